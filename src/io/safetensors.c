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
#include "../public/api.h"
#include "../core/internal.h"
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
