/* Block formats: products of float32 activations with weights in ggml's block formats (Q4_1 / Q8_0 here,
 * the others' blocks read through blocks.h).
 *
 *   y[m, n] = sum_k x[m, k] * W[n, k]  (+ bias[n])
 *
 * W holds one row per output feature, each a run of blocks of 32 weights along k, in ggml's
 * formats, regrouped per row so that scales load together (asyncinfer.kernels.pack):
 *
 *   Q4_1 row: d[nb] (fp16), m[nb] (fp16), then 16 bytes of nibbles per block; weight j = d * q_j + m,
 *             q_j the low nibble of byte j for j < 16, the high nibble of byte j - 16 otherwise
 *   Q8_0 row: d[nb] (fp16), then 32 int8 per block; weight j = d * q_j
 *   Q4_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K rows: ggml's blocks as they are (blocks.h), read as sub-blocks of
 *             32 weights scale * q_j + min (min 0 for Q4_0, Q5_0, Q6_K)
 *
 * The algorithm, the same in every variant:
 *   - below PANEL_MIN_ROWS activation rows, each block of 32 activations is rounded to int16
 *     (x ~= dx * qx, |qx| <= 32767, rounded to nearest even, dx = the block's largest |x| / 32767),
 *     each block's integer dot product is exact, scaled by dx * dw in float32 and summed; Q4_1 adds
 *     sum over blocks of m * (the block's float32 sum of x); the other formats the same per sub-block of
 *     32 (dw its scale, m its min), the sub-blocks of 32 lining up with the activations' blocks;
 *   - from PANEL_MIN_ROWS rows on (prefills, batched decodes), in the scalar and AVX2 variants the weights are
 *     rebuilt in float32 (the blocks' exact values) and each output is one float32 sum over k in order (the
 *     panel); in the AVX-512 variants the same int16 rounding and exact integer products as below it, sixteen
 *     activation rows a register (gemm8.c's int16 tile), about twice the panel's speed there.
 * Beyond that, the variants differ only in the order of float32 additions (and Q4_1's d * q + m being fused or
 * not; the AVX-512 Q4_0 rows multiply the nibbles as they are and take the centre 8 off in float32, as
 * -8 * dx * dw * (the block's integer sum of qx)), which the tests bound against the scalar reference
 * (docs/formats.md, "Kernel variants").
 */
#include "internal.h"
#include "blocks.h"

#define MR 4  /* activation rows per pass over a weight row */
#define TN 12 /* weight rows per panel */
#define PREFETCH AI_PREFETCH_BYTES
#define ROW_BYTES_Q4_1 20
#define ROW_BYTES_Q8_0 34

/* Activations rounded per block (see above): q [M, K], d, sum and isum [M, K / 32], in the caller's scratch
 * (asyncinfer_scratch_bytes). The scalar and AVX-512 variants store each block's 32 values in order (the AVX-512
 * Q4_0 / Q4_1 rows: two blocks' halves interleaved, quantize_acts512_pairs; Q4_K: two blocks' even elements, then
 * their odd ones, quantize_acts512_pairs_eo); the AVX2 variant stores even elements first, then odd ones (the order
 * its weight unpacking yields). */
typedef struct {
    int16_t *q;
    float *d;
    float *sum;
    float *isum; /* [M, K / 32]: the AVX-512 pair layout's (quantize_acts512_pairs) sum of each block's q */
} acts;

static acts acts_in(void *scratch, int64_t M, int64_t K) {
    acts a = {(int16_t *)scratch, (float *)((char *)scratch + M * K * 2), NULL, NULL};
    a.sum = a.d + M * (K / QK);
    a.isum = a.sum + M * (K / QK);
    return a;
}

/* ------------------------------------------------------------------------------------------------
 * The scalar reference (plain C): the rounding of activations (also the AVX-512 variant's) and, in the
 * scalar build, the whole GEMM. */

__attribute__((unused)) static void quantize_acts_ref(const float *x, int64_t M, int64_t ldx, int64_t K, acts *a) {
    const int64_t nb = K / QK;
    for (int64_t m = 0; m < M; m++) {
        for (int64_t b = 0; b < nb; b++) {
            const float *xb = x + m * ldx + b * QK;
            float d, inv, total;
            ai_run_scale_ref(xb, 32767.0f, &d, &inv, &total);
            int16_t *q = a->q + m * K + b * QK;
            for (int i = 0; i < QK; i++) q[i] = d > 0.0f ? (int16_t)lrintf(xb[i] * inv) : 0;
            a->d[m * nb + b] = d;
            a->sum[m * nb + b] = total;
        }
    }
}

#ifndef AI_AVX2
/* One weight row against activation row m: the exact integer dot product per block, scaled in float32. */
static float row_ref(const uint8_t *row, int64_t nb, int has_min, const acts *a, int64_t m, int64_t K) {
    const uint16_t *d16 = (const uint16_t *)row, *m16 = d16 + nb;
    const uint8_t *qs = row + (has_min ? 4 : 2) * nb;
    const int16_t *q = a->q + m * K;
    const float *dx = a->d + m * nb, *sx = a->sum + m * nb;
    float acc = 0.0f, offset = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        int32_t s = 0;
        if (has_min) {
            const uint8_t *qb = qs + 16 * b;
            for (int j = 0; j < 16; j++)
                s += (int32_t)(qb[j] & 0x0F) * q[b * QK + j] + (int32_t)(qb[j] >> 4) * q[b * QK + 16 + j];
            offset += ai_half_to_float(m16[b]) * sx[b];
        } else {
            const int8_t *qb = (const int8_t *)(qs + 32 * b);
            for (int j = 0; j < QK; j++) s += (int32_t)qb[j] * q[b * QK + j];
        }
        acc += (float)s * (dx[b] * ai_half_to_float(d16[b]));
    }
    return acc + offset;
}

/* One row's weights in float32, in order. */
static void rebuild_row_ref(const uint8_t *row, int64_t nb, int has_min, float *out) {
    const uint16_t *d16 = (const uint16_t *)row, *m16 = d16 + nb;
    const uint8_t *qs = row + (has_min ? 4 : 2) * nb;
    for (int64_t b = 0; b < nb; b++, out += QK) {
        const float d = ai_half_to_float(d16[b]);
        if (has_min) {
            const float mn = ai_half_to_float(m16[b]);
            for (int j = 0; j < 16; j++) {
                out[j] = d * (float)(qs[16 * b + j] & 0x0F) + mn;
                out[16 + j] = d * (float)(qs[16 * b + j] >> 4) + mn;
            }
        } else {
            for (int j = 0; j < QK; j++) out[j] = d * (float)((const int8_t *)qs)[32 * b + j];
        }
    }
}

/* blocks.h's formats: one weight row against activation row m, per sub-block of 32 (the integer dot product
 * in int64: Q6_K's scaled quants reach 4096 x 32767 per product). */
static float row_blocks_ref(int fmt, const uint8_t *row, int64_t K, const acts *a, int64_t m) {
    const int subs = ai_fmt_subs(fmt);
    const int64_t nblk = K / ai_fmt_weights(fmt), bytes = ai_fmt_bytes(fmt), nb = K / QK;
    const int16_t *qx = a->q + m * K;
    const float *dx = a->d + m * nb, *sx = a->sum + m * nb;
    float acc = 0.0f, offset = 0.0f;
    for (int64_t blk = 0; blk < nblk; blk++) {
        const uint8_t *p = row + blk * bytes;
        float scale[8], min[8];
        ai_block_scales(fmt, p, scale, min);
        for (int j = 0; j < subs; j++) {
            const int64_t b = blk * subs + j;
            int16_t q[32];
            ai_sub_quants(fmt, p, j, q);
            int64_t s = 0;
            for (int i = 0; i < 32; i++) s += (int64_t)q[i] * qx[b * QK + i];
            acc += (float)s * (dx[b] * scale[j]);
            if (ai_fmt_has_min(fmt)) offset += min[j] * sx[b];
        }
    }
    return acc + offset;
}

static int gemm_ref(const float *x, int64_t M, int64_t ldx, int64_t K, const uint8_t *rows, int64_t N, int fmt,
                    const float *bias, float *y, int64_t ldy, int threads, void *scratch) {
    const int64_t nb = K / QK, row_bytes = K / ai_fmt_weights(fmt) * ai_fmt_bytes(fmt);
    const int legacy = fmt == ASYNCINFER_FMT_Q4_1 || fmt == ASYNCINFER_FMT_Q8_0, has_min = fmt == ASYNCINFER_FMT_Q4_1;
    if (M < PANEL_MIN_ROWS) {
        acts a = acts_in(scratch, M, K);
        quantize_acts_ref(x, M, ldx, K, &a);
        _Pragma("omp parallel for schedule(static) num_threads(threads) if(threads > 1)")
        for (int64_t n = 0; n < N; n++)
            for (int64_t m = 0; m < M; m++)
                y[m * ldy + n] = (legacy ? row_ref(rows + n * row_bytes, nb, has_min, &a, m, K)
                                         : row_blocks_ref(fmt, rows + n * row_bytes, K, &a, m)) +
                                 (bias ? bias[n] : 0.0f);
        return 0;
    }
    float *wrows = (float *)ai_alloc((int64_t)(threads > 1 ? threads : 1), (K > 0 ? K : 1) * (int64_t)sizeof(float));
    if (!wrows) return ASYNCINFER_ENOMEM;
    _Pragma("omp parallel for schedule(static) num_threads(threads) if(threads > 1)")
    for (int64_t n = 0; n < N; n++) {
        float *w = wrows + (int64_t)ai_thread_num() * K;
        if (legacy)
            rebuild_row_ref(rows + n * row_bytes, nb, has_min, w);
        else
            ai_rebuild_blocks(fmt, rows + n * row_bytes, K, w);
        for (int64_t m = 0; m < M; m++) {
            const float *xr = x + m * ldx;
            float acc = 0.0f;
            for (int64_t k = 0; k < K; k++) acc += w[k] * xr[k];
            y[m * ldy + n] = acc + (bias ? bias[n] : 0.0f);
        }
    }
    free(wrows);
    return 0;
}
#endif

#ifdef AI_AVX2
/* ------------------------------------------------------------------------------------------------
 * AVX2 (+ FMA, F16C): the small-M row kernels (not in the AVX-512 build, which has its own) and the
 * float32 panel (shared with the AVX-512 build, whose 16-token tiles are 512 bits wide). */
#ifndef AI_AVX512
/* quantize_acts_ref's rounding, eight lanes at a time (the same int16 values: both round to nearest even;
 * the block's sum is added in another order), each block stored even elements first, then odd ones. */
static void quantize_acts_avx2(const float *x, int64_t M, int64_t ldx, int64_t K, acts *a) {
    const int64_t nb = K / QK;
    for (int64_t m = 0; m < M; m++) {
        for (int64_t b = 0; b < nb; b++) {
            const float *xb = x + m * ldx + b * QK;
            __m256 amax = _mm256_setzero_ps(), sum = _mm256_setzero_ps();
            const __m256 sign = _mm256_set1_ps(-0.0f);
            for (int i = 0; i < QK; i += 8) {
                const __m256 v = _mm256_loadu_ps(xb + i);
                amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v));
                sum = _mm256_add_ps(sum, v);
            }
            __m128 mx = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
            mx = _mm_max_ps(mx, _mm_movehl_ps(mx, mx));
            mx = _mm_max_ss(mx, _mm_movehdup_ps(mx));
            const float absmax = _mm_cvtss_f32(mx), total = ai_hsum256(sum);
            /* a NaN or infinite activation makes the block's scale NaN, so the result is NaN too (the max
             * above drops NaNs, and their int16 values would be 0) */
            const float d = isfinite(total) && isfinite(absmax) ? absmax / 32767.0f : NAN;
            const __m256 inv = _mm256_set1_ps(d > 0.0f ? 32767.0f / absmax : 0.0f); /* NaN d: zeros */
            int32_t qi[QK];
            for (int i = 0; i < QK; i += 8)
                _mm256_storeu_si256((__m256i *)(qi + i), _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + i), inv)));
            int16_t *q = a->q + m * K + b * QK;
            for (int j = 0; j < QK / 2; j++) {
                q[j] = (int16_t)qi[2 * j];
                q[QK / 2 + j] = (int16_t)qi[2 * j + 1];
            }
            a->d[m * nb + b] = d;
            a->sum[m * nb + b] = total;
        }
    }
}

/* Weight rows in the kernels' layout (asyncinfer.kernels.pack: the same bytes as ggml's blocks,
 * regrouped per row so that scales load eight at a time):
 *   Q4_1 row: d[nb] (fp16), m[nb] (fp16), then 16 bytes of nibbles per block, as in ggml
 *   Q8_0 row: d[nb] (fp16), then 32 int8 per block
 * Unpacking a block into 16-bit lanes (even elements, then odd ones) takes shifts and masks only. */
static inline void unpack_q4_1(const uint8_t *qs, __m256i w[2]) {
    /* Each 16-bit word of the 16 bytes holds elements 2k (bits 0-3), 2k + 16 (4-7), 2k + 1 (8-11)
     * and 2k + 17 (12-15). Both 128-bit lanes get the bytes and keep their own nibble with a mask:
     * the upper lane's is not shifted down, so it holds 16 q (exact; Q4_1_UPPER undoes it). */
    const __m256i x = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qs));
    const __m256i mask = _mm256_setr_epi16(0x0F, 0x0F, 0x0F, 0x0F, 0x0F, 0x0F, 0x0F, 0x0F,
                                           0xF0, 0xF0, 0xF0, 0xF0, 0xF0, 0xF0, 0xF0, 0xF0);
    w[0] = _mm256_and_si256(x, mask);
    w[1] = _mm256_and_si256(_mm256_srli_epi16(x, 8), mask);
}

/* What unpack_q4_1's upper lane is multiplied by (exact powers of two). */
static inline __m256 q4_1_unscale(void) {
    return _mm256_setr_ps(1.0f, 1.0f, 1.0f, 1.0f, 0.0625f, 0.0625f, 0.0625f, 0.0625f);
}

static inline void unpack_q8_0(const uint8_t *qs, __m256i w[2]) {
    const __m256i x = _mm256_loadu_si256((const __m256i *)qs);
    w[0] = _mm256_srai_epi16(_mm256_slli_epi16(x, 8), 8); /* even elements, sign-extended */
    w[1] = _mm256_srai_epi16(x, 8);                       /* odd elements */
}

/* One weight row against ROWS (1 to MR) activation rows: out[i] = dot(x[m0 + i], row). ROWS is a
 * compile-time constant at every call, so the accumulators stay in registers. Two accumulators per
 * row alternate between blocks, so that consecutive FMAs do not wait on each other; every row is
 * summed in the same order whatever ROWS is, so a row's result does not depend on the others. */
/* A row's result from its two accumulators; with Q4_1's minimums (m16, else NULL), the offset term
 * sum over blocks of m * (the block's sum of x), and the upper lane's 16x undone (unpack_q4_1). */
static inline float finish_row(__m256 acc0, __m256 acc1, const uint16_t *m16, const float *sx, int64_t nb) {
    __m256 sum = _mm256_add_ps(acc0, acc1);
    if (!m16) return ai_hsum256(sum);
    __m256 o = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 8 <= nb; b += 8)
        o = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(m16 + b))), _mm256_loadu_ps(sx + b), o);
    float offset = ai_hsum256(o);
    for (; b < nb; b++) offset += ai_half_to_float(m16[b]) * sx[b];
    return ai_hsum256(_mm256_mul_ps(sum, q4_1_unscale())) + offset;
}

#define ROW_BLOCK(b, slot, UNPACK, QS_BYTES)                                                                      \
    do {                                                                                          \
        _mm_prefetch((const char *)(row + (b) * row_block) + PREFETCH, _MM_HINT_T0);              \
        __m256i w[2];                                                                             \
        UNPACK(qs + (b) * QS_BYTES, w);                                                           \
        const __m256 dw = _mm256_set1_ps(ai_half_to_float(d16[b]));                                  \
        for (int i = 0; i < ROWS; i++) {                                                          \
            const int16_t *q = a->q + (m0 + i) * K + (b) * QK;                                    \
            const __m256i s = _mm256_add_epi32(                                                   \
                _mm256_madd_epi16(w[0], _mm256_loadu_si256((const __m256i *)q)),                  \
                _mm256_madd_epi16(w[1], _mm256_loadu_si256((const __m256i *)(q + 16))));          \
            const __m256 scale = _mm256_mul_ps(_mm256_broadcast_ss(a->d + (m0 + i) * nb + (b)), dw); \
            acc[2 * i + (slot)] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale, acc[2 * i + (slot)]); \
        }                                                                                         \
    } while (0)

#define ROW_KERNEL(NAME, UNPACK, QS_BYTES, HAS_MIN)                                               \
    static inline __attribute__((always_inline)) void NAME(                                       \
        const uint8_t *row, int64_t nb, const acts *a, int64_t m0, int64_t K, const int ROWS,     \
        float *out) {                                                                             \
        const uint16_t *d16 = (const uint16_t *)row;                                              \
        const uint16_t *m16 = d16 + nb;                                                           \
        const uint8_t *qs = row + (HAS_MIN ? 4 : 2) * nb;                                         \
        const int64_t row_block = QS_BYTES + (HAS_MIN ? 4 : 2);                                   \
        __m256 acc[2 * MR];                                                                       \
        for (int i = 0; i < 2 * MR; i++) acc[i] = _mm256_setzero_ps();                            \
        int64_t b = 0; /* blocks alternate between two accumulators; slot indices are constants */ \
        for (; b + 1 < nb; b += 2) {                                                              \
            ROW_BLOCK(b, 0, UNPACK, QS_BYTES);                                                                      \
            ROW_BLOCK(b + 1, 1, UNPACK, QS_BYTES);                                                                  \
        }                                                                                         \
        if (b < nb) ROW_BLOCK(b, 0, UNPACK, QS_BYTES);                                                              \
        for (int i = 0; i < ROWS; i++)                                                            \
            out[i] = finish_row(acc[2 * i], acc[2 * i + 1], HAS_MIN ? m16 : NULL, a->sum + (m0 + i) * nb, nb); \
    }

ROW_KERNEL(row_q4_1, unpack_q4_1, 16, 1)
ROW_KERNEL(row_q8_0, unpack_q8_0, 32, 0)

/* Two weight rows against one activation row (decode at batch 1): the activations are loaded once
 * for both, and the scales d_x * d_w of eight blocks are formed in one vector multiply, each block
 * taking its lane. Each row is summed exactly as ROW_KERNEL sums it (the same products, slots and
 * order), so results do not depend on which kernel ran. */
#define ROW2_BLOCK(b, slot, SCALE0, SCALE1, UNPACK, QS_BYTES)                                     \
    do {                                                                                          \
        ai_prefetch_lines(rows[0] + 2 * (b) * row_block, 2 * row_block); /* Q8_0: 68 bytes, two lines */ \
        const int16_t *q = a->q + (b) * QK;                                                       \
        const __m256i x0 = _mm256_loadu_si256((const __m256i *)q);                                \
        const __m256i x1 = _mm256_loadu_si256((const __m256i *)(q + 16));                         \
        __m256i w[2];                                                                             \
        UNPACK(qs[0] + (b) * QS_BYTES, w);                                                        \
        const __m256i s0 = _mm256_add_epi32(_mm256_madd_epi16(w[0], x0), _mm256_madd_epi16(w[1], x1)); \
        acc[(slot)] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), (SCALE0), acc[(slot)]);             \
        UNPACK(qs[1] + (b) * QS_BYTES, w);                                                        \
        const __m256i s1 = _mm256_add_epi32(_mm256_madd_epi16(w[0], x0), _mm256_madd_epi16(w[1], x1)); \
        acc[2 + (slot)] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), (SCALE1), acc[2 + (slot)]);     \
    } while (0)

#define LANE(v, j) _mm256_permutevar8x32_ps((v), _mm256_set1_epi32(j))
#define ROW2_LANE(j, UNPACK, QS_BYTES) \
    ROW2_BLOCK(b + (j), (j) & 1, LANE(sc0, j), LANE(sc1, j), UNPACK, QS_BYTES)
#define ROW2_ONE(bb, slot, UNPACK, QS_BYTES)                                                      \
    do {                                                                                          \
        const __m256 dx = _mm256_broadcast_ss(a->d + (bb));                                       \
        ROW2_BLOCK(bb, slot, _mm256_mul_ps(dx, _mm256_set1_ps(ai_half_to_float(d16[0][bb]))),        \
                   _mm256_mul_ps(dx, _mm256_set1_ps(ai_half_to_float(d16[1][bb]))), UNPACK, QS_BYTES); \
    } while (0)

#define ROW2_KERNEL(NAME, UNPACK, QS_BYTES, HAS_MIN)                                              \
    static inline __attribute__((always_inline)) void NAME(const uint8_t *row0, const uint8_t *row1, \
                                                           int64_t nb, const acts *a, float *out) { \
        const uint8_t *rows[2] = {row0, row1};                                                    \
        const int64_t row_block = QS_BYTES + (HAS_MIN ? 4 : 2); /* row1 follows row0 */          \
        const uint16_t *d16[2], *m16[2];                                                          \
        const uint8_t *qs[2];                                                                     \
        for (int r = 0; r < 2; r++) {                                                             \
            d16[r] = (const uint16_t *)rows[r];                                                   \
            m16[r] = d16[r] + nb;                                                                 \
            qs[r] = rows[r] + (HAS_MIN ? 4 : 2) * nb;                                             \
        }                                                                                         \
        __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),           \
                         _mm256_setzero_ps()};                                                    \
        int64_t b = 0;                                                                            \
        for (; b + 8 <= nb; b += 8) { /* eight blocks: their scales in one multiply per row */    \
            const __m256 dxv = _mm256_loadu_ps(a->d + b);                                         \
            const __m256 sc0 = _mm256_mul_ps(dxv, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d16[0] + b)))); \
            const __m256 sc1 = _mm256_mul_ps(dxv, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d16[1] + b)))); \
            ROW2_LANE(0, UNPACK, QS_BYTES); ROW2_LANE(1, UNPACK, QS_BYTES);                       \
            ROW2_LANE(2, UNPACK, QS_BYTES); ROW2_LANE(3, UNPACK, QS_BYTES);                       \
            ROW2_LANE(4, UNPACK, QS_BYTES); ROW2_LANE(5, UNPACK, QS_BYTES);                       \
            ROW2_LANE(6, UNPACK, QS_BYTES); ROW2_LANE(7, UNPACK, QS_BYTES);                       \
        }                                                                                         \
        for (; b + 1 < nb; b += 2) { /* b is even here: slots as in ROW_KERNEL */                 \
            ROW2_ONE(b, 0, UNPACK, QS_BYTES);                                                     \
            ROW2_ONE(b + 1, 1, UNPACK, QS_BYTES);                                                 \
        }                                                                                         \
        if (b < nb) ROW2_ONE(b, 0, UNPACK, QS_BYTES);                                             \
        for (int r = 0; r < 2; r++)                                                               \
            out[r] = finish_row(acc[2 * r], acc[2 * r + 1], HAS_MIN ? m16[r] : NULL, a->sum, nb);    \
    }

ROW2_KERNEL(row2_q4_1, unpack_q4_1, 16, 1)
ROW2_KERNEL(row2_q8_0, unpack_q8_0, 32, 0)

#endif /* !AI_AVX512 */

#ifdef AI_AVX512
/* AVX-512 BW: a whole block of 32 int16 products in one register. The activations are in order
 * (quantize_acts_ref); Q4_1's nibbles widen to 16 bits, the low ones are elements 0-15 and the high ones
 * 16-31; Q8_0's bytes sign-extend. Two accumulators per row alternate between blocks. */
static inline __m512i unpack512_q4_1(const uint8_t *qs) {
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)qs));
    const __m256i lo = _mm256_and_si256(b, _mm256_set1_epi16(0x0F)), hi = _mm256_srli_epi16(b, 4);
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

/* Q5_0, Q5_1 from a block's first byte (ggml's blocks as they are, blocks.h): the nibbles as Q4_1's, then the
 * fifth bits (bit i of qh: element i's, lane i's) applied through a mask register: Q5_1 adds 16 where the bit is
 * set, Q5_0 (q = nibble + 16 bit - 16) takes 16 off where it is clear. */

static inline __m512i unpack512_q5_0(const uint8_t *blk) {
    const __m512i w = unpack512_q4_1(blk + 6);
    return _mm512_mask_add_epi16(w, (__mmask32)~ai_u32_at(blk + 2), w, _mm512_set1_epi16(-16));
}

static inline __m512i unpack512_q5_1(const uint8_t *blk) {
    const __m512i w = unpack512_q4_1(blk + 8);
    return _mm512_mask_add_epi16(w, (__mmask32)ai_u32_at(blk + 4), w, _mm512_set1_epi16(16));
}

static inline __m512i unpack512_q8_0(const uint8_t *qs) {
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)qs));
}

/* Two blocks' nibbles at once, from their 32 bytes (block b's 16 bytes, then block b + 1's): one widening, one
 * mask and one shift for both. lo holds elements 0-15 of block b, then of block b + 1; hi elements 16-31 of each:
 * the order quantize_acts512_pairs stores a pair's activations in, so no permutation is needed. The 4-bit rows
 * are bound by the instructions per block, not by memory (docs/formats.md). */
static inline void unpack512_q4_pair(__m256i bytes, __m512i *lo, __m512i *hi) {
    const __m512i b = _mm512_cvtepu8_epi16(bytes);
    *lo = _mm512_and_si512(b, _mm512_set1_epi16(0x0F));
    *hi = _mm512_srli_epi16(b, 4);
}

/* Q4_1's regrouped quants (16 bytes a block, back to back) and Q4_0's blocks in place (18 bytes, quants after the
 * scale; its centre 8 is taken off as 8 times the block's sum of qx, ROW512_BODY_PAIRED's CENTRE), two blocks from
 * qs + b * QS_BYTES. */
#define PAIR512_Q4_1(qs, b, lo, hi) \
    unpack512_q4_pair(_mm256_loadu_si256((const __m256i *)((qs) + (b) * 16)), &(lo), &(hi))
#define PAIR512_Q4_0(qs, b, lo, hi)                                                                               \
    unpack512_q4_pair(_mm256_loadu2_m128i((const __m128i *)((qs) + ((b) + 1) * 18 + 2),                          \
                                          (const __m128i *)((qs) + (b) * 18 + 2)), &(lo), &(hi))
/* Q4_0's nibbles of one block in order, its centre left to CENTRE (the tail block of a row of odd length). */
static inline __m512i unpack512_q4_0_nibbles(const uint8_t *blk) { return unpack512_q4_1(blk + 2); }

/* Block b's product with activation row m0 + i, its scale dx * dw read from sc (formed sixteen blocks at a
 * time, so no scalar conversion or multiply sits in the loop). */
#define ROW512_BLOCK(b, slot, UNPACK, QS_BYTES)                                                   \
    do {                                                                                          \
        _mm_prefetch((const char *)(row + (b) * row_block) + PREFETCH, _MM_HINT_T0);              \
        const __m512i w = UNPACK(qs + (b) * QS_BYTES);                                            \
        for (int i = 0; i < ROWS; i++) {                                                          \
            const __m512i s = _mm512_madd_epi16(w, _mm512_loadu_si512(a->q + (m0 + i) * K + (b) * QK)); \
            acc[2 * i + (slot)] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(sc[i][(b) - b0]), \
                                                  acc[2 * i + (slot)]);                           \
        }                                                                                         \
    } while (0)

/* Blocks b and b + 1 (b even) unpacked together by PAIR against the pair's activations in quantize_acts512_pairs'
 * order: lanes 0-7 of the products' sums are block b's, lanes 8-15 block b + 1's, each block's integer dot product
 * exact over its eight lanes, converted and multiplied by its scale (sc16, lanes moved into place by sel) in one
 * convert and one fma for both blocks, into accumulator `slot` of the row (consecutive pairs alternate, so no
 * fma waits for the one before). */
#define ROW512_PAIR(b, slot, PAIR, QS_BYTES)                                                      \
    do {                                                                                          \
        _mm_prefetch((const char *)(row + (b) * row_block) + PREFETCH, _MM_HINT_T0);              \
        __m512i lo, hi;                                                                           \
        PAIR(qs, b, lo, hi);                                                                      \
        for (int i = 0; i < ROWS; i++) {                                                          \
            const int16_t *xq = a->q + (m0 + i) * K + (b) * QK;                                   \
            const __m512i s = ai_dpwssd512(_mm512_madd_epi16(lo, _mm512_loadu_si512(xq)), hi,     \
                                           _mm512_loadu_si512(xq + QK));                          \
            acc[2 * i + (slot)] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_permutexvar_ps(sel, sc16[i]), \
                                                  acc[2 * i + (slot)]);                           \
        }                                                                                         \
        sel = _mm512_add_epi32(sel, _mm512_set1_epi32(2));                                        \
    } while (0)

/* The scales dx * dw of blocks b0 to b0 + n - 1 (n <= 16) per activation row, and (HAS_MIN) the offset
 * term m * (the block's sum of x) of those blocks added to off. SCALES8(h, dw, mw) sets the __m256 dw / mw to the
 * weight scales / minimums of blocks b0 + h to b0 + h + 7, SCALE1(j, dw, mw) the floats dw / mw to block
 * b0 + j's (the tail of fewer than 16 blocks). */
/* CENTRE (Q4_0's 8, its nibbles multiplied as they are): - CENTRE * (the block's sum of qx) times its scale added
 * to the same terms, in off / tail. With PAIRED, sc16 holds the sixteen scales in registers (the pairs' lanes). */
#define ROW512_SCALES(n, HAS_MIN, SCALES8, SCALE1, CENTRE, PAIRED)                                \
    do {                                                                                          \
        if ((n) == 16) { /* 256 bits at a time (SIMDe's emulation has no 512-bit cvtph) */          \
            __m256 half[MR];                                                                      \
            for (int h = 0; h < 16; h += 8) {                                                     \
                __m256 dw, mw;                                                                    \
                SCALES8(h, dw, mw);                                                               \
                for (int i = 0; i < ROWS; i++) {                                                  \
                    const int64_t at = (m0 + i) * nb + b0 + h;                                    \
                    const __m256 s8 = _mm256_mul_ps(_mm256_loadu_ps(a->d + at), dw);              \
                    _mm256_storeu_ps(sc[i] + h, s8);                                              \
                    if (HAS_MIN) off[i] = _mm256_fmadd_ps(mw, _mm256_loadu_ps(a->sum + at), off[i]); \
                    if (CENTRE)                                                                   \
                        off[i] = _mm256_fmadd_ps(s8, _mm256_mul_ps(_mm256_set1_ps(-(float)(CENTRE)),  \
                                                                   _mm256_loadu_ps(a->isum + at)), off[i]); \
                    if (PAIRED && h == 0) half[i] = s8;                                           \
                    if (PAIRED && h == 8)                                                         \
                        sc16[i] = _mm512_castpd_ps(_mm512_insertf64x4(                            \
                            _mm512_castpd256_pd512(_mm256_castps_pd(half[i])), _mm256_castps_pd(s8), 1)); \
                }                                                                                 \
            }                                                                                     \
        } else {                                                                                  \
            for (int i = 0; i < ROWS; i++) {                                                      \
                for (int64_t j = 0; j < (n); j++) {                                               \
                    float dw, mw;                                                                 \
                    SCALE1(j, dw, mw);                                                            \
                    sc[i][j] = a->d[(m0 + i) * nb + b0 + j] * dw;                                 \
                    if (HAS_MIN) tail[i] += mw * a->sum[(m0 + i) * nb + b0 + j];                  \
                    if (CENTRE) tail[i] += sc[i][j] * (-(float)(CENTRE) * a->isum[(m0 + i) * nb + b0 + j]); \
                }                                                                                 \
                if (PAIRED) sc16[i] = _mm512_loadu_ps(sc[i]);                                     \
            }                                                                                     \
        }                                                                                         \
    } while (0)

/* Q4_1 / Q8_0 rows: the scales (and minimums) are runs of fp16, eight loaded at a time (an unused minimum's load
 * is dropped by the compiler). */
#define PACKED_SCALES8(h, dw, mw)                                                                 \
    (dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d16 + b0 + (h)))),                    \
     mw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(m16 + b0 + (h)))))
#define PACKED_SCALE1(j, dw, mw) (dw = ai_half_to_float(d16[b0 + (j)]), mw = ai_half_to_float(m16[b0 + (j)]))

/* A row's blocks from its stream qs (block b at b * QS_BYTES), the scales of each run of 16 blocks read by SCALES8 /
 * SCALE1 (ROW512_SCALES): two accumulators a row, summed in the same order whatever ROWS is. */
/* With PAIRED, blocks two at a time, unpacked together by PAIR (ROW512_PAIR), against activations in
 * quantize_acts512_pairs' order: the same integer products, each pair's blocks scaled and summed in one register. */
#define ROW512_BODY_PAIRED(UNPACK, QS_BYTES, HAS_MIN, SCALES8, SCALE1, PAIRED, PAIR, CENTRE)        \
    __m512 acc[2 * MR], sc16[MR];                                                                 \
    __m256 off[MR];                                                                               \
    float sc[MR][16], tail[MR];                                                                   \
    for (int i = 0; i < 2 * MR; i++) acc[i] = _mm512_setzero_ps();                                \
    for (int i = 0; i < MR; i++) {                                                                \
        off[i] = _mm256_setzero_ps(), tail[i] = 0.0f, sc16[i] = _mm512_setzero_ps();             \
        for (int j = 0; j < 16; j++) sc[i][j] = 0.0f;                                             \
    }                                                                                             \
    for (int64_t b0 = 0; b0 < nb; b0 += 16) {                                                     \
        const int64_t n = nb - b0 < 16 ? nb - b0 : 16;                                            \
        ROW512_SCALES(n, HAS_MIN, SCALES8, SCALE1, CENTRE, PAIRED);                               \
        __m512i sel = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);           \
        int64_t b = b0;                                                                           \
        if (PAIRED) { /* consecutive pairs alternate between the two accumulators */             \
            for (; b + 3 < b0 + n; b += 4) {                                                      \
                ROW512_PAIR(b, 0, PAIR, QS_BYTES);                                                \
                ROW512_PAIR(b + 2, 1, PAIR, QS_BYTES);                                            \
            }                                                                                     \
            if (b + 1 < b0 + n) {                                                                 \
                ROW512_PAIR(b, 0, PAIR, QS_BYTES);                                                \
                b += 2;                                                                           \
            }                                                                                     \
        } else {                                                                                  \
            for (; b + 1 < b0 + n; b += 2) {                                                      \
                ROW512_BLOCK(b, 0, UNPACK, QS_BYTES);                                             \
                ROW512_BLOCK(b + 1, 1, UNPACK, QS_BYTES);                                         \
            }                                                                                     \
        }                                                                                         \
        (void)sel;                                                                                \
        if (b < b0 + n) ROW512_BLOCK(b, 0, UNPACK, QS_BYTES);                                     \
    }                                                                                             \
    for (int i = 0; i < ROWS; i++)                                                                \
        out[i] = _mm512_reduce_add_ps(_mm512_add_ps(acc[2 * i], acc[2 * i + 1])) +                \
                 (HAS_MIN || (CENTRE) ? ai_hsum256(off[i]) + tail[i] : 0.0f);

#define ROW512_KERNEL(NAME, UNPACK, QS_BYTES, HAS_MIN, PAIRED, PAIR)                             \
    static inline __attribute__((always_inline)) void NAME(                                       \
        const uint8_t *row, int64_t nb, const acts *a, int64_t m0, int64_t K, const int ROWS,     \
        float *out) {                                                                             \
        const uint16_t *d16 = (const uint16_t *)row, *m16 = d16 + nb;                             \
        const uint8_t *qs = row + (HAS_MIN ? 4 : 2) * nb;                                         \
        const int64_t row_block = QS_BYTES + (HAS_MIN ? 4 : 2);                                   \
        ROW512_BODY_PAIRED(UNPACK, QS_BYTES, HAS_MIN, PACKED_SCALES8, PACKED_SCALE1, PAIRED, PAIR, 0) \
    }

ROW512_KERNEL(row_q4_1, unpack512_q4_1, 16, 1, 1, PAIR512_Q4_1)
ROW512_KERNEL(row_q8_0, unpack512_q8_0, 32, 0, 0, PAIR512_Q4_1)

/* ggml's 32-weight blocks in place (Q4_0, Q5_0, Q5_1): the first four bytes of eight blocks `bytes` apart from p
 * are each block's fp16 scale (bits 0-15) and Q5_1's minimum (bits 16-31); inserted into two vectors straight from
 * memory (a run of small stores read back as one vector would wait for the stores: no store forwarding), their
 * halves packed in order and widened to eight floats each (an unused minimum is dropped by the compiler). */
static inline int32_t ggml_word(const uint8_t *p) {
    int32_t w;
    memcpy(&w, p, 4);
    return w;
}

static inline void ggml_scales8(const uint8_t *p, int64_t bytes, __m256 *dw, __m256 *mw) {
    __m128i lo = _mm_cvtsi32_si128(ggml_word(p)), hi = _mm_cvtsi32_si128(ggml_word(p + 4 * bytes));
    lo = _mm_insert_epi32(lo, ggml_word(p + bytes), 1);
    hi = _mm_insert_epi32(hi, ggml_word(p + 5 * bytes), 1);
    lo = _mm_insert_epi32(lo, ggml_word(p + 2 * bytes), 2);
    hi = _mm_insert_epi32(hi, ggml_word(p + 6 * bytes), 2);
    lo = _mm_insert_epi32(lo, ggml_word(p + 3 * bytes), 3);
    hi = _mm_insert_epi32(hi, ggml_word(p + 7 * bytes), 3);
    const __m128i low16 = _mm_set1_epi32(0xFFFF);
    *dw = _mm256_cvtph_ps(_mm_packus_epi32(_mm_and_si128(lo, low16), _mm_and_si128(hi, low16)));
    *mw = _mm256_cvtph_ps(_mm_packus_epi32(_mm_srli_epi32(lo, 16), _mm_srli_epi32(hi, 16)));
}
#define GGML_SCALES8(h, dw, mw) ggml_scales8(row + (b0 + (h)) * bytes, bytes, &(dw), &(mw))
/* Q4_0's eight scales from its 18-byte blocks (nine 16-bit words each: block j's scale is word 9 j) in two 64-byte
 * loads and one word permutation, where ggml_scales8 reads them one at a time: the 128 bytes lie within the eight
 * blocks' 144. */
static inline __m256 q4_0_scales8(const uint8_t *p) {
    static const int16_t words[32] = {0, 9, 18, 27, 36, 45, 54, 63};
    const __m512i w = _mm512_permutex2var_epi16(_mm512_loadu_si512(p), _mm512_loadu_si512(words),
                                                _mm512_loadu_si512(p + 64));
    return _mm256_cvtph_ps(_mm512_castsi512_si128(w));
}
#define Q4_0_SCALES8(h, dw, mw) (dw = q4_0_scales8(row + (b0 + (h)) * 18), mw = dw)
#define GGML_SCALE1(j, dw, mw) (dw = ai_half_at(row + (b0 + (j)) * bytes), mw = ai_half_at(row + (b0 + (j)) * bytes + 2))

/* Q4_0, Q5_0, Q5_1: ROW512_KERNEL's work on ggml's blocks in place (BYTES a block, its fp16 scale first and Q5_1's
 * minimum after it): the same products, slots and order of sums, the scales of each run of 16 blocks gathered
 * from the blocks (the stream ROW512_BLOCK reads, qs, is the row itself, block b at b * BYTES). */
#define ROW512_GGML_KERNEL(NAME, UNPACK, BYTES, HAS_MIN, PAIRED, PAIR, SCALES8, CENTRE)          \
    static inline __attribute__((always_inline)) void NAME(                                       \
        const uint8_t *row, int64_t nb, const acts *a, int64_t m0, int64_t K, const int ROWS,     \
        float *out) {                                                                             \
        const uint8_t *qs = row;                                                                  \
        const int64_t bytes = BYTES, row_block = BYTES;                                           \
        ROW512_BODY_PAIRED(UNPACK, BYTES, HAS_MIN, SCALES8, GGML_SCALE1, PAIRED, PAIR, CENTRE)    \
    }

ROW512_GGML_KERNEL(row512_q4_0, unpack512_q4_0_nibbles, 18, 0, 1, PAIR512_Q4_0, Q4_0_SCALES8, 8)
ROW512_GGML_KERNEL(row512_q5_0, unpack512_q5_0, 22, 0, 0, PAIR512_Q4_0, GGML_SCALES8, 0)
ROW512_GGML_KERNEL(row512_q5_1, unpack512_q5_1, 24, 1, 0, PAIR512_Q4_0, GGML_SCALES8, 0)
#endif /* AI_AVX512 */

#ifndef AI_AVX512
/* Batches of PANEL_MIN_ROWS activation rows or more in the AVX2 build (the AVX-512 builds take the int16 tile,
 * gemm8.c): each thread rebuilds TN weight rows at a time in
 * float32 (the blocks' exact values) and multiplies them by the float32 activations (not rounded;
 * packed per tile, see pack_acts) in register tiles of 6 weight rows x 16 tokens (12 rows x 8 for the
 * last 8 or fewer): one weight broadcast and one FMA per 8 products, no horizontal sums. The rebuild
 * is paid once per weight row and pass (see PANEL_PASS_BYTES). Each output is one float32 sum over k
 * in order, in its own lane, so a row's result never depends on the other rows of the call. */

/* One row's weights in float32, in order: Q4_1 d * q + m (one rounding), Q8_0 d * q. */
static void rebuild_row(const uint8_t *row, int64_t nb, int has_min, float *out) {
    const uint16_t *d16 = (const uint16_t *)row, *m16 = d16 + nb;
    const uint8_t *qs = row + (has_min ? 4 : 2) * nb;
    if (has_min) {
        const __m256i low = _mm256_set1_epi32(0x0F);
        for (int64_t b = 0; b < nb; b++, out += QK) {
            const __m256 d = _mm256_set1_ps(ai_half_to_float(d16[b])), m = _mm256_set1_ps(ai_half_to_float(m16[b]));
            for (int h = 0; h < 2; h++) { /* bytes 8h to 8h + 7: elements 8h on (low nibbles), 16 + 8h on (high) */
                const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 16 * b + 8 * h)));
                _mm256_storeu_ps(out + 8 * h, _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(v, low)), m));
                _mm256_storeu_ps(out + 16 + 8 * h, _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)), m));
            }
        }
    } else {
        for (int64_t b = 0; b < nb; b++, out += QK) {
            const __m256 d = _mm256_set1_ps(ai_half_to_float(d16[b]));
            for (int h = 0; h < 4; h++) {
                const __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 32 * b + 8 * h)));
                _mm256_storeu_ps(out + 8 * h, _mm256_mul_ps(d, _mm256_cvtepi32_ps(v)));
            }
        }
    }
}

/* The activations in the tiles' order: tokens in tiles of 16 (the last 8 or fewer in one of 8), each
 * tile's [K, W] floats stored contiguously at xt + m0 * K, tokens past M zero. Eight tokens by eight
 * k at a time, transposed in registers; called inside the parallel region, each thread filling its
 * share (the loop's barrier ends it). */
static inline int64_t tile_width(int64_t m0, int64_t Mp) { return Mp - m0 >= 16 ? 16 : 8; }

static void pack_acts(const float *x, int64_t M, int64_t ldx, int64_t K, int64_t Mp, float *xt) {
    const int64_t kb = K / 8;
    _Pragma("omp for schedule(static)")
    for (int64_t item = 0; item < (Mp / 8) * kb; item++) {
        const int64_t g8 = item / kb, k = (item % kb) * 8, m8 = g8 * 8;
        const int64_t m0 = m8 / 16 * 16, W = tile_width(m0, Mp), lane = m8 - m0;
        __m256 r[8];
        for (int i = 0; i < 8; i++)
            r[i] = m8 + i < M ? _mm256_loadu_ps(x + (m8 + i) * ldx + k) : _mm256_setzero_ps();
        /* 8 x 8 transpose: r[i][j] -> t[j][i] */
        const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
        const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
        const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
        const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
        const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
        const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
        const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
        const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
        const __m256 c[8] = {_mm256_permute2f128_ps(u0, u4, 0x20), _mm256_permute2f128_ps(u1, u5, 0x20),
                             _mm256_permute2f128_ps(u2, u6, 0x20), _mm256_permute2f128_ps(u3, u7, 0x20),
                             _mm256_permute2f128_ps(u0, u4, 0x31), _mm256_permute2f128_ps(u1, u5, 0x31),
                             _mm256_permute2f128_ps(u2, u6, 0x31), _mm256_permute2f128_ps(u3, u7, 0x31)};
        float *dst = xt + m0 * K + k * W + lane;
        for (int j = 0; j < 8; j++) _mm256_storeu_ps(dst + j * W, c[j]);
    }
}

/* RW panel rows from row J0 on against the tile of W8 x 8 tokens at m0, into y (the rows below nr and
 * the tokens below M). The accumulators are named by constant indices only, so they stay in
 * registers: 12 of them, W8 activation vectors and one broadcast weight. */
#define PANEL_TILE(RW, W8, J0)                                                                     \
    do {                                                                                          \
        __m256 acc[RW][W8];                                                                       \
        for (int j = 0; j < RW; j++)                                                              \
            for (int v = 0; v < W8; v++) acc[j][v] = _mm256_setzero_ps();                         \
        const float *xc = xt + m0 * K, *pw = panel + (J0) * K;                                    \
        for (int64_t k = 0; k < K; k++, xc += 8 * W8) {                                           \
            __m256 xv[W8];                                                                        \
            for (int v = 0; v < W8; v++) xv[v] = _mm256_loadu_ps(xc + 8 * v);                     \
            for (int j = 0; j < RW; j++) {                                                        \
                const __m256 wv = _mm256_broadcast_ss(pw + j * K + k);                            \
                for (int v = 0; v < W8; v++) acc[j][v] = _mm256_fmadd_ps(wv, xv[v], acc[j][v]);   \
            }                                                                                     \
        }                                                                                         \
        float o[RW][8 * W8];                                                                      \
        for (int j = 0; j < RW; j++)                                                              \
            for (int v = 0; v < W8; v++) _mm256_storeu_ps(o[j] + 8 * v, acc[j][v]);               \
        for (int64_t j = 0; j < RW && (J0) + j < nr; j++) {                                       \
            const int64_t n = n0 + (J0) + j;                                                      \
            const float bn = bias ? bias[n] : 0.0f;                                               \
            for (int64_t i = 0; i < 8 * W8 && m0 + i < M; i++) y[(m0 + i) * ldy + n] = o[j][i] + bn; \
        }                                                                                         \
    } while (0)


/* Tokens per pass over the weights: their packed activations (at most this many bytes) stay in a
 * core's L2 cache while every weight row passes; a bigger batch takes several passes, each
 * rebuilding the weights again (a small cost next to its FMAs). */
#ifndef PANEL_PASS_BYTES
#define PANEL_PASS_BYTES (384 * 1024)
#endif

/* blocks.h's formats: ai_rebuild_blocks with the format a constant in each branch (each its own loop). */
static void rebuild_blocks_row(int fmt, const uint8_t *row, int64_t K, float *out) {
    switch (fmt) {
        case ASYNCINFER_FMT_Q4_0: ai_rebuild_blocks(ASYNCINFER_FMT_Q4_0, row, K, out); return;
        case ASYNCINFER_FMT_Q5_0: ai_rebuild_blocks(ASYNCINFER_FMT_Q5_0, row, K, out); return;
        case ASYNCINFER_FMT_Q5_1: ai_rebuild_blocks(ASYNCINFER_FMT_Q5_1, row, K, out); return;
        case ASYNCINFER_FMT_Q4_K: ai_rebuild_blocks(ASYNCINFER_FMT_Q4_K, row, K, out); return;
        case ASYNCINFER_FMT_Q5_K: ai_rebuild_blocks(ASYNCINFER_FMT_Q5_K, row, K, out); return;
        default: ai_rebuild_blocks(ASYNCINFER_FMT_Q6_K, row, K, out); return;
    }
}

static int gemm_panel(const float *x, int64_t M, int64_t ldx, int64_t K, const uint8_t *rows, int64_t N, int fmt,
                      const float *bias, float *y, int64_t ldy, int threads, float *xt) {
    const int64_t nb = K / QK, groups = (N + TN - 1) / TN, Mp = (M + 7) / 8 * 8;
    const int64_t row_bytes = K / ai_fmt_weights(fmt) * ai_fmt_bytes(fmt);
    const int legacy = fmt == ASYNCINFER_FMT_Q4_1 || fmt == ASYNCINFER_FMT_Q8_0, has_min = fmt == ASYNCINFER_FMT_Q4_1;
    if (K == 0) { /* empty sums: the bias, as the row kernels give */
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = 0; n < N; n++) y[m * ldy + n] = bias ? bias[n] : 0.0f;
        return 0;
    }
    int64_t pass = PANEL_PASS_BYTES / (4 * K) / 16 * 16;
    pass = pass < 16 ? 16 : pass;
    float *panels = (float *)ai_alloc((int64_t)(threads > 1 ? threads : 1) * TN, K * (int64_t)sizeof(float));
    if (!panels) return ASYNCINFER_ENOMEM;
    _Pragma("omp parallel num_threads(threads) if(threads > 1)")
    {
        pack_acts(x, M, ldx, K, Mp, xt);
        float *panel = panels + (int64_t)ai_thread_num() * TN * K;
        for (int64_t p0 = 0; p0 < Mp; p0 += pass) {
            const int64_t p1 = Mp - p0 < pass ? Mp : p0 + pass;
            _Pragma("omp for schedule(static)")
            for (int64_t g = 0; g < groups; g++) {
                const int64_t n0 = g * TN, nr = N - n0 < TN ? N - n0 : TN;
                for (int64_t r = 0; r < nr; r++) {
                    if (legacy)
                        rebuild_row(rows + (n0 + r) * row_bytes, nb, has_min, panel + r * K);
                    else
                        rebuild_blocks_row(fmt, rows + (n0 + r) * row_bytes, K, panel + r * K);
                }
                for (int64_t r = nr; r < TN; r++) memset(panel + r * K, 0, sizeof(float) * (size_t)K);
                for (int64_t m0 = p0; m0 < p1; m0 += 16) {
                    if (tile_width(m0, Mp) == 16) {
                        PANEL_TILE(6, 2, 0);
                        if (nr > 6) PANEL_TILE(6, 2, 6);
                    } else {
                        PANEL_TILE(12, 1, 0);
                    }
                }
            }
        }
    }
    free(panels);
    return 0;
}
#endif /* !AI_AVX512 */

#endif /* AI_AVX2 */

/* ------------------------------------------------------------------------------------------------
 * The entry points: M < PANEL_MIN_ROWS through the row kernels, from it on through BATCHED (the AVX-512
 * builds' int16 tile, the AVX2 build's panel). */
#ifdef AI_AVX2
#ifdef AI_AVX512
/* quantize_acts_ref's rounding, eight lanes at a time (the same int16 values: both round to nearest even; the
 * block's sum is added in another order), each block's 32 values stored as LAYOUT says: ACTS_IN_ORDER, or per pair
 * of blocks b, b + 1 (b even) ACTS_PAIRS (elements 0-15 of block b, 0-15 of block b + 1, 16-31 of b, 16-31 of b + 1;
 * a row's odd last block in order; and each block's integer sum of its values, isum, exact as a float: the Q4_0 /
 * Q4_1 rows, ROW512_PAIR) or ACTS_PAIRS_EO (the even elements of block b, of block b + 1, then the odd ones of each;
 * rows of whole pairs: row512_q4_k). */
enum { ACTS_IN_ORDER, ACTS_PAIRS, ACTS_PAIRS_EO };
static inline __attribute__((always_inline)) void quantize_acts512_as(const float *x, int64_t M, int64_t ldx,
                                                                      int64_t K, acts *a, const int LAYOUT) {
    const int64_t nb = K / QK;
    const __m512i even_odd = _mm512_setr_epi32(0x00020000, 0x00060004, 0x000A0008, 0x000E000C, 0x00120010,
                                               0x00160014, 0x001A0018, 0x001E001C, 0x00030001, 0x00070005,
                                               0x000B0009, 0x000F000D, 0x00130011, 0x00170015, 0x001B0019,
                                               0x001F001D);
    for (int64_t m = 0; m < M; m++) {
        for (int64_t b = 0; b < nb; b++) {
            __m256i q[4];
            float total;
            const float d = ai_round_run(x + m * ldx + b * QK, 32767.0f, q, &total);
            /* packs works within 128-bit lanes: [q0 0-3, q1 0-3, q0 4-7, q1 4-7]; the permute restores order */
            __m256i lo = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xD8),
                    hi = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2], q[3]), 0xD8);
            int16_t *out = a->q + m * K + b * QK;
            int64_t second = 16; /* where hi goes, from out */
            if (LAYOUT == ACTS_PAIRS_EO) {
                const __m512i eo =
                    _mm512_permutexvar_epi16(even_odd, _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1));
                lo = _mm512_castsi512_si256(eo), hi = _mm512_extracti64x4_epi64(eo, 1);
            }
            if (LAYOUT != ACTS_IN_ORDER && (b + 1 < nb || (b & 1))) {
                out = a->q + m * K + (b & ~(int64_t)1) * QK + (b & 1) * 16;
                second = 32;
            }
            _mm256_storeu_si256((__m256i *)out, lo);
            _mm256_storeu_si256((__m256i *)(out + second), hi);
            a->d[m * nb + b] = d;
            a->sum[m * nb + b] = total;
            if (LAYOUT == ACTS_PAIRS) {
                const __m256i t8 = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
                __m128i t = _mm_add_epi32(_mm256_castsi256_si128(t8), _mm256_extracti128_si256(t8, 1));
                t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
                t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
                a->isum[m * nb + b] = (float)_mm_cvtsi128_si32(t);
            }
        }
    }
}
static void quantize_acts_avx512(const float *x, int64_t M, int64_t ldx, int64_t K, acts *a) {
    quantize_acts512_as(x, M, ldx, K, a, ACTS_IN_ORDER);
}
static void quantize_acts512_pairs(const float *x, int64_t M, int64_t ldx, int64_t K, acts *a) {
    quantize_acts512_as(x, M, ldx, K, a, ACTS_PAIRS);
}
static void quantize_acts512_pairs_eo(const float *x, int64_t M, int64_t ldx, int64_t K, acts *a) {
    quantize_acts512_as(x, M, ldx, K, a, ACTS_PAIRS_EO);
}

void ai_quantize_acts16(const float *x, int64_t M, int64_t ldx, int64_t K, int16_t *q, float *d, float *sum) {
    acts a = {q, d, sum, NULL};
    quantize_acts_avx512(x, M, ldx, K, &a);
}
/* From PANEL_MIN_ROWS rows on: the int16 tile (gemm8.c; it allocates its own working memory). */
#define BATCHED(FMT, x, M, ldx, K, rows, N, bias, y, ldy, threads, scratch) \
    ((void)(scratch), ai_tile16_gemm(FMT, x, M, ldx, K, rows, N, bias, y, ldy, threads))

/* The rounding a format's rows read: the pair layouts for the paired rows. */
#define QUANTIZE_ACTS_OF(FMT)                                                                                  \
    ((FMT) == ASYNCINFER_FMT_Q4_1 || (FMT) == ASYNCINFER_FMT_Q4_0 ? quantize_acts512_pairs                     \
     : (FMT) == ASYNCINFER_FMT_Q4_K                               ? quantize_acts512_pairs_eo                  \
                                                                  : quantize_acts_avx512)
#else
#define QUANTIZE_ACTS_OF(FMT) quantize_acts_avx2
/* From PANEL_MIN_ROWS rows on: the float32 panel. */
#define BATCHED(FMT, x, M, ldx, K, rows, N, bias, y, ldy, threads, scratch) \
    gemm_panel(x, M, ldx, K, rows, N, FMT, bias, y, ldy, threads, (float *)scratch)
#endif

#define GEMM(NAME, ROW, ROW2, ROW_BYTES, FMT)                                                     \
    int NAME(const float *x, int64_t M, int64_t ldx, int64_t K, const void *w, int64_t N, const float *bias, \
             float *y, int64_t ldy, int threads, void *scratch) {                                 \
        const int64_t nb = K / QK;                                                                \
        const uint8_t *rows = (const uint8_t *)w;                                                 \
        if (M >= PANEL_MIN_ROWS)                                                                  \
            return BATCHED(FMT, x, M, ldx, K, rows, N, bias, y, ldy, threads, scratch);            \
        acts a = acts_in(scratch, M, K);                                                          \
        QUANTIZE_ACTS_OF(FMT)(x, M, ldx, K, &a);                                                  \
        if (M == 1 && ROW2_PAIRS) { /* pairs of weight rows; an odd last row through ROW */       \
            _Pragma("omp parallel for schedule(static) num_threads(threads) if(threads > 1)")    \
            for (int64_t p = 0; p < (N + 1) / 2; p++) {                                           \
                const int64_t n = 2 * p;                                                          \
                float out[MR];                                                                    \
                if (n + 1 < N) {                                                                  \
                    ROW2(rows + n * nb * ROW_BYTES, rows + (n + 1) * nb * ROW_BYTES, nb, &a, out); \
                    y[n + 1] = out[1] + (bias ? bias[n + 1] : 0.0f);                              \
                } else {                                                                          \
                    ROW(rows + n * nb * ROW_BYTES, nb, &a, 0, K, 1, out);                         \
                }                                                                                 \
                y[n] = out[0] + (bias ? bias[n] : 0.0f);                                          \
            }                                                                                     \
            return 0;                                                                             \
        }                                                                                         \
        _Pragma("omp parallel for schedule(static) num_threads(threads) if(threads > 1)")        \
        for (int64_t n = 0; n < N; n++) {                                                         \
            const uint8_t *row = rows + n * nb * ROW_BYTES;                                       \
            const float b = bias ? bias[n] : 0.0f;                                                \
            for (int64_t m0 = 0; m0 < M; m0 += MR) {                                              \
                const int rows_now = (int)(M - m0 < MR ? M - m0 : MR);                            \
                float out[MR];                                                                    \
                switch (rows_now) {                                                               \
                    case 1: ROW(row, nb, &a, m0, K, 1, out); break;                               \
                    case 2: ROW(row, nb, &a, m0, K, 2, out); break;                               \
                    case 3: ROW(row, nb, &a, m0, K, 3, out); break;                               \
                    default: ROW(row, nb, &a, m0, K, 4, out); break;                              \
                }                                                                                 \
                for (int i = 0; i < rows_now; i++) y[(m0 + i) * ldy + n] = out[i] + b;            \
            }                                                                                     \
        }                                                                                         \
        return 0;                                                                                 \
    }

#ifdef AI_AVX512
#define ROW2_PAIRS 0 /* one row kernel for every M: the 512-bit block already fills a register */
static inline void row2_none(const uint8_t *r0, const uint8_t *r1, int64_t nb, const acts *a, float *out) {
    (void)r0; (void)r1; (void)nb; (void)a; (void)out;
}
GEMM(ai_gemm_q4_1, row_q4_1, row2_none, ROW_BYTES_Q4_1, ASYNCINFER_FMT_Q4_1)
GEMM(ai_gemm_q8_0, row_q8_0, row2_none, ROW_BYTES_Q8_0, ASYNCINFER_FMT_Q8_0)
#else
#define ROW2_PAIRS 1
GEMM(ai_gemm_q4_1, row_q4_1, row2_q4_1, ROW_BYTES_Q4_1, ASYNCINFER_FMT_Q4_1)
GEMM(ai_gemm_q8_0, row_q8_0, row2_q8_0, ROW_BYTES_Q8_0, ASYNCINFER_FMT_Q8_0)
#endif

/* Q4_0, Q5_0, Q5_1 in the AVX2 build (the AVX-512 build's: row512_q4_0 / row512_q5_0 / row512_q5_1): one weight
 * row against ROWS (1 to MR, a constant at every call) activation rows, a block at a time (ai_sub_words: its
 * integer quants in the activations' order), scaled by dx * the block's scale, plus the min's term per block in
 * float32. One accumulator per row; every row is summed in the same order whatever ROWS is. */
static inline __attribute__((always_inline)) void row_blocks(const int fmt, const uint8_t *row, int64_t K,
                                                             const acts *a, int64_t m0, const int ROWS, float *out) {
    const int64_t nb = K / QK, bytes = ai_fmt_bytes(fmt);
    __m256 acc[MR];
    float offset[MR];
    for (int i = 0; i < MR; i++) {
        acc[i] = _mm256_setzero_ps();
        offset[i] = 0.0f;
    }
    for (int64_t blk = 0; blk < nb; blk++) {
        const uint8_t *p = row + blk * bytes;
        _mm_prefetch((const char *)p + PREFETCH, _MM_HINT_T0);
        float scale[8], min[8];
        ai_block_scales(fmt, p, scale, min);
        __m256i w[2];
        ai_sub_words(fmt, p, w);
        for (int i = 0; i < ROWS; i++) {
            const int16_t *q = a->q + (m0 + i) * K + blk * QK;
            const __m256i s = ai_dpwssd256(_mm256_madd_epi16(w[0], _mm256_loadu_si256((const __m256i *)q)), w[1],
                                           _mm256_loadu_si256((const __m256i *)(q + 16)));
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(a->d[(m0 + i) * nb + blk] * scale[0]), acc[i]);
            if (ai_fmt_has_min(fmt)) offset[i] += min[0] * a->sum[(m0 + i) * nb + blk];
        }
    }
    for (int i = 0; i < ROWS; i++) out[i] = ai_hsum256(acc[i]) + offset[i];
}

/* The k-quant rows of the AVX2 and AVX-512 builds. A block's 32 activations are stored as the build rounds
 * them (quantize_acts_avx2: its even elements, then its odd ones; the AVX-512 build: in order), and the
 * quants are unpacked straight into the 16-bit lanes that meet them: w0 against stored values 0-15, w1
 * against 16-31, with shifts and masks of whole words (AVX2) or widened from 16 bytes (AVX-512, in order). The
 * sub-blocks' scales (and Q4_K / Q5_K's minimums) come out of the block's bytes eight at a time, as vectors.
 * Two accumulators a row (even and odd sub-blocks), so that consecutive multiply-adds do not wait on each
 * other; every row is summed in the same order whatever ROWS is. */

/* The int32 lanes of w0 * x0 and w1 * x1 (madd's pair sums) added into one vector: any lanes (one scale for all
 * 32, KQ_ADD; one fused instruction with VNNI), or lanes 0-3 from elements 0-15 and 4-7 from 16-31 (Q6_K's two
 * scales, KQ_HALVES: the AVX2 build's, whose order puts elements below 16 in lanes 0-3 of each of the two
 * products already, so adding keeps the halves apart). */
#define KQ_ADD(w0, x0, w1, x1) ai_dpwssd256(_mm256_madd_epi16((w0), (x0)), (w1), (x1))
#define KQ_HALVES KQ_ADD

/* One sub-block's integer dot product against ROWS activation rows, scaled and added: w0 / w1 its quants (see
 * above), COMBINE KQ_ADD or KQ_HALVES, SV (an expression of the activation row i) dx times the sub-block's
 * weight scale in every lane (Q6_K: one per half of 16, lanes 0-3 and 4-7). */
#define KQ_SUB(j, slot, w0, w1, COMBINE, SV)                                                      \
    do {                                                                                          \
        for (int i = 0; i < ROWS; i++) {                                                          \
            const int16_t *q = a->q + (m0 + i) * K + (blk * 8 + (j)) * QK;                        \
            const __m256i s = COMBINE((w0), _mm256_loadu_si256((const __m256i *)q), (w1),         \
                                      _mm256_loadu_si256((const __m256i *)(q + 16)));              \
            acc[i][slot] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), SV, acc[i][slot]);              \
        }                                                                                         \
    } while (0)

/* Bit j (< 8) of each 16-bit lane of h moved to bit 4, the others cleared. */
static inline __m256i kq_bit_to_4(__m256i h, int j) {
    return _mm256_and_si256(j <= 4 ? _mm256_slli_epi16(h, 4 - j) : _mm256_srli_epi16(h, j - 4), _mm256_set1_epi16(0x10));
}

/* Q4_K / Q5_K: bytes 32 p to 32 p + 31 of the nibbles hold sub-blocks 2 p (low nibbles) and 2 p + 1 (high).
 * AVX2 order, in 16-bit words: word l's bits 0-3 / 8-11 are sub-block 2 p's elements 2 l / 2 l + 1, bits 4-7 /
 * 12-15 sub-block 2 p + 1's. Q5_K's fifth bit of sub-block j's element i is bit j of qh[i]: in words, bit j
 * (even elements) and bit 8 + j (odd), moved to bit 4. In order (AVX-512 builds, Q5_K only: their Q4_K rows are
 * row512_q4_k): the 32 bytes widened to two runs of 16 words, each word's low and high nibble; qh widened the same
 * way. */
static inline __attribute__((always_inline)) void row_q45_k(const int fmt, const uint8_t *row, int64_t K,
                                                            const acts *a, int64_t m0, const int ROWS, float *out) {
    const int five = fmt == ASYNCINFER_FMT_Q5_K;
    const int64_t nblk = K / 256, bytes = ai_fmt_bytes(fmt), nb = K / QK;
    const __m256i low4 = _mm256_set1_epi16(0x0F);
    __m256 acc[MR][2], off[MR];
    for (int i = 0; i < MR; i++) acc[i][0] = acc[i][1] = off[i] = _mm256_setzero_ps();
    for (int64_t blk = 0; blk < nblk; blk++) {
        const uint8_t *p = row + blk * bytes;
        ai_prefetch_lines(p, bytes);
        __m256 minv;
        const __m256 scv = ai_k_scale_vectors(p, &minv);
        float dsc[MR][8]; /* dx * scale of each sub-block, per activation row */
        for (int i = 0; i < ROWS; i++) {
            const int64_t at = (m0 + i) * nb + blk * 8;
            _mm256_storeu_ps(dsc[i], _mm256_mul_ps(_mm256_loadu_ps(a->d + at), scv));
            off[i] = _mm256_fmadd_ps(minv, _mm256_loadu_ps(a->sum + at), off[i]);
        }
        const uint8_t *qs = p + (five ? 48 : 16);
#ifdef AI_AVX512
        const __m256i h0 = five ? _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(p + 16))) : _mm256_setzero_si256();
        const __m256i h1 = five ? _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(p + 32))) : _mm256_setzero_si256();
#else
        const __m256i h = five ? _mm256_loadu_si256((const __m256i *)(p + 16)) : _mm256_setzero_si256();
#endif
#pragma GCC unroll 4
        for (int pr = 0; pr < 4; pr++) {
            const int j0 = 2 * pr, j1 = 2 * pr + 1;
#ifdef AI_AVX512
            const __m256i x0 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(qs + 32 * pr)));
            const __m256i x1 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(qs + 32 * pr + 16)));
            __m256i a0 = _mm256_and_si256(x0, low4), a1 = _mm256_and_si256(x1, low4); /* sub-block j0 */
            __m256i b0 = _mm256_srli_epi16(x0, 4), b1 = _mm256_srli_epi16(x1, 4);      /* sub-block j1 */
            if (five) {
                a0 = _mm256_or_si256(a0, kq_bit_to_4(h0, j0));
                a1 = _mm256_or_si256(a1, kq_bit_to_4(h1, j0));
                b0 = _mm256_or_si256(b0, kq_bit_to_4(h0, j1));
                b1 = _mm256_or_si256(b1, kq_bit_to_4(h1, j1));
            }
#else
            const __m256i x = _mm256_loadu_si256((const __m256i *)(qs + 32 * pr));
            __m256i a0 = _mm256_and_si256(x, low4), a1 = _mm256_and_si256(_mm256_srli_epi16(x, 8), low4);
            __m256i b0 = _mm256_and_si256(_mm256_srli_epi16(x, 4), low4), b1 = _mm256_srli_epi16(x, 12);
            if (five) {
                a0 = _mm256_or_si256(a0, kq_bit_to_4(h, j0));
                b0 = _mm256_or_si256(b0, kq_bit_to_4(h, j1));
                a1 = _mm256_or_si256(a1, kq_bit_to_4(_mm256_srli_epi16(h, 8), j0));
                b1 = _mm256_or_si256(b1, kq_bit_to_4(_mm256_srli_epi16(h, 8), j1));
            }
#endif
            KQ_SUB(j0, 0, a0, a1, KQ_ADD, _mm256_broadcast_ss(&dsc[i][j0]));
            KQ_SUB(j1, 1, b0, b1, KQ_ADD, _mm256_broadcast_ss(&dsc[i][j1]));
        }
    }
    for (int i = 0; i < ROWS; i++) out[i] = ai_hsum256(_mm256_add_ps(acc[i][0], acc[i][1])) + ai_hsum256(off[i]);
}

#ifndef AI_AVX512
/* Q6_K (the AVX2 build; the AVX-512 builds' row512_q6_k is below): sub-block j = 4 n + k's quants (blocks.h: low or
 * high nibbles of ql, a bit pair of qh) made and centred as bytes, then widened to 16-bit lanes (even and odd
 * words); its two int8 scales (one per half of 16) multiply, in float32, the lanes of the integer sums that hold
 * each half (KQ_HALVES: 0-3 and 4-7). */
static inline __attribute__((always_inline)) void row_q6_k(const uint8_t *row, int64_t K, const acts *a, int64_t m0,
                                                           const int ROWS, float *out) {
    const int64_t nblk = K / 256, nb = K / QK;
    const __m256i centre = _mm256_set1_epi8(32);
    __m256 acc[MR][2];
    for (int i = 0; i < MR; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t blk = 0; blk < nblk; blk++) {
        const uint8_t *p = row + blk * 210;
        ai_prefetch_lines(p, 210);
        const __m128i s16 = _mm_loadu_si128((const __m128i *)(p + 192));
        const __m256 d = _mm256_set1_ps(ai_half_at(p + 208));
        const __m256 half_sc[2] = {_mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s16))),
                                   _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(s16, 8))))};
#pragma GCC unroll 2
        for (int n = 0; n < 2; n++) {
            const __m256i L[2] = {_mm256_loadu_si256((const __m256i *)(p + 64 * n)),
                                  _mm256_loadu_si256((const __m256i *)(p + 64 * n + 32))};
            const __m256i H = _mm256_loadu_si256((const __m256i *)(p + 128 + 32 * n));
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++) {
                const int j = 4 * n + k;
                const __m256i v = _mm256_sub_epi8(ai_q6k_quants(L, H, k), centre);
                const __m256i w0 = _mm256_srai_epi16(_mm256_slli_epi16(v, 8), 8), w1 = _mm256_srai_epi16(v, 8);
                /* lanes 0-3: d * scales[2 j], 4-7: d * scales[2 j + 1] (half_sc[n]'s lanes 2 k and 2 k + 1) */
                const __m256 sv = _mm256_permutevar8x32_ps(
                    half_sc[n], _mm256_setr_epi32(2 * k, 2 * k, 2 * k, 2 * k, 2 * k + 1, 2 * k + 1, 2 * k + 1, 2 * k + 1));
                KQ_SUB(j, k & 1, w0, w1, KQ_HALVES,
                       _mm256_mul_ps(sv, _mm256_broadcast_ss(a->d + (m0 + i) * nb + blk * 8 + j)));
            }
        }
    }
    for (int i = 0; i < ROWS; i++) out[i] = ai_hsum256(_mm256_add_ps(acc[i][0], acc[i][1]));
}

#else /* AI_AVX512 */
/* Q6_K in 512-bit registers (AVX-512 builds): sub-block j's quants made and centred as bytes (as row_q6_k),
 * widened to 32 words in order, which meet the activations (in order in these builds) in one multiply-add of
 * pairs; its sixteen int32 sums hold elements 0-15 in lanes 0-7 and 16-31 in lanes 8-15, which d times int8 scales
 * 2 j and 2 j + 1 multiply (the block's sixteen scales formed once, the pair for j moved into place). The 256-bit
 * rows needed two products and two cross-lane permutes to sum each half. Two accumulators a row (even and odd
 * sub-blocks), summed in the same order whatever ROWS is. (Q4_K / Q5_K written so ran 0.75-0.93x their 256-bit
 * rows on the Xeon of docs/formats.md: they have no permutes to save, and 512-bit multiplies issue at half the
 * 256-bit rate there.) */
static inline __attribute__((always_inline)) void row512_q6_k(const uint8_t *row, int64_t K, const acts *a,
                                                              int64_t m0, const int ROWS, float *out) {
    const int64_t nblk = K / 256, nb = K / QK;
    const __m256i centre = _mm256_set1_epi8(32);
    __m512 acc[2 * MR];
    for (int i = 0; i < 2 * MR; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t blk = 0; blk < nblk; blk++) {
        const uint8_t *p = row + blk * 210;
        ai_prefetch_lines(p, 210);
        const __m512 half_sc = _mm512_mul_ps(_mm512_set1_ps(ai_half_at(p + 208)),
                                             _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 192)))));
#pragma GCC unroll 2
        for (int n = 0; n < 2; n++) {
            const __m256i L[2] = {_mm256_loadu_si256((const __m256i *)(p + 64 * n)),
                                  _mm256_loadu_si256((const __m256i *)(p + 64 * n + 32))};
            const __m256i H = _mm256_loadu_si256((const __m256i *)(p + 128 + 32 * n));
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++) {
                const int j = 4 * n + k;
                const __m512i w = _mm512_cvtepi8_epi16(_mm256_sub_epi8(ai_q6k_quants(L, H, k), centre));
                const __m512 sv = _mm512_permutexvar_ps(
                    _mm512_setr_epi32(2 * j, 2 * j, 2 * j, 2 * j, 2 * j, 2 * j, 2 * j, 2 * j, 2 * j + 1, 2 * j + 1,
                                      2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1),
                    half_sc);
                for (int i = 0; i < ROWS; i++) {
                    const __m512i s = _mm512_madd_epi16(w, _mm512_loadu_si512(a->q + (m0 + i) * K + (blk * 8 + j) * QK));
                    acc[2 * i + (k & 1)] = _mm512_fmadd_ps(
                        _mm512_cvtepi32_ps(s), _mm512_mul_ps(sv, _mm512_set1_ps(a->d[(m0 + i) * nb + blk * 8 + j])),
                        acc[2 * i + (k & 1)]);
                }
            }
        }
    }
    for (int i = 0; i < ROWS; i++) out[i] = _mm512_reduce_add_ps(_mm512_add_ps(acc[2 * i], acc[2 * i + 1]));
}

/* Q4_K (AVX-512 builds) against quantize_acts512_pairs_eo's order (per pair of sub-blocks b, b + 1: the even
 * elements of b, of b + 1, then the odd ones of each): chunk pr's 32 bytes (sub-block 2 pr in the low nibbles,
 * 2 pr + 1 in the high ones) broadcast to both halves of a register as 16 words each, not widened; one variable
 * shift and a mask give the even elements of both sub-blocks (the low byte's nibbles), another the odd ones (the
 * high byte's); one multiply-add and one dot-product accumulation leave sub-block 2 pr's exact sums in lanes 0-7
 * and 2 pr + 1's in 8-15, one convert and one fma for both. The minimums' terms as row_q45_k's. */
static inline __attribute__((always_inline)) void row512_q4_k(const uint8_t *row, int64_t K, const acts *a,
                                                              int64_t m0, const int ROWS, float *out) {
    const int64_t nblk = K / 256, nb = K / QK;
    const __m512i low4 = _mm512_set1_epi16(0x0F);
    const __m512i even = _mm512_setr_epi64(0, 0, 0, 0, 0x0004000400040004LL, 0x0004000400040004LL,
                                           0x0004000400040004LL, 0x0004000400040004LL);
    const __m512i odd = _mm512_add_epi16(even, _mm512_set1_epi16(8));
    __m512 acc[2 * MR];
    __m256 off[MR];
    for (int i = 0; i < 2 * MR; i++) acc[i] = _mm512_setzero_ps();
    for (int i = 0; i < MR; i++) off[i] = _mm256_setzero_ps();
    for (int64_t blk = 0; blk < nblk; blk++) {
        const uint8_t *p = row + blk * 144;
        ai_prefetch_lines(p, 144);
        __m512 dsc[MR];
        ai_k_row_terms512(p, a->d + m0 * nb + blk * 8, a->sum + m0 * nb + blk * 8, nb, ROWS, dsc, off);
        const uint8_t *qs = p + 16;
#pragma GCC unroll 4
        for (int pr = 0; pr < 4; pr++) {
            const __m512i z = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(qs + 32 * pr)));
            const __m512i ra = _mm512_and_si512(_mm512_srlv_epi16(z, even), low4);
            const __m512i rb = _mm512_and_si512(_mm512_srlv_epi16(z, odd), low4);
            const __m512i sel = _mm512_setr_epi32(2 * pr, 2 * pr, 2 * pr, 2 * pr, 2 * pr, 2 * pr, 2 * pr, 2 * pr,
                                                  2 * pr + 1, 2 * pr + 1, 2 * pr + 1, 2 * pr + 1, 2 * pr + 1,
                                                  2 * pr + 1, 2 * pr + 1, 2 * pr + 1);
            for (int i = 0; i < ROWS; i++) {
                const int16_t *xq = a->q + (m0 + i) * K + (blk * 8 + 2 * pr) * QK;
                const __m512i sum = ai_dpwssd512(_mm512_madd_epi16(ra, _mm512_loadu_si512(xq)), rb,
                                                 _mm512_loadu_si512(xq + QK));
                acc[2 * i + (pr & 1)] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_permutexvar_ps(sel, dsc[i]),
                                                        acc[2 * i + (pr & 1)]);
            }
        }
    }
    for (int i = 0; i < ROWS; i++)
        out[i] = _mm512_reduce_add_ps(_mm512_add_ps(acc[2 * i], acc[2 * i + 1])) + ai_hsum256(off[i]);
}
#endif /* AI_AVX512 */

/* The row kernel of a format (a constant at every call). */
static inline __attribute__((always_inline)) void row_of(const int fmt, const uint8_t *row, int64_t K, const acts *a,
                                                         int64_t m0, const int ROWS, float *out) {
#ifdef AI_AVX512
    if (fmt == ASYNCINFER_FMT_Q4_K) return row512_q4_k(row, K, a, m0, ROWS, out);
#endif
    if (fmt == ASYNCINFER_FMT_Q4_K || fmt == ASYNCINFER_FMT_Q5_K) return row_q45_k(fmt, row, K, a, m0, ROWS, out);
#ifdef AI_AVX512
    if (fmt == ASYNCINFER_FMT_Q6_K) return row512_q6_k(row, K, a, m0, ROWS, out);
    if (fmt == ASYNCINFER_FMT_Q4_0) return row512_q4_0(row, K / QK, a, m0, K, ROWS, out);
    if (fmt == ASYNCINFER_FMT_Q5_0) return row512_q5_0(row, K / QK, a, m0, K, ROWS, out);
    if (fmt == ASYNCINFER_FMT_Q5_1) return row512_q5_1(row, K / QK, a, m0, K, ROWS, out);
#else
    if (fmt == ASYNCINFER_FMT_Q6_K) return row_q6_k(row, K, a, m0, ROWS, out);
#endif
    row_blocks(fmt, row, K, a, m0, ROWS, out);
}

#define GEMM_BLOCKS(NAME, FMT)                                                                    \
    int NAME(const float *x, int64_t M, int64_t ldx, int64_t K, const void *w, int64_t N, const float *bias, \
             float *y, int64_t ldy, int threads, void *scratch) {                                 \
        const uint8_t *rows = (const uint8_t *)w;                                                 \
        const int64_t row_bytes = K / ai_fmt_weights(FMT) * ai_fmt_bytes(FMT);                    \
        if (M >= PANEL_MIN_ROWS)                                                                  \
            return BATCHED(FMT, x, M, ldx, K, rows, N, bias, y, ldy, threads, scratch);            \
        acts a = acts_in(scratch, M, K);                                                          \
        QUANTIZE_ACTS_OF(FMT)(x, M, ldx, K, &a);                                                  \
        _Pragma("omp parallel for schedule(static) num_threads(threads) if(threads > 1)")        \
        for (int64_t n = 0; n < N; n++) {                                                         \
            const uint8_t *row = rows + n * row_bytes;                                            \
            const float bn = bias ? bias[n] : 0.0f;                                               \
            for (int64_t m0 = 0; m0 < M; m0 += MR) {                                              \
                const int rows_now = (int)(M - m0 < MR ? M - m0 : MR);                            \
                float out[MR];                                                                    \
                switch (rows_now) {                                                               \
                    case 1: row_of(FMT, row, K, &a, m0, 1, out); break;                       \
                    case 2: row_of(FMT, row, K, &a, m0, 2, out); break;                       \
                    case 3: row_of(FMT, row, K, &a, m0, 3, out); break;                       \
                    default: row_of(FMT, row, K, &a, m0, 4, out); break;                      \
                }                                                                                 \
                for (int i = 0; i < rows_now; i++) y[(m0 + i) * ldy + n] = out[i] + bn;           \
            }                                                                                     \
        }                                                                                         \
        return 0;                                                                                 \
    }

#else /* scalar */
int ai_gemm_q4_1(const float *x, int64_t M, int64_t ldx, int64_t K, const void *w, int64_t N, const float *bias,
                 float *y, int64_t ldy, int threads, void *scratch) {
    return gemm_ref(x, M, ldx, K, (const uint8_t *)w, N, ASYNCINFER_FMT_Q4_1, bias, y, ldy, threads, scratch);
}

int ai_gemm_q8_0(const float *x, int64_t M, int64_t ldx, int64_t K, const void *w, int64_t N, const float *bias,
                 float *y, int64_t ldy, int threads, void *scratch) {
    return gemm_ref(x, M, ldx, K, (const uint8_t *)w, N, ASYNCINFER_FMT_Q8_0, bias, y, ldy, threads, scratch);
}

#define GEMM_BLOCKS(NAME, FMT)                                                                    \
    int NAME(const float *x, int64_t M, int64_t ldx, int64_t K, const void *w, int64_t N, const float *bias, \
             float *y, int64_t ldy, int threads, void *scratch) {                                 \
        return gemm_ref(x, M, ldx, K, (const uint8_t *)w, N, FMT, bias, y, ldy, threads, scratch); \
    }
#endif

/* The other formats' GEMMs (static: reached through ai_gemm_of and their exported entries). */
static GEMM_BLOCKS(ai_gemm_q4_0, ASYNCINFER_FMT_Q4_0)
static GEMM_BLOCKS(ai_gemm_q5_0, ASYNCINFER_FMT_Q5_0)
static GEMM_BLOCKS(ai_gemm_q5_1, ASYNCINFER_FMT_Q5_1)
static GEMM_BLOCKS(ai_gemm_q4_k, ASYNCINFER_FMT_Q4_K)
static GEMM_BLOCKS(ai_gemm_q5_k, ASYNCINFER_FMT_Q5_K)
static GEMM_BLOCKS(ai_gemm_q6_k, ASYNCINFER_FMT_Q6_K)

/* A step's int8 projection with the tile allowed (layer_t's parts and the head's format): ai_step8_of's for M rows. */
#define STEP8_CODE (ASYNCINFER_FMT_TILE8 | ASYNCINFER_FMT_ACT8)
gemm_fn ai_gemm_of(int fmt, int64_t M) {
    static const gemm_fn table[ASYNCINFER_NUM_FMTS] = {ai_gemm_q4_1, ai_gemm_q8_0, ai_gemm_q4_0, ai_gemm_q5_0,
                                                       ai_gemm_q5_1, ai_gemm_q4_k, ai_gemm_q5_k, ai_gemm_q6_k};
    const gemm_fn in_lanes = ai_lanes_of(fmt);
    if (in_lanes) return in_lanes;
    if (fmt >= ASYNCINFER_FMT_ACT8 && fmt < ASYNCINFER_FMT_ACT8 + ASYNCINFER_NUM_FMTS)
        return ai_gemm8_of(fmt - ASYNCINFER_FMT_ACT8);
    if (fmt >= STEP8_CODE && fmt < STEP8_CODE + ASYNCINFER_NUM_FMTS) return ai_step8_of(fmt - STEP8_CODE, M);
    return fmt >= 0 && fmt < ASYNCINFER_NUM_FMTS ? table[fmt] : NULL;
}

/* Bytes: from PANEL_MIN_ROWS rows on the activations packed in tiles (rows rounded up to 8) as float32;
 * below it int16 values and three floats per block. -1 when a size would overflow. */
int64_t ai_scratch_bytes(int64_t M, int64_t K) {
    int64_t a, b, total;
    if (M < 0 || K < 0) return -1;
    if (M >= PANEL_MIN_ROWS) {
        if (!ai_add(M, 7, &a) || !ai_mul(a / 8 * 8, K, &a) || !ai_mul(a, 4, &total)) return -1;
        return total;
    }
    if (!ai_mul(M, K, &a) || !ai_mul(a, 2, &a) || !ai_mul(M, K / QK, &b) || !ai_mul(b, 12, &b) || !ai_add(a, b, &total))
        return -1;
    return total;
}

int asyncinfer_gemm_q4_1(const float *x, int64_t M, int64_t ldx, int64_t K, const void *w, int64_t N,
                         const float *bias, float *y, int64_t ldy, int threads, void *scratch) {
    return ai_gemm_q4_1(x, M, ldx, K, w, N, bias, y, ldy, threads, scratch);
}

int asyncinfer_gemm_q8_0(const float *x, int64_t M, int64_t ldx, int64_t K, const void *w, int64_t N,
                         const float *bias, float *y, int64_t ldy, int threads, void *scratch) {
    return ai_gemm_q8_0(x, M, ldx, K, w, N, bias, y, ldy, threads, scratch);
}

#define EXPORT_GEMM(NAME, INNER)                                                                  \
    int NAME(const float *x, int64_t M, int64_t ldx, int64_t K, const void *w, int64_t N, const float *bias, \
             float *y, int64_t ldy, int threads, void *scratch) {                                 \
        return INNER(x, M, ldx, K, w, N, bias, y, ldy, threads, scratch);                         \
    }
EXPORT_GEMM(asyncinfer_gemm_q4_0, ai_gemm_q4_0)
EXPORT_GEMM(asyncinfer_gemm_q5_0, ai_gemm_q5_0)
EXPORT_GEMM(asyncinfer_gemm_q5_1, ai_gemm_q5_1)
EXPORT_GEMM(asyncinfer_gemm_q4_k, ai_gemm_q4_k)
EXPORT_GEMM(asyncinfer_gemm_q5_k, ai_gemm_q5_k)
EXPORT_GEMM(asyncinfer_gemm_q6_k, ai_gemm_q6_k)

int64_t asyncinfer_scratch_bytes(int64_t M, int64_t K) { return ai_scratch_bytes(M, K); }

/* ------------------------------------------------------------------------------------------------
 * Weight rows rebuilt as bfloat16 (asyncinfer_dequantize_bf16): each row rebuilt in float32 as the panel does
 * (the blocks' exact values), then each value rounded once to bfloat16, to nearest even (torch's conversion:
 * every NaN becomes 0x7FC0). */

#ifndef AI_AVX512
/* One float32's bfloat16 bits. */
static inline uint16_t bf16_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static void bf16_row(const float *w, int64_t K, uint16_t *out) {
    int64_t k = 0;
#ifdef AI_AVX2
    const __m256i bias = _mm256_set1_epi32(0x7FFF), one = _mm256_set1_epi32(1), nan = _mm256_set1_epi32(0x7FC0);
    for (; k + 16 <= K; k += 16) {
        __m256i h[2];
        for (int i = 0; i < 2; i++) {
            const __m256 v = _mm256_loadu_ps(w + k + 8 * i);
            const __m256i u = _mm256_castps_si256(v);
            const __m256i r = _mm256_srli_epi32(
                _mm256_add_epi32(_mm256_add_epi32(u, bias), _mm256_and_si256(_mm256_srli_epi32(u, 16), one)), 16);
            h[i] = _mm256_blendv_epi8(r, nan, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
        }
        /* packus works within 128-bit lanes; the permute restores the order */
        _mm256_storeu_si256((__m256i *)(out + k), _mm256_permute4x64_epi64(_mm256_packus_epi32(h[0], h[1]), 0xD8));
    }
#endif
    for (; k < K; k++) out[k] = bf16_bits(w[k]);
}
#endif

#ifdef AI_AVX512
/* The AVX-512 build: the weights straight to bfloat16, 32 at a time, without a float32 row between. Where the
 * CPU has AVX-512 BF16 (chosen at run time), its conversion instruction rounds them (to nearest even, as
 * bf16x16; the weights are never float32 subnormals, which it would flush: every one is zero or at least
 * 2**-24 in size); elsewhere the integer form below. */

/* bf16_bits of 16 floats. */
static inline __m256i bf16x16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)),
                         _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))), 16);
    return _mm512_cvtepi32_epi16(
        _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0)));
}

/* 16 int8 quants q times sc (plus mn where the format has a min; one rounding, as the float32 rebuild). */
static inline __attribute__((always_inline)) __m512 bf16_values(__m128i q, float sc, float mn, int has_min) {
    const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q));
    return has_min ? _mm512_fmadd_ps(_mm512_set1_ps(sc), v, _mm512_set1_ps(mn)) : _mm512_mul_ps(_mm512_set1_ps(sc), v);
}

/* One row's weights, 32 at a time: a (elements 0-15) and b (16-31) stored through STORE32(a, b, out). */
#define REBUILD_BF16_BODY(STORE32)                                                                           \
    const __m256i low4 = _mm256_set1_epi8(0x0F);                                                              \
    if (fmt == ASYNCINFER_FMT_Q4_1 || fmt == ASYNCINFER_FMT_Q8_0) { /* the kernels' layout: d[nb], m[nb], q */  \
        const int64_t nb = K / QK;                                                                            \
        const int has_min = fmt == ASYNCINFER_FMT_Q4_1;                                                       \
        const uint8_t *qs = row + (has_min ? 4 : 2) * nb;                                                     \
        for (int64_t b = 0; b < nb; b++, out += QK) {                                                         \
            const float d = ai_half_at(row + 2 * b), m = has_min ? ai_half_at(row + 2 * (nb + b)) : 0.0f;     \
            const __m256i q = has_min ? ai_nibbles32(qs + 16 * b)                                             \
                                      : _mm256_loadu_si256((const __m256i *)(qs + 32 * b));                   \
            STORE32(bf16_values(_mm256_castsi256_si128(q), d, m, has_min),                                    \
                    bf16_values(_mm256_extracti128_si256(q, 1), d, m, has_min), out);                         \
        }                                                                                                     \
        return;                                                                                               \
    }                                                                                                         \
    const int64_t nblk = K / ai_fmt_weights(fmt), bytes = ai_fmt_bytes(fmt);                                  \
    for (int64_t blk = 0; blk < nblk; blk++) {                                                                \
        const uint8_t *p = row + blk * bytes;                                                                 \
        float scale[8], min[8];                                                                               \
        ai_block_scales(fmt, p, scale, min);                                                                  \
        if (fmt == ASYNCINFER_FMT_Q4_K || fmt == ASYNCINFER_FMT_Q5_K) {                                       \
            const int five = fmt == ASYNCINFER_FMT_Q5_K;                                                      \
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(p + 16));                                 \
            for (int j = 0; j < 8; j++, out += 32) {                                                          \
                const __m256i v = _mm256_loadu_si256((const __m256i *)(p + (five ? 48 : 16) + 32 * (j >> 1))); \
                __m256i q = _mm256_and_si256((j & 1) ? _mm256_srli_epi16(v, 4) : v, low4);                   \
                if (five) /* bit j of qh[i] as bit 4 */                                                       \
                    q = _mm256_or_si256(q, _mm256_slli_epi16(_mm256_and_si256(                                \
                        _mm256_srl_epi16(qh, _mm_cvtsi32_si128(j)), _mm256_set1_epi8(1)), 4));                \
                STORE32(bf16_values(_mm256_castsi256_si128(q), scale[j], min[j], 1),                          \
                        bf16_values(_mm256_extracti128_si256(q, 1), scale[j], min[j], 1), out);               \
            }                                                                                                 \
        } else if (fmt == ASYNCINFER_FMT_Q6_K) {                                                              \
            const int8_t *sc = (const int8_t *)(p + 192);                                                     \
            for (int j = 0; j < 8; j++, out += 32) { /* sub-block j = 4 n + k */                              \
                const int n = j >> 2, k = j & 3;                                                              \
                const __m256i l = _mm256_loadu_si256((const __m256i *)(p + 64 * n + 32 * (k & 1)));           \
                const __m256i h = _mm256_loadu_si256((const __m256i *)(p + 128 + 32 * n));                    \
                const __m256i lo = _mm256_and_si256(_mm256_srl_epi16(l, _mm_cvtsi32_si128(4 * (k >> 1))), low4); \
                const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(2 * k)),            \
                                                    _mm256_set1_epi8(3));                                     \
                const __m256i q = _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)),              \
                                                  _mm256_set1_epi8(32));                                      \
                /* d * sc is exact (11 by 8 bits), and so is its product with q (6 more bits) */              \
                STORE32(bf16_values(_mm256_castsi256_si128(q), scale[0] * (float)sc[2 * j], 0.0f, 0),         \
                        bf16_values(_mm256_extracti128_si256(q, 1), scale[0] * (float)sc[2 * j + 1], 0.0f, 0), out); \
            }                                                                                                 \
        } else { /* Q4_0, Q5_0, Q5_1 */                                                                       \
            const __m256i q = ai_sub_bytes(fmt, p);                                                           \
            const int has_min = ai_fmt_has_min(fmt);                                                          \
            STORE32(bf16_values(_mm256_castsi256_si128(q), scale[0], min[0], has_min),                        \
                    bf16_values(_mm256_extracti128_si256(q, 1), scale[0], min[0], has_min), out);             \
            out += 32;                                                                                        \
        }                                                                                                     \
    }

#define STORE32_INT(a, b, out)                                                                               \
    do {                                                                                                      \
        _mm256_storeu_si256((__m256i *)(out), bf16x16(a));                                                    \
        _mm256_storeu_si256((__m256i *)((out) + 16), bf16x16(b));                                             \
    } while (0)

static void rebuild_bf16_row(int fmt, const uint8_t *row, int64_t K, uint16_t *out) { REBUILD_BF16_BODY(STORE32_INT) }

#if !defined(ASYNCINFER_EMULATE_AVX512)
#define AI_NATIVE_BF16 1
#define STORE32_BF16(a, b, out) _mm512_storeu_si512((void *)(out), (__m512i)_mm512_cvtne2ps_pbh((b), (a)))
__attribute__((target("avx512bf16"))) static void rebuild_bf16_row_native(int fmt, const uint8_t *row, int64_t K,
                                                                          uint16_t *out) {
    REBUILD_BF16_BODY(STORE32_BF16)
}
#endif
#endif

#ifndef AI_AVX512
/* One weight row in float32, ggml's values (the panel's rebuild, or the reference's in the scalar build). */
static void rebuild_any(int fmt, const uint8_t *row, int64_t K, float *out) {
    const int legacy = fmt == ASYNCINFER_FMT_Q4_1 || fmt == ASYNCINFER_FMT_Q8_0;
#ifdef AI_AVX2
    if (legacy)
        rebuild_row(row, K / QK, fmt == ASYNCINFER_FMT_Q4_1, out);
    else
        rebuild_blocks_row(fmt, row, K, out);
#else
    if (legacy)
        rebuild_row_ref(row, K / QK, fmt == ASYNCINFER_FMT_Q4_1, out);
    else
        ai_rebuild_blocks(fmt, row, K, out);
#endif
}
#endif

int asyncinfer_dequantize_bf16(int fmt, const void *w, int64_t N, int64_t K, uint16_t *out, int64_t ldo,
                               int threads) {
    if (fmt < 0 || fmt >= ASYNCINFER_NUM_FMTS || N < 0 || K < 0 || K % ai_fmt_weights(fmt) || ldo < K)
        return ASYNCINFER_EINVAL;
    if (N == 0 || K == 0) return 0;
    const int64_t row_bytes = K / ai_fmt_weights(fmt) * ai_fmt_bytes(fmt);
    const uint8_t *rows = (const uint8_t *)w;
#ifdef AI_AVX512
#ifdef AI_NATIVE_BF16
    if (__builtin_cpu_supports("avx512bf16")) {
        _Pragma("omp parallel for schedule(static) num_threads(threads) if(threads > 1)")
        for (int64_t n = 0; n < N; n++) rebuild_bf16_row_native(fmt, rows + n * row_bytes, K, out + n * ldo);
        return 0;
    }
#endif
    _Pragma("omp parallel for schedule(static) num_threads(threads) if(threads > 1)")
    for (int64_t n = 0; n < N; n++) rebuild_bf16_row(fmt, rows + n * row_bytes, K, out + n * ldo);
    return 0;
#else
    float *buf = (float *)ai_alloc((int64_t)(threads > 1 ? threads : 1), K * (int64_t)sizeof(float));
    if (!buf) return ASYNCINFER_ENOMEM;
    _Pragma("omp parallel for schedule(static) num_threads(threads) if(threads > 1)")
    for (int64_t n = 0; n < N; n++) {
        float *f = buf + (int64_t)ai_thread_num() * K;
        rebuild_any(fmt, rows + n * row_bytes, K, f);
        bf16_row(f, K, out + n * ldo);
    }
    free(buf);
    return 0;
#endif
}
