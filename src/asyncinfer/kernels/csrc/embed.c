/* The token embedding's rows: a step's token ids looked up in a table held in any block format (or float32)
 * and dequantized straight into the residual stream, so that a table kept in its GGUF file's blocks costs
 * the decode step no more than a float32 one (embed_t in asyncinfer_kernels.h).
 *
 * Every value is ggml's dequantized float32 weight, bit for bit (asyncinfer.kernels.dequantize's): Q8_0's
 * d * q, Q4_1's d * q + m (d * q exact in float32: one rounding, of the sum) in ggml's order or the kernels'
 * layout, Q6_K's (d * sc) * q, and the other formats through blocks.h, whose every scale * q is exact. A scale other than 1 then
 * multiplies each value (one more rounding, as the model's float32 forward multiplies its rows). */
#include "blocks.h"

int ai_embed_check(const embed_t *E, int64_t hidden) {
    if (!E || hidden < 1 || E->vocab < 0 || E->ld < 0 || (E->vocab && !E->rows)) return ASYNCINFER_EINVAL;
    int64_t need;
    if (E->fmt == ASYNCINFER_EMBED_F32) {
        if (!ai_mul(hidden, 4, &need)) return ASYNCINFER_EINVAL;
    } else {
        const int fmt = E->fmt & ~ASYNCINFER_EMBED_PACKED;
        if (fmt < 0 || fmt >= ASYNCINFER_NUM_FMTS) return ASYNCINFER_EINVAL;
        if ((E->fmt & ASYNCINFER_EMBED_PACKED) && fmt != ASYNCINFER_FMT_Q4_1 && fmt != ASYNCINFER_FMT_Q8_0)
            return ASYNCINFER_EINVAL; /* the other formats' kernel layout is ggml's: no flag */
        if (hidden % ai_fmt_weights(fmt) || !ai_mul(hidden / ai_fmt_weights(fmt), ai_fmt_bytes(fmt), &need))
            return ASYNCINFER_EINVAL;
    }
    int64_t extent; /* the table's bytes address within int64 */
    if (!ai_mul(E->vocab, E->ld, &extent) || (E->vocab > 1 && E->ld < need)) return ASYNCINFER_EINVAL;
    return 0;
}

/* Q8_0 / Q4_1 rows of nb blocks: block b's d, (Q4_1) m and quants, in ggml's order or the kernels' layout. */
static void q8_0_row(const uint8_t *row, int64_t nb, int packed, float *out) {
    for (int64_t b = 0; b < nb; b++, out += 32) {
        const float d = ai_half_at(packed ? row + 2 * b : row + 34 * b);
        const int8_t *q = (const int8_t *)(packed ? row + 2 * nb + 32 * b : row + 34 * b + 2);
        for (int i = 0; i < 32; i++) out[i] = d * (float)q[i];
    }
}

static void q4_1_row(const uint8_t *row, int64_t nb, int packed, float *out) {
    for (int64_t b = 0; b < nb; b++, out += 32) {
        const float d = ai_half_at(packed ? row + 2 * b : row + 20 * b);
        const float m = ai_half_at(packed ? row + 2 * nb + 2 * b : row + 20 * b + 2);
        const uint8_t *qs = packed ? row + 4 * nb + 16 * b : row + 20 * b + 4;
        for (int i = 0; i < 16; i++) { /* element i: byte i's low nibble; element i + 16: its high one */
            out[i] = d * (float)(qs[i] & 0x0F) + m;
            out[i + 16] = d * (float)(qs[i] >> 4) + m;
        }
    }
}

/* Q6_K rows: (d * sc) * q, in ggml's order of the products (blocks.h's d * (sc * q) is the same value but for
 * the sign of a zero). */
static void q6_k_row(const uint8_t *row, int64_t nb, float *out) {
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + 210 * b;
        const float d = ai_half_at(blk + 208);
        const int8_t *sc = (const int8_t *)(blk + 192);
        for (int j = 0; j < 8; j++, out += 32) { /* sub-block j = 4 n + k: see blocks.h */
            const int n = j >> 2, k = j & 3;
            const uint8_t *ql = blk + 64 * n + 32 * (k & 1), *qh = blk + 128 + 32 * n;
            for (int i = 0; i < 32; i++) {
                const int q = (((ql[i] >> (4 * (k >> 1))) & 0x0F) | ((qh[i] >> (2 * k)) & 3) << 4) - 32;
                out[i] = (d * (float)sc[2 * j + (i >> 4)]) * (float)q;
            }
        }
    }
}

void ai_embed_rows(const embed_t *E, const int64_t *ids, int64_t T, int64_t hidden, float *out, int64_t ldo) {
    const int fmt = E->fmt & ~ASYNCINFER_EMBED_PACKED, packed = (E->fmt & ASYNCINFER_EMBED_PACKED) != 0;
    for (int64_t t = 0; t < T; t++) {
        const uint8_t *row = (const uint8_t *)E->rows + ids[t] * E->ld;
        float *o = out + t * ldo;
        if (E->fmt == ASYNCINFER_EMBED_F32)
            memcpy(o, row, sizeof(float) * (size_t)hidden);
        else if (fmt == ASYNCINFER_FMT_Q8_0)
            q8_0_row(row, hidden / 32, packed, o);
        else if (fmt == ASYNCINFER_FMT_Q4_1)
            q4_1_row(row, hidden / 32, packed, o);
        else if (fmt == ASYNCINFER_FMT_Q6_K)
            q6_k_row(row, hidden / 256, o);
        else
            ai_rebuild_blocks(fmt, row, hidden, o);
        if (E->scale != 1.0f)
            for (int64_t i = 0; i < hidden; i++) o[i] *= E->scale;
    }
}

int asyncinfer_embed_rows(const embed_t *E, const int64_t *ids, int64_t T, int64_t hidden, float *out, int64_t ldo) {
    const int bad = ai_embed_check(E, hidden);
    if (bad) return bad;
    if (T < 0 || ldo < hidden) return ASYNCINFER_EINVAL;
    for (int64_t t = 0; t < T; t++)
        if (ids[t] < 0 || ids[t] >= E->vocab) return 1;
    ai_embed_rows(E, ids, T, hidden, out, ldo);
    return 0;
}
