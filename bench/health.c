/* bench/health.c: what numeric health costs.
 *
 *   build/bench/health [--quick]
 *
 *   nonfinite_check  dtr_optimizer_step (SGD, no momentum, no clipping) over a gradient of
 *                    `numel` floats with the default check (DTR_NONFINITE_SKIP: one sum of
 *                    squares over the gradient) and without it (DTR_NONFINITE_OFF)
 *                    and a whole training step (forward, backward, SGD step) of the
 *                    Fashion-MNIST MLP of examples/common.h (784-256-128-10, batch 64, one
 *                    thread, random data) with and without the check
 *   anomaly          the same training step with anomaly mode off and on
 *
 * Output: JSON lines on stdout, e.g.
 *   {"bench":"nonfinite_check","numel":4194304,"policy":"off","step_ms":2.1}
 *   {"bench":"nonfinite_check","numel":4194304,"policy":"skip","step_ms":2.9,"overhead":0.38}
 *   {"bench":"anomaly","model":"mlp","batch":64,"anomaly":true,"step_ms":2.4,"overhead":0.2}
 * Each figure is the median of the repetitions. --quick shrinks everything (a smoke run). */
#include "../examples/common.h"

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return v[n / 2];
}

/* the median ms of `reps` optimizer steps over a model of numel floats under `policy` */
static double step_ms(int64_t numel, dtr_nonfinite_policy policy, int reps) {
    dtr_context *ctx = NULL;
    dtr_model *m = NULL;
    dtr_optimizer *opt = NULL;
    dtr_optimizer_config oc = dtr_optimizer_config_init(DTR_OPT_SGD, 1e-3f);
    dtr_context_config cc = dtr_context_config_init();
    double t[64], ms = -1;
    int i;
    cc.threads = 1;
    oc.nonfinite = policy;
    if (dtr_context_create(&cc, &ctx) != DTR_OK || dtr_model_create(ctx, 1, &m) != DTR_OK ||
        !dtr_model_param(m, "w", 1, &numel, DTR_INIT_ZEROS, 0) || dtr_model_build(m) != DTR_OK ||
        dtr_optimizer_create(m, &oc, &opt) != DTR_OK)
        goto done;
    for (i = 0; i < reps && i < 64; i++) {
        double t0;
        memset(dtr_model_grads(m), 0, (size_t)numel * sizeof(float));   /* as a backward would */
        t0 = fm_now();
        if (dtr_optimizer_step(opt, NULL) != DTR_OK) goto done;
        t[i] = (fm_now() - t0) * 1e3;
    }
    ms = median(t, i);
done:
    dtr_optimizer_destroy(opt);
    dtr_model_destroy(m);
    dtr_context_destroy(ctx);
    return ms;
}

/* the median ms of a training step of the MLP with anomaly mode `on` and the optimizer's policy */
static double mlp_step_ms(int on, dtr_nonfinite_policy policy, int reps) {
    dtr_optimizer_config oc = fm_sgd_config(0.01f, 0.9f, 0);
    dtr_context_config cc = dtr_context_config_init();
    dtr_context *ctx = NULL;
    dtr_optimizer *opt = NULL;
    fm_net net;
    static float x[64 * FM_PIXELS];
    int32_t y[64];
    int64_t xs[2] = {64, FM_PIXELS}, ys[1] = {64};
    double t[64], ms = -1;
    dtr_rng rng;
    int i;
    dtr_rng_seed(&rng, 3, 0);
    memset(&net, 0, sizeof net);
    for (i = 0; i < 64 * FM_PIXELS; i++) x[i] = dtr_rng_normal(&rng);
    for (i = 0; i < 64; i++) y[i] = i % FM_CLASSES;
    cc.threads = 1;
    if (dtr_context_create(&cc, &ctx) != DTR_OK || fm_net_init(&net, ctx, FM_MLP, DTR_INIT_KAIMING_UNIFORM, 1) != DTR_OK ||
        (oc.nonfinite = policy, dtr_optimizer_create(net.model, &oc, &opt)) != DTR_OK)
        goto done;
    dtr_context_set_anomaly(ctx, on);
    for (i = 0; i < reps + 3 && i < 64; i++) {   /* 3 warm-up steps */
        double t0 = fm_now();
        dtr_tensor *loss = dtr_cross_entropy(ctx, fm_net_forward(ctx, &net, dtr_tensor_from(ctx, DTR_F32, 2, xs, x)),
                                             dtr_tensor_from(ctx, DTR_I32, 1, ys, y));
        if (!loss || dtr_backward(ctx, loss) != DTR_OK || dtr_optimizer_step(opt, NULL) != DTR_OK) goto done;
        dtr_context_reset(ctx);
        if (i >= 3) t[i - 3] = (fm_now() - t0) * 1e3;
    }
    ms = median(t, i - 3);
done:
    dtr_optimizer_destroy(opt);
    fm_net_free(&net);
    dtr_context_destroy(ctx);
    return ms;
}

int main(int argc, char **argv) {
    int quick = argc > 1 && strcmp(argv[1], "--quick") == 0, reps = quick ? 5 : 31;
    int64_t sizes[2] = {1 << 20, 1 << 22};
    int k;
    for (k = 0; k < (quick ? 1 : 2); k++) {
        double off = step_ms(sizes[k], DTR_NONFINITE_OFF, reps), on = step_ms(sizes[k], DTR_NONFINITE_SKIP, reps);
        if (off < 0 || on < 0) { fprintf(stderr, "bench/health: optimizer setup failed\n"); return 1; }
        printf("{\"bench\":\"nonfinite_check\",\"numel\":%lld,\"policy\":\"off\",\"step_ms\":%.4f}\n", (long long)sizes[k], off);
        printf("{\"bench\":\"nonfinite_check\",\"numel\":%lld,\"policy\":\"skip\",\"step_ms\":%.4f,\"overhead\":%.3f}\n",
               (long long)sizes[k], on, on / off - 1.0);
    }
    {
        double off = mlp_step_ms(0, DTR_NONFINITE_OFF, reps), on = mlp_step_ms(0, DTR_NONFINITE_SKIP, reps);
        if (off < 0 || on < 0) { fprintf(stderr, "bench/health: MLP step failed\n"); return 1; }
        printf("{\"bench\":\"nonfinite_check\",\"model\":\"mlp\",\"batch\":64,\"policy\":\"off\",\"step_ms\":%.4f}\n", off);
        printf("{\"bench\":\"nonfinite_check\",\"model\":\"mlp\",\"batch\":64,\"policy\":\"skip\",\"step_ms\":%.4f,"
               "\"overhead\":%.3f}\n", on, on / off - 1.0);
    }
    {
        double off = mlp_step_ms(0, DTR_NONFINITE_SKIP, reps), on = mlp_step_ms(1, DTR_NONFINITE_SKIP, reps);
        if (off < 0 || on < 0) { fprintf(stderr, "bench/health: MLP step failed\n"); return 1; }
        printf("{\"bench\":\"anomaly\",\"model\":\"mlp\",\"batch\":64,\"anomaly\":false,\"step_ms\":%.4f}\n", off);
        printf("{\"bench\":\"anomaly\",\"model\":\"mlp\",\"batch\":64,\"anomaly\":true,\"step_ms\":%.4f,\"overhead\":%.3f}\n", on,
               on / off - 1.0);
    }
    return 0;
}
