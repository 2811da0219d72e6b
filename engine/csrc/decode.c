/* The small ops of a decode step, fused: what costs a step most on the CPU is not the
 * arithmetic of these but the ~40 torch dispatches a layer they take (see engine/native.py).
 *
 * fp32 only, plain loops that gcc vectorizes (-O3 -march=native), and attention's two inner
 * products in AVX-512 where the CPU has it (a head's score, and the value sums of the q heads
 * that share a kv head); attention runs on OpenMP threads, the rest on the caller's (decode
 * rows are few). Built with -ffp-contract=off, so a*b + c rounds twice as torch's separate ops
 * do: RoPE is bit-identical to torch's; RMSNorm, SiLU and attention differ in the last bits
 * (their sums and exp run in another order and another polynomial, attention's with fused
 * multiply-adds).
 *
 * Layouts (all row-major, contiguous unless a stride is given):
 *   qkv      [rows, qkv_stride]: q heads, then k heads, then v heads, each head_dim wide
 *   cache    [slots, kv_heads, head_dim] of one layer (keys or values); slot = block * bs + i
 *   tables   [rows, table_stride] int64 block ids; lens [rows] int64 context, own token included
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

#define LANES 16

/* exp(x) for x <= 0 or moderate x, as Cephes expf: 2^n * p(r), |error| ~1 ulp; branch-free so
 * that loops over it vectorize. */
static inline float exp_approx(float x) {
    x = x < -87.3f ? -87.3f : x;
    x = x > 88.3f ? 88.3f : x;
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { int32_t i; float f; } scale = {.i = ((int32_t)n + 127) << 23};
    return p * scale.f;
}

static inline float dot(const float *a, const float *b, int n) {
    float acc[LANES] = {0};
    int i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += a[i + l] * b[i + l];
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int l = 0; l < w; l++) acc[l] += acc[l + w];
    float s = acc[0];
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* dot() of a head: one vector accumulator and one horizontal sum where the head is whole AVX-512
 * vectors (a key's score was mostly dot()'s 16-lane reduction tree: 4x slower). */
static inline float head_dot(const float *a, const float *b, int64_t n) {
#ifdef __AVX512F__
    if (n % 16 == 0) {
        __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(a), _mm512_loadu_ps(b));
        for (int64_t i = 16; i < n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
        return _mm512_reduce_add_ps(acc);
    }
#endif
    return dot(a, b, (int)n);
}

static inline float sum(const float *a, int64_t n) {
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += a[i + l];
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int l = 0; l < w; l++) acc[l] += acc[l + w];
    float s = acc[0];
    for (; i < n; i++) s += a[i];
    return s;
}

/* out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w, each of `rows` rows `n` wide. With `delta`, x
 * first becomes x + delta, in place (the residual add before the norm). */
void rms_norm(float *x, const float *delta, const float *w, float *out, int64_t rows, int64_t n, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        float *xr = x + r * n;
        if (delta) {
            const float *dr = delta + r * n;
            for (int64_t i = 0; i < n; i++) xr[i] += dr[i];
        }
        float inv = 1.0f / sqrtf(dot(xr, xr, (int)n) / (float)n + eps);
        float *o = out + r * n;
        for (int64_t i = 0; i < n; i++) o[i] = w[i] * (xr[i] * inv);
    }
}

/* out[r] = silu(gu[r, :n]) * gu[r, n:], gu [rows, 2n]. */
void silu_mul(const float *gu, float *out, int64_t rows, int64_t n) {
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gu + r * 2 * n, *u = g + n;
        float *o = out + r * n;
        for (int64_t i = 0; i < n; i++) o[i] = g[i] / (1.0f + exp_approx(-g[i])) * u[i];
    }
}

/* RoPE (HF's rotate_half form) on the q and k heads of each row of qkv, in place, then the row's
 * k and v heads copied into the caches at slots[r]. cos, sin: [positions, head_dim]; sin carries
 * rotate_half's sign (-sin on the first half). */
void rope_write(float *qkv, int64_t rows, int64_t qkv_stride, int64_t heads, int64_t kv_heads, int64_t head_dim,
                const int64_t *positions, const float *cos, const float *sin, const int64_t *slots, float *k_cache,
                float *v_cache) {
    int64_t half = head_dim / 2, kv_width = kv_heads * head_dim;
    float tmp[512];
    for (int64_t r = 0; r < rows; r++) {
        float *row = qkv + r * qkv_stride;
        const float *c = cos + positions[r] * head_dim, *s = sin + positions[r] * head_dim;
        for (int64_t h = 0; h < heads + kv_heads; h++) {
            float *x = row + h * head_dim;
            for (int64_t i = 0; i < half; i++) {
                tmp[i] = x[i + half] * s[i];
                tmp[i + half] = x[i] * s[i + half];
            }
            for (int64_t i = 0; i < head_dim; i++) x[i] = x[i] * c[i] + tmp[i];
        }
        memcpy(k_cache + slots[r] * kv_width, row + heads * head_dim, kv_width * sizeof(float));
        memcpy(v_cache + slots[r] * kv_width, row + (heads + kv_heads) * head_dim, kv_width * sizeof(float));
    }
}

/* Keys of one row that one work item takes: long contexts split into segments (as flash-decoding
 * does) so that one row still keeps every thread busy; merged after. */
#define SEGMENT 256

#ifdef __AVX512F__
/* o[t] = sum_j p[t][j] v_j over 64 dims, for `nh` (1-4, a constant where called) query heads that
 * share one kv head: each value vector is loaded once for all of them, and the sums stay in
 * registers. p: scores rows SEGMENT apart; v_j at v + off[j]; o rows head_dim apart. */
static inline __attribute__((always_inline)) void pv_tile(const float *p, const float *v, const int64_t *off,
                                                          int64_t n, int nh, float *o, int64_t head_dim) {
    __m512 acc[4][4];
    for (int t = 0; t < 4; t++)
        for (int c = 0; c < 4; c++) acc[t][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j++) {
        const float *vj = v + off[j];
        __m512 vv[4];
        for (int c = 0; c < 4; c++) vv[c] = _mm512_loadu_ps(vj + 16 * c);
        for (int t = 0; t < nh; t++) {
            __m512 pt = _mm512_set1_ps(p[t * SEGMENT + j]);
            for (int c = 0; c < 4; c++) acc[t][c] = _mm512_fmadd_ps(pt, vv[c], acc[t][c]);
        }
    }
    for (int t = 0; t < nh; t++)
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(o + t * head_dim + 16 * c, acc[t][c]);
}
#endif

/* Scores, softmax numerator and its running sums of one work item: every query head of one row,
 * over keys [j_begin, j_end), each cached token's keys (all kv heads) read once, in order. Writes
 * the item's max m[h], sum l[h] of exp(s - m) and o[h] = sum of exp(s - m) v, unnormalised.
 * scores: scratch of heads * SEGMENT. */
static void attend_segment(const float *q, const float *k_cache, const float *v_cache, const int64_t *table,
                           int64_t j_begin, int64_t j_end, int64_t heads, int64_t kv_heads, int64_t head_dim,
                           int64_t block_size, float scale, float *scores, float *m, float *l, float *o) {
    int64_t n = j_end - j_begin, group = heads / kv_heads, kv_width = kv_heads * head_dim;
    for (int64_t j = 0, b = j_begin / block_size, i = j_begin % block_size; j < n; j++) {
        const float *k = k_cache + (table[b] * block_size + i) * kv_width;
        for (int64_t h = 0; h < heads; h++)
            scores[h * SEGMENT + j] = head_dot(q + h * head_dim, k + h / group * head_dim, head_dim) * scale;
        if (++i == block_size) b++, i = 0;
    }
    for (int64_t h = 0; h < heads; h++) {
        float *s = scores + h * SEGMENT, mx = s[0];
        for (int64_t j = 1; j < n; j++) mx = s[j] > mx ? s[j] : mx;
        for (int64_t j = 0; j < n; j++) s[j] = exp_approx(s[j] - mx);
        m[h] = mx;
        l[h] = sum(s, n);
    }
#ifdef __AVX512F__
    if (head_dim % 64 == 0) {
        int64_t off[SEGMENT]; /* each key's slot, times the slot's width */
        for (int64_t j = 0, b = j_begin / block_size, i = j_begin % block_size; j < n; j++) {
            off[j] = (table[b] * block_size + i) * kv_width;
            if (++i == block_size) b++, i = 0;
        }
        for (int64_t g = 0; g < kv_heads; g++)
            for (int64_t c = 0; c < head_dim; c += 64)
                for (int64_t h = g * group; h < (g + 1) * group; h += 4) {
                    int nh = (g + 1) * group - h < 4 ? (int)((g + 1) * group - h) : 4;
                    const float *vg = v_cache + g * head_dim + c, *sh = scores + h * SEGMENT;
                    float *oh = o + h * head_dim + c;
                    switch (nh) {
                    case 1: pv_tile(sh, vg, off, n, 1, oh, head_dim); break;
                    case 2: pv_tile(sh, vg, off, n, 2, oh, head_dim); break;
                    case 3: pv_tile(sh, vg, off, n, 3, oh, head_dim); break;
                    default: pv_tile(sh, vg, off, n, 4, oh, head_dim); break;
                    }
                }
        return;
    }
#endif
    memset(o, 0, heads * head_dim * sizeof(float));
    for (int64_t j = 0, b = j_begin / block_size, i = j_begin % block_size; j < n; j++) {
        const float *v = v_cache + (table[b] * block_size + i) * kv_width;
        for (int64_t h = 0; h < heads; h++) {
            const float p = scores[h * SEGMENT + j], *vh = v + h / group * head_dim;
            float *oh = o + h * head_dim;
            for (int64_t d = 0; d < head_dim; d++) oh[d] += p * vh[d];
        }
        if (++i == block_size) b++, i = 0;
    }
}

/* Each decode row's attention over its own context, straight from the paged cache, each query
 * head with the kv head its group shares (GQA). Work items (row, segment of SEGMENT keys) run on
 * `threads` OpenMP threads (the caller's team: torch's), then each row's segments are merged by
 * their maxima. q [rows, q_stride], its heads first; out [rows, heads * head_dim]. Returns 0, or
 * -1 with out untouched when its scratch cannot be allocated. */
int decode_attention(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                     const int64_t *tables, int64_t table_stride, const int64_t *lens, int64_t rows, int64_t heads,
                     int64_t kv_heads, int64_t head_dim, int64_t block_size, float scale, int64_t threads,
                     float *out) {
    int64_t max_segs = 1;
    for (int64_t r = 0; r < rows; r++) {
        int64_t segs = (lens[r] + SEGMENT - 1) / SEGMENT;
        max_segs = segs > max_segs ? segs : max_segs;
    }
    int64_t items = rows * max_segs, per_item = heads * (2 + head_dim), team = threads > 0 ? threads : 1;
    float *partial = malloc(items * per_item * sizeof(float)); /* m[heads], l[heads], o[heads][D] */
    float *scratch = malloc(team * heads * SEGMENT * sizeof(float)); /* each thread's scores */
    if (!partial || !scratch) {
        free(partial);
        free(scratch);
        return -1;
    }
#pragma omp parallel for num_threads(team) schedule(dynamic, 1)
    for (int64_t it = 0; it < items; it++) {
#ifdef _OPENMP
        float *scores = scratch + omp_get_thread_num() * heads * SEGMENT;
#else
        float *scores = scratch;
#endif
        int64_t r = it / max_segs, begin = it % max_segs * SEGMENT;
        int64_t end = begin + SEGMENT < lens[r] ? begin + SEGMENT : lens[r];
        float *m = partial + it * per_item, *l = m + heads, *o = l + heads;
        if (begin < end)
            attend_segment(q + r * q_stride, k_cache, v_cache, tables + r * table_stride, begin, end, heads,
                           kv_heads, head_dim, block_size, scale, scores, m, l, o);
    }
    for (int64_t r = 0; r < rows; r++) {
        int64_t segs = (lens[r] + SEGMENT - 1) / SEGMENT;
        const float *first = partial + r * max_segs * per_item;
        for (int64_t h = 0; h < heads; h++) {
            float mx = first[h], total = 0.0f, *oh = out + (r * heads + h) * head_dim;
            for (int64_t sg = 1; sg < segs; sg++) mx = first[sg * per_item + h] > mx ? first[sg * per_item + h] : mx;
            memset(oh, 0, head_dim * sizeof(float));
            for (int64_t sg = 0; sg < segs; sg++) {
                const float *p = first + sg * per_item, *os = p + 2 * heads + h * head_dim;
                float w = exp_approx(p[h] - mx);
                total += w * p[heads + h];
                for (int64_t d = 0; d < head_dim; d++) oh[d] += w * os[d];
            }
            float inv = 1.0f / total;
            for (int64_t d = 0; d < head_dim; d++) oh[d] *= inv;
        }
    }
    free(partial);
    free(scratch);
    return 0;
}
