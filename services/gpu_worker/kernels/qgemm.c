/* GEMM on GGUF-quantized weights, computed on as they come (llama.cpp's method):
 * out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), where w is never expanded to floats.
 *
 * Weights are repacked at load (services/gpu_worker/layers/quant.py) into one of six forms,
 * all in blocks of 32 along k (the GGUF scales are float16 and small integers, so each
 * product below is the one gguf's dequantization computes):
 *   Q4 form (4): w = d[b] * q + m[b], q in 0..15 (Q4_0: m = -8 d; Q4_1: d, m; Q4_K: d * scale,
 *            -dmin * min per 32-group)
 *   Q5 form (5): the same with q in 0..31 (Q5_0: m = -16 d; Q5_1: d, m; Q5_K as Q4_K): the
 *            Q4 form's nibbles and a plane of the fifth bits, 5 bits a weight as in GGUF
 *   Q6 form (6): w = d16[h] * (q - 32), q in 0..63, one scale per 16 (Q6_K): the nibbles and
 *            two planes of high bits, 6 bits a weight as in GGUF
 *   Q8 form (8): w = d16[h] * q + m[b], q a signed byte stored as q + 128, one scale per 16,
 *            m per 32 or none: a Q5, Q6 or Q8S layer concatenated with another form's
 *            (fused q/k/v of mixed types) is expanded to it
 *   Q8S form (9): the Q8 form with one scale per 32 (Q8_0's own), no m
 *   NL form (16, a 16-value table): w = d[b] * kvalues_iq4nl[q], q in 0..15 (IQ4_NL: d;
 *            IQ4_XS: d * (scale - 32) per 32-group), m per 32 or none (none from GGUF).
 *            Stored as the Q4 form's nibbles (4 bits a weight); in the kernel each nibble
 *            becomes kvalues + 128 (1..241, an unsigned byte) by one vpshufb, and the + 128
 *            is taken back as the Q8 form's is.
 *   MX form (17): the NL form on MXFP4's table, kvalues_mxfp4 (E2M1's values doubled: 0, 1,
 *            2, 3, 4, 6, 8, 12 and their negatives) with d the block's E8M0 scale halved
 *            (gguf's e8m0_to_fp32_half: a power of two, a float16 where it is in range)
 *
 * Layout: output columns in tiles of 16 (n padded), one column per 32-bit lane: vpdpbusd
 * multiplies 4 consecutive bytes of each lane by 4 bytes of x broadcast to every lane, so
 * a block of 32 values of 16 columns is 8 (Q4: 4 bytes holding two nibbles each) 64-byte
 * vectors, x is never shuffled, and each block's scales are one 16-float load per tile:
 *   Q4 form: w [n/16][kb][4][16 columns][4]: byte = q[k] | q[k + 16] << 4, k = 4 g + i
 *   Q5 form: w [n/16][kb][5][16][4]: the Q4 form's 4 groups of q's low nibbles, then 8
 *            64-bit words, word G's bit 4 j + i the fifth bit of value 4 G + i of column j
 *            (a byte mask: one masked vpaddb of 16 per 64 weights)
 *   Q6 form: w [n/16][kb][6][16][4]: the Q5 form's, then the sixth bits' 8 words alike; its
 *            - 32 is taken back in int32 as the Q8 form's + 128 is (corr / 4)
 *   Q8 and Q8S forms: w [n/16][kb][8][16][4]: byte = q[4 g + i] + 128
 *   NL form: w as the Q4 form's (q the table index); the MX form (17) the same on MXFP4's table
 *   d: Q4, Q5, Q8S and NL [n/16][kb][16], Q6 and Q8 [n/16][kb][2][16]; m [n/16][kb][16] or none
 * d and m are float32, or float16 where the form code has HALF_SCALES (256) set: the repack
 * stores them so when every value is a float16 exactly (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and
 * IQ4_NL's scales are GGUF's own float16s). Widened exactly in the kernel (vcvtph2ps), they
 * give the same bits as float32 scales. The k-quants' and IQ4_XS's scales are products, d (a
 * float16 per 256 values) times a 6-bit integer per group: with SUPER_SCALES (512) set, d and
 * m are kept so (super_blob below) and multiplied in the kernel, the float32 product gguf
 * makes, so again the same bits. Bytes a weight in memory, what a decode step reads: Q4_0 /
 * Q4_1 0.625 (GGUF's size), Q4_K 0.578, IQ4_XS 0.539, Q5_0 / Q5_1 0.75, Q5_K 0.703, Q8_0
 * 1.0625 (GGUF's), Q6_K 0.820 (GGUF's).
 *
 * x is rounded per row and block of 32 to two signed bytes, x ~ d * (q1 + q2 / 256) with
 * d = amax / 127 (llama.cpp's Q8_0 is q1 alone; the second byte, the remainder in 1/256ths,
 * makes it ~15 bits: SmolLM2's greedy answers otherwise drift from the float32 path's), and
 * each block's sum of that rounded x is kept for the m term (as llama.cpp's Q8_1). So the
 * result is the float32 GEMM of x so rounded and the dequantized weight (up to the order of
 * float additions): x's rounding is the only approximation. The Q8 and NL forms' +128 is
 * taken back exactly in int32: 128 * (256 sum(q1) + sum(q2)) per half block.
 *
 * `xbytes` 1 rounds x to q1 alone, x ~ d * q1 (as llama.cpp's Q8_1 rounds its prompt and
 * decode rows alike): half the vpdpbusd work, which bounds the kernel from a few rows up, so
 * a long prompt's GEMMs take ~2/3 of the time (2,048 rows of SmolLM2-135M on two Zen 4
 * threads: ~1.4 -> ~0.95 s). The caller uses it for prompt rows only, and only when asked
 * (`--prefill-dtype int8`, layers/quant.py): it changes small models' greedy answers.
 *
 * Output column tiles and row blocks are split over the threads of pool.c's pool (tasks taken
 * from a shared counter: a busy core's thread just takes fewer); each output is computed the
 * same way whichever thread runs it, so results do not depend on the thread count or split.
 * Needs AVX-512 VNNI, or AVX2 with FMA and F16C (its own code, below: the same layout and the
 * same bits, vpmaddubsw in place of vpdpbusd); mstar_qgemm_available() is 0 elsewhere and the
 * caller dequantizes.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pool.h"

/* the instruction sets this file has code for (the build's class, cpu_kernels.py) */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__)
#define QGEMM_AVX512 1
#define QGEMM_AVX2 0
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QGEMM_AVX512 0
#define QGEMM_AVX2 1
#else
#define QGEMM_AVX512 0
#define QGEMM_AVX2 0
#endif
#define QGEMM_SIMD (QGEMM_AVX512 || QGEMM_AVX2)

#define FORM_NL 16 /* the 4-bit table form (the others are named by their bits, 4, 5 and 8) */
#define FORM_MX 17 /* the 4-bit table form on MXFP4's table (the NL form's layout and code, another table) */
/* the two forms whose nibbles index a 16-value table */
#define TABLE_FORM(form) ((form) == FORM_NL || (form) == FORM_MX)
#define FORM_Q8S 9 /* the byte form with one scale per 32 (Q8_0's) */
#define HALF_SCALES 256 /* a form code's flag: d and m stored as float16 */
#define SUPER_SCALES 512 /* a form code's flag: d and m as the k-quants keep them (below) */

/* a float16 (IEEE binary16) widened to float32, exactly; for mstar_qrows, on any CPU */
static float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1F, man = h & 0x3FF;
    uint32_t bits;
    if (e == 31) {
        bits = sign | 0x7F800000u | man << 13;
    } else if (e) {
        bits = sign | (e + 112) << 23 | man << 13;
    } else { /* zero or subnormal: man * 2^-24, exact in float32 */
        const float f = (float)man * 5.9604644775390625e-8f;
        memcpy(&bits, &f, sizeof bits);
        bits |= sign;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* scale i of d or m, float16 (half) or float32 */
static inline float scale_at(const void *p, int64_t i, int half) {
    return half ? half_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* Super-block scales (SUPER_SCALES, `half` 2 below): per tile and super-block of 8 blocks, a
 * blob of the 16 columns' float16 d, then per group (8 of 32 values, or 16 of 16: the Q8
 * form's) the 16 columns' int8 factors; a scale is d * factor in float32, the product gguf's
 * dequantization makes (exact: 11 by 7 bits). */
static inline const uint8_t *super_blob(const void *p, int64_t t, int64_t b, int64_t kb, int per16) {
    return (const uint8_t *)p + (t * (kb / 8) + b / 8) * (32 + 16 * (per16 ? 16 : 8));
}

static inline int super_group(int64_t b, int h, int per16) { return per16 ? (int)(b % 8) * 2 + h : (int)(b % 8); }

/* 64-byte vectors a block of 32 values of a tile's 16 columns takes in w: the nibbles' 4,
 * then forms 5 and 6's bit planes; the byte forms' 8 */
static inline int block_vectors(int form) {
    return form == 8 || form == FORM_Q8S ? 8 : form == 5 || form == 6 ? form : 4;
}

/* where block b's scales (half h of it where per16) of tile t start in plain d or m */
static inline int64_t scale_index(int64_t t, int64_t b, int h, int64_t kb, int per16) {
    return (per16 ? (t * kb + b) * 2 + h : t * kb + b) * 16;
}

/* column j's scale of block b (half h of it where per16) in d or m, any storage */
static float scale_of(const void *p, int64_t t, int64_t b, int h, int64_t j, int64_t kb, int half, int per16) {
    if (half == 2) {
        const uint8_t *blob = super_blob(p, t, b, kb, per16);
        uint16_t base;
        memcpy(&base, blob + 2 * j, sizeof base);
        return half_to_float(base) * (float)(int8_t)blob[32 + 16 * super_group(b, h, per16) + j];
    }
    return scale_at(p, scale_index(t, b, h, kb, per16) + j, half);
}

int64_t mstar_qgemm_available(void) { return QGEMM_SIMD; }

/* bytes of scratch mstar_qlinear needs for m rows of k */
int64_t mstar_qlinear_scratch(int64_t m, int64_t k) {
    const int64_t kp = (k + 31) / 32 * 32, kb = kp / 32;
    return 2 * m * kp + 2 * m * kb * 4 + 2 * m * kb * 4 + 64;
}

/* IQ4_NL's values (ggml-common.h kvalues_iq4nl) as floats, for mstar_qrows */
static const float kvalues_nl[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
/* MXFP4's E2M1 values doubled (ggml-common.h kvalues_mxfp4; the block's scale is halved to match) */
static const float kvalues_mx[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* Rows `ids` of a weight in the tiled layout above, in float32 (an embedding lookup: a tied
 * model's table is its LM head's weight), each value as gguf dequantizes it and as
 * layers/quant.py's torch expression computes it, bit for bit: d * q then + m, two roundings
 * (fp-contract off: a fused multiply-add would round once). out [n_ids, ldo], the first k
 * columns written. Returns 0, -1 for a form it does not take, -2 for an id outside [0, n) (nothing
 * written). On any CPU: the decode step's one row cost ~10 torch ops (~0.1 ms) through the
 * tensor expression. */
__attribute__((optimize("fp-contract=off"))) int mstar_qrows(int form, const uint8_t *w, const void *d,
                                                              const void *mn, int64_t n, int64_t k,
                                                              const int64_t *ids, int64_t n_ids, float *out,
                                                              int64_t ldo) {
    const int half = form & HALF_SCALES ? 1 : form & SUPER_SCALES ? 2 : 0;
    form &= ~(HALF_SCALES | SUPER_SCALES);
    if (form != 4 && form != 5 && form != 6 && form != 8 && form != FORM_Q8S && !TABLE_FORM(form)) return -1;
    if (half == 2 && ((k + 31) / 32) % 8) return -1;
    for (int64_t r = 0; r < n_ids; r++)
        if (ids[r] < 0 || ids[r] >= n) return -2;
    const int64_t kb = (k + 31) / 32, groups = block_vectors(form);
    float v[32];
    for (int64_t r = 0; r < n_ids; r++) {
        const int64_t t = ids[r] / 16, j = ids[r] % 16;
        for (int64_t b = 0; b < kb; b++) {
            const uint8_t *src = w + (t * kb + b) * groups * 64 + j * 4;
            const float s = mn ? scale_of(mn, t, b, 0, j, kb, half, 0) : 0.f;
            const float m = half == 2 ? -s : s; /* super-block offsets are -(dmin * factor) */
            if (form == 8 || form == FORM_Q8S) {
                for (int g = 0; g < 8; g++)
                    for (int i = 0; i < 4; i++) {
                        const float q = (float)((int)src[g * 64 + i] - 128);
                        v[4 * g + i] = scale_of(d, t, b, g / 4, j, kb, half, form == 8) * q;
                    }
            } else { /* nibbles (NL: table indices); forms 5 and 6: the high bits from the planes after
                      * them, value 4 g + i's bit p at bit 4 j + i of word g of plane p - 4 */
                const uint8_t *planes = w + (t * kb + b) * groups * 64 + 256;
                const float dd = form == 6 ? 0.f : scale_of(d, t, b, 0, j, kb, half, 0); /* (6: per 16, below) */
                for (int g = 0; g < 8; g++)
                    for (int i = 0; i < 4; i++) {
                        const uint8_t byte = src[(g % 4) * 64 + i];
                        const int bit = 4 * (int)j + i;
                        int q = g < 4 ? byte & 15 : byte >> 4;
                        for (int p = 4; p < groups; p++)
                            q |= ((planes[64 * (p - 4) + 8 * g + bit / 8] >> (bit % 8)) & 1) << p;
                        v[4 * g + i] = form == FORM_NL ? dd * kvalues_nl[q]
                                       : form == FORM_MX ? dd * kvalues_mx[q]
                                       : form == 6    ? scale_of(d, t, b, g / 4, j, kb, half, 1) * (float)(q - 32)
                                                      : dd * (float)q;
                    }
            }
            if (mn)
                for (int e = 0; e < 32; e++) v[e] = v[e] + m;
            const int64_t cols = k - 32 * b < 32 ? k - 32 * b : 32;
            memcpy(out + r * ldo + 32 * b, v, sizeof(float) * cols);
        }
    }
    return 0;
}

#if QGEMM_SIMD
#include <immintrin.h>


#define NT 16 /* output columns per tile: one 32-bit lane each */
#define MR 4  /* rows per tile */
/* How far ahead in the weights a decode GEMV prefetches (bytes; the nibble forms). With only
 * the hardware's prefetcher a Q4_K or Q6_K GEMV on one row read ~21-27 GB/s on two Zen 4 cores
 * where the Q8_0 one reads ~44: a nibble form has more work per byte, so fewer loads are in
 * flight. Prefetching 3 KB ahead, non-temporal (the weights are read once a step: they need
 * not push the step's other data out of L3), took a GEMV to 25-33 GB/s and a Q4_K_M decode
 * step from 6.58 to 6.17 ms; the scales' streams prefetched as well, 3-7% off a decode step
 * more (SmolLM2's Q4_1, the Q4_K_M file). The byte forms ran 10% slower with it: their layer
 * GEMVs go without. An LM head is another matter (HEAD_TILES output tiles or more: Gemma 3
 * 270M's tied Q8_0 head, 262,144 x 640, 178 MB, ~72% of a decode step's bytes): prefetching it
 * PREFETCH_AHEAD_BYTES ahead took the c1 step (the C stack's one call) 7-15% down at min, p25
 * and median over 120-150 alternated steps in one process (2 Zen 4 cores, load average 8-10;
 * 3 KB ahead gave about half of that, 12 KB the same as 6). mstar_qgemm_set_head_prefetch(0)
 * turns it off (to compare: bench/head_prefetch.py). */
#define PREFETCH_AHEAD 3072
#define PREFETCH_AHEAD_BYTES 6144
#define HEAD_TILES 4096 /* 65,536 output columns: no layer GEMV is this wide */

/* One GEMM split into tasks for the pool (pool.h): a grid of column chunks (ct tiles) x row
 * blocks (rb rows, a multiple of MR), task = chunk * nrb + block. Whichever thread runs a task,
 * each output element is made by the same tile() call on the same rows (row groups of MR
 * start at multiples of MR either way), so the result does not depend on the split. */
struct qjob {
    int form, xbytes, half; /* form without its flags; half: scales float32 (0), float16 (1), super-block (2) */
    const float *x;
    int8_t *q1s, *q2s;
    float *dx, *sx;
    int32_t *corr;
    int64_t m, k, lda, kp, n, ldc, tiles;
    const uint8_t *w;
    const void *d, *mn;
    const float *bias;
    float *out;
    int64_t ct, rb, nrb, qrows;
    int pf;
};

/* A decode GEMV's prefetches at block b of tile t: the weights PREFETCH_AHEAD bytes on, and
 * the scales (and offsets) of the block as far on, each their own stream (the next tiles' where
 * it runs past this one's); non-temporal, as the weights are read once a step. */
static inline __attribute__((always_inline)) void prefetch_ahead(const int form, const int half, const uint8_t *w,
                                                                 const void *d, const void *mn, int64_t t, int64_t b,
                                                                 int64_t kb) {
    const int groups = block_vectors(form), per16 = form == 6;
    const int64_t dist = groups == 8 ? PREFETCH_AHEAD_BYTES : PREFETCH_AHEAD;
    const char *ahead = (const char *)(w + (t * kb + b) * groups * 64) + dist;
    for (int c = 0; c < groups * 64; c += 64) _mm_prefetch(ahead + c, _MM_HINT_NTA);
    int64_t ta = t, ba = b + dist / (groups * 64); /* (constants: no division; one costs a block's work) */
    while (ba >= kb) ba -= kb, ta++;
    if (half == 2) { /* a blob per 8 blocks: at the first block of a super-block, the whole blob */
        if (b % 8) return;
        const int64_t size = 32 + 16 * (per16 ? 16 : 8);
        for (const void *p = d; p; p = p == d ? mn : NULL) {
            const char *blob = (const char *)super_blob(p, ta, ba, kb, per16);
            for (int64_t c = 0; c < size; c += 64) _mm_prefetch(blob + c, _MM_HINT_NTA);
            _mm_prefetch(blob + size - 1, _MM_HINT_NTA);
        }
        return;
    }
    const int64_t elt = half ? 2 : 4; /* the block's first line of scales (of offsets) */
    _mm_prefetch((const char *)d + elt * scale_index(ta, ba, 0, kb, per16), _MM_HINT_NTA);
    if (mn) _mm_prefetch((const char *)mn + elt * scale_index(ta, ba, 0, kb, 0), _MM_HINT_NTA);
}

#endif

#if QGEMM_AVX512
/* IQ4_NL's kvalues (ggml-common.h kvalues_iq4nl, gguf.quants.IQ4_NL.kvalues) + 128, in each
 * 16-byte lane for vpshufb */
static inline __m512i nl_table(void) {
    return _mm512_broadcast_i32x4(_mm_setr_epi8((char)1, (char)24, (char)45, (char)63, (char)79, (char)93,
                                                (char)106, (char)118, (char)129, (char)141, (char)153, (char)166,
                                                (char)181, (char)197, (char)217, (char)241));
}

/* MXFP4's kvalues (ggml-common.h kvalues_mxfp4, E2M1 doubled) + 128, as nl_table's */
static inline __m512i mx_table(void) {
    return _mm512_broadcast_i32x4(_mm_setr_epi8((char)128, (char)129, (char)130, (char)131, (char)132, (char)134,
                                                (char)136, (char)140, (char)128, (char)127, (char)126, (char)125,
                                                (char)124, (char)122, (char)120, (char)116));
}

/* x [m, lda] floats, k values per row -> q1, q2 [m, kp] bytes (kp: k padded to 32),
 * dx = d / 256 and sx (the block's sum of the rounded x) [m, kb] floats, and
 * corr [m, kb, 2] = 128 * (256 sum(q1) + sum(q2)) per half block (int32). xbytes 1: q1
 * alone (q2 not written), dx = d, corr = 128 * sum(q1). */
static void quantize_rows(const float *x, int64_t m, int64_t k, int64_t lda, int8_t *q1s, int8_t *q2s, float *dx,
                          float *sx, int32_t *corr, int xbytes) {
    const int64_t kp = (k + 31) / 32 * 32, kb = kp / 32;
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
            int32_t total = 0;
            for (int h = 0; h < 2; h++) {
                __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v[h], iv)); /* round to nearest even */
                _mm_storeu_si128((__m128i *)(q1s + r * kp + b * 32 + 16 * h), _mm512_cvtsepi32_epi8(q1));
                int32_t part; /* the half block's sum of x in steps of dx */
                if (xbytes == 1) {
                    part = _mm512_reduce_add_epi32(q1);
                } else {
                    __m512 rest = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(q1), dv, v[h]);
                    __m512i q2 = _mm512_min_epi32(
                        _mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(rest, iv256)), lo), hi);
                    part = _mm512_reduce_add_epi32(_mm512_add_epi32(_mm512_slli_epi32(q1, 8), q2));
                    _mm_storeu_si128((__m128i *)(q2s + r * kp + b * 32 + 16 * h), _mm512_cvtsepi32_epi8(q2));
                }
                corr[(r * kb + b) * 2 + h] = 128 * part;
                total += part;
            }
            const float unit = xbytes == 1 ? d : d / 256.f; /* what one step of the integer sums is worth */
            dx[r * kb + b] = unit;
            sx[r * kb + b] = unit * (float)total;
        }
    }
}

/* 16 scales from element i of d or m: float16 widened (exact), or float32 */
static inline __attribute__((always_inline)) __m512 scales16(const void *p, int64_t i, const int half) {
    return half ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i)))
                : _mm512_loadu_ps((const float *)p + i);
}

/* tile t's 16 scales of block b (half h where per16) in d or m: half 2, super-block scales
 * (d * factor, as scale_of), else scales16's */
static inline __attribute__((always_inline)) __m512 tile_scales(const void *p, int64_t t, int64_t b, int h, int64_t kb,
                                                                const int half, const int per16) {
    if (half == 2) {
        const uint8_t *blob = super_blob(p, t, b, kb, per16);
        const __m512 base = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blob));
        const __m128i f = _mm_loadu_si128((const __m128i *)(blob + 32 + 16 * super_group(b, h, per16)));
        return _mm512_mul_ps(base, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(f)));
    }
    return scales16(p, scale_index(t, b, h, kb, per16), half);
}

/* block b of tile t's weights as 8 vectors of one byte a weight (value 4 g + i of column j at
 * byte 4 j + i of vector g, as vpdpbusd takes them): the nibbles split (NL: through its
 * table), forms 5 and 6 with their high bits put back, the byte forms loaded */
static inline __attribute__((always_inline)) void unpack_block(const int form, const uint8_t *w, int64_t t, int64_t kb,
                                                               int64_t b, __m512i *wv) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    const __m512i table = form == FORM_MX ? mx_table() : nl_table();
    if (form == 4 || form == 5 || form == 6 || TABLE_FORM(form)) {
        const uint8_t *src = w + ((t * kb + b) * block_vectors(form)) * 64;
        for (int g = 0; g < 4; g++) {
            __m512i v = _mm512_loadu_si512((const void *)(src + 64 * g));
            wv[g] = _mm512_and_si512(v, low);
            wv[g + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            if (TABLE_FORM(form)) {
                wv[g] = _mm512_shuffle_epi8(table, wv[g]);
                wv[g + 4] = _mm512_shuffle_epi8(table, wv[g + 4]);
            }
        }
        if (form == 5 || form == 6) { /* each byte's fifth (and sixth) bit: word G's bit 4 j + i, a byte mask */
            const __m512i sixteen = _mm512_set1_epi8(16), thirty_two = _mm512_set1_epi8(32);
            for (int g = 0; g < 8; g++) {
                uint64_t bits;
                memcpy(&bits, src + 256 + 8 * g, sizeof bits);
                wv[g] = _mm512_mask_add_epi8(wv[g], (__mmask64)bits, wv[g], sixteen);
                if (form == 6) {
                    memcpy(&bits, src + 320 + 8 * g, sizeof bits);
                    wv[g] = _mm512_mask_add_epi8(wv[g], (__mmask64)bits, wv[g], thirty_two);
                }
            }
        }
    } else {
        const uint8_t *src = w + ((t * kb + b) * 8) * 64;
        for (int g = 0; g < 8; g++) wv[g] = _mm512_loadu_si512((const void *)(src + 64 * g));
    }
}

/* block b of tile t's scales (half 2 multiplies them out): sd0, sd1 the halves' (the same
 * where one scale covers 32), sm the offsets (0 where there are none; super-block ones are
 * -(dmin * factor): negated here, by the sign bit, exactly) */
static inline __attribute__((always_inline)) void block_scales(const int form, const void *d, const void *mn,
                                                               int64_t t, int64_t b, int64_t kb, const int half,
                                                               __m512 *sd0, __m512 *sd1, __m512 *sm) {
    const int per16 = form == 8 || form == 6;
    *sd0 = tile_scales(d, t, b, 0, kb, half, per16);
    *sd1 = per16 ? tile_scales(d, t, b, 1, kb, half, 1) : *sd0;
    *sm = !mn ? _mm512_setzero_ps() : tile_scales(mn, t, b, 0, kb, half, 0);
    if (mn && half == 2)
        *sm = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(*sm), _mm512_set1_epi32(INT32_MIN)));
}

/* bytes of one expanded block: its 8 weight vectors, then sd0, sd1, sm (expand_tile) */
#define XBLOCK (11 * 64)

/* rows [r0, r0 + mr) x the 16 columns of tile t (columns past n not written); xbytes and half
 * constants (xbytes 1: q1 alone, half the dot products; half 1: d and m are float16, 2: super-block scales) */
static inline __attribute__((always_inline)) void tile(int form, const int8_t *q1s, const int8_t *q2s,
                                                       const float *dx, const float *sx, const int32_t *corr,
                                                       int64_t r0, int mr, int64_t kp, const uint8_t *w,
                                                       const void *d, const void *mn, const float *bias,
                                                       float *out, int64_t ldc, int64_t n, int64_t t,
                                                       const int xbytes, const int half, const uint8_t *xw,
                                                       const int prefetch) {
    const int64_t kb = kp / 32;
    __m512 acc[MR];
    for (int i = 0; i < MR; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < kb; b++) {
        __m512i wv[8];
        __m512 sd0, sd1, sm; /* the block's scales (per 16: two) and offsets, once for its rows */
        if (xw) { /* the tile expanded beforehand (expand_tile): a prompt's row groups share it */
            const uint8_t *e = xw + b * XBLOCK;
            for (int g = 0; g < 8; g++) wv[g] = _mm512_load_si512((const void *)(e + g * 64));
            sd0 = _mm512_load_ps((const float *)(e + 512));
            sd1 = _mm512_load_ps((const float *)(e + 576));
            sm = _mm512_load_ps((const float *)(e + 640));
        } else {
            if (prefetch) prefetch_ahead(form, half, w, d, mn, t, b, kb);
            unpack_block(form, w, t, kb, b, wv);
            block_scales(form, d, mn, t, b, kb, half, &sd0, &sd1, &sm);
        }
        for (int i = 0; i < mr; i++) {
            const int64_t r = r0 + i;
            const int32_t *x1 = (const int32_t *)(q1s + r * kp + b * 32);
            const int32_t *x2 = (const int32_t *)(q2s + r * kp + b * 32);
            const __m512 xs = _mm512_set1_ps(dx[r * kb + b]);
            if (form == 4 || form == 5 || TABLE_FORM(form)) {
                __m512i p1 = _mm512_setzero_si512(), p2 = _mm512_setzero_si512();
                for (int g = 0; g < 8; g++) {
                    p1 = _mm512_dpbusd_epi32(p1, wv[g], _mm512_set1_epi32(x1[g]));
                    if (xbytes == 2) p2 = _mm512_dpbusd_epi32(p2, wv[g], _mm512_set1_epi32(x2[g]));
                }
                __m512i p = xbytes == 1 ? p1 : _mm512_add_epi32(_mm512_slli_epi32(p1, 8), p2);
                if (TABLE_FORM(form)) /* |p| < 2^28: (kvalues + 128) * 257 * 127 * 32, no overflow */
                    p = _mm512_sub_epi32(p, _mm512_set1_epi32(corr[(r * kb + b) * 2] + corr[(r * kb + b) * 2 + 1]));
                __m512 ds = _mm512_mul_ps(sd0, xs);
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), ds, acc[i]);
            } else {
                for (int h = 0; h < 2; h++) {
                    __m512i p1 = _mm512_setzero_si512(), p2 = _mm512_setzero_si512();
                    for (int g = 4 * h; g < 4 * h + 4; g++) {
                        p1 = _mm512_dpbusd_epi32(p1, wv[g], _mm512_set1_epi32(x1[g]));
                        if (xbytes == 2) p2 = _mm512_dpbusd_epi32(p2, wv[g], _mm512_set1_epi32(x2[g]));
                    }
                    /* the bytes' offset taken back: 128 (forms 8, 9), 32 (form 6, q - 32): corr / 4, exact */
                    const int32_t c = corr[(r * kb + b) * 2 + h];
                    __m512i p = _mm512_sub_epi32(xbytes == 1 ? p1 : _mm512_add_epi32(_mm512_slli_epi32(p1, 8), p2),
                                                 _mm512_set1_epi32(form == 6 ? c / 4 : c));
                    __m512 ds = _mm512_mul_ps(h ? sd1 : sd0, xs);
                    acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), ds, acc[i]);
                }
            }
            if (mn) acc[i] = _mm512_fmadd_ps(sm, _mm512_set1_ps(sx[r * kb + b]), acc[i]);
        }
    }
    const int64_t c0 = t * NT;
    const __mmask16 keep = n - c0 >= NT ? 0xFFFF : (__mmask16)((1u << (n - c0)) - 1);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(keep, bias + c0) : _mm512_setzero_ps();
    for (int i = 0; i < mr; i++) _mm512_mask_storeu_ps(out + (r0 + i) * ldc + c0, keep, _mm512_add_ps(acc[i], bv));
}

/* Tile t's weights unpacked (unpack_block) and its scales made (block_scales) into xw
 * [kb][XBLOCK]: forms 5 and 6 put their high bits back with 8-16 masked adds a block, and the
 * k-quants' scales are multiplied out, which a prompt's row groups would each repeat (a
 * 512-row Q6_K GEMM took 1.4x its byte form's time); so they do it once a tile, into a
 * buffer that stays in L2 while the row groups read it. The same values: the same bits. */
static void expand_tile(const struct qjob *j, int64_t t, int64_t kb, uint8_t *xw) {
    for (int64_t b = 0; b < kb; b++) {
        __m512i wv[8];
        __m512 sc[3];
        if (j->form == 5)
            unpack_block(5, j->w, t, kb, b, wv);
        else
            unpack_block(6, j->w, t, kb, b, wv);
        if (j->half == 2)
            block_scales(j->form, j->d, j->mn, t, b, kb, 2, sc, sc + 1, sc + 2);
        else if (j->half)
            block_scales(j->form, j->d, j->mn, t, b, kb, 1, sc, sc + 1, sc + 2);
        else
            block_scales(j->form, j->d, j->mn, t, b, kb, 0, sc, sc + 1, sc + 2);
        uint8_t *e = xw + b * XBLOCK;
        for (int g = 0; g < 8; g++) _mm512_store_si512((void *)(e + g * 64), wv[g]);
        for (int i = 0; i < 3; i++) _mm512_store_ps((float *)(e + 512 + 64 * i), sc[i]);
    }
}

#elif QGEMM_AVX2
/* AVX2 (+ FMA, F16C): no vpdpbusd, so each column's 4-byte dot is vpmaddubsw (u8 x s8 pairs
 * to int16, saturating) then vpmaddwd (int16 pairs to int32), llama.cpp's AVX2 method, on the
 * same layout: a tile's 16 columns are two 8-lane halves (bytes 32 c .. 32 c + 31 of each
 * 64-byte vector). The integer sums are exactly the AVX-512 path's, and the float steps the
 * same operations in the same order, so the results are the same bits:
 * - a pair's sum must fit int16: 2 * 15 * 127 (Q4 form) fits, so up to 8 vectors' pairs are
 *   summed in int16 before the vpmaddwd (the Q5 form's 31: 4; the Q6 form's 63: 2);
 * - the byte forms' q + 128 (up to 255) and NL's kvalues + 128 do not fit (2 * 255 * 127), so
 *   they go signed, with the sign trick: |w| x (x with w's sign), |w| <= 128, x in +-127; the
 *   sum is then q x itself, the AVX-512 path's after its - 128 sum(x) (corr), so no corr;
 * - x's two bytes join in the vpmaddwd: pairs of q1 products times 256, of q2 times 1, the
 *   AVX-512 path's (p1 << 8) + p2.
 * Two Zen 4 cores built as x86-64-v3 (bench/qgemm_classes.py, 8 cycled 4096 x 4096 layers,
 * against the AVX-512 path in the same run; the machine's streaming read ~26 GB/s): a decode
 * GEMV reads Q4_1 at 26 GB/s (AVX-512: 28), Q4_K 28 (30), Q8_0 ~18 (~14, both noisy), Q6_K
 * ~19 (28: its two bit planes take ~8 operations a vector to put back, where AVX-512 masks them
 * in). More rows than a group take the wide path below (gemm_wide: vpmaddwd on int16): on one
 * Zen 5 core (CPU time, bench/qgemm_classes.py's layers) 16- and 512-row GEMMs of every form
 * run at 145-170 GFLOP/s, 0.55-0.65 of the VNNI path's rate and about the core's AVX2 FMA
 * peak (~131-169 as it clocks); the byte path took 55-70 (Q8_0, IQ4_NL) to 150 (Q4_1). */

/* IQ4_NL's kvalues (ggml-common.h kvalues_iq4nl) as signed bytes, in each 16-byte lane for
 * vpshufb */
static inline __m256i nl_table(void) {
    return _mm256_broadcastsi128_si256(_mm_setr_epi8(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69,
                                                     89, 113));
}

/* MXFP4's kvalues (ggml-common.h kvalues_mxfp4, E2M1 doubled) as signed bytes, as nl_table's */
static inline __m256i mx_table(void) {
    return _mm256_broadcastsi128_si256(_mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12));
}

static inline int32_t hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

static inline float hmax_ps(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 16 int32 (two vectors, each in +-127) -> 16 signed bytes, in order */
static inline void store_bytes16(int8_t *dst, __m256i a, __m256i b) {
    const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);
    _mm_storeu_si128((__m128i *)dst, _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1)));
}

/* quantize_rows as the AVX-512 path's (the same operations per value: the same bytes and sums) */
static void quantize_rows(const float *x, int64_t m, int64_t k, int64_t lda, int8_t *q1s, int8_t *q2s, float *dx,
                          float *sx, int32_t *corr, int xbytes) {
    const int64_t kp = (k + 31) / 32 * 32, kb = kp / 32;
    const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
    const __m256 sign = _mm256_set1_ps(-0.f);
    for (int64_t r = 0; r < m; r++) {
        for (int64_t b = 0; b < kb; b++) {
            const float *src = x + r * lda + b * 32;
            const int64_t left = k - b * 32;
            float tail[32];
            if (left < 32) { /* the last block, zero-padded */
                memset(tail, 0, sizeof tail);
                memcpy(tail, src, sizeof(float) * (size_t)left);
                src = tail;
            }
            __m256 v[4];
            for (int e = 0; e < 4; e++) v[e] = _mm256_loadu_ps(src + 8 * e);
            const __m256 a = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                           _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
            const float amax = hmax_ps(a);
            const float d = amax / 127.f;
            const float id = d > 0.f ? 1.f / d : 0.f;
            const __m256 iv = _mm256_set1_ps(id), dv = _mm256_set1_ps(d), iv256 = _mm256_set1_ps(256.f * id);
            int32_t total = 0;
            for (int h = 0; h < 2; h++) {
                __m256i q1[2], q2[2], s = _mm256_setzero_si256();
                for (int e = 0; e < 2; e++) {
                    q1[e] = _mm256_cvtps_epi32(_mm256_mul_ps(v[2 * h + e], iv)); /* round to nearest even */
                    if (xbytes == 1) {
                        s = _mm256_add_epi32(s, q1[e]);
                    } else {
                        const __m256 rest = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(q1[e]), dv, v[2 * h + e]);
                        q2[e] = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(rest, iv256)), lo),
                                                 hi);
                        s = _mm256_add_epi32(s, _mm256_add_epi32(_mm256_slli_epi32(q1[e], 8), q2[e]));
                    }
                }
                store_bytes16(q1s + r * kp + b * 32 + 16 * h, q1[0], q1[1]);
                if (xbytes == 2) store_bytes16(q2s + r * kp + b * 32 + 16 * h, q2[0], q2[1]);
                const int32_t part = hsum_epi32(s); /* the half block's sum of x in steps of dx */
                corr[(r * kb + b) * 2 + h] = 128 * part;
                total += part;
            }
            const float unit = xbytes == 1 ? d : d / 256.f; /* what one step of the integer sums is worth */
            dx[r * kb + b] = unit;
            sx[r * kb + b] = unit * (float)total;
        }
    }
}

/* forms whose bytes go signed (the sign trick above) */
static inline int signed_form(const int form) { return form == 8 || form == FORM_Q8S || TABLE_FORM(form); }

/* 8 scales from element i of d or m: float16 widened (exact), or float32 */
static inline __attribute__((always_inline)) __m256 scales8(const void *p, int64_t i, const int half) {
    return half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)))
                : _mm256_loadu_ps((const float *)p + i);
}

/* half c of tile t's 16 scales of block b (half h where per16) in d or m (tile_scales of the
 * AVX-512 path, 8 columns) */
static inline __attribute__((always_inline)) __m256 tile_scales(const void *p, int64_t t, int64_t b, int h, int64_t kb,
                                                                const int half, const int per16, int c) {
    if (half == 2) {
        const uint8_t *blob = super_blob(p, t, b, kb, per16);
        const __m256 base = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blob + 16 * c)));
        const __m128i f = _mm_loadl_epi64((const __m128i *)(blob + 32 + 16 * super_group(b, h, per16) + 8 * c));
        return _mm256_mul_ps(base, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(f)));
    }
    return scales8(p, scale_index(t, b, h, kb, per16) + 8 * c, half);
}

/* one bit plane's 32 bits for half c of vector g as a byte each: bit 4 j + i -> byte 4 j + i,
 * `value` (16 or 32) where set. Each byte of the word repeated 8 times, one bit of each kept
 * (byte k of 8: bit k), and vpsignb makes it the value: +value where the kept bit is 1 to 64
 * (a positive byte), 0 where it is clear; bit 7 makes the byte negative, so that byte's value
 * is given negated (one operation less than a compare and a mask). */
static inline __attribute__((always_inline)) __m256i plane_bytes(const uint8_t *word, const int value) {
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3,
                                            3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((int64_t)0x8040201008040201ull);
    const __m256i signed_value = _mm256_set1_epi64x((int64_t)(0x0101010101010101ull * (uint64_t)value
                                                              - ((uint64_t)(2 * value) << 56)));
    int32_t bits;
    memcpy(&bits, word, sizeof bits);
    return _mm256_sign_epi8(signed_value, _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(bits), spread), bit));
}

/* vector g of half c of a block's weights (src: the block's first byte) as one byte a weight
 * (value 4 g + i of column 8 c + j at byte 4 j + i): the nibbles split, forms 5 and 6 with
 * their high bits put back, NL through its (signed) table, the byte forms as signed q */
static inline __attribute__((always_inline)) __m256i weight_vector(const int form, const uint8_t *src, int g, int c) {
    if (form == 8 || form == FORM_Q8S)
        return _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(src + 64 * g + 32 * c)),
                                _mm256_set1_epi8((char)0x80));
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i v = _mm256_loadu_si256((const __m256i *)(src + 64 * (g % 4) + 32 * c));
    __m256i q = g < 4 ? _mm256_and_si256(v, low) : _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    if (form == FORM_NL) q = _mm256_shuffle_epi8(nl_table(), q);
    if (form == FORM_MX) q = _mm256_shuffle_epi8(mx_table(), q);
    if (form == 5 || form == 6) q = _mm256_or_si256(q, plane_bytes(src + 256 + 8 * g + 4 * c, 16));
    if (form == 6) q = _mm256_or_si256(q, plane_bytes(src + 320 + 8 * g + 4 * c, 32));
    return q;
}

/* half c of block b of tile t's weights: its 8 vectors (weight_vector) */
static inline __attribute__((always_inline)) void unpack_half(const int form, const uint8_t *w, int64_t t, int64_t kb,
                                                              int64_t b, int c, __m256i *wv) {
    const uint8_t *src = w + ((t * kb + b) * block_vectors(form)) * 64;
    for (int g = 0; g < 8; g++) wv[g] = weight_vector(form, src, g, c);
}

/* half c of block b of tile t's scales: block_scales of the AVX-512 path */
static inline __attribute__((always_inline)) void block_scales(const int form, const void *d, const void *mn,
                                                               int64_t t, int64_t b, int64_t kb, const int half,
                                                               int c, __m256 *sd0, __m256 *sd1, __m256 *sm) {
    const int per16 = form == 8 || form == 6;
    *sd0 = tile_scales(d, t, b, 0, kb, half, per16, c);
    *sd1 = per16 ? tile_scales(d, t, b, 1, kb, half, 1, c) : *sd0;
    *sm = !mn ? _mm256_setzero_ps() : tile_scales(mn, t, b, 0, kb, half, 0, c);
    if (mn && half == 2)
        *sm = _mm256_castsi256_ps(_mm256_xor_si256(_mm256_castps_si256(*sm), _mm256_set1_epi32(INT32_MIN)));
}

/* sum over vectors g0 .. g1 - 1 of each lane's 4 products with x's bytes `x` (as int32 words),
 * times `unit` (1 or 256), in int32: vpmaddubsw's int16 pairs summed over up to `run` vectors
 * (what fits int16 for the form), then widened by vpmaddwd. wa: |w| of the signed forms. */
static inline __attribute__((always_inline)) __m256i dot(const int form, const __m256i *wv, const __m256i *wa,
                                                         const int32_t *x, int g0, int g1, __m256i unit) {
    const int run = form == 4 ? 8 : form == 5 ? 4 : form == 6 ? 2 : 1;
    __m256i p = _mm256_setzero_si256();
    for (int g = g0; g < g1; g += run) {
        __m256i s = _mm256_setzero_si256();
        for (int u = g; u < g + run && u < g1; u++) {
            const __m256i xv = _mm256_set1_epi32(x[u]);
            const __m256i prod = signed_form(form) ? _mm256_maddubs_epi16(wa[u], _mm256_sign_epi8(xv, wv[u]))
                                                   : _mm256_maddubs_epi16(wv[u], xv);
            s = u == g ? prod : _mm256_add_epi16(s, prod);
            __asm__("" : "+x"(s)); /* in order, in a register (tile_row's note) */
        }
        p = _mm256_add_epi32(p, _mm256_madd_epi16(s, unit));
    }
    return p;
}

/* x's rounded row r against vectors g0 .. g1 - 1: (p1 << 8) + p2 (xbytes 2), p1 (xbytes 1) */
static inline __attribute__((always_inline)) __m256i row_dot(const int form, const int xbytes, const __m256i *wv,
                                                             const __m256i *wa, const int32_t *x1, const int32_t *x2,
                                                             int g0, int g1) {
    const __m256i one = _mm256_set1_epi16(1);
    if (xbytes == 1) return dot(form, wv, wa, x1, g0, g1, one);
    return _mm256_add_epi32(dot(form, wv, wa, x1, g0, g1, _mm256_set1_epi16(256)), dot(form, wv, wa, x2, g0, g1, one));
}

/* half c's 8 columns of rows [r0, r0 + mr) out (acc + bias, columns past n not written) */
static inline __attribute__((always_inline)) void store_half(const __m256 *acc, int64_t r0, int mr, const float *bias,
                                                             float *out, int64_t ldc, int64_t n, int64_t t, int c) {
    const int64_t col = t * NT + 8 * c, left = n - col;
    if (left <= 0) return;
    const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(left >= 8 ? 8 : (int)left),
                                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256 bv = bias ? _mm256_maskload_ps(bias + col, keep) : _mm256_setzero_ps();
    for (int i = 0; i < mr; i++) _mm256_maskstore_ps(out + (r0 + i) * ldc + col, keep, _mm256_add_ps(acc[i], bv));
}

/* A decode GEMV's tile (row r0 alone): each weight vector made, both halves, and used at once,
 * x's broadcasts shared by the halves (what keeps it within the 16 registers and each line read
 * once); the integer sums and the float steps are tile_rows' (the same bits) */
static inline __attribute__((always_inline)) void tile_row(int form, const int8_t *q1s, const int8_t *q2s,
                                                           const float *dx, const float *sx, const int32_t *corr,
                                                           int64_t r0, int64_t kp, const uint8_t *w, const void *d,
                                                           const void *mn, const float *bias, float *out, int64_t ldc,
                                                           int64_t n, int64_t t, const int xbytes, const int half,
                                                           const int prefetch) {
    const int64_t kb = kp / 32;
    const int per16 = form == 6 || form == 8 || form == FORM_Q8S, run = form == 4 ? 8 : form == 5 ? 4 : form == 6 ? 2 : 1;
    const __m256i one = _mm256_set1_epi16(1), unit1 = xbytes == 1 ? one : _mm256_set1_epi16(256);
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t b = 0; b < kb; b++) {
        if (prefetch) prefetch_ahead(form, half, w, d, mn, t, b, kb);
        const uint8_t *src = w + ((t * kb + b) * block_vectors(form)) * 64;
        const int32_t *x1 = (const int32_t *)(q1s + r0 * kp + b * 32);
        const int32_t *x2 = (const int32_t *)(q2s + r0 * kp + b * 32);
        const __m256 xs = _mm256_set1_ps(dx[r0 * kb + b]);
#pragma GCC unroll 2
        for (int h = 0; h < 1 + per16; h++) {
            __m256i p[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
            for (int g = per16 ? 4 * h : 0; g < (per16 ? 4 * h + 4 : 8); g += run) {
                __m256i s1[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()}, s2[2] = {s1[0], s1[1]};
#pragma GCC unroll 8
                for (int u = g; u < g + run; u++) {
                    const __m256i xv1 = _mm256_set1_epi32(x1[u]), xv2 = _mm256_set1_epi32(xbytes == 2 ? x2[u] : 0);
#pragma GCC unroll 2
                    for (int c = 0; c < 2; c++) {
                        const __m256i wv = weight_vector(form, src, u, c);
                        if (signed_form(form)) {
                            const __m256i wa = _mm256_sign_epi8(wv, wv);
                            s1[c] = _mm256_add_epi16(s1[c], _mm256_maddubs_epi16(wa, _mm256_sign_epi8(xv1, wv)));
                            if (xbytes == 2)
                                s2[c] = _mm256_add_epi16(s2[c], _mm256_maddubs_epi16(wa, _mm256_sign_epi8(xv2, wv)));
                        } else {
                            s1[c] = _mm256_add_epi16(s1[c], _mm256_maddubs_epi16(wv, xv1));
                            if (xbytes == 2) s2[c] = _mm256_add_epi16(s2[c], _mm256_maddubs_epi16(wv, xv2));
                        }
                        /* the sums kept in order, in registers: reassociated, gcc holds every
                         * product of the run on the stack first (a third slower) */
                        __asm__("" : "+x"(s1[c]), "+x"(s2[c]));
                    }
                }
#pragma GCC unroll 2
                for (int c = 0; c < 2; c++) {
                    p[c] = _mm256_add_epi32(p[c], _mm256_madd_epi16(s1[c], unit1));
                    if (xbytes == 2) p[c] = _mm256_add_epi32(p[c], _mm256_madd_epi16(s2[c], one));
                }
            }
#pragma GCC unroll 2
            for (int c = 0; c < 2; c++) {
                if (form == 6) /* q - 32: corr / 4 taken back, exact */
                    p[c] = _mm256_sub_epi32(p[c], _mm256_set1_epi32(corr[(r0 * kb + b) * 2 + h] / 4));
                const __m256 ds = _mm256_mul_ps(tile_scales(d, t, b, h, kb, half, form == 6 || form == 8, c), xs);
                acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p[c]), ds, acc[c]);
            }
        }
        if (mn) {
            const __m256 sxv = _mm256_set1_ps(sx[r0 * kb + b]);
#pragma GCC unroll 2
            for (int c = 0; c < 2; c++) {
                __m256 sm = tile_scales(mn, t, b, 0, kb, half, 0, c);
                if (half == 2) /* super-block offsets are -(dmin * factor) */
                    sm = _mm256_castsi256_ps(_mm256_xor_si256(_mm256_castps_si256(sm), _mm256_set1_epi32(INT32_MIN)));
                acc[c] = _mm256_fmadd_ps(sm, sxv, acc[c]);
            }
        }
    }
    store_half(acc, r0, 1, bias, out, ldc, n, t, 0);
    store_half(acc + 1, r0, 1, bias, out, ldc, n, t, 1);
}

/* half c of the tile() below for rows [r0, r0 + mr): each block unpacked (or read expanded)
 * once for the rows */
static inline __attribute__((always_inline)) void tile_rows(int form, const int8_t *q1s, const int8_t *q2s,
                                                            const float *dx, const float *sx, const int32_t *corr,
                                                            int64_t r0, int mr, int64_t kp, const uint8_t *w,
                                                            const void *d, const void *mn, const float *bias,
                                                            float *out, int64_t ldc, int64_t n, int64_t t,
                                                            const int xbytes, const int half, const uint8_t *xw,
                                                            const int c) {
    const int64_t kb = kp / 32;
    __m256 acc[MR];
    for (int i = 0; i < MR; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < kb; b++) {
        __m256i wv[8], wa[8];
        __m256 sd0, sd1, sm; /* the block's scales (per 16: two) and offsets, once for its rows */
        (void)xw; /* (the wide path, gemm_wide, takes more rows than a group) */
        unpack_half(form, w, t, kb, b, c, wv);
        block_scales(form, d, mn, t, b, kb, half, c, &sd0, &sd1, &sm);
        if (signed_form(form))
            for (int g = 0; g < 8; g++) wa[g] = _mm256_sign_epi8(wv[g], wv[g]);
#pragma GCC unroll 4
        for (int i = 0; i < mr; i++) {
            const int64_t r = r0 + i;
            const int32_t *x1 = (const int32_t *)(q1s + r * kp + b * 32);
            const int32_t *x2 = (const int32_t *)(q2s + r * kp + b * 32);
            const __m256 xs = _mm256_set1_ps(dx[r * kb + b]);
            if (form == 4 || form == 5 || TABLE_FORM(form)) {
                const __m256i p = row_dot(form, xbytes, wv, wa, x1, x2, 0, 8);
                const __m256 ds = _mm256_mul_ps(sd0, xs);
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), ds, acc[i]);
            } else {
                for (int h = 0; h < 2; h++) {
                    __m256i p = row_dot(form, xbytes, wv, wa, x1, x2, 4 * h, 4 * h + 4);
                    if (form == 6) /* q - 32: corr / 4 taken back, exact */
                        p = _mm256_sub_epi32(p, _mm256_set1_epi32(corr[(r * kb + b) * 2 + h] / 4));
                    const __m256 ds = _mm256_mul_ps(h ? sd1 : sd0, xs);
                    acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), ds, acc[i]);
                }
            }
            if (mn) acc[i] = _mm256_fmadd_ps(sm, _mm256_set1_ps(sx[r * kb + b]), acc[i]);
        }
    }
    store_half(acc, r0, mr, bias, out, ldc, n, t, c);
}

/* rows [r0, r0 + mr) x the 16 columns of tile t (columns past n not written): a decode GEMV's
 * one row (tile_row), or more, half by half (tile_rows: the tile stays in cache between) */
static inline __attribute__((always_inline)) void tile(int form, const int8_t *q1s, const int8_t *q2s,
                                                       const float *dx, const float *sx, const int32_t *corr,
                                                       int64_t r0, int mr, int64_t kp, const uint8_t *w,
                                                       const void *d, const void *mn, const float *bias,
                                                       float *out, int64_t ldc, int64_t n, int64_t t,
                                                       const int xbytes, const int half, const uint8_t *xw,
                                                       const int prefetch) {
    if (mr == 1 && !xw) {
        tile_row(form, q1s, q2s, dx, sx, corr, r0, kp, w, d, mn, bias, out, ldc, n, t, xbytes, half, prefetch);
        return;
    }
    for (int c = 0; c < 2; c++)
        tile_rows(form, q1s, q2s, dx, sx, corr, r0, mr, kp, w, d, mn, bias, out, ldc, n, t, xbytes, half, xw, c);
}

/* The prompt path (a task's row block of more than MR rows: a prompt's GEMMs, a batch's decode
 * step): vpmaddwd on weights widened to int16 once a tile (expand_wide, shared by the block's
 * row groups) and x as int16, x16 = 256 q1 + q2 (|x16| <= 32639; xbytes 1: q1): one vpmaddwd
 * makes a column's two products with both of x's bytes, where the byte path takes two
 * vpmaddubsw (xbytes 2) and, on the signed forms (Q8_0, NL), two vpsignb and two vpmaddwd
 * more. The integers are the same (the signed forms' bytes as q, form 6's as q - 32: the
 * AVX-512 path's sums after its corr), and the float steps tile_rows', so the same bits.
 * An expanded half tile: per block, 16 vectors of 8 columns x 2 values (value 2 kk, 2 kk + 1
 * of column j in lane j), then sd0, sd1, sm (8 floats each). */
#define XHALF (16 * 32 + 3 * 32)
#define XWIDE (2 * XHALF) /* bytes of one expanded block (both halves) */
#define WR 4              /* rows per wide row group */

/* a vector of bytes (value 4 g + i of column j at byte 4 j + i) widened to int16 pairs:
 * e0 values 4 g, 4 g + 1 of each column, e1 values 4 g + 2, 4 g + 3 (sgn: signed bytes) */
static inline __attribute__((always_inline)) void widen_bytes(__m256i v, const int sgn, __m256i *e0, __m256i *e1) {
    const __m256i lo = sgn ? _mm256_srai_epi16(_mm256_slli_epi16(v, 8), 8) : _mm256_and_si256(v, _mm256_set1_epi16(0xFF));
    const __m256i hi = sgn ? _mm256_srai_epi16(v, 8) : _mm256_srli_epi16(v, 8);
    *e0 = _mm256_blend_epi16(lo, _mm256_slli_epi32(hi, 16), 0xAA);
    *e1 = _mm256_blend_epi16(_mm256_srli_epi32(lo, 16), hi, 0xAA);
}

/* tile t's weights widened (widen_bytes of unpack_half's vectors; form 6 as q - 32) and its
 * scales made (block_scales) into xw [kb][XWIDE], form and half constant */
static inline __attribute__((always_inline)) void expand_wide_as(const struct qjob *j, const int form, const int half,
                                                                 int64_t t, int64_t kb, uint8_t *xw) {
    const __m256i thirty_two = _mm256_set1_epi16(32);
    for (int64_t b = 0; b < kb; b++)
        for (int c = 0; c < 2; c++) {
            __m256i wv[8];
            __m256 sc[3];
            unpack_half(form, j->w, t, kb, b, c, wv);
            block_scales(form, j->d, j->mn, t, b, kb, half, c, sc, sc + 1, sc + 2);
            uint8_t *e = xw + b * XWIDE + c * XHALF;
            for (int g = 0; g < 8; g++) {
                __m256i e0, e1;
                widen_bytes(wv[g], signed_form(form), &e0, &e1);
                if (form == 6) e0 = _mm256_sub_epi16(e0, thirty_two), e1 = _mm256_sub_epi16(e1, thirty_two);
                _mm256_store_si256((__m256i *)(e + 64 * g), e0);
                _mm256_store_si256((__m256i *)(e + 64 * g + 32), e1);
            }
            for (int i = 0; i < 3; i++) _mm256_store_ps((float *)(e + 512 + 32 * i), sc[i]);
        }
}

#define EXPAND_HALVES(form)                                                                                    \
    if (j->half == 2) expand_wide_as(j, form, 2, t, kb, xw);                                                   \
    else if (j->half) expand_wide_as(j, form, 1, t, kb, xw);                                                   \
    else expand_wide_as(j, form, 0, t, kb, xw);

static void expand_wide(const struct qjob *j, int64_t t, int64_t kb, uint8_t *xw) {
    if (j->form == 4) { EXPAND_HALVES(4) }
    else if (j->form == 5) { EXPAND_HALVES(5) }
    else if (j->form == 6) { EXPAND_HALVES(6) }
    else if (j->form == FORM_NL) { EXPAND_HALVES(FORM_NL) }
    else if (j->form == FORM_MX) { EXPAND_HALVES(FORM_MX) }
    else if (j->form == FORM_Q8S) { EXPAND_HALVES(FORM_Q8S) }
    else { EXPAND_HALVES(8) }
}

/* rows [ra, rz) of x's bytes as int16 into x16 [rz - ra][kp]: 256 q1 + q2 (xbytes 1: q1) */
static void widen_x(const struct qjob *j, int64_t ra, int64_t rz, int16_t *x16) {
    for (int64_t r = ra; r < rz; r++)
        for (int64_t k = 0; k < j->kp; k += 16) {
            __m256i v = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(j->q1s + r * j->kp + k)));
            if (j->xbytes == 2)
                v = _mm256_add_epi16(_mm256_slli_epi16(v, 8),
                                     _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(j->q2s + r * j->kp + k))));
            _mm256_storeu_si256((__m256i *)(x16 + (r - ra) * j->kp + k), v);
        }
}

/* rows [r0, r0 + mr) of tile t (both halves) from its expanded weights xw, x16's rows from row
 * xr: each x broadcast serves both halves, each weight vector the rows (2 weight and mr
 * broadcast loads a 2 mr vpmaddwd); the float sums kept in acc (memory: the 16 registers hold
 * the 2 mr integer sums). per_half: a scale per 16 values (forms 6, 8, 9: tile_rows' two
 * steps a block) */
static inline __attribute__((always_inline)) void tile_wide(const struct qjob *j, const int16_t *x16, int64_t xr,
                                                            int64_t r0, const int mr, const uint8_t *xw, int64_t t,
                                                            const int per_half) {
    const int64_t kp = j->kp, kb = kp / 32;
    float acc[WR][16] __attribute__((aligned(32)));
    memset(acc, 0, sizeof acc);
    for (int64_t b = 0; b < kb; b++) {
        const uint8_t *e = xw + b * XWIDE;
        const int16_t *xb = x16 + xr * kp + 32 * b;
        for (int h = 0; h < 1 + per_half; h++) {
            __m256i p[WR][2];
            for (int i = 0; i < WR; i++) p[i][0] = p[i][1] = _mm256_setzero_si256();
            const int k0 = per_half ? 8 * h : 0, k1 = per_half ? 8 * h + 8 : 16;
#pragma GCC unroll 16
            for (int kk = k0; kk < k1; kk++) {
                __m256i w0 = _mm256_load_si256((const __m256i *)(e + 32 * kk));
                __m256i w1 = _mm256_load_si256((const __m256i *)(e + XHALF + 32 * kk));
                __asm__("" : "+x"(w0), "+x"(w1)); /* loaded once for the rows */
#pragma GCC unroll 8
                for (int i = 0; i < mr; i++) {
                    int32_t xv;
                    memcpy(&xv, xb + i * kp + 2 * kk, sizeof xv);
                    const __m256i xq = _mm256_set1_epi32(xv);
                    p[i][0] = _mm256_add_epi32(p[i][0], _mm256_madd_epi16(w0, xq));
                    p[i][1] = _mm256_add_epi32(p[i][1], _mm256_madd_epi16(w1, xq));
                    __asm__("" : "+x"(p[i][0]), "+x"(p[i][1])); /* in order, in registers (tile_row's note) */
                }
            }
#pragma GCC unroll 8
            for (int i = 0; i < mr; i++) {
                const __m256 xs = _mm256_set1_ps(j->dx[(r0 + i) * kb + b]);
                for (int c = 0; c < 2; c++) {
                    const __m256 ds = _mm256_mul_ps(_mm256_load_ps((const float *)(e + c * XHALF + 512 + 32 * h)), xs);
                    _mm256_store_ps(acc[i] + 8 * c, _mm256_fmadd_ps(_mm256_cvtepi32_ps(p[i][c]), ds,
                                                                    _mm256_load_ps(acc[i] + 8 * c)));
                }
            }
        }
        if (j->mn)
#pragma GCC unroll 8
            for (int i = 0; i < mr; i++) {
                const __m256 sxv = _mm256_set1_ps(j->sx[(r0 + i) * kb + b]);
                for (int c = 0; c < 2; c++)
                    _mm256_store_ps(acc[i] + 8 * c, _mm256_fmadd_ps(_mm256_load_ps((const float *)(e + c * XHALF + 576)),
                                                                    sxv, _mm256_load_ps(acc[i] + 8 * c)));
            }
    }
    for (int c = 0; c < 2; c++) {
        __m256 half[WR];
        for (int i = 0; i < mr; i++) half[i] = _mm256_load_ps(acc[i] + 8 * c);
        store_half(half, r0, mr, j->bias, j->out, j->ldc, j->n, t, c);
    }
}

#define TILE_WIDE(per_half)                                                                                    \
    switch (mr) {                                                                                              \
    case 4: tile_wide(j, x16, r0 - ra, r0, 4, xw, t, per_half); break;                                         \
    case 3: tile_wide(j, x16, r0 - ra, r0, 3, xw, t, per_half); break;                                         \
    case 2: tile_wide(j, x16, r0 - ra, r0, 2, xw, t, per_half); break;                                         \
    default: tile_wide(j, x16, r0 - ra, r0, 1, xw, t, per_half);                                               \
    }

/* a thread's buffers, grown as needed (64-byte aligned; kept for the thread's life): slot 0
 * the expanded tile, 1 x16 */
static uint8_t *wide_buffer(int slot, int64_t bytes) {
    static __thread uint8_t *buf[2];
    static __thread int64_t cap[2];
    if (bytes > cap[slot]) {
        free(buf[slot]);
        buf[slot] = aligned_alloc(64, (size_t)((bytes + 63) / 64 * 64));
        cap[slot] = buf[slot] ? bytes : 0;
    }
    return buf[slot];
}

/* tiles [t0, t1) x rows [ra, rz) on the wide path; 0 where a buffer could not be had */
static int gemm_wide(const struct qjob *j, int64_t t0, int64_t t1, int64_t ra, int64_t rz) {
    const int64_t kb = j->kp / 32;
    uint8_t *xw = wide_buffer(0, kb * XWIDE);
    int16_t *x16 = (int16_t *)wide_buffer(1, (rz - ra) * j->kp * 2);
    if (!xw || !x16) return 0;
    widen_x(j, ra, rz, x16);
    const int per_half = j->form == 6 || j->form == 8 || j->form == FORM_Q8S;
    for (int64_t t = t0; t < t1; t++) {
        expand_wide(j, t, kb, xw);
        for (int64_t r0 = ra; r0 < rz; r0 += WR) {
            const int mr = rz - r0 < WR ? (int)(rz - r0) : WR;
            if (per_half) { TILE_WIDE(1) } else { TILE_WIDE(0) }
        }
    }
    return 1;
}
#endif

#if QGEMM_SIMD
#define TILE_ROWS(form, xbytes, half)                                                                          \
    switch (mr) {                                                                                                  \
    case 4: tile(form, q1s, q2s, dx, sx, corr, r0, 4, kp, w, d, mn, bias, out, ldc, n, t, xbytes, half, xw, pf); break; \
    case 3: tile(form, q1s, q2s, dx, sx, corr, r0, 3, kp, w, d, mn, bias, out, ldc, n, t, xbytes, half, xw, pf); break; \
    case 2: tile(form, q1s, q2s, dx, sx, corr, r0, 2, kp, w, d, mn, bias, out, ldc, n, t, xbytes, half, xw, pf); break; \
    default: tile(form, q1s, q2s, dx, sx, corr, r0, 1, kp, w, d, mn, bias, out, ldc, n, t, xbytes, half, xw, pf);   \
    }

/* TILE_ROWS with the form, x's bytes and the scales' type as constants (one copy of tile() each) */
#define TILE_FORMS(xbytes, half)                                                                               \
    if (j->form == 4) { TILE_ROWS(4, xbytes, half) }                                                           \
    else if (j->form == 5) { TILE_ROWS(5, xbytes, half) }                                                      \
    else if (j->form == 6) { TILE_ROWS(6, xbytes, half) }                                                      \
    else if (j->form == FORM_NL) { TILE_ROWS(FORM_NL, xbytes, half) }                                          \
    else if (j->form == FORM_MX) { TILE_ROWS(FORM_MX, xbytes, half) }                                          \
    else if (j->form == FORM_Q8S) { TILE_ROWS(FORM_Q8S, xbytes, half) }                                        \
    else { TILE_ROWS(8, xbytes, half) }

/* TILE_FORMS for the job's x bytes and scales (tile t, rows r0 .. r0 + mr) */
#define TILE_ANY                                                                                               \
    if (j->half == 2) {                                                                                        \
        if (j->xbytes == 1) { TILE_FORMS(1, 2) } else { TILE_FORMS(2, 2) }                                     \
    } else if (j->half) {                                                                                      \
        if (j->xbytes == 1) { TILE_FORMS(1, 1) } else { TILE_FORMS(2, 1) }                                     \
    } else {                                                                                                   \
        if (j->xbytes == 1) { TILE_FORMS(1, 0) } else { TILE_FORMS(2, 0) }                                     \
    }

#if QGEMM_AVX512
/* a thread's expansion buffer, grown as needed (64-byte aligned; kept for the thread's life) */
static uint8_t *expansion_buffer(int64_t bytes) {
    static __thread uint8_t *buf;
    static __thread int64_t cap;
    if (bytes > cap) {
        free(buf);
        buf = aligned_alloc(64, (size_t)((bytes + 63) / 64 * 64));
        cap = buf ? bytes : 0;
    }
    return buf;
}
#endif

static void gemm_task(void *p, int task) {
    const struct qjob *j = (const struct qjob *)p;
    const int8_t *q1s = j->q1s, *q2s = j->q2s;
    const float *dx = j->dx, *sx = j->sx, *bias = j->bias;
    const void *d = j->d, *mn = j->mn;
    const int32_t *corr = j->corr;
    const uint8_t *w = j->w;
    float *out = j->out;
    const int64_t kp = j->kp, ldc = j->ldc, n = j->n;
    const int64_t t0 = task / j->nrb * j->ct, t1 = t0 + j->ct < j->tiles ? t0 + j->ct : j->tiles;
    const int64_t ra = task % j->nrb * j->rb, rz = ra + j->rb < j->m ? ra + j->rb : j->m;
    const int64_t kb = kp / 32;
#if QGEMM_AVX2
    (void)kb;
    if (rz - ra > MR && gemm_wide(j, t0, t1, ra, rz)) return;
    const uint8_t *xw = NULL;
#else
    /* forms 5 and 6 under more than one row group: each tile expanded once, then its row groups */
    const uint8_t *xw = (j->form == 5 || j->form == 6) && rz - ra > MR ? expansion_buffer(kb * XBLOCK) : NULL;
#endif
    const int pf = j->pf; /* prefetch ahead (mstar_qlinear says when) */
#if QGEMM_AVX512
    if (xw) {
        for (int64_t t = t0; t < t1; t++) {
            expand_tile(j, t, kb, (uint8_t *)xw);
            for (int64_t r0 = ra; r0 < rz; r0 += MR) {
                const int mr = rz - r0 < MR ? (int)(rz - r0) : MR;
                TILE_ANY
            }
        }
        return;
    }
#endif
    /* column tiles in slices that stay in L1/L2 while every row group reads them */
    for (int64_t s0 = t0; s0 < t1; s0 += 8) {
        const int64_t s1 = s0 + 8 < t1 ? s0 + 8 : t1;
        for (int64_t r0 = ra; r0 < rz; r0 += MR) {
            const int mr = rz - r0 < MR ? (int)(rz - r0) : MR;
            for (int64_t t = s0; t < s1; t++) {
                TILE_ANY
            }
        }
    }
}

static int head_prefetch = 1;
/* whether a byte form's LM head GEMV prefetches (above; 1 by default): for A/B measurements */
void mstar_qgemm_set_head_prefetch(int on) { head_prefetch = on; }

static void quantize_task(void *p, int task) {
    const struct qjob *j = (const struct qjob *)p;
    const int64_t r0 = task * j->qrows, r1 = r0 + j->qrows < j->m ? r0 + j->qrows : j->m, kb = j->kp / 32;
    quantize_rows(j->x + r0 * j->lda, r1 - r0, j->k, j->lda, j->q1s + r0 * j->kp, j->q2s + r0 * j->kp,
                  j->dx + r0 * kb, j->sx + r0 * kb, j->corr + r0 * kb * 2, j->xbytes);
}

#define TASK_NS 2000  /* the least work a task is given (a claim costs ~0.1 us) */
#define TASK_MAX_NS 30000 /* the most: the caller waits out a task a descheduled worker holds */
#define TASKS_PER_THREAD 8

/* x [m, lda] floats -> out [m, ldc] (columns < n). form 4, 8 or 16 (NL), | HALF_SCALES where
 * d and m are float16; xbytes 2 or 1, the
 * bytes each value of x is rounded to (above); w, d, mn in the tiled layout above; scratch:
 * at least mstar_qlinear_scratch(m, k) bytes. `threads` > 0: run on up to that many threads
 * of the pool (pool.c; its workers are started if fewer), <= 0: on the pool's default count
 * (mstar_pool_threads()); the result is the same bits either way.
 * Returns 0, or -1 for a form or xbytes it does not take. */
int mstar_qlinear(int form, int xbytes, const float *x, int64_t m, int64_t k, int64_t lda, const void *wp,
                  const void *d, const void *mn, int64_t n, const float *bias, float *out, int64_t ldc, int threads,
                  void *scratch) {
    const int half = form & HALF_SCALES ? 1 : form & SUPER_SCALES ? 2 : 0;
    form &= ~(HALF_SCALES | SUPER_SCALES);
    if ((form != 4 && form != 5 && form != 6 && form != 8 && form != FORM_Q8S && !TABLE_FORM(form))
        || ((form == 4 || form == 5) && !mn)
        || (xbytes != 1 && xbytes != 2) || (half == 2 && ((k + 31) / 32) % 8))
        return -1;
    const int64_t kp = (k + 31) / 32 * 32, kb = kp / 32, tiles = (n + NT - 1) / NT;
    struct qjob j = {.form = form, .xbytes = xbytes, .half = half, .x = x, .m = m, .k = k, .lda = lda, .kp = kp,
                     .n = n, .ldc = ldc, .tiles = tiles, .w = (const uint8_t *)wp, .d = d, .mn = mn, .bias = bias,
                     .out = out};
    j.q1s = (int8_t *)scratch;
    j.q2s = j.q1s + m * kp;
    j.dx = (float *)(j.q2s + m * kp); /* 2 m kp is a multiple of 64: aligned */
    j.sx = j.dx + m * kb;
    j.corr = (int32_t *)(j.sx + m * kb);
    if (threads <= 0) threads = mstar_pool_threads();
    if (m <= 0 || tiles <= 0) return 0;
    /* x rounded: in blocks of 8 rows over the threads when there are many */
    j.qrows = 8;
    if (threads > 1 && m >= 32)
        mstar_parallel_for_n((int)((m + j.qrows - 1) / j.qrows), threads, quantize_task, &j);
    else
        quantize_rows(x, m, k, lda, j.q1s, j.q2s, j.dx, j.sx, j.corr, j.xbytes);
    /* the grid: row blocks of 32, column chunks of about tiles / (8 threads / row blocks)
     * tiles, but at least TASK_NS and at most TASK_MAX_NS of work (~ kb (weight + 6 ns per
     * row) ns per tile) */
    j.rb = m > 32 ? 32 : m;
    j.nrb = (m + j.rb - 1) / j.rb;
    const int64_t per_tile = kb * ((form == 4 ? 8 : form == 5 || form == 6 || TABLE_FORM(form) ? 10 : 25) + 6 * j.rb);
    const int64_t least = (TASK_NS + per_tile - 1) / per_tile;
    int64_t chunks = threads > 1 ? (TASKS_PER_THREAD * threads + j.nrb - 1) / j.nrb : 1;
    int64_t ct = (tiles + chunks - 1) / chunks;
    if (ct > TASK_MAX_NS / per_tile) ct = TASK_MAX_NS / per_tile;
    if (ct < least) ct = least;
    if (ct > tiles) ct = tiles;
    j.ct = ct;
    /* a decode GEMV's one row group (more rows are compute-bound): a nibble form, or an LM head */
    j.pf = m <= MR && ((form != 8 && form != FORM_Q8S) || (head_prefetch && tiles >= HEAD_TILES));
    chunks = (tiles + ct - 1) / ct;
    mstar_parallel_for_n((int)(chunks * j.nrb), threads, gemm_task, &j);
    return 0;
}

#else
void mstar_qgemm_set_head_prefetch(int on) { (void)on; }

int mstar_qlinear(int form, int xbytes, const float *x, int64_t m, int64_t k, int64_t lda, const void *w,
                  const void *d, const void *mn, int64_t n, const float *bias, float *out, int64_t ldc, int threads,
                  void *scratch) {
    (void)form; (void)xbytes; (void)x; (void)m; (void)k; (void)lda; (void)w; (void)d; (void)mn; (void)n; (void)bias;
    (void)out; (void)ldc; (void)threads; (void)scratch;
    return -1;
}
#endif
