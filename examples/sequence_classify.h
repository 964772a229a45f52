/* examples/sequence_classify.h: the data, model and training loop of
 * examples/sequence_classify.c (tests/test_train.c checks that it learns with the same code).
 *
 * The task: a noisy waveform of 8 to 40 samples (a sensor trace, a price series: sequences of
 * different lengths in one batch) is a sine, a square wave, a sawtooth or a triangle of random
 * frequency, phase and amplitude; say which. The model: a bidirectional GRU (one layer each
 * way, dtr_rnn_config with each row's length, one of them reversed) whose last states, side by
 * side, feed a linear head; cross-entropy, Adam. */
#ifndef SEQUENCE_CLASSIFY_H
#define SEQUENCE_CLASSIFY_H
#include "dtrain.h"
#include <math.h>
#include <string.h>

#define SC_CLASSES 4
#define SC_MAX_T 40
#define SC_MIN_T 8
#define SC_BATCH 32
#define SC_HIDDEN 24

typedef struct sc_batch {
    float x[SC_BATCH * SC_MAX_T];   /* (B, T, 1), zero past each row's length */
    int32_t len[SC_BATCH], y[SC_BATCH];
} sc_batch;

typedef struct sc_model {
    dtr_context *ctx;
    dtr_model *m;
    dtr_gru_layer fwd, rev;
    dtr_linear_layer head;
    dtr_optimizer *opt;
} sc_model;

/* waveform `cls` at phase u (in cycles), in [-1, 1] */
static float sc_wave(int cls, double u) {
    double f = u - floor(u + 0.5);   /* [-0.5, 0.5) */
    if (cls == 0) return (float)sin(6.283185307179586 * u);
    if (cls == 1) return sin(6.283185307179586 * u) >= 0.0 ? 1.0f : -1.0f;
    if (cls == 2) return (float)(2.0 * f);
    return (float)(2.0 * fabs(2.0 * f) - 1.0);
}

/* a batch of random waveforms (noise 0.1) */
static void sc_batch_make(sc_batch *b, dtr_rng *rng) {
    int i, t;
    memset(b->x, 0, sizeof b->x);
    for (i = 0; i < SC_BATCH; i++) {
        double freq = 0.05 + 0.15 * dtr_rng_uniform(rng), phase = dtr_rng_uniform(rng), amp = 0.5 + dtr_rng_uniform(rng);
        b->y[i] = (int32_t)(dtr_rng_u32(rng) % SC_CLASSES);
        b->len[i] = SC_MIN_T + (int32_t)(dtr_rng_u32(rng) % (SC_MAX_T - SC_MIN_T + 1));
        for (t = 0; t < b->len[i]; t++)
            b->x[i * SC_MAX_T + t] = (float)amp * sc_wave(b->y[i], freq * t + phase) + 0.1f * dtr_rng_normal(rng);
    }
}

static dtr_result sc_init(sc_model *s, dtr_context *ctx, float lr, uint64_t seed) {
    dtr_optimizer_config oc = dtr_optimizer_config_init(DTR_OPT_ADAM, lr);
    dtr_result r;
    memset(s, 0, sizeof *s);
    s->ctx = ctx;
    if ((r = dtr_model_create(ctx, seed, &s->m)) != DTR_OK) return r;
    if ((r = dtr_gru_layer_init(&s->fwd, s->m, "gru", 1, SC_HIDDEN)) != DTR_OK) return r;
    if ((r = dtr_gru_layer_init(&s->rev, s->m, "gru_reverse", 1, SC_HIDDEN)) != DTR_OK) return r;
    if ((r = dtr_linear_layer_init(&s->head, s->m, "head", 2 * SC_HIDDEN, SC_CLASSES, 1, DTR_INIT_TORCH_DEFAULT)) != DTR_OK) return r;
    if ((r = dtr_model_build(s->m)) != DTR_OK) return r;
    return dtr_optimizer_create(s->m, &oc, &s->opt);
}

/* the logits (B, 4): each direction's state after the row's last real step, side by side */
static dtr_tensor *sc_logits(sc_model *s, const sc_batch *b) {
    int64_t xs[3] = {SC_BATCH, SC_MAX_T, 1};
    dtr_rnn_config rc = dtr_rnn_config_init();
    dtr_tensor *x = dtr_tensor_from(s->ctx, DTR_F32, 3, xs, b->x), *h[2] = {NULL, NULL};
    rc.lengths = b->len;
    dtr_gru_layer_forward_ex(s->ctx, &s->fwd, x, NULL, &rc, &h[0]);
    rc.reverse = 1;
    dtr_gru_layer_forward_ex(s->ctx, &s->rev, x, NULL, &rc, &h[1]);
    return h[0] && h[1] ? dtr_linear_layer_forward(s->ctx, &s->head, dtr_concat(s->ctx, h, 2, 1)) : NULL;
}

/* `steps` Adam steps on fresh batches; the last loss in *loss */
static dtr_result sc_train(sc_model *s, dtr_rng *rng, int steps, float *loss) {
    int64_t ys = SC_BATCH;
    sc_batch b;
    dtr_result r = DTR_OK;
    int i;
    for (i = 0; i < steps && r == DTR_OK; i++) {
        dtr_tensor *l;
        sc_batch_make(&b, rng);
        l = dtr_cross_entropy(s->ctx, sc_logits(s, &b), dtr_tensor_from(s->ctx, DTR_I32, 1, &ys, b.y));
        if ((r = dtr_backward(s->ctx, l)) == DTR_OK) {
            *loss = dtr_tensor_get(l, 0);
            r = dtr_optimizer_step(s->opt, NULL);
        }
        dtr_context_reset(s->ctx);
    }
    return r;
}

/* the fraction of `batches` fresh batches' waveforms classified right (-1 on an error) */
static double sc_accuracy(sc_model *s, dtr_rng *rng, int batches) {
    float logits[SC_BATCH * SC_CLASSES];
    sc_batch b;
    int i, k, c, right = 0;
    dtr_context_set_grad_enabled(s->ctx, 0);
    for (i = 0; i < batches; i++) {
        sc_batch_make(&b, rng);
        if (dtr_tensor_read(sc_logits(s, &b), DTR_F32, logits, SC_BATCH * SC_CLASSES) != DTR_OK) right = -SC_BATCH * batches;
        for (k = 0; k < SC_BATCH; k++) {
            int best = 0;
            for (c = 1; c < SC_CLASSES; c++)
                if (logits[k * SC_CLASSES + c] > logits[k * SC_CLASSES + best]) best = c;
            right += best == b.y[k];
        }
        dtr_context_reset(s->ctx);
    }
    dtr_context_set_grad_enabled(s->ctx, 1);
    return right < 0 ? -1.0 : (double)right / (double)(SC_BATCH * batches);
}

static void sc_free(sc_model *s) {
    dtr_optimizer_destroy(s->opt);
    dtr_model_destroy(s->m);
}

#endif
