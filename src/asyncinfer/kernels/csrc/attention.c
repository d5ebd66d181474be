#include "internal.h"

/* The most floats of scores a task keeps at once (a head's a key), 256 KiB: the heads of a task beyond
 * it take their scores in turns */
#define SCORES_MAX 65536

/* Decode attention over a paged cache, read in place: one query token per sequence.
 *   q: [S, H, D]; k_cache, v_cache: [blocks, BS, KVH, D]; tables: [S, ldt] block ids;
 *   ctx: [S] context lengths (the new token's K/V already written); out: [S, H, D].
 * The G = H / KVH query heads of a KV head share its keys (GQA). Softmax in float32 with the
 * maximum subtracted, as SDPA computes it (exp256: within 2 ulp of expf). One task per KV head and sequence
 * (its query heads split over the threads where there are fewer such tasks than threads).
 * softcap > 0 (Gemma 2): each score, scale included, becomes
 * softcap * tanh(score / softcap) before the softmax, as transformers' eager attention caps it;
 * window > 0 (sliding layers): a context of L keys attends to its last
 * min(L, window) keys, L - window .. L - 1, as the torch reference's window masks them.
 * D must be a multiple of 8. The variants differ in the order of float32 sums and in exp (the AVX2
 * polynomial within 2 ulp of expf, the scalar reference expf itself).
 *
 * Each key's score is one 8-lane dot product (hsum), four keys in flight at a time so that the
 * FMA chains overlap; the output is accumulated in registers, 32 dimensions at a time over every
 * value row (two keys in flight, even and odd, added at the end), so nothing waits on a store. */
#ifdef AI_AVX2
static inline float key_score(const float *qv, const float *kv, int64_t D) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < D; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qv + i), _mm256_loadu_ps(kv + i), acc);
    return ai_hsum256(acc);
}

/* Memory, not arithmetic, bounds decode attention (the cache is cold after a step's weights have
 * streamed through): a task first asks for the rows (a KV head's D floats) of its first FAR keys and values
 * at once, into L2 (the T1 hint: the L1's fill buffers would bound the misses in flight), and each walk then
 * asks for the row FAR keys on. Asking for rows 16 keys on as the walk went, into L1, took 1.03-1.18x the time
 * at 64-512 keys, 1.48x at 2,048 (benchmarks/decode_attention.py; docs/formats.md, "Decode attention's keys,
 * asked for at once"). */
#define FAR 256
static inline void prefetch_row(const float *cache, const int64_t *table, int64_t t, int64_t BS, int64_t row,
                                int64_t D) {
    const float *p = cache + table[t / BS] * BS * row + (t % BS) * row;
    for (int64_t i = 0; i < D; i += 16) _mm_prefetch((const char *)(p + i), _MM_HINT_T1);
}

/* Query heads qv[g * D] (g < nh, heads of one KV head) against its keys s0 .. L - 1: head g's scores in
 * pg[g * keys], its output at o[g * D]. Each head's sums are the ones a head by itself takes; the heads take their
 * turns on each run of four keys (and, for the values, on each 32 dimensions), so the group reads a key's lines from
 * memory once and its other heads find them in L1 (the keys) or L2 (the values), where a head at a time walked the
 * context from memory once per head. */
static void attend(const float *qv, int64_t nh, const float *k_cache, const float *v_cache, const int64_t *table,
                   int64_t s0, int64_t L, int64_t BS, int64_t row, int64_t D, float scale, float softcap, float *pg,
                   float *o) {
    const int64_t keys = L - s0;
    /* the first FAR keys' rows, keys and values, asked for at once (many misses in flight where a walk would take
     * them a few at a time); each walk asks for the row FAR keys on */
    for (int64_t t = s0; t < L && t < s0 + FAR; t++) {
        prefetch_row(k_cache, table, t, BS, row, D);
        prefetch_row(v_cache, table, t, BS, row, D);
    }
    /* keys s0 .. L - 1, block by block (the first from its slot s0 % BS); key t's score in pg[g * keys + t - s0] */
    for (int64_t b = s0 / BS, t = s0; t < L; b++) {
        const int64_t j0 = t - b * BS; /* 0 but in a window's first block */
        const float *kb = k_cache + table[b] * BS * row + j0 * row;
        const int64_t n = L - t < BS - j0 ? L - t : BS - j0;
        for (int64_t r = t + FAR; r < t + FAR + n && r < L; r++) prefetch_row(k_cache, table, r, BS, row, D);
        int64_t j = 0;
        for (; j + 4 <= n; j += 4) { /* the same per-key sums as key_score, four chains at once */
            const float *k0 = kb + j * row, *k1 = k0 + row, *k2 = k1 + row, *k3 = k2 + row;
            for (int64_t g = 0; g < nh; g++) {
                const float *q = qv + g * D;
                float *const ps = pg + g * keys + (t - s0);
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
                for (int64_t i = 0; i < D; i += 8) {
                    const __m256 qi = _mm256_loadu_ps(q + i);
                    a0 = _mm256_fmadd_ps(qi, _mm256_loadu_ps(k0 + i), a0);
                    a1 = _mm256_fmadd_ps(qi, _mm256_loadu_ps(k1 + i), a1);
                    a2 = _mm256_fmadd_ps(qi, _mm256_loadu_ps(k2 + i), a2);
                    a3 = _mm256_fmadd_ps(qi, _mm256_loadu_ps(k3 + i), a3);
                }
                ps[j] = ai_hsum256(a0) * scale;
                ps[j + 1] = ai_hsum256(a1) * scale;
                ps[j + 2] = ai_hsum256(a2) * scale;
                ps[j + 3] = ai_hsum256(a3) * scale;
            }
        }
        for (; j < n; j++)
            for (int64_t g = 0; g < nh; g++) pg[g * keys + (t - s0) + j] = key_score(qv + g * D, kb + j * row, D) * scale;
        t += n;
    }
    float inv_of[nh];
    for (int64_t g = 0; g < nh; g++) {
        float *const ps = pg + g * keys;
        float mx = -INFINITY;
        for (int64_t t = 0; t < keys; t++) mx = ps[t] > mx ? ps[t] : mx;
        if (softcap > 0.0f) mx = ai_softcap(ps, keys, softcap); /* Gemma 2: the scores capped before the softmax */
        __m256 dsum = _mm256_setzero_ps();
        const __m256 mxv = _mm256_set1_ps(mx);
        int64_t t = 0;
        for (; t + 8 <= keys; t += 8) {
            const __m256 e = ai_exp256(_mm256_sub_ps(_mm256_loadu_ps(ps + t), mxv));
            _mm256_storeu_ps(ps + t, e);
            dsum = _mm256_add_ps(dsum, e);
        }
        float denom = ai_hsum256(dsum);
        for (; t < keys; t++) { ps[t] = expf(ps[t] - mx); denom += ps[t]; }
        inv_of[g] = 1.0f / denom;
    }
    const int64_t wide = D - D % 32;
    for (int64_t i0 = 0; i0 < wide; i0 += 32)
        for (int64_t g = 0; g < nh; g++) {
            __m256 e0 = _mm256_setzero_ps(), e1 = e0, e2 = e0, e3 = e0, o0 = e0, o1 = e0, o2 = e0, o3 = e0;
            int64_t t = s0;
            for (int64_t b = s0 / BS; t < L; b++) {
                const int64_t j0 = t - b * BS;
                const float *vb = v_cache + table[b] * BS * row + j0 * row + i0;
                const int64_t n = L - t < BS - j0 ? L - t : BS - j0;
                const float *const ps = pg + g * keys + (t - s0);
                if (i0 == 0 && g == 0) /* the first walk over the values */
                    for (int64_t r = t + FAR; r < t + FAR + n && r < L; r++) prefetch_row(v_cache, table, r, BS, row, D);
                int64_t j = 0;
                for (; j + 2 <= n; j += 2) {
                    const float *v0 = vb + j * row, *v1 = v0 + row;
                    const __m256 w0 = _mm256_broadcast_ss(ps + j), w1 = _mm256_broadcast_ss(ps + j + 1);
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
                    const __m256 w0 = _mm256_broadcast_ss(ps + j);
                    e0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(v0), e0);
                    e1 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(v0 + 8), e1);
                    e2 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(v0 + 16), e2);
                    e3 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(v0 + 24), e3);
                }
                t += n;
            }
            const __m256 inv = _mm256_set1_ps(inv_of[g]);
            float *const og = o + g * D + i0;
            _mm256_storeu_ps(og, _mm256_mul_ps(_mm256_add_ps(e0, o0), inv));
            _mm256_storeu_ps(og + 8, _mm256_mul_ps(_mm256_add_ps(e1, o1), inv));
            _mm256_storeu_ps(og + 16, _mm256_mul_ps(_mm256_add_ps(e2, o2), inv));
            _mm256_storeu_ps(og + 24, _mm256_mul_ps(_mm256_add_ps(e3, o3), inv));
        }
    for (int64_t g = 0; g < nh; g++)
        for (int64_t i0 = wide; i0 < D; i0 += 8) { /* D not a multiple of 32: the last 8s one chain each */
            __m256 acc = _mm256_setzero_ps();
            int64_t t = s0;
            for (int64_t b = s0 / BS; t < L; b++) {
                const int64_t j0 = t - b * BS;
                const float *vb = v_cache + table[b] * BS * row + j0 * row + i0;
                const int64_t n = L - t < BS - j0 ? L - t : BS - j0;
                if (wide == 0 && i0 == 0 && g == 0) /* D < 32: this is the first walk over the values */
                    for (int64_t r = t + FAR; r < t + FAR + n && r < L; r++) prefetch_row(v_cache, table, r, BS, row, D);
                for (int64_t j = 0; j < n; j++)
                    acc = _mm256_fmadd_ps(_mm256_broadcast_ss(pg + g * keys + (t - s0) + j), _mm256_loadu_ps(vb + j * row),
                                          acc);
                t += n;
            }
            _mm256_storeu_ps(o + g * D + i0, _mm256_mul_ps(acc, _mm256_set1_ps(inv_of[g])));
        }
}

#else
/* The scalar reference: each key's score in order, softmax with the maximum subtracted, the weighted
 * sum of values in key order. */
static void attend_head(const float *qv, const float *k_cache, const float *v_cache, const int64_t *table, int64_t s0,
                        int64_t L, int64_t BS, int64_t row, int64_t D, float scale, float softcap, float *pg, float *o) {
    float mx = -INFINITY;
    const int64_t keys = L - s0; /* keys s0 .. L - 1; key t's score in pg[t - s0] */
    for (int64_t t = s0; t < L; t++) {
        const float *kv = k_cache + table[t / BS] * BS * row + (t % BS) * row;
        float acc = 0.0f;
        for (int64_t i = 0; i < D; i++) acc += qv[i] * kv[i];
        pg[t - s0] = acc * scale;
        mx = pg[t - s0] > mx ? pg[t - s0] : mx;
    }
    if (softcap > 0.0f) mx = ai_softcap(pg, keys, softcap);
    float denom = 0.0f;
    for (int64_t t = 0; t < keys; t++) {
        pg[t] = expf(pg[t] - mx);
        denom += pg[t];
    }
    const float inv = 1.0f / denom;
    for (int64_t i = 0; i < D; i++) o[i] = 0.0f;
    for (int64_t t = s0; t < L; t++) {
        const float *vv = v_cache + table[t / BS] * BS * row + (t % BS) * row;
        for (int64_t i = 0; i < D; i++) o[i] += pg[t - s0] * vv[i];
    }
    for (int64_t i = 0; i < D; i++) o[i] *= inv;
}

static void attend(const float *qv, int64_t nh, const float *k_cache, const float *v_cache, const int64_t *table,
                   int64_t s0, int64_t L, int64_t BS, int64_t row, int64_t D, float scale, float softcap, float *pg,
                   float *o) {
    for (int64_t g = 0; g < nh; g++)
        attend_head(qv + g * D, k_cache, v_cache, table, s0, L, BS, row, D, scale, softcap, pg, o + g * D);
}
#endif

/* One task per (sequence, KV head), or per run of its query heads; each thread's scores in its own slice of one
 * allocation. */
int ai_decode_attention(const float *q, const float *k_cache, const float *v_cache, const int64_t *tables,
                        int64_t ldt, const int64_t *ctx, int64_t S, int64_t H, int64_t KVH, int64_t D, int64_t BS,
                        float scale, float softcap, int64_t window, float *out, int threads) {
    if (S < 0 || H < 1 || KVH < 1 || H % KVH || D < 1 || BS < 1) return ASYNCINFER_EINVAL; /* never divide by 0 */
    const int64_t G = H / KVH, row = KVH * D; /* floats from one slot to the next */
    int64_t longest = 1;
    for (int64_t s = 0; s < S; s++) longest = ctx[s] > longest ? ctx[s] : longest;
    if (S == 0) return 0;
    /* a task: a run of a KV head's query heads (run p of parts: heads p G / parts to (p + 1) G / parts): the whole
     * group where the groups share out evenly over the threads, else the fewest runs a group (at most a head a run)
     * that do, else enough for four tasks a thread */
    const int64_t nt = threads > 1 ? threads : 1, groups = S * KVH;
    int64_t parts = 0;
    for (int64_t p = 1; p <= G && !parts; p++)
        if (groups * p % nt == 0) parts = p;
    if (!parts) parts = (4 * nt + groups - 1) / groups < G ? (4 * nt + groups - 1) / groups : G;
    /* a task's heads take their scores together, as many at a time as keep them within SCORES_MAX floats */
    const int64_t widest = (G + parts - 1) / parts, fit = SCORES_MAX / longest > 1 ? SCORES_MAX / longest : 1;
    const int64_t at_once = widest < fit ? widest : fit;
    int64_t slice;
    if (!ai_mul(longest, at_once, &slice)) return ASYNCINFER_ENOMEM;
    float *scores = (float *)ai_alloc(nt, slice * (int64_t)sizeof(float));
    if (!scores) return ASYNCINFER_ENOMEM;
    _Pragma("omp parallel for schedule(static) num_threads(nt) if(nt > 1 && groups * parts > 1)")
    for (int64_t task = 0; task < groups * parts; task++) {
        const int64_t s = task / (KVH * parts), kvh = task / parts % KVH, p = task % parts, L = ctx[s];
        const int64_t first = kvh * G + p * G / parts, end = kvh * G + (p + 1) * G / parts;
        const int64_t s0 = window > 0 && L > window ? L - window : 0; /* a window: the last `window` keys */
        float *const pg = scores + (int64_t)ai_thread_num() * slice;
        for (int64_t head = first; head < end; head += at_once)
            attend(q + (s * H + head) * D, end - head < at_once ? end - head : at_once, k_cache + kvh * D,
                   v_cache + kvh * D, tables + s * ldt, s0, L, BS, row, D, scale, softcap, pg, out + (s * H + head) * D);
    }
    free(scores);
    return 0;
}

int asyncinfer_decode_attention(const float *q, const float *k_cache, const float *v_cache, const int64_t *tables,
                                int64_t ldt, const int64_t *ctx, int64_t S, int64_t H, int64_t KVH, int64_t D,
                                int64_t BS, float scale, float softcap, int64_t window, float *out, int threads) {
    return ai_decode_attention(q, k_cache, v_cache, tables, ldt, ctx, S, H, KVH, D, BS, scale, softcap, window, out,
                               threads);
}
