/* tests/test_comm_devsim.c: process groups whose buffers and transport differ in memory
 * kind, the ranks' contexts on the simulated device of tests/devsim.h (src/comm/stage.c).
 *   test_collectives, test_async_p2p   cfg.memory DTR_MEM_DEVICE over the local transport
 *                 (host memory): every collective (worlds 2-4, counts 1 to 70000, in place
 *                 and not, f32 and bf16, host and device buffers mixed), two async requests
 *                 in flight (their results on the device once test / wait say so), a ring of
 *                 device-to-device messages through wait_any, blocking and waited receives,
 *                 a sub-group: the bits of the same calls on host buffers
 *   test_dp_over_staged_group  the data-parallel engine over such a group ends on the bits
 *                 of CPU ranks over a host group
 *   test_errors   a rank whose copy to the host fails breaks the group at once
 *                 (DTR_PEER_FAILED naming it on the others); a backend without `owns` is
 *                 refused; every staging block freed; ZeRO-3 of a device model is refused
 *   test_device_transport ... test_device_pipeline  a stand-in for NCCL: the local transport
 *                 declared to take device memory only, counting every buffer handed to it
 *                 that is not its rank's device memory (NCCL takes no host pointer); the
 *                 collectives (worlds 1-4, scratch, copies and sums on the backend, counted),
 *                 host buffers through device images (none may reach the transport); ZeRO-1/2
 *                 (SGD, AdamW, clipping) and local SGD; every codec (bf16 and fp16 encoded on
 *                 the device, the others on a host copy) and ZeRO-2 with 16-bit slices; the four tensor-parallel ops; 2 and 4
 *                 pipeline stages and a 2 x 2 data x pipeline grid with ZeRO-1: the bits of
 *                 CPU ranks over a host group (the pipeline also within 1e-5 of one rank
 *                 training the whole model)
 * The device blocks are PROT_NONE outside backend calls: code that hands a device pointer to
 * host code dies here. */
#define _DEFAULT_SOURCE   /* MAP_ANONYMOUS (tests/devsim.h) */
#define DTRAIN_INTERNAL_API
#include <pthread.h>
#include "test.h"
#include "posix_util.h"
#ifdef COMM_CUDA   /* tests/gpu/test_comm_gpu.c: the same on the GPU, threads sharing it (make test-gpu) */
#define DEV_BACKEND() dtr_cuda_backend()
#define MODEL_TOL 2e-3    /* a model trained on the GPU against the CPU: their kernels sum in other orders */
static int devsim__violations, devsim_host_blocks;   /* (the simulated device's counts: none here) */
#else
#include "devsim.h"
#define DEV_BACKEND() devsim_backend()
#define MODEL_TOL 0.0     /* the simulated device runs the CPU's kernels: the same bits */
#endif
#include "dp_mlp.h"
#include "staged_coll.h"
#include "pipe_model.h"

typedef void (*rk_fn)(rk *r);

typedef struct rk_thread {
    rk r;
    rk_fn fn;
    dtr_local_world *w;
    const dtr_backend *be;
    const dtr_transport_vtable *vt;   /* NULL: the local transport */
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
    cfg.transport_vtable = t->vt;
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

/* fn on n rank threads, each with a context of backend `be` and a group of memory `mem` over
   transport vt (NULL: local); the total of failed checks */
static int run_rk_on(int n, const dtr_backend *be, const dtr_transport_vtable *vt, dtr_mem_kind mem, rk_fn fn, void *arg) {
    rk_thread t[4];
    dtr_local_world *w = NULL;
    int i, fails = 0;
    if (dtr_local_world_create(n, NULL, &w) != DTR_OK) return 1;
    memset(t, 0, sizeof t);
    for (i = 0; i < n; i++) {
        t[i].r.rank = i, t[i].r.size = n, t[i].r.arg = arg;
        t[i].fn = fn, t[i].w = w, t[i].be = be, t[i].vt = vt, t[i].mem = mem;
    }
    for (i = 0; i < n; i++) pthread_create(&t[i].tid, NULL, rk_main, &t[i]);
    for (i = 0; i < n; i++) pthread_join(t[i].tid, NULL);
    for (i = 0; i < n; i++) fails += t[i].r.fails;
    dtr_local_world_destroy(w);
    return fails;
}

#define run_rk(n, be, mem, fn, arg) run_rk_on((n), (be), NULL, (mem), (fn), (arg))

static void test_collectives(void) {
    int w;
    for (w = 2; w <= 4; w++) CHECK_EQ_INT(run_rk(w, DEV_BACKEND(), DTR_MEM_DEVICE, rk_collectives, NULL), 0);
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
    CHECK_EQ_INT(run_rk(3, DEV_BACKEND(), DTR_MEM_DEVICE, rk_async, NULL), 0);
    CHECK_EQ_INT(run_rk(4, DEV_BACKEND(), DTR_MEM_DEVICE, rk_async, NULL), 0);
    CHECK_EQ_INT(run_rk(2, DEV_BACKEND(), DTR_MEM_DEVICE, rk_recv_check, NULL), 0);
    CHECK_EQ_INT(devsim__violations, 0);
}

/* ---- a device transport (NCCL's stand-in) ----
 * The local transport declared to take device memory only, as NCCL does, and moving device
 * buffers by device means: a send copies its buffer to the host through the rank's backend
 * (to_host) and sends that, a receive lands in a host bounce buffer and goes to the device
 * (from_host) when its completion is seen. Any buffer handed to it that is not its rank's
 * device memory is counted (NCCL takes no host pointer). The device blocks stay PROT_NONE
 * outside backend calls, so host code of the engines touching device memory dies here.
 * Collectives through the group's algorithms (scratch and copies on the device, sums by the
 * backend), host buffers staged to the device, ZeRO and local SGD, codecs, tensor-parallel
 * ops and pipeline stages over it. */

#define MAX_EP 16
static struct { void *state; dtr_context *ctx; } g_ep[MAX_EP];
static int g_nep, g_host_bufs, g_reduces, g_copies, g_event_waits;
static long long g_to_host_bytes;   /* the ranks' copies from the device to the host */
static pthread_mutex_t g_ep_mu = PTHREAD_MUTEX_INITIALIZER;
static dtr_transport_vtable g_devt;
static dtr_backend g_counting;

/* a request of the stand-in: the local transport's, and a bounce buffer for device memory */
typedef struct devt_req {
    void *inner, *bounce, *dev_dst;   /* dev_dst: a receive's device buffer, filled once */
    size_t bytes;
    dtr_context *ctx;
} devt_req;

static dtr_result devt_open(const dtr_comm_config *cfg, void **state, dtr_transport_info *info, char *err, size_t errlen) {
    dtr_result r = dtr_local_transport()->open(cfg, state, info, err, errlen);
    pthread_mutex_lock(&g_ep_mu);
    if (r == DTR_OK && g_nep < MAX_EP) g_ep[g_nep].state = *state, g_ep[g_nep++].ctx = cfg->context;
    pthread_mutex_unlock(&g_ep_mu);
    return r;
}

static void devt_close(void *state) {
    int i;
    pthread_mutex_lock(&g_ep_mu);
    for (i = 0; i < g_nep; i++)
        if (g_ep[i].state == state) g_ep[i] = g_ep[--g_nep];
    pthread_mutex_unlock(&g_ep_mu);
    dtr_local_transport()->close(state);
}

/* the rank's context when buf is its device memory; NULL (counted) otherwise */
static dtr_context *devt_device(void *state, const void *buf, size_t bytes) {
    dtr_context *ctx = NULL;
    int i;
    pthread_mutex_lock(&g_ep_mu);
    for (i = 0; i < g_nep; i++)
        if (g_ep[i].state == state) ctx = g_ep[i].ctx;
    pthread_mutex_unlock(&g_ep_mu);
    if (!bytes) return NULL;
    if (ctx && ctx->backend->owns(ctx, buf) && ctx->backend->owns(ctx, (const char *)buf + bytes - 1)) return ctx;
    __atomic_add_fetch(&g_host_bufs, 1, __ATOMIC_RELAXED);
    return NULL;
}

static dtr_result devt_post(void *state, void *buf, size_t bytes, int peer, uint64_t tag, void **req, dtr_transport_error *err,
                            int send) {
    devt_req *q = (devt_req *)calloc(1, sizeof *q);
    dtr_result r;
    q->ctx = devt_device(state, buf, bytes);
    q->bytes = bytes;
    if (q->ctx) q->bounce = malloc(bytes);
    /* the wire's own copy (not counted); as NCCL it does not report what a kernel found on the
       device (CUDA's error word): the rank's next synchronisation does (dtr__cuda_take_error) */
    if (q->ctx && send) (void)DEV_BACKEND()->to_host(q->ctx, q->bounce, buf, bytes);
    if (q->ctx && !send) q->dev_dst = buf;
    r = send ? dtr_local_transport()->isend(state, q->ctx ? q->bounce : buf, bytes, peer, tag, &q->inner, err)
             : dtr_local_transport()->irecv(state, q->ctx ? q->bounce : buf, bytes, peer, tag, &q->inner, err);
    if (r != DTR_OK) {
        free(q->bounce);
        free(q);
        return r;
    }
    *req = q;
    return DTR_OK;
}
static dtr_result devt_isend(void *state, const void *buf, size_t bytes, int dst, uint64_t tag, void **req,
                             dtr_transport_error *err) {
    return devt_post(state, (void *)buf, bytes, dst, tag, req, err, 1);
}
static dtr_result devt_irecv(void *state, void *buf, size_t bytes, int src, uint64_t tag, void **req,
                             dtr_transport_error *err) {
    return devt_post(state, buf, bytes, src, tag, req, err, 0);
}

static dtr_result devt_test(void *state, void *req, int *done, dtr_transport_error *err) {
    devt_req *q = (devt_req *)req;
    dtr_result r = dtr_local_transport()->test(state, q->inner, done, err);
    if (*done && r == DTR_OK && q->dev_dst) {   /* a receive lands on the device */
        DEV_BACKEND()->from_host(q->ctx, q->dev_dst, q->bounce, q->bytes);
        q->dev_dst = NULL;
    }
    return r;
}

/* the local transport's handles of reqs[0..n) */
static void devt_inner(void *const *reqs, int n, void **inner) {
    int i;
    for (i = 0; i < n; i++) inner[i] = reqs[i] ? ((devt_req *)reqs[i])->inner : NULL;
}
static dtr_result devt_wait_any(void *state, void *const *reqs, int n, int64_t deadline_ns, dtr_transport_error *err) {
    void *inner[1024];
    devt_inner(reqs, n, inner);
    return dtr_local_transport()->wait_any(state, inner, n, deadline_ns, err);
}
static dtr_result devt_wait_some(void *state, void *const *reqs, int n, int64_t until_ns) {
    void *inner[1024];
    devt_inner(reqs, n, inner);
    return dtr_local_transport()->wait_some(state, inner, n, until_ns);
}
static void devt_release(void *state, void *req) {
    devt_req *q = (devt_req *)req;
    dtr_local_transport()->release(state, q->inner);
    free(q->bounce);
    free(q);
}

static dtr_result counting_reduce(dtr_context *ctx, void *out, const void *a, const void *b, size_t n, dtr_dtype dt, int op,
                                  int div) {
    __atomic_add_fetch(&g_reduces, 1, __ATOMIC_RELAXED);
    return DEV_BACKEND()->reduce(ctx, out, a, b, n, dt, op, div);
}

static dtr_result counting_to_host(dtr_context *ctx, void *dst, const void *src, size_t bytes) {
    __atomic_add_fetch(&g_to_host_bytes, (long long)bytes, __ATOMIC_RELAXED);
    return DEV_BACKEND()->to_host(ctx, dst, src, bytes);
}
static dtr_result counting_to_host_async(dtr_context *ctx, void *dst, const void *src, size_t bytes, dtr_event **done) {
    __atomic_add_fetch(&g_to_host_bytes, (long long)bytes, __ATOMIC_RELAXED);
    return DEV_BACKEND()->to_host_async(ctx, dst, src, bytes, done);
}

static dtr_result counting_copy(dtr_context *ctx, void *dst, const void *src, size_t bytes) {
    __atomic_add_fetch(&g_copies, 1, __ATOMIC_RELAXED);
    return DEV_BACKEND()->copy(ctx, dst, src, bytes);
}

/* events of the compute stream: a marker (the simulated device completes everything at once,
   its own are NULL), so that host waits on them are counted; the async copies' go through */
static char g_stream_event;
static dtr_result counting_event_record(dtr_context *ctx, dtr_event **ev) {
    dtr_result r = DEV_BACKEND()->event_record(ctx, ev);
    if (r == DTR_OK && !*ev) *ev = (dtr_event *)&g_stream_event;
    return r;
}
static dtr_result counting_event_wait(dtr_context *ctx, dtr_event *ev) {
    if (ev != (dtr_event *)&g_stream_event) return DEV_BACKEND()->event_wait(ctx, ev);
    __atomic_add_fetch(&g_event_waits, 1, __ATOMIC_RELAXED);
    return DTR_OK;
}
static dtr_result counting_event_query(dtr_context *ctx, dtr_event *ev, int *done) {
    if (ev != (dtr_event *)&g_stream_event) return DEV_BACKEND()->event_query(ctx, ev, done);
    *done = 1;
    return DTR_OK;
}

static void devt_setup(void) {
    g_devt = *dtr_local_transport();
    g_devt.name = "local-device";
    g_devt.mem_kinds = DTR_MEM_DEVICE;
    g_devt.open = devt_open;
    g_devt.close = devt_close;
    g_devt.isend = devt_isend;
    g_devt.irecv = devt_irecv;
    g_devt.test = devt_test;
    g_devt.wait_any = devt_wait_any;
    g_devt.wait_some = devt_wait_some;
    g_devt.release = devt_release;
    g_counting = *DEV_BACKEND();
    g_counting.reduce = counting_reduce;
    g_counting.copy = counting_copy;
    g_counting.to_host = counting_to_host;
    if (DEV_BACKEND()->to_host_async) g_counting.to_host_async = counting_to_host_async;
    g_counting.event_record = counting_event_record;
    g_counting.event_wait = counting_event_wait;
    g_counting.event_query = counting_event_query;
    g_nep = g_host_bufs = g_reduces = g_copies = g_event_waits = 0;
}

static void test_device_transport(void) {
    int w;
    devt_setup();
    CHECK_EQ_INT(run_rk_on(1, &g_counting, &g_devt, DTR_MEM_DEVICE, rk_collectives, NULL), 0);
    CHECK(g_copies > 0);    /* a group of one copies on the device */
    for (w = 2; w <= 4; w++) CHECK_EQ_INT(run_rk_on(w, &g_counting, &g_devt, DTR_MEM_DEVICE, rk_collectives, NULL), 0);
    CHECK(g_reduces > 0);   /* the algorithms' sums ran on the backend */
    CHECK_EQ_INT(run_rk_on(3, &g_counting, &g_devt, DTR_MEM_DEVICE, rk_async, NULL), 0);
    CHECK_EQ_INT(g_host_bufs, 0);   /* host buffers (the reference calls, split's table) went through device images */
    CHECK_EQ_INT(devsim__violations, 0);
}

/* ---- the data-parallel engine over such groups ---- */

/* the n floats of a run on the device against the CPU's: the same bits on the simulated
   device, within MODEL_TOL on a GPU */
#define OUT_FLOATS(c) ((int64_t)(sizeof (c).out / sizeof(float)))   /* every rank's slot */
static int close_runs(const float *dev, const float *cpu, int64_t n) {
    return MODEL_TOL == 0.0 ? memcmp(dev, cpu, (size_t)n * sizeof(float)) == 0 : rel_err(dev, cpu, n) <= MODEL_TOL;
}

#define NPAR (IN * HID + HID + HID * OUT + OUT + 64)

/* a data-parallel run: the MLP on the rank's context (dev) or a CPU one, SGD with momentum or
   AdamW, clipping by global norm, ZeRO stage `zero` or local SGD every `local_sgd` steps */
typedef struct dp_case {
    int dev, zero, local_sgd;
    int host_codec;       /* the backend without the codec slots: compression on a host copy */
    int ckpt;             /* the residual through a checkpoint at the end (resid_roundtrip) */
    int freeze;           /* l1 frozen (dtr_model_set_trainable): in no bucket */
    dtr_dp_compress compress;
    dtr_optimizer_kind kind;
    float out[4][NPAR];   /* each rank's parameters after the run */
} dp_case;

/* the residual's bytes (device memory: the backend's copy) into host memory */
static void resid_read(dtr_context *ctx, const dtr_state_entry *st, float *out) {
    if (st->device) ctx->backend->to_host(ctx, out, st->data, st->bytes);
    else memcpy(out, st->data, st->bytes);
}

/* error feedback's residual through a checkpoint (the rank's own, no group): saved, zeroed,
   restored: the same bytes, not all zero */
static void resid_roundtrip(rk *r, dtr_dp *dp, dtr_context *ctx) {
    char dir[96];
    dtr_ckpt_config cc = dtr_ckpt_config_init();
    dtr_ckpt *ck = NULL;
    dtr_state_entry st;
    float *before, *after;
    size_t i, nz = 0;
    snprintf(dir, sizeof dir, "/tmp/dtr_devsim_ck_%d_%d", (int)getpid(), r->rank);
    cc.dir = dir, cc.ctx = ctx, cc.dp = dp, cc.sync = 1;
    RK_OK(r, dtr_dp_state(dp, 2, &st));
    before = (float *)malloc(st.bytes), after = (float *)calloc(1, st.bytes);
    resid_read(ctx, &st, before);
    RK_OK(r, dtr_ckpt_create(&cc, &ck));
    RK_OK(r, dtr_ckpt_save(ck, 8, NULL));
    if (st.device) ctx->backend->from_host(ctx, st.data, after, st.bytes);   /* zeros */
    else memset(st.data, 0, st.bytes);
    RK_OK(r, dtr_ckpt_restore(ck, NULL, NULL));
    resid_read(ctx, &st, after);
    for (i = 0; i < st.bytes / sizeof(float); i++) nz += before[i] != 0.0f;
    RK_CHECK(r, nz > 0 && memcmp(before, after, st.bytes) == 0);
    dtr_ckpt_destroy(ck);
    rm_tree(dir);
    free(before), free(after);
}

static void rk_dp(rk *r) {
    dp_case *dc = (dp_case *)r->arg;
    dtr_optimizer_config oc = dtr_optimizer_config_init(dc->kind, dc->kind == DTR_OPT_SGD ? 0.05f : 0.01f);
    dtr_dp_config pc = dtr_dp_config_init();
    dtr_dp *dp = NULL;
    mlp n;
    int t;
    RK_CHECK(r, dc->dev ? mlp_init_on(&n, r->ctx, 5, 1) : mlp_init(&n, 5, 1));
    dtr_optimizer_destroy(n.opt);
    n.opt = NULL;
    oc.momentum = dc->kind == DTR_OPT_SGD ? 0.9f : 0.0f;
    oc.clip_norm = 0.5f;
    pc.bucket_bytes = 512;
    pc.zero = dc->zero;
    pc.local_sgd_every = dc->local_sgd;
    pc.compress = dc->compress;
    if (dc->freeze) {
        const char *l1[1] = {"l1."};
        RK_OK(r, dtr_model_set_trainable(n.m, l1, 1, 0));
    }
    RK_OK(r, dtr_dp_create(n.m, r->c, &pc, &dp));
    if (dp) RK_OK(r, dtr_dp_shard_optimizer(dp, &oc));
    RK_OK(r, dtr_optimizer_create(n.m, &oc, &n.opt));
    for (t = 0; t < 8 && dp && n.opt; t++) {
        RK_OK(r, mlp_backward(&n, t, r->rank * 8, 8));
        RK_OK(r, dtr_dp_finish(dp));
        RK_OK(r, dtr_optimizer_step(n.opt, NULL));
        RK_OK(r, dtr_dp_step_done(dp));
        dtr_context_reset(n.ctx);
    }
    if (dp && dc->compress >= DTR_COMPRESS_INT8) {   /* error feedback's residual: where the codec runs */
        dtr_state_entry st;
        RK_OK(r, dtr_dp_state(dp, 2, &st));
        RK_CHECK(r, !strcmp(st.name, "residual") && st.device == (dc->dev && !dc->host_codec));
        if (dc->ckpt) resid_roundtrip(r, dp, n.ctx);
    }
    RK_CHECK(r, dtr_model_numel(n.m) <= NPAR);
    RK_OK(r, dtr_model_read(n.m, dc->out[r->rank], dtr_model_numel(n.m)));
    dtr_dp_destroy(dp);
    if (!dc->dev) {
        mlp_free(&n);
        return;
    }
    dtr_optimizer_destroy(n.opt);   /* the context is the rank's */
    dtr_model_destroy(n.m);
}

/* ranks on the simulated device over a staged group against ranks on the CPU over a host
 * group (devsim runs the CPU's kernels: the same bits) */
static void test_dp_over_staged_group(void) {
    static dp_case dev, cpu;
    memset(&dev, 0, sizeof dev);
    dev.dev = 1, dev.kind = DTR_OPT_SGD;
    cpu = dev;
    cpu.dev = 0;
    CHECK_EQ_INT(run_rk(2, DEV_BACKEND(), DTR_MEM_DEVICE, rk_dp, &dev), 0);
    CHECK_EQ_INT(run_rk(2, NULL, DTR_MEM_HOST, rk_dp, &cpu), 0);
    CHECK(close_runs(dev.out[0], cpu.out[0], 2 * NPAR) && memcmp(dev.out[0], dev.out[1], sizeof dev.out[0]) == 0);
    CHECK_EQ_INT(devsim__violations, 0);
    /* l1 frozen, the device model over a host group (the engine's staging buffer) and over the
       device group: the staging buffer's l1 part is never written (poisoned NaNs), and never
       copied back: clipping's norm on the device sees zeros there */
    dev.freeze = cpu.freeze = 1;
    CHECK_EQ_INT(run_rk(2, NULL, DTR_MEM_HOST, rk_dp, &cpu), 0);
    CHECK_EQ_INT(run_rk(2, DEV_BACKEND(), DTR_MEM_HOST, rk_dp, &dev), 0);
    CHECK_MSG(close_runs(dev.out[0], cpu.out[0], 2 * NPAR) && memcmp(dev.out[0], dev.out[1], sizeof dev.out[0]) == 0,
              "frozen, staged: %g off the CPU", rel_err(dev.out[0], cpu.out[0], NPAR));
    CHECK_EQ_INT(run_rk(2, DEV_BACKEND(), DTR_MEM_DEVICE, rk_dp, &dev), 0);
    CHECK_MSG(close_runs(dev.out[0], cpu.out[0], 2 * NPAR), "frozen, device group: %g off the CPU", rel_err(dev.out[0], cpu.out[0], NPAR));
    CHECK_EQ_INT(devsim__violations, 0);
}

/* ZeRO-1 and ZeRO-2 (SGD with momentum, AdamW; clipping by the norm summed over the shards)
 * and local SGD over the device transport, against the same on CPU ranks over a host group:
 * the same bits; the shards' sums on the backend, every buffer on the device, and the host
 * never waits for the stream's events (the group orders its work after the stream's) */
static void test_device_dp(void) {
    static dp_case dev, cpu;
    static const dtr_optimizer_kind kinds[2] = {DTR_OPT_SGD, DTR_OPT_ADAMW};
    int w, k, z;
    devt_setup();
    for (w = 2; w <= 3; w++)
        for (k = 0; k < 2; k++)
            for (z = 0; z <= 3; z++) {   /* 0: plain, 1 and 2: ZeRO, 3: local SGD every 2 steps */
                memset(&dev, 0, sizeof dev);
                dev.dev = 1, dev.kind = kinds[k], dev.zero = z < 3 ? z : 0, dev.local_sgd = z == 3 ? 2 : 0;
                cpu = dev;
                cpu.dev = 0;
                g_reduces = g_event_waits = 0;
                CHECK_EQ_INT(run_rk_on(w, &g_counting, &g_devt, DTR_MEM_DEVICE, rk_dp, &dev), 0);
                CHECK_MSG(g_event_waits == 0, "mode %d: the host waited %d times for the stream", z, g_event_waits);
                CHECK_MSG(z == 0 || z == 3 || g_reduces >= 8 * (w - 1), "ZeRO-%d: %d sums on the backend", z, g_reduces);
                CHECK_EQ_INT(run_rk(w, NULL, DTR_MEM_HOST, rk_dp, &cpu), 0);
                CHECK_MSG(close_runs(dev.out[0], cpu.out[0], OUT_FLOATS(dev)), "world %d optimizer %d mode %d: %g off the CPU",
                          w,
                          (int)kinds[k], z, rel_err(dev.out[0], cpu.out[0], NPAR));
            }
    CHECK_EQ_INT(g_host_bufs, 0);
    CHECK_EQ_INT(devsim__violations, 0);
}

/* every codec (bf16, int8 per bucket, top-k and PowerSGD with error feedback) and ZeRO-2 with
 * 16-bit slices over the device transport encode and decode on the device (the backend's cast
 * kernel, codec and powersgd slots; the residual in device memory; no gradient reaches the
 * host: the ranks copy to the host their final parameters and a few scalars a step); a
 * backend without the codec slots compresses int8 and PowerSGD on a host copy (the gradients
 * cross every step) whose encoded buffers the group stages to the device. The bits of CPU
 * ranks over a host group, every time. The device residual goes through a checkpoint and
 * comes back. */
static void test_device_compress(void) {
    static dp_case dev, cpu;
    static const dtr_dp_compress codecs[8] = {DTR_COMPRESS_BF16, DTR_COMPRESS_INT8,     DTR_COMPRESS_TOPK, DTR_COMPRESS_POWERSGD,
                                              DTR_COMPRESS_FP16, DTR_COMPRESS_FP16,     DTR_COMPRESS_INT8, DTR_COMPRESS_POWERSGD};
    static dtr_backend slotless;
    int i;
    devt_setup();
    slotless = g_counting;
    slotless.codec = NULL, slotless.powersgd = NULL;
    for (i = 0; i < 8; i++) {
        long long params = 3LL * (IN * HID + HID + HID * OUT + OUT) * (long long)sizeof(float);   /* the final reads */
        memset(&dev, 0, sizeof dev);
        dev.dev = 1, dev.kind = DTR_OPT_ADAMW, dev.compress = codecs[i], dev.zero = i == 4 ? 2 : 0, dev.host_codec = i >= 6;
        cpu = dev;
        cpu.dev = 0;
        g_to_host_bytes = 0;
        CHECK_EQ_INT(run_rk_on(3, i >= 6 ? &slotless : &g_counting, &g_devt, DTR_MEM_DEVICE, rk_dp, &dev), 0);
        if (i < 6)   /* the parameters at the end, and a few scalars a step (loss, norms) */
            CHECK_MSG(g_to_host_bytes <= params + 3 * 8 * 64, "codec %d on the device: %lld bytes to the host (the "
                      "parameters: %lld)", (int)codecs[i], g_to_host_bytes, params);
        else   /* a host copy of the gradients every step */
            CHECK_MSG(g_to_host_bytes >= 8 * params, "codec %d on a host copy: %lld bytes to the host", (int)codecs[i],
                      g_to_host_bytes);
        CHECK_EQ_INT(run_rk(3, NULL, DTR_MEM_HOST, rk_dp, &cpu), 0);
        CHECK_MSG(close_runs(dev.out[0], cpu.out[0], OUT_FLOATS(dev)), "codec %d: %g off the CPU", (int)codecs[i],
                  rel_err(dev.out[0], cpu.out[0], NPAR));
    }
    memset(&dev, 0, sizeof dev);   /* the device residual through a checkpoint */
    dev.dev = 1, dev.kind = DTR_OPT_ADAMW, dev.compress = DTR_COMPRESS_INT8, dev.ckpt = 1;
    CHECK_EQ_INT(run_rk_on(2, &g_counting, &g_devt, DTR_MEM_DEVICE, rk_dp, &dev), 0);
    CHECK_EQ_INT(g_host_bufs, 0);
    CHECK_EQ_INT(devsim__violations, 0);
}

/* ---- tensor parallelism over the device transport ----
 * copy, reduce and gather run on the device (a device copy, the group's all-reduce or
 * all-gather, strided copies, the backend's sum), the vocabulary-parallel cross-entropy too
 * (the backend's vocab_xent, the group's all-reduces of the rows' statistics): 6 SGD steps
 * of column -> gelu -> row -> (column gathered: MSE) + (column head: vocabulary-parallel
 * cross-entropy, plain and with an ignored row, label smoothing and a sum) on ranks of the
 * simulated device end with the bits of CPU ranks over a host
 * group, and copy nothing to the host but the parameters read at the end; a target outside
 * the vocabulary fails every rank with DTR_INVALID_ARGUMENT */

#define TPC 8
#define TPV 16
typedef struct tp_case { int dev; float out[4][1024]; int64_t numel; } tp_case;

static void rk_tp(rk *r) {
    tp_case *tc = (tp_case *)r->arg;
    dtr_context *ctx = tc->dev ? r->ctx : test_ctx(1);
    dtr_optimizer_config oc = dtr_optimizer_config_init(DTR_OPT_SGD, 0.1f);
    dtr_optimizer *opt = NULL;
    dtr_model *m = NULL;
    dtr_tp_linear t1, t2, t3, head;
    const int64_t xs[2] = {4, TPC}, ts[1] = {4};
    float x[4 * TPC], y[4 * TPC];
    int32_t tgt[4], tgt2[4];
    dtr_xent_config xc = dtr_xent_config_init();
    int s, i;
    xc.ignore_index = -1, xc.label_smoothing = 0.1f, xc.reduction = DTR_LOSS_SUM;
    RK_OK(r, dtr_model_create(ctx, 3, &m));
    RK_OK(r, dtr_tp_column_linear_init(&t1, m, r->c, "t1", TPC, 2 * TPC, 1, DTR_INIT_TORCH_DEFAULT, 0));
    RK_OK(r, dtr_tp_row_linear_init(&t2, m, r->c, "t2", 2 * TPC, TPC, 1, DTR_INIT_TORCH_DEFAULT));
    RK_OK(r, dtr_tp_column_linear_init(&t3, m, r->c, "t3", TPC, TPC, 1, DTR_INIT_TORCH_DEFAULT, 1));
    RK_OK(r, dtr_tp_column_linear_init(&head, m, r->c, "head", TPC, TPV, 0, DTR_INIT_TORCH_DEFAULT, 0));
    RK_OK(r, dtr_optimizer_create(m, &oc, &opt));
    for (s = 0; s < 6 && opt; s++) {
        dtr_tensor *h, *loss;
        for (i = 0; i < 4 * TPC; i++) x[i] = val(7, (size_t)(s * 100 + i), 1), y[i] = 0.1f * val(8, (size_t)(s * 100 + i), 2);
        for (i = 0; i < 4; i++) tgt[i] = (int32_t)((s * 5 + i * 3) % TPV), tgt2[i] = i == s % 4 ? -1 : tgt[i];
        h = dtr_tensor_from(ctx, DTR_F32, 2, xs, x);
        h = dtr_tp_linear_forward(ctx, &t2, dtr_gelu(ctx, dtr_tp_linear_forward(ctx, &t1, h)));
        loss = dtr_add(ctx, dtr_mse(ctx, dtr_tp_linear_forward(ctx, &t3, h), dtr_tensor_from(ctx, DTR_F32, 2, xs, y)),
                       dtr_vocab_parallel_cross_entropy(ctx, dtr_tp_linear_forward(ctx, &head, h),
                                                        dtr_tensor_from(ctx, DTR_I32, 1, ts, tgt), r->c));
        loss = dtr_add(ctx, loss,   /* again with a row ignored, label smoothing, summed */
                       dtr_vocab_parallel_cross_entropy_ex(ctx, dtr_tp_linear_forward(ctx, &head, h),
                                                           dtr_tensor_from(ctx, DTR_I32, 1, ts, tgt2), r->c, &xc));
        RK_CHECK(r, loss != NULL);
        if (!loss) break;
        RK_OK(r, dtr_backward(ctx, loss));
        RK_OK(r, dtr_optimizer_step(opt, NULL));
        dtr_context_reset(ctx);
    }
    if (r->fails) fprintf(stderr, "  rank %d: %s\n", r->rank, dtr_context_last_error(ctx));
    tc->numel = dtr_model_numel(m);
    RK_CHECK(r, tc->numel <= 1024);
    RK_OK(r, dtr_model_read(m, tc->out[r->rank], tc->numel));
    dtr_optimizer_destroy(opt);
    dtr_model_destroy(m);
    if (!tc->dev) dtr_context_destroy(ctx);
}

/* a target outside the vocabulary on the device path: every rank gets DTR_INVALID_ARGUMENT
   naming it (the CPU's phase at the op; CUDA's error word at the loss's read), no hang */
static void rk_tp_bad_target(rk *r) {
    dtr_model *m = NULL;
    dtr_tp_linear head;
    const int64_t xs[2] = {2, TPC}, ts[1] = {2};
    const int32_t tgt[2] = {3, TPV};
    float x[2 * TPC] = {0}, v = 0.0f;
    dtr_tensor *loss;
    dtr_result res;
    RK_OK(r, dtr_model_create(r->ctx, 1, &m));
    RK_OK(r, dtr_tp_column_linear_init(&head, m, r->c, "head", TPC, TPV, 0, DTR_INIT_TORCH_DEFAULT, 0));
    RK_OK(r, dtr_model_build(m));
    loss = dtr_vocab_parallel_cross_entropy(r->ctx, dtr_tp_linear_forward(r->ctx, &head, dtr_tensor_from(r->ctx, DTR_F32, 2, xs, x)),
                                            dtr_tensor_from(r->ctx, DTR_I32, 1, ts, tgt), r->c);
    res = loss ? dtr_tensor_read(loss, DTR_F32, &v, 1) : dtr_context_status(r->ctx);
    RK_CHECK(r, res == DTR_INVALID_ARGUMENT && strstr(dtr_context_last_error(r->ctx), "outside") != NULL);
    if (res != DTR_INVALID_ARGUMENT) fprintf(stderr, "  rank %d: %s\n", r->rank, dtr_context_last_error(r->ctx));
    dtr_context_reset(r->ctx);
    dtr_model_destroy(m);
}

static void test_device_tp(void) {
    static tp_case dev, cpu;
    int w;
    devt_setup();
    for (w = 2; w <= 4; w += 2) {
        memset(&dev, 0, sizeof dev);
        memset(&cpu, 0, sizeof cpu);
        dev.dev = 1;
#ifndef COMM_CUDA
        devsim_copies2d = 0;
#endif
        g_to_host_bytes = 0;
        CHECK_EQ_INT(run_rk_on(w, &g_counting, &g_devt, DTR_MEM_DEVICE, rk_tp, &dev), 0);
        CHECK_MSG(g_to_host_bytes == (long long)w * dev.numel * (long long)sizeof(float),
                  "world %d: %lld bytes to the host (the parameters read at the end: %lld)", w, g_to_host_bytes,
                  (long long)w * dev.numel * (long long)sizeof(float));   /* the cross-entropy's logits stay */
#ifndef COMM_CUDA
        CHECK_MSG(devsim_copies2d >= 6 * w * (w + 1), "world %d: %d strided copies (the gather on the device)", w,
                  devsim_copies2d);   /* per step and rank: w forward, 1 backward */
#endif
        CHECK_EQ_INT(run_rk(w, NULL, DTR_MEM_HOST, rk_tp, &cpu), 0);
        CHECK(dev.numel > 0 && dev.numel == cpu.numel);
        CHECK_MSG(close_runs(dev.out[0], cpu.out[0], OUT_FLOATS(dev)), "world %d: %g off the CPU", w,
                  rel_err(dev.out[0], cpu.out[0], dev.numel));
        CHECK_EQ_INT(run_rk_on(w, &g_counting, &g_devt, DTR_MEM_DEVICE, rk_tp_bad_target, NULL), 0);
    }
    CHECK_EQ_INT(g_host_bufs, 0);
    CHECK_EQ_INT(devsim__violations, 0);
}

/* ---- pipeline stages over the device transport ----
 * the pipeline's activations and gradients go through host slots, which the group stages to
 * the device; clipping by the norm summed over the stages (sums of doubles staged too). 2 and
 * 4 stages, and a 2 x 2 data x pipeline grid with ZeRO-1 on the replicas, on the simulated
 * device over the stand-in, against the same on CPU ranks over a host group: the same bits */

typedef struct pp_case { int dev, dp; float out[4][512]; int64_t numel[4]; double err[4]; } pp_case;
static dtr_model *g_pp_ref;   /* the whole model trained on one CPU rank (pm_reference) */

static void rk_pipe(rk *r) {
    pp_case *pc = (pp_case *)r->arg;
    dtr_context *ctx = pc->dev ? r->ctx : test_ctx(1);
    dtr_optimizer_config oc = dtr_optimizer_config_init(DTR_OPT_SGD, 0.1f);
    dtr_pipe_config cfg = dtr_pipe_config_init();
    dtr_optimizer *opt = NULL;
    dtr_model *m = NULL;
    dtr_dp *dp = NULL;
    dtr_grid g;
    pm_model pm;
    pm_stage st;
    float loss;
    char msg[256];
    int dps = pc->dp;
    memset(&pm, 0, sizeof pm);
    memset(&st, 0, sizeof st);
    RK_OK(r, dtr_grid_create(r->c, dps, r->size / dps, 1, &g, msg, sizeof msg));
    pm.stages = r->size / dps, pm.P = pm.stages, pm.rank = dtr_comm_rank(g.pp);
    pm.offset = g.dp_rank * (PM_BATCH / dps);
    oc.momentum = 0.9f;
    oc.clip_norm = 0.5f;
    cfg.microbatches = 4, cfg.batch = PM_BATCH / dps, cfg.forward = pm_forward, cfg.user = &st;
    RK_OK(r, dtr_model_create(ctx, 7, &m));
    RK_OK(r, pm_declare(&pm, m));
    RK_OK(r, pm_keep(&pm, 1));
    if (dps > 1) {
        dtr_dp_config dc = dtr_dp_config_init();
        dc.zero = 1;
        RK_OK(r, dtr_dp_create(m, g.dp, &dc, &dp));
        if (dp) RK_OK(r, dtr_dp_shard_optimizer(dp, &oc));
    }
    cfg.dp = dp;
    RK_OK(r, dtr_pipe_create(m, g.pp, &cfg, &st.pipe));
    if (st.pipe) RK_OK(r, dtr_pipe_optimizer_config(st.pipe, &oc));
    RK_CHECK(r, oc.norm_sum != NULL);   /* the norm over the stages */
    RK_OK(r, dtr_optimizer_create(m, &oc, &opt));
    st.pm = &pm;
    for (pm.step = 0; pm.step < 6 && st.pipe && opt && !r->fails; pm.step++) {
        RK_OK(r, dtr_pipe_step(st.pipe, &loss));
        RK_OK(r, dtr_optimizer_step(opt, NULL));
        if (dp) RK_OK(r, dtr_dp_step_done(dp));
        dtr_context_reset(ctx);
    }
    if (r->fails) fprintf(stderr, "  rank %d: %s\n", r->rank, dtr_context_last_error(ctx));
    pc->err[r->rank] = pm_max_rel_error(m, g_pp_ref);
    pc->numel[r->rank] = dtr_model_numel(m);
    RK_CHECK(r, pc->numel[r->rank] <= 512);
    RK_OK(r, dtr_model_read(m, pc->out[r->rank], pc->numel[r->rank]));
    dtr_pipe_destroy(st.pipe);
    dtr_dp_destroy(dp);
    dtr_optimizer_destroy(opt);
    dtr_model_destroy(m);
    dtr_grid_destroy(&g);
    if (!pc->dev) dtr_context_destroy(ctx);
}

static void test_device_pipeline(void) {
    static pp_case dev, cpu;
    static const int worlds[3] = {2, 4, 4}, dps[3] = {1, 1, 2};
    dtr_context *ref_ctx = NULL;
    float ref_loss = 0.0f;
    int i, k;
    devt_setup();
    CHECK_OK(NULL, pm_reference(6, 0.5f, &ref_ctx, &g_pp_ref, &ref_loss));
    for (i = 0; i < 3; i++) {
        memset(&dev, 0, sizeof dev);
        dev.dp = dps[i];
        cpu = dev;
        dev.dev = 1;
        CHECK_EQ_INT(run_rk_on(worlds[i], &g_counting, &g_devt, DTR_MEM_DEVICE, rk_pipe, &dev), 0);
        CHECK_EQ_INT(run_rk(worlds[i], NULL, DTR_MEM_HOST, rk_pipe, &cpu), 0);
        CHECK(dev.numel[0] > 0 && memcmp(dev.numel, cpu.numel, sizeof dev.numel) == 0);
        CHECK_MSG(close_runs(dev.out[0], cpu.out[0], OUT_FLOATS(dev)), "world %d, %d replicas: %g off the CPU", worlds[i],
                  dps[i],
                  rel_err(dev.out[0], cpu.out[0], dev.numel[0]));
        for (k = 0; k < worlds[i]; k++)   /* and the stages hold the weights of one rank training the whole model */
            CHECK_MSG(dev.err[k] <= (MODEL_TOL > 1e-5 ? MODEL_TOL : 1e-5), "world %d, %d replicas, rank %d: %g off the whole "
                      "model", worlds[i], dps[i], k,
                      dev.err[k]);
    }
    dtr_model_destroy(g_pp_ref);
    dtr_context_destroy(ref_ctx);
    CHECK_EQ_INT(g_host_bufs, 0);
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
    return DEV_BACKEND()->to_host(ctx, dst, src, bytes);
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
        RK_CHECK(r, strstr(dtr_comm_last_error(r->c), "staging a buffer (device to host)") != NULL);
    } else {
        RK_CHECK(r, res == DTR_PEER_FAILED);
        RK_CHECK(r, dtr_comm_failed_rank(r->c) == 1);
    }
    RK_CHECK(r, now_s() - t0 < 10.0);   /* the group broke at once, not at the 20 s deadline */
}

/* ZeRO-3 takes models in host memory only (a device's memory cannot be released at fixed
   addresses without the driver's virtual memory calls) */
static void zero3_refused(void) {
    dtr_context_config cc = dtr_context_config_init();
    dtr_comm_config cfg = dtr_comm_config_init();
    dtr_dp_config dc = dtr_dp_config_init();
    dtr_local_world *w = NULL;
    dtr_context *ctx = NULL;
    dtr_model *m = NULL;
    dtr_comm *c = NULL;
    dtr_dp *dp = NULL;
    int64_t shape[1] = {8};
    cc.backend = DEV_BACKEND();
    cc.threads = 1;
    CHECK_OK(NULL, dtr_context_create(&cc, &ctx));
    CHECK_OK(ctx, dtr_model_create(ctx, 1, &m));
    CHECK(dtr_model_param(m, "p", 1, shape, DTR_INIT_ZEROS, 0.0f) != NULL);
    CHECK_OK(NULL, dtr_local_world_create(1, NULL, &w));
    cfg.local.world = w;
    CHECK_OK(NULL, dtr_comm_create(&cfg, &c, NULL, 0));
    dc.zero = 3;
    CHECK_EQ_INT(dtr_dp_create(m, c, &dc, &dp), DTR_UNSUPPORTED);
    CHECK_MSG(strstr(dtr_context_last_error(ctx), "host memory") != NULL, "%s", dtr_context_last_error(ctx));
    dtr_comm_destroy(c);
    dtr_local_world_destroy(w);
    dtr_model_destroy(m);
    dtr_context_destroy(ctx);
}

static void test_errors(void) {
    dtr_context_config cc = dtr_context_config_init();
    dtr_comm_config cfg = dtr_comm_config_init();
    dtr_backend blind = *DEV_BACKEND();
    dtr_local_world *w = NULL;
    dtr_context *ctx = NULL;
    dtr_comm *c = NULL;
    char err[256];
    g_failing = *DEV_BACKEND();
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
    zero3_refused();
    CHECK_EQ_INT(devsim__violations, 0);
    CHECK_EQ_INT(devsim_host_blocks, 0);   /* every staging block was freed with its group */
}

int main(void) {
#ifdef COMM_CUDA
    if (dtr_cuda_device_count() <= 0) {
        printf("*** test_comm_gpu: no GPU visible: device-memory group checks SKIPPED ***\n");
        return test_summary();
    }
#endif
    RUN(test_collectives);
    RUN(test_async_p2p);
    RUN(test_dp_over_staged_group);
    RUN(test_errors);
    RUN(test_device_transport);
    RUN(test_device_dp);
    RUN(test_device_compress);
    RUN(test_device_tp);
    RUN(test_device_pipeline);
    return test_summary();
}
