/* examples/common.h: Fashion-MNIST helpers. The two examples (examples/fmnist_mlp.c,
 * examples/fmnist_cnn.c) keep their network and training loop in their own file and take
 * only the plumbing from here (command line, data folder, split loaders, evaluation);
 * bench/fmnist.c, examples/fmnist_dp.c and tests/test_train.c also use the networks and the
 * epoch loop below, so the benchmark and the tests train exactly the same way.
 *
 *   data      fm_data_dir      the folder: argument, $DTR_FMNIST_DIR or the Debian default
 *             fm_data_load     dtr_mnist_load, then standardised pixels; messages with a hint
 *             fm_data_hint     what is wrong with the folder and how to get the data
 *             fm_open_split    a dtr_loader over "train" or "t10k" (normalised, flattened)
 *             fm_evaluate_loader  accuracy over a loader with gradients and training mode off
 *   models    fm_net_init      MLP 784-256-128-10, or the small CNN (see fm_net below)
 *             fm_net_forward   (B, 784) images -> (B, 10) logits
 *             fm_autoencoder_init / _forward / _epoch / _mse  a convolutional autoencoder
 *             (images -> images) and its training pass and score; fm_mean_image_mse its reference
 *   training  fm_train_epoch   one pass of mini-batch SGD over a shuffled order
 *             fm_evaluate      accuracy with gradients off and training mode off
 *             fm_sgd           SGD with momentum, constant or cosine learning rate
 *   misc      fm_shuffle (seeded dtr_rng), fm_now (monotonic seconds), fm_fail (message),
 *             fm_parse_args (the examples' command line)
 *   progress  fm_progress_init / _step / _clear: a progress line (dtr_progress_format) redrawn
 *             in place on a terminal, one line every N steps in a log
 *
 * Everything is `static` (header included once per program) and works through the public
 * API only. Errors: dtrain's calls return dtr_result or NULL with the context's sticky status
 * set; these helpers pass the first error up and the programs print
 * dtr_context_last_error(). Include this header before any system header (it asks for
 * POSIX clock_gettime). */
#ifndef DTRAIN_EXAMPLES_COMMON_H
#define DTRAIN_EXAMPLES_COMMON_H

#ifndef _POSIX_C_SOURCE
#define _POSIX_C_SOURCE 200809L
#endif
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include "dtrain.h"

#if defined(__GNUC__) || defined(__clang__)
#define FM_FN static __attribute__((unused))
#else
#define FM_FN static
#endif

/* ---- data ---- */

#define FM_DEFAULT_DIR "/usr/share/datasets/fashion-mnist"
#define FM_PIXELS 784
#define FM_CLASSES 10
/* Pixel standardisation (mean and std of the Fashion-MNIST training images, as in the
 * usual torchvision recipe); bench/fmnist_torch.py uses the same numbers. */
#define FM_MEAN 0.2860f
#define FM_STD 0.3530f

/** The data folder: `arg` when given, else $DTR_FMNIST_DIR when set and not empty, else
 *  the folder of Debian's dataset-fashion-mnist package. */
FM_FN const char *fm_data_dir(const char *arg) {
    const char *env = getenv("DTR_FMNIST_DIR");
    if (arg && *arg) return arg;
    if (env && *env) return env;
    return FM_DEFAULT_DIR;
}

/** Prints why Fashion-MNIST could not be read from `dir` (err: the library's message) and
 *  how to get the data; returns r. */
FM_FN dtr_result fm_data_hint(const char *dir, const char *err, dtr_result r) {
    fprintf(stderr, "error: cannot load Fashion-MNIST from %s: %s (%s)\n", dir, err, dtr_result_string(r));
    if (r == DTR_IO_ERROR)
        fprintf(stderr, "  The folder needs train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz,\n"
                            "  t10k-images-idx3-ubyte.gz and t10k-labels-idx1-ubyte.gz (or the files unpacked).\n"
                            "  `make deps` installs them (Debian package dataset-fashion-mnist, into\n"
                            "  " FM_DEFAULT_DIR "); without root, scripts/fetch-fmnist.sh\n"
                            "  fetches them into ~/.cache/dtrain/fashion-mnist. Pass the folder as the first\n"
                            "  argument or in DTR_FMNIST_DIR.\n");
    if (r == DTR_UNSUPPORTED)
        fprintf(stderr, "  The files are gzip-compressed: build dtrain with -DDTR_USE_ZLIB and link -lz,\n"
                        "  or gunzip them.\n");
    return r;
}

/** Loads Fashion-MNIST from `dir` and standardises the pixels. On failure prints what is
 *  wrong (the path included) and how to get the data, and returns the error. */
FM_FN dtr_result fm_data_load(const char *dir, dtr_mnist *d) {
    char err[512];
    int64_t i;
    dtr_result r = dtr_mnist_load(dir, NULL, d, err, sizeof err);
    if (r != DTR_OK) return fm_data_hint(dir, err, r);
    if (d->rows * d->cols != FM_PIXELS) {
        fprintf(stderr, "error: %s holds %d x %d images; Fashion-MNIST's are 28 x 28\n", dir, d->rows, d->cols);
        dtr_mnist_destroy(d);
        return DTR_SHAPE_MISMATCH;
    }
    for (i = 0; i < d->train_n * FM_PIXELS; i++) d->train_x[i] = (d->train_x[i] - FM_MEAN) / FM_STD;
    for (i = 0; i < d->test_n * FM_PIXELS; i++) d->test_x[i] = (d->test_x[i] - FM_MEAN) / FM_STD;
    return DTR_OK;
}

/* ---- misc ---- */

/** Seconds of a monotonic clock. */
FM_FN double fm_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/** order[0..n) becomes a permutation of 0..n-1 drawn from `rng` (Fisher-Yates). */
FM_FN void fm_shuffle(dtr_rng *rng, int32_t *order, int64_t n) {
    int64_t i;
    for (i = 0; i < n; i++) order[i] = (int32_t)i;
    for (i = n - 1; i > 0; i--) {
        int64_t j = (int64_t)(dtr_rng_u32(rng) % (uint32_t)(i + 1));
        int32_t t = order[i];
        order[i] = order[j];
        order[j] = t;
    }
}

/** Prints "error: <what>: <result> (<context message>)" and returns 1 (for main). */
FM_FN int fm_fail(dtr_context *ctx, const char *what, dtr_result r) {
    const char *msg = ctx ? dtr_context_last_error(ctx) : dtr_context_create_error();   /* no context: its creation's */
    fprintf(stderr, "error: %s: %s%s%s%s\n", what, dtr_result_string(r), *msg ? " (" : "", msg, *msg ? ")" : "");
    return 1;
}

/* ---- progress line ---- */

/** A progress line on stdout. On a terminal (or under dtrun on one: dtrun sets DTR_TTY=1 and
 *  forwards a line that ends in "\r" as such) it is redrawn in place at most 10 times a
 *  second; otherwise one line is printed every `every` steps (0: never). DTR_PROGRESS=0 in
 *  the environment turns it off, DTR_PROGRESS=N sets `every`. */
typedef struct fm_progress {
    int tty, every, width, on;
    double t0, epoch_t0, last;
    int64_t epoch, samples;
} fm_progress;

FM_FN void fm_progress_init(fm_progress *p, int every) {
    const char *env = getenv("DTR_PROGRESS"), *tty = getenv("DTR_TTY");
    memset(p, 0, sizeof *p);
    p->tty = isatty(1) || (tty && strcmp(tty, "1") == 0);
    p->every = env && *env ? atoi(env) : every;
    p->on = !(env && strcmp(env, "0") == 0);
    p->t0 = p->last = fm_now();
    p->epoch = -1;
}

/** Wipes a drawn progress line (before the program prints a line of its own). */
FM_FN void fm_progress_clear(fm_progress *p) {
    if (!p->tty || !p->width) return;
    printf("%*s\r", p->width, "");
    fflush(stdout);
    p->width = 0;
}

/** After step `step` (1-based) of `steps` in epoch `epoch` (0-based) of `epochs`, which took
 *  `samples` samples and gave `loss`. */
FM_FN void fm_progress_step(fm_progress *p, int64_t epoch, int64_t epochs, int64_t step, int64_t steps, int64_t samples,
                            double loss) {
    dtr_progress_info info;
    char line[200];
    double now = fm_now();
    int n;
    if (epoch != p->epoch) p->epoch = epoch, p->epoch_t0 = now, p->samples = 0;
    p->samples += samples;
    if (!p->on || (p->tty ? now - p->last < 0.1 && step != steps : p->every <= 0 || step % p->every != 0)) return;
    p->last = now;
    memset(&info, 0, sizeof info);
    info.epoch = epoch;
    info.epochs = epochs;
    info.step = step;
    info.steps = steps;
    info.elapsed_s = now - p->t0;
    info.rate = now > p->epoch_t0 ? (double)p->samples / (now - p->epoch_t0) : 0.0;
    info.loss = loss;
    info.has_loss = 1;
    dtr_progress_format(line, sizeof line, &info);
    n = (int)strlen(line);
    if (p->tty) printf("%s%*s\r", line, p->width > n ? p->width - n : 0, "");
    else printf("%s\n", line);
    if (p->tty && n > p->width) p->width = n;
    fflush(stdout);
}

/* ---- models ---- */

typedef enum fm_arch { FM_MLP = 0, FM_CNN = 1 } fm_arch;

/** The two networks of the examples.
 *  MLP: (B, 784) -> fc1 256 -> relu -> fc2 128 -> relu -> fc3 10.
 *  CNN: (B, 1, 28, 28) -> conv1 3x3 32 -> relu -> maxpool 2 -> (B, 32, 13, 13)
 *       -> conv2 3x3 64 -> relu -> maxpool 2 -> (B, 64, 5, 5) -> flatten 1600
 *       -> fc1 128 -> relu -> fc2 10. No padding: 28 -> 26 -> 13 -> 11 -> 5. */
typedef struct fm_net {
    fm_arch arch;
    dtr_model *model;
    dtr_conv2d_layer conv1, conv2;   /* CNN only */
    dtr_linear_layer fc1, fc2, fc3;  /* fc3: MLP only */
} fm_net;

/** Declares the parameters of `arch` on a new model of `ctx` and initialises them with
 *  `init` (weights; biases follow PyTorch's default) from `seed`. */
FM_FN dtr_result fm_net_init(fm_net *net, dtr_context *ctx, fm_arch arch, dtr_init init, uint64_t seed) {
    dtr_result r;
    memset(net, 0, sizeof *net);
    net->arch = arch;
    r = dtr_model_create(ctx, seed, &net->model);
    if (r != DTR_OK) return r;
    if (arch == FM_MLP) {
        if ((r = dtr_linear_layer_init(&net->fc1, net->model, "fc1", FM_PIXELS, 256, 1, init)) != DTR_OK) return r;
        if ((r = dtr_linear_layer_init(&net->fc2, net->model, "fc2", 256, 128, 1, init)) != DTR_OK) return r;
        if ((r = dtr_linear_layer_init(&net->fc3, net->model, "fc3", 128, FM_CLASSES, 1, init)) != DTR_OK) return r;
    } else {
        if ((r = dtr_conv2d_layer_init(&net->conv1, net->model, "conv1", 1, 32, 3, 1, 0, init)) != DTR_OK) return r;
        if ((r = dtr_conv2d_layer_init(&net->conv2, net->model, "conv2", 32, 64, 3, 1, 0, init)) != DTR_OK) return r;
        if ((r = dtr_linear_layer_init(&net->fc1, net->model, "fc1", 64 * 5 * 5, 128, 1, init)) != DTR_OK) return r;
        if ((r = dtr_linear_layer_init(&net->fc2, net->model, "fc2", 128, FM_CLASSES, 1, init)) != DTR_OK) return r;
    }
    return dtr_model_build(net->model);
}

FM_FN void fm_net_free(fm_net *net) {
    dtr_model_destroy(net->model);
    net->model = NULL;
}

/** x (B, 784) -> logits (B, 10). NULL on error (the context holds it). */
FM_FN dtr_tensor *fm_net_forward(dtr_context *ctx, const fm_net *net, dtr_tensor *x) {
    int64_t B = dtr_tensor_dim(x, 0);
    dtr_tensor *h;
    if (net->arch == FM_MLP) {
        h = dtr_relu(ctx, dtr_linear_layer_forward(ctx, &net->fc1, x));    /* (B, 256) */
        h = dtr_relu(ctx, dtr_linear_layer_forward(ctx, &net->fc2, h));    /* (B, 128) */
        return dtr_linear_layer_forward(ctx, &net->fc3, h);                /* (B, 10) */
    } else {
        int64_t img[4], flat[2];
        img[0] = B; img[1] = 1; img[2] = 28; img[3] = 28;
        flat[0] = B; flat[1] = 64 * 5 * 5;
        h = dtr_reshape(ctx, x, 4, img);                                                  /* (B, 1, 28, 28) */
        h = dtr_maxpool2d(ctx, dtr_relu(ctx, dtr_conv2d_layer_forward(ctx, &net->conv1, h)), 2, 2, 0); /* (B, 32, 13, 13) */
        h = dtr_maxpool2d(ctx, dtr_relu(ctx, dtr_conv2d_layer_forward(ctx, &net->conv2, h)), 2, 2, 0); /* (B, 64, 5, 5) */
        h = dtr_reshape(ctx, h, 2, flat);                                                 /* (B, 1600) */
        h = dtr_relu(ctx, dtr_linear_layer_forward(ctx, &net->fc1, h));                   /* (B, 128) */
        return dtr_linear_layer_forward(ctx, &net->fc2, h);                               /* (B, 10) */
    }
}

/** A convolutional autoencoder (examples/fmnist_autoencoder.c, tests/test_train.c): strided
 *  convolutions down to an 8 x 7 x 7 code (392 numbers for 784 pixels), transposed ones back up.
 *  (B, 1, 28, 28) -> enc1 3x3/2 16 -> relu -> (B, 16, 14, 14) -> enc2 3x3/2 8 -> relu -> (B, 8, 7, 7)
 *  -> dec1 3x3/2 16 (output padding 1) -> relu -> (B, 16, 14, 14) -> dec2 3x3/2 1 -> (B, 1, 28, 28). */
typedef struct fm_autoencoder {
    dtr_model *model;
    dtr_conv2d_layer enc1, enc2, dec1, dec2;
} fm_autoencoder;

FM_FN dtr_result fm_autoencoder_init(fm_autoencoder *ae, dtr_context *ctx, uint64_t seed) {
    dtr_conv_config c = dtr_conv_config_init();
    dtr_result r;
    memset(ae, 0, sizeof *ae);
    c.stride[0] = c.stride[1] = 2;
    c.padding[0] = c.padding[1] = 1;
    if ((r = dtr_model_create(ctx, seed, &ae->model)) != DTR_OK) return r;
    if ((r = dtr_conv2d_layer_init_ex(&ae->enc1, ae->model, "enc1", 1, 16, 3, 3, &c, 1, DTR_INIT_TORCH_DEFAULT)) != DTR_OK ||
        (r = dtr_conv2d_layer_init_ex(&ae->enc2, ae->model, "enc2", 16, 8, 3, 3, &c, 1, DTR_INIT_TORCH_DEFAULT)) != DTR_OK)
        return r;
    c.output_padding[0] = c.output_padding[1] = 1;   /* 7 -> 14 -> 28, not 13 -> 25 */
    if ((r = dtr_conv_transpose2d_layer_init(&ae->dec1, ae->model, "dec1", 8, 16, 3, 3, &c, 1, DTR_INIT_TORCH_DEFAULT)) != DTR_OK ||
        (r = dtr_conv_transpose2d_layer_init(&ae->dec2, ae->model, "dec2", 16, 1, 3, 3, &c, 1, DTR_INIT_TORCH_DEFAULT)) != DTR_OK)
        return r;
    return dtr_model_build(ae->model);
}

/** x (B, 784) -> its reconstruction (B, 784). NULL on error (the context holds it). */
FM_FN dtr_tensor *fm_autoencoder_forward(dtr_context *ctx, const fm_autoencoder *ae, dtr_tensor *x) {
    int64_t img[4], flat[2];
    dtr_tensor *h;
    img[0] = flat[0] = dtr_tensor_dim(x, 0); img[1] = 1; img[2] = img[3] = 28; flat[1] = FM_PIXELS;
    h = dtr_reshape(ctx, x, 4, img);
    h = dtr_relu(ctx, dtr_conv2d_layer_forward(ctx, &ae->enc1, h));   /* (B, 16, 14, 14) */
    h = dtr_relu(ctx, dtr_conv2d_layer_forward(ctx, &ae->enc2, h));   /* (B, 8, 7, 7): the code */
    h = dtr_relu(ctx, dtr_conv2d_layer_forward(ctx, &ae->dec1, h));   /* (B, 16, 14, 14) */
    return dtr_reshape(ctx, dtr_conv2d_layer_forward(ctx, &ae->dec2, h), 2, flat);
}

/** One pass over images X[order[i]] (i < n) in mini-batches of `batch` (the last one may be
 *  smaller; `buf` holds batch * 784 floats): the reconstruction's MSE against the image,
 *  backward, an optimizer step. *mean_loss: the pass's mean loss. */
FM_FN dtr_result fm_autoencoder_epoch(dtr_context *ctx, const fm_autoencoder *ae, dtr_optimizer *opt, const float *X,
                                      const int32_t *order, int64_t n, int64_t batch, float *buf, double *mean_loss) {
    int64_t i, k, xs[2];
    double sum = 0.0;
    dtr_result r;
    dtr_context_set_training(ctx, 1);
    dtr_context_set_grad_enabled(ctx, 1);
    for (i = 0; i < n; i += batch) {
        dtr_tensor *x, *loss;
        xs[0] = n - i < batch ? n - i : batch; xs[1] = FM_PIXELS;
        for (k = 0; k < xs[0]; k++) memcpy(buf + k * FM_PIXELS, X + (int64_t)order[i + k] * FM_PIXELS, FM_PIXELS * sizeof(float));
        x = dtr_tensor_from(ctx, DTR_F32, 2, xs, buf);
        if (!(loss = dtr_mse(ctx, fm_autoencoder_forward(ctx, ae, x), x))) return dtr_context_status(ctx);
        if ((r = dtr_backward(ctx, loss)) != DTR_OK) return r;
        sum += (double)dtr_tensor_get(loss, 0) * (double)xs[0];
        if ((r = dtr_optimizer_step(opt, NULL)) != DTR_OK || (r = dtr_context_reset(ctx)) != DTR_OK) return r;
    }
    *mean_loss = n ? sum / (double)n : 0.0;
    return DTR_OK;
}

/** The mean squared reconstruction error over images X[0 .. n) (gradients and training mode
 *  off, batches of 500), in *mse. */
FM_FN dtr_result fm_autoencoder_mse(dtr_context *ctx, const fm_autoencoder *ae, const float *X, int64_t n, double *mse) {
    int64_t i, xs[2];
    double sum = 0.0;
    dtr_result r = DTR_OK;
    dtr_context_set_training(ctx, 0);
    dtr_context_set_grad_enabled(ctx, 0);
    for (i = 0; i < n && r == DTR_OK; i += 500) {
        dtr_tensor *x, *loss;
        xs[0] = n - i < 500 ? n - i : 500; xs[1] = FM_PIXELS;
        x = dtr_tensor_from(ctx, DTR_F32, 2, xs, X + i * FM_PIXELS);
        if (!(loss = dtr_mse(ctx, fm_autoencoder_forward(ctx, ae, x), x))) r = dtr_context_status(ctx);
        else sum += (double)dtr_tensor_get(loss, 0) * (double)xs[0];
        if (r == DTR_OK) r = dtr_context_reset(ctx);
    }
    dtr_context_set_grad_enabled(ctx, 1);
    *mse = n ? sum / (double)n : 0.0;
    return r;
}

/** The error of the best constant guess: each pixel's mean over the first `n_fit` images of
 *  F, scored on X[0 .. n) (the reference an autoencoder must beat). */
FM_FN double fm_mean_image_mse(const float *F, int64_t n_fit, const float *X, int64_t n) {
    double mean[FM_PIXELS] = {0.0}, sum = 0.0;
    int64_t i;
    int p;
    for (i = 0; i < n_fit; i++)
        for (p = 0; p < FM_PIXELS; p++) mean[p] += F[i * FM_PIXELS + p] / (double)n_fit;
    for (i = 0; i < n; i++)
        for (p = 0; p < FM_PIXELS; p++) sum += (X[i * FM_PIXELS + p] - mean[p]) * (X[i * FM_PIXELS + p] - mean[p]);
    return n ? sum / ((double)n * FM_PIXELS) : 0.0;
}

/* ---- training and evaluation ---- */

/** Host buffers of one mini-batch, allocated once. */
typedef struct fm_batch {
    int64_t cap;
    float *x;        /* (cap, 784) */
    int32_t *y;      /* (cap) */
    float *logits;   /* (cap, 10) */
} fm_batch;

FM_FN dtr_result fm_batch_alloc(fm_batch *b, int64_t cap) {
    b->cap = cap;
    b->x = (float *)malloc((size_t)cap * FM_PIXELS * sizeof(float));
    b->y = (int32_t *)malloc((size_t)cap * sizeof(int32_t));
    b->logits = (float *)malloc((size_t)cap * FM_CLASSES * sizeof(float));
    return (b->x && b->y && b->logits) ? DTR_OK : DTR_OUT_OF_MEMORY;
}

FM_FN void fm_batch_free(fm_batch *b) {
    free(b->x);
    free(b->y);
    free(b->logits);
    memset(b, 0, sizeof *b);
}

/** Number of rows of logits (n, 10) whose argmax equals the label. */
FM_FN int64_t fm_count_correct(const float *logits, const int32_t *y, int64_t n);
/** fm_count_correct on a logits tensor (B, 10) of at most 1000 rows. */
FM_FN int64_t fm_count_correct_t(const dtr_tensor *logits, const int32_t *y, int64_t n) {
    static float buf[1000 * FM_CLASSES];
    if (n > 1000 || dtr_tensor_read(logits, DTR_F32, buf, (size_t)(n * FM_CLASSES)) != DTR_OK) return 0;
    return fm_count_correct(buf, y, n);
}

FM_FN int64_t fm_count_correct(const float *logits, const int32_t *y, int64_t n) {
    int64_t i, correct = 0;
    int k;
    for (i = 0; i < n; i++) {
        const float *l = logits + i * FM_CLASSES;
        int best = 0;
        for (k = 1; k < FM_CLASSES; k++)
            if (l[k] > l[best]) best = k;
        correct += best == y[i];
    }
    return correct;
}

/** Result of an epoch. */
typedef struct fm_epoch_stats {
    double loss;      /* mean training loss over the samples seen */
    double acc;       /* training accuracy (from the logits of each step, before its update) */
    int64_t samples;  /* samples seen */
    int64_t steps;    /* optimizer steps */
} fm_epoch_stats;

/** One epoch of mini-batch training over X[order[i]], Y[order[i]] for i < n, in batches of
 *  at most b->cap (the last one may be smaller); stops after max_steps steps when > 0.
 *  A step: batch tensors -> forward -> cross-entropy -> backward -> optimizer step
 *  (which zeroes the gradients) -> dtr_context_reset (the step arena is reused). */
FM_FN dtr_result fm_train_epoch(dtr_context *ctx, const fm_net *net, dtr_optimizer *opt, const float *X,
                                const int32_t *Y, const int32_t *order, int64_t n, fm_batch *b, int64_t max_steps,
                                fm_epoch_stats *st) {
    double loss_sum = 0.0;
    int64_t correct = 0, start, i;
    dtr_result r;
    memset(st, 0, sizeof *st);
    dtr_context_set_training(ctx, 1);
    dtr_context_set_grad_enabled(ctx, 1);
    for (start = 0; start < n && (max_steps <= 0 || st->steps < max_steps); start += b->cap) {
        int64_t B = n - start < b->cap ? n - start : b->cap, xs[2], ys[1];
        dtr_tensor *x, *y, *logits, *loss;
        for (i = 0; i < B; i++) {   /* gather the shuffled samples into one batch */
            memcpy(b->x + i * FM_PIXELS, X + (int64_t)order[start + i] * FM_PIXELS, FM_PIXELS * sizeof(float));
            b->y[i] = Y[order[start + i]];
        }
        xs[0] = B; xs[1] = FM_PIXELS; ys[0] = B;
        x = dtr_tensor_from(ctx, DTR_F32, 2, xs, b->x);
        y = dtr_tensor_from(ctx, DTR_I32, 1, ys, b->y);
        logits = fm_net_forward(ctx, net, x);
        loss = dtr_cross_entropy(ctx, logits, y);
        if (!loss) return dtr_context_status(ctx);
        if ((r = dtr_backward(ctx, loss)) != DTR_OK) return r;
        if ((r = dtr_tensor_read(logits, DTR_F32, b->logits, (size_t)(B * FM_CLASSES))) != DTR_OK) return r;
        loss_sum += (double)dtr_tensor_get(loss, 0) * (double)B;
        correct += fm_count_correct(b->logits, b->y, B);
        if ((r = dtr_optimizer_step(opt, NULL)) != DTR_OK) return r;
        if ((r = dtr_context_reset(ctx)) != DTR_OK) return r;
        st->samples += B;
        st->steps++;
    }
    if (st->samples) {
        st->loss = loss_sum / (double)st->samples;
        st->acc = (double)correct / (double)st->samples;
    }
    return DTR_OK;
}

/** Accuracy of the network on (X, Y) of n samples, in batches of b->cap, with gradient
 *  recording and training mode off (both restored after). The training batch size is a good
 *  choice: the step arena then never grows beyond what training needs. */
FM_FN dtr_result fm_evaluate(dtr_context *ctx, const fm_net *net, const float *X, const int32_t *Y, int64_t n,
                             fm_batch *b, double *acc) {
    int grad = dtr_context_set_grad_enabled(ctx, 0), training = dtr_context_set_training(ctx, 0);
    int64_t start, correct = 0;
    dtr_result r = DTR_OK;
    *acc = 0.0;
    for (start = 0; start < n; start += b->cap) {
        int64_t B = n - start < b->cap ? n - start : b->cap, xs[2];
        dtr_tensor *logits;
        xs[0] = B; xs[1] = FM_PIXELS;
        logits = fm_net_forward(ctx, net, dtr_tensor_from(ctx, DTR_F32, 2, xs, X + start * FM_PIXELS));
        if (!logits) { r = dtr_context_status(ctx); break; }
        if ((r = dtr_tensor_read(logits, DTR_F32, b->logits, (size_t)(B * FM_CLASSES))) != DTR_OK) break;
        correct += fm_count_correct(b->logits, Y + start, B);
        if ((r = dtr_context_reset(ctx)) != DTR_OK) break;
    }
    dtr_context_set_grad_enabled(ctx, grad);
    dtr_context_set_training(ctx, training);
    if (r == DTR_OK && n > 0) *acc = (double)correct / (double)n;
    return r;
}

/** SGD with momentum over every parameter of the network; when cosine_steps > 0 the
 *  learning rate decays from lr to 0 along a cosine over that many steps. */
FM_FN dtr_optimizer_config fm_sgd_config(float lr, float momentum, int64_t cosine_steps) {
    dtr_optimizer_config oc = dtr_optimizer_config_init(DTR_OPT_SGD, lr);
    oc.momentum = momentum;
    if (cosine_steps > 0) {
        oc.schedule.kind = DTR_SCHED_COSINE;
        oc.schedule.total_steps = cosine_steps;
    }
    return oc;
}

FM_FN dtr_result fm_sgd(const fm_net *net, float lr, float momentum, int64_t cosine_steps, dtr_optimizer **out) {
    dtr_optimizer_config oc = fm_sgd_config(lr, momentum, cosine_steps);
    return dtr_optimizer_create(net->model, &oc, out);
}

/* ---- loaders and evaluation (the examples that use the data loader) ---- */

/** A loader over one split of Fashion-MNIST ("train" or "t10k") in `dir` (.gz or unpacked
 *  files): flattened (B, 784) pixels, normalised with FM_MEAN and FM_STD. `device`: the
 *  GPU context the batches go to (their buffers then pinned; NULL on the CPU). On failure
 *  prints what is wrong and how to get the data. */
FM_FN dtr_result fm_open_split(const char *dir, const char *split, int64_t batch, int shuffle, uint64_t seed,
                             dtr_context *device, dtr_dataset **ds, dtr_loader **ld) {
    static const float mean = FM_MEAN, std = FM_STD;
    dtr_loader_config lc = dtr_loader_config_init();
    char img[600], lab[600], err[512];
    dtr_result r;
    snprintf(img, sizeof img, "%s/%s-images-idx3-ubyte.gz", dir, split);
    snprintf(lab, sizeof lab, "%s/%s-labels-idx1-ubyte.gz", dir, split);
    if ((r = dtr_dataset_open_idx(img, lab, NULL, ds, err, sizeof err)) != DTR_OK) {   /* or unpacked files */
        img[strlen(img) - 3] = lab[strlen(lab) - 3] = '\0';
        r = dtr_dataset_open_idx(img, lab, NULL, ds, err, sizeof err);
    }
    if (r != DTR_OK) return fm_data_hint(dir, err, r);
    lc.batch_size = batch;
    lc.shuffle = shuffle;
    lc.seed = seed;
    lc.flatten = 1;
    lc.device = device;
    lc.augment.norm_count = 1;
    lc.augment.mean = &mean;
    lc.augment.std = &std;
    if ((r = dtr_loader_create(*ds, &lc, ld, err, sizeof err)) != DTR_OK) fprintf(stderr, "error: loader: %s\n", err);
    return r;
}

/** A network's forward pass: x (B, 784) -> logits (B, 10). */
typedef dtr_tensor *(*fm_forward_fn)(dtr_context *ctx, const void *net, dtr_tensor *x);

/** Accuracy over a loader's epoch (batches of at most 1000), without gradients or dropout. */
FM_FN dtr_result fm_evaluate_loader(dtr_context *ctx, fm_forward_fn forward, const void *n, dtr_loader *test, double *acc) {
    int64_t b, seen = 0, correct = 0;
    dtr_context_set_grad_enabled(ctx, 0);
    dtr_context_set_training(ctx, 0);
    for (b = 0; b < dtr_loader_batches(test); b++) {
        dtr_batch batch;
        dtr_tensor *x, *y, *logits;
        dtr_result r = dtr_loader_next(test, &batch);
        if (r == DTR_OK) r = dtr_loader_tensors(test, ctx, &batch, &x, &y);
        if (r != DTR_OK || !(logits = forward(ctx, n, x))) return r != DTR_OK ? r : dtr_context_status(ctx);
        correct += fm_count_correct_t(logits, (const int32_t *)batch.y, batch.size);
        seen += batch.size;
        dtr_context_reset(ctx);
    }
    dtr_context_set_grad_enabled(ctx, 1);
    dtr_context_set_training(ctx, 1);
    *acc = seen ? (double)correct / (double)seen : 0.0;
    return DTR_OK;
}

/* ---- captured steps (--graph) ----
 * The training step (forward, cross-entropy, backward) captured once with dtr_graph_capture
 * (a CUDA graph on the GPU) and launched for every full batch; its inputs live on a tape of
 * their own (they outlive dtr_context_reset) and are fed from the loader's tensors with
 * dtr_tensor_copy (a device copy on the GPU). A last, smaller batch runs eagerly. */
typedef struct fm_graph_step {
    fm_forward_fn forward;
    const void *net;
    dtr_tape *inputs;
    dtr_tensor *x, *y, *loss, *logits;
    dtr_graph *g;
} fm_graph_step;

static dtr_result fm_graph_fn(dtr_context *ctx, void *user) {
    fm_graph_step *s = (fm_graph_step *)user;
    s->logits = s->forward(ctx, s->net, s->x);
    s->loss = dtr_cross_entropy(ctx, s->logits, s->y);
    return s->loss ? dtr_backward(ctx, s->loss) : dtr_context_status(ctx);
}

/** The step on batch (x, y) through the captured graph (captured on the first call, which runs
 *  it too); *loss is the step's loss tensor (s->logits its logits). */
FM_FN dtr_result fm_graph_run(dtr_context *ctx, fm_graph_step *s, dtr_tensor *x, dtr_tensor *y, dtr_tensor **loss) {
    dtr_result r = DTR_OK;
    if (!s->inputs) {
        int64_t xs[DTR_MAX_DIMS], ys[DTR_MAX_DIMS];
        dtr_tape *was;
        int d;
        for (d = 0; d < dtr_tensor_ndim(x); d++) xs[d] = dtr_tensor_dim(x, d);
        for (d = 0; d < dtr_tensor_ndim(y); d++) ys[d] = dtr_tensor_dim(y, d);
        if ((r = dtr_tape_create(ctx, &s->inputs)) != DTR_OK) return r;
        was = dtr_context_set_tape(ctx, s->inputs);
        s->x = dtr_tensor_new(ctx, dtr_tensor_dtype(x), dtr_tensor_ndim(x), xs);
        s->y = dtr_tensor_new(ctx, dtr_tensor_dtype(y), dtr_tensor_ndim(y), ys);
        dtr_context_set_tape(ctx, was);
        if (!s->x || !s->y) return dtr_context_status(ctx);
    }
    if ((r = dtr_tensor_copy(s->x, x)) != DTR_OK || (r = dtr_tensor_copy(s->y, y)) != DTR_OK) return r;
    r = s->g ? dtr_graph_launch(s->g) : dtr_graph_capture(ctx, fm_graph_fn, s, &s->g);
    *loss = s->loss;
    return r;
}

/** Frees the graph and its inputs. */
FM_FN void fm_graph_free(fm_graph_step *s) {
    dtr_graph_destroy(s->g);
    dtr_tape_destroy(s->inputs);
    s->g = NULL;
    s->inputs = NULL;
}

/* ---- command line of the examples ---- */

typedef struct fm_options {
    const char *dir;     /* data folder (NULL: fm_data_dir's default) */
    int epochs, threads, batch;
    float lr;
    int cosine;          /* 1: cosine decay of the learning rate to 0 over the run */
    unsigned long seed;
    const char *ckpt_dir; /* --ckpt-dir: full-state checkpoints there, resumed from (examples that take it) */
    int ckpt_every;       /* --ckpt-every: steps between checkpoints (0: 200) */
    const char *metrics; /* --metrics FILE: JSON lines of per-step metrics (NULL: none) */
    const char *trace;   /* --trace FILE: Chrome/Perfetto timeline (NULL: none) */
    int gpu;             /* --gpu: the CUDA backend (builds with FM_CUDA: make examples-gpu) */
    int graph;           /* --graph: the step captured once and launched (fm_graph_run; fmnist_mlp, fmnist_cnn) */
    int bf16;            /* --bf16: bf16 activations, bf16 products on a GPU (fm_bf16; fmnist_mlp, fmnist_cnn) */
    int bn;              /* --bn: batch norm after each convolution (fmnist_cnn) */
} fm_options;

#define FM_USAGE "[DATA_DIR] [--epochs E] [--threads T] [--batch B] [--lr LR] [--schedule cosine|constant] [--seed S]" \
                 " [--ckpt-dir DIR] [--ckpt-every N] [--metrics FILE] [--trace FILE] [--gpu] [--graph] [--bf16] [--bn]"

/** path, or with ".rank<r>" before its extension when world > 1 (run.json -> run.rank1.json). */
FM_FN const char *fm_rank_path(const char *path, int rank, int world, char *buf, size_t n) {
    const char *dot = strrchr(path, '.'), *slash = strrchr(path, '/');
    int stem = dot && (!slash || dot > slash) ? (int)(dot - path) : (int)strlen(path);
    if (world <= 1) return path;
    snprintf(buf, n, "%.*s.rank%d%s", stem, path, rank, path + stem);
    return buf;
}

/** Observes ctx when --metrics or --trace was given (*out NULL otherwise): rank `rank` of
 *  `world` writes FILE itself when world is 1, else FILE with ".rank<r>" before its
 *  extension (dtrun --merge-traces joins the timelines). Returns DTR_OK or the error of
 *  dtr_metrics_create. */
FM_FN dtr_result fm_metrics_open(dtr_context *ctx, const char *metrics, const char *trace, int rank, int world,
                                 dtr_metrics **out) {
    dtr_metrics_config mc = dtr_metrics_config_init();
    char mpath[1024], tpath[1024];
    *out = NULL;
    if (!metrics && !trace) return DTR_OK;
    mc.rank = rank;
    mc.jsonl_path = metrics ? fm_rank_path(metrics, rank, world, mpath, sizeof mpath) : NULL;
    mc.trace_path = trace ? fm_rank_path(trace, rank, world, tpath, sizeof tpath) : NULL;
    mc.trace_events = (size_t)1 << 20;   /* the last million spans */
    mc.grad_norm = 1;                    /* one more pass over the gradients per step */
    return dtr_metrics_create(ctx, &mc, out);
}

/** Parses the examples' arguments into `o` (which holds the defaults). Returns 0, 1 for
 *  --help, 2 after printing what is wrong. */
FM_FN int fm_parse_args(int argc, char **argv, fm_options *o) {
    int i;
    for (i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        char *end = NULL;
        if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) return 1;
        if (a[0] != '-') { o->dir = a; continue; }
        if (strcmp(a, "--gpu") == 0) { o->gpu = 1; continue; }
        if (strcmp(a, "--graph") == 0) { o->graph = 1; continue; }
        if (strcmp(a, "--bf16") == 0) { o->bf16 = 1; continue; }
        if (strcmp(a, "--bn") == 0) { o->bn = 1; continue; }
        if (!v) { fprintf(stderr, "error: %s needs a value\n", a); return 2; }
        i++;
        if (strcmp(a, "--schedule") == 0) {
            if (strcmp(v, "cosine") != 0 && strcmp(v, "constant") != 0) {
                fprintf(stderr, "error: --schedule is cosine or constant, not '%s'\n", v);
                return 2;
            }
            o->cosine = strcmp(v, "cosine") == 0;
            continue;
        }
        if (strcmp(a, "--ckpt-dir") == 0) { o->ckpt_dir = v; continue; }
        if (strcmp(a, "--metrics") == 0 || strcmp(a, "--trace") == 0) {
            *(strcmp(a, "--metrics") == 0 ? &o->metrics : &o->trace) = v;
            continue;
        }
        if (strcmp(a, "--epochs") == 0) o->epochs = (int)strtol(v, &end, 10);
        else if (strcmp(a, "--threads") == 0) o->threads = (int)strtol(v, &end, 10);
        else if (strcmp(a, "--batch") == 0) o->batch = (int)strtol(v, &end, 10);
        else if (strcmp(a, "--lr") == 0) o->lr = strtof(v, &end);
        else if (strcmp(a, "--seed") == 0) o->seed = strtoul(v, &end, 10);
        else if (strcmp(a, "--ckpt-every") == 0) o->ckpt_every = (int)strtol(v, &end, 10);
        else { fprintf(stderr, "error: unknown option %s\n", a); return 2; }
        if (!end || *end || end == v) { fprintf(stderr, "error: %s: '%s' is not a number\n", a, v); return 2; }
    }
    if (o->epochs < 1 || o->threads < 0 || o->batch < 1 || !(o->lr > 0.0f) || o->ckpt_every < 0) {
        fprintf(stderr, "error: need --epochs >= 1, --threads >= 0, --batch >= 1, --lr > 0, --ckpt-every >= 0\n");
        return 2;
    }
    return 0;
}

/** The CUDA backend when this program was built with it (make examples-gpu defines FM_CUDA
 *  and links dtrain_cuda.o), else NULL. */
FM_FN const dtr_backend *fm_cuda_backend(void) {
#ifdef FM_CUDA
    return dtr_cuda_backend();
#else
    return NULL;
#endif
}

/** --bf16: every op's output stored in bf16 (activation_dtype; parameters, gradients and the
 *  optimizer's state stay f32) and, on a GPU, the matrix products on bf16 tensor cores
 *  (matmul_precision): torch.autocast(bfloat16)'s arrangement. */
FM_FN void fm_bf16(int on, dtr_context_config *cfg) {
    cfg->activation_dtype = on ? DTR_BF16 : DTR_F32;
    cfg->matmul_precision = on ? DTR_MATMUL_BF16 : DTR_MATMUL_F32;
}

/** Chooses the backend for --gpu (the CUDA one; the CPU without --gpu). Returns 0 after
 *  printing why when --gpu was asked of a CPU-only build. */
FM_FN int fm_backend(int gpu, dtr_context_config *cfg) {
    if (!gpu) return 1;
    cfg->backend = fm_cuda_backend();
    if (!cfg->backend) fprintf(stderr, "error: --gpu needs this example built with the CUDA backend (make examples-gpu)\n");
    return cfg->backend != NULL;
}

#endif /* DTRAIN_EXAMPLES_COMMON_H */
