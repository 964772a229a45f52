/* cuemu's warp matrix operations (nvcuda::wmma, see cuda_runtime.h). A fragment's element
 * layout across a warp's lanes is unspecified in CUDA; here every lane holds the whole tile
 * and computes the whole product (the same values on every lane), which is what a kernel that
 * only loads, multiplies, stores and applies one operation to every element can observe.
 * Operands: bf16 and fp16 (m16n16k16), TF32 (m16n16k8: f32 values of which the product reads
 * 10 bits of mantissa, the rest dropped as the hardware does; __float_to_tf32 rounds them to
 * nearest, ties away from zero), sums in f32 (in the order of k, as one thread would). */
#ifndef CUEMU_MMA_H
#define CUEMU_MMA_H
#include "cuda_runtime.h"
#include "cuda_bf16.h"
#include "cuda_fp16.h"
#include <memory>

namespace nvcuda {
namespace wmma {
struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };
namespace precision {
struct tf32 {};
}

/* the element type a fragment of T is loaded from */
template <class T> struct cuemu_elem { typedef T type; };
template <> struct cuemu_elem<precision::tf32> { typedef float type; };

inline uint32_t cuemu_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}
inline float cuemu_float(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}
/* f32 -> TF32 (an f32 with the low 13 bits 0): to nearest, ties away (cvt.rna.tf32.f32) */
inline float __float_to_tf32(float f) {
    uint32_t u = cuemu_bits(f);
    if ((u & 0x7f800000u) == 0x7f800000u) return f;   /* inf, NaN */
    return cuemu_float((u + 0x1000u) & 0xffffe000u);
}
/* what the tensor cores read of an operand of T: TF32 keeps 10 bits of mantissa */
template <class T> inline float cuemu_operand(float v) { return std::is_same<T, precision::tf32>::value ? cuemu_float(cuemu_bits(v) & 0xffffe000u) : v; }

inline float cuemu_to_float(__nv_bfloat16 v) {
    uint32_t u = (uint32_t)v.bits << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
inline float cuemu_to_float(float v) { return v; }
inline float cuemu_to_float(__half v) { return cuemu_half_to_float(v.bits); }

/* rows x cols of the fragment's use */
template <class Use, int M, int N, int K> struct cuemu_shape;
template <int M, int N, int K> struct cuemu_shape<matrix_a, M, N, K> { enum { rows = M, cols = K }; };
template <int M, int N, int K> struct cuemu_shape<matrix_b, M, N, K> { enum { rows = K, cols = N }; };
template <int M, int N, int K> struct cuemu_shape<accumulator, M, N, K> { enum { rows = M, cols = N }; };

template <class Use, int M, int N, int K, class T, class Layout = void> struct fragment {
    enum { rows = cuemu_shape<Use, M, N, K>::rows, cols = cuemu_shape<Use, M, N, K>::cols, num_elements = rows * cols };
    float x[num_elements];   /* row-major */
};

template <class Use, int M, int N, int K, class T, class L>
inline void fill_fragment(fragment<Use, M, N, K, T, L> &f, float v) {
    for (int i = 0; i < f.num_elements; i++) f.x[i] = v;
}

template <class Use, int M, int N, int K, class T, class L>
inline void load_matrix_sync(fragment<Use, M, N, K, T, L> &f, const typename cuemu_elem<T>::type *p, unsigned ldm) {
    const bool rowm = std::is_same<L, row_major>::value;
    for (int r = 0; r < f.rows; r++)
        for (int c = 0; c < f.cols; c++) f.x[r * f.cols + c] = cuemu_to_float(p[rowm ? r * ldm + c : c * ldm + r]);
}

template <int M, int N, int K>
inline void load_matrix_sync(fragment<accumulator, M, N, K, float> &f, const float *p, unsigned ldm, layout_t l) {
    for (int r = 0; r < M; r++)
        for (int c = 0; c < N; c++) f.x[r * N + c] = p[l == mem_row_major ? r * ldm + c : c * ldm + r];
}

template <int M, int N, int K>
inline void store_matrix_sync(float *p, const fragment<accumulator, M, N, K, float> &f, unsigned ldm, layout_t l) {
    __syncwarp();   /* every lane holds the tile: one store of it, after the warp's earlier reads */
    if ((threadIdx.x & 31) == 0)
        for (int r = 0; r < M; r++)
            for (int c = 0; c < N; c++) p[l == mem_row_major ? r * ldm + c : c * ldm + r] = f.x[r * N + c];
    __syncwarp();
}

/* The products a thread made lately, by their operands: every lane of a warp holds the same
   tiles and multiplies them in the same order between two of its switches, so lanes 1..31 find
   lane 0's products here and copy them (the lookup tries where the last hit was, then where
   the last run of new products began, then every entry by a fingerprint of sampled words);
   the result is the product's either way. */
template <int M, int N, int K, class TA, class TB> struct cuemu_mma_memo {
    enum { R = 256 };
    struct entry { float a[M * K], b[K * N], c[M * N], d[M * N]; uint64_t fp; };
    entry e[R];
    int n = 0, next = 0, cursor = 0, run = 0, hit = 1, prev_hit = 1;
    static uint64_t fingerprint(const float *a, const float *b, const float *c) {
        uint64_t h = 0;
        for (int t = 0; t < 8; t++)
            h = (h ^ cuemu_bits(a[t * (M * K / 8)]) ^ ((uint64_t)cuemu_bits(b[t * (K * N / 8) + t]) << 21) ^
                 ((uint64_t)cuemu_bits(c[t * (M * N / 8) + t]) << 42)) * 0x100000001b3ull;
        return h;
    }
    bool same(int i, uint64_t fp, const float *a, const float *b, const float *c) const {
        return i < n && e[i].fp == fp && memcmp(e[i].a, a, sizeof e[i].a) == 0 && memcmp(e[i].b, b, sizeof e[i].b) == 0 &&
               memcmp(e[i].c, c, sizeof e[i].c) == 0;
    }
    const float *find(uint64_t fp, const float *a, const float *b, const float *c) {
        int i = same(cursor, fp, a, b, c) ? cursor : same(run, fp, a, b, c) ? run : -1;
        for (int t = 0; i < 0 && t < n; t++)
            if (same(t, fp, a, b, c)) i = t;
        prev_hit = hit, hit = i >= 0;
        if (hit) cursor = (i + 1) % R;
        return hit ? e[i].d : nullptr;
    }
    /* after a miss: the product's entry (the first miss after a hit begins a run) */
    float *add(uint64_t fp, const float *a, const float *b, const float *c) {
        entry &x = e[next];
        if (prev_hit) run = next;
        memcpy(x.a, a, sizeof x.a), memcpy(x.b, b, sizeof x.b), memcpy(x.c, c, sizeof x.c);
        x.fp = fp;
        next = (next + 1) % R;
        n = n < R ? n + 1 : R;
        return x.d;
    }
};

template <int M, int N, int K, class TA, class LA, class TB, class LB>
inline void mma_sync(fragment<accumulator, M, N, K, float> &d, const fragment<matrix_a, M, N, K, TA, LA> &a,
                     const fragment<matrix_b, M, N, K, TB, LB> &b, const fragment<accumulator, M, N, K, float> &c) {
    static thread_local std::unique_ptr<cuemu_mma_memo<M, N, K, TA, TB>> memo(new cuemu_mma_memo<M, N, K, TA, TB>());
    uint64_t fp = memo->fingerprint(a.x, b.x, c.x);
    const float *seen = memo->find(fp, a.x, b.x, c.x);
    float ra[M * K], rb[K * N], *out;
    if (seen) {
        memcpy(d.x, seen, sizeof d.x);
        return;
    }
    for (int t = 0; t < M * K; t++) ra[t] = cuemu_operand<TA>(a.x[t]);
    for (int t = 0; t < K * N; t++) rb[t] = cuemu_operand<TB>(b.x[t]);
    out = memo->add(fp, a.x, b.x, c.x);
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            float acc = c.x[i * N + j];
            for (int k = 0; k < K; k++) acc += ra[i * K + k] * rb[k * N + j];
            out[i * N + j] = acc;
        }
    memcpy(d.x, out, sizeof d.x);
}
}  // namespace wmma
}  // namespace nvcuda
#endif
