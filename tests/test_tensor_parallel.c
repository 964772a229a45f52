/* tests/test_tensor_parallel.c: the tensor-parallel layers (src/nn/tensor_parallel.c) against
 * one rank training the single-device layers.
 *   test_tp_train_*   for each net (linear column -> row -> gathered column; attention, not
 *                     causal (the GPT block's is); a
 *                     vocabulary-parallel embedding, head and cross-entropy (the batch's
 *                     first target class ignored as padding, label smoothing 0.1, against
 *                     dtr_cross_entropy_ex's);
 *                     a GPT block with
 *                     the vocabulary-parallel head and cross-entropy on top), TP 2 and 4 on thread ranks train 20 steps
 *                     (AdamW for the MLP and the embedding, SGD with attention: the k part of
 *                     qkv.bias has a gradient of exactly 0 in exact arithmetic -- softmax
 *                     ignores a score shift per query -- and AdamW would turn the rounding
 *                     noise left there into full-size steps) on two alternating batches, the
 *                     same data as one rank with the single-device
 *                     layers from the same seed. Every step's loss and, at the end, every
 *                     weight (gathered by the collective dtr_model_save, read back by a
 *                     single-device dtr_model_load) agree within 1e-5 (relative, per tensor).
 *   test_tp_train_lora  the linear chain and the attention frozen, rank-2 LoRA adapters on every
 *                     linear (dtr_tp_linear_add_lora: column-parallel with 1 and 3 blocks,
 *                     row-parallel, gathered) trained alone with AdamW: the same losses and
 *                     weights (the adapters' full tensors, base unchanged) as one rank with
 *                     dtr_linear_layer_add_lora's adapters; then merged on both sides
 *                     (dtr_tp_linear_merge_lora: each rank into its shard), the same loss and
 *                     the same merged weights.
 *   test_tp_train_dropout  the GPT block with dropout 0.2 (its attention weights: each rank
 *                     its heads' share of the mask; the attention's and the MLP's outputs:
 *                     replicated) and the LoRA net with dropout 0.2 on every adapter's input
 *                     (row-parallel: each rank its columns of the mask) and on the attention's
 *                     weights: every rank's context on the reference's seed, the same losses
 *                     and weights as one rank (one device's masks).
 *   test_tp_init      before any step the TP shards save into the single-device weights.
 *   test_tp_grid      data 2 x tensor 2 (dtr_grid_create, dtr_dp over the data group) on half
 *                     the batch per replica against one rank on the whole batch: same weights.
 *   test_tp_load      a single-device file loaded into TP 2 ranks is sliced: saving it again
 *                     gives the same tensors, and the TP forward equals the single-device one.
 *   test_tp_errors    heads or vocabulary not divisible by tp, a NULL comm, a bad id or
 *                     target: the error code and a message that says so.
 *   test_tp_generate  TP 2 and 4 GPT blocks generating through KV caches of their own heads
 *                     give the single-device block's outputs over the whole sequence.
 * tests/test_tp_devsim.c runs all of it with the tensor-parallel ranks' contexts on the
 * simulated device (tests/devsim.h; the single-device reference stays on the CPU): the
 * communication ops then run on host images as on a GPU; build/tests/gpu/test_tp_gpu (make
 * test-gpu, TP_CUDA) on the GPU, ranks on threads sharing it. */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include "test.h"
#include "test_util.h"

#if defined(TP_DEVSIM) || defined(TP_CUDA)
#ifdef TP_DEVSIM
#include "devsim.h"
#define TP_BACKEND() devsim_backend()
#else
#define TP_BACKEND() dtr_cuda_backend()
#endif
/* a rank's context: on the device, or the CPU for the single-device reference */
static dtr_context *rank_ctx(const dtr_comm *c) {
    dtr_context_config cc = dtr_context_config_init();
    dtr_context *ctx = NULL;
    if (!c) return test_ctx(1);
    cc.backend = TP_BACKEND();
    cc.threads = 1;
    return dtr_context_create(&cc, &ctx) == DTR_OK ? ctx : NULL;
}
#else
static dtr_context *rank_ctx(const dtr_comm *c) { (void)c; return test_ctx(1); }
#endif

#define STEPS 20
#define B 2
#define T 4
#define C 8
#define HEADS 4
#define V 16
#define SEED 7

enum net { NET_LINEAR, NET_ATTN, NET_EMBED, NET_GPT, NET_LORA, NET_GPT_DROPOUT, NET_LORA_DROPOUT };
static const char *const k_net_names[] = {"linear", "attention", "embedding + cross-entropy", "gpt", "lora", "gpt, dropout 0.2",
                                          "lora, dropout 0.2"};
/* the nets with dropout are their base's with it on */
static enum net net_base(enum net kind) { return kind == NET_GPT_DROPOUT ? NET_GPT : kind == NET_LORA_DROPOUT ? NET_LORA : kind; }

/* One net, either kind: the single-device layers (comm NULL) or the tensor-parallel ones. */
typedef struct net_layers {
    dtr_linear_layer l1, l2, l3, head;
    dtr_attention_layer attn;
    dtr_embedding_layer emb;
    dtr_gpt_block block;
    dtr_tp_linear t1, t2, t3, thead;
    dtr_tp_attention tattn;
    dtr_tp_embedding temb;
    dtr_tp_gpt_block tblock;
} net_layers;

/* NET_LORA: the linear chain and the attention, frozen, with rank-2 adapters on every linear
   (column-parallel l1, qkv in three blocks; row-parallel l2, proj; gathered column l3) */
static dtr_result declare_lora(dtr_model *m, dtr_comm *c, net_layers *L) {
    static const char *adapters[1] = {"*lora_"};
    dtr_result r;
    if (!c) {
        dtr_linear_layer *ls[5] = {&L->l1, &L->l2, &L->l3, &L->attn.qkv, &L->attn.proj};
        int i;
        dtr_attention_layer_init(&L->attn, m, "attn", C, HEADS), L->attn.causal = 0;
        for (i = 0; i < 5; i++) dtr_linear_layer_add_lora(ls[i], m, 2, 4.0f);
    } else {
        dtr_tp_linear *ts[5] = {&L->t1, &L->t2, &L->t3, &L->tattn.qkv, &L->tattn.proj};
        int i;
        dtr_tp_attention_init(&L->tattn, m, c, "attn", C, HEADS), L->tattn.causal = 0;
        for (i = 0; i < 5; i++) dtr_tp_linear_add_lora(ts[i], m, 2, 4.0f);
    }
    if ((r = dtr_model_build(m)) != DTR_OK || (r = dtr_model_set_trainable(m, NULL, 0, 0)) != DTR_OK) return r;
    return dtr_model_set_trainable(m, adapters, 1, 1);
}

/* Dropout 0.2 everywhere the net has it: the GPT block's (weights, attention output, MLP output);
   LoRA's on every adapter's input and the attention's weights. */
static void set_dropout(enum net kind, dtr_comm *c, net_layers *L) {
    dtr_linear_layer *ls[5] = {&L->l1, &L->l2, &L->l3, &L->attn.qkv, &L->attn.proj};
    dtr_tp_linear *ts[5] = {&L->t1, &L->t2, &L->t3, &L->tattn.qkv, &L->tattn.proj};
    int i;
    if (kind == NET_GPT_DROPOUT) *(c ? &L->tblock.dropout : &L->block.dropout) = 0.2f;
    if (kind != NET_LORA_DROPOUT) return;
    for (i = 0; i < 5; i++) *(c ? &ts[i]->lora_dropout : &ls[i]->lora_dropout) = 0.2f;
    *(c ? &L->tattn.dropout : &L->attn.dropout) = 0.2f;
}

static dtr_result declare(enum net kind, dtr_model *m, dtr_comm *c, net_layers *L) {
    enum net full = kind;
    dtr_result r;
    kind = net_base(kind);
    if ((kind == NET_LINEAR || kind == NET_LORA) && !c) {
        dtr_linear_layer_init(&L->l1, m, "l1", C, 2 * C, 1, DTR_INIT_TORCH_DEFAULT);
        dtr_linear_layer_init(&L->l2, m, "l2", 2 * C, C, 1, DTR_INIT_TORCH_DEFAULT);
        dtr_linear_layer_init(&L->l3, m, "l3", C, C, 1, DTR_INIT_TORCH_DEFAULT);
    } else if (kind == NET_LINEAR || kind == NET_LORA) {
        dtr_tp_column_linear_init(&L->t1, m, c, "l1", C, 2 * C, 1, DTR_INIT_TORCH_DEFAULT, 0);
        dtr_tp_row_linear_init(&L->t2, m, c, "l2", 2 * C, C, 1, DTR_INIT_TORCH_DEFAULT);
        dtr_tp_column_linear_init(&L->t3, m, c, "l3", C, C, 1, DTR_INIT_TORCH_DEFAULT, 1);
    } else if (kind == NET_ATTN) {   /* not causal (an encoder's); the GPT block's is */
        if (c) dtr_tp_attention_init(&L->tattn, m, c, "attn", C, HEADS), L->tattn.causal = 0;
        else dtr_attention_layer_init(&L->attn, m, "attn", C, HEADS), L->attn.causal = 0;
    } else {
        if (kind == NET_EMBED && c) dtr_tp_embedding_init(&L->temb, m, c, "wte", V, C);
        else if (kind == NET_EMBED) dtr_embedding_layer_init(&L->emb, m, "wte", V, C);
        if (kind == NET_GPT && c) dtr_tp_gpt_block_init(&L->tblock, m, c, "h0", C, HEADS);
        else if (kind == NET_GPT) dtr_gpt_block_init(&L->block, m, "h0", C, HEADS);
        if (c) dtr_tp_column_linear_init(&L->thead, m, c, "head", C, V, 1, DTR_INIT_TORCH_DEFAULT, 0);
        else dtr_linear_layer_init(&L->head, m, "head", C, V, 1, DTR_INIT_TORCH_DEFAULT);
    }
    r = kind == NET_LORA ? declare_lora(m, c, L) : dtr_model_build(m);
    set_dropout(full, c, L);
    return r;
}

/* The batch of a step: x (B, T, C) and a regression target of the same shape, token ids and
   next-token targets (B, T) -- the same on every rank. */
typedef struct batch { float x[B * T * C], y[B * T * C]; int32_t ids[B * T], tgt[B * T]; } batch;

static void make_batch(int step, batch *b) {
    dtr_rng r;
    int i;
    dtr_rng_seed(&r, 1234, (uint64_t)step);
    for (i = 0; i < B * T * C; i++) b->x[i] = 2.0f * dtr_rng_uniform(&r) - 1.0f;
    for (i = 0; i < B * T * C; i++) b->y[i] = 2.0f * dtr_rng_uniform(&r) - 1.0f;
    for (i = 0; i < B * T; i++) b->ids[i] = (int32_t)(dtr_rng_u32(&r) % V);
    for (i = 0; i < B * T; i++) b->tgt[i] = (int32_t)(dtr_rng_u32(&r) % V);
}

/* The loss of samples [lo, lo + n) of the batch. */
static dtr_tensor *forward_loss(dtr_context *ctx, enum net kind, dtr_comm *c, const net_layers *L, const batch *b, int lo,
                                int n) {
    const int64_t xs[3] = {n, T, C}, is[2] = {n, T};
    dtr_tensor *x = dtr_tensor_from(ctx, DTR_F32, 3, xs, b->x + lo * T * C), *y = dtr_tensor_from(ctx, DTR_F32, 3, xs, b->y + lo * T * C);
    dtr_tensor *ids = dtr_tensor_from(ctx, DTR_I32, 2, is, b->ids + lo * T), *tgt = dtr_tensor_from(ctx, DTR_I32, 2, is, b->tgt + lo * T), *h;
    kind = net_base(kind);
    if (kind == NET_LINEAR && !c)
        return dtr_mse(ctx, dtr_linear_layer_forward(ctx, &L->l3, dtr_linear_layer_forward(ctx, &L->l2,
                            dtr_gelu(ctx, dtr_linear_layer_forward(ctx, &L->l1, x)))), y);
    if (kind == NET_LINEAR)
        return dtr_mse(ctx, dtr_tp_linear_forward(ctx, &L->t3, dtr_tp_linear_forward(ctx, &L->t2,
                            dtr_gelu(ctx, dtr_tp_linear_forward(ctx, &L->t1, x)))), y);
    if (kind == NET_LORA && !c)
        return dtr_mse(ctx, dtr_attention_layer_forward(ctx, &L->attn, dtr_linear_layer_forward(ctx, &L->l3,
                            dtr_linear_layer_forward(ctx, &L->l2, dtr_gelu(ctx, dtr_linear_layer_forward(ctx, &L->l1, x))))), y);
    if (kind == NET_LORA)
        return dtr_mse(ctx, dtr_tp_attention_forward(ctx, &L->tattn, dtr_tp_linear_forward(ctx, &L->t3,
                            dtr_tp_linear_forward(ctx, &L->t2, dtr_gelu(ctx, dtr_tp_linear_forward(ctx, &L->t1, x))))), y);
    if (kind == NET_ATTN)
        return dtr_mse(ctx, c ? dtr_tp_attention_forward(ctx, &L->tattn, x) : dtr_attention_layer_forward(ctx, &L->attn, x), y);
    if (kind == NET_EMBED) h = c ? dtr_tp_embedding_forward(ctx, &L->temb, ids) : dtr_embedding_layer_forward(ctx, &L->emb, ids);
    else h = c ? dtr_tp_gpt_block_forward(ctx, &L->tblock, x) : dtr_gpt_block_forward(ctx, &L->block, x);
    if (kind == NET_EMBED) {   /* the batch's first target class ignored (as padding), label smoothing 0.1 */
        dtr_xent_config xc = dtr_xent_config_init();
        xc.ignore_index = b->tgt[0], xc.label_smoothing = 0.1f;
        if (c) return dtr_vocab_parallel_cross_entropy_ex(ctx, dtr_tp_linear_forward(ctx, &L->thead, h), tgt, c, &xc);
        return dtr_cross_entropy_ex(ctx, dtr_linear_layer_forward(ctx, &L->head, h), tgt, &xc);
    }
    if (c) return dtr_vocab_parallel_cross_entropy(ctx, dtr_tp_linear_forward(ctx, &L->thead, h), tgt, c);
    return dtr_cross_entropy(ctx, dtr_linear_layer_forward(ctx, &L->head, h), tgt);
}

/* NET_LORA after training: every adapter merged into its layer's weight (the TP ranks each
   into their shard); the loss on batch b (evaluation mode: no dropout) stays (1e-5), and the
   saved file then holds the merged weights and zero B's on either side. */
static int merge_lora(dtr_context *ctx, dtr_comm *c, net_layers *L, const batch *b) {
    dtr_linear_layer *ls[5] = {&L->l1, &L->l2, &L->l3, &L->attn.qkv, &L->attn.proj};
    dtr_tp_linear *ts[5] = {&L->t1, &L->t2, &L->t3, &L->tattn.qkv, &L->tattn.proj};
    dtr_tensor *loss;
    float before, after;
    int i, ok;
    dtr_context_set_training(ctx, 0);
    loss = forward_loss(ctx, NET_LORA, c, L, b, 0, B);
    before = loss ? dtr_tensor_get(loss, 0) : 0.0f, ok = loss != NULL;
    dtr_context_reset(ctx);
    for (i = 0; ok && i < 5; i++) ok = (c ? dtr_tp_linear_merge_lora(ts[i]) : dtr_linear_layer_merge_lora(ls[i])) == DTR_OK;
    loss = ok ? forward_loss(ctx, NET_LORA, c, L, b, 0, B) : NULL;
    after = loss ? dtr_tensor_get(loss, 0) : 0.0f;
    dtr_context_reset(ctx);
    CHECK_MSG(loss && fabsf(after - before) <= 1e-5f * (1.0f + fabsf(before)), "lora merged (%s): loss %.9g, before %.9g",
              c ? "tp" : "single device", after, before);
    return loss != NULL;
}

/* What one rank (or the reference) did: the loss of every step, its error if any. */
typedef struct run_out {
    float loss[STEPS];
    int ok;
    char msg[512];
} run_out;

/* Trains `steps` steps of net `kind` (comm NULL: single device); with `path`, saves the model
   after training (collective for TP) and, before it, loads `load` when given. With `dp`
   (group of D replicas, this one `dp_rank`): each replica trains on its 1/D of the batch. */
static void train_dp(enum net kind, dtr_comm *c, dtr_comm *dpc, int steps, const char *load, const char *path, run_out *o) {
    dtr_context *ctx = rank_ctx(c);
    dtr_model *m = NULL;
    dtr_optimizer *opt = NULL;
    int adamw = kind == NET_LINEAR || kind == NET_EMBED || net_base(kind) == NET_LORA;
    dtr_optimizer_config oc = dtr_optimizer_config_init(adamw ? DTR_OPT_ADAMW : DTR_OPT_SGD, adamw ? 0.01f : 0.1f);
    dtr_dp *dp = NULL;
    int D = dpc ? dtr_comm_size(dpc) : 1, lo = dpc ? dtr_comm_rank(dpc) * (B / D) : 0;
    net_layers L;
    batch b;
    int s;
    memset(o, 0, sizeof *o);
    o->ok = dtr_model_create(ctx, SEED, &m) == DTR_OK && declare(kind, m, c, &L) == DTR_OK &&
            (!load || dtr_model_load(m, load) == DTR_OK) && dtr_optimizer_create(m, &oc, &opt) == DTR_OK &&
            (!dpc || dtr_dp_create(m, dpc, NULL, &dp) == DTR_OK);
    for (s = 0; o->ok && s < steps; s++) {
        dtr_tensor *loss;
        make_batch(s % 2, &b);
        dtr_model_zero_grad(m);
        loss = forward_loss(ctx, kind, c, &L, &b, lo, B / D);
        o->ok = loss && dtr_backward(ctx, loss) == DTR_OK && (!dp || dtr_dp_finish(dp) == DTR_OK) &&
                dtr_optimizer_step(opt, NULL) == DTR_OK;
        if (o->ok) o->loss[s] = dtr_tensor_get(loss, 0);
        dtr_context_reset(ctx);
    }
    if (o->ok && net_base(kind) == NET_LORA) o->ok = merge_lora(ctx, c, &L, &b);
    if (o->ok && path) o->ok = dtr_model_save(m, path, DTR_F32) == DTR_OK;
    if (!o->ok) snprintf(o->msg, sizeof o->msg, "%s", dtr_context_last_error(ctx));
    dtr_dp_destroy(dp);
    dtr_optimizer_destroy(opt);
    dtr_model_destroy(m);
    dtr_context_destroy(ctx);
}

static void train(enum net kind, dtr_comm *c, int steps, const char *load, const char *path, run_out *o) {
    train_dp(kind, c, NULL, steps, load, path, o);
}

/* ---- thread ranks ---- */

typedef struct rank_job {
    pthread_t tid;
    dtr_local_world *w;
    int rank, steps, dp;   /* dp > 1: a grid of dp x (world / dp) tensor ranks */
    enum net kind;
    const char *load, *path;
    run_out out;
} rank_job;

static void *rank_main(void *arg) {
    rank_job *j = (rank_job *)arg;
    dtr_comm_config cfg = dtr_comm_config_init();
    dtr_comm *c = NULL;
    cfg.local.world = j->w;
    cfg.local.rank = j->rank;
    cfg.timeout_ms = 20000;
    if (dtr_comm_create(&cfg, &c, j->out.msg, sizeof j->out.msg) != DTR_OK) return NULL;
    if (j->dp > 1) {
        dtr_grid g;
        if (dtr_grid_create(c, j->dp, 1, dtr_comm_size(c) / j->dp, &g, j->out.msg, sizeof j->out.msg) == DTR_OK) {
            train_dp(j->kind, g.tp, g.dp, j->steps, j->load, g.dp_rank ? NULL : j->path, &j->out);   /* replica 0 saves */
            dtr_grid_destroy(&g);
        }
    } else {
        train(j->kind, c, j->steps, j->load, j->path, &j->out);
    }
    dtr_comm_destroy(c);
    return NULL;
}

/* Runs `tp` thread ranks; 1 when every rank succeeded (failures are reported). */
static int run_grid(int world, int dp, enum net kind, int steps, const char *load, const char *path, run_out *rank0) {
    static rank_job jobs[4];
    dtr_local_world *w = NULL;
    int r, ok = 1;
    if (dtr_local_world_create(world, NULL, &w) != DTR_OK) return 0;
    for (r = 0; r < world; r++) {
        memset(&jobs[r], 0, sizeof jobs[r]);
        jobs[r].w = w, jobs[r].rank = r, jobs[r].steps = steps, jobs[r].kind = kind, jobs[r].load = load, jobs[r].path = path;
        jobs[r].dp = dp;
        pthread_create(&jobs[r].tid, NULL, rank_main, &jobs[r]);
    }
    for (r = 0; r < world; r++) pthread_join(jobs[r].tid, NULL);
    for (r = 0; r < world; r++) {
        CHECK_MSG(jobs[r].out.ok, "%s, %d ranks (dp %d), rank %d: %s", k_net_names[kind], world, dp, r, jobs[r].out.msg);
        ok &= jobs[r].out.ok;
    }
    *rank0 = jobs[0].out;
    dtr_local_world_destroy(w);
    return ok;
}

static int run_tp(int tp, enum net kind, int steps, const char *load, const char *path, run_out *rank0) {
    return run_grid(tp, 1, kind, steps, load, path, rank0);
}

/* ---- comparing weights ---- */

/* Loads `path` into a single-device model of net `kind` (its parameters then hold the file). */
static dtr_model *load_single(dtr_context *ctx, enum net kind, const char *path) {
    dtr_model *m = NULL;
    net_layers L;
    CHECK_OK(ctx, dtr_model_create(ctx, 999, &m));
    CHECK_OK(ctx, declare(kind, m, NULL, &L));
    CHECK_OK(ctx, dtr_model_load(m, path));
    return m;
}

/* Largest over the parameters of ||a - b|| / ||a||. */
static double max_rel_error(dtr_model *a, dtr_model *b) {
    double worst = 0.0;
    int i;
    for (i = 0; i < dtr_model_param_count(a); i++) {
        dtr_tensor *ta = dtr_model_param_at(a, i), *tb = dtr_model_param_at(b, i);
        const float *pa = (const float *)dtr_tensor_data(ta), *pb = (const float *)dtr_tensor_data(tb);
        double d = 0.0, n = 0.0, e;
        int64_t k;
        for (k = 0; k < dtr_tensor_numel(ta); k++) d += (double)(pa[k] - pb[k]) * (pa[k] - pb[k]), n += (double)pa[k] * pa[k];
        e = sqrt(d) / (sqrt(n) + 1e-30);
        if (e > worst || e != e) worst = e != e ? 1e30 : e;
    }
    return worst;
}

/* Same files: every tensor within `tol` (relative per tensor). */
static void check_same_weights(enum net kind, const char *ref_path, const char *path, double tol, const char *what) {
    dtr_context *ctx = test_ctx(1);
    dtr_model *a = load_single(ctx, kind, ref_path), *b = load_single(ctx, kind, path);
    double e = max_rel_error(a, b);
    CHECK_MSG(e <= tol, "%s, %s: weights differ from the single device by %.3g", k_net_names[kind], what, e);
    dtr_model_destroy(a);
    dtr_model_destroy(b);
    dtr_context_destroy(ctx);
}

static void check_training(enum net kind) {
    run_out ref, got;
    char ref_path[512], path[512], what[64];
    int tp, s;
    tmp_path("tp_ref", k_net_names[kind], ref_path, sizeof ref_path);
    tmp_path("tp_run", k_net_names[kind], path, sizeof path);
    train(kind, NULL, STEPS, NULL, ref_path, &ref);
    CHECK_MSG(ref.ok, "%s, single device: %s", k_net_names[kind], ref.msg);
    CHECK_MSG(ref.loss[STEPS - 1] < ref.loss[0], "%s: the reference does not learn (%g -> %g)", k_net_names[kind],
              ref.loss[0], ref.loss[STEPS - 1]);
    for (tp = 2; ref.ok && tp <= 4; tp += 2) {
        if (!run_tp(tp, kind, STEPS, NULL, path, &got)) continue;
        for (s = 0; s < STEPS && fabsf(got.loss[s] - ref.loss[s]) <= 1e-5f * (1.0f + fabsf(ref.loss[s])); s++) {}
        if (s < STEPS)   /* the first step whose loss differs */
            CHECK_MSG(fabsf(got.loss[s] - ref.loss[s]) <= 1e-5f * (1.0f + fabsf(ref.loss[s])), "%s, tp %d, step %d: loss %.9g vs %.9g",
                      k_net_names[kind], tp, s, got.loss[s], ref.loss[s]);
        snprintf(what, sizeof what, "tp %d after %d steps", tp, STEPS);
        check_same_weights(kind, ref_path, path, 1e-5, what);
    }
    remove(ref_path);
    remove(path);
}

static void test_tp_train_linear(void) { check_training(NET_LINEAR); }
static void test_tp_train_attention(void) { check_training(NET_ATTN); }
static void test_tp_train_embedding(void) { check_training(NET_EMBED); }
static void test_tp_train_gpt(void) { check_training(NET_GPT); }
static void test_tp_train_lora(void) { check_training(NET_LORA); }
static void test_tp_train_dropout(void) {
    check_training(NET_GPT_DROPOUT);
    check_training(NET_LORA_DROPOUT);
}

/* the shards start as slices of the single-device weights: bit for bit */
static void test_tp_init(void) {
    run_out ref, got;
    char ref_path[512], path[512];
    tmp_path("tp_init", "ref", ref_path, sizeof ref_path);
    tmp_path("tp_init", "tp", path, sizeof path);
    train(NET_GPT, NULL, 0, NULL, ref_path, &ref);
    CHECK_MSG(ref.ok, "%s", ref.msg);
    if (run_tp(4, NET_GPT, 0, NULL, path, &got)) check_same_weights(NET_GPT, ref_path, path, 0.0, "tp 4 at initialisation");
    remove(ref_path);
    remove(path);
}

/* A single-device file (of another seed's weights) into TP 2: loaded shards, saved again,
   give the file back; and one step's loss equals the single device's on those weights. */
static void test_tp_load(void) {
    char src[512], path[512];
    run_out ref, got;
    dtr_context *ctx = test_ctx(1);
    dtr_model *m = NULL;
    net_layers L;
    tmp_path("tp_load", "src", src, sizeof src);
    tmp_path("tp_load", "tp", path, sizeof path);
    CHECK_OK(ctx, dtr_model_create(ctx, 4242, &m));
    CHECK_OK(ctx, declare(NET_GPT, m, NULL, &L));
    CHECK_OK(ctx, dtr_model_save(m, src, DTR_F32));
    dtr_model_destroy(m);
    dtr_context_destroy(ctx);
    if (run_tp(2, NET_GPT, 0, src, path, &got)) check_same_weights(NET_GPT, src, path, 0.0, "tp 2 loaded and saved");
    train(NET_GPT, NULL, 1, src, NULL, &ref);
    if (run_tp(2, NET_GPT, 1, src, NULL, &got))
        CHECK_MSG(ref.ok && fabsf(got.loss[0] - ref.loss[0]) <= 1e-5f * (1.0f + fabsf(ref.loss[0])), "loss %.9g vs %.9g",
                  got.loss[0], ref.loss[0]);
    remove(src);
    remove(path);
}

/* data 2 x tensor 2 on 4 ranks (dtr_grid_create): each replica trains the TP GPT block on
   half the batch, the data-parallel engine averages the gradients over the replicas; the
   weights equal one rank's on the whole batch. */
static void test_tp_grid(void) {
    run_out ref, got;
    char ref_path[512], path[512];
    tmp_path("tp_grid", "ref", ref_path, sizeof ref_path);
    tmp_path("tp_grid", "tp", path, sizeof path);
    train(NET_GPT, NULL, STEPS, NULL, ref_path, &ref);
    CHECK_MSG(ref.ok, "%s", ref.msg);
    if (run_grid(4, 2, NET_GPT, STEPS, NULL, path, &got))
        check_same_weights(NET_GPT, ref_path, path, 1e-5, "dp 2 x tp 2 after 20 steps");
    remove(ref_path);
    remove(path);
}

/* ---- bad input ---- */

typedef struct err_job { pthread_t tid; dtr_local_world *w; int rank; char msg[4][256]; dtr_result res[4]; } err_job;

static void note(err_job *j, int k, dtr_context *ctx, dtr_result r) {
    j->res[k] = r;
    snprintf(j->msg[k], sizeof j->msg[k], "%s", dtr_context_last_error(ctx));
}

/* on 2 ranks: 3 heads, a vocabulary of 15, an id and a target outside the vocabulary */
static void *err_main(void *arg) {
    err_job *j = (err_job *)arg;
    dtr_comm_config cfg = dtr_comm_config_init();
    dtr_comm *c = NULL;
    dtr_context *ctx;
    dtr_model *m = NULL;
    dtr_tp_attention a;
    dtr_tp_embedding e;
    int64_t n = 2, ls[2] = {2, 8};
    static const int32_t bad[2] = {1, 16};
    cfg.local.world = j->w;
    cfg.local.rank = j->rank;
    if (dtr_comm_create(&cfg, &c, NULL, 0) != DTR_OK) return NULL;
    ctx = rank_ctx(c);
    dtr_model_create(ctx, 1, &m);
    note(j, 0, ctx, dtr_tp_attention_init(&a, m, c, "attn", 12, 3));
    dtr_context_clear_error(ctx);
    note(j, 1, ctx, dtr_tp_embedding_init(&e, m, c, "wte", 15, 4));
    dtr_context_clear_error(ctx);
    dtr_tp_embedding_init(&e, m, c, "wte", 16, 4);
    dtr_model_build(m);
    note(j, 2, ctx, dtr_tp_embedding_forward(ctx, &e, dtr_tensor_from(ctx, DTR_I32, 1, &n, bad)) ? DTR_OK : dtr_context_status(ctx));
    dtr_context_clear_error(ctx);
    note(j, 3, ctx, dtr_vocab_parallel_cross_entropy(ctx, dtr_tensor_zeros(ctx, DTR_F32, 2, ls),
                                                     dtr_tensor_from(ctx, DTR_I32, 1, &n, bad), c) ? DTR_OK : dtr_context_status(ctx));
    dtr_model_destroy(m);
    dtr_context_destroy(ctx);
    dtr_comm_destroy(c);
    return NULL;
}

static void test_tp_errors(void) {
    static err_job jobs[2];
    dtr_local_world *w = NULL;
    dtr_context *ctx = test_ctx(1);
    dtr_model *m = NULL;
    dtr_tp_linear l;
    dtr_tp_gpt_block blk;
    int64_t n = 1;
    int r;
    CHECK_OK(ctx, dtr_model_create(ctx, 1, &m));
    CHECK_EQ_INT(dtr_tp_column_linear_init(&l, m, NULL, "fc", 4, 4, 1, DTR_INIT_TORCH_DEFAULT, 0), DTR_NULL_HANDLE);
    CHECK(strstr(dtr_context_last_error(ctx), "dtr_tp_column_linear_init: 'fc': comm is NULL") != NULL);
    dtr_context_clear_error(ctx);
    CHECK_EQ_INT(dtr_tp_gpt_block_init(&blk, m, NULL, "h0", 8, 2), DTR_NULL_HANDLE);
    CHECK(strstr(dtr_context_last_error(ctx), "comm is NULL") != NULL);
    dtr_context_clear_error(ctx);
    CHECK(dtr_vocab_parallel_cross_entropy(ctx, dtr_tensor_zeros(ctx, DTR_F32, 1, &n),
                                           dtr_tensor_zeros(ctx, DTR_I32, 1, &n), NULL) == NULL);
    CHECK_EQ_INT(dtr_context_status(ctx), DTR_NULL_HANDLE);
    CHECK(strstr(dtr_context_last_error(ctx), "dtr_vocab_parallel_cross_entropy: comm is NULL") != NULL);
    dtr_model_destroy(m);
    dtr_context_destroy(ctx);
    if (dtr_local_world_create(2, NULL, &w) != DTR_OK) return;
    for (r = 0; r < 2; r++) {
        memset(&jobs[r], 0, sizeof jobs[r]);
        jobs[r].w = w, jobs[r].rank = r;
        pthread_create(&jobs[r].tid, NULL, err_main, &jobs[r]);
    }
    for (r = 0; r < 2; r++) pthread_join(jobs[r].tid, NULL);
    dtr_local_world_destroy(w);
    for (r = 0; r < 2; r++) {
        CHECK_EQ_INT(jobs[r].res[0], DTR_INVALID_ARGUMENT);
        CHECK_MSG(strstr(jobs[r].msg[0], "3 heads must divide dim 12 and split evenly over 2 ranks") != NULL, "%s", jobs[r].msg[0]);
        CHECK_EQ_INT(jobs[r].res[1], DTR_INVALID_ARGUMENT);
        CHECK_MSG(strstr(jobs[r].msg[1], "vocab 15 must be > 0 and split evenly over 2 ranks") != NULL, "%s", jobs[r].msg[1]);
        CHECK_EQ_INT(jobs[r].res[2], DTR_INVALID_ARGUMENT);
        CHECK_MSG(strstr(jobs[r].msg[2], "id 1 is 16, outside [0, 16)") != NULL, "%s", jobs[r].msg[2]);
        CHECK_EQ_INT(jobs[r].res[3], DTR_INVALID_ARGUMENT);
        CHECK_MSG(strstr(jobs[r].msg[3], "target 1 is 16, outside [0, 16)") != NULL, "%s", jobs[r].msg[3]);
    }
}

/* ---- generation ---- */

#define GN 7   /* positions: 3 at once, then one a step */
typedef struct gen_job {
    pthread_t tid;
    dtr_local_world *w;
    int rank, ok;
    const float *x;
    float out[B * GN * C];
    char msg[512];
} gen_job;

/* The GPT block's output for x (B, GN, C): the plain pass (c NULL), or the tensor-parallel one
   through a KV cache of this rank's heads (width C / tp), fed 3 positions, then one a step. */
static void generate_block(dtr_comm *c, gen_job *j) {
    dtr_context *ctx = rank_ctx(c);
    dtr_model *m = NULL;
    dtr_kv_cache *kv = NULL;
    net_layers L;
    int64_t at, n = GN, b;
    j->ok = ctx && dtr_model_create(ctx, SEED, &m) == DTR_OK && declare(NET_GPT, m, c, &L) == DTR_OK &&
            dtr_kv_cache_create(ctx, 1, B, GN, c ? C / dtr_comm_size(c) : C, &kv) == DTR_OK;
    if (ctx) dtr_context_set_grad_enabled(ctx, 0);
    for (at = 0; j->ok && at < GN; at += n) {
        float part[B * GN * C];
        int64_t xs[3] = {B, 0, C};
        dtr_tensor *y;
        xs[1] = n = !c ? GN : at ? 1 : 3;
        for (b = 0; b < B; b++) memcpy(part + b * n * C, j->x + (b * GN + at) * C, sizeof(float) * (size_t)(n * C));
        y = c ? dtr_tp_gpt_block_forward_cached(ctx, &L.tblock, dtr_tensor_from(ctx, DTR_F32, 3, xs, part), kv, 0)
              : dtr_gpt_block_forward(ctx, &L.block, dtr_tensor_from(ctx, DTR_F32, 3, xs, part));
        j->ok = y && dtr_tensor_read(y, DTR_F32, part, (size_t)(B * n * C)) == DTR_OK;
        for (b = 0; j->ok && b < B; b++) memcpy(j->out + (b * GN + at) * C, part + b * n * C, sizeof(float) * (size_t)(n * C));
        dtr_context_reset(ctx);
    }
    if (!j->ok) snprintf(j->msg, sizeof j->msg, "%s", ctx ? dtr_context_last_error(ctx) : "no context");
    dtr_kv_cache_destroy(kv);
    dtr_model_destroy(m);
    dtr_context_destroy(ctx);
}

static void *gen_main(void *arg) {
    gen_job *j = (gen_job *)arg;
    dtr_comm_config cfg = dtr_comm_config_init();
    dtr_comm *c = NULL;
    cfg.local.world = j->w, cfg.local.rank = j->rank, cfg.timeout_ms = 20000;
    if (dtr_comm_create(&cfg, &c, j->msg, sizeof j->msg) == DTR_OK) generate_block(c, j);
    dtr_comm_destroy(c);
    return NULL;
}

/* Generation with the tensor-parallel block: TP 2 and 4, each rank caching its own heads, give
   the single-device block's outputs over the whole sequence at every position (1e-5). */
static void test_tp_generate(void) {
    static gen_job ref, jobs[4];
    float x[B * GN * C];
    dtr_rng r;
    int i, tp;
    dtr_rng_seed(&r, 77, 1);
    for (i = 0; i < B * GN * C; i++) x[i] = 2.0f * dtr_rng_uniform(&r) - 1.0f;
    ref.x = x;
    generate_block(NULL, &ref);
    CHECK_MSG(ref.ok, "single device: %s", ref.msg);
    for (tp = 2; tp <= 4; tp += 2) {
        dtr_local_world *w = NULL;
        double worst = 0.0;
        if (dtr_local_world_create(tp, NULL, &w) != DTR_OK) { CHECK(0); return; }
        for (i = 0; i < tp; i++) {
            memset(&jobs[i], 0, sizeof jobs[i]);
            jobs[i].w = w, jobs[i].rank = i, jobs[i].x = x;
            pthread_create(&jobs[i].tid, NULL, gen_main, &jobs[i]);
        }
        for (i = 0; i < tp; i++) pthread_join(jobs[i].tid, NULL);
        for (i = 0; i < tp; i++) CHECK_MSG(jobs[i].ok, "tp %d, rank %d: %s", tp, i, jobs[i].msg);
        worst = test_rel_gap(jobs[tp - 1].out, ref.out, B * GN * C);
        CHECK_MSG(worst < 1e-5, "tp %d through KV caches: %.3g from the whole sequence on one device", tp, worst);
        dtr_local_world_destroy(w);
    }
}

int main(void) {
#ifdef TP_CUDA
    if (dtr_cuda_device_count() <= 0) {
        printf("*** test_tp_gpu: no GPU visible: tensor-parallel GPU checks SKIPPED ***\n");
        return test_summary();
    }
#endif
    RUN(test_tp_train_linear);
    RUN(test_tp_train_attention);
    RUN(test_tp_train_embedding);
    RUN(test_tp_train_gpt);
    RUN(test_tp_train_lora);
    RUN(test_tp_train_dropout);
    RUN(test_tp_init);
    RUN(test_tp_load);
    RUN(test_tp_grid);
    RUN(test_tp_errors);
    RUN(test_tp_generate);
#ifdef TP_DEVSIM
    CHECK_EQ_INT(devsim__violations, 0);
#endif
    return test_summary();
}
