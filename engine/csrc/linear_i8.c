/* y = x @ W.T for an int8 weight W [n, k] (per output channel scales), the activations quantized
 * per row: each row's int8 values and scale depend on that row alone, and the dot products sum
 * in int32, exactly. So a row's output is the same bits whatever else is in the batch, and
 * whatever the threads (fbgemm's dynamic kernel quantizes per tensor: a row moves with its
 * neighbours). For the few rows of a decode step it is also 2-4x faster than fbgemm here (see
 * engine/native.py).
 *
 *   x      [m, k] fp32; xq = round(x * 127 / max|x_row|) in [-127, 127], stored + 128 (u8)
 *   packed [n / 16][k / 4][16][4] int8: 16 channels x 4 inputs a 64-byte vector, the layout
 *          VNNI's vpdpbusd (u8 x s8, 4 products into each int32 lane) reads
 *   sums   [n] int32: 128 * sum_k W[c], what the +128 offset added
 *   y[r][c] = (float)(dot - sums[c]) * xscale[r] * wscale[c]
 *
 * With AVX512-VNNI up to 8 rows pass each block of 16 channels together (rows_block), so a
 * decode or verify step of up to 8 rows reads the weights once, as one sequential stream a
 * thread (from 24 rows: tiles of 8 x 32, see tall_tile); the channel blocks are split evenly
 * over `threads` OpenMP threads. With AVX2 alone, tiles of up to 2 rows x 32 channels (tile_avx2: 3.0x the plain loops'
 * one-stream decode on a Zen 1 EPYC, 4.3x at batch 16). Without either, plain loops. All three,
 * the same integer sums, the same bits.
 */
#include "common.h"
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define HAVE_VNNI 1
#elif defined(__AVX2__)
#include <immintrin.h>
#define HAVE_AVX2 1
#endif

#define NB 4 /* 16-channel blocks a thread takes at a time (the AVX2 kernel: 2) */
#define MR 8 /* rows in one pass over W: 5-6 rows in one pass were 9-11% faster than 4 + the rest */

static void quantize_rows(const float *x, int64_t m, int64_t k, uint8_t *xq, float *xscale) {
    for (int64_t r = 0; r < m; r++) {
        const float *xr = x + r * k;
        float amax = abs_max(xr, k);
        float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        xscale[r] = amax > 0.0f ? amax / 127.0f : 0.0f;
        uint8_t *q = xq + r * k;
        for (int64_t i = 0; i < k; i++) q[i] = (uint8_t)((int32_t)nearbyintf(xr[i] * inv) + 128);
    }
}

#ifdef HAVE_VNNI
/* TALL rows x 2 blocks, for prefill's many rows: a 32-channel slice of W (18 KB at k = 576)
 * stays in L1 while every row passes it, where the 4 x 4 tile's 36 KB did not fit. Its own
 * function: tile() widened to TALL rows ran prefill's matmuls 3-4% slower (alternated builds).
 * With `next`, the slice after this one is fetched into L2 as this tile goes: the first rows
 * to pass a slice waited on memory, and with few row tiles a slice (a decode step's 16-64 rows)
 * that was most of the time. Alternated, 16 rows: SmolLM2's qkv 18.8 -> 16.1 us, gate_up
 * 79.1 -> 54.1, down 36.2 -> 30.4, the LM head 1,314 -> 941; 64 rows 1.08-1.19x; 512 the same. */
#define TALL 8
static void tall_tile(const uint8_t *xq, int64_t k, const int8_t *w, const int32_t *sums, const float *wscale,
                      const float *xscale, int64_t n, float *y, const int8_t *next) {
    __m512i acc[TALL][2];
    for (int r = 0; r < TALL; r++) acc[r][0] = acc[r][1] = _mm512_setzero_si512();
    for (int64_t kk = 0; kk < k; kk += 4) {
        if (next) {
            _mm_prefetch((const char *)(next + kk * 16), _MM_HINT_T1);
            _mm_prefetch((const char *)(next + 16 * k + kk * 16), _MM_HINT_T1);
        }
        __m512i w0 = _mm512_loadu_si512(w + kk * 16), w1 = _mm512_loadu_si512(w + 16 * k + kk * 16);
        for (int r = 0; r < TALL; r++) {
            __m512i a = _mm512_set1_epi32(*(const int32_t *)(xq + r * k + kk));
            acc[r][0] = dpbusd(acc[r][0], a, w0);
            acc[r][1] = dpbusd(acc[r][1], a, w1);
        }
    }
    for (int r = 0; r < TALL; r++)
        for (int j = 0; j < 2; j++) {
            __m512 d = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][j], _mm512_loadu_si512(sums + j * 16)));
            d = _mm512_mul_ps(_mm512_mul_ps(d, _mm512_set1_ps(xscale[r])), _mm512_loadu_ps(wscale + j * 16));
            _mm512_storeu_ps(y + r * n + j * 16, d);
        }
}
#else
#define TALL 0 /* the AVX2 kernel and the plain loops have no tall tile */
#endif

#ifdef HAVE_AVX2
/* AVX2 (no VNNI: e.g. AMD before Zen 4). vpmaddubsw multiplies u8 x s8 into int16 pair sums,
 * which the +128 offset would overflow (255 x 127 x 2). So each row's 4 inputs go back to
 * signed, and a . w = |a| . (w signed as a), with |a|, |w| <= 127: a pair sums to at most
 * 2 x 127 x 127 < 2^15, exact; vpmaddwd by ones then sums a channel's 4 products in int32.
 * The dot is sum(a . w) = sum((a + 128) . w) - sums[c]: the integer VNNI's path computes, so
 * the same bits out. Needs w != -128 (RowQuantWeight.from_int8 refuses it).
 * A tile: up to 2 rows x 2 blocks (4 halves of 8 channels, 32 bytes each): 8 accumulators, 4
 * weight vectors, reused by both rows. */
static inline __attribute__((always_inline)) void tile_avx2(const uint8_t *xq, int64_t k, int rows, const int8_t *w,
                                                            int nb, const float *wscale, const float *xscale,
                                                            int64_t n, float *y) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i acc[2][4];
    for (int r = 0; r < 2; r++)
        for (int j = 0; j < 4; j++) acc[r][j] = _mm256_setzero_si256();
    for (int64_t kk = 0; kk < k; kk += 4) {
        __m256i wv[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                         _mm256_setzero_si256()};
        for (int j = 0; j < 2 * nb; j++)
            wv[j] = _mm256_loadu_si256((const __m256i *)(w + (j / 2) * 16 * k + kk * 16 + (j % 2) * 32));
        for (int r = 0; r < rows; r++) {
            uint32_t four;
            memcpy(&four, xq + r * k + kk, 4);
            __m256i a = _mm256_set1_epi32((int32_t)(four ^ 0x80808080u)); /* back to signed */
            __m256i ua = _mm256_abs_epi8(a);
            for (int j = 0; j < 2 * nb; j++) {
                __m256i p = _mm256_maddubs_epi16(ua, _mm256_sign_epi8(wv[j], a));
                acc[r][j] = _mm256_add_epi32(acc[r][j], _mm256_madd_epi16(p, ones));
                __asm__("" : "+v"(acc[r][j])); /* else gcc keeps 2 of the 8 on the stack: 1.04-1.09x */
            }
        }
    }
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < 2 * nb; j++) {
            int64_t c = (j / 2) * 16 + (j % 2) * 8;
            __m256 d = _mm256_cvtepi32_ps(acc[r][j]);
            d = _mm256_mul_ps(_mm256_mul_ps(d, _mm256_set1_ps(xscale[r])), _mm256_loadu_ps(wscale + c));
            _mm256_storeu_ps(y + r * n + c, d);
        }
}
#endif

#ifdef HAVE_VNNI
/* One row x one block of 16 channels, k in four interleaved partial sums (integers: the same
 * dot): a one-row step reads each thread's share of W as one sequential stream, where the 1 x 4
 * tile read four blocks 16 x k bytes apart at once. Alternated, 1 row: SmolLM2's qkv 10.9 ->
 * 9.5 us, o 6.5 -> 6.1, gate_up 37.8 -> 37.0, down 16.6 -> 15.9, the LM head the same. */
static void row_block(const uint8_t *xq, int64_t k, const int8_t *w, const int32_t *sums, const float *wscale,
                      float xscale, float *y) {
    __m512i acc[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
    int64_t kk = 0;
    for (; kk + 16 <= k; kk += 16)
        for (int u = 0; u < 4; u++)
            acc[u] = dpbusd(acc[u], _mm512_set1_epi32(*(const int32_t *)(xq + kk + 4 * u)),
                            _mm512_loadu_si512(w + (kk + 4 * u) * 16));
    for (; kk < k; kk += 4)
        acc[0] = dpbusd(acc[0], _mm512_set1_epi32(*(const int32_t *)(xq + kk)), _mm512_loadu_si512(w + kk * 16));
    __m512i dot = _mm512_add_epi32(_mm512_add_epi32(acc[0], acc[1]), _mm512_add_epi32(acc[2], acc[3]));
    __m512 d = _mm512_cvtepi32_ps(_mm512_sub_epi32(dot, _mm512_loadu_si512(sums)));
    d = _mm512_mul_ps(_mm512_mul_ps(d, _mm512_set1_ps(xscale)), _mm512_loadu_ps(wscale));
    _mm512_storeu_ps(y, d);
}

/* `rows` (2-8) x one block of 16 channels, k in two interleaved partial sums: each thread reads
 * its share of W as one sequential stream, as row_block, and fetches 8 KB ahead of it into L1.
 * The 4-block tiles this replaced (up to 6 rows x 4 blocks, 8 x 3) read four blocks 16 x k
 * bytes apart and waited on memory: alternated, 5 rows, SmolLM2's gate_up 48.9 -> 29.7 us, down
 * 23.6 -> 20.8, qkv 15.7 -> 13.1, the LM head 722 -> 431; 8 rows 1.25-2.1x; the same bits. */
#define AHEAD 8192
static inline __attribute__((always_inline)) void rows_block(const uint8_t *xq, int64_t k, int rows,
                                                             const int8_t *w, const int32_t *sums,
                                                             const float *wscale, const float *xscale, int64_t n,
                                                             float *y) {
    __m512i acc[MR][2];
    for (int r = 0; r < MR; r++) acc[r][0] = acc[r][1] = _mm512_setzero_si512();
    int64_t kk = 0;
    for (; kk + 8 <= k; kk += 8) {
        _mm_prefetch((const char *)(w + kk * 16 + AHEAD), _MM_HINT_T0);
        _mm_prefetch((const char *)(w + kk * 16 + AHEAD + 64), _MM_HINT_T0);
        __m512i w0 = _mm512_loadu_si512(w + kk * 16), w1 = _mm512_loadu_si512(w + (kk + 4) * 16);
        for (int r = 0; r < rows; r++) {
            acc[r][0] = dpbusd(acc[r][0], _mm512_set1_epi32(*(const int32_t *)(xq + r * k + kk)), w0);
            acc[r][1] = dpbusd(acc[r][1], _mm512_set1_epi32(*(const int32_t *)(xq + r * k + kk + 4)), w1);
        }
    }
    for (; kk < k; kk += 4) {
        __m512i w0 = _mm512_loadu_si512(w + kk * 16);
        for (int r = 0; r < rows; r++)
            acc[r][0] = dpbusd(acc[r][0], _mm512_set1_epi32(*(const int32_t *)(xq + r * k + kk)), w0);
    }
    for (int r = 0; r < rows; r++) {
        __m512 d = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_add_epi32(acc[r][0], acc[r][1]), _mm512_loadu_si512(sums)));
        d = _mm512_mul_ps(_mm512_mul_ps(d, _mm512_set1_ps(xscale[r])), _mm512_loadu_ps(wscale));
        _mm512_storeu_ps(y + r * n, d);
    }
}
/* called with a constant `rows`, so each keeps its accumulators in registers */
#define ROWS(R)                                                                                                \
    case R:                                                                                                    \
        for (int j = 0; j < nb; j++)                                                                           \
            rows_block(xq, k, R, w + j * 16 * k, sums + j * 16, wscale + j * 16, xscale, n, y + j * 16);       \
        return;
#endif

/* Rows [r, r + rows) x blocks [b, b + nb) of y; nb <= NB, rows <= MR. */
static void run_tile(const uint8_t *xq, int64_t k, int rows, const int8_t *w, int nb, const int32_t *sums,
                     const float *wscale, const float *xscale, int64_t n, float *y) {
#ifdef HAVE_VNNI
    if (rows == 1) {
        for (int j = 0; j < nb; j++) row_block(xq, k, w + j * 16 * k, sums + j * 16, wscale + j * 16, xscale[0], y + j * 16);
        return;
    }
    switch (rows) { ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8) }
#elif defined(HAVE_AVX2)
    (void)sums;
    for (int j = 0; j < nb; j += 2) /* 2 blocks of W, passed by every row while they sit in L1 */
        for (int r = 0; r < rows; r += 2) {
            const uint8_t *xr = xq + r * k;
            const int8_t *wj = w + j * 16 * k;
            float *yr = y + r * n + j * 16;
            int two_rows = rows - r >= 2, two_blocks = nb - j >= 2;
            if (two_rows && two_blocks)
                tile_avx2(xr, k, 2, wj, 2, wscale + j * 16, xscale + r, n, yr);
            else if (two_rows)
                tile_avx2(xr, k, 2, wj, 1, wscale + j * 16, xscale + r, n, yr);
            else if (two_blocks)
                tile_avx2(xr, k, 1, wj, 2, wscale + j * 16, xscale + r, n, yr);
            else
                tile_avx2(xr, k, 1, wj, 1, wscale + j * 16, xscale + r, n, yr);
        }
#else
    for (int r = 0; r < rows; r++)
        for (int64_t c = 0; c < nb * 16; c++) {
            const int8_t *wc = w + (c / 16) * 16 * k + (c % 16) * 4;
            const uint8_t *xr = xq + r * k;
            int32_t dot = 0;
            for (int64_t kk = 0; kk < k; kk += 4)
                for (int i = 0; i < 4; i++) dot += (int32_t)xr[kk + i] * wc[kk * 16 + i];
            y[r * n + c] = (float)(dot - sums[c]) * xscale[r] * wscale[c];
        }
#endif
}

int linear_i8_fast(void) {
#if defined(HAVE_VNNI) || defined(HAVE_AVX2)
    return 1;
#else
    return 0;
#endif
}

/* y [m, n] = x [m, k] @ W.T; n a multiple of 16, k of 4. Returns 0, or -1 (y untouched) when its
 * scratch cannot be allocated. */
int linear_i8(const float *x, int64_t m, int64_t k, const int8_t *packed, const int32_t *sums,
              const float *wscale, int64_t n, int64_t threads, float *y) {
    uint8_t *xq = malloc(m * k);
    float *xscale = malloc(m * sizeof(float));
    if (!xq || !xscale) {
        free(xq);
        free(xscale);
        return -1;
    }
    int64_t blocks = n / 16, team = threads > 0 ? threads : 1;
    /* Many rows (prefill): slices of 2 blocks, each passed by every row in tall tiles; else a
     * thread's blocks NB at a time, 8 rows at a pass (rows_block). Each thread takes an even
     * share of the slices. Tall from 24 rows: at 16, 8-row passes spend 9% less time in a
     * decode step's matmuls (alternated: the LM head 866 -> 684 us, gate_up 57.1 -> 50.1, down
     * 33.9 -> 31.7, qkv and o 2-6% more), at 24 about the same, from 32 on more. */
    int tall = TALL > 0 && m >= 3 * TALL && blocks % 2 == 0, many = m >= 16;
    int64_t slice = tall ? 2 : 1, slices = blocks / slice;
    team = team < slices ? team : slices;
    if (!many) /* a decode step's few rows: not worth a barrier */
        quantize_rows(x, m, k, xq, xscale);
#pragma omp parallel num_threads(team)
    {
#ifdef _OPENMP
        int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
        int64_t t = 0, nt = 1;
#endif
        if (many) {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < m; r++) quantize_rows(x + r * k, 1, k, xq + r * k, xscale + r);
        }
        int64_t b_end = slices * (t + 1) / nt * slice;
#ifdef HAVE_AVX2
        int step = 2; /* the AVX2 tile's */
#else
        int step = tall ? 2 : NB;
#endif
        for (int64_t b = slices * t / nt * slice; b < b_end; b += step) {
            int nb = b_end - b < step ? (int)(b_end - b) : step;
            int64_t r = 0;
#ifdef HAVE_VNNI
            if (tall)
                for (nb = 2; r + TALL <= m; r += TALL) { /* the slice's last tall tile fetches the next */
                    const int8_t *next = r + 2 * TALL > m && b + 2 < b_end ? packed + (b + 2) * 16 * k : NULL;
                    tall_tile(xq + r * k, k, packed + b * 16 * k, sums + b * 16, wscale + b * 16, xscale + r, n,
                              y + r * n + b * 16, next);
                }
#endif
            for (; r < m; r += MR)
                run_tile(xq + r * k, k, m - r < MR ? (int)(m - r) : MR, packed + b * 16 * k, nb, sums + b * 16,
                         wscale + b * 16, xscale + r, n, y + r * n + b * 16);
        }
    }
    free(xq);
    free(xscale);
    return 0;
}
