/* tests/devsim.h: a simulated device backend, for the machines without a GPU that run CI.
 *
 * It runs the CPU kernels, but over memory the core must treat as device memory: the backend
 * lacks DTR__CAP_HOST_MEMORY, and every block it hands out (model buffers, optimizer state,
 * step-arena chunks) is its own mapping, protected PROT_NONE whenever the backend is not
 * running. Core code that touches tensor data directly on a device backend, instead of going
 * through the backend's copies and kernels, dies with SIGSEGV here, in `make test`, rather
 * than on the first GPU (the CUDA backend's first run found tensor data in a host arena).
 * Copies check their direction: to_host must read a device block and write outside them,
 * from_host the reverse; a wrong one is counted (devsim_violations) and named on stderr.
 * to_host_async copies land late (devsim_copy): reading their destination before their event
 * completed gives the old bytes.
 *
 * Protection is per context (each has its own blocks), so several contexts on threads of one
 * process (data-parallel ranks) do not unprotect each other's memory. Use:
 *     cc.backend = devsim_backend();   (before dtr_context_create)
 * Needs DTRAIN_INTERNAL_API before test.h (the CPU backend's vtable). */
#ifndef DTRAIN_TEST_DEVSIM_H
#define DTRAIN_TEST_DEVSIM_H
#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

typedef struct devsim_block { void *p; size_t bytes, mapped; } devsim_block;

/* an async copy queued. to_host_async's lands when its event is waited for, or queried a
   second time (the first query says "not yet"), or at a synchronisation: code that reads the
   destination before its event completed reads what was there before. from_host_async's are
   on the stream: they land, in order, before the next backend call that runs there (or at
   their event, or a synchronisation), reading the source then: code that changes the source
   before the event completed sends the new bytes */
typedef struct devsim_copy { void *dst; const void *src; size_t bytes; int pending, queries, to_dev; long seq; } devsim_copy;

typedef struct devsim_state {
    devsim_block *b;
    int n, cap, depth;   /* depth > 0: inside a backend call (blocks open) */
    devsim_copy copies[DTR__ASYNC_COPIES];
    int next_copy, landing;
    long seq;            /* copies queued so far (their order) */
    pthread_mutex_t copy_mu;   /* the queue of copies: a group's progress thread enters the
                                  backend beside the rank's thread (recursive: landing a copy
                                  enters the backend) */
} devsim_state;

static int devsim__violations;
static int devsim_async_copies, devsim_async_early;   /* copies queued; queries answered "not yet" */
static int devsim_copies2d;                           /* strided copies (copy2d) */
/* the block lists, and the depth of backend calls: a group's progress thread may call the
   backend (reduce, copies) beside the rank's thread */
static pthread_mutex_t devsim__mu = PTHREAD_MUTEX_INITIALIZER, devsim__depth_mu = PTHREAD_MUTEX_INITIALIZER;

static devsim_state *devsim__st(dtr_context *ctx) { return (devsim_state *)ctx->backend_state; }

static void devsim__protect(devsim_state *s, int open) {
    int i;
    pthread_mutex_lock(&devsim__mu);
    for (i = 0; i < s->n; i++) mprotect(s->b[i].p, s->b[i].mapped, open ? PROT_READ | PROT_WRITE : PROT_NONE);
    pthread_mutex_unlock(&devsim__mu);
}

static void devsim__land_to_dev(dtr_context *ctx, long upto);

/* a backend call: the blocks open for its duration (calls may nest); the stream's queued
   copies land first */
static void devsim__enter(dtr_context *ctx) {
    devsim_state *s = devsim__st(ctx);
    if (s->depth == 0 && !s->landing) devsim__land_to_dev(ctx, s->seq);
    pthread_mutex_lock(&devsim__depth_mu);
    if (s->depth++ == 0) devsim__protect(s, 1);
    pthread_mutex_unlock(&devsim__depth_mu);
}
static void devsim__leave(dtr_context *ctx) {
    devsim_state *s = devsim__st(ctx);
    pthread_mutex_lock(&devsim__depth_mu);
    if (--s->depth == 0) devsim__protect(s, 0);
    pthread_mutex_unlock(&devsim__depth_mu);
}

/* 1 when [p, p + bytes) lies inside one of ctx's blocks */
static int devsim__owns(dtr_context *ctx, const void *p, size_t bytes) {
    devsim_state *s = devsim__st(ctx);
    int i, in = 0;
    pthread_mutex_lock(&devsim__mu);
    for (i = 0; i < s->n && !in; i++) {
        const char *a = (const char *)s->b[i].p;
        in = (const char *)p >= a && (const char *)p + bytes <= a + s->b[i].bytes;
    }
    pthread_mutex_unlock(&devsim__mu);
    return in;
}

static void devsim__violation(const char *what, const void *p, size_t bytes) {
    devsim__violations++;
    fprintf(stderr, "  devsim: %s (%p, %zu bytes)\n", what, p, bytes);
}

/* backend slot owns: p inside one of ctx's blocks */
static int devsim__owns_ptr(dtr_context *ctx, const void *p) { return devsim__owns(ctx, p, 1); }

static dtr_result devsim__init(dtr_context *ctx, void **state) {
    devsim_state *s = (devsim_state *)calloc(1, sizeof(devsim_state));
    pthread_mutexattr_t a;
    (void)ctx;
    *state = s;
    if (!s) return DTR_OUT_OF_MEMORY;
    pthread_mutexattr_init(&a);
    pthread_mutexattr_settype(&a, PTHREAD_MUTEX_RECURSIVE);
    pthread_mutex_init(&s->copy_mu, &a);
    pthread_mutexattr_destroy(&a);
    return DTR_OK;
}

static void devsim__shutdown(dtr_context *ctx, void *state) {
    devsim_state *s = (devsim_state *)state;
    int i;
    (void)ctx;
    for (i = 0; i < s->n; i++) munmap(s->b[i].p, s->b[i].mapped);
    pthread_mutex_destroy(&s->copy_mu);
    free(s->b);
    free(s);
}

static void *devsim__alloc(dtr_context *ctx, size_t bytes) {
    devsim_state *s = devsim__st(ctx);
    size_t page = (size_t)sysconf(_SC_PAGESIZE), mapped = ((bytes ? bytes : 1) + page - 1) / page * page;
    void *p = NULL;
    /* mapped open or closed as the other blocks are now, and listed before they change */
    pthread_mutex_lock(&devsim__depth_mu);
    pthread_mutex_lock(&devsim__mu);
    if (s->n == s->cap) {
        int cap = s->cap ? 2 * s->cap : 32;
        devsim_block *nb = (devsim_block *)realloc(s->b, (size_t)cap * sizeof *nb);
        if (nb) s->b = nb, s->cap = cap;
    }
    if (s->n < s->cap) p = mmap(NULL, mapped, s->depth ? PROT_READ | PROT_WRITE : PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) p = NULL;
    if (p) {
        s->b[s->n].p = p;
        s->b[s->n].bytes = bytes;
        s->b[s->n].mapped = mapped;
        s->n++;
    }
    pthread_mutex_unlock(&devsim__mu);
    pthread_mutex_unlock(&devsim__depth_mu);
    return p;
}

static void devsim__free(dtr_context *ctx, void *p) {
    devsim_state *s = devsim__st(ctx);
    int i;
    size_t mapped;
    if (!p) return;
    pthread_mutex_lock(&devsim__mu);
    for (i = 0; i < s->n && s->b[i].p != p; i++) {}
    if (i == s->n) {
        pthread_mutex_unlock(&devsim__mu);
        devsim__violation("free of memory that is not a device block", p, 0);
        return;
    }
    mapped = s->b[i].mapped;
    s->b[i] = s->b[--s->n];
    pthread_mutex_unlock(&devsim__mu);
    munmap(p, mapped);
}

static dtr_result devsim__memset0(dtr_context *ctx, void *dst, size_t bytes) {
    dtr_result r;
    if (bytes && !devsim__owns(ctx, dst, bytes)) devsim__violation("memset0 outside the device blocks", dst, bytes);
    devsim__enter(ctx);
    r = dtr__cpu_backend.memset0(ctx, dst, bytes);
    devsim__leave(ctx);
    return r;
}

static dtr_result devsim__copy(dtr_context *ctx, void *dst, const void *src, size_t bytes, int to_host) {
    dtr_result r;
    if (bytes && !devsim__owns(ctx, to_host ? src : dst, bytes))
        devsim__violation(to_host ? "to_host reads outside the device blocks" : "from_host writes outside the device blocks",
                          to_host ? src : dst, bytes);
    if (bytes && devsim__owns(ctx, to_host ? dst : src, bytes))
        devsim__violation(to_host ? "to_host writes into a device block" : "from_host reads a device block",
                          to_host ? dst : src, bytes);
    devsim__enter(ctx);
    r = to_host ? dtr__cpu_backend.to_host(ctx, dst, src, bytes) : dtr__cpu_backend.from_host(ctx, dst, src, bytes);
    devsim__leave(ctx);
    return r;
}
/* backend slot copy: device to device, both inside ctx's blocks */
static dtr_result devsim__dcopy(dtr_context *ctx, void *dst, const void *src, size_t bytes) {
    if (bytes && (!devsim__owns(ctx, dst, bytes) || !devsim__owns(ctx, src, bytes)))
        devsim__violation("copy outside the device blocks", !devsim__owns(ctx, dst, bytes) ? dst : src, bytes);
    devsim__enter(ctx);
    memmove(dst, src, bytes);
    devsim__leave(ctx);
    return DTR_OK;
}

/* rows of a strided copy, each inside the device blocks */
static dtr_result devsim__dcopy2d(dtr_context *ctx, void *dst, size_t dpitch, const void *src, size_t spitch, size_t width,
                                  size_t rows) {
    size_t i;
    for (i = 0; i < rows; i++) devsim__dcopy(ctx, (char *)dst + i * dpitch, (const char *)src + i * spitch, width);
    __atomic_add_fetch(&devsim_copies2d, 1, __ATOMIC_RELAXED);
    return DTR_OK;
}

static dtr_result devsim__to_host(dtr_context *ctx, void *dst, const void *src, size_t bytes) {
    return devsim__copy(ctx, dst, src, bytes, 1);
}
static dtr_result devsim__from_host(dtr_context *ctx, void *dst, const void *src, size_t bytes) {
    return devsim__copy(ctx, dst, src, bytes, 0);
}

static void devsim__land(dtr_context *ctx, devsim_copy *c) {
    devsim_state *s = devsim__st(ctx);
    if (c->pending && c->to_dev) { devsim__land_to_dev(ctx, c->seq); return; }
    pthread_mutex_lock(&s->copy_mu);
    if (c->pending) s->landing++, (void)devsim__copy(ctx, c->dst, c->src, c->bytes, 1), s->landing--;
    c->pending = 0;
    pthread_mutex_unlock(&s->copy_mu);
}
/* the stream's copies to the device queued up to number `upto`, in order */
static void devsim__land_to_dev(dtr_context *ctx, long upto) {
    devsim_state *s = devsim__st(ctx);
    pthread_mutex_lock(&s->copy_mu);
    for (;;) {
        devsim_copy *first = NULL;
        int i;
        for (i = 0; i < DTR__ASYNC_COPIES; i++) {
            devsim_copy *c = &s->copies[i];
            if (c->pending && c->to_dev && c->seq <= upto && (!first || c->seq < first->seq)) first = c;
        }
        if (!first) break;
        s->landing++;
        (void)devsim__copy(ctx, first->dst, first->src, first->bytes, 0);
        s->landing--;
        first->pending = 0;
    }
    pthread_mutex_unlock(&s->copy_mu);
}
static devsim_copy *devsim__as_copy(dtr_context *ctx, dtr_event *ev) {
    devsim_state *s = devsim__st(ctx);
    devsim_copy *c = (devsim_copy *)(void *)ev;
    return c >= s->copies && c < s->copies + DTR__ASYNC_COPIES ? c : NULL;
}
static dtr_result devsim__queue(dtr_context *ctx, void *dst, const void *src, size_t bytes, int to_dev, dtr_event **done) {
    devsim_state *s = devsim__st(ctx);
    devsim_copy *c;
    pthread_mutex_lock(&s->copy_mu);
    c = &s->copies[s->next_copy];
    s->next_copy = (s->next_copy + 1) % DTR__ASYNC_COPIES;
    if (!to_dev) devsim__land_to_dev(ctx, s->seq);   /* a copy to the host starts after the stream's work */
    devsim__land(ctx, c);   /* the slot's earlier copy (its event now stands for this one) */
    c->dst = dst, c->src = src, c->bytes = bytes, c->pending = 1, c->queries = 0, c->to_dev = to_dev, c->seq = ++s->seq;
    __atomic_add_fetch(&devsim_async_copies, 1, __ATOMIC_RELAXED);
    *done = (dtr_event *)(void *)c;
    pthread_mutex_unlock(&s->copy_mu);
    return DTR_OK;
}
static dtr_result devsim__to_host_async(dtr_context *ctx, void *dst, const void *src, size_t bytes, dtr_event **done) {
    return devsim__queue(ctx, dst, src, bytes, 0, done);
}
static dtr_result devsim__from_host_async(dtr_context *ctx, void *dst, const void *src, size_t bytes, dtr_event **done) {
    return devsim__queue(ctx, dst, src, bytes, 1, done);
}

static int devsim__supports_op(const dtr_context *ctx, int op) { return dtr__cpu_backend.supports_op(ctx, op); }

#define DEVSIM_WRAP(name, params, args)             \
    static dtr_result devsim__##name params {       \
        dtr_result r;                               \
        devsim__enter(ctx);                         \
        r = dtr__cpu_backend.name args;             \
        devsim__leave(ctx);                         \
        return r;                                   \
    }
DEVSIM_WRAP(optimizer_update, (dtr_context *ctx, const dtr__opt_args *a), (ctx, a))
DEVSIM_WRAP(sumsq, (dtr_context *ctx, const float *x, int64_t n, double *out), (ctx, x, n, out))
DEVSIM_WRAP(scale, (dtr_context *ctx, float *x, int64_t n, float s), (ctx, x, n, s))
DEVSIM_WRAP(reduce, (dtr_context *ctx, void *out, const void *a, const void *b, size_t n, dtr_dtype dt, int op, int div),
            (ctx, out, a, b, n, dt, op, div))
DEVSIM_WRAP(vocab_xent, (dtr_context *ctx, const dtr__vxent_args *a, int phase), (ctx, a, phase))
DEVSIM_WRAP(codec, (dtr_context *ctx, const dtr__codec_args *a, int decode), (ctx, a, decode))
DEVSIM_WRAP(powersgd, (dtr_context *ctx, const dtr__psgd_args *a, int phase), (ctx, a, phase))
#undef DEVSIM_WRAP

/* as the CUDA backend's table: the tensor-parallel communication ops on host images (or, over
   a group of the context's memory, through the backend's copies, reduce and vocab_xent), run
   with the blocks closed (a direct access of device memory there dies) */
static int devsim__staged(const dtr__node *n) {
    return n->op == DTR_OP_TP_COPY || n->op == DTR_OP_TP_REDUCE || n->op == DTR_OP_TP_GATHER || n->op == DTR_OP_VOCAB_CROSS_ENTROPY;
}
static dtr_result devsim__cast(dtr_context *ctx, dtr__node *n) {
    dtr_result r;
    devsim__enter(ctx);
    r = dtr__cpu_backend.forward(ctx, n);
    devsim__leave(ctx);
    return r;
}
/* dispatched as the CUDA backend's table is (16-bit tensors widened around the staged kernels
   by the cast kernel) */
static const dtr__kernel_pair devsim__staged_table[DTR_OP_COUNT] = {
    [DTR_OP_TP_COPY] = {dtr__comm_staged_fwd, dtr__comm_staged_bwd, 0},
    [DTR_OP_TP_REDUCE] = {dtr__comm_staged_fwd, dtr__comm_staged_bwd, 0},
    [DTR_OP_TP_GATHER] = {dtr__comm_staged_fwd, dtr__comm_staged_bwd, 0},
    [DTR_OP_VOCAB_CROSS_ENTROPY] = {dtr__comm_staged_fwd, dtr__comm_staged_bwd, 0},
    [DTR_OP_CAST] = {devsim__cast, NULL, 0},
};
static dtr_result devsim__run(dtr_context *ctx, dtr__node *n, int bwd) {
    dtr_result r;
    if (devsim__staged(n)) return dtr__table_run(devsim__staged_table, "devsim", ctx, n, bwd);
    devsim__enter(ctx);
    r = bwd ? dtr__cpu_backend.backward(ctx, n) : dtr__cpu_backend.forward(ctx, n);
    devsim__leave(ctx);
    return r;
}
static dtr_result devsim__forward(dtr_context *ctx, dtr__node *n) { return devsim__run(ctx, n, 0); }
static dtr_result devsim__backward(dtr_context *ctx, dtr__node *n) { return devsim__run(ctx, n, 1); }

static dtr_result devsim__event_record(dtr_context *ctx, dtr_event **ev) { return dtr__cpu_backend.event_record(ctx, ev); }
static dtr_result devsim__event_wait(dtr_context *ctx, dtr_event *ev) {
    devsim_copy *c = devsim__as_copy(ctx, ev);
    if (c) devsim__land(ctx, c);
    return c ? DTR_OK : dtr__cpu_backend.event_wait(ctx, ev);
}
static dtr_result devsim__event_query(dtr_context *ctx, dtr_event *ev, int *done) {
    devsim_copy *c = devsim__as_copy(ctx, ev);
    if (!c) return dtr__cpu_backend.event_query(ctx, ev, done);
    *done = !c->pending || c->queries++ > 0;
    if (*done) devsim__land(ctx, c);
    else __atomic_add_fetch(&devsim_async_early, 1, __ATOMIC_RELAXED);
    return DTR_OK;
}
static dtr_result devsim__sync(dtr_context *ctx) {
    int i;
    for (i = 0; i < DTR__ASYNC_COPIES; i++) devsim__land(ctx, &devsim__st(ctx)->copies[i]);
    return dtr__cpu_backend.synchronize(ctx);
}

/* staging memory: plain host memory, counted (a device's staging buffers come from here), and
   poisoned (0xff bytes: NaNs), as page-locked memory comes with whatever it held: a read of
   staging floats nothing wrote shows */
static int devsim_host_blocks;
static void *devsim__host_alloc(dtr_context *ctx, size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    (void)ctx;
    __atomic_add_fetch(&devsim_host_blocks, 1, __ATOMIC_RELAXED);
    if (p) memset(p, 0xff, bytes ? bytes : 1);
    return p;
}
static void devsim__host_free(dtr_context *ctx, void *p) {
    (void)ctx;
    if (p) __atomic_sub_fetch(&devsim_host_blocks, 1, __ATOMIC_RELAXED);
    free(p);
}

static const dtr_backend devsim__vt = {
    DTR_VERSION_NUMBER, sizeof(dtr_backend), "devsim", 0u, devsim__init, devsim__shutdown, devsim__alloc, devsim__free,
    devsim__alloc, devsim__free, devsim__memset0, devsim__to_host, devsim__from_host, devsim__supports_op,
    devsim__forward, devsim__backward, devsim__optimizer_update, devsim__sumsq, devsim__scale, devsim__reduce,
    devsim__event_record, devsim__event_wait, devsim__event_query, devsim__sync, devsim__host_alloc, devsim__host_free, devsim__to_host_async,
    devsim__from_host_async, devsim__owns_ptr, devsim__dcopy, NULL, NULL, NULL, NULL, devsim__dcopy2d, devsim__vocab_xent,
    devsim__codec, devsim__powersgd, NULL, NULL};

/** The simulated device backend (see the top of this file). */
static const dtr_backend *devsim_backend(void) { return &devsim__vt; }

/** A context of one thread on the simulated device, or NULL. */
static inline dtr_context *devsim_context(void) {
    dtr_context_config cc = dtr_context_config_init();
    dtr_context *ctx = NULL;
    cc.backend = devsim_backend();
    cc.threads = 1;
    return dtr_context_create(&cc, &ctx) == DTR_OK ? ctx : NULL;
}

#endif /* DTRAIN_TEST_DEVSIM_H */
