/* A driver for the CPU kernels (services/gpu_worker/kernels) where Python cannot load them:
 * tests/unit/test_kernels_aarch64.py cross-compiles the kernels and this file for aarch64 and
 * runs it under qemu-user, so the Arm build is compiled and its results checked on any x86
 * machine (CI's), not only on an Arm host.
 *
 * Usage: driver IN OUT. IN is a sequence of calls, each (all integers int64, little-endian):
 *   name length, name bytes (a kernel entry point without its mstar_ prefix, or a pool op);
 *   buffer count, then per buffer its byte count and bytes (an empty buffer is passed as NULL);
 *   int count, the ints; float count, the floats (as float64).
 * For each call OUT gets: the entry point's return value (int64; 0 for a void one), the
 * buffer count, then every buffer as it is after the call (byte count and bytes): the
 * kernels write their outputs into buffers they are given, some in place.
 *
 * Arguments go in the order of the entry point's C signature, buffers and ints each in their
 * own order (see dispatch()); scratch a kernel needs is allocated here, as the Python callers
 * do, from the kernel's own size function. An unknown name or a wrong argument count exits
 * with status 2 and a message: the test and this file disagree.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* the entry points (their definitions: the .c files of services/gpu_worker/kernels; their ctypes
 * declarations: services/gpu_worker/cpu_kernels.py) */
void mstar_rms_norm(const float *x, int64_t x_stride, const float *w, float eps, float *out, int64_t rows,
                    int64_t dim);
void mstar_head_norm(float *x, int64_t x_stride, int64_t rows, int64_t heads, int64_t d, const float *w, float eps);
void mstar_rope(float *x, int64_t x_stride, int64_t rows, int64_t heads, int64_t d, const float *cos,
                const float *sin_signed, int64_t tab_stride);
void mstar_silu_mul(const float *gu, int64_t gu_stride, int64_t inter, float *out, int64_t rows);
void mstar_gelu_mul(const float *gu, int64_t gu_stride, int64_t inter, float *out, int64_t rows);
void mstar_write_kv(float *cache, const float *k, int64_t k_stride, const float *v, int64_t v_stride,
                    const int64_t *slot_pages, const int64_t *slot_offsets, int64_t n, int64_t row, int64_t page_size);
void mstar_write_kv_bf16(uint16_t *cache, const float *k, int64_t k_stride, const float *v, int64_t v_stride,
                         const int64_t *slot_pages, const int64_t *slot_offsets, int64_t n, int64_t row,
                         int64_t page_size);
void mstar_write_kv_i8(int8_t *cache, const float *k, int64_t k_stride, const float *v, int64_t v_stride,
                       const int64_t *slot_pages, const int64_t *slot_offsets, int64_t n, int64_t row, int64_t d,
                       int64_t page_size);
int64_t mstar_paged_decode_scratch(int64_t n_rows, int64_t hq, int64_t d, int64_t max_keys);
int mstar_paged_decode(const float *q, int64_t q_stride, const float *cache, const int64_t *pages, int64_t width,
                       const int64_t *qrow, const int64_t *entry, const int64_t *lo, const int64_t *hi, int64_t n_rows,
                       int64_t hq, int64_t hkv, int64_t d, int64_t page_size, float scale, float *out, float *scratch,
                       int64_t max_keys);
int mstar_paged_decode_bf16(const float *q, int64_t q_stride, const uint16_t *cache, const int64_t *pages,
                            int64_t width, const int64_t *qrow, const int64_t *entry, const int64_t *lo,
                            const int64_t *hi, int64_t n_rows, int64_t hq, int64_t hkv, int64_t d, int64_t page_size,
                            float scale, float *out, float *scratch, int64_t max_keys);
int mstar_paged_decode_i8(const float *q, int64_t q_stride, const int8_t *cache, const int64_t *pages, int64_t width,
                          const int64_t *qrow, const int64_t *entry, const int64_t *lo, const int64_t *hi,
                          int64_t n_rows, int64_t hq, int64_t hkv, int64_t d, int64_t page_size, float scale,
                          float *out, float *scratch, int64_t max_keys);
int mstar_prefill_attention(const float *q, int64_t q_stride, const void *cache, int64_t kind, const int64_t *pages,
                            int64_t q_len, int64_t kv_len, int64_t hq, int64_t hkv, int64_t d, int64_t page_size,
                            int64_t window, float scale, float *out, int64_t out_stride);
int64_t mstar_gemm_nr(void);
void mstar_gemm_pack(const float *w, int64_t n, int64_t k, float *packed);
void mstar_gemm_unpack(const float *packed, int64_t n, int64_t k, float *w);
int mstar_gemm(const float *x, int64_t m, int64_t k, int64_t ldx, const float *packed, int64_t n, const float *bias,
               float *out, int64_t ldo);
int64_t mstar_qgemm_available(void);
int64_t mstar_qlinear_scratch(int64_t m, int64_t k);
int mstar_qlinear(int form, int xbytes, const float *x, int64_t m, int64_t k, int64_t lda, const void *w,
                  const void *d, const void *mn, int64_t n, const float *bias, float *out, int64_t ldc, int threads,
                  void *scratch);
int mstar_qrows(int form, const uint8_t *w, const void *d, const void *mn, int64_t n, int64_t k, const int64_t *ids,
                int64_t n_ids, float *out, int64_t ldo);
int mstar_pool_threads(void);
void mstar_pool_set_threads(int threads);
int64_t mstar_pool_check(int jobs, int ntasks, int threads);

#define MAX_ARGS 32

typedef struct {
    char name[64];
    int nb, ni, nf;
    void *b[MAX_ARGS];
    int64_t bn[MAX_ARGS];
    int64_t i[MAX_ARGS];
    double f[MAX_ARGS];
} Call;

static void die(const char *what, const char *name) {
    fprintf(stderr, "driver: %s%s%s\n", what, name ? ": " : "", name ? name : "");
    exit(2);
}

static int64_t read_i64(FILE *in, int *eof) {
    int64_t v;
    if (fread(&v, sizeof v, 1, in) != 1) {
        if (eof) {
            *eof = 1;
            return 0;
        }
        die("truncated input", NULL);
    }
    return v;
}

static int64_t count(FILE *in) {
    const int64_t n = read_i64(in, NULL);
    if (n < 0 || n > MAX_ARGS) die("bad argument count", NULL);
    return n;
}

/* one call from `in` (0 at the end of the file) */
static int read_call(FILE *in, Call *c) {
    int eof = 0;
    const int64_t len = read_i64(in, &eof);
    if (eof) return 0;
    if (len <= 0 || len >= (int64_t)sizeof c->name) die("bad name length", NULL);
    memset(c->name, 0, sizeof c->name);
    if (fread(c->name, 1, (size_t)len, in) != (size_t)len) die("truncated name", NULL);
    c->nb = (int)count(in);
    for (int k = 0; k < c->nb; k++) {
        c->bn[k] = read_i64(in, NULL);
        if (c->bn[k] < 0) die("bad buffer size", c->name);
        c->b[k] = NULL;
        if (c->bn[k] == 0) continue;
        /* 64-byte aligned, as torch's CPU allocator gives the Python callers */
        c->b[k] = aligned_alloc(64, (size_t)((c->bn[k] + 63) / 64 * 64));
        if (!c->b[k]) die("out of memory", c->name);
        if (fread(c->b[k], 1, (size_t)c->bn[k], in) != (size_t)c->bn[k]) die("truncated buffer", c->name);
    }
    c->ni = (int)count(in);
    for (int k = 0; k < c->ni; k++) c->i[k] = read_i64(in, NULL);
    c->nf = (int)count(in);
    for (int k = 0; k < c->nf; k++)
        if (fread(&c->f[k], sizeof(double), 1, in) != 1) die("truncated float", c->name);
    return 1;
}

static void want(const Call *c, int nb, int ni, int nf) {
    if (c->nb != nb || c->ni != ni || c->nf != nf) die("wrong argument counts for", c->name);
}

#define IS(s) (strcmp(c->name, s) == 0)
#define B(k) (c->b[k])
#define I(k) (c->i[k])
#define F(k) ((float)c->f[k])

/* the call's entry point on its arguments; its return value */
static int64_t dispatch(Call *c) {
    if (IS("rms_norm")) { /* x, w, out; x_stride, rows, dim; eps */
        want(c, 3, 3, 1);
        mstar_rms_norm(B(0), I(0), B(1), F(0), B(2), I(1), I(2));
        return 0;
    }
    if (IS("head_norm")) { /* x, w; x_stride, rows, heads, d; eps */
        want(c, 2, 4, 1);
        mstar_head_norm(B(0), I(0), I(1), I(2), I(3), B(1), F(0));
        return 0;
    }
    if (IS("rope")) { /* x, cos, sin_signed; x_stride, rows, heads, d, tab_stride */
        want(c, 3, 5, 0);
        mstar_rope(B(0), I(0), I(1), I(2), I(3), B(1), B(2), I(4));
        return 0;
    }
    if (IS("silu_mul") || IS("gelu_mul")) { /* gu, out; gu_stride, inter, rows */
        want(c, 2, 3, 0);
        (IS("silu_mul") ? mstar_silu_mul : mstar_gelu_mul)(B(0), I(0), I(1), B(1), I(2));
        return 0;
    }
    if (IS("write_kv") || IS("write_kv_bf16")) { /* cache, k, v, slot_pages, slot_offsets; k_stride, v_stride, n,
                                                  * row, page_size */
        want(c, 5, 5, 0);
        if (IS("write_kv"))
            mstar_write_kv(B(0), B(1), I(0), B(2), I(1), B(3), B(4), I(2), I(3), I(4));
        else
            mstar_write_kv_bf16(B(0), B(1), I(0), B(2), I(1), B(3), B(4), I(2), I(3), I(4));
        return 0;
    }
    if (IS("write_kv_i8")) { /* as write_kv; k_stride, v_stride, n, row, d, page_size */
        want(c, 5, 6, 0);
        mstar_write_kv_i8(B(0), B(1), I(0), B(2), I(1), B(3), B(4), I(2), I(3), I(4), I(5));
        return 0;
    }
    if (IS("paged_decode") || IS("paged_decode_bf16") || IS("paged_decode_i8")) {
        /* q, cache, pages, qrow, entry, lo, hi, out; q_stride, width, n_rows, hq, hkv, d, page_size, max_keys;
         * scale */
        want(c, 8, 8, 1);
        const int64_t floats = mstar_paged_decode_scratch(I(2), I(3), I(5), I(7));
        float *scratch = aligned_alloc(64, (size_t)((floats * 4 + 63) / 64 * 64));
        if (!scratch) die("out of memory", c->name);
        int rc;
        if (IS("paged_decode"))
            rc = mstar_paged_decode(B(0), I(0), B(1), B(2), I(1), B(3), B(4), B(5), B(6), I(2), I(3), I(4), I(5),
                                    I(6), F(0), B(7), scratch, I(7));
        else if (IS("paged_decode_bf16"))
            rc = mstar_paged_decode_bf16(B(0), I(0), B(1), B(2), I(1), B(3), B(4), B(5), B(6), I(2), I(3), I(4),
                                         I(5), I(6), F(0), B(7), scratch, I(7));
        else
            rc = mstar_paged_decode_i8(B(0), I(0), B(1), B(2), I(1), B(3), B(4), B(5), B(6), I(2), I(3), I(4), I(5),
                                       I(6), F(0), B(7), scratch, I(7));
        free(scratch);
        return rc;
    }
    if (IS("prefill_attention")) { /* q, cache, pages, out; q_stride, kind, q_len, kv_len, hq, hkv, d, page_size,
                                    * window, out_stride; scale */
        want(c, 4, 10, 1);
        return mstar_prefill_attention(B(0), I(0), B(1), I(1), B(2), I(2), I(3), I(4), I(5), I(6), I(7), I(8), F(0),
                                       B(3), I(9));
    }
    if (IS("gemm_nr")) {
        want(c, 0, 0, 0);
        return mstar_gemm_nr();
    }
    if (IS("gemm_pack") || IS("gemm_unpack")) { /* src, dst; n, k */
        want(c, 2, 2, 0);
        (IS("gemm_pack") ? mstar_gemm_pack : mstar_gemm_unpack)(B(0), I(0), I(1), B(1));
        return 0;
    }
    if (IS("gemm")) { /* x, packed, bias (empty: none), out; m, k, ldx, n, ldo */
        want(c, 4, 5, 0);
        return mstar_gemm(B(0), I(0), I(1), I(2), B(1), I(3), B(2), B(3), I(4));
    }
    if (IS("qgemm_available")) {
        want(c, 0, 0, 0);
        return mstar_qgemm_available();
    }
    if (IS("qlinear")) { /* x, w, d, m (empty: none), bias (empty: none), out; form, xbytes, m, k, lda, n, ldc,
                          * threads */
        want(c, 6, 8, 0);
        void *scratch = aligned_alloc(64, (size_t)((mstar_qlinear_scratch(I(2), I(3)) + 63) / 64 * 64));
        if (!scratch) die("out of memory", c->name);
        const int rc = mstar_qlinear((int)I(0), (int)I(1), B(0), I(2), I(3), I(4), B(1), B(2), B(3), I(5), B(4),
                                     B(5), I(6), (int)I(7), scratch);
        free(scratch);
        return rc;
    }
    if (IS("qrows")) { /* w, d, m (empty: none), ids, out; form, n, k, n_ids, ldo */
        want(c, 5, 5, 0);
        return mstar_qrows((int)I(0), B(0), B(1), B(2), I(1), I(2), B(3), I(3), B(4), I(4));
    }
    if (IS("pool_set_threads")) { /* ; threads */
        want(c, 0, 1, 0);
        mstar_pool_set_threads((int)I(0));
        return mstar_pool_threads();
    }
    if (IS("pool_check")) { /* ; jobs, ntasks, threads */
        want(c, 0, 3, 0);
        return mstar_pool_check((int)I(0), (int)I(1), (int)I(2));
    }
    die("unknown call", c->name);
    return 0;
}

static void write_all(FILE *out, const void *p, size_t n) {
    if (n && fwrite(p, 1, n, out) != n) die("write failed", NULL);
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s IN OUT\n", argv[0]);
        return 2;
    }
    FILE *in = fopen(argv[1], "rb"), *out = fopen(argv[2], "wb");
    if (!in || !out) die("cannot open", !in ? argv[1] : argv[2]);
    Call c;
    while (read_call(in, &c)) {
        const int64_t rc = dispatch(&c), nb = c.nb;
        write_all(out, &rc, sizeof rc);
        write_all(out, &nb, sizeof nb);
        for (int k = 0; k < c.nb; k++) {
            write_all(out, &c.bn[k], sizeof c.bn[k]);
            write_all(out, c.b[k], (size_t)c.bn[k]);
            free(c.b[k]);
        }
    }
    fclose(in);
    return fclose(out) == 0 ? 0 : 1;
}
