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
#include "../public/api.h"
#include "../public/api_data.h"
#include "../core/internal.h"
#include "data_internal.h"
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
