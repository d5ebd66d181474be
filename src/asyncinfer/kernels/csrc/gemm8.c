/* Block formats with 8-bit activations (format codes with ASYNCINFER_FMT_ACT8 set): at any number of
 * activation rows, each block of 32 activations is rounded to int8 (x ~= dx * qx, |qx| <= 127, rounded to
 * nearest even, dx = the block's largest |x| / 127) instead of int16, so that a sub-block's products take the
 * bytes as they come (u8 quants times s8 activations: maddubs, then madd with ones, or VNNI's vpdpbusd; 256 bits
 * a sub-block, the AVX-512 build 512 bits two sub-blocks, or for Q4_0 / Q4_1 a half of each of four blocks) instead
 * of widening both sides to 16 bits. This is llama.cpp's numerics (its Q8_0 / Q8_K activations): a scale per 32
 * activations, and on the AVX-512 builds one per 256 for the k-quants, in the rows and the tile alike, as llama.cpp
 * takes for them (acts8_per_256). Prefills and batched decodes too: the rows (or the tile below), and a row's result
 * does not depend on the other rows of the call.
 *
 * The result, in every variant: per sub-block of 32 weights (the activations' blocks line up with them)
 *
 *   float(idot) * (dx * scale_j)   (+ min_j * the block's float32 sum of x),   summed in float32,
 *
 * idot the exact integer dot product of the sub-block's signed integer quants (blocks.h's q: Q6_K's scaled
 * by its int8 scale of each 16) with qx. The SIMD builds take the quants unsigned (Q4_0's nibble, not
 * nibble - 8) and subtract centre * (the sum of qx) from the integer, so idot is the same integer; they
 * differ from the scalar reference only in the order of the float32 additions (tests bound it). The exception: the
 * AVX-512 builds round the k-quants' activations with one dx per 256 (acts8_per_256), a definition of their own that
 * the tests hold both GEMMs to in float64: the rows sum a super-block's products in int32 and multiply once, the
 * tile Q6_K's so too and Q4_K's / Q5_K's per block in float32 (tile8_kernel).
 *
 * The AVX-512 builds' int16 tile (tile16_gemm, at the end) shares the int8 tile's weight unpacking and layout: the
 * int16 default's GEMM from PANEL_MIN_ROWS rows on there (gemm.c's BATCHED).
 */
#include "internal.h"
#include "blocks.h"

#define MR8 4 /* activation rows per pass over a weight row */
/* Whether the format adds a min term (blocks.h's formats, and the regrouped Q4_1). */
static inline int has_min8(int fmt) { return fmt == ASYNCINFER_FMT_Q4_1 || ai_fmt_has_min(fmt); }

#define PREFETCH8 AI_PREFETCH_BYTES

/* Activations rounded per block (in order, every variant; the AVX-512 rows then reorder q for Q4_0 / Q4_1,
 * quads8_order, and for Q4_K / Q5_K, k_pairs8_order): q [M, K] int8, d and sum [M, K / 32] float32, isum [M, K / 16]
 * int16 (the sum of each 16 of q).
 * In the caller's scratch: ai_scratch8_bytes(M, K), never more than ai_scratch_bytes(M, K). */
typedef struct {
    int8_t *q;
    float *d;
    float *sum;
    int16_t *isum;
} acts8;

static acts8 acts8_in(void *scratch, int64_t M, int64_t K) {
    acts8 a;
    a.q = (int8_t *)scratch;
    a.d = (float *)((char *)scratch + M * K); /* M * K is a multiple of 32: d stays aligned */
    a.sum = a.d + M * (K / QK);
    a.isum = (int16_t *)(a.sum + M * (K / QK));
    return a;
}

/* Each block's scale dx, its float32 sum and its int8 values (quantize_acts8_ref's rounding: nearest even). */
__attribute__((unused)) static void quantize_acts8_ref(const float *x, int64_t M, int64_t ldx, int64_t K, acts8 *a) {
    const int64_t nb = K / QK;
    for (int64_t m = 0; m < M; m++) {
        for (int64_t b = 0; b < nb; b++) {
            const float *xb = x + m * ldx + b * QK;
            float d, inv, total;
            ai_run_scale_ref(xb, 127.0f, &d, &inv, &total);
            int8_t *q = a->q + m * K + b * QK;
            int s0 = 0, s1 = 0;
            for (int i = 0; i < QK; i++) {
                q[i] = d > 0.0f ? (int8_t)lrintf(xb[i] * inv) : 0;
                if (i < 16) s0 += q[i]; else s1 += q[i];
            }
            a->d[m * nb + b] = d;
            a->sum[m * nb + b] = total;
            a->isum[m * 2 * nb + 2 * b] = (int16_t)s0;
            a->isum[m * 2 * nb + 2 * b + 1] = (int16_t)s1;
        }
    }
}

#ifdef AI_AVX2
/* Block b of row m's 32 values rounded (q, int32 lanes), its scale d and float32 sum, stored in a. */
static inline void acts8_put(const __m256i q[4], float d, float total, int64_t m, int64_t K, int64_t b, acts8 *a) {
    const int64_t nb = K / QK;
    /* packs work within 128-bit lanes: [q0 lo, q1 lo, q0 hi, q1 hi] words, then bytes; the permute restores order */
    const __m256i w01 = _mm256_packs_epi32(q[0], q[1]), w23 = _mm256_packs_epi32(q[2], q[3]);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w01, w23), order);
    _mm256_storeu_si256((__m256i *)(a->q + m * K + b * QK), bytes);
    const __m256i h0 = _mm256_add_epi32(q[0], q[1]), h1 = _mm256_add_epi32(q[2], q[3]);
    __m128i s = _mm_hadd_epi32(_mm_add_epi32(_mm256_castsi256_si128(h0), _mm256_extracti128_si256(h0, 1)),
                               _mm_add_epi32(_mm256_castsi256_si128(h1), _mm256_extracti128_si256(h1, 1)));
    s = _mm_hadd_epi32(s, s); /* lanes 0, 1: the two halves' sums */
    a->d[m * nb + b] = d;
    a->sum[m * nb + b] = total;
    a->isum[m * 2 * nb + 2 * b] = (int16_t)_mm_cvtsi128_si32(s);
    a->isum[m * 2 * nb + 2 * b + 1] = (int16_t)_mm_extract_epi32(s, 1);
}

/* quantize_acts8_ref's values eight lanes at a time (the same rounding; the block's float sum added in another
 * order). */
static void quantize_acts8(const float *x, int64_t M, int64_t ldx, int64_t K, acts8 *a) {
    for (int64_t m = 0; m < M; m++) {
        for (int64_t b = 0; b < K / QK; b++) {
            __m256i q[4];
            float total;
            const float d = ai_round_run(x + m * ldx + b * QK, 127.0f, q, &total);
            acts8_put(q, d, total, m, K, b, a);
        }
    }
}

#ifdef AI_AVX512
/* The k-quants' int8 activations on the AVX-512 builds (acts8_per_256): quantize_acts8's values with one scale for each
 * 256 (a k-quant super-block), as llama.cpp's Q8_K: dx = the 256's largest |x| / 127 (NaN where one of its values
 * is NaN or infinite, or a block's float32 sum overflows), in each of its eight blocks' d; each block's float32 sum
 * and integer sums of 16 as there. */
static void quantize_acts8_256(const float *x, int64_t M, int64_t ldx, int64_t K, acts8 *a) {
    for (int64_t m = 0; m < M; m++) {
        for (int64_t sb = 0; sb < K / 256; sb++) {
            const float *xs = x + m * ldx + 256 * sb;
            __m256 amax = _mm256_setzero_ps();
            float total[8];
            int finite = 1;
            for (int j = 0; j < 8; j++) {
                amax = _mm256_max_ps(amax, ai_run_stats(xs + QK * j, &total[j]));
                finite &= isfinite(total[j]) != 0;
            }
            const float absmax = ai_hmax256(amax);
            const float d = finite && isfinite(absmax) ? absmax / 127.0f : NAN;
            const __m256 inv = _mm256_set1_ps(d > 0.0f ? 127.0f / absmax : 0.0f); /* NaN d: zeros */
            for (int j = 0; j < 8; j++) {
                __m256i q[4];
                ai_round_values(xs + QK * j, inv, q);
                acts8_put(q, d, total[j], m, K, 8 * sb + j, a);
            }
        }
    }
}
#endif
#else
#define quantize_acts8 quantize_acts8_ref
#endif

/* Whether a format's int8 activations take one scale for each 256 (quantize_acts8_256) rather than one for each 32:
 * the k-quants on the AVX-512 builds, in the rows and the tile alike. Their super-blocks of 256 weights share a
 * scale d (Q6_K) or d times 6-bit integer scales (Q4_K, Q5_K), so a super-block's products sum in int32 and take one
 * float multiply by dx rather than one a block of 32 (as llama.cpp's Q8_K activations). */
static inline int acts8_per_256(int fmt) {
#ifdef AI_AVX512
    return fmt == ASYNCINFER_FMT_Q4_K || fmt == ASYNCINFER_FMT_Q5_K || fmt == ASYNCINFER_FMT_Q6_K;
#else
    (void)fmt;
    return 0;
#endif
}

/* Sub-block j's 32 signed integer quants of the block at b in the kernels' layout of a row (the legacy Q4_1 /
 * Q8_0 rows regrouped; the others ggml's blocks): blocks.h's q. */
static inline void sub_quants8(int fmt, const uint8_t *row, int64_t nb, int64_t blk, int j, int16_t *q,
                               float *scale, float *min) {
    if (fmt == ASYNCINFER_FMT_Q4_1 || fmt == ASYNCINFER_FMT_Q8_0) {
        const int has_min = fmt == ASYNCINFER_FMT_Q4_1;
        const uint16_t *d16 = (const uint16_t *)row, *m16 = d16 + nb;
        const uint8_t *qs = row + (has_min ? 4 : 2) * nb;
        *scale = ai_half_to_float(d16[blk]);
        *min = has_min ? ai_half_to_float(m16[blk]) : 0.0f;
        for (int i = 0; i < 32; i++)
            q[i] = has_min ? (int16_t)(i < 16 ? qs[16 * blk + i] & 0x0F : qs[16 * blk + i - 16] >> 4)
                           : (int16_t)((const int8_t *)qs)[32 * blk + i];
        return;
    }
    const uint8_t *p = row + blk * ai_fmt_bytes(fmt);
    float sc[8], mn[8];
    ai_block_scales(fmt, p, sc, mn);
    *scale = sc[j];
    *min = mn[j];
    ai_sub_quants(fmt, p, j, q);
}

/* The scalar reference: one weight row against activation row m, the definition above term by term. */
__attribute__((unused)) static float row8_ref(int fmt, const uint8_t *row, int64_t K, const acts8 *a, int64_t m) {
    const int subs = ai_fmt_subs(fmt);
    const int64_t nblk = K / ai_fmt_weights(fmt), nb = K / QK;
    const int8_t *qx = a->q + m * K;
    const float *dx = a->d + m * nb, *sx = a->sum + m * nb;
    float acc = 0.0f, offset = 0.0f;
    for (int64_t blk = 0; blk < nblk; blk++) {
        for (int j = 0; j < subs; j++) {
            const int64_t b = blk * subs + j;
            int16_t q[32];
            float scale, min;
            sub_quants8(fmt, row, nb, blk, j, q, &scale, &min);
            int64_t s = 0;
            for (int i = 0; i < 32; i++) s += (int64_t)q[i] * qx[b * QK + i];
            acc += (float)s * (dx[b] * scale);
            if (has_min8(fmt)) offset += min * sx[b];
        }
    }
    return acc + offset;
}

#ifdef AI_AVX2
/* ------------------------------------------------------------------------------------------------
 * AVX2 (and the AVX-512 build): a sub-block's 32 quants as unsigned bytes u in order, their products with 32
 * int8 activations in eight int32 lanes (lane l: elements 4 l to 4 l + 3), the centre's term subtracted in
 * lane 0. maddubs' pair sums stay within int16: u <= 63 (Q8_0: |q| <= 128) times |qx| <= 127, twice. */
static inline __m256i dot_u8(__m256i u, __m256i x) { return ai_dpbusd256(_mm256_setzero_si256(), u, x); }

static inline __m256i load_x(const acts8 *a, int64_t m, int64_t K, int64_t b) {
    return _mm256_loadu_si256((const __m256i *)(a->q + m * K + b * QK));
}

static inline int isum32(const acts8 *a, int64_t m, int64_t K, int64_t b) {
    const int16_t *s = a->isum + m * (K / 16) + 2 * b;
    return (int)s[0] + (int)s[1];
}

/* Q4_K / Q5_K: bytes 32 p to 32 p + 31 of the nibbles hold sub-blocks 2 p (low nibbles) and 2 p + 1 (high), in
 * order; Q5_K's fifth bit of sub-block j's element i is bit j of qh[i]. */
static inline __attribute__((always_inline)) void row8_q45_k(const int fmt, const uint8_t *row, int64_t K,
                                                             const acts8 *a, int64_t m0, const int ROWS, float *out) {
    const int five = fmt == ASYNCINFER_FMT_Q5_K;
    const int64_t nblk = K / 256, bytes = ai_fmt_bytes(fmt), nb = K / QK;
    const __m256i low4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
    __m256 acc[MR8][2], off[MR8];
    for (int i = 0; i < MR8; i++) acc[i][0] = acc[i][1] = off[i] = _mm256_setzero_ps();
    for (int64_t blk = 0; blk < nblk; blk++) {
        const uint8_t *p = row + blk * bytes;
        ai_prefetch_lines(p, bytes);
        __m256 minv;
        const __m256 scv = ai_k_scale_vectors(p, &minv);
        float dsc[MR8][8];
        for (int i = 0; i < ROWS; i++) {
            const int64_t at = (m0 + i) * nb + blk * 8;
            _mm256_storeu_ps(dsc[i], _mm256_mul_ps(_mm256_loadu_ps(a->d + at), scv));
            off[i] = _mm256_fmadd_ps(minv, _mm256_loadu_ps(a->sum + at), off[i]);
        }
        const uint8_t *qs = p + (five ? 48 : 16);
        const __m256i h = five ? _mm256_loadu_si256((const __m256i *)(p + 16)) : _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int pr = 0; pr < 4; pr++) {
            const int j0 = 2 * pr, j1 = 2 * pr + 1;
            const __m256i x = _mm256_loadu_si256((const __m256i *)(qs + 32 * pr));
            __m256i u0 = _mm256_and_si256(x, low4), u1 = _mm256_and_si256(_mm256_srli_epi16(x, 4), low4);
            if (five) {
                u0 = _mm256_or_si256(u0, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, j0), one), 4));
                u1 = _mm256_or_si256(u1, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, j1), one), 4));
            }
            for (int i = 0; i < ROWS; i++) {
                const __m256i s0 = dot_u8(u0, load_x(a, m0 + i, K, blk * 8 + j0));
                const __m256i s1 = dot_u8(u1, load_x(a, m0 + i, K, blk * 8 + j1));
                acc[i][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), _mm256_broadcast_ss(&dsc[i][j0]), acc[i][0]);
                acc[i][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), _mm256_broadcast_ss(&dsc[i][j1]), acc[i][1]);
            }
        }
    }
    for (int i = 0; i < ROWS; i++) out[i] = ai_hsum256(_mm256_add_ps(acc[i][0], acc[i][1])) + ai_hsum256(off[i]);
}

/* Q6_K: sub-block j = 4 n + k's 6-bit quants u (ai_q6k_quants) in order; the products' pair sums multiplied by the
 * int8 scale of their half of 16 (madd: lanes 0-3 the first half, 4-7 the second), less 32 * (sc * the half's
 * sum of qx), an integer per sub-block formed for the whole super-block at once. */
static inline __attribute__((always_inline)) void row8_q6_k(const uint8_t *row, int64_t K, const acts8 *a,
                                                            int64_t m0, const int ROWS, float *out) {
    const int64_t nblk = K / 256, nb = K / QK;
    __m256 acc[MR8][2];
    for (int i = 0; i < MR8; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t blk = 0; blk < nblk; blk++) {
        const uint8_t *p = row + blk * 210;
        ai_prefetch_lines(p, 210);
        const int8_t *sc = (const int8_t *)(p + 192);
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc));
        const __m256 d = _mm256_set1_ps(ai_half_at(p + 208));
        float dsc[MR8][8];
        int32_t corr[MR8][8];
        for (int i = 0; i < ROWS; i++) {
            const int64_t at = (m0 + i) * nb + blk * 8;
            _mm256_storeu_ps(dsc[i], _mm256_mul_ps(_mm256_loadu_ps(a->d + at), d));
            const __m256i is = _mm256_loadu_si256((const __m256i *)(a->isum + (m0 + i) * (K / 16) + blk * 16));
            _mm256_storeu_si256((__m256i *)corr[i], _mm256_slli_epi32(_mm256_madd_epi16(sc16, is), 5));
        }
#pragma GCC unroll 2
        for (int n = 0; n < 2; n++) {
            const __m256i L[2] = {_mm256_loadu_si256((const __m256i *)(p + 64 * n)),
                                  _mm256_loadu_si256((const __m256i *)(p + 64 * n + 32))};
            const __m256i H = _mm256_loadu_si256((const __m256i *)(p + 128 + 32 * n));
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++) {
                const int j = 4 * n + k;
                const __m256i u = ai_q6k_quants(L, H, k);
                const __m256i sv = _mm256_set_m128i(_mm_set1_epi16(sc[2 * j + 1]), _mm_set1_epi16(sc[2 * j]));
                for (int i = 0; i < ROWS; i++) {
                    __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(u, load_x(a, m0 + i, K, blk * 8 + j)), sv);
                    s = _mm256_sub_epi32(s, _mm256_setr_epi32(corr[i][j], 0, 0, 0, 0, 0, 0, 0));
                    acc[i][k & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_broadcast_ss(&dsc[i][j]), acc[i][k & 1]);
                }
            }
        }
    }
    for (int i = 0; i < ROWS; i++) out[i] = ai_hsum256(_mm256_add_ps(acc[i][0], acc[i][1]));
}

/* The 32-weight formats, a block at a time: Q4_0, Q5_0, Q5_1 in ggml's blocks (the quants unsigned, Q4_0's and
 * Q5_0's centre 8 / 16 subtracted as centre * the block's sum of qx), Q4_1 and Q8_0 in the regrouped rows (Q8_0's
 * signed bytes: |q| times qx with q's sign). The scales dx * dw of eight blocks formed in one multiply. */
static inline __attribute__((always_inline)) __m256i block_u8(const int fmt, const uint8_t *row, int64_t nb,
                                                              int64_t b) {
    switch (fmt) {
        case ASYNCINFER_FMT_Q4_1: return ai_nibbles32(row + 4 * nb + 16 * b);
        case ASYNCINFER_FMT_Q8_0: return _mm256_loadu_si256((const __m256i *)(row + 2 * nb + 32 * b));
        case ASYNCINFER_FMT_Q4_0: return ai_nibbles32(row + 18 * b + 2);
        case ASYNCINFER_FMT_Q5_0: {
            const uint8_t *p = row + 22 * b;
            return _mm256_or_si256(ai_nibbles32(p + 6), ai_bits32(ai_u32_at(p + 2)));
        }
        default: { /* Q5_1 */
            const uint8_t *p = row + 24 * b;
            return _mm256_or_si256(ai_nibbles32(p + 8), ai_bits32(ai_u32_at(p + 4)));
        }
    }
}

/* The block's float16 scale (and min) at b. */
static inline __attribute__((always_inline)) uint16_t block_d16(const int fmt, const uint8_t *row, int64_t nb,
                                                               int64_t b) {
    uint16_t h;
    switch (fmt) {
        case ASYNCINFER_FMT_Q4_1:
        case ASYNCINFER_FMT_Q8_0: return ((const uint16_t *)row)[b];
        default: memcpy(&h, row + b * ai_fmt_bytes(fmt), 2); return h;
    }
}

static inline __attribute__((always_inline)) float block_min(const int fmt, const uint8_t *row, int64_t nb, int64_t b) {
    if (fmt == ASYNCINFER_FMT_Q4_1) return ai_half_to_float(((const uint16_t *)row)[nb + b]);
    return ai_half_at(row + 24 * b + 2); /* Q5_1 */
}

static inline __attribute__((always_inline)) void row8_blocks(const int fmt, const uint8_t *row, int64_t K,
                                                              const acts8 *a, int64_t m0, const int ROWS, float *out,
                                                              int64_t b_first) {
    const int64_t nb = K / QK;
    const int centre = fmt == ASYNCINFER_FMT_Q4_0 ? 8 : fmt == ASYNCINFER_FMT_Q5_0 ? 16 : 0;
    const int legacy = fmt == ASYNCINFER_FMT_Q4_1 || fmt == ASYNCINFER_FMT_Q8_0;
    const int64_t stride = legacy ? 0 : ai_fmt_bytes(fmt);
    __m256 acc[MR8][2];
    float offset[MR8];
    for (int i = 0; i < MR8; i++) {
        acc[i][0] = acc[i][1] = _mm256_setzero_ps();
        offset[i] = 0.0f;
    }
    for (int64_t b0 = b_first; b0 < nb; b0 += 8) {
        const int64_t n = nb - b0 < 8 ? nb - b0 : 8;
        float sc[MR8][8];
        uint16_t h[8] = {0};
        for (int64_t t = 0; t < n; t++) h[t] = block_d16(fmt, row, nb, b0 + t);
        /* the eight scales in a register, not stored one by one and loaded as a vector (a stall on the stores) */
        const __m256 dwv = _mm256_cvtph_ps(_mm_setr_epi16((short)h[0], (short)h[1], (short)h[2], (short)h[3], (short)h[4],
                                                          (short)h[5], (short)h[6], (short)h[7]));
        for (int i = 0; i < ROWS; i++) {
            if (n == 8) {
                _mm256_storeu_ps(sc[i], _mm256_mul_ps(_mm256_loadu_ps(a->d + (m0 + i) * nb + b0), dwv));
            } else {
                for (int64_t t = 0; t < n; t++) sc[i][t] = a->d[(m0 + i) * nb + b0 + t] * ai_half_to_float(h[t]);
            }
            if (has_min8(fmt))
                for (int64_t t = 0; t < n; t++) offset[i] += block_min(fmt, row, nb, b0 + t) * a->sum[(m0 + i) * nb + b0 + t];
        }
        for (int64_t t = 0; t < n; t++) {
            const int64_t b = b0 + t;
            if (!legacy) _mm_prefetch((const char *)row + b * stride + PREFETCH8, _MM_HINT_T0);
            else _mm_prefetch((const char *)row + (fmt == ASYNCINFER_FMT_Q4_1 ? 20 : 34) * b + PREFETCH8,
                              _MM_HINT_T0);
            const __m256i w = block_u8(fmt, row, nb, b);
            const __m256i u = fmt == ASYNCINFER_FMT_Q8_0 ? _mm256_sign_epi8(w, w) : w;
            for (int i = 0; i < ROWS; i++) {
                const __m256i x = load_x(a, m0 + i, K, b);
                /* the centre's term starts lane 0 */
                const __m256i c = centre ? _mm256_setr_epi32(-centre * isum32(a, m0 + i, K, b), 0, 0, 0, 0, 0, 0, 0)
                                         : _mm256_setzero_si256();
                const __m256i s = ai_dpbusd256(c, u, fmt == ASYNCINFER_FMT_Q8_0 ? _mm256_sign_epi8(x, w) : x);
                acc[i][t & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_broadcast_ss(&sc[i][t]), acc[i][t & 1]);
            }
        }
    }
    for (int i = 0; i < ROWS; i++) out[i] = ai_hsum256(_mm256_add_ps(acc[i][0], acc[i][1])) + offset[i];
}

#ifdef AI_AVX512
/* ---- AVX-512 BW: two sub-blocks (64 weights, 64 activations) per register; lanes 0-7 of the products the
 * first sub-block's, 8-15 the second's; scales and corrections moved into those lanes by permutes. */
static inline __m512i dot512_u8(__m512i u, __m512i x) { return ai_dpbusd512(_mm512_setzero_si512(), u, x); }

/* Q4_0: words 9 t (t = 0-7) of two registers of 64 bytes each (128 bytes from the 18-byte blocks' start), their
 * scales, in words 0-7 (indices 32 on: the second register). */
static const int16_t Q4_0_SCALE_WORDS[32] __attribute__((aligned(64))) = {0, 9, 18, 27, 36, 45, 54, 63};

/* Lanes 0-7: lane a of a vector; 8-15: lane b (an index for the 32-bit permutes). */
static inline __m512i pair_idx(int a, int b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi32(a)), _mm256_set1_epi32(b), 1);
}

/* The same for 64-bit lanes 0-3 / 4-7 (the 64-bit shifts' counts) and 16-bit lanes 0-15 / 16-31 (the 16-bit
 * permutes). */
static inline __m512i pair_idx64(int a, int b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi64x(a)), _mm256_set1_epi64x(b), 1);
}

static inline __m512i pair_idx16(int a, int b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16((short)a)), _mm256_set1_epi16((short)b), 1);
}

static inline __m512i load_x512(const acts8 *a, int64_t m, int64_t K, int64_t b) {
    return _mm512_loadu_si512(a->q + m * K + b * QK);
}

/* The k-quants against activations rounded with a scale per 256 (acts8_per_256): per super-block, each sub-block's
 * integer products times its integer scale summed in int32 (the pair sums of maddubs, then a multiply-add with the
 * scales, fused under VNNI), one convert and one fma with d * dx, as llama.cpp's Q8_K products. Q4_K / Q5_K: two
 * sub-blocks a register, from one load of 64 bytes of quants (bytes 64 q to 64 q + 63: sub-blocks 4 q and 4 q + 2 in
 * their low nibbles, 4 q + 1 and 4 q + 3 in their high ones) split by a mask and a shift, against activations that
 * k_pairs8_order put in that order (lanes 0-7: sub-block j, 8-15: j + 2); Q5_K's fifth bit of sub-block j's element
 * i is bit j of qh[i]. The minimum terms per block with its float32 sum of x, as the rows per 32. The scales (<= 63)
 * times the pair sums (<= 2 * 31 * 127) stay far within int32 over a super-block. */
static inline __attribute__((always_inline)) void row8_q45_k_256(const int fmt, const uint8_t *row, int64_t K,
                                                                 const acts8 *a, int64_t m0, const int ROWS,
                                                                 float *out) {
    const int five = fmt == ASYNCINFER_FMT_Q5_K;
    const int64_t nblk = K / 256, nb = K / QK, bytes = ai_fmt_bytes(fmt);
    const __m512i low4 = _mm512_set1_epi8(0x0F), one = _mm512_set1_epi8(1);
    __m512 acc[MR8];
    __m256 off[MR8];
    for (int i = 0; i < MR8; i++) {
        acc[i] = _mm512_setzero_ps();
        off[i] = _mm256_setzero_ps();
    }
    for (int64_t blk = 0; blk < nblk; blk++) {
        const uint8_t *p = row + blk * bytes, *qs = p + (five ? 48 : 16);
        ai_prefetch_lines_l2(p, bytes);
        uint64_t sc, mn;
        ai_k_scales8(p + 4, &sc, &mn);
        const __m512i sc16 = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)sc)));
        const __m256 minv = ai_k_min_vector(p, mn);
        const float d = ai_half_at(p);
        const __m512i h = five ? _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(p + 16))) : one;
        __m512i is[MR8];
        for (int i = 0; i < ROWS; i++) is[i] = _mm512_setzero_si512();
#pragma GCC unroll 2
        for (int q = 0; q < 2; q++) {
            const __m512i v = _mm512_loadu_si512(qs + 64 * q);
            __m512i u[2] = {_mm512_and_si512(v, low4), _mm512_and_si512(_mm512_srli_epi16(v, 4), low4)};
#pragma GCC unroll 2
            for (int hi = 0; hi < 2; hi++) {
                const int j = 4 * q + hi; /* sub-blocks j (the low half's bytes) and j + 2 (the high half's) */
                if (five) {
                    const __m512i bit = _mm512_and_si512(_mm512_srlv_epi64(h, pair_idx64(j, j + 2)), one);
                    u[hi] = _mm512_or_si512(u[hi], _mm512_slli_epi16(bit, 4));
                }
                const __m512i scv = _mm512_permutexvar_epi16(pair_idx16(j, j + 2), sc16);
                for (int i = 0; i < ROWS; i++) {
                    const __m512i x = load_x512(a, m0 + i, K, blk * 8 + 4 * q + 2 * hi);
                    is[i] = ai_dpwssd512(is[i], _mm512_maddubs_epi16(u[hi], x), scv);
                }
            }
        }
        for (int i = 0; i < ROWS; i++) {
            const int64_t at = (m0 + i) * nb + blk * 8;
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is[i]), _mm512_set1_ps(d * a->d[at]), acc[i]);
            off[i] = _mm256_fmadd_ps(minv, _mm256_loadu_ps(a->sum + at), off[i]);
        }
    }
    for (int i = 0; i < ROWS; i++) out[i] = _mm512_reduce_add_ps(acc[i]) + ai_hsum256(off[i]);
}

/* Q6_K: sub-blocks j, j + 1 (j = 4 n + k, k = 0 or 2): their ql bytes are the 64 at 64 n (low nibbles for
 * k = 0, high for k = 2), their bit pairs qh's 32 bytes at 128 + 32 n moved to bits 4-5 by a shift per half; the
 * pair sums times the int8 scale of their 16, less 32 * (the scale times the 16's sum of qx) for the quants'
 * centre, all in int32 over the super-block (pair sums <= 2 * 63 * 127), then one convert and one fma with d * dx. */
static inline __attribute__((always_inline)) void row8_q6_k_256(const uint8_t *row, int64_t K, const acts8 *a,
                                                                int64_t m0, const int ROWS, float *out) {
    const int64_t nblk = K / 256, nb = K / QK;
    const __m512i low4 = _mm512_set1_epi8(0x0F), two = _mm512_set1_epi8(0x30);
    /* k = 0, 1: qh << 4, << 2; k = 2, 3: qh, qh >> 2 */
    const __m512i left = _mm512_inserti64x4(_mm512_set1_epi64(4), _mm256_set1_epi64x(2), 1);
    const __m512i right = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi64x(2), 1);
    __m512 acc[MR8];
    for (int i = 0; i < MR8; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t blk = 0; blk < nblk; blk++) {
        const uint8_t *p = row + blk * 210;
        ai_prefetch_lines_l2(p, 210);
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p + 192)));
        const __m512i sc512 = _mm512_castsi256_si512(sc16);
        const float d = ai_half_at(p + 208);
        __m512i is[MR8];
        for (int i = 0; i < ROWS; i++) {
            const __m256i xs = _mm256_loadu_si256((const __m256i *)(a->isum + (m0 + i) * (K / 16) + blk * 16));
            const __m256i centre = _mm256_slli_epi32(_mm256_madd_epi16(sc16, xs), 5);
            is[i] = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_sub_epi32(_mm256_setzero_si256(), centre), 0);
        }
#pragma GCC unroll 2
        for (int n = 0; n < 2; n++) {
            const __m512i ql = _mm512_loadu_si512(p + 64 * n);
            const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(p + 128 + 32 * n)));
#pragma GCC unroll 2
            for (int k = 0; k < 4; k += 2) {
                const int j = 4 * n + k;
                const __m512i lo = _mm512_and_si512(k == 0 ? ql : _mm512_srli_epi16(ql, 4), low4);
                const __m512i hi = _mm512_and_si512(k == 0 ? _mm512_sllv_epi64(qh, left) : _mm512_srlv_epi64(qh, right), two);
                const __m512i u = _mm512_or_si512(lo, hi);
                /* int16 lanes 8 h to 8 h + 7: the scale of half 2 j + h */
                const __m512i sv = _mm512_permutexvar_epi16(
                    _mm512_set_epi16(2 * j + 3, 2 * j + 3, 2 * j + 3, 2 * j + 3, 2 * j + 3, 2 * j + 3, 2 * j + 3, 2 * j + 3,
                                     2 * j + 2, 2 * j + 2, 2 * j + 2, 2 * j + 2, 2 * j + 2, 2 * j + 2, 2 * j + 2, 2 * j + 2,
                                     2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1,
                                     2 * j, 2 * j, 2 * j, 2 * j, 2 * j, 2 * j, 2 * j, 2 * j),
                    sc512);
                for (int i = 0; i < ROWS; i++)
                    is[i] = ai_dpwssd512(is[i], _mm512_maddubs_epi16(u, load_x512(a, m0 + i, K, blk * 8 + j)), sv);
            }
        }
        for (int i = 0; i < ROWS; i++) {
            const float dx = a->d[(m0 + i) * nb + blk * 8];
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is[i]), _mm512_set1_ps(d * dx), acc[i]);
        }
    }
    for (int i = 0; i < ROWS; i++) out[i] = _mm512_reduce_add_ps(acc[i]);
}

/* Q8_0: blocks b and b + 1's 64 signed bytes (the regrouped row's quants after its scales). */
static inline __attribute__((always_inline)) __m512i pair_q8_0(const uint8_t *row, int64_t nb, int64_t b) {
    return _mm512_loadu_si512(row + 2 * nb + 32 * b);
}

/* Q4_0 / Q4_1: sixteen blocks b0 to b0 + 15 four at a time (quads), against activations that quads8_order put in
 * quad order (per four blocks: elements 0-15 of each, then 16-31 of each). A quad's 64 bytes of nibbles hold block
 * b + c's 16 bytes in 128-bit lane c (Q4_1's regrouped quants in one load, Q4_0's from its blocks of 18 in four):
 * the low nibbles are elements 0-15 of each block, the high ones 16-31, the two registers of the quad's
 * activations, so two vpdpbusd leave each block's integer sum in the four lanes of its 128-bit lane. The four quads'
 * sums are added pairwise across registers (unpacks) until lane 4 c + r holds block 4 r + c's, then one convert and
 * one fma for the sixteen blocks (their scales sc put in that order), where the pairs take a permute, a convert and
 * an fma per two blocks. */
static inline __attribute__((always_inline)) __m512i quad8_u8(const int fmt, const uint8_t *row, int64_t nb, int64_t b) {
    if (fmt == ASYNCINFER_FMT_Q4_1) return _mm512_loadu_si512(row + 4 * nb + 16 * b);
    const uint8_t *p = row + 18 * b + 2;
    const __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)p));
    return _mm512_inserti32x4(_mm512_inserti32x4(_mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(p + 18)), 1),
                                                  _mm_loadu_si128((const __m128i *)(p + 36)), 2),
                              _mm_loadu_si128((const __m128i *)(p + 54)), 3);
}

static inline __attribute__((always_inline)) void row8_quads16(const int fmt, const uint8_t *row, int64_t nb,
                                                               int64_t K, const acts8 *a, int64_t m0, const int ROWS,
                                                               int64_t b0, const __m512 *sc, __m512 *acc) {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    const int64_t bytes = fmt == ASYNCINFER_FMT_Q4_0 ? 18 : 20;
    __m512i r[MR8][4];
#pragma GCC unroll 4
    for (int q = 0; q < 4; q++) {
        const int64_t b = b0 + 4 * q;
        ai_prefetch_lines_l2(row + bytes * b, 4 * bytes);
        const __m512i v = quad8_u8(fmt, row, nb, b);
        const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
#pragma GCC unroll 4
        for (int i = 0; i < ROWS; i++)
            r[i][q] = ai_dpbusd512(dot512_u8(lo, load_x512(a, m0 + i, K, b)), hi, load_x512(a, m0 + i, K, b + 2));
    }
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
#pragma GCC unroll 4
    for (int i = 0; i < ROWS; i++) {
        const __m512i t0 = _mm512_add_epi32(_mm512_unpacklo_epi32(r[i][0], r[i][1]), _mm512_unpackhi_epi32(r[i][0], r[i][1]));
        const __m512i t1 = _mm512_add_epi32(_mm512_unpacklo_epi32(r[i][2], r[i][3]), _mm512_unpackhi_epi32(r[i][2], r[i][3]));
        __m512i u = _mm512_add_epi32(_mm512_unpacklo_epi64(t0, t1), _mm512_unpackhi_epi64(t0, t1));
        if (fmt == ASYNCINFER_FMT_Q4_0) /* the centre: -8 * (each block's sum of qx), in the integer */
            u = _mm512_add_epi32(u, _mm512_permutexvar_epi32(order, _mm512_madd_epi16(
                                        _mm512_loadu_si512(a->isum + (m0 + i) * (K / 16) + 2 * b0), _mm512_set1_epi16(-8))));
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(u), _mm512_permutexvar_ps(order, sc[i]), acc[i]);
    }
}

/* Activation rows [m0, m1) of a put in quad order, in place, over each run of sixteen whole blocks (the rows'
 * blocks past the last such run stay in order, for row8_blocks): per four blocks, elements 0-15 of each block, then
 * 16-31 of each. */
static inline void quads8_order(const acts8 *a, int64_t m0, int64_t m1, int64_t K) {
    const int64_t n16 = K / QK / 16 * 16;
    const __m512i first = _mm512_setr_epi64(0, 1, 4, 5, 8, 9, 12, 13), second = _mm512_setr_epi64(2, 3, 6, 7, 10, 11, 14, 15);
    for (int64_t m = m0; m < m1; m++)
        for (int64_t b = 0; b < n16; b += 4) {
            int8_t *p = a->q + m * K + b * QK;
            const __m512i x01 = _mm512_loadu_si512(p), x23 = _mm512_loadu_si512(p + 64);
            _mm512_storeu_si512(p, _mm512_permutex2var_epi64(x01, first, x23));
            _mm512_storeu_si512(p + 64, _mm512_permutex2var_epi64(x01, second, x23));
        }
}

/* Q4_0, Q4_1, Q8_0: sixteen blocks' scales (and Q4_1's minimum terms) at a time; Q4_0 and Q4_1 then in quads
 * (row8_quads16, against activations in quad order), Q8_0 in pairs (activations in order); the blocks past the last
 * sixteen through row8_blocks (activations in order for every format). */
static inline __attribute__((always_inline)) void row8_blocks_512(const int fmt, const uint8_t *row, int64_t K,
                                                                  const acts8 *a, int64_t m0, const int ROWS,
                                                                  float *out) {
    const int64_t nb = K / QK, n16 = nb / 16 * 16;
    const int q4_0 = fmt == ASYNCINFER_FMT_Q4_0, q4_1 = fmt == ASYNCINFER_FMT_Q4_1;
    __m512 acc[MR8][2]; /* Q8_0: two a row, pairs alternating; Q4_0 / Q4_1: the first, a run of sixteen at a time */
    __m256 off[MR8];
    for (int i = 0; i < MR8; i++) {
        acc[i][0] = acc[i][1] = _mm512_setzero_ps();
        off[i] = _mm256_setzero_ps();
    }
    for (int64_t b0 = 0; b0 < n16; b0 += 16) {
        /* the sixteen blocks' float16 scales, formed in registers (a vector load of values just stored one by one
         * would wait for the stores to retire) */
        __m256i dh;
        if (q4_0) { /* block t's scale is 16-bit word 9 t of the 18-byte blocks: eight blocks' in two registers, picked
                     * out by one word permute (not sixteen scalar loads and inserts) */
            const uint8_t *p = row + 18 * b0;
            const __m512i pick = _mm512_loadu_si512(Q4_0_SCALE_WORDS);
            const __m512i d0 = _mm512_permutex2var_epi16(_mm512_loadu_si512(p), pick, _mm512_loadu_si512(p + 64));
            const __m512i d1 = _mm512_permutex2var_epi16(_mm512_loadu_si512(p + 144), pick, _mm512_loadu_si512(p + 208));
            dh = _mm256_set_m128i(_mm512_castsi512_si128(d1), _mm512_castsi512_si128(d0));
        } else {
            dh = _mm256_loadu_si256((const __m256i *)(row + 2 * b0));
        }
        const __m256 dw0 = _mm256_cvtph_ps(_mm256_castsi256_si128(dh)), dw1 = _mm256_cvtph_ps(_mm256_extracti128_si256(dh, 1));
        __m512 sc[MR8];
        for (int i = 0; i < ROWS; i++) {
            const int64_t at = (m0 + i) * nb + b0;
            const __m256 s0 = _mm256_mul_ps(_mm256_loadu_ps(a->d + at), dw0);
            const __m256 s1 = _mm256_mul_ps(_mm256_loadu_ps(a->d + at + 8), dw1);
            sc[i] = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(s0)), _mm256_castps_pd(s1), 1));
            if (q4_1)
                for (int h = 0; h < 16; h += 8)
                    off[i] = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + 2 * nb + 2 * (b0 + h)))),
                                             _mm256_loadu_ps(a->sum + at + h), off[i]);
        }
        if (q4_0 || q4_1) {
            __m512 run[MR8];
            for (int i = 0; i < ROWS; i++) run[i] = acc[i][0];
            row8_quads16(fmt, row, nb, K, a, m0, ROWS, b0, sc, run);
            for (int i = 0; i < ROWS; i++) acc[i][0] = run[i];
            continue;
        }
        /* Q8_0, blocks in pairs: |q| times qx with q's sign */
#pragma GCC unroll 8
        for (int t = 0; t < 8; t++) {
            const int64_t b = b0 + 2 * t;
            ai_prefetch_lines_l2(row + 34 * b, 68); /* a pair: 68 bytes of the row, two lines */
            const __m512i w = pair_q8_0(row, nb, b);
            const __m512i u = _mm512_abs_epi8(w);
            const __mmask64 neg = _mm512_movepi8_mask(w);
            const __m512i idx = pair_idx(2 * t, 2 * t + 1);
            for (int i = 0; i < ROWS; i++) {
                const __m512i x0 = load_x512(a, m0 + i, K, b);
                const __m512i x = _mm512_mask_sub_epi8(x0, neg, _mm512_setzero_si512(), x0);
                const __m512i s = ai_dpbusd512(_mm512_setzero_si512(), u, x);
                acc[i][t & 1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_permutexvar_ps(idx, sc[i]), acc[i][t & 1]);
            }
        }
    }
    float tail[MR8] = {0};
    if (n16 < nb) row8_blocks(fmt, row, K, a, m0, ROWS, tail, n16);
    for (int i = 0; i < ROWS; i++)
        out[i] = _mm512_reduce_add_ps(_mm512_add_ps(acc[i][0], acc[i][1])) + ai_hsum256(off[i]) + tail[i];
}
#endif /* AI_AVX512 */

static inline __attribute__((always_inline)) void row8_of(const int fmt, const uint8_t *row, int64_t K, const acts8 *a,
                                                          int64_t m0, const int ROWS, float *out) {
#ifdef AI_AVX512
    /* each reads the activations in the order quantize_rows8 put them in for its format (in_quads) */
    if (fmt == ASYNCINFER_FMT_Q4_K || fmt == ASYNCINFER_FMT_Q5_K) return row8_q45_k_256(fmt, row, K, a, m0, ROWS, out);
    if (fmt == ASYNCINFER_FMT_Q6_K) return row8_q6_k_256(row, K, a, m0, ROWS, out);
    if (fmt == ASYNCINFER_FMT_Q4_0 || fmt == ASYNCINFER_FMT_Q4_1 || fmt == ASYNCINFER_FMT_Q8_0)
        return row8_blocks_512(fmt, row, K, a, m0, ROWS, out);
    row8_blocks(fmt, row, K, a, m0, ROWS, out, 0); /* Q5_0, Q5_1: in order */
#else
    if (fmt == ASYNCINFER_FMT_Q4_K || fmt == ASYNCINFER_FMT_Q5_K) return row8_q45_k(fmt, row, K, a, m0, ROWS, out);
    if (fmt == ASYNCINFER_FMT_Q6_K) return row8_q6_k(row, K, a, m0, ROWS, out);
    row8_blocks(fmt, row, K, a, m0, ROWS, out, 0);
#endif
}

#define ROWS8_CALL(FMT, row, K, a, m0, R, out) row8_of(FMT, row, K, a, m0, R, out)
#else
#define ROWS8_CALL(FMT, row, K, a, m0, R, out)                                                   \
    do {                                                                                          \
        for (int i_ = 0; i_ < (R); i_++) (out)[i_] = row8_ref(FMT, row, K, a, (m0) + i_);          \
    } while (0)
#endif

/* Activation rows a pass over the weights takes (a multiple of MR8): as many as keep their int8 values, scales
 * and sums within PASS8_BYTES, which stay in a core's L2 cache while every weight row meets them; a batch of more
 * rows reads the weights again for each pass. */
#ifndef PASS8_BYTES
#define PASS8_BYTES (768 * 1024)
#endif
static inline int64_t pass8_rows(int64_t K) {
    const int64_t per_row = K + K / QK * 8 + K / 16 * 2, rows = PASS8_BYTES / (per_row > 0 ? per_row : 1) / MR8 * MR8;
    return rows < 4 * MR8 ? 4 * MR8 : rows;
}

#ifdef AI_AVX512
/* Q4_K / Q5_K: each super-block's 32-byte sub-blocks of activations in the order 0, 2, 1, 3, 4, 6, 5, 7, the order
 * row8_q45_k_256 reads them (the low nibbles of 64 bytes of quants: sub-blocks 4 q and 4 q + 2; the high ones: 4 q + 1
 * and 4 q + 3). */
static inline void k_pairs8_order(const acts8 *a, int64_t rows, int64_t K) {
    for (int64_t m = 0; m < rows; m++)
        for (int64_t k = 0; k < K; k += 128) {
            int8_t *p = a->q + m * K + k;
            const __m256i second = _mm256_loadu_si256((const __m256i *)(p + 32));
            _mm256_storeu_si256((__m256i *)(p + 32), _mm256_loadu_si256((const __m256i *)(p + 64)));
            _mm256_storeu_si256((__m256i *)(p + 64), second);
        }
}
#endif

/* Activation rows [m0, m1) of x rounded into a, each row by itself (the same values whatever the batch): per 256 or
 * per 32 as acts8_per_256 says; in_quads: in the order the AVX-512 rows read them (Q4_0 / Q4_1: quads8_order; Q4_K /
 * Q5_K: k_pairs8_order), else in order (the tile's, the lanes'). */
static inline __attribute__((always_inline)) void quantize_rows8(const int fmt, const int in_quads, const float *x,
                                                                 int64_t m0, int64_t m1, int64_t ldx, int64_t K,
                                                                 const acts8 *a) {
    const int64_t nb = K / QK;
    acts8 r = {a->q + m0 * K, a->d + m0 * nb, a->sum + m0 * nb, a->isum + m0 * (K / 16)};
#ifdef AI_AVX512
    if (acts8_per_256(fmt)) {
        quantize_acts8_256(x + m0 * ldx, m1 - m0, ldx, K, &r);
        if (in_quads && (fmt == ASYNCINFER_FMT_Q4_K || fmt == ASYNCINFER_FMT_Q5_K)) k_pairs8_order(&r, m1 - m0, K);
        return;
    }
    quantize_acts8(x + m0 * ldx, m1 - m0, ldx, K, &r);
    if (in_quads && (fmt == ASYNCINFER_FMT_Q4_0 || fmt == ASYNCINFER_FMT_Q4_1)) quads8_order(a, m0, m1, K);
#else
    (void)fmt;
    (void)in_quads;
    quantize_acts8(x + m0 * ldx, m1 - m0, ldx, K, &r);
#endif
}

/* Every batch through the rows: each activation row's result is the same whatever the other rows are (its sums
 * in one order, whatever ROWS), so a request's logits do not depend on its neighbours in a step. Batches of
 * several passes: the rows rounded in parallel, then each pass meets every weight row. */
#define GEMM8(NAME, FMT)                                                                          \
    static int NAME(const float *x, int64_t M, int64_t ldx, int64_t K, const void *w, int64_t N, const float *bias, \
                    float *y, int64_t ldy, int threads, void *scratch) {                          \
        const uint8_t *rows = (const uint8_t *)w;                                                 \
        const int64_t row_bytes = K / ai_fmt_weights(FMT) * ai_fmt_bytes(FMT), pass = pass8_rows(K); \
        acts8 a = acts8_in(scratch, M, K);                                                        \
        _Pragma("omp parallel num_threads(threads) if(threads > 1 && M >= PANEL_MIN_ROWS)")      \
        {                                                                                         \
            _Pragma("omp for schedule(static)")                                                   \
            for (int64_t m = 0; m < M; m += MR8) quantize_rows8(FMT, 1, x, m, M - m < MR8 ? M : m + MR8, ldx, K, &a); \
        }                                                                                         \
        _Pragma("omp parallel num_threads(threads) if(threads > 1)")                              \
        for (int64_t p0 = 0; p0 < M; p0 += pass) {                                                \
            const int64_t p1 = M - p0 < pass ? M : p0 + pass;                                     \
            _Pragma("omp for schedule(static)")                                                   \
            for (int64_t n = 0; n < N; n++) {                                                     \
                const uint8_t *row = rows + n * row_bytes;                                        \
                const float bn = bias ? bias[n] : 0.0f;                                           \
                for (int64_t m0 = p0; m0 < p1; m0 += MR8) {                                       \
                    const int rows_now = (int)(p1 - m0 < MR8 ? p1 - m0 : MR8);                    \
                    float out[MR8];                                                               \
                    switch (rows_now) {                                                           \
                        case 1: ROWS8_CALL(FMT, row, K, &a, m0, 1, out); break;                   \
                        case 2: ROWS8_CALL(FMT, row, K, &a, m0, 2, out); break;                   \
                        case 3: ROWS8_CALL(FMT, row, K, &a, m0, 3, out); break;                   \
                        default: ROWS8_CALL(FMT, row, K, &a, m0, 4, out); break;                  \
                    }                                                                             \
                    for (int i = 0; i < rows_now; i++) y[(m0 + i) * ldy + n] = out[i] + bn;       \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
        return 0;                                                                                 \
    }

GEMM8(ai_gemm8_q4_1, ASYNCINFER_FMT_Q4_1)
GEMM8(ai_gemm8_q8_0, ASYNCINFER_FMT_Q8_0)
GEMM8(ai_gemm8_q4_0, ASYNCINFER_FMT_Q4_0)
GEMM8(ai_gemm8_q5_0, ASYNCINFER_FMT_Q5_0)
GEMM8(ai_gemm8_q5_1, ASYNCINFER_FMT_Q5_1)
GEMM8(ai_gemm8_q4_k, ASYNCINFER_FMT_Q4_K)
GEMM8(ai_gemm8_q5_k, ASYNCINFER_FMT_Q5_K)
GEMM8(ai_gemm8_q6_k, ASYNCINFER_FMT_Q6_K)

gemm_fn ai_gemm8_of(int fmt) {
    static const gemm_fn table[ASYNCINFER_NUM_FMTS] = {ai_gemm8_q4_1, ai_gemm8_q8_0, ai_gemm8_q4_0, ai_gemm8_q5_0,
                                                       ai_gemm8_q5_1, ai_gemm8_q4_k, ai_gemm8_q5_k, ai_gemm8_q6_k};
    return fmt >= 0 && fmt < ASYNCINFER_NUM_FMTS ? table[fmt] : NULL;
}

/* Q4_0 and Q4_1 in lanes (ASYNCINFER_FMT_LANES16; their GEMM at the end of this file, the tile below reads them
 * too). A group's block: 16 float16 scales (Q4_1: then 16 float16 minimums), then 4 runs of 64 bytes of nibbles. */
#define LANE_ROWS 16
static inline int lane_head(int fmt) { return fmt == ASYNCINFER_FMT_Q4_1 ? 64 : 32; }
static inline int lane_block(int fmt) { return lane_head(fmt) + 256; }

#ifdef AI_AVX512
/* ---- The tile (AVX-512 builds; asyncinfer_gemm's ASYNCINFER_FMT_TILE8): the int8 GEMM at any number of rows, 16
 * activation rows to a register. The decoder layers' projections take it in prefills and mixed steps (kernels.gemm's
 * int8_kernel="tile") and in the kernels' one-call decode step (decoder.c) from ASYNCINFER_STEP_TILE_MIN_ROWS rows on
 * (step8, below), and so does the output projection there unless every layer is held in lanes (decoder.py); in prefills
 * and mixed steps it keeps the rows above (a row per sampled request). A pass of activation rows is rounded per row
 * (quantize_rows8, as the rows do: the k-quants with a scale per 256, acts8_per_256), then laid out
 * in groups of 16 rows: four consecutive int8 values of the 16 rows in one 512-bit register (lane r: row r's four),
 * beside each row's block scale dx, float32 block sum and integer sums of 16. A weight row is unpacked once per pass
 * into unsigned bytes u (q = u - centre), its float32 scale S and min of each block of 32 and (Q6_K) the int8 scale of
 * each 16 (Q4_K on the VNNI build: its scales only, the nibbles read in place, tile8_in_place); four consecutive bytes
 * broadcast to every lane make one vpdpbusd with the group's register: lane r adds row r's four products. So every lane
 * holds one (row, weight row) pair and a block's integer dot product needs no horizontal sum: per block of 32, for
 * every lane,
 *
 *   idot = sum(u * qx) - centre * sum(qx)        (Q6_K: sc0 * (its first 16's) + sc1 * (its second 16's))
 *   acc  = fma(float(idot), dx * S, acc);   acc = fma(min, sum(x), acc)   (the formats with a min)
 *
 * blocks in order from acc = 0 (the k-quants per super-block of 256: tile8_kernel), then + bias (Q8_0: u = q + 128,
 * centre 128, on the VNNI build; the AVX-512 BW build's multiply-add pair would saturate there, so it takes |q| times
 * qx with q's sign, centre 0: the same integer). The same float32 operations for a row whatever its lane, its group or
 * the batch, so a row's result does not depend on the other rows (the rows' property, in another order of additions
 * than theirs). Eight vpdpbusd per block and row group a weight row, against the rows' one vpdpbusd, convert and fma
 * per 32 (two sub-blocks a 512-bit register): far fewer instructions per product where many rows meet a weight row; but
 * 16 rows' work at any count (a fifth of the rows' speed at one row). */
#define T8_COLS 4   /* weight rows a micro-kernel call takes */
#define T8_GROUPS 2 /* groups of 16 activation rows a micro-kernel call takes */

static inline int tile8_centre(int fmt) {
    switch (fmt) {
        case ASYNCINFER_FMT_Q4_0: return 8;
        case ASYNCINFER_FMT_Q5_0: return 16;
        case ASYNCINFER_FMT_Q6_K: return 32;
#ifdef AI_VNNI
        case ASYNCINFER_FMT_Q8_0: return 128;
#endif
        default: return 0;
    }
}

/* The rows a tile's next micro-kernel call takes (n of them from row, bytes apart; n = 0: none), fetched from
 * memory during this call. */
typedef struct {
    const uint8_t *row;
    int64_t bytes;
    int n;
} tile_next;

/* The weight rows from after on that a call taking up to cols of them would take (none past N). */
static inline tile_next tile_next_rows(const uint8_t *w, int64_t row_bytes, int64_t N, int64_t after, int cols) {
    const tile_next next = {after < N ? w + after * row_bytes : w, row_bytes,
                            after >= N ? 0 : (int)(N - after < cols ? N - after : cols)};
    return next;
}

/* Block b (of nb) of a call: a block's share of next's rows' bytes (under a cache line for every format) fetched
 * while the call's own rows compute. A weight row comes from memory once a pass, and without this the tiles waited on
 * it (docs/formats.md, "The tiles fetch the next weight rows ahead"). */
static inline __attribute__((always_inline)) void tile_fetch(const tile_next *next, int64_t b, int64_t nb) {
    for (int c = 0; c < next->n; c++)
        _mm_prefetch((const char *)next->row + c * next->bytes + b * next->bytes / nb, _MM_HINT_T0);
}

/* A weight row unpacked: u [K] unsigned quants in order, s and mn [K / 32] (mn: the formats with a min), sc
 * [K / 16] int32 (Q6_K's int8 scales); raw: the row's own bytes (tile8_in_place's formats read them, u unused). */
typedef struct {
    uint8_t *u;
    float *s;
    float *mn;
    int32_t *sc;
    const uint8_t *raw; /* the row's own bytes, where the tile reads the quants in place (tile8_in_place) */
} wrow8;

static inline int64_t tile8_wrow_bytes(int64_t K) { return K + K / QK * 8 + K / 16 * 4; }

static inline wrow8 tile8_wrow_in(void *at, int64_t K) {
    wrow8 r;
    r.u = (uint8_t *)at;
    r.s = (float *)(r.u + K); /* K is a multiple of 32: aligned to 4 */
    r.mn = r.s + K / QK;
    r.sc = (int32_t *)(r.mn + K / QK);
    r.raw = NULL;
    return r;
}

/* Whether the int8 tile reads a format's quants from the weight row in place rather than unpacked: Q4_K on the VNNI
 * build (at 32 rows, a step of decodes, the 1B shape's four Q4_K GEMMs ran 5% faster so on a Zen 4 core pair, the same
 * bits; at 256 rows level). Its bytes hold two sub-blocks' nibbles at the same positions, so four bytes broadcast and
 * masked make a word of either: 0x0F, the low nibbles' sub-block (even); 0xF0, the high nibbles' (odd) times 16, whose
 * scale the unpacking stores a 16th of. Both exact (a power of two; 16 times a sub-block's integer dot product stays
 * below 2^24), so fma(float(16 idot), scale / 16, a) is fma(float(idot), scale, a) to the bit (tile8_kernel's
 * super-block sum) unless scale / 16 falls below float32's normal range: the same results as the unpacked rows. The
 * AVX-512 BW build's multiply-add pair would saturate at 16 times the quants (its int16 pairs), so it unpacks. */
static inline int tile8_in_place(int fmt) {
#ifdef AI_VNNI
    return fmt == ASYNCINFER_FMT_Q4_K;
#else
    (void)fmt;
    return 0;
#endif
}

/* A weight row unpacked into r; quants = 0 (a format tile8_in_place reads in place): its scales and minimums only. */
static inline __attribute__((always_inline)) void tile8_unpack(const int fmt, const uint8_t *row, int64_t K,
                                                               const wrow8 *r, const int quants) {
    const int64_t nb = K / QK;
    if (fmt == ASYNCINFER_FMT_Q4_K || fmt == ASYNCINFER_FMT_Q5_K) {
        const int five = fmt == ASYNCINFER_FMT_Q5_K;
        const __m256i low4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
        for (int64_t blk = 0; blk < K / 256; blk++) {
            const uint8_t *p = row + blk * ai_fmt_bytes(fmt);
            uint64_t sc, m; /* ai_block_scales' values, 8 at a time: d * scale, -(dmin * min) as (-dmin) * min */
            ai_k_scales8(p + 4, &sc, &m);
            const __m256 scf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)sc)));
            const __m256 mf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)m)));
            const __m256 sv = _mm256_mul_ps(_mm256_set1_ps(ai_half_at(p)), scf);
            /* in place: the high nibbles' sub-blocks (odd) multiply 16 times their quants, their scale a 16th */
            const __m256 sixteenth = _mm256_setr_ps(1.0f, 0.0625f, 1.0f, 0.0625f, 1.0f, 0.0625f, 1.0f, 0.0625f);
            _mm256_storeu_ps(r->s + 8 * blk, quants ? sv : _mm256_mul_ps(sv, sixteenth));
            _mm256_storeu_ps(r->mn + 8 * blk, _mm256_mul_ps(_mm256_set1_ps(-ai_half_at(p + 2)), mf));
            if (!quants) continue;
            const uint8_t *qs = p + (five ? 48 : 16);
            const __m256i h = five ? _mm256_loadu_si256((const __m256i *)(p + 16)) : _mm256_setzero_si256();
            for (int pr = 0; pr < 4; pr++) {
                const __m256i x = _mm256_loadu_si256((const __m256i *)(qs + 32 * pr));
                __m256i u0 = _mm256_and_si256(x, low4), u1 = _mm256_and_si256(_mm256_srli_epi16(x, 4), low4);
                if (five) {
                    u0 = _mm256_or_si256(u0, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2 * pr), one), 4));
                    u1 = _mm256_or_si256(u1, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2 * pr + 1), one), 4));
                }
                _mm256_storeu_si256((__m256i *)(r->u + 256 * blk + 64 * pr), u0);
                _mm256_storeu_si256((__m256i *)(r->u + 256 * blk + 64 * pr + 32), u1);
            }
        }
        return;
    }
    if (fmt == ASYNCINFER_FMT_Q6_K) {
        const __m256i low4 = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(0x30);
        for (int64_t blk = 0; blk < K / 256; blk++) {
            const uint8_t *p = row + blk * 210;
            _mm256_storeu_ps(r->s + 8 * blk, _mm256_set1_ps(ai_half_at(p + 208)));
            for (int h = 0; h < 2; h++) /* the 16 int8 scales widened, 8 at a time */
                _mm256_storeu_si256((__m256i *)(r->sc + 16 * blk + 8 * h),
                                    _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 192 + 8 * h))));
            for (int n = 0; n < 2; n++) {
                const __m256i L[2] = {_mm256_loadu_si256((const __m256i *)(p + 64 * n)),
                                      _mm256_loadu_si256((const __m256i *)(p + 64 * n + 32))};
                const __m256i H = _mm256_loadu_si256((const __m256i *)(p + 128 + 32 * n));
                for (int k = 0; k < 4; k++) {
                    const __m256i lo = _mm256_and_si256(k < 2 ? L[k & 1] : _mm256_srli_epi16(L[k & 1], 4), low4);
                    const __m256i hi = _mm256_and_si256(k < 2 ? _mm256_slli_epi16(H, 4 - 2 * k)
                                                              : k == 2 ? H : _mm256_srli_epi16(H, 2), two);
                    _mm256_storeu_si256((__m256i *)(r->u + 256 * blk + 32 * (4 * n + k)), _mm256_or_si256(lo, hi));
                }
            }
        }
        return;
    }
    for (int64_t b = 0; b < nb; b++) {
        __m256i u = block_u8(fmt, row, nb, b);
#ifdef AI_VNNI
        if (fmt == ASYNCINFER_FMT_Q8_0) u = _mm256_xor_si256(u, _mm256_set1_epi8((char)0x80)); /* q + 128 */
#endif
        _mm256_storeu_si256((__m256i *)(r->u + 32 * b), u);
        r->s[b] = ai_half_to_float(block_d16(fmt, row, nb, b));
        if (has_min8(fmt)) r->mn[b] = block_min(fmt, row, nb, b);
    }
}

/* Group grp of Q4_0 / Q4_1 in lanes unpacked whole, for tile8_kernel's grouped rows: word t of block b of all 16
 * rows in one register's lanes (t < 4: run t's low nibbles, else run t - 4's high ones), at u + (8 b + t) * 64; the
 * 16 scales (and minimums) of block b at s + 16 b (mn + 16 b): for each row the values tile8_unpack gives the same
 * row in ggml's blocks, so the same results. */
static inline int64_t tile8_group_lanes_bytes(int64_t K) { return K / QK * (8 * 64 + 2 * 16 * 4); }
static inline __attribute__((always_inline)) void tile8_unpack_group(const int fmt, const uint8_t *w, int64_t grp,
                                                                     int64_t K, uint8_t *u, float *s, float *mn) {
    const int64_t nb = K / QK;
    const int head = lane_head(fmt), size = lane_block(fmt);
    const uint8_t *g = w + grp * nb * size;
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = g + b * size;
        for (int c = 0; c < 4; c++) {
            const __m512i run = _mm512_loadu_si512(blk + head + 64 * c);
            _mm512_storeu_si512(u + (8 * b + c) * 64, _mm512_and_si512(run, low4));
            _mm512_storeu_si512(u + (8 * b + 4 + c) * 64, _mm512_and_si512(_mm512_srli_epi16(run, 4), low4));
        }
        for (int h = 0; h < 2; h++) {
            _mm256_storeu_ps(s + 16 * b + 8 * h, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16 * h))));
            if (fmt == ASYNCINFER_FMT_Q4_1)
                _mm256_storeu_ps(mn + 16 * b + 8 * h,
                                 _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 32 + 16 * h))));
        }
    }
}

/* A pass's activation rows in groups of 16 (rows past the batch zeros): q [K / 4] registers of the 16 rows' four
 * int8 values, d and sum [K / 32][16] float32, csum [K / 32][16] and isum [K / 16][16] int32 (centre * the
 * block's sum of qx; the sum of each 16). */
typedef struct {
    int32_t *q;
    float *d;
    float *sum;
    int32_t *csum;
    int32_t *isum;
} group8;

static inline int64_t tile8_group_bytes(int64_t K) { return 16 * (K + K / QK * 12 + K / 16 * 4); }

static inline group8 tile8_group_in(void *at, int64_t K) {
    group8 g;
    g.q = (int32_t *)at;
    g.d = (float *)(g.q + 4 * K); /* 16 rows * K / 4 words */
    g.sum = g.d + 16 * (K / QK);
    g.csum = (int32_t *)(g.sum + 16 * (K / QK));
    g.isum = g.csum + 16 * (K / QK);
    return g;
}

static void tile8_group(const acts8 *a, int64_t m0, int64_t m1, int64_t K, int centre, const group8 *g) {
    const int64_t nb = K / QK;
    for (int r = 0; r < 16; r++) {
        const int64_t m = m0 + r;
        const int live = m < m1;
        const int32_t *q = (const int32_t *)(a->q + m * K);
        for (int64_t t = 0; t < K / 4; t++) {
            int32_t v = 0;
            if (live) memcpy(&v, q + t, 4);
            g->q[t * 16 + r] = v;
        }
        for (int64_t b = 0; b < nb; b++) {
            const int s0 = live ? a->isum[m * 2 * nb + 2 * b] : 0, s1 = live ? a->isum[m * 2 * nb + 2 * b + 1] : 0;
            g->d[b * 16 + r] = live ? a->d[m * nb + b] : 0.0f;
            g->sum[b * 16 + r] = live ? a->sum[m * nb + b] : 0.0f;
            g->csum[b * 16 + r] = centre * (s0 + s1);
            g->isum[2 * b * 16 + r] = s0;
            g->isum[(2 * b + 1) * 16 + r] = s1;
        }
    }
}

/* Block b's integer dot products (tile8_kernel's idot) of groups [0, G) with weight rows [0, C), into idot: set, or
 * with add (Q6_K's sums of a super-block) added to what idot holds. */
static inline __attribute__((always_inline)) void tile8_idot(const int fmt, const int G, const int C, const group8 *gs,
                                                             const wrow8 *w, int64_t b, const int grouped,
                                                             __m512i idot[T8_GROUPS][T8_COLS], const int add) {
    const int64_t ub = grouped ? 8 * 64 : 32, ut = grouped ? 64 : 4;
    const int q6 = fmt == ASYNCINFER_FMT_Q6_K, centre = tile8_centre(fmt);
    for (int half = 0; half < (q6 ? 2 : 1); half++) {
        __m512i acc[T8_GROUPS][T8_COLS];
        for (int g = 0; g < G; g++)
            for (int c = 0; c < C; c++) acc[g][c] = _mm512_setzero_si512();
        const int t0 = q6 ? 4 * half : 0, t1 = q6 ? t0 + 4 : 8;
        const __m512i nib = _mm512_set1_epi8(b % 2 ? (char)0xF0 : 0x0F);
        for (int t = t0; t < t1; t++) {
            __m512i xv[T8_GROUPS];
            for (int g = 0; g < G; g++) xv[g] = _mm512_loadu_si512(gs[g].q + (8 * b + t) * 16);
            for (int c = 0; c < C; c++) {
                int32_t word;
                __m512i wv;
                if (tile8_in_place(fmt) && !grouped) {
                    /* Q4_K's 144-byte blocks (d, dmin, 12 bytes of scales, 128 of nibbles): sub-block b % 8 =
                     * 2 p + h in nibble h of the 32 bytes from 16 + 32 p */
                    memcpy(&word, w[c].raw + 144 * (b / 8) + 16 + 32 * (b % 8 / 2) + 4 * t, 4);
                    wv = _mm512_and_si512(_mm512_set1_epi32(word), nib);
                } else {
                    memcpy(&word, w[c].u + ub * b + ut * t, 4);
                    wv = _mm512_set1_epi32(word);
                }
#ifndef AI_VNNI
                if (fmt == ASYNCINFER_FMT_Q8_0) { /* |q| times qx with q's sign: maddubs' pairs within int16 */
                    const __mmask64 neg = _mm512_movepi8_mask(wv);
                    const __m512i u = _mm512_abs_epi8(wv);
                    for (int g = 0; g < G; g++)
                        acc[g][c] = ai_dpbusd512(acc[g][c], u, _mm512_mask_sub_epi8(xv[g], neg, _mm512_setzero_si512(), xv[g]));
                    continue;
                }
#endif
                for (int g = 0; g < G; g++) acc[g][c] = ai_dpbusd512(acc[g][c], wv, xv[g]);
            }
        }
        for (int g = 0; g < G; g++) {
            if (q6) {
                const __m512i is = _mm512_slli_epi32(_mm512_loadu_si512(gs[g].isum + (2 * b + half) * 16), 5);
                for (int c = 0; c < C; c++) {
                    const __m512i v = _mm512_mullo_epi32(_mm512_sub_epi32(acc[g][c], is),
                                                         _mm512_set1_epi32(w[c].sc[2 * b + half]));
                    idot[g][c] = half || add ? _mm512_add_epi32(idot[g][c], v) : v;
                }
            } else {
                const __m512i cs = centre ? _mm512_loadu_si512(gs[g].csum + b * 16) : _mm512_setzero_si512();
                for (int c = 0; c < C; c++) idot[g][c] = centre ? _mm512_sub_epi32(acc[g][c], cs) : acc[g][c];
            }
        }
    }
}

/* Groups [0, G) of gs against weight rows [0, C) of w: out[g][c] the 16 lanes' sums. grouped: w's rows are rows of a
 * group of 16 unpacked whole (tile8_unpack_group: word t of block b at u[(8 b + t) * 64], s and mn at [16 b]), else
 * rows unpacked one by one (tile8_unpack: u[32 b + 4 t], s and mn at [b]; tile8_in_place's formats: the words from
 * raw, s and mn at [b]). next: the rows the following call takes, fetched from memory during this one. The k-quants
 * (acts8_per_256; dx the same for a super-block's eight blocks) per super-block, per lane:
 *
 *   Q4_K, Q5_K:  a = sum over its blocks of fma(float(idot), S, a) from a = 0;  acc = fma(a, dx, acc)
 *                (and for each block, in order, acc = fma(min, sum(x), acc) before that)
 *   Q6_K:        acc = fma(float(the integer sum of its blocks' idot), dx * d, acc)
 *
 * super-blocks in order from acc = 0 (a block's S times 16 times a 16th where Q4_K's quants are read in place: the
 * same products). */
static inline __attribute__((always_inline)) void tile8_kernel(const int fmt, const int G, const int C,
                                                               const group8 *gs, const wrow8 *w, int64_t K,
                                                               __m512 out[T8_GROUPS][T8_COLS], const int grouped,
                                                               const tile_next *next) {
    const int64_t nb = K / QK, sb = grouped ? 16 : 1;
    const int min = has_min8(fmt);
    __m512 f[T8_GROUPS][T8_COLS];
    for (int g = 0; g < G; g++)
        for (int c = 0; c < C; c++) f[g][c] = _mm512_setzero_ps();
    if (acts8_per_256(fmt) && !grouped) {
        const int q6 = fmt == ASYNCINFER_FMT_Q6_K;
        for (int64_t s = 0; s < nb / 8; s++) {
            __m512 a[T8_GROUPS][T8_COLS];   /* Q4_K, Q5_K */
            __m512i is[T8_GROUPS][T8_COLS]; /* Q6_K */
            for (int g = 0; g < G; g++)
                for (int c = 0; c < C; c++) {
                    a[g][c] = _mm512_setzero_ps();
                    is[g][c] = _mm512_setzero_si512();
                }
            for (int j = 0; j < 8; j++) {
                const int64_t b = 8 * s + j;
                tile_fetch(next, b, nb);
                if (q6) {
                    tile8_idot(fmt, G, C, gs, w, b, 0, is, 1);
                    continue;
                }
                __m512i idot[T8_GROUPS][T8_COLS];
                tile8_idot(fmt, G, C, gs, w, b, 0, idot, 0);
                for (int g = 0; g < G; g++) {
                    const __m512 xs = _mm512_loadu_ps(gs[g].sum + b * 16);
                    for (int c = 0; c < C; c++) {
                        a[g][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(idot[g][c]), _mm512_set1_ps(w[c].s[b]), a[g][c]);
                        f[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(w[c].mn[b]), xs, f[g][c]);
                    }
                }
            }
            for (int g = 0; g < G; g++) {
                const __m512 dx = _mm512_loadu_ps(gs[g].d + 8 * s * 16);
                for (int c = 0; c < C; c++)
                    f[g][c] = q6 ? _mm512_fmadd_ps(_mm512_cvtepi32_ps(is[g][c]),
                                                   _mm512_mul_ps(dx, _mm512_set1_ps(w[c].s[8 * s])), f[g][c])
                                 : _mm512_fmadd_ps(a[g][c], dx, f[g][c]);
            }
        }
    } else {
        for (int64_t b = 0; b < nb; b++) {
            tile_fetch(next, b, nb);
            __m512i idot[T8_GROUPS][T8_COLS];
            tile8_idot(fmt, G, C, gs, w, b, grouped, idot, 0);
            for (int g = 0; g < G; g++) {
                const __m512 dx = _mm512_loadu_ps(gs[g].d + b * 16);
                const __m512 xs = min ? _mm512_loadu_ps(gs[g].sum + b * 16) : _mm512_setzero_ps();
                for (int c = 0; c < C; c++) {
                    f[g][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(idot[g][c]),
                                              _mm512_mul_ps(dx, _mm512_set1_ps(w[c].s[sb * b])), f[g][c]);
                    if (min) f[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(w[c].mn[sb * b]), xs, f[g][c]);
                }
            }
        }
    }
    for (int g = 0; g < G; g++)
        for (int c = 0; c < C; c++) out[g][c] = f[g][c];
}

/* Every weight row of the tile at once (a tile of fewer, the last of a call, computes the others on stale rows and
 * drops them): two micro-kernels a format, one or two groups, where each (G, C) of its own would multiply the
 * compile time of the SIMDe-emulated builds. */
static inline __attribute__((always_inline)) void tile8_call(const int fmt, int G, const group8 *gs,
                                                             const wrow8 *w, int64_t K, __m512 out[T8_GROUPS][T8_COLS],
                                                             const int grouped, const tile_next *next) {
    if (G == 2) return tile8_kernel(fmt, 2, T8_COLS, gs, w, K, out, grouped, next);
    tile8_kernel(fmt, 1, T8_COLS, gs, w, K, out, grouped, next);
}

/* Activation rows a pass takes (a multiple of 16 * T8_GROUPS): their int8 values and groups within T8_PASS_BYTES. Eight
 * times the rows' budget, past a core's L2 cache: each pass reads every weight row again (and unpacks it, or for Q4_K
 * on the VNNI build its scales), and the groups stream from L3 as fast as the micro-kernel takes them (two 64-byte
 * loads per eight vpdpbusd). On a Zen 4 core pair (1 MiB of L2 each) 6 MiB passes ran the 1B shape's down projection (K
 * = 8192) at 250 rows 5% (Q4_K) and 8% (Q6_K) faster than 1.5 MiB ones, the same bits (its 64-row passes unpacked every
 * weight row four times), and 24 MiB ones (1,024 rows of K = 8192 in one pass) 3% slower than 6.5 MiB ones (there the
 * same 256 rows as 6 MiB; ad hoc, two builds in one process); on a Zen 5 core 1.5 MiB passes ran the GEMMs at 64-256
 * rows a few percent faster than 768 KiB ones. */
#ifndef T8_PASS_BYTES
#define T8_PASS_BYTES (8 * PASS8_BYTES)
#endif
static inline int64_t tile8_pass_rows(int64_t K) {
    const int64_t per = tile8_group_bytes(K) / 16 + K + K / QK * 8 + K / 16 * 2,
                  rows = T8_PASS_BYTES / (per > 0 ? per : 1) / (16 * T8_GROUPS) * (16 * T8_GROUPS);
    return rows < 16 * T8_GROUPS ? 16 * T8_GROUPS : rows;
}

/* A thread's call takes a span of weight rows (a few micro-kernel calls' worth), keeps each group's sums in its own
 * buffer (TILE_SPAN_COLS columns of 16 lanes a group), and stores them once the span is done: 16 columns turned into
 * 16 rows in registers (transpose16), each output row's 16 values one vector store, where a column's 16 lanes went to
 * 16 rows a float at a time before ac05d46. */
#define TILE_SPAN_COLS 32
static inline int64_t tile_span_bytes(int64_t groups) { return groups * TILE_SPAN_COLS * 16 * (int64_t)sizeof(float); }

/* r[c] lane i to r[i] lane c, for 16 vectors of 16 floats: within 128-bit lanes by pairs, then quads, then the
 * 128-bit lanes across registers. */
static inline __attribute__((always_inline)) void transpose16(__m512 r[16]) {
    __m512 t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 2]);
        const __m512d c = _mm512_castps_pd(t[4 * i + 1]), d = _mm512_castps_pd(t[4 * i + 3]);
        u[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));     /* element 0 of each 128-bit lane's 4 */
        u[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)); /* element 1 */
        u[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d)); /* element 2 */
        u[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d)); /* element 3 */
    }
    /* 128-bit lanes: (a.0, a.2, b.0, b.2) and (a.1, a.3, b.1, b.3), as vshuff32x4 with 0x88 and 0xDD (written as
     * two-source permutes, which the SIMDe-emulated builds have) */
    const __m512i even = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
    const __m512i odd = _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int e = 0; e < 4; e++) { /* u[4i + e] lane L: r[4i..4i+3] element 4L + e, to r[4L + e] */
        const __m512 v0 = _mm512_permutex2var_ps(u[e], even, u[4 + e]), v1 = _mm512_permutex2var_ps(u[e], odd, u[4 + e]);
        const __m512 w0 = _mm512_permutex2var_ps(u[8 + e], even, u[12 + e]),
                     w1 = _mm512_permutex2var_ps(u[8 + e], odd, u[12 + e]);
        r[e] = _mm512_permutex2var_ps(v0, even, w0);
        r[8 + e] = _mm512_permutex2var_ps(v0, odd, w0);
        r[4 + e] = _mm512_permutex2var_ps(v1, even, w1);
        r[12 + e] = _mm512_permutex2var_ps(v1, odd, w1);
    }
}

/* A span's sums for the 16 rows of a group from row r0 (those below p1) and weight rows [n0, n0 + C), lane r of
 * ob[16 c ...] to y[r0 + r, n0 + c], plus the bias (+ 0 without one, as the rows add). */
static inline void span_store_group(const float *ob, int C, int64_t r0, int64_t p1, int64_t n0, const float *bias,
                                    float *y, int64_t ldy) {
    const int64_t live = p1 - r0 < 16 ? p1 - r0 : 16;
    for (int c0 = 0; c0 < C; c0 += 16) {
        const int n = C - c0 < 16 ? C - c0 : 16;
        __m512 r[16];
        for (int c = 0; c < 16; c++) r[c] = _mm512_loadu_ps(ob + 16 * (c0 + c));
        transpose16(r);
        float part[16] = {0}; /* a span's last columns, fewer than 16, through the stack */
        if (bias && n < 16) memcpy(part, bias + n0 + c0, (size_t)n * sizeof(float));
        const __m512 b = !bias ? _mm512_setzero_ps() : n < 16 ? _mm512_loadu_ps(part) : _mm512_loadu_ps(bias + n0 + c0);
        for (int64_t i = 0; i < live; i++) {
            float *to = y + (r0 + i) * ldy + n0 + c0;
            if (n == 16) {
                _mm512_storeu_ps(to, _mm512_add_ps(r[i], b));
            } else {
                _mm512_storeu_ps(part, _mm512_add_ps(r[i], b));
                memcpy(to, part, (size_t)n * sizeof(float));
            }
        }
    }
}

/* Every group's span sums (the ng groups of the pass from row p0, those below p1) to y. */
static inline void span_store(const float *ob, int64_t ng, int C, int64_t p0, int64_t p1, int64_t n0, const float *bias,
                              float *y, int64_t ldy) {
    for (int64_t gi = 0; gi < ng; gi++)
        span_store_group(ob + gi * TILE_SPAN_COLS * 16, C, p0 + 16 * gi, p1, n0, bias, y, ldy);
}

/* A micro-kernel call's sums (weight rows [s, s + C) of the span, groups [gi, gi + G)) into the span's buffer. */
static inline __attribute__((always_inline)) void span_keep(float *ob, int64_t gi, int G, int s, int C,
                                                            const __m512 *out, int stride) {
    for (int g = 0; g < G; g++)
        for (int c = 0; c < C; c++) _mm512_storeu_ps(ob + ((gi + g) * TILE_SPAN_COLS + s + c) * 16, out[g * stride + c]);
}

/* What a thread's run of weight rows needs (tile8_cols): the pass's groups, its own unpacked rows, the output. */
typedef struct {
    int fmt, lanes; /* lanes: Q4_0 / Q4_1 in lanes (w its groups), else the format's rows */
    const uint8_t *w;
    int64_t row_bytes, K, ng, p0, p1, gbytes, ldy, N;
    char *gmem;
    const wrow8 *wr;
    const float *bias;
    float *y;
    float *ob;     /* the thread's span buffer (tile_span_bytes) */
    uint8_t *gu;   /* lanes: the thread's group unpacked whole (tile8_group_lanes_bytes) */
} tile8_job;

/* Weight rows [s, s + C) of the span, unpacked in w (grouped: tile8_kernel's), against every pair of groups of the
 * pass, into the span's buffer; the first pair's call fetches next's rows ahead. */
static inline __attribute__((always_inline)) void tile8_groups(const int fmt, const tile8_job *j, const wrow8 *w, int s,
                                                               int C, const int grouped, const tile_next *next) {
    group8 gs[T8_GROUPS];
    const tile_next none = {NULL, 0, 0};
    for (int64_t gi = 0; gi < j->ng; gi += T8_GROUPS) {
        const int G = (int)(j->ng - gi < T8_GROUPS ? j->ng - gi : T8_GROUPS);
        for (int g = 0; g < G; g++) gs[g] = tile8_group_in(j->gmem + (gi + g) * j->gbytes, j->K);
        __m512 out[T8_GROUPS][T8_COLS];
        tile8_call(fmt, G, gs, w, j->K, out, grouped, gi == 0 ? next : &none);
        span_keep(j->ob, gi, G, s, C, &out[0][0], T8_COLS);
    }
}

#define T8_SPAN (4 * T8_COLS) /* weight rows a call takes (at most TILE_SPAN_COLS; a group in lanes exactly) */
_Static_assert(T8_SPAN == LANE_ROWS && T8_SPAN <= TILE_SPAN_COLS, "a span of the int8 tile is a group in lanes");

/* Weight rows [n0, n0 + C) (C <= T8_SPAN) against every group of the pass: T8_COLS at a time unpacked once (a format
 * in lanes: the span's group of 16 unpacked whole), then each pair of groups; the span's sums stored at the end. */
static inline __attribute__((always_inline)) void tile8_cols(const int fmt, const tile8_job *j, int64_t n0, int C) {
    const int64_t K = j->K;
    /* in lanes a span is a group of 16 rows (n0 a multiple of 16, N too): unpacked whole, read in place */
    const int grouped = (fmt == ASYNCINFER_FMT_Q4_0 || fmt == ASYNCINFER_FMT_Q4_1) && j->lanes;
    uint8_t *u = j->gu;
    float *sc = (float *)(u + K / QK * 8 * 64), *mn = sc + K / QK * 16;
    if (grouped) tile8_unpack_group(fmt, j->w, n0 / LANE_ROWS, K, u, sc, mn);
    for (int s = 0; s < C; s += T8_COLS) {
        if (grouped) {
            wrow8 wr[T8_COLS];
            for (int c = 0; c < T8_COLS; c++) wr[c] = (wrow8){u + 4 * (s + c), sc + s + c, mn + s + c, NULL, NULL};
            /* the next group's bytes, a quarter a call (two eighths: under a line a block each) */
            const int64_t gb = K / QK * lane_block(fmt), after = n0 + LANE_ROWS;
            const tile_next next = {after < j->N ? j->w + after / LANE_ROWS * gb + 2 * (s / T8_COLS) * (gb / 8) : j->w,
                                    gb / 8, after < j->N ? 2 : 0};
            tile8_groups(fmt, j, wr, s, T8_COLS, 1, &next);
        } else {
            const int cs = C - s < T8_COLS ? C - s : T8_COLS;
            wrow8 wr[T8_COLS];
            for (int c = 0; c < T8_COLS; c++) {
                wr[c] = j->wr[c]; /* past cs: a short tile's stale rows, the raw bytes its first row's */
                wr[c].raw = j->w + (n0 + s + (c < cs ? c : 0)) * j->row_bytes;
                if (c < cs) tile8_unpack(fmt, wr[c].raw, K, &wr[c], !tile8_in_place(fmt));
            }
            const tile_next next = tile_next_rows(j->w, j->row_bytes, j->N, n0 + s + T8_COLS, T8_COLS);
            tile8_groups(fmt, j, wr, s, cs, 0, &next);
        }
    }
    span_store(j->ob, j->ng, C, j->p0, j->p1, n0, j->bias, j->y, j->ldy);
}

/* PREFIX_cols_of(fmt): PREFIX_cols (tile8_cols / tile16_cols) with the format a constant, a function each: the
 * OpenMP region that calls it is compiled once for every format, so the format must be fixed below it, not above.
 * The SIMDe-emulated builds (tests) take one instance, the format read at run time from the job (eight cost minutes
 * to compile there). */
#ifndef ASYNCINFER_EMULATE_AVX512
#define TILE_COLS_ONE(PREFIX, JOB, SUFFIX, FMT) \
    static void PREFIX##_cols_##SUFFIX(const JOB *j, int64_t n0, int C) { PREFIX##_cols(FMT, j, n0, C); }
#define TILE_COLS_OF(PREFIX, JOB)                                                                 \
    typedef void (*PREFIX##_cols_fn)(const JOB *, int64_t, int);                                  \
    TILE_COLS_ONE(PREFIX, JOB, q4_1, ASYNCINFER_FMT_Q4_1)                                         \
    TILE_COLS_ONE(PREFIX, JOB, q8_0, ASYNCINFER_FMT_Q8_0)                                         \
    TILE_COLS_ONE(PREFIX, JOB, q4_0, ASYNCINFER_FMT_Q4_0)                                         \
    TILE_COLS_ONE(PREFIX, JOB, q5_0, ASYNCINFER_FMT_Q5_0)                                         \
    TILE_COLS_ONE(PREFIX, JOB, q5_1, ASYNCINFER_FMT_Q5_1)                                         \
    TILE_COLS_ONE(PREFIX, JOB, q4_k, ASYNCINFER_FMT_Q4_K)                                         \
    TILE_COLS_ONE(PREFIX, JOB, q5_k, ASYNCINFER_FMT_Q5_K)                                         \
    TILE_COLS_ONE(PREFIX, JOB, q6_k, ASYNCINFER_FMT_Q6_K)                                         \
    static PREFIX##_cols_fn PREFIX##_cols_of(int fmt) {                                           \
        static const PREFIX##_cols_fn table[ASYNCINFER_NUM_FMTS] = {                              \
            PREFIX##_cols_q4_1, PREFIX##_cols_q8_0, PREFIX##_cols_q4_0, PREFIX##_cols_q5_0,       \
            PREFIX##_cols_q5_1, PREFIX##_cols_q4_k, PREFIX##_cols_q5_k, PREFIX##_cols_q6_k};      \
        return table[fmt];                                                                        \
    }
#else
#define TILE_COLS_OF(PREFIX, JOB)                                                                 \
    typedef void (*PREFIX##_cols_fn)(const JOB *, int64_t, int);                                  \
    static void PREFIX##_cols_any(const JOB *j, int64_t n0, int C) { PREFIX##_cols(j->fmt, j, n0, C); } \
    static PREFIX##_cols_fn PREFIX##_cols_of(int fmt) {                                           \
        (void)fmt;                                                                                \
        return PREFIX##_cols_any;                                                                 \
    }
#endif

TILE_COLS_OF(tile8, tile8_job)

static int tile8_gemm(const int fmt, const float *x, int64_t M, int64_t ldx, int64_t K, const uint8_t *w, int64_t N,
                      const float *bias, float *y, int64_t ldy, int threads, int lanes) {
    if (K < 0 || K % ai_fmt_weights(fmt)) return ASYNCINFER_EINVAL; /* whole blocks only: the rows are read in place */
    const tile8_cols_fn cols = tile8_cols_of(fmt);
    const int64_t row_bytes = K / ai_fmt_weights(fmt) * ai_fmt_bytes(fmt), pass = tile8_pass_rows(K);
    const int64_t groups = (M < pass ? (M + 15) / 16 : pass / 16);
    const int64_t rows = M < pass ? M : pass, acts = rows * (K + K / QK * 8 + K / 16 * 2), gbytes = tile8_group_bytes(K),
                  wbytes = (tile_span_bytes(groups) + T8_COLS * tile8_wrow_bytes(K) + 63) / 64 * 64,
                  lbytes = lanes ? (tile8_group_lanes_bytes(K) + 63) / 64 * 64 : 0;
    const int nt = threads > 1 ? threads : 1;
    char *mem = (char *)malloc((size_t)(acts + groups * gbytes + nt * (wbytes + lbytes) + 64));
    if (!mem) return ASYNCINFER_ENOMEM;
    char *gmem = mem + (acts + 63) / 64 * 64, *wmem = gmem + groups * gbytes, *lmem = wmem + nt * wbytes;
    memset(wmem, 0, (size_t)(nt * wbytes)); /* the rows a short tile computes and drops: never uninitialized */
    const int centre = tile8_centre(fmt);
    for (int64_t p0 = 0; p0 < M; p0 += pass) {
        const int64_t p1 = M - p0 < pass ? M : p0 + pass, ng = (p1 - p0 + 15) / 16;
        acts8 a = acts8_in(mem, p1 - p0, K);
        _Pragma("omp parallel num_threads(nt) if(nt > 1 && p1 - p0 >= 16)")
        {
            _Pragma("omp for schedule(static)")
            for (int64_t m = p0; m < p1; m += 4)
                quantize_rows8(fmt, 0, x + p0 * ldx, m - p0, p1 - m < 4 ? p1 - p0 : m - p0 + 4, ldx, K, &a);
            _Pragma("omp for schedule(static)")
            for (int64_t gi = 0; gi < ng; gi++) {
                const group8 g = tile8_group_in(gmem + gi * gbytes, K);
                tile8_group(&a, 16 * gi, p1 - p0, K, centre, &g);
            }
        }
        _Pragma("omp parallel num_threads(nt) if(nt > 1)")
        {
            char *mine = wmem + ai_thread_num() * wbytes;
            wrow8 wr[T8_COLS];
            for (int c = 0; c < T8_COLS; c++)
                wr[c] = tile8_wrow_in(mine + tile_span_bytes(groups) + c * tile8_wrow_bytes(K), K);
            const tile8_job job = {fmt, lanes, w, row_bytes, K, ng, p0, p1, gbytes, ldy, N, gmem, wr, bias, y,
                                   (float *)mine, (uint8_t *)(lmem + ai_thread_num() * lbytes)};
            _Pragma("omp for schedule(static)")
            for (int64_t n0 = 0; n0 < N; n0 += T8_SPAN) cols(&job, n0, (int)(N - n0 < T8_SPAN ? N - n0 : T8_SPAN));
        }
    }
    free(mem);
    return 0;
}

#define TILE8(NAME, FMT)                                                                          \
    static int NAME(const float *x, int64_t M, int64_t ldx, int64_t K, const void *w, int64_t N, const float *bias, \
                    float *y, int64_t ldy, int threads, void *scratch) {                          \
        (void)scratch;                                                                            \
        return tile8_gemm(FMT, x, M, ldx, K, (const uint8_t *)w, N, bias, y, ldy, threads, 0);    \
    }
TILE8(ai_tile8_q4_1, ASYNCINFER_FMT_Q4_1)
TILE8(ai_tile8_q8_0, ASYNCINFER_FMT_Q8_0)
TILE8(ai_tile8_q4_0, ASYNCINFER_FMT_Q4_0)
TILE8(ai_tile8_q5_0, ASYNCINFER_FMT_Q5_0)
TILE8(ai_tile8_q5_1, ASYNCINFER_FMT_Q5_1)
TILE8(ai_tile8_q4_k, ASYNCINFER_FMT_Q4_K)
TILE8(ai_tile8_q5_k, ASYNCINFER_FMT_Q5_K)
TILE8(ai_tile8_q6_k, ASYNCINFER_FMT_Q6_K)

/* Q4_0 / Q4_1 in lanes (N a multiple of 16), each group of 16 weight rows unpacked whole (tile8_unpack_group): the
 * same float32 operations as the lanes' own GEMM, so the same results (asyncinfer_gemm's TILE8 | LANES16 on AVX-512
 * builds: a prefill's). */
static int ai_tile8_lanes(int fmt, const float *x, int64_t M, int64_t ldx, int64_t K, const void *w, int64_t N,
                          const float *bias, float *y, int64_t ldy, int threads) {
    if (N % LANE_ROWS) return ASYNCINFER_EINVAL;
    return tile8_gemm(fmt, x, M, ldx, K, (const uint8_t *)w, N, bias, y, ldy, threads, 1);
}

static gemm_fn tile8_of(int fmt) {
    static const gemm_fn table[ASYNCINFER_NUM_FMTS] = {ai_tile8_q4_1, ai_tile8_q8_0, ai_tile8_q4_0, ai_tile8_q5_0,
                                                       ai_tile8_q5_1, ai_tile8_q4_k, ai_tile8_q5_k, ai_tile8_q6_k};
    return fmt >= 0 && fmt < ASYNCINFER_NUM_FMTS ? table[fmt] : NULL;
}

/* ---- The int16 tile (AVX-512 builds): the int16 default's GEMM from PANEL_MIN_ROWS activation rows on, the
 * tile above with the rows' int16 numerics (gemm.c: each block of 32 activations rounded to int16, x ~= dx * qx,
 * |qx| <= 32767). A weight row is unpacked once per pass into signed int16 quants q (the centre subtracted: Q4_0's
 * nibble - 8, Q6_K's six bits - 32, Q8_0's bytes as they are), its float32 scale S and min of each block of 32
 * (Q6_K: d times the int8 scale of each 16); two consecutive quants broadcast to every lane make one vpdpwssd with
 * the group's register of the 16 rows' two int16 values (lane r: row r's pair). Per block of 32 (Q6_K: per 16),
 * for every lane,
 *
 *   idot = sum(q * qx)   (exact: |q| <= 128, 32 products of at most 2^22)
 *   acc  = fma(float(idot), dx * S, acc);   acc = fma(min, sum(x), acc)   (the formats with a min)
 *
 * blocks in order from acc = 0, then + bias: the rows' definition (their products and scales), summed in
 * another order; the same float32 operations for a row whatever its lane, its group or the batch. Sixteen
 * vpdpwssd per block and row group a weight row (the int8 tile's eight vpdpbusd take twice the products each). */
#define T16_COLS 6   /* weight rows a micro-kernel call takes: 12 accumulators and 12 sums with 2 groups */
#define T16_GROUPS 2 /* groups of 16 activation rows a micro-kernel call takes */

typedef struct {
    int16_t *q;
    float *s;  /* [K / 32]; Q6_K: [K / 16], d * its int8 scale */
    float *mn; /* [K / 32] */
} wrow16;

static inline int64_t tile16_wrow_bytes(int64_t K) { return 2 * K + K / 16 * 4 + K / QK * 4; }

static inline wrow16 tile16_wrow_in(void *at, int64_t K) {
    wrow16 r;
    r.q = (int16_t *)at;
    r.s = (float *)(r.q + K);
    r.mn = r.s + K / 16;
    return r;
}

/* tile8_unpack's bytes (u, in tmp) widened to int16 with the centre subtracted. */
static inline __attribute__((always_inline)) void tile16_unpack(const int fmt, const uint8_t *row, int64_t K,
                                                                const wrow8 *tmp, const wrow16 *r) {
    tile8_unpack(fmt, row, K, tmp, 1);
    const __m512i centre = _mm512_set1_epi16((short)tile8_centre(fmt));
    for (int64_t i = 0; i < K; i += 32) {
        const __m256i u = _mm256_loadu_si256((const __m256i *)(tmp->u + i));
#ifndef AI_VNNI
        if (fmt == ASYNCINFER_FMT_Q8_0) { /* the signed bytes as they are (centre 0 here) */
            _mm512_storeu_si512(r->q + i, _mm512_cvtepi8_epi16(u));
            continue;
        }
#endif
        _mm512_storeu_si512(r->q + i, _mm512_sub_epi16(_mm512_cvtepu8_epi16(u), centre));
    }
    const int64_t nb = K / QK;
    if (fmt == ASYNCINFER_FMT_Q6_K) {
        for (int64_t j = 0; j < K / 16; j++) r->s[j] = tmp->s[j / 2] * (float)tmp->sc[j];
        return;
    }
    memcpy(r->s, tmp->s, (size_t)nb * sizeof(float));
    if (has_min8(fmt)) memcpy(r->mn, tmp->mn, (size_t)nb * sizeof(float));
}

/* A pass's activation rows in groups of 16 (rows past the batch zeros): q [K / 2] registers of the 16 rows' two
 * int16 values, d and sum [K / 32][16] float32. */
typedef struct {
    int32_t *q;
    float *d;
    float *sum;
} group16;

static inline int64_t tile16_group_bytes(int64_t K) { return 16 * (2 * K + K / QK * 8); }

static inline group16 tile16_group_in(void *at, int64_t K) {
    group16 g;
    g.q = (int32_t *)at;
    g.d = (float *)(g.q + 8 * K); /* 16 rows * K / 2 words */
    g.sum = g.d + 16 * (K / QK);
    return g;
}

static void tile16_group(const int16_t *q, const float *d, const float *sum, int64_t m0, int64_t m1, int64_t K,
                         const group16 *g) {
    const int64_t nb = K / QK;
    for (int r = 0; r < 16; r++) {
        const int64_t m = m0 + r;
        const int live = m < m1;
        const int32_t *qr = (const int32_t *)(q + m * K);
        for (int64_t t = 0; t < K / 2; t++) {
            int32_t v = 0;
            if (live) memcpy(&v, qr + t, 4);
            g->q[t * 16 + r] = v;
        }
        for (int64_t b = 0; b < nb; b++) {
            g->d[b * 16 + r] = live ? d[m * nb + b] : 0.0f;
            g->sum[b * 16 + r] = live ? sum[m * nb + b] : 0.0f;
        }
    }
}

static inline __attribute__((always_inline)) void tile16_kernel(const int fmt, const int G, const int C,
                                                                const group16 *gs, const wrow16 *w, int64_t K,
                                                                __m512 out[T16_GROUPS][T16_COLS], const tile_next *next) {
    const int64_t nb = K / QK;
    const int q6 = fmt == ASYNCINFER_FMT_Q6_K, min = has_min8(fmt);
    __m512 f[T16_GROUPS][T16_COLS];
    for (int g = 0; g < G; g++)
        for (int c = 0; c < C; c++) f[g][c] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        tile_fetch(next, b, nb);
        __m512 dx[T16_GROUPS];
        for (int g = 0; g < G; g++) dx[g] = _mm512_loadu_ps(gs[g].d + b * 16);
        for (int half = 0; half < (q6 ? 2 : 1); half++) {
            __m512i acc[T16_GROUPS][T16_COLS];
            for (int g = 0; g < G; g++)
                for (int c = 0; c < C; c++) acc[g][c] = _mm512_setzero_si512();
            const int t0 = q6 ? 8 * half : 0, t1 = q6 ? t0 + 8 : 16;
#ifndef ASYNCINFER_EMULATE_AVX512
#pragma GCC unroll 16
#endif
            for (int t = t0; t < t1; t++) {
                __m512i xv[T16_GROUPS];
                for (int g = 0; g < G; g++) xv[g] = _mm512_loadu_si512(gs[g].q + (16 * b + t) * 16);
                for (int c = 0; c < C; c++) {
                    int32_t word;
                    memcpy(&word, w[c].q + 32 * b + 2 * t, 4);
                    const __m512i wv = _mm512_set1_epi32(word);
                    for (int g = 0; g < G; g++) acc[g][c] = ai_dpwssd512(acc[g][c], wv, xv[g]);
                }
            }
            for (int c = 0; c < C; c++) {
                const __m512 s = _mm512_set1_ps(q6 ? w[c].s[2 * b + half] : w[c].s[b]);
                for (int g = 0; g < G; g++)
                    f[g][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[g][c]), _mm512_mul_ps(dx[g], s), f[g][c]);
            }
        }
        if (min) {
            for (int g = 0; g < G; g++) {
                const __m512 xs = _mm512_loadu_ps(gs[g].sum + b * 16);
                for (int c = 0; c < C; c++) f[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(w[c].mn[b]), xs, f[g][c]);
            }
        }
    }
    for (int g = 0; g < G; g++)
        for (int c = 0; c < C; c++) out[g][c] = f[g][c];
}

/* As tile8_call: every weight row of the tile at once, one or two groups. */
static inline __attribute__((always_inline)) void tile16_call(const int fmt, int G, const group16 *gs,
                                                              const wrow16 *w, int64_t K,
                                                              __m512 out[T16_GROUPS][T16_COLS], const tile_next *next) {
    if (G == 2) return tile16_kernel(fmt, 2, T16_COLS, gs, w, K, out, next);
    tile16_kernel(fmt, 1, T16_COLS, gs, w, K, out, next);
}

/* Activation rows a pass takes (a multiple of 16 * T16_GROUPS): their int16 values and groups within
 * T16_PASS_BYTES (3 MiB), the groups (half of it) in a core's L2 cache while every weight row meets them. Four times
 * the rows' budget (each row's values are twice the bytes): at the 1B shape on this project's Xeon (2 MiB of L2) it
 * ran the down projection's GEMM (K = 8192) at 128 rows faster than 1.5 MiB passes. Not the int8 tile's 6 MiB
 * (T8_PASS_BYTES): larger int16 passes are not measured across machines. */
#ifndef T16_PASS_BYTES
#define T16_PASS_BYTES (4 * PASS8_BYTES)
#endif
static inline int64_t tile16_pass_rows(int64_t K) {
    const int64_t per = tile16_group_bytes(K) / 16 + 2 * K + K / QK * 8,
                  rows = T16_PASS_BYTES / (per > 0 ? per : 1) / (16 * T16_GROUPS) * (16 * T16_GROUPS);
    return rows < 16 * T16_GROUPS ? 16 * T16_GROUPS : rows;
}

/* What a thread's run of weight rows needs (tile16_cols): the pass's groups, its own unpacked rows, the output. */
typedef struct {
    int fmt;
    const uint8_t *w;
    int64_t row_bytes, K, ng, p0, p1, gbytes, ldy, N;
    char *gmem;
    const wrow8 *tmp;
    const wrow16 *wr;
    const float *bias;
    float *y;
    float *ob; /* the thread's span buffer (tile_span_bytes) */
} tile16_job;

#define T16_SPAN (4 * T16_COLS) /* weight rows a call takes (at most TILE_SPAN_COLS) */

/* Weight rows [n0, n0 + C) (C <= T16_SPAN) against every group of the pass: T16_COLS at a time unpacked once,
 * then each pair of groups; the span's sums stored at the end. */
static inline __attribute__((always_inline)) void tile16_cols(const int fmt, const tile16_job *j, int64_t n0, int C) {
    const int64_t K = j->K;
    for (int s = 0; s < C; s += T16_COLS) {
        const int cs = C - s < T16_COLS ? C - s : T16_COLS;
        for (int c = 0; c < cs; c++) tile16_unpack(fmt, j->w + (n0 + s + c) * j->row_bytes, K, j->tmp, &j->wr[c]);
        group16 gs[T16_GROUPS];
        const tile_next next = tile_next_rows(j->w, j->row_bytes, j->N, n0 + s + T16_COLS, T16_COLS);
        const tile_next none = {NULL, 0, 0};
        for (int64_t gi = 0; gi < j->ng; gi += T16_GROUPS) {
            const int G = (int)(j->ng - gi < T16_GROUPS ? j->ng - gi : T16_GROUPS);
            for (int g = 0; g < G; g++) gs[g] = tile16_group_in(j->gmem + (gi + g) * j->gbytes, K);
            __m512 out[T16_GROUPS][T16_COLS];
            tile16_call(fmt, G, gs, j->wr, K, out, gi == 0 ? &next : &none);
            span_keep(j->ob, gi, G, s, cs, &out[0][0], T16_COLS);
        }
    }
    span_store(j->ob, j->ng, C, j->p0, j->p1, n0, j->bias, j->y, j->ldy);
}

TILE_COLS_OF(tile16, tile16_job)

static int tile16_gemm(const int fmt, const float *x, int64_t M, int64_t ldx, int64_t K, const uint8_t *w, int64_t N,
                       const float *bias, float *y, int64_t ldy, int threads) {
    const tile16_cols_fn cols = tile16_cols_of(fmt);
    const int64_t row_bytes = K / ai_fmt_weights(fmt) * ai_fmt_bytes(fmt), pass = tile16_pass_rows(K), nb = K / QK;
    const int64_t groups = (M < pass ? (M + 15) / 16 : pass / 16);
    const int64_t rows = M < pass ? M : pass, acts = rows * (2 * K + nb * 8), gbytes = tile16_group_bytes(K),
                  wbytes = (tile_span_bytes(groups) + T16_COLS * tile16_wrow_bytes(K) + tile8_wrow_bytes(K) + 127) / 64 * 64;
    const int nt = threads > 1 ? threads : 1;
    char *mem = (char *)malloc((size_t)(acts + groups * gbytes + nt * wbytes + 128));
    if (!mem) return ASYNCINFER_ENOMEM;
    char *gmem = mem + (acts + 63) / 64 * 64, *wmem = gmem + groups * gbytes;
    memset(wmem, 0, (size_t)(nt * wbytes)); /* the rows a short tile computes and drops: never uninitialized */
    int16_t *q = (int16_t *)mem;
    float *d = (float *)(q + rows * K), *sum = d + rows * nb;
    for (int64_t p0 = 0; p0 < M; p0 += pass) {
        const int64_t p1 = M - p0 < pass ? M : p0 + pass, ng = (p1 - p0 + 15) / 16;
        _Pragma("omp parallel num_threads(nt) if(nt > 1 && p1 - p0 >= 16)")
        {
            _Pragma("omp for schedule(static)")
            for (int64_t m = p0; m < p1; m += 4) {
                const int64_t m1 = p1 - m < 4 ? p1 : m + 4;
                ai_quantize_acts16(x + m * ldx, m1 - m, ldx, K, q + (m - p0) * K, d + (m - p0) * nb,
                                   sum + (m - p0) * nb);
            }
            _Pragma("omp for schedule(static)")
            for (int64_t gi = 0; gi < ng; gi++) {
                const group16 g = tile16_group_in(gmem + gi * gbytes, K);
                tile16_group(q, d, sum, 16 * gi, p1 - p0, K, &g);
            }
        }
        _Pragma("omp parallel num_threads(nt) if(nt > 1)")
        {
            float *ob = (float *)(wmem + ai_thread_num() * wbytes);
            char *mine = (char *)ob + tile_span_bytes(groups);
            wrow16 wr[T16_COLS];
            for (int c = 0; c < T16_COLS; c++) wr[c] = tile16_wrow_in(mine + c * tile16_wrow_bytes(K), K);
            const wrow8 tmp = tile8_wrow_in(mine + T16_COLS * tile16_wrow_bytes(K), K);
            const tile16_job job = {fmt, w, row_bytes, K, ng, p0, p1, gbytes, ldy, N, gmem, &tmp, wr, bias, y, ob};
            _Pragma("omp for schedule(static)")
            for (int64_t n0 = 0; n0 < N; n0 += T16_SPAN) cols(&job, n0, (int)(N - n0 < T16_SPAN ? N - n0 : T16_SPAN));
        }
    }
    free(mem);
    return 0;
}

int ai_tile16_gemm(int fmt, const float *x, int64_t M, int64_t ldx, int64_t K, const void *w, int64_t N,
                   const float *bias, float *y, int64_t ldy, int threads) {
    if (fmt < 0 || fmt >= ASYNCINFER_NUM_FMTS) return ASYNCINFER_EINVAL;
    return tile16_gemm(fmt, x, M, ldx, K, (const uint8_t *)w, N, bias, y, ldy, threads);
}
#endif /* AI_AVX512 */

/* ---- Q4_0 and Q4_1 in lanes (ASYNCINFER_FMT_LANES16): 16 weight rows a register, one activation row at a time.
 * Per activation row, group of 16 weight rows and block of 32, with the activations rounded as the rows round them:
 *
 *   idot = sum(u * qx) - centre * sum(qx)   (lane r: weight row r's; Q4_0's centre 8, Q4_1's 0)
 *   acc = fma(float(idot), d_r * dx, acc);   Q4_1: acc = fma(m_r, sum(x), acc)   (the block's float32 sum of x)
 *
 * blocks in order from acc = 0, then + bias: the same operations for an activation row whatever the others, and
 * in every variant (the plain C loop below is the reference and the non-AVX-512 variants' path; Q4_0's results the
 * same bits everywhere, Q4_1's wherever the activations' float32 sums are added in the same order: every variant
 * but scalar). Four int8 activations broadcast to every lane meet four bytes of each of the 16 rows in one
 * vpdpbusd: no horizontal sums, the float32 work of a block shared by 16 weight rows. */
#define LANE_PASS 8    /* activation rows a pass over a group's blocks takes */

__attribute__((unused)) static void lanes_ref(const int fmt, const uint8_t *g, int64_t K, const acts8 *a, int64_t m0,
                                              int R, float *y, int64_t ldy) {
    const int64_t nb = K / QK;
    const int head = lane_head(fmt), size = lane_block(fmt), q4_1 = fmt == ASYNCINFER_FMT_Q4_1;
    for (int i = 0; i < R; i++) {
        const int64_t m = m0 + i;
        float acc[LANE_ROWS] = {0};
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = g + b * size;
            const int8_t *qx = a->q + m * K + b * QK;
            const int centre = q4_1 ? 0 : 8 * (a->isum[m * 2 * nb + 2 * b] + a->isum[m * 2 * nb + 2 * b + 1]);
            for (int r = 0; r < LANE_ROWS; r++) {
                int32_t idot = -centre;
                for (int c = 0; c < 4; c++)
                    for (int t = 0; t < 4; t++) {
                        const uint8_t byte = blk[head + 64 * c + 4 * r + t];
                        idot += (byte & 15) * qx[4 * c + t] + (byte >> 4) * qx[16 + 4 * c + t];
                    }
                acc[r] = fmaf((float)idot, ai_half_at(blk + 2 * r) * a->d[m * nb + b], acc[r]);
                if (q4_1) acc[r] = fmaf(ai_half_at(blk + 32 + 2 * r), a->sum[m * nb + b], acc[r]);
            }
        }
        memcpy(y + m * ldy, acc, sizeof(acc));
    }
}

#ifdef AI_AVX512
/* With VNNI the high nibbles are taken in place, 16 times their value, and the sums shifted back (exact: vpdpbusd
 * does not saturate, where the multiply-add pair would); the same integers as shifting the nibbles first, which the
 * other builds do (and the SIMDe-emulated ones, whose headers have no 32-bit arithmetic shift). */
#if defined(AI_VNNI) && !defined(ASYNCINFER_EMULATE_AVX512)
#define LANES_HIGH_IN_PLACE 1
#else
#define LANES_HIGH_IN_PLACE 0
#endif
/* 16 float16 values (a group's scales or minimums) as 16 floats. */
static inline __m512 lanes_halves(const uint8_t *p) {
    const __m256 h0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    const __m256 h1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16)));
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(h0)), _mm256_castps_pd(h1), 1));
}

static inline __attribute__((always_inline)) void lanes_512(const int fmt, const uint8_t *g, int64_t K, const acts8 *a,
                                                            int64_t m0, const int R, float *y, int64_t ldy) {
    const int64_t nb = K / QK;
    const int head = lane_head(fmt), size = lane_block(fmt), q4_1 = fmt == ASYNCINFER_FMT_Q4_1;
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 acc[LANE_PASS];
    for (int i = 0; i < R; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = g + b * size;
        ai_prefetch_lines(blk + 4 * size, size);
        const __m512 dw = lanes_halves(blk);
        const __m512 mw = q4_1 ? lanes_halves(blk + 32) : _mm512_setzero_ps();
        __m512i lo[4], hi[4];
        for (int c = 0; c < 4; c++) {
            const __m512i v = _mm512_loadu_si512(blk + head + 64 * c);
            lo[c] = _mm512_and_si512(v, low);
#if LANES_HIGH_IN_PLACE
            hi[c] = _mm512_andnot_si512(low, v);
#else
            hi[c] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
#endif
        }
        for (int i = 0; i < R; i++) {
            const int64_t m = m0 + i;
            int32_t x[8];
            memcpy(x, a->q + m * K + b * QK, 32);
            __m512i s0 = ai_dpbusd512(_mm512_setzero_si512(), lo[0], _mm512_set1_epi32(x[0]));
            __m512i s1 = ai_dpbusd512(_mm512_setzero_si512(), hi[0], _mm512_set1_epi32(x[4]));
            for (int c = 1; c < 4; c++) {
                s0 = ai_dpbusd512(s0, lo[c], _mm512_set1_epi32(x[c]));
                s1 = ai_dpbusd512(s1, hi[c], _mm512_set1_epi32(x[4 + c]));
            }
#if LANES_HIGH_IN_PLACE
            s1 = _mm512_srai_epi32(s1, 4);
#endif
            __m512i idot = _mm512_add_epi32(s0, s1);
            if (!q4_1) {
                const int centre = 8 * (a->isum[m * 2 * nb + 2 * b] + a->isum[m * 2 * nb + 2 * b + 1]);
                idot = _mm512_sub_epi32(idot, _mm512_set1_epi32(centre));
            }
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(idot), _mm512_mul_ps(dw, _mm512_set1_ps(a->d[m * nb + b])),
                                     acc[i]);
            if (q4_1) acc[i] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a->sum[m * nb + b]), acc[i]);
        }
    }
    for (int i = 0; i < R; i++) _mm512_storeu_ps(y + (m0 + i) * ldy, acc[i]);
}
#define LANES_CALL(fmt, g, K, a, m0, R, y, ldy) lanes_512(fmt, g, K, a, m0, R, y, ldy)
#else
#define LANES_CALL(fmt, g, K, a, m0, R, y, ldy) lanes_ref(fmt, g, K, a, m0, R, y, ldy)
#endif

static inline __attribute__((always_inline)) int lanes_gemm(const int fmt, const float *x, int64_t M, int64_t ldx,
                                                            int64_t K, const void *w, int64_t N, const float *bias,
                                                            float *y, int64_t ldy, int threads, void *scratch) {
    if (N % LANE_ROWS) return ASYNCINFER_EINVAL;
    const uint8_t *groups = (const uint8_t *)w;
    const int64_t nb = K / QK, size = lane_block(fmt);
    acts8 a = acts8_in(scratch, M, K);
    _Pragma("omp parallel num_threads(threads) if(threads > 1 && M >= PANEL_MIN_ROWS)")
    {
        _Pragma("omp for schedule(static)")
        for (int64_t m = 0; m < M; m += MR8) quantize_rows8(fmt, 0, x, m, M - m < MR8 ? M : m + MR8, ldx, K, &a);
    }
    _Pragma("omp parallel for schedule(static) num_threads(threads) if(threads > 1)")
    for (int64_t gi = 0; gi < N / LANE_ROWS; gi++) {
        const uint8_t *g = groups + gi * nb * size;
        float *yg = y + gi * LANE_ROWS;
        int64_t m = 0;
        for (; m + LANE_PASS <= M; m += LANE_PASS) LANES_CALL(fmt, g, K, &a, m, LANE_PASS, yg, ldy);
        switch (M - m) {
            case 7: LANES_CALL(fmt, g, K, &a, m, 7, yg, ldy); break;
            case 6: LANES_CALL(fmt, g, K, &a, m, 6, yg, ldy); break;
            case 5: LANES_CALL(fmt, g, K, &a, m, 5, yg, ldy); break;
            case 4: LANES_CALL(fmt, g, K, &a, m, 4, yg, ldy); break;
            case 3: LANES_CALL(fmt, g, K, &a, m, 3, yg, ldy); break;
            case 2: LANES_CALL(fmt, g, K, &a, m, 2, yg, ldy); break;
            case 1: LANES_CALL(fmt, g, K, &a, m, 1, yg, ldy); break;
            default: break;
        }
        if (bias)
            for (int64_t i = 0; i < M; i++)
                for (int r = 0; r < LANE_ROWS; r++) yg[i * ldy + r] += bias[gi * LANE_ROWS + r];
    }
    return 0;
}

static int ai_gemm8_q4_0_lanes(const float *x, int64_t M, int64_t ldx, int64_t K, const void *w, int64_t N,
                               const float *bias, float *y, int64_t ldy, int threads, void *scratch) {
    return lanes_gemm(ASYNCINFER_FMT_Q4_0, x, M, ldx, K, w, N, bias, y, ldy, threads, scratch);
}

static int ai_gemm8_q4_1_lanes(const float *x, int64_t M, int64_t ldx, int64_t K, const void *w, int64_t N,
                               const float *bias, float *y, int64_t ldy, int threads, void *scratch) {
    return lanes_gemm(ASYNCINFER_FMT_Q4_1, x, M, ldx, K, w, N, bias, y, ldy, threads, scratch);
}

/* Activation rows from which a format in lanes with ASYNCINFER_FMT_TILE8 takes the tile (AVX-512 builds): below it
 * the lanes' own GEMM is faster (a fifth of the tile's time at one row; about even at 32 on a Zen 4 core, measured
 * before the tile unpacked the lanes' groups whole at d70fbb4, which made it faster at 32 rows: not measured since). */
#define LANES_TILE_MIN_ROWS 32

/* A format in lanes with ASYNCINFER_FMT_TILE8 (a prefill's, and the decode step's at every batch): the tile reading
 * the lanes from LANES_TILE_MIN_ROWS rows on where the build has it, else the lanes' own GEMM; the same results. */
static inline __attribute__((always_inline)) int lanes_tile(const int fmt, const float *x, int64_t M, int64_t ldx,
                                                            int64_t K, const void *w, int64_t N, const float *bias,
                                                            float *y, int64_t ldy, int threads, void *scratch) {
#ifdef AI_AVX512
    if (M >= LANES_TILE_MIN_ROWS) return ai_tile8_lanes(fmt, x, M, ldx, K, w, N, bias, y, ldy, threads);
#endif
    return lanes_gemm(fmt, x, M, ldx, K, w, N, bias, y, ldy, threads, scratch);
}

static int ai_gemm8_q4_0_lanes_tile(const float *x, int64_t M, int64_t ldx, int64_t K, const void *w, int64_t N,
                                    const float *bias, float *y, int64_t ldy, int threads, void *scratch) {
    return lanes_tile(ASYNCINFER_FMT_Q4_0, x, M, ldx, K, w, N, bias, y, ldy, threads, scratch);
}

static int ai_gemm8_q4_1_lanes_tile(const float *x, int64_t M, int64_t ldx, int64_t K, const void *w, int64_t N,
                                    const float *bias, float *y, int64_t ldy, int threads, void *scratch) {
    return lanes_tile(ASYNCINFER_FMT_Q4_1, x, M, ldx, K, w, N, bias, y, ldy, threads, scratch);
}

/* A step's int8 projection in a plain block format with ASYNCINFER_FMT_TILE8 (layer_t's parts, the head's format):
 * the tile from ASYNCINFER_STEP_TILE_MIN_ROWS rows on where the build has it (AVX-512), else the rows. At the 1B
 * shape on a Zen 4 core pair, at 71476af, the tile ran at 1.09x (Q4_K) to 1.35x (Q6_K) the rows' speed at 12 rows
 * and 1.84x to 2.36x at 32 in the k-quants and Q8_0; Q4_0 / Q4_1 in ggml's layout (a layer that cannot take the
 * lanes) at 0.99x / 0.80x at 12 rows, 1.39x / 1.11x at 16 (it computes 16 rows' work from one row on;
 * benchmarks/results/activation_dtype_step_tile_zen4.json). */
gemm_fn ai_step8_of(int fmt, int64_t M) {
#ifdef AI_AVX512
    if (M >= ASYNCINFER_STEP_TILE_MIN_ROWS) return tile8_of(fmt);
#else
    (void)M;
#endif
    return ai_gemm8_of(fmt);
}

/* The GEMM of a format code in lanes (LANES16 | ACT8 | Q4_0 or Q4_1, TILE8 allowed), NULL for any other code. */
#define LANES_CODE (ASYNCINFER_FMT_LANES16 | ASYNCINFER_FMT_ACT8)
gemm_fn ai_lanes_of(int fmt) {
    switch (fmt) {
        case LANES_CODE | ASYNCINFER_FMT_Q4_0: return ai_gemm8_q4_0_lanes;
        case LANES_CODE | ASYNCINFER_FMT_Q4_1: return ai_gemm8_q4_1_lanes;
        case ASYNCINFER_FMT_TILE8 | LANES_CODE | ASYNCINFER_FMT_Q4_0: return ai_gemm8_q4_0_lanes_tile;
        case ASYNCINFER_FMT_TILE8 | LANES_CODE | ASYNCINFER_FMT_Q4_1: return ai_gemm8_q4_1_lanes_tile;
        default: return NULL;
    }
}

/* kernels.gemm's entry: an int8-activation format with ASYNCINFER_FMT_TILE8 takes the tile where the build has
 * one (AVX-512), the rows elsewhere (a format in lanes: ai_lanes_of's); the other codes their GEMM. */
int asyncinfer_gemm(int fmt, const float *x, int64_t M, int64_t ldx, int64_t K, const void *w, int64_t N,
                    const float *bias, float *y, int64_t ldy, int threads, void *scratch) {
    const gemm_fn in_lanes = ai_lanes_of(fmt);
    if (in_lanes) return in_lanes(x, M, ldx, K, w, N, bias, y, ldy, threads, scratch);
    if (fmt >= ASYNCINFER_FMT_TILE8) {
        fmt -= ASYNCINFER_FMT_TILE8;
        if (fmt < ASYNCINFER_FMT_ACT8 || fmt >= ASYNCINFER_FMT_ACT8 + ASYNCINFER_NUM_FMTS) return ASYNCINFER_EINVAL;
#ifdef AI_AVX512
        return tile8_of(fmt - ASYNCINFER_FMT_ACT8)(x, M, ldx, K, w, N, bias, y, ldy, threads, scratch);
#endif
    }
    const gemm_fn fn = ai_gemm_of(fmt, M);
    return fn ? fn(x, M, ldx, K, w, N, bias, y, ldy, threads, scratch) : ASYNCINFER_EINVAL;
}
