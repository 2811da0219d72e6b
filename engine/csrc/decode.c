/* The small ops of a decode step, fused: what costs a step most on the CPU is not the
 * arithmetic of these but the ~40 torch dispatches a layer they take (see engine/native.py).
 *
 * fp32 activations, plain loops that gcc vectorizes (-O3 -march=native), a row per thread where
 * there are many (a prefill's; engine/model.py runs prefills through these too). Built
 * with -ffp-contract=off, so a*b + c rounds twice as torch's separate ops do: RoPE and the
 * int8 KV codes are bit-identical to torch's; RMSNorm, SiLU and attention differ in the last
 * bits (their sums and exp run in another order and another polynomial, attention's with
 * fused multiply-adds).
 *
 * Layouts (all row-major, contiguous unless a stride is given):
 *   qkv      [rows, qkv_stride]: q heads, then k heads, then v heads, each head_dim wide
 *   cache    [slots, kv_heads, head_dim] of one layer (keys or values); slot = block * bs + i;
 *            int8: [slots, kv_heads, head_dim + 4] bytes, codes then the fp32 scale; bf16: 2 bytes each
 *   tables   [rows, table_stride] int64 block ids; lens [rows] int64 context, own token included
 */
#include "common.h"

/* Rows from which the ops below split them over `threads` OpenMP threads (a prefill's hundreds);
 * a decode step's few stay on the caller's thread, where a parallel region would cost more. */
#define PARALLEL_ROWS 32

/* out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w, each of `rows` rows `n` wide. With `delta`, x
 * first becomes x + delta, in place (the residual add before the norm). */
void rms_norm(float *x, const float *delta, const float *w, float *out, int64_t rows, int64_t n, float eps,
              int64_t threads) {
#pragma omp parallel for num_threads(threads > 0 ? threads : 1) if (rows >= PARALLEL_ROWS) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float *xr = x + r * n;
        if (delta) {
            const float *dr = delta + r * n;
            for (int64_t i = 0; i < n; i++) xr[i] += dr[i];
        }
        float inv = 1.0f / sqrtf(dot(xr, xr, (int)n) / (float)n + eps);
        float *o = out + r * n;
        for (int64_t i = 0; i < n; i++) o[i] = w[i] * (xr[i] * inv);
    }
}

/* out[r] = silu(gu[r, :n]) * gu[r, n:], gu [rows, 2n]. With AVX-512, 16 lanes at a time by
 * exp_approx_ps: gcc's own vectorization of the scalar line split exp's clamp into a second
 * division a vector, and the divisions were most of the op's time (0.62 ns an element at 512
 * rows on 2 threads). Same bits either way. */
void silu_mul(const float *gu, float *out, int64_t rows, int64_t n, int64_t threads) {
#pragma omp parallel for num_threads(threads > 0 ? threads : 1) if (rows >= PARALLEL_ROWS) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gu + r * 2 * n, *u = g + n;
        float *o = out + r * n;
        int64_t i = 0;
#if defined(__AVX512F__)
        for (; i + 16 <= n; i += 16) {
            __m512 gv = _mm512_loadu_ps(g + i);
            __m512 e = exp_approx_ps(_mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(gv), _mm512_set1_epi32(INT32_MIN))));
            __m512 sv = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
            _mm512_storeu_ps(o + i, _mm512_mul_ps(sv, _mm512_loadu_ps(u + i)));
        }
#endif
        for (; i < n; i++) o[i] = g[i] / (1.0f + exp_approx(-g[i])) * u[i];
    }
}

/* kv heads of one token into an int8 cache row each: head_dim codes round(x / scale), then the
 * fp32 scale = max(max|x|, 1e-12) / 127, as engine/kv_codec.py codes them (same bits). */
static void code_int8(const float *x, int64_t kv_heads, int64_t head_dim, int8_t *dst) {
    for (int64_t g = 0; g < kv_heads; g++, x += head_dim, dst += head_dim + 4) {
        float amax = 0.0f;
        for (int64_t i = 0; i < head_dim; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
        float scale = (amax > 1e-12f ? amax : 1e-12f) / 127.0f;
        for (int64_t i = 0; i < head_dim; i++) dst[i] = (int8_t)nearbyintf(x[i] / scale);
        memcpy(dst + head_dim, &scale, 4);
    }
}

/* n floats as bf16, each rounded to nearest even as torch's conversion rounds it (a NaN to a NaN). */
static void to_bf16(const float *x, int64_t n, uint16_t *dst) {
    for (int64_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, x + i, 4);
        dst[i] = (u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0 : (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    }
}

/* RoPE (HF's rotate_half form) on the q and k heads of each row of qkv, in place, then the row's
 * k and v heads written into the caches at slots[r] as `kv_kind` stores them (common.h): as
 * they are, coded into int8 rows of head_dim + 4 bytes, or rounded to bf16. cos, sin:
 * [positions, head_dim]; sin carries rotate_half's sign (-sin on the first half). */
void rope_write(float *qkv, int64_t rows, int64_t qkv_stride, int64_t heads, int64_t kv_heads, int64_t head_dim,
                const int64_t *positions, const float *cos, const float *sin, const int64_t *slots, void *k_cache,
                void *v_cache, int64_t kv_kind, int64_t threads) {
    int64_t half = head_dim / 2, kv_width = kv_heads * head_dim, coded_width = kv_heads * (head_dim + 4);
#pragma omp parallel for num_threads(threads > 0 ? threads : 1) if (rows >= PARALLEL_ROWS) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float tmp[512];
        float *row = qkv + r * qkv_stride;
        const float *c = cos + positions[r] * head_dim, *s = sin + positions[r] * head_dim;
        for (int64_t h = 0; h < heads + kv_heads; h++) {
            float *x = row + h * head_dim;
            for (int64_t i = 0; i < half; i++) {
                tmp[i] = x[i + half] * s[i];
                tmp[i + half] = x[i] * s[i + half];
            }
            for (int64_t i = 0; i < head_dim; i++) x[i] = x[i] * c[i] + tmp[i];
        }
        const float *k = row + heads * head_dim, *v = k + kv_width;
        if (kv_kind == KV_INT8) {
            code_int8(k, kv_heads, head_dim, (int8_t *)k_cache + slots[r] * coded_width);
            code_int8(v, kv_heads, head_dim, (int8_t *)v_cache + slots[r] * coded_width);
        } else if (kv_kind == KV_BF16) {
            to_bf16(k, kv_width, (uint16_t *)k_cache + slots[r] * kv_width);
            to_bf16(v, kv_width, (uint16_t *)v_cache + slots[r] * kv_width);
        } else {
            memcpy((float *)k_cache + slots[r] * kv_width, k, kv_width * sizeof(float));
            memcpy((float *)v_cache + slots[r] * kv_width, v, kv_width * sizeof(float));
        }
    }
}
