/* bench/fmnist.c: Fashion-MNIST training throughput and accuracy of dtrain, the peer of
 * bench/fmnist_torch.py (same networks, initialisation, data order rules and optimizer).
 *
 *   build/bench/fmnist [--model mlp|cnn] [--epochs E] [--threads T] [--batches N]
 *                      [--batch B] [--lr LR] [--schedule constant|cosine|onecycle] [--seed S] [--data DIR]
 *
 * Workload: the networks of examples/common.h (MLP 784-256-128-10 or the small CNN),
 * Kaiming-uniform weights, PyTorch-default biases, standardised pixels, batch 64, SGD
 * lr 0.05 momentum 0.9 (constant; --schedule cosine decays it to 0 along a cosine over the
 * run, stepped per batch as torch's CosineAnnealingLR; --schedule onecycle is torch's
 * OneCycleLR with max_lr LR over the run: 30% rising from LR / 25, the momentum cycled
 * between 0.95 and 0.85, its defaults), a seeded shuffle per epoch, the last
 * batch of an epoch smaller. --batches N stops each epoch after N steps (quick CNN timings).
 *
 * Output: one JSON line on stdout,
 *   {"bench":"fmnist","impl":"dtrain","model":"mlp","threads":1,"epochs":1,"batches":938,
 *    "schedule":"constant","train_s":1.6,"samples_per_s":37000,"test_acc":0.834,"best_test_acc":0.834}
 * train_s is the time of the training steps only (no data loading, no evaluation);
 * samples_per_s = samples trained / train_s; test_acc is measured on the 10000 test images
 * after the last epoch, best_test_acc is the best after any epoch. Per-epoch progress goes
 * to stderr. Data: --data, else $DTR_FMNIST_DIR, else /usr/share/datasets/fashion-mnist. */
#include "../examples/common.h"

int main(int argc, char **argv) {
    const char *model = "mlp", *dir = NULL, *schedule = "constant";
    int epochs = 1, threads = 1, batch = 64, i, e, rc = 1;
    long max_batches = 0;
    float lr = 0.05f;
    unsigned long seed = 1;
    dtr_context_config cfg = dtr_context_config_init();
    dtr_context *ctx = NULL;
    dtr_optimizer *opt = NULL;
    dtr_mnist data;
    fm_net net;
    fm_batch b;
    int32_t *order = NULL;
    dtr_rng rng;
    double train_s = 0.0, acc = 0.0, best = 0.0;
    int64_t samples = 0, steps = 0;
    dtr_result r;

    for (i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) { fprintf(stderr, "fmnist: %s needs a value (see the comment at the top of bench/fmnist.c)\n", a); return 2; }
        i++;
        if (strcmp(a, "--model") == 0) model = v;
        else if (strcmp(a, "--epochs") == 0) epochs = atoi(v);
        else if (strcmp(a, "--threads") == 0) threads = atoi(v);
        else if (strcmp(a, "--batches") == 0) max_batches = atol(v);
        else if (strcmp(a, "--batch") == 0) batch = atoi(v);
        else if (strcmp(a, "--lr") == 0) lr = (float)atof(v);
        else if (strcmp(a, "--schedule") == 0) schedule = v;
        else if (strcmp(a, "--seed") == 0) seed = strtoul(v, NULL, 10);
        else if (strcmp(a, "--data") == 0) dir = v;
        else { fprintf(stderr, "fmnist: unknown option %s\n", a); return 2; }
    }
    if ((strcmp(model, "mlp") != 0 && strcmp(model, "cnn") != 0) || epochs < 1 || threads < 0 || batch < 1 ||
        max_batches < 0 || !(lr > 0.0f) ||
        (strcmp(schedule, "constant") != 0 && strcmp(schedule, "cosine") != 0 && strcmp(schedule, "onecycle") != 0)) {
        fprintf(stderr, "fmnist: need --model mlp|cnn, --epochs >= 1, --threads >= 0, --batch >= 1, --batches >= 0, --lr > 0,\n"
                        "        --schedule constant|cosine|onecycle\n");
        return 2;
    }
    dir = fm_data_dir(dir);
    memset(&net, 0, sizeof net);
    memset(&b, 0, sizeof b);
    if (fm_data_load(dir, &data) != DTR_OK) return 1;

    cfg.threads = threads;
    if ((r = dtr_context_create(&cfg, &ctx)) != DTR_OK) { fm_fail(NULL, "dtr_context_create", r); goto done; }
    r = fm_net_init(&net, ctx, strcmp(model, "cnn") == 0 ? FM_CNN : FM_MLP, DTR_INIT_KAIMING_UNIFORM, seed);
    if (r != DTR_OK) { fm_fail(ctx, "model", r); goto done; }
    {
        int64_t per_epoch = (data.train_n + batch - 1) / batch;
        if (max_batches > 0 && max_batches < per_epoch) per_epoch = max_batches;
        dtr_optimizer_config oc = fm_sgd_config(lr, 0.9f, strcmp(schedule, "cosine") == 0 ? epochs * per_epoch : 0);
        if (strcmp(schedule, "onecycle") == 0) {   /* OneCycleLR(max_lr = lr, total_steps = the run)'s defaults */
            oc.schedule.kind = DTR_SCHED_ONE_CYCLE;
            oc.schedule.warmup_steps = (int64_t)(0.3 * (double)(epochs * per_epoch));
            oc.schedule.total_steps = epochs * per_epoch - oc.schedule.warmup_steps;
            oc.schedule.start_lr = lr / 25.0f, oc.schedule.min_lr = lr / 25.0f / 1e4f;
            oc.schedule.max_momentum = 0.95f, oc.schedule.base_momentum = 0.85f;
        }
        r = dtr_optimizer_create(net.model, &oc, &opt);
    }
    if (r != DTR_OK) { fm_fail(ctx, "optimizer", r); goto done; }
    order = (int32_t *)malloc((size_t)data.train_n * sizeof(int32_t));
    if (!order || fm_batch_alloc(&b, batch) != DTR_OK) {
        fprintf(stderr, "fmnist: out of memory\n");
        goto done;
    }
    dtr_rng_seed(&rng, seed, 1);
    for (e = 1; e <= epochs; e++) {
        fm_epoch_stats st;
        double t0;
        fm_shuffle(&rng, order, data.train_n);
        t0 = fm_now();
        r = fm_train_epoch(ctx, &net, opt, data.train_x, data.train_y, order, data.train_n, &b, max_batches, &st);
        train_s += fm_now() - t0;
        if (r != DTR_OK) { fm_fail(ctx, "training", r); goto done; }
        samples += st.samples;
        steps += st.steps;
        if ((r = fm_evaluate(ctx, &net, data.test_x, data.test_y, data.test_n, &b, &acc)) != DTR_OK) {
            fm_fail(ctx, "evaluation", r);
            goto done;
        }
        if (acc > best) best = acc;
        fprintf(stderr, "fmnist dtrain %s: epoch %d loss %.4f train_acc %.4f test_acc %.4f (%.1f s training so far)\n",
                model, e, st.loss, st.acc, acc, train_s);
    }
    printf("{\"bench\":\"fmnist\",\"impl\":\"dtrain\",\"model\":\"%s\",\"threads\":%d,\"epochs\":%d,\"batches\":%lld,"
           "\"schedule\":\"%s\",\"train_s\":%.3f,\"samples_per_s\":%.1f,\"test_acc\":%.4f,\"best_test_acc\":%.4f}\n",
           model, dtr_context_threads(ctx), epochs, (long long)steps, schedule, train_s,
           train_s > 0 ? (double)samples / train_s : 0.0, acc, best);
    rc = 0;
done:
    free(order);
    fm_batch_free(&b);
    dtr_optimizer_destroy(opt);
    fm_net_free(&net);
    dtr_context_destroy(ctx);
    dtr_mnist_destroy(&data);
    return rc;
}
