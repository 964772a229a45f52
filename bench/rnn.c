/* bench/rnn.c: training speed of an LSTM and a GRU over sequences (dtr_lstm_layer,
 * dtr_gru_layer), as JSON lines ("impl":"dtrain"; bench/rnn_torch.py prints the same lines for
 * PyTorch's nn.LSTM / nn.GRU). A step: the layer over x (B, T, I) from a zero state, a linear
 * readout of the last step's state, MSE against a target, backward, Adam. Random data
 * (seed 1); the best of --repeat timings of --steps steps each, after one warm-up step.
 * Prints per cell: ms_per_step, sequences_per_s, and the last loss.
 * Usage: rnn [--cell lstm|gru|all] [--batch B] [--seq T] [--input I] [--hidden H]
 *            [--threads N] [--steps S] [--repeat R]
 * Build: make bench. */
#define _POSIX_C_SOURCE 200809L
#include "../dtrain.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

typedef struct opts { const char *cell; int64_t batch, seq, input, hidden; int threads, steps, repeat; } opts;

typedef struct rnn_net { dtr_model *m; dtr_lstm_layer lstm; dtr_gru_layer gru; dtr_linear_layer out; int is_lstm; } rnn_net;

/* one training step; the loss into *loss */
static dtr_result rnn_step(dtr_context *ctx, rnn_net *n, dtr_optimizer *opt, const opts *o, const float *x, const float *y,
                           float *loss) {
    int64_t xs[3] = {o->batch, o->seq, o->input}, ys[2] = {o->batch, 1};
    dtr_tensor *h = NULL, *l;
    dtr_tensor *xt = dtr_tensor_from(ctx, DTR_F32, 3, xs, x);
    dtr_result r;
    if (n->is_lstm) dtr_lstm_layer_forward(ctx, &n->lstm, xt, NULL, NULL, &h, NULL);
    else dtr_gru_layer_forward(ctx, &n->gru, xt, NULL, &h);
    l = dtr_mse(ctx, dtr_linear_layer_forward(ctx, &n->out, h), dtr_tensor_from(ctx, DTR_F32, 2, ys, y));
    if ((r = dtr_backward(ctx, l)) == DTR_OK) {
        *loss = dtr_tensor_get(l, 0);
        r = dtr_optimizer_step(opt, NULL);
    }
    dtr_context_reset(ctx);
    return r;
}

static int run_cell(const opts *o, int is_lstm) {
    dtr_context_config cc = dtr_context_config_init();
    dtr_optimizer_config oc = dtr_optimizer_config_init(DTR_OPT_ADAM, 1e-3f);
    dtr_context *ctx = NULL;
    dtr_optimizer *opt = NULL;
    rnn_net n;
    dtr_rng rng;
    int64_t nx = o->batch * o->seq * o->input, i;
    float *x = (float *)malloc((size_t)nx * sizeof(float)), *y = (float *)malloc((size_t)o->batch * sizeof(float)), loss = 0;
    double best = 1e30;
    int rep, s, ok;
    memset(&n, 0, sizeof n);
    n.is_lstm = is_lstm;
    cc.threads = o->threads;
    dtr_rng_seed(&rng, 1, 0);
    for (i = 0; i < nx; i++) x[i] = dtr_rng_uniform(&rng) * 2 - 1;
    for (i = 0; i < o->batch; i++) y[i] = dtr_rng_uniform(&rng);
    ok = x && y && dtr_context_create(&cc, &ctx) == DTR_OK && dtr_model_create(ctx, 1, &n.m) == DTR_OK &&
         (is_lstm ? dtr_lstm_layer_init(&n.lstm, n.m, "rnn", o->input, o->hidden) : dtr_gru_layer_init(&n.gru, n.m, "rnn", o->input, o->hidden)) ==
             DTR_OK &&
         dtr_linear_layer_init(&n.out, n.m, "out", o->hidden, 1, 1, DTR_INIT_TORCH_DEFAULT) == DTR_OK &&
         dtr_optimizer_create(n.m, &oc, &opt) == DTR_OK && rnn_step(ctx, &n, opt, o, x, y, &loss) == DTR_OK;
    for (rep = 0; ok && rep < o->repeat; rep++) {
        double t0 = now_s();
        for (s = 0; ok && s < o->steps; s++) ok = rnn_step(ctx, &n, opt, o, x, y, &loss) == DTR_OK;
        if (now_s() - t0 < best) best = now_s() - t0;
    }
    if (ok)
        printf("{\"bench\":\"rnn\",\"impl\":\"dtrain\",\"cell\":\"%s\",\"batch\":%lld,\"seq\":%lld,\"input\":%lld,\"hidden\":%lld,"
               "\"threads\":%d,\"ms_per_step\":%.3f,\"sequences_per_s\":%.1f,\"loss\":%.5f}\n",
               is_lstm ? "lstm" : "gru", (long long)o->batch, (long long)o->seq, (long long)o->input, (long long)o->hidden,
               dtr_context_threads(ctx), 1e3 * best / o->steps, (double)o->batch * o->steps / best, (double)loss);
    else fprintf(stderr, "rnn: %s\n", ctx ? dtr_context_last_error(ctx) : "no context");
    dtr_optimizer_destroy(opt);
    dtr_model_destroy(n.m);
    dtr_context_destroy(ctx);
    free(x);
    free(y);
    return ok;
}

static int parse(int argc, char **argv, opts *o) {
    int i;
    for (i = 1; i + 1 < argc; i += 2) {
        const char *a = argv[i], *v = argv[i + 1];
        if (!strcmp(a, "--cell")) o->cell = v;
        else if (!strcmp(a, "--batch")) o->batch = atoll(v);
        else if (!strcmp(a, "--seq")) o->seq = atoll(v);
        else if (!strcmp(a, "--input")) o->input = atoll(v);
        else if (!strcmp(a, "--hidden")) o->hidden = atoll(v);
        else if (!strcmp(a, "--threads")) o->threads = atoi(v);
        else if (!strcmp(a, "--steps")) o->steps = atoi(v);
        else if (!strcmp(a, "--repeat")) o->repeat = atoi(v);
        else return 0;
    }
    return i == argc && o->batch > 0 && o->seq > 0 && o->input > 0 && o->hidden > 0 && o->steps > 0 && o->repeat > 0;
}

int main(int argc, char **argv) {
    opts o = {"all", 32, 64, 32, 128, 0, 10, 3};
    int ok = 1;
    if (!parse(argc, argv, &o)) {
        fprintf(stderr, "usage: rnn [--cell lstm|gru|all] [--batch B] [--seq T] [--input I] [--hidden H] [--threads N] "
                        "[--steps S] [--repeat R]\n");
        return 2;
    }
    if (strcmp(o.cell, "gru") != 0) ok &= run_cell(&o, 1);
    if (strcmp(o.cell, "lstm") != 0) ok &= run_cell(&o, 0);
    return ok ? 0 : 1;
}
