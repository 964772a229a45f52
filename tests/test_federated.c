/* tests/test_federated.c: federated learning (src/fed/federated.c) with real processes over
 * TCP on 127.0.0.1: the server runs in this process, every client is a forked process.
 *
 *   test_fedavg_equals_central  3 clients of 8/16/24 rows, one full-batch GD step a round:
 *                               FedAvg's model after 3 rounds equals centralised GD (rel 1e-5)
 *   test_noniid_fmnist          8 label-skewed clients, MLP, >= 80% test accuracy within 20 rounds
 *   test_fedprox_skewed         pathological 2-class shards: FedProx (mu 0.1) >= FedAvg - 1 point
 *   test_faults                 NaN, huge-norm, silent, SIGKILLed, wrong-shape, garbage and
 *                               wrong-secret peers: rounds finish, the model stays finite and good
 *   test_median_robust          2 of 8 clients send crafted bounded updates: median keeps the
 *                               model good where the mean does not
 *   test_server_restart         a SIGKILLed server restarts from its checkpoint at the same
 *                               round, its clients (still running) rejoin and the run goes on
 *   test_config_errors          bad configurations and joins get clear errors
 * Data: Fashion-MNIST ($DTR_FMNIST_DIR or /usr/share/datasets/fashion-mnist). */
#include "../examples/common.h"
#include "test.h"
#include "test_util.h"
#include "posix_util.h"
#include "dp_mlp.h"
#include "../examples/fed_fmnist.h"

#include <signal.h>
#include <sys/wait.h>

/* the raw-message hook of src/fed/federated.c (tests only) */
dtr_result dtr__fed_client_send_raw(dtr_fed_client *c, int type, int codec, uint64_t task, uint64_t arg,
                                    const void *body, uint64_t len);

static const char *SECRET = "fed-test-secret";
static dtr_mnist g_data;
static int g_have_data = -1;

static int have_data(void) {
    if (g_have_data < 0) g_have_data = fm_data_load(fm_data_dir(NULL), &g_data) == DTR_OK;
    CHECK_MSG(g_have_data, "Fashion-MNIST not found at %s", fm_data_dir(NULL));
    return g_have_data;
}

static dtr_fed_client_config client_cfg(int port, uint64_t id) {
    dtr_fed_client_config cc = dtr_fed_client_config_init();
    cc.port = port;
    cc.client_id = id;
    cc.timeout_ms = 20000;
    snprintf(cc.secret, sizeof cc.secret, "%s", SECRET);
    return cc;
}

static dtr_fed_server_config server_cfg(int k) {
    dtr_fed_server_config sc = dtr_fed_server_config_init();
    sc.clients_per_round = k;
    sc.min_updates = k;
    sc.round_timeout_ms = 15000;
    sc.join_timeout_ms = 15000;
    snprintf(sc.secret, sizeof sc.secret, "%s", SECRET);
    return sc;
}

static pid_t fork_child(void) {
    pid_t pid;
    fflush(NULL);
    pid = fork();
    if (pid < 0) { perror("fork"); exit(2); }
    if (pid == 0) alarm(120);
    return pid;
}

/* Exit code of pid (-signal when killed); SIGKILL after timeout_ms. */
static int reap(pid_t pid, int timeout_ms) {
    int64_t end = now_ms() + timeout_ms;
    int status;
    for (;;) {
        pid_t r = waitpid(pid, &status, WNOHANG);
        if (r == pid) return WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
        if (r < 0) return -2000;
        if (now_ms() > end) {
            kill(pid, SIGKILL);
            waitpid(pid, &status, 0);
            return -1000;
        }
        sleep_ms(5);
    }
}

/* ---- FedAvg == centralised GD ---- */

#define GD_LR 0.1f

static void gd_opt(mlp *n) {
    dtr_optimizer_config oc = dtr_optimizer_config_init(DTR_OPT_SGD, GD_LR);
    dtr_optimizer_destroy(n->opt);
    n->opt = NULL;
    (void)dtr_optimizer_create(n->m, &oc, &n->opt);
}

/* A client process: one full-batch GD step on rows [r0, r0 + b) of the hashed data per task. */
static void gd_client(int port, uint64_t id, int64_t r0, int64_t b) {
    dtr_fed_client_config cc = client_cfg(port, id);
    dtr_fed_client *cl = NULL;
    dtr_fed_task task;
    mlp n;
    char err[512];
    int rc = 0;
    if (!mlp_init(&n, 1, 1)) _exit(3);
    gd_opt(&n);
    if (dtr_fed_client_create(&cc, dtr_model_numel(n.m), &cl, err, sizeof err) != DTR_OK) {
        fprintf(stderr, "gd client %llu: %s\n", (unsigned long long)id, err);
        _exit(4);
    }
    while (dtr_fed_client_next(cl, dtr_model_params(n.m), &task) == DTR_OK && !task.done) {
        if (mlp_backward(&n, 0, r0, b) != DTR_OK || dtr_optimizer_step(n.opt, NULL) != DTR_OK ||
            dtr_context_reset(n.ctx) != DTR_OK) { rc = 5; break; }
        if (dtr_fed_client_send_weights(cl, dtr_model_params(n.m), (uint64_t)b) != DTR_OK) continue;
    }
    dtr_fed_client_destroy(cl);
    _exit(rc);
}

static void spawn_gd_clients(int port, pid_t *pids) {
    int k;
    for (k = 0; k < 3; k++) {
        pids[k] = fork_child();
        if (pids[k] == 0) gd_client(port, (uint64_t)k + 1, 8 * (k * (k + 1) / 2), 8 * (k + 1));
    }
}

/* 3 rounds of FedAvg with one GD step per client against centralised training on all rows:
 * plain averaging equals GD, server momentum (beta 0.9, lr 1) equals SGD with momentum 0.9. */
static void fedavg_vs_central(dtr_fed_server_opt opt, float momentum) {
    dtr_fed_server_config sc = server_cfg(3);
    dtr_optimizer_config oc = dtr_optimizer_config_init(DTR_OPT_SGD, GD_LR);
    dtr_fed_server *s = NULL;
    pid_t pids[3];
    mlp central;
    char err[512];
    int k, r;
    CHECK(mlp_init(&central, 1, 1));
    dtr_optimizer_destroy(central.opt);
    oc.momentum = momentum;
    CHECK_OK(central.ctx, dtr_optimizer_create(central.m, &oc, &central.opt));
    sc.port = free_port();
    sc.server_opt = opt;
    spawn_gd_clients(sc.port, pids);
    CHECK_EQ_INT(dtr_fed_server_create(&sc, dtr_model_params(central.m), dtr_model_numel(central.m), &s, err, sizeof err), DTR_OK);
    if (s) CHECK_EQ_INT(dtr_fed_server_wait_clients(s, 3, 15000), DTR_OK);
    for (r = 0; s && r < 3; r++) {
        dtr_fed_round_stats st;
        CHECK_EQ_INT(dtr_fed_server_round(s, &st), DTR_OK);
        CHECK_EQ_INT(st.accepted, 3);
        CHECK_EQ_INT(st.samples, 48);
        CHECK_OK(central.ctx, mlp_backward(&central, 0, 0, 48));   /* the same rows, all at once */
        CHECK_OK(central.ctx, dtr_optimizer_step(central.opt, NULL));
        CHECK_OK(central.ctx, dtr_context_reset(central.ctx));
    }
    if (s) {
        double e = rel_err(dtr_fed_server_weights(s), dtr_model_params(central.m), dtr_model_numel(central.m));
        printf("     %s vs centralised SGD (momentum %.1f) after 3 rounds: relative error %.3g\n",
               opt == DTR_FED_OPT_AVG ? "FedAvg" : "FedAvg + server momentum", (double)momentum, e);
        CHECK_MSG(e <= 1e-5, "relative error %g", e);
        CHECK_EQ_INT(dtr_fed_server_round_index(s), 3);
    }
    dtr_fed_server_destroy(s);
    for (k = 0; k < 3; k++) CHECK_EQ_INT(reap(pids[k], 10000), 0);
    mlp_free(&central);
}

static void test_fedavg_equals_central(void) {
    fedavg_vs_central(DTR_FED_OPT_AVG, 0.0f);
    fedavg_vs_central(DTR_FED_OPT_MOMENTUM, 0.9f);
}

/* One round of the 3 GD clients under `sc`; returns its stats (round result in *rr). */
static dtr_fed_round_stats gd_round(dtr_fed_server_config sc, dtr_result *rr, float *w_out) {
    dtr_fed_round_stats st;
    dtr_fed_server *s = NULL;
    pid_t pids[3];
    mlp n;
    char err[512];
    int k;
    memset(&st, 0, sizeof st);
    *rr = DTR_BAD_STATE;
    CHECK(mlp_init(&n, 1, 1));
    sc.port = free_port();
    spawn_gd_clients(sc.port, pids);
    CHECK_EQ_INT(dtr_fed_server_create(&sc, dtr_model_params(n.m), dtr_model_numel(n.m), &s, err, sizeof err), DTR_OK);
    if (s && dtr_fed_server_wait_clients(s, 3, 15000) == DTR_OK) *rr = dtr_fed_server_round(s, &st);
    if (s && w_out) memcpy(w_out, dtr_fed_server_weights(s), (size_t)dtr_model_numel(n.m) * sizeof(float));
    dtr_fed_server_destroy(s);
    for (k = 0; k < 3; k++) CHECK_EQ_INT(reap(pids[k], 10000), 0);
    mlp_free(&n);
    return st;
}

/* Clipping scales every update to clip_norm; the noise of differential privacy has the
 * documented size: std z * clip_norm * max(samples) / sum(samples) per value. */
static void test_clip_and_dp(void) {
    dtr_fed_server_config sc = server_cfg(3);
    dtr_fed_round_stats st;
    dtr_result rr;
    mlp n;
    double sigma, want;
    CHECK(mlp_init(&n, 1, 1));
    sc.clip_norm = 1e-3f;
    st = gd_round(sc, &rr, NULL);
    CHECK_EQ_INT(rr, DTR_OK);
    CHECK_EQ_INT(st.clipped, 3);
    CHECK_MSG(st.update_norm <= 1e-3 * (1 + 1e-5), "aggregate norm %g above the clip", st.update_norm);
    sc.clip_norm = 1e-6f;   /* the updates vanish next to the noise */
    sc.dp_noise_multiplier = 2.0f;
    st = gd_round(sc, &rr, NULL);
    CHECK_EQ_INT(rr, DTR_OK);
    sigma = 2.0 * 1e-6 * 24.0 / 48.0;
    want = sigma * sqrt((double)dtr_model_numel(n.m));
    printf("     dp noise: aggregate norm %.4g, expected about %.4g\n", st.update_norm, want);
    CHECK_MSG(st.update_norm > 0.8 * want && st.update_norm < 1.2 * want, "norm %g, expected %g", st.update_norm, want);
    mlp_free(&n);
}

/* Too few clients: the round is attempted max_attempts times within its bound, returns
 * DTR_TIMEOUT and leaves the model alone; once a third client joins the round goes through. */
static void test_round_repeats(void) {
    dtr_fed_server_config sc = server_cfg(3);
    dtr_fed_server *s = NULL;
    dtr_fed_round_stats st;
    pid_t pids[3];
    mlp n;
    char err[512];
    int64_t t0;
    int k;
    CHECK(mlp_init(&n, 1, 1));
    sc.port = free_port();
    sc.join_timeout_ms = 300;
    sc.round_timeout_ms = 300;
    sc.max_attempts = 2;
    for (k = 0; k < 2; k++) {
        pids[k] = fork_child();
        if (pids[k] == 0) gd_client(sc.port, (uint64_t)k + 1, 8 * k, 8);
    }
    CHECK_EQ_INT(dtr_fed_server_create(&sc, dtr_model_params(n.m), dtr_model_numel(n.m), &s, err, sizeof err), DTR_OK);
    if (s) {
        CHECK_EQ_INT(dtr_fed_server_wait_clients(s, 2, 15000), DTR_OK);
        t0 = now_ms();
        CHECK_EQ_INT(dtr_fed_server_round(s, &st), DTR_TIMEOUT);
        CHECK_MSG(now_ms() - t0 < 2 * 600 + 1000, "took %lld ms", (long long)(now_ms() - t0));
        CHECK_EQ_INT(st.attempts, 2);
        CHECK_EQ_INT(dtr_fed_server_round_index(s), 0);
        CHECK(memcmp(dtr_fed_server_weights(s), dtr_model_params(n.m), (size_t)dtr_model_numel(n.m) * 4) == 0);
        CHECK(strstr(dtr_fed_server_last_error(s), "fewer than 3") != NULL);
        pids[2] = fork_child();
        if (pids[2] == 0) gd_client(sc.port, 3, 16, 8);
        CHECK_EQ_INT(dtr_fed_server_wait_clients(s, 3, 15000), DTR_OK);
        CHECK_EQ_INT(dtr_fed_server_round(s, &st), DTR_OK);
        CHECK_EQ_INT(st.accepted, 3);
    }
    dtr_fed_server_destroy(s);
    for (k = 0; k < 3; k++)
        if (k < 2 || s) CHECK_EQ_INT(reap(pids[k], 10000), 0);
    mlp_free(&n);
}

/* FedAdam's first step: m = (1-b1) d, v = (1-b2) d^2, w += lr m / (sqrt(v) + eps), with d the
 * average of the clients' GD steps (= -0.1 x the gradient over all rows). */
static void test_fedadam_step(void) {
    dtr_fed_server_config sc = server_cfg(3);
    dtr_result rr;
    mlp n;
    int64_t i, numel;
    float *w, *want;
    CHECK(mlp_init(&n, 1, 1));
    numel = dtr_model_numel(n.m);
    w = (float *)malloc((size_t)numel * sizeof(float));
    want = (float *)malloc((size_t)numel * sizeof(float));
    sc.server_opt = DTR_FED_OPT_ADAM;
    (void)gd_round(sc, &rr, w);
    CHECK_EQ_INT(rr, DTR_OK);
    CHECK_OK(n.ctx, mlp_backward(&n, 0, 0, 48));
    for (i = 0; i < numel; i++) {
        float d = -GD_LR * dtr_model_grads(n.m)[i], m = 0.1f * d, v = 0.01f * d * d;
        want[i] = dtr_model_params(n.m)[i] + 0.01f * m / (sqrtf(v) + 1e-3f);
    }
    CHECK_MSG(rel_err(w, want, numel) <= 1e-5, "FedAdam step: relative error %g", rel_err(w, want, numel));
    free(w);
    free(want);
    mlp_free(&n);
}

/* ---- Fashion-MNIST clients ---- */

typedef enum { HONEST, SEND_NAN, SEND_HUGE, SILENT, BYZANTINE } behaviour;

typedef struct fm_run {
    int clients, per, hidden, epochs, rounds;
    double skew;
    float lr;
} fm_run;

/* A Fashion-MNIST client process that behaves as told. */
static void fm_client(int port, int k, const fm_run *run, behaviour how, dtr_fed_codec codec) {
    dtr_fed_client_config cc = client_cfg(port, (uint64_t)k + 100);
    fed_net n;
    int32_t *idx = fed_shard(&g_data, k, run->per, run->skew, 5);
    char err[512] = "";
    dtr_result r;
    cc.codec = codec;
    if (!idx || fed_net_init(&n, run->hidden, 1, 1) != DTR_OK) _exit(3);
    if (how == HONEST) {
        r = fed_client_loop(&cc, &n, &g_data, idx, run->per, run->lr, err, sizeof err);
        if (r != DTR_OK) fprintf(stderr, "client %d: %s: %s\n", k, dtr_result_string(r), err);
        _exit(r == DTR_OK ? 0 : 6);
    } else {
        dtr_fed_client *cl = NULL;
        int64_t i, numel = dtr_model_numel(n.model);
        float *w = (float *)malloc((size_t)numel * sizeof(float)), *u = (float *)malloc((size_t)numel * sizeof(float));
        dtr_fed_task task;
        if (!w || !u || dtr_fed_client_create(&cc, numel, &cl, err, sizeof err) != DTR_OK) _exit(4);
        while (dtr_fed_client_next(cl, w, &task) == DTR_OK && !task.done) {
            if (how == SILENT) { sleep_ms(60000); break; }
            for (i = 0; i < numel; i++)
                u[i] = how == SEND_NAN ? (i % 7 ? 0.01f : NAN) : how == SEND_HUGE ? 1e5f : -3.0f * w[i] + 0.3f;
            (void)dtr_fed_client_send(cl, u, 1000000);   /* and claims many samples */
        }
        dtr_fed_client_destroy(cl);
        _exit(0);
    }
}

/* Runs a Fashion-MNIST federation with n honest clients plus the extra peers; returns the
 * best and last accuracy on 2000 test images. */
typedef struct fm_result { double best, last, tail; int bad_rounds; int rejected; } fm_result;

static fm_result fm_federation(const fm_run *run, dtr_fed_server_config sc, const behaviour *how, int kill_one) {
    fm_result res = {0.0, 0.0, 0.0, 0, 0};
    dtr_fed_server *s = NULL;
    pid_t pids[16];
    fed_net eval;
    char err[512];
    int k, r;
    sc.port = free_port();
    for (k = 0; k < run->clients; k++) {
        pids[k] = fork_child();
        if (pids[k] == 0) fm_client(sc.port, k, run, how ? how[k] : HONEST, k % 2 ? DTR_FED_BF16 : DTR_FED_F32);
    }
    CHECK_OK(NULL, fed_net_init(&eval, run->hidden, 1, 1));
    CHECK_EQ_INT(dtr_fed_server_create(&sc, dtr_model_params(eval.model), dtr_model_numel(eval.model), &s, err, sizeof err), DTR_OK);
    if (!s) fprintf(stderr, "  %s\n", err);
    if (s) CHECK_EQ_INT(dtr_fed_server_wait_clients(s, run->clients, 20000), DTR_OK);
    for (r = 0; s && r < run->rounds; r++) {
        dtr_fed_round_stats st;
        dtr_result rr;
        int64_t i;
        if (kill_one && r == 1) kill(pids[0], SIGKILL);   /* mid-run: the server must notice */
        rr = dtr_fed_server_round(s, &st);
        if (rr != DTR_OK) { res.bad_rounds++; fprintf(stderr, "  round %d: %s\n", r, dtr_fed_server_last_error(s)); continue; }
        for (i = 0; i < dtr_model_numel(eval.model); i++)
            if (!isfinite(dtr_fed_server_weights(s)[i])) { res.bad_rounds++; break; }
        CHECK_OK(eval.ctx, fed_evaluate(&eval, &g_data, dtr_fed_server_weights(s), 2000, &res.last));
        if (res.last > res.best) res.best = res.last;
        if (r >= run->rounds - 4) res.tail += res.last / 4;   /* mean of the last 4 rounds */
        res.rejected += st.rejected;
        printf("     round %2lld: acc %.2f%%  accepted %d/%d rejected %d late %d dropped %d  %.2f s  %llu B out\n",
               (long long)st.round, 100.0 * res.last, st.accepted, st.sampled, st.rejected, st.late, st.dropped_clients,
               st.seconds, (unsigned long long)st.bytes_sent);
        fflush(stdout);
    }
    dtr_fed_server_destroy(s);
    for (k = 0; k < run->clients; k++) {
        int rc = reap(pids[k], how && how[k] == SILENT ? 100 : 15000);
        if (!(kill_one && k == 0) && !(how && how[k] == SILENT)) CHECK_EQ_INT(rc, 0);
    }
    fed_net_free(&eval);
    return res;
}

static void test_noniid_fmnist(void) {
    fm_run run = {8, 800, 64, 2, 20, 0.8, 0.02f};
    dtr_fed_server_config sc = server_cfg(8);
    fm_result res;
    if (!have_data()) return;
    res = fm_federation(&run, sc, NULL, 0);
    printf("     8 clients, 80%% label skew, %d images each: best %.2f%%, last %.2f%%\n", run.per, 100 * res.best,
           100 * res.last);
    CHECK_EQ_INT(res.bad_rounds, 0);
    CHECK_MSG(res.best >= 0.80, "best accuracy %.4f below 0.80 within %d rounds", res.best, run.rounds);
}

static void test_fedprox_skewed(void) {
    fm_run run = {8, 300, 32, 3, 10, 1.0, 0.05f};
    dtr_fed_server_config sc = server_cfg(8);
    fm_result avg, prox;
    if (!have_data()) return;
    avg = fm_federation(&run, sc, NULL, 0);
    sc.mu = 0.5f;
    prox = fm_federation(&run, sc, NULL, 0);
    printf("     2-class shards, E=3, mean of the last 4 rounds: FedAvg %.2f%%, FedProx mu 0.5 %.2f%%\n",
           100 * avg.tail, 100 * prox.tail);
    CHECK_EQ_INT(avg.bad_rounds + prox.bad_rounds, 0);
    CHECK_MSG(prox.tail >= avg.tail - 0.01, "FedProx %.4f below FedAvg %.4f", prox.tail, avg.tail);
}

/* A peer that connects and writes garbage; returns after the server closed it. */
static void garbage_peer(int port) {
    struct sockaddr_in a;
    uint8_t junk[300];
    int i, fd = socket(AF_INET, SOCK_STREAM, 0);
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_port = htons((uint16_t)port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    for (i = 0; i < (int)sizeof junk; i++) junk[i] = (uint8_t)(i * 37 + 11);
    if (fd >= 0 && connect(fd, (struct sockaddr *)&a, sizeof a) == 0) {
        ssize_t w = write(fd, junk, sizeof junk);
        (void)w;
        sleep_ms(200);
    }
    if (fd >= 0) close(fd);
}

/* Peers that break the rules from their own process: garbage bytes, a wrong secret, a model
 * of the wrong size, and an authenticated client that sends a body of the wrong length. */
static void rule_breakers(int port, int numel) {
    dtr_fed_client_config cc = client_cfg(port, 999);
    dtr_fed_client *cl = NULL;
    char err[512];
    float *w = (float *)calloc((size_t)numel, sizeof(float));
    dtr_fed_task task;
    int rc = 0;
    garbage_peer(port);
    snprintf(cc.secret, sizeof cc.secret, "wrong");
    if (dtr_fed_client_create(&cc, numel, &cl, err, sizeof err) != DTR_INVALID_ARGUMENT) rc |= 1;
    snprintf(cc.secret, sizeof cc.secret, "%s", SECRET);
    if (dtr_fed_client_create(&cc, numel - 1, &cl, err, sizeof err) != DTR_SHAPE_MISMATCH) rc |= 2;
    cc.no_reconnect = 1;
    if (dtr_fed_client_create(&cc, numel, &cl, err, sizeof err) != DTR_OK) rc |= 4;
    else if (dtr_fed_client_next(cl, w, &task) == DTR_OK && !task.done) {
        (void)dtr__fed_client_send_raw(cl, 2, 0, 0, 10, w, (uint64_t)(numel - 1) * 4);   /* wrong shape */
        if (dtr_fed_client_next(cl, w, &task) == DTR_OK && !task.done) rc |= 8;   /* must be dropped */
    }
    dtr_fed_client_destroy(cl);
    free(w);
    _exit(rc);
}

static void test_faults(void) {
    fm_run run = {8, 300, 32, 1, 6, 0.0, 0.05f};
    behaviour how[8] = {HONEST, HONEST, HONEST, HONEST, HONEST, SEND_NAN, SEND_HUGE, SILENT};
    dtr_fed_server_config sc = server_cfg(8);
    fm_result res;
    if (!have_data()) return;
    sc.min_updates = 3;
    sc.round_timeout_ms = 2500;
    sc.codec = DTR_FED_BF16;   /* the weights go out in bf16 too */
    res = fm_federation(&run, sc, how, 1);
    printf("     faults (NaN, huge norm, silent, one SIGKILLed): last %.2f%%, %d updates rejected\n", 100 * res.last,
           res.rejected);
    CHECK_EQ_INT(res.bad_rounds, 0);
    CHECK_MSG(res.rejected >= 2, "only %d updates rejected", res.rejected);
    CHECK_MSG(res.last >= 0.70, "accuracy %.4f after faults", res.last);
}

static void test_rule_breakers(void) {
    dtr_fed_server_config sc = server_cfg(3);
    dtr_fed_server *s = NULL;
    pid_t pids[3];
    mlp n;
    char err[512];
    int k, r;
    CHECK(mlp_init(&n, 1, 1));
    sc.port = free_port();
    sc.min_updates = 2;
    sc.round_timeout_ms = 3000;
    for (k = 0; k < 2; k++) {
        pids[k] = fork_child();
        if (pids[k] == 0) gd_client(sc.port, (uint64_t)k + 1, 8 * k, 8);
    }
    pids[2] = fork_child();
    if (pids[2] == 0) rule_breakers(sc.port, (int)dtr_model_numel(n.m));
    CHECK_EQ_INT(dtr_fed_server_create(&sc, dtr_model_params(n.m), dtr_model_numel(n.m), &s, err, sizeof err), DTR_OK);
    if (s) CHECK_EQ_INT(dtr_fed_server_wait_clients(s, 3, 15000), DTR_OK);   /* all three are sampled */
    for (r = 0; s && r < 4; r++) {
        dtr_fed_round_stats st;
        int64_t i;
        CHECK_EQ_INT(dtr_fed_server_round(s, &st), DTR_OK);
        if (r == 0) CHECK_EQ_INT(st.dropped_clients, 1);   /* the wrong-shape update */
        CHECK_EQ_INT(st.accepted, 2);
        for (i = 0; i < dtr_model_numel(n.m); i++) CHECK(isfinite(dtr_fed_server_weights(s)[i]));
    }
    if (s) CHECK_EQ_INT(dtr_fed_server_round_index(s), 4);
    dtr_fed_server_destroy(s);
    for (k = 0; k < 3; k++) CHECK_EQ_INT(reap(pids[k], 15000), 0);
    mlp_free(&n);
}

static void test_median_robust(void) {
    fm_run run = {8, 300, 32, 1, 5, 0.0, 0.05f};
    behaviour how[8] = {HONEST, HONEST, HONEST, HONEST, HONEST, HONEST, BYZANTINE, BYZANTINE};
    dtr_fed_server_config sc = server_cfg(8);
    fm_result mean, median, trimmed;
    if (!have_data()) return;
    sc.max_update_norm = -1.0f;   /* the crafted updates pass every check but their intent */
    mean = fm_federation(&run, sc, how, 0);
    sc.aggregator = DTR_FED_MEDIAN;
    median = fm_federation(&run, sc, how, 0);
    sc.aggregator = DTR_FED_TRIMMED_MEAN;
    sc.trim_fraction = 0.25f;
    trimmed = fm_federation(&run, sc, how, 0);
    printf("     2 of 8 byzantine: mean last %.2f%%, median %.2f%%, trimmed mean (25%%) %.2f%%\n", 100 * mean.last,
           100 * median.last, 100 * trimmed.last);
    CHECK_MSG(median.last >= 0.70, "median %.4f", median.last);
    CHECK_MSG(trimmed.last >= 0.70, "trimmed mean %.4f", trimmed.last);
    CHECK_MSG(median.last > mean.last + 0.1, "median %.4f not better than mean %.4f", median.last, mean.last);
}

/* ---- server restart ---- */

/* The server process: runs rounds forever (until killed), checkpointing each. */
static void server_proc(dtr_fed_server_config sc, const float *w, int64_t numel) {
    dtr_fed_server *s = NULL;
    char err[512];
    if (dtr_fed_server_create(&sc, w, numel, &s, err, sizeof err) != DTR_OK) _exit(3);
    (void)dtr_fed_server_wait_clients(s, 3, 15000);
    for (;;) {
        (void)dtr_fed_server_round(s, NULL);
        sleep_ms(50);
    }
}

static int64_t ckpt_round(const char *path, float *w, int64_t numel) {
    dtr_st_file f;
    int64_t round = -1;
    int i;
    if (dtr_st_open(path, NULL, &f, NULL, 0) != DTR_OK) return -1;
    for (i = 0; i < f.count; i++) {
        if (strcmp(f.entries[i].name, "fed.state") == 0) round = ((const int32_t *)f.entries[i].data)[0];
        if (strcmp(f.entries[i].name, "fed.weights") == 0 && w) memcpy(w, f.entries[i].data, (size_t)numel * 4);
    }
    dtr_st_destroy(&f);
    return round;
}

static void test_server_restart(void) {
    dtr_fed_server_config sc = server_cfg(3);
    dtr_fed_server *s = NULL;
    pid_t pids[3], srv;
    char path[1000], err[512];
    mlp n;
    float *w;
    int64_t numel, saved = -1, deadline;
    int k;
    CHECK(mlp_init(&n, 1, 1));
    numel = dtr_model_numel(n.m);
    w = (float *)malloc((size_t)numel * sizeof(float));
    tmp_path("fed_ckpt", "safetensors", path, sizeof path);
    remove(path);
    sc.port = free_port();
    sc.server_opt = DTR_FED_OPT_MOMENTUM;
    snprintf(sc.checkpoint_path, sizeof sc.checkpoint_path, "%s", path);
    spawn_gd_clients(sc.port, pids);
    srv = fork_child();
    if (srv == 0) server_proc(sc, dtr_model_params(n.m), numel);
    deadline = now_ms() + 20000;
    while (now_ms() < deadline && ckpt_round(path, NULL, numel) < 3) sleep_ms(20);
    kill(srv, SIGKILL);
    reap(srv, 5000);
    saved = ckpt_round(path, w, numel);
    CHECK_MSG(saved >= 3, "checkpoint at round %lld", (long long)saved);
    CHECK_EQ_INT(dtr_fed_server_create(&sc, dtr_model_params(n.m), numel, &s, err, sizeof err), DTR_OK);
    if (s) {
        dtr_fed_round_stats st;
        CHECK_EQ_INT(dtr_fed_server_round_index(s), saved);
        CHECK(memcmp(dtr_fed_server_weights(s), w, (size_t)numel * 4) == 0);
        CHECK_EQ_INT(dtr_fed_server_round(s, &st), DTR_OK);   /* the clients rejoined by themselves */
        CHECK_EQ_INT(st.round, saved);
        CHECK_EQ_INT(st.accepted, 3);
        CHECK_EQ_INT(dtr_fed_server_round(s, &st), DTR_OK);
        CHECK_EQ_INT(ckpt_round(path, NULL, numel), saved + 2);
    }
    dtr_fed_server_destroy(s);
    for (k = 0; k < 3; k++) CHECK_EQ_INT(reap(pids[k], 10000), 0);
    remove(path);
    free(w);
    mlp_free(&n);
}

static void test_config_errors(void) {
    dtr_fed_server_config sc = dtr_fed_server_config_init();
    dtr_fed_client_config cc = dtr_fed_client_config_init();
    dtr_fed_server *s = NULL;
    dtr_fed_client *c = NULL;
    float w[4] = {0};
    char err[512];
    CHECK_EQ_INT(dtr_fed_server_create(&sc, w, 4, &s, err, sizeof err), DTR_INVALID_ARGUMENT);   /* no secret */
    snprintf(sc.secret, sizeof sc.secret, "s");
    sc.dp_noise_multiplier = 1.0f;
    CHECK_EQ_INT(dtr_fed_server_create(&sc, w, 4, &s, err, sizeof err), DTR_INVALID_ARGUMENT);
    CHECK(strstr(err, "clip_norm") != NULL);
    sc.dp_noise_multiplier = 0.0f;
    CHECK_EQ_INT(dtr_fed_server_create(&sc, w, 0, &s, err, sizeof err), DTR_INVALID_ARGUMENT);
    sc.trim_fraction = 0.7f;
    CHECK_EQ_INT(dtr_fed_server_create(&sc, w, 4, &s, err, sizeof err), DTR_INVALID_ARGUMENT);
    CHECK(s == NULL);
    CHECK_EQ_INT(dtr_fed_server_create(NULL, w, 4, &s, err, sizeof err), DTR_NULL_HANDLE);
    CHECK_EQ_INT(dtr_fed_client_create(&cc, 4, &c, err, sizeof err), DTR_INVALID_ARGUMENT);   /* no secret, port */
    CHECK(c == NULL);
    CHECK_EQ_INT(dtr_fed_server_round(NULL, NULL), DTR_NULL_HANDLE);
    CHECK_EQ_INT(dtr_fed_client_send(NULL, w, 1), DTR_NULL_HANDLE);
}

/* `test_federated NAME` runs the cases whose name contains NAME. */
static const char *g_only;
#define RUNF(fn) do { if (!g_only || strstr(#fn, g_only)) RUN(fn); } while (0)

int main(int argc, char **argv) {
    g_only = argc > 1 ? argv[1] : NULL;
    signal(SIGPIPE, SIG_IGN);
    RUNF(test_config_errors);
    RUNF(test_fedavg_equals_central);
    RUNF(test_clip_and_dp);
    RUNF(test_fedadam_step);
    RUNF(test_round_repeats);
    RUNF(test_rule_breakers);
    RUNF(test_server_restart);
    RUNF(test_noniid_fmnist);
    RUNF(test_fedprox_skewed);
    RUNF(test_faults);
    RUNF(test_median_robust);
    if (g_have_data > 0) dtr_mnist_destroy(&g_data);
    return test_summary();
}
