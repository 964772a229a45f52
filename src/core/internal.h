/* ============================================================================
 * Internal types shared by the implementation, the CUDA backend (dtrain_cuda.cu) and the
 * transports (dtrain_comm.c). Visible with DTRAIN_IMPLEMENTATION or DTRAIN_INTERNAL_API.
 * Not a stable API: names start with dtr__ and may change between versions.
 * ==========================================================================*/
#include "platform.h"
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
/** Host floats [p, p + n) whose values are no longer needed: the whole pages inside go back to
 *  the system (Linux: madvise DONTNEED; they read as zeros until written), the rest is set to
 *  `fill` (NaN: a read of discarded values shows; 0: the range reads as zeros throughout).
 *  Memory from the application's allocation callbacks `a` (which may be a shared mapping that
 *  DONTNEED does not zero) is only filled. */
DTR__PRIVATE void dtr__mem_discard(const dtr_allocation_callbacks *a, float *p, int64_t n, float fill);
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
/** B (K, N) packed once for several products with it (an LSTM's recurrent weight at every
 *  step): the original operand (the fallbacks read it) and its panels, as dtr__gemm packs them. */
typedef struct dtr__gemm_bpack {
    const float *B;
    int64_t rsb, csb, K, N;
    float *packed;          /* dtr__gemm_bpack_floats(K, N) floats, or NULL: packed per call */
} dtr__gemm_bpack;
/** Floats of B's packed panels. */
size_t dtr__gemm_bpack_floats(int64_t K, int64_t N);
/** Packs B (K, N) (strides as dtr__gemm's) into mem (dtr__gemm_bpack_floats of them; NULL:
 *  nothing packed, each product packs its own) and describes it in *b. */
void dtr__gemm_bpack_fill(dtr__gemm_bpack *b, const float *B, int64_t rsb, int64_t csb, int64_t K, int64_t N, float *mem);
/** dtr__gemm with a B packed ahead: C (M, b->N) = alpha A (M, b->K) B + beta C, the same bits;
 *  over p's threads (worker < 0) or as dtr__gemm_on on worker `worker`. */
void dtr__gemm_packed(dtr__pool *p, int worker, int64_t M, float alpha, const float *A, int64_t rsa, int64_t csa,
                      const dtr__gemm_bpack *b, float beta, float *C, int64_t ldc);
/** dtr__gemm run entirely on the calling thread, which is worker `worker` of `p` (its packing
 *  buffers come from that worker's scratch). For callers that already split work
 *  over the pool. p NULL: private buffers of the calling thread. */
void dtr__gemm_on(dtr__pool *p, int worker, int64_t M, int64_t N, int64_t K, float alpha,
                  const float *A, int64_t rsa, int64_t csa,
                  const float *B, int64_t rsb, int64_t csb,
                  float beta, float *C, int64_t ldc);
/** A producer of B for dtr__gemm_on_gen: writes B (kb, nb) from row k0 and column j0 as
 *  nr-wide panels, as dtr__gemm packs them (panel p: dst[p*nr*kb + k*nr + j] = B(k0 + k,
 *  j0 + p*nr + j), the columns past nb zero): an operand made on the fly (a convolution's
 *  columns from its image) in place of one read from memory. kb <= DTR__GEMM_MAX_KC, nr <= 32. */
typedef void (*dtr__gemm_bgen)(void *user, int64_t k0, int64_t kb, int64_t j0, int64_t nb, int nr, float *dst);
#define DTR__GEMM_MAX_KC 256
/** dtr__gemm_on with B (K, N) from `gen`, block by block: the bits of dtr__gemm_on over the B
 *  it makes (never through cblas). */
void dtr__gemm_on_gen(dtr__pool *p, int worker, int64_t M, int64_t N, int64_t K, float alpha, const float *A, int64_t rsa,
                      int64_t csa, dtr__gemm_bgen gen, void *user, float beta, float *C, int64_t ldc);
/** Packs B (kb, nb) (strides as dtr__gemm's) into the running kernel's panels at dst, as
 *  dtr__gemm does: for a producer that makes a block of B first (a transposed operand). */
void dtr__gemm_pack_panels(const float *B, int64_t rsb, int64_t csb, int64_t kb, int64_t nb, float *dst);
/** Name of the GEMM kernel picked at run time ("avx512", "avx2", "neon", "generic", "cblas"). */
const char *dtr__gemm_kernel_name(void);
/** Forces the GEMM kernel by name (tests run each one the CPU has); NULL goes back to the
 *  run-time pick. Returns 1, or 0 (nothing changed) for a name this build or CPU lacks.
 *  Thread safety: not while products run. */
int dtr__gemm_force(const char *name);
/** The element loops' variant that runs: 2 AVX-512 (DTR__TARGET_AVX512, where the loop has
 *  one), 1 AVX2 (DTR__TARGET_AVX2), 0 the generic one: the best this CPU runs, capped by
 *  DTRAIN_SIMD ("generic": 0, "avx2": 1; read once). Thread safety: any thread. */
int dtr__simd_level(void);
/** 1 when dtr__simd_level is 1 or more: the AVX2 variants run (and the AVX-512 ones where
 *  they exist). Thread safety: any thread. */
DTR__PRIVATE int dtr__simd_avx2(void);
/** Forces the element loops' variant: 2 AVX-512, 1 AVX2 (each where the CPU has it, else the
 *  best below), 0 the generic one, -1 back to the default (tests compare them). Thread
 *  safety: not while ops run. */
void dtr__simd_force(int level);
/** A loop's variant for dtr__simd_level: the AVX-512 one, the AVX2 one or the generic one. */
#define DTR__SIMD_PICK(generic, avx2, avx512) (dtr__simd_level() >= 2 ? (avx512) : dtr__simd_level() ? (avx2) : (generic))

/* ---- arena ---- */

typedef struct dtr__chunk {
    struct dtr__chunk *next;
    size_t size, used;
    char *data;                /* 64-byte aligned: after this header (host), or the backend's memory */
} dtr__chunk;

typedef struct dtr__arena {
    dtr__chunk *head;          /* chunk being filled */
    dtr__chunk *full;          /* chunks filled during this step */
    size_t reserved, used, max_bytes, chunk_bytes;
    const dtr_allocation_callbacks *alloc;
    struct dtr_context *dev;   /* non-NULL: payloads from dev's backend chunk_alloc (device memory) */
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
    DTR__LEAF = 4u,
    DTR__GRAD_SPARE = 8u,      /* grad from the current tape's data arena: back to its spares once
                                  the producer's backward ran (dtr__grad_release) */
    DTR__RETAIN_GRAD = 16u,    /* dtr_tensor_retain_grad: never released */
    DTR__OWNS_DATA = 32u,      /* storage is a block of its tape's data arena made for it
                                  (dtr__tensor_alloc): released with release_activations */
    DTR__RELEASED = 64u,       /* its storage went back to the spares (release_activations) */
    DTR__RETAIN = 128u,        /* dtr_tensor_retain: its storage is never released */
    DTR__ABSENT = 256u         /* parameter whose values live on other ranks (ZeRO-3): gathered
                                  by ctx->param_fetch before an op reads it (dtr__fetch_params) */
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
    struct dtr_tensor *base;        /* views: the tensor that owns the storage (NULL: itself) */
};

/** The tensor that owns t's storage (t itself unless t is a view). */
static inline const dtr_tensor *dtr__owner(const dtr_tensor *t) { return t->base ? t->base : t; }
/** Batch norm's x (N, C, ...) viewed as (N, C, S): the CPU's and CUDA's kernels alike. */
static inline void dtr__bn_dims(const dtr_tensor *x, int64_t *N, int64_t *C, int64_t *S) {
    int d;
    *N = x->shape[0], *C = x->shape[1], *S = 1;
    for (d = 2; d < x->ndim; d++) *S *= x->shape[d];
}
/** x viewed as (outer, len, inner) around `axis` (reductions, max, gather): the CPU's and CUDA's
 *  kernels alike. */
static inline void dtr__axis_split(const dtr_tensor *x, int axis, int64_t *outer, int64_t *len, int64_t *inner) {
    int d;
    *outer = *inner = 1;
    for (d = 0; d < axis; d++) *outer *= x->shape[d];
    for (d = axis + 1; d < x->ndim; d++) *inner *= x->shape[d];
    *len = x->shape[axis];
}
/** 1 when t's storage went back to the arena's spares (release_activations). */
static inline int dtr__released(const dtr_tensor *t) { return (dtr__owner(t)->flags & DTR__RELEASED) != 0; }

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
    X(CHECKPOINT, "checkpoint", checkpoint) X(ATTENTION, "attention", attention)             \
    X(SILU, "silu", unary) X(RMSNORM, "rmsnorm", layernorm) X(ROPE, "rope", rope)           \
    X(EXP, "exp", unary) X(LOG, "log", unary) X(SQRT, "sqrt", unary) X(POW, "pow", unary)    \
    X(CLAMP, "clamp", unary) X(LEAKY_RELU, "leaky_relu", unary)                              \
    X(SOFTPLUS, "softplus", unary) X(MAXIMUM, "maximum", binary)                             \
    X(MINIMUM, "minimum", binary) X(BATCHNORM, "batchnorm", batchnorm)                      \
    X(LSTM_CELL, "lstm_cell", lstm) X(CONV_TRANSPOSE2D, "conv_transpose2d", conv_transpose)     \
    X(MAX, "max", argmax) X(ARGMAX, "argmax", argmax) X(GATHER, "gather", gather)                \
    X(UPSAMPLE, "upsample_nearest", upsample) X(LSTM, "lstm", rnn) X(GRU, "gru", rnn)

#define DTR__OP_ENUM(id, name, kernels) DTR_OP_##id,
/** Stable op ids (DTR_OP_NONE = 0 is no op). */
typedef enum dtr__op { DTR_OP_NONE = 0, DTR__OP_LIST(DTR__OP_ENUM) DTR_OP_COUNT } dtr__op;
#undef DTR__OP_ENUM
/** The count, stated: a change here is a change of the stored ids' range, made on purpose. */
#define DTR__OP_COUNT_EXPECTED 62
typedef char dtr__op_count_check[(DTR_OP_COUNT == DTR__OP_COUNT_EXPECTED) ? 1 : -1];

/* The CPU kernels of the list's entries (src/ops/), private to the implementation. */
#define DTR__CPU_DECLARE(id, name, k)                                       \
    DTR__PRIVATE dtr_result dtr__cpu_##k##_fwd(dtr_context *, struct dtr__node *); \
    DTR__PRIVATE dtr_result dtr__cpu_##k##_bwd(dtr_context *, struct dtr__node *);

/** "add", "conv2d", ...; "none" for 0 and "?" outside the list. */
const char *dtr__op_name(int op);

/* ---- typed op parameters: what an op means, recorded by its builder ---- */

typedef struct dtr__conv2d_params {   /* CONV2D, CONV_TRANSPOSE2D: per axis (height, width) */
    int64_t stride[2], padding[2], dilation[2];
    int64_t groups;                   /* C and O divide into groups; w (O, C / groups, KH, KW) */
} dtr__conv2d_params;
typedef struct dtr__pool2d_params { int64_t k[2], stride[2], padding[2]; } dtr__pool2d_params; /* MAX/AVGPOOL2D: (h, w) */
typedef struct dtr__upsample_params { int64_t scale[2]; } dtr__upsample_params;   /* UPSAMPLE: (h, w) */
/* Where an op's random draws come from: element i of its mask (row-major, rows of `width`
   elements) takes draw (i / width) cols + col0 + i % width of the stream that starts at `rng`
   (dtr__f_pcg_at): draw i when its rows are whole (width == cols, col0 0); with tensor
   parallelism, a rank's share of the mask one device draws (columns col0 .. of rows of cols). */
typedef struct dtr__draws {
    dtr_rng rng;
    int64_t width, cols, col0;
} dtr__draws;
typedef struct dtr__dropout_params {
    float p;                          /* drop probability, in (0, 1): element i is dropped when its draw
                                         is below p (dtr__f_dropout_mask) */
    dtr__draws draws;
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

typedef struct dtr__xent_params {     /* CROSS_ENTROPY */
    int32_t ignore_index;             /* rows with this target add nothing */
    float smoothing;                  /* label smoothing in [0, 1) */
    int reduction;                    /* dtr_loss_reduction */
} dtr__xent_params;

/* SCALE: a the factor; POW: a the exponent; CLAMP: [a, b]; LEAKY_RELU: a the slope below 0;
   SOFTPLUS: a = beta, b = threshold (the others: none) */
typedef struct dtr__unary_params { float a, b; } dtr__unary_params;

typedef struct dtr__batchnorm_params {
    float eps;                        /* added to the batch's variance */
    float momentum;                   /* running = (1 - momentum) running + momentum batch */
} dtr__batchnorm_params;

typedef struct dtr__rope_params {
    int heads;                        /* C = heads * D, D even */
    int interleaved;                  /* pairs (2j, 2j + 1); 0: (j, j + D/2) */
    float theta;                      /* the frequencies' base */
    int64_t start;                    /* the position of row t = 0 (t is at start + t) */
} dtr__rope_params;

typedef struct dtr__attention_params {
    int heads;                        /* C = heads * D */
    int kv_heads;                     /* k and v's heads (dividing heads): q head h reads kv head
                                         h / (heads / kv_heads) */
    int causal;                       /* 1: query t sees keys 0 .. q_start + t */
    float scale;                      /* the scores' factor (1 / sqrt(D) unless the app chose) */
    int64_t q_start;                  /* causal: the key position of query 0 (q_start + Tq <= Tk) */
    float dropout;                    /* the weights' dropout probability (0: none) */
    dtr__draws draws;                 /* dropout: its mask over (B, H, Tq, Tk), rows of H Tq Tk */
} dtr__attention_params;

/** Parameters of a node, by op (ops not listed have none). */
typedef union dtr__op_params {
    dtr__unary_params unary;          /* the unary ops' constants */
    float eps;                        /* LAYERNORM, RMSNORM: added to the variance (mean square) */
    int axis;                         /* SUM, MEAN, MAX, ARGMAX: the reduced axis; GATHER: the indexed one */
    dtr__attention_params attention;  /* ATTENTION */
    dtr__rope_params rope;            /* ROPE */
    dtr__batchnorm_params batchnorm;  /* BATCHNORM */
    dtr__checkpoint_params checkpoint;
    dtr__conv2d_params conv2d;
    dtr__xent_params xent;
    dtr__pool2d_params pool2d;
    dtr__upsample_params upsample;
    dtr__dropout_params dropout;
    dtr__view_params view;
    struct {
        dtr_comm *group;              /* TP_COPY, TP_REDUCE, TP_GATHER, VOCAB_CROSS_ENTROPY: the tensor-parallel
                                         group (the last's rank r holds vocabulary rows r * K ..) */
        dtr__xent_params xent;        /* VOCAB_CROSS_ENTROPY: the loss's settings, as CROSS_ENTROPY's */
    } comm;
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
    struct dtr__spare *saves;         /* release_activations: the blocks dtr__node_save gave it */
    int released;                     /* release_activations: its saved state went back */
    struct dtr__node *prev;           /* previous node on the tape */
    struct dtr_tape *tape;            /* the tape that recorded it */
} dtr__node;

/** The first input of n whose storage was released (release_activations), or -1. */
static inline int dtr__released_input(const dtr__node *n) {
    int i;
    for (i = 0; i < n->n_in; i++)
        if (n->in[i] && dtr__released(n->in[i])) return i;
    return -1;
}

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

/** The tensor-parallel communication ops (the `comm` family) on a backend without host
 *  memory: the CPU kernels run on host images of the tensors they touch, then what they
 *  wrote is copied back (src/ops/ops_comm.c). A device backend's dispatch table points its
 *  `comm` entry here. Over a group of the context's device memory TP_COPY, TP_REDUCE and
 *  TP_GATHER run on the device instead, and the cross-entropy too where the backend has
 *  vocab_xent; without it the cross-entropy needs a group that takes host buffers or stages
 *  them (else DTR_UNSUPPORTED, said). */
dtr_result dtr__comm_staged_fwd(dtr_context *ctx, struct dtr__node *nd);
dtr_result dtr__comm_staged_bwd(dtr_context *ctx, struct dtr__node *nd);
DTR__PRIVATE dtr_result dtr__cpu_optimizer_update(dtr_context *ctx, const dtr__opt_args *args);

/** The vocabulary-parallel cross-entropy's local work (dtr_backend.vocab_xent; the collectives
 *  between the phases: src/ops/ops_comm.c). Shapes: x (R, K) f32, this rank's classes
 *  [start, start + K) of V; t (R) int32; s: the rows' M, Z, T, R floats each; all of it in
 *  the backend's memory. s: the rows' M, Z, T, S, R floats each, then the loss's divisor D.
 *    DTR__VXENT_MAX   M[r] = max_k x[r, k]                 (then all-reduce MAX of M)
 *    DTR__VXENT_SUMS  Z[r] = sum_k exp(x[r, k] - M[r]) (summed in double), T[r] = x[r, t[r] -
 *                     start] where this rank holds t[r], else 0, S[r] = sum_k x[r, k] (label
 *                     smoothing's, else 0)   (then all-reduce SUM of Z, T, S)
 *    DTR__VXENT_LOSS  l_r = dtr__f_xent_loss(M, Z, T, S / V, eps) (0 for an ignored row); y[0] =
 *                     their sum (rows in order, double) / D, D the rows kept (mean) or 1 (sum);
 *                     y[r] = l_r (none, D = 1)
 *    DTR__VXENT_GRAD  c = g[0] / D (g[r] for none); gx[r, k] += c (exp(x[r, k] - M[r]) / Z[r] -
 *                     eps / V) - c (1 - eps) [k == t[r] - start]; ignored rows nothing
 *  A target outside [0, V), not ignored, is DTR_INVALID_ARGUMENT (the CPU at MAX; a device
 *  when it reports its kernels' data errors, at the next synchronisation). */
typedef struct dtr__vxent_args {
    int64_t R, K, V, start;
    const float *x;
    const int32_t *t;
    float *s;
    float *y;               /* LOSS: 1 float (R with DTR_LOSS_NONE) */
    const float *g;         /* GRAD: 1 float, dL/dy (R with DTR_LOSS_NONE) */
    float *gx;              /* GRAD: (R, K) */
    dtr__xent_params p;     /* ignored targets, label smoothing, reduction (as dtr_cross_entropy_ex) */
} dtr__vxent_args;
enum { DTR__VXENT_MAX, DTR__VXENT_SUMS, DTR__VXENT_LOSS, DTR__VXENT_GRAD };
/** The CPU's vocab_xent (host memory). */
DTR__PRIVATE dtr_result dtr__cpu_vocab_xent(dtr_context *ctx, const dtr__vxent_args *a, int phase);

/** Gradient compression's int8 and top-k codecs on one bucket (dtr_backend.codec; the engine
 *  around them: src/engine/compress.c), everything in the backend's memory.
 *    encode (decode 0): payload = the code of g, `bytes` long (int8: [f32 scale = max |g| /
 *      127][n int8, g / scale rounded to nearest even, NaN as 0]; top-k: [k int32 indices,
 *      ascending][k f32 values], the k entries largest in magnitude, ties the first ones);
 *      resid (may be NULL) = g - decoded(payload)
 *    decode (1): g = (sum over the `world` payloads at payload + r * bytes, in rank order) /
 *      world, in f32 (the same bits on every rank and every backend) */
typedef struct dtr__codec_args {
    int kind;               /* DTR_COMPRESS_INT8 or DTR_COMPRESS_TOPK */
    int world;
    int64_t n, k;           /* floats of the bucket; top-k: entries kept, 1 <= k <= n */
    float *g, *resid;
    unsigned char *payload;
    size_t bytes;           /* one payload */
} dtr__codec_args;
/** The CPU's codec (host memory). */
DTR__PRIVATE dtr_result dtr__cpu_codec(dtr_context *ctx, const dtr__codec_args *a, int decode);

/** PowerSGD's work on one matrix M (rows, cols) of a bucket, rank r (dtr_backend.powersgd; the
 *  engine around it: src/engine/compress.c), everything row-major in the backend's memory:
 *    DTR__PSGD_P  p (rows, r) = M q
 *    DTR__PSGD_Q  p's columns made orthonormal (modified Gram-Schmidt, each projection done
 *                 twice, sums in double; a zero column stays zero), then q (cols, r) = M^T p
 *    DTR__PSGD_M  M = p q^T, then resid (rows, cols; may be NULL) -= M */
typedef struct dtr__psgd_args {
    int64_t rows, cols;
    int r;
    float *m, *p, *q, *resid;
} dtr__psgd_args;
enum { DTR__PSGD_P, DTR__PSGD_Q, DTR__PSGD_M };
/** The CPU's powersgd (host memory). */
DTR__PRIVATE dtr_result dtr__cpu_powersgd(dtr_context *ctx, const dtr__psgd_args *a, int phase);

/** A backend's dispatch table: kernels[op] for every id of the op list (NULL: none). */
typedef dtr_result (*dtr__kernel)(dtr_context *, struct dtr__node *);
typedef struct dtr__kernel_pair {
    dtr__kernel fwd, bwd;
    int narrow;   /* 1: the kernels load and store bf16/fp16 tensors themselves (the dispatch
                     does not widen them, src/core/widen.c) */
} dtr__kernel_pair;
/** 1 when table[op] has a forward kernel. */
int dtr__table_has(const dtr__kernel_pair *table, int op);
/** Runs the forward (bwd 0) or backward kernel of node->op from `table` (over f32 copies of
 *  its 16-bit tensors unless the entry is `narrow`), or records DTR_UNSUPPORTED naming the
 *  backend and the op. Shared by every backend's vtable. */
dtr_result dtr__table_run(const dtr__kernel_pair *table, const char *backend, dtr_context *ctx, struct dtr__node *n,
                          int bwd);

/** Capabilities of a backend (dtr_backend.caps). */
enum {
    DTR__CAP_HOST_MEMORY = 1u,  /* tensor, parameter and gradient memory is host memory: the
                                   host may read and write it directly (the CPU) */
    DTR__CAP_ASYNC = 2u         /* work is queued on a stream and completes later: wait on
                                   events (or synchronize) before the host reads results */
};

/** How many to_host_async copies a backend keeps track of at once (their events stay valid). */
#define DTR__ASYNC_COPIES 64

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
    /* host memory the backend copies fastest from and to (page-locked on CUDA), for staging
       buffers; NULL: the context's allocation callbacks (dtr__host_alloc) */
    void *(*host_alloc)(dtr_context *ctx, size_t bytes);
    void (*host_free)(dtr_context *ctx, void *p);
    /* copies bytes of backend memory src to host memory dst (from host_alloc) beside the
       context's stream: the copy starts once the work queued on the stream so far has
       completed, the stream goes on meanwhile, and *done completes with the copy; the caller
       leaves src unchanged and dst unread until then. NULL: the core calls to_host
       (synchronous) instead (dtr__to_host_async). The events of async copies (either way)
       outlive dtr_context_reset; after DTR__ASYNC_COPIES later ones an event may stand for a
       later point of the streams (waiting on it then waits longer, never less) */
    dtr_result (*to_host_async)(dtr_context *ctx, void *dst, const void *src, size_t bytes, dtr_event **done);
    /* copies bytes of host memory src (from host_alloc) to backend memory dst, queued on the
       context's stream (work queued later sees it) without waiting; *done completes with
       the copy, and src stays unchanged until then. NULL: the core calls from_host
       (synchronous) instead (dtr__from_host_async) */
    dtr_result (*from_host_async)(dtr_context *ctx, void *dst, const void *src, size_t bytes, dtr_event **done);
    /* 1 when p points into memory of this backend that the host cannot read (device memory),
       0 for host memory (page-locked included). NULL: a backend of host memory. A process
       group of device memory over a host transport stages the buffers it says 1 of
       (src/comm/stage.c) and passes the others as they are */
    int (*owns)(dtr_context *ctx, const void *p);
    /* copies bytes of backend memory src to backend memory dst, queued on the context's
       stream (the collectives of a group of device memory move data with it). NULL: a
       backend of host memory (dtr__mem_copy does memcpy) */
    dtr_result (*copy)(dtr_context *ctx, void *dst, const void *src, size_t bytes);
    /* captured steps (src/core/graph.c): graph_begin starts capturing the context's stream
       (work queued until graph_end is recorded into a graph, not run); graph_end ends the
       capture (always, also after an error) and makes *exec an executable graph, NULL on
       error; graph_launch queues one on the stream; graph_free releases one. NULL: a backend
       without graphs (dtr_graph_launch calls the step function again) */
    dtr_result (*graph_begin)(dtr_context *ctx);
    dtr_result (*graph_end)(dtr_context *ctx, void **exec);
    dtr_result (*graph_launch)(dtr_context *ctx, void *exec);
    void (*graph_free)(dtr_context *ctx, void *exec);
    /* copies `rows` rows of `width` bytes of backend memory, row i from src + i * spitch to
       dst + i * dpitch, queued on the context's stream (the tensor-parallel gather over a
       group of device memory). NULL: dtr__mem_copy2d copies row by row */
    dtr_result (*copy2d)(dtr_context *ctx, void *dst, size_t dpitch, const void *src, size_t spitch, size_t width,
                         size_t rows);
    /* the vocabulary-parallel cross-entropy's local work, one phase (dtr__vxent_args), queued
       on the context's stream: over a group of the context's device memory the op runs on the
       device with it. NULL: a device backend runs the op on host images */
    dtr_result (*vocab_xent)(dtr_context *ctx, const dtr__vxent_args *a, int phase);
    /* gradient compression's int8 and top-k codecs on a bucket (dtr__codec_args), queued on
       the context's stream: with it the data-parallel engine compresses a device model's
       gradients on the device over a group of its memory. NULL: through a host copy */
    dtr_result (*codec)(dtr_context *ctx, const dtr__codec_args *a, int decode);
    /* PowerSGD's products on one matrix (dtr__psgd_args), queued on the context's stream: with
       it (and codec) a device model's PowerSGD runs on the device over a group of its memory.
       NULL: through a host copy */
    dtr_result (*powersgd)(dtr_context *ctx, const dtr__psgd_args *a, int phase);
    /* memory backed only where it is used (the gradient buffer: frozen parameters' gradients
       take none). mem_reserve hands out `bytes` of backend memory that read as zeros (NULL
       with the error recorded); mem_back gives such a block memory of its own over the n
       byte ranges [r[2i], r[2i + 1]) (ascending, disjoint) and takes it back elsewhere, in
       whole units of the backend's (a GPU's mapping granularity; a backend without them
       keeps the block whole): afterwards units that kept their memory keep their bytes,
       newly backed ones and those given back read zeros. Writing zeros where a unit has no
       memory is allowed; other values there are a bug (they may show in every such unit).
       mem_back waits for the stream's work; free the block with mem_free. NULL: the core
       uses mem_alloc and memset0 (dtr_model_build) */
    void *(*mem_reserve)(dtr_context *ctx, size_t bytes);
    dtr_result (*mem_back)(dtr_context *ctx, void *block, const size_t *r, int n);
};

/** Staging memory on the host: the backend's host_alloc (pinned on CUDA) or the context's
 *  allocator. NULL when out of memory. Free with dtr__host_free. */
DTR__PRIVATE void *dtr__host_alloc(dtr_context *ctx, size_t bytes);
DTR__PRIVATE void dtr__host_free(dtr_context *ctx, void *p);
/** `bytes` of zeros in ctx's backend memory (dev 1: mem_alloc and memset0) or from the
 *  context's allocator (dev 0), for engine buffers that live where their group's memory is.
 *  NULL when out of memory. Free with dtr__mem_free_on and the same dev (NULL is ignored). */
DTR__PRIVATE void *dtr__mem_alloc_on(dtr_context *ctx, int dev, size_t bytes);
DTR__PRIVATE void dtr__mem_free_on(dtr_context *ctx, int dev, void *p);
/** The backend's to_host_async / from_host_async, or on a backend without them its
 *  synchronous to_host / from_host with *done NULL (complete). */
DTR__PRIVATE dtr_result dtr__to_host_async(dtr_context *ctx, void *dst, const void *src, size_t bytes, dtr_event **done);
DTR__PRIVATE dtr_result dtr__from_host_async(dtr_context *ctx, void *dst, const void *src, size_t bytes, dtr_event **done);
/** bytes of ctx's backend memory from src to dst: the backend's copy, or memcpy on a backend
 *  of host memory (DTR_UNSUPPORTED on a device backend without the slot). */
DTR__PRIVATE dtr_result dtr__mem_copy(dtr_context *ctx, void *dst, const void *src, size_t bytes);
/** `rows` rows of `width` bytes of ctx's backend memory, row i from src + i * spitch to
 *  dst + i * dpitch: the backend's copy2d, or dtr__mem_copy row by row. */
DTR__PRIVATE dtr_result dtr__mem_copy2d(dtr_context *ctx, void *dst, size_t dpitch, const void *src, size_t spitch,
                                        size_t width, size_t rows);

#define DTR__MAX_GRAD_HOOKS 8
/** How deep dtr_checkpoint regions may nest (each level has its own recompute tape). */
#define DTR__MAX_RECOMPUTE_DEPTH 4

/** A released gradient block of a tape's data arena (descriptor in its meta arena). */
typedef struct dtr__spare {
    struct dtr__spare *next;
    void *p;
    size_t bytes;
} dtr__spare;

/** A tape and the arenas of what was recorded while it was current (dtr_tape_create; the
 *  context's own is ctx->own). Resetting it frees all of them at once. */
struct dtr_tape {
    dtr_context *ctx;
    dtr__arena meta;              /* tensor structs and nodes (host) */
    dtr__arena data;              /* tensor data (backend memory) */
    dtr__node *head;              /* last recorded node */
    dtr__spare *spare;            /* released gradients, for the pass's next ones of that size */
    dtr__spare *unused;           /* descriptors whose block was taken again */
    float *wide;                  /* 16-bit activations: f32 scratch of the kernels that widen
                                     their inputs (src/core/widen.c), kept for the next one */
    size_t wide_bytes;
};

/** One installed gradient hook (dtr_context_add_grad_hook). */
typedef struct dtr__grad_hook {
    dtr_grad_hook_fn fn;
    void *user;
    int id;
    int deferred;   /* its work may wait for the step's end (dtr__grad_hook_defer): not run in a captured step */
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
    const dtr_tensor *pass_root;  /* the storage owner of the current pass's root (never released) */
    /* activation checkpointing (src/core/recompute.c): one tape per nesting level, made on
       first use, where a region runs and is recomputed; empty between uses */
    dtr_tape *recompute[DTR__MAX_RECOMPUTE_DEPTH];
    int recompute_depth;          /* levels in use now */
    int recomputing;              /* a region's recomputation in backward runs: batch norm
                                     leaves its running statistics alone */
    int anomaly;                  /* anomaly mode (dtr_context_set_anomaly; src/core/anomaly.c) */
    struct dtr_metrics *obs;      /* metrics and timeline (src/obs/; NULL: off, one branch per hook) */
    struct dtr_graph *capturing;  /* the graph whose step runs now (src/core/graph.c; its guard is
                                     `backend` meanwhile), NULL otherwise */
    uint64_t resets;              /* dtr_context_reset calls: a graph that read the own tape's
                                     tensors is stale after one */
    /* parameters sharded over a group (ZeRO-3, src/engine/zero.c): gathers the DTR__ABSENT
       parameters among n's inputs before n's forward or backward kernel reads them; NULL: no
       engine shards this context's parameters */
    dtr_result (*param_fetch)(void *user, struct dtr__node *n);
    void *param_fetch_user;
};

/** Host memory for the backend's tensors (may the host read and write it?). */
static inline int dtr__host_memory(const dtr_context *ctx) { return (ctx->backend->caps & DTR__CAP_HOST_MEMORY) != 0; }
/** Host memory the core may read and write directly: host memory, and no captured step running
 *  (its copies in and reads go through the backend's slots, which the graph's guard sees:
 *  src/core/graph.c). */
static inline int dtr__host_direct(const dtr_context *ctx) { return dtr__host_memory(ctx) && !ctx->capturing; }

/* ---- autograd internals (src/core/autograd.c, src/core/recompute.c) ---- */

/** Replays the nodes from `head` back in the current pass (ctx->backward_pass); the root
 *  already holds its gradient. report 0: gradient hooks are neither counted nor called (a
 *  recomputed region inside the pass that reports its parameters). */
DTR__PRIVATE dtr_result dtr__replay(dtr_context *ctx, dtr__node *head, int report);
/** dtr_backward_from with `grad` in host memory (in_backend 0), or in the context's backend
 *  memory (1: a tensor's data, copied on the device; the pipeline over a device transport). */
DTR__PRIVATE dtr_result dtr__backward_from(dtr_context *ctx, dtr_tensor *out, const float *grad, int in_backend);
/** 1 when p (a tensor struct, a node) lies in the metadata arena of tape t. */
DTR__PRIVATE int dtr__tape_owns(const dtr_tape *t, const void *p);
/** The backward of a CHECKPOINT node, for every backend: recomputes the region with its
 *  saved random stream and replays it into the gradients of the node's inputs. */
dtr_result dtr__checkpoint_backward(dtr_context *ctx, dtr__node *n);

/* ---- numeric health (src/core/anomaly.c) ---- */

/** Anomaly mode, forward: DTR_OK when n->out is finite (or not checked: not f32, a view),
 *  else DTR_NONFINITE recorded on ctx naming the op. Called only when ctx->anomaly is set. */
DTR__PRIVATE dtr_result dtr__anomaly_forward(dtr_context *ctx, const dtr__node *n);
/** Anomaly mode, backward: checks the gradients n's backward wrote (its inputs'). */
DTR__PRIVATE dtr_result dtr__anomaly_backward(dtr_context *ctx, const dtr__node *n);
/** Logs a formatted message at `level` through the context's log callback (when set and
 *  verbose enough); never records an error. */
DTR__PRIVATE void dtr__ctx_log(dtr_context *ctx, dtr_log_level level, const char *fmt, ...) DTR__PRINTF(3, 4);
/** A non-sticky error: writes the message (when no error is recorded) and logs it at
 *  DTR_LOG_WARN, leaving the status as it is; returns code. */
DTR__PRIVATE dtr_result dtr__note(dtr_context *ctx, dtr_result code, const char *fmt, ...) DTR__PRINTF(3, 4);

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

/** The floats the optimizer updates and keeps state for: [*base, *base + *len) of the
 *  model's buffers (the whole buffer, or its ZeRO shard); 0, 0 for NULL. */
DTR__PRIVATE void dtr__optimizer_range(const dtr_optimizer *o, int64_t *base, int64_t *len);

/** Makes the optimizer leave the gradient buffer as it is after an update (a parameter
 *  server writes its range's gradient whole before each one; zeroing the model's whole
 *  buffer would be wasted). */
DTR__PRIVATE void dtr__optimizer_keep_grads(dtr_optimizer *o);
/** The context of the optimizer's model (o not NULL). */
DTR__PRIVATE dtr_context *dtr__optimizer_context(const dtr_optimizer *o);

/** The gradient's global norm as the optimizer measures it for clipping: with shard_sum
 *  (ZeRO) its own floats' sum of squares summed over the group's shards, with norm_sum
 *  (pipeline stages) over the model's other parts too, tensor-parallel shards over their
 *  group (collectives: every rank calls it), else the whole buffer's. Every rank of a group
 *  gets the same value. */
DTR__PRIVATE dtr_result dtr__optimizer_grad_norm(dtr_optimizer *o, double *norm);
/** Hands the next dtr_optimizer_step the norm dtr__optimizer_grad_norm just gave for the
 *  gradients it will read (the loss scaler's check): the step's clipping and non-finite
 *  check take it instead of measuring again, one group sum less under ZeRO or a pipeline. */
DTR__PRIVATE void dtr__optimizer_give_norm(dtr_optimizer *o, double norm);

/** Forgets the micro-batches counted toward the next update (grad_accum_steps): a step the
 *  loss scaler skipped starts the accumulation over. */
DTR__PRIVATE void dtr__optimizer_restart_accum(dtr_optimizer *o);
/** 1 when the next dtr_optimizer_step call updates (its micro-batch completes the
 *  accumulation), 0 when it only counts one. */
DTR__PRIVATE int dtr__optimizer_updates_next(const dtr_optimizer *o);

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
/** Marks t DTR__GRAD_SPARE when its gradient can be released later (an intermediate, not
 *  retained, on the context's own tape). */
DTR__PRIVATE void dtr__grad_spare_mark(dtr_context *ctx, dtr_tensor *t);
/** Gives block p of `bytes` (from dtr__arena_data) back to the current tape's spares, for its
 *  next allocations: 1, or 0 when p is not that tape's (then it stays until the reset). */
DTR__PRIVATE int dtr__arena_give_back(dtr_context *ctx, void *p, size_t bytes);
/** Gives t's gradient back to the own tape's spares if it came from there (DTR__GRAD_SPARE)
 *  and t is not retained; t->grad becomes NULL. */
DTR__PRIVATE void dtr__grad_release(dtr_context *ctx, dtr_tensor *t);
/** Moves from's gradient block to `to` when from's would be released after this node and
 *  to's is still to be made in this pass (both intermediates of the own tape): the backward
 *  of an op whose input gradient is its output gradient (reshape, contiguous) becomes a
 *  pointer move, without a second buffer of that size. 1 when moved. */
DTR__PRIVATE int dtr__grad_handoff(dtr_context *ctx, dtr_tensor *from, dtr_tensor *to);
/** release_activations: after node n (own tape) ran its backward, gives its saved state and
 *  its output's storage (owned, not retained, not the pass's root) back to the spares. */
DTR__PRIVATE void dtr__node_release(dtr_context *ctx, dtr__node *n);
int64_t dtr__numel(int ndim, const int64_t *shape);
void dtr__contig_strides(int ndim, const int64_t *shape, int64_t *stride);
static inline float *dtr__f32(const dtr_tensor *t) { return (float *)t->storage + t->offset; }
/** The first element of t's view, any dtype, whatever memory it is in (kernels' access). */
static inline void *dtr__data(const dtr_tensor *t) { return (char *)t->storage + (size_t)t->offset * dtr_dtype_size(t->dtype); }
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
void *dtr__node_save(dtr_context *ctx, dtr__node *n, size_t bytes);
/** Advances a generator by `delta` draws in O(log delta) (PCG's jump ahead). */
DTR__PRIVATE void dtr__rng_advance(dtr_rng *rng, uint64_t delta);
/** The draws of an op's mask of n elements in rows of `width` that are columns col0 .. of rows
 *  of `cols` draws (cols 0: whole rows, draw i for element i): taken from the context's
 *  stream, which moves past n / width * cols draws (the whole mask one device would draw). */
DTR__PRIVATE dtr__draws dtr__draws_take(dtr_context *ctx, int64_t n, int64_t width, int64_t cols, int64_t col0);
/** The generator at element i's draw; the draws of the rest of i's row follow it in order. */
DTR__PRIVATE dtr_rng dtr__draws_at(const dtr__draws *d, int64_t i);
/** dtr_dropout of x, whose last axis holds columns col0 .. of rows of `cols` (a
 *  tensor-parallel shard's share of one device's mask; cols 0: x's own rows). */
DTR__PRIVATE dtr_tensor *dtr__dropout_cols(dtr_context *ctx, dtr_tensor *x, float p, int64_t cols, int64_t col0);
/** 1 when x is a usable float (f32, bf16, f16) input of `op` on ctx; else records an error naming op and `what`. */
DTR__PRIVATE int dtr__check_input(dtr_context *ctx, const char *op, const dtr_tensor *x, const char *what);
/** The node of a cross-entropy op `op` (logits (..., K) f32, targets i32 of the row count)
 *  with its scalar output, checked and not yet recorded; NULL with the error (naming `name`). */
DTR__PRIVATE dtr__node *dtr__xent_node(dtr_context *ctx, int op, const char *name, dtr_tensor *logits, dtr_tensor *targets);
/** x, or a recorded contiguous copy of it. */
DTR__PRIVATE dtr_tensor *dtr__contig_input(dtr_context *ctx, dtr_tensor *x);
/** Before n's kernel reads its inputs: parameters among them that are DTR__ABSENT (sharded by
 *  ZeRO-3) are gathered through ctx->param_fetch. DTR_OK, the fetch's error, or DTR_BAD_STATE
 *  when no engine shards them any more (recorded on ctx). */
DTR__PRIVATE dtr_result dtr__fetch_params(dtr_context *ctx, struct dtr__node *n);
/** DTR_BAD_STATE (recorded on t's context, naming `fn`) when parameter t's values are on other
 *  ranks (ZeRO-3), else DTR_OK. */
DTR__PRIVATE dtr_result dtr__param_present(const dtr_tensor *t, const char *fn);
/** dtr__param_present over every parameter of m (src/nn/model.c). */
DTR__PRIVATE dtr_result dtr__model_present(const dtr_model *m, const char *fn);
/** ZeRO-3 (on 1): dtr_model_zero_grad zeroes gradient floats [lo, hi) and discards the rest
 *  (it reads as zeros, its memory back to the system) on a host model; on 0: the whole buffer. */
DTR__PRIVATE void dtr__model_shard_grads(dtr_model *m, int on, int64_t lo, int64_t hi);
/** 1 for the dtypes ops compute with: f32, bf16, f16. */
static inline int dtr__is_float(dtr_dtype dt) { return dt == DTR_F32 || dt == DTR_BF16 || dt == DTR_F16; }
/** The dtype ops store what they compute in (dtr_context_config.activation_dtype). */
static inline dtr_dtype dtr__act_dtype(const dtr_context *ctx) { return ctx->cfg.activation_dtype; }
/** 1 when node n has a bf16/fp16 input or output whose values its forward (bwd 0) or
 *  backward kernel reads or writes as f32 (every op but those whose kernels take any dtype:
 *  the cast, the checkpoint copy, the views, cross-entropy). */
int dtr__needs_widening(const struct dtr__node *n, int bwd);
/** Runs `kernel`, node n's forward (bwd 0) or backward kernel, over f32 copies of n's 16-bit
 *  inputs (and output) made by `cast` (the backend's CAST kernel), rounding the output back
 *  after a forward (src/core/widen.c). The dispatch calls it for entries not `narrow`; a
 *  narrow kernel calls it for the cases it leaves to its f32 form. */
dtr_result dtr__run_widened(dtr__kernel cast, dtr__kernel kernel, dtr_context *ctx, struct dtr__node *n, int bwd);
/** The largest of `init` and x[0..n) (absval 1: of |x[i]|), NaN skipped as fmaxf does; 8
 *  running maxima, which compilers vectorise (`a > m ? a : m` is maxps) (src/core/half.c). */
DTR__PRIVATE float dtr__max_f32(const float *x, int64_t n, float init, int absval);
/** dst (dd) = src (sd), n dense elements of the context's backend memory, converted by the
 *  backend's CAST kernel on its stream (f32, bf16, f16). */
DTR__PRIVATE dtr_result dtr__convert_on(dtr_context *ctx, void *dst, dtr_dtype dd, const void *src, dtr_dtype sd, int64_t n);
/** dtr__convert_on in the backend's memory (dev 1), dtr_convert in host memory (dev 0): for
 *  engine buffers that live where their group's memory is. */
DTR__PRIVATE dtr_result dtr__convert_mem(dtr_context *ctx, int dev, void *dst, dtr_dtype dd, const void *src, dtr_dtype sd,
                                         int64_t n);
/** The values of dense float tensor t as f32 in backend memory: its own for f32, else an f32
 *  copy in the current tape's widening scratch (valid until the next widened kernel), made by
 *  the backend's cast kernel on behalf of node n. NULL with the error set on failure. */
DTR__PRIVATE const float *dtr__f32_view(dtr_context *ctx, const struct dtr__node *n, const dtr_tensor *t);
/** Marks hook `id` deferrable: what it starts can wait for the end of the step (the
 *  data-parallel engine: dtr_dp_finish exchanges every bucket its hook did not start), so a
 *  captured step (dtr_graph) runs without it instead of refusing the context. */
DTR__PRIVATE void dtr__grad_hook_defer(dtr_context *ctx, int id);
/** Steps of the complete checkpoints under dir (dtr_ckpt's layout), newest first, up to cap;
 *  -1 when dir cannot be read (src/engine/checkpoint.c). */
DTR__PRIVATE int dtr__ckpt_steps(const char *dir, int64_t *steps, int cap);
/** 1 when name starts with one of the n prefixes, a '*' in which matches any run of characters
 *  (dtr_model_set_trainable's patterns). */
DTR__PRIVATE int dtr__name_matches(const char *name, const char *const *prefixes, int n);
/** Notes, during a capture (ctx->capturing), that its backward reached `param` (src/core/graph.c). */
DTR__PRIVATE void dtr__graph_reached(dtr_context *ctx, dtr_tensor *param);
/** Marks in skip[i] (one per parameter) the trainable parameters no backward pass reached since
 *  the last dtr_model_zero_grad, torch.optim's parameters whose .grad is None; returns how many.
 *  None when no pass reached any of the model's parameters (gradients written by other means:
 *  a parameter server's, the app's) or after dtr__model_reach_all. */
DTR__PRIVATE int dtr__model_unreached(const dtr_model *m, unsigned char *skip);
/** Until the next zero_grad every parameter counts as reached (data parallelism: the replicas
 *  update alike whatever each rank's backward reached). */
DTR__PRIVATE void dtr__model_reach_all(dtr_model *m);
/** Parameter i counts as reached since the last zero_grad (reached 1) or not (0): data
 *  parallelism's find_unused puts the group's answer in place of this rank's. */
DTR__PRIVATE void dtr__model_set_reached(dtr_model *m, int i, int reached);
/** How many of the model's parameters are frozen (dtr_model_set_trainable). */
DTR__PRIVATE int dtr__model_frozen(const dtr_model *m);
/** A number that changes with every change of the model's trainable set (an optimizer lays its
 *  state out again when it differs from the one it saw). */
DTR__PRIVATE unsigned dtr__model_trainable_gen(const dtr_model *m);
/** The next run of trainable parameters from parameter *i on: their floats [*lo, *hi) (to the
 *  next parameter's offset: the padding between them included); *i moves past it. 0 when no
 *  trainable parameter is left. */
DTR__PRIVATE int dtr__model_next_run(const dtr_model *m, int *i, int64_t *lo, int64_t *hi);
/** Gradients *= factor: the whole buffer, or on host memory with frozen parameters their runs of
 *  trainable ones only (the frozen ones' zeros, and their unmapped pages, left alone). */
DTR__PRIVATE dtr_result dtr__model_grad_scale(dtr_model *m, float factor);
/** The recurrence op `op` (DTR_OP_LSTM, DTR_OP_GRU; inputs gx, w_hh, b_hh, h0, c0 (the GRU's
 *  NULL), lengths) -> y (T, B, 2H | H), errors naming fn. lengths: B host values in 1..T
 *  (checked by the caller; a row past its length carries its state: y = the step before's),
 *  or NULL (src/ops/ops_nn.c). */
DTR__PRIVATE dtr_tensor *dtr__rnn_sequence(dtr_context *ctx, const char *fn, int op, dtr_tensor *gx, dtr_tensor *w_hh, dtr_tensor *b_hh,
                                           dtr_tensor *h0, dtr_tensor *c0, const int32_t *lengths);
/** out[j] += the sum over rows r of X[r n + j] (X (rows, n) dense): a bias's gradient, row by
 *  row in order for every j, its columns split over p's threads (NULL: the caller's). */
DTR__PRIVATE void dtr__rows_sum_into(dtr__pool *p, const float *X, int64_t rows, int64_t n, float *out);
/** out[i] += x[i] for i < n (no overlap), split over p's threads (NULL: the caller's). */
DTR__PRIVATE void dtr__add_into(dtr__pool *p, float *out, const float *x, int64_t n);
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

/** A LoRA adapter of `rank` and `alpha` may go on the layer of `weight` ("<name>.weight", none
 *  yet: `a` NULL): "<name>" into base (cap bytes), or the error recorded, naming fn. */
DTR__PRIVATE dtr_result dtr__lora_check(dtr_model *m, const char *fn, const dtr_tensor *weight, const dtr_tensor *a, int rank,
                                        float alpha, char *base, size_t cap);
/** weight (out, in) += scale b (out, r) a (r, in), accumulated in double, then b = 0 (the layer's
 *  output stays); errors name fn. */
DTR__PRIVATE dtr_result dtr__lora_merge(const char *fn, dtr_tensor *weight, dtr_tensor *a, dtr_tensor *b, float scale);
/** "<prefix>.<suffix>" (just suffix for an empty or NULL prefix) into buf; returns buf. */
DTR__PRIVATE const char *dtr__sub_name(char *buf, size_t n, const char *prefix, const char *suffix);
/** Declares parameter "prefix.suffix" (just suffix for an empty or NULL prefix) on m (src/nn/layers.c). */
DTR__PRIVATE dtr_tensor *dtr__named_param(dtr_model *m, const char *prefix, const char *suffix, int ndim,
                                          const int64_t *shape, dtr_init init, float arg);
/** A layer's attention: dtr_attention_ex(q, k, v, cfg) without a cache (c NULL); with one, k and
 *  v appended to layer's rows and q against all of them, cfg->q_start set to the first new
 *  position and cfg->dropout to 0 (src/nn/generate.c). */
DTR__PRIVATE dtr_tensor *dtr__kv_attention(dtr_context *ctx, dtr_kv_cache *c, int layer, dtr_tensor *q, dtr_tensor *k,
                                           dtr_tensor *v, dtr_attention_config *cfg);
/** Marks parameter `t` of m (declared with the shard's shape, before dtr_model_build) as a
 *  shard: build initialises the full tensor and keeps the slice, save gathers, load slices. */
DTR__PRIVATE dtr_result dtr__model_set_shard(dtr_model *m, dtr_tensor *t, const dtr__shard *s);
/** The sum of squares of gradient floats [b, e) of m: with tensor-parallel shards, their parts
 *  summed over the shards' group (collective over it: every rank of the group calls it alike;
 *  one group per model; a group of device memory is not summed) and the replicated
 *  parameters' once. */
DTR__PRIVATE dtr_result dtr__model_grad_sumsq(dtr_model *m, int64_t b, int64_t e, double *out);
/** This rank's sum of squares of gradient floats [b, e) (on host memory with frozen parameters
 *  the trainable runs' only: the frozen ones' zeros are not read). */
DTR__PRIVATE dtr_result dtr__grad_sumsq_range(dtr_model *m, int64_t b, int64_t e, double *out);
/** Copies rank `rank`'s slice between the full tensor and a shard (to_full 0: full -> part). */
DTR__PRIVATE void dtr__shard_copy(const dtr__shard *s, int rank, float *full, float *part, int to_full);
/** Gathers the shard `t` of every rank into `full` (f32, the full shape). Collective. */
DTR__PRIVATE dtr_result dtr__shard_gather(dtr_context *ctx, const dtr__shard *s, const dtr_tensor *t, float *full);

/* ---- CPU backend ---- */
extern const dtr_backend dtr__cpu_backend;

#ifdef __cplusplus
}
#endif
