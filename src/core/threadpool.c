/* ============================================================================
 * Thread pool: parallel loops over [0, n) and per-worker scratch memory.
 *
 * The pool owns threads-1 pthreads; the thread that calls dtr__pool_run is worker 0 and
 * runs the first chunk itself. Each worker has its own job ticket (a generation counter):
 * the caller writes the job, bumps the tickets of the workers it needs and wakes only
 * those that sleep. Between jobs a worker spins for a short while (DTR_POOL_SPIN_TICKS
 * time-stamp ticks on x86, DTR_POOL_SPIN_ITERS pause loops elsewhere) so that the many
 * small parallel loops of a training step start without a futex round trip, then sleeps
 * on a condition variable: an idle pool burns no CPU. Every chunk is claimed with a
 * compare-and-swap before it runs, and once its own chunk is done the caller runs every
 * chunk that no worker has claimed yet: a worker that is asleep, or whose core is busy
 * with another process (a wake-up on a loaded or virtualised machine can take 100 us),
 * delays nothing. Then the caller waits for the claimed chunks (spin, then sleep). The
 * last worker to finish reads whether the caller sleeps under the mutex the caller sleeps
 * with, never from a bare store-then-load pair across threads: that needs store-load ordering,
 * which qemu's emulation of AArch64 did not give (test_grad under qemu-aarch64 then hung
 * about one run in eight, the caller asleep with nobody to wake it).
 *
 * Rules:
 *   - Chunks are contiguous and depend only on n, grain and the pool's thread count, and
 *     chunk i is always run with worker index i (by worker i's thread or by the caller,
 *     never both), so a task can keep per-worker state, such as its scratch, by index.
 *   - A task must not call dtr__pool_run on the same pool; if it does, the inner loop
 *     runs serially on the calling thread (with that thread's worker index), which is
 *     correct but shares that worker's scratch with the outer task.
 *   - Scratch memory only grows; once a step has asked for its largest sizes, later
 *     steps make no allocation-callback call. Allocation happens on the thread that calls
 *     dtr__pool_scratch.
 *   - No printing, no exit()/abort(): thread-creation failure is a dtr_result.
 * ==========================================================================*/
#include "../public/api.h"
#include "internal.h"
#include <pthread.h>

/* ---- configuration and portability ---- */

#ifndef DTR_POOL_SPIN_TICKS
#define DTR_POOL_SPIN_TICKS 200000   /* ~50-100 us of spinning on a 2-4 GHz TSC */
#endif
#ifndef DTR_POOL_SPIN_ITERS
#define DTR_POOL_SPIN_ITERS 20000
#endif
#define DTR__POOL_MAX_THREADS 1024

#if DTR__HAVE_ATOMICS
#define DTR__POOL_ATOMICS 1
#define DTR__POOL_TLS 1
#else
#define DTR__POOL_ATOMICS 0   /* no atomics: every shared field is read under the mutex */
#define DTR__POOL_TLS 0
#endif

#if DTR__POOL_ATOMICS && (defined(__x86_64__) || defined(__i386__))
#include <x86intrin.h>
#define DTR__POOL_RDTSC 1
static inline void dtr__pool_relax(void) { __builtin_ia32_pause(); }
#elif DTR__POOL_ATOMICS && defined(__aarch64__)
static inline void dtr__pool_relax(void) { __asm__ __volatile__("yield" ::: "memory"); }
#else
static inline void dtr__pool_relax(void) { }
#endif

/* ---- types ---- */

typedef struct dtr__pool_worker {
    struct dtr__pool *pool;
    int index;
    int started;
    pthread_t tid;
    unsigned ticket;           /* bumped by the caller for each job this worker takes part in */
    int sleeping;              /* 1 while blocked on pool->wake */
    int claim;                 /* 0: chunk `index` of the current job is still unclaimed */
    void *scratch_raw;         /* from dtr__malloc */
    void *scratch;             /* 64-byte aligned inside scratch_raw */
    size_t scratch_cap;
    char pad[64];              /* keeps neighbours' hot fields off this cache line */
} dtr__pool_worker;

struct dtr__pool {
    dtr_allocation_callbacks alloc;
    int threads;
    dtr__pool_worker *w;       /* threads entries; w[0] is the caller */
    pthread_mutex_t mu;
    pthread_cond_t wake;       /* workers wait for a ticket */
    pthread_cond_t done;       /* the caller waits for pending == 0 */
    /* the current job: written by the caller before the tickets are bumped */
    dtr__task_fn fn;
    void *arg;
    int64_t n;
    int chunks;
    unsigned pending;          /* workers still running the job */
    int waiting;               /* 1 while the caller is blocked on done */
    int busy;                  /* a job is in flight (nested calls run inline) */
    int stop;
};

/* Worker index of the current thread for inline (nested) runs: 0 outside the pool. */
#if DTR__POOL_TLS
static __thread int dtr__pool_self = 0;
#define DTR__POOL_SELF dtr__pool_self
#else
#define DTR__POOL_SELF 0
#endif

/* ---- chunking ---- */

/** [begin, end) of chunk i of `chunks` over [0, n): sizes differ by at most one. */
static void dtr__pool_chunk(int64_t n, int chunks, int i, int64_t *begin, int64_t *end) {
    int64_t q = n / chunks, r = n % chunks;
    *begin = q * i + (i < r ? i : r);
    *end = *begin + q + (i < r ? 1 : 0);
}

/** Runs chunk i as worker i (the index names the chunk's per-worker state, whichever thread
 *  runs it). */
static void dtr__pool_run_chunk(dtr__pool *p, int i) {
    int64_t b, e;
#if DTR__POOL_TLS
    int saved = dtr__pool_self;
    dtr__pool_self = i;
#endif
    dtr__pool_chunk(p->n, p->chunks, i, &b, &e);
    if (b < e) p->fn(p->arg, b, e, i);
#if DTR__POOL_TLS
    dtr__pool_self = saved;
#endif
}

/* ---- spinning ---- */

#if DTR__POOL_ATOMICS
/** Spins while (*v == val) == equal, at most the spin budget; returns the last value read. */
static unsigned dtr__pool_spin(unsigned *v, unsigned val, int equal) {
    unsigned cur = DTR__ATOMIC_LOAD_SC(v);
#ifdef DTR__POOL_RDTSC
    unsigned long long t0 = __rdtsc();
    while ((cur == val) == equal && __rdtsc() - t0 < (unsigned long long)DTR_POOL_SPIN_TICKS) {
        dtr__pool_relax(); dtr__pool_relax(); dtr__pool_relax(); dtr__pool_relax();
        cur = DTR__ATOMIC_LOAD_SC(v);
    }
#else
    long it;
    for (it = 0; (cur == val) == equal && it < DTR_POOL_SPIN_ITERS; it++) {
        dtr__pool_relax();
        cur = DTR__ATOMIC_LOAD_SC(v);
    }
#endif
    return cur;
}
#endif

/* ---- workers ---- */

static void *dtr__pool_main(void *argp) {
    dtr__pool_worker *w = (dtr__pool_worker *)argp;
    dtr__pool *p = w->pool;
    unsigned seen = 0;
#if DTR__POOL_TLS
    dtr__pool_self = w->index;
#endif
    for (;;) {
        int last;
#if DTR__POOL_ATOMICS
        unsigned t = dtr__pool_spin(&w->ticket, seen, 1);
        if (t == seen) {
            pthread_mutex_lock(&p->mu);
            DTR__ATOMIC_STORE_SC(&w->sleeping, 1);
            while (DTR__ATOMIC_LOAD_SC(&w->ticket) == seen && !DTR__ATOMIC_LOAD_SC(&p->stop))
                pthread_cond_wait(&p->wake, &p->mu);
            DTR__ATOMIC_STORE_SC(&w->sleeping, 0);
            pthread_mutex_unlock(&p->mu);
            t = DTR__ATOMIC_LOAD_SC(&w->ticket);
        }
        if (t == seen) break;   /* woken by stop */
        seen = t;
        /* The caller may have run this chunk already (it takes the chunks no worker has
         * claimed once its own is done): then there is nothing to do. */
        {
            int expect = 0;
            if (!DTR__ATOMIC_CAS(&w->claim, &expect, 1)) continue;
        }
        dtr__pool_run_chunk(p, w->index);
        last = DTR__ATOMIC_DEC(&p->pending) == 0;
        if (last) {   /* `waiting` read under the mutex (the caller sets it and reads `pending` under it) */
            pthread_mutex_lock(&p->mu);
            if (DTR__ATOMIC_LOAD_SC(&p->waiting)) pthread_cond_signal(&p->done);
            pthread_mutex_unlock(&p->mu);
        }
#else
        pthread_mutex_lock(&p->mu);
        while (w->ticket == seen && !p->stop) pthread_cond_wait(&p->wake, &p->mu);
        if (w->ticket == seen) { pthread_mutex_unlock(&p->mu); break; }
        seen = w->ticket;
        pthread_mutex_unlock(&p->mu);
        dtr__pool_run_chunk(p, w->index);
        pthread_mutex_lock(&p->mu);
        last = --p->pending == 0;
        if (last) pthread_cond_signal(&p->done);
        pthread_mutex_unlock(&p->mu);
#endif
    }
    return NULL;
}

/* ---- create / destroy ---- */

dtr_result dtr__pool_create(const dtr_allocation_callbacks *a, int threads, dtr__pool **out) {
    dtr__pool *p;
    int i;
    if (!out) return DTR_NULL_HANDLE;
    *out = NULL;
    if (threads < 1) threads = 1;
    if (threads > DTR__POOL_MAX_THREADS) return DTR_INVALID_ARGUMENT;
    p = (dtr__pool *)dtr__calloc(a, sizeof(*p));
    if (!p) return DTR_OUT_OF_MEMORY;
    if (a) p->alloc = *a;
    p->threads = threads;
    p->w = (dtr__pool_worker *)dtr__calloc(a, sizeof(dtr__pool_worker) * (size_t)threads);
    if (!p->w) { dtr__free(a, p); return DTR_OUT_OF_MEMORY; }
    for (i = 0; i < threads; i++) { p->w[i].pool = p; p->w[i].index = i; p->w[i].claim = 1; }
    if (pthread_mutex_init(&p->mu, NULL) != 0) goto fail_mu;
    if (pthread_cond_init(&p->wake, NULL) != 0) goto fail_wake;
    if (pthread_cond_init(&p->done, NULL) != 0) goto fail_done;
    for (i = 1; i < threads; i++) {
        if (pthread_create(&p->w[i].tid, NULL, dtr__pool_main, &p->w[i]) != 0) {
            dtr__pool_destroy(p);   /* joins the workers started so far */
            return DTR_OUT_OF_MEMORY;
        }
        p->w[i].started = 1;
    }
    *out = p;
    return DTR_OK;
fail_done:
    pthread_cond_destroy(&p->wake);
fail_wake:
    pthread_mutex_destroy(&p->mu);
fail_mu:
    dtr__free(a, p->w);
    dtr__free(a, p);
    return DTR_OUT_OF_MEMORY;
}

void dtr__pool_destroy(dtr__pool *p) {
    dtr_allocation_callbacks a;
    int i;
    if (!p) return;
    pthread_mutex_lock(&p->mu);
#if DTR__POOL_ATOMICS
    DTR__ATOMIC_STORE_SC(&p->stop, 1);
#else
    p->stop = 1;
#endif
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mu);
    for (i = 1; i < p->threads; i++)
        if (p->w[i].started) pthread_join(p->w[i].tid, NULL);
    pthread_cond_destroy(&p->done);
    pthread_cond_destroy(&p->wake);
    pthread_mutex_destroy(&p->mu);
    a = p->alloc;
    for (i = 0; i < p->threads; i++) dtr__free(&a, p->w[i].scratch_raw);
    dtr__free(&a, p->w);
    dtr__free(&a, p);
}

int dtr__pool_threads(const dtr__pool *p) {
    return p ? p->threads : 1;
}

/* ---- parallel loops ---- */

void dtr__pool_run(dtr__pool *p, int64_t n, int64_t grain, dtr__task_fn fn, void *arg) {
    int64_t c;
    int chunks, i;
    if (n <= 0 || !fn) return;
    if (grain < 1) grain = 1;
    c = p ? n / grain : 1;
    chunks = c < (int64_t)(p ? p->threads : 1) ? (int)c : (p ? p->threads : 1);
    if (chunks <= 1) { fn(arg, 0, n, p ? DTR__POOL_SELF : 0); return; }
#if DTR__POOL_ATOMICS
    {
        int expect = 0, wake = 0;
        if (!DTR__ATOMIC_CAS(&p->busy, &expect, 1)) {   /* nested: run inline */
            fn(arg, 0, n, DTR__POOL_SELF);
            return;
        }
        p->fn = fn; p->arg = arg; p->n = n; p->chunks = chunks;
        DTR__ATOMIC_STORE_SC(&p->pending, (unsigned)(chunks - 1));
        for (i = 1; i < chunks; i++) DTR__ATOMIC_STORE_SC(&p->w[i].claim, 0);
        for (i = 1; i < chunks; i++) DTR__ATOMIC_STORE_SC(&p->w[i].ticket, DTR__ATOMIC_LOAD_SC(&p->w[i].ticket) + 1u);
        for (i = 1; i < chunks; i++) wake |= DTR__ATOMIC_LOAD_SC(&p->w[i].sleeping);
        if (wake) {
            pthread_mutex_lock(&p->mu);
            pthread_cond_broadcast(&p->wake);
            pthread_mutex_unlock(&p->mu);
        }
        dtr__pool_run_chunk(p, 0);
        /* Chunks whose worker has not started yet (asleep, or its core busy with another
         * process) run here: a late worker never delays the loop. */
        for (i = 1; i < chunks; i++) {
            int expect = 0;
            if (DTR__ATOMIC_CAS(&p->w[i].claim, &expect, 1)) {
                dtr__pool_run_chunk(p, i);
                DTR__ATOMIC_DEC(&p->pending);
            }
        }
        if (dtr__pool_spin(&p->pending, 0, 0) != 0) {
            pthread_mutex_lock(&p->mu);
            DTR__ATOMIC_STORE_SC(&p->waiting, 1);
            while (DTR__ATOMIC_LOAD_SC(&p->pending) != 0) pthread_cond_wait(&p->done, &p->mu);
            DTR__ATOMIC_STORE_SC(&p->waiting, 0);
            pthread_mutex_unlock(&p->mu);
        }
        DTR__ATOMIC_STORE_SC(&p->busy, 0);
    }
#else
    pthread_mutex_lock(&p->mu);
    if (p->busy) { pthread_mutex_unlock(&p->mu); fn(arg, 0, n, DTR__POOL_SELF); return; }
    p->busy = 1;
    p->fn = fn; p->arg = arg; p->n = n; p->chunks = chunks;
    p->pending = chunks - 1;
    for (i = 1; i < chunks; i++) p->w[i].ticket++;
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mu);
    dtr__pool_run_chunk(p, 0);
    pthread_mutex_lock(&p->mu);
    while (p->pending != 0) pthread_cond_wait(&p->done, &p->mu);
    p->busy = 0;
    pthread_mutex_unlock(&p->mu);
#endif
}

/* ---- scratch ---- */

void *dtr__pool_scratch(dtr__pool *p, int worker, size_t bytes) {
    dtr__pool_worker *w;
    void *raw;
    size_t cap;
    if (!p || worker < 0 || worker >= p->threads) return NULL;
    w = &p->w[worker];
    if (w->scratch && w->scratch_cap >= bytes) return w->scratch;
    cap = (bytes + 4095) & ~(size_t)4095;   /* whole pages: fewer regrowths */
    if (cap < bytes) return NULL;           /* overflow */
    raw = dtr__malloc(&p->alloc, cap + 64);
    if (!raw) return NULL;
    dtr__free(&p->alloc, w->scratch_raw);
    w->scratch_raw = raw;
    w->scratch = (void *)(((uintptr_t)raw + 63) & ~(uintptr_t)63);
    w->scratch_cap = cap;
    return w->scratch;
}
