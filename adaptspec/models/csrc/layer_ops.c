/* The rest of a decoder layer for CPU decoding and verification, in fp32.
 *
 * Once the weight products stream at memory speed, a decode step of a small model is only
 * about half matmuls: the rest is ~45 small torch operations per layer (norms, rotary
 * embedding, the cache write, attention over the cache, SwiGLU, residual adds), each a
 * dispatch of a few microseconds on a [k + 1, hidden] tensor. These functions do that work
 * in three calls per layer (attention with the rotary embedding and the cache write;
 * residual add + RMSNorm; SwiGLU), over the step's ragged rows and the paged KV cache.
 * ``adaptspec_layers`` (at the end) strings them and the products together over all layers.
 *
 * Numbers are fp32 throughout; results agree with the torch path to fp32 rounding (sums are
 * taken in another order, and exp is the polynomial below, within 2 ulp of expf). Each
 * query's attention is computed the same way whatever else is in the batch (one query, its
 * own keys in order), so a position gives the same value decoded alone or verified in a
 * chunk of k + 1.
 *
 * GCC vector extensions of 8 floats (AVX2 / AVX-512VL registers, NEON pairs) from one
 * source; OpenMP over tasks of attention. 8 and not 16 lanes: on a CPU with one 512-bit FMA
 * unit and two 256-bit ones, attention's multiply-adds ran about twice as fast in 256-bit
 * registers. The weight products (small_gemm.c) wait on memory, not on FMAs, and take the
 * CPU's widest vectors (16 lanes on AVX-512).
 *
 * Measured timings of these choices: docs/benchmarks.md ("Kernel and forward timings").
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define VL 8
typedef float vf __attribute__((vector_size(4 * VL)));
typedef int32_t vi __attribute__((vector_size(4 * VL)));

static inline vf vload(const float* p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void vstore(float* p, vf v) { memcpy(p, &v, sizeof v); }

static inline float hsum(vf v) {
    float t[VL];
    memcpy(t, &v, sizeof t);
    return ((t[0] + t[4]) + (t[2] + t[6])) + ((t[1] + t[5]) + (t[3] + t[7]));
}

static inline float hmax(vf v) {
    float t[VL];
    memcpy(t, &v, sizeof t);
    float m = t[0];
    for (int i = 1; i < VL; i++) m = t[i] > m ? t[i] : m;
    return m;
}

static inline vf vselect(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }

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

/* exp on VL lanes for x <= ~88: x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial for
   e^r (Cephes' expf coefficients), times 2^n built in the exponent bits. Below -86.5 the
   result is 0 (e^-86.5 ~ 2.6e-38, nothing next to a softmax's largest term, 1): it keeps
   every result a normal float. */
static inline vf vexp(vf x) {
    const vf lo = (vf){0} - 86.5f, hi = (vf){0} + 88.0f;
    vi below = x < lo;
    x = vselect(below, lo, x);
    x = vselect(x > hi, hi, x);  /* e^88 = 1.7e38: SwiGLU's far tail */
    vf t = x * 1.44269504088896341f + 0.5f;
    vi n = __builtin_convertvector(t, vi);  /* truncates toward zero: make it floor */
    n += (vi)(__builtin_convertvector(n, vf) > t);  /* -1 where the truncation went up */
    vf nf = __builtin_convertvector(n, vf);
    vf r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
    vf p = (vf){0} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    vi e = (n + 127) << 23;
    return (vf)((vi)(p * (vf)e) & ~below);
}

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
        vf acc = {0};
        int i = 0;
        for (; i + VL <= H; i += VL) {
            vf v = vload(x + i);
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
        for (; i + VL <= I; i += VL) {
            vf gv = vload(g + i);
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
    vf acc = {0};
    int d = 0;
    for (; d + VL <= D; d += VL) acc += vload(a + d) * vload(b + d);
    float s = hsum(acc);
    for (; d < D; d++) s += a[d] * b[d];
    return s;
}

/* The shuffles that sum VL vectors lane-wise into one: lane i of the result is the sum of
   vector i's lanes. Three levels, each halving the partial sums per key and doubling the
   keys a vector holds: 7 x (two shuffles + one add) per VL dot products, instead of a
   horizontal sum (a store and 7 scalar adds) for each. */
#if defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector) && !defined(ADAPTSPEC_NO_SHUFFLEVECTOR)
#define SHUF(x, y, ...) __builtin_shufflevector(x, y, __VA_ARGS__)
#endif
#endif
#ifndef SHUF /* GCC before 12 has only its own form */
#define SHUF(x, y, ...) __builtin_shuffle(x, y, (vi){__VA_ARGS__})
#endif
static inline vf comb4(vf x, vf y) {
    return SHUF(x, y, 0, 1, 2, 3, 8, 9, 10, 11) + SHUF(x, y, 4, 5, 6, 7, 12, 13, 14, 15);
}
static inline vf comb2(vf x, vf y) {
    return SHUF(x, y, 0, 1, 4, 5, 8, 9, 12, 13) + SHUF(x, y, 2, 3, 6, 7, 10, 11, 14, 15);
}
static inline vf comb1(vf x, vf y) {
    return SHUF(x, y, 0, 2, 4, 6, 8, 10, 12, 14) + SHUF(x, y, 1, 3, 5, 7, 9, 11, 13, 15);
}
static inline vf sum8(const vf* a) {
    vf b[4], c[2];
    for (int i = 0; i < 4; i++) b[i] = comb4(a[2 * i], a[2 * i + 1]);
    for (int i = 0; i < 2; i++) c[i] = comb2(b[2 * i], b[2 * i + 1]);
    return comb1(c[0], c[1]);
}

/* Scores of one query against VL consecutive keys (rows of D = VL * DV floats). */
#define BLOCK_SCORES(DV)                                                                \
    static inline vf block_scores_##DV(const float* q, const float* K) {               \
        vf qv[DV], acc[VL];                                                             \
        _Pragma("GCC unroll 16") for (int v = 0; v < DV; v++) qv[v] = vload(q + VL * v); \
        _Pragma("GCC unroll 8") for (int j = 0; j < VL; j++) {                          \
            const float* kr = K + (int64_t)j * VL * DV;                                 \
            vf a = qv[0] * vload(kr);                                                   \
            _Pragma("GCC unroll 16") for (int v = 1; v < DV; v++) a += qv[v] * vload(kr + VL * v); \
            acc[j] = a;                                                                 \
        }                                                                               \
        return sum8(acc);                                                               \
    }
BLOCK_SCORES(8)
BLOCK_SCORES(16)

static inline vf block_scores(const float* q, const float* K, int D) {  /* D % VL == 0 */
    if (D == 64) return block_scores_8(q, K);
    if (D == 128) return block_scores_16(q, K);
    vf acc[VL];
    for (int j = 0; j < VL; j++) {
        const float* kr = K + (int64_t)j * D;
        vf a = {0};
        for (int d = 0; d < D; d += VL) a += vload(q + d) * vload(kr + d);
        acc[j] = a;
    }
    return sum8(acc);
}

/* o += sum over s < n (n <= VL) of p[s] * V[s] */
static inline void block_weighted(const float* p, const float* V, int n, int D, float* o) {
    if (D == 64) {
        vf a[8];
        _Pragma("GCC unroll 8") for (int v = 0; v < 8; v++) a[v] = vload(o + VL * v);
        for (int s = 0; s < n; s++) {
            const float* vr = V + (int64_t)s * 64;
            const float ps = p[s];
            _Pragma("GCC unroll 8") for (int v = 0; v < 8; v++) a[v] += ps * vload(vr + VL * v);
        }
        _Pragma("GCC unroll 8") for (int v = 0; v < 8; v++) vstore(o + VL * v, a[v]);
        return;
    }
    int d = 0;
    for (; d + VL <= D; d += VL) {
        vf a = vload(o + d);
        for (int s = 0; s < n; s++) a += p[s] * vload(V + (int64_t)s * D + d);
        vstore(o + d, a);
    }
    for (; d < D; d++)
        for (int s = 0; s < n; s++) o[d] += p[s] * V[(int64_t)s * D + d];
}

/* Softmax of sc[0 .. L) in place (the buffer holds L rounded up to VL); returns 1 / sum. */
static float softmax_unnormalized(float* sc, int L) {
    vf mv = (vf){0} - INFINITY;
    int s = 0;
    for (; s + VL <= L; s += VL) {
        vf x = vload(sc + s);
        mv = vselect(x > mv, x, mv);
    }
    float mx = hmax(mv);
    for (; s < L; s++) mx = sc[s] > mx ? sc[s] : mx;
    for (s = L; s < ((L + VL - 1) & ~(VL - 1)); s++) sc[s] = mx;  /* pad the last vector */
    vf sv = {0};
    for (s = 0; s < L; s += VL) {
        vf e = vexp(vload(sc + s) - mx);
        vstore(sc + s, e);
        if (s + VL <= L) sv += e;
    }
    float sum = hsum(sv);
    for (s = L & ~(VL - 1); s < L; s++) sum += sc[s];
    return 1.0f / sum;
}

#define QCHUNK 16  /* the most queries one task runs over a kv head's keys */

/* Attention of B sequences' new tokens over their cached prefixes, with the rotary embedding
 * and the cache write.
 *
 * Sequence b has tokens row_start[b] .. row_start[b + 1] - 1 of the flat token rows, at
 * positions cache_lens[b] + j, in the blocks of its block table. qkv[N, ld_qkv] holds each
 * token's q (H heads), k and v (Hkv heads each) of head_dim D. Rotates q and k in place, writes
 * k and v into the paged caches ([block][kv head][offset][D], strides in floats), then each
 * query attends causally to its sequence's keys 0 .. its own position (grouped-query: head h reads kv
 * head h / (H / Hkv)). out[N, H * D]. cos_t / sin_t: [max_position, D] tables. max_ctx: the
 * longest context (for the score buffers).
 *
 * A task is up to QCHUNK queries of one sequence that share a kv head (its query heads times
 * its new tokens) and walks that head's keys and values in blocks of VL, every query of the
 * task per block, so a block is read from memory once and then from L1 rather than once per
 * query from L2. Tasks are sized so the threads get several each. Whatever the chunk, a
 * query's keys go through the same code in the same order (VL-key blocks up to its own
 * length, then one by one), so its result does not depend on the batch.
 */
/* The paged cache: a layer's keys (and values) are [num_blocks, Hkv, BS, D]; sequence b's
 * position s lives in block block_tables[b * max_blocks + s / BS] at offset s % BS. BS is a
 * multiple of VL, so a VL-key run that starts at a multiple of VL never leaves its block. */
static inline int64_t kv_at(const int* bt, int s, int bs, int64_t block_stride, int D) {
    return (int64_t)bt[s / bs] * block_stride + (int64_t)(s % bs) * D;
}

void adaptspec_attention(int B, const int* row_start, const int* block_tables, int max_blocks, int bs,
                         const int* cache_lens, float* qkv,
                         int ld_qkv, const float* cos_t, const float* sin_t, float* kcache, float* vcache,
                         int64_t block_stride, int64_t head_stride, int H, int Hkv, int D, float scale,
                         float* out, int max_ctx, int nthreads) {
    int total_q = 0;
    for (int b = 0; b < B; b++) {
        total_q += (row_start[b + 1] - row_start[b]) * H;
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
                int64_t at = kv_at(block_tables + (int64_t)b * max_blocks, pos, bs, block_stride, D)
                             + (int64_t)h * head_stride;
                memcpy(kcache + at, k + (int64_t)h * D, sizeof(float) * D);
                memcpy(vcache + at, v + (int64_t)h * D, sizeof(float) * D);
            }
        }
    }
    const int group = H / Hkv;
    int qc = (total_q + 4 * nthreads - 1) / (4 * nthreads);  /* ~4 tasks per thread */
    qc = qc < 1 ? 1 : qc > QCHUNK ? QCHUNK : qc;
    int ntasks = 0;
    for (int b = 0; b < B; b++) ntasks += Hkv * ((group * (row_start[b + 1] - row_start[b]) + qc - 1) / qc);
    int* task = malloc(sizeof(int) * 3 * (size_t)(ntasks > 0 ? ntasks : 1));  /* (b, kv head, first query) */
    ntasks = 0;
    for (int b = 0; b < B; b++)
        for (int kh = 0; kh < Hkv; kh++)
            for (int q0 = 0; q0 < group * (row_start[b + 1] - row_start[b]); q0 += qc) {
                task[3 * ntasks] = b, task[3 * ntasks + 1] = kh, task[3 * ntasks + 2] = q0;
                ntasks++;
            }
    const int stride = (max_ctx + VL - 1) & ~(VL - 1);
#pragma omp parallel num_threads(nthreads)
    {
        FLUSH_BEGIN
        float* sc = malloc(sizeof(float) * (size_t)qc * stride);
#pragma omp for schedule(dynamic, 1)
        for (int ti = 0; ti < ntasks; ti++) {
            const int b = task[3 * ti], kh = task[3 * ti + 1], q0 = task[3 * ti + 2];
            const int nt = row_start[b + 1] - row_start[b];
            const int nq = group * nt - q0 < qc ? group * nt - q0 : qc;
            const int* bt = block_tables + (int64_t)b * max_blocks;
            const float* K = kcache + (int64_t)kh * head_stride;  /* + kv_at(bt, s, ...) for key s */
            const float* V = vcache + (int64_t)kh * head_stride;
            int Lq[QCHUNK], Lmax = 0;
            const float* qp[QCHUNK];
            float* op[QCHUNK];
            float inv[QCHUNK];
            for (int i = 0; i < nq; i++) {
                const int g = (q0 + i) / nt, j = (q0 + i) % nt, t = row_start[b] + j, h = kh * group + g;
                Lq[i] = cache_lens[b] + j + 1;  /* keys 0 .. its own position */
                Lmax = Lq[i] > Lmax ? Lq[i] : Lmax;
                qp[i] = qkv + (int64_t)t * ld_qkv + (int64_t)h * D;
                op[i] = out + (int64_t)t * H * D + (int64_t)h * D;
            }
            const int blocked = D % VL == 0;
            for (int s0 = 0; blocked && s0 + VL <= Lmax; s0 += VL)
                for (int i = 0; i < nq; i++)
                    if (s0 + VL <= Lq[i])
                        vstore(sc + (int64_t)i * stride + s0,
                               block_scores(qp[i], K + kv_at(bt, s0, bs, block_stride, D), D) * scale);
            for (int i = 0; i < nq; i++) {
                float* si = sc + (int64_t)i * stride;
                for (int s = blocked ? Lq[i] & ~(VL - 1) : 0; s < Lq[i]; s++) si[s] = dot(qp[i], K + kv_at(bt, s, bs, block_stride, D), D) * scale;
                inv[i] = softmax_unnormalized(si, Lq[i]);
                memset(op[i], 0, sizeof(float) * D);
            }
            for (int s0 = 0; s0 < Lmax; s0 += VL)
                for (int i = 0; i < nq; i++)
                    if (s0 < Lq[i])
                        block_weighted(sc + (int64_t)i * stride + s0, V + kv_at(bt, s0, bs, block_stride, D),
                                       Lq[i] - s0 < VL ? Lq[i] - s0 : VL, D, op[i]);
            for (int i = 0; i < nq; i++)
                for (int d = 0; d < D; d++) op[i][d] *= inv[i];
        }
        free(sc);
        FLUSH_END
    }
    free(task);
}

/* y[M, O] = x[M, I] @ W on the packed weight (small_gemm.c, the same library). */
void adaptspec_small_gemm(int M, int I, int O, const float* x, int ldx, const void* wp, int layout,
                          float* y, int ldy, int nthreads);

/* Every decoder layer of a decode or verification step in one call: for each layer l,
 *
 *   x = rmsnorm(h += delta) * ln1[l]            (no add before layer 0)
 *   qkv = x @ Wqkv[l] (+ bias[l]); a = attention(qkv) (rotary, cache write; see above)
 *   x = rmsnorm(h += a @ Wo[l]) * ln2[l]
 *   delta = silu_mul(x @ Wgu[l]) @ Wdown[l]
 *
 * then out = rmsnorm(h += delta) * norm_w: the final hidden states. Exactly the calls
 * LlamaModel._forward_fused makes from Python one by one (same functions, order and
 * buffers), so the results are bitwise the same; what goes is ~250 Python-to-C round trips
 * a step (4-6 us each with the tensor bookkeeping around them). Every product must be on the
 * kernel: the caller checks that (fp32 rows beyond the kernel's go to the BLAS in Python).
 * h [N, Hd] is the residual stream (updated in place); weights and norms are arrays of L
 * pointers (bias entries may be NULL; bias == NULL: none); scratch: x, o, delta [N, Hd],
 * qkv [N, Wqkv], a [N, H * D], gu [N, 2 I], s [N, I]. */
void adaptspec_layers(int L, int N, int Hd, int Wqkv, int I, float* h, float eps,
                      const float* const* ln1, const void* const* wqkv, const float* const* bias,
                      const void* const* wo, const float* const* ln2, const void* const* wgu,
                      const void* const* wdown, int layout, const float* norm_w, float* out,
                      int B, const int* row_start, const int* block_tables, int max_blocks, int bs,
                      const int* cache_lens,
                      const float* cos_t, const float* sin_t, float* const* kcache, float* const* vcache,
                      int64_t block_stride, int64_t head_stride, int H, int Hkv, int D, float scale,
                      int max_ctx, float* x, float* qkv, float* a, float* o, float* gu, float* s,
                      float* delta, int nthreads) {
    const int HD = H * D;
    for (int l = 0; l < L; l++) {
        adaptspec_add_rms_norm(N, Hd, h, l ? delta : NULL, ln1[l], eps, x);
        adaptspec_small_gemm(N, Hd, Wqkv, x, Hd, wqkv[l], layout, qkv, Wqkv, nthreads);
        if (bias && bias[l])
            for (int n = 0; n < N; n++)
                for (int j = 0; j < Wqkv; j++) qkv[(int64_t)n * Wqkv + j] += bias[l][j];
        adaptspec_attention(B, row_start, block_tables, max_blocks, bs, cache_lens, qkv, Wqkv, cos_t, sin_t,
                            kcache[l], vcache[l], block_stride, head_stride, H, Hkv, D, scale, a, max_ctx, nthreads);
        adaptspec_small_gemm(N, HD, Hd, a, HD, wo[l], layout, o, Hd, nthreads);
        adaptspec_add_rms_norm(N, Hd, h, o, ln2[l], eps, x);
        adaptspec_small_gemm(N, Hd, 2 * I, x, Hd, wgu[l], layout, gu, 2 * I, nthreads);
        adaptspec_silu_mul(N, I, gu, s);
        adaptspec_small_gemm(N, I, Hd, s, I, wdown[l], layout, delta, Hd, nthreads);
    }
    adaptspec_add_rms_norm(N, Hd, h, L ? delta : NULL, norm_w, eps, out);
}
