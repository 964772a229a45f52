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

/** Sliding windows over a time series (dtr_dataset_windows). */
typedef struct dtr_window_config {
    int64_t window;    /**< steps in a window (required, >= 1) */
    int64_t stride;    /**< steps between window starts (default 1) */
    int64_t horizon;   /**< the label is the one `horizon` steps after the window's last step:
                            1 (default) the next step's (forecasting), 0 the last step's own */
} dtr_window_config;

/** Defaults: stride 1, horizon 1; window must be set. Thread safety: thread safe. */
DTR_API dtr_window_config dtr_window_config_init(void);

/** A dataset of windows over `base`, whose samples are the steps of one time series in order
 *  (a CSV of readings or prices, one row a step): sample s is steps [s stride, s stride +
 *  window), x their features stacked (window, x_shape...) (an LSTM's (T, F) input), y the
 *  label of step s stride + window - 1 + horizon (base's y layout). count = (base count -
 *  window - horizon) / stride + 1 (0 when shorter). Samples are read from `base`, which must
 *  stay open while the windows are used; a loader shuffles and batches them as any dataset.
 *  @return DTR_OK, DTR_NULL_HANDLE, DTR_INVALID_ARGUMENT (window or stride < 1, horizon < 0,
 *          base samples of DTR_MAX_DIMS - 1 axes), DTR_OUT_OF_MEMORY.
 *  Thread safety: thread safe (see the section comment). */
DTR_API dtr_result dtr_dataset_windows(dtr_dataset *base, const dtr_window_config *cfg, dtr_dataset **out, char *err,
                                       size_t errlen);

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
 *  For a loader's batch on a GPU, dtr_loader_tensors does not wait for the copies.
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
    dtr_context *device;              /**< the context the batches go to (a GPU's): the batch buffers
                                           are the host memory its backend copies fastest from
                                           (page-locked on CUDA) and dtr_loader_tensors queues
                                           their copies without waiting; it must outlive the
                                           loader. NULL: plain host memory (the allocator) */
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

/** dtr_batch_tensors for `b`, the batch dtr_loader_next handed out last. With cfg.device ==
 *  ctx (a GPU's context) the copies from the page-locked batch buffers are queued on the
 *  context's stream and the call returns at once: the host goes on queueing the step while
 *  the batch travels, and the loader keeps the buffer until the copies are done (the next
 *  dtr_loader_next waits for them before the buffer is refilled). Otherwise (CPU, another
 *  batch, no cfg.device) it is dtr_batch_tensors.
 *  @return as dtr_batch_tensors. Thread safety: the thread that calls dtr_loader_next, which
 *  is the context's. */
DTR_API dtr_result dtr_loader_tensors(dtr_loader *l, dtr_context *ctx, const dtr_batch *b, dtr_tensor **x, dtr_tensor **y);

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

/** What a push into a full ring does (dtr_feed_config.policy). Append-only. */
typedef enum dtr_feed_policy {
    DTR_FEED_BLOCK = 0,               /**< wait for room up to the push's timeout, then DTR_TIMEOUT */
    DTR_FEED_DROP_OLDEST = 1,         /**< overwrite the oldest waiting samples (counted in `dropped`) */
    DTR_FEED_DROP_NEWEST = 2          /**< discard the incoming samples that do not fit (counted in
                                           `dropped_newest`); the push returns DTR_OK */
} dtr_feed_policy;

/** How a push checks its samples (dtr_feed_config.check), as the other datasets do: f32
 *  features and targets must be finite, i32 labels inside [0, num_classes) when the layout
 *  gives num_classes. Append-only. */
typedef enum dtr_feed_check {
    DTR_FEED_REJECT_PUSH = 0,         /**< one bad sample refuses the whole push: DTR_INVALID_ARGUMENT,
                                           nothing goes in (counted in `rejected_pushes`) */
    DTR_FEED_REJECT_SAMPLE = 1,       /**< bad samples are left out (counted in `rejected`), the rest go in */
    DTR_FEED_NO_CHECK = 2             /**< no check (the app has checked) */
} dtr_feed_check;

/** A bounded ring buffer of samples that the application pushes into while a trainer pops
 *  batches from it: training inside a running app on a stream of samples. */
typedef struct dtr_feed_config {
    dtr_sample_layout layout;         /**< the samples' layout */
    int64_t capacity;                 /**< samples the ring holds; 0: 1024 */
    int64_t max_batch;                /**< largest batch dtr_feed_next hands out; 0: 256 */
    int drop_oldest;                  /**< 1: the same as policy DTR_FEED_DROP_OLDEST (kept for old code) */
    dtr_allocation_callbacks alloc;   /**< zero: libc */
    dtr_feed_policy policy;           /**< a push into a full ring; default DTR_FEED_BLOCK */
    dtr_feed_check check;             /**< checking of pushed samples; default DTR_FEED_REJECT_PUSH */
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

/** Checks (dtr_feed_config.check) and copies `n` samples (x: n * x_numel elements, y:
 *  n * y_numel, NULL when unlabeled) into the ring. When it is full, the policy decides:
 *  wait up to `timeout_ms` for room (0: never blocks; negative: waits as long as it takes),
 *  overwrite the oldest samples, or discard the newest.
 *  @param pushed  receives how many samples went in (may be NULL).
 *  @return DTR_OK (all went in, or the rest was dropped or rejected by policy: see the
 *          stats), DTR_TIMEOUT (the ring stayed full: *pushed < n), DTR_INVALID_ARGUMENT
 *          (n < 0, or a bad sample with DTR_FEED_REJECT_PUSH: the stats' last_bad says which
 *          and why), DTR_BAD_STATE (the feed has ended), DTR_NULL_HANDLE.
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
    int64_t dropped_newest;           /**< incoming samples discarded by DTR_FEED_DROP_NEWEST */
    int64_t rejected;                 /**< bad samples left out (DTR_FEED_REJECT_SAMPLE) */
    int64_t rejected_pushes;          /**< pushes refused for a bad sample (DTR_FEED_REJECT_PUSH) */
    char last_bad[160];               /**< why the last bad sample was bad, or "" */
} dtr_feed_stats;

/** Copies the counters. Thread safe. */
DTR_API void dtr_feed_get_stats(dtr_feed *s, dtr_feed_stats *out);

#ifdef __cplusplus
}
#endif
