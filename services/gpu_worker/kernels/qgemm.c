/* GEMM on GGUF-quantized weights, computed on as they come (llama.cpp's method):
 * out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), where w is never expanded to floats.
 *
 * Weights are repacked at load (services/gpu_worker/layers/quant.py) into one of two forms,
 * both in blocks of 32 along k, every scale a float32 (the GGUF scales are float16 and
 * small integers, so each product below is the one gguf's dequantization computes):
 *   Q4 form: w = d[b] * q + m[b], q in 0..15, 16 bytes per block (byte j: q[j] | q[j+16] << 4)
 *            (Q4_0: m = -8 d; Q4_1: d, m; Q4_K: d * scale, -dmin * min per 32-group)
 *   Q8 form: w = d16[h] * q + m[b], q a signed byte, one scale per 16 (Q6_K's groups; Q8_0's
 *            scale written twice), m per 32 or none (Q8_0, Q6_K, Q5_0: none; Q5_1, Q5_K: one)
 *
 * x is rounded per row and block of 32 to two signed bytes, x ~ d * (q1 + q2 / 256) with
 * d = amax / 127 (llama.cpp's Q8_0 is q1 alone; the second byte, the remainder in 1/256ths,
 * makes it ~15 bits: SmolLM2's greedy answers otherwise drift from the float32 path's), and
 * each block's sum of that rounded x is kept for the m term (as llama.cpp's Q8_1). Per block
 * pair and column, 256 (q1 . w) + (q2 . w) is two VNNI instructions (vpdpbusd, 64 bytes) and
 * a shift in int32 lanes, scaled by d_w * d / 256 into 16 float lanes; the m term is
 * m * sum. So the result is the float32 GEMM of x so rounded and the dequantized weight (up
 * to the order of float additions): x's rounding is the only approximation. A Q8 form byte
 * must not be -128 (the sign trick below cannot negate it; ggml's quantizers never write it
 * and the loader dequantizes a tensor that has one). In decode (a row or a few) the GEMM
 * is bound by reading the weight, so the second byte costs little there.
 *
 * Output columns are split over `threads` OpenMP threads (each column's sum is computed
 * the same way whichever thread runs it, so results do not depend on the thread count).
 * Needs AVX-512 VNNI (mstar_qgemm_available() is 0 elsewhere and the caller dequantizes).
 */
#include <math.h>
#include <stdint.h>

int64_t mstar_qgemm_available(void) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__)
#include <immintrin.h>

/* Block pairs: every layout here goes by pairs of 32-blocks (k padded to a multiple of 64
 * with zero blocks, d = m = 0), each pair's 64 values in the order
 *   [block 0 values 0-15 | block 1 values 0-15 | block 0 values 16-31 | block 1 values 16-31],
 * which is what one 512-bit load of a Q4 pair's 32 bytes gives once split into low and high
 * nibbles; Q8 weights and quantized x are stored in it, Q8 scales as [b0 h0, b1 h0, b0 h1, b1 h1]. */

/* x [m, lda] floats, k values per row -> per row and block of 32, x ~ d * (q1 + q2 / 256):
 * q1 = round(x / d) with d = amax / 127, q2 = round((x - d q1) * 256 / d) (in [-127, 127]),
 * both [m, kp] bytes in pair order; dx = d / 256 (the unit of 256 q1 + q2) and sx = the
 * block's sum of that rounded x, [m, kp / 32]. */
void mstar_quantize_rows(const float *x, int64_t m, int64_t k, int64_t lda, int8_t *qx, int8_t *qx2, float *dx,
                         float *sx) {
    const int64_t kp = (k + 63) / 64 * 64, kb = kp / 32;
    const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
    for (int64_t r = 0; r < m; r++) {
        for (int64_t b = 0; b < kb; b++) {
            const float *src = x + r * lda + b * 32;
            const int64_t left = k - b * 32;
            const __mmask16 m0 = left >= 16 ? 0xFFFF : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
            const __mmask16 m1 = left >= 32 ? 0xFFFF : left <= 16 ? 0 : (__mmask16)((1u << (left - 16)) - 1);
            __m512 v[2] = {_mm512_maskz_loadu_ps(m0, src), _mm512_maskz_loadu_ps(m1, src + 16)};
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
            const float d = amax / 127.f;
            const float id = d > 0.f ? 1.f / d : 0.f;
            const __m512 iv = _mm512_set1_ps(id), dv = _mm512_set1_ps(d), iv256 = _mm512_set1_ps(256.f * id);
            __m512i total = _mm512_setzero_si512();
            int8_t *dst = qx + r * kp + (b / 2) * 64 + (b % 2) * 16;
            int8_t *dst2 = qx2 + r * kp + (b / 2) * 64 + (b % 2) * 16;
            for (int h = 0; h < 2; h++) {
                __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v[h], iv)); /* round to nearest even */
                __m512 rest = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(q1), dv, v[h]);
                __m512i q2 = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(rest, iv256)), lo),
                                              hi);
                total = _mm512_add_epi32(total, _mm512_add_epi32(_mm512_slli_epi32(q1, 8), q2));
                _mm_storeu_si128((__m128i *)(dst + 32 * h), _mm512_cvtsepi32_epi8(q1));
                _mm_storeu_si128((__m128i *)(dst2 + 32 * h), _mm512_cvtsepi32_epi8(q2));
            }
            dx[r * kb + b] = d / 256.f;
            sx[r * kb + b] = (d / 256.f) * (float)_mm512_reduce_add_epi32(total);
        }
    }
}

#define MR 4 /* rows per tile */
#define NC 4 /* columns per tile: MR x NC accumulators of 16 floats */

static inline __m512 pair_scale(const float *two) { /* [s0 x4, s1 x4, s0 x4, s1 x4] */
    const __m512i idx = _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0);
    return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)two))));
}

static inline __m512 quad_scale(const float *four) { /* [s0 x4, s1 x4, s2 x4, s3 x4] */
    const __m512i idx = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_loadu_ps(four)));
}

/* sum_b a[b] * c[b] over kb floats */
static inline float dot_blocks(const float *a, const float *c, int64_t kb) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t b = 0; b < kb; b += 16) {
        const __mmask16 mk = kb - b >= 16 ? 0xFFFF : (__mmask16)((1u << (kb - b)) - 1);
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mk, a + b), _mm512_maskz_loadu_ps(mk, c + b), acc);
    }
    return _mm512_reduce_add_ps(acc);
}

/* rows [r0, r0 + mr) x columns [n0, n0 + nc); form 4 or 8 */
static inline __attribute__((always_inline)) void tile(int form, const int8_t *qx, const int8_t *qx2,
                                                       const float *dx, const float *sx,
                                                       int64_t r0, int mr, int64_t kb, const void *w,
                                                       const float *d, const float *mn, const float *bias,
                                                       float *out, int64_t ldc, int64_t n0, int nc) {
    const int64_t kp = kb * 32;
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 acc[MR][NC];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NC; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t p = 0; p < kb / 2; p++) {
        __m512i wq[NC];
        __m512 ws[NC];
        for (int j = 0; j < nc; j++) {
            const int64_t n = n0 + j;
            if (form == 4) {
                __m256i packed = _mm256_loadu_si256((const __m256i *)((const uint8_t *)w + n * kb * 16 + p * 32));
                wq[j] = _mm512_and_si512(
                    _mm512_inserti64x4(_mm512_castsi256_si512(packed), _mm256_srli_epi16(packed, 4), 1), low);
                ws[j] = pair_scale(d + n * kb + 2 * p);
            } else {
                wq[j] = _mm512_loadu_si512((const void *)((const int8_t *)w + n * kp + p * 64));
                ws[j] = quad_scale(d + n * kb * 2 + 4 * p);
            }
        }
        for (int i = 0; i < mr; i++) {
            const int64_t r = r0 + i;
            __m512i xq = _mm512_loadu_si512((const void *)(qx + r * kp + p * 64));
            __m512i xq2 = _mm512_loadu_si512((const void *)(qx2 + r * kp + p * 64));
            __m512 xs = pair_scale(dx + r * kb + 2 * p);
            __m512i ax = _mm512_abs_epi8(xq), ax2 = _mm512_abs_epi8(xq2);
            const __mmask64 neg = _mm512_movepi8_mask(xq), neg2 = _mm512_movepi8_mask(xq2);
            for (int j = 0; j < nc; j++) {
                /* 256 * (q1 . w) + (q2 . w) in int32 lanes (|.| < 2^25) */
                __m512i p32;
                if (form == 4) {
                    p32 = _mm512_slli_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), wq[j], xq), 8);
                    p32 = _mm512_dpbusd_epi32(p32, wq[j], xq2);
                } else { /* |x| (unsigned) times w with x's sign: vpdpbusd multiplies unsigned by signed */
                    __m512i sw = _mm512_mask_sub_epi8(wq[j], neg, _mm512_setzero_si512(), wq[j]);
                    __m512i sw2 = _mm512_mask_sub_epi8(wq[j], neg2, _mm512_setzero_si512(), wq[j]);
                    p32 = _mm512_slli_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), ax, sw), 8);
                    p32 = _mm512_dpbusd_epi32(p32, ax2, sw2);
                }
                acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p32), _mm512_mul_ps(ws[j], xs), acc[i][j]);
            }
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nc; j++) {
            const int64_t r = r0 + i, n = n0 + j;
            float v = _mm512_reduce_add_ps(acc[i][j]);
            if (mn) v += dot_blocks(mn + n * kb, sx + r * kb, kb);
            out[r * ldc + n] = v + (bias ? bias[n] : 0.f);
        }
}

#define TILE_ROWS(form, nc)                                                                               \
    switch (mr) {                                                                                         \
    case 4: tile(form, qx, qx2, dx, sx, r0, 4, kb, w, d, mn, bias, out, ldc, c, nc); break;                   \
    case 3: tile(form, qx, qx2, dx, sx, r0, 3, kb, w, d, mn, bias, out, ldc, c, nc); break;                   \
    case 2: tile(form, qx, qx2, dx, sx, r0, 2, kb, w, d, mn, bias, out, ldc, c, nc); break;                   \
    default: tile(form, qx, qx2, dx, sx, r0, 1, kb, w, d, mn, bias, out, ldc, c, nc);                         \
    }

static void run_slice(int form, const int8_t *qx, const int8_t *qx2, const float *dx, const float *sx, int64_t m, int64_t kb,
                      const void *w, const float *d, const float *mn, const float *bias, float *out, int64_t ldc,
                      int64_t c0, int64_t c1) {
    for (int64_t r0 = 0; r0 < m; r0 += MR) {
        const int mr = m - r0 < MR ? (int)(m - r0) : MR;
        int64_t c = c0;
        for (; c + NC <= c1; c += NC) {
            if (form == 4) { TILE_ROWS(4, NC) } else { TILE_ROWS(8, NC) }
        }
        for (; c < c1; c++) {
            if (form == 4) { TILE_ROWS(4, 1) } else { TILE_ROWS(8, 1) }
        }
    }
}

/* Every row, output columns split in `threads` contiguous chunks. form 4 or 8; k the
 * weight's columns (qx, dx, sx as mstar_quantize_rows leaves them; w, d, mn in the pair
 * layout with k padded to a multiple of 64). Returns 0, or -1 for a form it does not take. */
int mstar_qgemm(int form, const int8_t *qx, const int8_t *qx2, const float *dx, const float *sx, int64_t m,
                int64_t k, const void *w, const float *d, const float *mn, int64_t n, const float *bias,
                float *out, int64_t ldc, int threads) {
    if ((form != 4 && form != 8) || (form == 4 && !mn)) return -1;
    const int64_t kb = (k + 63) / 64 * 2;
    if (threads < 1) threads = 1;
    const int64_t chunk = ((n + threads - 1) / threads + NC - 1) / NC * NC;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int t = 0; t < threads; t++) {
        const int64_t n0 = t * chunk, n1 = n0 + chunk < n ? n0 + chunk : n;
        /* columns in slices that stay in L2 while every row group reads them */
        for (int64_t c0 = n0; c0 < n1; c0 += 64)
            run_slice(form, qx, qx2, dx, sx, m, kb, w, d, mn, bias, out, ldc, c0, c0 + 64 < n1 ? c0 + 64 : n1);
    }
    return 0;
}

/* x [m, lda] floats -> out: mstar_quantize_rows into `scratch` (at least
 * mstar_qlinear_scratch(m, k) bytes) then mstar_qgemm: one call per linear layer. */
int64_t mstar_qlinear_scratch(int64_t m, int64_t k) {
    const int64_t kp = (k + 63) / 64 * 64;
    return 2 * m * kp + 2 * m * (kp / 32) * (int64_t)sizeof(float) + 64;
}

int mstar_qlinear(int form, const float *x, int64_t m, int64_t k, int64_t lda, const void *w, const float *d,
                  const float *mn, int64_t n, const float *bias, float *out, int64_t ldc, int threads,
                  void *scratch) {
    const int64_t kp = (k + 63) / 64 * 64, kb = kp / 32;
    int8_t *qx = (int8_t *)scratch, *qx2 = qx + m * kp;
    float *dx = (float *)(qx2 + m * kp), *sx = dx + m * kb; /* 2 m kp is a multiple of 64: aligned */
    mstar_quantize_rows(x, m, k, lda, qx, qx2, dx, sx);
    return mstar_qgemm(form, qx, qx2, dx, sx, m, k, w, d, mn, n, bias, out, ldc, threads);
}

#else
int64_t mstar_qlinear_scratch(int64_t m, int64_t k) {
    (void)m; (void)k;
    return 0;
}
int mstar_qlinear(int form, const float *x, int64_t m, int64_t k, int64_t lda, const void *w, const float *d,
                  const float *mn, int64_t n, const float *bias, float *out, int64_t ldc, int threads,
                  void *scratch) {
    (void)form; (void)x; (void)m; (void)k; (void)lda; (void)w; (void)d; (void)mn; (void)n; (void)bias;
    (void)out; (void)ldc; (void)threads; (void)scratch;
    return -1;
}
void mstar_quantize_rows(const float *x, int64_t m, int64_t k, int64_t lda, int8_t *qx, int8_t *qx2, float *dx,
                         float *sx) {
    (void)x; (void)m; (void)k; (void)lda; (void)qx; (void)qx2; (void)dx; (void)sx;
}
int mstar_qgemm(int form, const int8_t *qx, const int8_t *qx2, const float *dx, const float *sx, int64_t m,
                int64_t k, const void *w, const float *d, const float *mn, int64_t n, const float *bias,
                float *out, int64_t ldc, int threads) {
    (void)form; (void)qx; (void)qx2; (void)dx; (void)sx; (void)m; (void)k; (void)w; (void)d; (void)mn; (void)n;
    (void)bias; (void)out; (void)ldc; (void)threads;
    return -1;
}
#endif
