/* A decode step's whole layer stack in one call (and a step with short prompt chunks beside
 * its decode rows), for a Llama-shaped decoder whose GEMMs are C kernels: quantized GGUF
 * weights (qgemm.c) or float32 in the packed panels of gemm.c
 * (services/gpu_worker/modeling/cpu_stack.py decides when it applies).
 *
 * Why: on the CPU a one-row decode step of a small model is mostly the per-op cost around
 * the kernels (a torch module call, a ctypes call, a fresh tensor per op: about a dozen per
 * layer), not the kernels. Here the same kernels run in the same order on the same inputs
 * as the torch modules' path (modeling/decoder_lm.py on the CPU): RMSNorm, the fused q/k/v
 * GEMM, RoPE in place on q and k, the K/V rows into their pages, paged decode attention,
 * the o GEMM, the residual add, RMSNorm, the gate/up GEMM, silu * up, the down GEMM, the
 * residual add. So the result is bitwise the modules' (tests/unit/test_cpu_stack.py), only
 * the Python around the kernels is gone. The residual add is o + x, as the modules'
 * `o.add_(x)` (float addition commutes bitwise).
 *
 * Built at first use by services/gpu_worker/cpu_kernels.py with the other kernels.
 */
#include <stddef.h>
#include <stdint.h>

#include "pool.h"

/* the kernels it chains (elementwise.c, qgemm.c, paged_attention.c) */
void mstar_rms_norm(const float *x, int64_t x_stride, const float *w, float eps, float *out, int64_t rows,
                    int64_t dim);
void mstar_rope(float *x, int64_t x_stride, int64_t rows, int64_t heads, int64_t d, const float *cos,
                const float *sin_signed, int64_t tab_stride);
void mstar_silu_mul(const float *gu, int64_t gu_stride, int64_t inter, float *out, int64_t rows);
void mstar_gelu_mul(const float *gu, int64_t gu_stride, int64_t inter, float *out, int64_t rows);
void mstar_head_norm(float *x, int64_t x_stride, int64_t rows, int64_t heads, int64_t d, const float *w, float eps);
int mstar_qlinear(int form, int xbytes, const float *x, int64_t m, int64_t k, int64_t lda, const void *w,
                  const void *d, const void *mn, int64_t n, const float *bias, float *out, int64_t ldc, int threads,
                  void *scratch);
int mstar_qrows(int form, const uint8_t *w, const void *d, const void *mn, int64_t n, int64_t k, const int64_t *ids,
                int64_t n_ids, float *out, int64_t ldo);
int mstar_gemm(const float *x, int64_t m, int64_t k, int64_t ldx, const float *packed, int64_t n,
               const float *bias, float *out, int64_t ldo);
int mstar_gemm_silu(const float *x, int64_t m, int64_t k, int64_t ldx, const float *packed, int64_t inter,
                    float *out, int64_t ldo);
int mstar_paged_decode(const float *q, int64_t q_stride, const float *cache, const int64_t *pages, int64_t width,
                       const int64_t *qrow, const int64_t *entry, const int64_t *lo, const int64_t *hi, int64_t n_rows,
                       int64_t hq, int64_t hkv, int64_t d, int64_t page_size, float scale, float *out, float *scratch,
                       int64_t max_keys);
int mstar_paged_decode_bf16(const float *q, int64_t q_stride, const uint16_t *cache, const int64_t *pages,
                            int64_t width, const int64_t *qrow, const int64_t *entry, const int64_t *lo,
                            const int64_t *hi, int64_t n_rows, int64_t hq, int64_t hkv, int64_t d, int64_t page_size,
                            float scale, float *out, float *scratch, int64_t max_keys);
void mstar_write_kv_bf16(uint16_t *cache, const float *k, int64_t k_stride, const float *v, int64_t v_stride,
                         const int64_t *slot_pages, const int64_t *slot_offsets, int64_t n, int64_t row,
                         int64_t page_size);
int mstar_paged_decode_i8(const float *q, int64_t q_stride, const int8_t *cache, const int64_t *pages, int64_t width,
                          const int64_t *qrow, const int64_t *entry, const int64_t *lo, const int64_t *hi,
                          int64_t n_rows, int64_t hq, int64_t hkv, int64_t d, int64_t page_size, float scale,
                          float *out, float *scratch, int64_t max_keys);
void mstar_write_kv_i8(int8_t *cache, const float *k, int64_t k_stride, const float *v, int64_t v_stride,
                       const int64_t *slot_pages, const int64_t *slot_offsets, int64_t n, int64_t row, int64_t d,
                       int64_t page_size);
void mstar_write_kv(float *cache, const float *k, int64_t k_stride, const float *v, int64_t v_stride,
                    const int64_t *slot_pages, const int64_t *slot_offsets, int64_t n, int64_t row, int64_t page_size);
int mstar_moe_route(const float *logits, int64_t t, int64_t n, int64_t k, int kind, float *weights, int64_t *ids);
void mstar_clamped_swiglu(const float *gu, int64_t gu_stride, int64_t inter, float alpha, float limit, float *out,
                          int64_t rows);
int mstar_paged_decode_sinks(int64_t kind, const float *q, int64_t q_stride, const void *cache, const int64_t *pages,
                             int64_t width, const int64_t *qrow, const int64_t *entry, const int64_t *lo,
                             const int64_t *hi, int64_t n_rows, int64_t hq, int64_t hkv, int64_t d, int64_t page_size,
                             float scale, float *out, float *scratch, int64_t max_keys, const float *sinks);
int mstar_causal_conv(const float *x, int64_t x_stride, int64_t c, float *state, int64_t slot_stride, int64_t k,
                      const float *weight, const int64_t *meta, int64_t b, float *out);
int mstar_gated_delta(const float *q, int64_t q_stride, const float *k, int64_t k_stride, const float *v,
                      int64_t v_stride, const float *g, int64_t g_stride, const float *beta, int64_t beta_stride,
                      int64_t hk, int64_t hv, int64_t dk, int64_t dv, float *state, int64_t slot_stride,
                      const int64_t *meta, int64_t b, float *out);
void mstar_gated_rms_norm(const float *x, int64_t x_stride, const float *z, int64_t z_stride, const float *w,
                          float eps, float *out, int64_t rows, int64_t dim);
void mstar_rope_partial(float *x, int64_t x_stride, int64_t rows, int64_t heads, int64_t head_stride, int64_t rot,
                        const float *cos, const float *sin_signed, int64_t tab_stride);
void mstar_sigmoid_gate(float *o, int64_t rows, int64_t heads, int64_t d, const float *g, int64_t g_stride,
                        int64_t g_head);
void mstar_sigmoid(const float *x, int64_t n, float *out);
void mstar_gdn_gates(const float *b, const float *a, int64_t stride, int64_t rows, int64_t heads,
                     const float *dt_bias, const float *neg_a, float *beta, float *g);
int mstar_prefill_attention_sinks(const float *q, int64_t q_stride, const void *cache, int64_t kind,
                                  const int64_t *pages, int64_t q_len, int64_t kv_len, int64_t hq, int64_t hkv,
                                  int64_t d, int64_t page_size, int64_t window, float scale, float *out,
                                  int64_t out_stride, const float *sinks, int64_t key_base);

/* One GEMM's weight. form 4, 5, 6, 8, 9 or 16, with qgemm.c's HALF_SCALES or SUPER_SCALES flag
 * or neither: a quantized one (layers/quant.py QuantLinear: tiled w, d, m (float16, float32
 * or super-block blobs), bias); GEMM_F32:
 * float32 packed panels in w (layers/linear.py KernelLinear, with bias); GEMM_F32_SILU: the
 * MLP's gate/up panels with silu * up in the epilogue (KernelGateUpSilu; n is inter, its
 * output is the activation). */
#define GEMM_F32 32
#define GEMM_F32_SILU 33
typedef struct {
    int64_t form, k, n;
    const void *w, *d, *m;
    const float *bias;
} MstarQWeight;

/* One layer: its norms, its four GEMMs and its KV tensor [P, 2, page_size, hkv, d]
 * (float32, or bfloat16 / int8 where the shape's kv_kind says so). q_norm, k_norm (Gemma 3,
 * Qwen3; else NULL): over each head. ln3 / ln4 (Gemma 3's sandwich norms; else NULL): the
 * norms before and after the MLP, and then ln2 is the norm of the attention's output. `step`: which of the call's steps
 * (its metadata and RoPE tables) the layer reads: 0 full attention, 1 sliding window. */
/* A mixture-of-experts block in place of a layer's MLP (layers/moe.py SparseMoE without a
 * shared expert: Qwen3-MoE, Mixtral; layers/gpt_oss_moe.py GptOssMoE): the router's GEMM,
 * mstar_moe_route (`route`: its kind), then each active expert's gate/up GEMM (GEMM_F32_SILU
 * with silu * up in its epilogue, or [gate | up] then the activation: silu * up, or with
 * `clamped` gpt-oss's clamped SwiGLU of `alpha` and `limit`) and down GEMM over its rows
 * (biases in the GEMMs' epilogues), weighted and added in ascending expert order
 * (moe_block). gate_up and down: one weight per expert; at most 1024 experts (moe_route.c). */
typedef struct {
    int64_t n_experts, top_k, inter, route, clamped;
    float alpha, limit;
    MstarQWeight router;
    const MstarQWeight *gate_up, *down;
    /* a shared expert every row takes (Qwen3.5-MoE, Qwen3-Next; shared_down.w NULL: none):
     * its MLP (gate/up as the dense MLP's, up to 2 parts; width shared_inter) times
     * sigmoid(shared_gate(h)) [t, 1], added after the routed experts (shared_expert_add) */
    int64_t shared_inter;
    MstarQWeight shared_gate_up[2], shared_down, shared_gate;
} MstarMoE;

/* A Gated DeltaNet layer (modeling/hybrid/qwen3_5.py GatedDeltaNet) in place of the
 * attention: in_proj (qkv | z | b | a columns, z, b and a from z_at, b_at, a_at of its
 * `width` columns; up to 4 parts as QuantParts), the causal conv over each request's window
 * (mstar_causal_conv), the gates (mstar_gdn_gates), the gated delta rule on the recurrent
 * state (mstar_gated_delta), the gated RMSNorm per value head, out_proj. The layer's `cache`
 * is its state pool [slots, slot_stride]: each slot the conv window [K-1, conv_dim], then
 * the state [hv, dk, dv]; the step's `states` say which slot each request's rows use. */
typedef struct {
    int64_t hk, hv, dk, dv, conv_k, conv_dim, z_at, b_at, a_at, width, slot_stride;
    MstarQWeight in_proj[4], out;
    const float *conv_w, *dt_bias, *neg_a, *norm_w;
} MstarGdn;

typedef struct {
    const float *ln1, *ln2;
    /* qkv[1..2] and gate_up[1]: where the GEMM is split (layers/quant.py QuantParts: parts of
     * forms that do not concatenate), the parts after the first, each into its column range;
     * w NULL otherwise */
    MstarQWeight qkv[3], o, gate_up[2], down;
    void *cache;
    const float *q_norm, *k_norm, *ln3, *ln4;
    int64_t step;
    const MstarMoE *moe; /* NULL: the dense MLP (gate_up, down) */
    const float *sinks;  /* gpt-oss's attention sinks [hq], or NULL */
    const MstarGdn *gdn; /* a linear-attention layer (its mixer in place of the attention), or NULL */
    /* Qwen3.5's gated attention (GatedAttention): q_proj writes q and an output gate per head
     * ([q_h | gate_h]), q and k normed per head, RoPE on the first `rotary` of each head, the
     * output times sigmoid(gate) before o; 0: a plain layer */
    int64_t rotary;
} MstarLayer;

/* The shapes every layer shares; kv_kind: the pages' type, 0 float32, 1 bfloat16, 2 int8
 * (paged_attention.c's plain, _bf16 and _i8 kernels, as attention.py picks them for such a
 * pool). */
typedef struct {
    int64_t n_layers, hidden, hq, hkv, d, inter, page_size, kv_kind;
    float eps, scale;
    int64_t gelu; /* the MLP's activation: gelu_tanh (Gemma), else silu */
    int64_t n_experts, top_k; /* the widest mixture of experts' (0 where no layer has one); inter is the
                               * widest MLP's or expert's */
    int64_t extra;            /* floats per row a hybrid's layers need beyond these (0 elsewhere) */
} MstarStackShape;

/* The step: T rows of one label, its decode query rows (the metadata's decode_query columns
 * qrow, entry, lo, hi; pages [B, width]) and its prompt chunks (chunks [n_chunks, 4]: first
 * row, end row, keys held, and where in `chunk_pages` the chunk's pages start; each a plain
 * causal chunk, under `window` when not 0); rope tables [T, d], or with `positions` [T] the
 * whole tables [positions, d] (row r reads table row positions[r]: the same values the
 * gathered rows hold). A call takes one per kind of layer (full attention; sliding window,
 * whose label and RoPE are its own). */
typedef struct {
    int64_t rows;
    const float *cos, *sin_signed;
    const int64_t *slot_pages, *slot_offsets;
    const int64_t *pages;
    int64_t width;
    const int64_t *qrow, *entry, *lo, *hi;
    int64_t n_query, max_keys;
    const int64_t *positions;
    const int64_t *chunks, *chunk_pages;
    int64_t n_chunks, window;
    const int64_t *states; /* a linear layers' step: per request (first row, end row, slot, fresh) [n_states, 4] */
    int64_t n_states;
} MstarDecodeStep;

/* What a whole decode forward adds around the layers (mstar_decode_model): the token
 * embedding (embed.form 0: a float32 table [n, k]; else a quantized table, rows as
 * mstar_qrows dequantizes them), times embed_scale where it is not 1 (Gemma); the final
 * norm of the rows that sample, and the LM head on them into logits [n_sample, head.n]. */
typedef struct {
    MstarQWeight embed;
    float embed_scale;
    const int64_t *ids;
    const float *norm;
    MstarQWeight head;
    const int64_t *sample_rows;
    int64_t n_sample;
    float *logits;
} MstarModelEnds;

/* floats of workspace the stack needs for `rows` rows (the caller also passes the
 * quantized GEMMs' scratch, mstar_qlinear_scratch(rows, max k), and the attention's,
 * mstar_paged_decode_scratch(rows, hq, d, max_keys) floats) */
int64_t mstar_stack_workspace(const MstarStackShape *s, int64_t rows) {
    const int64_t nqkv = (s->hq + 2 * s->hkv) * s->d;
    /* a mixture's (moe_block): each row's k ids and an expert's rows (int64s, 2 floats each,
     * after a float of slack to align them), the router's logits, each row's k weights, an
     * expert's rows' weights, its gathered rows and their outputs */
    const int64_t moe = s->n_experts ? 1 + rows * (2 * s->top_k + 2 + s->n_experts + s->top_k + 1 + 2 * s->hidden) : 0;
    return rows * (s->hidden + nqkv + s->hq * s->d + s->hidden + 2 * s->inter + s->inter + s->extra) + moe;
}

/* out [t, hidden] += weight * y for one expert's rows (`rows` [n] of out, y [n, hidden]): the
 * product rounded, then added (as torch's `y * w` then `index_add_`; no fused multiply-add) */
__attribute__((optimize("fp-contract=off"))) static void add_weighted(float *out, int64_t hid, const int64_t *rows,
                                                                      const float *w, const float *y, int64_t n) {
    for (int64_t j = 0; j < n; j++) {
        float *o = out + rows[j] * hid;
        const float *yj = y + j * hid, wj = w[j];
        for (int64_t i = 0; i < hid; i++) o[i] = o[i] + yj[i] * wj;
    }
}

/* out [t, hidden] += sg[r] * y[r] per row (SparseMoE.forward's `out + sigmoid(gate(x)) *
 * shared(x)`, sg the sigmoid: the product rounded, then added). */
__attribute__((optimize("fp-contract=off"))) static void shared_expert_add(float *out, int64_t hid, int64_t t,
                                                                           const float *sg, const float *y) {
    for (int64_t r = 0; r < t; r++)
        for (int64_t i = 0; i < hid; i++) out[r * hid + i] = out[r * hid + i] + sg[r] * y[r * hid + i];
}

static void add_into(float *x, const float *o, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) x[i] = o[i] + x[i];
}

/* One layer's attention: the decode query rows in one kernel call, which splits the rows and
 * their key partitions over the pool's threads itself (the same bits on any count); then each
 * prompt chunk through the prefill kernel, as attention.py's `_prefill_kernel` calls it. */
static int attention(const MstarStackShape *s, const MstarDecodeStep *st, const float *qkv, int64_t nqkv,
                     const void *cache, const float *sinks, float *out, float *scratch) {
    const int64_t hd = s->hq * s->d;
    for (int64_t c = 0; c < st->n_chunks; c++) {
        const int64_t *ch = st->chunks + 5 * c;
        if (mstar_prefill_attention_sinks(qkv + ch[0] * nqkv, nqkv, cache, s->kv_kind, st->chunk_pages + ch[3],
                                          ch[1] - ch[0], ch[2], s->hq, s->hkv, s->d, s->page_size, st->window,
                                          s->scale, out + ch[0] * hd, hd, sinks, ch[4]))
            return -2;
    }
    if (!st->n_query) return 0;
    if (sinks) /* (the module's path: this kernel with sinks, the plain ones without) */
        return mstar_paged_decode_sinks(s->kv_kind, qkv, nqkv, cache, st->pages, st->width, st->qrow, st->entry,
                                        st->lo, st->hi, st->n_query, s->hq, s->hkv, s->d, s->page_size, s->scale, out,
                                        scratch, st->max_keys, sinks);
    if (s->kv_kind == 2)
        return mstar_paged_decode_i8(qkv, nqkv, (const int8_t *)cache, st->pages, st->width, st->qrow, st->entry,
                                     st->lo, st->hi, st->n_query, s->hq, s->hkv, s->d, s->page_size, s->scale, out,
                                     scratch, st->max_keys);
    if (s->kv_kind == 1)
        return mstar_paged_decode_bf16(qkv, nqkv, (const uint16_t *)cache, st->pages, st->width, st->qrow, st->entry,
                                       st->lo, st->hi, st->n_query, s->hq, s->hkv, s->d, s->page_size, s->scale, out,
                                       scratch, st->max_keys);
    return mstar_paged_decode(qkv, nqkv, (const float *)cache, st->pages, st->width, st->qrow, st->entry, st->lo,
                              st->hi, st->n_query, s->hq, s->hkv, s->d, s->page_size, s->scale, out, scratch,
                              st->max_keys);
}

static int qgemm_ld(const MstarQWeight *w, const float *x, int64_t m, float *out, int64_t ldo, int threads,
                    void *qscratch) {
    if (w->form == GEMM_F32) return mstar_gemm(x, m, w->k, w->k, (const float *)w->w, w->n, w->bias, out, ldo);
    if (w->form == GEMM_F32_SILU) return mstar_gemm_silu(x, m, w->k, w->k, (const float *)w->w, w->n, out, ldo);
    return mstar_qlinear((int)w->form, 2, x, m, w->k, w->k, w->w, w->d, w->m, w->n, w->bias, out, ldo, threads,
                         qscratch);
}

static int qgemm(const MstarQWeight *w, const float *x, int64_t m, float *out, int threads, void *qscratch) {
    return qgemm_ld(w, x, m, out, w->n, threads, qscratch);
}

static int qgemm_parts(const MstarQWeight *w, int parts, const float *x, int64_t m, float *out, int threads,
                       void *qscratch);

/* A mixture-of-experts block on h [t, hidden] into out [t, hidden] (zeroed here), as
 * layers/moe.py computes it: the router, mstar_moe_route, then for each expert in ascending
 * order its rows (by top-k place, then row) gathered, its two GEMMs, and each row's weighted
 * output added into out. mw: the workspace's mixture part (mstar_stack_workspace); gu, act:
 * the MLP's buffers. Returns 0 or a GEMM's -1. */
static int moe_block(const MstarStackShape *s, const MstarMoE *m, const float *h, int64_t t, float *out, float *gu,
                     float *act, float *mw, int threads, void *qscratch) {
    const int64_t hid = s->hidden, n = m->n_experts, k = m->top_k;
    int64_t *ids = (int64_t *)(mw + ((uintptr_t)mw / sizeof(float)) % 2), *rows = ids + t * k; /* (an expert's: <= t) */
    float *logits = (float *)(rows + t), *weights = logits + t * n, *pw = weights + t * k, *xg = pw + t;
    float *y = xg + t * hid;
    if (qgemm(&m->router, h, t, logits, threads, qscratch)) return -1;
    if (mstar_moe_route(logits, t, n, k, (int)m->route, weights, ids)) return -1;
    for (int64_t i = 0; i < t * hid; i++) out[i] = 0.f;
    for (int64_t e = 0; e < n; e++) {
        int64_t cnt = 0;
        for (int64_t j = 0; j < k; j++)
            for (int64_t r = 0; r < t; r++)
                if (ids[r * k + j] == e) {
                    rows[cnt] = r;
                    pw[cnt] = weights[r * k + j];
                    for (int64_t i = 0; i < hid; i++) xg[cnt * hid + i] = h[r * hid + i];
                    cnt++;
                }
        if (!cnt) continue;
        const MstarQWeight *gw = m->gate_up + e;
        if (gw->form == GEMM_F32_SILU) {
            if (qgemm(gw, xg, cnt, act, threads, qscratch)) return -1;
        } else {
            if (qgemm(gw, xg, cnt, gu, threads, qscratch)) return -1;
            if (m->clamped)
                mstar_clamped_swiglu(gu, 2 * m->inter, m->inter, m->alpha, m->limit, act, cnt);
            else
                mstar_silu_mul(gu, 2 * m->inter, m->inter, act, cnt);
        }
        if (qgemm(m->down + e, act, cnt, y, threads, qscratch)) return -1;
        add_weighted(out, hid, rows, pw, y, cnt);
    }
    if (!m->shared_down.w) return 0;
    if (m->shared_gate_up[0].form == GEMM_F32_SILU) {
        if (qgemm(m->shared_gate_up, h, t, act, threads, qscratch)) return -1;
    } else {
        if (qgemm_parts(m->shared_gate_up, 2, h, t, gu, threads, qscratch)) return -1;
        mstar_silu_mul(gu, 2 * m->shared_inter, m->shared_inter, act, t);
    }
    if (qgemm(&m->shared_down, act, t, y, threads, qscratch) || qgemm(&m->shared_gate, h, t, logits, threads, qscratch))
        return -1;
    mstar_sigmoid(logits, t, logits); /* (the kernel SparseMoE._shared_scale calls) */
    shared_expert_add(out, hid, t, logits, y);
    return 0;
}

/* A GEMM given as up to `parts` weights (w[1..]: NULL where it is one): each part into its
 * column range of out [m, total columns]. */
static int qgemm_parts(const MstarQWeight *w, int parts, const float *x, int64_t m, float *out, int threads,
                       void *qscratch) {
    if (parts < 2 || !w[1].w) return qgemm(w, x, m, out, threads, qscratch);
    int64_t ldo = 0, at = 0;
    for (int p = 0; p < parts && (p == 0 || w[p].w); p++) ldo += w[p].n;
    for (int p = 0; p < parts && (p == 0 || w[p].w); at += w[p].n, p++)
        if (qgemm_ld(w + p, x, m, out + at, ldo, threads, qscratch)) return -1;
    return 0;
}

/* The step's K/V rows (k, v rows `stride` apart) into the layer's pages, by the pages' type. */
static void write_kv(const MstarStackShape *s, const MstarLayer *L, const MstarDecodeStep *st, const float *k,
                     const float *v, int64_t stride, int64_t t) {
    if (s->kv_kind == 2)
        mstar_write_kv_i8((int8_t *)L->cache, k, stride, v, stride, st->slot_pages, st->slot_offsets, t,
                          s->hkv * s->d, s->d, s->page_size);
    else if (s->kv_kind == 1)
        mstar_write_kv_bf16((uint16_t *)L->cache, k, stride, v, stride, st->slot_pages, st->slot_offsets, t,
                            s->hkv * s->d, s->page_size);
    else
        mstar_write_kv((float *)L->cache, k, stride, v, stride, st->slot_pages, st->slot_offsets, t, s->hkv * s->d,
                       s->page_size);
}

/* A plain layer's attention on h [t, hidden] into o [t, hidden]: the q/k/v GEMM, q/k norms
 * (Gemma 3, Qwen3), RoPE, the K/V rows into their pages, the attention, the o GEMM. Returns
 * 0, -1 (the q/k/v GEMM), -2 (a chunk the prefill kernel refused), -3 (the attention), -4
 * (the o GEMM). */
static int plain_attention(const MstarStackShape *s, const MstarLayer *L, const MstarDecodeStep *st, const float *h,
                           int64_t t, float *qkv, float *attn, float *o, float *ascratch, int threads,
                           void *qscratch) {
    const int64_t nqkv = (s->hq + 2 * s->hkv) * s->d;
    if (qgemm_parts(L->qkv, 3, h, t, qkv, threads, qscratch)) return -1;
    if (L->q_norm) {
        mstar_head_norm(qkv, nqkv, t, s->hq, s->d, L->q_norm, s->eps);
        mstar_head_norm(qkv + s->hq * s->d, nqkv, t, s->hkv, s->d, L->k_norm, s->eps);
    }
    if (st->positions)
        for (int64_t r = 0; r < t; r++)
            mstar_rope(qkv + r * nqkv, nqkv, 1, s->hq + s->hkv, s->d, st->cos + st->positions[r] * s->d,
                       st->sin_signed + st->positions[r] * s->d, s->d);
    else
        mstar_rope(qkv, nqkv, t, s->hq + s->hkv, s->d, st->cos, st->sin_signed, s->d);
    write_kv(s, L, st, qkv + s->hq * s->d, qkv + (s->hq + s->hkv) * s->d, nqkv, t);
    const int rc = attention(s, st, qkv, nqkv, L->cache, L->sinks, attn, ascratch);
    if (rc) return rc == -2 ? -2 : -3;
    return qgemm(&L->o, attn, t, o, threads, qscratch) ? -4 : 0;
}

/* Qwen3.5's gated attention (modeling/hybrid/qwen3_5.py GatedAttention, on the C kernels)
 * on h into o: the q(+gate)/k/v GEMM into w [t, 2 hq d + 2 hkv d], q copied out of it into
 * w's next [t, hq d] and RMS-normed per head (the modules' q_norm on q's contiguous copy: the
 * same per-row kernel), k normed in place, RoPE on the first `rotary` of each head, the K/V
 * rows, the attention, times sigmoid(gate), the o GEMM. Codes as plain_attention's. */
static int gated_attention(const MstarStackShape *s, const MstarLayer *L, const MstarDecodeStep *st,
                           const float *h, int64_t t, float *attn, float *o, float *w, float *ascratch, int threads,
                           void *qscratch) {
    const int64_t d = s->d, hq = s->hq, hkv = s->hkv, nqg = 2 * (hq + hkv) * d, rot = L->rotary;
    float *qg = w, *q = w + t * nqg, *k = qg + 2 * hq * d;
    if (qgemm_parts(L->qkv, 3, h, t, qg, threads, qscratch)) return -1;
    for (int64_t r = 0; r < t; r++)
        for (int64_t hh = 0; hh < hq; hh++)
            for (int64_t i = 0; i < d; i++) q[(r * hq + hh) * d + i] = qg[r * nqg + hh * 2 * d + i];
    mstar_head_norm(q, hq * d, t, hq, d, L->q_norm, s->eps);
    mstar_head_norm(k, nqg, t, hkv, d, L->k_norm, s->eps);
    for (int64_t r = 0; r < t; r++) {
        const int64_t p = st->positions ? st->positions[r] : r;
        const float *c = st->cos + p * rot, *sn = st->sin_signed + p * rot;
        mstar_rope_partial(q + r * hq * d, hq * d, 1, hq, d, rot, c, sn, rot);
        mstar_rope_partial(k + r * nqg, nqg, 1, hkv, d, rot, c, sn, rot);
    }
    write_kv(s, L, st, k, k + hkv * d, nqg, t);
    const int rc = attention(s, st, q, hq * d, L->cache, NULL, attn, ascratch);
    if (rc) return rc == -2 ? -2 : -3;
    mstar_sigmoid_gate(attn, t, hq, d, qg + d, nqg, 2 * d);
    return qgemm(&L->o, attn, t, o, threads, qscratch) ? -4 : 0;
}

/* A Gated DeltaNet layer (MstarGdn) on h into o, its state slots updated in place; w: its
 * workspace (in_proj's output, the conv's, beta, g, the rule's output, the normed rows).
 * Codes: -1 (in_proj), -4 (out_proj), -5 (the conv or the rule refusing its shape). */
static int gdn_mixer(const MstarGdn *G, const MstarStackShape *s, float *pool, const MstarDecodeStep *st,
                     const float *h, int64_t t, float *o, float *w, int threads, void *qscratch) {
    const int64_t c = G->conv_dim, kd = G->hk * G->dk, vd = G->hv * G->dv, win = (G->conv_k - 1) * c;
    float *ip = w, *mixed = ip + t * G->width, *beta = mixed + t * c, *g = beta + t * G->hv, *core = g + t * G->hv;
    float *normed = core + t * vd;
    if (qgemm_parts(G->in_proj, 4, h, t, ip, threads, qscratch)) return -1;
    if (mstar_causal_conv(ip, G->width, c, pool, G->slot_stride, G->conv_k, G->conv_w, st->states, st->n_states,
                          mixed))
        return -5;
    mstar_gdn_gates(ip + G->b_at, ip + G->a_at, G->width, t, G->hv, G->dt_bias, G->neg_a, beta, g);
    if (mstar_gated_delta(mixed, c, mixed + kd, c, mixed + 2 * kd, c, g, G->hv, beta, G->hv, G->hk, G->hv, G->dk,
                          G->dv, pool + win, G->slot_stride, st->states, st->n_states, core))
        return -5;
    for (int64_t r = 0; r < t; r++)
        mstar_gated_rms_norm(core + r * vd, G->dv, ip + r * G->width + G->z_at, G->dv, G->norm_w, s->eps,
                             normed + r * vd, G->hv, G->dv);
    return qgemm(&G->out, normed, t, o, threads, qscratch) ? -4 : 0;
}

/* The layer's MLP (dense or a mixture) on h into o. Returns 0 or -1. */
static int mlp_block(const MstarStackShape *s, const MstarLayer *L, const float *h, int64_t t, float *o, float *gu,
                     float *act, float *mw, int threads, void *qscratch) {
    if (L->moe) return moe_block(s, L->moe, h, t, o, gu, act, mw, threads, qscratch);
    if (L->gate_up[0].form == GEMM_F32_SILU) { /* silu * up in the GEMM's epilogue, as KernelGateUpSilu */
        if (qgemm(L->gate_up, h, t, act, threads, qscratch)) return -1;
    } else {
        if (qgemm_parts(L->gate_up, 2, h, t, gu, threads, qscratch)) return -1;
        if (s->gelu)
            mstar_gelu_mul(gu, 2 * s->inter, s->inter, act, t);
        else
            mstar_silu_mul(gu, 2 * s->inter, s->inter, act, t);
    }
    return qgemm(&L->down, act, t, o, threads, qscratch) ? -2 : 0;
}

/* x [rows, hidden] in place through every layer; steps[layer's step] its metadata. Returns 0,
 * or the first kernel's error code (a GEMM's -1 as -10 - layer * 8 - which, the decode
 * attention's as -20000 - layer, a prompt chunk's as -30000 - layer, a linear layer's conv
 * or rule refusing its shape as -14 - layer * 8). The modules' order
 * (modeling/decoder_lm.py): a Llama layer is x += attn(norm1(x)); x += mlp(norm2(x)); a
 * Gemma 3 layer x += norm2(attn(norm1(x))); x += norm4(mlp(norm3(x))), with q and k
 * normalised per head before RoPE; a hybrid's (modeling/hybrid/qwen3_5.py HybridLayer)
 * x += mixer(norm1(x)); x += mlp(norm2(x)), its mixer a Gated DeltaNet or gated attention. */
int mstar_decode_stack(const MstarStackShape *s, const MstarLayer *layers, const MstarDecodeStep *steps, float *x,
                       float *work, void *qscratch, float *ascratch, int threads) {
    const int64_t t = steps[0].rows, hid = s->hidden, nqkv = (s->hq + 2 * s->hkv) * s->d;
    float *h = work, *qkv = h + t * hid, *attn = qkv + t * nqkv, *o = attn + t * s->hq * s->d;
    float *gu = o + t * hid, *act = gu + t * 2 * s->inter, *xw = act + t * s->inter, *mw = xw + t * s->extra;
    for (int64_t l = 0; l < s->n_layers; l++) {
        const MstarLayer *L = layers + l;
        const MstarDecodeStep *st = steps + L->step;
        mstar_rms_norm(x, hid, L->ln1, s->eps, h, t, hid);
        const int rc = L->gdn ? gdn_mixer(L->gdn, s, (float *)L->cache, st, h, t, o, xw, threads, qscratch)
                       : L->rotary ? gated_attention(s, L, st, h, t, attn, o, xw, ascratch, threads, qscratch)
                                   : plain_attention(s, L, st, h, t, qkv, attn, o, ascratch, threads, qscratch);
        if (rc == -1) return (int)(-10 - l * 8);
        if (rc == -2) return (int)(-30000 - l); /* a chunk the prefill kernel refused: nothing is lost */
        if (rc == -3) return (int)(-20000 - l);
        if (rc == -4) return (int)(-11 - l * 8);
        if (rc == -5) return (int)(-14 - l * 8);
        if (L->ln3) {
            mstar_rms_norm(o, hid, L->ln2, s->eps, h, t, hid);
            add_into(x, h, t * hid);
            mstar_rms_norm(x, hid, L->ln3, s->eps, h, t, hid);
        } else {
            add_into(x, o, t * hid);
            mstar_rms_norm(x, hid, L->ln2, s->eps, h, t, hid);
        }
        const int mrc = mlp_block(s, L, h, t, o, gu, act, mw, threads, qscratch);
        if (mrc) return (int)(mrc == -1 ? -12 - l * 8 : -13 - l * 8);
        if (L->ln4) {
            mstar_rms_norm(o, hid, L->ln4, s->eps, h, t, hid);
            add_into(x, h, t * hid);
        } else {
            add_into(x, o, t * hid);
        }
    }
    return 0;
}

/* floats of workspace mstar_decode_model needs: the stack's, the rows' hidden states and the
 * sampled rows' normalised ones */
int64_t mstar_model_workspace(const MstarStackShape *s, int64_t rows, int64_t n_sample) {
    return mstar_stack_workspace(s, rows) + (rows + n_sample) * s->hidden;
}

/* A decode step's whole forward: the embedding of ids [T], every layer (mstar_decode_stack),
 * the final norm of the rows that sample and the LM head, as the modules' path does them
 * (modeling/decoder_lm.py DecoderLM.forward: the same kernels on the same values, so the
 * same bits). Why: each of these was a module call around one kernel, and with the caches
 * cold from the weights each cost 30-90 us of a ~4 ms step. Returns 0, the stack's error
 * code (-30000 - layer: the prefill kernel refused a prompt chunk, and the caller may run the
 * step another way: every K/V row written is the one any path writes), -2 for an id outside
 * the embedding (nothing run), or -3 / -4 for the embedding's / the head's kernel refusing
 * its form. */
int mstar_decode_model(const MstarStackShape *s, const MstarLayer *layers, const MstarDecodeStep *steps,
                       const MstarModelEnds *e, float *work, void *qscratch, float *ascratch, int threads) {
    const int64_t t = steps[0].rows, hid = s->hidden;
    float *x = work + mstar_stack_workspace(s, t), *xs = x + t * hid;
    const MstarQWeight *em = &e->embed;
    if (em->form == 0) {
        for (int64_t r = 0; r < t; r++) {
            if (e->ids[r] < 0 || e->ids[r] >= em->n) return -2;
            const float *row = (const float *)em->w + e->ids[r] * em->k;
            for (int64_t i = 0; i < hid; i++) x[r * hid + i] = row[i];
        }
    } else {
        const int rc = mstar_qrows((int)em->form, (const uint8_t *)em->w, em->d, em->m, em->n, em->k, e->ids, t, x,
                                   hid);
        if (rc == -2) return -2;
        if (rc) return -3;
    }
    if (e->embed_scale != 1.0f)
        for (int64_t i = 0; i < t * hid; i++) x[i] = x[i] * e->embed_scale;
    const int rc = mstar_decode_stack(s, layers, steps, x, work, qscratch, ascratch, threads);
    if (rc) return rc;
    for (int64_t i = 0; i < e->n_sample; i++)
        mstar_rms_norm(x + e->sample_rows[i] * hid, hid, e->norm, s->eps, xs + i * hid, 1, hid);
    if (e->n_sample && qgemm(&e->head, xs, e->n_sample, e->logits, threads, qscratch)) return -4;
    return 0;
}
