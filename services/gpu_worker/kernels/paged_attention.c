/* Paged attention kernels for the CPU path (float32 or bfloat16 pages, FlashInfer's page layout).
 *
 * mstar_write_kv: a step's new K/V rows into their pages (one memcpy per row and half;
 * torch's two index_put calls per layer cost more than the copy).
 *
 * mstar_paged_decode: each query row attends over its request's KV pages where they lie, in
 * FlashInfer's page layout [P, 2, page_size, kv_heads, head_dim]. The torch path first gathers
 * every page of the batch into a contiguous copy (index_select) and then runs SDPA over the
 * copy; for decode rows (one to a few queries per request) that copy is most of the cost.
 * Here K and V are read once, in place.
 *
 * Query row i belongs to entry entry[i] (its pages are pages[entry[i] * width ...]) and
 * sees the held rows [lo[i], hi[i]) of that entry. Its heads are q[qrow[i] * q_stride ...]
 * (query head h * G + g uses KV head h) and its output goes to out[qrow[i] * Hq * D ...].
 *
 * Work is split over the threads of pool.c's pool (flash-decoding): a task is one query row and
 * one partition of PART keys ([lo + p * PART, ...)), every head; when a call has fewer
 * partitions than GROUP_TASKS per thread (one short row: a c1 decode step), each is split
 * further into groups of KV heads (a head's arithmetic is the same in any group, so the bits
 * do not change), as many heads to a group, where the tasks then come out even over the
 * threads: 4 KV heads as 4 tasks on two threads, but SmolLM2's 3 as one task (as 3 on two
 * threads, in its decode steps at 100-400 keys, its attention took 20-35% longer: one thread
 * did two tasks' strided slices of the pages while the other waited). A task walks its
 * partition's pages twice, K then V; on each page every head of the task takes the page's
 * keys (the rows' slices of its KV heads, read from memory once, serve each KV head's query
 * heads), with the page PF_ROWS ahead
 * prefetched into L2, a few lines with each key (struct pf_cursor). The K walk writes the
 * scores to a buffer on the task's stack, the softmax is exact over the partition (its max
 * subtracted), and the V walk accumulates the outputs. A row of at most PART keys is one partition, which writes its
 * output normalized: the arithmetic of the single-threaded kernel before the split, bit for
 * bit (each score, sum and output the same operations in the same order). A longer row's
 * partitions each leave their max m_p, sum l_p and unnormalized output o_p per head in the
 * scratch, and the last of them to finish (an atomic count per row) merges them in partition
 * order: M = max m_p, w_p = exp(m_p - M), out = (sum w_p o_p) / (sum w_p l_p). The partitions
 * and the merge order depend on the row's length only, never on the thread count or on which
 * thread ran what, so the result is the same bits on any number of threads; it differs from
 * one exact softmax over the whole row by float rounding only (a few ulp: the partitions' sums
 * are shorter; tests/unit/test_decode_attention_split.py holds it to SDPA within 1e-5).
 *
 * mstar_write_kv_bf16 / mstar_paged_decode_bf16: the same over bfloat16 pages (a
 * `--kv-cache-dtype bfloat16` pool; half the KV bytes). A page value is read as float32 by a
 * 16-bit shift (exact; vpmovzxwd + vpslld in the vector paths), so the decode is the float32
 * kernel's run on the pages widened (bitwise); a row is stored rounded to nearest even, NaN as
 * 0xFFFF, as torch's `.to(torch.bfloat16)` rounds (tests/unit/test_paged_attention_bf16.py).
 *
 * mstar_write_kv_i8 / mstar_paged_decode_i8: the same over int8 pages (`--kv-cache-dtype int8`;
 * about a quarter of float32's KV bytes). Each (row, KV head) vector is stored as head_dim int8
 * values then its float32 scale (absmax / 127, symmetric; head_dim + 4 bytes), so a page's
 * rows stay one contiguous run and the scale sits in the cache line its values are read from.
 * A value is read as (float)q * scale, so the decode is the float32 kernel's run on the pages
 * dequantized (bitwise, as for bfloat16); the stored values are torch's quantization of the
 * row (attention.py's quantize_kv, tests/unit/test_paged_attention_int8.py).
 *
 * Head sizes 16, 32, 48, 64, 128 and 256 (Gemma 3) with AVX-512 or AVX2 + FMA have a path of intrinsics
 * (simd.h's vector of VL = 16 or 8 lanes): q and the outputs of a block of up to GB query heads
 * of one KV head (AVX-512, d = 128: 2, d = 256: 1) in registers while it takes a page's keys
 * (AVX2, with half the registers: q from L1 and the outputs in chunks of head dims), and a
 * score is its FMA chain over the head's VL-lane slices, then a fixed tree over the VL lanes,
 * done for VL keys at once (vfold). Other head sizes, or neither: plain loops, a score's
 * sum in 8 partial sums written out (dot_plain). Each path's scores are its own bits (16-, 8-
 * or the plain loops' 8-lane partial sums), fixed by the head size and the class alone: a
 * row's output never depends on the rows beside it in the call (test_decode_attention_split's
 * batch invariance test). Heads go in passes of up to HC (their scores on the stack); only the first
 * prefetches, the others find the partition in L2.
 *
 * Memory: on a 2-core EPYC VM (~28 GB/s from DRAM with two threads reading in sequence), a decode
 * step of the default model (SmolLM2-135M, 30 layers, bfloat16 pages) at 2,048 keys spends
 * ~2.5 ms in attention on two threads (47 MB of K/V: ~19 GB/s), ~9.5 ms on one thread before
 * the split. Software prefetches go to L2 (prefetcht1): into L1 they held the core's few L1
 * miss buffers and halved the speed. On a Zen 4 EPYC VM (~32 GB/s) the same step's attention
 * took ~2.9 ms with a page's prefetches issued at once and ~2.2 ms spread over its keys
 * (a plain two-thread read of K/V pages scattered as the pool holds them reaches ~21 GB/s:
 * ~2.2 ms).
 *
 * Timed per class with `python -m bench.kernel_classes` (AVX2 on an AVX-512 host through
 * MSTAR_CPU_CLASS=avx2): on a Zen 5 core, whose AVX2 FMA rate is half its AVX-512 one, the
 * AVX2 path takes 1.2-2.4x the AVX-512 path's time over cached pages (2-3x faster than the
 * plain loops it replaces there).
 *
 * Built at first use by services/gpu_worker/cpu_kernels.py with the machine's C compiler
 * (-O3, the class's flags).
 */
#include <float.h>
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#include "exp_poly.h"
#include "pool.h"
#include "simd.h"

#define MAX_HEADS 128
#define PART 512   /* keys per partition (fixed: the thread count never changes the result) */
#define GB 4       /* query heads of one KV head whose accumulators are in registers at once */
#define HC 16      /* query heads per pass over a partition (their scores on the task's stack) */
#define GROUP_TASKS 2 /* a call with fewer partitions than this per thread splits them by KV head */
#define PF_ROWS 32 /* rows (whole pages of them, at least one) prefetched ahead of the one read */

/* A bfloat16 value as float32: its bits are the float's top half (exact). */
static inline float bf16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* float32 -> bfloat16 rounded to nearest even (c10::BFloat16's rule); NaN -> 0xFFFF, as
 * torch's CPU conversion writes it. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint16_t r = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    return f != f ? (uint16_t)0xFFFF : r;
}

/* Bytes of one pool element: float32 (kind 0), bfloat16 (1), int8 (2). */
#define ELT(kind) ((kind) == 0 ? 4 : (kind) == 1 ? 2 : 1)

/* An int8 head vector's scale: the float32 after its d values (unaligned: memcpy). */
static inline float i8_scale(const int8_t *x, int64_t d) {
    float sc;
    memcpy(&sc, x + d, sizeof sc);
    return sc;
}

/* d values of one head at element `at` of a bfloat16 (kind 1) or int8 (kind 2) pool as
 * float32: bfloat16 exactly, int8 as (float)q * scale (one rounding: torch's
 * `q.float() * scale`, the reference's dequantization, bit for bit). */
__attribute__((always_inline)) static inline void widen(const void *cache, const int kind, int64_t at, int64_t d,
                                                        float *restrict buf) {
    if (kind == 1) {
        const uint16_t *x = (const uint16_t *)cache + at;
#pragma omp simd
        for (int64_t e = 0; e < d; e++) buf[e] = bf16_to_f32(x[e]);
    } else {
        const int8_t *x = (const int8_t *)cache + at;
        const float sc = i8_scale(x, d);
#pragma omp simd
        for (int64_t e = 0; e < d; e++) buf[e] = (float)x[e] * sc;
    }
}

/* One decode call's shapes and pointers, shared by its tasks. */
struct decode_job {
    const float *q;
    int64_t q_stride;
    const void *cache;
    const int64_t *pages, *qrow, *entry, *lo, *hi;
    /* parts: task slots per row; groups: tasks per partition (KV-head groups); hs: a head's
     * elements in a row (d, int8: d + 4) */
    int64_t width, hq, hkv, g_n, d, hs, row, half, page_size, parts, groups;
    float scale;
    float *out;
    float *rec;         /* partition records, [n_rows][parts][hq * (d + 2)]: maxes, sums, outputs */
    _Atomic int *done;  /* per row: its partitions finished */
    const float *sinks; /* per query head, or NULL: exp(sink - max) joins each row's denominator */
};

/* One task's keys: its row's pages, keys [a, b), the row's last page (prefetches stop there),
 * and whether its pass prefetches (the first of its passes over the heads). */
struct span {
    const int64_t *pg;
    int64_t a, b, last_page;
    int pf;
    int64_t ka, kb; /* the task's KV heads [ka, kb): only their slices of a row are prefetched */
    struct pf_cursor *pc;
};

/* The prefetches still to issue for the page ahead ([cur, end)), `step` bytes of them with
 * each key a block takes (pf_some): spread over the page's work rather than issued at once,
 * which stalled the core on its few miss buffers until the page arrived, so the loads did
 * not overlap the arithmetic (2,048 keys of SmolLM2 a layer, cold, two threads: ~85 us in a
 * burst, ~60 us spread; a plain read of the same pages takes ~55). */
struct pf_cursor {
    const char *cur, *end;
    int64_t step;
};

/* The cursor's page, all of what is left of it, now. */
__attribute__((always_inline)) static inline void pf_rest(struct pf_cursor *c) {
    for (; c->cur < c->end; c->cur += 64) __builtin_prefetch(c->cur, 0, 2);
}

__attribute__((always_inline)) static inline void pf_some(const struct span *S) {
    struct pf_cursor *c = S->pc;
    for (int64_t b = 0; b < c->step && c->cur < c->end; b += 64, c->cur += 64) __builtin_prefetch(c->cur, 0, 2);
}

/* Prefetches page index k's half kv into L2: every KV head's rows (one run) through the
 * cursor, whose rest for the previous page is issued now; a task's slices of the rows (a
 * group of KV heads, short rows) at once. Always inlined: GCC takes a function of prefetches
 * alone for a pure one, and drops its calls. */
__attribute__((always_inline)) static inline void prefetch_half(const struct decode_job *J, const struct span *S,
                                                                int64_t k, int kv, int elt) {
    if (!S->pf || k > S->last_page) return;
    const char *base = (const char *)J->cache + elt * ((S->pg[k] * 2 + kv) * J->half + S->ka * J->hs);
    const int64_t len = elt * (S->kb - S->ka) * J->hs;
    if (len == elt * J->row) { /* every KV head: the page half is one run */
        struct pf_cursor *c = S->pc;
        pf_rest(c);
        c->cur = base;
        c->end = base + elt * J->half;
        return;
    }
    for (int64_t r = 0; r < J->page_size; r++, base += elt * J->row)
        for (int64_t c = 0; c < len; c += 64) __builtin_prefetch(base + c, 0, 2);
}

/* The keys from j to the end of their page (or of the span, *end) begin at the returned
 * element: key j's cached row (every KV head) in half kv (0 K, 1 V). The page PF_ROWS ahead is
 * prefetched, past the span too: the thread's next task is mostly the row's next partition. */
__attribute__((always_inline)) static inline int64_t page_run(const struct decode_job *J, const struct span *S,
                                                              int64_t j, int kv, int elt, int64_t *end) {
    const int64_t k = j / J->page_size, off = j - k * J->page_size;
    *end = (k + 1) * J->page_size < S->b ? (k + 1) * J->page_size : S->b;
    prefetch_half(J, S, k + (J->page_size < PF_ROWS ? PF_ROWS / J->page_size : 1), kv, elt);
    return (S->pg[k] * 2 + kv) * J->half + off * J->row;
}

/* The end of the register block starting at query head h (below h1): at most `cap` heads, all
 * of one KV head. */
static inline int64_t block_end(const struct decode_job *J, int64_t h, int64_t h1, int64_t cap) {
    int64_t e = (h / J->g_n + 1) * J->g_n;
    e = e < h1 ? e : h1;
    return e < h + cap ? e : h + cap;
}

/* exp(s - m) in place over n scores, and their sum (the loop of the kernel before the split:
 * same vectorization, same bits). */
static inline float softmax_part(float *restrict sh, int64_t n, float m) {
    float t = 0.f;
#pragma omp simd reduction(+ : t)
    for (int64_t j = 0; j < n; j++) {
        sh[j] = exp_poly(sh[j] - m);
        t += sh[j];
    }
    return t;
}

/* Hands a pass's heads [h0, h0 + nh) on: normalized into `dst` (the row's output, heads of d)
 * when the row is one partition, else the partition's record (its maxes, sums and
 * unnormalized outputs, for the merge). */
static inline void finish_heads(const struct decode_job *J, const float *restrict o, const float *mx,
                                const float *sum, int64_t h0, int64_t nh, float *restrict dst, float *restrict rec) {
    const int64_t d = J->d;
    if (!rec) {
        for (int64_t g = 0; g < nh; g++) {
            const float inv = 1.f / (J->sinks ? sum[g] + expf(J->sinks[h0 + g] - mx[g]) : sum[g]);
#pragma omp simd
            for (int64_t e = 0; e < d; e++) dst[(h0 + g) * d + e] = o[g * d + e] * inv;
        }
        return;
    }
    for (int64_t g = 0; g < nh; g++) {
        rec[h0 + g] = mx[g];
        rec[J->hq + h0 + g] = sum[g];
        memcpy(rec + 2 * J->hq + (h0 + g) * d, o + g * d, sizeof(float) * d);
    }
}

/* q . k over d floats in a fixed order: DOT_LANES partial sums (lane l takes the elements
 * e = l mod DOT_LANES, in order), then a fixed tree. Not an `omp simd` reduction: that lets
 * GCC order the sum as each copy of the loop it makes likes, and GCC 12 made two here (one
 * vectorized, one scalar: -fopt-info-vec), picked at run time, so a row's scores took one
 * order or the other with the heads its task had (the KV-head split, `groups`, is chosen by
 * the batch's size): a row of more than a page changed bits with the rows beside it, and
 * dropping that pragma alone made it invariant. Written out, every copy the compiler makes
 * is IEEE's same sum (it still vectorizes the lanes). */
#define DOT_LANES 8
static inline float dot_plain(const float *restrict a, const float *restrict b, int64_t d) {
    float p[DOT_LANES] = {0.f};
    int64_t e = 0;
    for (; e + DOT_LANES <= d; e += DOT_LANES)
        for (int l = 0; l < DOT_LANES; l++) p[l] += a[e + l] * b[e + l];
    for (int l = 0; e < d; e++, l++) p[l] += a[e] * b[e];
    return ((p[0] + p[4]) + (p[2] + p[6])) + ((p[1] + p[5]) + (p[3] + p[7]));
}

/* The plain-loop pass over heads [h0, h1), any head size d (q: the row's heads). */
__attribute__((always_inline)) static inline void pass_plain(const struct decode_job *J, const struct span *S,
                                                             const int kind, const float *restrict q, int64_t h0,
                                                             int64_t h1, int64_t d, float *restrict dst,
                                                             float *restrict rec) {
    const int64_t n = S->b - S->a, elt = ELT(kind), nh = h1 - h0;
    float s[HC * PART] __attribute__((aligned(64)));
    float mx[HC], sum[HC], buf[kind ? d : 1], o[HC * d];
    for (int64_t g = 0; g < nh; g++) mx[g] = -FLT_MAX;
    S->pc->step = (elt * J->row + 63) / 64 * 64; /* a page's rows over its keys */
    for (int64_t j = S->a, end; j < S->b;) {
        for (int64_t at = page_run(J, S, j, 0, elt, &end); j < end; j++, at += J->row) {
            pf_some(S);
            for (int64_t h = h0, hk = -1; h < h1; h++) {
                const float *k = kind ? buf : (const float *)J->cache + at + (h / J->g_n) * d;
                if (kind && h / J->g_n != hk) {  /* this KV head's slice widened */
                    hk = h / J->g_n;
                    widen(J->cache, kind, at + hk * J->hs, d, buf);
                }
                const float acc = dot_plain(q + h * d, k, d) * J->scale;
                s[(h - h0) * PART + (j - S->a)] = acc;
                mx[h - h0] = acc > mx[h - h0] ? acc : mx[h - h0];
            }
        }
    }
    for (int64_t g = 0; g < nh; g++) sum[g] = softmax_part(s + g * PART, n, mx[g]);
    memset(o, 0, sizeof(float) * nh * d);
    for (int64_t j = S->a, end; j < S->b;) {
        for (int64_t at = page_run(J, S, j, 1, elt, &end); j < end; j++, at += J->row) {
            pf_some(S);
            for (int64_t h = h0, hk = -1; h < h1; h++) {
                const float *v = kind ? buf : (const float *)J->cache + at + (h / J->g_n) * d;
                if (kind && h / J->g_n != hk) {
                    hk = h / J->g_n;
                    widen(J->cache, kind, at + hk * J->hs, d, buf);
                }
                const float p = s[(h - h0) * PART + (j - S->a)];
#pragma omp simd
                for (int64_t e = 0; e < d; e++) o[(h - h0) * d + e] += p * v[e];
            }
        }
    }
    finish_heads(J, o, mx, sum, h0, nh, dst, rec);
}

/* The plain pass out of line, a copy per page kind (d = 64 with a constant trip count): the
 * task functions then hold the vector passes alone, whose code the plain loops' changes
 * (dot_plain) do not move. */
#define PLAIN_PASS(name, KIND)                                                                                  \
    static __attribute__((noinline)) void name(const struct decode_job *J, const struct span *S, const float *q, \
                                               int64_t h0, int64_t h1, float *dst, float *rec) {                \
        if (J->d == 64)                                                                                         \
            pass_plain(J, S, KIND, q, h0, h1, 64, dst, rec);                                                    \
        else                                                                                                    \
            pass_plain(J, S, KIND, q, h0, h1, J->d, dst, rec);                                                  \
    }
PLAIN_PASS(plain_f32, 0)
PLAIN_PASS(plain_bf16, 1)
PLAIN_PASS(plain_i8, 2)

#if MSTAR_VL
#define VL MSTAR_VL
#if VL == 16
#define QREGS 16 /* q vectors a K block keeps in registers (of 32) */
#define VC_MAX 16 /* output vectors a V block keeps in registers */
/* heads per register block: 4 of 64, 2 of 128, 1 of 256 (q or the outputs: 16 registers) */
#define BLOCK_CAP(nv) ((nv) == 16 ? 1 : (nv) == 8 ? 2 : GB)
#define V_CHUNK(gb, nv) (nv)
#else
/* AVX2: 16 registers. A K block of GB heads takes q from L1 (one load per FMA, as a memory
 * operand) where its heads' q would not fit beside the key's vectors; a V block keeps at
 * most 8 output vectors, so the outputs go in chunks of head dims (V_CHUNK vectors of each
 * of the block's heads: 12 or fewer accumulators, each key vector loaded and widened once
 * for all of them). An output is the same FMA chain over the keys in any chunk. */
#define QREGS 8
#define VC_MAX 8
#define BLOCK_CAP(nv) GB
/* of 1, 2-3 or 4 heads: 8, 4 or 2 vectors, fewer where nv is smaller or not a multiple (a
 * divisor of nv for each head size with a vector path: d = 16, 32, 48 are nv = 2, 4, 6) */
#define V_CHUNK(gb, nv) \
    ((gb) == 1 ? ((nv) < 8 ? (nv) : 8) : (gb) <= 3 ? ((nv) % 4 == 0 ? 4 : (nv) % 3 == 0 ? 3 : 2) : 2)
#endif

/* Vector v (VL floats) of the head slice at element `at` of the pool (bfloat16: zero-extended
 * and shifted; int8: widened to int32, converted (exact) and times the slice's scale `sc`, as
 * `widen`). */
__attribute__((always_inline)) static inline vf load_vec(const void *cache, const int kind, int64_t at, int v, vf sc) {
    if (kind == 2) return vmul(vload_i8((const int8_t *)cache + at + VL * v), sc);
    if (kind) return vload_bf16((const uint16_t *)cache + at + VL * v);
    return vload((const float *)cache + at + VL * v);
}

/* the int8 slice's scale at `at` (head size VL * nv), broadcast; unused for other pages */
__attribute__((always_inline)) static inline vf slice_scale(const void *cache, const int kind, int64_t at,
                                                            const int nv) {
    return kind == 2 ? vset1(i8_scale((const int8_t *)cache + at, VL * nv)) : vzero();
}

/* K work of one register block (gb heads of one KV head, head size VL * nv: constants) over
 * cnt keys of one page (their head slices at `at`, a row apart), keys jj.. of the partition's
 * n: each key's FMA chain over its VL-lane slices (in order) is kept in acc (head g's at
 * acc + VL * VL g) until VL keys are there or the partition ends, then folded (simd.h's vfold),
 * scaled into the scores (s + g * PART) and its max taken (mv[g]: sc > m ? sc : m, as the
 * plain loop). */
__attribute__((always_inline)) static inline void k_block(const struct decode_job *J, const struct span *S,
                                                          const int kind, const float *restrict q, const int gb,
                                                          const int nv, int64_t at, int64_t cnt, int64_t jj,
                                                          int64_t n, float *restrict acc, float *restrict s, vf *mv) {
    const int qreg = gb * nv <= QREGS;
    vf qv[GB][QREGS];
    if (qreg)
        for (int g = 0; g < gb; g++)
            for (int v = 0; v < nv; v++) qv[g][v % QREGS] = vload(q + g * VL * nv + VL * v);
    for (int64_t e = 0; e < cnt; e++, jj++, at += J->row) {
        pf_some(S);
        const vf sc = slice_scale(J->cache, kind, at, nv);
        vf a[GB];
        for (int v = 0; v < nv; v++) {
            const vf x = load_vec(J->cache, kind, at, v, sc);
            for (int g = 0; g < gb; g++)
                a[g] = vfma(qreg ? qv[g][v % QREGS] : vload(q + g * VL * nv + VL * v), x, v ? a[g] : vzero());
        }
        for (int g = 0; g < gb; g++) vstore_a(acc + g * VL * VL + (jj & (VL - 1)) * VL, a[g]);
        if (((jj + 1) & (VL - 1)) && jj + 1 < n) continue;
        for (int g = 0; g < gb; g++) {
            const vf sc = vmul(vfold(acc + g * VL * VL), vset1(J->scale));
            vstore_a(s + g * PART + (jj & ~(int64_t)(VL - 1)), sc);
            mv[g] = vblend_n(mv[g], vmax(sc, mv[g]), (jj & (VL - 1)) + 1);
        }
    }
}

/* V work of one register block over cnt keys of one page, output vectors [v0, v0 + vc) of
 * each head: o[g] += p_g,j * v_j, key by key in order (each output the plain loop's FMA
 * chain: the same bits), the outputs in registers. The first chunk prefetches. */
__attribute__((always_inline)) static inline void v_block(const struct decode_job *J, const struct span *S,
                                                          const int kind, const int gb, const int nv, int v0,
                                                          const int vc, int64_t at, int64_t cnt, int64_t jj,
                                                          const float *restrict s, float *restrict o) {
    vf acc[GB][VC_MAX];
    for (int g = 0; g < gb; g++)
        for (int v = 0; v < vc; v++) acc[g][v] = vload_a(o + g * VL * nv + VL * (v0 + v));
    for (int64_t e = 0; e < cnt; e++, jj++, at += J->row) {
        if (!v0) pf_some(S);
        const vf sc = slice_scale(J->cache, kind, at, nv);
        vf p[GB];
        for (int g = 0; g < gb; g++) p[g] = vset1(s[g * PART + jj]);
        for (int v = 0; v < vc; v++) {
            const vf x = load_vec(J->cache, kind, at, v0 + v, sc);
            for (int g = 0; g < gb; g++) acc[g][v] = vfma(p[g], x, acc[g][v]);
        }
    }
    for (int g = 0; g < gb; g++)
        for (int v = 0; v < vc; v++) vstore_a(o + g * VL * nv + VL * (v0 + v), acc[g][v]);
}

/* k_block / v_block with the block's head count a constant (one copy each). */
#define BLOCK_CASES(call_1, call_2, call_3, call_4) \
    switch (gb) {                                    \
    case 1: call_1; break;                           \
    case 2: call_2; break;                           \
    case 3: call_3; break;                           \
    default: call_4; break;                          \
    }

__attribute__((always_inline)) static inline void k_any(const struct decode_job *J, const struct span *S,
                                                        const int kind, const float *q, int gb, const int nv,
                                                        int64_t at, int64_t cnt, int64_t jj, int64_t n, float *acc,
                                                        float *s, vf *mv) {
    BLOCK_CASES(k_block(J, S, kind, q, 1, nv, at, cnt, jj, n, acc, s, mv),
                k_block(J, S, kind, q, 2, nv, at, cnt, jj, n, acc, s, mv),
                k_block(J, S, kind, q, 3, nv, at, cnt, jj, n, acc, s, mv),
                k_block(J, S, kind, q, 4, nv, at, cnt, jj, n, acc, s, mv))
}

/* v_block over all of a head's vectors, V_CHUNK(gb) at a time */
__attribute__((always_inline)) static inline void v_chunks(const struct decode_job *J, const struct span *S,
                                                           const int kind, const int gb, const int nv, int64_t at,
                                                           int64_t cnt, int64_t jj, const float *s, float *o) {
    for (int v0 = 0; v0 < nv; v0 += V_CHUNK(gb, nv)) v_block(J, S, kind, gb, nv, v0, V_CHUNK(gb, nv), at, cnt, jj, s, o);
}

__attribute__((always_inline)) static inline void v_any(const struct decode_job *J, const struct span *S,
                                                        const int kind, int gb, const int nv, int64_t at, int64_t cnt,
                                                        int64_t jj, const float *s, float *o) {
    BLOCK_CASES(v_chunks(J, S, kind, 1, nv, at, cnt, jj, s, o), v_chunks(J, S, kind, 2, nv, at, cnt, jj, s, o),
                v_chunks(J, S, kind, 3, nv, at, cnt, jj, s, o), v_chunks(J, S, kind, 4, nv, at, cnt, jj, s, o))
}

/* The vector pass over heads [h0, h1), head size VL * nv (a constant), page by page: on each
 * page every register block of heads takes the page's keys (so the page's whole rows, read
 * from memory once, serve every head while they are in L1), K pages first (scores, maxes),
 * the exact softmax of each head over the partition, then V pages (outputs). */
__attribute__((always_inline)) static inline void pass_vec(const struct decode_job *J, const struct span *S,
                                                           const int kind, const float *restrict q, int64_t h0,
                                                           int64_t h1, const int nv, float *restrict dst,
                                                           float *restrict rec) {
    const int64_t n = S->b - S->a, elt = ELT(kind), d = VL * nv, cap = BLOCK_CAP(nv);
    float s[HC * PART] __attribute__((aligned(64)));
    float acc[HC * VL * VL] __attribute__((aligned(64)));
    float o[HC * 256] __attribute__((aligned(64)));
    float mx[HC], sum[HC];
    vf mv[HC];
    for (int64_t g = 0; g < h1 - h0; g++) mv[g] = vset1(-FLT_MAX);
    int64_t blocks = 0; /* register blocks a page's keys go through: the page ahead's prefetches over them */
    for (int64_t h = h0; h < h1; h = block_end(J, h, h1, cap)) blocks++;
    S->pc->step = (elt * J->row / blocks + 63) / 64 * 64;
    for (int64_t j = S->a, end; j < S->b; j = end) {
        const int64_t at = page_run(J, S, j, 0, elt, &end);
        for (int64_t h = h0, e; h < h1; h = e) {
            e = block_end(J, h, h1, cap);
            k_any(J, S, kind, q + h * d, (int)(e - h), nv, at + (h / J->g_n) * J->hs, end - j, j - S->a, n,
                  acc + (h - h0) * VL * VL, s + (h - h0) * PART, mv + (h - h0));
        }
    }
    for (int64_t g = 0; g < h1 - h0; g++) {
        float m[VL], r = -FLT_MAX;
        vstore(m, mv[g]);
        for (int l = 0; l < VL; l++) r = m[l] > r ? m[l] : r;
        mx[g] = r;
        sum[g] = softmax_part(s + g * PART, n, r);
    }
    memset(o, 0, sizeof(float) * (h1 - h0) * d);
    for (int64_t j = S->a, end; j < S->b; j = end) {
        const int64_t at = page_run(J, S, j, 1, elt, &end);
        for (int64_t h = h0, e; h < h1; h = e) {
            e = block_end(J, h, h1, cap);
            v_any(J, S, kind, (int)(e - h), nv, at + (h / J->g_n) * J->hs, end - j, j - S->a, s + (h - h0) * PART,
                  o + (h - h0) * d);
        }
    }
    finish_heads(J, o, mx, sum, h0, h1 - h0, dst, rec);
}
#endif

/* One task's partition: the row's query heads in passes of up to HC (the first pass
 * prefetches; the others find the partition in L2). `small` (a constant): the task functions
 * of head sizes 16, 32 and 48 (SMALL_HEADS), a copy of their own, so that adding their vector
 * passes left the code of the 64 / 128 / 256 ones as it was (in one function with them, those
 * ran a few percent slower on a shared 2-core Zen 5 VM: bench.kernel_classes' shapes, the
 * least of 21-41 reps alternated with the old build, in either order). */
#define SMALL_HEADS(d) (MSTAR_VL && ((d) == 16 || (d) == 32 || (d) == 48))
__attribute__((always_inline)) static inline void run_part(const struct decode_job *J, struct span *S,
                                                           const int kind, const int small, const float *q,
                                                           float *dst, float *rec) {
    const int64_t ha = S->ka * J->g_n, hb = S->kb * J->g_n;
    for (int64_t h0 = ha; h0 < hb; h0 += HC) {
        const int64_t h1 = h0 + HC < hb ? h0 + HC : hb;
        S->pf = h0 == ha;
#if MSTAR_VL
        if (small) {
            if (J->d == 16)
                pass_vec(J, S, kind, q, h0, h1, 16 / VL, dst, rec);
            else if (J->d == 32)
                pass_vec(J, S, kind, q, h0, h1, 32 / VL, dst, rec);
            else
                pass_vec(J, S, kind, q, h0, h1, 48 / VL, dst, rec);
            continue;
        }
        if (J->d == 64 || J->d == 128 || J->d == 256) {
            if (J->d == 64)
                pass_vec(J, S, kind, q, h0, h1, 64 / VL, dst, rec);
            else if (J->d == 128)
                pass_vec(J, S, kind, q, h0, h1, 128 / VL, dst, rec);
            else
                pass_vec(J, S, kind, q, h0, h1, 256 / VL, dst, rec);
            continue;
        }
#endif
        (kind == 2 ? plain_i8 : kind ? plain_bf16 : plain_f32)(J, S, q, h0, h1, dst, rec);
    }
}

/* Row i: its partitions' records merged in partition order into its output, head by head. */
static void merge(const struct decode_job *J, int64_t i, int64_t nparts) {
    const int64_t hq = J->hq, d = J->d, size = hq * (d + 2);
    const float *rec = J->rec + i * J->parts * size;
    float *dst = J->out + J->qrow[i] * hq * d;
    float o[d];
    for (int64_t h = 0; h < hq; h++) {
        float m = -FLT_MAX, l = 0.f;
        for (int64_t p = 0; p < nparts; p++) m = rec[p * size + h] > m ? rec[p * size + h] : m;
        memset(o, 0, sizeof(float) * d);
        for (int64_t p = 0; p < nparts; p++) {
            const float *r = rec + p * size, w = exp_poly(r[h] - m), *op = r + 2 * hq + h * d;
            l += w * r[hq + h];
#pragma omp simd
            for (int64_t e = 0; e < d; e++) o[e] += w * op[e];
        }
        if (J->sinks) l += expf(J->sinks[h] - m);
        const float inv = 1.f / l;
#pragma omp simd
        for (int64_t e = 0; e < d; e++) dst[h * d + e] = o[e] * inv;
    }
}

/* Task t = row * parts + partition (a row's partitions in a row: one thread mostly takes them
 * one after another, and prefetches the next one's first pages); a slot past the row's
 * partitions is empty. */
__attribute__((always_inline)) static inline void decode_task(const struct decode_job *J, int t, const int kind,
                                                              const int small) {
    const int64_t grp = t % J->groups, p = t / J->groups % J->parts, i = t / J->groups / J->parts;
    const int64_t n = J->hi[i] - J->lo[i], nparts = (n + PART - 1) / PART;
    if (p >= nparts) return;
    const int64_t ka = grp * J->hkv / J->groups, kb = (grp + 1) * J->hkv / J->groups;
    struct pf_cursor pc = {NULL, NULL, 0};
    struct span S = {J->pages + J->entry[i] * J->width, J->lo[i] + p * PART, 0, (J->hi[i] - 1) / J->page_size, 1,
                     ka, kb, &pc};
    S.b = S.a + PART < J->hi[i] ? S.a + PART : J->hi[i];
    float *rec = nparts == 1 ? NULL : J->rec + (i * J->parts + p) * J->hq * (J->d + 2);
    run_part(J, &S, kind, small, J->q + J->qrow[i] * J->q_stride, J->out + J->qrow[i] * J->hq * J->d, rec);
    pf_rest(&pc); /* the next partition's start */
    if (nparts > 1 &&
        atomic_fetch_add_explicit(&J->done[i], 1, memory_order_acq_rel) == nparts * J->groups - 1)
        merge(J, i, nparts);
}

static void task_f32(void *ctx, int t) { decode_task((const struct decode_job *)ctx, t, 0, 0); }
static void task_bf16(void *ctx, int t) { decode_task((const struct decode_job *)ctx, t, 1, 0); }
static void task_i8(void *ctx, int t) { decode_task((const struct decode_job *)ctx, t, 2, 0); }
#if MSTAR_VL
static void task_f32_small(void *ctx, int t) { decode_task((const struct decode_job *)ctx, t, 0, 1); }
static void task_bf16_small(void *ctx, int t) { decode_task((const struct decode_job *)ctx, t, 1, 1); }
static void task_i8_small(void *ctx, int t) { decode_task((const struct decode_job *)ctx, t, 2, 1); }
#endif

/* Count slots (one int per row) at the scratch's start, rounded to 64 bytes. */
static inline int64_t count_floats(int64_t n_rows) { return (n_rows + 15) / 16 * 16; }

/* Floats of scratch a decode of n_rows rows of up to max_keys keys needs: the counts, then a
 * record per row and partition slot (hq maxes, hq sums, hq * d outputs). */
int64_t mstar_paged_decode_scratch(int64_t n_rows, int64_t hq, int64_t d, int64_t max_keys) {
    if (n_rows < 1) return 16;
    const int64_t parts = max_keys > 0 ? (max_keys + PART - 1) / PART : 1;
    return count_floats(n_rows) + n_rows * parts * hq * (d + 2) + 16;
}

/* Both page types' decode: checks, then every task over the pool's threads. */
static int paged_decode(const float *q, int64_t q_stride, const void *cache, const int kind, const int64_t *pages,
                        int64_t width, const int64_t *qrow, const int64_t *entry, const int64_t *lo, const int64_t *hi,
                        int64_t n_rows, int64_t hq, int64_t hkv, int64_t d, int64_t page_size, float scale, float *out,
                        float *scratch, int64_t max_keys, const float *sinks) {
    if (hq > MAX_HEADS || hkv < 1 || (hq / hkv) * hkv != hq) return -1;
    int64_t work = 0; /* the partitions of every row */
    for (int64_t i = 0; i < n_rows; i++) {
        if (hi[i] - lo[i] <= 0 || hi[i] - lo[i] > max_keys) return -2;
        work += (hi[i] - lo[i] + PART - 1) / PART;
    }
    if (n_rows <= 0) return 0;
    const int64_t parts = (max_keys + PART - 1) / PART;
    /* fewer partitions than GROUP_TASKS a thread: each split over the KV heads too (same bits),
     * in groups of as many heads whose tasks come out even over the threads, or not at all */
    const int64_t threads = mstar_pool_threads(), want = GROUP_TASKS * threads;
    int64_t groups = 1;
    if (work < want)
        for (int64_t g = (want + work - 1) / work; g > 1; g--)
            if (g <= hkv && hkv % g == 0 && work * g % threads == 0) {
                groups = g;
                break;
            }
    if (n_rows * parts * groups > INT32_MAX) return -2;
    const int64_t hs = kind == 2 ? d + 4 : d;
    struct decode_job J = {q, q_stride, cache, pages, qrow, entry, lo, hi, width, hq, hkv, hq / hkv, d, hs, hkv * hs,
                           page_size * hkv * hs, page_size, parts, groups, scale, out, NULL, (_Atomic int *)scratch,
                           sinks};
    J.rec = (float *)(((uintptr_t)(scratch + count_floats(n_rows)) + 63) & ~(uintptr_t)63);
    for (int64_t c = 0; c < n_rows; c++) atomic_init(&J.done[c], 0);
    mstar_task_fn fn = kind == 2 ? task_i8 : kind ? task_bf16 : task_f32;
#if MSTAR_VL
    if (SMALL_HEADS(d)) fn = kind == 2 ? task_i8_small : kind ? task_bf16_small : task_f32_small;
#endif
    mstar_parallel_for((int)(n_rows * parts * groups), fn, &J);
    return 0;
}

/* Returns 0, or -1 for shapes it does not take (more than 128 query heads, or query heads not
 * a multiple of KV heads), -2 for a row with no keys or more than max_keys. scratch: at least
 * mstar_paged_decode_scratch(n_rows, hq, d, max_keys) floats. */
int mstar_paged_decode(const float *q, int64_t q_stride, const float *cache, const int64_t *pages, int64_t width,
                       const int64_t *qrow, const int64_t *entry, const int64_t *lo, const int64_t *hi, int64_t n_rows,
                       int64_t hq, int64_t hkv, int64_t d, int64_t page_size, float scale, float *out, float *scratch,
                       int64_t max_keys) {
    return paged_decode(q, q_stride, cache, 0, pages, width, qrow, entry, lo, hi, n_rows, hq, hkv, d, page_size, scale,
                        out, scratch, max_keys, NULL);
}

/* mstar_paged_decode over bfloat16 pages (same arguments and codes; the pool's elements are
 * bfloat16, q, out and scratch float32). */
int mstar_paged_decode_bf16(const float *q, int64_t q_stride, const uint16_t *cache, const int64_t *pages,
                            int64_t width, const int64_t *qrow, const int64_t *entry, const int64_t *lo,
                            const int64_t *hi, int64_t n_rows, int64_t hq, int64_t hkv, int64_t d, int64_t page_size,
                            float scale, float *out, float *scratch, int64_t max_keys) {
    return paged_decode(q, q_stride, cache, 1, pages, width, qrow, entry, lo, hi, n_rows, hq, hkv, d, page_size, scale,
                        out, scratch, max_keys, NULL);
}

/* mstar_paged_decode over int8 pages: each (row, KV head) vector is d int8 values then its
 * float32 scale (d + 4 bytes; mstar_write_kv_i8). Same arguments and codes; each value is
 * read as (float)q * scale, so the result is the float32 kernel's on the dequantized pages,
 * bit for bit. */
int mstar_paged_decode_i8(const float *q, int64_t q_stride, const int8_t *cache, const int64_t *pages, int64_t width,
                          const int64_t *qrow, const int64_t *entry, const int64_t *lo, const int64_t *hi,
                          int64_t n_rows, int64_t hq, int64_t hkv, int64_t d, int64_t page_size, float scale,
                          float *out, float *scratch, int64_t max_keys) {
    return paged_decode(q, q_stride, cache, 2, pages, width, qrow, entry, lo, hi, n_rows, hq, hkv, d, page_size, scale,
                        out, scratch, max_keys, NULL);
}

/* mstar_paged_decode over pages of `kind` (0 float32, 1 bfloat16, 2 int8) with attention sinks
 * (gpt-oss): sinks[h], one logit per query head, joins each row's softmax denominator as
 * exp(sinks[h] - max) and adds no value. Same codes; -1 for another kind. */
int mstar_paged_decode_sinks(int64_t kind, const float *q, int64_t q_stride, const void *cache, const int64_t *pages,
                             int64_t width, const int64_t *qrow, const int64_t *entry, const int64_t *lo,
                             const int64_t *hi, int64_t n_rows, int64_t hq, int64_t hkv, int64_t d, int64_t page_size,
                             float scale, float *out, float *scratch, int64_t max_keys, const float *sinks) {
    if (kind < 0 || kind > 2) return -1;
    return paged_decode(q, q_stride, cache, (int)kind, pages, width, qrow, entry, lo, hi, n_rows, hq, hkv, d,
                        page_size, scale, out, scratch, max_keys, sinks);
}

/* Row i of k and v (row strides k_stride, v_stride floats; each row kv_heads * head_dim
 * contiguous floats, `row`) goes to page slot_pages[i], offset slot_offsets[i]. */
void mstar_write_kv(float *cache, const float *k, int64_t k_stride, const float *v, int64_t v_stride,
                    const int64_t *slot_pages, const int64_t *slot_offsets, int64_t n, int64_t row, int64_t page_size) {
    const int64_t half = page_size * row;
    for (int64_t i = 0; i < n; i++) {
        float *dst = cache + slot_pages[i] * 2 * half + slot_offsets[i] * row;
        memcpy(dst, k + i * k_stride, sizeof(float) * row);
        memcpy(dst + half, v + i * v_stride, sizeof(float) * row);
    }
}

/* mstar_write_kv into bfloat16 pages: each float rounded to nearest even (f32_to_bf16). */
void mstar_write_kv_bf16(uint16_t *cache, const float *k, int64_t k_stride, const float *v, int64_t v_stride,
                         const int64_t *slot_pages, const int64_t *slot_offsets, int64_t n, int64_t row,
                         int64_t page_size) {
    const int64_t half = page_size * row;
    for (int64_t i = 0; i < n; i++) {
        uint16_t *restrict dk = cache + slot_pages[i] * 2 * half + slot_offsets[i] * row;
        uint16_t *restrict dv = dk + half;
        const float *restrict ki = k + i * k_stride, *restrict vi = v + i * v_stride;
#pragma omp simd
        for (int64_t e = 0; e < row; e++) dk[e] = f32_to_bf16(ki[e]);
#pragma omp simd
        for (int64_t e = 0; e < row; e++) dv[e] = f32_to_bf16(vi[e]);
    }
}

/* One head's d floats quantized into int8 at dst, its scale after them: symmetric,
 * scale = absmax / 127 (float32), q = round-half-even(x / scale) clamped to [-127, 127]
 * (torch's `(x / scale).round()`: attention.py's quantize_kv, bit for bit); an all-zero
 * vector gets scale 0 and zeros. */
static inline void quantize_head(const float *restrict x, int64_t d, int8_t *restrict dst) {
    float m = 0.f;
    for (int64_t e = 0; e < d; e++) {
        const float a = fabsf(x[e]);
        m = a > m ? a : m;
    }
    const float sc = m / 127.f;
    for (int64_t e = 0; e < d; e++) {
        float r = sc > 0.f ? nearbyintf(x[e] / sc) : 0.f;
        r = r > 127.f ? 127.f : r < -127.f ? -127.f : r;
        dst[e] = (int8_t)r;
    }
    memcpy(dst + d, &sc, sizeof sc);
}

/* mstar_write_kv into int8 pages (`row` = kv_heads * head_dim floats in, each head stored as
 * head_dim int8 values and its float32 scale: quantize_head). */
void mstar_write_kv_i8(int8_t *cache, const float *k, int64_t k_stride, const float *v, int64_t v_stride,
                       const int64_t *slot_pages, const int64_t *slot_offsets, int64_t n, int64_t row, int64_t d,
                       int64_t page_size) {
    const int64_t heads = row / d, brow = heads * (d + 4), half = page_size * brow;
    for (int64_t i = 0; i < n; i++) {
        int8_t *dk = cache + slot_pages[i] * 2 * half + slot_offsets[i] * brow;
        for (int64_t h = 0; h < heads; h++) {
            quantize_head(k + i * k_stride + h * d, d, dk + h * (d + 4));
            quantize_head(v + i * v_stride + h * d, d, dk + half + h * (d + 4));
        }
    }
}
