/* Fused elementwise ops of a decoder layer for the CPU path (float32): RMSNorm, RoPE in
 * place, silu(gate) * up. Each is a chain of 3-6 torch ops on small tensors in a decode
 * step (16 x 512 floats), where torch's per-op dispatch is most of the cost: ~40 us per
 * chain against a few us here, about 160 us per layer per step.
 *
 * Built at first use by services/gpu_worker/cpu_kernels.py (see there for flags).
 */
#include <math.h>
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

/* out[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * w, as HF's RMSNorm in float32. */
void mstar_rms_norm(const float *x, int64_t x_stride, const float *w, float eps, float *out, int64_t rows, int64_t dim) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride;
        float ss = 0.f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < dim; i++) ss += xr[i] * xr[i];
        const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
        float *o = out + r * dim;
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) o[i] = (xr[i] * inv) * w[i];
    }
}

/* In place on heads [0, heads) of each row (row stride x_stride, head_dim d contiguous):
 * x = x * cos + rotate_half(x) * sin, with sin's first half negated in the table
 * (sin_signed), so rotate_half is a plain swap of halves. cos/sin rows are per row. */
void mstar_rope(float *x, int64_t x_stride, int64_t rows, int64_t heads, int64_t d, const float *cos,
                const float *sin_signed, int64_t tab_stride) {
    const int64_t h2 = d / 2;
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos + r * tab_stride, *s = sin_signed + r * tab_stride;
        for (int64_t h = 0; h < heads; h++) {
            float *v = x + r * x_stride + h * d;
#pragma omp simd
            for (int64_t i = 0; i < h2; i++) {
                const float a = v[i], b = v[i + h2];
                v[i] = a * c[i] + b * s[i];
                v[i + h2] = b * c[i + h2] + a * s[i + h2];
            }
        }
    }
}

/* out[r] = silu(gu[r, :inter]) * gu[r, inter:2 inter]; silu(g) = g / (1 + exp(-g)). */
void mstar_silu_mul(const float *restrict gu, int64_t gu_stride, int64_t inter, float *restrict out, int64_t rows) {
    for (int64_t r = 0; r < rows; r++) {
        const float *restrict g = gu + r * gu_stride;
        const float *restrict u = g + inter;
        float *restrict o = out + r * inter;
#pragma omp simd
        for (int64_t i = 0; i < inter; i++) o[i] = exp_poly(-g[i]);
#pragma omp simd
        for (int64_t i = 0; i < inter; i++) o[i] = g[i] / (1.0f + o[i]) * u[i];
    }
}
