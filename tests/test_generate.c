/* tests/test_generate.c: generation with a key/value cache, and the token sampler.
 *   test_cache_gpt          a tiny GPT fed through a cache (a prompt in two pieces, then one token
 *                           a step) gives the logits of the whole sequence's forward pass, position
 *                           by position (1e-5; f32 and bf16 activations); the cache outlives
 *                           dtr_context_reset; reset reuses it
 *   test_cache_llama        the same for Llama blocks (grouped-query heads, RoPE at each position)
 *   test_cache_errors       gradients on, a full cache (left unchanged), wrong shapes and dtypes, a
 *                           layer out of range, a captured step, an encoder's attention: clear
 *                           errors, no crash
 *   test_learn_and_generate a tiny GPT learns a sentence; greedy generation through the cache from
 *                           its first letters writes the rest (and equals sampling without a cache)
 *   test_sample_greedy      temperature 0 and top_k 1 give the first largest logit; NaN and -inf
 *                           never win; a row with no finite logit is an error
 *   test_sample_distribution 40000 draws follow softmax(logits / T) (each share within 4 sigma),
 *                           top_k and top_p keep only the tokens they should (on 5 tokens and
 *                           on a vocabulary of 600 with ties), a seed repeats */
#include "test.h"

enum { G_V = 31, G_C = 16, G_CAP = 32, G_LAYERS = 2 };

typedef struct gen_model {
    dtr_model *m;
    int llama;
    dtr_embedding_layer wte, wpe;
    dtr_gpt_block h[G_LAYERS];
    dtr_llama_block l[G_LAYERS];
    dtr_layernorm_layer ln;
    dtr_rmsnorm_layer rms;
    dtr_linear_layer head;
} gen_model;

static void gen_init(dtr_context *ctx, gen_model *g, int llama) {
    char name[16];
    int i;
    memset(g, 0, sizeof *g);
    g->llama = llama;
    CHECK_OK(ctx, dtr_model_create(ctx, 7, &g->m));
    CHECK_OK(ctx, dtr_embedding_layer_init(&g->wte, g->m, "wte", G_V, G_C));
    if (!llama) CHECK_OK(ctx, dtr_embedding_layer_init(&g->wpe, g->m, "wpe", G_CAP, G_C));
    for (i = 0; i < G_LAYERS; i++) {
        snprintf(name, sizeof name, "h.%d", i);
        if (llama) CHECK_OK(ctx, dtr_llama_block_init(&g->l[i], g->m, name, G_C, 4, 2, 24));
        else CHECK_OK(ctx, dtr_gpt_block_init(&g->h[i], g->m, name, G_C, 4));
    }
    if (llama) CHECK_OK(ctx, dtr_rmsnorm_layer_init(&g->rms, g->m, "norm", G_C));
    else CHECK_OK(ctx, dtr_layernorm_layer_init(&g->ln, g->m, "ln", G_C));
    CHECK_OK(ctx, dtr_linear_layer_init(&g->head, g->m, "head", G_C, G_V, 0, DTR_INIT_TORCH_DEFAULT));
    CHECK_OK(ctx, dtr_model_build(g->m));
}

/* logits (B, T, V) of tokens ids (B, T) at positions at .. at + T - 1, through the cache (NULL:
   the plain forward pass, at 0) */
static dtr_tensor *gen_forward(dtr_context *ctx, gen_model *g, const int32_t *ids, int64_t B, int64_t T, int64_t at, dtr_kv_cache *kv) {
    int64_t s[2] = {B, T}, i;
    int32_t pos[64];
    dtr_tensor *h = dtr_embedding_layer_forward(ctx, &g->wte, dtr_tensor_from(ctx, DTR_I32, 2, s, ids));
    for (i = 0; i < B * T && i < 64; i++) pos[i] = (int32_t)(at + i % T);
    if (!g->llama) h = dtr_add(ctx, h, dtr_embedding_layer_forward(ctx, &g->wpe, dtr_tensor_from(ctx, DTR_I32, 2, s, pos)));
    for (i = 0; i < G_LAYERS; i++)
        h = g->llama ? dtr_llama_block_forward_cached(ctx, &g->l[i], h, kv, (int)i) : dtr_gpt_block_forward_cached(ctx, &g->h[i], h, kv, (int)i);
    h = g->llama ? dtr_rmsnorm_layer_forward(ctx, &g->rms, h) : dtr_layernorm_layer_forward(ctx, &g->ln, h);
    return dtr_linear_layer_forward(ctx, &g->head, h);
}

/* The whole sequence (B 2, N 10) once, then through a cache: the prompt's 5 positions as 3 + 2,
   then a position a step, each step's logits against the whole's at its positions; after
   dtr_kv_cache_reset the same again (the cache's memory reused, nothing stale read). The blocks
   have dropout 0.5: the whole runs in evaluation mode, the cached steps in training mode (a
   cache ignores dropout). */
static void cache_matches(int llama, dtr_dtype act) {
    enum { B = 2, N = 10 };
    static const int64_t pieces[] = {3, 2, 1, 1, 1, 1, 1};
    dtr_context_config cc = dtr_context_config_init();
    dtr_context *ctx = NULL;
    gen_model g;
    dtr_kv_cache *kv = NULL;
    int32_t ids[B * N], piece[B * N];
    float *whole = (float *)malloc(sizeof(float) * B * N * G_V), step[B * 3 * G_V];
    double worst = 0.0;
    int64_t at, i, b, t;
    int round, p;
    for (i = 0; i < B * N; i++) ids[i] = (int32_t)((i * 11 + 3) % G_V);
    cc.threads = 2, cc.activation_dtype = act;
    if (dtr_context_create(&cc, &ctx) != DTR_OK) { CHECK(0); free(whole); return; }
    gen_init(ctx, &g, llama);
    for (i = 0; i < G_LAYERS; i++) *(llama ? &g.l[i].attention_dropout : &g.h[i].dropout) = 0.5f;
    dtr_context_set_grad_enabled(ctx, 0);
    dtr_context_set_training(ctx, 0);
    CHECK_OK(ctx, dtr_tensor_read(gen_forward(ctx, &g, ids, B, N, 0, NULL), DTR_F32, whole, B * N * G_V));
    dtr_context_set_training(ctx, 1);
    dtr_context_reset(ctx);
    CHECK_OK(ctx, dtr_kv_cache_create(ctx, G_LAYERS, B, G_CAP, llama ? G_C / 2 : G_C, &kv));
    for (round = 0; round < 2; round++) {
        for (p = 0, at = 0; p < 7; at += pieces[p], p++) {
            int64_t T = pieces[p];
            CHECK_EQ_INT((int)dtr_kv_cache_length(kv, 0), (int)at);
            for (b = 0; b < B; b++) memcpy(piece + b * T, ids + b * N + at, (size_t)T * sizeof(int32_t));
            CHECK_OK(ctx, dtr_tensor_read(gen_forward(ctx, &g, piece, B, T, at, kv), DTR_F32, step, (size_t)(B * T * G_V)));
            for (b = 0; b < B; b++)
                for (t = 0; t < T; t++)
                    for (i = 0; i < G_V; i++) {
                        double a = step[(b * T + t) * G_V + i], e = whole[(b * N + at + t) * G_V + i];
                        worst = fmax(worst, fabs(a - e) / (1.0 + fabs(e)));
                    }
            dtr_context_reset(ctx);   /* the cache is not the arena's */
        }
        CHECK_EQ_INT((int)dtr_kv_cache_length(kv, G_LAYERS - 1), N);
        dtr_kv_cache_reset(kv);
        CHECK_EQ_INT((int)dtr_kv_cache_length(kv, 0), 0);
    }
    CHECK_MSG(worst < 1e-5, "%s (%s activations): cached logits differ from the whole sequence's by %.3g", llama ? "llama" : "gpt",
              dtr_dtype_name(act), worst);
    printf("  %s, %s activations: cached steps against the whole sequence: largest difference %.3g\n", llama ? "llama" : "gpt",
           dtr_dtype_name(act), worst);
    dtr_kv_cache_destroy(kv);
    dtr_model_destroy(g.m);
    dtr_context_destroy(ctx);
    free(whole);
}

/* f32, and bf16 activations (a bf16 cache: the layers' k and v as stored) */
static void test_cache_gpt(void) { cache_matches(0, DTR_F32), cache_matches(0, DTR_BF16); }
static void test_cache_llama(void) { cache_matches(1, DTR_F32), cache_matches(1, DTR_BF16); }

/* a captured step that appends to the cache (refused: its position would change every launch) */
typedef struct capture_arg { dtr_kv_cache *kv; dtr_tensor *k, *v; } capture_arg;
static dtr_result append_step(dtr_context *ctx, void *user) {
    capture_arg *a = (capture_arg *)user;
    dtr_tensor *keys, *values;
    (void)ctx;
    return dtr_kv_cache_append(a->kv, 0, a->k, a->v, &keys, &values);
}

static void test_cache_errors(void) {
    dtr_context *ctx = test_ctx(1);
    dtr_kv_cache *kv = NULL;
    int64_t s3[3] = {2, 3, 8}, s4[3] = {2, 3, 6}, one[3] = {2, 1, 8};
    dtr_tensor *k, *v, *keys = NULL, *values = NULL;
    gen_model g;
    int32_t ids[2] = {1, 2};
    CHECK(dtr_kv_cache_create(ctx, 0, 2, 4, 8, &kv) == DTR_INVALID_ARGUMENT && kv == NULL);
    dtr_context_clear_error(ctx);
    CHECK_OK(ctx, dtr_kv_cache_create(ctx, 2, 2, 4, 8, &kv));
    k = dtr_tensor_full(ctx, 3, s3, 1.0f), v = dtr_tensor_full(ctx, 3, s3, 2.0f);
    CHECK(dtr_kv_cache_append(kv, 0, k, v, &keys, &values) == DTR_BAD_STATE);   /* gradients on */
    CHECK(strstr(dtr_context_last_error(ctx), "dtr_context_set_grad_enabled") != NULL);
    dtr_context_clear_error(ctx);
    dtr_context_set_grad_enabled(ctx, 0);
    CHECK_OK(ctx, dtr_kv_cache_append(kv, 0, k, v, &keys, &values));
    CHECK(keys != NULL && dtr_tensor_dim(keys, 1) == 4 && dtr_tensor_get(keys, 2 * 8) == 1.0f && dtr_tensor_get(values, 0) == 2.0f);
    CHECK(dtr_tensor_get(keys, 3 * 8) == 0.0f);   /* zeroed, not written */
    CHECK(dtr_kv_cache_append(kv, 0, k, v, &keys, &values) == DTR_INVALID_ARGUMENT);   /* 3 + 3 > 4 */
    CHECK(strstr(dtr_context_last_error(ctx), "holds 3 of 4 positions") != NULL && dtr_kv_cache_length(kv, 0) == 3);
    dtr_context_clear_error(ctx);
    CHECK(dtr_kv_cache_append(kv, 2, k, v, &keys, &values) == DTR_INVALID_ARGUMENT);
    dtr_context_clear_error(ctx);
    CHECK(dtr_kv_cache_append(kv, 1, k, dtr_tensor_full(ctx, 3, s4, 0.0f), &keys, &values) == DTR_SHAPE_MISMATCH);
    dtr_context_clear_error(ctx);
    CHECK(dtr_kv_cache_append(kv, 1, dtr_cast(ctx, k, DTR_BF16), dtr_cast(ctx, v, DTR_BF16), &keys, &values) == DTR_DTYPE_MISMATCH);
    dtr_context_clear_error(ctx);
    CHECK(dtr_kv_cache_append(kv, 1, dtr_tensor_full(ctx, 3, one, 0.5f), dtr_tensor_full(ctx, 3, one, 0.5f), &keys, &values) == DTR_OK);
    CHECK(dtr_kv_cache_length(kv, 1) == 1 && dtr_kv_cache_length(kv, 0) == 3 && dtr_kv_cache_length(NULL, 0) == 0);
    CHECK(dtr_kv_cache_append(NULL, 0, k, v, &keys, &values) == DTR_NULL_HANDLE);
    {
        capture_arg ca;
        dtr_graph *gr = NULL;
        ca.kv = kv, ca.k = dtr_tensor_full(ctx, 3, one, 0.5f), ca.v = dtr_tensor_full(ctx, 3, one, 0.5f);
        CHECK(dtr_graph_capture(ctx, append_step, &ca, &gr) == DTR_BAD_STATE && gr == NULL);
        CHECK(strstr(dtr_context_last_error(ctx), "captured step") != NULL && dtr_kv_cache_length(kv, 0) == 3);
        dtr_context_clear_error(ctx);
    }
    dtr_kv_cache_destroy(kv);
    kv = NULL;
    gen_init(ctx, &g, 0);   /* an encoder's attention has no cache */
    CHECK_OK(ctx, dtr_kv_cache_create(ctx, G_LAYERS, 1, 4, G_C, &kv));
    g.h[0].attn.causal = 0;
    CHECK(gen_forward(ctx, &g, ids, 1, 2, 0, kv) == NULL && dtr_context_status(ctx) == DTR_UNSUPPORTED);
    dtr_context_clear_error(ctx);
    dtr_kv_cache_destroy(kv);
    dtr_kv_cache_destroy(NULL);
    dtr_model_destroy(g.m);
    dtr_context_destroy(ctx);
}

/* End to end: a tiny GPT (2 blocks of 32, 4 heads, learned positions) trained with AdamW on
   windows of a repeating sentence, then greedy generation from its first 5 letters through the
   cache writes the rest of the sentence, and sampling with top_k 1 and no cache (the whole
   sequence each step) writes the same. */
static const char g_text[] = "the quick brown fox jumps. ";
enum { E_T = 32, E_B = 8, E_PROMPT = 5 };
static int32_t text_id(int64_t i) { char ch = g_text[i % (int64_t)(sizeof g_text - 1)]; return ch == ' ' ? 26 : ch == '.' ? 27 : ch - 'a'; }

static void train_sentence(dtr_context *ctx, gen_model *g) {
    dtr_optimizer_config oc = dtr_optimizer_config_init(DTR_OPT_ADAMW, 1e-2f);
    dtr_optimizer *opt = NULL;
    int32_t ids[E_B * E_T], pos[E_B * E_T], tgt[E_B * E_T];
    int64_t s[2] = {E_B, E_T}, n = E_B * E_T, i;
    float first = 0.0f, last = 0.0f;
    int step;
    CHECK_OK(ctx, dtr_optimizer_create(g->m, &oc, &opt));
    for (step = 0; step < 200; step++) {
        dtr_tensor *h, *loss;
        for (i = 0; i < n; i++) {
            int64_t at = (i / E_T) * 5 + step * 3 + i % E_T;
            ids[i] = text_id(at), tgt[i] = text_id(at + 1), pos[i] = (int32_t)(i % E_T);
        }
        h = dtr_add(ctx, dtr_embedding_layer_forward(ctx, &g->wte, dtr_tensor_from(ctx, DTR_I32, 2, s, ids)),
                    dtr_embedding_layer_forward(ctx, &g->wpe, dtr_tensor_from(ctx, DTR_I32, 2, s, pos)));
        for (i = 0; i < G_LAYERS; i++) h = dtr_gpt_block_forward(ctx, &g->h[i], h);
        h = dtr_linear_layer_forward(ctx, &g->head, dtr_layernorm_layer_forward(ctx, &g->ln, h));
        {
            int64_t rows[2] = {n, G_V};
            loss = dtr_cross_entropy(ctx, dtr_reshape(ctx, h, 2, rows), dtr_tensor_from(ctx, DTR_I32, 1, &n, tgt));
        }
        CHECK_OK(ctx, dtr_backward(ctx, loss));
        CHECK_OK(ctx, dtr_optimizer_step(opt, NULL));
        last = dtr_tensor_get(loss, 0);
        if (step == 0) first = last;
        dtr_context_reset(ctx);
    }
    printf("  the sentence: loss %.3f -> %.4f in 200 AdamW steps\n", first, last);
    CHECK(last < 0.05f);
    dtr_optimizer_destroy(opt);
}

/* E_T - E_PROMPT tokens after the prompt into out: through the cache, or (kv NULL) the whole
   sequence so far each step, sampled with cfg */
static void generate(dtr_context *ctx, gen_model *g, dtr_kv_cache *kv, const dtr_sample_config *cfg, int32_t *out) {
    int32_t seq[E_T];
    int64_t at = 0, len;
    uint64_t rng = 3;
    for (len = 0; len < E_PROMPT; len++) seq[len] = text_id(len);
    for (; len < E_T; len++) {
        dtr_tensor *logits = gen_forward(ctx, g, seq + (kv ? at : 0), 1, kv ? len - at : len, kv ? at : 0, kv);
        CHECK_OK(ctx, dtr_sample(ctx, logits, cfg, &rng, &seq[len]));
        at = len;
        dtr_context_reset(ctx);
    }
    memcpy(out, seq + E_PROMPT, sizeof(int32_t) * (E_T - E_PROMPT));
}

static void test_learn_and_generate(void) {
    dtr_context *ctx = test_ctx(2);
    dtr_sample_config greedy = dtr_sample_config_init(), top1 = dtr_sample_config_init();
    dtr_kv_cache *kv = NULL;
    int32_t a[E_T], b[E_T];
    char got[E_T + 1];
    gen_model g;
    int i, right = 0;
    gen_init(ctx, &g, 0);
    train_sentence(ctx, &g);
    dtr_context_set_grad_enabled(ctx, 0);
    CHECK_OK(ctx, dtr_kv_cache_create(ctx, G_LAYERS, 1, E_T, G_C, &kv));
    greedy.temperature = 0.0f, top1.top_k = 1;
    generate(ctx, &g, kv, &greedy, a);
    generate(ctx, &g, NULL, &top1, b);
    for (i = 0; i < E_T - E_PROMPT; i++) {
        right += a[i] == text_id(E_PROMPT + i);
        got[i] = a[i] == 26 ? ' ' : a[i] == 27 ? '.' : (char)('a' + a[i]);
    }
    got[E_T - E_PROMPT] = 0;
    printf("  greedy from \"the q\" through the cache: \"%s\"\n", got);
    CHECK_MSG(right == E_T - E_PROMPT, "%d of %d generated letters continue the sentence", right, E_T - E_PROMPT);
    CHECK(memcmp(a, b, sizeof(int32_t) * (E_T - E_PROMPT)) == 0);
    dtr_kv_cache_destroy(kv);
    dtr_model_destroy(g.m);
    dtr_context_destroy(ctx);
}

static dtr_tensor *logits_of(dtr_context *ctx, const float *v, int64_t B, int64_t V) {
    int64_t s[2] = {B, V};
    return dtr_tensor_from(ctx, DTR_F32, 2, s, v);
}

static void test_sample_greedy(void) {
    dtr_context *ctx = test_ctx(1);
    static const float v[2 * 6] = {0.5f, 3.0f, NAN, 3.0f, -1.0f, 2.0f, -INFINITY, NAN, -2.0f, -3.0f, -2.0f, -7.0f};
    const float none[3] = {NAN, -INFINITY, INFINITY};
    dtr_sample_config sc = dtr_sample_config_init();
    uint64_t rng = 1, before;
    int32_t tok[2] = {-5, -5};
    int i, seen = 0;
    CHECK(sc.temperature == 1.0f && sc.top_k == 0 && sc.top_p == 1.0f);
    sc.temperature = 0.0f;
    CHECK_OK(ctx, dtr_sample(ctx, logits_of(ctx, v, 2, 6), &sc, &rng, tok));
    CHECK(tok[0] == 1 && tok[1] == 2 && rng == 1);   /* the first of equals; no draw */
    sc.temperature = 1.0f, sc.top_k = 1;
    for (i = 0; i < 40; i++) {   /* ties at the top_k-th stay in: both of each row's come up */
        CHECK_OK(ctx, dtr_sample(ctx, logits_of(ctx, v, 2, 6), &sc, &rng, tok));
        CHECK((tok[0] == 1 || tok[0] == 3) && (tok[1] == 2 || tok[1] == 4));
        seen |= 1 << (tok[0] == 3) | 4 << (tok[1] == 4);
    }
    CHECK_EQ_INT(seen, 15);
    before = rng;
    CHECK(dtr_sample(ctx, logits_of(ctx, none, 1, 3), &sc, &rng, tok) == DTR_INVALID_ARGUMENT);
    CHECK(strstr(dtr_context_last_error(ctx), "no finite logit") != NULL && rng == before);
    dtr_context_clear_error(ctx);
    sc.top_p = 0.0f;
    CHECK(dtr_sample(ctx, logits_of(ctx, v, 2, 6), &sc, &rng, tok) == DTR_INVALID_ARGUMENT);
    dtr_context_clear_error(ctx);
    sc = dtr_sample_config_init();
    {
        int64_t s1[1] = {6};
        CHECK(dtr_sample(ctx, dtr_tensor_from(ctx, DTR_F32, 1, s1, v), &sc, &rng, tok) == DTR_SHAPE_MISMATCH);
    }
    dtr_context_clear_error(ctx);
    CHECK(dtr_sample(ctx, NULL, &sc, &rng, tok) == DTR_NULL_HANDLE);
    dtr_context_destroy(ctx);
}

/* shares of 40000 draws (one batch of 40000 identical rows) against p, each within 4 sigma; 0
   where p is 0 */
static void draws_follow(dtr_context *ctx, const float *row, int V, const dtr_sample_config *sc, const double *p, uint64_t seed) {
    enum { N = 40000 };
    float *rows = (float *)malloc(sizeof(float) * N * (size_t)V);
    int32_t *tok = (int32_t *)malloc(sizeof(int32_t) * N);
    int count[16] = {0}, i, bad = 0;
    uint64_t rng = seed;
    for (i = 0; i < N; i++) memcpy(rows + (size_t)i * V, row, sizeof(float) * (size_t)V);
    CHECK_OK(ctx, dtr_sample(ctx, logits_of(ctx, rows, N, V), sc, &rng, tok));
    for (i = 0; i < N; i++) count[tok[i] >= 0 && tok[i] < V ? tok[i] : 15]++;
    for (i = 0; i < V; i++) {
        double share = (double)count[i] / N, sigma = sqrt(p[i] * (1.0 - p[i]) / N);
        if (p[i] == 0.0 ? count[i] != 0 : fabs(share - p[i]) > 4.0 * sigma + 1e-9) bad++;
        if (bad == 1 && (p[i] == 0.0 ? count[i] != 0 : fabs(share - p[i]) > 4.0 * sigma + 1e-9))
            printf("  token %d: share %.4f, expected %.4f\n", i, share, p[i]), bad++;
    }
    CHECK_MSG(bad == 0, "draws do not follow the distribution (T %g, top_k %d, top_p %g)", (double)sc->temperature, sc->top_k,
              (double)sc->top_p);
    free(rows);
    free(tok);
}

/* a vocabulary of 600 (logits with ties): top_k 50 draws only tokens at or above the 50th
   largest logit (ties in), top_p 0.5 only tokens of the nucleus (the fewest largest reaching
   half the mass), each computed here by sorting; both draw the largest often */
static int desc_float(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return x < y ? 1 : x > y ? -1 : 0;
}
static void cuts_of_a_vocabulary(dtr_context *ctx) {
    enum { VV = 600, N = 4000 };
    float *row = (float *)malloc(sizeof(float) * VV), *sorted = (float *)malloc(sizeof(float) * VV), *rows;
    int32_t *tok = (int32_t *)malloc(sizeof(int32_t) * N);
    dtr_sample_config sc = dtr_sample_config_init();
    double sum = 0.0, acc = 0.0;
    float kth, pth = 0.0f;
    uint64_t rng = 11;
    int i, pass, out = 0, top = 0;
    for (i = 0; i < VV; i++) row[i] = (float)((i * 7919) % 97) / 10.0f;   /* 97 values, each about 6 times */
    memcpy(sorted, row, sizeof(float) * VV);
    qsort(sorted, VV, sizeof(float), desc_float);
    kth = sorted[49];
    for (i = 0; i < VV; i++) sum += exp(sorted[i] - sorted[0]);
    for (i = 0; i < VV && acc < 0.5 * sum; i++) acc += exp(sorted[i] - sorted[0]), pth = sorted[i];
    rows = (float *)malloc(sizeof(float) * VV * N);
    for (i = 0; i < N; i++) memcpy(rows + (size_t)i * VV, row, sizeof(float) * VV);
    for (pass = 0; pass < 2; pass++) {
        int64_t shape[2] = {N, VV};
        sc.top_k = pass ? 0 : 50, sc.top_p = pass ? 0.5f : 1.0f;
        CHECK_OK(ctx, dtr_sample(ctx, dtr_tensor_from(ctx, DTR_F32, 2, shape, rows), &sc, &rng, tok));
        for (i = 0; i < N; i++) out += row[tok[i]] < (pass ? pth : kth), top += row[tok[i]] == sorted[0];
    }
    CHECK_MSG(out == 0, "%d draws outside the top_k / top_p cut", out);
    CHECK(top > N / 10);
    free(row), free(sorted), free(rows), free(tok);
}

static void test_sample_distribution(void) {
    dtr_context *ctx = test_ctx(1);
    static const float row[5] = {1.0f, 0.0f, 2.0f, -1.0f, 0.5f};
    static const int order[5] = {2, 0, 4, 1, 3};   /* by logit, largest first */
    dtr_sample_config sc = dtr_sample_config_init();
    double p[5], e[5], sum, kept;
    int32_t a[4], b[4];
    float rows[4 * 5];
    uint64_t r1 = 42, r2 = 42;
    int i, pass;
    for (pass = 0; pass < 4; pass++) {   /* T 1; T 0.5; T 1 top_k 2; T 1 top_p 0.8 */
        sc = dtr_sample_config_init();
        if (pass == 1) sc.temperature = 0.5f;
        if (pass == 2) sc.top_k = 2;
        if (pass == 3) sc.top_p = 0.8f;
        for (i = 0, sum = 0.0; i < 5; i++) sum += e[i] = exp(row[i] / sc.temperature);
        for (i = 0; i < 5; i++) p[i] = e[i] / sum;
        if (pass >= 2) {   /* top_k 2 keeps tokens 2 and 0; top_p 0.8: 2, 0, 4 reach 0.896 (2 and 0: 0.770) */
            int keep = pass == 2 ? 2 : 3;
            for (i = keep, kept = 0.0; i < 5; i++) p[order[i]] = 0.0;
            for (i = 0; i < 5; i++) kept += p[i];
            for (i = 0; i < 5; i++) p[i] /= kept;
        }
        draws_follow(ctx, row, 5, &sc, p, 7 + (uint64_t)pass);
        dtr_context_reset(ctx);
    }
    for (i = 0; i < 20; i++) rows[i] = row[i % 5];
    sc = dtr_sample_config_init();
    CHECK_OK(ctx, dtr_sample(ctx, logits_of(ctx, rows, 4, 5), &sc, &r1, a));
    CHECK_OK(ctx, dtr_sample(ctx, logits_of(ctx, rows, 4, 5), &sc, &r2, b));
    CHECK(memcmp(a, b, sizeof a) == 0 && r1 == r2 && r1 != 42);   /* the same seed, the same tokens */
    dtr_context_reset(ctx);
    cuts_of_a_vocabulary(ctx);
    dtr_context_destroy(ctx);
}

int main(void) {
    RUN(test_cache_gpt);
    RUN(test_cache_llama);
    RUN(test_cache_errors);
    RUN(test_learn_and_generate);
    RUN(test_sample_greedy);
    RUN(test_sample_distribution);
    return test_summary();
}
