/* ============================================================================
 * Public API: federated learning (src/fed/federated.c)
 *
 * One server holds the global model (a flat float vector: dtr_model_params of any dtrain
 * model) and runs rounds; clients (cars, robots, consoles, branch offices: processes that
 * keep their data) connect to it over TCP, come and go at any time, train on their own data
 * and send back an update. Each round the server samples K of the live clients, sends them
 * the global weights, waits until the round deadline for their updates (weights after
 * training minus the weights sent, with the number of samples behind them), checks every
 * update (shape, finite values, norm), clips it, aggregates (FedAvg weighted by samples,
 * coordinate-wise median or trimmed mean), optionally adds differential-privacy noise, and
 * applies the result with a server optimizer (plain averaging, server momentum, FedAdam).
 * A round with fewer than min_updates usable updates is repeated (up to max_attempts).
 *
 *     dtr_fed_server_config sc = dtr_fed_server_config_init();
 *     snprintf(sc.secret, sizeof sc.secret, "%s", getenv("DTR_SECRET"));
 *     sc.clients_per_round = 8;
 *     dtr_fed_server_create(&sc, dtr_model_params(m), dtr_model_numel(m), &srv, err, sizeof err);
 *     dtr_fed_server_wait_clients(srv, 8, 60000);
 *     for (r = 0; r < 20; r++) dtr_fed_server_round(srv, &stats);
 *
 *     // on each client:
 *     dtr_fed_client_create(&cc, dtr_model_numel(m), &cl, err, sizeof err);
 *     while (dtr_fed_client_next(cl, dtr_model_params(m), &task) == DTR_OK && !task.done) {
 *         ... train task.local_epochs epochs (dtr_fed_prox after each backward when task.mu > 0) ...
 *         dtr_fed_client_send_weights(cl, dtr_model_params(m), samples);
 *     }
 *     // a model on a GPU: receive into a host array w, dtr_model_write(m, w, n) to train,
 *     // dtr_model_read(m, w, n) before sending w
 *
 * Transport security: joining needs the shared secret (an HMAC-SHA256 challenge in both
 * directions, as the rendezvous store's join); every message after the join carries an
 * HMAC-SHA256 under a per-connection session key with a sequence number, so an update cannot
 * be altered, replayed or injected in transit. Messages are NOT encrypted: someone on the
 * path can read the weights and updates. Use a VPN or TLS tunnel where that matters.
 * docs/federated.md has the wire format and the fault model.
 * Windows: every call reports DTR_UNSUPPORTED.
 * ==========================================================================*/
#ifdef __cplusplus
extern "C" {
#endif

/** How the server combines the updates of a round. */
typedef enum dtr_fed_aggregator {
    DTR_FED_MEAN = 0,          /**< FedAvg: mean weighted by each client's sample count */
    DTR_FED_MEDIAN = 1,        /**< coordinate-wise median (unweighted) */
    DTR_FED_TRIMMED_MEAN = 2   /**< coordinate-wise mean after dropping trim_fraction at each end */
} dtr_fed_aggregator;

/** How the server applies the aggregated update d (FedOpt, Reddi et al. 2021). */
typedef enum dtr_fed_server_opt {
    DTR_FED_OPT_AVG = 0,       /**< w += server_lr * d (FedAvg with server_lr 1) */
    DTR_FED_OPT_MOMENTUM = 1,  /**< m = beta1 m + d; w += server_lr * m */
    DTR_FED_OPT_ADAM = 2       /**< m = b1 m + (1-b1) d; v = b2 v + (1-b2) d^2; w += server_lr m / (sqrt(v) + eps) */
} dtr_fed_server_opt;

/** Encoding of weights and updates on the wire. */
typedef enum dtr_fed_codec {
    DTR_FED_F32 = 0,           /**< 4 bytes a value, exact */
    DTR_FED_BF16 = 1           /**< 2 bytes a value (round to nearest even) */
} dtr_fed_codec;

/** Server configuration. Make one with dtr_fed_server_config_init(); zero means default. */
typedef struct dtr_fed_server_config {
    char bind_addr[DTR_RDZV_STR];   /**< address to listen on (default "127.0.0.1"; "0.0.0.0" or "::": every interface) */
    int port;                   /**< TCP port; 0: any free port (dtr_fed_server_port) */
    char secret[DTR_RDZV_STR];  /**< shared secret, 1..255 bytes; required */
    int clients_per_round;      /**< K, clients sampled per round (default 8) */
    int min_updates;            /**< fewest accepted updates that make a round (default 1) */
    int round_timeout_ms;       /**< deadline of one attempt of a round; late updates are dropped (default 60000) */
    int max_attempts;           /**< attempts of a round before dtr_fed_server_round gives up (default 3) */
    int join_timeout_ms;        /**< how long an attempt waits for enough idle clients (default round_timeout_ms) */
    int local_epochs;           /**< E, sent to the clients with each task (default 1) */
    float mu;                   /**< FedProx proximal weight sent to the clients (default 0: FedAvg) */
    float client_lr;            /**< learning rate suggested to the clients (default 0: their own) */
    dtr_fed_aggregator aggregator;  /**< default DTR_FED_MEAN */
    float trim_fraction;        /**< DTR_FED_TRIMMED_MEAN: fraction dropped at each end, 0..0.5 (default 0.2) */
    float max_update_norm;      /**< an update of larger L2 norm is rejected (default 1e4; negative: no limit) */
    float clip_norm;            /**< an update of larger L2 norm is scaled down to it (default 0: no clipping) */
    float dp_noise_multiplier;  /**< z > 0 adds Gaussian noise of std z * clip_norm * max_i(w_i) / sum_i(w_i)
                                     to the aggregate (needs clip_norm > 0); default 0: off */
    dtr_fed_server_opt server_opt;  /**< default DTR_FED_OPT_AVG */
    float server_lr;            /**< 0: 1, or 0.01 with DTR_FED_OPT_ADAM (resolved at create) */
    float beta1, beta2, eps;    /**< momentum / Adam moments (default 0.9, 0.99) and Adam's eps (default 1e-3) */
    dtr_fed_codec codec;        /**< encoding of the weights sent to the clients (default DTR_FED_F32) */
    uint64_t seed;              /**< seed of client sampling and of the noise (default 0) */
    char checkpoint_path[1024];  /**< safetensors file of the server state, written atomically after
                                              every checkpoint_every rounds and read at create when it
                                              exists (the run resumes); "": none */
    int checkpoint_every;       /**< default 1 */
    int max_clients;            /**< most connections held (default 1024) */
    dtr_allocation_callbacks alloc;  /**< zero: libc */
    dtr_log_fn log;             /**< refusals, rejected updates, rounds; NULL: silent */
    void *log_user;             /**< passed to `log` */
    dtr_log_level log_level;    /**< most verbose level passed to `log` (default DTR_LOG_WARN) */
} dtr_fed_server_config;

/** What one round did. */
typedef struct dtr_fed_round_stats {
    int64_t round;              /**< the round completed (0-based); the next one is round + 1 */
    int attempts;               /**< attempts it took (1 unless some were repeated) */
    int live_clients;           /**< authenticated connections at the end */
    int sampled;                /**< clients sent the task in the last attempt */
    int received;               /**< updates received in time (all attempts) */
    int accepted;               /**< updates aggregated (last attempt) */
    int rejected;               /**< non-finite, too large, zero samples (all attempts) */
    int clipped;                /**< accepted updates scaled down to clip_norm (last attempt) */
    int late;                   /**< updates that arrived after their deadline (dropped) */
    int dropped_clients;        /**< connections closed for a protocol error or lost (all attempts) */
    uint64_t samples;           /**< sum of the accepted updates' sample counts */
    uint64_t bytes_sent;        /**< bytes written to clients (all attempts) */
    uint64_t bytes_received;    /**< bytes read from clients (all attempts) */
    double seconds;             /**< wall time of the round */
    double update_norm;         /**< L2 norm of the aggregated update (before the server optimizer) */
} dtr_fed_round_stats;

typedef struct dtr_fed_server dtr_fed_server;

/** Returns a server configuration with every field at its default. Thread safe. */
DTR_API dtr_fed_server_config dtr_fed_server_config_init(void);

/** Starts a server: listens on bind_addr:port and holds the global model, `numel` floats
 *  copied from `weights`. When checkpoint_path names an existing file, the global model,
 *  the round number and the server optimizer's state are read from it instead (its numel
 *  must match) and the run resumes at that round.
 *  @return DTR_OK; DTR_NULL_HANDLE; DTR_INVALID_ARGUMENT (no secret, numel < 1, a field out
 *          of range, dp without clipping); DTR_IO_ERROR (cannot listen: the message says
 *          why); DTR_CORRUPT_FILE / DTR_SHAPE_MISMATCH (checkpoint unreadable or of another
 *          model); DTR_OUT_OF_MEMORY; DTR_UNSUPPORTED on Windows.
 *  Thread safety: any thread; servers are independent. */
DTR_API dtr_result dtr_fed_server_create(const dtr_fed_server_config *cfg, const float *weights, int64_t numel,
                                         dtr_fed_server **out, char *err, size_t errlen);

/** Sends every client "done" (their dtr_fed_client_next returns task.done = 1), closes the
 *  connections and frees the server. NULL is ignored.
 *  Thread safety: no other call on this server may be running or follow. */
DTR_API void dtr_fed_server_destroy(dtr_fed_server *s);

/** Serves joins and messages for up to timeout_ms, returning early once `n` clients are live
 *  (authenticated and connected).
 *  @return DTR_OK when n clients are live; DTR_TIMEOUT otherwise; DTR_NULL_HANDLE.
 *  Thread safety: one thread at a time per server. */
DTR_API dtr_result dtr_fed_server_wait_clients(dtr_fed_server *s, int n, int timeout_ms);

/** Runs one round: samples K idle live clients (waiting up to join_timeout_ms for at least
 *  min_updates of them), sends the task, collects updates until all answered or
 *  round_timeout_ms, then aggregates and applies them and checkpoints. An attempt with
 *  fewer than min_updates accepted updates is repeated with a new sample; clients that did
 *  not answer an attempt are not sampled again until they do. Never waits longer than
 *  max_attempts * (join_timeout_ms + round_timeout_ms).
 *  @param stats  receives what happened (may be NULL).
 *  @return DTR_OK (the round number advanced); DTR_TIMEOUT when max_attempts attempts all
 *          had too few updates (the model and round are unchanged; call again);
 *          DTR_IO_ERROR when the checkpoint could not be written (the round is done);
 *          DTR_NULL_HANDLE.
 *  Thread safety: one thread at a time per server. */
DTR_API dtr_result dtr_fed_server_round(dtr_fed_server *s, dtr_fed_round_stats *stats);

/** The global model (numel floats), valid until the next round or destroy. NULL for NULL.
 *  Thread safety: not while a round runs on another thread. */
DTR_API const float *dtr_fed_server_weights(const dtr_fed_server *s);
/** Rounds completed so far (the next round's number); -1 for NULL. Thread safety: as weights. */
DTR_API int64_t dtr_fed_server_round_index(const dtr_fed_server *s);
/** Authenticated connections now; -1 for NULL. Thread safety: as weights. */
DTR_API int dtr_fed_server_live_clients(const dtr_fed_server *s);
/** The TCP port listened on (the chosen one with port 0); 0 for NULL. Thread safe. */
DTR_API int dtr_fed_server_port(const dtr_fed_server *s);
/** Message of the last failed call, or "". Thread safety: as weights. */
DTR_API const char *dtr_fed_server_last_error(const dtr_fed_server *s);

/** Client configuration. Make one with dtr_fed_client_config_init(); zero means default. */
typedef struct dtr_fed_client_config {
    char server_addr[DTR_RDZV_STR];  /**< host name or address of the server (default "127.0.0.1") */
    int port;                   /**< the server's port; required */
    char secret[DTR_RDZV_STR];  /**< the shared secret; required */
    uint64_t client_id;         /**< this client's identity; a new join with the same id replaces the
                                     old connection (0: a random id) */
    int timeout_ms;             /**< deadline of create and of each dtr_fed_client_next (default 300000) */
    dtr_fed_codec codec;        /**< encoding of the updates sent (default DTR_FED_F32) */
    int no_reconnect;           /**< 1: dtr_fed_client_next fails when the connection is lost instead
                                     of joining again (default 0: it reconnects, so a restarted
                                     server gets its clients back) */
    dtr_allocation_callbacks alloc;  /**< zero: libc */
} dtr_fed_client_config;

/** A round's task, as received by dtr_fed_client_next. */
typedef struct dtr_fed_task {
    int64_t round;              /**< the round this task belongs to */
    int local_epochs;           /**< E: local epochs to train */
    float mu;                   /**< FedProx weight (0: plain FedAvg); see dtr_fed_prox */
    float lr;                   /**< the server's suggested learning rate (0: use your own) */
    int done;                   /**< 1: the server finished (or is shutting down); no weights were written */
} dtr_fed_task;

typedef struct dtr_fed_client dtr_fed_client;

/** Returns a client configuration with every field at its default. Thread safe. */
DTR_API dtr_fed_client_config dtr_fed_client_config_init(void);

/** Connects to the server and joins (retrying while it is not up, until timeout_ms).
 *  `numel` is the model's size: the server refuses another size.
 *  @return DTR_OK; DTR_NULL_HANDLE; DTR_INVALID_ARGUMENT (no secret or port, or the server
 *          refused the secret); DTR_SHAPE_MISMATCH (the server's model has another size);
 *          DTR_TIMEOUT (no server answered); DTR_PEER_FAILED (the server closed the
 *          connection, e.g. it is full); DTR_IO_ERROR (address does not resolve);
 *          DTR_OUT_OF_MEMORY; DTR_UNSUPPORTED on Windows.
 *  Thread safety: any thread; clients are independent. */
DTR_API dtr_result dtr_fed_client_create(const dtr_fed_client_config *cfg, int64_t numel, dtr_fed_client **out,
                                         char *err, size_t errlen);

/** Closes the connection and frees the client. NULL is ignored.
 *  Thread safety: no other call on this client may be running or follow. */
DTR_API void dtr_fed_client_destroy(dtr_fed_client *c);

/** Waits (up to timeout_ms) for the next task and writes the global weights (numel floats)
 *  into `weights`. When the connection is lost it joins again (unless no_reconnect), so a
 *  client survives a server restart. task->done = 1 means the server finished.
 *  @return DTR_OK; DTR_TIMEOUT; DTR_PEER_FAILED (lost and could not join again);
 *          DTR_CORRUPT_FILE (a message failed its checks: the connection is dropped);
 *          DTR_NULL_HANDLE.
 *  Thread safety: one thread at a time per client. */
DTR_API dtr_result dtr_fed_client_next(dtr_fed_client *c, float *weights, dtr_fed_task *task);

/** Sends the update of the last task: `delta` (numel floats: local weights minus the
 *  weights received) and the number of samples it was trained on (>= 1).
 *  @return DTR_OK; DTR_BAD_STATE (no task pending); DTR_INVALID_ARGUMENT (samples 0);
 *          DTR_PEER_FAILED / DTR_TIMEOUT (the update is lost; the next dtr_fed_client_next
 *          reconnects); DTR_NULL_HANDLE.
 *  Thread safety: one thread at a time per client. */
DTR_API dtr_result dtr_fed_client_send(dtr_fed_client *c, const float *delta, uint64_t samples);

/** Like dtr_fed_client_send, with the local weights after training: the client subtracts the
 *  weights it received. Thread safety: one thread at a time per client. */
DTR_API dtr_result dtr_fed_client_send_weights(dtr_fed_client *c, const float *weights, uint64_t samples);

/** Message of the last failed call, or "". Thread safety: one thread at a time per client. */
DTR_API const char *dtr_fed_client_last_error(const dtr_fed_client *c);

/** FedProx: adds mu * (w - global) to the model's gradients (the gradient of the proximal
 *  term mu/2 ||w - global||^2). Call after each backward, before the optimizer step.
 *  `global` holds dtr_model_numel host floats (the weights of the task). A model on a device
 *  works through host copies of its weights and gradients (three copies a call).
 *  @return DTR_OK; DTR_NULL_HANDLE; DTR_BAD_STATE (model not built); DTR_OUT_OF_MEMORY; a
 *  device error.
 *  Thread safety: the model's context thread. */
DTR_API dtr_result dtr_fed_prox(dtr_model *m, const float *global, float mu);

#ifdef __cplusplus
}
#endif
