/* ============================================================================
 * CUDA backend: device memory. A caching allocator over cudaMalloc (never managed memory)
 * for model buffers, optimizer state and the step arena, and blocks backed only where they
 * are used (the gradient buffer of a model with frozen parameters) through the driver's
 * virtual memory calls.
 * ==========================================================================*/

static int dtr__cuda_sparse_free(dtr_context *ctx, dtr__cuda_state *s, void *p);

/* ---- memory: a caching allocator ----
 * Freed blocks are kept (up to DTR__CUDA_CACHE) and handed out again for a request of at
 * most their size and at least half of it, so the steady state of training (arena chunks,
 * model buffers) never calls cudaMalloc / cudaFree, which synchronise the device. When
 * cudaMalloc fails, the cache is emptied and the allocation tried once more. The sizes of
 * live blocks are kept beside them (few: model buffers, optimizer state, arena chunks). */

static void dtr__cuda_cache_empty(dtr__cuda_state *s) {
    int i;
    for (i = 0; i < s->n_cache; i++) cudaFree(s->cache[i].p);
    s->n_cache = 0;
    s->cached_bytes = 0;
}

static void *dtr__cuda_cache_take(dtr__cuda_state *s, size_t bytes) {
    int i, best = -1;
    void *p;
    for (i = 0; i < s->n_cache; i++)
        if (s->cache[i].bytes >= bytes && s->cache[i].bytes / 2 <= bytes && (best < 0 || s->cache[i].bytes < s->cache[best].bytes))
            best = i;
    if (best < 0) return NULL;
    p = s->cache[best].p;
    s->cached_bytes -= s->cache[best].bytes;
    s->cache[best] = s->cache[--s->n_cache];
    return p;
}

static int dtr__cuda_live_add(dtr_context *ctx, dtr__cuda_state *s, void *p, size_t bytes) {
    if (s->n_live == s->cap_live) {
        int cap = s->cap_live ? 2 * s->cap_live : 32;
        dtr__cuda_block *q = (dtr__cuda_block *)dtr__malloc(&ctx->alloc, (size_t)cap * sizeof *s->live);
        if (!q) return 0;
        if (s->n_live) memcpy(q, s->live, (size_t)s->n_live * sizeof *s->live);
        dtr__free(&ctx->alloc, s->live);
        s->live = q;
        s->cap_live = cap;
    }
    s->live[s->n_live].p = p;
    s->live[s->n_live].bytes = bytes;
    s->n_live++;
    s->live_bytes += bytes;
    if (s->live_bytes > s->peak_bytes) s->peak_bytes = s->live_bytes;
    return 1;
}

static void *dtr__cuda_alloc_locked(dtr_context *ctx, size_t bytes) {
    dtr__cuda_state *s = dtr__cuda(ctx);
    void *p;
    cudaError_t e;
    bytes = bytes ? (bytes + 511) & ~(size_t)511 : 512;
    p = dtr__cuda_cache_take(s, bytes);
    if (!p) {
        e = cudaMalloc(&p, bytes);
        if (e == cudaErrorMemoryAllocation && s->n_cache > 0) {
            (void)cudaGetLastError();   /* clear it, then retry with the cache given back */
            cudaStreamSynchronize(s->stream);
            dtr__cuda_cache_empty(s);
            e = cudaMalloc(&p, bytes);
        }
        if (dtr__cuda_check(ctx, e, "cudaMalloc") != DTR_OK) return NULL;
    }
    if (!dtr__cuda_live_add(ctx, s, p, bytes)) {
        cudaFree(p);
        dtr__fail(ctx, DTR_OUT_OF_MEMORY, "cuda: out of host memory tracking device blocks");
        return NULL;
    }
    return p;
}

static void dtr__cuda_free_locked(dtr_context *ctx, void *p) {
    dtr__cuda_state *s = dtr__cuda(ctx);
    int i;
    if (!p) return;
    for (i = 0; i < s->n_live && s->live[i].p != p; i++) {}
    if (i == s->n_live) {   /* a reserved block, or not ours: give it back to the driver */
        if (!dtr__cuda_sparse_free(ctx, s, p)) cudaFree(p);
        return;
    }
    if (s->n_cache < DTR__CUDA_CACHE) {
        /* kernels queued before this free may still read it: the next owner's work is queued
           behind them on the same stream, so reuse is safe without a synchronisation */
        s->cache[s->n_cache++] = s->live[i];
        s->cached_bytes += s->live[i].bytes;
    } else {
        cudaFree(p);
    }
    s->live_bytes -= s->live[i].bytes;
    s->live[i] = s->live[--s->n_live];
}

static void *dtr__cuda_alloc(dtr_context *ctx, size_t bytes) {
    void *p;
    pthread_mutex_lock(&dtr__cuda(ctx)->mu);
    p = dtr__cuda_alloc_locked(ctx, bytes);
    pthread_mutex_unlock(&dtr__cuda(ctx)->mu);
    return p;
}

static void dtr__cuda_free(dtr_context *ctx, void *p) {
    pthread_mutex_lock(&dtr__cuda(ctx)->mu);
    dtr__cuda_free_locked(ctx, p);
    pthread_mutex_unlock(&dtr__cuda(ctx)->mu);
}

/* an outgrown scratch block: freed (work queued on it runs before the next owner's), or kept
   while a graph may replay kernels that use it */
static void dtr__cuda_scratch_drop(dtr_context *ctx, dtr__cuda_state *s) {
    void **r;
    if (!s->scratch) return;
    if (s->graphs == 0) { dtr__cuda_free(ctx, s->scratch); return; }
    r = (void **)dtr__malloc(&ctx->alloc, (size_t)(s->n_retired + 1) * sizeof(void *));
    if (!r) return;   /* out of host memory: the block is leaked, never reused under a graph */
    if (s->n_retired) memcpy(r, s->retired, (size_t)s->n_retired * sizeof(void *));
    dtr__free(&ctx->alloc, s->retired);
    s->retired = r;
    s->retired[s->n_retired++] = s->scratch;
}

static void *dtr__cuda_scratch(dtr_context *ctx, size_t bytes) {
    dtr__cuda_state *s = dtr__cuda(ctx);
    if (bytes <= s->scratch_bytes) return s->scratch;
    dtr__cuda_scratch_drop(ctx, s);
    s->scratch = dtr__cuda_alloc(ctx, bytes);
    s->scratch_bytes = s->scratch ? bytes : 0;
    return s->scratch;
}

static dtr_result dtr__cuda_memset0(dtr_context *ctx, void *dst, size_t bytes) {
    return dtr__cuda_check(ctx, cudaMemsetAsync(dst, 0, bytes, dtr__cuda(ctx)->stream), "cudaMemsetAsync");
}

/* ---- memory backed where it is used (mem_reserve, mem_back) ----
 * A reserved block is an address range whose every granule of the device's mapping
 * granularity (2 MiB on current GPUs) is mapped either to memory of its own or to one shared
 * granule of zeros, so the whole block reads zeros and an unbacked part costs nothing. The
 * addresses never change: kernels, captured graphs, copies and NCCL see an ordinary buffer.
 * Writes of zeros into the shared granule (a memset over the whole buffer) change nothing.
 * The driver's calls (cuMemCreate, cuMemMap, ...) are found through the runtime, so the link
 * needs no -lcuda. Without them (a driver or device without virtual memory management, or
 * DTR_CUDA_VMM=0 in the environment) a reserved block is an ordinary one, zeroed, and
 * mem_back leaves it as it is. */

typedef struct dtr__cuda_driver {
    decltype(&cuDeviceGet) device_get;
    decltype(&cuDeviceGetAttribute) attribute;
    decltype(&cuMemGetAllocationGranularity) granularity;
    decltype(&cuMemAddressReserve) reserve;
    decltype(&cuMemAddressFree) address_free;
    decltype(&cuMemCreate) create;
    decltype(&cuMemRelease) release;
    decltype(&cuMemMap) map;
    decltype(&cuMemUnmap) unmap;
    decltype(&cuMemSetAccess) set_access;
    int ok;
} dtr__cuda_driver;

static dtr__cuda_driver dtr__cuda_drv;
static pthread_once_t dtr__cuda_drv_once = PTHREAD_ONCE_INIT;

static void *dtr__cuda_driver_fn(const char *name) {
    void *fn = NULL;
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
    cudaError_t e = cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &q);
#else
    cudaError_t e = cudaGetDriverEntryPoint(name, &fn, cudaEnableDefault, &q);
#endif
    if (e != cudaSuccess || q != cudaDriverEntryPointSuccess) fn = NULL, (void)cudaGetLastError();
    return fn;
}

static void dtr__cuda_driver_load(void) {
    dtr__cuda_driver *d = &dtr__cuda_drv;
#define DTR__CUDA_DRV(field, name) d->field = (decltype(d->field))dtr__cuda_driver_fn(name)
    DTR__CUDA_DRV(device_get, "cuDeviceGet");
    DTR__CUDA_DRV(attribute, "cuDeviceGetAttribute");
    DTR__CUDA_DRV(granularity, "cuMemGetAllocationGranularity");
    DTR__CUDA_DRV(reserve, "cuMemAddressReserve");
    DTR__CUDA_DRV(address_free, "cuMemAddressFree");
    DTR__CUDA_DRV(create, "cuMemCreate");
    DTR__CUDA_DRV(release, "cuMemRelease");
    DTR__CUDA_DRV(map, "cuMemMap");
    DTR__CUDA_DRV(unmap, "cuMemUnmap");
    DTR__CUDA_DRV(set_access, "cuMemSetAccess");
#undef DTR__CUDA_DRV
    d->ok = d->device_get && d->attribute && d->granularity && d->reserve && d->address_free && d->create && d->release &&
            d->map && d->unmap && d->set_access;
}

static CUmemAllocationProp dtr__cuda_granule_prop(const dtr__cuda_state *s) {
    CUmemAllocationProp p;
    memset(&p, 0, sizeof p);
    p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    p.location.id = s->device;
    return p;
}

/* the device's granularity when it has virtual memory management and DTR_CUDA_VMM is not 0
   (asked once per context), else 0 */
static size_t dtr__cuda_granule(dtr__cuda_state *s) {
    const char *env = getenv("DTR_CUDA_VMM");
    CUdevice dev;
    int vmm = 0;
    size_t g = 0;
    CUmemAllocationProp p = dtr__cuda_granule_prop(s);
    if (s->granule_known) return s->granule;
    s->granule_known = 1;
    pthread_once(&dtr__cuda_drv_once, dtr__cuda_driver_load);
    if (!dtr__cuda_drv.ok || (env && strcmp(env, "0") == 0) || dtr__cuda_drv.device_get(&dev, s->device) != CUDA_SUCCESS ||
        dtr__cuda_drv.attribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev) != CUDA_SUCCESS || !vmm ||
        dtr__cuda_drv.granularity(&g, &p, CU_MEM_ALLOC_GRANULARITY_MINIMUM) != CUDA_SUCCESS)
        g = 0;
    return s->granule = g;
}

static dtr_result dtr__cuda_cu(dtr_context *ctx, CUresult e, const char *what) {
    if (e == CUDA_SUCCESS) return DTR_OK;
    return dtr__fail(ctx, e == CUDA_ERROR_OUT_OF_MEMORY ? DTR_DEVICE_OUT_OF_MEMORY : DTR_DEVICE_ERROR,
                     "cuda: %s: driver error %d", what, (int)e);
}

/* maps memory h (one granule) at `at`, readable and writable by the context's device */
static CUresult dtr__cuda_map_granule(dtr__cuda_state *s, CUdeviceptr at, CUmemGenericAllocationHandle h) {
    CUmemAccessDesc a;
    CUresult e = dtr__cuda_drv.map(at, s->granule, 0, h, 0);
    memset(&a, 0, sizeof a);
    a.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    a.location.id = s->device;
    a.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    if (e == CUDA_SUCCESS && (e = dtr__cuda_drv.set_access(at, s->granule, &a, 1)) != CUDA_SUCCESS) dtr__cuda_drv.unmap(at, s->granule);
    return e;
}

/* a granule of device memory, counted as handed out */
static CUresult dtr__cuda_granule_new(dtr__cuda_state *s, CUmemGenericAllocationHandle *h) {
    CUmemAllocationProp p = dtr__cuda_granule_prop(s);
    CUresult e = dtr__cuda_drv.create(h, s->granule, &p, 0);
    if (e == CUDA_SUCCESS && (s->live_bytes += s->granule) > s->peak_bytes) s->peak_bytes = s->live_bytes;
    return e;
}

static void dtr__cuda_granule_free(dtr__cuda_state *s, CUmemGenericAllocationHandle h) {
    dtr__cuda_drv.release(h);
    s->live_bytes -= s->granule;
}

/* the shared granule of zeros, made (mapped at `at` to be zeroed) at the first reserve */
static dtr_result dtr__cuda_zero_granule(dtr_context *ctx, dtr__cuda_state *s, CUdeviceptr at) {
    CUresult e;
    if (s->has_zero) return dtr__cuda_cu(ctx, dtr__cuda_map_granule(s, at, s->zero), "cuMemMap");
    if ((e = dtr__cuda_granule_new(s, &s->zero)) != CUDA_SUCCESS) return dtr__cuda_cu(ctx, e, "cuMemCreate");
    if ((e = dtr__cuda_map_granule(s, at, s->zero)) != CUDA_SUCCESS) {
        dtr__cuda_granule_free(s, s->zero);
        return dtr__cuda_cu(ctx, e, "cuMemMap");
    }
    s->has_zero = 1;
    if (dtr__cuda_check(ctx, cudaMemsetAsync((void *)at, 0, s->granule, s->stream), "cudaMemsetAsync") != DTR_OK) return ctx->status;
    return dtr__cuda_check(ctx, cudaStreamSynchronize(s->stream), "cudaStreamSynchronize");
}

/* before a remap: the work queued on both streams is done (a bucket's copy to the host reads
   the gradients on the copies stream) */
static dtr_result dtr__cuda_quiet(dtr_context *ctx, dtr__cuda_state *s) {
    if (dtr__cuda_check(ctx, cudaStreamSynchronize(s->stream), "cudaStreamSynchronize") != DTR_OK) return ctx->status;
    return dtr__cuda_check(ctx, cudaStreamSynchronize(s->copies), "cudaStreamSynchronize");
}

static dtr__cuda_sparse *dtr__cuda_sparse_find(dtr__cuda_state *s, const void *p) {
    int i;
    for (i = 0; i < s->n_sparse; i++)
        if (s->sparse[i].base == (CUdeviceptr)p) return &s->sparse[i];
    return NULL;
}

/* unmaps granules [0, n) of b (the stream's work done), gives back their memory and the range */
static void dtr__cuda_sparse_drop(dtr_context *ctx, dtr__cuda_state *s, dtr__cuda_sparse *b, size_t n) {
    size_t g;
    for (g = 0; g < n; g++) {
        dtr__cuda_drv.unmap(b->base + g * s->granule, s->granule);
        if (b->own[g]) dtr__cuda_granule_free(s, b->own[g]);
    }
    dtr__cuda_drv.address_free(b->base, b->n * s->granule);
    dtr__free(&ctx->alloc, b->own);
}

static int dtr__cuda_sparse_grow(dtr_context *ctx, dtr__cuda_state *s) {
    int cap = s->cap_sparse ? 2 * s->cap_sparse : 8;
    dtr__cuda_sparse *q;
    if (s->n_sparse < s->cap_sparse) return 1;
    q = (dtr__cuda_sparse *)dtr__malloc(&ctx->alloc, (size_t)cap * sizeof *q);
    if (!q) return 0;
    if (s->n_sparse) memcpy(q, s->sparse, (size_t)s->n_sparse * sizeof *q);
    dtr__free(&ctx->alloc, s->sparse);
    s->sparse = q, s->cap_sparse = cap;
    return 1;
}

/* a reserved range of n granules, each mapped to the zero granule; 0 with the error recorded */
static CUdeviceptr dtr__cuda_sparse_new(dtr_context *ctx, dtr__cuda_state *s, size_t n) {
    dtr__cuda_sparse b;
    size_t g;
    b.n = n;
    b.own = dtr__cuda_sparse_grow(ctx, s) ? (CUmemGenericAllocationHandle *)dtr__calloc(&ctx->alloc, n * sizeof *b.own) : NULL;
    if (!b.own) { dtr__fail(ctx, DTR_OUT_OF_MEMORY, "cuda: out of host memory for a reserved block"); return 0; }
    if (dtr__cuda_cu(ctx, dtr__cuda_drv.reserve(&b.base, n * s->granule, s->granule, 0, 0), "cuMemAddressReserve") != DTR_OK) {
        dtr__free(&ctx->alloc, b.own);
        return 0;
    }
    for (g = 0; g < n && dtr__cuda_zero_granule(ctx, s, b.base + g * s->granule) == DTR_OK; g++) {}
    if (g < n) {
        dtr__cuda_sparse_drop(ctx, s, &b, g);
        return 0;
    }
    s->sparse[s->n_sparse++] = b;
    return b.base;
}

static void *dtr__cuda_reserve(dtr_context *ctx, size_t bytes) {
    dtr__cuda_state *s = dtr__cuda(ctx);
    void *p;
    pthread_mutex_lock(&s->mu);
    if (dtr__cuda_granule(s)) {
        p = (void *)dtr__cuda_sparse_new(ctx, s, (bytes ? bytes + s->granule - 1 : s->granule) / s->granule);
    } else {
        p = dtr__cuda_alloc_locked(ctx, bytes);
        if (p && dtr__cuda_memset0(ctx, p, bytes) != DTR_OK) dtr__cuda_free_locked(ctx, p), p = NULL;
    }
    pthread_mutex_unlock(&s->mu);
    return p;
}

/* granule g of b to its own memory (own 1) or to the zero granule (own 0); the same on failure */
static dtr_result dtr__cuda_regranule(dtr_context *ctx, dtr__cuda_state *s, dtr__cuda_sparse *b, size_t g, int own) {
    CUdeviceptr at = b->base + g * s->granule;
    CUmemGenericAllocationHandle h = 0;
    CUresult e;
    if (own && (e = dtr__cuda_granule_new(s, &h)) != CUDA_SUCCESS) return dtr__cuda_cu(ctx, e, "cuMemCreate");
    dtr__cuda_drv.unmap(at, s->granule);
    if ((e = dtr__cuda_map_granule(s, at, own ? h : s->zero)) != CUDA_SUCCESS) {
        if (h) dtr__cuda_granule_free(s, h);
        dtr__cuda_map_granule(s, at, b->own[g] ? b->own[g] : s->zero);
        return dtr__cuda_cu(ctx, e, "cuMemMap");
    }
    if (b->own[g]) dtr__cuda_granule_free(s, b->own[g]);
    b->own[g] = h;
    return own ? dtr__cuda_memset0(ctx, (void *)at, s->granule) : DTR_OK;
}

/* 1 when granule [a, a + len) meets one of the n ranges r (ascending) */
static int dtr__cuda_ranges_meet(const size_t *r, int n, size_t a, size_t len) {
    int i;
    for (i = 0; i < n && r[2 * i] < a + len; i++)
        if (r[2 * i + 1] > a && r[2 * i + 1] > r[2 * i]) return 1;
    return 0;
}

static dtr_result dtr__cuda_back_locked(dtr_context *ctx, dtr__cuda_state *s, void *block, const size_t *r, int n) {
    dtr__cuda_sparse *b = dtr__cuda_sparse_find(s, block);
    dtr_result res = DTR_OK;
    size_t g, G = s->granule;
    if (!b) return DTR_OK;   /* an ordinary block (no virtual memory calls): backed throughout */
    if (dtr__cuda_quiet(ctx, s) != DTR_OK) return ctx->status;
    for (g = 0; g < b->n && res == DTR_OK; g++) {
        int want = dtr__cuda_ranges_meet(r, n, g * G, G);
        if (want != (b->own[g] != 0)) res = dtr__cuda_regranule(ctx, s, b, g, want);
    }
    return res;
}

static dtr_result dtr__cuda_back(dtr_context *ctx, void *block, const size_t *r, int n) {
    dtr__cuda_state *s = dtr__cuda(ctx);
    dtr_result res;
    pthread_mutex_lock(&s->mu);
    res = dtr__cuda_back_locked(ctx, s, block, r, n);
    pthread_mutex_unlock(&s->mu);
    return res;
}

/* mem_free of a reserved block (the stream's work on it done first); 0 when p is not one */
static int dtr__cuda_sparse_free(dtr_context *ctx, dtr__cuda_state *s, void *p) {
    dtr__cuda_sparse *b = dtr__cuda_sparse_find(s, p);
    if (!b) return 0;
    cudaStreamSynchronize(s->stream);
    cudaStreamSynchronize(s->copies);
    dtr__cuda_sparse_drop(ctx, s, b, b->n);
    *b = s->sparse[--s->n_sparse];
    return 1;
}

/* at shutdown: every reserved block left, then the zero granule */
static void dtr__cuda_sparse_release(dtr_context *ctx, dtr__cuda_state *s) {
    while (s->n_sparse) dtr__cuda_sparse_free(ctx, s, (void *)s->sparse[0].base);
    if (s->has_zero) dtr__cuda_granule_free(s, s->zero), s->has_zero = 0;
    dtr__free(&ctx->alloc, s->sparse);
}
