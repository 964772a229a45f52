/* examples/fmnist_cnn.c: train a small convolutional network on Fashion-MNIST with dtrain.
 *
 * What it shows: the same run as examples/fmnist_mlp.c with a CNN: conv2d and max-pooling
 * layers on images, dtr_reshape between the (B, 784) input, the (B, 1, 28, 28) images and
 * the flattened (B, 1600) features, and the thread pool at work in the convolution kernels
 * (im2col + GEMM per sample; results are bit-identical for any thread count). The network:
 *     conv 3x3 32 -> relu -> maxpool 2 -> conv 3x3 64 -> relu -> maxpool 2
 *     -> linear 1600-128 -> relu -> linear 10          (no padding: 28 -> 26 -> 13 -> 11 -> 5)
 * The model and the training loop are in this file; the data comes from the loader (seeded
 * shuffle each epoch, normalisation), as in examples/fmnist_mlp.c. examples/common.h holds
 * the command line, the data folder, the loaders of the splits and the evaluation loop.
 *
 * Build and run from the repository:
 *     make examples && build/examples/fmnist_cnn [DATA_DIR] [options]
 *     (`make deps` installs the data; `make demo` runs the MLP example)
 * Build by hand, with dtrain.h and common.h beside this file (the two -D flags do what
 * `#define DTRAIN_IMPLEMENTATION` and `#define DTR_USE_ZLIB` before `#include "dtrain.h"`
 * do in one file of your own program; DTR_USE_ZLIB reads the .gz files directly):
 *     cc -O2 -march=native -I. -DDTRAIN_IMPLEMENTATION -DDTR_USE_ZLIB fmnist_cnn.c \
 *        -o fmnist_cnn -lm -lpthread -lz
 *
 * Usage: fmnist_cnn [DATA_DIR] [--epochs E] [--threads T] [--batch B] [--lr LR]
 *                   [--schedule cosine|constant] [--seed S]
 *   DATA_DIR    folder with the four IDX files (.gz or not); default $DTR_FMNIST_DIR, else
 *               /usr/share/datasets/fashion-mnist (Debian's dataset-fashion-mnist)
 *   --epochs    passes over the 60000 training images (default 1)
 *   --threads   compute threads (default 0: every online core)
 *   --batch     mini-batch size (default 64)
 *   --lr        learning rate of SGD with momentum 0.9 (default 0.05)
 *   --schedule  cosine (default): the learning rate decays to 0 over the run; or constant
 *   --seed      initialisation and shuffle seed (default 1)
 *   --bf16      activations stored in bf16 (parameters, gradients, optimizer state f32; on a
 *               GPU the products on bf16 tensor cores); --gpu, --graph, --metrics, --trace,
 *               --ckpt-dir as in fmnist_mlp.c
 *   --bn        batch norm after each convolution (dtr_batchnorm_layer: the batch's statistics
 *               while training, the running ones when evaluating)
 * Weights are Kaiming-uniform, biases PyTorch's default. Expect about 87% test accuracy
 * after the default epoch (about 30 s on one core of a recent x86) and about 91% with
 * --epochs 10. */
#include "common.h"

typedef struct cnn {
    dtr_model *model;
    dtr_conv2d_layer conv1, conv2;
    dtr_batchnorm_layer bn1, bn2;   /* --bn */
    dtr_linear_layer fc1, fc2;
    int bn;
} cnn;

/* conv, batch norm (--bn; the batch's statistics in training, the running ones in evaluation),
   relu, 2x2 max pooling */
static dtr_tensor *cnn_stage(dtr_context *ctx, const cnn *n, const dtr_conv2d_layer *conv, const dtr_batchnorm_layer *bn,
                             dtr_tensor *h) {
    h = dtr_conv2d_layer_forward(ctx, conv, h);
    if (n->bn) h = dtr_batchnorm_layer_forward(ctx, bn, h);
    return dtr_maxpool2d(ctx, dtr_relu(ctx, h), 2, 2, 0);
}

/* x (B, 784) -> logits (B, 10); an fm_forward_fn */
static dtr_tensor *cnn_forward(dtr_context *ctx, const void *net, dtr_tensor *x) {
    const cnn *n = (const cnn *)net;
    int64_t img[4] = {dtr_tensor_dim(x, 0), 1, 28, 28}, flat[2] = {dtr_tensor_dim(x, 0), 64 * 5 * 5};
    dtr_tensor *h = dtr_reshape(ctx, x, 4, img);                                                /* (B, 1, 28, 28) */
    h = cnn_stage(ctx, n, &n->conv1, &n->bn1, h);                                               /* (B, 32, 13, 13) */
    h = cnn_stage(ctx, n, &n->conv2, &n->bn2, h);                                               /* (B, 64, 5, 5) */
    h = dtr_relu(ctx, dtr_linear_layer_forward(ctx, &n->fc1, dtr_reshape(ctx, h, 2, flat)));    /* (B, 128) */
    return dtr_linear_layer_forward(ctx, &n->fc2, h);                                           /* (B, 10) */
}

int main(int argc, char **argv) {
    fm_options o = {NULL, 1, 0, 64, 0.05f, 1, 1, NULL, 0, NULL, NULL, 0, 0, 0, 0};
    dtr_context_config cfg = dtr_context_config_init();
    dtr_optimizer_config oc;
    dtr_context *ctx = NULL;
    dtr_optimizer *opt = NULL;
    dtr_dataset *train_ds = NULL, *test_ds = NULL;
    dtr_loader *train = NULL, *test = NULL;
    cnn net;
    double test_acc = 0.0;
    fm_progress prog;
    fm_graph_step gs = {cnn_forward, &net, NULL, NULL, NULL, NULL, NULL, NULL};
    dtr_result r;
    int e, rc = 1, pa = fm_parse_args(argc, argv, &o);

    if (pa) {
        fprintf(pa == 1 ? stdout : stderr, "usage: %s " FM_USAGE "\n", argv[0]);
        return pa == 1 ? 0 : 2;
    }
    if (o.ckpt_dir) {
        fprintf(stderr, "error: --ckpt-dir: this example does not checkpoint; examples/fmnist_mlp.c shows it\n");
        return 2;
    }
    o.dir = fm_data_dir(o.dir);
    memset(&net, 0, sizeof net);
    net.bn = o.bn;

    /* the context (thread pool, step arena), the model and the optimizer */
    cfg.threads = o.threads;
    if (!fm_backend(o.gpu, &cfg)) goto done;
    fm_bf16(o.bf16, &cfg);
    cfg.seed = o.seed;
    if ((r = dtr_context_create(&cfg, &ctx)) != DTR_OK) { fm_fail(NULL, "dtr_context_create", r); goto done; }
    /* the data: on the GPU the batch buffers are pinned and their copies queued (dtr_loader_tensors) */
    if (fm_open_split(o.dir, "train", o.batch, 1, o.seed, o.gpu ? ctx : NULL, &train_ds, &train) != DTR_OK ||
        fm_open_split(o.dir, "t10k", 1000, 0, 0, o.gpu ? ctx : NULL, &test_ds, &test) != DTR_OK)
        goto done;
    if ((r = dtr_model_create(ctx, o.seed, &net.model)) != DTR_OK ||
        (r = dtr_conv2d_layer_init(&net.conv1, net.model, "conv1", 1, 32, 3, 1, 0, DTR_INIT_KAIMING_UNIFORM)) != DTR_OK ||
        (r = dtr_conv2d_layer_init(&net.conv2, net.model, "conv2", 32, 64, 3, 1, 0, DTR_INIT_KAIMING_UNIFORM)) != DTR_OK ||
        (r = dtr_linear_layer_init(&net.fc1, net.model, "fc1", 64 * 5 * 5, 128, 1, DTR_INIT_KAIMING_UNIFORM)) != DTR_OK ||
        (r = dtr_linear_layer_init(&net.fc2, net.model, "fc2", 128, FM_CLASSES, 1, DTR_INIT_KAIMING_UNIFORM)) != DTR_OK ||
        (o.bn && ((r = dtr_batchnorm_layer_init(&net.bn1, net.model, "bn1", 32)) != DTR_OK ||
                  (r = dtr_batchnorm_layer_init(&net.bn2, net.model, "bn2", 64)) != DTR_OK))) {
        fm_fail(ctx, "model", r);
        goto done;
    }
    oc = dtr_optimizer_config_init(DTR_OPT_SGD, o.lr);
    oc.momentum = 0.9f;
    if (o.cosine) {
        oc.schedule.kind = DTR_SCHED_COSINE;
        oc.schedule.total_steps = (int64_t)o.epochs * dtr_loader_batches(train);
    }
    if ((r = dtr_optimizer_create(net.model, &oc, &opt)) != DTR_OK) { fm_fail(ctx, "optimizer", r); goto done; }
    printf("fmnist_cnn: %lld train / %lld test images from %s\n"
           "  CNN conv32%s-pool-conv64%s-pool-128-10 (%lld parameters), %d threads, batch %d, SGD lr %g momentum 0.9 %s\n",
           (long long)dtr_dataset_count(train_ds), (long long)dtr_dataset_count(test_ds), o.dir, o.bn ? "-bn" : "",
           o.bn ? "-bn" : "", (long long)dtr_model_numel(net.model), dtr_context_threads(ctx), o.batch, (double)o.lr,
           o.cosine ? "cosine" : "constant");

    fm_progress_init(&prog, 100);
    for (e = 1; e <= o.epochs; e++) {
        double t0 = fm_now(), loss_sum = 0.0;
        int64_t b, seen = 0;
        for (b = 0; b < dtr_loader_batches(train); b++) {   /* one epoch: the loader reshuffles each */
            dtr_batch batch;
            dtr_tensor *x, *y, *loss = NULL;
            if ((r = dtr_loader_next(train, &batch)) != DTR_OK) { fprintf(stderr, "error: %s\n", dtr_loader_last_error(train)); goto done; }
            if ((r = dtr_loader_tensors(train, ctx, &batch, &x, &y)) != DTR_OK) { fm_fail(ctx, "batch", r); goto done; }
            if (o.graph && batch.size == o.batch) {   /* --graph: the captured step */
                if ((r = fm_graph_run(ctx, &gs, x, y, &loss)) != DTR_OK) { fm_fail(ctx, "captured step", r); goto done; }
            } else {
                loss = dtr_cross_entropy(ctx, cnn_forward(ctx, &net, x), y);
                if ((r = dtr_backward(ctx, loss)) != DTR_OK) { fm_fail(ctx, "backward", r); goto done; }
            }
            loss_sum += (double)dtr_tensor_get(loss, 0) * (double)batch.size;   /* read before the reset */
            seen += batch.size;
            if ((r = dtr_optimizer_step(opt, NULL)) != DTR_OK) { fm_fail(ctx, "optimizer step", r); goto done; }
            fm_progress_step(&prog, e - 1, o.epochs, b + 1, dtr_loader_batches(train), batch.size, dtr_tensor_get(loss, 0));
            dtr_context_reset(ctx);
        }
        fm_progress_clear(&prog);
        if ((r = fm_evaluate_loader(ctx, cnn_forward, &net, test, &test_acc)) != DTR_OK) { fm_fail(ctx, "evaluation", r); goto done; }
        printf("epoch %2d  loss %.4f  test acc %.2f%%  %.1f s  %.0f samples/s\n", e, loss_sum / (double)seen,
               100.0 * test_acc, fm_now() - t0, (double)seen / (fm_now() - t0));
        fflush(stdout);
    }
    printf("final test accuracy: %.2f%%\n", 100.0 * test_acc);
    rc = 0;
done:
    fm_graph_free(&gs);
    dtr_optimizer_destroy(opt);
    dtr_model_destroy(net.model);
    dtr_loader_destroy(train);   /* before the context its buffers may come from */
    dtr_loader_destroy(test);
    dtr_context_destroy(ctx);
    dtr_dataset_destroy(train_ds);
    dtr_dataset_destroy(test_ds);
    return rc;
}
