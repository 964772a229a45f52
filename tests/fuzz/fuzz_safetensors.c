/* tests/fuzz/fuzz_safetensors.c: libFuzzer target for the safetensors reader (dtr_st_parse,
 * and with it the JSON reader). Any input must either parse into entries that all lie
 * inside the image and tile its data section, or fail with a message; never crash, leak
 * or read out of bounds. Linked with the implementation (lib/dtrain_impl.c, under the same
 * sanitizers):
 *     clang -g -O1 -fsanitize=fuzzer,address,undefined tests/fuzz/fuzz_safetensors.c lib/dtrain_impl.c -lm -lpthread
 *     ./a.out -max_total_time=60 tests/fuzz/corpus/safetensors */
#include "../../dtrain.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    dtr_st_file f;
    char err[512];
    uint64_t covered = 0;
    unsigned sum = 0;
    int i;
    if (dtr_st_parse(data, size, NULL, &f, err, sizeof err) != DTR_OK) {
        if (err[0] == '\0' || f.entries || f.count) __builtin_trap();   /* failures explain themselves */
        return 0;
    }
    for (i = 0; i < f.count; i++) {
        const dtr_st_entry *e = &f.entries[i];
        const uint8_t *p = (const uint8_t *)e->data;
        uint64_t k, n = e->end - e->begin;
        if (e->ndim < 0 || e->ndim > DTR_MAX_DIMS || e->begin > e->end) __builtin_trap();
        if (p < data || p + n > data + size) __builtin_trap();
        for (k = 0; k < n; k++) sum += p[k];   /* ASan checks every byte is in the image */
        covered += n;
    }
    if (f.count && covered + 8 > size) __builtin_trap();
    (void)sum;
    dtr_st_destroy(&f);
    return 0;
}
