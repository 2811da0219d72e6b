/* What the C files of engine/csrc share: exp, and sums and maxima that gcc vectorizes. */
#ifndef TANDEM_COMMON_H
#define TANDEM_COMMON_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

static inline float max_of(const float *a, int64_t n) {
    float acc[LANES];
    for (int l = 0; l < LANES; l++) acc[l] = a[0];
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) acc[l] = a[i + l] > acc[l] ? a[i + l] : acc[l];
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int l = 0; l < w; l++) acc[l] = acc[l + w] > acc[l] ? acc[l + w] : acc[l];
    float m = acc[0];
    for (; i < n; i++) m = a[i] > m ? a[i] : m;
    return m;
}

#endif
