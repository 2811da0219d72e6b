/* Causal attention of a prefill chunk over its keys, with bf16 dot products (AVX512-BF16).
 *
 *   q   [n, heads, D] fp32: the chunk's queries, the last n positions of the keys
 *   k,v [L, kv_heads, D] fp32: cached context first, then the chunk's own keys
 *   out [n, heads, D]: query i sees keys 0 .. L - n + i (a bottom-right causal mask)
 *
 * q, k, p (the softmax weights) and v are rounded to bf16 (nearest even); scores, softmax and
 * sums stay fp32. vdpbf16ps does 32 multiply-adds an instruction, twice fp32 FMA's rate: on
 * this machine's cores torch's fp32 flash kernel runs at 55-130 GFLOP/s, its bf16 one no
 * faster, and this one at 170-200 (the README's "Prefill, later" has the figures).
 *
 * Layouts built per call (O(L * D), against the O(n * L * D) of the attention):
 *   kp [kv_heads][L / 16][D / 2][16]: 16 keys' (d, d + 1) bf16 pairs a vector, so one
 *       vdpbf16ps against a broadcast query pair adds to 16 scores at once
 *   vp [kv_heads][L / 2][D]: keys 2t and 2t + 1 paired per d, so one vdpbf16ps against a
 *       broadcast pair of softmax weights adds to 16 output dims at once
 * A work item is R query rows of one q head, flash style: blocks of 32 keys, a running max
 * and sum, the accumulators rescaled when the max moves (only by more than HEADROOM: most
 * blocks then skip the reduction and the rescale); scores in log2 units (q is scaled by
 * scale * log2(e)) and exp2.
 *
 * On a CPU with AVX2 and FMA but no AVX-512, prefill_attention_avx2.h does the same work in
 * fp32 (no bf16 rounding). With neither, the plain loops compute the bf16 kernel's roundings one
 * score at a time (the sums in another order: not the same bits), so tests run everywhere; the
 * engine calls this only where `prefill_attention_fast()` says a vector kernel is built, and
 * `prefill_attention_bf16()` says which roundings the build makes.
 */
#include "common.h"
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_BF16 1
#elif defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h> /* with AVX-512 but no BF16, torch's fp32 flash kernel runs 512 bits wide */
#define HAVE_F32X8 1
#endif

#define KEYS 32 /* keys a block */
#define HEADROOM 8.0f /* see rows_block */
#define LOG2E 1.44269504088896341f

static inline uint32_t bf16_bits(float x) { /* round to nearest even, as vcvtne2ps2bf16 */
    union { float f; uint32_t u; } b = {.f = x};
    return (b.u + 0x7FFFu + ((b.u >> 16) & 1u)) >> 16;
}

static inline float bf16_round(float x) {
    union { uint32_t u; float f; } b = {.u = bf16_bits(x) << 16};
    return b.f;
}

int prefill_attention_fast(void) {
#if defined(HAVE_BF16) || defined(HAVE_F32X8)
    return 1;
#else
    return 0;
#endif
}

#ifdef HAVE_F32X8
#include "prefill_attention_avx2.h"
int prefill_attention_bf16(void) { return 0; } /* fp32 throughout */
#else
int prefill_attention_bf16(void) { return 1; } /* q, k, the softmax weights and v rounded to bf16 */
#endif

#ifdef HAVE_BF16
/* One fp32 row of D values -> D / 2 bf16 pairs (d, d + 1), in order. */
static inline void pairs_row(const float *x, int64_t d, float mul, uint32_t *out) {
    __m512 m = _mm512_set1_ps(mul);
    for (int64_t i = 0; i < d; i += 32) {
        __m512bh b = _mm512_cvtne2ps_pbh(_mm512_mul_ps(_mm512_loadu_ps(x + i + 16), m),
                                         _mm512_mul_ps(_mm512_loadu_ps(x + i), m));
        _mm512_storeu_si512(out + i / 2, (__m512i)b);
    }
}

/* Rows 2t and 2t + 1 of v (a NULL b: zeros) -> [D] pairs (a[d], b[d]). */
static inline void interleave_rows(const float *a, const float *b, int64_t d, uint32_t *out) {
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int64_t i = 0; i < d; i += 16) {
        __m512 hi = b ? _mm512_loadu_ps(b + i) : _mm512_setzero_ps();
        __m512i both = (__m512i)_mm512_cvtne2ps_pbh(hi, _mm512_loadu_ps(a + i)); /* a 0..15 | b 0..15 */
        _mm512_storeu_si512(out + i, _mm512_permutexvar_epi16(idx, both));
    }
}

/* R query rows (pairs in qp, each row's last visible key in lim) against keys 0 .. lim[R - 1];
 * DV = D / 16. Writes the R rows of out (row stride out_stride) that `rows` says are real. */
static inline __attribute__((always_inline)) void rows_block(const uint32_t *const *qp, const int64_t *lim, int rows,
                                                              const uint32_t *kp, const uint32_t *vp, int R, int DV,
                                                              float *out, int64_t out_stride) {
    const int64_t pairs = DV * 8;
    __m512 acc[4][8], l[4];
    float m[4];
    uint32_t pw[4][KEYS / 2];
    for (int r = 0; r < 4; r++) {
        m[r] = -INFINITY;
        l[r] = _mm512_setzero_ps();
        for (int c = 0; c < DV; c++) acc[r][c] = _mm512_setzero_ps();
    }
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    for (int64_t kb = 0; kb <= lim[R - 1]; kb += KEYS) {
        __m512 s[4][2];
        for (int r = 0; r < R; r++) s[r][0] = s[r][1] = _mm512_setzero_ps();
        const uint32_t *k0 = kp + (kb / 16) * pairs * 16, *k1 = k0 + pairs * 16;
        for (int64_t p = 0; p < pairs; p++) {
            __m512bh a = (__m512bh)_mm512_loadu_si512(k0 + p * 16), b = (__m512bh)_mm512_loadu_si512(k1 + p * 16);
            for (int r = 0; r < R; r++) {
                __m512bh qb = (__m512bh)_mm512_set1_epi32((int)qp[r][p]);
                s[r][0] = dpbf16(s[r][0], qb, a);
                s[r][1] = dpbf16(s[r][1], qb, b);
            }
        }
        const int whole = kb + KEYS - 1 <= lim[0]; /* every row sees every key of the block */
        for (int r = 0; r < R; r++) {
            __mmask16 ok0 = 0xFFFF, ok1 = 0xFFFF;
            __m512 s0 = s[r][0], s1 = s[r][1];
            if (!whole) {
                __m512i first = _mm512_add_epi32(lane, _mm512_set1_epi32((int)kb)), last = _mm512_set1_epi32((int)lim[r]);
                ok0 = _mm512_cmple_epi32_mask(first, last);
                ok1 = _mm512_cmple_epi32_mask(_mm512_add_epi32(first, _mm512_set1_epi32(16)), last);
                s0 = _mm512_mask_mov_ps(ninf, ok0, s0);
                s1 = _mm512_mask_mov_ps(ninf, ok1, s1);
            }
            /* The running max moves only when a score passes it by more than HEADROOM (log2
             * units): the weights then stay <= 2^HEADROOM, and most blocks skip the reduction
             * and the rescale. (Key 0 is in every row's first block, so m is finite after it.) */
            __m512 mx = _mm512_max_ps(s0, s1);
            if (_mm512_cmp_ps_mask(mx, _mm512_set1_ps(m[r] + HEADROOM), _CMP_GT_OQ)) {
                float m_new = _mm512_reduce_max_ps(mx);
                m_new = m_new > m[r] ? m_new : m[r];
                __m512 al = _mm512_set1_ps(exp_approx((m[r] - m_new) * 0.69314718f));
                m[r] = m_new;
                l[r] = _mm512_mul_ps(l[r], al);
                for (int c = 0; c < DV; c++) acc[r][c] = _mm512_mul_ps(acc[r][c], al);
            }
            __m512 mr = _mm512_set1_ps(m[r]);
            __m512 p0 = _mm512_maskz_mov_ps(ok0, exp2_ps(_mm512_sub_ps(s0, mr)));
            __m512 p1 = _mm512_maskz_mov_ps(ok1, exp2_ps(_mm512_sub_ps(s1, mr)));
            l[r] = _mm512_add_ps(l[r], _mm512_add_ps(p0, p1));
            _mm512_storeu_si512(pw[r], (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
        }
        const uint32_t *vrow = vp + (kb / 2) * DV * 16;
        for (int t = 0; t < KEYS / 2; t++, vrow += DV * 16) {
            __m512bh vv[8];
            for (int c = 0; c < DV; c++) vv[c] = (__m512bh)_mm512_loadu_si512(vrow + c * 16);
            for (int r = 0; r < R; r++) {
                __m512bh pb = (__m512bh)_mm512_set1_epi32((int)pw[r][t]);
                for (int c = 0; c < DV; c++) acc[r][c] = dpbf16(acc[r][c], pb, vv[c]);
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(l[r]));
        for (int c = 0; c < DV; c++) _mm512_storeu_ps(out + r * out_stride + c * 16, _mm512_mul_ps(acc[r][c], inv));
    }
}
#endif

#if !defined(HAVE_BF16) && !defined(HAVE_F32X8)
/* The plain loops: one query row, scores kept whole in `scores` [L]. */
static void plain_row(const float *q, const float *k, const float *v, int64_t lim, int64_t kv_stride, int64_t d,
                      float mul, float *scores, float *out) {
    float qb[512], mx = -INFINITY, total = 0.0f;
    for (int64_t i = 0; i < d; i++) qb[i] = bf16_round(q[i] * mul);
    for (int64_t j = 0; j <= lim; j++) {
        float s = 0.0f;
        for (int64_t i = 0; i < d; i++) s += qb[i] * bf16_round(k[j * kv_stride + i]);
        scores[j] = s;
        mx = s > mx ? s : mx;
    }
    for (int64_t i = 0; i < d; i++) out[i] = 0.0f;
    for (int64_t j = 0; j <= lim; j++) {
        float p = exp_approx((scores[j] - mx) * 0.69314718f);
        total += p;
        float pb = bf16_round(p);
        for (int64_t i = 0; i < d; i++) out[i] += pb * bf16_round(v[j * kv_stride + i]);
    }
    for (int64_t i = 0; i < d; i++) out[i] /= total;
}
#endif

/* Returns 0; -1 when scratch cannot be allocated; -2 when D is not 32, 64 or 128, or heads is
 * not a multiple of kv_heads (out untouched). */
int prefill_attention(const float *q, int64_t n, const float *k, const float *v, int64_t L, int64_t heads,
                      int64_t kv_heads, int64_t d, float scale, int64_t threads, float *out) {
    if ((d != 32 && d != 64 && d != 128) || kv_heads <= 0 || heads % kv_heads != 0 || n > L)
        return -2;
    int64_t group = heads / kv_heads, team = threads > 0 ? threads : 1, ctx = L - n;
    float mul = scale * LOG2E;
#ifdef HAVE_BF16
    int R = d <= 64 ? 4 : 2, DV = (int)(d / 16);
    int64_t lpad = (L + KEYS - 1) / KEYS * KEYS, pairs = d / 2;
    uint32_t *kp = malloc(kv_heads * lpad * pairs * sizeof(uint32_t));
    uint32_t *vp = malloc(kv_heads * lpad * pairs * sizeof(uint32_t));
    uint32_t *qp = malloc(n * heads * pairs * sizeof(uint32_t));
    if (!kp || !vp || !qp) {
        free(kp);
        free(vp);
        free(qp);
        return -1;
    }
    int64_t blocks16 = lpad / 16;
#pragma omp parallel num_threads(team)
    {
        uint32_t row[64];
#pragma omp for schedule(static) nowait
        for (int64_t it = 0; it < kv_heads * blocks16; it++) { /* keys: 16 rows, transposed */
            int64_t h = it / blocks16, b = it % blocks16;
            uint32_t *dst = kp + (h * blocks16 + b) * pairs * 16;
            for (int64_t j = 0; j < 16; j++) {
                int64_t key = b * 16 + j;
                if (key < L)
                    pairs_row(k + (key * kv_heads + h) * d, d, 1.0f, row);
                else
                    memset(row, 0, sizeof(row));
                for (int64_t p = 0; p < pairs; p++) dst[p * 16 + j] = row[p];
            }
        }
#pragma omp for schedule(static) nowait
        for (int64_t it = 0; it < kv_heads * (lpad / 2); it++) { /* values: pairs of rows */
            int64_t h = it / (lpad / 2), t = it % (lpad / 2), a = 2 * t, b = a + 1;
            uint32_t *dst = vp + it * d;
            if (a >= L)
                memset(dst, 0, d * sizeof(uint32_t));
            else
                interleave_rows(v + (a * kv_heads + h) * d, b < L ? v + (b * kv_heads + h) * d : NULL, d, dst);
        }
#pragma omp for schedule(static)
        for (int64_t it = 0; it < n * heads; it++) pairs_row(q + it * d, d, mul, qp + it * pairs);
        int64_t row_blocks = (n + R - 1) / R;
        /* Heaviest blocks (the last rows see the most keys) first. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < heads * row_blocks; it++) {
            int64_t h = it % heads, r0 = (row_blocks - 1 - it / heads) * R, hk = h / group;
            int rows = (int)(n - r0 < R ? n - r0 : R);
            const uint32_t *rq[4];
            int64_t lim[4];
            for (int r = 0; r < R; r++) {
                int64_t i = r0 + (r < rows ? r : rows - 1);
                rq[r] = qp + (i * heads + h) * pairs;
                lim[r] = ctx + i;
            }
            const uint32_t *khead = kp + hk * blocks16 * pairs * 16, *vhead = vp + hk * (lpad / 2) * d;
            float *o = out + (r0 * heads + h) * d;
            if (DV == 4)
                rows_block(rq, lim, rows, khead, vhead, 4, 4, o, heads * d);
            else if (DV == 2)
                rows_block(rq, lim, rows, khead, vhead, 4, 2, o, heads * d);
            else
                rows_block(rq, lim, rows, khead, vhead, 2, 8, o, heads * d);
        }
    }
    free(kp);
    free(vp);
    free(qp);
    return 0;
#elif defined(HAVE_F32X8)
    (void)group, (void)ctx; /* it takes them per tile */
    return prefill_attention_avx2(q, n, k, v, L, heads, kv_heads, d, mul, team, out);
#else
    float *scores = malloc(team * L * sizeof(float));
    if (!scores)
        return -1;
#pragma omp parallel for num_threads(team) schedule(dynamic, 1)
    for (int64_t it = 0; it < n * heads; it++) {
#ifdef _OPENMP
        float *sc = scores + omp_get_thread_num() * L;
#else
        float *sc = scores;
#endif
        int64_t i = it / heads, h = it % heads;
        plain_row(q + it * d, k + (h / group) * d, v + (h / group) * d, ctx + i, kv_heads * d, d, mul, sc,
                  out + it * d);
    }
    free(scores);
    return 0;
#endif
}
