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
#include "../public/api.h"
#include "../core/internal.h"
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
