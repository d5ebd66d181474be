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
 * The weights are the blocks' exact values. Below PANEL_MIN_ROWS activation rows, activations are
 * rounded per block of 32 to int16 (see quantize_acts), the integer products summed exactly, and each
 * block's sum scaled in float32; from it on, weights are rebuilt in float32 (see gemm_panel).
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

/* Batches of PANEL_MIN_ROWS activation rows or more: each thread rebuilds TN weight rows at a time in
 * float32 (the blocks' exact values) and multiplies them by the float32 activations (not rounded;
 * packed per tile, see pack_acts) in register tiles of 6 weight rows x 16 tokens (12 rows x 8 for the
 * last 8 or fewer): one weight broadcast and one FMA per 8 products, no horizontal sums. The rebuild
 * is paid once per weight row and pass (see PANEL_PASS_BYTES). Each output is one float32 sum over k
 * in order, in its own lane, so a row's result never depends on the other rows of the call. */
#define TN 12
#ifndef PANEL_MIN_ROWS
#define PANEL_MIN_ROWS 5
#endif

/* One row's weights in float32, in order: Q4_1 d * q + m (one rounding), Q8_0 d * q. */
static void rebuild_row(const uint8_t *row, int64_t nb, int has_min, float *out) {
    const uint16_t *d16 = (const uint16_t *)row, *m16 = d16 + nb;
    const uint8_t *qs = row + (has_min ? 4 : 2) * nb;
    if (has_min) {
        const __m256i low = _mm256_set1_epi32(0x0F);
        for (int64_t b = 0; b < nb; b++, out += QK) {
            const __m256 d = _mm256_set1_ps(half_to_float(d16[b])), m = _mm256_set1_ps(half_to_float(m16[b]));
            for (int h = 0; h < 2; h++) { /* bytes 8h to 8h + 7: elements 8h on (low nibbles), 16 + 8h on (high) */
                const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 16 * b + 8 * h)));
                _mm256_storeu_ps(out + 8 * h, _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(v, low)), m));
                _mm256_storeu_ps(out + 16 + 8 * h, _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)), m));
            }
        }
    } else {
        for (int64_t b = 0; b < nb; b++, out += QK) {
            const __m256 d = _mm256_set1_ps(half_to_float(d16[b]));
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

static void gemm_panel(const float *x, int64_t M, int64_t ldx, int64_t K, const uint8_t *rows, int64_t N,
                       int64_t row_bytes, int has_min, const float *bias, float *y, int64_t ldy, int threads,
                       float *xt) {
    const int64_t nb = K / QK, groups = (N + TN - 1) / TN, Mp = (M + 7) / 8 * 8;
    if (K == 0) { /* empty sums: the bias, as the row kernels give */
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = 0; n < N; n++) y[m * ldy + n] = bias ? bias[n] : 0.0f;
        return;
    }
    int64_t pass = PANEL_PASS_BYTES / (4 * K) / 16 * 16;
    pass = pass < 16 ? 16 : pass;
    _Pragma("omp parallel num_threads(threads) if(threads > 1)")
    {
        pack_acts(x, M, ldx, K, Mp, xt);
        float *panel = (float *)malloc(sizeof(float) * (size_t)(TN * K));
        for (int64_t p0 = 0; p0 < Mp; p0 += pass) {
            const int64_t p1 = Mp - p0 < pass ? Mp : p0 + pass;
            _Pragma("omp for schedule(static)")
            for (int64_t g = 0; g < groups; g++) {
                const int64_t n0 = g * TN, nr = N - n0 < TN ? N - n0 : TN;
                for (int64_t r = 0; r < nr; r++) rebuild_row(rows + (n0 + r) * row_bytes, nb, has_min, panel + r * K);
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
    return M >= PANEL_MIN_ROWS ? (M + 7) / 8 * 8 * K * 4 : M * K * 2 + 2 * M * (K / QK) * 4;
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
 * D must be a multiple of 8.
 *
 * Each key's score is one 8-lane dot product (hsum), four keys in flight at a time so that the
 * FMA chains overlap; the output is accumulated in registers, 32 dimensions at a time over every
 * value row (two keys in flight, even and odd, added at the end), so nothing waits on a store. */
static inline float key_score(const float *qv, const float *kv, int64_t D) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < D; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qv + i), _mm256_loadu_ps(kv + i), acc);
    return hsum(acc);
}

/* Memory, not arithmetic, bounds decode attention (the cache is cold after a step's weights have
 * streamed through): rows AHEAD keys on are requested while the current ones are summed, so that
 * many misses are in flight at once. */
#define AHEAD 16
static inline void prefetch_keys(const float *cache, const int64_t *table, int64_t t, int64_t BS, int64_t row,
                                 int64_t D, int rows) {
    const float *p = cache + table[t / BS] * BS * row + (t % BS) * row;
    for (int r = 0; r < rows; r++)
        for (int64_t i = 0; i < D; i += 16) _mm_prefetch((const char *)(p + r * row + i), _MM_HINT_T0);
}

static void attend(const float *qv, const float *k_cache, const float *v_cache, const int64_t *table, int64_t L,
                   int64_t BS, int64_t row, int64_t D, float scale, float *pg, float *o) {
    float mx = -INFINITY;
    for (int64_t b = 0, t = 0; t < L; b++) {
        const float *kb = k_cache + table[b] * BS * row;
        const int64_t n = L - t < BS ? L - t : BS;
        int64_t j = 0;
        for (; j + 4 <= n; j += 4) { /* the same per-key sums as key_score, four chains at once */
            const float *k0 = kb + j * row, *k1 = k0 + row, *k2 = k1 + row, *k3 = k2 + row;
            if (t + j + AHEAD < L) prefetch_keys(k_cache, table, t + j + AHEAD, BS, row, D, 4);
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int64_t i = 0; i < D; i += 8) {
                const __m256 qi = _mm256_loadu_ps(qv + i);
                a0 = _mm256_fmadd_ps(qi, _mm256_loadu_ps(k0 + i), a0);
                a1 = _mm256_fmadd_ps(qi, _mm256_loadu_ps(k1 + i), a1);
                a2 = _mm256_fmadd_ps(qi, _mm256_loadu_ps(k2 + i), a2);
                a3 = _mm256_fmadd_ps(qi, _mm256_loadu_ps(k3 + i), a3);
            }
            pg[t + j] = hsum(a0) * scale;
            pg[t + j + 1] = hsum(a1) * scale;
            pg[t + j + 2] = hsum(a2) * scale;
            pg[t + j + 3] = hsum(a3) * scale;
        }
        for (; j < n; j++) pg[t + j] = key_score(qv, kb + j * row, D) * scale;
        for (j = 0; j < n; j++) mx = pg[t + j] > mx ? pg[t + j] : mx;
        t += n;
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
    const __m256 inv = _mm256_set1_ps(1.0f / denom);
    const int64_t wide = D - D % 32;
    for (int64_t i0 = 0; i0 < wide; i0 += 32) {
        __m256 e0 = _mm256_setzero_ps(), e1 = e0, e2 = e0, e3 = e0, o0 = e0, o1 = e0, o2 = e0, o3 = e0;
        t = 0;
        for (int64_t b = 0; t < L; b++) {
            const float *vb = v_cache + table[b] * BS * row + i0;
            const int64_t n = L - t < BS ? L - t : BS;
            int64_t j = 0;
            for (; j + 2 <= n; j += 2) {
                const float *v0 = vb + j * row, *v1 = v0 + row;
                if (t + j + AHEAD < L) prefetch_keys(v_cache + i0, table, t + j + AHEAD, BS, row, 32, 2);
                const __m256 w0 = _mm256_broadcast_ss(pg + t + j), w1 = _mm256_broadcast_ss(pg + t + j + 1);
                e0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(v0), e0);
                e1 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(v0 + 8), e1);
                e2 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(v0 + 16), e2);
                e3 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(v0 + 24), e3);
                o0 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(v1), o0);
                o1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(v1 + 8), o1);
                o2 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(v1 + 16), o2);
                o3 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(v1 + 24), o3);
            }
            if (j < n) { /* an odd block length: its last key on the even chains */
                const float *v0 = vb + j * row;
                const __m256 w0 = _mm256_broadcast_ss(pg + t + j);
                e0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(v0), e0);
                e1 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(v0 + 8), e1);
                e2 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(v0 + 16), e2);
                e3 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(v0 + 24), e3);
            }
            t += n;
        }
        _mm256_storeu_ps(o + i0, _mm256_mul_ps(_mm256_add_ps(e0, o0), inv));
        _mm256_storeu_ps(o + i0 + 8, _mm256_mul_ps(_mm256_add_ps(e1, o1), inv));
        _mm256_storeu_ps(o + i0 + 16, _mm256_mul_ps(_mm256_add_ps(e2, o2), inv));
        _mm256_storeu_ps(o + i0 + 24, _mm256_mul_ps(_mm256_add_ps(e3, o3), inv));
    }
    for (int64_t i0 = wide; i0 < D; i0 += 8) { /* D not a multiple of 32: the last 8s one chain each */
        __m256 acc = _mm256_setzero_ps();
        t = 0;
        for (int64_t b = 0; t < L; b++) {
            const float *vb = v_cache + table[b] * BS * row + i0;
            const int64_t n = L - t < BS ? L - t : BS;
            for (int64_t j = 0; j < n; j++)
                acc = _mm256_fmadd_ps(_mm256_broadcast_ss(pg + t + j), _mm256_loadu_ps(vb + j * row), acc);
            t += n;
        }
        _mm256_storeu_ps(o + i0, _mm256_mul_ps(acc, inv));
    }
}

void asyncinfer_decode_attention(const float *q, const float *k_cache, const float *v_cache, const int64_t *tables,
                                 int64_t ldt, const int64_t *ctx, int64_t S, int64_t H, int64_t KVH, int64_t D,
                                 int64_t BS, float scale, float *out, int threads) {
    const int64_t G = H / KVH, row = KVH * D; /* floats from one slot to the next */
    _Pragma("omp parallel for schedule(static) num_threads(threads) if(threads > 1 && S * H > 1)")
    for (int64_t task = 0; task < S * H; task++) {
        const int64_t s = task / H, head = task % H, kvh = head / G, L = ctx[s];
        float *pg = (float *)malloc(sizeof(float) * (size_t)(L > 0 ? L : 1));
        attend(q + (s * H + head) * D, k_cache + kvh * D, v_cache + kvh * D, tables + s * ldt, L, BS, row, D, scale,
               pg, out + (s * H + head) * D);
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

/* One layer's weights and shape, built once (the Python side's DecodeLayer holds one). */
typedef struct {
    const float *norm1, *norm2;
    const void *w_qkv;
    const float *b_qkv; /* [q + 2 kv] or NULL */
    const void *w_o, *w_gate_up, *w_down;
    int32_t fmt_qkv, fmt_o, fmt_gate_up, fmt_down;
    int64_t hidden, H, KVH, D, I;
    float eps, scale;
} layer_t;

/* A step's working memory, sized for the widest layer of a call. */
typedef struct {
    float *x, *wide, *attn, *out;
    void *scratch;
} step_bufs;

static int bufs_alloc(step_bufs *b, const layer_t *layers, int64_t n, int64_t T) {
    int64_t xw = 0, ww = 0, aw = 0, ow = 0, sb = 0;
    for (int64_t l = 0; l < n; l++) {
        const layer_t *L = layers + l;
        const int64_t q = L->H * L->D, qkv = q + 2 * L->KVH * L->D, k_in = L->hidden > L->I ? L->hidden : L->I;
        const int64_t cand[4] = {L->hidden > q ? L->hidden : q, qkv > 2 * L->I ? qkv : 2 * L->I, q > L->I ? q : L->I,
                                 L->hidden};
        xw = cand[0] > xw ? cand[0] : xw;
        ww = cand[1] > ww ? cand[1] : ww;
        aw = cand[2] > aw ? cand[2] : aw;
        ow = cand[3] > ow ? cand[3] : ow;
        const int64_t s = asyncinfer_scratch_bytes(T, k_in > q ? k_in : q);
        sb = s > sb ? s : sb;
    }
    b->x = (float *)malloc(sizeof(float) * (size_t)(T * xw));
    b->wide = (float *)malloc(sizeof(float) * (size_t)(T * ww));
    b->attn = (float *)malloc(sizeof(float) * (size_t)(T * aw));
    b->out = (float *)malloc(sizeof(float) * (size_t)(T * ow));
    b->scratch = malloc((size_t)sb + 64);
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
 * [2] the whole layer. */
#define TIMED(slot, call)                                                                         \
    do {                                                                                          \
        if (timing) mark = now();                                                                 \
        call;                                                                                     \
        if (timing) timing[slot] += now() - mark;                                                 \
    } while (0)

static void layer_step(const layer_t *L, float *h, int64_t T, const float *cos, const float *sin, float *k_cache,
                       float *v_cache, const int64_t *slots, const int64_t *tables, int64_t ldt, const int64_t *ctx,
                       int64_t BS, int threads, double *timing, const step_bufs *b) {
    const int64_t hidden = L->hidden, H = L->H, KVH = L->KVH, D = L->D, I = L->I;
    const int64_t q_size = H * D, kv_size = KVH * D, qkv_size = q_size + 2 * kv_size, half = D / 2;
    const double start = timing ? now() : 0.0;
    double mark = start;
    float *x = b->x, *wide = b->wide, *attn = b->attn, *out = b->out;

    /* attention block */
    asyncinfer_rms_norm(h, T, hidden, hidden, L->norm1, L->eps, x, threads);
    TIMED(0, gemm_of(L->fmt_qkv)(x, T, hidden, hidden, L->w_qkv, qkv_size, L->b_qkv, wide, qkv_size, threads,
                                 b->scratch));
    _Pragma("omp parallel for schedule(static) num_threads(threads) if(threads > 1 && T >= 8)")
    for (int64_t t = 0; t < T; t++) {
        float *row = wide + t * qkv_size;
        const float *c = cos + t * half, *sn = sin + t * half;
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
    TIMED(1, asyncinfer_decode_attention(x, k_cache, v_cache, tables, ldt, ctx, T, H, KVH, D, BS, L->scale, attn,
                                         threads));
    TIMED(0, gemm_of(L->fmt_o)(attn, T, q_size, q_size, L->w_o, hidden, NULL, out, hidden, threads, b->scratch));
    for (int64_t i = 0; i < T * hidden; i++) h[i] += out[i];

    /* MLP block */
    asyncinfer_rms_norm(h, T, hidden, hidden, L->norm2, L->eps, x, threads);
    TIMED(0, gemm_of(L->fmt_gate_up)(x, T, hidden, hidden, L->w_gate_up, 2 * I, NULL, wide, 2 * I, threads,
                                     b->scratch));
    _Pragma("omp parallel for schedule(static) num_threads(threads) if(threads > 1 && T >= 8)")
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
    TIMED(0, gemm_of(L->fmt_down)(attn, T, I, I, L->w_down, hidden, NULL, out, hidden, threads, b->scratch));
    for (int64_t i = 0; i < T * hidden; i++) h[i] += out[i];
    if (timing) timing[2] += now() - start;
}

/* One layer (DecodeLayer). Returns 0, or -1 when its working memory cannot be allocated. */
int asyncinfer_decode_layer(const layer_t *L, float *h, int64_t T, const float *cos, const float *sin,
                            float *k_cache, float *v_cache, const int64_t *slots, const int64_t *tables, int64_t ldt,
                            const int64_t *ctx, int64_t BS, int threads, double *timing) {
    step_bufs b;
    const int ok = bufs_alloc(&b, L, 1, T);
    if (ok) layer_step(L, h, T, cos, sin, k_cache, v_cache, slots, tables, ldt, ctx, BS, threads, timing, &b);
    bufs_free(&b);
    return ok ? 0 : -1;
}

void asyncinfer_argmax(const float *x, int64_t rows, int64_t n, int64_t ldx, int64_t *out);

/* The paged inputs of S sequences checked against the caches (num_blocks blocks of BS slots): 0; 3 for
 * a context length below 1 or longer than its block table (ldt blocks); 4 for a slot (slots: NULL or
 * [S]) or a block id that the context reads outside the caches. The kernels read and write only where
 * these point, so the Python side checks them first. */
int asyncinfer_check_paged(const int64_t *tables, int64_t ldt, const int64_t *ctx, const int64_t *slots, int64_t S,
                           int64_t BS, int64_t num_blocks) {
    for (int64_t s = 0; s < S; s++) {
        if (ctx[s] < 1 || (ctx[s] + BS - 1) / BS > ldt) return 3;
        if (slots && (slots[s] < 0 || slots[s] >= num_blocks * BS)) return 4;
        for (int64_t b = 0; b < (ctx[s] + BS - 1) / BS; b++)
            if (tables[s * ldt + b] < 0 || tables[s * ldt + b] >= num_blocks) return 4;
    }
    return 0;
}

/* Every layer of a model and its final norm for a step of decodes (DecodeStack).
 *   h: [T, hidden], the residual stream, or NULL (allocated here); ids: NULL (h holds the embedded
 *     tokens), or the tokens, whose rows of the float32 embedding table [vocab, hidden] fill h first;
 *   cos_table / sin_table: [max_pos, D / 2], read at each token's position;
 *   caches: layer l's K and V caches at 2l and 2l + 1;
 *   out: [T, hidden], the final-normed states, or NULL (allocated here);
 *   logits: NULL, or [T, head_n]: out times the head's weights (head_w in format head_fmt);
 *   argmax: NULL, or [T]: each logits row's argmax (asyncinfer_argmax), for greedy sampling;
 *   timing: NULL or four doubles, the layers' three (TIMED) and the head's.
 * num_slots: the caches' blocks times BS. Returns 0; 1 for a token id outside [0, vocab), 2 for a
 * position outside [0, max_pos), 3 for a context length below 1 or longer than its block table, 4
 * for a slot or block outside the caches (nothing is computed then); -1 when working memory cannot
 * be allocated. */
int asyncinfer_decode_stack(const layer_t *layers, int64_t n, float *const *caches, float *h, int64_t T,
                            const int64_t *ids, const float *embed, int64_t vocab, const int64_t *positions,
                            const float *cos_table, const float *sin_table, int64_t max_pos, const float *final_norm,
                            float final_eps, float *out, const void *head_w, int head_fmt, int64_t head_n,
                            float *logits, int64_t *argmax, const int64_t *slots, const int64_t *tables, int64_t ldt,
                            const int64_t *ctx, int64_t BS, int64_t num_slots, int threads, double *timing) {
    const int64_t hidden = layers[0].hidden, half = layers[0].D / 2;
    for (int64_t t = 0; t < T; t++) {
        if (ids && (ids[t] < 0 || ids[t] >= vocab)) return 1;
        if (positions[t] < 0 || positions[t] >= max_pos) return 2;
    }
    const int paged = asyncinfer_check_paged(tables, ldt, ctx, slots, T, BS, num_slots / BS);
    if (paged) return paged;
    step_bufs b;
    float *cs = (float *)malloc(sizeof(float) * (size_t)(2 * T * half));
    float *own_h = h ? NULL : (float *)malloc(sizeof(float) * (size_t)(T * hidden));
    float *own_out = out ? NULL : (float *)malloc(sizeof(float) * (size_t)(T * hidden));
    h = h ? h : own_h;
    out = out ? out : own_out;
    int ok = bufs_alloc(&b, layers, n, T) && cs && h && out;
    if (ok) {
        if (ids)
            for (int64_t t = 0; t < T; t++) memcpy(h + t * hidden, embed + ids[t] * hidden, sizeof(float) * (size_t)hidden);
        for (int64_t t = 0; t < T; t++) {
            memcpy(cs + t * half, cos_table + positions[t] * half, sizeof(float) * (size_t)half);
            memcpy(cs + (T + t) * half, sin_table + positions[t] * half, sizeof(float) * (size_t)half);
        }
        for (int64_t l = 0; l < n; l++)
            layer_step(layers + l, h, T, cs, cs + T * half, caches[2 * l], caches[2 * l + 1], slots, tables, ldt, ctx,
                       BS, threads, timing, &b);
        asyncinfer_rms_norm(h, T, hidden, hidden, final_norm, final_eps, out, threads);
        if (logits) {
            double mark = 0.0;
            TIMED(3, gemm_of(head_fmt)(out, T, hidden, hidden, head_w, head_n, NULL, logits, head_n, threads,
                                       b.scratch));
            if (argmax) asyncinfer_argmax(logits, T, head_n, head_n, argmax);
        }
    }
    bufs_free(&b);
    free(cs);
    free(own_h);
    free(own_out);
    return ok ? 0 : -1;
}

/* The index of each row's largest value, the first one among equals, as torch.argmax picks it (a NaN
 * counts as the largest: the first NaN's index). x: [rows, n], row stride ldx; out: [rows]. */
void asyncinfer_argmax(const float *x, int64_t rows, int64_t n, int64_t ldx, int64_t *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *v = x + r * ldx;
        int64_t i = 0, best = 0;
        __m256 mx = _mm256_set1_ps(-INFINITY);
        __m256i at = _mm256_setzero_si256(), idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        int nan = 0;
        const int64_t wide = n < (int64_t)1 << 31 ? n - n % 8 : 0; /* int32 lane indices */
        for (; i < wide; i += 8) {
            const __m256 e = _mm256_loadu_ps(v + i);
            if (_mm256_movemask_ps(_mm256_cmp_ps(e, e, _CMP_UNORD_Q))) { nan = 1; break; }
            const __m256 gt = _mm256_cmp_ps(e, mx, _CMP_GT_OQ); /* strictly greater: a lane keeps its first */
            mx = _mm256_blendv_ps(mx, e, gt);
            at = _mm256_blendv_epi8(at, idx, _mm256_castps_si256(gt));
            idx = _mm256_add_epi32(idx, _mm256_set1_epi32(8));
        }
        float m = -INFINITY; /* the maximum of v[0, i) and its first index (0 while all are -inf) */
        if (!nan && i > 0) {
            float lm[8];
            int32_t li[8];
            _mm256_storeu_ps(lm, mx);
            _mm256_storeu_si256((__m256i *)li, at);
            m = lm[0];
            best = li[0];
            for (int k = 1; k < 8; k++)
                if (lm[k] > m || (lm[k] == m && li[k] < best)) { m = lm[k]; best = li[k]; }
        }
        if (nan) i = 0; /* start again, one value at a time, to find the first NaN */
        for (; i < n; i++) {
            if (v[i] != v[i]) { best = i; break; }
            if (v[i] > m) { m = v[i]; best = i; }
        }
        out[r] = best;
    }
}

int asyncinfer_panel_min_rows(void) { return PANEL_MIN_ROWS; }

/* The kernels' version: the Python side refuses a cached build of another. */
int asyncinfer_kernels_version(void) { return 23; }
