/* tests/header_only/app.c: an application built from dtrain.h alone, the way a user would:
 *
 *     cc tests/header_only/app.c -o app -lm -lpthread && ./app
 *
 * It fits a linear model y = x w^T + b (4 inputs, 1 output) to data made from known weights
 * with plain SGD and checks that the loss goes down. Exit status 0 on success, 1 otherwise.
 * `make header-only` builds and runs it. */
#define DTRAIN_IMPLEMENTATION
#include "../../dtrain.h"

#include <stdio.h>

#define N_IN 4
#define BATCH 32
#define STEPS 50

static int fail(dtr_context *ctx, const char *what) {
    fprintf(stderr, "header_only app: %s failed: %s\n", what, ctx ? dtr_context_last_error(ctx) : "");
    return 1;
}

int main(void) {
    static const float true_w[N_IN] = {0.5f, -1.0f, 2.0f, 0.25f};
    const float true_b = 0.3f;
    float x[BATCH * N_IN], y[BATCH];
    int64_t xshape[2] = {BATCH, N_IN}, yshape[2] = {BATCH, 1};
    dtr_context_config cfg = dtr_context_config_init();
    dtr_context *ctx = NULL;
    dtr_model *model = NULL;
    dtr_optimizer *opt = NULL;
    dtr_linear_layer layer;
    dtr_optimizer_config ocfg;
    dtr_rng rng;
    float first = -1.0f, last = -1.0f;
    int i, j, step, rc = 1;

    cfg.threads = 2;
    if (dtr_context_create(&cfg, &ctx) != DTR_OK) return fail(NULL, "dtr_context_create");
    if (dtr_model_create(ctx, 42, &model) != DTR_OK) { rc = fail(ctx, "dtr_model_create"); goto done; }
    if (dtr_linear_layer_init(&layer, model, "fc", N_IN, 1, 1, DTR_INIT_TORCH_DEFAULT) != DTR_OK ||
        dtr_model_build(model) != DTR_OK) {
        rc = fail(ctx, "building the model");
        goto done;
    }
    ocfg = dtr_optimizer_config_init(DTR_OPT_SGD, 0.1f);
    if (dtr_optimizer_create(model, &ocfg, &opt) != DTR_OK) { rc = fail(ctx, "dtr_optimizer_create"); goto done; }

    dtr_rng_seed(&rng, 7, 0);
    for (i = 0; i < BATCH; i++) {
        y[i] = true_b;
        for (j = 0; j < N_IN; j++) {
            x[i * N_IN + j] = dtr_rng_normal(&rng);
            y[i] += true_w[j] * x[i * N_IN + j];
        }
    }

    for (step = 0; step < STEPS; step++) {
        dtr_tensor *xt = dtr_tensor_from(ctx, DTR_F32, 2, xshape, x);
        dtr_tensor *yt = dtr_tensor_from(ctx, DTR_F32, 2, yshape, y);
        dtr_tensor *loss = dtr_mse(ctx, dtr_linear_layer_forward(ctx, &layer, xt), yt);
        if (dtr_context_status(ctx) != DTR_OK || !loss) { rc = fail(ctx, "the forward pass"); goto done; }
        last = dtr_tensor_get(loss, 0);
        if (step == 0) first = last;
        if (dtr_backward(ctx, loss) != DTR_OK) { rc = fail(ctx, "dtr_backward"); goto done; }
        if (dtr_optimizer_step(opt, NULL) != DTR_OK) { rc = fail(ctx, "dtr_optimizer_step"); goto done; }
        if (dtr_context_reset(ctx) != DTR_OK) { rc = fail(ctx, "dtr_context_reset"); goto done; }
    }

    printf("header_only app: dtrain %s, loss %.6f -> %.6f after %d SGD steps\n",
           dtr_version_string(), first, last, STEPS);
    if (!(first > 0.0f) || !(last < 0.1f * first)) {
        fprintf(stderr, "header_only app: the loss did not go down enough\n");
        rc = 1;
    } else {
        rc = 0;
    }
done:
    if (opt) dtr_optimizer_destroy(opt);
    dtr_model_destroy(model);
    dtr_context_destroy(ctx);
    return rc;
}
