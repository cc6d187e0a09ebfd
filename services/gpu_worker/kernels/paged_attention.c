/* Paged attention kernels for the CPU path (float32, FlashInfer's page layout).
 *
 * mstar_write_kv: a step's new K/V rows into their pages (one memcpy per row and half;
 * torch's two index_put calls per layer cost more than the copy).
 *
 * mstar_paged_decode: each query row attends over its request's KV
 * pages where they lie, in FlashInfer's page layout [P, 2, page_size, kv_heads, head_dim]
 * (float32). The torch path first gathers every page of the batch into a contiguous copy
 * (index_select) and then runs SDPA over the copy; for decode rows (one to a few queries per
 * request) that copy is most of the cost. Here K and V are read once, in place.
 *
 * Query row i belongs to entry entry[i] (its pages are pages[entry[i] * width ...]) and
 * sees the held rows [lo[i], hi[i]) of that entry. Its heads are q[qrow[i] * q_stride ...]
 * (query head h * G + g uses KV head h) and its output goes to out[qrow[i] * Hq * D ...].
 * One pass over K writes the scores to `scratch` (Hq * max_keys floats), the softmax is
 * exact (max subtracted), and one pass over V accumulates every head's output.
 *
 * mstar_write_kv_bf16 / mstar_paged_decode_bf16: the same over bfloat16 pages (a
 * `--kv-cache-dtype bfloat16` pool; half the KV bytes). A page value is read as float32 by a
 * 16-bit shift (exact), so the decode is the float32 kernel's run on the pages widened
 * (bitwise); a row is stored rounded to nearest even, NaN as 0xFFFF, as torch's
 * `.to(torch.bfloat16)` rounds (tests/unit/test_paged_attention_bf16.py).
 *
 * Built at first use by services/gpu_worker/cpu_kernels.py with the machine's C compiler
 * (-O3 -march=native -mprefer-vector-width=512 -fopenmp-simd; no OpenMP runtime: one thread).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <float.h>

#include "exp_poly.h"

#define MAX_HEADS 128

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

/* The cached row (kv_heads * head_dim values) at element `at` of the pool, as float32: in
 * place for a float32 pool, widened into `buf` for a bfloat16 one (so both run the same
 * arithmetic after it). `bf16` is a constant at every (inlined) call site. */
static inline const float *cached_row(const void *restrict cache, const int bf16, int64_t at, int64_t row,
                                      float *restrict buf) {
    if (!bf16) return (const float *)cache + at;
    const uint16_t *restrict h = (const uint16_t *)cache + at;
#pragma omp simd
    for (int64_t e = 0; e < row; e++) buf[e] = bf16_to_f32(h[e]);
    return buf;
}

/* One query row over keys [a, b) of its pages, every head at once: the cached row of all
 * KV heads is one contiguous read (hkv * d values). */
__attribute__((always_inline))
static inline void query_row(const float *restrict q, const void *restrict cache, const int bf16,
                             const int64_t *restrict pg,
                             int64_t a, int64_t b, int64_t hq, int64_t hkv, int64_t g_n, int64_t d, int64_t row, int64_t half,
                             int64_t page_size, float scale, float *restrict s, float *restrict out) {
    const int64_t n = b - a, elt = bf16 ? 2 : 4;
    const char *bytes = (const char *)cache;
    float mx[MAX_HEADS], sum[MAX_HEADS];
    float buf[bf16 ? row : 1];  /* a bfloat16 row widened */
    for (int64_t h = 0; h < hq; h++) mx[h] = -FLT_MAX;
    /* scores: s[h * n + (j - a)] = scale * q_h . k_j, page by page */
    for (int64_t j = a; j < b;) {
        const int64_t off = j % page_size, end = j - off + page_size < b ? j - off + page_size : b;
        int64_t at = pg[j / page_size] * 2 * half + off * row;  /* the row's first element in the pool */
        if (end < b) __builtin_prefetch(bytes + elt * pg[end / page_size] * 2 * half);
        for (; j < end; j++, at += row) {
            const float *k = cached_row(cache, bf16, at, row, buf);
            for (int64_t hk = 0, h = 0; hk < hkv; hk++) {
                const float *kh = k + hk * d;
                for (int64_t g = 0; g < g_n; g++, h++) {
                    const float *qh = q + h * d;
                    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
                    for (int64_t e = 0; e < d; e++) acc += qh[e] * kh[e];
                    acc *= scale;
                    s[h * n + (j - a)] = acc;
                    mx[h] = acc > mx[h] ? acc : mx[h];
                }
            }
        }
    }
    for (int64_t h = 0; h < hq; h++) {
        float *sh = s + h * n, m = mx[h], t = 0.f;
#pragma omp simd reduction(+ : t)
        for (int64_t j = 0; j < n; j++) {
            sh[j] = exp_poly(sh[j] - m);
            t += sh[j];
        }
        sum[h] = t;
    }
    memset(out, 0, sizeof(float) * hq * d);
    for (int64_t j = a; j < b;) {
        const int64_t off = j % page_size, end = j - off + page_size < b ? j - off + page_size : b;
        int64_t at = (pg[j / page_size] * 2 + 1) * half + off * row;
        if (end < b) __builtin_prefetch(bytes + elt * (pg[end / page_size] * 2 + 1) * half);
        for (; j < end; j++, at += row) {
            const float *v = cached_row(cache, bf16, at, row, buf);
            for (int64_t hk = 0, h = 0; hk < hkv; hk++) {
                const float *vh = v + hk * d;
                for (int64_t g = 0; g < g_n; g++, h++) {
                    const float p = s[h * n + (j - a)];
                    float *o = out + h * d;
#pragma omp simd
                    for (int64_t e = 0; e < d; e++) o[e] += p * vh[e];
                }
            }
        }
    }
    for (int64_t h = 0; h < hq; h++) {
        const float inv = 1.f / sum[h];
#pragma omp simd
        for (int64_t e = 0; e < d; e++) out[h * d + e] *= inv;
    }
}

/* Both page types' decode: every query row through query_row (bf16 a constant). */
__attribute__((always_inline))
static inline int paged_decode(const float *q, int64_t q_stride, const void *cache, const int bf16,
                               const int64_t *pages, int64_t width, const int64_t *qrow, const int64_t *entry,
                               const int64_t *lo, const int64_t *hi, int64_t n_rows, int64_t hq, int64_t hkv,
                               int64_t d, int64_t page_size, float scale, float *out, float *scratch,
                               int64_t max_keys) {
    const int64_t g_n = hq / hkv;
    if (hq > MAX_HEADS || g_n * hkv != hq) return -1;
    const int64_t row = hkv * d, half = page_size * row;
    for (int64_t i = 0; i < n_rows; i++) {
        if (hi[i] - lo[i] <= 0 || hi[i] - lo[i] > max_keys) return -2;
        const float *qi = q + qrow[i] * q_stride;
        float *oi = out + qrow[i] * hq * d;
        const int64_t *pg = pages + entry[i] * width;
        if (d == 64)  /* the common head size, with a constant trip count */
            query_row(qi, cache, bf16, pg, lo[i], hi[i], hq, hkv, g_n, 64, row, half, page_size, scale, scratch, oi);
        else
            query_row(qi, cache, bf16, pg, lo[i], hi[i], hq, hkv, g_n, d, row, half, page_size, scale, scratch, oi);
    }
    return 0;
}

/* Returns 0, or -1 for shapes it does not take (more than 128 query heads, or query heads not a multiple of KV heads), -2 for a row
 * with no keys or more than max_keys. */
int mstar_paged_decode(const float *q, int64_t q_stride, const float *cache, const int64_t *pages, int64_t width,
                       const int64_t *qrow, const int64_t *entry, const int64_t *lo, const int64_t *hi, int64_t n_rows,
                       int64_t hq, int64_t hkv, int64_t d, int64_t page_size, float scale, float *out, float *scratch,
                       int64_t max_keys) {
    return paged_decode(q, q_stride, cache, 0, pages, width, qrow, entry, lo, hi, n_rows, hq, hkv, d, page_size, scale,
                        out, scratch, max_keys);
}

/* mstar_paged_decode over bfloat16 pages (same arguments and codes; the pool's elements are
 * bfloat16, q, out and scratch float32). */
int mstar_paged_decode_bf16(const float *q, int64_t q_stride, const uint16_t *cache, const int64_t *pages,
                            int64_t width, const int64_t *qrow, const int64_t *entry, const int64_t *lo,
                            const int64_t *hi, int64_t n_rows, int64_t hq, int64_t hkv, int64_t d, int64_t page_size,
                            float scale, float *out, float *scratch, int64_t max_keys) {
    return paged_decode(q, q_stride, cache, 1, pages, width, qrow, entry, lo, hi, n_rows, hq, hkv, d, page_size, scale,
                        out, scratch, max_keys);
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
