/* Causal attention of a prefill chunk over its keys with int8 dot products (AVX512-VNNI).
 *
 * The same contract as prefill_attention.c's: q [n, heads, D], k and v [L, kv_heads, D], fp32;
 * query i sees keys 0 .. L - n + i. vpdpbusd does 64 multiply-adds an instruction, twice
 * vdpbf16ps's 32, so both products of the attention (q.k and p.v) take half the instructions of
 * the bf16 kernel. Roundings (SageAttention's, for a CPU), each a function of the keys a row
 * sees, so a row's bits do not depend on the call it came in (its chunk, a prefix-cache hit):
 *   k: the mean of the first 16 keys of each kv head is subtracted first (of all of them, where
 *      L < 16: rows of such a call are never reused by a longer one, as the prefix cache keeps
 *      whole blocks of 16 or more). That changes no softmax (a query's scores all move by the
 *      same q . mean), and it takes out the offset keys share, so the int8 steps are finer.
 *      Then one scale a key and kv head: max |k| / 127.
 *   q: one scale a query row and head, max |q| / 127; stored + 128 (vpdpbusd multiplies an
 *      unsigned byte by a signed one), the + 128 taken back with 128 * sum(k) a key.
 *   v: one scale a key and kv head, max |v| / 127, as the int8 KV cache's.
 *   p: in a block of 64 keys, each weight times its value's scale, rounded to 255ths of the
 *      block's largest such product: a block of small weights is stepped as finely as the
 *      block holding the max. The sum the output is divided by is of the unrounded weights.
 *      (Blocks of 32 had the same error against exact attention, 0.0018 on average, and took
 *      1.26-1.30x as long at 2K-8K keys: the softmax's costs a block, its maxima across rows,
 *      the running max's checks and the sums' updates, are spread over twice the keys.)
 * Scores, the softmax and the sums stay fp32. The layouts are built per call (O(L * D), against
 * the O(n * L * D) of the attention):
 *   kq [kv_heads][L / 16][D / 4][16]: 16 keys' 4 consecutive int8 dims a 32-bit lane
 *   vq [kv_heads][L / 4][D]: 4 consecutive keys' int8 values of one dim a lane
 * A work item is R query rows of one q head, in blocks of 64 keys, with prefill_attention.c's
 * running max (moved only by more than HEADROOM) and exp2 in log2 units.
 */
#include "common.h"
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_VNNI 1
#endif

#define KEYS 64 /* keys a block */
#define NV (KEYS / 16) /* vectors of 16 keys a block */
#define MEAN_KEYS 16 /* keys the mean key is taken over */
#define HEADROOM 8.0f
#define LOG2E 1.44269504088896341f

int prefill_attention_i8_fast(void) {
#ifdef HAVE_VNNI
    return 1;
#else
    return 0;
#endif
}

#ifdef HAVE_VNNI
#include "prefill_i8_block.h"
#include "prefill_i8_layouts.h"
#endif

/* Returns 0; -1 when scratch cannot be allocated; -2 when D is not 32, 64 or 128, or heads is
 * not a multiple of kv_heads; -3 where the kernel is not built (no AVX512-VNNI); out untouched
 * unless 0. */
int prefill_attention_i8(const float *q, int64_t n, const float *k, const float *v, int64_t L, int64_t heads,
                         int64_t kv_heads, int64_t d, float scale, int64_t threads, float *out) {
    if ((d != 32 && d != 64 && d != 128) || kv_heads <= 0 || heads % kv_heads != 0 || n > L)
        return -2;
#ifndef HAVE_VNNI
    (void)q, (void)k, (void)v, (void)scale, (void)threads, (void)out;
    return -3;
#else
    int64_t group = heads / kv_heads, team = threads > 0 ? threads : 1, ctx = L - n;
    int R = d <= 64 ? 4 : 2, DV = (int)(d / 16);
    int64_t lpad = (L + KEYS - 1) / KEYS * KEYS, quads = d / 4, blocks16 = lpad / 16;
    uint32_t *kq = malloc(kv_heads * lpad * quads * sizeof(uint32_t));
    uint32_t *vq = malloc(kv_heads * lpad * quads * sizeof(uint32_t));
    uint32_t *qq = malloc(n * heads * quads * sizeof(uint32_t));
    int32_t *kcorr = malloc(kv_heads * lpad * sizeof(int32_t));
    float *ks = malloc(kv_heads * lpad * sizeof(float)), *vs = malloc(kv_heads * lpad * sizeof(float));
    float *qs = malloc(n * heads * sizeof(float)), *kmean = calloc(kv_heads * d, sizeof(float));
    if (!kq || !vq || !qq || !kcorr || !ks || !vs || !qs || !kmean) {
        free(kq), free(vq), free(qq), free(kcorr), free(ks), free(vs), free(qs), free(kmean);
        return -1;
    }
    int64_t mean_keys = L < MEAN_KEYS ? L : MEAN_KEYS;
    for (int64_t key = 0; key < mean_keys; key++) /* each kv head's mean key, in key order */
        for (int64_t i = 0; i < kv_heads * d; i++) kmean[i] += k[key * kv_heads * d + i];
    for (int64_t i = 0; i < kv_heads * d; i++) kmean[i] /= (float)mean_keys;
    float mul = scale * LOG2E;
#pragma omp parallel num_threads(team)
    {
        uint32_t row[32];
#pragma omp for schedule(static) nowait
        for (int64_t it = 0; it < kv_heads * blocks16; it++) { /* keys: 16 rows, transposed */
            int64_t h = it / blocks16, b = it % blocks16;
            uint32_t *dst = kq + (h * blocks16 + b) * quads * 16;
            for (int64_t j = 0; j < 16; j++) {
                int64_t key = b * 16 + j;
                int32_t total = 0;
                float s = 0.0f;
                if (key < L)
                    s = quantize_row(k + (key * kv_heads + h) * d, kmean + h * d, d, 0, (uint8_t *)row, &total);
                else
                    memset(row, 0, sizeof(row));
                ks[h * lpad + key] = s;
                kcorr[h * lpad + key] = 128 * total;
                for (int64_t p = 0; p < quads; p++) dst[p * 16 + j] = row[p];
            }
        }
#pragma omp for schedule(static) nowait
        for (int64_t it = 0; it < kv_heads * (lpad / 4); it++) { /* values: quads of keys */
            int64_t h = it / (lpad / 4), first = (it % (lpad / 4)) * 4;
            value_quad(v + (first * kv_heads + h) * d, L - first, kv_heads * d, d, vq + it * d, vs + h * lpad + first);
        }
#pragma omp for schedule(static)
        for (int64_t it = 0; it < n * heads; it++) {
            int32_t total;
            qs[it] = quantize_row(q + it * d, NULL, d, 1, (uint8_t *)(qq + it * quads), &total) * mul;
        }
        int64_t row_blocks = (n + R - 1) / R;
        /* Heaviest blocks (the last rows see the most keys) first. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < heads * row_blocks; it++) {
            int64_t h = it % heads, r0 = (row_blocks - 1 - it / heads) * R, hk = h / group;
            int rows = (int)(n - r0 < R ? n - r0 : R);
            const uint32_t *rq[4];
            float rs[4];
            int64_t lim[4];
            for (int r = 0; r < R; r++) {
                int64_t i = r0 + (r < rows ? r : rows - 1);
                rq[r] = qq + (i * heads + h) * quads;
                rs[r] = qs[i * heads + h];
                lim[r] = ctx + i;
            }
            const uint32_t *khead = kq + hk * blocks16 * quads * 16, *vhead = vq + hk * (lpad / 4) * d;
            const int32_t *chead = kcorr + hk * lpad;
            const float *shead = ks + hk * lpad, *vshead = vs + hk * lpad;
            float *o = out + (r0 * heads + h) * d;
            if (DV == 4)
                rows_block_i8(rq, rs, lim, rows, khead, chead, shead, vhead, vshead, 4, 4, o, heads * d);
            else if (DV == 2)
                rows_block_i8(rq, rs, lim, rows, khead, chead, shead, vhead, vshead, 4, 2, o, heads * d);
            else
                rows_block_i8(rq, rs, lim, rows, khead, chead, shead, vhead, vshead, 2, 8, o, heads * d);
        }
    }
    free(kq), free(vq), free(qq), free(kcorr), free(ks), free(vs), free(qs), free(kmean);
    return 0;
#endif
}
