/* examples/fed_fmnist.h: the federated Fashion-MNIST pieces shared by
 * examples/federated_fmnist.c, bench/federated.c and tests/test_federated.c, so the example,
 * the benchmark and the tests train the same way. Include after examples/common.h.
 *
 *   fed_shards      label-skewed non-IID shards: client k draws `skew` of its samples from
 *                   its two classes (2k, 2k+1 mod 10) and the rest from all classes
 *   fed_net_init    MLP 784-H-10 (ReLU); its parameters are one flat buffer (dtr_model_params)
 *   fed_local_train E epochs of mini-batch SGD (momentum 0.9, fresh each round) on a shard,
 *                   with the FedProx term when mu > 0
 *   fed_evaluate    accuracy of the flat weights on the first n test images
 *   fed_client_loop a whole client: next task -> train -> send, until the server is done
 *   fed_run         a whole federation on this machine: the clients as forked processes,
 *                   the server in this one, a callback after each round (POSIX) */
#ifndef DTRAIN_EXAMPLES_FED_FMNIST_H
#define DTRAIN_EXAMPLES_FED_FMNIST_H
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

typedef struct fed_net {
    dtr_context *ctx;
    dtr_model *model;
    dtr_linear_layer fc1, fc2;
    fm_batch b;
} fed_net;

/** The shard of client k: `per` indices into the training set, a fraction `skew` of them of
 *  the client's two classes (2k, 2k+1 mod 10), the rest of any class. malloc'ed. */
FM_FN int32_t *fed_shard(const dtr_mnist *d, int k, int64_t per, double skew, uint64_t seed) {
    int32_t *idx = (int32_t *)malloc((size_t)per * sizeof(int32_t));
    int64_t want_mine = (int64_t)(skew * (double)per), mine_got = 0, any_got = 0;
    dtr_rng rng;
    if (!idx) return NULL;
    dtr_rng_seed(&rng, seed, (uint64_t)k + 11);
    while (mine_got + any_got < per) {
        int32_t i = (int32_t)(dtr_rng_u32(&rng) % (uint32_t)d->train_n);
        int y = d->train_y[i];
        if ((y == (2 * k) % 10 || y == (2 * k + 1) % 10) && mine_got < want_mine) idx[mine_got++ + any_got] = i;
        else if (any_got < per - want_mine) idx[mine_got + any_got++] = i;
    }
    return idx;
}

FM_FN dtr_result fed_net_init(fed_net *n, int hidden, int threads, uint64_t seed) {
    dtr_context_config cc = dtr_context_config_init();
    dtr_result r;
    memset(n, 0, sizeof *n);
    cc.threads = threads;
    cc.seed = seed;
    if ((r = dtr_context_create(&cc, &n->ctx)) != DTR_OK) return r;
    if ((r = dtr_model_create(n->ctx, seed, &n->model)) != DTR_OK) return r;
    if ((r = dtr_linear_layer_init(&n->fc1, n->model, "fc1", FM_PIXELS, hidden, 1, DTR_INIT_KAIMING_UNIFORM)) != DTR_OK)
        return r;
    if ((r = dtr_linear_layer_init(&n->fc2, n->model, "fc2", hidden, FM_CLASSES, 1, DTR_INIT_KAIMING_UNIFORM)) != DTR_OK)
        return r;
    if ((r = dtr_model_build(n->model)) != DTR_OK) return r;
    return fm_batch_alloc(&n->b, 32);
}

FM_FN void fed_net_free(fed_net *n) {
    fm_batch_free(&n->b);
    dtr_model_destroy(n->model);
    dtr_context_destroy(n->ctx);
    memset(n, 0, sizeof *n);
}

FM_FN dtr_tensor *fed_forward(fed_net *n, dtr_tensor *x) {
    return dtr_linear_layer_forward(n->ctx, &n->fc2, dtr_relu(n->ctx, dtr_linear_layer_forward(n->ctx, &n->fc1, x)));
}

/** One step on rows X[idx[s..s+B)]: forward, backward, FedProx term, optimizer step. */
FM_FN dtr_result fed_step(fed_net *n, dtr_optimizer *opt, const dtr_mnist *d, const int32_t *idx, int64_t B,
                          const float *global, float mu) {
    int64_t i, xs[2], ys[1];
    dtr_tensor *loss;
    dtr_result r;
    for (i = 0; i < B; i++) {
        memcpy(n->b.x + i * FM_PIXELS, d->train_x + (int64_t)idx[i] * FM_PIXELS, FM_PIXELS * sizeof(float));
        n->b.y[i] = d->train_y[idx[i]];
    }
    xs[0] = B; xs[1] = FM_PIXELS; ys[0] = B;
    loss = dtr_cross_entropy(n->ctx, fed_forward(n, dtr_tensor_from(n->ctx, DTR_F32, 2, xs, n->b.x)),
                             dtr_tensor_from(n->ctx, DTR_I32, 1, ys, n->b.y));
    if (!loss) return dtr_context_status(n->ctx);
    if ((r = dtr_backward(n->ctx, loss)) != DTR_OK) return r;
    if (mu > 0.0f && (r = dtr_fed_prox(n->model, global, mu)) != DTR_OK) return r;
    if ((r = dtr_optimizer_step(opt, NULL)) != DTR_OK) return r;
    return dtr_context_reset(n->ctx);
}

/** E epochs of SGD (lr, momentum 0.9, batch 32) over the shard idx[0..per), starting from the
 *  model's current weights (= global when mu > 0). */
FM_FN dtr_result fed_local_train(fed_net *n, const dtr_mnist *d, int32_t *idx, int64_t per, int epochs, float lr,
                                 const float *global, float mu, uint64_t seed) {
    dtr_optimizer_config oc = fm_sgd_config(lr, 0.9f, 0);
    dtr_optimizer *opt = NULL;
    dtr_rng rng;
    dtr_result r = dtr_optimizer_create(n->model, &oc, &opt);
    int e;
    dtr_rng_seed(&rng, seed, 3);
    dtr_context_set_training(n->ctx, 1);
    dtr_context_set_grad_enabled(n->ctx, 1);
    for (e = 0; r == DTR_OK && e < epochs; e++) {
        int64_t s, i;
        for (i = per - 1; i > 0; i--) {   /* shuffle the shard */
            int64_t j = (int64_t)(dtr_rng_u32(&rng) % (uint32_t)(i + 1));
            int32_t t = idx[i];
            idx[i] = idx[j];
            idx[j] = t;
        }
        for (s = 0; r == DTR_OK && s < per; s += n->b.cap)
            r = fed_step(n, opt, d, idx + s, per - s < n->b.cap ? per - s : n->b.cap, global, mu);
    }
    dtr_optimizer_destroy(opt);
    return r;
}

/** Accuracy of `weights` on the first `count` test images. */
FM_FN dtr_result fed_evaluate(fed_net *n, const dtr_mnist *d, const float *weights, int64_t count, double *acc) {
    int grad = dtr_context_set_grad_enabled(n->ctx, 0), training = dtr_context_set_training(n->ctx, 0);
    int64_t s, correct = 0;
    dtr_result r = DTR_OK;
    memcpy(dtr_model_params(n->model), weights, (size_t)dtr_model_numel(n->model) * sizeof(float));
    if (count > d->test_n) count = d->test_n;
    for (s = 0; s < count; s += n->b.cap) {
        int64_t B = count - s < n->b.cap ? count - s : n->b.cap, xs[2];
        dtr_tensor *logits;
        xs[0] = B; xs[1] = FM_PIXELS;
        logits = fed_forward(n, dtr_tensor_from(n->ctx, DTR_F32, 2, xs, d->test_x + s * FM_PIXELS));
        if (!logits) { r = dtr_context_status(n->ctx); break; }
        if ((r = dtr_tensor_read(logits, DTR_F32, n->b.logits, (size_t)(B * FM_CLASSES))) != DTR_OK) break;
        correct += fm_count_correct(n->b.logits, d->test_y + s, B);
        if ((r = dtr_context_reset(n->ctx)) != DTR_OK) break;
    }
    dtr_context_set_grad_enabled(n->ctx, grad);
    dtr_context_set_training(n->ctx, training);
    *acc = count > 0 ? (double)correct / (double)count : 0.0;
    return r;
}

/** A client: joins, then trains each task on its shard and sends the weights, until the
 *  server says it is done (returns DTR_OK) or a call fails. `lr` is used when the task
 *  suggests none. */
FM_FN dtr_result fed_client_loop(const dtr_fed_client_config *cc, fed_net *n, const dtr_mnist *d, int32_t *idx,
                                 int64_t per, float lr, char *err, size_t errlen) {
    dtr_fed_client *cl = NULL;
    int64_t numel = dtr_model_numel(n->model);
    float *global = (float *)malloc((size_t)numel * sizeof(float));
    dtr_fed_task task;
    dtr_result r = global ? dtr_fed_client_create(cc, numel, &cl, err, errlen) : DTR_OUT_OF_MEMORY;
    while (r == DTR_OK && (r = dtr_fed_client_next(cl, global, &task)) == DTR_OK && !task.done) {
        memcpy(dtr_model_params(n->model), global, (size_t)numel * sizeof(float));
        r = fed_local_train(n, d, idx, per, task.local_epochs, task.lr > 0.0f ? task.lr : lr, global, task.mu,
                            (uint64_t)task.round * 131 + cc->client_id);
        if (r == DTR_OK) r = dtr_fed_client_send_weights(cl, dtr_model_params(n->model), (uint64_t)per);
        if (r == DTR_PEER_FAILED || r == DTR_TIMEOUT) r = DTR_OK;   /* lost update: the next task reconnects */
    }
    if (r != DTR_OK && cl && err && !err[0]) snprintf(err, errlen, "%s", dtr_fed_client_last_error(cl));
    dtr_fed_client_destroy(cl);
    free(global);
    return r;
}

/** What fed_run does. */
typedef struct fed_options {
    int clients, per_round, rounds, epochs, hidden, per_client, eval_n;
    double skew;
    float lr, mu;
    dtr_fed_codec codec;
    dtr_fed_aggregator aggregator;
    dtr_fed_server_opt server_opt;
    const char *secret;
} fed_options;

FM_FN fed_options fed_options_default(void) {
    fed_options o;
    memset(&o, 0, sizeof o);
    o.clients = 8; o.per_round = 8; o.rounds = 20; o.epochs = 2; o.hidden = 64; o.per_client = 800;
    o.eval_n = 10000; o.skew = 0.8; o.lr = 0.02f; o.secret = "federated-example";
    return o;
}

/** Called after each round with its stats and the test accuracy of the new global model. */
typedef void (*fed_round_fn)(void *user, const dtr_fed_round_stats *st, double acc);

/* A client process of fed_run: never returns. */
FM_FN void fed_child(const fed_options *o, const dtr_mnist *d, int port, int k) {
    dtr_fed_client_config cc = dtr_fed_client_config_init();
    fed_net n;
    int32_t *idx = fed_shard(d, k, o->per_client, o->skew, 5);
    char err[512] = "";
    dtr_result r;
    cc.port = port;
    cc.client_id = (uint64_t)k + 1;
    cc.codec = o->codec;
    snprintf(cc.secret, sizeof cc.secret, "%s", o->secret);
    if (!idx || fed_net_init(&n, o->hidden, 1, 1) != DTR_OK) _exit(3);
    r = fed_client_loop(&cc, &n, d, idx, o->per_client, o->lr, err, sizeof err);
    if (r != DTR_OK) fprintf(stderr, "client %d: %s: %s\n", k, dtr_result_string(r), err);
    _exit(r == DTR_OK ? 0 : 1);
}

/** Runs the federation of `o` on the data set `d` (loaded and standardised), calling
 *  `each` after every round. Returns DTR_OK, or the first error (message printed). */
FM_FN dtr_result fed_run(const fed_options *o, const dtr_mnist *d, fed_round_fn each, void *user) {
    dtr_fed_server_config sc = dtr_fed_server_config_init();
    dtr_fed_server *s = NULL;
    pid_t *pids = (pid_t *)calloc((size_t)o->clients, sizeof(pid_t));
    fed_net eval;
    char err[512];
    dtr_result r;
    int k, round;
    if (!pids) return DTR_OUT_OF_MEMORY;
    snprintf(sc.secret, sizeof sc.secret, "%s", o->secret);
    sc.clients_per_round = o->per_round;
    sc.min_updates = o->per_round > 1 ? o->per_round / 2 : 1;
    sc.round_timeout_ms = 60000;
    sc.local_epochs = o->epochs;
    sc.mu = o->mu;
    sc.codec = o->codec;
    sc.aggregator = o->aggregator;
    sc.server_opt = o->server_opt;
    if ((r = fed_net_init(&eval, o->hidden, 1, 1)) != DTR_OK ||
        (r = dtr_fed_server_create(&sc, dtr_model_params(eval.model), dtr_model_numel(eval.model), &s, err, sizeof err)) != DTR_OK) {
        fprintf(stderr, "server: %s: %s\n", dtr_result_string(r), err);
        fed_net_free(&eval);
        free(pids);
        return r;
    }
    fflush(NULL);
    for (k = 0; k < o->clients; k++)
        if ((pids[k] = fork()) == 0) fed_child(o, d, dtr_fed_server_port(s), k);
    r = dtr_fed_server_wait_clients(s, o->clients, 60000);
    for (round = 0; r == DTR_OK && round < o->rounds; round++) {
        dtr_fed_round_stats st;
        double acc = 0.0;
        if ((r = dtr_fed_server_round(s, &st)) != DTR_OK) break;
        if ((r = fed_evaluate(&eval, d, dtr_fed_server_weights(s), o->eval_n, &acc)) != DTR_OK) break;
        each(user, &st, acc);
    }
    if (r != DTR_OK) fprintf(stderr, "server: %s: %s\n", dtr_result_string(r), dtr_fed_server_last_error(s));
    dtr_fed_server_destroy(s);   /* the clients get "done" and exit */
    for (k = 0; k < o->clients; k++) {
        int status;
        if (pids[k] > 0) waitpid(pids[k], &status, 0);
    }
    fed_net_free(&eval);
    free(pids);
    return r;
}

#endif
