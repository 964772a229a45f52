/* tests/test_util.h: helpers several tests share (include after test.h). Each is static
 * inline, so a test that uses only some of them builds without unused-function warnings.
 *   count_alloc / count_alloc_callbacks  an allocator that counts calls and live blocks (leak
 *                                        checks, steady state) and fails the fail_at-th call
 *                                        (out-of-memory paths); thread-safe
 *   tmp_path, make_tmp_dir               per-process paths and fresh folders under $TMPDIR
 *   write_file                           writes bytes to a file
 *   idx_header                           the header of an IDX file (MNIST format)
 *   TU_HAVE_STBIW                        1 when stb_image_write.h is there (then included,
 *                                        its functions static) */
#ifndef DTRAIN_TEST_UTIL_H
#define DTRAIN_TEST_UTIL_H
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#ifndef _WIN32
#include <unistd.h>
#endif

/* ---- a counting, failing allocator (thread-safe) ---- */

/** Calls of each callback; live blocks (a successful malloc or realloc(NULL) adds one, freeing
 *  a block removes one); calls counts malloc and realloc calls, and the fail_at-th fails. */
typedef struct count_alloc { long mallocs, reallocs, frees, live, calls, fail_at; } count_alloc;

#define TU_ATOMIC_ADD(p, v) __atomic_add_fetch((p), (v), __ATOMIC_SEQ_CST)
#define TU_ATOMIC_LOAD(p) __atomic_load_n((p), __ATOMIC_SEQ_CST)

static inline void *ca_malloc(size_t n, void *u) {
    count_alloc *c = (count_alloc *)u;
    void *p;
    TU_ATOMIC_ADD(&c->mallocs, 1);
    if (TU_ATOMIC_ADD(&c->calls, 1) == c->fail_at) return NULL;
    p = malloc(n);
    if (p) TU_ATOMIC_ADD(&c->live, 1);
    return p;
}
static inline void *ca_realloc(void *p, size_t n, void *u) {
    count_alloc *c = (count_alloc *)u;
    void *q;
    TU_ATOMIC_ADD(&c->reallocs, 1);
    if (TU_ATOMIC_ADD(&c->calls, 1) == c->fail_at) return NULL;
    q = realloc(p, n);
    if (!p && q) TU_ATOMIC_ADD(&c->live, 1);
    return q;
}
static inline void ca_free(void *p, void *u) {
    count_alloc *c = (count_alloc *)u;
    TU_ATOMIC_ADD(&c->frees, 1);
    if (p) TU_ATOMIC_ADD(&c->live, -1);
    free(p);
}
/** Callbacks over `c` (zero it first; set fail_at to make the n-th call fail). */
static inline dtr_allocation_callbacks count_alloc_callbacks(count_alloc *c) {
    dtr_allocation_callbacks a;
    a.user = c;
    a.malloc_fn = ca_malloc;
    a.realloc_fn = ca_realloc;
    a.free_fn = ca_free;
    return a;
}
/** Every callback call so far (malloc, realloc and free). */
static inline long count_alloc_total(count_alloc *c) {
    return TU_ATOMIC_LOAD(&c->mallocs) + TU_ATOMIC_LOAD(&c->reallocs) + TU_ATOMIC_LOAD(&c->frees);
}

/* ---- temporary files and folders ---- */

/** "<$TMPDIR or /tmp>/<prefix>_<pid>_<tag>" in buf (a path of this process); returns buf. */
static inline const char *tmp_path(const char *prefix, const char *tag, char *buf, size_t n) {
    const char *d = getenv("TMPDIR");
    long pid = 0;
#ifndef _WIN32
    pid = (long)getpid();
#endif
    snprintf(buf, n, "%s/%s_%ld_%s", d && d[0] ? d : "/tmp", prefix, pid, tag);
    return buf;
}

#if defined(_POSIX_C_SOURCE) && _POSIX_C_SOURCE >= 200809L
/** Makes a fresh folder "<$TMPDIR or /tmp>/<prefix>_XXXXXX" (mkdtemp), its path in buf;
 *  1 on success (a message on stderr otherwise). Needs _POSIX_C_SOURCE 200809L. */
static inline int make_tmp_dir(const char *prefix, char *buf, size_t n) {
    const char *d = getenv("TMPDIR");
    snprintf(buf, n, "%s/%s_XXXXXX", d && d[0] ? d : "/tmp", prefix);
    if (mkdtemp(buf)) return 1;
    fprintf(stderr, "cannot make a temporary folder %s\n", buf);
    return 0;
}
#endif

/* ---- files ---- */

/** Writes n bytes to path; 1 on success. */
static inline int write_file(const char *path, const void *p, size_t n) {
    FILE *f = fopen(path, "wb");
    int ok;
    if (!f) return 0;
    ok = fwrite(p, 1, n, f) == n;
    return fclose(f) == 0 && ok;
}

/** Writes an IDX header into b: 00 00 type ndim, then big-endian dims. Returns its length. */
static inline size_t idx_header(unsigned char *b, int type, int ndim, const uint32_t *dims) {
    int i;
    b[0] = 0; b[1] = 0; b[2] = (unsigned char)type; b[3] = (unsigned char)ndim;
    for (i = 0; i < ndim; i++) {
        b[4 + 4 * i] = (unsigned char)(dims[i] >> 24);
        b[5 + 4 * i] = (unsigned char)(dims[i] >> 16);
        b[6 + 4 * i] = (unsigned char)(dims[i] >> 8);
        b[7 + 4 * i] = (unsigned char)dims[i];
    }
    return 4 + 4 * (size_t)ndim;
}

/* ---- stb_image_write (libstb-dev), to make image files ---- */

#if defined(TU_WANT_STBIW) && defined(__has_include)
#if __has_include(<stb/stb_image_write.h>)
#define TU_HAVE_STBIW 1
#define STB_IMAGE_WRITE_STATIC
#define STB_IMAGE_WRITE_IMPLEMENTATION
#if defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function"
#endif
#include <stb/stb_image_write.h>
#if defined(__GNUC__)
#pragma GCC diagnostic pop
#endif
#endif
#endif
#ifndef TU_HAVE_STBIW
#define TU_HAVE_STBIW 0
#endif

#endif
