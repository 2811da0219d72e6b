/* A decode step's whole layer stack in one call: each layer the same C functions, in the same
 * order, on the same values as engine/fused_forward.py calls them one by one, so the same bits.
 * What it saves is the Python between them: ~270 calls a step through ctypes, each with its
 * argument conversion and a new torch tensor for its output (~3.5 ms of a 17 ms one-stream step
 * on a Zen 1 EPYC). Only for steps whose every row is a decode and whose every projection has
 * its per-row int8 weight, or every one its 4-bit weight (engine/decode_stack.py decides). */
#include "common.h"

/* the functions this file strings together (decode.c, linear_i8.c, linear_q4.c, attention.c) */
void rms_norm(float *x, const float *delta, const float *w, float *out, int64_t rows, int64_t n, float eps,
              int64_t threads);
void silu_mul(const float *gu, float *out, int64_t rows, int64_t n, int64_t threads);
void rope_write(float *qkv, int64_t rows, int64_t qkv_stride, int64_t heads, int64_t kv_heads, int64_t head_dim,
                const int64_t *positions, const float *cos, const float *sin, const int64_t *slots, void *k_cache,
                void *v_cache, int64_t kv_kind, int64_t threads);
int decode_attention(const float *q, int64_t q_stride, const void *k_cache, const void *v_cache, int64_t kv_kind,
                     const int64_t *tables, int64_t table_stride, const int64_t *lens, int64_t rows, int64_t heads,
                     int64_t kv_heads, int64_t head_dim, int64_t block_size, float scale, int64_t threads,
                     float *out);
int linear_i8(const float *x, int64_t m, int64_t k, const int8_t *packed, const int32_t *sums, const float *wscale,
              int64_t n, int64_t threads, float *y);
int linear_q4(const float *x, int64_t m, int64_t k, const uint8_t *packed, const float *dm, int64_t n,
              int64_t threads, float *y);

/* A layer's row of `weights`: its two norms' weights, then packed, sums and scale of each of its
 * four projections (engine/linear.py's RowQuantWeight), as addresses; for 4-bit weights packed,
 * dm and 0 (engine/q4_weight.py's Q4Weight). */
enum { ATTN_NORM, QKV, O = QKV + 3, MLP_NORM = O + 3, GATE_UP, DOWN = GATE_UP + 3, LAYER_WEIGHTS = DOWN + 3 };

static int project(const int64_t *w, int64_t q4, const float *x, int64_t rows, int64_t in, int64_t out,
                   int64_t threads, float *y) {
    if (q4)
        return linear_q4(x, rows, in, (const uint8_t *)w[0], (const float *)w[1], out, threads, y);
    return linear_i8(x, rows, in, (const int8_t *)w[0], (const int32_t *)w[1], (const float *)w[2], out, threads, y);
}

/* h [rows, hidden] through every layer, in place, its last residual added too; the KV of each
 * row written into layer i's keys and values at kv + i * 2 * kv_half and one kv_half (bytes)
 * after. The rest as rope_write and decode_attention take them. Returns 0, or -1 where scratch
 * could not be allocated (h then half through the stack: the caller raises). */
int decode_layers(float *h, int64_t rows, int64_t layers, const int64_t *weights, int64_t q4, char *kv,
                  int64_t kv_half, int64_t kv_kind, int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim,
                  int64_t intermediate, float eps, const int64_t *positions, const float *cos, const float *sin,
                  const int64_t *slots, const int64_t *tables, int64_t table_stride, const int64_t *lens,
                  int64_t block_size, float scale, int64_t threads) {
    int64_t q_size = heads * head_dim, qkv_n = q_size + 2 * kv_heads * head_dim;
    float *x = malloc(rows * (2 * hidden + qkv_n + q_size + 3 * intermediate + hidden) * sizeof(float));
    if (!x)
        return -1;
    float *qkv = x + rows * hidden, *a = qkv + rows * qkv_n, *o = a + rows * q_size, *gu = o + rows * hidden;
    float *act = gu + rows * 2 * intermediate, *delta = act + rows * intermediate;
    int status = 0;
    for (int64_t i = 0; i < layers && status == 0; i++) {
        const int64_t *w = weights + i * LAYER_WEIGHTS;
        char *k_cache = kv + 2 * i * kv_half, *v_cache = k_cache + kv_half;
        rms_norm(h, i ? delta : NULL, (const float *)w[ATTN_NORM], x, rows, hidden, eps, threads);
        status |= project(w + QKV, q4, x, rows, hidden, qkv_n, threads, qkv);
        rope_write(qkv, rows, qkv_n, heads, kv_heads, head_dim, positions, cos, sin, slots, k_cache, v_cache,
                   kv_kind, threads);
        status |= decode_attention(qkv, qkv_n, k_cache, v_cache, kv_kind, tables, table_stride, lens, rows, heads,
                                   kv_heads, head_dim, block_size, scale, threads, a);
        status |= project(w + O, q4, a, rows, q_size, hidden, threads, o);
        rms_norm(h, o, (const float *)w[MLP_NORM], x, rows, hidden, eps, threads);
        status |= project(w + GATE_UP, q4, x, rows, hidden, 2 * intermediate, threads, gu);
        silu_mul(gu, act, rows, intermediate, threads);
        status |= project(w + DOWN, q4, act, rows, intermediate, hidden, threads, delta);
    }
    if (status == 0)
        for (int64_t j = 0; j < rows * hidden; j++) h[j] += delta[j];
    free(x);
    return status ? -1 : 0;
}
