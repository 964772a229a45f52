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
inline float cuemu_to_float(__half v) {
    _Float16 h;
    memcpy(&h, &v.bits, 2);
    return (float)h;
}

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

template <int M, int N, int K, class TA, class LA, class TB, class LB>
inline void mma_sync(fragment<accumulator, M, N, K, float> &d, const fragment<matrix_a, M, N, K, TA, LA> &a,
                     const fragment<matrix_b, M, N, K, TB, LB> &b, const fragment<accumulator, M, N, K, float> &c) {
    float out[M * N];
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            float acc = c.x[i * N + j];
            for (int k = 0; k < K; k++) acc += cuemu_operand<TA>(a.x[i * K + k]) * cuemu_operand<TB>(b.x[k * N + j]);
            out[i * N + j] = acc;
        }
    memcpy(d.x, out, sizeof out);
}
}  // namespace wmma
}  // namespace nvcuda
#endif
