/* ============================================================================
 * Public API: rendezvous (the built-in TCP key-value store hosted by rank 0)
 *
 * Every process of a job makes one store with the same master address, port and secret.
 * Rank 0 hosts the server (a thread inside dtr_store_create) and every rank, rank 0
 * included, connects to it as a client. Transports use it to swap addresses:
 *
 *     dtr_rendezvous_config cfg = dtr_rendezvous_config_init();
 *     char err[512];
 *     dtr_store *st;
 *     if (dtr_rendezvous_config_from_env(&cfg, err, sizeof err) != DTR_OK ||
 *         dtr_store_create(&cfg, &st, err, sizeof err) != DTR_OK) { puts(err); return 1; }
 *     dtr_store_set(st, "addr/3", my_addr, my_addr_len);
 *     dtr_store_get(st, "addr/0", buf, sizeof buf, &len);   // waits until rank 0 has set it
 *     dtr_store_barrier(st, "init");
 *     dtr_store_destroy(st);
 *
 * Joining needs the shared secret (DTR_SECRET): each connection answers an HMAC-SHA256
 * challenge with a fresh server nonce, and the server proves the secret back. The secret
 * authenticates; it does not encrypt. docs/rendezvous.md has the wire format and the
 * security model. Every call has a deadline (timeout_ms): a dead server is
 * DTR_PEER_FAILED, a silent one or a key that never comes is DTR_TIMEOUT, and the
 * message (dtr_store_last_error) names the rank, the operation and the key.
 * ==========================================================================*/
#ifdef __cplusplus
extern "C" {
#endif

/** Longest key in bytes (keys are NUL-terminated strings of 1..DTR_STORE_MAX_KEY bytes). */
#define DTR_STORE_MAX_KEY 256
/** Largest value in bytes. */
#define DTR_STORE_MAX_VALUE (1u << 20)
/** Size of the string fields of dtr_rendezvous_config (the longest string is one less). */
#define DTR_RDZV_STR 256

/** Rendezvous configuration. Make one with dtr_rendezvous_config_init() (zero or "" means
 *  default, except for port), optionally fill it from the environment with
 *  dtr_rendezvous_config_from_env(), and set what remains by hand. */
typedef struct dtr_rendezvous_config {
    int32_t rank;               /**< this process, 0 .. world_size-1 (default 0) */
    int32_t world_size;         /**< number of processes (default 1); every rank must give the same */
    int32_t local_rank;         /**< rank on this node (default 0) */
    int32_t local_world_size;   /**< processes on this node; 0: unknown (default) */
    char master_addr[DTR_RDZV_STR];  /**< host name, IPv4 or IPv6 address of rank 0 (default "127.0.0.1");
                                          "[::1]" brackets are accepted */
    int port;                   /**< TCP port of the store, 1..65535 (default 29500). Rank 0 of a
                                     one-process job may use 0: any free port (dtr_store_port) */
    char secret[DTR_RDZV_STR];  /**< shared secret, 1..255 bytes; required (DTR_SECRET) */
    int timeout_ms;             /**< deadline of every blocking call, create included; 0: $DTR_TIMEOUT_MS,
                                     else 300000 */
    int max_keys;               /**< server: most keys held; 0: 65536 */
    int max_connections;        /**< server: most open connections; 0: 1024 (at least world_size + 16) */
    size_t max_bytes;           /**< server: most bytes of keys and values held; 0: 256 MiB */
    dtr_allocation_callbacks alloc;  /**< allocation callbacks; zero: libc */
    dtr_log_fn log;             /**< log callback (server refusals, with the reason); NULL: silent.
                                     Called from the server thread too */
    void *log_user;             /**< passed to `log` */
    dtr_log_level log_level;    /**< most verbose level passed to `log` (default DTR_LOG_WARN) */
    int32_t generation;         /**< the job's attempt, 0 first (DTR_RESTART, set by dtrun --max-restarts):
                                     a rank of another generation than rank 0's cannot join; an older
                                     one is refused at once, a newer one retries (the old store is
                                     going away) */
    char job_id[DTR_RDZV_STR];  /**< the job's identity (DTR_JOB_ID; dtrun makes a random one; default
                                     ""): a rank of another job that reaches this store (two jobs on one
                                     port) is refused at once, naming the cause */
    int grace_ms;               /**< rank 0's dtr_store_destroy after a failure (a call of this store
                                     failed, or dtr_store_mark_failed): the longest wait for the other
                                     ranks to close; 0: $DTR_GRACE_MS, else 2000 */
} dtr_rendezvous_config;

/** Returns a configuration with every field at its default (rank 0 of 1, 127.0.0.1:29500,
 *  no secret, 300 s deadline). Thread safe. */
DTR_API dtr_rendezvous_config dtr_rendezvous_config_init(void);

/** Fills `cfg` from the environment. Each field is taken from the first variable that is set
 *  (an empty variable counts as unset); fields with no variable keep their value:
 *
 *      rank              DTR_RANK, RANK, SLURM_PROCID, OMPI_COMM_WORLD_RANK
 *      world_size        DTR_WORLD_SIZE, WORLD_SIZE, SLURM_NTASKS, OMPI_COMM_WORLD_SIZE
 *      local_rank        DTR_LOCAL_RANK, LOCAL_RANK, SLURM_LOCALID, OMPI_COMM_WORLD_LOCAL_RANK
 *      local_world_size  DTR_LOCAL_WORLD_SIZE, LOCAL_WORLD_SIZE, SLURM_NTASKS_PER_NODE,
 *                        OMPI_COMM_WORLD_LOCAL_SIZE
 *      master_addr       DTR_MASTER_ADDR, MASTER_ADDR
 *      port              DTR_MASTER_PORT, MASTER_PORT
 *      secret            DTR_SECRET
 *      timeout_ms        DTR_TIMEOUT_MS
 *      generation        DTR_RESTART
 *      job_id            DTR_JOB_ID
 *      grace_ms          DTR_GRACE_MS
 *
 *  A variable that is set must be valid; it is never skipped in favour of a later one.
 *  @param cfg     in/out: the configuration to update.
 *  @param err     receives a message naming the variable and its value on failure (may be NULL).
 *  @param errlen  size of err.
 *  @return DTR_OK; DTR_NULL_HANDLE for cfg NULL; DTR_INVALID_ARGUMENT for a value that is not
 *          a decimal integer in range, a rank not below the world size, a port outside
 *          1..65535, or a string too long. cfg may be partly updated on failure.
 *  Thread safety: reads the environment; do not call while another thread changes it. */
DTR_API dtr_result dtr_rendezvous_config_from_env(dtr_rendezvous_config *cfg, char *err, size_t errlen);

typedef struct dtr_store dtr_store;

/** Joins the store. Rank 0 first starts the server (listening on the loopback addresses when
 *  master_addr is a loopback address, otherwise on every interface, IPv6 and IPv4), then every
 *  rank connects to master_addr:port, retrying while the server is not up yet, and answers
 *  the server's challenge. Returns once the connection is authenticated (it does not wait
 *  for the other ranks: use dtr_store_barrier for that).
 *  @param cfg     configuration (copied); not NULL.
 *  @param out     receives the store, NULL on failure.
 *  @param err     receives the reason on failure (may be NULL).
 *  @return DTR_OK; DTR_NULL_HANDLE; DTR_INVALID_ARGUMENT for a bad configuration (no secret,
 *          rank out of range) or when the server refuses the secret, the rank or the world
 *          size (every rank must give rank 0's world_size); DTR_IO_ERROR when rank 0
 *          cannot listen (port in use) or the address does not resolve; DTR_TIMEOUT when no
 *          server answered within timeout_ms; DTR_PEER_FAILED when the server closed the
 *          connection during the handshake; DTR_VERSION_MISMATCH for another protocol
 *          version; DTR_OUT_OF_MEMORY; DTR_UNSUPPORTED on platforms without POSIX sockets.
 *  Thread safety: any thread; stores are independent. */
DTR_API dtr_result dtr_store_create(const dtr_rendezvous_config *cfg, dtr_store **out, char *err, size_t errlen);

/** Leaves the store and frees it. On rank 0 it first waits until the other ranks have closed
 *  their connections (up to timeout_ms; up to grace_ms once the store has failed: see
 *  dtr_store_mark_failed), so call it after a final barrier, then stops the server thread and
 *  joins it. NULL is ignored. Thread safety: no other call on this store may be running or
 *  follow. */
DTR_API void dtr_store_destroy(dtr_store *st);

/** Sets `key` (a string of 1..DTR_STORE_MAX_KEY bytes) to `len` bytes of `value` (len up to
 *  DTR_STORE_MAX_VALUE; value may be NULL when len is 0), replacing any old value, and wakes
 *  every rank waiting for the key in dtr_store_get.
 *  @return DTR_OK; DTR_NULL_HANDLE; DTR_INVALID_ARGUMENT for a bad key or length;
 *          DTR_OUT_OF_MEMORY when the server holds max_keys keys or max_bytes bytes;
 *          DTR_PEER_FAILED (connection to rank 0 lost); DTR_TIMEOUT (no reply in timeout_ms).
 *  Thread safety: calls on one store are serialised by a lock. */
DTR_API dtr_result dtr_store_set(dtr_store *st, const char *key, const void *value, size_t len);

/** Gets the value of `key`, waiting until some rank sets it or timeout_ms passes.
 *  @param buf  receives up to `cap` bytes of the value (may be NULL when cap is 0).
 *  @param len  receives the value's full length (may be NULL).
 *  @return DTR_OK; DTR_INVALID_ARGUMENT for a bad key, or when the value is longer than
 *          `cap` (then *len holds the length needed and the call can be repeated with a
 *          larger buffer: the key is there now); DTR_TIMEOUT when the key was not set within
 *          timeout_ms (the message names the key); DTR_PEER_FAILED; DTR_NULL_HANDLE.
 *  Thread safety: as dtr_store_set. */
DTR_API dtr_result dtr_store_get(dtr_store *st, const char *key, void *buf, size_t cap, size_t *len);

/** Like dtr_store_get but does not wait: *found is 1 and the value is returned when the key
 *  exists, else *found is 0 and the result is DTR_OK.
 *  @return as dtr_store_get, without DTR_TIMEOUT for a missing key.
 *  Thread safety: one thread at a time per store handle. */
DTR_API dtr_result dtr_store_check(dtr_store *st, const char *key, void *buf, size_t cap, size_t *len,
                                   int *found);

/** Adds `delta` to the counter `key` atomically and returns its new value in *result (may be
 *  NULL). A missing key counts as 0. Counters are stored as decimal text ("42"), so
 *  dtr_store_get reads them too, and setting a key to decimal text makes it a counter.
 *  @return DTR_OK; DTR_INVALID_ARGUMENT when the key holds something that is not a decimal
 *          int64 or the sum overflows; otherwise as dtr_store_set.
 *  Thread safety: as dtr_store_set; atomic across all ranks. */
DTR_API dtr_result dtr_store_add(dtr_store *st, const char *key, int64_t delta, int64_t *result);

/** Removes `key` (nothing happens when it does not exist). Keys are not removed otherwise;
 *  delete those you no longer need when a job makes many.
 *  @return DTR_OK; otherwise as dtr_store_set.  Thread safety: as dtr_store_set. */
DTR_API dtr_result dtr_store_delete(dtr_store *st, const char *key);

/** Waits until all world_size ranks have called their n-th barrier (the n-th call on every
 *  rank meet, so every rank must call barriers in the same order). `tag` (may be NULL) only
 *  names the barrier in messages. One deadline, timeout_ms, covers the whole barrier.
 *  @return DTR_OK; DTR_TIMEOUT naming how many ranks arrived; DTR_PEER_FAILED; DTR_NULL_HANDLE.
 *  Thread safety: as dtr_store_set. */
DTR_API dtr_result dtr_store_barrier(dtr_store *st, const char *tag);

/** Marks the job as failed for this store, so that dtr_store_destroy on rank 0 waits for the
 *  other ranks to leave at most grace_ms instead of timeout_ms (a stopped or hung rank keeps
 *  its connection open). A call of the store that fails with DTR_TIMEOUT or DTR_PEER_FAILED
 *  marks it too, and so does a process group (dtr_comm) that failed, for the store it was
 *  made from. NULL is ignored. Thread safety: any thread, at any time before destroy. */
DTR_API void dtr_store_mark_failed(dtr_store *st);

/** Tells the launcher (dtrun) that this rank finished training step `step` of this attempt,
 *  so that dtrun can print how long a restart took from the failure to the restarted job's
 *  first step. Only the first call of a process does anything: it writes one line to the
 *  pipe whose descriptor dtrun puts in DTR_NOTIFY_FD; without that variable it does nothing.
 *  Cheap enough to call after every step. Thread safety: any thread. */
DTR_API void dtr_elastic_step(int64_t step);

/** The message of the last failed call on this store (names rank, operation and key), or "".
 *  Valid until the next call on the store.
 *  Thread safety: one thread at a time per store handle. */
DTR_API const char *dtr_store_last_error(const dtr_store *st);

/** This store's rank (from its configuration); -1 for NULL. Thread safe. */
DTR_API int32_t dtr_store_rank(const dtr_store *st);
/** This store's world size (from its configuration); 0 for NULL. Thread safe. */
DTR_API int32_t dtr_store_world_size(const dtr_store *st);

/** The TCP port of the store: on rank 0 the port actually bound (useful with port 0). Thread safe. */
DTR_API int dtr_store_port(const dtr_store *st);

#ifdef __cplusplus
}
#endif
