/* ============================================================================
 * Allocation through the application's callbacks, and small error helpers.
 * ==========================================================================*/
#include "../public/api.h"
#include "internal.h"
#include <math.h>
#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#if !defined(MADV_DONTNEED) && !defined(__alpha__)
/* glibc declares madvise only for _DEFAULT_SOURCE; the value is Linux's on every architecture
   but alpha */
int madvise(void *addr, size_t len, int advice);
#define MADV_DONTNEED 4
#endif
#endif

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

void dtr__mem_discard(const dtr_allocation_callbacks *a, float *p, int64_t n, float fill) {
    char *b = (char *)p, *e = (char *)(p + (n > 0 ? n : 0)), *lo = b, *hi = b;
#if defined(__linux__) && defined(MADV_DONTNEED)
    long page = sysconf(_SC_PAGESIZE);
    if (page > 0 && !(a && a->malloc_fn)) {
        lo = (char *)(((uintptr_t)b + (uintptr_t)page - 1) / (uintptr_t)page * (uintptr_t)page);
        hi = (char *)((uintptr_t)e / (uintptr_t)page * (uintptr_t)page);
        if (hi <= lo || madvise(lo, (size_t)(hi - lo), MADV_DONTNEED) != 0) lo = hi = b;
    }
#endif
    for (; b < lo && b < e; b += sizeof(float)) *(float *)b = fill;
    for (b = hi > lo ? hi : b; b < e; b += sizeof(float)) *(float *)b = fill;
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
