/* tests/fuzz/fuzz_idx.c: libFuzzer target for the IDX reader (dtr_idx_parse). Any input
 * must either parse into numel converted elements or fail with a message; never crash,
 * leak or read out of bounds. Linked with the implementation (lib/dtrain_impl.c, under the same
 * sanitizers):
 *     clang -g -O1 -fsanitize=fuzzer,address,undefined tests/fuzz/fuzz_idx.c lib/dtrain_impl.c -lm -lpthread
 *     ./a.out -max_total_time=60 tests/fuzz/corpus/idx */
#include "../../dtrain.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    dtr_idx x;
    char err[512];
    int64_t i, numel = 1;
    size_t es;
    unsigned sum = 0;
    if (dtr_idx_parse(data, size, NULL, &x, err, sizeof err) != DTR_OK) {
        if (err[0] == '\0' || x.data) __builtin_trap();   /* failures explain themselves */
        return 0;
    }
    for (i = 0; i < x.ndim; i++) numel *= x.dims[i];
    if (x.ndim < 1 || x.ndim > DTR_MAX_DIMS || numel != x.numel || !x.data) __builtin_trap();
    es = dtr_dtype_size(x.dtype);
    for (i = 0; i < x.numel * (int64_t)es; i++) sum += ((const unsigned char *)x.data)[i];   /* ASan: in bounds */
    (void)sum;
    dtr_idx_destroy(&x);
    return 0;
}
