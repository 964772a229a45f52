/* ============================================================================
 * Process-group internals shared by the sources in src/comm/, src/engine/data_parallel.c and the
 * transports of dtrain_comm.c (which see them through DTRAIN_INTERNAL_API).
 * ==========================================================================*/
#include <pthread.h>
#include <time.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- time and condition variables with deadlines ---- */

/** Initialises a condition variable whose timed waits run on the monotonic clock where the
 *  platform allows it (CLOCK_MONOTONIC; elsewhere waits are cut into short slices of the
 *  real-time clock so that clock jumps cannot stretch a deadline much). */
int dtr__cond_init(pthread_cond_t *cv);
/** Waits on cv (mu held) until signalled or deadline_ns (dtr_time_ns) passes.
 *  deadline_ns < 0: no deadline. Returns 1 when the deadline has passed. */
int dtr__cond_wait_until(pthread_cond_t *cv, pthread_mutex_t *mu, int64_t deadline_ns);

/* ---- tags ----
 * 64-bit transport tags: bits 63..48 the group's context id, bit 47 set for user
 * point-to-point messages (bits 30..0: the user tag), clear for collectives (bits 46..24:
 * the collective's sequence number modulo 2^23, bits 23..0: the message's step inside it).
 * Every message of a collective has its own (source, destination, tag). */
#define DTR__TAG_CTX_SHIFT 48
#define DTR__TAG_P2P ((uint64_t)1 << 47)
#define DTR__MAX_CTX 0xffffu
static inline uint64_t dtr__tag_coll(uint32_t ctx, uint32_t seq, uint32_t step) {
    return ((uint64_t)ctx << DTR__TAG_CTX_SHIFT) | ((uint64_t)(seq & 0x7fffffu) << 24) | (uint64_t)(step & 0xffffffu);
}
static inline uint64_t dtr__tag_p2p(uint32_t ctx, int tag) {
    return ((uint64_t)ctx << DTR__TAG_CTX_SHIFT) | DTR__TAG_P2P | (uint64_t)(uint32_t)tag;
}

/* ---- endpoints, groups, requests ---- */

/** One rank's transport instance, shared (reference counted) by a group and its sub-groups. */
typedef struct dtr__endpoint {
    const dtr_transport_vtable *vt;
    void *state;
    dtr_transport_info info;
    dtr_allocation_callbacks alloc;
    pthread_mutex_t mu;      /* refs, next_ctx */
    int refs;
    uint32_t next_ctx;       /* lowest context id no group of this rank uses (see dtr_comm_split) */
    int isolate;             /* cfg.isolate_peer_failures on a transport with peer_alive */
} dtr__endpoint;

/** The flight recorder of a group (src/comm/flight.c). */
#define DTR__FLIGHT_DEFAULT 64   /* records kept when the config says 0 */
#define DTR__FLIGHT_LOGGED 16    /* records the log callback gets on failure */
typedef struct dtr__flight {
    pthread_mutex_t mu;
    dtr_flight_record *ring;   /* cap records; id k lives at (k - 1) % cap */
    int cap, inited, dumped;
    uint64_t next_id;          /* the last id handed out */
    char dir[256];             /* where the failure dump goes ("": nowhere) */
} dtr__flight;

/** Kinds of operations of a group. */
enum {
    DTR__OP_ALL_REDUCE = 0, DTR__OP_BROADCAST, DTR__OP_REDUCE_SCATTER, DTR__OP_ALL_GATHER,
    DTR__OP_BARRIER, DTR__OP_SEND, DTR__OP_RECV, DTR__OP_SPLIT, DTR__OP_COUNT
};

/** Arguments of one operation (a collective or a point-to-point transfer). */
typedef struct dtr__coll {
    int kind;
    const void *src;
    void *dst;
    size_t count;          /* elements (bytes for send/recv) */
    dtr_dtype dtype;
    dtr_reduce_op op;
    int root;              /* broadcast root; send/recv peer (group ranks) */
    int tag;               /* send/recv user tag */
    int algo;              /* all-reduce: the algorithm chosen at the call */
    int avg_div;           /* DTR_REDUCE_AVG divides by this (0: the group's size) */
    uint32_t seq;          /* sequence number of the collective in its group */
    int timeout_ms;        /* the group's deadline setting when it was called */
    int64_t deadline;      /* dtr_time_ns */
} dtr__coll;

enum { DTR__REQ_QUEUED = 0, DTR__REQ_RUNNING = 1, DTR__REQ_DONE = 2 };

/** A block of a group that stages buffers (src/comm/stage.c): page-locked host memory for
 *  device buffers over a host transport, device memory for host buffers over a device one. */
typedef struct dtr__stage_blk {
    struct dtr__stage_blk *next;
    void *p;
    size_t bytes;
} dtr__stage_blk;

/** What one operation staged: the block its images live in, and the caller's destination
 *  filled from it once the operation completed (NULL: none). */
typedef struct dtr__staged {
    dtr__stage_blk *blk;
    void *user_dst;        /* the caller's destination, of the kind the transport does not take */
    const void *img_dst;   /* its image in blk */
    size_t dst_bytes;
} dtr__staged;

struct dtr_request {
    dtr_comm *comm;
    dtr__coll a;
    int state;             /* DTR__REQ_*, under comm->mu */
    dtr_result result;
    void *treq;            /* send/recv: the transport's request */
    uint64_t flight_id;    /* send/recv: its flight record */
    dtr__staged st;        /* device buffers staged through host memory (stage.c) */
    struct dtr_request *next;
};

struct dtr_comm {
    dtr__endpoint *ep;
    int rank, size;            /* in this group */
    int local_rank, local_size;
    int *ranks;                /* group rank -> transport rank */
    uint32_t ctx;              /* context id (tags) */
    uint32_t seq;              /* next collective's sequence number */
    void *native_group;        /* the transport's group handle when it has native collectives */
    struct dtr_comm *host;     /* hierarchical all-reduce: this rank's host, and the hosts'
                                  first ranks (NULL on the others); run only by this group */
    struct dtr_comm *leaders;
    struct dtr__shm *shm;      /* the group's shared-memory segment (src/comm/shm.c), or NULL */
    int hier_ready;            /* host and leaders were made */
    int hier_on;               /* and hierarchical differs from flat (several hosts, one of
                                  several ranks, host memory): the same on every rank */
    dtr_context *mem_ctx;      /* buffers in this context's backend memory (cfg.memory device); NULL: host */
    dtr_context *stage_ctx;    /* buffers of the kind the transport does not take are staged through
                                  this context's backend (stage.c); NULL: none */
    int stage_to_dev;          /* 1: host buffers to device images (a device transport); 0: device
                                  buffers to host images (cfg.memory device over a host transport) */
    dtr__stage_blk *stage_free;  /* its blocks not in use (under mu) */
    /* configuration */
    int timeout_ms;
    int algo;                  /* dtr_allreduce_algo */
    size_t ring_threshold, chain_threshold, segment;
    int no_native;
    int shm_wanted;            /* cfg.shared_memory; $DTR_COMM_SHM=0/1/2 overrides (sub-groups inherit it) */
    dtr_log_fn log;
    void *log_user;
    dtr_log_level log_level;
    /* errors: status and message are written under mu; status is sticky once it is a
       communication failure */
    dtr_result status;
    int failed_rank, native_code;
    char msg[512];
    /* the progress thread and its queue (under mu) */
    pthread_mutex_t mu;
    pthread_cond_t work_cv;    /* the thread waits for work */
    pthread_cond_t done_cv;    /* callers wait for requests */
    pthread_t thread;
    int thread_on, stop;
    int inline_running;        /* a blocking collective runs on the caller's thread */
    dtr_request *head, *tail;  /* queued collectives, oldest first */
    dtr_request *running;
    dtr_request *free_reqs;
    int live_reqs;             /* requests handed out and not yet freed */
    dtr__flight flight;        /* the last operations (src/comm/flight.c) */
    /* scratch of the algorithms, in the buffers' memory: used by one operation at a time (queue rule) */
    void *scratch;
    size_t scratch_cap;
};

/* ---- shared helpers ---- */

/** $DTR_RANKS_PER_HOST: fake hosts of that many consecutive ranks (tests of hierarchical
 *  collectives on one machine); 0 when unset or not a positive number. */
static inline int dtr__fake_ranks_per_host(void) {
    const char *v = getenv("DTR_RANKS_PER_HOST");
    int k = v ? atoi(v) : 0;
    return k > 0 ? k : 0;
}
/* dtr__pid_dead (is a process of this host gone?) is declared in src/core/internal.h. */

/* ---- the flight recorder (src/comm/flight.c) ---- */
/** Makes c's ring of `cap` records (0: the default; < 0: off) and takes the dump folder
 *  (NULL or "": $DTR_FLIGHT_DIR). */
DTR__PRIVATE dtr_result dtr__flight_init(dtr_comm *c, int cap, const char *dir);
DTR__PRIVATE void dtr__flight_free(dtr_comm *c);
/** Records the start of operation a; returns its id (0: recorder off). */
DTR__PRIVATE uint64_t dtr__flight_begin(dtr_comm *c, const dtr__coll *a);
/** Records the end of operation id with result r. */
DTR__PRIVATE void dtr__flight_end(dtr_comm *c, uint64_t id, dtr_result r);
/** The group's first communication failure: the running records fail with code; the first
 *  call logs the ring and writes the dump file. */
DTR__PRIVATE void dtr__flight_failure(dtr_comm *c, dtr_result code);

/* ---- shared-memory collectives (src/comm/shm.c) ---- */
typedef struct dtr__shm dtr__shm;
/** Collective over c at its creation: maps one segment shared by the group's ranks when
 *  they are processes of one host (else nothing). An error only when the group failed. */
DTR__PRIVATE dtr_result dtr__shm_setup(dtr_comm *c);
/** The local transport's shared blocks (src/transport/local.c): the block of `bytes` the ranks
 *  of the endpoint's world share under `key`, made zeroed and passed to init by the first rank
 *  that asks (under the world's lock); NULL for every rank when it could not be made.
 *  Each get is matched by a put; the last put frees it. */
DTR__PRIVATE void *dtr__local_shared_get(void *ep_state, uint64_t key, size_t bytes, void (*init)(void *p, void *arg),
                                         void *arg);
DTR__PRIVATE void dtr__local_shared_put(void *ep_state, uint64_t key);
/** Unmaps the group's segment. */
DTR__PRIVATE void dtr__shm_free(dtr_comm *c);
/** Runs collective a through the segment when the group has one (1; result in *r), else 0. */
DTR__PRIVATE int dtr__shm_run(dtr_comm *c, const dtr__coll *a, dtr_result *r);

/** The all-reduce algorithm AUTO picks for `count` elements of `dt` on group c. */
DTR__PRIVATE int dtr__auto_algo(const dtr_comm *c, size_t count, dtr_dtype dt);

/** Records an error on the group (first communication failure is sticky), logs it, and for
 *  DTR_TIMEOUT / DTR_PEER_FAILED aborts the transport so every rank learns of it.
 *  `peer` is the transport rank at fault (-1 unknown). Returns code. */
DTR__PRIVATE dtr_result dtr__comm_fail(dtr_comm *c, const dtr__coll *a, dtr_result code, int peer, int native_code,
                          const char *fmt, ...) DTR__PRINTF(6, 7);
/** "all_reduce", "broadcast", ... */
DTR__PRIVATE const char *dtr__coll_name(int kind);
/** Scratch of at least `bytes` (grows, kept) in the memory of the group's buffers (the
 *  backend's for a group of device memory); NULL on OOM. */
DTR__PRIVATE void *dtr__comm_scratch(dtr_comm *c, size_t bytes);
/** Runs one collective on the calling thread, blocking until done or its deadline. */
DTR__PRIVATE dtr_result dtr__coll_run(dtr_comm *c, const dtr__coll *a);
/** This rank cannot do its part of collective a (error r, not a communication failure): the
 *  others would wait for it until their deadline, so the group breaks now (status
 *  DTR_PEER_FAILED naming this rank, the transport aborted). Returns r. */
DTR__PRIVATE dtr_result dtr__coll_cannot(dtr_comm *c, const dtr__coll *a, dtr_result r);
/** Sums n doubles over group c in place: an all-gather of the bytes, added in rank order (the
 *  same bits on every rank). Errors go to ctx's message, prefixed with `who`. */
DTR__PRIVATE dtr_result dtr__comm_sum_doubles(dtr_comm *c, dtr_context *ctx, double *vals, int n, const char *who);
/** out[i] = a[i] op b[i] for n elements of dt (f32 math; bf16/f16 rounded once), then
 *  divided by `div` when div > 1 (DTR_REDUCE_AVG's last step). out may alias a or b. */
DTR__PRIVATE void dtr__comm_reduce(void *out, const void *a, const void *b, size_t n, dtr_dtype dt, dtr_reduce_op op, int div);
/** dtr__comm_reduce on the memory of the group's buffers: host, or the backend of cfg.context
 *  for device memory. Records a failure on the group. */
DTR__PRIVATE dtr_result dtr__coll_reduce(dtr_comm *c, void *out, const void *x, const void *y, size_t n, const dtr__coll *a, int div);
/** Waits until all n transport requests are complete; releases all of them in every case.
 *  On failure records the error on the group (naming the operation) and returns it. */
DTR__PRIVATE dtr_result dtr__comm_waitall(dtr_comm *c, const dtr__coll *a, void **reqs, int n);
/** Posts a send (to >= 0) and a receive (from >= 0) of group ranks with the tag of step
 *  `step` of collective `a`, and waits for both. Either side may be skipped with -1. */
DTR__PRIVATE dtr_result dtr__comm_sendrecv(dtr_comm *c, const dtr__coll *a, const void *sbuf, size_t sbytes, int to, void *rbuf,
                              size_t rbytes, int from, uint32_t step);

/* ---- buffers of the other memory kind (src/comm/stage.c) ---- */
/** 1 when c's operations take host buffers: a host transport, or a device transport whose
 *  group stages them to its device (0: a device transport without staging). */
static inline int dtr__comm_takes_host(const dtr_comm *c) { return !c->mem_ctx || c->stage_to_dev; }
/** Operation a of group c is prepared: when c stages, its buffers of the kind the transport
 *  does not take get images in a block of the other kind (the input copied there, ordered
 *  after the work queued on the context's stream) and a's pointers move onto the block; s
 *  says what to copy back. Nothing to do: s empty, DTR_OK. A failed copy or allocation is recorded on the
 *  group; the caller has not started the operation. */
DTR__PRIVATE dtr_result dtr__stage_in(dtr_comm *c, dtr__coll *a, dtr__staged *s);
/** The operation of s ended with r: when r is DTR_OK its result goes back to the device
 *  destination; the block returns to the group. Returns r, or the copy's failure. Empty s:
 *  returns r. */
DTR__PRIVATE dtr_result dtr__stage_out(dtr_comm *c, const dtr__coll *a, dtr__staged *s, dtr_result r);
/** Frees the group's cached blocks (dtr_comm_destroy). */
DTR__PRIVATE void dtr__stage_free_all(dtr_comm *c);

/* ---- the bootstrap of process transports (src/comm/bootstrap.c, in dtrain_comm.c) ---- */

/** What a transport whose ranks are processes learns through the rendezvous store. */
typedef struct dtr__boot {
    const char *transport;     /* its name, for messages */
    dtr_store *st;             /* its own store connection (dtr__store_clone) */
    dtr_store *app_store;      /* made from the environment when cfg->store was NULL */
    dtr_store *app;            /* the store the group was made from (cfg->store or app_store) */
    int failed;                /* set by the transport before close when the group failed */
    int rank, size, local_rank, local_size;
    int *on_host, *pids;       /* per rank: on this host (same kernel and pid namespace), pid */
    char ns[48];               /* this open's namespace in the store: "<prefix>/<n>" */
    int waiting_for;           /* the rank the last fetch waited for (-1: none) */
    int timeout_ms;            /* the group's deadline */
    dtr_allocation_callbacks alloc;
} dtr__boot;

/** Opens the bootstrap of `transport`: the store (cfg->store, else from the environment), its
 *  own connection, the namespace "<prefix>/<n>" of this rank's n-th open, every rank's host
 *  and pid. On failure `b` holds what to release with dtr__boot_close. */
dtr_result dtr__boot_open(dtr__boot *b, const dtr_comm_config *cfg, const char *transport, const char *prefix, char *err,
                          size_t errlen);
void dtr__boot_close(dtr__boot *b);
/** "<ns>/<what>/<rank>" (rank < 0: "<ns>/<what>"). */
void dtr__boot_key(const dtr__boot *b, char *key, size_t cap, const char *what, int rank);
/** Sets "<ns>/<what>/<my rank>" / gets "<ns>/<what>/<rank>" (blocking until it is there). */
dtr_result dtr__boot_publish(dtr__boot *b, const char *what, const void *data, size_t len);
dtr_result dtr__boot_fetch(dtr__boot *b, const char *what, int rank, void *buf, size_t cap, size_t *len);
/** The message of a failed store call during open: names the rank a timed-out fetch waited
 *  for. Returns r. */
dtr_result dtr__boot_fail(const dtr__boot *b, dtr_result r, const char *what, char *err, size_t errlen);

/* ---- the watchdog of process transports (src/comm/watchdog.c, in dtrain_comm.c) ---- */

/** What the watchdog asks of its transport (t: the transport's state). */
typedef struct dtr__watch_ops {
    void *t;
    /** 1 when the world is broken already (read without the transport's lock: a hint). */
    int (*failed)(void *t);
    /** 1 when the transport failed on its own and the world must hear of it: fills who (the
     *  rank at fault) and why. */
    int (*to_publish)(void *t, int *who, char *why, size_t cap);
    /** Break the world naming `rank` (publish 1: the transport's own failure to tell). */
    void (*fail)(void *t, int rank, const char *why, int publish);
    /** `rank` closed its end cleanly: requests still waiting for it fail. */
    void (*left)(void *t, int rank);
    /** NULL, or (peer failures isolated): `rank` died; only its requests fail, the world goes on. */
    void (*died)(void *t, int rank, const char *how);
    /** NULL, or called every tick while the world is whole: the transport's own health (a
     *  worker thread that has not come back from its library for stale_ns fails the
     *  transport; to_publish then tells the world). */
    void (*check)(void *t, int64_t stale_ns);
} dtr__watch_ops;

/** A watchdog thread over a bootstrap (see the file's comment for what it watches). */
typedef struct dtr__watchdog {
    dtr__boot *boot;
    dtr__watch_ops ops;
    int *gone;                 /* per rank: left cleanly, no longer watched */
    int64_t *beat, *beat_ns;   /* last heartbeat value of each peer, and when it changed (under mu) */
    int64_t *seen_ns;          /* when each peer's heartbeat was last read (under mu) */
    int64_t stale_ns;          /* a remote heartbeat older than this is a failure */
    int next_remote;           /* the peer whose heartbeat is read next (large worlds: one per round) */
    int published;             /* the world's abort key holds a failure (ours or read); atomic: the
                                  watchdog thread and a waiting thread (dtr__watchdog_culprit) set it */
    int heard;                 /* the abort key was read and handed to the transport (atomic) */
    int won;                   /* this rank's failure is the one the abort key holds (atomic) */
    int64_t ok_ns;             /* when the store last answered a whole round (under mu) */
    int64_t tick_ns;           /* the thread's last wake-up (under mu): old when this process was stopped */
    int in_store;              /* the thread is in a store call (which may wait for a silent store); atomic */
    pthread_t thread;
    int inited, on, stop;
    pthread_mutex_t mu;
    pthread_cond_t cv;
} dtr__watchdog;

/** Starts the thread (and cuts the store's deadlines to 10 s). On failure
 *  dtr__watchdog_free still releases what was made. */
dtr_result dtr__watchdog_start(dtr__watchdog *w, dtr__boot *b, const dtr__watch_ops *ops);
/** Wakes the thread at once (the transport just failed: publish now). */
void dtr__watchdog_wake(dtr__watchdog *w);
/** Joins the thread, publishes a failure it had no time to, and marks this rank as left. */
void dtr__watchdog_stop(dtr__watchdog *w);
void dtr__watchdog_free(dtr__watchdog *w);
/** Writes the world's abort key ("<who> <why>") unless another rank's failure is there
 *  first (the first told wins, so every rank reads the same culprit). */
dtr_result dtr__watchdog_publish(dtr__watchdog *w, int who, const char *why);
/** A deadline passed while this rank waited for `suspect`: the rank to blame, the same on
 *  every rank: the one the abort key names, else the lowest rank whose heartbeat stopped
 *  (rank 0 when the store it hosts is silent), else suspect; published first-told-wins.
 *  Fills why. Blocks at most for a store call. */
int dtr__watchdog_culprit(dtr__watchdog *w, int suspect, char *why, size_t cap);

/* ---- rendezvous helpers for transports ---- */

/** A second client connection to the store `st` joined (same rank, world, secret; never a
 *  server), with its own lock and deadline timeout_ms (<= 0: st's). Transports use it for
 *  their address exchange and watchdog so they neither queue behind the application's store
 *  calls nor depend on the application keeping its store. Free with dtr_store_destroy. */
dtr_result dtr__store_clone(const dtr_store *st, int timeout_ms, dtr_store **out, char *err, size_t errlen);
/** Changes the deadline of every later call on st (timeout_ms > 0). */
void dtr__store_set_timeout(dtr_store *st, int timeout_ms);
/** Teardown after a failure: every call on st, the one in progress on another thread
 *  included, ends within st's grace_ms from now (DTR_TIMEOUT), and st is marked failed. A
 *  store host that is stopped or hung would otherwise make each call of the teardown wait
 *  its whole deadline. Thread safety: any thread. */
void dtr__store_cut(dtr_store *st);
/** The default deadline of every blocking call: $DTR_TIMEOUT_MS when it is a positive decimal
 *  number, else 300000 (src/rendezvous/env.c). */
int dtr__default_timeout_ms(void);
/** The default teardown grace after a failure: $DTR_GRACE_MS, else 2000. */
DTR__PRIVATE int dtr__default_grace_ms(void);

#ifdef __cplusplus
}
#endif
