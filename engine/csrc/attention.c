/* Decode attention: each decode row's query heads over its own context, read from the paged
 * cache in place (see decode.c for the layouts, engine/native.py for why). fp32 caches, bf16 ones
 * (half the bytes, made floats as they are read), and int8 ones (engine/kv_codec.py: per token and kv
 * head, head_dim codes then the fp32 scale), whose codes are scaled as they are read: a quarter
 * of the bytes. The bytes are what bounds long contexts.
 * With AVX-512 the two inner loops run as attention_avx512.h's, with AVX2 alone as
 * attention_avx2.h's; int8 caches are summed in integers instead where the CPU has AVX512-VNNI
 * (attention_int8.h) or AVX2 alone (attention_int8_avx2.h, the same numbers).
 */
#include "common.h"
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

/* Keys of one row that one work item takes: long contexts split into segments (as flash-decoding
 * does) so that one row still keeps every thread busy; merged after. */
#define SEGMENT 256
#define SPLIT_FROM 64 /* keys from which a row takes two or more segments */
/* With AVX-512, the scores prefetch into L2 the keys L2_AHEAD on and the values of the keys they
 * score (once a kv head), and the value sums prefetch into L1 the values L1_AHEAD on. Without, each
 * key's first load had stalled: 30 layers of 8,000 keys from memory, a Zen 4 EPYC, us a layer:
 * bf16 cache 558-579 -> 307-343, fp32 679-742 -> 533-600, int8 375-412 -> 235-247 (from L3:
 * no change). Dropping either L2 prefetch cost 20-30% of that; L1 ones for the keys, nothing. */
#define L2_AHEAD 32
#define L1_AHEAD 16
#include "attention_avx2.h"
#include "attention_avx512.h"
#include "attention_int8.h"
#include "attention_int8_avx2.h"
#include "attention_bf16_avx2.h"

/* CALL(NH) with NH the constant 1-4 that `n` heads (>= 1) ask for, 4 where more: the kernels
 * take the heads of a GQA group 4 at a time, each variant with its sums in registers. */
#define BY_HEADS(n, CALL)        \
    switch (n) {                 \
    case 1: CALL(1); break;      \
    case 2: CALL(2); break;      \
    case 3: CALL(3); break;      \
    default: CALL(4); break;     \
    }
#define MAX_HEAD_DIM 512 /* engine/native.py's too */

/* One kv head of one cached token as floats: in place for fp32, widened into buf for bf16 and
 * int8 (the codes; *scale their scale, 1 for the others). */
static inline const float *kv_head(const void *cache, int64_t slot, int64_t g, int64_t kv_heads, int64_t head_dim,
                                   int kind, float *buf, float *scale) {
    const char *row = (const char *)cache + (slot * kv_heads + g) * kv_row_bytes(kind, head_dim);
    *scale = 1.0f;
    if (kind == KV_FP32)
        return (const float *)row;
    for (int64_t d = 0; d < head_dim; d++)
        buf[d] = kind == KV_BF16 ? bf16_to_float(((const uint16_t *)row)[d]) : (float)((const int8_t *)row)[d];
    if (kind == KV_INT8)
        memcpy(scale, row + head_dim, 4);
    return buf;
}

/* Scores, softmax numerator and its running sums of one work item: every query head of one row,
 * over keys [j_begin, j_end), each cached token's keys (all kv heads) read once, in order. Writes
 * the item's max m[h], sum l[h] of exp(s - m) and o[h] = sum of exp(s - m) v, unnormalised.
 * scores: scratch of heads * SEGMENT; caches as `kind` (common.h) holds them. */
static void attend_segment(const float *q, const void *k_cache, const void *v_cache, int kind, const int64_t *table,
                           int64_t j_begin, int64_t j_end, int64_t heads, int64_t kv_heads, int64_t head_dim,
                           int64_t block_size, float scale, float *scores, float *m, float *l, float *o) {
    int64_t n = j_end - j_begin, group = heads / kv_heads;
    int64_t slot[SEGMENT];
    float buf[MAX_HEAD_DIM], ks;
    for (int64_t j = 0, b = j_begin / block_size, i = j_begin % block_size; j < n; j++) {
        slot[j] = table[b] * block_size + i;
        if (++i == block_size) b++, i = 0;
    }
#ifdef INT8_ATTENTION
    int int8_path = kind == KV_INT8 && head_dim % 64 == 0;
#endif
#ifdef __AVX512F__
    if (head_dim % 16 == 0) { /* 16 keys at a time, their sums reduced together */
        int64_t row = kv_row_bytes(kind, head_dim), off[SEGMENT + 16 + L2_AHEAD];
        float kscale[SEGMENT + 16], qs[heads * head_dim]; /* bf16: q split as bdots_heads takes it */
        for (int64_t j = 0; j < n + 16 + L2_AHEAD; j++) /* bytes; pad: key 0 */
            off[j] = slot[j < n ? j : 0] * kv_heads * row;
        if (kind == KV_BF16 && head_dim % 32 == 0)
            for (int64_t i = 0; i < heads * head_dim; i += 32)
                for (int d = 0; d < 16; d++) qs[i + d] = q[i + 2 * d], qs[i + 16 + d] = q[i + 2 * d + 1];
        for (int64_t g = 0; g < kv_heads; g++) {
            const char *kg = (const char *)k_cache + g * row, *vg = (const char *)v_cache + g * row;
            for (int64_t j = 0; j < n && j < L2_AHEAD; j++) /* the scores prefetch from L2_AHEAD keys on */
                prefetch_bytes(kg + off[j], row, 1);
#ifdef INT8_ATTENTION
            if (int8_path) { /* reads the keys' scales after their scores */
                for (int64_t h = g * group; h < (g + 1) * group; h += 4) {
#define IS(NH)                                                                                                  \
    int8_scores(q + h * head_dim, NH, (const int8_t *)kg, (const int8_t *)vg, h == g * group, off, scale, n, head_dim, \
                scores + h * SEGMENT, SEGMENT)
                    BY_HEADS((g + 1) * group - h, IS);
#undef IS
                }
                continue;
            }
#endif
            if (kind == KV_BF16 && head_dim % 32 == 0) {
                for (int64_t h = g * group; h < (g + 1) * group; h += 4) {
#define BS(NH)                                                                                                  \
    bf16_scores(qs + h * head_dim, NH, kg, vg, h == g * group, off, row, n, head_dim, scale, scores + h * SEGMENT, \
                SEGMENT)
                    BY_HEADS((g + 1) * group - h, BS);
#undef BS
                }
                continue;
            }
            for (int64_t j = 0; j < n + 16; j++) {
                kscale[j] = scale;
                if (kind == KV_INT8) memcpy(&ks, kg + off[j] + head_dim, 4), kscale[j] = ks * scale;
            }
            for (int64_t h = g * group; h < (g + 1) * group; h++)
                for (int64_t j = 0; j < n; j += 16) {
                    for (int i = 0; h == g * group && i < 16; i++) {
                        prefetch_bytes(kg + off[j + L2_AHEAD + i], row, 1);
                        prefetch_bytes(vg + off[j + i], row, 1);
                    }
                    __m512 d = kind == KV_INT8   ? dots16(q + h * head_dim, kg, off + j, KV_INT8, head_dim)
                               : kind != KV_BF16 ? dots16(q + h * head_dim, kg, off + j, KV_FP32, head_dim)
                                                 : dots16(q + h * head_dim, kg, off + j, KV_BF16, head_dim);
                    float tmp[16];
                    _mm512_storeu_ps(tmp, _mm512_mul_ps(d, _mm512_loadu_ps(kscale + j)));
                    memcpy(scores + h * SEGMENT + j, tmp, (n - j < 16 ? n - j : 16) * sizeof(float));
                }
        }
    } else
#elif defined(AVX2_ATTENTION)
    if (int8_path)
        avx2_int8_scores(q, (const int8_t *)k_cache, (const int8_t *)v_cache, slot, n, heads, kv_heads, head_dim,
                         scale, scores);
    else if (kind == KV_BF16 && head_dim % 16 == 0)
        avx2_bf16_scores(q, k_cache, slot, n, heads, kv_heads, head_dim, scale, scores);
    else if (head_dim % 8 == 0)
        avx2_scores(q, k_cache, kind, slot, n, heads, kv_heads, head_dim, scale, scores);
    else
#endif
        for (int64_t j = 0; j < n; j++)
            for (int64_t g = 0; g < kv_heads; g++) {
                const float *k = kv_head(k_cache, slot[j], g, kv_heads, head_dim, kind, buf, &ks);
                for (int64_t h = g * group; h < (g + 1) * group; h++)
                    scores[h * SEGMENT + j] = dot(q + h * head_dim, k, (int)head_dim) * ks * scale;
            }
    for (int64_t h = 0; h < heads; h++) {
#ifdef AVX2_ATTENTION
        avx2_softmax_row(scores + h * SEGMENT, n, m + h, l + h);
#else
        float *s = scores + h * SEGMENT, mx = max_of(s, n);
        for (int64_t j = 0; j < n; j++) s[j] = exp_approx(s[j] - mx);
        m[h] = mx;
        l[h] = sum(s, n);
#endif
    }
#ifdef __AVX512F__
    if (head_dim % 64 == 0) {
        int64_t off[SEGMENT + 1 + L1_AHEAD]; /* each key's slot, in bytes; pad: key 0 */
        float vscale[SEGMENT]; /* int8: each value's scale */
        int64_t row = kv_row_bytes(kind, head_dim);
        for (int64_t j = 0; j <= n + L1_AHEAD; j++) off[j] = slot[j < n ? j : 0] * kv_heads * row;
        for (int64_t g = 0; g < kv_heads; g++) {
            const int8_t *vrow = (const int8_t *)v_cache + g * row + head_dim; /* int8: a value's scale */
            if (kind == KV_INT8)
                for (int64_t j = 0; j < n; j++) memcpy(vscale + j, vrow + off[j], 4);
#ifdef INT8_ATTENTION
            if (int8_path) {
                for (int64_t h = g * group; h < (g + 1) * group; h += 4) {
#define IV(NH) int8_values(scores + h * SEGMENT, NH, vscale, vrow - head_dim, off, n, o + h * head_dim, head_dim)
                    BY_HEADS((g + 1) * group - h, IV);
#undef IV
                }
                continue;
            }
#endif
            for (int64_t c = 0; c < head_dim; c += 64)
                for (int64_t h = g * group; h < (g + 1) * group; h += 4) {
                    int nh = (g + 1) * group - h < 4 ? (int)((g + 1) * group - h) : 4;
                    const float *sh = scores + h * SEGMENT;
                    float *oh = o + h * head_dim + c;
                    const char *vg = (const char *)v_cache + g * row + c * kv_elem_bytes(kind);
/* constants for pv_tile's kind and nh, so that each variant keeps its sums in registers */
#define PV(NH) (kind == KV_INT8   ? pv_tile(sh, vg, off, vscale, KV_INT8, n, NH, oh, head_dim) \
                : kind == KV_BF16 ? pv_tile(sh, vg, off, NULL, KV_BF16, n, NH, oh, head_dim) \
                                  : pv_tile(sh, vg, off, NULL, KV_FP32, n, NH, oh, head_dim))
                    BY_HEADS(nh, PV);
#undef PV
                }
        }
        return;
    }
#elif defined(AVX2_ATTENTION)
    if (int8_path) {
        avx2_int8_values(scores, (const int8_t *)v_cache, slot, n, heads, kv_heads, head_dim, o);
        return;
    }
    if (head_dim % 16 == 0) {
        avx2_values(scores, v_cache, kind, slot, n, heads, kv_heads, head_dim, o);
        return;
    }
#endif
    memset(o, 0, heads * head_dim * sizeof(float));
    for (int64_t j = 0; j < n; j++)
        for (int64_t g = 0; g < kv_heads; g++) {
            float vs;
            const float *v = kv_head(v_cache, slot[j], g, kv_heads, head_dim, kind, buf, &vs);
            for (int64_t h = g * group; h < (g + 1) * group; h++) {
                const float p = scores[h * SEGMENT + j] * vs;
                float *oh = o + h * head_dim;
                for (int64_t d = 0; d < head_dim; d++) oh[d] += p * v[d];
            }
        }
}

int decode_attention_int8_fast(void) {
#ifdef INT8_ATTENTION
    return 1;
#else
    return 0;
#endif
}

/* The keys of each segment of a row of `len` keys: at most SEGMENT, and an even count of equal
 * segments (to 16 keys) from SPLIT_FROM keys on, so that one row keeps two threads busy (below
 * 256 keys a one-stream step's attention had run on one thread of two: a quarter of the step's
 * time on a Zen 1 EPYC). A function of the row's length alone: a row's bits do not depend on
 * what else the step holds (speculation is exact by that) nor on the thread count. */
static int64_t segment_len(int64_t len) {
    if (len < SPLIT_FROM)
        return SEGMENT;
    int64_t segs = (len + SEGMENT - 1) / SEGMENT;
    segs += segs & 1;
    return ((len + segs - 1) / segs + 15) / 16 * 16;
}

/* Each decode row's attention over its own context, straight from the paged cache, each query
 * head with the kv head its group shares (GQA). Work items (row, segment of segment_len keys) run on
 * `threads` OpenMP threads (the caller's team: torch's), then each row's segments are merged by
 * their maxima. q [rows, q_stride], its heads first; out [rows, heads * head_dim]. Returns 0, or
 * -1 with out untouched when its scratch cannot be allocated. */
int decode_attention(const float *q, int64_t q_stride, const void *k_cache, const void *v_cache, int64_t kv_kind,
                     const int64_t *tables, int64_t table_stride, const int64_t *lens, int64_t rows, int64_t heads,
                     int64_t kv_heads, int64_t head_dim, int64_t block_size, float scale, int64_t threads,
                     float *out) {
    int64_t max_segs = 1;
    for (int64_t r = 0; r < rows; r++) {
        int64_t segs = (lens[r] + segment_len(lens[r]) - 1) / segment_len(lens[r]);
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
        int64_t r = it / max_segs, seg = segment_len(lens[r]), begin = it % max_segs * seg;
        int64_t end = begin + seg < lens[r] ? begin + seg : lens[r];
        float *m = partial + it * per_item, *l = m + heads, *o = l + heads;
        if (begin < end)
            attend_segment(q + r * q_stride, k_cache, v_cache, (int)kv_kind, tables + r * table_stride, begin, end,
                           heads, kv_heads, head_dim, block_size, scale, scores, m, l, o);
    }
    for (int64_t r = 0; r < rows; r++) {
        int64_t segs = (lens[r] + segment_len(lens[r]) - 1) / segment_len(lens[r]);
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
