/* ============================================================================
 * Observability: per-step metrics (loss, learning rate, gradient norm, throughput, the step
 * time split into phases, FLOPs and model FLOP utilisation) delivered to a callback and,
 * optionally, appended as JSON lines to a file; a per-rank timeline (Chrome trace-event
 * JSON, opens in Perfetto) of every op's forward and backward, each data-parallel bucket's
 * collective, data-loader waits and the optimizer; a straggler report over the ranks.
 * docs/observability.md describes the formats.
 * ==========================================================================*/

/** The parts a step's time is split into. Every moment between dtr_metrics_step_begin (or
 *  the previous step's end) and dtr_metrics_step_end belongs to exactly one phase, so the
 *  parts add up to the step time. The library marks the phases it runs: dtr_loader_next
 *  of a watched loader (DATA), dtr_backward (BACKWARD), the waits of dtr_dp_finish and
 *  dtr_dp_step_done (COMM: exposed communication, not hidden behind backward), the
 *  optimizer step (OPTIMIZER). Time outside every marked phase counts as FORWARD (the
 *  forward pass, the loss, and whatever else the application does in the step).
 *  CHECKPOINT is marked by the application (dtr_metrics_phase_begin) or the checkpoint code. */
typedef enum dtr_phase {
    DTR_PHASE_DATA = 0,
    DTR_PHASE_FORWARD = 1,
    DTR_PHASE_BACKWARD = 2,
    DTR_PHASE_COMM = 3,
    DTR_PHASE_OPTIMIZER = 4,
    DTR_PHASE_CHECKPOINT = 5,
    DTR_PHASE_COUNT = 6
} dtr_phase;

/** One step's metrics, as the callback receives them and the JSON line holds them. */
typedef struct dtr_step_metrics {
    int32_t rank;
    int64_t step, epoch;
    double loss;                      /**< as the application reported it */
    double lr;                        /**< the optimizer's last learning rate (or the app's) */
    double grad_norm;                 /**< the gradient norm before clipping; -1: not measured */
    int64_t samples, tokens;          /**< in this step, on this rank */
    double samples_per_s, tokens_per_s;
    double time_step;                 /**< seconds */
    double time[DTR_PHASE_COUNT];     /**< seconds per phase (dtr_phase); they sum to time_step */
    double flops;                     /**< forward and backward FLOPs of the ops run in the step */
    double mfu;                       /**< flops / time_step / peak_flops; 0 without a peak */
    int skipped;                      /**< the app skipped the update (non-finite loss ...) */
    double comm_wait;                 /**< seconds this rank waited at collectives (within COMM) */
} dtr_step_metrics;

/** Receives each step's metrics (from dtr_metrics_step_end, on its thread). */
typedef void (*dtr_metrics_fn)(void *user, const dtr_step_metrics *s);

/** Settings of a dtr_metrics. Zero means default; make it with dtr_metrics_config_init. */
typedef struct dtr_metrics_config {
    int32_t rank;                 /**< written into every record and the trace's process row */
    dtr_metrics_fn callback;      /**< each step's metrics (may be NULL) */
    void *user;
    const char *jsonl_path;       /**< append one JSON object per step to this file (NULL: none);
                                       flushed at most once a second and by dtr_metrics_destroy */
    const char *trace_path;       /**< Chrome trace-event JSON written by dtr_metrics_write_trace
                                       and dtr_metrics_destroy (NULL: no timeline, no cost) */
    size_t trace_events;          /**< ring capacity in events (0: 65536); the newest are kept */
    double peak_flops;            /**< FLOP/s the hardware can do, for mfu (0: mfu is 0) */
    int grad_norm;                /**< 1: the optimizer measures the gradient norm every step
                                       (one pass over the gradients; free with clip_norm) */
    int64_t first_step;           /**< number of the first step (a resumed run's step) */
} dtr_metrics_config;

/** What the application tells dtr_metrics_step_end about the step; zero fields are unknown. */
typedef struct dtr_step_info {
    double loss;
    int64_t samples, tokens, epoch;
    int skipped;
    double lr;                    /**< 0: the optimizer's */
    double grad_norm;             /**< 0: the optimizer's (when measured) */
} dtr_step_info;

/** Straggler report (dtr_metrics_stragglers): who arrived last at the collectives. */
typedef struct dtr_straggler_report {
    int64_t steps;                /**< steps compared (the last ones every rank recorded) */
    int32_t slowest_rank;         /**< the rank that arrived last most often (-1: no data) */
    int64_t slowest_count;        /**< in how many of those steps */
    double slowest_wait_s;        /**< its mean wait per step (small: the others waited for it) */
    double others_wait_s;         /**< the other ranks' mean wait per step */
} dtr_straggler_report;

typedef struct dtr_metrics dtr_metrics;

/** Defaults: no callback, no file, no trace, 65536 trace events.
 *  Thread safety: thread safe. */
DTR_API dtr_metrics_config dtr_metrics_config_init(void);

/** Starts observing `ctx`: from now on its ops count FLOPs (and, with a trace path, record
 *  spans), and the library marks the phases it runs. One dtr_metrics per context.
 *  @param ctx the context to observe.  @param cfg settings (NULL: defaults).
 *  @param out receives the handle.
 *  @return DTR_OK; DTR_BAD_STATE when ctx is already observed; DTR_IO_ERROR when the JSON
 *  lines file cannot be opened; DTR_OUT_OF_MEMORY.
 *  Thread safety: the context's thread. */
DTR_API dtr_result dtr_metrics_create(dtr_context *ctx, const dtr_metrics_config *cfg, dtr_metrics **out);

/** Writes the trace (when configured), closes the file, detaches from the context. Call it
 *  before dtr_context_destroy of its context.
 *  Thread safety: the context's thread. */
DTR_API void dtr_metrics_destroy(dtr_metrics *m);

/** Starts a step now: time since the previous step's end is not counted. Optional (without
 *  it a step starts where the previous one ended, or at dtr_metrics_create).
 *  Thread safety: the context's thread. */
DTR_API dtr_result dtr_metrics_step_begin(dtr_metrics *m);

/** Ends the step: fills *out (may be NULL), calls the callback, appends the JSON line.
 *  @param info what the app knows (loss, samples ...; NULL: nothing).
 *  @return DTR_OK; DTR_IO_ERROR when the line cannot be written.
 *  Thread safety: the context's thread. */
DTR_API dtr_result dtr_metrics_step_end(dtr_metrics *m, const dtr_step_info *info, dtr_step_metrics *out);

/** Marks a phase the library does not mark itself (a checkpoint, a data wait of the app's
 *  own loader); phases nest (at most 8 deep) and the innermost one owns the time.
 *  @return DTR_OK; DTR_INVALID_ARGUMENT for a phase outside dtr_phase; DTR_BAD_STATE when
 *  nested too deep or when _end does not match the innermost _begin.
 *  Thread safety: the context's thread. */
DTR_API dtr_result dtr_metrics_phase_begin(dtr_metrics *m, dtr_phase phase);
/** Ends the innermost phase, which must be `phase`. Thread safety: the context's thread. */
DTR_API dtr_result dtr_metrics_phase_end(dtr_metrics *m, dtr_phase phase);

/** Lets `loader` mark its waits in dtr_loader_next as DATA on m's context (NULL m: stops).
 *  The loader must be driven from the context's thread.
 *  Thread safety: the context's thread. */
DTR_API dtr_result dtr_metrics_watch_loader(dtr_metrics *m, dtr_loader *loader);

/** Writes the timeline now (Chrome trace-event JSON, atomically) to cfg.trace_path.
 *  @return DTR_OK (also without a trace path: nothing to do); DTR_IO_ERROR.
 *  Thread safety: the context's thread. */
DTR_API dtr_result dtr_metrics_write_trace(dtr_metrics *m);

/** Events dropped because the ring was full (the oldest go first).
 *  Thread safety: the context's thread. */
DTR_API uint64_t dtr_metrics_trace_dropped(const dtr_metrics *m);

/** Collective over `c` (every rank calls it with its own dtr_metrics): gathers the last
 *  (up to 64) steps' collective wait times of every rank and names the rank that arrived
 *  last (waited least) most often.
 *  @param counts receives, per rank of c, in how many steps it was last (may be NULL; else
 *  dtr_comm_size(c) entries).
 *  @return DTR_OK or the all-gather's error.
 *  Thread safety: the context's thread; collective over c. */
DTR_API dtr_result dtr_metrics_stragglers(dtr_metrics *m, dtr_comm *c, dtr_straggler_report *out, int64_t *counts);

/** Merges the per-rank trace files `inputs` (each written by dtr_metrics_write_trace, one
 *  process row per rank) into one file `output` (written atomically). Each input is
 *  checked to be valid JSON with a "traceEvents" array.
 *  @return DTR_OK; DTR_IO_ERROR; DTR_CORRUPT_FILE naming the file; DTR_OUT_OF_MEMORY.
 *  Thread safety: thread safe. */
DTR_API dtr_result dtr_trace_merge(const char *const *inputs, int n, const char *output, char *err, size_t errlen);
