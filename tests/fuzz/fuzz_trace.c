/* tests/fuzz/fuzz_trace.c: libFuzzer target for the timeline merge (dtr_trace_merge), which
 * reads each rank's trace file with the JSON reader and copies its "traceEvents" elements.
 * The input is one trace file. Either the merge fails with a message (nothing left at the
 * output path) or its output merges again to the same bytes (a merged file is itself a
 * valid input, and a fixed point). Never crash, leak, hang or read out of bounds.
 *     clang -g -O1 -fsanitize=fuzzer,address,undefined tests/fuzz/fuzz_trace.c lib/dtrain_impl.c -lm -lpthread
 *     ./a.out -max_total_time=60 tests/fuzz/corpus/trace */
#define _POSIX_C_SOURCE 200809L
#include "../../dtrain.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* the whole file (malloc'd, *n bytes), or NULL */
static char *slurp(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    char *buf = NULL;
    long len;
    if (f && fseek(f, 0, SEEK_END) == 0 && (len = ftell(f)) >= 0 && fseek(f, 0, SEEK_SET) == 0 &&
        (buf = (char *)malloc((size_t)len + 1)) && fread(buf, 1, (size_t)len, f) == (size_t)len)
        *n = (size_t)len;
    else
        free(buf), buf = NULL;
    if (f) fclose(f);
    return buf;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char in[64], out[64], again[64], err[512];
    const char *p[1];
    char *a, *b;
    size_t na = 0, nb = 0;
    FILE *f;
    snprintf(in, sizeof in, "/tmp/fuzz_trace_%ld.in", (long)getpid());
    snprintf(out, sizeof out, "/tmp/fuzz_trace_%ld.out", (long)getpid());
    snprintf(again, sizeof again, "/tmp/fuzz_trace_%ld.again", (long)getpid());
    if (!(f = fopen(in, "wb"))) return 0;
    if (fwrite(data, 1, size, f) != size) { fclose(f); return 0; }
    fclose(f);
    p[0] = in;
    remove(out);
    if (dtr_trace_merge(p, 1, out, err, sizeof err) != DTR_OK) {
        if (err[0] == '\0' || access(out, F_OK) == 0) __builtin_trap();   /* failures explain themselves */
        return 0;
    }
    p[0] = out;
    if (dtr_trace_merge(p, 1, again, err, sizeof err) != DTR_OK) __builtin_trap();
    a = slurp(out, &na);
    b = slurp(again, &nb);
    if (!a || !b || na != nb || memcmp(a, b, na) != 0) __builtin_trap();
    free(a);
    free(b);
    return 0;
}
