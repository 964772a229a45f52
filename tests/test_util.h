/* tests/test_util.h: helpers several tests share (include after test.h). Each is static
 * inline, so a test that uses only some of them builds without unused-function warnings.
 *   count_alloc / count_alloc_callbacks  an allocator that counts live blocks (leak checks)
 *                                        and fails the fail_at-th call (out-of-memory paths)
 *   write_file                           writes bytes to a file
 *   idx_header                           the header of an IDX file (MNIST format)
 *   TU_HAVE_STBIW                        1 when stb_image_write.h is there (then included,
 *                                        its functions static) */
#ifndef DTRAIN_TEST_UTIL_H
#define DTRAIN_TEST_UTIL_H
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

/* ---- a counting, failing allocator ---- */

typedef struct count_alloc { long live, calls, fail_at; } count_alloc;

static inline void *ca_malloc(size_t n, void *u) {
    count_alloc *c = (count_alloc *)u;
    if (++c->calls == c->fail_at) return NULL;
    c->live++;
    return malloc(n);
}
static inline void *ca_realloc(void *p, size_t n, void *u) {
    count_alloc *c = (count_alloc *)u;
    if (++c->calls == c->fail_at) return NULL;
    if (!p) c->live++;
    return realloc(p, n);
}
static inline void ca_free(void *p, void *u) {
    count_alloc *c = (count_alloc *)u;
    if (p) c->live--;
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
