#define _POSIX_C_SOURCE 200809L /* clock_gettime */
#include "internal.h"

#include <time.h>

/* ------------------------------------------------------------------------------------------------
 * A whole decoder layer of a Llama-family or Gemma model for a step of decodes (one new token per
 * sequence), in one call: what the engine's Python layer does op by op, without torch's per-op cost
 * (which at batch 1 took about as long as the projections themselves).
 *
 *   h += o_proj(attention(rope(qkv_proj(norm1(h)))))      (K/V written to their cache slots first)
 *   (Qwen3, Gemma 3: each q and k head RMS-normalised, q_norm / k_norm, between qkv_proj and rope)
 *   h += down_proj(act(gate) * up),  [gate; up] = gate_up_proj(norm2(h))
 * Gemma's parts, each chosen per layer (layer_t): the attention's and the MLP's outputs RMS-normalised
 * (post_norm1, post_norm2) before they are added to h, GeGLU (act), soft-capped attention scores, and a
 * sliding layer's window (the last `window` keys of each context).
 *
 * Weights: each projection up to ASYNCINFER_MAX_PARTS runs of output rows, each in any block format
 * (part_t; the Python side checks the formats and sizes). cos/sin: [T, D/2] rows of the rope table for
 * each token's position (rotate-half convention). timing: NULL, or three doubles that the call adds its
 * seconds to (see TIMED). */
static gemm_fn gemm_of(int fmt, int64_t M) { return ai_gemm_of(fmt, M); }

/* y[T, sum of the parts' rows] (row stride ldy) = x[T, K] times a projection's parts, each into its own
 * columns (+ the bias's matching values); -2 for a format code outside the table. */
static int project(const part_t *parts, const float *x, int64_t T, int64_t K, const float *bias, float *y,
                   int64_t ldy, int threads, void *scratch) {
    int64_t at = 0;
    for (int i = 0; i < ASYNCINFER_MAX_PARTS; i++) {
        if (parts[i].rows <= 0) continue;
        const gemm_fn fn = gemm_of(parts[i].fmt, T);
        if (!fn) return ASYNCINFER_EINVAL;
        const int rc = fn(x, T, K, K, parts[i].w, parts[i].rows, bias ? bias + at : NULL, y + at, ldy, threads,
                          scratch);
        if (rc) return rc;
        at += parts[i].rows;
    }
    return 0;
}

/* A step's working memory, sized for the widest layer of a call. */
typedef struct {
    float *x, *wide, *attn, *out;
    void *scratch;
} step_bufs;

/* Sizes checked for overflow: a size that would overflow fails like an allocation (-1). */
static int bufs_alloc(step_bufs *b, const layer_t *layers, int64_t n, int64_t T) {
    int64_t xw = 0, ww = 0, aw = 0, ow = 0, sb = 0;
    memset(b, 0, sizeof(*b));
    for (int64_t l = 0; l < n; l++) {
        const layer_t *L = layers + l;
        int64_t q, kv, qkv, i2;
        if (!ai_mul(L->H, L->D, &q) || !ai_mul(L->KVH, L->D, &kv) || !ai_mul(kv, 2, &kv) || !ai_add(q, kv, &qkv) ||
            !ai_mul(L->I, 2, &i2))
            return 0;
        const int64_t k_in = L->hidden > L->I ? L->hidden : L->I;
        const int64_t cand[4] = {L->hidden > q ? L->hidden : q, qkv > i2 ? qkv : i2, q > L->I ? q : L->I, L->hidden};
        xw = cand[0] > xw ? cand[0] : xw;
        ww = cand[1] > ww ? cand[1] : ww;
        aw = cand[2] > aw ? cand[2] : aw;
        ow = cand[3] > ow ? cand[3] : ow;
        const int64_t s = ai_scratch_bytes(T, k_in > q ? k_in : q);
        if (s < 0) return 0;
        sb = s > sb ? s : sb;
    }
    int64_t tx, tw, ta, to;
    if (!ai_mul(T, xw, &tx) || !ai_mul(T, ww, &tw) || !ai_mul(T, aw, &ta) || !ai_mul(T, ow, &to) ||
        !ai_add(sb, 64, &sb))
        return 0;
    b->x = (float *)ai_alloc(tx, sizeof(float));
    b->wide = (float *)ai_alloc(tw, sizeof(float));
    b->attn = (float *)ai_alloc(ta, sizeof(float));
    b->out = (float *)ai_alloc(to, sizeof(float));
    b->scratch = ai_alloc(sb, 1);
    return b->x && b->wide && b->attn && b->out && b->scratch;
}

static void bufs_free(step_bufs *b) {
    free(b->x); free(b->wide); free(b->attn); free(b->out); free(b->scratch);
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* With a timing array (profiling), seconds are added up per part: [0] projections, [1] attention,
 * [2] the whole layer. A call that fails (-1) ends the step with its code. */
#define TIMED(slot, call)                                                                         \
    do {                                                                                          \
        if (timing) mark = now();                                                                 \
        const int rc_ = (call);                                                                   \
        if (timing) timing[slot] += now() - mark;                                                 \
        if (rc_) return rc_;                                                                      \
    } while (0)

static int layer_step(const layer_t *L, float *h, int64_t T, const float *cos, const float *sin, float *k_cache,
                       float *v_cache, const int64_t *slots, const int64_t *tables, int64_t ldt, const int64_t *ctx,
                       int64_t BS, int threads, double *timing, const step_bufs *b) {
    const int64_t hidden = L->hidden, H = L->H, KVH = L->KVH, D = L->D, I = L->I;
    const int64_t q_size = H * D, kv_size = KVH * D, qkv_size = q_size + 2 * kv_size, half = D / 2;
    const double start = timing ? now() : 0.0;
    double mark = start;
    float *x = b->x, *wide = b->wide, *attn = b->attn, *out = b->out;
    if (!L->q_norm != !L->k_norm) return ASYNCINFER_EINVAL; /* both q/k norms or neither */
    if (L->act != ASYNCINFER_ACT_SILU && L->act != ASYNCINFER_ACT_GELU_TANH) return ASYNCINFER_EINVAL;

    /* attention block */
    ai_rms_norm(h, T, hidden, hidden, L->norm1, L->eps, x, threads);
    TIMED(0, project(L->qkv, x, T, hidden, L->b_qkv, wide, qkv_size, threads, b->scratch));
    _Pragma("omp parallel for schedule(static) num_threads(threads) if(threads > 1 && T >= 8)")
    for (int64_t t = 0; t < T; t++) {
        float *row = wide + t * qkv_size;
        const float *c = cos + t * half, *sn = sin + t * half;
        if (L->q_norm) { /* Qwen3, Gemma 3: every q head, then every k head, normalised over D (in place) */
            ai_rms_norm(row, H, D, D, L->q_norm, L->eps, row, 1);
            ai_rms_norm(row + q_size, KVH, D, D, L->k_norm, L->eps, row + q_size, 1);
        }
        for (int64_t head = 0; head < H + KVH; head++) { /* q heads, then k heads: adjacent in the row */
            float *v = row + head * D;
            for (int64_t i = 0; i < half; i++) {
                const float x1 = v[i], x2 = v[i + half];
                const float a = x1 * c[i], bb = x2 * sn[i], e = x2 * c[i], f = x1 * sn[i];
                v[i] = a - bb;
                v[i + half] = e + f;
            }
        }
        memcpy(x + t * q_size, row, sizeof(float) * (size_t)q_size); /* q, packed for attention */
    }
    for (int64_t t = 0; t < T; t++) { /* in order: a slot given twice keeps the last token's K/V */
        const float *row = wide + t * qkv_size;
        memcpy(k_cache + slots[t] * kv_size, row + q_size, sizeof(float) * (size_t)kv_size);
        memcpy(v_cache + slots[t] * kv_size, row + q_size + kv_size, sizeof(float) * (size_t)kv_size);
    }
    TIMED(1, ai_decode_attention(x, k_cache, v_cache, tables, ldt, ctx, T, H, KVH, D, BS, L->scale, L->softcap,
                                 L->window, attn, threads));
    TIMED(0, project(L->o, attn, T, q_size, NULL, out, hidden, threads, b->scratch));
    if (L->post_norm1) ai_rms_norm(out, T, hidden, hidden, L->post_norm1, L->eps, out, threads); /* Gemma */
    for (int64_t i = 0; i < T * hidden; i++) h[i] += out[i];

    /* MLP block */
    ai_rms_norm(h, T, hidden, hidden, L->norm2, L->eps, x, threads);
    TIMED(0, project(L->gate_up, x, T, hidden, NULL, wide, 2 * I, threads, b->scratch));
    _Pragma("omp parallel for schedule(static) num_threads(threads) if(threads > 1 && T >= 8)")
    for (int64_t t = 0; t < T; t++) {
        if (L->act == ASYNCINFER_ACT_SILU) ai_swiglu(wide + t * 2 * I, wide + t * 2 * I + I, attn + t * I, I);
        else ai_geglu(wide + t * 2 * I, wide + t * 2 * I + I, attn + t * I, I);
    }
    TIMED(0, project(L->down, attn, T, I, NULL, out, hidden, threads, b->scratch));
    if (L->post_norm2) ai_rms_norm(out, T, hidden, hidden, L->post_norm2, L->eps, out, threads); /* Gemma */
    for (int64_t i = 0; i < T * hidden; i++) h[i] += out[i];
    if (timing) timing[2] += now() - start;
    return 0;
}

/* One layer (DecodeLayer). Returns 0, or -1 when its working memory cannot be allocated. */
int asyncinfer_decode_layer(const layer_t *L, float *h, int64_t T, const float *cos, const float *sin,
                            float *k_cache, float *v_cache, const int64_t *slots, const int64_t *tables, int64_t ldt,
                            const int64_t *ctx, int64_t BS, int threads, double *timing) {
    step_bufs b = {0};
    int rc = bufs_alloc(&b, L, 1, T) ? 0 : ASYNCINFER_ENOMEM;
    if (!rc) rc = layer_step(L, h, T, cos, sin, k_cache, v_cache, slots, tables, ldt, ctx, BS, threads, timing, &b);
    bufs_free(&b);
    return rc;
}

/* The body of a step (asyncinfer_decode_stack), its memory allocated; cs: [n_rope, 2, T, D / 2]. */
static int stack_step(const layer_t *layers, int64_t n, float *const *caches, float *h, int64_t T, const int64_t *ids,
                      const embed_t *embed, const int64_t *positions, const float *const *cos_tables,
                      const float *const *sin_tables, int64_t n_rope, const float *final_norm, float final_eps,
                      float *out, const void *head_w, int head_fmt, int64_t head_n, float logit_softcap,
                      float *logits, int64_t *argmax, const int64_t *slots, const int64_t *tables,
                      int64_t ldt, const int64_t *ctx, int64_t BS, int threads, double *timing, const step_bufs *b,
                      float *cs) {
    const int64_t hidden = layers[0].hidden, half = layers[0].D / 2;
    if (ids) ai_embed_rows(embed, ids, T, hidden, h, hidden); /* each row dequantized straight into h */
    for (int64_t r = 0; r < n_rope; r++) {
        float *c = cs + r * 2 * T * half;
        for (int64_t t = 0; t < T; t++) {
            memcpy(c + t * half, cos_tables[r] + positions[t] * half, sizeof(float) * (size_t)half);
            memcpy(c + (T + t) * half, sin_tables[r] + positions[t] * half, sizeof(float) * (size_t)half);
        }
    }
    for (int64_t l = 0; l < n; l++) {
        const float *c = cs + layers[l].rope * 2 * T * half;
        const int rc = layer_step(layers + l, h, T, c, c + T * half, caches[2 * l], caches[2 * l + 1], slots, tables,
                                  ldt, ctx, BS, threads, timing, b);
        if (rc) return rc;
    }
    ai_rms_norm(h, T, hidden, hidden, final_norm, final_eps, out, threads);
    if (logits) {
        double mark = 0.0;
        const gemm_fn head = gemm_of(head_fmt, T);
        if (!head) return ASYNCINFER_EINVAL;
        TIMED(3, head(out, T, hidden, hidden, head_w, head_n, NULL, logits, head_n, threads, b->scratch));
        if (logit_softcap > 0.0f) { /* Gemma 2: the logits capped, before their argmax */
            _Pragma("omp parallel for schedule(static) num_threads(threads) if(threads > 1 && T > 1)")
            for (int64_t t = 0; t < T; t++) ai_softcap(logits + t * head_n, head_n, logit_softcap);
        }
        if (argmax) ai_argmax(logits, T, head_n, head_n, argmax);
    }
    return 0;
}

/* Every layer of a model and its final norm for a step of decodes (DecodeStack).
 *   h: [T, hidden], the residual stream, or NULL (allocated here); ids: NULL (h holds the embedded
 *     tokens; embed unused), or the tokens, whose rows of the embedding table embed (any block format or
 *     float32, times its scale: asyncinfer_embed_rows) fill h first;
 *   cos_tables / sin_tables: n_rope tables each [max_pos, D / 2], read at each token's position; layer l
 *     reads table layers[l].rope (Gemma 3's sliding layers have a rope table of their own);
 *   caches: layer l's K and V caches at 2l and 2l + 1;
 *   out: [T, hidden], the final-normed states, or NULL (allocated here);
 *   logits: NULL, or [T, head_n]: out times the head's weights (head_w in format head_fmt), each then
 *     logit_softcap * tanh(logit / logit_softcap) where logit_softcap > 0 (Gemma 2);
 *   argmax: NULL, or [T]: each logits row's argmax (asyncinfer_argmax), for greedy sampling;
 *   timing: NULL or four doubles, the layers' three (TIMED) and the head's.
 * num_slots: the caches' blocks times BS. Returns 0; 1 for a token id outside [0, embed->vocab), 2 for a
 * position outside [0, max_pos), 3 for a context length below 1 or longer than its block table, 4
 * for a slot or block outside the caches (nothing is computed then); -1 when working memory cannot
 * be allocated; -2 for an embedding table the kernels cannot read (ai_embed_check) or a layer's rope
 * table outside [0, n_rope). */
int asyncinfer_decode_stack(const layer_t *layers, int64_t n, float *const *caches, float *h, int64_t T,
                            const int64_t *ids, const embed_t *embed, const int64_t *positions,
                            const float *const *cos_tables, const float *const *sin_tables, int64_t n_rope,
                            int64_t max_pos, const float *final_norm, float final_eps, float *out, const void *head_w,
                            int head_fmt, int64_t head_n, float logit_softcap, float *logits, int64_t *argmax,
                            const int64_t *slots, const int64_t *tables, int64_t ldt, const int64_t *ctx, int64_t BS,
                            int64_t num_slots, int threads, double *timing) {
    const int64_t hidden = layers[0].hidden, half = layers[0].D / 2;
    if (ids && ai_embed_check(embed, hidden)) return ASYNCINFER_EINVAL;
    for (int64_t l = 0; l < n; l++)
        if (layers[l].rope < 0 || layers[l].rope >= n_rope) return ASYNCINFER_EINVAL;
    for (int64_t t = 0; t < T; t++) {
        if (ids && (ids[t] < 0 || ids[t] >= embed->vocab)) return 1;
        if (positions[t] < 0 || positions[t] >= max_pos) return 2;
    }
    const int paged = ai_check_paged(tables, ldt, ctx, slots, T, BS, num_slots / BS);
    if (paged) return paged;
    step_bufs b = {0};
    int64_t cs_n, th;
    int rc = ai_mul(T, 2 * half, &cs_n) && ai_mul(cs_n, n_rope, &cs_n) && ai_mul(T, hidden, &th) &&
                     bufs_alloc(&b, layers, n, T) ? 0 : ASYNCINFER_ENOMEM;
    float *cs = rc ? NULL : (float *)ai_alloc(cs_n, sizeof(float));
    float *own_h = h || rc ? NULL : (float *)ai_alloc(th, sizeof(float));
    float *own_out = out || rc ? NULL : (float *)ai_alloc(th, sizeof(float));
    h = h ? h : own_h;
    out = out ? out : own_out;
    if (!rc && !(cs && h && out)) rc = ASYNCINFER_ENOMEM;
    if (!rc) rc = stack_step(layers, n, caches, h, T, ids, embed, positions, cos_tables, sin_tables, n_rope,
                             final_norm, final_eps, out, head_w, head_fmt, head_n, logit_softcap, logits, argmax,
                             slots, tables, ldt, ctx, BS, threads, timing, &b, cs);
    bufs_free(&b);
    free(cs);
    free(own_h);
    free(own_out);
    return rc;
}
