/* Decode attention's two inner loops (attention.c) on a CPU with AVX2 and FMA but no AVX-512,
 * where they had run as plain loops: a head's dot with each key alone, then a read-modify-write
 * of the head's sums in memory for each value. Here the scores take 8 keys at a time, their
 * sums reduced together (each block of keys for every head of its GQA group while it is in L1),
 * and the value sums run as register tiles of up to 64 dims for up to 4 heads of a group, each
 * value vector loaded once for all of them. Both prefetch the rows PF keys ahead. fp32 caches,
 * bf16 ones, or int8 rows (head_dim codes, then their fp32 scale), the last two converted as they
 * are read (int8 where attention_int8_avx2.h's integer sums do not take it: head_dim not a
 * multiple of 64). The softmax between them runs here too, 8 lanes wide. */
#ifndef TANDEM_ATTENTION_AVX2_H
#define TANDEM_ATTENTION_AVX2_H
/* SEGMENT: the most keys of one work item (attention.c) */
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define AVX2_ATTENTION 1
#define PF 8 /* keys ahead that the loops prefetch: the loads of a step's cold cache had stalled */
#include <immintrin.h>

/* The 8 values of a cache of `kind` (common.h) at p, as floats. */
static inline __attribute__((always_inline)) __m256 load8(const char *p, int kind) {
    if (kind == KV_INT8)
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
    if (kind == KV_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
    return _mm256_loadu_ps((const float *)p);
}

/* The 8 sums of 8 vectors, in order, in one vector. */
static inline __m256 sum8(const __m256 v[8]) {
    __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
    __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3); /* lanes: keys 0-3 | 4-7, halves */
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* 16 bf16 at p as floats without a widening shuffle: *even the 8 of even index (0, 2, .. 14: each
 * 32-bit lane's low half shifted up), *odd the 8 of odd index (the high halves, masked). */
static inline __attribute__((always_inline)) void load_bf16_pairs(const char *p, __m256 *even, __m256 *odd) {
    __m256i raw = _mm256_loadu_si256((const __m256i *)p);
    *even = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
    *odd = _mm256_and_ps(_mm256_castsi256_ps(raw), _mm256_castsi256_ps(_mm256_set1_epi32((int)0xFFFF0000u)));
}

/* q . k_j for 8 keys of one kv head of a cache of `kind`, key j at kg + off[j] bytes (unscaled
 * codes for int8; bf16 only where head_dim is not a multiple of 16: attention_bf16_avx2.h takes
 * the rest). */
static inline __attribute__((always_inline)) __m256 dots8(const float *q, const char *kg, const int64_t *off,
                                                          int kind, int64_t head_dim) {
    __m256 acc[8];
    for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < head_dim; d += 8) {
        __m256 qd = _mm256_loadu_ps(q + d);
        for (int j = 0; j < 8; j++)
            acc[j] = _mm256_fmadd_ps(qd, load8(kg + off[j] + d * kv_elem_bytes(kind), kind), acc[j]);
    }
    return sum8(acc);
}

/* scores[h * SEGMENT + j] = q_h . k_j * scale (times the key's scale for int8) for every query
 * head and the n (<= SEGMENT) keys at `slot` of a cache of `kind`; head_dim a multiple of 8. */
static void avx2_scores(const float *q, const void *k_cache, int kind, const int64_t *slot, int64_t n, int64_t heads,
                        int64_t kv_heads, int64_t head_dim, float scale, float *scores) {
    int64_t group = heads / kv_heads, row = kv_row_bytes(kind, head_dim), off[SEGMENT + 8];
    float kscale[SEGMENT + 8];
    for (int64_t j = 0; j < n + 8; j++) off[j] = slot[j < n ? j : 0] * kv_heads * row; /* bytes; pad: key 0 */
    for (int64_t g = 0; g < kv_heads; g++) {
        const char *kg = (const char *)k_cache + g * row;
        for (int64_t j = 0; j < n + 8; j++) {
            float ks = 1.0f;
            if (kind == KV_INT8) memcpy(&ks, kg + off[j] + head_dim, 4);
            kscale[j] = ks * scale;
        }
        for (int64_t i = 0; i < PF && i < n; i++) /* the first PF keys: the loop's prefetch starts PF on */
            for (int64_t b = 0; b < row; b += 64) _mm_prefetch(kg + off[i] + b, _MM_HINT_T0);
        for (int64_t j = 0; j < n; j += 8) { /* 8 keys (2 KB at D 64) stay in L1 for every head of the group */
            for (int64_t i = j + PF; i < j + PF + 8 && i < n; i++) /* the 8 keys PF ahead */
                for (int64_t b = 0; b < row; b += 64) _mm_prefetch(kg + off[i] + b, _MM_HINT_T0);
            for (int64_t h = g * group; h < (g + 1) * group; h++) {
                __m256 d = kind == KV_INT8   ? dots8(q + h * head_dim, kg, off + j, KV_INT8, head_dim)
                           : kind == KV_BF16 ? dots8(q + h * head_dim, kg, off + j, KV_BF16, head_dim)
                                             : dots8(q + h * head_dim, kg, off + j, KV_FP32, head_dim);
                float tmp[8];
                _mm256_storeu_ps(tmp, _mm256_mul_ps(d, _mm256_loadu_ps(kscale + j)));
                memcpy(scores + h * SEGMENT + j, tmp, (n - j < 8 ? n - j : 8) * sizeof(float));
            }
        }
    }
}

/* common.h's exp_approx on 8 lanes, op for op (the same bits): gcc's vectorization of it for
 * Zen 1 (znver1 prefers 128-bit vectors) had made the softmax a fifth of a segment's time. */
static inline __m256 exp_approx8(__m256 x) {
    x = _mm256_min_ps(_mm256_set1_ps(88.3f), _mm256_max_ps(_mm256_set1_ps(-87.3f), x)); /* NaN stays NaN */
    __m256 n = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
    n = _mm256_floor_ps(_mm256_add_ps(n, _mm256_set1_ps(0.5f)));
    __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
    r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    static const float c[5] = {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f,
                               5.0000001201e-1f};
    for (int i = 0; i < 5; i++) p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(c[i]));
    p = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(p, r), r), r), _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* s[j] = exp(s[j] - max) for a row of n scores; *mx = the max, *total = the sum, both as
 * common.h's max_of and sum compute them (the sum in 16 lanes, then halves, then the tail). */
static inline void avx2_softmax_row(float *s, int64_t n, float *mx, float *total) {
    float top = max_of(s, n);
    const __m256 m = _mm256_set1_ps(top);
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        __m256 a = exp_approx8(_mm256_sub_ps(_mm256_loadu_ps(s + j), m));
        __m256 b = exp_approx8(_mm256_sub_ps(_mm256_loadu_ps(s + j + 8), m));
        _mm256_storeu_ps(s + j, a);
        _mm256_storeu_ps(s + j + 8, b);
        lo = _mm256_add_ps(lo, a);
        hi = _mm256_add_ps(hi, b);
    }
    __m256 h8 = _mm256_add_ps(lo, hi);
    __m128 h4 = _mm_add_ps(_mm256_castps256_ps128(h8), _mm256_extractf128_ps(h8, 1));
    __m128 h2 = _mm_add_ps(h4, _mm_movehl_ps(h4, h4));
    float sum_ = _mm_cvtss_f32(_mm_add_ss(h2, _mm_shuffle_ps(h2, h2, 1)));
    for (; j < n; j++) {
        s[j] = exp_approx(s[j] - top);
        sum_ += s[j];
    }
    *mx = top;
    *total = sum_;
}

/* o[t] = sum_j p[t][j] v_j over 8 x w dims for nh (1-4) heads: p rows SEGMENT apart, v_j at
 * v + off[j] bytes in a cache of `kind` (codes times vscale[j] for int8), o rows head_dim apart.
 * nh, w and kind are constants where called (nh x w <= 12), so the sums stay in registers; each
 * value row is read in as few passes as they allow (one at nh 1: at 4 passes a row, the loads
 * missed). */
static inline __attribute__((always_inline)) void pv_tile8(const float *p, const char *v, const int64_t *off,
                                                           const float *vscale, int kind, int64_t n, int nh, int w,
                                                           float *o, int64_t head_dim) {
    __m256 acc[4][8];
    for (int t = 0; t < nh; t++)
        for (int c = 0; c < w; c++) acc[t][c] = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; j++) {
        __m256 vv[8];
        for (int b = 0; b < 8 * w * kv_elem_bytes(kind); b += 64) /* the row PF keys ahead (off is padded) */
            _mm_prefetch(v + off[j + PF] + b, _MM_HINT_T0);
        for (int c = 0; c < w; c++)
            if (kind != KV_BF16)
                vv[c] = load8(v + off[j] + 8 * c * kv_elem_bytes(kind), kind);
            else if (c % 2 == 0) /* 16 dims: their even ones in vv[c], odd in vv[c + 1] */
                load_bf16_pairs(v + off[j] + 16 * c, vv + c, vv + c + 1);
        for (int t = 0; t < nh; t++) {
            __m256 pt = _mm256_set1_ps(kind == KV_INT8 ? p[t * SEGMENT + j] * vscale[j] : p[t * SEGMENT + j]);
            for (int c = 0; c < w; c++) acc[t][c] = _mm256_fmadd_ps(pt, vv[c], acc[t][c]);
        }
    }
    for (int t = 0; t < nh; t++)
        for (int c = 0; c < w; c++)
            if (kind != KV_BF16)
                _mm256_storeu_ps(o + t * head_dim + 8 * c, acc[t][c]);
            else if (c % 2 == 0) { /* even and odd dims back in order */
                __m256 lo = _mm256_unpacklo_ps(acc[t][c], acc[t][c + 1]);
                __m256 hi = _mm256_unpackhi_ps(acc[t][c], acc[t][c + 1]);
                _mm256_storeu_ps(o + t * head_dim + 8 * c, _mm256_permute2f128_ps(lo, hi, 0x20));
                _mm256_storeu_ps(o + t * head_dim + 8 * c + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
            }
}

/* o[h] = sum_j p[h][j] v_j for every query head, p = scores (rows SEGMENT apart), over the n
 * values at `slot` of a cache of `kind`; head_dim a multiple of 16. */
static void avx2_values(const float *scores, const void *v_cache, int kind, const int64_t *slot, int64_t n,
                        int64_t heads, int64_t kv_heads, int64_t head_dim, float *o) {
    int64_t group = heads / kv_heads, row = kv_row_bytes(kind, head_dim), off[SEGMENT + PF];
    float vscale[SEGMENT];
    for (int64_t j = 0; j < n + PF; j++) off[j] = slot[j < n ? j : n - 1] * kv_heads * row; /* bytes */
    for (int64_t g = 0; g < kv_heads; g++) {
        const char *vg = (const char *)v_cache + g * row;
        if (kind == KV_INT8)
            for (int64_t j = 0; j < n; j++) memcpy(vscale + j, vg + off[j] + head_dim, 4);
        for (int64_t h = g * group; h < (g + 1) * group; h += 4) {
            int64_t nh = (g + 1) * group - h < 4 ? (g + 1) * group - h : 4;
            /* dims a pass: 64 for one head, 32 for two or three, 16 for four (12 sums at most) */
            int64_t width = nh == 1 ? 64 : nh < 4 ? 32 : 16;
            width = head_dim % width == 0 ? width : 16;
            for (int64_t c = 0; c < head_dim; c += width) {
                const float *sh = scores + h * SEGMENT;
                float *oh = o + h * head_dim + c;
                const char *vc = vg + c * kv_elem_bytes(kind);
#define PV8(NH, W) (kind == KV_INT8   ? pv_tile8(sh, vc, off, vscale, KV_INT8, n, NH, W, oh, head_dim) \
                    : kind == KV_BF16 ? pv_tile8(sh, vc, off, NULL, KV_BF16, n, NH, W, oh, head_dim) \
                                      : pv_tile8(sh, vc, off, NULL, KV_FP32, n, NH, W, oh, head_dim))
                if (width == 16)
                    switch (nh) {
                    case 1: PV8(1, 2); break;
                    case 2: PV8(2, 2); break;
                    case 3: PV8(3, 2); break;
                    default: PV8(4, 2); break;
                    }
                else if (nh == 1)
                    PV8(1, 8);
                else if (nh == 2)
                    PV8(2, 4);
                else
                    PV8(3, 4);
#undef PV8
            }
        }
    }
}
#endif
#endif
