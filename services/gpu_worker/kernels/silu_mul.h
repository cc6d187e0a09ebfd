/* silu(gate) * up over rows, shared by mstar_silu_mul (elementwise.c) and the GEMM's
 * silu epilogue (gemm.c), so the two paths give the same bits by construction; and
 * gelu_tanh(gate) * up (Gemma's MLP), shared by mstar_gelu_mul and the decode stack. */
#ifndef MSTAR_SILU_MUL_H
#define MSTAR_SILU_MUL_H
#include <stdint.h>

#include "exp_poly.h"

/* out[r, :n] = act(g) * u with g = gu[r, :n], u = gu[r, up:up + n] (row strides gu_stride
 * and out_stride), both activations as g / (1 + exp(-z)): silu's z = g; gelu_tanh's (a
 * constant `gelu`; transformers' gelu_pytorch_tanh, 0.5 g (1 + tanh(c (g + 0.044715 g^3))),
 * c = sqrt(2 / pi)) z = 2 c (g + 0.044715 g^3), the same function without tanh's
 * cancellation near 0. exp(-z) goes through out first. */
static inline __attribute__((always_inline)) void act_mul_rows(const float *restrict gu, int64_t gu_stride,
                                                               int64_t up, int64_t n, float *restrict out,
                                                               int64_t out_stride, int64_t rows, const int gelu) {
    for (int64_t r = 0; r < rows; r++) {
        const float *restrict g = gu + r * gu_stride;
        const float *restrict u = g + up;
        float *restrict o = out + r * out_stride;
#pragma omp simd
        for (int64_t i = 0; i < n; i++)
            o[i] = exp_poly(gelu ? -1.5957691216057308f * (g[i] + 0.044715f * g[i] * g[i] * g[i]) : -g[i]);
#pragma omp simd
        for (int64_t i = 0; i < n; i++) o[i] = g[i] / (1.0f + o[i]) * u[i];
    }
}

static inline void silu_mul_rows(const float *restrict gu, int64_t gu_stride, int64_t up, int64_t n,
                                 float *restrict out, int64_t out_stride, int64_t rows) {
    act_mul_rows(gu, gu_stride, up, n, out, out_stride, rows, 0);
}

static inline void gelu_mul_rows(const float *restrict gu, int64_t gu_stride, int64_t up, int64_t n,
                                 float *restrict out, int64_t out_stride, int64_t rows) {
    act_mul_rows(gu, gu_stride, up, n, out, out_stride, rows, 1);
}

#endif
