/* What the kernels' sources share and do not export: the variant being built, block constants, float16
 * conversion, overflow-safe sizes and the internal entry points between files.
 *
 * Variants: every source is built once per ISA; the compiler's flags pick the code.
 *   AI_VNNI:   AVX-512 VNNI on top of AI_AVX512: the integer dot products of the GEMM's rows fuse their
 *              multiply and add (vpdpbusd, vpdpwssd); the same integers, so the same results as AI_AVX512
 *   AI_AVX512: AVX-512 F/BW/VL (+ AVX2, FMA, F16C): 512-bit hot loops of the GEMM, AVX2 elsewhere
 *   AI_AVX2:   AVX2 + FMA + F16C
 *   neither:   the scalar reference, plain C, every machine
 */
#ifndef ASYNCINFER_INTERNAL_H
#define ASYNCINFER_INTERNAL_H

#include "asyncinfer_kernels.h"

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(ASYNCINFER_FORCE_SCALAR)
#define AI_AVX2 1
#include <immintrin.h>
#if defined(ASYNCINFER_EMULATE_AVX512)
/* ---- Test builds only (tests/models/test_kernel_variants.py; never set by setup.py or _build.py): the
 * AVX-512 variant's code built with the AVX2 flags, its 512-bit intrinsics emulated by SIMDe's headers
 * (libsimde-dev), so that machines without AVX-512 execute and test that code path. */
#if defined(__AVX512F__)
#error "ASYNCINFER_EMULATE_AVX512 is for builds without -mavx512f"
#endif
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#undef I /* SIMDe includes <complex.h>, whose I and complex macros the sources do not use */
#undef complex
/* SIMDe 0.7.x: its alias of _mm512_madd_epi16 takes four arguments (the masked form's) */
#undef _mm512_madd_epi16
#define _mm512_madd_epi16(a, b) simde_mm512_madd_epi16(a, b)
/* SIMDe 0.7.x has no _mm512_cvtepi32_ps nor _mm512_reduce_add_ps: lane by lane (int to float rounds to
 * nearest even, as the instruction does under the default MXCSR), and the sum in the tree order of GCC's
 * _mm512_reduce_add_ps (upper 256 + lower 256 bits, then the 128-bit halves, then pairs). */
static inline __m512 ai_emulated_cvtepi32_ps(__m512i v) {
    int32_t in[16];
    float out[16];
    _mm512_storeu_si512(in, v);
    for (int i = 0; i < 16; i++) out[i] = (float)in[i];
    return _mm512_loadu_ps(out);
}
static inline float ai_emulated_reduce_add_ps(__m512 v) {
    float x[16], h[8], q[4];
    _mm512_storeu_ps(x, v);
    for (int i = 0; i < 8; i++) h[i] = x[i] + x[8 + i];
    for (int i = 0; i < 4; i++) q[i] = h[i] + h[4 + i];
    return (q[0] + q[2]) + (q[1] + q[3]);
}
/* ... nor _mm512_cvtepi8_epi32 / _mm512_cvtepi32_epi16 (gemm.c's bfloat16 rows): lane by lane, sign-extended and
 * truncated as the instructions do. */
static inline __m512i ai_emulated_cvtepi8_epi32(__m128i v) {
    int8_t in[16];
    int32_t out[16];
    _mm_storeu_si128((__m128i *)in, v);
    for (int i = 0; i < 16; i++) out[i] = in[i];
    return _mm512_loadu_si512(out);
}
static inline __m256i ai_emulated_cvtepi32_epi16(__m512i v) {
    int32_t in[16];
    int16_t out[16];
    _mm512_storeu_si512(in, v);
    for (int i = 0; i < 16; i++) out[i] = (int16_t)in[i];
    return _mm256_loadu_si256((const __m256i *)out);
}
/* ... nor _mm512_cvtepu8_epi16 (gemm.c's 4-bit pairs): lane by lane, zero-extended. */
static inline __m512i ai_emulated_cvtepu8_epi16(__m256i v) {
    uint8_t in[32];
    int16_t out[32];
    _mm256_storeu_si256((__m256i *)in, v);
    for (int i = 0; i < 32; i++) out[i] = in[i];
    return _mm512_loadu_si512(out);
}
#define _mm512_cvtepi32_ps(v) ai_emulated_cvtepi32_ps(v)
#define _mm512_cvtepu8_epi16(v) ai_emulated_cvtepu8_epi16(v)
#define _mm512_reduce_add_ps(v) ai_emulated_reduce_add_ps(v)
#define _mm512_cvtepi8_epi32(v) ai_emulated_cvtepi8_epi32(v)
#define _mm512_cvtepi32_epi16(v) ai_emulated_cvtepi32_epi16(v)
#define AI_AVX512 1
#if defined(ASYNCINFER_EMULATE_VNNI) /* and the VNNI variant's code, through SIMDe's vpdpbusd / vpdpwssd */
#define AI_VNNI 1
#define AI_ISA ASYNCINFER_ISA_AVX512VNNI
#else
#define AI_ISA ASYNCINFER_ISA_AVX512
#endif
/* ---- end of the test-only emulation */
#elif defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define AI_AVX512 1
#if defined(__AVX512VNNI__)
#define AI_VNNI 1
#define AI_ISA ASYNCINFER_ISA_AVX512VNNI
#else
#define AI_ISA ASYNCINFER_ISA_AVX512
#endif
#else
#define AI_ISA ASYNCINFER_ISA_AVX2
#endif
#else
#define AI_ISA ASYNCINFER_ISA_SCALAR
#endif

#ifdef _OPENMP
#include <omp.h>
static inline int ai_thread_num(void) { return omp_get_thread_num(); }
#else
static inline int ai_thread_num(void) { return 0; }
#endif

#define AI_HIDDEN __attribute__((visibility("hidden")))

/* How far ahead of the weights a row kernel asks for them (_mm_prefetch), in bytes; a thread's weight rows are
 * contiguous. At 1,024 one-row GEMMs waited on memory: on a 2-core AMD EPYC (Zen 5) virtual machine, 8,192 made
 * them 1.10-1.32x faster with int8 activations and 1.05-1.33x with int16 (the median per format over a 1B layer's
 * weights, too many to stay in cache); 32 rows, bound by arithmetic, 0.98-1.04x (docs/formats.md, "Prefetch
 * distance"). The address runs over a row's whole bytes, its runs of scales included: Q4_1 / Q8_0 rows hold their
 * scales ahead of their quants, and a prefetch that followed the quants alone left those lines to be waited for
 * (docs/formats.md, "The whole row, scales included"). */
#ifndef AI_PREFETCH_BYTES
#define AI_PREFETCH_BYTES 8192
#endif
#ifdef AI_AVX2
/* The prefetch of the `bytes` bytes a step reads at p (a k-quant super-block: 144 Q4_K, 176 Q5_K, 210 Q6_K; a run
 * of blocks of the 32-weight formats): each of its 64-byte lines, AI_PREFETCH_BYTES ahead, so that a step of more
 * than 64 bytes skips none. `bytes` is a constant at every call, so the loop unrolls. */
static inline __attribute__((always_inline)) void ai_prefetch_lines(const uint8_t *p, const int bytes) {
    for (int line = 0; line < bytes; line += 64) _mm_prefetch((const char *)p + AI_PREFETCH_BYTES + line, _MM_HINT_T0);
}

/* The same into the L2 cache (the T1 hint), where the L1's fill buffers would otherwise bound the lines in flight:
 * the AVX-512 int8 rows (the k-quants' super-blocks, Q4_0 / Q4_1's quads, Q8_0's pairs), whose loads find them
 * there. */
static inline __attribute__((always_inline)) void ai_prefetch_lines_l2(const uint8_t *p, const int bytes) {
    for (int line = 0; line < bytes; line += 64) _mm_prefetch((const char *)p + AI_PREFETCH_BYTES + line, _MM_HINT_T1);
}
#endif

#define QK 32
#define PANEL_MIN_ROWS ASYNCINFER_PANEL_MIN_ROWS

/* IEEE half to float, exactly (every half is a float). */
static inline float ai_half_to_float(uint16_t h) {
#ifdef AI_AVX2
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    uint32_t bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000u | (man << 13); /* inf, NaN */
    } else if (exp) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (!man) {
        bits = sign;
    } else { /* subnormal: man * 2^-24, exact in float */
        const float f = (float)man * 5.9604644775390625e-8f;
        memcpy(&bits, &f, 4);
        bits |= sign;
    }
    float out;
    memcpy(&out, &bits, 4);
    return out;
#endif
}

/* a * b into *out; 0 if it would overflow or either is negative. */
static inline int ai_mul(int64_t a, int64_t b, int64_t *out) {
    return a >= 0 && b >= 0 && !__builtin_mul_overflow(a, b, out);
}

static inline int ai_add(int64_t a, int64_t b, int64_t *out) {
    return a >= 0 && b >= 0 && !__builtin_add_overflow(a, b, out);
}

/* malloc of n elements of size bytes, NULL when that overflows (or n is negative) or memory is short. */
static inline void *ai_alloc(int64_t n, int64_t size) {
    int64_t bytes;
    if (!ai_mul(n > 0 ? n : 1, size, &bytes) || (uint64_t)bytes > (uint64_t)SIZE_MAX) return NULL;
    return malloc((size_t)bytes);
}

typedef int (*gemm_fn)(const float *, int64_t, int64_t, int64_t, const void *, int64_t, const float *, float *,
                       int64_t, int, void *);

/* Internal entry points (hidden: each variant's library calls its own). */
AI_HIDDEN int ai_gemm_q4_1(const float *x, int64_t M, int64_t ldx, int64_t K, const void *w, int64_t N,
                           const float *bias, float *y, int64_t ldy, int threads, void *scratch);
AI_HIDDEN int ai_gemm_q8_0(const float *x, int64_t M, int64_t ldx, int64_t K, const void *w, int64_t N,
                           const float *bias, float *y, int64_t ldy, int threads, void *scratch);
/* The GEMM of a format code (ASYNCINFER_FMT_*, with ASYNCINFER_FMT_ACT8 the int8-activation one, with ACT8 and
 * ASYNCINFER_FMT_TILE8 a step's for M rows: ai_step8_of), NULL for a code outside them. */
AI_HIDDEN gemm_fn ai_gemm_of(int fmt, int64_t M);
/* The int8-activation GEMM of a format (gemm8.c; fmt without ASYNCINFER_FMT_ACT8), NULL outside the table. */
AI_HIDDEN gemm_fn ai_gemm8_of(int fmt);
/* A step's int8-activation GEMM of a plain block format for M rows (gemm8.c; fmt without ASYNCINFER_FMT_ACT8 and
 * TILE8): the tile from ASYNCINFER_STEP_TILE_MIN_ROWS rows on (AVX-512 builds), the rows below it and elsewhere. */
AI_HIDDEN gemm_fn ai_step8_of(int fmt, int64_t M);
/* Q4_0 / Q4_1 in lanes with int8 activations (gemm8.c; ASYNCINFER_FMT_LANES16): the GEMM of such a code, its
 * own, or with ASYNCINFER_FMT_TILE8 the tile over the lanes from 32 rows on (AVX-512 builds; the same results);
 * NULL for any other code. */
AI_HIDDEN gemm_fn ai_lanes_of(int fmt);
AI_HIDDEN int64_t ai_scratch_bytes(int64_t M, int64_t K);
#ifdef AI_AVX512
/* gemm.c's int16 rounding of activation rows (x [M, K] at stride ldx): q [M, K] in order, d and sum [M, K / 32]. */
AI_HIDDEN void ai_quantize_acts16(const float *x, int64_t M, int64_t ldx, int64_t K, int16_t *q, float *d, float *sum);
/* The int16 tile (gemm8.c): the int16 GEMM of a block format (fmt without ASYNCINFER_FMT_ACT8) at any row count. */
AI_HIDDEN int ai_tile16_gemm(int fmt, const float *x, int64_t M, int64_t ldx, int64_t K, const void *w, int64_t N,
                             const float *bias, float *y, int64_t ldy, int threads);
#endif
AI_HIDDEN void ai_rms_norm(const float *x, int64_t T, int64_t ldx, int64_t H, const float *w, float eps, float *y,
                           int threads);
AI_HIDDEN int ai_decode_attention(const float *q, const float *k_cache, const float *v_cache, const int64_t *tables,
                                  int64_t ldt, const int64_t *ctx, int64_t S, int64_t H, int64_t KVH, int64_t D,
                                  int64_t BS, float scale, float softcap, int64_t window, float *out, int threads);
AI_HIDDEN void ai_argmax(const float *x, int64_t rows, int64_t n, int64_t ldx, int64_t *out);
AI_HIDDEN int ai_check_paged(const int64_t *tables, int64_t ldt, const int64_t *ctx, const int64_t *slots, int64_t S,
                             int64_t BS, int64_t num_blocks);
/* The embedding table's rows (asyncinfer_embed_rows without its checks: E checked by ai_embed_check, the ids
 * within [0, E->vocab)). */
AI_HIDDEN void ai_embed_rows(const embed_t *E, const int64_t *ids, int64_t T, int64_t hidden, float *out, int64_t ldo);
/* 0 when the kernels can read rows of hidden values from E (its format code, its row bytes), else -2. */
AI_HIDDEN int ai_embed_check(const embed_t *E, int64_t hidden);
/* silu(g) * u over n values (SwiGLU), the variant's exp. */
AI_HIDDEN void ai_swiglu(const float *g, const float *u, float *out, int64_t n);
/* gelu_tanh(g) * u over n values (GeGLU): 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), float32. */
AI_HIDDEN void ai_geglu(const float *g, const float *u, float *out, int64_t n);
/* x[i] = cap * tanh(x[i] / cap) over n values (soft-capping); returns the largest result (-inf for n = 0). */
AI_HIDDEN float ai_softcap(float *x, int64_t n, float cap);

/* A run of 32 activations xb about to be rounded to integers within +-qmax (32767: int16, 127: int8): its float32
 * sum in order, its scale (the largest |x| / qmax; NaN where a value is NaN or infinite, so the result is NaN
 * too) and that scale's inverse (0 for a run of zeros or a NaN scale), the plain-C way (the scalar references'). */
static inline void ai_run_scale_ref(const float *xb, float qmax, float *d, float *inv, float *total) {
    float absmax = 0.0f, sum = 0.0f;
    for (int i = 0; i < 32; i++) {
        const float v = fabsf(xb[i]);
        absmax = v > absmax ? v : absmax; /* drops NaNs; the sum keeps them */
        sum += xb[i];
    }
    *d = isfinite(sum) && isfinite(absmax) ? absmax / qmax : NAN;
    *inv = *d > 0.0f ? qmax / absmax : 0.0f;
    *total = sum;
}

#ifdef AI_AVX2
/* Integer dot products added to acc, lane by lane: ai_dpbusd* the sums of four products of unsigned bytes u
 * with signed bytes x (the callers keep each pair's sum within int16, where maddubs would saturate), ai_dpwssd256
 * the sums of two products of int16 words (int32 arithmetic, wrapping as madd + add). VNNI's fused instruction,
 * else the multiply-add pair and an add: the same integers either way. */
static inline __m256i ai_dpbusd256(__m256i acc, __m256i u, __m256i x) {
#ifdef AI_VNNI
    return _mm256_dpbusd_epi32(acc, u, x);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1)));
#endif
}

static inline __m256i ai_dpwssd256(__m256i acc, __m256i w, __m256i x) {
#ifdef AI_VNNI
    return _mm256_dpwssd_epi32(acc, w, x);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(w, x));
#endif
}

#ifdef AI_AVX512
static inline __m512i ai_dpbusd512(__m512i acc, __m512i u, __m512i x) {
#ifdef AI_VNNI
    return _mm512_dpbusd_epi32(acc, u, x);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, x), _mm512_set1_epi16(1)));
#endif
}

static inline __m512i ai_dpwssd512(__m512i acc, __m512i w, __m512i x) {
#ifdef AI_VNNI
    return _mm512_dpwssd_epi32(acc, w, x);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(w, x));
#endif
}
#endif

static inline float ai_hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* A run of 32 floats' statistics eight lanes at a time: the lanes' largest |x| (each lane's of its four values) and
 * the run's float32 sum (added in another order than ai_run_scale_ref's: (x0-7 + x8-15) + (x16-23 + x24-31)). The max
 * may drop a NaN (maxps returns its second operand where either is NaN); the sum keeps it. */
static inline __m256 ai_run_stats(const float *xb, float *total) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256 v0 = _mm256_loadu_ps(xb), v1 = _mm256_loadu_ps(xb + 8), v2 = _mm256_loadu_ps(xb + 16),
                 v3 = _mm256_loadu_ps(xb + 24);
    *total = ai_hsum256(_mm256_add_ps(_mm256_add_ps(v0, v1), _mm256_add_ps(v2, v3)));
    return _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                         _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
}

/* The largest of 8 lanes. */
static inline float ai_hmax256(__m256 v) {
    __m128 mx = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    mx = _mm_max_ps(mx, _mm_movehl_ps(mx, mx));
    mx = _mm_max_ss(mx, _mm_movehdup_ps(mx));
    return _mm_cvtss_f32(mx);
}

/* 32 floats at xb times inv rounded to int32 in q[0..3] (elements 0-7, 8-15, ...; nearest even, as lrintf). */
static inline void ai_round_values(const float *xb, __m256 inv, __m256i q[4]) {
    for (int k = 0; k < 4; k++) q[k] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + 8 * k), inv));
}

/* ai_run_scale_ref's scale and sum eight lanes at a time (ai_run_stats), and the run rounded to int32 in q[0..3]
 * (ai_round_values: the same integers as the reference). A NaN rounds to a value the NaN scale makes irrelevant. */
static inline float ai_round_run(const float *xb, float qmax, __m256i q[4], float *total) {
    const float absmax = ai_hmax256(ai_run_stats(xb, total));
    const float d = isfinite(*total) && isfinite(absmax) ? absmax / qmax : NAN;
    ai_round_values(xb, _mm256_set1_ps(d > 0.0f ? qmax / absmax : 0.0f), q); /* NaN d: zeros */
    return d;
}

/* e^x for 8 floats, within 2 ulp (Cody-Waite range reduction, Cephes' degree-5 polynomial); x is
 * clamped to [-87.3, 88.3], where the result stays a normal float. */
static inline __m256 ai_exp256(__m256 x) {
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

/* tanh of 8 floats, within 5 ulp: an odd Taylor polynomial (to x^9) below |x| = 0.25, where
 * (1 - e) / (1 + e), e = e^-2|x|, would lose bits to cancellation, that quotient above (1 from |x| = 9
 * on, as e underflows the float's precision), the sign put back. NaN stays NaN. */
static inline __m256 ai_tanh256(__m256 x) {
    const __m256 sign = _mm256_and_ps(x, _mm256_set1_ps(-0.0f));
    const __m256 a = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x);
    const __m256 e = ai_exp256(_mm256_mul_ps(a, _mm256_set1_ps(-2.0f)));
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 big = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
    const __m256 a2 = _mm256_mul_ps(a, a);
    __m256 p = _mm256_set1_ps(62.0f / 2835.0f);
    p = _mm256_fmadd_ps(p, a2, _mm256_set1_ps(-17.0f / 315.0f));
    p = _mm256_fmadd_ps(p, a2, _mm256_set1_ps(2.0f / 15.0f));
    p = _mm256_fmadd_ps(p, a2, _mm256_set1_ps(-1.0f / 3.0f));
    const __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(p, a2), a, a);
    const __m256 r = _mm256_blendv_ps(big, small, _mm256_cmp_ps(a, _mm256_set1_ps(0.25f), _CMP_LT_OQ));
    return _mm256_or_ps(r, sign);
}
#endif

#endif
