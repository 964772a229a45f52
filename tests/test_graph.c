/* tests/test_graph.c: captured steps (dtr_graph, src/core/graph.c) on the CPU and the
 * simulated device, where a launch calls the step function again and checks it against the
 * capture; tests/gpu/test_graph_gpu.c compiles this file for the GPU (GRAPH_CUDA), where a
 * launch replays a CUDA graph. Cases:
 *   - an MLP, a small GPT (embeddings, a GPT block with attention, layer norm) and the GPT's
 *     inputs through an LSTM and a GRU, trained for
 *     5 steps by capture + launches equal an eager twin step for step (losses and weights: bit
 *     for bit here, within 1e-5 on the GPU); the batch of each step written into input tensors
 *     made before the capture, or copied in from tensors (dtr_tensor_copy) as a loader hands
 *     them over, the context reset after every step;
 *   - a parameter no backward reaches stays out of every update after a launch, as after an
 *     eager step (the weights' equality covers it);
 *   - the captured step's arena peak equals the eager step's (its tape recycles gradients);
 *   - host values copied in inside the step are the capture's on every launch;
 *   - a launch whose step differs from the capture (a changed scale factor, a changed shape, a
 *     convolution's changed dilation and padding with its shapes kept)
 *     fails with DTR_BAD_STATE, and the context works afterwards;
 *   - refused inside the step: reading a tensor, an optimizer step, clipping (a host sum),
 *     dtr_context_reset, dropout (attention's too), the loss scaler's scaling, a nested capture; a context with a gradient hook of the app's; each with
 *     its code and message, the context usable again after clearing the error;
 *   - dtr_context_reset frees inputs made on the own tape: a launch then refuses; inputs on a
 *     tape of the app's survive it;
 *   - two ranks of a data-parallel engine train the MLP by captured steps (the engine's hook
 *     does not run in them; dtr_dp_finish exchanges every bucket after the launch) and end on
 *     the weights of eager steps; ZeRO-3 (gathers during the step) is refused. */
#define _DEFAULT_SOURCE   /* MAP_ANONYMOUS (tests/devsim.h) */
#define DTRAIN_INTERNAL_API
#include <pthread.h>
#include "test.h"
#ifdef GRAPH_CUDA
#define BACKENDS 1
#define MODEL_TOL 1e-5
static const dtr_backend *backend_at(int i) { (void)i; return dtr_cuda_backend(); }
static const char *backend_name(int i) { (void)i; return "cuda"; }
#define NATIVE 1
#else
#include "devsim.h"
#define BACKENDS 2
#define MODEL_TOL 0.0
static const dtr_backend *backend_at(int i) { return i == 0 ? NULL : devsim_backend(); }
static const char *backend_name(int i) { return i == 0 ? "cpu" : "devsim"; }
#define NATIVE 0
#endif

#define B 4
#define IN 12
#define HID 16
#define CLS 5
#define T 8
#define C 16
#define VOCAB 11

typedef struct tnet {
    dtr_context *ctx;
    dtr_model *m;
    dtr_optimizer *opt;
    int gpt;
    dtr_linear_layer l1, l2, head;
    dtr_embedding_layer wte, wpe;
    dtr_gpt_block blk;
    dtr_layernorm_layer ln;
    dtr_lstm_layer lstm;             /* gpt 2: the GPT's inputs through an LSTM and a GRU */
    dtr_gru_layer gru;
    dtr_tensor *x, *ids, *pos, *y;   /* the inputs, made before the capture */
    dtr_tensor *loss;                /* the step's, set by the step function */
} tnet;

static dtr_dtype g_act = DTR_F32;   /* the contexts' activation_dtype */
static int g_spare;                 /* net_init adds a parameter the loss leaves out */

static dtr_context *new_ctx(int bi) {
    dtr_context_config cc = dtr_context_config_init();
    dtr_context *ctx = NULL;
    cc.backend = backend_at(bi);
    cc.threads = 1;
    cc.activation_dtype = g_act;
    if (dtr_context_create(&cc, &ctx) != DTR_OK) {
        fprintf(stderr, "cannot create a %s context: %s\n", backend_name(bi), dtr_context_create_error());
        exit(2);
    }
    return ctx;
}

static int net_init(tnet *n, int bi, int gpt) {
    dtr_optimizer_config oc = dtr_optimizer_config_init(DTR_OPT_ADAMW, 0.01f);
    dtr_result r;
    memset(n, 0, sizeof *n);
    n->ctx = new_ctx(bi);
    n->gpt = gpt;
    r = dtr_model_create(n->ctx, 7, &n->m);
    if (r == DTR_OK && !gpt) r = dtr_linear_layer_init(&n->l1, n->m, "l1", IN, HID, 1, DTR_INIT_KAIMING_UNIFORM);
    if (r == DTR_OK && !gpt) r = dtr_linear_layer_init(&n->l2, n->m, "l2", HID, CLS, 1, DTR_INIT_KAIMING_UNIFORM);
    if (r == DTR_OK && gpt) r = dtr_embedding_layer_init(&n->wte, n->m, "wte", VOCAB, C);
    if (r == DTR_OK && gpt) r = dtr_embedding_layer_init(&n->wpe, n->m, "wpe", T, C);
    if (r == DTR_OK && gpt == 1) r = dtr_gpt_block_init(&n->blk, n->m, "h0", C, 2);
    if (r == DTR_OK && gpt == 2) r = dtr_lstm_layer_init(&n->lstm, n->m, "lstm", C, C);
    if (r == DTR_OK && gpt == 2) r = dtr_gru_layer_init(&n->gru, n->m, "gru", C, C);
    if (r == DTR_OK && gpt) r = dtr_layernorm_layer_init(&n->ln, n->m, "ln", C);
    if (r == DTR_OK && gpt) r = dtr_linear_layer_init(&n->head, n->m, "head", C, VOCAB, 0, DTR_INIT_KAIMING_UNIFORM);
    /* graph_vs_eager: a parameter no backward reaches: an eager update leaves it out (AdamW's
       decay included), and so must one after a launch (a CUDA replay writes gradients without
       the tape) */
    if (r == DTR_OK && g_spare && !dtr_model_param(n->m, "spare", 1, (const int64_t[]){8}, DTR_INIT_UNIFORM, 1.0f)) r = DTR_INVALID_ARGUMENT;
    if (r == DTR_OK) r = dtr_model_build(n->m);
    if (r == DTR_OK) r = dtr_optimizer_create(n->m, &oc, &n->opt);
    return r == DTR_OK;
}

static void net_free(tnet *n) {
    dtr_optimizer_destroy(n->opt);
    dtr_model_destroy(n->m);
    dtr_context_destroy(n->ctx);
}

/* the batch of step t */
static float data_x(int t, int i) { return (float)((t * 31 + i * 17) % 23) / 11.0f - 1.0f; }
static int32_t data_id(int t, int i) { return (int32_t)((t * 5 + i * 3) % VOCAB); }
static int32_t data_y(int t, int i, int classes) { return (int32_t)((t * 7 + i * 5) % classes); }

typedef struct batch {
    float x[B * IN];
    int32_t ids[B * T], pos[B * T], y[B * T];
} batch;

/* labels: the MLP's classes of its B rows, or the GPT's next tokens of its B * T */
static void batch_of(batch *b, int t, int gpt) {
    int i;
    for (i = 0; i < B * IN; i++) b->x[i] = data_x(t, i);
    for (i = 0; i < B * T; i++) {
        b->ids[i] = data_id(t, i);
        b->pos[i] = i % T;
        b->y[i] = data_y(t, i, gpt ? VOCAB : CLS);
    }
}

static int64_t rows(const tnet *n) { return n->gpt ? B * T : B; }

static dtr_tensor *net_loss(dtr_context *ctx, const tnet *n, dtr_tensor *x, dtr_tensor *ids, dtr_tensor *pos, dtr_tensor *y) {
    if (!n->gpt) {
        dtr_tensor *h = dtr_relu(ctx, dtr_linear_layer_forward(ctx, &n->l1, x));
        return dtr_cross_entropy(ctx, dtr_linear_layer_forward(ctx, &n->l2, h), y);
    } else {
        int64_t ls[2] = {B * T, VOCAB};
        dtr_tensor *h = dtr_add(ctx, dtr_embedding_layer_forward(ctx, &n->wte, ids), dtr_embedding_layer_forward(ctx, &n->wpe, pos));
        if (n->gpt == 1) {
            h = dtr_gpt_block_forward(ctx, &n->blk, h);
        } else {
            dtr_tensor *hl = NULL;
            h = dtr_lstm_layer_forward(ctx, &n->lstm, h, NULL, NULL, &hl, NULL);
            h = dtr_gru_layer_forward(ctx, &n->gru, h, hl, NULL);
        }
        h = dtr_linear_layer_forward(ctx, &n->head, dtr_layernorm_layer_forward(ctx, &n->ln, h));
        return dtr_cross_entropy(ctx, dtr_reshape(ctx, h, 2, ls), y);
    }
}

/* the eager step t on a fresh copy of the batch (dp: a data-parallel engine's, or NULL) */
static dtr_result eager_step(tnet *n, int t, float *loss, dtr_dp *dp) {
    int64_t xs[2] = {B, IN}, is[2] = {B, T}, ys[1];
    batch b;
    dtr_tensor *l;
    dtr_result r;
    batch_of(&b, t, n->gpt);
    ys[0] = rows(n);
    l = net_loss(n->ctx, n, n->gpt ? NULL : dtr_tensor_from(n->ctx, DTR_F32, 2, xs, b.x),
                 n->gpt ? dtr_tensor_from(n->ctx, DTR_I32, 2, is, b.ids) : NULL,
                 n->gpt ? dtr_tensor_from(n->ctx, DTR_I32, 2, is, b.pos) : NULL,
                 dtr_tensor_from(n->ctx, DTR_I32, 1, ys, b.y));
    r = l ? dtr_backward(n->ctx, l) : dtr_context_status(n->ctx);
    if (r == DTR_OK) r = dtr_tensor_read(l, DTR_F32, loss, 1);
    if (r == DTR_OK && dp) r = dtr_dp_finish(dp);
    if (r == DTR_OK) r = dtr_optimizer_step(n->opt, NULL);
    dtr_context_reset(n->ctx);
    return r;
}

/* the inputs of the captured step, on the current tape */
static int make_inputs(tnet *n) {
    int64_t xs[2] = {B, IN}, is[2] = {B, T}, ys[1];
    ys[0] = rows(n);
    n->x = n->gpt ? NULL : dtr_tensor_new(n->ctx, DTR_F32, 2, xs);
    n->ids = n->gpt ? dtr_tensor_new(n->ctx, DTR_I32, 2, is) : NULL;
    n->pos = n->gpt ? dtr_tensor_new(n->ctx, DTR_I32, 2, is) : NULL;
    n->y = dtr_tensor_new(n->ctx, DTR_I32, 1, ys);
    return n->y != NULL;
}

static dtr_result write_inputs(tnet *n, int t) {
    batch b;
    dtr_result r = DTR_OK;
    batch_of(&b, t, n->gpt);
    if (!n->gpt) r = dtr_tensor_write(n->x, DTR_F32, b.x, B * IN);
    if (n->gpt && r == DTR_OK) r = dtr_tensor_write(n->ids, DTR_I32, b.ids, B * T);
    if (n->gpt && r == DTR_OK) r = dtr_tensor_write(n->pos, DTR_I32, b.pos, B * T);
    if (r == DTR_OK) r = dtr_tensor_write(n->y, DTR_I32, b.y, (size_t)rows(n));
    return r;
}

static dtr_result train_step(dtr_context *ctx, void *user) {
    tnet *n = (tnet *)user;
    n->loss = net_loss(ctx, n, n->x, n->ids, n->pos, n->y);
    return n->loss ? dtr_backward(ctx, n->loss) : dtr_context_status(ctx);
}

static void read_params(tnet *n, float **out, int64_t *count) {
    *count = dtr_model_numel(n->m);
    *out = (float *)malloc((size_t)*count * sizeof(float));
    if (dtr_model_read(n->m, *out, *count) != DTR_OK) memset(*out, 0, (size_t)*count * sizeof(float));
}

/* the batch of step t into the inputs as a loader hands it over: tensors of the own tape
   (dtr_tensor_from, as dtr_loader_tensors makes them) copied in on the backend */
static dtr_result copy_inputs(tnet *n, int t) {
    int64_t xs[2] = {B, IN}, is[2] = {B, T}, ys[1];
    batch b;
    dtr_result r = DTR_OK;
    batch_of(&b, t, n->gpt);
    ys[0] = rows(n);
    if (!n->gpt) r = dtr_tensor_copy(n->x, dtr_tensor_from(n->ctx, DTR_F32, 2, xs, b.x));
    if (n->gpt && r == DTR_OK) r = dtr_tensor_copy(n->ids, dtr_tensor_from(n->ctx, DTR_I32, 2, is, b.ids));
    if (n->gpt && r == DTR_OK) r = dtr_tensor_copy(n->pos, dtr_tensor_from(n->ctx, DTR_I32, 2, is, b.pos));
    if (r == DTR_OK) r = dtr_tensor_copy(n->y, dtr_tensor_from(n->ctx, DTR_I32, 1, ys, b.y));
    return r;
}

/* feed 0: inputs on the own tape written from the host; 1: inputs on a tape of the test's,
   copied from own-tape tensors, the context reset after every step */
static void graph_vs_eager(int bi, int gpt, int feed) {
    tnet e, g;
    dtr_graph *gr = NULL;
    dtr_tape *mine = NULL, *was;
    float le, lg, *pe, *pg;
    int64_t ne, ng, i;
    double worst = 0.0;
    int t;
    g_spare = 1;
    CHECK(net_init(&e, bi, gpt) && net_init(&g, bi, gpt));
    g_spare = 0;
    if (feed) CHECK_OK(g.ctx, dtr_tape_create(g.ctx, &mine));
    was = dtr_context_set_tape(g.ctx, mine);
    CHECK(make_inputs(&g));
    dtr_context_set_tape(g.ctx, was);
    for (t = 0; t < 5; t++) {
        CHECK_OK(e.ctx, eager_step(&e, t, &le, NULL));
        CHECK_OK(g.ctx, feed ? copy_inputs(&g, t) : write_inputs(&g, t));
        if (t == 0) CHECK_OK(g.ctx, dtr_graph_capture(g.ctx, train_step, &g, &gr));   /* runs step 0 */
        else CHECK_OK(g.ctx, dtr_graph_launch(gr));
        CHECK_OK(g.ctx, dtr_tensor_read(g.loss, DTR_F32, &lg, 1));
        CHECK_OK(g.ctx, dtr_optimizer_step(g.opt, NULL));
        if (feed) CHECK_OK(g.ctx, dtr_context_reset(g.ctx));
        CHECK_MSG(fabs((double)le - lg) <= MODEL_TOL * (1.0 + fabs(le)), "%s %s step %d: loss %.9g eager, %.9g graph",
                  backend_name(bi), gpt == 2 ? "rnn" : gpt ? "gpt" : "mlp", t, le, lg);
    }
    CHECK_EQ_INT(dtr_graph_native(gr), NATIVE);
    read_params(&e, &pe, &ne);
    read_params(&g, &pg, &ng);
    CHECK_EQ_INT(ne, ng);
    for (i = 0; i < ne && i < ng; i++) worst = fmax(worst, fabs((double)pe[i] - pg[i]));
    CHECK_MSG(worst <= MODEL_TOL, "%s %s: weights differ by %g", backend_name(bi), gpt == 2 ? "rnn" : gpt ? "gpt" : "mlp", worst);
    free(pe);
    free(pg);
    dtr_graph_destroy(gr);
    dtr_tape_destroy(mine);
    net_free(&e);
    net_free(&g);
}

/* ---- a data-parallel engine's step, captured ---- */

typedef struct dprank {
    dtr_local_world *w;
    int rank, bi, graph;   /* graph 2: ZeRO-3, whose capture is refused (into r) */
    dtr_result r;
    float *params;
    int64_t numel;
    int overlapped;        /* buckets the last step started during backward */
    char msg[300];
} dprank;

/* 4 steps of a rank of 2: eager, or by capture and launches (dtr_dp_finish after each) */
static dtr_result dp_steps(dprank *d, tnet *n, dtr_dp *dp) {
    dtr_graph *gr = NULL;
    dtr_result r = d->graph && !make_inputs(n) ? DTR_OUT_OF_MEMORY : DTR_OK;
    float loss;
    int t;
    if (d->graph == 2) {
        if (r == DTR_OK) r = write_inputs(n, d->rank);
        return r == DTR_OK ? dtr_graph_capture(n->ctx, train_step, n, &gr) : r;
    }
    for (t = 0; t < 4 && r == DTR_OK; t++) {
        int s = 2 * t + d->rank;   /* each rank its own batches */
        if (!d->graph) {
            r = eager_step(n, s, &loss, dp);
            continue;
        }
        r = write_inputs(n, s);
        if (r == DTR_OK) r = t == 0 ? dtr_graph_capture(n->ctx, train_step, n, &gr) : dtr_graph_launch(gr);
        if (r == DTR_OK) r = dtr_dp_finish(dp);   /* every bucket: the captured step started none */
        if (r == DTR_OK) r = dtr_optimizer_step(n->opt, NULL);
    }
    d->overlapped = dtr_dp_overlapped_buckets(dp);
    dtr_graph_destroy(gr);
    return r;
}

static void *dp_rank_main(void *arg) {
    dprank *d = (dprank *)arg;
    dtr_comm_config cc = dtr_comm_config_init();
    dtr_dp_config dc = dtr_dp_config_init();
    dtr_comm *c = NULL;
    dtr_dp *dp = NULL;
    tnet n;
    cc.local.world = d->w, cc.local.rank = d->rank;
    dc.bucket_bytes = 256;   /* several buckets */
    dc.zero = d->graph == 2 ? 3 : 0;
    d->r = net_init(&n, d->bi, 0) ? DTR_OK : DTR_BAD_STATE;
    if (d->r == DTR_OK) d->r = dtr_comm_create(&cc, &c, d->msg, sizeof d->msg);
    if (d->r == DTR_OK) d->r = dtr_dp_create(n.m, c, &dc, &dp);
    if (d->r == DTR_OK) d->r = dp_steps(d, &n, dp);
    if (d->r != DTR_OK) snprintf(d->msg, sizeof d->msg, "%s", dtr_context_last_error(n.ctx));
    read_params(&n, &d->params, &d->numel);
    dtr_dp_destroy(dp);
    dtr_comm_destroy(c);
    net_free(&n);
    return NULL;
}

static void dp_world(dprank *d, int bi, int graph) {
    pthread_t tid[2];
    dtr_local_world *w = NULL;
    int r;
    CHECK_OK(NULL, dtr_local_world_create(2, NULL, &w));
    for (r = 0; r < 2; r++) {
        memset(&d[r], 0, sizeof d[r]);
        d[r].w = w, d[r].rank = r, d[r].bi = bi, d[r].graph = graph;
        pthread_create(&tid[r], NULL, dp_rank_main, &d[r]);
    }
    for (r = 0; r < 2; r++) pthread_join(tid[r], NULL);
    dtr_local_world_destroy(w);
}

/* Two ranks training the MLP data-parallel: captured steps (the engine's hook does not run in
   them; dtr_dp_finish exchanges every bucket after the launch) end on the weights of eager
   steps, whose buckets start during backward; ZeRO-3's on-demand gathers are refused */
static void test_graph_data_parallel(void) {
    dprank e[2], g[2];
    int bi, r;
    for (bi = 0; bi < BACKENDS; bi++) {
        dp_world(e, bi, 0);
        dp_world(g, bi, 1);
        for (r = 0; r < 2; r++) {
            double worst = 0.0;
            int64_t i;
            CHECK_MSG(e[r].r == DTR_OK && g[r].r == DTR_OK, "%s rank %d: %s / %s", backend_name(bi), r, e[r].msg, g[r].msg);
            CHECK_EQ_INT(e[r].numel, g[r].numel);
            for (i = 0; i < e[r].numel && i < g[r].numel; i++) worst = fmax(worst, fabs((double)e[r].params[i] - g[r].params[i]));
            CHECK_MSG(worst <= MODEL_TOL, "%s rank %d: weights differ by %g", backend_name(bi), r, worst);
            CHECK_MSG(e[r].overlapped > 0 && g[r].overlapped == 0, "%s rank %d: %d buckets overlapped eager, %d captured",
                      backend_name(bi), r, e[r].overlapped, g[r].overlapped);
            free(e[r].params);
            free(g[r].params);
        }
        if (bi > 0) continue;   /* ZeRO-3 takes host models */
        dp_world(g, bi, 2);
        for (r = 0; r < 2; r++) {
            CHECK_MSG(g[r].r == DTR_UNSUPPORTED && strstr(g[r].msg, "ZeRO-3"), "ZeRO-3 rank %d: %s", r, g[r].msg);
            free(g[r].params);
        }
    }
}

static void test_graph_mlp_equals_eager(void) {
    int bi;
    for (bi = 0; bi < BACKENDS; bi++) graph_vs_eager(bi, 0, 0);
}

/* batches copied in from tensors the way a loader hands them over, the context reset every step */
static void test_graph_mlp_fed_by_tensor_copies(void) {
    int bi;
    for (bi = 0; bi < BACKENDS; bi++) graph_vs_eager(bi, 0, 1);
}

static void test_graph_gpt_equals_eager(void) {
    int bi;
    for (bi = 0; bi < BACKENDS; bi++) graph_vs_eager(bi, 1, 0);
}

/* the GPT's inputs through an LSTM and a GRU (the recurrence ops: per-step products and kernels
   with their scratch and saved gates) instead of its block */
static void test_graph_rnn_equals_eager(void) {
    int bi;
    for (bi = 0; bi < BACKENDS; bi++) graph_vs_eager(bi, 2, 0);
}

/* bf16 activations: the widened kernels' conversions and scratch are captured with the step */
static void test_graph_gpt_bf16_equals_eager(void) {
    int bi;
    g_act = DTR_BF16;
    for (bi = 0; bi < BACKENDS; bi++) graph_vs_eager(bi, 1, 0);
    g_act = DTR_F32;
}

/* The captured step's tape recycles released gradients as the own tape does: its arena peak
 * is the eager step's (without recycling the small GPT's is 1.4 times as high). */
static void test_graph_arena_peak_equals_eager(void) {
    int bi;
    for (bi = 0; bi < BACKENDS; bi++) {
        tnet n;
        dtr_graph *g = NULL;
        size_t eager, captured, before;
        CHECK(net_init(&n, bi, 1));
        CHECK(make_inputs(&n));
        CHECK_OK(n.ctx, write_inputs(&n, 0));
        before = dtr_context_arena_peak(n.ctx, 1);
        CHECK_OK(n.ctx, train_step(n.ctx, &n));   /* eager, on the own tape after the inputs */
        eager = dtr_context_arena_peak(n.ctx, 0) - before;
        CHECK_OK(n.ctx, dtr_model_zero_grad(n.m));
        dtr_context_arena_peak(n.ctx, 1);
        before = dtr_context_arena_peak(n.ctx, 0);   /* the eager step's tensors still live */
        CHECK_OK(n.ctx, dtr_graph_capture(n.ctx, train_step, &n, &g));
        captured = dtr_context_arena_peak(n.ctx, 0) - before;
        CHECK_MSG(captured == eager, "%s: arena peak %zu captured, %zu eager", backend_name(bi), captured, eager);
        dtr_graph_destroy(g);
        net_free(&n);
    }
}

/* ---- host values, changed steps ---- */

typedef struct probe {
    float host[4];      /* copied in inside the step */
    float factor;       /* a scale inside the step */
    int64_t n;          /* the length of the step's tensors */
    dtr_tensor *in;     /* made before the capture */
    dtr_tensor *out;
} probe;

/* out = sum(host + in) * factor */
static dtr_result probe_step(dtr_context *ctx, void *user) {
    probe *p = (probe *)user;
    int64_t s[1];
    s[0] = p->n;
    p->out = dtr_scale(ctx, dtr_sum_all(ctx, dtr_add(ctx, dtr_tensor_from(ctx, DTR_F32, 1, s, p->host), p->in)), p->factor);
    return p->out ? DTR_OK : dtr_context_status(ctx);
}

static float probe_read(dtr_context *ctx, probe *p) {
    float v = -1.0f;
    CHECK_OK(ctx, dtr_tensor_read(p->out, DTR_F32, &v, 1));
    return v;
}

static void test_graph_host_values_are_the_captures(void) {
    int bi;
    for (bi = 0; bi < BACKENDS; bi++) {
        dtr_context *ctx = new_ctx(bi);
        probe p = {{1, 2, 3, 4}, 2.0f, 4, NULL, NULL};
        const float in1[4] = {10, 10, 10, 10}, in2[4] = {100, 100, 100, 100};
        int64_t s[1] = {4};
        dtr_graph *g = NULL;
        p.in = dtr_tensor_from(ctx, DTR_F32, 1, s, in1);
        CHECK_OK(ctx, dtr_graph_capture(ctx, probe_step, &p, &g));
        CHECK_NEAR(probe_read(ctx, &p), 100.0, 0.0);      /* (10 + 40) * 2 */
        p.host[0] = 1001;                                   /* changed on the host: not seen */
        CHECK_OK(ctx, dtr_tensor_write(p.in, DTR_F32, in2, 4));   /* written into an input: seen */
        CHECK_OK(ctx, dtr_graph_launch(g));
        CHECK_NEAR(probe_read(ctx, &p), 820.0, 0.0);      /* (10 + 400) * 2 */
        CHECK_OK(ctx, dtr_graph_launch(g));
        CHECK_NEAR(probe_read(ctx, &p), 820.0, 0.0);
        dtr_graph_destroy(g);
        dtr_context_destroy(ctx);
    }
}

static void test_graph_launch_detects_a_changed_step(void) {
    int bi;
    for (bi = 0; bi < BACKENDS; bi++) {
        dtr_context *ctx = new_ctx(bi);
        probe p = {{1, 2, 3, 4}, 2.0f, 4, NULL, NULL};
        const float in[4] = {0, 0, 0, 0};
        int64_t s[1] = {4};
        dtr_graph *g = NULL;
        p.in = dtr_tensor_from(ctx, DTR_F32, 1, s, in);
        CHECK_OK(ctx, dtr_graph_capture(ctx, probe_step, &p, &g));
        if (NATIVE) {   /* the replay cannot see what fn would do: nothing to check */
            dtr_graph_destroy(g);
            dtr_context_destroy(ctx);
            continue;
        }
        p.factor = 3.0f;
        CHECK_EQ_INT(dtr_graph_launch(g), DTR_BAD_STATE);
        CHECK(strstr(dtr_context_last_error(ctx), "differs from its capture") != NULL);
        CHECK(strstr(dtr_context_last_error(ctx), "scale") != NULL);
        dtr_context_clear_error(ctx);
        p.factor = 2.0f;
        p.n = 3;   /* a tensor of another shape (host[0..2] + in[0..2] would not even add) */
        CHECK(dtr_graph_launch(g) != DTR_OK);
        dtr_context_clear_error(ctx);
        p.n = 4;
        CHECK_OK(ctx, dtr_graph_launch(g));   /* the capture's step again */
        CHECK_NEAR(probe_read(ctx, &p), 20.0, 0.0);
        dtr_graph_destroy(g);
        dtr_context_destroy(ctx);
    }
}

/* a convolution whose geometry changes after the capture with its shapes kept */
typedef struct conv_probe { dtr_conv_config cfg; dtr_tensor *x, *w, *out; } conv_probe;

static dtr_result conv_probe_step(dtr_context *ctx, void *user) {
    conv_probe *p = (conv_probe *)user;
    p->out = dtr_sum_all(ctx, dtr_conv2d_ex(ctx, p->x, p->w, NULL, &p->cfg));
    return p->out ? DTR_OK : dtr_context_status(ctx);
}

static void test_graph_launch_detects_a_changed_conv(void) {
    int bi;
    for (bi = 0; bi < BACKENDS; bi++) {
        dtr_context *ctx = new_ctx(bi);
        conv_probe p;
        int64_t xs[4] = {1, 1, 5, 5}, ws[4] = {1, 1, 3, 3};
        dtr_graph *g = NULL;
        p.cfg = dtr_conv_config_init();
        p.cfg.padding[0] = p.cfg.padding[1] = 1;
        p.x = dtr_tensor_full(ctx, 4, xs, 1.0f), p.w = dtr_tensor_full(ctx, 4, ws, 1.0f);
        CHECK_OK(ctx, dtr_graph_capture(ctx, conv_probe_step, &p, &g));
        if (!NATIVE) {   /* dilation 2, padding 2: the same (1, 1, 5, 5) output, another convolution */
            p.cfg.padding[0] = p.cfg.padding[1] = p.cfg.dilation[0] = p.cfg.dilation[1] = 2;
            CHECK_EQ_INT(dtr_graph_launch(g), DTR_BAD_STATE);
            CHECK(strstr(dtr_context_last_error(ctx), "conv2d") != NULL);
            dtr_context_clear_error(ctx);
            p.cfg.padding[0] = p.cfg.padding[1] = 1, p.cfg.dilation[0] = p.cfg.dilation[1] = 1;
        }
        CHECK_OK(ctx, dtr_graph_launch(g));
        {   /* each axis's windows hold 2, 3, 3, 3, 2 ones: 13 x 13 */
            float v = -1.0f;
            CHECK_OK(ctx, dtr_tensor_read(p.out, DTR_F32, &v, 1));
            CHECK_NEAR(v, 169.0, 0.0);
        }
        dtr_graph_destroy(g);
        dtr_context_destroy(ctx);
    }
}

/* ---- refusals ---- */

enum { R_READ, R_OPT, R_CLIP, R_RESET, R_DROPOUT, R_ATT_DROPOUT, R_SCALER, R_NESTED, R_COUNT };

typedef struct refuse {
    tnet *n;
    int what;
    dtr_graph *inner;
    dtr_loss_scaler *ls;
} refuse;

/* attention with dropout on its weights over constant q, k, v (1, 2, 2) */
static dtr_result refuse_attention(dtr_context *ctx) {
    static const int64_t shape[3] = {1, 2, 2};
    dtr_tensor *x = dtr_tensor_full(ctx, 3, shape, 0.5f);
    dtr_attention_config cfg = dtr_attention_config_init(1, 1);
    cfg.dropout = 0.1f;
    return dtr_attention_ex(ctx, x, x, x, &cfg) ? DTR_OK : dtr_context_status(ctx);
}

static dtr_result refuse_step(dtr_context *ctx, void *user) {
    refuse *f = (refuse *)user;
    float v;
    dtr_result r = train_step(ctx, f->n);
    if (r != DTR_OK) return r;
    switch (f->what) {
    case R_READ: return dtr_tensor_read(f->n->loss, DTR_F32, &v, 1);
    case R_OPT: return dtr_optimizer_step(f->n->opt, NULL);
    case R_CLIP: return dtr_clip_grad_norm(f->n->m, 1.0f, &v);
    case R_RESET: return dtr_context_reset(ctx);
    case R_DROPOUT: return dtr_dropout(ctx, f->n->loss, 0.5f) ? DTR_OK : dtr_context_status(ctx);
    case R_ATT_DROPOUT: return refuse_attention(ctx);
    case R_SCALER: return dtr_loss_scaler_scale(f->ls, ctx, f->n->loss) ? DTR_OK : dtr_context_status(ctx);
    default: return dtr_graph_capture(ctx, train_step, f->n, &f->inner);
    }
}

static dtr_result no_hook(void *user, dtr_tensor *param, dtr_event *ready) {
    (void)user; (void)param; (void)ready;
    return DTR_OK;
}

static void test_graph_refusals(void) {
    static const dtr_result want[R_COUNT] = {DTR_BAD_STATE, DTR_BAD_STATE, DTR_BAD_STATE, DTR_BAD_STATE,
                                             DTR_UNSUPPORTED, DTR_UNSUPPORTED, DTR_UNSUPPORTED, DTR_BAD_STATE};
    static const char *const says[R_COUNT] = {"reading backend memory", "dtr_optimizer_step: inside a captured step", "a sum read",
                                              "dtr_context_reset", "dropout", "attention dropout inside a captured step",
                                              "the scale changes", "a capture is under way"};
    dtr_loss_scaler_config lc = dtr_loss_scaler_config_init();
    dtr_loss_scaler *ls = NULL;
    int bi, w, id;
    for (bi = 0; bi < BACKENDS; bi++) {
        tnet n;
        dtr_graph *g = NULL;
        float lv = -1.0f;
        CHECK(net_init(&n, bi, 0));
        CHECK(make_inputs(&n));
        CHECK_OK(n.ctx, write_inputs(&n, 0));
        CHECK_OK(n.ctx, dtr_loss_scaler_create(&lc, &ls));
        for (w = 0; w < R_COUNT; w++) {
            refuse f = {&n, w, NULL, ls};
            dtr_result r = dtr_graph_capture(n.ctx, refuse_step, &f, &g);
            CHECK_MSG(r == want[w] && g == NULL, "%s case %d: %s", backend_name(bi), w, dtr_result_string(r));
            CHECK_MSG(strstr(dtr_context_last_error(n.ctx), says[w]) != NULL, "%s case %d: '%s'", backend_name(bi), w,
                      dtr_context_last_error(n.ctx));
            CHECK(f.inner == NULL);
            dtr_context_clear_error(n.ctx);
            CHECK_OK(n.ctx, dtr_model_zero_grad(n.m));
        }
        /* the context is itself again: an eager step and a capture work */
        CHECK_OK(n.ctx, train_step(n.ctx, &n));
        CHECK_OK(n.ctx, dtr_tensor_read(n.loss, DTR_F32, &lv, 1));
        CHECK(lv > 0.0f);
        CHECK_OK(n.ctx, dtr_optimizer_step(n.opt, NULL));
        CHECK_OK(n.ctx, dtr_graph_capture(n.ctx, train_step, &n, &g));
        dtr_graph_destroy(g);
        g = NULL;
        /* a gradient hook (a data-parallel engine) */
        CHECK_OK(n.ctx, dtr_context_add_grad_hook(n.ctx, no_hook, NULL, &id));
        CHECK_EQ_INT(dtr_graph_capture(n.ctx, train_step, &n, &g), DTR_UNSUPPORTED);
        CHECK(strstr(dtr_context_last_error(n.ctx), "gradient hook") != NULL);
        dtr_context_clear_error(n.ctx);
        CHECK_OK(n.ctx, dtr_context_remove_grad_hook(n.ctx, id));
        dtr_loss_scaler_destroy(ls);
        net_free(&n);
    }
    CHECK_EQ_INT(dtr_graph_capture(NULL, train_step, NULL, NULL), DTR_NULL_HANDLE);
    CHECK_EQ_INT(dtr_graph_launch(NULL), DTR_NULL_HANDLE);
    CHECK_EQ_INT(dtr_graph_native(NULL), 0);
    dtr_graph_destroy(NULL);
}

/* dtr_tensor_copy's checks */
static void test_tensor_copy(void) {
    int bi;
    for (bi = 0; bi < BACKENDS; bi++) {
        dtr_context *ctx = new_ctx(bi), *other = new_ctx(bi);
        const float v[6] = {1, 2, 3, 4, 5, 6};
        int64_t s23[2] = {2, 3}, s32[2] = {3, 2}, s4[1] = {4};
        int perm[2] = {1, 0};
        float out[6] = {0};
        dtr_tensor *a = dtr_tensor_from(ctx, DTR_F32, 2, s23, v), *b = dtr_tensor_new(ctx, DTR_F32, 2, s32);
        CHECK_OK(ctx, dtr_tensor_copy(b, a));   /* the elements in order, any shape of that count */
        CHECK_OK(ctx, dtr_tensor_read(b, DTR_F32, out, 6));
        CHECK(memcmp(out, v, sizeof v) == 0);
        CHECK_EQ_INT(dtr_tensor_copy(dtr_tensor_new(ctx, DTR_I32, 2, s23), a), DTR_INVALID_ARGUMENT);
        dtr_context_clear_error(ctx);
        CHECK_EQ_INT(dtr_tensor_copy(dtr_tensor_new(ctx, DTR_F32, 1, s4), a), DTR_SHAPE_MISMATCH);
        dtr_context_clear_error(ctx);
        CHECK_EQ_INT(dtr_tensor_copy(b, dtr_permute(ctx, a, perm)), DTR_UNSUPPORTED);
        dtr_context_clear_error(ctx);
        CHECK_EQ_INT(dtr_tensor_copy(dtr_tensor_new(other, DTR_F32, 2, s23), a), DTR_INVALID_ARGUMENT);
        CHECK_EQ_INT(dtr_tensor_copy(NULL, a), DTR_NULL_HANDLE);
        dtr_context_destroy(other);
        dtr_context_destroy(ctx);
    }
}

/* ---- inputs and dtr_context_reset ---- */

static void test_graph_inputs_and_reset(void) {
    int bi;
    for (bi = 0; bi < BACKENDS; bi++) {
        dtr_context *ctx = new_ctx(bi);
        probe p = {{1, 2, 3, 4}, 1.0f, 4, NULL, NULL};
        const float in[4] = {1, 1, 1, 1};
        int64_t s[1] = {4};
        dtr_graph *g = NULL;
        dtr_tape *mine = NULL, *was;
        /* on the own tape: a reset frees them, the launch refuses */
        p.in = dtr_tensor_from(ctx, DTR_F32, 1, s, in);
        CHECK_OK(ctx, dtr_graph_capture(ctx, probe_step, &p, &g));
        CHECK_OK(ctx, dtr_context_reset(ctx));
        CHECK_EQ_INT(dtr_graph_launch(g), DTR_BAD_STATE);
        CHECK(strstr(dtr_context_last_error(ctx), "capture it again") != NULL);
        dtr_context_clear_error(ctx);
        dtr_graph_destroy(g);
        /* on a tape of the app's: they outlive resets */
        CHECK_OK(ctx, dtr_tape_create(ctx, &mine));
        was = dtr_context_set_tape(ctx, mine);
        p.in = dtr_tensor_from(ctx, DTR_F32, 1, s, in);
        dtr_context_set_tape(ctx, was);
        CHECK_OK(ctx, dtr_graph_capture(ctx, probe_step, &p, &g));
        CHECK_OK(ctx, dtr_context_reset(ctx));
        CHECK_OK(ctx, dtr_graph_launch(g));
        CHECK_NEAR(probe_read(ctx, &p), 14.0, 0.0);   /* 10 + 4 */
        dtr_graph_destroy(g);
        dtr_tape_destroy(mine);
        dtr_context_destroy(ctx);
    }
}

int main(void) {
    (void)test_ctx;
#ifdef GRAPH_CUDA
    if (dtr_cuda_device_count() <= 0) {
        printf("*** test_graph_gpu: no GPU visible: CUDA graph checks SKIPPED ***\n");
        return test_summary();
    }
#endif
    RUN(test_graph_mlp_equals_eager);
    RUN(test_graph_mlp_fed_by_tensor_copies);
    RUN(test_graph_gpt_equals_eager);
    RUN(test_graph_rnn_equals_eager);
    RUN(test_graph_gpt_bf16_equals_eager);
    RUN(test_graph_arena_peak_equals_eager);
    RUN(test_graph_host_values_are_the_captures);
    RUN(test_graph_launch_detects_a_changed_step);
    RUN(test_graph_launch_detects_a_changed_conv);
    RUN(test_graph_refusals);
    RUN(test_graph_data_parallel);
    RUN(test_graph_inputs_and_reset);
    RUN(test_tensor_copy);
    return test_summary();
}
