/* One vector width for the float kernels' intrinsics paths (included, not compiled on its
 * own): 16 lanes (zmm) where the build has AVX-512, else 8 (ymm) with AVX2 + FMA, else
 * MSTAR_VL is 0 and the kernels keep their plain loops. paged_attention.c, prefill_attention.c
 * and gemm.c write their vector code once over `vf` and these helpers; what differs between
 * the widths (a 16- or 8-row horizontal fold, how a mask is made) is here, and the register
 * blocking (how many vectors a tile holds: 32 zmm or 16 ymm registers) is each kernel's.
 *
 * Each helper is the one instruction (or fixed sequence) of its name at either width, so a
 * kernel's arithmetic is the same operations in the same order at both widths wherever its
 * blocking does not change the order; where it does (a dot product's partial sums, 16 or 8
 * lanes), each class's result is still fixed by the shapes alone, never by the batch or the
 * thread count.
 */
#ifndef MSTAR_SIMD_H
#define MSTAR_SIMD_H
#include <stdint.h>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define MSTAR_VL 16
typedef __m512 vf;
typedef __m512i vi;
static inline __attribute__((always_inline)) vf vload(const float *p) { return _mm512_loadu_ps(p); }
static inline __attribute__((always_inline)) vf vload_a(const float *p) { return _mm512_load_ps(p); }
static inline __attribute__((always_inline)) void vstore(float *p, vf x) { _mm512_storeu_ps(p, x); }
static inline __attribute__((always_inline)) void vstore_a(float *p, vf x) { _mm512_store_ps(p, x); }
static inline __attribute__((always_inline)) vf vset1(float x) { return _mm512_set1_ps(x); }
static inline __attribute__((always_inline)) vf vzero(void) { return _mm512_setzero_ps(); }
static inline __attribute__((always_inline)) vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline __attribute__((always_inline)) vf vfnma(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }
static inline __attribute__((always_inline)) vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline __attribute__((always_inline)) vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline __attribute__((always_inline)) vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline __attribute__((always_inline)) vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
static inline __attribute__((always_inline)) vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline __attribute__((always_inline)) vf vmin(vf a, vf b) { return _mm512_min_ps(a, b); }
static inline __attribute__((always_inline)) vi viload(const int32_t *p) { return _mm512_loadu_si512(p); }
/* lanes [0, n) of x to p, the others not written (n in [0, 16]) */
static inline __attribute__((always_inline)) void vstore_n(float *p, vf x, int64_t n) {
    _mm512_mask_storeu_ps(p, (__mmask16)(n >= 16 ? 0xFFFF : (1u << (n < 0 ? 0 : n)) - 1), x);
}
/* b in lanes [0, n), a in the others */
static inline __attribute__((always_inline)) vf vblend_n(vf a, vf b, int64_t n) {
    return _mm512_mask_mov_ps(a, (__mmask16)(n >= 16 ? 0xFFFF : (1u << n) - 1), b);
}
/* x where lo <= key <= hi (per lane, int32), else fill */
static inline __attribute__((always_inline)) vf vin_range(vf x, vi lo, vi hi, int32_t key, vf fill) {
    const vi k = _mm512_set1_epi32(key);
    return _mm512_mask_blend_ps(_mm512_cmple_epi32_mask(lo, k) & _mm512_cmple_epi32_mask(k, hi), fill, x);
}
/* x where test is not -inf, else 0 */
static inline __attribute__((always_inline)) vf vunless_ninf(vf test, vf x) {
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(test, _mm512_set1_ps(-__builtin_inff()), _CMP_NEQ_OQ), x);
}
/* y * 2^n for n integral in [-126, 127] (exact scaling, as a multiply by 2^n) */
static inline __attribute__((always_inline)) vf vscale2(vf y, vf n) { return _mm512_scalef_ps(y, n); }
static inline __attribute__((always_inline)) vf vround(vf x) {
    return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
/* 16 bfloat16 / int8 values at p widened to float32 (int8: exact integers, not yet scaled) */
static inline __attribute__((always_inline)) vf vload_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline __attribute__((always_inline)) vf vload_i8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

/* The 16 rows a[0..15] (16 lanes each, 64-byte aligned) summed across their lanes, row j
 * into lane j, by a tree that stays inside the 128-bit lanes as long as it can (cross-lane
 * shuffles cost the most): rows paired by unpacklo/hi + add (each 128-bit lane then holds
 * two partial sums of each of the two rows), pairs paired again (one partial of each of four
 * rows per 128-bit lane), then the 128-bit lanes added across in two steps: 24 in-lane and 6
 * cross-lane shuffles and 15 adds for the 16 sums (a transpose then in-order adds took 32 and
 * 32 and 16). Each sum's order is fixed, so a sum is the same bits whatever the thread,
 * batch or partition. */
static inline vf vfold(const float *a) {
    __m512 t[8], v[4];
    for (int i = 0; i < 8; i++) { /* rows 2i, 2i + 1: per 128-bit lane [x0+x2, y0+y2, x1+x3, y1+y3] */
        const __m512 x = _mm512_load_ps(a + 32 * i), y = _mm512_load_ps(a + 32 * i + 16);
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y));
    }
    for (int i = 0; i < 4; i++) { /* rows 4i .. 4i + 3, one partial each per 128-bit lane */
        const __m512d x = _mm512_castps_pd(t[2 * i]), y = _mm512_castps_pd(t[2 * i + 1]);
        v[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    /* lanes 0, 1 of w0: rows 0-3 (two partials), lanes 2, 3: rows 4-7; w1 the same for rows 8-15 */
    const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(v[0], v[1], 0x44), _mm512_shuffle_f32x4(v[0], v[1], 0xEE));
    const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(v[2], v[3], 0x44), _mm512_shuffle_f32x4(v[2], v[3], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, 0x88), _mm512_shuffle_f32x4(w0, w1, 0xDD));
}

#elif defined(__AVX2__) && defined(__FMA__)
#define MSTAR_VL 8
typedef __m256 vf;
typedef __m256i vi;
static inline __attribute__((always_inline)) vf vload(const float *p) { return _mm256_loadu_ps(p); }
static inline __attribute__((always_inline)) vf vload_a(const float *p) { return _mm256_load_ps(p); }
static inline __attribute__((always_inline)) void vstore(float *p, vf x) { _mm256_storeu_ps(p, x); }
static inline __attribute__((always_inline)) void vstore_a(float *p, vf x) { _mm256_store_ps(p, x); }
static inline __attribute__((always_inline)) vf vset1(float x) { return _mm256_set1_ps(x); }
static inline __attribute__((always_inline)) vf vzero(void) { return _mm256_setzero_ps(); }
static inline __attribute__((always_inline)) vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline __attribute__((always_inline)) vf vfnma(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
static inline __attribute__((always_inline)) vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline __attribute__((always_inline)) vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline __attribute__((always_inline)) vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline __attribute__((always_inline)) vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
static inline __attribute__((always_inline)) vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline __attribute__((always_inline)) vf vmin(vf a, vf b) { return _mm256_min_ps(a, b); }
static inline __attribute__((always_inline)) vi viload(const int32_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
/* all ones in lanes [0, n) */
static inline __attribute__((always_inline)) vi vfirst_n(int64_t n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int32_t)n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
static inline __attribute__((always_inline)) void vstore_n(float *p, vf x, int64_t n) {
    _mm256_maskstore_ps(p, vfirst_n(n), x);
}
static inline __attribute__((always_inline)) vf vblend_n(vf a, vf b, int64_t n) {
    return _mm256_blendv_ps(a, b, _mm256_castsi256_ps(vfirst_n(n)));
}
static inline __attribute__((always_inline)) vf vin_range(vf x, vi lo, vi hi, int32_t key, vf fill) {
    const vi k = _mm256_set1_epi32(key);
    const vi out = _mm256_or_si256(_mm256_cmpgt_epi32(lo, k), _mm256_cmpgt_epi32(k, hi));
    return _mm256_blendv_ps(x, fill, _mm256_castsi256_ps(out));
}
static inline __attribute__((always_inline)) vf vunless_ninf(vf test, vf x) {
    return _mm256_and_ps(_mm256_cmp_ps(test, _mm256_set1_ps(-__builtin_inff()), _CMP_NEQ_OQ), x);
}
/* y * 2^n through the exponent bits (n integral in [-126, 127]: 2^n is a normal float, and
 * the multiply rounds as scalef does) */
static inline __attribute__((always_inline)) vf vscale2(vf y, vf n) {
    const vi e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
static inline __attribute__((always_inline)) vf vround(vf x) {
    return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
static inline __attribute__((always_inline)) vf vload_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline __attribute__((always_inline)) vf vload_i8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* The 8 rows a[0..7] (8 lanes each, 32-byte aligned) summed across their lanes, row j into
 * lane j: the AVX-512 fold's tree at 8 lanes (rows paired by unpacklo/hi + add, pairs paired
 * again, then the two 128-bit halves added across once): 12 in-lane and 2 cross-lane
 * shuffles and 7 adds. A fixed order, so a sum is the same bits whatever the thread, batch or
 * partition. */
static inline vf vfold(const float *a) {
    __m256 t[4], v[2];
    for (int i = 0; i < 4; i++) { /* rows 2i, 2i + 1: per 128-bit lane [x0+x2, y0+y2, x1+x3, y1+y3] */
        const __m256 x = _mm256_load_ps(a + 16 * i), y = _mm256_load_ps(a + 16 * i + 8);
        t[i] = _mm256_add_ps(_mm256_unpacklo_ps(x, y), _mm256_unpackhi_ps(x, y));
    }
    for (int i = 0; i < 2; i++) { /* rows 4i .. 4i + 3, one partial each per 128-bit lane */
        const __m256d x = _mm256_castps_pd(t[2 * i]), y = _mm256_castps_pd(t[2 * i + 1]);
        v[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)), _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
    }
    return _mm256_add_ps(_mm256_permute2f128_ps(v[0], v[1], 0x20), _mm256_permute2f128_ps(v[0], v[1], 0x31));
}
#else
#define MSTAR_VL 0
#endif

#if MSTAR_VL
/* exp(x) per lane: Cephes' expf as exp_poly.h (x = n ln2 + r, a degree-6 polynomial in r,
 * 2^n applied exactly); within 2 ulp of libm's for x in [-87, 88]. */
static inline __attribute__((always_inline)) vf vexp(vf x) {
    x = vmax(x, vset1(-87.0f));
    x = vmin(x, vset1(88.0f));
    const vf n = vround(vmul(x, vset1(1.44269504088896341f)));
    vf r = vfnma(n, vset1(0.693359375f), x);
    r = vfma(n, vset1(2.12194440e-4f), r);
    vf p = vset1(1.9875691500e-4f);
    p = vfma(p, r, vset1(1.3981999507e-3f));
    p = vfma(p, r, vset1(8.3334519073e-3f));
    p = vfma(p, r, vset1(4.1665795894e-2f));
    p = vfma(p, r, vset1(1.6666665459e-1f));
    p = vfma(p, r, vset1(5.0000001201e-1f));
    const vf y = vadd(vfma(p, vmul(r, r), r), vset1(1.0f));
    return vscale2(y, n);
}
#endif

#endif
