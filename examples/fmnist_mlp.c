/* examples/fmnist_mlp.c: train a multi-layer perceptron on Fashion-MNIST with dtrain.
 *
 * What it shows, all in this file: the data pipeline (IDX datasets read by the loader, which
 * shuffles with a seed each epoch, normalises the pixels and hands out batches), a model of
 * named layers (784-256-128-10, ReLU) whose parameters live in one contiguous buffer, SGD
 * with momentum and an optional cosine schedule, and the per-step loop:
 *     batch -> forward -> cross-entropy -> backward -> optimizer step -> dtr_context_reset
 * (the step arena is reused, so a steady-state step allocates nothing), then evaluation with
 * gradient recording and training mode off. With --ckpt-dir DIR it checkpoints the full
 * state (weights, momentum, schedule, the loader's shuffle and position) every --ckpt-every
 * steps (default 200) asynchronously, and a second run with the same options resumes from the
 * newest complete checkpoint, bit for bit (docs/fault-tolerance.md): interrupt it with Ctrl-C
 * or kill -9 and start it again. Every call is checked; on error the program
 * prints the context's message (dtrain itself never prints). examples/common.h holds the
 * command line, the data folder with its error hints, the loaders of the two splits
 * (fm_open_split) and the evaluation loop (fm_evaluate_loader).
 *
 * Build and run from the repository:
 *     make examples && build/examples/fmnist_mlp [DATA_DIR] [options]
 * Build by hand, with dtrain.h and common.h beside this file:
 *     cc -O2 -I. -DDTRAIN_IMPLEMENTATION -DDTR_USE_ZLIB fmnist_mlp.c -o fmnist_mlp -lm -lpthread -lz
 * Options: [DATA_DIR] [--epochs E] [--threads T] [--batch B] [--lr LR] [--schedule cosine|constant]
 * [--seed S] [--ckpt-dir DIR] [--ckpt-every N] [--metrics FILE] [--trace FILE] [--gpu] [--graph] [--bf16]. --bf16
 * stores the activations in bf16 (parameters, gradients and the optimizer's state stay f32; on a
 * GPU the products run on bf16 tensor cores). --graph
 * captures the training step once (dtr_graph_capture: a CUDA graph with --gpu) and launches it for
 * every full batch, the loader's tensors copied into its inputs (examples/common.h, fm_graph_run);
 * the weights come out as without it. --ckpt-dir keeps
 * full-state checkpoints there every N steps and resumes from the newest. --metrics appends one JSON line per step (loss,
 * learning rate, gradient norm, samples/s, the step time split into data, forward, backward,
 * optimizer; FLOPs); --trace writes a timeline of every op to open in https://ui.perfetto.dev
 * (docs/observability.md). DATA_DIR defaults to $DTR_FMNIST_DIR, else /usr/share/datasets/fashion-mnist. */
#include "common.h"

typedef struct mlp { dtr_model *model; dtr_linear_layer fc1, fc2, fc3; } mlp;

/* x (B, 784) -> logits (B, 10); an fm_forward_fn */
static dtr_tensor *mlp_forward(dtr_context *ctx, const void *net, dtr_tensor *x) {
    const mlp *n = (const mlp *)net;
    dtr_tensor *h = dtr_relu(ctx, dtr_linear_layer_forward(ctx, &n->fc1, x));   /* (B, 256) */
    h = dtr_relu(ctx, dtr_linear_layer_forward(ctx, &n->fc2, h));                /* (B, 128) */
    return dtr_linear_layer_forward(ctx, &n->fc3, h);                            /* (B, 10) */
}

int main(int argc, char **argv) {
    fm_options o = {NULL, 2, 0, 64, 0.05f, 1, 1, NULL, 0, NULL, NULL, 0, 0, 0, 0};
    dtr_context_config cfg = dtr_context_config_init();
    dtr_optimizer_config oc;
    dtr_context *ctx = NULL;
    dtr_optimizer *opt = NULL;
    dtr_dataset *train_ds = NULL, *test_ds = NULL;
    dtr_loader *train = NULL, *test = NULL;
    dtr_ckpt *ck = NULL;
    int64_t step = 0, per;
    dtr_metrics *metrics = NULL;
    mlp net = {NULL, {0}, {0}, {0}};
    double test_acc = 0.0;
    fm_progress prog;
    fm_graph_step gs = {mlp_forward, &net, NULL, NULL, NULL, NULL, NULL, NULL};
    dtr_result r;
    int e, rc = 1, pa = fm_parse_args(argc, argv, &o);

    if (pa) {
        fprintf(pa == 1 ? stdout : stderr, "usage: %s " FM_USAGE "\n", argv[0]);
        return pa == 1 ? 0 : 2;
    }
    o.dir = fm_data_dir(o.dir);

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
        (r = dtr_linear_layer_init(&net.fc1, net.model, "fc1", FM_PIXELS, 256, 1, DTR_INIT_KAIMING_UNIFORM)) != DTR_OK ||
        (r = dtr_linear_layer_init(&net.fc2, net.model, "fc2", 256, 128, 1, DTR_INIT_KAIMING_UNIFORM)) != DTR_OK ||
        (r = dtr_linear_layer_init(&net.fc3, net.model, "fc3", 128, FM_CLASSES, 1, DTR_INIT_KAIMING_UNIFORM)) != DTR_OK) {
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
    /* metrics and timeline (--metrics, --trace): the loader marks its waits, the library the rest */
    if ((r = fm_metrics_open(ctx, o.metrics, o.trace, 0, 1, &metrics)) != DTR_OK) { fm_fail(ctx, "metrics", r); goto done; }
    if (metrics) dtr_metrics_watch_loader(metrics, train);
    printf("fmnist_mlp: %lld train / %lld test images from %s\n"
           "  784-256-128-10 MLP (%lld parameters), %d threads, batch %d, SGD lr %g momentum 0.9 %s\n",
           (long long)dtr_dataset_count(train_ds), (long long)dtr_dataset_count(test_ds), o.dir,
           (long long)dtr_model_numel(net.model), dtr_context_threads(ctx), o.batch, (double)o.lr,
           o.cosine ? "cosine" : "constant");

    per = dtr_loader_batches(train);
    if (o.ckpt_dir) {   /* full-state checkpoints: resume from the newest complete one */
        dtr_ckpt_config kc = dtr_ckpt_config_init();
        kc.dir = o.ckpt_dir;
        kc.ctx = ctx, kc.model = net.model, kc.optimizer = opt, kc.loader = train;
        if ((r = dtr_ckpt_create(&kc, &ck)) != DTR_OK) { fm_fail(ctx, "dtr_ckpt_create", r); goto done; }
        r = dtr_ckpt_restore(ck, NULL, &step);
        if (r == DTR_OK) printf("  resumed from %s at step %lld (epoch %lld)\n", o.ckpt_dir, (long long)step, (long long)(step / per + 1));
        else if (r != DTR_NOT_FOUND) { fprintf(stderr, "error: restore: %s\n", dtr_ckpt_last_error(ck)); goto done; }
    }

    fm_progress_init(&prog, 100);
    for (e = (int)(step / per) + 1; e <= o.epochs; e++) {
        double t0 = fm_now(), loss_sum = 0.0;
        int64_t b, seen = 0;
        for (b = step % per; b < per; b++) {   /* one epoch: the loader reshuffles each */
            dtr_batch batch;
            dtr_tensor *x, *y, *loss = NULL;
            double batch_loss;
            if ((r = dtr_loader_next(train, &batch)) != DTR_OK) { fprintf(stderr, "error: %s\n", dtr_loader_last_error(train)); goto done; }
            if ((r = dtr_loader_tensors(train, ctx, &batch, &x, &y)) != DTR_OK) { fm_fail(ctx, "batch", r); goto done; }
            if (o.graph && batch.size == o.batch) {   /* --graph: the captured step */
                if ((r = fm_graph_run(ctx, &gs, x, y, &loss)) != DTR_OK) { fm_fail(ctx, "captured step", r); goto done; }
            } else {
                loss = dtr_cross_entropy(ctx, mlp_forward(ctx, &net, x), y);
                if ((r = dtr_backward(ctx, loss)) != DTR_OK) { fm_fail(ctx, "backward", r); goto done; }
            }
            batch_loss = (double)dtr_tensor_get(loss, 0);   /* read before the reset */
            loss_sum += batch_loss * (double)batch.size;
            seen += batch.size;
            if ((r = dtr_optimizer_step(opt, NULL)) != DTR_OK) { fm_fail(ctx, "optimizer step", r); goto done; }
            fm_progress_step(&prog, e - 1, o.epochs, b + 1, dtr_loader_batches(train), batch.size, dtr_tensor_get(loss, 0));
            dtr_context_reset(ctx);
            if (metrics) {
                dtr_step_info info = {0};
                info.loss = batch_loss;
                info.samples = batch.size;
                info.epoch = e - 1;
                if ((r = dtr_metrics_step_end(metrics, &info, NULL)) != DTR_OK) { fm_fail(ctx, "metrics", r); goto done; }
            }
            if (ck && ++step % (o.ckpt_every ? o.ckpt_every : 200) == 0 && (r = dtr_ckpt_save(ck, step, NULL)) != DTR_OK) {
                fprintf(stderr, "error: checkpoint: %s\n", dtr_ckpt_last_error(ck));
                goto done;
            }
        }
        fm_progress_clear(&prog);
        if (metrics) dtr_metrics_step_begin(metrics);   /* evaluation is not a training step */
        if ((r = fm_evaluate_loader(ctx, mlp_forward, &net, test, &test_acc)) != DTR_OK) { fm_fail(ctx, "evaluation", r); goto done; }
        printf("epoch %2d  loss %.4f  test acc %.2f%%  %.1f s  %.0f samples/s\n", e, loss_sum / (double)seen,
               100.0 * test_acc, fm_now() - t0, (double)seen / (fm_now() - t0));
        fflush(stdout);
    }
    printf("final test accuracy: %.2f%%\n", 100.0 * test_acc);
    rc = 0;
    if (ck && (r = dtr_ckpt_wait(ck)) != DTR_OK) { fprintf(stderr, "error: checkpoint: %s\n", dtr_ckpt_last_error(ck)); rc = 1; }
done:
    fm_graph_free(&gs);
    dtr_ckpt_destroy(ck);
    dtr_metrics_destroy(metrics);   /* writes the timeline */
    dtr_optimizer_destroy(opt);
    dtr_model_destroy(net.model);
    dtr_loader_destroy(train);   /* before the context its buffers may come from */
    dtr_loader_destroy(test);
    dtr_context_destroy(ctx);
    dtr_dataset_destroy(train_ds);
    dtr_dataset_destroy(test_ds);
    return rc;
}
