/* ============================================================================
 * GEMM: C (M, N) = alpha * A (M, K) B (K, N) + beta * C, f32, for the CPU backend.
 *
 * Layout of the arguments (element strides, so transposed and sliced views need no copy):
 *     A(i, k) = A[i*rsa + k*csa]      B(k, j) = B[k*rsb + j*csb]      C(i, j) = C[i*ldc + j]
 *
 * The algorithm is the one of GotoBLAS / BLIS:
 *
 *     for jc in N by NC                      B block  (KC, NC): lives in L3
 *       for pc in K by KC                    pack B(pc:pc+KC, jc:jc+NC) into NR-wide panels
 *         for ic in M by MC                  pack A(ic:ic+MC, pc:pc+KC) into MR-tall panels
 *           for jr in NC by NR               B micro-panel (KC, NR): stays in L1
 *             for ir in MC by MR             A micro-panel (MR, KC): streamed from L2
 *               micro-kernel: C(MR, NR) tile = alpha * sum_k a(:, k) b(k, :) + beta * C
 *
 * Micro-kernels (register blocked, written with intrinsics, each compiled for its ISA with
 * __attribute__((target)), so the application needs no -mavx2 / -march flag; the best one
 * the CPU supports is picked at the first call with __builtin_cpu_supports):
 *     kernel   MR x NR   MC   KC   NC     registers
 *     avx512   8 x 32    64   256  1024   16 zmm accumulators (2 vectors of 16 per row)
 *     avx2     6 x 16    96   256  1024   12 ymm accumulators, FMA
 *     neon     8 x 12    128  256  1536   24 q accumulators, FMA by lane (AArch64)
 *     generic  4 x 16    128  256  1024   portable C (other compilers and CPUs)
 * The avx512 blocks were measured on Sapphire Rapids (48 KiB L1d, 2 MiB L2): the B
 * micro-panel (32 KiB) stays in L1 and a small A block (64 KiB) close by; larger MC lost
 * 10-15% on large squares. Packing uses 8x8 AVX transposes for the transposed layouts,
 * prefetching the next 8 rows as it goes: a product of one row (a generation step's linear
 * layers, W^T) packs the whole weight from memory each call, and the rows' starts were stalls
 * (decoding the small GPT: 13.3-15.3 -> 8.1-10.8 ms a token on this project's 2-vCPU machine).
 * The avx2 kernel runs on AMD's cores too (Zen 4 in a VM that hides AVX-512: 32 KiB L1d, 1 MiB
 * L2), where masked moves (vmaskmovps) are slow: full tiles and panels use plain loads and
 * stores, masks only a partial one; and the kernel prefetches its C rows before the k loop, as
 * BLIS's does (rows a large leading dimension apart missed every cache by the time the loop
 * ended: 2048² went 71 -> 82 GFLOPS). 1 thread: 0.74-0.84x OpenBLAS's Zen kernels before,
 * 1.09-1.10x after (other MC, KC, NC did not help).
 * The environment variable DTRAIN_GEMM_KERNEL=avx512|avx2|neon|generic forces a kernel (for
 * tests and benchmarks; an unsupported choice is ignored).
 *
 * Edge tiles (M, N not multiples of MR, NR) run the same micro-kernel on zero-padded panels
 * and store through masks (their part of the tile only), so every element of C is computed by exactly the same sequence
 * of operations wherever it lies: an FMA chain over k inside each KC block (the K blocking
 * depends only on K), then C = alpha * acc + beta * C with beta = 1 after the first block.
 * Threads split C into column (or row) slabs of whole panels, each worker packing its own
 * panels into its dtr__pool_scratch buffer: results are bitwise identical for any thread
 * count. beta == 0 never reads C (NaN in C is overwritten). K == 0 or alpha == 0 scale C
 * by beta without reading A or B.
 *
 * With DTR_USE_CBLAS defined, calls go to cblas_sgemm whenever each of A and B has a unit
 * stride in one dimension (then the result follows that BLAS's threading and rounding);
 * otherwise the own kernels run. dtr__gemm_kernel_name() then reports "cblas".
 *
 * Memory: packing buffers come from the pool's per-worker scratch, sized for the kernel's
 * full blocks (about 1.1 MiB per worker for avx512) and grown on the calling thread before
 * the workers start, so only the first GEMM on a pool allocates. With p == NULL a buffer of
 * the size this call needs is allocated and freed; if memory cannot be had, a plain triple
 * loop computes the result instead (slow, never wrong).
 *
 * dtr__gemm_on(p, worker, ...) is the same product run entirely on the calling thread with
 * worker `worker`'s scratch, for pool tasks that already split their work (convolutions
 * over samples); its results are bitwise those of dtr__gemm.
 *
 * Thread safety: any number of concurrent calls with different pools (or NULL); one
 * dtr__gemm at a time per pool, and dtr__gemm_on only from the task running as `worker`.
 * A pool task that calls dtr__gemm with its own pool runs it serially on its worker index
 * (see threadpool.c), sharing that worker's scratch.
 * ==========================================================================*/
#include "../public/api.h"
#include "internal.h"

#ifdef DTR_USE_CBLAS
#include <cblas.h>
#endif

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(DTR_NO_SIMD)
#define DTR__GEMM_X86 1
#include <immintrin.h>
#define DTR__GEMM_TARGET_AVX512 __attribute__((target("avx512f")))
#define DTR__GEMM_TARGET_AVX2 __attribute__((target("avx2,fma")))
#else
#define DTR__GEMM_X86 0
#endif
#if defined(__aarch64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(DTR_NO_SIMD)
#define DTR__GEMM_NEON 1   /* Advanced SIMD is part of every ARMv8-A core: no run-time check */
#include <arm_neon.h>
#else
#define DTR__GEMM_NEON 0
#endif

/* ---- kernel table ---- */

/** Micro-kernel: the (mv, nv) top-left part of the MR x NR tile at c (row stride ldc)
 *  receives alpha * sum_{k < kc} a[k*MR + i] b[k*NR + j] (+ beta * C when load_c). */
typedef void (*dtr__gemm_ukr)(int64_t kc, const float *a, const float *b, float *c, int64_t ldc,
                              float alpha, float beta, int mv, int nv, int load_c);

/** Packs an (mb, kb) block of A into MR-tall panels (rows past mb zero). */
typedef void (*dtr__gemm_pack_a_fn)(const float *A, int64_t rsa, int64_t csa, int64_t mb, int64_t kb,
                                    int mr, float *dst);
/** Packs a (kb, nb) block of B into NR-wide panels (columns past nb zero). */
typedef void (*dtr__gemm_pack_b_fn)(const float *B, int64_t rsb, int64_t csb, int64_t kb, int64_t nb,
                                    int nr, float *dst);

typedef struct dtr__gemm_kernel {
    const char *name;
    int mr, nr;            /* register tile */
    int64_t mc, kc, nc;    /* cache blocks: A block (mc, kc) in L2, B panel (kc, nr) in L1 */
    dtr__gemm_ukr ukr;
    dtr__gemm_pack_a_fn pack_a;
    dtr__gemm_pack_b_fn pack_b;
} dtr__gemm_kernel;

/* Work below this many flops per thread is not worth waking a worker. */
#define DTR__GEMM_MIN_FLOPS_PER_THREAD 100000.0

static int64_t dtr__gemm_min64(int64_t a, int64_t b) { return a < b ? a : b; }
static int64_t dtr__gemm_ceil(int64_t a, int64_t b) { return (a + b - 1) / b; }

/* ---- packing (portable) ---- */

/** Packs A (mb, kb) into MR-tall panels: panel p holds a[k*MR + i] = A(p*MR + i, k), rows
 *  past mb are zero. */
static void dtr__gemm_pack_a(const float *A, int64_t rsa, int64_t csa, int64_t mb, int64_t kb,
                             int mr, float *dst) {
    int64_t i0, k;
    int i;
    for (i0 = 0; i0 < mb; i0 += mr) {
        int rows = (int)dtr__gemm_min64(mr, mb - i0);
        const float *src = A + i0 * rsa;
        if (rows == mr && csa == 1) {
            for (i = 0; i < mr; i++) {
                const float *s = src + i * rsa;
                for (k = 0; k < kb; k++) dst[k * mr + i] = s[k];
            }
        } else if (rows == mr && rsa == 1) {
            for (k = 0; k < kb; k++) memcpy(dst + k * mr, src + k * csa, (size_t)mr * sizeof(float));
        } else {
            for (k = 0; k < kb; k++) {
                for (i = 0; i < rows; i++) dst[k * mr + i] = src[i * rsa + k * csa];
                for (; i < mr; i++) dst[k * mr + i] = 0.0f;
            }
        }
        dst += (int64_t)mr * kb;
    }
}

/** Packs B (kb, nb) into NR-wide panels: panel p holds b[k*NR + j] = B(k, p*NR + j), columns
 *  past nb are zero. */
static void dtr__gemm_pack_b(const float *B, int64_t rsb, int64_t csb, int64_t kb, int64_t nb,
                             int nr, float *dst) {
    int64_t j0, k;
    int j;
    for (j0 = 0; j0 < nb; j0 += nr) {
        int cols = (int)dtr__gemm_min64(nr, nb - j0);
        const float *src = B + j0 * csb;
        if (cols == nr && csb == 1) {
            for (k = 0; k < kb; k++) memcpy(dst + k * nr, src + k * rsb, (size_t)nr * sizeof(float));
        } else if (rsb == 1) {
            for (j = 0; j < cols; j++) {
                const float *s = src + j * csb;
                for (k = 0; k < kb; k++) dst[k * nr + j] = s[k];
            }
            for (k = 0; k < kb; k++)
                for (j = cols; j < nr; j++) dst[k * nr + j] = 0.0f;
        } else {
            for (k = 0; k < kb; k++) {
                for (j = 0; j < cols; j++) dst[k * nr + j] = src[k * rsb + j * csb];
                for (; j < nr; j++) dst[k * nr + j] = 0.0f;
            }
        }
        dst += (int64_t)nr * kb;
    }
}

/* ---- portable C micro-kernel ---- */

#define DTR__GEMM_GEN_MR 4
#define DTR__GEMM_GEN_NR 16

static void dtr__gemm_ukr_generic(int64_t kc, const float *a, const float *b, float *c, int64_t ldc,
                                  float alpha, float beta, int mv, int nv, int load_c) {
    float acc[DTR__GEMM_GEN_MR][DTR__GEMM_GEN_NR];
    int64_t k;
    int i, j;
    for (i = 0; i < DTR__GEMM_GEN_MR; i++)
        for (j = 0; j < DTR__GEMM_GEN_NR; j++) acc[i][j] = 0.0f;
    for (k = 0; k < kc; k++) {
        for (i = 0; i < DTR__GEMM_GEN_MR; i++) {
            float ai = a[i];
            for (j = 0; j < DTR__GEMM_GEN_NR; j++) acc[i][j] += ai * b[j];
        }
        a += DTR__GEMM_GEN_MR;
        b += DTR__GEMM_GEN_NR;
    }
    for (i = 0; i < mv; i++) {
        float *ci = c + i * ldc;
        if (load_c) {
            for (j = 0; j < nv; j++) ci[j] = alpha * acc[i][j] + beta * ci[j];
        } else {
            for (j = 0; j < nv; j++) ci[j] = alpha * acc[i][j];
        }
    }
}

/* ---- epilogue of the SIMD kernels ---- */

#if DTR__GEMM_X86 || DTR__GEMM_NEON
/* Epilogue modes, from the general C = alpha * acc + beta * C (fma(alpha, acc, beta * C)):
 * 0: acc, 1: alpha * acc (C not read), 2: acc + C, 3: fma(alpha, acc, C), 4: general. The
 * shortcuts leave out only multiplications by 1, so every mode rounds like the general one. */
static int dtr__gemm_epilogue_mode(float alpha, float beta, int load_c) {
    if (!load_c) return alpha == 1.0f ? 0 : 1;
    if (beta == 1.0f) return alpha == 1.0f ? 2 : 3;
    return 4;
}
#endif

#if DTR__GEMM_X86

/* ---- AVX-512 micro-kernel (8 x 32) ---- */

/* One row of the tile: two 16-float vectors under masks m0, m1. */
#define DTR__GEMM_AVX512_STORE_ROW(i)                                                           \
    if ((i) < mv) {                                                                             \
        float *ci = c + (int64_t)(i) * ldc;                                                     \
        if (mode >= 2) {                                                                        \
            __m512 o0 = _mm512_maskz_loadu_ps(m0, ci), o1 = _mm512_maskz_loadu_ps(m1, ci + 16); \
            if (mode == 2) {                                                                    \
                c##i##0 = _mm512_add_ps(c##i##0, o0);                                           \
                c##i##1 = _mm512_add_ps(c##i##1, o1);                                           \
            } else {                                                                            \
                if (mode == 4) { o0 = _mm512_mul_ps(vb, o0); o1 = _mm512_mul_ps(vb, o1); }      \
                c##i##0 = _mm512_fmadd_ps(va, c##i##0, o0);                                     \
                c##i##1 = _mm512_fmadd_ps(va, c##i##1, o1);                                     \
            }                                                                                   \
        } else if (mode == 1) {                                                                 \
            c##i##0 = _mm512_mul_ps(va, c##i##0);                                               \
            c##i##1 = _mm512_mul_ps(va, c##i##1);                                               \
        }                                                                                       \
        _mm512_mask_storeu_ps(ci, m0, c##i##0);                                                 \
        _mm512_mask_storeu_ps(ci + 16, m1, c##i##1);                                            \
    }

#define DTR__GEMM_AVX512_FMA_ROW(i)                                                             \
    t = _mm512_set1_ps(a[i]);                                                                   \
    c##i##0 = _mm512_fmadd_ps(t, b0, c##i##0);                                                  \
    c##i##1 = _mm512_fmadd_ps(t, b1, c##i##1);

DTR__GEMM_TARGET_AVX512
static void dtr__gemm_ukr_avx512(int64_t kc, const float *a, const float *b, float *c, int64_t ldc,
                                 float alpha, float beta, int mv, int nv, int load_c) {
    __m512 c00 = _mm512_setzero_ps(), c01 = _mm512_setzero_ps();
    __m512 c10 = _mm512_setzero_ps(), c11 = _mm512_setzero_ps();
    __m512 c20 = _mm512_setzero_ps(), c21 = _mm512_setzero_ps();
    __m512 c30 = _mm512_setzero_ps(), c31 = _mm512_setzero_ps();
    __m512 c40 = _mm512_setzero_ps(), c41 = _mm512_setzero_ps();
    __m512 c50 = _mm512_setzero_ps(), c51 = _mm512_setzero_ps();
    __m512 c60 = _mm512_setzero_ps(), c61 = _mm512_setzero_ps();
    __m512 c70 = _mm512_setzero_ps(), c71 = _mm512_setzero_ps();
    __m512 va, vb;
    __mmask16 m0, m1;
    int64_t k;
    int i, mode;
    for (i = 0; i < mv; i++) {   /* C is needed after the k loop: fetch it meanwhile */
        _mm_prefetch((const char *)(c + i * ldc), _MM_HINT_T0);
        _mm_prefetch((const char *)(c + i * ldc + 31), _MM_HINT_T0);
    }
    for (k = 0; k < kc; k++) {
        __m512 b0 = _mm512_loadu_ps(b), b1 = _mm512_loadu_ps(b + 16), t;
        DTR__GEMM_AVX512_FMA_ROW(0) DTR__GEMM_AVX512_FMA_ROW(1)
        DTR__GEMM_AVX512_FMA_ROW(2) DTR__GEMM_AVX512_FMA_ROW(3)
        DTR__GEMM_AVX512_FMA_ROW(4) DTR__GEMM_AVX512_FMA_ROW(5)
        DTR__GEMM_AVX512_FMA_ROW(6) DTR__GEMM_AVX512_FMA_ROW(7)
        a += 8;
        b += 32;
    }
    va = _mm512_set1_ps(alpha);
    vb = _mm512_set1_ps(beta);
    mode = dtr__gemm_epilogue_mode(alpha, beta, load_c);
    m0 = (__mmask16)(nv >= 16 ? 0xFFFFu : (1u << nv) - 1u);
    m1 = (__mmask16)(nv >= 32 ? 0xFFFFu : nv <= 16 ? 0u : (1u << (nv - 16)) - 1u);
    DTR__GEMM_AVX512_STORE_ROW(0) DTR__GEMM_AVX512_STORE_ROW(1)
    DTR__GEMM_AVX512_STORE_ROW(2) DTR__GEMM_AVX512_STORE_ROW(3)
    DTR__GEMM_AVX512_STORE_ROW(4) DTR__GEMM_AVX512_STORE_ROW(5)
    DTR__GEMM_AVX512_STORE_ROW(6) DTR__GEMM_AVX512_STORE_ROW(7)
}

/* ---- SIMD packing (AVX2 for both x86 kernels, AVX-512 for 32-wide B panels) ---- */

/* Transposes the 8x8 block held in r0..r7 (row i in ri) in place, with t0..t7 as temporaries. */
#define DTR__GEMM_TRANSPOSE8(r0, r1, r2, r3, r4, r5, r6, r7, t0, t1, t2, t3, t4, t5, t6, t7)    \
    t0 = _mm256_unpacklo_ps(r0, r1); t1 = _mm256_unpackhi_ps(r0, r1);                           \
    t2 = _mm256_unpacklo_ps(r2, r3); t3 = _mm256_unpackhi_ps(r2, r3);                           \
    t4 = _mm256_unpacklo_ps(r4, r5); t5 = _mm256_unpackhi_ps(r4, r5);                           \
    t6 = _mm256_unpacklo_ps(r6, r7); t7 = _mm256_unpackhi_ps(r6, r7);                           \
    r0 = _mm256_shuffle_ps(t0, t2, 0x44); r1 = _mm256_shuffle_ps(t0, t2, 0xEE);                 \
    r2 = _mm256_shuffle_ps(t1, t3, 0x44); r3 = _mm256_shuffle_ps(t1, t3, 0xEE);                 \
    r4 = _mm256_shuffle_ps(t4, t6, 0x44); r5 = _mm256_shuffle_ps(t4, t6, 0xEE);                 \
    r6 = _mm256_shuffle_ps(t5, t7, 0x44); r7 = _mm256_shuffle_ps(t5, t7, 0xEE);                 \
    t0 = _mm256_permute2f128_ps(r0, r4, 0x20); t4 = _mm256_permute2f128_ps(r0, r4, 0x31);       \
    t1 = _mm256_permute2f128_ps(r1, r5, 0x20); t5 = _mm256_permute2f128_ps(r1, r5, 0x31);       \
    t2 = _mm256_permute2f128_ps(r2, r6, 0x20); t6 = _mm256_permute2f128_ps(r2, r6, 0x31);       \
    t3 = _mm256_permute2f128_ps(r3, r7, 0x20); t7 = _mm256_permute2f128_ps(r3, r7, 0x31);       \
    r0 = t0; r1 = t1; r2 = t2; r3 = t3; r4 = t4; r5 = t5; r6 = t6; r7 = t7;

/** dst[k*ld + i] = src[i*rs + k] for i < rows (zero for rows <= i < width) and k < kb, by 8x8
 *  register transposes; width lanes are stored per k: 8, or 6 with ld 6 (A's panels, whose rows
 *  are stored whole, in order, each over the next one's first two lanes). Missing rows read
 *  row 0 and are masked to zero afterwards. */
DTR__GEMM_TARGET_AVX2
static void dtr__gemm_transpose8_avx2(const float *src, int64_t rs, int64_t kb, int rows, int width,
                                      float *dst, int64_t ld) {
    const float *s1 = src + (rows > 1 ? 1 : 0) * rs, *s2 = src + (rows > 2 ? 2 : 0) * rs;
    const float *s3 = src + (rows > 3 ? 3 : 0) * rs, *s4 = src + (rows > 4 ? 4 : 0) * rs;
    const float *s5 = src + (rows > 5 ? 5 : 0) * rs, *s6 = src + (rows > 6 ? 6 : 0) * rs;
    const float *s7 = src + (rows > 7 ? 7 : 0) * rs;
    __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(rows), lane));
    __m256i wmask = _mm256_cmpgt_epi32(_mm256_set1_epi32(width), lane);
    int64_t k;
    int i;
    if (rows <= 0) {
        for (k = 0; k < kb; k++)
            for (i = 0; i < width; i++) dst[k * ld + i] = 0.0f;
        return;
    }
    for (k = 0; k + 8 <= kb; k += 8) {
        __m256 r0, r1;
        if (!(k & 15)) {   /* the next 8 rows' line at k: they are read next (as integers: past the end is no object) */
            uintptr_t next = (uintptr_t)(src + k) + (uintptr_t)(8 * rs) * sizeof(float);
            for (i = 0; i < 8; i++) _mm_prefetch((const char *)(next + (uintptr_t)(i * rs) * sizeof(float)), _MM_HINT_T0);
        }
        r0 = _mm256_loadu_ps(src + k), r1 = _mm256_loadu_ps(s1 + k);
        __m256 r2 = _mm256_loadu_ps(s2 + k), r3 = _mm256_loadu_ps(s3 + k);
        __m256 r4 = _mm256_loadu_ps(s4 + k), r5 = _mm256_loadu_ps(s5 + k);
        __m256 r6 = _mm256_loadu_ps(s6 + k), r7 = _mm256_loadu_ps(s7 + k);
        __m256 t0, t1, t2, t3, t4, t5, t6, t7;
        DTR__GEMM_TRANSPOSE8(r0, r1, r2, r3, r4, r5, r6, r7, t0, t1, t2, t3, t4, t5, t6, t7)
        if (rows < 8) {
            r0 = _mm256_and_ps(r0, keep); r1 = _mm256_and_ps(r1, keep);
            r2 = _mm256_and_ps(r2, keep); r3 = _mm256_and_ps(r3, keep);
            r4 = _mm256_and_ps(r4, keep); r5 = _mm256_and_ps(r5, keep);
            r6 = _mm256_and_ps(r6, keep); r7 = _mm256_and_ps(r7, keep);
        }
        if (width == 8) {
            _mm256_storeu_ps(dst + (k + 0) * ld, r0); _mm256_storeu_ps(dst + (k + 1) * ld, r1);
            _mm256_storeu_ps(dst + (k + 2) * ld, r2); _mm256_storeu_ps(dst + (k + 3) * ld, r3);
            _mm256_storeu_ps(dst + (k + 4) * ld, r4); _mm256_storeu_ps(dst + (k + 5) * ld, r5);
            _mm256_storeu_ps(dst + (k + 6) * ld, r6); _mm256_storeu_ps(dst + (k + 7) * ld, r7);
        } else {   /* width 6 = ld: each row's last two lanes spill into the next row's, stored next (masked
                      stores are slow on AMD's cores); the last row of the panel is masked */
            _mm256_storeu_ps(dst + (k + 0) * ld, r0); _mm256_storeu_ps(dst + (k + 1) * ld, r1);
            _mm256_storeu_ps(dst + (k + 2) * ld, r2); _mm256_storeu_ps(dst + (k + 3) * ld, r3);
            _mm256_storeu_ps(dst + (k + 4) * ld, r4); _mm256_storeu_ps(dst + (k + 5) * ld, r5);
            _mm256_storeu_ps(dst + (k + 6) * ld, r6);
            if (k + 8 < kb) _mm256_storeu_ps(dst + (k + 7) * ld, r7);
            else _mm256_maskstore_ps(dst + (k + 7) * ld, wmask, r7);
        }
    }
    for (; k < kb; k++)
        for (i = 0; i < width; i++) dst[k * ld + i] = i < rows ? src[i * rs + k] : 0.0f;
}

/** A panels of mr = 6 or 8 rows. */
DTR__GEMM_TARGET_AVX2
static void dtr__gemm_pack_a_avx2(const float *A, int64_t rsa, int64_t csa, int64_t mb, int64_t kb,
                                  int mr, float *dst) {
    __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256i wmask = _mm256_cmpgt_epi32(_mm256_set1_epi32(mr), lane);
    int64_t i0, k;
    for (i0 = 0; i0 < mb; i0 += mr) {
        const float *src = A + i0 * rsa;
        int rows = (int)dtr__gemm_min64(mr, mb - i0);
        if (csa == 1) {
            dtr__gemm_transpose8_avx2(src, rsa, kb, rows, mr, dst, mr);
        } else if (rsa == 1) {   /* plain loads and stores where they stay in bounds (see transpose8) */
            __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(rows), lane);
            int whole = i0 + 8 <= mb;
            for (k = 0; k < kb; k++) {
                __m256 v = whole ? _mm256_loadu_ps(src + k * csa) : _mm256_maskload_ps(src + k * csa, m);
                if (mr == 8 || k + 1 < kb) _mm256_storeu_ps(dst + k * mr, v);
                else _mm256_maskstore_ps(dst + k * mr, wmask, v);
            }
        } else {
            dtr__gemm_pack_a(src, rsa, csa, rows, kb, mr, dst);
        }
        dst += mr * kb;
    }
}

/** B panels of 16 columns. */
DTR__GEMM_TARGET_AVX2
static void dtr__gemm_pack_b_avx2(const float *B, int64_t rsb, int64_t csb, int64_t kb, int64_t nb,
                                  int nr, float *dst) {
    __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    int64_t j0, k;
    int g;
    for (j0 = 0; j0 < nb; j0 += 16) {
        const float *src = B + j0 * csb;
        int cols = (int)dtr__gemm_min64(16, nb - j0);
        if (csb == 1) {
            __m256i m0 = _mm256_cmpgt_epi32(_mm256_set1_epi32(cols), lane);
            __m256i m1 = _mm256_cmpgt_epi32(_mm256_set1_epi32(cols - 8), lane);
            for (k = 0; k < kb; k++) {   /* masked loads only for a panel's missing columns (slow on AMD's cores) */
                _mm256_storeu_ps(dst + k * 16, cols == 16 ? _mm256_loadu_ps(src + k * rsb) : _mm256_maskload_ps(src + k * rsb, m0));
                _mm256_storeu_ps(dst + k * 16 + 8, cols == 16 ? _mm256_loadu_ps(src + k * rsb + 8) : _mm256_maskload_ps(src + k * rsb + 8, m1));
            }
        } else if (rsb == 1) {
            for (g = 0; g < 2; g++) {
                int c = cols - 8 * g;
                dtr__gemm_transpose8_avx2(src + (c > 0 ? g * 8 * csb : 0), csb, kb, c < 0 ? 0 : c > 8 ? 8 : c, 8,
                                          dst + g * 8, 16);
            }
        } else {
            dtr__gemm_pack_b(src, rsb, csb, kb, cols, nr, dst);
        }
        dst += 16 * kb;
    }
}

/** B panels of 32 columns. */
DTR__GEMM_TARGET_AVX512
static void dtr__gemm_pack_b_avx512(const float *B, int64_t rsb, int64_t csb, int64_t kb, int64_t nb,
                                    int nr, float *dst) {
    int64_t j0, k;
    int g;
    for (j0 = 0; j0 < nb; j0 += 32) {
        const float *src = B + j0 * csb;
        int cols = (int)dtr__gemm_min64(32, nb - j0);
        if (csb == 1) {
            __mmask16 m0 = (__mmask16)(cols >= 16 ? 0xFFFFu : (1u << cols) - 1u);
            __mmask16 m1 = (__mmask16)(cols >= 32 ? 0xFFFFu : cols <= 16 ? 0u : (1u << (cols - 16)) - 1u);
            for (k = 0; k < kb; k++) {
                _mm512_storeu_ps(dst + k * 32, _mm512_maskz_loadu_ps(m0, src + k * rsb));
                _mm512_storeu_ps(dst + k * 32 + 16, _mm512_maskz_loadu_ps(m1, src + k * rsb + 16));
            }
        } else if (rsb == 1) {
            for (g = 0; g < 4; g++) {
                int c = cols - 8 * g;
                dtr__gemm_transpose8_avx2(src + (c > 0 ? g * 8 * csb : 0), csb, kb, c < 0 ? 0 : c > 8 ? 8 : c, 8,
                                          dst + g * 8, 32);
            }
        } else {
            dtr__gemm_pack_b(src, rsb, csb, kb, cols, nr, dst);
        }
        dst += 32 * kb;
    }
}

/* ---- AVX2 + FMA micro-kernel (6 x 16) ---- */

#define DTR__GEMM_AVX2_STORE_ROW(i)                                                             \
    if ((i) < mv) {                                                                             \
        float *ci = c + (int64_t)(i) * ldc;                                                     \
        if (mode >= 2) {                                                                        \
            __m256 o0 = full ? _mm256_loadu_ps(ci) : _mm256_maskload_ps(ci, m0);                \
            __m256 o1 = full ? _mm256_loadu_ps(ci + 8) : _mm256_maskload_ps(ci + 8, m1);        \
            if (mode == 2) {                                                                    \
                c##i##0 = _mm256_add_ps(c##i##0, o0);                                           \
                c##i##1 = _mm256_add_ps(c##i##1, o1);                                           \
            } else {                                                                            \
                if (mode == 4) { o0 = _mm256_mul_ps(vb, o0); o1 = _mm256_mul_ps(vb, o1); }      \
                c##i##0 = _mm256_fmadd_ps(va, c##i##0, o0);                                     \
                c##i##1 = _mm256_fmadd_ps(va, c##i##1, o1);                                     \
            }                                                                                   \
        } else if (mode == 1) {                                                                 \
            c##i##0 = _mm256_mul_ps(va, c##i##0);                                               \
            c##i##1 = _mm256_mul_ps(va, c##i##1);                                               \
        }                                                                                       \
        if (full) {                                                                             \
            _mm256_storeu_ps(ci, c##i##0);                                                      \
            _mm256_storeu_ps(ci + 8, c##i##1);                                                  \
        } else {                                                                                \
            _mm256_maskstore_ps(ci, m0, c##i##0);                                               \
            _mm256_maskstore_ps(ci + 8, m1, c##i##1);                                           \
        }                                                                                       \
    }

#define DTR__GEMM_AVX2_FMA_ROW(i)                                                               \
    t = _mm256_broadcast_ss(a + (i));                                                           \
    c##i##0 = _mm256_fmadd_ps(t, b0, c##i##0);                                                  \
    c##i##1 = _mm256_fmadd_ps(t, b1, c##i##1);

DTR__GEMM_TARGET_AVX2
static void dtr__gemm_ukr_avx2(int64_t kc, const float *a, const float *b, float *c, int64_t ldc,
                               float alpha, float beta, int mv, int nv, int load_c) {
    __m256 c00 = _mm256_setzero_ps(), c01 = _mm256_setzero_ps();
    __m256 c10 = _mm256_setzero_ps(), c11 = _mm256_setzero_ps();
    __m256 c20 = _mm256_setzero_ps(), c21 = _mm256_setzero_ps();
    __m256 c30 = _mm256_setzero_ps(), c31 = _mm256_setzero_ps();
    __m256 c40 = _mm256_setzero_ps(), c41 = _mm256_setzero_ps();
    __m256 c50 = _mm256_setzero_ps(), c51 = _mm256_setzero_ps();
    __m256 va, vb;
    __m256i lane, m0, m1;
    int64_t k;
    int mode, full = nv == 16;   /* whole rows: plain loads and stores (masked ones are slow on AMD's cores) */
    for (k = 0; k < mv; k++)   /* the C rows, read and written after the loop (a prefetch never faults) */
        _mm_prefetch((const char *)(c + k * ldc), _MM_HINT_T0), _mm_prefetch((const char *)(c + k * ldc + 15), _MM_HINT_T0);
    for (k = 0; k < kc; k++) {
        __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8), t;
        DTR__GEMM_AVX2_FMA_ROW(0) DTR__GEMM_AVX2_FMA_ROW(1) DTR__GEMM_AVX2_FMA_ROW(2)
        DTR__GEMM_AVX2_FMA_ROW(3) DTR__GEMM_AVX2_FMA_ROW(4) DTR__GEMM_AVX2_FMA_ROW(5)
        a += 6;
        b += 16;
    }
    va = _mm256_set1_ps(alpha);
    vb = _mm256_set1_ps(beta);
    mode = dtr__gemm_epilogue_mode(alpha, beta, load_c);
    lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    m0 = _mm256_cmpgt_epi32(_mm256_set1_epi32(nv), lane);
    m1 = _mm256_cmpgt_epi32(_mm256_set1_epi32(nv - 8), lane);
    DTR__GEMM_AVX2_STORE_ROW(0) DTR__GEMM_AVX2_STORE_ROW(1) DTR__GEMM_AVX2_STORE_ROW(2)
    DTR__GEMM_AVX2_STORE_ROW(3) DTR__GEMM_AVX2_STORE_ROW(4) DTR__GEMM_AVX2_STORE_ROW(5)
}

#endif /* DTR__GEMM_X86 */

#if DTR__GEMM_NEON

/* ---- NEON micro-kernel (8 x 12, AArch64) ---- */

/* 24 accumulators (8 rows of 3 vectors of 4) + 2 A vectors + 3 B vectors of the 32 registers;
 * each k is 24 FMAs by lane (vfmaq_laneq_f32), as BLIS's and OpenBLAS's ARMv8 kernels do. */
#define DTR__GEMM_NEON_MR 8
#define DTR__GEMM_NEON_NR 12

#define DTR__GEMM_NEON_FMA_ROW(i, av, lane)                                                      \
    c##i##0 = vfmaq_laneq_f32(c##i##0, b0, av, lane);                                            \
    c##i##1 = vfmaq_laneq_f32(c##i##1, b1, av, lane);                                            \
    c##i##2 = vfmaq_laneq_f32(c##i##2, b2, av, lane);

/* One row of the tile into t (row stride ldt) by the epilogue mode (see dtr__gemm_epilogue_mode). */
#define DTR__GEMM_NEON_STORE_ROW(i)                                                              \
    {                                                                                            \
        float *ti = t + (i) * ldt;                                                               \
        if (mode >= 2) {                                                                         \
            float32x4_t o0 = vld1q_f32(ti), o1 = vld1q_f32(ti + 4), o2 = vld1q_f32(ti + 8);      \
            if (mode == 2) {                                                                     \
                c##i##0 = vaddq_f32(c##i##0, o0);                                                \
                c##i##1 = vaddq_f32(c##i##1, o1);                                                \
                c##i##2 = vaddq_f32(c##i##2, o2);                                                \
            } else {                                                                             \
                if (mode == 4) { o0 = vmulq_f32(vb, o0); o1 = vmulq_f32(vb, o1); o2 = vmulq_f32(vb, o2); } \
                c##i##0 = vfmaq_f32(o0, va, c##i##0);                                            \
                c##i##1 = vfmaq_f32(o1, va, c##i##1);                                            \
                c##i##2 = vfmaq_f32(o2, va, c##i##2);                                            \
            }                                                                                    \
        } else if (mode == 1) {                                                                  \
            c##i##0 = vmulq_f32(va, c##i##0);                                                    \
            c##i##1 = vmulq_f32(va, c##i##1);                                                    \
            c##i##2 = vmulq_f32(va, c##i##2);                                                    \
        }                                                                                        \
        vst1q_f32(ti, c##i##0);                                                                  \
        vst1q_f32(ti + 4, c##i##1);                                                              \
        vst1q_f32(ti + 8, c##i##2);                                                              \
    }

/* Copies an (mv, nv) block between matrices of row strides lds and ldd. */
static void dtr__gemm_copy_tile(const float *src, int64_t lds, float *dst, int64_t ldd, int mv, int nv) {
    int i;
    for (i = 0; i < mv; i++) memcpy(dst + i * ldd, src + i * lds, (size_t)nv * sizeof(float));
}

static void dtr__gemm_ukr_neon(int64_t kc, const float *a, const float *b, float *c, int64_t ldc,
                               float alpha, float beta, int mv, int nv, int load_c) {
    float32x4_t c00 = vdupq_n_f32(0.0f), c01 = c00, c02 = c00, c10 = c00, c11 = c00, c12 = c00;
    float32x4_t c20 = c00, c21 = c00, c22 = c00, c30 = c00, c31 = c00, c32 = c00;
    float32x4_t c40 = c00, c41 = c00, c42 = c00, c50 = c00, c51 = c00, c52 = c00;
    float32x4_t c60 = c00, c61 = c00, c62 = c00, c70 = c00, c71 = c00, c72 = c00;
    float32x4_t va, vb;
    float tile[DTR__GEMM_NEON_MR * DTR__GEMM_NEON_NR], *t = c;
    int64_t k, ldt = ldc;
    int mode, edge = mv < DTR__GEMM_NEON_MR || nv < DTR__GEMM_NEON_NR;
    for (k = 0; k < kc; k++) {
        float32x4_t a0 = vld1q_f32(a), a1 = vld1q_f32(a + 4);
        float32x4_t b0 = vld1q_f32(b), b1 = vld1q_f32(b + 4), b2 = vld1q_f32(b + 8);
        DTR__GEMM_NEON_FMA_ROW(0, a0, 0) DTR__GEMM_NEON_FMA_ROW(1, a0, 1)
        DTR__GEMM_NEON_FMA_ROW(2, a0, 2) DTR__GEMM_NEON_FMA_ROW(3, a0, 3)
        DTR__GEMM_NEON_FMA_ROW(4, a1, 0) DTR__GEMM_NEON_FMA_ROW(5, a1, 1)
        DTR__GEMM_NEON_FMA_ROW(6, a1, 2) DTR__GEMM_NEON_FMA_ROW(7, a1, 3)
        a += DTR__GEMM_NEON_MR;
        b += DTR__GEMM_NEON_NR;
    }
    va = vdupq_n_f32(alpha);
    vb = vdupq_n_f32(beta);
    mode = dtr__gemm_epilogue_mode(alpha, beta, load_c);
    if (edge) {   /* through a full tile, so that edge elements round as inner ones */
        t = tile, ldt = DTR__GEMM_NEON_NR;
        memset(tile, 0, sizeof(tile));
        if (mode >= 2) dtr__gemm_copy_tile(c, ldc, tile, ldt, mv, nv);
    }
    DTR__GEMM_NEON_STORE_ROW(0) DTR__GEMM_NEON_STORE_ROW(1) DTR__GEMM_NEON_STORE_ROW(2)
    DTR__GEMM_NEON_STORE_ROW(3) DTR__GEMM_NEON_STORE_ROW(4) DTR__GEMM_NEON_STORE_ROW(5)
    DTR__GEMM_NEON_STORE_ROW(6) DTR__GEMM_NEON_STORE_ROW(7)
    if (edge) dtr__gemm_copy_tile(tile, ldt, c, ldc, mv, nv);
}

#endif /* DTR__GEMM_NEON */

/* ---- kernel selection ---- */

static const dtr__gemm_kernel dtr__gemm_kernels[] = {
    { "generic", DTR__GEMM_GEN_MR, DTR__GEMM_GEN_NR, 128, 256, 1024, dtr__gemm_ukr_generic,
      dtr__gemm_pack_a, dtr__gemm_pack_b },
#if DTR__GEMM_X86
    { "avx2", 6, 16, 96, 256, 1024, dtr__gemm_ukr_avx2, dtr__gemm_pack_a_avx2, dtr__gemm_pack_b_avx2 },
    { "avx512", 8, 32, 64, 256, 1024, dtr__gemm_ukr_avx512, dtr__gemm_pack_a_avx2, dtr__gemm_pack_b_avx512 },
#endif
#if DTR__GEMM_NEON
    { "neon", DTR__GEMM_NEON_MR, DTR__GEMM_NEON_NR, 128, 256, 1536, dtr__gemm_ukr_neon, dtr__gemm_pack_a,
      dtr__gemm_pack_b },
#endif
};

static int dtr__gemm_choice = -1;   /* index into dtr__gemm_kernels, set at the first call */
#if DTR__HAVE_ATOMICS
#define DTR__GEMM_CHOICE_GET() DTR__ATOMIC_LOAD_RELAXED(&dtr__gemm_choice)
#define DTR__GEMM_CHOICE_SET(v) DTR__ATOMIC_STORE_RELAXED(&dtr__gemm_choice, (v))
#else
#define DTR__GEMM_CHOICE_GET() dtr__gemm_choice
#define DTR__GEMM_CHOICE_SET(v) (dtr__gemm_choice = (v))
#endif

/* 1 when this CPU runs kernel idx of dtr__gemm_kernels (NEON: every AArch64 CPU) */
static int dtr__gemm_supported(int idx) {
#if DTR__GEMM_X86
    __builtin_cpu_init();
    if (idx == 1) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (idx == 2) return __builtin_cpu_supports("avx512f");
#endif
    return idx == 0 || DTR__GEMM_NEON;
}

#define DTR__GEMM_NKERNELS ((int)(sizeof(dtr__gemm_kernels) / sizeof(dtr__gemm_kernels[0])))

/* the index of the kernel called name when this CPU runs it, else -1 */
static int dtr__gemm_find(const char *name) {
    int i;
    for (i = 0; name && i < DTR__GEMM_NKERNELS; i++)
        if (strcmp(name, dtr__gemm_kernels[i].name) == 0) return dtr__gemm_supported(i) ? i : -1;
    return -1;
}

static const dtr__gemm_kernel *dtr__gemm_pick(void) {
    int idx = DTR__GEMM_CHOICE_GET();
    if (idx < 0) {
        int i = dtr__gemm_find(getenv("DTRAIN_GEMM_KERNEL"));
        for (idx = DTR__GEMM_NKERNELS - 1; idx > 0 && i < 0; idx--)   /* else the last one it runs */
            if (dtr__gemm_supported(idx)) break;
        if (i >= 0) idx = i;
        DTR__GEMM_CHOICE_SET(idx);   /* every thread that races here computes the same value */
    }
    return &dtr__gemm_kernels[idx];
}

int dtr__gemm_force(const char *name) {
    int i = dtr__gemm_find(name);
    if (name && i < 0) return 0;
    DTR__GEMM_CHOICE_SET(i);
    return 1;
}

static int dtr__simd_state = -1;   /* dtr__simd_level's answer; -1 until the first call */

#if DTR__HAVE_ATOMICS
#define DTR__SIMD_GET() DTR__ATOMIC_LOAD_RELAXED(&dtr__simd_state)
#define DTR__SIMD_SET(v) DTR__ATOMIC_STORE_RELAXED(&dtr__simd_state, (v))
#else
#define DTR__SIMD_GET() dtr__simd_state
#define DTR__SIMD_SET(v) (dtr__simd_state = (v))
#endif

/* the best element-loop variant compiled in that this CPU runs: 2 AVX-512, 1 AVX2, 0 none */
static int dtr__simd_can(void) { return !DTR__X86_SIMD ? 0 : !dtr__gemm_supported(1) ? 0 : dtr__gemm_supported(2) ? 2 : 1; }

int dtr__simd_level(void) {
    int s = DTR__SIMD_GET();
    if (s < 0) {
        const char *e = getenv("DTRAIN_SIMD");
        s = dtr__simd_can();
        if (e && strcmp(e, "generic") == 0) s = 0;
        else if (e && strcmp(e, "avx2") == 0 && s > 1) s = 1;
        DTR__SIMD_SET(s);   /* every thread that races here computes the same value */
    }
    return s;
}

int dtr__simd_avx2(void) { return dtr__simd_level() > 0; }

void dtr__simd_force(int level) { DTR__SIMD_SET(level < 0 ? -1 : level < dtr__simd_can() ? level : dtr__simd_can()); }

const char *dtr__gemm_kernel_name(void) {
#ifdef DTR_USE_CBLAS
    return "cblas";
#else
    return dtr__gemm_pick()->name;
#endif
}

/* ---- blocked driver ---- */

typedef struct dtr__gemm_job {
    const dtr__gemm_kernel *kern;
    int64_t M, N, K;
    int64_t kc;                 /* K block used for every block but possibly the last */
    int64_t mc, nc;             /* M and N blocks (multiples of MR and NR) */
    float alpha, beta;
    const float *A; int64_t rsa, csa;
    const float *B; int64_t rsb, csb;
    float *C; int64_t ldc;
    const float *bpre;          /* B packed ahead (dtr__gemm_bpack), or NULL: packed per block */
    dtr__gemm_bgen bgen;        /* B made per block by this producer (B NULL), or NULL */
    void *bgen_user;
    int split_n;                /* work units: NR-column panels (1) or MR-row panels (0) */
    dtr__pool *pool;            /* NULL: a private buffer of the exact size */
} dtr__gemm_job;

/** Floats of packing memory one worker needs: an A block (*a_floats, a multiple of 16 so
 *  that the B block after it stays 64-byte aligned) and a B block. For pool scratch these
 *  are the kernel's full block sizes, so that the first GEMM grows the scratch once for
 *  every later shape; for a one-off buffer (exact) the sizes this call uses. */
static size_t dtr__gemm_buf_floats(const dtr__gemm_job *j, int exact, int64_t *a_floats) {
    const dtr__gemm_kernel *kn = j->kern;
    int64_t mc = exact ? j->mc : kn->mc, kc = exact ? j->kc : kn->kc, nc = exact ? j->nc : kn->nc;
    *a_floats = (mc * kc + 15) & ~(int64_t)15;
    return (size_t)(*a_floats + kc * nc);
}

/** Computes the slab C(m0:m1, n0:n1) with packing memory `buf`. */
static void dtr__gemm_slab(const dtr__gemm_job *j, int64_t m0, int64_t m1, int64_t n0, int64_t n1,
                           float *buf) {
    const dtr__gemm_kernel *kn = j->kern;
    int64_t a_floats, jc, pc, ic, jr, ir;
    float *apack, *bpack;
    dtr__gemm_buf_floats(j, j->pool == NULL, &a_floats);
    apack = buf;
    bpack = buf + a_floats;
    for (jc = n0; jc < n1; jc += j->nc) {
        int64_t nb = dtr__gemm_min64(j->nc, n1 - jc);
        for (pc = 0; pc < j->K; pc += j->kc) {
            int64_t kb = dtr__gemm_min64(j->kc, j->K - pc);
            int load_c = pc > 0 || j->beta != 0.0f;
            float beta = pc > 0 ? 1.0f : j->beta;
            const float *bblock = j->bpre ? j->bpre + pc * dtr__gemm_ceil(j->N, kn->nr) * kn->nr + jc * kb : bpack;
            if (j->bgen) j->bgen(j->bgen_user, pc, kb, jc, nb, kn->nr, bpack);
            else if (!j->bpre) kn->pack_b(j->B + pc * j->rsb + jc * j->csb, j->rsb, j->csb, kb, nb, kn->nr, bpack);
            for (ic = m0; ic < m1; ic += j->mc) {
                int64_t mb = dtr__gemm_min64(j->mc, m1 - ic);
                kn->pack_a(j->A + ic * j->rsa + pc * j->csa, j->rsa, j->csa, mb, kb, kn->mr, apack);
                for (jr = 0; jr < nb; jr += kn->nr) {
                    int nv = (int)dtr__gemm_min64(kn->nr, nb - jr);
                    const float *bp = bblock + jr * kb;
                    for (ir = 0; ir < mb; ir += kn->mr) {
                        int mv = (int)dtr__gemm_min64(kn->mr, mb - ir);
                        kn->ukr(kb, apack + ir * kb, bp, j->C + (ic + ir) * j->ldc + jc + jr, j->ldc,
                                j->alpha, beta, mv, nv, load_c);
                    }
                }
            }
        }
    }
}

static void dtr__gemm_naive(int64_t M, int64_t N, int64_t K, float alpha,
                            const float *A, int64_t rsa, int64_t csa,
                            const float *B, int64_t rsb, int64_t csb,
                            float beta, float *C, int64_t ldc);

/** Pool task: units [begin, end) are panels along N (split_n) or M. */
static void dtr__gemm_task(void *arg, int64_t begin, int64_t end, int worker) {
    const dtr__gemm_job *j = (const dtr__gemm_job *)arg;
    int64_t a_floats, m0 = 0, m1 = j->M, n0 = 0, n1 = j->N;
    size_t floats = dtr__gemm_buf_floats(j, 0, &a_floats);
    float *buf = (float *)dtr__pool_scratch(j->pool, worker, floats * sizeof(float));
    if (j->split_n) {
        n0 = begin * j->kern->nr;
        n1 = dtr__gemm_min64(end * j->kern->nr, j->N);
    } else {
        m0 = begin * j->kern->mr;
        m1 = dtr__gemm_min64(end * j->kern->mr, j->M);
    }
    if (buf) {
        dtr__gemm_slab(j, m0, m1, n0, n1, buf);
    } else {   /* only when run nested on a worker whose scratch could not grow */
        dtr__gemm_naive(m1 - m0, n1 - n0, j->K, j->alpha, j->A + m0 * j->rsa, j->rsa, j->csa,
                        j->B + n0 * j->csb, j->rsb, j->csb, j->beta, j->C + m0 * j->ldc + n0, j->ldc);
    }
}

/* ---- simple paths ---- */

/** C = beta * C (beta == 0 writes zeros without reading C). */
static void dtr__gemm_scale_c(int64_t M, int64_t N, float beta, float *C, int64_t ldc) {
    int64_t i, j;
    for (i = 0; i < M; i++) {
        float *ci = C + i * ldc;
        if (beta == 0.0f) {
            for (j = 0; j < N; j++) ci[j] = 0.0f;
        } else if (beta != 1.0f) {
            for (j = 0; j < N; j++) ci[j] *= beta;
        }
    }
}

/** Triple loop without any memory: the fallback when packing memory cannot be had. */
static void dtr__gemm_naive(int64_t M, int64_t N, int64_t K, float alpha,
                            const float *A, int64_t rsa, int64_t csa,
                            const float *B, int64_t rsb, int64_t csb,
                            float beta, float *C, int64_t ldc) {
    int64_t i, j, k;
    for (i = 0; i < M; i++) {
        for (j = 0; j < N; j++) {
            float acc = 0.0f;
            for (k = 0; k < K; k++) acc += A[i * rsa + k * csa] * B[k * rsb + j * csb];
            C[i * ldc + j] = beta == 0.0f ? alpha * acc : alpha * acc + beta * C[i * ldc + j];
        }
    }
}

#ifdef DTR_USE_CBLAS
/** Row-major BLAS description of an (R, S) operand with strides (rs, cs): sets *trans and
 *  *ld and returns 1, or returns 0 when neither dimension has a unit stride. */
static int dtr__gemm_blas_desc(int64_t R, int64_t S, int64_t rs, int64_t cs, int *trans, int64_t *ld) {
    int64_t minr = R > 1 ? R : 1, mins = S > 1 ? S : 1;
    if ((cs == 1 || S == 1) && (R == 1 || rs >= mins)) {
        *trans = 0;
        *ld = R == 1 ? mins : rs;
        return 1;
    }
    if ((rs == 1 || R == 1) && (S == 1 || cs >= minr)) {
        *trans = 1;
        *ld = S == 1 ? minr : cs;
        return 1;
    }
    return 0;
}

static int dtr__gemm_cblas(int64_t M, int64_t N, int64_t K, float alpha,
                           const float *A, int64_t rsa, int64_t csa,
                           const float *B, int64_t rsb, int64_t csb,
                           float beta, float *C, int64_t ldc) {
    int ta, tb;
    int64_t lda, ldb, big = 0x7fffffff;
    if (!dtr__gemm_blas_desc(M, K, rsa, csa, &ta, &lda)) return 0;
    if (!dtr__gemm_blas_desc(K, N, rsb, csb, &tb, &ldb)) return 0;
    if (M == 1 && ldc < N) ldc = N;
    if (ldc < N || M > big || N > big || K > big || lda > big || ldb > big || ldc > big) return 0;
    cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
                (int)M, (int)N, (int)K, alpha, A, (int)lda, B, (int)ldb, beta, C, (int)ldc);
    return 1;
}
#endif

/* ---- entry points ---- */

/** The K block of a product of depth K: blocks of near-equal size (a function of K only: fixes
 *  the summation order). */
static int64_t dtr__gemm_kc(const dtr__gemm_kernel *kn, int64_t K) { return dtr__gemm_ceil(K, dtr__gemm_ceil(K, kn->kc)); }

/** Fills the job for a call (kernel, K/M/N blocks). Returns 0 when nothing more is to be done
 *  (empty C, K == 0 or alpha == 0 handled here, or cblas took the call). */
static int dtr__gemm_setup(dtr__gemm_job *j, dtr__pool *p, int64_t M, int64_t N, int64_t K, float alpha,
                           const float *A, int64_t rsa, int64_t csa,
                           const float *B, int64_t rsb, int64_t csb,
                           float beta, float *C, int64_t ldc) {
    const dtr__gemm_kernel *kn;
    if (M <= 0 || N <= 0) return 0;
    if (K <= 0 || alpha == 0.0f) {
        dtr__gemm_scale_c(M, N, beta, C, ldc);
        return 0;
    }
#ifdef DTR_USE_CBLAS
    if (B && dtr__gemm_cblas(M, N, K, alpha, A, rsa, csa, B, rsb, csb, beta, C, ldc)) return 0;
#endif
    kn = dtr__gemm_pick();
    memset(j, 0, sizeof(*j));
    j->kern = kn;
    j->M = M; j->N = N; j->K = K;
    j->alpha = alpha; j->beta = beta;
    j->A = A; j->rsa = rsa; j->csa = csa;
    j->B = B; j->rsb = rsb; j->csb = csb;
    j->C = C; j->ldc = ldc;
    j->pool = p;
    j->kc = dtr__gemm_kc(kn, K);
    j->mc = dtr__gemm_min64(kn->mc, dtr__gemm_ceil(M, kn->mr) * kn->mr);
    j->nc = dtr__gemm_min64(kn->nc, dtr__gemm_ceil(N, kn->nr) * kn->nr);
    return 1;
}

/** The triple loop of a job whose B a producer makes, an element at a time (a one-column
 *  panel): without packing memory, slow and never wrong. */
static void dtr__gemm_naive_gen(const dtr__gemm_job *j) {
    int64_t i, c, k;
    for (i = 0; i < j->M; i++)
        for (c = 0; c < j->N; c++) {
            float acc = 0.0f, b, *ci = j->C + i * j->ldc + c;
            for (k = 0; k < j->K; k++) {
                j->bgen(j->bgen_user, k, 1, c, 1, 1, &b);
                acc += j->A[i * j->rsa + k * j->csa] * b;
            }
            *ci = j->beta == 0.0f ? j->alpha * acc : j->alpha * acc + j->beta * *ci;
        }
}

/** Runs the whole job on the calling thread with a buffer of its own (the exact size), or
 *  the triple loop when that cannot be allocated. */
static void dtr__gemm_serial_private(dtr__gemm_job *j) {
    int64_t a_floats;
    size_t floats;
    void *raw;
    j->pool = NULL;
    floats = dtr__gemm_buf_floats(j, 1, &a_floats);
    raw = dtr__malloc(NULL, floats * sizeof(float) + 64);
    if (!raw && j->bgen) {
        dtr__gemm_naive_gen(j);
        return;
    }
    if (!raw) {
        dtr__gemm_naive(j->M, j->N, j->K, j->alpha, j->A, j->rsa, j->csa, j->B, j->rsb, j->csb,
                        j->beta, j->C, j->ldc);
        return;
    }
    dtr__gemm_slab(j, 0, j->M, 0, j->N, (float *)(((uintptr_t)raw + 63) & ~(uintptr_t)63));
    dtr__free(NULL, raw);
}

/** Runs a set-up job: over the pool's threads, or serially without a pool. */
static void dtr__gemm_run(dtr__pool *p, dtr__gemm_job *jp) {
    dtr__gemm_job j = *jp;
    const dtr__gemm_kernel *kn = j.kern;
    int64_t units, grain, a_floats, M = j.M, N = j.N, K = j.K;
    double flops;
    int threads, use, chunks, w;
    size_t floats;
    if (!p) {
        dtr__gemm_serial_private(&j);
        return;
    }
    /* threads: split the larger of M and N into slabs of whole panels */
    threads = dtr__pool_threads(p);
    flops = 2.0 * (double)M * (double)N * (double)K;
    use = threads;
    if (flops < DTR__GEMM_MIN_FLOPS_PER_THREAD * use) use = (int)(flops / DTR__GEMM_MIN_FLOPS_PER_THREAD);
    if (use < 1) use = 1;
    j.split_n = N >= M ? dtr__gemm_ceil(N, kn->nr) >= use : dtr__gemm_ceil(M, kn->mr) < use;
    units = j.split_n ? dtr__gemm_ceil(N, kn->nr) : dtr__gemm_ceil(M, kn->mr);
    if (use > units) use = (int)units;
    grain = units / use;
    chunks = (int)dtr__gemm_min64(threads, units / grain);
    /* grow the scratch of every worker that will take part here, on the calling thread */
    floats = dtr__gemm_buf_floats(&j, 0, &a_floats);
    for (w = 0; w < chunks; w++) {
        if (!dtr__pool_scratch(p, w, floats * sizeof(float))) {
            dtr__gemm_naive(M, N, K, j.alpha, j.A, j.rsa, j.csa, j.B, j.rsb, j.csb, j.beta, j.C, j.ldc);
            return;
        }
    }
    /* one chunk runs inline (with the calling thread's worker index when nested) */
    dtr__pool_run(p, units, chunks <= 1 ? units : grain, dtr__gemm_task, &j);
}

void dtr__gemm(dtr__pool *p, int64_t M, int64_t N, int64_t K, float alpha,
               const float *A, int64_t rsa, int64_t csa,
               const float *B, int64_t rsb, int64_t csb,
               float beta, float *C, int64_t ldc) {
    dtr__gemm_job j;
    if (dtr__gemm_setup(&j, p, M, N, K, alpha, A, rsa, csa, B, rsb, csb, beta, C, ldc)) dtr__gemm_run(p, &j);
}

/** Runs a set-up job on the calling thread, worker `worker` of p. */
static void dtr__gemm_run_on(dtr__pool *p, int worker, dtr__gemm_job *j) {
    int64_t a_floats;
    float *buf = p ? (float *)dtr__pool_scratch(p, worker, dtr__gemm_buf_floats(j, 0, &a_floats) * sizeof(float)) : NULL;
    if (!buf) {   /* no pool, a worker index out of range, or out of memory */
        dtr__gemm_serial_private(j);
        return;
    }
    dtr__gemm_slab(j, 0, j->M, 0, j->N, buf);
}

void dtr__gemm_on(dtr__pool *p, int worker, int64_t M, int64_t N, int64_t K, float alpha,
                  const float *A, int64_t rsa, int64_t csa,
                  const float *B, int64_t rsb, int64_t csb,
                  float beta, float *C, int64_t ldc) {
    dtr__gemm_job j;
    if (dtr__gemm_setup(&j, p, M, N, K, alpha, A, rsa, csa, B, rsb, csb, beta, C, ldc)) dtr__gemm_run_on(p, worker, &j);
}

void dtr__gemm_on_gen(dtr__pool *p, int worker, int64_t M, int64_t N, int64_t K, float alpha, const float *A, int64_t rsa,
                      int64_t csa, dtr__gemm_bgen gen, void *user, float beta, float *C, int64_t ldc) {
    dtr__gemm_job j;
    if (!dtr__gemm_setup(&j, p, M, N, K, alpha, A, rsa, csa, NULL, 0, 0, beta, C, ldc)) return;
    j.bgen = gen, j.bgen_user = user;
    dtr__gemm_run_on(p, worker, &j);
}

void dtr__gemm_pack_panels(const float *B, int64_t rsb, int64_t csb, int64_t kb, int64_t nb, float *dst) {
    const dtr__gemm_kernel *kn = dtr__gemm_pick();
    kn->pack_b(B, rsb, csb, kb, nb, kn->nr, dst);
}

size_t dtr__gemm_bpack_floats(int64_t K, int64_t N) {
    const dtr__gemm_kernel *kn = dtr__gemm_pick();
    return (size_t)(K > 0 ? K : 0) * (size_t)(dtr__gemm_ceil(N > 0 ? N : 0, kn->nr) * kn->nr);
}

void dtr__gemm_bpack_fill(dtr__gemm_bpack *b, const float *B, int64_t rsb, int64_t csb, int64_t K, int64_t N, float *mem) {
    const dtr__gemm_kernel *kn = dtr__gemm_pick();
    int64_t kc = dtr__gemm_kc(kn, K), pc, npad = dtr__gemm_ceil(N, kn->nr) * kn->nr;
    b->B = B, b->rsb = rsb, b->csb = csb, b->K = K, b->N = N, b->packed = mem;
    for (pc = 0; mem && pc < K; pc += kc)   /* each K block's NR-wide panels, as dtr__gemm_slab packs them */
        kn->pack_b(B + pc * rsb, rsb, csb, dtr__gemm_min64(kc, K - pc), N, kn->nr, mem + pc * npad);
}

void dtr__gemm_packed(dtr__pool *p, int worker, int64_t M, float alpha, const float *A, int64_t rsa, int64_t csa,
                      const dtr__gemm_bpack *b, float beta, float *C, int64_t ldc) {
    dtr__gemm_job j;
    if (!dtr__gemm_setup(&j, p, M, b->N, b->K, alpha, A, rsa, csa, b->B, b->rsb, b->csb, beta, C, ldc)) return;
    j.bpre = b->packed;
    if (worker < 0) dtr__gemm_run(p, &j);
    else dtr__gemm_run_on(p, worker, &j);
}
