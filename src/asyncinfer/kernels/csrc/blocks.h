/* ggml's block formats besides Q4_1 / Q8_0, as gemm.c reads them: Q4_0, Q5_0, Q5_1 (blocks of 32 weights)
 * and the k-quants Q4_K, Q5_K, Q6_K (super-blocks of 256), each in ggml's own block layout (the kernels'
 * layout is ggml's: asyncinfer.kernels.pack leaves these blocks as they are).
 *
 * A block is read as runs of 32 weights ("sub-blocks": a 32-weight block is one, a super-block eight);
 * sub-block j's weight i is  scale_j * q_i + min_j,  q_i an integer (int16), scale_j and min_j float32:
 *
 *   Q4_0 (18 bytes: d, 16 bytes of nibbles):  q = nibble - 8, scale d, no min
 *   Q5_0 (22 bytes: d, qh[4], qs[16]):        q = (nibble | bit i of qh << 4) - 16, scale d, no min
 *   Q5_1 (24 bytes: d, m, qh[4], qs[16]):     q = nibble | bit i of qh << 4, scale d, min m
 *        (the nibbles: element i < 16 is byte i's low nibble, element i + 16 its high one)
 *   Q4_K (144 bytes: d, dmin, scales[12], qs[128]): q = nibble, scale d * sc_j, min -(dmin * m_j), with
 *        sc_j / m_j sub-block j's 6-bit scale and minimum packed in scales[12]; sub-block j's nibbles are
 *        the low (j even) or high (j odd) halves of bytes 32 (j / 2) to 32 (j / 2) + 31
 *   Q5_K (176 bytes: d, dmin, scales[12], qh[32], qs[128]): as Q4_K, plus bit j of qh[i] << 4
 *   Q6_K (210 bytes: ql[128], qh[64], scales[16] int8, d): sub-block j = 4 n + k (n the half of 128,
 *        k its quarter) takes the low (k < 2) or high nibbles of ql[64 n + 32 (k & 1) + i] and bits 2k, 2k + 1
 *        of qh[32 n + i] as bits 4, 5; q = sc * (that - 32), sc = scales[2 j] for i < 16, scales[2 j + 1]
 *        after (the int8 scales of the halves of 16); scale d, no min
 *
 * Every scale_j * q_i is exact in float32 (at most 24 significant bits: an 11-bit half times at most 13
 * bits), so scale_j * q_i + min_j is ggml's dequantized weight bit for bit (one rounding, of the sum). */
#ifndef ASYNCINFER_BLOCKS_H
#define ASYNCINFER_BLOCKS_H

#include "internal.h"

/* Weights and bytes per block, sub-blocks of 32 per block, whether a min term is added. */
static inline int64_t ai_fmt_weights(int fmt) { return fmt >= ASYNCINFER_FMT_Q4_K ? 256 : 32; }

static inline int64_t ai_fmt_bytes(int fmt) {
    switch (fmt) {
        case ASYNCINFER_FMT_Q4_1: return 20;
        case ASYNCINFER_FMT_Q8_0: return 34;
        case ASYNCINFER_FMT_Q4_0: return 18;
        case ASYNCINFER_FMT_Q5_0: return 22;
        case ASYNCINFER_FMT_Q5_1: return 24;
        case ASYNCINFER_FMT_Q4_K: return 144;
        case ASYNCINFER_FMT_Q5_K: return 176;
        default: return 210; /* Q6_K */
    }
}

static inline int ai_fmt_subs(int fmt) { return fmt >= ASYNCINFER_FMT_Q4_K ? 8 : 1; }

static inline int ai_fmt_has_min(int fmt) {
    return fmt == ASYNCINFER_FMT_Q5_1 || fmt == ASYNCINFER_FMT_Q4_K || fmt == ASYNCINFER_FMT_Q5_K;
}

static inline float ai_half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return ai_half_to_float(h);
}

static inline uint32_t ai_u32_at(const uint8_t *p) { /* little-endian, as ggml writes qh */
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* Q4_K / Q5_K: the eight 6-bit scales and the eight minimums from the 12 packed bytes s, as bytes (byte j of
 * *sc / *mn: sub-block j's). Sub-blocks 0-3 take the low 6 bits of bytes 0-3 (scales) and 4-7 (minimums);
 * sub-blocks 4-7 the nibbles of bytes 8-11 (low: scale, high: minimum) with the top 2 bits of bytes 0-3
 * (scale) and 4-7 (minimum) above them: four sub-blocks a 32-bit word, the bits no byte keeps masked off. */
static inline void ai_k_scales8(const uint8_t *s, uint64_t *sc, uint64_t *mn) {
    const uint32_t a = ai_u32_at(s), b = ai_u32_at(s + 4), c = ai_u32_at(s + 8);
    const uint32_t low6 = 0x3F3F3F3Fu, low4 = 0x0F0F0F0Fu, top2 = 0x30303030u;
    *sc = (uint64_t)(a & low6) | (uint64_t)((c & low4) | ((a >> 2) & top2)) << 32;
    *mn = (uint64_t)(b & low6) | (uint64_t)(((c >> 4) & low4) | ((b >> 2) & top2)) << 32;
}

/* Every sub-block's scale and min of the block at blk (min 0 where the format has none). */
static inline void ai_block_scales(int fmt, const uint8_t *blk, float *scale, float *min) {
    switch (fmt) {
        case ASYNCINFER_FMT_Q4_0:
        case ASYNCINFER_FMT_Q5_0:
            scale[0] = ai_half_at(blk);
            min[0] = 0.0f;
            return;
        case ASYNCINFER_FMT_Q5_1:
            scale[0] = ai_half_at(blk);
            min[0] = ai_half_at(blk + 2);
            return;
        case ASYNCINFER_FMT_Q4_K:
        case ASYNCINFER_FMT_Q5_K: {
            const float d = ai_half_at(blk), dmin = ai_half_at(blk + 2);
            uint64_t sc, m;
            ai_k_scales8(blk + 4, &sc, &m);
            for (int j = 0; j < 8; j++) {
                scale[j] = d * (float)(int)((sc >> (8 * j)) & 0xFF);
                min[j] = -(dmin * (float)(int)((m >> (8 * j)) & 0xFF));
            }
            return;
        }
        default: { /* Q6_K: the int8 scales go into q */
            const float d = ai_half_at(blk + 208);
            for (int j = 0; j < 8; j++) {
                scale[j] = d;
                min[j] = 0.0f;
            }
            return;
        }
    }
}

/* Sub-block j's 32 integer quants of the block at blk, in order. */
static inline void ai_sub_quants(int fmt, const uint8_t *blk, int j, int16_t *q) {
    switch (fmt) {
        case ASYNCINFER_FMT_Q4_0:
            for (int i = 0; i < 16; i++) {
                q[i] = (int16_t)((blk[2 + i] & 0x0F) - 8);
                q[i + 16] = (int16_t)((blk[2 + i] >> 4) - 8);
            }
            return;
        case ASYNCINFER_FMT_Q5_0:
        case ASYNCINFER_FMT_Q5_1: {
            const int min = fmt == ASYNCINFER_FMT_Q5_1;
            const uint8_t *qs = blk + (min ? 8 : 6);
            const uint32_t qh = ai_u32_at(blk + (min ? 4 : 2));
            const int offset = min ? 0 : 16;
            for (int i = 0; i < 16; i++) {
                q[i] = (int16_t)(((qs[i] & 0x0F) | ((qh >> i) & 1) << 4) - offset);
                q[i + 16] = (int16_t)(((qs[i] >> 4) | ((qh >> (i + 16)) & 1) << 4) - offset);
            }
            return;
        }
        case ASYNCINFER_FMT_Q4_K: {
            const uint8_t *qs = blk + 16 + 32 * (j >> 1);
            const int shift = 4 * (j & 1);
            for (int i = 0; i < 32; i++) q[i] = (int16_t)((qs[i] >> shift) & 0x0F);
            return;
        }
        case ASYNCINFER_FMT_Q5_K: {
            const uint8_t *qs = blk + 48 + 32 * (j >> 1), *qh = blk + 16;
            const int shift = 4 * (j & 1);
            for (int i = 0; i < 32; i++) q[i] = (int16_t)(((qs[i] >> shift) & 0x0F) | ((qh[i] >> j) & 1) << 4);
            return;
        }
        default: { /* Q6_K */
            const int n = j >> 2, k = j & 3;
            const uint8_t *ql = blk + 64 * n + 32 * (k & 1), *qh = blk + 128 + 32 * n;
            const int8_t *sc = (const int8_t *)(blk + 192) + 2 * j;
            for (int i = 0; i < 32; i++) {
                const int v = (((ql[i] >> (4 * (k >> 1))) & 0x0F) | ((qh[i] >> (2 * k)) & 3) << 4) - 32;
                q[i] = (int16_t)(sc[i >> 4] * v);
            }
            return;
        }
    }
}

/* One row of K weights in float32, in order: ggml's dequantized values (see above). The plain-C form; the
 * AVX2 builds take ai_rebuild_blocks_avx2's (the same values, each one rounding of an exact product plus the
 * min, or an exact product). */
__attribute__((unused)) static inline void ai_rebuild_blocks_ref(int fmt, const uint8_t *row, int64_t K, float *out) {
    const int subs = ai_fmt_subs(fmt);
    const int64_t nblk = K / ai_fmt_weights(fmt), bytes = ai_fmt_bytes(fmt);
    for (int64_t blk = 0; blk < nblk; blk++) {
        const uint8_t *p = row + blk * bytes;
        float scale[8], min[8];
        ai_block_scales(fmt, p, scale, min);
        for (int j = 0; j < subs; j++, out += 32) {
            int16_t q[32];
            ai_sub_quants(fmt, p, j, q);
            if (ai_fmt_has_min(fmt))
                for (int i = 0; i < 32; i++) out[i] = scale[j] * (float)q[i] + min[j];
            else
                for (int i = 0; i < 32; i++) out[i] = scale[j] * (float)q[i];
        }
    }
}

#ifdef AI_AVX2
/* ---- AVX2: a 32-weight block's quants (Q4_0, Q5_0, Q5_1) as 32 int8 in order, then widened to int16 in
 * the order the variant's activations are stored (gemm.c's acts); the k-quants have their own row kernels
 * (gemm.c's row_q45_k, row_q6_k) and rebuild (below). */

/* 16 bytes of nibbles: elements 0-15 the low nibbles, 16-31 the high ones. */
static inline __m256i ai_nibbles32(const uint8_t *qs) {
    const __m128i x = _mm_loadu_si128((const __m128i *)qs), low = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(x, 4), low), _mm_and_si128(x, low));
}

/* Byte i = 0x10 where bit i of bits is set, else 0. */
static inline __m256i ai_bits32(uint32_t bits) {
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i x = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), spread);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(x, bit), bit), _mm256_set1_epi8(0x10));
}

/* Each byte of x shifted right by n (< 8) and masked. */
static inline __m256i ai_shift_mask(__m256i x, int n, char mask) {
    return _mm256_and_si256(_mm256_srl_epi16(x, _mm_cvtsi32_si128(n)), _mm256_set1_epi8(mask));
}

static inline __m256i ai_sub_bytes(int fmt, const uint8_t *blk) {
    switch (fmt) {
        case ASYNCINFER_FMT_Q4_0:
            return _mm256_sub_epi8(ai_nibbles32(blk + 2), _mm256_set1_epi8(8));
        case ASYNCINFER_FMT_Q5_0:
            return _mm256_sub_epi8(_mm256_or_si256(ai_nibbles32(blk + 6), ai_bits32(ai_u32_at(blk + 2))),
                                   _mm256_set1_epi8(16));
        default: /* Q5_1 */
            return _mm256_or_si256(ai_nibbles32(blk + 8), ai_bits32(ai_u32_at(blk + 4)));
    }
}

/* The block's quants as int16: w[0], w[1] hold elements 0-15 and 16-31 in the AVX-512 build (whose
 * activations are in order), the even and the odd elements in the AVX2 build (quantize_acts_avx2's order). */
static inline void ai_sub_words(int fmt, const uint8_t *blk, __m256i w[2]) {
    const __m256i v = ai_sub_bytes(fmt, blk);
#ifdef AI_AVX512
    w[0] = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(v));
    w[1] = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(v, 1));
#else
    w[0] = _mm256_srai_epi16(_mm256_slli_epi16(v, 8), 8);
    w[1] = _mm256_srai_epi16(v, 8);
#endif
}

/* Q4_K / Q5_K: -(dmin * m_j) of the super-block at p (mn: its minimums, ai_k_scales8's), lane j sub-block j's. */
static inline __m256 ai_k_min_vector(const uint8_t *p, uint64_t mn) {
    const __m256 mnf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)mn)));
    return _mm256_mul_ps(mnf, _mm256_set1_ps(-ai_half_at(p + 2)));
}

/* Q4_K / Q5_K: d * sc_j (returned) and -(dmin * m_j) (*minv) of the super-block at p, lane j sub-block j's. */
static inline __m256 ai_k_scale_vectors(const uint8_t *p, __m256 *minv) {
    uint64_t sc, mn;
    ai_k_scales8(p + 4, &sc, &mn);
    const __m256 scf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)sc)));
    *minv = ai_k_min_vector(p, mn);
    return _mm256_mul_ps(scf, _mm256_set1_ps(ai_half_at(p)));
}

#ifdef AI_AVX512
/* The AVX-512 Q4_K rows' per-super-block terms for ROWS activation rows (row i's block scales dx at d + i * ld, its
 * blocks' float sums at sum + i * ld): dx * d * sc_j in lanes 0-7 of dsc[i], and -(dmin * m_j) times the sums added
 * to off[i]. */
static inline __attribute__((always_inline)) void ai_k_row_terms512(const uint8_t *p, const float *d, const float *sum,
                                                                   int64_t ld, const int ROWS, __m512 *dsc, __m256 *off) {
    __m256 minv;
    const __m256 scv = ai_k_scale_vectors(p, &minv);
    for (int i = 0; i < ROWS; i++) {
        dsc[i] = _mm512_castps256_ps512(_mm256_mul_ps(_mm256_loadu_ps(d + i * ld), scv));
        off[i] = _mm256_fmadd_ps(minv, _mm256_loadu_ps(sum + i * ld), off[i]);
    }
}
#endif

/* Q6_K: the 6-bit quants (0-63, uncentred) of sub-block j = 4 n + k of a super-block, as 32 bytes in order, from
 * its half n's 64 bytes of low nibbles L[0], L[1] (ql) and 32 bytes of high bit pairs H (qh): the low nibbles of
 * L[k & 1] for k < 2, its high nibbles after, and bit pair k of H above them. */
static inline __attribute__((always_inline)) __m256i ai_q6k_quants(const __m256i L[2], __m256i H, int k) {
    const __m256i lo = _mm256_and_si256(k < 2 ? L[k & 1] : _mm256_srli_epi16(L[k & 1], 4), _mm256_set1_epi8(0x0F));
    const __m256i hi = _mm256_and_si256(k < 2 ? _mm256_slli_epi16(H, 4 - 2 * k) : k == 2 ? H : _mm256_srli_epi16(H, 2),
                                        _mm256_set1_epi8(0x30));
    return _mm256_or_si256(lo, hi);
}

/* Lane j of the 8 floats v in every lane. */
static inline __m256 ai_lane(__m256 v, int j) { return _mm256_permutevar8x32_ps(v, _mm256_set1_epi32(j)); }

/* 8 bytes at p as 8 int32 (unsigned). */
static inline __m256i ai_u8x8(const uint8_t *p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }

/* ai_rebuild_blocks_ref's values, eight at a time. The k-quants: the super-block's eight scales (and Q4_K /
 * Q5_K's minimums) formed in one vector (ai_k_scales8; Q6_K: d times its sixteen int8 scales), the quants
 * widened from eight bytes at a time to 32-bit lanes (a byte's two nibbles: two sub-blocks', or Q6_K's two
 * quarters'); each weight one rounding of the exact scale * q plus the min, or the exact product. The 32-weight
 * formats: the block's quants (ai_sub_bytes, in order) to float32, times the scale, plus the min. */
static inline __attribute__((always_inline)) void ai_rebuild_blocks_avx2(int fmt, const uint8_t *row, int64_t K,
                                                                         float *out) {
    const int64_t nblk = K / ai_fmt_weights(fmt), bytes = ai_fmt_bytes(fmt);
    const __m256i low4 = _mm256_set1_epi32(0x0F);
    for (int64_t blk = 0; blk < nblk; blk++) {
        const uint8_t *p = row + blk * bytes;
        if (fmt == ASYNCINFER_FMT_Q4_K || fmt == ASYNCINFER_FMT_Q5_K) {
            __m256 mnv;
            const __m256 scv = ai_k_scale_vectors(p, &mnv);
            const int five = fmt == ASYNCINFER_FMT_Q5_K;
            const uint8_t *qs = p + (five ? 48 : 16), *qh = p + 16;
            for (int pr = 0; pr < 4; pr++) { /* sub-blocks 2 pr (low nibbles) and 2 pr + 1 (high) */
                const __m256 s0 = ai_lane(scv, 2 * pr), s1 = ai_lane(scv, 2 * pr + 1);
                const __m256 m0 = ai_lane(mnv, 2 * pr), m1 = ai_lane(mnv, 2 * pr + 1);
                float *o0 = out + 64 * pr, *o1 = o0 + 32;
                for (int h = 0; h < 4; h++) {
                    const __m256i v = ai_u8x8(qs + 32 * pr + 8 * h);
                    __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_srli_epi32(v, 4);
                    if (five) { /* bits 2 pr and 2 pr + 1 of qh: the fifth bits */
                        const __m256i b = _mm256_srl_epi32(ai_u8x8(qh + 8 * h), _mm_cvtsi32_si128(2 * pr));
                        lo = _mm256_or_si256(lo, _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(1)), 4));
                        hi = _mm256_or_si256(hi, _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(2)), 3));
                    }
                    _mm256_storeu_ps(o0 + 8 * h, _mm256_fmadd_ps(s0, _mm256_cvtepi32_ps(lo), m0));
                    _mm256_storeu_ps(o1 + 8 * h, _mm256_fmadd_ps(s1, _mm256_cvtepi32_ps(hi), m1));
                }
            }
            out += 256;
        } else if (fmt == ASYNCINFER_FMT_Q6_K) {
            const __m128i s16 = _mm_loadu_si128((const __m128i *)(p + 192));
            const __m256 d = _mm256_set1_ps(ai_half_at(p + 208)); /* d * sc exact (11 by 8 bits) */
            const __m256 hs[2] = {_mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s16))),
                                  _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(s16, 8))))};
            const __m256i centre = _mm256_set1_epi32(32), two = _mm256_set1_epi32(0x30);
            for (int n = 0; n < 2; n++) {
                for (int c = 0; c < 2; c++) { /* ql bytes 64 n + 32 c on: quarters k = c (low) and c + 2 (high) */
                    for (int h = 0; h < 4; h++) {
                        const __m256i v = ai_u8x8(p + 64 * n + 32 * c + 8 * h), hv = ai_u8x8(p + 128 + 32 * n + 8 * h);
                        const int klo = c, khi = c + 2; /* qh bits 2k, 2k + 1 to bits 4, 5 */
                        const __m256i qlo = _mm256_or_si256(_mm256_and_si256(v, low4),
                                                            _mm256_and_si256(_mm256_slli_epi32(hv, 4 - 2 * klo), two));
                        const __m256i qhi = _mm256_or_si256(_mm256_srli_epi32(v, 4),
                                                            _mm256_and_si256(_mm256_srl_epi32(hv, _mm_cvtsi32_si128(2 * khi - 4)), two));
                        const int jl = 4 * n + klo, jh = 4 * n + khi; /* sub-blocks; their half h >> 1 of 16 */
                        _mm256_storeu_ps(out + 32 * jl + 8 * h, _mm256_mul_ps(ai_lane(hs[n], (2 * jl + (h >> 1)) & 7),
                                                                              _mm256_cvtepi32_ps(_mm256_sub_epi32(qlo, centre))));
                        _mm256_storeu_ps(out + 32 * jh + 8 * h, _mm256_mul_ps(ai_lane(hs[n], (2 * jh + (h >> 1)) & 7),
                                                                              _mm256_cvtepi32_ps(_mm256_sub_epi32(qhi, centre))));
                    }
                }
            }
            out += 256;
        } else {
            float scale[8], min[8];
            ai_block_scales(fmt, p, scale, min);
            const __m256i v = ai_sub_bytes(fmt, p);
            const __m128i half[2] = {_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)};
            const __m256 sc = _mm256_set1_ps(scale[0]), mn = _mm256_set1_ps(min[0]);
            for (int h = 0; h < 4; h++, out += 8) { /* elements 8h to 8h + 7 */
                const __m128i b8 = (h & 1) ? _mm_srli_si128(half[h >> 1], 8) : half[h >> 1];
                const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b8));
                _mm256_storeu_ps(out, ai_fmt_has_min(fmt) ? _mm256_fmadd_ps(sc, q, mn) : _mm256_mul_ps(sc, q));
            }
        }
    }
}
#endif /* AI_AVX2 */

/* One row of K weights in float32, in order: ggml's dequantized values (see above); fmt a constant where the
 * caller inlines it, so each format gets its own loop. */
static inline __attribute__((always_inline)) void ai_rebuild_blocks(int fmt, const uint8_t *row, int64_t K, float *out) {
#ifdef AI_AVX2
    ai_rebuild_blocks_avx2(fmt, row, K, out);
#else
    ai_rebuild_blocks_ref(fmt, row, K, out);
#endif
}

#endif
