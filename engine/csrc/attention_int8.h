/* Decode attention's integer paths over an int8 KV cache (attention.c): where the CPU has
 * AVX512-VNNI, the scores are int16 queries dotted with the int8 key codes, and the value sums
 * int16 softmax weights times the int8 value codes, both summed exactly in int32 by VPDPWSSD.
 * Each query head and each head's weights over a segment take their own scale (max / 32767), so
 * what they add is 2^-16 of the largest term, against the 2^-8 of the codes themselves; and a
 * row's result still depends on that row alone. Converting codes to floats had cost more than
 * reading them (int8 -> int32 -> fp32: two ops a 16 values, then a multiply-add, for each head). */
#ifndef TANDEM_ATTENTION_INT8_H
#define TANDEM_ATTENTION_INT8_H
/* SEGMENT: the most keys of one work item; L2_AHEAD: how far ahead the scores prefetch (attention.c) */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define INT8_ATTENTION 1
#include <immintrin.h>

/* out[j] = round(x[j] * k) as int16, for |x[j] * k| <= 32767 (the callers' scales). */
static inline void to_int16(const float *x, int64_t n, float k, int16_t *out) {
    __m512 kv = _mm512_set1_ps(k);
    for (int64_t j = 0; j < n; j += 16) {
        __mmask16 m = n - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - j)) - 1);
        __m512i r = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + j), kv));
        _mm256_mask_storeu_epi16(out + j, m, _mm512_cvtsepi32_epi16(r));
    }
}

/* x as int16 by its largest magnitude; returns the scale (max / 32767; 0 where x is all 0). */
static inline float quantize16(const float *x, int64_t n, int16_t *out) {
    __m512 m = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {
        __mmask16 k = n - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - j)) - 1);
        m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_maskz_loadu_ps(k, x + j)));
    }
    float mx = _mm512_reduce_max_ps(m);
    to_int16(x, n, mx > 0.0f ? 32767.0f / mx : 0.0f, out);
    return mx / 32767.0f;
}

/* The 16 sums of 16 int32 vectors, in order, in one vector (attention.c's sum16, on integers). */
static inline __m512i sum16i(const __m512i v[16]) {
#define PS(x) _mm512_castsi512_ps(x)
#define SI(x) _mm512_castps_si512(x)
    __m512i u[8], x[4];
    for (int i = 0; i < 8; i++)
        u[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]),
                                _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++)
        x[i] = _mm512_add_epi32(SI(_mm512_shuffle_ps(PS(u[2 * i]), PS(u[2 * i + 1]), 0x44)),
                                SI(_mm512_shuffle_ps(PS(u[2 * i]), PS(u[2 * i + 1]), 0xEE)));
#undef PS
#undef SI
    __m512i y01 = _mm512_add_epi32(_mm512_shuffle_i32x4(x[0], x[1], 0x88), _mm512_shuffle_i32x4(x[0], x[1], 0xDD));
    __m512i y23 = _mm512_add_epi32(_mm512_shuffle_i32x4(x[2], x[3], 0x88), _mm512_shuffle_i32x4(x[2], x[3], 0xDD));
    return _mm512_add_epi32(_mm512_shuffle_i32x4(y01, y23, 0x88), _mm512_shuffle_i32x4(y01, y23, 0xDD));
}

/* Lane t * nk + j: the dot of int16 query head t (rows head_dim apart) with int8 key j (at
 * k + off[j]), for nh (1-4) heads and nk = 16 / nh keys; each key is widened once for all heads. */
static inline __attribute__((always_inline)) __m512i idots(const int16_t *q, const int8_t *k, const int64_t *off,
                                                           int nh, int64_t head_dim) {
    const int nk = 16 / nh;
    __m512i acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_si512();
    for (int64_t d = 0; d < head_dim; d += 32) {
        __m512i qd[4];
        for (int t = 0; t < nh; t++) qd[t] = _mm512_loadu_si512(q + t * head_dim + d);
        for (int j = 0; j < nk; j++) {
            __m512i kd = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(k + off[j] + d)));
            for (int t = 0; t < nh; t++) acc[t * nk + j] = dpwssd(acc[t * nk + j], kd, qd[t]);
        }
    }
    return sum16i(acc);
}

/* scores[t][j] (rows `stride` apart) of nh (1-4) query heads q (fp32, rows head_dim apart) over n
 * int8 keys of one kv head (key j at k + off[j], off readable to n + 16 + L2_AHEAD, its scale after
 * its codes), times the softmax's `scale`. head_dim a multiple of 32, at most 4 * 512 / nh. With
 * `prefetch`, the rows L2_AHEAD keys on and the value rows (v + off[j]) of the keys scored into L2,
 * as attention.c's other scores do. The keys' scales are read after the scores, from the lines
 * those brought: read in a pass of their own before them, the scales had been each row's first
 * touch, gathers that waited on memory (a quarter of the call at 8,000 keys from memory). */
static inline __attribute__((always_inline)) void int8_scores(const float *q, int nh, const int8_t *k, const int8_t *v,
                                                              int prefetch, const int64_t *off, float scale,
                                                              int64_t n, int64_t head_dim, float *scores,
                                                              int64_t stride) {
    const int nk = 16 / nh;
    int16_t qi[4 * 512];
    float qs[16] = {0};
    int32_t head_of[16];
    for (int t = 0; t < nh; t++) qs[t] = quantize16(q + t * head_dim, head_dim, qi + t * head_dim);
    for (int i = 0; i < 16; i++) head_of[i] = i / nk < nh ? i / nk : 0;
    const __m512 qscale = _mm512_permutexvar_ps(_mm512_loadu_si512(head_of), _mm512_loadu_ps(qs));
    for (int64_t j = 0; j < n; j += nk) {
        for (int i = 0; prefetch && i < nk; i++) {
            prefetch_bytes(k + off[j + L2_AHEAD + i], head_dim + 4, 1);
            prefetch_bytes(v + off[j + i], head_dim + 4, 1);
        }
        __m512 s = _mm512_mul_ps(_mm512_cvtepi32_ps(idots(qi, k, off + j, nh, head_dim)), qscale);
        unsigned m = (1u << (n - j < nk ? n - j : nk)) - 1;
        for (int t = 0; t < nh; t++) /* head t's lanes, t * nk on, to its row from column j */
            _mm512_mask_storeu_ps(scores + t * stride + j - t * nk, (__mmask16)(m << (t * nk)), s);
    }
    float kscale[SEGMENT];
    for (int64_t j = 0; j < n; j++) {
        memcpy(kscale + j, k + off[j] + head_dim, 4);
        kscale[j] *= scale; /* as the other kinds' kscale[j] */
    }
    for (int t = 0; t < nh; t++)
        for (int64_t j = 0; j < n; j++) scores[t * stride + j] *= kscale[j];
}

/* o[t] = sum_j w[t][j] v_j over 64 dims, for nh (1-4) heads sharing one kv head: int8 value codes
 * (v_j at v + off[j], off padded to even n), the weights int16, as pairs (wp[t]: keys 2i, 2i + 1 in
 * its int32 i) of unit wunit[t]. Two keys' codes are widened and interleaved once for all heads;
 * o rows head_dim apart. */
static inline __attribute__((always_inline)) void int8_values_tile(const int32_t (*wp)[SEGMENT / 2], const int8_t *v,
                                                                   const int64_t *off, int64_t n, int nh,
                                                                   const float *wunit, float *o, int64_t head_dim) {
    __m512i acc[4][4];
    for (int t = 0; t < 4; t++)
        for (int c = 0; c < 4; c++) acc[t][c] = _mm512_setzero_si512();
    for (int64_t j = 0; j < n; j += 2) {
        const int8_t *a = v + off[j], *b = v + off[j + 1];
        __m512i alo = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)a));
        __m512i ahi = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(a + 32)));
        __m512i blo = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)b));
        __m512i bhi = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(b + 32)));
        __m512i pair[4] = {_mm512_unpacklo_epi16(alo, blo), _mm512_unpackhi_epi16(alo, blo),
                           _mm512_unpacklo_epi16(ahi, bhi), _mm512_unpackhi_epi16(ahi, bhi)};
        for (int t = 0; t < nh; t++) {
            __m512i w = _mm512_set1_epi32(wp[t][j / 2]);
            for (int c = 0; c < 4; c++) acc[t][c] = dpwssd(acc[t][c], pair[c], w);
        }
    }
    /* unpack{lo,hi} left dim 8L + i in lane 4L + i of pair 0 and dim 8L + 4 + i in pair 1 (i < 4) */
    const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i hi = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int t = 0; t < nh; t++) {
        __m512 unit = _mm512_set1_ps(wunit[t]);
        for (int c = 0; c < 4; c += 2) {
            __m512i x = _mm512_permutex2var_epi32(acc[t][c], lo, acc[t][c + 1]);
            __m512i y = _mm512_permutex2var_epi32(acc[t][c], hi, acc[t][c + 1]);
            _mm512_storeu_ps(o + t * head_dim + 16 * c, _mm512_mul_ps(_mm512_cvtepi32_ps(x), unit));
            _mm512_storeu_ps(o + t * head_dim + 16 * c + 16, _mm512_mul_ps(_mm512_cvtepi32_ps(y), unit));
        }
    }
}

/* o[t] = sum_j p[t][j] vscale[j] v_j for nh (1-4) heads (p rows SEGMENT apart, scaled in place
 * to the weights), int8 values as for int8_values_tile, n <= SEGMENT, head_dim a multiple of 64. */
static inline __attribute__((always_inline)) void int8_values(float *p, int nh, const float *vscale, const int8_t *v,
                                                              const int64_t *off, int64_t n, float *o,
                                                              int64_t head_dim) {
    int32_t wp[4][SEGMENT / 2];
    float wunit[4];
    for (int t = 0; t < nh; t++) {
        float *w = p + t * SEGMENT;
        for (int64_t j = 0; j < n; j++) w[j] *= vscale[j];
        wunit[t] = quantize16(w, n, (int16_t *)wp[t]); /* vector stores: they may alias */
        if (n & 1) memset((int16_t *)wp[t] + n, 0, 2); /* an odd n's last pair: key 0 (off's pad), weight 0 */
    }
    for (int64_t c = 0; c < head_dim; c += 64) int8_values_tile(wp, v + c, off, n, nh, wunit, o + c, head_dim);
}
#endif
#endif
