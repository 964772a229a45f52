/* ============================================================================
 * Shared-memory collectives: the ranks of a group that are processes of one host map one
 * segment and run every collective through it instead of through the transport.
 *
 * Segment: a header with two counters per rank (each on its own cache line), a slot of S
 * bytes per rank, and two result buffers of S bytes. Every collective goes in epochs of at
 * most S bytes per rank (the same count on every rank: the collectives are called in the
 * same order). In epoch e a rank
 *   A. copies its part of the input into its slot and publishes in = e;
 *   B. waits until every rank's `in` reached e (or only the root's, for a broadcast), then
 *      computes its share of the result from the peers' slots (a reduction reads its slice of
 *      every slot, in the documented order of the algorithm the group would have used, so
 *      results are bit for bit those of the point-to-point path), writing it into the
 *      epoch's result buffer (or straight into its output), and publishes red = e;
 *   C. waits until every rank's `red` reached e and copies the result out.
 * A slot is written again only in epoch e + 1, after every rank passed B of epoch e; the
 * result buffers alternate, so a slow reader of epoch e never sees epoch e + 1's writes.
 *
 * Waits spin briefly, then yield, then nap, and check the deadline, an abort flag in the
 * header (a rank that fails sets it), and a zero-byte receive posted on the transport at
 * setup that never matches: the transport fails it when a peer dies or the world aborts, so
 * a killed rank turns into DTR_PEER_FAILED here too. Setup (dtr__shm_setup, collective at
 * group creation) uses the transport: rank 0 creates the segment and broadcasts its name,
 * the others map it, all agree (or all fall back), and the name is unlinked at once.
 * ==========================================================================*/
#include "../public/api.h"
#include "../public/api_comm.h"
#include "../core/internal.h"
#include "comm_internal.h"

#if defined(__unix__) || defined(__APPLE__)
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>
/* compiled after the app's headers: under strict ISO C glibc hides these (see comm.c) */
#if defined(__GLIBC__) && !defined(__USE_POSIX199309) && !defined(__cplusplus)
extern int nanosleep(const struct timespec *req, struct timespec *rem);
#endif
#if defined(__GLIBC__) && !defined(__USE_POSIX) && !defined(__cplusplus)
extern int kill(__pid_t pid, int sig);
#endif
#if defined(__GLIBC__) && !defined(__USE_XOPEN2K8) && !defined(__USE_XOPEN_EXTENDED) && !defined(__cplusplus)
extern int ftruncate(int fd, __off_t length);
#endif

/* Shared with the process transports' watchdog (src/comm/watchdog.c, in dtrain_comm.c). */
int dtr__pid_dead(int64_t pid) {
    char path[64], buf[512], *p;
    FILE *f;
    size_t n;
    if (pid <= 0) return 0;
    if (kill((pid_t)pid, 0) != 0 && errno == ESRCH) return 1;
    snprintf(path, sizeof path, "/proc/%lld/stat", (long long)pid);
    if (!(f = fopen(path, "r"))) return 0;   /* no /proc: kill() is all we know */
    n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    p = strrchr(buf, ')');
    return p && p[1] == ' ' && (p[2] == 'Z' || p[2] == 'X');
}
#define DTR__HAVE_SHM DTR__HAVE_ATOMICS
#else
#define DTR__HAVE_SHM 0
#endif

#if DTR__HAVE_SHM

#define DTR__SHM_MAGIC 0x64747273686d3031ULL /* "dtrshm01" */
/* Collectives of at most this many bytes per rank go through the segment, larger ones through
 * the transport: measured at world 2 (docs/distributed.md) the segment matched or beat
 * libfabric's shm provider from 8 to 128 KiB, and lost from 256 KiB on (single copy there). */
#define DTR__SHM_MAX_BYTES ((size_t)128 << 10)

typedef struct dtr__shm_counter {
    uint64_t in;            /* the epoch whose input is in this rank's slot */
    char pad0[56];
    uint64_t red;           /* the epoch whose share this rank computed */
    int64_t pid;            /* the rank's process, watched while others wait for it */
    char pad1[48];
} dtr__shm_counter;

typedef struct dtr__shm_hdr {
    uint64_t magic;
    uint64_t slot;          /* S */
    int32_t size;
    int32_t abort_rank;     /* -1; else the group rank that failed (first writer wins) */
    char pad[40];
    dtr__shm_counter r[1];  /* size of them */
} dtr__shm_hdr;

struct dtr__shm {
    char *base;
    size_t bytes, slot;
    dtr__shm_hdr *h;
    char *slots, *out[2];
    uint64_t epoch;
    void *sentinel;         /* the transport's never-matching receive */
    int on;                 /* every rank mapped it: the collectives use it */
    int64_t next_check;     /* dtr_time_ns of the next look at the peers' processes */
};

static size_t dtr__shm_hdr_bytes(int n) {
    size_t b = sizeof(dtr__shm_hdr) + (size_t)n * sizeof(dtr__shm_counter);
    return (b + 4095) & ~(size_t)4095;
}

static size_t dtr__shm_slot_bytes(int n) { return n <= 8 ? (size_t)256 << 10 : (size_t)128 << 10; }

/* ---- setup and teardown ---- */

static void dtr__shm_name(char *out, size_t cap, const uint32_t *token) {
    snprintf(out, cap, "/dtr-%ld-%08x%08x", (long)getuid(), token[0], token[1]);
}

/* maps the segment `name` (creating it on rank 0); NULL on any failure */
static dtr__shm *dtr__shm_map(dtr_comm *c, const char *name, int create) {
    size_t slot = dtr__shm_slot_bytes(c->size), bytes = dtr__shm_hdr_bytes(c->size) + (size_t)(c->size + 2) * slot;
    int fd = shm_open(name, create ? O_CREAT | O_EXCL | O_RDWR : O_RDWR, 0600);
    struct stat st;
    dtr__shm *s;
    void *p;
    if (fd < 0) return NULL;
    if ((create && ftruncate(fd, (off_t)bytes) != 0) || fstat(fd, &st) != 0 || (size_t)st.st_size != bytes) {
        close(fd);
        return NULL;
    }
    p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) return NULL;
    s = (dtr__shm *)dtr__calloc(&c->ep->alloc, sizeof(*s));
    if (!s) { munmap(p, bytes); return NULL; }
    s->base = (char *)p, s->bytes = bytes, s->slot = slot, s->h = (dtr__shm_hdr *)p;
    s->slots = s->base + dtr__shm_hdr_bytes(c->size);
    s->out[0] = s->slots + (size_t)c->size * slot;
    s->out[1] = s->out[0] + slot;
    if (create) {
        s->h->slot = slot, s->h->size = c->size, s->h->abort_rank = -1;
        DTR__ATOMIC_STORE(&s->h->magic, DTR__SHM_MAGIC);
    }
    return s;
}

void dtr__shm_free(dtr_comm *c) {
    dtr__shm *s = c->shm;
    if (!s) return;
    if (s->sentinel) c->ep->vt->release(c->ep->state, s->sentinel);
    munmap(s->base, s->bytes);
    dtr__free(&c->ep->alloc, s);
    c->shm = NULL;
}

/* 1 when this group wants a segment (cfg.shared_memory; $DTR_COMM_SHM=0 or 1 overrides)
 * and may use one: processes of one host (not the local transport's threads; other
 * transports' threads decline at setup), host buffers, 2 to 64 ranks */
static int dtr__shm_eligible(const dtr_comm *c) {
    const char *env = getenv("DTR_COMM_SHM");
    int wanted = env && *env ? strcmp(env, "0") != 0 : c->shm_wanted;
    return wanted && c->ep->vt != dtr_local_transport() && !c->mem_ctx && c->size > 1 && c->size <= 64 &&
           c->local_size == c->size;
}

static int dtr__shm_check(const dtr__shm *s, const dtr_comm *c) {
    return s && DTR__ATOMIC_LOAD(&s->h->magic) == DTR__SHM_MAGIC && s->h->size == c->size && s->h->slot == s->slot;
}

/* posts the never-matching receive that reports the world's failures */
static int dtr__shm_post_sentinel(dtr_comm *c) {
    dtr_transport_error e;
    int peer = c->ranks[(c->rank + 1) % c->size];
    return c->ep->vt->irecv(c->ep->state, NULL, 0, peer, dtr__tag_coll(c->ctx, 0xffffffffu, 0xffffffu), &c->shm->sentinel,
                            &e) == DTR_OK;
}

dtr_result dtr__shm_setup(dtr_comm *c) {
    uint32_t msg[4] = {0, 0, 0, 0};   /* token, rank 0 mapped it, rank 0's pid */
    char name[64];
    float ok;
    dtr_result r;
    if (!dtr__shm_eligible(c)) return DTR_OK;
    if (c->rank == 0) {
        int64_t t = dtr_time_ns();
        msg[0] = (uint32_t)t ^ (uint32_t)getpid();
        msg[1] = (uint32_t)((uint64_t)t >> 32) ^ (uint32_t)(uintptr_t)c;
        dtr__shm_name(name, sizeof name, msg);
        c->shm = dtr__shm_map(c, name, 1);
        msg[2] = c->shm != NULL;
        msg[3] = (uint32_t)getpid();
    }
    if ((r = dtr_comm_broadcast(c, msg, 4, DTR_I32, 0)) != DTR_OK) { dtr__shm_free(c); return r; }
    dtr__shm_name(name, sizeof name, msg);
    /* threads of one process (a transport of the app's own) gain nothing: all decline */
    if (c->rank != 0 && msg[2] && msg[3] != (uint32_t)getpid()) c->shm = dtr__shm_map(c, name, 0);
    ok = dtr__shm_check(c->shm, c) && dtr__shm_post_sentinel(c) ? 1.0f : 0.0f;
    if (ok > 0.5f) DTR__ATOMIC_STORE(&c->shm->h->r[c->rank].pid, (int64_t)getpid());
    r = dtr_comm_all_reduce(c, &ok, &ok, 1, DTR_F32, DTR_REDUCE_SUM);   /* ranks that could map it */
    if (c->rank == 0 && msg[2]) shm_unlink(name);   /* mapped by all who could: no file is left behind */
    if (r != DTR_OK || ok < (float)c->size - 0.5f) dtr__shm_free(c);
    else c->shm->on = 1;
    return r;
}

/* ---- waiting ---- */

/* the first rank (all: -1) whose counter at `off` is below e, or -1 when none is */
static int dtr__shm_behind(const dtr__shm *s, int n, int only, size_t off, uint64_t e) {
    int j;
    for (j = 0; j < n; j++) {
        const uint64_t *p = (const uint64_t *)((const char *)&s->h->r[j] + off);
        if ((only < 0 || j == only) && DTR__ATOMIC_LOAD(p) < e) return j;
    }
    return -1;
}

static void dtr__shm_nap(int64_t ns) {
    struct timespec ts;
    ts.tv_sec = 0;
    ts.tv_nsec = (long)ns;
    nanosleep(&ts, NULL);
}

/* the first peer whose process died, or -1 */
static int dtr__shm_dead_peer(dtr_comm *c) {
    int j;
    for (j = 0; j < c->size; j++)
        if (j != c->rank && dtr__pid_dead(DTR__ATOMIC_LOAD(&c->shm->h->r[j].pid))) return j;
    return -1;
}

/* DTR_OK, or the failure that stops the wait: a rank's abort flag, a peer's death, the
 * transport's report (its never-matching receive failed), the deadline */
static dtr_result dtr__shm_check_fail(dtr_comm *c, const dtr__coll *a, int waiting_for) {
    dtr__shm *s = c->shm;
    dtr_transport_error e;
    int done = 0, who = DTR__ATOMIC_LOAD(&s->h->abort_rank), dead;
    int64_t now = dtr_time_ns();
    dtr_result r;
    e.rank = -1, e.native_code = 0, e.msg[0] = 0;
    if (who >= 0)
        return dtr__comm_fail(c, a, DTR_PEER_FAILED, who, 0, "rank %d failed (a shared-memory collective's peer said so)", who);
    if (now < s->next_check) return DTR_OK;   /* the slower looks: every 5 ms */
    s->next_check = now + 5000000;
    if ((dead = dtr__shm_dead_peer(c)) >= 0)
        return dtr__comm_fail(c, a, DTR_PEER_FAILED, c->ranks[dead], 0, "rank %d (pid %lld on this host) died",
                              c->ranks[dead], (long long)DTR__ATOMIC_LOAD(&s->h->r[dead].pid));
    r = c->ep->vt->test(c->ep->state, s->sentinel, &done, &e);
    if (r != DTR_OK || done)
        return dtr__comm_fail(c, a, r != DTR_OK ? r : DTR_PEER_FAILED, e.rank, e.native_code, "%s",
                              e.msg[0] ? e.msg : "the transport reported a failure");
    if (now > a->deadline)
        return dtr__comm_fail(c, a, DTR_TIMEOUT, c->ranks[waiting_for], 0,
                              "timed out after %d ms: rank %d did not reach the shared-memory step", a->timeout_ms,
                              c->ranks[waiting_for]);
    return DTR_OK;
}

/* Waits until the counters at `off` of every rank (or of `only`) reached epoch e. */
static dtr_result dtr__shm_wait(dtr_comm *c, const dtr__coll *a, int only, size_t off, uint64_t e) {
    dtr__shm *s = c->shm;
    int64_t naps = 0;
    long spins = 0;
    int j;
    dtr_result r;
    while ((j = dtr__shm_behind(s, c->size, only, off, e)) >= 0) {
        if (++spins < 2000) continue;
        if ((r = dtr__shm_check_fail(c, a, j)) != DTR_OK) {   /* tell the others whom to blame */
            int32_t none = -1, who = dtr_comm_failed_rank(c) >= 0 ? dtr_comm_failed_rank(c) : c->ep->info.rank;
            DTR__ATOMIC_CAS(&s->h->abort_rank, &none, who);
            return r;
        }
        if (spins < 4000) sched_yield();
        else dtr__shm_nap(naps++ < 100 ? 2000 : 50000);
    }
    return DTR_OK;
}

#define DTR__SHM_IN offsetof(dtr__shm_counter, in)
#define DTR__SHM_RED offsetof(dtr__shm_counter, red)

/* ---- reductions in the point-to-point path's orders ---- */

/* the first element of ring chunk k of a count split over n ranks */
static size_t dtr__shm_ring_start(size_t count, int n, int k) {
    size_t q = count / (size_t)n, rem = count % (size_t)n;
    return (size_t)k * q + ((size_t)k < rem ? (size_t)k : rem);
}

/* out[0..len) = elements [g, g + len) of the slots (slot j's first element is global index
 * g0) in ring order: chunk k starts at rank k + 1 and ends at rank k (an average divides in
 * the last step) */
static void dtr__shm_ring(dtr_comm *c, const dtr__coll *a, char *out, size_t g0, size_t g, size_t len, int div) {
    size_t es = dtr_dtype_size(a->dtype);
    int N = c->size, k;
    for (k = 0; k < N && len; k++) {
        size_t lo = dtr__shm_ring_start(a->count, N, k), hi = dtr__shm_ring_start(a->count, N, k + 1), b, e, i;
        int j;
        b = g > lo ? g : lo, e = g + len < hi ? g + len : hi;
        if (b >= e) continue;
        i = b - g0;
        for (j = 2; j <= N; j++) {
            const char *x = j == 2 ? c->shm->slots + (size_t)((k + 1) % N) * c->shm->slot + i * es : out + (b - g) * es;
            const char *y = c->shm->slots + (size_t)((k + j) % N) * c->shm->slot + i * es;
            dtr__comm_reduce(out + (b - g) * es, x, y, e - b, a->dtype, a->op, j == N ? div : 1);
        }
    }
}

/* the same in recursive doubling's order: pairs 2i, 2i+1 below 2m fold first, then the p
 * partial values combine at distances 1, 2, 4 ..., the lower first (the tree that leads to
 * partial 0); vector by vector over the slice, in the group's scratch (p slices) */
static dtr_result dtr__shm_rd(dtr_comm *c, const dtr__coll *a, char *out, size_t first, size_t len, int div) {
    size_t es = dtr_dtype_size(a->dtype), sl = len * es;
    int N = c->size, p = 1, m, nr, d;
    char *v;
    while (p * 2 <= N) p *= 2;
    m = N - p;
    v = (char *)dtr__comm_scratch(c, (size_t)p * sl + 1);
    if (!v) return dtr__comm_fail(c, a, DTR_OUT_OF_MEMORY, -1, 0, "out of memory for %zu bytes", (size_t)p * sl);
    for (nr = 0; nr < p; nr++) {
        const char *x0 = c->shm->slots + (size_t)(nr < m ? 2 * nr : nr + m) * c->shm->slot + first * es;
        if (nr < m) dtr__comm_reduce(v + nr * sl, x0, x0 + c->shm->slot, len, a->dtype, a->op, 1);
        else memcpy(v + nr * sl, x0, sl);
    }
    for (d = 1; d < p; d *= 2)
        for (nr = 0; nr < p; nr += 2 * d)
            dtr__comm_reduce(v + nr * sl, v + nr * sl, v + (nr + d) * sl, len, a->dtype, a->op, d * 2 >= p ? div : 1);
    memcpy(out, v, sl);
    return DTR_OK;
}

/* ---- the collectives ---- */

/* A: this rank's input of the epoch into its slot */
static uint64_t dtr__shm_publish(dtr_comm *c, const void *src, size_t bytes) {
    dtr__shm *s = c->shm;
    uint64_t e = ++s->epoch;
    if (bytes) memcpy(s->slots + (size_t)c->rank * s->slot, src, bytes);
    DTR__ATOMIC_STORE(&s->h->r[c->rank].in, e);
    return e;
}

static dtr_result dtr__shm_all_reduce(dtr_comm *c, const dtr__coll *a) {
    dtr__shm *s = c->shm;
    size_t es = dtr_dtype_size(a->dtype), per = s->slot / es, g, n;
    int div = a->op == DTR_REDUCE_AVG ? (a->avg_div ? a->avg_div : c->size) : 1;
    dtr_result r;
    for (g = 0; g < a->count; g += n) {
        size_t lo, hi;
        char *out;
        uint64_t e;
        n = a->count - g < per ? a->count - g : per;
        e = dtr__shm_publish(c, (const char *)a->src + g * es, n * es);
        out = s->out[e & 1];
        if ((r = dtr__shm_wait(c, a, -1, DTR__SHM_IN, e)) != DTR_OK) return r;
        lo = n * (size_t)c->rank / (size_t)c->size, hi = n * (size_t)(c->rank + 1) / (size_t)c->size;
        if (a->algo == DTR_ALLREDUCE_RING) dtr__shm_ring(c, a, out + lo * es, g, g + lo, hi - lo, div);
        else if ((r = dtr__shm_rd(c, a, out + lo * es, lo, hi - lo, div)) != DTR_OK) return r;
        DTR__ATOMIC_STORE(&s->h->r[c->rank].red, e);
        if ((r = dtr__shm_wait(c, a, -1, DTR__SHM_RED, e)) != DTR_OK) return r;
        memcpy((char *)a->dst + g * es, out, n * es);
    }
    return DTR_OK;
}

/* reduce-scatter: block b of the input is rank b's; each epoch carries the same range of
 * every block, and rank b reduces its block in ring order (chunk b starts at rank b + 1) */
static dtr_result dtr__shm_reduce_scatter(dtr_comm *c, const dtr__coll *a) {
    dtr__shm *s = c->shm;
    size_t es = dtr_dtype_size(a->dtype), per = s->slot / es / (size_t)c->size, g, n;
    int N = c->size, b, j;
    dtr_result r;
    for (g = 0; g < a->count; g += n) {
        char *mine = s->slots + (size_t)c->rank * s->slot, *dst = (char *)a->dst + g * es;
        uint64_t e = ++s->epoch;
        n = a->count - g < per ? a->count - g : per;
        for (b = 0; b < N; b++) memcpy(mine + (size_t)b * n * es, (const char *)a->src + ((size_t)b * a->count + g) * es, n * es);
        DTR__ATOMIC_STORE(&s->h->r[c->rank].in, e);
        if ((r = dtr__shm_wait(c, a, -1, DTR__SHM_IN, e)) != DTR_OK) return r;
        for (j = 2; j <= N; j++) {
            const char *x = j == 2 ? s->slots + (size_t)((c->rank + 1) % N) * s->slot + (size_t)c->rank * n * es : dst;
            const char *y = s->slots + (size_t)((c->rank + j) % N) * s->slot + (size_t)c->rank * n * es;
            dtr__comm_reduce(dst, x, y, n, a->dtype, a->op, j == N && a->op == DTR_REDUCE_AVG ? N : 1);
        }
        DTR__ATOMIC_STORE(&s->h->r[c->rank].red, e);
        if ((r = dtr__shm_wait(c, a, -1, DTR__SHM_RED, e)) != DTR_OK) return r;
    }
    return DTR_OK;
}

/* all-gather (root < 0) or broadcast from root: every rank (or the root) publishes, all copy */
static dtr_result dtr__shm_gather(dtr_comm *c, const dtr__coll *a, int root) {
    dtr__shm *s = c->shm;
    size_t es = dtr_dtype_size(a->dtype), per = s->slot / es, g, n;
    int j;
    dtr_result r;
    for (g = 0; g < a->count; g += n) {
        const char *src = root < 0 ? (const char *)a->src : (const char *)a->dst;
        uint64_t e;
        n = a->count - g < per ? a->count - g : per;
        e = dtr__shm_publish(c, src + g * es, root < 0 || root == c->rank ? n * es : 0);
        if ((r = dtr__shm_wait(c, a, root, DTR__SHM_IN, e)) != DTR_OK) return r;
        for (j = 0; j < c->size; j++) {
            const char *from = s->slots + (size_t)j * s->slot;
            if (root < 0) memcpy((char *)a->dst + ((size_t)j * a->count + g) * es, from, n * es);
            else if (j == root && j != c->rank) memcpy((char *)a->dst + g * es, from, n * es);
        }
        DTR__ATOMIC_STORE(&s->h->r[c->rank].red, e);
        if ((r = dtr__shm_wait(c, a, -1, DTR__SHM_RED, e)) != DTR_OK) return r;
    }
    return DTR_OK;
}

static dtr_result dtr__shm_barrier(dtr_comm *c, const dtr__coll *a) {
    uint64_t e = dtr__shm_publish(c, NULL, 0);
    dtr_result r = dtr__shm_wait(c, a, -1, DTR__SHM_IN, e);
    if (r == DTR_OK) DTR__ATOMIC_STORE(&c->shm->h->r[c->rank].red, e);
    return r;
}

int dtr_comm_shared_memory(const dtr_comm *c) { return c && c->shm && c->shm->on; }

int dtr__shm_run(dtr_comm *c, const dtr__coll *a, dtr_result *r) {
    if (!c->shm || !c->shm->on) return 0;
    /* large payloads: the provider's single-copy path moves them faster (same bits) */
    if (a->kind != DTR__OP_BARRIER && a->count * dtr_dtype_size(a->dtype) > DTR__SHM_MAX_BYTES) return 0;
    switch (a->kind) {
    case DTR__OP_ALL_REDUCE: *r = dtr__shm_all_reduce(c, a); return 1;
    case DTR__OP_REDUCE_SCATTER: *r = dtr__shm_reduce_scatter(c, a); return 1;
    case DTR__OP_ALL_GATHER: *r = dtr__shm_gather(c, a, -1); return 1;
    case DTR__OP_BROADCAST: *r = dtr__shm_gather(c, a, a->root); return 1;
    case DTR__OP_BARRIER: *r = dtr__shm_barrier(c, a); return 1;
    }
    return 0;
}

#else /* no POSIX shared memory: the transport's path */
#if !(defined(__unix__) || defined(__APPLE__))
int dtr__pid_dead(int64_t pid) { (void)pid; return 0; }
#endif
int dtr_comm_shared_memory(const dtr_comm *c) { (void)c; return 0; }
dtr_result dtr__shm_setup(dtr_comm *c) { (void)c; return DTR_OK; }
void dtr__shm_free(dtr_comm *c) { (void)c; }
int dtr__shm_run(dtr_comm *c, const dtr__coll *a, dtr_result *r) { (void)c, (void)a, (void)r; return 0; }
#endif
