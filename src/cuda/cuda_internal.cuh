/* ============================================================================
 * CUDA backend internals: the per-context state (stream, cuBLAS handle, the device-side
 * error word, the caching allocator, the event ring, reduction scratch) and the helpers
 * every kernel file uses. The kernels keep the CPU kernels' signatures
 * (dtr__cuda_<kernels>_fwd / _bwd (ctx, node)) and shapes, and call the same element
 * formulas (src/core/formulas.h).
 * ==========================================================================*/
#include "../public/api.h"
#include "../public/api_engine.h"
#include "../core/internal.h"
#include "../core/formulas.h"
#include <cuda.h>   /* the driver's types (its calls are found through the runtime: cuda_memory.cu) */
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cublas_v2.h>
#include <mma.h>
#include <type_traits>
#include <pthread.h>

#define DTR__CUDA_THREADS 256
#define DTR__CUDA_MAX_BLOCKS 65535u
#define DTR__CUDA_EVENTS 256        /* event ring: a handle stays valid for this many records */
#define DTR__CUDA_COPY_EVENTS DTR__ASYNC_COPIES   /* the copies' own ring (to_host_async) */
#define DTR__CUDA_CACHE 64          /* cached free blocks per context */

/** A free block of the caching allocator. */
typedef struct dtr__cuda_block { void *p; size_t bytes; } dtr__cuda_block;

/** A reserved block (mem_reserve): n granules from base, granule g mapped to its own memory
 *  own[g], or (own[g] 0) to the state's zero granule. */
typedef struct dtr__cuda_sparse { CUdeviceptr base; size_t n; CUmemGenericAllocationHandle *own; } dtr__cuda_sparse;

/** A ring of events: a handle stays valid for `cap` records. */
typedef struct dtr__cuda_ring { cudaEvent_t ev[DTR__CUDA_EVENTS]; int cap, n, next; } dtr__cuda_ring;

typedef struct dtr__cuda_state {
    int device;
    cudaStream_t stream;
    cudaStream_t copies;            /* device-to-host copies beside the stream (to_host_async) */
    cublasHandle_t blas;
    int fast16;                     /* 1: f32 products through cublasGemmEx with `compute` (bf16 / fp16) */
    cublasComputeType_t compute;
    unsigned fa_widths;             /* operand kinds and head widths of the fused attention kernels this device runs (cuda_attention.cu: DTR__FA_BIT) */
    /* the error word: kernels that check data (class targets, embedding ids) record the
       first failure here: [0] the op id, [1] the element; mapped pinned host memory, read
       by the host after each synchronisation (dtr__cuda_take_error) */
    int *err_host, *err_dev;
    int err_found;                  /* 1: the word had an error, reported until the status is cleared */
    dtr__cuda_block cache[DTR__CUDA_CACHE];   /* freed blocks kept for reuse */
    int n_cache;
    size_t cached_bytes;
    dtr__cuda_block *live;                    /* blocks handed out, with their sizes */
    int n_live, cap_live;
    size_t live_bytes, peak_bytes;            /* handed out now, and the most at once */
    dtr__cuda_sparse *sparse;                 /* reserved blocks (cuda_memory.cu) */
    int n_sparse, cap_sparse;
    size_t granule;                           /* the device's mapping granularity; 0: no virtual memory calls */
    int granule_known;
    CUmemGenericAllocationHandle zero;        /* the granule of zeros every unbacked granule maps */
    int has_zero;
    void *scratch;                            /* kernels' temporaries (dtr__cuda_scratch) */
    size_t scratch_bytes;
    int graphs;                               /* executable graphs alive (dtr_graph): they hold the
                                                 scratch's address, so one outgrown is kept */
    void **retired;                           /* outgrown scratch blocks kept for them */
    int n_retired;
    dtr__cuda_ring events;                    /* event_record's */
    dtr__cuda_ring copy_events;               /* to_host_async's */
    double *partial;                /* reduction scratch: DTR__CUDA_MAX_PARTIALS doubles */
    double *sum_host;               /* pinned: a reduction's result for the host */
    int64_t *segs;                  /* LAMB segment bounds on the device, and their capacity */
    int seg_cap;
    /* the allocator's lists and the event rings: a process group's progress thread calls the
       backend beside the context's thread (NCCL's event_record, a device group's scratch) */
    pthread_mutex_t mu;
} dtr__cuda_state;

#define DTR__CUDA_MAX_PARTIALS 1024

static dtr__cuda_state *dtr__cuda(dtr_context *ctx) { return (dtr__cuda_state *)ctx->backend_state; }

/** A device buffer of at least `bytes` for an op's temporaries (attention's score tiles, a
 *  convolution's column gradients), kept by the context and grown when asked for more. It
 *  stays valid until the next call: work queued before that call has used it when work
 *  queued after runs (stream order). NULL with the error recorded. (cuda_memory.cu) */
static void *dtr__cuda_scratch(dtr_context *ctx, size_t bytes);
/** Zeroes `bytes` at dst on the context's stream; DTR_OK or the error recorded. (cuda_memory.cu) */
static dtr_result dtr__cuda_memset0(dtr_context *ctx, void *dst, size_t bytes);
static cudaStream_t dtr__cuda_stream(dtr_context *ctx) { return dtr__cuda(ctx)->stream; }

/** DTR_OK, or the CUDA error recorded on the context (DTR_DEVICE_OUT_OF_MEMORY for an
 *  allocation failure, DTR_DEVICE_ERROR otherwise) naming `what`. */
static dtr_result dtr__cuda_check(dtr_context *ctx, cudaError_t e, const char *what) {
    if (e == cudaSuccess) return DTR_OK;
    return dtr__fail(ctx, e == cudaErrorMemoryAllocation ? DTR_DEVICE_OUT_OF_MEMORY : DTR_DEVICE_ERROR, "cuda: %s: %s (%d)",
                     what, cudaGetErrorString(e), (int)e);
}

/** After a launch: the launch error, if any, naming the node's op. */
static dtr_result dtr__cuda_launched(dtr_context *ctx, const dtr__node *n) {
    return dtr__cuda_check(ctx, cudaGetLastError(), n ? dtr__op_name(n->op) : "kernel");
}

static dtr_result dtr__cuda_blas(dtr_context *ctx, cublasStatus_t st, const char *what) {
    if (st == CUBLAS_STATUS_SUCCESS) return DTR_OK;
    return dtr__fail(ctx, st == CUBLAS_STATUS_ALLOC_FAILED ? DTR_DEVICE_OUT_OF_MEMORY : DTR_DEVICE_ERROR,
                     "cuda: cuBLAS %s failed (status %d)", what, (int)st);
}


/** Grid for n elements, DTR__CUDA_THREADS each, grid-stride loops. */
static unsigned dtr__cuda_grid(int64_t n) { return dtr__launch_blocks(n, DTR__CUDA_THREADS, DTR__CUDA_MAX_BLOCKS); }

/** The grid-stride loop over [0, n). */
#define DTR__CUDA_FOR(i, n) \
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (int64_t)blockDim.x * gridDim.x)

/** A tensor's memory in its own dtype (f32, bf16, f16). The kernel families marked `narrow` in
 *  the dispatch table (cuda_backend.cu) load and store their tensors' values through it, so
 *  16-bit activations are read and written as they are, in f32 arithmetic, rounded once at
 *  the store (the semantics of the widened path, src/core/widen.c, without its copies). */
typedef struct dtr__cuda_mem {
    void *p;
    int dt;
    __device__ float ld(int64_t i) const { return dtr__f_load(p, dt, i); }
    __device__ void st(int64_t i, float v) const { dtr__f_store(p, dt, i, v); }
} dtr__cuda_mem;

/** t's values from its view's first element (dtr__data); NULL p for a NULL (absent) tensor. */
static dtr__cuda_mem dtr__cuda_mem_of(const dtr_tensor *t) {
    dtr__cuda_mem m = {t ? dtr__data(t) : NULL, t ? (int)t->dtype : (int)DTR_F32};
    return m;
}

/** t's storage from its start (kernels that add the view's offset themselves). */
static dtr__cuda_mem dtr__cuda_storage_of(const dtr_tensor *t) {
    dtr__cuda_mem m = {t->storage, (int)t->dtype};
    return m;
}

/** Kernels that find bad data (an index out of range) record it once: op id and element. */
__device__ static void dtr__cuda_flag(int *err, int op, int64_t at) {
    if (atomicCAS(err, 0, op) == 0) err[1] = (int)(at < 0x7fffffff ? at : 0x7fffffff);
}

/* ---- shapes passed to kernels by value ---- */

/** A tensor walk: shape and strides (in elements) over up to DTR_MAX_DIMS axes. */
typedef struct dtr__cuda_walk {
    int nd;
    int small;        /* every index fits 32 bits: 32-bit divisions (64-bit ones cost ~5x more) */
    int64_t shape[DTR_MAX_DIMS], stride[DTR_MAX_DIMS];
    int64_t base;
} dtr__cuda_walk;

/** A walk over shape/stride from `base`, with axes of length 1 dropped and neighbouring axes
 *  that step as one merged (a slice of rows becomes two axes, a dense block one): the same
 *  offsets for the same row-major index, with fewer divisions per element. */
static dtr__cuda_walk dtr__cuda_walk_make(int nd, const int64_t *shape, const int64_t *stride, int64_t base) {
    dtr__cuda_walk w;
    int d;
    memset(&w, 0, sizeof w);
    for (d = 0; d < nd; d++) {
        if (shape[d] == 1) continue;
        if (w.nd > 0 && w.stride[w.nd - 1] == stride[d] * shape[d]) {
            w.shape[w.nd - 1] *= shape[d];
            w.stride[w.nd - 1] = stride[d];
        } else {
            w.shape[w.nd] = shape[d];
            w.stride[w.nd] = stride[d];
            w.nd++;
        }
    }
    w.base = base;
    w.small = dtr__numel(w.nd, w.shape) <= INT32_MAX;
    return w;
}

/** The offset of row-major element i of the walk's shape. */
__device__ static int64_t dtr__cuda_walk_off(const dtr__cuda_walk *w, int64_t i) {
    int64_t off = w->base;
    if (w->small) {
        uint32_t r = (uint32_t)i;
        for (int d = w->nd - 1; d >= 0; d--) {
            uint32_t n = (uint32_t)w->shape[d], k = r % n;
            r /= n;
            off += (int64_t)k * w->stride[d];
        }
        return off;
    }
    for (int d = w->nd - 1; d >= 0; d--) {
        int64_t k = i % w->shape[d];
        i /= w->shape[d];
        off += k * w->stride[d];
    }
    return off;
}

/* ---- block reductions in double (the CPU sums rows in double too) ---- */

/** Sum of v over the block (blockDim.x a power of two <= 1024); every thread gets it. */
__device__ static double dtr__cuda_block_sum(double v) {
    __shared__ double sh[32];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    __syncthreads();
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    v = (int)threadIdx.x < nw ? sh[threadIdx.x] : 0.0;
    if (warp == 0)
        for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    if (threadIdx.x == 0) sh[0] = v;
    __syncthreads();
    v = sh[0];
    __syncthreads();
    return v;
}

/** Maximum of v over the block; every thread gets it. */
__device__ static float dtr__cuda_block_max(float v) {
    __shared__ float sh[32];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_down_sync(0xffffffffu, v, o));
    __syncthreads();
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    v = (int)threadIdx.x < nw ? sh[threadIdx.x] : -INFINITY;
    if (warp == 0)
        for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_down_sync(0xffffffffu, v, o));
    if (threadIdx.x == 0) sh[0] = v;
    __syncthreads();
    v = sh[0];
    __syncthreads();
    return v;
}

/* Declared here, defined with the reductions (src/cuda/cuda_optim.cu): the sum of f(i) over
 * [0, n) into *out (device), f one of DTR__CUDA_SUM_*: a deterministic two-pass reduction. */
enum { DTR__CUDA_SUM_PLAIN = 0, DTR__CUDA_SUM_SQ = 1, DTR__CUDA_SUM_SQDIFF = 2 };
static dtr_result dtr__cuda_sum(dtr_context *ctx, int kind, dtr__cuda_mem a, dtr__cuda_mem b, int64_t n, double *out);
