/* attention_int8.h's integer paths on a CPU with AVX2 but no AVX-512 (attention.c): the same
 * numbers (int16 queries and softmax weights, each by its own largest magnitude; exact int32
 * sums with the int8 codes), so the same results, summed by VPMADDWD instead of VPDPWSSD.
 *
 * Measured on a Zen 1 EPYC (AVX2, FMA): converting each code to a float took two ops per 8 values
 * on the pipes the multiply-adds share, and held a dot tile (4 keys x 3 heads, one thread, codes in
 * L1) to 10.6 GMAC/s (17.7 over an fp32 cache), where int16 pairs through VPMADDWD run at 21.8.
 * The scores also read a token's record (its kv heads' rows) once, 4 tokens at a time, and
 * prefetch the same tokens' values into L2 for the value sums. */
#ifndef TANDEM_ATTENTION_INT8_AVX2_H
#define TANDEM_ATTENTION_INT8_AVX2_H
/* SEGMENT: the most keys of one work item (attention.c); PF: how far ahead loops prefetch
 * (attention_avx2.h, included before this under the same condition) */
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define INT8_ATTENTION 1
#include <immintrin.h>

/* acc += x (int32 lanes) in place, in order. As an intrinsic gcc (free to reorder integer
 * additions) unrolled a head's dims and summed a tile's products as one tree, storing them to the
 * stack first (as linear_q4.c's PIN2 tells); with an empty asm pinning the sum it still added into
 * the product's register and moved the sum back. Same sums, so the same bits. */
static inline __attribute__((always_inline)) __m256i add_to(__m256i acc, __m256i x) {
    __asm__("vpaddd %1, %0, %0" : "+x"(acc) : "x"(x));
    return acc;
}

/* x as int16 by its largest magnitude, as attention_int8.h's quantize16 rounds it (to nearest
 * even, saturated); returns the scale (max / 32767; 0 where x is all 0). out: n rounded up to 2. */
static inline float quantize16(const float *x, int64_t n, int16_t *out) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + j)));
    float lanes[8], mx = 0.0f;
    _mm256_storeu_ps(lanes, m);
    for (int i = 0; i < 8; i++) mx = lanes[i] > mx ? lanes[i] : mx;
    for (; j < n; j++) mx = fabsf(x[j]) > mx ? fabsf(x[j]) : mx;
    float k = mx > 0.0f ? 32767.0f / mx : 0.0f;
    __m256 kv = _mm256_set1_ps(k);
    for (j = 0; j + 8 <= n; j += 8) {
        __m256i r = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + j), kv));
        __m128i p = _mm_packs_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
        _mm_storeu_si128((__m128i *)(out + j), p);
    }
    for (; j < n; j++) {
        int32_t r = _mm_cvtss_si32(_mm_set_ss(x[j] * k));
        out[j] = (int16_t)(r > 32767 ? 32767 : r < -32768 ? -32768 : r);
    }
    if (n & 1) out[n] = 0;
    return mx / 32767.0f;
}

/* Lane j of out[t]: the dot of int16 query head t (rows head_dim apart) with int8 key j (at
 * k + off[j]), for nh (1-3) heads and 4 keys; each 16 codes are widened once for all heads. */
static inline __attribute__((always_inline)) void idots4(const int16_t *q, int nh, const int8_t *k, const int64_t *off,
                                                         int64_t head_dim, __m128i out[3]) {
    __m256i acc[3][4];
    for (int t = 0; t < nh; t++)
        for (int j = 0; j < 4; j++) acc[t][j] = _mm256_setzero_si256();
    for (int64_t d = 0; d < head_dim; d += 16)
        for (int j = 0; j < 4; j++) {
            __m256i kd = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(k + off[j] + d)));
            for (int t = 0; t < nh; t++) {
                __m256i qd = _mm256_loadu_si256((const __m256i *)(q + t * head_dim + d));
                acc[t][j] = add_to(acc[t][j], _mm256_madd_epi16(kd, qd));
            }
        }
    for (int t = 0; t < nh; t++) {
        __m256i s = _mm256_hadd_epi32(_mm256_hadd_epi32(acc[t][0], acc[t][1]), _mm256_hadd_epi32(acc[t][2], acc[t][3]));
        out[t] = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    }
}

/* scores[h * SEGMENT + j] = q_h . k_j * (the key's scale * scale) for every query head and the n
 * (<= SEGMENT) int8 keys at `slot`, 4 tokens at a time, every kv head of them in turn, while the
 * records PF tokens on are prefetched: keys into L1, values (v_cache) into L2 for
 * avx2_int8_values. head_dim a multiple of 16, at most 512. */
static void avx2_int8_scores(const float *q, const int8_t *k_cache, const int8_t *v_cache, const int64_t *slot,
                             int64_t n, int64_t heads, int64_t kv_heads, int64_t head_dim, float scale, float *scores) {
    int64_t group = heads / kv_heads, row = head_dim + 4, record = kv_heads * row, off[SEGMENT + 4];
    int16_t qi[heads * head_dim];
    float qs[heads];
    for (int64_t h = 0; h < heads; h++) qs[h] = quantize16(q + h * head_dim, head_dim, qi + h * head_dim);
    for (int64_t j = 0; j < n + 4; j++) off[j] = slot[j < n ? j : 0] * record; /* pad: key 0 */
    for (int64_t i = 0; i < PF && i < n; i++) { /* the first PF records: the loop's prefetch starts PF on */
        prefetch_bytes(k_cache + off[i], record, 0);
        prefetch_bytes(v_cache + off[i], record, 1);
    }
    for (int64_t j = 0; j < n; j += 4) {
        for (int64_t i = j + PF; i < j + PF + 4 && i < n; i++) {
            prefetch_bytes(k_cache + off[i], record, 0);
            prefetch_bytes(v_cache + off[i], record, 1);
        }
        for (int64_t g = 0; g < kv_heads; g++) {
            const int8_t *kg = k_cache + g * row;
            float ks[4];
            for (int t = 0; t < 4; t++) memcpy(ks + t, kg + off[j + t] + head_dim, 4);
            const __m128 kscale = _mm_mul_ps(_mm_loadu_ps(ks), _mm_set1_ps(scale));
            for (int64_t h = g * group; h < (g + 1) * group; h += 3) {
                __m128i d[3];
                int nh = (g + 1) * group - h < 3 ? (int)((g + 1) * group - h) : 3;
                if (nh == 1)
                    idots4(qi + h * head_dim, 1, kg, off + j, head_dim, d);
                else if (nh == 2)
                    idots4(qi + h * head_dim, 2, kg, off + j, head_dim, d);
                else
                    idots4(qi + h * head_dim, 3, kg, off + j, head_dim, d);
                /* all 4: a row's last tile is partial only where n < SEGMENT (n % 4 != 0), and then
                 * ends within the row; past n nothing reads (a copy of a partial tile's size had
                 * been a call to memcpy, a tenth of the scores' time) */
                for (int t = 0; t < nh; t++)
                    _mm_storeu_ps(scores + (h + t) * SEGMENT + j,
                                  _mm_mul_ps(_mm_mul_ps(_mm_cvtepi32_ps(d[t]), _mm_set1_ps(qs[h + t])), kscale));
            }
        }
    }
}

/* o[t] = sum_j w[t][j] v_j over 16 dims, for nh (1-3) heads sharing one kv head: int8 value codes
 * (v_j at v + off[j], off padded to even n), the weights int16 as pairs (wp[t]: keys 2i, 2i + 1
 * in its int32 i) of unit wunit[t]; o rows head_dim apart. Two keys' codes are widened and
 * interleaved once for all heads. 16 dims, not 32: 6 sums, 3 weights and 2 pairs leave registers
 * to spare, where 32 dims' 12 sums and 4 pairs had pushed sums to the stack. */
static inline __attribute__((always_inline)) void int8_values16(const int32_t (*wp)[SEGMENT / 2], const int8_t *v,
                                                                const int64_t *off, int64_t n, int nh,
                                                                const float *wunit, float *o, int64_t head_dim) {
    __m256i acc[3][2];
    for (int t = 0; t < nh; t++) acc[t][0] = acc[t][1] = _mm256_setzero_si256();
    for (int64_t j = 0; j < n; j += 2) {
        __m256i a = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(v + off[j])));
        __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(v + off[j + 1])));
        __m256i pair[2] = {_mm256_unpacklo_epi16(a, b), _mm256_unpackhi_epi16(a, b)};
        for (int t = 0; t < nh; t++) {
            __m256i w = _mm256_set1_epi32(wp[t][j / 2]);
            for (int c = 0; c < 2; c++) acc[t][c] = add_to(acc[t][c], _mm256_madd_epi16(pair[c], w));
        }
    }
    /* unpack{lo,hi} left dims 0-3 | 8-11 in pair 0 and 4-7 | 12-15 in pair 1 (lanes of 128 bits) */
    for (int t = 0; t < nh; t++) {
        __m256 unit = _mm256_set1_ps(wunit[t]);
        __m256i x = _mm256_permute2x128_si256(acc[t][0], acc[t][1], 0x20);
        __m256i y = _mm256_permute2x128_si256(acc[t][0], acc[t][1], 0x31);
        _mm256_storeu_ps(o + t * head_dim, _mm256_mul_ps(_mm256_cvtepi32_ps(x), unit));
        _mm256_storeu_ps(o + t * head_dim + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(y), unit));
    }
}

/* o[h] = sum_j p[h][j] vscale[j] v_j for every query head (p = scores, rows SEGMENT apart, scaled in
 * place to the weights) over the n int8 values at `slot`; head_dim a multiple of 16. */
static void avx2_int8_values(float *scores, const int8_t *v_cache, const int64_t *slot, int64_t n, int64_t heads,
                             int64_t kv_heads, int64_t head_dim, float *o) {
    int64_t group = heads / kv_heads, row = head_dim + 4, off[SEGMENT + 1];
    float vscale[SEGMENT];
    int32_t wp[3][SEGMENT / 2];
    for (int64_t j = 0; j <= n; j++) off[j] = slot[j < n ? j : 0] * kv_heads * row; /* pad: key 0 */
    for (int64_t g = 0; g < kv_heads; g++) {
        const int8_t *vg = v_cache + g * row;
        for (int64_t j = 0; j < n; j++) memcpy(vscale + j, vg + off[j] + head_dim, 4);
        for (int64_t h = g * group; h < (g + 1) * group; h += 3) {
            int nh = (g + 1) * group - h < 3 ? (int)((g + 1) * group - h) : 3;
            float wunit[3];
            for (int t = 0; t < nh; t++) {
                float *w = scores + (h + t) * SEGMENT;
                for (int64_t j = 0; j < n; j++) w[j] *= vscale[j];
                wunit[t] = quantize16(w, n, (int16_t *)wp[t]); /* an odd n's last pair: key 0, weight 0 */
            }
            for (int64_t c = 0; c < head_dim; c += 16) {
                if (nh == 1)
                    int8_values16(wp, vg + c, off, n, 1, wunit, o + h * head_dim + c, head_dim);
                else if (nh == 2)
                    int8_values16(wp, vg + c, off, n, 2, wunit, o + h * head_dim + c, head_dim);
                else
                    int8_values16(wp, vg + c, off, n, 3, wunit, o + h * head_dim + c, head_dim);
            }
        }
    }
}
#endif
#endif
