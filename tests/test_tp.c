/* tests/test_tp.c: tensor parallelism through communication ops on the tape.
 *   test_tp_mlp   y = W2 relu(W1 x + b1) + b2 split over 2 and 4 ranks (threads, local
 *                 transport) Megatron-style: W1 by rows (column-parallel), W2 by columns
 *                 (row-parallel), dtr_tp_copy before and dtr_tp_reduce after. Every rank's
 *                 output, its slices' gradients and x's gradient equal the 1-rank model's.
 *   test_tp_fault a rank that aborts instead of joining the tensor-parallel collectives turns
 *                 into DTR_PEER_FAILED naming it on the other ranks, not a hang. */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include "test.h"

#define D 5
#define H 8
#define O 3
#define B 4

static float g_x[B * D], g_w1[H * D], g_b1[H], g_w2[O * H], g_b2[O], g_r[B * O];

static void make_weights(void) {
    dtr_rng r;
    int i;
    dtr_rng_seed(&r, 21, 2);
    for (i = 0; i < B * D; i++) g_x[i] = dtr_rng_uniform(&r) - 0.5f;
    for (i = 0; i < H * D; i++) g_w1[i] = dtr_rng_uniform(&r) - 0.5f;
    for (i = 0; i < H; i++) g_b1[i] = dtr_rng_uniform(&r) - 0.5f;
    for (i = 0; i < O * H; i++) g_w2[i] = dtr_rng_uniform(&r) - 0.5f;
    for (i = 0; i < O; i++) g_b2[i] = dtr_rng_uniform(&r) - 0.5f;
    for (i = 0; i < B * O; i++) g_r[i] = dtr_rng_uniform(&r);
}

/* The outputs of one rank (or of the reference): y, and the gradients of x, of its slices of
   W1, b1 (rows lo..hi) and W2 (columns lo..hi), and of b2. */
typedef struct tp_out {
    float y[B * O], gx[B * D], gw1[H * D], gb1[H], gw2[O * H], gb2[O];
    int ok;
    char msg[512];   /* the context's error when !ok */
} tp_out;

static dtr_tensor *leaf(dtr_context *ctx, int64_t n0, int64_t n1, const float *v) {
    int64_t s[2] = {n0, n1};
    return dtr_tensor_requires_grad(dtr_tensor_from(ctx, DTR_F32, n1 ? 2 : 1, s, v));
}

/* Rank `rank` of `world` (comm NULL: the whole model on one rank). */
static void tp_forward_backward(dtr_comm *comm, int rank, int world, tp_out *o) {
    dtr_context *ctx = test_ctx(1);
    int hs = H / world, lo = rank * hs, i, j;
    float w2s[O * H];
    dtr_tensor *x, *w1, *b1, *w2, *b2, *h, *y, *loss;
    int64_t rs[2] = {B, O};
    for (i = 0; i < O; i++)
        for (j = 0; j < hs; j++) w2s[i * hs + j] = g_w2[i * H + lo + j];   /* W2's columns lo.. */
    x = leaf(ctx, B, D, g_x);
    w1 = leaf(ctx, hs, D, g_w1 + lo * D);
    b1 = leaf(ctx, hs, 0, g_b1 + lo);
    w2 = leaf(ctx, O, hs, w2s);
    b2 = leaf(ctx, O, 0, g_b2);
    h = dtr_relu(ctx, dtr_linear(ctx, comm ? dtr_tp_copy(ctx, x, comm) : x, w1, b1));
    y = dtr_linear(ctx, h, w2, NULL);
    if (comm) y = dtr_tp_reduce(ctx, y, comm);
    y = dtr_add(ctx, y, b2);
    loss = dtr_sum_all(ctx, dtr_mul(ctx, y, dtr_tensor_from(ctx, DTR_F32, 2, rs, g_r)));
    o->ok = dtr_backward(ctx, loss) == DTR_OK;
    if (o->ok) {
        dtr_tensor_read(y, DTR_F32, o->y, B * O);
        memcpy(o->gx, dtr_tensor_grad(x), sizeof o->gx);
        memcpy(o->gw1 + lo * D, dtr_tensor_grad(w1), (size_t)(hs * D) * sizeof(float));
        memcpy(o->gb1 + lo, dtr_tensor_grad(b1), (size_t)hs * sizeof(float));
        for (i = 0; i < O; i++)
            for (j = 0; j < hs; j++) o->gw2[i * H + lo + j] = dtr_tensor_grad(w2)[i * hs + j];
        memcpy(o->gb2, dtr_tensor_grad(b2), sizeof o->gb2);
    } else {
        snprintf(o->msg, sizeof o->msg, "%s", dtr_context_last_error(ctx));
    }
    dtr_context_destroy(ctx);
}

typedef struct tp_rank {
    pthread_t tid;
    dtr_local_world *w;
    int rank, world, fail;
    tp_out out;
    dtr_result result;
} tp_rank;

static void *tp_main(void *arg) {
    tp_rank *t = (tp_rank *)arg;
    dtr_comm_config cfg = dtr_comm_config_init();
    dtr_comm *c = NULL;
    cfg.local.world = t->w;
    cfg.local.rank = t->rank;
    cfg.timeout_ms = t->fail ? 1500 : 20000;
    if (dtr_comm_create(&cfg, &c, NULL, 0) != DTR_OK) return NULL;
    if (t->fail && t->rank == 1) {
        dtr_comm_abort(c, "rank 1 gives up");   /* the others are in their backward's all-reduce */
    } else {
        tp_forward_backward(c, t->rank, t->world, &t->out);
        t->result = dtr_comm_status(c);
    }
    dtr_comm_destroy(c);
    return NULL;
}

static void run_world(int world, int fail, tp_rank *t) {
    dtr_local_world *w = NULL;
    int r;
    if (dtr_local_world_create(world, NULL, &w) != DTR_OK) return;
    for (r = 0; r < world; r++) {
        memset(&t[r], 0, sizeof t[r]);
        t[r].w = w; t[r].rank = r; t[r].world = world; t[r].fail = fail;
        pthread_create(&t[r].tid, NULL, tp_main, &t[r]);
    }
    for (r = 0; r < world; r++) pthread_join(t[r].tid, NULL);
    dtr_local_world_destroy(w);
}

static int near(const float *a, const float *b, int n) {
    int i;
    for (i = 0; i < n; i++)
        if (!(fabsf(a[i] - b[i]) <= 1e-5f * (1.0f + fabsf(a[i])))) return 0;
    return 1;
}

static void test_tp_mlp(void) {
    static tp_out ref;
    static tp_rank t[4];
    int world, r;
    make_weights();
    tp_forward_backward(NULL, 0, 1, &ref);
    CHECK(ref.ok);
    for (world = 2; world <= 4; world += 2) {
        run_world(world, 0, t);
        for (r = 0; r < world; r++) {
            int lo = r * (H / world), hs = H / world, i;
            CHECK_MSG(t[r].out.ok, "world %d rank %d: %s", world, r, t[r].out.msg);
            CHECK_MSG(near(ref.y, t[r].out.y, B * O), "world %d rank %d: output", world, r);
            CHECK_MSG(near(ref.gx, t[r].out.gx, B * D), "world %d rank %d: x's gradient", world, r);
            CHECK_MSG(near(ref.gw1 + lo * D, t[r].out.gw1 + lo * D, hs * D), "world %d rank %d: W1 rows", world, r);
            CHECK_MSG(near(ref.gb1 + lo, t[r].out.gb1 + lo, hs), "world %d rank %d: b1", world, r);
            for (i = 0; i < O; i++)
                CHECK_MSG(near(ref.gw2 + i * H + lo, t[r].out.gw2 + i * H + lo, hs), "world %d rank %d: W2 columns", world, r);
            CHECK_MSG(near(ref.gb2, t[r].out.gb2, O), "world %d rank %d: b2", world, r);
        }
    }
}

static void test_tp_fault(void) {
    static tp_rank t[3];
    int r;
    make_weights();
    run_world(3, 1, t);
    for (r = 0; r < 3; r++) {
        if (r == 1) continue;
        CHECK_MSG(!t[r].out.ok, "rank %d finished although rank 1 aborted", r);
        CHECK_MSG(strstr(t[r].out.msg, "rank 1") != NULL, "rank %d: %s", r, t[r].out.msg);
        CHECK_MSG(t[r].result == DTR_PEER_FAILED || t[r].result == DTR_TIMEOUT, "rank %d: group status %d", r,
                  (int)t[r].result);
    }
}

int main(void) {
    RUN(test_tp_mlp);
    RUN(test_tp_fault);
    return test_summary();
}
