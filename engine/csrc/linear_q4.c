/* y = x @ W.T for a 4-bit weight W [n, k] in blocks of 32 inputs, each with its own scale d and
 * minimum m (w = d * q + m, q in 0..15: a GGUF file's Q4_1 blocks as stored, so the file's own
 * weights), the activations quantized per row to int8 as linear_i8.c does (a row's result depends
 * on that row alone). A block's dot product sums in integers; then per channel, in this order on
 * every path, so the AVX2 tiles and the plain loops give the same bits:
 *
 *   acc = 0; for each block b: acc = fmaf(d[b], dot_b, acc); acc = fmaf(m[b], xsum_b, acc)
 *   y[r][c] = acc * xscale[r]          (xsum_b: the sum of the row's int8 inputs in block b)
 *
 *   x      [m, k] fp32; xq = round(x * 127 / max|x_row|) in [-127, 127], signed
 *   packed [n / 16][k / 32][4][16][4] u8: of 16 channels' block b, inputs 4g..4g+3 in the low
 *          nibbles and 16+4g..16+4g+3 in the high ones of vector g (64 bytes): half the bytes of
 *          linear_i8's weights, which is what bounds a decode step of a few rows
 *   dm     [n / 16][k / 32][2][16] fp32: d, then m, of the 16 channels' block b
 *
 * With AVX2, vpmaddubsw multiplies the unsigned 4-bit weights by the signed inputs straight into
 * int16 pair sums (at most 2 x 15 x 127), and a block's 8 of them add in int16 (at most 30,480)
 * before vpmaddwd by ones takes them to int32: exact. A tile is up to 2 rows x 16 channels.
 * With AVX512-VNNI, a block's four 64-byte vectors hold all 16 channels, and each nibble half
 * goes through vpdpbusd (4 products a lane) straight into int32: the same exact sums. A tile is
 * up to 4 rows x 16 channels. */
#include "common.h"
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define HAVE_Q4_VNNI 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_Q4_AVX2 1
#endif

#define QB 32 /* inputs a block */

/* xq signed, xsum [m][k / QB] the blocks' sums of xq (exact in a float: at most 32 x 127) */
static void quantize_rows_q4(const float *x, int64_t m, int64_t k, int8_t *xq, float *xsum, float *xscale) {
    for (int64_t r = 0; r < m; r++) {
        const float *xr = x + r * k;
        float amax = abs_max(xr, k);
        float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        xscale[r] = amax > 0.0f ? amax / 127.0f : 0.0f;
        int8_t *q = xq + r * k;
        for (int64_t b = 0; b < k / QB; b++) {
            int32_t s = 0;
            for (int i = 0; i < QB; i++) {
                q[b * QB + i] = (int8_t)(int32_t)nearbyintf(xr[b * QB + i] * inv);
                s += q[b * QB + i];
            }
            xsum[r * (k / QB) + b] = (float)s;
        }
    }
}

#ifdef HAVE_Q4_AVX2
/* Keeps a and b in registers here. Without it gcc reorders a block's int16 sums (integers: it
 * may) into a tree over all 32 products of a 2-row tile, which spill to the stack: ~20 stores a
 * block, each two cycles on Zen 1. Pinned, nothing spills; same sums, so the same bits. The
 * kernel alone, SmolLM2's gate projection on Zen 1 (GMAC/s, alternated): one thread, 1 row
 * 20-21 -> 22.4, 2-512 rows 19-22 -> 25-26; two threads, 1 row 33-40 either way, 2-512 rows
 * 36-42 -> 44-51. */
#define PIN2(a, b) __asm__("" : "+v"(a), "+v"(b))

static inline __m256i bcast4(const int8_t *p) {
    int32_t four;
    memcpy(&four, p, 4);
    return _mm256_set1_epi32(four);
}

/* `rows` (1 or 2) x one group of 16 channels; w and dm at the group's first block */
static inline __attribute__((always_inline)) void tile_q4(const int8_t *xq, const float *xsum, int64_t k, int rows,
                                                          const uint8_t *w, const float *dm, const float *xscale,
                                                          int64_t n, float *y) {
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    const int64_t blocks = k / QB;
    __m256 acc[2][2] = {{_mm256_setzero_ps(), _mm256_setzero_ps()}, {_mm256_setzero_ps(), _mm256_setzero_ps()}};
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *wb = w + b * 256;
        __m256i s[2][2] = {{_mm256_setzero_si256(), _mm256_setzero_si256()},
                           {_mm256_setzero_si256(), _mm256_setzero_si256()}};
        for (int g = 0; g < 4; g++) {
            __m256i v0 = _mm256_loadu_si256((const __m256i *)(wb + g * 64));
            __m256i v1 = _mm256_loadu_si256((const __m256i *)(wb + g * 64 + 32));
            __m256i lo0 = _mm256_and_si256(v0, low), hi0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), low);
            __m256i lo1 = _mm256_and_si256(v1, low), hi1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), low);
            for (int r = 0; r < rows; r++) {
                const int8_t *xb = xq + r * k + b * QB;
                __m256i al = bcast4(xb + 4 * g), ah = bcast4(xb + 16 + 4 * g);
                s[r][0] = _mm256_add_epi16(s[r][0], _mm256_add_epi16(_mm256_maddubs_epi16(lo0, al),
                                                                     _mm256_maddubs_epi16(hi0, ah)));
                s[r][1] = _mm256_add_epi16(s[r][1], _mm256_add_epi16(_mm256_maddubs_epi16(lo1, al),
                                                                     _mm256_maddubs_epi16(hi1, ah)));
                PIN2(s[r][0], s[r][1]);
            }
        }
        const float *d = dm + b * 2 * 16, *mn = d + 16;
        for (int r = 0; r < rows; r++) {
            __m256 xs = _mm256_set1_ps(xsum[r * blocks + b]);
            for (int h = 0; h < 2; h++) {
                __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(s[r][h], ones));
                acc[r][h] = _mm256_fmadd_ps(_mm256_loadu_ps(d + 8 * h), dot, acc[r][h]);
                acc[r][h] = _mm256_fmadd_ps(_mm256_loadu_ps(mn + 8 * h), xs, acc[r][h]);
            }
        }
    }
    for (int r = 0; r < rows; r++)
        for (int h = 0; h < 2; h++)
            _mm256_storeu_ps(y + r * n + 8 * h, _mm256_mul_ps(acc[r][h], _mm256_set1_ps(xscale[r])));
}
#endif

#ifdef HAVE_Q4_VNNI
/* tile_q4 512 bits wide, `rows` 1-4: the same exact dots, then the same float steps, so the same
 * bits. Same process, alternated, SmolLM2's four projection shapes, 2 threads, a Zen 4 EPYC
 * (weights in L3), us against the AVX2 tiles: 1 row 40 / 43, 4 rows 76 / 100, 16 rows 234 / 320,
 * 512 rows 6,940 / 9,631. */
static inline __attribute__((always_inline)) void tile_q4_vnni(const int8_t *xq, const float *xsum, int64_t k,
                                                               int rows, const uint8_t *w, const float *dm,
                                                               const float *xscale, int64_t n, float *y,
                                                               const uint8_t *next, const float *next_dm) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    const int64_t blocks = k / QB;
    __m512 acc[4];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        if (next) {
            for (int g = 0; g < 4; g++) _mm_prefetch((const char *)(next + b * 256 + g * 64), _MM_HINT_T1);
            _mm_prefetch((const char *)(next_dm + b * 32), _MM_HINT_T1);
            _mm_prefetch((const char *)(next_dm + b * 32 + 16), _MM_HINT_T1);
        }
        const uint8_t *wb = w + b * 256;
        __m512i s[4];
        for (int r = 0; r < rows; r++) s[r] = _mm512_setzero_si512();
        for (int g = 0; g < 4; g++) {
            __m512i v = _mm512_loadu_si512((const void *)(wb + g * 64));
            __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            for (int r = 0; r < rows; r++) {
                const int8_t *xb = xq + r * k + b * QB;
                int32_t al, ah; /* the row's inputs 4g..4g+3 and 16+4g..16+4g+3, in every lane */
                memcpy(&al, xb + 4 * g, 4);
                memcpy(&ah, xb + 16 + 4 * g, 4);
                s[r] = dpbusd(s[r], lo, _mm512_set1_epi32(al));
                s[r] = dpbusd(s[r], hi, _mm512_set1_epi32(ah));
            }
        }
        const __m512 d = _mm512_loadu_ps(dm + b * 32), mn = _mm512_loadu_ps(dm + b * 32 + 16);
        for (int r = 0; r < rows; r++) {
            acc[r] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(s[r]), acc[r]);
            acc[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xsum[r * blocks + b]), acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) _mm512_storeu_ps(y + r * n, _mm512_mul_ps(acc[r], _mm512_set1_ps(xscale[r])));
}
#endif

/* every row of y's 16 channels of group `w`; `next` (or NULL): the group after it, with its
 * scales `next_dm`, which the last of two or more VNNI row tiles fetches into L2 (the first tile
 * of a group waited on memory, the others ran from L1 with memory idle; as linear_i8.c's tall
 * tiles). Alternated, us: 8 rows qkv 14.7 -> 14.0, gate_up 43.9 -> 37.7, down 32.0 -> 26.7; 16
 * rows 1.12-1.23x, the LM head 1,171 -> 952; 64 rows 1.01-1.16x; 1-4 rows the same. */
static void run_group(const int8_t *xq, const float *xsum, int64_t m, int64_t k, const uint8_t *w, const float *dm,
                      const float *xscale, int64_t n, float *y, const uint8_t *next, const float *next_dm) {
#ifdef HAVE_Q4_VNNI
    for (int64_t r = 0; r < m; r += 4) { /* the group's weights (k / 2 x 16 bytes) stay in L1 for every tile */
        const uint8_t *pf = r > 0 && r + 4 >= m ? next : NULL; /* the last of 2+ tiles fetches the next group */
#define T(R) tile_q4_vnni(xq + r * k, xsum + r * (k / QB), k, R, w, dm, xscale + r, n, y + r * n, pf, next_dm)
        switch (m - r) {
        case 1: T(1); break;
        case 2: T(2); break;
        case 3: T(3); break;
        default: T(4); break;
        }
#undef T
    }
#elif defined(HAVE_Q4_AVX2)
    (void)next, (void)next_dm;
    int64_t r = 0;
    for (; r + 2 <= m; r += 2) /* the group's weights (k / 2 x 16 bytes) stay in L1 for every pair */
        tile_q4(xq + r * k, xsum + r * (k / QB), k, 2, w, dm, xscale + r, n, y + r * n);
    if (r < m)
        tile_q4(xq + r * k, xsum + r * (k / QB), k, 1, w, dm, xscale + r, n, y + r * n);
#else
    (void)next, (void)next_dm;
    const int64_t blocks = k / QB;
    for (int64_t r = 0; r < m; r++)
        for (int c = 0; c < 16; c++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < blocks; b++) {
                const uint8_t *wb = w + b * 256;
                const int8_t *xb = xq + r * k + b * QB;
                int32_t dot = 0;
                for (int g = 0; g < 4; g++)
                    for (int i = 0; i < 4; i++) {
                        uint8_t byte = wb[g * 64 + c * 4 + i];
                        dot += (byte & 0x0F) * xb[4 * g + i] + (byte >> 4) * xb[16 + 4 * g + i];
                    }
                acc = fmaf(dm[b * 32 + c], (float)dot, acc);
                acc = fmaf(dm[b * 32 + 16 + c], xsum[r * blocks + b], acc);
            }
            y[r * n + c] = acc * xscale[r];
        }
#endif
}

int linear_q4_fast(void) {
#if defined(HAVE_Q4_VNNI) || defined(HAVE_Q4_AVX2)
    return 1;
#else
    return 0;
#endif
}

/* y [m, n] = x [m, k] @ W.T; n a multiple of 16, k of 32. Returns 0, or -1 (y untouched) when its
 * scratch cannot be allocated. */
int linear_q4(const float *x, int64_t m, int64_t k, const uint8_t *packed, const float *dm, int64_t n,
              int64_t threads, float *y) {
    int8_t *xq = malloc(m * k);
    float *xsum = malloc((m * (k / QB) + m) * sizeof(float));
    if (!xq || !xsum) {
        free(xq);
        free(xsum);
        return -1;
    }
    float *xscale = xsum + m * (k / QB);
    int64_t groups = n / 16, team = threads > 0 ? threads : 1, many = m >= 16;
    team = team < groups ? team : groups;
    if (!many) /* a decode step's few rows: not worth a barrier */
        quantize_rows_q4(x, m, k, xq, xsum, xscale);
#pragma omp parallel num_threads(team)
    {
#ifdef _OPENMP
        int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
        int64_t t = 0, nt = 1;
#endif
        if (many) {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < m; r++)
                quantize_rows_q4(x + r * k, 1, k, xq + r * k, xsum + r * (k / QB), xscale + r);
        }
        int64_t g_end = groups * (t + 1) / nt;
        for (int64_t g = groups * t / nt; g < g_end; g++) {
            const uint8_t *next = g + 1 < g_end ? packed + (g + 1) * 8 * k : NULL;
            run_group(xq, xsum, m, k, packed + g * 8 * k, dm + g * 32 * (k / QB), xscale, n, y + g * 16, next,
                      dm + (g + 1) * 32 * (k / QB));
        }
    }
    free(xq);
    free(xsum);
    return 0;
}
