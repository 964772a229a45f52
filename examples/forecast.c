/* examples/forecast.c: time-series forecasting: an LSTM predicts the next hour of a load-like
 * series from the last 48.
 *
 * What it shows: one row a step (value, hour of day) turned into windows of 48 steps labelled
 * with the next step's value (dtr_dataset_windows), a chronological split (dtr_dataset_subset:
 * the last 20% of the windows validate), shuffled batches of windows (B, 48, 3) from a loader,
 * an LSTM and a linear head trained on the MSE, and the validation RMSE next to persistence's
 * (tomorrow equals today, hour by hour: the baseline a forecast must beat). The series, model
 * and loop are in examples/forecast.h (the test that checks it learns, tests/test_train.c,
 * uses the same code).
 *
 * Build and run from the repository:
 *     make examples && build/examples/forecast [--epochs E] [--seed S] [--threads N]
 * Build by hand, with dtrain.h, common.h and forecast.h beside this file:
 *     cc -O2 -I. -DDTRAIN_IMPLEMENTATION forecast.c -o forecast -lm -lpthread
 * Prints the validation RMSE after each epoch (default 6) beside persistence's. */
#include "common.h"
#include "forecast.h"

int main(int argc, char **argv) {
    dtr_context_config cfg = dtr_context_config_init();
    dtr_context *ctx = NULL;
    fc_run *f = (fc_run *)calloc(1, sizeof(fc_run));
    long epochs = 6, seed = 1, threads = 1;
    double rmse = 0.0, naive = 0.0, t0;
    float loss = 0.0f;
    int i, e, rc = 1;
    for (i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--epochs")) epochs = strtol(argv[i + 1], NULL, 10);
        else if (!strcmp(argv[i], "--seed")) seed = strtol(argv[i + 1], NULL, 10);
        else if (!strcmp(argv[i], "--threads")) threads = strtol(argv[i + 1], NULL, 10);
        else break;
    }
    if (!f || i != argc || epochs < 1 || seed < 0 || threads < 1) {
        fprintf(stderr, "usage: %s [--epochs E] [--seed S] [--threads N]\n", argv[0]);
        free(f);
        return 2;
    }
    cfg.threads = (int)threads;
    if (dtr_context_create(&cfg, &ctx) != DTR_OK) {
        fprintf(stderr, "context: %s\n", dtr_context_create_error());
        free(f);
        return 1;
    }
    if (fc_init(f, ctx, (uint64_t)seed) != DTR_OK) goto done;
    printf("%lld training windows of %d hours, %lld validation windows\n", (long long)dtr_dataset_count(f->train), FC_WINDOW,
           (long long)dtr_dataset_count(f->valid));
    t0 = fm_now();
    for (e = 1; e <= epochs; e++) {
        if (fc_epoch(f, e, &loss) != DTR_OK || fc_validate(f, &rmse, &naive) != DTR_OK) goto done;
        printf("epoch %ld: train loss %.4f, validation RMSE %.4f (persistence %.4f), %.1f s\n", (long)e, (double)loss, rmse, naive,
               fm_now() - t0);
    }
    rc = 0;
done:
    if (rc) fprintf(stderr, "error: %s%s%s\n", dtr_context_last_error(ctx), f->err[0] ? " / " : "", f->err);
    fc_free(f);
    free(f);
    dtr_context_destroy(ctx);
    return rc;
}
