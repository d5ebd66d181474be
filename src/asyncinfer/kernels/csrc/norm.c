/* RMS norm of T rows: y[t] = (x[t] * 1 / sqrt(mean(x[t]^2) + eps)) * w, float32 throughout. The
 * variants differ only in the order of the sum of squares. */
#include "internal.h"

void ai_rms_norm(const float *x, int64_t T, int64_t ldx, int64_t H, const float *w, float eps, float *y, int threads) {
    _Pragma("omp parallel for schedule(static) num_threads(threads) if(threads > 1 && T > 16)")
    for (int64_t t = 0; t < T; t++) {
        const float *xr = x + t * ldx;
        float *yr = y + t * H;
        int64_t i = 0;
        float sum = 0.0f;
#ifdef AI_AVX2
        __m256 ss = _mm256_setzero_ps();
        for (; i + 8 <= H; i += 8) {
            const __m256 v = _mm256_loadu_ps(xr + i);
            ss = _mm256_fmadd_ps(v, v, ss);
        }
        sum = ai_hsum256(ss);
#endif
        for (; i < H; i++) sum += xr[i] * xr[i];
        const float r = 1.0f / sqrtf(sum / (float)H + eps);
        i = 0;
#ifdef AI_AVX2
        const __m256 rv = _mm256_set1_ps(r);
        for (; i + 8 <= H; i += 8)
            _mm256_storeu_ps(yr + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + i), rv), _mm256_loadu_ps(w + i)));
#endif
        for (; i < H; i++) yr[i] = (xr[i] * r) * w[i];
    }
}

void asyncinfer_rms_norm(const float *x, int64_t T, int64_t ldx, int64_t H, const float *w, float eps, float *y,
                         int threads) {
    ai_rms_norm(x, T, ldx, H, w, eps, y, threads);
}
