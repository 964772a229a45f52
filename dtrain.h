/* dtrain.h - v0.1.0 - distributed deep-learning training in C. MIT license (end of file).

   Drop-in use: in ONE C or C++ file

       #define DTRAIN_IMPLEMENTATION
       #include "dtrain.h"

   and include "dtrain.h" normally everywhere else. Link with -lm -lpthread. Nothing else is
   required; optional switches (define before the implementation include):

       DTR_USE_ZLIB    read gzip-compressed IDX files through zlib (link -lz)
       DTR_USE_CBLAS   route GEMM through a system BLAS's cblas_sgemm (link e.g. -lopenblas)
       DTR_USE_STB_IMAGE  decode PNG/JPEG/BMP images with stb_image (header only; Debian's
                       libstb-dev, or set DTR_STB_IMAGE_HEADER to your copy's path)

   See README.md and docs/ for the guides; every public function below has a doc comment.
*/
#ifndef DTRAIN_H
#define DTRAIN_H

/* ---- src/public/api.h ---- */
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
    DTR_DEVICE_OUT_OF_MEMORY = -301 /**< a device allocation failed (host memory: DTR_OUT_OF_MEMORY) */
} dtr_result;

/** Short constant description of a result code ("shape mismatch"). Thread safe. */
DTR_API const char *dtr_result_string(dtr_result r);

/** Runtime version as DTR_VERSION_NUMBER; compare with the macro to detect a header/library skew.
 *  Thread safety: thread safe. */
DTR_API int dtr_version(void);
/** Runtime version string, "major.minor.patch". */
DTR_API const char *dtr_version_string(void);

/* ---- dtypes ---- */

/** Element types. Compute is f32; bf16 and f16 are storage types. Append-only. */
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
} dtr_context_config;

/** Returns a configuration with every field at its default.
 *  Thread safety: thread safe. */
DTR_API dtr_context_config dtr_context_config_init(void);

/** Creates a context: the backend, the thread pool and the step arena.
 *  @param cfg  configuration, or NULL for defaults.
 *  @param out  receives the context (NULL on failure).
 *  @return DTR_OK, DTR_NULL_HANDLE, DTR_INVALID_ARGUMENT, DTR_OUT_OF_MEMORY, DTR_VERSION_MISMATCH
 *          (a backend built against another header) or the backend's init error.
 *  Thread safety: contexts are independent; one context is used by one thread at a time. */
DTR_API dtr_result dtr_context_create(const dtr_context_config *cfg, dtr_context **out);

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
/** Gradient of `t` after dtr_backward (contiguous f32, shape of `t`), or NULL. */
DTR_API float *dtr_tensor_grad(dtr_tensor *t);
/** The name given to a parameter, or "". */
DTR_API const char *dtr_tensor_name(const dtr_tensor *t);
/** Copies the elements in row-major order into host memory `dst` converted to `dt`
 *  (`n` must equal numel). Works for any backend and any view. */
DTR_API dtr_result dtr_tensor_read(const dtr_tensor *t, dtr_dtype dt, void *dst, size_t n);
/** Copies `n` = numel elements of type `dt` from host memory into `t` (converted). */
DTR_API dtr_result dtr_tensor_write(dtr_tensor *t, dtr_dtype dt, const void *src, size_t n);
/** f32 element at a flat row-major index of the logical shape; 0 on error. Handy in tests. */
DTR_API float dtr_tensor_get(const dtr_tensor *t, int64_t index);
/** Marks an arena tensor as requiring a gradient (a leaf the app wants dL/dt of). */
DTR_API dtr_tensor *dtr_tensor_requires_grad(dtr_tensor *t);

/* ---- ops (autograd) ----
 * Each op checks its inputs, records a tape node when grad is enabled and any input needs a
 * gradient, runs the forward kernel of the context's backend and returns the result.
 * Inputs are f32 unless stated (indices are i32). On a bad shape, dtype or NULL input the
 * op records a message naming itself on the context and returns NULL; an op given NULL
 * passes the NULL on, so a whole graph can be built and the status checked once.
 * Binary element-wise ops broadcast as NumPy does. Shapes: B batch, T time, C channels. */

/** Element-wise a + b, a - b, a * b, a / b with broadcasting.
 *  Thread safety: the context's thread. */
DTR_API dtr_tensor *dtr_add(dtr_context *ctx, dtr_tensor *a, dtr_tensor *b);
DTR_API dtr_tensor *dtr_sub(dtr_context *ctx, dtr_tensor *a, dtr_tensor *b);
DTR_API dtr_tensor *dtr_mul(dtr_context *ctx, dtr_tensor *a, dtr_tensor *b);
DTR_API dtr_tensor *dtr_div(dtr_context *ctx, dtr_tensor *a, dtr_tensor *b);
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

/** Mean cross-entropy of logits (N, K) (or (..., K)) against i32 class indices (N) (or (...)).
 *  An index outside [0, K) is DTR_INVALID_ARGUMENT. Returns a scalar (ndim 0).
 *  Thread safety: the context's thread. */
DTR_API dtr_tensor *dtr_cross_entropy(dtr_context *ctx, dtr_tensor *logits, dtr_tensor *targets);
/** Mean squared error between same-shaped tensors; scalar. */
DTR_API dtr_tensor *dtr_mse(dtr_context *ctx, dtr_tensor *pred, dtr_tensor *target);

/** Sum / mean over `axis` (negative allowed); keepdim keeps it as size 1. The mean over an
 *  axis of size 0 is NaN (0 / 0), as PyTorch's torch.mean; the sum of nothing is 0.
 *  Thread safety: the context's thread. */
DTR_API dtr_tensor *dtr_sum(dtr_context *ctx, dtr_tensor *x, int axis, int keepdim);
DTR_API dtr_tensor *dtr_mean(dtr_context *ctx, dtr_tensor *x, int axis, int keepdim);
/** Sum / mean of all elements; scalar. The mean of an empty tensor is NaN, as PyTorch's
 *  torch.mean (dtr_mse of empty tensors too); the sum is 0.
 *  Thread safety: the context's thread. */
DTR_API dtr_tensor *dtr_sum_all(dtr_context *ctx, dtr_tensor *x);
DTR_API dtr_tensor *dtr_mean_all(dtr_context *ctx, dtr_tensor *x);

/** Rows of `table` (V, C) picked by i32 `ids` (any shape S): (S..., C). An id outside [0, V)
 *  is DTR_INVALID_ARGUMENT.
 *  Thread safety: the context's thread. */
DTR_API dtr_tensor *dtr_embedding(dtr_context *ctx, dtr_tensor *table, dtr_tensor *ids);
/** Layer normalisation over the last axis with gain `w` and bias `b` (C) (either may be NULL). */
DTR_API dtr_tensor *dtr_layernorm(dtr_context *ctx, dtr_tensor *x, dtr_tensor *w, dtr_tensor *b, float eps);
/** Inverted dropout with probability p, from the context's seeded RNG; identity when the
 *  context is in evaluation mode or p == 0. */
DTR_API dtr_tensor *dtr_dropout(dtr_context *ctx, dtr_tensor *x, float p);

/** 2-D convolution: x (N, C, H, W), w (O, C, KH, KW), bias (O) or NULL -> (N, O, H', W').
 *  Thread safety: the context's thread. */
DTR_API dtr_tensor *dtr_conv2d(dtr_context *ctx, dtr_tensor *x, dtr_tensor *w, dtr_tensor *bias,
                               int stride, int padding);
/** Max and average pooling over (N, C, H, W) with a k x k window. stride 0 means k.
 *  Average pooling divides by k*k (padding counts as zeros). Max pooling propagates NaN as
 *  PyTorch's max_pool2d: a window holding a NaN gives NaN, and its gradient goes to the NaN.
 *  Thread safety: the context's thread. */
DTR_API dtr_tensor *dtr_maxpool2d(dtr_context *ctx, dtr_tensor *x, int k, int stride, int padding);
DTR_API dtr_tensor *dtr_avgpool2d(dtr_context *ctx, dtr_tensor *x, int k, int stride, int padding);

/** Causal multi-head self-attention core: q, k, v (B, T, C) with C = heads * D ->
 *  (B, T, C), softmax(q k^T / sqrt(D) + causal mask) v per head. Built from matmul,
 *  permute and softmax_causal, so it shares their backward passes.
 *  Thread safety: the context's thread. */
DTR_API dtr_tensor *dtr_attention(dtr_context *ctx, dtr_tensor *q, dtr_tensor *k, dtr_tensor *v, int heads);

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
/** Keeps only the parameters whose names start with one of the n `prefixes` (for example the
 *  layers of one pipeline stage: {"h.2.", "h.3.", "ln_f."}); call it after declaring the
 *  whole model and before dtr_model_build. Kept parameters start from the values they would
 *  have in the whole model (each parameter's initialiser stream is its declaration number),
 *  so a split model and the whole one train from the same weights. A parameter left out
 *  keeps its tensor (layer structs may point at it) but has no storage: an op given it fails
 *  with DTR_INVALID_ARGUMENT naming it. @return DTR_OK, DTR_NULL_HANDLE, DTR_INVALID_ARGUMENT
 *  (n < 0), DTR_BAD_STATE (already built), DTR_OUT_OF_MEMORY.
 *  Thread safety: the model's context thread. */
DTR_API dtr_result dtr_model_keep(dtr_model *m, const char *const *prefixes, int n);
/** Allocates the contiguous parameter and gradient buffers and runs the initialisers.
 *  Called automatically by the first forward use; calling it twice is harmless. */
DTR_API dtr_result dtr_model_build(dtr_model *m);
/** Number of parameters (tensors) and of scalar elements. */
DTR_API int dtr_model_param_count(const dtr_model *m);
DTR_API int64_t dtr_model_numel(const dtr_model *m);
/** Parameter i in declaration order, or NULL. */
DTR_API dtr_tensor *dtr_model_param_at(const dtr_model *m, int i);
/** Parameter by name, or NULL. */
DTR_API dtr_tensor *dtr_model_find(const dtr_model *m, const char *name);
/** Offset in elements of parameter i in the contiguous buffers. */
DTR_API int64_t dtr_model_param_offset(const dtr_model *m, int i);
/** The contiguous f32 parameter and gradient buffers (host pointers on the CPU backend;
 *  NULL before build). Layout: parameters in declaration order, each 16-float aligned. */
DTR_API float *dtr_model_params(dtr_model *m);
DTR_API float *dtr_model_grads(dtr_model *m);
/** Zeroes the gradient buffer. */
DTR_API dtr_result dtr_model_zero_grad(dtr_model *m);
/** The context the model lives on. */
DTR_API dtr_context *dtr_model_context(const dtr_model *m);

/** Fully connected layer: weight (out, in), optional bias (out). */
typedef struct dtr_linear_layer { dtr_tensor *weight, *bias; int64_t in, out; } dtr_linear_layer;
/** 2-D convolution layer: weight (out, in, k, k), bias (out). */
typedef struct dtr_conv2d_layer {
    dtr_tensor *weight, *bias;
    int64_t in, out;
    int k, stride, padding;
} dtr_conv2d_layer;
/** Layer norm over the last axis: weight (C) = 1, bias (C) = 0; eps 1e-5, PyTorch's
 *  nn.LayerNorm default (the layer's `eps` field may be changed after init). */
typedef struct dtr_layernorm_layer { dtr_tensor *weight, *bias; int64_t dim; float eps; } dtr_layernorm_layer;
/** Embedding table (vocab, dim), N(0, 0.02^2) like GPT-2. */
typedef struct dtr_embedding_layer { dtr_tensor *weight; int64_t vocab, dim; } dtr_embedding_layer;
/** Causal self-attention: parameters "<name>.qkv.weight" (3C, C), "<name>.qkv.bias" (3C),
 *  "<name>.proj.weight" (C, C), "<name>.proj.bias" (C), stored as nn.Linear stores them
 *  (out, in). The rows of qkv.weight are q | k | v: rows 0..C-1 give q, C..2C-1 k, 2C..3C-1 v;
 *  head h of `heads` uses features h*C/heads .. (h+1)*C/heads-1 of each (GPT-2's layout).
 *  Scores are scaled by 1/sqrt(C/heads). Hugging Face GPT-2 keeps these as Conv1D weights
 *  (in, out): transpose c_attn.weight and c_proj.weight when porting (docs/guide.md). */
typedef struct dtr_attention_layer { dtr_linear_layer qkv, proj; int64_t dim; int heads; } dtr_attention_layer;
/** Pre-norm GPT block: x + attn(ln1(x)), then x + fc_proj(gelu(fc(ln2(x)))), GELU in its tanh
 *  form (dtr_gelu, GPT-2's). Parameters under "<name>.": ln1.weight/bias, attn.qkv.*,
 *  attn.proj.* (as dtr_attention_layer), ln2.weight/bias, fc.weight (4C, C), fc.bias (4C),
 *  fc_proj.weight (C, 4C), fc_proj.bias (C). Hugging Face GPT-2's h.<i>.ln_1, attn.c_attn,
 *  attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj map to them in that order (Conv1D weights
 *  transposed). */
typedef struct dtr_gpt_block {
    dtr_layernorm_layer ln1, ln2;
    dtr_attention_layer attn;
    dtr_linear_layer fc, fc_proj;
} dtr_gpt_block;

/** Layer constructors declare parameters "<name>.weight" and "<name>.bias" on `m` and fill
 *  `layer`. `init` applies to weights (DTR_INIT_TORCH_DEFAULT matches PyTorch); biases follow
 *  PyTorch's default. `bias` 0 leaves the bias out. Return DTR_OK or the context's error.
 *  Thread safety: the context's thread. */
DTR_API dtr_result dtr_linear_layer_init(dtr_linear_layer *layer, dtr_model *m, const char *name,
                                         int64_t in, int64_t out, int bias, dtr_init init);
DTR_API dtr_result dtr_conv2d_layer_init(dtr_conv2d_layer *layer, dtr_model *m, const char *name,
                                         int64_t in, int64_t out, int k, int stride, int padding,
                                         dtr_init init);
DTR_API dtr_result dtr_layernorm_layer_init(dtr_layernorm_layer *layer, dtr_model *m, const char *name,
                                            int64_t dim);
DTR_API dtr_result dtr_embedding_layer_init(dtr_embedding_layer *layer, dtr_model *m, const char *name,
                                            int64_t vocab, int64_t dim);
DTR_API dtr_result dtr_attention_layer_init(dtr_attention_layer *layer, dtr_model *m, const char *name,
                                            int64_t dim, int heads);
DTR_API dtr_result dtr_gpt_block_init(dtr_gpt_block *block, dtr_model *m, const char *name,
                                      int64_t dim, int heads);
/** Forward passes of the layers (ops with autograd). */
DTR_API dtr_tensor *dtr_linear_layer_forward(dtr_context *ctx, const dtr_linear_layer *l, dtr_tensor *x);
DTR_API dtr_tensor *dtr_conv2d_layer_forward(dtr_context *ctx, const dtr_conv2d_layer *l, dtr_tensor *x);
DTR_API dtr_tensor *dtr_layernorm_layer_forward(dtr_context *ctx, const dtr_layernorm_layer *l, dtr_tensor *x);
DTR_API dtr_tensor *dtr_embedding_layer_forward(dtr_context *ctx, const dtr_embedding_layer *l, dtr_tensor *ids);
/** x (B, T, C) -> (B, T, C). */
DTR_API dtr_tensor *dtr_attention_layer_forward(dtr_context *ctx, const dtr_attention_layer *l, dtr_tensor *x);
DTR_API dtr_tensor *dtr_gpt_block_forward(dtr_context *ctx, const dtr_gpt_block *b, dtr_tensor *x);

/** Saves every parameter to a safetensors file (F32, or BF16/F16 when `dt` says so), written
 *  to a temporary file and renamed into place. Returns DTR_IO_ERROR with the path on failure.
 *  A model with tensor-parallel shards (api_engine.h, dtr_tp_*) saves collectively: every rank
 *  of its group calls this, the shards are gathered and rank 0 writes one file of full
 *  tensors under the single-device names (the others write nothing and return once the
 *  gather is done; the file is complete when rank 0's call returns).
 *  Thread safety: the context's thread. */
DTR_API dtr_result dtr_model_save(dtr_model *m, const char *path, dtr_dtype dt);
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
 *  the contiguous buffers; device memory on a device backend). Builds the model first.
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
    DTR_OPT_LAMB = 3    /**< layer-wise trust ratio over AdamW-style updates (You et al.) */
} dtr_optimizer_kind;

typedef enum dtr_schedule_kind {
    DTR_SCHED_CONSTANT = 0,
    DTR_SCHED_STEP = 1,    /**< lr * gamma^(floor(step / step_size)) */
    DTR_SCHED_COSINE = 2   /**< cosine from lr to min_lr over total_steps */
} dtr_schedule_kind;

/** A learning-rate schedule with optional linear warm-up (from 0 over warmup_steps). */
typedef struct dtr_schedule {
    dtr_schedule_kind kind;
    float lr;
    float min_lr;
    int64_t warmup_steps;
    int64_t total_steps;   /**< cosine length (after warm-up) */
    int64_t step_size;     /**< step schedule period */
    float gamma;           /**< step schedule factor */
} dtr_schedule;

/** Learning rate at optimizer step `step` (0-based). Pure function.
 *  Thread safety: thread safe. */
DTR_API float dtr_schedule_lr(const dtr_schedule *s, int64_t step);

typedef struct dtr_optimizer_config {
    dtr_optimizer_kind kind;
    dtr_schedule schedule;  /**< schedule.lr is the learning rate */
    float momentum;         /**< SGD */
    int nesterov;           /**< SGD */
    float dampening;        /**< SGD */
    double beta1, beta2;    /**< Adam family moments (defaults 0.9, 0.999); double so 1 - beta is exact as in PyTorch */
    float eps;              /**< Adam family (default 1e-8; LAMB 1e-6) */
    float weight_decay;
    float clip_norm;        /**< > 0: clip the global gradient norm before each update */
    int grad_accum_steps;   /**< > 1: dtr_optimizer_step updates every N calls with the mean gradient */
    int64_t shard_begin;    /**< with shard_end > 0: the optimizer updates, and keeps state for, only the */
    int64_t shard_end;      /**< floats [shard_begin, shard_end) of the parameter buffer (on parameter
                                 boundaries for LAMB; may be empty): one rank's shard of a sharded optimizer
                                 (ZeRO, dtr_dp_shard_optimizer). Without shard_sum clip_norm takes the whole
                                 gradient buffer's norm (ZeRO-1: every rank holds the whole average). 0: all */
    /** With a shard: sums n values over the ranks that share the optimizer, in place (the same
     *  result on every rank; a collective every rank's optimizer step calls alike). Given, the
     *  optimizer takes clip_norm's norm as the root of the sum of its shard's sums of squares
     *  (ZeRO-2: a rank holds the average of its shard's gradients only), and LAMB's shard may
     *  split parameters: each one's norms are summed over the shards (host memory only). The
     *  optimizer then steps its whole shard only (dtr_optimizer_step). NULL: none.
     *  dtr_dp_shard_optimizer sets it. */
    dtr_result (*shard_sum)(void *user, double *vals, int n);
    void *shard_sum_user;   /**< handed to shard_sum */
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
 *  included) once every grad_accum_steps calls, then zeroes the gradients.
 *  @param updated  set to 1 when parameters changed (may be NULL). */
DTR_API dtr_result dtr_optimizer_step(dtr_optimizer *opt, int *updated);
/** Number of updates applied so far (the schedule's step). */
DTR_API int64_t dtr_optimizer_steps(const dtr_optimizer *opt);
/** The learning rate of the next update. */
DTR_API float dtr_optimizer_lr(const dtr_optimizer *opt);
/** Replaces the base learning rate (schedule.lr). */
DTR_API void dtr_optimizer_set_lr(dtr_optimizer *opt, float lr);
/** The optimizer's moment buffers: `count` buffers of dtr_model_numel floats each (SGD with
 *  momentum: 1; the Adam family and LAMB: 2), NULL past the end. For checkpoints, prefer
 *  dtr_optimizer_state, which lists every piece of the optimizer's state.
 *  Thread safety: the model's context thread. */
DTR_API float *dtr_optimizer_moments(dtr_optimizer *opt, int index, int *count);
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
 *  micro-batches since the last update), "schedule" (its dtr_schedule, which
 *  dtr_optimizer_set_lr changes), then the moments "m" and "v" where the kind has them
 *  (dtr_model_numel floats each, device memory on a device backend).
 *  @return DTR_OK, DTR_NOT_FOUND past the last, DTR_NULL_HANDLE. Thread safety: the model's
 *  context thread. */
DTR_API dtr_result dtr_optimizer_state(dtr_optimizer *opt, int index, dtr_state_entry *out);
/** After writing the optimizer's entries back: checks them.
 *  @return DTR_OK, DTR_NULL_HANDLE, DTR_CORRUPT_FILE (a negative counter, a micro count not
 *  below grad_accum_steps). Thread safety: the model's context thread. */
DTR_API dtr_result dtr_optimizer_state_loaded(dtr_optimizer *opt);

/** Global L2 norm of the model's gradients; scales them by max_norm / norm when larger.
 *  @param norm_out receives the norm before clipping (may be NULL).
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

/* ---- optional units: dtrain_cuda.cu and dtrain_comm.c ---- */

/** The CUDA backend vtable, for dtr_context_config.backend (defined in dtrain_cuda.cu).
 *  In this version it manages devices and memory; its op kernels report DTR_UNSUPPORTED.
 *  Thread safety: thread safe. */
DTR_API const dtr_backend *dtr_cuda_backend(void);
/** Number of CUDA devices visible (0 without a GPU or driver). Defined in dtrain_cuda.cu. */
DTR_API int dtr_cuda_device_count(void);
/** Newline-separated names of the libfabric providers that offer reliable-datagram tagged
 *  endpoints here (defined in dtrain_comm.c). DTR_UNSUPPORTED when built without
 *  DTR_USE_LIBFABRIC, DTR_NOT_FOUND when no provider qualifies. */
DTR_API dtr_result dtr_fabric_providers(char *buf, size_t len);

#ifdef __cplusplus
}
#endif

/* ---- src/public/api_data.h ---- */
/* ============================================================================
 * Public API: data pipeline (samplers, datasets, loaders)
 * ==========================================================================*/
#ifdef __cplusplus
extern "C" {
#endif

/* ---- distributed sampler ---- */

/** Splits the indices [0, n) of a dataset among `world` ranks, as torch's
 *  DistributedSampler does: every epoch the same seeded permutation on every rank (or the
 *  identity without shuffling), padded by wrapping around (or cut with drop_last) to a
 *  multiple of `world`, then rank r takes positions r, r + world, ... Every rank gets the
 *  same number of indices, so uneven data cannot make one rank wait for another forever. */
typedef struct dtr_sampler {
    int64_t n;          /**< dataset size */
    int rank, world;
    uint64_t seed;
    int shuffle;        /**< 1: a new permutation every epoch */
    int drop_last;      /**< 1: drop the tail instead of padding */
} dtr_sampler;

/** Fills `s`. Returns DTR_INVALID_ARGUMENT for n < 0, world < 1 or rank outside [0, world),
 *  or when drop_last leaves no index for a rank while n > 0 would need one.
 *  Thread safety: one thread per sampler. */
DTR_API dtr_result dtr_sampler_init(dtr_sampler *s, int64_t n, int rank, int world, uint64_t seed, int shuffle,
                                    int drop_last);
/** Indices per rank per epoch (the same on every rank). */
DTR_API int64_t dtr_sampler_count(const dtr_sampler *s);
/** Writes this rank's dtr_sampler_count() indices of `epoch` into `out`. Deterministic:
 *  the same (seed, epoch) gives the same indices on every machine. `scratch` must hold n
 *  int64 values (the permutation) or be NULL to use `alloc` (NULL: libc) for it. */
DTR_API dtr_result dtr_sampler_epoch(const dtr_sampler *s, int64_t epoch, int64_t *out, int64_t *scratch,
                                     const dtr_allocation_callbacks *alloc);

/* ---- datasets ----
 * A dataset is a numbered collection of samples, 0 .. count-1. Each sample is a feature
 * array x and (unless the dataset is unlabeled) a label array y, with a fixed layout for the
 * whole dataset. Every format has a constructor (in-memory arrays, CSV, IDX, image folders,
 * token files) and an application can plug in its own with dtr_dataset_create. A loader
 * (dtr_loader_create) turns any dataset into shuffled, sharded, augmented batches.
 *
 * Errors: constructors and dtr_dataset_get take an `err` buffer (may be NULL) that receives
 * a message naming the file and the line, column or sample at fault.
 * Thread safety: dtr_dataset_get may be called from several threads at once on the same
 * dataset (the loader's prefetch threads do); every built-in dataset allows it. Creating
 * and closing a dataset are single-threaded; close it after every loader over it. */

typedef struct dtr_dataset dtr_dataset;

/** The layout of one sample. x is DTR_F32 (features, pixels) or DTR_I32 (token ids);
 *  y is DTR_I32 (class indices, target tokens) or DTR_F32 (regression targets). */
typedef struct dtr_sample_layout {
    dtr_dtype x_dtype;                /**< DTR_F32 or DTR_I32 */
    int x_ndim;                       /**< 1 .. DTR_MAX_DIMS-1: images are (C, H, W), vectors (D) */
    int64_t x_shape[DTR_MAX_DIMS];
    dtr_dtype y_dtype;                /**< DTR_I32 or DTR_F32 */
    int y_ndim;                       /**< 0: one value per sample (a class index); up to DTR_MAX_DIMS-1 */
    int64_t y_shape[DTR_MAX_DIMS];
    int unlabeled;                    /**< 1: samples have no y */
    int num_classes;                  /**< classification: labels are in [0, num_classes); 0: not known */
} dtr_sample_layout;

/** Elements of x and of y in one sample (y: 0 when unlabeled). NULL gives 0.
 *  Thread safety: thread safe. */
DTR_API int64_t dtr_sample_layout_x_numel(const dtr_sample_layout *l);
DTR_API int64_t dtr_sample_layout_y_numel(const dtr_sample_layout *l);

/** Callbacks of an application-defined dataset (the dataset vtable).
 *  get: writes sample `index` (0 <= index < count) into `x` (x_numel elements of x_dtype)
 *  and `y` (y_numel elements of y_dtype; NULL when unlabeled); returns DTR_OK or an error
 *  with a message in `err` (errlen bytes, may be NULL). Must be safe to call from several
 *  threads at once when a loader with threads > 0 uses the dataset.
 *  close: frees `user` (may be NULL); called once by dtr_dataset_destroy. */
typedef struct dtr_dataset_callbacks {
    void *user;
    dtr_result (*get)(void *user, int64_t index, void *x, void *y, char *err, size_t errlen);
    void (*close)(void *user);
} dtr_dataset_callbacks;

/** Creates a dataset from application callbacks.
 *  @param count   number of samples (>= 0).
 *  @param layout  the sample layout (copied).
 *  @param cb      callbacks (copied); cb->get is required.
 *  @param alloc   allocation callbacks for the handle (NULL: libc).
 *  @param out     receives the dataset (NULL on failure).
 *  @return DTR_OK, DTR_NULL_HANDLE, DTR_INVALID_ARGUMENT (bad layout), DTR_OUT_OF_MEMORY.
 *  Thread safety: see the section comment. */
DTR_API dtr_result dtr_dataset_create(int64_t count, const dtr_sample_layout *layout, const dtr_dataset_callbacks *cb,
                                      const dtr_allocation_callbacks *alloc, dtr_dataset **out, char *err,
                                      size_t errlen);

/** Closes a dataset and frees what it owns (its close callback included). NULL is ignored.
 *  Close it only after every loader and subset over it.
 *  Thread safety: thread safe (see the section comment). */
DTR_API void dtr_dataset_destroy(dtr_dataset *ds);

/** Number of samples; 0 for NULL. Thread safe. */
DTR_API int64_t dtr_dataset_count(const dtr_dataset *ds);

/** The sample layout (valid while the dataset is open); NULL for NULL. Thread safe. */
DTR_API const dtr_sample_layout *dtr_dataset_layout(const dtr_dataset *ds);

/** A short description for messages: the file or folder it was read from, or "memory".
 *  Thread safety: thread safe (see the section comment). */
DTR_API const char *dtr_dataset_name(const dtr_dataset *ds);

/** Reads sample `index` into host buffers `x` (x_numel elements) and `y` (y_numel elements;
 *  may be NULL to skip the label).
 *  @return DTR_OK, DTR_NULL_HANDLE, DTR_INVALID_ARGUMENT (index out of range), or the
 *          format's error (DTR_IO_ERROR, DTR_CORRUPT_FILE, DTR_UNSUPPORTED ...) with a
 *          message naming the file and sample. Thread safe (see the section comment). */
DTR_API dtr_result dtr_dataset_get(dtr_dataset *ds, int64_t index, void *x, void *y, char *err, size_t errlen);

/** Name of class `k` (image-folder subfolders, CSV text labels), or NULL when the dataset
 *  has no class names or k is out of range. Valid while the dataset is open. Thread safe. */
DTR_API const char *dtr_dataset_class_name(const dtr_dataset *ds, int k);

/** A dataset of the samples `indices[0..n)` of `base` (copied), e.g. a train/validation
 *  split. Samples are read from `base`, which must stay open while the subset is used.
 *  @return DTR_OK, DTR_NULL_HANDLE, DTR_INVALID_ARGUMENT (an index outside base), DTR_OUT_OF_MEMORY.
 *  Thread safety: thread safe (see the section comment). */
DTR_API dtr_result dtr_dataset_subset(dtr_dataset *base, const int64_t *indices, int64_t n, dtr_dataset **out,
                                      char *err, size_t errlen);

/** Mean and standard deviation of the f32 features over the whole dataset, computed in
 *  double: per element of x (`per_channel` 0: x_numel values each) or per channel of
 *  (C, ...) samples (`per_channel` 1: x_shape[0] values each). Feed them to the loader's
 *  normalisation (dtr_augment_config). std is the population deviation; 0 becomes 1.
 *  @return DTR_OK, DTR_NULL_HANDLE, DTR_DTYPE_MISMATCH (x not f32), DTR_INVALID_ARGUMENT
 *          (empty dataset), DTR_OUT_OF_MEMORY, or the error of a sample that fails.
 *  Thread safety: thread safe (see the section comment). */
DTR_API dtr_result dtr_dataset_feature_stats(dtr_dataset *ds, int per_channel, float *mean, float *std, char *err,
                                             size_t errlen);

/* ---- in-memory arrays ---- */

/** Arrays the application already holds: sample i is x[i * x_numel ...] and y[i * y_numel ...]. */
typedef struct dtr_memory_dataset_config {
    int64_t count;                    /**< number of samples */
    dtr_sample_layout layout;         /**< x/y dtypes and per-sample shapes */
    const void *x;                    /**< count * x_numel elements of layout.x_dtype */
    const void *y;                    /**< count * y_numel elements of layout.y_dtype; NULL when unlabeled */
    int copy;                         /**< 1: copy the arrays (the app may free them); 0: borrow them
                                           (they must outlive the dataset and stay unchanged) */
    dtr_allocation_callbacks alloc;   /**< zero: libc */
} dtr_memory_dataset_config;

/** Returns a configuration with every field zero (borrowing, f32 x, i32 scalar labels).
 *  Thread safety: thread safe. */
DTR_API dtr_memory_dataset_config dtr_memory_dataset_config_init(void);

/** Creates a dataset over in-memory arrays. When layout.num_classes > 0 every i32 label is
 *  checked to lie in [0, num_classes).
 *  @return DTR_OK, DTR_NULL_HANDLE, DTR_INVALID_ARGUMENT (bad layout, count < 0, a label out
 *          of range: the message names the sample), DTR_OUT_OF_MEMORY.
 *  Thread safety: thread safe (see the section comment). */
DTR_API dtr_result dtr_dataset_from_memory(const dtr_memory_dataset_config *cfg, dtr_dataset **out, char *err,
                                           size_t errlen);

/* ---- CSV ---- */

/** What the label column holds. */
typedef enum dtr_label_kind {
    DTR_LABEL_CLASS = 0,       /**< class indices (i32): integers 0..K-1, or text names mapped to
                                    0..K-1 in sorted (byte) order and kept as class names */
    DTR_LABEL_REGRESSION = 1,  /**< a number (f32) */
    DTR_LABEL_NONE = 2         /**< no label: every column is a feature (unlabeled dataset) */
} dtr_label_kind;

/** CSV options. Fields are separated by `delimiter`, records by LF or CRLF; fields may be
 *  quoted ("a ""b"""); spaces around fields are ignored; blank lines are skipped; a UTF-8
 *  byte-order mark is skipped. Every feature field must be a finite number (decimal, with
 *  optional exponent; parsed without the C locale's influence). An empty field, NA, N/A,
 *  NaN, null or ? is a missing value, which is an error naming the line and column. */
typedef struct dtr_csv_config {
    const char *path;                 /**< the file (dtr_dataset_open_csv) */
    char delimiter;                   /**< 0: ',' */
    int header;                       /**< 0: detect (the first record is a header when none of its
                                           fields is a number); 1: there is one; -1: there is none */
    dtr_label_kind label_kind;        /**< default DTR_LABEL_CLASS */
    int label_column;                 /**< 0-based; negative counts from the end (-1: the last).
                                           dtr_csv_config_init() sets -1 */
    const char *label_name;           /**< when set, the label is the header column of this name */
    const char *ignore;               /**< comma-separated header names of columns to leave out
                                           (an id column, say); NULL: none */
    dtr_allocation_callbacks alloc;   /**< zero: libc */
} dtr_csv_config;

/** Returns the defaults: detected header, ',' separator, class labels in the last column.
 *  Thread safety: thread safe. */
DTR_API dtr_csv_config dtr_csv_config_init(void);

/** Reads a whole CSV file into an in-memory dataset: x is the f32 vector (F) of the feature
 *  columns in file order, y the label (i32 class or f32 value, scalar).
 *  @return DTR_OK, DTR_NULL_HANDLE, DTR_IO_ERROR (cannot open or read), DTR_CORRUPT_FILE
 *          (a bad or missing field, a record with the wrong number of fields, no data
 *          records, a negative or fractional class label: "path:line:column: ..." with the
 *          column's name), DTR_NOT_FOUND (label_name or an ignored name is not in the
 *          header), DTR_INVALID_ARGUMENT (label_column out of range), DTR_OUT_OF_MEMORY.
 *  Thread safe for distinct outputs. */
DTR_API dtr_result dtr_dataset_open_csv(const dtr_csv_config *cfg, dtr_dataset **out, char *err, size_t errlen);

/** Same as dtr_dataset_open_csv over `size` bytes of CSV text in memory (cfg->path, when
 *  set, only names the text in messages). The bytes are not kept.
 *  Thread safety: thread safe (see the section comment). */
DTR_API dtr_result dtr_dataset_csv_from_buffer(const void *bytes, size_t size, const dtr_csv_config *cfg,
                                               dtr_dataset **out, char *err, size_t errlen);

/* ---- IDX (MNIST family) ---- */

/** Creates a dataset from an IDX images file (N, ...) and an optional IDX labels file (N),
 *  plain or gzip (gzip needs DTR_USE_ZLIB), read with dtr_idx_read. Samples of 2-D images
 *  (N, rows, cols) are (1, rows, cols); (N, a, b, c) stays (a, b, c); (N, d) is (d).
 *  u8 images become f32 scaled by 1/255 (other types unscaled); integer labels become i32
 *  class indices (num_classes = max + 1; a negative label is an error), float labels f32.
 *  @param labels_path  NULL for an unlabeled dataset.
 *  @param alloc        NULL: libc.
 *  @return DTR_OK, DTR_NULL_HANDLE, the errors of dtr_idx_read, DTR_CORRUPT_FILE (image and
 *          label counts differ, labels not 1-D, a negative label), DTR_OUT_OF_MEMORY.
 *  Thread safety: thread safe (see the section comment). */
DTR_API dtr_result dtr_dataset_open_idx(const char *images_path, const char *labels_path,
                                        const dtr_allocation_callbacks *alloc, dtr_dataset **out, char *err,
                                        size_t errlen);

/* ---- image folders ---- */

/** An image folder: root/<class>/<image>, one subfolder per class (classes are the
 *  subfolder names in sorted byte order; class k is the k-th), images found recursively
 *  inside each class folder by extension (.png .jpg .jpeg .bmp .gif, any case), in sorted path
 *  order. Decoding needs DTR_USE_STB_IMAGE (see dtr_image_decode). */
typedef struct dtr_image_folder_config {
    const char *root;
    int width, height;                /**< every image is resized to this (required) */
    int channels;                     /**< 1: gray, 3: RGB; 0: 3 (alpha is dropped) */
    dtr_allocation_callbacks alloc;   /**< zero: libc */
} dtr_image_folder_config;

/** Returns the defaults (RGB; width and height must still be set).
 *  Thread safety: thread safe. */
DTR_API dtr_image_folder_config dtr_image_folder_config_init(void);

/** Lists an image folder; images are decoded by dtr_dataset_get (so a loader decodes them in
 *  its threads). Samples are f32 (channels, height, width) in [0, 1], labels i32 class
 *  indices; class names are the subfolder names (dtr_dataset_class_name).
 *  @return DTR_OK, DTR_NULL_HANDLE, DTR_INVALID_ARGUMENT (size or channels), DTR_IO_ERROR
 *          (root cannot be read), DTR_NOT_FOUND (no class folder or no image at all: the
 *          message names root), DTR_UNSUPPORTED (built without DTR_USE_STB_IMAGE, or no
 *          directory listing on this platform: the message says how to enable it),
 *          DTR_OUT_OF_MEMORY. An image that fails to decode is reported by dtr_dataset_get
 *          (or skipped by a loader with skip_bad) naming its file.
 *  Thread safety: thread safe (see the section comment). */
DTR_API dtr_result dtr_dataset_open_image_folder(const dtr_image_folder_config *cfg, dtr_dataset **out, char *err,
                                                 size_t errlen);

/** Width, height and channel count stored in a PNG, JPEG, BMP or GIF image in memory, without
 *  decoding it. Needs DTR_USE_STB_IMAGE (else DTR_UNSUPPORTED).
 *  @return DTR_OK, DTR_NULL_HANDLE, DTR_CORRUPT_FILE (not an image or a damaged header),
 *          DTR_UNSUPPORTED. Thread safe. */
DTR_API dtr_result dtr_image_info(const void *bytes, size_t size, int *width, int *height, int *channels, char *err,
                                  size_t errlen);

/** Decodes a PNG, JPEG, BMP or GIF (first frame) image in memory into f32
 *  (channels, height, width) in [0, 1],
 *  resized from its own size with dtr_image_resize. Decoding uses stb_image, compiled into
 *  the implementation when DTR_USE_STB_IMAGE is defined there (it includes
 *  DTR_STB_IMAGE_HEADER, default <stb/stb_image.h> or "stb_image.h", and defines
 *  STB_IMAGE_IMPLEMENTATION as static functions unless DTR_STB_IMAGE_EXTERNAL says that the
 *  application links its own). Images larger than DTR_IMAGE_MAX_PIXELS (default 2^26) are
 *  refused before decoding.
 *  @param channels  1 (gray) or 3 (RGB).
 *  @param out       channels * height * width floats.
 *  @param alloc     for the temporary buffers (NULL: libc; stb_image itself uses libc).
 *  @return DTR_OK, DTR_NULL_HANDLE, DTR_INVALID_ARGUMENT, DTR_CORRUPT_FILE (the decoder's
 *          reason in the message), DTR_UNSUPPORTED (not compiled in), DTR_OUT_OF_MEMORY.
 *  Thread safe. */
DTR_API dtr_result dtr_image_decode(const void *bytes, size_t size, int channels, int width, int height, float *out,
                                    const dtr_allocation_callbacks *alloc, char *err, size_t errlen);

/** Resizes planar f32 images (channels, src_h, src_w) -> (channels, dst_h, dst_w): exact area
 *  averaging along an axis that shrinks (a box filter that weighs partly covered pixels by
 *  their coverage), bilinear interpolation with pixel centres aligned along an axis that
 *  grows, a plain copy along an axis that keeps its size. Separable (rows, then columns).
 *  @return DTR_OK, DTR_NULL_HANDLE, DTR_INVALID_ARGUMENT (a size < 1), DTR_OUT_OF_MEMORY
 *          (from `alloc`, NULL: libc). `src` and `dst` must not overlap. Thread safe. */
DTR_API dtr_result dtr_image_resize(const float *src, int channels, int src_h, int src_w, float *dst, int dst_h,
                                    int dst_w, const dtr_allocation_callbacks *alloc);

/* ---- token files (language models) ---- */

/** A flat file of token ids (little-endian uint16 or uint32, after an optional header),
 *  memory-mapped (read into memory where mmap is not available). Sample s is the window of
 *  context+1 tokens starting at s * stride: x = tokens [start, start+context) and
 *  y = tokens [start+1, start+context+1), both i32 (context): next-token prediction. */
typedef struct dtr_token_file_config {
    const char *path;
    int token_bytes;                  /**< 2 (uint16, GPT-2 vocabularies) or 4 (uint32); 0: 2 */
    size_t header_bytes;              /**< bytes to skip at the start (llm.c's .bin files: 1024) */
    int64_t context;                  /**< tokens per sample (T, required) */
    int64_t stride;                   /**< tokens between window starts; 0: context (no overlap) */
    int64_t vocab_size;               /**< > 0: a token >= vocab_size is a bad sample; sets num_classes */
    dtr_allocation_callbacks alloc;   /**< zero: libc */
} dtr_token_file_config;

/** Returns the defaults (uint16 tokens, no header, stride = context; context must be set).
 *  Thread safety: thread safe. */
DTR_API dtr_token_file_config dtr_token_file_config_init(void);

/** Maps a token file. count = (tokens - context - 1) / stride + 1 windows (0 when shorter).
 *  @return DTR_OK, DTR_NULL_HANDLE, DTR_INVALID_ARGUMENT (token_bytes, context < 1,
 *          stride < 0), DTR_IO_ERROR (cannot open or map), DTR_CORRUPT_FILE (shorter than
 *          the header, or the token data is not a whole number of tokens), DTR_OUT_OF_MEMORY.
 *  A token that does not fit i32 or passes vocab_size is reported by dtr_dataset_get
 *  naming the file, sample and position.
 *  Thread safety: thread safe (see the section comment). */
DTR_API dtr_result dtr_dataset_open_tokens(const dtr_token_file_config *cfg, dtr_dataset **out, char *err,
                                           size_t errlen);

/* ---- batches ---- */

/** A batch of samples in host memory, owned by the loader or feed that produced it and
 *  valid until its next call (dtr_loader_next, dtr_feed_next) or its destruction.
 *  x is (size, x_shape of a sample...) of x_dtype, y (size, y_shape...) of y_dtype, both
 *  dense row-major: ready for dtr_tensor_from, or use dtr_batch_tensors. */
typedef struct dtr_batch {
    int64_t size;                     /**< samples N */
    dtr_dtype x_dtype;
    int x_ndim;                       /**< including the leading N */
    int64_t x_shape[DTR_MAX_DIMS];
    void *x;
    dtr_dtype y_dtype;
    int y_ndim;                       /**< including the leading N; 0 when unlabeled */
    int64_t y_shape[DTR_MAX_DIMS];
    void *y;                          /**< NULL when unlabeled */
    const int64_t *indices;           /**< (N) dataset index of each sample (a feed: push sequence numbers) */
    int64_t epoch;                    /**< epoch of the batch (0-based) */
    int64_t position;                 /**< batch number within the epoch (0-based) */
    int last;                         /**< 1 for the last batch of its epoch */
} dtr_batch;

/** Copies a batch into arena tensors of `ctx` (dtr_tensor_from): *x gets the batch's x
 *  shape and dtype, *y its labels (NULL when unlabeled; `y` may be NULL to skip them).
 *  @return DTR_OK, DTR_NULL_HANDLE, or the context's error (arena full ...).
 *  Thread safety: the context's thread. */
DTR_API dtr_result dtr_batch_tensors(dtr_context *ctx, const dtr_batch *b, dtr_tensor **x, dtr_tensor **y);

/* ---- the loader ---- */

/** On-the-fly augmentation of f32 samples, in this order: random crop, horizontal flip,
 *  normalisation. Crop and flip act on the last two axes (H, W) of each sample. Random
 *  choices come from a PCG32 stream seeded by (loader seed, epoch, the sample's position in
 *  the epoch), so they repeat exactly and do not depend on threads or timing. */
typedef struct dtr_augment_config {
    int crop_padding;                 /**< > 0: pad H and W by this many zero pixels on each side,
                                           then crop an H x W window at a random offset */
    int hflip;                        /**< 1: mirror left-right with probability 1/2 */
    int norm_count;                   /**< 0: no normalisation; 1: one mean/std for every element;
                                           C: per channel (axis 0 of the sample); x_numel: per element */
    const float *mean, *std;          /**< norm_count values each (copied): x = (x - mean) / std */
} dtr_augment_config;

/** Loader options. Make one with dtr_loader_config_init(). */
typedef struct dtr_loader_config {
    int64_t batch_size;               /**< 0: 32 */
    int shuffle;                      /**< 1: a new seeded permutation every epoch */
    int drop_last;                    /**< 1: drop each epoch's last incomplete batch */
    uint64_t seed;                    /**< shuffles and augmentation; 0 is a valid seed */
    int rank, world;                  /**< sharding (dtr_sampler): rank's share of each epoch; world 0: 1 */
    int shard_drop_tail;              /**< 1: drop the n % world last samples instead of padding
                                           the shards by wrapping around (dtr_sampler's drop_last) */
    int threads;                      /**< prefetch threads; 0: dtr_loader_next loads on the caller */
    int prefetch;                     /**< batches the prefetch queue holds; 0: 2 * threads (min 2) */
    int flatten;                      /**< 1: x comes out as (N, x_numel) */
    dtr_augment_config augment;       /**< zero: none */
    size_t cache_bytes;               /**< > 0: keep decoded samples (before augmentation) of datasets
                                           that decode (image folders, tokens, custom) in memory, up to
                                           this many bytes: samples 0 .. cache_bytes / sample_bytes - 1 */
    int skip_bad;                     /**< 1: a sample that fails to load is replaced by the next
                                           dataset index that loads, and counted (dtr_loader_get_stats);
                                           0: dtr_loader_next returns the error naming the sample */
    dtr_allocation_callbacks alloc;   /**< zero: libc */
} dtr_loader_config;

/** Returns the defaults: batch 32, no shuffle, one rank, synchronous, no augmentation.
 *  Thread safety: thread safe. */
DTR_API dtr_loader_config dtr_loader_config_init(void);

typedef struct dtr_loader dtr_loader;

/** Creates a loader over `ds` (which must outlive it) and starts its prefetch threads.
 *  Every rank gets dtr_sampler_count indices per epoch and so the same number of batches.
 *  Batches follow each other without end: after the last batch of epoch e comes the first
 *  of epoch e + 1 (batch.epoch, batch.position and batch.last say where a batch is).
 *  @return DTR_OK, DTR_NULL_HANDLE, DTR_INVALID_ARGUMENT (rank/world, a negative size, no
 *          batch in an epoch, augmentation that does not fit the samples: the message says
 *          which), DTR_OUT_OF_MEMORY (also when a thread cannot be started).
 *  Thread safety: a loader is used by one thread at a time (its own threads are internal). */
DTR_API dtr_result dtr_loader_create(dtr_dataset *ds, const dtr_loader_config *cfg, dtr_loader **out, char *err,
                                     size_t errlen);

/** Stops and joins the prefetch threads (also in the middle of an epoch) and frees the
 *  loader. NULL is ignored. Batches it returned are invalid afterwards.
 *  Thread safety: the thread that calls dtr_loader_next. */
DTR_API void dtr_loader_destroy(dtr_loader *l);

/** Batches per epoch on this rank (the same on every rank).
 *  Thread safety: the thread that calls dtr_loader_next. */
DTR_API int64_t dtr_loader_batches(const dtr_loader *l);

/** Hands out the next batch (waiting for the prefetch threads if it is not ready yet). The
 *  batch is valid until the next call. The contents depend only on the dataset, the
 *  configuration and the batch's (epoch, position): the same with 0, 1 or 8 threads.
 *  @return DTR_OK; DTR_NULL_HANDLE; or the error of a sample that failed to load (skip_bad
 *          0; dtr_loader_last_error names the batch, file and sample), after which the
 *          loader has moved past that batch and can go on.
 *  Thread safety: the thread that calls dtr_loader_next. */
DTR_API dtr_result dtr_loader_next(dtr_loader *l, dtr_batch *out);

/** The message of the last error of dtr_loader_next, or "".
 *  Thread safety: the thread that calls dtr_loader_next. */
DTR_API const char *dtr_loader_last_error(const dtr_loader *l);

/** Counters since creation. */
typedef struct dtr_loader_stats {
    int64_t batches;                  /**< batches handed out */
    int64_t samples;                  /**< samples handed out */
    int64_t skipped;                  /**< bad samples replaced (skip_bad) */
    int64_t cache_hits;               /**< samples served from the cache */
    double wait_s;                    /**< seconds dtr_loader_next spent waiting (threads > 0) or
                                           loading (threads 0): the time a trainer was kept waiting */
    char last_bad[256];               /**< message of the last skipped sample, or "" */
} dtr_loader_stats;

/** Copies the counters into `out`.
 *  Thread safety: the thread that calls dtr_loader_next. */
DTR_API void dtr_loader_get_stats(const dtr_loader *l, dtr_loader_stats *out);

#define DTR_LOADER_CURSOR_MAGIC 0x52435444u  /* "DTCR" */

/** Where a loader is: the batch dtr_loader_next hands out next, and what decides the
 *  contents (the seed). A plain 64-byte struct of fixed-width fields: a checkpoint stores
 *  its bytes (fields in host byte order) and dtr_loader_set_cursor continues exactly where
 *  the run stopped, with the same batches as an uninterrupted run. */
typedef struct dtr_loader_cursor {
    uint32_t magic;                   /**< DTR_LOADER_CURSOR_MAGIC */
    uint32_t version;                 /**< 1 */
    uint64_t seed;                    /**< the loader's seed: shuffles and augmentation derive from it */
    int64_t epoch;
    int64_t position;                 /**< next batch within the epoch */
    int64_t count;                    /**< dataset size */
    int64_t batch_size;
    int32_t rank, world;
    int32_t shuffle;
    int32_t reserved;
} dtr_loader_cursor;

/** The cursor of the next batch to be handed out (prefetched batches do not count).
 *  Thread safety: the thread that calls dtr_loader_next. */
DTR_API void dtr_loader_get_cursor(const dtr_loader *l, dtr_loader_cursor *out);

/** Moves the loader to `c` (discarding prefetched batches) and adopts its seed. The dataset
 *  size must match; in the middle of an epoch (position > 0) the batch size and world size
 *  must match too. Also the way to jump to an epoch: get the cursor, set epoch and position.
 *  @return DTR_OK, DTR_NULL_HANDLE, DTR_INVALID_ARGUMENT (bad magic or version, mismatch:
 *          dtr_loader_last_error says which), DTR_OUT_OF_MEMORY.
 *  Thread safety: the thread that calls dtr_loader_next. */
DTR_API dtr_result dtr_loader_set_cursor(dtr_loader *l, const dtr_loader_cursor *c);
/** Entry `index` of the loader's state (api.h, "state"): "cursor", its dtr_loader_cursor as
 *  dtr_loader_get_cursor gives it now. @return DTR_OK, DTR_NOT_FOUND past the last,
 *  DTR_NULL_HANDLE. Thread safety: the thread that calls dtr_loader_next. */
DTR_API dtr_result dtr_loader_state(dtr_loader *l, int index, dtr_state_entry *out);
/** After writing the "cursor" entry back: applies it (dtr_loader_set_cursor, with its checks
 *  and results). Thread safety: the thread that calls dtr_loader_next. */
DTR_API dtr_result dtr_loader_state_loaded(dtr_loader *l);

/* ---- feed: a streaming dataset (online training) ---- */

/** A bounded ring buffer of samples that the application pushes into while a trainer pops
 *  batches from it: training inside a running app on a stream of samples. */
typedef struct dtr_feed_config {
    dtr_sample_layout layout;         /**< the samples' layout */
    int64_t capacity;                 /**< samples the ring holds; 0: 1024 */
    int64_t max_batch;                /**< largest batch dtr_feed_next hands out; 0: 256 */
    int drop_oldest;                  /**< 1: a push into a full ring overwrites the oldest samples
                                           (counted) instead of waiting */
    dtr_allocation_callbacks alloc;   /**< zero: libc */
} dtr_feed_config;

/** Returns the defaults (capacity 1024, batches of up to 256, pushes wait when full).
 *  Thread safety: thread safe. */
DTR_API dtr_feed_config dtr_feed_config_init(void);

typedef struct dtr_feed dtr_feed;

/** Creates a feed; all memory is allocated here, pushes and pops allocate nothing.
 *  @return DTR_OK, DTR_NULL_HANDLE, DTR_INVALID_ARGUMENT (layout, sizes), DTR_OUT_OF_MEMORY
 *          (also when a mutex cannot be created).
 *  Thread safety: on one thread, with no push or next in flight. */
DTR_API dtr_result dtr_feed_create(const dtr_feed_config *cfg, dtr_feed **out, char *err, size_t errlen);

/** Frees the feed. No thread may be inside a push or next call. NULL is ignored.
 *  Thread safety: on one thread, with no push or next in flight. */
DTR_API void dtr_feed_destroy(dtr_feed *s);

/** Copies `n` samples (x: n * x_numel elements, y: n * y_numel, NULL when unlabeled) into
 *  the ring. When it is full, waits up to `timeout_ms` for room (0: never blocks; negative:
 *  waits as long as it takes), or with drop_oldest overwrites the oldest samples.
 *  @param pushed  receives how many samples went in (may be NULL).
 *  @return DTR_OK (all went in), DTR_TIMEOUT (the ring stayed full: *pushed < n),
 *          DTR_BAD_STATE (the feed has ended), DTR_NULL_HANDLE, DTR_INVALID_ARGUMENT.
 *  Thread safety: any number of threads may push while one thread calls dtr_feed_next. */
DTR_API dtr_result dtr_feed_push(dtr_feed *s, const void *x, const void *y, int64_t n, int timeout_ms,
                                   int64_t *pushed);

/** Pops a batch of up to `max_size` samples (at most max_batch) once at least `min_size`
 *  (1 when < 1) are there, waiting up to `timeout_ms` (0: never; negative: forever). After
 *  dtr_feed_end the remaining samples come out even when fewer than min_size. The
 *  batch (epoch 0, position = batches popped before) is valid until the next call.
 *  @return DTR_OK, DTR_TIMEOUT (fewer than min_size arrived in time; nothing popped),
 *          DTR_BAD_STATE (closed and empty: the end of the stream), DTR_NULL_HANDLE,
 *          DTR_INVALID_ARGUMENT. Thread safety: one thread pops at a time. */
DTR_API dtr_result dtr_feed_next(dtr_feed *s, int64_t max_size, int64_t min_size, int timeout_ms,
                                   dtr_batch *out);

/** Marks the end of the feed (no more pushes): pushes fail with DTR_BAD_STATE, waiting calls wake up, and
 *  dtr_feed_next drains what is left. Thread safe. */
DTR_API void dtr_feed_end(dtr_feed *s);

/** Counters of a feed. */
typedef struct dtr_feed_stats {
    int64_t size;                     /**< samples waiting in the ring */
    int64_t pushed;                   /**< samples pushed in total */
    int64_t popped;                   /**< samples handed out in batches */
    int64_t dropped;                  /**< samples overwritten by drop_oldest before being popped */
    int64_t timeouts;                 /**< pushes that returned DTR_TIMEOUT */
} dtr_feed_stats;

/** Copies the counters. Thread safe. */
DTR_API void dtr_feed_get_stats(dtr_feed *s, dtr_feed_stats *out);

#ifdef __cplusplus
}
#endif

/* ---- src/public/api_rdzv.h ---- */
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
    int timeout_ms;             /**< deadline of every blocking call, create included; 0: 300000 */
    int max_keys;               /**< server: most keys held; 0: 65536 */
    int max_connections;        /**< server: most open connections; 0: 1024 (at least world_size + 16) */
    size_t max_bytes;           /**< server: most bytes of keys and values held; 0: 256 MiB */
    dtr_allocation_callbacks alloc;  /**< allocation callbacks; zero: libc */
    dtr_log_fn log;             /**< log callback (server refusals, with the reason); NULL: silent.
                                     Called from the server thread too */
    void *log_user;             /**< passed to `log` */
    dtr_log_level log_level;    /**< most verbose level passed to `log` (default DTR_LOG_WARN) */
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

/** Leaves the store and frees it. On rank 0 it first waits (up to timeout_ms) until the other
 *  ranks have closed their connections, so call it after a final barrier, then stops the
 *  server thread and joins it. NULL is ignored. Thread safety: no other call on this store
 *  may be running or follow. */
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

/* ---- src/public/api_comm.h ---- */
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
 *     five minutes): a peer that dies, hangs or leaves turns into DTR_PEER_FAILED or
 *     DTR_TIMEOUT on every surviving rank, naming the rank at fault and the operation
 *     (dtr_comm_last_error, dtr_comm_failed_rank), never into a hang.
 *   - Such a failure breaks the group and every group sharing its transport (sub-groups,
 *     parent): later calls return the same error at once. Destroy the groups (and restart
 *     from a checkpoint with whoever is left).
 *   - Results are deterministic: for a given world size, count, dtype and algorithm a
 *     reduction adds in a fixed order, so two runs give the same bits, and every rank gets
 *     the same bits (docs/distributed.md gives the exact order of each algorithm).
 *   - Buffers are host memory (cfg.memory opens the way to device memory on transports that
 *     take it). A group is used by one thread at a time; different groups
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

/** Settings of the NCCL transport (reserved: the transport arrives with the CUDA backend). */
typedef struct dtr_nccl_config {
    int device;                        /**< CUDA device of this rank; -1 (default): the local rank */
    int blocking;                      /**< 1: NCCL's blocking communicator mode; 0: non-blocking (deadlines work) */
} dtr_nccl_config;

/** Where the buffers handed to a group's collectives live. */
typedef enum dtr_mem_kind {
    DTR_MEM_HOST = 1,                  /**< host memory (default) */
    DTR_MEM_DEVICE = 2                 /**< memory of the context's backend (a GPU): needs a transport that takes it */
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
                                            stream orders the transfers, its backend reduces); NULL for host */
    int timeout_ms;                    /**< deadline of every blocking call; 0: 300000 (five minutes) */
    dtr_allreduce_algo allreduce_algo; /**< DTR_ALLREDUCE_AUTO (default): by size */
    size_t ring_threshold_bytes;       /**< AUTO: ring at or above this many bytes; 0: 256 KiB */
    size_t chain_threshold_bytes;      /**< broadcast: pipelined chain at or above this many bytes (binomial tree below); 0: 1 MiB */
    size_t segment_bytes;              /**< segment of the pipelined chain; 0: 256 KiB */
    int no_native;                     /**< 1: always build collectives over point-to-point, even when the transport has native ones */
    int shared_memory;                 /**< 1: run collectives of up to 128 KiB per rank through a segment
                                            shared by the processes of one host (docs/distributed.md;
                                            $DTR_COMM_SHM=1 or 0 overrides). 0 (default): off, as it did not
                                            beat libfabric's shm provider reliably in this version's runs */
    dtr_allocation_callbacks alloc;    /**< allocation callbacks; zero: libc */
    dtr_log_fn log;                    /**< log callback (errors of the group); NULL: silent */
    void *log_user;
    dtr_log_level log_level;           /**< default DTR_LOG_WARN */
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
/** Waits for the request if it still runs, then frees it. NULL is ignored. Every request
 *  must be freed (before its group is destroyed). */
DTR_API void dtr_request_destroy(dtr_request *req);

#ifdef __cplusplus
}
#endif

/* ---- src/public/api_engine.h ---- */
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
/** Column: linear(dtr_tp_copy(x), W_shard, b_shard), then (gather) dtr_tp_gather. Row: dtr_tp_reduce(x W_shard^T) +
 *  bias. @return the output or NULL with the context's error. Collective over l->comm.
 *  Thread safety: the context's thread; the group not used by another thread meanwhile. */
DTR_API dtr_tensor *dtr_tp_linear_forward(dtr_context *ctx, const dtr_tp_linear *l, dtr_tensor *x);

/** Causal self-attention with its heads split over the group: rank r computes heads
 *  r * heads / tp .. with a column-parallel qkv (its rows of the q, k and v blocks) and a
 *  row-parallel proj. Parameters as dtr_attention_layer's. */
typedef struct dtr_tp_attention {
    dtr_tp_linear qkv, proj;
    int64_t dim;
    int heads, local_heads;    /**< all heads, and this rank's (heads / tp) */
} dtr_tp_attention;

/** Declares the attention `name` on m. @return DTR_OK, DTR_NULL_HANDLE, DTR_INVALID_ARGUMENT
 *  (heads not dividing dim, or tp not dividing heads: the message names both), or the
 *  model's error. Thread safety: the model's context thread. */
DTR_API dtr_result dtr_tp_attention_init(dtr_tp_attention *a, dtr_model *m, dtr_comm *comm, const char *name, int64_t dim,
                                         int heads);
/** x (B, T, C), the same on every rank -> (B, T, C), the same on every rank. Collective.
 *  Thread safety: as dtr_tp_linear_forward. */
DTR_API dtr_tensor *dtr_tp_attention_forward(dtr_context *ctx, const dtr_tp_attention *a, dtr_tensor *x);

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
 *  attention, ln2, column-parallel fc, gelu, row-parallel fc_proj. Parameters as
 *  dtr_gpt_block's (same names and order), the layer norms replicated. */
typedef struct dtr_tp_gpt_block {
    dtr_layernorm_layer ln1, ln2;
    dtr_tp_attention attn;
    dtr_tp_linear fc, fc_proj;
} dtr_tp_gpt_block;

/** Declares the block `name` on m. @return as dtr_tp_attention_init.
 *  Thread safety: the model's context thread. */
DTR_API dtr_result dtr_tp_gpt_block_init(dtr_tp_gpt_block *b, dtr_model *m, dtr_comm *comm, const char *name, int64_t dim,
                                         int heads);
/** x (B, T, C) -> (B, T, C), as dtr_gpt_block_forward. Collective.
 *  Thread safety: as dtr_tp_linear_forward. */
DTR_API dtr_tensor *dtr_tp_gpt_block_forward(dtr_context *ctx, const dtr_tp_gpt_block *b, dtr_tensor *x);

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
                                dtr_dp_step_done gathers the shards. 1: ZeRO-1, gradients averaged
                                whole. 2: ZeRO-2, each bucket's slices are sent to the ranks that
                                own them during backward (a reduce-scatter's volume, half an
                                all-reduce's) and a rank ends with the average of its shard's
                                gradients only. 0: off. Stage 3 is not in this version
                                (DTR_UNSUPPORTED); neither is ZeRO with compress or local SGD.
                                ZeRO's point-to-point messages on the group use tags 2^30 - 1
                                to 2^30 + the bucket count: keep the application's apart */
    int zero_whole_params; /**< ZeRO: 1 makes each shard a run of whole parameters (shards then
                                follow the parameter sizes; LAMB needs no sum over the shards
                                for its trust ratios); 0: equal shards (16-float aligned) */
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
} dtr_dp_stats;

/** Returns a configuration with every field at its default.
 *  Thread safety: thread safe. */
DTR_API dtr_dp_config dtr_dp_config_init(void);

/** Makes model `m` data parallel over group `c`: builds it, broadcasts its parameters from
 *  the root (collective, blocking), splits the contiguous gradient buffer into buckets of
 *  about bucket_bytes along parameter boundaries (last parameters first, as backward
 *  produces them) and adds a gradient hook to the model's context (dtr_context_add_grad_hook): during
 *  dtr_backward each bucket's all-reduce (average) starts as soon as all its gradients are
 *  final, on the group's progress thread, in bucket order on every rank. On a group of size
 *  1 nothing is installed and every call below returns at once. cfg.compress replaces the
 *  f32 all-reduce by a codec (dtr_dp_compress); cfg.local_sgd_every turns on local SGD.
 *  Loop: forward, dtr_backward, dtr_dp_finish, dtr_optimizer_step, dtr_dp_step_done (needed
 *  by local SGD only), dtr_context_reset.
 *  @return DTR_OK, DTR_NULL_HANDLE, DTR_INVALID_ARGUMENT (root, compress, topk_ratio,
 *          powersgd_rank, local_sgd_every or local_sgd_warmup out of range), DTR_BAD_STATE (the context
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
 *  the average over the ranks of their gradients, identical bits on every rank (with a
 *  codec: the decoded average, within the codec's bound; PowerSGD's second all-reduce runs
 *  here; with ZeRO-2: only this rank's shard holds the average, summed in rank order, the
 *  rest of the buffer keeps this rank's own gradients). During local SGD past its warm-up it returns at once.
 *  @return DTR_OK or the first error of a bucket (the group's message names it).
 *  Thread safety: the model's context thread; collective over the group. */
DTR_API dtr_result dtr_dp_finish(dtr_dp *dp);
/** Tells the engine an optimizer step is done (call it after dtr_optimizer_step). With ZeRO
 *  it gathers every rank's updated shard of the parameters (one broadcast per rank, from the
 *  rank that owns it), so every rank holds the whole model again; without ZeRO or local
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
/** Number of gradient buckets, and the [begin, end) float range of bucket i in the gradient
 *  buffer (bucket 0 holds the last parameters). */
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
 *  return the activation for the next stage (any shape, f32). NULL (with the context's
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
    DTR_PS_FAIL = 0,      /**< fail the job: dtr_ps_serve returns DTR_TIMEOUT naming the worker, the group is aborted */
    DTR_PS_CONTINUE = 1   /**< drop the worker from rounds and waits; it rejoins when it speaks again */
} dtr_ps_policy;

/** Parameter-server configuration. Make one with dtr_ps_config_init(); zero means default. */
typedef struct dtr_ps_config {
    int servers;               /**< S servers (ranks 0..S-1), 1 to min(64, size - 1); 0: $DTR_PS_SERVERS (dtrun --servers), else 1 */
    dtr_ps_mode mode;          /**< DTR_PS_SYNC (default) */
    int staleness;             /**< SSP bound s >= 0 (default 2; 0 is lock-step) */
    dtr_optimizer_config opt;  /**< the servers' optimizer (default SGD lr 0.01); LAMB and clip_norm are refused */
    dtr_dtype push_dtype;      /**< gradients on the wire: DTR_F32 (default) or DTR_BF16 (half the bytes) */
    int worker_deadline_ms;    /**< a waited-on worker silent this long is dropped or fails the job; 0: 60000.
                                    Keep it above the longest step a worker takes (a lone worker is waited on) */
    dtr_ps_policy policy;      /**< DTR_PS_FAIL (default) or DTR_PS_CONTINUE */
    dtr_log_fn log;            /**< refused messages and dropped workers are logged here; NULL: silent */
    void *log_user;
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
    int64_t updates;             /**< server: optimizer updates applied to its range */
    int64_t pushes_applied;      /**< server: pushes that went into an update */
    int64_t pulls_answered;      /**< server: pulls answered */
    int64_t refused;             /**< server: malformed, oversized or unexpected messages refused */
    int64_t stale_discarded;     /**< server: pushes of a dropped worker for a finished round, discarded */
    int64_t dropped;             /**< server: workers dropped at the deadline */
    int64_t rejoined;            /**< server: dropped workers that came back */
    int64_t staleness[DTR_PS_STALENESS_BINS]; /**< server: pushes by staleness (clocks); the last bin counts that many or more */
    int64_t max_staleness;       /**< server: the largest staleness seen */
    int64_t pushes, pulls;       /**< worker: pushes and pulls made (each to every server) */
    int64_t row_pushes, row_pulls; /**< sparse: worker: calls made; server: row messages applied / answered */
    int64_t wait_ns;             /**< worker: time spent in pulls waiting for the servers */
    uint64_t bytes_sent, bytes_received; /**< both: payload and headers put on / taken off the wire */
} dtr_ps_stats;

typedef struct dtr_ps dtr_ps;

/** Makes this rank's part of the parameter-server engine over `c` (every rank of the group
 *  calls it, with the same cfg and a model built alike): a server makes its optimizer over
 *  its range, a worker its buffers; then the engine's own group is split from `c` (a
 *  collective over `c`, after the checks: a refused configuration sends nothing). A server's
 *  copy of that group waits a day for a worker's next message; the engine's worker deadline
 *  bounds what it waits for.
 *  @return DTR_OK, DTR_NULL_HANDLE, DTR_INVALID_ARGUMENT (servers not below the group size,
 *  staleness < 0, push_dtype, mode, policy; the context's message says which), DTR_UNSUPPORTED
 *  (LAMB, clip_norm), DTR_OUT_OF_MEMORY. Thread safety: the model's context thread. */
DTR_API dtr_result dtr_ps_create(dtr_model *m, dtr_comm *c, const dtr_ps_config *cfg, dtr_ps **out);
/** Frees the engine (not the model or group). NULL is ignored. A server still listening
 *  (dtr_ps_serve returned an error) aborts the group first so that nothing waits on it.
 *  Thread safety: the model's context thread. */
DTR_API void dtr_ps_destroy(dtr_ps *ps);
/** 1 on a server rank, 0 on a worker (0 for NULL). Thread safety: any thread. */
DTR_API int dtr_ps_is_server(const dtr_ps *ps);
/** This rank's index among the servers or among the workers (-1 for NULL). Thread safe. */
DTR_API int dtr_ps_index(const dtr_ps *ps);
/** Number of workers W (0 for NULL). Thread safety: any thread. */
DTR_API int dtr_ps_workers(const dtr_ps *ps);
/** Server s's range of the parameter buffer, [*begin, *end) in floats.
 *  @return DTR_OK, DTR_NULL_HANDLE, DTR_INVALID_ARGUMENT (s). Thread safety: any thread. */
DTR_API dtr_result dtr_ps_range(const dtr_ps *ps, int s, int64_t *begin, int64_t *end);
/** Server: answers the workers until every worker has said dtr_ps_finish (or was dropped
 *  and never came back). Returns DTR_OK then; DTR_TIMEOUT (policy FAIL, a worker silent past
 *  the deadline: the context's message names it), or the group's error.
 *  Thread safety: the model's context thread. */
DTR_API dtr_result dtr_ps_serve(dtr_ps *ps);
/** Worker: pulls the parameters from every server into the model (SYNC: those of the step
 *  after this worker's last push; SSP: waits within the staleness bound; ASYNC: the current
 *  ones). @return DTR_OK, DTR_BAD_STATE (on a server), or the group's error.
 *  Thread safety: the model's context thread. */
DTR_API dtr_result dtr_ps_pull(dtr_ps *ps);
/** Worker: pushes the model's gradient buffer (each server its range, in push_dtype) and
 *  zeroes it; the worker's clock advances. @return DTR_OK, DTR_BAD_STATE (on a server), or
 *  the group's error. Thread safety: the model's context thread. */
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

#endif /* DTRAIN_H */

#if defined(DTRAIN_IMPLEMENTATION) || defined(DTRAIN_INTERNAL_API)
#ifndef DTRAIN_INTERNAL_H
#define DTRAIN_INTERNAL_H

/* ---- src/core/platform.h ---- */
#line 1 "src/core/platform.h"
/* ============================================================================
 * Platform shims shared by the implementation and the two other units: compiler attributes
 * and atomics, each defined once. GCC and Clang builtins; other compilers get the portable
 * fall-backs noted at each macro.
 * ==========================================================================*/

/* ---- attributes ---- */

/** printf-style checking of a function's format (argument fmt_index) against its variadic
 *  arguments (from first_arg): -Wformat then finds every mismatched call. */
#if defined(__GNUC__) || defined(__clang__)
#define DTR__PRINTF(fmt_index, first_arg) __attribute__((format(printf, fmt_index, first_arg)))
#else
#define DTR__PRINTF(fmt_index, first_arg)
#endif

/** Marks the declaration of an implementation-private function (dtr__, not used by
 *  dtrain_cuda.cu, dtrain_comm.c or the tests): `static` inside the implementation unit, so
 *  the library exports only what the other units need (`make private-check` keeps it so);
 *  a plain declaration in the units that see the internal API, where nothing calls it. A
 *  definition without `static` after it keeps the internal linkage (C99 6.2.2). */
#if defined(DTRAIN_IMPLEMENTATION)
#define DTR__PRIVATE static
#else
#define DTR__PRIVATE
#endif

/* ---- atomics ----
 * Acquire/release loads and stores, a sequentially consistent decrement and compare-and-swap,
 * and relaxed accesses, on integers shared between threads. */
#if defined(__GNUC__) || defined(__clang__)
#define DTR__ATOMIC_LOAD(p) __atomic_load_n((p), __ATOMIC_ACQUIRE)
#define DTR__ATOMIC_STORE(p, v) __atomic_store_n((p), (v), __ATOMIC_RELEASE)
#define DTR__ATOMIC_LOAD_SC(p) __atomic_load_n((p), __ATOMIC_SEQ_CST)
#define DTR__ATOMIC_STORE_SC(p, v) __atomic_store_n((p), (v), __ATOMIC_SEQ_CST)
#define DTR__ATOMIC_LOAD_RELAXED(p) __atomic_load_n((p), __ATOMIC_RELAXED)
#define DTR__ATOMIC_STORE_RELAXED(p, v) __atomic_store_n((p), (v), __ATOMIC_RELAXED)
#define DTR__ATOMIC_DEC(p) __atomic_sub_fetch((p), 1, __ATOMIC_SEQ_CST)
#define DTR__ATOMIC_INC(p) __atomic_add_fetch((p), 1, __ATOMIC_SEQ_CST)
/* 1 when *p was *expect and is now v; else 0 and *expect holds *p */
#define DTR__ATOMIC_CAS(p, expect, v) \
    __atomic_compare_exchange_n((p), (expect), (v), 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)
#define DTR__HAVE_ATOMICS 1
#else
#define DTR__HAVE_ATOMICS 0   /* callers fall back to their mutexes (the thread pool), or need shims here */
#endif
#line 2672 "dtrain.h"

/* ---- src/core/internal.h ---- */
#line 1 "src/core/internal.h"
/* ============================================================================
 * Internal types shared by the implementation, the CUDA backend (dtrain_cuda.cu) and the
 * transports (dtrain_comm.c). Visible with DTRAIN_IMPLEMENTATION or DTRAIN_INTERNAL_API.
 * Not a stable API: names start with dtr__ and may change between versions.
 * ==========================================================================*/

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- allocation ---- */

void *dtr__malloc(const dtr_allocation_callbacks *a, size_t bytes);
void *dtr__calloc(const dtr_allocation_callbacks *a, size_t bytes);
DTR__PRIVATE void *dtr__realloc(const dtr_allocation_callbacks *a, void *p, size_t bytes);
void dtr__free(const dtr_allocation_callbacks *a, void *p);
/** snprintf into `err` (may be NULL) and return `code`: the error path of readers without a context. */
dtr_result dtr__errf(char *err, size_t errlen, dtr_result code, const char *fmt, ...) DTR__PRINTF(4, 5);

/* ---- thread pool ---- */

typedef struct dtr__pool dtr__pool;
/** Body of a parallel loop: handles [begin, end) on worker `worker` (0 .. threads-1). */
typedef void (*dtr__task_fn)(void *arg, int64_t begin, int64_t end, int worker);
/** Starts threads-1 workers (the caller is worker 0). threads <= 1 makes a serial pool. */
dtr_result dtr__pool_create(const dtr_allocation_callbacks *a, int threads, dtr__pool **out);
void dtr__pool_destroy(dtr__pool *p);
int dtr__pool_threads(const dtr__pool *p);
/** Runs fn over [0, n) split into at most `threads` contiguous chunks of at least `grain`
 *  items; returns when all are done. p NULL or a small n runs inline on the caller. */
void dtr__pool_run(dtr__pool *p, int64_t n, int64_t grain, dtr__task_fn fn, void *arg);
/** Per-worker scratch of at least `bytes`, 64-byte aligned, kept between calls (it grows only
 *  when a larger size is asked for, so steady state allocates nothing). NULL on OOM. */
void *dtr__pool_scratch(dtr__pool *p, int worker, size_t bytes);

/* ---- GEMM ---- */

/** C (M, N) = alpha * A (M, K) B (K, N) + beta * C, all f32.
 *  A(i,k) = A[i*rsa + k*csa], B(k,j) = B[k*rsb + j*csb], C(i,j) = C[i*ldc + j]; any strides
 *  (transposed views need no copy). beta == 0 ignores C's old contents (NaN included).
 *  Threads over `p` (NULL: serial). Packed, blocked, SIMD (AVX-512/AVX2 chosen at run time;
 *  portable C otherwise); with DTR_USE_CBLAS through cblas_sgemm where the strides allow. */
void dtr__gemm(dtr__pool *p, int64_t M, int64_t N, int64_t K, float alpha,
               const float *A, int64_t rsa, int64_t csa,
               const float *B, int64_t rsb, int64_t csb,
               float beta, float *C, int64_t ldc);
/** dtr__gemm run entirely on the calling thread, which is worker `worker` of `p` (its packing
 *  buffers come from that worker's scratch). For callers that already split work
 *  over the pool. p NULL: private buffers of the calling thread. */
void dtr__gemm_on(dtr__pool *p, int worker, int64_t M, int64_t N, int64_t K, float alpha,
                  const float *A, int64_t rsa, int64_t csa,
                  const float *B, int64_t rsb, int64_t csb,
                  float beta, float *C, int64_t ldc);
/** Name of the GEMM kernel picked at run time ("avx512", "avx2", "generic", "cblas"). */
const char *dtr__gemm_kernel_name(void);

/* ---- arena ---- */

typedef struct dtr__chunk {
    struct dtr__chunk *next;
    size_t size, used;
    /* data follows, 64-byte aligned */
} dtr__chunk;

typedef struct dtr__arena {
    dtr__chunk *head;          /* chunk being filled */
    dtr__chunk *full;          /* chunks filled during this step */
    size_t reserved, used, max_bytes, chunk_bytes;
    const dtr_allocation_callbacks *alloc;
} dtr__arena;

DTR__PRIVATE void dtr__arena_init(dtr__arena *a, const dtr_allocation_callbacks *alloc, size_t chunk_bytes, size_t max_bytes);
/** 64-byte aligned memory; NULL when allocation fails or max_bytes would be passed. */
DTR__PRIVATE void *dtr__arena_alloc(dtr__arena *a, size_t bytes, int *full);
/** Forgets every allocation. When the step needed more than one chunk, the chunks are
 *  replaced by one chunk of the total size, so the next step fits in one. */
DTR__PRIVATE void dtr__arena_reset(dtr__arena *a);
DTR__PRIVATE void dtr__arena_free(dtr__arena *a);

/* ---- tensors and the tape ---- */

enum {
    DTR__REQUIRES_GRAD = 1u,   /* gradient wanted (leaf or computed from one) */
    DTR__PARAM = 2u,           /* model parameter: storage and grad in the model buffers */
    DTR__LEAF = 4u
};

struct dtr__node;

struct dtr_tensor {
    dtr_dtype dtype;
    int ndim;
    int64_t shape[DTR_MAX_DIMS];
    int64_t stride[DTR_MAX_DIMS];   /* in elements */
    int64_t offset;                 /* in elements from storage */
    void *storage;                  /* host or device memory */
    float *grad;                    /* contiguous f32, logical shape; NULL until needed */
    dtr_context *ctx;
    struct dtr__node *node;         /* the op that made it (NULL for leaves) */
    uint32_t flags;
    int param_index;                /* -1 unless a parameter */
    dtr_model *model;               /* owner of a parameter */
    const char *name;
    int grad_pending;               /* parameter, during a backward pass with gradient hooks:
                                       tape nodes still to write its gradient */
    uint32_t grad_pass;             /* the backward pass `grad` belongs to (intermediates) */
};

/* ---- the op list ----
 * One entry per op, in id order: X(ID, "name", kernels).
 *   ID       DTR_OP_<ID>, the op's stable id. Ids are append-only (traces and checkpoints store
 *            them): a new op goes at the END of the list, and DTR__OP_COUNT_EXPECTED below grows.
 *   "name"   what errors, logs and traces print (dtr__op_name).
 *   kernels  the CPU kernel pair dtr__cpu_<kernels>_fwd / dtr__cpu_<kernels>_bwd (src/ops/);
 *            ops of one family share a pair and switch on node->op.
 * Everything indexed by op (the enum, the names, each backend's dispatch table, the tests'
 * coverage check) is generated from this list: adding an op is one entry here, a builder, its
 * kernels and a test case (HACKING.md, "Adding an op"). */
#define DTR__OP_LIST(X)                                                                       \
    X(ADD, "add", binary) X(SUB, "sub", binary) X(MUL, "mul", binary) X(DIV, "div", binary)   \
    X(SCALE, "scale", unary) X(RELU, "relu", unary) X(GELU, "gelu", unary)                   \
    X(TANH, "tanh", unary) X(SIGMOID, "sigmoid", unary)                                      \
    X(MATMUL, "matmul", matmul) X(LINEAR, "linear", linear)                                  \
    X(SOFTMAX, "softmax", softmax) X(LOG_SOFTMAX, "log_softmax", softmax)                    \
    X(SOFTMAX_CAUSAL, "softmax_causal", softmax)                                             \
    X(CROSS_ENTROPY, "cross_entropy", cross_entropy) X(MSE, "mse", mse)                      \
    X(SUM, "sum", reduce) X(MEAN, "mean", reduce) X(SUM_ALL, "sum_all", reduce)              \
    X(MEAN_ALL, "mean_all", reduce)                                                          \
    X(EMBEDDING, "embedding", embedding) X(LAYERNORM, "layernorm", layernorm)                \
    X(DROPOUT, "dropout", dropout) X(CONV2D, "conv2d", conv2d)                               \
    X(MAXPOOL2D, "maxpool2d", pool2d) X(AVGPOOL2D, "avgpool2d", pool2d)                      \
    X(CAST, "cast", cast)                                                                    \
    X(RESHAPE, "reshape", view) X(PERMUTE, "permute", view) X(SLICE, "slice", view)          \
    X(CONCAT, "concat", view) X(CONTIGUOUS, "contiguous", view)                              \
    X(ABS, "abs", unary) X(GELU_ERF, "gelu_erf", unary)                                      \
    X(TP_COPY, "tp_copy", comm) X(TP_REDUCE, "tp_reduce", comm)                             \
    X(VOCAB_CROSS_ENTROPY, "vocab_cross_entropy", comm) X(TP_GATHER, "tp_gather", comm)      \
    X(CHECKPOINT, "checkpoint", checkpoint)

#define DTR__OP_ENUM(id, name, kernels) DTR_OP_##id,
/** Stable op ids (DTR_OP_NONE = 0 is no op). */
typedef enum dtr__op { DTR_OP_NONE = 0, DTR__OP_LIST(DTR__OP_ENUM) DTR_OP_COUNT } dtr__op;
#undef DTR__OP_ENUM
/** The count, stated: a change here is a change of the stored ids' range, made on purpose. */
#define DTR__OP_COUNT_EXPECTED 40
typedef char dtr__op_count_check[(DTR_OP_COUNT == DTR__OP_COUNT_EXPECTED) ? 1 : -1];

/* The CPU kernels of the list's entries (src/ops/), private to the implementation. */
#define DTR__CPU_DECLARE(id, name, k)                                       \
    DTR__PRIVATE dtr_result dtr__cpu_##k##_fwd(dtr_context *, struct dtr__node *); \
    DTR__PRIVATE dtr_result dtr__cpu_##k##_bwd(dtr_context *, struct dtr__node *);

/** "add", "conv2d", ...; "none" for 0 and "?" outside the list. */
const char *dtr__op_name(int op);

/* ---- typed op parameters: what an op means, recorded by its builder ---- */

typedef struct dtr__conv2d_params { int64_t stride, padding; } dtr__conv2d_params;   /* CONV2D */
typedef struct dtr__pool2d_params { int64_t k, stride, padding; } dtr__pool2d_params; /* MAX/AVGPOOL2D */
typedef struct dtr__dropout_params {
    float p;                          /* drop probability, in (0, 1) */
    dtr_rng rng;                      /* the context's stream where this op's draws start: the
                                         mask is element i's draw < p, in row-major order */
} dtr__dropout_params;
typedef struct dtr__view_params {
    int axis;                         /* SLICE, CONCAT: the axis */
    int64_t start;                    /* SLICE: first index along axis */
    int perm[DTR_MAX_DIMS];           /* PERMUTE: out axis d is input axis perm[d] */
} dtr__view_params;

typedef struct dtr__checkpoint_params {
    dtr_checkpoint_fn fn;             /* the region (dtr_checkpoint) and its user pointer */
    void *user;
    dtr_rng rng;                      /* the context's stream when the region began: the
                                         recomputation draws the same dropout masks */
    int n_explicit;                   /* in[0 .. n_explicit-1] are fn's inputs; the rest are the
                                         tensors the region read that need gradients */
    int training;                     /* the context's training mode in the region */
    dtr_tensor *region_out;           /* forward only: the region's output (dense, on the
                                         region's tape) that the kernel copies into out */
} dtr__checkpoint_params;

/** Parameters of a node, by op (ops not listed have none). */
typedef union dtr__op_params {
    float scale;                      /* SCALE: the factor */
    float eps;                        /* LAYERNORM: added to the variance */
    int axis;                         /* SUM, MEAN: the reduced axis */
    dtr__checkpoint_params checkpoint;
    dtr__conv2d_params conv2d;
    dtr__pool2d_params pool2d;
    dtr__dropout_params dropout;
    dtr__view_params view;
    dtr_comm *comm;                   /* TP_COPY, TP_REDUCE, TP_GATHER, VOCAB_CROSS_ENTROPY: the tensor-parallel
                                         group (the last's rank r holds vocabulary rows r * K ..) */
} dtr__op_params;

#define DTR__INLINE_INPUTS 4

/** One recorded operation: what the builder says (op, inputs, params) and what the backend's
 *  forward keeps for backward (`saved`). */
typedef struct dtr__node {
    int op;                           /* DTR_OP_* */
    int n_in;                         /* number of inputs */
    dtr_tensor **in;                  /* the inputs (in_inline when n_in <= DTR__INLINE_INPUTS);
                                         an entry may be NULL (an absent optional input) */
    dtr_tensor *in_inline[DTR__INLINE_INPUTS];
    dtr_tensor *out;
    dtr__op_params p;
    int taped;                        /* recorded for backward (set before the forward kernel runs) */
    void *saved;                      /* backend-private: what its forward keeps for its backward
                                         (masks, argmax indices, statistics, im2col columns) */
    struct dtr__node *prev;           /* previous node on the tape */
    struct dtr_tape *tape;            /* the tape that recorded it */
} dtr__node;

/** Arguments of one fused optimizer update over a contiguous range. */
typedef struct dtr__opt_args {
    int kind;                     /* dtr_optimizer_kind */
    int64_t n;
    float *param, *grad, *m, *v;  /* m, v: moments (may be NULL when unused) */
    float lr, momentum, dampening, eps, weight_decay;
    double beta1, beta2;
    int nesterov;
    int64_t begin;                /* the update covers [begin, n) of the buffers (0: all) */
    int64_t step;                 /* 1-based update count (bias correction) */
    float grad_scale;             /* gradients are multiplied by this first (accumulation) */
    int first;                    /* first SGD momentum step */
    /* LAMB: per-parameter segments */
    int nseg;
    const int64_t *seg_begin, *seg_end;
    float *work;                  /* n floats of scratch for LAMB */
} dtr__opt_args;

DTR__OP_LIST(DTR__CPU_DECLARE)
DTR__PRIVATE dtr_result dtr__cpu_optimizer_update(dtr_context *ctx, const dtr__opt_args *args);

/** A backend's dispatch table: kernels[op] for every id of the op list (NULL: none). */
typedef dtr_result (*dtr__kernel)(dtr_context *, struct dtr__node *);
typedef struct dtr__kernel_pair { dtr__kernel fwd, bwd; } dtr__kernel_pair;
/** 1 when table[op] has a forward kernel. */
int dtr__table_has(const dtr__kernel_pair *table, int op);
/** Runs the forward (bwd 0) or backward kernel of node->op from `table`, or records
 *  DTR_UNSUPPORTED naming the backend and the op. Shared by every backend's vtable. */
dtr_result dtr__table_run(const dtr__kernel_pair *table, const char *backend, dtr_context *ctx, struct dtr__node *n,
                          int bwd);

/** Capabilities of a backend (dtr_backend.caps). */
enum {
    DTR__CAP_HOST_MEMORY = 1u,  /* tensor, parameter and gradient memory is host memory: the
                                   host may read and write it directly (the CPU) */
    DTR__CAP_ASYNC = 2u         /* work is queued on a stream and completes later: wait on
                                   events (or synchronize) before the host reads results */
};

/** The backend vtable. CPU lives in dtrain.h; CUDA in dtrain_cuda.cu. Append-only: a new
 *  slot goes at the end, and struct_size tells which slots a backend has.
 *  Asynchronous contract: every slot that computes may only queue work on the context's
 *  stream; event_record marks "everything queued so far", and results are host-visible once
 *  that event completes. A backend without DTR__CAP_ASYNC (the CPU) completes each call
 *  before it returns and records NULL events (complete). Errors of a device are reported as
 *  DTR_DEVICE_ERROR / DTR_DEVICE_OUT_OF_MEMORY, distinct from DTR_UNSUPPORTED (no kernel). */
struct dtr_backend {
    int abi_version;          /* DTR_VERSION_NUMBER the backend was built with */
    size_t struct_size;       /* sizeof(dtr_backend) the backend was built with */
    const char *name;
    unsigned caps;            /* DTR__CAP_* */
    dtr_result (*init)(dtr_context *ctx, void **state);
    void (*shutdown)(dtr_context *ctx, void *state);
    /* long-lived memory (model buffers, optimizer state) */
    void *(*mem_alloc)(dtr_context *ctx, size_t bytes);
    void (*mem_free)(dtr_context *ctx, void *p);
    /* step-arena chunk memory */
    void *(*chunk_alloc)(dtr_context *ctx, size_t bytes);
    void (*chunk_free)(dtr_context *ctx, void *p);
    dtr_result (*memset0)(dtr_context *ctx, void *dst, size_t bytes);
    /* copies between host and backend memory; to_host completes before it returns */
    dtr_result (*to_host)(dtr_context *ctx, void *dst, const void *src, size_t bytes);
    dtr_result (*from_host)(dtr_context *ctx, void *dst, const void *src, size_t bytes);
    /* 1 when the backend has forward and backward kernels for op (DTR_OP_*) */
    int (*supports_op)(const dtr_context *ctx, int op);
    /* run the forward kernel of node->op, writing node->out (and node->saved) */
    dtr_result (*forward)(dtr_context *ctx, dtr__node *node);
    /* accumulate into the grads of node->in[i] that are non-NULL, from node->out->grad */
    dtr_result (*backward)(dtr_context *ctx, dtr__node *node);
    /* optimizer update over n contiguous floats (see dtr__opt_args) */
    dtr_result (*optimizer_update)(dtr_context *ctx, const dtr__opt_args *args);
    /* sum of squares of n floats into *out (host; completes before it returns) */
    dtr_result (*sumsq)(dtr_context *ctx, const float *x, int64_t n, double *out);
    /* x *= s over n floats */
    dtr_result (*scale)(dtr_context *ctx, float *x, int64_t n, float s);
    /* out[i] = a[i] op b[i] over n elements of dt in this backend's memory, then / div when
       div > 1 (collectives reduce with it; out may alias a or b). op: dtr_reduce_op */
    dtr_result (*reduce)(dtr_context *ctx, void *out, const void *a, const void *b, size_t n, dtr_dtype dt, int op,
                         int div);
    /* events: *ev marks the work queued so far on the context's stream (NULL: complete);
       valid until dtr_context_reset. wait blocks the host; query sets *done. */
    dtr_result (*event_record)(dtr_context *ctx, dtr_event **ev);
    dtr_result (*event_wait)(dtr_context *ctx, dtr_event *ev);
    dtr_result (*event_query)(dtr_context *ctx, dtr_event *ev, int *done);
    dtr_result (*synchronize)(dtr_context *ctx);
};

#define DTR__MAX_GRAD_HOOKS 8
/** How deep dtr_checkpoint regions may nest (each level has its own recompute tape). */
#define DTR__MAX_RECOMPUTE_DEPTH 4

/** A tape and the arenas of what was recorded while it was current (dtr_tape_create; the
 *  context's own is ctx->own). Resetting it frees all of them at once. */
struct dtr_tape {
    dtr_context *ctx;
    dtr__arena meta;              /* tensor structs and nodes (host) */
    dtr__arena data;              /* tensor data (backend memory) */
    dtr__node *head;              /* last recorded node */
};

/** One installed gradient hook (dtr_context_add_grad_hook). */
typedef struct dtr__grad_hook {
    dtr_grad_hook_fn fn;
    void *user;
    int id;
} dtr__grad_hook;

struct dtr_context {
    dtr_context_config cfg;
    dtr_allocation_callbacks alloc;
    const dtr_backend *backend;
    void *backend_state;
    dtr__pool *pool;
    int threads;
    dtr_tape own;                 /* the context's own tape (dtr_context_reset) */
    dtr_tape *cur;                /* where ops record and allocate now (&own by default) */
    size_t live_bytes;            /* arena bytes in use over all tapes */
    size_t peak_bytes;            /* the most live_bytes since the last dtr_context_arena_peak reset */
    int grad_enabled;
    int training;
    dtr_result status;            /* sticky */
    char msg[512];
    dtr_rng rng;                  /* dropout */
    /* gradient hooks (dtr_context_add_grad_hook), called in order once a parameter's
       gradient is final for a backward pass; none installed costs nothing */
    dtr__grad_hook grad_hooks[DTR__MAX_GRAD_HOOKS];
    int n_grad_hooks, grad_hook_ids;
    uint32_t backward_pass;       /* number of the current (last) backward pass */
    /* activation checkpointing (src/core/recompute.c): one tape per nesting level, made on
       first use, where a region runs and is recomputed; empty between uses */
    dtr_tape *recompute[DTR__MAX_RECOMPUTE_DEPTH];
    int recompute_depth;          /* levels in use now */
};

/** Host memory for the backend's tensors (may the host read and write it?). */
static inline int dtr__host_memory(const dtr_context *ctx) { return (ctx->backend->caps & DTR__CAP_HOST_MEMORY) != 0; }

/* ---- autograd internals (src/core/autograd.c, src/core/recompute.c) ---- */

/** Replays the nodes from `head` back in the current pass (ctx->backward_pass); the root
 *  already holds its gradient. report 0: gradient hooks are neither counted nor called (a
 *  recomputed region inside the pass that reports its parameters). */
DTR__PRIVATE dtr_result dtr__replay(dtr_context *ctx, dtr__node *head, int report);
/** 1 when p (a tensor struct, a node) lies in the metadata arena of tape t. */
DTR__PRIVATE int dtr__tape_owns(const dtr_tape *t, const void *p);
/** The backward of a CHECKPOINT node, for every backend: recomputes the region with its
 *  saved random stream and replays it into the gradients of the node's inputs. */
DTR__PRIVATE dtr_result dtr__checkpoint_backward(dtr_context *ctx, dtr__node *n);

/* ---- the atomic file writer (src/io/atomic.c) ---- */

typedef struct dtr__afile dtr__afile;
/** Starts writing `path` through a temporary file beside it. */
DTR__PRIVATE dtr_result dtr__afile_open(dtr__afile **out, const char *path, char *err, size_t errlen);
/** Buffered write; the first failure is remembered and reported by commit. */
DTR__PRIVATE void dtr__afile_write(dtr__afile *f, const void *p, size_t n);
/** Syncs, renames over the path, syncs its folder; frees f (also on failure, removing the
 *  temporary file). */
DTR__PRIVATE dtr_result dtr__afile_commit(dtr__afile *f, char *err, size_t errlen);
/** Gives up: closes and removes the temporary file; frees f. */
DTR__PRIVATE void dtr__afile_abort(dtr__afile *f);
/** 1 when `path` exists and is not a regular file (a folder, a FIFO, a device). */
DTR__PRIVATE int dtr__not_regular_file(const char *path);
/** 1 when process `pid` of this host is gone (or a zombie); 0 when alive or unknown
 *  (src/comm/shm.c; the process transports' watchdog and the atomic writer use it). */
int dtr__pid_dead(int64_t pid);

/* ---- state entries ---- */

/** Fills *out (when index == want) and returns DTR_OK; else returns DTR_NOT_FOUND. The
 *  accessors list their entries as a chain of these: `if (i == 0) return put(...)`. */
DTR__PRIVATE dtr_result dtr__state_put(dtr_state_entry *out, const char *name, void *data, size_t bytes, int device);

/* ---- errors and logging ---- */

/** Records `code` and a formatted message on ctx (the first error is sticky), logs it at
 *  DTR_LOG_ERROR and returns code. */
dtr_result dtr__fail(dtr_context *ctx, dtr_result code, const char *fmt, ...) DTR__PRINTF(3, 4);
/** Same, returning NULL: for tensor-returning builders. */
DTR__PRIVATE dtr_tensor *dtr__failt(dtr_context *ctx, dtr_result code, const char *fmt, ...) DTR__PRINTF(3, 4);

/* ---- tensor helpers ---- */

/** Arena tensor struct with dense row-major strides and data from the data arena. */
DTR__PRIVATE dtr_tensor *dtr__tensor_alloc(dtr_context *ctx, dtr_dtype dt, int ndim, const int64_t *shape, const char *op);
/** Tensor struct only (views): storage shared with `base`. */
DTR__PRIVATE dtr_tensor *dtr__tensor_view(dtr_context *ctx, dtr_tensor *base, const char *op);
DTR__PRIVATE void *dtr__arena_meta(dtr_context *ctx, size_t bytes, const char *op);
DTR__PRIVATE void *dtr__arena_data(dtr_context *ctx, size_t bytes, const char *op);
int64_t dtr__numel(int ndim, const int64_t *shape);
DTR__PRIVATE void dtr__contig_strides(int ndim, const int64_t *shape, int64_t *stride);
static inline float *dtr__f32(const dtr_tensor *t) { return (float *)t->storage + t->offset; }
static inline int32_t *dtr__i32(const dtr_tensor *t) { return (int32_t *)t->storage + t->offset; }
/** Makes sure t->grad exists (zeroed; the model's buffer for parameters). */
DTR__PRIVATE dtr_result dtr__grad_ensure(dtr_context *ctx, dtr_tensor *t);
/** Shape as "(2, 3, 4)" into buf, for messages. */
DTR__PRIVATE const char *dtr__shape_str(const dtr_tensor *t, char *buf, size_t n);
/** New node for `op`: records it on the tape when grad is on and an input needs grad,
 *  then runs the backend's forward. Returns out, or NULL with the error set. */
DTR__PRIVATE dtr_tensor *dtr__record(dtr_context *ctx, dtr__node *node, const char *opname);
/** New node for `op` with n_in inputs (NULL entries allowed): in points at in_inline, or at
 *  arena memory beyond DTR__INLINE_INPUTS. NULL with the error set on failure. */
DTR__PRIVATE dtr__node *dtr__node_new(dtr_context *ctx, int op, int n_in, dtr_tensor *const *in);
/** Memory from the step arena for a kernel's saved state (backend memory on devices; the CPU
 *  backend's is host memory). NULL with the error set (naming the node's op) on failure. */
DTR__PRIVATE void *dtr__node_save(dtr_context *ctx, dtr__node *n, size_t bytes);
/** Advances a generator by `delta` draws in O(log delta) (PCG's jump ahead). */
DTR__PRIVATE void dtr__rng_advance(dtr_rng *rng, uint64_t delta);
/** 1 when x is a usable f32 input of `op` on ctx; else records an error naming op and `what`. */
DTR__PRIVATE int dtr__check_input(dtr_context *ctx, const char *op, const dtr_tensor *x, const char *what);
/** The node of a cross-entropy op `op` (logits (..., K) f32, targets i32 of the row count)
 *  with its scalar output, checked and not yet recorded; NULL with the error (naming `name`). */
DTR__PRIVATE dtr__node *dtr__xent_node(dtr_context *ctx, int op, const char *name, dtr_tensor *logits, dtr_tensor *targets);
/** x, or a recorded contiguous copy of it. */
DTR__PRIVATE dtr_tensor *dtr__contig_input(dtr_context *ctx, dtr_tensor *x);
/** Gradient buffer of x when x takes part in backward, else NULL. */
static inline float *dtr__gradof(const dtr_tensor *x) {
    return (x && (x->flags & DTR__REQUIRES_GRAD)) ? x->grad : NULL;
}

/* ---- tensor-parallel shards of model parameters (src/nn/tensor_parallel.c) ---- */

/** How a parameter is one rank's shard of a full tensor: the full tensor's axis `axis` is
 *  `parts` equal blocks (3 for attention's q|k|v), each split evenly over `ways` ranks; rank
 *  `rank` holds its slice of every block, in block order. */
typedef struct dtr__shard {
    dtr_comm *comm;                   /* the tensor-parallel group */
    int rank, ways, axis, parts;
    int ndim;
    int64_t full[DTR_MAX_DIMS];       /* the full tensor's shape */
} dtr__shard;

/** Declares parameter "prefix.suffix" (just suffix for an empty or NULL prefix) on m (src/nn/layers.c). */
DTR__PRIVATE dtr_tensor *dtr__named_param(dtr_model *m, const char *prefix, const char *suffix, int ndim,
                                          const int64_t *shape, dtr_init init, float arg);
/** Marks parameter `t` of m (declared with the shard's shape, before dtr_model_build) as a
 *  shard: build initialises the full tensor and keeps the slice, save gathers, load slices. */
DTR__PRIVATE dtr_result dtr__model_set_shard(dtr_model *m, dtr_tensor *t, const dtr__shard *s);
/** Copies rank `rank`'s slice between the full tensor and a shard (to_full 0: full -> part). */
DTR__PRIVATE void dtr__shard_copy(const dtr__shard *s, int rank, float *full, float *part, int to_full);
/** Gathers the shard `t` of every rank into `full` (f32, the full shape). Collective. */
DTR__PRIVATE dtr_result dtr__shard_gather(dtr_context *ctx, const dtr__shard *s, const dtr_tensor *t, float *full);

/* ---- CPU backend ---- */
extern const dtr_backend dtr__cpu_backend;

#ifdef __cplusplus
}
#endif
#line 3145 "dtrain.h"

/* ---- src/data/data_internal.h ---- */
#line 1 "src/data/data_internal.h"
/* ============================================================================
 * Internal types of the data pipeline (src/data/): the dataset handle and the helpers the
 * dataset, CSV, image, loader and stream files share. Not a stable API.
 * ==========================================================================*/
#ifdef __cplusplus
extern "C" {
#endif

/** Reads sample `index` (already range-checked) into x and y (y may be NULL). */
typedef dtr_result (*dtr__ds_get_fn)(dtr_dataset *ds, int64_t index, void *x, void *y, char *err, size_t errlen);

/** Every dataset is one of these; the formats differ in `get`, `close` and `impl`. */
struct dtr_dataset {
    int64_t count;
    dtr_sample_layout layout;
    int64_t x_numel, y_numel;         /* elements of one sample's x and y (0 when unlabeled) */
    int in_memory;                    /* 1: get() is a copy; a loader does not cache such datasets */
    dtr__ds_get_fn get;
    void (*close)(dtr_dataset *ds);   /* frees impl (may be NULL) */
    void *impl;                       /* the format's state */
    char **class_names;               /* num_classes names or NULL (freed with the handle) */
    int n_class_names;
    dtr_dataset *base;                /* a subset: the dataset it reads from (class names too) */
    char name[256];                   /* file or folder, for messages */
    dtr_allocation_callbacks alloc;
};

/** Checks a layout (dtypes, ranks, sizes); writes a message and returns DTR_INVALID_ARGUMENT. */
DTR__PRIVATE dtr_result dtr__layout_check(const dtr_sample_layout *l, const char *who, char *err, size_t errlen);
/** A zeroed handle with `layout` (x_numel and y_numel filled) from `alloc` (copied; may be NULL). */
DTR__PRIVATE dtr_result dtr__dataset_new(const dtr_allocation_callbacks *alloc, int64_t count, const dtr_sample_layout *layout,
                            const char *name, dtr_dataset **out, char *err, size_t errlen);
/** A heap copy of a NUL-terminated string (NULL on OOM). */
DTR__PRIVATE char *dtr__strdup(const dtr_allocation_callbacks *a, const char *s);
/** Reads a whole file into memory from `a` (a NUL byte is appended, not counted in *size). */
DTR__PRIVATE dtr_result dtr__read_file(const char *path, const dtr_allocation_callbacks *a, unsigned char **buf, size_t *size,
                          char *err, size_t errlen);
/** Wall-clock seconds (gettimeofday): for the loader's wait time and stream deadlines. */
DTR__PRIVATE double dtr__wall_seconds(void);
/** Stable merge sort of ids v[0..n) by the NUL-terminated texts buf + off[id] (strcmp
 *  order); tmp holds n ids. */
DTR__PRIVATE void dtr__sort_by_text(int64_t *v, int64_t *tmp, int64_t n, const char *buf, const size_t *off);
/** An in-memory dataset that owns (copy 1) or borrows the arrays; see dtr_dataset_from_memory.
 *  `own_x`/`own_y` are adopted (freed with the dataset) when not NULL. */
DTR__PRIVATE dtr_result dtr__memory_dataset(const dtr_allocation_callbacks *alloc, int64_t count, const dtr_sample_layout *layout,
                               void *own_x, void *own_y, const char *name, dtr_dataset **out, char *err,
                               size_t errlen);

#ifdef __cplusplus
}
#endif
#line 3200 "dtrain.h"

/* ---- src/comm/comm_internal.h ---- */
#line 1 "src/comm/comm_internal.h"
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
} dtr__endpoint;

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

struct dtr_request {
    dtr_comm *comm;
    dtr__coll a;
    int state;             /* DTR__REQ_*, under comm->mu */
    dtr_result result;
    void *treq;            /* send/recv: the transport's request */
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
    /* configuration */
    int timeout_ms;
    int algo;                  /* dtr_allreduce_algo */
    size_t ring_threshold, chain_threshold, segment;
    int no_native;
    int shm_wanted;            /* cfg.shared_memory; $DTR_COMM_SHM=0/1 overrides (sub-groups inherit it) */
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
    /* scratch of the algorithms: used by one operation at a time (queue rule) */
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
/** 1 when process `pid` on this host is gone or a zombie waiting to be reaped (Linux reads
 *  /proc; elsewhere only a gone pid counts). Used by the shared-memory collectives and the
 *  process transports' watchdog. */
int dtr__pid_dead(int64_t pid);

/* ---- shared-memory collectives (src/comm/shm.c) ---- */
typedef struct dtr__shm dtr__shm;
/** Collective over c at its creation: maps one segment shared by the group's ranks when
 *  they are processes of one host (else nothing). An error only when the group failed. */
DTR__PRIVATE dtr_result dtr__shm_setup(dtr_comm *c);
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
/** Scratch of at least `bytes` (grows, kept); NULL on OOM. */
DTR__PRIVATE void *dtr__comm_scratch(dtr_comm *c, size_t bytes);
/** Runs one collective on the calling thread, blocking until done or its deadline. */
DTR__PRIVATE dtr_result dtr__coll_run(dtr_comm *c, const dtr__coll *a);
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

/* ---- the bootstrap of process transports (src/comm/bootstrap.c, in dtrain_comm.c) ---- */

/** What a transport whose ranks are processes learns through the rendezvous store. */
typedef struct dtr__boot {
    const char *transport;     /* its name, for messages */
    dtr_store *st;             /* its own store connection (dtr__store_clone) */
    dtr_store *app_store;      /* made from the environment when cfg->store was NULL */
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
} dtr__watch_ops;

/** A watchdog thread over a bootstrap (see the file's comment for what it watches). */
typedef struct dtr__watchdog {
    dtr__boot *boot;
    dtr__watch_ops ops;
    int *gone;                 /* per rank: left cleanly, no longer watched */
    int64_t *beat, *beat_ns;   /* last heartbeat value of each remote peer, and when it changed */
    int64_t stale_ns;          /* a remote heartbeat older than this is a failure */
    int next_remote;           /* the remote peer whose heartbeat is read next */
    volatile int published;    /* the world's abort key holds a failure (ours or read) */
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
/** Writes the world's abort key ("<who> <why>"). */
dtr_result dtr__watchdog_publish(dtr__watchdog *w, int who, const char *why);

/* ---- rendezvous helpers for transports ---- */

/** A second client connection to the store `st` joined (same rank, world, secret; never a
 *  server), with its own lock and deadline timeout_ms (<= 0: st's). Transports use it for
 *  their address exchange and watchdog so they neither queue behind the application's store
 *  calls nor depend on the application keeping its store. Free with dtr_store_destroy. */
dtr_result dtr__store_clone(const dtr_store *st, int timeout_ms, dtr_store **out, char *err, size_t errlen);
/** Changes the deadline of every later call on st (timeout_ms > 0). */
void dtr__store_set_timeout(dtr_store *st, int timeout_ms);

#ifdef __cplusplus
}
#endif
#line 3470 "dtrain.h"

/* ---- src/engine/compress.h ---- */
#line 1 "src/engine/compress.h"
/* ============================================================================
 * Gradient compression of the data-parallel engine (src/engine/compress.c), private to
 * src/engine/data_parallel.c: one codec per engine (dtr_dp_compress), state per bucket,
 * the residual of error feedback, and the engine's counters.
 * ==========================================================================*/

typedef struct dtr__dpc dtr__dpc;

/** Makes the compressor of config `cfg` for model m over group c (defaults filled in).
 *  @return DTR_OK, DTR_INVALID_ARGUMENT (compress, topk_ratio, powersgd_rank; the context's
 *          message says which) or DTR_OUT_OF_MEMORY. */
DTR__PRIVATE dtr_result dtr__dpc_create(dtr_model *m, dtr_comm *c, const dtr_dp_config *cfg, dtr__dpc **out);
DTR__PRIVATE void dtr__dpc_destroy(dtr__dpc *z);
/** Bucket i ([begin, end) of the gradient buffer g) is final: encodes it (adding the
 *  residual) and starts its exchange in *req. */
DTR__PRIVATE dtr_result dtr__dpc_start(dtr__dpc *z, int i, float *g, int64_t begin, int64_t end, dtr_request **req);
/** After bucket i's request completed: decodes the average into g + begin (PowerSGD: its
 *  second all-reduce, blocking). Called in bucket order on every rank. */
DTR__PRIVATE dtr_result dtr__dpc_finish(dtr__dpc *z, int i, float *g, int64_t begin);
/** The engine's counters (updated by the engine too). */
DTR__PRIVATE dtr_dp_stats *dtr__dpc_stats(dtr__dpc *z);
/** The residual of error feedback (numel floats) or NULL when the codec has none. */
DTR__PRIVATE float *dtr__dpc_residual(dtr__dpc *z, size_t *bytes);
#line 3497 "dtrain.h"

/* ---- src/engine/zero.h ---- */
#line 1 "src/engine/zero.h"
/* ============================================================================
 * ZeRO of the data-parallel engine (src/engine/zero.c), private to
 * src/engine/data_parallel.c: the shards of the parameter buffer, stage 2's exchange of
 * gradient slices to their owners, and the gather of the updated shards.
 * ==========================================================================*/

typedef struct dtr__zero dtr__zero;

/** The shards of model m over group c for cfg.zero (1 or 2), with stage 2's receive buffer
 *  for the peers' slices of this rank's shard. nb: the engine's bucket count.
 *  @return DTR_OK or DTR_OUT_OF_MEMORY (the context's message says so). */
DTR__PRIVATE dtr_result dtr__zero_create(dtr_model *m, dtr_comm *c, const dtr_dp_config *cfg, int nb, dtr__zero **out);
/** Waits for requests still in flight and frees. NULL is ignored. */
DTR__PRIVATE void dtr__zero_destroy(dtr__zero *z);
/** Stage 2: bucket i ([begin, end) of the gradient buffer) is final: sends each of its
 *  slices that another rank owns to that rank and posts the receives of the peers' slices
 *  of this rank's shard (point-to-point, tag per bucket). */
DTR__PRIVATE dtr_result dtr__zero_start(dtr__zero *z, int i, int64_t begin, int64_t end);
/** Stage 2, after every bucket started: waits for the exchange and writes the average over
 *  the ranks (summed in rank order, divided by the group's size) into this rank's shard of
 *  the gradient buffer; adds the bytes sent to st. */
DTR__PRIVATE dtr_result dtr__zero_reduce(dtr__zero *z, dtr_dp_stats *st);
/** Every rank's shard of the parameters from the rank that updated it (collective). */
DTR__PRIVATE dtr_result dtr__zero_gather(dtr__zero *z, dtr_dp_stats *st);
/** This rank's shard, [*begin, *end) floats. */
DTR__PRIVATE void dtr__zero_shard(const dtr__zero *z, int64_t *begin, int64_t *end);
/** dtr_optimizer_config.shard_sum of stage 2: sums n doubles over the group (an all-gather
 *  of the bytes, added in rank order: the same bits on every rank). user: the dtr__zero. */
DTR__PRIVATE dtr_result dtr__zero_sum(void *user, double *vals, int n);
#line 3530 "dtrain.h"

/* ---- src/engine/ps.h ---- */
#line 1 "src/engine/ps.h"
/* ============================================================================
 * The parameter servers' wire format (src/engine/ps.c), private: a fixed header, then the
 * payload. dtr__ps_parse validates a message a server received; the fuzz target
 * tests/fuzz/fuzz_ps.c feeds it arbitrary bytes.
 * ==========================================================================*/

#define DTR__PS_MAGIC 0x53505444u   /* "DTPS" */
#define DTR__PS_VERSION 1

/** Message kinds (worker -> server: PUSH, PULL, DONE, PUSH_ROWS, PULL_ROWS; server -> worker:
 *  REPLY). The ROWS kinds carry `begin` segments (int64 offset, int64 length: floats of the
 *  server's range) before their values; `count` is the sum of the lengths. */
enum { DTR__PS_PUSH = 1, DTR__PS_PULL = 2, DTR__PS_DONE = 3, DTR__PS_REPLY = 4, DTR__PS_PUSH_ROWS = 5, DTR__PS_PULL_ROWS = 6 };
#define DTR__PS_MAX_SEGMENTS (1 << 24)

/** The header of every message (host byte order: the ranks of a group share one ABI). A
 *  message is the header, `count` values of `dtype`, then the 8-byte trailer
 *  dtr__ps_trailer(header): receives do not report their length, so a server zeroes the
 *  header and trailer of its buffer after each message and a shorter message than its header
 *  claims is caught by the trailer missing. */
typedef struct dtr__ps_hdr {
    uint32_t magic;
    uint16_t version, kind;
    int32_t worker;     /**< the sender's worker index (REPLY: the server's index) */
    int32_t dtype;      /**< PUSH: the payload's dtype (f32 or bf16); else 0 */
    int64_t clock;      /**< PUSH: the worker's clock; PULL: the clock wanted; REPLY: the server's clock */
    int64_t begin;      /**< the range's first float (the server's) */
    int64_t count;      /**< floats of payload (PUSH, REPLY), 0 otherwise */
} dtr__ps_hdr;

/** What a server expects: its index, range and the number of workers. */
typedef struct dtr__ps_expect {
    int server, workers;
    int64_t begin, count;
} dtr__ps_expect;

/** The trailer that ends a message with header h. */
DTR__PRIVATE uint64_t dtr__ps_trailer(const dtr__ps_hdr *h);
/** Bytes of the message header h announces (header, payload, trailer); 0 when h's kind,
 *  dtype or count make no sense. */
DTR__PRIVATE size_t dtr__ps_message_bytes(const dtr__ps_hdr *h);

/** Validates the message from worker `from` in a receive buffer of `cap` bytes, for the
 *  server `e` describes. On DTR_OK *h holds the header and the payload (h->count elements of
 *  h->dtype) follows it in buf.
 *  @return DTR_OK or DTR_CORRUPT_FILE with `why` (may be NULL) saying what is wrong. */
DTR__PRIVATE dtr_result dtr__ps_parse(const void *buf, size_t len, int from, const dtr__ps_expect *e, dtr__ps_hdr *h,
                                      char *why, size_t whylen);

/** The engine's own group (a split of the application's): tests send crafted messages on it
 *  (tag DTR__PS_TAG_REQ). */
dtr_comm *dtr__ps_group(dtr_ps *ps);
#define DTR__PS_TAG_REQ ((1 << 29) + 1)
#define DTR__PS_TAG_REP ((1 << 29) + 2)
#line 3588 "dtrain.h"

#endif /* DTRAIN_INTERNAL_H */
#endif

#ifdef DTRAIN_IMPLEMENTATION
#ifndef DTRAIN_IMPLEMENTATION_DONE
#define DTRAIN_IMPLEMENTATION_DONE

/* ---- src/core/alloc.c ---- */
#line 1 "src/core/alloc.c"
/* ============================================================================
 * Allocation through the application's callbacks, and small error helpers.
 * ==========================================================================*/



void *dtr__malloc(const dtr_allocation_callbacks *a, size_t bytes) {
    if (bytes == 0) bytes = 1;
    if (a && a->malloc_fn) return a->malloc_fn(bytes, a->user);
    return malloc(bytes);
}

void *dtr__calloc(const dtr_allocation_callbacks *a, size_t bytes) {
    void *p = dtr__malloc(a, bytes);
    if (p) memset(p, 0, bytes);
    return p;
}

void *dtr__realloc(const dtr_allocation_callbacks *a, void *p, size_t bytes) {
    if (bytes == 0) bytes = 1;
    if (a && a->realloc_fn) return a->realloc_fn(p, bytes, a->user);
    return realloc(p, bytes);
}

void dtr__free(const dtr_allocation_callbacks *a, void *p) {
    if (!p) return;
    if (a && a->free_fn) { a->free_fn(p, a->user); return; }
    free(p);
}

dtr_result dtr__errf(char *err, size_t errlen, dtr_result code, const char *fmt, ...) {
    if (err && errlen) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, errlen, fmt, ap);
        va_end(ap);
    }
    return code;
}
#line 3638 "dtrain.h"

/* ---- src/core/threadpool.c ---- */
#line 1 "src/core/threadpool.c"
/* ============================================================================
 * Thread pool: parallel loops over [0, n) and per-worker scratch memory.
 *
 * The pool owns threads-1 pthreads; the thread that calls dtr__pool_run is worker 0 and
 * runs the first chunk itself. Each worker has its own job ticket (a generation counter):
 * the caller writes the job, bumps the tickets of the workers it needs and wakes only
 * those that sleep. Between jobs a worker spins for a short while (DTR_POOL_SPIN_TICKS
 * time-stamp ticks on x86, DTR_POOL_SPIN_ITERS pause loops elsewhere) so that the many
 * small parallel loops of a training step start without a futex round trip, then sleeps
 * on a condition variable: an idle pool burns no CPU. Every chunk is claimed with a
 * compare-and-swap before it runs, and once its own chunk is done the caller runs every
 * chunk that no worker has claimed yet: a worker that is asleep, or whose core is busy
 * with another process (a wake-up on a loaded or virtualised machine can take 100 us),
 * delays nothing. Then the caller waits for the claimed chunks (spin, then sleep).
 *
 * Rules:
 *   - Chunks are contiguous and depend only on n, grain and the pool's thread count, and
 *     chunk i is always run with worker index i (by worker i's thread or by the caller,
 *     never both), so a task can keep per-worker state, such as its scratch, by index.
 *   - A task must not call dtr__pool_run on the same pool; if it does, the inner loop
 *     runs serially on the calling thread (with that thread's worker index), which is
 *     correct but shares that worker's scratch with the outer task.
 *   - Scratch memory only grows; once a step has asked for its largest sizes, later
 *     steps make no allocation-callback call. Allocation happens on the thread that calls
 *     dtr__pool_scratch.
 *   - No printing, no exit()/abort(): thread-creation failure is a dtr_result.
 * ==========================================================================*/


#include <pthread.h>

/* ---- configuration and portability ---- */

#ifndef DTR_POOL_SPIN_TICKS
#define DTR_POOL_SPIN_TICKS 200000   /* ~50-100 us of spinning on a 2-4 GHz TSC */
#endif
#ifndef DTR_POOL_SPIN_ITERS
#define DTR_POOL_SPIN_ITERS 20000
#endif
#define DTR__POOL_MAX_THREADS 1024

#if DTR__HAVE_ATOMICS
#define DTR__POOL_ATOMICS 1
#define DTR__POOL_TLS 1
#else
#define DTR__POOL_ATOMICS 0   /* no atomics: every shared field is read under the mutex */
#define DTR__POOL_TLS 0
#endif

#if DTR__POOL_ATOMICS && (defined(__x86_64__) || defined(__i386__))
#include <x86intrin.h>
#define DTR__POOL_RDTSC 1
static inline void dtr__pool_relax(void) { __builtin_ia32_pause(); }
#elif DTR__POOL_ATOMICS && defined(__aarch64__)
static inline void dtr__pool_relax(void) { __asm__ __volatile__("yield" ::: "memory"); }
#else
static inline void dtr__pool_relax(void) { }
#endif

/* ---- types ---- */

typedef struct dtr__pool_worker {
    struct dtr__pool *pool;
    int index;
    int started;
    pthread_t tid;
    unsigned ticket;           /* bumped by the caller for each job this worker takes part in */
    int sleeping;              /* 1 while blocked on pool->wake */
    int claim;                 /* 0: chunk `index` of the current job is still unclaimed */
    void *scratch_raw;         /* from dtr__malloc */
    void *scratch;             /* 64-byte aligned inside scratch_raw */
    size_t scratch_cap;
    char pad[64];              /* keeps neighbours' hot fields off this cache line */
} dtr__pool_worker;

struct dtr__pool {
    dtr_allocation_callbacks alloc;
    int threads;
    dtr__pool_worker *w;       /* threads entries; w[0] is the caller */
    pthread_mutex_t mu;
    pthread_cond_t wake;       /* workers wait for a ticket */
    pthread_cond_t done;       /* the caller waits for pending == 0 */
    /* the current job: written by the caller before the tickets are bumped */
    dtr__task_fn fn;
    void *arg;
    int64_t n;
    int chunks;
    unsigned pending;          /* workers still running the job */
    int waiting;               /* 1 while the caller is blocked on done */
    int busy;                  /* a job is in flight (nested calls run inline) */
    int stop;
};

/* Worker index of the current thread for inline (nested) runs: 0 outside the pool. */
#if DTR__POOL_TLS
static __thread int dtr__pool_self = 0;
#define DTR__POOL_SELF dtr__pool_self
#else
#define DTR__POOL_SELF 0
#endif

/* ---- chunking ---- */

/** [begin, end) of chunk i of `chunks` over [0, n): sizes differ by at most one. */
static void dtr__pool_chunk(int64_t n, int chunks, int i, int64_t *begin, int64_t *end) {
    int64_t q = n / chunks, r = n % chunks;
    *begin = q * i + (i < r ? i : r);
    *end = *begin + q + (i < r ? 1 : 0);
}

/** Runs chunk i as worker i (the index names the chunk's per-worker state, whichever thread
 *  runs it). */
static void dtr__pool_run_chunk(dtr__pool *p, int i) {
    int64_t b, e;
#if DTR__POOL_TLS
    int saved = dtr__pool_self;
    dtr__pool_self = i;
#endif
    dtr__pool_chunk(p->n, p->chunks, i, &b, &e);
    if (b < e) p->fn(p->arg, b, e, i);
#if DTR__POOL_TLS
    dtr__pool_self = saved;
#endif
}

/* ---- spinning ---- */

#if DTR__POOL_ATOMICS
/** Spins while (*v == val) == equal, at most the spin budget; returns the last value read. */
static unsigned dtr__pool_spin(unsigned *v, unsigned val, int equal) {
    unsigned cur = DTR__ATOMIC_LOAD_SC(v);
#ifdef DTR__POOL_RDTSC
    unsigned long long t0 = __rdtsc();
    while ((cur == val) == equal && __rdtsc() - t0 < (unsigned long long)DTR_POOL_SPIN_TICKS) {
        dtr__pool_relax(); dtr__pool_relax(); dtr__pool_relax(); dtr__pool_relax();
        cur = DTR__ATOMIC_LOAD_SC(v);
    }
#else
    long it;
    for (it = 0; (cur == val) == equal && it < DTR_POOL_SPIN_ITERS; it++) {
        dtr__pool_relax();
        cur = DTR__ATOMIC_LOAD_SC(v);
    }
#endif
    return cur;
}
#endif

/* ---- workers ---- */

static void *dtr__pool_main(void *argp) {
    dtr__pool_worker *w = (dtr__pool_worker *)argp;
    dtr__pool *p = w->pool;
    unsigned seen = 0;
#if DTR__POOL_TLS
    dtr__pool_self = w->index;
#endif
    for (;;) {
        int last;
#if DTR__POOL_ATOMICS
        unsigned t = dtr__pool_spin(&w->ticket, seen, 1);
        if (t == seen) {
            pthread_mutex_lock(&p->mu);
            DTR__ATOMIC_STORE_SC(&w->sleeping, 1);
            while (DTR__ATOMIC_LOAD_SC(&w->ticket) == seen && !DTR__ATOMIC_LOAD_SC(&p->stop))
                pthread_cond_wait(&p->wake, &p->mu);
            DTR__ATOMIC_STORE_SC(&w->sleeping, 0);
            pthread_mutex_unlock(&p->mu);
            t = DTR__ATOMIC_LOAD_SC(&w->ticket);
        }
        if (t == seen) break;   /* woken by stop */
        seen = t;
        /* The caller may have run this chunk already (it takes the chunks no worker has
         * claimed once its own is done): then there is nothing to do. */
        {
            int expect = 0;
            if (!DTR__ATOMIC_CAS(&w->claim, &expect, 1)) continue;
        }
        dtr__pool_run_chunk(p, w->index);
        last = DTR__ATOMIC_DEC(&p->pending) == 0;
        if (last && DTR__ATOMIC_LOAD_SC(&p->waiting)) {
            pthread_mutex_lock(&p->mu);
            pthread_cond_signal(&p->done);
            pthread_mutex_unlock(&p->mu);
        }
#else
        pthread_mutex_lock(&p->mu);
        while (w->ticket == seen && !p->stop) pthread_cond_wait(&p->wake, &p->mu);
        if (w->ticket == seen) { pthread_mutex_unlock(&p->mu); break; }
        seen = w->ticket;
        pthread_mutex_unlock(&p->mu);
        dtr__pool_run_chunk(p, w->index);
        pthread_mutex_lock(&p->mu);
        last = --p->pending == 0;
        if (last) pthread_cond_signal(&p->done);
        pthread_mutex_unlock(&p->mu);
#endif
    }
    return NULL;
}

/* ---- create / destroy ---- */

dtr_result dtr__pool_create(const dtr_allocation_callbacks *a, int threads, dtr__pool **out) {
    dtr__pool *p;
    int i;
    if (!out) return DTR_NULL_HANDLE;
    *out = NULL;
    if (threads < 1) threads = 1;
    if (threads > DTR__POOL_MAX_THREADS) return DTR_INVALID_ARGUMENT;
    p = (dtr__pool *)dtr__calloc(a, sizeof(*p));
    if (!p) return DTR_OUT_OF_MEMORY;
    if (a) p->alloc = *a;
    p->threads = threads;
    p->w = (dtr__pool_worker *)dtr__calloc(a, sizeof(dtr__pool_worker) * (size_t)threads);
    if (!p->w) { dtr__free(a, p); return DTR_OUT_OF_MEMORY; }
    for (i = 0; i < threads; i++) { p->w[i].pool = p; p->w[i].index = i; p->w[i].claim = 1; }
    if (pthread_mutex_init(&p->mu, NULL) != 0) goto fail_mu;
    if (pthread_cond_init(&p->wake, NULL) != 0) goto fail_wake;
    if (pthread_cond_init(&p->done, NULL) != 0) goto fail_done;
    for (i = 1; i < threads; i++) {
        if (pthread_create(&p->w[i].tid, NULL, dtr__pool_main, &p->w[i]) != 0) {
            dtr__pool_destroy(p);   /* joins the workers started so far */
            return DTR_OUT_OF_MEMORY;
        }
        p->w[i].started = 1;
    }
    *out = p;
    return DTR_OK;
fail_done:
    pthread_cond_destroy(&p->wake);
fail_wake:
    pthread_mutex_destroy(&p->mu);
fail_mu:
    dtr__free(a, p->w);
    dtr__free(a, p);
    return DTR_OUT_OF_MEMORY;
}

void dtr__pool_destroy(dtr__pool *p) {
    dtr_allocation_callbacks a;
    int i;
    if (!p) return;
    pthread_mutex_lock(&p->mu);
#if DTR__POOL_ATOMICS
    DTR__ATOMIC_STORE_SC(&p->stop, 1);
#else
    p->stop = 1;
#endif
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mu);
    for (i = 1; i < p->threads; i++)
        if (p->w[i].started) pthread_join(p->w[i].tid, NULL);
    pthread_cond_destroy(&p->done);
    pthread_cond_destroy(&p->wake);
    pthread_mutex_destroy(&p->mu);
    a = p->alloc;
    for (i = 0; i < p->threads; i++) dtr__free(&a, p->w[i].scratch_raw);
    dtr__free(&a, p->w);
    dtr__free(&a, p);
}

int dtr__pool_threads(const dtr__pool *p) {
    return p ? p->threads : 1;
}

/* ---- parallel loops ---- */

void dtr__pool_run(dtr__pool *p, int64_t n, int64_t grain, dtr__task_fn fn, void *arg) {
    int64_t c;
    int chunks, i;
    if (n <= 0 || !fn) return;
    if (grain < 1) grain = 1;
    c = p ? n / grain : 1;
    chunks = c < (int64_t)(p ? p->threads : 1) ? (int)c : (p ? p->threads : 1);
    if (chunks <= 1) { fn(arg, 0, n, p ? DTR__POOL_SELF : 0); return; }
#if DTR__POOL_ATOMICS
    {
        int expect = 0, wake = 0;
        if (!DTR__ATOMIC_CAS(&p->busy, &expect, 1)) {   /* nested: run inline */
            fn(arg, 0, n, DTR__POOL_SELF);
            return;
        }
        p->fn = fn; p->arg = arg; p->n = n; p->chunks = chunks;
        DTR__ATOMIC_STORE_SC(&p->pending, (unsigned)(chunks - 1));
        for (i = 1; i < chunks; i++) DTR__ATOMIC_STORE_SC(&p->w[i].claim, 0);
        for (i = 1; i < chunks; i++) DTR__ATOMIC_STORE_SC(&p->w[i].ticket, DTR__ATOMIC_LOAD_SC(&p->w[i].ticket) + 1u);
        for (i = 1; i < chunks; i++) wake |= DTR__ATOMIC_LOAD_SC(&p->w[i].sleeping);
        if (wake) {
            pthread_mutex_lock(&p->mu);
            pthread_cond_broadcast(&p->wake);
            pthread_mutex_unlock(&p->mu);
        }
        dtr__pool_run_chunk(p, 0);
        /* Chunks whose worker has not started yet (asleep, or its core busy with another
         * process) run here: a late worker never delays the loop. */
        for (i = 1; i < chunks; i++) {
            int expect = 0;
            if (DTR__ATOMIC_CAS(&p->w[i].claim, &expect, 1)) {
                dtr__pool_run_chunk(p, i);
                DTR__ATOMIC_DEC(&p->pending);
            }
        }
        if (dtr__pool_spin(&p->pending, 0, 0) != 0) {
            pthread_mutex_lock(&p->mu);
            DTR__ATOMIC_STORE_SC(&p->waiting, 1);
            while (DTR__ATOMIC_LOAD_SC(&p->pending) != 0) pthread_cond_wait(&p->done, &p->mu);
            DTR__ATOMIC_STORE_SC(&p->waiting, 0);
            pthread_mutex_unlock(&p->mu);
        }
        DTR__ATOMIC_STORE_SC(&p->busy, 0);
    }
#else
    pthread_mutex_lock(&p->mu);
    if (p->busy) { pthread_mutex_unlock(&p->mu); fn(arg, 0, n, DTR__POOL_SELF); return; }
    p->busy = 1;
    p->fn = fn; p->arg = arg; p->n = n; p->chunks = chunks;
    p->pending = chunks - 1;
    for (i = 1; i < chunks; i++) p->w[i].ticket++;
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mu);
    dtr__pool_run_chunk(p, 0);
    pthread_mutex_lock(&p->mu);
    while (p->pending != 0) pthread_cond_wait(&p->done, &p->mu);
    p->busy = 0;
    pthread_mutex_unlock(&p->mu);
#endif
}

/* ---- scratch ---- */

void *dtr__pool_scratch(dtr__pool *p, int worker, size_t bytes) {
    dtr__pool_worker *w;
    void *raw;
    size_t cap;
    if (!p || worker < 0 || worker >= p->threads) return NULL;
    w = &p->w[worker];
    if (w->scratch && w->scratch_cap >= bytes) return w->scratch;
    cap = (bytes + 4095) & ~(size_t)4095;   /* whole pages: fewer regrowths */
    if (cap < bytes) return NULL;           /* overflow */
    raw = dtr__malloc(&p->alloc, cap + 64);
    if (!raw) return NULL;
    dtr__free(&p->alloc, w->scratch_raw);
    w->scratch_raw = raw;
    w->scratch = (void *)(((uintptr_t)raw + 63) & ~(uintptr_t)63);
    w->scratch_cap = cap;
    return w->scratch;
}
#line 3990 "dtrain.h"

/* ---- src/core/gemm.c ---- */
#line 1 "src/core/gemm.c"
/* ============================================================================
 * GEMM: C (M, N) = alpha * A (M, K) B (K, N) + beta * C, f32, for the CPU backend.
 *
 * Layout of the arguments (element strides, so transposed and sliced views need no copy):
 *     A(i, k) = A[i*rsa + k*csa]      B(k, j) = B[k*rsb + j*csb]      C(i, j) = C[i*ldc + j]
 *
 * The algorithm is the one of GotoBLAS / BLIS:
 *
 *     for jc in N by NC                      B block  (KC, NC): lives in L3
 *       for pc in K by KC                    pack B(pc:pc+KC, jc:jc+NC) into NR-wide panels
 *         for ic in M by MC                  pack A(ic:ic+MC, pc:pc+KC) into MR-tall panels
 *           for jr in NC by NR               B micro-panel (KC, NR): stays in L1
 *             for ir in MC by MR             A micro-panel (MR, KC): streamed from L2
 *               micro-kernel: C(MR, NR) tile = alpha * sum_k a(:, k) b(k, :) + beta * C
 *
 * Micro-kernels (register blocked, written with intrinsics, each compiled for its ISA with
 * __attribute__((target)), so the application needs no -mavx2 / -march flag; the best one
 * the CPU supports is picked at the first call with __builtin_cpu_supports):
 *     kernel   MR x NR   MC   KC   NC     registers
 *     avx512   8 x 32    64   256  1024   16 zmm accumulators (2 vectors of 16 per row)
 *     avx2     6 x 16    96   256  1024   12 ymm accumulators, FMA
 *     generic  4 x 16    128  256  1024   portable C (other compilers and CPUs)
 * The avx512 blocks were measured on Sapphire Rapids (48 KiB L1d, 2 MiB L2): the B
 * micro-panel (32 KiB) stays in L1 and a small A block (64 KiB) close by; larger MC lost
 * 10-15% on large squares. Packing uses 8x8 AVX transposes for the transposed layouts.
 * The environment variable DTRAIN_GEMM_KERNEL=avx512|avx2|generic forces a kernel (for
 * tests and benchmarks; an unsupported choice is ignored).
 *
 * Edge tiles (M, N not multiples of MR, NR) run the same micro-kernel on zero-padded panels
 * and store through masks, so every element of C is computed by exactly the same sequence
 * of operations wherever it lies: an FMA chain over k inside each KC block (the K blocking
 * depends only on K), then C = alpha * acc + beta * C with beta = 1 after the first block.
 * Threads split C into column (or row) slabs of whole panels, each worker packing its own
 * panels into its dtr__pool_scratch buffer: results are bitwise identical for any thread
 * count. beta == 0 never reads C (NaN in C is overwritten). K == 0 or alpha == 0 scale C
 * by beta without reading A or B.
 *
 * With DTR_USE_CBLAS defined, calls go to cblas_sgemm whenever each of A and B has a unit
 * stride in one dimension (then the result follows that BLAS's threading and rounding);
 * otherwise the own kernels run. dtr__gemm_kernel_name() then reports "cblas".
 *
 * Memory: packing buffers come from the pool's per-worker scratch, sized for the kernel's
 * full blocks (about 1.1 MiB per worker for avx512) and grown on the calling thread before
 * the workers start, so only the first GEMM on a pool allocates. With p == NULL a buffer of
 * the size this call needs is allocated and freed; if memory cannot be had, a plain triple
 * loop computes the result instead (slow, never wrong).
 *
 * dtr__gemm_on(p, worker, ...) is the same product run entirely on the calling thread with
 * worker `worker`'s scratch, for pool tasks that already split their work (convolutions
 * over samples); its results are bitwise those of dtr__gemm.
 *
 * Thread safety: any number of concurrent calls with different pools (or NULL); one
 * dtr__gemm at a time per pool, and dtr__gemm_on only from the task running as `worker`.
 * A pool task that calls dtr__gemm with its own pool runs it serially on its worker index
 * (see threadpool.c), sharing that worker's scratch.
 * ==========================================================================*/



#ifdef DTR_USE_CBLAS
#include <cblas.h>
#endif

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(DTR_NO_SIMD)
#define DTR__GEMM_X86 1
#include <immintrin.h>
#define DTR__GEMM_TARGET_AVX512 __attribute__((target("avx512f")))
#define DTR__GEMM_TARGET_AVX2 __attribute__((target("avx2,fma")))
#else
#define DTR__GEMM_X86 0
#endif

/* ---- kernel table ---- */

/** Micro-kernel: the (mv, nv) top-left part of the MR x NR tile at c (row stride ldc)
 *  receives alpha * sum_{k < kc} a[k*MR + i] b[k*NR + j] (+ beta * C when load_c). */
typedef void (*dtr__gemm_ukr)(int64_t kc, const float *a, const float *b, float *c, int64_t ldc,
                              float alpha, float beta, int mv, int nv, int load_c);

/** Packs an (mb, kb) block of A into MR-tall panels (rows past mb zero). */
typedef void (*dtr__gemm_pack_a_fn)(const float *A, int64_t rsa, int64_t csa, int64_t mb, int64_t kb,
                                    int mr, float *dst);
/** Packs a (kb, nb) block of B into NR-wide panels (columns past nb zero). */
typedef void (*dtr__gemm_pack_b_fn)(const float *B, int64_t rsb, int64_t csb, int64_t kb, int64_t nb,
                                    int nr, float *dst);

typedef struct dtr__gemm_kernel {
    const char *name;
    int mr, nr;            /* register tile */
    int64_t mc, kc, nc;    /* cache blocks: A block (mc, kc) in L2, B panel (kc, nr) in L1 */
    dtr__gemm_ukr ukr;
    dtr__gemm_pack_a_fn pack_a;
    dtr__gemm_pack_b_fn pack_b;
} dtr__gemm_kernel;

/* Work below this many flops per thread is not worth waking a worker. */
#define DTR__GEMM_MIN_FLOPS_PER_THREAD 100000.0

static int64_t dtr__gemm_min64(int64_t a, int64_t b) { return a < b ? a : b; }
static int64_t dtr__gemm_ceil(int64_t a, int64_t b) { return (a + b - 1) / b; }

/* ---- packing (portable) ---- */

/** Packs A (mb, kb) into MR-tall panels: panel p holds a[k*MR + i] = A(p*MR + i, k), rows
 *  past mb are zero. */
static void dtr__gemm_pack_a(const float *A, int64_t rsa, int64_t csa, int64_t mb, int64_t kb,
                             int mr, float *dst) {
    int64_t i0, k;
    int i;
    for (i0 = 0; i0 < mb; i0 += mr) {
        int rows = (int)dtr__gemm_min64(mr, mb - i0);
        const float *src = A + i0 * rsa;
        if (rows == mr && csa == 1) {
            for (i = 0; i < mr; i++) {
                const float *s = src + i * rsa;
                for (k = 0; k < kb; k++) dst[k * mr + i] = s[k];
            }
        } else if (rows == mr && rsa == 1) {
            for (k = 0; k < kb; k++) memcpy(dst + k * mr, src + k * csa, (size_t)mr * sizeof(float));
        } else {
            for (k = 0; k < kb; k++) {
                for (i = 0; i < rows; i++) dst[k * mr + i] = src[i * rsa + k * csa];
                for (; i < mr; i++) dst[k * mr + i] = 0.0f;
            }
        }
        dst += (int64_t)mr * kb;
    }
}

/** Packs B (kb, nb) into NR-wide panels: panel p holds b[k*NR + j] = B(k, p*NR + j), columns
 *  past nb are zero. */
static void dtr__gemm_pack_b(const float *B, int64_t rsb, int64_t csb, int64_t kb, int64_t nb,
                             int nr, float *dst) {
    int64_t j0, k;
    int j;
    for (j0 = 0; j0 < nb; j0 += nr) {
        int cols = (int)dtr__gemm_min64(nr, nb - j0);
        const float *src = B + j0 * csb;
        if (cols == nr && csb == 1) {
            for (k = 0; k < kb; k++) memcpy(dst + k * nr, src + k * rsb, (size_t)nr * sizeof(float));
        } else if (rsb == 1) {
            for (j = 0; j < cols; j++) {
                const float *s = src + j * csb;
                for (k = 0; k < kb; k++) dst[k * nr + j] = s[k];
            }
            for (k = 0; k < kb; k++)
                for (j = cols; j < nr; j++) dst[k * nr + j] = 0.0f;
        } else {
            for (k = 0; k < kb; k++) {
                for (j = 0; j < cols; j++) dst[k * nr + j] = src[k * rsb + j * csb];
                for (; j < nr; j++) dst[k * nr + j] = 0.0f;
            }
        }
        dst += (int64_t)nr * kb;
    }
}

/* ---- portable C micro-kernel ---- */

#define DTR__GEMM_GEN_MR 4
#define DTR__GEMM_GEN_NR 16

static void dtr__gemm_ukr_generic(int64_t kc, const float *a, const float *b, float *c, int64_t ldc,
                                  float alpha, float beta, int mv, int nv, int load_c) {
    float acc[DTR__GEMM_GEN_MR][DTR__GEMM_GEN_NR];
    int64_t k;
    int i, j;
    for (i = 0; i < DTR__GEMM_GEN_MR; i++)
        for (j = 0; j < DTR__GEMM_GEN_NR; j++) acc[i][j] = 0.0f;
    for (k = 0; k < kc; k++) {
        for (i = 0; i < DTR__GEMM_GEN_MR; i++) {
            float ai = a[i];
            for (j = 0; j < DTR__GEMM_GEN_NR; j++) acc[i][j] += ai * b[j];
        }
        a += DTR__GEMM_GEN_MR;
        b += DTR__GEMM_GEN_NR;
    }
    for (i = 0; i < mv; i++) {
        float *ci = c + i * ldc;
        if (load_c) {
            for (j = 0; j < nv; j++) ci[j] = alpha * acc[i][j] + beta * ci[j];
        } else {
            for (j = 0; j < nv; j++) ci[j] = alpha * acc[i][j];
        }
    }
}

#if DTR__GEMM_X86

/* ---- epilogue of the SIMD kernels ---- */

/* Epilogue modes, from the general C = alpha * acc + beta * C (fma(alpha, acc, beta * C)):
 * 0: acc, 1: alpha * acc (C not read), 2: acc + C, 3: fma(alpha, acc, C), 4: general. The
 * shortcuts leave out only multiplications by 1, so every mode rounds like the general one. */
static int dtr__gemm_epilogue_mode(float alpha, float beta, int load_c) {
    if (!load_c) return alpha == 1.0f ? 0 : 1;
    if (beta == 1.0f) return alpha == 1.0f ? 2 : 3;
    return 4;
}

/* ---- AVX-512 micro-kernel (8 x 32) ---- */

/* One row of the tile: two 16-float vectors under masks m0, m1. */
#define DTR__GEMM_AVX512_STORE_ROW(i)                                                           \
    if ((i) < mv) {                                                                             \
        float *ci = c + (int64_t)(i) * ldc;                                                     \
        if (mode >= 2) {                                                                        \
            __m512 o0 = _mm512_maskz_loadu_ps(m0, ci), o1 = _mm512_maskz_loadu_ps(m1, ci + 16); \
            if (mode == 2) {                                                                    \
                c##i##0 = _mm512_add_ps(c##i##0, o0);                                           \
                c##i##1 = _mm512_add_ps(c##i##1, o1);                                           \
            } else {                                                                            \
                if (mode == 4) { o0 = _mm512_mul_ps(vb, o0); o1 = _mm512_mul_ps(vb, o1); }      \
                c##i##0 = _mm512_fmadd_ps(va, c##i##0, o0);                                     \
                c##i##1 = _mm512_fmadd_ps(va, c##i##1, o1);                                     \
            }                                                                                   \
        } else if (mode == 1) {                                                                 \
            c##i##0 = _mm512_mul_ps(va, c##i##0);                                               \
            c##i##1 = _mm512_mul_ps(va, c##i##1);                                               \
        }                                                                                       \
        _mm512_mask_storeu_ps(ci, m0, c##i##0);                                                 \
        _mm512_mask_storeu_ps(ci + 16, m1, c##i##1);                                            \
    }

#define DTR__GEMM_AVX512_FMA_ROW(i)                                                             \
    t = _mm512_set1_ps(a[i]);                                                                   \
    c##i##0 = _mm512_fmadd_ps(t, b0, c##i##0);                                                  \
    c##i##1 = _mm512_fmadd_ps(t, b1, c##i##1);

DTR__GEMM_TARGET_AVX512
static void dtr__gemm_ukr_avx512(int64_t kc, const float *a, const float *b, float *c, int64_t ldc,
                                 float alpha, float beta, int mv, int nv, int load_c) {
    __m512 c00 = _mm512_setzero_ps(), c01 = _mm512_setzero_ps();
    __m512 c10 = _mm512_setzero_ps(), c11 = _mm512_setzero_ps();
    __m512 c20 = _mm512_setzero_ps(), c21 = _mm512_setzero_ps();
    __m512 c30 = _mm512_setzero_ps(), c31 = _mm512_setzero_ps();
    __m512 c40 = _mm512_setzero_ps(), c41 = _mm512_setzero_ps();
    __m512 c50 = _mm512_setzero_ps(), c51 = _mm512_setzero_ps();
    __m512 c60 = _mm512_setzero_ps(), c61 = _mm512_setzero_ps();
    __m512 c70 = _mm512_setzero_ps(), c71 = _mm512_setzero_ps();
    __m512 va, vb;
    __mmask16 m0, m1;
    int64_t k;
    int i, mode;
    for (i = 0; i < mv; i++) {   /* C is needed after the k loop: fetch it meanwhile */
        _mm_prefetch((const char *)(c + i * ldc), _MM_HINT_T0);
        _mm_prefetch((const char *)(c + i * ldc + 31), _MM_HINT_T0);
    }
    for (k = 0; k < kc; k++) {
        __m512 b0 = _mm512_loadu_ps(b), b1 = _mm512_loadu_ps(b + 16), t;
        DTR__GEMM_AVX512_FMA_ROW(0) DTR__GEMM_AVX512_FMA_ROW(1)
        DTR__GEMM_AVX512_FMA_ROW(2) DTR__GEMM_AVX512_FMA_ROW(3)
        DTR__GEMM_AVX512_FMA_ROW(4) DTR__GEMM_AVX512_FMA_ROW(5)
        DTR__GEMM_AVX512_FMA_ROW(6) DTR__GEMM_AVX512_FMA_ROW(7)
        a += 8;
        b += 32;
    }
    va = _mm512_set1_ps(alpha);
    vb = _mm512_set1_ps(beta);
    mode = dtr__gemm_epilogue_mode(alpha, beta, load_c);
    m0 = (__mmask16)(nv >= 16 ? 0xFFFFu : (1u << nv) - 1u);
    m1 = (__mmask16)(nv >= 32 ? 0xFFFFu : nv <= 16 ? 0u : (1u << (nv - 16)) - 1u);
    DTR__GEMM_AVX512_STORE_ROW(0) DTR__GEMM_AVX512_STORE_ROW(1)
    DTR__GEMM_AVX512_STORE_ROW(2) DTR__GEMM_AVX512_STORE_ROW(3)
    DTR__GEMM_AVX512_STORE_ROW(4) DTR__GEMM_AVX512_STORE_ROW(5)
    DTR__GEMM_AVX512_STORE_ROW(6) DTR__GEMM_AVX512_STORE_ROW(7)
}

/* ---- SIMD packing (AVX2 for both x86 kernels, AVX-512 for 32-wide B panels) ---- */

/* Transposes the 8x8 block held in r0..r7 (row i in ri) in place, with t0..t7 as temporaries. */
#define DTR__GEMM_TRANSPOSE8(r0, r1, r2, r3, r4, r5, r6, r7, t0, t1, t2, t3, t4, t5, t6, t7)    \
    t0 = _mm256_unpacklo_ps(r0, r1); t1 = _mm256_unpackhi_ps(r0, r1);                           \
    t2 = _mm256_unpacklo_ps(r2, r3); t3 = _mm256_unpackhi_ps(r2, r3);                           \
    t4 = _mm256_unpacklo_ps(r4, r5); t5 = _mm256_unpackhi_ps(r4, r5);                           \
    t6 = _mm256_unpacklo_ps(r6, r7); t7 = _mm256_unpackhi_ps(r6, r7);                           \
    r0 = _mm256_shuffle_ps(t0, t2, 0x44); r1 = _mm256_shuffle_ps(t0, t2, 0xEE);                 \
    r2 = _mm256_shuffle_ps(t1, t3, 0x44); r3 = _mm256_shuffle_ps(t1, t3, 0xEE);                 \
    r4 = _mm256_shuffle_ps(t4, t6, 0x44); r5 = _mm256_shuffle_ps(t4, t6, 0xEE);                 \
    r6 = _mm256_shuffle_ps(t5, t7, 0x44); r7 = _mm256_shuffle_ps(t5, t7, 0xEE);                 \
    t0 = _mm256_permute2f128_ps(r0, r4, 0x20); t4 = _mm256_permute2f128_ps(r0, r4, 0x31);       \
    t1 = _mm256_permute2f128_ps(r1, r5, 0x20); t5 = _mm256_permute2f128_ps(r1, r5, 0x31);       \
    t2 = _mm256_permute2f128_ps(r2, r6, 0x20); t6 = _mm256_permute2f128_ps(r2, r6, 0x31);       \
    t3 = _mm256_permute2f128_ps(r3, r7, 0x20); t7 = _mm256_permute2f128_ps(r3, r7, 0x31);       \
    r0 = t0; r1 = t1; r2 = t2; r3 = t3; r4 = t4; r5 = t5; r6 = t6; r7 = t7;

/** dst[k*ld + i] = src[i*rs + k] for i < rows (zero for rows <= i < width) and k < kb, by 8x8
 *  register transposes; width (6 or 8) lanes are stored per k. Missing rows read row 0 and
 *  are masked to zero afterwards. */
DTR__GEMM_TARGET_AVX2
static void dtr__gemm_transpose8_avx2(const float *src, int64_t rs, int64_t kb, int rows, int width,
                                      float *dst, int64_t ld) {
    const float *s1 = src + (rows > 1 ? 1 : 0) * rs, *s2 = src + (rows > 2 ? 2 : 0) * rs;
    const float *s3 = src + (rows > 3 ? 3 : 0) * rs, *s4 = src + (rows > 4 ? 4 : 0) * rs;
    const float *s5 = src + (rows > 5 ? 5 : 0) * rs, *s6 = src + (rows > 6 ? 6 : 0) * rs;
    const float *s7 = src + (rows > 7 ? 7 : 0) * rs;
    __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(rows), lane));
    __m256i wmask = _mm256_cmpgt_epi32(_mm256_set1_epi32(width), lane);
    int64_t k;
    int i;
    if (rows <= 0) {
        for (k = 0; k < kb; k++)
            for (i = 0; i < width; i++) dst[k * ld + i] = 0.0f;
        return;
    }
    for (k = 0; k + 8 <= kb; k += 8) {
        __m256 r0 = _mm256_loadu_ps(src + k), r1 = _mm256_loadu_ps(s1 + k);
        __m256 r2 = _mm256_loadu_ps(s2 + k), r3 = _mm256_loadu_ps(s3 + k);
        __m256 r4 = _mm256_loadu_ps(s4 + k), r5 = _mm256_loadu_ps(s5 + k);
        __m256 r6 = _mm256_loadu_ps(s6 + k), r7 = _mm256_loadu_ps(s7 + k);
        __m256 t0, t1, t2, t3, t4, t5, t6, t7;
        DTR__GEMM_TRANSPOSE8(r0, r1, r2, r3, r4, r5, r6, r7, t0, t1, t2, t3, t4, t5, t6, t7)
        if (rows < 8) {
            r0 = _mm256_and_ps(r0, keep); r1 = _mm256_and_ps(r1, keep);
            r2 = _mm256_and_ps(r2, keep); r3 = _mm256_and_ps(r3, keep);
            r4 = _mm256_and_ps(r4, keep); r5 = _mm256_and_ps(r5, keep);
            r6 = _mm256_and_ps(r6, keep); r7 = _mm256_and_ps(r7, keep);
        }
        if (width == 8) {
            _mm256_storeu_ps(dst + (k + 0) * ld, r0); _mm256_storeu_ps(dst + (k + 1) * ld, r1);
            _mm256_storeu_ps(dst + (k + 2) * ld, r2); _mm256_storeu_ps(dst + (k + 3) * ld, r3);
            _mm256_storeu_ps(dst + (k + 4) * ld, r4); _mm256_storeu_ps(dst + (k + 5) * ld, r5);
            _mm256_storeu_ps(dst + (k + 6) * ld, r6); _mm256_storeu_ps(dst + (k + 7) * ld, r7);
        } else {
            _mm256_maskstore_ps(dst + (k + 0) * ld, wmask, r0); _mm256_maskstore_ps(dst + (k + 1) * ld, wmask, r1);
            _mm256_maskstore_ps(dst + (k + 2) * ld, wmask, r2); _mm256_maskstore_ps(dst + (k + 3) * ld, wmask, r3);
            _mm256_maskstore_ps(dst + (k + 4) * ld, wmask, r4); _mm256_maskstore_ps(dst + (k + 5) * ld, wmask, r5);
            _mm256_maskstore_ps(dst + (k + 6) * ld, wmask, r6); _mm256_maskstore_ps(dst + (k + 7) * ld, wmask, r7);
        }
    }
    for (; k < kb; k++)
        for (i = 0; i < width; i++) dst[k * ld + i] = i < rows ? src[i * rs + k] : 0.0f;
}

/** A panels of mr = 6 or 8 rows. */
DTR__GEMM_TARGET_AVX2
static void dtr__gemm_pack_a_avx2(const float *A, int64_t rsa, int64_t csa, int64_t mb, int64_t kb,
                                  int mr, float *dst) {
    __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256i wmask = _mm256_cmpgt_epi32(_mm256_set1_epi32(mr), lane);
    int64_t i0, k;
    for (i0 = 0; i0 < mb; i0 += mr) {
        const float *src = A + i0 * rsa;
        int rows = (int)dtr__gemm_min64(mr, mb - i0);
        if (csa == 1) {
            dtr__gemm_transpose8_avx2(src, rsa, kb, rows, mr, dst, mr);
        } else if (rsa == 1) {
            __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(rows), lane);
            for (k = 0; k < kb; k++) _mm256_maskstore_ps(dst + k * mr, wmask, _mm256_maskload_ps(src + k * csa, m));
        } else {
            dtr__gemm_pack_a(src, rsa, csa, rows, kb, mr, dst);
        }
        dst += mr * kb;
    }
}

/** B panels of 16 columns. */
DTR__GEMM_TARGET_AVX2
static void dtr__gemm_pack_b_avx2(const float *B, int64_t rsb, int64_t csb, int64_t kb, int64_t nb,
                                  int nr, float *dst) {
    __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    int64_t j0, k;
    int g;
    for (j0 = 0; j0 < nb; j0 += 16) {
        const float *src = B + j0 * csb;
        int cols = (int)dtr__gemm_min64(16, nb - j0);
        if (csb == 1) {
            __m256i m0 = _mm256_cmpgt_epi32(_mm256_set1_epi32(cols), lane);
            __m256i m1 = _mm256_cmpgt_epi32(_mm256_set1_epi32(cols - 8), lane);
            for (k = 0; k < kb; k++) {
                _mm256_storeu_ps(dst + k * 16, _mm256_maskload_ps(src + k * rsb, m0));
                _mm256_storeu_ps(dst + k * 16 + 8, _mm256_maskload_ps(src + k * rsb + 8, m1));
            }
        } else if (rsb == 1) {
            for (g = 0; g < 2; g++) {
                int c = cols - 8 * g;
                dtr__gemm_transpose8_avx2(src + (c > 0 ? g * 8 * csb : 0), csb, kb, c < 0 ? 0 : c > 8 ? 8 : c, 8,
                                          dst + g * 8, 16);
            }
        } else {
            dtr__gemm_pack_b(src, rsb, csb, kb, cols, nr, dst);
        }
        dst += 16 * kb;
    }
}

/** B panels of 32 columns. */
DTR__GEMM_TARGET_AVX512
static void dtr__gemm_pack_b_avx512(const float *B, int64_t rsb, int64_t csb, int64_t kb, int64_t nb,
                                    int nr, float *dst) {
    int64_t j0, k;
    int g;
    for (j0 = 0; j0 < nb; j0 += 32) {
        const float *src = B + j0 * csb;
        int cols = (int)dtr__gemm_min64(32, nb - j0);
        if (csb == 1) {
            __mmask16 m0 = (__mmask16)(cols >= 16 ? 0xFFFFu : (1u << cols) - 1u);
            __mmask16 m1 = (__mmask16)(cols >= 32 ? 0xFFFFu : cols <= 16 ? 0u : (1u << (cols - 16)) - 1u);
            for (k = 0; k < kb; k++) {
                _mm512_storeu_ps(dst + k * 32, _mm512_maskz_loadu_ps(m0, src + k * rsb));
                _mm512_storeu_ps(dst + k * 32 + 16, _mm512_maskz_loadu_ps(m1, src + k * rsb + 16));
            }
        } else if (rsb == 1) {
            for (g = 0; g < 4; g++) {
                int c = cols - 8 * g;
                dtr__gemm_transpose8_avx2(src + (c > 0 ? g * 8 * csb : 0), csb, kb, c < 0 ? 0 : c > 8 ? 8 : c, 8,
                                          dst + g * 8, 32);
            }
        } else {
            dtr__gemm_pack_b(src, rsb, csb, kb, cols, nr, dst);
        }
        dst += 32 * kb;
    }
}

/* ---- AVX2 + FMA micro-kernel (6 x 16) ---- */

#define DTR__GEMM_AVX2_STORE_ROW(i)                                                             \
    if ((i) < mv) {                                                                             \
        float *ci = c + (int64_t)(i) * ldc;                                                     \
        if (mode >= 2) {                                                                        \
            __m256 o0 = _mm256_maskload_ps(ci, m0), o1 = _mm256_maskload_ps(ci + 8, m1);        \
            if (mode == 2) {                                                                    \
                c##i##0 = _mm256_add_ps(c##i##0, o0);                                           \
                c##i##1 = _mm256_add_ps(c##i##1, o1);                                           \
            } else {                                                                            \
                if (mode == 4) { o0 = _mm256_mul_ps(vb, o0); o1 = _mm256_mul_ps(vb, o1); }      \
                c##i##0 = _mm256_fmadd_ps(va, c##i##0, o0);                                     \
                c##i##1 = _mm256_fmadd_ps(va, c##i##1, o1);                                     \
            }                                                                                   \
        } else if (mode == 1) {                                                                 \
            c##i##0 = _mm256_mul_ps(va, c##i##0);                                               \
            c##i##1 = _mm256_mul_ps(va, c##i##1);                                               \
        }                                                                                       \
        _mm256_maskstore_ps(ci, m0, c##i##0);                                                   \
        _mm256_maskstore_ps(ci + 8, m1, c##i##1);                                               \
    }

#define DTR__GEMM_AVX2_FMA_ROW(i)                                                               \
    t = _mm256_broadcast_ss(a + (i));                                                           \
    c##i##0 = _mm256_fmadd_ps(t, b0, c##i##0);                                                  \
    c##i##1 = _mm256_fmadd_ps(t, b1, c##i##1);

DTR__GEMM_TARGET_AVX2
static void dtr__gemm_ukr_avx2(int64_t kc, const float *a, const float *b, float *c, int64_t ldc,
                               float alpha, float beta, int mv, int nv, int load_c) {
    __m256 c00 = _mm256_setzero_ps(), c01 = _mm256_setzero_ps();
    __m256 c10 = _mm256_setzero_ps(), c11 = _mm256_setzero_ps();
    __m256 c20 = _mm256_setzero_ps(), c21 = _mm256_setzero_ps();
    __m256 c30 = _mm256_setzero_ps(), c31 = _mm256_setzero_ps();
    __m256 c40 = _mm256_setzero_ps(), c41 = _mm256_setzero_ps();
    __m256 c50 = _mm256_setzero_ps(), c51 = _mm256_setzero_ps();
    __m256 va, vb;
    __m256i lane, m0, m1;
    int64_t k;
    int mode;
    for (k = 0; k < kc; k++) {
        __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8), t;
        DTR__GEMM_AVX2_FMA_ROW(0) DTR__GEMM_AVX2_FMA_ROW(1) DTR__GEMM_AVX2_FMA_ROW(2)
        DTR__GEMM_AVX2_FMA_ROW(3) DTR__GEMM_AVX2_FMA_ROW(4) DTR__GEMM_AVX2_FMA_ROW(5)
        a += 6;
        b += 16;
    }
    va = _mm256_set1_ps(alpha);
    vb = _mm256_set1_ps(beta);
    mode = dtr__gemm_epilogue_mode(alpha, beta, load_c);
    lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    m0 = _mm256_cmpgt_epi32(_mm256_set1_epi32(nv), lane);
    m1 = _mm256_cmpgt_epi32(_mm256_set1_epi32(nv - 8), lane);
    DTR__GEMM_AVX2_STORE_ROW(0) DTR__GEMM_AVX2_STORE_ROW(1) DTR__GEMM_AVX2_STORE_ROW(2)
    DTR__GEMM_AVX2_STORE_ROW(3) DTR__GEMM_AVX2_STORE_ROW(4) DTR__GEMM_AVX2_STORE_ROW(5)
}

#endif /* DTR__GEMM_X86 */

/* ---- kernel selection ---- */

static const dtr__gemm_kernel dtr__gemm_kernels[] = {
    { "generic", DTR__GEMM_GEN_MR, DTR__GEMM_GEN_NR, 128, 256, 1024, dtr__gemm_ukr_generic,
      dtr__gemm_pack_a, dtr__gemm_pack_b },
#if DTR__GEMM_X86
    { "avx2", 6, 16, 96, 256, 1024, dtr__gemm_ukr_avx2, dtr__gemm_pack_a_avx2, dtr__gemm_pack_b_avx2 },
    { "avx512", 8, 32, 64, 256, 1024, dtr__gemm_ukr_avx512, dtr__gemm_pack_a_avx2, dtr__gemm_pack_b_avx512 },
#endif
};

static int dtr__gemm_choice = -1;   /* index into dtr__gemm_kernels, set at the first call */

static int dtr__gemm_supported(int idx) {
#if DTR__GEMM_X86
    __builtin_cpu_init();
    if (idx == 1) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (idx == 2) return __builtin_cpu_supports("avx512f");
#endif
    return idx == 0;
}

static const dtr__gemm_kernel *dtr__gemm_pick(void) {
#if defined(__GNUC__) || defined(__clang__)
    int idx = DTR__ATOMIC_LOAD_RELAXED(&dtr__gemm_choice);
#else
    int idx = dtr__gemm_choice;
#endif
    if (idx < 0) {
        const char *force = getenv("DTRAIN_GEMM_KERNEL");
        int n = (int)(sizeof(dtr__gemm_kernels) / sizeof(dtr__gemm_kernels[0])), i;
        idx = 0;
        for (i = n - 1; i > 0; i--)
            if (dtr__gemm_supported(i)) { idx = i; break; }
        if (force)
            for (i = 0; i < n; i++)
                if (strcmp(force, dtr__gemm_kernels[i].name) == 0 && dtr__gemm_supported(i)) idx = i;
        /* every thread that races here computes the same value */
#if defined(__GNUC__) || defined(__clang__)
        DTR__ATOMIC_STORE_RELAXED(&dtr__gemm_choice, idx);
#else
        dtr__gemm_choice = idx;
#endif
    }
    return &dtr__gemm_kernels[idx];
}

const char *dtr__gemm_kernel_name(void) {
#ifdef DTR_USE_CBLAS
    return "cblas";
#else
    return dtr__gemm_pick()->name;
#endif
}

/* ---- blocked driver ---- */

typedef struct dtr__gemm_job {
    const dtr__gemm_kernel *kern;
    int64_t M, N, K;
    int64_t kc;                 /* K block used for every block but possibly the last */
    int64_t mc, nc;             /* M and N blocks (multiples of MR and NR) */
    float alpha, beta;
    const float *A; int64_t rsa, csa;
    const float *B; int64_t rsb, csb;
    float *C; int64_t ldc;
    int split_n;                /* work units: NR-column panels (1) or MR-row panels (0) */
    dtr__pool *pool;            /* NULL: a private buffer of the exact size */
} dtr__gemm_job;

/** Floats of packing memory one worker needs: an A block (*a_floats, a multiple of 16 so
 *  that the B block after it stays 64-byte aligned) and a B block. For pool scratch these
 *  are the kernel's full block sizes, so that the first GEMM grows the scratch once for
 *  every later shape; for a one-off buffer (exact) the sizes this call uses. */
static size_t dtr__gemm_buf_floats(const dtr__gemm_job *j, int exact, int64_t *a_floats) {
    const dtr__gemm_kernel *kn = j->kern;
    int64_t mc = exact ? j->mc : kn->mc, kc = exact ? j->kc : kn->kc, nc = exact ? j->nc : kn->nc;
    *a_floats = (mc * kc + 15) & ~(int64_t)15;
    return (size_t)(*a_floats + kc * nc);
}

/** Computes the slab C(m0:m1, n0:n1) with packing memory `buf`. */
static void dtr__gemm_slab(const dtr__gemm_job *j, int64_t m0, int64_t m1, int64_t n0, int64_t n1,
                           float *buf) {
    const dtr__gemm_kernel *kn = j->kern;
    int64_t a_floats, jc, pc, ic, jr, ir;
    float *apack, *bpack;
    dtr__gemm_buf_floats(j, j->pool == NULL, &a_floats);
    apack = buf;
    bpack = buf + a_floats;
    for (jc = n0; jc < n1; jc += j->nc) {
        int64_t nb = dtr__gemm_min64(j->nc, n1 - jc);
        for (pc = 0; pc < j->K; pc += j->kc) {
            int64_t kb = dtr__gemm_min64(j->kc, j->K - pc);
            int load_c = pc > 0 || j->beta != 0.0f;
            float beta = pc > 0 ? 1.0f : j->beta;
            kn->pack_b(j->B + pc * j->rsb + jc * j->csb, j->rsb, j->csb, kb, nb, kn->nr, bpack);
            for (ic = m0; ic < m1; ic += j->mc) {
                int64_t mb = dtr__gemm_min64(j->mc, m1 - ic);
                kn->pack_a(j->A + ic * j->rsa + pc * j->csa, j->rsa, j->csa, mb, kb, kn->mr, apack);
                for (jr = 0; jr < nb; jr += kn->nr) {
                    int nv = (int)dtr__gemm_min64(kn->nr, nb - jr);
                    const float *bp = bpack + jr * kb;
                    for (ir = 0; ir < mb; ir += kn->mr) {
                        int mv = (int)dtr__gemm_min64(kn->mr, mb - ir);
                        kn->ukr(kb, apack + ir * kb, bp, j->C + (ic + ir) * j->ldc + jc + jr, j->ldc,
                                j->alpha, beta, mv, nv, load_c);
                    }
                }
            }
        }
    }
}

static void dtr__gemm_naive(int64_t M, int64_t N, int64_t K, float alpha,
                            const float *A, int64_t rsa, int64_t csa,
                            const float *B, int64_t rsb, int64_t csb,
                            float beta, float *C, int64_t ldc);

/** Pool task: units [begin, end) are panels along N (split_n) or M. */
static void dtr__gemm_task(void *arg, int64_t begin, int64_t end, int worker) {
    const dtr__gemm_job *j = (const dtr__gemm_job *)arg;
    int64_t a_floats, m0 = 0, m1 = j->M, n0 = 0, n1 = j->N;
    size_t floats = dtr__gemm_buf_floats(j, 0, &a_floats);
    float *buf = (float *)dtr__pool_scratch(j->pool, worker, floats * sizeof(float));
    if (j->split_n) {
        n0 = begin * j->kern->nr;
        n1 = dtr__gemm_min64(end * j->kern->nr, j->N);
    } else {
        m0 = begin * j->kern->mr;
        m1 = dtr__gemm_min64(end * j->kern->mr, j->M);
    }
    if (buf) {
        dtr__gemm_slab(j, m0, m1, n0, n1, buf);
    } else {   /* only when run nested on a worker whose scratch could not grow */
        dtr__gemm_naive(m1 - m0, n1 - n0, j->K, j->alpha, j->A + m0 * j->rsa, j->rsa, j->csa,
                        j->B + n0 * j->csb, j->rsb, j->csb, j->beta, j->C + m0 * j->ldc + n0, j->ldc);
    }
}

/* ---- simple paths ---- */

/** C = beta * C (beta == 0 writes zeros without reading C). */
static void dtr__gemm_scale_c(int64_t M, int64_t N, float beta, float *C, int64_t ldc) {
    int64_t i, j;
    for (i = 0; i < M; i++) {
        float *ci = C + i * ldc;
        if (beta == 0.0f) {
            for (j = 0; j < N; j++) ci[j] = 0.0f;
        } else if (beta != 1.0f) {
            for (j = 0; j < N; j++) ci[j] *= beta;
        }
    }
}

/** Triple loop without any memory: the fallback when packing memory cannot be had. */
static void dtr__gemm_naive(int64_t M, int64_t N, int64_t K, float alpha,
                            const float *A, int64_t rsa, int64_t csa,
                            const float *B, int64_t rsb, int64_t csb,
                            float beta, float *C, int64_t ldc) {
    int64_t i, j, k;
    for (i = 0; i < M; i++) {
        for (j = 0; j < N; j++) {
            float acc = 0.0f;
            for (k = 0; k < K; k++) acc += A[i * rsa + k * csa] * B[k * rsb + j * csb];
            C[i * ldc + j] = beta == 0.0f ? alpha * acc : alpha * acc + beta * C[i * ldc + j];
        }
    }
}

#ifdef DTR_USE_CBLAS
/** Row-major BLAS description of an (R, S) operand with strides (rs, cs): sets *trans and
 *  *ld and returns 1, or returns 0 when neither dimension has a unit stride. */
static int dtr__gemm_blas_desc(int64_t R, int64_t S, int64_t rs, int64_t cs, int *trans, int64_t *ld) {
    int64_t minr = R > 1 ? R : 1, mins = S > 1 ? S : 1;
    if ((cs == 1 || S == 1) && (R == 1 || rs >= mins)) {
        *trans = 0;
        *ld = R == 1 ? mins : rs;
        return 1;
    }
    if ((rs == 1 || R == 1) && (S == 1 || cs >= minr)) {
        *trans = 1;
        *ld = S == 1 ? minr : cs;
        return 1;
    }
    return 0;
}

static int dtr__gemm_cblas(int64_t M, int64_t N, int64_t K, float alpha,
                           const float *A, int64_t rsa, int64_t csa,
                           const float *B, int64_t rsb, int64_t csb,
                           float beta, float *C, int64_t ldc) {
    int ta, tb;
    int64_t lda, ldb, big = 0x7fffffff;
    if (!dtr__gemm_blas_desc(M, K, rsa, csa, &ta, &lda)) return 0;
    if (!dtr__gemm_blas_desc(K, N, rsb, csb, &tb, &ldb)) return 0;
    if (M == 1 && ldc < N) ldc = N;
    if (ldc < N || M > big || N > big || K > big || lda > big || ldb > big || ldc > big) return 0;
    cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
                (int)M, (int)N, (int)K, alpha, A, (int)lda, B, (int)ldb, beta, C, (int)ldc);
    return 1;
}
#endif

/* ---- entry points ---- */

/** Fills the job for a call (kernel, K/M/N blocks). Returns 0 when nothing more is to be done
 *  (empty C, K == 0 or alpha == 0 handled here, or cblas took the call). */
static int dtr__gemm_setup(dtr__gemm_job *j, dtr__pool *p, int64_t M, int64_t N, int64_t K, float alpha,
                           const float *A, int64_t rsa, int64_t csa,
                           const float *B, int64_t rsb, int64_t csb,
                           float beta, float *C, int64_t ldc) {
    const dtr__gemm_kernel *kn;
    int64_t nkb;
    if (M <= 0 || N <= 0) return 0;
    if (K <= 0 || alpha == 0.0f) {
        dtr__gemm_scale_c(M, N, beta, C, ldc);
        return 0;
    }
#ifdef DTR_USE_CBLAS
    if (dtr__gemm_cblas(M, N, K, alpha, A, rsa, csa, B, rsb, csb, beta, C, ldc)) return 0;
#endif
    kn = dtr__gemm_pick();
    memset(j, 0, sizeof(*j));
    j->kern = kn;
    j->M = M; j->N = N; j->K = K;
    j->alpha = alpha; j->beta = beta;
    j->A = A; j->rsa = rsa; j->csa = csa;
    j->B = B; j->rsb = rsb; j->csb = csb;
    j->C = C; j->ldc = ldc;
    j->pool = p;
    /* K blocks of near-equal size (a function of K only: fixes the summation order) */
    nkb = dtr__gemm_ceil(K, kn->kc);
    j->kc = dtr__gemm_ceil(K, nkb);
    j->mc = dtr__gemm_min64(kn->mc, dtr__gemm_ceil(M, kn->mr) * kn->mr);
    j->nc = dtr__gemm_min64(kn->nc, dtr__gemm_ceil(N, kn->nr) * kn->nr);
    return 1;
}

/** Runs the whole job on the calling thread with a buffer of its own (the exact size), or
 *  the triple loop when that cannot be allocated. */
static void dtr__gemm_serial_private(dtr__gemm_job *j) {
    int64_t a_floats;
    size_t floats;
    void *raw;
    j->pool = NULL;
    floats = dtr__gemm_buf_floats(j, 1, &a_floats);
    raw = dtr__malloc(NULL, floats * sizeof(float) + 64);
    if (!raw) {
        dtr__gemm_naive(j->M, j->N, j->K, j->alpha, j->A, j->rsa, j->csa, j->B, j->rsb, j->csb,
                        j->beta, j->C, j->ldc);
        return;
    }
    dtr__gemm_slab(j, 0, j->M, 0, j->N, (float *)(((uintptr_t)raw + 63) & ~(uintptr_t)63));
    dtr__free(NULL, raw);
}

void dtr__gemm(dtr__pool *p, int64_t M, int64_t N, int64_t K, float alpha,
               const float *A, int64_t rsa, int64_t csa,
               const float *B, int64_t rsb, int64_t csb,
               float beta, float *C, int64_t ldc) {
    dtr__gemm_job j;
    const dtr__gemm_kernel *kn;
    int64_t units, grain, a_floats;
    double flops;
    int threads, use, chunks, w;
    size_t floats;
    if (!dtr__gemm_setup(&j, p, M, N, K, alpha, A, rsa, csa, B, rsb, csb, beta, C, ldc)) return;
    if (!p) {
        dtr__gemm_serial_private(&j);
        return;
    }
    kn = j.kern;
    /* threads: split the larger of M and N into slabs of whole panels */
    threads = dtr__pool_threads(p);
    flops = 2.0 * (double)M * (double)N * (double)K;
    use = threads;
    if (flops < DTR__GEMM_MIN_FLOPS_PER_THREAD * use) use = (int)(flops / DTR__GEMM_MIN_FLOPS_PER_THREAD);
    if (use < 1) use = 1;
    j.split_n = N >= M ? dtr__gemm_ceil(N, kn->nr) >= use : dtr__gemm_ceil(M, kn->mr) < use;
    units = j.split_n ? dtr__gemm_ceil(N, kn->nr) : dtr__gemm_ceil(M, kn->mr);
    if (use > units) use = (int)units;
    grain = units / use;
    chunks = (int)dtr__gemm_min64(threads, units / grain);
    /* grow the scratch of every worker that will take part here, on the calling thread */
    floats = dtr__gemm_buf_floats(&j, 0, &a_floats);
    for (w = 0; w < chunks; w++) {
        if (!dtr__pool_scratch(p, w, floats * sizeof(float))) {
            dtr__gemm_naive(M, N, K, alpha, A, rsa, csa, B, rsb, csb, beta, C, ldc);
            return;
        }
    }
    /* one chunk runs inline (with the calling thread's worker index when nested) */
    dtr__pool_run(p, units, chunks <= 1 ? units : grain, dtr__gemm_task, &j);
}

void dtr__gemm_on(dtr__pool *p, int worker, int64_t M, int64_t N, int64_t K, float alpha,
                  const float *A, int64_t rsa, int64_t csa,
                  const float *B, int64_t rsb, int64_t csb,
                  float beta, float *C, int64_t ldc) {
    dtr__gemm_job j;
    int64_t a_floats;
    float *buf;
    if (!dtr__gemm_setup(&j, p, M, N, K, alpha, A, rsa, csa, B, rsb, csb, beta, C, ldc)) return;
    buf = p ? (float *)dtr__pool_scratch(p, worker, dtr__gemm_buf_floats(&j, 0, &a_floats) * sizeof(float)) : NULL;
    if (!buf) {   /* no pool, a worker index out of range, or out of memory */
        dtr__gemm_serial_private(&j);
        return;
    }
    dtr__gemm_slab(&j, 0, M, 0, N, buf);
}
#line 4781 "dtrain.h"

/* ---- src/core/context.c ---- */
#line 1 "src/core/context.c"
/* ============================================================================
 * Context: configuration, backend, thread pool, step arena, errors, logging, RNG.
 * ==========================================================================*/


#include <math.h>
#ifndef _WIN32
#include <unistd.h>
#endif

/* ---- version and result strings ---- */

int dtr_version(void) { return DTR_VERSION_NUMBER; }
const char *dtr_version_string(void) { return DTR_VERSION_STRING; }

const char *dtr_result_string(dtr_result r) {
    switch (r) {
    case DTR_OK: return "ok";
    case DTR_INVALID_ARGUMENT: return "invalid argument";
    case DTR_NULL_HANDLE: return "null handle";
    case DTR_SHAPE_MISMATCH: return "shape mismatch";
    case DTR_DTYPE_MISMATCH: return "dtype mismatch";
    case DTR_OUT_OF_MEMORY: return "out of memory";
    case DTR_ARENA_FULL: return "arena full";
    case DTR_BAD_STATE: return "bad state";
    case DTR_UNSUPPORTED: return "unsupported";
    case DTR_NOT_FOUND: return "not found";
    case DTR_VERSION_MISMATCH: return "version mismatch";
    case DTR_IO_ERROR: return "i/o error";
    case DTR_CORRUPT_FILE: return "corrupt file";
    case DTR_TIMEOUT: return "timeout";
    case DTR_PEER_FAILED: return "peer failed";
    case DTR_DEVICE_ERROR: return "device error";
    case DTR_DEVICE_OUT_OF_MEMORY: return "device out of memory";
    }
    return "unknown error";
}

/* ---- arena ---- */

#define DTR__ALIGN 64
#define DTR__CHUNK_HDR ((sizeof(dtr__chunk) + DTR__ALIGN - 1) / DTR__ALIGN * DTR__ALIGN)

void dtr__arena_init(dtr__arena *a, const dtr_allocation_callbacks *alloc, size_t chunk_bytes, size_t max_bytes) {
    memset(a, 0, sizeof(*a));
    a->alloc = alloc;
    a->chunk_bytes = chunk_bytes;
    a->max_bytes = max_bytes;
}

static dtr__chunk *dtr__chunk_new(dtr__arena *a, size_t bytes) {
    /* over-allocate so the payload can be aligned whatever malloc returns */
    char *raw = (char *)dtr__malloc(a->alloc, DTR__CHUNK_HDR + bytes + DTR__ALIGN);
    dtr__chunk *c;
    if (!raw) return NULL;
    c = (dtr__chunk *)raw;
    c->next = NULL;
    c->size = bytes;
    c->used = 0;
    a->reserved += bytes;
    return c;
}

static char *dtr__chunk_data(dtr__chunk *c) {
    uintptr_t p = (uintptr_t)((char *)c + DTR__CHUNK_HDR);
    return (char *)((p + DTR__ALIGN - 1) & ~(uintptr_t)(DTR__ALIGN - 1));
}

void *dtr__arena_alloc(dtr__arena *a, size_t bytes, int *full) {
    size_t need = (bytes + DTR__ALIGN - 1) & ~(size_t)(DTR__ALIGN - 1);
    dtr__chunk *c = a->head;
    if (full) *full = 0;
    if (need == 0) need = DTR__ALIGN;
    if (!c || c->used + need > c->size) {
        size_t sz = need > a->chunk_bytes ? need : a->chunk_bytes;
        if (a->max_bytes && a->reserved + sz > a->max_bytes) {
            /* last try: a chunk just big enough */
            sz = need;
            if (a->reserved + sz > a->max_bytes) { if (full) *full = 1; return NULL; }
        }
        c = dtr__chunk_new(a, sz);
        if (!c) return NULL;
        if (a->head) { a->head->next = a->full; a->full = a->head; }
        a->head = c;
    }
    {
        char *p = dtr__chunk_data(c) + c->used;
        c->used += need;
        a->used += need;
        return p;
    }
}

void dtr__arena_reset(dtr__arena *a) {
    if (a->full) {
        /* the step needed several chunks: replace them all by one of the total size */
        size_t total = a->reserved;
        dtr__chunk *c = a->full, *n;
        while (c) { n = c->next; dtr__free(a->alloc, c); c = n; }
        a->full = NULL;
        if (a->head) dtr__free(a->alloc, a->head);
        a->head = NULL;
        a->reserved = 0;
        if (a->max_bytes && total > a->max_bytes) total = a->max_bytes;
        a->head = dtr__chunk_new(a, total); /* NULL is fine: the next alloc retries */
    } else if (a->head) {
        a->head->used = 0;
    }
    a->used = 0;
}

void dtr__arena_free(dtr__arena *a) {
    dtr__chunk *c = a->full, *n;
    while (c) { n = c->next; dtr__free(a->alloc, c); c = n; }
    if (a->head) dtr__free(a->alloc, a->head);
    a->head = a->full = NULL;
    a->reserved = a->used = 0;
}

/* ---- errors and logging ---- */

static dtr_result dtr__vfail(dtr_context *ctx, dtr_result code, const char *fmt, va_list ap) DTR__PRINTF(3, 0);
static dtr_result dtr__vfail(dtr_context *ctx, dtr_result code, const char *fmt, va_list ap) {
    if (!ctx) return code;
    if (ctx->status == DTR_OK) {
        ctx->status = code;
        vsnprintf(ctx->msg, sizeof(ctx->msg), fmt, ap);
        if (ctx->cfg.log && ctx->cfg.log_level >= DTR_LOG_ERROR)
            ctx->cfg.log(ctx->cfg.log_user, DTR_LOG_ERROR, ctx->msg);
    }
    return code;
}

dtr_result dtr__fail(dtr_context *ctx, dtr_result code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    dtr__vfail(ctx, code, fmt, ap);
    va_end(ap);
    return code;
}

dtr_tensor *dtr__failt(dtr_context *ctx, dtr_result code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    dtr__vfail(ctx, code, fmt, ap);
    va_end(ap);
    return NULL;
}

dtr_result dtr_context_status(const dtr_context *ctx) { return ctx ? ctx->status : DTR_NULL_HANDLE; }
const char *dtr_context_last_error(const dtr_context *ctx) { return ctx ? ctx->msg : "null context"; }

void dtr_context_clear_error(dtr_context *ctx) {
    if (!ctx) return;
    ctx->status = DTR_OK;
    ctx->msg[0] = 0;
}

/* ---- configuration and lifetime ---- */

static void dtr__tape_init(dtr_context *ctx, dtr_tape *t);
static void dtr__tape_clear(dtr_tape *t);

dtr_context_config dtr_context_config_init(void) {
    dtr_context_config c;
    memset(&c, 0, sizeof(c));
    c.log_level = DTR_LOG_WARN;
    return c;
}

static int dtr__online_cores(void) {
#if defined(_SC_NPROCESSORS_ONLN)
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
#else
    return 1;
#endif
}

dtr_result dtr_context_create(const dtr_context_config *cfg, dtr_context **out) {
    dtr_context_config def = dtr_context_config_init();
    dtr_context *ctx;
    dtr_result r;
    const dtr_allocation_callbacks *a;
    if (!out) return DTR_NULL_HANDLE;
    *out = NULL;
    if (!cfg) cfg = &def;
    a = &cfg->alloc;
    if ((a->malloc_fn || a->realloc_fn || a->free_fn) && !(a->malloc_fn && a->realloc_fn && a->free_fn))
        return DTR_INVALID_ARGUMENT;
    if (cfg->threads < 0 || cfg->threads > 1024) return DTR_INVALID_ARGUMENT;
    if (cfg->backend && (cfg->backend->abi_version != DTR_VERSION_NUMBER || cfg->backend->struct_size != sizeof(dtr_backend)))
        return DTR_VERSION_MISMATCH;
    ctx = (dtr_context *)dtr__calloc(a, sizeof(*ctx));
    if (!ctx) return DTR_OUT_OF_MEMORY;
    ctx->cfg = *cfg;
    ctx->alloc = cfg->alloc;
    ctx->backend = cfg->backend ? cfg->backend : &dtr__cpu_backend;
    ctx->threads = cfg->threads ? cfg->threads : dtr__online_cores();
    ctx->grad_enabled = 1;
    ctx->training = 1;
    dtr_rng_seed(&ctx->rng, cfg->seed, 0x64747261696eULL);
    dtr__tape_init(ctx, &ctx->own);
    ctx->cur = &ctx->own;
    r = dtr__pool_create(&ctx->alloc, ctx->threads, &ctx->pool);
    if (r != DTR_OK) { dtr__free(&ctx->alloc, ctx); return r; }
    if (ctx->backend->init) {
        r = ctx->backend->init(ctx, &ctx->backend_state);
        if (r != DTR_OK) {
            dtr__pool_destroy(ctx->pool);
            dtr__free(&ctx->alloc, ctx);
            return r;
        }
    }
    *out = ctx;
    return DTR_OK;
}

void dtr_context_destroy(dtr_context *ctx) {
    dtr_allocation_callbacks a;
    int i;
    if (!ctx) return;
    a = ctx->alloc;
    for (i = 0; i < DTR__MAX_RECOMPUTE_DEPTH; i++) dtr_tape_destroy(ctx->recompute[i]);
    dtr__arena_free(&ctx->own.meta);
    dtr__arena_free(&ctx->own.data);
    if (ctx->backend->shutdown) ctx->backend->shutdown(ctx, ctx->backend_state);
    dtr__pool_destroy(ctx->pool);
    dtr__free(&a, ctx);
}

dtr_result dtr_context_reset(dtr_context *ctx) {
    if (!ctx) return DTR_NULL_HANDLE;
    dtr__tape_clear(&ctx->own);
    return DTR_OK;
}

/* ---- tapes ---- */

static void dtr__tape_init(dtr_context *ctx, dtr_tape *t) {
    t->ctx = ctx;
    t->head = NULL;
    dtr__arena_init(&t->meta, &ctx->alloc, 1u << 20, 0);
    dtr__arena_init(&t->data, &ctx->alloc, ctx->cfg.arena_bytes ? ctx->cfg.arena_bytes : (16u << 20),
                    ctx->cfg.arena_max_bytes);
}

static void dtr__tape_clear(dtr_tape *t) {
    t->ctx->live_bytes -= t->meta.used + t->data.used;
    dtr__arena_reset(&t->meta);
    dtr__arena_reset(&t->data);
    t->head = NULL;
}

dtr_result dtr_tape_create(dtr_context *ctx, dtr_tape **out) {
    dtr_tape *t;
    if (!ctx || !out) return DTR_NULL_HANDLE;
    *out = NULL;
    t = (dtr_tape *)dtr__calloc(&ctx->alloc, sizeof(*t));
    if (!t) return dtr__fail(ctx, DTR_OUT_OF_MEMORY, "dtr_tape_create: out of memory");
    dtr__tape_init(ctx, t);
    *out = t;
    return DTR_OK;
}

dtr_result dtr_tape_reset(dtr_tape *t) {
    if (!t) return DTR_NULL_HANDLE;
    dtr__tape_clear(t);
    return DTR_OK;
}

void dtr_tape_destroy(dtr_tape *t) {
    dtr_context *ctx;
    if (!t || t == &t->ctx->own) return;
    ctx = t->ctx;
    dtr__tape_clear(t);
    if (ctx->cur == t) ctx->cur = &ctx->own;
    dtr__arena_free(&t->meta);
    dtr__arena_free(&t->data);
    dtr__free(&ctx->alloc, t);
}

static int dtr__chunk_has(dtr__chunk *c, const void *p) {
    uintptr_t q = (uintptr_t)p, begin;
    if (!c) return 0;
    begin = (uintptr_t)dtr__chunk_data(c);
    return q >= begin && q < begin + c->size;
}

int dtr__tape_owns(const dtr_tape *t, const void *p) {
    dtr__chunk *c;
    if (dtr__chunk_has(t->meta.head, p)) return 1;
    for (c = t->meta.full; c; c = c->next)
        if (dtr__chunk_has(c, p)) return 1;
    return 0;
}

dtr_tape *dtr_context_set_tape(dtr_context *ctx, dtr_tape *t) {
    dtr_tape *old;
    if (!ctx) return NULL;
    if (t && t->ctx != ctx) {
        dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_context_set_tape: the tape belongs to another context");
        return NULL;
    }
    old = ctx->cur == &ctx->own ? NULL : ctx->cur;
    ctx->cur = t ? t : &ctx->own;
    return old;
}

dtr_tape *dtr_context_tape(const dtr_context *ctx) {
    return ctx && ctx->cur != &ctx->own ? ctx->cur : NULL;
}

int dtr_context_set_grad_enabled(dtr_context *ctx, int enabled) {
    int old;
    if (!ctx) return 0;
    old = ctx->grad_enabled;
    ctx->grad_enabled = enabled ? 1 : 0;
    return old;
}

int dtr_context_set_training(dtr_context *ctx, int training) {
    int old;
    if (!ctx) return 0;
    old = ctx->training;
    ctx->training = training ? 1 : 0;
    return old;
}

int dtr_context_threads(const dtr_context *ctx) { return ctx ? ctx->threads : 0; }

void dtr_context_arena_usage(const dtr_context *ctx, size_t *reserved, size_t *used) {
    if (reserved) *reserved = ctx ? ctx->cur->data.reserved + ctx->cur->meta.reserved : 0;
    if (used) *used = ctx ? ctx->cur->data.used + ctx->cur->meta.used : 0;
}

size_t dtr_context_arena_peak(dtr_context *ctx, int reset) {
    size_t peak;
    if (!ctx) return 0;
    peak = ctx->peak_bytes;
    if (reset) ctx->peak_bytes = ctx->live_bytes;
    return peak;
}

/* an allocation from one of the current tape's arenas, counted in live and peak bytes */
static void *dtr__tape_alloc(dtr_context *ctx, dtr__arena *a, size_t bytes, int *full) {
    size_t before = a->used;
    void *p = dtr__arena_alloc(a, bytes, full);
    ctx->live_bytes += a->used - before;
    if (ctx->live_bytes > ctx->peak_bytes) ctx->peak_bytes = ctx->live_bytes;
    return p;
}

const char *dtr_context_backend_name(const dtr_context *ctx) {
    return ctx && ctx->backend ? ctx->backend->name : "";
}

void *dtr__arena_meta(dtr_context *ctx, size_t bytes, const char *op) {
    int full = 0;
    void *p = dtr__tape_alloc(ctx, &ctx->cur->meta, bytes, &full);
    if (!p) dtr__fail(ctx, DTR_OUT_OF_MEMORY, "%s: out of memory for %zu bytes of tensor metadata", op, bytes);
    return p;
}

void *dtr__arena_data(dtr_context *ctx, size_t bytes, const char *op) {
    int full = 0;
    void *p = dtr__tape_alloc(ctx, &ctx->cur->data, bytes, &full);
    if (!p) {
        if (full)
            dtr__fail(ctx, DTR_ARENA_FULL, "%s: step arena full (%zu bytes asked, %zu of %zu reserved); "
                      "raise arena_max_bytes or use smaller batches", op, bytes, ctx->cur->data.reserved,
                      ctx->cur->data.max_bytes);
        else
            dtr__fail(ctx, DTR_OUT_OF_MEMORY, "%s: out of memory for %zu bytes", op, bytes);
    }
    return p;
}

/* ---- random numbers (PCG32, O'Neill) ---- */

void dtr_rng_seed(dtr_rng *rng, uint64_t seed, uint64_t stream) {
    rng->state = 0;
    rng->inc = (stream << 1u) | 1u;
    dtr_rng_u32(rng);
    rng->state += seed;
    dtr_rng_u32(rng);
}

uint32_t dtr_rng_u32(dtr_rng *rng) {
    uint64_t old = rng->state;
    uint32_t xorshifted, rot;
    rng->state = old * 6364136223846793005ULL + rng->inc;
    xorshifted = (uint32_t)(((old >> 18u) ^ old) >> 27u);
    rot = (uint32_t)(old >> 59u);
    return (xorshifted >> rot) | (xorshifted << ((-rot) & 31));
}

/* ---- state ---- */

dtr_result dtr__state_put(dtr_state_entry *out, const char *name, void *data, size_t bytes, int device) {
    out->name = name;
    out->data = data;
    out->bytes = bytes;
    out->device = device;
    return DTR_OK;
}

dtr_result dtr_context_state(dtr_context *ctx, int index, dtr_state_entry *out) {
    if (!ctx || !out) return DTR_NULL_HANDLE;
    if (index == 0) return dtr__state_put(out, "rng", &ctx->rng, sizeof ctx->rng, 0);
    return DTR_NOT_FOUND;
}

dtr_result dtr_context_state_loaded(dtr_context *ctx) { return ctx ? DTR_OK : DTR_NULL_HANDLE; }

/* PCG's jump ahead (O'Neill, pcg_advance_lcg_64): the LCG state after delta steps. */
void dtr__rng_advance(dtr_rng *rng, uint64_t delta) {
    uint64_t mult = 6364136223846793005ULL, plus = rng->inc, acc_mult = 1u, acc_plus = 0u;
    while (delta > 0) {
        if (delta & 1u) {
            acc_mult *= mult;
            acc_plus = acc_plus * mult + plus;
        }
        plus = (mult + 1u) * plus;
        mult *= mult;
        delta >>= 1u;
    }
    rng->state = acc_mult * rng->state + acc_plus;
}

float dtr_rng_uniform(dtr_rng *rng) { return (float)(dtr_rng_u32(rng) >> 8) * (1.0f / 16777216.0f); }

float dtr_rng_normal(dtr_rng *rng) {
    float u1 = dtr_rng_uniform(rng), u2 = dtr_rng_uniform(rng);
    if (u1 < 1e-7f) u1 = 1e-7f;
    return sqrtf(-2.0f * logf(u1)) * cosf(6.28318530717958647692f * u2);
}
#line 5222 "dtrain.h"

/* ---- src/core/half.c ---- */
#line 1 "src/core/half.c"
/* ============================================================================
 * dtypes: sizes, names, and f32 <-> bf16 / f16 conversion (round to nearest even).
 * ==========================================================================*/



size_t dtr_dtype_size(dtr_dtype dt) {
    switch (dt) {
    case DTR_F32: case DTR_I32: return 4;
    case DTR_BF16: case DTR_F16: return 2;
    case DTR_U8: return 1;
    }
    return 0;
}

const char *dtr_dtype_name(dtr_dtype dt) {
    switch (dt) {
    case DTR_F32: return "f32";
    case DTR_BF16: return "bf16";
    case DTR_F16: return "f16";
    case DTR_I32: return "i32";
    case DTR_U8: return "u8";
    }
    return "unknown";
}

static uint32_t dtr__fbits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static float dtr__bitsf(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

uint16_t dtr_f32_to_bf16(float x) {
    uint32_t u = dtr__fbits(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

float dtr_bf16_to_f32(uint16_t x) { return dtr__bitsf((uint32_t)x << 16); }

uint16_t dtr_f32_to_f16(float x) {
    uint32_t u = dtr__fbits(x);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t a = u & 0x7fffffffu;
    if (a >= 0x7f800000u) /* inf or nan */
        return (uint16_t)(sign | 0x7c00u | (a > 0x7f800000u ? 0x200u | ((a >> 13) & 0x3ffu) : 0));
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds to inf */
    if (a < 0x38800000u) {  /* subnormal or zero in f16 */
        /* value = a as float; f16 subnormal unit = 2^-24 */
        float f = dtr__bitsf(a) * 16777216.0f; /* scale by 2^24 */
        /* round half to even */
        uint32_t i = (uint32_t)f;
        float rem = f - (float)i;
        if (rem > 0.5f || (rem == 0.5f && (i & 1u))) i++;
        return (uint16_t)(sign | i);
    }
    {
        uint32_t mant_odd = (a >> 13) & 1u;
        a += 0xc8000fffu + mant_odd; /* rebias exponent (-112 << 23) and round */
        return (uint16_t)(sign | (a >> 13));
    }
}

float dtr_f16_to_f32(uint16_t h) {
    uint32_t sign = ((uint32_t)h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    if (exp == 0) {
        float f = (float)mant * (1.0f / 16777216.0f);
        return sign ? -f : f;
    }
    if (exp == 31) return dtr__bitsf(sign | 0x7f800000u | (mant << 13));
    return dtr__bitsf(sign | ((exp + 112u) << 23) | (mant << 13));
}

static float dtr__load_f32(const void *src, dtr_dtype dt, size_t i) {
    switch (dt) {
    case DTR_F32: return ((const float *)src)[i];
    case DTR_BF16: return dtr_bf16_to_f32(((const uint16_t *)src)[i]);
    case DTR_F16: return dtr_f16_to_f32(((const uint16_t *)src)[i]);
    case DTR_I32: return (float)((const int32_t *)src)[i];
    case DTR_U8: return (float)((const uint8_t *)src)[i];
    }
    return 0.0f;
}

/* f32 <-> bf16 over arrays, branch-free so that compilers vectorize them (the rule of
 * dtr_f32_to_bf16: NaN stays a quiet NaN, the rest rounds to nearest even) */
static void dtr__f32_to_bf16_n(uint16_t *d, const float *s, size_t n) {
    size_t i;
    for (i = 0; i < n; i++) {
        uint32_t u = dtr__fbits(s[i]), nan = (u & 0x7fffffffu) > 0x7f800000u;
        uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16, q = (u >> 16) | 0x40u;
        d[i] = (uint16_t)(nan ? q : r);
    }
}

static void dtr__bf16_to_f32_n(float *d, const uint16_t *s, size_t n) {
    size_t i;
    for (i = 0; i < n; i++) d[i] = dtr__bitsf((uint32_t)s[i] << 16);
}

dtr_result dtr_convert(void *dst, dtr_dtype dst_dtype, const void *src, dtr_dtype src_dtype, size_t n) {
    size_t i;
    if (!dtr_dtype_size(dst_dtype) || !dtr_dtype_size(src_dtype)) return DTR_DTYPE_MISMATCH;
    if (n == 0) return DTR_OK; /* dst/src may be NULL: memcpy(NULL, NULL, 0) is undefined */
    if (!dst || !src) return DTR_NULL_HANDLE;
    if (dst_dtype == src_dtype) { memcpy(dst, src, n * dtr_dtype_size(dst_dtype)); return DTR_OK; }
    if (src_dtype == DTR_F32 && dst_dtype == DTR_BF16) { dtr__f32_to_bf16_n((uint16_t *)dst, (const float *)src, n); return DTR_OK; }
    if (src_dtype == DTR_BF16 && dst_dtype == DTR_F32) { dtr__bf16_to_f32_n((float *)dst, (const uint16_t *)src, n); return DTR_OK; }
    if (src_dtype == DTR_I32 && dst_dtype == DTR_U8) {
        for (i = 0; i < n; i++) ((uint8_t *)dst)[i] = (uint8_t)((const int32_t *)src)[i];
        return DTR_OK;
    }
    if (src_dtype == DTR_U8 && dst_dtype == DTR_I32) {
        for (i = 0; i < n; i++) ((int32_t *)dst)[i] = ((const uint8_t *)src)[i];
        return DTR_OK;
    }
    for (i = 0; i < n; i++) {
        float f = dtr__load_f32(src, src_dtype, i);
        switch (dst_dtype) {
        case DTR_F32: ((float *)dst)[i] = f; break;
        case DTR_BF16: ((uint16_t *)dst)[i] = dtr_f32_to_bf16(f); break;
        case DTR_F16: ((uint16_t *)dst)[i] = dtr_f32_to_f16(f); break;
        case DTR_I32: ((int32_t *)dst)[i] = (int32_t)f; break;
        case DTR_U8: ((uint8_t *)dst)[i] = (uint8_t)(f < 0 ? 0 : f > 255 ? 255 : f); break;
        }
    }
    return DTR_OK;
}
#line 5353 "dtrain.h"

/* ---- src/core/tensor.c ---- */
#line 1 "src/core/tensor.c"
/* ============================================================================
 * Tensors: arena allocation, shape queries, host read/write, and the node recorder
 * every op builder goes through.
 * ==========================================================================*/



/* ---- shapes ---- */

int64_t dtr__numel(int ndim, const int64_t *shape) {
    int64_t n = 1;
    int i;
    for (i = 0; i < ndim; i++) n *= shape[i];
    return n;
}

void dtr__contig_strides(int ndim, const int64_t *shape, int64_t *stride) {
    int64_t s = 1;
    int i;
    for (i = ndim - 1; i >= 0; i--) { stride[i] = s; s *= shape[i]; }
}

const char *dtr__shape_str(const dtr_tensor *t, char *buf, size_t n) {
    size_t len = 0;
    int i;
    if (!t) { snprintf(buf, n, "(null)"); return buf; }
    len += (size_t)snprintf(buf + len, n - len, "(");
    for (i = 0; i < t->ndim && len < n; i++)
        len += (size_t)snprintf(buf + len, n - len, i ? ", %lld" : "%lld", (long long)t->shape[i]);
    if (len < n) snprintf(buf + len, n - len, ")");
    return buf;
}

/* ---- allocation ---- */

dtr_tensor *dtr__tensor_view(dtr_context *ctx, dtr_tensor *base, const char *op) {
    dtr_tensor *t = (dtr_tensor *)dtr__arena_meta(ctx, sizeof(dtr_tensor), op);
    if (!t) return NULL;
    *t = *base;
    t->grad = NULL;
    t->node = NULL;
    t->flags = 0;
    t->param_index = -1;
    t->model = NULL;
    t->name = "";
    return t;
}

dtr_tensor *dtr__tensor_alloc(dtr_context *ctx, dtr_dtype dt, int ndim, const int64_t *shape, const char *op) {
    dtr_tensor *t;
    int64_t n;
    int i;
    size_t es = dtr_dtype_size(dt);
    if (!es) return dtr__failt(ctx, DTR_DTYPE_MISMATCH, "%s: unknown dtype %d", op, (int)dt);
    if (ndim < 0 || ndim > DTR_MAX_DIMS)
        return dtr__failt(ctx, DTR_INVALID_ARGUMENT, "%s: ndim %d outside 0..%d", op, ndim, DTR_MAX_DIMS);
    if (ndim && !shape) return dtr__failt(ctx, DTR_NULL_HANDLE, "%s: shape is NULL", op);
    for (i = 0; i < ndim; i++)
        if (shape[i] < 0 || shape[i] > ((int64_t)1 << 40))
            return dtr__failt(ctx, DTR_INVALID_ARGUMENT, "%s: dimension %d is %lld", op, i, (long long)shape[i]);
    n = dtr__numel(ndim, shape);
    if (n > ((int64_t)1 << 40)) return dtr__failt(ctx, DTR_INVALID_ARGUMENT, "%s: %lld elements is too many", op, (long long)n);
    t = (dtr_tensor *)dtr__arena_meta(ctx, sizeof(dtr_tensor), op);
    if (!t) return NULL;
    memset(t, 0, sizeof(*t));
    t->dtype = dt;
    t->ndim = ndim;
    for (i = 0; i < ndim; i++) t->shape[i] = shape[i];
    dtr__contig_strides(ndim, shape, t->stride);
    t->ctx = ctx;
    t->param_index = -1;
    t->name = "";
    t->storage = dtr__arena_data(ctx, (size_t)n * es, op);
    if (!t->storage) return NULL;
    return t;
}

dtr_tensor *dtr_tensor_new(dtr_context *ctx, dtr_dtype dt, int ndim, const int64_t *shape) {
    if (!ctx) return NULL;
    return dtr__tensor_alloc(ctx, dt, ndim, shape, "dtr_tensor_new");
}

dtr_tensor *dtr_tensor_1d(dtr_context *ctx, int64_t n0) { return dtr_tensor_new(ctx, DTR_F32, 1, &n0); }
dtr_tensor *dtr_tensor_2d(dtr_context *ctx, int64_t n0, int64_t n1) {
    int64_t s[2]; s[0] = n0; s[1] = n1;
    return dtr_tensor_new(ctx, DTR_F32, 2, s);
}
dtr_tensor *dtr_tensor_3d(dtr_context *ctx, int64_t n0, int64_t n1, int64_t n2) {
    int64_t s[3]; s[0] = n0; s[1] = n1; s[2] = n2;
    return dtr_tensor_new(ctx, DTR_F32, 3, s);
}
dtr_tensor *dtr_tensor_4d(dtr_context *ctx, int64_t n0, int64_t n1, int64_t n2, int64_t n3) {
    int64_t s[4]; s[0] = n0; s[1] = n1; s[2] = n2; s[3] = n3;
    return dtr_tensor_new(ctx, DTR_F32, 4, s);
}

dtr_tensor *dtr_tensor_zeros(dtr_context *ctx, dtr_dtype dt, int ndim, const int64_t *shape) {
    dtr_tensor *t = dtr_tensor_new(ctx, dt, ndim, shape);
    if (!t) return NULL;
    if (ctx->backend->memset0(ctx, t->storage, (size_t)dtr_tensor_numel(t) * dtr_dtype_size(dt)) != DTR_OK)
        return dtr__failt(ctx, DTR_UNSUPPORTED, "dtr_tensor_zeros: backend memset failed");
    return t;
}

dtr_tensor *dtr_tensor_full(dtr_context *ctx, int ndim, const int64_t *shape, float value) {
    dtr_tensor *t = dtr_tensor_new(ctx, DTR_F32, ndim, shape);
    int64_t i, n;
    float *tmp;
    if (!t) return NULL;
    n = dtr_tensor_numel(t);
    if (dtr__host_memory(ctx)) {
        for (i = 0; i < n; i++) dtr__f32(t)[i] = value;
        return t;
    }
    tmp = (float *)dtr__malloc(&ctx->alloc, (size_t)n * 4);
    if (!tmp) return dtr__failt(ctx, DTR_OUT_OF_MEMORY, "dtr_tensor_full: out of memory");
    for (i = 0; i < n; i++) tmp[i] = value;
    ctx->backend->from_host(ctx, t->storage, tmp, (size_t)n * 4);
    dtr__free(&ctx->alloc, tmp);
    return t;
}

dtr_tensor *dtr_tensor_from(dtr_context *ctx, dtr_dtype dt, int ndim, const int64_t *shape, const void *src) {
    dtr_tensor *t;
    if (!ctx) return NULL;
    if (!src) return dtr__failt(ctx, DTR_NULL_HANDLE, "dtr_tensor_from: src is NULL");
    t = dtr_tensor_new(ctx, dt, ndim, shape);
    if (!t) return NULL;
    if (ctx->backend->from_host(ctx, t->storage, src, (size_t)dtr_tensor_numel(t) * dtr_dtype_size(dt)) != DTR_OK)
        return dtr__failt(ctx, DTR_UNSUPPORTED, "dtr_tensor_from: copy to the device failed");
    return t;
}

/* ---- queries ---- */

int dtr_tensor_ndim(const dtr_tensor *t) { return t ? t->ndim : 0; }

int64_t dtr_tensor_dim(const dtr_tensor *t, int axis) {
    if (!t) return 0;
    if (axis < 0) axis += t->ndim;
    if (axis < 0 || axis >= t->ndim) return 0;
    return t->shape[axis];
}

int64_t dtr_tensor_stride(const dtr_tensor *t, int axis) {
    if (!t) return 0;
    if (axis < 0) axis += t->ndim;
    if (axis < 0 || axis >= t->ndim) return 0;
    return t->stride[axis];
}

int64_t dtr_tensor_numel(const dtr_tensor *t) { return t ? dtr__numel(t->ndim, t->shape) : 0; }
dtr_dtype dtr_tensor_dtype(const dtr_tensor *t) { return t ? t->dtype : DTR_F32; }
const char *dtr_tensor_name(const dtr_tensor *t) { return t && t->name ? t->name : ""; }

int dtr_tensor_is_contiguous(const dtr_tensor *t) {
    int64_t s = 1;
    int i;
    if (!t) return 0;
    for (i = t->ndim - 1; i >= 0; i--) {
        if (t->shape[i] != 1 && t->stride[i] != s) return 0;
        s *= t->shape[i];
    }
    return 1;
}

void *dtr_tensor_data(dtr_tensor *t) {
    if (!t || !t->storage) return NULL;
    if (t->ctx && !dtr__host_memory(t->ctx)) return NULL;
    return (char *)t->storage + (size_t)t->offset * dtr_dtype_size(t->dtype);
}

float *dtr_tensor_grad(dtr_tensor *t) { return t ? t->grad : NULL; }

dtr_tensor *dtr_tensor_requires_grad(dtr_tensor *t) {
    if (!t) return NULL;
    if (t->dtype != DTR_F32)
        return dtr__failt(t->ctx, DTR_DTYPE_MISMATCH, "dtr_tensor_requires_grad: only f32 tensors have gradients (got %s)",
                          dtr_dtype_name(t->dtype));
    t->flags |= DTR__REQUIRES_GRAD | DTR__LEAF;
    return t;
}

/* Gathers a (possibly strided) host tensor into dense row-major `dst` of element size es. */
static void dtr__gather(const dtr_tensor *t, void *dst, size_t es) {
    int64_t n = dtr__numel(t->ndim, t->shape), i;
    int64_t idx[DTR_MAX_DIMS] = {0};
    const char *base = (const char *)t->storage;
    char *out = (char *)dst;
    int d;
    for (i = 0; i < n; i++) {
        int64_t off = t->offset;
        for (d = 0; d < t->ndim; d++) off += idx[d] * t->stride[d];
        memcpy(out + (size_t)i * es, base + (size_t)off * es, es);
        for (d = t->ndim - 1; d >= 0; d--) { if (++idx[d] < t->shape[d]) break; idx[d] = 0; }
    }
}

dtr_result dtr_tensor_read(const dtr_tensor *t, dtr_dtype dt, void *dst, size_t n) {
    dtr_context *ctx;
    size_t es, bytes;
    void *tmp = NULL;
    const void *src;
    dtr_result r;
    if (!t || !dst) return DTR_NULL_HANDLE;
    ctx = t->ctx;
    /* a parameter of a model not built yet: build it, as the ops do */
    if (!t->storage && t->model && (r = dtr_model_build(t->model)) != DTR_OK) return r;
    if ((int64_t)n != dtr_tensor_numel(t))
        return dtr__fail(ctx, DTR_SHAPE_MISMATCH, "dtr_tensor_read: %zu elements asked, tensor has %lld", n,
                         (long long)dtr_tensor_numel(t));
    es = dtr_dtype_size(t->dtype);
    bytes = n * es;
    if (dtr__host_memory(ctx) && dtr_tensor_is_contiguous(t)) {
        src = (const char *)t->storage + (size_t)t->offset * es;
    } else {
        tmp = dtr__malloc(&ctx->alloc, bytes);
        if (!tmp) return dtr__fail(ctx, DTR_OUT_OF_MEMORY, "dtr_tensor_read: out of memory");
        if (dtr__host_memory(ctx)) {
            dtr__gather(t, tmp, es);
        } else {
            if (!dtr_tensor_is_contiguous(t)) {
                dtr__free(&ctx->alloc, tmp);
                return dtr__fail(ctx, DTR_UNSUPPORTED, "dtr_tensor_read: make device views contiguous first");
            }
            r = ctx->backend->to_host(ctx, tmp, (const char *)t->storage + (size_t)t->offset * es, bytes);
            if (r != DTR_OK) { dtr__free(&ctx->alloc, tmp); return dtr__fail(ctx, r, "dtr_tensor_read: copy failed"); }
        }
        src = tmp;
    }
    r = dtr_convert(dst, dt, src, t->dtype, n);
    dtr__free(&ctx->alloc, tmp);
    return r;
}

dtr_result dtr_tensor_write(dtr_tensor *t, dtr_dtype dt, const void *src, size_t n) {
    dtr_context *ctx;
    size_t es;
    void *tmp;
    dtr_result r;
    if (!t || !src) return DTR_NULL_HANDLE;
    ctx = t->ctx;
    if (!t->storage && t->model && (r = dtr_model_build(t->model)) != DTR_OK) return r;
    if ((int64_t)n != dtr_tensor_numel(t))
        return dtr__fail(ctx, DTR_SHAPE_MISMATCH, "dtr_tensor_write: %zu elements given, tensor has %lld", n,
                         (long long)dtr_tensor_numel(t));
    if (!dtr_tensor_is_contiguous(t))
        return dtr__fail(ctx, DTR_UNSUPPORTED, "dtr_tensor_write: the tensor is a non-contiguous view");
    es = dtr_dtype_size(t->dtype);
    if (dtr__host_memory(ctx))
        return dtr_convert((char *)t->storage + (size_t)t->offset * es, t->dtype, src, dt, n);
    tmp = dtr__malloc(&ctx->alloc, n * es);
    if (!tmp) return dtr__fail(ctx, DTR_OUT_OF_MEMORY, "dtr_tensor_write: out of memory");
    r = dtr_convert(tmp, t->dtype, src, dt, n);
    if (r == DTR_OK) r = ctx->backend->from_host(ctx, (char *)t->storage + (size_t)t->offset * es, tmp, n * es);
    dtr__free(&ctx->alloc, tmp);
    return r;
}

float dtr_tensor_get(const dtr_tensor *t, int64_t index) {
    int64_t off, rem;
    int d;
    float f = 0.0f;
    if (!t || index < 0 || index >= dtr_tensor_numel(t)) return 0.0f;
    off = t->offset;
    rem = index;
    for (d = t->ndim - 1; d >= 0; d--) {
        off += (rem % t->shape[d]) * t->stride[d];
        rem /= t->shape[d];
    }
    if (dtr__host_memory(t->ctx)) {
        dtr_convert(&f, DTR_F32, (const char *)t->storage + (size_t)off * dtr_dtype_size(t->dtype), t->dtype, 1);
    } else {
        unsigned char buf[8];
        if (t->ctx->backend->to_host(t->ctx, buf, (const char *)t->storage + (size_t)off * dtr_dtype_size(t->dtype),
                                     dtr_dtype_size(t->dtype)) == DTR_OK)
            dtr_convert(&f, DTR_F32, buf, t->dtype, 1);
    }
    return f;
}

/* ---- gradients and the recorder ---- */

dtr_result dtr__grad_ensure(dtr_context *ctx, dtr_tensor *t) {
    size_t bytes;
    if (t->grad) return DTR_OK;
    bytes = (size_t)dtr_tensor_numel(t) * sizeof(float);
    t->grad = (float *)dtr__arena_data(ctx, bytes, "backward");
    if (!t->grad) return ctx->status;
    return ctx->backend->memset0(ctx, t->grad, bytes);
}

#define DTR__OP_NAME(id, name, kernels) name,
static const char *const dtr__op_names[DTR_OP_COUNT] = {"none", DTR__OP_LIST(DTR__OP_NAME)};
#undef DTR__OP_NAME

const char *dtr__op_name(int op) { return op >= 0 && op < DTR_OP_COUNT ? dtr__op_names[op] : "?"; }

dtr__node *dtr__node_new(dtr_context *ctx, int op, int n_in, dtr_tensor *const *in) {
    dtr__node *n = (dtr__node *)dtr__arena_meta(ctx, sizeof(dtr__node), dtr__op_name(op));
    if (!n) return NULL;
    memset(n, 0, sizeof(*n));
    n->op = op;
    n->n_in = n_in;
    n->in = n->in_inline;
    if (n_in > DTR__INLINE_INPUTS) {
        n->in = (dtr_tensor **)dtr__arena_meta(ctx, (size_t)n_in * sizeof(dtr_tensor *), dtr__op_name(op));
        if (!n->in) return NULL;
    }
    if (n_in > 0) memcpy(n->in, in, (size_t)n_in * sizeof(dtr_tensor *));
    return n;
}

void *dtr__node_save(dtr_context *ctx, dtr__node *n, size_t bytes) {
    return dtr__arena_data(ctx, bytes, dtr__op_name(n->op));
}

static int dtr__node_needs_grad(const dtr_context *ctx, const dtr__node *node) {
    int i;
    if (!ctx->grad_enabled) return 0;
    if (node->out->dtype != DTR_F32 && node->out->dtype != DTR_BF16 && node->out->dtype != DTR_F16) return 0;
    for (i = 0; i < node->n_in; i++)
        if (node->in[i] && (node->in[i]->flags & DTR__REQUIRES_GRAD)) return 1;
    return 0;
}

dtr_tensor *dtr__record(dtr_context *ctx, dtr__node *node, const char *opname) {
    dtr_result r;
    if (ctx->status != DTR_OK) return NULL;
    node->taped = dtr__node_needs_grad(ctx, node);
    r = ctx->backend->forward(ctx, node);
    if (r != DTR_OK) {
        if (ctx->status == DTR_OK) dtr__fail(ctx, r, "%s: forward kernel of op '%s' failed", opname, dtr__op_name(node->op));
        return NULL;
    }
    if (node->taped) {
        node->out->flags |= DTR__REQUIRES_GRAD;
        node->out->node = node;
        node->tape = ctx->cur;
        node->prev = ctx->cur->head;
        ctx->cur->head = node;
    }
    return node->out;
}

/* ---- input checks shared by the op builders ---- */

int dtr__check_input(dtr_context *ctx, const char *op, const dtr_tensor *x, const char *what) {
    if (!x) {
        if (ctx->status == DTR_OK) dtr__fail(ctx, DTR_NULL_HANDLE, "%s: %s is NULL", op, what);
        return 0;
    }
    if (x->dtype != DTR_F32) {
        dtr__fail(ctx, DTR_DTYPE_MISMATCH, "%s: %s must be f32, is %s", op, what, dtr_dtype_name(x->dtype));
        return 0;
    }
    if (x->ctx != ctx) {
        dtr__fail(ctx, DTR_INVALID_ARGUMENT, "%s: %s belongs to another context", op, what);
        return 0;
    }
    if (!x->storage && x->model && dtr_model_build(x->model) != DTR_OK) return 0;
    if (!x->storage && x->model) {
        dtr__fail(ctx, DTR_INVALID_ARGUMENT, "%s: parameter '%s' is not part of this model (dtr_model_keep left it out)", op, x->name);
        return 0;
    }
    return 1;
}

dtr_tensor *dtr__contig_input(dtr_context *ctx, dtr_tensor *x) {
    return dtr_tensor_is_contiguous(x) ? x : dtr_contiguous(ctx, x);
}
#line 5728 "dtrain.h"

/* ---- src/core/autograd.c ---- */
#line 1 "src/core/autograd.c"
/* ============================================================================
 * Autograd: replays the tape recorded by the op builders in reverse.
 *
 * Passes. Each dtr_backward / dtr_backward_from is one pass with its own number. Gradients of
 * leaves (parameters, tensors marked with dtr_tensor_requires_grad) accumulate across passes;
 * the gradient of an intermediate tensor belongs to one pass: the first write of a pass
 * finds it zeroed (dtr__grad_of_pass), and a node whose output received nothing in this pass
 * is skipped. So two losses that share a graph, each with its own dtr_backward, give the sum
 * of their gradients, as PyTorch's retain_graph=True does.
 *
 * Gradient hooks. With hooks installed, a pass first counts, for every model parameter on
 * the tape, the nodes whose backward writes its gradient (grad_pending), then after each
 * node (run or skipped) counts down its parameter inputs and reports a parameter when its
 * count reaches zero: its gradient is final for this pass. The report carries an event that
 * completes when the backend has finished writing it (NULL on the CPU: already done).
 * ==========================================================================*/





/* ---- gradient hooks ---- */

dtr_result dtr_context_add_grad_hook(dtr_context *ctx, dtr_grad_hook_fn fn, void *user, int *id) {
    dtr__grad_hook *h;
    if (!ctx) return DTR_NULL_HANDLE;
    if (!fn) return dtr__fail(ctx, DTR_NULL_HANDLE, "dtr_context_add_grad_hook: fn is NULL");
    if (ctx->n_grad_hooks >= DTR__MAX_GRAD_HOOKS)
        return dtr__fail(ctx, DTR_BAD_STATE, "dtr_context_add_grad_hook: the context has %d hooks already",
                         DTR__MAX_GRAD_HOOKS);
    h = &ctx->grad_hooks[ctx->n_grad_hooks++];
    h->fn = fn;
    h->user = user;
    h->id = ++ctx->grad_hook_ids;
    if (id) *id = h->id;
    return DTR_OK;
}

dtr_result dtr_context_remove_grad_hook(dtr_context *ctx, int id) {
    int i;
    if (!ctx) return DTR_NULL_HANDLE;
    for (i = 0; i < ctx->n_grad_hooks; i++) {
        if (ctx->grad_hooks[i].id != id) continue;
        for (; i + 1 < ctx->n_grad_hooks; i++) ctx->grad_hooks[i] = ctx->grad_hooks[i + 1];
        ctx->n_grad_hooks--;
        return DTR_OK;
    }
    return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_context_remove_grad_hook: no hook with id %d", id);
}

static int dtr__is_param(const dtr_tensor *x) {
    return x && (x->flags & DTR__PARAM) && (x->flags & DTR__REQUIRES_GRAD);
}

static void dtr__count_writers(dtr__node *tape) {
    dtr__node *n;
    int i;
    for (n = tape; n; n = n->prev)
        for (i = 0; i < n->n_in; i++)
            if (dtr__is_param(n->in[i])) n->in[i]->grad_pending = 0;
    for (n = tape; n; n = n->prev)
        for (i = 0; i < n->n_in; i++)
            if (dtr__is_param(n->in[i])) n->in[i]->grad_pending++;
}

static dtr_result dtr__report_param(dtr_context *ctx, dtr_tensor *x) {
    dtr_event *ready = NULL;
    dtr_result r = ctx->backend->event_record(ctx, &ready);
    int k;
    for (k = 0; r == DTR_OK && k < ctx->n_grad_hooks; k++) {
        r = ctx->grad_hooks[k].fn(ctx->grad_hooks[k].user, x, ready);
        if (r != DTR_OK && ctx->status == DTR_OK)
            dtr__fail(ctx, r, "dtr_backward: gradient hook %d failed on '%s'", ctx->grad_hooks[k].id, x->name);
    }
    return r;
}

static dtr_result dtr__writers_done(dtr_context *ctx, const dtr__node *n) {
    int i;
    for (i = 0; i < n->n_in; i++) {
        dtr_tensor *x = n->in[i];
        if (dtr__is_param(x) && --x->grad_pending == 0) {
            dtr_result r = dtr__report_param(ctx, x);
            if (r != DTR_OK) return r;
        }
    }
    return DTR_OK;
}

/* ---- passes ---- */

/* The gradient of x for the current pass: a leaf's accumulates; an intermediate's starts
 * from zero in each pass. */
static dtr_result dtr__grad_of_pass(dtr_context *ctx, dtr_tensor *x) {
    int stale = x->grad && x->node && x->grad_pass != ctx->backward_pass;   /* left by an earlier pass */
    dtr_result r = dtr__grad_ensure(ctx, x);                                /* a new one comes zeroed */
    x->grad_pass = ctx->backward_pass;
    if (r != DTR_OK || !stale) return r;
    return ctx->backend->memset0(ctx, x->grad, (size_t)dtr_tensor_numel(x) * sizeof(float));
}

static int dtr__reached(const dtr_context *ctx, const dtr_tensor *x) {
    return x->grad && x->grad_pass == ctx->backward_pass;
}

static dtr_result dtr__run_node(dtr_context *ctx, dtr__node *n) {
    dtr_result r;
    int i;
    for (i = 0; i < n->n_in; i++) {
        dtr_tensor *x = n->in[i];
        if (x && (x->flags & DTR__REQUIRES_GRAD) && (r = dtr__grad_of_pass(ctx, x)) != DTR_OK) return r;
    }
    r = ctx->backend->backward(ctx, n);
    if (r != DTR_OK && ctx->status == DTR_OK)
        dtr__fail(ctx, r, "dtr_backward: backward kernel of op '%s' failed", dtr__op_name(n->op));
    return r;
}

dtr_result dtr__replay(dtr_context *ctx, dtr__node *tape, int report) {
    dtr__node *n;
    dtr_result r;
    int hooks = report && ctx->n_grad_hooks > 0;
    if (hooks) dtr__count_writers(tape);
    for (n = tape; n; n = n->prev) {
        if (dtr__reached(ctx, n->out) && (r = dtr__run_node(ctx, n)) != DTR_OK) return r;
        if (hooks && (r = dtr__writers_done(ctx, n)) != DTR_OK) return r;
    }
    return DTR_OK;
}

static dtr_result dtr__check_root(dtr_context *ctx, const char *fn, const dtr_tensor *out) {
    if (!ctx) return DTR_NULL_HANDLE;
    if (ctx->status != DTR_OK) return ctx->status;
    if (!out) return dtr__fail(ctx, DTR_NULL_HANDLE, "%s: the tensor is NULL", fn);
    if (out->ctx != ctx) return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "%s: the tensor belongs to another context", fn);
    if (!(out->flags & DTR__REQUIRES_GRAD))
        return dtr__fail(ctx, DTR_BAD_STATE, "%s: the tensor does not depend on any parameter "
                                             "(or gradient recording was off)", fn);
    return DTR_OK;
}

/* Seeds out's gradient for this pass with `grad` (host memory). */
static dtr_result dtr__seed(dtr_context *ctx, dtr_tensor *out, const float *grad) {
    size_t bytes = (size_t)dtr_tensor_numel(out) * sizeof(float);
    dtr_result r = dtr__grad_of_pass(ctx, out);
    if (r == DTR_OK && out->node) {
        r = ctx->backend->from_host(ctx, out->grad, grad, bytes);
    } else if (r == DTR_OK) { /* a leaf: its gradient accumulates */
        float *tmp = (float *)dtr__arena_data(ctx, bytes, "dtr_backward_from");
        r = tmp ? ctx->backend->from_host(ctx, tmp, grad, bytes) : ctx->status;
        if (r == DTR_OK) r = ctx->backend->reduce(ctx, out->grad, out->grad, tmp, (size_t)dtr_tensor_numel(out), DTR_F32, DTR_REDUCE_SUM, 1);
    }
    if (r != DTR_OK) return dtr__fail(ctx, r, "dtr_backward_from: cannot seed the gradient");
    return DTR_OK;
}

/* One pass over the tape that recorded `out` (the current one for a leaf), with that tape
 * current so the gradients of its tensors live in its arenas. */
dtr_result dtr_backward_from(dtr_context *ctx, dtr_tensor *out, const float *grad) {
    dtr_result r = dtr__check_root(ctx, "dtr_backward_from", out);
    dtr_tape *was;
    if (r != DTR_OK) return r;
    if (!grad) return dtr__fail(ctx, DTR_NULL_HANDLE, "dtr_backward_from: grad is NULL");
    was = ctx->cur;
    if (out->node) ctx->cur = out->node->tape;
    ctx->backward_pass++;
    r = dtr__seed(ctx, out, grad);
    if (r == DTR_OK) r = dtr__replay(ctx, ctx->cur->head, 1);
    ctx->cur = was;
    return r;
}

dtr_result dtr_backward(dtr_context *ctx, dtr_tensor *loss) {
    static const float one = 1.0f;
    if (!ctx) return DTR_NULL_HANDLE;
    if (ctx->status != DTR_OK) return ctx->status;
    if (!loss) return dtr__fail(ctx, DTR_NULL_HANDLE, "dtr_backward: loss is NULL");
    if (dtr_tensor_numel(loss) != 1)
        return dtr__fail(ctx, DTR_SHAPE_MISMATCH, "dtr_backward: loss must be a scalar, has %lld elements",
                         (long long)dtr_tensor_numel(loss));
    return dtr_backward_from(ctx, loss, &one);
}

/* ---- completion events ---- */

dtr_result dtr_event_wait(dtr_context *ctx, dtr_event *ev) {
    if (!ctx) return DTR_NULL_HANDLE;
    return ev ? ctx->backend->event_wait(ctx, ev) : DTR_OK;
}

dtr_result dtr_event_query(dtr_context *ctx, dtr_event *ev, int *done) {
    if (!ctx || !done) return DTR_NULL_HANDLE;
    *done = 1;
    return ev ? ctx->backend->event_query(ctx, ev, done) : DTR_OK;
}
#line 5927 "dtrain.h"

/* ---- src/core/recompute.c ---- */
#line 1 "src/core/recompute.c"
/* ============================================================================
 * Activation checkpointing (dtr_checkpoint): a region of the forward runs on a tape of its
 * own, which is emptied as soon as the region's output is copied out; the region is
 * recorded as one CHECKPOINT node whose backward runs the region again (same inputs, same
 * random stream, same training mode) and replays it inside the current backward pass.
 *
 *   forward   in -> fn on ctx->recompute[depth] -> y (dense) -> copied into out (current tape)
 *             The node's inputs: the explicit inputs, then every tensor from outside the
 *             region that a node of the region read and that needs a gradient (parameters,
 *             tensors fn reached through its user pointer). So the outer pass makes their
 *             gradients before the node runs, and gradient hooks count the node as a writer
 *             of each parameter: they report it after the node, not inside it.
 *   backward  fn again -> y'; y'.grad is out.grad for this pass (no copy); the region's
 *             nodes replay with the pass's number and without hook reports; the tape is
 *             emptied again.
 * Each nesting level has its own tape, made on first use and kept (empty) for the next
 * step, so a steady step allocates nothing.
 * ==========================================================================*/





#define DTR__CHECKPOINT_MAX_INPUTS 64

/* ---- the region's tape ---- */

typedef struct dtr__region {
    dtr_tape *outer, *tape;
    int grad_enabled;
} dtr__region;

/* Makes the tape of the next nesting level current, with gradient recording on. */
static dtr_result dtr__region_begin(dtr_context *ctx, dtr__region *g) {
    dtr_tape **slot;
    dtr_result r;
    if (ctx->recompute_depth >= DTR__MAX_RECOMPUTE_DEPTH)
        return dtr__fail(ctx, DTR_BAD_STATE, "dtr_checkpoint: regions nested deeper than %d", DTR__MAX_RECOMPUTE_DEPTH);
    slot = &ctx->recompute[ctx->recompute_depth];
    if (!*slot && (r = dtr_tape_create(ctx, slot)) != DTR_OK) return r;
    g->outer = ctx->cur;
    g->tape = *slot;
    g->grad_enabled = ctx->grad_enabled;
    ctx->cur = g->tape;
    ctx->grad_enabled = 1;
    ctx->recompute_depth++;
    return DTR_OK;
}

/* Drops everything the region recorded and makes the outer tape current again. */
static void dtr__region_end(dtr_context *ctx, const dtr__region *g) {
    dtr_tape_reset(g->tape);
    ctx->cur = g->outer;
    ctx->grad_enabled = g->grad_enabled;
    ctx->recompute_depth--;
}

/* 1 when x was computed by a node of tape t. */
static int dtr__inside(const dtr_tape *t, const dtr_tensor *x) { return x->node && x->node->tape == t; }

/* 1 when x needs a gradient and comes from outside tape t (a parameter, an outer tensor). */
static int dtr__from_outside(const dtr_tape *t, const dtr_tensor *x) {
    return x && (x->flags & DTR__REQUIRES_GRAD) && !dtr__inside(t, x);
}

/* fn's output, or NULL with the context's error set. */
static dtr_tensor *dtr__call(dtr_context *ctx, const dtr__checkpoint_params *p, dtr_tensor *const *in) {
    dtr_tensor *y = p->fn(p->user, ctx, in);
    if (ctx->status != DTR_OK) return NULL;
    if (!y) return dtr__failt(ctx, DTR_INVALID_ARGUMENT, "dtr_checkpoint: fn returned NULL without setting an error");
    if (y->ctx != ctx) return dtr__failt(ctx, DTR_INVALID_ARGUMENT, "dtr_checkpoint: fn returned a tensor of another context");
    return y;
}

/* fn's output on the region's (current) tape, made dense; NULL with the error set. */
static dtr_tensor *dtr__region_run(dtr_context *ctx, const dtr__checkpoint_params *p, dtr_tensor *const *in) {
    dtr_tensor *y = dtr__call(ctx, p, in);
    if (!y) return NULL;
    if (dtr__from_outside(ctx->cur, y))
        return dtr__failt(ctx, DTR_INVALID_ARGUMENT, "dtr_checkpoint: fn returned '%s', a tensor it did not compute "
                          "(an input or a parameter); return the result of an op", y->name);
    return dtr__contig_input(ctx, y);
}

/* ---- forward ---- */

/* Appends x, an input of a node of the region, to list[0 .. *n) when it comes from outside
 * the region and needs a gradient, unless it is there already. 0 with the error set when x
 * was made inside the region without a node (a leaf would not outlive it). */
static int dtr__capture(dtr_context *ctx, dtr_tensor **list, int *n, dtr_tensor *x) {
    int i;
    if (!dtr__from_outside(ctx->cur, x)) return 1;
    if (dtr__tape_owns(ctx->cur, x))
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_checkpoint: fn made '%s' require a gradient inside the region; "
                         "make it outside and pass it in", x->name), 0;
    for (i = 0; i < *n; i++)
        if (list[i] == x) return 1;
    list[(*n)++] = x;
    return 1;
}

/* The CHECKPOINT node's inputs: the explicit ones, then each tensor from outside the region
 * that a node of the region read and that needs a gradient. In the region tape's memory. */
static dtr_tensor **dtr__region_inputs(dtr_context *ctx, int n_in, dtr_tensor *const *in, int *count) {
    const dtr_tape *t = ctx->cur;
    const dtr__node *m;
    size_t cap = (size_t)n_in + 1;
    dtr_tensor **list;
    int i;
    for (m = t->head; m; m = m->prev) cap += (size_t)m->n_in;
    list = (dtr_tensor **)dtr__arena_meta(ctx, cap * sizeof(*list), "dtr_checkpoint");
    if (!list) return NULL;
    for (i = 0; i < n_in; i++) list[i] = in[i];
    *count = n_in;
    for (m = t->head; m; m = m->prev)
        for (i = 0; i < m->n_in; i++)
            if (!dtr__capture(ctx, list, count, m->in[i])) return NULL;
    return list;
}

/* Records the CHECKPOINT node on the outer tape; its forward kernel copies y into out. */
static dtr_tensor *dtr__checkpoint_record(dtr_context *ctx, const dtr__region *g, const dtr__checkpoint_params *p,
                                          dtr_tensor *const *in, dtr_tensor *y) {
    int count = 0;
    dtr_tensor **all = dtr__region_inputs(ctx, p->n_explicit, in, &count);
    dtr__node *n;
    if (!all) return NULL;
    ctx->cur = g->outer;
    n = dtr__node_new(ctx, DTR_OP_CHECKPOINT, count, all);
    if (!n) return NULL;
    n->p.checkpoint = *p;
    n->p.checkpoint.region_out = y;
    n->out = dtr__tensor_alloc(ctx, y->dtype, y->ndim, y->shape, "dtr_checkpoint");
    y = n->out ? dtr__record(ctx, n, "dtr_checkpoint") : NULL;
    n->p.checkpoint.region_out = NULL;   /* emptied with the region's tape */
    return y;
}

static int dtr__checkpoint_args(dtr_context *ctx, dtr_checkpoint_fn fn, int n_in, dtr_tensor *const *in) {
    int i;
    if (ctx->status != DTR_OK) return 0;
    if (!fn) return dtr__fail(ctx, DTR_NULL_HANDLE, "dtr_checkpoint: fn is NULL"), 0;
    if (n_in < 0 || n_in > DTR__CHECKPOINT_MAX_INPUTS)
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_checkpoint: n_in is %d, must be 0..%d", n_in,
                         DTR__CHECKPOINT_MAX_INPUTS), 0;
    if (n_in > 0 && !in) return dtr__fail(ctx, DTR_NULL_HANDLE, "dtr_checkpoint: in is NULL (n_in %d)", n_in), 0;
    for (i = 0; i < n_in; i++) {
        if (!in[i]) return dtr__fail(ctx, DTR_NULL_HANDLE, "dtr_checkpoint: input %d is NULL", i), 0;
        if (in[i]->ctx != ctx)
            return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_checkpoint: input %d belongs to another context", i), 0;
    }
    return 1;
}

dtr_tensor *dtr_checkpoint(dtr_context *ctx, dtr_checkpoint_fn fn, void *user, int n_in, dtr_tensor *const *in) {
    dtr__checkpoint_params p;
    dtr__region g = {NULL, NULL, 0};
    dtr_tensor *y;
    if (!ctx || !dtr__checkpoint_args(ctx, fn, n_in, in)) return NULL;
    memset(&p, 0, sizeof(p));
    p.fn = fn;
    p.user = user;
    p.rng = ctx->rng;
    p.n_explicit = n_in;
    p.training = ctx->training;
    if (!ctx->grad_enabled) return dtr__call(ctx, &p, in);   /* nothing to keep for backward */
    if (dtr__region_begin(ctx, &g) != DTR_OK) return NULL;
    y = dtr__region_run(ctx, &p, in);
    if (y) y = dtr__checkpoint_record(ctx, &g, &p, in, y);
    dtr__region_end(ctx, &g);
    return y;
}

/* ---- backward ---- */

/* The recomputed region's share of the pass: y's gradient is the node's output gradient,
 * and the region's nodes replay into the gradients the outer pass made for its inputs. */
static dtr_result dtr__region_backward(dtr_context *ctx, const dtr__node *n, dtr_tensor *y) {
    const dtr_tape *t = ctx->cur;
    const dtr__node *m;
    char s1[96], s2[96];
    int i;
    if (y->ndim != n->out->ndim || memcmp(y->shape, n->out->shape, (size_t)y->ndim * sizeof(int64_t)) != 0)
        return dtr__fail(ctx, DTR_SHAPE_MISMATCH, "dtr_checkpoint: the region's output was %s in forward and is %s "
                         "recomputed", dtr__shape_str(n->out, s1, sizeof s1), dtr__shape_str(y, s2, sizeof s2));
    if (!dtr__inside(t, y)) return DTR_OK;   /* nothing in the region needs a gradient */
    /* every outside tensor the region writes a gradient to must have one from this pass */
    for (m = t->head; m; m = m->prev)
        for (i = 0; i < m->n_in; i++)
            if (dtr__from_outside(t, m->in[i]) && !(m->in[i]->grad && m->in[i]->grad_pass == ctx->backward_pass))
                return dtr__fail(ctx, DTR_BAD_STATE, "dtr_checkpoint: recomputing the region read '%s', which it did "
                                 "not read in forward (fn must build the same graph each time)", m->in[i]->name);
    y->grad = n->out->grad;
    y->grad_pass = ctx->backward_pass;
    return dtr__replay(ctx, t->head, 0);
}

dtr_result dtr__checkpoint_backward(dtr_context *ctx, dtr__node *n) {
    const dtr__checkpoint_params *p = &n->p.checkpoint;
    dtr_rng rng = ctx->rng;
    int training = ctx->training;
    dtr__region g = {NULL, NULL, 0};
    dtr_tensor *y;
    dtr_result r = dtr__region_begin(ctx, &g);
    if (r != DTR_OK) return r;
    ctx->rng = p->rng;           /* the forward's stream: the same dropout masks */
    ctx->training = p->training;
    y = dtr__region_run(ctx, p, n->in);
    ctx->rng = rng;
    ctx->training = training;
    r = y ? dtr__region_backward(ctx, n, y) : ctx->status;
    dtr__region_end(ctx, &g);
    return r;
}

/* ---- CPU kernels ---- */

/* out = the region's dense output */
dtr_result dtr__cpu_checkpoint_fwd(dtr_context *ctx, dtr__node *n) {
    const dtr_tensor *y = n->p.checkpoint.region_out;
    size_t es = dtr_dtype_size(y->dtype);
    (void)ctx;
    memcpy(n->out->storage, (const char *)y->storage + (size_t)y->offset * es, (size_t)dtr_tensor_numel(y) * es);
    return DTR_OK;
}

dtr_result dtr__cpu_checkpoint_bwd(dtr_context *ctx, dtr__node *n) { return dtr__checkpoint_backward(ctx, n); }
#line 6158 "dtrain.h"

/* ---- src/ops/ops_elementwise.c ---- */
#line 1 "src/ops/ops_elementwise.c"
/* ============================================================================
 * Element-wise ops, reductions and simple losses: builders and CPU kernels side by side.
 * Shapes: any; binary ops broadcast as NumPy does (axes aligned on the right).
 * ==========================================================================*/


#include <math.h>

/* ---- broadcasting ---- */

/* Output shape and per-input strides (0 on broadcast axes) over the output's axes. */
typedef struct dtr__bcast {
    int nd;
    int64_t shape[DTR_MAX_DIMS];
    int64_t sa[DTR_MAX_DIMS], sb[DTR_MAX_DIMS];   /* element strides of a, b (views) */
    int64_t ga[DTR_MAX_DIMS], gb[DTR_MAX_DIMS];   /* strides into the dense gradients of a, b */
} dtr__bcast;

static int dtr__bcast_make(const dtr_tensor *a, const dtr_tensor *b, dtr__bcast *bc) {
    int nd = a->ndim > b->ndim ? a->ndim : b->ndim, d;
    int64_t gsa[DTR_MAX_DIMS], gsb[DTR_MAX_DIMS];
    dtr__contig_strides(a->ndim, a->shape, gsa);
    dtr__contig_strides(b->ndim, b->shape, gsb);
    bc->nd = nd;
    for (d = 0; d < nd; d++) {
        int da = d - (nd - a->ndim), db = d - (nd - b->ndim);
        int64_t na = da >= 0 ? a->shape[da] : 1, nb = db >= 0 ? b->shape[db] : 1;
        if (na != nb && na != 1 && nb != 1) return 0;
        bc->shape[d] = na > nb ? na : nb;
        if (na == 0 || nb == 0) bc->shape[d] = 0;
        bc->sa[d] = (da >= 0 && na != 1) ? a->stride[da] : 0;
        bc->sb[d] = (db >= 0 && nb != 1) ? b->stride[db] : 0;
        bc->ga[d] = (da >= 0 && na != 1) ? gsa[da] : 0;
        bc->gb[d] = (db >= 0 && nb != 1) ? gsb[db] : 0;
    }
    return 1;
}

/* Walks the output in row-major order, one innermost row at a time. */
#define DTR__BCAST_ROWS(bc, ...)                                                          \
    do {                                                                                  \
        int64_t idx_[DTR_MAX_DIMS] = {0}, nrow_ = 1, r_, inner_;                          \
        int d_, last_ = (bc)->nd - 1;                                                     \
        inner_ = last_ >= 0 ? (bc)->shape[last_] : 1;                                     \
        for (d_ = 0; d_ < last_; d_++) nrow_ *= (bc)->shape[d_];                          \
        if (inner_ == 0) nrow_ = 0;                                                       \
        for (r_ = 0; r_ < nrow_; r_++) {                                                  \
            int64_t oa = 0, ob = 0, oga = 0, ogb = 0, o = r_ * inner_, n = inner_;         \
            int64_t ia = last_ >= 0 ? (bc)->sa[last_] : 0, ib = last_ >= 0 ? (bc)->sb[last_] : 0; \
            int64_t iga = last_ >= 0 ? (bc)->ga[last_] : 0, igb = last_ >= 0 ? (bc)->gb[last_] : 0; \
            for (d_ = 0; d_ < last_; d_++) {                                              \
                oa += idx_[d_] * (bc)->sa[d_]; ob += idx_[d_] * (bc)->sb[d_];             \
                oga += idx_[d_] * (bc)->ga[d_]; ogb += idx_[d_] * (bc)->gb[d_];           \
            }                                                                             \
            (void)oga; (void)ogb; (void)iga; (void)igb; (void)ia; (void)ib;               \
            __VA_ARGS__;                                                                  \
            for (d_ = last_ - 1; d_ >= 0; d_--) {                                         \
                if (++idx_[d_] < (bc)->shape[d_]) break;                                  \
                idx_[d_] = 0;                                                             \
            }                                                                             \
        }                                                                                 \
    } while (0)

static dtr_tensor *dtr__binary(dtr_context *ctx, int op, const char *name, dtr_tensor *a, dtr_tensor *b) {
    dtr__bcast bc;
    dtr__node *n;
    char s1[96], s2[96];
    if (!ctx) return NULL;
    if (!dtr__check_input(ctx, name, a, "a") || !dtr__check_input(ctx, name, b, "b")) return NULL;
    if (!dtr__bcast_make(a, b, &bc))
        return dtr__failt(ctx, DTR_SHAPE_MISMATCH, "%s: shapes %s and %s do not broadcast", name,
                          dtr__shape_str(a, s1, sizeof s1), dtr__shape_str(b, s2, sizeof s2));
    {
        dtr_tensor *in[2] = {a, b};
        n = dtr__node_new(ctx, op, 2, in);
    }
    if (!n) return NULL;
    n->out = dtr__tensor_alloc(ctx, DTR_F32, bc.nd, bc.shape, name);
    if (!n->out) return NULL;
    return dtr__record(ctx, n, name);
}

dtr_tensor *dtr_add(dtr_context *ctx, dtr_tensor *a, dtr_tensor *b) { return dtr__binary(ctx, DTR_OP_ADD, "dtr_add", a, b); }
dtr_tensor *dtr_sub(dtr_context *ctx, dtr_tensor *a, dtr_tensor *b) { return dtr__binary(ctx, DTR_OP_SUB, "dtr_sub", a, b); }
dtr_tensor *dtr_mul(dtr_context *ctx, dtr_tensor *a, dtr_tensor *b) { return dtr__binary(ctx, DTR_OP_MUL, "dtr_mul", a, b); }
dtr_tensor *dtr_div(dtr_context *ctx, dtr_tensor *a, dtr_tensor *b) { return dtr__binary(ctx, DTR_OP_DIV, "dtr_div", a, b); }

dtr_result dtr__cpu_binary_fwd(dtr_context *ctx, dtr__node *nd) {
    dtr__bcast bc;
    const float *A = (const float *)nd->in[0]->storage + nd->in[0]->offset;
    const float *B = (const float *)nd->in[1]->storage + nd->in[1]->offset;
    float *Y = dtr__f32(nd->out);
    int op = nd->op;
    (void)ctx;
    dtr__bcast_make(nd->in[0], nd->in[1], &bc);
    DTR__BCAST_ROWS(&bc, {
        const float *pa = A + oa, *pb = B + ob;
        float *py = Y + o;
        int64_t j;
        switch (op) {
        case DTR_OP_ADD:
            if (ia == 1 && ib == 1) { for (j = 0; j < n; j++) py[j] = pa[j] + pb[j]; }
            else if (ia == 1 && ib == 0) { float v = pb[0]; for (j = 0; j < n; j++) py[j] = pa[j] + v; }
            else { for (j = 0; j < n; j++) py[j] = pa[j * ia] + pb[j * ib]; }
            break;
        case DTR_OP_SUB: for (j = 0; j < n; j++) py[j] = pa[j * ia] - pb[j * ib]; break;
        case DTR_OP_MUL:
            if (ia == 1 && ib == 1) { for (j = 0; j < n; j++) py[j] = pa[j] * pb[j]; }
            else { for (j = 0; j < n; j++) py[j] = pa[j * ia] * pb[j * ib]; }
            break;
        default: for (j = 0; j < n; j++) py[j] = pa[j * ia] / pb[j * ib]; break;
        }
    });
    return DTR_OK;
}

dtr_result dtr__cpu_binary_bwd(dtr_context *ctx, dtr__node *nd) {
    dtr__bcast bc;
    const float *A = (const float *)nd->in[0]->storage + nd->in[0]->offset;
    const float *B = (const float *)nd->in[1]->storage + nd->in[1]->offset;
    const float *G = nd->out->grad;
    float *GA = dtr__gradof(nd->in[0]), *GB = dtr__gradof(nd->in[1]);
    int op = nd->op;
    (void)ctx;
    dtr__bcast_make(nd->in[0], nd->in[1], &bc);
    DTR__BCAST_ROWS(&bc, {
        const float *g = G + o, *pa = A + oa, *pb = B + ob;
        float *qa = GA ? GA + oga : NULL, *qb = GB ? GB + ogb : NULL;
        int64_t j;
        switch (op) {
        case DTR_OP_ADD:
            if (qa) for (j = 0; j < n; j++) qa[j * iga] += g[j];
            if (qb) for (j = 0; j < n; j++) qb[j * igb] += g[j];
            break;
        case DTR_OP_SUB:
            if (qa) for (j = 0; j < n; j++) qa[j * iga] += g[j];
            if (qb) for (j = 0; j < n; j++) qb[j * igb] -= g[j];
            break;
        case DTR_OP_MUL:
            if (qa) for (j = 0; j < n; j++) qa[j * iga] += g[j] * pb[j * ib];
            if (qb) for (j = 0; j < n; j++) qb[j * igb] += g[j] * pa[j * ia];
            break;
        default:
            if (qa) for (j = 0; j < n; j++) qa[j * iga] += g[j] / pb[j * ib];
            if (qb) for (j = 0; j < n; j++) {
                float bv = pb[j * ib];
                qb[j * igb] -= g[j] * pa[j * ia] / (bv * bv);
            }
            break;
        }
    });
    return DTR_OK;
}

/* ---- unary ops ---- */

static dtr_tensor *dtr__unary(dtr_context *ctx, int op, const char *name, dtr_tensor *x, float arg) {
    dtr__node *n;
    if (!ctx) return NULL;
    if (!dtr__check_input(ctx, name, x, "x")) return NULL;
    x = dtr__contig_input(ctx, x);
    if (!x) return NULL;
    n = dtr__node_new(ctx, op, 1, &x);
    if (!n) return NULL;
    if (op == DTR_OP_SCALE) n->p.scale = arg;
    n->out = dtr__tensor_alloc(ctx, DTR_F32, x->ndim, x->shape, name);
    if (!n->out) return NULL;
    return dtr__record(ctx, n, name);
}

dtr_tensor *dtr_scale(dtr_context *ctx, dtr_tensor *x, float s) { return dtr__unary(ctx, DTR_OP_SCALE, "dtr_scale", x, s); }
dtr_tensor *dtr_relu(dtr_context *ctx, dtr_tensor *x) { return dtr__unary(ctx, DTR_OP_RELU, "dtr_relu", x, 0); }
dtr_tensor *dtr_gelu(dtr_context *ctx, dtr_tensor *x) { return dtr__unary(ctx, DTR_OP_GELU, "dtr_gelu", x, 0); }
dtr_tensor *dtr_tanh(dtr_context *ctx, dtr_tensor *x) { return dtr__unary(ctx, DTR_OP_TANH, "dtr_tanh", x, 0); }
dtr_tensor *dtr_sigmoid(dtr_context *ctx, dtr_tensor *x) { return dtr__unary(ctx, DTR_OP_SIGMOID, "dtr_sigmoid", x, 0); }
dtr_tensor *dtr_abs(dtr_context *ctx, dtr_tensor *x) { return dtr__unary(ctx, DTR_OP_ABS, "dtr_abs", x, 0); }
dtr_tensor *dtr_gelu_erf(dtr_context *ctx, dtr_tensor *x) { return dtr__unary(ctx, DTR_OP_GELU_ERF, "dtr_gelu_erf", x, 0); }

#define DTR__GELU_K 0.7978845608028654f       /* sqrt(2/pi) */
#define DTR__SQRT1_2 0.7071067811865476f      /* 1/sqrt(2) */
#define DTR__INV_SQRT_2PI 0.3989422804014327f /* 1/sqrt(2 pi) */

typedef struct { const dtr__node *nd; } dtr__unary_job;

/* ReLU, the hot activation of CNNs and MLPs, in blocks of 8 through a local array: the
 * compiler's basic-block (SLP) vectorizer turns each block into SIMD compares and selects,
 * even at -O2 and although the pointers may alias (a block is loaded before it is stored).
 * Per element the operations are those of the scalar loop, so the results are the same. */
static void dtr__relu_fwd(const float *x, float *y, int64_t b, int64_t e) {
    int64_t i = b;
    int k;
    for (; i + 8 <= e; i += 8) {
        float t[8];
        for (k = 0; k < 8; k++) t[k] = x[i + k];
        for (k = 0; k < 8; k++) t[k] = t[k] < 0.0f ? 0.0f : t[k];
        for (k = 0; k < 8; k++) y[i + k] = t[k];
    }
    for (; i < e; i++) y[i] = x[i] < 0.0f ? 0.0f : x[i];
}

static void dtr__relu_bwd(const float *x, const float *g, float *gx, int64_t b, int64_t e) {
    int64_t i = b;
    int k;
    for (; i + 8 <= e; i += 8) {
        float tx[8], tg[8], tgx[8];
        for (k = 0; k < 8; k++) { tx[k] = x[i + k]; tg[k] = g[i + k]; tgx[k] = gx[i + k]; }
        for (k = 0; k < 8; k++) tgx[k] += tx[k] <= 0.0f ? 0.0f : tg[k];
        for (k = 0; k < 8; k++) gx[i + k] = tgx[k];
    }
    for (; i < e; i++) gx[i] += x[i] <= 0.0f ? 0.0f : g[i];
}

static void dtr__unary_fwd_range(void *arg, int64_t b, int64_t e, int w) {
    const dtr__node *nd = ((dtr__unary_job *)arg)->nd;
    const float *x = dtr__f32(nd->in[0]);
    float *y = dtr__f32(nd->out);
    int64_t i;
    (void)w;
    switch (nd->op) {
    case DTR_OP_SCALE: { float s = nd->p.scale; for (i = b; i < e; i++) y[i] = s * x[i]; } break;
    case DTR_OP_RELU: dtr__relu_fwd(x, y, b, e); break;
    case DTR_OP_GELU:
        for (i = b; i < e; i++) {
            float v = x[i];
            y[i] = 0.5f * v * (1.0f + tanhf(DTR__GELU_K * (v + 0.044715f * v * v * v)));
        }
        break;
    case DTR_OP_TANH: for (i = b; i < e; i++) y[i] = tanhf(x[i]); break;
    case DTR_OP_ABS: for (i = b; i < e; i++) y[i] = fabsf(x[i]); break;
    case DTR_OP_GELU_ERF: for (i = b; i < e; i++) y[i] = 0.5f * x[i] * (1.0f + erff(x[i] * DTR__SQRT1_2)); break;
    default: for (i = b; i < e; i++) y[i] = 1.0f / (1.0f + expf(-x[i])); break;
    }
}

static void dtr__unary_bwd_range(void *arg, int64_t b, int64_t e, int w) {
    const dtr__node *nd = ((dtr__unary_job *)arg)->nd;
    const float *x = dtr__f32(nd->in[0]), *y = dtr__f32(nd->out), *g = nd->out->grad;
    float *gx = dtr__gradof(nd->in[0]);
    int64_t i;
    (void)w;
    switch (nd->op) {
    case DTR_OP_SCALE: { float s = nd->p.scale; for (i = b; i < e; i++) gx[i] += s * g[i]; } break;
    case DTR_OP_RELU: dtr__relu_bwd(x, g, gx, b, e); break;
    case DTR_OP_GELU:
        for (i = b; i < e; i++) {
            float v = x[i], u = DTR__GELU_K * (v + 0.044715f * v * v * v), t = tanhf(u);
            float du = DTR__GELU_K * (1.0f + 3.0f * 0.044715f * v * v);
            gx[i] += g[i] * (0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * du);
        }
        break;
    case DTR_OP_TANH: for (i = b; i < e; i++) gx[i] += g[i] * (1.0f - y[i] * y[i]); break;
    case DTR_OP_ABS: /* sign(x), as PyTorch's: 0 at 0 and at NaN (torch.sign(nan) is 0) */
        for (i = b; i < e; i++) gx[i] += g[i] * (x[i] > 0.0f ? 1.0f : x[i] < 0.0f ? -1.0f : 0.0f);
        break;
    case DTR_OP_GELU_ERF:
        for (i = b; i < e; i++) {
            float v = x[i], cdf = 0.5f * (1.0f + erff(v * DTR__SQRT1_2));
            gx[i] += g[i] * (cdf + v * DTR__INV_SQRT_2PI * expf(-0.5f * v * v));
        }
        break;
    default: for (i = b; i < e; i++) gx[i] += g[i] * y[i] * (1.0f - y[i]); break;
    }
}

dtr_result dtr__cpu_unary_fwd(dtr_context *ctx, dtr__node *nd) {
    dtr__unary_job j;
    j.nd = nd;
    dtr__pool_run(ctx->pool, dtr_tensor_numel(nd->out), 16384, dtr__unary_fwd_range, &j);
    return DTR_OK;
}

dtr_result dtr__cpu_unary_bwd(dtr_context *ctx, dtr__node *nd) {
    dtr__unary_job j;
    if (!dtr__gradof(nd->in[0])) return DTR_OK;
    j.nd = nd;
    dtr__pool_run(ctx->pool, dtr_tensor_numel(nd->out), 16384, dtr__unary_bwd_range, &j);
    return DTR_OK;
}

/* ---- reductions ---- */

static dtr_tensor *dtr__reduce(dtr_context *ctx, int op, const char *name, dtr_tensor *x, int axis, int keepdim) {
    dtr__node *n;
    int64_t shape[DTR_MAX_DIMS] = {0};
    int nd = 0, d;
    if (!ctx) return NULL;
    if (!dtr__check_input(ctx, name, x, "x")) return NULL;
    if (op == DTR_OP_SUM || op == DTR_OP_MEAN) {
        if (axis < 0) axis += x->ndim;
        if (axis < 0 || axis >= x->ndim)
            return dtr__failt(ctx, DTR_INVALID_ARGUMENT, "%s: axis %d outside a tensor of %d dims", name, axis, x->ndim);
        for (d = 0; d < x->ndim; d++) {
            if (d == axis) { if (keepdim) shape[nd++] = 1; }
            else shape[nd++] = x->shape[d];
        }
    }
    x = dtr__contig_input(ctx, x);
    if (!x) return NULL;
    n = dtr__node_new(ctx, op, 1, &x);
    if (!n) return NULL;
    n->p.axis = axis;
    n->out = dtr__tensor_alloc(ctx, DTR_F32, nd, shape, name);
    if (!n->out) return NULL;
    return dtr__record(ctx, n, name);
}

dtr_tensor *dtr_sum(dtr_context *ctx, dtr_tensor *x, int axis, int keepdim) { return dtr__reduce(ctx, DTR_OP_SUM, "dtr_sum", x, axis, keepdim); }
dtr_tensor *dtr_mean(dtr_context *ctx, dtr_tensor *x, int axis, int keepdim) { return dtr__reduce(ctx, DTR_OP_MEAN, "dtr_mean", x, axis, keepdim); }
dtr_tensor *dtr_sum_all(dtr_context *ctx, dtr_tensor *x) { return dtr__reduce(ctx, DTR_OP_SUM_ALL, "dtr_sum_all", x, 0, 0); }
dtr_tensor *dtr_mean_all(dtr_context *ctx, dtr_tensor *x) { return dtr__reduce(ctx, DTR_OP_MEAN_ALL, "dtr_mean_all", x, 0, 0); }

/* x viewed as (outer, len, inner) around `axis`. */
static void dtr__axis_split(const dtr_tensor *x, int axis, int64_t *outer, int64_t *len, int64_t *inner) {
    int d;
    *outer = 1; *inner = 1;
    for (d = 0; d < axis; d++) *outer *= x->shape[d];
    for (d = axis + 1; d < x->ndim; d++) *inner *= x->shape[d];
    *len = x->shape[axis];
}

dtr_result dtr__cpu_reduce_fwd(dtr_context *ctx, dtr__node *nd) {
    const float *x = dtr__f32(nd->in[0]);
    float *y = dtr__f32(nd->out);
    (void)ctx;
    if (nd->op == DTR_OP_SUM_ALL || nd->op == DTR_OP_MEAN_ALL) {
        int64_t i, n = dtr_tensor_numel(nd->in[0]);
        double s = 0.0;
        for (i = 0; i < n; i++) s += x[i];
        y[0] = (float)(nd->op == DTR_OP_MEAN_ALL ? s / (double)n : s); /* empty: 0/0 = NaN */
    } else {
        int64_t outer, len, inner, o, k, i;
        dtr__axis_split(nd->in[0], nd->p.axis, &outer, &len, &inner);
        for (o = 0; o < outer; o++)
            for (i = 0; i < inner; i++) {
                double s = 0.0;
                for (k = 0; k < len; k++) s += x[(o * len + k) * inner + i];
                if (nd->op == DTR_OP_MEAN) s /= (double)len; /* len 0: NaN */
                y[o * inner + i] = (float)s;
            }
    }
    return DTR_OK;
}

dtr_result dtr__cpu_reduce_bwd(dtr_context *ctx, dtr__node *nd) {
    float *gx = dtr__gradof(nd->in[0]);
    const float *g = nd->out->grad;
    (void)ctx;
    if (!gx) return DTR_OK;
    if (nd->op == DTR_OP_SUM_ALL || nd->op == DTR_OP_MEAN_ALL) {
        int64_t i, n = dtr_tensor_numel(nd->in[0]);
        float v = nd->op == DTR_OP_MEAN_ALL ? (n ? g[0] / (float)n : 0.0f) : g[0];
        for (i = 0; i < n; i++) gx[i] += v;
    } else {
        int64_t outer, len, inner, o, k, i;
        float sc;
        dtr__axis_split(nd->in[0], nd->p.axis, &outer, &len, &inner);
        sc = nd->op == DTR_OP_MEAN && len ? 1.0f / (float)len : 1.0f;
        for (o = 0; o < outer; o++)
            for (k = 0; k < len; k++)
                for (i = 0; i < inner; i++) gx[(o * len + k) * inner + i] += g[o * inner + i] * sc;
    }
    return DTR_OK;
}

/* ---- mean squared error ---- */

dtr_tensor *dtr_mse(dtr_context *ctx, dtr_tensor *pred, dtr_tensor *target) {
    dtr__node *n;
    char s1[96], s2[96];
    int d;
    if (!ctx) return NULL;
    if (!dtr__check_input(ctx, "dtr_mse", pred, "pred") || !dtr__check_input(ctx, "dtr_mse", target, "target"))
        return NULL;
    if (pred->ndim != target->ndim) goto mismatch;
    for (d = 0; d < pred->ndim; d++)
        if (pred->shape[d] != target->shape[d]) goto mismatch;
    pred = dtr__contig_input(ctx, pred);
    target = dtr__contig_input(ctx, target);
    if (!pred || !target) return NULL;
    {
        dtr_tensor *in[2] = {pred, target};
        n = dtr__node_new(ctx, DTR_OP_MSE, 2, in);
    }
    if (!n) return NULL;
    n->out = dtr__tensor_alloc(ctx, DTR_F32, 0, NULL, "dtr_mse");
    if (!n->out) return NULL;
    return dtr__record(ctx, n, "dtr_mse");
mismatch:
    return dtr__failt(ctx, DTR_SHAPE_MISMATCH, "dtr_mse: pred %s and target %s differ",
                      dtr__shape_str(pred, s1, sizeof s1), dtr__shape_str(target, s2, sizeof s2));
}

dtr_result dtr__cpu_mse_fwd(dtr_context *ctx, dtr__node *nd) {
    const float *p = dtr__f32(nd->in[0]), *t = dtr__f32(nd->in[1]);
    int64_t i, n = dtr_tensor_numel(nd->in[0]);
    double s = 0.0;
    (void)ctx;
    for (i = 0; i < n; i++) { double d = (double)p[i] - t[i]; s += d * d; }
    dtr__f32(nd->out)[0] = (float)(s / (double)n); /* empty: 0/0 = NaN, as PyTorch */
    return DTR_OK;
}

dtr_result dtr__cpu_mse_bwd(dtr_context *ctx, dtr__node *nd) {
    const float *p = dtr__f32(nd->in[0]), *t = dtr__f32(nd->in[1]);
    float *gp = dtr__gradof(nd->in[0]), *gt = dtr__gradof(nd->in[1]);
    int64_t i, n = dtr_tensor_numel(nd->in[0]);
    float c = n ? 2.0f * nd->out->grad[0] / (float)n : 0.0f;
    (void)ctx;
    for (i = 0; i < n; i++) {
        float d = c * (p[i] - t[i]);
        if (gp) gp[i] += d;
        if (gt) gt[i] -= d;
    }
    return DTR_OK;
}

/* ---- dtype cast ---- */

dtr_tensor *dtr_cast(dtr_context *ctx, dtr_tensor *x, dtr_dtype dt) {
    dtr__node *n;
    if (!ctx) return NULL;
    if (!x) return dtr__failt(ctx, ctx->status ? ctx->status : DTR_NULL_HANDLE, "dtr_cast: x is NULL");
    if (!dtr_dtype_size(dt)) return dtr__failt(ctx, DTR_DTYPE_MISMATCH, "dtr_cast: unknown dtype %d", (int)dt);
    x = dtr__contig_input(ctx, x);
    if (!x) return NULL;
    n = dtr__node_new(ctx, DTR_OP_CAST, 1, &x);
    if (!n) return NULL;
    n->out = dtr__tensor_alloc(ctx, dt, x->ndim, x->shape, "dtr_cast");
    if (!n->out) return NULL;
    return dtr__record(ctx, n, "dtr_cast");
}

dtr_result dtr__cpu_cast_fwd(dtr_context *ctx, dtr__node *nd) {
    (void)ctx;
    return dtr_convert(dtr_tensor_data(nd->out), nd->out->dtype, dtr_tensor_data(nd->in[0]), nd->in[0]->dtype,
                       (size_t)dtr_tensor_numel(nd->out));
}

dtr_result dtr__cpu_cast_bwd(dtr_context *ctx, dtr__node *nd) {
    float *gx = dtr__gradof(nd->in[0]);
    const float *g = nd->out->grad;
    int64_t i, n = dtr_tensor_numel(nd->out);
    (void)ctx;
    if (gx) for (i = 0; i < n; i++) gx[i] += g[i];
    return DTR_OK;
}
#line 6608 "dtrain.h"

/* ---- src/ops/ops_matmul.c ---- */
#line 1 "src/ops/ops_matmul.c"
/* ============================================================================
 * Matrix products: batched matmul and linear (x w^T + b), through dtr__gemm.
 * Shapes: a (..., M, K), b (..., K, N) -> (..., M, N); x (R..., in), w (out, in) -> (R..., out).
 * ==========================================================================*/



/* ---- matmul ---- */

/* Batch layout: output batch shape and the strides of a and b over it (0 where broadcast). */
typedef struct dtr__batch {
    int nd;
    int64_t shape[DTR_MAX_DIMS], sa[DTR_MAX_DIMS], sb[DTR_MAX_DIMS], count;
} dtr__batch;

static int dtr__batch_make(const dtr_tensor *a, const dtr_tensor *b, dtr__batch *bt) {
    int na = a->ndim - 2, nb = b->ndim - 2, nd = na > nb ? na : nb, d;
    bt->nd = nd;
    bt->count = 1;
    for (d = 0; d < nd; d++) {
        int da = d - (nd - na), db = d - (nd - nb);
        int64_t sa = da >= 0 ? a->shape[da] : 1, sb = db >= 0 ? b->shape[db] : 1;
        if (sa != sb && sa != 1 && sb != 1) return 0;
        bt->shape[d] = sa > sb ? sa : sb;
        bt->sa[d] = (da >= 0 && sa != 1) ? a->stride[da] : 0;
        bt->sb[d] = (db >= 0 && sb != 1) ? b->stride[db] : 0;
        bt->count *= bt->shape[d];
    }
    return 1;
}

static void dtr__batch_offsets(const dtr__batch *bt, int64_t i, int64_t *oa, int64_t *ob) {
    int d;
    *oa = *ob = 0;
    for (d = bt->nd - 1; d >= 0; d--) {
        int64_t k = i % bt->shape[d];
        i /= bt->shape[d];
        *oa += k * bt->sa[d];
        *ob += k * bt->sb[d];
    }
}

dtr_tensor *dtr_matmul(dtr_context *ctx, dtr_tensor *a, dtr_tensor *b) {
    dtr__batch bt;
    dtr__node *n;
    int64_t shape[DTR_MAX_DIMS];
    char s1[96], s2[96];
    int d;
    if (!ctx) return NULL;
    if (!dtr__check_input(ctx, "dtr_matmul", a, "a") || !dtr__check_input(ctx, "dtr_matmul", b, "b")) return NULL;
    if (a->ndim < 2 || b->ndim < 2 || a->shape[a->ndim - 1] != b->shape[b->ndim - 2] || !dtr__batch_make(a, b, &bt))
        return dtr__failt(ctx, DTR_SHAPE_MISMATCH, "dtr_matmul: cannot multiply %s by %s (need (..., M, K) x (..., K, N))",
                          dtr__shape_str(a, s1, sizeof s1), dtr__shape_str(b, s2, sizeof s2));
    for (d = 0; d < bt.nd; d++) shape[d] = bt.shape[d];
    shape[bt.nd] = a->shape[a->ndim - 2];
    shape[bt.nd + 1] = b->shape[b->ndim - 1];
    {
        dtr_tensor *in[2] = {a, b};
        n = dtr__node_new(ctx, DTR_OP_MATMUL, 2, in);
    }
    if (!n) return NULL;
    n->out = dtr__tensor_alloc(ctx, DTR_F32, bt.nd + 2, shape, "dtr_matmul");
    if (!n->out) return NULL;
    return dtr__record(ctx, n, "dtr_matmul");
}

dtr_result dtr__cpu_matmul_fwd(dtr_context *ctx, dtr__node *nd) {
    const dtr_tensor *a = nd->in[0], *b = nd->in[1];
    dtr__batch bt;
    int64_t M = a->shape[a->ndim - 2], K = a->shape[a->ndim - 1], N = b->shape[b->ndim - 1], i;
    const float *A = (const float *)a->storage + a->offset, *B = (const float *)b->storage + b->offset;
    float *Y = dtr__f32(nd->out);
    dtr__batch_make(a, b, &bt);
    for (i = 0; i < bt.count; i++) {
        int64_t oa, ob;
        dtr__batch_offsets(&bt, i, &oa, &ob);
        dtr__gemm(ctx->pool, M, N, K, 1.0f, A + oa, a->stride[a->ndim - 2], a->stride[a->ndim - 1],
                  B + ob, b->stride[b->ndim - 2], b->stride[b->ndim - 1], 0.0f, Y + i * M * N, N);
    }
    return DTR_OK;
}

dtr_result dtr__cpu_matmul_bwd(dtr_context *ctx, dtr__node *nd) {
    const dtr_tensor *a = nd->in[0], *b = nd->in[1];
    dtr__batch bt;
    int64_t M = a->shape[a->ndim - 2], K = a->shape[a->ndim - 1], N = b->shape[b->ndim - 1], i;
    int64_t rsa = a->stride[a->ndim - 2], csa = a->stride[a->ndim - 1];
    int64_t rsb = b->stride[b->ndim - 2], csb = b->stride[b->ndim - 1];
    const float *A = (const float *)a->storage + a->offset, *B = (const float *)b->storage + b->offset;
    const float *G = nd->out->grad;
    float *GA = dtr__gradof(a), *GB = dtr__gradof(b);
    dtr__batch gb;
    dtr_tensor ca = *a, cb = *b;
    /* the gradients are dense: their batch offsets use dense strides */
    dtr__contig_strides(a->ndim, a->shape, ca.stride);
    dtr__contig_strides(b->ndim, b->shape, cb.stride);
    dtr__batch_make(a, b, &bt);
    dtr__batch_make(&ca, &cb, &gb);
    for (i = 0; i < bt.count; i++) {
        int64_t oa, ob, ga, gbo;
        const float *g = G + i * M * N;
        dtr__batch_offsets(&bt, i, &oa, &ob);
        dtr__batch_offsets(&gb, i, &ga, &gbo);
        /* dA (M, K) += G (M, N) B^T (N, K) */
        if (GA) dtr__gemm(ctx->pool, M, K, N, 1.0f, g, N, 1, B + ob, csb, rsb, 1.0f, GA + ga, K);
        /* dB (K, N) += A^T (K, M) G (M, N) */
        if (GB) dtr__gemm(ctx->pool, K, N, M, 1.0f, A + oa, csa, rsa, g, N, 1, 1.0f, GB + gbo, N);
    }
    return DTR_OK;
}

/* ---- linear ---- */

dtr_tensor *dtr_linear(dtr_context *ctx, dtr_tensor *x, dtr_tensor *w, dtr_tensor *bias) {
    dtr__node *n;
    int64_t shape[DTR_MAX_DIMS];
    char s1[96], s2[96];
    int d;
    if (!ctx) return NULL;
    if (!dtr__check_input(ctx, "dtr_linear", x, "x") || !dtr__check_input(ctx, "dtr_linear", w, "w")) return NULL;
    if (bias && !dtr__check_input(ctx, "dtr_linear", bias, "bias")) return NULL;
    if (x->ndim < 1 || w->ndim != 2 || x->shape[x->ndim - 1] != w->shape[1])
        return dtr__failt(ctx, DTR_SHAPE_MISMATCH, "dtr_linear: x %s does not fit weight %s (need x (..., in), w (out, in))",
                          dtr__shape_str(x, s1, sizeof s1), dtr__shape_str(w, s2, sizeof s2));
    if (bias && (bias->ndim != 1 || bias->shape[0] != w->shape[0]))
        return dtr__failt(ctx, DTR_SHAPE_MISMATCH, "dtr_linear: bias %s does not match %lld outputs",
                          dtr__shape_str(bias, s1, sizeof s1), (long long)w->shape[0]);
    x = dtr__contig_input(ctx, x);
    w = dtr__contig_input(ctx, w);
    if (!x || !w) return NULL;
    for (d = 0; d < x->ndim - 1; d++) shape[d] = x->shape[d];
    shape[x->ndim - 1] = w->shape[0];
    {
        dtr_tensor *in[3] = {x, w, bias};
        n = dtr__node_new(ctx, DTR_OP_LINEAR, bias ? 3 : 2, in);
    }
    if (!n) return NULL;
    n->out = dtr__tensor_alloc(ctx, DTR_F32, x->ndim, shape, "dtr_linear");
    if (!n->out) return NULL;
    return dtr__record(ctx, n, "dtr_linear");
}

dtr_result dtr__cpu_linear_fwd(dtr_context *ctx, dtr__node *nd) {
    const dtr_tensor *x = nd->in[0], *w = nd->in[1], *bias = nd->in[2];
    int64_t in = w->shape[1], out = w->shape[0], R = dtr_tensor_numel(x) / (in ? in : 1), r;
    float *Y = dtr__f32(nd->out);
    float beta = 0.0f;
    if (in == 0) R = dtr_tensor_numel(nd->out) / (out ? out : 1);
    if (bias) {
        const float *bv = dtr__f32(bias);
        for (r = 0; r < R; r++) memcpy(Y + r * out, bv, (size_t)out * sizeof(float));
        beta = 1.0f;
    }
    /* Y (R, out) = X (R, in) W^T (in, out) */
    dtr__gemm(ctx->pool, R, out, in, 1.0f, dtr__f32(x), in, 1, dtr__f32(w), 1, in, beta, Y, out);
    return DTR_OK;
}

dtr_result dtr__cpu_linear_bwd(dtr_context *ctx, dtr__node *nd) {
    const dtr_tensor *x = nd->in[0], *w = nd->in[1], *bias = nd->in[2];
    int64_t in = w->shape[1], out = w->shape[0], R = dtr_tensor_numel(nd->out) / (out ? out : 1), r, j;
    const float *G = nd->out->grad;
    float *gx = dtr__gradof(x), *gw = dtr__gradof(w), *gb = dtr__gradof(bias);
    /* dX (R, in) += G (R, out) W (out, in) */
    if (gx) dtr__gemm(ctx->pool, R, in, out, 1.0f, G, out, 1, dtr__f32(w), in, 1, 1.0f, gx, in);
    /* dW (out, in) += G^T (out, R) X (R, in) */
    if (gw) dtr__gemm(ctx->pool, out, in, R, 1.0f, G, 1, out, dtr__f32(x), in, 1, 1.0f, gw, in);
    if (gb) {
        for (r = 0; r < R; r++) {
            const float *g = G + r * out;
            for (j = 0; j < out; j++) gb[j] += g[j];
        }
    }
    return DTR_OK;
}
#line 6787 "dtrain.h"

/* ---- src/ops/ops_nn.c ---- */
#line 1 "src/ops/ops_nn.c"
/* ============================================================================
 * Neural-network ops: softmax family, cross-entropy, embedding, layer norm, dropout and the
 * causal self-attention composite.
 * Shapes: R rows of length C (all leading axes flattened), B batch, T time, H heads, D head dim.
 * ==========================================================================*/


#include <math.h>

static int64_t dtr__rows(const dtr_tensor *x) {
    int64_t c = x->ndim ? x->shape[x->ndim - 1] : 1;
    return c ? dtr_tensor_numel(x) / c : 0;
}

/* ---- softmax, log-softmax, causal softmax ---- */

static dtr_tensor *dtr__softmax_like(dtr_context *ctx, int op, const char *name, dtr_tensor *x) {
    dtr__node *n;
    char s1[96];
    if (!ctx) return NULL;
    if (!dtr__check_input(ctx, name, x, "x")) return NULL;
    if (x->ndim < 1) return dtr__failt(ctx, DTR_SHAPE_MISMATCH, "%s: x must have at least one axis", name);
    if (op == DTR_OP_SOFTMAX_CAUSAL && (x->ndim < 2 || x->shape[x->ndim - 1] != x->shape[x->ndim - 2]))
        return dtr__failt(ctx, DTR_SHAPE_MISMATCH, "%s: x %s must be (..., T, T)", name, dtr__shape_str(x, s1, sizeof s1));
    x = dtr__contig_input(ctx, x);
    if (!x) return NULL;
    n = dtr__node_new(ctx, op, 1, &x);
    if (!n) return NULL;
    n->out = dtr__tensor_alloc(ctx, DTR_F32, x->ndim, x->shape, name);
    if (!n->out) return NULL;
    return dtr__record(ctx, n, name);
}

dtr_tensor *dtr_softmax(dtr_context *ctx, dtr_tensor *x) { return dtr__softmax_like(ctx, DTR_OP_SOFTMAX, "dtr_softmax", x); }
dtr_tensor *dtr_log_softmax(dtr_context *ctx, dtr_tensor *x) { return dtr__softmax_like(ctx, DTR_OP_LOG_SOFTMAX, "dtr_log_softmax", x); }
dtr_tensor *dtr_softmax_causal(dtr_context *ctx, dtr_tensor *x) { return dtr__softmax_like(ctx, DTR_OP_SOFTMAX_CAUSAL, "dtr_softmax_causal", x); }

/* Row softmax of x[0..n) into y; `valid` leading entries take part, the rest get 0.
 * With logp set, writes log-probabilities instead. */
static void dtr__softmax_row(const float *x, float *y, int64_t n, int64_t valid, int logp) {
    float mx = -INFINITY;
    double s = 0.0;
    int64_t j;
    for (j = 0; j < valid; j++) if (x[j] > mx) mx = x[j];
    for (j = 0; j < valid; j++) s += exp((double)(x[j] - mx));
    if (logp) {
        float lse = mx + (float)log(s);
        for (j = 0; j < valid; j++) y[j] = x[j] - lse;
        for (; j < n; j++) y[j] = -INFINITY;
    } else {
        float inv = (float)(1.0 / s);
        for (j = 0; j < valid; j++) y[j] = expf(x[j] - mx) * inv;
        for (; j < n; j++) y[j] = 0.0f;
    }
}

typedef struct { const dtr__node *nd; int64_t C; } dtr__rows_job;

static void dtr__softmax_fwd_range(void *arg, int64_t b, int64_t e, int w) {
    const dtr__rows_job *j = (const dtr__rows_job *)arg;
    const float *x = dtr__f32(j->nd->in[0]);
    float *y = dtr__f32(j->nd->out);
    int64_t r, C = j->C;
    (void)w;
    for (r = b; r < e; r++) {
        int64_t valid = j->nd->op == DTR_OP_SOFTMAX_CAUSAL ? (r % C) + 1 : C;
        dtr__softmax_row(x + r * C, y + r * C, C, valid, j->nd->op == DTR_OP_LOG_SOFTMAX);
    }
}

static void dtr__softmax_bwd_range(void *arg, int64_t b, int64_t e, int w) {
    const dtr__rows_job *j = (const dtr__rows_job *)arg;
    const float *y = dtr__f32(j->nd->out), *g = j->nd->out->grad;
    float *gx = dtr__gradof(j->nd->in[0]);
    int64_t r, k, C = j->C;
    (void)w;
    for (r = b; r < e; r++) {
        const float *yr = y + r * C, *gr = g + r * C;
        float *gxr = gx + r * C;
        double s = 0.0;
        if (j->nd->op == DTR_OP_LOG_SOFTMAX) {
            for (k = 0; k < C; k++) s += gr[k];
            for (k = 0; k < C; k++) gxr[k] += gr[k] - expf(yr[k]) * (float)s;
        } else {
            for (k = 0; k < C; k++) s += (double)gr[k] * yr[k];
            for (k = 0; k < C; k++) gxr[k] += yr[k] * (gr[k] - (float)s);
        }
    }
}

dtr_result dtr__cpu_softmax_fwd(dtr_context *ctx, dtr__node *nd) {
    dtr__rows_job j;
    j.nd = nd;
    j.C = nd->in[0]->shape[nd->in[0]->ndim - 1];
    dtr__pool_run(ctx->pool, dtr__rows(nd->in[0]), 64, dtr__softmax_fwd_range, &j);
    return DTR_OK;
}

dtr_result dtr__cpu_softmax_bwd(dtr_context *ctx, dtr__node *nd) {
    dtr__rows_job j;
    if (!dtr__gradof(nd->in[0])) return DTR_OK;
    j.nd = nd;
    j.C = nd->in[0]->shape[nd->in[0]->ndim - 1];
    dtr__pool_run(ctx->pool, dtr__rows(nd->in[0]), 64, dtr__softmax_bwd_range, &j);
    return DTR_OK;
}

/* ---- cross-entropy on class indices ---- */

dtr__node *dtr__xent_node(dtr_context *ctx, int op, const char *name, dtr_tensor *logits, dtr_tensor *targets) {
    dtr__node *n;
    char s1[96], s2[96];
    if (!dtr__check_input(ctx, name, logits, "logits")) return NULL;
    if (!targets) return (dtr__node *)dtr__failt(ctx, DTR_NULL_HANDLE, "%s: targets is NULL", name);
    if (targets->dtype != DTR_I32)
        return (dtr__node *)dtr__failt(ctx, DTR_DTYPE_MISMATCH, "%s: targets must be i32 class indices, are %s", name,
                                       dtr_dtype_name(targets->dtype));
    if (logits->ndim < 1 || dtr__rows(logits) != dtr_tensor_numel(targets))
        return (dtr__node *)dtr__failt(ctx, DTR_SHAPE_MISMATCH, "%s: logits %s and targets %s disagree on the row count", name,
                                       dtr__shape_str(logits, s1, sizeof s1), dtr__shape_str(targets, s2, sizeof s2));
    logits = dtr__contig_input(ctx, logits);
    targets = dtr__contig_input(ctx, targets);
    if (!logits || !targets) return NULL;
    {
        dtr_tensor *in[2] = {logits, targets};
        n = dtr__node_new(ctx, op, 2, in);
    }
    if (!n) return NULL;
    n->out = dtr__tensor_alloc(ctx, DTR_F32, 0, NULL, name);
    return n->out ? n : NULL;
}

dtr_tensor *dtr_cross_entropy(dtr_context *ctx, dtr_tensor *logits, dtr_tensor *targets) {
    dtr__node *n;
    if (!ctx) return NULL;
    n = dtr__xent_node(ctx, DTR_OP_CROSS_ENTROPY, "dtr_cross_entropy", logits, targets);
    return n ? dtr__record(ctx, n, "dtr_cross_entropy") : NULL;
}

dtr_result dtr__cpu_cross_entropy_fwd(dtr_context *ctx, dtr__node *nd) {
    const dtr_tensor *x = nd->in[0];
    int64_t K = x->shape[x->ndim - 1], R = dtr__rows(x), r, k;
    const float *X = dtr__f32(x);
    const int32_t *t = dtr__i32(nd->in[1]);
    float *P;
    double loss = 0.0;
    for (r = 0; r < R; r++)
        if (t[r] < 0 || t[r] >= K)
            return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_cross_entropy: target %lld is %d, outside [0, %lld)",
                             (long long)r, (int)t[r], (long long)K);
    P = (float *)dtr__node_save(ctx, nd, (size_t)(R * K) * sizeof(float)); /* probabilities, for backward */
    if (!P) return ctx->status;
    nd->saved = P;
    for (r = 0; r < R; r++) {
        const float *xr = X + r * K;
        float *pr = P + r * K;
        float mx = -INFINITY;
        double s = 0.0;
        for (k = 0; k < K; k++) if (xr[k] > mx) mx = xr[k];
        for (k = 0; k < K; k++) { pr[k] = expf(xr[k] - mx); s += pr[k]; }
        for (k = 0; k < K; k++) pr[k] = (float)(pr[k] / s);
        loss += (double)mx + log(s) - xr[t[r]];
    }
    dtr__f32(nd->out)[0] = R ? (float)(loss / (double)R) : 0.0f;
    return DTR_OK;
}

dtr_result dtr__cpu_cross_entropy_bwd(dtr_context *ctx, dtr__node *nd) {
    const dtr_tensor *x = nd->in[0];
    int64_t K = x->shape[x->ndim - 1], R = dtr__rows(x), r, k;
    const int32_t *t = dtr__i32(nd->in[1]);
    const float *P = (const float *)nd->saved;
    float *gx = dtr__gradof(x), c;
    (void)ctx;
    if (!gx || !R) return DTR_OK;
    c = nd->out->grad[0] / (float)R;
    for (r = 0; r < R; r++) {
        for (k = 0; k < K; k++) gx[r * K + k] += c * P[r * K + k];
        gx[r * K + t[r]] -= c;
    }
    return DTR_OK;
}

/* ---- embedding ---- */

dtr_tensor *dtr_embedding(dtr_context *ctx, dtr_tensor *table, dtr_tensor *ids) {
    dtr__node *n;
    int64_t shape[DTR_MAX_DIMS];
    char s1[96];
    int d;
    if (!ctx) return NULL;
    if (!dtr__check_input(ctx, "dtr_embedding", table, "table")) return NULL;
    if (!ids) return dtr__failt(ctx, DTR_NULL_HANDLE, "dtr_embedding: ids is NULL");
    if (ids->dtype != DTR_I32) return dtr__failt(ctx, DTR_DTYPE_MISMATCH, "dtr_embedding: ids must be i32");
    if (table->ndim != 2 || ids->ndim + 1 > DTR_MAX_DIMS)
        return dtr__failt(ctx, DTR_SHAPE_MISMATCH, "dtr_embedding: table %s must be (V, C)", dtr__shape_str(table, s1, sizeof s1));
    table = dtr__contig_input(ctx, table);
    ids = dtr__contig_input(ctx, ids);
    if (!table || !ids) return NULL;
    for (d = 0; d < ids->ndim; d++) shape[d] = ids->shape[d];
    shape[ids->ndim] = table->shape[1];
    {
        dtr_tensor *in[2] = {table, ids};
        n = dtr__node_new(ctx, DTR_OP_EMBEDDING, 2, in);
    }
    if (!n) return NULL;
    n->out = dtr__tensor_alloc(ctx, DTR_F32, ids->ndim + 1, shape, "dtr_embedding");
    if (!n->out) return NULL;
    return dtr__record(ctx, n, "dtr_embedding");
}

dtr_result dtr__cpu_embedding_fwd(dtr_context *ctx, dtr__node *nd) {
    int64_t C = nd->in[0]->shape[1], N = dtr_tensor_numel(nd->in[1]), i;
    const float *W = dtr__f32(nd->in[0]);
    const int32_t *id = dtr__i32(nd->in[1]);
    float *Y = dtr__f32(nd->out);
    int64_t V = nd->in[0]->shape[0];
    for (i = 0; i < N; i++)
        if (id[i] < 0 || id[i] >= V)
            return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_embedding: id %lld is %d, outside [0, %lld)",
                             (long long)i, (int)id[i], (long long)V);
    for (i = 0; i < N; i++) memcpy(Y + i * C, W + (int64_t)id[i] * C, (size_t)C * sizeof(float));
    return DTR_OK;
}

dtr_result dtr__cpu_embedding_bwd(dtr_context *ctx, dtr__node *nd) {
    int64_t C = nd->in[0]->shape[1], N = dtr_tensor_numel(nd->in[1]), i, k;
    const int32_t *id = dtr__i32(nd->in[1]);
    const float *G = nd->out->grad;
    float *gw = dtr__gradof(nd->in[0]);
    (void)ctx;
    if (!gw) return DTR_OK;
    for (i = 0; i < N; i++) {
        float *row = gw + (int64_t)id[i] * C;
        for (k = 0; k < C; k++) row[k] += G[i * C + k];
    }
    return DTR_OK;
}

/* ---- layer norm ---- */

dtr_tensor *dtr_layernorm(dtr_context *ctx, dtr_tensor *x, dtr_tensor *w, dtr_tensor *b, float eps) {
    dtr__node *n;
    int64_t C;
    char s1[96], s2[96];
    if (!ctx) return NULL;
    if (!dtr__check_input(ctx, "dtr_layernorm", x, "x")) return NULL;
    if (w && !dtr__check_input(ctx, "dtr_layernorm", w, "weight")) return NULL;
    if (b && !dtr__check_input(ctx, "dtr_layernorm", b, "bias")) return NULL;
    if (x->ndim < 1) return dtr__failt(ctx, DTR_SHAPE_MISMATCH, "dtr_layernorm: x must have at least one axis");
    C = x->shape[x->ndim - 1];
    if ((w && (w->ndim != 1 || w->shape[0] != C)) || (b && (b->ndim != 1 || b->shape[0] != C)))
        return dtr__failt(ctx, DTR_SHAPE_MISMATCH, "dtr_layernorm: weight/bias %s must be (%lld) for x %s",
                          dtr__shape_str(w ? w : b, s1, sizeof s1), (long long)C, dtr__shape_str(x, s2, sizeof s2));
    if (!(eps > 0.0f)) return dtr__failt(ctx, DTR_INVALID_ARGUMENT, "dtr_layernorm: eps must be > 0");
    x = dtr__contig_input(ctx, x);
    if (!x) return NULL;
    {
        dtr_tensor *in[3] = {x, w, b};
        n = dtr__node_new(ctx, DTR_OP_LAYERNORM, 3, in);
    }
    if (!n) return NULL;
    n->p.eps = eps;
    n->out = dtr__tensor_alloc(ctx, DTR_F32, x->ndim, x->shape, "dtr_layernorm");
    if (!n->out) return NULL;
    return dtr__record(ctx, n, "dtr_layernorm");
}

dtr_result dtr__cpu_layernorm_fwd(dtr_context *ctx, dtr__node *nd) {
    const dtr_tensor *x = nd->in[0];
    int64_t C = x->shape[x->ndim - 1], R = dtr__rows(x), r, k;
    const float *X = dtr__f32(x), *W = nd->in[1] ? dtr__f32(nd->in[1]) : NULL, *B = nd->in[2] ? dtr__f32(nd->in[2]) : NULL;
    float *Y = dtr__f32(nd->out);
    float *stat = (float *)dtr__node_save(ctx, nd, (size_t)R * 2 * sizeof(float)); /* mean, rstd per row */
    if (!stat) return ctx->status;
    nd->saved = stat;
    for (r = 0; r < R; r++) {
        const float *xr = X + r * C;
        float *yr = Y + r * C;
        double m = 0.0, v = 0.0;
        float mean, rstd;
        for (k = 0; k < C; k++) m += xr[k];
        m /= (double)C;
        for (k = 0; k < C; k++) { double d = xr[k] - m; v += d * d; }
        v /= (double)C;
        mean = (float)m;
        rstd = (float)(1.0 / sqrt(v + nd->p.eps));
        for (k = 0; k < C; k++) {
            float h = (xr[k] - mean) * rstd;
            yr[k] = (W ? W[k] : 1.0f) * h + (B ? B[k] : 0.0f);
        }
        stat[2 * r] = mean;
        stat[2 * r + 1] = rstd;
    }
    return DTR_OK;
}

dtr_result dtr__cpu_layernorm_bwd(dtr_context *ctx, dtr__node *nd) {
    const dtr_tensor *x = nd->in[0];
    int64_t C = x->shape[x->ndim - 1], R = dtr__rows(x), r, k;
    const float *X = dtr__f32(x), *W = nd->in[1] ? dtr__f32(nd->in[1]) : NULL, *G = nd->out->grad;
    const float *stat = (const float *)nd->saved;
    float *gx = dtr__gradof(x), *gw = dtr__gradof(nd->in[1]), *gb = dtr__gradof(nd->in[2]);
    (void)ctx;
    for (r = 0; r < R; r++) {
        const float *xr = X + r * C, *gr = G + r * C;
        float mean = stat[2 * r], rstd = stat[2 * r + 1];
        double sd = 0.0, sdh = 0.0;
        for (k = 0; k < C; k++) {
            float h = (xr[k] - mean) * rstd, dh = gr[k] * (W ? W[k] : 1.0f);
            sd += dh;
            sdh += (double)dh * h;
            if (gw) gw[k] += gr[k] * h;
            if (gb) gb[k] += gr[k];
        }
        if (gx) {
            float md = (float)(sd / (double)C), mdh = (float)(sdh / (double)C);
            float *gxr = gx + r * C;
            for (k = 0; k < C; k++) {
                float h = (xr[k] - mean) * rstd, dh = gr[k] * (W ? W[k] : 1.0f);
                gxr[k] += rstd * (dh - md - h * mdh);
            }
        }
    }
    return DTR_OK;
}

/* ---- dropout ---- */

dtr_tensor *dtr_dropout(dtr_context *ctx, dtr_tensor *x, float p) {
    dtr__node *n;
    if (!ctx) return NULL;
    if (!dtr__check_input(ctx, "dtr_dropout", x, "x")) return NULL;
    if (!(p >= 0.0f && p < 1.0f)) return dtr__failt(ctx, DTR_INVALID_ARGUMENT, "dtr_dropout: p = %g outside [0, 1)", (double)p);
    if (!ctx->training || p == 0.0f) return x;
    x = dtr__contig_input(ctx, x);
    if (!x) return NULL;
    n = dtr__node_new(ctx, DTR_OP_DROPOUT, 1, &x);
    if (!n) return NULL;
    /* the op takes the next numel(x) draws of the context's seeded stream, so runs repeat on
       any backend; the backend draws them */
    n->p.dropout.p = p;
    n->p.dropout.rng = ctx->rng;
    dtr__rng_advance(&ctx->rng, (uint64_t)dtr_tensor_numel(x));
    n->out = dtr__tensor_alloc(ctx, DTR_F32, x->ndim, x->shape, "dtr_dropout");
    if (!n->out) return NULL;
    return dtr__record(ctx, n, "dtr_dropout");
}

dtr_result dtr__cpu_dropout_fwd(dtr_context *ctx, dtr__node *nd) {
    int64_t i, N = dtr_tensor_numel(nd->out);
    const float *x = dtr__f32(nd->in[0]);
    float *y = dtr__f32(nd->out), *m, p = nd->p.dropout.p;
    dtr_rng rng = nd->p.dropout.rng;
    m = (float *)dtr__node_save(ctx, nd, (size_t)N * sizeof(float)); /* the mask, for backward */
    if (!m) return ctx->status;
    nd->saved = m;
    for (i = 0; i < N; i++) m[i] = dtr_rng_uniform(&rng) < p ? 0.0f : 1.0f / (1.0f - p);
    for (i = 0; i < N; i++) y[i] = x[i] * m[i];
    return DTR_OK;
}

dtr_result dtr__cpu_dropout_bwd(dtr_context *ctx, dtr__node *nd) {
    int64_t i, N = dtr_tensor_numel(nd->out);
    const float *g = nd->out->grad, *m = (const float *)nd->saved;
    float *gx = dtr__gradof(nd->in[0]);
    (void)ctx;
    if (gx) for (i = 0; i < N; i++) gx[i] += g[i] * m[i];
    return DTR_OK;
}

/* ---- causal self-attention (composite) ---- */

dtr_tensor *dtr_attention(dtr_context *ctx, dtr_tensor *q, dtr_tensor *k, dtr_tensor *v, int heads) {
    static const int to_heads[4] = {0, 2, 1, 3}; /* (B, T, H, D) -> (B, H, T, D) */
    int64_t B, T, C, D, shape[4];
    dtr_tensor *qh, *kh, *vh, *att, *y;
    char s1[96], s2[96], s3[96];
    if (!ctx) return NULL;
    if (!dtr__check_input(ctx, "dtr_attention", q, "q") || !dtr__check_input(ctx, "dtr_attention", k, "k") ||
        !dtr__check_input(ctx, "dtr_attention", v, "v"))
        return NULL;
    if (q->ndim != 3 || k->ndim != 3 || v->ndim != 3 || memcmp(q->shape, k->shape, 3 * sizeof(int64_t)) ||
        memcmp(q->shape, v->shape, 3 * sizeof(int64_t)))
        return dtr__failt(ctx, DTR_SHAPE_MISMATCH, "dtr_attention: q %s, k %s, v %s must all be (B, T, C)",
                          dtr__shape_str(q, s1, sizeof s1), dtr__shape_str(k, s2, sizeof s2), dtr__shape_str(v, s3, sizeof s3));
    B = q->shape[0]; T = q->shape[1]; C = q->shape[2];
    if (heads <= 0 || C % heads)
        return dtr__failt(ctx, DTR_INVALID_ARGUMENT, "dtr_attention: %d heads do not divide C = %lld", heads, (long long)C);
    D = C / heads;
    shape[0] = B; shape[1] = T; shape[2] = heads; shape[3] = D;
    qh = dtr_permute(ctx, dtr_reshape(ctx, q, 4, shape), to_heads);          /* (B, H, T, D) */
    kh = dtr_permute(ctx, dtr_reshape(ctx, k, 4, shape), to_heads);
    vh = dtr_permute(ctx, dtr_reshape(ctx, v, 4, shape), to_heads);
    att = dtr_matmul(ctx, qh, dtr_transpose(ctx, kh, 2, 3));                  /* (B, H, T, T) */
    att = dtr_softmax_causal(ctx, dtr_scale(ctx, att, 1.0f / sqrtf((float)D)));
    y = dtr_matmul(ctx, att, vh);                                             /* (B, H, T, D) */
    y = dtr_contiguous(ctx, dtr_permute(ctx, y, to_heads));                   /* (B, T, H, D) */
    shape[2] = C;
    return dtr_reshape(ctx, y, 3, shape);
}
#line 7192 "dtrain.h"

/* ---- src/ops/ops_conv.c ---- */
#line 1 "src/ops/ops_conv.c"
/* ============================================================================
 * Convolution and pooling over images. Shapes: x (N, C, H, W), w (O, C, KH, KW),
 * y (N, O, Ho, Wo) with Ho = (H + 2P - KH) / S + 1. Convolution is im2col + GEMM: the
 * column matrix of sample n is (C*KH*KW, Ho*Wo), kept for the backward pass when the op is
 * recorded on the tape; otherwise (inference, frozen layers) each worker reuses one.
 * ==========================================================================*/


#include <math.h>

/* ---- im2col / col2im ---- */

typedef struct dtr__conv_geom {
    int64_t N, C, H, W, O, KH, KW, Ho, Wo, S, P;
} dtr__conv_geom;

/* Reference loops: any stride and padding. */
static void dtr__im2col_ref(const dtr__conv_geom *g, const float *x, float *col) {
    int64_t c, ki, kj, oi, oj;
    for (c = 0; c < g->C; c++)
        for (ki = 0; ki < g->KH; ki++)
            for (kj = 0; kj < g->KW; kj++) {
                float *row = col + ((c * g->KH + ki) * g->KW + kj) * g->Ho * g->Wo;
                for (oi = 0; oi < g->Ho; oi++) {
                    int64_t ii = oi * g->S - g->P + ki;
                    float *r = row + oi * g->Wo;
                    if (ii < 0 || ii >= g->H) { for (oj = 0; oj < g->Wo; oj++) r[oj] = 0.0f; continue; }
                    for (oj = 0; oj < g->Wo; oj++) {
                        int64_t jj = oj * g->S - g->P + kj;
                        r[oj] = (jj >= 0 && jj < g->W) ? x[(c * g->H + ii) * g->W + jj] : 0.0f;
                    }
                }
            }
}

static void dtr__col2im_add_ref(const dtr__conv_geom *g, const float *col, float *gx) {
    int64_t c, ki, kj, oi, oj;
    for (c = 0; c < g->C; c++)
        for (ki = 0; ki < g->KH; ki++)
            for (kj = 0; kj < g->KW; kj++) {
                const float *row = col + ((c * g->KH + ki) * g->KW + kj) * g->Ho * g->Wo;
                for (oi = 0; oi < g->Ho; oi++) {
                    int64_t ii = oi * g->S - g->P + ki;
                    if (ii < 0 || ii >= g->H) continue;
                    for (oj = 0; oj < g->Wo; oj++) {
                        int64_t jj = oj * g->S - g->P + kj;
                        if (jj >= 0 && jj < g->W) gx[(c * g->H + ii) * g->W + jj] += row[oi * g->Wo + oj];
                    }
                }
            }
}

/* Stride 1 (any padding): for tap (ki, kj) output column oj reads input column oj - P + kj,
 * so each output row is one contiguous run of the input row between zero margins
 * [0, j0) and [j1, Wo). Same results as the reference loops (copies and the same order of
 * additions), without per-element bounds checks. */
static void dtr__conv_s1_cols(const dtr__conv_geom *g, int64_t kj, int64_t *j0, int64_t *j1) {
    int64_t a = g->P - kj, b = g->W + g->P - kj;   /* valid oj: a <= oj < b */
    *j0 = a < 0 ? 0 : (a > g->Wo ? g->Wo : a);
    *j1 = b > g->Wo ? g->Wo : (b < *j0 ? *j0 : b);
}

/* d[0..n) = s[0..n) and d[0..n) += s[0..n) for the short runs of im2col / col2im: 8 at a
 * time through a local array, which compilers turn into vector loads and stores at -O2
 * (a memcpy call costs more than the copy for runs of 10 to 30 floats). */
static void dtr__conv_copy(float *d, const float *s, int64_t n) {
    int64_t i;
    int k;
    for (i = 0; i + 8 <= n; i += 8) {
        float t[8];
        for (k = 0; k < 8; k++) t[k] = s[i + k];
        for (k = 0; k < 8; k++) d[i + k] = t[k];
    }
    for (; i < n; i++) d[i] = s[i];
}

static void dtr__conv_add(float *d, const float *s, int64_t n) {
    int64_t i;
    int k;
    for (i = 0; i + 8 <= n; i += 8) {
        float t[8], u[8];
        for (k = 0; k < 8; k++) { t[k] = d[i + k]; u[k] = s[i + k]; }
        for (k = 0; k < 8; k++) t[k] += u[k];
        for (k = 0; k < 8; k++) d[i + k] = t[k];
    }
    for (; i < n; i++) d[i] += s[i];
}

static void dtr__im2col(const dtr__conv_geom *g, const float *x, float *col) {
    int64_t c, ki, kj, oi, oj, j0, j1;
    if (g->S != 1) { dtr__im2col_ref(g, x, col); return; }
    for (c = 0; c < g->C; c++)
        for (ki = 0; ki < g->KH; ki++)
            for (kj = 0; kj < g->KW; kj++) {
                float *row = col + ((c * g->KH + ki) * g->KW + kj) * g->Ho * g->Wo;
                dtr__conv_s1_cols(g, kj, &j0, &j1);
                for (oi = 0; oi < g->Ho; oi++) {
                    int64_t ii = oi - g->P + ki;
                    float *r = row + oi * g->Wo;
                    if (ii < 0 || ii >= g->H) { memset(r, 0, (size_t)g->Wo * sizeof(float)); continue; }
                    for (oj = 0; oj < j0; oj++) r[oj] = 0.0f;
                    if (j1 > j0) dtr__conv_copy(r + j0, x + (c * g->H + ii) * g->W + (j0 - g->P + kj), j1 - j0);
                    for (oj = j1; oj < g->Wo; oj++) r[oj] = 0.0f;
                }
            }
}

static void dtr__col2im_add(const dtr__conv_geom *g, const float *col, float *gx) {
    int64_t c, ki, kj, oi, j0, j1;
    if (g->S != 1) { dtr__col2im_add_ref(g, col, gx); return; }
    for (c = 0; c < g->C; c++)
        for (ki = 0; ki < g->KH; ki++)
            for (kj = 0; kj < g->KW; kj++) {
                const float *row = col + ((c * g->KH + ki) * g->KW + kj) * g->Ho * g->Wo;
                dtr__conv_s1_cols(g, kj, &j0, &j1);
                for (oi = 0; oi < g->Ho; oi++) {
                    int64_t ii = oi - g->P + ki;
                    const float *r = row + oi * g->Wo + j0;
                    float *d;
                    if (ii < 0 || ii >= g->H || j1 <= j0) continue;
                    d = gx + (c * g->H + ii) * g->W + (j0 - g->P + kj);   /* input column of output column j0 */
                    dtr__conv_add(d, r, j1 - j0);
                }
            }
}

static void dtr__conv_geom_of(const dtr__node *nd, dtr__conv_geom *g) {
    const dtr_tensor *x = nd->in[0], *w = nd->in[1];
    g->N = x->shape[0]; g->C = x->shape[1]; g->H = x->shape[2]; g->W = x->shape[3];
    g->O = w->shape[0]; g->KH = w->shape[2]; g->KW = w->shape[3];
    g->S = nd->p.conv2d.stride; g->P = nd->p.conv2d.padding;
    g->Ho = nd->out->shape[2]; g->Wo = nd->out->shape[3];
}

/* ---- conv2d ---- */

dtr_tensor *dtr_conv2d(dtr_context *ctx, dtr_tensor *x, dtr_tensor *w, dtr_tensor *bias, int stride, int padding) {
    dtr__node *n;
    int64_t shape[4], Ho, Wo;
    char s1[96], s2[96];
    if (!ctx) return NULL;
    if (!dtr__check_input(ctx, "dtr_conv2d", x, "x") || !dtr__check_input(ctx, "dtr_conv2d", w, "w")) return NULL;
    if (bias && !dtr__check_input(ctx, "dtr_conv2d", bias, "bias")) return NULL;
    if (x->ndim != 4 || w->ndim != 4 || x->shape[1] != w->shape[1])
        return dtr__failt(ctx, DTR_SHAPE_MISMATCH, "dtr_conv2d: x %s and w %s must be (N, C, H, W) and (O, C, KH, KW)",
                          dtr__shape_str(x, s1, sizeof s1), dtr__shape_str(w, s2, sizeof s2));
    if (bias && (bias->ndim != 1 || bias->shape[0] != w->shape[0]))
        return dtr__failt(ctx, DTR_SHAPE_MISMATCH, "dtr_conv2d: bias %s must be (%lld)", dtr__shape_str(bias, s1, sizeof s1),
                          (long long)w->shape[0]);
    if (stride < 1 || padding < 0)
        return dtr__failt(ctx, DTR_INVALID_ARGUMENT, "dtr_conv2d: stride %d must be >= 1 and padding %d >= 0", stride, padding);
    Ho = (x->shape[2] + 2 * padding - w->shape[2]) / stride + 1;
    Wo = (x->shape[3] + 2 * padding - w->shape[3]) / stride + 1;
    if (x->shape[2] + 2 * padding < w->shape[2] || x->shape[3] + 2 * padding < w->shape[3] || Ho < 1 || Wo < 1)
        return dtr__failt(ctx, DTR_SHAPE_MISMATCH, "dtr_conv2d: kernel %s larger than the padded input %s",
                          dtr__shape_str(w, s1, sizeof s1), dtr__shape_str(x, s2, sizeof s2));
    x = dtr__contig_input(ctx, x);
    w = dtr__contig_input(ctx, w);
    if (!x || !w) return NULL;
    shape[0] = x->shape[0]; shape[1] = w->shape[0]; shape[2] = Ho; shape[3] = Wo;
    {
        dtr_tensor *in[3] = {x, w, bias};
        n = dtr__node_new(ctx, DTR_OP_CONV2D, bias ? 3 : 2, in);
    }
    if (!n) return NULL;
    n->p.conv2d.stride = stride;
    n->p.conv2d.padding = padding;
    n->out = dtr__tensor_alloc(ctx, DTR_F32, 4, shape, "dtr_conv2d");
    if (!n->out) return NULL;
    return dtr__record(ctx, n, "dtr_conv2d");
}

typedef struct {
    const dtr__node *nd;
    dtr__conv_geom g;
    dtr__pool *pool;
    float *gcol;      /* backward: per-worker column gradients */
    int split_cols;   /* backward: dW split over columns (1) or output channels (0) */
} dtr__conv_job;

/* y[0..n) = v; 8 at a time from a local array (vector stores without -O3). */
static void dtr__conv_fill(float *y, int64_t n, float v) {
    float t[8];
    int64_t i;
    int k;
    for (k = 0; k < 8; k++) t[k] = v;
    for (i = 0; i + 8 <= n; i += 8) memcpy(y + i, t, sizeof t);
    for (; i < n; i++) y[i] = v;
}

static void dtr__conv_fwd_range(void *arg, int64_t b, int64_t e, int worker) {
    const dtr__conv_job *j = (const dtr__conv_job *)arg;
    const dtr__conv_geom *g = &j->g;
    const float *X = dtr__f32(j->nd->in[0]), *Wt = dtr__f32(j->nd->in[1]);
    const float *bias = j->nd->in[2] ? dtr__f32(j->nd->in[2]) : NULL;
    float *Y = dtr__f32(j->nd->out), *COL = (float *)j->nd->saved;
    int64_t ckk = g->C * g->KH * g->KW, P = g->Ho * g->Wo, n, o;
    for (n = b; n < e; n++) {
        float *col = COL + (j->nd->taped ? n : worker) * ckk * P, *y = Y + n * g->O * P;
        dtr__im2col(g, X + n * g->C * g->H * g->W, col);
        for (o = 0; o < g->O; o++) dtr__conv_fill(y + o * P, P, bias ? bias[o] : 0.0f);
        /* y (O, P) += W (O, ckk) col (ckk, P) */
        dtr__gemm_on(j->pool, worker, g->O, P, ckk, 1.0f, Wt, ckk, 1, col, P, 1, 1.0f, y, P);
    }
}

dtr_result dtr__cpu_conv2d_fwd(dtr_context *ctx, dtr__node *nd) {
    dtr__conv_job j;
    int64_t ncol;
    memset(&j, 0, sizeof j);
    j.nd = nd;
    j.pool = ctx->pool;
    dtr__conv_geom_of(nd, &j.g);
    /* im2col columns: one matrix per sample when backward will reuse them, else one per worker */
    ncol = nd->taped ? j.g.N : dtr__pool_threads(ctx->pool);
    nd->saved = dtr__node_save(ctx, nd, (size_t)(ncol * j.g.C * j.g.KH * j.g.KW * j.g.Ho * j.g.Wo) * sizeof(float));
    if (!nd->saved) return ctx->status;
    dtr__pool_run(ctx->pool, j.g.N, 1, dtr__conv_fwd_range, &j);
    return DTR_OK;
}

/* Sum of x[0..n) in a fixed order: 8 running sums (element i goes to sum i mod 8, which
 * compilers keep in one SIMD register) added pairwise at the end, then the tail. */
static float dtr__conv_sum(const float *x, int64_t n) {
    float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f}, s;
    int64_t i;
    int k;
    for (i = 0; i + 8 <= n; i += 8)
        for (k = 0; k < 8; k++) acc[k] += x[i + k];
    s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; i < n; i++) s += x[i];
    return s;
}

/* dW and db. Each worker owns a slab of dW and sums over the samples in one fixed order, so
 * any split gives the same bits. The slab is a range of output channels (rows; every worker
 * packs all columns of each sample) or, when there are fewer output channels than C*KH*KW,
 * a range of columns (every worker packs the smaller gy instead). The bias rows are split
 * in proportion to the units. */
static void dtr__conv_bwd_w_range(void *arg, int64_t b, int64_t e, int worker) {
    const dtr__conv_job *j = (const dtr__conv_job *)arg;
    const dtr__conv_geom *g = &j->g;
    const float *G = j->nd->out->grad, *COL = (const float *)j->nd->saved;
    float *gw = dtr__gradof(j->nd->in[1]), *gb = dtr__gradof(j->nd->in[2]);
    int64_t ckk = g->C * g->KH * g->KW, P = g->Ho * g->Wo, n, o, o0 = b, o1 = e;
    if (j->split_cols) { o0 = b * g->O / ckk; o1 = e * g->O / ckk; }
    for (n = 0; n < g->N; n++) {
        const float *gy = G + n * g->O * P, *col = COL + n * ckk * P;
        if (gw && j->split_cols)   /* dW[:, b:e] (O, e-b) += gy (O, P) col[b:e]^T (P, e-b) */
            dtr__gemm_on(j->pool, worker, g->O, e - b, P, 1.0f, gy, P, 1, col + b * P, 1, P, 1.0f, gw + b, ckk);
        else if (gw)               /* dW[b:e] (e-b, ckk) += gy[b:e] (e-b, P) col^T (P, ckk) */
            dtr__gemm_on(j->pool, worker, e - b, ckk, P, 1.0f, gy + b * P, P, 1, col, 1, P, 1.0f, gw + b * ckk, ckk);
        if (gb)
            for (o = o0; o < o1; o++) gb[o] += dtr__conv_sum(gy + o * P, P);
    }
}

/* dX, split over samples; each worker has its own column-gradient buffer in j->gcol. */
static void dtr__conv_bwd_x_range(void *arg, int64_t b, int64_t e, int worker) {
    const dtr__conv_job *j = (const dtr__conv_job *)arg;
    const dtr__conv_geom *g = &j->g;
    const float *G = j->nd->out->grad, *Wt = dtr__f32(j->nd->in[1]);
    float *gx = dtr__gradof(j->nd->in[0]);
    int64_t ckk = g->C * g->KH * g->KW, P = g->Ho * g->Wo, n;
    float *gcol = j->gcol + (int64_t)worker * ckk * P;
    for (n = b; n < e; n++) {
        /* gcol (ckk, P) = W^T (ckk, O) gy (O, P) */
        dtr__gemm_on(j->pool, worker, ckk, P, g->O, 1.0f, Wt, 1, ckk, G + n * g->O * P, P, 1, 0.0f, gcol, P);
        dtr__col2im_add(g, gcol, gx + n * g->C * g->H * g->W);
    }
}

dtr_result dtr__cpu_conv2d_bwd(dtr_context *ctx, dtr__node *nd) {
    dtr__conv_job j;
    memset(&j, 0, sizeof j);
    j.nd = nd;
    j.pool = ctx->pool;
    dtr__conv_geom_of(nd, &j.g);
    j.split_cols = j.g.O < j.g.C * j.g.KH * j.g.KW;
    if (dtr__gradof(nd->in[1]) || dtr__gradof(nd->in[2]))
        dtr__pool_run(ctx->pool, j.split_cols ? j.g.C * j.g.KH * j.g.KW : j.g.O, 1, dtr__conv_bwd_w_range, &j);
    if (dtr__gradof(nd->in[0])) {
        size_t per = (size_t)(j.g.C * j.g.KH * j.g.KW * j.g.Ho * j.g.Wo);
        j.gcol = (float *)dtr__arena_data(ctx, per * (size_t)dtr__pool_threads(ctx->pool) * sizeof(float), "dtr_conv2d backward");
        if (!j.gcol) return ctx->status;
        dtr__pool_run(ctx->pool, j.g.N, 1, dtr__conv_bwd_x_range, &j);
    }
    return DTR_OK;
}

/* ---- pooling ---- */

static dtr_tensor *dtr__pool2d(dtr_context *ctx, int op, const char *name, dtr_tensor *x, int k, int stride, int padding) {
    dtr__node *n;
    int64_t shape[4];
    char s1[96];
    if (!ctx) return NULL;
    if (!dtr__check_input(ctx, name, x, "x")) return NULL;
    if (x->ndim != 4) return dtr__failt(ctx, DTR_SHAPE_MISMATCH, "%s: x %s must be (N, C, H, W)", name, dtr__shape_str(x, s1, sizeof s1));
    if (stride == 0) stride = k;
    if (k < 1 || stride < 1 || padding < 0 || 2 * padding > k)
        return dtr__failt(ctx, DTR_INVALID_ARGUMENT, "%s: window %d, stride %d, padding %d are invalid", name, k, stride, padding);
    if (x->shape[2] + 2 * padding < k || x->shape[3] + 2 * padding < k)
        return dtr__failt(ctx, DTR_SHAPE_MISMATCH, "%s: window %d larger than the input %s", name, k, dtr__shape_str(x, s1, sizeof s1));
    x = dtr__contig_input(ctx, x);
    if (!x) return NULL;
    shape[0] = x->shape[0]; shape[1] = x->shape[1];
    shape[2] = (x->shape[2] + 2 * padding - k) / stride + 1;
    shape[3] = (x->shape[3] + 2 * padding - k) / stride + 1;
    n = dtr__node_new(ctx, op, 1, &x);
    if (!n) return NULL;
    n->p.pool2d.k = k; n->p.pool2d.stride = stride; n->p.pool2d.padding = padding;
    n->out = dtr__tensor_alloc(ctx, DTR_F32, 4, shape, name);
    if (!n->out) return NULL;
    return dtr__record(ctx, n, name);
}

dtr_tensor *dtr_maxpool2d(dtr_context *ctx, dtr_tensor *x, int k, int stride, int padding) {
    return dtr__pool2d(ctx, DTR_OP_MAXPOOL2D, "dtr_maxpool2d", x, k, stride, padding);
}
dtr_tensor *dtr_avgpool2d(dtr_context *ctx, dtr_tensor *x, int k, int stride, int padding) {
    return dtr__pool2d(ctx, DTR_OP_AVGPOOL2D, "dtr_avgpool2d", x, k, stride, padding);
}

/* Pooling kernels run over the N*C planes in parallel: a plane's output and its input
 * gradient depend on that plane only, so any split gives the same bits. */
typedef struct {
    const dtr__node *nd;
    int64_t H, W, Ho, Wo, k, S, P;
} dtr__pool2d_job;

/* Reference loops: any window, stride and padding; max keeps the first largest value. */
static void dtr__pool2d_fwd_ref(const dtr__pool2d_job *j, int64_t c0, int64_t c1) {
    int64_t H = j->H, W = j->W, Ho = j->Ho, Wo = j->Wo, k = j->k, S = j->S, P = j->P;
    int64_t c, oi, oj, a, b;
    const float *X = dtr__f32(j->nd->in[0]);
    float *Y = dtr__f32(j->nd->out);
    int32_t *arg = (int32_t *)j->nd->saved;
    int maxp = j->nd->op == DTR_OP_MAXPOOL2D;
    for (c = c0; c < c1; c++) {
        const float *xc = X + c * H * W;
        for (oi = 0; oi < Ho; oi++)
            for (oj = 0; oj < Wo; oj++) {
                float best = -INFINITY, s = 0.0f;
                int32_t bi = -1;
                for (a = 0; a < k; a++) {
                    int64_t ii = oi * S - P + a;
                    if (ii < 0 || ii >= H) continue;
                    for (b = 0; b < k; b++) {
                        int64_t jj = oj * S - P + b;
                        float v;
                        if (jj < 0 || jj >= W) continue;
                        v = xc[ii * W + jj];
                        s += v;
                        if (v > best || bi < 0 || v != v) { best = v; bi = (int32_t)(ii * W + jj); } /* NaN wins */
                    }
                }
                if (maxp) { Y[(c * Ho + oi) * Wo + oj] = best; arg[(c * Ho + oi) * Wo + oj] = bi; }
                else Y[(c * Ho + oi) * Wo + oj] = s / (float)(k * k);
            }
    }
}

/* v replaces the window's best so far when larger, or when it is NaN (NaN propagates, and
 * its index is the one backward uses, as in PyTorch). */
#define DTR__MAX_TAKES(v, best) ((v) > (best) || (v) != (v))

/* One 2x2 window per lane: a b / c d. with_nan 0: plain compares (no lane holds a NaN);
 * 1: the NaN-aware rule of the reference. Two loops, each branch-free, so both vectorise. */
static void dtr__maxpool2_lanes(const float *a, const float *b, const float *c, const float *d, float *best,
                                int32_t *bi, int32_t j0, int32_t W, int with_nan) {
    int k;
    for (k = 0; k < 8; k++) { best[k] = a[k]; bi[k] = j0 + 2 * k; }
    if (with_nan) {
        for (k = 0; k < 8; k++) {
            bi[k] = DTR__MAX_TAKES(b[k], best[k]) ? bi[k] + 1 : bi[k];   best[k] = DTR__MAX_TAKES(b[k], best[k]) ? b[k] : best[k];
            bi[k] = DTR__MAX_TAKES(c[k], best[k]) ? j0 + 2 * k + W : bi[k]; best[k] = DTR__MAX_TAKES(c[k], best[k]) ? c[k] : best[k];
            bi[k] = DTR__MAX_TAKES(d[k], best[k]) ? j0 + 2 * k + W + 1 : bi[k]; best[k] = DTR__MAX_TAKES(d[k], best[k]) ? d[k] : best[k];
        }
        return;
    }
    for (k = 0; k < 8; k++) {
        int32_t j = j0 + 2 * k;
        bi[k] = b[k] > best[k] ? j + 1 : bi[k];     best[k] = b[k] > best[k] ? b[k] : best[k];
        bi[k] = c[k] > best[k] ? j + W : bi[k];     best[k] = c[k] > best[k] ? c[k] : best[k];
        bi[k] = d[k] > best[k] ? j + W + 1 : bi[k]; best[k] = d[k] > best[k] ? d[k] : best[k];
    }
}

/* Max pooling with a 2x2 window, stride 2, no padding (the common case): the scan order
 * and comparisons of the reference, without bounds checks. Outputs go in blocks of 8
 * through local arrays, which compilers turn into SIMD compares and selects instead of
 * unpredictable branches; a row's last block has n < 8 valid lanes (the others repeat
 * output column oj and are not stored). A block holding a NaN takes the NaN-aware rule. */
static void dtr__maxpool2_block(const float *r0, const float *r1, float *y, int32_t *ag, int64_t oj, int n,
                                int32_t base, int32_t W) {
    float a[8], b[8], c[8], d[8], best[8], z[8], zs;
    int32_t bi[8];
    int k;
    for (k = 0; k < 8; k++) {
        int64_t q = 2 * (oj + (k < n ? k : 0));
        a[k] = r0[q]; b[k] = r0[q + 1]; c[k] = r1[q]; d[k] = r1[q + 1];
    }
    /* x - x is 0, or NaN when x is NaN or infinite: float lanes the compiler vectorises; a
       block with an infinity takes the exact rule too (same result) */
    for (k = 0; k < 8; k++) z[k] = ((a[k] - a[k]) + (b[k] - b[k])) + ((c[k] - c[k]) + (d[k] - d[k]));
    zs = ((z[0] + z[1]) + (z[2] + z[3])) + ((z[4] + z[5]) + (z[6] + z[7]));
    dtr__maxpool2_lanes(a, b, c, d, best, bi, base + 2 * (int32_t)oj, W, zs != zs);
    for (k = 0; k < n; k++) { y[oj + k] = best[k]; ag[oj + k] = bi[k]; }
}

static void dtr__maxpool2_fwd(const dtr__pool2d_job *j, int64_t c0, int64_t c1) {
    int64_t H = j->H, W = j->W, Ho = j->Ho, Wo = j->Wo, c, oi, oj;
    const float *X = dtr__f32(j->nd->in[0]);
    float *Y = dtr__f32(j->nd->out);
    int32_t *arg = (int32_t *)j->nd->saved;
    for (c = c0; c < c1; c++) {
        const float *xc = X + c * H * W;
        for (oi = 0; oi < Ho; oi++) {
            const float *r0 = xc + 2 * oi * W, *r1 = r0 + W;
            float *y = Y + (c * Ho + oi) * Wo;
            int32_t *ag = arg + (c * Ho + oi) * Wo, base = (int32_t)(2 * oi * W);
            for (oj = 0; oj + 8 <= Wo; oj += 8) dtr__maxpool2_block(r0, r1, y, ag, oj, 8, base, (int32_t)W);
            if (oj < Wo) dtr__maxpool2_block(r0, r1, y, ag, oj, (int)(Wo - oj), base, (int32_t)W);
        }
    }
}

static void dtr__pool2d_fwd_range(void *arg, int64_t b, int64_t e, int worker) {
    const dtr__pool2d_job *j = (const dtr__pool2d_job *)arg;
    (void)worker;
    if (j->nd->op == DTR_OP_MAXPOOL2D && j->k == 2 && j->S == 2 && j->P == 0) dtr__maxpool2_fwd(j, b, e);
    else dtr__pool2d_fwd_ref(j, b, e);
}

static void dtr__pool2d_bwd_range(void *arg, int64_t c0, int64_t c1, int worker) {
    const dtr__pool2d_job *j = (const dtr__pool2d_job *)arg;
    int64_t H = j->H, W = j->W, Ho = j->Ho, Wo = j->Wo, k = j->k, S = j->S, P = j->P;
    int64_t c, oi, oj, a, b;
    const float *G = j->nd->out->grad;
    const int32_t *arg_ = (const int32_t *)j->nd->saved;
    float *gx = dtr__gradof(j->nd->in[0]);
    (void)worker;
    for (c = c0; c < c1; c++) {
        float *gc = gx + c * H * W;
        if (j->nd->op == DTR_OP_MAXPOOL2D) {
            const float *g = G + c * Ho * Wo;
            const int32_t *ag = arg_ + c * Ho * Wo;
            for (oi = 0; oi < Ho * Wo; oi++) gc[ag[oi]] += g[oi];
            continue;
        }
        for (oi = 0; oi < Ho; oi++)
            for (oj = 0; oj < Wo; oj++) {
                float g = G[(c * Ho + oi) * Wo + oj] / (float)(k * k);
                for (a = 0; a < k; a++) {
                    int64_t ii = oi * S - P + a;
                    if (ii < 0 || ii >= H) continue;
                    for (b = 0; b < k; b++) {
                        int64_t jj = oj * S - P + b;
                        if (jj >= 0 && jj < W) gc[ii * W + jj] += g;
                    }
                }
            }
    }
}

static void dtr__pool2d_job_of(const dtr__node *nd, dtr__pool2d_job *j, int64_t *planes, int64_t *grain) {
    const dtr_tensor *x = nd->in[0];
    j->nd = nd;
    j->H = x->shape[2]; j->W = x->shape[3];
    j->Ho = nd->out->shape[2]; j->Wo = nd->out->shape[3];
    j->k = nd->p.pool2d.k; j->S = nd->p.pool2d.stride; j->P = nd->p.pool2d.padding;
    *planes = x->shape[0] * x->shape[1];
    *grain = 16384 / (j->H * j->W + 1) + 1;   /* about 16k input elements per chunk at least */
}

dtr_result dtr__cpu_pool2d_fwd(dtr_context *ctx, dtr__node *nd) {
    dtr__pool2d_job j;
    int64_t planes, grain;
    if (nd->op == DTR_OP_MAXPOOL2D) { /* argmax of each window, for backward */
        nd->saved = dtr__node_save(ctx, nd, (size_t)dtr_tensor_numel(nd->out) * sizeof(int32_t));
        if (!nd->saved) return ctx->status;
    }
    dtr__pool2d_job_of(nd, &j, &planes, &grain);
    dtr__pool_run(ctx->pool, planes, grain, dtr__pool2d_fwd_range, &j);
    return DTR_OK;
}

dtr_result dtr__cpu_pool2d_bwd(dtr_context *ctx, dtr__node *nd) {
    dtr__pool2d_job j;
    int64_t planes, grain;
    if (!dtr__gradof(nd->in[0])) return DTR_OK;
    dtr__pool2d_job_of(nd, &j, &planes, &grain);
    dtr__pool_run(ctx->pool, planes, grain, dtr__pool2d_bwd_range, &j);
    return DTR_OK;
}
#line 7692 "dtrain.h"

/* ---- src/ops/ops_view.c ---- */
#line 1 "src/ops/ops_view.c"
/* ============================================================================
 * Views and copies: reshape, permute/transpose, slice (no copy), concat and contiguous
 * (copies). A view shares its input's storage and has its own dense gradient; its backward
 * adds that gradient into the input's at the positions the view covers.
 * ==========================================================================*/



/* Calls ROW for every element of a tensor of shape (nd, shape) in row-major order with
 * `off` = the offset given by `stride` (and `i` = the flat index). */
#define DTR__FOR_EACH(nd, shape, stride, base, ...)                                       \
    do {                                                                                  \
        int64_t ix_[DTR_MAX_DIMS] = {0}, n_ = dtr__numel((nd), (shape)), i, off = (base); \
        int d_;                                                                           \
        for (i = 0; i < n_; i++) {                                                        \
            __VA_ARGS__;                                                                  \
            for (d_ = (nd) - 1; d_ >= 0; d_--) {                                          \
                off += (stride)[d_];                                                      \
                if (++ix_[d_] < (shape)[d_]) break;                                       \
                off -= (stride)[d_] * ix_[d_];                                            \
                ix_[d_] = 0;                                                              \
            }                                                                             \
        }                                                                                 \
    } while (0)

static dtr_tensor *dtr__view_record(dtr_context *ctx, dtr__node *n, dtr_tensor *v, const char *name) {
    n->out = v;
    return dtr__record(ctx, n, name);
}

/* ---- reshape ---- */

dtr_tensor *dtr_reshape(dtr_context *ctx, dtr_tensor *x, int ndim, const int64_t *shape) {
    int64_t s[DTR_MAX_DIMS], known = 1;
    int d, infer = -1;
    dtr_tensor *v;
    dtr__node *n;
    char s1[96];
    if (!ctx) return NULL;
    if (!x) return dtr__failt(ctx, ctx->status ? ctx->status : DTR_NULL_HANDLE, "dtr_reshape: x is NULL");
    if (ndim < 0 || ndim > DTR_MAX_DIMS || (ndim && !shape))
        return dtr__failt(ctx, DTR_INVALID_ARGUMENT, "dtr_reshape: bad shape (ndim %d)", ndim);
    for (d = 0; d < ndim; d++) {
        s[d] = shape[d];
        if (s[d] == -1) {
            if (infer >= 0) return dtr__failt(ctx, DTR_INVALID_ARGUMENT, "dtr_reshape: more than one -1");
            infer = d;
        } else if (s[d] < 0) {
            return dtr__failt(ctx, DTR_INVALID_ARGUMENT, "dtr_reshape: dimension %d is %lld", d, (long long)s[d]);
        } else {
            known *= s[d];
        }
    }
    if (infer >= 0) s[infer] = known ? dtr_tensor_numel(x) / known : 0;
    if (dtr__numel(ndim, s) != dtr_tensor_numel(x))
        return dtr__failt(ctx, DTR_SHAPE_MISMATCH, "dtr_reshape: cannot view %s (%lld elements) as %lld elements",
                          dtr__shape_str(x, s1, sizeof s1), (long long)dtr_tensor_numel(x), (long long)dtr__numel(ndim, s));
    x = dtr__contig_input(ctx, x);
    if (!x) return NULL;
    n = dtr__node_new(ctx, DTR_OP_RESHAPE, 1, &x);
    v = dtr__tensor_view(ctx, x, "dtr_reshape");
    if (!n || !v) return NULL;
    v->ndim = ndim;
    for (d = 0; d < ndim; d++) v->shape[d] = s[d];
    dtr__contig_strides(ndim, s, v->stride);
    return dtr__view_record(ctx, n, v, "dtr_reshape");
}

/* ---- permute, transpose ---- */

dtr_tensor *dtr_permute(dtr_context *ctx, dtr_tensor *x, const int *perm) {
    int seen[DTR_MAX_DIMS] = {0}, d;
    dtr_tensor *v;
    dtr__node *n;
    if (!ctx) return NULL;
    if (!x) return dtr__failt(ctx, ctx->status ? ctx->status : DTR_NULL_HANDLE, "dtr_permute: x is NULL");
    if (!perm && x->ndim) return dtr__failt(ctx, DTR_NULL_HANDLE, "dtr_permute: perm is NULL");
    for (d = 0; d < x->ndim; d++) {
        if (perm[d] < 0 || perm[d] >= x->ndim || seen[perm[d]])
            return dtr__failt(ctx, DTR_INVALID_ARGUMENT, "dtr_permute: entry %d (%d) is not a permutation of %d axes", d,
                              perm[d], x->ndim);
        seen[perm[d]] = 1;
    }
    n = dtr__node_new(ctx, DTR_OP_PERMUTE, 1, &x);
    v = dtr__tensor_view(ctx, x, "dtr_permute");
    if (!n || !v) return NULL;
    for (d = 0; d < x->ndim; d++) {
        v->shape[d] = x->shape[perm[d]];
        v->stride[d] = x->stride[perm[d]];
        n->p.view.perm[d] = perm[d];
    }
    return dtr__view_record(ctx, n, v, "dtr_permute");
}

dtr_tensor *dtr_transpose(dtr_context *ctx, dtr_tensor *x, int axis0, int axis1) {
    int perm[DTR_MAX_DIMS], d, t;
    if (!ctx) return NULL;
    if (!x) return dtr__failt(ctx, ctx->status ? ctx->status : DTR_NULL_HANDLE, "dtr_transpose: x is NULL");
    if (axis0 < 0) axis0 += x->ndim;
    if (axis1 < 0) axis1 += x->ndim;
    if (axis0 < 0 || axis1 < 0 || axis0 >= x->ndim || axis1 >= x->ndim)
        return dtr__failt(ctx, DTR_INVALID_ARGUMENT, "dtr_transpose: axes %d, %d outside %d dims", axis0, axis1, x->ndim);
    for (d = 0; d < x->ndim; d++) perm[d] = d;
    t = perm[axis0]; perm[axis0] = perm[axis1]; perm[axis1] = t;
    return dtr_permute(ctx, x, perm);
}

/* ---- slice ---- */

dtr_tensor *dtr_slice(dtr_context *ctx, dtr_tensor *x, int axis, int64_t start, int64_t end) {
    dtr_tensor *v;
    dtr__node *n;
    if (!ctx) return NULL;
    if (!x) return dtr__failt(ctx, ctx->status ? ctx->status : DTR_NULL_HANDLE, "dtr_slice: x is NULL");
    if (axis < 0) axis += x->ndim;
    if (axis < 0 || axis >= x->ndim) return dtr__failt(ctx, DTR_INVALID_ARGUMENT, "dtr_slice: axis outside %d dims", x->ndim);
    if (start < 0) start += x->shape[axis];
    if (end < 0) end += x->shape[axis];
    if (start < 0 || end > x->shape[axis] || start > end)
        return dtr__failt(ctx, DTR_INVALID_ARGUMENT, "dtr_slice: [%lld, %lld) outside axis %d of size %lld", (long long)start,
                          (long long)end, axis, (long long)x->shape[axis]);
    n = dtr__node_new(ctx, DTR_OP_SLICE, 1, &x);
    v = dtr__tensor_view(ctx, x, "dtr_slice");
    if (!n || !v) return NULL;
    v->shape[axis] = end - start;
    v->offset += start * x->stride[axis];
    n->p.view.axis = axis;
    n->p.view.start = start;
    return dtr__view_record(ctx, n, v, "dtr_slice");
}

/* ---- contiguous ---- */

dtr_tensor *dtr_contiguous(dtr_context *ctx, dtr_tensor *x) {
    dtr__node *n;
    if (!ctx) return NULL;
    if (!x) return dtr__failt(ctx, ctx->status ? ctx->status : DTR_NULL_HANDLE, "dtr_contiguous: x is NULL");
    if (dtr_tensor_is_contiguous(x)) return x;
    n = dtr__node_new(ctx, DTR_OP_CONTIGUOUS, 1, &x);
    if (!n) return NULL;
    n->out = dtr__tensor_alloc(ctx, x->dtype, x->ndim, x->shape, "dtr_contiguous");
    if (!n->out) return NULL;
    return dtr__record(ctx, n, "dtr_contiguous");
}

/* ---- concat ---- */

dtr_tensor *dtr_concat(dtr_context *ctx, dtr_tensor *const *xs, int count, int axis) {
    dtr__node *n;
    int64_t shape[DTR_MAX_DIMS];
    char s1[96], s2[96];
    int i, d, ndim;
    if (!ctx) return NULL;
    if (!xs || count < 1) return dtr__failt(ctx, DTR_INVALID_ARGUMENT, "dtr_concat: no inputs");
    for (i = 0; i < count; i++)
        if (!dtr__check_input(ctx, "dtr_concat", xs[i], "an input")) return NULL;
    ndim = xs[0]->ndim;
    if (axis < 0) axis += ndim;
    if (axis < 0 || axis >= ndim) return dtr__failt(ctx, DTR_INVALID_ARGUMENT, "dtr_concat: axis outside %d dims", ndim);
    for (d = 0; d < ndim; d++) shape[d] = xs[0]->shape[d];
    shape[axis] = 0;
    for (i = 0; i < count; i++) {
        if (xs[i]->ndim != ndim) goto mismatch;
        for (d = 0; d < ndim; d++)
            if (d != axis && xs[i]->shape[d] != shape[d]) goto mismatch;
        shape[axis] += xs[i]->shape[axis];
    }
    n = dtr__node_new(ctx, DTR_OP_CONCAT, count, xs);
    if (!n) return NULL;
    n->p.view.axis = axis;
    n->out = dtr__tensor_alloc(ctx, DTR_F32, ndim, shape, "dtr_concat");
    if (!n->out) return NULL;
    return dtr__record(ctx, n, "dtr_concat");
mismatch:
    return dtr__failt(ctx, DTR_SHAPE_MISMATCH, "dtr_concat: input %d %s does not match %s outside axis %d", i,
                      dtr__shape_str(xs[i], s1, sizeof s1), dtr__shape_str(xs[0], s2, sizeof s2), axis);
}

/* ---- CPU kernels ---- */

dtr_result dtr__cpu_view_fwd(dtr_context *ctx, dtr__node *nd) {
    const dtr_tensor *x = nd->in[0];
    (void)ctx;
    if (nd->op == DTR_OP_CONTIGUOUS) {
        size_t es = dtr_dtype_size(x->dtype);
        char *dst = (char *)dtr_tensor_data(nd->out);
        const char *src = (const char *)x->storage;
        DTR__FOR_EACH(x->ndim, x->shape, x->stride, x->offset, memcpy(dst + (size_t)i * es, src + (size_t)off * es, es));
    } else if (nd->op == DTR_OP_CONCAT) {
        int k, axis = nd->p.view.axis;
        int64_t ostr[DTR_MAX_DIMS], base = 0;
        float *Y = dtr__f32(nd->out);
        memcpy(ostr, nd->out->stride, sizeof(ostr));
        for (k = 0; k < nd->n_in; k++) {
            const dtr_tensor *p = nd->in[k];
            const float *X = (const float *)p->storage;
            int64_t xo = p->offset;
            /* walk the input; the output offset follows with the output's strides */
            int64_t ix[DTR_MAX_DIMS] = {0}, cnt = dtr_tensor_numel(p), i;
            int d;
            for (i = 0; i < cnt; i++) {
                int64_t ooff = base, xoff = xo;
                for (d = 0; d < p->ndim; d++) { ooff += ix[d] * ostr[d]; xoff += ix[d] * p->stride[d]; }
                Y[ooff] = X[xoff];
                for (d = p->ndim - 1; d >= 0; d--) { if (++ix[d] < p->shape[d]) break; ix[d] = 0; }
            }
            base += p->shape[axis] * ostr[axis];
        }
    }
    /* reshape, permute and slice are views: nothing to compute */
    return DTR_OK;
}

dtr_result dtr__cpu_view_bwd(dtr_context *ctx, dtr__node *nd) {
    const dtr_tensor *x = nd->in[0];
    const float *g = nd->out->grad;
    int64_t cs[DTR_MAX_DIMS], gs[DTR_MAX_DIMS];
    float *gx;
    int d;
    (void)ctx;
    if (nd->op == DTR_OP_CONCAT) {
        int k, axis = nd->p.view.axis;
        int64_t base = 0;
        for (k = 0; k < nd->n_in; k++) {
            const dtr_tensor *p = nd->in[k];
            float *gp = dtr__gradof(p);
            if (gp) {
                /* gp (dense) += the block of g at `base` along axis */
                DTR__FOR_EACH(p->ndim, p->shape, nd->out->stride, base, gp[i] += g[off]);
            }
            base += p->shape[axis] * nd->out->stride[axis];
        }
        return DTR_OK;
    }
    gx = dtr__gradof(x);
    if (!gx) return DTR_OK;
    dtr__contig_strides(x->ndim, x->shape, cs);
    switch (nd->op) {
    case DTR_OP_RESHAPE:
    case DTR_OP_CONTIGUOUS: {
        int64_t i, n = dtr_tensor_numel(x);
        for (i = 0; i < n; i++) gx[i] += g[i];
        break;
    }
    case DTR_OP_PERMUTE:
        for (d = 0; d < x->ndim; d++) gs[d] = cs[nd->p.view.perm[d]];
        DTR__FOR_EACH(nd->out->ndim, nd->out->shape, gs, 0, gx[off] += g[i]);
        break;
    case DTR_OP_SLICE:
        DTR__FOR_EACH(nd->out->ndim, nd->out->shape, cs, nd->p.view.start * cs[nd->p.view.axis], gx[off] += g[i]);
        break;
    default: break;
    }
    return DTR_OK;
}
#line 7951 "dtrain.h"

/* ---- src/ops/ops_comm.c ---- */
#line 1 "src/ops/ops_comm.c"
/* ============================================================================
 * Communication on the tape, for tensor parallelism (Megatron-LM's f and g): the ranks of a
 * group each hold a slice of a layer, and these ops join their partial results.
 *   TP_COPY    forward: y = x (every rank already holds all of x);
 *              backward: gx += all_reduce_sum(gy) (each rank's slice contributed to gy)
 *   TP_REDUCE  forward: y = all_reduce_sum(x) (each rank holds a partial sum);
 *              backward: gx += gy
 *   VOCAB_CROSS_ENTROPY  mean cross-entropy of logits whose last axis (the vocabulary) is split
 *              over the group, rank r holding classes r * K .. (r + 1) * K - 1: the global row
 *              max (all-reduce MAX), sum of exponentials and target logit (one all-reduce SUM);
 *              backward: gx += g / N * (softmax_shard - onehot_shard), no communication.
 *   TP_GATHER  forward: y = every rank's x joined along the last axis, in rank order
 *              (all-gather); backward: gx += this rank's slice of gy
 * Shapes: any; y has x's shape (TP_GATHER: the last axis times the group size). Every rank of the group must build the same ops in the same
 * order (they are collectives). The group's buffers are the backend's tensors (cfg.memory).
 * ==========================================================================*/




#include <math.h>

static dtr_tensor *dtr__tp(dtr_context *ctx, int op, const char *name, dtr_tensor *x, dtr_comm *comm) {
    int64_t shape[DTR_MAX_DIMS];
    dtr__node *n;
    if (!ctx) return NULL;
    if (!dtr__check_input(ctx, name, x, "x")) return NULL;
    if (!comm) return dtr__failt(ctx, DTR_NULL_HANDLE, "%s: comm is NULL", name);
    if (op == DTR_OP_TP_GATHER && x->ndim < 1) return dtr__failt(ctx, DTR_SHAPE_MISMATCH, "%s: x needs an axis to join", name);
    x = dtr__contig_input(ctx, x);
    if (!x) return NULL;
    n = dtr__node_new(ctx, op, 1, &x);
    if (!n) return NULL;
    n->p.comm = comm;
    memcpy(shape, x->shape, sizeof shape);
    if (op == DTR_OP_TP_GATHER) shape[x->ndim - 1] *= dtr_comm_size(comm);
    n->out = dtr__tensor_alloc(ctx, DTR_F32, x->ndim, shape, name);
    if (!n->out) return NULL;
    return dtr__record(ctx, n, name);
}

dtr_tensor *dtr_tp_copy(dtr_context *ctx, dtr_tensor *x, dtr_comm *comm) { return dtr__tp(ctx, DTR_OP_TP_COPY, "dtr_tp_copy", x, comm); }
dtr_tensor *dtr_tp_reduce(dtr_context *ctx, dtr_tensor *x, dtr_comm *comm) { return dtr__tp(ctx, DTR_OP_TP_REDUCE, "dtr_tp_reduce", x, comm); }
dtr_tensor *dtr_tp_gather(dtr_context *ctx, dtr_tensor *x, dtr_comm *comm) { return dtr__tp(ctx, DTR_OP_TP_GATHER, "dtr_tp_gather", x, comm); }

dtr_tensor *dtr_vocab_parallel_cross_entropy(dtr_context *ctx, dtr_tensor *logits, dtr_tensor *targets, dtr_comm *comm) {
    static const char name[] = "dtr_vocab_parallel_cross_entropy";
    dtr__node *n;
    if (!ctx) return NULL;
    if (!comm) return dtr__failt(ctx, DTR_NULL_HANDLE, "%s: comm is NULL", name);
    n = dtr__xent_node(ctx, DTR_OP_VOCAB_CROSS_ENTROPY, name, logits, targets);
    if (!n) return NULL;
    n->p.comm = comm;
    return dtr__record(ctx, n, name);
}

/* in-place reduction over the group, with the group's error on the context */
static dtr_result dtr__tp_all_reduce(dtr_context *ctx, const dtr__node *nd, float *buf, int64_t n, dtr_reduce_op op) {
    dtr_result r = dtr_comm_all_reduce(nd->p.comm, buf, buf, (size_t)n, DTR_F32, op);
    if (r != DTR_OK)
        return dtr__fail(ctx, r, "%s: all-reduce over the group failed: %s", dtr__op_name(nd->op), dtr_comm_last_error(nd->p.comm));
    return DTR_OK;
}

/* ---- vocabulary-parallel cross-entropy ---- */

typedef struct dtr__vxent {
    int64_t K, R, start;       /* classes here, rows, first class here */
    const float *x;
    const int32_t *t;
} dtr__vxent;

static dtr__vxent dtr__vxent_of(const dtr__node *nd) {
    dtr__vxent v;
    v.K = nd->in[0]->shape[nd->in[0]->ndim - 1];
    v.R = v.K ? dtr_tensor_numel(nd->in[0]) / v.K : 0;
    v.start = (int64_t)dtr_comm_rank(nd->p.comm) * v.K;
    v.x = dtr__f32(nd->in[0]);
    v.t = dtr__i32(nd->in[1]);
    return v;
}

/* saved: the rows' global max M, sum of exp(x - M) Z and target logit T, R floats each */
static dtr_result dtr__vxent_fwd(dtr_context *ctx, dtr__node *nd) {
    dtr__vxent v = dtr__vxent_of(nd);
    int64_t V = v.K * dtr_comm_size(nd->p.comm), r, k;
    float *M, *Z, *T;
    double loss = 0.0;
    dtr_result res;
    for (r = 0; r < v.R; r++)
        if (v.t[r] < 0 || v.t[r] >= V)
            return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_vocab_parallel_cross_entropy: target %lld is %d, outside [0, %lld)",
                             (long long)r, (int)v.t[r], (long long)V);
    M = (float *)dtr__node_save(ctx, nd, (size_t)(3 * v.R + 1) * sizeof(float));
    if (!M) return ctx->status;
    nd->saved = M, Z = M + v.R, T = Z + v.R;
    for (r = 0; r < v.R; r++)
        for (M[r] = -INFINITY, k = 0; k < v.K; k++) M[r] = v.x[r * v.K + k] > M[r] ? v.x[r * v.K + k] : M[r];
    if ((res = dtr__tp_all_reduce(ctx, nd, M, v.R, DTR_REDUCE_MAX)) != DTR_OK) return res;
    for (r = 0; r < v.R; r++) {
        double s = 0.0;
        int64_t own = v.t[r] - v.start;
        for (k = 0; k < v.K; k++) s += expf(v.x[r * v.K + k] - M[r]);
        Z[r] = (float)s;
        T[r] = own >= 0 && own < v.K ? v.x[r * v.K + own] : 0.0f;
    }
    if ((res = dtr__tp_all_reduce(ctx, nd, Z, 2 * v.R, DTR_REDUCE_SUM)) != DTR_OK) return res;
    for (r = 0; r < v.R; r++) loss += (double)M[r] + log((double)Z[r]) - T[r];
    dtr__f32(nd->out)[0] = v.R ? (float)(loss / (double)v.R) : 0.0f;
    return DTR_OK;
}

static dtr_result dtr__vxent_bwd(dtr__node *nd) {
    dtr__vxent v = dtr__vxent_of(nd);
    const float *M = (const float *)nd->saved, *Z = M + v.R;
    float *gx = dtr__gradof(nd->in[0]), c;
    int64_t r, k;
    if (!gx || !v.R) return DTR_OK;
    c = nd->out->grad[0] / (float)v.R;
    for (r = 0; r < v.R; r++) {
        int64_t own = v.t[r] - v.start;
        for (k = 0; k < v.K; k++) gx[r * v.K + k] += c * (expf(v.x[r * v.K + k] - M[r]) / Z[r]);
        if (own >= 0 && own < v.K) gx[r * v.K + own] -= c;
    }
    return DTR_OK;
}

/* ---- all-gather along the last axis ---- */

/* rows of width w: rank k's row r lands at y[r * N * w + k * w] */
static dtr_result dtr__gather_fwd(dtr_context *ctx, dtr__node *nd) {
    const dtr_tensor *x = nd->in[0];
    int64_t n = dtr_tensor_numel(x), w = x->shape[x->ndim - 1], r, N = dtr_comm_size(nd->p.comm), k;
    float *buf = (float *)dtr__arena_data(ctx, (size_t)(n * N + 1) * sizeof(float), "dtr_tp_gather"), *y = dtr__f32(nd->out);
    dtr_result res;
    if (!buf) return ctx->status;
    res = dtr_comm_all_gather(nd->p.comm, dtr__f32(x), buf, (size_t)n, DTR_F32);
    if (res != DTR_OK)
        return dtr__fail(ctx, res, "dtr_tp_gather: all-gather over the group failed: %s", dtr_comm_last_error(nd->p.comm));
    for (k = 0; w && k < N; k++)
        for (r = 0; r < n / w; r++) memcpy(y + (r * N + k) * w, buf + k * n + r * w, (size_t)w * sizeof(float));
    return DTR_OK;
}

static dtr_result dtr__gather_bwd(dtr__node *nd) {
    const dtr_tensor *x = nd->in[0];
    int64_t n = dtr_tensor_numel(x), w = x->shape[x->ndim - 1], N = dtr_comm_size(nd->p.comm), i;
    const float *g = nd->out->grad + (int64_t)dtr_comm_rank(nd->p.comm) * w;
    float *gx = dtr__gradof(x);
    if (gx && w)
        for (i = 0; i < n; i++) gx[i] += g[i / w * N * w + i % w];
    return DTR_OK;
}

/* ---- the family's kernels ---- */

dtr_result dtr__cpu_comm_fwd(dtr_context *ctx, dtr__node *nd) {
    int64_t n = dtr_tensor_numel(nd->out);
    if (nd->op == DTR_OP_VOCAB_CROSS_ENTROPY) return dtr__vxent_fwd(ctx, nd);
    if (nd->op == DTR_OP_TP_GATHER) return dtr__gather_fwd(ctx, nd);
    memcpy(dtr__f32(nd->out), dtr__f32(nd->in[0]), (size_t)n * sizeof(float));
    return nd->op == DTR_OP_TP_REDUCE ? dtr__tp_all_reduce(ctx, nd, dtr__f32(nd->out), n, DTR_REDUCE_SUM) : DTR_OK;
}

dtr_result dtr__cpu_comm_bwd(dtr_context *ctx, dtr__node *nd) {
    int64_t i, n = dtr_tensor_numel(nd->out);
    float *gx = dtr__gradof(nd->in[0]), *g = nd->out->grad, *sum;
    dtr_result r;
    if (nd->op == DTR_OP_VOCAB_CROSS_ENTROPY) return dtr__vxent_bwd(nd);
    if (nd->op == DTR_OP_TP_GATHER) return dtr__gather_bwd(nd);
    if (nd->op == DTR_OP_TP_REDUCE) {
        if (gx) for (i = 0; i < n; i++) gx[i] += g[i];
        return DTR_OK;
    }
    /* every rank takes part in the all-reduce, whether or not its x needs a gradient */
    sum = (float *)dtr__arena_data(ctx, (size_t)(n ? n : 1) * sizeof(float), "dtr_tp_copy backward");
    if (!sum) return ctx->status;
    memcpy(sum, g, (size_t)n * sizeof(float));
    if ((r = dtr__tp_all_reduce(ctx, nd, sum, n, DTR_REDUCE_SUM)) != DTR_OK) return r;
    if (gx) for (i = 0; i < n; i++) gx[i] += sum[i];
    return DTR_OK;
}
#line 8137 "dtrain.h"

/* ---- src/core/backend_cpu.c ---- */
#line 1 "src/core/backend_cpu.c"
/* ============================================================================
 * The CPU backend: host memory and the dispatch from op ids to the CPU kernels that sit
 * beside each op's builder in src/ops/.
 * ==========================================================================*/




/* ---- dispatch (shared by every backend) ---- */

int dtr__table_has(const dtr__kernel_pair *table, int op) {
    return op > 0 && op < DTR_OP_COUNT && table[op].fwd != NULL;
}

dtr_result dtr__table_run(const dtr__kernel_pair *table, const char *backend, dtr_context *ctx, dtr__node *n, int bwd) {
    if (!dtr__table_has(table, n->op))
        return dtr__fail(ctx, DTR_UNSUPPORTED, "%s backend: op %d (%s) has no %s kernel in this version", backend, n->op,
                         dtr__op_name(n->op), bwd ? "backward" : "forward");
    return bwd ? table[n->op].bwd(ctx, n) : table[n->op].fwd(ctx, n);
}

/* The CPU kernels (src/ops/, declared in internal.h), tabled from the op list: entry
 * X(ID, name, k) runs dtr__cpu_k_fwd / dtr__cpu_k_bwd. */
#define DTR__CPU_ENTRY(id, name, k) {dtr__cpu_##k##_fwd, dtr__cpu_##k##_bwd},
static const dtr__kernel_pair dtr__cpu_kernels[DTR_OP_COUNT] = {
    {NULL, NULL}, /* DTR_OP_NONE */
    DTR__OP_LIST(DTR__CPU_ENTRY)
};
#undef DTR__CPU_ENTRY

static int dtr__cpu_supports_op(const dtr_context *ctx, int op) { (void)ctx; return dtr__table_has(dtr__cpu_kernels, op); }
static dtr_result dtr__cpu_forward(dtr_context *ctx, dtr__node *n) { return dtr__table_run(dtr__cpu_kernels, "cpu", ctx, n, 0); }
static dtr_result dtr__cpu_backward(dtr_context *ctx, dtr__node *n) { return dtr__table_run(dtr__cpu_kernels, "cpu", ctx, n, 1); }

static void *dtr__cpu_mem_alloc(dtr_context *ctx, size_t bytes) { return dtr__malloc(&ctx->alloc, bytes); }
static void dtr__cpu_mem_free(dtr_context *ctx, void *p) { dtr__free(&ctx->alloc, p); }

static dtr_result dtr__cpu_memset0(dtr_context *ctx, void *dst, size_t bytes) {
    (void)ctx;
    memset(dst, 0, bytes);
    return DTR_OK;
}

static dtr_result dtr__cpu_copy(dtr_context *ctx, void *dst, const void *src, size_t bytes) {
    (void)ctx;
    if (bytes) memmove(dst, src, bytes);
    return DTR_OK;
}

static dtr_result dtr__cpu_sumsq(dtr_context *ctx, const float *x, int64_t n, double *out) {
    int64_t i;
    double s = 0.0;
    (void)ctx;
    for (i = 0; i < n; i++) s += (double)x[i] * x[i];
    *out = s;
    return DTR_OK;
}

static dtr_result dtr__cpu_scale(dtr_context *ctx, float *x, int64_t n, float s) {
    int64_t i;
    (void)ctx;
    for (i = 0; i < n; i++) x[i] *= s;
    return DTR_OK;
}

static dtr_result dtr__cpu_reduce(dtr_context *ctx, void *out, const void *a, const void *b, size_t n, dtr_dtype dt,
                                  int op, int div) {
    (void)ctx;
    dtr__comm_reduce(out, a, b, n, dt, (dtr_reduce_op)op, div);
    return DTR_OK;
}

/* Every call completes before it returns: events are NULL (complete). */
static dtr_result dtr__cpu_event_record(dtr_context *ctx, dtr_event **ev) { (void)ctx; *ev = NULL; return DTR_OK; }
static dtr_result dtr__cpu_event_wait(dtr_context *ctx, dtr_event *ev) { (void)ctx; (void)ev; return DTR_OK; }
static dtr_result dtr__cpu_event_query(dtr_context *ctx, dtr_event *ev, int *done) {
    (void)ctx; (void)ev;
    *done = 1;
    return DTR_OK;
}

static dtr_result dtr__cpu_sync(dtr_context *ctx) { (void)ctx; return DTR_OK; }

const dtr_backend dtr__cpu_backend = {
    DTR_VERSION_NUMBER,
    sizeof(dtr_backend),
    "cpu",
    DTR__CAP_HOST_MEMORY,
    NULL,
    NULL,
    dtr__cpu_mem_alloc,
    dtr__cpu_mem_free,
    dtr__cpu_mem_alloc,
    dtr__cpu_mem_free,
    dtr__cpu_memset0,
    dtr__cpu_copy,
    dtr__cpu_copy,
    dtr__cpu_supports_op,
    dtr__cpu_forward,
    dtr__cpu_backward,
    dtr__cpu_optimizer_update,
    dtr__cpu_sumsq,
    dtr__cpu_scale,
    dtr__cpu_reduce,
    dtr__cpu_event_record,
    dtr__cpu_event_wait,
    dtr__cpu_event_query,
    dtr__cpu_sync
};
#line 8250 "dtrain.h"

/* ---- src/nn/model.c ---- */
#line 1 "src/nn/model.c"
/* ============================================================================
 * Models: named parameters in one contiguous buffer (gradients in another), seeded
 * initialisers, and save/load in the safetensors layout.
 * ==========================================================================*/


#include <math.h>

#define DTR__PARAM_ALIGN 16 /* floats: each parameter starts on a 64-byte boundary */

struct dtr_model {
    dtr_context *ctx;
    uint64_t seed;
    dtr_tensor **params;
    char **names;
    dtr_init *inits;
    float *init_args;
    int64_t *offsets;
    uint64_t *streams;    /* each parameter's initialiser stream: its declaration number */
    dtr__shard *shards;   /* tensor-parallel shards (comm NULL: a whole tensor) */
    int count, cap;
    dtr_tensor **dropped; /* declared, then left out by dtr_model_keep (no storage) */
    int n_dropped;
    int64_t total;        /* floats in each buffer, padding included */
    float *data, *grad;   /* backend memory */
    int built;
};

dtr_result dtr_model_create(dtr_context *ctx, uint64_t seed, dtr_model **out) {
    dtr_model *m;
    if (!ctx || !out) return DTR_NULL_HANDLE;
    *out = NULL;
    m = (dtr_model *)dtr__calloc(&ctx->alloc, sizeof(*m));
    if (!m) return dtr__fail(ctx, DTR_OUT_OF_MEMORY, "dtr_model_create: out of memory");
    m->ctx = ctx;
    m->seed = seed;
    *out = m;
    return DTR_OK;
}

void dtr_model_destroy(dtr_model *m) {
    const dtr_allocation_callbacks *a;
    int i;
    if (!m) return;
    a = &m->ctx->alloc;
    for (i = 0; i < m->count; i++) { dtr__free(a, m->params[i]); dtr__free(a, m->names[i]); }
    for (i = 0; i < m->n_dropped; i++) { dtr__free(a, (void *)m->dropped[i]->name); dtr__free(a, m->dropped[i]); }
    dtr__free(a, m->dropped);
    dtr__free(a, m->streams);
    dtr__free(a, m->shards);
    dtr__free(a, m->params);
    dtr__free(a, m->names);
    dtr__free(a, m->inits);
    dtr__free(a, m->init_args);
    dtr__free(a, m->offsets);
    if (m->data) m->ctx->backend->mem_free(m->ctx, m->data);
    if (m->grad) m->ctx->backend->mem_free(m->ctx, m->grad);
    dtr__free(a, m);
}

/* floats a parameter takes in the buffers: each starts on a 64-byte boundary */
static int64_t dtr__padded(const dtr_tensor *t) {
    return (dtr_tensor_numel(t) + DTR__PARAM_ALIGN - 1) / DTR__PARAM_ALIGN * DTR__PARAM_ALIGN;
}

static int dtr__model_grow(dtr_model *m) {
    const dtr_allocation_callbacks *a = &m->ctx->alloc;
    int cap = m->cap ? m->cap * 2 : 16;
    void *p;
    p = dtr__realloc(a, m->params, (size_t)cap * sizeof(*m->params)); if (!p) return 0; m->params = (dtr_tensor **)p;
    p = dtr__realloc(a, m->names, (size_t)cap * sizeof(*m->names)); if (!p) return 0; m->names = (char **)p;
    p = dtr__realloc(a, m->inits, (size_t)cap * sizeof(*m->inits)); if (!p) return 0; m->inits = (dtr_init *)p;
    p = dtr__realloc(a, m->init_args, (size_t)cap * sizeof(*m->init_args)); if (!p) return 0; m->init_args = (float *)p;
    p = dtr__realloc(a, m->offsets, (size_t)cap * sizeof(*m->offsets)); if (!p) return 0; m->offsets = (int64_t *)p;
    p = dtr__realloc(a, m->streams, (size_t)cap * sizeof(*m->streams)); if (!p) return 0; m->streams = (uint64_t *)p;
    p = dtr__realloc(a, m->shards, (size_t)cap * sizeof(*m->shards)); if (!p) return 0; m->shards = (dtr__shard *)p;
    m->cap = cap;
    return 1;
}

dtr_tensor *dtr_model_param(dtr_model *m, const char *name, int ndim, const int64_t *shape, dtr_init init, float arg) {
    dtr_context *ctx;
    dtr_tensor *t;
    size_t len;
    int i;
    if (!m) return NULL;
    ctx = m->ctx;
    if (!name || !*name) return dtr__failt(ctx, DTR_INVALID_ARGUMENT, "dtr_model_param: a parameter needs a name");
    len = strlen(name);
    if (len >= 256) return dtr__failt(ctx, DTR_INVALID_ARGUMENT, "dtr_model_param: name '%.40s...' is longer than 255 bytes", name);
    if (m->built) return dtr__failt(ctx, DTR_BAD_STATE, "dtr_model_param: '%s' declared after dtr_model_build", name);
    if (ndim < 0 || ndim > DTR_MAX_DIMS || (ndim && !shape))
        return dtr__failt(ctx, DTR_INVALID_ARGUMENT, "dtr_model_param: '%s' has a bad shape", name);
    for (i = 0; i < ndim; i++)
        if (shape[i] < 0 || shape[i] > ((int64_t)1 << 32))
            return dtr__failt(ctx, DTR_INVALID_ARGUMENT, "dtr_model_param: '%s' dimension %d is %lld", name, i, (long long)shape[i]);
    if ((int)init < 0 || init > DTR_INIT_TORCH_DEFAULT)
        return dtr__failt(ctx, DTR_INVALID_ARGUMENT, "dtr_model_param: '%s' has unknown initialiser %d", name, (int)init);
    for (i = 0; i < m->count; i++)
        if (!strcmp(m->names[i], name)) return dtr__failt(ctx, DTR_INVALID_ARGUMENT, "dtr_model_param: '%s' declared twice", name);
    if (m->count == m->cap && !dtr__model_grow(m)) return dtr__failt(ctx, DTR_OUT_OF_MEMORY, "dtr_model_param: out of memory");
    t = (dtr_tensor *)dtr__calloc(&ctx->alloc, sizeof(*t));
    m->names[m->count] = (char *)dtr__malloc(&ctx->alloc, len + 1);
    if (!t || !m->names[m->count]) {
        dtr__free(&ctx->alloc, t);
        dtr__free(&ctx->alloc, m->names[m->count]);
        return dtr__failt(ctx, DTR_OUT_OF_MEMORY, "dtr_model_param: out of memory");
    }
    memcpy(m->names[m->count], name, len + 1);
    t->dtype = DTR_F32;
    t->ndim = ndim;
    for (i = 0; i < ndim; i++) t->shape[i] = shape[i];
    dtr__contig_strides(ndim, shape, t->stride);
    t->ctx = ctx;
    t->flags = DTR__PARAM | DTR__REQUIRES_GRAD | DTR__LEAF;
    t->param_index = m->count;
    t->model = m;
    t->name = m->names[m->count];
    m->params[m->count] = t;
    m->inits[m->count] = init;
    m->init_args[m->count] = arg;
    m->offsets[m->count] = m->total;
    m->streams[m->count] = (uint64_t)(m->count + m->n_dropped) + 1;
    memset(&m->shards[m->count], 0, sizeof(m->shards[m->count]));
    m->total += dtr__padded(t);
    m->count++;
    return t;
}

/* ---- initialisers ---- */

static void dtr__fans(const dtr_tensor *t, double *fan_in, double *fan_out) {
    double rf = 1.0;
    int d;
    for (d = 2; d < t->ndim; d++) rf *= (double)t->shape[d];
    if (t->ndim >= 2) { *fan_in = (double)t->shape[1] * rf; *fan_out = (double)t->shape[0] * rf; }
    else { *fan_in = *fan_out = t->ndim == 1 ? (double)t->shape[0] : 1.0; }
    if (*fan_in < 1.0) *fan_in = 1.0;
    if (*fan_out < 1.0) *fan_out = 1.0;
}

static void dtr__init_values(dtr_init init, float arg, const dtr_tensor *t, dtr_rng *rng, float *x) {
    int64_t i, n = dtr_tensor_numel(t);
    double fi, fo, b = 0.0, sd = 0.0;
    int normal = 0;
    dtr__fans(t, &fi, &fo);
    switch (init) {
    case DTR_INIT_ZEROS: for (i = 0; i < n; i++) x[i] = 0.0f; return;
    case DTR_INIT_ONES: for (i = 0; i < n; i++) x[i] = 1.0f; return;
    case DTR_INIT_NORMAL: normal = 1; sd = arg; break;
    case DTR_INIT_UNIFORM: b = arg; break;
    case DTR_INIT_KAIMING_UNIFORM: b = sqrt(6.0 / fi); break;
    case DTR_INIT_KAIMING_NORMAL: normal = 1; sd = sqrt(2.0 / fi); break;
    case DTR_INIT_XAVIER_UNIFORM: b = sqrt(6.0 / (fi + fo)); break;
    case DTR_INIT_XAVIER_NORMAL: normal = 1; sd = sqrt(2.0 / (fi + fo)); break;
    case DTR_INIT_TORCH_DEFAULT: b = 1.0 / sqrt(fi); break;
    }
    for (i = 0; i < n; i++)
        x[i] = normal ? (float)(sd * dtr_rng_normal(rng)) : (float)(b * (2.0 * dtr_rng_uniform(rng) - 1.0));
}

/* Parameter i's initial values into x: a shard gets its slice of the full tensor, drawn as a
   single-device model would draw it (same stream, fans of the full shape). */
static dtr_result dtr__model_init_param(dtr_model *m, int i, float *x) {
    const dtr__shard *s = &m->shards[i];
    dtr_tensor full;
    float *buf;
    dtr_rng rng;
    dtr_rng_seed(&rng, m->seed, m->streams[i]);
    if (!s->comm) {
        dtr__init_values(m->inits[i], m->init_args[i], m->params[i], &rng, x);
        return DTR_OK;
    }
    memset(&full, 0, sizeof full);
    full.ndim = s->ndim;
    memcpy(full.shape, s->full, sizeof full.shape);
    buf = (float *)dtr__malloc(&m->ctx->alloc, (size_t)dtr__numel(s->ndim, s->full) * sizeof(float) + 1);
    if (!buf) return DTR_OUT_OF_MEMORY;
    dtr__init_values(m->inits[i], m->init_args[i], &full, &rng, buf);
    dtr__shard_copy(s, s->rank, buf, x, 0);
    dtr__free(&m->ctx->alloc, buf);
    return DTR_OK;
}

dtr_result dtr__model_set_shard(dtr_model *m, dtr_tensor *t, const dtr__shard *s) {
    if (!m || !t || t->model != m || t->param_index < 0) return DTR_NULL_HANDLE;
    if (m->built) return dtr__fail(m->ctx, DTR_BAD_STATE, "'%s': a shard is declared before dtr_model_build", t->name);
    m->shards[t->param_index] = *s;
    return DTR_OK;
}

dtr_result dtr_model_build(dtr_model *m) {
    dtr_context *ctx;
    size_t bytes;
    float *host;
    int i;
    if (!m) return DTR_NULL_HANDLE;
    if (m->built) return DTR_OK;
    ctx = m->ctx;
    bytes = (size_t)(m->total ? m->total : 1) * sizeof(float);
    m->data = (float *)ctx->backend->mem_alloc(ctx, bytes);
    m->grad = (float *)ctx->backend->mem_alloc(ctx, bytes);
    host = dtr__host_memory(ctx) ? m->data : (float *)dtr__malloc(&ctx->alloc, bytes);
    if (!m->data || !m->grad || !host) {
        if (m->data) ctx->backend->mem_free(ctx, m->data);
        if (m->grad) ctx->backend->mem_free(ctx, m->grad);
        if (host && host != m->data) dtr__free(&ctx->alloc, host);
        m->data = m->grad = NULL;
        return dtr__fail(ctx, DTR_OUT_OF_MEMORY, "dtr_model_build: out of memory for %lld parameters", (long long)m->total);
    }
    memset(host, 0, bytes);
    for (i = 0; i < m->count; i++)
        if (dtr__model_init_param(m, i, host + m->offsets[i]) != DTR_OK) break;
    if (i < m->count) {
        ctx->backend->mem_free(ctx, m->data);
        ctx->backend->mem_free(ctx, m->grad);
        if (host != m->data) dtr__free(&ctx->alloc, host);
        m->data = m->grad = NULL;
        return dtr__fail(ctx, DTR_OUT_OF_MEMORY, "dtr_model_build: out of memory for the full tensor of '%s'", m->names[i]);
    }
    if (host != m->data) {
        ctx->backend->from_host(ctx, m->data, host, bytes);
        dtr__free(&ctx->alloc, host);
    }
    ctx->backend->memset0(ctx, m->grad, bytes);
    for (i = 0; i < m->count; i++) {
        m->params[i]->storage = m->data + m->offsets[i];
        m->params[i]->grad = m->grad + m->offsets[i];
    }
    m->built = 1;
    return DTR_OK;
}

/* ---- keeping a part of a model (a pipeline stage) ---- */

static int dtr__has_prefix(const char *name, const char *const *prefixes, int n) {
    int k;
    for (k = 0; k < n; k++)
        if (prefixes[k] && !strncmp(name, prefixes[k], strlen(prefixes[k]))) return 1;
    return 0;
}

/* moves parameter i to the dropped list (its struct stays valid: layers point at it) */
static int dtr__model_drop(dtr_model *m, int i) {
    void *p = dtr__realloc(&m->ctx->alloc, m->dropped, (size_t)(m->n_dropped + 1) * sizeof(*m->dropped));
    if (!p) return 0;
    m->dropped = (dtr_tensor **)p;
    m->dropped[m->n_dropped++] = m->params[i];
    m->params[i]->param_index = -1;
    return 1;
}

dtr_result dtr_model_keep(dtr_model *m, const char *const *prefixes, int n) {
    int i, kept = 0;
    if (!m) return DTR_NULL_HANDLE;
    if (n < 0 || (n && !prefixes)) return dtr__fail(m->ctx, DTR_INVALID_ARGUMENT, "dtr_model_keep: %d prefixes", n);
    if (m->built) return dtr__fail(m->ctx, DTR_BAD_STATE, "dtr_model_keep: the model is built already");
    m->total = 0;
    for (i = 0; i < m->count; i++) {
        dtr_tensor *t = m->params[i];
        if (!dtr__has_prefix(t->name, prefixes, n)) {
            if (!dtr__model_drop(m, i)) return dtr__fail(m->ctx, DTR_OUT_OF_MEMORY, "dtr_model_keep: out of memory");
            continue;
        }
        m->params[kept] = t, m->names[kept] = m->names[i], m->inits[kept] = m->inits[i];
        m->init_args[kept] = m->init_args[i], m->streams[kept] = m->streams[i], m->shards[kept] = m->shards[i];
        t->param_index = kept;
        m->offsets[kept++] = m->total;
        m->total += dtr__padded(t);
    }
    m->count = kept;
    return DTR_OK;
}

/* ---- queries ---- */

int dtr_model_param_count(const dtr_model *m) { return m ? m->count : 0; }

int64_t dtr_model_numel(const dtr_model *m) { return m ? m->total : 0; }

dtr_tensor *dtr_model_param_at(const dtr_model *m, int i) {
    return (m && i >= 0 && i < m->count) ? m->params[i] : NULL;
}

dtr_tensor *dtr_model_find(const dtr_model *m, const char *name) {
    int i;
    if (!m || !name) return NULL;
    for (i = 0; i < m->count; i++)
        if (!strcmp(m->names[i], name)) return m->params[i];
    return NULL;
}

int64_t dtr_model_param_offset(const dtr_model *m, int i) {
    return (m && i >= 0 && i < m->count) ? m->offsets[i] : -1;
}

float *dtr_model_params(dtr_model *m) { return m ? m->data : NULL; }
float *dtr_model_grads(dtr_model *m) { return m ? m->grad : NULL; }
dtr_context *dtr_model_context(const dtr_model *m) { return m ? m->ctx : NULL; }

dtr_result dtr_model_zero_grad(dtr_model *m) {
    if (!m) return DTR_NULL_HANDLE;
    if (!m->built) return DTR_OK;
    return m->ctx->backend->memset0(m->ctx, m->grad, (size_t)m->total * sizeof(float));
}

/* ---- save and load (safetensors) ---- */

/* Elements of parameter i in a file: the full tensor's for a shard. */
static int64_t dtr__file_numel(const dtr_model *m, int i) {
    const dtr__shard *s = &m->shards[i];
    return s->comm ? dtr__numel(s->ndim, s->full) : dtr_tensor_numel(m->params[i]);
}

/* Parameter i as the file holds it: its entry (name, dtype, full shape) and its values in dt
   at dst (a shard is gathered from its group first: collective). */
static dtr_result dtr__save_param(dtr_model *m, int i, dtr_dtype dt, dtr_st_entry *e, void *dst) {
    const dtr__shard *s = &m->shards[i];
    const dtr_tensor *t = m->params[i];
    int64_t n = dtr__file_numel(m, i);
    float *full;
    dtr_result r;
    int d;
    snprintf(e->name, sizeof(e->name), "%s", m->names[i]);
    e->dtype = dt;
    e->ndim = s->comm ? s->ndim : t->ndim;
    for (d = 0; d < e->ndim; d++) e->shape[d] = s->comm ? s->full[d] : t->shape[d];
    if (!s->comm) return dtr_tensor_read(t, dt, dst, (size_t)n);
    full = (float *)dtr__malloc(&m->ctx->alloc, (size_t)n * sizeof(float) + 1);
    if (!full) return dtr__fail(m->ctx, DTR_OUT_OF_MEMORY, "dtr_model_save: out of memory gathering '%s'", m->names[i]);
    r = dtr__shard_gather(m->ctx, s, t, full);
    if (r == DTR_OK) dtr_convert(dst, dt, full, DTR_F32, (size_t)n);
    dtr__free(&m->ctx->alloc, full);
    return r;
}

dtr_result dtr_model_save(dtr_model *m, const char *path, dtr_dtype dt) {
    dtr_context *ctx;
    dtr_st_entry *ents = NULL;
    const void **data = NULL;
    void *conv = NULL;
    size_t es, off = 0;
    int64_t total = 0;
    char err[512];
    dtr_result r;
    int i, writer = 1;
    if (!m || !path) return DTR_NULL_HANDLE;
    ctx = m->ctx;
    if (dt != DTR_F32 && dt != DTR_BF16 && dt != DTR_F16)
        return dtr__fail(ctx, DTR_DTYPE_MISMATCH, "dtr_model_save: %s: weights are saved as f32, bf16 or f16, not %s", path,
                         dtr_dtype_name(dt));
    r = dtr_model_build(m);
    if (r != DTR_OK) return r;
    es = dtr_dtype_size(dt);
    for (i = 0; i < m->count; i++) {
        total += dtr__file_numel(m, i);
        if (m->shards[i].comm && m->shards[i].rank) writer = 0;   /* rank 0 of a tensor-parallel group writes */
    }
    ents = (dtr_st_entry *)dtr__calloc(&ctx->alloc, (size_t)(m->count ? m->count : 1) * sizeof(*ents));
    data = (const void **)dtr__calloc(&ctx->alloc, (size_t)(m->count ? m->count : 1) * sizeof(*data));
    conv = dtr__malloc(&ctx->alloc, (size_t)(total ? total : 1) * es);
    if (!ents || !data || !conv) { r = dtr__fail(ctx, DTR_OUT_OF_MEMORY, "dtr_model_save: %s: out of memory", path); goto done; }
    for (i = 0; i < m->count; i++) {
        data[i] = (char *)conv + off;
        r = dtr__save_param(m, i, dt, &ents[i], (char *)conv + off);
        if (r != DTR_OK) goto done;
        off += (size_t)dtr__file_numel(m, i) * es;
    }
    r = writer ? dtr_st_write(path, ents, data, m->count, err, sizeof(err)) : DTR_OK;
    if (r != DTR_OK) dtr__fail(ctx, r, "dtr_model_save: %s", err);
done:
    dtr__free(&ctx->alloc, ents);
    dtr__free(&ctx->alloc, (void *)data);
    dtr__free(&ctx->alloc, conv);
    return r;
}

/* The shape parameter i has in a file: its own, or (in *buf) the full tensor's for a shard. */
static const dtr_tensor *dtr__file_shape(const dtr_model *m, int i, dtr_tensor *buf) {
    const dtr__shard *s = &m->shards[i];
    if (!s->comm) return m->params[i];
    *buf = *m->params[i];
    buf->ndim = s->ndim;
    memcpy(buf->shape, s->full, sizeof buf->shape);
    return buf;
}

/* Converts entry e (checked against the file shape) into parameter i's f32 values at x. */
static dtr_result dtr__load_param(dtr_model *m, int i, const dtr_st_entry *e, float *x) {
    const dtr__shard *s = &m->shards[i];
    int64_t n = dtr__file_numel(m, i);
    float *full;
    if (!s->comm) return dtr_convert(x, DTR_F32, e->data, e->dtype, (size_t)n);
    full = (float *)dtr__malloc(&m->ctx->alloc, (size_t)n * sizeof(float) + 1);
    if (!full) return dtr__fail(m->ctx, DTR_OUT_OF_MEMORY, "dtr_model_load: out of memory for '%s'", m->names[i]);
    dtr_convert(full, DTR_F32, e->data, e->dtype, (size_t)n);
    dtr__shard_copy(s, s->rank, full, x, 0);
    dtr__free(&m->ctx->alloc, full);
    return DTR_OK;
}

dtr_result dtr_model_load(dtr_model *m, const char *path) {
    dtr_context *ctx;
    dtr_st_file f;
    float *stage = NULL;
    char err[512], s1[96], s2[96];
    dtr_result r;
    int i, j, d;
    if (!m || !path) return DTR_NULL_HANDLE;
    ctx = m->ctx;
    r = dtr_model_build(m);
    if (r != DTR_OK) return r;
    r = dtr_st_open(path, &ctx->alloc, &f, err, sizeof(err));
    if (r != DTR_OK) return dtr__fail(ctx, r, "dtr_model_load: %s", err);
    /* convert everything into a staging copy first: on any error the model is untouched */
    stage = (float *)dtr__malloc(&ctx->alloc, (size_t)(m->total ? m->total : 1) * sizeof(float));
    if (!stage) { r = dtr__fail(ctx, DTR_OUT_OF_MEMORY, "dtr_model_load: %s: out of memory", path); goto done; }
    for (i = 0; i < m->count; i++) {
        dtr_tensor want;
        const dtr_tensor *t = dtr__file_shape(m, i, &want);
        const dtr_st_entry *e = NULL;
        for (j = 0; j < f.count; j++)
            if (!strcmp(f.entries[j].name, m->names[i])) { e = &f.entries[j]; break; }
        if (!e) { r = dtr__fail(ctx, DTR_NOT_FOUND, "dtr_model_load: %s has no tensor '%s'", path, m->names[i]); goto done; }
        if (e->ndim != t->ndim) goto shape;
        for (d = 0; d < t->ndim; d++)
            if (e->shape[d] != t->shape[d]) goto shape;
        if (e->foreign || (e->dtype != DTR_F32 && e->dtype != DTR_BF16 && e->dtype != DTR_F16)) {
            r = dtr__fail(ctx, DTR_DTYPE_MISMATCH, "dtr_model_load: %s: tensor '%s' is %s; weights must be F32, BF16 or F16",
                          path, m->names[i], e->dtype_name);
            goto done;
        }
        if ((r = dtr__load_param(m, i, e, stage + m->offsets[i])) != DTR_OK) goto done;
        continue;
    shape: {
        dtr_tensor fs; /* the file's shape, for the message */
        memset(&fs, 0, sizeof fs);
        fs.ndim = e->ndim >= 0 && e->ndim <= DTR_MAX_DIMS ? e->ndim : 0;
        for (d = 0; d < fs.ndim; d++) fs.shape[d] = e->shape[d];
        r = dtr__fail(ctx, DTR_SHAPE_MISMATCH, "dtr_model_load: %s: tensor '%s' is %s in the file, %s in the model", path,
                      m->names[i], dtr__shape_str(&fs, s2, sizeof s2), dtr__shape_str(t, s1, sizeof s1));
        goto done;
    }
    }
    for (i = 0; i < m->count; i++) {
        r = ctx->backend->from_host(ctx, m->data + m->offsets[i], stage + m->offsets[i],
                                    (size_t)dtr_tensor_numel(m->params[i]) * sizeof(float));
        if (r != DTR_OK) { dtr__fail(ctx, r, "dtr_model_load: %s: copy to the device failed", path); goto done; }
    }
    r = DTR_OK;
done:
    dtr__free(&ctx->alloc, stage);
    dtr_st_destroy(&f);
    return r;
}

/* ---- state ---- */

dtr_result dtr_model_state(dtr_model *m, int index, dtr_state_entry *out) {
    dtr_result r;
    size_t bytes;
    if (!m || !out) return DTR_NULL_HANDLE;
    if ((r = dtr_model_build(m)) != DTR_OK) return r;
    bytes = (size_t)m->total * sizeof(float);
    if (index == 0) return dtr__state_put(out, "params", m->data, bytes, !dtr__host_memory(m->ctx));
    if (index == 1) return dtr__state_put(out, "grads", m->grad, bytes, !dtr__host_memory(m->ctx));
    return DTR_NOT_FOUND;
}

dtr_result dtr_model_state_loaded(dtr_model *m) { return m ? DTR_OK : DTR_NULL_HANDLE; }
#line 8724 "dtrain.h"

/* ---- src/nn/layers.c ---- */
#line 1 "src/nn/layers.c"
/* ============================================================================
 * Layers: constructors that declare named parameters on a model, and forward passes made
 * of ops (so autograd covers them). Shapes: x (..., in) for linear, (N, C, H, W) for conv,
 * (B, T, C) for attention and GPT blocks.
 * ==========================================================================*/


#include <math.h>

dtr_tensor *dtr__named_param(dtr_model *m, const char *prefix, const char *suffix, int ndim, const int64_t *shape,
                             dtr_init init, float arg) {
    char name[256];
    if (!prefix) prefix = "";
    if ((size_t)snprintf(name, sizeof(name), "%s%s%s", prefix, *prefix ? "." : "", suffix) >= sizeof(name))
        return dtr__failt(dtr_model_context(m), DTR_INVALID_ARGUMENT, "layer name '%.40s...' is too long", prefix);
    return dtr_model_param(m, name, ndim, shape, init, arg);
}

static dtr_result dtr__layer_status(dtr_model *m) {
    return m ? dtr_context_status(dtr_model_context(m)) : DTR_NULL_HANDLE;
}

/* ---- linear ---- */

dtr_result dtr_linear_layer_init(dtr_linear_layer *l, dtr_model *m, const char *name, int64_t in, int64_t out, int bias,
                                 dtr_init init) {
    int64_t ws[2];
    if (!l || !m) return DTR_NULL_HANDLE;
    memset(l, 0, sizeof(*l));
    if (in <= 0 || out <= 0)
        return dtr__fail(dtr_model_context(m), DTR_INVALID_ARGUMENT, "dtr_linear_layer_init: '%s' needs in, out > 0", name ? name : "");
    ws[0] = out; ws[1] = in;
    l->in = in;
    l->out = out;
    l->weight = dtr__named_param(m, name, "weight", 2, ws, init, 0.0f);
    if (bias) l->bias = dtr__named_param(m, name, "bias", 1, &out, DTR_INIT_UNIFORM, (float)(1.0 / sqrt((double)in)));
    return dtr__layer_status(m);
}

dtr_tensor *dtr_linear_layer_forward(dtr_context *ctx, const dtr_linear_layer *l, dtr_tensor *x) {
    if (!ctx) return NULL;
    if (!l) return dtr__failt(ctx, DTR_NULL_HANDLE, "dtr_linear_layer_forward: layer is NULL");
    return dtr_linear(ctx, x, l->weight, l->bias);
}

/* ---- conv2d ---- */

dtr_result dtr_conv2d_layer_init(dtr_conv2d_layer *l, dtr_model *m, const char *name, int64_t in, int64_t out, int k,
                                 int stride, int padding, dtr_init init) {
    int64_t ws[4];
    if (!l || !m) return DTR_NULL_HANDLE;
    memset(l, 0, sizeof(*l));
    if (in <= 0 || out <= 0 || k <= 0 || stride <= 0 || padding < 0)
        return dtr__fail(dtr_model_context(m), DTR_INVALID_ARGUMENT, "dtr_conv2d_layer_init: '%s' has a bad geometry",
                         name ? name : "");
    ws[0] = out; ws[1] = in; ws[2] = k; ws[3] = k;
    l->in = in; l->out = out; l->k = k; l->stride = stride; l->padding = padding;
    l->weight = dtr__named_param(m, name, "weight", 4, ws, init, 0.0f);
    l->bias = dtr__named_param(m, name, "bias", 1, &out, DTR_INIT_UNIFORM, (float)(1.0 / sqrt((double)(in * k * k))));
    return dtr__layer_status(m);
}

dtr_tensor *dtr_conv2d_layer_forward(dtr_context *ctx, const dtr_conv2d_layer *l, dtr_tensor *x) {
    if (!ctx) return NULL;
    if (!l) return dtr__failt(ctx, DTR_NULL_HANDLE, "dtr_conv2d_layer_forward: layer is NULL");
    return dtr_conv2d(ctx, x, l->weight, l->bias, l->stride, l->padding);
}

/* ---- layer norm, embedding ---- */

dtr_result dtr_layernorm_layer_init(dtr_layernorm_layer *l, dtr_model *m, const char *name, int64_t dim) {
    if (!l || !m) return DTR_NULL_HANDLE;
    memset(l, 0, sizeof(*l));
    if (dim <= 0) return dtr__fail(dtr_model_context(m), DTR_INVALID_ARGUMENT, "dtr_layernorm_layer_init: dim must be > 0");
    l->dim = dim;
    l->eps = 1e-5f;
    l->weight = dtr__named_param(m, name, "weight", 1, &dim, DTR_INIT_ONES, 0.0f);
    l->bias = dtr__named_param(m, name, "bias", 1, &dim, DTR_INIT_ZEROS, 0.0f);
    return dtr__layer_status(m);
}

dtr_tensor *dtr_layernorm_layer_forward(dtr_context *ctx, const dtr_layernorm_layer *l, dtr_tensor *x) {
    if (!ctx) return NULL;
    if (!l) return dtr__failt(ctx, DTR_NULL_HANDLE, "dtr_layernorm_layer_forward: layer is NULL");
    return dtr_layernorm(ctx, x, l->weight, l->bias, l->eps);
}

dtr_result dtr_embedding_layer_init(dtr_embedding_layer *l, dtr_model *m, const char *name, int64_t vocab, int64_t dim) {
    int64_t s[2];
    if (!l || !m) return DTR_NULL_HANDLE;
    memset(l, 0, sizeof(*l));
    if (vocab <= 0 || dim <= 0)
        return dtr__fail(dtr_model_context(m), DTR_INVALID_ARGUMENT, "dtr_embedding_layer_init: vocab and dim must be > 0");
    s[0] = vocab; s[1] = dim;
    l->vocab = vocab;
    l->dim = dim;
    l->weight = dtr__named_param(m, name, "weight", 2, s, DTR_INIT_NORMAL, 0.02f);
    return dtr__layer_status(m);
}

dtr_tensor *dtr_embedding_layer_forward(dtr_context *ctx, const dtr_embedding_layer *l, dtr_tensor *ids) {
    if (!ctx) return NULL;
    if (!l) return dtr__failt(ctx, DTR_NULL_HANDLE, "dtr_embedding_layer_forward: layer is NULL");
    return dtr_embedding(ctx, l->weight, ids);
}

/* ---- attention and the GPT block ---- */

dtr_result dtr_attention_layer_init(dtr_attention_layer *l, dtr_model *m, const char *name, int64_t dim, int heads) {
    char sub[256];
    if (!l || !m) return DTR_NULL_HANDLE;
    memset(l, 0, sizeof(*l));
    if (dim <= 0 || heads <= 0 || dim % heads)
        return dtr__fail(dtr_model_context(m), DTR_INVALID_ARGUMENT, "dtr_attention_layer_init: %d heads must divide dim %lld",
                         heads, (long long)dim);
    l->dim = dim;
    l->heads = heads;
    snprintf(sub, sizeof(sub), "%s%sqkv", name ? name : "", name && *name ? "." : "");
    dtr_linear_layer_init(&l->qkv, m, sub, dim, 3 * dim, 1, DTR_INIT_TORCH_DEFAULT);
    snprintf(sub, sizeof(sub), "%s%sproj", name ? name : "", name && *name ? "." : "");
    dtr_linear_layer_init(&l->proj, m, sub, dim, dim, 1, DTR_INIT_TORCH_DEFAULT);
    return dtr__layer_status(m);
}

dtr_tensor *dtr_attention_layer_forward(dtr_context *ctx, const dtr_attention_layer *l, dtr_tensor *x) {
    dtr_tensor *qkv, *q, *k, *v;
    int64_t C;
    if (!ctx) return NULL;
    if (!l) return dtr__failt(ctx, DTR_NULL_HANDLE, "dtr_attention_layer_forward: layer is NULL");
    C = l->dim;
    qkv = dtr_linear_layer_forward(ctx, &l->qkv, x);   /* (B, T, 3C) */
    q = dtr_slice(ctx, qkv, -1, 0, C);
    k = dtr_slice(ctx, qkv, -1, C, 2 * C);
    v = dtr_slice(ctx, qkv, -1, 2 * C, 3 * C);
    return dtr_linear_layer_forward(ctx, &l->proj, dtr_attention(ctx, q, k, v, l->heads));
}

dtr_result dtr_gpt_block_init(dtr_gpt_block *b, dtr_model *m, const char *name, int64_t dim, int heads) {
    char sub[256];
    const char *p = name ? name : "", *dot = name && *name ? "." : "";
    if (!b || !m) return DTR_NULL_HANDLE;
    memset(b, 0, sizeof(*b));
    snprintf(sub, sizeof(sub), "%s%sln1", p, dot);
    dtr_layernorm_layer_init(&b->ln1, m, sub, dim);
    snprintf(sub, sizeof(sub), "%s%sattn", p, dot);
    dtr_attention_layer_init(&b->attn, m, sub, dim, heads);
    snprintf(sub, sizeof(sub), "%s%sln2", p, dot);
    dtr_layernorm_layer_init(&b->ln2, m, sub, dim);
    snprintf(sub, sizeof(sub), "%s%sfc", p, dot);
    dtr_linear_layer_init(&b->fc, m, sub, dim, 4 * dim, 1, DTR_INIT_TORCH_DEFAULT);
    snprintf(sub, sizeof(sub), "%s%sfc_proj", p, dot);
    dtr_linear_layer_init(&b->fc_proj, m, sub, 4 * dim, dim, 1, DTR_INIT_TORCH_DEFAULT);
    return dtr__layer_status(m);
}

dtr_tensor *dtr_gpt_block_forward(dtr_context *ctx, const dtr_gpt_block *b, dtr_tensor *x) {
    dtr_tensor *h;
    if (!ctx) return NULL;
    if (!b) return dtr__failt(ctx, DTR_NULL_HANDLE, "dtr_gpt_block_forward: block is NULL");
    h = dtr_attention_layer_forward(ctx, &b->attn, dtr_layernorm_layer_forward(ctx, &b->ln1, x));
    x = dtr_add(ctx, x, h);
    h = dtr_layernorm_layer_forward(ctx, &b->ln2, x);
    h = dtr_linear_layer_forward(ctx, &b->fc_proj, dtr_gelu(ctx, dtr_linear_layer_forward(ctx, &b->fc, h)));
    return dtr_add(ctx, x, h);
}
#line 8893 "dtrain.h"

/* ---- src/nn/tensor_parallel.c ---- */
#line 1 "src/nn/tensor_parallel.c"
/* ============================================================================
 * Tensor-parallel layers (Megatron-LM): each rank of a group holds a shard of a layer's
 * weights and the communication ops of src/ops/ops_comm.c join the partial results.
 *   column-parallel linear  y_r = x W_r^T + b_r   (W_r: rows r * out / tp ..), after tp_copy
 *   row-parallel linear     y = tp_reduce(x_r W_r^T) + b   (W_r: columns r * in / tp ..)
 *   attention               qkv column-parallel over this rank's heads, proj row-parallel
 *   embedding               rows r * vocab / tp ..; the others' ids give zero rows; tp_reduce
 * Shards are model parameters marked with a dtr__shard (model.c initialises, saves and loads
 * them as slices of the full tensor).
 * ==========================================================================*/




#include <math.h>

/* ---- shards ---- */

void dtr__shard_copy(const dtr__shard *s, int rank, float *full, float *part, int to_full) {
    int64_t outer = 1, inner = 1, c, o;
    int d, p;
    for (d = 0; d < s->axis; d++) outer *= s->full[d];
    for (d = s->axis + 1; d < s->ndim; d++) inner *= s->full[d];
    c = s->full[s->axis] / s->parts / s->ways * inner;   /* floats of one block's slice */
    for (o = 0; o < outer; o++)
        for (p = 0; p < s->parts; p++) {
            float *f = full + ((o * s->parts + p) * s->ways + rank) * c, *q = part + (o * s->parts + p) * c;
            memcpy(to_full ? f : q, to_full ? q : f, (size_t)c * sizeof(float));
        }
}

dtr_result dtr__shard_gather(dtr_context *ctx, const dtr__shard *s, const dtr_tensor *t, float *full) {
    int64_t n = dtr_tensor_numel(t);
    float *buf = (float *)dtr__malloc(&ctx->alloc, (size_t)(n * s->ways + 1) * sizeof(float));
    dtr_result r;
    int k;
    if (!buf) return dtr__fail(ctx, DTR_OUT_OF_MEMORY, "gathering '%s': out of memory", t->name);
    r = dtr_tensor_read(t, DTR_F32, buf + s->rank * n, (size_t)n);
    if (r == DTR_OK) r = dtr_comm_all_gather(s->comm, buf + s->rank * n, buf, (size_t)n, DTR_F32);
    if (r != DTR_OK) dtr__fail(ctx, r, "gathering '%s' over the tensor-parallel group: %s", t->name, dtr_comm_last_error(s->comm));
    for (k = 0; r == DTR_OK && k < s->ways; k++) dtr__shard_copy(s, k, full, buf + k * n, 1);
    dtr__free(&ctx->alloc, buf);
    return r;
}

/* Declares "prefix.suffix" as this rank's shard of a full tensor of shape `full` split along
   `axis` (in `parts` blocks); a group of one holds the whole tensor. */
static dtr_tensor *dtr__tp_param(dtr_model *m, dtr_comm *comm, const char *prefix, const char *suffix, int ndim,
                                 const int64_t *full, int axis, int parts, dtr_init init, float arg) {
    dtr__shard s;
    int64_t shape[DTR_MAX_DIMS];
    dtr_tensor *t;
    memset(&s, 0, sizeof s);
    s.comm = comm, s.rank = dtr_comm_rank(comm), s.ways = dtr_comm_size(comm);
    s.axis = axis, s.parts = parts, s.ndim = ndim;
    memcpy(s.full, full, (size_t)ndim * sizeof(*full));
    memcpy(shape, full, (size_t)ndim * sizeof(*full));
    shape[axis] = full[axis] / s.ways;
    t = dtr__named_param(m, prefix, suffix, ndim, shape, init, arg);
    if (t && s.ways > 1) dtr__model_set_shard(m, t, &s);
    return t;
}

/* "prefix.suffix" into buf (as the single-device layers name their parts) */
static const char *dtr__tp_sub(char *buf, size_t n, const char *prefix, const char *suffix) {
    snprintf(buf, n, "%s%s%s", prefix ? prefix : "", prefix && *prefix ? "." : "", suffix);
    return buf;
}

static dtr_result dtr__tp_status(dtr_model *m) { return dtr_context_status(dtr_model_context(m)); }

/* The group's size, or 0 with DTR_NULL_HANDLE recorded for a NULL group. */
static int dtr__tp_size(dtr_model *m, dtr_comm *comm, const char *fn, const char *name) {
    if (comm) return dtr_comm_size(comm);
    dtr__fail(dtr_model_context(m), DTR_NULL_HANDLE, "%s: '%s': comm is NULL", fn, name ? name : "");
    return 0;
}

/* ---- linear ---- */

static dtr_result dtr__tp_linear_init(dtr_tp_linear *l, dtr_model *m, dtr_comm *comm, const char *name, int64_t in,
                                      int64_t out, int bias, dtr_init init, int row, int parts) {
    const char *fn = row ? "dtr_tp_row_linear_init" : "dtr_tp_column_linear_init";
    int64_t ws[2], split;
    int tp;
    if (!l || !m) return DTR_NULL_HANDLE;
    memset(l, 0, sizeof(*l));
    if (!(tp = dtr__tp_size(m, comm, fn, name))) return DTR_NULL_HANDLE;
    split = row ? in : out;
    if (in <= 0 || out <= 0 || split % ((int64_t)parts * tp))
        return dtr__fail(dtr_model_context(m), DTR_INVALID_ARGUMENT,
                         "%s: '%s': %s features %lld do not split over %d ranks (in %lld, out %lld)", fn, name ? name : "",
                         row ? "input" : "output", (long long)split, tp, (long long)in, (long long)out);
    ws[0] = out, ws[1] = in;
    l->in = in, l->out = out, l->row = row, l->comm = comm;
    l->weight = dtr__tp_param(m, comm, name, "weight", 2, ws, row, parts, init, 0.0f);
    if (bias && row) l->bias = dtr__named_param(m, name, "bias", 1, &out, DTR_INIT_UNIFORM, (float)(1.0 / sqrt((double)in)));
    else if (bias) l->bias = dtr__tp_param(m, comm, name, "bias", 1, &out, 0, parts, DTR_INIT_UNIFORM, (float)(1.0 / sqrt((double)in)));
    return dtr__tp_status(m);
}

dtr_result dtr_tp_column_linear_init(dtr_tp_linear *l, dtr_model *m, dtr_comm *comm, const char *name, int64_t in,
                                     int64_t out, int bias, dtr_init init, int gather) {
    dtr_result r = dtr__tp_linear_init(l, m, comm, name, in, out, bias, init, 0, 1);
    if (r == DTR_OK) l->gather = gather;
    return r;
}

dtr_result dtr_tp_row_linear_init(dtr_tp_linear *l, dtr_model *m, dtr_comm *comm, const char *name, int64_t in,
                                  int64_t out, int bias, dtr_init init) {
    return dtr__tp_linear_init(l, m, comm, name, in, out, bias, init, 1, 1);
}

dtr_tensor *dtr_tp_linear_forward(dtr_context *ctx, const dtr_tp_linear *l, dtr_tensor *x) {
    dtr_tensor *y;
    if (!ctx) return NULL;
    if (!l || !l->comm) return dtr__failt(ctx, DTR_NULL_HANDLE, "dtr_tp_linear_forward: layer is NULL or not initialised");
    if (!l->row) {
        y = dtr_linear(ctx, dtr_tp_copy(ctx, x, l->comm), l->weight, l->bias);
        return l->gather ? dtr_tp_gather(ctx, y, l->comm) : y;
    }
    y = dtr_tp_reduce(ctx, dtr_linear(ctx, x, l->weight, NULL), l->comm);
    return l->bias ? dtr_add(ctx, y, l->bias) : y;
}

/* ---- attention ---- */

dtr_result dtr_tp_attention_init(dtr_tp_attention *a, dtr_model *m, dtr_comm *comm, const char *name, int64_t dim,
                                 int heads) {
    char sub[256];
    int tp;
    if (!a || !m) return DTR_NULL_HANDLE;
    memset(a, 0, sizeof(*a));
    if (!(tp = dtr__tp_size(m, comm, "dtr_tp_attention_init", name))) return DTR_NULL_HANDLE;
    if (dim <= 0 || heads <= 0 || dim % heads || heads % tp)
        return dtr__fail(dtr_model_context(m), DTR_INVALID_ARGUMENT,
                         "dtr_tp_attention_init: '%s': %d heads must divide dim %lld and split evenly over %d ranks",
                         name ? name : "", heads, (long long)dim, tp);
    a->dim = dim, a->heads = heads, a->local_heads = heads / tp;
    dtr__tp_linear_init(&a->qkv, m, comm, dtr__tp_sub(sub, sizeof sub, name, "qkv"), dim, 3 * dim, 1,
                        DTR_INIT_TORCH_DEFAULT, 0, 3);
    dtr_tp_row_linear_init(&a->proj, m, comm, dtr__tp_sub(sub, sizeof sub, name, "proj"), dim, dim, 1, DTR_INIT_TORCH_DEFAULT);
    return dtr__tp_status(m);
}

dtr_tensor *dtr_tp_attention_forward(dtr_context *ctx, const dtr_tp_attention *a, dtr_tensor *x) {
    dtr_tensor *qkv, *q, *k, *v;
    int64_t C;
    if (!ctx) return NULL;
    if (!a || !a->local_heads) return dtr__failt(ctx, DTR_NULL_HANDLE, "dtr_tp_attention_forward: layer is NULL or not initialised");
    C = a->dim / a->heads * a->local_heads;   /* this rank's features */
    qkv = dtr_tp_linear_forward(ctx, &a->qkv, x);   /* (B, T, 3C): its q | k | v */
    q = dtr_slice(ctx, qkv, -1, 0, C);
    k = dtr_slice(ctx, qkv, -1, C, 2 * C);
    v = dtr_slice(ctx, qkv, -1, 2 * C, 3 * C);
    return dtr_tp_linear_forward(ctx, &a->proj, dtr_attention(ctx, q, k, v, a->local_heads));
}

/* ---- embedding ---- */

dtr_result dtr_tp_embedding_init(dtr_tp_embedding *e, dtr_model *m, dtr_comm *comm, const char *name, int64_t vocab,
                                 int64_t dim) {
    int64_t s[2];
    int tp;
    if (!e || !m) return DTR_NULL_HANDLE;
    memset(e, 0, sizeof(*e));
    if (!(tp = dtr__tp_size(m, comm, "dtr_tp_embedding_init", name))) return DTR_NULL_HANDLE;
    if (vocab <= 0 || dim <= 0 || vocab % tp)
        return dtr__fail(dtr_model_context(m), DTR_INVALID_ARGUMENT,
                         "dtr_tp_embedding_init: '%s': vocab %lld must be > 0 and split evenly over %d ranks (dim %lld)",
                         name ? name : "", (long long)vocab, tp, (long long)dim);
    s[0] = vocab, s[1] = dim;
    e->vocab = vocab, e->dim = dim, e->comm = comm;
    e->start = vocab / tp * dtr_comm_rank(comm);
    e->weight = dtr__tp_param(m, comm, name, "weight", 2, s, 0, 1, DTR_INIT_NORMAL, 0.02f);
    return dtr__tp_status(m);
}

/* ids -> this rank's rows (0 for ids it does not hold) and a mask (S..., 1) of the ids it holds */
static dtr_result dtr__tp_local_ids(dtr_context *ctx, const dtr_tp_embedding *e, const int32_t *ids, int64_t n,
                                    int32_t *local, float *mask) {
    int64_t i, rows = e->vocab / dtr_comm_size(e->comm);
    for (i = 0; i < n; i++) {
        int64_t j = (int64_t)ids[i] - e->start;
        if (ids[i] < 0 || ids[i] >= e->vocab)
            return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_tp_embedding_forward: id %lld is %d, outside [0, %lld)",
                             (long long)i, (int)ids[i], (long long)e->vocab);
        mask[i] = j >= 0 && j < rows ? 1.0f : 0.0f;
        local[i] = mask[i] != 0.0f ? (int32_t)j : 0;
    }
    return DTR_OK;
}

dtr_tensor *dtr_tp_embedding_forward(dtr_context *ctx, const dtr_tp_embedding *e, dtr_tensor *ids) {
    int64_t n, shape[DTR_MAX_DIMS];
    int32_t *buf;
    dtr_tensor *rows = NULL, *mask;
    int d;
    if (!ctx) return NULL;
    if (!e || !e->comm) return dtr__failt(ctx, DTR_NULL_HANDLE, "dtr_tp_embedding_forward: layer is NULL or not initialised");
    if (!ids || ids->dtype != DTR_I32 || ids->ndim >= DTR_MAX_DIMS)
        return dtr__failt(ctx, ids ? DTR_DTYPE_MISMATCH : DTR_NULL_HANDLE, "dtr_tp_embedding_forward: ids must be i32 of at most %d dims",
                          DTR_MAX_DIMS - 1);
    n = dtr_tensor_numel(ids);
    buf = (int32_t *)dtr__malloc(&ctx->alloc, (size_t)(2 * n + 1) * sizeof(int32_t) + (size_t)n * sizeof(float));
    if (!buf) return dtr__failt(ctx, DTR_OUT_OF_MEMORY, "dtr_tp_embedding_forward: out of memory");
    for (d = 0; d < ids->ndim; d++) shape[d] = ids->shape[d];
    shape[ids->ndim] = 1;
    if (dtr_tensor_read(ids, DTR_I32, buf, (size_t)n) == DTR_OK &&
        dtr__tp_local_ids(ctx, e, buf, n, buf + n, (float *)(buf + 2 * n + 1)) == DTR_OK) {
        rows = dtr_embedding(ctx, e->weight, dtr_tensor_from(ctx, DTR_I32, ids->ndim, ids->shape, buf + n));
        mask = dtr_tensor_from(ctx, DTR_F32, ids->ndim + 1, shape, buf + 2 * n + 1);
        rows = dtr_tp_reduce(ctx, dtr_mul(ctx, rows, mask), e->comm);
    }
    dtr__free(&ctx->alloc, buf);
    return rows;
}

/* ---- the GPT block ---- */

dtr_result dtr_tp_gpt_block_init(dtr_tp_gpt_block *b, dtr_model *m, dtr_comm *comm, const char *name, int64_t dim,
                                 int heads) {
    char sub[256];
    if (!b || !m) return DTR_NULL_HANDLE;
    memset(b, 0, sizeof(*b));
    dtr_layernorm_layer_init(&b->ln1, m, dtr__tp_sub(sub, sizeof sub, name, "ln1"), dim);
    if (dtr_tp_attention_init(&b->attn, m, comm, dtr__tp_sub(sub, sizeof sub, name, "attn"), dim, heads) != DTR_OK)
        return dtr__tp_status(m);
    dtr_layernorm_layer_init(&b->ln2, m, dtr__tp_sub(sub, sizeof sub, name, "ln2"), dim);
    dtr_tp_column_linear_init(&b->fc, m, comm, dtr__tp_sub(sub, sizeof sub, name, "fc"), dim, 4 * dim, 1,
                              DTR_INIT_TORCH_DEFAULT, 0);
    dtr_tp_row_linear_init(&b->fc_proj, m, comm, dtr__tp_sub(sub, sizeof sub, name, "fc_proj"), 4 * dim, dim, 1,
                           DTR_INIT_TORCH_DEFAULT);
    return dtr__tp_status(m);
}

dtr_tensor *dtr_tp_gpt_block_forward(dtr_context *ctx, const dtr_tp_gpt_block *b, dtr_tensor *x) {
    dtr_tensor *h;
    if (!ctx) return NULL;
    if (!b) return dtr__failt(ctx, DTR_NULL_HANDLE, "dtr_tp_gpt_block_forward: block is NULL");
    h = dtr_tp_attention_forward(ctx, &b->attn, dtr_layernorm_layer_forward(ctx, &b->ln1, x));
    x = dtr_add(ctx, x, h);
    h = dtr_tp_linear_forward(ctx, &b->fc, dtr_layernorm_layer_forward(ctx, &b->ln2, x));
    return dtr_add(ctx, x, dtr_tp_linear_forward(ctx, &b->fc_proj, dtr_gelu(ctx, h)));
}
#line 9142 "dtrain.h"

/* ---- src/optim/optim.c ---- */
#line 1 "src/optim/optim.c"
/* ============================================================================
 * Optimizers (SGD, Adam, AdamW, LAMB) as fused updates over the model's contiguous
 * buffers, learning-rate schedules, gradient clipping and accumulation.
 * The update formulas follow torch.optim (SGD, Adam, AdamW) and You et al. 2019 (LAMB).
 * ==========================================================================*/


#include <math.h>

struct dtr_optimizer {
    dtr_model *model;
    dtr_optimizer_config cfg;
    float *m, *v, *work;      /* backend memory, len floats each (NULL when unused) */
    int64_t base, len;        /* the floats it updates: [base, base + len) of the model's buffers */
    int64_t *seg_begin, *seg_end;   /* LAMB: its parameters' ranges, relative to base (with
                                       shard_sum: their parts inside the shard) */
    int *seg_param;           /* LAMB: the parameter of each segment */
    int nseg;
    int64_t steps;            /* updates applied */
    int micro;                /* micro-batches since the last update */
};

/* ---- schedules ---- */

float dtr_schedule_lr(const dtr_schedule *s, int64_t step) {
    double lr, t;
    if (!s) return 0.0f;
    if (step < 0) step = 0;
    if (s->warmup_steps > 0 && step < s->warmup_steps) return (float)(s->lr * (double)(step + 1) / (double)s->warmup_steps);
    t = (double)(step - (s->warmup_steps > 0 ? s->warmup_steps : 0));
    switch (s->kind) {
    case DTR_SCHED_STEP:
        lr = s->lr * pow(s->gamma, floor(t / (double)(s->step_size > 0 ? s->step_size : 1)));
        break;
    case DTR_SCHED_COSINE:
        if (s->total_steps <= 0 || t >= (double)s->total_steps) lr = s->min_lr;
        else lr = s->min_lr + 0.5 * (s->lr - s->min_lr) * (1.0 + cos(3.14159265358979323846 * t / (double)s->total_steps));
        break;
    default: lr = s->lr; break;
    }
    return (float)lr;
}

/* ---- configuration ---- */

dtr_optimizer_config dtr_optimizer_config_init(dtr_optimizer_kind kind, float lr) {
    dtr_optimizer_config c;
    memset(&c, 0, sizeof(c));
    c.kind = kind;
    c.schedule.kind = DTR_SCHED_CONSTANT;
    c.schedule.lr = lr;
    c.schedule.gamma = 0.1f;
    c.beta1 = 0.9;
    c.beta2 = 0.999;
    c.eps = kind == DTR_OPT_LAMB ? 1e-6f : 1e-8f;
    c.weight_decay = kind == DTR_OPT_ADAMW ? 0.01f : 0.0f;
    c.grad_accum_steps = 1;
    return c;
}

/* 1 when x is 0, the buffer's end, or where a parameter starts or ends */
static int dtr__on_boundary(const dtr_model *m, int64_t x) {
    int i;
    if (x == 0 || x == dtr_model_numel(m)) return 1;
    for (i = 0; i < dtr_model_param_count(m); i++) {
        int64_t b = dtr_model_param_offset(m, i);
        if (x == b || x == b + dtr_tensor_numel(dtr_model_param_at(m, i))) return 1;
    }
    return 0;
}

static dtr_result dtr__check_shard(dtr_model *m, const dtr_optimizer_config *cfg) {
    if (cfg->shard_end <= 0 && cfg->shard_begin == 0) return DTR_OK;
    if (cfg->shard_begin < 0 || cfg->shard_end < cfg->shard_begin || cfg->shard_end > dtr_model_numel(m))
        return dtr__fail(dtr_model_context(m), DTR_INVALID_ARGUMENT, "dtr_optimizer_create: shard [%lld, %lld) is not a "
                         "range of the parameter buffer (%lld floats)", (long long)cfg->shard_begin,
                         (long long)cfg->shard_end, (long long)dtr_model_numel(m));
    if (cfg->kind == DTR_OPT_LAMB && !cfg->shard_sum &&
        (!dtr__on_boundary(m, cfg->shard_begin) || !dtr__on_boundary(m, cfg->shard_end)))
        return dtr__fail(dtr_model_context(m), DTR_INVALID_ARGUMENT, "dtr_optimizer_create: LAMB's trust ratio is per "
                         "parameter: shard [%lld, %lld) must hold whole parameters (dtr_dp_config.zero_whole_params) "
                         "or give shard_sum", (long long)cfg->shard_begin, (long long)cfg->shard_end);
    if (cfg->kind == DTR_OPT_LAMB && cfg->shard_sum && !dtr__host_memory(dtr_model_context(m)))
        return dtr__fail(dtr_model_context(m), DTR_UNSUPPORTED, "dtr_optimizer_create: LAMB with shard_sum needs "
                                                                "parameters in host memory");
    return DTR_OK;
}

/* LAMB's per-parameter segments: the parameters inside [base, base + len), relative to base;
   with shard_sum the parts of those that cross its ends too */
static void dtr__lamb_segments(dtr_optimizer *o) {
    int64_t lo = o->base, hi = o->base + o->len;
    int i;
    o->nseg = 0;
    for (i = 0; i < dtr_model_param_count(o->model); i++) {
        int64_t b = dtr_model_param_offset(o->model, i), e = b + dtr_tensor_numel(dtr_model_param_at(o->model, i));
        if (o->cfg.shard_sum) b = b > lo ? b : lo, e = e < hi ? e : hi;
        if (b < lo || e > hi || b >= e) continue;
        o->seg_param[o->nseg] = i;
        o->seg_begin[o->nseg] = b - o->base;
        o->seg_end[o->nseg++] = e - o->base;
    }
}

dtr_result dtr_optimizer_create(dtr_model *model, const dtr_optimizer_config *cfg, dtr_optimizer **out) {
    dtr_context *ctx;
    dtr_optimizer *o;
    size_t bytes;
    int nbuf = 0;
    dtr_result r;
    if (!model || !cfg || !out) return DTR_NULL_HANDLE;
    *out = NULL;
    ctx = dtr_model_context(model);
    if ((int)cfg->kind < 0 || cfg->kind > DTR_OPT_LAMB)
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_optimizer_create: unknown optimizer kind %d", (int)cfg->kind);
    if (!(cfg->schedule.lr >= 0.0f) || !(cfg->momentum >= 0.0f) || !(cfg->weight_decay >= 0.0f) || !(cfg->eps >= 0.0f) ||
        !(cfg->beta1 >= 0.0 && cfg->beta1 < 1.0) || !(cfg->beta2 >= 0.0 && cfg->beta2 < 1.0) || cfg->grad_accum_steps < 0 ||
        !(cfg->clip_norm >= 0.0f))
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_optimizer_create: lr, momentum, weight_decay, eps, clip_norm must be "
                                                    ">= 0 and betas in [0, 1)");
    if (cfg->nesterov && (cfg->momentum <= 0.0f || cfg->dampening != 0.0f))
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_optimizer_create: Nesterov needs momentum > 0 and zero dampening");
    r = dtr_model_build(model);
    if (r != DTR_OK) return r;
    if ((r = dtr__check_shard(model, cfg)) != DTR_OK) return r;
    o = (dtr_optimizer *)dtr__calloc(&ctx->alloc, sizeof(*o));
    if (!o) return dtr__fail(ctx, DTR_OUT_OF_MEMORY, "dtr_optimizer_create: out of memory");
    o->model = model;
    o->cfg = *cfg;
    if (o->cfg.grad_accum_steps < 1) o->cfg.grad_accum_steps = 1;
    o->base = cfg->shard_end > 0 ? cfg->shard_begin : 0;
    o->len = cfg->shard_end > 0 ? cfg->shard_end - cfg->shard_begin : dtr_model_numel(model);
    bytes = (size_t)(o->len ? o->len : 1) * sizeof(float);
    nbuf = cfg->kind == DTR_OPT_SGD ? (cfg->momentum > 0.0f ? 1 : 0) : 2;
    if (nbuf >= 1) o->m = (float *)ctx->backend->mem_alloc(ctx, bytes);
    if (nbuf >= 2) o->v = (float *)ctx->backend->mem_alloc(ctx, bytes);
    if (cfg->kind == DTR_OPT_LAMB) {
        int n = dtr_model_param_count(model);
        o->work = (float *)ctx->backend->mem_alloc(ctx, bytes);
        o->seg_begin = (int64_t *)dtr__malloc(&ctx->alloc, (size_t)(n ? n : 1) * sizeof(int64_t));
        o->seg_end = (int64_t *)dtr__malloc(&ctx->alloc, (size_t)(n ? n : 1) * sizeof(int64_t));
        o->seg_param = (int *)dtr__malloc(&ctx->alloc, (size_t)(n ? n : 1) * sizeof(int));
        if (o->seg_begin && o->seg_end && o->seg_param) dtr__lamb_segments(o);
    }
    if ((nbuf >= 1 && !o->m) || (nbuf >= 2 && !o->v) ||
        (cfg->kind == DTR_OPT_LAMB && (!o->work || !o->seg_begin || !o->seg_end || !o->seg_param))) {
        dtr_optimizer_destroy(o);
        return dtr__fail(ctx, DTR_OUT_OF_MEMORY, "dtr_optimizer_create: out of memory for the optimizer state");
    }
    if (o->m) ctx->backend->memset0(ctx, o->m, bytes);
    if (o->v) ctx->backend->memset0(ctx, o->v, bytes);
    *out = o;
    return DTR_OK;
}

void dtr_optimizer_destroy(dtr_optimizer *o) {
    dtr_context *ctx;
    if (!o) return;
    ctx = dtr_model_context(o->model);
    if (o->m) ctx->backend->mem_free(ctx, o->m);
    if (o->v) ctx->backend->mem_free(ctx, o->v);
    if (o->work) ctx->backend->mem_free(ctx, o->work);
    dtr__free(&ctx->alloc, o->seg_begin);
    dtr__free(&ctx->alloc, o->seg_end);
    dtr__free(&ctx->alloc, o->seg_param);
    dtr__free(&ctx->alloc, o);
}

int64_t dtr_optimizer_steps(const dtr_optimizer *o) { return o ? o->steps : 0; }
float dtr_optimizer_lr(const dtr_optimizer *o) { return o ? dtr_schedule_lr(&o->cfg.schedule, o->steps) : 0.0f; }
void dtr_optimizer_set_lr(dtr_optimizer *o, float lr) { if (o) o->cfg.schedule.lr = lr; }

float *dtr_optimizer_moments(dtr_optimizer *o, int index, int *count) {
    int n;
    if (!o) { if (count) *count = 0; return NULL; }
    n = (o->m ? 1 : 0) + (o->v ? 1 : 0);
    if (count) *count = n;
    if (index == 0) return o->m;
    if (index == 1) return o->v;
    return NULL;
}

/* ---- clipping ---- */

static dtr_result dtr__grad_norm(dtr_model *m, double *norm) {
    dtr_context *ctx = dtr_model_context(m);
    double s = 0.0;
    dtr_result r = ctx->backend->sumsq(ctx, dtr_model_grads(m), dtr_model_numel(m), &s);
    *norm = sqrt(s);
    return r;
}

dtr_result dtr_clip_grad_norm(dtr_model *m, float max_norm, float *norm_out) {
    dtr_context *ctx;
    double norm;
    dtr_result r;
    if (!m) return DTR_NULL_HANDLE;
    ctx = dtr_model_context(m);
    if (!(max_norm > 0.0f)) return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_clip_grad_norm: max_norm must be > 0");
    r = dtr_model_build(m);
    if (r != DTR_OK) return r;
    r = dtr__grad_norm(m, &norm);
    if (r != DTR_OK) return r;
    if (norm_out) *norm_out = (float)norm;
    if (norm > max_norm) return ctx->backend->scale(ctx, dtr_model_grads(m), dtr_model_numel(m), (float)(max_norm / (norm + 1e-6)));
    return DTR_OK;
}

/* ---- the update ---- */

/* the norm clip_norm takes: the whole buffer's, or with shard_sum the group's over the shards */
static dtr_result dtr__opt_grad_norm(dtr_optimizer *o, double *norm) {
    dtr_context *ctx = dtr_model_context(o->model);
    double s = 0.0;
    dtr_result r;
    if (!o->cfg.shard_sum) return dtr__grad_norm(o->model, norm);
    r = o->len ? ctx->backend->sumsq(ctx, dtr_model_grads(o->model) + o->base, o->len, &s) : DTR_OK;
    if (r == DTR_OK) r = o->cfg.shard_sum(o->cfg.shard_sum_user, &s, 1);
    *norm = sqrt(s);
    return r;
}

/* A range the update can take: inside the optimizer's floats; for LAMB on parameter
 * boundaries; without clipping unless it is all of them. */
static dtr_result dtr__check_range(dtr_optimizer *o, int64_t begin, int64_t end) {
    dtr_context *ctx = dtr_model_context(o->model);
    int64_t lo = o->base, hi = o->base + o->len;
    if (begin < lo || end > hi || begin > end)
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_optimizer_step_range: [%lld, %lld) outside the optimizer's "
                         "[%lld, %lld)", (long long)begin, (long long)end, (long long)lo, (long long)hi);
    if ((o->cfg.clip_norm > 0.0f || o->cfg.shard_sum) && (begin != lo || end != hi))
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_optimizer_step_range: clip_norm and shard_sum need the whole "
                                                    "gradient's norm; clip globally (dtr_clip_grad_norm) and step ranges "
                                                    "without them");
    if (o->cfg.kind != DTR_OPT_LAMB || o->cfg.shard_sum) return DTR_OK;   /* shard_sum: the whole shard */
    if (!dtr__on_boundary(o->model, begin) || !dtr__on_boundary(o->model, end))
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_optimizer_step_range: LAMB's trust ratio is per parameter: "
                                                    "[%lld, %lld) must start and end on parameter boundaries",
                         (long long)begin, (long long)end);
    return DTR_OK;
}

/* LAMB over a shard whose ends may split parameters (shard_sum given; host memory): the
 * kernel with lr 0 updates the moments and writes each update direction to work without
 * moving the parameters; each parameter's norms (of p and of its direction) are summed over
 * the shards; then p -= lr * trust * work, as the kernel's last loop. */
static dtr_result dtr__lamb_sharded(dtr_optimizer *o, dtr__opt_args *a) {
    dtr_context *ctx = dtr_model_context(o->model);
    int np = dtr_model_param_count(o->model), s;
    double *v = (double *)dtr__calloc(&ctx->alloc, (size_t)(2 * np + 1) * sizeof(double));
    float lr = a->lr;
    dtr_result r;
    int64_t i;
    if (!v) return DTR_OUT_OF_MEMORY;
    a->lr = 0.0f;
    r = ctx->backend->optimizer_update(ctx, a);
    for (s = 0; s < o->nseg && r == DTR_OK; s++)
        for (i = o->seg_begin[s]; i < o->seg_end[s]; i++) {
            v[2 * o->seg_param[s]] += (double)a->param[i] * a->param[i];
            v[2 * o->seg_param[s] + 1] += (double)a->work[i] * a->work[i];
        }
    if (r == DTR_OK) r = o->cfg.shard_sum(o->cfg.shard_sum_user, v, 2 * np);
    for (s = 0; s < o->nseg && r == DTR_OK; s++) {
        double pn = v[2 * o->seg_param[s]], un = v[2 * o->seg_param[s] + 1];
        float trust = (pn > 0.0 && un > 0.0) ? (float)(sqrt(pn) / sqrt(un)) : 1.0f;
        for (i = o->seg_begin[s]; i < o->seg_end[s]; i++) a->param[i] -= lr * trust * a->work[i];
    }
    dtr__free(&ctx->alloc, v);
    return r;
}

dtr_result dtr_optimizer_step(dtr_optimizer *o, int *updated) {
    if (updated) *updated = 0;
    if (!o) return DTR_NULL_HANDLE;
    return dtr_optimizer_step_range(o, o->base, o->base + o->len, updated);
}

dtr_result dtr_optimizer_step_range(dtr_optimizer *o, int64_t begin, int64_t end, int *updated) {
    dtr_context *ctx;
    dtr__opt_args a;
    dtr_result r;
    if (updated) *updated = 0;
    if (!o) return DTR_NULL_HANDLE;
    ctx = dtr_model_context(o->model);
    if (ctx->status != DTR_OK) return ctx->status;
    if ((r = dtr__check_range(o, begin, end)) != DTR_OK) return r;
    if (++o->micro < o->cfg.grad_accum_steps) return DTR_OK;
    o->micro = 0;
    memset(&a, 0, sizeof(a));
    a.kind = o->cfg.kind;
    a.begin = begin - o->base;   /* the kernel sees the optimizer's floats, state-aligned */
    a.n = end - o->base;
    a.param = dtr_model_params(o->model) + o->base;
    a.grad = dtr_model_grads(o->model) + o->base;
    a.m = o->m;
    a.v = o->v;
    a.lr = dtr_schedule_lr(&o->cfg.schedule, o->steps);
    a.momentum = o->cfg.momentum;
    a.dampening = o->cfg.dampening;
    a.nesterov = o->cfg.nesterov;
    a.beta1 = o->cfg.beta1;
    a.beta2 = o->cfg.beta2;
    a.eps = o->cfg.eps;
    a.weight_decay = o->cfg.weight_decay;
    a.grad_scale = 1.0f / (float)o->cfg.grad_accum_steps;
    a.first = o->steps == 0;
    a.step = o->steps + 1;
    a.nseg = o->nseg;
    a.seg_begin = o->seg_begin;
    a.seg_end = o->seg_end;
    a.work = o->work;
    if (o->cfg.clip_norm > 0.0f) {
        double norm;
        r = dtr__opt_grad_norm(o, &norm);
        if (r != DTR_OK) return r;
        norm *= a.grad_scale;
        if (norm > o->cfg.clip_norm) a.grad_scale *= (float)(o->cfg.clip_norm / (norm + 1e-6));
    }
    r = a.kind == DTR_OPT_LAMB && o->cfg.shard_sum ? dtr__lamb_sharded(o, &a) : ctx->backend->optimizer_update(ctx, &a);
    if (r != DTR_OK) return dtr__fail(ctx, r, "dtr_optimizer_step: update failed");
    o->steps++;
    if (updated) *updated = 1;
    return dtr_model_zero_grad(o->model);
}

/* CPU reference of the fused update; other backends are tested against it. */
dtr_result dtr__cpu_optimizer_update(dtr_context *ctx, const dtr__opt_args *a) {
    int64_t i, n = a->n, b = a->begin;
    float *p = a->param, *g = a->grad, *m = a->m, *v = a->v;
    float lr = a->lr, wd = a->weight_decay, gs = a->grad_scale;
    (void)ctx;
    switch (a->kind) {
    case DTR_OPT_SGD: {
        /* one simple loop per variant, fields in locals: the compiler vectorises each */
        float mom = a->momentum, damp = 1.0f - a->dampening;
        if (!m) {
            for (i = b; i < n; i++) p[i] -= lr * (g[i] * gs + wd * p[i]);
        } else if (a->first) {
            for (i = b; i < n; i++) {
                float d = g[i] * gs + wd * p[i];
                m[i] = d;
                p[i] -= lr * (a->nesterov ? d + mom * d : d);
            }
        } else if (a->nesterov) {
            for (i = b; i < n; i++) {
                float d = g[i] * gs + wd * p[i], b = mom * m[i] + damp * d;
                m[i] = b;
                p[i] -= lr * (d + mom * b);
            }
        } else {
            for (i = b; i < n; i++) {
                float d = g[i] * gs + wd * p[i], b = mom * m[i] + damp * d;
                m[i] = b;
                p[i] -= lr * b;
            }
        }
        break;
    }
    case DTR_OPT_ADAM:
    case DTR_OPT_ADAMW: {
        float bc1 = (float)(1.0 - pow(a->beta1, (double)a->step)), bc2 = (float)(1.0 - pow(a->beta2, (double)a->step));
        float step_size = lr / bc1, sbc2 = sqrtf(bc2);
        float b1 = (float)a->beta1, b2 = (float)a->beta2, c1 = (float)(1.0 - a->beta1), c2 = (float)(1.0 - a->beta2);
        int adamw = a->kind == DTR_OPT_ADAMW;
        for (i = b; i < n; i++) {
            float d = g[i] * gs;
            if (adamw) p[i] *= 1.0f - lr * wd;
            else d += wd * p[i];
            m[i] = b1 * m[i] + c1 * d;
            v[i] = b2 * v[i] + c2 * d * d;
            p[i] -= step_size * m[i] / (sqrtf(v[i]) / sbc2 + a->eps);
        }
        break;
    }
    case DTR_OPT_LAMB: {
        double bc1 = 1.0 - pow(a->beta1, (double)a->step), bc2 = 1.0 - pow(a->beta2, (double)a->step);
        float b1 = (float)a->beta1, b2 = (float)a->beta2, c1 = (float)(1.0 - a->beta1), c2 = (float)(1.0 - a->beta2);
        int s;
        for (s = 0; s < a->nseg; s++) {
            double pn = 0.0, un = 0.0;
            float trust;
            if (a->seg_begin[s] < b || a->seg_end[s] > n) continue;   /* outside the range */
            for (i = a->seg_begin[s]; i < a->seg_end[s]; i++) {
                float d = g[i] * gs, mh, vh;
                m[i] = b1 * m[i] + c1 * d;
                v[i] = b2 * v[i] + c2 * d * d;
                mh = (float)(m[i] / bc1);
                vh = (float)(v[i] / bc2);
                a->work[i] = mh / (sqrtf(vh) + a->eps) + wd * p[i];
                pn += (double)p[i] * p[i];
                un += (double)a->work[i] * a->work[i];
            }
            trust = (pn > 0.0 && un > 0.0) ? (float)(sqrt(pn) / sqrt(un)) : 1.0f;
            for (i = a->seg_begin[s]; i < a->seg_end[s]; i++) p[i] -= lr * trust * a->work[i];
        }
        break;
    }
    default: return DTR_INVALID_ARGUMENT;
    }
    return DTR_OK;
}

/* ---- state ---- */

dtr_result dtr_optimizer_state(dtr_optimizer *o, int index, dtr_state_entry *out) {
    size_t bytes;
    int dev;
    if (!o || !out) return DTR_NULL_HANDLE;
    bytes = (size_t)o->len * sizeof(float);   /* 0 for an empty shard */
    dev = !dtr__host_memory(dtr_model_context(o->model));
    if (index == 0) return dtr__state_put(out, "steps", &o->steps, sizeof o->steps, 0);
    if (index == 1) return dtr__state_put(out, "micro", &o->micro, sizeof o->micro, 0);
    if (index == 2) return dtr__state_put(out, "schedule", &o->cfg.schedule, sizeof o->cfg.schedule, 0);
    if (index == 3 && o->m) return dtr__state_put(out, "m", o->m, bytes, dev);
    if (index == 4 && o->v) return dtr__state_put(out, "v", o->v, bytes, dev);
    return DTR_NOT_FOUND;
}

dtr_result dtr_optimizer_state_loaded(dtr_optimizer *o) {
    if (!o) return DTR_NULL_HANDLE;
    if (o->steps < 0 || o->micro < 0 || o->micro >= o->cfg.grad_accum_steps)
        return dtr__fail(dtr_model_context(o->model), DTR_CORRUPT_FILE,
                         "dtr_optimizer_state_loaded: steps %lld / micro %d do not fit this optimizer", (long long)o->steps,
                         o->micro);
    return DTR_OK;
}
#line 9572 "dtrain.h"

/* ---- src/io/json.c ---- */
#line 1 "src/io/json.c"
/* ============================================================================
 * A small strict JSON reader (RFC 8259) for the safetensors header: a cursor over
 * the text that the caller drives (object, key, value ...), with checked helpers for
 * strings (escapes decoded, UTF-8 validated), non-negative integers (no fraction, no
 * exponent, no overflow) and a validating skip of any value with bounded nesting.
 * No allocation. On error a helper returns DTR_CORRUPT_FILE and leaves a short
 * description of the problem, with its byte offset, in j->msg; the caller adds the
 * file and field it was reading.
 * Private to the amalgamation (static, SQLite-style): src/io/safetensors.c, which follows
 * this file in the amalgamation's order, is its user.
 * ==========================================================================*/



/* ---- cursor ---- */

/** Deepest nesting of arrays and objects that dtr__json_skip accepts. */
#define DTR__JSON_MAX_DEPTH 64

/** Reading state over a JSON text of `n` bytes (not NUL-terminated). */
typedef struct dtr__json {
    const char *s;    /* text */
    size_t n;         /* its length */
    size_t pos;       /* next byte to read */
    char msg[160];    /* the last problem found, with its byte offset */
} dtr__json;

/** Starts reading `n` bytes at `s`. */
static void dtr__json_init(dtr__json *j, const char *s, size_t n) {
    j->s = s;
    j->n = n;
    j->pos = 0;
    j->msg[0] = '\0';
}

/* Records a problem at the current position and returns DTR_CORRUPT_FILE. */
static dtr_result dtr__json_fail(dtr__json *j, const char *what) {
    if (j->pos < j->n) {
        unsigned char c = (unsigned char)j->s[j->pos];
        if (c >= 0x20 && c < 0x7f)
            snprintf(j->msg, sizeof j->msg, "%s at byte %llu (found '%c')", what,
                     (unsigned long long)j->pos, (char)c);
        else
            snprintf(j->msg, sizeof j->msg, "%s at byte %llu (found byte 0x%02x)", what,
                     (unsigned long long)j->pos, c);
    } else {
        snprintf(j->msg, sizeof j->msg, "%s at byte %llu (end of text)", what, (unsigned long long)j->pos);
    }
    return DTR_CORRUPT_FILE;
}

/** Skips JSON whitespace (space, tab, CR, LF). */
static void dtr__json_ws(dtr__json *j) {
    while (j->pos < j->n) {
        char c = j->s[j->pos];
        if (c != ' ' && c != '\t' && c != '\r' && c != '\n') break;
        j->pos++;
    }
}

/** Skips whitespace and returns the next byte (0..255), or -1 at the end of the text. */
static int dtr__json_peek(dtr__json *j) {
    dtr__json_ws(j);
    return j->pos < j->n ? (int)(unsigned char)j->s[j->pos] : -1;
}

/** Skips whitespace and consumes `c` when it comes next. Returns 1 if it did, else 0. */
static int dtr__json_accept(dtr__json *j, char c) {
    if (dtr__json_peek(j) == (int)(unsigned char)c) {
        j->pos++;
        return 1;
    }
    return 0;
}

/** Skips whitespace and consumes `c`, or fails with "expected 'c'". */
static dtr_result dtr__json_expect(dtr__json *j, char c) {
    char what[32];
    if (dtr__json_accept(j, c)) return DTR_OK;
    snprintf(what, sizeof what, "expected '%c'", c);
    return dtr__json_fail(j, what);
}

/** Succeeds when only whitespace is left (no trailing garbage). */
static dtr_result dtr__json_end(dtr__json *j) {
    dtr__json_ws(j);
    if (j->pos != j->n) return dtr__json_fail(j, "trailing characters after the JSON value");
    return DTR_OK;
}

/* ---- strings ---- */

static int dtr__json_hex4(const char *p, uint32_t *out) {
    uint32_t v = 0;
    int i;
    for (i = 0; i < 4; i++) {
        char c = p[i];
        v <<= 4;
        if (c >= '0' && c <= '9') v |= (uint32_t)(c - '0');
        else if (c >= 'a' && c <= 'f') v |= (uint32_t)(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F') v |= (uint32_t)(c - 'A' + 10);
        else return 0;
    }
    *out = v;
    return 1;
}

/* Length of the valid UTF-8 sequence starting at s[0] (at most n bytes), or 0 when it is
 * malformed (overlong, surrogate, above U+10FFFF, truncated). */
static size_t dtr__json_utf8_len(const unsigned char *s, size_t n) {
    unsigned char c = s[0];
    if (c < 0x80) return 1;
    if (c >= 0xc2 && c <= 0xdf) {
        return (n >= 2 && (s[1] & 0xc0) == 0x80) ? 2 : 0;
    }
    if (c >= 0xe0 && c <= 0xef) {
        unsigned char lo = 0x80, hi = 0xbf;
        if (c == 0xe0) lo = 0xa0;         /* overlong */
        if (c == 0xed) hi = 0x9f;         /* surrogates */
        if (n < 3 || s[1] < lo || s[1] > hi || (s[2] & 0xc0) != 0x80) return 0;
        return 3;
    }
    if (c >= 0xf0 && c <= 0xf4) {
        unsigned char lo = 0x80, hi = 0xbf;
        if (c == 0xf0) lo = 0x90;         /* overlong */
        if (c == 0xf4) hi = 0x8f;         /* above U+10FFFF */
        if (n < 4 || s[1] < lo || s[1] > hi || (s[2] & 0xc0) != 0x80 || (s[3] & 0xc0) != 0x80) return 0;
        return 4;
    }
    return 0;
}

/* Appends code point `cp` as UTF-8 to buf (capacity cap, keeping room for the NUL) while
 * it fits; *len counts every byte, stored or not. */
static void dtr__json_put(char *buf, size_t cap, size_t *len, const char *bytes, size_t nb) {
    size_t i;
    for (i = 0; i < nb; i++) {
        if (buf && *len + 1 < cap) buf[*len] = bytes[i];
        (*len)++;
    }
}

static void dtr__json_put_cp(char *buf, size_t cap, size_t *len, uint32_t cp) {
    char b[4];
    size_t nb;
    if (cp < 0x80) { b[0] = (char)cp; nb = 1; }
    else if (cp < 0x800) { b[0] = (char)(0xc0 | (cp >> 6)); b[1] = (char)(0x80 | (cp & 0x3f)); nb = 2; }
    else if (cp < 0x10000) {
        b[0] = (char)(0xe0 | (cp >> 12)); b[1] = (char)(0x80 | ((cp >> 6) & 0x3f));
        b[2] = (char)(0x80 | (cp & 0x3f)); nb = 3;
    } else {
        b[0] = (char)(0xf0 | (cp >> 18)); b[1] = (char)(0x80 | ((cp >> 12) & 0x3f));
        b[2] = (char)(0x80 | ((cp >> 6) & 0x3f)); b[3] = (char)(0x80 | (cp & 0x3f)); nb = 4;
    }
    dtr__json_put(buf, cap, len, b, nb);
}

/** Reads a string value (after optional whitespace). Escapes are decoded and the text is
 *  checked to be valid UTF-8 without control characters or lone surrogates.
 *  @param buf  receives the decoded bytes, NUL-terminated and cut to cap-1 bytes (may be
 *              NULL with cap 0 to validate and skip).
 *  @param len  receives the full decoded length, also when it did not fit: the caller
 *              compares it with cap to reject long strings (may be NULL).
 *  A "\u0000" escape decodes to a NUL byte; callers that need C strings compare strlen. */
static dtr_result dtr__json_string(dtr__json *j, char *buf, size_t cap, size_t *len) {
    size_t n = 0;
    if (buf && cap) buf[0] = '\0';
    if (len) *len = 0;
    if (dtr__json_peek(j) != '"') return dtr__json_fail(j, "expected a string");
    j->pos++;
    for (;;) {
        unsigned char c;
        if (j->pos >= j->n) return dtr__json_fail(j, "unterminated string");
        c = (unsigned char)j->s[j->pos];
        if (c == '"') { j->pos++; break; }
        if (c < 0x20) return dtr__json_fail(j, "control character in string");
        if (c == '\\') {
            char e;
            if (j->pos + 1 >= j->n) { j->pos++; return dtr__json_fail(j, "unterminated escape"); }
            e = j->s[j->pos + 1];
            switch (e) {
            case '"': dtr__json_put(buf, cap, &n, "\"", 1); j->pos += 2; break;
            case '\\': dtr__json_put(buf, cap, &n, "\\", 1); j->pos += 2; break;
            case '/': dtr__json_put(buf, cap, &n, "/", 1); j->pos += 2; break;
            case 'b': dtr__json_put(buf, cap, &n, "\b", 1); j->pos += 2; break;
            case 'f': dtr__json_put(buf, cap, &n, "\f", 1); j->pos += 2; break;
            case 'n': dtr__json_put(buf, cap, &n, "\n", 1); j->pos += 2; break;
            case 'r': dtr__json_put(buf, cap, &n, "\r", 1); j->pos += 2; break;
            case 't': dtr__json_put(buf, cap, &n, "\t", 1); j->pos += 2; break;
            case 'u': {
                uint32_t cp, lo;
                if (j->n - j->pos < 6 || !dtr__json_hex4(j->s + j->pos + 2, &cp))
                    return dtr__json_fail(j, "bad \\u escape in string");
                if (cp >= 0xdc00 && cp <= 0xdfff) return dtr__json_fail(j, "lone low surrogate escape in string");
                if (cp >= 0xd800 && cp <= 0xdbff) {
                    if (j->n - j->pos < 12 || j->s[j->pos + 6] != '\\' || j->s[j->pos + 7] != 'u' ||
                        !dtr__json_hex4(j->s + j->pos + 8, &lo) || lo < 0xdc00 || lo > 0xdfff)
                        return dtr__json_fail(j, "high surrogate escape not followed by a low surrogate");
                    cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
                    j->pos += 6;
                }
                dtr__json_put_cp(buf, cap, &n, cp);
                j->pos += 6;
                break;
            }
            default:
                return dtr__json_fail(j, "bad escape in string");
            }
        } else {
            size_t k = dtr__json_utf8_len((const unsigned char *)j->s + j->pos, j->n - j->pos);
            if (k == 0) return dtr__json_fail(j, "invalid UTF-8 in string");
            dtr__json_put(buf, cap, &n, j->s + j->pos, k);
            j->pos += k;
        }
    }
    if (buf && cap) buf[n < cap ? n : cap - 1] = '\0';
    if (len) *len = n;
    return DTR_OK;
}

/* ---- numbers ---- */

/** Reads a non-negative integer that fits in 64 bits: digits only, no sign, no leading
 *  zero, no fraction, no exponent. Each violation has its own message. */
static dtr_result dtr__json_u64(dtr__json *j, uint64_t *out) {
    uint64_t v = 0;
    size_t start;
    int c = dtr__json_peek(j);
    *out = 0;
    if (c == '-') return dtr__json_fail(j, "negative number where a non-negative integer is required");
    if (c < '0' || c > '9') return dtr__json_fail(j, "expected a non-negative integer");
    start = j->pos;
    while (j->pos < j->n && j->s[j->pos] >= '0' && j->s[j->pos] <= '9') {
        unsigned d = (unsigned)(j->s[j->pos] - '0');
        if (v > (UINT64_MAX - d) / 10) {
            j->pos = start;
            return dtr__json_fail(j, "integer overflows 64 bits");
        }
        v = v * 10 + d;
        j->pos++;
    }
    if (j->s[start] == '0' && j->pos - start > 1) {
        j->pos = start;
        return dtr__json_fail(j, "number with a leading zero");
    }
    if (j->pos < j->n && (j->s[j->pos] == '.' || j->s[j->pos] == 'e' || j->s[j->pos] == 'E'))
        return dtr__json_fail(j, "number with a fraction or exponent where an integer is required");
    *out = v;
    return DTR_OK;
}

/* Skips a JSON number (full grammar: -?(0|[1-9]d*)(.d+)?([eE][+-]?d+)?). */
static dtr_result dtr__json_number(dtr__json *j) {
    size_t p = j->pos;
    const char *s = j->s;
    size_t n = j->n;
    if (p < n && s[p] == '-') p++;
    if (p >= n || s[p] < '0' || s[p] > '9') { j->pos = p; return dtr__json_fail(j, "bad number"); }
    if (s[p] == '0') p++;
    else while (p < n && s[p] >= '0' && s[p] <= '9') p++;
    if (p < n && s[p] == '.') {
        p++;
        if (p >= n || s[p] < '0' || s[p] > '9') { j->pos = p; return dtr__json_fail(j, "bad number fraction"); }
        while (p < n && s[p] >= '0' && s[p] <= '9') p++;
    }
    if (p < n && (s[p] == 'e' || s[p] == 'E')) {
        p++;
        if (p < n && (s[p] == '+' || s[p] == '-')) p++;
        if (p >= n || s[p] < '0' || s[p] > '9') { j->pos = p; return dtr__json_fail(j, "bad number exponent"); }
        while (p < n && s[p] >= '0' && s[p] <= '9') p++;
    }
    j->pos = p;
    return DTR_OK;
}

/* ---- any value ---- */

static int dtr__json_word(dtr__json *j, const char *w) {
    size_t k = strlen(w);
    if (j->n - j->pos >= k && memcmp(j->s + j->pos, w, k) == 0) {
        j->pos += k;
        return 1;
    }
    return 0;
}

static dtr_result dtr__json_skip_depth(dtr__json *j, int depth) {
    dtr_result r;
    int c = dtr__json_peek(j);
    switch (c) {
    case '{':
        if (depth >= DTR__JSON_MAX_DEPTH) return dtr__json_fail(j, "JSON nested too deeply (more than 64 levels)");
        j->pos++;
        if (dtr__json_accept(j, '}')) return DTR_OK;
        for (;;) {
            if ((r = dtr__json_string(j, NULL, 0, NULL)) != DTR_OK) return r;
            if ((r = dtr__json_expect(j, ':')) != DTR_OK) return r;
            if ((r = dtr__json_skip_depth(j, depth + 1)) != DTR_OK) return r;
            if (dtr__json_accept(j, ',')) continue;
            return dtr__json_expect(j, '}');
        }
    case '[':
        if (depth >= DTR__JSON_MAX_DEPTH) return dtr__json_fail(j, "JSON nested too deeply (more than 64 levels)");
        j->pos++;
        if (dtr__json_accept(j, ']')) return DTR_OK;
        for (;;) {
            if ((r = dtr__json_skip_depth(j, depth + 1)) != DTR_OK) return r;
            if (dtr__json_accept(j, ',')) continue;
            return dtr__json_expect(j, ']');
        }
    case '"':
        return dtr__json_string(j, NULL, 0, NULL);
    case 't':
        if (dtr__json_word(j, "true")) return DTR_OK;
        break;
    case 'f':
        if (dtr__json_word(j, "false")) return DTR_OK;
        break;
    case 'n':
        if (dtr__json_word(j, "null")) return DTR_OK;
        break;
    default:
        if (c == '-' || (c >= '0' && c <= '9')) return dtr__json_number(j);
        break;
    }
    return dtr__json_fail(j, "expected a JSON value");
}

/** Validates and skips one value of any kind, nested at most DTR__JSON_MAX_DEPTH deep. */
static dtr_result dtr__json_skip(dtr__json *j) {
    return dtr__json_skip_depth(j, 0);
}

/** Checks that the whole text is exactly one valid JSON value (whitespace around it is
 *  allowed); the caller then walks it knowing the syntax is sound. */
static dtr_result dtr__json_validate(dtr__json *j) {
    dtr_result r;
    j->pos = 0;
    if ((r = dtr__json_skip(j)) != DTR_OK) return r;
    if ((r = dtr__json_end(j)) != DTR_OK) return r;
    j->pos = 0;
    return DTR_OK;
}
#line 9919 "dtrain.h"

/* ---- src/io/checksum.c ---- */
#line 1 "src/io/checksum.c"
/* ============================================================================
 * CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), the checksum of every tensor in the
 * files dtrain writes (weights and checkpoints) and of checkpoint files in their manifest.
 * Slicing by 8: eight 256-entry tables built once on first use (a spin on an atomic flag,
 * so threads that race to the first call all see complete tables). 2-3 GB/s on one core.
 * ==========================================================================*/



#define DTR__CRC32C_POLY 0x82F63B78u

static uint32_t dtr__crc_table[8][256];
static int dtr__crc_state;   /* 0: not built, 1: being built, 2: ready */

static void dtr__crc_build(void) {
    uint32_t i, k, c;
    for (i = 0; i < 256; i++) {
        c = i;
        for (k = 0; k < 8; k++) c = (c >> 1) ^ ((c & 1u) ? DTR__CRC32C_POLY : 0u);
        dtr__crc_table[0][i] = c;
    }
    for (i = 0; i < 256; i++) {
        c = dtr__crc_table[0][i];
        for (k = 1; k < 8; k++) {
            c = dtr__crc_table[0][c & 0xFFu] ^ (c >> 8);
            dtr__crc_table[k][i] = c;
        }
    }
}

static void dtr__crc_ready(void) {
#if DTR__HAVE_ATOMICS
    int expected = 0;
    if (DTR__ATOMIC_LOAD(&dtr__crc_state) == 2) return;
    if (DTR__ATOMIC_CAS(&dtr__crc_state, &expected, 1)) {
        dtr__crc_build();
        DTR__ATOMIC_STORE(&dtr__crc_state, 2);
        return;
    }
    while (DTR__ATOMIC_LOAD(&dtr__crc_state) != 2) { /* another thread is building them */ }
#else
    if (!dtr__crc_state) { dtr__crc_build(); dtr__crc_state = 2; }   /* no atomics: build before threads */
#endif
}

/** CRC-32C of `n` bytes, continuing from `crc` (0 to start; pass the previous result to
 *  checksum data in pieces). See api.h. */
uint32_t dtr_crc32c(uint32_t crc, const void *data, size_t n) {
    const unsigned char *p = (const unsigned char *)data;
    const uint32_t (*t)[256] = (const uint32_t (*)[256])dtr__crc_table;
    uint32_t c = ~crc;
    if (!p) return crc;
    dtr__crc_ready();
    for (; n && ((uintptr_t)p & 7u); n--) c = t[0][(c ^ *p++) & 0xFFu] ^ (c >> 8);
    for (; n >= 8; n -= 8, p += 8) {
        uint32_t lo = c ^ ((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24);
        c = t[7][lo & 0xFFu] ^ t[6][(lo >> 8) & 0xFFu] ^ t[5][(lo >> 16) & 0xFFu] ^ t[4][lo >> 24] ^
            t[3][p[4]] ^ t[2][p[5]] ^ t[1][p[6]] ^ t[0][p[7]];
    }
    for (; n; n--) c = t[0][(c ^ *p++) & 0xFFu] ^ (c >> 8);
    return ~c;
}
#line 9985 "dtrain.h"

/* ---- src/io/atomic.c ---- */
#line 1 "src/io/atomic.c"
/* ============================================================================
 * The atomic file writer shared by weights (safetensors), checkpoints and logs: bytes go to
 * "<path>.tmp.<pid>.<n>" in the same folder through a buffer; commit syncs the file, renames
 * it over `path` and syncs the folder (POSIX), so a reader sees the old file or the whole new
 * one, and a crash leaves no half-written `path`. Any failure removes the temporary file.
 * ==========================================================================*/


#include <errno.h>
#include <sys/stat.h>
#ifdef _WIN32
#include <io.h>
#include <process.h>
#include <windows.h>
#else
#include <dirent.h>
#include <fcntl.h>
#include <unistd.h>
#endif

struct dtr__afile {
    char *path, *tmp;
#ifdef _WIN32
    FILE *fp;
#else
    int fd;
#endif
    int failed;        /* errno of the first failed write, -1 for a short write, 0: none */
    size_t used;
    char buf[8192];
};

static unsigned dtr__afile_serial;   /* distinguishes temporary files of one process */

int dtr__not_regular_file(const char *path) {
#ifdef _WIN32
    struct _stat64 st;
    return _stat64(path, &st) == 0 && (st.st_mode & _S_IFMT) != _S_IFREG;
#else
    struct stat st;
    return stat(path, &st) == 0 && !S_ISREG(st.st_mode);
#endif
}

#ifndef _WIN32
/* A path that exists and is not a regular file (a folder, FIFO, device) is not replaced. */
static dtr_result dtr__afile_check_target(const char *path, char *err, size_t errlen) {
    struct stat st;
    if (stat(path, &st) != 0 || S_ISREG(st.st_mode)) return DTR_OK;
    return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "%s: exists and is not a regular file (%s): refusing to replace it",
                     path, S_ISDIR(st.st_mode) ? "a folder" : S_ISFIFO(st.st_mode) ? "a FIFO" : "a device or socket");
}

/* Removes "<base>.tmp.<pid>.<n>" files beside `path` whose process is gone: saves killed
 * midway leave them, and each would otherwise stay forever. */
static void dtr__afile_sweep(const char *path) {
    char dir[4096], victim[4096 + 256];
    const char *slash = strrchr(path, '/'), *base = slash ? slash + 1 : path;
    size_t bl = strlen(base), dl = slash ? (size_t)(slash - path) : 0;
    struct dirent *d;
    DIR *dp;
    if (dl >= sizeof dir || bl == 0) return;
    if (slash) { memcpy(dir, path, dl ? dl : 1); dir[dl ? dl : 1] = '\0'; }
    else strcpy(dir, ".");
    if (!(dp = opendir(dir))) return;
    while ((d = readdir(dp)) != NULL) {
        long long pid = 0;
        unsigned n;
        char tail;
        if (strncmp(d->d_name, base, bl) != 0 || strncmp(d->d_name + bl, ".tmp.", 5) != 0) continue;
        if (sscanf(d->d_name + bl + 5, "%lld.%u%c", &pid, &n, &tail) != 2 || pid == (long long)getpid()) continue;
        if (!dtr__pid_dead((int64_t)pid)) continue;
        snprintf(victim, sizeof victim, "%s/%s", dir, d->d_name);
        (void)remove(victim);
    }
    closedir(dp);
}
#endif

dtr_result dtr__afile_open(dtr__afile **out, const char *path, char *err, size_t errlen) {
    dtr__afile *f;
    long pid;
    *out = NULL;
    if (!path) return dtr__errf(err, errlen, DTR_NULL_HANDLE, "atomic write: path is NULL");
    f = (dtr__afile *)dtr__calloc(NULL, sizeof *f);
    if (f) f->tmp = (char *)dtr__malloc(NULL, strlen(path) + 48);
    if (f) f->path = (char *)dtr__malloc(NULL, strlen(path) + 1);
    if (!f || !f->tmp || !f->path) {
        if (f) { dtr__free(NULL, f->tmp); dtr__free(NULL, f->path); dtr__free(NULL, f); }
        return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "%s: out of memory", path);
    }
    strcpy(f->path, path);
#ifdef _WIN32
    pid = (long)_getpid();
    sprintf(f->tmp, "%s.tmp.%ld.%u", path, pid, DTR__ATOMIC_INC(&dtr__afile_serial));
    f->fp = fopen(f->tmp, "wb");
    if (!f->fp) {
#else
    {
        dtr_result r = dtr__afile_check_target(path, err, errlen);
        if (r != DTR_OK) { dtr__free(NULL, f->tmp); dtr__free(NULL, f->path); dtr__free(NULL, f); return r; }
    }
    dtr__afile_sweep(path);
    pid = (long)getpid();
    sprintf(f->tmp, "%s.tmp.%ld.%u", path, pid, DTR__ATOMIC_INC(&dtr__afile_serial));
    do { f->fd = open(f->tmp, O_WRONLY | O_CREAT | O_TRUNC, 0666); } while (f->fd < 0 && errno == EINTR);
    if (f->fd < 0) {
#endif
        dtr_result r = dtr__errf(err, errlen, DTR_IO_ERROR, "%s: cannot create temporary file %s: %s", path, f->tmp,
                                 strerror(errno));
        dtr__free(NULL, f->tmp);
        dtr__free(NULL, f->path);
        dtr__free(NULL, f);
        return r;
    }
    *out = f;
    return DTR_OK;
}

static void dtr__afile_raw(dtr__afile *f, const char *c, size_t n) {
    while (n > 0 && !f->failed) {
        size_t chunk = n < ((size_t)1 << 30) ? n : ((size_t)1 << 30);
#ifdef _WIN32
        if (fwrite(c, 1, chunk, f->fp) != chunk) { f->failed = errno ? errno : -1; return; }
#else
        ssize_t w = write(f->fd, c, chunk);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) { f->failed = w < 0 && errno ? errno : -1; return; }
        chunk = (size_t)w;
#endif
        c += chunk;
        n -= chunk;
    }
}

void dtr__afile_write(dtr__afile *f, const void *p, size_t n) {
    if (f->used + n > sizeof f->buf) {
        dtr__afile_raw(f, f->buf, f->used);
        f->used = 0;
        if (n >= sizeof f->buf) { dtr__afile_raw(f, (const char *)p, n); return; }
    }
    memcpy(f->buf + f->used, p, n);
    f->used += n;
}

static void dtr__afile_free(dtr__afile *f, int remove_tmp) {
    if (remove_tmp) remove(f->tmp);
    dtr__free(NULL, f->tmp);
    dtr__free(NULL, f->path);
    dtr__free(NULL, f);
}

void dtr__afile_abort(dtr__afile *f) {
    if (!f) return;
#ifdef _WIN32
    fclose(f->fp);
#else
    close(f->fd);
#endif
    dtr__afile_free(f, 1);
}

/* Syncs and closes the temporary file; 0 or the errno of the failure. */
static int dtr__afile_close(dtr__afile *f) {
    int e = 0;
#ifdef _WIN32
    if (fflush(f->fp) != 0 || _commit(_fileno(f->fp)) != 0) e = errno;
    if (fclose(f->fp) != 0 && !e) e = errno;
#else
    if (fsync(f->fd) != 0) e = errno;
    if (close(f->fd) != 0 && !e) e = errno;
#endif
    return e;
}

/* The rename made durable: the folder holding `path` is synced (best effort). */
static void dtr__afile_sync_dir(const char *path) {
#ifndef _WIN32
    char dir[4096];
    const char *slash = strrchr(path, '/');
    size_t dl = slash ? (size_t)(slash - path) : 0;
    int dfd;
    if (dl >= sizeof dir) return;
    if (slash) { memcpy(dir, path, dl ? dl : 1); dir[dl ? dl : 1] = '\0'; }
    else strcpy(dir, ".");
    dfd = open(dir, O_RDONLY);
    if (dfd >= 0) { (void)fsync(dfd); close(dfd); }
#else
    (void)path;
#endif
}

dtr_result dtr__afile_commit(dtr__afile *f, char *err, size_t errlen) {
    dtr_result r = DTR_OK;
    int e;
    dtr__afile_raw(f, f->buf, f->used);
    f->used = 0;
    if (f->failed) {
        r = dtr__errf(err, errlen, DTR_IO_ERROR, "%s: write to %s failed: %s", f->path, f->tmp,
                      f->failed > 0 ? strerror(f->failed) : "short write");
        dtr__afile_abort(f);
        return r;
    }
    if ((e = dtr__afile_close(f)) != 0) {
        r = dtr__errf(err, errlen, DTR_IO_ERROR, "%s: syncing %s failed: %s", f->path, f->tmp, strerror(e));
        dtr__afile_free(f, 1);
        return r;
    }
#ifdef _WIN32
    if (!MoveFileExA(f->tmp, f->path, MOVEFILE_REPLACE_EXISTING | MOVEFILE_WRITE_THROUGH)) {
        r = dtr__errf(err, errlen, DTR_IO_ERROR, "%s: renaming %s into place failed (error %lu)", f->path, f->tmp,
                      (unsigned long)GetLastError());
#else
    if (rename(f->tmp, f->path) != 0) {
        r = dtr__errf(err, errlen, DTR_IO_ERROR, "%s: renaming %s into place failed: %s", f->path, f->tmp, strerror(errno));
#endif
        dtr__afile_free(f, 1);
        return r;
    }
    dtr__afile_sync_dir(f->path);
    dtr__afile_free(f, 0);
    return DTR_OK;
}

dtr_result dtr_write_file_atomic(const char *path, const void *data, size_t bytes, char *err, size_t errlen) {
    dtr__afile *f;
    dtr_result r;
    if (err && errlen) err[0] = '\0';
    if (!data && bytes) return dtr__errf(err, errlen, DTR_NULL_HANDLE, "dtr_write_file_atomic: data is NULL");
    if ((r = dtr__afile_open(&f, path, err, errlen)) != DTR_OK) return r;
    dtr__afile_write(f, data, bytes);
    return dtr__afile_commit(f, err, errlen);
}
#line 10222 "dtrain.h"

/* ---- src/io/safetensors.c ---- */
#line 1 "src/io/safetensors.c"
/* ============================================================================
 * safetensors files (https://github.com/huggingface/safetensors): read, validate, write.
 *
 * Layout: an 8-byte little-endian u64 N, N bytes of UTF-8 JSON (an object mapping each
 * tensor name to {"dtype", "shape", "data_offsets": [begin, end]}, plus an optional
 * "__metadata__" object of string -> string), padded with spaces, then the data section.
 * Offsets are relative to the start of the data section.
 *
 * The reader trusts nothing: header length, JSON syntax (strict, bounded nesting), the
 * fields of every entry (all three present, no others, no duplicates), dtype, shape,
 * offsets against dtype x numel, and that the entries tile the data section exactly
 * (no overlap, no gap, nothing left over). Every error names the file, the tensor or
 * field, and the problem. The writer produces compact headers padded to a multiple of 8
 * and writes through a temporary file, fsync and rename.
 * ==========================================================================*/


#include <errno.h>
#ifdef _WIN32
#include <io.h>
#include <process.h>
#ifndef WIN32_LEAN_AND_MEAN
#define WIN32_LEAN_AND_MEAN
#endif
#ifndef NOMINMAX
#define NOMINMAX
#endif
#include <windows.h>
#else
#include <fcntl.h>
#include <unistd.h>
#endif

/* ---- dtypes ---- */

/** Largest header accepted, as the reference implementation (100 MB). */
#define DTR__ST_MAX_HEADER 100000000ull

static const char *dtr__st_dtype_str(dtr_dtype dt) {
    switch (dt) {
    case DTR_F32: return "F32";
    case DTR_BF16: return "BF16";
    case DTR_F16: return "F16";
    case DTR_I32: return "I32";
    case DTR_U8: return "U8";
    }
    return NULL;
}

static int dtr__st_dtype_parse(const char *s, dtr_dtype *out) {
    static const dtr_dtype all[5] = { DTR_F32, DTR_BF16, DTR_F16, DTR_I32, DTR_U8 };
    int i;
    for (i = 0; i < 5; i++) {
        if (strcmp(s, dtr__st_dtype_str(all[i])) == 0) {
            *out = all[i];
            return 1;
        }
    }
    return 0;
}

/* Dtypes of the format that dtrain does not hold, with their element sizes. */
static unsigned dtr__st_foreign_size(const char *s) {
    static const struct { const char *name; unsigned size; } t[10] = {
        {"BOOL", 1}, {"I8", 1}, {"F8_E4M3", 1}, {"F8_E5M2", 1}, {"I16", 2}, {"U16", 2}, {"U32", 4},
        {"I64", 8}, {"U64", 8}, {"F64", 8}};
    int i;
    for (i = 0; i < 10; i++)
        if (strcmp(s, t[i].name) == 0) return t[i].size;
    return 0;
}

static size_t dtr__st_dtype_size(dtr_dtype dt) {
    switch (dt) {
    case DTR_F32: case DTR_I32: return 4;
    case DTR_BF16: case DTR_F16: return 2;
    case DTR_U8: return 1;
    }
    return 0;
}

/* numel of a shape and its size in bytes, with overflow checks. Returns 0 on overflow. */
static int dtr__st_nbytes(int ndim, const int64_t *shape, uint64_t es, uint64_t *numel, uint64_t *nbytes) {
    uint64_t n = 1;
    int i;
    for (i = 0; i < ndim; i++) {
        if (shape[i] == 0) { n = 0; break; }
    }
    if (n) {
        for (i = 0; i < ndim; i++) {
            uint64_t d = (uint64_t)shape[i];
            if (n > (uint64_t)INT64_MAX / d) return 0;
            n *= d;
        }
    }
    if (es == 0 || n > UINT64_MAX / es) return 0;
    *numel = n;
    *nbytes = n * es;
    return 1;
}

/* ---- reading: one header entry ---- */

/* Parses {"dtype": .., "shape": [..], "data_offsets": [b, e]} of tensor e->name. */
static dtr_result dtr__st_parse_entry(dtr__json *j, const char *src, dtr_st_entry *e, uint64_t data_size,
                                      char *err, size_t errlen) {
    const char *nm = e->name;
    int have_dtype = 0, have_shape = 0, have_offsets = 0;
    uint64_t numel = 0, nbytes = 0, es = 0;
    char key[32], dts[24];
    size_t klen, dlen;

    if (dtr__json_peek(j) != '{')
        return dtr__errf(err, errlen, DTR_CORRUPT_FILE,
                         "%s: tensor \"%s\": entry is not an object (byte %llu of the header)",
                         src, nm, (unsigned long long)j->pos);
    j->pos++;
    if (!dtr__json_accept(j, '}')) {
        for (;;) {
            if (dtr__json_string(j, key, sizeof key, &klen) != DTR_OK || dtr__json_expect(j, ':') != DTR_OK)
                return dtr__errf(err, errlen, DTR_CORRUPT_FILE, "%s: tensor \"%s\": %s", src, nm, j->msg);
            if (klen < sizeof key && strlen(key) == klen && strcmp(key, "dtype") == 0) {
                if (have_dtype)
                    return dtr__errf(err, errlen, DTR_CORRUPT_FILE, "%s: tensor \"%s\": duplicate field \"dtype\"", src, nm);
                have_dtype = 1;
                if (dtr__json_string(j, dts, sizeof dts, &dlen) != DTR_OK)
                    return dtr__errf(err, errlen, DTR_CORRUPT_FILE, "%s: tensor \"%s\": dtype: %s", src, nm, j->msg);
                if (dlen < sizeof dts && strlen(dts) == dlen && dtr__st_dtype_parse(dts, &e->dtype))
                    es = dtr__st_dtype_size(e->dtype);
                else if (dlen < sizeof dts && strlen(dts) == dlen && (es = dtr__st_foreign_size(dts)) != 0)
                    e->foreign = 1, e->dtype = DTR_U8;
                else
                    return dtr__errf(err, errlen, DTR_UNSUPPORTED,
                                     "%s: tensor \"%s\": dtype \"%s%s\" is not a safetensors dtype", src, nm, dts,
                                     dlen >= sizeof dts ? "..." : "");
                snprintf(e->dtype_name, sizeof e->dtype_name, "%.11s", dts);   /* names are at most 7 */
            } else if (klen < sizeof key && strlen(key) == klen && strcmp(key, "shape") == 0) {
                if (have_shape)
                    return dtr__errf(err, errlen, DTR_CORRUPT_FILE, "%s: tensor \"%s\": duplicate field \"shape\"", src, nm);
                have_shape = 1;
                if (dtr__json_expect(j, '[') != DTR_OK)
                    return dtr__errf(err, errlen, DTR_CORRUPT_FILE, "%s: tensor \"%s\": shape is not an array: %s", src, nm, j->msg);
                e->ndim = 0;
                if (!dtr__json_accept(j, ']')) {
                    for (;;) {
                        uint64_t d;
                        if (e->ndim == DTR_MAX_DIMS)
                            return dtr__errf(err, errlen, DTR_UNSUPPORTED,
                                             "%s: tensor \"%s\": shape has more than %d dims", src, nm, DTR_MAX_DIMS);
                        if (dtr__json_peek(j) == '-')
                            return dtr__errf(err, errlen, DTR_CORRUPT_FILE, "%s: tensor \"%s\": shape[%d] is negative",
                                             src, nm, e->ndim);
                        if (dtr__json_u64(j, &d) != DTR_OK)
                            return dtr__errf(err, errlen, DTR_CORRUPT_FILE, "%s: tensor \"%s\": shape[%d]: %s",
                                             src, nm, e->ndim, j->msg);
                        if (d > (uint64_t)INT64_MAX)
                            return dtr__errf(err, errlen, DTR_CORRUPT_FILE, "%s: tensor \"%s\": shape[%d] = %llu is too large",
                                             src, nm, e->ndim, (unsigned long long)d);
                        e->shape[e->ndim++] = (int64_t)d;
                        if (dtr__json_accept(j, ',')) continue;
                        if (dtr__json_expect(j, ']') != DTR_OK)
                            return dtr__errf(err, errlen, DTR_CORRUPT_FILE, "%s: tensor \"%s\": shape: %s", src, nm, j->msg);
                        break;
                    }
                }
            } else if (klen < sizeof key && strlen(key) == klen && strcmp(key, "data_offsets") == 0) {
                if (have_offsets)
                    return dtr__errf(err, errlen, DTR_CORRUPT_FILE, "%s: tensor \"%s\": duplicate field \"data_offsets\"", src, nm);
                have_offsets = 1;
                if (dtr__json_expect(j, '[') != DTR_OK || dtr__json_u64(j, &e->begin) != DTR_OK ||
                    dtr__json_expect(j, ',') != DTR_OK || dtr__json_u64(j, &e->end) != DTR_OK ||
                    dtr__json_expect(j, ']') != DTR_OK)
                    return dtr__errf(err, errlen, DTR_CORRUPT_FILE,
                                     "%s: tensor \"%s\": data_offsets must be [begin, end] with two non-negative integers: %s",
                                     src, nm, j->msg);
            } else {
                return dtr__errf(err, errlen, DTR_CORRUPT_FILE, "%s: tensor \"%s\": unknown field \"%s%s\"",
                                 src, nm, key, klen >= sizeof key ? "..." : "");
            }
            if (dtr__json_accept(j, ',')) continue;
            if (dtr__json_expect(j, '}') != DTR_OK)
                return dtr__errf(err, errlen, DTR_CORRUPT_FILE, "%s: tensor \"%s\": %s", src, nm, j->msg);
            break;
        }
    }
    if (!have_dtype || !have_shape || !have_offsets)
        return dtr__errf(err, errlen, DTR_CORRUPT_FILE, "%s: tensor \"%s\": missing field \"%s\"", src, nm,
                         !have_dtype ? "dtype" : !have_shape ? "shape" : "data_offsets");

    if (!dtr__st_nbytes(e->ndim, e->shape, es, &numel, &nbytes))
        return dtr__errf(err, errlen, DTR_CORRUPT_FILE, "%s: tensor \"%s\": shape x dtype size overflows 64 bits", src, nm);
    if (e->begin > e->end)
        return dtr__errf(err, errlen, DTR_CORRUPT_FILE, "%s: tensor \"%s\": data_offsets [%llu, %llu]: begin is after end",
                         src, nm, (unsigned long long)e->begin, (unsigned long long)e->end);
    if (e->end - e->begin != nbytes)
        return dtr__errf(err, errlen, DTR_CORRUPT_FILE,
                         "%s: tensor \"%s\": size mismatch: data_offsets [%llu, %llu] hold %llu bytes but %s x %llu elements need %llu",
                         src, nm, (unsigned long long)e->begin, (unsigned long long)e->end,
                         (unsigned long long)(e->end - e->begin), e->dtype_name,
                         (unsigned long long)numel, (unsigned long long)nbytes);
    if (e->end > data_size)
        return dtr__errf(err, errlen, DTR_CORRUPT_FILE,
                         "%s: tensor \"%s\": data_offsets [%llu, %llu] out of range: the data section has %llu bytes",
                         src, nm, (unsigned long long)e->begin, (unsigned long long)e->end, (unsigned long long)data_size);
    return DTR_OK;
}

/* Checks "__metadata__": an object of string -> string. */
static dtr_result dtr__st_parse_metadata(dtr__json *j, const char *src, char *err, size_t errlen) {
    char key[64];
    size_t klen;
    if (dtr__json_peek(j) != '{')
        return dtr__errf(err, errlen, DTR_CORRUPT_FILE, "%s: __metadata__ is not an object (byte %llu of the header)",
                         src, (unsigned long long)j->pos);
    j->pos++;
    if (dtr__json_accept(j, '}')) return DTR_OK;
    for (;;) {
        if (dtr__json_string(j, key, sizeof key, &klen) != DTR_OK || dtr__json_expect(j, ':') != DTR_OK)
            return dtr__errf(err, errlen, DTR_CORRUPT_FILE, "%s: __metadata__: %s", src, j->msg);
        if (dtr__json_string(j, NULL, 0, NULL) != DTR_OK)
            return dtr__errf(err, errlen, DTR_CORRUPT_FILE, "%s: __metadata__: value of \"%s%s\" must be a string: %s",
                             src, key, klen >= sizeof key ? "..." : "", j->msg);
        if (dtr__json_accept(j, ',')) continue;
        if (dtr__json_expect(j, '}') != DTR_OK)
            return dtr__errf(err, errlen, DTR_CORRUPT_FILE, "%s: __metadata__: %s", src, j->msg);
        return DTR_OK;
    }
}

/* ---- reading: the whole image ---- */

static int dtr__st_cmp_offset(const void *a, const void *b) {
    const dtr_st_entry *x = *(const dtr_st_entry *const *)a, *y = *(const dtr_st_entry *const *)b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end) return x->end < y->end ? -1 : 1;
    return 0;
}

static int dtr__st_cmp_name(const void *a, const void *b) {
    const dtr_st_entry *x = *(const dtr_st_entry *const *)a, *y = *(const dtr_st_entry *const *)b;
    return strcmp(x->name, y->name);
}

/* Unique names, and entries that tile [0, data_size) exactly. */
static dtr_result dtr__st_check_layout(dtr_st_file *f, uint64_t data_size, const char *src, char *err, size_t errlen) {
    const dtr_st_entry **v;
    uint64_t pos = 0;
    dtr_result r = DTR_OK;
    int i;
    if (f->count == 0) {
        if (data_size != 0)
            return dtr__errf(err, errlen, DTR_CORRUPT_FILE,
                             "%s: no tensors but the data section has %llu bytes (they must be covered exactly)",
                             src, (unsigned long long)data_size);
        return DTR_OK;
    }
    v = (const dtr_st_entry **)dtr__malloc(f->alloc, (size_t)f->count * sizeof *v);
    if (!v) return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "%s: out of memory checking %d entries", src, f->count);
    for (i = 0; i < f->count; i++) v[i] = &f->entries[i];

    qsort(v, (size_t)f->count, sizeof *v, dtr__st_cmp_name);
    for (i = 1; i < f->count; i++) {
        if (strcmp(v[i - 1]->name, v[i]->name) == 0) {
            r = dtr__errf(err, errlen, DTR_CORRUPT_FILE, "%s: duplicate tensor name \"%s\"", src, v[i]->name);
            goto done;
        }
    }

    qsort(v, (size_t)f->count, sizeof *v, dtr__st_cmp_offset);
    for (i = 0; i < f->count; i++) {
        if (v[i]->begin < pos) {
            r = dtr__errf(err, errlen, DTR_CORRUPT_FILE,
                          "%s: tensors \"%s\" [%llu, %llu) and \"%s\" [%llu, %llu) overlap in the data section",
                          src, v[i - 1]->name, (unsigned long long)v[i - 1]->begin, (unsigned long long)v[i - 1]->end,
                          v[i]->name, (unsigned long long)v[i]->begin, (unsigned long long)v[i]->end);
            goto done;
        }
        if (v[i]->begin > pos) {
            r = dtr__errf(err, errlen, DTR_CORRUPT_FILE,
                          "%s: gap in the data section: bytes [%llu, %llu) before tensor \"%s\" belong to no tensor",
                          src, (unsigned long long)pos, (unsigned long long)v[i]->begin, v[i]->name);
            goto done;
        }
        pos = v[i]->end;
    }
    if (pos != data_size)
        r = dtr__errf(err, errlen, DTR_CORRUPT_FILE,
                      "%s: the data section has %llu bytes but the tensors cover only %llu (%llu bytes left over)",
                      src, (unsigned long long)data_size, (unsigned long long)pos, (unsigned long long)(data_size - pos));
done:
    dtr__free(f->alloc, v);
    return r;
}

/* ---- reading: checksums ---- */

static int dtr__st_cmp_key(const void *key, const void *elt) {
    return strcmp((const char *)key, (*(const dtr_st_entry *const *)elt)->name);
}

/* 8 lowercase hex digits, exactly. */
static int dtr__st_hex32(const char *s, size_t len, uint32_t *out) {
    uint32_t v = 0;
    size_t i;
    if (len != 8) return 0;
    for (i = 0; i < 8; i++) {
        char c = s[i];
        if (c >= '0' && c <= '9') v = (v << 4) | (uint32_t)(c - '0');
        else if (c >= 'a' && c <= 'f') v = (v << 4) | (uint32_t)(c - 'a' + 10);
        else return 0;
    }
    *out = v;
    return 1;
}

/* One "crc32c.<name>": "hex" pair of __metadata__ into the entry it names (`byname`: the
 * entries sorted by name); other keys are the app's and left alone. */
static dtr_result dtr__st_take_checksum(const dtr_st_entry **byname, int count, const char *key, size_t klen,
                                        const char *val, size_t vlen, const char *src, char *err, size_t errlen) {
    const dtr_st_entry **hit;
    dtr_st_entry *e;
    if (klen <= 7 || strncmp(key, "crc32c.", 7) != 0) return DTR_OK;
    hit = (const dtr_st_entry **)bsearch(key + 7, byname, (size_t)count, sizeof *byname, dtr__st_cmp_key);
    if (!hit) return dtr__errf(err, errlen, DTR_CORRUPT_FILE, "%s: __metadata__ has a checksum for \"%s\", which is not a tensor of the file", src, key + 7);
    e = (dtr_st_entry *)*hit;
    if (!dtr__st_hex32(val, vlen, &e->crc32c))
        return dtr__errf(err, errlen, DTR_CORRUPT_FILE, "%s: tensor \"%s\": checksum \"%.16s\" is not 8 lowercase hex digits", src, e->name, val);
    e->has_crc32c = 1;
    return DTR_OK;
}

/* Reads the checksums of __metadata__ (the object at byte `at` of the validated header). */
static dtr_result dtr__st_read_checksums(dtr_st_file *f, dtr__json *j, size_t at, const char *src, char *err, size_t errlen) {
    char key[8 + sizeof f->entries->name], val[16];
    size_t klen, vlen;
    const dtr_st_entry **v = (const dtr_st_entry **)dtr__malloc(f->alloc, (size_t)(f->count ? f->count : 1) * sizeof *v);
    dtr_result r = DTR_OK;
    int i;
    if (!v) return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "%s: out of memory checking checksums", src);
    for (i = 0; i < f->count; i++) v[i] = &f->entries[i];
    qsort(v, (size_t)f->count, sizeof *v, dtr__st_cmp_name);
    j->pos = at + 1;
    while (r == DTR_OK && !dtr__json_accept(j, '}')) {
        dtr__json_accept(j, ',');
        if (dtr__json_string(j, key, sizeof key, &klen) != DTR_OK || dtr__json_expect(j, ':') != DTR_OK ||
            dtr__json_string(j, val, sizeof val, &vlen) != DTR_OK)
            r = dtr__errf(err, errlen, DTR_CORRUPT_FILE, "%s: __metadata__: %s", src, j->msg);
        else if (klen < sizeof key)
            r = dtr__st_take_checksum(v, f->count, key, klen, val, vlen < sizeof val ? vlen : sizeof val, src, err, errlen);
    }
    dtr__free(f->alloc, v);
    return r;
}

/* Every tensor's bytes against its checksum; in a file that has checksums, every tensor has one. */
static dtr_result dtr__st_verify_checksums(const dtr_st_file *f, const char *src, char *err, size_t errlen) {
    int i, any = 0;
    for (i = 0; i < f->count; i++) any |= f->entries[i].has_crc32c;
    for (i = 0; any && i < f->count; i++) {
        const dtr_st_entry *e = &f->entries[i];
        uint32_t c;
        if (!e->has_crc32c)
            return dtr__errf(err, errlen, DTR_CORRUPT_FILE, "%s: tensor \"%s\" has no checksum while the others have one", src, e->name);
        c = dtr_crc32c(0, e->data, (size_t)(e->end - e->begin));
        if (c != e->crc32c)
            return dtr__errf(err, errlen, DTR_CORRUPT_FILE,
                             "%s: tensor \"%s\": checksum mismatch (crc32c %08x in the header, %08x of the data): the file is corrupt",
                             src, e->name, (unsigned)e->crc32c, (unsigned)c);
    }
    return DTR_OK;
}

static dtr_result dtr__st_parse_image(const char *src, const void *bytes, size_t size,
                                      const dtr_allocation_callbacks *alloc, dtr_st_file *out,
                                      char *err, size_t errlen) {
    const unsigned char *b = (const unsigned char *)bytes;
    uint64_t hlen = 0, data_size;
    const char *data;
    dtr__json j;
    int cap = 0, seen_meta = 0, i;
    size_t meta_at = 0;
    dtr_result r;

    if (size < 8)
        return dtr__errf(err, errlen, DTR_CORRUPT_FILE,
                         "%s: file is %llu bytes, too short for the 8-byte header length", src, (unsigned long long)size);
    for (i = 7; i >= 0; i--) hlen = (hlen << 8) | b[i];
    if (hlen > DTR__ST_MAX_HEADER)
        return dtr__errf(err, errlen, DTR_CORRUPT_FILE, "%s: bad header length %llu: larger than the 100 MB limit",
                         src, (unsigned long long)hlen);
    if (hlen > (uint64_t)(size - 8))
        return dtr__errf(err, errlen, DTR_CORRUPT_FILE,
                         "%s: bad header length %llu: the file has only %llu bytes after the length (truncated?)",
                         src, (unsigned long long)hlen, (unsigned long long)(size - 8));
    if (hlen < 2 || b[8] != '{')
        return dtr__errf(err, errlen, DTR_CORRUPT_FILE, "%s: header is not JSON: it must start with '{'", src);
    data_size = (uint64_t)(size - 8) - hlen;
    data = (const char *)b + 8 + hlen;

    dtr__json_init(&j, (const char *)b + 8, (size_t)hlen);
    if (dtr__json_validate(&j) != DTR_OK)
        return dtr__errf(err, errlen, DTR_CORRUPT_FILE, "%s: header is not valid JSON: %s of the header", src, j.msg);

    /* the top-level object: name -> entry, "__metadata__" -> {string: string} */
    j.pos = 1;
    if (!dtr__json_accept(&j, '}')) {
        for (;;) {
            char name[256];
            size_t nlen;
            size_t at = j.pos;
            if (dtr__json_string(&j, name, sizeof name, &nlen) != DTR_OK || dtr__json_expect(&j, ':') != DTR_OK)
                return dtr__errf(err, errlen, DTR_CORRUPT_FILE, "%s: header: %s", src, j.msg);
            if (nlen >= sizeof name)
                return dtr__errf(err, errlen, DTR_CORRUPT_FILE,
                                 "%s: tensor name at byte %llu of the header is %llu bytes long (the limit is 255)",
                                 src, (unsigned long long)at, (unsigned long long)nlen);
            if (strlen(name) != nlen)
                return dtr__errf(err, errlen, DTR_CORRUPT_FILE, "%s: tensor name \"%s\\u0000...\" contains a NUL character",
                                 src, name);
            if (strcmp(name, "__metadata__") == 0) {
                if (seen_meta) return dtr__errf(err, errlen, DTR_CORRUPT_FILE, "%s: duplicate \"__metadata__\"", src);
                seen_meta = 1;
                meta_at = j.pos;
                if ((r = dtr__st_parse_metadata(&j, src, err, errlen)) != DTR_OK) return r;
            } else {
                dtr_st_entry *e;
                if (out->count == cap) {
                    int ncap = cap ? cap * 2 : 16;
                    void *p;
                    if (ncap < cap || (size_t)ncap > (size_t)-1 / sizeof(dtr_st_entry))
                        return dtr__errf(err, errlen, DTR_CORRUPT_FILE, "%s: too many tensors", src);
                    p = dtr__realloc(alloc, out->entries, (size_t)ncap * sizeof(dtr_st_entry));
                    if (!p)
                        return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "%s: out of memory for %d header entries", src, ncap);
                    out->entries = (dtr_st_entry *)p;
                    cap = ncap;
                }
                e = &out->entries[out->count];
                memset(e, 0, sizeof *e);
                memcpy(e->name, name, nlen + 1);
                if ((r = dtr__st_parse_entry(&j, src, e, data_size, err, errlen)) != DTR_OK) return r;
                e->data = data + e->begin;
                out->count++;
            }
            if (dtr__json_accept(&j, ',')) continue;
            if (dtr__json_expect(&j, '}') != DTR_OK)
                return dtr__errf(err, errlen, DTR_CORRUPT_FILE, "%s: header: %s", src, j.msg);
            break;
        }
    }
    if ((r = dtr__st_check_layout(out, data_size, src, err, errlen)) != DTR_OK) return r;
    if (seen_meta && (r = dtr__st_read_checksums(out, &j, meta_at, src, err, errlen)) != DTR_OK) return r;
    return dtr__st_verify_checksums(out, src, err, errlen);
}

/** Parses and validates a safetensors image in memory; see api.h. The entries point into
 *  `bytes`; out->bytes stays NULL (the caller owns the image) and out->size is `size`.
 *  Results: DTR_OK, DTR_NULL_HANDLE, DTR_CORRUPT_FILE, DTR_UNSUPPORTED (a dtype name that is
 *  not one of the format's, more than DTR_MAX_DIMS dims), DTR_OUT_OF_MEMORY. Entries of the
 *  format's other dtypes (I64, F64, BOOL, ...) are kept with `foreign` set. On failure `out` is
 *  left empty (safe to pass to dtr_st_destroy). Thread safe for distinct `out`. */
dtr_result dtr_st_parse(const void *bytes, size_t size, const dtr_allocation_callbacks *alloc,
                        dtr_st_file *out, char *err, size_t errlen) {
    dtr_result r;
    if (err && errlen) err[0] = '\0';
    if (!out) return dtr__errf(err, errlen, DTR_NULL_HANDLE, "dtr_st_parse: out is NULL");
    memset(out, 0, sizeof *out);
    out->alloc = alloc;
    if (!bytes && size) return dtr__errf(err, errlen, DTR_NULL_HANDLE, "dtr_st_parse: bytes is NULL");
    r = dtr__st_parse_image("safetensors image", bytes ? bytes : "", size, alloc, out, err, errlen);
    if (r != DTR_OK) {
        dtr_st_destroy(out);
        return r;
    }
    out->size = size;
    return DTR_OK;
}

/* Reads a whole stream into memory from `alloc`. 0 ok, 1 out of memory, 2 read error. */
static int dtr__st_read_all(FILE *fp, const dtr_allocation_callbacks *alloc, void **buf, size_t *size) {
    size_t cap = 1 << 16, n = 0;
    unsigned char *p;
    long hint = -1;
    if (fseek(fp, 0, SEEK_END) == 0) {
        hint = ftell(fp);
        if (fseek(fp, 0, SEEK_SET) != 0) return 2;
    }
    if (hint >= 0 && (unsigned long)hint < (size_t)-1 - 1) cap = (size_t)hint + 1;
    p = (unsigned char *)dtr__malloc(alloc, cap);
    if (!p) return 1;
    for (;;) {
        size_t got;
        if (n == cap) {
            size_t ncap = cap < ((size_t)-1) / 2 ? cap * 2 : (size_t)-1;
            void *q;
            if (ncap == cap) { dtr__free(alloc, p); return 1; }
            q = dtr__realloc(alloc, p, ncap);
            if (!q) { dtr__free(alloc, p); return 1; }
            p = (unsigned char *)q;
            cap = ncap;
        }
        got = fread(p + n, 1, cap - n, fp);
        n += got;
        if (got == 0) {
            if (ferror(fp)) { dtr__free(alloc, p); return 2; }
            break;
        }
    }
    *buf = p;
    *size = n;
    return 0;
}

/** Reads the whole file at `path` and parses it (see dtr_st_parse); out->bytes owns the
 *  file's contents until dtr_st_destroy. Results as dtr_st_parse plus DTR_IO_ERROR when the
 *  file cannot be opened or read. Messages name `path`. Thread safe for distinct `out`. */
dtr_result dtr_st_open(const char *path, const dtr_allocation_callbacks *alloc, dtr_st_file *out,
                       char *err, size_t errlen) {
    FILE *fp;
    void *buf = NULL;
    size_t size = 0;
    int rc;
    dtr_result r;
    if (err && errlen) err[0] = '\0';
    if (!out) return dtr__errf(err, errlen, DTR_NULL_HANDLE, "dtr_st_open: out is NULL");
    memset(out, 0, sizeof *out);
    out->alloc = alloc;
    if (!path) return dtr__errf(err, errlen, DTR_NULL_HANDLE, "dtr_st_open: path is NULL");
    if (dtr__not_regular_file(path))
        return dtr__errf(err, errlen, DTR_IO_ERROR, "%s: not a regular file (a folder, a FIFO or a device)", path);
    fp = fopen(path, "rb");
    if (!fp) return dtr__errf(err, errlen, DTR_IO_ERROR, "%s: cannot open: %s", path, strerror(errno));
    rc = dtr__st_read_all(fp, alloc, &buf, &size);
    fclose(fp);
    if (rc == 1) return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "%s: out of memory reading the file", path);
    if (rc == 2) return dtr__errf(err, errlen, DTR_IO_ERROR, "%s: read error: %s", path, strerror(errno));
    r = dtr__st_parse_image(path, buf, size, alloc, out, err, errlen);
    if (r != DTR_OK) {
        dtr_st_destroy(out);
        dtr__free(alloc, buf);
        return r;
    }
    out->bytes = buf;
    out->size = size;
    return DTR_OK;
}

/** Frees the entries (and, after dtr_st_open, the file's bytes) and empties `f`.
 *  NULL is ignored. */
void dtr_st_destroy(dtr_st_file *f) {
    if (!f) return;
    dtr__free(f->alloc, f->entries);
    dtr__free(f->alloc, f->bytes);
    f->entries = NULL;
    f->bytes = NULL;
    f->count = 0;
    f->size = 0;
}

/* ---- writing ---- */

/* A buffered sink that either counts bytes (to size the header) or writes them. */
/* Where the writer's bytes go: counted only (sizing the header), or to the atomic file. */
typedef struct dtr__st_sink {
    int counting;
    uint64_t total;
    dtr__afile *f;
} dtr__st_sink;

static void dtr__st_put(dtr__st_sink *s, const void *p, size_t n) {
    s->total += n;
    if (!s->counting && n) dtr__afile_write(s->f, p, n);
}

static void dtr__st_puts(dtr__st_sink *s, const char *str) { dtr__st_put(s, str, strlen(str)); }

static void dtr__st_put_u64(dtr__st_sink *s, uint64_t v) {
    char d[24];
    int i = (int)sizeof d;
    do { d[--i] = (char)('0' + v % 10); v /= 10; } while (v);
    dtr__st_put(s, d + i, sizeof d - (size_t)i);
}

/* A JSON string literal: quotes, backslashes and control characters escaped. */
static void dtr__st_put_jstr(dtr__st_sink *s, const char *str) {
    static const char hex[] = "0123456789abcdef";
    const unsigned char *p = (const unsigned char *)str;
    dtr__st_put(s, "\"", 1);
    for (; *p; p++) {
        if (*p == '"' || *p == '\\') {
            char e[2];
            e[0] = '\\';
            e[1] = (char)*p;
            dtr__st_put(s, e, 2);
        } else if (*p < 0x20) {
            char e[6];
            e[0] = '\\'; e[1] = 'u'; e[2] = '0'; e[3] = '0';
            e[4] = hex[*p >> 4]; e[5] = hex[*p & 15];
            dtr__st_put(s, e, 6);
        } else {
            dtr__st_put(s, p, 1);
        }
    }
    dtr__st_put(s, "\"", 1);
}

/* "__metadata__": each tensor's CRC-32C under "crc32c.<name>", 8 lowercase hex digits. */
static void dtr__st_put_checksums(dtr__st_sink *s, const dtr_st_entry *entries, const uint32_t *crc, int count) {
    static const char hex[] = "0123456789abcdef";
    char key[8 + sizeof entries->name], val[8];
    int i, k;
    dtr__st_puts(s, "\"__metadata__\":{");
    for (i = 0; i < count; i++) {
        if (i) dtr__st_puts(s, ",");
        snprintf(key, sizeof key, "crc32c.%s", entries[i].name);
        for (k = 0; k < 8; k++) val[k] = hex[(crc[i] >> (28 - 4 * k)) & 15u];
        dtr__st_put_jstr(s, key);
        dtr__st_puts(s, ":\"");
        dtr__st_put(s, val, 8);
        dtr__st_puts(s, "\"");
    }
    dtr__st_puts(s, "}");
}

/* The JSON header (without padding): the checksums, then the entries in order with
 * contiguous offsets. */
static void dtr__st_put_header(dtr__st_sink *s, const dtr_st_entry *entries, const uint64_t *nbytes,
                               const uint32_t *crc, int count) {
    uint64_t off = 0;
    int i, k;
    dtr__st_puts(s, "{");
    if (count) dtr__st_put_checksums(s, entries, crc, count);
    for (i = 0; i < count; i++) {
        const dtr_st_entry *e = &entries[i];
        dtr__st_puts(s, ",");
        dtr__st_put_jstr(s, e->name);
        dtr__st_puts(s, ":{\"dtype\":\"");
        dtr__st_puts(s, dtr__st_dtype_str(e->dtype));
        dtr__st_puts(s, "\",\"shape\":[");
        for (k = 0; k < e->ndim; k++) {
            if (k) dtr__st_puts(s, ",");
            dtr__st_put_u64(s, (uint64_t)e->shape[k]);
        }
        dtr__st_puts(s, "],\"data_offsets\":[");
        dtr__st_put_u64(s, off);
        dtr__st_puts(s, ",");
        dtr__st_put_u64(s, off + nbytes[i]);
        dtr__st_puts(s, "]}");
        off += nbytes[i];
    }
    dtr__st_puts(s, "}");
}

/* Checks the entries given to dtr_st_write and computes each one's size in bytes. */
static dtr_result dtr__st_check_write(const char *path, const dtr_st_entry *entries, const void *const *data,
                                      int count, uint64_t *nbytes_out, char *err, size_t errlen) {
    int i, k;
    for (i = 0; i < count; i++) {
        const dtr_st_entry *e = &entries[i];
        uint64_t numel;
        if (!memchr(e->name, '\0', sizeof e->name))
            return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "%s: entry %d: name is not NUL-terminated within 256 bytes", path, i);
        if (strcmp(e->name, "__metadata__") == 0)
            return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "%s: entry %d: \"__metadata__\" is reserved", path, i);
        if (e->foreign || !dtr__st_dtype_str(e->dtype))
            return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "%s: tensor \"%s\": unknown dtype %d", path, e->name, (int)e->dtype);
        if (e->ndim < 0 || e->ndim > DTR_MAX_DIMS)
            return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "%s: tensor \"%s\": ndim %d is outside 0..%d",
                             path, e->name, e->ndim, DTR_MAX_DIMS);
        for (k = 0; k < e->ndim; k++) {
            if (e->shape[k] < 0)
                return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "%s: tensor \"%s\": shape[%d] = %lld is negative",
                                 path, e->name, k, (long long)e->shape[k]);
        }
        if (!dtr__st_nbytes(e->ndim, e->shape, dtr__st_dtype_size(e->dtype), &numel, &nbytes_out[i]))
            return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "%s: tensor \"%s\": size overflows", path, e->name);
        if (nbytes_out[i] && !data[i])
            return dtr__errf(err, errlen, DTR_NULL_HANDLE, "%s: tensor \"%s\": data is NULL", path, e->name);
        for (k = 0; k < i; k++) {
            if (entries[k].name[0] == e->name[0] && strcmp(entries[k].name, e->name) == 0)
                return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "%s: duplicate tensor name \"%s\" (entries %d and %d)",
                                 path, e->name, k, i);
        }
    }
    return DTR_OK;
}

/** Writes `count` tensors to a safetensors file at `path`, in the given order with
 *  contiguous data offsets (the begin/end and data fields of `entries` are ignored; the
 *  bytes come from data[i], stored as they are in the entry's dtype). The header is compact
 *  JSON padded with spaces to a multiple of 8 bytes, so tensor data is 8-byte aligned in
 *  the file. The file is written atomically (dtr_write_file_atomic's temporary file, sync
 *  and rename): on failure the temporary file is removed and `path` is untouched.
 *  Results: DTR_OK, DTR_NULL_HANDLE, DTR_INVALID_ARGUMENT (bad name, dtype, shape, duplicate
 *  names), DTR_OUT_OF_MEMORY, DTR_IO_ERROR (with the path and the system's reason).
 *  Thread safe for distinct paths. Allocates with the C library (the API has no callbacks). */
dtr_result dtr_st_write(const char *path, const dtr_st_entry *entries, const void *const *data,
                        int count, char *err, size_t errlen) {
    dtr__st_sink s;
    uint64_t *nbytes = NULL, hlen, pad, total = 0;
    uint32_t *crc;
    unsigned char len8[8];
    static const char spaces[8] = { ' ', ' ', ' ', ' ', ' ', ' ', ' ', ' ' };
    dtr_result r = DTR_OK;
    int i;

    if (err && errlen) err[0] = '\0';
    if (!path) return dtr__errf(err, errlen, DTR_NULL_HANDLE, "dtr_st_write: path is NULL");
    if (count < 0) return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "%s: count %d is negative", path, count);
    if (count > 0 && (!entries || !data))
        return dtr__errf(err, errlen, DTR_NULL_HANDLE, "%s: entries or data is NULL", path);

    nbytes = (uint64_t *)dtr__calloc(NULL, (size_t)(count ? count : 1) * (sizeof *nbytes + sizeof *crc));
    if (!nbytes) return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "%s: out of memory", path);
    crc = (uint32_t *)(nbytes + (count ? count : 1));
    if ((r = dtr__st_check_write(path, entries, data, count, nbytes, err, errlen)) != DTR_OK) goto done;
    for (i = 0; i < count; i++) {
        if (total > (uint64_t)INT64_MAX - nbytes[i]) {
            r = dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "%s: total size overflows", path);
            goto done;
        }
        total += nbytes[i];
        crc[i] = dtr_crc32c(0, data[i], (size_t)nbytes[i]);
    }

    /* size the header, then pad it with spaces to a multiple of 8 */
    memset(&s, 0, sizeof s);
    s.counting = 1;
    dtr__st_put_header(&s, entries, nbytes, crc, count);
    hlen = s.total;
    pad = (8 - hlen % 8) % 8;
    hlen += pad;
    for (i = 0; i < 8; i++) len8[i] = (unsigned char)(hlen >> (8 * i));

    if ((r = dtr__afile_open(&s.f, path, err, errlen)) != DTR_OK) goto done;
    s.counting = 0;
    dtr__st_put(&s, len8, 8);
    dtr__st_put_header(&s, entries, nbytes, crc, count);
    dtr__st_put(&s, spaces, (size_t)pad);
    for (i = 0; i < count; i++) dtr__st_put(&s, data[i], (size_t)nbytes[i]);
    r = dtr__afile_commit(s.f, err, errlen);
done:
    dtr__free(NULL, nbytes);
    return r;
}
#line 10971 "dtrain.h"

/* ---- src/data/idx.c ---- */
#line 1 "src/data/idx.c"
/* ============================================================================
 * IDX files (the MNIST family) and the MNIST / Fashion-MNIST loader.
 *
 * IDX layout: magic 0x00 0x00 <type> <ndim>, then ndim big-endian u32 dims, then the
 * elements in big-endian order, row-major. Types: 0x08 u8, 0x09 i8, 0x0B i16, 0x0C i32,
 * 0x0D f32, 0x0E f64. u8 stays DTR_U8, the other integer types become DTR_I32 and the
 * float types DTR_F32. The file length must match the dims exactly (truncated files and
 * trailing bytes are errors). Compressed files (.gz) are read through zlib when the
 * library is built with -DDTR_USE_ZLIB (and linked with -lz); otherwise they are
 * recognised by their magic and refused with DTR_UNSUPPORTED and a hint.
 * ==========================================================================*/


#include <errno.h>
#ifdef DTR_USE_ZLIB
#include <zlib.h>
#endif

/* ---- parsing ---- */

/** Largest (uncompressed) IDX file dtr_idx_read accepts: 4 GiB. */
#define DTR__IDX_MAX_BYTES ((uint64_t)4 << 30)

/* Bytes per element of IDX type `t`, or 0 for an unknown type. */
static size_t dtr__idx_type_size(int t) {
    switch (t) {
    case 0x08: case 0x09: return 1;
    case 0x0B: return 2;
    case 0x0C: case 0x0D: return 4;
    case 0x0E: return 8;
    }
    return 0;
}

static const char *dtr__idx_type_name(int t) {
    switch (t) {
    case 0x08: return "u8";
    case 0x09: return "i8";
    case 0x0B: return "i16";
    case 0x0C: return "i32";
    case 0x0D: return "f32";
    case 0x0E: return "f64";
    }
    return "?";
}

static uint32_t dtr__idx_be32(const unsigned char *p) {
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | (uint32_t)p[3];
}

/* Converts numel big-endian elements of IDX type `t` at `src` into `dst` (u8, i32 or f32). */
static void dtr__idx_convert(int t, const unsigned char *src, size_t numel, void *dst) {
    size_t i;
    switch (t) {
    case 0x08:
        if (numel) memcpy(dst, src, numel);
        break;
    case 0x09:
        for (i = 0; i < numel; i++) ((int32_t *)dst)[i] = (int32_t)(signed char)src[i];
        break;
    case 0x0B:
        for (i = 0; i < numel; i++) {
            uint16_t u = (uint16_t)(((unsigned)src[2 * i] << 8) | src[2 * i + 1]);
            ((int32_t *)dst)[i] = (int32_t)(u >= 0x8000u ? (int32_t)u - 0x10000 : (int32_t)u);
        }
        break;
    case 0x0C:
        for (i = 0; i < numel; i++) {
            uint32_t u = dtr__idx_be32(src + 4 * i);
            int32_t v;
            memcpy(&v, &u, 4);
            ((int32_t *)dst)[i] = v;
        }
        break;
    case 0x0D:
        for (i = 0; i < numel; i++) {
            uint32_t u = dtr__idx_be32(src + 4 * i);
            float f;
            memcpy(&f, &u, 4);
            ((float *)dst)[i] = f;
        }
        break;
    case 0x0E:
        for (i = 0; i < numel; i++) {
            uint64_t u = ((uint64_t)dtr__idx_be32(src + 8 * i) << 32) | dtr__idx_be32(src + 8 * i + 4);
            double d;
            memcpy(&d, &u, 8);
            ((float *)dst)[i] = (float)d;
        }
        break;
    }
}

static dtr_result dtr__idx_parse_named(const char *src, const unsigned char *b, size_t size,
                                       const dtr_allocation_callbacks *alloc, dtr_idx *out,
                                       char *err, size_t errlen) {
    int type, ndim, i, zero = 0, overflow = 0;
    size_t es, out_es;
    uint64_t header, numel = 1, expected;

    if (size < 4)
        return dtr__errf(err, errlen, DTR_CORRUPT_FILE, "%s: truncated: %llu bytes, too short for the 4-byte IDX magic",
                         src, (unsigned long long)size);
    if (b[0] != 0 || b[1] != 0)
        return dtr__errf(err, errlen, DTR_CORRUPT_FILE,
                         "%s: bad magic %02x %02x %02x %02x: an IDX file starts with two zero bytes", src, b[0], b[1], b[2], b[3]);
    type = b[2];
    ndim = b[3];
    es = dtr__idx_type_size(type);
    if (!es)
        return dtr__errf(err, errlen, DTR_CORRUPT_FILE,
                         "%s: bad data type 0x%02x (IDX types: 0x08 u8, 0x09 i8, 0x0B i16, 0x0C i32, 0x0D f32, 0x0E f64)",
                         src, type);
    if (ndim == 0)
        return dtr__errf(err, errlen, DTR_CORRUPT_FILE, "%s: ndim is 0 (an IDX array has 1 to %d dims)", src, DTR_MAX_DIMS);
    if (ndim > DTR_MAX_DIMS)
        return dtr__errf(err, errlen, DTR_UNSUPPORTED, "%s: %d dims: dtrain supports at most %d", src, ndim, DTR_MAX_DIMS);
    header = 4 + 4 * (uint64_t)ndim;
    if (size < header)
        return dtr__errf(err, errlen, DTR_CORRUPT_FILE,
                         "%s: truncated: %d dims need a %llu-byte header but the file has %llu bytes",
                         src, ndim, (unsigned long long)header, (unsigned long long)size);
    for (i = 0; i < ndim; i++) {
        uint64_t d = dtr__idx_be32(b + 4 + 4 * i);
        out->dims[i] = (int64_t)d;
        if (d == 0) zero = 1;
        else if (numel > UINT64_MAX / d) overflow = 1;
        else numel *= d;
    }
    if (zero) {
        numel = 0;  /* an empty array */
    } else if (overflow || numel > (UINT64_MAX - header) / es || numel > (uint64_t)INT64_MAX) {
        char dims[160];
        size_t n = 0;
        for (i = 0; i < ndim; i++)
            n += (size_t)snprintf(dims + n, sizeof dims - n, i ? " x %lu" : "%lu", (unsigned long)out->dims[i]);
        return dtr__errf(err, errlen, DTR_CORRUPT_FILE, "%s: dims %s overflow: the element count does not fit in 64 bits",
                         src, dims);
    }
    expected = header + numel * es;
    if ((uint64_t)size != expected) {
        if ((uint64_t)size < expected)
            return dtr__errf(err, errlen, DTR_CORRUPT_FILE,
                             "%s: truncated: expected %llu bytes (%llu-byte header + %llu %s elements), the file has %llu",
                             src, (unsigned long long)expected, (unsigned long long)header, (unsigned long long)numel,
                             dtr__idx_type_name(type), (unsigned long long)size);
        return dtr__errf(err, errlen, DTR_CORRUPT_FILE,
                         "%s: trailing bytes: expected %llu bytes (%llu-byte header + %llu %s elements), the file has %llu",
                         src, (unsigned long long)expected, (unsigned long long)header, (unsigned long long)numel,
                         dtr__idx_type_name(type), (unsigned long long)size);
    }
    out->ndim = ndim;
    out->numel = (int64_t)numel;
    out->dtype = type == 0x08 ? DTR_U8 : (type == 0x0D || type == 0x0E) ? DTR_F32 : DTR_I32;
    out_es = type == 0x08 ? 1 : 4;
    if (numel > (uint64_t)((size_t)-1 / out_es))
        return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "%s: %llu elements do not fit in memory", src, (unsigned long long)numel);
    out->data = dtr__malloc(alloc, (size_t)numel * out_es);
    if (!out->data)
        return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "%s: out of memory for %llu elements", src, (unsigned long long)numel);
    dtr__idx_convert(type, b + header, (size_t)numel, out->data);
    return DTR_OK;
}

/* Empties `out` and remembers the allocator. */
static void dtr__idx_reset(dtr_idx *out, const dtr_allocation_callbacks *alloc) {
    memset(out, 0, sizeof *out);
    out->alloc = alloc;
}

/** Parses an uncompressed IDX image of `size` bytes (see the file comment for the layout).
 *  The elements are copied and converted, so `bytes` may be freed afterwards.
 *  @param out  receives dims, dtype (DTR_U8, DTR_I32 or DTR_F32), data and numel; empty on
 *              failure (safe to pass to dtr_idx_destroy).
 *  @return DTR_OK, DTR_NULL_HANDLE, DTR_CORRUPT_FILE (bad magic, type, ndim, overflowing
 *          dims, truncated or trailing bytes), DTR_UNSUPPORTED (more than DTR_MAX_DIMS dims),
 *          DTR_OUT_OF_MEMORY. Thread safe for distinct `out`. */
dtr_result dtr_idx_parse(const void *bytes, size_t size, const dtr_allocation_callbacks *alloc,
                         dtr_idx *out, char *err, size_t errlen) {
    dtr_result r;
    if (err && errlen) err[0] = '\0';
    if (!out) return dtr__errf(err, errlen, DTR_NULL_HANDLE, "dtr_idx_parse: out is NULL");
    dtr__idx_reset(out, alloc);
    if (!bytes && size) return dtr__errf(err, errlen, DTR_NULL_HANDLE, "dtr_idx_parse: bytes is NULL");
    r = dtr__idx_parse_named("IDX image", (const unsigned char *)(bytes ? bytes : ""), size, alloc, out, err, errlen);
    if (r != DTR_OK) {
        dtr_idx_destroy(out);
        dtr__idx_reset(out, alloc);
    }
    return r;
}

/* ---- reading files ---- */

/* Reads the whole (decompressed) file into memory from `alloc`, at most DTR__IDX_MAX_BYTES. */
static dtr_result dtr__idx_load(const char *path, const dtr_allocation_callbacks *alloc, unsigned char **buf,
                                size_t *size, char *err, size_t errlen) {
    size_t cap = (size_t)1 << 20, n = 0, limit;
    unsigned char *p;
    dtr_result r = DTR_OK;
#ifdef DTR_USE_ZLIB
    gzFile fp;
    errno = 0;
    fp = gzopen(path, "rb");
    if (!fp) return dtr__errf(err, errlen, DTR_IO_ERROR, "%s: cannot open: %s", path, errno ? strerror(errno) : "gzopen failed");
#else
    FILE *fp = fopen(path, "rb");
    if (!fp) return dtr__errf(err, errlen, DTR_IO_ERROR, "%s: cannot open: %s", path, strerror(errno));
#endif
    limit = (uint64_t)((size_t)-1) - 1 < DTR__IDX_MAX_BYTES ? (size_t)-1 - 1 : (size_t)DTR__IDX_MAX_BYTES;
    *buf = NULL;
    *size = 0;
    p = (unsigned char *)dtr__malloc(alloc, cap);
    if (!p) { r = dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "%s: out of memory", path); goto done; }
    for (;;) {
        size_t want, got;
        if (n == cap) {
            size_t ncap;
            void *q;
            if (cap > limit) {
                r = dtr__errf(err, errlen, DTR_UNSUPPORTED, "%s: larger than %llu bytes, the limit of dtr_idx_read",
                              path, (unsigned long long)limit);
                goto done;
            }
            ncap = cap <= limit / 2 ? cap * 2 : limit + 1;
            q = dtr__realloc(alloc, p, ncap);
            if (!q) {
                r = dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "%s: out of memory after %llu bytes", path, (unsigned long long)n);
                goto done;
            }
            p = (unsigned char *)q;
            cap = ncap;
        }
        want = cap - n < ((size_t)1 << 30) ? cap - n : ((size_t)1 << 30);
#ifdef DTR_USE_ZLIB
        {
            int got_i = gzread(fp, p + n, (unsigned)want);
            if (got_i < 0) {
                int zerr = 0;
                const char *zmsg = gzerror(fp, &zerr);
                if (zerr == Z_ERRNO)
                    r = dtr__errf(err, errlen, DTR_IO_ERROR, "%s: read error: %s", path, strerror(errno));
                else
                    r = dtr__errf(err, errlen, DTR_CORRUPT_FILE, "%s: corrupt gzip stream: %s", path, zmsg ? zmsg : "?");
                goto done;
            }
            got = (size_t)got_i;
        }
#else
        got = fread(p + n, 1, want, fp);
        if (got == 0 && ferror(fp)) {
            r = dtr__errf(err, errlen, DTR_IO_ERROR, "%s: read error: %s", path, strerror(errno));
            goto done;
        }
        if (n == 0 && got >= 2 && p[0] == 0x1f && p[1] == 0x8b) {
            r = dtr__errf(err, errlen, DTR_UNSUPPORTED,
                          "%s: gzip-compressed; build dtrain with -DDTR_USE_ZLIB and link -lz, or gunzip the file", path);
            goto done;
        }
#endif
        if (got == 0) break;
        n += got;
    }
done:
#ifdef DTR_USE_ZLIB
    {
        int zrc = gzclose(fp);
        if (r == DTR_OK && zrc != Z_OK)
            r = dtr__errf(err, errlen, zrc == Z_ERRNO ? DTR_IO_ERROR : DTR_CORRUPT_FILE,
                          "%s: corrupt gzip stream (truncated or bad checksum, zlib error %d)", path, zrc);
    }
#else
    fclose(fp);
#endif
    if (r != DTR_OK) {
        dtr__free(alloc, p);
        return r;
    }
    *buf = p;
    *size = n;
    return DTR_OK;
}

/** Reads an IDX file, plain or gzip-compressed (gzip needs DTR_USE_ZLIB; without it a gzip
 *  file gives DTR_UNSUPPORTED with a hint). Validates as dtr_idx_parse; messages name `path`.
 *  @return DTR_OK, DTR_NULL_HANDLE, DTR_IO_ERROR (open or read failed), DTR_CORRUPT_FILE
 *          (including a corrupt or truncated gzip stream), DTR_UNSUPPORTED, DTR_OUT_OF_MEMORY.
 *  Thread safe for distinct `out`. */
dtr_result dtr_idx_read(const char *path, const dtr_allocation_callbacks *alloc, dtr_idx *out,
                        char *err, size_t errlen) {
    unsigned char *buf = NULL;
    size_t size = 0;
    dtr_result r;
    if (err && errlen) err[0] = '\0';
    if (!out) return dtr__errf(err, errlen, DTR_NULL_HANDLE, "dtr_idx_read: out is NULL");
    dtr__idx_reset(out, alloc);
    if (!path) return dtr__errf(err, errlen, DTR_NULL_HANDLE, "dtr_idx_read: path is NULL");
    if ((r = dtr__idx_load(path, alloc, &buf, &size, err, errlen)) != DTR_OK) return r;
    r = dtr__idx_parse_named(path, buf, size, alloc, out, err, errlen);
    dtr__free(alloc, buf);
    if (r != DTR_OK) {
        dtr_idx_destroy(out);
        dtr__idx_reset(out, alloc);
    }
    return r;
}

/** Frees the data of an IDX array and empties it. NULL is ignored. */
void dtr_idx_destroy(dtr_idx *idx) {
    if (!idx) return;
    dtr__free(idx->alloc, idx->data);
    idx->data = NULL;
    idx->numel = 0;
    idx->ndim = 0;
}

/* ---- MNIST / Fashion-MNIST ---- */

/* Reads `name` from `dir`, preferring name.gz when zlib is compiled in (plain first otherwise). */
static dtr_result dtr__mnist_read(const char *dir, const char *name, const dtr_allocation_callbacks *alloc,
                                  dtr_idx *out, char **path_out, char *err, size_t errlen) {
    size_t dl = strlen(dir), nl = strlen(name);
    const char *sep = (dl == 0 || dir[dl - 1] == '/' || dir[dl - 1] == '\\') ? "" : "/";
    char *path = (char *)dtr__malloc(alloc, dl + nl + 8);
    int k;
    *path_out = NULL;
    if (!path) return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "%s: out of memory", dir);
    for (k = 0; k < 2; k++) {
        FILE *fp;
#ifdef DTR_USE_ZLIB
        int gz = k == 0;
#else
        int gz = k == 1;
#endif
        sprintf(path, "%s%s%s%s", dir, sep, name, gz ? ".gz" : "");
        fp = fopen(path, "rb");
        if (fp) {
            fclose(fp);
            *path_out = path;
            return dtr_idx_read(path, alloc, out, err, errlen);
        }
    }
    dtr__free(alloc, path);
    return dtr__errf(err, errlen, DTR_IO_ERROR, "%s: cannot find %s.gz or %s", dir, name, name);
}

/* Checks an images file (u8, (N, rows, cols)) or labels file (u8, (N), values 0..9). */
static dtr_result dtr__mnist_check(const dtr_idx *x, int labels, const char *path, char *err, size_t errlen) {
    int64_t i;
    if (x->dtype != DTR_U8 || x->ndim != (labels ? 1 : 3))
        return dtr__errf(err, errlen, DTR_CORRUPT_FILE, "%s: expected u8 %s, found %s with %d dims", path,
                         labels ? "labels (N)" : "images (N, rows, cols)", dtr_dtype_name(x->dtype), x->ndim);
    if (labels) {
        const unsigned char *y = (const unsigned char *)x->data;
        for (i = 0; i < x->numel; i++) {
            if (y[i] > 9)
                return dtr__errf(err, errlen, DTR_CORRUPT_FILE, "%s: label %lld is %d, outside 0..9", path, (long long)i, y[i]);
        }
    } else if (x->dims[1] > 65535 || x->dims[2] > 65535) {
        return dtr__errf(err, errlen, DTR_CORRUPT_FILE, "%s: images of %lld x %lld are too large", path,
                         (long long)x->dims[1], (long long)x->dims[2]);
    }
    return DTR_OK;
}

/* Loads one split: images as f32 / 255 (N, rows*cols) and labels as i32 (N). */
static dtr_result dtr__mnist_split(const char *dir, const char *img_name, const char *lbl_name,
                                   const dtr_allocation_callbacks *alloc, float **xs, int32_t **ys, int64_t *n,
                                   int *rows, int *cols, char *err, size_t errlen) {
    dtr_idx img, lbl;
    char *img_path = NULL, *lbl_path = NULL;
    dtr_result r;
    int64_t i;
    memset(&img, 0, sizeof img);
    memset(&lbl, 0, sizeof lbl);
    if ((r = dtr__mnist_read(dir, img_name, alloc, &img, &img_path, err, errlen)) != DTR_OK) goto done;
    if ((r = dtr__mnist_check(&img, 0, img_path, err, errlen)) != DTR_OK) goto done;
    if ((r = dtr__mnist_read(dir, lbl_name, alloc, &lbl, &lbl_path, err, errlen)) != DTR_OK) goto done;
    if ((r = dtr__mnist_check(&lbl, 1, lbl_path, err, errlen)) != DTR_OK) goto done;
    if (img.dims[0] != lbl.dims[0]) {
        r = dtr__errf(err, errlen, DTR_CORRUPT_FILE, "%s: %lld images but %s has %lld labels", img_path,
                      (long long)img.dims[0], lbl_path, (long long)lbl.dims[0]);
        goto done;
    }
    if (*rows && (img.dims[1] != *rows || img.dims[2] != *cols)) {
        r = dtr__errf(err, errlen, DTR_CORRUPT_FILE, "%s: images are %lld x %lld but the training images are %d x %d",
                      img_path, (long long)img.dims[1], (long long)img.dims[2], *rows, *cols);
        goto done;
    }
    *rows = (int)img.dims[1];
    *cols = (int)img.dims[2];
    *n = img.dims[0];
    if ((uint64_t)img.numel > (uint64_t)((size_t)-1 / sizeof(float))) {
        r = dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "%s: too many images for memory", img_path);
        goto done;
    }
    *xs = (float *)dtr__malloc(alloc, (size_t)img.numel * sizeof(float));
    *ys = (int32_t *)dtr__malloc(alloc, (size_t)lbl.numel * sizeof(int32_t));
    if (!*xs || !*ys) {
        r = dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "%s: out of memory for %lld images", img_path, (long long)img.dims[0]);
        goto done;
    }
    for (i = 0; i < img.numel; i++) (*xs)[i] = (float)((const unsigned char *)img.data)[i] / 255.0f;
    for (i = 0; i < lbl.numel; i++) (*ys)[i] = (int32_t)((const unsigned char *)lbl.data)[i];
done:
    dtr_idx_destroy(&img);
    dtr_idx_destroy(&lbl);
    dtr__free(alloc, img_path);
    dtr__free(alloc, lbl_path);
    return r;
}

/** Loads MNIST or Fashion-MNIST from `dir`: train-images-idx3-ubyte, train-labels-idx1-ubyte,
 *  t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte, each as name.gz (needs DTR_USE_ZLIB) or
 *  uncompressed. Images become f32 in [0, 1] laid out (N, rows*cols); labels i32 (N).
 *  @return DTR_OK, DTR_NULL_HANDLE, DTR_IO_ERROR (a file is missing: the message names it),
 *          DTR_CORRUPT_FILE (bad IDX, image and label counts differ, train and test image
 *          sizes differ, a label outside 0..9), DTR_UNSUPPORTED (.gz without zlib),
 *          DTR_OUT_OF_MEMORY. On failure `out` is empty. Free with dtr_mnist_destroy.
 *  Thread safe for distinct `out`. */
dtr_result dtr_mnist_load(const char *dir, const dtr_allocation_callbacks *alloc, dtr_mnist *out,
                          char *err, size_t errlen) {
    dtr_result r;
    if (err && errlen) err[0] = '\0';
    if (!out) return dtr__errf(err, errlen, DTR_NULL_HANDLE, "dtr_mnist_load: out is NULL");
    memset(out, 0, sizeof *out);
    out->alloc = alloc;
    if (!dir) return dtr__errf(err, errlen, DTR_NULL_HANDLE, "dtr_mnist_load: dir is NULL");
    r = dtr__mnist_split(dir, "train-images-idx3-ubyte", "train-labels-idx1-ubyte", alloc,
                         &out->train_x, &out->train_y, &out->train_n, &out->rows, &out->cols, err, errlen);
    if (r == DTR_OK)
        r = dtr__mnist_split(dir, "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte", alloc,
                             &out->test_x, &out->test_y, &out->test_n, &out->rows, &out->cols, err, errlen);
    if (r != DTR_OK) {
        dtr_mnist_destroy(out);
        out->alloc = alloc;
    }
    return r;
}

/** Frees the four arrays of a loaded dataset and empties it. NULL is ignored. */
void dtr_mnist_destroy(dtr_mnist *d) {
    if (!d) return;
    dtr__free(d->alloc, d->train_x);
    dtr__free(d->alloc, d->train_y);
    dtr__free(d->alloc, d->test_x);
    dtr__free(d->alloc, d->test_y);
    memset(d, 0, sizeof *d);
}
#line 11424 "dtrain.h"

/* ---- src/data/sampler.c ---- */
#line 1 "src/data/sampler.c"
/* ============================================================================
 * Distributed sampler: per-epoch seeded permutations sharded by rank with equal counts.
 * ==========================================================================*/




dtr_result dtr_sampler_init(dtr_sampler *s, int64_t n, int rank, int world, uint64_t seed, int shuffle, int drop_last) {
    if (!s) return DTR_NULL_HANDLE;
    memset(s, 0, sizeof(*s));
    if (n < 0 || world < 1 || rank < 0 || rank >= world) return DTR_INVALID_ARGUMENT;
    if (drop_last && n > 0 && n < world) return DTR_INVALID_ARGUMENT;
    s->n = n;
    s->rank = rank;
    s->world = world;
    s->seed = seed;
    s->shuffle = shuffle ? 1 : 0;
    s->drop_last = drop_last ? 1 : 0;
    return DTR_OK;
}

int64_t dtr_sampler_count(const dtr_sampler *s) {
    if (!s || s->world < 1) return 0;
    return s->drop_last ? s->n / s->world : (s->n + s->world - 1) / s->world;
}

dtr_result dtr_sampler_epoch(const dtr_sampler *s, int64_t epoch, int64_t *out, int64_t *scratch,
                             const dtr_allocation_callbacks *alloc) {
    int64_t count, i, *perm = scratch;
    dtr_rng rng;
    if (!s || !out) return DTR_NULL_HANDLE;
    count = dtr_sampler_count(s);
    if (s->n == 0 || count == 0) return DTR_OK;
    if (!perm) {
        perm = (int64_t *)dtr__malloc(alloc, (size_t)s->n * sizeof(int64_t));
        if (!perm) return DTR_OUT_OF_MEMORY;
    }
    for (i = 0; i < s->n; i++) perm[i] = i;
    if (s->shuffle) { /* Fisher-Yates from a stream keyed by the epoch: the same on every rank */
        dtr_rng_seed(&rng, s->seed, (uint64_t)epoch * 2654435761u + 1u);
        for (i = s->n - 1; i > 0; i--) {
            /* bounded draw from 64 random bits (modulo bias below 2^-24 for n < 2^40) */
            uint64_t r = ((uint64_t)dtr_rng_u32(&rng) << 32) | dtr_rng_u32(&rng);
            int64_t j = (int64_t)(r % (uint64_t)(i + 1)), t = perm[i];
            perm[i] = perm[j];
            perm[j] = t;
        }
    }
    for (i = 0; i < count; i++) out[i] = perm[(i * s->world + s->rank) % s->n]; /* wrap-around padding */
    if (perm != scratch) dtr__free(alloc, perm);
    return DTR_OK;
}
#line 11480 "dtrain.h"

/* ---- src/data/dataset.c ---- */
#line 1 "src/data/dataset.c"
/* ============================================================================
 * Datasets: the handle and its vtable, in-memory arrays, subsets, feature statistics,
 * IDX files and memory-mapped token files. CSV lives in csv.c, image folders in image.c,
 * the loader in loader.c and the streaming dataset in stream.c.
 *
 * A dataset is a `struct dtr_dataset` (data_internal.h): count, sample layout and a `get`
 * function that writes one sample into caller buffers. get() must be callable from several
 * threads at once (the loader's prefetch threads): the built-in formats only read shared
 * state after construction.
 * ==========================================================================*/




#include <errno.h>
#include <math.h>
#include <sys/time.h>
#if !defined(_WIN32)
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#define DTR__HAVE_MMAP 1
#else
#define DTR__HAVE_MMAP 0
#endif

/* ---- shared helpers ---- */

char *dtr__strdup(const dtr_allocation_callbacks *a, const char *s) {
    size_t n = strlen(s) + 1;
    char *p = (char *)dtr__malloc(a, n);
    if (p) memcpy(p, s, n);
    return p;
}

double dtr__wall_seconds(void) {
    struct timeval tv;
    gettimeofday(&tv, NULL);
    return (double)tv.tv_sec + 1e-6 * (double)tv.tv_usec;
}

dtr_result dtr__read_file(const char *path, const dtr_allocation_callbacks *a, unsigned char **buf, size_t *size,
                          char *err, size_t errlen) {
    size_t cap = 1 << 16, n = 0;
    unsigned char *p;
    FILE *fp;
    *buf = NULL;
    *size = 0;
    errno = 0;
    fp = fopen(path, "rb");
    if (!fp) return dtr__errf(err, errlen, DTR_IO_ERROR, "%s: cannot open: %s", path, errno ? strerror(errno) : "fopen failed");
    p = (unsigned char *)dtr__malloc(a, cap);
    if (!p) {
        fclose(fp);
        return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "%s: out of memory", path);
    }
    for (;;) {
        size_t got;
        if (cap - n < 2) {   /* room for one more byte and the NUL */
            unsigned char *q;
            if (cap > ((size_t)-1) / 2) {
                dtr__free(a, p);
                fclose(fp);
                return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "%s: too large for memory", path);
            }
            q = (unsigned char *)dtr__realloc(a, p, cap * 2);
            if (!q) {
                dtr__free(a, p);
                fclose(fp);
                return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "%s: out of memory after %llu bytes", path,
                                 (unsigned long long)n);
            }
            p = q;
            cap *= 2;
        }
        got = fread(p + n, 1, cap - n - 1, fp);
        n += got;
        if (got == 0) {
            if (ferror(fp)) {
                dtr__free(a, p);
                fclose(fp);
                return dtr__errf(err, errlen, DTR_IO_ERROR, "%s: read error: %s", path, strerror(errno));
            }
            break;
        }
    }
    fclose(fp);
    p[n] = 0;
    *buf = p;
    *size = n;
    return DTR_OK;
}

void dtr__sort_by_text(int64_t *v, int64_t *tmp, int64_t n, const char *buf, const size_t *off) {
    int64_t h, i, j, k;
    if (n < 2) return;
    h = n / 2;
    dtr__sort_by_text(v, tmp, h, buf, off);
    dtr__sort_by_text(v + h, tmp, n - h, buf, off);
    for (i = 0, j = h, k = 0; i < h || j < n;) {
        if (j >= n || (i < h && strcmp(buf + off[v[i]], buf + off[v[j]]) <= 0)) tmp[k++] = v[i++];
        else tmp[k++] = v[j++];
    }
    memcpy(v, tmp, (size_t)n * sizeof *v);
}

/* numel of a shape, or -1 when a dim is < 1 or the product passes 2^40 elements. */
static int64_t dtr__shape_numel(int ndim, const int64_t *shape) {
    int64_t n = 1;
    int i;
    for (i = 0; i < ndim; i++) {
        if (shape[i] < 1 || shape[i] > ((int64_t)1 << 40) / n) return -1;
        n *= shape[i];
    }
    return n;
}

int64_t dtr_sample_layout_x_numel(const dtr_sample_layout *l) {
    int64_t n;
    if (!l || l->x_ndim < 1 || l->x_ndim >= DTR_MAX_DIMS) return 0;
    n = dtr__shape_numel(l->x_ndim, l->x_shape);
    return n < 0 ? 0 : n;
}

int64_t dtr_sample_layout_y_numel(const dtr_sample_layout *l) {
    int64_t n;
    if (!l || l->unlabeled || l->y_ndim < 0 || l->y_ndim >= DTR_MAX_DIMS) return 0;
    n = dtr__shape_numel(l->y_ndim, l->y_shape);
    return n < 0 ? 0 : n;
}

dtr_result dtr__layout_check(const dtr_sample_layout *l, const char *who, char *err, size_t errlen) {
    if (!l) return dtr__errf(err, errlen, DTR_NULL_HANDLE, "%s: layout is NULL", who);
    if (l->x_dtype != DTR_F32 && l->x_dtype != DTR_I32)
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "%s: x_dtype must be DTR_F32 or DTR_I32, not %s", who,
                         dtr_dtype_name(l->x_dtype));
    if (l->x_ndim < 1 || l->x_ndim >= DTR_MAX_DIMS)
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "%s: x_ndim is %d, must be 1..%d", who, l->x_ndim,
                         DTR_MAX_DIMS - 1);
    if (dtr__shape_numel(l->x_ndim, l->x_shape) < 0)
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "%s: x_shape has a dim < 1 or too many elements", who);
    if (l->num_classes < 0)
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "%s: num_classes is negative", who);
    if (l->unlabeled) return DTR_OK;
    if (l->y_dtype != DTR_F32 && l->y_dtype != DTR_I32)
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "%s: y_dtype must be DTR_I32 or DTR_F32, not %s", who,
                         dtr_dtype_name(l->y_dtype));
    if (l->y_ndim < 0 || l->y_ndim >= DTR_MAX_DIMS)
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "%s: y_ndim is %d, must be 0..%d", who, l->y_ndim,
                         DTR_MAX_DIMS - 1);
    if (dtr__shape_numel(l->y_ndim, l->y_shape) < 0)
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "%s: y_shape has a dim < 1 or too many elements", who);
    return DTR_OK;
}

dtr_result dtr__dataset_new(const dtr_allocation_callbacks *alloc, int64_t count, const dtr_sample_layout *layout,
                            const char *name, dtr_dataset **out, char *err, size_t errlen) {
    dtr_dataset *ds;
    dtr_result r;
    *out = NULL;
    if ((r = dtr__layout_check(layout, name, err, errlen)) != DTR_OK) return r;
    if (count < 0) return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "%s: count is negative", name);
    ds = (dtr_dataset *)dtr__calloc(alloc, sizeof *ds);
    if (!ds) return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "%s: out of memory", name);
    if (alloc) ds->alloc = *alloc;
    ds->count = count;
    ds->layout = *layout;
    if (ds->layout.unlabeled) {
        ds->layout.y_ndim = 0;
        memset(ds->layout.y_shape, 0, sizeof ds->layout.y_shape);
    }
    ds->x_numel = dtr_sample_layout_x_numel(&ds->layout);
    ds->y_numel = dtr_sample_layout_y_numel(&ds->layout);
    snprintf(ds->name, sizeof ds->name, "%s", name);
    *out = ds;
    return DTR_OK;
}

/* ---- the handle ---- */

/* Custom datasets: the application's callbacks. */
typedef struct dtr__custom_ds {
    dtr_dataset_callbacks cb;
} dtr__custom_ds;

static dtr_result dtr__custom_get(dtr_dataset *ds, int64_t index, void *x, void *y, char *err, size_t errlen) {
    dtr__custom_ds *c = (dtr__custom_ds *)ds->impl;
    dtr_result r;
    if (err && errlen) err[0] = '\0';
    r = c->cb.get(c->cb.user, index, x, y, err, errlen);
    if (r != DTR_OK && err && errlen && !err[0])
        dtr__errf(err, errlen, r, "%s: sample %lld: %s", ds->name, (long long)index, dtr_result_string(r));
    return r;
}

static void dtr__custom_close(dtr_dataset *ds) {
    dtr__custom_ds *c = (dtr__custom_ds *)ds->impl;
    if (c->cb.close) c->cb.close(c->cb.user);
    dtr__free(&ds->alloc, c);
}

dtr_result dtr_dataset_create(int64_t count, const dtr_sample_layout *layout, const dtr_dataset_callbacks *cb,
                              const dtr_allocation_callbacks *alloc, dtr_dataset **out, char *err, size_t errlen) {
    dtr_dataset *ds;
    dtr__custom_ds *c;
    dtr_result r;
    if (err && errlen) err[0] = '\0';
    if (!out) return dtr__errf(err, errlen, DTR_NULL_HANDLE, "dtr_dataset_create: out is NULL");
    *out = NULL;
    if (!cb || !cb->get) return dtr__errf(err, errlen, DTR_NULL_HANDLE, "dtr_dataset_create: callbacks or get is NULL");
    if ((r = dtr__dataset_new(alloc, count, layout, "dtr_dataset_create", &ds, err, errlen)) != DTR_OK) return r;
    c = (dtr__custom_ds *)dtr__calloc(alloc, sizeof *c);
    if (!c) {
        dtr__free(alloc, ds);
        return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "dtr_dataset_create: out of memory");
    }
    c->cb = *cb;
    snprintf(ds->name, sizeof ds->name, "custom dataset");
    ds->impl = c;
    ds->get = dtr__custom_get;
    ds->close = dtr__custom_close;
    *out = ds;
    return DTR_OK;
}

void dtr_dataset_destroy(dtr_dataset *ds) {
    dtr_allocation_callbacks a;
    int i;
    if (!ds) return;
    a = ds->alloc;
    if (ds->close) ds->close(ds);
    if (ds->class_names) {
        for (i = 0; i < ds->n_class_names; i++) dtr__free(&a, ds->class_names[i]);
        dtr__free(&a, ds->class_names);
    }
    dtr__free(&a, ds);
}

int64_t dtr_dataset_count(const dtr_dataset *ds) { return ds ? ds->count : 0; }

const dtr_sample_layout *dtr_dataset_layout(const dtr_dataset *ds) { return ds ? &ds->layout : NULL; }

const char *dtr_dataset_name(const dtr_dataset *ds) { return ds ? ds->name : ""; }

dtr_result dtr_dataset_get(dtr_dataset *ds, int64_t index, void *x, void *y, char *err, size_t errlen) {
    if (err && errlen) err[0] = '\0';
    if (!ds || !x) return dtr__errf(err, errlen, DTR_NULL_HANDLE, "dtr_dataset_get: dataset or x is NULL");
    if (index < 0 || index >= ds->count)
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "%s: sample %lld is outside 0..%lld", ds->name,
                         (long long)index, (long long)ds->count - 1);
    return ds->get(ds, index, x, ds->layout.unlabeled ? NULL : y, err, errlen);
}

const char *dtr_dataset_class_name(const dtr_dataset *ds, int k) {
    while (ds && !ds->class_names && ds->base) ds = ds->base;
    if (!ds || !ds->class_names || k < 0 || k >= ds->n_class_names) return NULL;
    return ds->class_names[k];
}

/* ---- in-memory arrays ---- */

typedef struct dtr__memory_ds {
    const unsigned char *x, *y;
    void *own_x, *own_y;
    size_t x_bytes, y_bytes;   /* per sample */
} dtr__memory_ds;

static dtr_result dtr__memory_get(dtr_dataset *ds, int64_t index, void *x, void *y, char *err, size_t errlen) {
    const dtr__memory_ds *m = (const dtr__memory_ds *)ds->impl;
    (void)err;
    (void)errlen;
    memcpy(x, m->x + (size_t)index * m->x_bytes, m->x_bytes);
    if (y && m->y) memcpy(y, m->y + (size_t)index * m->y_bytes, m->y_bytes);
    return DTR_OK;
}

static void dtr__memory_close(dtr_dataset *ds) {
    dtr__memory_ds *m = (dtr__memory_ds *)ds->impl;
    dtr__free(&ds->alloc, m->own_x);
    dtr__free(&ds->alloc, m->own_y);
    dtr__free(&ds->alloc, m);
}

/* Checks i32 class labels against num_classes (when > 0). */
static dtr_result dtr__check_labels(const dtr_dataset *ds, const void *y, char *err, size_t errlen) {
    const int32_t *lab = (const int32_t *)y;
    int64_t i, n;
    if (ds->layout.unlabeled || ds->layout.y_dtype != DTR_I32 || ds->layout.num_classes <= 0 || !y) return DTR_OK;
    n = ds->count * ds->y_numel;
    for (i = 0; i < n; i++) {
        if (lab[i] < 0 || lab[i] >= ds->layout.num_classes)
            return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "%s: sample %lld: label %d is outside 0..%d", ds->name,
                             (long long)(i / ds->y_numel), (int)lab[i], ds->layout.num_classes - 1);
    }
    return DTR_OK;
}

dtr_result dtr__memory_dataset(const dtr_allocation_callbacks *alloc, int64_t count, const dtr_sample_layout *layout,
                               void *own_x, void *own_y, const char *name, dtr_dataset **out, char *err,
                               size_t errlen) {
    dtr_dataset *ds;
    dtr__memory_ds *m;
    dtr_result r;
    if ((r = dtr__dataset_new(alloc, count, layout, name, &ds, err, errlen)) != DTR_OK) {
        dtr__free(alloc, own_x);
        dtr__free(alloc, own_y);
        return r;
    }
    m = (dtr__memory_ds *)dtr__calloc(alloc, sizeof *m);
    if (!m) {
        dtr__free(alloc, own_x);
        dtr__free(alloc, own_y);
        dtr__free(alloc, ds);
        return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "%s: out of memory", name);
    }
    m->x = (const unsigned char *)own_x;
    m->y = (const unsigned char *)own_y;
    m->own_x = own_x;
    m->own_y = own_y;
    m->x_bytes = (size_t)ds->x_numel * 4;
    m->y_bytes = (size_t)ds->y_numel * 4;
    ds->impl = m;
    ds->get = dtr__memory_get;
    ds->close = dtr__memory_close;
    ds->in_memory = 1;
    *out = ds;
    return DTR_OK;
}

dtr_memory_dataset_config dtr_memory_dataset_config_init(void) {
    dtr_memory_dataset_config c;
    memset(&c, 0, sizeof c);
    return c;
}

dtr_result dtr_dataset_from_memory(const dtr_memory_dataset_config *cfg, dtr_dataset **out, char *err, size_t errlen) {
    dtr_dataset *ds = NULL;
    dtr__memory_ds *m;
    const dtr_allocation_callbacks *alloc;
    dtr_result r;
    size_t xb, yb;
    if (err && errlen) err[0] = '\0';
    if (!out) return dtr__errf(err, errlen, DTR_NULL_HANDLE, "dtr_dataset_from_memory: out is NULL");
    *out = NULL;
    if (!cfg) return dtr__errf(err, errlen, DTR_NULL_HANDLE, "dtr_dataset_from_memory: cfg is NULL");
    alloc = &cfg->alloc;
    if ((r = dtr__memory_dataset(alloc, cfg->count, &cfg->layout, NULL, NULL, "memory", &ds, err, errlen)) != DTR_OK)
        return r;
    m = (dtr__memory_ds *)ds->impl;
    if (ds->count > 0 && (!cfg->x || (!ds->layout.unlabeled && !cfg->y))) {
        r = dtr__errf(err, errlen, DTR_NULL_HANDLE, "dtr_dataset_from_memory: x%s is NULL",
                      ds->layout.unlabeled ? "" : " or y");
        dtr_dataset_destroy(ds);
        return r;
    }
    if ((uint64_t)ds->count > ((uint64_t)(size_t)-1 / 8) / (uint64_t)(ds->x_numel + ds->y_numel + 1)) {
        dtr_dataset_destroy(ds);
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "dtr_dataset_from_memory: too many samples");
    }
    xb = (size_t)ds->count * m->x_bytes;
    yb = (size_t)ds->count * m->y_bytes;
    if (cfg->copy && ds->count > 0) {
        m->own_x = dtr__malloc(alloc, xb);
        m->own_y = yb ? dtr__malloc(alloc, yb) : NULL;
        if (!m->own_x || (yb && !m->own_y)) {
            dtr_dataset_destroy(ds);
            return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "dtr_dataset_from_memory: out of memory for %lld samples",
                             (long long)cfg->count);
        }
        memcpy(m->own_x, cfg->x, xb);
        if (yb) memcpy(m->own_y, cfg->y, yb);
        m->x = (const unsigned char *)m->own_x;
        m->y = (const unsigned char *)m->own_y;
    } else {
        m->x = (const unsigned char *)cfg->x;
        m->y = (const unsigned char *)(ds->layout.unlabeled ? NULL : cfg->y);
    }
    if ((r = dtr__check_labels(ds, m->y, err, errlen)) != DTR_OK) {
        dtr_dataset_destroy(ds);
        return r;
    }
    *out = ds;
    return DTR_OK;
}

/* ---- subsets ---- */

typedef struct dtr__subset_ds {
    dtr_dataset *base;
    int64_t *index;
} dtr__subset_ds;

static dtr_result dtr__subset_get(dtr_dataset *ds, int64_t index, void *x, void *y, char *err, size_t errlen) {
    const dtr__subset_ds *s = (const dtr__subset_ds *)ds->impl;
    return s->base->get(s->base, s->index[index], x, y, err, errlen);
}

static void dtr__subset_close(dtr_dataset *ds) {
    dtr__subset_ds *s = (dtr__subset_ds *)ds->impl;
    dtr__free(&ds->alloc, s->index);
    dtr__free(&ds->alloc, s);
}

dtr_result dtr_dataset_subset(dtr_dataset *base, const int64_t *indices, int64_t n, dtr_dataset **out, char *err,
                              size_t errlen) {
    dtr_dataset *ds;
    dtr__subset_ds *s;
    dtr_result r;
    int64_t i;
    if (err && errlen) err[0] = '\0';
    if (!out) return dtr__errf(err, errlen, DTR_NULL_HANDLE, "dtr_dataset_subset: out is NULL");
    *out = NULL;
    if (!base || (n > 0 && !indices)) return dtr__errf(err, errlen, DTR_NULL_HANDLE, "dtr_dataset_subset: base or indices is NULL");
    if (n < 0) return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "dtr_dataset_subset: n is negative");
    for (i = 0; i < n; i++) {
        if (indices[i] < 0 || indices[i] >= base->count)
            return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "%s: subset index %lld is %lld, outside 0..%lld", base->name,
                             (long long)i, (long long)indices[i], (long long)base->count - 1);
    }
    if ((r = dtr__dataset_new(&base->alloc, n, &base->layout, base->name, &ds, err, errlen)) != DTR_OK) return r;
    s = (dtr__subset_ds *)dtr__calloc(&base->alloc, sizeof *s);
    if (s) s->index = (int64_t *)dtr__malloc(&base->alloc, (size_t)(n ? n : 1) * sizeof(int64_t));
    if (!s || !s->index) {
        if (s) dtr__free(&base->alloc, s);
        dtr__free(&base->alloc, ds);
        return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "%s: out of memory for a subset of %lld", base->name, (long long)n);
    }
    if (n) memcpy(s->index, indices, (size_t)n * sizeof(int64_t));
    s->base = base;
    ds->impl = s;
    ds->base = base;
    ds->in_memory = base->in_memory;
    ds->get = dtr__subset_get;
    ds->close = dtr__subset_close;
    *out = ds;
    return DTR_OK;
}

/* ---- feature statistics ---- */

dtr_result dtr_dataset_feature_stats(dtr_dataset *ds, int per_channel, float *mean, float *std, char *err,
                                     size_t errlen) {
    int64_t nx, ns, per, i, k;
    float *x = NULL;
    double *shift = NULL, *s1 = NULL, *s2 = NULL;
    void *y = NULL;
    dtr_result r = DTR_OK;
    if (err && errlen) err[0] = '\0';
    if (!ds || !mean || !std) return dtr__errf(err, errlen, DTR_NULL_HANDLE, "dtr_dataset_feature_stats: NULL argument");
    if (ds->layout.x_dtype != DTR_F32)
        return dtr__errf(err, errlen, DTR_DTYPE_MISMATCH, "%s: feature statistics need f32 samples", ds->name);
    if (ds->count < 1) return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "%s: the dataset is empty", ds->name);
    nx = ds->x_numel;
    ns = per_channel ? ds->layout.x_shape[0] : nx;   /* statistics slots */
    per = nx / ns;                                     /* elements per slot per sample */
    x = (float *)dtr__malloc(&ds->alloc, (size_t)nx * sizeof(float));
    y = dtr__malloc(&ds->alloc, (size_t)(ds->y_numel + 1) * 4);
    shift = (double *)dtr__calloc(&ds->alloc, (size_t)ns * sizeof(double));
    s1 = (double *)dtr__calloc(&ds->alloc, (size_t)ns * sizeof(double));
    s2 = (double *)dtr__calloc(&ds->alloc, (size_t)ns * sizeof(double));
    if (!x || !y || !shift || !s1 || !s2) {
        r = dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "%s: out of memory", ds->name);
        goto done;
    }
    /* shifted sums (shift = the first sample's slot value) keep the variance accurate for
     * data far from zero */
    for (i = 0; i < ds->count; i++) {
        if ((r = ds->get(ds, i, x, ds->layout.unlabeled ? NULL : y, err, errlen)) != DTR_OK) goto done;
        for (k = 0; k < nx; k++) {
            int64_t slot = k / per;
            double d;
            if (i == 0 && k % per == 0) shift[slot] = x[k];
            d = (double)x[k] - shift[slot];
            s1[slot] += d;
            s2[slot] += d * d;
        }
    }
    for (k = 0; k < ns; k++) {
        double n = (double)ds->count * (double)per, m = s1[k] / n, var = s2[k] / n - m * m;
        double sd = var > 0 ? sqrt(var) : 0.0;
        mean[k] = (float)(shift[k] + m);
        std[k] = sd > 0 ? (float)sd : 1.0f;
    }
done:
    dtr__free(&ds->alloc, x);
    dtr__free(&ds->alloc, y);
    dtr__free(&ds->alloc, shift);
    dtr__free(&ds->alloc, s1);
    dtr__free(&ds->alloc, s2);
    return r;
}

/* ---- IDX ---- */

typedef struct dtr__idx_ds {
    dtr_idx images, labels;
    int has_labels;
    float lut[256];   /* u8 -> f32: v / 255 */
} dtr__idx_ds;

static dtr_result dtr__idx_ds_get(dtr_dataset *ds, int64_t index, void *x, void *y, char *err, size_t errlen) {
    const dtr__idx_ds *d = (const dtr__idx_ds *)ds->impl;
    int64_t n = ds->x_numel, i;
    float *xf = (float *)x;
    (void)err;
    (void)errlen;
    if (d->images.dtype == DTR_U8) {
        const unsigned char *p = (const unsigned char *)d->images.data + index * n;
        for (i = 0; i < n; i++) xf[i] = d->lut[p[i]];
    } else if (d->images.dtype == DTR_I32) {
        const int32_t *p = (const int32_t *)d->images.data + index * n;
        for (i = 0; i < n; i++) xf[i] = (float)p[i];
    } else {
        memcpy(xf, (const float *)d->images.data + index * n, (size_t)n * sizeof(float));
    }
    if (y && d->has_labels) {
        int64_t m = ds->y_numel;
        if (d->labels.dtype == DTR_U8) {
            const unsigned char *p = (const unsigned char *)d->labels.data + index * m;
            for (i = 0; i < m; i++) ((int32_t *)y)[i] = (int32_t)p[i];
        } else {
            memcpy(y, (const char *)d->labels.data + (size_t)(index * m) * 4, (size_t)m * 4);
        }
    }
    return DTR_OK;
}

static void dtr__idx_ds_close(dtr_dataset *ds) {
    dtr__idx_ds *d = (dtr__idx_ds *)ds->impl;
    dtr_idx_destroy(&d->images);
    dtr_idx_destroy(&d->labels);
    dtr__free(&ds->alloc, d);
}

dtr_result dtr_dataset_open_idx(const char *images_path, const char *labels_path, const dtr_allocation_callbacks *alloc,
                                dtr_dataset **out, char *err, size_t errlen) {
    dtr_sample_layout L;
    dtr_dataset *ds = NULL;
    dtr__idx_ds *d;
    dtr_result r;
    int i;
    if (err && errlen) err[0] = '\0';
    if (!out) return dtr__errf(err, errlen, DTR_NULL_HANDLE, "dtr_dataset_open_idx: out is NULL");
    *out = NULL;
    if (!images_path) return dtr__errf(err, errlen, DTR_NULL_HANDLE, "dtr_dataset_open_idx: images_path is NULL");
    memset(&L, 0, sizeof L);
    L.x_dtype = DTR_F32;
    L.x_ndim = 1;
    L.x_shape[0] = 1;
    L.unlabeled = 1;
    /* the handle first: the IDX arrays keep a pointer to its allocation callbacks */
    if ((r = dtr__dataset_new(alloc, 0, &L, images_path, &ds, err, errlen)) != DTR_OK) return r;
    d = (dtr__idx_ds *)dtr__calloc(alloc, sizeof *d);
    if (!d) {
        dtr__free(alloc, ds);
        return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "%s: out of memory", images_path);
    }
    for (i = 0; i < 256; i++) d->lut[i] = (float)i / 255.0f;
    ds->impl = d;
    ds->get = dtr__idx_ds_get;
    ds->close = dtr__idx_ds_close;
    ds->in_memory = 1;
    if ((r = dtr_idx_read(images_path, &ds->alloc, &d->images, err, errlen)) != DTR_OK) goto fail;
    if (d->images.ndim < 1) {
        r = dtr__errf(err, errlen, DTR_CORRUPT_FILE, "%s: no sample dimension", images_path);
        goto fail;
    }
    memset(&L, 0, sizeof L);
    L.x_dtype = DTR_F32;
    if (d->images.ndim == 1) {
        L.x_ndim = 1;
        L.x_shape[0] = 1;
    } else if (d->images.ndim == 3) {   /* (N, rows, cols) images: (1, rows, cols) */
        L.x_ndim = 3;
        L.x_shape[0] = 1;
        L.x_shape[1] = d->images.dims[1];
        L.x_shape[2] = d->images.dims[2];
    } else {
        L.x_ndim = d->images.ndim - 1;
        for (i = 1; i < d->images.ndim; i++) L.x_shape[i - 1] = d->images.dims[i];
    }
    L.unlabeled = 1;
    if (labels_path) {
        if ((r = dtr_idx_read(labels_path, &ds->alloc, &d->labels, err, errlen)) != DTR_OK) goto fail;
        if (d->labels.ndim < 1 || d->labels.dims[0] != d->images.dims[0]) {
            r = dtr__errf(err, errlen, DTR_CORRUPT_FILE, "%s: %lld labels but %s has %lld images", labels_path,
                          (long long)(d->labels.ndim ? d->labels.dims[0] : 0), images_path, (long long)d->images.dims[0]);
            goto fail;
        }
        d->has_labels = 1;
        L.unlabeled = 0;
        L.y_dtype = d->labels.dtype == DTR_F32 ? DTR_F32 : DTR_I32;
        L.y_ndim = d->labels.ndim - 1;
        for (i = 1; i < d->labels.ndim; i++) L.y_shape[i - 1] = d->labels.dims[i];
        if (L.y_dtype == DTR_I32) {
            int64_t k, mx = -1;
            for (k = 0; k < d->labels.numel; k++) {
                int64_t v = d->labels.dtype == DTR_U8 ? (int64_t)((const unsigned char *)d->labels.data)[k]
                                                      : (int64_t)((const int32_t *)d->labels.data)[k];
                if (v < 0) {
                    r = dtr__errf(err, errlen, DTR_CORRUPT_FILE, "%s: label %lld is %lld, a negative class", labels_path,
                                  (long long)k, (long long)v);
                    goto fail;
                }
                if (v > mx) mx = v;
            }
            L.num_classes = mx >= 0 && mx < INT32_MAX ? (int)(mx + 1) : 0;
        }
    }
    if ((r = dtr__layout_check(&L, images_path, err, errlen)) != DTR_OK) {
        r = DTR_CORRUPT_FILE;
        goto fail;
    }
    ds->layout = L;
    ds->count = d->images.dims[0];
    ds->x_numel = dtr_sample_layout_x_numel(&L);
    ds->y_numel = dtr_sample_layout_y_numel(&L);
    *out = ds;
    return DTR_OK;
fail:
    dtr_dataset_destroy(ds);
    return r;
}

/* ---- token files ---- */

typedef struct dtr__token_ds {
    const unsigned char *tokens;   /* first token */
    int64_t ntok;
    int tb;                        /* bytes per token */
    int64_t context, stride, vocab;
    void *map;                     /* mmap'd region (or NULL) */
    size_t map_len;
    unsigned char *owned;          /* read into memory (no mmap, or an empty file) */
} dtr__token_ds;

dtr_token_file_config dtr_token_file_config_init(void) {
    dtr_token_file_config c;
    memset(&c, 0, sizeof c);
    c.token_bytes = 2;
    return c;
}

static uint32_t dtr__token_at(const dtr__token_ds *t, int64_t i) {
    const unsigned char *p = t->tokens + (size_t)i * (size_t)t->tb;
    if (t->tb == 2) return (uint32_t)p[0] | ((uint32_t)p[1] << 8);
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

static dtr_result dtr__token_get(dtr_dataset *ds, int64_t index, void *x, void *y, char *err, size_t errlen) {
    const dtr__token_ds *t = (const dtr__token_ds *)ds->impl;
    int64_t start = index * t->stride, i;
    int32_t *xi = (int32_t *)x, *yi = (int32_t *)y;
    for (i = 0; i <= t->context; i++) {
        uint32_t v = dtr__token_at(t, start + i);
        if (v > (uint32_t)INT32_MAX || (t->vocab > 0 && (int64_t)v >= t->vocab))
            return dtr__errf(err, errlen, DTR_CORRUPT_FILE,
                             "%s: sample %lld: token %lu at position %lld is outside the vocabulary (%lld)", ds->name,
                             (long long)index, (unsigned long)v, (long long)(start + i),
                             (long long)(t->vocab > 0 ? t->vocab : (int64_t)INT32_MAX + 1));
        if (i < t->context) xi[i] = (int32_t)v;
        if (i > 0 && yi) yi[i - 1] = (int32_t)v;
    }
    return DTR_OK;
}

static void dtr__token_close(dtr_dataset *ds) {
    dtr__token_ds *t = (dtr__token_ds *)ds->impl;
#if DTR__HAVE_MMAP
    if (t->map) munmap(t->map, t->map_len);
#endif
    dtr__free(&ds->alloc, t->owned);
    dtr__free(&ds->alloc, t);
}

dtr_result dtr_dataset_open_tokens(const dtr_token_file_config *cfg, dtr_dataset **out, char *err, size_t errlen) {
    dtr_sample_layout L;
    dtr_dataset *ds = NULL;
    dtr__token_ds *t;
    const unsigned char *bytes = NULL;
    size_t size = 0, data;
    dtr_result r;
    int tb;
    if (err && errlen) err[0] = '\0';
    if (!out) return dtr__errf(err, errlen, DTR_NULL_HANDLE, "dtr_dataset_open_tokens: out is NULL");
    *out = NULL;
    if (!cfg || !cfg->path) return dtr__errf(err, errlen, DTR_NULL_HANDLE, "dtr_dataset_open_tokens: cfg or path is NULL");
    tb = cfg->token_bytes ? cfg->token_bytes : 2;
    if (tb != 2 && tb != 4)
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "%s: token_bytes is %d, must be 2 or 4", cfg->path, tb);
    if (cfg->context < 1 || cfg->context > ((int64_t)1 << 30) || cfg->stride < 0 || cfg->vocab_size < 0)
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "%s: need context in 1..2^30, stride >= 0, vocab_size >= 0",
                         cfg->path);
    memset(&L, 0, sizeof L);
    L.x_dtype = DTR_I32;
    L.x_ndim = 1;
    L.x_shape[0] = cfg->context;
    L.y_dtype = DTR_I32;
    L.y_ndim = 1;
    L.y_shape[0] = cfg->context;
    L.num_classes = cfg->vocab_size > 0 && cfg->vocab_size <= INT32_MAX ? (int)cfg->vocab_size : 0;
    if ((r = dtr__dataset_new(&cfg->alloc, 0, &L, cfg->path, &ds, err, errlen)) != DTR_OK) return r;
    t = (dtr__token_ds *)dtr__calloc(&cfg->alloc, sizeof *t);
    if (!t) {
        dtr__free(&cfg->alloc, ds);
        return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "%s: out of memory", cfg->path);
    }
    ds->impl = t;
    ds->get = dtr__token_get;
    ds->close = dtr__token_close;
#if DTR__HAVE_MMAP
    {
        struct stat st;
        int fd;
        errno = 0;
        fd = open(cfg->path, O_RDONLY);
        if (fd < 0) {
            r = dtr__errf(err, errlen, DTR_IO_ERROR, "%s: cannot open: %s", cfg->path, strerror(errno));
            goto fail;
        }
        if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
            r = dtr__errf(err, errlen, DTR_IO_ERROR, "%s: not a regular file", cfg->path);
            close(fd);
            goto fail;
        }
        if ((uint64_t)st.st_size > (uint64_t)((size_t)-1 / 2)) {
            r = dtr__errf(err, errlen, DTR_IO_ERROR, "%s: too large to map", cfg->path);
            close(fd);
            goto fail;
        }
        size = (size_t)st.st_size;
        if (size > 0) {
            void *p = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
            if (p == MAP_FAILED) {
                r = dtr__errf(err, errlen, DTR_IO_ERROR, "%s: cannot map: %s", cfg->path, strerror(errno));
                close(fd);
                goto fail;
            }
            t->map = p;
            t->map_len = size;
            bytes = (const unsigned char *)p;
        }
        close(fd);
    }
#else
    if ((r = dtr__read_file(cfg->path, &cfg->alloc, &t->owned, &size, err, errlen)) != DTR_OK) goto fail;
    bytes = t->owned;
#endif
    if (size < cfg->header_bytes) {
        r = dtr__errf(err, errlen, DTR_CORRUPT_FILE, "%s: %llu bytes, shorter than the %llu-byte header", cfg->path,
                      (unsigned long long)size, (unsigned long long)cfg->header_bytes);
        goto fail;
    }
    data = size - cfg->header_bytes;
    if (data % (size_t)tb) {
        r = dtr__errf(err, errlen, DTR_CORRUPT_FILE, "%s: %llu bytes of tokens is not a whole number of %d-byte tokens (truncated?)",
                      cfg->path, (unsigned long long)data, tb);
        goto fail;
    }
    t->tokens = bytes ? bytes + cfg->header_bytes : NULL;
    t->ntok = (int64_t)(data / (size_t)tb);
    t->tb = tb;
    t->context = cfg->context;
    t->stride = cfg->stride ? cfg->stride : cfg->context;
    t->vocab = cfg->vocab_size;
    ds->count = t->ntok >= cfg->context + 1 ? (t->ntok - cfg->context - 1) / t->stride + 1 : 0;
    *out = ds;
    return DTR_OK;
fail:
    dtr_dataset_destroy(ds);
    return r;
}
#line 12257 "dtrain.h"

/* ---- src/data/csv.c ---- */
#line 1 "src/data/csv.c"
/* ============================================================================
 * CSV datasets: a whole file (or buffer) parsed into an in-memory dataset.
 *
 * Grammar (RFC 4180 with the usual leniencies): records end with LF or CRLF; fields are
 * separated by the delimiter; a field may be quoted ("..." with "" for a quote inside, and
 * may then span lines); spaces and tabs around a field are dropped (unless the delimiter is
 * a tab: then only spaces); empty and blank records are skipped; a UTF-8 BOM is skipped.
 * Numbers are parsed here, not by strtod, so the C locale of the application (a decimal
 * comma) cannot change them: [+-]digits[.digits][(e|E)[+-]digits]. Every error names
 * "file:line:column" (column = the 1-based field number) and the column's header name.
 * ==========================================================================*/




#include <math.h>

/* ---- fields ---- */

typedef struct dtr__csv_field {
    const char *p;      /* content (inside the quotes) */
    size_t n;
    int quoted;
    int escaped;        /* contains "" */
} dtr__csv_field;

typedef struct dtr__csv {
    const char *name;                 /* for messages */
    const char *s, *end;              /* the text */
    const char *cur;
    int64_t line;                     /* line of `cur` (1-based) */
    char delim;
    dtr__csv_field *f;                /* fields of the current record */
    int nf, capf;
    int64_t rec_line;                 /* first line of the current record */
    const dtr_allocation_callbacks *alloc;
    char *err;
    size_t errlen;
} dtr__csv;

static int dtr__csv_space(const dtr__csv *c, char ch) {
    return ch == ' ' || (ch == '\t' && c->delim != '\t');
}

/* Reads the next record into c->f. Returns 1 with a record, 0 at the end, or a negative
 * dtr_result. Blank records (one empty unquoted field) are skipped. */
static int dtr__csv_record(dtr__csv *c) {
    for (;;) {
        const char *p = c->cur;
        if (p >= c->end) return 0;
        c->nf = 0;
        c->rec_line = c->line;
        for (;;) {
            dtr__csv_field fld;
            while (p < c->end && dtr__csv_space(c, *p)) p++;
            memset(&fld, 0, sizeof fld);
            if (p < c->end && *p == '"') {
                int64_t qline = c->line;
                fld.quoted = 1;
                fld.p = ++p;
                for (;;) {
                    if (p >= c->end)
                        return dtr__errf(c->err, c->errlen, DTR_CORRUPT_FILE, "%s:%lld:%d: unterminated quoted field",
                                         c->name, (long long)qline, c->nf + 1);
                    if (*p == '"') {
                        if (p + 1 < c->end && p[1] == '"') {
                            fld.escaped = 1;
                            p += 2;
                            continue;
                        }
                        break;
                    }
                    if (*p == '\n') c->line++;
                    p++;
                }
                fld.n = (size_t)(p - fld.p);
                p++;   /* closing quote */
                while (p < c->end && dtr__csv_space(c, *p)) p++;
                if (p < c->end && *p != c->delim && *p != '\n' && !(*p == '\r' && (p + 1 == c->end || p[1] == '\n')))
                    return dtr__errf(c->err, c->errlen, DTR_CORRUPT_FILE,
                                     "%s:%lld:%d: unexpected character after a closing quote", c->name,
                                     (long long)c->line, c->nf + 1);
            } else {
                const char *q;
                fld.p = p;
                while (p < c->end && *p != c->delim && *p != '\n') p++;
                q = p;
                if (q > fld.p && q[-1] == '\r' && (q == c->end || *q == '\n')) q--;
                while (q > fld.p && dtr__csv_space(c, q[-1])) q--;
                fld.n = (size_t)(q - fld.p);
            }
            if (c->nf == c->capf) {
                int cap = c->capf ? c->capf * 2 : 16;
                dtr__csv_field *nfp;
                if (cap > (1 << 24))
                    return dtr__errf(c->err, c->errlen, DTR_CORRUPT_FILE, "%s:%lld: more than %d fields in a record",
                                     c->name, (long long)c->rec_line, 1 << 24);
                nfp = (dtr__csv_field *)dtr__realloc(c->alloc, c->f, (size_t)cap * sizeof *nfp);
                if (!nfp) return dtr__errf(c->err, c->errlen, DTR_OUT_OF_MEMORY, "%s: out of memory", c->name);
                c->f = nfp;
                c->capf = cap;
            }
            c->f[c->nf++] = fld;
            if (p < c->end && *p == c->delim) {
                p++;
                continue;
            }
            if (p < c->end && *p == '\r') p++;
            if (p < c->end && *p == '\n') {
                p++;
                c->line++;
            }
            break;
        }
        c->cur = p;
        if (c->nf == 1 && !c->f[0].quoted && c->f[0].n == 0) continue;   /* blank line */
        return 1;
    }
}

/* The content of a field with "" turned into ", as a NUL-terminated copy (NULL on OOM). */
static char *dtr__csv_text(const dtr_allocation_callbacks *a, const dtr__csv_field *f) {
    char *s = (char *)dtr__malloc(a, f->n + 1);
    size_t i, k = 0;
    if (!s) return NULL;
    for (i = 0; i < f->n; i++) {
        s[k++] = f->p[i];
        if (f->escaped && f->p[i] == '"' && i + 1 < f->n && f->p[i + 1] == '"') i++;
    }
    s[k] = '\0';
    return s;
}

/* ---- numbers ---- */

static int dtr__ieq(const char *p, size_t n, const char *word) {
    size_t i;
    for (i = 0; i < n; i++) {
        char a = p[i], b = word[i];
        if (!b) return 0;
        if (a >= 'A' && a <= 'Z') a = (char)(a - 'A' + 'a');
        if (a != b) return 0;
    }
    return word[n] == '\0';
}

/* 1 when the field is a missing value: empty, NA, N/A, NaN, null, none or ?. */
static int dtr__csv_missing(const dtr__csv_field *f) {
    return f->n == 0 || dtr__ieq(f->p, f->n, "na") || dtr__ieq(f->p, f->n, "n/a") || dtr__ieq(f->p, f->n, "nan") ||
           dtr__ieq(f->p, f->n, "null") || dtr__ieq(f->p, f->n, "none") || dtr__ieq(f->p, f->n, "?");
}

/* Parses the whole of p[0..n) as a finite decimal number. Returns 1 on success. Up to 19
 * significant digits are kept exactly; the power of ten is applied in double, which is
 * far more precise than the f32 the values become. */
static int dtr__parse_number(const char *p, size_t n, double *out) {
    static const double pow10[] = {1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10, 1e11,
                                   1e12, 1e13, 1e14, 1e15, 1e16, 1e17, 1e18, 1e19, 1e20, 1e21, 1e22};
    size_t i = 0;
    int neg = 0, digits = 0, sig = 0;
    uint64_t m = 0;
    long e10 = 0;
    double v;
    if (i < n && (p[i] == '+' || p[i] == '-')) neg = p[i++] == '-';
    for (; i < n && p[i] >= '0' && p[i] <= '9'; i++, digits++) {
        if (sig < 19) {
            if (m || p[i] != '0') sig++;
            m = m * 10 + (uint64_t)(p[i] - '0');
        } else {
            e10++;
        }
    }
    if (i < n && p[i] == '.') {
        for (i++; i < n && p[i] >= '0' && p[i] <= '9'; i++, digits++) {
            if (sig < 19) {
                if (m || p[i] != '0') sig++;
                m = m * 10 + (uint64_t)(p[i] - '0');
                e10--;
            }
        }
    }
    if (!digits) return 0;
    if (i < n && (p[i] == 'e' || p[i] == 'E')) {
        int eneg = 0, ed = 0;
        long ev = 0;
        i++;
        if (i < n && (p[i] == '+' || p[i] == '-')) eneg = p[i++] == '-';
        for (; i < n && p[i] >= '0' && p[i] <= '9'; i++, ed++)
            if (ev < 100000) ev = ev * 10 + (p[i] - '0');
        if (!ed) return 0;
        e10 += eneg ? -ev : ev;
    }
    if (i != n) return 0;
    v = (double)m;
    if (m == 0) {
        v = 0.0;
    } else if (e10 > 0) {
        while (e10 > 22 && v < 1e300) { v *= 1e22; e10 -= 22; }
        v = e10 > 22 ? HUGE_VAL : v * pow10[e10];
    } else if (e10 < 0) {
        while (e10 < -22 && v > 1e-300) { v /= 1e22; e10 += 22; }
        v = e10 < -22 ? 0.0 : v / pow10[-e10];
    }
    if (!(v <= 3.4028234663852886e38)) return 0;   /* passes f32 (or inf) */
    *out = neg ? -v : v;
    return 1;
}

/* ---- the dataset ---- */

dtr_csv_config dtr_csv_config_init(void) {
    dtr_csv_config c;
    memset(&c, 0, sizeof c);
    c.label_column = -1;
    return c;
}

/* One data record's label: its number, or where its text is. */
typedef struct dtr__csv_label {
    double v;
    int numeric;
    dtr__csv_field f;
    int64_t line;
} dtr__csv_label;

typedef struct dtr__csv_parse {
    char **names;          /* ncols column names */
    int ncols;
    unsigned char *role;   /* per column: 0 feature, 1 label, 2 ignored */
    float *x;
    int64_t xcap, rows;
    dtr__csv_label *lab;
    int64_t labcap;
} dtr__csv_parse;

static void dtr__csv_parse_free(const dtr_allocation_callbacks *a, dtr__csv_parse *P) {
    int i;
    if (P->names) {
        for (i = 0; i < P->ncols; i++) dtr__free(a, P->names[i]);
        dtr__free(a, P->names);
    }
    dtr__free(a, P->role);
    dtr__free(a, P->x);
    dtr__free(a, P->lab);
}

/* Column roles from the configuration and the header. */
static dtr_result dtr__csv_roles(dtr__csv *c, const dtr_csv_config *cfg, dtr__csv_parse *P, int has_header) {
    int j, label = -1;
    P->role = (unsigned char *)dtr__calloc(c->alloc, (size_t)P->ncols);
    if (!P->role) return dtr__errf(c->err, c->errlen, DTR_OUT_OF_MEMORY, "%s: out of memory", c->name);
    if (cfg->label_kind != DTR_LABEL_NONE) {
        if (cfg->label_name) {
            if (!has_header)
                return dtr__errf(c->err, c->errlen, DTR_NOT_FOUND, "%s: label_name \"%s\" given but the file has no header",
                                 c->name, cfg->label_name);
            for (j = 0; j < P->ncols && label < 0; j++)
                if (strcmp(P->names[j], cfg->label_name) == 0) label = j;
            if (label < 0)
                return dtr__errf(c->err, c->errlen, DTR_NOT_FOUND, "%s: no column named \"%s\" in the header", c->name,
                                 cfg->label_name);
        } else {
            label = cfg->label_column < 0 ? P->ncols + cfg->label_column : cfg->label_column;
            if (label < 0 || label >= P->ncols)
                return dtr__errf(c->err, c->errlen, DTR_INVALID_ARGUMENT, "%s: label_column %d is outside the %d columns",
                                 c->name, cfg->label_column, P->ncols);
        }
        P->role[label] = 1;
    }
    if (cfg->ignore && cfg->ignore[0]) {
        const char *s = cfg->ignore;
        if (!has_header)
            return dtr__errf(c->err, c->errlen, DTR_NOT_FOUND, "%s: ignore \"%s\" given but the file has no header", c->name,
                             cfg->ignore);
        while (*s) {
            const char *e = strchr(s, ',');
            size_t n = e ? (size_t)(e - s) : strlen(s);
            int found = 0;
            for (j = 0; j < P->ncols; j++) {
                if (strlen(P->names[j]) == n && memcmp(P->names[j], s, n) == 0) {
                    if (P->role[j] == 0) P->role[j] = 2;
                    found = 1;
                }
            }
            if (!found && n)
                return dtr__errf(c->err, c->errlen, DTR_NOT_FOUND, "%s: ignored column \"%.*s\" is not in the header",
                                 c->name, (int)n, s);
            s += n;
            if (*s == ',') s++;
        }
    }
    return DTR_OK;
}

/* Parses every data record into P (features as f32, labels kept for later). */
static dtr_result dtr__csv_rows(dtr__csv *c, const dtr_csv_config *cfg, dtr__csv_parse *P, int first_is_data,
                                int64_t nfeat) {
    int rc, j;
    for (;;) {
        int64_t k;
        if (first_is_data) {
            first_is_data = 0;   /* the record already in c->f */
        } else {
            rc = dtr__csv_record(c);
            if (rc < 0) return (dtr_result)rc;
            if (rc == 0) break;
        }
        if (c->nf != P->ncols)
            return dtr__errf(c->err, c->errlen, DTR_CORRUPT_FILE, "%s:%lld: %d fields, expected %d", c->name,
                             (long long)c->rec_line, c->nf, P->ncols);
        if (P->rows == P->xcap) {
            int64_t cap = P->xcap ? P->xcap * 2 : 256;
            float *nx;
            dtr__csv_label *nl;
            if ((uint64_t)cap > (uint64_t)((size_t)-1 / 8) / (uint64_t)(nfeat + 8))
                return dtr__errf(c->err, c->errlen, DTR_OUT_OF_MEMORY, "%s: too many records", c->name);
            nx = (float *)dtr__realloc(c->alloc, P->x, (size_t)(cap * (nfeat ? nfeat : 1)) * sizeof(float));
            if (!nx) return dtr__errf(c->err, c->errlen, DTR_OUT_OF_MEMORY, "%s: out of memory after %lld records", c->name,
                                      (long long)P->rows);
            P->x = nx;
            nl = (dtr__csv_label *)dtr__realloc(c->alloc, P->lab, (size_t)cap * sizeof *nl);
            if (!nl) return dtr__errf(c->err, c->errlen, DTR_OUT_OF_MEMORY, "%s: out of memory after %lld records", c->name,
                                      (long long)P->rows);
            P->lab = nl;
            P->xcap = cap;
        }
        k = 0;
        for (j = 0; j < P->ncols; j++) {
            const dtr__csv_field *f = &c->f[j];
            double v = 0.0;
            int num;
            if (P->role[j] == 2) continue;
            if (dtr__csv_missing(f))
                return dtr__errf(c->err, c->errlen, DTR_CORRUPT_FILE, "%s:%lld:%d: missing value (column \"%s\")", c->name,
                                 (long long)c->rec_line, j + 1, P->names[j]);
            num = dtr__parse_number(f->p, f->n, &v);
            if (P->role[j] == 1) {
                dtr__csv_label *L = &P->lab[P->rows];
                if (!num && cfg->label_kind == DTR_LABEL_REGRESSION)
                    return dtr__errf(c->err, c->errlen, DTR_CORRUPT_FILE, "%s:%lld:%d: \"%.*s\" is not a number (label column \"%s\")",
                                     c->name, (long long)c->rec_line, j + 1, (int)(f->n > 40 ? 40 : f->n), f->p, P->names[j]);
                L->v = v;
                L->numeric = num;
                L->f = *f;
                L->line = c->rec_line;
                continue;
            }
            if (!num)
                return dtr__errf(c->err, c->errlen, DTR_CORRUPT_FILE, "%s:%lld:%d: \"%.*s\" is not a number (column \"%s\")",
                                 c->name, (long long)c->rec_line, j + 1, (int)(f->n > 40 ? 40 : f->n), f->p, P->names[j]);
            P->x[P->rows * nfeat + k++] = (float)v;
        }
        P->rows++;
    }
    return DTR_OK;
}

/* Turns the collected labels into an i32 or f32 array (and class names for text classes). */
static dtr_result dtr__csv_labels(dtr__csv *c, const dtr_csv_config *cfg, dtr__csv_parse *P, int label_col,
                                  void **y_out, char ***names_out, int *nclasses) {
    int64_t i, text = 0;
    *y_out = NULL;
    *names_out = NULL;
    *nclasses = 0;
    if (cfg->label_kind == DTR_LABEL_NONE) return DTR_OK;
    if (cfg->label_kind == DTR_LABEL_REGRESSION) {
        float *y = (float *)dtr__malloc(c->alloc, (size_t)P->rows * sizeof(float));
        if (!y) return dtr__errf(c->err, c->errlen, DTR_OUT_OF_MEMORY, "%s: out of memory", c->name);
        for (i = 0; i < P->rows; i++) y[i] = (float)P->lab[i].v;
        *y_out = y;
        return DTR_OK;
    }
    for (i = 0; i < P->rows; i++) text += !P->lab[i].numeric;
    if (!text) {   /* integer class indices */
        int32_t *y = (int32_t *)dtr__malloc(c->alloc, (size_t)P->rows * sizeof(int32_t));
        int32_t mx = -1;
        if (!y) return dtr__errf(c->err, c->errlen, DTR_OUT_OF_MEMORY, "%s: out of memory", c->name);
        for (i = 0; i < P->rows; i++) {
            double v = P->lab[i].v;
            if (!(v >= 0.0 && v < 2147483647.0 && v == floor(v))) {
                dtr__free(c->alloc, y);
                return dtr__errf(c->err, c->errlen, DTR_CORRUPT_FILE,
                                 "%s:%lld:%d: class label \"%.*s\" is not an integer >= 0 (column \"%s\")", c->name,
                                 (long long)P->lab[i].line, label_col + 1, (int)(P->lab[i].f.n > 40 ? 40 : P->lab[i].f.n),
                                 P->lab[i].f.p, P->names[label_col]);
            }
            y[i] = (int32_t)v;
            if (y[i] > mx) mx = y[i];
        }
        *y_out = y;
        *nclasses = mx + 1;
        return DTR_OK;
    } else {   /* text classes: sorted unique names */
        size_t total = 0, *off;
        char *buf;
        int64_t *ord, *tmp, k = 0;
        int32_t *y;
        char **names = NULL;
        dtr_result r = DTR_OK;
        for (i = 0; i < P->rows; i++) total += P->lab[i].f.n + 1;
        buf = (char *)dtr__malloc(c->alloc, total + 1);
        off = (size_t *)dtr__malloc(c->alloc, (size_t)P->rows * sizeof(size_t));
        ord = (int64_t *)dtr__malloc(c->alloc, (size_t)P->rows * sizeof(int64_t));
        tmp = (int64_t *)dtr__malloc(c->alloc, (size_t)P->rows * sizeof(int64_t));
        y = (int32_t *)dtr__malloc(c->alloc, (size_t)P->rows * sizeof(int32_t));
        if (!buf || !off || !ord || !tmp || !y) {
            r = dtr__errf(c->err, c->errlen, DTR_OUT_OF_MEMORY, "%s: out of memory", c->name);
            goto done;
        }
        total = 0;
        for (i = 0; i < P->rows; i++) {
            const dtr__csv_field *f = &P->lab[i].f;
            size_t j;
            off[i] = total;
            for (j = 0; j < f->n; j++) {
                buf[total++] = f->p[j];
                if (f->escaped && f->p[j] == '"' && j + 1 < f->n && f->p[j + 1] == '"') j++;
            }
            buf[total++] = '\0';
            ord[i] = i;
        }
        dtr__sort_by_text(ord, tmp, P->rows, buf, off);
        for (i = 0; i < P->rows; i++) {   /* class of each row, counting distinct names */
            if (i > 0 && strcmp(buf + off[ord[i - 1]], buf + off[ord[i]]) != 0) k++;
            y[ord[i]] = (int32_t)k;
            if (k >= (1 << 24)) {
                r = dtr__errf(c->err, c->errlen, DTR_CORRUPT_FILE, "%s: more than %d distinct class names", c->name, 1 << 24);
                goto done;
            }
        }
        k = P->rows ? k + 1 : 0;
        names = (char **)dtr__calloc(c->alloc, (size_t)(k ? k : 1) * sizeof(char *));
        if (!names) {
            r = dtr__errf(c->err, c->errlen, DTR_OUT_OF_MEMORY, "%s: out of memory", c->name);
            goto done;
        }
        for (i = 0; i < P->rows; i++) {
            int32_t cls = y[ord[i]];
            if (!names[cls] && !(names[cls] = dtr__strdup(c->alloc, buf + off[ord[i]]))) {
                r = dtr__errf(c->err, c->errlen, DTR_OUT_OF_MEMORY, "%s: out of memory", c->name);
                goto done;
            }
        }
    done:
        dtr__free(c->alloc, buf);
        dtr__free(c->alloc, off);
        dtr__free(c->alloc, ord);
        dtr__free(c->alloc, tmp);
        if (r != DTR_OK) {
            if (names)
                for (i = 0; i < k; i++) dtr__free(c->alloc, names[i]);
            dtr__free(c->alloc, names);
            dtr__free(c->alloc, y);
            return r;
        }
        *y_out = y;
        *names_out = names;
        *nclasses = (int)k;
        return DTR_OK;
    }
}

dtr_result dtr_dataset_csv_from_buffer(const void *bytes, size_t size, const dtr_csv_config *cfg, dtr_dataset **out,
                                       char *err, size_t errlen) {
    dtr__csv c;
    dtr__csv_parse P;
    dtr_sample_layout L;
    dtr_dataset *ds = NULL;
    void *y = NULL;
    char **class_names = NULL;
    int nclasses = 0, has_header, label_col = -1, j, rc;
    int64_t nfeat = 0;
    dtr_result r;
    if (err && errlen) err[0] = '\0';
    if (!out) return dtr__errf(err, errlen, DTR_NULL_HANDLE, "dtr_dataset_csv_from_buffer: out is NULL");
    *out = NULL;
    if (!cfg || (!bytes && size)) return dtr__errf(err, errlen, DTR_NULL_HANDLE, "dtr_dataset_csv_from_buffer: NULL argument");
    if ((int)cfg->label_kind < 0 || (int)cfg->label_kind > 2)
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "CSV: label_kind %d is not a dtr_label_kind", (int)cfg->label_kind);
    memset(&c, 0, sizeof c);
    memset(&P, 0, sizeof P);
    c.name = cfg->path ? cfg->path : "CSV text";
    c.s = bytes ? (const char *)bytes : "";
    c.end = c.s + size;
    c.cur = c.s;
    c.line = 1;
    c.delim = cfg->delimiter ? cfg->delimiter : ',';
    c.alloc = &cfg->alloc;
    c.err = err;
    c.errlen = errlen;
    if (c.delim == '"' || c.delim == '\n' || c.delim == '\r' || c.delim == ' ')
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "%s: the delimiter cannot be a quote, space or line break", c.name);
    if (size >= 3 && memcmp(c.s, "\xEF\xBB\xBF", 3) == 0) c.cur += 3;
    rc = dtr__csv_record(&c);
    if (rc < 0) { r = (dtr_result)rc; goto fail; }
    if (rc == 0) {
        r = dtr__errf(err, errlen, DTR_CORRUPT_FILE, "%s: no records (empty file)", c.name);
        goto fail;
    }
    /* the header: given, or detected (no field of the first record is a number) */
    if (cfg->header > 0) {
        has_header = 1;
    } else if (cfg->header < 0) {
        has_header = 0;
    } else {
        double v;
        has_header = 1;
        for (j = 0; j < c.nf; j++)
            if (dtr__parse_number(c.f[j].p, c.f[j].n, &v)) has_header = 0;
    }
    P.ncols = c.nf;
    P.names = (char **)dtr__calloc(c.alloc, (size_t)P.ncols * sizeof(char *));
    if (!P.names) { r = dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "%s: out of memory", c.name); goto fail; }
    for (j = 0; j < P.ncols; j++) {
        char tmp[32];
        if (!has_header) snprintf(tmp, sizeof tmp, "%d", j + 1);
        P.names[j] = has_header ? dtr__csv_text(c.alloc, &c.f[j]) : dtr__strdup(c.alloc, tmp);
        if (!P.names[j]) { r = dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "%s: out of memory", c.name); goto fail; }
    }
    if ((r = dtr__csv_roles(&c, cfg, &P, has_header)) != DTR_OK) goto fail;
    for (j = 0; j < P.ncols; j++) {
        if (P.role[j] == 0) nfeat++;
        if (P.role[j] == 1) label_col = j;
    }
    if (nfeat == 0) {
        r = dtr__errf(err, errlen, DTR_CORRUPT_FILE, "%s: no feature columns (%d columns, all label or ignored)", c.name, P.ncols);
        goto fail;
    }
    if ((r = dtr__csv_rows(&c, cfg, &P, !has_header, nfeat)) != DTR_OK) goto fail;
    if (P.rows == 0) {
        r = dtr__errf(err, errlen, DTR_CORRUPT_FILE, "%s: no data records after the header", c.name);
        goto fail;
    }
    if ((r = dtr__csv_labels(&c, cfg, &P, label_col, &y, &class_names, &nclasses)) != DTR_OK) goto fail;
    memset(&L, 0, sizeof L);
    L.x_dtype = DTR_F32;
    L.x_ndim = 1;
    L.x_shape[0] = nfeat;
    L.unlabeled = cfg->label_kind == DTR_LABEL_NONE;
    L.y_dtype = cfg->label_kind == DTR_LABEL_REGRESSION ? DTR_F32 : DTR_I32;
    L.y_ndim = 0;
    L.num_classes = cfg->label_kind == DTR_LABEL_CLASS ? nclasses : 0;
    r = dtr__memory_dataset(c.alloc, P.rows, &L, P.x, y, c.name, &ds, err, errlen);
    P.x = NULL;   /* adopted (or freed) by the dataset */
    y = NULL;
    if (r != DTR_OK) goto fail;
    ds->class_names = class_names;
    ds->n_class_names = class_names ? nclasses : 0;
    class_names = NULL;
    dtr__csv_parse_free(c.alloc, &P);
    dtr__free(c.alloc, c.f);
    *out = ds;
    return DTR_OK;
fail:
    if (class_names) {
        for (j = 0; j < nclasses; j++) dtr__free(c.alloc, class_names[j]);
        dtr__free(c.alloc, class_names);
    }
    dtr__free(c.alloc, y);
    dtr__csv_parse_free(c.alloc, &P);
    dtr__free(c.alloc, c.f);
    return r;
}

dtr_result dtr_dataset_open_csv(const dtr_csv_config *cfg, dtr_dataset **out, char *err, size_t errlen) {
    unsigned char *buf = NULL;
    size_t size = 0;
    dtr_result r;
    if (err && errlen) err[0] = '\0';
    if (!out) return dtr__errf(err, errlen, DTR_NULL_HANDLE, "dtr_dataset_open_csv: out is NULL");
    *out = NULL;
    if (!cfg || !cfg->path) return dtr__errf(err, errlen, DTR_NULL_HANDLE, "dtr_dataset_open_csv: cfg or path is NULL");
    if ((r = dtr__read_file(cfg->path, &cfg->alloc, &buf, &size, err, errlen)) != DTR_OK) return r;
    r = dtr_dataset_csv_from_buffer(buf, size, cfg, out, err, errlen);
    dtr__free(&cfg->alloc, buf);
    return r;
}
#line 12838 "dtrain.h"

/* ---- src/data/image.c ---- */
#line 1 "src/data/image.c"
/* ============================================================================
 * Images: decoding (PNG, JPEG, BMP, GIF through stb_image), resampling, image-folder datasets.
 *
 * stb_image is compiled in only with DTR_USE_STB_IMAGE, so that dtrain.h alone still
 * builds with `cc app.c -lm -lpthread`. Then the implementation includes
 * DTR_STB_IMAGE_HEADER (default: <stb/stb_image.h> where it exists, as Debian's libstb-dev
 * installs it, else "stb_image.h") with STB_IMAGE_IMPLEMENTATION, STB_IMAGE_STATIC (every
 * stbi_ function static: no clash with an application's own copy), STBI_NO_STDIO (files are
 * read here) and only the PNG, JPEG, BMP and GIF decoders. With DTR_STB_IMAGE_EXTERNAL the
 * header is included for its declarations only and the application links its own
 * implementation. Without DTR_USE_STB_IMAGE every decoding call returns DTR_UNSUPPORTED
 * with a message that says how to turn it on; dtr_image_resize works either way.
 *
 * Samples are planar f32 (C, H, W) in [0, 1]: stb's interleaved 8-bit pixels (gray or RGB;
 * alpha dropped, gray from colour by stb's luma weights) divided by 255, then resized.
 * ==========================================================================*/




#include <errno.h>
#include <math.h>
#include <limits.h>
#if !defined(_MSC_VER)
#include <dirent.h>
#include <sys/stat.h>
#define DTR__HAVE_DIRENT 1
#else
#define DTR__HAVE_DIRENT 0
#endif

#ifndef DTR_IMAGE_MAX_PIXELS
#define DTR_IMAGE_MAX_PIXELS ((int64_t)1 << 26)
#endif

#ifdef DTR_USE_STB_IMAGE
#ifndef DTR_STB_IMAGE_HEADER
#if defined(__has_include)
#if __has_include(<stb/stb_image.h>)
#define DTR_STB_IMAGE_HEADER <stb/stb_image.h>
#else
#define DTR_STB_IMAGE_HEADER "stb_image.h"
#endif
#else
#define DTR_STB_IMAGE_HEADER <stb/stb_image.h>
#endif
#endif
#ifndef DTR_STB_IMAGE_EXTERNAL
#define STB_IMAGE_STATIC
#define STBI_NO_STDIO
#define STBI_ONLY_PNG
#define STBI_ONLY_JPEG
#define STBI_ONLY_BMP
#define STBI_ONLY_GIF   /* (stb 2.27 declares the GIF API even without its decoder) */
#define STB_IMAGE_IMPLEMENTATION
#ifndef STBI_ASSERT
#define STBI_ASSERT(x) ((void)0)   /* never abort(): stb's asserts are internal checks */
#endif
/* stb 2.27 declares stbi_set_unpremultiply_on_load_thread but defines it under another
 * name: with static functions GCC would warn that it is never defined. Naming both the
 * same keeps every version consistent. */
#define stbi_set_unpremultiply_on_load_thread stbi__unpremultiply_on_load_thread
#endif
#if defined(__GNUC__) || defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function"
#pragma GCC diagnostic ignored "-Wsign-compare"
#pragma GCC diagnostic ignored "-Wunused-parameter"
#pragma GCC diagnostic ignored "-Wunused-but-set-variable"
#pragma GCC diagnostic ignored "-Wimplicit-fallthrough"
#endif
#include DTR_STB_IMAGE_HEADER
#if defined(__GNUC__) || defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif /* DTR_USE_STB_IMAGE */

#define DTR__NO_STB_MSG \
    "image decoding is not compiled in: define DTR_USE_STB_IMAGE where the dtrain implementation is " \
    "compiled (Debian/Ubuntu: apt install libstb-dev; or put stb_image.h on the include path and " \
    "set DTR_STB_IMAGE_HEADER)"

/* ---- resampling ---- */

/* Filter taps of one axis: output o reads src[first[o] + k] * w[o * maxt + k], k < cnt[o]. */
typedef struct dtr__taps {
    int *first, *cnt;
    float *w;
    int maxt;
} dtr__taps;

static int dtr__taps_make(dtr__taps *t, int src, int dst, const dtr_allocation_callbacks *a) {
    double scale = (double)src / (double)dst;
    int o;
    t->maxt = src > dst ? (int)ceil(scale) + 2 : 2;
    t->first = (int *)dtr__malloc(a, (size_t)dst * sizeof(int));
    t->cnt = (int *)dtr__malloc(a, (size_t)dst * sizeof(int));
    t->w = (float *)dtr__malloc(a, (size_t)dst * (size_t)t->maxt * sizeof(float));
    if (!t->first || !t->cnt || !t->w) return 0;
    for (o = 0; o < dst; o++) {
        float *w = t->w + (size_t)o * (size_t)t->maxt;
        if (src == dst) {                    /* copy */
            t->first[o] = o;
            t->cnt[o] = 1;
            w[0] = 1.0f;
        } else if (src > dst) {              /* area: coverage of [o, o+1) * scale */
            double a0 = o * scale, a1 = (o + 1) * scale;
            int s0 = (int)floor(a0), s1 = (int)ceil(a1), s, k = 0;
            if (s1 > src) s1 = src;
            if (s1 - s0 > t->maxt) s1 = s0 + t->maxt;
            for (s = s0; s < s1; s++) {
                double lo = a0 > s ? a0 : (double)s, hi = a1 < s + 1 ? a1 : (double)(s + 1);
                w[k++] = (float)((hi - lo) / scale);
            }
            t->first[o] = s0;
            t->cnt[o] = k;
        } else {                             /* bilinear, pixel centres aligned */
            double f = (o + 0.5) * scale - 0.5, fr;
            int s0;
            if (f < 0) f = 0;
            s0 = (int)floor(f);
            if (s0 >= src - 1) {
                s0 = src - 1;
                fr = 0.0;
            } else {
                fr = f - s0;
            }
            t->first[o] = s0;
            w[0] = (float)(1.0 - fr);
            t->cnt[o] = 1;
            if (fr > 0.0) {
                w[1] = (float)fr;
                t->cnt[o] = 2;
            }
        }
    }
    return 1;
}

static void dtr__taps_free(dtr__taps *t, const dtr_allocation_callbacks *a) {
    dtr__free(a, t->first);
    dtr__free(a, t->cnt);
    dtr__free(a, t->w);
}

dtr_result dtr_image_resize(const float *src, int channels, int src_h, int src_w, float *dst, int dst_h, int dst_w,
                            const dtr_allocation_callbacks *alloc) {
    dtr__taps th, tv;
    float *tmp = NULL;
    dtr_result r = DTR_OK;
    int c, y, x, k;
    if (!src || !dst) return DTR_NULL_HANDLE;
    if (channels < 1 || src_h < 1 || src_w < 1 || dst_h < 1 || dst_w < 1) return DTR_INVALID_ARGUMENT;
    if (src_h == dst_h && src_w == dst_w) {
        memcpy(dst, src, (size_t)channels * (size_t)src_h * (size_t)src_w * sizeof(float));
        return DTR_OK;
    }
    memset(&th, 0, sizeof th);
    memset(&tv, 0, sizeof tv);
    tmp = (float *)dtr__malloc(alloc, (size_t)channels * (size_t)src_h * (size_t)dst_w * sizeof(float));
    if (!tmp || !dtr__taps_make(&th, src_w, dst_w, alloc) || !dtr__taps_make(&tv, src_h, dst_h, alloc)) {
        r = DTR_OUT_OF_MEMORY;
        goto done;
    }
    /* rows: (C, src_h, src_w) -> (C, src_h, dst_w) */
    for (c = 0; c < channels; c++) {
        for (y = 0; y < src_h; y++) {
            const float *s = src + ((size_t)c * src_h + y) * (size_t)src_w;
            float *d = tmp + ((size_t)c * src_h + y) * (size_t)dst_w;
            for (x = 0; x < dst_w; x++) {
                const float *w = th.w + (size_t)x * (size_t)th.maxt, *sp = s + th.first[x];
                float acc = 0.0f;
                for (k = 0; k < th.cnt[x]; k++) acc += w[k] * sp[k];
                d[x] = acc;
            }
        }
    }
    /* columns: (C, src_h, dst_w) -> (C, dst_h, dst_w) */
    for (c = 0; c < channels; c++) {
        for (y = 0; y < dst_h; y++) {
            const float *w = tv.w + (size_t)y * (size_t)tv.maxt;
            float *d = dst + ((size_t)c * dst_h + y) * (size_t)dst_w;
            const float *s0 = tmp + ((size_t)c * src_h + tv.first[y]) * (size_t)dst_w;
            for (x = 0; x < dst_w; x++) d[x] = w[0] * s0[x];
            for (k = 1; k < tv.cnt[y]; k++) {
                const float *sk = s0 + (size_t)k * (size_t)dst_w;
                for (x = 0; x < dst_w; x++) d[x] += w[k] * sk[x];
            }
        }
    }
done:
    dtr__taps_free(&th, alloc);
    dtr__taps_free(&tv, alloc);
    dtr__free(alloc, tmp);
    return r;
}

/* ---- decoding ---- */

#ifdef DTR_USE_STB_IMAGE
static const char *dtr__stbi_reason(void) {
    const char *s = stbi_failure_reason();
    return s ? s : "unknown reason";
}

/* stb_image before 2.28 writes past its Huffman tables when a JPEG's DHT segment declares
 * more than 256 codes (CVE-2021-37789; fuzzing found it here). This walks the markers the
 * way stb does (fill bytes, segments by length, entropy-coded data up to the next marker
 * that is not a stuffed 00 or a restart) and checks every Huffman table stb would read,
 * bytes past the end counting as 0 as they do in stb. Returns 0 for a table stb would
 * overflow on. Not a validator: everything else is left to the decoder. */
static int dtr__jpeg_tables_ok(const unsigned char *b, size_t n) {
    size_t p = 1;
    if (n < 2 || b[0] != 0xFF) return 1;                    /* not a JPEG */
    while (p < n && b[p] == 0xFF) p++;                       /* stb takes FF FF .. D8 as SOI */
    if (p >= n || b[p] != 0xD8) return 1;
    p++;
    while (p < n) {
        unsigned m;
        size_t len;
        if (b[p] != 0xFF) { p++; continue; }                 /* stb skips junk between segments */
        while (p < n && b[p] == 0xFF) p++;                   /* fill bytes */
        if (p >= n) break;
        m = b[p++];
        if (m == 0xD9) break;                                /* EOI */
        if (m == 0x00 || m == 0x01 || (m >= 0xD0 && m <= 0xD8)) continue;   /* no length */
        if (p + 2 > n) break;
        len = ((size_t)b[p] << 8) | b[p + 1];
        if (m == 0xC4) {                                     /* DHT: tables while L > 0 */
            long L = (long)len - 2;
            size_t q = p + 2;
            while (L > 0) {
                unsigned sum = 0, i;
                if (q < n && ((b[q] >> 4) > 1 || (b[q] & 15) > 3)) break;   /* stb refuses the header */
                for (i = 0; i < 16; i++) sum += q + 1 + i < n ? b[q + 1 + i] : 0;
                if (sum > 256) return 0;
                q += 17 + sum;
                L -= 17 + (long)sum;
                if (q > n + 17 + 256) break;                /* all zeros from here on */
            }
        }
        p += len;
        if (m == 0xDA) {                                     /* SOS: skip the entropy-coded data */
            while (p + 1 < n) {
                if (b[p] == 0xFF) {
                    size_t q = p + 1;
                    while (q < n && b[q] == 0xFF) q++;
                    if (q < n && b[q] != 0x00 && !(b[q] >= 0xD0 && b[q] <= 0xD7)) break;   /* a marker */
                    p = q + 1;
                } else {
                    p++;
                }
            }
        }
    }
    return 1;
}
#endif

dtr_result dtr_image_info(const void *bytes, size_t size, int *width, int *height, int *channels, char *err,
                          size_t errlen) {
    if (err && errlen) err[0] = '\0';
    if (!bytes || !width || !height || !channels) return dtr__errf(err, errlen, DTR_NULL_HANDLE, "dtr_image_info: NULL argument");
#ifdef DTR_USE_STB_IMAGE
    if (size > (size_t)INT_MAX) return dtr__errf(err, errlen, DTR_CORRUPT_FILE, "image: larger than 2 GiB");
    if (!dtr__jpeg_tables_ok((const unsigned char *)bytes, size))
        return dtr__errf(err, errlen, DTR_CORRUPT_FILE, "image: corrupt JPEG (a Huffman table with more than 256 codes)");
    if (!stbi_info_from_memory((const unsigned char *)bytes, (int)size, width, height, channels))
        return dtr__errf(err, errlen, DTR_CORRUPT_FILE, "image: not a PNG, JPEG, BMP or GIF image, or a damaged one (%s)",
                         dtr__stbi_reason());
    return DTR_OK;
#else
    (void)size;
    *width = *height = *channels = 0;
    return dtr__errf(err, errlen, DTR_UNSUPPORTED, "image: %s", DTR__NO_STB_MSG);
#endif
}

/* Decodes and resizes; messages start with `name`. */
static dtr_result dtr__image_decode(const char *name, const unsigned char *bytes, size_t size, int channels, int W, int H,
                                    float *out, const dtr_allocation_callbacks *alloc, char *err, size_t errlen) {
#ifdef DTR_USE_STB_IMAGE
    int w = 0, h = 0, c = 0, ch;
    float lut[256];
    unsigned char *px;
    float *planar;
    dtr_result r = DTR_OK;
    if (size > (size_t)INT_MAX) return dtr__errf(err, errlen, DTR_CORRUPT_FILE, "%s: larger than 2 GiB", name);
    if (!dtr__jpeg_tables_ok(bytes, size))
        return dtr__errf(err, errlen, DTR_CORRUPT_FILE, "%s: corrupt JPEG (a Huffman table with more than 256 codes)", name);
    if (!stbi_info_from_memory(bytes, (int)size, &w, &h, &c))
        return dtr__errf(err, errlen, DTR_CORRUPT_FILE, "%s: cannot decode: not a PNG, JPEG, BMP or GIF image, or damaged (%s)",
                         name, dtr__stbi_reason());
    if (w < 1 || h < 1 || (int64_t)w * (int64_t)h > DTR_IMAGE_MAX_PIXELS)
        return dtr__errf(err, errlen, DTR_CORRUPT_FILE, "%s: %d x %d pixels: larger than DTR_IMAGE_MAX_PIXELS (%lld)", name,
                         w, h, (long long)DTR_IMAGE_MAX_PIXELS);
    px = stbi_load_from_memory(bytes, (int)size, &w, &h, &c, channels);
    if (!px) return dtr__errf(err, errlen, DTR_CORRUPT_FILE, "%s: cannot decode: %s", name, dtr__stbi_reason());
    if (w == W && h == H) {
        planar = out;
    } else {
        planar = (float *)dtr__malloc(alloc, (size_t)channels * (size_t)w * (size_t)h * sizeof(float));
        if (!planar) {
            stbi_image_free(px);
            return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "%s: out of memory for %d x %d pixels", name, w, h);
        }
    }
    for (ch = 0; ch < 256; ch++) lut[ch] = (float)ch / 255.0f;
    for (ch = 0; ch < channels; ch++) {   /* interleaved u8 -> planar f32 */
        float *d = planar + (size_t)ch * (size_t)w * (size_t)h;
        const unsigned char *s = px + ch;
        size_t n = (size_t)w * (size_t)h, i;
        for (i = 0; i < n; i++) d[i] = lut[s[i * (size_t)channels]];
    }
    stbi_image_free(px);
    if (planar != out) {
        r = dtr_image_resize(planar, channels, h, w, out, H, W, alloc);
        dtr__free(alloc, planar);
        if (r != DTR_OK) return dtr__errf(err, errlen, r, "%s: resizing %d x %d to %d x %d failed (%s)", name, w, h, W, H,
                                          dtr_result_string(r));
    }
    return DTR_OK;
#else
    (void)bytes; (void)size; (void)channels; (void)W; (void)H; (void)out; (void)alloc;
    return dtr__errf(err, errlen, DTR_UNSUPPORTED, "%s: %s", name, DTR__NO_STB_MSG);
#endif
}

dtr_result dtr_image_decode(const void *bytes, size_t size, int channels, int width, int height, float *out,
                            const dtr_allocation_callbacks *alloc, char *err, size_t errlen) {
    if (err && errlen) err[0] = '\0';
    if (!bytes || !out) return dtr__errf(err, errlen, DTR_NULL_HANDLE, "dtr_image_decode: bytes or out is NULL");
    if ((channels != 1 && channels != 3) || width < 1 || height < 1 || (int64_t)width * height > DTR_IMAGE_MAX_PIXELS)
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "dtr_image_decode: need channels 1 or 3 and a size of 1 .. %lld pixels",
                         (long long)DTR_IMAGE_MAX_PIXELS);
    return dtr__image_decode("image", (const unsigned char *)bytes, size, channels, width, height, out, alloc, err, errlen);
}

/* ---- image folders ---- */

#if defined(DTR_USE_STB_IMAGE) && DTR__HAVE_DIRENT

typedef struct dtr__strlist {
    char *buf;          /* NUL-terminated strings back to back */
    size_t len, cap;
    size_t *off;
    int32_t *tag;       /* class of each path */
    int64_t n, ncap;
} dtr__strlist;

static int dtr__strlist_add(dtr__strlist *l, const dtr_allocation_callbacks *a, const char *s, int32_t tag) {
    size_t n = strlen(s) + 1;
    if (l->len + n > l->cap) {
        size_t cap = l->cap ? l->cap : 4096;
        char *nb;
        while (cap < l->len + n) cap *= 2;
        nb = (char *)dtr__realloc(a, l->buf, cap);
        if (!nb) return 0;
        l->buf = nb;
        l->cap = cap;
    }
    if (l->n == l->ncap) {
        int64_t cap = l->ncap ? l->ncap * 2 : 256;
        size_t *no = (size_t *)dtr__realloc(a, l->off, (size_t)cap * sizeof(size_t));
        int32_t *nt;
        if (!no) return 0;
        l->off = no;
        nt = (int32_t *)dtr__realloc(a, l->tag, (size_t)cap * sizeof(int32_t));
        if (!nt) return 0;
        l->tag = nt;
        l->ncap = cap;
    }
    memcpy(l->buf + l->len, s, n);
    l->off[l->n] = l->len;
    l->tag[l->n] = tag;
    l->len += n;
    l->n++;
    return 1;
}

static void dtr__strlist_free(dtr__strlist *l, const dtr_allocation_callbacks *a) {
    dtr__free(a, l->buf);
    dtr__free(a, l->off);
    dtr__free(a, l->tag);
    memset(l, 0, sizeof *l);
}

/* Sorts entries [from, n) by text (the tags follow their strings). */
static int dtr__strlist_sort(dtr__strlist *l, int64_t from, const dtr_allocation_callbacks *a) {
    int64_t n = l->n - from, i, *ord, *tmp;
    size_t *off2;
    if (n < 2) return 1;
    ord = (int64_t *)dtr__malloc(a, (size_t)n * sizeof(int64_t));
    tmp = (int64_t *)dtr__malloc(a, (size_t)n * sizeof(int64_t));
    off2 = (size_t *)dtr__malloc(a, (size_t)n * sizeof(size_t));
    if (!ord || !tmp || !off2) {
        dtr__free(a, ord);
        dtr__free(a, tmp);
        dtr__free(a, off2);
        return 0;
    }
    for (i = 0; i < n; i++) ord[i] = from + i;
    dtr__sort_by_text(ord, tmp, n, l->buf, l->off);
    for (i = 0; i < n; i++) off2[i] = l->off[ord[i]];
    memcpy(l->off + from, off2, (size_t)n * sizeof(size_t));   /* the tags of [from, n) are all equal */
    dtr__free(a, ord);
    dtr__free(a, tmp);
    dtr__free(a, off2);
    return 1;
}

static int dtr__image_ext(const char *name) {
    static const char *const ext[] = {".png", ".jpg", ".jpeg", ".bmp", ".gif"};
    size_t n = strlen(name), i, k;
    for (k = 0; k < sizeof ext / sizeof ext[0]; k++) {
        size_t m = strlen(ext[k]);
        int ok = n > m;
        for (i = 0; ok && i < m; i++) {
            char ch = name[n - m + i];
            if (ch >= 'A' && ch <= 'Z') ch = (char)(ch - 'A' + 'a');
            ok = ch == ext[k][i];
        }
        if (ok) return 1;
    }
    return 0;
}

/* "a/b" into a new heap string. */
static char *dtr__path_join(const dtr_allocation_callbacks *a, const char *dir, const char *name) {
    size_t dl = strlen(dir), nl = strlen(name);
    int sep = dl > 0 && dir[dl - 1] != '/';
    char *p = (char *)dtr__malloc(a, dl + nl + 2);
    if (!p) return NULL;
    memcpy(p, dir, dl);
    if (sep) p[dl] = '/';
    memcpy(p + dl + sep, name, nl + 1);
    return p;
}

/* 1 directory, 2 regular file, 0 other or missing. */
static int dtr__path_kind(const char *path) {
    struct stat st;
    if (stat(path, &st) != 0) return 0;
    if (S_ISDIR(st.st_mode)) return 1;
    if (S_ISREG(st.st_mode)) return 2;
    return 0;
}

/* Adds the images under `dir` (recursively, depth-limited) with class `cls`. */
static dtr_result dtr__scan_images(const char *dir, int32_t cls, int depth, dtr__strlist *files,
                                   const dtr_allocation_callbacks *a, char *err, size_t errlen) {
    DIR *d;
    struct dirent *e;
    dtr_result r = DTR_OK;
    if (depth > 16) return DTR_OK;
    errno = 0;
    d = opendir(dir);
    if (!d) return dtr__errf(err, errlen, DTR_IO_ERROR, "%s: cannot open folder: %s", dir, strerror(errno));
    while ((e = readdir(d)) != NULL) {
        char *p;
        int kind;
        if (e->d_name[0] == '.') continue;   /* ., .., hidden files */
        p = dtr__path_join(a, dir, e->d_name);
        if (!p) { r = dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "%s: out of memory", dir); break; }
        kind = dtr__path_kind(p);
        if (kind == 1) r = dtr__scan_images(p, cls, depth + 1, files, a, err, errlen);
        else if (kind == 2 && dtr__image_ext(e->d_name) && !dtr__strlist_add(files, a, p, cls))
            r = dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "%s: out of memory", dir);
        dtr__free(a, p);
        if (r != DTR_OK) break;
    }
    closedir(d);
    return r;
}

typedef struct dtr__folder_ds {
    dtr__strlist files;
    int w, h, ch;
} dtr__folder_ds;

static dtr_result dtr__folder_get(dtr_dataset *ds, int64_t index, void *x, void *y, char *err, size_t errlen) {
    const dtr__folder_ds *f = (const dtr__folder_ds *)ds->impl;
    const char *path = f->files.buf + f->files.off[index];
    unsigned char *buf = NULL;
    size_t size = 0;
    dtr_result r = dtr__read_file(path, &ds->alloc, &buf, &size, err, errlen);
    if (r != DTR_OK) return r;
    r = dtr__image_decode(path, buf, size, f->ch, f->w, f->h, (float *)x, &ds->alloc, err, errlen);
    dtr__free(&ds->alloc, buf);
    if (y) *(int32_t *)y = f->files.tag[index];
    return r;
}

static void dtr__folder_close(dtr_dataset *ds) {
    dtr__folder_ds *f = (dtr__folder_ds *)ds->impl;
    dtr__strlist_free(&f->files, &ds->alloc);
    dtr__free(&ds->alloc, f);
}

/* Lists the class folders and their images (see dtr_dataset_open_image_folder). */
static dtr_result dtr__open_folder(const dtr_image_folder_config *cfg, int ch, dtr_dataset **out, char *err,
                                   size_t errlen) {
    const dtr_allocation_callbacks *a = &cfg->alloc;
    dtr__strlist classes;
    dtr__folder_ds *f = NULL;
    dtr_sample_layout L;
    dtr_dataset *ds = NULL;
    DIR *d;
    struct dirent *e;
    dtr_result r = DTR_OK;
    int64_t k;
    memset(&classes, 0, sizeof classes);
    errno = 0;
    d = opendir(cfg->root);
    if (!d) return dtr__errf(err, errlen, DTR_IO_ERROR, "%s: cannot open folder: %s", cfg->root, strerror(errno));
    while ((e = readdir(d)) != NULL) {   /* class folders */
        char *p;
        if (e->d_name[0] == '.') continue;
        p = dtr__path_join(a, cfg->root, e->d_name);
        if (!p || (dtr__path_kind(p) == 1 && !dtr__strlist_add(&classes, a, e->d_name, 0))) r = DTR_OUT_OF_MEMORY;
        dtr__free(a, p);
        if (r != DTR_OK) break;
    }
    closedir(d);
    if (r == DTR_OK && !dtr__strlist_sort(&classes, 0, a)) r = DTR_OUT_OF_MEMORY;
    if (r != DTR_OK) {
        dtr__strlist_free(&classes, a);
        return dtr__errf(err, errlen, r, "%s: out of memory", cfg->root);
    }
    if (classes.n == 0) {
        dtr__strlist_free(&classes, a);
        return dtr__errf(err, errlen, DTR_NOT_FOUND, "%s: no class folders (expected root/<class>/<image>)", cfg->root);
    }
    if (classes.n > INT32_MAX / 2) {
        dtr__strlist_free(&classes, a);
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "%s: too many class folders", cfg->root);
    }
    memset(&L, 0, sizeof L);
    L.x_dtype = DTR_F32;
    L.x_ndim = 3;
    L.x_shape[0] = ch;
    L.x_shape[1] = cfg->height;
    L.x_shape[2] = cfg->width;
    L.y_dtype = DTR_I32;
    L.y_ndim = 0;
    L.num_classes = (int)classes.n;
    if ((r = dtr__dataset_new(a, 0, &L, cfg->root, &ds, err, errlen)) != DTR_OK) {
        dtr__strlist_free(&classes, a);
        return r;
    }
    f = (dtr__folder_ds *)dtr__calloc(a, sizeof *f);
    if (!f) {
        r = dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "%s: out of memory", cfg->root);
        goto fail;
    }
    ds->impl = f;
    ds->get = dtr__folder_get;
    ds->close = dtr__folder_close;
    ds->class_names = (char **)dtr__calloc(a, (size_t)classes.n * sizeof(char *));
    if (!ds->class_names) {
        r = dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "%s: out of memory", cfg->root);
        goto fail;
    }
    ds->n_class_names = (int)classes.n;
    f->w = cfg->width;
    f->h = cfg->height;
    f->ch = ch;
    for (k = 0; k < classes.n; k++) {
        const char *name = classes.buf + classes.off[k];
        char *dir;
        int64_t from = f->files.n;
        if (!(ds->class_names[k] = dtr__strdup(a, name)) || !(dir = dtr__path_join(a, cfg->root, name))) {
            r = dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "%s: out of memory", cfg->root);
            goto fail;
        }
        r = dtr__scan_images(dir, (int32_t)k, 0, &f->files, a, err, errlen);
        dtr__free(a, dir);
        if (r != DTR_OK) goto fail;
        if (!dtr__strlist_sort(&f->files, from, a)) {
            r = dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "%s: out of memory", cfg->root);
            goto fail;
        }
    }
    if (f->files.n == 0) {
        r = dtr__errf(err, errlen, DTR_NOT_FOUND, "%s: no images (.png, .jpg, .jpeg, .bmp, .gif) in its %lld class folders",
                      cfg->root, (long long)classes.n);
        goto fail;
    }
    ds->count = f->files.n;
    dtr__strlist_free(&classes, a);
    *out = ds;
    return DTR_OK;
fail:
    dtr__strlist_free(&classes, a);
    dtr_dataset_destroy(ds);
    return r;
}
#endif /* DTR_USE_STB_IMAGE && DTR__HAVE_DIRENT */

dtr_image_folder_config dtr_image_folder_config_init(void) {
    dtr_image_folder_config c;
    memset(&c, 0, sizeof c);
    c.channels = 3;
    return c;
}

dtr_result dtr_dataset_open_image_folder(const dtr_image_folder_config *cfg, dtr_dataset **out, char *err,
                                         size_t errlen) {
    int ch;
    if (err && errlen) err[0] = '\0';
    if (!out) return dtr__errf(err, errlen, DTR_NULL_HANDLE, "dtr_dataset_open_image_folder: out is NULL");
    *out = NULL;
    if (!cfg || !cfg->root) return dtr__errf(err, errlen, DTR_NULL_HANDLE, "dtr_dataset_open_image_folder: cfg or root is NULL");
    ch = cfg->channels ? cfg->channels : 3;
    if ((ch != 1 && ch != 3) || cfg->width < 1 || cfg->height < 1 ||
        (int64_t)cfg->width * cfg->height > DTR_IMAGE_MAX_PIXELS)
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "%s: need channels 1 or 3 and width, height >= 1 (got %d, %d x %d)",
                         cfg->root, ch, cfg->width, cfg->height);
#if !defined(DTR_USE_STB_IMAGE)
    return dtr__errf(err, errlen, DTR_UNSUPPORTED, "%s: %s", cfg->root, DTR__NO_STB_MSG);
#elif !DTR__HAVE_DIRENT
    return dtr__errf(err, errlen, DTR_UNSUPPORTED, "%s: listing folders needs <dirent.h> (not available with MSVC); "
                     "list the files yourself and use dtr_dataset_create with dtr_image_decode", cfg->root);
#else
    return dtr__open_folder(cfg, ch, out, err, errlen);
#endif
}
#line 13469 "dtrain.h"

/* ---- src/data/loader.c ---- */
#line 1 "src/data/loader.c"
/* ============================================================================
 * The loader: batches over any dataset, with per-epoch seeded shuffles, sharding by rank
 * (dtr_sampler), background prefetch threads, augmentation, a cache of decoded samples,
 * skipping of bad samples, and a cursor that a checkpoint can save and restore.
 *
 * Batches form one endless sequence: batch number s is batch (s % B) of epoch (s / B),
 * with B = dtr_loader_batches(). The contents of batch s depend only on s, the dataset and
 * the configuration: its indices come from dtr_sampler_epoch(epoch), and the random choices
 * of augmentation from a PCG32 stream seeded by (seed, epoch) and the sample's global
 * position in the epoch. So any number of threads, any timing and a restored cursor all
 * give the same batches.
 *
 * Prefetch: `depth` slots, batch s lives in slot s % depth. A worker claims the next
 * unclaimed batch when it is less than `depth` batches ahead of `head` (the batch the app
 * holds or waits for), fills the slot outside the lock, and marks it ready. The app's
 * dtr_loader_next releases the batch it held, then waits until slot head % depth holds
 * batch head. At most ceil(depth / B) + 1 epochs are in flight, so a ring of that many
 * per-epoch index lists suffices. Destroy sets `stop` (checked between samples) and joins.
 * ==========================================================================*/




#include <pthread.h>

#if defined(__GNUC__) || defined(__clang__)
#else
#define DTR__ATOMIC_LOAD(p) (*(volatile int *)(p))
#define DTR__ATOMIC_STORE(p, v) (*(volatile int *)(p) = (v))
#endif

/* Replacement attempts of skip_bad before giving up on a batch. */
#define DTR__SKIP_TRIES 64

typedef struct dtr__slot {
    int64_t seq;              /* batch number it holds */
    int ready;
    dtr_result result;
    char msg[512];
    void *x, *y;              /* batch_size samples */
    int64_t *indices;
    int64_t size;
    int64_t skipped, cache_hits;
    char last_bad[256];
} dtr__slot;

typedef struct dtr__worker {
    dtr_loader *l;
    pthread_t th;
    int started;
    float *tmp;               /* one decoded sample before crop/flip */
    char err[512];
} dtr__worker;

struct dtr_loader {
    dtr_dataset *ds;
    dtr_loader_cursor state_cursor;   /* dtr_loader_state's "cursor" entry */
    dtr_loader_config cfg;
    dtr_allocation_callbacks alloc;
    float *mean, *std;        /* normalisation (owned copies) */
    int crop, flip;
    int64_t C, H, W;          /* crop/flip geometry: leading dims, then H, W */
    dtr_sampler sampler;
    int64_t per_rank, batches, B;
    int64_t x_numel, y_numel;
    size_t x_bytes, y_bytes;
    uint64_t seed;
    /* per-epoch index lists: a ring of n_ep, enough for every epoch in flight */
    int n_ep;
    int64_t *ep_epoch;
    int64_t **ep_idx;
    int64_t *perm;
    /* prefetch queue */
    int depth, nthreads;
    dtr__slot *slots;
    dtr__worker *workers;     /* nthreads (or 1 for the synchronous path) */
    pthread_mutex_t mu;
    pthread_cond_t cv_work, cv_ready;
    int sync_ok;              /* mutex and conditions initialised */
    int64_t head, next_claim;
    int held, busy, stop, paused;
    /* cache of decoded samples 0 .. cache_cap-1 */
    unsigned char *cache;
    unsigned char *cache_state;   /* 0 empty, 1 being filled, 2 ready */
    int64_t cache_cap;
    size_t cache_stride;
    pthread_mutex_t cache_mu;
    int cache_mu_ok;
    dtr_loader_stats stats;
    char msg[512];
};

dtr_loader_config dtr_loader_config_init(void) {
    dtr_loader_config c;
    memset(&c, 0, sizeof c);
    c.batch_size = 32;
    c.world = 1;
    return c;
}

/* splitmix64 finaliser */
static uint64_t dtr__mix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

/* The index list of `epoch` (computed once per epoch, under the lock). NULL on OOM. */
static const int64_t *dtr__epoch_indices(dtr_loader *l, int64_t epoch) {
    int k = (int)(epoch % l->n_ep);
    const int64_t *p = NULL;
    pthread_mutex_lock(&l->mu);
    if (l->ep_epoch[k] != epoch) {
        if (dtr_sampler_epoch(&l->sampler, epoch, l->ep_idx[k], l->perm, &l->alloc) == DTR_OK) l->ep_epoch[k] = epoch;
        else l->ep_epoch[k] = -1;
    }
    if (l->ep_epoch[k] == epoch) p = l->ep_idx[k];
    pthread_mutex_unlock(&l->mu);
    return p;
}

/* ---- one sample ---- */

/* Cache entry states: 0 empty, 1 being filled by one thread, 2 ready (immutable). claim
 * returns the state it found and turns 0 into 1 for the caller; publish sets 2 (or back 0
 * after a failure). Atomics where the compiler has them, the cache mutex otherwise. */
static int dtr__cache_claim(dtr_loader *l, int64_t i) {
#if defined(__GNUC__) || defined(__clang__)
    unsigned char expect = 0;
    if (DTR__ATOMIC_CAS(&l->cache_state[i], &expect, (unsigned char)1))
        return 0;
    return expect;
#else
    int state;
    pthread_mutex_lock(&l->cache_mu);
    state = l->cache_state[i];
    if (state == 0) l->cache_state[i] = 1;
    pthread_mutex_unlock(&l->cache_mu);
    return state;
#endif
}

static void dtr__cache_publish(dtr_loader *l, int64_t i, int state) {
#if defined(__GNUC__) || defined(__clang__)
    DTR__ATOMIC_STORE(&l->cache_state[i], (unsigned char)state);
#else
    pthread_mutex_lock(&l->cache_mu);
    l->cache_state[i] = (unsigned char)state;
    pthread_mutex_unlock(&l->cache_mu);
#endif
}

/* Reads dataset sample i into x/y through the cache. *src receives the sample's features:
 * x, or (when `borrow` and the cache has it) the cache entry itself, saving a copy for a
 * caller that only reads them. Returns the dataset's result. */
static dtr_result dtr__load_sample(dtr_loader *l, dtr__worker *w, int64_t i, float *x, void *y, int borrow, int *hit,
                                   const float **src) {
    dtr_dataset *ds = l->ds;
    dtr_result r;
    int state = 0;
    *hit = 0;
    *src = x;
    if (i < l->cache_cap) {
        state = dtr__cache_claim(l, i);
        if (state == 2) {   /* ready entries never change again */
            const unsigned char *e = l->cache + (size_t)i * l->cache_stride;
            if (borrow) *src = (const float *)e;
            else memcpy(x, e, l->x_bytes);
            if (y) memcpy(y, e + l->x_bytes, l->y_bytes);
            *hit = 1;
            return DTR_OK;
        }
    }
    w->err[0] = '\0';
    r = ds->get(ds, i, x, ds->layout.unlabeled ? NULL : y, w->err, sizeof w->err);
    if (i < l->cache_cap && state == 0) {
        if (r == DTR_OK) {
            unsigned char *e = l->cache + (size_t)i * l->cache_stride;
            memcpy(e, x, l->x_bytes);
            if (y) memcpy(e + l->x_bytes, y, l->y_bytes);
        }
        dtr__cache_publish(l, i, r == DTR_OK ? 2 : 0);
    }
    if (r != DTR_OK && !w->err[0])
        snprintf(w->err, sizeof w->err, "%s: sample %lld: %s", ds->name, (long long)i, dtr_result_string(r));
    return r;
}

/* Random crop (with zero padding) and horizontal flip of src into dst (when enabled; src
 * may then be read-only), then normalisation of dst in place. Output pixel (y, x) of the
 * crop is input (y + oy - P, x + ox - P), zero outside the input; the flip mirrors the
 * cropped window: output x reads cropped column W - 1 - x. */
static void dtr__augment(const dtr_loader *l, const float *src, float *dst, dtr_rng *rng) {
    int64_t c, y, x, P = l->crop, H = l->H, W = l->W, n, k;
    if (l->crop || l->flip) {
        int64_t oy = P, ox = P, dx, x0, x1;
        int flip = 0;
        if (l->crop) {
            oy = (int64_t)(dtr_rng_u32(rng) % (uint32_t)(2 * P + 1));
            ox = (int64_t)(dtr_rng_u32(rng) % (uint32_t)(2 * P + 1));
        }
        if (l->flip) flip = (int)(dtr_rng_u32(rng) >> 31);
        dx = ox - P;   /* source column = (flip ? W - 1 - x : x) + dx */
        x0 = flip ? (dx > 0 ? dx : 0) : (-dx > 0 ? -dx : 0);            /* outputs with a source column */
        x1 = flip ? (W + dx < W ? W + dx : W) : (W - dx < W ? W - dx : W);
        if (x0 > W) x0 = W;   /* padding wider than the image: whole rows of zeros */
        if (x1 < x0) x1 = x0;
        for (c = 0; c < l->C; c++) {
            const float *s = src + c * H * W;
            float *d = dst + c * H * W;
            for (y = 0; y < H; y++) {
                int64_t sy = y + oy - P;
                float *drow = d + y * W;
                const float *srow;
                if (sy < 0 || sy >= H) {
                    memset(drow, 0, (size_t)W * sizeof(float));
                    continue;
                }
                srow = s + sy * W;
                for (x = 0; x < x0; x++) drow[x] = 0.0f;
                if (flip) {
                    for (x = x0; x < x1; x++) drow[x] = srow[W - 1 + dx - x];
                } else {
                    memcpy(drow + x0, srow + x0 + dx, (size_t)(x1 - x0) * sizeof(float));
                }
                for (x = x1; x < W; x++) drow[x] = 0.0f;
            }
        }
    }
    n = l->cfg.augment.norm_count;
    if (n > 0) {
        int64_t per = l->x_numel / n, j;   /* elements sharing one mean/std */
        for (j = 0; j < n; j++) {
            float m = l->mean[j], sd = l->std[j], *d = dst + j * per;
            for (k = 0; k < per; k++) d[k] = (d[k] - m) / sd;
        }
    }
}

/* ---- one batch ---- */

/* Fills `slot` with batch `seq` using worker w's scratch. */
static void dtr__fill(dtr_loader *l, dtr__worker *w, int64_t seq, dtr__slot *slot) {
    int64_t epoch = seq / l->batches, pos = seq % l->batches, start = pos * l->B, n, j;
    const int64_t *idx;
    uint64_t eseed = dtr__mix64(l->seed ^ dtr__mix64((uint64_t)epoch * 0xD1B54A32D192ED03ull + 1));
    int copy = l->crop || l->flip;
    slot->result = DTR_OK;
    slot->msg[0] = '\0';
    slot->skipped = 0;
    slot->cache_hits = 0;
    slot->last_bad[0] = '\0';
    n = l->per_rank - start < l->B ? l->per_rank - start : l->B;
    slot->size = n;
    idx = dtr__epoch_indices(l, epoch);
    if (!idx) {
        slot->result = DTR_OUT_OF_MEMORY;
        snprintf(slot->msg, sizeof slot->msg, "loader: out of memory for the indices of epoch %lld", (long long)epoch);
        return;
    }
    for (j = 0; j < n; j++) {
        int64_t k = start + j, i = idx[k], t;
        float *xd = (float *)((unsigned char *)slot->x + (size_t)j * l->x_bytes);
        void *yd = slot->y ? (unsigned char *)slot->y + (size_t)j * l->y_bytes : NULL;
        float *xs = copy ? w->tmp : xd;
        const float *src = xs;
        dtr_result r = DTR_OK;
        int hit = 0;
        if (DTR__ATOMIC_LOAD(&l->stop)) {
            slot->result = DTR_BAD_STATE;
            return;
        }
        for (t = 0; t < DTR__SKIP_TRIES; t++) {
            int64_t ii = (i + t) % l->ds->count;
            r = dtr__load_sample(l, w, ii, xs, yd, copy, &hit, &src);
            if (r == DTR_OK) {
                i = ii;
                break;
            }
            if (!l->cfg.skip_bad) {
                slot->result = r;
                snprintf(slot->msg, sizeof slot->msg, "batch %lld of epoch %lld: %.440s", (long long)pos, (long long)epoch,
                         w->err);
                return;
            }
            slot->skipped++;
            snprintf(slot->last_bad, sizeof slot->last_bad, "%.255s", w->err);
        }
        if (r != DTR_OK) {
            slot->result = r;
            snprintf(slot->msg, sizeof slot->msg, "batch %lld of epoch %lld: skip_bad: %d samples in a row from %lld failed; last: %.380s",
                     (long long)pos, (long long)epoch, DTR__SKIP_TRIES, (long long)idx[k], w->err);
            return;
        }
        slot->cache_hits += hit;
        slot->indices[j] = i;
        if (copy || l->cfg.augment.norm_count > 0) {
            dtr_rng rng;
            dtr_rng_seed(&rng, eseed, (uint64_t)(k * l->sampler.world + l->sampler.rank));
            dtr__augment(l, src, xd, &rng);
        }
    }
}

/* ---- threads ---- */

static void *dtr__loader_thread(void *arg) {
    dtr__worker *w = (dtr__worker *)arg;
    dtr_loader *l = w->l;
    pthread_mutex_lock(&l->mu);
    for (;;) {
        int64_t seq;
        dtr__slot *slot;
        if (l->stop) break;
        if (l->paused || l->next_claim >= l->head + l->depth) {
            pthread_cond_wait(&l->cv_work, &l->mu);
            continue;
        }
        seq = l->next_claim++;
        slot = &l->slots[seq % l->depth];
        l->busy++;
        pthread_mutex_unlock(&l->mu);
        dtr__fill(l, w, seq, slot);
        pthread_mutex_lock(&l->mu);
        l->busy--;
        slot->seq = seq;
        slot->ready = 1;
        pthread_cond_broadcast(&l->cv_ready);
    }
    pthread_mutex_unlock(&l->mu);
    return NULL;
}

/* Stops and joins the threads. */
static void dtr__loader_stop(dtr_loader *l) {
    int i;
    if (!l->sync_ok || !l->workers) return;
    pthread_mutex_lock(&l->mu);
    DTR__ATOMIC_STORE(&l->stop, 1);
    pthread_cond_broadcast(&l->cv_work);
    pthread_mutex_unlock(&l->mu);
    for (i = 0; i < l->nthreads; i++)
        if (l->workers[i].started) pthread_join(l->workers[i].th, NULL);
}

void dtr_loader_destroy(dtr_loader *l) {
    dtr_allocation_callbacks a;
    int i;
    if (!l) return;
    a = l->alloc;
    dtr__loader_stop(l);
    if (l->sync_ok) {
        pthread_mutex_destroy(&l->mu);
        pthread_cond_destroy(&l->cv_work);
        pthread_cond_destroy(&l->cv_ready);
    }
    if (l->cache_mu_ok) pthread_mutex_destroy(&l->cache_mu);
    if (l->slots) {
        for (i = 0; i < l->depth; i++) {
            dtr__free(&a, l->slots[i].x);
            dtr__free(&a, l->slots[i].y);
            dtr__free(&a, l->slots[i].indices);
        }
        dtr__free(&a, l->slots);
    }
    if (l->workers) {
        for (i = 0; i < (l->nthreads ? l->nthreads : 1); i++) dtr__free(&a, l->workers[i].tmp);
        dtr__free(&a, l->workers);
    }
    if (l->ep_idx) {
        for (i = 0; i < l->n_ep; i++) dtr__free(&a, l->ep_idx[i]);
        dtr__free(&a, l->ep_idx);
    }
    dtr__free(&a, l->ep_epoch);
    dtr__free(&a, l->perm);
    dtr__free(&a, l->cache);
    dtr__free(&a, l->cache_state);
    dtr__free(&a, l->mean);
    dtr__free(&a, l->std);
    dtr__free(&a, l);
}

/* ---- creation ---- */

/* Checks the augmentation against the samples and copies mean/std. */
static dtr_result dtr__loader_augment_init(dtr_loader *l, char *err, size_t errlen) {
    const dtr_augment_config *au = &l->cfg.augment;
    const dtr_sample_layout *L = &l->ds->layout;
    int64_t n = au->norm_count, k;
    int any = au->crop_padding != 0 || au->hflip != 0 || n != 0;
    if (!any) return DTR_OK;
    if (L->x_dtype != DTR_F32)
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "loader: augmentation needs f32 samples; %s has %s", l->ds->name,
                         dtr_dtype_name(L->x_dtype));
    if (au->crop_padding < 0 || n < 0)
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "loader: crop_padding and norm_count must be >= 0");
    if (au->crop_padding || au->hflip) {
        if (L->x_ndim < 2)
            return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "loader: crop and flip need samples of (..., H, W); %s has %d-D samples",
                             l->ds->name, L->x_ndim);
        l->H = L->x_shape[L->x_ndim - 2];
        l->W = L->x_shape[L->x_ndim - 1];
        l->C = l->x_numel / (l->H * l->W);
        l->crop = au->crop_padding;
        l->flip = au->hflip ? 1 : 0;
        if (l->crop > (1 << 20))
            return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "loader: crop_padding %d is too large", l->crop);
    }
    if (n) {
        if (n != 1 && n != L->x_shape[0] && n != l->x_numel)
            return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT,
                             "loader: norm_count %lld must be 1, the channels (%lld) or the sample's elements (%lld)",
                             (long long)n, (long long)L->x_shape[0], (long long)l->x_numel);
        if (!au->mean || !au->std) return dtr__errf(err, errlen, DTR_NULL_HANDLE, "loader: norm_count > 0 but mean or std is NULL");
        l->mean = (float *)dtr__malloc(&l->alloc, (size_t)n * sizeof(float));
        l->std = (float *)dtr__malloc(&l->alloc, (size_t)n * sizeof(float));
        if (!l->mean || !l->std) return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "loader: out of memory");
        for (k = 0; k < n; k++) {
            if (!(au->std[k] != 0.0f) || au->std[k] != au->std[k])
                return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "loader: std[%lld] is %g", (long long)k, (double)au->std[k]);
            l->mean[k] = au->mean[k];
            l->std[k] = au->std[k];
        }
    }
    l->cfg.augment.mean = l->mean;
    l->cfg.augment.std = l->std;
    return DTR_OK;
}

dtr_result dtr_loader_create(dtr_dataset *ds, const dtr_loader_config *cfg, dtr_loader **out, char *err, size_t errlen) {
    dtr_loader_config c = cfg ? *cfg : dtr_loader_config_init();
    const dtr_allocation_callbacks *a = &c.alloc;
    dtr_loader *l;
    dtr_result r;
    int i, nw;
    if (err && errlen) err[0] = '\0';
    if (!out) return dtr__errf(err, errlen, DTR_NULL_HANDLE, "dtr_loader_create: out is NULL");
    *out = NULL;
    if (!ds) return dtr__errf(err, errlen, DTR_NULL_HANDLE, "dtr_loader_create: dataset is NULL");
    if (c.batch_size == 0) c.batch_size = 32;
    if (c.world == 0) c.world = 1;
    if (c.batch_size < 0 || c.threads < 0 || c.threads > 256 || c.prefetch < 0)
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "loader: batch_size, threads (0..256) and prefetch must be >= 0");
    l = (dtr_loader *)dtr__calloc(a, sizeof *l);
    if (!l) return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "loader: out of memory");
    l->alloc = c.alloc;
    l->cfg = c;
    l->ds = ds;
    l->seed = c.seed;
    l->B = c.batch_size;
    l->x_numel = ds->x_numel;
    l->y_numel = ds->y_numel;
    l->x_bytes = (size_t)ds->x_numel * 4;
    l->y_bytes = (size_t)ds->y_numel * 4;
    l->nthreads = c.threads;
    a = &l->alloc;
    if ((r = dtr_sampler_init(&l->sampler, ds->count, c.rank, c.world, c.seed, c.shuffle, c.shard_drop_tail)) != DTR_OK) {
        r = dtr__errf(err, errlen, r, "loader: rank %d / world %d do not fit a dataset of %lld samples", c.rank, c.world,
                      (long long)ds->count);
        goto fail;
    }
    l->per_rank = dtr_sampler_count(&l->sampler);
    l->batches = c.drop_last ? l->per_rank / l->B : (l->per_rank + l->B - 1) / l->B;
    if (l->batches < 1) {
        r = dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "loader: %s: %lld samples per rank make no %sbatch of %lld",
                      ds->name, (long long)l->per_rank, c.drop_last ? "complete " : "", (long long)l->B);
        goto fail;
    }
    if ((r = dtr__loader_augment_init(l, err, errlen)) != DTR_OK) goto fail;
    /* queue depth, and the epochs that can be in flight at once: batches head .. head+depth-1 */
    l->depth = c.threads == 0 ? 1 : (c.prefetch ? c.prefetch : (2 * c.threads > 2 ? 2 * c.threads : 2));
    l->n_ep = (int)((l->depth + l->batches - 1) / l->batches) + 1;
    l->ep_epoch = (int64_t *)dtr__malloc(a, (size_t)l->n_ep * sizeof(int64_t));
    l->ep_idx = (int64_t **)dtr__calloc(a, (size_t)l->n_ep * sizeof(int64_t *));
    l->perm = (int64_t *)dtr__malloc(a, (size_t)ds->count * sizeof(int64_t));
    if (!l->ep_epoch || !l->ep_idx || !l->perm) {
        r = dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "loader: out of memory for %lld indices", (long long)ds->count);
        goto fail;
    }
    for (i = 0; i < l->n_ep; i++) {
        l->ep_epoch[i] = -1;
        l->ep_idx[i] = (int64_t *)dtr__malloc(a, (size_t)l->per_rank * sizeof(int64_t));
        if (!l->ep_idx[i]) {
            r = dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "loader: out of memory for %lld indices", (long long)ds->count);
            goto fail;
        }
    }
    /* the cache (only for datasets whose get() does real work) */
    if (c.cache_bytes > 0 && !ds->in_memory) {
        size_t stride = l->x_bytes + l->y_bytes;
        int64_t cap = (int64_t)(c.cache_bytes / stride);
        if (cap > ds->count) cap = ds->count;
        if (cap > 0) {
            l->cache = (unsigned char *)dtr__malloc(a, (size_t)cap * stride);
            l->cache_state = (unsigned char *)dtr__calloc(a, (size_t)cap);
            if (!l->cache || !l->cache_state) {
                r = dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "loader: out of memory for a cache of %lld samples", (long long)cap);
                goto fail;
            }
            l->cache_cap = cap;
            l->cache_stride = stride;
        }
    }
    if (pthread_mutex_init(&l->cache_mu, NULL) != 0) {
        r = dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "loader: cannot create a mutex");
        goto fail;
    }
    l->cache_mu_ok = 1;
    if (pthread_mutex_init(&l->mu, NULL) != 0 || pthread_cond_init(&l->cv_work, NULL) != 0 ||
        pthread_cond_init(&l->cv_ready, NULL) != 0) {
        r = dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "loader: cannot create a mutex or condition");
        goto fail;   /* (a partly created set is not destroyed: acceptable on this path) */
    }
    l->sync_ok = 1;
    /* slots and workers */
    l->slots = (dtr__slot *)dtr__calloc(a, (size_t)l->depth * sizeof(dtr__slot));
    nw = c.threads ? c.threads : 1;
    l->workers = (dtr__worker *)dtr__calloc(a, (size_t)nw * sizeof(dtr__worker));
    if (!l->slots || !l->workers) {
        r = dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "loader: out of memory");
        goto fail;
    }
    for (i = 0; i < l->depth; i++) {
        dtr__slot *s = &l->slots[i];
        s->seq = -1;
        s->x = dtr__malloc(a, (size_t)l->B * l->x_bytes);
        s->y = l->y_bytes ? dtr__malloc(a, (size_t)l->B * l->y_bytes) : NULL;
        s->indices = (int64_t *)dtr__malloc(a, (size_t)l->B * sizeof(int64_t));
        if (!s->x || (l->y_bytes && !s->y) || !s->indices) {
            r = dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "loader: out of memory for %d batches of %lld samples", l->depth,
                          (long long)l->B);
            goto fail;
        }
    }
    for (i = 0; i < nw; i++) {
        l->workers[i].l = l;
        if (l->crop || l->flip) {
            l->workers[i].tmp = (float *)dtr__malloc(a, l->x_bytes);
            if (!l->workers[i].tmp) {
                r = dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "loader: out of memory");
                goto fail;
            }
        }
    }
    for (i = 0; i < c.threads; i++) {
        if (pthread_create(&l->workers[i].th, NULL, dtr__loader_thread, &l->workers[i]) != 0) {
            r = dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "loader: cannot start prefetch thread %d of %d", i + 1, c.threads);
            goto fail;
        }
        l->workers[i].started = 1;
    }
    *out = l;
    return DTR_OK;
fail:
    dtr_loader_destroy(l);
    return r;
}

int64_t dtr_loader_batches(const dtr_loader *l) { return l ? l->batches : 0; }

const char *dtr_loader_last_error(const dtr_loader *l) { return l ? l->msg : ""; }

/* ---- handing out batches ---- */

dtr_result dtr_loader_next(dtr_loader *l, dtr_batch *out) {
    dtr__slot *slot;
    const dtr_sample_layout *L;
    double t0;
    int d;
    if (!l || !out) return DTR_NULL_HANDLE;
    memset(out, 0, sizeof *out);
    t0 = dtr__wall_seconds();
    if (l->nthreads == 0) {
        if (l->held) l->head++;
        slot = &l->slots[0];
        dtr__fill(l, &l->workers[0], l->head, slot);
        slot->seq = l->head;
        l->held = 1;
    } else {
        pthread_mutex_lock(&l->mu);
        if (l->held) {
            l->slots[l->head % l->depth].ready = 0;
            l->head++;
            l->held = 0;
            pthread_cond_broadcast(&l->cv_work);
        }
        slot = &l->slots[l->head % l->depth];
        while (!(slot->ready && slot->seq == l->head)) pthread_cond_wait(&l->cv_ready, &l->mu);
        l->held = 1;
        pthread_mutex_unlock(&l->mu);
    }
    {
        double dt = dtr__wall_seconds() - t0;
        if (dt > 0) l->stats.wait_s += dt;
    }
    out->epoch = slot->seq / l->batches;
    out->position = slot->seq % l->batches;
    out->last = out->position == l->batches - 1;
    l->stats.skipped += slot->skipped;
    l->stats.cache_hits += slot->cache_hits;
    if (slot->last_bad[0]) snprintf(l->stats.last_bad, sizeof l->stats.last_bad, "%s", slot->last_bad);
    if (slot->result != DTR_OK) {
        snprintf(l->msg, sizeof l->msg, "%s", slot->msg[0] ? slot->msg : dtr_result_string(slot->result));
        return slot->result;
    }
    L = &l->ds->layout;
    out->size = slot->size;
    out->x_dtype = L->x_dtype;
    out->x_shape[0] = slot->size;
    if (l->cfg.flatten) {
        out->x_ndim = 2;
        out->x_shape[1] = l->x_numel;
    } else {
        out->x_ndim = L->x_ndim + 1;
        for (d = 0; d < L->x_ndim; d++) out->x_shape[d + 1] = L->x_shape[d];
    }
    out->x = slot->x;
    if (!L->unlabeled) {
        out->y_dtype = L->y_dtype;
        out->y_ndim = L->y_ndim + 1;
        out->y_shape[0] = slot->size;
        for (d = 0; d < L->y_ndim; d++) out->y_shape[d + 1] = L->y_shape[d];
        out->y = slot->y;
    }
    out->indices = slot->indices;
    l->stats.batches++;
    l->stats.samples += slot->size;
    return DTR_OK;
}

void dtr_loader_get_stats(const dtr_loader *l, dtr_loader_stats *out) {
    if (!out) return;
    if (!l) {
        memset(out, 0, sizeof *out);
        return;
    }
    *out = l->stats;
}

/* ---- the cursor ---- */

void dtr_loader_get_cursor(const dtr_loader *l, dtr_loader_cursor *out) {
    int64_t seq;
    if (!out) return;
    memset(out, 0, sizeof *out);
    if (!l) return;
    seq = l->head + (l->held ? 1 : 0);
    out->magic = DTR_LOADER_CURSOR_MAGIC;
    out->version = 1;
    out->seed = l->seed;
    out->epoch = seq / l->batches;
    out->position = seq % l->batches;
    out->count = l->ds->count;
    out->batch_size = l->B;
    out->rank = l->sampler.rank;
    out->world = l->sampler.world;
    out->shuffle = l->sampler.shuffle;
}

dtr_result dtr_loader_set_cursor(dtr_loader *l, const dtr_loader_cursor *c) {
    int64_t seq;
    int i;
    if (!l || !c) return DTR_NULL_HANDLE;
    l->msg[0] = '\0';
    if (c->magic != DTR_LOADER_CURSOR_MAGIC || c->version != 1)
        return dtr__errf(l->msg, sizeof l->msg, DTR_INVALID_ARGUMENT, "loader cursor: bad magic or version (%08x, %u)",
                         (unsigned)c->magic, (unsigned)c->version);
    if (c->count != l->ds->count)
        return dtr__errf(l->msg, sizeof l->msg, DTR_INVALID_ARGUMENT,
                         "loader cursor: made for a dataset of %lld samples, this one has %lld", (long long)c->count,
                         (long long)l->ds->count);
    if (c->epoch < 0 || c->position < 0 || c->position >= l->batches)
        return dtr__errf(l->msg, sizeof l->msg, DTR_INVALID_ARGUMENT, "loader cursor: epoch %lld position %lld is outside 0..%lld",
                         (long long)c->epoch, (long long)c->position, (long long)l->batches - 1);
    if (c->position > 0 && (c->batch_size != l->B || c->world != l->sampler.world || (c->shuffle != 0) != (l->sampler.shuffle != 0)))
        return dtr__errf(l->msg, sizeof l->msg, DTR_INVALID_ARGUMENT,
                         "loader cursor: in the middle of an epoch the batch size (%lld, here %lld), world size (%d, here %d) "
                         "and shuffle (%d, here %d) must match", (long long)c->batch_size, (long long)l->B, (int)c->world,
                         l->sampler.world, (int)c->shuffle, l->sampler.shuffle != 0);
    if (c->epoch > (INT64_MAX - c->position) / l->batches - 1)
        return dtr__errf(l->msg, sizeof l->msg, DTR_INVALID_ARGUMENT, "loader cursor: epoch %lld is too large", (long long)c->epoch);
    seq = c->epoch * l->batches + c->position;
    if (l->nthreads > 0) {   /* pause the workers and wait for batches being filled */
        pthread_mutex_lock(&l->mu);
        l->paused = 1;
        while (l->busy > 0) pthread_cond_wait(&l->cv_ready, &l->mu);
    }
    l->seed = c->seed;
    l->sampler.seed = c->seed;
    for (i = 0; i < l->n_ep; i++) l->ep_epoch[i] = -1;
    for (i = 0; i < l->depth; i++) {
        l->slots[i].ready = 0;
        l->slots[i].seq = -1;
    }
    l->head = seq;
    l->next_claim = seq;
    l->held = 0;
    if (l->nthreads > 0) {
        l->paused = 0;
        pthread_cond_broadcast(&l->cv_work);
        pthread_mutex_unlock(&l->mu);
    }
    return DTR_OK;
}

/* ---- batches as tensors ---- */

dtr_result dtr_batch_tensors(dtr_context *ctx, const dtr_batch *b, dtr_tensor **x, dtr_tensor **y) {
    if (x) *x = NULL;
    if (y) *y = NULL;
    if (!ctx || !b || !x || !b->x) return DTR_NULL_HANDLE;
    *x = dtr_tensor_from(ctx, b->x_dtype, b->x_ndim, b->x_shape, b->x);
    if (!*x) return dtr_context_status(ctx);
    if (y && b->y) {
        *y = dtr_tensor_from(ctx, b->y_dtype, b->y_ndim, b->y_shape, b->y);
        if (!*y) return dtr_context_status(ctx);
    }
    return DTR_OK;
}

/* ---- state ---- */

dtr_result dtr_loader_state(dtr_loader *l, int index, dtr_state_entry *out) {
    if (!l || !out) return DTR_NULL_HANDLE;
    if (index != 0) return DTR_NOT_FOUND;
    dtr_loader_get_cursor(l, &l->state_cursor);
    return dtr__state_put(out, "cursor", &l->state_cursor, sizeof l->state_cursor, 0);
}

dtr_result dtr_loader_state_loaded(dtr_loader *l) {
    if (!l) return DTR_NULL_HANDLE;
    return dtr_loader_set_cursor(l, &l->state_cursor);
}
#line 14207 "dtrain.h"

/* ---- src/data/feed.c ---- */
#line 1 "src/data/feed.c"
/* ============================================================================
 * Streaming dataset: a bounded ring buffer of samples for online training inside an app.
 *
 * Producers (any number of threads: a game loop, a sensor callback) copy samples in with
 * dtr_feed_push; one trainer thread takes batches out with dtr_feed_next. One mutex
 * guards the ring; two condition variables wake a waiting producer (room) or trainer
 * (samples). Waits have deadlines from the caller (0: never block), measured on the wall
 * clock that pthread_cond_timedwait uses. All memory (the ring and one batch buffer) is
 * allocated at creation: pushing and popping allocate nothing.
 * ==========================================================================*/




#include <errno.h>
#include <pthread.h>
#include <sys/time.h>

struct dtr_feed {
    dtr_sample_layout layout;
    dtr_allocation_callbacks alloc;
    size_t x_bytes, y_bytes;
    int64_t x_numel, y_numel;
    int64_t cap, max_batch;
    int drop_oldest;
    unsigned char *rx, *ry;        /* the ring: cap samples */
    int64_t *rseq;                 /* push sequence number of each ring sample */
    int64_t head, size;            /* oldest sample, samples waiting */
    int64_t next_seq;
    unsigned char *bx, *by;        /* the batch handed out */
    int64_t *bseq;
    int64_t batches;
    int closed;
    dtr_feed_stats stats;
    pthread_mutex_t mu;
    pthread_cond_t room, data;
};

dtr_feed_config dtr_feed_config_init(void) {
    dtr_feed_config c;
    memset(&c, 0, sizeof c);
    c.capacity = 1024;
    c.max_batch = 256;
    return c;
}

dtr_result dtr_feed_create(const dtr_feed_config *cfg, dtr_feed **out, char *err, size_t errlen) {
    const dtr_allocation_callbacks *a;
    dtr_feed *s;
    dtr_result r;
    int64_t cap, mb;
    if (err && errlen) err[0] = '\0';
    if (!out) return dtr__errf(err, errlen, DTR_NULL_HANDLE, "dtr_feed_create: out is NULL");
    *out = NULL;
    if (!cfg) return dtr__errf(err, errlen, DTR_NULL_HANDLE, "dtr_feed_create: cfg is NULL");
    if ((r = dtr__layout_check(&cfg->layout, "stream", err, errlen)) != DTR_OK) return r;
    cap = cfg->capacity ? cfg->capacity : 1024;
    mb = cfg->max_batch ? cfg->max_batch : 256;
    if (cap < 1 || mb < 1 || cap > ((int64_t)1 << 40) || mb > ((int64_t)1 << 40))
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "stream: capacity and max_batch must be >= 1");
    if (mb > cap) mb = cap;
    a = &cfg->alloc;
    s = (dtr_feed *)dtr__calloc(a, sizeof *s);
    if (!s) return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "stream: out of memory");
    s->alloc = cfg->alloc;
    a = &s->alloc;
    s->layout = cfg->layout;
    s->x_numel = dtr_sample_layout_x_numel(&s->layout);
    s->y_numel = dtr_sample_layout_y_numel(&s->layout);
    s->x_bytes = (size_t)s->x_numel * 4;
    s->y_bytes = (size_t)s->y_numel * 4;
    s->cap = cap;
    s->max_batch = mb;
    s->drop_oldest = cfg->drop_oldest ? 1 : 0;
    if ((uint64_t)cap > (uint64_t)((size_t)-1 / 4) / (uint64_t)(s->x_bytes + s->y_bytes + 8)) {
        dtr__free(a, s);
        return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "stream: a ring of %lld samples does not fit in memory", (long long)cap);
    }
    s->rx = (unsigned char *)dtr__malloc(a, (size_t)cap * s->x_bytes);
    s->ry = s->y_bytes ? (unsigned char *)dtr__malloc(a, (size_t)cap * s->y_bytes) : NULL;
    s->rseq = (int64_t *)dtr__malloc(a, (size_t)cap * sizeof(int64_t));
    s->bx = (unsigned char *)dtr__malloc(a, (size_t)mb * s->x_bytes);
    s->by = s->y_bytes ? (unsigned char *)dtr__malloc(a, (size_t)mb * s->y_bytes) : NULL;
    s->bseq = (int64_t *)dtr__malloc(a, (size_t)mb * sizeof(int64_t));
    if (!s->rx || (s->y_bytes && (!s->ry || !s->by)) || !s->rseq || !s->bx || !s->bseq) {
        dtr__free(a, s->rx); dtr__free(a, s->ry); dtr__free(a, s->rseq);
        dtr__free(a, s->bx); dtr__free(a, s->by); dtr__free(a, s->bseq);
        dtr__free(a, s);
        return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "stream: out of memory for %lld samples", (long long)cap);
    }
    if (pthread_mutex_init(&s->mu, NULL) != 0 || pthread_cond_init(&s->room, NULL) != 0 ||
        pthread_cond_init(&s->data, NULL) != 0) {
        dtr__free(a, s->rx); dtr__free(a, s->ry); dtr__free(a, s->rseq);
        dtr__free(a, s->bx); dtr__free(a, s->by); dtr__free(a, s->bseq);
        dtr__free(a, s);
        return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "stream: cannot create a mutex or condition");
    }
    *out = s;
    return DTR_OK;
}

void dtr_feed_destroy(dtr_feed *s) {
    dtr_allocation_callbacks a;
    if (!s) return;
    a = s->alloc;
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->room);
    pthread_cond_destroy(&s->data);
    dtr__free(&a, s->rx);
    dtr__free(&a, s->ry);
    dtr__free(&a, s->rseq);
    dtr__free(&a, s->bx);
    dtr__free(&a, s->by);
    dtr__free(&a, s->bseq);
    dtr__free(&a, s);
}

/* Absolute wall-clock deadline `ms` from now, for pthread_cond_timedwait. */
static struct timespec dtr__deadline(int ms) {
    struct timeval tv;
    struct timespec ts;
    long usec;
    gettimeofday(&tv, NULL);
    usec = (long)tv.tv_usec + (long)(ms % 1000) * 1000L;
    ts.tv_sec = tv.tv_sec + ms / 1000 + usec / 1000000L;
    ts.tv_nsec = (usec % 1000000L) * 1000L;
    return ts;
}

/* Waits on `cv` (forever when ms < 0). Returns 0 when the deadline passed. */
static int dtr__stream_wait(dtr_feed *s, pthread_cond_t *cv, int ms, const struct timespec *deadline) {
    if (ms < 0) {
        pthread_cond_wait(cv, &s->mu);
        return 1;
    }
    return pthread_cond_timedwait(cv, &s->mu, deadline) != ETIMEDOUT;
}

dtr_result dtr_feed_push(dtr_feed *s, const void *x, const void *y, int64_t n, int timeout_ms, int64_t *pushed) {
    struct timespec deadline;
    dtr_result r = DTR_OK;
    int64_t done = 0;
    if (pushed) *pushed = 0;
    if (!s || (n > 0 && (!x || (s->y_bytes && !y)))) return DTR_NULL_HANDLE;
    if (n < 0) return DTR_INVALID_ARGUMENT;
    if (timeout_ms > 0) deadline = dtr__deadline(timeout_ms);
    else memset(&deadline, 0, sizeof deadline);
    pthread_mutex_lock(&s->mu);
    while (done < n) {
        int64_t room, k, i;
        if (s->closed) {
            r = DTR_BAD_STATE;
            break;
        }
        room = s->cap - s->size;
        if (room == 0) {
            if (s->drop_oldest) {
                k = n - done < s->cap ? n - done : s->cap;
                s->head = (s->head + k) % s->cap;
                s->size -= k;
                s->stats.dropped += k;
                continue;
            }
            if (timeout_ms == 0 || !dtr__stream_wait(s, &s->room, timeout_ms, &deadline)) {
                if (s->size == s->cap) {   /* still full when the time ran out */
                    r = DTR_TIMEOUT;
                    s->stats.timeouts++;
                    break;
                }
            }
            continue;
        }
        k = n - done < room ? n - done : room;
        for (i = 0; i < k; i++) {
            int64_t at = (s->head + s->size + i) % s->cap;
            memcpy(s->rx + (size_t)at * s->x_bytes, (const unsigned char *)x + (size_t)(done + i) * s->x_bytes, s->x_bytes);
            if (s->y_bytes)
                memcpy(s->ry + (size_t)at * s->y_bytes, (const unsigned char *)y + (size_t)(done + i) * s->y_bytes, s->y_bytes);
            s->rseq[at] = s->next_seq++;
        }
        s->size += k;
        done += k;
        s->stats.pushed += k;
        pthread_cond_signal(&s->data);
    }
    pthread_mutex_unlock(&s->mu);
    if (pushed) *pushed = done;
    return r;
}

dtr_result dtr_feed_next(dtr_feed *s, int64_t max_size, int64_t min_size, int timeout_ms, dtr_batch *out) {
    struct timespec deadline;
    int64_t k, i;
    int d;
    if (out) memset(out, 0, sizeof *out);
    if (!s || !out) return DTR_NULL_HANDLE;
    if (max_size < 1) return DTR_INVALID_ARGUMENT;
    if (max_size > s->max_batch) max_size = s->max_batch;
    if (min_size < 1) min_size = 1;
    if (min_size > max_size) min_size = max_size;
    if (timeout_ms > 0) deadline = dtr__deadline(timeout_ms);
    else memset(&deadline, 0, sizeof deadline);
    pthread_mutex_lock(&s->mu);
    while (s->size < min_size && !s->closed) {
        if (timeout_ms == 0 || !dtr__stream_wait(s, &s->data, timeout_ms, &deadline)) {
            if (s->size < min_size && !s->closed) {
                pthread_mutex_unlock(&s->mu);
                return DTR_TIMEOUT;
            }
        }
    }
    if (s->size == 0) {   /* closed and drained */
        pthread_mutex_unlock(&s->mu);
        return DTR_BAD_STATE;
    }
    k = s->size < max_size ? s->size : max_size;
    for (i = 0; i < k; i++) {
        int64_t at = (s->head + i) % s->cap;
        memcpy(s->bx + (size_t)i * s->x_bytes, s->rx + (size_t)at * s->x_bytes, s->x_bytes);
        if (s->y_bytes) memcpy(s->by + (size_t)i * s->y_bytes, s->ry + (size_t)at * s->y_bytes, s->y_bytes);
        s->bseq[i] = s->rseq[at];
    }
    s->head = (s->head + k) % s->cap;
    s->size -= k;
    s->stats.popped += k;
    pthread_cond_broadcast(&s->room);
    out->position = s->batches++;
    pthread_mutex_unlock(&s->mu);
    out->size = k;
    out->x_dtype = s->layout.x_dtype;
    out->x_ndim = s->layout.x_ndim + 1;
    out->x_shape[0] = k;
    for (d = 0; d < s->layout.x_ndim; d++) out->x_shape[d + 1] = s->layout.x_shape[d];
    out->x = s->bx;
    if (!s->layout.unlabeled) {
        out->y_dtype = s->layout.y_dtype;
        out->y_ndim = s->layout.y_ndim + 1;
        out->y_shape[0] = k;
        for (d = 0; d < s->layout.y_ndim; d++) out->y_shape[d + 1] = s->layout.y_shape[d];
        out->y = s->by;
    }
    out->indices = s->bseq;
    return DTR_OK;
}

void dtr_feed_end(dtr_feed *s) {
    if (!s) return;
    pthread_mutex_lock(&s->mu);
    s->closed = 1;
    pthread_cond_broadcast(&s->room);
    pthread_cond_broadcast(&s->data);
    pthread_mutex_unlock(&s->mu);
}

void dtr_feed_get_stats(dtr_feed *s, dtr_feed_stats *out) {
    if (!out) return;
    memset(out, 0, sizeof *out);
    if (!s) return;
    pthread_mutex_lock(&s->mu);
    *out = s->stats;
    out->size = s->size;
    pthread_mutex_unlock(&s->mu);
}
#line 14474 "dtrain.h"

/* ---- src/rendezvous/sha256.c ---- */
#line 1 "src/rendezvous/sha256.c"
/* ============================================================================
 * SHA-256 (FIPS 180-4) and HMAC-SHA256 (RFC 2104), for the rendezvous handshake.
 *
 * Plain, portable C: no tables beyond the 64 round constants, no SIMD, byte order handled
 * explicitly, so the result is the same on every machine. Speed does not matter here (a few
 * hashes per connection). Checked against the FIPS 180-4 examples and the RFC 4231 HMAC
 * vectors in tests/test_rendezvous.c.
 * ==========================================================================*/



#ifdef __cplusplus
extern "C" {
#endif

#define DTR__SHA256_BYTES 32
#define DTR__SHA256_BLOCK 64

typedef struct dtr__sha256 {
    uint32_t h[8];
    uint64_t bytes;                  /* message length so far */
    uint8_t buf[DTR__SHA256_BLOCK];  /* partial block */
    size_t fill;
} dtr__sha256;

static void dtr__sha256_init(dtr__sha256 *s);
static void dtr__sha256_update(dtr__sha256 *s, const void *data, size_t n);
static void dtr__sha256_final(dtr__sha256 *s, uint8_t out[DTR__SHA256_BYTES]);
/** SHA-256 of one buffer. */
void dtr__sha256_once(const void *data, size_t n, uint8_t out[DTR__SHA256_BYTES]);

/** HMAC-SHA256 (RFC 2104), incremental: init with the key (any length), update, final. */
typedef struct dtr__hmac {
    dtr__sha256 inner, outer;
} dtr__hmac;
static void dtr__hmac_init(dtr__hmac *h, const void *key, size_t keylen);
static void dtr__hmac_update(dtr__hmac *h, const void *data, size_t n);
static void dtr__hmac_final(dtr__hmac *h, uint8_t out[DTR__SHA256_BYTES]);
/** HMAC-SHA256 of one buffer. */
void dtr__hmac_sha256(const void *key, size_t keylen, const void *data, size_t n, uint8_t out[DTR__SHA256_BYTES]);
/** 1 when the n bytes of a and b are equal; the time taken does not depend on where they differ. */
static int dtr__ct_equal(const void *a, const void *b, size_t n);

/* ---- SHA-256 ---- */

static const uint32_t dtr__sha256_k[64] = {
    0x428a2f98u, 0x71374491u, 0xb5c0fbcfu, 0xe9b5dba5u, 0x3956c25bu, 0x59f111f1u, 0x923f82a4u, 0xab1c5ed5u,
    0xd807aa98u, 0x12835b01u, 0x243185beu, 0x550c7dc3u, 0x72be5d74u, 0x80deb1feu, 0x9bdc06a7u, 0xc19bf174u,
    0xe49b69c1u, 0xefbe4786u, 0x0fc19dc6u, 0x240ca1ccu, 0x2de92c6fu, 0x4a7484aau, 0x5cb0a9dcu, 0x76f988dau,
    0x983e5152u, 0xa831c66du, 0xb00327c8u, 0xbf597fc7u, 0xc6e00bf3u, 0xd5a79147u, 0x06ca6351u, 0x14292967u,
    0x27b70a85u, 0x2e1b2138u, 0x4d2c6dfcu, 0x53380d13u, 0x650a7354u, 0x766a0abbu, 0x81c2c92eu, 0x92722c85u,
    0xa2bfe8a1u, 0xa81a664bu, 0xc24b8b70u, 0xc76c51a3u, 0xd192e819u, 0xd6990624u, 0xf40e3585u, 0x106aa070u,
    0x19a4c116u, 0x1e376c08u, 0x2748774cu, 0x34b0bcb5u, 0x391c0cb3u, 0x4ed8aa4au, 0x5b9cca4fu, 0x682e6ff3u,
    0x748f82eeu, 0x78a5636fu, 0x84c87814u, 0x8cc70208u, 0x90befffau, 0xa4506cebu, 0xbef9a3f7u, 0xc67178f2u
};

static uint32_t dtr__rotr32(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

/* One 64-byte block into the state. */
static void dtr__sha256_block(uint32_t h[8], const uint8_t *p) {
    uint32_t w[64], a, b, c, d, e, f, g, hh, t1, t2;
    int i;
    for (i = 0; i < 16; i++)
        w[i] = ((uint32_t)p[4 * i] << 24) | ((uint32_t)p[4 * i + 1] << 16) | ((uint32_t)p[4 * i + 2] << 8) |
               (uint32_t)p[4 * i + 3];
    for (i = 16; i < 64; i++) {
        uint32_t s0 = dtr__rotr32(w[i - 15], 7) ^ dtr__rotr32(w[i - 15], 18) ^ (w[i - 15] >> 3);
        uint32_t s1 = dtr__rotr32(w[i - 2], 17) ^ dtr__rotr32(w[i - 2], 19) ^ (w[i - 2] >> 10);
        w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    a = h[0]; b = h[1]; c = h[2]; d = h[3]; e = h[4]; f = h[5]; g = h[6]; hh = h[7];
    for (i = 0; i < 64; i++) {
        uint32_t S1 = dtr__rotr32(e, 6) ^ dtr__rotr32(e, 11) ^ dtr__rotr32(e, 25);
        uint32_t ch = (e & f) ^ (~e & g);
        uint32_t S0 = dtr__rotr32(a, 2) ^ dtr__rotr32(a, 13) ^ dtr__rotr32(a, 22);
        uint32_t maj = (a & b) ^ (a & c) ^ (b & c);
        t1 = hh + S1 + ch + dtr__sha256_k[i] + w[i];
        t2 = S0 + maj;
        hh = g; g = f; f = e; e = d + t1; d = c; c = b; b = a; a = t1 + t2;
    }
    h[0] += a; h[1] += b; h[2] += c; h[3] += d; h[4] += e; h[5] += f; h[6] += g; h[7] += hh;
}

static void dtr__sha256_init(dtr__sha256 *s) {
    static const uint32_t iv[8] = {0x6a09e667u, 0xbb67ae85u, 0x3c6ef372u, 0xa54ff53au,
                                   0x510e527fu, 0x9b05688cu, 0x1f83d9abu, 0x5be0cd19u};
    memcpy(s->h, iv, sizeof iv);
    s->bytes = 0;
    s->fill = 0;
}

static void dtr__sha256_update(dtr__sha256 *s, const void *data, size_t n) {
    const uint8_t *p = (const uint8_t *)data;
    s->bytes += n;
    if (s->fill) {
        size_t take = DTR__SHA256_BLOCK - s->fill;
        if (take > n) take = n;
        memcpy(s->buf + s->fill, p, take);
        s->fill += take; p += take; n -= take;
        if (s->fill < DTR__SHA256_BLOCK) return;
        dtr__sha256_block(s->h, s->buf);
        s->fill = 0;
    }
    while (n >= DTR__SHA256_BLOCK) {
        dtr__sha256_block(s->h, p);
        p += DTR__SHA256_BLOCK; n -= DTR__SHA256_BLOCK;
    }
    if (n) {
        memcpy(s->buf, p, n);
        s->fill = n;
    }
}

static void dtr__sha256_final(dtr__sha256 *s, uint8_t out[DTR__SHA256_BYTES]) {
    uint64_t bits = s->bytes * 8;
    int i;
    s->buf[s->fill++] = 0x80;
    if (s->fill > DTR__SHA256_BLOCK - 8) {
        memset(s->buf + s->fill, 0, DTR__SHA256_BLOCK - s->fill);
        dtr__sha256_block(s->h, s->buf);
        s->fill = 0;
    }
    memset(s->buf + s->fill, 0, DTR__SHA256_BLOCK - 8 - s->fill);
    for (i = 0; i < 8; i++) s->buf[DTR__SHA256_BLOCK - 1 - i] = (uint8_t)(bits >> (8 * i));
    dtr__sha256_block(s->h, s->buf);
    for (i = 0; i < 8; i++) {
        out[4 * i] = (uint8_t)(s->h[i] >> 24);
        out[4 * i + 1] = (uint8_t)(s->h[i] >> 16);
        out[4 * i + 2] = (uint8_t)(s->h[i] >> 8);
        out[4 * i + 3] = (uint8_t)s->h[i];
    }
    memset(s, 0, sizeof *s);
}

void dtr__sha256_once(const void *data, size_t n, uint8_t out[DTR__SHA256_BYTES]) {
    dtr__sha256 s;
    dtr__sha256_init(&s);
    dtr__sha256_update(&s, data, n);
    dtr__sha256_final(&s, out);
}

/* ---- HMAC-SHA256: H((K ^ opad) || H((K ^ ipad) || m)) ---- */

static void dtr__hmac_init(dtr__hmac *h, const void *key, size_t keylen) {
    uint8_t k[DTR__SHA256_BLOCK], pad[DTR__SHA256_BLOCK];
    int i;
    memset(k, 0, sizeof k);
    if (keylen > DTR__SHA256_BLOCK) dtr__sha256_once(key, keylen, k);   /* long keys are hashed first */
    else if (keylen) memcpy(k, key, keylen);
    for (i = 0; i < DTR__SHA256_BLOCK; i++) pad[i] = (uint8_t)(k[i] ^ 0x36);
    dtr__sha256_init(&h->inner);
    dtr__sha256_update(&h->inner, pad, sizeof pad);
    for (i = 0; i < DTR__SHA256_BLOCK; i++) pad[i] = (uint8_t)(k[i] ^ 0x5c);
    dtr__sha256_init(&h->outer);
    dtr__sha256_update(&h->outer, pad, sizeof pad);
    memset(k, 0, sizeof k);
    memset(pad, 0, sizeof pad);
}

static void dtr__hmac_update(dtr__hmac *h, const void *data, size_t n) { dtr__sha256_update(&h->inner, data, n); }

static void dtr__hmac_final(dtr__hmac *h, uint8_t out[DTR__SHA256_BYTES]) {
    uint8_t ih[DTR__SHA256_BYTES];
    dtr__sha256_final(&h->inner, ih);
    dtr__sha256_update(&h->outer, ih, sizeof ih);
    dtr__sha256_final(&h->outer, out);
}

void dtr__hmac_sha256(const void *key, size_t keylen, const void *data, size_t n, uint8_t out[DTR__SHA256_BYTES]) {
    dtr__hmac h;
    dtr__hmac_init(&h, key, keylen);
    dtr__hmac_update(&h, data, n);
    dtr__hmac_final(&h, out);
}

static int dtr__ct_equal(const void *a, const void *b, size_t n) {
    const volatile uint8_t *x = (const volatile uint8_t *)a, *y = (const volatile uint8_t *)b;
    uint8_t d = 0;
    size_t i;
    for (i = 0; i < n; i++) d = (uint8_t)(d | (x[i] ^ y[i]));
    return d == 0;
}

#ifdef __cplusplus
}
#endif
#line 14664 "dtrain.h"

/* ---- src/rendezvous/env.c ---- */
#line 1 "src/rendezvous/env.c"
/* ============================================================================
 * Rendezvous, part 1 of 4: the configuration and the environment conventions (dtrun,
 * torchrun, Slurm, Open MPI), on every platform. Part 2 (wire.c) is the protocol and the
 * server logic on memory buffers, part 3 (server.c) the sockets and rank 0's server thread,
 * part 4 (client.c) the client every rank uses. docs/rendezvous.md describes the whole.
 * ==========================================================================*/




#include <limits.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- configuration and the environment (every platform) ---- */

dtr_rendezvous_config dtr_rendezvous_config_init(void) {
    dtr_rendezvous_config c;
    memset(&c, 0, sizeof c);
    c.world_size = 1;
    memcpy(c.master_addr, "127.0.0.1", 10);
    c.port = 29500;
    c.timeout_ms = 300000;
    c.log_level = DTR_LOG_WARN;
    return c;
}

/* Parses a whole string of decimal digits (no sign, no spaces) into [lo, hi]. */
static int dtr__rdzv_parse_uint(const char *s, int64_t lo, int64_t hi, int64_t *out) {
    int64_t v = 0;
    if (!*s) return 0;
    for (; *s; s++) {
        int d = *s - '0';
        if (d < 0 || d > 9) return 0;
        if (v > (hi - d) / 10) return 0;
        v = v * 10 + d;
    }
    if (v < lo) return 0;
    *out = v;
    return 1;
}

/* The first non-empty variable among names[0..n); *which gets its name. */
static const char *dtr__rdzv_getenv(const char *const *names, int n, const char **which) {
    int i;
    for (i = 0; i < n; i++) {
        const char *v = getenv(names[i]);
        if (v && v[0]) {
            *which = names[i];
            return v;
        }
    }
    return NULL;
}

/* Reads an integer field from the first set variable of `names`. */
static dtr_result dtr__rdzv_env_int(const char *const *names, int n, int64_t lo, int64_t hi, int32_t *field,
                                    const char **which, char *err, size_t errlen) {
    const char *v = dtr__rdzv_getenv(names, n, which);
    int64_t x;
    if (!v) return DTR_OK;
    if (!dtr__rdzv_parse_uint(v, lo, hi, &x))
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT,
                         "rendezvous: %s='%.64s' is not a decimal integer in [%lld, %lld]", *which, v, (long long)lo,
                         (long long)hi);
    *field = (int32_t)x;
    return DTR_OK;
}

static dtr_result dtr__rdzv_env_str(const char *const *names, int n, char *field, const char **which, char *err,
                                    size_t errlen) {
    const char *v = dtr__rdzv_getenv(names, n, which);
    size_t len;
    if (!v) return DTR_OK;
    len = strlen(v);
    if (len >= DTR_RDZV_STR)
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "rendezvous: %s is %lu bytes long; at most %d", *which,
                         (unsigned long)len, DTR_RDZV_STR - 1);
    memcpy(field, v, len + 1);
    return DTR_OK;
}

dtr_result dtr_rendezvous_config_from_env(dtr_rendezvous_config *cfg, char *err, size_t errlen) {
    static const char *const rank[] = {"DTR_RANK", "RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"};
    static const char *const world[] = {"DTR_WORLD_SIZE", "WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"};
    static const char *const lrank[] = {"DTR_LOCAL_RANK", "LOCAL_RANK", "SLURM_LOCALID",
                                        "OMPI_COMM_WORLD_LOCAL_RANK"};
    static const char *const lworld[] = {"DTR_LOCAL_WORLD_SIZE", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"};
    static const char *const addr[] = {"DTR_MASTER_ADDR", "MASTER_ADDR"};
    static const char *const port[] = {"DTR_MASTER_PORT", "MASTER_PORT"};
    static const char *const secret[] = {"DTR_SECRET"};
    static const char *const timeout[] = {"DTR_TIMEOUT_MS"};
    const char *rank_from = "the configuration", *world_from = "the configuration";
    const char *lrank_from = "the configuration", *lworld_from = "the configuration", *w = NULL;
    int32_t port_v = 0, timeout_v = 0;
    dtr_result r;
    if (err && errlen) err[0] = '\0';
    if (!cfg) return dtr__errf(err, errlen, DTR_NULL_HANDLE, "rendezvous: config is NULL");
    if ((r = dtr__rdzv_env_int(rank, 4, 0, INT32_MAX - 1, &cfg->rank, &rank_from, err, errlen)) != DTR_OK) return r;
    if ((r = dtr__rdzv_env_int(world, 4, 1, INT32_MAX, &cfg->world_size, &world_from, err, errlen)) != DTR_OK)
        return r;
    if ((r = dtr__rdzv_env_int(lrank, 4, 0, INT32_MAX - 1, &cfg->local_rank, &lrank_from, err, errlen)) != DTR_OK)
        return r;
    if ((r = dtr__rdzv_env_int(lworld, 3, 1, INT32_MAX, &cfg->local_world_size, &lworld_from, err, errlen)) !=
        DTR_OK)
        return r;
    if ((r = dtr__rdzv_env_str(addr, 2, cfg->master_addr, &w, err, errlen)) != DTR_OK) return r;
    if ((r = dtr__rdzv_env_str(secret, 1, cfg->secret, &w, err, errlen)) != DTR_OK) return r;
    port_v = cfg->port;
    if ((r = dtr__rdzv_env_int(port, 2, 1, 65535, &port_v, &w, err, errlen)) != DTR_OK) return r;
    cfg->port = port_v;
    timeout_v = cfg->timeout_ms;
    if ((r = dtr__rdzv_env_int(timeout, 1, 1, INT32_MAX, &timeout_v, &w, err, errlen)) != DTR_OK) return r;
    cfg->timeout_ms = timeout_v;
    if (cfg->rank >= cfg->world_size)
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "rendezvous: rank %ld (from %s) is not below the world size %ld (from %s)",
                         (long)cfg->rank, rank_from, (long)cfg->world_size, world_from);
    if (cfg->local_world_size > 0 && cfg->local_rank >= cfg->local_world_size)
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT,
                         "rendezvous: local rank %ld (from %s) is not below the local world size %ld (from %s)",
                         (long)cfg->local_rank, lrank_from, (long)cfg->local_world_size, lworld_from);
    return DTR_OK;
}


#ifdef __cplusplus
}
#endif
#line 14798 "dtrain.h"

/* ---- src/rendezvous/wire.c ---- */
#line 1 "src/rendezvous/wire.c"
/* ============================================================================
 * Rendezvous, part 2 of 4: the built-in TCP store's protocol and its server logic on memory
 * buffers (no sockets), so tests/fuzz/fuzz_rdzv.c drives it directly.
 *
 * Rank 0 runs the server on a thread of its own: one poll() loop over the listening
 * sockets, a wake-up pipe and every connection, all non-blocking, so a client that stalls
 * or sends garbage holds nobody up. Every rank, rank 0 included, is a client with one
 * blocking-with-deadline connection.
 *
 * Wire format (all integers big-endian; docs/rendezvous.md has the full description):
 *   server hello    40 B  "DTRZ" u32 version  nonce_s[32]
 *   client auth     80 B  "DTRA" u32 version  u32 rank  u32 world  nonce_c[32]  mac[32]
 *                         mac = HMAC-SHA256(secret, "dtr-rdzv-1 join" || nonce_s || auth[0..48))
 *   server welcome  40 B  "DTRW" u32 status  mac[32]
 *                         mac = HMAC-SHA256(secret, "dtr-rdzv-1 welcome" || nonce_c || nonce_s
 *                               || welcome[0..8)), zero when the status is a refusal
 *   request         12 B  u8 op  u8 0  u16 key_len  u32 value_len  u32 id,  then key, value
 *   reply           12 B  u8 status  u8 0  u16 0  u32 value_len  u32 id,  then value
 * The server reads exactly 80 bytes from a new connection and checks the MAC before it
 * looks at any field. Every length is checked against its bound as soon as its header is
 * complete, before a byte of the body is buffered; a message that breaks a rule closes
 * that connection (the reason is logged) and nothing else.
 *
 * The server logic (dtr__rdzv_server_*, dtr__rdzv_conn_*) works on in-memory buffers and
 * knows nothing of sockets, so tests/fuzz/fuzz_rdzv.c drives it directly.
 *
 * Portability: POSIX sockets, poll, pthreads. Only interfaces that glibc and musl declare
 * under plain -std=c99 are required (the amalgamation cannot define feature-test macros
 * after the user's headers): getaddrinfo is used when the headers declare it (AI_PASSIVE),
 * else numeric addresses go through inet_pton and host names through gethostbyname (IPv4).
 * Time is dtr_time_ns (src/comm/comm.c), which finds the monotonic clock under -std=c99 too.
 * Windows: the store reports DTR_UNSUPPORTED.
 * Uses dtr__hmac_* and dtr__ct_equal from src/rendezvous/sha256.c (just before it in the
 * amalgamation).
 * ==========================================================================*/





#include <limits.h>

#if !defined(_WIN32)
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <pthread.h>
#include <unistd.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/types.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- protocol constants ---- */

#define DTR__RDZV_VERSION 1u
#define DTR__RDZV_NONCE 32
#define DTR__RDZV_MAC 32
#define DTR__RDZV_HELLO_LEN 40
#define DTR__RDZV_AUTH_LEN 80
#define DTR__RDZV_AUTH_SIGNED 48    /* bytes of the auth message covered by its MAC */
#define DTR__RDZV_WELCOME_LEN 40
#define DTR__RDZV_HDR 12
#define DTR__RDZV_MAX_FRAME (DTR__RDZV_HDR + DTR_STORE_MAX_KEY + DTR_STORE_MAX_VALUE)

/* request ops */
enum { DTR__RDZV_SET = 1, DTR__RDZV_GET = 2, DTR__RDZV_ADD = 3, DTR__RDZV_CHECK = 4, DTR__RDZV_DEL = 5 };
/* reply status */
enum { DTR__RDZV_OK = 0, DTR__RDZV_NOT_FOUND = 1, DTR__RDZV_NOT_INTEGER = 2, DTR__RDZV_FULL = 3 };
/* welcome status */
enum { DTR__RDZV_W_OK = 0, DTR__RDZV_W_BAD_SECRET = 1, DTR__RDZV_W_BAD_RANK = 2, DTR__RDZV_W_BAD_VERSION = 3 };
/* (W_BAD_RANK: the rank is not below the world size, or the world sizes differ) */
/* connection states */
enum { DTR__RDZV_C_AUTH = 0, DTR__RDZV_C_READY = 1, DTR__RDZV_C_CLOSING = 2 };

static const char dtr__rdzv_join_label[] = "dtr-rdzv-1 join";
static const char dtr__rdzv_welcome_label[] = "dtr-rdzv-1 welcome";

#ifdef MSG_NOSIGNAL
#define DTR__RDZV_NOSIGNAL MSG_NOSIGNAL
#else
#define DTR__RDZV_NOSIGNAL 0
#endif

/* ---- small helpers ---- */

static void dtr__rdzv_put32(uint8_t *p, uint32_t v) {
    p[0] = (uint8_t)(v >> 24); p[1] = (uint8_t)(v >> 16); p[2] = (uint8_t)(v >> 8); p[3] = (uint8_t)v;
}
static uint32_t dtr__rdzv_get32(const uint8_t *p) {
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | (uint32_t)p[3];
}
static void dtr__rdzv_put64(uint8_t *p, uint64_t v) {
    dtr__rdzv_put32(p, (uint32_t)(v >> 32));
    dtr__rdzv_put32(p + 4, (uint32_t)v);
}
static uint64_t dtr__rdzv_get64(const uint8_t *p) {
    return ((uint64_t)dtr__rdzv_get32(p) << 32) | dtr__rdzv_get32(p + 4);
}

/* Monotonic milliseconds (the library's one clock, dtr_time_ns). */
static int64_t dtr__rdzv_now_ms(void) { return dtr_time_ns() / 1000000; }

/* Milliseconds left until `deadline`, clamped to [0, INT_MAX]. */
static int dtr__rdzv_left_ms(int64_t deadline) {
    int64_t left = deadline - dtr__rdzv_now_ms();
    if (left < 0) return 0;
    if (left > INT_MAX) return INT_MAX;
    return (int)left;
}

static void dtr__rdzv_sleep_ms(int ms) {
    if (ms > 0) (void)poll(NULL, 0, ms);
}

/* Cryptographic random bytes from /dev/urandom; should that fail, SHA-256 of the time, the
 * process id, a counter and an address (unique, if not unpredictable: enough for nonces,
 * whose job is never to repeat). */
static void dtr__rdzv_random(uint8_t *out, size_t n) {
    static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
    static uint64_t counter;
    size_t got = 0;
    int fd = open("/dev/urandom", O_RDONLY);
    if (fd >= 0) {
        while (got < n) {
            ssize_t k = read(fd, out + got, n - got);
            if (k > 0) got += (size_t)k;
            else if (k < 0 && errno == EINTR) continue;
            else break;
        }
        close(fd);
    }
    while (got < n) {
        uint8_t seed[40], h[32];
        int64_t t = dtr__rdzv_now_ms();
        long pid = (long)getpid();
        uint64_t c;
        const void *addr = &seed;
        size_t take;
        pthread_mutex_lock(&lock);
        c = ++counter;
        pthread_mutex_unlock(&lock);
        memset(seed, 0, sizeof seed);
        memcpy(seed, &t, sizeof t);
        memcpy(seed + 8, &pid, sizeof pid < 8 ? sizeof pid : 8);
        memcpy(seed + 16, &c, sizeof c);
        memcpy(seed + 24, &addr, sizeof addr < 16 ? sizeof addr : 16);
        dtr__sha256_once(seed, sizeof seed, h);
        take = n - got < 32 ? n - got : 32;
        memcpy(out + got, h, take);
        got += take;
    }
}

/* Log through the configuration's callback. */
static void dtr__rdzv_log(const dtr_rendezvous_config *cfg, dtr_log_level level, const char *fmt, ...) DTR__PRINTF(3, 4);
static void dtr__rdzv_log(const dtr_rendezvous_config *cfg, dtr_log_level level, const char *fmt, ...) {
    char msg[768];
    va_list ap;
    if (!cfg->log || level > cfg->log_level) return;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    cfg->log(cfg->log_user, level, msg);
}

/* Key as text for messages: printable ASCII kept, anything else as '?'; at most 64 chars. */
static const char *dtr__rdzv_show_key(const uint8_t *key, size_t n, char *buf, size_t cap) {
    size_t i, m = n < 64 ? n : 64;
    if (m + 4 > cap) m = cap > 4 ? cap - 4 : 0;
    for (i = 0; i < m; i++) buf[i] = (key[i] >= 0x20 && key[i] < 0x7f) ? (char)key[i] : '?';
    if (m < n && i + 3 < cap) { buf[i++] = '.'; buf[i++] = '.'; buf[i++] = '.'; }
    buf[i] = '\0';
    return buf;
}

/* ======================================================================
 * The server logic, on memory buffers (no sockets).
 * ====================================================================*/

typedef struct dtr__rdzv_entry {
    struct dtr__rdzv_entry *next;
    uint32_t hash, klen, vlen;
    uint8_t *val;        /* vlen bytes (NULL when 0) */
    /* key bytes follow the struct */
} dtr__rdzv_entry;

typedef struct dtr__rdzv_conn {
    int fd;                          /* -1 when driven from memory */
    int state;                       /* DTR__RDZV_C_* */
    int32_t rank;                    /* -1 until authenticated */
    int64_t deadline_ms;             /* handshake deadline (socket layer) */
    char peer[64];                   /* "127.0.0.1:5555", for messages */
    uint8_t nonce[DTR__RDZV_NONCE];  /* the server's challenge */
    uint8_t *in;                     /* the message being received */
    size_t in_len, in_cap, frame_len;  /* frame_len: full length once the header is in, else 0 */
    uint8_t *out;                    /* replies not yet sent: out[out_pos .. out_len) */
    size_t out_pos, out_len, out_cap;
    int waiting;                     /* a GET is parked until its key is set */
    uint32_t wait_id;
    uint32_t wait_klen;
    uint8_t wait_key[DTR_STORE_MAX_KEY];
} dtr__rdzv_conn;

typedef struct dtr__rdzv_server {
    dtr_rendezvous_config cfg;       /* limits resolved (no zeros) */
    dtr__rdzv_entry **buckets;
    size_t nbuckets, nkeys, nbytes;
    dtr__rdzv_conn **conns;
    int nconns, cap_conns;
    uint64_t refused;                /* connections refused or closed for a protocol error */
} dtr__rdzv_server;

/* A parsed request header. */
typedef struct dtr__rdzv_req {
    int op;
    uint32_t klen, vlen, id;
} dtr__rdzv_req;

/* The server core, used by server.c (and driven directly by tests/fuzz/fuzz_rdzv.c, which
 * compiles the implementation itself). */
DTR__PRIVATE dtr_result dtr__rdzv_server_init(dtr__rdzv_server *s, const dtr_rendezvous_config *cfg);
DTR__PRIVATE void dtr__rdzv_server_free(dtr__rdzv_server *s);
DTR__PRIVATE int dtr__rdzv_parse_header(const uint8_t *p, dtr__rdzv_req *req, char *why, size_t whylen);
DTR__PRIVATE dtr__rdzv_conn *dtr__rdzv_conn_open(dtr__rdzv_server *s, int fd, const char *peer);
DTR__PRIVATE void dtr__rdzv_conn_feed(dtr__rdzv_server *s, dtr__rdzv_conn *c, const uint8_t *p, size_t n);
DTR__PRIVATE size_t dtr__rdzv_conn_want(const dtr__rdzv_conn *c);
DTR__PRIVATE void dtr__rdzv_conn_close(dtr__rdzv_server *s, dtr__rdzv_conn *c);

static void *dtr__rdzv_alloc(const dtr_rendezvous_config *cfg, size_t n) { return dtr__malloc(&cfg->alloc, n); }
static void dtr__rdzv_free(const dtr_rendezvous_config *cfg, void *p) { dtr__free(&cfg->alloc, p); }

dtr_result dtr__rdzv_server_init(dtr__rdzv_server *s, const dtr_rendezvous_config *cfg) {
    memset(s, 0, sizeof *s);
    s->cfg = *cfg;
    if (s->cfg.max_keys <= 0) s->cfg.max_keys = 65536;
    if (s->cfg.max_connections <= 0) {
        s->cfg.max_connections = 1024;
        if (s->cfg.world_size < INT_MAX - 16 && s->cfg.max_connections < s->cfg.world_size + 16)
            s->cfg.max_connections = s->cfg.world_size + 16;
    }
    if (s->cfg.max_bytes == 0) s->cfg.max_bytes = (size_t)256 << 20;
    s->nbuckets = 64;
    s->buckets = (dtr__rdzv_entry **)dtr__calloc(&s->cfg.alloc, s->nbuckets * sizeof *s->buckets);
    if (!s->buckets) return DTR_OUT_OF_MEMORY;
    return DTR_OK;
}

void dtr__rdzv_server_free(dtr__rdzv_server *s) {
    size_t i;
    while (s->nconns > 0) dtr__rdzv_conn_close(s, s->conns[s->nconns - 1]);
    dtr__rdzv_free(&s->cfg, s->conns);
    if (s->buckets) {
        for (i = 0; i < s->nbuckets; i++) {
            dtr__rdzv_entry *e = s->buckets[i];
            while (e) {
                dtr__rdzv_entry *next = e->next;
                dtr__rdzv_free(&s->cfg, e->val);
                dtr__rdzv_free(&s->cfg, e);
                e = next;
            }
        }
    }
    dtr__rdzv_free(&s->cfg, s->buckets);
    memset(s, 0, sizeof *s);
}

/* ---- the table: a chained hash map of byte-string keys ---- */

static uint32_t dtr__rdzv_hash(const uint8_t *k, size_t n) {
    uint32_t h = 2166136261u;   /* FNV-1a */
    size_t i;
    for (i = 0; i < n; i++) h = (h ^ k[i]) * 16777619u;
    return h;
}

static const uint8_t *dtr__rdzv_entry_key(const dtr__rdzv_entry *e) { return (const uint8_t *)(e + 1); }

static dtr__rdzv_entry **dtr__rdzv_find(dtr__rdzv_server *s, const uint8_t *k, uint32_t klen, uint32_t h) {
    dtr__rdzv_entry **pe = &s->buckets[h & (s->nbuckets - 1)];
    while (*pe) {
        if ((*pe)->hash == h && (*pe)->klen == klen && memcmp(dtr__rdzv_entry_key(*pe), k, klen) == 0) return pe;
        pe = &(*pe)->next;
    }
    return pe;
}

/* Doubles the bucket array (when it can; a failed grow only makes chains longer). */
static void dtr__rdzv_grow(dtr__rdzv_server *s) {
    size_t n = s->nbuckets * 2, i;
    dtr__rdzv_entry **b = (dtr__rdzv_entry **)dtr__calloc(&s->cfg.alloc, n * sizeof *b);
    if (!b) return;
    for (i = 0; i < s->nbuckets; i++) {
        dtr__rdzv_entry *e = s->buckets[i];
        while (e) {
            dtr__rdzv_entry *next = e->next;
            e->next = b[e->hash & (n - 1)];
            b[e->hash & (n - 1)] = e;
            e = next;
        }
    }
    dtr__rdzv_free(&s->cfg, s->buckets);
    s->buckets = b;
    s->nbuckets = n;
}

/* Sets key to value. Returns the entry, or NULL when a limit or the memory runs out
 * (*full says which: 1 limit, 0 memory). */
static dtr__rdzv_entry *dtr__rdzv_table_set(dtr__rdzv_server *s, const uint8_t *k, uint32_t klen, const uint8_t *v,
                                            uint32_t vlen, int *full) {
    uint32_t h = dtr__rdzv_hash(k, klen);
    dtr__rdzv_entry **pe = dtr__rdzv_find(s, k, klen, h), *e = *pe;
    uint8_t *copy = NULL;
    size_t old = e ? e->vlen : 0;
    *full = 1;
    if (!e && s->nkeys >= (size_t)s->cfg.max_keys) return NULL;
    if (s->nbytes - old + vlen + (e ? 0 : klen) > s->cfg.max_bytes) return NULL;
    *full = 0;
    if (vlen) {
        copy = (uint8_t *)dtr__rdzv_alloc(&s->cfg, vlen);
        if (!copy) return NULL;
        memcpy(copy, v, vlen);
    }
    if (!e) {
        e = (dtr__rdzv_entry *)dtr__rdzv_alloc(&s->cfg, sizeof *e + klen);
        if (!e) {
            dtr__rdzv_free(&s->cfg, copy);
            return NULL;
        }
        memset(e, 0, sizeof *e);
        e->hash = h;
        e->klen = klen;
        memcpy((uint8_t *)(e + 1), k, klen);
        *pe = e;
        s->nkeys++;
        s->nbytes += klen;
    }
    dtr__rdzv_free(&s->cfg, e->val);
    e->val = copy;
    e->vlen = vlen;
    s->nbytes = s->nbytes - old + vlen;
    if (s->nkeys > s->nbuckets) dtr__rdzv_grow(s);
    return e;
}

static void dtr__rdzv_table_del(dtr__rdzv_server *s, const uint8_t *k, uint32_t klen) {
    dtr__rdzv_entry **pe = dtr__rdzv_find(s, k, klen, dtr__rdzv_hash(k, klen)), *e = *pe;
    if (!e) return;
    *pe = e->next;
    s->nkeys--;
    s->nbytes -= (size_t)e->klen + e->vlen;
    dtr__rdzv_free(&s->cfg, e->val);
    dtr__rdzv_free(&s->cfg, e);
}

/* Parses a counter: optional '-', 1..19 digits, nothing else; within int64. */
static int dtr__rdzv_parse_counter(const uint8_t *p, size_t n, int64_t *out) {
    uint64_t v = 0, lim;
    size_t i = 0;
    int neg = 0;
    if (n > 0 && p[0] == '-') { neg = 1; i = 1; }
    if (i == n || n - i > 19) return 0;
    lim = neg ? (uint64_t)INT64_MAX + 1u : (uint64_t)INT64_MAX;
    for (; i < n; i++) {
        unsigned d = (unsigned)p[i] - '0';
        if (d > 9) return 0;
        if (v > (lim - d) / 10) return 0;
        v = v * 10 + d;
    }
    if (neg) *out = v == (uint64_t)INT64_MAX + 1u ? INT64_MIN : -(int64_t)v;
    else *out = (int64_t)v;
    return 1;
}

/* ---- connections ---- */

/* Makes room for `more` bytes in c->out. 0 when out of memory. */
static int dtr__rdzv_out_reserve(dtr__rdzv_server *s, dtr__rdzv_conn *c, size_t more) {
    size_t need, cap;
    uint8_t *p;
    if (c->out_pos == c->out_len) c->out_pos = c->out_len = 0;
    need = c->out_len + more;
    if (need <= c->out_cap) return 1;
    cap = c->out_cap ? c->out_cap : 256;
    while (cap < need) cap *= 2;
    p = (uint8_t *)dtr__realloc(&s->cfg.alloc, c->out, cap);
    if (!p) return 0;
    c->out = p;
    c->out_cap = cap;
    return 1;
}

/* Ends a connection after what is queued has been sent; logs why at `level`. */
static void dtr__rdzv_refuse(dtr__rdzv_server *s, dtr__rdzv_conn *c, dtr_log_level level, const char *fmt, ...) DTR__PRINTF(4, 5);
static void dtr__rdzv_refuse(dtr__rdzv_server *s, dtr__rdzv_conn *c, dtr_log_level level, const char *fmt, ...) {
    char msg[512];
    va_list ap;
    c->state = DTR__RDZV_C_CLOSING;
    c->waiting = 0;
    s->refused++;
    if (!s->cfg.log || level > s->cfg.log_level) return;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (c->rank >= 0) dtr__rdzv_log(&s->cfg, level, "rendezvous server: closed the connection of rank %ld (%s): %s",
                                    (long)c->rank, c->peer, msg);
    else dtr__rdzv_log(&s->cfg, level, "rendezvous server: refused %s: %s", c->peer, msg);
}

static void dtr__rdzv_reply(dtr__rdzv_server *s, dtr__rdzv_conn *c, int status, uint32_t id, const uint8_t *v,
                            uint32_t vlen) {
    uint8_t *p;
    if (!dtr__rdzv_out_reserve(s, c, DTR__RDZV_HDR + (size_t)vlen)) {
        dtr__rdzv_refuse(s, c, DTR_LOG_ERROR, "out of memory for a reply of %lu bytes", (unsigned long)vlen);
        return;
    }
    p = c->out + c->out_len;
    memset(p, 0, DTR__RDZV_HDR);
    p[0] = (uint8_t)status;
    dtr__rdzv_put32(p + 4, vlen);
    dtr__rdzv_put32(p + 8, id);
    if (vlen) memcpy(p + DTR__RDZV_HDR, v, vlen);
    c->out_len += DTR__RDZV_HDR + (size_t)vlen;
}

dtr__rdzv_conn *dtr__rdzv_conn_open(dtr__rdzv_server *s, int fd, const char *peer) {
    dtr__rdzv_conn *c;
    if (s->nconns >= s->cfg.max_connections) return NULL;
    if (s->nconns == s->cap_conns) {
        int cap = s->cap_conns ? s->cap_conns * 2 : 16;
        dtr__rdzv_conn **a = (dtr__rdzv_conn **)dtr__realloc(&s->cfg.alloc, s->conns, (size_t)cap * sizeof *a);
        if (!a) return NULL;
        s->conns = a;
        s->cap_conns = cap;
    }
    c = (dtr__rdzv_conn *)dtr__calloc(&s->cfg.alloc, sizeof *c);
    if (!c) return NULL;
    c->fd = fd;
    c->rank = -1;
    c->state = DTR__RDZV_C_AUTH;
    snprintf(c->peer, sizeof c->peer, "%s", peer ? peer : "?");
    dtr__rdzv_random(c->nonce, sizeof c->nonce);
    if (!dtr__rdzv_out_reserve(s, c, DTR__RDZV_HELLO_LEN)) {
        dtr__rdzv_free(&s->cfg, c);
        return NULL;
    }
    memcpy(c->out, "DTRZ", 4);
    dtr__rdzv_put32(c->out + 4, DTR__RDZV_VERSION);
    memcpy(c->out + 8, c->nonce, DTR__RDZV_NONCE);
    c->out_len = DTR__RDZV_HELLO_LEN;
    s->conns[s->nconns++] = c;
    return c;
}

void dtr__rdzv_conn_close(dtr__rdzv_server *s, dtr__rdzv_conn *c) {
    int i;
    for (i = 0; i < s->nconns; i++) {
        if (s->conns[i] == c) {
            s->conns[i] = s->conns[--s->nconns];
            break;
        }
    }
    if (c->fd >= 0) close(c->fd);
    dtr__rdzv_free(&s->cfg, c->in);
    dtr__rdzv_free(&s->cfg, c->out);
    dtr__rdzv_free(&s->cfg, c);
}

/* The MAC of an auth message: HMAC(secret, join label || server nonce || auth[0..48)). */
static void dtr__rdzv_auth_mac(const char *secret, const uint8_t *snonce, const uint8_t *auth, uint8_t *mac) {
    dtr__hmac h;
    dtr__hmac_init(&h, secret, strlen(secret));
    dtr__hmac_update(&h, dtr__rdzv_join_label, sizeof dtr__rdzv_join_label - 1);
    dtr__hmac_update(&h, snonce, DTR__RDZV_NONCE);
    dtr__hmac_update(&h, auth, DTR__RDZV_AUTH_SIGNED);
    dtr__hmac_final(&h, mac);
}

/* The MAC of a welcome: HMAC(secret, welcome label || client nonce || server nonce || welcome[0..8)). */
static void dtr__rdzv_welcome_mac(const char *secret, const uint8_t *cnonce, const uint8_t *snonce,
                                  const uint8_t *welcome, uint8_t *mac) {
    dtr__hmac h;
    dtr__hmac_init(&h, secret, strlen(secret));
    dtr__hmac_update(&h, dtr__rdzv_welcome_label, sizeof dtr__rdzv_welcome_label - 1);
    dtr__hmac_update(&h, cnonce, DTR__RDZV_NONCE);
    dtr__hmac_update(&h, snonce, DTR__RDZV_NONCE);
    dtr__hmac_update(&h, welcome, 8);
    dtr__hmac_final(&h, mac);
}

static void dtr__rdzv_welcome(dtr__rdzv_server *s, dtr__rdzv_conn *c, uint32_t status, const uint8_t *cnonce) {
    uint8_t *p;
    if (!dtr__rdzv_out_reserve(s, c, DTR__RDZV_WELCOME_LEN)) {
        dtr__rdzv_refuse(s, c, DTR_LOG_ERROR, "out of memory");
        return;
    }
    p = c->out + c->out_len;
    memcpy(p, "DTRW", 4);
    dtr__rdzv_put32(p + 4, status);
    if (status == DTR__RDZV_W_OK) dtr__rdzv_welcome_mac(s->cfg.secret, cnonce, c->nonce, p, p + 8);
    else memset(p + 8, 0, DTR__RDZV_MAC);
    c->out_len += DTR__RDZV_WELCOME_LEN;
}

/* The 80-byte auth message: the MAC first, then the fields it covers. */
static void dtr__rdzv_handle_auth(dtr__rdzv_server *s, dtr__rdzv_conn *c, const uint8_t *m) {
    uint8_t mac[DTR__RDZV_MAC];
    uint32_t version, rank, world;
    dtr__rdzv_auth_mac(s->cfg.secret, c->nonce, m, mac);
    if (!dtr__ct_equal(mac, m + DTR__RDZV_AUTH_SIGNED, DTR__RDZV_MAC)) {
        dtr__rdzv_welcome(s, c, DTR__RDZV_W_BAD_SECRET, NULL);
        dtr__rdzv_refuse(s, c, DTR_LOG_WARN, "wrong secret (the HMAC of the join message does not match; "
                                             "is DTR_SECRET the same on every rank?)");
        return;
    }
    version = dtr__rdzv_get32(m + 4);
    rank = dtr__rdzv_get32(m + 8);
    world = dtr__rdzv_get32(m + 12);
    if (memcmp(m, "DTRA", 4) != 0 || version != DTR__RDZV_VERSION) {
        dtr__rdzv_welcome(s, c, DTR__RDZV_W_BAD_VERSION, NULL);
        dtr__rdzv_refuse(s, c, DTR_LOG_WARN, "protocol version %lu; this server speaks version %u",
                         (unsigned long)version, DTR__RDZV_VERSION);
        return;
    }
    if (world != (uint32_t)s->cfg.world_size || rank >= world) {
        dtr__rdzv_welcome(s, c, DTR__RDZV_W_BAD_RANK, NULL);
        if (world != (uint32_t)s->cfg.world_size)
            dtr__rdzv_refuse(s, c, DTR_LOG_WARN, "rank %lu joins a world of %lu ranks; this job has %ld",
                             (unsigned long)rank, (unsigned long)world, (long)s->cfg.world_size);
        else
            dtr__rdzv_refuse(s, c, DTR_LOG_WARN, "rank %lu is not below the world size %ld", (unsigned long)rank,
                             (long)s->cfg.world_size);
        return;
    }
    c->rank = (int32_t)rank;
    c->state = DTR__RDZV_C_READY;
    dtr__rdzv_welcome(s, c, DTR__RDZV_W_OK, m + 16);
    dtr__rdzv_log(&s->cfg, DTR_LOG_DEBUG, "rendezvous server: rank %ld joined from %s", (long)c->rank, c->peer);
}

int dtr__rdzv_parse_header(const uint8_t *p, dtr__rdzv_req *req, char *why, size_t whylen) {
    req->op = p[0];
    req->klen = ((uint32_t)p[2] << 8) | p[3];
    req->vlen = dtr__rdzv_get32(p + 4);
    req->id = dtr__rdzv_get32(p + 8);
    if (req->op < DTR__RDZV_SET || req->op > DTR__RDZV_DEL) {
        dtr__errf(why, whylen, DTR_INVALID_ARGUMENT, "unknown op %d", req->op);
        return 0;
    }
    if (p[1] != 0) {
        dtr__errf(why, whylen, DTR_INVALID_ARGUMENT, "reserved byte is %d, not 0", p[1]);
        return 0;
    }
    if (req->klen < 1 || req->klen > DTR_STORE_MAX_KEY) {
        dtr__errf(why, whylen, DTR_INVALID_ARGUMENT, "key length %lu outside 1..%d", (unsigned long)req->klen,
                  DTR_STORE_MAX_KEY);
        return 0;
    }
    if (req->vlen > DTR_STORE_MAX_VALUE) {
        dtr__errf(why, whylen, DTR_INVALID_ARGUMENT, "value length %lu over the limit of %lu",
                  (unsigned long)req->vlen, (unsigned long)DTR_STORE_MAX_VALUE);
        return 0;
    }
    if (req->op == DTR__RDZV_ADD && req->vlen != 8) {
        dtr__errf(why, whylen, DTR_INVALID_ARGUMENT, "add carries %lu bytes, not 8", (unsigned long)req->vlen);
        return 0;
    }
    if ((req->op == DTR__RDZV_GET || req->op == DTR__RDZV_CHECK || req->op == DTR__RDZV_DEL) && req->vlen != 0) {
        dtr__errf(why, whylen, DTR_INVALID_ARGUMENT, "op %d carries a value of %lu bytes", req->op,
                  (unsigned long)req->vlen);
        return 0;
    }
    return 1;
}

/* Answers every connection parked on key e. */
static void dtr__rdzv_wake(dtr__rdzv_server *s, const dtr__rdzv_entry *e) {
    int i;
    for (i = 0; i < s->nconns; i++) {
        dtr__rdzv_conn *w = s->conns[i];
        if (w->waiting && w->state == DTR__RDZV_C_READY && w->wait_klen == e->klen &&
            memcmp(w->wait_key, dtr__rdzv_entry_key(e), e->klen) == 0) {
            w->waiting = 0;
            dtr__rdzv_reply(s, w, DTR__RDZV_OK, w->wait_id, e->val, e->vlen);
        }
    }
}

/* One complete request: header + key + value in m. */
static void dtr__rdzv_handle_request(dtr__rdzv_server *s, dtr__rdzv_conn *c, const dtr__rdzv_req *q, const uint8_t *m) {
    const uint8_t *key = m + DTR__RDZV_HDR, *val = key + q->klen;
    dtr__rdzv_entry *e;
    char shown[80];
    int full = 0;
    if (memchr(key, 0, q->klen)) {
        dtr__rdzv_refuse(s, c, DTR_LOG_WARN, "malformed request: key contains a NUL byte");
        return;
    }
    c->waiting = 0;   /* a new request means the client gave up on a parked GET */
    switch (q->op) {
    case DTR__RDZV_SET:
        e = dtr__rdzv_table_set(s, key, q->klen, val, q->vlen, &full);
        if (!e) {
            dtr__rdzv_log(&s->cfg, DTR_LOG_WARN, "rendezvous server: set '%s' by rank %ld refused: %s",
                          dtr__rdzv_show_key(key, q->klen, shown, sizeof shown), (long)c->rank,
                          full ? "store full (max_keys or max_bytes)" : "out of memory");
            dtr__rdzv_reply(s, c, DTR__RDZV_FULL, q->id, NULL, 0);
            return;
        }
        dtr__rdzv_reply(s, c, DTR__RDZV_OK, q->id, NULL, 0);
        dtr__rdzv_wake(s, e);
        return;
    case DTR__RDZV_GET:
    case DTR__RDZV_CHECK:
        e = *dtr__rdzv_find(s, key, q->klen, dtr__rdzv_hash(key, q->klen));
        if (e) dtr__rdzv_reply(s, c, DTR__RDZV_OK, q->id, e->val, e->vlen);
        else if (q->op == DTR__RDZV_CHECK) dtr__rdzv_reply(s, c, DTR__RDZV_NOT_FOUND, q->id, NULL, 0);
        else {
            c->waiting = 1;
            c->wait_id = q->id;
            c->wait_klen = q->klen;
            memcpy(c->wait_key, key, q->klen);
        }
        return;
    case DTR__RDZV_ADD: {
        int64_t cur = 0, delta = (int64_t)dtr__rdzv_get64(val), sum;
        char text[24];
        uint8_t out[8];
        e = *dtr__rdzv_find(s, key, q->klen, dtr__rdzv_hash(key, q->klen));
        if (e && !dtr__rdzv_parse_counter(e->val, e->vlen, &cur)) {
            dtr__rdzv_reply(s, c, DTR__RDZV_NOT_INTEGER, q->id, NULL, 0);
            return;
        }
        if ((delta > 0 && cur > INT64_MAX - delta) || (delta < 0 && cur < INT64_MIN - delta)) {
            dtr__rdzv_reply(s, c, DTR__RDZV_NOT_INTEGER, q->id, NULL, 0);
            return;
        }
        sum = cur + delta;
        snprintf(text, sizeof text, "%lld", (long long)sum);
        e = dtr__rdzv_table_set(s, key, q->klen, (const uint8_t *)text, (uint32_t)strlen(text), &full);
        if (!e) {
            dtr__rdzv_reply(s, c, DTR__RDZV_FULL, q->id, NULL, 0);
            return;
        }
        dtr__rdzv_put64(out, (uint64_t)sum);
        dtr__rdzv_reply(s, c, DTR__RDZV_OK, q->id, out, 8);
        dtr__rdzv_wake(s, e);
        return;
    }
    case DTR__RDZV_DEL:
        dtr__rdzv_table_del(s, key, q->klen);
        dtr__rdzv_reply(s, c, DTR__RDZV_OK, q->id, NULL, 0);
        return;
    }
}

size_t dtr__rdzv_conn_want(const dtr__rdzv_conn *c) {
    if (c->state == DTR__RDZV_C_CLOSING) return 0;
    if (c->state == DTR__RDZV_C_AUTH) return DTR__RDZV_AUTH_LEN - c->in_len;
    if (c->frame_len) return c->frame_len - c->in_len;
    return DTR__RDZV_HDR - c->in_len;
}

/* Takes n bytes received from the connection. Complete messages are handled as they come;
 * replies go to c->out. A connection that breaks a rule turns DTR__RDZV_C_CLOSING (reason
 * logged) and takes no more input. The buffer never holds more than one message. */
void dtr__rdzv_conn_feed(dtr__rdzv_server *s, dtr__rdzv_conn *c, const uint8_t *p, size_t n) {
    for (;;) {
        size_t need, take;
        if (c->state == DTR__RDZV_C_CLOSING) return;
        if (c->state == DTR__RDZV_C_AUTH) need = DTR__RDZV_AUTH_LEN;
        else need = c->frame_len ? c->frame_len : DTR__RDZV_HDR;
        if (c->in_len == need) {
            if (c->state == DTR__RDZV_C_AUTH) {
                dtr__rdzv_handle_auth(s, c, c->in);
                c->in_len = 0;
            } else if (!c->frame_len) {
                dtr__rdzv_req q;
                char why[160];
                if (!dtr__rdzv_parse_header(c->in, &q, why, sizeof why)) {
                    dtr__rdzv_refuse(s, c, DTR_LOG_WARN, "malformed request: %s", why);
                    return;
                }
                c->frame_len = DTR__RDZV_HDR + (size_t)q.klen + q.vlen;
            } else {
                dtr__rdzv_req q;
                char why[160];
                (void)dtr__rdzv_parse_header(c->in, &q, why, sizeof why);
                dtr__rdzv_handle_request(s, c, &q, c->in);
                c->in_len = 0;
                c->frame_len = 0;
                if (c->in_cap > 65536) {   /* do not keep a large buffer for an idle connection */
                    dtr__rdzv_free(&s->cfg, c->in);
                    c->in = NULL;
                    c->in_cap = 0;
                }
            }
            continue;
        }
        if (n == 0) return;
        if (c->in_cap < need) {
            uint8_t *b = (uint8_t *)dtr__realloc(&s->cfg.alloc, c->in, need);
            if (!b) {
                dtr__rdzv_refuse(s, c, DTR_LOG_ERROR, "out of memory for a message of %lu bytes", (unsigned long)need);
                return;
            }
            c->in = b;
            c->in_cap = need;
        }
        take = need - c->in_len;
        if (take > n) take = n;
        memcpy(c->in + c->in_len, p, take);
        c->in_len += take;
        p += take;
        n -= take;
    }
}


#ifdef __cplusplus
}
#endif

#endif /* !_WIN32 */
#line 15532 "dtrain.h"

/* ---- src/rendezvous/server.c ---- */
#line 1 "src/rendezvous/server.c"
/* ============================================================================
 * Rendezvous, part 3 of 4: sockets (addresses, listening, non-blocking I/O) and rank 0's
 * server thread: one poll() loop over the listening sockets, a wake-up pipe and every
 * connection, feeding the server logic of wire.c.
 * ==========================================================================*/




#if !defined(_WIN32)
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <pthread.h>
#include <unistd.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/types.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ======================================================================
 * Sockets: addresses, the server thread, the client.
 * ====================================================================*/

typedef struct dtr__rdzv_addr {
    struct sockaddr_storage ss;
    socklen_t len;
} dtr__rdzv_addr;

#define DTR__RDZV_MAX_ADDRS 8

/* "host:port" or "[v6]:port" of a socket address. */
static void dtr__rdzv_addr_str(const struct sockaddr *sa, char *buf, size_t cap) {
    char host[48];   /* INET6_ADDRSTRLEN is 46 */
    if (sa->sa_family == AF_INET) {
        const struct sockaddr_in *a = (const struct sockaddr_in *)(const void *)sa;
        if (!inet_ntop(AF_INET, &a->sin_addr, host, sizeof host)) snprintf(host, sizeof host, "?");
        snprintf(buf, cap, "%s:%u", host, (unsigned)ntohs(a->sin_port));
    } else if (sa->sa_family == AF_INET6) {
        const struct sockaddr_in6 *a = (const struct sockaddr_in6 *)(const void *)sa;
        if (!inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof host)) snprintf(host, sizeof host, "?");
        snprintf(buf, cap, "[%s]:%u", host, (unsigned)ntohs(a->sin6_port));
    } else {
        snprintf(buf, cap, "(family %d)", (int)sa->sa_family);
    }
}

static int dtr__rdzv_is_loopback(const dtr__rdzv_addr *a) {
    if (a->ss.ss_family == AF_INET) {
        const struct sockaddr_in *s4 = (const struct sockaddr_in *)(const void *)&a->ss;
        return (ntohl(s4->sin_addr.s_addr) >> 24) == 127;
    }
    if (a->ss.ss_family == AF_INET6) {
        const struct sockaddr_in6 *s6 = (const struct sockaddr_in6 *)(const void *)&a->ss;
        return IN6_IS_ADDR_LOOPBACK(&s6->sin6_addr);
    }
    return 0;
}

static void dtr__rdzv_set_port(dtr__rdzv_addr *a, int port) {
    if (a->ss.ss_family == AF_INET) ((struct sockaddr_in *)(void *)&a->ss)->sin_port = htons((uint16_t)port);
    else if (a->ss.ss_family == AF_INET6) ((struct sockaddr_in6 *)(void *)&a->ss)->sin6_port = htons((uint16_t)port);
}

/* Resolves host (a name, an IPv4 or an IPv6 address, "[v6]" allowed) for TCP to `port`.
 * Returns the number of addresses (>= 1), or 0 with the reason in why; *retry is 1 when the
 * failure may be temporary. */
static int dtr__rdzv_resolve(const char *host_in, int port, dtr__rdzv_addr *out, int max, char *why, size_t whylen,
                             int *retry) {
    char host[DTR_RDZV_STR];
    size_t n = strlen(host_in);
    int count = 0;
    *retry = 0;
    if (n >= 2 && host_in[0] == '[' && host_in[n - 1] == ']') {
        memcpy(host, host_in + 1, n - 2);
        host[n - 2] = '\0';
    } else {
        snprintf(host, sizeof host, "%s", host_in);
    }
    if (!host[0]) {
        dtr__errf(why, whylen, DTR_INVALID_ARGUMENT, "empty master address");
        return 0;
    }
#ifdef AI_PASSIVE
    {
        struct addrinfo hints, *res = NULL, *ai;
        char portstr[16];
        int rc;
        memset(&hints, 0, sizeof hints);
        hints.ai_family = AF_UNSPEC;
        hints.ai_socktype = SOCK_STREAM;
        snprintf(portstr, sizeof portstr, "%d", port);
        rc = getaddrinfo(host, portstr, &hints, &res);
        if (rc != 0) {
            *retry = rc == EAI_AGAIN;
            dtr__errf(why, whylen, DTR_IO_ERROR, "cannot resolve '%s': %s", host, gai_strerror(rc));
            return 0;
        }
        for (ai = res; ai && count < max; ai = ai->ai_next) {
            if ((ai->ai_family != AF_INET && ai->ai_family != AF_INET6) || ai->ai_addrlen > sizeof out[0].ss) continue;
            memset(&out[count], 0, sizeof out[count]);
            memcpy(&out[count].ss, ai->ai_addr, ai->ai_addrlen);
            out[count].len = (socklen_t)ai->ai_addrlen;
            count++;
        }
        freeaddrinfo(res);
    }
#else
    {
        struct sockaddr_in s4;
        struct sockaddr_in6 s6;
        memset(&s4, 0, sizeof s4);
        memset(&s6, 0, sizeof s6);
        if (inet_pton(AF_INET, host, &s4.sin_addr) == 1) {
            s4.sin_family = AF_INET;
            memset(&out[0], 0, sizeof out[0]);
            memcpy(&out[0].ss, &s4, sizeof s4);
            out[0].len = (socklen_t)sizeof s4;
            count = 1;
        } else if (inet_pton(AF_INET6, host, &s6.sin6_addr) == 1) {
            s6.sin6_family = AF_INET6;
            memset(&out[0], 0, sizeof out[0]);
            memcpy(&out[0].ss, &s6, sizeof s6);
            out[0].len = (socklen_t)sizeof s6;
            count = 1;
        } else {
            /* gethostbyname is not reentrant: one caller at a time, results copied out. */
            static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
            struct hostent *he;
            pthread_mutex_lock(&lock);
            he = gethostbyname(host);
            if (he && he->h_addrtype == AF_INET && he->h_length == 4) {
                int i;
                for (i = 0; he->h_addr_list[i] && count < max; i++) {
                    memset(&s4, 0, sizeof s4);
                    s4.sin_family = AF_INET;
                    memcpy(&s4.sin_addr, he->h_addr_list[i], 4);
                    memset(&out[count], 0, sizeof out[count]);
                    memcpy(&out[count].ss, &s4, sizeof s4);
                    out[count].len = (socklen_t)sizeof s4;
                    count++;
                }
            } else {
                *retry = h_errno == TRY_AGAIN;
            }
            pthread_mutex_unlock(&lock);
            if (!count) {
                dtr__errf(why, whylen, DTR_IO_ERROR,
                          "cannot resolve '%s' (IPv4 names only: this build has no getaddrinfo; use an address)",
                          host);
                return 0;
            }
        }
    }
#endif
    if (!count) {
        dtr__errf(why, whylen, DTR_IO_ERROR, "'%s' has no IPv4 or IPv6 address", host);
        return 0;
    }
    {
        int i;
        for (i = 0; i < count; i++) dtr__rdzv_set_port(&out[i], port);
    }
    return count;
}

static int dtr__rdzv_nonblock(int fd) {
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0 || fcntl(fd, F_SETFL, fl | O_NONBLOCK) < 0) return 0;
    (void)fcntl(fd, F_SETFD, FD_CLOEXEC);
    return 1;
}

static void dtr__rdzv_sockopts(int fd) {
    int one = 1;
    (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, (socklen_t)sizeof one);
#ifdef SO_NOSIGPIPE
    (void)setsockopt(fd, SOL_SOCKET, SO_NOSIGPIPE, &one, (socklen_t)sizeof one);
#endif
}

/* ---- the server thread (rank 0) ---- */

#define DTR__RDZV_MAX_LISTEN 4

typedef struct dtr__rdzv_host {
    dtr__rdzv_server core;
    int lfd[DTR__RDZV_MAX_LISTEN];
    int nlfd;
    int wake[2];                 /* write 'q' to stop now, 'd' to stop once no rank is connected */
    int64_t drain_deadline;      /* set before 'd' is written */
    pthread_t thread;
    int started;
    int port;
    struct pollfd *pfd;
    dtr__rdzv_conn **pconn;
    int pcap;
} dtr__rdzv_host;

static int dtr__rdzv_host_grow(dtr__rdzv_host *h, int n) {
    struct pollfd *p;
    dtr__rdzv_conn **c;
    int cap;
    if (n <= h->pcap) return 1;
    cap = h->pcap ? h->pcap : 32;
    while (cap < n) cap *= 2;
    p = (struct pollfd *)dtr__realloc(&h->core.cfg.alloc, h->pfd, (size_t)cap * sizeof *p);
    if (!p) return 0;
    h->pfd = p;
    c = (dtr__rdzv_conn **)dtr__realloc(&h->core.cfg.alloc, h->pconn, (size_t)cap * sizeof *c);
    if (!c) return 0;
    h->pconn = c;
    h->pcap = cap;
    return 1;
}

static void dtr__rdzv_accept(dtr__rdzv_host *h, int lfd) {
    dtr__rdzv_server *s = &h->core;
    int k;
    for (k = 0; k < 64; k++) {
        struct sockaddr_storage ss;
        socklen_t sl = (socklen_t)sizeof ss;
        char peer[64];
        dtr__rdzv_conn *c;
        int fd = accept(lfd, (struct sockaddr *)(void *)&ss, &sl);
        if (fd < 0) {
            if (errno == EINTR || errno == ECONNABORTED) continue;
            if (errno != EAGAIN && errno != EWOULDBLOCK)
                dtr__rdzv_log(&s->cfg, DTR_LOG_WARN, "rendezvous server: accept failed: %s", strerror(errno));
            return;
        }
        dtr__rdzv_addr_str((const struct sockaddr *)(const void *)&ss, peer, sizeof peer);
        if (!dtr__rdzv_nonblock(fd)) {
            close(fd);
            continue;
        }
        dtr__rdzv_sockopts(fd);
        c = dtr__rdzv_conn_open(s, fd, peer);
        if (!c) {
            s->refused++;
            dtr__rdzv_log(&s->cfg, DTR_LOG_WARN, "rendezvous server: refused %s: %d connections open (max_connections %d)",
                          peer, s->nconns, s->cfg.max_connections);
            close(fd);
            continue;
        }
        c->deadline_ms = dtr__rdzv_now_ms() + (s->cfg.timeout_ms < 30000 ? s->cfg.timeout_ms : 30000);
        dtr__rdzv_log(&s->cfg, DTR_LOG_DEBUG, "rendezvous server: connection from %s", peer);
    }
}

/* Sends what is queued; 0 when the connection is gone. */
static int dtr__rdzv_flush(dtr__rdzv_conn *c) {
    while (c->out_pos < c->out_len) {
        ssize_t k = send(c->fd, c->out + c->out_pos, c->out_len - c->out_pos, DTR__RDZV_NOSIGNAL);
        if (k > 0) c->out_pos += (size_t)k;
        else if (k < 0 && errno == EINTR) continue;
        else if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return 1;
        else return 0;
    }
    return 1;
}

static void *dtr__rdzv_thread(void *arg) {
    dtr__rdzv_host *h = (dtr__rdzv_host *)arg;
    dtr__rdzv_server *s = &h->core;
    uint8_t buf[16384];
    int draining = 0;
    for (;;) {
        int n = 0, i, nfixed, timeout = -1, rc, ready = 0;
        int64_t now = dtr__rdzv_now_ms();
        if (!dtr__rdzv_host_grow(h, 1 + h->nlfd + s->nconns)) {
            dtr__rdzv_sleep_ms(10);   /* out of memory for the poll set: try again shortly */
            continue;
        }
        h->pfd[n].fd = h->wake[0];
        h->pfd[n].events = POLLIN;
        h->pconn[n++] = NULL;
        for (i = 0; i < h->nlfd; i++) {
            h->pfd[n].fd = h->lfd[i];
            h->pfd[n].events = POLLIN;
            h->pconn[n++] = NULL;
        }
        nfixed = n;
        for (i = 0; i < s->nconns; i++) {
            dtr__rdzv_conn *c = s->conns[i];
            short ev = 0;
            if (c->out_pos < c->out_len) ev |= POLLOUT;
            else if (c->state != DTR__RDZV_C_CLOSING) ev |= POLLIN;
            if (c->state == DTR__RDZV_C_READY) ready++;
            if (c->state == DTR__RDZV_C_AUTH) {
                int64_t left = c->deadline_ms - now;
                int t = left <= 0 ? 0 : (left > INT_MAX ? INT_MAX : (int)left);
                if (timeout < 0 || t < timeout) timeout = t;
            }
            h->pfd[n].fd = c->fd;
            h->pfd[n].events = ev;
            h->pconn[n++] = c;
        }
        if (draining) {
            int t = dtr__rdzv_left_ms(h->drain_deadline);
            if (ready == 0 || t == 0) break;
            if (timeout < 0 || t < timeout) timeout = t;
        }
        rc = poll(h->pfd, (nfds_t)n, timeout);
        if (rc < 0) {
            if (errno == EINTR) continue;
            dtr__rdzv_log(&s->cfg, DTR_LOG_ERROR, "rendezvous server: poll failed: %s", strerror(errno));
            dtr__rdzv_sleep_ms(10);
            continue;
        }
        if (h->pfd[0].revents) {
            char cmd[16];
            ssize_t k = read(h->wake[0], cmd, sizeof cmd), j;
            for (j = 0; j < k; j++) {
                if (cmd[j] == 'q') return NULL;
                if (cmd[j] == 'd' && !draining) {
                    /* no new joins once the store is being destroyed: the port is free at once
                       for the next store, and a rank that opens that one cannot reach this
                       server, which only waits for its connected ranks to leave */
                    int l;
                    for (l = 0; l < h->nlfd; l++) close(h->lfd[l]);
                    h->nlfd = 0;
                    draining = 1;
                }
            }
        }
        for (i = 1; i < nfixed && !draining; i++)
            if (h->pfd[i].revents & POLLIN) dtr__rdzv_accept(h, h->pfd[i].fd);
        now = dtr__rdzv_now_ms();
        for (i = nfixed; i < n; i++) {
            dtr__rdzv_conn *c = h->pconn[i];
            short re = h->pfd[i].revents;
            int gone = 0;
            if (re & POLLNVAL) gone = 1;
            if (!gone && (re & (POLLOUT | POLLHUP | POLLERR)) && c->out_pos < c->out_len && !dtr__rdzv_flush(c))
                gone = 1;
            if (!gone && (re & (POLLHUP | POLLERR)) && !(h->pfd[i].events & POLLIN) && c->out_pos < c->out_len)
                gone = 1;   /* cannot be written and is not read: nothing more to do with it */
            if (!gone && (re & (POLLIN | POLLHUP | POLLERR)) && (h->pfd[i].events & POLLIN)) {
                size_t want = dtr__rdzv_conn_want(c);
                ssize_t k;
                if (want > sizeof buf) want = sizeof buf;
                if (want == 0) want = 1;   /* closing: only notice the peer's end */
                k = recv(c->fd, buf, want, 0);
                if (k > 0) {
                    if (c->state != DTR__RDZV_C_CLOSING) dtr__rdzv_conn_feed(s, c, buf, (size_t)k);
                } else if (k == 0 || (errno != EINTR && errno != EAGAIN && errno != EWOULDBLOCK)) {
                    if (c->state == DTR__RDZV_C_AUTH && c->in_len > 0) {
                        s->refused++;
                        dtr__rdzv_log(&s->cfg, DTR_LOG_WARN,
                                      "rendezvous server: refused %s: closed after %lu bytes of an incomplete join message",
                                      c->peer, (unsigned long)c->in_len);
                    } else if (c->state == DTR__RDZV_C_READY) {
                        dtr__rdzv_log(&s->cfg, DTR_LOG_DEBUG, "rendezvous server: rank %ld (%s) disconnected",
                                      (long)c->rank, c->peer);
                    }
                    gone = 1;
                }
            }
            if (!gone && c->state == DTR__RDZV_C_AUTH && now >= c->deadline_ms) {
                dtr__rdzv_refuse(s, c, DTR_LOG_WARN, "no valid join message within %d ms (%lu bytes received)",
                                 s->cfg.timeout_ms < 30000 ? s->cfg.timeout_ms : 30000, (unsigned long)c->in_len);
                gone = 1;
            }
            if (!gone && c->state == DTR__RDZV_C_CLOSING) {
                if (c->out_pos < c->out_len) (void)dtr__rdzv_flush(c);   /* best effort: the refusal */
                gone = 1;
            }
            if (gone) dtr__rdzv_conn_close(s, c);
        }
        /* Replies queued on other connections (woken waiters) go out on the next round. */
    }
    return NULL;
}

static void dtr__rdzv_host_free(dtr__rdzv_host *h) {
    int i;
    for (i = 0; i < h->nlfd; i++) close(h->lfd[i]);
    if (h->wake[0] >= 0) close(h->wake[0]);
    if (h->wake[1] >= 0) close(h->wake[1]);
    dtr__rdzv_free(&h->core.cfg, h->pfd);
    dtr__rdzv_free(&h->core.cfg, h->pconn);
    {
        dtr_allocation_callbacks a = h->core.cfg.alloc;
        dtr__rdzv_server_free(&h->core);
        dtr__free(&a, h);
    }
}

static void dtr__rdzv_host_stop(dtr__rdzv_host *h, char cmd, int64_t deadline) {
    if (h->started) {
        h->drain_deadline = deadline;
        while (write(h->wake[1], &cmd, 1) < 0 && errno == EINTR) {
        }
        pthread_join(h->thread, NULL);
        h->started = 0;
    }
    dtr__rdzv_host_free(h);
}

/* Binds and listens: on each loopback address of master_addr when all its addresses are
 * loopback, else on the IPv6 wildcard (dual stack) or, without IPv6, the IPv4 wildcard. */
static dtr_result dtr__rdzv_host_start(const dtr_rendezvous_config *cfg, dtr__rdzv_host **out, int *port_out,
                                       char *err, size_t errlen) {
    dtr__rdzv_addr addrs[DTR__RDZV_MAX_ADDRS], bind_to[DTR__RDZV_MAX_LISTEN];
    char why[300];
    int n, nb = 0, i, retry, all_loop = 1, port = cfg->port, last_errno = 0;
    dtr__rdzv_host *h;
    dtr_result r;
    *out = NULL;
    n = dtr__rdzv_resolve(cfg->master_addr, port, addrs, DTR__RDZV_MAX_ADDRS, why, sizeof why, &retry);
    if (n == 0)
        return dtr__errf(err, errlen, DTR_IO_ERROR, "rendezvous rank 0: master address: %s", why);
    for (i = 0; i < n; i++) all_loop &= dtr__rdzv_is_loopback(&addrs[i]);
    if (all_loop) {
        for (i = 0; i < n && nb < DTR__RDZV_MAX_LISTEN; i++) {
            int j, dup = 0;
            for (j = 0; j < nb; j++)
                if (bind_to[j].len == addrs[i].len && memcmp(&bind_to[j].ss, &addrs[i].ss, addrs[i].len) == 0) dup = 1;
            if (!dup) bind_to[nb++] = addrs[i];
        }
    } else {
        struct sockaddr_in6 s6;
        struct sockaddr_in s4;
        memset(&s6, 0, sizeof s6);
        s6.sin6_family = AF_INET6;
        s6.sin6_addr = in6addr_any;
        memset(&bind_to[0], 0, sizeof bind_to[0]);
        memcpy(&bind_to[0].ss, &s6, sizeof s6);
        bind_to[0].len = (socklen_t)sizeof s6;
        memset(&s4, 0, sizeof s4);
        s4.sin_family = AF_INET;
        s4.sin_addr.s_addr = htonl(INADDR_ANY);
        memset(&bind_to[1], 0, sizeof bind_to[1]);
        memcpy(&bind_to[1].ss, &s4, sizeof s4);
        bind_to[1].len = (socklen_t)sizeof s4;
        nb = 2;   /* the second only when the first fails */
    }
    h = (dtr__rdzv_host *)dtr__calloc(&cfg->alloc, sizeof *h);
    if (!h) return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "rendezvous rank 0: out of memory");
    h->wake[0] = h->wake[1] = -1;
    if ((r = dtr__rdzv_server_init(&h->core, cfg)) != DTR_OK) {
        dtr__rdzv_host_free(h);
        return dtr__errf(err, errlen, r, "rendezvous rank 0: out of memory");
    }
    for (i = 0; i < nb; i++) {
        int fd, one = 1;
        dtr__rdzv_addr a = bind_to[i];
        if (!all_loop && h->nlfd > 0) break;   /* wildcard: the IPv6 socket took IPv4 too */
        dtr__rdzv_set_port(&a, port);
        fd = socket(a.ss.ss_family, SOCK_STREAM, 0);
        if (fd < 0) {
            last_errno = errno;
            continue;
        }
        (void)setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, (socklen_t)sizeof one);
        if (a.ss.ss_family == AF_INET6) {
            int v6only = all_loop ? 1 : 0;
            (void)setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &v6only, (socklen_t)sizeof v6only);
        }
        if (bind(fd, (struct sockaddr *)(void *)&a.ss, a.len) != 0 || listen(fd, SOMAXCONN) != 0 ||
            !dtr__rdzv_nonblock(fd)) {
            last_errno = errno;
            close(fd);
            if (all_loop && h->nlfd == 0 && i == 0 && last_errno == EADDRINUSE) break;
            continue;
        }
        if (port == 0) {   /* the port the kernel chose: the other sockets take the same one */
            struct sockaddr_storage ss;
            socklen_t sl = (socklen_t)sizeof ss;
            if (getsockname(fd, (struct sockaddr *)(void *)&ss, &sl) == 0) {
                if (ss.ss_family == AF_INET) port = ntohs(((struct sockaddr_in *)(void *)&ss)->sin_port);
                else if (ss.ss_family == AF_INET6) port = ntohs(((struct sockaddr_in6 *)(void *)&ss)->sin6_port);
            }
        }
        h->lfd[h->nlfd++] = fd;
    }
    if (h->nlfd == 0) {
        dtr__rdzv_host_free(h);
        return dtr__errf(err, errlen, DTR_IO_ERROR, "rendezvous rank 0: cannot listen on %s port %d: %s%s",
                         all_loop ? cfg->master_addr : "every interface", cfg->port, strerror(last_errno),
                         last_errno == EADDRINUSE ? " (another job on this port? choose another DTR_MASTER_PORT)" : "");
    }
    if (pipe(h->wake) != 0) {
        h->wake[0] = h->wake[1] = -1;
        dtr__rdzv_host_free(h);
        return dtr__errf(err, errlen, DTR_IO_ERROR, "rendezvous rank 0: pipe: %s", strerror(errno));
    }
    (void)fcntl(h->wake[0], F_SETFD, FD_CLOEXEC);
    (void)fcntl(h->wake[1], F_SETFD, FD_CLOEXEC);
    h->port = port;
    if (pthread_create(&h->thread, NULL, dtr__rdzv_thread, h) != 0) {
        dtr__rdzv_host_free(h);
        return dtr__errf(err, errlen, DTR_IO_ERROR, "rendezvous rank 0: cannot start the server thread");
    }
    h->started = 1;
    *port_out = port;
    *out = h;
    return DTR_OK;
}


#ifdef __cplusplus
}
#endif

#endif /* !_WIN32 */
#line 16049 "dtrain.h"

/* ---- src/rendezvous/client.c ---- */
#line 1 "src/rendezvous/client.c"
/* ============================================================================
 * Rendezvous, part 4 of 4: the store's client, which every rank (rank 0 included) uses with
 * one blocking-with-deadline connection, and dtr_store_create, which starts rank 0's server
 * (server.c) first. On Windows the store reports DTR_UNSUPPORTED.
 * ==========================================================================*/




#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)

/* ---- Windows: not supported yet ---- */

struct dtr_store {
    int unused;
};

dtr_result dtr_store_create(const dtr_rendezvous_config *cfg, dtr_store **out, char *err, size_t errlen) {
    (void)cfg;
    if (out) *out = NULL;
    return dtr__errf(err, errlen, DTR_UNSUPPORTED, "rendezvous: the TCP store needs POSIX sockets (not on Windows yet)");
}
void dtr_store_destroy(dtr_store *st) { (void)st; }
dtr_result dtr_store_set(dtr_store *st, const char *key, const void *value, size_t len) {
    (void)st; (void)key; (void)value; (void)len;
    return DTR_UNSUPPORTED;
}
dtr_result dtr_store_get(dtr_store *st, const char *key, void *buf, size_t cap, size_t *len) {
    (void)st; (void)key; (void)buf; (void)cap; (void)len;
    return DTR_UNSUPPORTED;
}
dtr_result dtr_store_check(dtr_store *st, const char *key, void *buf, size_t cap, size_t *len, int *found) {
    (void)st; (void)key; (void)buf; (void)cap; (void)len; (void)found;
    return DTR_UNSUPPORTED;
}
dtr_result dtr_store_add(dtr_store *st, const char *key, int64_t delta, int64_t *result) {
    (void)st; (void)key; (void)delta; (void)result;
    return DTR_UNSUPPORTED;
}
dtr_result dtr_store_delete(dtr_store *st, const char *key) {
    (void)st; (void)key;
    return DTR_UNSUPPORTED;
}
dtr_result dtr_store_barrier(dtr_store *st, const char *tag) {
    (void)st; (void)tag;
    return DTR_UNSUPPORTED;
}
dtr_result dtr__store_clone(const dtr_store *st, int timeout_ms, dtr_store **out, char *err, size_t errlen) {
    (void)st; (void)timeout_ms;
    if (out) *out = NULL;
    return dtr__errf(err, errlen, DTR_UNSUPPORTED, "rendezvous: the TCP store needs POSIX sockets (not on Windows yet)");
}
void dtr__store_set_timeout(dtr_store *st, int timeout_ms) { (void)st; (void)timeout_ms; }
const char *dtr_store_last_error(const dtr_store *st) { (void)st; return "rendezvous: not supported on Windows"; }
int32_t dtr_store_rank(const dtr_store *st) { (void)st; return -1; }
int32_t dtr_store_world_size(const dtr_store *st) { (void)st; return 0; }
int dtr_store_port(const dtr_store *st) { (void)st; return 0; }

#else /* POSIX */

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <pthread.h>
#include <unistd.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/types.h>

/* ---- the client ---- */

struct dtr_store {
    dtr_rendezvous_config cfg;
    int fd;
    dtr_result broken;           /* DTR_OK while the connection is usable */
    char broken_msg[256];
    uint32_t next_id;
    int64_t barriers;            /* barriers passed */
    int port;
    char where[DTR_RDZV_STR + 16];   /* "host:port" of the server */
    pthread_mutex_t lock;
    dtr__rdzv_host *host;        /* rank 0: the server */
    char err[768];
};

/* Sends all n bytes before the deadline. DTR_TIMEOUT or DTR_PEER_FAILED (errno in *e). */
static dtr_result dtr__rdzv_send_all(int fd, const void *buf, size_t n, int64_t deadline, int *e) {
    const uint8_t *p = (const uint8_t *)buf;
    *e = 0;
    while (n > 0) {
        ssize_t k = send(fd, p, n, DTR__RDZV_NOSIGNAL);
        if (k > 0) {
            p += k;
            n -= (size_t)k;
            continue;
        }
        if (k < 0 && errno == EINTR) continue;
        if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            struct pollfd pf;
            int left = dtr__rdzv_left_ms(deadline), rc;
            if (left == 0) return DTR_TIMEOUT;
            pf.fd = fd;
            pf.events = POLLOUT;
            pf.revents = 0;
            rc = poll(&pf, 1, left);
            if (rc < 0 && errno != EINTR) {
                *e = errno;
                return DTR_PEER_FAILED;
            }
            continue;
        }
        *e = k < 0 ? errno : 0;
        return DTR_PEER_FAILED;
    }
    return DTR_OK;
}

/* Receives exactly n bytes before the deadline; *got counts what arrived. DTR_PEER_FAILED
 * with *e == 0 means the peer closed the connection. */
static dtr_result dtr__rdzv_recv_all(int fd, void *buf, size_t n, int64_t deadline, size_t *got, int *e) {
    uint8_t *p = (uint8_t *)buf;
    *got = 0;
    *e = 0;
    while (*got < n) {
        ssize_t k = recv(fd, p + *got, n - *got, 0);
        if (k > 0) {
            *got += (size_t)k;
            continue;
        }
        if (k == 0) return DTR_PEER_FAILED;
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
            struct pollfd pf;
            int left = dtr__rdzv_left_ms(deadline), rc;
            if (left == 0) return DTR_TIMEOUT;
            pf.fd = fd;
            pf.events = POLLIN;
            pf.revents = 0;
            rc = poll(&pf, 1, left);
            if (rc < 0 && errno != EINTR) {
                *e = errno;
                return DTR_PEER_FAILED;
            }
            continue;
        }
        *e = errno;
        return DTR_PEER_FAILED;
    }
    return DTR_OK;
}

static const char *dtr__rdzv_errno_str(int e) { return e ? strerror(e) : "connection closed by the server"; }

/* Records the store's message (and logs it at ERROR); returns code. */
static dtr_result dtr__rdzv_fail(dtr_store *st, dtr_result code, const char *fmt, ...) DTR__PRINTF(3, 4);
static dtr_result dtr__rdzv_fail(dtr_store *st, dtr_result code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(st->err, sizeof st->err, fmt, ap);
    va_end(ap);
    dtr__rdzv_log(&st->cfg, DTR_LOG_ERROR, "%s", st->err);
    return code;
}

/* Connect (non-blocking, bounded by the deadline) and run the client side of the handshake.
 * Returns DTR_OK, or the error with the reason in why; *fatal says whether retrying is
 * pointless (refused secret, rank, version). */
static dtr_result dtr__rdzv_join(dtr_store *st, const dtr__rdzv_addr *a, int64_t deadline, int *fd_out, char *why,
                                 size_t whylen, int *fatal) {
    uint8_t hello[DTR__RDZV_HELLO_LEN], auth[DTR__RDZV_AUTH_LEN], wel[DTR__RDZV_WELCOME_LEN], mac[DTR__RDZV_MAC];
    size_t got;
    int fd, e = 0, one = 1;
    uint32_t status;
    dtr_result r;
    int64_t cdl = dtr__rdzv_now_ms() + 5000;   /* one address may be a black hole: try the next */
    *fatal = 0;
    *fd_out = -1;
    if (cdl > deadline) cdl = deadline;
    fd = socket(a->ss.ss_family, SOCK_STREAM, 0);
    if (fd < 0) return dtr__errf(why, whylen, DTR_IO_ERROR, "socket: %s", strerror(errno));
    if (!dtr__rdzv_nonblock(fd)) {
        close(fd);
        return dtr__errf(why, whylen, DTR_IO_ERROR, "fcntl: %s", strerror(errno));
    }
    dtr__rdzv_sockopts(fd);
    (void)setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, (socklen_t)sizeof one);
    if (connect(fd, (const struct sockaddr *)(const void *)&a->ss, a->len) != 0) {
        if (errno != EINPROGRESS && errno != EINTR) {
            e = errno;
            close(fd);
            return dtr__errf(why, whylen, DTR_PEER_FAILED, "connect: %s", strerror(e));
        }
        for (;;) {
            struct pollfd pf;
            int rc, left = dtr__rdzv_left_ms(cdl);
            socklen_t sl = (socklen_t)sizeof e;
            if (left == 0) {
                close(fd);
                return dtr__errf(why, whylen, DTR_TIMEOUT, "connect: no answer");
            }
            pf.fd = fd;
            pf.events = POLLOUT;
            pf.revents = 0;
            rc = poll(&pf, 1, left);
            if (rc < 0 && errno == EINTR) continue;
            if (rc == 0) continue;
            e = 0;
            if (rc < 0 || getsockopt(fd, SOL_SOCKET, SO_ERROR, &e, &sl) != 0) e = errno;
            if (e != 0) {
                close(fd);
                return dtr__errf(why, whylen, DTR_PEER_FAILED, "connect: %s", strerror(e));
            }
            break;
        }
    }
    /* hello */
    r = dtr__rdzv_recv_all(fd, hello, sizeof hello, deadline, &got, &e);
    if (r != DTR_OK) {
        close(fd);
        return dtr__errf(why, whylen, r, "waiting for the server's greeting: %s",
                         r == DTR_TIMEOUT ? "no answer" : dtr__rdzv_errno_str(e));
    }
    if (memcmp(hello, "DTRZ", 4) != 0) {
        close(fd);
        *fatal = 1;
        return dtr__errf(why, whylen, DTR_PEER_FAILED, "the server is not a dtrain rendezvous server (bad greeting)");
    }
    if (dtr__rdzv_get32(hello + 4) != DTR__RDZV_VERSION) {
        close(fd);
        *fatal = 1;
        return dtr__errf(why, whylen, DTR_VERSION_MISMATCH, "the server speaks protocol version %lu, this rank %u",
                         (unsigned long)dtr__rdzv_get32(hello + 4), DTR__RDZV_VERSION);
    }
    /* auth */
    memcpy(auth, "DTRA", 4);
    dtr__rdzv_put32(auth + 4, DTR__RDZV_VERSION);
    dtr__rdzv_put32(auth + 8, (uint32_t)st->cfg.rank);
    dtr__rdzv_put32(auth + 12, (uint32_t)st->cfg.world_size);
    dtr__rdzv_random(auth + 16, DTR__RDZV_NONCE);
    dtr__rdzv_auth_mac(st->cfg.secret, hello + 8, auth, auth + DTR__RDZV_AUTH_SIGNED);
    r = dtr__rdzv_send_all(fd, auth, sizeof auth, deadline, &e);
    if (r == DTR_OK) r = dtr__rdzv_recv_all(fd, wel, sizeof wel, deadline, &got, &e);
    if (r != DTR_OK) {
        close(fd);
        return dtr__errf(why, whylen, r, "during the handshake: %s",
                         r == DTR_TIMEOUT ? "no answer" : dtr__rdzv_errno_str(e));
    }
    status = dtr__rdzv_get32(wel + 4);
    if (memcmp(wel, "DTRW", 4) != 0 || status > DTR__RDZV_W_BAD_VERSION) {
        close(fd);
        *fatal = 1;
        return dtr__errf(why, whylen, DTR_PEER_FAILED, "malformed answer to the join message");
    }
    if (status != DTR__RDZV_W_OK) {
        close(fd);
        *fatal = 1;
        if (status == DTR__RDZV_W_BAD_SECRET)
            return dtr__errf(why, whylen, DTR_INVALID_ARGUMENT,
                             "the server refused the secret (DTR_SECRET must be the same on every rank)");
        if (status == DTR__RDZV_W_BAD_RANK)
            return dtr__errf(why, whylen, DTR_INVALID_ARGUMENT,
                             "the server refused rank %ld of a world of %ld (rank 0 has another world size)",
                             (long)st->cfg.rank, (long)st->cfg.world_size);
        return dtr__errf(why, whylen, DTR_VERSION_MISMATCH, "the server refused this protocol version");
    }
    dtr__rdzv_welcome_mac(st->cfg.secret, auth + 16, hello + 8, wel, mac);
    if (!dtr__ct_equal(mac, wel + 8, DTR__RDZV_MAC)) {
        close(fd);
        *fatal = 1;
        return dtr__errf(why, whylen, DTR_INVALID_ARGUMENT,
                         "the server did not prove that it knows the secret (a different DTR_SECRET, or not our server)");
    }
    *fd_out = fd;
    return DTR_OK;
}

/* Resolves and joins, retrying until the deadline while the server is not up. */
static dtr_result dtr__rdzv_connect(dtr_store *st, int64_t deadline, char *err, size_t errlen) {
    dtr__rdzv_addr addrs[DTR__RDZV_MAX_ADDRS];
    char why[320];
    int backoff = 10;
    why[0] = '\0';
    for (;;) {
        int retry = 0, n, i, fatal = 0;
        n = dtr__rdzv_resolve(st->cfg.master_addr, st->port, addrs, DTR__RDZV_MAX_ADDRS, why, sizeof why, &retry);
        if (n == 0 && !retry)
            return dtr__errf(err, errlen, DTR_IO_ERROR, "rendezvous rank %ld: master address: %s", (long)st->cfg.rank,
                             why);
        for (i = 0; i < n; i++) {
            int fd;
            char w[320];
            dtr_result r = dtr__rdzv_join(st, &addrs[i], deadline, &fd, w, sizeof w, &fatal);
            if (r == DTR_OK) {
                st->fd = fd;
                return DTR_OK;
            }
            if (fatal)
                return dtr__errf(err, errlen, r, "rendezvous rank %ld: joining the server (rank 0) at %s: %s",
                                 (long)st->cfg.rank, st->where, w);
            if (r != DTR_TIMEOUT || !why[0]) memcpy(why, w, sizeof why);   /* keep the most telling reason */
        }
        if (dtr__rdzv_left_ms(deadline) == 0) break;
        dtr__rdzv_sleep_ms(backoff < dtr__rdzv_left_ms(deadline) ? backoff : dtr__rdzv_left_ms(deadline));
        if (backoff < 500) backoff *= 2;
    }
    return dtr__errf(err, errlen, DTR_TIMEOUT,
                     "rendezvous rank %ld: could not join the server (rank 0) at %s within %d ms: %s "
                     "(is rank 0 running, are DTR_MASTER_ADDR and DTR_MASTER_PORT right?)",
                     (long)st->cfg.rank, st->where, st->cfg.timeout_ms, why[0] ? why : "no answer");
}

static void dtr__rdzv_close_client(dtr_store *st) {
    if (st->fd >= 0) close(st->fd);
    st->fd = -1;
}

dtr_result dtr_store_create(const dtr_rendezvous_config *cfg, dtr_store **out, char *err, size_t errlen) {
    dtr_store *st;
    dtr_result r;
    char msg[768];
    const dtr_allocation_callbacks *a;
    int have;
    if (err && errlen) err[0] = '\0';
    if (out) *out = NULL;
    if (!cfg || !out) return dtr__errf(err, errlen, DTR_NULL_HANDLE, "rendezvous: cfg or out is NULL");
    a = &cfg->alloc;
    have = (a->malloc_fn != NULL) + (a->realloc_fn != NULL) + (a->free_fn != NULL);
    if (have != 0 && have != 3)
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "rendezvous: set all three allocation callbacks or none");
    if (!memchr(cfg->secret, 0, sizeof cfg->secret) || !memchr(cfg->master_addr, 0, sizeof cfg->master_addr))
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "rendezvous: secret or master_addr is not NUL-terminated");
    if (!cfg->secret[0])
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT,
                         "rendezvous: no secret: set DTR_SECRET (the same on every rank) or cfg.secret");
    if (cfg->world_size < 0 || cfg->rank < 0 || cfg->rank >= (cfg->world_size ? cfg->world_size : 1))
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "rendezvous: rank %ld outside [0, world size %ld)",
                         (long)cfg->rank, (long)cfg->world_size);
    if (cfg->port < 0 || cfg->port > 65535 || (cfg->port == 0 && cfg->world_size > 1))
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT,
                         "rendezvous: port %d outside 1..65535 (0 only for a one-process job)", cfg->port);
    if (cfg->timeout_ms < 0 || cfg->max_keys < 0 || cfg->max_connections < 0)
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "rendezvous: negative timeout_ms, max_keys or max_connections");
    st = (dtr_store *)dtr__calloc(a, sizeof *st);
    if (!st) return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "rendezvous: out of memory");
    st->cfg = *cfg;
    if (st->cfg.timeout_ms == 0) st->cfg.timeout_ms = 300000;
    if (!st->cfg.master_addr[0]) memcpy(st->cfg.master_addr, "127.0.0.1", 10);
    if (st->cfg.world_size == 0) st->cfg.world_size = 1;
    st->fd = -1;
    st->port = cfg->port;
    if (pthread_mutex_init(&st->lock, NULL) != 0) {
        dtr__free(a, st);
        return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "rendezvous: cannot make a mutex");
    }
    {
        int64_t deadline = dtr__rdzv_now_ms() + st->cfg.timeout_ms;
        if (st->cfg.rank == 0) {
            r = dtr__rdzv_host_start(&st->cfg, &st->host, &st->port, msg, sizeof msg);
            if (r != DTR_OK) goto fail;
        }
        if (strchr(st->cfg.master_addr, ':') && st->cfg.master_addr[0] != '[')
            snprintf(st->where, sizeof st->where, "[%s]:%d", st->cfg.master_addr, st->port);
        else
            snprintf(st->where, sizeof st->where, "%s:%d", st->cfg.master_addr, st->port);
        r = dtr__rdzv_connect(st, deadline, msg, sizeof msg);
        if (r != DTR_OK) goto fail;
    }
    *out = st;
    return DTR_OK;
fail:
    dtr__rdzv_log(&st->cfg, DTR_LOG_ERROR, "%s", msg);
    dtr__errf(err, errlen, r, "%s", msg);
    if (st->host) dtr__rdzv_host_stop(st->host, 'q', 0);
    pthread_mutex_destroy(&st->lock);
    dtr__free(a, st);
    return r;
}

dtr_result dtr__store_clone(const dtr_store *st, int timeout_ms, dtr_store **out, char *err, size_t errlen) {
    dtr_store *c;
    dtr_result r;
    if (out) *out = NULL;
    if (!st || !out) return dtr__errf(err, errlen, DTR_NULL_HANDLE, "rendezvous: store or out is NULL");
    c = (dtr_store *)dtr__calloc(&st->cfg.alloc, sizeof *c);
    if (!c) return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "rendezvous: out of memory");
    c->cfg = st->cfg;
    if (timeout_ms > 0) c->cfg.timeout_ms = timeout_ms;
    c->fd = -1;
    c->port = st->port;
    memcpy(c->where, st->where, sizeof c->where);
    if (pthread_mutex_init(&c->lock, NULL) != 0) {
        dtr__free(&st->cfg.alloc, c);
        return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "rendezvous: cannot make a mutex");
    }
    r = dtr__rdzv_connect(c, dtr__rdzv_now_ms() + c->cfg.timeout_ms, err, errlen);
    if (r != DTR_OK) {
        pthread_mutex_destroy(&c->lock);
        dtr__free(&st->cfg.alloc, c);
        return r;
    }
    *out = c;
    return DTR_OK;
}

void dtr__store_set_timeout(dtr_store *st, int timeout_ms) {
    if (!st || timeout_ms <= 0) return;
    pthread_mutex_lock(&st->lock);
    st->cfg.timeout_ms = timeout_ms;
    pthread_mutex_unlock(&st->lock);
}

void dtr_store_destroy(dtr_store *st) {
    dtr_allocation_callbacks a;
    if (!st) return;
    dtr__rdzv_close_client(st);
    if (st->host) dtr__rdzv_host_stop(st->host, 'd', dtr__rdzv_now_ms() + st->cfg.timeout_ms);
    pthread_mutex_destroy(&st->lock);
    a = st->cfg.alloc;
    dtr__free(&a, st);
}

/* Checks a key given to the API. */
static dtr_result dtr__rdzv_check_key(dtr_store *st, const char *op, const char *key, size_t *klen) {
    size_t n;
    if (!key) return dtr__rdzv_fail(st, DTR_NULL_HANDLE, "rendezvous rank %ld: store %s: key is NULL", (long)st->cfg.rank, op);
    n = strlen(key);
    if (n < 1 || n > DTR_STORE_MAX_KEY)
        return dtr__rdzv_fail(st, DTR_INVALID_ARGUMENT, "rendezvous rank %ld: store %s: key of %lu bytes (1..%d allowed)",
                              (long)st->cfg.rank, op, (unsigned long)n, DTR_STORE_MAX_KEY);
    *klen = n;
    return DTR_OK;
}

static const char *dtr__rdzv_op_name(int op) {
    switch (op) {
    case DTR__RDZV_SET: return "set";
    case DTR__RDZV_GET: return "get";
    case DTR__RDZV_ADD: return "add";
    case DTR__RDZV_CHECK: return "check";
    case DTR__RDZV_DEL: return "delete";
    }
    return "?";
}

/* One request and its reply, before `deadline`. The reply's value goes to buf (up to cap
 * bytes; the rest is read and dropped); *vlen gets its full length. Lock held by the caller. */
static dtr_result dtr__rdzv_call(dtr_store *st, int op, const char *key, size_t klen, const void *value, size_t len,
                                 int64_t deadline, void *buf, size_t cap, size_t *vlen, int *status) {
    uint8_t hdr[DTR__RDZV_HDR + DTR_STORE_MAX_KEY], rh[DTR__RDZV_HDR], sink[4096];
    uint32_t id;
    int e = 0;
    size_t got;
    dtr_result r;
    const char *opn = dtr__rdzv_op_name(op);
    if (st->broken != DTR_OK)
        return dtr__rdzv_fail(st, st->broken, "rendezvous rank %ld: store %s '%.64s': the connection to the server "
                              "(rank 0 at %s) was lost earlier: %s", (long)st->cfg.rank, opn, key, st->where,
                              st->broken_msg);
    id = ++st->next_id;
    memset(hdr, 0, DTR__RDZV_HDR);
    hdr[0] = (uint8_t)op;
    hdr[2] = (uint8_t)(klen >> 8);
    hdr[3] = (uint8_t)klen;
    dtr__rdzv_put32(hdr + 4, (uint32_t)len);
    dtr__rdzv_put32(hdr + 8, id);
    memcpy(hdr + DTR__RDZV_HDR, key, klen);
    r = dtr__rdzv_send_all(st->fd, hdr, DTR__RDZV_HDR + klen, deadline, &e);
    if (r == DTR_OK && len) r = dtr__rdzv_send_all(st->fd, value, len, deadline, &e);
    if (r != DTR_OK) {
        /* part of a request may be on the wire: the stream cannot be trusted any more */
        st->broken = r == DTR_TIMEOUT ? DTR_TIMEOUT : DTR_PEER_FAILED;
        snprintf(st->broken_msg, sizeof st->broken_msg, "%s",
                 r == DTR_TIMEOUT ? "the server stopped reading (send timed out)" : dtr__rdzv_errno_str(e));
        dtr__rdzv_close_client(st);
        return dtr__rdzv_fail(st, st->broken, "rendezvous rank %ld: store %s '%.64s': %s the server (rank 0 at %s): %s",
                              (long)st->cfg.rank, opn, key, r == DTR_TIMEOUT ? "timed out sending to" : "lost the connection to",
                              st->where, st->broken_msg);
    }
    for (;;) {
        uint32_t rlen, rid;
        size_t keep, off;
        r = dtr__rdzv_recv_all(st->fd, rh, sizeof rh, deadline, &got, &e);
        if (r == DTR_TIMEOUT && got == 0) {
            /* nothing of the reply yet: the connection stays usable; a late reply has an old id */
            if (op == DTR__RDZV_GET)
                return dtr__rdzv_fail(st, DTR_TIMEOUT, "rendezvous rank %ld: store get '%.64s': timed out after %d ms: "
                                      "the key was not set (server: rank 0 at %s)", (long)st->cfg.rank, key,
                                      st->cfg.timeout_ms, st->where);
            return dtr__rdzv_fail(st, DTR_TIMEOUT, "rendezvous rank %ld: store %s '%.64s': timed out after %d ms: "
                                  "no reply from the server (rank 0 at %s)", (long)st->cfg.rank, opn, key,
                                  st->cfg.timeout_ms, st->where);
        }
        if (r == DTR_OK) {
            rlen = dtr__rdzv_get32(rh + 4);
            rid = dtr__rdzv_get32(rh + 8);
            if (rh[0] > DTR__RDZV_FULL || rh[1] || rh[2] || rh[3] || rlen > DTR_STORE_MAX_VALUE) {
                r = DTR_PEER_FAILED;
                e = 0;
                snprintf(st->broken_msg, sizeof st->broken_msg, "malformed reply from the server");
            }
        }
        if (r == DTR_OK) {
            keep = rid == id ? (cap < rlen ? cap : rlen) : 0;
            if (keep) r = dtr__rdzv_recv_all(st->fd, buf, keep, deadline, &got, &e);
            for (off = keep; r == DTR_OK && off < rlen; off += got) {
                size_t chunk = rlen - off < sizeof sink ? rlen - off : sizeof sink;
                r = dtr__rdzv_recv_all(st->fd, sink, chunk, deadline, &got, &e);
            }
        }
        if (r != DTR_OK) {
            st->broken = r == DTR_TIMEOUT ? DTR_TIMEOUT : DTR_PEER_FAILED;
            if (r == DTR_TIMEOUT) snprintf(st->broken_msg, sizeof st->broken_msg, "a reply stopped half-way");
            else if (!st->broken_msg[0] || e) snprintf(st->broken_msg, sizeof st->broken_msg, "%s", dtr__rdzv_errno_str(e));
            dtr__rdzv_close_client(st);
            return dtr__rdzv_fail(st, st->broken, "rendezvous rank %ld: store %s '%.64s': lost the connection to the "
                                  "server (rank 0 at %s): %s", (long)st->cfg.rank, opn, key, st->where, st->broken_msg);
        }
        if (rid != id) continue;   /* a late reply to a request that timed out */
        if (vlen) *vlen = rlen;
        *status = rh[0];
        return DTR_OK;
    }
}

dtr_result dtr_store_set(dtr_store *st, const char *key, const void *value, size_t len) {
    size_t klen = 0, vlen = 0;
    int status = 0;
    dtr_result r;
    if (!st) return DTR_NULL_HANDLE;
    pthread_mutex_lock(&st->lock);
    st->err[0] = '\0';
    if ((r = dtr__rdzv_check_key(st, "set", key, &klen)) != DTR_OK) goto done;
    if (len > DTR_STORE_MAX_VALUE || (len && !value)) {
        r = dtr__rdzv_fail(st, DTR_INVALID_ARGUMENT, "rendezvous rank %ld: store set '%.64s': value of %lu bytes%s "
                           "(at most %lu)", (long)st->cfg.rank, key, (unsigned long)len, value ? "" : " is NULL",
                           (unsigned long)DTR_STORE_MAX_VALUE);
        goto done;
    }
    r = dtr__rdzv_call(st, DTR__RDZV_SET, key, klen, value, len, dtr__rdzv_now_ms() + st->cfg.timeout_ms, NULL, 0,
                       &vlen, &status);
    if (r == DTR_OK && status == DTR__RDZV_FULL)
        r = dtr__rdzv_fail(st, DTR_OUT_OF_MEMORY, "rendezvous rank %ld: store set '%.64s': the store is full "
                           "(max_keys / max_bytes on rank 0)", (long)st->cfg.rank, key);
done:
    pthread_mutex_unlock(&st->lock);
    return r;
}

/* get and check. */
static dtr_result dtr__rdzv_get(dtr_store *st, int op, const char *key, void *buf, size_t cap, size_t *len,
                                int *found, int64_t deadline) {
    size_t klen = 0, vlen = 0;
    int status = 0;
    dtr_result r;
    if (found) *found = 0;
    if (len) *len = 0;
    if ((r = dtr__rdzv_check_key(st, dtr__rdzv_op_name(op), key, &klen)) != DTR_OK) return r;
    if (cap && !buf) return dtr__rdzv_fail(st, DTR_NULL_HANDLE, "rendezvous rank %ld: store %s '%.64s': buf is NULL",
                                           (long)st->cfg.rank, dtr__rdzv_op_name(op), key);
    r = dtr__rdzv_call(st, op, key, klen, NULL, 0, deadline, buf, cap, &vlen, &status);
    if (r != DTR_OK) return r;
    if (status == DTR__RDZV_NOT_FOUND) return DTR_OK;
    if (found) *found = 1;
    if (len) *len = vlen;
    if (vlen > cap)
        return dtr__rdzv_fail(st, DTR_INVALID_ARGUMENT, "rendezvous rank %ld: store %s '%.64s': the value has %lu bytes, "
                              "the buffer %lu", (long)st->cfg.rank, dtr__rdzv_op_name(op), key, (unsigned long)vlen,
                              (unsigned long)cap);
    return DTR_OK;
}

dtr_result dtr_store_get(dtr_store *st, const char *key, void *buf, size_t cap, size_t *len) {
    dtr_result r;
    if (!st) return DTR_NULL_HANDLE;
    pthread_mutex_lock(&st->lock);
    st->err[0] = '\0';
    r = dtr__rdzv_get(st, DTR__RDZV_GET, key, buf, cap, len, NULL, dtr__rdzv_now_ms() + st->cfg.timeout_ms);
    pthread_mutex_unlock(&st->lock);
    return r;
}

dtr_result dtr_store_check(dtr_store *st, const char *key, void *buf, size_t cap, size_t *len, int *found) {
    dtr_result r;
    if (!st) return DTR_NULL_HANDLE;
    pthread_mutex_lock(&st->lock);
    st->err[0] = '\0';
    r = dtr__rdzv_get(st, DTR__RDZV_CHECK, key, buf, cap, len, found, dtr__rdzv_now_ms() + st->cfg.timeout_ms);
    pthread_mutex_unlock(&st->lock);
    return r;
}

static dtr_result dtr__rdzv_add(dtr_store *st, const char *key, int64_t delta, int64_t *result, int64_t deadline) {
    uint8_t d[8], v[8];
    size_t klen = 0, vlen = 0;
    int status = 0;
    dtr_result r;
    if ((r = dtr__rdzv_check_key(st, "add", key, &klen)) != DTR_OK) return r;
    dtr__rdzv_put64(d, (uint64_t)delta);
    r = dtr__rdzv_call(st, DTR__RDZV_ADD, key, klen, d, 8, deadline, v, sizeof v, &vlen, &status);
    if (r != DTR_OK) return r;
    if (status == DTR__RDZV_NOT_INTEGER)
        return dtr__rdzv_fail(st, DTR_INVALID_ARGUMENT, "rendezvous rank %ld: store add '%.64s': the key holds something "
                              "that is not a decimal int64, or the sum overflows", (long)st->cfg.rank, key);
    if (status == DTR__RDZV_FULL)
        return dtr__rdzv_fail(st, DTR_OUT_OF_MEMORY, "rendezvous rank %ld: store add '%.64s': the store is full",
                              (long)st->cfg.rank, key);
    if (status != DTR__RDZV_OK || vlen != 8)
        return dtr__rdzv_fail(st, DTR_PEER_FAILED, "rendezvous rank %ld: store add '%.64s': malformed reply",
                              (long)st->cfg.rank, key);
    if (result) *result = (int64_t)dtr__rdzv_get64(v);
    return DTR_OK;
}

dtr_result dtr_store_add(dtr_store *st, const char *key, int64_t delta, int64_t *result) {
    dtr_result r;
    if (!st) return DTR_NULL_HANDLE;
    pthread_mutex_lock(&st->lock);
    st->err[0] = '\0';
    r = dtr__rdzv_add(st, key, delta, result, dtr__rdzv_now_ms() + st->cfg.timeout_ms);
    pthread_mutex_unlock(&st->lock);
    return r;
}

static dtr_result dtr__rdzv_del(dtr_store *st, const char *key, int64_t deadline) {
    size_t klen = 0, vlen = 0;
    int status = 0;
    dtr_result r;
    if ((r = dtr__rdzv_check_key(st, "delete", key, &klen)) != DTR_OK) return r;
    return dtr__rdzv_call(st, DTR__RDZV_DEL, key, klen, NULL, 0, deadline, NULL, 0, &vlen, &status);
}

dtr_result dtr_store_delete(dtr_store *st, const char *key) {
    dtr_result r;
    if (!st) return DTR_NULL_HANDLE;
    pthread_mutex_lock(&st->lock);
    st->err[0] = '\0';
    r = dtr__rdzv_del(st, key, dtr__rdzv_now_ms() + st->cfg.timeout_ms);
    pthread_mutex_unlock(&st->lock);
    return r;
}

/* Barrier n (1-based) uses the counter "dtr/barrier" (ranks add 1; barrier n is complete when
 * it reaches n * world) and the flag "dtr/barrier/<n>" set by the rank that completes it. That
 * rank first deletes flag n-1: every rank has read it, since all have arrived at barrier n.
 * So barriers hold two keys however many there are. */
dtr_result dtr_store_barrier(dtr_store *st, const char *tag) {
    int64_t deadline, count = 0, gen, world;
    char key[48], prev[48], shown[72];
    size_t vlen = 0;
    dtr_result r;
    if (!st) return DTR_NULL_HANDLE;
    pthread_mutex_lock(&st->lock);
    st->err[0] = '\0';
    world = st->cfg.world_size;
    deadline = dtr__rdzv_now_ms() + st->cfg.timeout_ms;
    shown[0] = '\0';
    if (tag) snprintf(shown, sizeof shown, " ('%.60s')", tag);
    r = dtr__rdzv_add(st, "dtr/barrier", 1, &count, deadline);
    if (r != DTR_OK) goto done;
    gen = (count - 1) / world + 1;
    if (gen != st->barriers + 1) {
        r = dtr__rdzv_fail(st, DTR_BAD_STATE, "rendezvous rank %ld: barrier %lld%s: the ranks are at barrier %lld "
                           "(barriers called in a different order, or a rank restarted?)", (long)st->cfg.rank,
                           (long long)(st->barriers + 1), shown, (long long)gen);
        goto done;
    }
    snprintf(key, sizeof key, "dtr/barrier/%lld", (long long)gen);
    if (count == gen * world) {
        int status = 0;
        r = DTR_OK;
        if (gen > 1) {
            snprintf(prev, sizeof prev, "dtr/barrier/%lld", (long long)(gen - 1));
            r = dtr__rdzv_del(st, prev, deadline);
        }
        if (r == DTR_OK)
            r = dtr__rdzv_call(st, DTR__RDZV_SET, key, strlen(key), "1", 1, deadline, NULL, 0, &vlen, &status);
        if (r != DTR_OK) goto done;
    }
    {
        char flag[4];
        int status = 0;
        r = dtr__rdzv_call(st, DTR__RDZV_GET, key, strlen(key), NULL, 0, deadline, flag, sizeof flag, &vlen, &status);
    }
    if (r == DTR_TIMEOUT && st->broken == DTR_OK) {
        int64_t now_count = count;
        char text[24];
        size_t tl = 0;
        int status = 0;
        if (dtr__rdzv_call(st, DTR__RDZV_CHECK, "dtr/barrier", 11, NULL, 0, dtr__rdzv_now_ms() + 1000, text,
                           sizeof text - 1, &tl, &status) == DTR_OK && status == DTR__RDZV_OK && tl < sizeof text) {
            text[tl] = '\0';
            (void)dtr__rdzv_parse_counter((const uint8_t *)text, tl, &now_count);
        }
        r = dtr__rdzv_fail(st, DTR_TIMEOUT, "rendezvous rank %ld: barrier %lld%s: timed out after %d ms: %lld of %lld "
                           "ranks arrived", (long)st->cfg.rank, (long long)gen, shown, st->cfg.timeout_ms,
                           (long long)(now_count - (gen - 1) * world), (long long)world);
        goto done;
    }
    if (r == DTR_OK) st->barriers = gen;
done:
    if (r != DTR_OK && strncmp(st->err, "rendezvous rank", 15) == 0 && !strstr(st->err, ": barrier ")) {
        char inner[sizeof st->err];
        const char *what = strstr(st->err, ": store ");
        memcpy(inner, st->err, sizeof inner);
        (void)dtr__errf(st->err, sizeof st->err, r, "rendezvous rank %ld: barrier %lld%s: %s", (long)st->cfg.rank,
                        (long long)(st->barriers + 1), shown, what ? what + 2 : inner);
    }
    pthread_mutex_unlock(&st->lock);
    return r;
}

const char *dtr_store_last_error(const dtr_store *st) { return st ? st->err : "rendezvous: store is NULL"; }
int32_t dtr_store_rank(const dtr_store *st) { return st ? st->cfg.rank : -1; }
int32_t dtr_store_world_size(const dtr_store *st) { return st ? st->cfg.world_size : 0; }
int dtr_store_port(const dtr_store *st) { return st ? st->port : 0; }

#endif /* POSIX */

#ifdef __cplusplus
}
#endif
#line 16781 "dtrain.h"

/* ---- src/comm/comm.c ---- */
#line 1 "src/comm/comm.c"
/* ============================================================================
 * Process groups: the transport registry, dtr_comm (create, split, errors, abort), the
 * progress thread that runs non-blocking collectives, requests, point-to-point calls.
 *
 * Execution model. Every collective of a group gets a sequence number when it is called;
 * blocking ones run on the caller's thread when nothing is queued, and *_async ones (and
 * blocking ones called while some are queued) go to the group's FIFO queue, which one
 * progress thread drains in order. So a group runs one collective at a time, in call order,
 * on every rank: the rule that makes collectives match. The progress thread starts on the
 * first queued operation and sleeps on a condition variable while the queue is empty.
 * Send/recv requests go to the transport directly.
 *
 * Errors. A communication failure (DTR_TIMEOUT, DTR_PEER_FAILED) is written once into the
 * group (message naming this rank, the operation and the rank at fault), the transport is
 * aborted so that every other rank fails at once instead of at its own deadline, and the
 * group stays broken: later calls return the error. Argument errors are returned and
 * described without breaking the group.
 * ==========================================================================*/




#include <sys/time.h>

/* ---- clock and timed waits ----
 * The implementation is compiled after the application's own headers, so it cannot ask
 * for POSIX with a feature-test macro. Under strict ISO C (-std=c99) glibc hides
 * clock_gettime and pthread_condattr_setclock although libc has them: they are declared
 * here with the Linux clock ids. Elsewhere CLOCK_MONOTONIC is used when the headers show it,
 * and gettimeofday otherwise; condition variables wait on the monotonic clock on glibc and
 * in slices of at most 100 ms of the real-time clock elsewhere. */
#if defined(__GLIBC__) && !defined(__USE_POSIX199309) && !defined(__cplusplus)
extern int clock_gettime(__clockid_t clock_id, struct timespec *tp);
#define DTR__CLK_MONO 1
#define DTR__CLK_REAL 0
#define DTR__HAVE_CLOCK 1
#elif defined(CLOCK_MONOTONIC)
#define DTR__CLK_MONO CLOCK_MONOTONIC
#define DTR__CLK_REAL CLOCK_REALTIME
#define DTR__HAVE_CLOCK 1
#else
#define DTR__HAVE_CLOCK 0
#endif
#if DTR__HAVE_CLOCK && defined(__GLIBC__)
#if !defined(__USE_XOPEN2K) && !defined(__cplusplus)
extern int pthread_condattr_setclock(pthread_condattr_t *attr, __clockid_t clock_id);
#endif
#define DTR__COND_MONO 1
#else
#define DTR__COND_MONO 0
#endif

#if !DTR__COND_MONO || !DTR__HAVE_CLOCK
static int64_t dtr__realtime_ns(void) {
#if DTR__HAVE_CLOCK
    struct timespec ts;
    clock_gettime(DTR__CLK_REAL, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
#else
    struct timeval tv;
    gettimeofday(&tv, NULL);
    return (int64_t)tv.tv_sec * 1000000000 + (int64_t)tv.tv_usec * 1000;
#endif
}
#endif

int64_t dtr_time_ns(void) {
#if DTR__HAVE_CLOCK
    struct timespec ts;
    clock_gettime(DTR__CLK_MONO, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
#else
    return dtr__realtime_ns();
#endif
}

int dtr__cond_init(pthread_cond_t *cv) {
#if DTR__COND_MONO
    pthread_condattr_t at;
    int rc;
    if (pthread_condattr_init(&at) != 0) return -1;
    rc = pthread_condattr_setclock(&at, DTR__CLK_MONO);
    if (rc == 0) rc = pthread_cond_init(cv, &at);
    pthread_condattr_destroy(&at);
    return rc;
#else
    return pthread_cond_init(cv, NULL);
#endif
}

int dtr__cond_wait_until(pthread_cond_t *cv, pthread_mutex_t *mu, int64_t deadline_ns) {
    struct timespec ts;
    int64_t now, t;
    if (deadline_ns < 0) { pthread_cond_wait(cv, mu); return 0; }
    now = dtr_time_ns();
    if (now >= deadline_ns) return 1;
#if DTR__COND_MONO
    t = deadline_ns;
#else
    { /* the real-time clock: at most 100 ms at a time, so that a clock jump costs little */
        int64_t d = deadline_ns - now;
        if (d > 100000000) d = 100000000;
        t = dtr__realtime_ns() + d;
    }
#endif
    ts.tv_sec = (time_t)(t / 1000000000);
    ts.tv_nsec = (long)(t % 1000000000);
    pthread_cond_timedwait(cv, mu, &ts);
    return dtr_time_ns() >= deadline_ns;
}

/* ---- names ---- */

const char *dtr_reduce_op_name(dtr_reduce_op op) {
    switch (op) {
    case DTR_REDUCE_SUM: return "sum";
    case DTR_REDUCE_AVG: return "avg";
    case DTR_REDUCE_MAX: return "max";
    }
    return "unknown";
}

const char *dtr_allreduce_algo_name(dtr_allreduce_algo algo) {
    switch (algo) {
    case DTR_ALLREDUCE_AUTO: return "auto";
    case DTR_ALLREDUCE_RING: return "ring";
    case DTR_ALLREDUCE_RECURSIVE_DOUBLING: return "recursive_doubling";
    case DTR_ALLREDUCE_HIERARCHICAL: return "hierarchical";
    }
    return "unknown";
}

const char *dtr__coll_name(int kind) {
    static const char *const names[DTR__OP_COUNT] = {"all_reduce", "broadcast", "reduce_scatter", "all_gather",
                                                     "barrier", "send", "recv", "split"};
    return kind >= 0 && kind < DTR__OP_COUNT ? names[kind] : "operation";
}

/* ---- transport registry ---- */

#define DTR__MAX_TRANSPORTS 32
static pthread_mutex_t dtr__registry_mu = PTHREAD_MUTEX_INITIALIZER;
static const dtr_transport_vtable *dtr__registry[DTR__MAX_TRANSPORTS];
static int dtr__registry_n;

dtr_result dtr_transport_register(const dtr_transport_vtable *vt) {
    dtr_result r = DTR_OK;
    int i;
    if (!vt) return DTR_NULL_HANDLE;
    if (vt->abi_version != DTR_VERSION_NUMBER) return DTR_VERSION_MISMATCH;
    if (!vt->name || !*vt->name || !vt->open || !vt->close || !vt->isend || !vt->irecv || !vt->test ||
        !vt->wait_any || !vt->release || !vt->abort)
        return DTR_INVALID_ARGUMENT;
    if (!strcmp(vt->name, "local")) return vt == dtr_local_transport() ? DTR_OK : DTR_INVALID_ARGUMENT;
    pthread_mutex_lock(&dtr__registry_mu);
    for (i = 0; i < dtr__registry_n; i++)
        if (!strcmp(dtr__registry[i]->name, vt->name)) { r = dtr__registry[i] == vt ? DTR_OK : DTR_INVALID_ARGUMENT; goto out; }
    if (dtr__registry_n == DTR__MAX_TRANSPORTS) { r = DTR_OUT_OF_MEMORY; goto out; }
    dtr__registry[dtr__registry_n++] = vt;
out:
    pthread_mutex_unlock(&dtr__registry_mu);
    return r;
}

/* dtrain_comm.c's transport is found by name when that unit is linked (a weak reference:
   without the unit the address is NULL) */
#if (defined(__GNUC__) || defined(__clang__)) && defined(__ELF__)
extern const dtr_transport_vtable *dtr_fabric_transport(void) __attribute__((weak));
#define DTR__WEAK_FABRIC 1
#else
#define DTR__WEAK_FABRIC 0
#endif

const dtr_transport_vtable *dtr_transport_find(const char *name) {
    const dtr_transport_vtable *vt = NULL;
    int i;
    if (!name) return NULL;
    if (!strcmp(name, "local")) return dtr_local_transport();
#if DTR__WEAK_FABRIC
    if (!strcmp(name, "libfabric") && dtr_fabric_transport) {
        vt = dtr_fabric_transport();
        if (vt) return vt;
    }
#endif
    pthread_mutex_lock(&dtr__registry_mu);
    for (i = 0; i < dtr__registry_n; i++)
        if (!strcmp(dtr__registry[i]->name, name)) { vt = dtr__registry[i]; break; }
    pthread_mutex_unlock(&dtr__registry_mu);
    return vt;
}

/* ---- configuration and lifetime ---- */

dtr_comm_config dtr_comm_config_init(void) {
    dtr_comm_config c;
    memset(&c, 0, sizeof(c));
    c.allreduce_algo = DTR_ALLREDUCE_AUTO;
    c.log_level = DTR_LOG_WARN;
    c.memory = DTR_MEM_HOST;
    c.nccl.device = -1;
    return c;
}

static void dtr__endpoint_unref(dtr__endpoint *ep) {
    int last;
    dtr_allocation_callbacks a;
    pthread_mutex_lock(&ep->mu);
    last = --ep->refs == 0;
    pthread_mutex_unlock(&ep->mu);
    if (!last) return;
    ep->vt->close(ep->state);
    pthread_mutex_destroy(&ep->mu);
    a = ep->alloc;
    dtr__free(&a, ep);
}

/* A group object over endpoint ep (one more reference to it) with `size` ranks. */
static dtr_result dtr__comm_new(dtr__endpoint *ep, int size, dtr_comm **out) {
    dtr_comm *c = (dtr_comm *)dtr__calloc(&ep->alloc, sizeof(*c));
    *out = NULL;
    if (!c) return DTR_OUT_OF_MEMORY;
    c->ranks = (int *)dtr__calloc(&ep->alloc, (size_t)size * sizeof(int));
    if (!c->ranks) { dtr__free(&ep->alloc, c); return DTR_OUT_OF_MEMORY; }
    if (pthread_mutex_init(&c->mu, NULL) != 0) goto fail;
    if (dtr__cond_init(&c->work_cv) != 0) { pthread_mutex_destroy(&c->mu); goto fail; }
    if (dtr__cond_init(&c->done_cv) != 0) {
        pthread_cond_destroy(&c->work_cv);
        pthread_mutex_destroy(&c->mu);
        goto fail;
    }
    c->ep = ep;
    c->size = size;
    c->failed_rank = -1;
    pthread_mutex_lock(&ep->mu);
    ep->refs++;
    pthread_mutex_unlock(&ep->mu);
    *out = c;
    return DTR_OK;
fail:
    dtr__free(&ep->alloc, c->ranks);
    dtr__free(&ep->alloc, c);
    return DTR_OUT_OF_MEMORY;
}

static void dtr__comm_config_apply(dtr_comm *c, const dtr_comm_config *cfg) {
    c->timeout_ms = cfg->timeout_ms > 0 ? cfg->timeout_ms : 300000;
    c->algo = (int)cfg->allreduce_algo;
    c->ring_threshold = cfg->ring_threshold_bytes ? cfg->ring_threshold_bytes : (size_t)256 << 10;
    c->chain_threshold = cfg->chain_threshold_bytes ? cfg->chain_threshold_bytes : (size_t)1 << 20;
    c->segment = cfg->segment_bytes ? cfg->segment_bytes : (size_t)256 << 10;
    c->no_native = cfg->no_native;
    c->shm_wanted = cfg->shared_memory;
    c->log = cfg->log;
    c->log_user = cfg->log_user;
    c->log_level = cfg->log_level;
}

/* The memory kind of the group's buffers must be one the transport takes. */
static dtr_result dtr__comm_check_memory(const dtr_comm_config *cfg, const dtr_transport_vtable *vt, char *err, size_t errlen) {
    unsigned kinds = vt->mem_kinds ? vt->mem_kinds : (unsigned)DTR_MEM_HOST;
    dtr_mem_kind mem = cfg->memory ? cfg->memory : DTR_MEM_HOST;
    if (mem != DTR_MEM_HOST && mem != DTR_MEM_DEVICE)
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "dtr_comm_create: memory %d is not a dtr_mem_kind", (int)mem);
    if (mem == DTR_MEM_DEVICE && !cfg->context)
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "dtr_comm_create: device memory needs cfg.context (the owner)");
    if (!(kinds & (unsigned)mem))
        return dtr__errf(err, errlen, DTR_UNSUPPORTED, "dtr_comm_create: transport '%s' does not take %s memory", vt->name,
                         mem == DTR_MEM_DEVICE ? "device" : "host");
    return DTR_OK;
}

dtr_result dtr_comm_create(const dtr_comm_config *cfg, dtr_comm **out, char *err, size_t errlen) {
    dtr_comm_config def = dtr_comm_config_init();
    const dtr_transport_vtable *vt;
    const dtr_allocation_callbacks *a;
    dtr__endpoint *ep;
    dtr_comm *c;
    dtr_result r;
    int i;
    if (err && errlen) err[0] = 0;
    if (!out) return dtr__errf(err, errlen, DTR_NULL_HANDLE, "dtr_comm_create: out is NULL");
    *out = NULL;
    if (!cfg) cfg = &def;
    a = &cfg->alloc;
    if ((a->malloc_fn || a->realloc_fn || a->free_fn) && !(a->malloc_fn && a->realloc_fn && a->free_fn))
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "dtr_comm_create: set all three allocation callbacks or none");
    if (cfg->timeout_ms < 0 || (int)cfg->allreduce_algo < 0 || cfg->allreduce_algo > DTR_ALLREDUCE_RECURSIVE_DOUBLING)
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "dtr_comm_create: bad timeout_ms or allreduce_algo");
    vt = cfg->transport_vtable ? cfg->transport_vtable : dtr_transport_find(cfg->transport ? cfg->transport : "local");
    if (!vt)
        return dtr__errf(err, errlen, DTR_NOT_FOUND, "dtr_comm_create: no transport '%s' is registered%s", cfg->transport,
                         !strcmp(cfg->transport, "libfabric") ? " (link dtrain_comm.c built with DTR_USE_LIBFABRIC and "
                                                                "register its transport)" : "");
    if (vt->abi_version != DTR_VERSION_NUMBER)
        return dtr__errf(err, errlen, DTR_VERSION_MISMATCH, "dtr_comm_create: transport '%s' was built against dtrain %d, "
                         "this is %d", vt->name ? vt->name : "?", vt->abi_version, DTR_VERSION_NUMBER);
    r = dtr__comm_check_memory(cfg, vt, err, errlen);
    if (r != DTR_OK) return r;
    ep = (dtr__endpoint *)dtr__calloc(a, sizeof(*ep));
    if (!ep) return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "dtr_comm_create: out of memory");
    ep->alloc = *a;
    ep->vt = vt;
    if (pthread_mutex_init(&ep->mu, NULL) != 0) {
        dtr__free(a, ep);
        return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "dtr_comm_create: cannot make a mutex");
    }
    r = vt->open(cfg, &ep->state, &ep->info, err, errlen);
    if (r == DTR_OK && (ep->info.size < 1 || ep->info.rank < 0 || ep->info.rank >= ep->info.size)) {
        vt->close(ep->state);
        r = dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "dtr_comm_create: transport '%s' reported rank %d of %d",
                      vt->name, ep->info.rank, ep->info.size);
    }
    if (r != DTR_OK) {
        pthread_mutex_destroy(&ep->mu);
        dtr__free(a, ep);
        return r;
    }
    ep->next_ctx = 1;   /* 0 is the world group */
    r = dtr__comm_new(ep, ep->info.size, &c);   /* the group holds the only reference */
    if (r != DTR_OK) {
        vt->close(ep->state);
        pthread_mutex_destroy(&ep->mu);
        dtr__free(a, ep);
        return dtr__errf(err, errlen, r, "dtr_comm_create: out of memory");
    }
    c->rank = ep->info.rank;
    c->local_rank = ep->info.local_rank;
    c->local_size = ep->info.local_size > 0 ? ep->info.local_size : 1;
    for (i = 0; i < c->size; i++) c->ranks[i] = i;
    c->ctx = 0;
    c->mem_ctx = cfg->memory == DTR_MEM_DEVICE ? cfg->context : NULL;
    dtr__comm_config_apply(c, cfg);
    if (vt->group_create && !c->no_native) {
        r = vt->group_create(ep->state, c->ranks, c->size, c->ctx, &c->native_group);
        if (r != DTR_OK) c->native_group = NULL;   /* fall back to point-to-point */
    }
    if (!c->native_group && (r = dtr__shm_setup(c)) != DTR_OK) {
        dtr__errf(err, errlen, r, "dtr_comm_create: %s", c->msg);
        dtr_comm_destroy(c);
        return r;
    }
    *out = c;
    return DTR_OK;
}

static void dtr__comm_stop_thread(dtr_comm *c) {
    int on;
    pthread_mutex_lock(&c->mu);
    c->stop = 1;
    on = c->thread_on;
    pthread_cond_broadcast(&c->work_cv);
    pthread_mutex_unlock(&c->mu);
    if (on) pthread_join(c->thread, NULL);
    c->thread_on = 0;
}

void dtr_comm_destroy(dtr_comm *c) {
    dtr_allocation_callbacks a;
    dtr__endpoint *ep;
    dtr_request *q, *n;
    int pending;
    if (!c) return;
    ep = c->ep;
    a = ep->alloc;
    pthread_mutex_lock(&c->mu);
    pending = c->head != NULL || c->running != NULL;
    pthread_mutex_unlock(&c->mu);
    if (pending) {
        char why[160];
        snprintf(why, sizeof why, "rank %d destroyed its group with collectives still in flight", ep->info.rank);
        ep->vt->abort(ep->state, ep->info.rank, why);
    }
    dtr__comm_stop_thread(c);
    dtr_comm_destroy(c->leaders);
    dtr_comm_destroy(c->host);
    dtr__shm_free(c);
    /* requests never run (stopped queue) complete with an error; their memory is freed below,
       so the caller must not use them any more (documented: free requests before destroy) */
    for (q = c->head; q; q = n) { n = q->next; dtr__free(&a, q); }
    for (q = c->free_reqs; q; q = n) { n = q->next; dtr__free(&a, q); }
    if (c->native_group && ep->vt->group_destroy) ep->vt->group_destroy(ep->state, c->native_group);
    pthread_cond_destroy(&c->work_cv);
    pthread_cond_destroy(&c->done_cv);
    pthread_mutex_destroy(&c->mu);
    dtr__free(&a, c->scratch);
    dtr__free(&a, c->ranks);
    dtr__free(&a, c);
    dtr__endpoint_unref(ep);
}

/* ---- queries ---- */

int dtr_comm_rank(const dtr_comm *c) { return c ? c->rank : -1; }
int dtr_comm_size(const dtr_comm *c) { return c ? c->size : 0; }
int dtr_comm_local_rank(const dtr_comm *c) { return c ? c->local_rank : -1; }
int dtr_comm_local_size(const dtr_comm *c) { return c ? c->local_size : 0; }
int dtr_comm_world_rank(const dtr_comm *c, int rank) {
    return c && rank >= 0 && rank < c->size ? c->ranks[rank] : -1;
}
const char *dtr_comm_transport_name(const dtr_comm *c) { return c ? c->ep->vt->name : ""; }
const char *dtr_comm_transport_detail(const dtr_comm *c) { return c ? c->ep->info.detail : ""; }

dtr_result dtr_comm_status(const dtr_comm *c) {
    dtr_result r;
    if (!c) return DTR_NULL_HANDLE;
    pthread_mutex_lock((pthread_mutex_t *)&c->mu);
    r = c->status;
    pthread_mutex_unlock((pthread_mutex_t *)&c->mu);
    return r;
}

const char *dtr_comm_last_error(const dtr_comm *c) { return c ? c->msg : "null group"; }
int dtr_comm_failed_rank(const dtr_comm *c) { return c ? c->failed_rank : -1; }
int dtr_comm_native_error(const dtr_comm *c) { return c ? c->native_code : 0; }

dtr_result dtr_comm_set_timeout(dtr_comm *c, int timeout_ms) {
    if (!c) return DTR_NULL_HANDLE;
    if (timeout_ms <= 0) return DTR_INVALID_ARGUMENT;
    c->timeout_ms = timeout_ms;
    return DTR_OK;
}

/* The host and leaders groups of the hierarchical all-reduce (collective over c), and
 * whether it changes anything: several hosts, one of several ranks (the same on all ranks). */
static dtr_result dtr__comm_hier_groups(dtr_comm *c) {
    int host = c->ep->info.rank - c->ep->info.local_rank; /* its first rank: ranks of a host are contiguous */
    float shape[2];
    dtr_result r;
    if (c->hier_ready) return DTR_OK;
    r = dtr_comm_split(c, host, c->rank, &c->host);
    if (r == DTR_OK) r = dtr_comm_split(c, dtr_comm_rank(c->host) == 0 ? 0 : DTR_COMM_UNDEFINED, c->rank, &c->leaders);
    shape[0] = c->leaders ? 1.0f : 0.0f;                            /* hosts */
    shape[1] = (float)dtr_comm_size(c->host);                     /* the biggest host */
    if (r == DTR_OK) r = dtr_comm_all_reduce(c, shape, shape, 1, DTR_F32, DTR_REDUCE_SUM);
    if (r == DTR_OK) r = dtr_comm_all_reduce(c, shape + 1, shape + 1, 1, DTR_F32, DTR_REDUCE_MAX);
    if (r != DTR_OK) return r;
    c->hier_ready = 1;
    c->hier_on = shape[0] > 1.5f && shape[1] > 1.5f && !c->mem_ctx;
    return DTR_OK;
}

dtr_result dtr_comm_set_allreduce_algo(dtr_comm *c, dtr_allreduce_algo algo, size_t ring_threshold_bytes) {
    dtr_result r;
    if (!c) return DTR_NULL_HANDLE;
    if ((int)algo < 0 || algo > DTR_ALLREDUCE_HIERARCHICAL) return DTR_INVALID_ARGUMENT;
    if (algo == DTR_ALLREDUCE_HIERARCHICAL && (r = dtr__comm_hier_groups(c)) != DTR_OK) return r;
    c->algo = (int)algo;
    if (ring_threshold_bytes) c->ring_threshold = ring_threshold_bytes;
    if (c->host) c->host->ring_threshold = c->ring_threshold;
    if (c->leaders) c->leaders->ring_threshold = c->ring_threshold;
    return DTR_OK;
}

void dtr_comm_abort(dtr_comm *c, const char *why) {
    char msg[200];
    if (!c) return;
    snprintf(msg, sizeof msg, "rank %d aborted the group: %s", c->ep->info.rank, why ? why : "(no reason given)");
    pthread_mutex_lock(&c->mu);
    if (c->status == DTR_OK || c->status == DTR_INVALID_ARGUMENT) {
        c->status = DTR_PEER_FAILED;
        c->failed_rank = c->ep->info.rank;
        snprintf(c->msg, sizeof(c->msg), "%s", msg);
    }
    pthread_mutex_unlock(&c->mu);
    c->ep->vt->abort(c->ep->state, c->ep->info.rank, msg);
}

/* ---- errors ---- */

static int dtr__is_comm_failure(dtr_result r) { return r == DTR_TIMEOUT || r == DTR_PEER_FAILED; }

dtr_result dtr__comm_fail(dtr_comm *c, const dtr__coll *a, dtr_result code, int peer, int native_code, const char *fmt,
                          ...) {
    char what[300], head[160];
    va_list ap;
    int first = 0;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    if (a && a->kind == DTR__OP_ALL_REDUCE)
        snprintf(head, sizeof head, "rank %d/%d all_reduce #%u (%zu x %s, %s, %s)", c->rank, c->size, a->seq, a->count,
                 dtr_dtype_name(a->dtype), dtr_reduce_op_name(a->op), dtr_allreduce_algo_name((dtr_allreduce_algo)a->algo));
    else if (a && (a->kind == DTR__OP_SEND || a->kind == DTR__OP_RECV))
        snprintf(head, sizeof head, "rank %d/%d %s (%zu bytes, %s rank %d, tag %d)", c->rank, c->size,
                 dtr__coll_name(a->kind), a->count, a->kind == DTR__OP_SEND ? "to" : "from", a->root, a->tag);
    else if (a)
        snprintf(head, sizeof head, "rank %d/%d %s #%u (%zu x %s)", c->rank, c->size, dtr__coll_name(a->kind), a->seq,
                 a->count, dtr_dtype_name(a->dtype));
    else
        snprintf(head, sizeof head, "rank %d/%d", c->rank, c->size);
    pthread_mutex_lock(&c->mu);
    if (!dtr__is_comm_failure(c->status)) {
        first = 1;
        if (dtr__is_comm_failure(code)) {
            c->status = code;
            c->failed_rank = peer;
            c->native_code = native_code;
        }
        snprintf(c->msg, sizeof(c->msg), "%s: %s", head, what);
    }
    pthread_mutex_unlock(&c->mu);
    if (first && c->log && c->log_level >= DTR_LOG_ERROR) c->log(c->log_user, DTR_LOG_ERROR, c->msg);
    if (dtr__is_comm_failure(code)) {
        char why[200];
        snprintf(why, sizeof why, "%.80s: %.110s", head, what);
        c->ep->vt->abort(c->ep->state, peer, why);
    }
    return code;
}

/* ---- point-to-point building blocks of the algorithms ---- */

static void dtr__terr_clear(dtr_transport_error *e) {
    e->rank = -1;
    e->native_code = 0;
    e->msg[0] = 0;
}

dtr_result dtr__comm_waitall(dtr_comm *c, const dtr__coll *a, void **reqs, int n) {
    const dtr_transport_vtable *vt = c->ep->vt;
    void *st = c->ep->state;
    dtr_transport_error e;
    dtr_result r = DTR_OK;
    int i, left;
    dtr__terr_clear(&e);
    for (;;) {
        left = 0;
        for (i = 0; i < n; i++) {
            int done = 0;
            if (!reqs[i]) continue;
            r = vt->test(st, reqs[i], &done, &e);
            if (r != DTR_OK) goto fail;
            if (done) { vt->release(st, reqs[i]); reqs[i] = NULL; }
            else left++;
        }
        if (!left) return DTR_OK;
        r = vt->wait_any(st, reqs, n, a->deadline, &e);
        if (r != DTR_OK) goto fail;
    }
fail:
    for (i = 0; i < n; i++)
        if (reqs[i]) { vt->release(st, reqs[i]); reqs[i] = NULL; }
    if (r == DTR_TIMEOUT)
        return dtr__comm_fail(c, a, r, e.rank, e.native_code, "timed out after %d ms: %s", a->timeout_ms, e.msg);
    return dtr__comm_fail(c, a, r, e.rank, e.native_code, "%s", e.msg[0] ? e.msg : dtr_result_string(r));
}

dtr_result dtr__comm_sendrecv(dtr_comm *c, const dtr__coll *a, const void *sbuf, size_t sbytes, int to, void *rbuf,
                              size_t rbytes, int from, uint32_t step) {
    const dtr_transport_vtable *vt = c->ep->vt;
    void *reqs[2] = {NULL, NULL};
    uint64_t tag = dtr__tag_coll(c->ctx, a->seq, step);
    dtr_transport_error e;
    dtr_result r;
    dtr__terr_clear(&e);
    if (from >= 0) {
        r = vt->irecv(c->ep->state, rbuf, rbytes, c->ranks[from], tag, &reqs[1], &e);
        if (r != DTR_OK) return dtr__comm_fail(c, a, r, e.rank, e.native_code, "%s", e.msg);
    }
    if (to >= 0) {
        r = vt->isend(c->ep->state, sbuf, sbytes, c->ranks[to], tag, &reqs[0], &e);
        if (r != DTR_OK) {
            if (reqs[1]) vt->release(c->ep->state, reqs[1]);
            return dtr__comm_fail(c, a, r, e.rank, e.native_code, "%s", e.msg);
        }
    }
    return dtr__comm_waitall(c, a, reqs, 2);
}

void *dtr__comm_scratch(dtr_comm *c, size_t bytes) {
    if (bytes > c->scratch_cap) {
        void *p = dtr__malloc(&c->ep->alloc, bytes);
        if (!p) return NULL;
        dtr__free(&c->ep->alloc, c->scratch);
        c->scratch = p;
        c->scratch_cap = bytes;
    }
    return c->scratch ? c->scratch : (void *)c;   /* a valid pointer even for 0 bytes */
}

/* ---- the queue and the progress thread ---- */

/* Runs the request at the head of the queue on the calling thread. Called and returns with
 * c->mu held; the collective itself runs unlocked. Wakes waiters of its completion and the
 * progress thread (which waits while another thread runs the head). */
static void dtr__comm_run_head(dtr_comm *c) {
    dtr_request *q = c->head;
    dtr_result r;
    c->head = q->next;
    if (!c->head) c->tail = NULL;
    q->state = DTR__REQ_RUNNING;
    c->running = q;
    r = c->status;
    pthread_mutex_unlock(&c->mu);
    if (!dtr__is_comm_failure(r)) r = dtr__coll_run(c, &q->a);
    pthread_mutex_lock(&c->mu);
    q->result = r;
    q->state = DTR__REQ_DONE;
    c->running = NULL;
    pthread_cond_broadcast(&c->done_cv);
    pthread_cond_broadcast(&c->work_cv);
}

static void *dtr__comm_thread(void *arg) {
    dtr_comm *c = (dtr_comm *)arg;
    pthread_mutex_lock(&c->mu);
    for (;;) {
        /* a waiting caller may be running the head itself (dtr_request_wait): wait for it */
        while ((!c->head || c->running) && !c->stop) dtr__cond_wait_until(&c->work_cv, &c->mu, -1);
        while (c->running) dtr__cond_wait_until(&c->work_cv, &c->mu, -1);
        if (!c->head) break;    /* stop, and nothing left */
        dtr__comm_run_head(c);
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

static dtr_request *dtr__req_get(dtr_comm *c) {
    dtr_request *q;
    pthread_mutex_lock(&c->mu);
    q = c->free_reqs;
    if (q) c->free_reqs = q->next;
    pthread_mutex_unlock(&c->mu);
    if (!q && !(q = (dtr_request *)dtr__malloc(&c->ep->alloc, sizeof(*q)))) return NULL;
    memset(q, 0, sizeof(*q));
    q->comm = c;
    return q;
}

/* Queues q (state QUEUED) and starts the progress thread if needed. */
static dtr_result dtr__comm_enqueue(dtr_comm *c, dtr_request *q) {
    dtr_result r = DTR_OK;
    pthread_mutex_lock(&c->mu);
    if (!c->thread_on) {
        c->stop = 0;
        if (pthread_create(&c->thread, NULL, dtr__comm_thread, c) != 0) r = DTR_OUT_OF_MEMORY;
        else c->thread_on = 1;
    }
    if (r == DTR_OK) {
        q->state = DTR__REQ_QUEUED;
        q->next = NULL;
        if (c->tail) c->tail->next = q;
        else c->head = q;
        c->tail = q;
        pthread_cond_signal(&c->work_cv);
    }
    pthread_mutex_unlock(&c->mu);
    return r;
}

int dtr__auto_algo(const dtr_comm *c, size_t count, dtr_dtype dt) {
    return count * dtr_dtype_size(dt) >= c->ring_threshold && count >= (size_t)c->size ? DTR_ALLREDUCE_RING
                                                                                        : DTR_ALLREDUCE_RECURSIVE_DOUBLING;
}

/* Checks arguments (an error here breaks nothing), stamps the sequence number and deadline. */
static dtr_result dtr__coll_prepare(dtr_comm *c, dtr__coll *a) {
    size_t es;
    dtr_result st;
    if (!c) return DTR_NULL_HANDLE;
    st = dtr_comm_status(c);
    if (dtr__is_comm_failure(st)) return st;
    es = dtr_dtype_size(a->dtype);
    if (a->kind != DTR__OP_SEND && a->kind != DTR__OP_RECV && a->kind != DTR__OP_BARRIER) {
        if (!es) return dtr__comm_fail(c, a, DTR_DTYPE_MISMATCH, -1, 0, "unknown dtype %d", (int)a->dtype);
        if (a->count && ((!a->src && a->kind != DTR__OP_BROADCAST) || !a->dst))
            return dtr__comm_fail(c, a, DTR_NULL_HANDLE, -1, 0, "a buffer is NULL");
        if (a->count > (SIZE_MAX / 2) / es / (size_t)c->size)
            return dtr__comm_fail(c, a, DTR_INVALID_ARGUMENT, -1, 0, "count too large");
    }
    if (a->kind == DTR__OP_ALL_REDUCE || a->kind == DTR__OP_REDUCE_SCATTER) {
        if (a->dtype != DTR_F32 && a->dtype != DTR_BF16 && a->dtype != DTR_F16)
            return dtr__comm_fail(c, a, DTR_DTYPE_MISMATCH, -1, 0, "reductions take f32, bf16 or f16, not %s",
                                  dtr_dtype_name(a->dtype));
        if ((int)a->op < 0 || a->op > DTR_REDUCE_MAX)
            return dtr__comm_fail(c, a, DTR_INVALID_ARGUMENT, -1, 0, "unknown reduction %d", (int)a->op);
    }
    if (a->kind == DTR__OP_ALL_REDUCE && a->src != a->dst && a->count) {
        const char *s = (const char *)a->src, *d = (const char *)a->dst;
        size_t b = a->count * es;
        if (s < d + b && d < s + b)
            return dtr__comm_fail(c, a, DTR_INVALID_ARGUMENT, -1, 0, "src and dst overlap without being equal");
    }
    if (a->kind == DTR__OP_REDUCE_SCATTER && a->count) {
        const char *s = (const char *)a->src, *d = (const char *)a->dst;
        size_t b = a->count * es;
        if (s < d + b && d < s + b * (size_t)c->size)
            return dtr__comm_fail(c, a, DTR_INVALID_ARGUMENT, -1, 0, "dst overlaps src");
    }
    if (a->kind == DTR__OP_ALL_GATHER && a->count) {
        const char *s = (const char *)a->src, *d = (const char *)a->dst;
        size_t b = a->count * es;
        if (s != d + b * (size_t)c->rank && s < d + b * (size_t)c->size && d < s + b)
            return dtr__comm_fail(c, a, DTR_INVALID_ARGUMENT, -1, 0, "src overlaps dst (in place is src == dst + rank*count)");
    }
    if (a->kind == DTR__OP_BROADCAST && (a->root < 0 || a->root >= c->size))
        return dtr__comm_fail(c, a, DTR_INVALID_ARGUMENT, -1, 0, "root %d outside the group of %d", a->root, c->size);
    if (a->kind == DTR__OP_SEND || a->kind == DTR__OP_RECV) {
        if (a->root < 0 || a->root >= c->size)
            return dtr__comm_fail(c, a, DTR_INVALID_ARGUMENT, -1, 0, "peer %d outside the group of %d", a->root, c->size);
        if (a->root == c->rank)
            return dtr__comm_fail(c, a, DTR_INVALID_ARGUMENT, -1, 0, "a rank cannot send to itself");
        if (a->tag < 0) return dtr__comm_fail(c, a, DTR_INVALID_ARGUMENT, -1, 0, "tag %d is negative", a->tag);
        if (a->count && !(a->kind == DTR__OP_SEND ? a->src : (const void *)a->dst))
            return dtr__comm_fail(c, a, DTR_NULL_HANDLE, -1, 0, "the buffer is NULL");
    }
    if (a->kind == DTR__OP_ALL_REDUCE) a->algo = c->algo != DTR_ALLREDUCE_AUTO ? c->algo : dtr__auto_algo(c, a->count, a->dtype);
    if (a->kind != DTR__OP_SEND && a->kind != DTR__OP_RECV) a->seq = c->seq++;
    a->timeout_ms = c->timeout_ms;
    a->deadline = dtr_time_ns() + (int64_t)c->timeout_ms * 1000000;
    return DTR_OK;
}

/* Runs a prepared collective: inline when the queue is idle, else behind the queue. */
static dtr_result dtr__coll_blocking(dtr_comm *c, dtr__coll *a) {
    dtr_result r = dtr__coll_prepare(c, a);
    int idle;
    if (r != DTR_OK) return r;
    pthread_mutex_lock(&c->mu);
    idle = !c->head && !c->running;
    if (idle) c->inline_running = 1;
    pthread_mutex_unlock(&c->mu);
    if (idle) {
        r = dtr__coll_run(c, a);
        pthread_mutex_lock(&c->mu);
        c->inline_running = 0;
        pthread_mutex_unlock(&c->mu);
        return r;
    } else {
        dtr_request *q = dtr__req_get(c);
        if (!q) return dtr__comm_fail(c, a, DTR_OUT_OF_MEMORY, -1, 0, "out of memory");
        q->a = *a;
        pthread_mutex_lock(&c->mu);
        c->live_reqs++;
        pthread_mutex_unlock(&c->mu);
        r = dtr__comm_enqueue(c, q);
        if (r == DTR_OK) r = dtr_request_wait(q);
        else { q->state = DTR__REQ_DONE; q->result = r; }
        dtr_request_destroy(q);
        return r;
    }
}

static dtr_result dtr__coll_async(dtr_comm *c, dtr__coll *a, dtr_request **out) {
    dtr_request *q;
    dtr_result r;
    if (!out) return DTR_NULL_HANDLE;
    *out = NULL;
    r = dtr__coll_prepare(c, a);
    if (r != DTR_OK) return r;
    q = dtr__req_get(c);
    if (!q) return dtr__comm_fail(c, a, DTR_OUT_OF_MEMORY, -1, 0, "out of memory");
    q->a = *a;
    pthread_mutex_lock(&c->mu);
    c->live_reqs++;
    pthread_mutex_unlock(&c->mu);
    if (c->size == 1) { /* nothing to wait for: run it here */
        q->result = dtr__coll_run(c, &q->a);
        q->state = DTR__REQ_DONE;
    } else if ((r = dtr__comm_enqueue(c, q)) != DTR_OK) {
        q->state = DTR__REQ_DONE;
        q->result = dtr__comm_fail(c, a, r, -1, 0, "cannot start the progress thread");
    }
    *out = q;
    return DTR_OK;
}

/* ---- requests ---- */

static dtr_result dtr__p2p_finish(dtr_request *q, dtr_result r, const dtr_transport_error *e, int timed_out) {
    dtr_comm *c = q->comm;
    c->ep->vt->release(c->ep->state, q->treq);
    q->treq = NULL;
    q->state = DTR__REQ_DONE;
    if (r == DTR_OK) q->result = DTR_OK;
    else if (timed_out)
        q->result = dtr__comm_fail(c, &q->a, r, e->rank, e->native_code, "timed out after %d ms: %s", q->a.timeout_ms, e->msg);
    else
        q->result = dtr__comm_fail(c, &q->a, r, e->rank, e->native_code, "%s", e->msg[0] ? e->msg : dtr_result_string(r));
    return q->result;
}

dtr_result dtr_request_test(dtr_request *q, int *done) {
    dtr_comm *c;
    dtr_result r;
    if (!q || !done) return DTR_NULL_HANDLE;
    c = q->comm;
    *done = 0;
    if (q->treq) { /* send/recv */
        dtr_transport_error e;
        dtr__terr_clear(&e);
        if (c->ep->vt->progress) c->ep->vt->progress(c->ep->state);
        r = c->ep->vt->test(c->ep->state, q->treq, done, &e);
        if (*done || r != DTR_OK) { *done = 1; return dtr__p2p_finish(q, r, &e, 0); }
        if (dtr_time_ns() >= q->a.deadline) {
            e.rank = c->ranks[q->a.root];
            snprintf(e.msg, sizeof(e.msg), "no matching %s from rank %d", q->a.kind == DTR__OP_SEND ? "receive" : "send",
                     e.rank);
            *done = 1;
            return dtr__p2p_finish(q, DTR_TIMEOUT, &e, 1);
        }
        return DTR_OK;
    }
    pthread_mutex_lock(&c->mu);
    *done = q->state == DTR__REQ_DONE;
    r = *done ? q->result : DTR_OK;
    pthread_mutex_unlock(&c->mu);
    return r;
}

dtr_result dtr_request_wait(dtr_request *q) {
    dtr_comm *c;
    dtr_result r;
    if (!q) return DTR_NULL_HANDLE;
    c = q->comm;
    if (q->treq) {
        dtr_transport_error e;
        for (;;) {
            int done = 0;
            dtr__terr_clear(&e);
            r = c->ep->vt->test(c->ep->state, q->treq, &done, &e);
            if (done || r != DTR_OK) return dtr__p2p_finish(q, r, &e, 0);
            r = c->ep->vt->wait_any(c->ep->state, &q->treq, 1, q->a.deadline, &e);
            if (r != DTR_OK) return dtr__p2p_finish(q, r, &e, r == DTR_TIMEOUT);
        }
    }
    pthread_mutex_lock(&c->mu);
    /* the request is next and nothing runs: run it on this thread rather than wake the
       progress thread and sleep (one hand-over less; the order is the same) */
    if (q->state == DTR__REQ_QUEUED && c->head == q && !c->running) dtr__comm_run_head(c);
    /* the progress thread ends every operation by its deadline; the grace covers a
       transport that overruns, so that this call cannot hang either */
    while (q->state != DTR__REQ_DONE) {
        int64_t limit = q->a.deadline + (int64_t)2000 * 1000000;
        if (dtr__cond_wait_until(&c->done_cv, &c->mu, limit) && q->state != DTR__REQ_DONE) {
            pthread_mutex_unlock(&c->mu);
            dtr__comm_fail(c, &q->a, DTR_TIMEOUT, -1, 0, "the transport did not end the operation by its deadline");
            dtr_comm_abort(c, "an operation overran its deadline");
            pthread_mutex_lock(&c->mu);
            while (q->state != DTR__REQ_DONE) dtr__cond_wait_until(&c->done_cv, &c->mu, -1);
        }
    }
    r = q->result;
    pthread_mutex_unlock(&c->mu);
    return r;
}

void dtr_request_destroy(dtr_request *q) {
    dtr_comm *c;
    if (!q) return;
    c = q->comm;
    if (q->treq) { /* a pending send/recv is cancelled */
        c->ep->vt->release(c->ep->state, q->treq);
        q->treq = NULL;
    } else if (q->state != DTR__REQ_DONE) {
        dtr_request_wait(q);
    }
    pthread_mutex_lock(&c->mu);
    q->next = c->free_reqs;
    c->free_reqs = q;
    c->live_reqs--;
    pthread_mutex_unlock(&c->mu);
}

/* ---- public collectives ---- */

static dtr__coll dtr__coll_make(int kind, const void *src, void *dst, size_t count, dtr_dtype dt, dtr_reduce_op op,
                                int root) {
    dtr__coll a;
    memset(&a, 0, sizeof(a));
    a.kind = kind;
    a.src = src;
    a.dst = dst;
    a.count = count;
    a.dtype = dt;
    a.op = op;
    a.root = root;
    return a;
}

dtr_result dtr_comm_all_reduce(dtr_comm *c, const void *src, void *dst, size_t count, dtr_dtype dt, dtr_reduce_op op) {
    dtr__coll a = dtr__coll_make(DTR__OP_ALL_REDUCE, src, dst, count, dt, op, 0);
    return dtr__coll_blocking(c, &a);
}
dtr_result dtr_comm_broadcast(dtr_comm *c, void *buf, size_t count, dtr_dtype dt, int root) {
    dtr__coll a = dtr__coll_make(DTR__OP_BROADCAST, buf, buf, count, dt, DTR_REDUCE_SUM, root);
    return dtr__coll_blocking(c, &a);
}
dtr_result dtr_comm_reduce_scatter(dtr_comm *c, const void *src, void *dst, size_t count, dtr_dtype dt,
                                   dtr_reduce_op op) {
    dtr__coll a = dtr__coll_make(DTR__OP_REDUCE_SCATTER, src, dst, count, dt, op, 0);
    return dtr__coll_blocking(c, &a);
}
dtr_result dtr_comm_all_gather(dtr_comm *c, const void *src, void *dst, size_t count, dtr_dtype dt) {
    dtr__coll a = dtr__coll_make(DTR__OP_ALL_GATHER, src, dst, count, dt, DTR_REDUCE_SUM, 0);
    return dtr__coll_blocking(c, &a);
}
dtr_result dtr_comm_barrier(dtr_comm *c) {
    dtr__coll a = dtr__coll_make(DTR__OP_BARRIER, NULL, NULL, 0, DTR_U8, DTR_REDUCE_SUM, 0);
    return dtr__coll_blocking(c, &a);
}
dtr_result dtr_comm_all_reduce_async(dtr_comm *c, const void *src, void *dst, size_t count, dtr_dtype dt,
                                     dtr_reduce_op op, dtr_request **req) {
    dtr__coll a = dtr__coll_make(DTR__OP_ALL_REDUCE, src, dst, count, dt, op, 0);
    return dtr__coll_async(c, &a, req);
}
dtr_result dtr_comm_broadcast_async(dtr_comm *c, void *buf, size_t count, dtr_dtype dt, int root, dtr_request **req) {
    dtr__coll a = dtr__coll_make(DTR__OP_BROADCAST, buf, buf, count, dt, DTR_REDUCE_SUM, root);
    return dtr__coll_async(c, &a, req);
}
dtr_result dtr_comm_reduce_scatter_async(dtr_comm *c, const void *src, void *dst, size_t count, dtr_dtype dt,
                                         dtr_reduce_op op, dtr_request **req) {
    dtr__coll a = dtr__coll_make(DTR__OP_REDUCE_SCATTER, src, dst, count, dt, op, 0);
    return dtr__coll_async(c, &a, req);
}
dtr_result dtr_comm_all_gather_async(dtr_comm *c, const void *src, void *dst, size_t count, dtr_dtype dt,
                                     dtr_request **req) {
    dtr__coll a = dtr__coll_make(DTR__OP_ALL_GATHER, src, dst, count, dt, DTR_REDUCE_SUM, 0);
    return dtr__coll_async(c, &a, req);
}
dtr_result dtr_comm_barrier_async(dtr_comm *c, dtr_request **req) {
    dtr__coll a = dtr__coll_make(DTR__OP_BARRIER, NULL, NULL, 0, DTR_U8, DTR_REDUCE_SUM, 0);
    return dtr__coll_async(c, &a, req);
}

/* ---- point-to-point ---- */

static dtr_result dtr__p2p_start(dtr_comm *c, int kind, const void *sbuf, void *rbuf, size_t bytes, int peer, int tag,
                                 dtr_request **out) {
    dtr__coll a = dtr__coll_make(kind, sbuf, rbuf, bytes, DTR_U8, DTR_REDUCE_SUM, peer);
    dtr_transport_error e;
    dtr_request *q;
    dtr_result r;
    *out = NULL;
    a.tag = tag;
    r = dtr__coll_prepare(c, &a);
    if (r != DTR_OK) return r;
    q = dtr__req_get(c);
    if (!q) return dtr__comm_fail(c, &a, DTR_OUT_OF_MEMORY, -1, 0, "out of memory");
    q->a = a;
    q->state = DTR__REQ_RUNNING;
    dtr__terr_clear(&e);
    if (kind == DTR__OP_SEND)
        r = c->ep->vt->isend(c->ep->state, sbuf, bytes, c->ranks[peer], dtr__tag_p2p(c->ctx, tag), &q->treq, &e);
    else
        r = c->ep->vt->irecv(c->ep->state, rbuf, bytes, c->ranks[peer], dtr__tag_p2p(c->ctx, tag), &q->treq, &e);
    if (r != DTR_OK) {
        pthread_mutex_lock(&c->mu);
        q->next = c->free_reqs;
        c->free_reqs = q;
        pthread_mutex_unlock(&c->mu);
        return dtr__comm_fail(c, &a, r, e.rank, e.native_code, "%s", e.msg);
    }
    pthread_mutex_lock(&c->mu);
    c->live_reqs++;
    pthread_mutex_unlock(&c->mu);
    *out = q;
    return DTR_OK;
}

dtr_result dtr_comm_send_async(dtr_comm *c, const void *buf, size_t bytes, int dst, int tag, dtr_request **req) {
    if (!req) return DTR_NULL_HANDLE;
    return dtr__p2p_start(c, DTR__OP_SEND, buf, NULL, bytes, dst, tag, req);
}
dtr_result dtr_comm_recv_async(dtr_comm *c, void *buf, size_t bytes, int src, int tag, dtr_request **req) {
    if (!req) return DTR_NULL_HANDLE;
    return dtr__p2p_start(c, DTR__OP_RECV, NULL, buf, bytes, src, tag, req);
}
dtr_result dtr_comm_send(dtr_comm *c, const void *buf, size_t bytes, int dst, int tag) {
    dtr_request *q;
    dtr_result r = dtr__p2p_start(c, DTR__OP_SEND, buf, NULL, bytes, dst, tag, &q);
    if (r != DTR_OK) return r;
    r = dtr_request_wait(q);
    dtr_request_destroy(q);
    return r;
}
dtr_result dtr_comm_recv(dtr_comm *c, void *buf, size_t bytes, int src, int tag) {
    dtr_request *q;
    dtr_result r = dtr__p2p_start(c, DTR__OP_RECV, NULL, buf, bytes, src, tag, &q);
    if (r != DTR_OK) return r;
    r = dtr_request_wait(q);
    dtr_request_destroy(q);
    return r;
}

/* ---- split ---- */

dtr_result dtr_comm_split(dtr_comm *c, int color, int key, dtr_comm **out) {
    dtr__coll a;
    int32_t mine[4], *all;
    dtr_comm *nc = NULL;
    dtr_result r;
    uint32_t ctx = 0;
    int i, n = 0, me = -1;
    if (!c || !out) return DTR_NULL_HANDLE;
    *out = NULL;
    a = dtr__coll_make(DTR__OP_SPLIT, NULL, NULL, 4, DTR_I32, DTR_REDUCE_SUM, 0);
    if (color < DTR_COMM_UNDEFINED) return dtr__comm_fail(c, &a, DTR_INVALID_ARGUMENT, -1, 0, "color %d < -1", color);
    all = (int32_t *)dtr__malloc(&c->ep->alloc, (size_t)c->size * sizeof(mine));
    if (!all) return dtr__comm_fail(c, &a, DTR_OUT_OF_MEMORY, -1, 0, "out of memory");
    pthread_mutex_lock(&c->ep->mu);
    mine[0] = color;
    mine[1] = key;
    mine[2] = (int32_t)c->ep->next_ctx;
    mine[3] = c->ep->info.rank - c->ep->info.local_rank; /* the machine: its first rank (ranks of a machine are contiguous) */
    pthread_mutex_unlock(&c->ep->mu);
    r = dtr_comm_all_gather(c, mine, all, 4, DTR_I32);
    if (r != DTR_OK) goto done;
    /* one context id for every sub-group of this split (they are disjoint): the largest
       "next free" id among the ranks of c, so no rank of c uses it yet */
    for (i = 0; i < c->size; i++)
        if ((uint32_t)all[4 * i + 2] > ctx) ctx = (uint32_t)all[4 * i + 2];
    if (ctx > DTR__MAX_CTX) {
        r = dtr__comm_fail(c, &a, DTR_UNSUPPORTED, -1, 0, "all %u context ids are used", DTR__MAX_CTX);
        goto done;
    }
    pthread_mutex_lock(&c->ep->mu);
    if (c->ep->next_ctx <= ctx) c->ep->next_ctx = ctx + 1;
    pthread_mutex_unlock(&c->ep->mu);
    if (color == DTR_COMM_UNDEFINED) goto done;
    for (i = 0; i < c->size; i++) n += all[4 * i] == color;
    r = dtr__comm_new(c->ep, n, &nc);
    if (r != DTR_OK) { r = dtr__comm_fail(c, &a, r, -1, 0, "out of memory"); goto done; }
    /* members ordered by (key, rank in c): insertion sort, n is small */
    n = 0;
    for (i = 0; i < c->size; i++) {
        int j;
        if (all[4 * i] != color) continue;
        for (j = n; j > 0 && all[4 * nc->ranks[j - 1] + 1] > all[4 * i + 1]; j--) nc->ranks[j] = nc->ranks[j - 1];
        nc->ranks[j] = i;
        n++;
    }
    for (i = 0; i < n; i++) {
        if (nc->ranks[i] == c->rank) me = i;
        nc->ranks[i] = c->ranks[nc->ranks[i]];   /* to transport ranks */
    }
    nc->rank = me;
    nc->ctx = ctx;
    nc->mem_ctx = c->mem_ctx;
    nc->timeout_ms = c->timeout_ms;
    nc->algo = c->algo;
    nc->ring_threshold = c->ring_threshold;
    nc->chain_threshold = c->chain_threshold;
    nc->segment = c->segment;
    nc->no_native = c->no_native;
    nc->shm_wanted = c->shm_wanted;
    nc->log = c->log;
    nc->log_user = c->log_user;
    nc->log_level = c->log_level;
    /* local rank: among the members on this machine, in group order */
    nc->local_rank = nc->local_size = 0;
    for (i = 0; i < n; i++) {
        int j;
        for (j = 0; j < c->size; j++)
            if (c->ranks[j] == nc->ranks[i]) break;
        if (all[4 * j + 3] != mine[3]) continue;
        if (i < me) nc->local_rank++;
        nc->local_size++;
    }
    if (c->ep->vt->group_create && !nc->no_native) {
        if (c->ep->vt->group_create(c->ep->state, nc->ranks, nc->size, nc->ctx, &nc->native_group) != DTR_OK)
            nc->native_group = NULL;
    }
    if (!nc->native_group && (r = dtr__shm_setup(nc)) != DTR_OK) {
        r = dtr__comm_fail(c, &a, r, dtr_comm_failed_rank(nc), 0, "setting up the sub-group: %s", nc->msg);
        dtr_comm_destroy(nc);
        goto done;
    }
    *out = nc;
done:
    dtr__free(&c->ep->alloc, all);
    return r;
}
#line 17858 "dtrain.h"

/* ---- src/transport/local.c ---- */
#line 1 "src/transport/local.c"
/* ============================================================================
 * The `local` transport: the ranks of a world are threads of this process.
 *
 * A dtr_local_world holds, per rank, the receives it has posted and the sends addressed to
 * it that no receive has matched yet ("unexpected"), both in posting order, under one
 * mutex. Matching is MPI's: a send takes the oldest posted receive with its (source, tag),
 * a receive the oldest unexpected send with its (source, tag). Data is copied once, from
 * the sender's buffer straight into the receiver's, outside the mutex:
 *   - a receive that finds its send already waiting copies at once (the receiver's thread);
 *   - a send that finds its receive posted copies itself when the message is small
 *     (< DTR__LOCAL_EAGER bytes), and otherwise hands the copy to the receiver, which does it
 *     in its next test or wait; so in a ring or an exchange each rank copies its own incoming
 *     data and the copies of different ranks run in parallel.
 * A send therefore completes when the receiver has the data (synchronous mode).
 * Waiting sleeps on the rank's condition variable with the caller's deadline.
 *
 * Failure: a rank that closes its endpoint fails its peers' pending requests with
 * DTR_PEER_FAILED naming it; abort(r) fails every rank's pending and later requests naming r.
 * When a wait times out, the world knows which ranks are blocked and on whom: the rank at
 * fault is found by following "waits for" from the peer until a rank that is not waiting
 * in the transport (it hangs, or computes past the deadline) or has left, and the world is
 * broken at once naming it, so every other rank fails with DTR_PEER_FAILED naming the same
 * rank.
 * ==========================================================================*/





#ifndef DTR__LOCAL_EAGER
#define DTR__LOCAL_EAGER 32768
#endif

enum { DTR__LR_POSTED = 0, DTR__LR_MATCHED = 1, DTR__LR_COPYING = 2, DTR__LR_DONE = 3 };

typedef struct dtr__lreq {
    struct dtr__lreq *next;          /* in a posting queue, a copy queue or the free list */
    struct dtr__lreq *lnext, *lprev; /* the owner's live requests */
    struct dtr__lreq *match;         /* the other side once matched */
    int is_send, owner, peer;
    uint64_t tag;
    void *buf;
    size_t bytes;
    int state;
    dtr_result result;
    int fail_rank;                   /* rank named by a failed result */
    char why[96];
} dtr__lreq;

typedef struct dtr__lqueue { dtr__lreq *head, *tail; } dtr__lqueue;

typedef struct dtr__lrank {
    pthread_cond_t cv;
    dtr__lqueue recvs;       /* receives this rank posted, not matched */
    dtr__lqueue sends;       /* sends to this rank, not matched */
    dtr__lqueue copies;      /* this rank's receives matched by a large send: it copies */
    dtr__lreq *live;         /* every request this rank holds */
    dtr__lreq *free_list;
    int opened, closed;
    int blocked;             /* threads of this rank waiting in the transport */
    int wait_peer;           /* the peer the latest of them waits for */
} dtr__lrank;

struct dtr_local_world {
    pthread_mutex_t mu;
    int size, refs;
    dtr_allocation_callbacks alloc;
    dtr__lrank *r;
    int failed_rank;         /* >= 0 once the world is broken */
    char why[200];
};

typedef struct dtr__lep {
    dtr_local_world *w;
    int rank;
} dtr__lep;

/* ---- world ---- */

dtr_result dtr_local_world_create(int size, const dtr_allocation_callbacks *alloc, dtr_local_world **out) {
    dtr_local_world *w;
    int i;
    if (!out) return DTR_NULL_HANDLE;
    *out = NULL;
    if (size < 1 || size > 4096) return DTR_INVALID_ARGUMENT;
    w = (dtr_local_world *)dtr__calloc(alloc, sizeof(*w));
    if (!w) return DTR_OUT_OF_MEMORY;
    if (alloc) w->alloc = *alloc;
    w->r = (dtr__lrank *)dtr__calloc(alloc, (size_t)size * sizeof(*w->r));
    if (!w->r) { dtr__free(alloc, w); return DTR_OUT_OF_MEMORY; }
    if (pthread_mutex_init(&w->mu, NULL) != 0) { dtr__free(alloc, w->r); dtr__free(alloc, w); return DTR_OUT_OF_MEMORY; }
    for (i = 0; i < size; i++) {
        if (dtr__cond_init(&w->r[i].cv) != 0) {
            while (--i >= 0) pthread_cond_destroy(&w->r[i].cv);
            pthread_mutex_destroy(&w->mu);
            dtr__free(alloc, w->r);
            dtr__free(alloc, w);
            return DTR_OUT_OF_MEMORY;
        }
        w->r[i].wait_peer = -1;
    }
    w->size = size;
    w->refs = 1;
    w->failed_rank = -1;
    *out = w;
    return DTR_OK;
}

static void dtr__local_world_free(dtr_local_world *w) {
    dtr_allocation_callbacks a = w->alloc;
    int i;
    for (i = 0; i < w->size; i++) {
        dtr__lreq *q = w->r[i].free_list, *n;
        while (q) { n = q->next; dtr__free(&a, q); q = n; }
        pthread_cond_destroy(&w->r[i].cv);
    }
    pthread_mutex_destroy(&w->mu);
    dtr__free(&a, w->r);
    dtr__free(&a, w);
}

/* drops one reference; frees on the last. Called without the lock held. */
static void dtr__local_world_unref(dtr_local_world *w) {
    int last;
    pthread_mutex_lock(&w->mu);
    last = --w->refs == 0;
    pthread_mutex_unlock(&w->mu);
    if (last) dtr__local_world_free(w);
}

void dtr_local_world_destroy(dtr_local_world *w) {
    if (w) dtr__local_world_unref(w);
}

int dtr_local_world_size(const dtr_local_world *w) { return w ? w->size : 0; }

/* ---- queues (world lock held) ---- */

static void dtr__lq_push(dtr__lqueue *q, dtr__lreq *r) {
    r->next = NULL;
    if (q->tail) q->tail->next = r;
    else q->head = r;
    q->tail = r;
}

static int dtr__lq_remove(dtr__lqueue *q, dtr__lreq *r) {
    dtr__lreq *p = NULL, *c = q->head;
    while (c && c != r) { p = c; c = c->next; }
    if (!c) return 0;
    if (p) p->next = c->next;
    else q->head = c->next;
    if (q->tail == c) q->tail = p;
    c->next = NULL;
    return 1;
}

/* the oldest request of q from `peer` (sends: owner; receives: peer) with `tag` */
static dtr__lreq *dtr__lq_take(dtr__lqueue *q, int peer, uint64_t tag, int by_owner) {
    dtr__lreq *p = NULL, *c = q->head;
    for (; c; p = c, c = c->next) {
        if (c->tag == tag && (by_owner ? c->owner : c->peer) == peer) {
            if (p) p->next = c->next;
            else q->head = c->next;
            if (q->tail == c) q->tail = p;
            c->next = NULL;
            return c;
        }
    }
    return NULL;
}

static dtr__lreq *dtr__lreq_new(dtr_local_world *w, int owner) {
    dtr__lrank *rk = &w->r[owner];
    dtr__lreq *q = rk->free_list;
    if (q) rk->free_list = q->next;
    else if (!(q = (dtr__lreq *)dtr__malloc(&w->alloc, sizeof(*q)))) return NULL;
    memset(q, 0, sizeof(*q));
    q->owner = owner;
    q->fail_rank = -1;
    q->lnext = rk->live;
    if (rk->live) rk->live->lprev = q;
    rk->live = q;
    return q;
}

static void dtr__lreq_put(dtr_local_world *w, dtr__lreq *q) {
    dtr__lrank *rk = &w->r[q->owner];
    if (q->lprev) q->lprev->lnext = q->lnext;
    else rk->live = q->lnext;
    if (q->lnext) q->lnext->lprev = q->lprev;
    q->next = rk->free_list;
    rk->free_list = q;
}

static void dtr__lreq_finish(dtr_local_world *w, dtr__lreq *q, dtr_result res, int fail_rank, const char *why) {
    q->state = DTR__LR_DONE;
    q->result = res;
    q->fail_rank = fail_rank;
    if (why) snprintf(q->why, sizeof(q->why), "%.*s", (int)sizeof(q->why) - 1, why);
    pthread_cond_broadcast(&w->r[q->owner].cv);
}

/* Copies send s into receive r (both COPYING, lock NOT held), then completes both. */
static void dtr__local_copy(dtr_local_world *w, dtr__lreq *s, dtr__lreq *r) {
    int fits = s->bytes <= r->bytes;
    if (fits && s->bytes) memcpy(r->buf, s->buf, s->bytes);
    pthread_mutex_lock(&w->mu);
    if (fits) {
        r->bytes = s->bytes;
        dtr__lreq_finish(w, s, DTR_OK, -1, NULL);
        dtr__lreq_finish(w, r, DTR_OK, -1, NULL);
    } else {
        char why[96];
        snprintf(why, sizeof why, "message of %zu bytes is longer than the %zu-byte receive", s->bytes, r->bytes);
        dtr__lreq_finish(w, s, DTR_INVALID_ARGUMENT, r->owner, why);
        dtr__lreq_finish(w, r, DTR_INVALID_ARGUMENT, s->owner, why);
    }
    s->match = r->match = NULL;
}

/* Copies every receive of `rank` that a large send matched (lock held on entry and exit). */
static void dtr__local_service(dtr_local_world *w, int rank) {
    dtr__lrank *rk = &w->r[rank];
    while (rk->copies.head) {
        dtr__lreq *r = rk->copies.head, *s = r->match;
        dtr__lq_remove(&rk->copies, r);
        r->state = s->state = DTR__LR_COPYING;
        pthread_mutex_unlock(&w->mu);
        dtr__local_copy(w, s, r);   /* returns with the lock held */
    }
}

/* ---- vtable ---- */

/* Every rank of a world is on this host, unless $DTR_RANKS_PER_HOST declares fake hosts of
 * k consecutive ranks (the last may hold fewer). */
static void dtr__local_host(int rank, int size, dtr_transport_info *info) {
    int k = dtr__fake_ranks_per_host(), first;
    if (k <= 0 || k > size) k = size;
    first = rank / k * k;
    info->rank = rank;
    info->size = size;
    info->local_rank = rank - first;
    info->local_size = size - first < k ? size - first : k;
}

static dtr_result dtr__local_open(const dtr_comm_config *cfg, void **state, dtr_transport_info *info, char *err,
                                  size_t errlen) {
    dtr_local_world *w = cfg->local.world;
    int rank = cfg->local.rank;
    dtr__lep *ep;
    if (!w) return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "local transport: dtr_comm_config.local.world is NULL "
                                                              "(make one with dtr_local_world_create)");
    if (rank < 0 || rank >= w->size)
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "local transport: rank %d outside the world of %d", rank,
                         w->size);
    ep = (dtr__lep *)dtr__calloc(&w->alloc, sizeof(*ep));
    if (!ep) return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "local transport: out of memory");
    pthread_mutex_lock(&w->mu);
    if (w->r[rank].opened) {
        pthread_mutex_unlock(&w->mu);
        dtr__free(&w->alloc, ep);
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "local transport: rank %d of this world was opened already",
                         rank);
    }
    w->r[rank].opened = 1;
    w->refs++;
    pthread_mutex_unlock(&w->mu);
    ep->w = w;
    ep->rank = rank;
    dtr__local_host(rank, w->size, info);
    *state = ep;
    return DTR_OK;
}

static void dtr__lerr(dtr_transport_error *err, int rank, const char *fmt, ...) DTR__PRINTF(3, 4);
static void dtr__lerr(dtr_transport_error *err, int rank, const char *fmt, ...) {
    va_list ap;
    if (!err) return;
    err->rank = rank;
    err->native_code = 0;
    va_start(ap, fmt);
    vsnprintf(err->msg, sizeof(err->msg), fmt, ap);
    va_end(ap);
}

/* the error a request to/from `peer` gets when the world or the peer is gone (lock held):
   DTR_OK when both are fine */
static dtr_result dtr__local_gone(dtr_local_world *w, int peer, int *who, const char **why) {
    if (w->failed_rank >= 0) { *who = w->failed_rank; *why = w->why; return DTR_PEER_FAILED; }
    if (w->r[peer].closed) { *who = peer; *why = "it left the group (closed its endpoint)"; return DTR_PEER_FAILED; }
    return DTR_OK;
}

static dtr_result dtr__local_post(dtr__lep *ep, int is_send, void *buf, size_t bytes, int peer, uint64_t tag, void **req,
                                  dtr_transport_error *err) {
    dtr_local_world *w = ep->w;
    dtr__lreq *q, *m;
    const char *why;
    int who;
    dtr_result r;
    *req = NULL;
    if (peer < 0 || peer >= w->size) {
        dtr__lerr(err, -1, "rank %d outside the world of %d", peer, w->size);
        return DTR_INVALID_ARGUMENT;
    }
    pthread_mutex_lock(&w->mu);
    if ((r = dtr__local_gone(w, peer, &who, &why)) != DTR_OK) {
        pthread_mutex_unlock(&w->mu);
        dtr__lerr(err, who, "rank %d failed: %s", who, why);
        return r;
    }
    q = dtr__lreq_new(w, ep->rank);
    if (!q) { pthread_mutex_unlock(&w->mu); dtr__lerr(err, -1, "out of memory"); return DTR_OUT_OF_MEMORY; }
    q->is_send = is_send;
    q->peer = peer;
    q->tag = tag;
    q->buf = buf;
    q->bytes = bytes;
    *req = q;
    if (is_send) {
        m = dtr__lq_take(&w->r[peer].recvs, ep->rank, tag, 0);
        if (!m) { dtr__lq_push(&w->r[peer].sends, q); pthread_mutex_unlock(&w->mu); return DTR_OK; }
        q->match = m;
        m->match = q;
        if (bytes < DTR__LOCAL_EAGER) {
            q->state = m->state = DTR__LR_COPYING;
            pthread_mutex_unlock(&w->mu);
            dtr__local_copy(w, q, m);
        } else { /* the receiver copies */
            q->state = m->state = DTR__LR_MATCHED;
            dtr__lq_push(&w->r[peer].copies, m);
            pthread_cond_broadcast(&w->r[peer].cv);
        }
    } else {
        m = dtr__lq_take(&w->r[ep->rank].sends, peer, tag, 1);
        if (!m) { dtr__lq_push(&w->r[ep->rank].recvs, q); pthread_mutex_unlock(&w->mu); return DTR_OK; }
        q->match = m;
        m->match = q;
        q->state = m->state = DTR__LR_COPYING;
        pthread_mutex_unlock(&w->mu);
        dtr__local_copy(w, m, q);
    }
    pthread_mutex_unlock(&w->mu);
    return DTR_OK;
}

static dtr_result dtr__local_isend(void *state, const void *buf, size_t bytes, int dst, uint64_t tag, void **req,
                                   dtr_transport_error *err) {
    return dtr__local_post((dtr__lep *)state, 1, (void *)(uintptr_t)buf, bytes, dst, tag, req, err);
}

static dtr_result dtr__local_irecv(void *state, void *buf, size_t bytes, int src, uint64_t tag, void **req,
                                   dtr_transport_error *err) {
    return dtr__local_post((dtr__lep *)state, 0, buf, bytes, src, tag, req, err);
}

/* 1 when q is complete (lock held); fails it first when its peer or the world is gone */
static int dtr__local_check(dtr_local_world *w, dtr__lreq *q) {
    const char *why;
    int who;
    if (q->state == DTR__LR_DONE) return 1;
    if (q->state == DTR__LR_COPYING) return 0;  /* a copy in progress always finishes */
    if (dtr__local_gone(w, q->peer, &who, &why) != DTR_OK) {
        /* unlink it from where it waits; its buffer is not touched any more */
        if (q->state == DTR__LR_POSTED) {
            if (q->is_send) dtr__lq_remove(&w->r[q->peer].sends, q);
            else dtr__lq_remove(&w->r[q->owner].recvs, q);
        } else { /* matched: the receive sits in a copy queue */
            dtr__lreq *m = q->match, *rv = q->is_send ? m : q;
            dtr__lq_remove(&w->r[rv->owner].copies, rv);
            if (m) {
                m->match = NULL;
                dtr__lreq_finish(w, m, DTR_PEER_FAILED, who, why);
            }
            q->match = NULL;
        }
        dtr__lreq_finish(w, q, DTR_PEER_FAILED, who, why);
        return 1;
    }
    return 0;
}

static dtr_result dtr__local_result(const dtr__lreq *q, dtr_transport_error *err) {
    if (q->result != DTR_OK) {
        if (q->result == DTR_PEER_FAILED) dtr__lerr(err, q->fail_rank, "rank %d failed: %s", q->fail_rank, q->why);
        else dtr__lerr(err, q->fail_rank, "%s", q->why);
    }
    return q->result;
}

static dtr_result dtr__local_test(void *state, void *req, int *done, dtr_transport_error *err) {
    dtr__lep *ep = (dtr__lep *)state;
    dtr_local_world *w = ep->w;
    dtr__lreq *q = (dtr__lreq *)req;
    dtr_result r = DTR_OK;
    pthread_mutex_lock(&w->mu);
    dtr__local_service(w, ep->rank);
    *done = dtr__local_check(w, q);
    if (*done) r = dtr__local_result(q, err);
    pthread_mutex_unlock(&w->mu);
    return r;
}

/* The rank at fault when a wait for `peer` times out: follow "waits for" (lock held). */
static int dtr__local_culprit(dtr_local_world *w, int me, int peer, int *cycle) {
    int q = peer, steps;
    *cycle = 0;
    for (steps = 0; steps <= w->size; steps++) {
        if (q < 0 || q == me) break;
        if (w->r[q].closed || w->r[q].blocked == 0) return q;
        q = w->r[q].wait_peer;
    }
    *cycle = 1;
    return peer;
}

static dtr_result dtr__local_wait_any(void *state, void *const *reqs, int n, int64_t deadline_ns,
                                      dtr_transport_error *err) {
    dtr__lep *ep = (dtr__lep *)state;
    dtr_local_world *w = ep->w;
    dtr__lrank *me = &w->r[ep->rank];
    dtr_result r = DTR_OK;
    int64_t spin_until = dtr_time_ns() + 20000;
    int i;
    pthread_mutex_lock(&w->mu);
    for (;;) {
        int pending_peer = -1, timed_out = 0;
        dtr__local_service(w, ep->rank);
        for (i = 0; i < n; i++) {
            dtr__lreq *q = (dtr__lreq *)reqs[i];
            if (!q) continue;
            if (dtr__local_check(w, q)) goto out;
            if (pending_peer < 0) pending_peer = q->peer;
        }
        if (pending_peer < 0) goto out; /* nothing to wait for */
        if (dtr_time_ns() >= deadline_ns) {
            int cycle, who = dtr__local_culprit(w, ep->rank, pending_peer, &cycle);
            if (cycle)
                dtr__lerr(err, who, "no message from rank %d, and the ranks it waits for wait in turn "
                                    "(mismatched collective calls?)", pending_peer);
            else if (who == pending_peer)
                dtr__lerr(err, who, "rank %d did not answer (it is not waiting in any call of the group)", who);
            else
                dtr__lerr(err, who, "rank %d did not answer: it waits for others, and rank %d, down that chain, "
                                    "is not waiting in any call of the group", pending_peer, who);
            /* break the world now, under the lock: a rank that times out a moment later
               must not mistake this one (no longer waiting) for the culprit */
            if (w->failed_rank < 0) {
                int k;
                w->failed_rank = who;
                snprintf(w->why, sizeof(w->why), "rank %d timed out waiting for it: %.150s", ep->rank, err ? err->msg : "");
                for (k = 0; k < w->size; k++) pthread_cond_broadcast(&w->r[k].cv);
            }
            r = DTR_TIMEOUT;
            goto out;
        }
        me->blocked++;
        me->wait_peer = pending_peer;
        if (dtr_time_ns() < spin_until) {
            /* the first microseconds: poll with the lock released (the peer is usually a
               moment away), then sleep on the condition variable */
            volatile int k;
            pthread_mutex_unlock(&w->mu);
            for (k = 0; k < 200; k++) {}
            pthread_mutex_lock(&w->mu);
        } else
            timed_out = dtr__cond_wait_until(&me->cv, &w->mu, deadline_ns);
        me->blocked--;
        (void)timed_out; /* the loop re-checks everything, the deadline included */
    }
out:
    pthread_mutex_unlock(&w->mu);
    return r;
}

static void dtr__local_release(void *state, void *req) {
    dtr__lep *ep = (dtr__lep *)state;
    dtr_local_world *w = ep->w;
    dtr__lreq *q = (dtr__lreq *)req;
    if (!q) return;
    pthread_mutex_lock(&w->mu);
    while (q->state == DTR__LR_COPYING) dtr__cond_wait_until(&w->r[q->owner].cv, &w->mu, -1);
    if (q->state == DTR__LR_POSTED) {
        if (q->is_send) dtr__lq_remove(&w->r[q->peer].sends, q);
        else dtr__lq_remove(&w->r[q->owner].recvs, q);
    } else if (q->state == DTR__LR_MATCHED) {
        dtr__lreq *m = q->match, *rv = q->is_send ? m : q;
        char why[64];
        dtr__lq_remove(&w->r[rv->owner].copies, rv);
        snprintf(why, sizeof why, "rank %d cancelled the transfer", q->owner);
        if (m) { m->match = NULL; dtr__lreq_finish(w, m, DTR_PEER_FAILED, q->owner, why); }
    }
    dtr__lreq_put(w, q);
    pthread_mutex_unlock(&w->mu);
}

static void dtr__local_close(void *state) {
    dtr__lep *ep = (dtr__lep *)state;
    dtr_local_world *w = ep->w;
    dtr__lrank *me = &w->r[ep->rank];
    int i;
    pthread_mutex_lock(&w->mu);
    me->closed = 1;
    /* fail every request of other ranks that waits on this one */
    for (i = 0; i < w->size; i++) {
        dtr__lreq *q;
        pthread_cond_broadcast(&w->r[i].cv);
        for (q = w->r[i].live; q; q = q->lnext)
            if (q->peer == ep->rank) dtr__local_check(w, q);
    }
    pthread_mutex_unlock(&w->mu);
    /* cancel what this rank still holds (release waits for copies in flight) */
    for (;;) {
        dtr__lreq *q;
        pthread_mutex_lock(&w->mu);
        q = me->live;
        pthread_mutex_unlock(&w->mu);
        if (!q) break;
        dtr__local_release(state, q);
    }
    dtr__free(&w->alloc, ep);
    dtr__local_world_unref(w);
}

static void dtr__local_abort(void *state, int failed_rank, const char *why) {
    dtr__lep *ep = (dtr__lep *)state;
    dtr_local_world *w = ep->w;
    int i;
    pthread_mutex_lock(&w->mu);
    if (w->failed_rank < 0) {
        w->failed_rank = failed_rank >= 0 && failed_rank < w->size ? failed_rank : ep->rank;
        snprintf(w->why, sizeof(w->why), "%s", why ? why : "the group was aborted");
    }
    for (i = 0; i < w->size; i++) pthread_cond_broadcast(&w->r[i].cv);
    pthread_mutex_unlock(&w->mu);
}

static const dtr_transport_vtable dtr__local_vtable = {
    DTR_VERSION_NUMBER, "local",
    dtr__local_open, dtr__local_close,
    dtr__local_isend, dtr__local_irecv, dtr__local_test, dtr__local_wait_any, dtr__local_release,
    dtr__local_abort,
    NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
    DTR_MEM_HOST
};

const dtr_transport_vtable *dtr_local_transport(void) { return &dtr__local_vtable; }
#line 18410 "dtrain.h"

/* ---- src/comm/collectives.c ---- */
#line 1 "src/comm/collectives.c"
/* ============================================================================
 * Collectives built over point-to-point messages, and the reduction kernels.
 *
 * N is the group size, r this rank, x_i the input of rank i. Reductions combine two
 * operands in a fixed order ("earlier" operand first), so results are the same bits on
 * every rank and in every run for a given N, count, dtype and algorithm:
 *
 *   ring all-reduce     chunk k (count split into N chunks, the first count % N one element
 *                       longer) is reduced along the ring starting at rank k+1:
 *                       ((x_{k+1} + x_{k+2}) + ...) + x_k, at rank k, then passed around
 *                       (all-gather). 2(N-1) steps, each moving count/N elements.
 *   recursive doubling  with p the largest power of two <= N and m = N - p: ranks 2i and
 *                       2i+1 (i < m) first fold into x_{2i} + x_{2i+1}; then the p remaining
 *                       partial sums are combined pairwise at distances 1, 2, 4, ... with the
 *                       lower-ranked partner's value first, i.e. a balanced tree over the
 *                       ranks in order; the folded-out ranks receive the result at the end.
 *   reduce-scatter      block k as the ring all-reduce's chunk k (same order).
 *   average             the sum, divided by N (f32) in the step that finishes it.
 *   bf16 / f16          each step converts its two operands to f32, combines them (and
 *                       divides, for the last step of an average) and rounds once to the
 *                       storage type (round to nearest even).
 * ==========================================================================*/





/* ---- reduction kernels ---- */

static inline float dtr__maxf(float a, float b) { return (a > b || a != a) ? a : b; } /* NaN wins */

void dtr__comm_reduce(void *out, const void *a, const void *b, size_t n, dtr_dtype dt, dtr_reduce_op op, int div) {
    size_t i;
    int is_max = op == DTR_REDUCE_MAX;
    float d = (float)(div > 1 ? div : 1);
    if (dt == DTR_F32) {
        /* blocks of 8 through local arrays: the basic-block vectorizer makes SIMD of each at
           -O2 although out may alias a or b (a block is loaded before it is stored); per
           element the operations are those of the scalar tail, so the results are the same */
        float *o = (float *)out;
        const float *x = (const float *)a, *y = (const float *)b;
        float tx[8], ty[8];
        int k;
        i = 0;
        if (is_max)
            for (; i + 8 <= n; i += 8) {
                memcpy(tx, x + i, sizeof tx);
                memcpy(ty, y + i, sizeof ty);
                for (k = 0; k < 8; k++) tx[k] = dtr__maxf(tx[k], ty[k]);
                memcpy(o + i, tx, sizeof tx);
            }
        else if (div > 1)
            for (; i + 8 <= n; i += 8) {
                memcpy(tx, x + i, sizeof tx);
                memcpy(ty, y + i, sizeof ty);
                for (k = 0; k < 8; k++) tx[k] = (tx[k] + ty[k]) / d;
                memcpy(o + i, tx, sizeof tx);
            }
        else
            for (; i + 8 <= n; i += 8) {
                memcpy(tx, x + i, sizeof tx);
                memcpy(ty, y + i, sizeof ty);
                for (k = 0; k < 8; k++) tx[k] = tx[k] + ty[k];
                memcpy(o + i, tx, sizeof tx);
            }
        for (; i < n; i++) o[i] = is_max ? dtr__maxf(x[i], y[i]) : div > 1 ? (x[i] + y[i]) / d : x[i] + y[i];
    } else if (dt == DTR_BF16) {
        uint16_t *o = (uint16_t *)out;
        const uint16_t *x = (const uint16_t *)a, *y = (const uint16_t *)b;
        for (i = 0; i < n; i++) {
            float fx = dtr_bf16_to_f32(x[i]), fy = dtr_bf16_to_f32(y[i]);
            o[i] = dtr_f32_to_bf16(is_max ? dtr__maxf(fx, fy) : div > 1 ? (fx + fy) / d : fx + fy);
        }
    } else if (dt == DTR_F16) {
        uint16_t *o = (uint16_t *)out;
        const uint16_t *x = (const uint16_t *)a, *y = (const uint16_t *)b;
        for (i = 0; i < n; i++) {
            float fx = dtr_f16_to_f32(x[i]), fy = dtr_f16_to_f32(y[i]);
            o[i] = dtr_f32_to_f16(is_max ? dtr__maxf(fx, fy) : div > 1 ? (fx + fy) / d : fx + fy);
        }
    }
}

/* The reduction step of an algorithm, on the backend that owns the group's buffers: the host
 * code above for host memory, the context's backend for device memory (cfg.memory). */
dtr_result dtr__coll_reduce(dtr_comm *c, void *out, const void *x, const void *y, size_t n, const dtr__coll *a, int div) {
    dtr_result r;
    if (!c->mem_ctx) {
        dtr__comm_reduce(out, x, y, n, a->dtype, a->op, div);
        return DTR_OK;
    }
    r = c->mem_ctx->backend->reduce(c->mem_ctx, out, x, y, n, a->dtype, (int)a->op, div);
    if (r != DTR_OK)
        return dtr__comm_fail(c, a, r, -1, 0, "the %s backend's reduction failed: %s", c->mem_ctx->backend->name,
                              dtr_context_last_error(c->mem_ctx));
    return DTR_OK;
}

/* ---- helpers ---- */

/* what the step that completes an average divides by (1 for other reductions) */
static int dtr__avg_div(const dtr_comm *c, const dtr__coll *a) {
    if (a->op != DTR_REDUCE_AVG) return 1;
    return a->avg_div ? a->avg_div : c->size;
}

static int dtr__mod(int a, int n) { return ((a % n) + n) % n; }

/* chunk k of `count` elements split into n: [*off, *off + *len) */
static void dtr__coll_chunk(size_t count, int n, int k, size_t *off, size_t *len) {
    size_t q = count / (size_t)n, rem = count % (size_t)n, kk = (size_t)k;
    *off = kk * q + (kk < rem ? kk : rem);
    *len = q + (kk < rem ? 1 : 0);
}

static dtr_result dtr__oom(dtr_comm *c, const dtr__coll *a, size_t bytes) {
    return dtr__comm_fail(c, a, DTR_OUT_OF_MEMORY, -1, 0, "out of memory for %zu bytes of scratch", bytes);
}

/* ---- all-reduce ---- */

/* Ring reduce-scatter into dst (chunk layout above): afterwards rank r holds the reduction
   of chunk r in dst. This rank's contributions are read from src (src may be dst), so an
   out-of-place call needs no copy first; dst's other chunks receive partials only. Steps
   0..N-2. */
static dtr_result dtr__ring_reduce_scatter(dtr_comm *c, const dtr__coll *a, const char *src, char *dst, char *tmp) {
    int N = c->size, r = c->rank, s, right = (r + 1) % N, left = (r + N - 1) % N;
    size_t es = dtr_dtype_size(a->dtype);
    dtr_result res;
    for (s = 0; s < N - 1; s++) {
        int ks = dtr__mod(r - s - 1, N), kr = dtr__mod(r - s - 2, N);
        size_t so, sl, ro, rl;
        dtr__coll_chunk(a->count, N, ks, &so, &sl);
        dtr__coll_chunk(a->count, N, kr, &ro, &rl);
        /* step 0 sends our own input; later steps the partial reduced at the step before */
        res = dtr__comm_sendrecv(c, a, (s == 0 ? src : dst) + so * es, sl * es, right, tmp, rl * es, left, (uint32_t)s);
        if (res != DTR_OK) return res;
        /* the partial of the ranks before us comes first */
        res = dtr__coll_reduce(c, dst + ro * es, tmp, src + ro * es, rl, a, s == N - 2 ? dtr__avg_div(c, a) : 1);
        if (res != DTR_OK) return res;
    }
    return DTR_OK;
}

/* Ring all-gather of chunk layout over dst: rank r owns chunk r. Steps base..base+N-2. */
static dtr_result dtr__ring_all_gather_chunks(dtr_comm *c, const dtr__coll *a, char *dst, uint32_t base) {
    int N = c->size, r = c->rank, s, right = (r + 1) % N, left = (r + N - 1) % N;
    size_t es = dtr_dtype_size(a->dtype);
    dtr_result res;
    for (s = 0; s < N - 1; s++) {
        int ks = dtr__mod(r - s, N), kr = dtr__mod(r - s - 1, N);
        size_t so, sl, ro, rl;
        dtr__coll_chunk(a->count, N, ks, &so, &sl);
        dtr__coll_chunk(a->count, N, kr, &ro, &rl);
        res = dtr__comm_sendrecv(c, a, dst + so * es, sl * es, right, dst + ro * es, rl * es, left, base + (uint32_t)s);
        if (res != DTR_OK) return res;
    }
    return DTR_OK;
}

static dtr_result dtr__all_reduce_ring(dtr_comm *c, const dtr__coll *a) {
    size_t es = dtr_dtype_size(a->dtype), off, len;
    char *dst = (char *)a->dst, *tmp;
    dtr_result res;
    dtr__coll_chunk(a->count, c->size, 0, &off, &len);  /* chunk 0 is the longest */
    tmp = (char *)dtr__comm_scratch(c, len * es);
    if (!tmp) return dtr__oom(c, a, len * es);
    res = dtr__ring_reduce_scatter(c, a, (const char *)a->src, dst, tmp);
    if (res != DTR_OK) return res;
    return dtr__ring_all_gather_chunks(c, a, dst, (uint32_t)c->size - 1);
}

static dtr_result dtr__all_reduce_rd(dtr_comm *c, const dtr__coll *a) {
    int N = c->size, r = c->rank, p = 1, m, nr, d;
    size_t es = dtr_dtype_size(a->dtype), bytes = a->count * es;
    char *dst = (char *)a->dst, *tmp;
    uint32_t step = 1;
    dtr_result res;
    while (p * 2 <= N) p *= 2;
    m = N - p;
    tmp = (char *)dtr__comm_scratch(c, bytes);
    if (!tmp) return dtr__oom(c, a, bytes);
    if (a->src != a->dst) memcpy(dst, a->src, bytes);
    /* fold: ranks 2i hand their data to 2i+1 (i < m) */
    if (r < 2 * m) {
        if (r % 2 == 0) {
            res = dtr__comm_sendrecv(c, a, dst, bytes, r + 1, NULL, 0, -1, 0);
            if (res != DTR_OK) return res;
            nr = -1;
        } else {
            res = dtr__comm_sendrecv(c, a, NULL, 0, -1, tmp, bytes, r - 1, 0);
            if (res != DTR_OK) return res;
            res = dtr__coll_reduce(c, dst, tmp, dst, a->count, a, 1);
            if (res != DTR_OK) return res;
            nr = r / 2;
        }
    } else {
        nr = r - m;
    }
    if (nr >= 0) {
        for (d = 1; d < p; d *= 2, step++) {
            int pn = nr ^ d, partner = pn < m ? 2 * pn + 1 : pn + m;
            int div = d * 2 >= p ? dtr__avg_div(c, a) : 1;
            res = dtr__comm_sendrecv(c, a, dst, bytes, partner, tmp, bytes, partner, step);
            if (res != DTR_OK) return res;
            res = nr < pn ? dtr__coll_reduce(c, dst, dst, tmp, a->count, a, div) : dtr__coll_reduce(c, dst, tmp, dst, a->count, a, div);
            if (res != DTR_OK) return res;
        }
    }
    /* unfold: the result goes back to the folded-out ranks */
    if (r < 2 * m) {
        if (r % 2 == 1) res = dtr__comm_sendrecv(c, a, dst, bytes, r - 1, NULL, 0, -1, 0xffffffu);
        else res = dtr__comm_sendrecv(c, a, NULL, 0, -1, dst, bytes, r + 1, 0xffffffu);
        if (res != DTR_OK) return res;
    }
    return DTR_OK;
}

/* ---- hierarchical all-reduce ---- */

/* Runs collective `sub` on a child group of c (host or leaders) inside c's collective `a`:
 * the child's sequence number, a's deadline; a failure there is c's failure. */
static dtr_result dtr__coll_child(dtr_comm *c, const dtr__coll *a, dtr_comm *child, dtr__coll *sub) {
    dtr_result r;
    sub->seq = child->seq++;
    if (sub->kind == DTR__OP_ALL_REDUCE) sub->algo = dtr__auto_algo(child, sub->count, sub->dtype);
    r = dtr__coll_run(child, sub);
    if (r == DTR_OK) return DTR_OK;
    return dtr__comm_fail(c, a, r, dtr_comm_failed_rank(child), dtr_comm_native_error(child), "in the %s group: %s",
                          child == c->host ? "host" : "leaders'", dtr_comm_last_error(child));
}

/* Sum inside the host, all-reduce of the hosts' sums between the leaders (an average is
 * divided by the whole group's size in its last step), broadcast inside the host. */
static dtr_result dtr__all_reduce_hier(dtr_comm *c, const dtr__coll *a) {
    dtr__coll s = *a;
    dtr_result r;
    s.op = a->op == DTR_REDUCE_AVG ? DTR_REDUCE_SUM : a->op;
    if ((r = dtr__coll_child(c, a, c->host, &s)) != DTR_OK) return r;
    if (c->leaders) {
        s = *a;
        s.src = a->dst;
        s.avg_div = c->size;
        if ((r = dtr__coll_child(c, a, c->leaders, &s)) != DTR_OK) return r;
    }
    s = *a;
    s.kind = DTR__OP_BROADCAST;
    s.root = 0;
    return dtr__coll_child(c, a, c->host, &s);
}

/* hierarchical only where it changes something (decided alike on every rank) */
static int dtr__use_hier(const dtr_comm *c) { return c->hier_ready && c->hier_on; }

/* ---- broadcast ---- */

static dtr_result dtr__broadcast_tree(dtr_comm *c, const dtr__coll *a) {
    int N = c->size, vr = dtr__mod(c->rank - a->root, N), mask = 1, n = 0;
    size_t bytes = a->count * dtr_dtype_size(a->dtype);
    const dtr_transport_vtable *vt = c->ep->vt;
    uint64_t tag = dtr__tag_coll(c->ctx, a->seq, 0);
    void *reqs[32];
    dtr_transport_error e;
    dtr_result res;
    while (mask < N) {
        if (vr & mask) {
            res = dtr__comm_sendrecv(c, a, NULL, 0, -1, a->dst, bytes, dtr__mod(vr - mask + a->root, N), 0);
            if (res != DTR_OK) return res;
            break;
        }
        mask <<= 1;
    }
    for (mask >>= 1; mask > 0; mask >>= 1) {
        if (vr + mask < N) {
            e.rank = -1; e.native_code = 0; e.msg[0] = 0;
            res = vt->isend(c->ep->state, a->dst, bytes, c->ranks[dtr__mod(vr + mask + a->root, N)], tag, &reqs[n], &e);
            if (res != DTR_OK) {
                while (n > 0) vt->release(c->ep->state, reqs[--n]);
                return dtr__comm_fail(c, a, res, e.rank, e.native_code, "%s", e.msg);
            }
            n++;
        }
    }
    return n ? dtr__comm_waitall(c, a, reqs, n) : DTR_OK;
}

#define DTR__CHAIN_WINDOW 4

/* Pipelined chain root -> root+1 -> ...: segment k goes on as soon as it has arrived. */
static dtr_result dtr__broadcast_chain(dtr_comm *c, const dtr__coll *a) {
    int N = c->size, vr = dtr__mod(c->rank - a->root, N);
    int prev = vr > 0 ? dtr__mod(c->rank - 1, N) : -1, next = vr + 1 < N ? (c->rank + 1) % N : -1;
    size_t bytes = a->count * dtr_dtype_size(a->dtype), seg = c->segment, nseg, k, posted = 0;
    const dtr_transport_vtable *vt = c->ep->vt;
    void *rq[DTR__CHAIN_WINDOW], *sq[DTR__CHAIN_WINDOW];
    char *buf = (char *)a->dst;
    dtr_transport_error e;
    dtr_result res = DTR_OK;
    int i;
    if (seg < 4096) seg = 4096;
    while (bytes / seg >= ((size_t)1 << 23)) seg *= 2;   /* segment index fits a tag step */
    nseg = (bytes + seg - 1) / seg;
    for (i = 0; i < DTR__CHAIN_WINDOW; i++) rq[i] = sq[i] = NULL;
    e.rank = -1; e.native_code = 0; e.msg[0] = 0;
    for (k = 0; k < nseg; k++) {
        size_t off = k * seg, len = bytes - off < seg ? bytes - off : seg;
        int w = (int)(k % DTR__CHAIN_WINDOW);
        if (prev >= 0) {
            /* keep up to WINDOW receives posted ahead */
            while (posted < nseg && posted < k + DTR__CHAIN_WINDOW) {
                size_t po = posted * seg, pl = bytes - po < seg ? bytes - po : seg;
                res = vt->irecv(c->ep->state, buf + po, pl, c->ranks[prev], dtr__tag_coll(c->ctx, a->seq, (uint32_t)posted),
                                &rq[posted % DTR__CHAIN_WINDOW], &e);
                if (res != DTR_OK) goto fail;
                posted++;
            }
            res = dtr__comm_waitall(c, a, &rq[w], 1);
            if (res != DTR_OK) goto out;
        }
        if (next >= 0) {
            if (sq[w]) { res = dtr__comm_waitall(c, a, &sq[w], 1); if (res != DTR_OK) goto out; }
            res = vt->isend(c->ep->state, buf + off, len, c->ranks[next], dtr__tag_coll(c->ctx, a->seq, (uint32_t)k), &sq[w], &e);
            if (res != DTR_OK) goto fail;
        }
    }
    return dtr__comm_waitall(c, a, sq, DTR__CHAIN_WINDOW);
fail:
    res = dtr__comm_fail(c, a, res, e.rank, e.native_code, "%s", e.msg);
out:
    for (i = 0; i < DTR__CHAIN_WINDOW; i++) {
        if (rq[i]) vt->release(c->ep->state, rq[i]);
        if (sq[i]) vt->release(c->ep->state, sq[i]);
    }
    return res;
}

/* ---- reduce-scatter, all-gather, barrier ---- */

static dtr_result dtr__reduce_scatter_ring(dtr_comm *c, const dtr__coll *a) {
    int N = c->size, r = c->rank, s, right = (r + 1) % N, left = (r + N - 1) % N;
    size_t es = dtr_dtype_size(a->dtype), bytes = a->count * es;
    const char *src = (const char *)a->src;
    char *buf[2];
    dtr_result res;
    if (N == 1) {
        memcpy(a->dst, a->src, bytes);
        return DTR_OK;
    }
    buf[0] = (char *)dtr__comm_scratch(c, 2 * bytes);
    if (!buf[0]) return dtr__oom(c, a, 2 * bytes);
    buf[1] = buf[0] + bytes;
    /* step s: send the partial of block r-s-1 (at s = 0 our own input), receive the partial
       of block r-s-2 and add our input to it */
    for (s = 0; s < N - 1; s++) {
        int ks = dtr__mod(r - s - 1, N), kr = dtr__mod(r - s - 2, N);
        const char *sb = s == 0 ? src + (size_t)ks * bytes : buf[(s - 1) % 2];
        char *rb = buf[s % 2];
        res = dtr__comm_sendrecv(c, a, sb, bytes, right, rb, bytes, left, (uint32_t)s);
        if (res != DTR_OK) return res;
        if (s == N - 2)
            res = dtr__coll_reduce(c, a->dst, rb, src + (size_t)kr * bytes, a->count, a, dtr__avg_div(c, a));
        else
            res = dtr__coll_reduce(c, rb, rb, src + (size_t)kr * bytes, a->count, a, 1);
        if (res != DTR_OK) return res;
    }
    return DTR_OK;
}

static dtr_result dtr__all_gather_ring(dtr_comm *c, const dtr__coll *a) {
    int N = c->size, r = c->rank, s, right = (r + 1) % N, left = (r + N - 1) % N;
    size_t es = dtr_dtype_size(a->dtype), bytes = a->count * es;
    char *dst = (char *)a->dst;
    dtr_result res;
    if (a->src != dst + (size_t)r * bytes) memcpy(dst + (size_t)r * bytes, a->src, bytes);
    for (s = 0; s < N - 1; s++) {
        int ks = dtr__mod(r - s, N), kr = dtr__mod(r - s - 1, N);
        res = dtr__comm_sendrecv(c, a, dst + (size_t)ks * bytes, bytes, right, dst + (size_t)kr * bytes, bytes, left,
                                 (uint32_t)s);
        if (res != DTR_OK) return res;
    }
    return DTR_OK;
}

static dtr_result dtr__barrier_dissemination(dtr_comm *c, const dtr__coll *a) {
    int N = c->size, r = c->rank, k;
    dtr_result res;
    for (k = 0; (1 << k) < N; k++) {
        res = dtr__comm_sendrecv(c, a, NULL, 0, (r + (1 << k)) % N, NULL, 0, dtr__mod(r - (1 << k), N), (uint32_t)k);
        if (res != DTR_OK) return res;
    }
    return DTR_OK;
}

/* ---- dispatch ---- */

static dtr_result dtr__coll_native(dtr_comm *c, const dtr__coll *a, int *used) {
    const dtr_transport_vtable *vt = c->ep->vt;
    void *st = c->ep->state, *g = c->native_group;
    dtr_transport_error e;
    dtr_result r = DTR_OK;
    *used = 1;
    e.rank = -1; e.native_code = 0; e.msg[0] = 0;
    if (a->kind == DTR__OP_ALL_REDUCE && vt->all_reduce)
        r = vt->all_reduce(st, g, a->src, a->dst, a->count, a->dtype, a->op, a->deadline, &e);
    else if (a->kind == DTR__OP_BROADCAST && vt->broadcast)
        r = vt->broadcast(st, g, a->dst, a->count, a->dtype, a->root, a->deadline, &e);
    else if (a->kind == DTR__OP_REDUCE_SCATTER && vt->reduce_scatter)
        r = vt->reduce_scatter(st, g, a->src, a->dst, a->count, a->dtype, a->op, a->deadline, &e);
    else if (a->kind == DTR__OP_ALL_GATHER && vt->all_gather)
        r = vt->all_gather(st, g, a->src, a->dst, a->count, a->dtype, a->deadline, &e);
    else if (a->kind == DTR__OP_BARRIER && vt->barrier)
        r = vt->barrier(st, g, a->deadline, &e);
    else
        *used = 0;
    if (*used && r != DTR_OK) {
        if (r == DTR_TIMEOUT)
            return dtr__comm_fail(c, a, r, e.rank, e.native_code, "timed out after %d ms: %s", a->timeout_ms, e.msg);
        return dtr__comm_fail(c, a, r, e.rank, e.native_code, "%s", e.msg[0] ? e.msg : dtr_result_string(r));
    }
    return r;
}

/* the all-reduce algorithm that runs: the one asked for, AUTO's pick, or hierarchical where
 * it changes something */
static int dtr__effective_algo(const dtr_comm *c, const dtr__coll *a) {
    if (a->algo == DTR_ALLREDUCE_RING || a->algo == DTR_ALLREDUCE_RECURSIVE_DOUBLING) return a->algo;
    if (a->algo == DTR_ALLREDUCE_HIERARCHICAL && dtr__use_hier(c)) return a->algo;
    return dtr__auto_algo(c, a->count, a->dtype);
}

dtr_result dtr__coll_run(dtr_comm *c, const dtr__coll *in) {
    size_t es = dtr_dtype_size(in->dtype);
    dtr__coll b = *in, *a = &b;
    dtr_result r;
    int used = 0;
    if (c->size == 1) { /* no communication: copy (and an average over one rank is the value) */
        if (a->kind == DTR__OP_ALL_REDUCE || a->kind == DTR__OP_REDUCE_SCATTER || a->kind == DTR__OP_ALL_GATHER)
            if (a->src != a->dst && a->count) memcpy(a->dst, a->src, a->count * es);
        return DTR_OK;
    }
    if (a->count == 0 && a->kind != DTR__OP_BARRIER) return DTR_OK;   /* the same on every rank */
    if (c->native_group) {
        r = dtr__coll_native(c, a, &used);
        if (used) return r;
    }
    if (a->kind == DTR__OP_ALL_REDUCE) b.algo = dtr__effective_algo(c, a);
    if (a->kind == DTR__OP_ALL_REDUCE && a->algo == DTR_ALLREDUCE_HIERARCHICAL) {
        r = dtr__all_reduce_hier(c, a);
    } else if (dtr__shm_run(c, a, &r)) {
        /* done through the group's shared memory */
    } else switch (a->kind) {
    case DTR__OP_ALL_REDUCE:
        r = a->algo == DTR_ALLREDUCE_RING ? dtr__all_reduce_ring(c, a) : dtr__all_reduce_rd(c, a);
        break;
    case DTR__OP_BROADCAST:
        r = a->count * es >= c->chain_threshold ? dtr__broadcast_chain(c, a) : dtr__broadcast_tree(c, a);
        break;
    case DTR__OP_REDUCE_SCATTER: r = dtr__reduce_scatter_ring(c, a); break;
    case DTR__OP_ALL_GATHER: r = dtr__all_gather_ring(c, a); break;
    case DTR__OP_BARRIER: r = dtr__barrier_dissemination(c, a); break;
    default: r = dtr__comm_fail(c, a, DTR_INVALID_ARGUMENT, -1, 0, "not a collective");
    }
    if (r != DTR_OK && r != DTR_TIMEOUT && r != DTR_PEER_FAILED) {
        /* this rank cannot finish its part: the others would wait for it until their
           deadline, so break the group now */
        char why[160];
        snprintf(why, sizeof why, "rank %d could not take part in %s #%u: %s", c->ep->info.rank, dtr__coll_name(a->kind),
                 a->seq, dtr_result_string(r));
        pthread_mutex_lock(&c->mu);
        if (c->status != DTR_TIMEOUT && c->status != DTR_PEER_FAILED) {
            c->status = DTR_PEER_FAILED;
            c->failed_rank = c->ep->info.rank;
        }
        pthread_mutex_unlock(&c->mu);
        c->ep->vt->abort(c->ep->state, c->ep->info.rank, why);
    }
    return r;
}
#line 18892 "dtrain.h"

/* ---- src/comm/shm.c ---- */
#line 1 "src/comm/shm.c"
/* ============================================================================
 * Shared-memory collectives: the ranks of a group that are processes of one host map one
 * segment and run every collective through it instead of through the transport.
 *
 * Segment: a header with two counters per rank (each on its own cache line), a slot of S
 * bytes per rank, and two result buffers of S bytes. Every collective goes in epochs of at
 * most S bytes per rank (the same count on every rank: the collectives are called in the
 * same order). In epoch e a rank
 *   A. copies its part of the input into its slot and publishes in = e;
 *   B. waits until every rank's `in` reached e (or only the root's, for a broadcast), then
 *      computes its share of the result from the peers' slots (a reduction reads its slice of
 *      every slot, in the documented order of the algorithm the group would have used, so
 *      results are bit for bit those of the point-to-point path), writing it into the
 *      epoch's result buffer (or straight into its output), and publishes red = e;
 *   C. waits until every rank's `red` reached e and copies the result out.
 * A slot is written again only in epoch e + 1, after every rank passed B of epoch e; the
 * result buffers alternate, so a slow reader of epoch e never sees epoch e + 1's writes.
 *
 * Waits spin briefly, then yield, then nap, and check the deadline, an abort flag in the
 * header (a rank that fails sets it), and a zero-byte receive posted on the transport at
 * setup that never matches: the transport fails it when a peer dies or the world aborts, so
 * a killed rank turns into DTR_PEER_FAILED here too. Setup (dtr__shm_setup, collective at
 * group creation) uses the transport: rank 0 creates the segment and broadcasts its name,
 * the others map it, all agree (or all fall back), and the name is unlinked at once.
 * ==========================================================================*/





#if defined(__unix__) || defined(__APPLE__)
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>
/* compiled after the app's headers: under strict ISO C glibc hides these (see comm.c) */
#if defined(__GLIBC__) && !defined(__USE_POSIX199309) && !defined(__cplusplus)
extern int nanosleep(const struct timespec *req, struct timespec *rem);
#endif
#if defined(__GLIBC__) && !defined(__USE_POSIX) && !defined(__cplusplus)
extern int kill(__pid_t pid, int sig);
#endif
#if defined(__GLIBC__) && !defined(__USE_XOPEN2K8) && !defined(__USE_XOPEN_EXTENDED) && !defined(__cplusplus)
extern int ftruncate(int fd, __off_t length);
#endif

/* Shared with the process transports' watchdog (src/comm/watchdog.c, in dtrain_comm.c). */
int dtr__pid_dead(int64_t pid) {
    char path[64], buf[512], *p;
    FILE *f;
    size_t n;
    if (pid <= 0) return 0;
    if (kill((pid_t)pid, 0) != 0 && errno == ESRCH) return 1;
    snprintf(path, sizeof path, "/proc/%lld/stat", (long long)pid);
    if (!(f = fopen(path, "r"))) return 0;   /* no /proc: kill() is all we know */
    n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    p = strrchr(buf, ')');
    return p && p[1] == ' ' && (p[2] == 'Z' || p[2] == 'X');
}
#define DTR__HAVE_SHM DTR__HAVE_ATOMICS
#else
#define DTR__HAVE_SHM 0
#endif

#if DTR__HAVE_SHM

#define DTR__SHM_MAGIC 0x64747273686d3031ULL /* "dtrshm01" */
/* Collectives of at most this many bytes per rank go through the segment, larger ones through
 * the transport: measured at world 2 (docs/distributed.md) the segment matched or beat
 * libfabric's shm provider from 8 to 128 KiB, and lost from 256 KiB on (single copy there). */
#define DTR__SHM_MAX_BYTES ((size_t)128 << 10)

typedef struct dtr__shm_counter {
    uint64_t in;            /* the epoch whose input is in this rank's slot */
    char pad0[56];
    uint64_t red;           /* the epoch whose share this rank computed */
    int64_t pid;            /* the rank's process, watched while others wait for it */
    char pad1[48];
} dtr__shm_counter;

typedef struct dtr__shm_hdr {
    uint64_t magic;
    uint64_t slot;          /* S */
    int32_t size;
    int32_t abort_rank;     /* -1; else the group rank that failed (first writer wins) */
    char pad[40];
    dtr__shm_counter r[1];  /* size of them */
} dtr__shm_hdr;

struct dtr__shm {
    char *base;
    size_t bytes, slot;
    dtr__shm_hdr *h;
    char *slots, *out[2];
    uint64_t epoch;
    void *sentinel;         /* the transport's never-matching receive */
    int on;                 /* every rank mapped it: the collectives use it */
    int64_t next_check;     /* dtr_time_ns of the next look at the peers' processes */
};

static size_t dtr__shm_hdr_bytes(int n) {
    size_t b = sizeof(dtr__shm_hdr) + (size_t)n * sizeof(dtr__shm_counter);
    return (b + 4095) & ~(size_t)4095;
}

static size_t dtr__shm_slot_bytes(int n) { return n <= 8 ? (size_t)256 << 10 : (size_t)128 << 10; }

/* ---- setup and teardown ---- */

static void dtr__shm_name(char *out, size_t cap, const uint32_t *token) {
    snprintf(out, cap, "/dtr-%ld-%08x%08x", (long)getuid(), token[0], token[1]);
}

/* maps the segment `name` (creating it on rank 0); NULL on any failure */
static dtr__shm *dtr__shm_map(dtr_comm *c, const char *name, int create) {
    size_t slot = dtr__shm_slot_bytes(c->size), bytes = dtr__shm_hdr_bytes(c->size) + (size_t)(c->size + 2) * slot;
    int fd = shm_open(name, create ? O_CREAT | O_EXCL | O_RDWR : O_RDWR, 0600);
    struct stat st;
    dtr__shm *s;
    void *p;
    if (fd < 0) return NULL;
    if ((create && ftruncate(fd, (off_t)bytes) != 0) || fstat(fd, &st) != 0 || (size_t)st.st_size != bytes) {
        close(fd);
        return NULL;
    }
    p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) return NULL;
    s = (dtr__shm *)dtr__calloc(&c->ep->alloc, sizeof(*s));
    if (!s) { munmap(p, bytes); return NULL; }
    s->base = (char *)p, s->bytes = bytes, s->slot = slot, s->h = (dtr__shm_hdr *)p;
    s->slots = s->base + dtr__shm_hdr_bytes(c->size);
    s->out[0] = s->slots + (size_t)c->size * slot;
    s->out[1] = s->out[0] + slot;
    if (create) {
        s->h->slot = slot, s->h->size = c->size, s->h->abort_rank = -1;
        DTR__ATOMIC_STORE(&s->h->magic, DTR__SHM_MAGIC);
    }
    return s;
}

void dtr__shm_free(dtr_comm *c) {
    dtr__shm *s = c->shm;
    if (!s) return;
    if (s->sentinel) c->ep->vt->release(c->ep->state, s->sentinel);
    munmap(s->base, s->bytes);
    dtr__free(&c->ep->alloc, s);
    c->shm = NULL;
}

/* 1 when this group wants a segment (cfg.shared_memory; $DTR_COMM_SHM=0 or 1 overrides)
 * and may use one: processes of one host (not the local transport's threads; other
 * transports' threads decline at setup), host buffers, 2 to 64 ranks */
static int dtr__shm_eligible(const dtr_comm *c) {
    const char *env = getenv("DTR_COMM_SHM");
    int wanted = env && *env ? strcmp(env, "0") != 0 : c->shm_wanted;
    return wanted && c->ep->vt != dtr_local_transport() && !c->mem_ctx && c->size > 1 && c->size <= 64 &&
           c->local_size == c->size;
}

static int dtr__shm_check(const dtr__shm *s, const dtr_comm *c) {
    return s && DTR__ATOMIC_LOAD(&s->h->magic) == DTR__SHM_MAGIC && s->h->size == c->size && s->h->slot == s->slot;
}

/* posts the never-matching receive that reports the world's failures */
static int dtr__shm_post_sentinel(dtr_comm *c) {
    dtr_transport_error e;
    int peer = c->ranks[(c->rank + 1) % c->size];
    return c->ep->vt->irecv(c->ep->state, NULL, 0, peer, dtr__tag_coll(c->ctx, 0xffffffffu, 0xffffffu), &c->shm->sentinel,
                            &e) == DTR_OK;
}

dtr_result dtr__shm_setup(dtr_comm *c) {
    uint32_t msg[4] = {0, 0, 0, 0};   /* token, rank 0 mapped it, rank 0's pid */
    char name[64];
    float ok;
    dtr_result r;
    if (!dtr__shm_eligible(c)) return DTR_OK;
    if (c->rank == 0) {
        int64_t t = dtr_time_ns();
        msg[0] = (uint32_t)t ^ (uint32_t)getpid();
        msg[1] = (uint32_t)((uint64_t)t >> 32) ^ (uint32_t)(uintptr_t)c;
        dtr__shm_name(name, sizeof name, msg);
        c->shm = dtr__shm_map(c, name, 1);
        msg[2] = c->shm != NULL;
        msg[3] = (uint32_t)getpid();
    }
    if ((r = dtr_comm_broadcast(c, msg, 4, DTR_I32, 0)) != DTR_OK) { dtr__shm_free(c); return r; }
    dtr__shm_name(name, sizeof name, msg);
    /* threads of one process (a transport of the app's own) gain nothing: all decline */
    if (c->rank != 0 && msg[2] && msg[3] != (uint32_t)getpid()) c->shm = dtr__shm_map(c, name, 0);
    ok = dtr__shm_check(c->shm, c) && dtr__shm_post_sentinel(c) ? 1.0f : 0.0f;
    if (ok > 0.5f) DTR__ATOMIC_STORE(&c->shm->h->r[c->rank].pid, (int64_t)getpid());
    r = dtr_comm_all_reduce(c, &ok, &ok, 1, DTR_F32, DTR_REDUCE_SUM);   /* ranks that could map it */
    if (c->rank == 0 && msg[2]) shm_unlink(name);   /* mapped by all who could: no file is left behind */
    if (r != DTR_OK || ok < (float)c->size - 0.5f) dtr__shm_free(c);
    else c->shm->on = 1;
    return r;
}

/* ---- waiting ---- */

/* the first rank (all: -1) whose counter at `off` is below e, or -1 when none is */
static int dtr__shm_behind(const dtr__shm *s, int n, int only, size_t off, uint64_t e) {
    int j;
    for (j = 0; j < n; j++) {
        const uint64_t *p = (const uint64_t *)((const char *)&s->h->r[j] + off);
        if ((only < 0 || j == only) && DTR__ATOMIC_LOAD(p) < e) return j;
    }
    return -1;
}

static void dtr__shm_nap(int64_t ns) {
    struct timespec ts;
    ts.tv_sec = 0;
    ts.tv_nsec = (long)ns;
    nanosleep(&ts, NULL);
}

/* the first peer whose process died, or -1 */
static int dtr__shm_dead_peer(dtr_comm *c) {
    int j;
    for (j = 0; j < c->size; j++)
        if (j != c->rank && dtr__pid_dead(DTR__ATOMIC_LOAD(&c->shm->h->r[j].pid))) return j;
    return -1;
}

/* DTR_OK, or the failure that stops the wait: a rank's abort flag, a peer's death, the
 * transport's report (its never-matching receive failed), the deadline */
static dtr_result dtr__shm_check_fail(dtr_comm *c, const dtr__coll *a, int waiting_for) {
    dtr__shm *s = c->shm;
    dtr_transport_error e;
    int done = 0, who = DTR__ATOMIC_LOAD(&s->h->abort_rank), dead;
    int64_t now = dtr_time_ns();
    dtr_result r;
    e.rank = -1, e.native_code = 0, e.msg[0] = 0;
    if (who >= 0)
        return dtr__comm_fail(c, a, DTR_PEER_FAILED, who, 0, "rank %d failed (a shared-memory collective's peer said so)", who);
    if (now < s->next_check) return DTR_OK;   /* the slower looks: every 5 ms */
    s->next_check = now + 5000000;
    if ((dead = dtr__shm_dead_peer(c)) >= 0)
        return dtr__comm_fail(c, a, DTR_PEER_FAILED, c->ranks[dead], 0, "rank %d (pid %lld on this host) died",
                              c->ranks[dead], (long long)DTR__ATOMIC_LOAD(&s->h->r[dead].pid));
    r = c->ep->vt->test(c->ep->state, s->sentinel, &done, &e);
    if (r != DTR_OK || done)
        return dtr__comm_fail(c, a, r != DTR_OK ? r : DTR_PEER_FAILED, e.rank, e.native_code, "%s",
                              e.msg[0] ? e.msg : "the transport reported a failure");
    if (now > a->deadline)
        return dtr__comm_fail(c, a, DTR_TIMEOUT, c->ranks[waiting_for], 0,
                              "timed out after %d ms: rank %d did not reach the shared-memory step", a->timeout_ms,
                              c->ranks[waiting_for]);
    return DTR_OK;
}

/* Waits until the counters at `off` of every rank (or of `only`) reached epoch e. */
static dtr_result dtr__shm_wait(dtr_comm *c, const dtr__coll *a, int only, size_t off, uint64_t e) {
    dtr__shm *s = c->shm;
    int64_t naps = 0;
    long spins = 0;
    int j;
    dtr_result r;
    while ((j = dtr__shm_behind(s, c->size, only, off, e)) >= 0) {
        if (++spins < 2000) continue;
        if ((r = dtr__shm_check_fail(c, a, j)) != DTR_OK) {   /* tell the others whom to blame */
            int32_t none = -1, who = dtr_comm_failed_rank(c) >= 0 ? dtr_comm_failed_rank(c) : c->ep->info.rank;
            DTR__ATOMIC_CAS(&s->h->abort_rank, &none, who);
            return r;
        }
        if (spins < 4000) sched_yield();
        else dtr__shm_nap(naps++ < 100 ? 2000 : 50000);
    }
    return DTR_OK;
}

#define DTR__SHM_IN offsetof(dtr__shm_counter, in)
#define DTR__SHM_RED offsetof(dtr__shm_counter, red)

/* ---- reductions in the point-to-point path's orders ---- */

/* the first element of ring chunk k of a count split over n ranks */
static size_t dtr__shm_ring_start(size_t count, int n, int k) {
    size_t q = count / (size_t)n, rem = count % (size_t)n;
    return (size_t)k * q + ((size_t)k < rem ? (size_t)k : rem);
}

/* out[0..len) = elements [g, g + len) of the slots (slot j's first element is global index
 * g0) in ring order: chunk k starts at rank k + 1 and ends at rank k (an average divides in
 * the last step) */
static void dtr__shm_ring(dtr_comm *c, const dtr__coll *a, char *out, size_t g0, size_t g, size_t len, int div) {
    size_t es = dtr_dtype_size(a->dtype);
    int N = c->size, k;
    for (k = 0; k < N && len; k++) {
        size_t lo = dtr__shm_ring_start(a->count, N, k), hi = dtr__shm_ring_start(a->count, N, k + 1), b, e, i;
        int j;
        b = g > lo ? g : lo, e = g + len < hi ? g + len : hi;
        if (b >= e) continue;
        i = b - g0;
        for (j = 2; j <= N; j++) {
            const char *x = j == 2 ? c->shm->slots + (size_t)((k + 1) % N) * c->shm->slot + i * es : out + (b - g) * es;
            const char *y = c->shm->slots + (size_t)((k + j) % N) * c->shm->slot + i * es;
            dtr__comm_reduce(out + (b - g) * es, x, y, e - b, a->dtype, a->op, j == N ? div : 1);
        }
    }
}

/* the same in recursive doubling's order: pairs 2i, 2i+1 below 2m fold first, then the p
 * partial values combine at distances 1, 2, 4 ..., the lower first (the tree that leads to
 * partial 0); vector by vector over the slice, in the group's scratch (p slices) */
static dtr_result dtr__shm_rd(dtr_comm *c, const dtr__coll *a, char *out, size_t first, size_t len, int div) {
    size_t es = dtr_dtype_size(a->dtype), sl = len * es;
    int N = c->size, p = 1, m, nr, d;
    char *v;
    while (p * 2 <= N) p *= 2;
    m = N - p;
    v = (char *)dtr__comm_scratch(c, (size_t)p * sl + 1);
    if (!v) return dtr__comm_fail(c, a, DTR_OUT_OF_MEMORY, -1, 0, "out of memory for %zu bytes", (size_t)p * sl);
    for (nr = 0; nr < p; nr++) {
        const char *x0 = c->shm->slots + (size_t)(nr < m ? 2 * nr : nr + m) * c->shm->slot + first * es;
        if (nr < m) dtr__comm_reduce(v + nr * sl, x0, x0 + c->shm->slot, len, a->dtype, a->op, 1);
        else memcpy(v + nr * sl, x0, sl);
    }
    for (d = 1; d < p; d *= 2)
        for (nr = 0; nr < p; nr += 2 * d)
            dtr__comm_reduce(v + nr * sl, v + nr * sl, v + (nr + d) * sl, len, a->dtype, a->op, d * 2 >= p ? div : 1);
    memcpy(out, v, sl);
    return DTR_OK;
}

/* ---- the collectives ---- */

/* A: this rank's input of the epoch into its slot */
static uint64_t dtr__shm_publish(dtr_comm *c, const void *src, size_t bytes) {
    dtr__shm *s = c->shm;
    uint64_t e = ++s->epoch;
    if (bytes) memcpy(s->slots + (size_t)c->rank * s->slot, src, bytes);
    DTR__ATOMIC_STORE(&s->h->r[c->rank].in, e);
    return e;
}

static dtr_result dtr__shm_all_reduce(dtr_comm *c, const dtr__coll *a) {
    dtr__shm *s = c->shm;
    size_t es = dtr_dtype_size(a->dtype), per = s->slot / es, g, n;
    int div = a->op == DTR_REDUCE_AVG ? (a->avg_div ? a->avg_div : c->size) : 1;
    dtr_result r;
    for (g = 0; g < a->count; g += n) {
        size_t lo, hi;
        char *out;
        uint64_t e;
        n = a->count - g < per ? a->count - g : per;
        e = dtr__shm_publish(c, (const char *)a->src + g * es, n * es);
        out = s->out[e & 1];
        if ((r = dtr__shm_wait(c, a, -1, DTR__SHM_IN, e)) != DTR_OK) return r;
        lo = n * (size_t)c->rank / (size_t)c->size, hi = n * (size_t)(c->rank + 1) / (size_t)c->size;
        if (a->algo == DTR_ALLREDUCE_RING) dtr__shm_ring(c, a, out + lo * es, g, g + lo, hi - lo, div);
        else if ((r = dtr__shm_rd(c, a, out + lo * es, lo, hi - lo, div)) != DTR_OK) return r;
        DTR__ATOMIC_STORE(&s->h->r[c->rank].red, e);
        if ((r = dtr__shm_wait(c, a, -1, DTR__SHM_RED, e)) != DTR_OK) return r;
        memcpy((char *)a->dst + g * es, out, n * es);
    }
    return DTR_OK;
}

/* reduce-scatter: block b of the input is rank b's; each epoch carries the same range of
 * every block, and rank b reduces its block in ring order (chunk b starts at rank b + 1) */
static dtr_result dtr__shm_reduce_scatter(dtr_comm *c, const dtr__coll *a) {
    dtr__shm *s = c->shm;
    size_t es = dtr_dtype_size(a->dtype), per = s->slot / es / (size_t)c->size, g, n;
    int N = c->size, b, j;
    dtr_result r;
    for (g = 0; g < a->count; g += n) {
        char *mine = s->slots + (size_t)c->rank * s->slot, *dst = (char *)a->dst + g * es;
        uint64_t e = ++s->epoch;
        n = a->count - g < per ? a->count - g : per;
        for (b = 0; b < N; b++) memcpy(mine + (size_t)b * n * es, (const char *)a->src + ((size_t)b * a->count + g) * es, n * es);
        DTR__ATOMIC_STORE(&s->h->r[c->rank].in, e);
        if ((r = dtr__shm_wait(c, a, -1, DTR__SHM_IN, e)) != DTR_OK) return r;
        for (j = 2; j <= N; j++) {
            const char *x = j == 2 ? s->slots + (size_t)((c->rank + 1) % N) * s->slot + (size_t)c->rank * n * es : dst;
            const char *y = s->slots + (size_t)((c->rank + j) % N) * s->slot + (size_t)c->rank * n * es;
            dtr__comm_reduce(dst, x, y, n, a->dtype, a->op, j == N && a->op == DTR_REDUCE_AVG ? N : 1);
        }
        DTR__ATOMIC_STORE(&s->h->r[c->rank].red, e);
        if ((r = dtr__shm_wait(c, a, -1, DTR__SHM_RED, e)) != DTR_OK) return r;
    }
    return DTR_OK;
}

/* all-gather (root < 0) or broadcast from root: every rank (or the root) publishes, all copy */
static dtr_result dtr__shm_gather(dtr_comm *c, const dtr__coll *a, int root) {
    dtr__shm *s = c->shm;
    size_t es = dtr_dtype_size(a->dtype), per = s->slot / es, g, n;
    int j;
    dtr_result r;
    for (g = 0; g < a->count; g += n) {
        const char *src = root < 0 ? (const char *)a->src : (const char *)a->dst;
        uint64_t e;
        n = a->count - g < per ? a->count - g : per;
        e = dtr__shm_publish(c, src + g * es, root < 0 || root == c->rank ? n * es : 0);
        if ((r = dtr__shm_wait(c, a, root, DTR__SHM_IN, e)) != DTR_OK) return r;
        for (j = 0; j < c->size; j++) {
            const char *from = s->slots + (size_t)j * s->slot;
            if (root < 0) memcpy((char *)a->dst + ((size_t)j * a->count + g) * es, from, n * es);
            else if (j == root && j != c->rank) memcpy((char *)a->dst + g * es, from, n * es);
        }
        DTR__ATOMIC_STORE(&s->h->r[c->rank].red, e);
        if ((r = dtr__shm_wait(c, a, -1, DTR__SHM_RED, e)) != DTR_OK) return r;
    }
    return DTR_OK;
}

static dtr_result dtr__shm_barrier(dtr_comm *c, const dtr__coll *a) {
    uint64_t e = dtr__shm_publish(c, NULL, 0);
    dtr_result r = dtr__shm_wait(c, a, -1, DTR__SHM_IN, e);
    if (r == DTR_OK) DTR__ATOMIC_STORE(&c->shm->h->r[c->rank].red, e);
    return r;
}

int dtr_comm_shared_memory(const dtr_comm *c) { return c && c->shm && c->shm->on; }

int dtr__shm_run(dtr_comm *c, const dtr__coll *a, dtr_result *r) {
    if (!c->shm || !c->shm->on) return 0;
    /* large payloads: the provider's single-copy path moves them faster (same bits) */
    if (a->kind != DTR__OP_BARRIER && a->count * dtr_dtype_size(a->dtype) > DTR__SHM_MAX_BYTES) return 0;
    switch (a->kind) {
    case DTR__OP_ALL_REDUCE: *r = dtr__shm_all_reduce(c, a); return 1;
    case DTR__OP_REDUCE_SCATTER: *r = dtr__shm_reduce_scatter(c, a); return 1;
    case DTR__OP_ALL_GATHER: *r = dtr__shm_gather(c, a, -1); return 1;
    case DTR__OP_BROADCAST: *r = dtr__shm_gather(c, a, a->root); return 1;
    case DTR__OP_BARRIER: *r = dtr__shm_barrier(c, a); return 1;
    }
    return 0;
}

#else /* no POSIX shared memory: the transport's path */
#if !(defined(__unix__) || defined(__APPLE__))
int dtr__pid_dead(int64_t pid) { (void)pid; return 0; }
#endif
int dtr_comm_shared_memory(const dtr_comm *c) { (void)c; return 0; }
dtr_result dtr__shm_setup(dtr_comm *c) { (void)c; return DTR_OK; }
void dtr__shm_free(dtr_comm *c) { (void)c; }
int dtr__shm_run(dtr_comm *c, const dtr__coll *a, dtr_result *r) { (void)c, (void)a, (void)r; return 0; }
#endif
#line 19345 "dtrain.h"

/* ---- src/engine/compress.c ---- */
#line 1 "src/engine/compress.c"
/* ============================================================================
 * Gradient compression of the data-parallel engine: what each bucket puts on the wire.
 *
 *   n      floats in the bucket, N ranks, acc = gradient + residual (error feedback)
 *   bf16, fp16   the bucket converted to 2-byte floats, all-reduced (average) in that dtype
 *   int8         [f32 scale][n int8], all-gathered; every rank sums the N payloads in rank
 *                order (identical bits everywhere) and divides by N
 *   topk         [k int32 indices][k f32 values], all-gathered, summed likewise
 *   powersgd     per matrix M (rows, cols) of the bucket: P = M Q (rows, r) with the other
 *                parameters' floats appended, all-reduced during backward; then in
 *                dtr_dp_finish P is orthonormalised, Q = M^T P (cols, r) all-reduced, and
 *                M ~ P Q^T. Q starts random (the same seed on every rank) and is reused by
 *                the next step (warm start), as PowerSGD (Vogels et al., 2019).
 * The residual (one float per gradient float) keeps what the codec lost: int8 and top-k the
 * local difference acc - decoded(acc); PowerSGD acc - (averaged approximation), whose
 * average over the ranks is what the average lost (the approximation is linear in M).
 * ==========================================================================*/





#include <math.h>

typedef struct dtr__cmat { int64_t off, rows, cols; } dtr__cmat;   /* offset in the bucket */

typedef struct dtr__cbucket {
    int64_t n;              /* floats */
    size_t bytes;           /* this rank's payload */
    unsigned char *send, *recv;   /* payload; the gathered payloads of int8 and top-k */
    dtr__cmat *mat;         /* PowerSGD: the matrices, by offset */
    int nmat;
    int64_t np, nq;         /* PowerSGD: floats of P (with the exact rest) and of Q */
    float *q;               /* PowerSGD: Q of every matrix, kept for the next step */
} dtr__cbucket;

struct dtr__dpc {
    dtr_model *m;
    dtr_comm *c;
    dtr_context *ctx;
    dtr_dp_compress kind;
    float ratio;
    int rank_r, ef, world;
    float *resid;           /* error feedback (numel floats) */
    dtr__cbucket *b;        /* one per parameter at most, made at the first start */
    int nb;
    dtr_dp_stats st;
};

static int dtr__dpc_has_ef(const dtr__dpc *z) {
    return z->ef && (z->kind == DTR_COMPRESS_INT8 || z->kind == DTR_COMPRESS_TOPK || z->kind == DTR_COMPRESS_POWERSGD);
}

dtr_result dtr__dpc_create(dtr_model *m, dtr_comm *c, const dtr_dp_config *cfg, dtr__dpc **out) {
    dtr_context *ctx = dtr_model_context(m);
    size_t numel = (size_t)dtr_model_numel(m);
    dtr__dpc *z;
    *out = NULL;
    if ((int)cfg->compress < 0 || cfg->compress > DTR_COMPRESS_POWERSGD)
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_dp_create: unknown compress %d", (int)cfg->compress);
    if (!(cfg->topk_ratio >= 0.0f && cfg->topk_ratio <= 1.0f))
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_dp_create: topk_ratio %g outside (0, 1]", cfg->topk_ratio);
    if (cfg->powersgd_rank < 0 || cfg->powersgd_rank > 1024)
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_dp_create: powersgd_rank %d outside 1..1024", cfg->powersgd_rank);
    if (cfg->compress == DTR_COMPRESS_TOPK && numel > (size_t)INT32_MAX)
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_dp_create: top-k indexes buckets with int32 (%zu floats)", numel);
    z = (dtr__dpc *)dtr__calloc(&ctx->alloc, sizeof(*z));
    if (!z) return dtr__fail(ctx, DTR_OUT_OF_MEMORY, "dtr_dp_create: out of memory");
    z->m = m, z->c = c, z->ctx = ctx, z->kind = cfg->compress, z->world = dtr_comm_size(c);
    z->ratio = cfg->topk_ratio > 0.0f ? cfg->topk_ratio : 0.01f;
    z->rank_r = cfg->powersgd_rank > 0 ? cfg->powersgd_rank : 4;
    z->ef = !cfg->no_error_feedback;
    z->b = (dtr__cbucket *)dtr__calloc(&ctx->alloc, (size_t)(dtr_model_param_count(m) + 1) * sizeof(dtr__cbucket));
    if (z->b && dtr__dpc_has_ef(z)) z->resid = (float *)dtr__calloc(&ctx->alloc, (numel + 1) * sizeof(float));
    if (!z->b || (dtr__dpc_has_ef(z) && !z->resid)) {
        dtr__dpc_destroy(z);
        return dtr__fail(ctx, DTR_OUT_OF_MEMORY, "dtr_dp_create: out of memory");
    }
    z->nb = dtr_model_param_count(m) + 1;
    *out = z;
    return DTR_OK;
}

void dtr__dpc_destroy(dtr__dpc *z) {
    int i;
    if (!z) return;
    for (i = 0; z->b && i < z->nb; i++) {
        dtr__free(&z->ctx->alloc, z->b[i].send);
        dtr__free(&z->ctx->alloc, z->b[i].recv);
        dtr__free(&z->ctx->alloc, z->b[i].mat);
        dtr__free(&z->ctx->alloc, z->b[i].q);
    }
    dtr__free(&z->ctx->alloc, z->b);
    dtr__free(&z->ctx->alloc, z->resid);
    dtr__free(&z->ctx->alloc, z);
}

dtr_dp_stats *dtr__dpc_stats(dtr__dpc *z) { return &z->st; }

float *dtr__dpc_residual(dtr__dpc *z, size_t *bytes) {
    *bytes = z->resid ? (size_t)dtr_model_numel(z->m) * sizeof(float) : 0;
    return z->resid;
}

/* ---- PowerSGD: the matrices of a bucket and the floats between them ---- */

/* the parameters of [begin, end) with 2 or more dimensions and both sides above the rank */
static dtr_result dtr__psgd_plan(dtr__dpc *z, dtr__cbucket *b, int64_t begin, int64_t end) {
    int np = dtr_model_param_count(z->m), i;
    int64_t covered = 0;
    b->mat = (dtr__cmat *)dtr__calloc(&z->ctx->alloc, (size_t)(np + 1) * sizeof(dtr__cmat));
    if (!b->mat) return DTR_OUT_OF_MEMORY;
    for (i = 0; i < np; i++) {
        dtr_tensor *p = dtr_model_param_at(z->m, i);
        int64_t off = dtr_model_param_offset(z->m, i), rows = dtr_tensor_dim(p, 0), numel = dtr_tensor_numel(p);
        if (off < begin || off >= end || dtr_tensor_ndim(p) < 2 || rows <= z->rank_r || numel / rows <= z->rank_r) continue;
        b->mat[b->nmat].off = off - begin, b->mat[b->nmat].rows = rows, b->mat[b->nmat].cols = numel / rows;
        b->np += rows * z->rank_r;
        b->nq += numel / rows * z->rank_r;
        covered += numel;
        b->nmat++;
    }
    b->np += b->n - covered;
    return DTR_OK;
}

/* segment j (0 .. nmat) of the floats outside the matrices: start in *s, length returned */
static int64_t dtr__psgd_gap(const dtr__cbucket *b, int j, int64_t *s) {
    *s = j == 0 ? 0 : b->mat[j - 1].off + b->mat[j - 1].rows * b->mat[j - 1].cols;
    return (j < b->nmat ? b->mat[j].off : b->n) - *s;
}

/* copies the floats outside the matrices between the bucket g and rest (to_g: rest -> g) */
static void dtr__psgd_rest(const dtr__cbucket *b, float *g, float *rest, int to_g) {
    int64_t s, len, k = 0;
    int j;
    for (j = 0; j <= b->nmat; j++, k += len) {
        len = dtr__psgd_gap(b, j, &s);
        if (to_g) memcpy(g + s, rest + k, (size_t)len * sizeof(float));
        else memcpy(rest + k, g + s, (size_t)len * sizeof(float));
    }
}

/* makes the r columns of p (rows, r) orthonormal (modified Gram-Schmidt, projections done
   twice so that a column of rounding noise still comes out orthogonal; zero stays zero) */
static void dtr__orthonormalise(float *p, int64_t rows, int r) {
    int c, d;
    int64_t i;
    for (c = 0; c < r; c++) {
        double norm = 0.0;
        for (d = 0; d < 2 * c; d++) {
            double dot = 0.0;
            for (i = 0; i < rows; i++) dot += (double)p[i * r + c] * p[i * r + d % c];
            for (i = 0; i < rows; i++) p[i * r + c] -= (float)dot * p[i * r + d % c];
        }
        for (i = 0; i < rows; i++) norm += (double)p[i * r + c] * p[i * r + c];
        norm = sqrt(norm);
        for (i = 0; i < rows; i++) p[i * r + c] = norm > 1e-30 ? (float)(p[i * r + c] / norm) : 0.0f;
    }
}

static dtr_result dtr__psgd_alloc(dtr__dpc *z, dtr__cbucket *b, int64_t begin, int64_t end) {
    dtr_rng rng;
    int64_t i;
    if (dtr__psgd_plan(z, b, begin, end) != DTR_OK) return DTR_OUT_OF_MEMORY;
    b->bytes = (size_t)b->np * sizeof(float);
    b->send = (unsigned char *)dtr__calloc(&z->ctx->alloc, b->bytes + sizeof(float));
    b->q = (float *)dtr__calloc(&z->ctx->alloc, (size_t)(b->nq + 1) * sizeof(float));
    if (!b->send || !b->q) return DTR_OUT_OF_MEMORY;
    dtr_rng_seed(&rng, 0x9e3779b97f4a7c15ull, (uint64_t)begin);   /* the same Q on every rank */
    for (i = 0; i < b->nq; i++) b->q[i] = dtr_rng_normal(&rng);
    return DTR_OK;
}

static dtr_result dtr__psgd_start(dtr__dpc *z, dtr__cbucket *b, float *g, dtr_request **req) {
    float *p = (float *)b->send, *q = b->q;
    int j, r = z->rank_r;
    for (j = 0; j < b->nmat; j++) {   /* P (rows, r) = M (rows, cols) Q (cols, r) */
        const dtr__cmat *a = &b->mat[j];
        dtr__gemm(z->ctx->pool, a->rows, r, a->cols, 1.0f, g + a->off, a->cols, 1, q, r, 1, 0.0f, p, r);
        p += a->rows * z->rank_r;
        q += a->cols * z->rank_r;
    }
    dtr__psgd_rest(b, g, p, 0);
    return dtr_comm_all_reduce_async(z->c, b->send, b->send, (size_t)b->np, DTR_F32, DTR_REDUCE_AVG, req);
}

/* P averaged: Q = M^T P averaged (blocking), g = P Q^T, the rest from P's tail */
static dtr_result dtr__psgd_finish(dtr__dpc *z, dtr__cbucket *b, float *g, float *resid) {
    float *p = (float *)b->send, *q = b->q;
    int64_t s, len;
    int j, r = z->rank_r;
    dtr_result res;
    for (j = 0; j < b->nmat; j++) {   /* Q (cols, r) = M^T P */
        const dtr__cmat *a = &b->mat[j];
        dtr__orthonormalise(p, a->rows, r);
        dtr__gemm(z->ctx->pool, a->cols, r, a->rows, 1.0f, g + a->off, 1, a->cols, p, r, 1, 0.0f, q, r);
        p += b->mat[j].rows * r;
        q += b->mat[j].cols * r;
    }
    z->st.wire_bytes += (uint64_t)b->nq * sizeof(float);
    if ((res = dtr_comm_all_reduce(z->c, b->q, b->q, (size_t)b->nq, DTR_F32, DTR_REDUCE_AVG)) != DTR_OK) return res;
    dtr__psgd_rest(b, g, p, 1);
    for (j = 0, p = (float *)b->send, q = b->q; j < b->nmat; j++) {   /* M ~ P Q^T */
        const dtr__cmat *a = &b->mat[j];
        dtr__gemm(z->ctx->pool, a->rows, a->cols, r, 1.0f, p, r, 1, q, 1, r, 0.0f, g + a->off, a->cols);
        p += b->mat[j].rows * r;
        q += b->mat[j].cols * r;
    }
    if (!resid) return DTR_OK;
    for (s = 0; s < b->n; s++) resid[s] -= g[s];   /* resid held acc */
    for (j = 0; j <= b->nmat; j++) {               /* the rest was averaged exactly */
        len = dtr__psgd_gap(b, j, &s);
        memset(resid + s, 0, (size_t)len * sizeof(float));
    }
    return DTR_OK;
}

/* ---- int8 and top-k: encode, all-gather, sum in rank order ---- */

/* payload [f32 scale][n int8]; resid (may be NULL) = g - decoded */
static void dtr__int8_encode(const float *g, int64_t n, unsigned char *out, float *resid) {
    float mx = 0.0f, scale;
    int8_t *q = (int8_t *)(out + sizeof(float));
    int64_t i;
    for (i = 0; i < n; i++) mx = fabsf(g[i]) > mx ? fabsf(g[i]) : mx;
    scale = mx / 127.0f;
    memcpy(out, &scale, sizeof scale);
    for (i = 0; i < n; i++) {
        float v = scale > 0.0f ? nearbyintf(g[i] / scale) : 0.0f;
        q[i] = (int8_t)(v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v == v ? v : 0.0f);   /* NaN: 0 */
        if (resid) resid[i] = g[i] - (float)q[i] * scale;
    }
}

/* the k-th largest of |g[0..n)| (1 <= k <= n): a radix select on the magnitudes' bit
   patterns (those of non-negative floats order as the floats), 11 + 11 + 10 bits, each pass
   counting the entries that share the prefix found so far */
static float dtr__kth_largest_abs(const float *g, int64_t n, int64_t k) {
    static const int shift[3] = {21, 10, 0};
    uint32_t prefix = 0, mask = 0, bits;
    int64_t cnt[2048], i;
    int p, bin, nb;
    float f;
    for (p = 0; p < 3; p++) {
        nb = p == 2 ? 1024 : 2048;
        memset(cnt, 0, sizeof cnt);
        for (i = 0; i < n; i++) {
            memcpy(&bits, g + i, sizeof bits);
            bits &= 0x7fffffffu;
            if ((bits & mask) == prefix) cnt[(bits >> shift[p]) & (uint32_t)(nb - 1)]++;
        }
        for (bin = nb - 1; bin > 0 && cnt[bin] < k; bin--) k -= cnt[bin];
        prefix |= (uint32_t)bin << shift[p];
        mask |= (uint32_t)(nb - 1) << shift[p];
    }
    memcpy(&f, &prefix, sizeof f);
    return f;
}

static int64_t dtr__topk_count(const dtr__dpc *z, int64_t n) {
    int64_t k = (int64_t)((double)z->ratio * (double)n + 0.5);
    return k < 1 ? 1 : k > n ? n : k;
}

/* payload [k int32 indices, ascending][k f32 values]: the k entries of g largest in
   magnitude (ties: the first ones); resid (may be NULL) = g with those entries zeroed */
static void dtr__topk_encode(const float *g, int64_t n, int64_t k, unsigned char *out, float *resid) {
    int32_t *idx = (int32_t *)out;
    float *val = (float *)(out + (size_t)k * sizeof(int32_t)), thr = dtr__kth_largest_abs(g, n, k);
    int64_t i, m = 0, above = 0;
    for (i = 0; i < n; i++) above += fabsf(g[i]) > thr;
    for (i = 0; i < n; i++) {
        int take = m < k && (fabsf(g[i]) > thr || (fabsf(g[i]) == thr && above < k));
        if (fabsf(g[i]) == thr && take) above++;
        if (take) { idx[m] = (int32_t)i; val[m++] = g[i]; }
        if (resid) resid[i] = take ? 0.0f : g[i];
    }
    for (; m < k; m++) idx[m] = 0, val[m] = 0.0f;   /* NaN magnitudes compare with nothing */
}

/* g = (sum over ranks, in rank order, of the gathered payloads) / N */
static void dtr__gather_decode(const dtr__dpc *z, const dtr__cbucket *b, float *g) {
    int r;
    int64_t i, k = z->kind == DTR_COMPRESS_TOPK ? dtr__topk_count(z, b->n) : 0;
    memset(g, 0, (size_t)b->n * sizeof(float));
    for (r = 0; r < z->world; r++) {
        const unsigned char *p = b->recv + (size_t)r * b->bytes;
        float scale;
        if (z->kind == DTR_COMPRESS_TOPK) {
            const int32_t *idx = (const int32_t *)p;
            const float *val = (const float *)(p + (size_t)k * sizeof(int32_t));
            for (i = 0; i < k; i++) g[idx[i]] += val[i];
            continue;
        }
        memcpy(&scale, p, sizeof scale);
        for (i = 0; i < b->n; i++) g[i] += scale * (float)((const int8_t *)(p + sizeof(float)))[i];
    }
    for (i = 0; i < b->n; i++) g[i] /= (float)z->world;
}

/* ---- per bucket ---- */

static dtr_result dtr__cbucket_alloc(dtr__dpc *z, dtr__cbucket *b, int64_t begin, int64_t end) {
    size_t half = (size_t)b->n * sizeof(uint16_t);
    if (z->kind == DTR_COMPRESS_POWERSGD) return dtr__psgd_alloc(z, b, begin, end);
    if (z->kind == DTR_COMPRESS_BF16 || z->kind == DTR_COMPRESS_FP16) b->bytes = half;
    if (z->kind == DTR_COMPRESS_INT8) b->bytes = (sizeof(float) + (size_t)b->n + 3) & ~(size_t)3;
    if (z->kind == DTR_COMPRESS_TOPK) b->bytes = (size_t)dtr__topk_count(z, b->n) * (sizeof(int32_t) + sizeof(float));
    b->send = (unsigned char *)dtr__calloc(&z->ctx->alloc, b->bytes + 1);
    if (z->kind == DTR_COMPRESS_INT8 || z->kind == DTR_COMPRESS_TOPK)
        b->recv = (unsigned char *)dtr__calloc(&z->ctx->alloc, b->bytes * (size_t)z->world + 1);
    return b->send && (b->recv || !b->bytes || b->bytes == half) ? DTR_OK : DTR_OUT_OF_MEMORY;
}

dtr_result dtr__dpc_start(dtr__dpc *z, int i, float *g, int64_t begin, int64_t end, dtr_request **req) {
    dtr__cbucket *b = &z->b[i];
    float *gb = g + begin, *rb = z->resid ? z->resid + begin : NULL;
    dtr_dtype half = z->kind == DTR_COMPRESS_BF16 ? DTR_BF16 : DTR_F16;
    int64_t k;
    z->st.raw_bytes += (uint64_t)(end - begin) * sizeof(float);
    if (z->kind == DTR_COMPRESS_NONE) {
        z->st.wire_bytes += (uint64_t)(end - begin) * sizeof(float);
        return dtr_comm_all_reduce_async(z->c, gb, gb, (size_t)(end - begin), DTR_F32, DTR_REDUCE_AVG, req);
    }
    if (!b->send) {
        b->n = end - begin;
        if (dtr__cbucket_alloc(z, b, begin, end) != DTR_OK) return DTR_OUT_OF_MEMORY;
    }
    for (k = 0; rb && k < b->n; k++) gb[k] += rb[k];   /* error feedback: acc = g + residual */
    z->st.wire_bytes += b->bytes;
    switch (z->kind) {
    case DTR_COMPRESS_BF16:
    case DTR_COMPRESS_FP16:
        dtr_convert(b->send, half, gb, DTR_F32, (size_t)b->n);
        return dtr_comm_all_reduce_async(z->c, b->send, b->send, (size_t)b->n, half, DTR_REDUCE_AVG, req);
    case DTR_COMPRESS_INT8: dtr__int8_encode(gb, b->n, b->send, rb); break;
    case DTR_COMPRESS_TOPK: dtr__topk_encode(gb, b->n, dtr__topk_count(z, b->n), b->send, rb); break;
    default:
        if (rb) memcpy(rb, gb, (size_t)b->n * sizeof(float));
        return dtr__psgd_start(z, b, gb, req);
    }
    return dtr_comm_all_gather_async(z->c, b->send, b->recv, b->bytes, DTR_U8, req);
}

dtr_result dtr__dpc_finish(dtr__dpc *z, int i, float *g, int64_t begin) {
    dtr__cbucket *b = &z->b[i];
    dtr_dtype half = z->kind == DTR_COMPRESS_BF16 ? DTR_BF16 : DTR_F16;
    if (z->kind == DTR_COMPRESS_NONE || !b->send) return DTR_OK;
    if (z->kind == DTR_COMPRESS_POWERSGD) return dtr__psgd_finish(z, b, g + begin, z->resid ? z->resid + begin : NULL);
    if (z->kind == DTR_COMPRESS_BF16 || z->kind == DTR_COMPRESS_FP16)
        return dtr_convert(g + begin, DTR_F32, b->send, half, (size_t)b->n);
    dtr__gather_decode(z, b, g + begin);
    return DTR_OK;
}
#line 19704 "dtrain.h"

/* ---- src/engine/zero.c ---- */
#line 1 "src/engine/zero.c"
/* ============================================================================
 * ZeRO in the data-parallel engine. Rank r of W owns floats [shard[r], shard[r + 1]) of the
 * parameter buffer: it updates them (its optimizer keeps state for them only) and after
 * the step sends them to the others (one broadcast per shard).
 *
 * Stage 1: gradients are averaged whole (the engine's bucketed all-reduce).
 * Stage 2: a bucket's gradients are final during backward -> each rank sends the bucket's
 * slice of rank o's shard to rank o (point-to-point, asynchronous) and receives the peers'
 * slices of its own shard into a buffer, one slot per peer. dtr_dp_finish waits and sums
 * the slices in rank order into the shard. Each rank sends (W - 1) / W of the gradients and
 * receives as much: the volume of a reduce-scatter, half an all-reduce's. Outside its
 * shard a rank's gradient buffer keeps its own local gradients (not the average).
 * ==========================================================================*/







#define DTR__ZERO_TAG (1 << 30)   /* + bucket index: stage 2's point-to-point tags */

struct dtr__zero {
    dtr_model *m;
    dtr_comm *c;
    dtr_context *ctx;
    int W, me, stage;
    int64_t *shard;          /* W + 1 offsets */
    float *recv;             /* stage 2: W - 1 slots of this rank's shard, peers in rank order */
    dtr_request **req;       /* stage 2: this step's sends and receives */
    int nreq, cap;
};

/* Shards: rank r's starts at r / W of the buffer, rounded down to 16 floats, or with
 * zero_whole_params at the first parameter boundary there or after (a shard may be empty) */
static void dtr__zero_layout(dtr__zero *z, int whole) {
    int np = dtr_model_param_count(z->m), r, i = 0;
    int64_t total = dtr_model_numel(z->m);
    for (r = 1; r < z->W; r++) {
        int64_t want = total * r / z->W / 16 * 16;
        while (whole && i < np && dtr_model_param_offset(z->m, i) < want) i++;
        z->shard[r] = !whole ? want : i < np ? dtr_model_param_offset(z->m, i) : total;
    }
    z->shard[z->W] = total;
}

dtr_result dtr__zero_create(dtr_model *m, dtr_comm *c, const dtr_dp_config *cfg, int nb, dtr__zero **out) {
    dtr_context *ctx = dtr_model_context(m);
    dtr__zero *z = (dtr__zero *)dtr__calloc(&ctx->alloc, sizeof(*z));
    int ok;
    *out = NULL;
    if (!z) return dtr__fail(ctx, DTR_OUT_OF_MEMORY, "dtr_dp_create: out of memory");
    z->m = m, z->c = c, z->ctx = ctx, z->stage = cfg->zero;
    z->W = dtr_comm_size(c), z->me = dtr_comm_rank(c);
    z->shard = (int64_t *)dtr__calloc(&ctx->alloc, (size_t)(z->W + 1) * sizeof(int64_t));
    ok = z->shard != NULL;
    if (ok) dtr__zero_layout(z, cfg->zero_whole_params);
    z->cap = 2 * z->W * (nb > 0 ? nb : 1);   /* a bucket's or the gather's sends and receives: 2 (W - 1) */
    z->req = (dtr_request **)dtr__calloc(&ctx->alloc, (size_t)z->cap * sizeof(dtr_request *));
    ok = ok && z->req;
    if (ok && z->stage == 2) {
        int64_t len = z->shard[z->me + 1] - z->shard[z->me];
        z->recv = (float *)dtr__calloc(&ctx->alloc, (size_t)((z->W - 1) * len + 1) * sizeof(float));
        ok = z->recv != NULL;
    }
    if (!ok) {
        dtr__zero_destroy(z);
        return dtr__fail(ctx, DTR_OUT_OF_MEMORY, "dtr_dp_create: out of memory for the ZeRO shards");
    }
    *out = z;
    return DTR_OK;
}

/* waits for and frees this step's requests; the first error */
static dtr_result dtr__zero_wait(dtr__zero *z) {
    dtr_result first = DTR_OK;
    int i;
    for (i = 0; i < z->nreq; i++) {
        dtr_result r = dtr_request_wait(z->req[i]);
        if (r != DTR_OK && first == DTR_OK) first = r;
        dtr_request_destroy(z->req[i]);
        z->req[i] = NULL;
    }
    z->nreq = 0;
    return first;
}

void dtr__zero_destroy(dtr__zero *z) {
    dtr_allocation_callbacks a;
    if (!z) return;
    a = z->ctx->alloc;
    if (z->req) dtr__zero_wait(z);
    dtr__free(&a, z->req);
    dtr__free(&a, z->recv);
    dtr__free(&a, z->shard);
    dtr__free(&a, z);
}

/* peer p's slot for float x of this rank's shard */
static float *dtr__zero_slot(dtr__zero *z, int p, int64_t x) {
    int64_t len = z->shard[z->me + 1] - z->shard[z->me];
    return z->recv + (int64_t)(p < z->me ? p : p - 1) * len + (x - z->shard[z->me]);
}

/* posts a send or receive of n floats at buf to/from rank p */
static dtr_result dtr__zero_post(dtr__zero *z, int send, float *buf, int64_t n, int p, int tag) {
    size_t bytes = (size_t)n * sizeof(float);
    dtr_result r;
    if (z->nreq >= z->cap) return dtr__fail(z->ctx, DTR_BAD_STATE, "ZeRO: more requests than planned");
    r = send ? dtr_comm_send_async(z->c, buf, bytes, p, tag, &z->req[z->nreq])
             : dtr_comm_recv_async(z->c, buf, bytes, p, tag, &z->req[z->nreq]);
    if (r == DTR_OK) z->nreq++;
    return r;
}

dtr_result dtr__zero_start(dtr__zero *z, int i, int64_t begin, int64_t end) {
    float *g = dtr_model_grads(z->m);
    int o, p;
    for (o = 0; o < z->W; o++) {
        int64_t lo = begin > z->shard[o] ? begin : z->shard[o], hi = end < z->shard[o + 1] ? end : z->shard[o + 1];
        dtr_result r = DTR_OK;
        if (lo >= hi) continue;
        if (o != z->me) r = dtr__zero_post(z, 1, g + lo, hi - lo, o, DTR__ZERO_TAG + i);
        for (p = 0; p < z->W && o == z->me && r == DTR_OK; p++)
            if (p != z->me) r = dtr__zero_post(z, 0, dtr__zero_slot(z, p, lo), hi - lo, p, DTR__ZERO_TAG + i);
        if (r != DTR_OK) return r;
    }
    return DTR_OK;
}

/* rank p's slice of the shard: the local gradients for this rank, else its slot */
static const float *dtr__zero_part(dtr__zero *z, int p) {
    int64_t b = z->shard[z->me];
    return p == z->me ? dtr_model_grads(z->m) + b : dtr__zero_slot(z, p, b);
}

dtr_result dtr__zero_reduce(dtr__zero *z, dtr_dp_stats *st) {
    int64_t b = z->shard[z->me], n = z->shard[z->me + 1] - b;
    float *g = dtr_model_grads(z->m) + b, *acc;
    dtr_result r = dtr__zero_wait(z);
    int p;
    if (r != DTR_OK) return r;
    /* sum in rank order: in the shard itself for rank 0, else in rank 0's slot (rank p > 0
       may still need its own gradients); the last addition divides and lands in the shard */
    acc = z->me == 0 ? g : dtr__zero_slot(z, 0, b);
    for (p = 1; p < z->W; p++)
        dtr__comm_reduce(p == z->W - 1 ? g : acc, p == 1 ? dtr__zero_part(z, 0) : acc, dtr__zero_part(z, p), (size_t)n,
                         DTR_F32, DTR_REDUCE_AVG, p == z->W - 1 ? z->W : 1);
    st->wire_bytes += (uint64_t)(dtr_model_numel(z->m) - n) * sizeof(float);
    st->raw_bytes += (uint64_t)dtr_model_numel(z->m) * sizeof(float);
    return DTR_OK;
}

dtr_result dtr__zero_gather(dtr__zero *z, dtr_dp_stats *st) {
    float *prm = dtr_model_params(z->m);
    int64_t n = z->shard[z->me + 1] - z->shard[z->me];
    dtr_result r = DTR_OK;
    int p;
    /* an all-gather of unequal shards: this rank's to every peer, every peer's from it */
    for (p = 0; p < z->W && r == DTR_OK; p++) {
        if (p == z->me) continue;
        if (n > 0) r = dtr__zero_post(z, 1, prm + z->shard[z->me], n, p, DTR__ZERO_TAG - 1);
        if (r == DTR_OK && z->shard[p + 1] > z->shard[p])
            r = dtr__zero_post(z, 0, prm + z->shard[p], z->shard[p + 1] - z->shard[p], p, DTR__ZERO_TAG - 1);
    }
    if (r == DTR_OK) r = dtr__zero_wait(z);
    else dtr__zero_wait(z);
    if (r != DTR_OK) return dtr__fail(z->ctx, r, "ZeRO-%d: gathering the parameters: %s", z->stage, dtr_comm_last_error(z->c));
    st->wire_bytes += (uint64_t)n * sizeof(float);
    st->raw_bytes += (uint64_t)n * sizeof(float);
    return DTR_OK;
}

void dtr__zero_shard(const dtr__zero *z, int64_t *begin, int64_t *end) {
    *begin = z->shard[z->me];
    *end = z->shard[z->me + 1];
}

dtr_result dtr__zero_sum(void *user, double *vals, int n) {
    dtr__zero *z = (dtr__zero *)user;
    double *all = (double *)dtr__malloc(&z->ctx->alloc, (size_t)(z->W * (n > 0 ? n : 1)) * sizeof(double));
    int i, r;
    dtr_result res;
    if (!all) return dtr__fail(z->ctx, DTR_OUT_OF_MEMORY, "ZeRO: out of memory");
    res = dtr_comm_all_gather(z->c, vals, all, (size_t)n * sizeof(double), DTR_U8);
    for (i = 0; i < n && res == DTR_OK; i++) {
        vals[i] = 0.0;
        for (r = 0; r < z->W; r++) vals[i] += all[r * n + i];
    }
    dtr__free(&z->ctx->alloc, all);
    if (res != DTR_OK) return dtr__fail(z->ctx, res, "ZeRO: summing over the group: %s", dtr_comm_last_error(z->c));
    return DTR_OK;
}
#line 19901 "dtrain.h"

/* ---- src/engine/data_parallel.c ---- */
#line 1 "src/engine/data_parallel.c"
/* ============================================================================
 * Data-parallel engine: every rank holds the whole model; gradients are averaged over the
 * ranks in buckets of the contiguous gradient buffer, each bucket's all-reduce starting
 * during backward as soon as its gradients are final.
 *
 * Buckets are ranges of the gradient buffer on parameter boundaries, formed from the last
 * parameter backwards (the order backward produces them), each at least bucket_bytes
 * unless it is the last. The gradient-ready hook of the context counts down the parameters
 * of each bucket; buckets are started strictly in bucket order (a ready bucket waits for
 * the ones before it), so every rank issues the same all-reduces in the same order even if
 * its backward reaches parameters in another order. dtr_dp_finish starts the rest and waits.
 * The all-reduce is DTR_REDUCE_AVG: the sum over ranks in the collective's fixed order,
 * divided by the world size, identical bits on every rank. With compression (compress.c)
 * a bucket's exchange is the codec's; dtr_dp_finish decodes the buckets in bucket order.
 * Local SGD: after the warm-up the hook and dtr_dp_finish do nothing, and dtr_dp_step_done
 * averages the parameters every local_sgd_every steps.
 * ZeRO (zero.c): dtr_dp_step_done gathers the shards the ranks updated; with stage 2 a
 * bucket's start sends its slices to their owners instead of an all-reduce, and
 * dtr_dp_finish sums this rank's shard.
 * ==========================================================================*/








typedef struct dtr__bucket {
    int64_t begin, end;     /* float range in the gradient buffer */
    int nparams, pending;   /* parameters, and those whose gradient is not final yet */
    dtr_request *req;
    int in_backward;        /* started by the hook */
} dtr__bucket;

struct dtr_dp {
    dtr_model *m;
    dtr_comm *c;
    dtr_context *ctx;
    dtr_dp_config cfg;
    dtr__bucket *b;
    int nb;
    int *param_bucket;      /* parameter index -> bucket */
    int next;               /* next bucket to start */
    int no_sync;
    int hook_id;           /* our gradient hook (0: none) */
    int overlapped;
    dtr__dpc *cz;           /* gradient codec and counters */
    dtr__zero *z;           /* ZeRO: the shards (NULL without) */
};

dtr_dp_config dtr_dp_config_init(void) {
    dtr_dp_config c;
    memset(&c, 0, sizeof(c));
    return c;
}

static dtr_result dtr__dp_start(dtr_dp *dp, int i, int from_hook) {
    dtr__bucket *b = &dp->b[i];
    b->in_backward = from_hook;
    if (dp->cfg.zero == 2) return dtr__zero_start(dp->z, i, b->begin, b->end);
    return dtr__dpc_start(dp->cz, i, dtr_model_grads(dp->m), b->begin, b->end, &b->req);
}

/* local SGD past its warm-up: gradients stay local */
static int dtr__dp_local(const dtr_dp *dp) {
    return dp->cfg.local_sgd_every > 0 && dtr__dpc_stats(dp->cz)->steps >= dp->cfg.local_sgd_warmup;
}

/* starts every ready bucket that is next in order */
static dtr_result dtr__dp_launch_ready(dtr_dp *dp, int from_hook) {
    while (dp->next < dp->nb && dp->b[dp->next].pending == 0) {
        dtr_result r = dtr__dp_start(dp, dp->next, from_hook);
        dp->next++;
        if (r != DTR_OK) return r;
    }
    return DTR_OK;
}

static dtr_result dtr__dp_grad_ready(void *user, dtr_tensor *param, dtr_event *ready) {
    dtr_dp *dp = (dtr_dp *)user;
    dtr__bucket *b;
    if (dp->no_sync || dtr__dp_local(dp) || param->model != dp->m || param->param_index < 0) return DTR_OK;
    b = &dp->b[dp->param_bucket[param->param_index]];
    if (b->pending == 0) return DTR_OK;   /* a second backward without dtr_dp_finish */
    if (--b->pending == 0) {
        /* the bucket's last gradient is written once `ready` completes (the transport reads
           host memory on its progress thread) */
        dtr_result r = dtr_event_wait(dp->ctx, ready);
        if (r == DTR_OK) r = dtr__dp_launch_ready(dp, 1);
        if (r != DTR_OK) return dtr__fail(dp->ctx, r, "data parallel: cannot start a gradient all-reduce: %s",
                                          dtr_comm_last_error(dp->c));
    }
    return DTR_OK;
}

static void dtr__dp_reset(dtr_dp *dp) {
    int i;
    for (i = 0; i < dp->nb; i++) dp->b[i].pending = dp->b[i].nparams;
    dp->next = 0;
}

static dtr_result dtr__dp_buckets(dtr_dp *dp) {
    dtr_context *ctx = dp->ctx;
    int np = dtr_model_param_count(dp->m), i, k = 0;
    int64_t total = dtr_model_numel(dp->m), per = (int64_t)(dp->cfg.bucket_bytes / sizeof(float)), end = total;
    if (per < 1) per = 1;
    dp->param_bucket = (int *)dtr__calloc(&ctx->alloc, (size_t)(np ? np : 1) * sizeof(int));
    dp->b = (dtr__bucket *)dtr__calloc(&ctx->alloc, (size_t)(np ? np : 1) * sizeof(dtr__bucket));
    if (!dp->param_bucket || !dp->b) return DTR_OUT_OF_MEMORY;
    for (i = np - 1; i >= 0; i--) {
        int64_t off = dtr_model_param_offset(dp->m, i);
        dp->param_bucket[i] = k;
        dp->b[k].nparams++;
        if (end - off >= per || i == 0) {
            dp->b[k].begin = i == 0 ? 0 : off;
            dp->b[k].end = end;
            end = dp->b[k].begin;
            k++;
        }
    }
    dp->nb = k;
    dtr__dp_reset(dp);
    return DTR_OK;
}

static dtr_result dtr__dp_check(dtr_context *ctx, dtr_comm *c, const dtr_dp_config *cfg) {
    if (cfg->root < 0 || cfg->root >= dtr_comm_size(c))
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_dp_create: root %d outside the group of %d", cfg->root,
                         dtr_comm_size(c));
    if (cfg->local_sgd_every < 0 || cfg->local_sgd_warmup < 0)
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_dp_create: local_sgd_every %d and local_sgd_warmup %lld "
                         "must be >= 0", cfg->local_sgd_every, (long long)cfg->local_sgd_warmup);
    if (cfg->zero < 0 || cfg->zero > 2)
        return dtr__fail(ctx, cfg->zero == 3 ? DTR_UNSUPPORTED : DTR_INVALID_ARGUMENT,
                         "dtr_dp_create: zero %d (this version has stages 1 and 2)", cfg->zero);
    if (cfg->zero && (cfg->compress != DTR_COMPRESS_NONE || cfg->local_sgd_every > 0))
        return dtr__fail(ctx, DTR_UNSUPPORTED, "dtr_dp_create: ZeRO-%d with gradient compression or local SGD is not in "
                                               "this version", cfg->zero);
    if (!dtr__host_memory(ctx))
        return dtr__fail(ctx, DTR_UNSUPPORTED, "dtr_dp_create: gradients must be in host memory (backend %s)",
                         ctx->backend->name);
    return DTR_OK;
}

dtr_result dtr_dp_create(dtr_model *m, dtr_comm *c, const dtr_dp_config *cfg, dtr_dp **out) {
    dtr_dp_config def = dtr_dp_config_init();
    dtr_context *ctx;
    dtr_dp *dp;
    dtr_result r;
    if (!m || !c || !out) return DTR_NULL_HANDLE;
    *out = NULL;
    if (!cfg) cfg = &def;
    ctx = dtr_model_context(m);
    if ((r = dtr__dp_check(ctx, c, cfg)) != DTR_OK) return r;
    r = dtr_model_build(m);
    if (r != DTR_OK) return r;
    dp = (dtr_dp *)dtr__calloc(&ctx->alloc, sizeof(*dp));
    if (!dp) return dtr__fail(ctx, DTR_OUT_OF_MEMORY, "dtr_dp_create: out of memory");
    dp->m = m;
    dp->c = c;
    dp->ctx = ctx;
    dp->cfg = *cfg;
    if (!dp->cfg.bucket_bytes) dp->cfg.bucket_bytes = (size_t)25 << 20;
    r = dtr__dpc_create(m, c, cfg, &dp->cz);
    if (r != DTR_OK) { dtr_dp_destroy(dp); return r; }
    if (dtr_comm_size(c) > 1) {
        r = dtr__dp_buckets(dp);
        if (r != DTR_OK) { dtr_dp_destroy(dp); return dtr__fail(ctx, r, "dtr_dp_create: out of memory"); }
        if (cfg->zero && (r = dtr__zero_create(m, c, cfg, dp->nb, &dp->z)) != DTR_OK) { dtr_dp_destroy(dp); return r; }
        r = dtr_dp_broadcast_params(dp);
        if (r != DTR_OK) { dtr_dp_destroy(dp); return r; }
        r = dtr_context_add_grad_hook(ctx, dtr__dp_grad_ready, dp, &dp->hook_id);
        if (r != DTR_OK) { dtr_dp_destroy(dp); return r; }
    }
    *out = dp;
    return DTR_OK;
}

static dtr_result dtr__dp_wait_all(dtr_dp *dp) {
    dtr_result first = DTR_OK;
    int i;
    for (i = 0; i < dp->nb; i++) {
        if (dp->b[i].req) {
            dtr_result r = dtr_request_wait(dp->b[i].req);
            if (r != DTR_OK && first == DTR_OK) first = r;
            dtr_request_destroy(dp->b[i].req);
            dp->b[i].req = NULL;
        }
    }
    return first;
}

void dtr_dp_destroy(dtr_dp *dp) {
    dtr_allocation_callbacks a;
    if (!dp) return;
    a = dp->ctx->alloc;
    if (dp->b) dtr__dp_wait_all(dp);
    if (dp->hook_id) dtr_context_remove_grad_hook(dp->ctx, dp->hook_id);
    dtr__free(&a, dp->b);
    dtr__free(&a, dp->param_bucket);
    dtr__dpc_destroy(dp->cz);
    dtr__zero_destroy(dp->z);
    dtr__free(&a, dp);
}

/* `fn` called between a synchronised backward and its finish: described on the group; the
   context stays usable */
static dtr_result dtr__dp_busy(dtr_dp *dp, const char *fn) {
    return dtr__comm_fail(dp->c, NULL, DTR_BAD_STATE, -1, 0,
                          "%s: gradient buckets are in flight (call dtr_dp_finish first)", fn);
}

dtr_result dtr_dp_set_no_sync(dtr_dp *dp, int no_sync) {
    if (!dp) return DTR_NULL_HANDLE;
    if (dp->nb && dp->next > 0) return dtr__dp_busy(dp, "dtr_dp_set_no_sync");
    dp->no_sync = no_sync ? 1 : 0;
    return DTR_OK;
}

dtr_result dtr_dp_finish(dtr_dp *dp) {
    dtr_result r, w;
    int i;
    if (!dp) return DTR_NULL_HANDLE;
    if (!dp->nb || dp->no_sync || dtr__dp_local(dp)) return DTR_OK;
    for (i = dp->next; i < dp->nb; i++) dp->b[i].pending = 0;   /* parameters backward did not reach */
    r = dtr__dp_launch_ready(dp, 0);
    w = dtr__dp_wait_all(dp);
    if (dp->cfg.zero == 2) {   /* waits for the exchange even after an error */
        dtr_result zr = dtr__zero_reduce(dp->z, dtr__dpc_stats(dp->cz));
        if (w == DTR_OK) w = zr;
    }
    for (i = 0; i < dp->nb && r == DTR_OK && w == DTR_OK && dp->cfg.zero != 2; i++)
        w = dtr__dpc_finish(dp->cz, i, dtr_model_grads(dp->m), dp->b[i].begin);
    dtr__dpc_stats(dp->cz)->syncs++;
    dp->overlapped = 0;
    for (i = 0; i < dp->nb; i++) dp->overlapped += dp->b[i].in_backward;
    dtr__dp_reset(dp);
    if (r == DTR_OK) r = w;
    if (r != DTR_OK) return dtr__fail(dp->ctx, r, "dtr_dp_finish: %s", dtr_comm_last_error(dp->c));
    return DTR_OK;
}

dtr_result dtr_dp_shard(const dtr_dp *dp, int64_t *begin, int64_t *end) {
    if (!dp || !begin || !end) return DTR_NULL_HANDLE;
    *begin = 0;
    *end = dtr_model_numel(dp->m);
    if (dp->z) dtr__zero_shard(dp->z, begin, end);
    return DTR_OK;
}

dtr_result dtr_dp_shard_optimizer(const dtr_dp *dp, dtr_optimizer_config *oc) {
    if (!dp || !oc) return DTR_NULL_HANDLE;
    oc->shard_sum = dp->z ? dtr__zero_sum : NULL;
    oc->shard_sum_user = oc->shard_sum ? dp->z : NULL;
    return dtr_dp_shard(dp, &oc->shard_begin, &oc->shard_end);
}

dtr_result dtr_dp_step_done(dtr_dp *dp) {
    dtr_dp_stats *st;
    int64_t n, w;
    dtr_result r;
    if (!dp) return DTR_NULL_HANDLE;
    if (dp->nb && dp->next > 0) return dtr__dp_busy(dp, "dtr_dp_step_done");
    st = dtr__dpc_stats(dp->cz);
    if (dp->z) {
        st->steps++;
        return dtr__zero_gather(dp->z, st);
    }
    w = ++st->steps - dp->cfg.local_sgd_warmup;
    if (!dp->nb || dp->cfg.local_sgd_every <= 0 || w <= 0 || w % dp->cfg.local_sgd_every) return DTR_OK;
    n = dtr_model_numel(dp->m);
    r = dtr_comm_all_reduce(dp->c, dtr_model_params(dp->m), dtr_model_params(dp->m), (size_t)n, DTR_F32, DTR_REDUCE_AVG);
    if (r != DTR_OK) return dtr__fail(dp->ctx, r, "local SGD: parameter average: %s", dtr_comm_last_error(dp->c));
    st->param_averages++;
    st->wire_bytes += (uint64_t)n * sizeof(float);
    st->raw_bytes += (uint64_t)n * sizeof(float);
    return DTR_OK;
}

dtr_result dtr_dp_get_stats(const dtr_dp *dp, dtr_dp_stats *out) {
    if (!dp || !out) return DTR_NULL_HANDLE;
    *out = *dtr__dpc_stats(dp->cz);
    return DTR_OK;
}

dtr_result dtr_dp_broadcast_params(dtr_dp *dp) {
    dtr_result r;
    if (!dp) return DTR_NULL_HANDLE;
    if (dtr_comm_size(dp->c) == 1) return DTR_OK;
    r = dtr_comm_broadcast(dp->c, dtr_model_params(dp->m), (size_t)dtr_model_numel(dp->m), DTR_F32, dp->cfg.root);
    if (r != DTR_OK) return dtr__fail(dp->ctx, r, "data parallel: parameter broadcast: %s", dtr_comm_last_error(dp->c));
    return DTR_OK;
}

int dtr_dp_bucket_count(const dtr_dp *dp) { return dp ? dp->nb : 0; }

dtr_result dtr_dp_bucket_range(const dtr_dp *dp, int i, int64_t *begin, int64_t *end) {
    if (!dp || !begin || !end) return DTR_NULL_HANDLE;
    if (i < 0 || i >= dp->nb) return DTR_INVALID_ARGUMENT;
    *begin = dp->b[i].begin;
    *end = dp->b[i].end;
    return DTR_OK;
}

int dtr_dp_overlapped_buckets(const dtr_dp *dp) { return dp ? dp->overlapped : 0; }

/* ---- state ---- */

dtr_result dtr_dp_state(dtr_dp *dp, int index, dtr_state_entry *out) {
    size_t bytes;
    float *resid;
    if (!dp || !out) return DTR_NULL_HANDLE;
    resid = dtr__dpc_residual(dp->cz, &bytes);
    if (index == 0) return dtr__state_put(out, "no_sync", &dp->no_sync, sizeof dp->no_sync, 0);
    if (index == 1) return dtr__state_put(out, "steps", &dtr__dpc_stats(dp->cz)->steps, sizeof(int64_t), 0);
    if (index == 2 && resid) return dtr__state_put(out, "residual", resid, bytes, 0);
    return DTR_NOT_FOUND;
}

dtr_result dtr_dp_state_loaded(dtr_dp *dp) {
    if (!dp) return DTR_NULL_HANDLE;
    if (dp->no_sync != 0 && dp->no_sync != 1)
        return dtr__fail(dp->ctx, DTR_CORRUPT_FILE, "dtr_dp_state_loaded: no_sync is %d", dp->no_sync);
    if (dtr__dpc_stats(dp->cz)->steps < 0)
        return dtr__fail(dp->ctx, DTR_CORRUPT_FILE, "dtr_dp_state_loaded: steps is %lld",
                         (long long)dtr__dpc_stats(dp->cz)->steps);
    return DTR_OK;
}
#line 20234 "dtrain.h"

/* ---- src/engine/pipeline.c ---- */
#line 1 "src/engine/pipeline.c"
/* ============================================================================
 * Pipeline parallelism: each rank of a group holds some consecutive layers of the model (a
 * stage, or with interleaving several model chunks), and the micro-batches of a batch flow
 * through the stages: activations forward by point-to-point sends, their gradients back.
 *
 * A step runs this rank's plan, a list of actions F(chunk, mb) and B(chunk, mb) that the
 * schedule fixes (GPipe: every forward, then every backward; 1F1B: P - rank - 1 forwards of
 * warm-up, then one forward and one backward in turn, then the rest of the backwards;
 * interleaved: Megatron-LM's order over `chunks` model chunks per rank). Sends never block
 * (their requests are collected and reclaimed later), receives block (with the group's
 * deadline), so a rank waits only for data it needs next: the plans of all ranks together
 * cannot deadlock, and a dead stage turns into DTR_PEER_FAILED on the others.
 *
 * Memory: each micro-batch in flight has its own tape (dtr_tape), reset as soon as its
 * backward is done and its gradient sent; 1F1B keeps at most P micro-batches of activations
 * alive on the first stage, GPipe keeps M.
 *
 * Wire format, per (sender, receiving chunk): an activation is a header of 1 + DTR_MAX_DIMS
 * int64 (ndim, shape) on tag + 3c, its f32 data on tag + 3c + 1; a gradient (shape known to
 * both) is f32 data on tag + 3c + 2. Messages of one tag arrive in order, and every stage
 * handles the micro-batches of a chunk in increasing order in both directions.
 * ==========================================================================*/





/* one micro-batch in flight: its tape, input (received or NULL), output, sends */
typedef struct dtr__pipe_slot {
    dtr_tape *tape;
    dtr_tensor *in, *out;
    dtr_request *req[3];           /* header, activation, gradient sends */
    int64_t hdr[1 + DTR_MAX_DIMS]; /* header being sent */
    int busy;                      /* 1 from its forward until its backward is done */
} dtr__pipe_slot;

typedef struct dtr__pipe_action { int fwd, chunk, mb; } dtr__pipe_action;

struct dtr_pipe {
    dtr_model *m;
    dtr_context *ctx;
    dtr_comm *c;
    dtr_pipe_config cfg;
    int rank, P, v, M;
    dtr__pipe_slot **slots;         /* each allocated once: pending sends point into them */
    int n_slots, live_now;
    dtr__pipe_slot **live;          /* [chunk * M + mb] during a step */
    dtr__pipe_action *plan;         /* 2 * v * M actions */
    double loss;                    /* weighted sum of this step's micro-batch losses */
    dtr_pipe_stats stats;
};

/* ---- configuration and plans ---- */

dtr_pipe_config dtr_pipe_config_init(void) {
    dtr_pipe_config c;
    memset(&c, 0, sizeof(c));
    c.schedule = DTR_PIPE_1F1B;
    c.microbatches = 1;
    c.chunks = 1;
    c.tag = 1 << 24;
    return c;
}

/* Megatron-LM's interleaved order: forward k runs chunk (k mod P*v) / P of micro-batch
 * (k / (P*v)) * P + k mod P; backward k the same micro-batch of the mirrored chunk. */
static dtr__pipe_action dtr__pipe_interleaved(const dtr_pipe *p, int k, int fwd) {
    dtr__pipe_action a;
    int group = p->P * p->v, chunk = (k % group) / p->P;
    a.fwd = fwd;
    a.chunk = fwd ? chunk : p->v - 1 - chunk;
    a.mb = (k / group) * p->P + k % p->P;
    return a;
}

static dtr__pipe_action dtr__pipe_nth(const dtr_pipe *p, int k, int fwd) {
    dtr__pipe_action a;
    if (p->v > 1) return dtr__pipe_interleaved(p, k, fwd);
    a.fwd = fwd, a.chunk = 0, a.mb = k;
    return a;
}

/* forwards before the first backward on this rank */
static int dtr__pipe_warmup(const dtr_pipe *p) {
    int total = p->v * p->M, w;
    if (p->cfg.schedule == DTR_PIPE_GPIPE) return total;
    if (p->v == 1) w = p->P - p->rank - 1;
    else w = p->M == p->P ? total : (p->P - p->rank - 1) * 2 + (p->v - 1) * p->P;
    return w < total ? w : total;
}

static void dtr__pipe_build_plan(dtr_pipe *p) {
    int total = p->v * p->M, w = dtr__pipe_warmup(p), n = 0, k;
    for (k = 0; k < w; k++) p->plan[n++] = dtr__pipe_nth(p, k, 1);
    for (k = 0; k < total - w; k++) {
        p->plan[n++] = dtr__pipe_nth(p, w + k, 1);
        p->plan[n++] = dtr__pipe_nth(p, k, 0);
    }
    for (k = total - w; k < total; k++) p->plan[n++] = dtr__pipe_nth(p, k, 0);
}

static dtr_result dtr__pipe_check(dtr_context *ctx, const dtr_pipe_config *cfg, int P) {
    const char *fn = "dtr_pipe_create";
    if (!cfg->forward) return dtr__fail(ctx, DTR_NULL_HANDLE, "%s: cfg.forward is NULL", fn);
    if (cfg->microbatches < 1 || cfg->microbatches > 1 << 16)
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "%s: %d micro-batches (1 to 65536)", fn, cfg->microbatches);
    if ((int)cfg->schedule < 0 || cfg->schedule > DTR_PIPE_INTERLEAVED)
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "%s: unknown schedule %d", fn, (int)cfg->schedule);
    if (cfg->chunks < 1 || cfg->chunks > 64 || (cfg->chunks > 1) != (cfg->schedule == DTR_PIPE_INTERLEAVED))
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "%s: %d model chunks per rank with the %s schedule "
                         "(the interleaved schedule takes 2 or more, the others 1)", fn, cfg->chunks,
                         dtr_pipe_schedule_name(cfg->schedule));
    if (cfg->chunks > 1 && (P < 2 || cfg->microbatches % P))
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "%s: the interleaved schedule needs 2 or more ranks and a "
                         "micro-batch count divisible by them (%d micro-batches, %d ranks)", fn, cfg->microbatches, P);
    if (cfg->batch < 0 || (cfg->batch > 0 && cfg->batch < cfg->microbatches))
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "%s: a batch of %lld samples cannot make %d micro-batches", fn,
                         (long long)cfg->batch, cfg->microbatches);
    if (cfg->tag < 0 || cfg->tag > INT32_MAX - 3 * cfg->chunks)
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "%s: tag %d out of range", fn, cfg->tag);
    return DTR_OK;
}

const char *dtr_pipe_schedule_name(dtr_pipe_schedule s) {
    switch (s) {
    case DTR_PIPE_GPIPE: return "gpipe";
    case DTR_PIPE_1F1B: return "1f1b";
    case DTR_PIPE_INTERLEAVED: return "interleaved";
    }
    return "?";
}

dtr_result dtr_pipe_create(dtr_model *m, dtr_comm *c, const dtr_pipe_config *cfg, dtr_pipe **out) {
    dtr_context *ctx;
    dtr_pipe *p;
    dtr_result r;
    if (!out) return DTR_NULL_HANDLE;
    *out = NULL;
    if (!m || !c || !cfg) return DTR_NULL_HANDLE;
    ctx = dtr_model_context(m);
    if ((r = dtr__pipe_check(ctx, cfg, dtr_comm_size(c))) != DTR_OK) return r;
    p = (dtr_pipe *)dtr__calloc(&ctx->alloc, sizeof(*p));
    if (!p) return dtr__fail(ctx, DTR_OUT_OF_MEMORY, "dtr_pipe_create: out of memory");
    p->m = m, p->ctx = ctx, p->c = c, p->cfg = *cfg;
    p->rank = dtr_comm_rank(c), p->P = dtr_comm_size(c), p->v = cfg->chunks, p->M = cfg->microbatches;
    p->live = (dtr__pipe_slot **)dtr__calloc(&ctx->alloc, (size_t)(p->v * p->M) * sizeof(*p->live));
    p->plan = (dtr__pipe_action *)dtr__calloc(&ctx->alloc, (size_t)(2 * p->v * p->M) * sizeof(*p->plan));
    if (!p->live || !p->plan) {
        dtr_pipe_destroy(p);
        return dtr__fail(ctx, DTR_OUT_OF_MEMORY, "dtr_pipe_create: out of memory");
    }
    dtr__pipe_build_plan(p);
    if ((r = dtr_model_build(m)) != DTR_OK) { dtr_pipe_destroy(p); return r; }
    *out = p;
    return DTR_OK;
}

void dtr_pipe_destroy(dtr_pipe *p) {
    int i, k;
    if (!p) return;
    for (i = 0; i < p->n_slots; i++) {
        for (k = 0; k < 3; k++) dtr_request_destroy(p->slots[i]->req[k]);
        dtr_tape_destroy(p->slots[i]->tape);
        dtr__free(&p->ctx->alloc, p->slots[i]);
    }
    dtr__free(&p->ctx->alloc, p->slots);
    dtr__free(&p->ctx->alloc, p->live);
    dtr__free(&p->ctx->alloc, p->plan);
    dtr__free(&p->ctx->alloc, p);
}

/* ---- queries ---- */

int dtr_pipe_stage(const dtr_pipe *p, int chunk) { return p && chunk >= 0 && chunk < p->v ? chunk * p->P + p->rank : -1; }
int dtr_pipe_stage_count(const dtr_pipe *p) { return p ? p->P * p->v : 0; }

dtr_result dtr_pipe_microbatch_range(const dtr_pipe *p, int mb, int64_t *begin, int64_t *end) {
    if (!p || !begin || !end) return DTR_NULL_HANDLE;
    if (mb < 0 || mb >= p->M || p->cfg.batch <= 0)
        return dtr__fail(p->ctx, DTR_INVALID_ARGUMENT, "dtr_pipe_microbatch_range: micro-batch %d of %d%s", mb, p->M,
                         p->cfg.batch <= 0 ? " (cfg.batch is not set)" : "");
    *begin = p->cfg.batch * mb / p->M;
    *end = p->cfg.batch * (mb + 1) / p->M;
    return DTR_OK;
}

dtr_result dtr_pipe_get_stats(const dtr_pipe *p, dtr_pipe_stats *out) {
    if (!p || !out) return DTR_NULL_HANDLE;
    *out = p->stats;
    return DTR_OK;
}

/* ---- slots ---- */

/* 1 when every send of the slot is complete (their requests freed); errors go to *r */
static int dtr__pipe_sent(dtr__pipe_slot *s, dtr_result *r) {
    int k, done = 1, d;
    for (k = 0; k < 3; k++) {
        if (!s->req[k]) continue;
        d = 0;
        if ((*r = dtr_request_test(s->req[k], &d)) != DTR_OK) return 0;
        if (!d) { done = 0; continue; }
        dtr_request_destroy(s->req[k]);
        s->req[k] = NULL;
    }
    return done;
}

/* A free slot (backward done, sends complete, tape reset); a new one when none is. */
static dtr__pipe_slot *dtr__pipe_acquire(dtr_pipe *p, dtr_result *r) {
    dtr__pipe_slot *s, **grown;
    int i;
    *r = DTR_OK;
    for (i = 0; i < p->n_slots; i++) {
        s = p->slots[i];
        if (!s->busy && dtr__pipe_sent(s, r)) { dtr_tape_reset(s->tape); return s; }
        if (*r != DTR_OK) return NULL;
    }
    grown = (dtr__pipe_slot **)dtr__realloc(&p->ctx->alloc, p->slots, (size_t)(p->n_slots + 1) * sizeof(*grown));
    s = (dtr__pipe_slot *)dtr__calloc(&p->ctx->alloc, sizeof(*s));
    if (grown) p->slots = grown;
    if (!grown || !s || (*r = dtr_tape_create(p->ctx, &s->tape)) != DTR_OK) {
        dtr__free(&p->ctx->alloc, s);
        if (*r == DTR_OK) *r = dtr__fail(p->ctx, DTR_OUT_OF_MEMORY, "dtr_pipe_step: out of memory");
        return NULL;
    }
    p->slots[p->n_slots++] = s;
    return s;
}

/* ---- one forward and one backward ---- */

static int dtr__pipe_first(const dtr_pipe *p, int chunk) { return chunk == 0 && p->rank == 0; }
static int dtr__pipe_last(const dtr_pipe *p, int chunk) { return chunk == p->v - 1 && p->rank == p->P - 1; }
static int dtr__pipe_next(const dtr_pipe *p) { return (p->rank + 1) % p->P; }
static int dtr__pipe_prev(const dtr_pipe *p) { return (p->rank + p->P - 1) % p->P; }

static dtr_result dtr__pipe_comm_fail(dtr_pipe *p, dtr_result r, const char *what, int chunk, int mb) {
    return dtr__fail(p->ctx, r, "dtr_pipe_step: stage %d, micro-batch %d: %s: %s", dtr_pipe_stage(p, chunk), mb, what,
                     dtr_comm_last_error(p->c));
}

/* a blocking receive, its time counted as waiting */
static dtr_result dtr__pipe_recv(dtr_pipe *p, void *buf, size_t bytes, int src, int tag) {
    int64_t t0 = dtr_time_ns();
    dtr_result r = dtr_comm_recv(p->c, buf, bytes, src, tag);
    p->stats.wait_s += (double)(dtr_time_ns() - t0) * 1e-9;
    return r;
}

/* receives the activation header for (chunk, mb) and makes the input tensor on the slot's tape */
static dtr_result dtr__pipe_recv_input(dtr_pipe *p, dtr__pipe_slot *s, int chunk, int mb) {
    int64_t hdr[1 + DTR_MAX_DIMS];
    int tag = p->cfg.tag + 3 * chunk, d;
    dtr_result r = dtr__pipe_recv(p, hdr, sizeof hdr, dtr__pipe_prev(p), tag);
    if (r != DTR_OK) return dtr__pipe_comm_fail(p, r, "receiving an activation's shape", chunk, mb);
    if (hdr[0] < 1 || hdr[0] > DTR_MAX_DIMS) goto bad;
    for (d = 1; d <= hdr[0]; d++)
        if (hdr[d] < 1 || hdr[d] > ((int64_t)1 << 31)) goto bad;
    s->in = dtr_tensor_new(p->ctx, DTR_F32, (int)hdr[0], hdr + 1);
    if (!s->in) return p->ctx->status;
    r = dtr__pipe_recv(p, dtr_tensor_data(s->in), (size_t)dtr_tensor_numel(s->in) * sizeof(float), dtr__pipe_prev(p), tag + 1);
    if (r != DTR_OK) return dtr__pipe_comm_fail(p, r, "receiving an activation", chunk, mb);
    dtr_tensor_requires_grad(s->in);
    return DTR_OK;
bad:
    return dtr__fail(p->ctx, DTR_INVALID_ARGUMENT, "dtr_pipe_step: stage %d, micro-batch %d: malformed activation "
                     "header from rank %d (ndim %lld)", dtr_pipe_stage(p, chunk), mb, dtr__pipe_prev(p), (long long)hdr[0]);
}

static dtr_result dtr__pipe_send(dtr_pipe *p, dtr__pipe_slot *s, int k, const void *buf, size_t bytes, int dst, int tag) {
    p->stats.bytes_sent += (int64_t)bytes;
    return dtr_comm_send_async(p->c, buf, bytes, dst, tag, &s->req[k]);
}

/* sends the output of (chunk, mb) to the next stage: header, then data */
static dtr_result dtr__pipe_send_output(dtr_pipe *p, dtr__pipe_slot *s, int chunk, int mb) {
    int next_chunk = chunk + (p->rank == p->P - 1), tag = p->cfg.tag + 3 * next_chunk, d;
    dtr_result r;
    if (!dtr_tensor_is_contiguous(s->out) && !(s->out = dtr_contiguous(p->ctx, s->out))) return p->ctx->status;
    s->hdr[0] = dtr_tensor_ndim(s->out);
    for (d = 0; d < DTR_MAX_DIMS; d++) s->hdr[1 + d] = d < s->hdr[0] ? dtr_tensor_dim(s->out, d) : 0;
    r = dtr__pipe_send(p, s, 0, s->hdr, sizeof s->hdr, dtr__pipe_next(p), tag);
    if (r == DTR_OK)
        r = dtr__pipe_send(p, s, 1, dtr_tensor_data(s->out), (size_t)dtr_tensor_numel(s->out) * sizeof(float),
                           dtr__pipe_next(p), tag + 1);
    return r == DTR_OK ? DTR_OK : dtr__pipe_comm_fail(p, r, "sending an activation", chunk, mb);
}

/* the weight of micro-batch mb in the batch's mean loss */
static float dtr__pipe_weight(const dtr_pipe *p, int mb) {
    int64_t b, e;
    if (p->cfg.batch <= 0) return 1.0f / (float)p->M;
    dtr_pipe_microbatch_range(p, mb, &b, &e);
    return (float)(e - b) / (float)p->cfg.batch;
}

/* checks the stage's output; the last stage's loss is counted, the others' sent on */
static dtr_result dtr__pipe_take_output(dtr_pipe *p, dtr__pipe_slot *s, int chunk, int mb) {
    int stage = dtr_pipe_stage(p, chunk);
    if (!s->out)
        return p->ctx->status != DTR_OK ? p->ctx->status
                                        : dtr__fail(p->ctx, DTR_INVALID_ARGUMENT, "dtr_pipe_step: the forward of stage %d "
                                                    "returned NULL for micro-batch %d", stage, mb);
    if (dtr_tensor_dtype(s->out) != DTR_F32)
        return dtr__fail(p->ctx, DTR_DTYPE_MISMATCH, "dtr_pipe_step: the forward of stage %d returned %s for micro-batch %d "
                         "(stages exchange f32)", stage, dtr_dtype_name(dtr_tensor_dtype(s->out)), mb);
    if (!dtr__pipe_last(p, chunk)) return dtr__pipe_send_output(p, s, chunk, mb);
    if (dtr_tensor_numel(s->out) != 1)
        return dtr__fail(p->ctx, DTR_SHAPE_MISMATCH, "dtr_pipe_step: the last stage must return a scalar loss, not %lld "
                         "values", (long long)dtr_tensor_numel(s->out));
    p->loss += (double)dtr__pipe_weight(p, mb) * dtr_tensor_get(s->out, 0);
    return DTR_OK;
}

static dtr_result dtr__pipe_forward(dtr_pipe *p, int chunk, int mb) {
    dtr_result r;
    dtr__pipe_slot *s = dtr__pipe_acquire(p, &r);
    dtr_tape *was;
    if (!s) return r;
    was = dtr_context_set_tape(p->ctx, s->tape);
    s->in = NULL;
    r = dtr__pipe_first(p, chunk) ? DTR_OK : dtr__pipe_recv_input(p, s, chunk, mb);
    if (r == DTR_OK) {
        s->out = p->cfg.forward(p->cfg.user, p->ctx, chunk, mb, s->in);
        r = dtr__pipe_take_output(p, s, chunk, mb);
    }
    dtr_context_set_tape(p->ctx, was);
    s->busy = 1;
    p->live[chunk * p->M + mb] = s;
    if (++p->live_now > p->stats.max_live) p->stats.max_live = p->live_now;
    return r;
}

/* sends the gradient of the slot's input to the previous stage (zeros if it got none) */
static dtr_result dtr__pipe_send_grad(dtr_pipe *p, dtr__pipe_slot *s, int chunk, int mb) {
    int64_t n = dtr_tensor_numel(s->in);
    const float *g = dtr_tensor_grad(s->in);
    dtr_result r;
    if (!g) {
        dtr_tape *was = dtr_context_set_tape(p->ctx, s->tape);
        dtr_tensor *z = dtr_tensor_zeros(p->ctx, DTR_F32, 1, &n);
        dtr_context_set_tape(p->ctx, was);
        if (!z) return p->ctx->status;
        g = (const float *)dtr_tensor_data(z);
    }
    r = dtr__pipe_send(p, s, 2, g, (size_t)n * sizeof(float), dtr__pipe_prev(p), p->cfg.tag + 3 * chunk + 2);
    return r == DTR_OK ? DTR_OK : dtr__pipe_comm_fail(p, r, "sending a gradient", chunk, mb);
}

static dtr_result dtr__pipe_backward(dtr_pipe *p, int chunk, int mb, int last_backward) {
    dtr__pipe_slot *s = p->live[chunk * p->M + mb];
    dtr_result r = DTR_OK;
    float seed = dtr__pipe_weight(p, mb), *g = &seed;
    if (p->cfg.dp && (r = dtr_dp_set_no_sync(p->cfg.dp, !last_backward)) != DTR_OK) return r;
    if (!dtr__pipe_last(p, chunk)) {
        dtr_tape *was = dtr_context_set_tape(p->ctx, s->tape);
        int64_t n = dtr_tensor_numel(s->out);
        dtr_tensor *gt = dtr_tensor_new(p->ctx, DTR_F32, 1, &n);
        dtr_context_set_tape(p->ctx, was);
        if (!gt) return p->ctx->status;
        g = (float *)dtr_tensor_data(gt);
        r = dtr__pipe_recv(p, g, (size_t)n * sizeof(float), dtr__pipe_next(p), p->cfg.tag + 3 * (chunk + (p->rank == p->P - 1)) + 2);
        if (r != DTR_OK) return dtr__pipe_comm_fail(p, r, "receiving a gradient", chunk, mb);
    }
    if ((r = dtr_backward_from(p->ctx, s->out, g)) != DTR_OK) return r;
    if (s->in && (r = dtr__pipe_send_grad(p, s, chunk, mb)) != DTR_OK) return r;
    s->busy = 0;
    p->live[chunk * p->M + mb] = NULL;
    p->live_now--;
    return DTR_OK;
}

/* ---- the step ---- */

/* waits for every send and frees every micro-batch's tape; the first error wins */
static dtr_result dtr__pipe_drain(dtr_pipe *p, dtr_result r) {
    int i, k;
    for (i = 0; i < p->n_slots; i++) {
        dtr__pipe_slot *s = p->slots[i];
        for (k = 0; k < 3; k++) {
            dtr_result w = s->req[k] ? dtr_request_wait(s->req[k]) : DTR_OK;
            if (r == DTR_OK && w != DTR_OK) r = dtr__pipe_comm_fail(p, w, "completing a send", 0, -1);
            dtr_request_destroy(s->req[k]);
            s->req[k] = NULL;
        }
        s->busy = 0;
        dtr_tape_reset(s->tape);
    }
    memset(p->live, 0, (size_t)(p->v * p->M) * sizeof(*p->live));
    p->live_now = 0;
    return r;
}

static dtr_result dtr__pipe_run_plan(dtr_pipe *p) {
    int n = 2 * p->v * p->M, i, last_b = n - 1;
    dtr_result r = DTR_OK;
    while (last_b > 0 && p->plan[last_b].fwd) last_b--;
    for (i = 0; i < n && r == DTR_OK; i++) {
        const dtr__pipe_action *a = &p->plan[i];
        r = a->fwd ? dtr__pipe_forward(p, a->chunk, a->mb) : dtr__pipe_backward(p, a->chunk, a->mb, i == last_b);
    }
    return r;
}

dtr_result dtr_pipe_step(dtr_pipe *p, float *loss) {
    int64_t t0;
    float l;
    dtr_result r;
    if (!p) return DTR_NULL_HANDLE;
    if (p->ctx->status != DTR_OK) return p->ctx->status;
    t0 = dtr_time_ns();
    p->loss = 0.0;
    p->stats.wait_s = 0.0;
    p->stats.bytes_sent = 0;
    p->stats.max_live = 0;
    r = dtr__pipe_run_plan(p);
    if (r == DTR_OK && p->cfg.dp) r = dtr_dp_finish(p->cfg.dp);
    if (r != DTR_OK && dtr_comm_status(p->c) == DTR_OK) dtr_comm_abort(p->c, dtr_context_last_error(p->ctx));
    r = dtr__pipe_drain(p, r);
    l = (float)p->loss;
    if (r == DTR_OK && (r = dtr_comm_broadcast(p->c, &l, 1, DTR_F32, p->P - 1)) != DTR_OK)
        r = dtr__pipe_comm_fail(p, r, "sharing the loss", p->v - 1, -1);
    if (r == DTR_OK && loss) *loss = l;
    p->stats.step_s = (double)(dtr_time_ns() - t0) * 1e-9;
    p->stats.bubble = p->stats.step_s > 0 ? p->stats.wait_s / p->stats.step_s : 0.0;
    p->stats.bubble_theory = (double)(p->P - 1) / (double)(p->v * p->M + p->P - 1);
    return r;
}
#line 20667 "dtrain.h"

/* ---- src/engine/ps.c ---- */
#line 1 "src/engine/ps.c"
/* ============================================================================
 * Parameter servers (docs/parameter-server.md). Ranks 0..S-1 of the engine's group are
 * servers, the others workers. Server s owns floats [range[s], range[s + 1]) of the model's
 * parameter buffer and its optimizer state; workers push gradients and pull parameters.
 *
 * Wire: a worker sends requests (PUSH, PULL, DONE: src/engine/ps.h) on tag REQ, in order;
 * a server listens with one receive per worker and answers a PULL on tag REP when the mode
 * allows (SYNC: its clock reached the one wanted; SSP: the slowest live worker within s
 * clocks; ASYNC: at once). A worker posts the receive of the reply before it asks, so the
 * server's replies never wait on a worker's progress.
 *
 * The server's own group (a split of the application's) has a deadline far away: a listening
 * receive may wait as long as a worker computes. The engine keeps its own deadline instead
 * (worker_deadline_ms, on the workers a server waits on), so that no wait is unbounded.
 * ==========================================================================*/






#define DTR__PS_LISTEN_MS (24 * 3600 * 1000)   /* the server group's deadline: a day */

enum { DTR__PS_LIVE = 0, DTR__PS_FINISHED = 1, DTR__PS_DROPPED = 2 };

typedef struct dtr__ps_peer {  /* a server's view of one worker */
    uint8_t *in, *out;         /* the listening receive's buffer, the reply's */
    dtr_request *rreq, *sreq;
    int state, pushed, waiting;
    int64_t clock, want, last_ns;
} dtr__ps_peer;

struct dtr_ps {
    dtr_model *m;
    dtr_context *ctx;
    dtr_comm *g;               /* the engine's group (a split of the application's) */
    dtr_ps_config cfg;
    int S, W, server, index;
    int64_t *range;            /* S + 1 offsets */
    int64_t maxlen;            /* the longest range */
    dtr_ps_stats st;
    /* server */
    dtr_optimizer *opt;
    dtr__ps_peer *peer;
    float *slots;              /* SYNC: W pushes of this round, in worker order */
    float *scratch;            /* a range of floats: decoded rows */
    int64_t clock, last_any_ns;
    /* worker */
    uint8_t **msg, **rep;      /* S request and S reply buffers */
    int64_t *sclock;           /* SYNC: each server's clock at the last pull */
    int64_t wclock;            /* pushes made */
    int pushed;                /* a push since the last pull */
};

static const size_t dtr__ps_hdr_bytes = sizeof(dtr__ps_hdr);

/* ---- configuration ---- */

dtr_ps_config dtr_ps_config_init(void) {
    dtr_ps_config c;
    memset(&c, 0, sizeof c);
    c.mode = DTR_PS_SYNC;
    c.staleness = 2;
    c.opt = dtr_optimizer_config_init(DTR_OPT_SGD, 0.01f);
    c.push_dtype = DTR_F32;
    c.worker_deadline_ms = 60000;
    c.policy = DTR_PS_FAIL;
    return c;
}

int dtr_ps_servers_from_env(int fallback) {
    const char *s = getenv("DTR_PS_SERVERS");
    char *end = NULL;
    long v;
    if (!s || !*s) return fallback;
    v = strtol(s, &end, 10);
    return (*end == 0 && v > 0 && v < 65536) ? (int)v : fallback;
}

static void dtr__ps_log(const dtr_ps *ps, dtr_log_level lv, const char *fmt, ...) DTR__PRINTF(3, 4);
static void dtr__ps_log(const dtr_ps *ps, dtr_log_level lv, const char *fmt, ...) {
    char msg[320];
    va_list ap;
    if (!ps->cfg.log) return;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    ps->cfg.log(ps->cfg.log_user, lv, msg);
}

/* ---- the wire ---- */

uint64_t dtr__ps_trailer(const dtr__ps_hdr *h) {
    return ((uint64_t)h->clock * 0x9E3779B97F4A7C15ull) ^ ((uint64_t)h->magic << 16) ^ h->kind;
}

size_t dtr__ps_message_bytes(const dtr__ps_hdr *h) {
    int rows = h->kind == DTR__PS_PUSH_ROWS || h->kind == DTR__PS_PULL_ROWS;
    int values = h->kind == DTR__PS_PUSH || h->kind == DTR__PS_REPLY || h->kind == DTR__PS_PUSH_ROWS;
    size_t es = values ? dtr_dtype_size((dtr_dtype)h->dtype) : 0, segs = 0;
    if (h->kind < DTR__PS_PUSH || h->kind > DTR__PS_PULL_ROWS || h->count < 0 || h->count > ((int64_t)1 << 40)) return 0;
    if (values && es == 0) return 0;
    if (!values && !rows && h->count != 0) return 0;
    if (rows && (h->begin < 1 || h->begin > DTR__PS_MAX_SEGMENTS)) return 0;
    if (rows) segs = (size_t)h->begin * 16;
    return sizeof *h + segs + (size_t)h->count * es + 8;
}

/* the segments of a ROWS message: each inside the server's range, their lengths summing to count */
static dtr_result dtr__ps_parse_segments(const uint8_t *buf, const dtr__ps_hdr *h, const dtr__ps_expect *e, char *why,
                                         size_t whylen) {
    int64_t i, sum = 0;
    if (h->count > e->count) return dtr__errf(why, whylen, DTR_CORRUPT_FILE, "%lld row values, the range holds %lld",
                                              (long long)h->count, (long long)e->count);
    for (i = 0; i < h->begin; i++) {
        int64_t seg[2];
        memcpy(seg, buf + sizeof *h + (size_t)i * 16, 16);
        if (seg[1] < 1 || seg[0] < e->begin || seg[1] > e->count || seg[0] - e->begin > e->count - seg[1])
            return dtr__errf(why, whylen, DTR_CORRUPT_FILE, "segment %lld [%lld, +%lld) outside the range", (long long)i,
                             (long long)seg[0], (long long)seg[1]);
        sum += seg[1];
        if (sum > h->count) break;
    }
    if (sum != h->count) return dtr__errf(why, whylen, DTR_CORRUPT_FILE, "segments do not sum to %lld values", (long long)h->count);
    return DTR_OK;
}

static dtr_result dtr__ps_parse_push(const dtr__ps_hdr *h, const dtr__ps_expect *e, char *why, size_t whylen) {
    if (h->dtype != DTR_F32 && h->dtype != DTR_BF16)
        return dtr__errf(why, whylen, DTR_CORRUPT_FILE, "push of dtype %d", (int)h->dtype);
    if (h->begin != e->begin || h->count != e->count)
        return dtr__errf(why, whylen, DTR_CORRUPT_FILE, "push of [%lld, +%lld), this server holds [%lld, +%lld)",
                         (long long)h->begin, (long long)h->count, (long long)e->begin, (long long)e->count);
    return DTR_OK;
}

dtr_result dtr__ps_parse(const void *buf, size_t cap, int from, const dtr__ps_expect *e, dtr__ps_hdr *h, char *why,
                         size_t whylen) {
    size_t n;
    uint64_t tr;
    dtr_result r;
    if (!buf || cap < sizeof *h) return dtr__errf(why, whylen, DTR_CORRUPT_FILE, "%zu bytes: shorter than a header", cap);
    memcpy(h, buf, sizeof *h);
    if (h->magic != DTR__PS_MAGIC) return dtr__errf(why, whylen, DTR_CORRUPT_FILE, "bad magic %08x", (unsigned)h->magic);
    if (h->version != DTR__PS_VERSION) return dtr__errf(why, whylen, DTR_CORRUPT_FILE, "version %u", (unsigned)h->version);
    if (h->worker != from) return dtr__errf(why, whylen, DTR_CORRUPT_FILE, "claims to be worker %d", (int)h->worker);
    if (h->clock < 0) return dtr__errf(why, whylen, DTR_CORRUPT_FILE, "negative clock %lld", (long long)h->clock);
    if (h->kind == DTR__PS_REPLY || h->kind < DTR__PS_PUSH || h->kind > DTR__PS_PULL_ROWS)
        return dtr__errf(why, whylen, DTR_CORRUPT_FILE, "unknown kind %u", (unsigned)h->kind);
    if (h->kind == DTR__PS_PUSH && (r = dtr__ps_parse_push(h, e, why, whylen)) != DTR_OK) return r;
    if (h->kind == DTR__PS_PUSH_ROWS && h->dtype != DTR_F32 && h->dtype != DTR_BF16)
        return dtr__errf(why, whylen, DTR_CORRUPT_FILE, "push of dtype %d", (int)h->dtype);
    if ((n = dtr__ps_message_bytes(h)) == 0 || n > cap)
        return dtr__errf(why, whylen, DTR_CORRUPT_FILE, "%lld values of dtype %d do not fit %zu bytes", (long long)h->count,
                         (int)h->dtype, cap);
    memcpy(&tr, (const uint8_t *)buf + n - 8, 8);
    if (tr != dtr__ps_trailer(h)) return dtr__errf(why, whylen, DTR_CORRUPT_FILE, "truncated (no trailer after %zu bytes)", n - 8);
    if (h->kind == DTR__PS_PUSH_ROWS || h->kind == DTR__PS_PULL_ROWS)
        return dtr__ps_parse_segments((const uint8_t *)buf, h, e, why, whylen);
    return DTR_OK;
}

/* writes the trailer after the header and payload at buf; returns the message's bytes */
static size_t dtr__ps_seal(uint8_t *buf, const dtr__ps_hdr *h) {
    size_t n = dtr__ps_message_bytes(h);
    uint64_t tr = dtr__ps_trailer(h);
    memcpy(buf, h, sizeof *h);
    memcpy(buf + n - 8, &tr, 8);
    return n;
}

static dtr__ps_hdr dtr__ps_header(int kind, int who, int64_t clock, int64_t begin, int64_t count, int dtype) {
    dtr__ps_hdr h;
    memset(&h, 0, sizeof h);
    h.magic = DTR__PS_MAGIC;
    h.version = DTR__PS_VERSION;
    h.kind = (uint16_t)kind;
    h.worker = who;
    h.dtype = dtype;
    h.clock = clock;
    h.begin = begin;
    h.count = count;
    return h;
}

/* ---- creation ---- */

/* server s's range starts at s / S of the buffer, rounded down to 16 floats */
static void dtr__ps_layout(dtr_ps *ps) {
    int64_t total = dtr_model_numel(ps->m);
    int s;
    for (s = 0; s <= ps->S; s++) ps->range[s] = s == ps->S ? total : total * s / ps->S / 16 * 16;
    for (s = 0; s < ps->S; s++)
        if (ps->range[s + 1] - ps->range[s] > ps->maxlen) ps->maxlen = ps->range[s + 1] - ps->range[s];
}

static dtr_result dtr__ps_check(dtr_context *ctx, const dtr_ps_config *cfg, int S, int size) {
    if (S < 1 || S >= size || S > 64)
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_ps_create: %d servers in a group of %d (1 to size - 1, at most 64)",
                         S, size);
    if ((unsigned)cfg->mode > DTR_PS_SSP || cfg->staleness < 0 || (unsigned)cfg->policy > DTR_PS_CONTINUE)
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_ps_create: mode %d, staleness %d or policy %d out of range",
                         (int)cfg->mode, cfg->staleness, (int)cfg->policy);
    if (cfg->push_dtype != DTR_F32 && cfg->push_dtype != DTR_BF16)
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_ps_create: push_dtype must be f32 or bf16");
    if (cfg->opt.kind == DTR_OPT_LAMB || cfg->opt.clip_norm > 0 || cfg->opt.shard_sum)
        return dtr__fail(ctx, DTR_UNSUPPORTED, "dtr_ps_create: LAMB and clip_norm need the whole gradient, not a server's range");
    return DTR_OK;
}

static dtr_result dtr__ps_alloc_server(dtr_ps *ps) {
    dtr_allocation_callbacks *a = &ps->ctx->alloc;
    int64_t len = ps->range[ps->index + 1] - ps->range[ps->index];
    size_t cap = dtr__ps_hdr_bytes + (size_t)len * sizeof(float) + 8;
    int w;
    ps->peer = (dtr__ps_peer *)dtr__calloc(a, (size_t)ps->W * sizeof(dtr__ps_peer));
    ps->slots = ps->cfg.mode == DTR_PS_SYNC ? (float *)dtr__calloc(a, (size_t)(ps->W * len + 1) * sizeof(float))
                                            : (float *)dtr__calloc(a, (size_t)(len + 1) * sizeof(float));
    ps->scratch = (float *)dtr__calloc(a, (size_t)(len + 1) * sizeof(float));
    if (!ps->peer || !ps->slots || !ps->scratch) return DTR_OUT_OF_MEMORY;
    for (w = 0; w < ps->W; w++) {
        ps->peer[w].in = (uint8_t *)dtr__calloc(a, cap);
        ps->peer[w].out = (uint8_t *)dtr__calloc(a, cap);
        if (!ps->peer[w].in || !ps->peer[w].out) return DTR_OUT_OF_MEMORY;
    }
    if (len > 0) {
        dtr_optimizer_config oc = ps->cfg.opt;
        oc.shard_begin = ps->range[ps->index];
        oc.shard_end = ps->range[ps->index + 1];
        return dtr_optimizer_create(ps->m, &oc, &ps->opt);
    }
    return DTR_OK;
}

static dtr_result dtr__ps_alloc_worker(dtr_ps *ps) {
    dtr_allocation_callbacks *a = &ps->ctx->alloc;
    size_t cap = dtr__ps_hdr_bytes + (size_t)ps->maxlen * sizeof(float) + 8;
    int s;
    ps->msg = (uint8_t **)dtr__calloc(a, (size_t)ps->S * sizeof(uint8_t *));
    ps->rep = (uint8_t **)dtr__calloc(a, (size_t)ps->S * sizeof(uint8_t *));
    ps->sclock = (int64_t *)dtr__calloc(a, (size_t)ps->S * sizeof(int64_t));
    if (!ps->msg || !ps->rep || !ps->sclock) return DTR_OUT_OF_MEMORY;
    for (s = 0; s < ps->S; s++) {
        ps->msg[s] = (uint8_t *)dtr__calloc(a, cap);
        ps->rep[s] = (uint8_t *)dtr__calloc(a, cap);
        if (!ps->msg[s] || !ps->rep[s]) return DTR_OUT_OF_MEMORY;
    }
    return DTR_OK;
}

dtr_result dtr_ps_create(dtr_model *m, dtr_comm *c, const dtr_ps_config *cfg, dtr_ps **out) {
    dtr_ps_config def = dtr_ps_config_init();
    dtr_context *ctx;
    dtr_ps *ps;
    dtr_result r;
    int me;
    if (out) *out = NULL;
    if (!m || !c || !out) return DTR_NULL_HANDLE;
    ctx = dtr_model_context(m);
    if (!cfg) cfg = &def;
    def = *cfg;
    if (def.servers <= 0) def.servers = dtr_ps_servers_from_env(1);
    if (def.worker_deadline_ms <= 0) def.worker_deadline_ms = 60000;
    if ((r = dtr__ps_check(ctx, &def, def.servers, dtr_comm_size(c))) != DTR_OK) return r;
    ps = (dtr_ps *)dtr__calloc(&ctx->alloc, sizeof *ps);
    if (!ps) return dtr__fail(ctx, DTR_OUT_OF_MEMORY, "dtr_ps_create: out of memory");
    ps->m = m, ps->ctx = ctx, ps->cfg = def, ps->S = def.servers, ps->W = dtr_comm_size(c) - def.servers;
    me = dtr_comm_rank(c);
    ps->server = me < ps->S;
    ps->index = ps->server ? me : me - ps->S;
    ps->range = (int64_t *)dtr__calloc(&ctx->alloc, (size_t)(ps->S + 1) * sizeof(int64_t));
    r = ps->range ? DTR_OK : DTR_OUT_OF_MEMORY;
    if (r == DTR_OK) dtr__ps_layout(ps);
    if (r == DTR_OK) r = ps->server ? dtr__ps_alloc_server(ps) : dtr__ps_alloc_worker(ps);
    if (r == DTR_OK) r = dtr_comm_split(c, 0, me, &ps->g);
    if (r == DTR_OK && ps->server) r = dtr_comm_set_timeout(ps->g, DTR__PS_LISTEN_MS);
    if (r != DTR_OK) {
        dtr_ps_destroy(ps);
        return r == DTR_OUT_OF_MEMORY ? dtr__fail(ctx, r, "dtr_ps_create: out of memory") : r;
    }
    *out = ps;
    return DTR_OK;
}

static void dtr__ps_free_bufs(dtr_ps *ps, uint8_t **b, int n) {
    int i;
    if (!b) return;
    for (i = 0; i < n; i++) dtr__free(&ps->ctx->alloc, b[i]);
    dtr__free(&ps->ctx->alloc, b);
}

/* cancels what a server still has in flight: its listening receives would wait a day, so a
   server leaving with some aborts the group first */
static void dtr__ps_cancel(dtr_ps *ps) {
    int w, pending = 0;
    for (w = 0; w < ps->W; w++) pending += ps->peer[w].rreq != NULL || ps->peer[w].sreq != NULL;
    if (pending && ps->g) dtr_comm_abort(ps->g, "parameter server leaving");
    for (w = 0; w < ps->W; w++) {
        dtr_request_destroy(ps->peer[w].rreq);
        dtr_request_destroy(ps->peer[w].sreq);
        ps->peer[w].rreq = ps->peer[w].sreq = NULL;
        dtr__free(&ps->ctx->alloc, ps->peer[w].in);
        dtr__free(&ps->ctx->alloc, ps->peer[w].out);
    }
}

void dtr_ps_destroy(dtr_ps *ps) {
    dtr_allocation_callbacks a;
    if (!ps) return;
    a = ps->ctx->alloc;
    if (ps->peer) dtr__ps_cancel(ps);
    dtr__free(&a, ps->peer);
    dtr__free(&a, ps->slots);
    dtr__free(&a, ps->scratch);
    dtr_optimizer_destroy(ps->opt);
    dtr__ps_free_bufs(ps, ps->msg, ps->S);
    dtr__ps_free_bufs(ps, ps->rep, ps->S);
    dtr__free(&a, ps->sclock);
    dtr__free(&a, ps->range);
    dtr_comm_destroy(ps->g);
    dtr__free(&a, ps);
}

dtr_comm *dtr__ps_group(dtr_ps *ps) { return ps ? ps->g : NULL; }

int dtr_ps_is_server(const dtr_ps *ps) { return ps ? ps->server : 0; }
int dtr_ps_index(const dtr_ps *ps) { return ps ? ps->index : -1; }
int dtr_ps_workers(const dtr_ps *ps) { return ps ? ps->W : 0; }

dtr_result dtr_ps_range(const dtr_ps *ps, int s, int64_t *begin, int64_t *end) {
    if (!ps || !begin || !end) return DTR_NULL_HANDLE;
    if (s < 0 || s >= ps->S) return DTR_INVALID_ARGUMENT;
    *begin = ps->range[s];
    *end = ps->range[s + 1];
    return DTR_OK;
}

dtr_result dtr_ps_get_stats(const dtr_ps *ps, dtr_ps_stats *out) {
    if (!ps || !out) return DTR_NULL_HANDLE;
    *out = ps->st;
    return DTR_OK;
}

/* ---- server ---- */

static int64_t dtr__ps_len(const dtr_ps *ps) { return ps->range[ps->index + 1] - ps->range[ps->index]; }

/* a server's receive and reply buffers: the largest message it takes or sends */
static size_t dtr__ps_cap(const dtr_ps *ps) { return dtr__ps_hdr_bytes + (size_t)dtr__ps_len(ps) * sizeof(float) + 8; }

static dtr_result dtr__ps_listen(dtr_ps *ps, int w) {
    return dtr_comm_recv_async(ps->g, ps->peer[w].in, dtr__ps_cap(ps), ps->S + w, DTR__PS_TAG_REQ, &ps->peer[w].rreq);
}

/* the smallest clock of the live workers (INT64_MAX when none is live) */
static int64_t dtr__ps_min_clock(const dtr_ps *ps) {
    int64_t lo = INT64_MAX;
    int w;
    for (w = 0; w < ps->W; w++)
        if (ps->peer[w].state == DTR__PS_LIVE && ps->peer[w].clock < lo) lo = ps->peer[w].clock;
    return lo;
}

static void dtr__ps_count_staleness(dtr_ps *ps, int64_t st) {
    if (st < 0) st = 0;
    ps->st.staleness[st < DTR_PS_STALENESS_BINS - 1 ? st : DTR_PS_STALENESS_BINS - 1]++;
    if (st > ps->st.max_staleness) ps->st.max_staleness = st;
}

/* one optimizer update of this server's range with the gradient g */
static dtr_result dtr__ps_apply(dtr_ps *ps, const float *g) {
    int64_t b = ps->range[ps->index], len = dtr__ps_len(ps);
    dtr_result r = DTR_OK;
    if (len > 0) {
        memcpy(dtr_model_grads(ps->m) + b, g, (size_t)len * sizeof(float));
        r = dtr_optimizer_step_range(ps->opt, b, b + len, NULL);
    }
    ps->clock++;
    ps->st.updates++;
    return r;
}

/* SYNC: once every live worker pushed this round: their average, summed in worker order */
static dtr_result dtr__ps_round(dtr_ps *ps) {
    int64_t len = dtr__ps_len(ps), i;
    int w, n = 0, live = 0;
    float *sum = ps->slots;   /* slot 0 doubles as the sum: worker 0's push is added first */
    for (w = 0; w < ps->W; w++) {
        if (ps->peer[w].state != DTR__PS_LIVE) continue;
        live++;
        if (!ps->peer[w].pushed) return DTR_OK;
    }
    for (w = 0; w < ps->W && live; w++) {
        const float *s = ps->slots + w * len;
        if (!ps->peer[w].pushed) continue;
        if (n == 0 && w > 0) memcpy(sum, s, (size_t)len * sizeof(float));
        else if (n > 0) for (i = 0; i < len; i++) sum[i] += s[i];
        n++;
    }
    if (n == 0) return DTR_OK;
    for (i = 0; i < len; i++) sum[i] /= (float)n;
    for (w = 0; w < ps->W; w++) ps->peer[w].pushed = 0;
    ps->st.pushes_applied += n;
    return dtr__ps_apply(ps, sum);
}

static dtr_result dtr__ps_on_push(dtr_ps *ps, int w, const dtr__ps_hdr *h) {
    dtr__ps_peer *p = &ps->peer[w];
    int64_t len = dtr__ps_len(ps);
    const uint8_t *payload = p->in + dtr__ps_hdr_bytes;
    if (ps->cfg.mode == DTR_PS_SYNC) {
        if (h->clock != ps->clock || p->pushed) {
            ps->st.stale_discarded++;
            dtr__ps_log(ps, DTR_LOG_WARN, "parameter server %d: push of worker %d for step %lld discarded (round %lld)",
                        ps->index, w, (long long)h->clock, (long long)ps->clock);
            return DTR_OK;
        }
        dtr_convert(ps->slots + w * len, DTR_F32, payload, (dtr_dtype)h->dtype, (size_t)len);
        p->pushed = 1;
        p->clock = h->clock + 1;
        dtr__ps_count_staleness(ps, 0);
        return dtr__ps_round(ps);
    }
    dtr__ps_count_staleness(ps, h->clock - dtr__ps_min_clock(ps));
    if (h->clock + 1 > p->clock) p->clock = h->clock + 1;
    dtr_convert(ps->slots, DTR_F32, payload, (dtr_dtype)h->dtype, (size_t)len);
    ps->st.pushes_applied++;
    return dtr__ps_apply(ps, ps->slots);
}

/* a dropped worker that speaks again */
static void dtr__ps_rejoin(dtr_ps *ps, int w, const dtr__ps_hdr *h) {
    dtr__ps_peer *p = &ps->peer[w];
    int64_t lo = dtr__ps_min_clock(ps);
    p->state = DTR__PS_LIVE;
    p->pushed = 0;
    p->clock = ps->cfg.mode == DTR_PS_SYNC ? ps->clock : (lo == INT64_MAX || h->clock > lo ? h->clock : lo);
    ps->st.rejoined++;
    dtr__ps_log(ps, DTR_LOG_WARN, "parameter server %d: worker %d rejoined", ps->index, w);
}

static void dtr__ps_refuse(dtr_ps *ps, int w, const char *why) {
    ps->st.refused++;
    dtr__ps_log(ps, DTR_LOG_WARN, "parameter server %d: message from worker %d (rank %d) refused: %s", ps->index, w,
                ps->S + w, why);
}

/* segment i of the ROWS message in buf: [seg[0], seg[0] + seg[1]) */
static void dtr__ps_segment(const uint8_t *buf, int64_t i, int64_t *seg) {
    memcpy(seg, buf + dtr__ps_hdr_bytes + (size_t)i * 16, 16);
}

/* PUSH_ROWS, applied on arrival in every mode: plain SGD on the rows at the optimizer's
   learning rate (no moments for rows) */
static dtr_result dtr__ps_on_push_rows(dtr_ps *ps, int w, const dtr__ps_hdr *h) {
    const uint8_t *in = ps->peer[w].in, *val = in + dtr__ps_hdr_bytes + (size_t)h->begin * 16;
    size_t es = dtr_dtype_size((dtr_dtype)h->dtype);
    float lr = ps->opt ? dtr_optimizer_lr(ps->opt) : 0.0f, *p = dtr_model_params(ps->m);
    int64_t i, k, at = 0, seg[2];
    for (i = 0; i < h->begin; i++) {
        dtr__ps_segment(in, i, seg);
        dtr_convert(ps->scratch, DTR_F32, val + (size_t)at * es, (dtr_dtype)h->dtype, (size_t)seg[1]);
        for (k = 0; k < seg[1]; k++) p[seg[0] + k] -= lr * ps->scratch[k];
        at += seg[1];
    }
    ps->st.row_pushes++;
    return DTR_OK;
}

/* PULL_ROWS, answered at once with the rows' current values */
static dtr_result dtr__ps_on_pull_rows(dtr_ps *ps, int w, const dtr__ps_hdr *h) {
    dtr__ps_peer *p = &ps->peer[w];
    const float *params = dtr_model_params(ps->m);
    int64_t i, at = 0, seg[2];
    dtr__ps_hdr rh;
    size_t n;
    if (p->sreq) {   /* the previous reply: the worker received it before it asked again */
        dtr_result r = dtr_request_wait(p->sreq);
        dtr_request_destroy(p->sreq);
        p->sreq = NULL;
        if (r != DTR_OK) return r;
    }
    for (i = 0; i < h->begin; i++) {
        dtr__ps_segment(p->in, i, seg);
        memcpy(p->out + dtr__ps_hdr_bytes + (size_t)at * sizeof(float), params + seg[0], (size_t)seg[1] * sizeof(float));
        at += seg[1];
    }
    rh = dtr__ps_header(DTR__PS_REPLY, ps->index, ps->clock, h->begin, h->count, DTR_F32);
    n = dtr__ps_seal(p->out, &rh);
    ps->st.row_pulls++;
    ps->st.bytes_sent += n;
    return dtr_comm_send_async(ps->g, p->out, n, ps->S + w, DTR__PS_TAG_REP, &p->sreq);
}

/* a request arrived from worker w: validated, then its header and trailer wiped from the buffer */
static dtr_result dtr__ps_on_request(dtr_ps *ps, int w) {
    dtr__ps_peer *p = &ps->peer[w];
    dtr__ps_expect e;
    dtr__ps_hdr h;
    char why[200];
    size_t n;
    e.server = ps->index, e.workers = ps->W, e.begin = ps->range[ps->index], e.count = dtr__ps_len(ps);
    if (dtr__ps_parse(p->in, dtr__ps_cap(ps), w, &e, &h, why, sizeof why) != DTR_OK) {
        dtr__ps_refuse(ps, w, why);
        memset(p->in, 0, sizeof h);
        return DTR_OK;
    }
    n = dtr__ps_message_bytes(&h);
    memset(p->in, 0, sizeof h);
    memset(p->in + n - 8, 0, 8);
    ps->st.bytes_received += n;
    p->last_ns = ps->last_any_ns = dtr_time_ns();
    if (p->state == DTR__PS_DROPPED && h.kind != DTR__PS_DONE) dtr__ps_rejoin(ps, w, &h);
    if (h.kind == DTR__PS_DONE) p->state = DTR__PS_FINISHED, p->pushed = 0, p->waiting = 0;
    else if (h.kind == DTR__PS_PULL) p->waiting = 1, p->want = h.clock;
    else if (h.kind == DTR__PS_PUSH_ROWS) return dtr__ps_on_push_rows(ps, w, &h);
    else if (h.kind == DTR__PS_PULL_ROWS) return dtr__ps_on_pull_rows(ps, w, &h);
    else return dtr__ps_on_push(ps, w, &h);
    return ps->cfg.mode == DTR_PS_SYNC ? dtr__ps_round(ps) : DTR_OK;
}

/* can worker w's waiting pull be answered now? */
static int dtr__ps_ready(const dtr_ps *ps, int w) {
    const dtr__ps_peer *p = &ps->peer[w];
    if (!p->waiting) return 0;
    if (ps->cfg.mode == DTR_PS_SYNC) return ps->clock >= p->want;
    if (ps->cfg.mode == DTR_PS_SSP) return dtr__ps_min_clock(ps) >= p->want - ps->cfg.staleness;
    return 1;
}

/* answers the pulls that may be answered (one reply in flight per worker) */
static dtr_result dtr__ps_answer(dtr_ps *ps, int *progressed) {
    int64_t b = ps->range[ps->index], len = dtr__ps_len(ps);
    int w;
    for (w = 0; w < ps->W; w++) {
        dtr__ps_peer *p = &ps->peer[w];
        dtr__ps_hdr h;
        size_t n;
        dtr_result r;
        if (p->sreq || p->state != DTR__PS_LIVE || !dtr__ps_ready(ps, w)) continue;
        h = dtr__ps_header(DTR__PS_REPLY, ps->index, ps->clock, b, len, DTR_F32);
        memcpy(p->out + dtr__ps_hdr_bytes, dtr_model_params(ps->m) + b, (size_t)len * sizeof(float));
        n = dtr__ps_seal(p->out, &h);
        if ((r = dtr_comm_send_async(ps->g, p->out, n, ps->S + w, DTR__PS_TAG_REP, &p->sreq)) != DTR_OK) return r;
        p->waiting = 0;
        ps->st.pulls_answered++;
        ps->st.bytes_sent += n;
        *progressed = 1;
    }
    return DTR_OK;
}

/* is live worker w holding up another worker or the end of serving? */
static int dtr__ps_blocking(const dtr_ps *ps, int w) {
    int v, others = 0;
    for (v = 0; v < ps->W; v++) {
        const dtr__ps_peer *q = &ps->peer[v];
        if (v == w || q->state != DTR__PS_LIVE) continue;
        others++;
        if (!q->waiting || dtr__ps_ready(ps, v)) continue;
        if (ps->cfg.mode == DTR_PS_SYNC && !ps->peer[w].pushed) return 1;
        if (ps->cfg.mode == DTR_PS_SSP && ps->peer[w].clock < q->want - ps->cfg.staleness) return 1;
    }
    return others == 0;
}

/* drops (or fails the job for) the live workers that are waited on and silent too long */
static dtr_result dtr__ps_deadlines(dtr_ps *ps) {
    int64_t now = dtr_time_ns(), limit = (int64_t)ps->cfg.worker_deadline_ms * 1000000;
    int w;
    for (w = 0; w < ps->W; w++) {
        dtr__ps_peer *p = &ps->peer[w];
        if (p->state != DTR__PS_LIVE || now - p->last_ns < limit || !dtr__ps_blocking(ps, w)) continue;
        if (ps->cfg.policy == DTR_PS_FAIL) {
            dtr_result r = dtr__fail(ps->ctx, DTR_TIMEOUT, "parameter server %d: worker %d (rank %d) silent for %d ms",
                                     ps->index, w, ps->S + w, ps->cfg.worker_deadline_ms);
            dtr_comm_abort(ps->g, dtr_context_last_error(ps->ctx));
            return r;
        }
        p->state = DTR__PS_DROPPED;
        p->pushed = 0;
        ps->st.dropped++;
        dtr__ps_log(ps, DTR_LOG_WARN, "parameter server %d: worker %d (rank %d) silent for %d ms: dropped", ps->index, w,
                    ps->S + w, ps->cfg.worker_deadline_ms);
        if (ps->cfg.mode == DTR_PS_SYNC) {
            dtr_result r = dtr__ps_round(ps);
            if (r != DTR_OK) return r;
        }
    }
    return DTR_OK;
}

/* polls worker w's reply and receive; handles a request that arrived */
static dtr_result dtr__ps_poll(dtr_ps *ps, int w, int *progressed) {
    dtr__ps_peer *p = &ps->peer[w];
    int done = 0;
    dtr_result r;
    if (p->sreq) {
        r = dtr_request_test(p->sreq, &done);
        if (done) dtr_request_destroy(p->sreq), p->sreq = NULL, *progressed = 1;
        if (r != DTR_OK) return r;
    }
    if (!p->rreq) return DTR_OK;
    r = dtr_request_test(p->rreq, &done);
    if (!done) return r;
    dtr_request_destroy(p->rreq);
    p->rreq = NULL;
    *progressed = 1;
    if (r == DTR_INVALID_ARGUMENT) dtr__ps_refuse(ps, w, "longer than any message this server takes");
    else if (r != DTR_OK) return r;
    else if ((r = dtr__ps_on_request(ps, w)) != DTR_OK) return r;
    return p->state == DTR__PS_FINISHED ? DTR_OK : dtr__ps_listen(ps, w);
}

static int dtr__ps_all_gone(const dtr_ps *ps) {
    int w;
    for (w = 0; w < ps->W; w++)
        if (ps->peer[w].state == DTR__PS_LIVE || ps->peer[w].sreq) return 0;
    return 1;
}

static void dtr__ps_nap(int *idle) {
    struct timespec ts;
    long us = *idle < 4 ? 0 : *idle < 50 ? 20 : 200;
    (*idle)++;
    if (us == 0) return;
    ts.tv_sec = 0;
    ts.tv_nsec = us * 1000;
    nanosleep(&ts, NULL);
}

dtr_result dtr_ps_serve(dtr_ps *ps) {
    dtr_result r = DTR_OK;
    int w, idle = 0;
    if (!ps) return DTR_NULL_HANDLE;
    if (!ps->server) return dtr__fail(ps->ctx, DTR_BAD_STATE, "dtr_ps_serve: rank is a worker");
    ps->last_any_ns = dtr_time_ns();
    for (w = 0; w < ps->W && r == DTR_OK; w++) {
        ps->peer[w].last_ns = ps->last_any_ns;
        if (ps->peer[w].state != DTR__PS_FINISHED && !ps->peer[w].rreq) r = dtr__ps_listen(ps, w);
    }
    while (r == DTR_OK && !dtr__ps_all_gone(ps)) {
        int progressed = 0;
        for (w = 0; w < ps->W && r == DTR_OK; w++) r = dtr__ps_poll(ps, w, &progressed);
        if (r == DTR_OK) r = dtr__ps_answer(ps, &progressed);
        if (r == DTR_OK) r = dtr__ps_deadlines(ps);
        if (progressed) idle = 0;
        else dtr__ps_nap(&idle);
    }
    if (r != DTR_OK && dtr_context_status(ps->ctx) == DTR_OK)
        dtr__fail(ps->ctx, r, "dtr_ps_serve: %s", dtr_comm_last_error(ps->g));
    return r;
}

/* ---- worker ---- */

static dtr_result dtr__ps_waitall(dtr_request **q, int n) {
    dtr_result first = DTR_OK;
    int i;
    for (i = 0; i < n; i++) {
        dtr_result r = q[i] ? dtr_request_wait(q[i]) : DTR_OK;
        if (r != DTR_OK && first == DTR_OK) first = r;
        dtr_request_destroy(q[i]);
        q[i] = NULL;
    }
    return first;
}

static dtr_result dtr__ps_worker_fail(dtr_ps *ps, const char *what, dtr_result r) {
    if (dtr_context_status(ps->ctx) != DTR_OK) return r;
    return dtr__fail(ps->ctx, r, "%s: %s", what, dtr_comm_last_error(ps->g));
}

/* sends a request of kind `kind` with `clock` (and the gradient of server s's range for a
   push) to every server */
static dtr_result dtr__ps_send_all(dtr_ps *ps, int kind, const int64_t *clock) {
    dtr_request *q[64];
    dtr_result r = DTR_OK;
    int s, n = 0;
    for (s = 0; s < ps->S && r == DTR_OK; s++) {
        int64_t b = ps->range[s], len = kind == DTR__PS_PUSH ? ps->range[s + 1] - b : 0;
        dtr_dtype dt = kind == DTR__PS_PUSH ? ps->cfg.push_dtype : (dtr_dtype)0;
        dtr__ps_hdr h = dtr__ps_header(kind, ps->index, clock[s], b, len, (int)dt);
        size_t bytes;
        if (len) dtr_convert(ps->msg[s] + dtr__ps_hdr_bytes, dt, dtr_model_grads(ps->m) + b, DTR_F32, (size_t)len);
        bytes = dtr__ps_seal(ps->msg[s], &h);
        ps->st.bytes_sent += bytes;
        r = dtr_comm_send_async(ps->g, ps->msg[s], bytes, s, DTR__PS_TAG_REQ, &q[n]);
        if (r == DTR_OK) n++;
        if (n == 64 || s == ps->S - 1 || r != DTR_OK) {
            dtr_result w = dtr__ps_waitall(q, n);
            if (r == DTR_OK) r = w;
            n = 0;
        }
    }
    return r;
}

dtr_result dtr_ps_push(dtr_ps *ps) {
    int64_t clock[64];
    dtr_result r;
    int s;
    if (!ps) return DTR_NULL_HANDLE;
    if (ps->server) return dtr__fail(ps->ctx, DTR_BAD_STATE, "dtr_ps_push: rank is a server");
    for (s = 0; s < ps->S; s++) clock[s] = ps->cfg.mode == DTR_PS_SYNC ? ps->sclock[s] : ps->wclock;
    r = dtr__ps_send_all(ps, DTR__PS_PUSH, clock);
    if (r != DTR_OK) return dtr__ps_worker_fail(ps, "dtr_ps_push", r);
    ps->wclock++;
    ps->pushed = 1;
    ps->st.pushes++;
    return dtr_model_zero_grad(ps->m);
}

/* checks server s's reply: a REPLY of `count` f32 values with `begin`, whole */
static dtr_result dtr__ps_check_reply(dtr_ps *ps, int s, int64_t begin, int64_t count, dtr__ps_hdr *h) {
    uint64_t tr;
    size_t n;
    memcpy(h, ps->rep[s], sizeof *h);
    n = dtr__ps_message_bytes(h);
    if (h->magic != DTR__PS_MAGIC || h->kind != DTR__PS_REPLY || h->worker != s || h->begin != begin || h->count != count ||
        h->dtype != DTR_F32 || n == 0)
        return dtr__fail(ps->ctx, DTR_CORRUPT_FILE, "parameter server %d sent a malformed reply", s);
    memcpy(&tr, ps->rep[s] + n - 8, 8);
    if (tr != dtr__ps_trailer(h)) return dtr__fail(ps->ctx, DTR_CORRUPT_FILE, "parameter server %d: truncated reply", s);
    ps->st.bytes_received += n;
    return DTR_OK;
}

/* checks server s's reply to a pull and copies its range into the model */
static dtr_result dtr__ps_take_reply(dtr_ps *ps, int s) {
    int64_t b = ps->range[s], len = ps->range[s + 1] - b;
    dtr__ps_hdr h;
    dtr_result r = dtr__ps_check_reply(ps, s, b, len, &h);
    if (r != DTR_OK) return r;
    memcpy(dtr_model_params(ps->m) + b, ps->rep[s] + dtr__ps_hdr_bytes, (size_t)len * sizeof(float));
    ps->sclock[s] = h.clock;
    return DTR_OK;
}

dtr_result dtr_ps_pull(dtr_ps *ps) {
    dtr_request *q[64];
    int64_t want[64], t0;
    size_t cap;
    dtr_result r = DTR_OK, r2;
    int s, n = 0;
    if (!ps) return DTR_NULL_HANDLE;
    if (ps->server) return dtr__fail(ps->ctx, DTR_BAD_STATE, "dtr_ps_pull: rank is a server");
    cap = dtr__ps_hdr_bytes + (size_t)ps->maxlen * sizeof(float) + 8;
    t0 = dtr_time_ns();
    for (s = 0; s < ps->S; s++) want[s] = ps->cfg.mode == DTR_PS_SYNC ? ps->sclock[s] + ps->pushed : ps->wclock;
    for (s = 0; s < ps->S && r == DTR_OK; s++)
        if ((r = dtr_comm_recv_async(ps->g, ps->rep[s], cap, s, DTR__PS_TAG_REP, &q[n])) == DTR_OK) n++;
    if (r == DTR_OK) r = dtr__ps_send_all(ps, DTR__PS_PULL, want);
    if (r != DTR_OK) dtr_comm_abort(ps->g, "dtr_ps_pull failed");   /* the posted receives must end */
    if ((r2 = dtr__ps_waitall(q, n)) != DTR_OK && r == DTR_OK) r = r2;
    if (r != DTR_OK) return dtr__ps_worker_fail(ps, "dtr_ps_pull", r);
    for (s = 0; s < ps->S && r == DTR_OK; s++) r = dtr__ps_take_reply(ps, s);
    ps->pushed = 0;
    ps->st.pulls++;
    ps->st.wait_ns += dtr_time_ns() - t0;
    return r;
}

dtr_result dtr_ps_step(dtr_ps *ps) {
    dtr_result r = dtr_ps_push(ps);
    return r == DTR_OK ? dtr_ps_pull(ps) : r;
}

dtr_result dtr_ps_finish(dtr_ps *ps) {
    int64_t clock[64];
    dtr_result r;
    int s;
    if (!ps) return DTR_NULL_HANDLE;
    if (ps->server) return dtr__fail(ps->ctx, DTR_BAD_STATE, "dtr_ps_finish: rank is a server");
    for (s = 0; s < ps->S; s++) clock[s] = ps->wclock;
    r = dtr__ps_send_all(ps, DTR__PS_DONE, clock);
    return r == DTR_OK ? DTR_OK : dtr__ps_worker_fail(ps, "dtr_ps_finish", r);
}

/* ---- sparse rows ---- */

/* param's offset in the buffer and row width; rows in range and distinct */
static dtr_result dtr__ps_rows_check(dtr_ps *ps, const char *fn, const dtr_tensor *param, const int64_t *rows, int n,
                                     int64_t *off, int64_t *dim) {
    int i, np = dtr_model_param_count(ps->m), k = -1;
    int64_t nrows;
    uint8_t *seen;
    if (ps->server) return dtr__fail(ps->ctx, DTR_BAD_STATE, "%s: rank is a server", fn);
    for (i = 0; i < np && k < 0; i++)
        if (dtr_model_param_at(ps->m, i) == param) k = i;
    if (k < 0 || dtr_tensor_ndim(param) < 1 || n < 0 || (n > 0 && !rows))
        return dtr__fail(ps->ctx, DTR_INVALID_ARGUMENT, "%s: not a parameter of the model, or %d rows", fn, n);
    nrows = dtr_tensor_dim(param, 0);
    *off = dtr_model_param_offset(ps->m, k);
    *dim = nrows ? dtr_tensor_numel(param) / nrows : 0;
    seen = (uint8_t *)dtr__calloc(&ps->ctx->alloc, (size_t)nrows + 1);
    if (!seen) return dtr__fail(ps->ctx, DTR_OUT_OF_MEMORY, "%s: out of memory", fn);
    for (i = 0; i < n && rows[i] >= 0 && rows[i] < nrows && !seen[rows[i]]; i++) seen[rows[i]] = 1;
    dtr__free(&ps->ctx->alloc, seen);
    if (i < n) return dtr__fail(ps->ctx, DTR_INVALID_ARGUMENT, "%s: row %lld is outside [0, %lld) or repeated", fn,
                                (long long)rows[i], (long long)nrows);
    return DTR_OK;
}

/* writes server s's pieces of the rows as segments after msg[s]'s header; returns how many,
   *values their floats; DTR_INVALID_ARGUMENT when they would not fit one message */
static dtr_result dtr__ps_rows_segments(dtr_ps *ps, int s, int64_t off, int64_t dim, const int64_t *rows, int n,
                                        size_t es, int64_t *nseg, int64_t *values) {
    int64_t lo = ps->range[s], hi = ps->range[s + 1];
    int i;
    *nseg = *values = 0;
    for (i = 0; i < n; i++) {
        int64_t a = off + rows[i] * dim, b = a + dim, seg[2];
        a = a > lo ? a : lo;
        b = b < hi ? b : hi;
        if (a >= b) continue;
        seg[0] = a, seg[1] = b - a;
        *values += seg[1];
        if ((size_t)(*nseg + 1) * 16 + (size_t)*values * es > (size_t)(hi - lo) * sizeof(float))
            return dtr__fail(ps->ctx, DTR_INVALID_ARGUMENT, "%d rows do not fit one message to server %d: send fewer at once", n, s);
        memcpy(ps->msg[s] + dtr__ps_hdr_bytes + (size_t)*nseg * 16, seg, 16);
        (*nseg)++;
    }
    return DTR_OK;
}

dtr_result dtr_ps_push_rows(dtr_ps *ps, const dtr_tensor *param, const int64_t *rows, int n) {
    dtr_request *q[64];
    int64_t off, dim, nseg, values, i, at, seg[2];
    size_t es;
    dtr_result r, r2;
    int s, k = 0;
    if (!ps || !param) return DTR_NULL_HANDLE;
    if ((r = dtr__ps_rows_check(ps, "dtr_ps_push_rows", param, rows, n, &off, &dim)) != DTR_OK) return r;
    es = dtr_dtype_size(ps->cfg.push_dtype);
    for (s = 0; s < ps->S && r == DTR_OK; s++) {
        uint8_t *val;
        dtr__ps_hdr h;
        if ((r = dtr__ps_rows_segments(ps, s, off, dim, rows, n, es, &nseg, &values)) != DTR_OK || nseg == 0) continue;
        val = ps->msg[s] + dtr__ps_hdr_bytes + (size_t)nseg * 16;
        for (i = 0, at = 0; i < nseg; at += seg[1], i++) {
            dtr__ps_segment(ps->msg[s], i, seg);
            dtr_convert(val + (size_t)at * es, ps->cfg.push_dtype, dtr_model_grads(ps->m) + seg[0], DTR_F32, (size_t)seg[1]);
        }
        h = dtr__ps_header(DTR__PS_PUSH_ROWS, ps->index, ps->wclock, nseg, values, (int)ps->cfg.push_dtype);
        ps->st.bytes_sent += dtr__ps_message_bytes(&h);
        r = dtr_comm_send_async(ps->g, ps->msg[s], dtr__ps_seal(ps->msg[s], &h), s, DTR__PS_TAG_REQ, &q[k]);
        if (r == DTR_OK) k++;
    }
    if ((r2 = dtr__ps_waitall(q, k)) != DTR_OK && r == DTR_OK) r = r2;
    if (r != DTR_OK) return dtr__ps_worker_fail(ps, "dtr_ps_push_rows", r);
    for (i = 0; i < n; i++) memset(dtr_model_grads(ps->m) + off + rows[i] * dim, 0, (size_t)dim * sizeof(float));
    ps->st.row_pushes++;
    return DTR_OK;
}

/* scatters server s's reply to a PULL_ROWS of nseg segments (in msg[s]) into the parameters */
static dtr_result dtr__ps_take_rows(dtr_ps *ps, int s, int64_t nseg, int64_t values) {
    dtr__ps_hdr h;
    int64_t i, at = 0, seg[2];
    dtr_result r = dtr__ps_check_reply(ps, s, nseg, values, &h);
    for (i = 0; i < nseg && r == DTR_OK; i++) {
        dtr__ps_segment(ps->msg[s], i, seg);
        memcpy(dtr_model_params(ps->m) + seg[0], ps->rep[s] + dtr__ps_hdr_bytes + (size_t)at * sizeof(float),
               (size_t)seg[1] * sizeof(float));
        at += seg[1];
    }
    return r;
}

dtr_result dtr_ps_pull_rows(dtr_ps *ps, const dtr_tensor *param, const int64_t *rows, int n) {
    dtr_request *q[128];
    int64_t off, dim, nseg[64], values[64];
    size_t cap = dtr__ps_hdr_bytes + (size_t)(ps ? ps->maxlen : 0) * sizeof(float) + 8;
    dtr_result r, r2;
    int s, k = 0;
    if (!ps || !param) return DTR_NULL_HANDLE;
    if ((r = dtr__ps_rows_check(ps, "dtr_ps_pull_rows", param, rows, n, &off, &dim)) != DTR_OK) return r;
    for (s = 0; s < ps->S && r == DTR_OK; s++) {
        dtr__ps_hdr h;
        if ((r = dtr__ps_rows_segments(ps, s, off, dim, rows, n, 0, &nseg[s], &values[s])) != DTR_OK || nseg[s] == 0) continue;
        h = dtr__ps_header(DTR__PS_PULL_ROWS, ps->index, ps->wclock, nseg[s], values[s], 0);
        ps->st.bytes_sent += dtr__ps_message_bytes(&h);
        if ((r = dtr_comm_recv_async(ps->g, ps->rep[s], cap, s, DTR__PS_TAG_REP, &q[k])) != DTR_OK) break;
        k++;
        if ((r = dtr_comm_send_async(ps->g, ps->msg[s], dtr__ps_seal(ps->msg[s], &h), s, DTR__PS_TAG_REQ, &q[k])) == DTR_OK) k++;
    }
    if (r != DTR_OK && k > 0) dtr_comm_abort(ps->g, "dtr_ps_pull_rows failed");   /* the posted receives must end */
    if ((r2 = dtr__ps_waitall(q, k)) != DTR_OK && r == DTR_OK) r = r2;
    if (r != DTR_OK) return dtr__ps_worker_fail(ps, "dtr_ps_pull_rows", r);
    for (s = 0; s < ps->S && r == DTR_OK; s++)
        if (nseg[s] > 0) r = dtr__ps_take_rows(ps, s, nseg[s], values[s]);
    ps->st.row_pulls++;
    return r;
}
#line 21566 "dtrain.h"

/* ---- src/engine/grid.c ---- */
#line 1 "src/engine/grid.c"
/* ============================================================================
 * Hybrid grids: a world of D * P * T ranks laid out as data x pipeline x tensor groups.
 * World rank r has tensor rank t = r mod T (innermost: the T ranks of a tensor group are
 * neighbours, so they share a host when hosts hold whole tensor groups), data rank
 * d = (r / T) mod D and pipeline rank p = r / (T * D) (outermost, as Megatron-LM lays it
 * out). Each rank belongs to one group of each kind, made by dtr_comm_split.
 * ==========================================================================*/





static dtr_result dtr__grid_split(dtr_comm *world, int color, int key, dtr_comm **out, const char *what, char *err,
                                  size_t errlen) {
    dtr_result r = dtr_comm_split(world, color, key, out);
    if (r != DTR_OK && err && errlen)
        snprintf(err, errlen, "dtr_grid_create: splitting the %s groups: %s", what, dtr_comm_last_error(world));
    return r;
}

dtr_result dtr_grid_create(dtr_comm *world, int dp, int pp, int tp, dtr_grid *out, char *err, size_t errlen) {
    int n, r, t, d, p;
    dtr_result res;
    if (err && errlen) err[0] = 0;
    if (!world || !out) return DTR_NULL_HANDLE;
    memset(out, 0, sizeof(*out));
    n = dtr_comm_size(world), r = dtr_comm_rank(world);
    if (dp < 1 || pp < 1 || tp < 1 || (int64_t)dp * pp * tp != n) {
        if (err && errlen)
            snprintf(err, errlen, "dtr_grid_create: data %d x pipeline %d x tensor %d is not the %d ranks of the group",
                     dp, pp, tp, n);
        return DTR_INVALID_ARGUMENT;
    }
    t = r % tp, d = (r / tp) % dp, p = r / (tp * dp);
    out->dp_size = dp, out->pp_size = pp, out->tp_size = tp;
    out->dp_rank = d, out->pp_rank = p, out->tp_rank = t;
    res = dtr__grid_split(world, p * dp + d, t, &out->tp, "tensor", err, errlen);
    if (res == DTR_OK) res = dtr__grid_split(world, p * tp + t, d, &out->dp, "data", err, errlen);
    if (res == DTR_OK) res = dtr__grid_split(world, d * tp + t, p, &out->pp, "pipeline", err, errlen);
    if (res != DTR_OK) dtr_grid_destroy(out);
    return res;
}

void dtr_grid_destroy(dtr_grid *g) {
    if (!g) return;
    dtr_comm_destroy(g->pp);
    dtr_comm_destroy(g->dp);
    dtr_comm_destroy(g->tp);
    g->pp = g->dp = g->tp = NULL;
}
#line 21620 "dtrain.h"

#endif /* DTRAIN_IMPLEMENTATION_DONE */
#endif /* DTRAIN_IMPLEMENTATION */

/*
------------------------------------------------------------------------------
This software is available under the MIT License.
------------------------------------------------------------------------------
MIT License

Copyright (c) 2026 the dtrain authors

Permission is hereby granted, free of charge, to any person obtaining a copy
of this software and associated documentation files (the "Software"), to deal
in the Software without restriction, including without limitation the rights
to use, copy, modify, merge, publish, distribute, sublicense, and/or sell
copies of the Software, and to permit persons to whom the Software is
furnished to do so, subject to the following conditions:

The above copyright notice and this permission notice shall be included in all
copies or substantial portions of the Software.

THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR
IMPLIED, INCLUDING BUT NOT LIMITED TO THE WARRANTIES OF MERCHANTABILITY,
FITNESS FOR A PARTICULAR PURPOSE AND NONINFRINGEMENT. IN NO EVENT SHALL THE
AUTHORS OR COPYRIGHT HOLDERS BE LIABLE FOR ANY CLAIM, DAMAGES OR OTHER
LIABILITY, WHETHER IN AN ACTION OF CONTRACT, TORT OR OTHERWISE, ARISING FROM,
OUT OF OR IN CONNECTION WITH THE SOFTWARE OR THE USE OR OTHER DEALINGS IN THE
SOFTWARE.
------------------------------------------------------------------------------
*/
