/* ============================================================================
 * Public API: process groups (dtr_comm), transports, collectives (engines: api_engine.h)
 *
 * A process group is a set of ranks 0..size-1 that run the same program and meet in
 * collective calls. Ranks are threads of one process (the `local` transport, built in) or
 * processes on one or many machines (libfabric, in dtrain_comm.c). The same code runs on
 * both; only dtr_comm_config changes. docs/distributed.md is the guide.
 *
 * Rules shared by every call of this section:
 *   - Collectives are called by every rank of the group, in the same order, with the same
 *     count, dtype, op and root. Each has a deadline (dtr_comm_config.timeout_ms, default
 *     $DTR_TIMEOUT_MS, else five minutes): a peer that dies, hangs or leaves turns into DTR_PEER_FAILED or
 *     DTR_TIMEOUT on every surviving rank, naming the rank at fault and the operation
 *     (dtr_comm_last_error, dtr_comm_failed_rank), never into a hang.
 *   - Such a failure breaks the group and every group sharing its transport (sub-groups,
 *     parent): later calls return the same error at once. Destroy the groups (and restart
 *     from a checkpoint with whoever is left).
 *   - Results are deterministic: for a given world size, count, dtype and algorithm a
 *     reduction adds in a fixed order, so two runs give the same bits, and every rank gets
 *     the same bits (docs/distributed.md gives the exact order of each algorithm).
 *   - Buffers are host memory, or with cfg.memory DTR_MEM_DEVICE device memory of
 *     cfg.context: NCCL takes it natively; libfabric and local stage it through page-locked
 *     host memory (the input copied before the call, the result back when the caller learns
 *     that it completed), and still take host buffers. A group is used by one thread at a time; different groups
 *     (and the ranks of a local world) may be used from different threads at once.
 * ==========================================================================*/
#ifdef __cplusplus
extern "C" {
#endif

/* ---- clock ---- */

/** Nanoseconds of the monotonic clock that every deadline of this section is measured on.
 *  Thread safe. */
DTR_API int64_t dtr_time_ns(void);

/* ---- reductions and algorithms ---- */

/** Reduction operators. bf16 and f16 are reduced in f32 and rounded back to their type once
 *  per step of the algorithm (so a world of N ranks rounds at most N-1 times, as NCCL does).
 *  DTR_REDUCE_AVG is the sum, then one division by the group size (in f32) at the rank that
 *  finishes the sum. DTR_REDUCE_MAX propagates NaN. Append-only. */
typedef enum dtr_reduce_op {
    DTR_REDUCE_SUM = 0,
    DTR_REDUCE_AVG = 1,
    DTR_REDUCE_MAX = 2
} dtr_reduce_op;

/** All-reduce algorithms. AUTO picks ring for messages of at least
 *  dtr_comm_config.ring_threshold_bytes (and at least one element per rank) and recursive
 *  doubling below. Append-only. */
typedef enum dtr_allreduce_algo {
    DTR_ALLREDUCE_AUTO = 0,
    DTR_ALLREDUCE_RING = 1,               /**< reduce-scatter + all-gather around a ring: 2(N-1) steps, bandwidth-optimal */
    DTR_ALLREDUCE_RECURSIVE_DOUBLING = 2, /**< ceil(log2 N) full exchanges (+2 for the fold of a non-power-of-two N) */
    DTR_ALLREDUCE_HIERARCHICAL = 3        /**< sum inside each host, all-reduce between the hosts' leaders,
                                               broadcast inside each host (dtr_comm_set_allreduce_algo) */
} dtr_allreduce_algo;

/** Name of an operator ("sum", "avg", "max") or algorithm ("auto", "ring", "recursive_doubling").
 *  Thread safety: thread safe. */
DTR_API const char *dtr_reduce_op_name(dtr_reduce_op op);
DTR_API const char *dtr_allreduce_algo_name(dtr_allreduce_algo algo);

/* ---- local worlds (the `local` transport) ---- */

/** The shared state of a group whose ranks are threads of this process. Create it once, hand
 *  it to every rank thread (dtr_comm_config.local_world with that thread's rank), and
 *  destroy it once every rank has opened its endpoint (dtr_comm_create returned) or is
 *  done: each open endpoint holds a reference, so it lives until its last rank has closed. Messages are matched like MPI's (FIFO per source and tag) and copied
 *  once, straight from the sender's buffer into the receiver's; a rank that closes or aborts
 *  makes its peers' pending and later operations fail with DTR_PEER_FAILED naming it. */
typedef struct dtr_local_world dtr_local_world;

/** Creates a local world of `size` ranks (1 to 4096).
 *  @param alloc  allocation callbacks (NULL: libc).
 *  @return DTR_OK, DTR_NULL_HANDLE, DTR_INVALID_ARGUMENT (size), DTR_OUT_OF_MEMORY.
 *  Thread safety: thread safe. */
DTR_API dtr_result dtr_local_world_create(int size, const dtr_allocation_callbacks *alloc, dtr_local_world **out);
/** Drops the creator's reference; the memory goes when the last rank has closed too. NULL
 *  is ignored. Thread safety: thread safe; call once. */
DTR_API void dtr_local_world_destroy(dtr_local_world *w);
/** Number of ranks of the world (0 for NULL). Thread safe. */
DTR_API int dtr_local_world_size(const dtr_local_world *w);

/* ---- transports ---- */

typedef struct dtr_comm dtr_comm;
typedef struct dtr_comm_config dtr_comm_config;

/** What a transport instance (one rank's endpoint) reports when it opens. */
typedef struct dtr_transport_info {
    int rank, size;              /**< this endpoint's rank among `size` (the world of the transport) */
    int local_rank, local_size;  /**< rank among the ranks on this machine, and their number */
    char detail[64];             /**< what the transport chose, for messages: libfabric's provider
                                      ("shm", "tcp;ofi_rxm", ...); "" when it has nothing to say */
} dtr_transport_info;

/** Error details a transport fills when a call fails because of a peer or the network. */
typedef struct dtr_transport_error {
    int rank;           /**< the transport rank at fault, or -1 */
    int native_code;    /**< the transport's own code (e.g. a negative libfabric errno), 0 if none */
    char msg[232];      /**< what happened, without the operation (dtr_comm adds it) */
} dtr_transport_error;

/** The transport vtable, in the manner of miniaudio's backends. A transport moves bytes
 *  between the ranks of a world with non-blocking, tagged point-to-point messages; dtr_comm
 *  builds every collective on them unless the transport has a native one. All functions get
 *  the `state` made by open. Requests (`void *req`) are the transport's own handles.
 *
 *  Contract of the point-to-point functions:
 *   - Messages match on (source, tag) exactly, in the order they were posted (non-overtaking
 *     per source and tag). dtr_comm never has two messages in flight with the same (source,
 *     destination, tag), so a transport whose hardware does not order messages still works.
 *     Tags are 64-bit: the upper bits hold the group's context id (see docs/distributed.md).
 *   - A receive buffer may be longer than the message; a longer message fails the receive
 *     with DTR_INVALID_ARGUMENT. Zero-byte messages are allowed (buf may be NULL).
 *   - The buffer of a pending request is the transport's until the request is complete or
 *     released; release of a pending request cancels it, and after release returns the
 *     buffer is no longer touched.
 *   - isend, irecv, test and wait_any may be called by several threads of the same rank at
 *     once (a group's progress thread and the application) on different requests.
 *   - Peer failure: a request whose peer died, left or aborted completes with
 *     DTR_PEER_FAILED; wait_any returns DTR_TIMEOUT at the deadline; both fill `err` with the
 *     rank at fault. A transport may report a rank other than the direct peer when it knows
 *     better (the local transport follows who waits for whom to the rank that stopped).
 *   - abort(failed_rank, why) breaks the whole world: every pending and later operation on
 *     every rank fails with DTR_PEER_FAILED naming failed_rank. dtr_comm calls it when an
 *     operation failed, so that the other ranks learn about the failure at once.
 *  Optional native collectives take a group handle made by group_create for a set of
 *  transport ranks (NULL hooks: dtr_comm builds the collective over point-to-point); NCCL
 *  would fill them. They block until done or the deadline, with the semantics of the
 *  dtr_comm functions of the same name.
 *  Version: abi_version must be DTR_VERSION_NUMBER of the dtrain.h the transport was built
 *  with; fields are only ever appended. */
typedef struct dtr_transport_vtable {
    int abi_version;
    const char *name;   /**< registry key: "local", "libfabric", ... */
    /* lifetime (required). open reads the fields of cfg that concern it (its nested settings:
       cfg->local, cfg->fabric, ...; store, timeout_ms, alloc, transport_user) and fills info. */
    dtr_result (*open)(const dtr_comm_config *cfg, void **state, dtr_transport_info *info, char *err, size_t errlen);
    void (*close)(void *state);
    /* point-to-point (required). dst/src are transport ranks. */
    dtr_result (*isend)(void *state, const void *buf, size_t bytes, int dst, uint64_t tag, void **req,
                        dtr_transport_error *err);
    dtr_result (*irecv)(void *state, void *buf, size_t bytes, int src, uint64_t tag, void **req,
                        dtr_transport_error *err);
    /** *done = 1 once complete; returns the request's result (DTR_OK while pending). */
    dtr_result (*test)(void *state, void *req, int *done, dtr_transport_error *err);
    /** Blocks until at least one of reqs[0..n) is complete (DTR_OK; it may also return
     *  early), the deadline (dtr_time_ns) passes (DTR_TIMEOUT) or the world failed
     *  (DTR_PEER_FAILED). Must not spin a core while nothing happens. */
    dtr_result (*wait_any)(void *state, void *const *reqs, int n, int64_t deadline_ns, dtr_transport_error *err);
    /** Frees a complete request, or cancels a pending one. */
    void (*release)(void *state, void *req);
    /* failure (required) */
    void (*abort)(void *state, int failed_rank, const char *why);
    /* optional */
    dtr_result (*progress)(void *state);   /**< drives the transport when dtr_request_test polls */
    dtr_result (*group_create)(void *state, const int *ranks, int n, uint32_t context_id, void **group);
    void (*group_destroy)(void *state, void *group);
    dtr_result (*all_reduce)(void *state, void *group, const void *src, void *dst, size_t count, dtr_dtype dt,
                             dtr_reduce_op op, int64_t deadline_ns, dtr_transport_error *err);
    dtr_result (*broadcast)(void *state, void *group, void *buf, size_t count, dtr_dtype dt, int root,
                            int64_t deadline_ns, dtr_transport_error *err);
    dtr_result (*reduce_scatter)(void *state, void *group, const void *src, void *dst, size_t count, dtr_dtype dt,
                                 dtr_reduce_op op, int64_t deadline_ns, dtr_transport_error *err);
    dtr_result (*all_gather)(void *state, void *group, const void *src, void *dst, size_t count, dtr_dtype dt,
                             int64_t deadline_ns, dtr_transport_error *err);
    dtr_result (*barrier)(void *state, void *group, int64_t deadline_ns, dtr_transport_error *err);
    /* memory: the dtr_mem_kind bits of the buffers the transport's functions take (0 means
       DTR_MEM_HOST only). A transport taking DTR_MEM_DEVICE orders its transfers after the
       work queued on cfg->context's stream (the backend's event_record) and completes them
       before reporting a request complete. */
    unsigned mem_kinds;
    /** Optional (cfg->isolate_peer_failures): 0 once the transport knows `rank` died or left
     *  while the world goes on, 1 otherwise (also after abort: the world failed). A transport
     *  that has it fails only the requests with a dead peer when the config asks for
     *  isolation, and dtr_comm keeps the group working. */
    int (*peer_alive)(void *state, int rank);
    /** Optional: wait_any without the deadline's failure. Blocks until at least one of
     *  reqs[0..n) is complete, until_ns passes or the world failed; returns DTR_OK in the
     *  first two cases (it may also return early) and DTR_PEER_FAILED in the last. Must not
     *  spin a core while nothing happens. dtr_request_wait_any uses it (without it: naps). */
    dtr_result (*wait_some)(void *state, void *const *reqs, int n, int64_t until_ns);
} dtr_transport_vtable;

/** The built-in `local` transport (ranks are threads; see dtr_local_world). Thread safe. */
DTR_API const dtr_transport_vtable *dtr_local_transport(void);

/** The libfabric transport (defined in dtrain_comm.c; NULL when that unit was built without
 *  DTR_USE_LIBFABRIC). When the unit is linked in, dtr_transport_find("libfabric") finds it
 *  without registration (GCC and Clang on ELF platforms; elsewhere pass it to
 *  dtr_transport_register). One process per rank: open takes rank and size from
 *  cfg->store (NULL: a store made from the environment, as dtrun sets it), exchanges
 *  endpoint addresses through it, and uses cfg->fabric.provider, else $DTR_FABRIC_PROVIDER,
 *  else shm on one host and the best remote provider across hosts (cfg->fabric has the other
 *  settings). docs/distributed.md has the
 *  details, the environment variables and how failures are detected.
 *  Thread safety: thread safe. */
DTR_API const dtr_transport_vtable *dtr_fabric_transport(void);

/** The NCCL transport (defined in dtrain_comm.c when it was built with nccl.h: DTR_USE_NCCL;
 *  NULL otherwise), found by dtr_transport_find("nccl") like libfabric. One process per GPU:
 *  open takes rank and size from cfg->store (as libfabric), passes rank 0's ncclUniqueId
 *  through it, and opens a non-blocking communicator on cfg->nccl.device (default: the local
 *  rank). Buffers are device memory (cfg->memory DTR_MEM_DEVICE, cfg->context the CUDA
 *  context whose queued work goes first). All-reduce, broadcast, reduce-scatter and
 *  all-gather are NCCL's own; point-to-point messages of a pair of ranks match in posting
 *  order with equal sizes (NCCL has no tags). A deadline, an asynchronous NCCL error or a dead
 *  peer process aborts the communicator: DTR_PEER_FAILED / DTR_TIMEOUT naming the rank, never
 *  a hang. Without a visible GPU open gives DTR_UNSUPPORTED. docs/distributed.md has more.
 *  Thread safety: thread safe. */
DTR_API const dtr_transport_vtable *dtr_nccl_transport(void);

/** Registers a transport under vt->name so that dtr_comm_config.transport can name it. The
 *  vtable must outlive every group using it. "local" is always registered.
 *  @return DTR_OK, DTR_NULL_HANDLE, DTR_VERSION_MISMATCH (abi_version), DTR_INVALID_ARGUMENT
 *          (no name, a required function missing, or the name taken by another vtable;
 *          registering the same vtable twice is DTR_OK), DTR_OUT_OF_MEMORY (more than 32).
 *  Thread safety: thread safe. */
DTR_API dtr_result dtr_transport_register(const dtr_transport_vtable *vt);
/** The registered transport called `name`, or NULL. Thread safe. */
DTR_API const dtr_transport_vtable *dtr_transport_find(const char *name);

/* ---- process groups ---- */

/** Settings of the `local` transport (ranks are threads of one process). */
typedef struct dtr_local_config {
    dtr_local_world *world;            /**< the world shared by the rank threads (required) */
    int rank;                          /**< this thread's rank in the world */
} dtr_local_config;

/** Settings of the libfabric transport (dtrain_comm.c). Zero or NULL means: the environment
 *  variable named, else the default. */
typedef struct dtr_fabric_config {
    const char *provider;              /**< "tcp;ofi_rxm", "shm", "efa", ...; $DTR_FABRIC_PROVIDER, else automatic */
    const char *domain;                /**< a domain (NIC) by name; $DTR_FABRIC_DOMAIN, else the provider's first */
    int spin_us;                       /**< a wait polls this long before it naps; $DTR_FABRIC_SPIN_US, else 20 (-1: 0) */
    int nap_us;                        /**< longest nap between polls; $DTR_FABRIC_NAP_US, else 64 */
    int keep_signal_handlers;          /**< 1: put back the process's handlers of SIGSEGV, SIGBUS, SIGINT, SIGTERM,
                                            SIGABRT and SIGILL after the endpoint opens (the shm provider installs
                                            its own); 0: $DTR_FABRIC_SIGNALS=keep does the same, else the
                                            provider's handlers stay (README, "Signals") */
} dtr_fabric_config;

/** Settings of the NCCL transport (dtr_nccl_transport). */
typedef struct dtr_nccl_config {
    int device;                        /**< CUDA device of this rank; -1 (default): the local rank */
    int blocking;                      /**< 1: NCCL's blocking communicator mode; 0: non-blocking (deadlines work) */
} dtr_nccl_config;

/** Where the buffers handed to a group's collectives live. */
typedef enum dtr_mem_kind {
    DTR_MEM_HOST = 1,                  /**< host memory (default) */
    DTR_MEM_DEVICE = 2                 /**< memory of the context's backend (a GPU): taken by a transport that takes
                                            it (NCCL), else staged through host memory (libfabric, local; a
                                            CPU context's is host memory) */
} dtr_mem_kind;

/** Group configuration. Make one with dtr_comm_config_init(); zero means default. Settings of
 *  one transport are nested (cfg.local, cfg.fabric, cfg.nccl) and read by that transport
 *  only, in the manner of miniaudio's per-backend configs. */
struct dtr_comm_config {
    const char *transport;             /**< registered transport name; NULL: "local" */
    const dtr_transport_vtable *transport_vtable; /**< use this transport without registering it (overrides `transport`) */
    struct dtr_store *store;           /**< transports that exchange addresses: the rendezvous store (api_rdzv.h) */
    void *transport_user;              /**< passed to a custom transport's open through cfg */
    dtr_local_config local;            /**< the local transport's settings */
    dtr_fabric_config fabric;          /**< the libfabric transport's settings */
    dtr_nccl_config nccl;              /**< the NCCL transport's settings */
    dtr_mem_kind memory;               /**< where collective buffers live; 0: DTR_MEM_HOST */
    dtr_context *context;              /**< DTR_MEM_DEVICE: the context whose backend owns the buffers (its
                                            stream orders the transfers, its backend reduces or copies them);
                                            outlives the group; NULL for host */
    int timeout_ms;                    /**< deadline of every blocking call (the store it makes from the
                                            environment too); 0: $DTR_TIMEOUT_MS, else 300000 (five minutes) */
    dtr_allreduce_algo allreduce_algo; /**< DTR_ALLREDUCE_AUTO (default): by size */
    size_t ring_threshold_bytes;       /**< AUTO: ring at or above this many bytes; 0: 256 KiB */
    size_t chain_threshold_bytes;      /**< broadcast: pipelined chain at or above this many bytes (binomial tree below); 0: 1 MiB */
    size_t segment_bytes;              /**< segment of the pipelined chain; 0: 256 KiB */
    int no_native;                     /**< 1: always build collectives over point-to-point, even when the transport has native ones */
    int shared_memory;                 /**< 1 (dtr_comm_config_init's default): when every rank of a group is
                                            a process of this host, its collectives run through a segment they
                                            all map (all-reduces above 128 KiB per rank by single copy, others
                                            up to 128 KiB; docs/distributed.md); 0: through the transport;
                                            2: as 1, and also for the local transport's threads (a block of
                                            their world; 1 MiB all-reduces about 3x faster; a rank that hangs
                                            is then found at the deadline as with processes, not by the local
                                            transport's waits-for analysis). $DTR_COMM_SHM=0, 1 or 2 overrides */
    int flight_records;                /**< operations the flight recorder keeps per group; 0: 64; -1: off */
    const char *flight_dir;            /**< on the first failure write <dir>/flight-rank<N>.json; NULL:
                                            $DTR_FLIGHT_DIR, else no file */
    dtr_allocation_callbacks alloc;    /**< allocation callbacks; zero: libc */
    dtr_log_fn log;                    /**< log callback (errors of the group, the flight record on failure); NULL: silent */
    void *log_user;
    dtr_log_level log_level;           /**< default DTR_LOG_WARN */
    int isolate_peer_failures;         /**< 1: a peer that dies or leaves fails only the send/recv operations
                                            with it (DTR_PEER_FAILED naming it; dtr_comm_peer_alive turns 0)
                                            and the group goes on with the others; collectives still fail
                                            as a whole. Read by the transport when it opens (every group on
                                            it; every rank must pass the same value); 0 (default): any
                                            failure breaks the world. Rank 0 hosts the rendezvous store and
                                            must not die. docs/distributed.md, "Failures" */
};

/** Returns a configuration with every field at its default (nccl.device -1, memory host).
 *  Thread safety: thread safe. */
DTR_API dtr_comm_config dtr_comm_config_init(void);

/** Opens this rank's endpoint of the transport and makes the world group of it (all ranks of
 *  the transport). Not collective: each rank calls it once (local transport: in its own
 *  thread, with its rank) and ranks may call it at different times; the first collective
 *  waits for the others up to the deadline.
 *  @return DTR_OK, DTR_NULL_HANDLE, DTR_NOT_FOUND (no such transport registered),
 *          DTR_INVALID_ARGUMENT (rank outside the world, rank opened twice, bad config),
 *          DTR_VERSION_MISMATCH, DTR_OUT_OF_MEMORY, or the transport's error. `err` (may be
 *          NULL) receives a message.
 *  Thread safety: thread safe (each rank opens its own). */
DTR_API dtr_result dtr_comm_create(const dtr_comm_config *cfg, dtr_comm **out, char *err, size_t errlen);

/** Destroys a group. Collectives still queued or running are aborted first (the other ranks
 *  get DTR_PEER_FAILED naming this rank), so destroy never waits longer than it takes the
 *  running step to notice. The transport endpoint closes with the last group sharing it.
 *  NULL is ignored. Thread safety: not with other calls on the same group. */
DTR_API void dtr_comm_destroy(dtr_comm *c);

/** This rank's rank in the group, the group's size, its rank among the ranks of the group
 *  on this machine and their number (local transport: the whole group), and the transport
 *  (world) rank of group rank `rank` (-1 outside). 0 / -1 for NULL. Thread safe. */
DTR_API int dtr_comm_rank(const dtr_comm *c);
DTR_API int dtr_comm_size(const dtr_comm *c);
DTR_API int dtr_comm_local_rank(const dtr_comm *c);
DTR_API int dtr_comm_local_size(const dtr_comm *c);
DTR_API int dtr_comm_world_rank(const dtr_comm *c, int rank);
/** Name of the group's transport ("local"). */
DTR_API const char *dtr_comm_transport_name(const dtr_comm *c);
/** What the transport chose when it opened (dtr_transport_info.detail): libfabric's provider,
 *  e.g. "shm" or "tcp;ofi_rxm"; "" for the local transport. Thread safety: any thread. */
DTR_API const char *dtr_comm_transport_detail(const dtr_comm *c);
/** 1 when the group's collectives run through a shared-memory segment that its ranks map
 *  (they are processes of one host, with host buffers: set up when the group is made;
 *  $DTR_COMM_SHM=0 turns it off), 0 when they go through the transport. The results are the
 *  same bits either way. Thread safety: any thread. */
DTR_API int dtr_comm_shared_memory(const dtr_comm *c);

/** Color of a rank that wants no sub-group from dtr_comm_split. */
#define DTR_COMM_UNDEFINED (-1)

/** Splits the group as MPI_Comm_split does: the ranks that pass the same color >= 0 form a
 *  sub-group, ordered by key, then by their rank here. Collective over `c` (an all-gather of
 *  (color, key)). The sub-group shares the transport with its own context id, so its
 *  messages never mix with another group's, and has its own progress thread and requests.
 *  @param color  >= 0, or DTR_COMM_UNDEFINED: *out becomes NULL (still a collective call).
 *  @return DTR_OK, DTR_NULL_HANDLE, DTR_INVALID_ARGUMENT (color < -1), DTR_OUT_OF_MEMORY,
 *          DTR_UNSUPPORTED (65535 context ids used), or a communication error.
 *  Thread safety: as a collective. */
DTR_API dtr_result dtr_comm_split(dtr_comm *c, int color, int key, dtr_comm **out);

/** Whether group rank `rank` can still be reached: 0 once the transport knows it died or
 *  left while the others go on (local: it closed its endpoint; libfabric: it closed, or died
 *  with cfg.isolate_peer_failures), 1 otherwise (also on transports that cannot tell, and
 *  after the whole world failed: dtr_comm_status says so), -1 for a NULL group or a rank
 *  outside it. On such groups a send or receive that fails with DTR_PEER_FAILED because
 *  its peer is gone leaves the group working (dtr_comm_status stays DTR_OK; the message is in
 *  dtr_comm_last_error). Thread safety: thread safe. */
DTR_API int dtr_comm_peer_alive(const dtr_comm *c, int rank);
/** 1 when the group's transport isolates peer failures (cfg.isolate_peer_failures on a
 *  transport with peer_alive), 0 otherwise (0 for NULL). Thread safety: thread safe. */
DTR_API int dtr_comm_isolates_peer_failures(const dtr_comm *c);

/** DTR_OK, or the error that broke the group (sticky).
 *  Thread safety: the group's thread (one at a time per group). */
DTR_API dtr_result dtr_comm_status(const dtr_comm *c);
/** The message of the most recent error on this group: "rank R/N all_reduce #S (...): what",
 *  naming the peer; "" when none. Valid until the next call on the group. */
DTR_API const char *dtr_comm_last_error(const dtr_comm *c);
/** The transport (world) rank named by the error that broke the group, or -1. */
DTR_API int dtr_comm_failed_rank(const dtr_comm *c);
/** The transport's native error code of that error (0 when none). */
DTR_API int dtr_comm_native_error(const dtr_comm *c);

/* ---- the flight recorder ----
 * Every group keeps its last operations (cfg.flight_records, default 64) in a ring made with
 * the group: recording allocates nothing. On the group's first communication failure
 * (DTR_TIMEOUT, DTR_PEER_FAILED) the ring goes to the log callback (DTR_LOG_ERROR, the last
 * 16) and, when cfg.flight_dir or $DTR_FLIGHT_DIR names a folder, to
 * <dir>/flight-rank<N>.json (N: the world rank; a sub-group writes
 * flight-rank<N>-group<id>.json). docs/distributed.md shows one. */

/** State of an operation in the flight recorder. */
typedef enum dtr_flight_state {
    DTR_FLIGHT_RUNNING = 0,            /**< started, not finished (in a dump: what the rank was doing) */
    DTR_FLIGHT_DONE = 1,               /**< finished with DTR_OK */
    DTR_FLIGHT_FAILED = 2              /**< finished with an error, or under way when the group failed */
} dtr_flight_state;

/** One operation of a group, as the flight recorder saw it. */
typedef struct dtr_flight_record {
    uint64_t id;                       /**< the group's operations counted from 1 */
    const char *op;                    /**< "all_reduce", "broadcast", "reduce_scatter", "all_gather", "barrier",
                                            "send", "recv" (a static string) */
    int p2p;                           /**< 1: send or recv */
    uint32_t seq;                      /**< a collective's sequence number in the group (the "#S" of error
                                            messages; equal on every rank for the same call); 0 for send/recv */
    size_t bytes;                      /**< this rank's payload (count x element size) */
    int peer;                          /**< send/recv: the peer; broadcast: the root (group ranks); else -1 */
    int tag;                           /**< send/recv: the tag; else 0 */
    int64_t start_ns, end_ns;          /**< dtr_time_ns() at start and end; end_ns 0 while running */
    dtr_flight_state state;
    dtr_result result;                 /**< DTR_OK, or the error it ended with (a send/recv request
                                            destroyed before it finished: DTR_BAD_STATE) */
} dtr_flight_record;

/** Copies the group's last operations into out (at most cap, oldest first) and returns how
 *  many it copied; with out NULL or cap <= 0, returns how many the recorder holds. 0 for a
 *  NULL group or a recorder turned off (cfg.flight_records -1).
 *  Thread safety: thread safe (any thread, also while operations run). */
DTR_API int dtr_comm_flight(const dtr_comm *c, dtr_flight_record *out, int cap);
/** Writes the flight record of the group as JSON to `path` (atomically: temporary file,
 *  fsync, rename): rank, size, status, failed rank, error message and the records.
 *  @return DTR_OK, DTR_NULL_HANDLE, DTR_OUT_OF_MEMORY, DTR_IO_ERROR (message in err).
 *  Thread safety: thread safe. */
DTR_API dtr_result dtr_comm_flight_dump(const dtr_comm *c, const char *path, char *err, size_t errlen);
/** "running", "done", "failed".
 *  Thread safety: thread safe. */
DTR_API const char *dtr_flight_state_name(dtr_flight_state s);

/** Breaks the group on purpose: every pending and later operation of every group sharing
 *  the transport, on every rank, fails with DTR_PEER_FAILED naming this rank and `why`.
 *  Returns at once; then destroy the groups. Use it when this rank cannot go on (its data
 *  failed to load, an exception...), so the others stop now instead of at their deadline.
 *  Thread safety: thread safe (may be called while another thread waits on the group). */
DTR_API void dtr_comm_abort(dtr_comm *c, const char *why);

/** Replaces the deadline (milliseconds > 0) of the group's later calls. Returns DTR_OK,
 *  DTR_NULL_HANDLE or DTR_INVALID_ARGUMENT. Thread safety: the group's thread. */
DTR_API dtr_result dtr_comm_set_timeout(dtr_comm *c, int timeout_ms);
/** Replaces the all-reduce algorithm and, when ring_threshold_bytes > 0, the AUTO threshold,
 *  for the group's later calls. Every rank must make the same change at the same point
 *  between collectives (the algorithm is part of what must match).
 *  DTR_ALLREDUCE_HIERARCHICAL makes the call a collective the first time: it splits the group
 *  by host (dtr_comm_local_rank's hosts; $DTR_RANKS_PER_HOST=k declares fake hosts of k
 *  consecutive ranks, for tests on one machine) and the hosts' first ranks into a leaders'
 *  group. Its all-reduce sums inside each host (the host group's AUTO algorithm), all-reduces
 *  the sums between the leaders (an average divided by the whole group's size in the last
 *  step), and broadcasts inside each host. With one host, or one rank per host, it is the
 *  flat algorithm AUTO picks. Buffers in device memory (cfg.memory) use the flat one.
 *  Returns DTR_OK, DTR_NULL_HANDLE, DTR_INVALID_ARGUMENT, or a split's error.
 *  Thread safety: the group's thread. */
DTR_API dtr_result dtr_comm_set_allreduce_algo(dtr_comm *c, dtr_allreduce_algo algo, size_t ring_threshold_bytes);

/* ---- collectives (blocking) ----
 * Counts are elements of `dt` (f32, bf16 or f16 for reductions; any dtype otherwise).
 * Return DTR_OK, DTR_NULL_HANDLE, DTR_INVALID_ARGUMENT (bad root, dtype, op, overlap),
 * DTR_DTYPE_MISMATCH, DTR_OUT_OF_MEMORY (scratch), DTR_TIMEOUT, DTR_PEER_FAILED, or the
 * group's sticky error. Messages name the rank, the operation and the peer. */

/** dst[i] = src[i] reduced over all ranks, on every rank. src == dst is in place; otherwise
 *  they must not overlap. Ring or recursive doubling as the configuration says.
 *  Thread safety: the group's thread (one at a time per group). */
DTR_API dtr_result dtr_comm_all_reduce(dtr_comm *c, const void *src, void *dst, size_t count, dtr_dtype dt,
                                       dtr_reduce_op op);
/** buf of rank `root` is copied into buf of every rank (binomial tree; pipelined chain for
 *  large messages). */
DTR_API dtr_result dtr_comm_broadcast(dtr_comm *c, void *buf, size_t count, dtr_dtype dt, int root);
/** src holds size * count elements; rank r receives in dst the reduction of block r
 *  (elements [r*count, (r+1)*count)) over all ranks. Ring. dst must not overlap src. */
DTR_API dtr_result dtr_comm_reduce_scatter(dtr_comm *c, const void *src, void *dst, size_t count, dtr_dtype dt,
                                           dtr_reduce_op op);
/** Every rank's `count` elements of src, in rank order, into dst (size * count elements)
 *  of every rank. Ring. In place when src == dst + rank * count. */
DTR_API dtr_result dtr_comm_all_gather(dtr_comm *c, const void *src, void *dst, size_t count, dtr_dtype dt);
/** Returns once every rank has entered the barrier (dissemination: ceil(log2 N) rounds). */
DTR_API dtr_result dtr_comm_barrier(dtr_comm *c);
/** Point-to-point: sends `bytes` bytes to group rank `dst` with a user tag (0 to 2^31-1).
 *  Returns when the receiver has the data (the local transport copies straight into the
 *  receiver's buffer) or at the deadline. */
DTR_API dtr_result dtr_comm_send(dtr_comm *c, const void *buf, size_t bytes, int dst, int tag);
/** Receives a message of at most `bytes` bytes from group rank `src` with `tag`; messages
 *  from one source with one tag arrive in the order they were sent. */
DTR_API dtr_result dtr_comm_recv(dtr_comm *c, void *buf, size_t bytes, int src, int tag);

/* ---- collectives (non-blocking) ----
 * The *_async variants return at once with a request; the operation runs on the group's
 * progress thread (started on first use; it sleeps while the queue is empty), in the order
 * the calls were made, so compute can overlap communication. The buffers belong to the
 * operation until the request is complete. A blocking collective called while requests are
 * queued runs after them. send/recv requests are handed to the transport directly (they
 * are not queued behind collectives). On a group of size 1 every request completes at once
 * on the calling thread. Results, deadlines and errors are those of the blocking calls;
 * the deadline of an operation runs from the call that started it. */

typedef struct dtr_request dtr_request;

/** The non-blocking collectives and point-to-point calls: arguments as the blocking calls of
 *  the same name, plus *req, the request to test, wait on and destroy.
 *  @return DTR_OK with *req set, or at once the error a blocking call would give for bad
 *  arguments or a broken group (no request then).
 *  Thread safety: the group's thread (the progress thread is the group's own). */
DTR_API dtr_result dtr_comm_all_reduce_async(dtr_comm *c, const void *src, void *dst, size_t count, dtr_dtype dt,
                                             dtr_reduce_op op, dtr_request **req);
DTR_API dtr_result dtr_comm_broadcast_async(dtr_comm *c, void *buf, size_t count, dtr_dtype dt, int root,
                                            dtr_request **req);
DTR_API dtr_result dtr_comm_reduce_scatter_async(dtr_comm *c, const void *src, void *dst, size_t count, dtr_dtype dt,
                                                 dtr_reduce_op op, dtr_request **req);
DTR_API dtr_result dtr_comm_all_gather_async(dtr_comm *c, const void *src, void *dst, size_t count, dtr_dtype dt,
                                             dtr_request **req);
DTR_API dtr_result dtr_comm_barrier_async(dtr_comm *c, dtr_request **req);
DTR_API dtr_result dtr_comm_send_async(dtr_comm *c, const void *buf, size_t bytes, int dst, int tag, dtr_request **req);
DTR_API dtr_result dtr_comm_recv_async(dtr_comm *c, void *buf, size_t bytes, int src, int tag, dtr_request **req);

/** Polls a request: *done = 1 once it is complete. Returns DTR_OK while it runs, then its
 *  result. Never blocks. Thread safety: the group's thread. */
DTR_API dtr_result dtr_request_test(dtr_request *req, int *done);
/** Blocks until the request is complete (at the latest shortly after its deadline) and
 *  returns its result. Thread safety: the group's thread. */
DTR_API dtr_result dtr_request_wait(dtr_request *req);
/** Waits up to timeout_ms for one of the point-to-point requests reqs[0..n) of one group
 *  (send_async / recv_async; NULL entries are skipped) to complete, without spinning a core:
 *  the transport's wait where it has one (local, libfabric), short naps otherwise. *index is
 *  the first complete request (dtr_request_test then gives its result), or -1 when none
 *  completed in time, which is not an error: a server loop waits this way for whichever
 *  peer speaks first and still wakes for its own timers. A request's own deadline still
 *  ends it (with DTR_TIMEOUT) as in dtr_request_test.
 *  @return DTR_OK, DTR_NULL_HANDLE, DTR_INVALID_ARGUMENT (a collective's request, requests of
 *  different groups, n outside 1..1024, timeout_ms < 0), DTR_PEER_FAILED (the world failed).
 *  Thread safety: the group's thread. */
DTR_API dtr_result dtr_request_wait_any(dtr_request *const *reqs, int n, int timeout_ms, int *index);
/** Waits for the request if it still runs, then frees it. NULL is ignored. Every request
 *  must be freed (before its group is destroyed). */
DTR_API void dtr_request_destroy(dtr_request *req);

#ifdef __cplusplus
}
#endif
