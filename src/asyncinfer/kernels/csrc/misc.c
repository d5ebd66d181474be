/* The small kernels: argmax, the paged-input check, SwiGLU's and GeGLU's element-wise steps, soft-capping,
 * and what the library says about itself (version, variant, the variants this CPU runs). */
#include "internal.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

/* The index of each row's largest value, the first one among equals, as torch.argmax picks it (a NaN
 * counts as the largest: the first NaN's index). x: [rows, n], row stride ldx; out: [rows]. */
void ai_argmax(const float *x, int64_t rows, int64_t n, int64_t ldx, int64_t *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *v = x + r * ldx;
        int64_t i = 0, best = 0;
        float m = -INFINITY; /* the maximum of v[0, i) and its first index (0 while all are -inf) */
#ifdef AI_AVX2
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
#endif
        for (; i < n; i++) {
            if (v[i] != v[i]) { best = i; break; }
            if (v[i] > m) { m = v[i]; best = i; }
        }
        out[r] = best;
    }
}

void asyncinfer_argmax(const float *x, int64_t rows, int64_t n, int64_t ldx, int64_t *out) {
    ai_argmax(x, rows, n, ldx, out);
}

/* The paged inputs of S sequences checked against the caches (num_blocks blocks of BS slots): 0; 3 for
 * a context length below 1 or longer than its block table (ldt blocks); 4 for a slot (slots: NULL or
 * [S]) or a block id that the context reads outside the caches. The kernels read and write only where
 * these point, so the Python side checks them first. */
int ai_check_paged(const int64_t *tables, int64_t ldt, const int64_t *ctx, const int64_t *slots, int64_t S,
                   int64_t BS, int64_t num_blocks) {
    if (BS < 1 || ldt < 0 || num_blocks < 0 || (num_blocks && num_blocks > INT64_MAX / BS)) return 4;
    for (int64_t s = 0; s < S; s++) {
        /* (ctx - 1) / BS + 1 blocks, written so that no length near 2**63 overflows */
        if (ctx[s] < 1 || (ctx[s] - 1) / BS >= ldt) return 3;
        if (slots && (slots[s] < 0 || slots[s] >= num_blocks * BS)) return 4;
        for (int64_t b = 0; b <= (ctx[s] - 1) / BS; b++)
            if (tables[s * ldt + b] < 0 || tables[s * ldt + b] >= num_blocks) return 4;
    }
    return 0;
}

int asyncinfer_check_paged(const int64_t *tables, int64_t ldt, const int64_t *ctx, const int64_t *slots, int64_t S,
                           int64_t BS, int64_t num_blocks) {
    return ai_check_paged(tables, ldt, ctx, slots, S, BS, num_blocks);
}

/* out[i] = silu(g[i]) * u[i] = g / (1 + e^-g) * u. */
void ai_swiglu(const float *g, const float *u, float *out, int64_t n) {
    int64_t i = 0;
#ifdef AI_AVX2
    for (; i + 8 <= n; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 e = ai_exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv));
        const __m256 silu = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
    }
#endif
    for (; i < n; i++) out[i] = (g[i] / (1.0f + expf(-g[i]))) * u[i];
}

/* out[i] = gelu_tanh(g[i]) * u[i], the float32 steps of torch's F.gelu(approximate="tanh"), then times u. */
void ai_geglu(const float *g, const float *u, float *out, int64_t n) {
    const float beta = 0.7978845608028654f, kappa = 0.044715f; /* sqrt(2 / pi) */
    int64_t i = 0;
#ifdef AI_AVX2
    const __m256 bv = _mm256_set1_ps(beta), kv = _mm256_set1_ps(kappa), half = _mm256_set1_ps(0.5f),
                 one = _mm256_set1_ps(1.0f);
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_loadu_ps(g + i);
        const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
        const __m256 inner = _mm256_mul_ps(bv, _mm256_add_ps(x, _mm256_mul_ps(kv, cube)));
        const __m256 gelu = _mm256_mul_ps(_mm256_mul_ps(half, x), _mm256_add_ps(one, ai_tanh256(inner)));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(gelu, _mm256_loadu_ps(u + i)));
    }
#endif
    for (; i < n; i++) {
        const float x = g[i], inner = beta * (x + kappa * (x * x * x));
        out[i] = ((0.5f * x) * (1.0f + tanhf(inner))) * u[i];
    }
}

/* x = cap * tanh(x / cap), in place; the largest result. */
float ai_softcap(float *x, int64_t n, float cap) {
    float mx = -INFINITY;
    int64_t i = 0;
#ifdef AI_AVX2
    const __m256 cv = _mm256_set1_ps(cap);
    __m256 m = _mm256_set1_ps(-INFINITY);
    for (; i + 8 <= n; i += 8) {
        /* x / cap as a division, as torch divides: x * (1 / cap) may round differently */
        const __m256 v = _mm256_mul_ps(ai_tanh256(_mm256_div_ps(_mm256_loadu_ps(x + i), cv)), cv);
        _mm256_storeu_ps(x + i, v);
        m = _mm256_max_ps(v, m);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, m);
    for (int k = 0; k < 8; k++) mx = lanes[k] > mx ? lanes[k] : mx;
#endif
    for (; i < n; i++) {
        x[i] = tanhf(x[i] / cap) * cap;
        mx = x[i] > mx ? x[i] : mx;
    }
    return mx;
}

int asyncinfer_panel_min_rows(void) { return PANEL_MIN_ROWS; }
int asyncinfer_step_tile_min_rows(void) { return ASYNCINFER_STEP_TILE_MIN_ROWS; }

int asyncinfer_kernels_version(void) { return ASYNCINFER_KERNELS_VERSION; }

int asyncinfer_kernels_isa(void) { return AI_ISA; }

/* The variants this CPU and OS run: cpuid for the instructions, xgetbv for the OS saving their registers
 * (AVX: XMM and YMM state; AVX-512: also the opmask and both halves of the ZMM state). */
int asyncinfer_cpu_isas(void) {
    int isas = 1 << ASYNCINFER_ISA_SCALAR;
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return isas;
    const int fma = (c >> 12) & 1, osxsave = (c >> 27) & 1, avx = (c >> 28) & 1, f16c = (c >> 29) & 1;
    if (!(osxsave && avx)) return isas;
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    const uint64_t xcr0 = ((uint64_t)hi << 32) | lo;
    if ((xcr0 & 0x6) != 0x6 || __get_cpuid_max(0, NULL) < 7) return isas;
    __cpuid_count(7, 0, a, b, c, d);
    const int avx2 = (b >> 5) & 1, avx512f = (b >> 16) & 1, avx512bw = (b >> 30) & 1, avx512vl = (b >> 31) & 1;
    if (!(avx2 && fma && f16c)) return isas;
    isas |= 1 << ASYNCINFER_ISA_AVX2;
    if (!(avx512f && avx512bw && avx512vl && (xcr0 & 0xE6) == 0xE6)) return isas;
    isas |= 1 << ASYNCINFER_ISA_AVX512;
    if ((c >> 11) & 1) isas |= 1 << ASYNCINFER_ISA_AVX512VNNI; /* AVX512_VNNI: vpdpbusd, vpdpwssd */
#endif
    return isas;
}
