/* ============================================================================
 * CUDA backend (skeleton): device selection, device memory and host<->device copies
 * behind the backend vtable. The op kernels, cuBLAS matmul and mixed precision arrive with
 * the CUDA backend issue; until then forward/backward report DTR_UNSUPPORTED, so a program
 * that picks this backend gets a clear error instead of wrong results.
 * Build: nvcc -O2 -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 -c dtrain_cuda.cu
 * ==========================================================================*/
#include "../public/api.h"
#include "../core/internal.h"
#include <cuda_runtime.h>

/* ---- helpers ---- */

typedef struct dtr__cuda_state {
    int device;
    cudaStream_t stream;
} dtr__cuda_state;

static dtr__cuda_state *dtr__cuda(dtr_context *ctx) { return (dtr__cuda_state *)ctx->backend_state; }

static dtr_result dtr__cuda_check(dtr_context *ctx, cudaError_t e, const char *what) {
    if (e == cudaSuccess) return DTR_OK;
    return dtr__fail(ctx, e == cudaErrorMemoryAllocation ? DTR_DEVICE_OUT_OF_MEMORY : DTR_DEVICE_ERROR, "cuda: %s: %s (%d)",
                     what, cudaGetErrorString(e), (int)e);
}

/* ---- lifetime ---- */

static dtr_result dtr__cuda_init(dtr_context *ctx, void **state) {
    int n = 0;
    dtr__cuda_state *s;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0)
        return dtr__fail(ctx, DTR_UNSUPPORTED, "cuda: no usable GPU (%s)", e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
    if (ctx->cfg.device < 0 || ctx->cfg.device >= n)
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "cuda: device %d outside 0..%d", ctx->cfg.device, n - 1);
    s = (dtr__cuda_state *)dtr__calloc(&ctx->alloc, sizeof(*s));
    if (!s) return DTR_OUT_OF_MEMORY;
    s->device = ctx->cfg.device;
    if (dtr__cuda_check(ctx, cudaSetDevice(s->device), "cudaSetDevice") != DTR_OK ||
        dtr__cuda_check(ctx, cudaStreamCreateWithFlags(&s->stream, cudaStreamNonBlocking), "cudaStreamCreate") != DTR_OK) {
        dtr__free(&ctx->alloc, s);
        return ctx->status;
    }
    *state = s;
    return DTR_OK;
}

static void dtr__cuda_shutdown(dtr_context *ctx, void *state) {
    dtr__cuda_state *s = (dtr__cuda_state *)state;
    if (!s) return;
    cudaStreamSynchronize(s->stream);
    cudaStreamDestroy(s->stream);
    dtr__free(&ctx->alloc, s);
}

/* ---- memory ---- */

static void *dtr__cuda_alloc(dtr_context *ctx, size_t bytes) {
    void *p = NULL;
    if (dtr__cuda_check(ctx, cudaMalloc(&p, bytes ? bytes : 1), "cudaMalloc") != DTR_OK) return NULL;
    return p;
}

static void dtr__cuda_free(dtr_context *ctx, void *p) { (void)ctx; if (p) cudaFree(p); }

static dtr_result dtr__cuda_memset0(dtr_context *ctx, void *dst, size_t bytes) {
    return dtr__cuda_check(ctx, cudaMemsetAsync(dst, 0, bytes, dtr__cuda(ctx)->stream), "cudaMemsetAsync");
}

static dtr_result dtr__cuda_to_host(dtr_context *ctx, void *dst, const void *src, size_t bytes) {
    dtr_result r = dtr__cuda_check(ctx, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, dtr__cuda(ctx)->stream),
                                   "cudaMemcpy to host");
    if (r != DTR_OK) return r;
    return dtr__cuda_check(ctx, cudaStreamSynchronize(dtr__cuda(ctx)->stream), "cudaStreamSynchronize");
}

static dtr_result dtr__cuda_from_host(dtr_context *ctx, void *dst, const void *src, size_t bytes) {
    dtr_result r = dtr__cuda_check(ctx, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, dtr__cuda(ctx)->stream),
                                   "cudaMemcpy to device");
    if (r != DTR_OK) return r;
    return dtr__cuda_check(ctx, cudaStreamSynchronize(dtr__cuda(ctx)->stream), "cudaStreamSynchronize");
}

static dtr_result dtr__cuda_sync(dtr_context *ctx) {
    return dtr__cuda_check(ctx, cudaStreamSynchronize(dtr__cuda(ctx)->stream), "cudaStreamSynchronize");
}

/* ---- kernels ---- */

/* The dispatch table, from the op list like the CPU's: entry X(ID, name, k) will run
 * dtr__cuda_k_fwd / dtr__cuda_k_bwd. No op has a CUDA kernel in this version yet, so every
 * entry is empty and the backend reports DTR_UNSUPPORTED naming the op. */
#define DTR__CUDA_ENTRY(id, name, k) {NULL, NULL},
static const dtr__kernel_pair dtr__cuda_kernels[DTR_OP_COUNT] = {
    {NULL, NULL}, /* DTR_OP_NONE */
    DTR__OP_LIST(DTR__CUDA_ENTRY)
};
#undef DTR__CUDA_ENTRY

static int dtr__cuda_supports_op(const dtr_context *ctx, int op) { (void)ctx; return dtr__table_has(dtr__cuda_kernels, op); }
static dtr_result dtr__cuda_forward(dtr_context *ctx, dtr__node *n) { return dtr__table_run(dtr__cuda_kernels, "cuda", ctx, n, 0); }
static dtr_result dtr__cuda_backward(dtr_context *ctx, dtr__node *n) { return dtr__table_run(dtr__cuda_kernels, "cuda", ctx, n, 1); }

static dtr_result dtr__cuda_optimizer(dtr_context *ctx, const dtr__opt_args *a) {
    (void)a;
    return dtr__fail(ctx, DTR_UNSUPPORTED, "cuda: fused optimizer kernels are not in this version");
}

__global__ void dtr__cuda_scale_kernel(float *x, int64_t n, float s) {
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= s;
}

static dtr_result dtr__cuda_scale(dtr_context *ctx, float *x, int64_t n, float s) {
    if (n <= 0) return DTR_OK;
    dtr__cuda_scale_kernel<<<(unsigned)((n + 255) / 256), 256, 0, dtr__cuda(ctx)->stream>>>(x, n, s);
    return dtr__cuda_check(ctx, cudaGetLastError(), "scale kernel");
}

static dtr_result dtr__cuda_sumsq(dtr_context *ctx, const float *x, int64_t n, double *out) {
    (void)x; (void)n; (void)out;
    return dtr__fail(ctx, DTR_UNSUPPORTED, "cuda: sumsq is not in this version");
}

static dtr_result dtr__cuda_reduce(dtr_context *ctx, void *out, const void *a, const void *b, size_t n, dtr_dtype dt,
                                   int op, int div) {
    (void)out; (void)a; (void)b; (void)n; (void)dt; (void)op; (void)div;
    return dtr__fail(ctx, DTR_UNSUPPORTED, "cuda: the reduction kernel of collectives is not in this version");
}

/* Events. This version has no kernels that run behind the host's back yet, so recording
 * waits for the stream and hands out a completed (NULL) event; real cudaEvent_t handles come
 * with the kernels. */
static dtr_result dtr__cuda_event_record(dtr_context *ctx, dtr_event **ev) {
    *ev = NULL;
    return dtr__cuda_sync(ctx);
}
static dtr_result dtr__cuda_event_wait(dtr_context *ctx, dtr_event *ev) { (void)ctx; (void)ev; return DTR_OK; }
static dtr_result dtr__cuda_event_query(dtr_context *ctx, dtr_event *ev, int *done) {
    (void)ctx; (void)ev;
    *done = 1;
    return DTR_OK;
}

static const dtr_backend dtr__cuda_backend_vt = {
    DTR_VERSION_NUMBER,
    sizeof(dtr_backend),
    "cuda",
    DTR__CAP_ASYNC,
    dtr__cuda_init,
    dtr__cuda_shutdown,
    dtr__cuda_alloc,
    dtr__cuda_free,
    dtr__cuda_alloc,
    dtr__cuda_free,
    dtr__cuda_memset0,
    dtr__cuda_to_host,
    dtr__cuda_from_host,
    dtr__cuda_supports_op,
    dtr__cuda_forward,
    dtr__cuda_backward,
    dtr__cuda_optimizer,
    dtr__cuda_sumsq,
    dtr__cuda_scale,
    dtr__cuda_reduce,
    dtr__cuda_event_record,
    dtr__cuda_event_wait,
    dtr__cuda_event_query,
    dtr__cuda_sync
};

/* ---- public entry points ---- */

extern "C" const dtr_backend *dtr_cuda_backend(void) { return &dtr__cuda_backend_vt; }

extern "C" int dtr_cuda_device_count(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
    return n;
}
