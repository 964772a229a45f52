/* ============================================================================
 * Context: configuration, backend, thread pool, step arena, errors, logging, RNG.
 * ==========================================================================*/
#include "../public/api.h"
#include "internal.h"
#include "formulas.h"
#include <math.h>
#ifndef _WIN32
#include <unistd.h>
#endif

/* ---- version and result strings ---- */

int dtr_version(void) { return DTR_VERSION_NUMBER; }
const char *dtr_version_string(void) { return DTR_VERSION_STRING; }

const char *dtr_result_string(dtr_result r) {
    switch (r) {
    case DTR_OK: return "ok";
    case DTR_INVALID_ARGUMENT: return "invalid argument";
    case DTR_NULL_HANDLE: return "null handle";
    case DTR_SHAPE_MISMATCH: return "shape mismatch";
    case DTR_DTYPE_MISMATCH: return "dtype mismatch";
    case DTR_OUT_OF_MEMORY: return "out of memory";
    case DTR_ARENA_FULL: return "arena full";
    case DTR_BAD_STATE: return "bad state";
    case DTR_UNSUPPORTED: return "unsupported";
    case DTR_NOT_FOUND: return "not found";
    case DTR_VERSION_MISMATCH: return "version mismatch";
    case DTR_IO_ERROR: return "i/o error";
    case DTR_CORRUPT_FILE: return "corrupt file";
    case DTR_TIMEOUT: return "timeout";
    case DTR_PEER_FAILED: return "peer failed";
    case DTR_DEVICE_ERROR: return "device error";
    case DTR_DEVICE_OUT_OF_MEMORY: return "device out of memory";
    case DTR_NONFINITE: return "non-finite value";
    }
    return "unknown error";
}

/* ---- arena ---- */

#define DTR__ALIGN 64
#define DTR__CHUNK_HDR ((sizeof(dtr__chunk) + DTR__ALIGN - 1) / DTR__ALIGN * DTR__ALIGN)

/* bytes rounded up to the arena's alignment (at least one unit) */
static size_t dtr__aligned(size_t bytes) {
    size_t need = (bytes + DTR__ALIGN - 1) & ~(size_t)(DTR__ALIGN - 1);
    return need ? need : DTR__ALIGN;
}

void dtr__arena_init(dtr__arena *a, const dtr_allocation_callbacks *alloc, size_t chunk_bytes, size_t max_bytes) {
    memset(a, 0, sizeof(*a));
    a->alloc = alloc;
    a->chunk_bytes = chunk_bytes;
    a->max_bytes = max_bytes;
}

/* A chunk of `bytes`: the header and the payload in one host allocation, or, for a device
   arena, the header on the host and the payload from the backend (device memory). */
static dtr__chunk *dtr__chunk_new(dtr__arena *a, size_t bytes) {
    size_t inline_bytes = a->dev ? 0 : bytes + DTR__ALIGN;
    char *raw = (char *)dtr__malloc(a->alloc, DTR__CHUNK_HDR + inline_bytes);
    dtr__chunk *c;
    if (!raw) return NULL;
    c = (dtr__chunk *)raw;
    c->next = NULL;
    c->size = bytes;
    c->used = 0;
    if (a->dev) {
        c->data = (char *)a->dev->backend->chunk_alloc(a->dev, bytes);
        if (!c->data) { dtr__free(a->alloc, raw); return NULL; }
    } else {
        /* over-allocated so the payload can be aligned whatever malloc returns */
        uintptr_t p = (uintptr_t)(raw + DTR__CHUNK_HDR);
        c->data = (char *)((p + DTR__ALIGN - 1) & ~(uintptr_t)(DTR__ALIGN - 1));
    }
    a->reserved += bytes;
    return c;
}

static void dtr__chunk_free(dtr__arena *a, dtr__chunk *c) {
    if (a->dev) a->dev->backend->chunk_free(a->dev, c->data);
    dtr__free(a->alloc, c);
}

void *dtr__arena_alloc(dtr__arena *a, size_t bytes, int *full) {
    size_t need = dtr__aligned(bytes);
    dtr__chunk *c = a->head;
    if (full) *full = 0;
    if (!c || c->used + need > c->size) {
        size_t sz = need > a->chunk_bytes ? need : a->chunk_bytes;
        if (a->max_bytes && a->reserved + sz > a->max_bytes) {
            /* last try: a chunk just big enough */
            sz = need;
            if (a->reserved + sz > a->max_bytes) { if (full) *full = 1; return NULL; }
        }
        c = dtr__chunk_new(a, sz);
        if (!c) return NULL;
        if (a->head) { a->head->next = a->full; a->full = a->head; }
        a->head = c;
    }
    {
        char *p = c->data + c->used;
        c->used += need;
        a->used += need;
        return p;
    }
}

void dtr__arena_reset(dtr__arena *a) {
    if (a->full) {
        /* the step needed several chunks: replace them all by one of the total size */
        size_t total = a->reserved;
        dtr__chunk *c = a->full, *n;
        while (c) { n = c->next; dtr__chunk_free(a, c); c = n; }
        a->full = NULL;
        if (a->head) dtr__chunk_free(a, a->head);
        a->head = NULL;
        a->reserved = 0;
        if (a->max_bytes && total > a->max_bytes) total = a->max_bytes;
        a->head = dtr__chunk_new(a, total); /* NULL is fine: the next alloc retries */
    } else if (a->head) {
        a->head->used = 0;
    }
    a->used = 0;
}

void dtr__arena_free(dtr__arena *a) {
    dtr__chunk *c = a->full, *n;
    while (c) { n = c->next; dtr__chunk_free(a, c); c = n; }
    if (a->head) dtr__chunk_free(a, a->head);
    a->head = a->full = NULL;
    a->reserved = a->used = 0;
}

/* ---- errors and logging ---- */

static dtr_result dtr__vfail(dtr_context *ctx, dtr_result code, const char *fmt, va_list ap) DTR__PRINTF(3, 0);
static dtr_result dtr__vfail(dtr_context *ctx, dtr_result code, const char *fmt, va_list ap) {
    if (!ctx) return code;
    if (ctx->status == DTR_OK) {
        ctx->status = code;
        vsnprintf(ctx->msg, sizeof(ctx->msg), fmt, ap);
        if (ctx->cfg.log && ctx->cfg.log_level >= DTR_LOG_ERROR)
            ctx->cfg.log(ctx->cfg.log_user, DTR_LOG_ERROR, ctx->msg);
    }
    return code;
}

dtr_result dtr__fail(dtr_context *ctx, dtr_result code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    dtr__vfail(ctx, code, fmt, ap);
    va_end(ap);
    return code;
}

dtr_tensor *dtr__failt(dtr_context *ctx, dtr_result code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    dtr__vfail(ctx, code, fmt, ap);
    va_end(ap);
    return NULL;
}

dtr_result dtr_context_status(const dtr_context *ctx) { return ctx ? ctx->status : DTR_NULL_HANDLE; }
const char *dtr_context_last_error(const dtr_context *ctx) { return ctx ? ctx->msg : "null context"; }

void dtr_context_clear_error(dtr_context *ctx) {
    if (!ctx) return;
    ctx->status = DTR_OK;
    ctx->msg[0] = 0;
}

/* ---- configuration and lifetime ---- */

static void dtr__tape_init(dtr_context *ctx, dtr_tape *t);
static void dtr__tape_clear(dtr_tape *t);

dtr_context_config dtr_context_config_init(void) {
    dtr_context_config c;
    memset(&c, 0, sizeof(c));
    c.log_level = DTR_LOG_WARN;
    return c;
}

static int dtr__online_cores(void) {
#if defined(_SC_NPROCESSORS_ONLN)
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
#else
    return 1;
#endif
}

static DTR__THREAD_LOCAL char dtr__create_err[512];

const char *dtr_context_create_error(void) { return dtr__create_err; }

/* dtr_context_create's answer, its message kept for dtr_context_create_error */
#define DTR__CREATE_FAIL(...) dtr__errf(dtr__create_err, sizeof dtr__create_err, __VA_ARGS__)

/* the configuration's fields in range, the backend built against this header */
static dtr_result dtr__create_check(const dtr_context_config *cfg) {
    const dtr_allocation_callbacks *a = &cfg->alloc;
    if ((a->malloc_fn || a->realloc_fn || a->free_fn) && !(a->malloc_fn && a->realloc_fn && a->free_fn))
        return DTR__CREATE_FAIL(DTR_INVALID_ARGUMENT, "dtr_context_create: allocation callbacks need malloc_fn, realloc_fn "
                                "and free_fn together");
    if (cfg->threads < 0 || cfg->threads > 1024)
        return DTR__CREATE_FAIL(DTR_INVALID_ARGUMENT, "dtr_context_create: threads %d outside 0..1024", cfg->threads);
    if ((unsigned)cfg->matmul_precision > DTR_MATMUL_F16)
        return DTR__CREATE_FAIL(DTR_INVALID_ARGUMENT, "dtr_context_create: matmul_precision %d is not a "
                                "dtr_matmul_precision", (int)cfg->matmul_precision);
    if (!dtr__is_float(cfg->activation_dtype))
        return DTR__CREATE_FAIL(DTR_INVALID_ARGUMENT, "dtr_context_create: activation_dtype %d is not f32, bf16 or f16",
                                (int)cfg->activation_dtype);
    if (cfg->backend && (cfg->backend->abi_version != DTR_VERSION_NUMBER || cfg->backend->struct_size != sizeof(dtr_backend)))
        return DTR__CREATE_FAIL(DTR_VERSION_MISMATCH, "dtr_context_create: backend '%s' was built against another "
                                "dtrain.h (version %d, vtable of %zu bytes; this one: %d, %zu)",
                                cfg->backend->name ? cfg->backend->name : "?", cfg->backend->abi_version,
                                cfg->backend->struct_size, DTR_VERSION_NUMBER, sizeof(dtr_backend));
    return DTR_OK;
}

dtr_result dtr_context_create(const dtr_context_config *cfg, dtr_context **out) {
    dtr_context_config def = dtr_context_config_init();
    dtr_context *ctx;
    dtr_result r;
    dtr__create_err[0] = 0;
    if (!out) return DTR__CREATE_FAIL(DTR_NULL_HANDLE, "dtr_context_create: out is NULL");
    *out = NULL;
    if (!cfg) cfg = &def;
    if ((r = dtr__create_check(cfg)) != DTR_OK) return r;
    ctx = (dtr_context *)dtr__calloc(&cfg->alloc, sizeof(*ctx));
    if (!ctx) return DTR__CREATE_FAIL(DTR_OUT_OF_MEMORY, "dtr_context_create: out of memory");
    ctx->cfg = *cfg;
    ctx->alloc = cfg->alloc;
    ctx->backend = cfg->backend ? cfg->backend : &dtr__cpu_backend;
    ctx->threads = cfg->threads ? cfg->threads : dtr__online_cores();
    ctx->grad_enabled = 1;
    ctx->training = 1;
    dtr_rng_seed(&ctx->rng, cfg->seed, 0x64747261696eULL);
    dtr__tape_init(ctx, &ctx->own);
    ctx->cur = &ctx->own;
    r = dtr__pool_create(&ctx->alloc, ctx->threads, &ctx->pool);
    if (r != DTR_OK) {
        DTR__CREATE_FAIL(r, "dtr_context_create: cannot start %d threads", ctx->threads);
        dtr__free(&ctx->alloc, ctx);
        return r;
    }
    if (ctx->backend->init) {
        r = ctx->backend->init(ctx, &ctx->backend_state);
        if (r != DTR_OK) {   /* the backend said why on the context */
            DTR__CREATE_FAIL(r, "%s", dtr_context_last_error(ctx)[0] ? dtr_context_last_error(ctx) : dtr_result_string(r));
            dtr__pool_destroy(ctx->pool);
            dtr__free(&ctx->alloc, ctx);
            return r;
        }
    }
    *out = ctx;
    return DTR_OK;
}

void dtr_context_destroy(dtr_context *ctx) {
    dtr_allocation_callbacks a;
    int i;
    if (!ctx) return;
    a = ctx->alloc;
    for (i = 0; i < DTR__MAX_RECOMPUTE_DEPTH; i++) dtr_tape_destroy(ctx->recompute[i]);
    dtr__arena_free(&ctx->own.meta);
    dtr__arena_free(&ctx->own.data);
    if (ctx->backend->shutdown) ctx->backend->shutdown(ctx, ctx->backend_state);
    dtr__pool_destroy(ctx->pool);
    dtr__free(&a, ctx);
}

dtr_result dtr_context_reset(dtr_context *ctx) {
    if (!ctx) return DTR_NULL_HANDLE;
    if (ctx->capturing)
        return dtr__fail(ctx, DTR_BAD_STATE, "dtr_context_reset: not inside a captured step (dtr_graph_capture's fn)");
    dtr__tape_clear(&ctx->own);
    ctx->resets++;
    return DTR_OK;
}

/* ---- tapes ---- */

static void dtr__tape_init(dtr_context *ctx, dtr_tape *t) {
    t->ctx = ctx;
    t->head = NULL;
    dtr__arena_init(&t->meta, &ctx->alloc, 1u << 20, 0);
    dtr__arena_init(&t->data, &ctx->alloc, ctx->cfg.arena_bytes ? ctx->cfg.arena_bytes : (16u << 20),
                    ctx->cfg.arena_max_bytes);
    if (!dtr__host_memory(ctx)) t->data.dev = ctx;   /* tensor data lives in the backend's memory */
}

static void dtr__tape_clear(dtr_tape *t) {
    t->ctx->live_bytes -= t->meta.used + t->data.used;
    dtr__arena_reset(&t->meta);
    dtr__arena_reset(&t->data);
    t->head = NULL;
    t->spare = t->unused = NULL;   /* they lived in the arenas */
    t->wide = NULL;
    t->wide_bytes = 0;
}

dtr_result dtr_tape_create(dtr_context *ctx, dtr_tape **out) {
    dtr_tape *t;
    if (!ctx || !out) return DTR_NULL_HANDLE;
    *out = NULL;
    t = (dtr_tape *)dtr__calloc(&ctx->alloc, sizeof(*t));
    if (!t) return dtr__fail(ctx, DTR_OUT_OF_MEMORY, "dtr_tape_create: out of memory");
    dtr__tape_init(ctx, t);
    *out = t;
    return DTR_OK;
}

dtr_result dtr_tape_reset(dtr_tape *t) {
    if (!t) return DTR_NULL_HANDLE;
    dtr__tape_clear(t);
    return DTR_OK;
}

void dtr_tape_destroy(dtr_tape *t) {
    dtr_context *ctx;
    if (!t || t == &t->ctx->own) return;
    ctx = t->ctx;
    dtr__tape_clear(t);
    if (ctx->cur == t) ctx->cur = &ctx->own;
    dtr__arena_free(&t->meta);
    dtr__arena_free(&t->data);
    dtr__free(&ctx->alloc, t);
}

static int dtr__chunk_has(dtr__chunk *c, const void *p) {
    uintptr_t q = (uintptr_t)p, begin;
    if (!c) return 0;
    begin = (uintptr_t)c->data;
    return q >= begin && q < begin + c->size;
}

int dtr__tape_owns(const dtr_tape *t, const void *p) {
    dtr__chunk *c;
    if (dtr__chunk_has(t->meta.head, p)) return 1;
    for (c = t->meta.full; c; c = c->next)
        if (dtr__chunk_has(c, p)) return 1;
    return 0;
}

dtr_tape *dtr_context_set_tape(dtr_context *ctx, dtr_tape *t) {
    dtr_tape *old;
    if (!ctx) return NULL;
    if (t && t->ctx != ctx) {
        dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_context_set_tape: the tape belongs to another context");
        return NULL;
    }
    old = ctx->cur == &ctx->own ? NULL : ctx->cur;
    ctx->cur = t ? t : &ctx->own;
    return old;
}

dtr_tape *dtr_context_tape(const dtr_context *ctx) {
    return ctx && ctx->cur != &ctx->own ? ctx->cur : NULL;
}

int dtr_context_set_grad_enabled(dtr_context *ctx, int enabled) {
    int old;
    if (!ctx) return 0;
    old = ctx->grad_enabled;
    ctx->grad_enabled = enabled ? 1 : 0;
    return old;
}

int dtr_context_set_training(dtr_context *ctx, int training) {
    int old;
    if (!ctx) return 0;
    old = ctx->training;
    ctx->training = training ? 1 : 0;
    return old;
}

int dtr_context_threads(const dtr_context *ctx) { return ctx ? ctx->threads : 0; }

void dtr_context_arena_usage(const dtr_context *ctx, size_t *reserved, size_t *used) {
    if (reserved) *reserved = ctx ? ctx->cur->data.reserved + ctx->cur->meta.reserved : 0;
    if (used) *used = ctx ? ctx->cur->data.used + ctx->cur->meta.used : 0;
}

size_t dtr_context_arena_peak(dtr_context *ctx, int reset) {
    size_t peak;
    if (!ctx) return 0;
    peak = ctx->peak_bytes;
    if (reset) ctx->peak_bytes = ctx->live_bytes;
    return peak;
}

/* an allocation from one of the current tape's arenas, counted in live and peak bytes */
static void *dtr__tape_alloc(dtr_context *ctx, dtr__arena *a, size_t bytes, int *full) {
    size_t before = a->used;
    void *p = dtr__arena_alloc(a, bytes, full);
    ctx->live_bytes += a->used - before;
    if (ctx->live_bytes > ctx->peak_bytes) ctx->peak_bytes = ctx->live_bytes;
    return p;
}

const char *dtr_context_backend_name(const dtr_context *ctx) {
    return ctx && ctx->backend ? ctx->backend->name : "";
}

void *dtr__arena_meta(dtr_context *ctx, size_t bytes, const char *op) {
    int full = 0;
    void *p = dtr__tape_alloc(ctx, &ctx->cur->meta, bytes, &full);
    if (!p) dtr__fail(ctx, DTR_OUT_OF_MEMORY, "%s: out of memory for %zu bytes of tensor metadata", op, bytes);
    return p;
}

static void *dtr__spare_take(dtr_tape *t, size_t need);
void *dtr__arena_data(dtr_context *ctx, size_t bytes, const char *op) {
    int full = 0;
    void *p = ctx->cur->spare ? dtr__spare_take(ctx->cur, dtr__aligned(bytes)) : NULL;
    if (!p) p = dtr__tape_alloc(ctx, &ctx->cur->data, bytes, &full);
    if (!p) {
        if (full)
            dtr__fail(ctx, DTR_ARENA_FULL, "%s: step arena full (%zu bytes asked, %zu of %zu reserved); "
                      "raise arena_max_bytes or use smaller batches", op, bytes, ctx->cur->data.reserved,
                      ctx->cur->data.max_bytes);
        else
            dtr__fail(ctx, DTR_OUT_OF_MEMORY, "%s: out of memory for %zu bytes", op, bytes);
    }
    return p;
}

/* ---- staging memory ---- */

void *dtr__host_alloc(dtr_context *ctx, size_t bytes) {
    if (ctx->backend->host_alloc) return ctx->backend->host_alloc(ctx, bytes);
    return dtr__malloc(&ctx->alloc, bytes ? bytes : 1);
}

void dtr__host_free(dtr_context *ctx, void *p) {
    if (ctx->backend->host_alloc) ctx->backend->host_free(ctx, p);
    else dtr__free(&ctx->alloc, p);
}

void *dtr__mem_alloc_on(dtr_context *ctx, int dev, size_t bytes) {
    void *p;
    if (!dev) return dtr__calloc(&ctx->alloc, bytes ? bytes : 1);
    p = ctx->backend->mem_alloc(ctx, bytes ? bytes : 1);
    if (p && ctx->backend->memset0(ctx, p, bytes) != DTR_OK) {
        ctx->backend->mem_free(ctx, p);
        return NULL;
    }
    return p;
}

void dtr__mem_free_on(dtr_context *ctx, int dev, void *p) {
    if (!dev) dtr__free(&ctx->alloc, p);
    else if (p) ctx->backend->mem_free(ctx, p);
}

dtr_result dtr__to_host_async(dtr_context *ctx, void *dst, const void *src, size_t bytes, dtr_event **done) {
    *done = NULL;
    if (ctx->backend->to_host_async) return ctx->backend->to_host_async(ctx, dst, src, bytes, done);
    return ctx->backend->to_host(ctx, dst, src, bytes);
}

dtr_result dtr__mem_copy(dtr_context *ctx, void *dst, const void *src, size_t bytes) {
    if (!bytes || dst == src) return DTR_OK;
    if (ctx->backend->copy) return ctx->backend->copy(ctx, dst, src, bytes);
    if (!dtr__host_memory(ctx))
        return dtr__fail(ctx, DTR_UNSUPPORTED, "backend '%s' has no device-to-device copy", ctx->backend->name);
    memmove(dst, src, bytes);
    return DTR_OK;
}

dtr_result dtr__mem_copy2d(dtr_context *ctx, void *dst, size_t dpitch, const void *src, size_t spitch, size_t width,
                           size_t rows) {
    dtr_result r = DTR_OK;
    size_t i;
    if (!width || !rows) return DTR_OK;
    if (ctx->backend->copy2d) return ctx->backend->copy2d(ctx, dst, dpitch, src, spitch, width, rows);
    for (i = 0; r == DTR_OK && i < rows; i++)
        r = dtr__mem_copy(ctx, (char *)dst + i * dpitch, (const char *)src + i * spitch, width);
    return r;
}

dtr_result dtr__from_host_async(dtr_context *ctx, void *dst, const void *src, size_t bytes, dtr_event **done) {
    *done = NULL;
    if (ctx->backend->from_host_async) return ctx->backend->from_host_async(ctx, dst, src, bytes, done);
    return ctx->backend->from_host(ctx, dst, src, bytes);
}

/* ---- spares ----
 * Blocks of a tape's data arena that nothing reads any more: an intermediate's gradient once
 * the op that made it has run its backward, and with release_activations an op's output and
 * saved state once it has (every reader of them comes later on the tape, so it ran first).
 * Each tape keeps its own lists; while it is current every later allocation from its data
 * arena takes the smallest spare that fits (a rest of DTR__SPLIT_MIN bytes or
 * more stays a spare), so a pass holds the live blocks only. A block goes back only to the
 * tape whose arena holds it, and stays that arena's memory (reset with it); on a device the
 * order of the stream keeps a reuse behind the kernels that read the block before. */

#define DTR__SPLIT_MIN 4096

/* a spare descriptor of tape t: one whose block was taken again, or a new one (NULL: out of memory) */
static dtr__spare *dtr__spare_desc(dtr_context *ctx, dtr_tape *t) {
    dtr__spare *s = t->unused;
    int full = 0;
    if (s) {
        t->unused = s->next;
        return s;
    }
    return (dtr__spare *)dtr__tape_alloc(ctx, &t->meta, sizeof(*s), &full);
}

/* the chunk of tape t's data arena that holds p, or NULL */
static dtr__chunk *dtr__data_chunk(const dtr_tape *t, const void *p) {
    dtr__chunk *c;
    if (dtr__chunk_has(t->data.head, p)) return t->data.head;
    for (c = t->data.full; c; c = c->next)
        if (dtr__chunk_has(c, p)) return c;
    return NULL;
}

/* s, describing the block [p, p + bytes), onto the front of *list */
static void dtr__spare_push(dtr__spare **list, dtr__spare *s, void *p, size_t bytes) {
    s->p = p;
    s->bytes = bytes;
    s->next = *list;
    *list = s;
}

/* Block [p, p + bytes) of tape t's chunk c back to t's spares (described by s), merged with
 * the spares that touch it in the same chunk: released neighbours serve a larger block. */
static void dtr__spare_free(dtr_tape *t, dtr__chunk *c, dtr__spare *s, void *p, size_t bytes) {
    dtr__spare **pp = &t->spare, *q;
    while ((q = *pp) != NULL) {
        char *a = (char *)q->p;
        if (dtr__chunk_has(c, a) && (a + q->bytes == (char *)p || (char *)p + bytes == a)) {
            if (a < (char *)p) p = a;
            bytes += q->bytes;
            *pp = q->next;
            dtr__spare_push(&t->unused, q, NULL, 0);
            pp = &t->spare;   /* the larger block may touch another */
            continue;
        }
        pp = &q->next;
    }
    dtr__spare_push(&t->spare, s, p, bytes);
}

/* The smallest spare of tape t of at least `need` (aligned) bytes, or NULL. */
static void *dtr__spare_take(dtr_tape *t, size_t need) {
    dtr__spare **pp, **best = NULL, *s;
    char *p;
    for (pp = &t->spare; *pp && !(best && (*best)->bytes == need); pp = &(*pp)->next)
        if ((*pp)->bytes >= need && (!best || (*pp)->bytes < (*best)->bytes)) best = pp;
    if (!best) return NULL;
    s = *best;
    *best = s->next;
    p = (char *)s->p;
    if (s->bytes - need >= DTR__SPLIT_MIN) dtr__spare_push(&t->spare, s, p + need, s->bytes - need);
    else dtr__spare_push(&t->unused, s, NULL, 0);
    return p;
}

static int dtr__grad_spareable(const dtr_context *ctx, const dtr_tensor *t) {
    return t->node && !(t->flags & (DTR__PARAM | DTR__RETAIN_GRAD)) && !ctx->cfg.retain_grads;
}

void dtr__grad_spare_mark(dtr_context *ctx, dtr_tensor *t) {
    if (dtr__grad_spareable(ctx, t)) t->flags |= DTR__GRAD_SPARE;
}

int dtr__grad_handoff(dtr_context *ctx, dtr_tensor *from, dtr_tensor *to) {
    if (!from->grad || (from->flags & (DTR__RETAIN_GRAD | DTR__GRAD_SPARE)) != DTR__GRAD_SPARE) return 0;
    if (!(to->flags & DTR__REQUIRES_GRAD) || !dtr__grad_spareable(ctx, to)) return 0;
    if (to->grad && to->grad_pass == ctx->backward_pass) return 0;   /* this pass wrote it already */
    dtr__grad_release(ctx, to);                                       /* an earlier pass's, if any */
    if (to->grad) return 0;
    to->grad = from->grad;
    to->grad_pass = ctx->backward_pass;
    to->flags |= DTR__GRAD_SPARE;
    from->grad = NULL;
    from->flags &= ~(uint32_t)DTR__GRAD_SPARE;
    return 1;
}

int dtr__arena_give_back(dtr_context *ctx, void *p, size_t bytes) {
    dtr_tape *st = ctx->cur;
    dtr__chunk *c = p ? dtr__data_chunk(st, p) : NULL;
    dtr__spare *s;
    if (!c) return 0;                                      /* another tape's block: kept */
    if (!(s = dtr__spare_desc(ctx, st))) return 0;         /* kept */
    dtr__spare_free(st, c, s, p, dtr__aligned(bytes));
    return 1;
}

void dtr__grad_release(dtr_context *ctx, dtr_tensor *t) {
    if (!t->grad || !(t->flags & DTR__GRAD_SPARE) || (t->flags & DTR__RETAIN_GRAD)) return;
    if (!dtr__arena_give_back(ctx, t->grad, (size_t)dtr_tensor_numel(t) * sizeof(float))) return;
    t->grad = NULL;
    t->flags &= ~(uint32_t)DTR__GRAD_SPARE;
}

void *dtr__node_save(dtr_context *ctx, dtr__node *n, size_t bytes) {
    void *p = dtr__arena_data(ctx, bytes, dtr__op_name(n->op));
    dtr__spare *s;
    if (p && ctx->cfg.release_activations && (s = dtr__spare_desc(ctx, ctx->cur)) != NULL)
        dtr__spare_push(&n->saves, s, p, dtr__aligned(bytes));   /* the node's until it has run its backward */
    return p;
}

void dtr__node_release(dtr_context *ctx, dtr__node *n) {
    dtr_tape *st = n->tape;   /* the current one (dtr__replay) */
    dtr__spare *s, *next;
    dtr_tensor *t = n->out;
    for (s = n->saves; s; s = next) {
        next = s->next;
        dtr__spare_free(st, dtr__data_chunk(st, s->p), s, s->p, s->bytes);
    }
    n->saves = NULL;
    n->released = 1;
    if (!(t->flags & DTR__OWNS_DATA) || (t->flags & (DTR__RETAIN | DTR__RELEASED)) || t == ctx->pass_root) return;
    if (!(s = dtr__spare_desc(ctx, st))) return;   /* kept */
    dtr__spare_free(st, dtr__data_chunk(st, t->storage), s, t->storage,
                    dtr__aligned((size_t)dtr_tensor_numel(t) * dtr_dtype_size(t->dtype)));
    t->flags |= DTR__RELEASED;
}

/* ---- random numbers (PCG32, O'Neill) ---- */

void dtr_rng_seed(dtr_rng *rng, uint64_t seed, uint64_t stream) {
    rng->state = 0;
    rng->inc = (stream << 1u) | 1u;
    dtr_rng_u32(rng);
    rng->state += seed;
    dtr_rng_u32(rng);
}

uint32_t dtr_rng_u32(dtr_rng *rng) { return dtr__f_pcg_next(&rng->state, rng->inc); }

/* ---- state ---- */

dtr_result dtr__state_put(dtr_state_entry *out, const char *name, void *data, size_t bytes, int device) {
    out->name = name;
    out->data = data;
    out->bytes = bytes;
    out->device = device;
    return DTR_OK;
}

dtr_result dtr_context_state(dtr_context *ctx, int index, dtr_state_entry *out) {
    if (!ctx || !out) return DTR_NULL_HANDLE;
    if (index == 0) return dtr__state_put(out, "rng", &ctx->rng, sizeof ctx->rng, 0);
    return DTR_NOT_FOUND;
}

dtr_result dtr_context_state_loaded(dtr_context *ctx) { return ctx ? DTR_OK : DTR_NULL_HANDLE; }

/* PCG's jump ahead (O'Neill, pcg_advance_lcg_64): the LCG state after delta steps. */
void dtr__rng_advance(dtr_rng *rng, uint64_t delta) { rng->state = dtr__f_pcg_advance(rng->state, rng->inc, delta); }

dtr__draws dtr__draws_take(dtr_context *ctx, int64_t n, int64_t width, int64_t cols, int64_t col0) {
    dtr__draws d;
    d.rng = ctx->rng;
    d.width = width > 0 ? width : 1;
    d.cols = cols > 0 ? cols : d.width;
    d.col0 = cols > 0 ? col0 : 0;
    dtr__rng_advance(&ctx->rng, (uint64_t)((n + d.width - 1) / d.width * d.cols));
    return d;
}

dtr_rng dtr__draws_at(const dtr__draws *d, int64_t i) {
    dtr_rng r = d->rng;
    r.state = dtr__f_pcg_at(r.state, r.inc, i, d->width, d->cols, d->col0);
    return r;
}

float dtr_rng_uniform(dtr_rng *rng) { return dtr__f_uniform(dtr_rng_u32(rng)); }

float dtr_rng_normal(dtr_rng *rng) {
    float u1 = dtr_rng_uniform(rng), u2 = dtr_rng_uniform(rng);
    if (u1 < 1e-7f) u1 = 1e-7f;
    return sqrtf(-2.0f * logf(u1)) * cosf(6.28318530717958647692f * u2);
}
