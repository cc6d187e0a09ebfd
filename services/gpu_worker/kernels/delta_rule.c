/* Qwen3.5's linear attention (Gated DeltaNet) for the CPU path, float32: the depthwise causal
 * conv over the q/k/v projection, the gated delta rule, and the gated RMSNorm after it
 * (services/gpu_worker/layers/delta_rule.py calls them; transformers' modeling_qwen3_5.py is
 * the reference).
 *
 * Why C: in a decode step each of these is a chain of 5-15 torch ops on small tensors per
 * layer (the recurrence alone reads and writes a 64 KB state per head), where torch's
 * dispatch and the temporaries cost more than the arithmetic; and in a prefill torch's
 * chunked form is a chain of small batched matrix products, ~10x slower on a CPU than the
 * recurrence below (python -m bench.delta_rule).
 *
 * A step holds several requests' rows, one after the other. `meta` describes them, one row of
 * four int64 per request: its rows [start, end) of the step, its state slot, and whether the
 * slot starts from zeros (fresh: the request's first rows; the slot's old contents are never
 * read then, so a slot needs no clearing between requests). Each request's state is read at
 * the start and written back in place at the end, so a prompt cut into chunks anywhere gives
 * the same results as whole, to float rounding.
 *
 * Parallel over the kernels' pool (pool.h): the conv over channel blocks, the delta
 * rule over (request, value head), the norm over row blocks. Each output is the same chain of
 * operations whichever thread computes it.
 *
 * The delta rule is the per-token recurrence, not transformers' chunked (WY) form: that form
 * trades multiply-adds for matrix products a GPU runs in parallel (per token ~3 Dk Dv for the
 * recurrence, ~3 Dk Dv + 2 * 64 (Dk + Dv) chunked at 64), and on a CPU the (request, head)
 * pairs already give the cores their work; the fused pass below runs near the FMA peak.
 *
 * Built at first use by services/gpu_worker/cpu_kernels.py (see there for flags).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "exp_poly.h"
#include "pool.h"
#include "simd.h"

/* ---------------------------------------------------------------- causal conv */

#define CONV_CB 256 /* channels per conv task */
#define CONV_MAX_K 16 /* the largest kernel the conv takes (its weight block is on the stack) */

typedef struct {
    const float *x, *w;
    float *state, *out;
    const int64_t *meta;
    int64_t x_stride, c, k, slot_stride, b;
} ConvJob;

/* w [cb, k] (a block of the weight's channel rows) transposed to wt [k, CONV_CB], so a tap's
 * channels are contiguous; k = 4 (every Qwen3.5) as its own loop, which the compiler
 * vectorizes with in-register shuffles */
static void transpose_taps(const float *restrict w, int64_t k, int64_t cb, float *restrict wt) {
    if (k == 4) {
#pragma omp simd
        for (int64_t i = 0; i < cb; i++) {
            wt[i] = w[4 * i];
            wt[CONV_CB + i] = w[4 * i + 1];
            wt[2 * CONV_CB + i] = w[4 * i + 2];
            wt[3 * CONV_CB + i] = w[4 * i + 3];
        }
        return;
    }
    for (int64_t i = 0; i < cb; i++)
        for (int64_t j = 0; j < k; j++) wt[j * CONV_CB + i] = w[i * k + j];
}

/* One block of channels, every request: the weight block is transposed once per call. */
static void conv_task(void *ctx, int task) {
    const ConvJob *J = (const ConvJob *)ctx;
    const int64_t c0 = (int64_t)task * CONV_CB;
    const int64_t cb = J->c - c0 < CONV_CB ? J->c - c0 : CONV_CB, K = J->k, C = J->c;
    static const float zeros[CONV_CB];
    float wt[CONV_MAX_K * CONV_CB], acc[CONV_CB];
    transpose_taps(J->w + c0 * K, K, cb, wt);
    for (int64_t r = 0; r < J->b; r++) {
        const int64_t *m = J->meta + 4 * r;
        const int64_t start = m[0], n = m[1] - m[0], fresh = m[3];
        float *win = J->state + m[2] * J->slot_stride + c0; /* window row j: win + j * C */
        /* every output first: they read the old window, which is then overwritten */
        for (int64_t t = 0; t < n; t++) {
            for (int64_t i = 0; i < cb; i++) acc[i] = 0.f;
            for (int64_t j = 0; j < K; j++) {
                const int64_t p = t - (K - 1) + j; /* the input this tap reads: < 0 is the window's */
                const float *in = p >= 0 ? J->x + (start + p) * J->x_stride + c0
                                  : fresh  ? zeros
                                           : win + (K - 1 + p) * C;
                const float *w = wt + j * CONV_CB;
#pragma omp simd
                for (int64_t i = 0; i < cb; i++) acc[i] += w[i] * in[i];
            }
            float *o = J->out + (start + t) * C + c0;
#pragma omp simd
            for (int64_t i = 0; i < cb; i++) o[i] = acc[i] / (1.0f + exp_poly(-acc[i]));
        }
        /* the new window: the last K - 1 of (old window ++ rows); row q of that sequence for
         * new row j is q = n + j >= j, so ascending j reads before it writes */
        for (int64_t j = 0; j < K - 1; j++) {
            const int64_t q = n + j;
            float *dst = win + j * C;
            if (q >= K - 1) {
                memcpy(dst, J->x + (start + q - (K - 1)) * J->x_stride + c0, (size_t)cb * sizeof(float));
            } else if (fresh) {
                memset(dst, 0, (size_t)cb * sizeof(float));
            } else if (q != j) {
                memcpy(dst, win + q * C, (size_t)cb * sizeof(float));
            }
        }
    }
}

/* out [T, C] (contiguous) = silu(depthwise causal conv of each request's rows, after its
 * window), x rows x_stride apart; state [S, K-1, C] (slot stride slot_stride, each window
 * contiguous, oldest row first) gets each request's last K-1 inputs; weight [C, K].
 * 0, or -1 for a kernel over CONV_MAX_K (nothing written). */
int mstar_causal_conv(const float *x, int64_t x_stride, int64_t c, float *state, int64_t slot_stride, int64_t k,
                      const float *weight, const int64_t *meta, int64_t b, float *out) {
    if (k < 1 || k > CONV_MAX_K) return -1;
    ConvJob J = {x, weight, state, out, meta, x_stride, c, k, slot_stride, b};
    const int64_t tasks = (c + CONV_CB - 1) / CONV_CB;
    int64_t rows = 0;
    for (int64_t r = 0; r < b; r++) rows += meta[4 * r + 1] - meta[4 * r];
    if (rows * c * k < (1 << 16) || tasks < 2) {
        for (int64_t t = 0; t < tasks; t++) conv_task(&J, (int)t);
    } else {
        mstar_parallel_for((int)tasks, conv_task, &J);
    }
    return 0;
}

/* ---------------------------------------------------------------- gated delta rule */

#define DELTA_MAX_D 512 /* largest head dim the kernel takes (its per-task buffers are on the stack) */

typedef struct {
    const float *q, *k, *v, *g, *beta;
    float *state, *out;
    const int64_t *meta;
    int64_t q_stride, k_stride, v_stride, g_stride, beta_stride;
    int64_t hk, hv, dk, dv, slot_stride;
} DeltaJob;

/* q or k head row `src` [d] L2-normalised as transformers' l2norm (x * rsqrt(sum x^2 + 1e-6)),
 * times `scale`, into dst */
static inline void l2norm_row(const float *src, int64_t d, float scale, float *dst) {
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < d; i++) ss += src[i] * src[i];
    const float inv = 1.0f / sqrtf(ss + 1e-6f);
#pragma omp simd
    for (int64_t i = 0; i < d; i++) dst[i] = src[i] * inv * scale;
}

/* One pass over the state S [dk, dv] for columns [j0, j0 + nv * VL):
 *   update: S[i, :] = decay S[i, :] + kn[i] delta   (the current token's write)
 *   read:   kv = k2^T S, qs = q2^T S                (with S after the update: the next token's reads)
 * The column block's accumulators stay in registers over the dk rows, so S is read and
 * written once per token. */
#if MSTAR_VL
static inline __attribute__((always_inline)) void state_pass_v(float *S, int64_t dk, int64_t dv, int64_t j0, int nv,
                                                               int update, float decay, const float *kn,
                                                               const float *delta, int read, const float *k2,
                                                               const float *q2, float *kv, float *qs) {
    vf d[4], a[4], b[4];
    const vf dec = vset1(decay);
    for (int u = 0; u < nv; u++) {
        d[u] = update ? vload(delta + j0 + u * MSTAR_VL) : vzero();
        a[u] = vzero();
        b[u] = vzero();
    }
    for (int64_t i = 0; i < dk; i++) {
        float *row = S + i * dv + j0;
        const vf ki = vset1(update ? kn[i] : 0.f), k2i = vset1(read ? k2[i] : 0.f), q2i = vset1(read ? q2[i] : 0.f);
        for (int u = 0; u < nv; u++) {
            vf s = vload(row + u * MSTAR_VL);
            if (update) {
                s = vfma(dec, s, vmul(ki, d[u])); /* one rounding of the decayed state: no denormal in between */
                vstore(row + u * MSTAR_VL, s);
            }
            if (read) {
                a[u] = vfma(k2i, s, a[u]);
                b[u] = vfma(q2i, s, b[u]);
            }
        }
    }
    if (read)
        for (int u = 0; u < nv; u++) {
            vstore(kv + j0 + u * MSTAR_VL, a[u]);
            vstore(qs + j0 + u * MSTAR_VL, b[u]);
        }
}
#endif

static void state_pass(float *S, int64_t dk, int64_t dv, int update, float decay, const float *kn,
                       const float *delta, int read, const float *k2, const float *q2, float *kv, float *qs) {
#if MSTAR_VL
    if (dv % MSTAR_VL == 0) {
        const int64_t nvec = dv / MSTAR_VL;
        int64_t v0 = 0;
        /* the flags are constants in each call, so each becomes its own loop */
        for (; v0 + 4 <= nvec; v0 += 4) {
            if (update && read)
                state_pass_v(S, dk, dv, v0 * MSTAR_VL, 4, 1, decay, kn, delta, 1, k2, q2, kv, qs);
            else if (update)
                state_pass_v(S, dk, dv, v0 * MSTAR_VL, 4, 1, decay, kn, delta, 0, k2, q2, kv, qs);
            else
                state_pass_v(S, dk, dv, v0 * MSTAR_VL, 4, 0, decay, kn, delta, 1, k2, q2, kv, qs);
        }
        for (; v0 < nvec; v0++)
            state_pass_v(S, dk, dv, v0 * MSTAR_VL, 1, update, decay, kn, delta, read, k2, q2, kv, qs);
        return;
    }
#endif
    if (read)
        for (int64_t j = 0; j < dv; j++) kv[j] = qs[j] = 0.f;
    for (int64_t i = 0; i < dk; i++) {
        float *row = S + i * dv;
        if (update) {
            const float ki = kn[i];
#pragma omp simd
            for (int64_t j = 0; j < dv; j++) row[j] = ki * delta[j] + decay * row[j];
        }
        if (read) {
            const float k2i = k2[i], q2i = q2[i];
#pragma omp simd
            for (int64_t j = 0; j < dv; j++) {
                kv[j] += k2i * row[j];
                qs[j] += q2i * row[j];
            }
        }
    }
}

/* One (request, value head): the recurrence over the request's rows. Per token, with q and k
 * normalised and S the state before the token:
 *   kv = exp(g) k^T S;  delta = beta (v - kv);  S' = exp(g) S + k delta^T;
 *   o = q^T S' = exp(g) q^T S + (q . k) delta
 * (transformers' recurrent form, its products regrouped), so each token needs k^T S and
 * q^T S of the state before it, which the previous token's update pass reads as it writes. */
static void delta_task(void *ctx, int task) {
    const DeltaJob *J = (const DeltaJob *)ctx;
    const int64_t r = task / J->hv, h = task % J->hv, kh = h / (J->hv / J->hk);
    const int64_t dk = J->dk, dv = J->dv;
    const int64_t *m = J->meta + 4 * r;
    const int64_t start = m[0], end = m[1];
    float *S = J->state + m[2] * J->slot_stride + h * dk * dv;
    const float scale = 1.0f / sqrtf((float)dk);
    float qa[DELTA_MAX_D], ka[DELTA_MAX_D], qb[DELTA_MAX_D], kb[DELTA_MAX_D];
    float kv[DELTA_MAX_D], qs[DELTA_MAX_D], delta[DELTA_MAX_D];
    float *qn = qa, *kn = ka, *q2 = qb, *k2 = kb;
    if (m[3]) memset(S, 0, (size_t)(dk * dv) * sizeof(float));
    if (start >= end) return;
    l2norm_row(J->q + start * J->q_stride + kh * dk, dk, scale, qn);
    l2norm_row(J->k + start * J->k_stride + kh * dk, dk, 1.0f, kn);
    if (m[3]) {
        for (int64_t j = 0; j < dv; j++) kv[j] = qs[j] = 0.f;
    } else {
        state_pass(S, dk, dv, 0, 1.0f, NULL, NULL, 1, kn, qn, kv, qs);
    }
    for (int64_t t = start; t < end; t++) {
        const float decay = expf(J->g[t * J->g_stride + h]), b = J->beta[t * J->beta_stride + h];
        const float *v = J->v + t * J->v_stride + h * dv;
        float *o = J->out + (t * J->hv + h) * dv;
        float qk = 0.f;
#pragma omp simd reduction(+ : qk)
        for (int64_t i = 0; i < dk; i++) qk += qn[i] * kn[i];
#pragma omp simd
        for (int64_t j = 0; j < dv; j++) {
            delta[j] = b * (v[j] - decay * kv[j]);
            o[j] = decay * qs[j] + qk * delta[j];
        }
        const int next = t + 1 < end;
        if (next) {
            l2norm_row(J->q + (t + 1) * J->q_stride + kh * dk, dk, scale, q2);
            l2norm_row(J->k + (t + 1) * J->k_stride + kh * dk, dk, 1.0f, k2);
        }
        state_pass(S, dk, dv, 1, decay, kn, delta, next, k2, q2, kv, qs);
        float *swap = qn;
        qn = q2;
        q2 = swap;
        swap = kn;
        kn = k2;
        k2 = swap;
    }
}

/* The gated delta rule over each request's rows (transformers' use_qk_l2norm_in_kernel=True):
 * q, k [T, hk, dk], v [T, hv, dv], g (log decay), beta [T, hv], each with its own row stride
 * and its heads contiguous; state [S, hv, dk, dv] (slot stride slot_stride, each slot
 * contiguous) read and written in place; out [T, hv, dv] contiguous. k head h / (hv / hk)
 * serves value head h. 0, or -1 for a head dim over DELTA_MAX_D (nothing written). */
int mstar_gated_delta(const float *q, int64_t q_stride, const float *k, int64_t k_stride, const float *v,
                      int64_t v_stride, const float *g, int64_t g_stride, const float *beta, int64_t beta_stride,
                      int64_t hk, int64_t hv, int64_t dk, int64_t dv, float *state, int64_t slot_stride,
                      const int64_t *meta, int64_t b, float *out) {
    if (dk > DELTA_MAX_D || dv > DELTA_MAX_D || hk <= 0 || hv % hk) return -1;
    DeltaJob J = {q, k, v, g, beta, state, out, meta, q_stride, k_stride, v_stride, g_stride, beta_stride,
                  hk, hv, dk, dv, slot_stride};
    const int64_t tasks = b * hv;
    int64_t rows = 0;
    for (int64_t r = 0; r < b; r++) rows += meta[4 * r + 1] - meta[4 * r] + 1;
    if (rows * hv * dk * dv < (1 << 16) || tasks < 2) {
        for (int64_t t = 0; t < tasks; t++) delta_task(&J, (int)t);
    } else {
        mstar_parallel_for((int)tasks, delta_task, &J);
    }
    return 0;
}

/* ---------------------------------------------------------------- gated RMSNorm */

#define NORM_ROWS 64 /* rows per norm task */

typedef struct {
    const float *x, *z, *w;
    float *out;
    int64_t x_stride, z_stride, rows, dim;
    float eps;
} NormJob;

static void norm_task(void *ctx, int task) {
    const NormJob *J = (const NormJob *)ctx;
    const int64_t r1 = (task + 1) * NORM_ROWS < J->rows ? (task + 1) * NORM_ROWS : J->rows;
    const int64_t dim = J->dim;
    for (int64_t r = (int64_t)task * NORM_ROWS; r < r1; r++) {
        const float *x = J->x + r * J->x_stride, *z = J->z + r * J->z_stride, *w = J->w;
        float *o = J->out + r * dim;
        float ss = 0.f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < dim; i++) ss += x[i] * x[i];
        const float inv = 1.0f / sqrtf(ss / (float)dim + J->eps);
        /* exp(-z) through o first, as silu_mul.h */
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) o[i] = exp_poly(-z[i]);
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) o[i] = ((x[i] * inv) * w[i]) * (z[i] / (1.0f + o[i]));
    }
}

/* out [rows, dim] (contiguous) = rmsnorm(x) * w * silu(z) (transformers' Qwen3_5RMSNormGated
 * in float32), x and z rows x_stride and z_stride apart. */
void mstar_gated_rms_norm(const float *x, int64_t x_stride, const float *z, int64_t z_stride, const float *w,
                          float eps, float *out, int64_t rows, int64_t dim) {
    NormJob J = {x, z, w, out, x_stride, z_stride, rows, dim, eps};
    const int64_t tasks = (rows + NORM_ROWS - 1) / NORM_ROWS;
    if (tasks < 2 || rows * dim < (1 << 15)) {
        for (int64_t t = 0; t < tasks; t++) norm_task(&J, (int)t);
    } else {
        mstar_parallel_for((int)tasks, norm_task, &J);
    }
}
