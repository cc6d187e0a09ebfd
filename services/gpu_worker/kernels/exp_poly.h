/* exp(x) shared by the CPU kernels (included, not compiled on its own). */
#ifndef MSTAR_EXP_POLY_H
#define MSTAR_EXP_POLY_H
#include <stdint.h>

/* exp(x), Cephes' expf (x = n ln2 + r, a degree-6 polynomial in r, 2^n through the
 * exponent bits): within 2 ulp of libm's, and the loops around it vectorize. */
static inline float exp_poly(float x) {
    x = x < -87.0f ? -87.0f : x;
    x = x > 88.0f ? 88.0f : x;
    /* n = round(x / ln2) by the 1.5 * 2^23 trick: floorf would block vectorizing */
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const float y = p * r * r + r + 1.0f;
    union { int32_t i; float f; } two_n = {.i = ((int32_t)n + 127) << 23};
    return y * two_n.f;
}

#endif
