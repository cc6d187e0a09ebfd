/* Prefill attention on the paged K/V for the CPU path (flash attention: blocked, online
 * softmax, never a [rows x keys] score matrix).
 *
 * mstar_prefill_attention: query rows [0, q_len) of one chunk (q rows q_stride floats apart,
 * each row's heads contiguous) attend over the chunk's first kv_len keys, which lie in its
 * pages (`pages`, int64) of the pool [P, 2, page_size, kv_heads, head_dim] (FlashInfer's
 * layout; K at [:, 0], V at [:, 1]), float32, bfloat16 or int8 (`kind` says which: 0, 1, 2;
 * bfloat16 is widened by a 16-bit shift, exactly; int8 pages hold each head's head_dim values
 * then its float32 scale, read as (float)q * scale, as paged_attention.c's decode reads them). Query head h * G + g uses KV head h. Causal, aligned bottom-right:
 * row i sees keys j <= kv_len - q_len + i, and with a sliding window W > 0 only those with
 * j > kv_len - q_len + i - W (transformers' convention, attention.py's `window_mask`). A
 * window W < 0 means no causal order: every row sees every key (an encoder's
 * attention; kv_len may then be below q_len). Per sequence and layer this ran the 32
 * sentences of an all-MiniLM-L6-v2 batch ~4x faster than a gather of the pages and SDPA.
 *
 * The torch path gathers the pages into a contiguous copy and runs SDPA on one thread. Here
 * one job of the kernels' thread pool (pool.h) first copies each KV head's keys out of the
 * pages once, as float32 (a contiguous run of K rows and of V rows per head, so no task
 * gathers pages), then a second splits the attention in tasks of (KV head, block of query
 * rows), the most expensive (last) blocks first. A task's lanes are its query rows x the G
 * heads of its KV head (up to 48: three 16-lane vectors, or six of AVX2's 8), so one read of a key block serves all of
 * them, and the softmax state (running max, sum, the scale of the output) is per lane: every
 * step of the online softmax is a vertical vector op. Per block of 64 keys: S^T [keys x
 * lanes] = K Q^T (a register tile of 8 keys x the lanes, broadcasting K; AVX2, with 16
 * registers: 8 keys x one vector), the block's max and exp, then O^T [head_dim x lanes]
 * += V^T P^T (a tile of 8 head dims x the lanes, broadcasting V; AVX2 8 x one vector), rescaled by
 * exp(old max - new max) as it is loaded. float32 FMAs throughout (about 85% of the FMA peak
 * on a 2,048-row prompt; the AVX2 path takes ~2.1x the AVX-512 one's time at 512 rows on a
 * Zen 5 core, whose AVX2 FMA rate is half its AVX-512 one): within float32 rounding of
 * torch's SDPA (tests/unit/test_prefill_attention.py). (bfloat16 dot products, with the
 * queries or the softmax weights rounded to bfloat16, were up to 1.8x faster but moved the
 * default model's logits by 0.3-0.5 and changed a greedy answer: not taken.)
 *
 * Every output row is computed by one task in a fixed order (key blocks ascending, head_dim
 * ascending inside a dot product), so the result does not depend on the thread count or on
 * which thread runs the task.
 *
 * Written once over simd.h's vector (16 lanes with AVX-512, 8 with AVX2 + FMA); every lane's
 * arithmetic is the same operations in the same order at either width. Built by
 * services/gpu_worker/cpu_kernels.py with the other kernels; without either the function
 * returns -1 and attention.py keeps the torch path.
 */
#include <float.h>
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pool.h"
#include "simd.h"

#if MSTAR_VL
#define VL MSTAR_VL
#define BK 64              /* keys per block */
#define LANES 48           /* the most query rows x heads a task holds: three vectors (AVX2: six) */
#define NV_MAX (LANES / VL)
#if VL == 16
#define TV 3               /* lane vectors per register tile */
#define RK 8               /* keys per S tile: 8 x 3 accumulators */
#define RD 8               /* head dims per O tile */
#else
/* AVX2, 16 registers: tiles of 8 keys (head dims) x one lane vector, 8 FMA chains, a vector
 * and 8 broadcasts loaded a step. The tile of 4 x 3 (12 chains) took all 16 registers, so
 * gcc read the lane vectors from memory at every FMA (16 loads a 12 FMAs); alone on a Zen 5
 * core (64 keys x 48 lanes x d 64, one thread) 4 x 3 ran at 95 GFLOP/s, 4 x 2 at 85, 8 x 1 at
 * 115 (its FMA peak there ~131: 65 for 4 chains, latency-bound at one FMA a cycle). */
#define TV 1
#define RK 8
#define RD 8
#endif
#define MAX_D 256          /* the stack buffers' bound (d * (2 * LANES) + BK * LANES floats) */
#define PACK_KEYS 256      /* keys per packing task */
#define KEEP_BYTES (64 << 20) /* the packed K/V buffer is kept for the next call up to this size */

typedef struct {
    const float *q;
    const char *cache;
    const int64_t *pages;
    float *out;
    float *kp, *vp; /* the packed K and V: per KV head kvp rows of d */
    int64_t q_stride, out_stride, q_len, kv_len, hkv, g, d, page_size, window, bq, nqb, kvp, npack;
    float scale;
    int kind; /* pages: 0 float32, 1 bfloat16, 2 int8 (each head's d values, then its float32 scale) */
    const float *sinks; /* per query head, or NULL: exp(sink - max) joins each row's denominator */
    int64_t base;       /* key blocks start at multiples of BK in rows counted from key 0's row - base */
} Job;

/* Packing task t: keys [k0, k0 + PACK_KEYS) of KV head t / npack out of the pages into the
 * head's contiguous runs of float32 K rows and V rows (rows from kv_len up to kvp zeros). */
static void pack_task(void *ctx, int t) {
    const Job *j = (const Job *)ctx;
    const int64_t d = j->d, row = j->hkv * d, half = j->page_size * row, h = t / j->npack;
    const int64_t k0 = t % j->npack * PACK_KEYS, k1 = k0 + PACK_KEYS < j->kvp ? k0 + PACK_KEYS : j->kvp;
    for (int64_t key = k0; key < k1; key++) {
        float *restrict kd = j->kp + (h * j->kvp + key) * d, *restrict vd = j->vp + (h * j->kvp + key) * d;
        if (key >= j->kv_len) {
            memset(kd, 0, sizeof(float) * d);
            memset(vd, 0, sizeof(float) * d);
            continue;
        }
        if (j->kind == 2) { /* int8: d values then the head's float32 scale, d + 4 bytes a head */
            const int64_t brow = j->hkv * (d + 4), bhalf = j->page_size * brow;
            const int8_t *ks = (const int8_t *)j->cache + j->pages[key / j->page_size] * 2 * bhalf
                               + key % j->page_size * brow + h * (d + 4), *vs = ks + bhalf;
            float ksc, vsc;
            memcpy(&ksc, ks + d, sizeof ksc);
            memcpy(&vsc, vs + d, sizeof vsc);
#pragma omp simd
            for (int64_t e = 0; e < d; e++) kd[e] = (float)ks[e] * ksc;
#pragma omp simd
            for (int64_t e = 0; e < d; e++) vd[e] = (float)vs[e] * vsc;
            continue;
        }
        const int64_t at = j->pages[key / j->page_size] * 2 * half + key % j->page_size * row + h * d;
        if (j->kind) {
            const uint16_t *restrict ks = (const uint16_t *)j->cache + at, *restrict vs = ks + half;
            uint32_t *restrict kw = (uint32_t *)kd, *restrict vw = (uint32_t *)vd;
#pragma omp simd
            for (int64_t e = 0; e < d; e++) kw[e] = (uint32_t)ks[e] << 16;
#pragma omp simd
            for (int64_t e = 0; e < d; e++) vw[e] = (uint32_t)vs[e] << 16;
        } else {
            const float *restrict ks = (const float *)j->cache + at, *restrict vs = ks + half;
#pragma omp simd
            for (int64_t e = 0; e < d; e++) kd[e] = ks[e];
#pragma omp simd
            for (int64_t e = 0; e < d; e++) vd[e] = vs[e];
        }
    }
}

/* s [n x w] = kb [n x d] qt^T at lane vectors [v0, v0 + tv) (tv <= TV, a constant), qt
 * [d x w] the scaled queries, transposed; n a multiple of RK. A tile of RK keys x tv vectors;
 * each score one FMA chain over e in order, whatever the tile. */
__attribute__((always_inline)) static inline void scores_tile(const float *restrict kb, const float *restrict qt,
                                                              int64_t n, const int64_t d, const int w, int v0,
                                                              const int tv, float *restrict s) {
    for (int64_t j0 = 0; j0 < n; j0 += RK) {
        vf acc[RK][TV];
        for (int r = 0; r < RK; r++)
            for (int v = 0; v < tv; v++) acc[r][v] = vzero();
        const float *k = kb + j0 * d;
        for (int64_t e = 0; e < d; e++) {
            vf qv[TV];
            for (int v = 0; v < tv; v++) qv[v] = vload(qt + e * w + (v0 + v) * VL);
            for (int r = 0; r < RK; r++) {
                const vf kk = vset1(k[r * d + e]);
                for (int v = 0; v < tv; v++) acc[r][v] = vfma(qv[v], kk, acc[r][v]);
            }
        }
        for (int r = 0; r < RK; r++)
            for (int v = 0; v < tv; v++) vstore(s + (j0 + r) * w + (v0 + v) * VL, acc[r][v]);
    }
}

/* All nv lane vectors' scores: one tile's width, or (AVX2's six) tiles of TV over the same
 * keys, each its own call so that its width is a constant. */
__attribute__((always_inline)) static inline void scores(const float *restrict kb, const float *restrict qt,
                                                         int64_t n, const int64_t d, const int nv, float *restrict s) {
    if (nv <= TV)
        scores_tile(kb, qt, n, d, nv * VL, 0, nv, s);
    else
        for (int v0 = 0; v0 < nv; v0 += TV) scores_tile(kb, qt, n, d, nv * VL, v0, TV, s);
}

/* ot [d x w] = ot * alpha (per lane) + vb^T [d x n] p [n x w] at lane vectors [v0, v0 + tv),
 * in tiles of RD head dims; each output one FMA chain over the keys in order. */
__attribute__((always_inline)) static inline void accumulate_tile(const float *restrict vb, const float *restrict p,
                                                                  int64_t n, const int64_t d, const int w, int v0,
                                                                  const int tv, const vf *alpha, float *restrict ot) {
    for (int64_t e0 = 0; e0 < d; e0 += RD) {
        vf acc[RD][TV];
        for (int r = 0; r < RD; r++)
            for (int v = 0; v < tv; v++) acc[r][v] = vmul(vload(ot + (e0 + r) * w + (v0 + v) * VL), alpha[v0 + v]);
        const float *vr = vb + e0;
        for (int64_t k = 0; k < n; k++, vr += d) {
            vf pv[TV];
            for (int v = 0; v < tv; v++) pv[v] = vload(p + k * w + (v0 + v) * VL);
            for (int r = 0; r < RD; r++) {
                const vf vv = vset1(vr[r]);
                for (int v = 0; v < tv; v++) acc[r][v] = vfma(pv[v], vv, acc[r][v]);
            }
        }
        for (int r = 0; r < RD; r++)
            for (int v = 0; v < tv; v++) vstore(ot + (e0 + r) * w + (v0 + v) * VL, acc[r][v]);
    }
}

__attribute__((always_inline)) static inline void accumulate(const float *restrict vb, const float *restrict p,
                                                             int64_t n, const int64_t d, const int nv,
                                                             const vf *alpha, float *restrict ot) {
    if (nv <= TV)
        accumulate_tile(vb, p, n, d, nv * VL, 0, nv, alpha, ot);
    else
        for (int v0 = 0; v0 < nv; v0 += TV) accumulate_tile(vb, p, n, d, nv * VL, v0, TV, alpha, ot);
}

/* The block's part of the online softmax for one vector of lanes (s at that vector, rows w
 * floats apart): when `masked`, a key k0 + j outside a lane's [lo, hi] becomes -inf; sets the
 * new running max and alpha = exp(old max - new max), and returns what exp subtracts (the new
 * max, or 0 in a lane that has seen no key yet: its p are all 0). */
__attribute__((always_inline)) static inline vf block_max(float *restrict s, int64_t n, int64_t k0, int w, int masked,
                                                          vi lo, vi hi, vf *mx, vf *alpha) {
    const vf ninf = vset1(-INFINITY);
    vf bm = ninf;
    for (int64_t j = 0; j < n; j++) {
        vf x = vload(s + j * w);
        if (masked) {
            x = vin_range(x, lo, hi, (int32_t)(k0 + j), ninf);
            vstore(s + j * w, x);
        }
        bm = vmax(bm, x);
    }
    const vf m = vmax(*mx, bm);
    const vf use = vunless_ninf(m, m);
    *alpha = vunless_ninf(*mx, vexp(vsub(*mx, use)));
    *mx = m;
    return use;
}

/* p = exp(s - use) in place for one vector of lanes (a masked key's p is 0); returns the
 * lanes' sums of p, added in key order. */
__attribute__((always_inline)) static inline vf block_exp(float *restrict s, int64_t n, int w, int masked, vf use) {
    vf t = vzero();
    for (int64_t j = 0; j < n; j++) {
        const vf x = vload(s + j * w);
        vf e = vexp(vsub(x, use));
        if (masked) e = vunless_ninf(x, e);
        vstore(s + j * w, e);
        t = vadd(t, e);
    }
    return t;
}

/* The online softmax over one block's scores s [n x lanes] (keys k0 + j), per vector of
 * lanes: p = exp(s - new max) in place, the running max and sum updated, alpha =
 * exp(old max - new max) for the output. */
__attribute__((always_inline)) static inline void softmax_block(float *restrict s, int64_t n, int64_t k0, const int nv,
                                                                int masked, const vi *lo, const vi *hi, vf *mx,
                                                                vf *sum, vf *alpha) {
    const int w = nv * VL;
    for (int v = 0; v < nv; v++) {
        const vf use = block_max(s + v * VL, n, k0, w, masked, lo[v], hi[v], &mx[v], &alpha[v]);
        sum[v] = vfma(sum[v], alpha[v], block_exp(s + v * VL, n, w, masked, use));
    }
}

/* The task's queries, scaled and transposed, qt [d x w] (lane m = r * G + g; zero in a
 * padding lane), and each lane's keys [lo, hi] (a padding lane none). */
static void pack_queries(const Job *j, int64_t h, int64_t i0, int64_t lanes, int64_t w, float *qt, int32_t *lo,
                         int32_t *hi) {
    const int64_t d = j->d, g = j->g, off = j->kv_len - j->q_len;
    for (int64_t m = 0; m < w; m++) {
        const int64_t i = i0 + m / g;
        hi[m] = m < lanes ? (int32_t)(j->window < 0 ? j->kv_len - 1 : off + i) : -1;
        lo[m] = m < lanes && j->window > 0 && off + i - j->window + 1 > 0 ? (int32_t)(off + i - j->window + 1) : 0;
        const float *qm = j->q + i * j->q_stride + (h * g + m % g) * d;
        for (int64_t e = 0; e < d; e++) qt[e * w + m] = m < lanes ? qm[e] * j->scale : 0.f;
    }
}

/* With attention sinks: each lane's 1 / (sum + exp(sink of its head - its max)) into s. */
static void sink_denominators(const Job *j, int64_t h, int64_t lanes, int nv, const vf *mx, const vf *sum, float *s) {
    float sm[LANES + 16] __attribute__((aligned(64))), mm[LANES + 16] __attribute__((aligned(64)));
    for (int v = 0; v < nv; v++) {
        vstore(sm + v * VL, sum[v]);
        vstore(mm + v * VL, mx[v]);
    }
    for (int64_t m = 0; m < lanes; m++) s[m] = 1.f / (sm[m] + expf(j->sinks[h * j->g + m % j->g] - mm[m]));
}

/* One task's rows: query rows [i0, i0 + rows) x the G heads of KV head h, as lanes
 * m = r * G + g (nv vectors); d a constant where it is the common 64. */
__attribute__((always_inline)) static inline void run_task(const Job *j, int64_t h, int64_t i0, int64_t rows,
                                                           const int nv, const int64_t d) {
    const int64_t g = j->g, lanes = rows * g, off = j->kv_len - j->q_len, w = nv * VL;
    float qt[d * w] __attribute__((aligned(64)));
    float ot[d * w] __attribute__((aligned(64)));
    float s[BK * w] __attribute__((aligned(64)));
    int32_t lo_a[LANES] __attribute__((aligned(64))), hi_a[LANES] __attribute__((aligned(64)));
    pack_queries(j, h, i0, lanes, w, qt, lo_a, hi_a);
    memset(ot, 0, sizeof(float) * d * w);
    vi lo[NV_MAX], hi[NV_MAX];
    vf mx[NV_MAX], sum[NV_MAX], alpha[NV_MAX];
    for (int v = 0; v < nv; v++) {
        lo[v] = viload(lo_a + v * VL);
        hi[v] = viload(hi_a + v * VL);
        mx[v] = vset1(-INFINITY);
        sum[v] = vzero();
    }
    const int64_t bidir = j->window < 0;
    const int64_t first = lo_a[0], last = bidir ? j->kv_len - 1 : off + i0 + rows - 1; /* keys any lane sees */
    const int64_t all_from = lo_a[lanes - 1], all_to = bidir ? last : off + i0; /* every lane sees: no mask */
    const float *kh = j->kp + h * j->kvp * d, *vh = j->vp + h * j->kvp * d;
    for (int64_t b0 = (first + j->base) / BK * BK - j->base; b0 <= last; b0 += BK) {
        const int64_t k0 = b0 > first ? b0 : first, k1 = b0 + BK <= last ? b0 + BK : last + 1, n = k1 - k0;
        const int masked = !(k0 >= all_from && k1 - 1 <= all_to);
        /* whole S tiles: up to RK - 1 keys past the last (kvp has them) */
        scores(kh + k0 * d, qt, (n + RK - 1) / RK * RK, d, nv, s);
        softmax_block(s, n, k0, nv, masked, lo, hi, mx, sum, alpha);
        accumulate(vh + k0 * d, s, n, d, nv, alpha, ot);
    }
    for (int v = 0; v < nv; v++) vstore(s + v * VL, vdiv(vset1(1.0f), sum[v]));
    if (j->sinks) sink_denominators(j, h, lanes, nv, mx, sum, s);
    for (int64_t m = 0; m < lanes; m++) {
        float *o = j->out + (i0 + m / g) * j->out_stride + (h * g + m % g) * d;
        const float inv = s[m];
        for (int64_t e = 0; e < d; e++) o[e] = ot[e * w + m] * inv;
    }
}

/* run_task with nv and (for 64) d as constants: nv 1-3, and with AVX2's 8 lanes 6 (4 or 5
 * rounded up: a padding lane sees no key and is never written). */
#define NV_CASES(D)                                                          \
    switch (nv) {                                                            \
    case 1: run_task(j, h, i0, rows, 1, D); break;                          \
    case 2: run_task(j, h, i0, rows, 2, D); break;                          \
    case 3: run_task(j, h, i0, rows, 3, D); break;                          \
    default: if (NV_MAX > 3) run_task(j, h, i0, rows, NV_MAX, D); break;    \
    }

/* Task t: KV head t % hkv, query block nqb - 1 - t / hkv (the longest rows first). */
static void task(void *ctx, int t) {
    const Job *j = (const Job *)ctx;
    const int64_t h = t % j->hkv, i0 = (j->nqb - 1 - t / j->hkv) * j->bq;
    const int64_t rows = j->q_len - i0 < j->bq ? j->q_len - i0 : j->bq, nv = (rows * j->g + VL - 1) / VL;
    if (j->d == 64)
        NV_CASES(64)
    else
        NV_CASES(j->d)
}

/* The packed K/V buffer: one kept between calls (up to KEEP_BYTES), taken by one call at a
 * time; a call that finds it taken, or needs more, allocates its own. */
static atomic_flag kept_taken = ATOMIC_FLAG_INIT;
static void *kept;
static size_t kept_bytes;

static void *take_buffer(size_t bytes, int *own) {
    bytes = (bytes + 63) / 64 * 64;
    *own = 1;
    if (bytes <= KEEP_BYTES && !atomic_flag_test_and_set(&kept_taken)) {
        if (kept_bytes < bytes) {
            free(kept);
            kept = aligned_alloc(64, bytes);
            kept_bytes = kept ? bytes : 0;
        }
        if (kept) {
            *own = 0;
            return kept;
        }
        atomic_flag_clear(&kept_taken);
    }
    return aligned_alloc(64, bytes);
}

static void give_buffer(void *buf, int own) {
    if (own)
        free(buf);
    else
        atomic_flag_clear(&kept_taken);
}
#endif

/* mstar_prefill_attention_sinks: with `sinks` (one logit per query head; NULL: none) each
 * row's softmax denominator also takes exp(sink - the row's max), which adds no value
 * (gpt-oss's attention sinks). `key_base`: the absolute row of key 0 (the chunk's first live
 * page's), so the key blocks, whose boundaries are where a row's online softmax rescales,
 * fall at multiples of BK absolute rows: a row's bits then do not depend on how many pages
 * behind a sliding window were released before its chunk (with 0, as mstar_prefill_attention
 * below passes, they do). mstar_prefill_attention is it without sinks, key_base 0.
 * Returns 0, or -1 for what it does not take (no AVX-512 or AVX2; head_dim not a multiple of 8 or
 * over 256; more than 48 query heads per KV head; query heads not a multiple of KV heads),
 * -2 for a causal chunk with more rows than keys, or none, -3 when the packed K/V's memory could not
 * be had. */
int mstar_prefill_attention_sinks(const float *q, int64_t q_stride, const void *cache, int64_t kind,
                                  const int64_t *pages, int64_t q_len, int64_t kv_len, int64_t hq, int64_t hkv,
                                  int64_t d, int64_t page_size, int64_t window, float scale, float *out,
                                  int64_t out_stride, const float *sinks, int64_t key_base) {
#if MSTAR_VL
    /* head_dim a multiple of 8 on either class (AVX2's O tile would take 4): the same shapes
     * run here whichever class was built */
    if (hkv <= 0 || hq % hkv || hq / hkv > LANES || d % 8 || d > MAX_D || d <= 0) return -1;
    if (q_len <= 0 || kv_len <= 0 || (window >= 0 && kv_len < q_len)) return -2;
    if (kind < 0 || kind > 2) return -1;
    const int64_t g = hq / hkv, bq = LANES / g < q_len ? LANES / g : q_len;
    Job j = {.q = q, .cache = (const char *)cache, .pages = pages, .out = out, .q_stride = q_stride,
             .out_stride = out_stride, .q_len = q_len, .kv_len = kv_len, .hkv = hkv, .g = g, .d = d,
             .page_size = page_size, .window = window, .bq = bq, .nqb = (q_len + bq - 1) / bq, .scale = scale,
             .kind = (int)kind, .sinks = sinks, .base = key_base};
    j.kvp = (kv_len + RK - 1) / RK * RK + RK; /* the S tiles' reads past the last key */
    j.npack = (j.kvp + PACK_KEYS - 1) / PACK_KEYS;
    const size_t half = (size_t)(hkv * j.kvp * d) * sizeof(float);
    int own;
    char *buf = take_buffer(2 * half, &own);
    if (!buf) return -3;
    j.kp = (float *)buf;
    j.vp = (float *)(buf + half);
    mstar_parallel_for((int)(hkv * j.npack), pack_task, &j);
    mstar_parallel_for((int)(j.nqb * hkv), task, &j);
    give_buffer(buf, own);
    return 0;
#else
    (void)q; (void)q_stride; (void)cache; (void)kind; (void)pages; (void)q_len; (void)kv_len; (void)hq; (void)hkv;
    (void)d; (void)page_size; (void)window; (void)scale; (void)out; (void)out_stride; (void)sinks;
    (void)key_base;
    return -1;
#endif
}

/* mstar_prefill_attention_sinks without sinks (what every model but gpt-oss runs). */
int mstar_prefill_attention(const float *q, int64_t q_stride, const void *cache, int64_t kind, const int64_t *pages,
                            int64_t q_len, int64_t kv_len, int64_t hq, int64_t hkv, int64_t d, int64_t page_size,
                            int64_t window, float scale, float *out, int64_t out_stride) {
    return mstar_prefill_attention_sinks(q, q_stride, cache, kind, pages, q_len, kv_len, hq, hkv, d, page_size, window,
                                         scale, out, out_stride, NULL, 0);
}
