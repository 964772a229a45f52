/* examples/forecast.c: time-series forecasting: an LSTM predicts the next hour of a load-like
 * series from the last 48.
 *
 * What it shows: one row a step (value, hour of day) turned into windows of 48 steps labelled
 * with the next step's value (dtr_dataset_windows), a chronological split (dtr_dataset_subset:
 * the last 20% of the windows validate), shuffled batches of windows (B, 48, 3) from a loader,
 * an LSTM and a linear head trained on the MSE, and the validation RMSE next to persistence's
 * (tomorrow equals today, hour by hour: the baseline a forecast must beat). The validation
 * RMSE drives the rate (a plateau schedule: halved when it stops improving) and early
 * stopping: after --patience validations without an improvement training stops, and the
 * best weights seen come back. The series, model and loop are in examples/forecast.h (the
 * test that checks it learns, tests/test_train.c, uses the same code).
 *
 * Build and run from the repository:
 *     make examples && build/examples/forecast [--epochs E] [--patience P] [--seed S] [--threads N]
 * Build by hand, with dtrain.h, common.h and forecast.h beside this file:
 *     cc -O2 -I. -DDTRAIN_IMPLEMENTATION forecast.c -o forecast -lm -lpthread
 * Prints the validation RMSE and the rate after each epoch (at most 30, stopping after 4
 * without an improvement by default) beside persistence's. */
#include "common.h"
#include "forecast.h"

/* The epochs, each validated: the RMSE reported to the optimizer (its plateau schedule), the
   best weights kept in `best`, until `patience` validations in a row bring no improvement. */
static dtr_result train(fc_run *f, long epochs, long patience, float *best, double *best_rmse) {
    int64_t n = dtr_model_numel(f->m);
    double rmse = 0.0, naive = 0.0, t0 = fm_now();
    dtr_metric_stats st;
    float loss = 0.0f, lr;
    dtr_result r = DTR_OK;
    long e;
    for (e = 1; e <= epochs && r == DTR_OK; e++) {
        lr = dtr_optimizer_lr(f->opt);
        if ((r = fc_epoch(f, (int)e, &loss)) != DTR_OK || (r = fc_validate(f, &rmse, &naive)) != DTR_OK) break;
        if ((r = dtr_optimizer_report_metric(f->opt, rmse, &st)) != DTR_OK) break;
        if (st.improved) memcpy(best, dtr_model_params(f->m), (size_t)n * sizeof(float)), *best_rmse = rmse;
        printf("epoch %ld: lr %.2g, train loss %.4f, validation RMSE %.4f%s (persistence %.4f), %.1f s\n", e, (double)lr,
               (double)loss, rmse, st.improved ? " *" : "", naive, fm_now() - t0);
        if (st.stale >= patience) {
            printf("no improvement in %ld validations: stopped\n", patience);
            break;
        }
    }
    return r;
}

int main(int argc, char **argv) {
    dtr_context_config cfg = dtr_context_config_init();
    dtr_context *ctx = NULL;
    fc_run *f = (fc_run *)calloc(1, sizeof(fc_run));
    long epochs = 30, patience = 4, seed = 1, threads = 1;
    double best_rmse = 0.0, rmse = 0.0, naive = 1.0;
    float *best = NULL;
    int i, rc = 1;
    for (i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--epochs")) epochs = strtol(argv[i + 1], NULL, 10);
        else if (!strcmp(argv[i], "--patience")) patience = strtol(argv[i + 1], NULL, 10);
        else if (!strcmp(argv[i], "--seed")) seed = strtol(argv[i + 1], NULL, 10);
        else if (!strcmp(argv[i], "--threads")) threads = strtol(argv[i + 1], NULL, 10);
        else break;
    }
    if (!f || i != argc || epochs < 1 || patience < 1 || seed < 0 || threads < 1) {
        fprintf(stderr, "usage: %s [--epochs E] [--patience P] [--seed S] [--threads N]\n", argv[0]);
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
    if (!(best = (float *)malloc((size_t)dtr_model_numel(f->m) * sizeof(float))) ||
        train(f, epochs, patience, best, &best_rmse) != DTR_OK)
        goto done;
    memcpy(dtr_model_params(f->m), best, (size_t)dtr_model_numel(f->m) * sizeof(float));   /* the best weights back */
    if (fc_validate(f, &rmse, &naive) != DTR_OK) goto done;
    printf("the best weights back (epoch RMSE %.4f): validation RMSE %.4f, %.2f of persistence's\n", best_rmse, rmse,
           rmse / naive);
    rc = 0;
done:
    if (rc) fprintf(stderr, "error: %s%s%s\n", best ? dtr_context_last_error(ctx) : "out of memory", f->err[0] ? " / " : "", f->err);
    fc_free(f);
    free(f);
    free(best);
    dtr_context_destroy(ctx);
    return rc;
}
