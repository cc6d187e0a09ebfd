/* float32 GEMM for the CPU path's linear layers: out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]).
 *
 * Why not oneDNN: a decode step is mostly these GEMMs at 1-16 rows, where oneDNN reaches
 * 45-60 GFLOP/s on one core of this Xeon, against 85-97 at prefill sizes (a register-only
 * FMA loop peaks at ~140), and its 16-row LM head (32000 x 512) takes ~1.7x the time a
 * one-row pass needs to read the weight. Here the
 * weight is packed once at load into panels of NR output columns ([K][NR] each, zero
 * padded): the inner loop streams one panel contiguously and does MR x 3 FMAs per k with
 * each x element broadcast from memory, MR x 3 accumulators, FMA-bound; the panel two ahead
 * is prefetched while one computes (its lines spread over all the row groups that use this
 * panel, not issued in one burst), so the weight's read overlaps the arithmetic.
 * Measured with `python -m bench.gemm` (one thread, bench checkpoint shapes): 16 rows,
 * 1.15-1.5x oneDNN on the layer shapes and 1.2-1.3x on the head; 512 rows, 0.9-1.0x.
 *
 * Each output is one left-to-right FMA chain over k whatever M is and whichever rows
 * share the call: a row's result does not depend on the batch it is in, nor on the threads
 * (pool.h) its blocks of panels are split over.
 *
 * Built with AVX-512 (16-lane vectors, 32 registers: panels of 48 columns, 8 rows a call)
 * or AVX2 + FMA (8 lanes, 16 registers: panels of 24 columns, 4 rows a call) over simd.h's
 * one vector type: the same loop at either width, each output the same FMA chain. Elsewhere
 * mstar_gemm_nr() is 0 and the caller keeps oneDNN.
 */
#include <stdint.h>
#include <string.h>

#include "pool.h"
#include "silu_mul.h"
#include "simd.h"

#define NV 3 /* vectors per panel row */
#if MSTAR_VL == 16
#define MR 8 /* rows per micro-kernel call: 8 x 3 accumulators + 3 panel vectors */
#else
#define MR 4 /* AVX2: 4 x 3 accumulators + 3 panel vectors + the broadcast, 16 registers (6 x 2
              * with 16-column panels measured ~8% slower here: more broadcasts per FMA) */
#endif
#define NR (NV * (MSTAR_VL ? MSTAR_VL : 8)) /* output columns per panel: 48, AVX2 24 */
#define MC 256 /* rows per block: MC x K floats of x stay in L2 across all panels */
#define PF_AHEAD 2 /* panels */

int64_t mstar_gemm_nr(void) { return MSTAR_VL ? NR : 0; }

/* w [N, K] row-major (nn.Linear's weight) -> packed [ceil(N / NR)][K][NR], zero padded. */
void mstar_gemm_pack(const float *w, int64_t n, int64_t k, float *packed) {
    const int64_t panels = (n + NR - 1) / NR;
    for (int64_t p = 0; p < panels; p++) {
        float *dst = packed + p * k * NR;
        for (int64_t kk = 0; kk < k; kk++)
            for (int64_t j = 0; j < NR; j++) {
                const int64_t col = p * NR + j;
                dst[kk * NR + j] = col < n ? w[col * k + kk] : 0.f;
            }
    }
}

/* The inverse of mstar_gemm_pack (for a torch fallback or a state dict). */
void mstar_gemm_unpack(const float *packed, int64_t n, int64_t k, float *w) {
    for (int64_t col = 0; col < n; col++) {
        const float *src = packed + (col / NR) * k * NR + col % NR;
        for (int64_t kk = 0; kk < k; kk++) w[col * k + kk] = src[kk * NR];
    }
}

#if MSTAR_VL
/* MR x NR outputs (mr rows, a constant) over all of k: each x element broadcast, each panel
 * row's NV vectors loaded once for the mr rows; then + bias, and the `cols` real columns
 * stored. */
static inline __attribute__((always_inline)) void micro(const int mr, const float *x, int64_t ldx, const float *b,
                                                        int64_t k, const float *bias, float *out, int64_t ldo,
                                                        int64_t cols, const float *pf, int64_t pf_lines) {
    vf acc[MR][NV];
    int64_t due = 0;
#pragma GCC unroll 8
    for (int m = 0; m < mr; m++)
        for (int v = 0; v < NV; v++) acc[m][v] = vzero();
#pragma GCC unroll 4
    for (int64_t kk = 0; kk < k; kk++) {
        vf bv[NV];
        for (int v = 0; v < NV; v++) bv[v] = vload(b + kk * NR + v * MSTAR_VL);
        /* this call's share of a panel ahead, pf_lines lines spread evenly over its k loop
         * (a running remainder, no division in the loop) */
        for (due += pf_lines; due >= k; due -= k, pf += 16) _mm_prefetch((const char *)pf, _MM_HINT_T0);
#pragma GCC unroll 8
        for (int m = 0; m < mr; m++) {
            const vf a = vset1(x[m * ldx + kk]);
            for (int v = 0; v < NV; v++) acc[m][v] = vfma(a, bv[v], acc[m][v]);
        }
    }
    if (bias != NULL) {
        vf c[NV];
        for (int v = 0; v < NV; v++) c[v] = vload(bias + v * MSTAR_VL);
#pragma GCC unroll 8
        for (int m = 0; m < mr; m++)
            for (int v = 0; v < NV; v++) acc[m][v] = vadd(acc[m][v], c[v]);
    }
    if (cols == NR) {
#pragma GCC unroll 8
        for (int m = 0; m < mr; m++)
            for (int v = 0; v < NV; v++) vstore(out + m * ldo + v * MSTAR_VL, acc[m][v]);
    } else { /* the last panel: masked stores of its `cols` real columns */
        for (int m = 0; m < mr; m++)
            for (int v = 0; v < NV; v++) vstore_n(out + m * ldo + v * MSTAR_VL, acc[m][v], cols - v * MSTAR_VL);
    }
}

#define MICRO_CASE(R)                                           \
    case R:                                                     \
        micro(R, x, ldx, b, k, bias, out, ldo, cols, pf, pf_lines); \
        break;

static void micro_any(int mr, const float *x, int64_t ldx, const float *b, int64_t k, const float *bias, float *out,
                      int64_t ldo, int64_t cols, const float *pf, int64_t pf_lines) {
    switch (mr) {
        MICRO_CASE(1) MICRO_CASE(2) MICRO_CASE(3) MICRO_CASE(4)
#if MR > 4
        MICRO_CASE(5) MICRO_CASE(6) MICRO_CASE(7) MICRO_CASE(8)
#endif
    }
}

/* One GEMM: both entry points' arguments. `silu`: the panels hold NR / 2 gate + NR / 2 up
 * columns and each tile goes through silu_mul_rows into NR / 2 output columns, else a panel
 * is NR output columns (+ bias). */
typedef struct {
    const float *x, *packed, *bias;
    float *out;
    int64_t m, k, ldx, n, ldo, width, panels, chunk, chunks;
    int silu;
} Gemm;

/* Rows [m0, m0 + mc) x panels [p0, p1): each panel in turn, MR rows per micro-kernel call. */
static void drive_range(const Gemm *g, int64_t m0, int64_t mc, int64_t p0, int64_t p1) {
    const float *x = g->x, *packed = g->packed, *bias = g->bias;
    const int64_t k = g->k, ldx = g->ldx, n = g->n, ldo = g->ldo, width = g->width;
    float bias_tail[NR], tile[MR * NR] __attribute__((aligned(64)));
    const int64_t calls = (mc + MR - 1) / MR;
    for (int64_t p = p0; p < p1; p++) {
        const int64_t col = p * width, cols = n - col < width ? n - col : width;
        const float *b = packed + p * k * NR, *bp = NULL;
        if (bias != NULL) {
            if (cols == NR) {
                bp = bias + col;
            } else { /* don't read past the bias's end */
                memset(bias_tail, 0, sizeof bias_tail);
                memcpy(bias_tail, bias + col, (size_t)cols * sizeof(float));
                bp = bias_tail;
            }
        }
        for (int64_t r = 0; r < mc; r += MR) {
            const int mr = (int)(mc - r < MR ? mc - r : MR);
            /* the panel PF_AHEAD ahead (in this range), its lines split evenly between this
             * panel's calls, so the memory stays busy through all of them */
            const int64_t lines = k * NR / 16, i = r / MR, j0 = i * lines / calls, j1 = (i + 1) * lines / calls;
            const int ahead = p + PF_AHEAD < p1;
            const float *pf = ahead ? b + PF_AHEAD * k * NR + j0 * 16 : b;
            float *o = g->out + (m0 + r) * ldo + col;
            if (g->silu) {
                micro_any(mr, x + (m0 + r) * ldx, ldx, b, k, NULL, tile, NR, NR, pf, ahead ? j1 - j0 : 0);
                silu_mul_rows(tile, NR, NR / 2, cols, o, ldo, mr);
            } else {
                micro_any(mr, x + (m0 + r) * ldx, ldx, b, k, bp, o, ldo, cols, pf, ahead ? j1 - j0 : 0);
            }
        }
    }
}

/* Task t: MC-row block t / chunks, panel chunk t % chunks. */
static void gemm_task(void *ctx, int task) {
    const Gemm *g = (const Gemm *)ctx;
    const int64_t blk = task / g->chunks, c = task % g->chunks, m0 = blk * MC;
    const int64_t mc = g->m - m0 < MC ? g->m - m0 : MC, p0 = c * g->chunk;
    const int64_t p1 = p0 + g->chunk < g->panels ? p0 + g->chunk : g->panels;
    drive_range(g, m0, mc, p0, p1);
}

/* Fewer multiply-adds than this run on the calling thread alone (a job's hand-off costs
 * more than it saves). */
#define POOL_MIN_MACS (1 << 17)

/* The GEMM over MC-row blocks x chunks of panels, split over the pool's threads (pool.h).
 * Each output is the same FMA chain whichever task computes it: the result does not
 * depend on the thread count or the split. */
static void drive(const float *x, int64_t m, int64_t k, int64_t ldx, const float *packed, int64_t n,
                  const float *bias, float *out, int64_t ldo, int silu) {
    Gemm g = {x, packed, bias, out, m, k, ldx, n, ldo, silu ? NR / 2 : NR, 0, 0, 0, silu};
    g.panels = (n + g.width - 1) / g.width;
    const int threads = mstar_pool_threads();
    if (threads <= 1 || m * n * k < POOL_MIN_MACS) {
        for (int64_t m0 = 0; m0 < m; m0 += MC) drive_range(&g, m0, m - m0 < MC ? m - m0 : MC, 0, g.panels);
        return;
    }
    /* about 8 chunks per thread and MC block: small enough to balance a lost core, large
     * enough that each streams a few panels with its prefetch running ahead */
    const int64_t want = 8 * (int64_t)threads;
    g.chunk = (g.panels + want - 1) / want;
    if (g.chunk < PF_AHEAD + 1 && g.panels >= PF_AHEAD + 1) g.chunk = PF_AHEAD + 1;
    g.chunks = (g.panels + g.chunk - 1) / g.chunk;
    const int64_t blocks = (m + MC - 1) / MC;
    mstar_parallel_for((int)(blocks * g.chunks), gemm_task, &g);
}
#endif

/* out [M, ldo] = x [M, ldx] @ unpacked(w)^T + bias; 0 on success, -1 without AVX-512 or AVX2. */
int mstar_gemm(const float *x, int64_t m, int64_t k, int64_t ldx, const float *packed, int64_t n,
               const float *bias, float *out, int64_t ldo) {
#if MSTAR_VL
    drive(x, m, k, ldx, packed, n, bias, out, ldo, 0);
    return 0;
#else
    (void)x; (void)m; (void)k; (void)ldx; (void)packed; (void)n; (void)bias; (void)out; (void)ldo;
    return -1;
#endif
}

/* The MLP's gate/up GEMM with silu(gate) * up applied as each tile leaves the registers:
 * out [M, ldo] (inter columns) = silu(x gate^T) * (x up^T). `packed` holds panels of 24
 * gate columns followed by the same 24 up columns (see KernelGateUpSilu), so a tile has
 * both halves of its outputs; the 2 x inter wide intermediate is never written. Each
 * output's GEMM chains are mstar_gemm's and its silu is mstar_silu_mul's (silu_mul.h): bit for bit. */
int mstar_gemm_silu(const float *x, int64_t m, int64_t k, int64_t ldx, const float *packed, int64_t inter,
                    float *out, int64_t ldo) {
#if MSTAR_VL
    drive(x, m, k, ldx, packed, inter, NULL, out, ldo, 1);
    return 0;
#else
    (void)x; (void)m; (void)k; (void)ldx; (void)packed; (void)inter; (void)out; (void)ldo;
    return -1;
#endif
}
