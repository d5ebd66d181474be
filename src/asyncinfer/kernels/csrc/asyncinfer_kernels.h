/* asyncinfer's CPU kernels: the ABI the Python side (kernels/_build.py, ops.py, decoder.py) binds with
 * ctypes. Every exported function, the layer_t struct and the ABI version are declared here and only
 * here; each ISA variant (scalar, avx2, avx512, avx512vnni) is the same sources built with other flags, exporting
 * exactly these names.
 *
 * Error codes (int results): 0 success; -1 working memory could not be allocated or its size would
 * overflow (the Python side raises MemoryError); 1 to 4 input errors, see each function.
 */
#ifndef ASYNCINFER_KERNELS_H
#define ASYNCINFER_KERNELS_H

#include <stdint.h>

/* The ABI version: bumped whenever a signature, a struct, the layout or a result changes. The library
 * returns it (asyncinfer_kernels_version); _build.py refuses a library of another version. */
#define ASYNCINFER_KERNELS_VERSION 34

/* From this many activation rows on, the GEMM takes its float32 panel path (below it, activations are
 * rounded per block of 32 to int16); _build.PANEL_MIN_ROWS is checked against it. */
#define ASYNCINFER_PANEL_MIN_ROWS 9

/* From this many activation rows on, a step's int8 projection in a plain block format with ASYNCINFER_FMT_TILE8
 * (layer_t's parts, the head's format) takes the tile on AVX-512 builds; _build.STEP_TILE_MIN_ROWS is checked
 * against it. */
#define ASYNCINFER_STEP_TILE_MIN_ROWS 12

/* ISA variant codes (asyncinfer_kernels_isa, asyncinfer_cpu_isas' bits). */
#define ASYNCINFER_ISA_SCALAR 0
#define ASYNCINFER_ISA_AVX2 1
#define ASYNCINFER_ISA_AVX512 2
#define ASYNCINFER_ISA_AVX512VNNI 3

#define ASYNCINFER_ENOMEM (-1)
/* Sizes a kernel cannot work with (a count of 0 it would divide by); the Python side refuses them first. */
#define ASYNCINFER_EINVAL (-2)

#if defined(_WIN32)
#define ASYNCINFER_API __declspec(dllexport)
#else
#define ASYNCINFER_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Block formats (layer_t's parts, the head's format; asyncinfer.kernels.formats.LAYOUTS' ``code``). */
#define ASYNCINFER_FMT_Q4_1 0
#define ASYNCINFER_FMT_Q8_0 1
#define ASYNCINFER_FMT_Q4_0 2
#define ASYNCINFER_FMT_Q5_0 3
#define ASYNCINFER_FMT_Q5_1 4
#define ASYNCINFER_FMT_Q4_K 5
#define ASYNCINFER_FMT_Q5_K 6
#define ASYNCINFER_FMT_Q6_K 7
#define ASYNCINFER_NUM_FMTS 8
/* A flag on a format code (layer_t's parts, the head's format, asyncinfer_gemm's fmt): below
 * ASYNCINFER_PANEL_MIN_ROWS activation rows, round the activations to int8 per block of 32 instead of int16
 * (gemm8.c: llama.cpp's numerics, faster products); from it on, the float32 panel as without it. */
#define ASYNCINFER_FMT_ACT8 0x40
/* A flag beside ASYNCINFER_FMT_ACT8 on asyncinfer_gemm's fmt: the int8 GEMM as a tile of 16 activation rows a
 * register (gemm8.c), for many rows; the AVX-512 builds have it (the k-quants' activations rounded with a scale per
 * 256 there, llama.cpp's Q8_K, as their rows round them too), the others take the rows without it. On layer_t's
 * parts and the head's format (a step's projections): the tile from ASYNCINFER_STEP_TILE_MIN_ROWS rows on, the rows
 * below it (a format in lanes: ASYNCINFER_FMT_LANES16's choice). */
#define ASYNCINFER_FMT_TILE8 0x80
/* A flag beside ASYNCINFER_FMT_ACT8 on Q4_0's or Q4_1's code (layer_t's parts, asyncinfer_gemm's fmt): the blocks
 * in lanes (asyncinfer.kernels.pack_lanes): weight rows in groups of 16, each block of 32 weights of the 16 rows in
 * 288 bytes (Q4_1: 320), their float16 scales (Q4_1: then their float16 minimums) then four runs of 64 bytes, run c
 * holding bytes 4c to 4c + 3 of each row's 16 bytes of nibbles, row r in 32-bit lane r. N a multiple of 16. Its
 * own GEMM at every number of activation rows; with TILE8 (asyncinfer_gemm's and layer_t's parts alike) on
 * AVX-512 builds, from 32 rows on, the tile, reading each group unpacked whole (a prefill's, a step of many
 * decodes), the same float32 operations, so the same results. Each row's result the same whatever the others. */
#define ASYNCINFER_FMT_LANES16 0x20

/* A projection is up to ASYNCINFER_MAX_PARTS runs of output rows, each in its own format (a fused q/k/v
 * whose tensors a file holds in different formats): part i's rows follow part i - 1's in the output. A
 * part of 0 rows is unused. */
#define ASYNCINFER_MAX_PARTS 3
typedef struct {
    const void *w; /* rows x (K / weights per block) blocks, in the kernels' layout */
    int64_t rows;
    int32_t fmt; /* ASYNCINFER_FMT_* */
    int32_t reserved;
} part_t;

/* The MLP's activation (layer_t's act): silu(gate) * up (SwiGLU, the Llama families) or gelu(gate) * up with
 * gelu's tanh approximation (GeGLU, Gemma). */
#define ASYNCINFER_ACT_SILU 0
#define ASYNCINFER_ACT_GELU_TANH 1

/* One decoder layer's weights and shape (DecodeLayer's _Layer mirrors it field for field).
 *   h += post_norm1(o(attention(...norm1(h)...))), h += post_norm2(down(act(gate_up(norm2(h))))),
 * each post norm skipped where NULL (the Llama families have none; Gemma has both). Norm weights are the
 * values the normalised rows are multiplied by (a family's weight offset already added). */
typedef struct {
    const float *norm1, *norm2;
    const float *b_qkv; /* [q + 2 kv] or NULL */
    const float *q_norm, *k_norm; /* [D] each, or both NULL: each q and k head RMS-normalised before rope (Qwen3) */
    const float *post_norm1, *post_norm2; /* [hidden] each, or NULL: the attention's / MLP's output normalised */
    part_t qkv[ASYNCINFER_MAX_PARTS], o[ASYNCINFER_MAX_PARTS], gate_up[ASYNCINFER_MAX_PARTS],
        down[ASYNCINFER_MAX_PARTS];
    int64_t hidden, H, KVH, D, I;
    float eps, scale;
    float softcap; /* > 0: each attention score s (scale included) becomes softcap * tanh(s / softcap); 0: none */
    int32_t act;   /* ASYNCINFER_ACT_* */
    int32_t rope;  /* which of asyncinfer_decode_stack's rope tables the layer reads (0 for asyncinfer_decode_layer) */
    int64_t window; /* > 0: a token attends to the last `window` keys of its context only (a sliding layer); 0: all */
} layer_t;

/* A token embedding table [vocab, hidden] the kernels read rows of (asyncinfer_embed_rows, the first step of
 * asyncinfer_decode_stack; asyncinfer.kernels.ops' _Embed mirrors it): row r is ld bytes after row r - 1, from
 * rows; fmt says how a row is held:
 *   ASYNCINFER_FMT_* (a block format): the row's blocks in ggml's order, as a GGUF file stores them;
 *   ASYNCINFER_EMBED_PACKED | ASYNCINFER_FMT_Q4_1 or _Q8_0: in the kernels' layout (asyncinfer.kernels.pack:
 *     the row's every d, Q4_1's every m, then the quants; a head's own blocks, read in place);
 *   ASYNCINFER_EMBED_F32: hidden float32 values.
 * A row is dequantized straight into its output, bit for bit ggml's float32 values (blocks.h), then, unless
 * scale is 1, multiplied by scale (a family's embedding scale: Gemma's sqrt(hidden)). */
#define ASYNCINFER_EMBED_PACKED 0x100
#define ASYNCINFER_EMBED_F32 0x200
typedef struct {
    const void *rows;
    int64_t vocab;
    int64_t ld; /* bytes from a row to the next */
    int32_t fmt; /* see above */
    float scale;
} embed_t;

/* y[M, N] (row stride ldy) = x[M, K] (row stride ldx) times W[N, K] held as blocks in the kernels' layout
 * (+ bias[N] or NULL); K a multiple of the format's weights per block; scratch: asyncinfer_scratch_bytes(M,
 * K) bytes. Returns 0 or -1. One entry per format. */
#define ASYNCINFER_GEMM_DECL(NAME)                                                                          \
    ASYNCINFER_API int NAME(const float *x, int64_t M, int64_t ldx, int64_t K, const void *w, int64_t N,       \
                            const float *bias, float *y, int64_t ldy, int threads, void *scratch);
ASYNCINFER_GEMM_DECL(asyncinfer_gemm_q4_1)
ASYNCINFER_GEMM_DECL(asyncinfer_gemm_q8_0)
ASYNCINFER_GEMM_DECL(asyncinfer_gemm_q4_0)
ASYNCINFER_GEMM_DECL(asyncinfer_gemm_q5_0)
ASYNCINFER_GEMM_DECL(asyncinfer_gemm_q5_1)
ASYNCINFER_GEMM_DECL(asyncinfer_gemm_q4_k)
ASYNCINFER_GEMM_DECL(asyncinfer_gemm_q5_k)
ASYNCINFER_GEMM_DECL(asyncinfer_gemm_q6_k)
/* The GEMM of any format code (ASYNCINFER_FMT_*, ASYNCINFER_FMT_ACT8 allowed, and with it ASYNCINFER_FMT_TILE8):
 * as the entries above; -2 for a code outside them. */
ASYNCINFER_API int asyncinfer_gemm(int fmt, const float *x, int64_t M, int64_t ldx, int64_t K, const void *w,
                                   int64_t N, const float *bias, float *y, int64_t ldy, int threads, void *scratch);
/* The scratch bytes a GEMM of M rows by K takes; -1 when that size would overflow. */
ASYNCINFER_API int64_t asyncinfer_scratch_bytes(int64_t M, int64_t K);
/* out[N, K] (row stride ldo, in uint16 elements) = rows 0..N-1 of W[N, K] (fmt's blocks in the kernels' layout,
 * ASYNCINFER_FMT_* without flags) as bfloat16 bits: each weight ggml's float32 value rounded once to nearest even
 * (a NaN stays a NaN): what asyncinfer.kernels.gemm's bfloat16 steps multiply by. Returns 0, -1, or -2 for a
 * format code outside them, K not a whole number of blocks or ldo < K. */
ASYNCINFER_API int asyncinfer_dequantize_bf16(int fmt, const void *w, int64_t N, int64_t K, uint16_t *out, int64_t ldo,
                                              int threads);

ASYNCINFER_API void asyncinfer_rms_norm(const float *x, int64_t T, int64_t ldx, int64_t H, const float *w, float eps,
                                        float *y, int threads);

/* softcap > 0: each score, scale included, capped to softcap * tanh(score / softcap) (0: not capped);
 * window > 0: a context of L keys attends to its last min(L, window) keys (0: to all of them).
 * Returns 0 or -1. */
ASYNCINFER_API int asyncinfer_decode_attention(const float *q, const float *k_cache, const float *v_cache,
                                               const int64_t *tables, int64_t ldt, const int64_t *ctx, int64_t S,
                                               int64_t H, int64_t KVH, int64_t D, int64_t BS, float scale,
                                               float softcap, int64_t window, float *out, int threads);

ASYNCINFER_API int asyncinfer_decode_layer(const layer_t *L, float *h, int64_t T, const float *cos, const float *sin,
                                           float *k_cache, float *v_cache, const int64_t *slots,
                                           const int64_t *tables, int64_t ldt, const int64_t *ctx, int64_t BS,
                                           int threads, double *timing);

/* out[T, hidden] (row stride ldo) = the rows ids[T] of the table E (times its scale). Returns 0; 1 for an id
 * outside [0, E->vocab) (nothing is written then); -2 for a format code the table cannot have, a hidden size
 * that is no whole number of its blocks, or rows closer than a row's bytes. */
ASYNCINFER_API int asyncinfer_embed_rows(const embed_t *E, const int64_t *ids, int64_t T, int64_t hidden, float *out,
                                         int64_t ldo);

ASYNCINFER_API int asyncinfer_decode_stack(const layer_t *layers, int64_t n, float *const *caches, float *h, int64_t T,
                                           const int64_t *ids, const embed_t *embed, const int64_t *positions,
                                           const float *const *cos_tables, const float *const *sin_tables,
                                           int64_t n_rope, int64_t max_pos, const float *final_norm, float final_eps,
                                           float *out, const void *head_w, int head_fmt, int64_t head_n,
                                           float logit_softcap, float *logits, int64_t *argmax, const int64_t *slots,
                                           const int64_t *tables, int64_t ldt, const int64_t *ctx, int64_t BS,
                                           int64_t num_slots, int threads, double *timing);

ASYNCINFER_API void asyncinfer_argmax(const float *x, int64_t rows, int64_t n, int64_t ldx, int64_t *out);

ASYNCINFER_API int asyncinfer_check_paged(const int64_t *tables, int64_t ldt, const int64_t *ctx,
                                          const int64_t *slots, int64_t S, int64_t BS, int64_t num_blocks);

ASYNCINFER_API int asyncinfer_panel_min_rows(void);
ASYNCINFER_API int asyncinfer_step_tile_min_rows(void);
ASYNCINFER_API int asyncinfer_kernels_version(void);
/* The variant this library was built as (ASYNCINFER_ISA_*). */
ASYNCINFER_API int asyncinfer_kernels_isa(void);
/* The variants this CPU (and OS) can run: bit ASYNCINFER_ISA_* set for each; scalar always. */
ASYNCINFER_API int asyncinfer_cpu_isas(void);

#ifdef __cplusplus
}
#endif

#endif
