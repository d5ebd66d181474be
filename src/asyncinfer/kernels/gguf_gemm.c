/* asyncinfer's CPU kernels for weights in ggml's block formats, float32 activations.
 *
 *   y[m, n] = sum_k x[m, k] * W[n, k]  (+ bias[n])
 *
 * W holds one row per output feature, each a run of blocks of 32 weights along k, in ggml's
 * formats (regrouped per row, see "the kernels' layout" below):
 *
 *   Q4_1: fp16 d, fp16 m, 16 bytes of nibbles; weight j = d * q_j + m, q_j in [0, 15]
 *         (q_j is the low nibble of byte j for j < 16, the high nibble of byte j - 16 otherwise)
 *   Q8_0: fp16 d, 32 int8; weight j = d * q_j
 *
 * The weights are the blocks' exact values; activations are rounded per block of 32 to int16 (see
 * quantize_acts), the integer products summed exactly, and each block's sum scaled in float32.
 * Decode reads each weight once per step, so these kernels move 5 (Q4_1) or 8.5 (Q8_0) bits per
 * weight instead of 32 (float32) or 16 (float16).
 *
 * Built for AVX2 + FMA + F16C (x86-64 from 2013 on); the Python side checks the CPU first.
 * Threads: OpenMP over output rows, sharing the OpenMP runtime torch has loaded.
 */
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#define QK 32
#define MR 4 /* activation rows per pass over a weight row */
#ifndef PREFETCH
#define PREFETCH 1024 /* bytes ahead in the weight stream (a thread's rows are contiguous) */
#endif


static inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* e^x for 8 floats, within 2 ulp (Cody-Waite range reduction, Cephes' degree-5 polynomial); x is
 * clamped to [-87.3, 88.3], where the result stays a normal float. */
static inline __m256 exp256(__m256 x) {
    /* max/min return their second operand when either is NaN: x second, so a NaN stays NaN */
    x = _mm256_min_ps(_mm256_set1_ps(88.3f), _mm256_max_ps(_mm256_set1_ps(-87.3f), x));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* Activations, as the kernels read them: each row cut into blocks of 32 like the weights, each
 * block scaled to int16 (x ~= dx * qx, |qx| <= 32767, rounded to nearest) with its exact float32
 * sum kept for Q4_1's offset term. int16 keeps 16 significant bits per block (float16 weights keep
 * 11), and int16 x small-int products summed in int32 are exact, so the whole dot product costs
 * one rounding per block. Within a block the 32 values are stored even elements first, then odd
 * ones: the order in which the weight unpacking below yields them. */
typedef struct {
    int16_t *q;   /* [M, K] */
    float *d;     /* [M, K / 32] */
    float *sum;   /* [M, K / 32] */
} acts;

static void quantize_acts(const float *x, int64_t M, int64_t ldx, int64_t K, acts *a) {
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
            const float absmax = _mm_cvtss_f32(mx), total = hsum(sum);
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
    if (!m16) return hsum(sum);
    __m256 o = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 8 <= nb; b += 8)
        o = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(m16 + b))), _mm256_loadu_ps(sx + b), o);
    float offset = hsum(o);
    for (; b < nb; b++) offset += half_to_float(m16[b]) * sx[b];
    return hsum(_mm256_mul_ps(sum, q4_1_unscale())) + offset;
}

#define ROW_BLOCK(b, slot, UNPACK, QS_BYTES)                                                                      \
    do {                                                                                          \
        _mm_prefetch((const char *)(qs + (b) * QS_BYTES) + PREFETCH, _MM_HINT_T0);                \
        __m256i w[2];                                                                             \
        UNPACK(qs + (b) * QS_BYTES, w);                                                           \
        const __m256 dw = _mm256_set1_ps(half_to_float(d16[b]));                                  \
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
        _mm_prefetch((const char *)(qs[1] + (b) * QS_BYTES) + PREFETCH, _MM_HINT_T0);             \
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
        ROW2_BLOCK(bb, slot, _mm256_mul_ps(dx, _mm256_set1_ps(half_to_float(d16[0][bb]))),        \
                   _mm256_mul_ps(dx, _mm256_set1_ps(half_to_float(d16[1][bb]))), UNPACK, QS_BYTES); \
    } while (0)

#define ROW2_KERNEL(NAME, UNPACK, QS_BYTES, HAS_MIN)                                              \
    static inline __attribute__((always_inline)) void NAME(const uint8_t *row0, const uint8_t *row1, \
                                                           int64_t nb, const acts *a, float *out) { \
        const uint8_t *rows[2] = {row0, row1};                                                    \
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

/* Batches of PANEL_MIN_ROWS activation rows or more: each thread rebuilds NP weight rows at a time in
 * float32 (the blocks' exact values, in the even/odd order of the unpacking) and multiplies them by
 * float32 activations (permuted to match, not rounded) with a 4 x 3 register tile, so the rebuild
 * is paid once per NP rows and the inner loop is one FMA per 8 products. Each output is one
 * dot product in 8 float32 lanes, summed the same way whatever the batch. */
#define NP 3
#define MP 4
#ifndef PANEL_MIN_ROWS
#define PANEL_MIN_ROWS 5
#endif

static inline void rebuild_block(const __m256i w[2], __m256 d, __m256 m, float upper, float *out) {
    for (int h = 0; h < 2; h++) {
        const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(w[h])));
        const __m256 hi = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(w[h], 1))),
                                        _mm256_set1_ps(upper));
        _mm256_storeu_ps(out + 16 * h, _mm256_fmadd_ps(d, lo, m));
        _mm256_storeu_ps(out + 16 * h + 8, _mm256_fmadd_ps(d, hi, m));
    }
}

static void rebuild_row(const uint8_t *row, int64_t nb, int has_min, float *out) {
    const uint16_t *d16 = (const uint16_t *)row, *m16 = d16 + nb;
    const uint8_t *qs = row + (has_min ? 4 : 2) * nb;
    for (int64_t b = 0; b < nb; b++) {
        __m256i w[2];
        if (has_min) unpack_q4_1(qs + 16 * b, w); else unpack_q8_0(qs + 32 * b, w);
        const __m256 d = _mm256_set1_ps(half_to_float(d16[b]));
        const __m256 m = has_min ? _mm256_set1_ps(half_to_float(m16[b])) : _mm256_setzero_ps();
        rebuild_block(w, d, m, has_min ? 0.0625f : 1.0f, out + b * QK);
    }
}

/* Activations in the rebuilt weights' order: within each block of 32, even elements then odd. */
static void permute_acts(const float *x, int64_t M, int64_t ldx, int64_t K, float *xp) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < K; b += QK)
            for (int j = 0; j < QK / 2; j++) {
                xp[m * K + b + j] = x[m * ldx + b + 2 * j];
                xp[m * K + b + QK / 2 + j] = x[m * ldx + b + 2 * j + 1];
            }
}

static void gemm_panel(const float *x, int64_t M, int64_t ldx, int64_t K, const uint8_t *rows, int64_t N,
                       int64_t row_bytes, int has_min, const float *bias, float *y, int64_t ldy, int threads,
                       float *xp) {
    const int64_t nb = K / QK, groups = (N + NP - 1) / NP;
    permute_acts(x, M, ldx, K, xp);
    _Pragma("omp parallel num_threads(threads) if(threads > 1)")
    {
        float *panel = (float *)malloc(sizeof(float) * (size_t)(NP * K));
        _Pragma("omp for schedule(static)")
        for (int64_t g = 0; g < groups; g++) {
            const int64_t n0 = g * NP, nr = N - n0 < NP ? N - n0 : NP;
            for (int64_t r = 0; r < nr; r++) rebuild_row(rows + (n0 + r) * row_bytes, nb, has_min, panel + r * K);
            for (int64_t r = nr; r < NP; r++) memset(panel + r * K, 0, sizeof(float) * (size_t)K);
            for (int64_t m0 = 0; m0 < M; m0 += MP) {
                const int64_t mr = M - m0 < MP ? M - m0 : MP;
                const float *xr[MP];
                for (int i = 0; i < MP; i++) xr[i] = xp + (m0 + (i < mr ? i : 0)) * K;
                __m256 acc[MP][NP];
                for (int i = 0; i < MP; i++)
                    for (int j = 0; j < NP; j++) acc[i][j] = _mm256_setzero_ps();
                for (int64_t k = 0; k < K; k += 8) {
                    __m256 wv[NP];
                    for (int j = 0; j < NP; j++) wv[j] = _mm256_loadu_ps(panel + j * K + k);
                    for (int i = 0; i < MP; i++) {
                        const __m256 xv = _mm256_loadu_ps(xr[i] + k);
                        for (int j = 0; j < NP; j++) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
                    }
                }
                for (int64_t i = 0; i < mr; i++)
                    for (int64_t j = 0; j < nr; j++)
                        y[(m0 + i) * ldy + n0 + j] = hsum(acc[i][j]) + (bias ? bias[n0 + j] : 0.0f);
            }
        }
        free(panel);
    }
}

/* x: [M, K] float32, row stride ldx; w: [N] rows in the kernels' layout (ROW_BYTES per 32 weights);
 * bias: [N] or NULL; y: [M, N], row stride ldy; scratch: asyncinfer_scratch_bytes(M, K) bytes. */
#define GEMM(NAME, ROW, ROW2, ROW_BYTES)                                                          \
    void NAME(const float *x, int64_t M, int64_t ldx, int64_t K, const void *w, int64_t N,        \
              const float *bias, float *y, int64_t ldy, int threads, void *scratch) {             \
        const int64_t nb = K / QK;                                                                \
        const uint8_t *rows = (const uint8_t *)w;                                                 \
        if (M >= PANEL_MIN_ROWS) {                                                                \
            gemm_panel(x, M, ldx, K, rows, N, nb * ROW_BYTES, ROW_BYTES == 20, bias, y, ldy,      \
                       threads, (float *)scratch);                                                \
            return;                                                                               \
        }                                                                                         \
        acts a = {(int16_t *)scratch, (float *)((char *)scratch + M * K * 2),                     \
                  (float *)((char *)scratch + M * K * 2) + M * nb};                               \
        quantize_acts(x, M, ldx, K, &a);                                                          \
        if (M == 1) { /* pairs of weight rows; an odd last row through ROW */                     \
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
            return;                                                                               \
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
    }

GEMM(asyncinfer_gemm_q4_1, row_q4_1, row2_q4_1, 20)
GEMM(asyncinfer_gemm_q8_0, row_q8_0, row2_q8_0, 34)

int64_t asyncinfer_scratch_bytes(int64_t M, int64_t K) {
    return M >= PANEL_MIN_ROWS ? M * K * 4 : M * K * 2 + 2 * M * (K / QK) * 4;
}

/* RMS norm of T rows: y[t] = (x[t] * 1 / sqrt(mean(x[t]^2) + eps)) * w, float32 throughout. */
void asyncinfer_rms_norm(const float *x, int64_t T, int64_t ldx, int64_t H, const float *w, float eps, float *y,
                         int threads) {
    _Pragma("omp parallel for schedule(static) num_threads(threads) if(threads > 1 && T > 16)")
    for (int64_t t = 0; t < T; t++) {
        const float *xr = x + t * ldx;
        float *yr = y + t * H;
        __m256 ss = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 8 <= H; i += 8) {
            const __m256 v = _mm256_loadu_ps(xr + i);
            ss = _mm256_fmadd_ps(v, v, ss);
        }
        float sum = hsum(ss);
        for (; i < H; i++) sum += xr[i] * xr[i];
        const float r = 1.0f / sqrtf(sum / (float)H + eps);
        const __m256 rv = _mm256_set1_ps(r);
        for (i = 0; i + 8 <= H; i += 8)
            _mm256_storeu_ps(yr + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + i), rv), _mm256_loadu_ps(w + i)));
        for (; i < H; i++) yr[i] = (xr[i] * r) * w[i];
    }
}

/* Decode attention over a paged cache, read in place: one query token per sequence.
 *   q: [S, H, D]; k_cache, v_cache: [blocks, BS, KVH, D]; tables: [S, ldt] block ids;
 *   ctx: [S] context lengths (the new token's K/V already written); out: [S, H, D].
 * The G = H / KVH query heads of a KV head share its keys (GQA). Softmax in float32 with the
 * maximum subtracted, as SDPA computes it (exp256: within 2 ulp of expf). One task per query head.
 * D must be a multiple of 8. */
void asyncinfer_decode_attention(const float *q, const float *k_cache, const float *v_cache, const int64_t *tables,
                                 int64_t ldt, const int64_t *ctx, int64_t S, int64_t H, int64_t KVH, int64_t D,
                                 int64_t BS, float scale, float *out, int threads) {
    const int64_t G = H / KVH, row = KVH * D; /* floats from one slot to the next */
    _Pragma("omp parallel for schedule(static) num_threads(threads) if(threads > 1 && S * H > 1)")
    for (int64_t task = 0; task < S * H; task++) {
        const int64_t s = task / H, head = task % H, kvh = head / G, L = ctx[s], nblocks = (L + BS - 1) / BS;
        const int64_t *table = tables + s * ldt;
        float *pg = (float *)malloc(sizeof(float) * (size_t)(L > 0 ? L : 1));
        const float *qv = q + (s * H + head) * D;
        float mx = -INFINITY;
        for (int64_t b = 0, t = 0; b < nblocks; b++) {
            const float *kb = k_cache + table[b] * BS * row + kvh * D;
            for (int64_t j = 0; j < BS && t < L; j++, t++) {
                const float *kv = kb + j * row;
                __m256 acc = _mm256_setzero_ps();
                for (int64_t i = 0; i < D; i += 8)
                    acc = _mm256_fmadd_ps(_mm256_loadu_ps(qv + i), _mm256_loadu_ps(kv + i), acc);
                pg[t] = hsum(acc) * scale;
                if (pg[t] > mx) mx = pg[t];
            }
        }
        __m256 dsum = _mm256_setzero_ps();
        const __m256 mxv = _mm256_set1_ps(mx);
        int64_t t = 0;
        for (; t + 8 <= L; t += 8) {
            const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(pg + t), mxv));
            _mm256_storeu_ps(pg + t, e);
            dsum = _mm256_add_ps(dsum, e);
        }
        float denom = hsum(dsum);
        for (; t < L; t++) { pg[t] = expf(pg[t] - mx); denom += pg[t]; }
        float *o = out + (s * H + head) * D;
        for (int64_t i = 0; i < D; i += 8) _mm256_storeu_ps(o + i, _mm256_setzero_ps());
        t = 0;
        for (int64_t b = 0; b < nblocks; b++) {
            const float *vb = v_cache + table[b] * BS * row + kvh * D;
            for (int64_t j = 0; j < BS && t < L; j++, t++) {
                const __m256 w = _mm256_set1_ps(pg[t]);
                const float *vv = vb + j * row;
                for (int64_t i = 0; i < D; i += 8)
                    _mm256_storeu_ps(o + i, _mm256_fmadd_ps(w, _mm256_loadu_ps(vv + i), _mm256_loadu_ps(o + i)));
            }
        }
        const __m256 inv = _mm256_set1_ps(1.0f / denom);
        for (int64_t i = 0; i < D; i += 8) _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_loadu_ps(o + i), inv));
        free(pg);
    }
}

/* ------------------------------------------------------------------------------------------------
 * A whole decoder layer of a Llama-family model for a step of decodes (one new token per sequence),
 * in one call: what the engine's Python layer does op by op, without torch's per-op cost (which at
 * batch 1 took about as long as the projections themselves).
 *
 *   h += o_proj(attention(rope(qkv_proj(norm1(h)))))      (K/V written to their cache slots first)
 *   h += down_proj(silu(gate) * up),  [gate; up] = gate_up_proj(norm2(h))
 *
 * Weights: one of the formats above per projection (fmt: 0 = Q4_1, 1 = Q8_0). cos/sin: [T, D/2]
 * rows of the rope table for each token's position (rotate-half convention). timing: NULL, or
 * three doubles that the call adds its seconds to (see TIMED). */
typedef void (*gemm_fn)(const float *, int64_t, int64_t, int64_t, const void *, int64_t, const float *, float *,
                        int64_t, int, void *);

static gemm_fn gemm_of(int fmt) { return fmt == 0 ? asyncinfer_gemm_q4_1 : asyncinfer_gemm_q8_0; }

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* With a timing array (profiling), seconds are added up per part: [0] projections, [1] attention,
 * [2] the whole layer. */
#define TIMED(slot, call)                                                                         \
    do {                                                                                          \
        if (timing) mark = now();                                                                 \
        call;                                                                                     \
        if (timing) timing[slot] += now() - mark;                                                 \
    } while (0)

void asyncinfer_decode_layer(float *h, int64_t T, int64_t hidden, const float *norm1, const float *norm2, float eps,
                             const void *w_qkv, int fmt_qkv, const float *b_qkv, const void *w_o, int fmt_o,
                             const void *w_gate_up, int fmt_gate_up, const void *w_down, int fmt_down, int64_t H,
                             int64_t KVH, int64_t D, int64_t I, const float *cos, const float *sin, float *k_cache,
                             float *v_cache, const int64_t *slots, const int64_t *tables, int64_t ldt,
                             const int64_t *ctx, int64_t BS, float scale, int threads, double *timing) {
    const int64_t q_size = H * D, kv_size = KVH * D, qkv_size = q_size + 2 * kv_size, half = D / 2;
    const double start = timing ? now() : 0.0;
    double mark = start;
    const int64_t widest = qkv_size > 2 * I ? qkv_size : 2 * I;
    const int64_t k_in = hidden > I ? (hidden > q_size ? hidden : q_size) : (I > q_size ? I : q_size);
    float *x = (float *)malloc(sizeof(float) * (size_t)(T * (hidden > q_size ? hidden : q_size)));
    float *wide = (float *)malloc(sizeof(float) * (size_t)(T * widest));
    float *attn = (float *)malloc(sizeof(float) * (size_t)(T * (q_size > I ? q_size : I)));
    float *out = (float *)malloc(sizeof(float) * (size_t)(T * hidden));
    void *scratch = malloc((size_t)asyncinfer_scratch_bytes(T, k_in) + 64);

    /* attention block */
    asyncinfer_rms_norm(h, T, hidden, hidden, norm1, eps, x, threads);
    TIMED(0, gemm_of(fmt_qkv)(x, T, hidden, hidden, w_qkv, qkv_size, b_qkv, wide, qkv_size, threads, scratch));
    for (int64_t t = 0; t < T; t++) {
        float *row = wide + t * qkv_size;
        const float *c = cos + t * half, *sn = sin + t * half;
        for (int64_t head = 0; head < H + KVH; head++) { /* q heads, then k heads: adjacent in the row */
            float *v = row + head * D;
            for (int64_t i = 0; i < half; i++) {
                const float x1 = v[i], x2 = v[i + half];
                const float a = x1 * c[i], b = x2 * sn[i], e = x2 * c[i], f = x1 * sn[i];
                v[i] = a - b;
                v[i + half] = e + f;
            }
        }
        memcpy(k_cache + slots[t] * kv_size, row + q_size, sizeof(float) * (size_t)kv_size);
        memcpy(v_cache + slots[t] * kv_size, row + q_size + kv_size, sizeof(float) * (size_t)kv_size);
        memcpy(x + t * q_size, row, sizeof(float) * (size_t)q_size); /* q, packed for attention */
    }
    TIMED(1, asyncinfer_decode_attention(x, k_cache, v_cache, tables, ldt, ctx, T, H, KVH, D, BS, scale, attn, threads));
    TIMED(0, gemm_of(fmt_o)(attn, T, q_size, q_size, w_o, hidden, NULL, out, hidden, threads, scratch));
    for (int64_t i = 0; i < T * hidden; i++) h[i] += out[i];

    /* MLP block */
    asyncinfer_rms_norm(h, T, hidden, hidden, norm2, eps, x, threads);
    TIMED(0, gemm_of(fmt_gate_up)(x, T, hidden, hidden, w_gate_up, 2 * I, NULL, wide, 2 * I, threads, scratch));
    for (int64_t t = 0; t < T; t++) {
        const float *g = wide + t * 2 * I, *u = g + I;
        float *a = attn + t * I;
        int64_t i = 0;
        for (; i + 8 <= I; i += 8) {
            const __m256 gv = _mm256_loadu_ps(g + i);
            const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv));
            const __m256 silu = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
            _mm256_storeu_ps(a + i, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
        }
        for (; i < I; i++) a[i] = (g[i] / (1.0f + expf(-g[i]))) * u[i];
    }
    TIMED(0, gemm_of(fmt_down)(attn, T, I, I, w_down, hidden, NULL, out, hidden, threads, scratch));
    for (int64_t i = 0; i < T * hidden; i++) h[i] += out[i];

    free(x); free(wide); free(attn); free(out); free(scratch);
    if (timing) timing[2] += now() - start;
}

int asyncinfer_panel_min_rows(void) { return PANEL_MIN_ROWS; }

/* The kernels' version: the Python side refuses a cached build of another. */
int asyncinfer_kernels_version(void) { return 17; }
