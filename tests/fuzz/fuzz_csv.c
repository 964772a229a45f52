/* tests/fuzz/fuzz_csv.c: libFuzzer target for the CSV reader (dtr_dataset_csv_from_buffer).
 * The first byte picks the options (delimiter, header mode, label kind and column), the
 * rest is the CSV text (so the files of tests/fuzz/corpus/csv/ are one option byte followed
 * by a CSV file). Any input must either give a dataset whose every sample reads back
 * (finite features, class labels inside 0..num_classes-1, class names present) or fail with
 * a message; never crash, leak, hang or read out of bounds. Linked with the implementation
 * (lib/dtrain_impl.c, under the same sanitizers):
 *     clang -g -O1 -fsanitize=fuzzer,address,undefined tests/fuzz/fuzz_csv.c lib/dtrain_impl.c -lm -lpthread
 *     ./a.out -max_total_time=60 tests/fuzz/corpus/csv */
#include "../../dtrain.h"
#include <math.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static const char delims[4] = {',', ';', '\t', '|'};
    dtr_csv_config c = dtr_csv_config_init();
    dtr_dataset *ds = NULL;
    const dtr_sample_layout *L;
    char err[512];
    float x[4096];
    union { int32_t i; float f; } y;
    uint8_t opt = size ? data[0] : 0;
    int64_t i, k, nx;
    if (size) { data++; size--; }
    c.delimiter = delims[opt & 3];
    c.header = (int)((opt >> 2) % 3) - 1;            /* -1, 0, 1 */
    c.label_kind = (dtr_label_kind)((opt >> 4) % 3); /* class, regression, none */
    c.label_column = (opt & 0x40) ? 0 : -1;
    if (opt & 0x80) c.label_name = "label";
    if (dtr_dataset_csv_from_buffer(data, size, &c, &ds, err, sizeof err) != DTR_OK) {
        if (err[0] == '\0' || ds) __builtin_trap();   /* failures explain themselves */
        return 0;
    }
    L = dtr_dataset_layout(ds);
    nx = dtr_sample_layout_x_numel(L);
    if (nx < 1 || dtr_dataset_count(ds) < 1) __builtin_trap();
    if (nx <= (int64_t)(sizeof x / sizeof x[0])) {
        for (i = 0; i < dtr_dataset_count(ds); i++) {
            if (dtr_dataset_get(ds, i, x, &y, err, sizeof err) != DTR_OK) __builtin_trap();
            for (k = 0; k < nx; k++)
                if (!isfinite(x[k])) __builtin_trap();
            if (!L->unlabeled && L->y_dtype == DTR_I32 && (y.i < 0 || y.i >= L->num_classes)) __builtin_trap();
        }
    }
    if (dtr_dataset_class_name(ds, 0))   /* text labels: a name for every class */
        for (k = 0; k < L->num_classes; k++)
            if (dtr_dataset_class_name(ds, (int)k) == NULL) __builtin_trap();
    dtr_dataset_destroy(ds);
    return 0;
}
