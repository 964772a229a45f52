/* tests/cuemu/test_cuemu.cu: the executor's own semantics, the same source for both builds:
 * make test (cuemu: launch.pl, the host compiler, tests/cuemu) and nvcc on a GPU (make
 * test-gpu), so the device confirms what the stand-in assumes: block barriers over shared
 * memory, warp shuffles and ballots, __syncthreads_or, grid-stride indices over 2-D grids,
 * launch-shape errors, dynamic shared memory over 48 KB once a kernel's limit is raised, (the
 * executor only) its two schedules seen through a deliberate race, a captured stream replayed by a graph, events ordering two streams, and
 * (the executor only: a GPU may be done sooner) work left undone until the host waits for it,
 * cuBLAS's column-major
 * products with transposes, leading dimensions, beta 0 not reading C, and argument errors, and
 * warp matrix products on TF32 (wmma m16n16k8: __float_to_tf32 rounds to nearest, ties away
 * from zero; products of TF32 values summed exactly where the sums fit f32). */
#include <cuda_runtime.h>
#include <cublas_v2.h>
#include <mma.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

static int g_fail, g_checks;
#define CHECK(c)                                                                    \
    do {                                                                            \
        g_checks++;                                                                 \
        if (!(c)) { g_fail++; printf("  FAIL %s:%d: %s\n", __FILE__, __LINE__, #c); } \
    } while (0)

/* out[b] = sum of in[b * blockDim ..] by a shared-memory tree (barriers between levels) */
__global__ static void block_tree_k(const int *in, int *out) {
    __shared__ int sh[256];
    int t = threadIdx.x;
    sh[t] = in[blockIdx.x * blockDim.x + t];
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (t < s) sh[t] += sh[t + s];
        __syncthreads();
    }
    if (t == 0) out[blockIdx.x] = sh[0];
}

/* warp sums by shuffles (down: lane 0 has it; xor: every lane, lane 7's kept), ballots of odd
   values, and a block-wide "any" */
__global__ static void warp_k(const int *in, int *sums, unsigned *ballots, int *any) {
    int t = threadIdx.x, v = in[t], x = in[t];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    if ((t & 31) == 0) sums[t >> 5] = v;
    if ((t & 31) == 7) sums[8 + (t >> 5)] = x;
    unsigned b = __ballot_sync(0xffffffffu, in[t] & 1);
    if ((t & 31) == 0) ballots[t >> 5] = b;
    int a = __syncthreads_or(in[t] == 77);
    if (t == 0) *any = a;
}

/* every (x, y) of a 2-D grid of 2-D blocks writes its linear index once */
__global__ static void grid2d_k(int *out, int w, int h) {
    int x = blockIdx.x * blockDim.x + threadIdx.x, y = blockIdx.y * blockDim.y + threadIdx.y;
    if (x < w && y < h) atomicAdd(&out[y * w + x], y * w + x + 1);
}

__global__ static void add_one_k(float *x, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) x[i] += 1.0f;
}

static void test_barriers_and_warps(void) {
    int h_in[1024], h_out[4], *in, *out, *sums, *any, h_sums[16], h_any = 0;
    unsigned *ballots, h_ballots[8];
    for (int i = 0; i < 1024; i++) h_in[i] = i == 200 ? 77 : i % 7;
    cudaMalloc((void **)&in, sizeof h_in);
    cudaMalloc((void **)&out, sizeof h_out);
    cudaMalloc((void **)&sums, sizeof h_sums);
    cudaMalloc((void **)&ballots, sizeof h_ballots);
    cudaMalloc((void **)&any, sizeof(int));
    cudaMemcpy(in, h_in, sizeof h_in, cudaMemcpyHostToDevice);
    block_tree_k<<<4, 256>>>(in, out);
    CHECK(cudaGetLastError() == cudaSuccess);
    cudaMemcpy(h_out, out, sizeof h_out, cudaMemcpyDeviceToHost);
    for (int b = 0; b < 4; b++) {
        int want = 0;
        for (int i = 0; i < 256; i++) want += h_in[b * 256 + i];
        CHECK(h_out[b] == want);
    }
    warp_k<<<1, 256>>>(in, sums, ballots, any);
    CHECK(cudaGetLastError() == cudaSuccess);
    cudaMemcpy(h_sums, sums, sizeof h_sums, cudaMemcpyDeviceToHost);
    cudaMemcpy(h_ballots, ballots, sizeof h_ballots, cudaMemcpyDeviceToHost);
    cudaMemcpy(&h_any, any, sizeof(int), cudaMemcpyDeviceToHost);
    for (int w = 0; w < 8; w++) {
        int want = 0;
        unsigned bits = 0;
        for (int l = 0; l < 32; l++) want += h_in[w * 32 + l], bits |= (unsigned)(h_in[w * 32 + l] & 1) << l;
        CHECK(h_sums[w] == want);
        CHECK(h_sums[8 + w] == want);
        CHECK(h_ballots[w] == bits);
    }
    CHECK(h_any == 1);
    cudaFree(in), cudaFree(out), cudaFree(sums), cudaFree(ballots), cudaFree(any);
}

static void test_grids_and_errors(void) {
    int w = 37, h = 21, *out, host[37 * 21], ok = 1;
    cudaMalloc((void **)&out, sizeof host);
    cudaMemsetAsync(out, 0, sizeof host, 0);
    grid2d_k<<<dim3(5, 3), dim3(8, 8)>>>(out, w, h);
    CHECK(cudaGetLastError() == cudaSuccess);
    cudaMemcpy(host, out, sizeof host, cudaMemcpyDeviceToHost);
    for (int i = 0; i < w * h; i++) ok &= host[i] == i + 1;
    CHECK(ok);
    grid2d_k<<<1, 2048>>>(out, w, h);                   /* over 1024 threads a block */
    CHECK(cudaGetLastError() == cudaErrorInvalidConfiguration);
    grid2d_k<<<dim3(1, 70000), 32>>>(out, w, h);        /* grid y over 65535 */
    CHECK(cudaGetLastError() == cudaErrorInvalidConfiguration);
    grid2d_k<<<0, 32>>>(out, w, h);                     /* an empty grid */
    CHECK(cudaGetLastError() == cudaErrorInvalidConfiguration);
    CHECK(cudaGetLastError() == cudaSuccess);           /* read once, then cleared */
    cudaFree(out);
}

/* dynamic shared memory: thread t writes slot t of n floats per thread-row, then (after a
   barrier) reads its mirror's; out[t] = in[blockDim - 1 - t] */
__global__ static void dyn_shared_k(const float *in, float *out, int n) {
    extern __shared__ __align__(16) float dyn[];
    int t = threadIdx.x, m = blockDim.x - 1 - t;
    for (int i = 0; i < n; i++) dyn[i * blockDim.x + t] = in[t] + i;
    __syncthreads();
    out[t] = dyn[(n - 1) * blockDim.x + m] - (float)(n - 1);
}

/* over 48 KB only once the kernel's limit is raised; the device's opt-in limit caps that */
static void test_dynamic_shared(void) {
    float h_in[128], h_out[128], *in, *out;
    int n = 160, optin = 0, ok = 1;                              /* 160 x 128 floats: 80 KB */
    size_t bytes = (size_t)n * 128 * sizeof(float);
    for (int i = 0; i < 128; i++) h_in[i] = (float)i * 0.5f;
    cudaMalloc((void **)&in, sizeof h_in);
    cudaMalloc((void **)&out, sizeof h_out);
    cudaMemcpy(in, h_in, sizeof h_in, cudaMemcpyHostToDevice);
    dyn_shared_k<<<1, 128, bytes>>>(in, out, n);
    CHECK(cudaGetLastError() == cudaErrorInvalidValue);
    CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0) == cudaSuccess && optin >= (int)bytes);
    CHECK(cudaFuncSetAttribute(dyn_shared_k, cudaFuncAttributeMaxDynamicSharedMemorySize, optin + 1) == cudaErrorInvalidValue);
    cudaGetLastError();
    CHECK(cudaFuncSetAttribute(dyn_shared_k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes) == cudaSuccess);
    dyn_shared_k<<<1, 128, bytes>>>(in, out, n);
    CHECK(cudaGetLastError() == cudaSuccess);
    cudaMemcpy(h_out, out, sizeof h_out, cudaMemcpyDeviceToHost);
    for (int i = 0; i < 128; i++) ok &= h_out[i] == h_in[127 - i];
    CHECK(ok);
    dyn_shared_k<<<1, 128, bytes + 4096>>>(in, out, n);          /* over the raised limit */
    CHECK(cudaGetLastError() == cudaErrorInvalidValue);
    cudaFree(in);
    cudaFree(out);
}

/* A race on purpose: each thread writes its slot, then reads the slot 32 ahead (another
   warp's) with no barrier between. What it reads depends on the schedule, so only cuemu's two
   schedules are checked: by default (every thread up to its next barrier in order) thread 0
   reads before thread 32 writes; reversed (each warp alone up to a block barrier, the last
   first) the second warp has written when the first reads, and the first has not when the
   second reads. */
#ifdef CUEMU
__global__ static void race_k(int *out) {
    __shared__ int sh[64];
    int t = threadIdx.x;
    sh[t] = -1;
    __syncthreads();
    sh[t] = t;
    out[t] = sh[(t + 32) % 64];
}
#endif

static void test_schedule(void) {
#ifdef CUEMU
    int *out, h[64];
    const char *sched = getenv("CUEMU_SCHEDULE");
    int rev = sched && !strcmp(sched, "reverse");
    cudaMalloc((void **)&out, sizeof h);
    race_k<<<1, 64>>>(out);
    cudaMemcpy(h, out, sizeof h, cudaMemcpyDeviceToHost);
    CHECK(h[0] == (rev ? 32 : -1));
    CHECK(h[32] == (rev ? -1 : 0));
    cudaFree(out);
#endif
}

/* launches on a capturing stream run only when the graph is launched, every time */
static void test_capture(void) {
    cudaStream_t s;
    cudaGraph_t g;
    cudaGraphExec_t x;
    float *d, host[100];
    cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    cudaMalloc((void **)&d, sizeof host);
    cudaMemsetAsync(d, 0, sizeof host, s);
    cudaStreamSynchronize(s);
    CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed) == cudaSuccess);
    add_one_k<<<2, 32, 0, s>>>(d, 100);
    CHECK(cudaStreamEndCapture(s, &g) == cudaSuccess);
    CHECK(cudaGraphInstantiate(&x, g, 0) == cudaSuccess);
    cudaMemcpy(host, d, sizeof host, cudaMemcpyDeviceToHost);
    CHECK(host[0] == 0.0f && host[99] == 0.0f);          /* not run at capture */
    cudaGraphLaunch(x, s);
    cudaGraphLaunch(x, s);
    cudaStreamSynchronize(s);
    cudaMemcpy(host, d, sizeof host, cudaMemcpyDeviceToHost);
    CHECK(host[0] == 2.0f && host[99] == 2.0f);
    cudaGraphExecDestroy(x);
    cudaGraphDestroy(g);
    cudaFree(d);
    cudaStreamDestroy(s);
}

/* stream b copies what stream a computed, after a's event; the host reads after b's event */
static void test_streams(void) {
    cudaStream_t a, b;
    cudaEvent_t done_a, done_b;
    float *d, *pinned, zero[64] = {0};
    int ok = 1;
    cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking);
    cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking);
    cudaEventCreateWithFlags(&done_a, cudaEventDisableTiming);
    cudaEventCreateWithFlags(&done_b, cudaEventDisableTiming);
    cudaMalloc((void **)&d, 64 * sizeof(float));
    cudaMallocHost((void **)&pinned, 64 * sizeof(float));
    memset(pinned, 0, 64 * sizeof(float));
    cudaMemcpyAsync(d, zero, sizeof zero, cudaMemcpyHostToDevice, a);   /* pageable source: taken at the call */
    zero[0] = 5.0f;
    add_one_k<<<1, 64, 0, a>>>(d, 64);
    cudaEventRecord(done_a, a);
    cudaStreamWaitEvent(b, done_a, 0);
    cudaMemcpyAsync(pinned, d, 64 * sizeof(float), cudaMemcpyDeviceToHost, b);
    cudaEventRecord(done_b, b);
#ifdef CUEMU
    CHECK(pinned[0] == 0.0f);            /* nothing ran: the host has not waited */
    CHECK(cudaEventQuery(done_a) == cudaSuccess);
    CHECK(pinned[0] == 0.0f);            /* a's work only */
#endif
    CHECK(cudaEventSynchronize(done_b) == cudaSuccess);
    for (int i = 0; i < 64; i++) ok &= pinned[i] == 1.0f;
    CHECK(ok);
    cudaFree(d);
    cudaFreeHost(pinned);
    cudaEventDestroy(done_a), cudaEventDestroy(done_b);
    cudaStreamDestroy(a), cudaStreamDestroy(b);
}

/* C (3 x 2) = A^T (3 x 4) B (4 x 2), column-major, A stored 4 x 3 with lda 5, C with ldc 4 */
static void test_gemm(void) {
    cublasHandle_t hb;
    float A[5 * 3], B[4 * 2], C[4 * 2], *dA, *dB, *dC, one = 1.0f, zero = 0.0f;
    for (int i = 0; i < 15; i++) A[i] = (float)(i % 5 == 4 ? 1e30 : i - 7);   /* row 4 is padding */
    for (int i = 0; i < 8; i++) B[i] = (float)(i * 0.5 - 1);
    for (int i = 0; i < 8; i++) C[i] = NAN;                                    /* beta 0: never read */
    cudaMalloc((void **)&dA, sizeof A), cudaMalloc((void **)&dB, sizeof B), cudaMalloc((void **)&dC, sizeof C);
    cudaMemcpy(dA, A, sizeof A, cudaMemcpyHostToDevice);
    cudaMemcpy(dB, B, sizeof B, cudaMemcpyHostToDevice);
    cudaMemcpy(dC, C, sizeof C, cudaMemcpyHostToDevice);
    CHECK(cublasCreate(&hb) == CUBLAS_STATUS_SUCCESS);
    CHECK(cublasSgemm(hb, CUBLAS_OP_T, CUBLAS_OP_N, 3, 2, 4, &one, dA, 5, dB, 4, &zero, dC, 4) == CUBLAS_STATUS_SUCCESS);
    cudaDeviceSynchronize();
    cudaMemcpy(C, dC, sizeof C, cudaMemcpyDeviceToHost);
    for (int j = 0; j < 2; j++)
        for (int i = 0; i < 3; i++) {
            double want = 0;
            for (int p = 0; p < 4; p++) want += (double)A[p + i * 5] * B[p + j * 4];
            CHECK(fabs(C[i + j * 4] - want) < 1e-4);
        }
    CHECK(isnan(C[3]) && isnan(C[7]));                                        /* past m rows: untouched */
    CHECK(cublasSgemm(hb, CUBLAS_OP_N, CUBLAS_OP_N, 3, 2, 4, &one, dA, 2, dB, 4, &zero, dC, 4) == CUBLAS_STATUS_INVALID_VALUE);
    CHECK(cublasSgemm(hb, CUBLAS_OP_N, CUBLAS_OP_N, -1, 2, 4, &one, dA, 5, dB, 4, &zero, dC, 4) == CUBLAS_STATUS_INVALID_VALUE);
    cublasDestroy(hb);
    cudaFree(dA), cudaFree(dB), cudaFree(dC);
}

/* one warp: conv = TF32 of a (16 x 8), d (16 x 16, row-major) = TF32(a) b (b: 8 x 16, row-major,
   TF32 already) */
__global__ static void tf32_k(const float *a, const float *b, float *conv, float *d) {
    using namespace nvcuda;
    wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, wmma::row_major> fa;
    wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, wmma::row_major> fb;
    wmma::fragment<wmma::accumulator, 16, 16, 8, float> c;
    for (int i = threadIdx.x; i < 128; i += 32) conv[i] = wmma::__float_to_tf32(a[i]);
    wmma::load_matrix_sync(fa, a, 8);
    wmma::load_matrix_sync(fb, b, 16);
    for (int t = 0; t < fa.num_elements; t++) fa.x[t] = wmma::__float_to_tf32(fa.x[t]);
    wmma::fill_fragment(c, 0.0f);
    wmma::mma_sync(c, fa, fb, c);
    wmma::store_matrix_sync(d, c, 16, wmma::mem_row_major);
}

/* what the fused attention's TF32 and f32 kinds rely on (src/cuda/cuda_attention.cu) */
static void test_tf32(void) {
    float a[128], b[128], conv[128], d[256], *da, *db, *dc, *dd;
    const float u = 1.0f / 4096;   /* 2^-12: a quarter of TF32's unit at 1 */
    for (int i = 0; i < 128; i++) {   /* 1 + k 2^-12, k = 0..7, both signs: below, at and past half a unit */
        int k = i % 8;
        a[i] = (i / 8 % 2 ? -1.0f : 1.0f) * (1.0f + k * u) * (float)(1 << (i / 16 % 4));   /* times 1, 2, 4, 8 */
        b[i] = (float)(i % 5) - 2.0f;
    }
    cudaMalloc((void **)&da, sizeof a), cudaMalloc((void **)&db, sizeof b), cudaMalloc((void **)&dc, sizeof conv);
    cudaMalloc((void **)&dd, sizeof d);
    cudaMemcpy(da, a, sizeof a, cudaMemcpyHostToDevice);
    cudaMemcpy(db, b, sizeof b, cudaMemcpyHostToDevice);
    tf32_k<<<1, 32>>>(da, db, dc, dd);
    CHECK(cudaDeviceSynchronize() == cudaSuccess);
    cudaMemcpy(conv, dc, sizeof conv, cudaMemcpyDeviceToHost);
    cudaMemcpy(d, dd, sizeof d, cudaMemcpyDeviceToHost);
    for (int i = 0; i < 128; i++) {   /* ties (k = 2, 6) away from zero: k 0, 1 down; 2..5 to 1 unit; 6, 7 to 2 */
        int k = i % 8, units = k < 2 ? 0 : k < 6 ? 1 : 2;
        float want = (i / 8 % 2 ? -1.0f : 1.0f) * (1.0f + units * 4 * u) * (float)(1 << (i / 16 % 4));
        CHECK(conv[i] == want);
    }
    for (int r = 0; r < 16; r++)
        for (int c = 0; c < 16; c++) {
            double want = 0;
            for (int k = 0; k < 8; k++) want += (double)conv[r * 8 + k] * b[k * 16 + c];
            CHECK(d[r * 16 + c] == (float)want);   /* 12 significant bits at most: exact in f32 */
        }
    cudaFree(da), cudaFree(db), cudaFree(dc), cudaFree(dd);
}

static void test_pointers(void) {
    float *d, *h, local = 0;
    cudaPointerAttributes at;
    cudaMalloc((void **)&d, 64);
    cudaMallocHost((void **)&h, 64);
    CHECK(cudaPointerGetAttributes(&at, d + 3) == cudaSuccess && at.type == cudaMemoryTypeDevice);
    CHECK(cudaPointerGetAttributes(&at, h) == cudaSuccess && at.type == cudaMemoryTypeHost);
    CHECK(cudaPointerGetAttributes(&at, &local) == cudaSuccess && at.type == cudaMemoryTypeUnregistered);
    cudaFree(d);
    cudaFreeHost(h);
}

int main(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
        printf("*** test_cuemu: no GPU: SKIPPED ***\n");
        return 0;
    }
    test_barriers_and_warps();
    test_grids_and_errors();
    test_dynamic_shared();
    test_schedule();
    test_capture();
    test_streams();
    test_gemm();
    test_pointers();
    test_tf32();
    printf("test_cuemu.cu: %d passed, %d failed\n", g_checks - g_fail, g_fail);
    return g_fail != 0;
}
