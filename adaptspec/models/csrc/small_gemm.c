/* Small-M matrix multiply for CPU decoding and verification: y[M, O] = x[M, I] @ W[I, O].
 *
 * Decoding one token per sequence, or verifying k + 1 candidates, multiplies a handful of
 * rows by every weight matrix: the time is the time to stream the weights from memory. A
 * BLAS GEMM packs panels for an arithmetic intensity small M does not have and streams the
 * weights slower as soon as there are 2+ rows, so verifying 5 tokens cost well over
 * decoding 1. This kernel streams each weight once, whatever M is (tiles of TR rows run over a
 * weight block while it is in cache).
 *
 * Layout: W is packed by ``adaptspec.models.cpu_gemm.pack`` into column blocks of 32,
 * wp[nb][I][32] (nb = ceil(O / 32), zero-padded), so one block's weights are contiguous and
 * the hardware prefetcher sees one sequential stream per thread. fp32 or bf16 weights (bf16
 * widened to fp32 exactly); x and y are fp32; accumulation in fp32, rows in order of i.
 * bf16 blocks interleave their two halves (see load_bf16x2), so a shift and a mask widen a
 * 64-byte load to two fp32 vectors instead of GCC's shuffle-based conversion.
 *
 * Software prefetch: none by default; the hardware prefetcher follows each thread's one
 * sequential stream, and an explicit L1 prefetch ahead of each row measured slower.
 * Building with -DADAPTSPEC_PREFETCH=<bytes> puts the L1 prefetch back, for CPUs where it
 * helps.
 *
 * Written with GCC vector extensions of the target's native width (VW, below), so it builds
 * to AVX-512, AVX2 or NEON from one source (-O3 -march=native). Threads: OpenMP over column
 * blocks.
 *
 * bf16 on CPUs with AVX512_BF16 (``adaptspec_bf16_pairs() == 1``): a second layout, pairs,
 * wp[nb][ceil(I / 2)][32][2], the two weights of rows 2p and 2p + 1 of a column side by side,
 * and x rounded to bf16 (round to nearest even) in pairs the same way, so one VDPBF16PS does
 * 32 multiply-adds (16 columns x 2 rows, accumulated in fp32) where the widened layout needs
 * two FMAs and the widening: half the arithmetic per weight and row. Like every bf16 GEMM,
 * the activations are bf16; each row is still computed alone (same instructions, same order
 * whatever M is), so a token decoded alone and verified among candidates get bitwise the
 * same result.
 *
 * Measured timings of these choices: docs/benchmarks.md ("Kernel and forward timings").
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_DPBF16 1
#else
#define HAVE_DPBF16 0
#endif

#define BW 32
#ifdef ADAPTSPEC_PREFETCH
#define PF_AHEAD (ADAPTSPEC_PREFETCH)
#else
#define PF_AHEAD 0
#endif
/* Vectors of the target's native width, NV of them to a block row of 32 columns. GCC lowers
   a generic vector wider than the hardware's through the stack (every broadcast and every
   accumulator stored and reloaded): 64-byte vectors on an AVX2 CPU ran several times slower
   than torch's matmuls. TR: rows a tile runs over a block at once, as many as keep the accumulators
   (TR x NV), the block row's NV weights and the broadcast in registers (32 zmm on AVX-512,
   16 ymm on AVX2 or xmm on SSE, 32 q-registers on NEON). Each row is computed alone (the same
   operations in the same order whatever M and TR are). */
#if defined(__AVX512F__)
#define VW 16
#define TR 8
#elif defined(__AVX__)
#define VW 8
#define TR 2
#elif defined(__ARM_NEON) || defined(__aarch64__)
#define VW 4
#define TR 3
#else
#define VW 4
#define TR 1
#endif
#define NV (BW / VW)
typedef float vf __attribute__((vector_size(VW * 4)));
typedef uint32_t vu __attribute__((vector_size(VW * 4)));
/* the same, at any address (plain loads and stores; a memcpy into an array of vectors kept
   GCC from holding the array in registers) */
typedef float vf_u __attribute__((vector_size(VW * 4), aligned(4)));
typedef uint32_t vu_u __attribute__((vector_size(VW * 4), aligned(2)));

/* The 32 weights of one row of a block, as NV vectors in column order. */
static inline void load_f32(const float* p, vf* w) {
#pragma GCC unroll 8
    for (int v = 0; v < NV; v++) w[v] = *(const vf_u*)(p + v * VW);
}

/* bf16 blocks are stored interleaved: element 2j of a row's 32 is column j and element
   2j + 1 is column 16 + j. A 64-byte load read as 16 uint32 then has column j in the low
   and column 16 + j in the high half of lane j, and a shift and a mask widen both exactly:
   no shuffles (a plain 16 -> 32 bit conversion costs three shuffle-port operations per 16
   weights on AVX-512, which kept the loop below memory speed). Narrower vectors take the
   64 bytes in NV / 2 loads: load q holds columns q * VW.. in its low and 16 + q * VW.. in
   its high halves. */
static inline void load_bf16(const uint16_t* p, vf* w) {
#pragma GCC unroll 8
    for (int q = 0; q < NV / 2; q++) {
        vu u = *(const vu_u*)(p + q * 2 * VW);
        w[q] = (vf)(u << 16);
        w[NV / 2 + q] = (vf)(u & 0xFFFF0000u);
    }
}

#define KERNEL(R, NAME, WT, LOAD, LINES)                                               \
    static void NAME##_##R(int I, const float* x, int ldx, const WT* w, float* y,      \
                           int ldy, int bw) {                                          \
        vf a[R][NV];                                                                   \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                            \
            _Pragma("GCC unroll 8") for (int v = 0; v < NV; v++) a[r][v] = (vf){0};    \
        for (int i = 0; i < I; i++) {                                                  \
            for (int l = 0; PF_AHEAD && l < LINES; l++) /* off unless built with it */  \
                __builtin_prefetch(w + (int64_t)i * BW + (PF_AHEAD + 64 * l) / sizeof(WT), 0, 3); \
            vf wv[NV];                                                                 \
            LOAD(w + (int64_t)i * BW, wv);                                             \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                      \
                float xs = x[(int64_t)r * ldx + i];                                    \
                _Pragma("GCC unroll 8") for (int v = 0; v < NV; v++) a[r][v] += xs * wv[v]; \
            }                                                                          \
        }                                                                              \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                          \
            float tmp[BW];                                                             \
            _Pragma("GCC unroll 8") for (int v = 0; v < NV; v++)                       \
                *(vf_u*)(tmp + v * VW) = a[r][v];                                      \
            memcpy(y + (int64_t)r * ldy, tmp, (size_t)bw * sizeof(float));             \
        }                                                                              \
    }

#define ALL(NAME, WT, LOAD, LN)                                                        \
    KERNEL(1, NAME, WT, LOAD, LN) KERNEL(2, NAME, WT, LOAD, LN)                        \
    KERNEL(3, NAME, WT, LOAD, LN) KERNEL(4, NAME, WT, LOAD, LN)                        \
    KERNEL(5, NAME, WT, LOAD, LN) KERNEL(6, NAME, WT, LOAD, LN)                        \
    KERNEL(7, NAME, WT, LOAD, LN) KERNEL(8, NAME, WT, LOAD, LN)

ALL(kf32, float, load_f32, 2)
ALL(kbf16, uint16_t, load_bf16, 1)

typedef void (*kfn_f32)(int, const float*, int, const float*, float*, int, int);
typedef void (*kfn_bf16)(int, const float*, int, const uint16_t*, float*, int, int);
static const kfn_f32 KF32[9] = {0, kf32_1, kf32_2, kf32_3, kf32_4, kf32_5, kf32_6, kf32_7, kf32_8};
static const kfn_bf16 KBF16[9] = {0, kbf16_1, kbf16_2, kbf16_3, kbf16_4, kbf16_5, kbf16_6, kbf16_7, kbf16_8};

int adaptspec_small_gemm_version(void) { return 5; }

/* The vector width the library was built for (floats) and the rows of a tile. */
int adaptspec_small_gemm_lanes(void) { return VW; }
int adaptspec_small_gemm_tile_rows(void) { return TR; }

/* 1 when the bf16 pair layout (VDPBF16PS) is compiled in. */
int adaptspec_bf16_pairs(void) { return HAVE_DPBF16; }

/* fp32 -> bf16, round to nearest even; NaN stays NaN (quiet). */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#if HAVE_DPBF16
#define KERNEL_DP(R)                                                                   \
    static void kdp_##R(int P, const uint32_t* x, int ldx, const uint16_t* w, float* y, \
                        int ldy, int bw) {                                             \
        __m512 a0[R], a1[R];                                                           \
        for (int r = 0; r < R; r++) {                                                  \
            a0[r] = _mm512_setzero_ps();                                               \
            a1[r] = _mm512_setzero_ps();                                               \
        }                                                                              \
        for (int p = 0; p < P; p++) {                                                  \
            const uint16_t* wp = w + (int64_t)p * 2 * BW; /* 128 bytes: 2 lines */     \
            if (PF_AHEAD) {                                                            \
                __builtin_prefetch(wp + PF_AHEAD / 2, 0, 3);                           \
                __builtin_prefetch(wp + (PF_AHEAD + 64) / 2, 0, 3);                    \
            }                                                                          \
            __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp);                            \
            __m512bh w1 = (__m512bh)_mm512_loadu_si512(wp + BW);                       \
            for (int r = 0; r < R; r++) {                                              \
                __m512bh xv = (__m512bh)_mm512_set1_epi32((int)x[(int64_t)r * ldx + p]); \
                a0[r] = _mm512_dpbf16_ps(a0[r], xv, w0);                               \
                a1[r] = _mm512_dpbf16_ps(a1[r], xv, w1);                               \
            }                                                                          \
        }                                                                              \
        for (int r = 0; r < R; r++) {                                                  \
            float tmp[BW];                                                             \
            _mm512_storeu_ps(tmp, a0[r]);                                              \
            _mm512_storeu_ps(tmp + 16, a1[r]);                                         \
            memcpy(y + (int64_t)r * ldy, tmp, (size_t)bw * sizeof(float));             \
        }                                                                              \
    }
KERNEL_DP(1) KERNEL_DP(2) KERNEL_DP(3) KERNEL_DP(4)
KERNEL_DP(5) KERNEL_DP(6) KERNEL_DP(7) KERNEL_DP(8)
typedef void (*kfn_dp)(int, const uint32_t*, int, const uint16_t*, float*, int, int);
static const kfn_dp KDP[9] = {0, kdp_1, kdp_2, kdp_3, kdp_4, kdp_5, kdp_6, kdp_7, kdp_8};
#endif

/* y[M, O] (row stride ldy) = x[M, I] (row stride ldx) @ W; wp packed as above. Each thread
   takes whole column blocks and runs every tile of TR rows of x over a block while the block
   (I x 32 weights, 36-72 KB) stays in its cache: the weights come from memory once.
   layout: 0 fp32 blocks, 1 bf16 blocks (interleaved halves), 2 bf16 pairs (see the top;
   only where adaptspec_bf16_pairs() says so, otherwise nothing is written). */
void adaptspec_small_gemm(int M, int I, int O, const float* x, int ldx, const void* wp, int layout,
                          float* y, int ldy, int nthreads) {
    const int nb = (O + BW - 1) / BW;
    const int P = (I + 1) / 2;  /* pairs of input rows (layout 2) */
    uint16_t* xb = NULL;        /* x rounded to bf16, in pairs (layout 2) */
    (void)P;                    /* unused where the pair kernel is not compiled in */
    if (layout == 2) {
#if HAVE_DPBF16
        xb = malloc(sizeof(uint16_t) * 2 * (size_t)P * (size_t)(M > 0 ? M : 1));
        if (!xb) return;
        for (int r = 0; r < M; r++) {
            uint16_t* d = xb + (int64_t)r * 2 * P;
            const float* s = x + (int64_t)r * ldx;
            for (int i = 0; i < I; i++) d[i] = to_bf16(s[i]);
            if (I & 1) d[I] = 0;
        }
#else
        return;
#endif
    }
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int b = 0; b < nb; b++) {
        const int j0 = b * BW;
        const int bw = O - j0 < BW ? O - j0 : BW;
        for (int m0 = 0; m0 < M; m0 += TR) {
            const int R = M - m0 < TR ? M - m0 : TR;
            float* yr = y + (int64_t)m0 * ldy + j0;
#if HAVE_DPBF16
            if (layout == 2) {
                KDP[R](P, (const uint32_t*)xb + (int64_t)m0 * P, P,
                       (const uint16_t*)wp + (int64_t)b * P * 2 * BW, yr, ldy, bw);
                continue;
            }
#endif
            const float* xr = x + (int64_t)m0 * ldx;
            if (layout == 1)
                KBF16[R](I, xr, ldx, (const uint16_t*)wp + (int64_t)b * I * BW, yr, ldy, bw);
            else
                KF32[R](I, xr, ldx, (const float*)wp + (int64_t)b * I * BW, yr, ldy, bw);
        }
    }
    free(xb);
}
