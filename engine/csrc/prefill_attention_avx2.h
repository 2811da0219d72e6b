/* prefill_attention.c's kernel for CPUs with AVX2 and FMA but no AVX-512: fp32 throughout (no
 * bf16 rounding: these CPUs have no bf16 dot products). Included by prefill_attention.c, which
 * defines HEADROOM and the interface; same work as its AVX512-BF16 kernel, in 8-wide vectors:
 *
 *   kt [kv_heads][L / 8][D][8]: 8 keys' dims transposed per call (O(L * D)), so one FMA of a
 *       broadcast query dim adds to 8 scores; values are read in place, [L, kv_heads, D]
 *   A tile is `sub` groups of PB = 4 query positions, each for every q head of one kv head: the
 *       group's heads and positions share each block of 16 keys and values while it sits in L1.
 *       Flash style per row: a running max (moved only past HEADROOM, as the BF16 kernel does),
 *       a running sum, the PV sums in scratch; scores in log2 units and exp2.
 *
 * A row's sums run in the same order whatever its tile, its chunk, the thread or their count (a
 * masked key's weight is exactly 0), so its bits depend on nothing else in the call. Against
 * torch's fp32 flash kernel on a Zen 1 EPYC (SmolLM2's 9/3 heads, 2 threads): 2-3x at 512
 * tokens, 1.2-1.5x at 2K-4K, 1.1-1.2x at 8K (README, "On a CPU without AVX-512"). */

#define PB 4 /* query positions a sub-tile: 4 rows x 2 vectors of scores */
#define T8 16 /* keys a block */

/* 2^x for x <= 0: 2^round(x) * p(x - round(x)), |rel. error| < 2e-7; below -125, about 0. */
static inline __m256 exp2_ps8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-125.0f));
    __m256 i = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 f = _mm256_sub_ps(x, i);
    __m256 p = _mm256_set1_ps(1.5403530e-4f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3333558e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504109e-2f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022651e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_cvtps_epi32(i), 23); /* p in [0.7, 1.5): 2^i by its exponent */
    return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), e));
}

static inline float hmax8(__m256 x) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}

static inline float hsum8(__m256 x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}

/* PB rows of one head (qs [PB][D], scaled) against keys kb .. kb + 15: their scores, the running
 * max and sum, their softmax weights into pw, and the PV sums (acc [PB][D]) rescaled when the
 * max moves. Row r sees keys up to lim[r] (increasing in r). */
static inline __attribute__((always_inline)) void scores8(const float *qs, const float *kt, int64_t kb,
                                                           const int64_t *lim, int64_t d, float *m, __m256 *l,
                                                           float *acc, float (*pw)[T8]) {
    /* named accumulators: as an array, gcc stored them to the stack on every iteration */
    __m256 s00 = _mm256_setzero_ps(), s01 = s00, s10 = s00, s11 = s00, s20 = s00, s21 = s00, s30 = s00, s31 = s00;
    const float *k0 = kt + (kb / 8) * d * 8, *k1 = k0 + d * 8;
    const float *q0 = qs, *q1 = qs + d, *q2 = qs + 2 * d, *q3 = qs + 3 * d;
    for (int64_t i = 0; i < d; i++) {
        __m256 a = _mm256_loadu_ps(k0 + i * 8), b = _mm256_loadu_ps(k1 + i * 8), qb;
        qb = _mm256_broadcast_ss(q0 + i);
        s00 = _mm256_fmadd_ps(qb, a, s00);
        s01 = _mm256_fmadd_ps(qb, b, s01);
        qb = _mm256_broadcast_ss(q1 + i);
        s10 = _mm256_fmadd_ps(qb, a, s10);
        s11 = _mm256_fmadd_ps(qb, b, s11);
        qb = _mm256_broadcast_ss(q2 + i);
        s20 = _mm256_fmadd_ps(qb, a, s20);
        s21 = _mm256_fmadd_ps(qb, b, s21);
        qb = _mm256_broadcast_ss(q3 + i);
        s30 = _mm256_fmadd_ps(qb, a, s30);
        s31 = _mm256_fmadd_ps(qb, b, s31);
    }
    __m256 s[PB][2] = {{s00, s01}, {s10, s11}, {s20, s21}, {s30, s31}};
    const int whole = kb + T8 - 1 <= lim[0]; /* every row sees every key of the block */
    const __m256i first = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32((int)kb));
    const __m256i first8 = _mm256_add_epi32(first, _mm256_set1_epi32(8));
    for (int r = 0; r < PB; r++) {
        __m256 s0 = s[r][0], s1 = s[r][1], ok0 = _mm256_castsi256_ps(_mm256_set1_epi32(-1)), ok1 = ok0;
        if (!whole) {
            __m256i end = _mm256_set1_epi32((int)lim[r] + 1);
            ok0 = _mm256_castsi256_ps(_mm256_cmpgt_epi32(end, first));
            ok1 = _mm256_castsi256_ps(_mm256_cmpgt_epi32(end, first8));
            s0 = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), s0, ok0);
            s1 = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), s1, ok1);
        }
        __m256 mx = _mm256_max_ps(s0, s1);
        if (_mm256_movemask_ps(_mm256_cmp_ps(mx, _mm256_set1_ps(m[r] + HEADROOM), _CMP_GT_OQ))) {
            float m_new = hmax8(mx);
            m_new = m_new > m[r] ? m_new : m[r];
            __m256 al = _mm256_set1_ps(exp_approx((m[r] - m_new) * 0.69314718f));
            m[r] = m_new;
            l[r] = _mm256_mul_ps(l[r], al);
            for (int64_t c = 0; c < d; c += 8)
                _mm256_storeu_ps(acc + r * d + c, _mm256_mul_ps(_mm256_loadu_ps(acc + r * d + c), al));
        }
        __m256 mr = _mm256_set1_ps(m[r]);
        __m256 p0 = _mm256_and_ps(ok0, exp2_ps8(_mm256_sub_ps(s0, mr)));
        __m256 p1 = _mm256_and_ps(ok1, exp2_ps8(_mm256_sub_ps(s1, mr)));
        l[r] = _mm256_add_ps(l[r], _mm256_add_ps(p0, p1));
        _mm256_storeu_ps(pw[r], p0);
        _mm256_storeu_ps(pw[r] + 8, p1);
    }
}

/* acc [PB][D] += pw @ v over the block's keys that its last row sees (the others weigh 0) */
static inline __attribute__((always_inline)) void values8(const float *v, int64_t v_stride, int64_t kb,
                                                           const int64_t *lim, int64_t d, float *acc,
                                                           float (*pw)[T8]) {
    int64_t keys = lim[PB - 1] - kb + 1;
    keys = keys < T8 ? keys : T8;
    for (int64_t c = 0; c < d; c += 16) {
        float *a0p = acc + c, *a1p = acc + d + c, *a2p = acc + 2 * d + c, *a3p = acc + 3 * d + c;
        __m256 a00 = _mm256_loadu_ps(a0p), a01 = _mm256_loadu_ps(a0p + 8), a10 = _mm256_loadu_ps(a1p),
               a11 = _mm256_loadu_ps(a1p + 8), a20 = _mm256_loadu_ps(a2p), a21 = _mm256_loadu_ps(a2p + 8),
               a30 = _mm256_loadu_ps(a3p), a31 = _mm256_loadu_ps(a3p + 8);
        const float *vr = v + kb * v_stride + c;
        for (int64_t t = 0; t < keys; t++, vr += v_stride) {
            __m256 v0 = _mm256_loadu_ps(vr), v1 = _mm256_loadu_ps(vr + 8), pb;
            pb = _mm256_broadcast_ss(&pw[0][t]);
            a00 = _mm256_fmadd_ps(pb, v0, a00);
            a01 = _mm256_fmadd_ps(pb, v1, a01);
            pb = _mm256_broadcast_ss(&pw[1][t]);
            a10 = _mm256_fmadd_ps(pb, v0, a10);
            a11 = _mm256_fmadd_ps(pb, v1, a11);
            pb = _mm256_broadcast_ss(&pw[2][t]);
            a20 = _mm256_fmadd_ps(pb, v0, a20);
            a21 = _mm256_fmadd_ps(pb, v1, a21);
            pb = _mm256_broadcast_ss(&pw[3][t]);
            a30 = _mm256_fmadd_ps(pb, v0, a30);
            a31 = _mm256_fmadd_ps(pb, v1, a31);
        }
        _mm256_storeu_ps(a0p, a00);
        _mm256_storeu_ps(a0p + 8, a01);
        _mm256_storeu_ps(a1p, a10);
        _mm256_storeu_ps(a1p + 8, a11);
        _mm256_storeu_ps(a2p, a20);
        _mm256_storeu_ps(a2p + 8, a21);
        _mm256_storeu_ps(a3p, a30);
        _mm256_storeu_ps(a3p + 8, a31);
    }
}

/* One tile: positions r0 .. r0 + sub * PB - 1 (those below n) of every q head of kv head hk. */
static void tile8(const float *q, int64_t n, int64_t ctx, int64_t heads, int64_t group, int64_t hk, int64_t r0,
                  int sub, const float *kt, const float *v, int64_t v_stride, int64_t d, float mul, float *qs,
                  float *acc, float *m, __m256 *l, float (*pw)[T8], float *out) {
    int64_t lim[8][PB], last = 0;
    int rows[8];
    for (int sb = 0; sb < sub; sb++) {
        int64_t p0 = r0 + sb * PB;
        rows[sb] = (int)(p0 >= n ? 0 : (n - p0 < PB ? n - p0 : PB));
        for (int r = 0; r < PB && rows[sb]; r++) {
            int64_t pos = p0 + (r < rows[sb] ? r : rows[sb] - 1); /* short sub-tiles repeat their last row */
            lim[sb][r] = last = ctx + pos;
            for (int64_t g = 0; g < group; g++) {
                int64_t row = (sb * group + g) * PB + r;
                const float *src = q + (pos * heads + hk * group + g) * d;
                for (int64_t i = 0; i < d; i++) qs[row * d + i] = src[i] * mul;
                m[row] = -INFINITY;
                l[row] = _mm256_setzero_ps();
            }
        }
    }
    memset(acc, 0, sub * group * PB * d * sizeof(float));
    for (int64_t kb = 0; kb <= last; kb += T8) {
        /* every row's weights first, then the values: a weight is not read back right after its store */
        for (int sb = 0; sb < sub; sb++)
            for (int64_t g = 0; g < group && rows[sb] && kb <= lim[sb][PB - 1]; g++) {
                int64_t row = (sb * group + g) * PB;
                scores8(qs + row * d, kt, kb, lim[sb], d, m + row, l + row, acc + row * d, pw + row);
            }
        for (int sb = 0; sb < sub; sb++)
            for (int64_t g = 0; g < group && rows[sb] && kb <= lim[sb][PB - 1]; g++) {
                int64_t row = (sb * group + g) * PB;
                values8(v, v_stride, kb, lim[sb], d, acc + row * d, pw + row);
            }
    }
    for (int sb = 0; sb < sub; sb++)
        for (int64_t g = 0; g < group; g++)
            for (int r = 0; r < rows[sb]; r++) {
                int64_t row = (sb * group + g) * PB + r;
                float inv = 1.0f / hsum8(l[row]);
                float *o = out + ((r0 + sb * PB + r) * heads + hk * group + g) * d;
                for (int64_t i = 0; i < d; i++) o[i] = acc[row * d + i] * inv;
            }
}

static int prefill_attention_avx2(const float *q, int64_t n, const float *k, const float *v, int64_t L, int64_t heads,
                                  int64_t kv_heads, int64_t d, float mul, int64_t team, float *out) {
    int64_t group = heads / kv_heads, lpad = (L + T8 - 1) / T8 * T8, blocks8 = lpad / 8;
    /* up to 8 sub-tiles (32 positions), fewer where there would be under 4 tiles a thread or
     * over 128 rows of scratch */
    int sub = 8;
    while (sub > 1 && (kv_heads * ((n + sub * PB - 1) / (sub * PB)) < 4 * team || sub * PB * group > 128)) sub /= 2;
    int64_t span = sub * PB, tiles = (n + span - 1) / span, rows_max = sub * PB * group;
    float *kt = malloc(kv_heads * lpad * d * sizeof(float));
    if (!kt)
        return -1;
    int failed = 0;
#pragma omp parallel num_threads(team)
    {
#pragma omp for schedule(static)
        for (int64_t it = 0; it < kv_heads * blocks8; it++) { /* keys: 8 rows, transposed */
            int64_t h = it / blocks8, b = it % blocks8;
            float *dst = kt + it * d * 8;
            for (int64_t j = 0; j < 8; j++) {
                int64_t key = b * 8 + j;
                for (int64_t i = 0; i < d; i++) dst[i * 8 + j] = key < L ? k[(key * kv_heads + h) * d + i] : 0.0f;
            }
        }
        float *scratch = malloc((2 * rows_max * d + rows_max) * sizeof(float));
        float(*pw)[T8] = malloc(rows_max * sizeof(float[T8]));
        __m256 *l = aligned_alloc(32, rows_max * sizeof(__m256));
        if (!scratch || !pw || !l) {
#pragma omp atomic write
            failed = 1;
        }
        /* One kv head's tiles after another (their keys and values stay in L3 for both threads),
         * the heaviest (the last rows see the most keys) first. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < kv_heads * tiles; it++) {
            if (!scratch || !pw || !l)
                continue;
            int64_t hk = it / tiles, r0 = (tiles - 1 - it % tiles) * span;
            tile8(q, n, L - n, heads, group, hk, r0, sub, kt + hk * blocks8 * d * 8, v + hk * d, kv_heads * d, d, mul,
                  scratch, scratch + rows_max * d, scratch + 2 * rows_max * d, l, pw, out);
        }
        free(scratch);
        free(pw);
        free(l);
    }
    free(kt);
    return failed ? -1 : 0;
}
