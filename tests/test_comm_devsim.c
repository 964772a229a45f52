/* tests/test_comm_devsim.c: process groups of device memory over a host-memory transport
 * (cfg.memory = DTR_MEM_DEVICE on the local transport), the ranks' buffers on the simulated
 * device of tests/devsim.h: every collective, asynchronous requests and point-to-point
 * messages on device buffers (src/comm/stage.c copies them through host memory) give the
 * bits the same group gives on host buffers, which it passes as they are; a sub-group
 * stages too; the data-parallel engine over such a group ends where it ends over a host
 * group; a rank whose copy to the host fails breaks the group (DTR_PEER_FAILED naming it on
 * the others, no hang); a backend that cannot tell its memory from the host's is refused.
 * Code that hands a device pointer to the host code dies here (the blocks are PROT_NONE). */
#define _DEFAULT_SOURCE   /* MAP_ANONYMOUS (tests/devsim.h) */
#define DTRAIN_INTERNAL_API
#include <pthread.h>
#include "test.h"
#include "posix_util.h"
#include "devsim.h"
#include "dp_mlp.h"
#include "staged_coll.h"

typedef void (*rk_fn)(rk *r);

typedef struct rk_thread {
    rk r;
    rk_fn fn;
    dtr_local_world *w;
    const dtr_backend *be;
    dtr_mem_kind mem;
    pthread_t tid;
} rk_thread;

static void *rk_main(void *p) {
    rk_thread *t = (rk_thread *)p;
    dtr_comm_config cfg = dtr_comm_config_init();
    char err[256];
    rk *r = &t->r;
    if (!rk_open(r, t->be)) {
        r->fails++;
        rk_close(r);
        return NULL;
    }
    cfg.local.world = t->w;
    cfg.local.rank = r->rank;
    cfg.memory = t->mem;
    cfg.context = r->ctx;
    cfg.timeout_ms = 20000;
    if (dtr_comm_create(&cfg, &r->c, err, sizeof err) != DTR_OK) {
        fprintf(stderr, "  rank %d: dtr_comm_create: %s\n", r->rank, err);
        r->fails++;
    } else {
        t->fn(r);
        dtr_comm_destroy(r->c);
    }
    rk_close(r);
    return NULL;
}

/* fn on n rank threads, each with a context of backend `be` and a group of memory `mem`;
   the total of failed checks */
static int run_rk(int n, const dtr_backend *be, dtr_mem_kind mem, rk_fn fn, void *arg) {
    rk_thread t[4];
    dtr_local_world *w = NULL;
    int i, fails = 0;
    if (dtr_local_world_create(n, NULL, &w) != DTR_OK) return 1;
    memset(t, 0, sizeof t);
    for (i = 0; i < n; i++) {
        t[i].r.rank = i, t[i].r.size = n, t[i].r.arg = arg;
        t[i].fn = fn, t[i].w = w, t[i].be = be, t[i].mem = mem;
    }
    for (i = 0; i < n; i++) pthread_create(&t[i].tid, NULL, rk_main, &t[i]);
    for (i = 0; i < n; i++) pthread_join(t[i].tid, NULL);
    for (i = 0; i < n; i++) fails += t[i].r.fails;
    dtr_local_world_destroy(w);
    return fails;
}

static void test_collectives(void) {
    int w;
    for (w = 2; w <= 4; w++) CHECK_EQ_INT(run_rk(w, devsim_backend(), DTR_MEM_DEVICE, rk_collectives, NULL), 0);
    CHECK_EQ_INT(devsim__violations, 0);
}

/* ---- asynchronous requests, point-to-point, a sub-group ---- */

/* rank 1's blocking receive wrote rank 0's 100 host floats into its device buffer */
static void rk_recv_check(rk *r) {
    float h[100];
    int i, ok = 1;
    dtr_request *q = NULL;
    for (i = 0; i < 100; i++) h[i] = (float)i * 0.5f - 7.0f;
    if (r->rank == 0) RK_OK(r, dtr_comm_send(r->c, h, sizeof h, 1, 3));
    if (r->rank == 0) RK_OK(r, dtr_comm_send(r->c, h, sizeof h, 1, 4));
    if (r->rank == 1) {
        RK_OK(r, dtr_comm_recv(r->c, r->dev + 10, sizeof h, 0, 3));   /* blocking */
        dev_get(r);
        for (i = 0; i < 100; i++) ok &= r->got[10 + i] == h[i];
        RK_CHECK(r, ok && r->got[9] == 0.0f && r->got[110] == 0.0f);
        RK_OK(r, dtr_comm_recv_async(r->c, r->dev + 200, sizeof h, 0, 4, &q));   /* waited for */
        RK_OK(r, dtr_request_wait(q));
        dev_get(r);
        for (i = 0; i < 100; i++) ok &= r->got[200 + i] == h[i];
        RK_CHECK(r, ok);
        dtr_request_destroy(q);
    }
}

static void test_async_p2p(void) {
    CHECK_EQ_INT(run_rk(3, devsim_backend(), DTR_MEM_DEVICE, rk_async, NULL), 0);
    CHECK_EQ_INT(run_rk(4, devsim_backend(), DTR_MEM_DEVICE, rk_async, NULL), 0);
    CHECK_EQ_INT(run_rk(2, devsim_backend(), DTR_MEM_DEVICE, rk_recv_check, NULL), 0);
    CHECK_EQ_INT(devsim__violations, 0);
}

/* ---- the data-parallel engine over a staged group ----
 * ranks on the simulated device over a staged group against ranks on the CPU over a host
 * group (devsim runs the CPU's kernels: the same bits) */

static float g_dp_params[2][2][IN * HID + HID + HID * OUT + OUT + 64];   /* [staged?][rank] */

static void rk_dp(rk *r) {
    int staged = *(int *)r->arg, t;
    mlp n;
    dtr_dp *dp = NULL;
    RK_CHECK(r, staged ? mlp_init_on(&n, devsim_context(), 5, 1) : mlp_init(&n, 5, 1));
    RK_OK(r, dtr_dp_create(n.m, r->c, NULL, &dp));
    for (t = 0; t < 6 && dp; t++) {
        RK_OK(r, mlp_backward(&n, t, r->rank * 8, 8));
        RK_OK(r, dtr_dp_finish(dp));
        RK_OK(r, dtr_optimizer_step(n.opt, NULL));
        RK_OK(r, dtr_dp_step_done(dp));
        dtr_model_zero_grad(n.m);
        dtr_context_reset(n.ctx);
    }
    RK_CHECK(r, dtr_model_numel(n.m) <= (int64_t)(sizeof g_dp_params[0][0] / sizeof(float)));
    RK_OK(r, dtr_model_read(n.m, g_dp_params[staged][r->rank], dtr_model_numel(n.m)));
    dtr_dp_destroy(dp);
    mlp_free(&n);
}

static void test_dp_over_staged_group(void) {
    int staged = 1, host = 0;
    CHECK_EQ_INT(run_rk(2, devsim_backend(), DTR_MEM_DEVICE, rk_dp, &staged), 0);
    CHECK_EQ_INT(run_rk(2, devsim_backend(), DTR_MEM_HOST, rk_dp, &host), 0);
    CHECK(memcmp(g_dp_params[1], g_dp_params[0], sizeof g_dp_params[0]) == 0);
    CHECK(rel_err(g_dp_params[1][0], g_dp_params[0][0], IN * HID) == 0.0);
    CHECK(memcmp(g_dp_params[1][0], g_dp_params[1][1], sizeof g_dp_params[0][0]) == 0);
    CHECK_EQ_INT(devsim__violations, 0);
}

/* ---- a failed copy, a backend that cannot tell ---- */

static __thread int tl_fail_copy;   /* this rank's copies to the host fail */
static dtr_backend g_failing;

static dtr_result failing_to_host(dtr_context *ctx, void *dst, const void *src, size_t bytes) {
    if (tl_fail_copy) {
        dtr__fail(ctx, DTR_DEVICE_ERROR, "injected: the copy failed");
        return DTR_DEVICE_ERROR;
    }
    return devsim__to_host(ctx, dst, src, bytes);
}

static void rk_copy_fails(rk *r) {
    double t0 = now_s();
    dtr_result res;
    fill(r, 0, 64, 21);
    dev_put(r);
    tl_fail_copy = r->rank == 1;
    res = dtr_comm_all_reduce(r->c, r->dev, r->dev, 64, DTR_F32, DTR_REDUCE_SUM);
    tl_fail_copy = 0;
    if (r->rank == 1) {
        RK_CHECK(r, res == DTR_DEVICE_ERROR);
        RK_CHECK(r, strstr(dtr_comm_last_error(r->c), "copying a device buffer to the host") != NULL);
    } else {
        RK_CHECK(r, res == DTR_PEER_FAILED);
        RK_CHECK(r, dtr_comm_failed_rank(r->c) == 1);
    }
    RK_CHECK(r, now_s() - t0 < 10.0);   /* the group broke at once, not at the 20 s deadline */
}

static void test_errors(void) {
    dtr_context_config cc = dtr_context_config_init();
    dtr_comm_config cfg = dtr_comm_config_init();
    dtr_backend blind = *devsim_backend();
    dtr_local_world *w = NULL;
    dtr_context *ctx = NULL;
    dtr_comm *c = NULL;
    char err[256];
    g_failing = *devsim_backend();
    g_failing.to_host = failing_to_host;
    CHECK_EQ_INT(run_rk(3, &g_failing, DTR_MEM_DEVICE, rk_copy_fails, NULL), 0);
    /* no `owns` slot: the group could not tell which buffers to stage */
    blind.owns = NULL;
    cc.backend = &blind;
    cc.threads = 1;
    CHECK_OK(NULL, dtr_context_create(&cc, &ctx));
    CHECK_OK(NULL, dtr_local_world_create(1, NULL, &w));
    cfg.local.world = w;
    cfg.memory = DTR_MEM_DEVICE;
    cfg.context = ctx;
    CHECK_EQ_INT(dtr_comm_create(&cfg, &c, err, sizeof err), DTR_UNSUPPORTED);
    CHECK_MSG(strstr(err, "cannot tell its memory from the host's") != NULL, "%s", err);
    dtr_local_world_destroy(w);
    dtr_context_destroy(ctx);
    CHECK_EQ_INT(devsim__violations, 0);
    CHECK_EQ_INT(devsim_host_blocks, 0);   /* every staging block was freed with its group */
}

int main(void) {
    RUN(test_collectives);
    RUN(test_async_p2p);
    RUN(test_dp_over_staged_group);
    RUN(test_errors);
    return test_summary();
}
