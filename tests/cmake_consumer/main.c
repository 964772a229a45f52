/* tests/cmake_consumer/main.c: a consumer of the installed or embedded library (not the
 * single header with DTRAIN_IMPLEMENTATION): checks that header and library agree on the
 * version and multiplies two small matrices. Exit status 0 on success. */
#include <dtrain.h>

#include <math.h>
#include <stdio.h>

int main(void) {
    const float a[2 * 3] = {1, 2, 3, 4, 5, 6};
    const float b[3 * 2] = {7, 8, 9, 10, 11, 12};
    const float want[2 * 2] = {58, 64, 139, 154};
    const int64_t ashape[2] = {2, 3}, bshape[2] = {3, 2};
    float got[4];
    dtr_context *ctx = NULL;
    dtr_tensor *c;
    int i, ok = 1;

    if (dtr_version() != DTR_VERSION_NUMBER) {
        fprintf(stderr, "consumer: header %s but library %s\n", DTR_VERSION_STRING, dtr_version_string());
        return 1;
    }
    if (dtr_context_create(NULL, &ctx) != DTR_OK) {
        fprintf(stderr, "consumer: dtr_context_create failed\n");
        return 1;
    }
    c = dtr_matmul(ctx, dtr_tensor_from(ctx, DTR_F32, 2, ashape, a), dtr_tensor_from(ctx, DTR_F32, 2, bshape, b));
    if (!c || dtr_tensor_read(c, DTR_F32, got, 4) != DTR_OK) {
        fprintf(stderr, "consumer: matmul failed: %s\n", dtr_context_last_error(ctx));
        ok = 0;
    } else {
        for (i = 0; i < 4; i++) ok &= fabsf(got[i] - want[i]) < 1e-4f;
    }
    printf("consumer: dtrain %s (%s backend): matmul %s\n", dtr_version_string(),
           dtr_context_backend_name(ctx), ok ? "ok" : "WRONG");
    dtr_context_destroy(ctx);
    return ok ? 0 : 1;
}
