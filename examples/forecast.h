/* examples/forecast.h: the data, model and training loop of examples/forecast.c
 * (tests/test_train.c checks that it learns with the same code).
 *
 * The series: a load-like signal, one value an hour: a daily cycle whose amplitude follows a
 * weekly one, plus an AR(1) disturbance (phi 0.8). Each step's features: the value and the hour
 * of day as a point on the circle (sin, cos); its label: the value. dtr_dataset_windows turns
 * the steps into windows of 48 hours labelled with the next hour's value; the first 80% of the
 * windows train, the last 20% (later in time) validate. The model: an LSTM over the window and
 * a linear head on its last state, MSE, Adam. The baseline to beat: persistence (the next hour
 * equals this one). */
#ifndef FORECAST_H
#define FORECAST_H
#include "dtrain.h"
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define FC_STEPS 3000
#define FC_FEATURES 3
#define FC_WINDOW 48
#define FC_HIDDEN 32
#define FC_BATCH 64

typedef struct fc_run {
    float x[FC_STEPS * FC_FEATURES], y[FC_STEPS];
    dtr_dataset *steps, *windows, *train, *valid;
    dtr_context *ctx;
    dtr_model *m;
    dtr_lstm_layer lstm;
    dtr_linear_layer head;
    dtr_optimizer *opt;
    char err[256];
} fc_run;

/* the series, seeded: value, sin and cos of the hour; label the value */
static void fc_series(fc_run *f, uint64_t seed) {
    dtr_rng rng;
    double ar = 0.0;
    int t;
    dtr_rng_seed(&rng, seed, 7);
    for (t = 0; t < FC_STEPS; t++) {
        double day = 6.283185307179586 * (t % 24) / 24.0, week = 6.283185307179586 * (t % 168) / 168.0;
        ar = 0.8 * ar + 0.1 * dtr_rng_normal(&rng);
        f->y[t] = (float)(sin(day) * (1.0 + 0.4 * sin(week)) + ar);
        f->x[t * FC_FEATURES] = f->y[t], f->x[t * FC_FEATURES + 1] = (float)sin(day), f->x[t * FC_FEATURES + 2] = (float)cos(day);
    }
}

/* the steps as a dataset, their windows, and the chronological split */
static dtr_result fc_data(fc_run *f) {
    dtr_memory_dataset_config mc = dtr_memory_dataset_config_init();
    dtr_window_config wc = dtr_window_config_init();
    int64_t n, cut, i, *idx;
    dtr_result r;
    mc.count = FC_STEPS, mc.layout.x_ndim = 1, mc.layout.x_shape[0] = FC_FEATURES, mc.layout.y_dtype = DTR_F32;
    mc.x = f->x, mc.y = f->y;
    wc.window = FC_WINDOW;   /* stride 1, horizon 1: the next hour's value */
    if ((r = dtr_dataset_from_memory(&mc, &f->steps, f->err, sizeof f->err)) != DTR_OK ||
        (r = dtr_dataset_windows(f->steps, &wc, &f->windows, f->err, sizeof f->err)) != DTR_OK)
        return r;
    n = dtr_dataset_count(f->windows), cut = n * 4 / 5;
    if (!(idx = (int64_t *)malloc((size_t)n * sizeof(int64_t)))) return DTR_OUT_OF_MEMORY;
    for (i = 0; i < n; i++) idx[i] = i;
    r = dtr_dataset_subset(f->windows, idx, cut, &f->train, f->err, sizeof f->err);
    if (r == DTR_OK) r = dtr_dataset_subset(f->windows, idx + cut, n - cut, &f->valid, f->err, sizeof f->err);
    free(idx);
    return r;
}

static dtr_result fc_init(fc_run *f, dtr_context *ctx, uint64_t seed) {
    dtr_optimizer_config oc = dtr_optimizer_config_init(DTR_OPT_ADAM, 3e-3f);
    dtr_result r;
    oc.schedule.kind = DTR_SCHED_PLATEAU;   /* halved after 2 validations without a 1% gain (reported */
    oc.schedule.gamma = 0.5f;               /* by the example; without reports the rate stays) */
    oc.schedule.step_size = 1;
    oc.schedule.threshold = 0.01f;
    f->ctx = ctx;
    fc_series(f, seed);
    if ((r = fc_data(f)) != DTR_OK) return r;
    if ((r = dtr_model_create(ctx, seed, &f->m)) != DTR_OK) return r;
    if ((r = dtr_lstm_layer_init(&f->lstm, f->m, "lstm", FC_FEATURES, FC_HIDDEN)) != DTR_OK) return r;
    if ((r = dtr_linear_layer_init(&f->head, f->m, "head", FC_HIDDEN, 1, 1, DTR_INIT_TORCH_DEFAULT)) != DTR_OK) return r;
    if ((r = dtr_model_build(f->m)) != DTR_OK) return r;
    return dtr_optimizer_create(f->m, &oc, &f->opt);
}

/* the next hour's prediction (B, 1) from a batch's windows x (B, 48, 3) */
static dtr_tensor *fc_predict(fc_run *f, dtr_tensor *x) {
    dtr_tensor *h = NULL;
    dtr_lstm_layer_forward(f->ctx, &f->lstm, x, NULL, NULL, &h, NULL);
    return h ? dtr_linear_layer_forward(f->ctx, &f->head, h) : NULL;
}

/* one pass over the training windows, shuffled (seed: the epoch) */
static dtr_result fc_epoch(fc_run *f, int epoch, float *loss) {
    dtr_loader_config lc = dtr_loader_config_init();
    dtr_loader *ld = NULL;
    dtr_batch b;
    dtr_result r;
    int64_t k;
    lc.batch_size = FC_BATCH, lc.shuffle = 1, lc.seed = (uint64_t)epoch;
    if ((r = dtr_loader_create(f->train, &lc, &ld, f->err, sizeof f->err)) != DTR_OK) return r;
    for (k = 0; r == DTR_OK && k < dtr_loader_batches(ld); k++) {
        dtr_tensor *x, *y, *l;
        if ((r = dtr_loader_next(ld, &b)) != DTR_OK || (r = dtr_batch_tensors(f->ctx, &b, &x, &y)) != DTR_OK) break;
        {
            int64_t ys[2] = {b.size, 1};
            l = dtr_mse(f->ctx, fc_predict(f, x), dtr_reshape(f->ctx, y, 2, ys));
        }
        if ((r = dtr_backward(f->ctx, l)) == DTR_OK) {
            *loss = dtr_tensor_get(l, 0);
            r = dtr_optimizer_step(f->opt, NULL);
        }
        dtr_context_reset(f->ctx);
    }
    dtr_loader_destroy(ld);
    return r;
}

/* the validation RMSE of the model and of persistence (the last value of each window) */
static dtr_result fc_validate(fc_run *f, double *rmse, double *naive) {
    int64_t n = dtr_dataset_count(f->valid), i, xs[3] = {1, FC_WINDOW, FC_FEATURES};
    float x[FC_WINDOW * FC_FEATURES], y, p;
    double se = 0.0, sn = 0.0;
    dtr_result r = DTR_OK;
    dtr_context_set_grad_enabled(f->ctx, 0);
    for (i = 0; i < n && r == DTR_OK; i++) {
        if ((r = dtr_dataset_get(f->valid, i, x, &y, f->err, sizeof f->err)) != DTR_OK) break;
        r = dtr_tensor_read(fc_predict(f, dtr_tensor_from(f->ctx, DTR_F32, 3, xs, x)), DTR_F32, &p, 1);
        se += ((double)p - y) * ((double)p - y);
        sn += ((double)x[(FC_WINDOW - 1) * FC_FEATURES] - y) * ((double)x[(FC_WINDOW - 1) * FC_FEATURES] - y);
        dtr_context_reset(f->ctx);
    }
    dtr_context_set_grad_enabled(f->ctx, 1);
    *rmse = n ? sqrt(se / (double)n) : 0.0, *naive = n ? sqrt(sn / (double)n) : 0.0;
    return r;
}

static void fc_free(fc_run *f) {
    dtr_optimizer_destroy(f->opt);
    dtr_model_destroy(f->m);
    dtr_dataset_destroy(f->valid);
    dtr_dataset_destroy(f->train);
    dtr_dataset_destroy(f->windows);
    dtr_dataset_destroy(f->steps);
}

#endif
