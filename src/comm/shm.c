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
 * All-reduces of at most DTR__SHM_SMALL bytes take one step instead (A, then each rank folds
 * the whole vector from small buffers that alternate by epoch), and those above a slot take
 * the single copy (dtr__shm_all_reduce_cma: every rank reads its chunk from the peers' own
 * buffers and writes the result into theirs with process_vm_readv / process_vm_writev).
 *
 * Waits spin briefly, then yield, then nap, and check the deadline, an abort flag in the
 * header (a rank that fails sets it), the peers' processes, and, once a wait is long, a
 * zero-byte receive posted on the transport that never matches: the transport fails it when
 * a peer dies or the world aborts, so a killed rank turns into DTR_PEER_FAILED here too.
 * Setup (dtr__shm_setup, collective at group creation) uses the transport: rank 0 creates the
 * segment and broadcasts its name, the others map it, all agree (or all fall back), and the
 * name is unlinked at once; then they try single copy on each other.
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
#if defined(__linux__)
#include <sys/uio.h>
#if defined(__GLIBC__) && !defined(__USE_GNU) && !defined(__cplusplus)
extern ssize_t process_vm_readv(pid_t pid, const struct iovec *lvec, unsigned long liovcnt, const struct iovec *rvec,
                                unsigned long riovcnt, unsigned long flags);
extern ssize_t process_vm_writev(pid_t pid, const struct iovec *lvec, unsigned long liovcnt, const struct iovec *rvec,
                                 unsigned long riovcnt, unsigned long flags);
#endif
#define DTR__HAVE_CMA 1
#else
#define DTR__HAVE_CMA 0
#endif
/* compiled after the app's headers: under strict ISO C glibc hides these (see comm.c, which
   declares nanosleep) */
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
/* Collectives of at most this many bytes per rank go through the slots; larger all-reduces by
 * single copy where the ranks may read each other's memory, everything else larger through
 * the transport (whose shm provider has a single copy of its own: copying through the slots
 * lost to it from 256 KiB on, docs/distributed.md). */
#define DTR__SHM_MAX_BYTES ((size_t)128 << 10)

/* All-reduces of at most this many bytes take one step: each rank reduces the whole vector. */
#define DTR__SHM_SMALL ((size_t)16 << 10)

typedef struct dtr__shm_counter {
    uint64_t in;            /* the epoch whose input is in this rank's slot (or whose buffers are below) */
    uint64_t src, dst;      /* single copy: the addresses of this rank's buffers in epoch `in` */
    char pad0[40];
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
    char *small;            /* per rank two buffers of DTR__SHM_SMALL bytes (one-step all-reduces) */
    uint64_t epoch;
    void *sentinel;         /* the transport's never-matching receive, posted while a wait is long */
    int64_t op_start;       /* dtr_time_ns when the running collective began */
    int on;                 /* every rank mapped it: the collectives use it */
    int cma;                /* every rank can read the others' memory (process_vm_readv) */
    int local;              /* the local transport's threads: the segment is a block of its world */
    long spins;             /* polls of a wait before it yields: few when ranks outnumber cores */
    uint64_t probe;         /* DTR__SHM_MAGIC: what the peers read at setup to test that */
    int64_t next_check;     /* dtr_time_ns of the next look at the peers' processes */
    int64_t next_deep;      /* and of the next look for zombies among them */
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

/* the local transport's key of a group's block: its context id and its first member (the
 * groups of one split share the context id; their members differ) */
static uint64_t dtr__shm_key(const dtr_comm *c) { return (uint64_t)c->ctx << 32 | (uint32_t)c->ranks[0]; }

static size_t dtr__shm_bytes(int n) {
    return dtr__shm_hdr_bytes(n) + (size_t)(n + 2) * dtr__shm_slot_bytes(n) + (size_t)n * 2 * DTR__SHM_SMALL;
}

/* a new segment's header (rank 0's, or the first thread's of the local transport) */
static void dtr__shm_init(void *p, void *group) {
    dtr__shm_hdr *h = (dtr__shm_hdr *)p;
    h->slot = dtr__shm_slot_bytes(((dtr_comm *)group)->size), h->size = ((dtr_comm *)group)->size, h->abort_rank = -1;
    DTR__ATOMIC_STORE(&h->magic, DTR__SHM_MAGIC);
}

/* this rank's view of the segment at p; NULL when out of memory */
static dtr__shm *dtr__shm_layout(dtr_comm *c, void *p, int local) {
    dtr__shm *s = (dtr__shm *)dtr__calloc(&c->ep->alloc, sizeof(*s));
    if (!s) return NULL;
    s->base = (char *)p, s->bytes = dtr__shm_bytes(c->size), s->slot = dtr__shm_slot_bytes(c->size), s->h = (dtr__shm_hdr *)p;
    s->local = local;
    s->slots = s->base + dtr__shm_hdr_bytes(c->size);
    s->out[0] = s->slots + (size_t)c->size * s->slot;
    s->out[1] = s->out[0] + s->slot;
    s->small = s->out[1] + s->slot;
    return s;
}

/* maps the segment `name` (creating it on rank 0); NULL on any failure */
static dtr__shm *dtr__shm_map(dtr_comm *c, const char *name, int create) {
    size_t bytes = dtr__shm_bytes(c->size);
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
    if (!(s = dtr__shm_layout(c, p, 0))) { munmap(p, bytes); return NULL; }
    if (create) dtr__shm_init(p, c);
    return s;
}

void dtr__shm_free(dtr_comm *c) {
    dtr__shm *s = c->shm;
    if (!s) return;
    if (s->sentinel) c->ep->vt->release(c->ep->state, s->sentinel);
    if (s->local) dtr__local_shared_put(c->ep->state, dtr__shm_key(c));
    else munmap(s->base, s->bytes);
    dtr__free(&c->ep->alloc, s);
    c->shm = NULL;
}

/* 1 when this group wants a segment (cfg.shared_memory; $DTR_COMM_SHM=0, 1 or 2 overrides)
 * and may use one: processes of one host, or with 2 the local transport's threads too (other
 * transports' threads decline at setup), host buffers, 2 to 64 ranks */
static int dtr__shm_eligible(const dtr_comm *c) {
    const char *env = getenv("DTR_COMM_SHM");
    int wanted = env && *env ? atoi(env) : c->shm_wanted;
    if (c->ep->vt == dtr_local_transport() && wanted < 2) return 0;
    return wanted > 0 && !c->mem_ctx && c->size > 1 && c->size <= 64 && c->local_size == c->size;
}

/* How many polls a wait makes before it yields: few when ranks outnumber the cores (a
 * spinning rank holds a core a peer needs). */
static long dtr__shm_spins(const dtr_comm *c) {
    long cores = 0;
#ifdef _SC_NPROCESSORS_ONLN
    cores = sysconf(_SC_NPROCESSORS_ONLN);
#endif
    return cores > 0 && cores < c->size ? 50 : 2000;
}

/* single copy unless $DTR_COMM_SHM_CMA is 0 */
static int dtr__shm_cma_wanted(void) {
    const char *env = getenv("DTR_COMM_SHM_CMA");
    return !(env && !strcmp(env, "0"));
}

/* The local transport's threads: the segment is a block of their world under the group's
 * context id, made by whichever rank comes first; no collective (a rank may make its group
 * before the others start), and single copy is a memcpy. */
static dtr_result dtr__shm_setup_local(dtr_comm *c) {
    void *p = dtr__local_shared_get(c->ep->state, dtr__shm_key(c), dtr__shm_bytes(c->size), dtr__shm_init, c);
    if (!p) return DTR_OK;   /* every rank goes without */
    if (!(c->shm = dtr__shm_layout(c, p, 1))) {
        dtr__local_shared_put(c->ep->state, dtr__shm_key(c));
        return DTR_OUT_OF_MEMORY;
    }
    DTR__ATOMIC_STORE(&c->shm->h->r[c->rank].pid, (int64_t)getpid());
    c->shm->on = 1;
    c->shm->cma = dtr__shm_cma_wanted();
    c->shm->spins = dtr__shm_spins(c);
    return DTR_OK;
}

static int dtr__shm_check(const dtr__shm *s, const dtr_comm *c) {
    return s && DTR__ATOMIC_LOAD(&s->h->magic) == DTR__SHM_MAGIC && s->h->size == c->size && s->h->slot == s->slot;
}

/* posts the never-matching receive that reports the world's failures (a world abort, a death
 * the transport saw first). Only while a collective waits longer than DTR__SHM_SENTINEL_NS:
 * a receive under way keeps the transport's provider thread polling. */
#define DTR__SHM_SENTINEL_NS 20000000
static dtr_result dtr__shm_post_sentinel(dtr_comm *c, dtr_transport_error *e) {
    int peer = c->ranks[(c->rank + 1) % c->size];
    return c->ep->vt->irecv(c->ep->state, NULL, 0, peer, dtr__tag_coll(c->ctx, 0xffffffffu, 0xffffffu), &c->shm->sentinel, e);
}

/* copies `bytes` between `mine` and `theirs` in process `pid` (write: to theirs): 0, or the
 * errno that stopped it */
static int dtr__shm_xfer(int64_t pid, void *mine, uint64_t theirs, size_t bytes, int write) {
    if (pid == (int64_t)getpid()) {   /* a thread of this process (the local transport) */
        if (write) memcpy((void *)(uintptr_t)theirs, mine, bytes);
        else memcpy(mine, (const void *)(uintptr_t)theirs, bytes);
        return 0;
    }
#if DTR__HAVE_CMA
    while (bytes) {
        struct iovec l, r;
        ssize_t k;
        l.iov_base = mine, l.iov_len = bytes;
        r.iov_base = (void *)(uintptr_t)theirs, r.iov_len = bytes;
        k = write ? process_vm_writev((pid_t)pid, &l, 1, &r, 1, 0) : process_vm_readv((pid_t)pid, &l, 1, &r, 1, 0);
        if (k <= 0) return k < 0 ? errno : EIO;
        mine = (char *)mine + k, theirs += (uint64_t)k, bytes -= (size_t)k;
    }
    return 0;
#else
    (void)pid, (void)mine, (void)theirs, (void)bytes, (void)write;
    return ENOSYS;
#endif
}

/* Single copy is on when every rank read its next peer's probe and wrote it back (cross-memory
 * attach allowed: same user, no ptrace restriction in the way) and $DTR_COMM_SHM_CMA is not 0. */
static dtr_result dtr__shm_cma_setup(dtr_comm *c) {
    int peer = (c->rank + 1) % c->size;
    uint64_t got = 0;
    float ok = 0.0f;
    dtr_result r;
    int64_t pid = DTR__ATOMIC_LOAD(&c->shm->h->r[peer].pid);
    if (dtr__shm_cma_wanted() && dtr__shm_xfer(pid, &got, c->shm->h->r[peer].src, sizeof got, 0) == 0 &&
        got == DTR__SHM_MAGIC && dtr__shm_xfer(pid, &got, c->shm->h->r[peer].src, sizeof got, 1) == 0)
        ok = 1.0f;
    r = dtr_comm_all_reduce(c, &ok, &ok, 1, DTR_F32, DTR_REDUCE_SUM);
    c->shm->cma = r == DTR_OK && ok > (float)c->size - 0.5f;
    return r;
}

dtr_result dtr__shm_setup(dtr_comm *c) {
    uint32_t msg[4] = {0, 0, 0, 0};   /* token, rank 0 mapped it, rank 0's pid */
    char name[64];
    float ok;
    dtr_result r;
    if (!dtr__shm_eligible(c)) return DTR_OK;
    if (c->ep->vt == dtr_local_transport()) return dtr__shm_setup_local(c);
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
    ok = dtr__shm_check(c->shm, c) ? 1.0f : 0.0f;
    if (ok > 0.5f) {
        c->shm->probe = DTR__SHM_MAGIC;
        c->shm->h->r[c->rank].src = (uint64_t)(uintptr_t)&c->shm->probe;
        DTR__ATOMIC_STORE(&c->shm->h->r[c->rank].pid, (int64_t)getpid());
    }
    r = dtr_comm_all_reduce(c, &ok, &ok, 1, DTR_F32, DTR_REDUCE_SUM);   /* ranks that could map it */
    if (c->rank == 0 && msg[2]) shm_unlink(name);   /* mapped by all who could: no file is left behind */
    if (r != DTR_OK || ok < (float)c->size - 0.5f) dtr__shm_free(c);
    else {
        c->shm->on = 1;
        c->shm->spins = dtr__shm_spins(c);
    }
    return r == DTR_OK && c->shm ? dtr__shm_cma_setup(c) : r;
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

/* the first peer whose process is gone, or -1; deep: a zombie counts too (that look reads
 * /proc/PID/stat, which costs the kernel tens of microseconds: every 100 ms only) */
static int dtr__shm_dead_peer(dtr_comm *c, int deep) {
    int j;
    for (j = 0; j < c->size; j++) {
        int64_t pid = DTR__ATOMIC_LOAD(&c->shm->h->r[j].pid);
        if (j != c->rank && (deep ? dtr__pid_dead(pid) : pid > 0 && kill((pid_t)pid, 0) != 0 && errno == ESRCH)) return j;
    }
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
    if ((dead = dtr__shm_dead_peer(c, now >= s->next_deep)) >= 0)
        return dtr__comm_fail(c, a, DTR_PEER_FAILED, c->ranks[dead], 0, "rank %d (pid %lld on this host) died",
                              c->ranks[dead], (long long)DTR__ATOMIC_LOAD(&s->h->r[dead].pid));
    r = DTR_OK;
    if (!s->sentinel && now - s->op_start > DTR__SHM_SENTINEL_NS) r = dtr__shm_post_sentinel(c, &e);
    if (r == DTR_OK && s->sentinel) r = c->ep->vt->test(c->ep->state, s->sentinel, &done, &e);
    if (r != DTR_OK || done)
        return dtr__comm_fail(c, a, r != DTR_OK ? r : DTR_PEER_FAILED, e.rank, e.native_code, "%s",
                              e.msg[0] ? e.msg : "the transport reported a failure");
    if (now >= s->next_deep) s->next_deep = now + 100000000;
    if (now > a->deadline)
        return dtr__comm_fail(c, a, DTR_TIMEOUT, c->ranks[waiting_for], 0,
                              "timed out after %d ms: rank %d did not reach the shared-memory step", a->timeout_ms,
                              c->ranks[waiting_for]);
    return DTR_OK;
}

/* Waits until the counters at `off` of every rank (or of `only`) reached epoch e: spins, then
 * yields the CPU for up to DTR__SHM_YIELD_NS (on a machine with more ranks than free cores the
 * peer runs then; a nap would cost the timer's slack, about 50 us), then naps. */
#define DTR__SHM_YIELD_NS 2000000
static dtr_result dtr__shm_wait(dtr_comm *c, const dtr__coll *a, int only, size_t off, uint64_t e) {
    dtr__shm *s = c->shm;
    int64_t naps = 0, t0 = 0;
    long spins = 0;
    int j;
    dtr_result r;
    while ((j = dtr__shm_behind(s, c->size, only, off, e)) >= 0) {
        if (++spins < s->spins) continue;
        if ((r = dtr__shm_check_fail(c, a, j)) != DTR_OK) {   /* tell the others whom to blame */
            int32_t none = -1, who = dtr_comm_failed_rank(c) >= 0 ? dtr_comm_failed_rank(c) : c->ep->info.rank;
            DTR__ATOMIC_CAS(&s->h->abort_rank, &none, who);
            /* threads: break the world as the local transport's own deadline does, so that the
               culprit too fails its next call, whatever the path */
            if (s->local) c->ep->vt->abort(c->ep->state, who, dtr_comm_last_error(c));
            return r;
        }
        if (!t0) t0 = dtr_time_ns();
        if (dtr_time_ns() - t0 < DTR__SHM_YIELD_NS) sched_yield();
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

/* out[0..n) = x[k + 1] + x[k + 2] + ... + x[k] (indices mod N): ring chunk k's order (an
 * average divides in the last step). out may be x[k + 1] or x[k + 2] only when N = 2. */
static void dtr__shm_fold_ring(char *out, const char *const *x, int N, int k, size_t n, const dtr__coll *a, int div) {
    int j;
    for (j = 2; j <= N; j++)
        dtr__comm_reduce(out, j == 2 ? x[(k + 1) % N] : out, x[(k + j) % N], n, a->dtype, a->op, j == N ? div : 1);
}

/* out[0..len) = elements [g, g + len) of the slots (slot j's first element is global index
 * g0) in ring order: chunk k starts at rank k + 1 and ends at rank k */
static void dtr__shm_ring(dtr_comm *c, const dtr__coll *a, char *out, size_t g0, size_t g, size_t len, int div) {
    size_t es = dtr_dtype_size(a->dtype);
    const char *x[64];
    int N = c->size, k, j;
    for (k = 0; k < N && len; k++) {
        size_t lo = dtr__shm_ring_start(a->count, N, k), hi = dtr__shm_ring_start(a->count, N, k + 1), b, e;
        b = g > lo ? g : lo, e = g + len < hi ? g + len : hi;
        if (b >= e) continue;
        for (j = 0; j < N; j++) x[j] = c->shm->slots + (size_t)j * c->shm->slot + (b - g0) * es;
        dtr__shm_fold_ring(out + (b - g) * es, x, N, k, e - b, a, div);
    }
}

/* out[0..len) from x[0..N) (N >= 2) in recursive doubling's order: pairs 2i, 2i+1 below 2m
 * fold first, then the p partial values combine at distances 1, 2, 4 ..., the lower first
 * (the tree that leads to partial 0); vector by vector, the partials in v (p * len elements).
 * Only the last step writes out, so out may be one of the x. */
static void dtr__shm_fold_rd(char *out, const char *const *x, int N, size_t len, const dtr__coll *a, int div, char *v) {
    size_t sl = len * dtr_dtype_size(a->dtype);
    const char *part[64];
    int p = 1, m, nr, d;
    while (p * 2 <= N) p *= 2;
    m = N - p;
    for (nr = 0; nr < p; nr++) {
        part[nr] = nr < m ? v + nr * sl : x[nr + m];
        if (nr < m) dtr__comm_reduce(v + nr * sl, x[2 * nr], x[2 * nr + 1], len, a->dtype, a->op, 1);
    }
    for (d = 1; d < p; d *= 2)
        for (nr = 0; nr < p; nr += 2 * d) {
            char *to = d * 2 >= p ? out : v + nr * sl;
            dtr__comm_reduce(to, part[nr], part[nr + d], len, a->dtype, a->op, d * 2 >= p ? div : 1);
            part[nr] = to;
        }
}

/* the same from the slots' elements [first, first + len), in the group's scratch */
static dtr_result dtr__shm_rd(dtr_comm *c, const dtr__coll *a, char *out, size_t first, size_t len, int div) {
    size_t es = dtr_dtype_size(a->dtype);
    const char *x[64];
    char *v = (char *)dtr__comm_scratch(c, (size_t)c->size * len * es + 1);
    int j;
    if (!v) return dtr__comm_fail(c, a, DTR_OUT_OF_MEMORY, -1, 0, "out of memory for %zu bytes", (size_t)c->size * len * es);
    for (j = 0; j < c->size; j++) x[j] = c->shm->slots + (size_t)j * c->shm->slot + first * es;
    dtr__shm_fold_rd(out, x, c->size, len, a, div, v);
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

/* ---- single copy: all-reduces larger than a slot ---- */

/* The bytes of one step of the single-copy reduction, per peer: its copies stay in cache. */
#define DTR__SHM_CMA_STEP ((size_t)128 << 10)

/* a peer's memory could not be read: the culprit a rank has already named comes first (a peer
   that saw another rank fail names it before it returns, and its process may be gone by now:
   the app may exit on the error); else the peer's failure when its process is gone (ESRCH says
   so even while it is an unreaped zombie, which /proc may not show yet), or a dead peer; else
   this rank's */
static dtr_result dtr__shm_cma_fail(dtr_comm *c, const dtr__coll *a, int j, int err) {
    int64_t pid = DTR__ATOMIC_LOAD(&c->shm->h->r[j].pid);
    int32_t none = -1, named = DTR__ATOMIC_LOAD(&c->shm->h->abort_rank);
    int dead = err == ESRCH || dtr__pid_dead(pid) ? j : dtr__shm_dead_peer(c, 1);
    int who = named >= 0 ? named : dead >= 0 ? c->ranks[dead] : c->ep->info.rank;
    dtr_result r = who == c->ranks[j]
                       ? dtr__comm_fail(c, a, DTR_PEER_FAILED, who, err, "reading rank %d's buffer (pid %lld): %s", c->ranks[j],
                                        (long long)pid, strerror(err))
                       : dtr__comm_fail(c, a, DTR_PEER_FAILED, who, err, "rank %d failed (then reading rank %d's buffer, "
                                        "pid %lld: %s)", who, c->ranks[j], (long long)pid, strerror(err));
    DTR__ATOMIC_CAS(&c->shm->h->abort_rank, &none, who);
    return r;
}

/* This rank's ring chunk [lo, hi): read from every peer's input in steps of DTR__SHM_CMA_STEP,
 * folded in the algorithm's order into dst, and written from there (still in cache) into every
 * peer's output. In place, the part of a peer's buffer written is the one just read: nobody
 * else reads it. */
static dtr_result dtr__shm_cma_reduce(dtr_comm *c, const dtr__coll *a, size_t lo, size_t hi, int div) {
    dtr__shm_counter *rc = c->shm->h->r;
    size_t es = dtr_dtype_size(a->dtype), step = DTR__SHM_CMA_STEP / es, sb = step * es, g, n;
    int N = c->size, me = c->rank, j, err;
    const char *x[64];
    char *buf = (char *)dtr__comm_scratch(c, (size_t)2 * N * sb);   /* N inputs, rd's partials */
    if (!buf) return dtr__comm_fail(c, a, DTR_OUT_OF_MEMORY, -1, 0, "out of memory for %zu bytes", (size_t)2 * N * sb);
    for (g = lo; g < hi; g += n) {
        n = hi - g < step ? hi - g : step;
        for (j = 0; j < N; j++) {
            x[j] = buf + (size_t)j * sb;
            if (j != me && (err = dtr__shm_xfer(rc[j].pid, buf + (size_t)j * sb, rc[j].src + g * es, n * es, 0)) != 0)
                return dtr__shm_cma_fail(c, a, j, err);
        }
        /* in place, the ring would overwrite this rank's input before its turn (N > 2) */
        if (a->src == a->dst && N > 2) memcpy(buf + (size_t)me * sb, (const char *)a->src + g * es, n * es);
        else x[me] = (const char *)a->src + g * es;
        if (a->algo == DTR_ALLREDUCE_RING) dtr__shm_fold_ring((char *)a->dst + g * es, x, N, me, n, a, div);
        else dtr__shm_fold_rd((char *)a->dst + g * es, x, N, n, a, div, buf + (size_t)N * sb);
        for (j = 0; j < N; j++)
            if (j != me && (err = dtr__shm_xfer(rc[j].pid, (char *)a->dst + g * es, rc[j].dst + g * es, n * es, 1)) != 0)
                return dtr__shm_cma_fail(c, a, j, err);
    }
    return DTR_OK;
}

/* Single copy: each rank publishes its buffers' addresses, reduces its ring chunk reading the
 * peers' inputs (process_vm_readv) and writes the result into their outputs (process_vm_writev);
 * it returns once every rank is done with the others' buffers (its output is then complete). */
static dtr_result dtr__shm_all_reduce_cma(dtr_comm *c, const dtr__coll *a) {
    dtr__shm *s = c->shm;
    dtr__shm_counter *me = &s->h->r[c->rank];
    uint64_t e = ++s->epoch;
    int div = a->op == DTR_REDUCE_AVG ? (a->avg_div ? a->avg_div : c->size) : 1;
    dtr_result r;
    me->src = (uint64_t)(uintptr_t)a->src, me->dst = (uint64_t)(uintptr_t)a->dst;
    DTR__ATOMIC_STORE(&me->in, e);
    if ((r = dtr__shm_wait(c, a, -1, DTR__SHM_IN, e)) != DTR_OK) return r;
    r = dtr__shm_cma_reduce(c, a, dtr__shm_ring_start(a->count, c->size, c->rank),
                            dtr__shm_ring_start(a->count, c->size, c->rank + 1), div);
    if (r != DTR_OK) return r;
    DTR__ATOMIC_STORE(&me->red, e);
    return dtr__shm_wait(c, a, -1, DTR__SHM_RED, e);
}

/* One step (all-reduces of at most DTR__SHM_SMALL bytes): each rank copies its input into its
 * small buffer of the epoch's parity and waits for every rank's; then every rank folds the
 * whole vector in the algorithm's order into its output. The buffers of parity e & 1 were last
 * read in epoch e - 2 or before, which every rank left before it published epoch e - 1. */
static dtr_result dtr__shm_all_reduce_small(dtr_comm *c, const dtr__coll *a) {
    dtr__shm *s = c->shm;
    size_t es = dtr_dtype_size(a->dtype), lo, hi;
    int div = a->op == DTR_REDUCE_AVG ? (a->avg_div ? a->avg_div : c->size) : 1, N = c->size, j, k;
    uint64_t e = ++s->epoch;
    const char *x[64];
    char *v = (char *)dtr__comm_scratch(c, (size_t)N * a->count * es + 1);
    dtr_result r;
    if (!v) return dtr__comm_fail(c, a, DTR_OUT_OF_MEMORY, -1, 0, "out of memory for %zu bytes", (size_t)N * a->count * es);
    memcpy(s->small + ((size_t)c->rank * 2 + (e & 1)) * DTR__SHM_SMALL, a->src, a->count * es);
    DTR__ATOMIC_STORE(&s->h->r[c->rank].in, e);
    if ((r = dtr__shm_wait(c, a, -1, DTR__SHM_IN, e)) != DTR_OK) return r;
    for (j = 0; j < N; j++) x[j] = s->small + ((size_t)j * 2 + (e & 1)) * DTR__SHM_SMALL;
    if (a->algo != DTR_ALLREDUCE_RING) {
        dtr__shm_fold_rd((char *)a->dst, x, N, a->count, a, div, v);
        return DTR_OK;
    }
    for (k = 0; k < N; k++) {   /* ring chunk k, from rank k + 1 to rank k */
        const char *y[64];
        lo = dtr__shm_ring_start(a->count, N, k), hi = dtr__shm_ring_start(a->count, N, k + 1);
        for (j = 0; j < N; j++) y[j] = x[j] + lo * es;
        if (hi > lo) dtr__shm_fold_ring((char *)a->dst + lo * es, y, N, k, hi - lo, a, div);
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

/* the collective through the segment (dtr__shm_run chose it) */
static dtr_result dtr__shm_op(dtr_comm *c, const dtr__coll *a) {
    size_t bytes = a->count * dtr_dtype_size(a->dtype);
    switch (a->kind) {
    case DTR__OP_ALL_REDUCE:
        return bytes <= DTR__SHM_SMALL ? dtr__shm_all_reduce_small(c, a)
               : bytes <= DTR__SHM_MAX_BYTES ? dtr__shm_all_reduce(c, a) : dtr__shm_all_reduce_cma(c, a);
    case DTR__OP_REDUCE_SCATTER: return dtr__shm_reduce_scatter(c, a);
    case DTR__OP_ALL_GATHER: return dtr__shm_gather(c, a, -1);
    case DTR__OP_BROADCAST: return dtr__shm_gather(c, a, a->root);
    default: return dtr__shm_barrier(c, a);
    }
}

int dtr__shm_run(dtr_comm *c, const dtr__coll *a, dtr_result *r) {
    dtr__shm *s = c->shm;
    if (!s || !s->on || a->kind > DTR__OP_BARRIER) return 0;   /* collectives only */
    if (a->kind != DTR__OP_BARRIER && a->count * dtr_dtype_size(a->dtype) > DTR__SHM_MAX_BYTES &&
        (a->kind != DTR__OP_ALL_REDUCE || !s->cma))
        return 0;   /* large payloads without single copy: the provider's own moves them faster */
    s->op_start = dtr_time_ns();
    *r = dtr__shm_op(c, a);
    if (s->sentinel) {   /* the wait was long: the transport's provider thread may rest again */
        c->ep->vt->release(c->ep->state, s->sentinel);
        s->sentinel = NULL;
    }
    return 1;
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
