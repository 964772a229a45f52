/* ============================================================================
 * Public API: engines, the parts that train one model together with others. Engines are
 * peers: each attaches to a model and a process group through the same open seams
 * (gradient hooks, backward from any tensor, optimizer steps over a range of the parameter
 * buffer, state accessors), so several can work on one model at once. In this version:
 * data parallel, and tensor-parallel communication on the tape.
 * ==========================================================================*/
#ifdef __cplusplus
extern "C" {
#endif

/* ---- gradient hooks (autograd) ---- */

/** Called on the thread running a backward pass as soon as the gradient of a model parameter
 *  is final for that pass (after the last tape node that writes it, or at once when no node
 *  of the pass will). `ready` completes when the backend has finished writing the gradient
 *  (NULL on the CPU: already written); a consumer on another thread or device waits on it
 *  (dtr_event_wait) before it reads the gradient. Parameters the pass never reaches are not
 *  reported. A non-OK result stops the pass, which returns it. */
typedef dtr_result (*dtr_grad_hook_fn)(void *user, dtr_tensor *param, dtr_event *ready);

/** Adds a gradient hook to a context; hooks run in the order they were added, every engine
 *  that needs gradients as they become final (data parallel, sharded optimizers, parameter
 *  servers) adds its own. Without hooks a backward pass does no extra work. `id` (may be
 *  NULL) receives the hook's id for dtr_context_remove_grad_hook.
 *  @return DTR_OK, DTR_NULL_HANDLE (ctx or fn), DTR_BAD_STATE (8 hooks already).
 *  Thread safety: the context's thread, outside a backward pass. */
DTR_API dtr_result dtr_context_add_grad_hook(dtr_context *ctx, dtr_grad_hook_fn fn, void *user, int *id);
/** Removes the hook `id`. @return DTR_OK, DTR_NULL_HANDLE, DTR_INVALID_ARGUMENT (no such hook).
 *  Thread safety: the context's thread, outside a backward pass. */
DTR_API dtr_result dtr_context_remove_grad_hook(dtr_context *ctx, int id);

/* ---- tensor parallel: communication on the tape ---- */

/** Tensor parallelism's entry into a parallel region (Megatron-LM's f): forward y = x, the
 *  backward all-reduces (sums) the gradient over `comm`. Put it before a column-parallel layer
 *  (each rank holds some output features of the layer): every rank's slice contributed to x's
 *  gradient. Collective in forward order and in backward: every rank of `comm` builds it.
 *  @return y, or NULL with the context's error (NULL input, or the group's failure).
 *  Thread safety: the context's thread; `comm` not used by another thread meanwhile. */
DTR_API dtr_tensor *dtr_tp_copy(dtr_context *ctx, dtr_tensor *x, dtr_comm *comm);
/** Tensor parallelism's exit from a parallel region (Megatron-LM's g): forward y =
 *  all-reduce-sum of x over `comm` (each rank holds a partial sum, e.g. after a row-parallel
 *  layer), backward passes the gradient through unchanged. Collective like dtr_tp_copy.
 *  Thread safety: as dtr_tp_copy. */
DTR_API dtr_tensor *dtr_tp_reduce(dtr_context *ctx, dtr_tensor *x, dtr_comm *comm);

/* ---- data parallel ---- */

/** Data-parallel training of a model replicated on every rank of a group. */
typedef struct dtr_dp dtr_dp;

typedef struct dtr_dp_config {
    size_t bucket_bytes;   /**< gradient bucket size; 0: 25 MiB (as PyTorch DDP) */
    int root;              /**< rank whose parameters are broadcast at creation (default 0) */
} dtr_dp_config;

/** Returns a configuration with every field at its default.
 *  Thread safety: thread safe. */
DTR_API dtr_dp_config dtr_dp_config_init(void);

/** Makes model `m` data parallel over group `c`: builds it, broadcasts its parameters from
 *  the root (collective, blocking), splits the contiguous gradient buffer into buckets of
 *  about bucket_bytes along parameter boundaries (last parameters first, as backward
 *  produces them) and adds a gradient hook to the model's context (dtr_context_add_grad_hook): during
 *  dtr_backward each bucket's all-reduce (average) starts as soon as all its gradients are
 *  final, on the group's progress thread, in bucket order on every rank. On a group of size
 *  1 nothing is installed and every call below returns at once.
 *  Loop: forward, dtr_backward, dtr_dp_finish, dtr_optimizer_step, dtr_context_reset.
 *  @return DTR_OK, DTR_NULL_HANDLE, DTR_INVALID_ARGUMENT (root), DTR_BAD_STATE (the context
 *          has no free hook slot), DTR_UNSUPPORTED (parameters not in host
 *          memory), DTR_OUT_OF_MEMORY, or the broadcast's error.
 *  Thread safety: the model's context thread; collective over c. */
DTR_API dtr_result dtr_dp_create(dtr_model *m, dtr_comm *c, const dtr_dp_config *cfg, dtr_dp **out);
/** Removes the hook and frees the engine (waiting for buckets still in flight). NULL is ignored. */
DTR_API void dtr_dp_destroy(dtr_dp *dp);
/** Gradient accumulation: with no_sync 1 the following backward passes only accumulate into
 *  the local gradient buffer (no communication) and dtr_dp_finish returns at once; set it
 *  back to 0 before the last micro-batch, whose dtr_dp_finish averages the accumulated sums.
 *  Returns DTR_OK, DTR_NULL_HANDLE, or DTR_BAD_STATE while buckets are in flight (between a
 *  synchronised dtr_backward and its dtr_dp_finish; the group's message says so, the
 *  context's status is not touched). */
DTR_API dtr_result dtr_dp_set_no_sync(dtr_dp *dp, int no_sync);
/** Ends a step's communication: starts the buckets that backward did not start (parameters
 *  the pass did not reach) and waits for all of them. Afterwards the gradient buffer holds
 *  the average over the ranks of their gradients, identical bits on every rank.
 *  @return DTR_OK or the first error of a bucket (the group's message names it). */
DTR_API dtr_result dtr_dp_finish(dtr_dp *dp);
/** Broadcasts the parameters from the root again (e.g. after loading a checkpoint on it). */
DTR_API dtr_result dtr_dp_broadcast_params(dtr_dp *dp);
/** Number of gradient buckets, and the [begin, end) float range of bucket i in the gradient
 *  buffer (bucket 0 holds the last parameters). */
DTR_API int dtr_dp_bucket_count(const dtr_dp *dp);
DTR_API dtr_result dtr_dp_bucket_range(const dtr_dp *dp, int i, int64_t *begin, int64_t *end);
/** Number of buckets whose all-reduce was started inside dtr_backward (not by finish) in
 *  the last synchronised step: shows that communication overlapped backward. */
DTR_API int dtr_dp_overlapped_buckets(const dtr_dp *dp);

/** Entry `index` of the engine's state (api.h, "state"): "no_sync" (int). Buckets and
 *  requests last one step and are not state. @return DTR_OK, DTR_NOT_FOUND past the last,
 *  DTR_NULL_HANDLE. Thread safety: the model's context thread. */
DTR_API dtr_result dtr_dp_state(dtr_dp *dp, int index, dtr_state_entry *out);
/** After writing the entries back: checks them. @return DTR_OK, DTR_NULL_HANDLE,
 *  DTR_CORRUPT_FILE. Thread safety: the model's context thread. */
DTR_API dtr_result dtr_dp_state_loaded(dtr_dp *dp);

#ifdef __cplusplus
}
#endif
