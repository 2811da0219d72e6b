/* Decode attention's two inner loops (attention.c) on a CPU with AVX-512: the scores take 16
 * keys at a time, their sums reduced together (sum16), and the value sums run as register
 * tiles of 64 dims for up to 4 heads of a GQA group, each value vector loaded once for all of
 * them. fp32 caches, or int8 rows (head_dim codes, then their fp32 scale) converted as they are
 * read. */
#ifndef TANDEM_ATTENTION_AVX512_H
#define TANDEM_ATTENTION_AVX512_H
/* SEGMENT: the most keys of one work item (attention.c) */
#ifdef __AVX512F__
#include <immintrin.h>

/* o[t] = sum_j p[t][j] v_j over 64 dims, for `nh` (1-4) query heads that share one kv head:
 * each value vector is loaded once for all of them, and the sums stay in registers. p: scores
 * rows SEGMENT apart; v_j at v + off[j], fp32, or int8 codes times vscale[j] where `coded`;
 * o rows head_dim apart. nh and coded are constants where called. */
static inline __attribute__((always_inline)) void pv_tile(const float *p, const void *v, const int64_t *off,
                                                          const float *vscale, int coded, int64_t n, int nh,
                                                          float *o, int64_t head_dim) {
    __m512 acc[4][4];
    for (int t = 0; t < 4; t++)
        for (int c = 0; c < 4; c++) acc[t][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j++) {
        __m512 vv[4];
        for (int c = 0; c < 4; c++)
            vv[c] = coded ? _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                _mm_loadu_si128((const __m128i *)((const int8_t *)v + off[j] + 16 * c))))
                          : _mm512_loadu_ps((const float *)v + off[j] + 16 * c);
        for (int t = 0; t < nh; t++) {
            __m512 pt = _mm512_set1_ps(coded ? p[t * SEGMENT + j] * vscale[j] : p[t * SEGMENT + j]);
            for (int c = 0; c < 4; c++) acc[t][c] = _mm512_fmadd_ps(pt, vv[c], acc[t][c]);
        }
    }
    for (int t = 0; t < nh; t++)
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(o + t * head_dim + 16 * c, acc[t][c]);
}

/* The 16 sums of 16 vectors, in order, in one vector: pairs, then quads within each 128-bit lane,
 * then across lanes (15 shuffles and adds where 16 horizontal sums take ~64). */
static inline __m512 sum16(const __m512 v[16]) {
    __m512 u[8], x[4];
    for (int i = 0; i < 8; i++)
        u[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++)
        x[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0xEE));
    __m512 y01 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x88), _mm512_shuffle_f32x4(x[0], x[1], 0xDD));
    __m512 y23 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], 0x88), _mm512_shuffle_f32x4(x[2], x[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(y01, y23, 0x88), _mm512_shuffle_f32x4(y01, y23, 0xDD));
}

/* q . k_j for 16 keys of one kv head (key j at k + off[j]: fp32, or int8 codes where `coded`,
 * unscaled), head_dim a multiple of 16. */
static inline __attribute__((always_inline)) __m512 dots16(const float *q, const void *k, const int64_t *off,
                                                           int coded, int64_t head_dim) {
    __m512 acc[16];
    for (int j = 0; j < 16; j++) acc[j] = _mm512_setzero_ps();
    for (int64_t d = 0; d < head_dim; d += 16) {
        __m512 qd = _mm512_loadu_ps(q + d);
        for (int j = 0; j < 16; j++) {
            __m512 kd = coded ? _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                    _mm_loadu_si128((const __m128i *)((const int8_t *)k + off[j] + d))))
                              : _mm512_loadu_ps((const float *)k + off[j] + d);
            acc[j] = _mm512_fmadd_ps(qd, kd, acc[j]);
        }
    }
    return sum16(acc);
}
#endif
#endif
