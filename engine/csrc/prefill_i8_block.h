/* One work item of the int8 prefill attention (prefill_attention_i8.c): R query rows of one q
 * head against their keys, in blocks of KEYS, with the softmax between the two products.
 * AVX512-VNNI only; the includer defines KEYS, NV, HEADROOM. */
#ifndef TANDEM_PREFILL_I8_BLOCK_H
#define TANDEM_PREFILL_I8_BLOCK_H
#include "common.h"
#include <immintrin.h>

/* 2^x for x <= 0 where the result is rounded to 8 bits after (a weight, against its block's
 * largest): a minimax cubic for 2^f on [-0.5, 0.5], |rel. error| < 7.5e-5, a 50th of the 8-bit
 * step.
 * -inf (a masked key) gives NaN: callers zero those lanes. */
static inline __m512 exp2_coarse(__m512 x) {
    __m512 i = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(x, i);
    __m512 p = _mm512_set1_ps(5.517132e-2f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4261054e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9326097e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.999281e-1f));
    return _mm512_scalef_ps(p, i);
}

/* The maxima of four rows of 16 at once: lanes 4g .. 4g + 3 of the result hold row g's. Thirteen
 * ops for four rows, where one row's own reduction takes seven. */
static inline __m512 max_of_rows(__m512 a, __m512 b, __m512 c, __m512 d) {
    __m512 ab = _mm512_max_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
    __m512 cd = _mm512_max_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
    __m512 m = _mm512_max_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
    m = _mm512_max_ps(m, _mm512_permute_ps(m, 0x4E));
    return _mm512_max_ps(m, _mm512_permute_ps(m, 0xB1));
}

/* Bytes 0..255 in the low byte of each int32 lane of a, b, c, d (keys 0-15, 16-31, 32-47,
 * 48-63) -> one vector of the 64 bytes in key order. packus interleaves the four by 128-bit lane
 * (lane L holds quads L, 4 + L, 8 + L, 12 + L); the vpermd puts quad t back at t. */
static inline __m512i bytes_of(__m512i a, __m512i b, __m512i c, __m512i d) {
    const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    __m512i packed = _mm512_packus_epi16(_mm512_packus_epi32(a, b), _mm512_packus_epi32(c, d));
    return _mm512_permutexvar_epi32(order, packed);
}

/* R query rows (quads in qq, scales in qs, each row's last visible key in lim) against keys
 * 0 .. lim[R - 1]; DV = D / 16. Writes the `rows` real rows of out (row stride out_stride). The
 * running sums and outputs live in memory, touched once a block: kept in 20 registers across
 * the loop, they left the products too few, and gcc shuffled and spilled the accumulators. */
static inline __attribute__((always_inline)) void rows_block_i8(const uint32_t *const *qq, const float *qs,
                                                                 const int64_t *lim, int rows, const uint32_t *kq,
                                                                 const int32_t *kcorr, const float *ks,
                                                                 const uint32_t *vq, const float *vs, int R, int DV,
                                                                 float *out, int64_t out_stride) {
    const int64_t quads = DV * 4;
    float acc[4][128] __attribute__((aligned(64))), l[4][16] __attribute__((aligned(64)));
    uint32_t pw[4][KEYS / 4] __attribute__((aligned(64)));
    float m[4], rise[16] = {0}, big[16] = {0}, grow[16], pscale[16], up[16];
    __m512 psum[4], w[4][NV];
    for (int r = 0; r < 4; r++) {
        m[r] = -INFINITY;
        _mm512_store_ps(l[r], _mm512_setzero_ps());
        for (int c = 0; c < DV; c++) _mm512_store_ps(acc[r] + c * 16, _mm512_setzero_ps());
    }
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    for (int64_t kb = 0; kb <= lim[R - 1]; kb += KEYS) {
        __m512i si[4][NV];
        for (int r = 0; r < R; r++)
            for (int j = 0; j < NV; j++) si[r][j] = _mm512_setzero_si512();
        const uint32_t *k0 = kq + (kb / 16) * quads * 16;
        for (int64_t p = 0; p < quads; p++) {
            __m512i a[NV];
            for (int j = 0; j < NV; j++) a[j] = _mm512_loadu_si512(k0 + (j * quads + p) * 16);
            for (int r = 0; r < R; r++) {
                __m512i qb = _mm512_set1_epi32((int)qq[r][p]);
                for (int j = 0; j < NV; j++) si[r][j] = dpbusd(si[r][j], qb, a[j]);
            }
        }
        const int whole = kb + KEYS - 1 <= lim[0]; /* every row sees every key of the block */
        __m512 sc[4][NV], mx[4];
        __mmask16 ok[4][NV];
        for (int r = 0; r < 4; r++) {
            if (r >= R) {
                mx[r] = ninf;
                continue;
            }
            __m512 qr = _mm512_set1_ps(qs[r]);
            mx[r] = ninf;
            for (int j = 0; j < NV; j++) {
                const int64_t key = kb + 16 * j;
                __m512i exact = _mm512_sub_epi32(si[r][j], _mm512_loadu_si512(kcorr + key));
                sc[r][j] = _mm512_mul_ps(_mm512_cvtepi32_ps(exact), _mm512_mul_ps(_mm512_loadu_ps(ks + key), qr));
                ok[r][j] = 0xFFFF;
                if (!whole) {
                    __m512i first = _mm512_add_epi32(lane, _mm512_set1_epi32((int)key));
                    ok[r][j] = _mm512_cmple_epi32_mask(first, _mm512_set1_epi32((int)lim[r]));
                    sc[r][j] = _mm512_mask_mov_ps(ninf, ok[r][j], sc[r][j]);
                }
                mx[r] = _mm512_max_ps(mx[r], sc[r][j]);
            }
        }
        float tops[16];
        _mm512_storeu_ps(tops, max_of_rows(mx[0], mx[1], mx[2], mx[3]));
        __m512 wm[4];
        for (int r = 0; r < 4; r++) {
            wm[r] = _mm512_setzero_ps();
            if (r >= R)
                continue;
            float top = tops[4 * r];
            if (top == -INFINITY) { /* a row that sees none of the block's keys */
                rise[r] = -INFINITY;
                psum[r] = _mm512_setzero_ps();
                for (int j = 0; j < NV; j++) w[r][j] = _mm512_setzero_ps();
                continue;
            }
            if (top > m[r] + HEADROOM) { /* key 0 is in every row's first block: m is finite after it */
                __m512 al = _mm512_set1_ps(exp_approx((m[r] - top) * 0.69314718f));
                m[r] = top;
                _mm512_store_ps(l[r], _mm512_mul_ps(_mm512_load_ps(l[r]), al));
                for (int c = 0; c < DV; c++)
                    _mm512_store_ps(acc[r] + c * 16, _mm512_mul_ps(_mm512_load_ps(acc[r] + c * 16), al));
            }
            rise[r] = top - m[r]; /* the block's weights are 2^rise times these, against the running max */
            __m512 tv = _mm512_set1_ps(top);
            psum[r] = _mm512_setzero_ps();
            for (int j = 0; j < NV; j++) {
                __m512 pj = _mm512_maskz_mov_ps(ok[r][j], exp2_coarse(_mm512_sub_ps(sc[r][j], tv)));
                psum[r] = _mm512_add_ps(psum[r], pj);
                w[r][j] = _mm512_mul_ps(pj, _mm512_loadu_ps(vs + kb + 16 * j));
                wm[r] = _mm512_max_ps(wm[r], w[r][j]);
            }
        }
        float bigs[16];
        _mm512_storeu_ps(bigs, max_of_rows(wm[0], wm[1], wm[2], wm[3]));
        for (int r = 0; r < R; r++) big[r] = bigs[4 * r];
        /* For all R rows at once: 2^rise; 255 / the largest product (0 where all are 0); the
         * step of a rounded product, 2^rise * largest / 255. */
        const __mmask16 real = (__mmask16)((1u << R) - 1);
        __m512 bigv = _mm512_maskz_loadu_ps(real, big), ev = exp2_ps(_mm512_maskz_loadu_ps(real, rise));
        _mm512_storeu_ps(grow, ev);
        _mm512_storeu_ps(pscale, _mm512_mul_ps(ev, _mm512_mul_ps(bigv, _mm512_set1_ps(1.0f / 255.0f))));
        _mm512_storeu_ps(up, _mm512_maskz_div_ps(_mm512_cmp_ps_mask(bigv, _mm512_setzero_ps(), _CMP_GT_OQ),
                                                 _mm512_set1_ps(255.0f), bigv));
        for (int r = 0; r < R; r++) {
            _mm512_store_ps(l[r], _mm512_fmadd_ps(psum[r], _mm512_set1_ps(grow[r]), _mm512_load_ps(l[r])));
            /* 255 * w / max w <= 255 (+ the cubic's error, far under the half step): 0 .. 255 */
            __m512 u = _mm512_set1_ps(up[r]);
            __m512i code[NV];
            for (int j = 0; j < NV; j++) code[j] = _mm512_cvtps_epi32(_mm512_mul_ps(w[r][j], u));
            _mm512_store_si512(pw[r], bytes_of(code[0], code[1], code[2], code[3]));
        }
        __m512i ai[4][8];
        for (int r = 0; r < R; r++)
            for (int c = 0; c < DV; c++) ai[r][c] = _mm512_setzero_si512();
        const uint32_t *vrow = vq + (kb / 4) * DV * 16;
        for (int t = 0; t < KEYS / 4; t++, vrow += DV * 16) {
            __m512i vv[8];
            for (int c = 0; c < DV; c++) vv[c] = _mm512_loadu_si512(vrow + c * 16);
            for (int r = 0; r < R; r++) {
                __m512i pb = _mm512_set1_epi32((int)pw[r][t]);
                for (int c = 0; c < DV; c++) ai[r][c] = dpbusd(ai[r][c], pb, vv[c]);
            }
        }
        for (int r = 0; r < R; r++) {
            __m512 ps = _mm512_set1_ps(pscale[r]);
            for (int c = 0; c < DV; c++)
                _mm512_store_ps(acc[r] + c * 16,
                                _mm512_fmadd_ps(_mm512_cvtepi32_ps(ai[r][c]), ps, _mm512_load_ps(acc[r] + c * 16)));
        }
    }
    for (int r = 0; r < rows; r++) {
        __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(_mm512_load_ps(l[r])));
        for (int c = 0; c < DV; c++)
            _mm512_storeu_ps(out + r * out_stride + c * 16, _mm512_mul_ps(_mm512_load_ps(acc[r] + c * 16), inv));
    }
}

#endif
