/* ============================================================================
 * Allocation through the application's callbacks, and small error helpers.
 * ==========================================================================*/
#include "../public/api.h"
#include "internal.h"

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

dtr_result dtr__errf(char *err, size_t errlen, dtr_result code, const char *fmt, ...) {
    if (err && errlen) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, errlen, fmt, ap);
        va_end(ap);
    }
    return code;
}
