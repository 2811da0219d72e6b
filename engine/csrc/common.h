/* What the C files of engine/csrc share: exp, sums and maxima that gcc vectorizes, and the
 * dot-product instructions as in-place accumulators. */
#ifndef TANDEM_COMMON_H
#define TANDEM_COMMON_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>
/* acc += a . b, in place, for the dot-product instructions that accumulate. gcc 12's intrinsics
 * for them (_mm512_dpbusd_epi32 and its kin) moved every accumulator to another register, and
 * some through the stack, on each iteration of a kernel's inner loop; as asm the accumulators
 * stay put. Same instruction, same bits. Same process, alternated: SmolLM2's projections at 8
 * rows 10.1 -> 8.5 ms, 64 rows 41.7 -> 37.4, 512 rows 275 -> 258; in the engine (int8) a
 * 512-token prefill 312 -> 268 and 327 -> 302 ms (two runs), decode steps 1-3% faster. */
#define TANDEM_DP(name, insn, acc_t, in_t)                                                           \
    static inline __attribute__((always_inline)) acc_t name(acc_t acc, in_t a, in_t b) {             \
        __asm__(insn " %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));                                    \
        return acc;                                                                                  \
    }
#if defined(__AVX512VNNI__)
TANDEM_DP(dpbusd, "vpdpbusd", __m512i, __m512i) /* u8 a x s8 b, 4 products a lane */
TANDEM_DP(dpwssd, "vpdpwssd", __m512i, __m512i) /* s16 x s16, 2 products a lane */
#endif
#if defined(__AVX512BF16__)
TANDEM_DP(dpbf16, "vdpbf16ps", __m512, __m512bh) /* bf16 pairs into fp32 */
#endif
/* 2^x for x <= 0, 16 lanes: 2^round(x) * p(x - round(x)), |rel. error| < 2e-7; below -126,
 * about 0 (the prefill attention kernels' softmax weights). */
static inline __m512 exp2_ps(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
    __m512 i = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(x, i);
    __m512 p = _mm512_set1_ps(1.5403530e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, i);
}
#endif

#define LANES 16

/* How a paged cache holds keys and values (engine/native.py's KV_KIND): fp32 as they are; int8
 * rows of head_dim codes, then their fp32 scale (engine/kv_codec.py); or bf16, the top half of
 * each fp32 (rounded to nearest even where written). */
enum { KV_FP32, KV_INT8, KV_BF16 };

/* Bytes of one kv head of one token in a cache of `kind`, and of one of its values. */
static inline int64_t kv_row_bytes(int64_t kind, int64_t head_dim) {
    return kind == KV_INT8 ? head_dim + 4 : head_dim * (kind == KV_BF16 ? 2 : 4);
}
static inline int64_t kv_elem_bytes(int64_t kind) { return kind == KV_INT8 ? 1 : kind == KV_BF16 ? 2 : 4; }

static inline float bf16_to_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* The cache lines of the `bytes` bytes at p, into L1 (hint T0) or L2 (T1). */
static inline void prefetch_bytes(const void *p, int64_t bytes, int hint_l2) {
    for (uintptr_t a = (uintptr_t)p & ~(uintptr_t)63; a < (uintptr_t)p + bytes; a += 64)
        hint_l2 ? __builtin_prefetch((const void *)a, 0, 2) : __builtin_prefetch((const void *)a, 0, 3);
}

/* exp(x) for x <= 0 or moderate x, as Cephes expf: 2^n * p(r), |error| ~1 ulp; branch-free so
 * that loops over it vectorize. */
static inline float exp_approx(float x) {
    x = x < -87.3f ? -87.3f : x;
    x = x > 88.3f ? 88.3f : x;
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { int32_t i; float f; } scale = {.i = ((int32_t)n + 127) << 23};
    return p * scale.f;
}

#if defined(__AVX512F__)
/* exp_approx on 16 lanes, op for op: the same bits (silu_mul's, in decode.c). */
static inline __m512 exp_approx_ps(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-87.3f), x); /* c > x ? c : x, as the scalar's clamps */
    x = _mm512_min_ps(_mm512_set1_ps(88.3f), x);
    __m512 n = _mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _mm512_set1_ps(0.5f));
    n = _mm512_roundscale_ps(n, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f)));
    r = _mm512_sub_ps(r, _mm512_mul_ps(n, _mm512_set1_ps(-2.12194440e-4f)));
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(p, r), r), r), _mm512_set1_ps(1.0f));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}
#endif

static inline float dot(const float *a, const float *b, int n) {
    float acc[LANES] = {0};
    int i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += a[i + l] * b[i + l];
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int l = 0; l < w; l++) acc[l] += acc[l + w];
    float s = acc[0];
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

static inline float sum(const float *a, int64_t n) {
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += a[i + l];
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int l = 0; l < w; l++) acc[l] += acc[l + w];
    float s = acc[0];
    for (; i < n; i++) s += a[i];
    return s;
}

/* max |a_i|: a row's per-row int8 quantization scale is this / 127 (linear_i8.c, linear_q4.c) */
static inline float abs_max(const float *a, int64_t n) {
    float m = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        float v = fabsf(a[i]);
        m = v > m ? v : m;
    }
    return m;
}

static inline float max_of(const float *a, int64_t n) {
    float acc[LANES];
    for (int l = 0; l < LANES; l++) acc[l] = a[0];
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) acc[l] = a[i + l] > acc[l] ? a[i + l] : acc[l];
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int l = 0; l < w; l++) acc[l] = acc[l + w] > acc[l] ? acc[l + w] : acc[l];
    float m = acc[0];
    for (; i < n; i++) m = a[i] > m ? a[i] : m;
    return m;
}

#endif
