/* ============================================================================
 * Public API: engines, the parts that train one model together with others. Engines are
 * peers: each attaches to a model and a process group through the same open seams
 * (gradient hooks, backward from any tensor, optimizer steps over a range of the parameter
 * buffer, state accessors), so several can work on one model at once. In this version:
 * data parallel, pipeline parallel, tensor-parallel communication on the tape, and
 * parameter servers.
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

/* ---- activation checkpointing (recompute) ---- */

/** A region of the forward pass for dtr_checkpoint: builds its output from `in` (the inputs
 *  given to dtr_checkpoint, in order) with ordinary ops on `ctx` and returns it, or returns
 *  NULL with the context's error set. It may read model parameters and other tensors through
 *  `user`. It runs once in forward and once more in backward, so it must build the same ops
 *  from the same tensors each time (dropout draws the same masks: the random stream is
 *  replayed) and have no other side effects that matter. */
typedef dtr_tensor *(*dtr_checkpoint_fn)(void *user, dtr_context *ctx, dtr_tensor *const *in);

/** Activation checkpointing: runs `fn` (a GPT block, a pipeline stage) and keeps only its
 *  output; the activations inside the region are dropped at once and recomputed during
 *  backward, so a checkpointed layer holds only its inputs and output between forward and
 *  backward. Gradients are the same bits as without it, dropout included (the recomputation
 *  replays the context's random stream and training mode from the forward). The region is one
 *  node of the current tape that writes the gradients of every parameter and tensor the
 *  region read, so gradient hooks (dtr_dp's bucketed all-reduce) report a parameter only after
 *  it, and it works in each micro-batch of a pipeline (dtr_pipe) the same way. A region may
 *  hold tensor-parallel collectives (dtr_tp_copy, dtr_tp_reduce): every rank recomputes them
 *  at the same point of its backward (they run twice). Regions may nest up to 4 deep. With
 *  gradient recording off it just calls fn.
 *  fn must not return one of its inputs or a parameter unchanged, nor create tensors that
 *  require gradients (dtr_tensor_requires_grad) inside the region.
 *  @param fn    the region; @param user handed to fn;
 *  @param n_in  number of inputs, 0 to 64; @param in  the inputs (may be NULL when n_in is 0).
 *  @return the region's output (a new tensor of the current tape), or NULL with the context's
 *          error: DTR_NULL_HANDLE (fn, in or an input NULL), DTR_INVALID_ARGUMENT (n_in out of
 *          range, an input of another context, fn returned NULL without an error or returned
 *          a tensor it did not compute, a tensor made to require gradients inside), DTR_BAD_STATE (nested deeper than 4), or fn's error.
 *          In backward, a region that builds a different graph the second time fails the pass.
 *  Thread safety: the context's thread. */
DTR_API dtr_tensor *dtr_checkpoint(dtr_context *ctx, dtr_checkpoint_fn fn, void *user, int n_in, dtr_tensor *const *in);

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
/** Every rank's x (..., w) joined along the last axis in rank order: (..., w * group size),
 *  the same on every rank (all-gather); backward adds this rank's slice of the gradient to
 *  x's, without communication. What a column-parallel layer's gathered output uses.
 *  Collective like dtr_tp_copy. @return y, or NULL with the context's error (NULL input or
 *  comm, a 0-dim x: DTR_SHAPE_MISMATCH, the group's failure).
 *  Thread safety: as dtr_tp_copy. */
DTR_API dtr_tensor *dtr_tp_gather(dtr_context *ctx, dtr_tensor *x, dtr_comm *comm);

/** Mean cross-entropy of logits whose vocabulary (last axis) is split over `comm`: rank r
 *  holds `logits` (..., K) for classes r * K .. (r + 1) * K - 1 (the output of a
 *  column-parallel head without gather); `targets` are i32 global class indices (...),
 *  the same on every rank. The value equals dtr_cross_entropy over the full logits: the row
 *  max is all-reduced (MAX), the sum of exponentials and the target logit (from the rank
 *  that owns it) are all-reduced (SUM). Backward: softmax_shard - onehot_shard, scaled by the
 *  upstream gradient over the row count, with no communication. Collective like dtr_tp_copy.
 *  @return the scalar loss (the same on every rank), or NULL with the context's error:
 *  DTR_NULL_HANDLE (comm, input), DTR_DTYPE_MISMATCH, DTR_SHAPE_MISMATCH (row counts),
 *  DTR_INVALID_ARGUMENT (a target outside [0, K * group size)), the group's failure.
 *  Thread safety: as dtr_tp_copy. */
DTR_API dtr_tensor *dtr_vocab_parallel_cross_entropy(dtr_context *ctx, dtr_tensor *logits, dtr_tensor *targets,
                                                     dtr_comm *comm);
/** dtr_vocab_parallel_cross_entropy with dtr_cross_entropy_ex's settings (cfg NULL: the
 *  defaults): targets equal to cfg->ignore_index add nothing and get no gradient (padding
 *  tokens; every row ignored: 0), label smoothing over the whole vocabulary (each rank's logit
 *  sums join the one all-reduce), and the reduction (DTR_LOSS_NONE: each row's loss, in the
 *  targets' shape). The same values as dtr_cross_entropy_ex over the full logits. @return as
 *  dtr_vocab_parallel_cross_entropy's, and DTR_INVALID_ARGUMENT (smoothing outside [0, 1), an
 *  unknown reduction). Thread safety: as dtr_tp_copy. */
DTR_API dtr_tensor *dtr_vocab_parallel_cross_entropy_ex(dtr_context *ctx, dtr_tensor *logits, dtr_tensor *targets, dtr_comm *comm,
                                                        const dtr_xent_config *cfg);

/* ---- tensor parallel: layers (Megatron-LM) ----
 * Each layer splits its weights over the ranks of a tensor-parallel group `comm` (size tp):
 * every rank declares the same parameter names as the single-device layer (dtr_linear_layer,
 * dtr_attention_layer, dtr_embedding_layer, dtr_gpt_block) with its shard's shape, in the
 * same order. dtr_model_build initialises each shard as the slice of the full tensor that a
 * single-device model with the same seed draws, so both runs start from the same weights;
 * dtr_model_save gathers the shards into one file of full tensors (collective) that a
 * single-device model loads, and dtr_model_load of such a file keeps each rank's slice.
 * Replicated parameters (layer norms, the row-parallel bias) get identical gradients on every
 * rank without further communication. Sizes that do not divide by tp are
 * DTR_INVALID_ARGUMENT. Every rank must run the same forward (the layers are collectives). */

/** A linear layer split over a tensor-parallel group. Column-parallel: weight rows (output
 *  features) out / tp per rank, rank r holding features r * out / tp ..; input full,
 *  output (..., out / tp), or (..., out) with `gather`. Row-parallel: weight columns (input
 *  features) in / tp per rank; input (..., in / tp) (a column-parallel output), output
 *  (..., out) summed over the group, plus the full bias (replicated). */
typedef struct dtr_tp_linear {
    dtr_tensor *weight, *bias; /**< this rank's shard; bias NULL without one */
    int64_t in, out;           /**< the full layer's sizes */
    int row;                   /**< 1: row-parallel, 0: column-parallel */
    int gather;                /**< column-parallel: the forward returns the full output */
    dtr_comm *comm;            /**< the tensor-parallel group */
    int parts;                 /**< blocks of the split axis sharded each (3: attention's q, k and v) */
    dtr_tensor *lora_a, *lora_b;   /**< a LoRA adapter (dtr_tp_linear_add_lora): this rank's part; or NULL */
    float lora_scale;          /**< alpha / rank */
    float lora_dropout;        /**< dropout on the adapter's input while training (0 by default) */
} dtr_tp_linear;

/** Declares a column-parallel linear layer `name` (weight (out, in) and bias (out) of the full
 *  layer, as dtr_linear_layer_init) on m; rank r keeps rows r * out / tp .. of both.
 *  `gather` 1 makes the forward return the full output on every rank.
 *  @return DTR_OK, DTR_NULL_HANDLE (l, m or comm), DTR_INVALID_ARGUMENT (sizes, out % tp),
 *  or the model's error. Thread safety: the model's context thread. */
DTR_API dtr_result dtr_tp_column_linear_init(dtr_tp_linear *l, dtr_model *m, dtr_comm *comm, const char *name,
                                             int64_t in, int64_t out, int bias, dtr_init init, int gather);
/** Declares a row-parallel linear layer `name`: rank r keeps weight columns r * in / tp ..;
 *  the bias (out) is whole on every rank. @return as dtr_tp_column_linear_init (in % tp).
 *  Thread safety: the model's context thread. */
DTR_API dtr_result dtr_tp_row_linear_init(dtr_tp_linear *l, dtr_model *m, dtr_comm *comm, const char *name,
                                          int64_t in, int64_t out, int bias, dtr_init init);
/** Adds a LoRA adapter of `rank` and `alpha` to a tensor-parallel linear layer of m, before
 *  dtr_model_build, split as the layer is (Megatron's LoRA): column-parallel, A "<name>.lora_A.weight"
 *  (rank, in) whole on every rank and B "<name>.lora_B.weight" (out, rank) sharded as the
 *  weight's rows; row-parallel, A sharded as the weight's columns and B whole. Initialised and
 *  saved as dtr_linear_layer_add_lora's full tensors: a file trained on tp ranks loads into the
 *  single-device layers, and back. The forward adds (alpha / rank) (x A^T) B^T with one more
 *  collective of rank-wide rows: column-parallel, x A^T's gradient summed over the group in
 *  backward; row-parallel, x A_r^T summed in forward. Set layer->lora_dropout after this call:
 *  with every rank's context on the same seed, the ranks draw one device's mask (column-parallel,
 *  the same on every rank; row-parallel, each rank its columns of it). @return as
 *  dtr_linear_layer_add_lora. Thread safety: the model's context thread. */
DTR_API dtr_result dtr_tp_linear_add_lora(dtr_tp_linear *layer, dtr_model *m, int rank, float alpha);
/** Folds this rank's part of the adapter into its shard of the weight (W_r += (alpha / rank)
 *  B_r A, or B A_r) and sets B to zero: local, no communication. @return as
 *  dtr_linear_layer_merge_lora. Thread safety: the model's context thread. */
DTR_API dtr_result dtr_tp_linear_merge_lora(dtr_tp_linear *layer);
/** Column: linear(dtr_tp_copy(x), W_shard, b_shard), then (gather) dtr_tp_gather. Row: dtr_tp_reduce(x W_shard^T) +
 *  bias. With an adapter (dtr_tp_linear_add_lora) its product is added before the gather. @return the output or NULL with the context's error. Collective over l->comm.
 *  Thread safety: the context's thread; the group not used by another thread meanwhile. */
DTR_API dtr_tensor *dtr_tp_linear_forward(dtr_context *ctx, const dtr_tp_linear *l, dtr_tensor *x);

/** Self-attention with its heads split over the group: rank r computes heads
 *  r * heads / tp .. with a column-parallel qkv (its rows of the q, k and v blocks) and a
 *  row-parallel proj. Parameters, `causal` and the dropouts as dtr_attention_layer's: each rank
 *  draws its heads' share of the weights' mask one device would draw (mask_heads), and the
 *  output's dropout, after the reduce, is replicated; with every rank's context on the same
 *  seed, training with dropout gives one device's masks and values. */
typedef struct dtr_tp_attention {
    dtr_tp_linear qkv, proj;
    int64_t dim;
    int heads, local_heads;    /**< all heads, and this rank's (heads / tp) */
    int causal;                /**< 1 (init's): causal; 0: every position sees every other */
    float dropout;             /**< on the attention weights while training; 0 from init */
    float resid_dropout;       /**< on the output while training; 0 from init */
} dtr_tp_attention;

/** Declares the attention `name` on m. @return DTR_OK, DTR_NULL_HANDLE, DTR_INVALID_ARGUMENT
 *  (heads not dividing dim, or tp not dividing heads: the message names both), or the
 *  model's error. Thread safety: the model's context thread. */
DTR_API dtr_result dtr_tp_attention_init(dtr_tp_attention *a, dtr_model *m, dtr_comm *comm, const char *name, int64_t dim,
                                         int heads);
/** x (B, T, C), the same on every rank -> (B, T, C), the same on every rank. Collective.
 *  Thread safety: as dtr_tp_linear_forward. */
DTR_API dtr_tensor *dtr_tp_attention_forward(dtr_context *ctx, const dtr_tp_attention *a, dtr_tensor *x);
/** dtr_tp_attention_forward through this rank's KV cache (generation, as
 *  dtr_attention_layer_forward_cached): each rank caches its own heads' keys and values, so its
 *  cache's width is dim / tp (dim / heads * local_heads). Collective.
 *  Thread safety: as dtr_tp_linear_forward. */
DTR_API dtr_tensor *dtr_tp_attention_forward_cached(dtr_context *ctx, const dtr_tp_attention *a, dtr_tensor *x,
                                                    dtr_kv_cache *cache, int layer);

/** Vocabulary-parallel embedding: rank r holds table rows r * vocab / tp .. */
typedef struct dtr_tp_embedding {
    dtr_tensor *weight;        /**< (vocab / tp, dim) */
    int64_t vocab, dim, start; /**< full sizes; the first row held here */
    dtr_comm *comm;
} dtr_tp_embedding;

/** Declares the embedding `name` (weight (vocab, dim) of the full table, as
 *  dtr_embedding_layer_init). @return DTR_OK, DTR_NULL_HANDLE, DTR_INVALID_ARGUMENT (sizes,
 *  vocab % tp), or the model's error. Thread safety: the model's context thread. */
DTR_API dtr_result dtr_tp_embedding_init(dtr_tp_embedding *e, dtr_model *m, dtr_comm *comm, const char *name, int64_t vocab,
                                         int64_t dim);
/** Rows of the full table for i32 `ids` (any shape S, the same on every rank): each rank
 *  looks up the ids it holds (zero rows for the others), then dtr_tp_reduce sums them.
 *  An id outside [0, vocab) is DTR_INVALID_ARGUMENT. Collective.
 *  Thread safety: as dtr_tp_linear_forward. */
DTR_API dtr_tensor *dtr_tp_embedding_forward(dtr_context *ctx, const dtr_tp_embedding *e, dtr_tensor *ids);

/** A GPT block (pre-norm) with its attention and MLP split over the group: ln1, tensor-parallel
 *  attention, ln2, column-parallel fc, gelu, row-parallel fc_proj. Parameters and `dropout` as
 *  dtr_gpt_block's (same names and order), the layer norms replicated. */
typedef struct dtr_tp_gpt_block {
    dtr_layernorm_layer ln1, ln2;
    dtr_tp_attention attn;
    dtr_tp_linear fc, fc_proj;
    float dropout;
} dtr_tp_gpt_block;

/** Declares the block `name` on m. @return as dtr_tp_attention_init.
 *  Thread safety: the model's context thread. */
DTR_API dtr_result dtr_tp_gpt_block_init(dtr_tp_gpt_block *b, dtr_model *m, dtr_comm *comm, const char *name, int64_t dim,
                                         int heads);
/** x (B, T, C) -> (B, T, C), as dtr_gpt_block_forward. Collective.
 *  Thread safety: as dtr_tp_linear_forward. */
DTR_API dtr_tensor *dtr_tp_gpt_block_forward(dtr_context *ctx, const dtr_tp_gpt_block *b, dtr_tensor *x);
/** dtr_tp_gpt_block_forward through this rank's KV cache (its heads' keys and values, width
 *  dim / tp; as dtr_gpt_block_forward_cached). Collective.
 *  Thread safety: as dtr_tp_linear_forward. */
DTR_API dtr_tensor *dtr_tp_gpt_block_forward_cached(dtr_context *ctx, const dtr_tp_gpt_block *b, dtr_tensor *x,
                                                    dtr_kv_cache *cache, int layer);

/* ---- data parallel ---- */

/** Data-parallel training of a model replicated on every rank of a group. */
typedef struct dtr_dp dtr_dp;
/** Pipeline-parallel training: a model's layers split into stages over the ranks of a group. */
typedef struct dtr_pipe dtr_pipe;

/** How the data-parallel engine puts gradients on the wire (docs/distributed.md, "Gradient
 *  compression"). Each bucket is compressed on its own; every rank ends with identical bits.
 *  Error bounds are per element, for one step, with acc_r = rank r's gradient plus its residual:
 *  - NONE: f32 all-reduce (average).
 *  - BF16, FP16: all-reduce in that dtype (summed in f32, rounded once): |error| <= 2^-7 (bf16)
 *    or 2^-10 (fp16) times max_r |g_r|, plus 2^-24 for fp16's subnormals; fp16 overflows above
 *    65504. No error feedback.
 *  - INT8: each rank sends one f32 scale (max |acc_r| / 127) and n bytes, all-gathered and
 *    summed in rank order: |error| <= max_r scale_r / 2.
 *  - TOPK: each rank sends the topk_ratio * n entries of acc_r largest in magnitude (index
 *    and value, 8 bytes each), all-gathered and summed in rank order; entries not sent
 *    stay in the residual: sent + residual == acc_r exactly.
 *  - POWERSGD: each parameter with 2 or more dimensions in the bucket, as a (rows, rest)
 *    matrix M, is sent as rank-r factors P = M Q (averaged during backward) and
 *    Q = M^T P (averaged in dtr_dp_finish, after orthonormalising P): rows * r + cols * r
 *    floats instead of rows * cols; the other parameters are averaged exactly. A gradient of
 *    rank <= powersgd_rank comes back exact; averaged residual + result == averaged acc.
 *  INT8, TOPK and POWERSGD carry the error in a residual per rank (error feedback), added
 *  to the next step's gradient. */
typedef enum dtr_dp_compress {
    DTR_COMPRESS_NONE = 0,
    DTR_COMPRESS_BF16 = 1,
    DTR_COMPRESS_FP16 = 2,
    DTR_COMPRESS_INT8 = 3,
    DTR_COMPRESS_TOPK = 4,
    DTR_COMPRESS_POWERSGD = 5
} dtr_dp_compress;

typedef struct dtr_dp_config {
    size_t bucket_bytes;   /**< gradient bucket size; 0: 25 MiB (as PyTorch DDP) */
    int root;              /**< rank whose parameters are broadcast at creation (default 0) */
    dtr_dp_compress compress;   /**< gradient compression (default none) */
    float topk_ratio;      /**< TOPK: fraction of each bucket's entries sent; 0: 0.01 */
    int powersgd_rank;     /**< POWERSGD: rank r of the factors; 0: 4 */
    int no_error_feedback; /**< 1: drop what INT8/TOPK/POWERSGD lose instead of carrying it */
    int local_sgd_every;   /**< H > 0: local SGD, parameters averaged every H optimizer steps
                                (dtr_dp_step_done) and gradients not synchronised; 0: off */
    int64_t local_sgd_warmup;   /**< local SGD: steps of ordinary DP first (post-local SGD) */
    int zero;              /**< ZeRO (docs/distributed.md, "ZeRO"), a sharded optimizer: each rank
                                updates only its shard of the parameters and keeps optimizer state
                                for it only (create the optimizer from dtr_dp_shard_optimizer);
                                dtr_dp_step_done gathers the shards. The gradients are reduce-
                                scattered (a reduce-scatter's volume, half an all-reduce's): a rank
                                ends with the average of its shard's gradients only. 1: ZeRO-1, the
                                whole buffer's slices sent in dtr_dp_finish. 2: ZeRO-2, each
                                bucket's slices sent during backward (overlapped). 3: ZeRO-3, as 2
                                and the parameters sharded too: after the step a rank keeps only its
                                shard; each bucket is a unit gathered from its owners when an op first
                                reads one of its parameters (forward or backward) and released when
                                its gradients are final or when zero3_units others are newer (the
                                memory of a released unit goes back to the system: Linux, host
                                models; docs/distributed.md, "ZeRO-3"). 0: off. Compress BF16 / FP16 send the gradient slices in 16 bits
                                (the parameters' gather stays f32), the other codecs and local SGD are refused.
                                ZeRO's point-to-point messages on the group use tags 2^30 - 1
                                to 2^30 + the bucket count: keep the application's apart */
    int zero_whole_params; /**< ZeRO: 1 makes each shard a run of whole parameters (shards then
                                follow the parameter sizes; LAMB needs no sum over the shards
                                for its trust ratios); 0: equal shards (16-float aligned) */
    int zero3_units;       /**< ZeRO-3: gathered units kept besides those the running op reads
                                (the least recently used is released first); 0: 2 */
    int zero3_keep_grads;  /**< ZeRO-3: 1 keeps the whole gradient buffer's memory, as ZeRO-2 (no
                                page faults when backward writes it again: faster, more memory);
                                0 (default): the gradients outside the shard go back to the system
                                once sent (docs/distributed.md, "ZeRO-3") */
    int zero2_release_grads; /**< ZeRO-2: 1 gives the gradients outside this rank's shard back to the system once
                                their slices are sent, as ZeRO-3 does: a rank holds its shard's gradients
                                between steps and, during backward, those of the buckets not yet sent (host
                                models, Linux; page faults when backward writes them again). 0 (default): the
                                whole gradient buffer stays resident. Other stages: DTR_INVALID_ARGUMENT */
    int find_unused;       /**< 1: parameters no rank's backward reached since the last zero_grad are
                                left out of the optimizer's update, as in one process (their .grad
                                None in PyTorch; DDP's find_unused_parameters): one more all-reduce,
                                of a flag a parameter, in each dtr_dp_finish. 0 (default): every
                                replica updates every trainable parameter with the averaged
                                gradient (zero where no rank reached it) */
} dtr_dp_config;

/** Counters of an engine since dtr_dp_create (this rank). wire_bytes counts the payload this
 *  rank hands to the collectives (an all-reduce of n floats counts 4n, an all-gather the
 *  rank's own part), not the algorithm's factor (a ring all-reduce moves 2 (N-1)/N times
 *  it). */
typedef struct dtr_dp_stats {
    uint64_t wire_bytes;       /**< gradient and parameter payload put on the wire */
    uint64_t raw_bytes;        /**< what f32 all-reduces of the same data would have been */
    int64_t syncs;             /**< gradient synchronisations (dtr_dp_finish that communicated) */
    int64_t steps;             /**< dtr_dp_step_done calls */
    int64_t param_averages;    /**< local SGD parameter averages */
    int64_t param_gathers;     /**< ZeRO-3: units gathered (forward, backward, dtr_dp_gather_params) */
    int64_t param_prefetches;  /**< ZeRO-3: of those, gathers posted ahead of the op that reads the
                                    unit (the units came in the last step's order) */
    uint64_t param_bytes_peak; /**< the most parameter bytes this rank held at once: the whole
                                    model's without ZeRO-3; with it the shard and the gathered
                                    units (set from the first gather on) */
} dtr_dp_stats;

/** Returns a configuration with every field at its default.
 *  Thread safety: thread safe. */
DTR_API dtr_dp_config dtr_dp_config_init(void);

/** Makes model `m` data parallel over group `c`: builds it, broadcasts its parameters from
 *  the root (collective, blocking), splits the contiguous gradient buffer into buckets of
 *  about bucket_bytes along parameter boundaries (last parameters first, as backward
 *  produces them; without ZeRO, frozen parameters (dtr_model_set_trainable) are in no bucket:
 *  never sent, and made again at the next step's first gradient when the trainable set changes)
 *  and adds a gradient hook to the model's context (dtr_context_add_grad_hook): during
 *  dtr_backward each bucket's all-reduce (average) starts as soon as all its gradients are
 *  final, on the group's progress thread, in bucket order on every rank. On a group of size
 *  1 nothing is installed and every call below returns at once. cfg.compress replaces the
 *  f32 all-reduce by a codec (dtr_dp_compress); cfg.local_sgd_every turns on local SGD.
 *  Loop: forward, dtr_backward, dtr_dp_finish, dtr_optimizer_step, dtr_dp_step_done (needed
 *  by local SGD only), dtr_context_reset.
 *  @return DTR_OK, DTR_NULL_HANDLE, DTR_INVALID_ARGUMENT (root, compress, topk_ratio,
 *          powersgd_rank, local_sgd_every or local_sgd_warmup out of range), DTR_BAD_STATE (the context
 *          has no free hook slot, or another engine shards its parameters), DTR_UNSUPPORTED
 *          (ZeRO with compress INT8, TOPK or POWERSGD, or with local SGD; ZeRO-3 of a model
 *          in device memory; compress over a device transport whose backend
 *          cannot stage host buffers), DTR_OUT_OF_MEMORY, or the broadcast's error. A model
 *          in device memory over a host-memory group (libfabric, local) goes through a host
 *          staging buffer of the model's size: every mode works there, the optimizer's state
 *          stays on the device. Over a device-memory group (NCCL) the buckets, ZeRO-1/2's
 *          slices and sums and local SGD's average stay on the device; a codec (it runs on
 *          the host) takes the host staging copy, and the group stages its messages.
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
 *  the pass did not reach) and waits for all of them (with cfg.find_unused, then sums over the
 *  group which parameters some rank's backward reached: the optimizer leaves out the others). Afterwards the gradient buffer holds
 *  the average over the ranks of their gradients, identical bits on every rank (with a
 *  codec: the decoded average, within the codec's bound; PowerSGD's second all-reduce runs
 *  here; with ZeRO-2: only this rank's shard holds the average, summed in rank order, the
 *  rest of the buffer keeps this rank's own gradients; with ZeRO-3 the rest reads as zeros:
 *  each bucket's memory outside the shard went back to the system once its slices were sent,
 *  unless cfg.zero3_keep_grads). During local SGD past its warm-up it returns at once.
 *  @return DTR_OK or the first error of a bucket (the group's message names it).
 *  Thread safety: the model's context thread; collective over the group. */
DTR_API dtr_result dtr_dp_finish(dtr_dp *dp);
/** Tells the engine an optimizer step is done (call it after dtr_optimizer_step). With ZeRO-1/2
 *  it gathers every rank's updated shard of the parameters (one broadcast per rank, from the
 *  rank that owns it), so every rank holds the whole model again; with ZeRO-3 it releases the
 *  gathered units instead (the next forward gathers them); without ZeRO or local
 *  SGD it only counts. Local SGD: During the warm-up (local_sgd_warmup steps) the engine
 *  is ordinary DP; afterwards backward does not synchronise gradients (dtr_dp_finish returns
 *  at once) and every local_sgd_every-th step here averages the parameters over the group
 *  (a blocking f32 all-reduce). With local_sgd_every 1 this is ordinary DP up to rounding.
 *  Optimizer state (momentum) stays local.
 *  @return DTR_OK, DTR_NULL_HANDLE, DTR_BAD_STATE (gradient buckets in flight: the group's
 *          message says so, the context's status is not touched), or the all-reduce's
 *          error (the context's message names it).
 *  Thread safety: the model's context thread; collective over the group. */
DTR_API dtr_result dtr_dp_step_done(dtr_dp *dp);
/** ZeRO-3: gathers every parameter on every rank (collective) and keeps them until the next
 *  dtr_dp_step_done: then the model may be read, saved or evaluated on one rank alone (ops on
 *  sharded parameters gather them, which every rank must do in the same order; reading or
 *  saving a sharded parameter is DTR_BAD_STATE). dtr_ckpt_save calls it when given the
 *  engine. Other stages: DTR_OK at once (every rank holds the whole model).
 *  @return DTR_OK, DTR_NULL_HANDLE, DTR_BAD_STATE (gradient buckets in flight), or the
 *          transport's error (the context's message names it).
 *  Thread safety: the model's context thread; collective over the group. */
DTR_API dtr_result dtr_dp_gather_params(dtr_dp *dp);
/** ZeRO: this rank's shard of the parameter buffer, [*begin, *end) in floats (equal shards,
 *  or whole parameters with cfg.zero_whole_params; may be empty), to give the optimizer as
 *  shard_begin / shard_end. Without
 *  cfg.zero (or on a group of 1): the whole buffer. @return DTR_OK, DTR_NULL_HANDLE.
 *  Thread safety: any thread. */
DTR_API dtr_result dtr_dp_shard(const dtr_dp *dp, int64_t *begin, int64_t *end);
/** ZeRO: fills the shard fields of an optimizer configuration for this rank: shard_begin /
 *  shard_end (dtr_dp_shard) and shard_sum / shard_sum_user (an all-gather over the group:
 *  clip_norm's norm and LAMB's per-parameter norms summed over the shards); without ZeRO
 *  (or on a group of 1) the whole buffer and no shard_sum.
 *  Create the optimizer from it (dtr_optimizer_create); the engine must outlive the
 *  optimizer's steps. With ZeRO-2 only the shard holds averaged gradients: clip through the
 *  optimizer's clip_norm, not dtr_clip_grad_norm (which sees this rank's buffer only).
 *  @return DTR_OK, DTR_NULL_HANDLE. Thread safety: the model's context thread. */
DTR_API dtr_result dtr_dp_shard_optimizer(const dtr_dp *dp, dtr_optimizer_config *oc);
/** Copies the engine's counters (dtr_dp_stats) into *out.
 *  @return DTR_OK or DTR_NULL_HANDLE. Thread safety: the model's context thread. */
DTR_API dtr_result dtr_dp_get_stats(const dtr_dp *dp, dtr_dp_stats *out);
/** Broadcasts the parameters from the root again (e.g. after loading a checkpoint on it). */
DTR_API dtr_result dtr_dp_broadcast_params(dtr_dp *dp);
/** Averages the model's buffers (dtr_model_buffer: batch norm's running statistics) over the
 *  group: each rank's follow its own batches, so call this before evaluating or saving (or
 *  every N steps) for one set of statistics on every rank, from every rank's data (PyTorch's
 *  DDP instead copies rank 0's at each forward). Collective; host staging, small.
 *  @return DTR_OK (also with no buffers or one rank), DTR_NULL_HANDLE, DTR_OUT_OF_MEMORY, the
 *          group's error (DTR_PEER_FAILED, DTR_TIMEOUT). Thread safety: the model's context thread. */
DTR_API dtr_result dtr_dp_average_buffers(dtr_dp *dp);
/** dtr_optimizer_report_metric with the group's mean: each rank gives the metric of its own
 *  part of the evaluation and that part's weight (its sample count; all 1 for a plain mean),
 *  and every rank reports sum(metric * weight) / sum(weight), summed in rank order (the same
 *  bits everywhere), so a plateau schedule drops every rank's rate at the same report and
 *  the replicas stay alike. A rank of weight 0 adds nothing (its metric may be NaN): over a
 *  pipeline's or a grid's whole group the stages without the loss give 0, and every stage's
 *  optimizer gets the last stages' mean. Collective over c.
 *  @return DTR_OK, DTR_NULL_HANDLE, DTR_INVALID_ARGUMENT (a weight < 0 or not finite, or all 0),
 *          the group's error (DTR_PEER_FAILED, DTR_TIMEOUT). Thread safety: the model's context thread. */
DTR_API dtr_result dtr_comm_report_metric(dtr_comm *c, dtr_optimizer *opt, double metric, double weight, dtr_metric_stats *stats);
/** dtr_comm_report_metric over the data-parallel group: every replica's optimizer gets the
 *  replicas' weighted mean. Collective. Thread safety: the model's context thread. */
DTR_API dtr_result dtr_dp_report_metric(dtr_dp *dp, dtr_optimizer *opt, double metric, double weight, dtr_metric_stats *stats);
/** Number of gradient buckets, and the [begin, end) float range of bucket i in the gradient
 *  buffer (bucket 0 holds the last parameters; without ZeRO, frozen parameters' floats are in
 *  none). */
DTR_API int dtr_dp_bucket_count(const dtr_dp *dp);
DTR_API dtr_result dtr_dp_bucket_range(const dtr_dp *dp, int i, int64_t *begin, int64_t *end);
/** Number of buckets whose all-reduce was started inside dtr_backward (not by finish) in
 *  the last synchronised step: shows that communication overlapped backward. */
DTR_API int dtr_dp_overlapped_buckets(const dtr_dp *dp);

/** Entry `index` of the engine's state (api.h, "state"): "no_sync" (int), "steps" (int64:
 *  dtr_dp_step_done calls, local SGD's phase) and, with INT8, TOPK or POWERSGD and error
 *  feedback, "residual" (one float per gradient float). Buckets and requests last one step
 *  and are not state; PowerSGD's warm-start Q is not either (it is rebuilt). @return DTR_OK, DTR_NOT_FOUND past the last,
 *  DTR_NULL_HANDLE. Thread safety: the model's context thread. */
DTR_API dtr_result dtr_dp_state(dtr_dp *dp, int index, dtr_state_entry *out);
/** After writing the entries back: checks them. @return DTR_OK, DTR_NULL_HANDLE,
 *  DTR_CORRUPT_FILE. Thread safety: the model's context thread. */
DTR_API dtr_result dtr_dp_state_loaded(dtr_dp *dp);

/* ---- pipeline parallel ----
 * Each rank of a group holds a stage: some consecutive layers (dtr_model_keep keeps them out
 * of a model declared whole). The micro-batches of a batch flow through the stages; the
 * engine sends activations forward and their gradients back, accumulates the gradients of
 * all micro-batches in the model, and reports the loss of the last stage to every rank.
 * Loop: dtr_model_zero_grad (or the optimizer's), dtr_pipe_step, dtr_optimizer_step,
 * dtr_context_reset. Stage s of S = P * chunks lives on rank s mod P as chunk s / P. */

/** The order in which a rank runs the forwards and backwards of its micro-batches. */
typedef enum dtr_pipe_schedule {
    DTR_PIPE_GPIPE = 0,      /**< every forward, then every backward: M micro-batches of activations alive */
    DTR_PIPE_1F1B = 1,       /**< PipeDream-flush: after P - rank - 1 warm-up forwards, one forward
                                  then one backward; at most P micro-batches alive (default) */
    DTR_PIPE_INTERLEAVED = 2 /**< Megatron-LM's interleaved 1F1B over `chunks` model chunks per
                                  rank: bubble divided by chunks; M must divide by P */
} dtr_pipe_schedule;

/** A stage's forward for one micro-batch, called by dtr_pipe_step with the micro-batch's own
 *  tape current. `input` is the previous stage's output (it requires grad: its gradient goes
 *  back), NULL on stage 0, which reads micro-batch `microbatch` of its data itself. The last
 *  stage returns the micro-batch's loss (a scalar, the mean over its samples); the others
 *  return the activation for the next stage (any shape; f32, bf16 or f16:
 *  it crosses as stored, and the next stage's input has its dtype). NULL (with the context's
 *  error) stops the step. `chunk` is the model chunk of this rank (0 without interleaving). */
typedef dtr_tensor *(*dtr_pipe_forward_fn)(void *user, dtr_context *ctx, int chunk, int microbatch,
                                           dtr_tensor *input);

typedef struct dtr_pipe_config {
    dtr_pipe_schedule schedule; /**< default DTR_PIPE_1F1B */
    int microbatches;           /**< M per batch, 1 to 65536 (default 1) */
    int chunks;                 /**< model chunks per rank: 1 (default), 2 or more with INTERLEAVED */
    int64_t batch;              /**< samples per batch, split into M near-equal contiguous ranges
                                     (dtr_pipe_microbatch_range) whose losses are weighted by their
                                     size; 0: the micro-batches weigh 1/M each */
    dtr_pipe_forward_fn forward;
    void *user;                 /**< passed to forward */
    int tag;                    /**< point-to-point tags tag .. tag + 3 * chunks - 1 are the
                                     engine's (default 1 << 24) */
    dtr_dp *dp;                 /**< optional: the data-parallel engine of this stage's replicas
                                     (a hybrid grid); its all-reduce runs during the last backward */
} dtr_pipe_config;

/** What the last dtr_pipe_step measured on this rank. */
typedef struct dtr_pipe_stats {
    double step_s;          /**< wall time of the step */
    double wait_s;          /**< time blocked receiving activations and gradients */
    double bubble;          /**< wait_s / step_s: the measured idle fraction */
    double bubble_theory;   /**< (P - 1) / (chunks * M + P - 1) */
    int64_t bytes_sent;     /**< activation, header and gradient bytes this rank sent */
    int max_live;           /**< most micro-batches whose activations were alive at once */
} dtr_pipe_stats;

/** A pipeline engine with every field at its default. Thread safety: thread safe. */
DTR_API dtr_pipe_config dtr_pipe_config_init(void);
/** "gpipe", "1f1b", "interleaved"; "?" for others. Thread safety: thread safe. */
DTR_API const char *dtr_pipe_schedule_name(dtr_pipe_schedule s);
/** Makes `m` (this rank's stages) a pipeline stage over group `c` (rank r holds stages r,
 *  r + P, ...). Not collective: nothing is sent until dtr_pipe_step.
 *  @return DTR_OK, DTR_NULL_HANDLE, DTR_INVALID_ARGUMENT (micro-batches, chunks against the
 *  schedule, an interleaved M not divisible by P, a batch smaller than M, tag),
 *  DTR_OUT_OF_MEMORY. Thread safety: the model's context thread. */
DTR_API dtr_result dtr_pipe_create(dtr_model *m, dtr_comm *c, const dtr_pipe_config *cfg, dtr_pipe **out);
/** Frees the engine and its tapes. NULL is ignored. Thread safety: the model's context thread. */
DTR_API void dtr_pipe_destroy(dtr_pipe *p);
/** Runs the forward and backward of every micro-batch of one batch in the schedule's order
 *  (collective over the group: every rank calls it). Gradients accumulate into the model's
 *  gradient buffer, scaled so that they are those of the batch's mean loss; *loss (may be
 *  NULL) receives that loss on every rank. A failing stage aborts the group, and every other
 *  rank returns DTR_PEER_FAILED within the group's deadline; the message names the stage
 *  and micro-batch. @return DTR_OK, or the context's error (the forward's, a malformed
 *  message, the group's failure). Thread safety: the model's context thread. */
DTR_API dtr_result dtr_pipe_step(dtr_pipe *p, float *loss);
/** Samples [*begin, *end) of micro-batch mb when cfg.batch is set.
 *  @return DTR_OK, DTR_NULL_HANDLE, DTR_INVALID_ARGUMENT (mb out of range, batch not set).
 *  Thread safety: any thread. */
DTR_API dtr_result dtr_pipe_microbatch_range(const dtr_pipe *p, int mb, int64_t *begin, int64_t *end);
/** The global stage number of this rank's model chunk `chunk` (-1 out of range), and the
 *  number of stages. Thread safety: any thread. */
DTR_API int dtr_pipe_stage(const dtr_pipe *p, int chunk);
DTR_API int dtr_pipe_stage_count(const dtr_pipe *p);
/** Sets oc's norm_sum so that the stage's optimizer takes the whole model's gradient norm,
 *  summed over the pipeline's ranks (clip_norm, the nonfinite check and the loss scaler then
 *  agree on every stage, as one rank training the whole model would); keeps its other fields.
 *  Call it before dtr_optimizer_create (after dtr_dp_shard_optimizer in a hybrid grid). The
 *  norm is then a collective over the pipeline's group in every optimizer step (tensor-
 *  parallel shards are summed over their own group by the optimizer itself, in every case).
 *  @return DTR_OK, DTR_NULL_HANDLE. Thread safety: the model's context thread. */
DTR_API dtr_result dtr_pipe_optimizer_config(dtr_pipe *p, dtr_optimizer_config *oc);
/** The measurements of the last step. @return DTR_OK, DTR_NULL_HANDLE.
 *  Thread safety: the model's context thread. */
DTR_API dtr_result dtr_pipe_get_stats(const dtr_pipe *p, dtr_pipe_stats *out);

/* ---- hybrid grids ---- */

/** A world laid out as data x pipeline x tensor groups (dtr_grid_create). */
typedef struct dtr_grid {
    dtr_comm *dp, *pp, *tp;        /**< this rank's data, pipeline and tensor groups */
    int dp_rank, pp_rank, tp_rank; /**< this rank's place in each */
    int dp_size, pp_size, tp_size;
} dtr_grid;

/** Lays the `world` group out as dp x pp x tp ranks and makes this rank's three groups with
 *  dtr_comm_split (collective over world: every rank calls it with the same sizes). World
 *  rank r has tensor rank r mod tp (innermost: tensor groups are consecutive ranks, so they
 *  share a host), data rank (r / tp) mod dp and pipeline rank r / (tp * dp). Then the
 *  engines compose: tensor-parallel layers over g.tp, dtr_pipe over g.pp (with cfg.dp from
 *  dtr_dp_create over g.dp). `err` (may be NULL) receives a message on failure.
 *  @return DTR_OK, DTR_NULL_HANDLE, DTR_INVALID_ARGUMENT (dp * pp * tp is not the world's
 *  size, or a size < 1), or the split's error. Thread safety: as a collective over world. */
DTR_API dtr_result dtr_grid_create(dtr_comm *world, int dp, int pp, int tp, dtr_grid *out, char *err, size_t errlen);
/** Destroys the three groups (not the world). NULL is ignored. Thread safety: the groups' thread. */
DTR_API void dtr_grid_destroy(dtr_grid *g);

/* ---- full-state checkpoints (docs/fault-tolerance.md) ----
 * One call saves, one restores everything a run needs to continue bit for bit: the context's
 * random stream, the model (parameters, gradients), the optimizer (step, schedule, moments),
 * the loader's cursor, the data-parallel engine (ZeRO shards included), any object the app
 * adds (augmentation streams, a loss scaler, its own counters) and key/value metadata.
 *
 * Layout: <dir>/step-<8 digits>/ holds one safetensors file per rank
 * ("rank-<5 digits>.safetensors", each state entry a U8 tensor named "<object>/<entry>") and
 * "manifest.json", written LAST by rank 0 once every rank's file is durable: the world size,
 * the model's identity (CRC-32C of its parameter names and shapes), each file's size and
 * CRC-32C, each tensor's size and CRC-32C, the metadata, and the manifest's own checksum.
 * Every file goes through the atomic writer (temporary file, fsync, rename, fsync folder),
 * so a crash at any instant leaves the old checkpoints and maybe a folder without a manifest,
 * which is incomplete and ignored (and removed by the next save). A checkpoint is complete
 * when its manifest exists.
 *
 * Saving is asynchronous by default: dtr_ckpt_save copies every entry into a staging buffer
 * (the only stall of the training loop) and a background thread writes the files. Restoring
 * verifies every file and tensor against the manifest before touching live state: a
 * truncated file, a flipped bit, a missing shard or another model's checkpoint is an error
 * naming the file and tensor, and nothing is loaded.
 *
 * Multi-rank (cfg.comm): every rank calls every function (they are collective); each rank
 * writes its own file; the app's thread and the writer thread use distinct groups
 * (dtr_ckpt_create splits a private one). The folder must be one file system that all ranks
 * see. A checkpoint saved on N ranks restores on M != N ranks for data parallelism (with or
 * without ZeRO): the ZeRO optimizer shards are re-split from the N files, the loader's
 * position is converted to the same number of samples seen (rounded down to a batch), rank
 * r takes old rank r mod N's random streams and app objects, and error-feedback residuals
 * are zeroed. Such a resume continues training but is not bit-exact; a resume on the same
 * world size is. Models that differ between ranks (pipeline stages, tensor shards) restore
 * on the same world size only (DTR_UNSUPPORTED otherwise). */

typedef struct dtr_ckpt dtr_ckpt;

/** What dtr_ckpt_save does when the previous checkpoint is still being written. */
typedef enum dtr_ckpt_busy {
    DTR_CKPT_BUSY_WAIT = 0,   /**< waits for it, then snapshots (default: no checkpoint is lost) */
    DTR_CKPT_BUSY_SKIP = 1    /**< skips this one (*started = 0): training never waits for the disk */
} dtr_ckpt_busy;

/** An application object's state, listed like the library's objects (api.h, "state"):
 *  entry `index`, DTR_NOT_FOUND past the last. */
typedef dtr_result (*dtr_ckpt_state_fn)(void *obj, int index, dtr_state_entry *out);
/** Called after a restore wrote the object's entries back (may be NULL). A failure undoes
 *  the whole restore. */
typedef dtr_result (*dtr_ckpt_loaded_fn)(void *obj);

typedef struct dtr_ckpt_config {
    const char *dir;          /**< the root folder (created when missing; its parent must exist); copied */
    dtr_context *ctx;         /**< required: its random stream is saved; its backend copies device entries */
    dtr_model *model;         /**< may be NULL (then no model identity check) */
    dtr_optimizer *optimizer; /**< may be NULL */
    dtr_loader *loader;       /**< may be NULL */
    dtr_dp *dp;               /**< may be NULL; with ZeRO its shard bounds make world-size changes possible */
    dtr_comm *comm;           /**< NULL: this process alone; else every rank of it takes part */
    int keep;                 /**< complete checkpoints kept, newest first (default 3); < 0: all */
    int sync;                 /**< 1: dtr_ckpt_save writes before it returns (default 0: a background thread) */
    dtr_ckpt_busy busy;       /**< a save while the previous one is still written (default WAIT) */
    int fallback;             /**< 1: restoring the latest, a checkpoint that fails verification is
                                   reported (dtr_ckpt_last_error keeps the first reason) and the next
                                   older complete one is tried (default 0: the error is returned) */
} dtr_ckpt_config;

/** Measurements of a checkpointer (this rank). */
typedef struct dtr_ckpt_stats {
    int64_t saves;            /**< checkpoints started */
    int64_t skipped;          /**< saves skipped because one was being written (BUSY_SKIP) */
    int64_t committed;        /**< checkpoints whose manifest was written (all ranks count them) */
    double snapshot_s;        /**< the last save's stall: copying the state into the staging buffer
                                   (plus waiting for the previous write with BUSY_WAIT) */
    double write_s;           /**< the last write's time on the writer thread (files, fsyncs, manifest) */
    uint64_t bytes;           /**< this rank's state bytes per checkpoint */
} dtr_ckpt_stats;

/** Returns a configuration with every field at its default (keep 3, asynchronous, BUSY_WAIT).
 *  Thread safety: thread safe. */
DTR_API dtr_ckpt_config dtr_ckpt_config_init(void);

/** Makes a checkpointer over the objects of `cfg` (which must outlive it), creating cfg->dir.
 *  With cfg->comm of size > 1 it splits a private group from it (collective).
 *  @return DTR_OK, DTR_NULL_HANDLE (cfg, out, dir or ctx NULL), DTR_OUT_OF_MEMORY, DTR_IO_ERROR
 *          (the folder cannot be made), or the split's error.
 *  Thread safety: the context's thread; collective over cfg->comm. */
DTR_API dtr_result dtr_ckpt_create(const dtr_ckpt_config *cfg, dtr_ckpt **out);

/** Adds an application object whose entries are saved as "<name>/<entry name>" and written
 *  back on restore, then `loaded(obj)` is called. Names are up to 31 characters of [A-Za-z0-9_.-].
 *  Add the same objects in the same order on every run (and every rank).
 *  @return DTR_OK, DTR_NULL_HANDLE, DTR_INVALID_ARGUMENT (bad or repeated name, more than 16
 *          objects), DTR_BAD_STATE (a write in flight).
 *  Thread safety: the context's thread. */
DTR_API dtr_result dtr_ckpt_add_object(dtr_ckpt *ck, const char *name, void *obj, dtr_ckpt_state_fn state,
                                       dtr_ckpt_loaded_fn loaded);

/** Sets a key/value pair of metadata that the next saves store in the manifest (rank 0's are
 *  kept); a restore replaces the set with the checkpoint's. value NULL removes the key.
 *  Keys and values: printable ASCII, keys up to 63 bytes, values up to 255; at most 32 keys.
 *  @return DTR_OK, DTR_NULL_HANDLE, DTR_INVALID_ARGUMENT. Thread safety: the context's thread. */
DTR_API dtr_result dtr_ckpt_set_meta(dtr_ckpt *ck, const char *key, const char *value);
/** The value of `key` (set, or read by the last restore), or NULL. The pointer stays valid
 *  until the key changes. Thread safety: the context's thread. */
DTR_API const char *dtr_ckpt_get_meta(const dtr_ckpt *ck, const char *key);

/** Checkpoints the state as of now as <dir>/step-<step>/: snapshots every entry into the
 *  staging buffer, then writes (on the writer thread unless cfg.sync). Call it at a step
 *  boundary (after the optimizer step, before the next forward). An existing complete
 *  checkpoint of the same step is replaced (its manifest is removed first). After the new
 *  manifest, the complete checkpoints beyond cfg.keep and incomplete folders of older steps
 *  are removed. A failure of the previous asynchronous write is returned here (or by
 *  dtr_ckpt_wait) once; the new save still goes ahead.
 *  @param started receives 1 when a checkpoint was started, 0 when skipped (BUSY_SKIP); may be NULL.
 *  @return DTR_OK, DTR_NULL_HANDLE, DTR_INVALID_ARGUMENT (step < 0 or above 99999999),
 *          DTR_OUT_OF_MEMORY, DTR_DEVICE_ERROR, DTR_UNSUPPORTED (more than 64 entries), the
 *          previous write's error (DTR_IO_ERROR, a communication error), or with cfg.sync this one's.
 *  Thread safety: the context's thread; collective over cfg.comm. */
DTR_API dtr_result dtr_ckpt_save(dtr_ckpt *ck, int64_t step, int *started);

/** Waits until the write in flight (if any) has finished, manifest included.
 *  @return DTR_OK, DTR_NULL_HANDLE, or that write's error. Thread safety: the context's thread. */
DTR_API dtr_result dtr_ckpt_wait(dtr_ckpt *ck);

/** Restores every object from a checkpoint: `path` names a checkpoint folder, or NULL for the
 *  newest complete one under cfg.dir (older ones too with cfg.fallback). Waits for a write
 *  in flight first. Verifies the manifest (its checksum, the model's identity, the world
 *  layout) and every file and tensor it needs (size, CRC-32C, the live entry's size) before
 *  writing anything; then writes the entries and calls each object's state_loaded. A failure
 *  there puts the previous state back. Collective over cfg.comm: the ranks agree on the
 *  checkpoint (a rank that fails verification fails it for all).
 *  @param step receives the checkpoint's step (may be NULL).
 *  @return DTR_OK; DTR_NOT_FOUND (no complete checkpoint: a fresh start); DTR_CORRUPT_FILE
 *          (checksum, size or format wrong, a tensor missing); DTR_IO_ERROR (a file missing or
 *          unreadable); DTR_INVALID_ARGUMENT (another model's checkpoint, or entries of
 *          other sizes); DTR_UNSUPPORTED (a world-size change of a model that differs between
 *          ranks); DTR_OUT_OF_MEMORY; a communication error; or a state_loaded error.
 *          dtr_ckpt_last_error names the file and tensor.
 *  Thread safety: the context's thread; collective over cfg.comm. */
DTR_API dtr_result dtr_ckpt_restore(dtr_ckpt *ck, const char *path, int64_t *step);

/** Finds the newest complete checkpoint under `dir` (one with a manifest; not verified).
 *  @param step receives its step; @param path receives its folder (may be NULL).
 *  @return DTR_OK, DTR_NULL_HANDLE, DTR_NOT_FOUND (none, or no such folder).
 *  Thread safety: thread safe. */
DTR_API dtr_result dtr_ckpt_latest(const char *dir, int64_t *step, char *path, size_t pathlen);

/** The last error's message ("" when none). Thread safety: the context's thread. */
DTR_API const char *dtr_ckpt_last_error(const dtr_ckpt *ck);
/** Copies the counters into *out. @return DTR_OK, DTR_NULL_HANDLE. Thread safety: the context's thread. */
DTR_API dtr_result dtr_ckpt_get_stats(const dtr_ckpt *ck, dtr_ckpt_stats *out);
/** Waits for the write in flight, then frees the checkpointer (not the objects). NULL is
 *  ignored. Thread safety: the context's thread; collective over cfg.comm. */
DTR_API void dtr_ckpt_destroy(dtr_ckpt *ck);

/* ---- online trainer: learning inside a running app ----
 * A dtr_trainer trains a model on the samples an application pushes while it runs (a game
 * at 60 or 144 frames per second, a 1 kHz control loop, a trading engine), and serves
 * predictions from the last published weights. It owns an optimizer (with its schedule), a
 * streaming dataset (dtr_feed) with a back-pressure policy and checked pushes, a held-out
 * set for the publication guard, and a few snapshot buffers. Two ways to run:
 *  - cooperative: the app calls dtr_trainer_tick(tr, budget_us) from its own loop; the
 *    tick runs micro-batches, updates and publications only while the step times it has
 *    measured say they fit in what is left of the budget;
 *  - background: dtr_trainer_start runs a thread (priority, CPU affinity, a CPU share cap)
 *    that trains continuously, with pause and resume.
 * Serving: dtr_trainer_acquire gives the newest published snapshot without waiting on
 * training (lock-free: a reader never blocks, training never writes a buffer a reader
 * holds), dtr_trainer_pull copies it into the app's own serving model. See docs/online.md. */

/** Builds the training loss from a batch: x (N, sample shape...) and y (N, ...; NULL when
 *  unlabeled) are arena tensors of `ctx` (the model's context); returns the scalar mean
 *  loss over the N samples, or NULL with the context's error set. Called on the thread that
 *  trains (the tick's caller or the background thread), with gradients on for training and
 *  off for the guard's evaluation. */
typedef dtr_tensor *(*dtr_trainer_loss_fn)(void *user, dtr_context *ctx, dtr_tensor *x, dtr_tensor *y);

/** A monotonic clock in microseconds (a fake one for tests, or CPU time of the thread), called
 *  on the thread that trains (the tick's caller or the background thread) and by
 *  dtr_trainer_get_stats. */
typedef uint64_t (*dtr_trainer_clock_fn)(void *user);

/** The background thread's settings (dtr_trainer_start). */
typedef struct dtr_trainer_background_config {
    int nice;                         /**< 0: the app's priority; 1..19: lower (Linux: the thread's nice value) */
    int cpu;                          /**< >= 0: pin the thread to this CPU (Linux); -1 (default): no pinning */
    float cpu_share;                  /**< (0, 1]: the fraction of one core the thread may take; it sleeps
                                           after each piece of work in proportion; 0: 1 (no cap) */
    int max_threads;                  /**< > 0: refuse a model whose context has more compute threads than
                                           this (the trainer's thread count is 1 + the context's); 0: no cap */
    int idle_wait_ms;                 /**< how long the thread waits for samples before looking at
                                           requests again; 0: 5 */
} dtr_trainer_background_config;

/** The publication guard: weights are published only when their loss on a held-out set is
 *  no worse than the published weights' loss on the same set (both measured now). Each
 *  guarded publication reports the new weights' held-out loss to the trainer's optimizer
 *  (dtr_optimizer_report_metric): with optimizer.schedule.kind DTR_SCHED_PLATEAU the rate
 *  drops when it stops improving, and dtr_optimizer_metric_stats(dtr_trainer_optimizer(tr))
 *  has the counts. */
typedef struct dtr_trainer_guard_config {
    int enabled;                      /**< 1: guard every publication */
    int64_t holdout_every;            /**< every k-th accepted sample goes to the held-out set instead of
                                           training (dtr_trainer_push_holdout adds more); 0: 10 */
    int64_t holdout_size;             /**< held-out samples kept (the newest); 0: 256 */
    float tolerance;                  /**< publish when new_loss <= old_loss * (1 + tolerance); default 0 */
} dtr_trainer_guard_config;

/** Trainer options. Make one with dtr_trainer_config_init() and set model, loss and the
 *  feed's layout. */
typedef struct dtr_trainer_config {
    dtr_model *model;                 /**< the model trained (the app keeps it; only the trainer touches it
                                           while the trainer lives, except between ticks) */
    dtr_trainer_loss_fn loss;         /**< required */
    void *loss_user;                  /**< handed to loss */
    dtr_optimizer_config optimizer;   /**< the optimizer and its schedule; default Adam, lr 1e-3
                                           (grad_accum_steps is the trainer's business: must be 0 or 1) */
    dtr_feed_config feed;             /**< the stream: layout, capacity, back-pressure policy, checks */
    int64_t batch_size;               /**< samples per optimizer update; 0: 32. A tick may split a batch
                                           into micro-batches across ticks (the gradient accumulates) */
    int64_t publish_every;            /**< publish every N updates; 0: 10; < 0: only on demand */
    int snapshots;                    /**< snapshot buffers: readers holding one + 2 are always enough;
                                           0: 4 (two readers at once) */
    dtr_trainer_guard_config guard;
    dtr_trainer_background_config background;
    size_t memory_cap;                /**< > 0: the trainer's memory (model, optimizer, feed, snapshots,
                                           held-out set, and the context's arena) stays under this many
                                           bytes: creation fails above it, a step that grows the arena
                                           past it stops training with DTR_ARENA_FULL; 0: no cap */
    int64_t cold_estimate_us;         /**< how long a one-sample micro-batch takes before any was timed;
                                           0: unknown (the first tick with samples runs one to time it) */
    int reprobe_ticks;                /**< after this many ticks in a row with work waiting and nothing
                                           that fitted, the time estimates are halved so that one slow
                                           measurement cannot stop training for good (the attempt
                                           may run over if the work really does not fit); 0: 64; -1: never */
    dtr_trainer_clock_fn clock;       /**< NULL: the monotonic clock (dtr_time_ns) */
    void *clock_user;                 /**< handed to clock */
} dtr_trainer_config;

/** Defaults: Adam at 1e-3, batch 32, publish every 10 updates, 4 snapshots, no guard, no
 *  cap. Thread safety: thread safe. */
DTR_API dtr_trainer_config dtr_trainer_config_init(void);

typedef struct dtr_trainer dtr_trainer;

/** Creates a trainer over cfg->model (built here if it was not), its optimizer, its feed
 *  and its snapshot buffers, and publishes the model's current weights as version 1. All
 *  memory is allocated here.
 *  The model may live on a device (a GPU context): the snapshots stay in host memory and
 *  the weights travel through the backend's copies (a serving model of dtr_trainer_pull may
 *  be on a device too).
 *  @return DTR_OK, DTR_NULL_HANDLE (cfg, model or loss), DTR_INVALID_ARGUMENT (a field out
 *          of range: the message says which), DTR_OUT_OF_MEMORY (also: over memory_cap, the
 *          message gives the bytes), or the optimizer's or feed's error.
 *  Thread safety: the model's context thread. */
DTR_API dtr_result dtr_trainer_create(const dtr_trainer_config *cfg, dtr_trainer **out, char *err, size_t errlen);

/** Stops the background thread (if any), then frees the optimizer, feed and snapshots (the
 *  model stays the app's). No snapshot may be held. NULL is ignored.
 *  Thread safety: the thread that created it, with no other call in flight. */
DTR_API void dtr_trainer_destroy(dtr_trainer *tr);

/** Pushes n samples (the feed's layout): checked by the feed's policy, every
 *  guard.holdout_every-th accepted one kept for the guard, the rest queued for training.
 *  Back pressure is the feed's policy: wait up to timeout_ms, drop the oldest or drop the
 *  newest (dtr_feed_push has the details and results).
 *  @param pushed receives the samples that went in for training or held out (may be NULL).
 *  Thread safety: any number of threads, at any time (also while training runs). */
DTR_API dtr_result dtr_trainer_push(dtr_trainer *tr, const void *x, const void *y, int64_t n, int timeout_ms,
                                    int64_t *pushed);

/** Adds n samples to the guard's held-out set only (checked as pushes are; the newest
 *  holdout_size are kept). @return DTR_OK, DTR_NULL_HANDLE, DTR_INVALID_ARGUMENT (n < 0, a
 *  bad sample), DTR_BAD_STATE (no guard). Thread safety: any thread, at any time. */
DTR_API dtr_result dtr_trainer_push_holdout(dtr_trainer *tr, const void *x, const void *y, int64_t n);

/** What one tick did. */
typedef struct dtr_trainer_tick_report {
    int64_t micro_batches;            /**< forward and backward passes run */
    int64_t samples;                  /**< samples they trained on */
    int64_t updates;                  /**< optimizer updates applied */
    int published;                    /**< 1: a new snapshot was published; -1: the guard refused one */
    int64_t used_us;                  /**< time the tick took, on the trainer's clock */
} dtr_trainer_tick_report;

/** Cooperative mode: trains for at most budget_us microseconds of the trainer's clock and
 *  returns. Each piece of work (a micro-batch of 1, 2, 4 ... samples, an update, a
 *  publication with its guard evaluation) starts only when the recent worst time of its
 *  kind, plus a margin, fits in what is left; an unknown size is estimated from the next
 *  smaller one (twice its time). Never waits for samples. Publications requested by
 *  publish_every or dtr_trainer_publish are made when one fits.
 *  @param report receives what was done (may be NULL).
 *  @return DTR_OK (also when nothing fitted or no sample was there), DTR_BAD_STATE (the
 *          background thread runs, or training stopped on an earlier error), DTR_ARENA_FULL
 *          (memory_cap), or the loss's or optimizer's error (dtr_trainer_last_error).
 *  Thread safety: one thread (the app's loop), not while the background thread runs. */
DTR_API dtr_result dtr_trainer_tick(dtr_trainer *tr, int64_t budget_us, dtr_trainer_tick_report *report);

/** Background mode: starts the training thread (cfg.background). Training goes on until
 *  dtr_trainer_stop or destroy; pause and resume hold it between two pieces of work.
 *  @return DTR_OK, DTR_NULL_HANDLE, DTR_BAD_STATE (already running), DTR_INVALID_ARGUMENT
 *          (max_threads exceeded), DTR_OUT_OF_MEMORY (no thread).
 *  Thread safety: the thread that created the trainer. */
DTR_API dtr_result dtr_trainer_start(dtr_trainer *tr);
/** Stops and joins the training thread (after its current piece of work). Returns the error
 *  that stopped training, if one did, else DTR_OK (also when not running).
 *  Thread safety: the thread that created the trainer. */
DTR_API dtr_result dtr_trainer_stop(dtr_trainer *tr);
/** Holds the background thread after its current piece of work (pause 1) or lets it go on
 *  (pause 0); returns at once. @return DTR_OK or DTR_NULL_HANDLE. Thread safety: any thread. */
DTR_API dtr_result dtr_trainer_pause(dtr_trainer *tr, int pause);

/** Asks for a publication of the current weights (through the guard when enabled): the next
 *  tick with room for it, or the background thread after its current piece of work, makes
 *  it. The stats say what happened (versions, guard refusals). @return DTR_OK or
 *  DTR_NULL_HANDLE. Thread safety: any thread. */
DTR_API dtr_result dtr_trainer_publish(dtr_trainer *tr);

/** A published version of the weights, read-only, valid until dtr_trainer_release. */
typedef struct dtr_snapshot {
    const float *params;              /**< dtr_model_numel floats, the model's parameter buffer layout */
    int64_t numel;
    int64_t version;                  /**< 1, 2, 3 ... in publication order */
    int64_t updates;                  /**< optimizer updates the weights had seen */
    uint32_t crc32c;                  /**< dtr_crc32c(0, params, numel * 4), computed at publication */
    float holdout_loss;               /**< guard: the loss on the held-out set at publication; NaN without */
    int slot;                         /**< which buffer (for dtr_trainer_release) */
    const float *buffers;             /**< the model's buffers (batch norm's running statistics) at
                                           publication: dtr_model_buffer_numel floats, the layout
                                           of dtr_model_read_buffers (not in crc32c) */
    int64_t buffer_numel;
} dtr_snapshot;

/** Takes the newest published snapshot and holds it until dtr_trainer_release: training
 *  never writes a held buffer. Lock-free: never waits on training (it retries only while a
 *  publication is swapping the pointer).
 *  @return DTR_OK, DTR_NULL_HANDLE. Thread safety: any number of threads at once. */
DTR_API dtr_result dtr_trainer_acquire(dtr_trainer *tr, dtr_snapshot *out);
/** Lets go of a snapshot from dtr_trainer_acquire. Thread safety: any thread. */
DTR_API void dtr_trainer_release(dtr_trainer *tr, const dtr_snapshot *snap);

/** Serving helper: when the newest published version differs from *version, copies it into
 *  `serving`'s parameters and buffers (a model of the same layout on the caller's own
 *  context: batch norm serves the running statistics published with the weights) and sets
 *  *version; otherwise does nothing. Never waits on training.
 *  @return DTR_OK, DTR_NULL_HANDLE, DTR_SHAPE_MISMATCH (another parameter or buffer count).
 *  Thread safety: any thread that owns `serving`; several at once with their own models. */
DTR_API dtr_result dtr_trainer_pull(dtr_trainer *tr, dtr_model *serving, int64_t *version);

/** Counters and the falling-behind report. */
typedef struct dtr_trainer_stats {
    int64_t updates;                  /**< optimizer updates */
    int64_t micro_batches;
    int64_t samples_trained;
    int64_t version;                  /**< newest published version */
    int64_t published;                /**< publications made */
    int64_t guard_refused;            /**< publications the guard refused (the old weights stayed) */
    float guard_new_loss, guard_old_loss; /**< losses of the last guarded decision (NaN before one) */
    int64_t publish_busy;             /**< publications put off because every spare buffer was held */
    int64_t ticks;                    /**< cooperative ticks */
    int64_t tick_overruns;            /**< ticks that ran past budget + max(10%, 200 us) */
    int64_t tick_max_over_us;         /**< the largest (used - budget) of a tick (<= 0: none ran over) */
    int64_t tick_used_us, tick_budget_us; /**< sums over ticks */
    int64_t reprobes;                 /**< times the estimates were halved (reprobe_ticks) */
    int64_t holdout;                  /**< held-out samples kept now */
    dtr_feed_stats feed;              /**< the stream: pushed, dropped, rejected, timeouts, backlog */
    double ingest_per_s, trained_per_s; /**< samples pushed and trained per second since creation */
    int behind;                       /**< 1: the trainer has fallen behind the stream (samples were lost
                                           to the back-pressure policy since the last call, or the
                                           backlog is over 3/4 of the feed's capacity) */
    char report[256];                 /**< one line saying so (how many lost, backlog, rates), or "" */
    dtr_result status;                /**< the error that stopped training, or DTR_OK */
} dtr_trainer_stats;

/** Fills the stats. Thread safety: any thread (counters of a running trainer may be a
 *  piece of work apart from each other). */
DTR_API void dtr_trainer_get_stats(dtr_trainer *tr, dtr_trainer_stats *out);

/** The message of the error that stopped training, or of the last failed call, or "".
 *  Thread safety: any thread, once the call that failed has returned. */
DTR_API const char *dtr_trainer_last_error(const dtr_trainer *tr);

/** The trainer's optimizer (for its state in a checkpoint). Thread safety: any thread; use
 *  it only while training is paused or between ticks. */
DTR_API dtr_optimizer *dtr_trainer_optimizer(dtr_trainer *tr);
/** The trainer's feed (stats, dtr_feed_end). Thread safety: as the feed's functions. */
DTR_API dtr_feed *dtr_trainer_feed(dtr_trainer *tr);

/** Entry `index` of the trainer's state (api.h, "state"): "counters" (int64: updates,
 *  micro-batches, samples trained, version, accumulated samples, the published weights'
 *  updates), then "published" (the
 *  published weights, dtr_model_numel floats) so a restored trainer serves and guards against
 *  the same weights. The model and optimizer list their own state.
 *  @return DTR_OK, DTR_NOT_FOUND past the last, DTR_NULL_HANDLE.
 *  Thread safety: while training is paused (stopped) or between ticks; no snapshot held. */
DTR_API dtr_result dtr_trainer_state(dtr_trainer *tr, int index, dtr_state_entry *out);
/** After writing the entries back: checks the counters and republishes the loaded weights
 *  under their version (checksum recomputed). @return DTR_OK, DTR_NULL_HANDLE,
 *  DTR_CORRUPT_FILE (a negative counter). Thread safety: as dtr_trainer_state. */
DTR_API dtr_result dtr_trainer_state_loaded(dtr_trainer *tr);
/* ---- parameter servers ----
 * A world splits into S servers (ranks 0..S-1) and W = size - S workers (ranks S..). The
 * model's parameter buffer is cut into S balanced ranges (16-float aligned; a large tensor
 * may span servers): server s holds and updates floats [range[s], range[s + 1]) with its own
 * optimizer (dtr_optimizer_step_range over its range), workers compute gradients, push them to
 * every server and pull the parameters back. Every rank builds the same model with the same
 * seed; the servers' initial parameters are the ones the workers pull first.
 * Consistency: SYNC (a server applies the average of step t once every live worker pushed
 * it: the same weights as all-reduce data parallelism), ASYNC (each push applied on arrival),
 * SSP (bounded staleness s: a worker at clock c waits in its pull until the slowest live
 * worker has pushed c - s clocks). Staleness of a push = the pushing worker's clock minus the
 * slowest live worker's clock when the server applies it (0 in SYNC, <= s in SSP), counted in
 * a histogram. The server's messages are validated (magic, version, kind, sender, range,
 * dtype, sizes); a bad one is refused, counted and logged, never applied. Waits are bounded:
 * a worker that a server waits on (a synchronous round, an SSP pull, the end of serving)
 * and that is silent for worker_deadline_ms is dropped (DTR_PS_CONTINUE) or fails the job
 * (DTR_PS_FAIL: the server aborts the group, every rank gets DTR_PEER_FAILED). A dropped
 * worker that speaks again rejoins (its stale push is discarded and counted). Tags 2^29 + 1
 * and 2^29 + 2 of the group are the engine's. docs/parameter-server.md is the guide. */

/** Consistency modes of the parameter servers. Append-only. */
typedef enum dtr_ps_mode {
    DTR_PS_SYNC = 0,   /**< rounds: the average of every live worker's push of step t, then one update */
    DTR_PS_ASYNC = 1,  /**< each push applied on arrival; pulls answered at once */
    DTR_PS_SSP = 2     /**< stale synchronous parallel: as ASYNC, pulls wait for the slowest worker within `staleness` clocks */
} dtr_ps_mode;

/** What a server does with a worker that it waits on and that stays silent past the deadline. */
typedef enum dtr_ps_policy {
    DTR_PS_FAIL = 0,      /**< fail the job: dtr_ps_serve returns DTR_TIMEOUT (silent) or DTR_PEER_FAILED (died, on a
                               group with isolate_peer_failures) naming the worker, the group is aborted */
    DTR_PS_CONTINUE = 1   /**< drop the worker from rounds and waits; it rejoins when it speaks again (a dead one
                               never: dropped for good) */
} dtr_ps_policy;

/** Parameter-server configuration. Make one with dtr_ps_config_init(); zero means default. */
typedef struct dtr_ps_config {
    int servers;               /**< S servers (ranks 0..S-1; with replicas, S ranges and 2S server ranks), 1 to
                                    min(64, size - 1); 0: $DTR_PS_SERVERS (dtrun --servers), else 1 */
    dtr_ps_mode mode;          /**< DTR_PS_SYNC (default) */
    int staleness;             /**< SSP bound s >= 0 (default 2; 0 is lock-step) */
    dtr_optimizer_config opt;  /**< the servers' optimizer (default SGD lr 0.01); LAMB and clip_norm are refused */
    dtr_dtype push_dtype;      /**< gradients on the wire: DTR_F32 (default) or DTR_BF16 (half the bytes; the
                                    same as push_compress BF16); sparse rows go in this dtype */
    int worker_deadline_ms;    /**< a waited-on worker silent this long is dropped or fails the job; 0: 60000.
                                    Keep it above the longest step a worker takes (a lone worker is waited on) */
    dtr_ps_policy policy;      /**< DTR_PS_FAIL (default) or DTR_PS_CONTINUE */
    dtr_log_fn log;            /**< refused messages and dropped workers are logged here; NULL: silent */
    void *log_user;
    int replicas;              /**< 0 (default) or 1: each range has a backup (ranks S..2S-1; workers from 2S) that
                                    holds every push before the worker's push returns, and takes over when its
                                    primary dies. Needs a group made with isolate_peer_failures
                                    (docs/parameter-server.md, "Replication"); refuses dtr_ps_push_rows / pull_rows */
    int aggregate;             /**< ASYNC and SSP: a server sums this many pushes (whichever workers send them, in
                                    arrival order) and applies their average as one update; 0 or 1 (default):
                                    every push is an update. W gives sync's update count and batch without its
                                    wait (docs/parameter-server.md, "Aggregation"); pushes left at the end are
                                    applied when serving ends. Above 1 in SYNC: DTR_INVALID_ARGUMENT */
    dtr_dp_compress push_compress; /**< a push's codec (the data-parallel engine's, docs/parameter-server.md,
                                    "Compressed pushes"): NONE (default: push_dtype), BF16, FP16, or INT8
                                    (a quarter of the bytes: an f32 scale per 4096 floats, the loss kept in a
                                    residual on the worker and added to the next push); TOPK and POWERSGD:
                                    DTR_UNSUPPORTED */
    int backup_workers;        /**< SYNC: a round is applied once every live worker but this many pushed
                                    (backup workers, as TensorFlow's SyncReplicasOptimizer): a persistent
                                    straggler no longer sets the pace; a push that comes after its round
                                    is discarded (stats.stale_discarded) and its worker goes on from the
                                    next round. Each server completes its rounds with the pushes that
                                    reach it first. 0 (default) to workers - 1 */
    const char *checkpoint_dir; /**< servers: checkpoint their range (its parameters, its optimizer's state and the
                                    update count) in dtr_ckpt's layout under <dir>/server-<s>/ every
                                    checkpoint_every updates, written beside serving, and when serving ends; at
                                    dtr_ps_create they resume from the newest (SYNC: the newest update count every
                                    server has), and each worker's first dtr_ps_pull brings it
                                    (docs/parameter-server.md, "Checkpoints"). Every rank gives the same value
                                    (dtr_ps_create compares the servers' folders, a collective). NULL (default): none */
    int checkpoint_every;      /**< updates between a server's checkpoints; 0: 1000 */
    int checkpoint_keep;       /**< complete checkpoints a server keeps, newest first; 0: 3 */
} dtr_ps_config;

/** Returns a configuration with every field at its default. Thread safety: thread safe. */
DTR_API dtr_ps_config dtr_ps_config_init(void);

/** Number of servers a launcher asked for: $DTR_PS_SERVERS (set by dtrun --servers S), or
 *  `fallback` when unset or not a positive integer. Thread safety: thread safe. */
DTR_API int dtr_ps_servers_from_env(int fallback);

/** Counters of one rank's engine since dtr_ps_create. Servers fill the server fields,
 *  workers the worker fields. */
#define DTR_PS_STALENESS_BINS 16
typedef struct dtr_ps_stats {
    int64_t updates;             /**< server: optimizer updates applied to its range (resumed: since the first run) */
    int64_t pushes_applied;      /**< server: pushes that went into an update */
    int64_t pulls_answered;      /**< server: pulls answered */
    int64_t refused;             /**< server: malformed, oversized or unexpected messages refused */
    int64_t stale_discarded;     /**< server: pushes for a finished round, discarded (a dropped worker's, or
                                      with backup_workers a late one's) */
    int64_t dropped;             /**< server: workers dropped at the deadline */
    int64_t rejoined;            /**< server: dropped workers that came back */
    int64_t staleness[DTR_PS_STALENESS_BINS]; /**< server: pushes by staleness (clocks); the last bin counts that many or more */
    int64_t max_staleness;       /**< server: the largest staleness seen */
    int64_t pushes, pulls;       /**< worker: pushes and pulls made (each to every server) */
    int64_t row_pushes, row_pulls; /**< sparse: worker: calls made; server: row messages applied / answered */
    int64_t wait_ns;             /**< worker: time spent in pulls waiting for the servers */
    uint64_t bytes_sent, bytes_received; /**< both: payload and headers put on / taken off the wire */
    int64_t pushes_acked;        /**< worker (replicas): pushes every server (and its backup) acknowledged */
    int64_t failovers;           /**< worker: ranges moved to their backup; backup: 1 once it took over */
    int64_t forwarded;           /**< primary (replicas): messages its backup acknowledged */
    int64_t workers_lost;        /**< server (isolated group, DTR_PS_CONTINUE): workers dropped because they died */
    int64_t checkpoints;         /**< server: checkpoints started (checkpoint_dir) */
    int64_t checkpoint_failures; /**< server: checkpoints that failed (logged; serving goes on; the last one at the
                                      end of serving is dtr_ps_serve's error instead) */
    int64_t resumed_updates;     /**< server: the update count of the checkpoint it resumed from (0: a fresh start);
                                      `updates` counts on from it. Worker: the least of the servers' (SYNC: the
                                      step to go on from) */
} dtr_ps_stats;

typedef struct dtr_ps dtr_ps;

/** Makes this rank's part of the parameter-server engine over `c` (every rank of the group
 *  calls it, with the same cfg and a model built alike): a server makes its optimizer over
 *  its range, a worker its buffers; then the engine's own group is split from `c` (a
 *  collective over `c`, after the checks: a refused configuration sends nothing). With
 *  cfg->checkpoint_dir the servers then resume from their checkpoints (every rank takes part;
 *  a server that cannot fails dtr_ps_create on every rank, naming it). A server's
 *  copy of that group waits a day for a worker's next message; the engine's worker deadline
 *  bounds what it waits for. A worker's model may live on a device (a GPU context): its
 *  pushes and pulls go through a host copy of the gradients (page-locked on CUDA) and the
 *  backend's copies; a server's model lives in host memory (a CPU context).
 *  @return DTR_OK, DTR_NULL_HANDLE, DTR_INVALID_ARGUMENT (servers not below the group size,
 *  staleness < 0, push_dtype, push_compress, mode, policy, aggregate, backup_workers; the context's message
 *  says which),
 *  DTR_UNSUPPORTED (LAMB, clip_norm, a server's model in device memory, push_compress TOPK or POWERSGD),
 *  DTR_OUT_OF_MEMORY, a resume's error (DTR_CORRUPT_FILE, DTR_IO_ERROR, DTR_INVALID_ARGUMENT: another
 *  model's or layout's checkpoint; dtr_ckpt_restore's). Thread safety: the model's
 *  context thread. */
DTR_API dtr_result dtr_ps_create(dtr_model *m, dtr_comm *c, const dtr_ps_config *cfg, dtr_ps **out);
/** Frees the engine (not the model or group). NULL is ignored. A server still listening
 *  (dtr_ps_serve returned an error) aborts the group first so that nothing waits on it.
 *  Thread safety: the model's context thread. */
DTR_API void dtr_ps_destroy(dtr_ps *ps);
/** 1 on a server rank, 0 on a worker (0 for NULL). Thread safety: any thread. */
DTR_API int dtr_ps_is_server(const dtr_ps *ps);
/** This rank's index among the servers (a backup: its range's) or among the workers (-1 for
 *  NULL). Thread safe. */
DTR_API int dtr_ps_index(const dtr_ps *ps);
/** Number of workers W (0 for NULL). Thread safety: any thread. */
DTR_API int dtr_ps_workers(const dtr_ps *ps);
/** Server s's range of the parameter buffer, [*begin, *end) in floats.
 *  @return DTR_OK, DTR_NULL_HANDLE, DTR_INVALID_ARGUMENT (s). Thread safety: any thread. */
DTR_API dtr_result dtr_ps_range(const dtr_ps *ps, int s, int64_t *begin, int64_t *end);
/** Server: answers the workers until every worker has said dtr_ps_finish (or was dropped
 *  and never came back). A backup (replicas) follows its primary until that one dies, then
 *  serves the range. Returns DTR_OK then; DTR_TIMEOUT (policy FAIL, a worker silent past
 *  the deadline: the context's message names it), DTR_PEER_FAILED (policy FAIL, a worker
 *  died on a group with isolate_peer_failures: named too), the last checkpoint's error
 *  (checkpoint_dir: the state as serving ended could not be written), or the group's error.
 *  Thread safety: the model's context thread. */
DTR_API dtr_result dtr_ps_serve(dtr_ps *ps);
/** Worker: pulls the parameters from every server into the model (SYNC: those of the step
 *  after this worker's last push; SSP: waits within the staleness bound; ASYNC: the current
 *  ones). @return DTR_OK, DTR_BAD_STATE (on a server), or the group's error.
 *  Thread safety: the model's context thread. */
DTR_API dtr_result dtr_ps_pull(dtr_ps *ps);
/** Worker: pushes the model's gradient buffer (each server its range, in push_dtype) and
 *  zeroes it; the worker's clock advances. With replicas it returns once every range's
 *  server and its backup hold the push (stats.pushes_acked), sending it again to the backup
 *  of a primary that died. @return DTR_OK, DTR_BAD_STATE (on a server), or the group's
 *  error. Thread safety: the model's context thread. */
DTR_API dtr_result dtr_ps_push(dtr_ps *ps);
/** Worker: dtr_ps_push, then dtr_ps_pull. Thread safety: the model's context thread. */
DTR_API dtr_result dtr_ps_step(dtr_ps *ps);
/** Worker: tells every server that this worker is done (it leaves rounds and waits).
 *  @return DTR_OK, DTR_BAD_STATE (on a server), or the group's error.
 *  Thread safety: the model's context thread. */
DTR_API dtr_result dtr_ps_finish(dtr_ps *ps);
/** Worker, sparse: pushes the gradient rows `rows[0..n)` (distinct indices along the first
 *  axis) of `param`, a parameter of the model (an embedding table), to the servers that hold
 *  them (a row may span two), and zeroes those rows of the gradient buffer. Servers apply
 *  rows on arrival in every mode, as plain SGD at their optimizer's current learning rate
 *  (rows keep no moments), without a round. Only the rows' bytes travel.
 *  @return DTR_OK, DTR_NULL_HANDLE, DTR_BAD_STATE (on a server), DTR_INVALID_ARGUMENT (not a
 *  parameter of the model, a row outside the table or repeated, more rows than fit one
 *  message to a server: the segments and values of a server's rows must fit its range's
 *  size), or the group's error. Thread safety: the model's context thread. */
DTR_API dtr_result dtr_ps_push_rows(dtr_ps *ps, const dtr_tensor *param, const int64_t *rows, int n);
/** Worker, sparse: pulls the current values of rows `rows[0..n)` of `param` into the model
 *  (answered at once in every mode). @return as dtr_ps_push_rows.
 *  Thread safety: the model's context thread. */
DTR_API dtr_result dtr_ps_pull_rows(dtr_ps *ps, const dtr_tensor *param, const int64_t *rows, int n);
/** Copies the engine's counters into *out. @return DTR_OK or DTR_NULL_HANDLE.
 *  Thread safety: the model's context thread. */
DTR_API dtr_result dtr_ps_get_stats(const dtr_ps *ps, dtr_ps_stats *out);

#ifdef __cplusplus
}
#endif
