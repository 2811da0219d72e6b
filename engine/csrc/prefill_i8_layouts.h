/* The int8 prefill attention's operands, built per call (prefill_attention_i8.c): rows rounded to
 * int8 steps, and four keys' values interleaved a 32-bit lane for vpdpbusd. AVX-512 only. */
#ifndef TANDEM_PREFILL_I8_LAYOUTS_H
#define TANDEM_PREFILL_I8_LAYOUTS_H
#include "common.h"
#include <immintrin.h>

/* 16 fp32 -> 16 int32 steps of `inv` (round to nearest even, saturated to +-127). */
static inline __m512i steps(__m512 x, __m512 inv) {
    __m512i i = _mm512_cvtps_epi32(_mm512_mul_ps(x, inv));
    return _mm512_max_epi32(_mm512_min_epi32(i, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
}

/* A row of D fp32 (less `sub` where given) -> D int8 steps of max |x| / 127 in `out` (+ 128 when
 * `offset`, as unsigned bytes); returns the scale and sets *total to the sum of the steps. */
static inline float quantize_row(const float *x, const float *sub, int64_t d, int offset, uint8_t *out,
                                 int32_t *total) {
    __m512 v[8], amax = _mm512_setzero_ps();
    for (int64_t c = 0; c < d / 16; c++) {
        v[c] = _mm512_loadu_ps(x + c * 16);
        if (sub)
            v[c] = _mm512_sub_ps(v[c], _mm512_loadu_ps(sub + c * 16));
        amax = _mm512_max_ps(amax, _mm512_abs_ps(v[c]));
    }
    float top = _mm512_reduce_max_ps(amax);
    __m512 inv = _mm512_set1_ps(top > 0.0f ? 127.0f / top : 0.0f);
    __m512i sum = _mm512_setzero_si512();
    for (int64_t c = 0; c < d / 16; c++) {
        __m512i i = steps(v[c], inv);
        sum = _mm512_add_epi32(sum, i);
        if (offset)
            i = _mm512_add_epi32(i, _mm512_set1_epi32(128));
        _mm_storeu_si128((__m128i *)(out + c * 16), _mm512_cvtepi32_epi8(i));
    }
    *total = _mm512_reduce_add_epi32(sum);
    return top / 127.0f;
}

/* Keys 4t .. 4t + 3 of one kv head (their int32 steps, one vector each) -> 16 lanes of 4 bytes. */
static inline __m512i quad_lanes(__m512i a, __m512i b, __m512i c, __m512i d) {
    const __m512i low = _mm512_set1_epi32(0xFF);
    __m512i w = _mm512_and_si512(a, low);
    w = _mm512_or_si512(w, _mm512_slli_epi32(_mm512_and_si512(b, low), 8));
    w = _mm512_or_si512(w, _mm512_slli_epi32(_mm512_and_si512(c, low), 16));
    return _mm512_or_si512(w, _mm512_slli_epi32(d, 24));
}

/* Keys 4t .. 4t + 3 of one kv head (v_stride floats from one key to the next; `count` of them
 * real) -> vq's D lanes of 4 bytes, and the 4 keys' scales. */
static void value_quad(const float *v, int64_t count, int64_t v_stride, int64_t d, uint32_t *dst, float *scale) {
    __m512i s[4][8];
    for (int64_t j = 0; j < 4; j++) {
        int32_t total;
        uint8_t codes[128];
        scale[j] = j < count ? quantize_row(v + j * v_stride, NULL, d, 0, codes, &total) : 0.0f;
        for (int64_t c = 0; c < d / 16; c++)
            s[j][c] = j < count ? _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(codes + c * 16)))
                                : _mm512_setzero_si512();
    }
    for (int64_t c = 0; c < d / 16; c++)
        _mm512_storeu_si512(dst + c * 16, quad_lanes(s[0][c], s[1][c], s[2][c], s[3][c]));
}

#endif
