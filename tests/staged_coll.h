/* tests/staged_coll.h: device buffers in process groups of device memory
 * (src/comm/stage.c), shared by tests/test_comm_devsim.c (threads; tests/gpu/test_comm_gpu.c
 * runs it on the GPU) and tests/test_fabric.c (processes, libfabric). A rank's device buffer
 * is the parameter buffer of a one-parameter model on the device (the simulated one of
 * tests/devsim.h, or a GPU); each check runs a collective on device buffers and the same on
 * host buffers (which the group passes as they are, or stages to the device when its
 * transport takes device memory only), and compares the bits. */
#ifndef DTRAIN_TEST_STAGED_COLL_H
#define DTRAIN_TEST_STAGED_COLL_H

#define BIG 70000                 /* the largest count */
#define NBUF (2 * 4 * BIG + 64)   /* two regions of count * world floats, world <= 4 */

typedef struct rk {
    int rank, size, fails;
    dtr_context *ctx;
    dtr_comm *c;
    dtr_model *m;                 /* one parameter of NBUF floats: the device buffer */
    float *dev, *mirror, *got;    /* device pointer; host images */
    void *arg;
} rk;

#define RK_CHECK(r, cond) do { if (!(cond)) { if ((r)->fails++ < 8) \
    fprintf(stderr, "  rank %d: FAIL %s:%d: %s\n", (r)->rank, __FILE__, __LINE__, #cond); } } while (0)
#define RK_OK(r, expr) do { dtr_result r__ = (expr); if (r__ != DTR_OK) { if ((r)->fails++ < 8) \
    fprintf(stderr, "  rank %d: FAIL %s:%d: %s -> %s (%s)\n", (r)->rank, __FILE__, __LINE__, #expr, \
            dtr_result_string(r__), dtr_comm_last_error((r)->c)); } } while (0)

/* the rank's context on backend `be` (the simulated device) and its device buffer */
static int rk_open(rk *r, const dtr_backend *be) {
    dtr_context_config cc = dtr_context_config_init();
    int64_t shape[1] = {NBUF};
    cc.backend = be;
    cc.threads = 1;
    if (dtr_context_create(&cc, &r->ctx) != DTR_OK || dtr_model_create(r->ctx, 1, &r->m) != DTR_OK ||
        !dtr_model_param(r->m, "buf", 1, shape, DTR_INIT_ZEROS, 0.0f) || dtr_model_build(r->m) != DTR_OK)
        return 0;
    r->dev = dtr_model_params(r->m);
    r->mirror = (float *)calloc(NBUF, sizeof(float));
    r->got = (float *)calloc(NBUF, sizeof(float));
    return r->mirror && r->got;
}

static void rk_close(rk *r) {
    dtr_model_destroy(r->m);
    dtr_context_destroy(r->ctx);
    free(r->mirror);
    free(r->got);
}

/* the device buffer from the mirror, and back into r->got */
static void dev_put(rk *r) { RK_OK(r, dtr_model_write(r->m, r->mirror, NBUF)); }
static void dev_get(rk *r) { RK_OK(r, dtr_model_read(r->m, r->got, NBUF)); }

static float val(int rank, size_t i, int salt) {
    uint32_t h = (uint32_t)(rank * 2654435761u) ^ (uint32_t)(i * 40503u + (size_t)salt * 977u);
    h ^= h >> 13; h *= 0x5bd1e995u; h ^= h >> 15;
    return (float)(h % 20001) / 1000.0f - 10.0f;
}

/* fills floats [off, off + k) of the mirror */
static void fill(rk *r, size_t off, size_t k, int salt) {
    size_t i;
    for (i = 0; i < k; i++) r->mirror[off + i] = val(r->rank, i, salt);
}

/* got[off..) equals want[0..k) bit for bit */
static int same(const float *got, const float *want, size_t k) { return memcmp(got, want, k * sizeof(float)) == 0; }

/* ---- every collective on device buffers equals the same on host buffers ---- */

static void coll_case(rk *r, size_t k) {
    const size_t A = 0, B = (size_t)NBUF / 2;   /* two regions of the device buffer */
    size_t W = (size_t)r->size, me = (size_t)r->rank;
    float *h = (float *)calloc(NBUF, sizeof(float)), *dev = r->dev;
    uint16_t *hb = (uint16_t *)h;
    /* all-reduce, out of place: src unchanged, dst the host result */
    fill(r, A, k, 1);
    dev_put(r);
    memcpy(h, r->mirror, k * sizeof(float));
    RK_OK(r, dtr_comm_all_reduce(r->c, dev + A, dev + B, k, DTR_F32, DTR_REDUCE_SUM));
    RK_OK(r, dtr_comm_all_reduce(r->c, h, h + B, k, DTR_F32, DTR_REDUCE_SUM));
    dev_get(r);
    RK_CHECK(r, same(r->got + B, h + B, k) && same(r->got + A, r->mirror + A, k));
    /* in place, average */
    RK_OK(r, dtr_comm_all_reduce(r->c, dev + A, dev + A, k, DTR_F32, DTR_REDUCE_AVG));
    RK_OK(r, dtr_comm_all_reduce(r->c, h, h, k, DTR_F32, DTR_REDUCE_AVG));
    dev_get(r);
    RK_CHECK(r, same(r->got + A, h, k));
    /* bf16: k halves of the same bytes */
    fill(r, A, k, 2);
    dev_put(r);
    memcpy(h, r->mirror, k * sizeof(float));
    RK_OK(r, dtr_comm_all_reduce(r->c, dev + A, dev + B, k, DTR_BF16, DTR_REDUCE_MAX));
    RK_OK(r, dtr_comm_all_reduce(r->c, hb, h + B, k, DTR_BF16, DTR_REDUCE_MAX));
    dev_get(r);
    RK_CHECK(r, memcmp(r->got + B, h + B, k * 2) == 0);
    /* broadcast from the last rank */
    fill(r, A, k, 3);
    dev_put(r);
    memcpy(h, r->mirror, k * sizeof(float));
    RK_OK(r, dtr_comm_broadcast(r->c, dev + A, k, DTR_F32, r->size - 1));
    RK_OK(r, dtr_comm_broadcast(r->c, h, k, DTR_F32, r->size - 1));
    dev_get(r);
    RK_CHECK(r, same(r->got + A, h, k));
    /* reduce-scatter: k x W in, k out */
    fill(r, A, k * W, 4);
    dev_put(r);
    memcpy(h, r->mirror, k * W * sizeof(float));
    RK_OK(r, dtr_comm_reduce_scatter(r->c, dev + A, dev + B, k, DTR_F32, DTR_REDUCE_SUM));
    RK_OK(r, dtr_comm_reduce_scatter(r->c, h, h + B, k, DTR_F32, DTR_REDUCE_SUM));
    dev_get(r);
    RK_CHECK(r, same(r->got + B, h + B, k));
    /* all-gather out of place, then in place (this rank's slot of dst is src) */
    fill(r, A, k, 5);
    fill(r, B + me * k, k, 6);
    dev_put(r);
    memcpy(h, r->mirror, NBUF * sizeof(float));
    RK_OK(r, dtr_comm_all_gather(r->c, dev + A, dev + B, k, DTR_F32));
    RK_OK(r, dtr_comm_all_gather(r->c, h + A, h + B, k, DTR_F32));
    dev_get(r);
    RK_CHECK(r, same(r->got + B, h + B, k * W));
    dev_put(r);   /* this rank's slot of B holds its own values again */
    memcpy(h, r->mirror, NBUF * sizeof(float));
    RK_OK(r, dtr_comm_all_gather(r->c, dev + B + me * k, dev + B, k, DTR_F32));
    RK_OK(r, dtr_comm_all_gather(r->c, h + B + me * k, h + B, k, DTR_F32));
    dev_get(r);
    RK_CHECK(r, same(r->got + B, h + B, k * W));
    /* host source, device destination; device source, host destination */
    fill(r, A, k, 7);
    dev_put(r);
    memcpy(h, r->mirror, k * sizeof(float));
    RK_OK(r, dtr_comm_all_reduce(r->c, h, dev + B, k, DTR_F32, DTR_REDUCE_SUM));
    RK_OK(r, dtr_comm_all_reduce(r->c, dev + A, h + B, k, DTR_F32, DTR_REDUCE_SUM));
    dev_get(r);
    RK_CHECK(r, same(r->got + B, h + B, k));
    free(h);
}

static void rk_collectives(rk *r) {
    static const size_t counts[3] = {1, 1000, BIG};
    int i;
    for (i = 0; i < 3; i++) coll_case(r, counts[i]);
    RK_CHECK(r, dtr_comm_status(r->c) == DTR_OK);
}

static void rk_async(rk *r) {
    const size_t k = 5000, A = 0, B = (size_t)NBUF / 2;
    int right = (r->rank + 1) % r->size, left = (r->rank + r->size - 1) % r->size, done = 0, idx = -1, spins = 0;
    float *h = (float *)calloc(NBUF, sizeof(float)), *dev = r->dev;
    dtr_request *q1 = NULL, *q2 = NULL, *p[2] = {NULL, NULL};
    dtr_comm *sub = NULL;
    /* two requests in flight at once: an in-place all-reduce and an all-gather */
    fill(r, A, k, 11);
    fill(r, B, k * (size_t)r->size, 12);
    dev_put(r);
    memcpy(h, r->mirror, NBUF * sizeof(float));
    RK_OK(r, dtr_comm_all_reduce_async(r->c, dev + A, dev + A, k, DTR_F32, DTR_REDUCE_SUM, &q1));
    RK_OK(r, dtr_comm_all_gather_async(r->c, dev + A + k, dev + B, k, DTR_F32, &q2));
    while (!done && spins++ < 200000) {   /* (20 s at most) */
        RK_OK(r, dtr_request_test(q2, &done));
        if (!done) usleep(100);
    }
    RK_CHECK(r, done);
    RK_OK(r, dtr_comm_all_gather(r->c, h + k, h + B, k, DTR_F32));
    dev_get(r);   /* the result is on the device once test said done */
    RK_CHECK(r, same(r->got + B, h + B, k * (size_t)r->size));
    RK_OK(r, dtr_request_wait(q1));
    RK_OK(r, dtr_comm_all_reduce(r->c, h, h, k, DTR_F32, DTR_REDUCE_SUM));
    dev_get(r);   /* and once wait returned */
    RK_CHECK(r, same(r->got + A, h, k));
    dtr_request_destroy(q1);
    dtr_request_destroy(q2);
    /* a ring of device-to-device messages, completed through wait_any */
    fill(r, A, k, 13);
    dev_put(r);
    RK_OK(r, dtr_comm_recv_async(r->c, dev + B, k * sizeof(float), left, 7, &p[0]));
    RK_OK(r, dtr_comm_send_async(r->c, dev + A, k * sizeof(float), right, 7, &p[1]));
    while (p[0] || p[1]) {
        RK_OK(r, dtr_request_wait_any(p, 2, 20000, &idx));
        if (idx < 0) break;
        RK_OK(r, dtr_request_wait(p[idx]));
        if (idx == 0) {   /* the message is on the device once wait returned */
            size_t i;
            int ok = 1;
            dev_get(r);
            for (i = 0; i < k; i++) ok &= r->got[B + i] == val(left, i, 13);
            RK_CHECK(r, ok);
        }
        dtr_request_destroy(p[idx]);
        p[idx] = NULL;
    }
    /* a sub-group (even and odd ranks) stages as its parent does */
    RK_OK(r, dtr_comm_split(r->c, r->rank % 2, r->rank, &sub));
    if (sub) {
        fill(r, A, k, 14);
        dev_put(r);
        memcpy(h, r->mirror, k * sizeof(float));
        RK_OK(r, dtr_comm_all_reduce(sub, dev + A, dev + B, k, DTR_F32, DTR_REDUCE_SUM));
        RK_OK(r, dtr_comm_all_reduce(sub, h, h + B, k, DTR_F32, DTR_REDUCE_SUM));
        dev_get(r);
        RK_CHECK(r, same(r->got + B, h + B, k));
        dtr_comm_destroy(sub);
    }
    free(h);
}

#endif /* DTRAIN_TEST_STAGED_COLL_H */
