/* Decode attention's two inner loops (attention.c) on a CPU with AVX-512: the scores take 16
 * keys at a time, their sums reduced together (sum16), and the value sums run as register
 * tiles of 64 dims for up to 4 heads of a GQA group, each value vector loaded once for all of
 * them. fp32 caches, or int8 rows (head_dim codes, then their fp32 scale) converted as they are
 * read; bf16 ones split into even and odd dims (a shift, a mask: load_bf16_pairs16) against
 * queries split so beforehand, where widening each 16 values had taken two ops (30 layers of 8,000
 * keys from memory, a Zen 4 EPYC: 333 against 344 us a layer; 192 against 212 from L3). */
#ifndef TANDEM_ATTENTION_AVX512_H
#define TANDEM_ATTENTION_AVX512_H
/* SEGMENT: the most keys of one work item; L1_AHEAD: how far ahead the value sums prefetch (attention.c) */
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

/* 32 bf16 values at p as their 16 even dims and their 16 odd ones. */
static inline __attribute__((always_inline)) void load_bf16_pairs16(const char *p, __m512 *even, __m512 *odd) {
    __m512i raw = _mm512_loadu_si512((const void *)p);
    *even = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
    *odd = _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32((int)0xFFFF0000u)));
}

/* o[t] = sum_j p[t][j] v_j over 64 dims, for `nh` (1-4) query heads that share one kv head:
 * each value vector is loaded once for all of them, and the sums stay in registers. p: scores
 * rows SEGMENT apart; v_j at v + off[j] bytes in a cache of `kind` (int8 codes times vscale[j]),
 * off readable to n + L1_AHEAD; o rows head_dim apart. nh and kind are constants where called. */
static inline __attribute__((always_inline)) void pv_tile(const float *p, const char *v, const int64_t *off,
                                                          const float *vscale, int kind, int64_t n, int nh,
                                                          float *o, int64_t head_dim) {
    __m512 acc[4][4];
    for (int t = 0; t < 4; t++)
        for (int c = 0; c < 4; c++) acc[t][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j++) {
        __m512 vv[4];
        prefetch_bytes(v + off[j + L1_AHEAD], 64 * kv_elem_bytes(kind), 0);
        if (kind == KV_BF16) /* dims 0-31 as even, odd; then 32-63 */
            for (int c = 0; c < 4; c += 2) load_bf16_pairs16(v + off[j] + 32 * c, vv + c, vv + c + 1);
        else
            for (int c = 0; c < 4; c++) vv[c] = load16(v + off[j] + 16 * c * kv_elem_bytes(kind), kind);
        for (int t = 0; t < nh; t++) {
            __m512 pt = _mm512_set1_ps(kind == KV_INT8 ? p[t * SEGMENT + j] * vscale[j] : p[t * SEGMENT + j]);
            for (int c = 0; c < 4; c++) acc[t][c] = _mm512_fmadd_ps(pt, vv[c], acc[t][c]);
        }
    }
    const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    for (int t = 0; t < nh; t++)
        for (int c = 0; c < 4; c++)
            if (kind != KV_BF16)
                _mm512_storeu_ps(o + t * head_dim + 16 * c, acc[t][c]);
            else if (c % 2 == 0) /* even and odd dims back in order */
                _mm512_storeu_ps(o + t * head_dim + 16 * c, _mm512_permutex2var_ps(acc[t][c], lo, acc[t][c + 1]));
            else
                _mm512_storeu_ps(o + t * head_dim + 16 * c, _mm512_permutex2var_ps(acc[t][c - 1], hi, acc[t][c]));
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

/* Lane t * nk + j: query head t (rows head_dim apart; each 32 dims as their 16 even, then their
 * 16 odd) . bf16 key j (at k + off[j]), for nh (1-4) heads and nk = 16 / nh keys: each key is
 * loaded and split once for all the heads of its GQA group, as the VNNI int8 scores do (it was
 * once a head: one row over 8,000 keys from memory, a Zen 4 EPYC, 331-344 -> 292-314 us a layer).
 * head_dim a multiple of 32. */
static inline __attribute__((always_inline)) __m512 bdots_heads(const float *qs, const char *k, const int64_t *off,
                                                                int nh, int64_t head_dim) {
    const int nk = 16 / nh;
    __m512 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t d = 0; d < head_dim; d += 32) {
        __m512 qe[4], qo[4];
        for (int t = 0; t < nh; t++)
            qe[t] = _mm512_loadu_ps(qs + t * head_dim + d), qo[t] = _mm512_loadu_ps(qs + t * head_dim + d + 16);
        for (int j = 0; j < nk; j++) {
            __m512 e, o;
            load_bf16_pairs16(k + off[j] + 2 * d, &e, &o);
            for (int t = 0; t < nh; t++) {
                acc[t * nk + j] = _mm512_fmadd_ps(qe[t], e, acc[t * nk + j]);
                acc[t * nk + j] = _mm512_fmadd_ps(qo[t], o, acc[t * nk + j]);
            }
        }
    }
    return sum16(acc);
}

/* scores[t][j] (rows `stride` apart) of nh (1-4) query heads qs (split as bdots_heads takes them) over
 * n bf16 keys of one kv head (key j at k + off[j], off readable to n + 16 + L2_AHEAD), times
 * `scale`. With `prefetch`, the rows L2_AHEAD keys on and the value rows (v + off[j]) of the keys
 * scored into L2, as attention.c's other scores do. head_dim a multiple of 32. */
static inline __attribute__((always_inline)) void bf16_scores(const float *qs, int nh, const char *k, const char *v,
                                                              int prefetch, const int64_t *off, int64_t row, int64_t n,
                                                              int64_t head_dim, float scale, float *scores,
                                                              int64_t stride) {
    const int nk = 16 / nh;
    const __m512 sv = _mm512_set1_ps(scale);
    for (int64_t j = 0; j < n; j += nk) {
        for (int i = 0; prefetch && i < nk; i++) {
            prefetch_bytes(k + off[j + L2_AHEAD + i], row, 1);
            prefetch_bytes(v + off[j + i], row, 1);
        }
        __m512 s = _mm512_mul_ps(bdots_heads(qs, k, off + j, nh, head_dim), sv);
        unsigned m = (1u << (n - j < nk ? n - j : nk)) - 1;
        for (int t = 0; t < nh; t++) /* head t's lanes, t * nk on, to its row from column j */
            _mm512_mask_storeu_ps(scores + t * stride + j - t * nk, (__mmask16)(m << (t * nk)), s);
    }
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
