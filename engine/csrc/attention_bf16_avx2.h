/* Decode attention's scores over a bf16 cache on a CPU with AVX2 but no AVX-512 (attention.c):
 * 4 tokens at a time, every kv head of each token's record in turn, each 16 dims of a key split
 * into its even and odd dims (a shift, a mask: attention_avx2.h's load_bf16_pairs) once for all
 * the heads of its group, against the queries split so beforehand; the key records PF tokens on
 * are prefetched into L1. attention_avx2.h's per-head dots had split each key once per head. Its
 * value sums read bf16 in the same pairs and prefetch their own rows: prefetching the values
 * into L2 here too, as avx2_int8_scores does for its value sums (which have none), was slower
 * (30 layers from memory, 8,000 keys, a Zen 1 EPYC: 811-829 against 707-724 us a layer). */
#ifndef TANDEM_ATTENTION_BF16_AVX2_H
#define TANDEM_ATTENTION_BF16_AVX2_H
/* SEGMENT: the most keys of one work item (attention.c); PF, load_bf16_pairs: attention_avx2.h,
 * included before this under the same condition; prefetch_bytes: common.h */
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* Lane j of out[t]: the dot of query head t (split: each 16 dims as their 8 even, then 8 odd;
 * rows head_dim apart) with bf16 key j at k + off[j] bytes, for nh (1-3) heads and 4 keys. */
static inline __attribute__((always_inline)) void bdots4(const float *qs, int nh, const char *k, const int64_t *off,
                                                         int64_t head_dim, __m128 out[3]) {
    __m256 acc[3][4];
    for (int t = 0; t < nh; t++)
        for (int j = 0; j < 4; j++) acc[t][j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < head_dim; d += 16)
        for (int j = 0; j < 4; j++) {
            __m256 even, odd;
            load_bf16_pairs(k + off[j] + 2 * d, &even, &odd);
            for (int t = 0; t < nh; t++) {
                const float *qd = qs + t * head_dim + d;
                acc[t][j] = _mm256_fmadd_ps(even, _mm256_loadu_ps(qd), acc[t][j]);
                acc[t][j] = _mm256_fmadd_ps(odd, _mm256_loadu_ps(qd + 8), acc[t][j]);
            }
        }
    for (int t = 0; t < nh; t++) {
        __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(acc[t][0], acc[t][1]), _mm256_hadd_ps(acc[t][2], acc[t][3]));
        out[t] = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    }
}

/* scores[h * SEGMENT + j] = q_h . k_j * scale for every query head and the n (<= SEGMENT) bf16
 * keys at `slot`; head_dim a multiple of 16, at most 512. */
static void avx2_bf16_scores(const float *q, const char *k_cache, const int64_t *slot, int64_t n, int64_t heads,
                             int64_t kv_heads, int64_t head_dim, float scale, float *scores) {
    int64_t group = heads / kv_heads, row = 2 * head_dim, record = kv_heads * row, off[SEGMENT + 4];
    float qs[heads * head_dim];
    for (int64_t h = 0; h < heads; h++)
        for (int64_t d = 0; d < head_dim; d += 16)
            for (int i = 0; i < 8; i++) {
                qs[h * head_dim + d + i] = q[h * head_dim + d + 2 * i];
                qs[h * head_dim + d + 8 + i] = q[h * head_dim + d + 2 * i + 1];
            }
    for (int64_t j = 0; j < n + 4; j++) off[j] = slot[j < n ? j : 0] * record; /* pad: key 0 */
    const __m128 s = _mm_set1_ps(scale);
    for (int64_t i = 0; i < PF && i < n; i++) /* the first PF records: the loop's prefetch starts PF on */
        prefetch_bytes(k_cache + off[i], record, 0);
    for (int64_t j = 0; j < n; j += 4) {
        for (int64_t i = j + PF; i < j + PF + 4 && i < n; i++)
            prefetch_bytes(k_cache + off[i], record, 0);
        for (int64_t g = 0; g < kv_heads; g++) {
            const char *kg = k_cache + g * row;
            for (int64_t h = g * group; h < (g + 1) * group; h += 3) {
                __m128 d[3];
                int nh = (g + 1) * group - h < 3 ? (int)((g + 1) * group - h) : 3;
                if (nh == 1)
                    bdots4(qs + h * head_dim, 1, kg, off + j, head_dim, d);
                else if (nh == 2)
                    bdots4(qs + h * head_dim, 2, kg, off + j, head_dim, d);
                else
                    bdots4(qs + h * head_dim, 3, kg, off + j, head_dim, d);
                /* all 4, as avx2_int8_scores stores them: past n, within the row, nothing reads */
                for (int t = 0; t < nh; t++) _mm_storeu_ps(scores + (h + t) * SEGMENT + j, _mm_mul_ps(d[t], s));
            }
        }
    }
}
#endif
#endif
