/* Fused elementwise ops of a decoder layer for the CPU path (float32): RMSNorm (of rows, or
 * of each head in place), RoPE in place, silu(gate) * up, gelu_tanh(gate) * up. Each is a
 * chain of 3-6 torch ops on small tensors in a decode step (16 x 512 floats), where torch's
 * per-op dispatch is most of the cost: ~40 us per chain against a few us here, about 160 us
 * per layer per step.
 *
 * Built at first use by services/gpu_worker/cpu_kernels.py (see there for flags).
 */
#include <math.h>
#include <stdint.h>

#include "silu_mul.h"

/* One row: o = x * rsqrt(mean(x^2) + eps) * w (o may be x: x is read whole first). */
static inline void rms_row(const float *xr, const float *w, float eps, float *o, int64_t dim) {
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < dim; i++) ss += xr[i] * xr[i];
    const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
#pragma omp simd
    for (int64_t i = 0; i < dim; i++) o[i] = (xr[i] * inv) * w[i];
}

/* out[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * w, as HF's RMSNorm in float32. */
void mstar_rms_norm(const float *x, int64_t x_stride, const float *w, float eps, float *out, int64_t rows, int64_t dim) {
    for (int64_t r = 0; r < rows; r++) rms_row(x + r * x_stride, w, eps, out + r * dim, dim);
}

/* The same per head, in place: heads [0, heads) of each row (row stride x_stride, each head's
 * d values contiguous, heads adjacent), each normalised with w [d] (Gemma 3's q and k norms,
 * on the q/k/v GEMM's output where it lies). */
void mstar_head_norm(float *x, int64_t x_stride, int64_t rows, int64_t heads, int64_t d, const float *w, float eps) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t h = 0; h < heads; h++) rms_row(x + r * x_stride + h * d, w, eps, x + r * x_stride + h * d, d);
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
    silu_mul_rows(gu, gu_stride, inter, inter, out, inter, rows);
}

/* out[r] = gelu_tanh(gu[r, :inter]) * gu[r, inter:2 inter] (silu_mul.h). */
void mstar_gelu_mul(const float *restrict gu, int64_t gu_stride, int64_t inter, float *restrict out, int64_t rows) {
    gelu_mul_rows(gu, gu_stride, inter, inter, out, inter, rows);
}

/* gpt-oss's clamped SwiGLU over rows of gu = [gate | up] (gate columns first, as
 * layers/gpt_oss_moe.py packs its experts): out[r] = (clamp(up, -limit, limit) + 1) * g *
 * sigmoid(alpha * g) with g = min(gate, limit), sigmoid(z) as 1 / (1 + exp(-z)). Row by row
 * over the same trip count, so a row's bits never depend on the rows beside it (torch's
 * vectorized sigmoid takes other code for a tensor's tail than for its body). */
void mstar_clamped_swiglu(const float *restrict gu, int64_t gu_stride, int64_t inter, float alpha, float limit,
                          float *restrict out, int64_t rows) {
    for (int64_t r = 0; r < rows; r++) {
        const float *restrict g = gu + r * gu_stride;
        const float *restrict u = g + inter;
        float *restrict o = out + r * inter;
#pragma omp simd
        for (int64_t i = 0; i < inter; i++) o[i] = exp_poly(-alpha * (g[i] < limit ? g[i] : limit));
#pragma omp simd
        for (int64_t i = 0; i < inter; i++) {
            const float x = g[i] < limit ? g[i] : limit;
            const float y = u[i] > limit ? limit : u[i] < -limit ? -limit : u[i];
            o[i] = (y + 1.0f) * (x / (1.0f + o[i]));
        }
    }
}

/* RoPE on the first `rot` values of each head (Qwen3.5's partial RoPE; the rest of the head
 * kept), heads `head_stride` apart: mstar_rope's arithmetic per head, tables [rows, rot]
 * (row stride tab_stride). The modules' GatedAttention and the decode stack both call it. */
void mstar_rope_partial(float *x, int64_t x_stride, int64_t rows, int64_t heads, int64_t head_stride, int64_t rot,
                        const float *cos, const float *sin_signed, int64_t tab_stride) {
    for (int64_t h = 0; h < heads; h++)
        mstar_rope(x + h * head_stride, x_stride, rows, 1, rot, cos, sin_signed, tab_stride);
}

/* o[r, h * d + i] *= sigmoid(g[r * g_stride + h * g_head + i]) over `heads` heads of d values
 * (Qwen3.5's attention output gate; the gate's heads lie between q's in q_proj's output),
 * sigmoid(z) = 1 / (1 + exp(-z)), row by row (a row's bits never depend on its batch). */
void mstar_sigmoid_gate(float *o, int64_t rows, int64_t heads, int64_t d, const float *g, int64_t g_stride,
                        int64_t g_head) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t h = 0; h < heads; h++) {
            float *restrict oh = o + (r * heads + h) * d;
            const float *restrict gh = g + r * g_stride + h * g_head;
            float e[256];
            for (int64_t i0 = 0; i0 < d; i0 += 256) {
                const int64_t n = d - i0 < 256 ? d - i0 : 256;
#pragma omp simd
                for (int64_t i = 0; i < n; i++) e[i] = exp_poly(-gh[i0 + i]);
#pragma omp simd
                for (int64_t i = 0; i < n; i++) oh[i0 + i] = oh[i0 + i] * (1.0f / (1.0f + e[i]));
            }
        }
}

/* Gated DeltaNet's per-head gates from in_proj's b and a columns (rows `stride` apart):
 * beta = sigmoid(b), g = neg_a * softplus(a + dt_bias) (softplus(x) = log1p(exp(x)), x past 20
 * as is: torch's threshold), into beta and g [rows, heads]. libm's expf / log1pf, scalar:
 * the modules' GatedDeltaNet and the decode stack both call this. */
void mstar_gdn_gates(const float *b, const float *a, int64_t stride, int64_t rows, int64_t heads,
                     const float *dt_bias, const float *neg_a, float *beta, float *g) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t h = 0; h < heads; h++) {
            const float bv = b[r * stride + h], x = a[r * stride + h] + dt_bias[h];
            beta[r * heads + h] = 1.0f / (1.0f + expf(-bv));
            g[r * heads + h] = neg_a[h] * (x > 20.0f ? x : log1pf(expf(x)));
        }
}

/* out = sigmoid(x) = 1 / (1 + exp(-x)) over n values (out may be x): a mixture's shared-expert
 * gate, in SparseMoE and the decode stack alike. */
void mstar_sigmoid(const float *x, int64_t n, float *out) {
    for (int64_t i = 0; i < n; i++) out[i] = 1.0f / (1.0f + exp_poly(-x[i]));
}
