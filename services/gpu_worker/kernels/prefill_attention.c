/* Prefill attention on the paged K/V for the CPU path (flash attention: blocked, online
 * softmax, never a [rows x keys] score matrix).
 *
 * mstar_prefill_attention: query rows [0, q_len) of one chunk (q rows q_stride floats apart,
 * each row's heads contiguous) attend over the chunk's first kv_len keys, which lie in its
 * pages (`pages`, int64) of the pool [P, 2, page_size, kv_heads, head_dim] (FlashInfer's
 * layout; K at [:, 0], V at [:, 1]), float32 or bfloat16 (`bf16`; a value is widened by a
 * 16-bit shift, exactly). Query head h * G + g uses KV head h. Causal, aligned bottom-right:
 * row i sees keys j <= kv_len - q_len + i, and with a sliding window W > 0 only those with
 * j > kv_len - q_len + i - W (transformers' convention, attention.py's `window_mask`).
 *
 * The torch path gathers the pages into a contiguous copy and runs SDPA on one thread; here
 * the pages are read where they lie and the work is split over the kernels' thread pool
 * (pool.h) in tasks of (KV head, block of query rows), the most expensive (last) blocks
 * first. A task's lanes are its query rows x the G heads of its KV head (up to 48, three
 * vectors), so one read of a key block serves all of them, and the softmax state (running
 * max, sum, the scale of the output) is per lane: every step of the online softmax is a
 * vertical vector op. Per block of 64 keys: S^T [keys x lanes] = K Q^T (a register tile of
 * 8 keys x the lanes, broadcasting K), the block's max and exp, then O^T [head_dim x lanes]
 * += V^T P^T (a tile of 8 head dims x the lanes, broadcasting V), rescaled by
 * exp(old max - new max) as it is loaded.
 *
 * Every output row is computed by one task in a fixed order (key blocks ascending, head_dim
 * ascending inside a dot product), so the result does not depend on the thread count or on
 * which thread runs the task. float32 FMAs throughout: within float32 rounding of torch's
 * SDPA (tests/unit/test_prefill_attention.py).
 *
 * Built by services/gpu_worker/cpu_kernels.py with the other kernels; without AVX-512 the
 * function returns -1 and attention.py keeps the torch path.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "pool.h"

#ifdef __AVX512F__
#include <immintrin.h>

#define BK 64     /* keys per block */
#define LANES 48  /* the most query rows x heads a task holds: three vectors */
#define RK 8      /* keys per S tile */
#define RD 8      /* head dims per O tile */
#define MAX_D 256 /* the stack buffers' bound (d * (2 * BK + 2 * LANES) floats) */

typedef struct {
    const float *q;
    const char *cache;
    const int64_t *pages;
    float *out;
    int64_t q_stride, out_stride, q_len, kv_len, hkv, g, d, page_size, window, bq, nqb;
    float scale;
    int bf16;
} Job;

/* exp(x) on 16 lanes: Cephes' expf as exp_poly.h (x = n ln2 + r, a degree-6 polynomial in r),
 * 2^n applied by scalef; within 2 ulp of libm's for x in [-87, 88]. */
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    x = _mm512_min_ps(x, _mm512_set1_ps(88.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(y, n);
}

/* Keys [k0, k0 + n) of KV head h, K and V each as n rows of d float32 (kb, vb); K padded
 * with zero rows to a multiple of RK. */
static void pack_block(const Job *j, int64_t h, int64_t k0, int64_t n, float *restrict kb, float *restrict vb) {
    const int64_t d = j->d, row = j->hkv * d, half = j->page_size * row, elt = j->bf16 ? 2 : 4;
    for (int64_t r = 0; r < n; r++) {
        const int64_t key = k0 + r;
        const int64_t at = j->pages[key / j->page_size] * 2 * half + key % j->page_size * row + h * d;
        if (j->bf16) {
            const uint16_t *restrict ks = (const uint16_t *)j->cache + at, *restrict vs = ks + half;
            uint32_t *restrict kd = (uint32_t *)(kb + r * d), *restrict vd = (uint32_t *)(vb + r * d);
#pragma omp simd
            for (int64_t e = 0; e < d; e++) kd[e] = (uint32_t)ks[e] << 16;
#pragma omp simd
            for (int64_t e = 0; e < d; e++) vd[e] = (uint32_t)vs[e] << 16;
        } else {
            memcpy(kb + r * d, j->cache + at * elt, sizeof(float) * d);
            memcpy(vb + r * d, j->cache + (at + half) * elt, sizeof(float) * d);
        }
    }
    const int64_t padded = (n + RK - 1) / RK * RK;
    memset(kb + n * d, 0, sizeof(float) * (padded - n) * d);
}

/* s [n_pad x nv*16] = kb [n_pad x d] qt^T, qt [d x nv*16] (the scaled queries, transposed). */
__attribute__((always_inline)) static inline void scores(const float *restrict kb, const float *restrict qt,
                                                         int64_t n, int64_t d, const int nv, float *restrict s) {
    const int w = nv * 16;
    for (int64_t j0 = 0; j0 < n; j0 += RK) {
        __m512 acc[RK][3];
        for (int r = 0; r < RK; r++)
            for (int v = 0; v < nv; v++) acc[r][v] = _mm512_setzero_ps();
        const float *k = kb + j0 * d;
        for (int64_t e = 0; e < d; e++) {
            __m512 qv[3];
            for (int v = 0; v < nv; v++) qv[v] = _mm512_loadu_ps(qt + e * w + v * 16);
            for (int r = 0; r < RK; r++) {
                const __m512 kk = _mm512_set1_ps(k[r * d + e]);
                for (int v = 0; v < nv; v++) acc[r][v] = _mm512_fmadd_ps(qv[v], kk, acc[r][v]);
            }
        }
        for (int r = 0; r < RK; r++)
            for (int v = 0; v < nv; v++) _mm512_storeu_ps(s + (j0 + r) * w + v * 16, acc[r][v]);
    }
}

/* ot [d x nv*16] = ot * alpha (per lane) + vb^T [d x n] p [n x nv*16]. */
__attribute__((always_inline)) static inline void accumulate(const float *restrict vb, const float *restrict p,
                                                             int64_t n, int64_t d, const int nv, const __m512 *alpha,
                                                             float *restrict ot) {
    const int w = nv * 16;
    for (int64_t e0 = 0; e0 < d; e0 += RD) {
        __m512 acc[RD][3];
        for (int r = 0; r < RD; r++)
            for (int v = 0; v < nv; v++) acc[r][v] = _mm512_mul_ps(_mm512_loadu_ps(ot + (e0 + r) * w + v * 16), alpha[v]);
        const float *vr = vb + e0;
        for (int64_t k = 0; k < n; k++, vr += d) {
            __m512 pv[3];
            for (int v = 0; v < nv; v++) pv[v] = _mm512_loadu_ps(p + k * w + v * 16);
            for (int r = 0; r < RD; r++) {
                const __m512 vv = _mm512_set1_ps(vr[r]);
                for (int v = 0; v < nv; v++) acc[r][v] = _mm512_fmadd_ps(pv[v], vv, acc[r][v]);
            }
        }
        for (int r = 0; r < RD; r++)
            for (int v = 0; v < nv; v++) _mm512_storeu_ps(ot + (e0 + r) * w + v * 16, acc[r][v]);
    }
}

/* The online softmax over one block's scores s [n x lanes] (keys k0 + j), in place into
 * p = exp(s - new max), masked to each lane's keys [lo, hi] when `masked`; updates the
 * running max and sum and sets alpha = exp(old max - new max). */
__attribute__((always_inline)) static inline void softmax_block(float *restrict s, int64_t n, int64_t k0, const int nv,
                                                                int masked, const __m512i *lo, const __m512i *hi,
                                                                __m512 *mx, __m512 *sum, __m512 *alpha) {
    const int w = nv * 16;
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    for (int v = 0; v < nv; v++) {
        __m512 bm = ninf;
        for (int64_t j = 0; j < n; j++) {
            __m512 x = _mm512_loadu_ps(s + j * w + v * 16);
            if (masked) {
                const __m512i key = _mm512_set1_epi32((int32_t)(k0 + j));
                const __mmask16 vis = _mm512_cmple_epi32_mask(lo[v], key) & _mm512_cmple_epi32_mask(key, hi[v]);
                x = _mm512_mask_blend_ps(vis, ninf, x);
                _mm512_storeu_ps(s + j * w + v * 16, x);
            }
            bm = _mm512_max_ps(bm, x);
        }
        const __m512 m = _mm512_max_ps(mx[v], bm);
        /* a lane that has seen no key yet keeps max -inf: subtract 0 there (its p are all 0) */
        const __mmask16 live = _mm512_cmp_ps_mask(m, ninf, _CMP_NEQ_OQ);
        const __m512 use = _mm512_maskz_mov_ps(live, m);
        const __mmask16 had = _mm512_cmp_ps_mask(mx[v], ninf, _CMP_NEQ_OQ);
        alpha[v] = _mm512_maskz_mov_ps(had, exp512(_mm512_sub_ps(mx[v], use)));
        __m512 t = _mm512_setzero_ps();
        for (int64_t j = 0; j < n; j++) {
            const __m512 x = _mm512_loadu_ps(s + j * w + v * 16);
            __m512 e = exp512(_mm512_sub_ps(x, use));
            if (masked) e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, ninf, _CMP_NEQ_OQ), e);
            _mm512_storeu_ps(s + j * w + v * 16, e);
            t = _mm512_add_ps(t, e);
        }
        sum[v] = _mm512_fmadd_ps(sum[v], alpha[v], t);
        mx[v] = m;
    }
}

/* One task's rows: query rows [i0, i0 + rows) x the G heads of KV head h, as lanes
 * m = r * G + g (nv vectors). */
__attribute__((always_inline)) static inline void run_task(const Job *j, int64_t h, int64_t i0, int64_t rows,
                                                           const int nv) {
    const int64_t d = j->d, g = j->g, lanes = rows * g, off = j->kv_len - j->q_len, w = nv * 16;
    float qt[d * w] __attribute__((aligned(64)));
    float ot[d * w] __attribute__((aligned(64)));
    float kb[BK * d] __attribute__((aligned(64)));
    float vb[BK * d] __attribute__((aligned(64)));
    float s[BK * w] __attribute__((aligned(64)));
    int32_t lo_a[48] __attribute__((aligned(64))), hi_a[48] __attribute__((aligned(64)));
    for (int64_t m = 0; m < w; m++) {
        const int64_t i = i0 + m / g;
        if (m < lanes) {
            const float *qm = j->q + i * j->q_stride + (h * g + m % g) * d;
            for (int64_t e = 0; e < d; e++) qt[e * w + m] = qm[e] * j->scale;
            hi_a[m] = (int32_t)(off + i);
            lo_a[m] = j->window > 0 && off + i - j->window + 1 > 0 ? (int32_t)(off + i - j->window + 1) : 0;
        } else { /* a padding lane: zero queries, sees no key */
            for (int64_t e = 0; e < d; e++) qt[e * w + m] = 0.f;
            hi_a[m] = -1;
            lo_a[m] = 0;
        }
    }
    memset(ot, 0, sizeof(float) * d * w);
    __m512i lo[3], hi[3];
    __m512 mx[3], sum[3], alpha[3];
    for (int v = 0; v < nv; v++) {
        lo[v] = _mm512_loadu_si512(lo_a + v * 16);
        hi[v] = _mm512_loadu_si512(hi_a + v * 16);
        mx[v] = _mm512_set1_ps(-INFINITY);
        sum[v] = _mm512_setzero_ps();
    }
    const int64_t first = lo_a[0], last = off + i0 + rows - 1;        /* keys any lane sees */
    const int64_t all_from = lo_a[lanes - 1], all_to = off + i0;      /* keys every lane sees */
    for (int64_t b0 = first / BK * BK; b0 <= last; b0 += BK) {
        const int64_t k0 = b0 > first ? b0 : first, k1 = b0 + BK <= last ? b0 + BK : last + 1, n = k1 - k0;
        const int masked = !(k0 >= all_from && k1 - 1 <= all_to);
        pack_block(j, h, k0, n, kb, vb);
        scores(kb, qt, (n + RK - 1) / RK * RK, d, nv, s);
        softmax_block(s, n, k0, nv, masked, lo, hi, mx, sum, alpha);
        accumulate(vb, s, n, d, nv, alpha, ot);
    }
    for (int v = 0; v < nv; v++) _mm512_storeu_ps(s + v * 16, _mm512_div_ps(_mm512_set1_ps(1.0f), sum[v]));
    for (int64_t m = 0; m < lanes; m++) {
        float *o = j->out + (i0 + m / g) * j->out_stride + (h * g + m % g) * d;
        const float inv = s[m];
        for (int64_t e = 0; e < d; e++) o[e] = ot[e * w + m] * inv;
    }
}

/* Task t: KV head t % hkv, query block nqb - 1 - t / hkv (the longest rows first). */
static void task(void *ctx, int t) {
    const Job *j = (const Job *)ctx;
    const int64_t h = t % j->hkv, i0 = (j->nqb - 1 - t / j->hkv) * j->bq;
    const int64_t rows = j->q_len - i0 < j->bq ? j->q_len - i0 : j->bq, nv = (rows * j->g + 15) / 16;
    if (nv == 1)
        run_task(j, h, i0, rows, 1);
    else if (nv == 2)
        run_task(j, h, i0, rows, 2);
    else
        run_task(j, h, i0, rows, 3);
}
#endif

/* Returns 0, or -1 for what it does not take (no AVX-512; head_dim not a multiple of 8 or
 * over 256; more than 48 query heads per KV head; query heads not a multiple of KV heads),
 * -2 for a chunk with more rows than keys or none. */
int mstar_prefill_attention(const float *q, int64_t q_stride, const void *cache, int64_t bf16, const int64_t *pages,
                            int64_t q_len, int64_t kv_len, int64_t hq, int64_t hkv, int64_t d, int64_t page_size,
                            int64_t window, float scale, float *out, int64_t out_stride) {
#ifdef __AVX512F__
    if (hkv <= 0 || hq % hkv || hq / hkv > LANES || d % RD || d > MAX_D || d <= 0) return -1;
    if (q_len <= 0 || kv_len < q_len) return -2;
    const int64_t g = hq / hkv, bq = LANES / g < q_len ? LANES / g : q_len;
    Job j = {.q = q, .cache = (const char *)cache, .pages = pages, .out = out, .q_stride = q_stride,
             .out_stride = out_stride, .q_len = q_len, .kv_len = kv_len, .hkv = hkv, .g = g, .d = d,
             .page_size = page_size, .window = window, .bq = bq, .nqb = (q_len + bq - 1) / bq, .scale = scale,
             .bf16 = bf16 != 0};
    mstar_parallel_for((int)(j.nqb * hkv), task, &j);
    return 0;
#else
    (void)q; (void)q_stride; (void)cache; (void)bf16; (void)pages; (void)q_len; (void)kv_len; (void)hq; (void)hkv;
    (void)d; (void)page_size; (void)window; (void)scale; (void)out; (void)out_stride;
    return -1;
#endif
}
