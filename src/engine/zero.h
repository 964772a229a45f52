/* ============================================================================
 * ZeRO of the data-parallel engine (src/engine/zero.c), private to
 * src/engine/data_parallel.c: the shards of the parameter buffer, the reduce-scatter of
 * gradient slices to their owners, and the gather of the updated shards; stage 3's units of
 * parameters gathered on demand.
 * ==========================================================================*/

typedef struct dtr__zero dtr__zero;

/** The shards of model m over group c for cfg.zero (1 or 2), with the receive buffer for the
 *  peers' slices of this rank's shard. nb: the engine's bucket count. dev: the gradient
 *  buffers handed to it are device memory (a device transport), the slots then too.
 *  @return DTR_OK or DTR_OUT_OF_MEMORY (the context's message says so). */
DTR__PRIVATE dtr_result dtr__zero_create(dtr_model *m, dtr_comm *c, const dtr_dp_config *cfg, int nb, int dev, dtr__zero **out);
/** Waits for requests still in flight and frees. NULL is ignored. */
DTR__PRIVATE void dtr__zero_destroy(dtr__zero *z);
/** Bucket i ([begin, end) of the gradient buffer g, host memory; stage 1: 0 and the whole
 *  buffer) is final: sends each of its slices that another rank owns to that rank and posts
 *  the receives of the peers' slices of this rank's shard (point-to-point, tag per bucket). */
DTR__PRIVATE dtr_result dtr__zero_start(dtr__zero *z, float *g, int i, int64_t begin, int64_t end);
/** After every bucket started: waits for the exchange and writes the average over
 *  the ranks (summed in rank order, divided by the group's size) into this rank's shard of
 *  the gradient buffer g (the one the buckets started from); adds the bytes sent to st. */
DTR__PRIVATE dtr_result dtr__zero_reduce(dtr__zero *z, float *g, dtr_dp_stats *st);
/** Every rank's shard of the parameter buffer prm (host memory, the model's parameters or a
 *  copy holding this rank's shard) from the rank that updated it (collective). */
DTR__PRIVATE dtr_result dtr__zero_gather(dtr__zero *z, float *prm, dtr_dp_stats *st);
/** This rank's shard, [*begin, *end) floats. */
DTR__PRIVATE void dtr__zero_shard(const dtr__zero *z, int64_t *begin, int64_t *end);
/** dtr_optimizer_config.shard_sum: sums n doubles over the group (an all-gather
 *  of the bytes, added in rank order: the same bits on every rank). user: the dtr__zero. */
DTR__PRIVATE dtr_result dtr__zero_sum(void *user, double *vals, int n);
/** Stage 3: the units of parameters gathered together (unit of parameter p: param_unit[p],
 *  kept by the caller; each unit a run of consecutive parameters), every one released now
 *  (a rank keeps the values of its shard); installs the context's param_fetch. keep: gathered units kept besides
 *  the running op's. st: the engine's counters (param_gathers, param_bytes_peak, bytes).
 *  @return DTR_OK, DTR_OUT_OF_MEMORY, DTR_BAD_STATE (another engine's param_fetch). */
DTR__PRIVATE dtr_result dtr__zero3_start(dtr__zero *z, int nu, const int *param_unit, int keep, dtr_dp_stats *st);
/** Stage 3: releases unit i (its gradients are final) unless pinned. */
DTR__PRIVATE void dtr__zero3_release(dtr__zero *z, int i);
/** Stage 3: unpins and releases every unit (after the step: the other shards changed).
 *  written 1: the whole buffer was just written (a restore): every unit's memory is released. */
DTR__PRIVATE void dtr__zero3_release_all(dtr__zero *z, int written);
/** Stage 3: gathers every unit not held and pins them all until release_all (collective). */
DTR__PRIVATE dtr_result dtr__zero3_gather_all(dtr__zero *z);
/** Stages 2 and 3 releasing gradients (dtr__zero_releases_grads): the buckets whose slices
 *  have all been sent (in start order; all: every started one, after the wait) have their
 *  gradients outside the shard discarded from g (they read as zeros, their memory back to the
 *  system). Otherwise nothing. */
DTR__PRIVATE void dtr__zero_grads_sent(dtr__zero *z, float *g, int all);
/** 1 when cfg's ZeRO gives the gradients outside the shard back once sent: stage 3 unless
 *  zero3_keep_grads, stage 2 with zero2_release_grads. */
static inline int dtr__zero_releases_grads(const dtr_dp_config *cfg) {
    return (cfg->zero == 3 && !cfg->zero3_keep_grads) || (cfg->zero == 2 && cfg->zero2_release_grads);
}
