/* bench/autoencoder.c: training speed of the convolutional autoencoder of
 * examples/fmnist_autoencoder.c (strided conv2d down, conv_transpose2d up; fm_autoencoder in
 * examples/common.h), as JSON lines ("impl":"dtrain"; bench/autoencoder_torch.py prints the same
 * line for the same network in PyTorch). A step: forward over x (B, 1, 28, 28), MSE against x,
 * backward, Adam. Random images (seed 1); the best of --repeat timings of --steps steps each,
 * after one warm-up step. Prints ms_per_step, images_per_s and the last loss.
 * Usage: autoencoder [--batch B] [--threads N] [--steps S] [--repeat R]
 * Build: make bench. */
#include "../examples/common.h"

typedef struct ae_opts { int64_t batch; int threads, steps, repeat; } ae_opts;

static int ae_args(int argc, char **argv, ae_opts *o) {
    int i;
    for (i = 1; i + 1 < argc; i += 2) {
        long v = strtol(argv[i + 1], NULL, 10);
        if (!strcmp(argv[i], "--batch")) o->batch = v;
        else if (!strcmp(argv[i], "--threads")) o->threads = (int)v;
        else if (!strcmp(argv[i], "--steps")) o->steps = (int)v;
        else if (!strcmp(argv[i], "--repeat")) o->repeat = (int)v;
        else return 0;
    }
    return i == argc && o->batch > 0 && o->threads >= 0 && o->steps > 0 && o->repeat > 0;
}

/* the parameters' element count (dtr_model_numel adds each one's alignment padding) */
static int64_t ae_params(const dtr_model *m) {
    int64_t n = 0;
    int i;
    for (i = 0; i < dtr_model_param_count(m); i++) n += dtr_tensor_numel(dtr_model_param_at(m, i));
    return n;
}

int main(int argc, char **argv) {
    ae_opts o = {64, 0, 10, 3};
    dtr_context_config cfg = dtr_context_config_init();
    dtr_optimizer_config oc = dtr_optimizer_config_init(DTR_OPT_ADAM, 0.002f);
    dtr_context *ctx = NULL;
    dtr_optimizer *opt = NULL;
    fm_autoencoder ae;
    dtr_rng rng;
    float *x, *buf;
    int32_t *order;
    double best = 1e30, loss = 0.0;
    int64_t i;
    int k, rc = 1;
    if (!ae_args(argc, argv, &o)) {
        fprintf(stderr, "usage: %s [--batch B] [--threads N] [--steps S] [--repeat R]\n", argv[0]);
        return 2;
    }
    x = (float *)malloc((size_t)(o.batch * FM_PIXELS) * sizeof(float));
    buf = (float *)malloc((size_t)(o.batch * FM_PIXELS) * sizeof(float));
    order = (int32_t *)malloc((size_t)o.batch * sizeof(int32_t));
    memset(&ae, 0, sizeof ae);
    cfg.threads = o.threads;
    if (!x || !buf || !order || dtr_context_create(&cfg, &ctx) != DTR_OK || fm_autoencoder_init(&ae, ctx, 1) != DTR_OK ||
        dtr_optimizer_create(ae.model, &oc, &opt) != DTR_OK) {
        fprintf(stderr, "autoencoder: setup failed: %s\n", ctx ? dtr_context_last_error(ctx) : "no context");
        goto done;
    }
    dtr_rng_seed(&rng, 1, 0);
    for (i = 0; i < o.batch * FM_PIXELS; i++) x[i] = dtr_rng_normal(&rng);
    for (i = 0; i < o.batch; i++) order[i] = (int32_t)i;
    for (k = -1; k < o.repeat; k++) {   /* k = -1: the warm-up step */
        double t0 = fm_now();
        int s;
        for (s = 0; s < (k < 0 ? 1 : o.steps); s++)   /* one pass over the batch = one step */
            if (fm_autoencoder_epoch(ctx, &ae, opt, x, order, o.batch, o.batch, buf, &loss) != DTR_OK) {
                fprintf(stderr, "autoencoder: %s\n", dtr_context_last_error(ctx));
                goto done;
            }
        if (k >= 0 && fm_now() - t0 < best) best = fm_now() - t0;
    }
    printf("{\"bench\":\"autoencoder\",\"impl\":\"dtrain\",\"batch\":%lld,\"threads\":%d,\"params\":%lld,\"ms_per_step\":%.3f,"
           "\"images_per_s\":%.1f,\"loss\":%.5f}\n",
           (long long)o.batch, dtr_context_threads(ctx), (long long)ae_params(ae.model), 1e3 * best / o.steps,
           (double)(o.batch * o.steps) / best, loss);
    rc = 0;
done:
    dtr_optimizer_destroy(opt);
    dtr_model_destroy(ae.model);
    dtr_context_destroy(ctx);
    free(x);
    free(buf);
    free(order);
    return rc;
}
