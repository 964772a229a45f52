/* ============================================================================
 * Observability hooks (src/obs/): what the core, the loader, the data-parallel engine, the
 * optimizer and the checkpoint code call to mark phases, ops and collectives on the
 * dtr_metrics of a context (ctx->obs). Every call site is guarded by `if (ctx->obs)` (or the
 * loader's own pointer): with no dtr_metrics the cost is that one branch.
 * ==========================================================================*/
#include "../core/internal.h"

#define DTR__OBS_DEPTH 8
#define DTR__OBS_WINDOW 64

/** One trace event in the ring. */
typedef struct dtr__obs_event {
    double t0, t1;
    const char *name;     /* static: an op name or a literal */
    int32_t arg;
    uint8_t cat, tid;
} dtr__obs_event;

/** A dtr_metrics (src/obs/metrics.c; the ring is written by src/obs/trace.c). */
struct dtr_metrics {
    dtr_context *ctx;
    dtr_metrics_config cfg;
    FILE *jsonl;
    double flushed;       /* when the JSON lines were last flushed */
    char *jsonl_path, *trace_path;
    int64_t step;
    double t_begin, t_last;
    int stack[DTR__OBS_DEPTH];
    double stack_t0[DTR__OBS_DEPTH];
    int depth;
    double phase[DTR_PHASE_COUNT];
    double flops, comm_wait, lr, grad_norm;
    /* straggler window: the last steps' collective waits */
    double waits[DTR__OBS_WINDOW];
    int64_t nwaits;
    /* timeline ring (NULL without a trace path) */
    dtr__obs_event *ring;
    size_t cap, head, count;
    uint64_t dropped;
};

/** Trace categories of a span (its "cat" in the trace file). */
enum { DTR__OBS_FORWARD = 0, DTR__OBS_BACKWARD, DTR__OBS_COMM, DTR__OBS_PHASE, DTR__OBS_CAT_COUNT };

/** Monotonic seconds (dtr_time_ns: one time base for every process on a host). */
DTR__PRIVATE double dtr__obs_now(void);
/** Enters / leaves phase `phase` (dtr_phase) at time t: the time since the last mark goes
 *  to the phase that was innermost. Unbalanced or too deep marks are ignored. */
DTR__PRIVATE void dtr__obs_enter(struct dtr_metrics *m, int phase, double t);
DTR__PRIVATE void dtr__obs_leave(struct dtr_metrics *m, int phase, double t);
/** An op's forward (bwd 0) or backward kernel ran from t0 to t1: counts its FLOPs and,
 *  with a timeline, records its span. */
DTR__PRIVATE void dtr__obs_op(struct dtr_metrics *m, const dtr__node *n, int bwd, double t0, double t1);
/** A span on trace row `tid` (0: the context's thread; 1 + k: collective k's row) with a
 *  static name, a category (DTR__OBS_*) and an integer argument (-1: none). */
DTR__PRIVATE void dtr__obs_span(struct dtr_metrics *m, const char *name, int cat, int tid, int arg, double t0,
                                double t1);
/** This rank waited `secs` at a collective (the straggler report compares these). */
DTR__PRIVATE void dtr__obs_comm_wait(struct dtr_metrics *m, double secs);
/** The optimizer stepped with learning rate lr and gradient norm `norm` (< 0: unknown). */
DTR__PRIVATE void dtr__obs_optimizer(struct dtr_metrics *m, double lr, double norm);
/** 1 when the optimizer should measure the gradient norm for m. */
DTR__PRIVATE int dtr__obs_wants_grad_norm(const struct dtr_metrics *m);
/** For code that has a context but not the metrics (the checkpoint writer): enters /
 *  leaves `phase` on ctx's dtr_metrics when there is one, now. */
DTR__PRIVATE void dtr__obs_phase_begin(dtr_context *ctx, int phase);
DTR__PRIVATE void dtr__obs_phase_end(dtr_context *ctx, int phase);
/** Sets the dtr_metrics a loader reports its waits to (src/data/loader.c). */
DTR__PRIVATE void dtr__loader_set_obs(dtr_loader *l, struct dtr_metrics *m);
