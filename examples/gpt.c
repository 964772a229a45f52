/* examples/gpt.c: a small byte-level GPT trained with pipeline, data and tensor parallelism.
 *
 * What it shows: one program trains the same model on one rank or on a grid of
 * data x pipeline x tensor ranks, changing only the launch:
 *   - the whole model is declared on every rank; dtr_model_keep keeps this rank's stage
 *     (token and position embeddings on the first, blocks h.i in between, ln_f and the head
 *     on the last), so every layout starts from the same weights;
 *   - dtr_grid_create lays the ranks out; dtr_pipe runs the micro-batches through the stages
 *     (GPipe, 1F1B or interleaved); dtr_dp averages the gradients of the replicas of a stage
 *     during the last micro-batch's backward;
 *   - a training step reads: dtr_pipe_step, dtr_optimizer_step, dtr_context_reset.
 * Data: the bytes of any text file (default /usr/share/common-licenses/GPL-3, which every
 * Debian system has); sample i of step t is a window of `context` bytes at a position drawn
 * from (seed, t, i), its targets the next bytes. Each step prints the loss (mean over the
 * replicas) and tokens per second; a model that learns goes from ln 256 = 5.55 to about 2.5
 * in 200 steps of the defaults.
 *
 * Build and run from the repository:
 *     make examples && build/examples/gpt --stages 2 --microbatches 8
 *     build/examples/gpt --dp 2 --stages 2 --tp 2          (8 thread ranks)
 *     dtrun -n 2 -- build/examples/gpt --stages 2 --transport libfabric
 * By hand, with dtrain.h, common.h and ranks.h beside this file:
 *     cc -O2 -I. -DDTRAIN_IMPLEMENTATION gpt.c -o gpt -lm -lpthread
 *
 * Usage: gpt [TEXT_FILE] [--stages P] [--chunks V] [--microbatches M]
 *            [--schedule gpipe|1f1b|interleaved] [--dp D] [--tp T] [--steps N] [--batch B]
 *            [--context T] [--dim C] [--heads H] [--layers L] [--lr LR] [--seed S]
 *            [--dropout P] [--transport local|NAME] [--provider P] [--threads N] [--checkpoint]
 *            [--quiet] [--generate N] [--prompt TEXT] [--temperature T] [--top-k K]
 *   --stages, --chunks  pipeline ranks, and model chunks per rank (interleaved schedule)
 *   --dp, --tp          data-parallel replicas; tensor-parallel ranks per stage (the
 *                       embedding, every block and the head split over them, the
 *                       cross-entropy vocabulary-parallel)
 *   --dropout P         dropout P while training on the embeddings and in every block
 *                       (dtr_gpt_block.dropout: the attention weights and both residual
 *                       branches), as nanoGPT's; default 0; each
 *                       replica's context draws its own masks (seed + replica), the tensor
 *                       ranks of a replica their shares of one device's
 *   --checkpoint        recompute each block's activations in backward (dtr_checkpoint):
 *                       less memory, one more forward of the blocks
 *   --batch             samples per step over all replicas (default 16), split into M
 *                       micro-batches per replica
 *   --generate N        after training, world rank 0 writes --prompt (default "The ") and N
 *                       bytes sampled from the model (--temperature, default 0.8; --top-k,
 *                       default 40; 0: greedy), one forward pass of one position a byte through
 *                       a KV cache (dtr_kv_cache); needs the whole model on a stage (--stages
 *                       1): with --tp each rank of the first replica caches its heads and
 *                       the vocabulary-parallel logits are gathered; stops when the context
 *                       is full
 *   world = dp * stages * tp ranks: threads of this process (--transport local, default)
 *   or the launcher's processes. */
#include "common.h"
#include "ranks.h"

/* ---- options ---- */

typedef struct gpt_opts {
    const char *text, *transport, *provider, *prompt;
    int stages, chunks, microbatches, dp, tp, steps, batch, context, dim, heads, layers, threads, quiet, checkpoint;
    int generate, top_k;
    dtr_pipe_schedule schedule;
    float lr, temperature, dropout;
    unsigned long seed;
} gpt_opts;

static gpt_opts gpt_opts_default(void) {
    gpt_opts o;
    memset(&o, 0, sizeof o);
    o.text = "/usr/share/common-licenses/GPL-3";
    o.transport = "local";
    o.stages = 1, o.chunks = 1, o.microbatches = 4, o.dp = 1, o.tp = 1, o.steps = 50, o.batch = 16;
    o.context = 64, o.dim = 64, o.heads = 4, o.layers = 4, o.threads = 1;
    o.schedule = DTR_PIPE_1F1B;
    o.lr = 3e-3f;
    o.prompt = "The ", o.temperature = 0.8f, o.top_k = 40;
    o.seed = 1;
    return o;
}

/* ---- the model ---- */

#define GPT_VOCAB 256
#define GPT_MAX_LAYERS 64
#define GPT_MAX_CONTEXT 4096   /* --generate: the most positions a sequence may reach */

typedef struct gpt_model gpt_model;
typedef struct gpt_block_ref { gpt_model *g; int i; } gpt_block_ref;   /* a block, for dtr_checkpoint */

struct gpt_model {
    const gpt_opts *o;
    const unsigned char *text;
    long text_len;
    dtr_model *m;
    dtr_comm *tp;                       /* tensor-parallel group (--tp > 1), else NULL */
    dtr_embedding_layer wte, wpe;       /* without tp */
    dtr_gpt_block h[GPT_MAX_LAYERS];
    dtr_linear_layer head;
    dtr_tp_embedding twte;              /* with tp: vocabulary-parallel */
    dtr_tp_gpt_block th[GPT_MAX_LAYERS];
    dtr_tp_linear thead;                /* column-parallel, logits stay split */
    dtr_layernorm_layer ln_f;
    gpt_block_ref ref[GPT_MAX_LAYERS];
    dtr_pipe *pipe;
    int pp_rank, pp_size, dp_rank, step;
};

/* the whole model, under the same names with or without tensor parallelism (a tp model
 * starts from the weights of the single-device one) */
static dtr_result gpt_declare(gpt_model *g, dtr_model *m) {
    const gpt_opts *o = g->o;
    char name[32];
    dtr_result r;
    int i;
    g->m = m;
    r = g->tp ? dtr_tp_embedding_init(&g->twte, m, g->tp, "wte", GPT_VOCAB, o->dim)
              : dtr_embedding_layer_init(&g->wte, m, "wte", GPT_VOCAB, o->dim);
    if (r == DTR_OK) r = dtr_embedding_layer_init(&g->wpe, m, "wpe", o->context, o->dim);
    for (i = 0; i < o->layers && r == DTR_OK; i++) {
        snprintf(name, sizeof name, "h.%d", i);
        g->ref[i].g = g, g->ref[i].i = i;
        r = g->tp ? dtr_tp_gpt_block_init(&g->th[i], m, g->tp, name, o->dim, o->heads)
                  : dtr_gpt_block_init(&g->h[i], m, name, o->dim, o->heads);
        g->th[i].dropout = g->h[i].dropout = o->dropout;
    }
    if (r == DTR_OK) r = dtr_layernorm_layer_init(&g->ln_f, m, "ln_f", o->dim);
    if (r != DTR_OK) return r;
    return g->tp ? dtr_tp_column_linear_init(&g->thead, m, g->tp, "head", o->dim, GPT_VOCAB, 0, DTR_INIT_TORCH_DEFAULT, 0)
                 : dtr_linear_layer_init(&g->head, m, "head", o->dim, GPT_VOCAB, 0, DTR_INIT_TORCH_DEFAULT);
}

/* the blocks of stage s of S: [first(s), first(s + 1)) */
static int gpt_first_block(const gpt_opts *o, int s) { return s * o->layers / (o->stages * o->chunks); }
static int gpt_last_stage(const gpt_opts *o, int s) { return s == o->stages * o->chunks - 1; }

/* keeps the layers of this rank's stages (chunk c is stage c * P + pp_rank) */
static dtr_result gpt_keep(gpt_model *g) {
    const gpt_opts *o = g->o;
    char names[GPT_MAX_LAYERS + 4][16];
    const char *keep[GPT_MAX_LAYERS + 4];
    int n = 0, c, b;
    for (c = 0; c < o->chunks; c++) {
        int s = c * o->stages + g->pp_rank;
        if (s == 0) keep[n++] = "wte.", keep[n++] = "wpe.";
        for (b = gpt_first_block(o, s); b < gpt_first_block(o, s + 1); b++) {
            snprintf(names[n], sizeof names[n], "h.%d.", b);
            keep[n] = names[n];
            n++;
        }
        if (gpt_last_stage(o, s)) keep[n++] = "ln_f.", keep[n++] = "head.";
    }
    return dtr_model_keep(g->m, keep, n);
}

/* ---- data: windows of the text ---- */

/* token ids (or, with `next`, targets) of samples [lo, hi) of this replica, step g->step */
static dtr_tensor *gpt_tokens(gpt_model *g, dtr_context *ctx, int64_t lo, int64_t hi, int next) {
    const gpt_opts *o = g->o;
    int64_t shape[2] = {hi - lo, o->context}, i, k, per = o->batch / o->dp;
    int32_t *ids = (int32_t *)malloc((size_t)(shape[0] * shape[1]) * sizeof(int32_t));
    dtr_tensor *t;
    if (!ids) return NULL;
    for (i = lo; i < hi; i++) {
        dtr_rng r;
        long at;
        dtr_rng_seed(&r, o->seed, (uint64_t)g->step * 1000003u + (uint64_t)(g->dp_rank * per + i));
        at = (long)(dtr_rng_u32(&r) % (uint32_t)(g->text_len - o->context - 1));
        for (k = 0; k < o->context; k++) ids[(i - lo) * o->context + k] = g->text[at + k + next];
    }
    t = dtr_tensor_from(ctx, DTR_I32, 2, shape, ids);
    free(ids);
    return t;
}

static dtr_tensor *gpt_embed(gpt_model *g, dtr_context *ctx, int64_t lo, int64_t hi) {
    int64_t shape[2] = {hi - lo, g->o->context}, i;
    int32_t *pos = (int32_t *)malloc((size_t)(shape[0] * shape[1]) * sizeof(int32_t));
    dtr_tensor *p, *ids = gpt_tokens(g, ctx, lo, hi, 0);
    dtr_tensor *x = g->tp ? dtr_tp_embedding_forward(ctx, &g->twte, ids) : dtr_embedding_layer_forward(ctx, &g->wte, ids);
    if (!pos) return NULL;
    for (i = 0; i < shape[0] * shape[1]; i++) pos[i] = (int32_t)(i % shape[1]);
    p = dtr_embedding_layer_forward(ctx, &g->wpe, dtr_tensor_from(ctx, DTR_I32, 2, shape, pos));
    free(pos);
    return dtr_dropout(ctx, dtr_add(ctx, x, p), g->o->dropout);   /* --dropout: nanoGPT's on the embeddings too */
}

static dtr_tensor *gpt_loss(gpt_model *g, dtr_context *ctx, dtr_tensor *x, int64_t lo, int64_t hi) {
    int64_t n = (hi - lo) * g->o->context, ls[2] = {n, GPT_VOCAB / g->o->tp}, ts[1] = {n};
    dtr_tensor *y = dtr_layernorm_layer_forward(ctx, &g->ln_f, x), *targets;
    dtr_tensor *logits = g->tp ? dtr_tp_linear_forward(ctx, &g->thead, y) : dtr_linear_layer_forward(ctx, &g->head, y);
    logits = dtr_reshape(ctx, logits, 2, ls);
    targets = dtr_reshape(ctx, gpt_tokens(g, ctx, lo, hi, 1), 1, ts);
    return g->tp ? dtr_vocab_parallel_cross_entropy(ctx, logits, targets, g->tp) : dtr_cross_entropy(ctx, logits, targets);
}

/* block i on x (dtr_checkpoint's region when --checkpoint: its activations are recomputed) */
static dtr_tensor *gpt_block_region(void *user, dtr_context *ctx, dtr_tensor *const *in) {
    const gpt_block_ref *b = (const gpt_block_ref *)user;
    return b->g->tp ? dtr_tp_gpt_block_forward(ctx, &b->g->th[b->i], in[0]) : dtr_gpt_block_forward(ctx, &b->g->h[b->i], in[0]);
}

static dtr_tensor *gpt_block(gpt_model *g, dtr_context *ctx, int i, dtr_tensor *x) {
    return g->o->checkpoint ? dtr_checkpoint(ctx, gpt_block_region, &g->ref[i], 1, &x) : gpt_block_region(&g->ref[i], ctx, &x);
}

/* the pipeline engine's forward of stage chunk * P + pp_rank for one micro-batch */
static dtr_tensor *gpt_forward(void *user, dtr_context *ctx, int chunk, int mb, dtr_tensor *x) {
    gpt_model *g = (gpt_model *)user;
    int s = chunk * g->o->stages + g->pp_rank, b;
    int64_t lo, hi;
    if (dtr_pipe_microbatch_range(g->pipe, mb, &lo, &hi) != DTR_OK) return NULL;
    if (s == 0) x = gpt_embed(g, ctx, lo, hi);
    for (b = gpt_first_block(g->o, s); b < gpt_first_block(g->o, s + 1); b++) x = gpt_block(g, ctx, b, x);
    return gpt_last_stage(g->o, s) ? gpt_loss(g, ctx, x, lo, hi) : x;
}

/* ---- one rank ---- */

typedef struct gpt_result {
    double tokens_per_s;     /* mean over the steps after the first */
    double bubble, bubble_theory;   /* measured idle fraction (mean over ranks and steps), theory */
    float first_loss, last_loss;
    int ok;
} gpt_result;

typedef struct gpt_job {
    const gpt_opts *o;
    const unsigned char *text;
    long text_len;
    gpt_result *res;         /* written by world rank 0 */
} gpt_job;

static int gpt_err(dtr_comm *c, const char *what, dtr_context *ctx, const char *msg) {
    fprintf(stderr, "rank %d: error: %s: %s\n", dtr_comm_rank(c), what, msg ? msg : dtr_context_last_error(ctx));
    return 0;
}

/* model, engines and optimizer of this rank; g->pipe set on success */
static dtr_result gpt_setup(gpt_model *g, dtr_context *ctx, const dtr_grid *grid, dtr_dp **dp, dtr_optimizer **opt) {
    const gpt_opts *o = g->o;
    dtr_optimizer_config oc = dtr_optimizer_config_init(DTR_OPT_ADAMW, o->lr);
    dtr_pipe_config pc = dtr_pipe_config_init();
    dtr_model *m = NULL;
    dtr_result r = dtr_model_create(ctx, o->seed, &m);
    g->pp_rank = grid->pp_rank, g->pp_size = grid->pp_size, g->dp_rank = grid->dp_rank;
    g->tp = o->tp > 1 ? grid->tp : NULL;
    if (r == DTR_OK) r = gpt_declare(g, m);
    if (r == DTR_OK) r = gpt_keep(g);
    if (r == DTR_OK && o->dp > 1) r = dtr_dp_create(m, grid->dp, NULL, dp);
    pc.schedule = o->schedule, pc.chunks = o->chunks, pc.microbatches = o->microbatches;
    pc.batch = o->batch / o->dp, pc.forward = gpt_forward, pc.user = g, pc.dp = *dp;
    if (r == DTR_OK) r = dtr_pipe_create(m, grid->pp, &pc, &g->pipe);
    if (r == DTR_OK) r = dtr_pipe_optimizer_config(g->pipe, &oc);   /* one gradient norm for all stages */
    if (r == DTR_OK) r = dtr_optimizer_create(m, &oc, opt);
    return r;
}

/* the loop: step, print, measure; 1 on success */
static int gpt_loop(gpt_model *g, dtr_context *ctx, const dtr_grid *grid, dtr_comm *world, dtr_optimizer *opt,
                    gpt_result *res) {
    const gpt_opts *o = g->o;
    double idle = 0.0, sum_s = 0.0;
    float bubble;
    int lead = dtr_comm_rank(world) == 0;
    dtr_pipe_stats st;
    for (g->step = 0; g->step < o->steps; g->step++) {
        float loss = 0.0f;
        double t0 = fm_now(), dt;
        if (dtr_pipe_step(g->pipe, &loss) != DTR_OK || dtr_optimizer_step(opt, NULL) != DTR_OK) return gpt_err(world, "step", ctx, NULL);
        dtr_context_reset(ctx);
        if (dtr_comm_all_reduce(grid->dp, &loss, &loss, 1, DTR_F32, DTR_REDUCE_AVG) != DTR_OK)
            return gpt_err(world, "loss", ctx, dtr_comm_last_error(grid->dp));
        dt = fm_now() - t0;
        dtr_pipe_get_stats(g->pipe, &st);
        if (g->step > 0) sum_s += dt, idle += st.bubble;
        if (g->step == 0) res->first_loss = loss;
        res->last_loss = loss;
        if (lead && !o->quiet)
            printf("step %4d  loss %.4f  %8.0f tokens/s\n", g->step, loss, (double)o->batch * o->context / dt);
    }
    bubble = (float)(o->steps > 1 ? idle / (o->steps - 1) : st.bubble);   /* this rank's mean */
    if (dtr_comm_all_reduce(world, &bubble, &bubble, 1, DTR_F32, DTR_REDUCE_AVG) != DTR_OK)
        return gpt_err(world, "bubble", ctx, dtr_comm_last_error(world));
    res->bubble = bubble;
    res->bubble_theory = st.bubble_theory;
    res->tokens_per_s = sum_s > 0 ? (double)(o->steps - 1) * o->batch * o->context / sum_s : 0.0;
    return 1;
}

/* --generate: the prompt, then o->generate bytes each sampled from the logits of the last
   position, fed back as the next position; the blocks keep the earlier positions' keys and
   values in a cache, so each step runs one position through the model. 1 on success. */
static int gpt_generate(gpt_model *g, dtr_context *ctx, int lead) {
    const gpt_opts *o = g->o;
    dtr_sample_config sc = dtr_sample_config_init();
    dtr_kv_cache *kv = NULL;
    int64_t n = (int64_t)strlen(o->prompt), at = 0, T, i, shape[2];
    int32_t ids[GPT_MAX_CONTEXT], pos[GPT_MAX_CONTEXT], next = 0;
    uint64_t rng = o->seed;
    int made = 0, prev = dtr_context_set_grad_enabled(ctx, 0), ok = n > 0 && n < o->context && o->context <= GPT_MAX_CONTEXT;
    int training = dtr_context_set_training(ctx, 0);   /* no dropout while generating */
    sc.temperature = o->temperature, sc.top_k = o->top_k;
    if (!ok) fprintf(stderr, "error: --prompt must be 1 to %d bytes (under --context, at most %d)\n", o->context - 1, GPT_MAX_CONTEXT);
    ok = ok && dtr_kv_cache_create(ctx, o->layers, 1, o->context, o->dim / o->tp, &kv) == DTR_OK;
    for (i = 0; i < n; i++) ids[i] = (unsigned char)o->prompt[i];
    if (ok && lead) printf("%s", o->prompt);
    for (T = n; ok && made < o->generate && at + T <= o->context; at += T, T = 1, ids[0] = next) {
        dtr_tensor *x;
        shape[0] = 1, shape[1] = T;
        for (i = 0; i < T; i++) pos[i] = (int32_t)(at + i);
        x = dtr_tensor_from(ctx, DTR_I32, 2, shape, ids);
        x = dtr_add(ctx, g->tp ? dtr_tp_embedding_forward(ctx, &g->twte, x) : dtr_embedding_layer_forward(ctx, &g->wte, x),
                    dtr_embedding_layer_forward(ctx, &g->wpe, dtr_tensor_from(ctx, DTR_I32, 2, shape, pos)));
        for (i = 0; i < o->layers; i++)
            x = g->tp ? dtr_tp_gpt_block_forward_cached(ctx, &g->th[i], x, kv, (int)i) : dtr_gpt_block_forward_cached(ctx, &g->h[i], x, kv, (int)i);
        x = dtr_layernorm_layer_forward(ctx, &g->ln_f, x);
        x = g->tp ? dtr_tp_gather(ctx, dtr_tp_linear_forward(ctx, &g->thead, x), g->tp) : dtr_linear_layer_forward(ctx, &g->head, x);
        ok = dtr_sample(ctx, x, &sc, &rng, &next) == DTR_OK;   /* from the last position's logits: the same on every rank */
        if (ok && lead) putchar(next >= 32 && next < 127 ? next : next == '\n' ? '\n' : '?');
        made += ok;
        dtr_context_reset(ctx);
    }
    if (lead) printf("%s\n", ok && made < o->generate ? " [context full]" : "");
    if (!ok && kv) fprintf(stderr, "error: generate: %s\n", dtr_context_last_error(ctx));
    dtr_kv_cache_destroy(kv);
    dtr_context_set_grad_enabled(ctx, prev);
    dtr_context_set_training(ctx, training);
    return ok;
}

static int gpt_rank(dtr_comm *world, void *user) {
    gpt_job *j = (gpt_job *)user;
    const gpt_opts *o = j->o;
    dtr_context_config cc = dtr_context_config_init();
    dtr_context *ctx = NULL;
    dtr_optimizer *opt = NULL;
    dtr_dp *dp = NULL;
    dtr_grid grid;
    gpt_model g;
    gpt_result mine;
    char err[256];
    int ok = 0;
    memset(&g, 0, sizeof g);
    memset(&mine, 0, sizeof mine);
    g.o = o, g.text = j->text, g.text_len = j->text_len;
    cc.threads = o->threads;
    if (dtr_grid_create(world, o->dp, o->stages, o->tp, &grid, err, sizeof err) != DTR_OK) return gpt_err(world, "grid", NULL, err);
    cc.seed = o->seed * 1000003u + (uint64_t)grid.dp_rank;   /* dropout: each replica its own masks */
    if (dtr_context_create(&cc, &ctx) != DTR_OK) { dtr_grid_destroy(&grid); return gpt_err(world, "context", NULL, "no memory"); }
    if (gpt_setup(&g, ctx, &grid, &dp, &opt) != DTR_OK) gpt_err(world, "setup", ctx, NULL);
    else ok = gpt_loop(&g, ctx, &grid, world, opt, &mine);
    if (ok && o->generate > 0 && g.dp_rank == 0) ok = gpt_generate(&g, ctx, dtr_comm_rank(world) == 0);   /* the first replica */
    if (ok && dtr_comm_rank(world) == 0) *j->res = mine, j->res->ok = 1;
    dtr_pipe_destroy(g.pipe);
    dtr_dp_destroy(dp);
    dtr_optimizer_destroy(opt);
    dtr_model_destroy(g.m);
    dtr_context_destroy(ctx);
    dtr_grid_destroy(&grid);
    return ok;
}

/* ---- the program ---- */

/* reads the whole file; NULL with a message on failure */
static unsigned char *gpt_read_text(const char *path, long *len) {
    FILE *f = fopen(path, "rb");
    unsigned char *buf = NULL;
    if (!f) { fprintf(stderr, "error: cannot open %s (give any text file of a few KB)\n", path); return NULL; }
    if (fseek(f, 0, SEEK_END) == 0 && (*len = ftell(f)) > 0 && fseek(f, 0, SEEK_SET) == 0 &&
        (buf = (unsigned char *)malloc((size_t)*len)) && fread(buf, 1, (size_t)*len, f) != (size_t)*len) {
        free(buf);
        buf = NULL;
    }
    fclose(f);
    if (!buf) fprintf(stderr, "error: cannot read %s\n", path);
    return buf;
}

static const char *gpt_check(const gpt_opts *o, long len) {
    if (o->stages < 1 || o->chunks < 1 || o->dp < 1 || o->tp < 1 || o->microbatches < 1 || o->steps < 1)
        return "--stages, --chunks, --dp, --tp, --microbatches and --steps must be >= 1";
    if (o->layers < 1 || o->layers > GPT_MAX_LAYERS || o->layers < o->stages * o->chunks)
        return "--layers must be 1 to 64 and at least one per stage (stages x chunks)";
    if (o->batch % o->dp || o->batch / o->dp < o->microbatches) return "--batch must divide by --dp into >= M samples each";
    if (o->dim % o->heads || o->context < 2 || len < o->context + 2) return "--dim must divide by --heads; the text must be longer than --context";
    if (o->heads % o->tp || GPT_VOCAB % o->tp) return "--tp must divide --heads and the 256 byte values";
    if (o->generate > 0 && o->stages > 1) return "--generate needs the whole model on one stage: --stages 1";
    if (o->generate < 0 || o->temperature < 0.0f || o->top_k < 0) return "--generate, --temperature and --top-k must be >= 0";
    return NULL;
}

static int gpt_train(const gpt_opts *o, gpt_result *res) {
    gpt_job j;
    const char *bad;
    int ok;
    memset(res, 0, sizeof *res);
    j.o = o, j.res = res;
    j.text = gpt_read_text(o->text, &j.text_len);
    if (!j.text) return 0;
    if ((bad = gpt_check(o, j.text_len)) != NULL) {
        fprintf(stderr, "error: %s\n", bad);
        free((void *)j.text);
        return 0;
    }
    ok = ex_run_ranks("gpt", o->transport, o->provider, o->dp * o->stages * o->tp, !o->quiet, gpt_rank, &j);
    free((void *)j.text);
    return ok;
}

/* the value of option a (1) into o; 0 when a is not one of them, -1 when v is bad */
static int gpt_option(gpt_opts *o, const char *a, const char *v) {
    static const char *const names[] = {"--stages", "--chunks", "--microbatches", "--dp", "--tp", "--steps", "--batch",
                                        "--context", "--dim", "--heads", "--layers", "--threads", "--generate", "--top-k"};
    int *fields[] = {&o->stages, &o->chunks, &o->microbatches, &o->dp, &o->tp, &o->steps, &o->batch,
                     &o->context, &o->dim, &o->heads, &o->layers, &o->threads, &o->generate, &o->top_k};
    char *end = NULL;
    size_t i;
    for (i = 0; i < sizeof names / sizeof names[0]; i++)
        if (!strcmp(a, names[i])) { *fields[i] = (int)strtol(v, &end, 10); return end && !*end && end != v ? 1 : -1; }
    if (!strcmp(a, "--lr")) { o->lr = strtof(v, &end); return end && !*end && o->lr > 0 ? 1 : -1; }
    if (!strcmp(a, "--dropout")) { o->dropout = strtof(v, &end); return end && !*end && o->dropout >= 0 && o->dropout < 1 ? 1 : -1; }
    if (!strcmp(a, "--seed")) { o->seed = strtoul(v, &end, 10); return end && !*end ? 1 : -1; }
    if (!strcmp(a, "--temperature")) { o->temperature = strtof(v, &end); return end && !*end && end != v ? 1 : -1; }
    if (!strcmp(a, "--prompt")) { o->prompt = v; return 1; }
    if (!strcmp(a, "--transport")) { o->transport = v; return 1; }
    if (!strcmp(a, "--provider")) { o->provider = v; return 1; }
    if (!strcmp(a, "--schedule")) {
        o->schedule = !strcmp(v, "gpipe") ? DTR_PIPE_GPIPE : !strcmp(v, "interleaved") ? DTR_PIPE_INTERLEAVED : DTR_PIPE_1F1B;
        return !strcmp(v, "gpipe") || !strcmp(v, "1f1b") || !strcmp(v, "interleaved") ? 1 : -1;
    }
    return 0;
}

/* the command line into o; 0 (with a message) when it is wrong */
static int gpt_parse(int argc, char **argv, gpt_opts *o) {
    int i, k;
    for (i = 1; i < argc; i++) {
        if (argv[i][0] != '-') { o->text = argv[i]; continue; }
        if (!strcmp(argv[i], "--quiet")) { o->quiet = 1; continue; }
        if (!strcmp(argv[i], "--checkpoint")) { o->checkpoint = 1; continue; }
        if (i + 1 >= argc) { fprintf(stderr, "error: %s needs a value\n", argv[i]); return 0; }
        k = gpt_option(o, argv[i], argv[i + 1]);
        if (k <= 0) { fprintf(stderr, "error: %s %s\n", k ? "bad value for" : "unknown option", argv[i]); return 0; }
        i++;
    }
    if (o->chunks > 1) o->schedule = DTR_PIPE_INTERLEAVED;
    return 1;
}

#ifndef GPT_NO_MAIN
int main(int argc, char **argv) {
    gpt_opts o = gpt_opts_default();
    gpt_result res;
    if (argc > 1 && (!strcmp(argv[1], "-h") || !strcmp(argv[1], "--help"))) {
        printf("usage: %s [TEXT_FILE] [--stages P] [--chunks V] [--microbatches M] [--schedule gpipe|1f1b|interleaved] "
               "[--dp D] [--tp T] [--steps N] [--batch B] [--context T] [--dim C] [--heads H] [--layers L] [--lr LR] "
               "[--seed S] [--dropout P] [--transport local|NAME] [--provider P] [--threads N] [--checkpoint] [--quiet] "
               "[--generate N] [--prompt TEXT] [--temperature T] [--top-k K]\n", argv[0]);
        return 0;
    }
    if (!gpt_parse(argc, argv, &o)) return 2;
    if (!o.quiet)
        printf("gpt: %d layers, dim %d, context %d; data %d x pipeline %d%s x tensor %d; %s, %d micro-batches; %s\n",
               o.layers, o.dim, o.context, o.dp, o.stages, o.chunks > 1 ? " (2+ chunks per rank)" : "", o.tp,
               dtr_pipe_schedule_name(o.schedule), o.microbatches, o.text);
    if (!gpt_train(&o, &res)) return 1;
    if (res.ok)
        printf("loss %.4f -> %.4f; %.0f tokens/s; pipeline bubble %.3f (theory %.3f)\n", res.first_loss, res.last_loss,
               res.tokens_per_s, res.bubble, res.bubble_theory);
    return 0;
}
#endif
