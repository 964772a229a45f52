/* ============================================================================
 * Public API
 * ==========================================================================*/
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define DTR_VERSION_MAJOR 0
#define DTR_VERSION_MINOR 1
#define DTR_VERSION_PATCH 0
#define DTR_VERSION_NUMBER (DTR_VERSION_MAJOR * 10000 + DTR_VERSION_MINOR * 100 + DTR_VERSION_PATCH)
#define DTR_VERSION_STRING "0.1.0"

#ifndef DTR_API
#define DTR_API
#endif

/** Maximum number of dimensions of a tensor. */
#define DTR_MAX_DIMS 6

/* ---- results ---- */

/** Result codes. Zero is success; errors are negative and grouped by range:
 *  -1..-99 general, -100..-199 files and data, -200..-299 communication, -300..-399 devices.
 *  The list is append-only. */
typedef enum dtr_result {
    DTR_OK = 0,
    DTR_INVALID_ARGUMENT = -1,  /**< an argument is out of range or inconsistent */
    DTR_NULL_HANDLE = -2,       /**< a required handle or pointer was NULL */
    DTR_SHAPE_MISMATCH = -3,    /**< tensor shapes do not fit the operation */
    DTR_DTYPE_MISMATCH = -4,    /**< tensor dtype not supported by the operation */
    DTR_OUT_OF_MEMORY = -5,     /**< an allocation callback returned NULL */
    DTR_ARENA_FULL = -6,        /**< the step arena hit arena_max_bytes */
    DTR_BAD_STATE = -7,         /**< call made in the wrong order or state */
    DTR_UNSUPPORTED = -8,       /**< feature not compiled in or not available */
    DTR_NOT_FOUND = -9,         /**< a named item does not exist */
    DTR_VERSION_MISMATCH = -10, /**< a unit was built against another header version */
    DTR_IO_ERROR = -100,        /**< a file could not be opened, read or written */
    DTR_CORRUPT_FILE = -101,    /**< a file's contents are malformed */
    DTR_TIMEOUT = -200,         /**< a deadline passed */
    DTR_PEER_FAILED = -201,     /**< a peer died or stopped answering */
    DTR_DEVICE_ERROR = -300,    /**< a device (GPU) or its driver reported an error; the
                                     native code is in the message */
    DTR_DEVICE_OUT_OF_MEMORY = -301, /**< a device allocation failed (host memory: DTR_OUT_OF_MEMORY) */
    DTR_NONFINITE = -400        /**< a NaN or an infinity where numbers must be finite: a loss or
                                     gradient norm (dtr_optimizer_config.nonfinite), or an op's output
                                     or gradient in anomaly mode (dtr_context_set_anomaly); the
                                     message names where */
} dtr_result;

/** Short constant description of a result code ("shape mismatch"). Thread safe. */
DTR_API const char *dtr_result_string(dtr_result r);

/** Runtime version as DTR_VERSION_NUMBER; compare with the macro to detect a header/library skew.
 *  Thread safety: thread safe. */
DTR_API int dtr_version(void);
/** Runtime version string, "major.minor.patch". */
DTR_API const char *dtr_version_string(void);

/* ---- dtypes ---- */

/** Element types. Compute is f32; bf16 and f16 are storage types (of tensors, and of every op's
 *  output with dtr_context_config.activation_dtype). Append-only. */
typedef enum dtr_dtype {
    DTR_F32 = 0,
    DTR_BF16 = 1,
    DTR_F16 = 2,
    DTR_I32 = 3,   /**< class indices, token ids */
    DTR_U8 = 4
} dtr_dtype;

/** Size in bytes of one element of `dt`; 0 for an unknown dtype.
 *  Thread safety: thread safe. */
DTR_API size_t dtr_dtype_size(dtr_dtype dt);
/** Name of the dtype ("f32", "bf16", ...). */
DTR_API const char *dtr_dtype_name(dtr_dtype dt);

/** Scalar conversions (round to nearest even; NaN and Inf preserved). Thread safe. */
DTR_API uint16_t dtr_f32_to_bf16(float x);
DTR_API float dtr_bf16_to_f32(uint16_t x);
DTR_API uint16_t dtr_f32_to_f16(float x);
DTR_API float dtr_f16_to_f32(uint16_t x);
/** Converts `n` elements between dtypes (f32, bf16, f16, i32, u8). `src` and `dst` must not overlap.
 *  Returns DTR_DTYPE_MISMATCH for an unknown dtype. Thread safe. */
DTR_API dtr_result dtr_convert(void *dst, dtr_dtype dst_dtype, const void *src, dtr_dtype src_dtype, size_t n);

/* ---- context ---- */

typedef struct dtr_context dtr_context;
/** A tape with its own arenas (dtr_tape_create). */
typedef struct dtr_tape dtr_tape;
typedef struct dtr_tensor dtr_tensor;
typedef struct dtr_backend dtr_backend;

/** Allocation callbacks, as in miniaudio. All NULL means the C library's malloc/realloc/free.
 *  Either all three are set or none. */
typedef struct dtr_allocation_callbacks {
    void *user;
    void *(*malloc_fn)(size_t bytes, void *user);
    void *(*realloc_fn)(void *p, size_t bytes, void *user);
    void (*free_fn)(void *p, void *user);
} dtr_allocation_callbacks;

typedef enum dtr_log_level {
    DTR_LOG_ERROR = 0,
    DTR_LOG_WARN = 1,
    DTR_LOG_INFO = 2,
    DTR_LOG_DEBUG = 3
} dtr_log_level;

/** Log callback. `msg` is valid only during the call. May be called from worker threads. */
typedef void (*dtr_log_fn)(void *user, dtr_log_level level, const char *msg);

/** What a GPU backend may round the operands of f32 matrix products (linear, matmul,
 *  convolution, attention) to; the products are summed in f32 and tensors keep their dtype
 *  (parameters, gradients, optimizer state f32: master weights; activations f32 unless
 *  activation_dtype says otherwise). The CPU backend computes in f32 whatever the setting.
 *  Append-only. */
typedef enum dtr_matmul_precision {
    DTR_MATMUL_F32 = 0,    /**< full f32 (TF32 when allow_tf32 is 1) */
    DTR_MATMUL_TF32 = 1,   /**< TF32 tensor cores: 10-bit mantissas, relative error near 1e-3 */
    DTR_MATMUL_BF16 = 2,   /**< bf16 tensor cores: 7-bit mantissas, f32's range; about twice TF32's
                                speed on GPT shapes, relative error near 1e-2; no loss scaling needed */
    DTR_MATMUL_F16 = 3     /**< fp16 tensor cores: 10-bit mantissas, range 6e-5 to 65504: small
                                gradients flush to zero without dtr_loss_scaler (scale the loss) */
} dtr_matmul_precision;

/** Context configuration. Make one with dtr_context_config_init(); zero means default everywhere. */
typedef struct dtr_context_config {
    const dtr_backend *backend;      /**< NULL: the CPU backend in dtrain.h */
    int device;                      /**< device ordinal for GPU backends */
    int threads;                     /**< compute threads; 0: the number of online cores */
    size_t arena_bytes;              /**< initial step-arena size; 0: 16 MiB. It grows by whole chunks */
    size_t arena_max_bytes;          /**< hard limit for the step arena; 0: no limit. Past it: DTR_ARENA_FULL */
    dtr_allocation_callbacks alloc;  /**< allocation callbacks; zero: libc */
    dtr_log_fn log;                  /**< log callback; NULL: the library never prints */
    void *log_user;                  /**< passed to `log` */
    dtr_log_level log_level;         /**< most verbose level passed to `log` (default DTR_LOG_WARN) */
    uint64_t seed;                   /**< seed of the context RNG (dropout); 0 is a valid seed */
    int allow_tf32;                  /**< 1: a GPU backend may run f32 matrix products on TF32 tensor
                                          cores (10-bit mantissa products, f32 sums: several times
                                          faster, relative error near 1e-3); 0 (default): full f32 */
    dtr_matmul_precision matmul_precision; /**< the f32 matrix products' operands on a GPU backend
                                          (dtr_matmul_precision); F32 (default) keeps allow_tf32's say */
    int retain_grads;                /**< 1: dtr_backward keeps the gradient of every intermediate
                                          tensor (dtr_tensor_grad reads it afterwards); 0 (default):
                                          an intermediate's gradient is released once the op that
                                          made it has run its backward, and its memory serves later
                                          gradients of the pass (a lower step-arena peak); keep single
                                          ones with dtr_tensor_retain_grad. Leaves and parameters
                                          always keep theirs */
    int release_activations;         /**< 1: dtr_backward also releases what an op computed (its
                                          output, its saved state) once the op has run its backward,
                                          as PyTorch frees saved tensors: the memory serves the pass's
                                          gradients and the next forward (micro-batches), a lower
                                          step-arena peak. Afterwards the tape's intermediate tensors
                                          are gone: reading one, using one in an op or back-propagating
                                          through them again gives DTR_BAD_STATE (never stale data);
                                          the root of the pass (the loss), leaves, inputs and
                                          parameters stay, and dtr_tensor_retain keeps others (logits
                                          read for accuracy). 0 (default): everything stays until
                                          dtr_context_reset */
    dtr_dtype activation_dtype;      /**< the dtype of what ops compute: DTR_F32 (default), DTR_BF16
                                          or DTR_F16. With a 16-bit one every op's output (the
                                          losses and sum_all/mean_all excepted: f32) is stored in it,
                                          half the memory of the activations a step keeps for
                                          backward; each kernel reads its inputs as f32, computes in
                                          f32 and rounds its output once. Parameters, gradients and
                                          optimizer state stay f32 (master weights), so nothing else
                                          changes. Inputs of any of the three dtypes are taken in
                                          either mode. fp16 wants dtr_loss_scaler; bf16 does not */
} dtr_context_config;

/** Returns a configuration with every field at its default.
 *  Thread safety: thread safe. */
DTR_API dtr_context_config dtr_context_config_init(void);

/** Creates a context: the backend, the thread pool and the step arena.
 *  @param cfg  configuration, or NULL for defaults.
 *  @param out  receives the context (NULL on failure).
 *  @return DTR_OK, DTR_NULL_HANDLE, DTR_INVALID_ARGUMENT, DTR_OUT_OF_MEMORY, DTR_VERSION_MISMATCH
 *          (a backend built against another header) or the backend's init error (no usable
 *          GPU: DTR_UNSUPPORTED); dtr_context_create_error says why.
 *  Thread safety: contexts are independent; one context is used by one thread at a time. */
DTR_API dtr_result dtr_context_create(const dtr_context_config *cfg, dtr_context **out);
/** The message of this thread's last dtr_context_create: why it failed ("cuda: no usable GPU
 *  (...)", "dtr_context_create: threads 2000 outside 0..1024", ...), "" after a success.
 *  Thread safety: thread safe (a copy per thread where the compiler has thread-local storage). */
DTR_API const char *dtr_context_create_error(void);

/** Destroys a context and everything allocated from its arena. NULL is ignored.
 *  Thread safety: the context's thread. */
DTR_API void dtr_context_destroy(dtr_context *ctx);

/** The sticky status: DTR_OK or the first error recorded by a tensor-returning call since the
 *  last dtr_context_clear_error(). Check it once after building a graph.
 *  Thread safety: the context's thread. */
DTR_API dtr_result dtr_context_status(const dtr_context *ctx);

/** The message of the most recent error on this context (names the op or file), or "".
 *  Thread safety: the context's thread. */
DTR_API const char *dtr_context_last_error(const dtr_context *ctx);

/** Clears the sticky status and the message.
 *  Thread safety: the context's thread. */
DTR_API void dtr_context_clear_error(dtr_context *ctx);

/** Ends a step: forgets the tape and releases every arena tensor (activations, gradients of
 *  non-parameters). Model parameters and their gradients are untouched. Once the arena has
 *  grown to the step's size, later steps allocate nothing. Returns DTR_NULL_HANDLE for NULL.
 *  Thread safety: the context's thread. */
DTR_API dtr_result dtr_context_reset(dtr_context *ctx);

/** Turns tape recording on (default) or off (inference; no backward, less memory).
 *  Returns the previous setting.
 *  Thread safety: the context's thread. */
DTR_API int dtr_context_set_grad_enabled(dtr_context *ctx, int enabled);

/** Training mode (dropout active; default) or evaluation mode. Returns the previous setting.
 *  Thread safety: the context's thread. */
DTR_API int dtr_context_set_training(dtr_context *ctx, int training);

/** Anomaly mode (off by default; costs nothing when off): every op's output in forward and
 *  every gradient an op's backward writes is checked for NaN and infinity (one pass over
 *  each, so slow: for debugging). The first op that makes one fails with DTR_NONFINITE, and
 *  the message names it: the op, its position on the tape, the shape, forward or backward,
 *  the parameter whose gradient it is, and an input that was already non-finite (data or a
 *  parameter that arrived so). Returns the previous setting (0 for NULL).
 *  Thread safety: the context's thread. */
DTR_API int dtr_context_set_anomaly(dtr_context *ctx, int on);

/** Number of compute threads of the context.
 *  Thread safety: the context's thread. */
DTR_API int dtr_context_threads(const dtr_context *ctx);

/** Bytes the current tape's arenas have reserved (their capacity) and use now (the context's
 *  own step arena unless a dtr_tape is current). Either pointer may be NULL.
 *  Thread safety: the context's thread. */
DTR_API void dtr_context_arena_usage(const dtr_context *ctx, size_t *reserved, size_t *used);

/** The most arena bytes in use at once, over the context's own tape and every dtr_tape, since
 *  the context was created or the last call with `reset` 1 (which restarts the count from the
 *  bytes in use now). 0 for NULL.
 *  Thread safety: the context's thread. */
DTR_API size_t dtr_context_arena_peak(dtr_context *ctx, int reset);

/* ---- tapes ----
 * Ops record on, and allocate their tensors from, the context's current tape: its own by
 * default, which dtr_context_reset frees. An engine that keeps several forward passes alive
 * at once (the micro-batches of a pipeline, a recomputed region) gives each its own tape and
 * frees each when its backward is done, in any order. dtr_backward replays the tape that
 * recorded the loss. A tensor of one tape may feed ops recorded on another; resetting the
 * first while the second still needs it is the app's error (its memory is gone). */

/** New, empty tape of ctx, with arenas sized like the context's (arena_bytes, and
 *  arena_max_bytes per tape). @return DTR_OK, DTR_NULL_HANDLE, DTR_OUT_OF_MEMORY.
 *  Thread safety: the context's thread. */
DTR_API dtr_result dtr_tape_create(dtr_context *ctx, dtr_tape **out);
/** Forgets the tape's nodes and frees its tensors, keeping its memory for reuse.
 *  @return DTR_OK, DTR_NULL_HANDLE. Thread safety: the context's thread. */
DTR_API dtr_result dtr_tape_reset(dtr_tape *t);
/** Frees the tape (the context's own tape comes back as current if it was). Destroy every
 *  tape before its context. NULL is ignored. Thread safety: the context's thread. */
DTR_API void dtr_tape_destroy(dtr_tape *t);
/** Makes `t` the tape that later ops record on (NULL: the context's own). Returns the tape
 *  that was current (NULL for the context's own), to put back after. A tape of another
 *  context is refused (error recorded on ctx, NULL returned, nothing changed).
 *  Thread safety: the context's thread. */
DTR_API dtr_tape *dtr_context_set_tape(dtr_context *ctx, dtr_tape *t);
/** The current tape, NULL when it is the context's own. Thread safety: the context's thread. */
DTR_API dtr_tape *dtr_context_tape(const dtr_context *ctx);

/* ---- captured steps (CUDA graphs) ----
 * A training step of fixed shapes launches the same kernels every time; on a GPU the launches
 * themselves can cost more than the work (a small MLP). dtr_graph_capture runs a step function
 * once and keeps it; dtr_graph_launch runs it again: on CUDA one cudaGraphLaunch replays every
 * kernel the capture queued, on the same memory; on a backend without graphs (the CPU) the
 * function is called again on the graph's own tape, and the work is checked to be the capture's.
 * Loop: write the batch into input tensors made before the capture, dtr_graph_launch,
 * dtr_optimizer_step, read the loss (docs/gpu.md, "Captured steps").
 *
 * The step function's rules (each broken one is refused with DTR_BAD_STATE or
 * DTR_UNSUPPORTED and a message naming the call, on every backend, so a program that captures
 * on the CPU captures on the GPU):
 * - It does the same work each time: the same ops on tensors of the same shapes, and host
 *   values it copies in (dtr_tensor_from, dtr_backward's seed, a scale factor) are the
 *   capture's on every launch: a launch whose work differs from the capture's fails
 *   ("the step differs from its capture"). Changing data goes in through tensors made before
 *   the capture (dtr_tensor_write before each launch).
 * - Nothing in it waits on the host: no reads of tensors (dtr_tensor_read, dtr_tensor_grad),
 *   no events, no dtr_context_reset, no optimizer step (its step count and learning rate change
 *   every step: call dtr_optimizer_step after the launch), no gradient clipping or loss-scaler
 *   check (host sums), no dtr_loss_scaler_scale (its scale changes between steps: fp16 with
 *   dynamic loss scaling runs eagerly; bf16 needs no scaling).
 * - No dropout (fresh masks every step), no activation checkpointing (dtr_checkpoint runs on
 *   other tapes), no tensor-parallel communication ops; the context may hold no gradient hook
 *   of the app's. A data-parallel engine's may: its hook does not run in a captured step, and
 *   dtr_dp_finish after the launch exchanges every bucket (no overlap with backward; ZeRO-3,
 *   which gathers parameters during the step, is refused).
 * Its tensors live on the graph's tape until the next launch (CPU) or the graph's end (CUDA):
 * keep the ones to read (the loss) in `user`; intermediate gradients are not released early in a
 * captured step (a higher arena peak than eager). A launch after dtr_context_reset of a context
 * whose own tape held an input of the capture is refused (the input is gone): capture again. */

/** A captured step (dtr_graph_capture). */
typedef struct dtr_graph dtr_graph;
/** A step function: records ops on ctx (forward, loss, dtr_backward) and returns DTR_OK or an
 *  error, which ends the capture or the launch with it. */
typedef dtr_result (*dtr_graph_fn)(dtr_context *ctx, void *user);

/** Captures the step `fn(ctx, user)` on a tape of its own and runs it once. On CUDA it runs it
 *  twice: eagerly (queueing the work, and settling the allocator's and cuBLAS's first-use
 *  allocations), then under stream capture (recorded, not run) into a CUDA graph; elsewhere
 *  once, recording what it did. Either way the step's work has run once when this returns.
 *  @return DTR_OK, DTR_NULL_HANDLE, the context's sticky error, DTR_BAD_STATE (a capture is
 *          under way on ctx, a refused call inside fn, or fn's second run differing from its
 *          first), DTR_UNSUPPORTED (a refused op, a gradient hook of the app's on ctx, ZeRO-3), DTR_OUT_OF_MEMORY,
 *          a device error of the capture, or fn's error. The context's message says which.
 *  Thread safety: the context's thread; nothing else may use the context during the capture. */
DTR_API dtr_result dtr_graph_capture(dtr_context *ctx, dtr_graph_fn fn, void *user, dtr_graph **out);
/** Runs the captured step again: queues the graph on the context's stream (CUDA; returns
 *  before the work is done, like any op), or calls fn again on the graph's tape after resetting
 *  it, checking that it does the capture's work.
 *  @return DTR_OK, DTR_NULL_HANDLE, the context's sticky error, DTR_BAD_STATE (the step
 *          differs from its capture, a refused call, or an input of the capture freed by
 *          dtr_context_reset), a device error, or fn's error.
 *  Thread safety: the context's thread. */
DTR_API dtr_result dtr_graph_launch(dtr_graph *g);
/** 1 when launches replay a backend graph (CUDA), 0 when they call the step function again.
 *  Thread safety: any thread. */
DTR_API int dtr_graph_native(const dtr_graph *g);
/** Frees the graph and its tape, after the work of its launches has completed. Destroy every
 *  graph before its context. NULL is ignored. Thread safety: the context's thread. */
DTR_API void dtr_graph_destroy(dtr_graph *g);

/** The backend's name ("cpu", "cuda").
 *  Thread safety: the context's thread. */
DTR_API const char *dtr_context_backend_name(const dtr_context *ctx);

/* ---- tensors ---- */

/** New tensor of the step arena, contents undefined. Lives until dtr_context_reset().
 *  On error the sticky status is set and NULL returned (here and in every op builder).
 *  Thread safety: the context's thread. */
DTR_API dtr_tensor *dtr_tensor_new(dtr_context *ctx, dtr_dtype dt, int ndim, const int64_t *shape);
/** Shorthands of dtr_tensor_new for f32 tensors of 1 to 4 dims. */
DTR_API dtr_tensor *dtr_tensor_1d(dtr_context *ctx, int64_t n0);
DTR_API dtr_tensor *dtr_tensor_2d(dtr_context *ctx, int64_t n0, int64_t n1);
DTR_API dtr_tensor *dtr_tensor_3d(dtr_context *ctx, int64_t n0, int64_t n1, int64_t n2);
DTR_API dtr_tensor *dtr_tensor_4d(dtr_context *ctx, int64_t n0, int64_t n1, int64_t n2, int64_t n3);
/** New arena tensor filled with zeros / with `value`. */
DTR_API dtr_tensor *dtr_tensor_zeros(dtr_context *ctx, dtr_dtype dt, int ndim, const int64_t *shape);
DTR_API dtr_tensor *dtr_tensor_full(dtr_context *ctx, int ndim, const int64_t *shape, float value);
/** Arena tensor that copies `n = numel` elements of type `dt` from host memory `src`. */
DTR_API dtr_tensor *dtr_tensor_from(dtr_context *ctx, dtr_dtype dt, int ndim, const int64_t *shape, const void *src);

/** Shape queries. dtr_tensor_dim accepts negative axes (-1 is the last). NULL gives 0.
 *  Thread safety: the context's thread. */
DTR_API int dtr_tensor_ndim(const dtr_tensor *t);
DTR_API int64_t dtr_tensor_dim(const dtr_tensor *t, int axis);
DTR_API int64_t dtr_tensor_numel(const dtr_tensor *t);
DTR_API dtr_dtype dtr_tensor_dtype(const dtr_tensor *t);
/** Stride of `axis` in elements (views may be non-contiguous). */
DTR_API int64_t dtr_tensor_stride(const dtr_tensor *t, int axis);
/** 1 when the elements are dense in row-major order. */
DTR_API int dtr_tensor_is_contiguous(const dtr_tensor *t);
/** Pointer to the first element in host memory (CPU backend), honouring the view offset.
 *  NULL for tensors on a device: use dtr_tensor_read/write. */
DTR_API void *dtr_tensor_data(dtr_tensor *t);
/** Gradient of `t` after dtr_backward (contiguous f32, shape of `t`), or NULL. On a device
 *  backend the pointer is device memory: read it with dtr_tensor_read_grad. */
DTR_API float *dtr_tensor_grad(dtr_tensor *t);
/** Keeps the gradient of the intermediate tensor `t` (made by an op) after dtr_backward, as
 *  PyTorch's retain_grad: by default an intermediate's gradient is released once the op that
 *  made it has run its backward (dtr_context_config.retain_grads keeps all of them). Call it
 *  before dtr_backward. No effect on leaves and parameters, which always keep theirs.
 *  @return DTR_OK, DTR_NULL_HANDLE.
 *  Thread safety: the context's thread. */
DTR_API dtr_result dtr_tensor_retain_grad(dtr_tensor *t);
/** Keeps the data of the intermediate tensor `t` (and of the tensor it views) through
 *  dtr_backward when dtr_context_config.release_activations is on, for reading it afterwards
 *  (logits for accuracy, an activation a later micro-batch reuses). Call it before dtr_backward.
 *  No effect without release_activations, or on leaves, inputs and parameters, which always stay.
 *  @return DTR_OK, DTR_NULL_HANDLE, DTR_BAD_STATE (released already).
 *  Thread safety: the context's thread. */
DTR_API dtr_result dtr_tensor_retain(dtr_tensor *t);
/** Copies the gradient of `t` (n = numel(t) floats) into host memory `dst`, from any backend
 *  (a device's copy completes before it returns).
 *  @return DTR_OK, DTR_NULL_HANDLE, DTR_BAD_STATE (no gradient: not part of a backward pass),
 *  DTR_SHAPE_MISMATCH (n), DTR_DEVICE_ERROR. Thread safety: the tensor's context thread. */
DTR_API dtr_result dtr_tensor_read_grad(const dtr_tensor *t, float *dst, size_t n);
/** The name given to a parameter, or "". */
DTR_API const char *dtr_tensor_name(const dtr_tensor *t);
/** Copies the elements in row-major order into host memory `dst` converted to `dt`
 *  (`n` must equal numel). Works for any backend and any view. */
DTR_API dtr_result dtr_tensor_read(const dtr_tensor *t, dtr_dtype dt, void *dst, size_t n);
/** Copies `n` = numel elements of type `dt` from host memory into `t` (converted). */
DTR_API dtr_result dtr_tensor_write(dtr_tensor *t, dtr_dtype dt, const void *src, size_t n);
/** Copies src's elements into dst, both of one context, the same dtype and element count, and
 *  contiguous, in the backend's memory (on a GPU a device copy queued on the stream: no host
 *  wait). Not recorded for autograd. What feeds a captured step's inputs (dtr_graph_capture)
 *  from tensors the loader made (dtr_loader_tensors).
 *  @return DTR_OK, DTR_NULL_HANDLE, DTR_INVALID_ARGUMENT (another context, another dtype),
 *          DTR_SHAPE_MISMATCH (element counts), DTR_UNSUPPORTED (a non-contiguous view),
 *          DTR_BAD_STATE (a released tensor). Thread safety: the context's thread. */
DTR_API dtr_result dtr_tensor_copy(dtr_tensor *dst, const dtr_tensor *src);
/** f32 element at a flat row-major index of the logical shape; 0 on error. Handy in tests. */
DTR_API float dtr_tensor_get(const dtr_tensor *t, int64_t index);
/** Marks an arena tensor as requiring a gradient (a leaf the app wants dL/dt of). f32, bf16
 *  and f16 tensors (the gradient is f32 either way); others are DTR_DTYPE_MISMATCH. */
DTR_API dtr_tensor *dtr_tensor_requires_grad(dtr_tensor *t);

/* ---- ops (autograd) ----
 * Each op checks its inputs, records a tape node when grad is enabled and any input needs a
 * gradient, runs the forward kernel of the context's backend and returns the result.
 * Inputs are float tensors (f32, bf16 or f16, computed in f32) unless stated (indices are
 * i32); outputs are dtr_context_config.activation_dtype (f32 by default; losses and whole
 * sums f32, views their input's dtype). On a bad shape, dtype or NULL input the
 * op records a message naming itself on the context and returns NULL; an op given NULL
 * passes the NULL on, so a whole graph can be built and the status checked once.
 * Binary element-wise ops broadcast as NumPy does. Shapes: B batch, T time, C channels. */

/** Element-wise a + b, a - b, a * b, a / b with broadcasting.
 *  Thread safety: the context's thread. */
DTR_API dtr_tensor *dtr_add(dtr_context *ctx, dtr_tensor *a, dtr_tensor *b);
DTR_API dtr_tensor *dtr_sub(dtr_context *ctx, dtr_tensor *a, dtr_tensor *b);
DTR_API dtr_tensor *dtr_mul(dtr_context *ctx, dtr_tensor *a, dtr_tensor *b);
DTR_API dtr_tensor *dtr_div(dtr_context *ctx, dtr_tensor *a, dtr_tensor *b);
/** Element-wise max(a, b) and min(a, b) with broadcasting, PyTorch's torch.maximum and
 *  torch.minimum: NaN in either gives NaN; the gradient goes to the larger (smaller) input,
 *  half to each at a tie, whole to both where one is NaN (a clipped objective, as PPO's:
 *  dtr_minimum(ctx, dtr_mul(ctx, r, adv), dtr_mul(ctx, dtr_clamp(ctx, r, 0.8f, 1.2f), adv))).
 *  Thread safety: the context's thread. */
DTR_API dtr_tensor *dtr_maximum(dtr_context *ctx, dtr_tensor *a, dtr_tensor *b);
DTR_API dtr_tensor *dtr_minimum(dtr_context *ctx, dtr_tensor *a, dtr_tensor *b);
/** s * x. */
DTR_API dtr_tensor *dtr_scale(dtr_context *ctx, dtr_tensor *x, float s);
/** Activations, element-wise. gelu is the tanh approximation (as GPT-2).
 *  relu keeps NaN (relu(NaN) is NaN) and passes the gradient through at NaN, as PyTorch's
 *  torch.relu (whose backward zeroes it only where x <= 0).
 *  Thread safety: the context's thread. */
DTR_API dtr_tensor *dtr_relu(dtr_context *ctx, dtr_tensor *x);
/** GELU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), PyTorch's
 *  gelu(x, approximate='tanh') and GPT-2's; dtr_gelu_erf is the exact form.
 *  Thread safety: the context's thread. */
DTR_API dtr_tensor *dtr_gelu(dtr_context *ctx, dtr_tensor *x);
DTR_API dtr_tensor *dtr_tanh(dtr_context *ctx, dtr_tensor *x);
DTR_API dtr_tensor *dtr_sigmoid(dtr_context *ctx, dtr_tensor *x);
/** |x| element-wise (|NaN| is NaN). Its gradient is sign(x) as PyTorch's torch.abs: 0 at 0,
 *  and 0 at NaN (PyTorch's torch.sign(nan) is 0).
 *  Thread safety: the context's thread (as every builder). */
DTR_API dtr_tensor *dtr_abs(dtr_context *ctx, dtr_tensor *x);
/** GELU in its exact form, x * Phi(x) with the normal CDF through erf: PyTorch's
 *  torch.nn.functional.gelu(x) (approximate='none'). dtr_gelu is the tanh approximation,
 *  gelu(x, approximate='tanh'), the form of GPT-2. Thread safety: the context's thread. */
DTR_API dtr_tensor *dtr_gelu_erf(dtr_context *ctx, dtr_tensor *x);
/** SiLU (swish): x * sigmoid(x), PyTorch's torch.nn.functional.silu (Llama's SwiGLU gate:
 *  dtr_mul(ctx, dtr_silu(ctx, gate), up)). Thread safety: the context's thread. */
DTR_API dtr_tensor *dtr_silu(dtr_context *ctx, dtr_tensor *x);
/** Leaky ReLU: x where x > 0, else slope * x (PyTorch's leaky_relu, whose default slope is
 *  0.01); the gradient 1 above 0, slope at and below 0. Thread safety: the context's thread. */
DTR_API dtr_tensor *dtr_leaky_relu(dtr_context *ctx, dtr_tensor *x, float slope);
/** Softplus: log(1 + exp(beta x)) / beta, and x itself where beta x > threshold (PyTorch's
 *  nn.functional.softplus(x, beta, threshold); its defaults are 1 and 20). A smooth ReLU, and
 *  a positive output (a standard deviation, a rate). beta not positive and finite is
 *  DTR_INVALID_ARGUMENT. Thread safety: the context's thread. */
DTR_API dtr_tensor *dtr_softplus(dtr_context *ctx, dtr_tensor *x, float beta, float threshold);
/** exp(x) (the library's exp: within 1.3 units in the last place; 0 below -104, inf above
 *  88.7); log(x) (-inf at 0, NaN below); sqrt(x) (NaN below 0); x^p for a constant p (powf:
 *  NaN for a negative x and a p that is not whole). Gradients as PyTorch's: exp(x), 1 / x,
 *  1 / (2 sqrt(x)) (inf at 0), p x^(p-1) (0 when p is 0). Thread safety: the context's thread. */
DTR_API dtr_tensor *dtr_exp(dtr_context *ctx, dtr_tensor *x);
DTR_API dtr_tensor *dtr_log(dtr_context *ctx, dtr_tensor *x);
DTR_API dtr_tensor *dtr_sqrt(dtr_context *ctx, dtr_tensor *x);
DTR_API dtr_tensor *dtr_pow(dtr_context *ctx, dtr_tensor *x, float p);
/** min(max(x, lo), hi), PyTorch's torch.clamp: -INFINITY or INFINITY leaves a side open; hi
 *  everywhere when lo > hi; NaN stays NaN. The gradient passes on [lo, hi], ends included,
 *  and is 0 outside (and at NaN). A NaN bound is DTR_INVALID_ARGUMENT.
 *  Thread safety: the context's thread. */
DTR_API dtr_tensor *dtr_clamp(dtr_context *ctx, dtr_tensor *x, float lo, float hi);

/** Matrix product over the last two axes: (..., M, K) x (..., K, N) -> (..., M, N).
 *  Leading (batch) axes broadcast; a 2-D `b` is shared by every batch. Inputs may be
 *  transposed views (no copy).
 *  Thread safety: the context's thread. */
DTR_API dtr_tensor *dtr_matmul(dtr_context *ctx, dtr_tensor *a, dtr_tensor *b);
/** x (..., in) times w (out, in) transposed plus bias (out) (bias may be NULL): (..., out). */
DTR_API dtr_tensor *dtr_linear(dtr_context *ctx, dtr_tensor *x, dtr_tensor *w, dtr_tensor *bias);

/** Softmax and log-softmax over the last axis.
 *  Thread safety: the context's thread. */
DTR_API dtr_tensor *dtr_softmax(dtr_context *ctx, dtr_tensor *x);
DTR_API dtr_tensor *dtr_log_softmax(dtr_context *ctx, dtr_tensor *x);
/** Softmax over the last axis of (..., T, T) scores with a causal mask: position j > i of
 *  row i gets probability 0. */
DTR_API dtr_tensor *dtr_softmax_causal(dtr_context *ctx, dtr_tensor *x);

/** Mean cross-entropy of logits (N, K) (or (..., K)) against i32 class indices (N) (or (...)):
 *  dtr_cross_entropy_ex with dtr_xent_config_init's settings, PyTorch's F.cross_entropy
 *  defaults (a target of -100 is ignored). Another index outside [0, K) is
 *  DTR_INVALID_ARGUMENT. Returns a scalar (ndim 0).
 *  Thread safety: the context's thread. */
DTR_API dtr_tensor *dtr_cross_entropy(dtr_context *ctx, dtr_tensor *logits, dtr_tensor *targets);

/** How a loss's rows become its result. */
typedef enum dtr_loss_reduction {
    DTR_LOSS_MEAN = 0,   /**< the mean over the rows that count (a scalar) */
    DTR_LOSS_SUM = 1,    /**< their sum (a scalar) */
    DTR_LOSS_NONE = 2    /**< each row's loss, in the targets' shape (0 for an ignored row): weigh
                              them (a policy gradient's advantages, per-sample weights), then
                              reduce them yourself */
} dtr_loss_reduction;

/** PyTorch's F.cross_entropy arguments for class indices. */
typedef struct dtr_xent_config {
    int32_t ignore_index;          /**< rows whose target is this add no loss and no gradient and
                                        leave the mean's count (padding tokens of a batch of
                                        sequences); -100 from init, as PyTorch */
    float label_smoothing;         /**< in [0, 1): the target class weighs 1 - eps, every class
                                        eps / K (0 from init) */
    dtr_loss_reduction reduction;  /**< DTR_LOSS_MEAN from init */
} dtr_xent_config;

/** ignore_index -100, label_smoothing 0, reduction mean. Thread safety: any thread. */
DTR_API dtr_xent_config dtr_xent_config_init(void);
/** Cross-entropy of logits (..., K) against i32 class indices (...) with `cfg`'s ignored
 *  target, label smoothing and reduction (NULL: dtr_xent_config_init's). The mean of a batch
 *  whose every row is ignored is 0 (PyTorch gives NaN), with no gradient. A target outside
 *  [0, K) other than ignore_index is DTR_INVALID_ARGUMENT (when the forward runs); smoothing
 *  outside [0, 1) or an unknown reduction is DTR_INVALID_ARGUMENT. The logits are read in
 *  their own dtype (f32, bf16, f16), never copied to f32. Thread safety: the context's thread. */
DTR_API dtr_tensor *dtr_cross_entropy_ex(dtr_context *ctx, dtr_tensor *logits, dtr_tensor *targets,
                                         const dtr_xent_config *cfg);
/** Mean squared error between same-shaped tensors; scalar. */
DTR_API dtr_tensor *dtr_mse(dtr_context *ctx, dtr_tensor *pred, dtr_tensor *target);
/** Binary cross-entropy of logits against targets in [0, 1] (0/1 labels or soft ones), same
 *  shapes, the mean over every element: PyTorch's binary_cross_entropy_with_logits (no
 *  weights), mean(log(1 + exp(x)) - x t), stable for any logit (no exp overflows). Multi-label
 *  classification, a yes/no head, a discriminator. Scalar; gradients to both inputs.
 *  Thread safety: the context's thread. */
DTR_API dtr_tensor *dtr_bce_with_logits(dtr_context *ctx, dtr_tensor *logits, dtr_tensor *target);
/** Huber loss, PyTorch's huber_loss(pred, target, delta=delta): per element d^2 / 2 where |d| =
 *  |pred - target| <= delta, delta (|d| - delta / 2) beyond; the mean over every element. MSE
 *  near the target, L1 far from it (outliers pull less). smooth_l1_loss(beta) is this with
 *  delta = beta, divided by beta. delta not positive and finite is DTR_INVALID_ARGUMENT.
 *  Thread safety: the context's thread. */
DTR_API dtr_tensor *dtr_huber_loss(dtr_context *ctx, dtr_tensor *pred, dtr_tensor *target, float delta);

/** Sum / mean over `axis` (negative allowed); keepdim keeps it as size 1. The mean over an
 *  axis of size 0 is NaN (0 / 0), as PyTorch's torch.mean; the sum of nothing is 0.
 *  Thread safety: the context's thread. */
DTR_API dtr_tensor *dtr_sum(dtr_context *ctx, dtr_tensor *x, int axis, int keepdim);
DTR_API dtr_tensor *dtr_mean(dtr_context *ctx, dtr_tensor *x, int axis, int keepdim);
/** The largest (smallest) value over `axis` (negative allowed; keepdim keeps it as size 1),
 *  PyTorch's torch.max(x, dim).values / torch.min: the gradient goes to that element (the
 *  first of ties); a NaN is the largest and the smallest (it propagates, as PyTorch). Global
 *  max pooling over time, the best action's value of a Q-network. An axis outside x or of
 *  size 0: DTR_INVALID_ARGUMENT. Thread safety: the context's thread. */
DTR_API dtr_tensor *dtr_max(dtr_context *ctx, dtr_tensor *x, int axis, int keepdim);
DTR_API dtr_tensor *dtr_min(dtr_context *ctx, dtr_tensor *x, int axis, int keepdim);
/** Where the largest (smallest) value over `axis` is: an i32 tensor of dtr_max's shape (the
 *  first of ties; a NaN's index when there is one), computed where x lives (a GPU's logits
 *  become predictions without copying them to the host). No gradient flows through it.
 *  Errors as dtr_max's. Thread safety: the context's thread. */
DTR_API dtr_tensor *dtr_argmax(dtr_context *ctx, dtr_tensor *x, int axis, int keepdim);
DTR_API dtr_tensor *dtr_argmin(dtr_context *ctx, dtr_tensor *x, int axis, int keepdim);
/** Sum / mean of all elements; scalar. The mean of an empty tensor is NaN, as PyTorch's
 *  torch.mean (dtr_mse of empty tensors too); the sum is 0.
 *  Thread safety: the context's thread. */
DTR_API dtr_tensor *dtr_sum_all(dtr_context *ctx, dtr_tensor *x);
DTR_API dtr_tensor *dtr_mean_all(dtr_context *ctx, dtr_tensor *x);

/** Rows of `table` (V, C) picked by i32 `ids` (any shape S): (S..., C). An id outside [0, V)
 *  is DTR_INVALID_ARGUMENT.
 *  Thread safety: the context's thread. */
DTR_API dtr_tensor *dtr_embedding(dtr_context *ctx, dtr_tensor *table, dtr_tensor *ids);
/** Values of x picked along `axis` by i32 `index` (PyTorch's torch.gather / take_along_dim):
 *  index has x's shape but for that axis (any length M), and out[..., m, ...] =
 *  x[..., index[..., m, ...], ...] (out has index's shape). The gradient adds back into the
 *  picked places (an index repeated adds up). A Q-network's value of the actions taken
 *  (x (B, A), index (B, 1)), the log-probabilities of chosen tokens, a top-k's values. An index
 *  outside [0, x's axis length) is DTR_INVALID_ARGUMENT (on a GPU, reported at the next
 *  synchronisation); another shape, DTR_SHAPE_MISMATCH. Thread safety: the context's thread. */
DTR_API dtr_tensor *dtr_gather(dtr_context *ctx, dtr_tensor *x, int axis, dtr_tensor *index);
/** Layer normalisation over the last axis with gain `w` and bias `b` (C) (either may be NULL). */
DTR_API dtr_tensor *dtr_layernorm(dtr_context *ctx, dtr_tensor *x, dtr_tensor *w, dtr_tensor *b, float eps);
/** Batch normalisation of x (N, C, ...) ((N, C) features, (N, C, L) sequences, (N, C, H, W)
 *  images), PyTorch's F.batch_norm: per channel, (x - mean) / sqrt(var + eps) * w + b (w, b
 *  (C), either may be NULL). training 1: mean and var are the batch's (over N and the
 *  positions; var biased), and running_mean, running_var (C) (dense f32 without gradients:
 *  model buffers; both or neither) move towards them by `momentum` (PyTorch's 0.1; the
 *  variance unbiased), written by the op's kernel on its backend (a captured step's replay
 *  updates them too; a dtr_checkpoint region's recomputation does not, so they move once a
 *  step). training 0: the running statistics (required). Gradients for x, w and b either way.
 *  @return NULL with the context's error: DTR_SHAPE_MISMATCH (x under 2 axes; a vector not
 *          (C); training with one value a channel), DTR_INVALID_ARGUMENT (eps <= 0, momentum
 *          outside [0, 1], running statistics missing, half given, or not dense f32 buffers).
 *  Thread safety: the context's thread. */
DTR_API dtr_tensor *dtr_batch_norm(dtr_context *ctx, dtr_tensor *x, dtr_tensor *w, dtr_tensor *b, dtr_tensor *running_mean,
                                   dtr_tensor *running_var, int training, float momentum, float eps);
/** One LSTM cell step as one op: from the gates' pre-activations (..., 4H) (rows i, f, g, o:
 *  x W_ih^T + b_ih + h W_hh^T + b_hh) and the cell before, c (..., H) (NULL: zeros), returns
 *  h' = sigmoid(o) tanh(c') (..., H) and sets *c_out = c' = sigmoid(f) c + sigmoid(i) tanh(g),
 *  both views of one (..., 2H) output; the gradients of both flow back into gates and c.
 *  dtr_lstm_layer uses it (one kernel a step instead of a dozen ops). DTR_SHAPE_MISMATCH for
 *  a last axis not 4H or c not (..., H). Thread safety: the context's thread. */
DTR_API dtr_tensor *dtr_lstm_cell(dtr_context *ctx, dtr_tensor *gates, dtr_tensor *c, dtr_tensor **c_out);
/** A whole LSTM recurrence as one op (as cuDNN and oneDNN run one): gx (T, B, 4H), time-major,
 *  the input's part of every step's gates (x_t W_ih^T + b_ih: one dtr_linear over all steps),
 *  w_hh (4H, H), b_hh (4H) or NULL, h0 and c0 (B, H) or NULL (zeros). Step t's gates are
 *  gx_t + (h_{t-1} W_hh^T + b_hh), then dtr_lstm_cell's formulas. Returns every step's h
 *  (T, B, H) and sets *c_out to every step's c (T, B, H): views of one (T, B, 2H) output. The
 *  values of T steps of dtr_linear, dtr_add and dtr_lstm_cell (bit for bit on the CPU) without
 *  a node or a view a step: backward walks the steps in reverse with one GEMM a step (the
 *  gradient of h) and one GEMM over all steps for w_hh's. Gradients reach gx, w_hh, b_hh, h0
 *  and c0 from any step's h and c. dtr_lstm_layer_forward runs on it. 16-bit activations: the
 *  recurrence runs in f32 inside the op and its output is rounded once.
 *  @return NULL with the context's error: DTR_NULL_HANDLE (c_out NULL), DTR_SHAPE_MISMATCH
 *          (w_hh not (4H, H), gx not (T, B, 4H) with T, B > 0, b_hh not (4H), h0 or c0 not
 *          (B, H)). Thread safety: the context's thread. */
DTR_API dtr_tensor *dtr_lstm_sequence(dtr_context *ctx, dtr_tensor *gx, dtr_tensor *w_hh, dtr_tensor *b_hh, dtr_tensor *h0,
                                      dtr_tensor *c0, dtr_tensor **c_out);
/** A whole GRU recurrence as one op, as dtr_lstm_sequence: gx (T, B, 3H), time-major (x_t
 *  W_ih^T + b_ih), w_hh (3H, H), b_hh (3H) or NULL, h0 (B, H) or NULL (zeros). Step t, with
 *  gh = h_{t-1} W_hh^T + b_hh: r = sigmoid(gx_r + gh_r), z = sigmoid(gx_z + gh_z), n = tanh(gx_n
 *  + r gh_n), h_t = n + z (h_{t-1} - n) (PyTorch's nn.GRU). Returns every step's h (T, B, H).
 *  The values of the steps made of ops (dtr_linear, dtr_add, dtr_sigmoid, dtr_mul, dtr_tanh,
 *  dtr_sub) bit for bit on the CPU; gradients reach gx, w_hh, b_hh and h0.
 *  dtr_gru_layer_forward runs on it. @return NULL with the context's error: DTR_SHAPE_MISMATCH
 *  (w_hh not (3H, H), gx not (T, B, 3H) with T, B > 0, b_hh not (3H), h0 not (B, H)).
 *  Thread safety: the context's thread. */
DTR_API dtr_tensor *dtr_gru_sequence(dtr_context *ctx, dtr_tensor *gx, dtr_tensor *w_hh, dtr_tensor *b_hh, dtr_tensor *h0);
/** Group normalisation of x (N, C, ...) (images (N, C, H, W), sequences (N, C, L)): the C
 *  channels in `groups` groups of C / groups, each group of each sample normalised over its
 *  channels and positions (mean 0, variance 1, eps added to the variance), then per channel
 *  times `w` plus `b` (C) (either may be NULL): PyTorch's group_norm. No batch statistics, so
 *  the result of a sample does not depend on the others or the batch size (a CNN's norm for
 *  small batches and data parallelism); groups = C is instance norm, groups = 1 a layer norm
 *  over (C, ...). C not divisible by groups is DTR_SHAPE_MISMATCH.
 *  Thread safety: the context's thread. */
DTR_API dtr_tensor *dtr_group_norm(dtr_context *ctx, dtr_tensor *x, int groups, dtr_tensor *w, dtr_tensor *b, float eps);
/** RMS normalisation over the last axis (Llama's): x / sqrt(mean(x^2) + eps) * w, `w` (C) or
 *  NULL; PyTorch's nn.RMSNorm. Errors as dtr_layernorm's (eps must be > 0).
 *  Thread safety: the context's thread. */
DTR_API dtr_tensor *dtr_rmsnorm(dtr_context *ctx, dtr_tensor *x, dtr_tensor *w, float eps);
/** Inverted dropout with probability p, from the context's seeded RNG; identity when the
 *  context is in evaluation mode or p == 0. */
DTR_API dtr_tensor *dtr_dropout(dtr_context *ctx, dtr_tensor *x, float p);

/** 2-D convolution: x (N, C, H, W), w (O, C, KH, KW), bias (O) or NULL -> (N, O, H', W'),
 *  H' = (H + 2 padding - KH) / stride + 1 (W' alike): PyTorch's conv2d (a cross-correlation).
 *  Wrong ranks or channels, a kernel larger than the padded input: DTR_SHAPE_MISMATCH; stride
 *  < 1 or padding < 0: DTR_INVALID_ARGUMENT. dtr_conv2d_ex adds per-axis geometry, dilation
 *  and groups. Thread safety: the context's thread. */
DTR_API dtr_tensor *dtr_conv2d(dtr_context *ctx, dtr_tensor *x, dtr_tensor *w, dtr_tensor *bias,
                               int stride, int padding);

/** A convolution's geometry, PyTorch's Conv2d arguments: per axis (index 0 height, 1 width)
 *  the stride, the zero padding on both sides and the dilation (the kernel's taps `dilation`
 *  apart: a 3-tap kernel with dilation 2 spans 5 inputs), and `groups` (C and O divisible by
 *  it; group g's O / groups outputs see only its C / groups input channels, so w is
 *  (O, C / groups, KH, KW); groups = C is a depthwise convolution, MobileNet's). */
typedef struct dtr_conv_config {
    int stride[2];                /**< >= 1; 1 from init */
    int padding[2];               /**< >= 0; 0 from init */
    int dilation[2];              /**< >= 1; 1 from init */
    int output_padding[2];        /**< a transposed convolution's extra rows and columns at the
                                       end (0 from init; below the stride or the dilation;
                                       must be 0 for a convolution) */
    int groups;                   /**< >= 1; 1 from init */
} dtr_conv_config;

/** Stride 1, padding 0, dilation 1, groups 1 (dtr_conv2d's with stride 1, padding 0).
 *  Thread safety: any thread. */
DTR_API dtr_conv_config dtr_conv_config_init(void);
/** 2-D convolution with the geometry of `cfg` (NULL: dtr_conv_config_init's): x (N, C, H, W),
 *  w (O, C / groups, KH, KW), bias (O) or NULL -> (N, O, H', W') with
 *  H' = (H + 2 padding[0] - dilation[0] (KH - 1) - 1) / stride[0] + 1 (W' alike with index 1).
 *  Errors as dtr_conv2d's; C or O not divisible by groups, or w's second axis not
 *  C / groups: DTR_SHAPE_MISMATCH; dilation or groups < 1: DTR_INVALID_ARGUMENT (groups:
 *  DTR_SHAPE_MISMATCH). On the CPU and CUDA backends, every dtype dtr_conv2d takes.
 *  Thread safety: the context's thread. */
DTR_API dtr_tensor *dtr_conv2d_ex(dtr_context *ctx, dtr_tensor *x, dtr_tensor *w, dtr_tensor *bias,
                                  const dtr_conv_config *cfg);
/** Transposed 2-D convolution (PyTorch's conv_transpose2d, the gradient of dtr_conv2d_ex with
 *  respect to its input; a decoder's, a GAN generator's or a U-Net's learned upsampling):
 *  x (N, Cin, H, W), w (Cin, Cout / groups, KH, KW), bias (Cout) or NULL -> (N, Cout, H', W'),
 *  H' = (H - 1) stride[0] - 2 padding[0] + dilation[0] (KH - 1) + output_padding[0] + 1 (W'
 *  alike). `cfg` as dtr_conv2d_ex's (NULL: dtr_conv_config_init's); a stride-s convolution's
 *  input size comes back with output_padding = (its input + 2 padding - the dilated kernel) mod s.
 *  Wrong ranks, w's first axis not Cin, Cin not divisible by groups, no output:
 *  DTR_SHAPE_MISMATCH; bad geometry values: DTR_INVALID_ARGUMENT.
 *  Thread safety: the context's thread. */
DTR_API dtr_tensor *dtr_conv_transpose2d(dtr_context *ctx, dtr_tensor *x, dtr_tensor *w, dtr_tensor *bias,
                                         const dtr_conv_config *cfg);
/** 1-D convolution over sequences: x (N, C, L), w (O, C / groups, K), bias (O) or NULL ->
 *  (N, O, L'), L' = (L + 2 padding - dilation (K - 1) - 1) / stride + 1: PyTorch's conv1d
 *  (the 2-D op over (N, C, 1, L); its errors, as dtr_conv2d_ex's). A causal convolution (a
 *  temporal convolutional network's) pads dilation (K - 1) zeros on the left only: concatenate
 *  them to x and pass padding 0. Thread safety: the context's thread. */
DTR_API dtr_tensor *dtr_conv1d(dtr_context *ctx, dtr_tensor *x, dtr_tensor *w, dtr_tensor *bias,
                               int stride, int padding, int dilation, int groups);
/** Max and average pooling over (N, C, H, W) with a k x k window. stride 0 means k.
 *  Average pooling divides by k*k (padding counts as zeros). Max pooling propagates NaN as
 *  PyTorch's max_pool2d: a window holding a NaN gives NaN, and its gradient goes to the NaN.
 *  Thread safety: the context's thread. */
DTR_API dtr_tensor *dtr_maxpool2d(dtr_context *ctx, dtr_tensor *x, int k, int stride, int padding);
DTR_API dtr_tensor *dtr_avgpool2d(dtr_context *ctx, dtr_tensor *x, int k, int stride, int padding);
/** Nearest-neighbour upsampling of x (N, C, H, W) by integer factors: (N, C, H sh, W sw), each
 *  value repeated over an sh x sw block (PyTorch's F.interpolate(mode='nearest') with
 *  scale_factor (sh, sw)); the gradient of an input is its block's sum. A U-Net's or a
 *  feature pyramid's way up (followed by a convolution: no checkerboard of a strided
 *  transposed one). A factor < 1: DTR_INVALID_ARGUMENT; x not 4-D: DTR_SHAPE_MISMATCH.
 *  Thread safety: the context's thread. */
DTR_API dtr_tensor *dtr_upsample_nearest2d(dtr_context *ctx, dtr_tensor *x, int sh, int sw);
/** 1-D max and average pooling over (N, C, L) with a window of k (PyTorch's max_pool1d and
 *  avg_pool1d): stride 0 means k, padding up to k / 2, the rules and errors of the 2-D ones.
 *  Thread safety: the context's thread. */
DTR_API dtr_tensor *dtr_maxpool1d(dtr_context *ctx, dtr_tensor *x, int k, int stride, int padding);
DTR_API dtr_tensor *dtr_avgpool1d(dtr_context *ctx, dtr_tensor *x, int k, int stride, int padding);

/** Causal multi-head self-attention core: q, k, v (B, T, C) with C = heads * D ->
 *  (B, T, C), softmax(q k^T / sqrt(D) + causal mask) v per head. One fused op (flash-style):
 *  query rows go in tiles through GEMMs with an exact softmax per row, and only each row's
 *  log-sum-exp is kept for backward, which recomputes the probabilities: memory grows with
 *  T, never with T x T per head. Results do not depend on the thread count. q, k and v may
 *  be views: those whose rows are dense (stride 1 along C, as the column slices
 *  `dtr_slice(qkv, -1, ...)` of one (B, T, 3C) projection) are read where they lie, others
 *  through a contiguous copy; the values are the same either way, bit for bit.
 *  Thread safety: the context's thread. */
DTR_API dtr_tensor *dtr_attention(dtr_context *ctx, dtr_tensor *q, dtr_tensor *k, dtr_tensor *v, int heads);

/** Rotary position embedding (RoPE, Llama's) of x (B, T, C), C = heads * D with D even: in
 *  each head of position t, pair j of its D/2 pairs is rotated by the angle t theta^(-2j/D)
 *  (computed in double). The pairs are the elements (j, j + D/2) with interleaved 0 (Hugging
 *  Face Llama's rotate_half), or (2j, 2j + 1) with interleaved 1 (Meta's Llama, GPT-J).
 *  theta: 10000 (Llama 1 and 2), 500000 (Llama 3). Apply it to q and k before dtr_attention:
 *  their scores then depend on the positions' difference only. x may be a view (q, k column
 *  slices of one projection); the output is dense. Positions start at 0 for every item
 *  (dtr_rope_at: elsewhere).
 *  Errors (NULL, the context's error set): DTR_SHAPE_MISMATCH (x not 3-D, heads not dividing C
 *  into even widths), DTR_INVALID_ARGUMENT (heads <= 0, theta not > 0 and finite).
 *  Thread safety: the context's thread. */
DTR_API dtr_tensor *dtr_rope(dtr_context *ctx, dtr_tensor *x, int heads, float theta, int interleaved);
/** dtr_rope with the rows at positions start .. start + T - 1 (every item): the new tokens of a
 *  generation step after `start` cached ones (dtr_kv_cache) get the angles the whole sequence
 *  would give them. dtr_rope is start 0. Errors: dtr_rope's, and DTR_INVALID_ARGUMENT for a
 *  negative start. Thread safety: the context's thread. */
DTR_API dtr_tensor *dtr_rope_at(dtr_context *ctx, dtr_tensor *x, int heads, float theta, int interleaved, int64_t start);

/** What dtr_attention_ex computes. Make one with dtr_attention_config_init(). */
typedef struct dtr_attention_config {
    int heads;     /**< heads H, dividing C: head h reads columns h*D .. h*D+D-1, D = C / H */
    int causal;    /**< 1: query t sees keys 0 .. q_start + t (self-attention: q_start 0,
                        Tq == Tk, as dtr_attention); 0: every query sees every key
                        (encoders, cross-attention) */
    float scale;   /**< the scores' factor: softmax(scale q k^T) v; 0 means 1 / sqrt(D) */
    int kv_heads;  /**< grouped-query attention (Llama 2 70B, Llama 3, Mistral): k and v have
                        kv_heads heads of width D, (B, Tk, kv_heads * D), each shared by
                        heads / kv_heads consecutive q heads (q head h reads kv head
                        h / (heads / kv_heads)); 1 is multi-query attention; 0 means heads */
    dtr_tensor *key_lengths;   /**< NULL: every key. Else i32 (B): item b's keys are
                                    0 .. key_lengths[b] - 1, the rest padding (masked for every
                                    query, so their k and v get zero gradients); each in [1, Tk] */
    int64_t q_start;   /**< causal only: the key position of query 0, 0 from init, with
                            q_start + Tq <= Tk. Generating with a KV cache: the Tq new tokens'
                            queries against the cache's keys (Tk its capacity), q_start the
                            tokens cached before them; keys past q_start + Tq - 1 are never
                            read (their contents do not matter) */
    float dropout;     /**< while training (dtr_context_set_training), each attention weight is
                            zeroed with this probability and the others scaled by 1 / (1 - dropout):
                            scaled_dot_product_attention's dropout_p, in [0, 1), 0 from init. The
                            mask is dtr_dropout's of the weights as a (B, H, Tq, Tk) tensor: the
                            next B H Tq Tk draws of the context's stream, drawn again in backward,
                            never stored. None in evaluation mode */
    int mask_heads;    /**< dropout under tensor parallelism (dtr_tp_attention sets both): these
                            heads are mask_head0 .. of a layer of mask_heads heads, and the call
                            draws its heads' share of that layer's (B, mask_heads, Tq, Tk) mask
                            (the stream moves past all of it), so the ranks together drop what one
                            device would. 0 (init's): heads, the whole layer */
    int mask_head0;    /**< the first of these heads among mask_heads (0 from init) */
} dtr_attention_config;

/** heads, causal as given, scale 0 (1 / sqrt(D)), no key lengths, q_start 0, no dropout.
 *  Thread safety: any thread. */
DTR_API dtr_attention_config dtr_attention_config_init(int heads, int causal);

/** Multi-head attention, causal or not, self or cross, with padded keys and grouped-query
 *  heads: q (B, Tq, C), k and v (B, Tk, kv_heads * D) (C when kv_heads is 0) -> (B, Tq, C),
 *  per head softmax(scale q k^T + mask) v: PyTorch's scaled_dot_product_attention on the
 *  (B, H, T, D) views, is_causal as cfg->causal, cfg->key_lengths a boolean attn_mask hiding
 *  item b's keys from key_lengths[b] on, kv_heads its enable_gqa=True. The fused op of
 *  dtr_attention (whose doc says how it runs and which views it reads in place) with the
 *  config's choices; dtr_attention(q, k, v, heads) is this with
 *  dtr_attention_config_init(heads, 1). A causal config needs q_start + Tq <= Tk (with
 *  q_start 0 and Tq < Tk it is PyTorch's is_causal, aligned at the first key). Tk may be 0
 *  only when Tq is 0 too (a row with no keys has no softmax).
 *  Errors (NULL, the context's error set): DTR_SHAPE_MISMATCH (ranks, B or k and v differing,
 *  k's width not kv_heads * D, causal with q_start + Tq > Tk, key_lengths not (B)),
 *  DTR_DTYPE_MISMATCH (key_lengths not i32), DTR_INVALID_ARGUMENT (heads not dividing C,
 *  kv_heads not dividing heads, a scale that is not finite, q_start negative or set on a
 *  config that is not causal, dropout outside [0, 1), mask_head0 + heads past mask_heads),
 *  DTR_UNSUPPORTED (dropout while training inside a captured step, dtr_graph_capture: a
 *  replay would repeat its mask), DTR_NULL_HANDLE (cfg NULL). A key length outside
 *  [1, Tk] is DTR_INVALID_ARGUMENT from the forward pass (the CPU: when the op runs; a GPU: at
 *  the next synchronisation, as an embedding's ids, the padding masked meanwhile as if the
 *  length were clamped into range).
 *  Thread safety: the context's thread. */
DTR_API dtr_tensor *dtr_attention_ex(dtr_context *ctx, dtr_tensor *q, dtr_tensor *k, dtr_tensor *v,
                                     const dtr_attention_config *cfg);

/** Converts to another dtype. f32 <-> bf16/f16: the backward pass converts the gradient
 *  straight through.
 *  Thread safety: the context's thread. */
DTR_API dtr_tensor *dtr_cast(dtr_context *ctx, dtr_tensor *x, dtr_dtype dt);

/* ---- views ----
 * Views share storage with their input (no copy) and have their own gradient. Ops accept
 * non-contiguous views. */

/** Same elements, new shape; one entry may be -1. Copies only if `x` is not contiguous.
 *  Thread safety: the context's thread. */
DTR_API dtr_tensor *dtr_reshape(dtr_context *ctx, dtr_tensor *x, int ndim, const int64_t *shape);
/** Swaps two axes. */
DTR_API dtr_tensor *dtr_transpose(dtr_context *ctx, dtr_tensor *x, int axis0, int axis1);
/** Reorders axes: result axis i is input axis perm[i]. */
DTR_API dtr_tensor *dtr_permute(dtr_context *ctx, dtr_tensor *x, const int *perm);
/** Elements [start, end) of `axis` (negative values count from the end). */
DTR_API dtr_tensor *dtr_slice(dtr_context *ctx, dtr_tensor *x, int axis, int64_t start, int64_t end);
/** Concatenates n tensors along `axis` (a copy). */
DTR_API dtr_tensor *dtr_concat(dtr_context *ctx, dtr_tensor *const *xs, int n, int axis);
/** A contiguous copy of `x` (or `x` itself when it already is). */
DTR_API dtr_tensor *dtr_contiguous(dtr_context *ctx, dtr_tensor *x);

/* ---- autograd ---- */

/** Runs the tape backwards from the scalar `loss` (seed 1). Gradients of parameters
 *  accumulate into the model's gradient buffer (call dtr_model_zero_grad between steps, or
 *  let the optimizer do it); gradients of other tensors live in the arena.
 *  Several backward passes over one tape (two losses sharing a graph, each with its own
 *  dtr_backward before dtr_context_reset) are correct: parameter and leaf gradients
 *  accumulate the sum over the passes, intermediate gradients start from zero in each pass
 *  (PyTorch's retain_graph=True). The gradient hooks (dtr_context_add_grad_hook) run in
 *  every pass.
 *  @return DTR_OK, DTR_NULL_HANDLE, DTR_SHAPE_MISMATCH (loss not a scalar), DTR_BAD_STATE
 *          (grad recording was off), or the sticky error.
 *  Thread safety: the context's thread. */
DTR_API dtr_result dtr_backward(dtr_context *ctx, dtr_tensor *loss);

/** Backward from any tensor `out` of the tape with the upstream gradient `grad` (host, f32,
 *  numel(out) values in out's row-major order): what a pipeline stage runs with the gradient
 *  its next stage sent back. dtr_backward(loss) is the case grad = {1}. The gradients reached
 *  are those of sum(out * grad). A leaf `out` just accumulates grad. Passes behave as for
 *  dtr_backward. @return as dtr_backward, DTR_NULL_HANDLE for a NULL grad.
 *  Thread safety: the context's thread. */
DTR_API dtr_result dtr_backward_from(dtr_context *ctx, dtr_tensor *out, const float *grad);

/** A backend's completion handle: marks work queued on a context's stream. NULL is an event
 *  that has completed (the CPU backend's events are always NULL). Valid until the next
 *  dtr_context_reset of its context.
 *  Thread safety: the context's thread. */
typedef struct dtr_event dtr_event;
/** Blocks the calling thread until `ev` has completed (NULL: returns at once).
 *  @return DTR_OK, DTR_NULL_HANDLE, DTR_DEVICE_ERROR. Thread safety: any thread, while the
 *  context lives and is not reset. */
DTR_API dtr_result dtr_event_wait(dtr_context *ctx, dtr_event *ev);
/** Sets *done to 1 when `ev` has completed, else 0, without blocking.
 *  @return DTR_OK, DTR_NULL_HANDLE, DTR_DEVICE_ERROR. Thread safety: as dtr_event_wait. */
DTR_API dtr_result dtr_event_query(dtr_context *ctx, dtr_event *ev, int *done);

/* ---- state: what a full-state checkpoint saves ----
 * Every stateful object lists its state the same way: entry i of the object (name, pointer,
 * bytes) through dtr_<object>_state(obj, i, &entry), DTR_NOT_FOUND past the last. A
 * checkpoint writes every entry of every object; a restore writes the bytes back through the
 * same pointers, then calls dtr_<object>_state_loaded(obj), which checks them and applies
 * what derives from them. Objects: context (random stream), model (parameters, gradients),
 * optimizer (step counters, schedule, moments), loader (cursor), data-parallel engine.
 * Entries stay valid until the object changes shape or is destroyed. */

/** One piece of an object's state. */
typedef struct dtr_state_entry {
    const char *name;   /**< stable within its object ("rng", "params", "m", "cursor", ...) */
    void *data;         /**< the bytes, writable */
    size_t bytes;
    int device;         /**< 1: data is memory of the context's backend (a GPU), not host memory:
                             copy it with dtr_tensor_read-like transfers of that backend */
} dtr_state_entry;

/** Entry `index` of the context's state: "rng" (the random stream dropout draws from).
 *  @return DTR_OK, DTR_NOT_FOUND past the last, DTR_NULL_HANDLE. Thread safety: the
 *  context's thread. */
DTR_API dtr_result dtr_context_state(dtr_context *ctx, int index, dtr_state_entry *out);
/** After writing the context's entries back. @return DTR_OK or DTR_NULL_HANDLE.
 *  Thread safety: the context's thread. */
DTR_API dtr_result dtr_context_state_loaded(dtr_context *ctx);

/* ---- random numbers ---- */

/** A small, fast, seedable generator (PCG32). Deterministic across platforms.
 *  Thread safety: one thread per generator. */
typedef struct dtr_rng { uint64_t state, inc; } dtr_rng;
/** Seeds a generator; different `stream` values give independent sequences. */
DTR_API void dtr_rng_seed(dtr_rng *rng, uint64_t seed, uint64_t stream);
DTR_API uint32_t dtr_rng_u32(dtr_rng *rng);
/** Uniform in [0, 1). */
DTR_API float dtr_rng_uniform(dtr_rng *rng);
/** Standard normal (Box-Muller). */
DTR_API float dtr_rng_normal(dtr_rng *rng);

/* ---- models, parameters, layers ---- */

typedef struct dtr_model dtr_model;

/** Parameter initialisers. Fan-in/fan-out are taken from the shape as PyTorch does
 *  (dim 1 times the receptive field is fan-in, dim 0 times it is fan-out). Append-only. */
typedef enum dtr_init {
    DTR_INIT_ZEROS = 0,
    DTR_INIT_ONES = 1,
    DTR_INIT_NORMAL = 2,          /**< N(0, arg^2) */
    DTR_INIT_UNIFORM = 3,         /**< U(-arg, arg) */
    DTR_INIT_KAIMING_UNIFORM = 4, /**< He et al., U(-b, b), b = sqrt(6 / fan_in) (ReLU gain) */
    DTR_INIT_KAIMING_NORMAL = 5,  /**< N(0, 2 / fan_in) */
    DTR_INIT_XAVIER_UNIFORM = 6,  /**< Glorot, U(-b, b), b = sqrt(6 / (fan_in + fan_out)) */
    DTR_INIT_XAVIER_NORMAL = 7,   /**< N(0, 2 / (fan_in + fan_out)) */
    DTR_INIT_TORCH_DEFAULT = 8    /**< PyTorch's nn.Linear/Conv default: U(-1/sqrt(fan_in), +) */
} dtr_init;

/** Creates an empty model on `ctx`. Parameters, gradients and optimizer state live in
 *  contiguous buffers the model owns (allocated once by dtr_model_build or the first use).
 *  @param seed  seeds every initialiser (parameter i uses stream i).
 *  Thread safety: the context's thread. */
DTR_API dtr_result dtr_model_create(dtr_context *ctx, uint64_t seed, dtr_model **out);
/** Frees the model, its buffers and its layers. NULL is ignored. */
DTR_API void dtr_model_destroy(dtr_model *m);

/** Declares a parameter. Names must be unique (they key checkpoints). `arg` is the std or
 *  bound for DTR_INIT_NORMAL / UNIFORM. Returns the parameter tensor (valid for the model's
 *  lifetime; its data exists after dtr_model_build), or NULL with the context's error set
 *  (duplicate name, bad shape, model already built).
 *  Thread safety: the context's thread. */
DTR_API dtr_tensor *dtr_model_param(dtr_model *m, const char *name, int ndim, const int64_t *shape,
                                    dtr_init init, float arg);
/** Declares a buffer: state of the model that is not trained, as batch norm's running
 *  statistics (PyTorch's register_buffer): f32, `value` in every element after build, found by
 *  dtr_model_find, saved and loaded by dtr_model_save / dtr_model_load beside the parameters
 *  (after them, by name), in the model's full state (entry "buffers") and so in checkpoints,
 *  split by dtr_model_keep as the parameters are. It has no gradient, and optimizers, the
 *  data-parallel and parameter-server engines never see it: buffers live in a block of their
 *  own, outside dtr_model_params (dtr_model_numel counts parameters only); each rank keeps its
 *  own. The ops that own a buffer write it (dtr_batch_norm); the app may write it with
 *  dtr_tensor_write. Errors as dtr_model_param's. Thread safety: the context's thread. */
DTR_API dtr_tensor *dtr_model_buffer(dtr_model *m, const char *name, int ndim, const int64_t *shape, float value);
/** Number of buffers, and buffer i in declaration order (or NULL). Thread safety: any thread. */
DTR_API int dtr_model_buffer_count(const dtr_model *m);
DTR_API dtr_tensor *dtr_model_buffer_at(const dtr_model *m, int i);
/** Keeps only the parameters whose names start with one of the n `prefixes` (for example the
 *  layers of one pipeline stage: {"h.2.", "h.3.", "ln_f."}; a '*' in a prefix matches any run
 *  of characters, as in dtr_model_set_trainable); call it after declaring the
 *  whole model and before dtr_model_build. Kept parameters start from the values they would
 *  have in the whole model (each parameter's initialiser stream is its declaration number),
 *  so a split model and the whole one train from the same weights. A parameter left out
 *  keeps its tensor (layer structs may point at it) but has no storage: an op given it fails
 *  with DTR_INVALID_ARGUMENT naming it. @return DTR_OK, DTR_NULL_HANDLE, DTR_INVALID_ARGUMENT
 *  (n < 0), DTR_BAD_STATE (already built), DTR_OUT_OF_MEMORY.
 *  Thread safety: the model's context thread. */
DTR_API dtr_result dtr_model_keep(dtr_model *m, const char *const *prefixes, int n);
/** Freezes (trainable 0) or unfreezes (1) the parameters whose names start with one of the n
 *  `prefixes` (n 0: every parameter): fine-tuning a loaded model's last layers, or training an
 *  adapter beside frozen weights. A '*' in a prefix matches any run of characters: "h.*.attn."
 *  is every block's attention, "*lora_" every LoRA adapter (dtr_linear_layer_add_lora). A frozen parameter gets no gradient (backward skips its
 *  weight-gradient products, and records no op whose inputs are all frozen or constant) and
 *  optimizers leave its values alone, weight decay included, and keep no state for it (Adam's
 *  moments of a frozen body cost nothing); its place in the parameter and gradient buffers
 *  stays (its gradient zeros, which data parallelism without ZeRO does not send; in host memory
 *  their pages are given back to the system at the next dtr_model_zero_grad and never read,
 *  so a frozen body's gradient takes no memory on the CPU; on a GPU the device's memory under it is given back
 *  when this returns, in whole granules of the device's mapping (2 MiB; docs/gpu.md, "Memory")). Takes effect at the next backward and
 *  optimizer step; unfreezing later is allowed (the optimizer lays its state out again at its
 *  next call: the moments of parameters trainable before and after are kept, the newly
 *  trainable ones start from zero and count their own steps from 1, as torch.optim's
 *  per-parameter "step": Adam's bias correction, SGD's first momentum step). An update taken
 *  while a parameter is frozen gives its optimizer state up (PyTorch keeps it); frozen and
 *  thawed between two updates it keeps it (the optimizer lays its state out at its next update:
 *  a GAN's discriminator, frozen while the generator's loss runs through it and stepped by an
 *  optimizer of its own). To pause one across updates and keep its state, leave it trainable
 *  and out of the loss: an update leaves out what no backward reached. Call it alike on every rank's model (data-parallel ranks,
 *  parameter servers, stages). A checkpoint restores with the trainable set it was saved with.
 *  @return DTR_OK, DTR_NULL_HANDLE, DTR_INVALID_ARGUMENT (n < 0), DTR_NOT_FOUND (no parameter
 *          matched: a misspelt prefix). Thread safety: the model's context thread. */
DTR_API dtr_result dtr_model_set_trainable(dtr_model *m, const char *const *prefixes, int n, int trainable);
/** Moves `target` toward `src`: every parameter and buffer becomes (1 - tau) target + tau src
 *  (each product rounded, then the sum: PyTorch's mul_(1 - tau), add_(src, alpha=tau)). A
 *  reinforcement learner's target network (a soft update, tau 0.005 each step), or an
 *  exponential moving average of the weights to evaluate and ship (tau = 1 - decay); tau 1
 *  copies src (a hard update), tau 0 leaves target. The two models need the same layers in
 *  the same order (parameters and buffers of equal shapes); both are built if they are not.
 *  Runs on target's backend (device memory stays on the device; a temporary of the model's
 *  size while it runs). src may live on another context: a GPU model's average kept in host
 *  memory on a CPU context, or the reverse (src's values come over through host memory; the
 *  same bits as on one context). @return DTR_OK, DTR_NULL_HANDLE, DTR_INVALID_ARGUMENT (tau
 *  outside [0, 1] or not finite), DTR_SHAPE_MISMATCH (another layout, naming the first
 *  parameter that differs), DTR_OUT_OF_MEMORY, DTR_DEVICE_OUT_OF_MEMORY, a copy's error.
 *  Thread safety: the thread of target's context, with no op running on src's. */
DTR_API dtr_result dtr_model_lerp(dtr_model *target, dtr_model *src, float tau);
/** 1 when parameter i is trainable (not frozen), 0 otherwise or out of range.
 *  Thread safety: the model's context thread. */
DTR_API int dtr_model_param_trainable(const dtr_model *m, int i);
/** Allocates the contiguous parameter and gradient buffers and runs the initialisers.
 *  Called automatically by the first forward use; calling it twice is harmless. */
DTR_API dtr_result dtr_model_build(dtr_model *m);
/** Number of parameters (tensors), and the contiguous buffers' length in floats: every
 *  parameter starts on a 64-byte boundary (16 floats), so dtr_model_numel is the parameters'
 *  element count plus that padding. */
DTR_API int dtr_model_param_count(const dtr_model *m);
DTR_API int64_t dtr_model_numel(const dtr_model *m);
/** Parameter i in declaration order, or NULL. */
DTR_API dtr_tensor *dtr_model_param_at(const dtr_model *m, int i);
/** Parameter or buffer by name, or NULL. */
DTR_API dtr_tensor *dtr_model_find(const dtr_model *m, const char *name);
/** Offset in elements of parameter i in the contiguous buffers. */
DTR_API int64_t dtr_model_param_offset(const dtr_model *m, int i);
/** The contiguous f32 parameter and gradient buffers (host pointers on the CPU backend;
 *  NULL before build). Layout: parameters in declaration order, each 16-float aligned.
 *  On a device they are device pointers: copy with dtr_model_read / dtr_model_write.
 *  Under ZeRO-3 (dtr_dp_config.zero) only this rank's shard and the units gathered now hold
 *  parameter values; the rest reads as NaN or zero until dtr_dp_gather_params. */
DTR_API float *dtr_model_params(dtr_model *m);
DTR_API float *dtr_model_grads(dtr_model *m);
/** Copies the whole parameter buffer (dtr_model_read, dtr_model_write) or gradient buffer
 *  (dtr_model_read_grads) to or from n host floats, n = dtr_model_numel, on any backend
 *  (the model is built first if it was not).
 *  @return DTR_OK, DTR_NULL_HANDLE, DTR_SHAPE_MISMATCH (n is not the model's size), or the
 *  build's or the device's error. Thread safety: the model's context thread. */
DTR_API dtr_result dtr_model_read(dtr_model *m, float *dst, int64_t n);
DTR_API dtr_result dtr_model_write(dtr_model *m, const float *src, int64_t n);
DTR_API dtr_result dtr_model_read_grads(dtr_model *m, float *dst, int64_t n);
/** The buffers' block (dtr_model_buffer), as the parameters': dtr_model_buffer_numel floats
 *  (each buffer 16-float aligned, in declaration order; 0 without buffers), copied to or from
 *  the host on any backend: to average batch norm's running statistics over data-parallel
 *  ranks, or to serve them beside a snapshot's weights. Errors as dtr_model_read's.
 *  Thread safety: the model's context thread. */
DTR_API int64_t dtr_model_buffer_numel(const dtr_model *m);
DTR_API dtr_result dtr_model_read_buffers(dtr_model *m, float *dst, int64_t n);
DTR_API dtr_result dtr_model_write_buffers(dtr_model *m, const float *src, int64_t n);
/** Zeroes the gradient buffer. */
DTR_API dtr_result dtr_model_zero_grad(dtr_model *m);
/** The context the model lives on. */
DTR_API dtr_context *dtr_model_context(const dtr_model *m);

/** Fully connected layer: weight (out, in), optional bias (out), optional LoRA adapter. */
typedef struct dtr_linear_layer {
    dtr_tensor *weight, *bias;
    int64_t in, out;
    dtr_tensor *lora_a, *lora_b;   /**< a LoRA adapter (dtr_linear_layer_add_lora): A (rank, in), B (out, rank); or NULL */
    float lora_scale;              /**< alpha / rank */
    float lora_dropout;            /**< dropout on the adapter's input while training (PEFT's lora_dropout;
                                        0 by default: set it after dtr_linear_layer_add_lora) */
} dtr_linear_layer;
/** 2-D convolution layer: weight (out, in / groups, kh, kw), bias (out) or NULL; forward
 *  convolves with `conv` (the geometry given to init; fields other than groups may change
 *  after init). A transposed one (dtr_conv_transpose2d_layer_init): weight
 *  (in, out / groups, kh, kw), PyTorch's ConvTranspose2d layout. */
typedef struct dtr_conv2d_layer {
    dtr_tensor *weight, *bias;
    int64_t in, out;
    int kh, kw;
    dtr_conv_config conv;
    int transposed;               /**< 1: forward is dtr_conv_transpose2d */
} dtr_conv2d_layer;
/** 1-D convolution layer: weight (out, in / groups, k), bias (out) or NULL; PyTorch's Conv1d
 *  (stride, padding, dilation, groups may change after init, groups only to a divisor that
 *  keeps the weight's shape). */
typedef struct dtr_conv1d_layer {
    dtr_tensor *weight, *bias;
    int64_t in, out;
    int k, stride, padding, dilation, groups;
} dtr_conv1d_layer;
/** Layer norm over the last axis: weight (C) = 1, bias (C) = 0; eps 1e-5, PyTorch's
 *  nn.LayerNorm default (the layer's `eps` field may be changed after init). */
typedef struct dtr_layernorm_layer { dtr_tensor *weight, *bias; int64_t dim; float eps; } dtr_layernorm_layer;
/** RMS norm over the last axis: weight (C) = 1; eps 1e-6, Llama's (Hugging Face
 *  LlamaRMSNorm's default; the `eps` field may be changed after init). */
typedef struct dtr_rmsnorm_layer { dtr_tensor *weight; int64_t dim; float eps; } dtr_rmsnorm_layer;
/** Batch norm (dtr_batch_norm) over `channels`, PyTorch's nn.BatchNorm1d/2d: parameters
 *  "<name>.weight" (C) = 1 and "<name>.bias" (C) = 0, buffers (dtr_model_buffer)
 *  "<name>.running_mean" (C) = 0 and "<name>.running_var" (C) = 1; eps 1e-5, momentum 0.1
 *  (fields; may be changed after init). PyTorch's num_batches_tracked is not kept (PyTorch
 *  loads a file without it). */
typedef struct dtr_batchnorm_layer {
    dtr_tensor *weight, *bias, *running_mean, *running_var;
    int64_t channels;
    float eps, momentum;
} dtr_batchnorm_layer;
/** Group norm (dtr_group_norm) over `channels` in `groups`: weight (C) = 1, bias (C) = 0, eps
 *  1e-5 (PyTorch's nn.GroupNorm; the names "<name>.weight", "<name>.bias" are its). */
typedef struct dtr_groupnorm_layer { dtr_tensor *weight, *bias; int64_t channels; int groups; float eps; } dtr_groupnorm_layer;
/** Embedding table (vocab, dim), N(0, 0.02^2) like GPT-2. */
typedef struct dtr_embedding_layer { dtr_tensor *weight; int64_t vocab, dim; } dtr_embedding_layer;
/** Self-attention, causal unless `causal` is set to 0 after init (a bidirectional encoder's:
 *  every position sees every other): parameters "<name>.qkv.weight" (3C, C), "<name>.qkv.bias" (3C),
 *  "<name>.proj.weight" (C, C), "<name>.proj.bias" (C), stored as nn.Linear stores them
 *  (out, in). The rows of qkv.weight are q | k | v: rows 0..C-1 give q, C..2C-1 k, 2C..3C-1 v;
 *  head h of `heads` uses features h*C/heads .. (h+1)*C/heads-1 of each (GPT-2's layout).
 *  Scores are scaled by 1/sqrt(C/heads). Hugging Face GPT-2 keeps these as Conv1D weights
 *  (in, out): transpose c_attn.weight and c_proj.weight when porting (docs/guide.md). */
typedef struct dtr_attention_layer {
    dtr_linear_layer qkv, proj;
    int64_t dim;
    int heads;
    int causal;    /**< 1 (init's): query t sees positions 0..t; 0: every position (dtr_attention_ex) */
    float dropout;         /**< while training, dropout on the attention weights (dtr_attention_config's;
                                Hugging Face GPT-2's attn_pdrop); 0 from init */
    float resid_dropout;   /**< while training, dropout on the output, after proj (resid_pdrop); 0 from init */
} dtr_attention_layer;
/** Pre-norm GPT block: x + attn(ln1(x)), then x + fc_proj(gelu(fc(ln2(x)))), GELU in its tanh
 *  form (dtr_gelu, GPT-2's). Parameters under "<name>.": ln1.weight/bias, attn.qkv.*,
 *  attn.proj.* (as dtr_attention_layer), ln2.weight/bias, fc.weight (4C, C), fc.bias (4C),
 *  fc_proj.weight (C, 4C), fc_proj.bias (C). Hugging Face GPT-2's h.<i>.ln_1, attn.c_attn,
 *  attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj map to them in that order (Conv1D weights
 *  transposed). Dropout while training: `dropout` (0 from init) on the attention weights, the
 *  attention's output and the MLP's output, nanoGPT's one knob (GPT-2: 0.1; fine-tuning on little
 *  data); with it 0, attn.dropout and attn.resid_dropout as set, and none on the MLP. */
typedef struct dtr_gpt_block {
    dtr_layernorm_layer ln1, ln2;
    dtr_attention_layer attn;
    dtr_linear_layer fc, fc_proj;
    float dropout;
} dtr_gpt_block;

/** LSTM (PyTorch's nn.LSTMCell; a one-layer nn.LSTM's weight_ih_l0 ... are the same tensors):
 *  parameters "<name>.weight_ih" (4H, I), "<name>.weight_hh" (4H, H), "<name>.bias_ih" (4H),
 *  "<name>.bias_hh" (4H), every one U(-1/sqrt(H), 1/sqrt(H)) as PyTorch's; their rows hold
 *  the gates i, f, g, o in that order: i, f, o = sigmoid, g = tanh of x W_ih^T + b_ih +
 *  h W_hh^T + b_hh; c' = f c + i g; h' = o tanh(c'). */
typedef struct dtr_lstm_layer {
    dtr_tensor *weight_ih, *weight_hh, *bias_ih, *bias_hh;
    int64_t in, hidden;
} dtr_lstm_layer;
/** GRU (PyTorch's nn.GRUCell): as dtr_lstm_layer with 3H rows, gates r, z, n: r, z = sigmoid of
 *  x W_ih^T + b_ih + h W_hh^T + b_hh (their rows), n = tanh(x W_in^T + b_in + r (h W_hn^T +
 *  b_hn)), h' = (1 - z) n + z h. */
typedef struct dtr_gru_layer {
    dtr_tensor *weight_ih, *weight_hh, *bias_ih, *bias_hh;
    int64_t in, hidden;
} dtr_gru_layer;

/** Llama block (Llama 2 and 3, Mistral's shape): x + o(attention(rope(q), rope(k), v)) over
 *  rmsnorm(x), then x + down(silu(gate(h)) * up(h)) over rmsnorm(x): pre-norm RMS norms (eps
 *  1e-6 unless changed), causal grouped-query attention with RoPE (rotate_half pairs, theta
 *  `rope_theta`: 10000 from init, 500000 for Llama 3), the SwiGLU MLP, no biases. Parameters
 *  under "<name>." with Hugging Face's LlamaDecoderLayer names, so a checkpoint's
 *  "model.layers.<i>." tensors load by name: input_layernorm.weight (C),
 *  self_attn.q_proj.weight (C, C), self_attn.k_proj.weight and self_attn.v_proj.weight
 *  (kv_heads * D, C), self_attn.o_proj.weight (C, C), post_attention_layernorm.weight (C),
 *  mlp.gate_proj.weight and mlp.up_proj.weight (hidden, C), mlp.down_proj.weight (C, hidden). */
typedef struct dtr_llama_block {
    dtr_rmsnorm_layer attn_norm, mlp_norm;   /**< input_layernorm, post_attention_layernorm */
    dtr_linear_layer q, k, v, o;             /**< self_attn.q_proj, k_proj, v_proj, o_proj */
    dtr_linear_layer gate, up, down;         /**< mlp.gate_proj, up_proj, down_proj */
    int64_t dim, hidden;
    int heads, kv_heads;
    float rope_theta;                        /**< 10000 from init; may be changed after init */
    float attention_dropout;                 /**< while training, dropout on the attention weights
                                                  (Hugging Face's attention_dropout); 0 from init */
} dtr_llama_block;

/** Layer constructors declare parameters "<name>.weight" and "<name>.bias" on `m` and fill
 *  `layer`. `init` applies to weights (DTR_INIT_TORCH_DEFAULT matches PyTorch); biases follow
 *  PyTorch's default. `bias` 0 leaves the bias out. Return DTR_OK or the context's error.
 *  Thread safety: the context's thread. */
DTR_API dtr_result dtr_linear_layer_init(dtr_linear_layer *layer, dtr_model *m, const char *name,
                                         int64_t in, int64_t out, int bias, dtr_init init);
DTR_API dtr_result dtr_conv2d_layer_init(dtr_conv2d_layer *layer, dtr_model *m, const char *name,
                                         int64_t in, int64_t out, int k, int stride, int padding,
                                         dtr_init init);
/** A convolution layer of any geometry: a kh x kw kernel, `cfg` as dtr_conv2d_ex's (NULL:
 *  dtr_conv_config_init's), weight (out, in / groups, kh, kw); PyTorch's Conv2d with its
 *  default init's bias bound 1 / sqrt(in / groups * kh * kw). in or out not divisible by
 *  groups: DTR_INVALID_ARGUMENT. */
DTR_API dtr_result dtr_conv2d_layer_init_ex(dtr_conv2d_layer *layer, dtr_model *m, const char *name,
                                            int64_t in, int64_t out, int kh, int kw,
                                            const dtr_conv_config *cfg, int bias, dtr_init init);
/** PyTorch's ConvTranspose2d(in, out, (kh, kw)) with `cfg`'s stride, padding, output_padding,
 *  dilation and groups: weight (in, out / groups, kh, kw), bias (out), both drawn as PyTorch's
 *  defaults from that shape (fan in = out / groups * kh * kw). The layer's forward runs
 *  dtr_conv_transpose2d. */
DTR_API dtr_result dtr_conv_transpose2d_layer_init(dtr_conv2d_layer *layer, dtr_model *m, const char *name,
                                                   int64_t in, int64_t out, int kh, int kw,
                                                   const dtr_conv_config *cfg, int bias, dtr_init init);
/** PyTorch's Conv1d(in, out, k, stride, padding, dilation, groups, bias): weight
 *  (out, in / groups, k). */
DTR_API dtr_result dtr_conv1d_layer_init(dtr_conv1d_layer *layer, dtr_model *m, const char *name,
                                         int64_t in, int64_t out, int k, int stride, int padding,
                                         int dilation, int groups, int bias, dtr_init init);
DTR_API dtr_result dtr_layernorm_layer_init(dtr_layernorm_layer *layer, dtr_model *m, const char *name,
                                            int64_t dim);
DTR_API dtr_result dtr_rmsnorm_layer_init(dtr_rmsnorm_layer *layer, dtr_model *m, const char *name, int64_t dim);
/** channels <= 0 is DTR_INVALID_ARGUMENT. Thread safety: the context's thread. */
DTR_API dtr_result dtr_batchnorm_layer_init(dtr_batchnorm_layer *layer, dtr_model *m, const char *name, int64_t channels);
/** `channels` not a positive multiple of `groups` is DTR_INVALID_ARGUMENT. */
DTR_API dtr_result dtr_groupnorm_layer_init(dtr_groupnorm_layer *layer, dtr_model *m, const char *name, int groups,
                                           int64_t channels);
DTR_API dtr_result dtr_embedding_layer_init(dtr_embedding_layer *layer, dtr_model *m, const char *name,
                                            int64_t vocab, int64_t dim);
DTR_API dtr_result dtr_attention_layer_init(dtr_attention_layer *layer, dtr_model *m, const char *name,
                                            int64_t dim, int heads);
DTR_API dtr_result dtr_gpt_block_init(dtr_gpt_block *block, dtr_model *m, const char *name,
                                      int64_t dim, int heads);
/** A Llama block of width dim, `heads` heads of dim / heads (even), `kv_heads` k and v heads
 *  (dividing heads; heads for plain multi-head attention) and an MLP of `hidden` (Llama 2 7B:
 *  4096, 32, 32, 11008). DTR_INVALID_ARGUMENT names what does not divide. */
DTR_API dtr_result dtr_llama_block_init(dtr_llama_block *block, dtr_model *m, const char *name, int64_t dim, int heads,
                                        int kv_heads, int64_t hidden);
/** An LSTM or a GRU layer of `in` inputs and `hidden` units. in or hidden <= 0 is
 *  DTR_INVALID_ARGUMENT. Thread safety: the context's thread. */
DTR_API dtr_result dtr_lstm_layer_init(dtr_lstm_layer *layer, dtr_model *m, const char *name, int64_t in, int64_t hidden);
DTR_API dtr_result dtr_gru_layer_init(dtr_gru_layer *layer, dtr_model *m, const char *name, int64_t in, int64_t hidden);
/** Adds a LoRA adapter (Hu et al. 2021; Hugging Face PEFT's names and initialisation) to a
 *  linear layer of model m, before dtr_model_build: parameters "<name>.lora_A.weight"
 *  (rank, in), U(-1/sqrt(in), 1/sqrt(in)), and "<name>.lora_B.weight" (out, rank), zeros. The
 *  layer's forward then adds ((alpha / rank) x A^T) B^T to x W^T + b: the same output until B
 *  trains. Every linear of the attention layer and of the GPT and Llama blocks takes one
 *  (block.attn.qkv, block.q, ...). To train the adapters only: dtr_model_set_trainable(m, NULL,
 *  0, 0), then (const char *[]){"*lora_"} trainable; the optimizer keeps state for them alone.
 *  Load a pretrained base with dtr_model_load_ex and optional {"*lora_"}. layer->lora_dropout
 *  = p drops the adapter's input x with probability p in training mode (the base product sees
 *  all of x; PEFT's lora_dropout, commonly 0.05 or 0.1).
 *  @return DTR_OK, DTR_NULL_HANDLE, DTR_INVALID_ARGUMENT (rank < 1, alpha <= 0, a layer not made
 *          by dtr_linear_layer_init, an adapter there already), DTR_BAD_STATE (model built).
 *  Thread safety: the model's context thread. */
DTR_API dtr_result dtr_linear_layer_add_lora(dtr_linear_layer *layer, dtr_model *m, int rank, float alpha);
/** Folds the layer's adapter into its weight, W += (alpha / rank) B A (accumulated in double),
 *  and sets B to zero: the layer's output stays (up to f32 rounding), and a file saved now holds
 *  the merged weight for a model without adapters (dtr_model_load skips the adapters' entries).
 *  Training on starts a fresh adapter from the merged weight. @return DTR_OK, DTR_NULL_HANDLE,
 *  DTR_INVALID_ARGUMENT (no adapter), DTR_OUT_OF_MEMORY. Thread safety: the model's context thread. */
DTR_API dtr_result dtr_linear_layer_merge_lora(dtr_linear_layer *layer);
/** Forward passes of the layers (ops with autograd). */
DTR_API dtr_tensor *dtr_linear_layer_forward(dtr_context *ctx, const dtr_linear_layer *l, dtr_tensor *x);
DTR_API dtr_tensor *dtr_conv2d_layer_forward(dtr_context *ctx, const dtr_conv2d_layer *l, dtr_tensor *x);
DTR_API dtr_tensor *dtr_conv1d_layer_forward(dtr_context *ctx, const dtr_conv1d_layer *l, dtr_tensor *x);
DTR_API dtr_tensor *dtr_layernorm_layer_forward(dtr_context *ctx, const dtr_layernorm_layer *l, dtr_tensor *x);
DTR_API dtr_tensor *dtr_rmsnorm_layer_forward(dtr_context *ctx, const dtr_rmsnorm_layer *l, dtr_tensor *x);
/** x (N, C, ...) -> the same shape: the batch's statistics in training mode (moving the running
 *  ones), the running ones in evaluation mode (dtr_context_set_training(ctx, 0)), as PyTorch's
 *  train() / eval(). Thread safety: the context's thread. */
DTR_API dtr_tensor *dtr_batchnorm_layer_forward(dtr_context *ctx, const dtr_batchnorm_layer *l, dtr_tensor *x);
/** x (N, C, ...) with the layer's C -> the same shape. */
DTR_API dtr_tensor *dtr_groupnorm_layer_forward(dtr_context *ctx, const dtr_groupnorm_layer *l, dtr_tensor *x);
DTR_API dtr_tensor *dtr_embedding_layer_forward(dtr_context *ctx, const dtr_embedding_layer *l, dtr_tensor *ids);
/** x (B, T, C) -> (B, T, C). */
DTR_API dtr_tensor *dtr_attention_layer_forward(dtr_context *ctx, const dtr_attention_layer *l, dtr_tensor *x);
DTR_API dtr_tensor *dtr_gpt_block_forward(dtr_context *ctx, const dtr_gpt_block *b, dtr_tensor *x);
/** x (B, T, C) -> (B, T, C), positions 0 .. T-1. */
DTR_API dtr_tensor *dtr_llama_block_forward(dtr_context *ctx, const dtr_llama_block *b, dtr_tensor *x);

/** An LSTM over a sequence: x (B, T, I), the state before it h0, c0 (B, H) (NULL: zeros) ->
 *  the hidden state after every step (B, T, H) (PyTorch's nn.LSTM(batch_first=True)'s output).
 *  *h_out and *c_out (either may be NULL) get the last step's state (B, H): hand them to the
 *  next call to go on with the sequence (truncated back-propagation through time: the
 *  gradient stops at the start of each call's tape once the context is reset; keep a copy of
 *  the state's values, dtr_tensor_read, to carry them over a reset). The input's part of
 *  every step's gates is one product of B T rows; each step then adds h W_hh^T.
 *  @return NULL with the context's error: DTR_NULL_HANDLE, DTR_SHAPE_MISMATCH (x not
 *          (B, T, in), T = 0, a state not (B, H)).
 *  Thread safety: the context's thread. */
DTR_API dtr_tensor *dtr_lstm_layer_forward(dtr_context *ctx, const dtr_lstm_layer *l, dtr_tensor *x, dtr_tensor *h0,
                                           dtr_tensor *c0, dtr_tensor **h_out, dtr_tensor **c_out);
/** Options of an LSTM or GRU layer over a batch of sequences (dtr_rnn_config_init(): none). */
typedef struct dtr_rnn_config {
    const int32_t *lengths;   /**< B host values: row b is a sequence of its first lengths[b] steps
                                   (1..T), the rest padding; NULL: every row has T steps. Read
                                   during the call. */
    int reverse;              /**< 1: each row's steps from its last to its first (the backward
                                   direction of a bidirectional layer: PyTorch's _reverse
                                   weights); its output is in x's order, the last states are
                                   those after the row's first step. 0: forward (default). */
} dtr_rnn_config;
/** A dtr_rnn_config with no options (every row T steps, forward). A bidirectional layer is two
 *  layers, one with reverse = 1, their outputs concatenated (dtr_concat on the last axis).
 *  Thread safety: any thread. */
DTR_API dtr_rnn_config dtr_rnn_config_init(void);
/** dtr_lstm_layer_forward over a batch of sequences of different lengths (cfg->lengths; cfg
 *  NULL: as dtr_lstm_layer_forward): PyTorch's nn.LSTM on a packed sequence. Row b's steps
 *  from lengths[b] on are padding: its output there is 0 (pad_packed_sequence's padding), its
 *  state stops at its last step, *h_out and *c_out are each row's state after its last step,
 *  and the padding gets no gradient and gives none. The recurrence still runs over all B rows
 *  a step (a padded row's state is carried along). @return NULL with the context's error: as
 *  dtr_lstm_layer_forward's, and DTR_INVALID_ARGUMENT (a length outside 1..T).
 *  Thread safety: the context's thread. */
DTR_API dtr_tensor *dtr_lstm_layer_forward_ex(dtr_context *ctx, const dtr_lstm_layer *l, dtr_tensor *x, dtr_tensor *h0,
                                              dtr_tensor *c0, const dtr_rnn_config *cfg, dtr_tensor **h_out, dtr_tensor **c_out);
/** One LSTM step: x (B, I), h, c (B, H) (NULL: zeros) -> h' (B, H), and *c_out = c' (B, H):
 *  a control loop's cell, one observation at a time (PyTorch's nn.LSTMCell). Errors as
 *  dtr_lstm_layer_forward's. Thread safety: the context's thread. */
DTR_API dtr_tensor *dtr_lstm_layer_step(dtr_context *ctx, const dtr_lstm_layer *l, dtr_tensor *x, dtr_tensor *h,
                                        dtr_tensor *c, dtr_tensor **c_out);
/** A GRU over a sequence: x (B, T, I) from h0 (B, H) (NULL: zeros) -> (B, T, H); *h_out (may be
 *  NULL) the last step's state. As dtr_lstm_layer_forward. Thread safety: the context's thread. */
DTR_API dtr_tensor *dtr_gru_layer_forward(dtr_context *ctx, const dtr_gru_layer *l, dtr_tensor *x, dtr_tensor *h0,
                                          dtr_tensor **h_out);
/** dtr_gru_layer_forward over sequences of different lengths, as dtr_lstm_layer_forward_ex.
 *  Thread safety: the context's thread. */
DTR_API dtr_tensor *dtr_gru_layer_forward_ex(dtr_context *ctx, const dtr_gru_layer *l, dtr_tensor *x, dtr_tensor *h0,
                                             const dtr_rnn_config *cfg, dtr_tensor **h_out);
/** One GRU step: x (B, I), h (B, H) (NULL: zeros) -> h' (B, H) (PyTorch's nn.GRUCell): a
 *  product for x's part and the recurrence op over one step (dtr_gru_sequence).
 *  Thread safety: the context's thread. */
DTR_API dtr_tensor *dtr_gru_layer_step(dtr_context *ctx, const dtr_gru_layer *l, dtr_tensor *x, dtr_tensor *h);

/* ---- generation: a key/value cache, and a sampler ----
 * Generating from a causal model one token at a time, each step's forward pass feeds only the
 * new tokens: the attention layers keep the keys and values of the earlier positions in a
 * dtr_kv_cache and attend to them (a step then costs what one position costs, not what the whole
 * sequence does). The loop (docs/guide.md, "Generating text"; examples/gpt.c --generate):
 *
 *     dtr_context_set_grad_enabled(ctx, 0);                   (a cache is for inference)
 *     dtr_kv_cache_create(ctx, layers, B, capacity, kv_width, &kv);
 *     h = embed(prompt, positions 0 .. P-1);                   (B, P, C): the prompt at once
 *     for each layer i: h = dtr_gpt_block_forward_cached(ctx, &block[i], h, kv, i);
 *     dtr_sample(ctx, head(h), &sc, &rng, next);               one token per item from the last row
 *     dtr_context_reset(ctx);                                  (the cache outlives resets)
 *     then for each new token: h = embed(next, position dtr_kv_cache_length(kv, 0)), (B, 1, C),
 *     the blocks with the cache, sample, reset, until done or the cache is full.
 *
 * Every item of the batch is at the same position. */

/** A key/value cache: per layer, keys and values (B, capacity, width) in the context's backend
 *  memory, and the positions held. */
typedef struct dtr_kv_cache dtr_kv_cache;

/** Makes a cache of `layers` layers for `batch` sequences of up to `capacity` positions, keys and
 *  values of `width` each (an attention layer's C; a Llama block's kv_heads * D), of the context's
 *  activation dtype, zeroed, empty. Memory: 2 x layers x batch x capacity x width elements.
 *  @return DTR_OK, DTR_NULL_HANDLE, DTR_INVALID_ARGUMENT (a count <= 0), DTR_OUT_OF_MEMORY.
 *  Thread safety: the context's thread. */
DTR_API dtr_result dtr_kv_cache_create(dtr_context *ctx, int layers, int64_t batch, int64_t capacity, int64_t width,
                                       dtr_kv_cache **out);
/** Frees the cache (before its context). NULL is ignored. Thread safety: the context's thread. */
DTR_API void dtr_kv_cache_destroy(dtr_kv_cache *c);
/** Empties every layer (a new sequence); the memory stays. Thread safety: the context's thread. */
DTR_API void dtr_kv_cache_reset(dtr_kv_cache *c);
/** Positions layer `layer` holds: the next forward pass's first position. 0 for NULL or a layer
 *  out of range. Thread safety: the context's thread. */
DTR_API int64_t dtr_kv_cache_length(const dtr_kv_cache *c, int layer);
/** For attention code of the app's: copies k and v (B, T, width; views with dense rows are read
 *  in place) after the rows layer `layer` holds, and gives that layer's whole keys and values
 *  (B, capacity, width) to attend to with a causal dtr_attention_ex whose q_start is the length
 *  before the call (the layers below do exactly this). Not recorded for autograd.
 *  @return DTR_OK, DTR_NULL_HANDLE, the context's sticky error, DTR_BAD_STATE (gradients on, or
 *          inside a captured step), DTR_SHAPE_MISMATCH, DTR_DTYPE_MISMATCH (not the cache's
 *          dtype), DTR_INVALID_ARGUMENT (layer out of range; T more positions do not fit: the
 *          cache is unchanged).
 *  Thread safety: the context's thread. */
DTR_API dtr_result dtr_kv_cache_append(dtr_kv_cache *c, int layer, dtr_tensor *k, dtr_tensor *v, dtr_tensor **keys,
                                       dtr_tensor **values);

/** The forward passes with a cache: x holds the T new positions (B, T, C) that follow the
 *  dtr_kv_cache_length(cache, layer) positions the cache holds for `layer`; their k and v are
 *  appended, their queries attend to every position up to their own, and the result equals the
 *  last T rows of the plain forward pass over the whole sequence (Llama's RoPE angles at the
 *  positions too) in evaluation mode: with a cache the layers' dropout fields are ignored (a
 *  cache is for generating; training mode left on would otherwise drop). cache NULL: the plain
 *  forward pass. Errors (NULL, the context's error set):
 *  those of dtr_kv_cache_append, DTR_UNSUPPORTED for a layer that is not causal.
 *  Thread safety: the context's thread. */
DTR_API dtr_tensor *dtr_attention_layer_forward_cached(dtr_context *ctx, const dtr_attention_layer *l, dtr_tensor *x,
                                                       dtr_kv_cache *cache, int layer);
DTR_API dtr_tensor *dtr_gpt_block_forward_cached(dtr_context *ctx, const dtr_gpt_block *b, dtr_tensor *x, dtr_kv_cache *cache,
                                                 int layer);
DTR_API dtr_tensor *dtr_llama_block_forward_cached(dtr_context *ctx, const dtr_llama_block *b, dtr_tensor *x,
                                                   dtr_kv_cache *cache, int layer);

/** How dtr_sample picks a token. Make one with dtr_sample_config_init(). */
typedef struct dtr_sample_config {
    float temperature;   /**< logits / temperature before the softmax; 0: greedy (the largest
                              logit, the first of equals), no random number drawn */
    int top_k;           /**< only the top_k largest logits compete (0: all) */
    float top_p;         /**< nucleus sampling: only the most likely tokens whose probabilities
                              (after temperature and top_k) first reach top_p together (1: all) */
} dtr_sample_config;

/** temperature 1, top_k 0, top_p 1: plain sampling from softmax(logits). Thread safety: any thread. */
DTR_API dtr_sample_config dtr_sample_config_init(void);

/** One token per item from the last row of logits (B, V) or (B, T, V) (any float dtype, any
 *  backend: the rows are read to the host) into tokens[0 .. B-1]. The random numbers come from
 *  *rng, a state of the app's (any value seeds it; it advances by one draw per item), so a run
 *  repeats with the same seed. NaN and infinite logits never win (-inf: a masked token). Ties
 *  at the top_k-th logit all stay in.
 *  @return DTR_OK, DTR_NULL_HANDLE, the context's sticky error, DTR_SHAPE_MISMATCH (not 2-D or
 *          3-D), DTR_INVALID_ARGUMENT (temperature < 0 or not finite, top_k < 0, top_p not in
 *          (0, 1], a row with no finite logit), DTR_OUT_OF_MEMORY.
 *  Thread safety: the context's thread. */
DTR_API dtr_result dtr_sample(dtr_context *ctx, dtr_tensor *logits, const dtr_sample_config *cfg, uint64_t *rng,
                              int32_t *tokens);

/** Saves every parameter to a safetensors file (F32, or BF16/F16 when `dt` says so), written
 *  to a temporary file and renamed into place. Returns DTR_IO_ERROR with the path on failure.
 *  A model with tensor-parallel shards (api_engine.h, dtr_tp_*) saves collectively: every rank
 *  of its group calls this, the shards are gathered and rank 0 writes one file of full
 *  tensors under the single-device names (the others write nothing and return once the
 *  gather is done; the file is complete when rank 0's call returns).
 *  Thread safety: the context's thread. */
DTR_API dtr_result dtr_model_save(dtr_model *m, const char *path, dtr_dtype dt);
/** dtr_model_save's settings (dtr_save_config_init(dtype): every tensor in dtype). `only`:
 *  n_only name prefixes (with '*' as in dtr_model_set_trainable); when given, only the
 *  parameters and buffers they match are saved: {"*lora_"} writes a LoRA adapter file of a few
 *  MB beside a base of GBs (dtr_model_load_ex with {"*"} optional reads it back). */
typedef struct dtr_save_config {
    dtr_dtype dtype;
    const char *const *only;
    int n_only;
} dtr_save_config;
/** A dtr_save_config saving every tensor in `dtype`. Thread safety: any thread. */
DTR_API dtr_save_config dtr_save_config_init(dtr_dtype dtype);
/** dtr_model_save with settings. DTR_NOT_FOUND when `only` matches no tensor of the model;
 *  other errors, the collective saving of shards and thread safety as dtr_model_save's. */
DTR_API dtr_result dtr_model_save_ex(dtr_model *m, const char *path, const dtr_save_config *cfg);
/** Loads parameters by name from a safetensors file (F32, BF16 or F16 entries). Every header
 *  field of every entry is validated; a missing parameter, a shape mismatch or a corrupt file
 *  gives DTR_NOT_FOUND / DTR_SHAPE_MISMATCH / DTR_CORRUPT_FILE with the file and tensor named,
 *  and leaves the model's values unchanged. Entries the model does not ask for are skipped
 *  whatever their dtype (Hugging Face files carry I64 position_ids, F64 or BOOL buffers); a
 *  parameter stored as another dtype gives DTR_DTYPE_MISMATCH. DTR_UNSUPPORTED comes only from
 *  a dtype name outside the safetensors format or more than DTR_MAX_DIMS dims. A
 *  tensor-parallel shard reads the full tensor (single-device shape) and keeps its slice.
 *  Thread safety: the model's context thread. */
DTR_API dtr_result dtr_model_load(dtr_model *m, const char *path);
/** dtr_model_load's settings (dtr_load_config_init: none). `optional`: n_optional name
 *  prefixes (with '*' as in dtr_model_set_trainable) of parameters and buffers the file may
 *  lack: those keep their values. A pretrained base into a model with LoRA adapters:
 *  {"*lora_"}; an adapter file into it: {"*"} (every tensor of the model the file has is
 *  loaded). */
typedef struct dtr_load_config {
    const char *const *optional;
    int n_optional;
} dtr_load_config;
/** A dtr_load_config with no optional tensors (what dtr_model_load uses). */
DTR_API dtr_load_config dtr_load_config_init(void);
/** dtr_model_load with settings (NULL: dtr_model_load's). A file that holds none of the
 *  model's tensors is DTR_NOT_FOUND even when every one is optional (a wrong file). Errors and
 *  thread safety as dtr_model_load's. */
DTR_API dtr_result dtr_model_load_ex(dtr_model *m, const char *path, const dtr_load_config *cfg);

/* ---- safetensors, low level ---- */

/** One tensor of a safetensors file. */
typedef struct dtr_st_entry {
    char name[256];
    dtr_dtype dtype;       /**< meaningful when !foreign */
    int foreign;           /**< 1: a dtype of the format that dtrain does not hold (I64, F64, BOOL,
                                I8, I16, U16, U32, U64, F8_E4M3, F8_E5M2): checked like the others,
                                its bytes are at `data`; dtr_model_load skips it unless asked for it */
    char dtype_name[12];   /**< the file's dtype ("F32", "I64", ...) */
    int ndim;
    int64_t shape[DTR_MAX_DIMS];
    uint64_t begin, end;   /**< byte offsets inside the data section */
    const void *data;      /**< points into the loaded file (dtr_st_file) */
    int has_crc32c;        /**< 1: the file's __metadata__ holds this tensor's checksum
                                ("crc32c.<name>": 8 lowercase hex digits), verified on read */
    uint32_t crc32c;       /**< that checksum (dtr_crc32c of the tensor's bytes) */
} dtr_st_entry;

/** A parsed, validated safetensors file held in memory. */
typedef struct dtr_st_file {
    dtr_st_entry *entries;
    int count;
    void *bytes;       /**< the whole file */
    size_t size;
    const dtr_allocation_callbacks *alloc;
} dtr_st_file;

/** Parses and validates a safetensors image in memory (no copy: entries point into `bytes`,
 *  which must outlive `out`). Checks the header length, the JSON syntax, each dtype, shape
 *  and data_offsets (inside the data section, matching dtype x numel, no overlap, covering
 *  the section), and the tensors' checksums when `__metadata__` has them (dtrain's files):
 *  a flipped bit or a checksum missing for one tensor of such a file gives DTR_CORRUPT_FILE
 *  naming the tensor. `err`/`errlen` receive a message naming the problem.
 *  Thread safety: thread safe for distinct files and objects. */
DTR_API dtr_result dtr_st_parse(const void *bytes, size_t size, const dtr_allocation_callbacks *alloc,
                                dtr_st_file *out, char *err, size_t errlen);
/** Reads a whole file and parses it. A path that is not a regular file (a folder, a FIFO)
 *  gives DTR_IO_ERROR naming it. */
DTR_API dtr_result dtr_st_open(const char *path, const dtr_allocation_callbacks *alloc,
                               dtr_st_file *out, char *err, size_t errlen);
/** Frees what dtr_st_parse / dtr_st_open allocated. */
DTR_API void dtr_st_destroy(dtr_st_file *f);
/** Writes `bytes` bytes to `path` atomically: into a temporary file beside it
 *  ("<path>.tmp.<pid>.<n>"), synced, renamed over `path`, then the folder synced. Readers see
 *  the old file or the whole new one; on failure the temporary file is removed and `path`
 *  is untouched. The writer of weights (dtr_st_write) uses the same code; use it for
 *  checkpoints, manifests and logs. @return DTR_OK, DTR_NULL_HANDLE, DTR_OUT_OF_MEMORY,
 *  DTR_IO_ERROR (with the path and the system's reason in err).
 *  Thread safety: thread safe for distinct paths. */
DTR_API dtr_result dtr_write_file_atomic(const char *path, const void *data, size_t bytes, char *err, size_t errlen);

/** CRC-32C (Castagnoli) of `n` bytes, continuing from `crc`: 0 starts a checksum, and a
 *  previous result continues it over the next piece. The checksum of every tensor in the
 *  safetensors files dtrain writes and of the files a checkpoint manifest lists.
 *  @return the checksum (`crc` unchanged when `data` is NULL).
 *  Thread safety: thread safe. */
DTR_API uint32_t dtr_crc32c(uint32_t crc, const void *data, size_t n);

/** Writes tensors (name, dtype, shape, data) as a safetensors file through a temporary file
 *  and rename. `data[i]` holds the elements of entry i in its dtype. The header's
 *  `__metadata__` carries each tensor's CRC-32C ("crc32c.<name>": "1a2b3c4d"), which other
 *  readers ignore and dtr_st_parse / dtr_st_open verify. Temporary files that dead processes
 *  left beside `path` (a save killed midway) are removed first; a `path` that exists and is
 *  not a regular file (a folder, a FIFO, a device) is refused with DTR_INVALID_ARGUMENT.
 *  Thread safety: thread safe for distinct files and objects. */
DTR_API dtr_result dtr_st_write(const char *path, const dtr_st_entry *entries, const void *const *data,
                                int count, char *err, size_t errlen);

/** Entry `index` of the model's state: "params" and "grads" (dtr_model_numel floats each,
 *  the contiguous buffers; device memory on a device backend), then "buffers" (the model
 *  buffers' block) when it has any (dtr_model_buffer). Builds the model first.
 *  @return DTR_OK, DTR_NOT_FOUND past the last, DTR_NULL_HANDLE, or the build's error.
 *  Thread safety: the model's context thread. */
DTR_API dtr_result dtr_model_state(dtr_model *m, int index, dtr_state_entry *out);
/** After writing the model's entries back. @return DTR_OK or DTR_NULL_HANDLE.
 *  Thread safety: the model's context thread. */
DTR_API dtr_result dtr_model_state_loaded(dtr_model *m);

/* ---- optimizers ---- */

typedef enum dtr_optimizer_kind {
    DTR_OPT_SGD = 0,    /**< momentum, Nesterov, L2 weight decay (added to the gradient) */
    DTR_OPT_ADAM = 1,   /**< L2 weight decay added to the gradient, as torch.optim.Adam */
    DTR_OPT_ADAMW = 2,  /**< decoupled weight decay */
    DTR_OPT_LAMB = 3,   /**< layer-wise trust ratio over AdamW-style updates (You et al.) */
    DTR_OPT_RMSPROP = 4,/**< torch.optim.RMSprop (not centered): square average with smoothing
                             beta2 (its alpha; default 0.99), eps added to its root, L2 weight
                             decay, optional momentum */
    DTR_OPT_ADAGRAD = 5 /**< torch.optim.Adagrad: the sum of squared gradients, eps (default
                             1e-10) added to its root, L2 weight decay */
} dtr_optimizer_kind;

typedef enum dtr_schedule_kind {
    DTR_SCHED_CONSTANT = 0,
    DTR_SCHED_STEP = 1,    /**< lr * gamma^(floor(t / step_size)) (torch's StepLR) */
    DTR_SCHED_COSINE = 2,  /**< cosine from lr to min_lr over total_steps (CosineAnnealingLR), then min_lr */
    DTR_SCHED_LINEAR = 3,  /**< a straight line from lr to min_lr over total_steps, then min_lr (with
                                warm-up: Hugging Face's get_linear_schedule_with_warmup, the usual
                                fine-tuning schedule; torch's LinearLR) */
    DTR_SCHED_EXPONENTIAL = 4, /**< lr * gamma^t (torch's ExponentialLR) */
    DTR_SCHED_POLY = 5,    /**< min_lr + (lr - min_lr) * (1 - t / total_steps)^gamma, then min_lr:
                                gamma is the power (torch's PolynomialLR with min_lr 0; Hugging
                                Face's polynomial decay with lr_end min_lr) */
    DTR_SCHED_INV_SQRT = 6,/**< lr / sqrt((t + s) / s) with timescale s = step_size, or warmup_steps
                                when step_size is 0, or 10000 when both are 0 (the Transformer's
                                and Hugging Face's inverse square root: lr when warm-up ends) */
    DTR_SCHED_MULTISTEP = 7, /**< lr * gamma^(the milestones <= t) (torch's MultiStepLR: a ResNet's
                                  drops at fixed epochs) */
    DTR_SCHED_ONE_CYCLE = 8, /**< torch's OneCycleLR (cosine annealing): a cosine from start_lr at step
                                  0 up to lr at step warmup_steps - 1 (its warm-up is this rise, not a
                                  line), then a cosine down to min_lr reached at step warmup_steps +
                                  total_steps - 1, min_lr afterwards; with max_momentum > 0 the
                                  momentum (SGD's, RMSprop's; the Adam family's and LAMB's beta1) goes
                                  from max_momentum down to base_momentum and back up
                                  (dtr_schedule_momentum). torch's OneCycleLR(max_lr, total_steps = T,
                                  pct_start = P, div_factor = D, final_div_factor = F) is lr = max_lr,
                                  warmup_steps = P * T, total_steps = T - warmup_steps, start_lr =
                                  max_lr / D, min_lr = start_lr / F */
    DTR_SCHED_COSINE_RESTARTS = 9, /**< cosine from lr to min_lr over cycles of step_size steps, each
                                        gamma times longer than the last (gamma a whole number >= 1),
                                        lr again at each restart (torch's CosineAnnealingWarmRestarts:
                                        T_0 = step_size, T_mult = gamma, eta_min = min_lr; SGDR) */
    DTR_SCHED_PLATEAU = 10   /**< lr until the metric the app reports (dtr_optimizer_report_metric,
                                  once an epoch: a validation loss) stops improving: after more
                                  than step_size reports (the patience) without an improvement
                                  of threshold, lr becomes max(lr * gamma, min_lr), then cooldown
                                  reports count as none bad (torch's ReduceLROnPlateau) */
} dtr_schedule_kind;

/** The most milestones a DTR_SCHED_MULTISTEP schedule takes. */
#define DTR_SCHED_MAX_MILESTONES 8

/** A learning-rate schedule with optional linear warm-up: (step + 1) / warmup_steps * lr at
 *  steps 0 .. warmup_steps - 1 (torch's LinearLR from 1 / warmup_steps), then the kind's
 *  curve of t = step - warmup_steps. Checked at dtr_optimizer_create. */
typedef struct dtr_schedule {
    dtr_schedule_kind kind;
    float lr;
    float min_lr;          /**< where cosine, linear and polynomial decay end (>= 0) */
    int64_t warmup_steps;
    int64_t total_steps;   /**< length of the cosine, linear and polynomial decay (after warm-up; > 0) */
    int64_t step_size;     /**< step schedule period (> 0); inverse square root's timescale (0: see it) */
    float gamma;           /**< step, multi-step and exponential schedules' factor (> 0); polynomial
                                decay's power (> 0; 1: linear); the restarts' growth of the cycle (a
                                whole number >= 1); the plateau's factor (in (0, 1)) */
    int64_t milestones[DTR_SCHED_MAX_MILESTONES]; /**< multi-step: the steps t (after warm-up) where
                                the rate drops by gamma, ascending and > 0; a 0 ends the list */
    float start_lr;        /**< one-cycle: the rate at step 0 (>= 0; torch: max_lr / div_factor) */
    float max_momentum;    /**< one-cycle: > 0 cycles the momentum between max_momentum (at the
                                ends) and base_momentum (at the peak rate), both in (0, 1),
                                replacing the config's momentum or beta1 (torch's
                                cycle_momentum, 0.95 and 0.85 there); 0: not cycled */
    float base_momentum;
    float threshold;       /**< plateau: the improvement a report must make over the best so far to
                                count: relative (torch's default mode; its default 1e-4) or, with
                                threshold_abs, absolute (>= 0) */
    int threshold_abs;
    int maximize;          /**< plateau: 1 when larger metrics are better (an accuracy); 0 a loss */
    int64_t cooldown;      /**< plateau: reports after a drop that count as not bad (>= 0) */
} dtr_schedule;

/** Learning rate at optimizer step `step` (0-based). Pure function. A plateau schedule's
 *  rate is its lr after warm-up: the optimizer lowers lr itself (dtr_optimizer_report_metric).
 *  Thread safety: thread safe. */
DTR_API float dtr_schedule_lr(const dtr_schedule *s, int64_t step);
/** The momentum of update `step` (0-based): one-cycle's cycled momentum when s cycles it
 *  (max_momentum > 0), else `momentum` (the config's momentum or beta1) unchanged. Pure
 *  function. Thread safety: thread safe. */
DTR_API float dtr_schedule_momentum(const dtr_schedule *s, int64_t step, float momentum);

/** The optimizer's check of the gradient before each update (one sum of squares over the
 *  contiguous gradient buffer, shared with clip_norm). In data parallelism it runs after the
 *  gradients are averaged, so every rank sees the same norm and decides alike (with local
 *  SGD each rank decides alone). */
typedef enum dtr_nonfinite_policy {
    DTR_NONFINITE_SKIP = 0,   /**< default: no update; the gradients are zeroed, the skipped-step
                                   counter (dtr_optimizer_skipped) grows, a warning is logged,
                                   and dtr_optimizer_step returns DTR_OK with *updated 0 */
    DTR_NONFINITE_STOP = 1,   /**< no update: dtr_optimizer_step fails with DTR_NONFINITE (sticky;
                                   the gradients are left for inspection) */
    DTR_NONFINITE_WARN = 2,   /**< a warning is logged, then the update runs anyway (the
                                   parameters take the NaN) */
    DTR_NONFINITE_OFF = 3     /**< no check (and no extra pass when clip_norm is 0) */
} dtr_nonfinite_policy;

/** One learning-rate group of dtr_optimizer_config.lr_groups. */
typedef struct dtr_lr_group {
    const char *match;   /**< a name prefix, '*' matching any run of characters (as in dtr_model_set_trainable) */
    float scale;         /**< >= 0: the group's learning rate is scale times the schedule's */
} dtr_lr_group;

typedef struct dtr_optimizer_config {
    dtr_optimizer_kind kind;
    dtr_schedule schedule;  /**< schedule.lr is the learning rate */
    float momentum;         /**< SGD, RMSprop */
    int nesterov;           /**< SGD */
    float dampening;        /**< SGD */
    double beta1, beta2;    /**< Adam family moments (defaults 0.9, 0.999); RMSprop's alpha is beta2 (default
                                 0.99); double so 1 - beta is exact as in PyTorch */
    float eps;              /**< Adam family, RMSprop (default 1e-8; LAMB 1e-6; Adagrad 1e-10) */
    float weight_decay;
    float clip_norm;        /**< > 0: clip the global gradient norm before each update */
    int grad_accum_steps;   /**< > 1: dtr_optimizer_step updates every N calls with the mean gradient */
    int64_t shard_begin;    /**< with shard_end > 0: the optimizer updates, and keeps state for, only the */
    int64_t shard_end;      /**< floats [shard_begin, shard_end) of the parameter buffer (on parameter
                                 boundaries for LAMB; may be empty): one rank's shard of a sharded optimizer
                                 (ZeRO, dtr_dp_shard_optimizer). Without shard_sum clip_norm takes the whole
                                 gradient buffer's norm (right when every rank holds the whole gradient). 0: all */
    /** With a shard: sums n values over the ranks that share the optimizer, in place (the same
     *  result on every rank; a collective every rank's optimizer step calls alike). Given, the
     *  optimizer takes clip_norm's norm as the root of the sum of its shard's sums of squares
     *  (ZeRO-2: a rank holds the average of its shard's gradients only), and LAMB's shard may
     *  split parameters: each one's norms are summed over the shards (host memory only). The
     *  optimizer then steps its whole shard only (dtr_optimizer_step). NULL: none.
     *  dtr_dp_shard_optimizer sets it. */
    dtr_result (*shard_sum)(void *user, double *vals, int n);
    void *shard_sum_user;   /**< handed to shard_sum */
    /** What an update does when the gradient's global norm is not finite (a NaN or an infinity
     *  anywhere in the gradient): see dtr_nonfinite_policy. Default DTR_NONFINITE_SKIP. */
    dtr_nonfinite_policy nonfinite;
    /** Sums n values over the ranks that hold the model's other parts (pipeline stages), in
     *  place, the same result on every rank (a collective every rank's optimizer step calls
     *  alike). Given, the gradient's global norm (clip_norm, the nonfinite check, the loss
     *  scaler's overflow check) is the root of the sum over those ranks of their sums of
     *  squares (after shard_sum's, with ZeRO in a hybrid grid; tensor-parallel shards are
     *  summed over their own group without it); LAMB's per-parameter norms stay local. dtr_pipe_optimizer_config sets it. NULL (default): this rank's gradients
     *  are the whole model's. */
    dtr_result (*norm_sum)(void *user, double *vals, int n);
    void *norm_sum_user;    /**< handed to norm_sum */
    /** Parameters without weight decay (PyTorch's param groups with weight_decay 0): with
     *  decay_matrices_only, every parameter of fewer than 2 dimensions (biases, norms' scales:
     *  nanoGPT's and llm.c's rule); and those matching one of the n_no_decay `no_decay` name
     *  prefixes ('*' as in dtr_model_set_trainable), read at dtr_optimizer_create. */
    int decay_matrices_only;
    const char *const *no_decay;
    int n_no_decay;
    /** Learning rates by name (PyTorch's param groups with their own lr: layer-wise decay, a
     *  new head trained faster than the body, LoRA+'s faster B matrices): a parameter takes
     *  the scale of the first of the n_lr_groups `lr_groups` whose `match` names it, 1 when none
     *  does, and its updates use scale times the schedule's rate (as torch's LambdaLR scales
     *  every group's lr alike; dtr_optimizer_lr reports the schedule's). Read at
     *  dtr_optimizer_create (the array may go afterwards); saved state does not hold them. */
    const dtr_lr_group *lr_groups;
    int n_lr_groups;
} dtr_optimizer_config;

/** Defaults for `kind` with learning rate `lr` (constant schedule).
 *  Thread safety: thread safe. */
DTR_API dtr_optimizer_config dtr_optimizer_config_init(dtr_optimizer_kind kind, float lr);

typedef struct dtr_optimizer dtr_optimizer;

/** Creates an optimizer over every parameter of `m` (or over cfg's shard of them); its state
 *  lives in contiguous buffers.
 *  @return DTR_OK, DTR_NULL_HANDLE, DTR_INVALID_ARGUMENT (a field out of range, a shard outside
 *  the buffer, a LAMB shard splitting a parameter without shard_sum), DTR_UNSUPPORTED (LAMB
 *  with shard_sum on a device backend), DTR_OUT_OF_MEMORY.
 *  Thread safety: the context's thread. */
DTR_API dtr_result dtr_optimizer_create(dtr_model *m, const dtr_optimizer_config *cfg, dtr_optimizer **out);
DTR_API void dtr_optimizer_destroy(dtr_optimizer *opt);
/** One call per micro-batch after dtr_backward. Applies an update (clipping and schedule
 *  included) once every grad_accum_steps calls, then zeroes the gradients. As torch.optim
 *  leaves out a parameter whose .grad is None, the update leaves out a trainable parameter no
 *  dtr_backward since the last dtr_model_zero_grad reached (a branch the step did not take, a
 *  task head another batch uses): its values, moments and update count stay as they are,
 *  weight decay included. Gradients written without a backward (by hand, a parameter server's)
 *  update every trainable parameter; so does data parallelism on every replica unless
 *  dtr_dp_config.find_unused leaves out those no rank reached.
 *  @param updated  set to 1 when parameters changed (may be NULL).
 *  Thread safety: the model's context thread. */
DTR_API dtr_result dtr_optimizer_step(dtr_optimizer *opt, int *updated);
/** Number of updates applied so far (the schedule's step). */
DTR_API int64_t dtr_optimizer_steps(const dtr_optimizer *opt);
/** Updates skipped because the gradient was not finite (DTR_NONFINITE_SKIP) since the
 *  optimizer was created (not part of its saved state). 0 for NULL.
 *  Thread safety: the model's context thread. */
DTR_API int64_t dtr_optimizer_skipped(const dtr_optimizer *opt);
/** The global gradient norm the last update measured (after the 1 / grad_accum_steps
 *  scaling, before clipping; NaN when it was not finite), or -1 before the first update or
 *  when nothing measured it (DTR_NONFINITE_OFF without clip_norm). 0 for NULL.
 *  Thread safety: the model's context thread. */
DTR_API double dtr_optimizer_grad_norm(const dtr_optimizer *opt);
/** The learning rate of the next update. */
DTR_API float dtr_optimizer_lr(const dtr_optimizer *opt);
/** Replaces the base learning rate (schedule.lr). */
DTR_API void dtr_optimizer_set_lr(dtr_optimizer *opt, float lr);

/** What dtr_optimizer_report_metric keeps of the reports: the plateau schedule's state, and
 *  what early stopping needs under any schedule. */
typedef struct dtr_metric_stats {
    double best;          /**< the best metric reported (+inf for a loss, -inf with maximize,
                               before the first) */
    int64_t reports;      /**< metrics reported */
    int64_t bad;          /**< the plateau's count: reports since the last improvement, drop or
                               cooldown report (torch's num_bad_epochs) */
    int64_t stale;        /**< reports since the last improvement (drops do not reset it): stop
                               early when it reaches your patience */
    int64_t cooldown;     /**< reports left in the cooldown after the last drop */
    int64_t drops;        /**< the plateau's drops of the rate so far */
    int improved;         /**< the last report improved on the best */
    int dropped;          /**< the last report lowered the rate (plateau) */
} dtr_metric_stats;

/** Reports a metric measured since the last report, once an epoch or an evaluation (torch's
 *  ReduceLROnPlateau.step(metric)): it counts as an improvement when it beats the best so
 *  far by the schedule's threshold (lower is better, or higher with schedule.maximize; a NaN
 *  never improves). With a DTR_SCHED_PLATEAU schedule, more than step_size reports without
 *  an improvement lower schedule.lr to max(lr * gamma, min_lr) (dropped when that moves it by
 *  more than 1e-8, as torch; an info line to the context's log callback says so, as torch's
 *  verbose), then `cooldown` reports count as none bad. Under any other
 *  schedule the rate stays; under any, `stale` serves early stopping. Data parallelism: every
 *  rank must report the same metric, or their rates part: dtr_dp_report_metric reports the
 *  group's mean. Part of
 *  the saved state (dtr_optimizer_state's "reports").
 *  @param stats  the counts after this report (may be NULL).
 *  @return DTR_OK, DTR_NULL_HANDLE. Thread safety: the model's context thread. */
DTR_API dtr_result dtr_optimizer_report_metric(dtr_optimizer *opt, double metric, dtr_metric_stats *stats);
/** The counts of the reports so far (all zero but best before the first).
 *  @return DTR_OK, DTR_NULL_HANDLE. Thread safety: the model's context thread. */
DTR_API dtr_result dtr_optimizer_metric_stats(const dtr_optimizer *opt, dtr_metric_stats *stats);
/** The optimizer's moment buffers: `count` buffers (SGD with momentum: 1; the Adam family and
 *  LAMB: 2, m and v; RMSprop: the square average, then the momentum buffer with momentum;
 *  Adagrad: 1, the sum of squares), NULL past the end (and for every index when the state
 *  cannot be laid out: out of memory). Each holds the floats of the optimizer's range
 *  (dtr_model_numel, or its shard) that are trainable, in the buffer's order: without frozen
 *  parameters float i is the parameter buffer's float i (of the shard); frozen ones
 *  (dtr_model_set_trainable) are left out. For checkpoints, prefer dtr_optimizer_state, which
 *  lists every piece of the optimizer's state.
 *  Thread safety: the model's context thread. */
DTR_API float *dtr_optimizer_moments(dtr_optimizer *opt, int index, int *count);
/** The bytes the optimizer's moment buffers take (dtr_optimizer_moments' buffers: their count
 *  times the trainable floats of its range times 4): what the optimizer's state costs in
 *  memory, the figure ZeRO divides by the world and frozen parameters leave out. 0 for NULL,
 *  SGD without momentum, or when the state cannot be laid out. Thread safety: the model's
 *  context thread. */
DTR_API size_t dtr_optimizer_state_bytes(dtr_optimizer *opt);
/** One update over the range [begin, end) of the parameter buffer (offsets as
 *  dtr_model_param_offset gives them): what a sharded optimizer (ZeRO) or a parameter-server
 *  shard runs on its part. Parameters and moments inside the range change exactly as the
 *  full dtr_optimizer_step would change them (the same bits); outside it nothing changes.
 *  The step counter, gradient accumulation and the zeroing of all gradients behave as in
 *  dtr_optimizer_step. LAMB's trust ratio is per parameter, so for LAMB begin and end must
 *  fall on parameter boundaries; clip_norm needs the norm of the whole gradient, so a range
 *  that is not the whole buffer is refused when clip_norm or shard_sum is set (clip with a
 *  global norm first). @return DTR_OK, DTR_NULL_HANDLE, DTR_INVALID_ARGUMENT (range outside
 *  the buffer, LAMB boundary, clipping), or the update's error. Thread safety: the model's context thread. */
DTR_API dtr_result dtr_optimizer_step_range(dtr_optimizer *opt, int64_t begin, int64_t end, int *updated);

/** Entry `index` of the optimizer's state: "steps" (int64 updates applied), "micro" (int,
 *  micro-batches since the last update), "schedule" (its dtr_schedule's fields from kind to
 *  gamma: dtr_optimizer_set_lr and the plateau change lr), then the moments "m" and "v" where the kind has them
 *  (the trainable floats of its range each, see dtr_optimizer_moments; device memory on a
 *  device backend), and last "started" (int64 per parameter: the update count its state started
 *  at, moved on by every update that left it out, so that "steps" minus it is the parameter's
 *  own update count; -1 frozen; dtr_optimizer_state_loaded refuses values that do not fit the step count and
 *  the model's trainable set). dtr_ckpt restores a checkpoint written before "started" existed
 *  with every trainable parameter started at 0. After it: "schedule2" (the rest of the
 *  dtr_schedule: milestones, one-cycle and plateau settings) and "reports" (the
 *  dtr_metric_stats of dtr_optimizer_report_metric); dtr_ckpt restores a checkpoint written
 *  before them with the optimizer's own (as created).
 *  @return DTR_OK, DTR_NOT_FOUND past the last, DTR_NULL_HANDLE. Thread safety: the model's
 *  context thread. */
DTR_API dtr_result dtr_optimizer_state(dtr_optimizer *opt, int index, dtr_state_entry *out);
/** After writing the optimizer's entries back: checks them.
 *  @return DTR_OK, DTR_NULL_HANDLE, DTR_CORRUPT_FILE (a negative counter, a micro count not
 *  below grad_accum_steps). Thread safety: the model's context thread. */
DTR_API dtr_result dtr_optimizer_state_loaded(dtr_optimizer *opt);

/* ---- dynamic loss scaling (low-precision gradients) ---- */

/** Settings of a loss scaler; dtr_loss_scaler_config_init gives PyTorch GradScaler's. */
typedef struct dtr_loss_scaler_config {
    float init_scale;       /**< first scale (default 65536) */
    float growth_factor;    /**< applied after growth_interval finite steps in a row (default 2) */
    float backoff_factor;   /**< applied after a step with non-finite gradients (default 0.5) */
    int growth_interval;    /**< default 2000 */
    float min_scale, max_scale;   /**< bounds of the scale (defaults 1 and 2^24) */
} dtr_loss_scaler_config;

/** Default loss-scaler settings. Thread safety: thread safe. */
DTR_API dtr_loss_scaler_config dtr_loss_scaler_config_init(void);

typedef struct dtr_loss_scaler dtr_loss_scaler;

/** Creates a loss scaler (cfg NULL: defaults). A training step with it reads:
 *      dtr_backward(ctx, dtr_loss_scaler_scale(ls, ctx, loss));
 *      dtr_loss_scaler_step(ls, model, opt, &stepped);   // unscale, check, step or skip
 *  @return DTR_OK, DTR_NULL_HANDLE, DTR_INVALID_ARGUMENT (a setting out of range),
 *  DTR_OUT_OF_MEMORY. Thread safety: thread safe for distinct scalers. */
DTR_API dtr_result dtr_loss_scaler_create(const dtr_loss_scaler_config *cfg, dtr_loss_scaler **out);
/** Frees the scaler; NULL is ignored. Thread safety: one thread per scaler. */
DTR_API void dtr_loss_scaler_destroy(dtr_loss_scaler *ls);
/** The loss times the current scale (an op: backward from it gives scaled gradients).
 *  NULL with the context's error when ls is NULL. Thread safety: the context's thread. */
DTR_API dtr_tensor *dtr_loss_scaler_scale(dtr_loss_scaler *ls, dtr_context *ctx, dtr_tensor *loss);
/** Call it where dtr_optimizer_step would be called (every micro-batch with
 *  grad_accum_steps > 1: until the last one it only counts, the scaled gradients adding up).
 *  At an update it divides the model's gradients by the scale and checks them: finite, the
 *  optimizer steps (*stepped as dtr_optimizer_step's `updated`) and after growth_interval such
 *  steps the scale grows; an inf or NaN anywhere skips the step (*stepped 0, counted, a
 *  warning through the log callback), shrinks the scale, zeroes the gradients and starts the
 *  accumulation over. Every rank of a
 *  data-parallel group takes the same decision: without ZeRO each holds the same averaged
 *  gradients; with a sharded optimizer (dtr_dp_shard_optimizer, ZeRO-1/2) the check is the
 *  norm of the shards' averages summed over the group (a collective: every rank calls this
 *  the same number of times). @return DTR_OK (stepped or skipped), DTR_NULL_HANDLE,
 *  DTR_BAD_STATE (no gradients), or the optimizer's error. Thread safety: the model's context
 *  thread. */
DTR_API dtr_result dtr_loss_scaler_step(dtr_loss_scaler *ls, dtr_model *m, dtr_optimizer *opt, int *stepped);
/** The current scale (0 for NULL). Thread safety: as dtr_loss_scaler_step. */
DTR_API float dtr_loss_scaler_value(const dtr_loss_scaler *ls);
/** Steps skipped so far for non-finite gradients. Thread safety: as dtr_loss_scaler_step. */
DTR_API int64_t dtr_loss_scaler_skipped(const dtr_loss_scaler *ls);
/** State entries ("scale", "good", "skipped") for a full-state checkpoint.
 *  @return DTR_OK, DTR_NOT_FOUND past the last, DTR_NULL_HANDLE. Thread safety: as
 *  dtr_loss_scaler_step. */
DTR_API dtr_result dtr_loss_scaler_state(dtr_loss_scaler *ls, int index, dtr_state_entry *out);
/** After the entries were written back: DTR_OK, or DTR_CORRUPT_FILE for a scale outside the
 *  settings' bounds or negative counters; DTR_NULL_HANDLE. Thread safety: as
 *  dtr_loss_scaler_step. */
DTR_API dtr_result dtr_loss_scaler_state_loaded(dtr_loss_scaler *ls);

/** Global L2 norm of the model's gradients; scales them by max_norm / norm when larger. With
 *  tensor-parallel layers (dtr_tp_*) the shards' squares are summed over their group and the
 *  replicated parameters count once (a collective over that group: every rank calls it).
 *  Pipeline stages are not summed here: clip through the optimizer's clip_norm with
 *  dtr_pipe_optimizer_config.
 *  @param norm_out receives the norm before clipping (may be NULL; NaN or infinity when the
 *  gradient holds one).
 *  @return DTR_OK, DTR_NULL_HANDLE, DTR_INVALID_ARGUMENT, DTR_NONFINITE (the norm is not
 *  finite: the gradients are left unscaled and the error is not sticky, so the optimizer's
 *  nonfinite policy still decides the step).
 *  Thread safety: the context's thread. */
DTR_API dtr_result dtr_clip_grad_norm(dtr_model *m, float max_norm, float *norm_out);

/* ---- data: IDX (MNIST family) ---- */

/** An IDX array: dims and u8/i8/i16/i32/f32/f64 data converted to f32 (labels to i32). */
typedef struct dtr_idx {
    int ndim;
    int64_t dims[DTR_MAX_DIMS];
    dtr_dtype dtype;          /**< DTR_U8 for unsigned byte data, else DTR_F32 / DTR_I32 */
    void *data;               /**< numel elements of `dtype` */
    int64_t numel;
    const dtr_allocation_callbacks *alloc;
} dtr_idx;

/** Reads an IDX file, gzip-compressed or not (gzip needs DTR_USE_ZLIB and -lz; without it a
 *  .gz file gives DTR_UNSUPPORTED with a message). Validates the magic, the dims against the
 *  file length, and rejects truncated files with DTR_CORRUPT_FILE naming the path.
 *  Thread safety: thread safe for distinct files and objects. */
DTR_API dtr_result dtr_idx_read(const char *path, const dtr_allocation_callbacks *alloc, dtr_idx *out,
                                char *err, size_t errlen);
/** Parses an uncompressed IDX image in memory (copies the data). */
DTR_API dtr_result dtr_idx_parse(const void *bytes, size_t size, const dtr_allocation_callbacks *alloc,
                                 dtr_idx *out, char *err, size_t errlen);
DTR_API void dtr_idx_destroy(dtr_idx *idx);

/** Fashion-MNIST / MNIST in memory: images as f32 in [0, 1] (N, 28*28), labels i32 (N). */
typedef struct dtr_mnist {
    float *train_x, *test_x;
    int32_t *train_y, *test_y;
    int64_t train_n, test_n;
    int rows, cols;
    const dtr_allocation_callbacks *alloc;
} dtr_mnist;

/** Loads the four files train-images-idx3-ubyte[.gz], train-labels-idx1-ubyte[.gz],
 *  t10k-images-idx3-ubyte[.gz], t10k-labels-idx1-ubyte[.gz] from `dir`. Checks that counts
 *  agree and labels are in 0..9.
 *  Thread safety: thread safe for distinct files and objects. */
DTR_API dtr_result dtr_mnist_load(const char *dir, const dtr_allocation_callbacks *alloc, dtr_mnist *out,
                                  char *err, size_t errlen);
DTR_API void dtr_mnist_destroy(dtr_mnist *d);

/* ---- progress line ---- */

/** What a progress line shows (dtr_progress_format); a zero field is left out. */
typedef struct dtr_progress_info {
    int64_t epoch;          /**< 0-based epoch */
    int64_t epochs;         /**< epochs in all (0: unknown; the ETA is then to the epoch's end) */
    int64_t step;           /**< steps done in this epoch */
    int64_t steps;          /**< steps per epoch (0: unknown: no bar, no percentage, no ETA) */
    double elapsed_s;       /**< seconds since training began: the ETA follows the mean pace */
    double rate;            /**< items per second (0: not shown) */
    const char *rate_unit;  /**< "samples/s" when NULL */
    double loss;            /**< shown when has_loss */
    int has_loss;
} dtr_progress_info;

/** One progress line, without newline or carriage return, e.g.
 *  "epoch 2/5 [#######.............] 35% 164/469 | 5821 samples/s | loss 0.4312 | ETA 1m12s".
 *  Print it after "\r" on a terminal (redrawn in place) or on a line of its own in a log.
 *  @return the length of the whole line (as snprintf; the line is cut to n - 1 characters),
 *  0 when buf or p is NULL or n is 0. Thread safety: thread safe. */
DTR_API size_t dtr_progress_format(char *buf, size_t n, const dtr_progress_info *p);

/* ---- optional units: dtrain_cuda.cu and dtrain_comm.c ---- */

/** The CUDA backend vtable, for dtr_context_config.backend (defined in dtrain_cuda.cu): every
 *  op of the core forward and backward (docs/gpu.md lists them; the tensor-parallel
 *  communication ops run on host copies, over a host-memory group), optimizers, a caching
 *  device allocator.
 *  Thread safety: thread safe. */
DTR_API const dtr_backend *dtr_cuda_backend(void);
/** Number of CUDA devices visible (0 without a GPU or driver). Defined in dtrain_cuda.cu. */
DTR_API int dtr_cuda_device_count(void);
/** Device memory of a CUDA context: bytes handed out now (model buffers, optimizer state,
 *  step arena), the most handed out at once since the context began (or since the last
 *  reset_peak), and freed bytes the allocator keeps for reuse. Any pointer may be NULL.
 *  @return DTR_OK; DTR_NULL_HANDLE; DTR_INVALID_ARGUMENT when ctx is not a CUDA context.
 *  Thread safety: the context's thread. Defined in dtrain_cuda.cu. */
DTR_API dtr_result dtr_cuda_memory(dtr_context *ctx, size_t *in_use, size_t *peak, size_t *cached, int reset_peak);
/** Newline-separated names of the libfabric providers that offer reliable-datagram tagged
 *  endpoints here (defined in dtrain_comm.c). DTR_UNSUPPORTED when built without
 *  DTR_USE_LIBFABRIC, DTR_NOT_FOUND when no provider qualifies. */
DTR_API dtr_result dtr_fabric_providers(char *buf, size_t len);

#ifdef __cplusplus
}
#endif
