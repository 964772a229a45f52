/* examples/fmnist_mlp.c: train a multi-layer perceptron on Fashion-MNIST with dtrain.
 *
 * What it shows: a whole CPU training run with the public API: a context with N threads; a
 * model of named layers (784-256-128-10, ReLU) whose parameters live in one contiguous
 * buffer; SGD with momentum and a cosine learning-rate schedule; the per-step loop
 * (batch -> forward -> cross-entropy -> backward -> optimizer step -> dtr_context_reset, so
 * the step arena is reused and a steady-state step allocates nothing); a seeded shuffle each
 * epoch; evaluation with gradient recording and training mode off. Every call is checked;
 * on error the program prints the context's message (dtrain itself never prints). The
 * network, the data loading and the loop are in examples/common.h, shared with
 * examples/fmnist_cnn.c, bench/fmnist.c and tests/test_train.c.
 *
 * Build and run from the repository:
 *     make demo          (installs the data with `make deps` when needed, then runs this)
 *     make examples && build/examples/fmnist_mlp [DATA_DIR] [options]
 * Build by hand, with dtrain.h and common.h beside this file (the two -D flags do what
 * `#define DTRAIN_IMPLEMENTATION` and `#define DTR_USE_ZLIB` before `#include "dtrain.h"`
 * do in one file of your own program; DTR_USE_ZLIB reads the .gz files directly):
 *     cc -O2 -march=native -I. -DDTRAIN_IMPLEMENTATION -DDTR_USE_ZLIB fmnist_mlp.c \
 *        -o fmnist_mlp -lm -lpthread -lz
 *
 * Usage: fmnist_mlp [DATA_DIR] [--epochs E] [--threads T] [--batch B] [--lr LR]
 *                   [--schedule cosine|constant] [--seed S]
 *   DATA_DIR    folder with the four IDX files (.gz or not); default $DTR_FMNIST_DIR, else
 *               /usr/share/datasets/fashion-mnist (Debian's dataset-fashion-mnist)
 *   --epochs    passes over the 60000 training images (default 2)
 *   --threads   compute threads (default 0: every online core)
 *   --batch     mini-batch size (default 64)
 *   --lr        learning rate of SGD with momentum 0.9 (default 0.05)
 *   --schedule  cosine (default): the learning rate decays to 0 over the run; or constant
 *   --seed      initialisation and shuffle seed (default 1)
 * Weights are Kaiming-uniform, biases PyTorch's default. Expect about 87.4% test accuracy
 * after the default 2 epochs (1.5-3 s each on one core of a recent x86) and about 89% with
 * --epochs 10. */
#include "common.h"

int main(int argc, char **argv) {
    fm_options o = {NULL, 2, 0, 64, 0.05f, 1, 1};
    dtr_context_config cfg = dtr_context_config_init();
    dtr_context *ctx = NULL;
    dtr_optimizer *opt = NULL;
    dtr_mnist data;
    fm_net net;
    fm_batch batch;
    int32_t *order = NULL;
    dtr_rng rng;
    double test_acc = 0.0;
    int64_t steps_per_epoch;
    dtr_result r;
    int e, rc = 1, pa = fm_parse_args(argc, argv, &o);

    if (pa) {
        fprintf(pa == 1 ? stdout : stderr, "usage: %s " FM_USAGE "\n", argv[0]);
        return pa == 1 ? 0 : 2;
    }
    o.dir = fm_data_dir(o.dir);
    memset(&net, 0, sizeof net);
    memset(&batch, 0, sizeof batch);
    if (fm_data_load(o.dir, &data) != DTR_OK) return 1;   /* prints the path and how to get the data */
    steps_per_epoch = (data.train_n + o.batch - 1) / o.batch;

    /* the context (thread pool, step arena), the model and the optimizer */
    cfg.threads = o.threads;
    cfg.seed = o.seed;
    if ((r = dtr_context_create(&cfg, &ctx)) != DTR_OK) { fm_fail(NULL, "dtr_context_create", r); goto done; }
    if ((r = fm_net_init(&net, ctx, FM_MLP, DTR_INIT_KAIMING_UNIFORM, o.seed)) != DTR_OK) { fm_fail(ctx, "model", r); goto done; }
    r = fm_sgd(&net, o.lr, 0.9f, o.cosine ? o.epochs * steps_per_epoch : 0, &opt);
    if (r != DTR_OK) { fm_fail(ctx, "optimizer", r); goto done; }
    order = (int32_t *)malloc((size_t)data.train_n * sizeof(int32_t));
    if (!order || fm_batch_alloc(&batch, o.batch) != DTR_OK) {
        fprintf(stderr, "error: out of memory\n");
        goto done;
    }
    dtr_rng_seed(&rng, o.seed, 1);
    printf("fmnist_mlp: %lld train / %lld test images from %s\n"
           "  784-256-128-10 MLP (%lld parameters), %d threads, batch %d, SGD lr %g momentum 0.9 %s\n",
           (long long)data.train_n, (long long)data.test_n, o.dir, (long long)dtr_model_numel(net.model),
           dtr_context_threads(ctx), o.batch, (double)o.lr, o.cosine ? "cosine" : "constant");

    for (e = 1; e <= o.epochs; e++) {
        fm_epoch_stats st;
        double t0, secs;
        fm_shuffle(&rng, order, data.train_n);   /* a new seeded order each epoch */
        t0 = fm_now();
        r = fm_train_epoch(ctx, &net, opt, data.train_x, data.train_y, order, data.train_n, &batch, 0, &st);
        secs = fm_now() - t0;
        if (r != DTR_OK) { fm_fail(ctx, "training", r); goto done; }
        if ((r = fm_evaluate(ctx, &net, data.test_x, data.test_y, data.test_n, &batch, &test_acc)) != DTR_OK) {
            fm_fail(ctx, "evaluation", r);
            goto done;
        }
        printf("epoch %2d  loss %.4f  train acc %.2f%%  test acc %.2f%%  %.1f s  %.0f samples/s\n", e, st.loss,
               100.0 * st.acc, 100.0 * test_acc, secs, (double)st.samples / secs);
        fflush(stdout);
    }
    printf("final test accuracy: %.2f%%\n", 100.0 * test_acc);
    rc = 0;
done:
    free(order);
    fm_batch_free(&batch);
    dtr_optimizer_destroy(opt);
    fm_net_free(&net);
    dtr_context_destroy(ctx);
    dtr_mnist_destroy(&data);
    return rc;
}
