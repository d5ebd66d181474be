/* Trial layouts for Q4_0 (and, at the end, Q4_K) weights with int8 activations, measured by benchmarks/interleaved_trial.py against the
 * kernels' int8 rows and tile; not one of the engine's kernels.
 *
 * Layout: weight rows in groups of 16; per group and block of 32 weights, 288 bytes (16 blocks of 18, as many
 * bytes as ggml's): the 16 rows' float16 scales (32 bytes), then four runs of 64 bytes, run c holding bytes 4c to
 * 4c + 3 of each row's 16 bytes of nibbles, row r in 32-bit lane r. One 512-bit load is four quants of every row
 * (the low nibbles: elements 4c to 4c + 3; the high: 16 + 4c to 19 + 4c), so four consecutive int8 activations
 * broadcast to every lane make one vpdpbusd that adds each row's four products in its own lane: no horizontal
 * sum, the same instructions whatever the activation rows. Per activation row, 16 weight rows and block:
 *
 *   idot = sum(u * qx) - 8 * sum(qx);   acc = fma(float(idot), d_row * dx, acc)   (blocks in order from 0)
 *
 * the activations rounded as the kernels' int8 rows round them (a scale per 32, nearest even; Q4_K's per 256 on
 * the AVX-512 builds), so idot is the rows' integer and the result differs from theirs only in the order of float
 * additions; and a row's result is the same whatever the other activation rows of the call (the same operations in
 * the same order). Built with the AVX-512 flags where the CPU has them (VNNI's vpdpbusd, else the multiply-add
 * pair), else the plain C loop. */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define TRIAL_AVX512 1
#endif

#define QK 32
#define GROUP_BYTES 288

const char *trial_path(void) {
#if defined(TRIAL_AVX512) && defined(__AVX512VNNI__)
    return "avx512vnni";
#elif defined(TRIAL_AVX512)
    return "avx512";
#else
    return "scalar";
#endif
}

/* ggml's Q4_0 rows [N][K / 32][18 bytes] into the layout above; -2 unless N is a multiple of 16 and K of 32. */
int trial_pack(const uint8_t *ggml, uint8_t *out, int64_t N, int64_t K) {
    if (N % 16 || K % QK || N <= 0 || K <= 0) return -2;
    const int64_t nb = K / QK;
    for (int64_t g = 0; g < N / 16; g++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *o = out + (g * nb + b) * GROUP_BYTES;
            for (int r = 0; r < 16; r++) {
                const uint8_t *blk = ggml + ((g * 16 + r) * nb + b) * 18;
                memcpy(o + 2 * r, blk, 2);
                for (int c = 0; c < 4; c++) memcpy(o + 32 + 64 * c + 4 * r, blk + 2 + 4 * c, 4);
            }
        }
    return 0;
}

int64_t trial_scratch_bytes(int64_t M, int64_t K) { return M * K + M * (K / QK) * 8 + 64; }

/* The kernels' int8 rounding of activation row x (K values): q, each block's scale d and 8 * its sum of q (the
 * AVX-512 build 16 values at a time: the same maximum, scale and nearest-even integers; finite x). */
static void round_row(const float *x, int64_t K, int8_t *q, float *d, int32_t *cs) {
#ifdef TRIAL_AVX512
    for (int64_t b = 0; b < K / QK; b++) {
        const __m512 v0 = _mm512_loadu_ps(x + b * QK), v1 = _mm512_loadu_ps(x + b * QK + 16);
        const float absmax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        const float db = absmax / 127.0f, inv = db > 0.0f ? 127.0f / absmax : 0.0f;
        const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(inv)));
        const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(inv)));
        _mm_storeu_si128((__m128i *)(q + b * QK), _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(q + b * QK + 16), _mm512_cvtepi32_epi8(q1));
        d[b] = db;
        cs[b] = 8 * _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    }
    return;
#endif
    for (int64_t b = 0; b < K / QK; b++) {
        const float *xb = x + b * QK;
        float absmax = 0.0f, sum = 0.0f;
        for (int i = 0; i < QK; i++) {
            const float v = fabsf(xb[i]);
            absmax = v > absmax ? v : absmax;
            sum += xb[i];
        }
        const float db = isfinite(sum) && isfinite(absmax) ? absmax / 127.0f : NAN;
        const float inv = db > 0.0f ? 127.0f / absmax : 0.0f;
        int s = 0;
        for (int i = 0; i < QK; i++) {
            q[b * QK + i] = db > 0.0f ? (int8_t)lrintf(xb[i] * inv) : 0;
            s += q[b * QK + i];
        }
        d[b] = db;
        cs[b] = 8 * s;
    }
}

#ifndef TRIAL_AVX512 /* the plain C loops' float16 */
static float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h >> 15) << 31, e = (h >> 10) & 31, m = h & 1023;
    uint32_t bits;
    if (e == 0) {
        if (!m) bits = sign;
        else {
            float v = ldexpf((float)m, -24);
            memcpy(&bits, &v, 4);
            bits |= sign;
        }
    } else if (e == 31) bits = sign | 0x7F800000u | (m << 13);
    else bits = sign | ((e + 112) << 23) | (m << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
#endif

#ifdef TRIAL_AVX512
static inline __m512i dpbusd(__m512i acc, __m512i u, __m512i x) {
#ifdef __AVX512VNNI__
    return _mm512_dpbusd_epi32(acc, u, x);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, x), _mm512_set1_epi16(1)));
#endif
}

/* Activation rows [m0, m0 + R) against one group of 16 weight rows (p: its blocks), into y's 16 columns. */
static inline __attribute__((always_inline)) void group_rows(const uint8_t *p, int64_t K, const int8_t *q,
                                                             const float *d, const int32_t *cs, int64_t m0, const int R,
                                                             float *y, int64_t ldy) {
    const int64_t nb = K / QK;
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 acc[8];
    for (int i = 0; i < R; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *o = p + b * GROUP_BYTES;
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)o));
        __m512i lo[4], hi[4];
        for (int c = 0; c < 4; c++) {
            const __m512i v = _mm512_loadu_si512(o + 32 + 64 * c);
            lo[c] = _mm512_and_si512(v, low);
#ifdef __AVX512VNNI__ /* 16 times the high nibble, its sums shifted back (exact): vpdpbusd does not saturate */
            hi[c] = _mm512_andnot_si512(low, v);
#else
            hi[c] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
#endif
        }
        for (int i = 0; i < R; i++) {
            const int64_t m = m0 + i;
            int32_t x[8];
            memcpy(x, q + m * K + b * QK, 32);
            __m512i s0 = dpbusd(_mm512_setzero_si512(), lo[0], _mm512_set1_epi32(x[0]));
            __m512i s1 = dpbusd(_mm512_setzero_si512(), hi[0], _mm512_set1_epi32(x[4]));
            for (int c = 1; c < 4; c++) {
                s0 = dpbusd(s0, lo[c], _mm512_set1_epi32(x[c]));
                s1 = dpbusd(s1, hi[c], _mm512_set1_epi32(x[4 + c]));
            }
#ifdef __AVX512VNNI__
            s1 = _mm512_srai_epi32(s1, 4);
#endif
            const __m512i idot = _mm512_sub_epi32(_mm512_add_epi32(s0, s1), _mm512_set1_epi32(cs[m * nb + b]));
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(idot), _mm512_mul_ps(dw, _mm512_set1_ps(d[m * nb + b])), acc[i]);
        }
    }
    for (int i = 0; i < R; i++) _mm512_storeu_ps(y + (m0 + i) * ldy, acc[i]);
}
#else
static void group_rows(const uint8_t *p, int64_t K, const int8_t *q, const float *d, const int32_t *cs, int64_t m0,
                       int R, float *y, int64_t ldy) {
    const int64_t nb = K / QK;
    for (int i = 0; i < R; i++) {
        const int64_t m = m0 + i;
        float acc[16] = {0};
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *o = p + b * GROUP_BYTES;
            for (int r = 0; r < 16; r++) {
                int32_t idot = -cs[m * nb + b];
                for (int c = 0; c < 4; c++)
                    for (int j = 0; j < 4; j++) {
                        const uint8_t byte = o[32 + 64 * c + 4 * r + j];
                        idot += (byte & 15) * q[m * K + b * QK + 4 * c + j] + (byte >> 4) * q[m * K + b * QK + 16 + 4 * c + j];
                    }
                uint16_t h;
                memcpy(&h, o + 2 * r, 2);
                acc[r] = fmaf((float)idot, half_to_float(h) * d[m * nb + b], acc[r]);
            }
        }
        memcpy(y + m * ldy, acc, sizeof(acc));
    }
}
#endif

/* y[M, N] = x[M, K] (rows rounded to int8 per block of 32) times the packed weights' rows; 0, or -2 for a shape the
 * layout cannot hold. */
int trial_gemm(const float *x, int64_t M, int64_t K, const uint8_t *p, int64_t N, float *y, int threads,
               void *scratch) {
    if (N % 16 || K % QK || N <= 0 || K <= 0 || M <= 0) return -2;
    const int64_t nb = K / QK;
    int8_t *q = (int8_t *)scratch;
    float *d = (float *)(q + M * K + (64 - (M * K) % 64) % 64);
    int32_t *cs = (int32_t *)(d + M * nb);
#pragma omp parallel for schedule(static) num_threads(threads) if(threads > 1 && M > 1)
    for (int64_t m = 0; m < M; m++) round_row(x + m * K, K, q + m * K, d + m * nb, cs + m * nb);
    (void)threads;
#pragma omp parallel for schedule(static) num_threads(threads) if(threads > 1)
    for (int64_t g = 0; g < N / 16; g++) {
        const uint8_t *pg = p + g * nb * GROUP_BYTES;
        int64_t m = 0;
        for (; m + 8 <= M; m += 8) group_rows(pg, K, q, d, cs, m, 8, y + g * 16, N);
        switch (M - m) {
            case 7: group_rows(pg, K, q, d, cs, m, 7, y + g * 16, N); break;
            case 6: group_rows(pg, K, q, d, cs, m, 6, y + g * 16, N); break;
            case 5: group_rows(pg, K, q, d, cs, m, 5, y + g * 16, N); break;
            case 4: group_rows(pg, K, q, d, cs, m, 4, y + g * 16, N); break;
            case 3: group_rows(pg, K, q, d, cs, m, 3, y + g * 16, N); break;
            case 2: group_rows(pg, K, q, d, cs, m, 2, y + g * 16, N); break;
            case 1: group_rows(pg, K, q, d, cs, m, 1, y + g * 16, N); break;
            default: break;
        }
    }
    return 0;
}

/* ---- Q4_K in the same kind of layout. Per group of 16 weight rows and super-block of 256 weights, 2368 bytes
 * (ggml's 16 blocks take 2304: the 6-bit scales and minimums are stored unpacked, a byte each): the rows' float16
 * d (32 bytes) and dmin (32), each sub-block's 16 scales (8 x 16 bytes) and 16 minimums (8 x 16), then per pair of
 * sub-blocks (2p, 2p + 1; ggml's bytes 32p to 32p + 31 of a row: low nibbles sub-block 2p, high 2p + 1) eight runs
 * of 64 bytes, run c holding bytes 4c to 4c + 3 of the pair's 32 of each row, row r in lane r. Per activation row,
 * 16 weight rows and sub-block j, as the kernels' int8 rows define it (dx_j one per 256 on the AVX-512 builds,
 * round_row_k; the rows there sum a super-block's integers before one float multiply, another order of sums):
 *
 *   acc = fma(float(idot_j), dx_j * (d * sc_j), acc);   acc = fma(-(dmin * mn_j), sum(x_j), acc)
 */
#define KGROUP_BYTES 2368

static void k_scales(const uint8_t *s, uint8_t *sc, uint8_t *mn) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (uint8_t)((s[j + 8] & 15) | ((s[j] >> 6) << 4));
        mn[j + 4] = (uint8_t)((s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4));
    }
}

int trial_pack_q4_k(const uint8_t *ggml, uint8_t *out, int64_t N, int64_t K) {
    if (N % 16 || K % 256 || N <= 0 || K <= 0) return -2;
    const int64_t nb = K / 256;
    for (int64_t g = 0; g < N / 16; g++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *o = out + (g * nb + b) * KGROUP_BYTES;
            for (int r = 0; r < 16; r++) {
                const uint8_t *blk = ggml + ((g * 16 + r) * nb + b) * 144;
                uint8_t sc[8], mn[8];
                memcpy(o + 2 * r, blk, 2);
                memcpy(o + 32 + 2 * r, blk + 2, 2);
                k_scales(blk + 4, sc, mn);
                for (int j = 0; j < 8; j++) {
                    o[64 + 16 * j + r] = sc[j];
                    o[192 + 16 * j + r] = mn[j];
                }
                for (int pair = 0; pair < 4; pair++)
                    for (int c = 0; c < 8; c++)
                        memcpy(o + 320 + 512 * pair + 64 * c + 4 * r, blk + 16 + 32 * pair + 4 * c, 4);
            }
        }
    return 0;
}

int64_t trial_scratch_bytes_q4_k(int64_t M, int64_t K) { return M * K + M * (K / QK) * 8 + 64; }

/* The kernels' int8 rounding for Q4_K, with each block's float32 sum (the minimums' term): on the AVX-512 builds one
 * scale per 256, in each of its eight blocks' d, as their rows and tile round the k-quants (finite x); elsewhere per
 * 32, as round_row. */
static void round_row_k(const float *x, int64_t K, int8_t *q, float *d, float *sum) {
    for (int64_t b = 0; b < K / QK; b++) {
        float t = 0.0f;
        for (int i = 0; i < QK; i++) t += x[b * QK + i];
        sum[b] = t;
    }
#ifdef TRIAL_AVX512
    for (int64_t s = 0; s < K / 256; s++) {
        const float *xs = x + 256 * s;
        float absmax = 0.0f;
        for (int i = 0; i < 256; i++) absmax = fabsf(xs[i]) > absmax ? fabsf(xs[i]) : absmax;
        const float db = absmax / 127.0f, inv = db > 0.0f ? 127.0f / absmax : 0.0f;
        for (int i = 0; i < 256; i++) q[256 * s + i] = (int8_t)lrintf(xs[i] * inv);
        for (int j = 0; j < 8; j++) d[8 * s + j] = db;
    }
#else
    for (int64_t b = 0; b < K / QK; b++) {
        int32_t cs;
        round_row(x + b * QK, QK, q + b * QK, d + b, &cs);
    }
#endif
}

#ifdef TRIAL_AVX512
static inline __attribute__((always_inline)) void group_rows_k(const uint8_t *p, int64_t K, const int8_t *q,
                                                               const float *d, const float *sum, int64_t m0,
                                                               const int R, float *y, int64_t ldy) {
    const int64_t nb = K / 256, ns = K / QK;
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 acc[4];
    for (int i = 0; i < R; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *o = p + b * KGROUP_BYTES;
        const __m512 dd = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)o));
        const __m512 dm = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(o + 32)));
        for (int pair = 0; pair < 4; pair++) {
            __m512i u[2][8];
            for (int c = 0; c < 8; c++) {
                const __m512i v = _mm512_loadu_si512(o + 320 + 512 * pair + 64 * c);
                u[0][c] = _mm512_and_si512(v, low);
#ifdef __AVX512VNNI__
                u[1][c] = _mm512_andnot_si512(low, v);
#else
                u[1][c] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
#endif
            }
            for (int h = 0; h < 2; h++) {
                const int j = 2 * pair + h;
                const __m512 scale = _mm512_mul_ps(dd, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                                           _mm_loadu_si128((const __m128i *)(o + 64 + 16 * j)))));
                const __m512 nmin = _mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), dm), _mm512_cvtepi32_ps(
                                                      _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(o + 192 + 16 * j)))));
                for (int i = 0; i < R; i++) {
                    const int64_t m = m0 + i, at = m * ns + b * 8 + j;
                    int32_t x[8];
                    memcpy(x, q + m * K + b * 256 + 32 * j, 32);
                    __m512i s0 = dpbusd(_mm512_setzero_si512(), u[h][0], _mm512_set1_epi32(x[0]));
                    __m512i s1 = dpbusd(_mm512_setzero_si512(), u[h][1], _mm512_set1_epi32(x[1]));
                    for (int c = 2; c < 8; c += 2) {
                        s0 = dpbusd(s0, u[h][c], _mm512_set1_epi32(x[c]));
                        s1 = dpbusd(s1, u[h][c + 1], _mm512_set1_epi32(x[c + 1]));
                    }
                    __m512i idot = _mm512_add_epi32(s0, s1);
#ifdef __AVX512VNNI__
                    if (h) idot = _mm512_srai_epi32(idot, 4);
#endif
                    acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(idot), _mm512_mul_ps(scale, _mm512_set1_ps(d[at])), acc[i]);
                    acc[i] = _mm512_fmadd_ps(nmin, _mm512_set1_ps(sum[at]), acc[i]);
                }
            }
        }
    }
    for (int i = 0; i < R; i++) _mm512_storeu_ps(y + (m0 + i) * ldy, acc[i]);
}
#else
static void group_rows_k(const uint8_t *p, int64_t K, const int8_t *q, const float *d, const float *sum, int64_t m0,
                         int R, float *y, int64_t ldy) {
    const int64_t nb = K / 256, ns = K / QK;
    for (int i = 0; i < R; i++) {
        const int64_t m = m0 + i;
        float acc[16] = {0};
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *o = p + b * KGROUP_BYTES;
            for (int r = 0; r < 16; r++) {
                uint16_t h0, h1;
                memcpy(&h0, o + 2 * r, 2);
                memcpy(&h1, o + 32 + 2 * r, 2);
                const float dr = half_to_float(h0), dmr = half_to_float(h1);
                for (int j = 0; j < 8; j++) {
                    const int pair = j / 2, h = j % 2;
                    int32_t idot = 0;
                    for (int c = 0; c < 8; c++)
                        for (int t = 0; t < 4; t++) {
                            const uint8_t byte = o[320 + 512 * pair + 64 * c + 4 * r + t];
                            idot += (h ? byte >> 4 : byte & 15) * q[m * K + b * 256 + 32 * j + 4 * c + t];
                        }
                    const int64_t at = m * ns + b * 8 + j;
                    acc[r] = fmaf((float)idot, (dr * (float)o[64 + 16 * j + r]) * d[at], acc[r]);
                    acc[r] = fmaf(-(dmr * (float)o[192 + 16 * j + r]), sum[at], acc[r]);
                }
            }
        }
        memcpy(y + m * ldy, acc, sizeof(acc));
    }
}
#endif

int trial_gemm_q4_k(const float *x, int64_t M, int64_t K, const uint8_t *p, int64_t N, float *y, int threads,
                    void *scratch) {
    if (N % 16 || K % 256 || N <= 0 || K <= 0 || M <= 0) return -2;
    const int64_t nb = K / 256, ns = K / QK;
    int8_t *q = (int8_t *)scratch;
    float *d = (float *)(q + M * K + (64 - (M * K) % 64) % 64);
    float *sum = d + M * ns;
#pragma omp parallel for schedule(static) num_threads(threads) if(threads > 1 && M > 1)
    for (int64_t m = 0; m < M; m++) round_row_k(x + m * K, K, q + m * K, d + m * ns, sum + m * ns);
    (void)threads;
#pragma omp parallel for schedule(static) num_threads(threads) if(threads > 1)
    for (int64_t g = 0; g < N / 16; g++) {
        const uint8_t *pg = p + g * nb * KGROUP_BYTES;
        int64_t m = 0;
        for (; m + 4 <= M; m += 4) group_rows_k(pg, K, q, d, sum, m, 4, y + g * 16, N);
        switch (M - m) {
            case 3: group_rows_k(pg, K, q, d, sum, m, 3, y + g * 16, N); break;
            case 2: group_rows_k(pg, K, q, d, sum, m, 2, y + g * 16, N); break;
            case 1: group_rows_k(pg, K, q, d, sum, m, 1, y + g * 16, N); break;
            default: break;
        }
    }
    return 0;
}
