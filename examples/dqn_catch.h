/* examples/dqn_catch.h: a deep Q-network learning the game of catch (examples/dqn_catch.c and
 * tests/test_train.c share it).
 *
 * The game: a 5 x 5 grid; a ball starts in a random column of the top row and falls one row a
 * step; the paddle on the bottom row moves left, stays or moves right (actions 0, 1, 2). When the
 * ball reaches the bottom row the episode ends: +1 if the paddle is under it, -1 if not. The
 * observation is the grid as 25 numbers (1 where the ball is, 1 where the paddle is).
 *
 * The learner (Mnih et al.'s DQN): an MLP 25-64-3 gives each action's value; a replay buffer of
 * transitions; each step a batch of 32 transitions is drawn and the value of the action taken
 * (dtr_gather) is pulled toward r + gamma max_a' Q_target(s', a') (dtr_max on the target network,
 * no gradient) with the Huber loss (dtr_huber_loss); Adam; then the target network trails the
 * online one by a soft update (dtr_model_lerp, tau 0.02). Acting is epsilon-greedy, the greedy
 * action taken on the context's backend (dtr_argmax). Everything goes through the public API.
 * Include it once per program, after dtrain.h. */
#ifndef DTRAIN_EXAMPLES_DQN_CATCH_H
#define DTRAIN_EXAMPLES_DQN_CATCH_H

#include <stdint.h>
#include <string.h>

#define CATCH_N 5
#define CATCH_OBS (CATCH_N * CATCH_N)
#define CATCH_ACTIONS 3
#define DQN_CAP 4096
#define DQN_BATCH 32

typedef struct catch_game { int bx, by, px; } catch_game;

static void catch_reset(catch_game *g, dtr_rng *rng) {
    g->bx = (int)(dtr_rng_u32(rng) % CATCH_N), g->by = 0, g->px = CATCH_N / 2;
}

static void catch_observe(const catch_game *g, float *o) {
    memset(o, 0, CATCH_OBS * sizeof(float));
    o[g->by * CATCH_N + g->bx] = 1.0f;
    o[(CATCH_N - 1) * CATCH_N + g->px] += 1.0f;
}

/* moves the paddle by action - 1, drops the ball; 1 when the episode ended (*reward +-1) */
static int catch_step(catch_game *g, int action, float *reward) {
    g->px += action - 1;
    g->px = g->px < 0 ? 0 : g->px >= CATCH_N ? CATCH_N - 1 : g->px;
    *reward = 0.0f;
    if (++g->by < CATCH_N - 1) return 0;
    *reward = g->bx == g->px ? 1.0f : -1.0f;
    return 1;
}

typedef struct dqn_net { dtr_model *m; dtr_linear_layer l1, l2; } dqn_net;

typedef struct dqn {
    dtr_context *ctx;
    dqn_net online, target;
    dtr_optimizer *opt;
    float s[DQN_CAP][CATCH_OBS], s2[DQN_CAP][CATCH_OBS], r[DQN_CAP], done[DQN_CAP];
    int32_t a[DQN_CAP];
    int64_t n;            /* transitions stored (the buffer's next slot is n % DQN_CAP) */
    float gamma, tau;
    int64_t decay;        /* steps over which epsilon falls from 1 to 0.05 */
} dqn;

static dtr_result dqn_net_init(dqn_net *q, dtr_context *ctx, uint64_t seed) {
    dtr_result r;
    if ((r = dtr_model_create(ctx, seed, &q->m)) != DTR_OK) return r;
    if ((r = dtr_linear_layer_init(&q->l1, q->m, "l1", CATCH_OBS, 64, 1, DTR_INIT_TORCH_DEFAULT)) != DTR_OK) return r;
    if ((r = dtr_linear_layer_init(&q->l2, q->m, "l2", 64, CATCH_ACTIONS, 1, DTR_INIT_TORCH_DEFAULT)) != DTR_OK) return r;
    return dtr_model_build(q->m);
}

/* x (B, 25) -> each action's value (B, 3) */
static dtr_tensor *dqn_forward(dtr_context *ctx, const dqn_net *q, dtr_tensor *x) {
    return dtr_linear_layer_forward(ctx, &q->l2, dtr_relu(ctx, dtr_linear_layer_forward(ctx, &q->l1, x)));
}

/* the online and target networks (the target starts as a copy), Adam at lr */
static dtr_result dqn_init(dqn *d, dtr_context *ctx, float lr, uint64_t seed) {
    dtr_optimizer_config oc = dtr_optimizer_config_init(DTR_OPT_ADAM, lr);
    dtr_result r;
    memset(d, 0, sizeof *d);
    d->ctx = ctx, d->gamma = 0.95f, d->tau = 0.02f, d->decay = 1000;
    if ((r = dqn_net_init(&d->online, ctx, seed)) != DTR_OK || (r = dqn_net_init(&d->target, ctx, seed + 1)) != DTR_OK ||
        (r = dtr_model_lerp(d->target.m, d->online.m, 1.0f)) != DTR_OK)
        return r;
    return dtr_optimizer_create(d->online.m, &oc, &d->opt);
}

static void dqn_free(dqn *d) {
    dtr_optimizer_destroy(d->opt);
    dtr_model_destroy(d->online.m);
    dtr_model_destroy(d->target.m);
}

/* the greedy action for observation o (dtr_argmax on the backend); -1 on error */
static int dqn_greedy(dqn *d, const float *o) {
    int64_t xs[2] = {1, CATCH_OBS};
    int32_t a = -1;
    dtr_context_set_grad_enabled(d->ctx, 0);
    if (dtr_tensor_read(dtr_argmax(d->ctx, dqn_forward(d->ctx, &d->online, dtr_tensor_from(d->ctx, DTR_F32, 2, xs, o)), 1, 0),
                        DTR_I32, &a, 1) != DTR_OK)
        a = -1;
    dtr_context_set_grad_enabled(d->ctx, 1);
    dtr_context_reset(d->ctx);
    return a;
}

static void dqn_remember(dqn *d, const float *s, int a, float r, const float *s2, int done) {
    int64_t i = d->n++ % DQN_CAP;
    memcpy(d->s[i], s, sizeof d->s[i]), memcpy(d->s2[i], s2, sizeof d->s2[i]);
    d->a[i] = a, d->r[i] = r, d->done[i] = (float)done;
}

/* y = r + gamma (1 - done) max_a' Q_target(s2, a') for the batch's rows, on the host */
static dtr_result dqn_targets(dqn *d, const float *s2, const int64_t *rows, float *y) {
    int64_t xs[2] = {DQN_BATCH, CATCH_OBS}, k;
    float best[DQN_BATCH];
    dtr_result r;
    dtr_context_set_grad_enabled(d->ctx, 0);
    r = dtr_tensor_read(dtr_max(d->ctx, dqn_forward(d->ctx, &d->target, dtr_tensor_from(d->ctx, DTR_F32, 2, xs, s2)), 1, 0), DTR_F32,
                        best, DQN_BATCH);
    dtr_context_set_grad_enabled(d->ctx, 1);
    for (k = 0; k < DQN_BATCH; k++) y[k] = d->r[rows[k]] + d->gamma * (1.0f - d->done[rows[k]]) * best[k];
    return r;
}

/* one learning step on a random batch of the buffer (needs DQN_BATCH transitions); *loss */
static dtr_result dqn_learn(dqn *d, dtr_rng *rng, float *loss) {
    float s[DQN_BATCH][CATCH_OBS], s2[DQN_BATCH][CATCH_OBS];
    int64_t rows[DQN_BATCH], xs[2] = {DQN_BATCH, CATCH_OBS}, cs[2] = {DQN_BATCH, 1}, k, have = d->n < DQN_CAP ? d->n : DQN_CAP;
    int32_t a[DQN_BATCH];
    float y[DQN_BATCH];
    dtr_tensor *q, *l;
    dtr_result r;
    for (k = 0; k < DQN_BATCH; k++) {
        rows[k] = (int64_t)(dtr_rng_u32(rng) % (uint32_t)have);
        memcpy(s[k], d->s[rows[k]], sizeof s[k]), memcpy(s2[k], d->s2[rows[k]], sizeof s2[k]);
        a[k] = d->a[rows[k]];
    }
    if ((r = dqn_targets(d, &s2[0][0], rows, y)) != DTR_OK) return r;
    q = dqn_forward(d->ctx, &d->online, dtr_tensor_from(d->ctx, DTR_F32, 2, xs, &s[0][0]));           /* (B, 3) */
    l = dtr_huber_loss(d->ctx, dtr_gather(d->ctx, q, 1, dtr_tensor_from(d->ctx, DTR_I32, 2, cs, a)),   /* Q(s, a): (B, 1) */
                       dtr_tensor_from(d->ctx, DTR_F32, 2, cs, y), 1.0f);
    if ((r = dtr_backward(d->ctx, l)) != DTR_OK) return r;
    *loss = dtr_tensor_get(l, 0);
    if ((r = dtr_optimizer_step(d->opt, NULL)) != DTR_OK) return r;
    if ((r = dtr_model_lerp(d->target.m, d->online.m, d->tau)) != DTR_OK) return r;   /* the target trails */
    return dtr_context_reset(d->ctx);
}

/* `steps` more steps of play and learning; epsilon falls from 1 to 0.05 over the first d->decay
   steps of all (the n transitions stored so far) */
static dtr_result dqn_train(dqn *d, dtr_rng *rng, int64_t steps, float *last_loss) {
    catch_game g;
    float o[CATCH_OBS], o2[CATCH_OBS], reward;
    int64_t t;
    dtr_result r;
    catch_reset(&g, rng);
    catch_observe(&g, o);
    for (t = 0; t < steps; t++) {
        float eps = 1.0f - 0.95f * (float)d->n / (float)(d->decay > 0 ? d->decay : 1);
        int a, done;
        if (eps < 0.05f) eps = 0.05f;
        a = dtr_rng_uniform(rng) < eps ? (int)(dtr_rng_u32(rng) % CATCH_ACTIONS) : dqn_greedy(d, o);
        if (a < 0) return dtr_context_status(d->ctx);
        done = catch_step(&g, a, &reward);
        catch_observe(&g, o2);
        dqn_remember(d, o, a, reward, o2, done);
        if (done) catch_reset(&g, rng), catch_observe(&g, o2);
        memcpy(o, o2, sizeof o);
        if (d->n >= DQN_BATCH && (r = dqn_learn(d, rng, last_loss)) != DTR_OK) return r;
    }
    return DTR_OK;
}

/* the share of `episodes` games the greedy policy catches (-1 on error) */
static double dqn_evaluate(dqn *d, dtr_rng *rng, int episodes) {
    catch_game g;
    float o[CATCH_OBS], reward = 0.0f;
    int e, caught = 0, a;
    for (e = 0; e < episodes; e++) {
        catch_reset(&g, rng);
        do {
            catch_observe(&g, o);
            if ((a = dqn_greedy(d, o)) < 0) return -1.0;
        } while (!catch_step(&g, a, &reward));
        caught += reward > 0.0f;
    }
    return (double)caught / episodes;
}

#endif
