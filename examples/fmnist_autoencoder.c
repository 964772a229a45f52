/* examples/fmnist_autoencoder.c: a convolutional autoencoder on Fashion-MNIST with dtrain.
 *
 * What it shows: images in, images out, no labels. Strided convolutions squeeze each 28 x 28
 * image into an 8 x 7 x 7 code (half the pixels' count); transposed convolutions
 * (dtr_conv_transpose2d_layer_init, output padding 1 so 7 -> 14 -> 28) grow it back; the loss is
 * the reconstruction's mean squared error against the image (dtr_mse). The score beside it is
 * the error of the best image that ignores its input (each pixel's training mean): how much of
 * each image the 392 numbers of its code carry. The same network is the start of anomaly
 * detection (a part the training set never showed reconstructs badly) and of image compression.
 * The model and its training pass are in examples/common.h (fm_autoencoder_*), shared with the
 * test that checks it learns (tests/test_train.c).
 *
 * Build and run from the repository:
 *     make examples && build/examples/fmnist_autoencoder [DATA_DIR] [options]
 * Build by hand, with dtrain.h and common.h beside this file:
 *     cc -O2 -march=native -I. -DDTRAIN_IMPLEMENTATION -DDTR_USE_ZLIB fmnist_autoencoder.c \
 *        -o fmnist_autoencoder -lm -lpthread -lz
 *
 * Usage: fmnist_autoencoder [DATA_DIR] [--epochs E] [--threads T] [--batch B] [--lr LR] [--seed S]
 *   DATA_DIR    folder with the four IDX files; default $DTR_FMNIST_DIR, else
 *               /usr/share/datasets/fashion-mnist
 *   --epochs    passes over the 60000 training images (default 1)
 *   --threads   compute threads (default 0: every online core)
 *   --batch     mini-batch size (default 64)
 *   --lr        Adam's learning rate (default 0.002)
 *   --seed      initialisation and shuffle seed (default 1)
 * Pixels are standardised (mean 0.286, deviation 0.353), so the errors are in those units. */
#include "common.h"

int main(int argc, char **argv) {
    fm_options o = {NULL, 1, 0, 64, 0.002f, 0, 1, NULL, 0, NULL, NULL, 0, 0, 0, 0};
    dtr_context_config cfg = dtr_context_config_init();
    dtr_context *ctx = NULL;
    dtr_optimizer *opt = NULL;
    dtr_optimizer_config oc = dtr_optimizer_config_init(DTR_OPT_ADAM, 0.002f);
    fm_autoencoder ae;
    dtr_mnist d;
    dtr_rng rng;
    int32_t *order = NULL;
    float *buf = NULL;
    double loss = 0.0, mse = 0.0, base;
    dtr_result r;
    int e, rc = 1, pa = fm_parse_args(argc, argv, &o);

    if (pa) {
        fprintf(pa == 1 ? stdout : stderr, "usage: %s [DATA_DIR] [--epochs E] [--threads T] [--batch B] [--lr LR] [--seed S]\n",
                argv[0]);
        return pa == 1 ? 0 : 2;
    }
    if (o.gpu || o.graph || o.bf16 || o.bn || o.ckpt_dir || o.metrics || o.trace) {
        fprintf(stderr, "error: this example takes --epochs, --threads, --batch, --lr and --seed only\n");
        return 2;
    }
    memset(&ae, 0, sizeof ae);
    o.dir = fm_data_dir(o.dir);
    if (fm_data_load(o.dir, &d) != DTR_OK) return 1;
    cfg.threads = o.threads;
    cfg.seed = o.seed;
    order = (int32_t *)malloc((size_t)d.train_n * sizeof(int32_t));
    buf = (float *)malloc((size_t)o.batch * FM_PIXELS * sizeof(float));
    if (!order || !buf) { fprintf(stderr, "error: out of memory\n"); goto done; }
    if ((r = dtr_context_create(&cfg, &ctx)) != DTR_OK) { fm_fail(NULL, "dtr_context_create", r); goto done; }
    if ((r = fm_autoencoder_init(&ae, ctx, o.seed)) != DTR_OK) { fm_fail(ctx, "model", r); goto done; }
    oc.schedule.lr = o.lr;
    if ((r = dtr_optimizer_create(ae.model, &oc, &opt)) != DTR_OK) { fm_fail(ctx, "optimizer", r); goto done; }
    base = fm_mean_image_mse(d.train_x, d.train_n, d.test_x, d.test_n);
    printf("fmnist_autoencoder: %lld train / %lld test images from %s\n"
           "  conv 16/2 - conv 8/2 (code 8x7x7) - convT 16/2 - convT 1/2 (%lld parameters), %d threads, batch %d, Adam lr %g\n"
           "  the mean image scores %.4f on the test images\n",
           (long long)d.train_n, (long long)d.test_n, o.dir, (long long)dtr_model_numel(ae.model), dtr_context_threads(ctx),
           o.batch, (double)o.lr, base);
    dtr_rng_seed(&rng, o.seed, 7);
    for (e = 1; e <= o.epochs; e++) {
        double t0 = fm_now();
        fm_shuffle(&rng, order, d.train_n);
        if ((r = fm_autoencoder_epoch(ctx, &ae, opt, d.train_x, order, d.train_n, o.batch, buf, &loss)) != DTR_OK ||
            (r = fm_autoencoder_mse(ctx, &ae, d.test_x, d.test_n, &mse)) != DTR_OK) {
            fm_fail(ctx, "epoch", r);
            goto done;
        }
        printf("epoch %2d  train loss %.4f  test reconstruction MSE %.4f (%.1f%% of the mean image's)  %.1f s  %.0f images/s\n",
               e, loss, mse, 100.0 * mse / base, fm_now() - t0, (double)d.train_n / (fm_now() - t0));
        fflush(stdout);
    }
    rc = 0;
done:
    dtr_optimizer_destroy(opt);
    dtr_model_destroy(ae.model);
    dtr_context_destroy(ctx);
    dtr_mnist_destroy(&d);
    free(order);
    free(buf);
    return rc;
}
