/* Decode attention's two inner loops (attention.c) on a CPU with AVX-512: the scores take 16
 * keys at a time, their sums reduced together (sum16), and the value sums run as register
 * tiles of 64 dims for up to 4 heads of a GQA group, each value vector loaded once for all of
 * them. fp32 caches, or bf16 ones or int8 rows (head_dim codes, then their fp32 scale) converted
 * as they are read. */
#ifndef TANDEM_ATTENTION_AVX512_H
#define TANDEM_ATTENTION_AVX512_H
/* SEGMENT: the most keys of one work item (attention.c) */
#ifdef __AVX512F__
#include <immintrin.h>

/* The 16 values of a cache of `kind` (common.h) at p, as floats. */
static inline __attribute__((always_inline)) __m512 load16(const char *p, int kind) {
    if (kind == KV_INT8)
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    if (kind == KV_BF16)
        return _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
    return _mm512_loadu_ps((const float *)p);
}

/* o[t] = sum_j p[t][j] v_j over 64 dims, for `nh` (1-4) query heads that share one kv head:
 * each value vector is loaded once for all of them, and the sums stay in registers. p: scores
 * rows SEGMENT apart; v_j at v + off[j] bytes in a cache of `kind` (int8 codes times vscale[j]);
 * o rows head_dim apart. nh and kind are constants where called. */
static inline __attribute__((always_inline)) void pv_tile(const float *p, const char *v, const int64_t *off,
                                                          const float *vscale, int kind, int64_t n, int nh,
                                                          float *o, int64_t head_dim) {
    __m512 acc[4][4];
    for (int t = 0; t < 4; t++)
        for (int c = 0; c < 4; c++) acc[t][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j++) {
        __m512 vv[4];
        for (int c = 0; c < 4; c++) vv[c] = load16(v + off[j] + 16 * c * kv_elem_bytes(kind), kind);
        for (int t = 0; t < nh; t++) {
            __m512 pt = _mm512_set1_ps(kind == KV_INT8 ? p[t * SEGMENT + j] * vscale[j] : p[t * SEGMENT + j]);
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

/* q . k_j for 16 keys of one kv head of a cache of `kind` (key j at k + off[j] bytes; int8 codes
 * unscaled), head_dim a multiple of 16. */
static inline __attribute__((always_inline)) __m512 dots16(const float *q, const char *k, const int64_t *off,
                                                           int kind, int64_t head_dim) {
    __m512 acc[16];
    for (int j = 0; j < 16; j++) acc[j] = _mm512_setzero_ps();
    for (int64_t d = 0; d < head_dim; d += 16) {
        __m512 qd = _mm512_loadu_ps(q + d);
        for (int j = 0; j < 16; j++)
            acc[j] = _mm512_fmadd_ps(qd, load16(k + off[j] + d * kv_elem_bytes(kind), kind), acc[j]);
    }
    return sum16(acc);
}
#endif
#endif
