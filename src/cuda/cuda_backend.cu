/* ============================================================================
 * CUDA backend: device selection, the stream, cuBLAS, host<->device copies, events, the
 * device-side error word, and the backend vtable whose dispatch table comes from the op list like the CPU's.
 * Memory: src/cuda/cuda_memory.cu. Kernels: src/cuda/cuda_ops.cu (ops), cuda_gemm.cu (matmul, linear), cuda_optim.cu
 * (optimizer, sums, the collectives' reduction), cuda_conv.cu (convolution, pooling), cuda_attention.cu (fused causal attention). An op
 * without a CUDA kernel would report DTR_UNSUPPORTED naming it, and supports_op says so.
 * Build: nvcc -O2 -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 -c dtrain_cuda.cu
 *        (link with -lcublas -lcudart).
 * ==========================================================================*/

/* ---- the device-side error word ---- */

/* After a synchronisation: a data error a kernel recorded (an index out of range) becomes the
 * context's error, naming the op and the element, and the word is cleared. It stays the answer
 * of every synchronisation until the app clears the context's status: a caller that drops the
 * result (a transport's copy of a buffer) does not lose it for the next reader. */
static dtr_result dtr__cuda_take_error(dtr_context *ctx) {
    dtr__cuda_state *s = dtr__cuda(ctx);
    int op = s->err_host[0], at = s->err_host[1];
    if (op == 0) {
        if (s->err_found && ctx->status != DTR_OK) return ctx->status;
        s->err_found = 0;
        return DTR_OK;
    }
    s->err_host[0] = s->err_host[1] = 0;
    s->err_found = 1;
    return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "cuda: %s: %s of row %d is outside the valid range (found on the device)",
                     dtr__op_name(op), op == DTR_OP_EMBEDDING ? "the id" : op == DTR_OP_GATHER ? "the index"
                                       : op == DTR_OP_ATTENTION ? "the key length" : "the target", at);
}

static dtr_result dtr__cuda_sync(dtr_context *ctx) {
    if (dtr__cuda_check(ctx, cudaStreamSynchronize(dtr__cuda(ctx)->stream), "cudaStreamSynchronize") != DTR_OK) return ctx->status;
    return dtr__cuda_take_error(ctx);
}

/* ---- lifetime ---- */

static dtr_result dtr__cuda_init_state(dtr_context *ctx, dtr__cuda_state *s) {
    if (dtr__cuda_check(ctx, cudaSetDevice(s->device), "cudaSetDevice") != DTR_OK ||
        dtr__cuda_check(ctx, cudaStreamCreateWithFlags(&s->stream, cudaStreamNonBlocking), "cudaStreamCreate") != DTR_OK ||
        dtr__cuda_check(ctx, cudaStreamCreateWithFlags(&s->copies, cudaStreamNonBlocking), "cudaStreamCreate") != DTR_OK)
        return ctx->status;
    if (dtr__cuda_blas(ctx, cublasCreate(&s->blas), "create") != DTR_OK ||
        dtr__cuda_blas(ctx, cublasSetStream(s->blas, s->stream), "set stream") != DTR_OK ||
        dtr__cuda_blas(ctx, cublasSetMathMode(s->blas, ctx->cfg.allow_tf32 || ctx->cfg.matmul_precision == DTR_MATMUL_TF32
                                                           ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH),
                       "set math mode") != DTR_OK)
        return ctx->status;
    if (dtr__cuda_check(ctx, cudaHostAlloc((void **)&s->err_host, 2 * sizeof(int), cudaHostAllocMapped), "error word") != DTR_OK ||
        dtr__cuda_check(ctx, cudaHostGetDevicePointer((void **)&s->err_dev, s->err_host, 0), "error word") != DTR_OK ||
        dtr__cuda_check(ctx, cudaMallocHost((void **)&s->sum_host, sizeof(double)), "pinned result") != DTR_OK ||
        dtr__cuda_check(ctx, cudaMalloc((void **)&s->partial, DTR__CUDA_MAX_PARTIALS * sizeof(double)), "reduction scratch") != DTR_OK)
        return ctx->status;
    s->err_host[0] = s->err_host[1] = 0;
    s->fa_widths = dtr__cuda_fa_setup();
    return DTR_OK;
}

static void dtr__cuda_release(dtr_context *ctx, dtr__cuda_state *s) {
    int i;
    if (s->stream) cudaStreamSynchronize(s->stream);
    if (s->copies) cudaStreamSynchronize(s->copies);
    for (i = 0; i < s->n_cache; i++) cudaFree(s->cache[i].p);
    dtr__cuda_sparse_release(ctx, s);
    for (i = 0; i < s->events.n; i++) cudaEventDestroy(s->events.ev[i]);
    for (i = 0; i < s->copy_events.n; i++) cudaEventDestroy(s->copy_events.ev[i]);
    if (s->scratch) cudaFree(s->scratch);
    for (i = 0; i < s->n_retired; i++) cudaFree(s->retired[i]);
    dtr__free(&ctx->alloc, s->retired);
    if (s->partial) cudaFree(s->partial);
    if (s->segs) cudaFree(s->segs);
    if (s->sum_host) cudaFreeHost(s->sum_host);
    if (s->err_host) cudaFreeHost(s->err_host);
    if (s->blas) cublasDestroy(s->blas);
    dtr__free(&ctx->alloc, s->live);
    if (s->copies) cudaStreamDestroy(s->copies);
    if (s->stream) cudaStreamDestroy(s->stream);
    pthread_mutex_destroy(&s->mu);
    dtr__free(&ctx->alloc, s);
}

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
    if (pthread_mutex_init(&s->mu, NULL) != 0) {
        dtr__free(&ctx->alloc, s);
        return DTR_OUT_OF_MEMORY;
    }
    s->device = ctx->cfg.device;
    s->events.cap = DTR__CUDA_EVENTS, s->copy_events.cap = DTR__CUDA_COPY_EVENTS;
    s->fast16 = ctx->cfg.matmul_precision == DTR_MATMUL_BF16 || ctx->cfg.matmul_precision == DTR_MATMUL_F16;
    s->compute = ctx->cfg.matmul_precision == DTR_MATMUL_F16 ? CUBLAS_COMPUTE_32F_FAST_16F : CUBLAS_COMPUTE_32F_FAST_16BF;
    if (dtr__cuda_init_state(ctx, s) != DTR_OK) {
        dtr_result r = ctx->status;
        dtr__cuda_release(ctx, s);
        return r;
    }
    *state = s;
    return DTR_OK;
}

static void dtr__cuda_shutdown(dtr_context *ctx, void *state) {
    if (state) dtr__cuda_release(ctx, (dtr__cuda_state *)state);
}

/* ---- copies ---- */

static dtr_result dtr__cuda_to_host(dtr_context *ctx, void *dst, const void *src, size_t bytes) {
    if (dtr__cuda_check(ctx, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, dtr__cuda(ctx)->stream),
                        "cudaMemcpy to host") != DTR_OK)
        return ctx->status;
    return dtr__cuda_sync(ctx);
}

static dtr_result dtr__cuda_from_host(dtr_context *ctx, void *dst, const void *src, size_t bytes) {
    /* pageable host memory: the copy has read `src` when this returns */
    if (dtr__cuda_check(ctx, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, dtr__cuda(ctx)->stream),
                        "cudaMemcpy to device") != DTR_OK)
        return ctx->status;
    return dtr__cuda_check(ctx, cudaStreamSynchronize(dtr__cuda(ctx)->stream), "cudaStreamSynchronize");
}

static dtr_result dtr__cuda_copy(dtr_context *ctx, void *dst, const void *src, size_t bytes) {
    return dtr__cuda_check(ctx, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, dtr__cuda(ctx)->stream),
                           "cudaMemcpy on the device");
}

/* `rows` rows of `width` bytes, device to device, on the stream (the tensor-parallel gather) */
static dtr_result dtr__cuda_copy2d(dtr_context *ctx, void *dst, size_t dpitch, const void *src, size_t spitch, size_t width,
                                   size_t rows) {
    return dtr__cuda_check(ctx, cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, rows, cudaMemcpyDeviceToDevice,
                                                  dtr__cuda(ctx)->stream), "cudaMemcpy2D on the device");
}

/* ---- events: a ring of cudaEvent_t; a handle is valid for DTR__CUDA_EVENTS records ---- */

/* the next event of ring rg recorded on stream `on` */
static dtr_result dtr__cuda_event_on(dtr_context *ctx, dtr__cuda_ring *rg, cudaStream_t on, dtr_event **ev) {
    dtr__cuda_state *s = dtr__cuda(ctx);
    dtr_result r = DTR_OK;
    cudaEvent_t *e;
    pthread_mutex_lock(&s->mu);
    if (rg->n < rg->cap && rg->next == rg->n) {
        r = dtr__cuda_check(ctx, cudaEventCreateWithFlags(&rg->ev[rg->n], cudaEventDisableTiming), "cudaEventCreate");
        if (r == DTR_OK) rg->n++;
    }
    e = &rg->ev[rg->next];
    if (r == DTR_OK) rg->next = (rg->next + 1) % rg->cap;
    if (r == DTR_OK) r = dtr__cuda_check(ctx, cudaEventRecord(*e, on), "cudaEventRecord");
    pthread_mutex_unlock(&s->mu);
    if (r != DTR_OK) return ctx->status;
    *ev = (dtr_event *)e;
    return DTR_OK;
}

static dtr_result dtr__cuda_event_record(dtr_context *ctx, dtr_event **ev) {
    return dtr__cuda_event_on(ctx, &dtr__cuda(ctx)->events, dtr__cuda(ctx)->stream, ev);
}

/* the copy stream waits for the work queued so far, copies, and records *done: the compute
   stream is not held up (the data-parallel engine's staging of gradient buckets) */
static dtr_result dtr__cuda_to_host_async(dtr_context *ctx, void *dst, const void *src, size_t bytes, dtr_event **done) {
    dtr__cuda_state *s = dtr__cuda(ctx);
    dtr_event *queued;
    if (dtr__cuda_event_on(ctx, &s->events, s->stream, &queued) != DTR_OK ||
        dtr__cuda_check(ctx, cudaStreamWaitEvent(s->copies, *(cudaEvent_t *)queued, 0), "cudaStreamWaitEvent") != DTR_OK ||
        dtr__cuda_check(ctx, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, s->copies), "cudaMemcpyAsync to host") != DTR_OK)
        return ctx->status;
    return dtr__cuda_event_on(ctx, &s->copy_events, s->copies, done);
}

/* page-locked src: the copy is queued on the stream (kernels queued later see it) and the host
   goes on; the copies' ring marks its end (the loader keeps src until then) */
static dtr_result dtr__cuda_from_host_async(dtr_context *ctx, void *dst, const void *src, size_t bytes, dtr_event **done) {
    dtr__cuda_state *s = dtr__cuda(ctx);
    if (dtr__cuda_check(ctx, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, s->stream), "cudaMemcpyAsync to device") != DTR_OK)
        return ctx->status;
    return dtr__cuda_event_on(ctx, &s->copy_events, s->stream, done);
}

static dtr_result dtr__cuda_event_wait(dtr_context *ctx, dtr_event *ev) {
    if (!ev) return DTR_OK;
    if (dtr__cuda_check(ctx, cudaEventSynchronize(*(cudaEvent_t *)ev), "cudaEventSynchronize") != DTR_OK) return ctx->status;
    return dtr__cuda_take_error(ctx);
}

static dtr_result dtr__cuda_event_query(dtr_context *ctx, dtr_event *ev, int *done) {
    cudaError_t e;
    *done = 1;
    if (!ev) return DTR_OK;
    e = cudaEventQuery(*(cudaEvent_t *)ev);
    if (e == cudaErrorNotReady) { (void)cudaGetLastError(); *done = 0; return DTR_OK; }
    if (dtr__cuda_check(ctx, e, "cudaEventQuery") != DTR_OK) return ctx->status;
    return dtr__cuda_take_error(ctx);
}

/* ---- graphs (dtr_graph, src/core/graph.c) ---- */

/* relaxed: the step's first-use allocations (cudaMalloc of the tape's arena) may happen inside
   the capture; the memory stays the graph's tape's for the graph's life */
static dtr_result dtr__cuda_graph_begin(dtr_context *ctx) {
    return dtr__cuda_check(ctx, cudaStreamBeginCapture(dtr__cuda(ctx)->stream, cudaStreamCaptureModeRelaxed),
                           "cudaStreamBeginCapture");
}

static dtr_result dtr__cuda_graph_end(dtr_context *ctx, void **exec) {
    dtr__cuda_state *s = dtr__cuda(ctx);
    cudaGraph_t g = NULL;
    cudaGraphExec_t x = NULL;
    cudaError_t e = cudaStreamEndCapture(s->stream, &g);
    *exec = NULL;
    if (e == cudaSuccess) e = cudaGraphInstantiate(&x, g, 0);
    if (g) cudaGraphDestroy(g);
    if (dtr__cuda_check(ctx, e, "CUDA graph capture") != DTR_OK) return ctx->status;
    pthread_mutex_lock(&s->mu);
    s->graphs++;
    pthread_mutex_unlock(&s->mu);
    *exec = (void *)x;
    return DTR_OK;
}

static dtr_result dtr__cuda_graph_launch(dtr_context *ctx, void *exec) {
    return dtr__cuda_check(ctx, cudaGraphLaunch((cudaGraphExec_t)exec, dtr__cuda(ctx)->stream), "cudaGraphLaunch");
}

static void dtr__cuda_graph_free(dtr_context *ctx, void *exec) {
    dtr__cuda_state *s = dtr__cuda(ctx);
    int i;
    cudaStreamSynchronize(s->stream);   /* launches queued before run to their end */
    cudaGraphExecDestroy((cudaGraphExec_t)exec);
    pthread_mutex_lock(&s->mu);
    if (--s->graphs == 0) {
        for (i = 0; i < s->n_retired; i++) dtr__cuda_free_locked(ctx, s->retired[i]);
        s->n_retired = 0;
    }
    pthread_mutex_unlock(&s->mu);
}

/* ---- the dispatch table, from the op list ---- */

/* Every kernel family of the op list has its pair dtr__cuda_<k>_fwd / _bwd (a family without
 * one would be NULL here, reported unsupported). The tensor-parallel communication ops run
 * the core's kernels on host images over a host-memory group, and on the device over a
 * group of the context's memory (the cross-entropy's local work: dtr__cuda_vocab_xent). */
#define dtr__cuda_comm_fwd dtr__comm_staged_fwd
#define dtr__cuda_comm_bwd dtr__comm_staged_bwd

/* The families whose kernels load and store 16-bit tensors themselves (dtr__cuda_mem:
 * element-wise, layer norm, embedding, softmax, dropout; cross-entropy reads its logits as they are on every
 * backend; linear and attention take 16-bit operands in 16-bit products and widen otherwise
 * themselves, cuda_gemm.cu, cuda_attention.cu); the dispatch widens the others' 16-bit tensors into f32 scratch (src/core/widen.c).
 * Setting one to 0 falls back to the widened path, the same arithmetic. */
static constexpr int dtr__cuda_binary_narrow = 1, dtr__cuda_unary_narrow = 1, dtr__cuda_layernorm_narrow = 1,
                     dtr__cuda_embedding_narrow = 1, dtr__cuda_matmul_narrow = 1, dtr__cuda_linear_narrow = 1,
                     dtr__cuda_softmax_narrow = 1, dtr__cuda_cross_entropy_narrow = 0, dtr__cuda_mse_narrow = 1,
                     dtr__cuda_reduce_narrow = 1, dtr__cuda_dropout_narrow = 1, dtr__cuda_conv2d_narrow = 1,
                     dtr__cuda_pool2d_narrow = 1, dtr__cuda_cast_narrow = 0, dtr__cuda_view_narrow = 1,
                     dtr__cuda_comm_narrow = 0, dtr__cuda_checkpoint_narrow = 0, dtr__cuda_attention_narrow = 1,
                     dtr__cuda_rope_narrow = 1, dtr__cuda_batchnorm_narrow = 1, dtr__cuda_lstm_narrow = 1,
                     dtr__cuda_conv_transpose_narrow = 0, dtr__cuda_argmax_narrow = 0,
                     dtr__cuda_gather_narrow = 0, dtr__cuda_upsample_narrow = 1,
                     dtr__cuda_rnn_narrow = 0;

#define DTR__CUDA_ENTRY(id, name, k) {dtr__cuda_##k##_fwd, dtr__cuda_##k##_bwd, dtr__cuda_##k##_narrow},
static const dtr__kernel_pair dtr__cuda_kernels[DTR_OP_COUNT] = {
    {NULL, NULL, 0}, /* DTR_OP_NONE */
    DTR__OP_LIST(DTR__CUDA_ENTRY)
};
#undef DTR__CUDA_ENTRY

static int dtr__cuda_supports_op(const dtr_context *ctx, int op) { (void)ctx; return dtr__table_has(dtr__cuda_kernels, op); }
static dtr_result dtr__cuda_forward(dtr_context *ctx, dtr__node *n) { return dtr__table_run(dtr__cuda_kernels, "cuda", ctx, n, 0); }
static dtr_result dtr__cuda_backward(dtr_context *ctx, dtr__node *n) { return dtr__table_run(dtr__cuda_kernels, "cuda", ctx, n, 1); }

/* page-locked host memory: copies to and from it run at the link's speed, without the
   driver's bounce through its own pinned buffer */
static void *dtr__cuda_host_alloc(dtr_context *ctx, size_t bytes) {
    void *p = NULL;
    if (dtr__cuda_check(ctx, cudaMallocHost(&p, bytes ? bytes : 1), "cudaMallocHost") != DTR_OK) return NULL;
    return p;
}

static void dtr__cuda_host_free(dtr_context *ctx, void *p) {
    (void)ctx;
    if (p) cudaFreeHost(p);
}

/* device memory (cudaMalloc): a pageable or page-locked host pointer, or managed memory, is
   the host's to read */
static int dtr__cuda_owns(dtr_context *ctx, const void *p) {
    cudaPointerAttributes at;
    (void)ctx;
    if (cudaPointerGetAttributes(&at, p) != cudaSuccess) {
        (void)cudaGetLastError();   /* not a pointer CUDA knows of: the host's */
        return 0;
    }
    return at.type == cudaMemoryTypeDevice;
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
    dtr__cuda_sync,
    dtr__cuda_host_alloc,
    dtr__cuda_host_free,
    dtr__cuda_to_host_async,
    dtr__cuda_from_host_async,
    dtr__cuda_owns,
    dtr__cuda_copy,
    dtr__cuda_graph_begin,
    dtr__cuda_graph_end,
    dtr__cuda_graph_launch,
    dtr__cuda_graph_free,
    dtr__cuda_copy2d,
    dtr__cuda_vocab_xent,
    dtr__cuda_codec,
    dtr__cuda_powersgd,
    dtr__cuda_reserve,
    dtr__cuda_back
};

/* ---- public entry points ---- */

extern "C" const dtr_backend *dtr_cuda_backend(void) { return &dtr__cuda_backend_vt; }

extern "C" dtr_result dtr_cuda_memory(dtr_context *ctx, size_t *in_use, size_t *peak, size_t *cached, int reset_peak) {
    dtr__cuda_state *s;
    if (!ctx) return DTR_NULL_HANDLE;
    /* by a slot, not the vtable's address: inside a captured step the backend is the graph's guard */
    if (ctx->backend->init != dtr__cuda_backend_vt.init) return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_cuda_memory: not a CUDA context");
    s = dtr__cuda(ctx);
    if (in_use) *in_use = s->live_bytes;
    if (peak) *peak = s->peak_bytes;
    if (cached) *cached = s->cached_bytes;
    if (reset_peak) s->peak_bytes = s->live_bytes;
    return DTR_OK;
}

extern "C" int dtr_cuda_device_count(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
    return n;
}
