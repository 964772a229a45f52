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

/** Checks samples [0, n) of a push as the feed's policy says (none with DTR_FEED_NO_CHECK):
 *  the index of the first bad one (its reason in msg and the feed's stats, counted as a
 *  refused push), or -1 when all are good. Thread safe. */
/** Samples waiting in the feed (without copying the stats). Thread safe. */
DTR__PRIVATE int64_t dtr__feed_size(dtr_feed *s);
DTR__PRIVATE int64_t dtr__feed_validate(dtr_feed *s, const void *x, const void *y, int64_t n, char *msg, size_t len);

#ifdef __cplusplus
}
#endif
