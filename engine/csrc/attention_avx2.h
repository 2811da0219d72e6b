/* Decode attention's two inner loops (attention.c) on a CPU with AVX2 and FMA but no AVX-512,
 * where they had run as plain loops: a head's dot with each key alone, then a read-modify-write
 * of the head's sums in memory for each value. Here the scores take 8 keys at a time, their
 * sums reduced together, and the value sums run as register tiles of 16 dims for up to 4 heads
 * of a GQA group, each value vector loaded once for all of them. fp32 caches, or int8 rows
 * (head_dim codes, then their fp32 scale) converted as they are read. */
#ifndef TANDEM_ATTENTION_AVX2_H
#define TANDEM_ATTENTION_AVX2_H
/* SEGMENT: the most keys of one work item (attention.c) */
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define AVX2_ATTENTION 1
#include <immintrin.h>

/* 8 values at base + off (in elements: floats, or int8 codes where `coded`) as floats. */
static inline __attribute__((always_inline)) __m256 load8(const void *base, int64_t off, int coded) {
    return coded ? _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)base + off))))
                 : _mm256_loadu_ps((const float *)base + off);
}

/* The 8 sums of 8 vectors, in order, in one vector. */
static inline __m256 sum8(const __m256 v[8]) {
    __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
    __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3); /* lanes: keys 0-3 | 4-7, halves */
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* q . k_j for 8 keys of one kv head, key j at kg + off[j] (unscaled codes where `coded`). */
static inline __attribute__((always_inline)) __m256 dots8(const float *q, const void *kg, const int64_t *off,
                                                          int coded, int64_t head_dim) {
    __m256 acc[8];
    for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < head_dim; d += 8) {
        __m256 qd = _mm256_loadu_ps(q + d);
        for (int j = 0; j < 8; j++) acc[j] = _mm256_fmadd_ps(qd, load8(kg, off[j] + d, coded), acc[j]);
    }
    return sum8(acc);
}

/* scores[h * SEGMENT + j] = q_h . k_j * scale (times the key's scale where `coded`) for every
 * query head and the n (<= SEGMENT) keys at `slot`; head_dim a multiple of 8. */
static void avx2_scores(const float *q, const void *k_cache, int coded, const int64_t *slot, int64_t n, int64_t heads,
                        int64_t kv_heads, int64_t head_dim, float scale, float *scores) {
    int64_t group = heads / kv_heads, row = coded ? head_dim + 4 : head_dim, off[SEGMENT + 8];
    float kscale[SEGMENT + 8];
    for (int64_t j = 0; j < n + 8; j++) off[j] = slot[j < n ? j : 0] * kv_heads * row; /* pad: key 0 */
    for (int64_t g = 0; g < kv_heads; g++) {
        const char *kg = (const char *)k_cache + g * row * (coded ? 1 : 4);
        for (int64_t j = 0; j < n + 8; j++) {
            float ks = 1.0f;
            if (coded) memcpy(&ks, kg + off[j] + head_dim, 4);
            kscale[j] = ks * scale;
        }
        for (int64_t h = g * group; h < (g + 1) * group; h++)
            for (int64_t j = 0; j < n; j += 8) {
                __m256 d = coded ? dots8(q + h * head_dim, kg, off + j, 1, head_dim)
                                 : dots8(q + h * head_dim, kg, off + j, 0, head_dim);
                float tmp[8];
                _mm256_storeu_ps(tmp, _mm256_mul_ps(d, _mm256_loadu_ps(kscale + j)));
                memcpy(scores + h * SEGMENT + j, tmp, (n - j < 8 ? n - j : 8) * sizeof(float));
            }
    }
}

/* o[t] = sum_j p[t][j] v_j over 16 dims for nh (1-4) heads: p rows SEGMENT apart, v_j at
 * v + off[j] (codes times vscale[j] where `coded`), o rows head_dim apart. nh and coded are
 * constants where called, so the sums stay in registers. */
static inline __attribute__((always_inline)) void pv_tile8(const float *p, const void *v, const int64_t *off,
                                                           const float *vscale, int coded, int64_t n, int nh,
                                                           float *o, int64_t head_dim) {
    __m256 acc[4][2];
    for (int t = 0; t < 4; t++) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; j++) {
        __m256 v0 = load8(v, off[j], coded), v1 = load8(v, off[j] + 8, coded);
        for (int t = 0; t < nh; t++) {
            __m256 pt = _mm256_set1_ps(coded ? p[t * SEGMENT + j] * vscale[j] : p[t * SEGMENT + j]);
            acc[t][0] = _mm256_fmadd_ps(pt, v0, acc[t][0]);
            acc[t][1] = _mm256_fmadd_ps(pt, v1, acc[t][1]);
        }
    }
    for (int t = 0; t < nh; t++) {
        _mm256_storeu_ps(o + t * head_dim, acc[t][0]);
        _mm256_storeu_ps(o + t * head_dim + 8, acc[t][1]);
    }
}

/* o[h] = sum_j p[h][j] v_j for every query head, p = scores (rows SEGMENT apart), over the n
 * values at `slot`; head_dim a multiple of 16. */
static void avx2_values(const float *scores, const void *v_cache, int coded, const int64_t *slot, int64_t n,
                        int64_t heads, int64_t kv_heads, int64_t head_dim, float *o) {
    int64_t group = heads / kv_heads, row = coded ? head_dim + 4 : head_dim, off[SEGMENT];
    float vscale[SEGMENT];
    for (int64_t j = 0; j < n; j++) off[j] = slot[j] * kv_heads * row;
    for (int64_t g = 0; g < kv_heads; g++) {
        const char *vg = (const char *)v_cache + g * row * (coded ? 1 : 4);
        if (coded)
            for (int64_t j = 0; j < n; j++) memcpy(vscale + j, vg + off[j] + head_dim, 4);
        for (int64_t c = 0; c < head_dim; c += 16)
            for (int64_t h = g * group; h < (g + 1) * group; h += 4) {
                const float *sh = scores + h * SEGMENT;
                float *oh = o + h * head_dim + c;
                const void *vc = coded ? (const void *)(vg + c) : (const void *)((const float *)vg + c);
#define PV8(NH) (coded ? pv_tile8(sh, vc, off, vscale, 1, n, NH, oh, head_dim) \
                       : pv_tile8(sh, vc, off, NULL, 0, n, NH, oh, head_dim))
                switch ((g + 1) * group - h) {
                case 1: PV8(1); break;
                case 2: PV8(2); break;
                case 3: PV8(3); break;
                default: PV8(4); break;
                }
#undef PV8
            }
    }
}
#endif
#endif
