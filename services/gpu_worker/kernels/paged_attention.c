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
 * Built at first use by services/gpu_worker/cpu_kernels.py with the machine's C compiler
 * (-O3 -march=native -mprefer-vector-width=512 -fopenmp-simd; no OpenMP runtime: one thread).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <float.h>

#include "exp_poly.h"

#define MAX_HEADS 128

/* One query row over keys [a, b) of its pages, every head at once: the cached row of all
 * KV heads is one contiguous read (hkv * d floats). */
static inline void query_row(const float *restrict q, const float *restrict cache, const int64_t *restrict pg,
                             int64_t a, int64_t b, int64_t hq, int64_t hkv, int64_t g_n, int64_t d, int64_t row, int64_t half,
                             int64_t page_size, float scale, float *restrict s, float *restrict out) {
    const int64_t n = b - a;
    float mx[MAX_HEADS], sum[MAX_HEADS];
    for (int64_t h = 0; h < hq; h++) mx[h] = -FLT_MAX;
    /* scores: s[h * n + (j - a)] = scale * q_h . k_j, page by page */
    for (int64_t j = a; j < b;) {
        const int64_t off = j % page_size, end = j - off + page_size < b ? j - off + page_size : b;
        const float *k = cache + pg[j / page_size] * 2 * half + off * row;
        if (end < b) __builtin_prefetch(cache + pg[end / page_size] * 2 * half);
        for (; j < end; j++, k += row) {
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
        const float *v = cache + (pg[j / page_size] * 2 + 1) * half + off * row;
        if (end < b) __builtin_prefetch(cache + (pg[end / page_size] * 2 + 1) * half);
        for (; j < end; j++, v += row) {
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

/* Returns 0, or -1 for shapes it does not take (more than 128 query heads, or query heads not a multiple of KV heads), -2 for a row
 * with no keys or more than max_keys. */
int mstar_paged_decode(const float *q, int64_t q_stride, const float *cache, const int64_t *pages, int64_t width,
                       const int64_t *qrow, const int64_t *entry, const int64_t *lo, const int64_t *hi, int64_t n_rows,
                       int64_t hq, int64_t hkv, int64_t d, int64_t page_size, float scale, float *out, float *scratch,
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
            query_row(qi, cache, pg, lo[i], hi[i], hq, hkv, g_n, 64, row, half, page_size, scale, scratch, oi);
        else
            query_row(qi, cache, pg, lo[i], hi[i], hq, hkv, g_n, d, row, half, page_size, scale, scratch, oi);
    }
    return 0;
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
