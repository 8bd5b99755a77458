/* The rest of a decoder layer for CPU decoding and verification, in fp32.
 *
 * A decode step of a small model is only about half matmuls: SmolLM2-135M in bf16 on the
 * project's 2-core machine spent ~15 ms of a 28 ms step in the weight products and the rest
 * in ~45 small torch operations per layer (norms, rotary embedding, the cache write,
 * attention over the cache, SwiGLU, residual adds), each a dispatch of a few microseconds on
 * a [k + 1, 576] tensor, and verifying 5 tokens added another 6 ms there. These functions do
 * that work in three calls per layer (attention with the rotary embedding and the cache
 * write; residual add + RMSNorm; SwiGLU), for rows of a few tokens each
 * (``LlamaModel._forward_fused``); long prefills stay on torch, whose attention is tiled.
 *
 * Numbers are fp32 throughout; results agree with the torch path to fp32 rounding (sums are
 * taken in another order, and exp is the polynomial below, within 2 ulp of expf). Each
 * query's attention is computed the same way whatever else is in the batch (one query, its
 * own keys in order), so a position gives the same value decoded alone or verified in a
 * chunk of k + 1.
 *
 * GCC vector extensions (builds to AVX-512, AVX2 or NEON from one source); OpenMP over
 * (sequence, head) pairs for attention.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

static inline v16f vload(const float* p) {
    v16f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void vstore(float* p, v16f v) { memcpy(p, &v, sizeof v); }

static inline float hsum(v16f v) {
    float t[16];
    memcpy(t, &v, sizeof t);
    float a = (t[0] + t[8]) + (t[4] + t[12]), b = (t[2] + t[10]) + (t[6] + t[14]);
    float c = (t[1] + t[9]) + (t[5] + t[13]), d = (t[3] + t[11]) + (t[7] + t[15]);
    return (a + b) + (c + d);
}

static inline float hmax(v16f v) {
    float t[16];
    memcpy(t, &v, sizeof t);
    float m = t[0];
    for (int i = 1; i < 16; i++) m = t[i] > m ? t[i] : m;
    return m;
}

/* Subnormal floats (below 1.2e-38) cost the CPU a microcode assist per operation: a softmax
   over widely spread scores makes weights near 1e-38 whose products with the values are
   subnormal, and attention then ran 4-10x slower (measured on random caches). The kernels
   flush them to zero (x86's FTZ and DAZ bits, set on entry and restored on exit, per
   thread); what that changes is below 1e-38. */
#if defined(__SSE__)
#include <xmmintrin.h>
#define FLUSH_BEGIN unsigned int csr_saved_ = _mm_getcsr(); _mm_setcsr(csr_saved_ | 0x8040);
#define FLUSH_END _mm_setcsr(csr_saved_);
#else
#define FLUSH_BEGIN
#define FLUSH_END
#endif

/* exp on 16 lanes for x <= ~88: x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial for
   e^r (Cephes' expf coefficients), times 2^n built in the exponent bits. Below -86.5 the
   result is 0 (e^-86.5 ~ 2.6e-38, nothing next to a softmax's largest term, 1): it keeps
   every result a normal float, as subnormal operands cost the CPU a microcode assist each
   (attention over scores spread wide ran 3-4x slower with them). */
static inline v16f vexp(v16f x) {
    const v16f lo = (v16f){0} - 86.5f, hi = (v16f){0} + 88.0f;
    v16i below = x < lo, above = x > hi;
    x = (v16f)(((v16i)x & ~below) | ((v16i)lo & below));
    x = (v16f)(((v16i)x & ~above) | ((v16i)hi & above));  /* e^88 = 1.7e38: SwiGLU's far tail */
    v16f t = x * 1.44269504088896341f + 0.5f;
    v16i n = __builtin_convertvector(t, v16i);  /* truncates toward zero: make it floor */
    v16f nf = __builtin_convertvector(n, v16f);
    n += (v16i)(nf > t);  /* -1 where the truncation went up */
    nf = __builtin_convertvector(n, v16f);
    v16f r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
    v16f p = (v16f){0} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    v16i e = (n + 127) << 23;
    return (v16f)((v16i)(p * (v16f)e) & ~below);
}

int adaptspec_layer_ops_version(void) { return 1; }

/* out[n] = h[n] / rms(h[n]) * w, and first h[n] += delta[n] when delta is given (the
   residual add that precedes every norm of a layer). N rows of H floats. */
void adaptspec_add_rms_norm(int N, int H, float* h, const float* delta, const float* w, float eps,
                            float* out) {
    for (int n = 0; n < N; n++) {
        float* x = h + (int64_t)n * H;
        float* y = out + (int64_t)n * H;
        if (delta) {
            const float* dl = delta + (int64_t)n * H;
            for (int i = 0; i < H; i++) x[i] += dl[i];
        }
        v16f acc = {0};
        int i = 0;
        for (; i + 16 <= H; i += 16) {
            v16f v = vload(x + i);
            acc += v * v;
        }
        float ss = hsum(acc);
        for (; i < H; i++) ss += x[i] * x[i];
        float inv = 1.0f / sqrtf(ss / (float)H + eps);
        for (i = 0; i < H; i++) y[i] = x[i] * inv * w[i];
    }
}

/* SwiGLU: out[n, i] = silu(gu[n, i]) * gu[n, I + i]; gu is the fused gate/up product. */
void adaptspec_silu_mul(int N, int I, const float* gu, float* out) {
    FLUSH_BEGIN
    for (int n = 0; n < N; n++) {
        const float* g = gu + (int64_t)n * 2 * I;
        const float* u = g + I;
        float* y = out + (int64_t)n * I;
        int i = 0;
        for (; i + 16 <= I; i += 16) {
            v16f gv = vload(g + i);
            vstore(y + i, gv / (1.0f + vexp(-gv)) * vload(u + i));
        }
        for (; i < I; i++) y[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
    FLUSH_END
}

/* Rotary embedding of one head in place: x * cos + rotate_half(x) * sin, rotate_half(x) =
   (-x2, x1) for the halves x1, x2 (the Llama / HF convention). */
static void rope(float* x, const float* cs, const float* sn, int D) {
    const int half = D / 2;
    for (int i = 0; i < half; i++) {
        float x1 = x[i], x2 = x[i + half];
        x[i] = x1 * cs[i] - x2 * sn[i];
        x[i + half] = x2 * cs[i + half] + x1 * sn[i + half];
    }
}

static inline float dot(const float* a, const float* b, int D) {
    v16f acc = {0};
    int d = 0;
    for (; d + 16 <= D; d += 16) acc += vload(a + d) * vload(b + d);
    float s = hsum(acc);
    for (; d < D; d++) s += a[d] * b[d];
    return s;
}

/* The shuffles that sum 16 vectors lane-wise into one: lane i of the result is the sum of
   vector i's lanes. Four levels, each halving the partial sums per key and doubling the keys
   a vector holds: 15 x (two shuffles + one add) per 16 dot products, instead of a
   horizontal sum (a store and 15 scalar adds) for each. */
#define SHUF __builtin_shufflevector
static inline v16f comb8(v16f x, v16f y) {
    return SHUF(x, y, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           SHUF(x, y, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
}
static inline v16f comb4(v16f x, v16f y) {
    return SHUF(x, y, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           SHUF(x, y, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
}
static inline v16f comb2(v16f x, v16f y) {
    return SHUF(x, y, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           SHUF(x, y, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
}
static inline v16f comb1(v16f x, v16f y) {
    return SHUF(x, y, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           SHUF(x, y, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
static inline v16f sum16(const v16f* a) {
    v16f b[8], c[4], d[2];
    for (int i = 0; i < 8; i++) b[i] = comb8(a[2 * i], a[2 * i + 1]);
    for (int i = 0; i < 4; i++) c[i] = comb4(b[2 * i], b[2 * i + 1]);
    for (int i = 0; i < 2; i++) d[i] = comb2(c[2 * i], c[2 * i + 1]);
    return comb1(d[0], d[1]);
}

/* sc[s] = scale * q . K[s] for s < L; DV = D / 16 vectors per row (0: any D, one by one). */
#define SCORES(DV)                                                                      \
    static void scores_##DV(const float* q, const float* K, int L, int D, float scale, float* sc) { \
        int s = 0;                                                                      \
        if (DV > 0) {                                                                   \
            v16f qv[DV > 0 ? DV : 1];                                                   \
            for (int v = 0; v < DV; v++) qv[v] = vload(q + 16 * v);                      \
            for (; s + 16 <= L; s += 16) {                                              \
                v16f acc[16];                                                           \
                for (int j = 0; j < 16; j++) {                                          \
                    const float* kr = K + (int64_t)(s + j) * D;                         \
                    v16f a = qv[0] * vload(kr);                                         \
                    for (int v = 1; v < DV; v++) a += qv[v] * vload(kr + 16 * v);       \
                    acc[j] = a;                                                         \
                }                                                                       \
                vstore(sc + s, sum16(acc) * scale);                                     \
            }                                                                           \
        }                                                                               \
        for (; s < L; s++) sc[s] = dot(q, K + (int64_t)s * D, D) * scale;               \
    }
SCORES(0)
SCORES(4)
SCORES(8)

/* o = sum_s p[s] V[s] / sum */
#define WEIGHTED(DV)                                                                    \
    static void weighted_##DV(const float* p, const float* V, int L, int D, float inv, float* o) { \
        if (DV > 0) {                                                                   \
            v16f acc[DV > 0 ? DV : 1];                                                  \
            for (int v = 0; v < DV; v++) acc[v] = (v16f){0};                            \
            for (int s = 0; s < L; s++) {                                               \
                const float* vr = V + (int64_t)s * D;                                   \
                for (int v = 0; v < DV; v++) acc[v] += p[s] * vload(vr + 16 * v);       \
            }                                                                           \
            for (int v = 0; v < DV; v++) vstore(o + 16 * v, acc[v] * inv);              \
            return;                                                                     \
        }                                                                               \
        for (int d = 0; d < D; d++) o[d] = 0.0f;                                        \
        for (int s = 0; s < L; s++) {                                                   \
            const float* vr = V + (int64_t)s * D;                                       \
            for (int d = 0; d < D; d++) o[d] += p[s] * vr[d];                           \
        }                                                                               \
        for (int d = 0; d < D; d++) o[d] *= inv;                                        \
    }
WEIGHTED(0)
WEIGHTED(4)
WEIGHTED(8)

/* Attention of B sequences' new tokens over their cached prefixes, with the rotary embedding
 * and the cache write.
 *
 * Sequence b has tokens row_start[b] .. row_start[b + 1] - 1 of the flat token rows, at
 * positions cache_lens[b] + j, in KV slot slots[b]. qkv[N, ld_qkv] holds each token's
 * q (H heads), k and v (Hkv heads each) of head_dim D. Rotates q and k in place, writes k and
 * v into the caches ([slot][kv head][position][D], strides in floats), then each query
 * attends causally to its slot's keys 0 .. its own position (grouped-query: head h reads kv
 * head h / (H / Hkv)). out[N, H * D]. cos_t / sin_t: [max_position, D] tables. max_ctx: the
 * longest context (for the score buffer).
 */
void adaptspec_attention(int B, const int* row_start, const int* slots, const int* cache_lens, float* qkv,
                         int ld_qkv, const float* cos_t, const float* sin_t, float* kcache, float* vcache,
                         int64_t slot_stride, int64_t head_stride, int H, int Hkv, int D, float scale,
                         float* out, int max_ctx, int nthreads) {
    for (int b = 0; b < B; b++) {
        for (int t = row_start[b]; t < row_start[b + 1]; t++) {
            const int pos = cache_lens[b] + (t - row_start[b]);
            const float* cs = cos_t + (int64_t)pos * D;
            const float* sn = sin_t + (int64_t)pos * D;
            float* q = qkv + (int64_t)t * ld_qkv;
            float* k = q + (int64_t)H * D;
            float* v = k + (int64_t)Hkv * D;
            for (int h = 0; h < H; h++) rope(q + (int64_t)h * D, cs, sn, D);
            for (int h = 0; h < Hkv; h++) {
                rope(k + (int64_t)h * D, cs, sn, D);
                int64_t at = (int64_t)slots[b] * slot_stride + (int64_t)h * head_stride + (int64_t)pos * D;
                memcpy(kcache + at, k + (int64_t)h * D, sizeof(float) * D);
                memcpy(vcache + at, v + (int64_t)h * D, sizeof(float) * D);
            }
        }
    }
    const int group = H / Hkv;
#pragma omp parallel num_threads(nthreads)
    {
        FLUSH_BEGIN
        float* sc = malloc(sizeof(float) * ((size_t)max_ctx + 16));
#pragma omp for schedule(static)
        for (int task = 0; task < B * H; task++) {
            const int b = task / H, h = task % H;
            const int64_t base = (int64_t)slots[b] * slot_stride + (int64_t)(h / group) * head_stride;
            const float* K = kcache + base;
            const float* V = vcache + base;
            for (int t = row_start[b]; t < row_start[b + 1]; t++) {
                const int L = cache_lens[b] + (t - row_start[b]) + 1;  /* keys 0 .. own position */
                const float* q = qkv + (int64_t)t * ld_qkv + (int64_t)h * D;
                float* o = out + (int64_t)t * H * D + (int64_t)h * D;
                if (D == 64)
                    scores_4(q, K, L, D, scale, sc);
                else if (D == 128)
                    scores_8(q, K, L, D, scale, sc);
                else
                    scores_0(q, K, L, D, scale, sc);
                v16f mv = (v16f){0} - INFINITY;
                int s = 0;
                for (; s + 16 <= L; s += 16) {
                    v16f x = vload(sc + s);
                    v16i gt = x > mv;
                    mv = (v16f)(((v16i)x & gt) | ((v16i)mv & ~gt));
                }
                float mx = hmax(mv);
                for (; s < L; s++) mx = sc[s] > mx ? sc[s] : mx;
                for (s = L; s < ((L + 15) & ~15); s++) sc[s] = mx;  /* pad the last vector */
                v16f sv = {0};
                for (s = 0; s < L; s += 16) {
                    v16f e = vexp(vload(sc + s) - mx);
                    vstore(sc + s, e);
                    if (s + 16 <= L) sv += e;
                }
                float sum = hsum(sv);
                for (s = L & ~15; s < L; s++) sum += sc[s];
                if (D == 64)
                    weighted_4(sc, V, L, D, 1.0f / sum, o);
                else if (D == 128)
                    weighted_8(sc, V, L, D, 1.0f / sum, o);
                else
                    weighted_0(sc, V, L, D, 1.0f / sum, o);
            }
        }
        free(sc);
        FLUSH_END
    }
}
