/* ============================================================================
 * cuemu: the CUDA units of dtrain executed on a CPU, for machines without a GPU.
 *
 * dtrain_cuda.cu is compiled by the host C++ compiler with this directory first on the
 * include path (this header and cublas_v2.h stand for the CUDA runtime and cuBLAS), after
 * its launches `k<<<grid, block, shmem, stream>>>(args)` were rewritten to
 * `cuemu::launcher(k, grid, block, shmem, stream)(args)` (tests/cuemu/launch.pl). Each block
 * runs its threads as fibers: __syncthreads and the warp operations (shuffles, ballots) switch
 * fibers, so the kernels' own source runs with CUDA's semantics of barriers and warps, one
 * block at a time. Device memory is host memory the runtime tracks (new allocations hold NaN
 * bytes, as uninitialised device memory may; so does a block's shared memory when it starts:
 * launch.pl turns `__shared__` declarations into slots of the running block's); cuBLAS's
 * products are reference loops with its column-major arguments, its argument checks and the
 * rounding of its compute types.
 *
 * What it checks: the kernels' index arithmetic, launch shapes (a block over 1024 threads, a
 * grid axis over its limit: cudaErrorInvalidConfiguration; dynamic shared memory over the
 * kernel's limit, 48 KB unless cudaFuncSetAttribute raised it: cudaErrorInvalidValue), barrier use (a block whose threads
 * wait at different barriers is reported as a launch failure), reductions and
 * math, graph capture (launches on a capturing stream are recorded, not run, and replayed
 * by cudaGraphLaunch), the driver's virtual memory calls (cuda.h: granules mapped into a
 * reserved range, a touch where nothing is mapped a SIGSEGV), and with AddressSanitizer,
 * out-of-bounds accesses of device buffers. Every lane of a warp holds a whole wmma tile
 * (mma.h); lanes after the first copy its products, found by their operands.
 * Races: fibers switch only at barriers and warp operations, so a missing barrier shows only
 * as a result that changes with the schedule: CUEMU_SCHEDULE=reverse runs each warp alone up
 * to a block barrier, last warp and lane first, blocks last to first (make test runs the kernel
 * tests both ways). What it cannot: races the two schedules do not tell apart, timing, memory
 * bandwidth, the real cuBLAS's algorithms. It is a test tool, never linked into dtrain; the
 * device run (make test-gpu on a GPU) remains the check of record.
 * ==========================================================================*/
#ifndef CUEMU_CUDA_RUNTIME_H
#define CUEMU_CUDA_RUNTIME_H
#define CUEMU 1   /* this is the CPU executor, not CUDA */

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <tuple>
#include <utility>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static   /* (launch.pl rewrites the kernels' declarations into shared_slot's) */
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))

struct uint3 { unsigned x, y, z; };
struct __attribute__((aligned(16))) uint4 { unsigned x, y, z, w; };
struct dim3 {
    unsigned x, y, z;
    dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

/* the running fiber's indices (one block runs at a time) */
extern uint3 threadIdx, blockIdx;
extern dim3 blockDim, gridDim;

/* ---- errors, handles, enums ---- */
enum cudaError {
    cudaSuccess = 0, cudaErrorInvalidValue = 1, cudaErrorMemoryAllocation = 2, cudaErrorInvalidConfiguration = 9,
    cudaErrorInvalidDevice = 101, cudaErrorStreamCaptureUnsupported = 900, cudaErrorStreamCaptureInvalidated = 901,
    cudaErrorNotReady = 600, cudaErrorLaunchFailure = 719
};
typedef enum cudaError cudaError_t;
typedef struct cuemu_stream *cudaStream_t;
typedef struct cuemu_event *cudaEvent_t;
typedef struct cuemu_graph *cudaGraph_t;
typedef struct cuemu_graph *cudaGraphExec_t;
enum cudaMemcpyKind { cudaMemcpyHostToHost = 0, cudaMemcpyHostToDevice = 1, cudaMemcpyDeviceToHost = 2,
                      cudaMemcpyDeviceToDevice = 3, cudaMemcpyDefault = 4 };
enum cudaStreamCaptureMode { cudaStreamCaptureModeGlobal = 0, cudaStreamCaptureModeThreadLocal = 1,
                             cudaStreamCaptureModeRelaxed = 2 };
enum cudaMemoryType { cudaMemoryTypeUnregistered = 0, cudaMemoryTypeHost = 1, cudaMemoryTypeDevice = 2,
                      cudaMemoryTypeManaged = 3 };
struct cudaPointerAttributes { enum cudaMemoryType type; int device; void *devicePointer, *hostPointer; };
typedef enum cudaDataType_t { CUDA_R_32F = 0, CUDA_R_16F = 2, CUDA_R_16BF = 14 } cudaDataType_t;
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
enum cudaDeviceAttr { cudaDevAttrMaxSharedMemoryPerBlockOptin = 97 };
#define cudaStreamDefault 0u
#define cudaStreamNonBlocking 1u
#define cudaEventDefault 0u
#define cudaEventDisableTiming 2u
#define cudaHostAllocDefault 0u
#define cudaHostAllocMapped 2u
#define CUDART_VERSION 13000
enum cudaDriverEntryPointQueryResult { cudaDriverEntryPointSuccess = 0, cudaDriverEntryPointSymbolNotFound = 1,
                                       cudaDriverEntryPointVersionNotSufficent = 2 };
#define cudaEnableDefault 0ull

/* ---- the runtime (tests/cuemu/cuemu.cpp) ---- */
const char *cudaGetErrorString(cudaError_t e);
cudaError_t cudaGetLastError(void);
cudaError_t cudaGetDeviceCount(int *n);
cudaError_t cudaSetDevice(int d);
cudaError_t cudaMalloc(void **p, size_t bytes);
cudaError_t cudaFree(void *p);
cudaError_t cudaMallocHost(void **p, size_t bytes);
cudaError_t cudaHostAlloc(void **p, size_t bytes, unsigned flags);
cudaError_t cudaHostGetDevicePointer(void **dev, void *host, unsigned flags);
cudaError_t cudaFreeHost(void *p);
cudaError_t cudaPointerGetAttributes(struct cudaPointerAttributes *at, const void *p);
cudaError_t cudaMemcpy(void *dst, const void *src, size_t bytes, enum cudaMemcpyKind kind);
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, enum cudaMemcpyKind kind, cudaStream_t s = 0);
cudaError_t cudaMemcpy2DAsync(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width, size_t rows,
                              enum cudaMemcpyKind kind, cudaStream_t s = 0);
cudaError_t cudaMemsetAsync(void *p, int value, size_t bytes, cudaStream_t s = 0);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned flags);
cudaError_t cudaStreamDestroy(cudaStream_t s);
cudaError_t cudaStreamSynchronize(cudaStream_t s);
cudaError_t cudaDeviceSynchronize(void);
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned flags = 0);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned flags);
cudaError_t cudaEventDestroy(cudaEvent_t e);
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s = 0);
cudaError_t cudaEventQuery(cudaEvent_t e);
cudaError_t cudaEventSynchronize(cudaEvent_t e);
cudaError_t cudaStreamBeginCapture(cudaStream_t s, enum cudaStreamCaptureMode mode);
cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t *g);
cudaError_t cudaGraphInstantiate(cudaGraphExec_t *x, cudaGraph_t g, unsigned long long flags);
cudaError_t cudaGraphLaunch(cudaGraphExec_t x, cudaStream_t s);
cudaError_t cudaGraphDestroy(cudaGraph_t g);
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t x);
cudaError_t cudaDeviceGetAttribute(int *value, enum cudaDeviceAttr attr, int device);
/* the driver calls of tests/cuemu/cuda.h by name (version at least 12000) */
cudaError_t cudaGetDriverEntryPointByVersion(const char *symbol, void **fn, unsigned version, unsigned long long flags,
                                             enum cudaDriverEntryPointQueryResult *status = nullptr);
namespace cuemu { cudaError_t set_attribute(const void *fn, enum cudaFuncAttribute attr, int value); }
/* a kernel's limit of dynamic shared memory (48 KB until raised; at most the device's opt-in
   limit, an H100's 227 KB) */
template <class F> cudaError_t cudaFuncSetAttribute(F *fn, enum cudaFuncAttribute attr, int value) {
    return cuemu::set_attribute(reinterpret_cast<const void *>(fn), attr, value);
}

/* ---- device functions ---- */
void __syncthreads(void);
int __syncthreads_or(int pred);
unsigned __ballot_sync(unsigned mask, int pred);
#include <type_traits>
void __syncwarp(unsigned mask = 0xffffffffu);
namespace cuemu {
enum { SHFL_DOWN, SHFL_XOR };
/* the value of lane (lane + arg) (SHFL_DOWN) or (lane ^ arg) (SHFL_XOR) inside groups of
   `width` lanes, this lane's own when that lane is outside its group or the block */
uint64_t shfl(uint64_t mine, int kind, int arg, int width);
template <class T> T shuffle(T v, int kind, int arg, int width) {
    uint64_t mine = 0, got;
    T r;
    static_assert(sizeof(T) <= 8, "shuffle of more than 8 bytes");
    memcpy(&mine, &v, sizeof(T));
    got = shfl(mine, kind, arg, width);
    memcpy(&r, &got, sizeof(T));
    return r;
}
}  // namespace cuemu
template <class T> T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    (void)mask;
    return cuemu::shuffle(v, cuemu::SHFL_DOWN, (int)delta, width);
}
template <class T> T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
    (void)mask;
    return cuemu::shuffle(v, cuemu::SHFL_XOR, lane_mask, width);
}
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline float __fadd_rn(float a, float b) { volatile float r = a + b; return r; }
inline float __fsub_rn(float a, float b) { volatile float r = a - b; return r; }
inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
inline float __fdiv_rn(float a, float b) { volatile float r = a / b; return r; }
inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
/* fibers switch only at barriers: a read-modify-write is never interrupted */
template <class T> T atomicAdd(T *p, T v) { T o = *p; *p = o + v; return o; }
template <class T> T atomicCAS(T *p, T cmp, T v) { T o = *p; if (o == cmp) *p = v; return o; }
template <class T> T atomicMax(T *p, T v) { T o = *p; if (v > o) *p = v; return o; }

/* ---- launches ---- */
namespace cuemu {
struct config { dim3 grid, block; size_t shmem; cudaStream_t stream; const void *fn; };
/* the running block's dynamic shared memory (`extern __shared__ T name[];` is rewritten by
   launch.pl to `T *name = (T *)cuemu::dynamic_shared();`): `shmem` bytes, NaN bytes when the
   block starts */
void *dynamic_shared();
/* the running block's static shared memory declared at `site` (`__shared__ T name[N];` is
   rewritten by launch.pl to a reference to it): `bytes` of NaN bytes the first time a thread
   of the block reaches the declaration, the same memory for the block's other threads */
void *shared_slot(const void *site, size_t bytes);
/* runs body as every thread of every block of the grid, or records it on a capturing stream */
void launch(const config &c, std::function<void()> body);

template <class... P> struct launch_of {
    void (*k)(P...);
    config c;
    template <class... A> void operator()(A &&...a) const {
        std::tuple<P...> args(std::forward<A>(a)...);
        void (*kk)(P...) = k;
        launch(c, [kk, args]() { std::apply(kk, args); });
    }
};
template <class... P> launch_of<P...> launcher(void (*k)(P...), dim3 grid, dim3 block, size_t shmem = 0, cudaStream_t s = 0) {
    launch_of<P...> l = {k, {grid, block, shmem, s, reinterpret_cast<const void *>(k)}};
    return l;
}
}  // namespace cuemu

#endif
