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
#include "../public/api.h"
#include "../public/api_data.h"
#include "../core/internal.h"
#include "data_internal.h"
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

/* ---- sliding windows over the steps of a time series ---- */

typedef struct dtr__window_ds {
    dtr_dataset *base;
    dtr_window_config cfg;
    size_t step_bytes;                /* one step's x */
} dtr__window_ds;

dtr_window_config dtr_window_config_init(void) {
    dtr_window_config c;
    c.window = 0, c.stride = 1, c.horizon = 1;
    return c;
}

/* window `index`: its steps' x stacked, y the label `horizon` steps after its last (a scratch
   x for that step's read: get may run on several threads) */
static dtr_result dtr__window_get(dtr_dataset *ds, int64_t index, void *x, void *y, char *err, size_t errlen) {
    const dtr__window_ds *w = (const dtr__window_ds *)ds->impl;
    int64_t start = index * w->cfg.stride, k, last = w->cfg.window - 1;
    void *scratch = NULL;
    dtr_result r = DTR_OK;
    for (k = 0; k <= last && r == DTR_OK; k++)
        r = w->base->get(w->base, start + k, (char *)x + (size_t)k * w->step_bytes, k == last && w->cfg.horizon == 0 ? y : NULL, err, errlen);
    if (r != DTR_OK || !y || w->cfg.horizon == 0) return r;
    if (!(scratch = dtr__malloc(&ds->alloc, w->step_bytes)))
        return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "%s: out of memory reading window %lld", ds->name, (long long)index);
    r = w->base->get(w->base, start + last + w->cfg.horizon, scratch, y, err, errlen);
    dtr__free(&ds->alloc, scratch);
    return r;
}

static void dtr__window_close(dtr_dataset *ds) { dtr__free(&ds->alloc, ds->impl); }

dtr_result dtr_dataset_windows(dtr_dataset *base, const dtr_window_config *cfg, dtr_dataset **out, char *err, size_t errlen) {
    dtr_sample_layout l;
    dtr__window_ds *w;
    dtr_dataset *ds;
    int64_t n;
    dtr_result r;
    if (err && errlen) err[0] = '\0';
    if (!out) return dtr__errf(err, errlen, DTR_NULL_HANDLE, "dtr_dataset_windows: out is NULL");
    *out = NULL;
    if (!base || !cfg) return dtr__errf(err, errlen, DTR_NULL_HANDLE, "dtr_dataset_windows: base or cfg is NULL");
    if (cfg->window < 1 || cfg->stride < 1 || cfg->horizon < 0)
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "%s: windows of %lld steps every %lld, horizon %lld: need window, stride >= 1 and "
                         "horizon >= 0", base->name, (long long)cfg->window, (long long)cfg->stride, (long long)cfg->horizon);
    if (base->layout.x_ndim >= DTR_MAX_DIMS - 1)
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "%s: a window of samples of %d axes would have too many", base->name,
                         base->layout.x_ndim);
    l = base->layout;
    memmove(l.x_shape + 1, l.x_shape, (size_t)l.x_ndim * sizeof(int64_t));
    l.x_shape[0] = cfg->window, l.x_ndim++;
    n = base->count >= cfg->window + cfg->horizon ? (base->count - cfg->window - cfg->horizon) / cfg->stride + 1 : 0;
    if ((r = dtr__dataset_new(&base->alloc, n, &l, base->name, &ds, err, errlen)) != DTR_OK) return r;
    if (!(w = (dtr__window_ds *)dtr__calloc(&base->alloc, sizeof *w))) {
        dtr__free(&base->alloc, ds);
        return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "%s: out of memory for windows", base->name);
    }
    w->base = base, w->cfg = *cfg, w->step_bytes = (size_t)base->x_numel * dtr_dtype_size(base->layout.x_dtype);
    ds->impl = w, ds->base = base, ds->in_memory = base->in_memory;
    ds->get = dtr__window_get, ds->close = dtr__window_close;
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
