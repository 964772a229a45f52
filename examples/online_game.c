/* examples/online_game.c: non-player characters that learn a model of the players while the
 * game runs, without dropping a frame.
 *
 * What it shows: a game loop at a fixed frame rate (60 fps by default) that does its own work
 * each frame (a calibrated stand-in for physics and rendering), pushes telemetry of 64
 * players every frame into a dtr_trainer (dtr_trainer_push: checked samples, drop-oldest back
 * pressure), lets the NPCs predict each player's next move from the last published weights
 * (dtr_trainer_pull into a serving model on the game thread's own context: never waits on
 * training), and trains in three phases:
 *   none        no training (the frame times of the game alone; predictions at chance)
 *   coop        cooperative: dtr_trainer_tick(tr, 2000 us) at the end of each frame
 *   background  dtr_trainer_start: a thread at lower priority capped to half a core
 * The players walk toward a goal that moves around the map (the distribution drifts), so
 * the accuracy rises as the model learns and keeps following the goal. Publication is
 * guarded: every 10th sample is held out and new weights are served only when they are no
 * worse on it.
 *
 * Prints, per phase, the frame time (the frame's work, inference and training, not the
 * sleep) at p50/p99/max, the samples trained per second, and the prediction accuracy every
 * half second of game time.
 *
 * Build and run from the repository:
 *     make examples && build/examples/online_game [--fps 60] [--seconds 4] [--work-us 3000]
 * Build by hand, with dtrain.h beside this file:
 *     cc -O2 -I. -DDTRAIN_IMPLEMENTATION online_game.c -o online_game -lm -lpthread
 * Expect accuracy near 0.25 (four moves, chance) in the first phase, above 0.8 in the next
 * two, and a p99 frame time within about a millisecond of the first phase's. */
#include "online_common.h"
#include <math.h>
#include <stdio.h>
#include "../dtrain.h"

#define PLAYERS 64
#define FEATURES 4   /* player x, y, velocity x, y */
#define MOVES 4      /* right, left, up, down */

typedef struct net {
    dtr_context *ctx;
    dtr_model *m;
    dtr_linear_layer l1, l2, l3;
} net;

static dtr_tensor *net_forward(net *n, dtr_context *ctx, dtr_tensor *x) {
    dtr_tensor *h = dtr_relu(ctx, dtr_linear_layer_forward(ctx, &n->l1, x));
    h = dtr_relu(ctx, dtr_linear_layer_forward(ctx, &n->l2, h));
    return dtr_linear_layer_forward(ctx, &n->l3, h);
}

static dtr_tensor *net_loss(void *user, dtr_context *ctx, dtr_tensor *x, dtr_tensor *y) {
    return dtr_cross_entropy(ctx, net_forward((net *)user, ctx, x), y);
}

static int net_make(net *n, int threads) {
    dtr_context_config cc = dtr_context_config_init();
    cc.threads = threads;
    memset(n, 0, sizeof *n);
    if (dtr_context_create(&cc, &n->ctx) != DTR_OK || dtr_model_create(n->ctx, 42, &n->m) != DTR_OK) return 0;
    return dtr_linear_layer_init(&n->l1, n->m, "l1", FEATURES, 64, 1, DTR_INIT_KAIMING_UNIFORM) == DTR_OK &&
           dtr_linear_layer_init(&n->l2, n->m, "l2", 64, 64, 1, DTR_INIT_KAIMING_UNIFORM) == DTR_OK &&
           dtr_linear_layer_init(&n->l3, n->m, "l3", 64, MOVES, 1, DTR_INIT_TORCH_DEFAULT) == DTR_OK &&
           dtr_model_build(n->m) == DTR_OK;
}

/* ---- the game: players walking toward a moving goal ---- */

typedef struct world {
    float px[PLAYERS], py[PLAYERS], vx[PLAYERS], vy[PLAYERS];
    dtr_rng rng;
} world;

/* The move a player makes: toward the goal along the longer axis, or at random (10%). */
static int player_move(world *w, int i, float gx, float gy) {
    float dx = gx - w->px[i], dy = gy - w->py[i];
    if (dtr_rng_uniform(&w->rng) < 0.1f) return (int)(dtr_rng_u32(&w->rng) % MOVES);
    if (fabsf(dx) > fabsf(dy)) return dx > 0 ? 0 : 1;
    return dy > 0 ? 2 : 3;
}

static void player_step(world *w, int i, int move) {
    static const float mx[MOVES] = {1, -1, 0, 0}, my[MOVES] = {0, 0, 1, -1};
    w->vx[i] = mx[move];
    w->vy[i] = my[move];
    w->px[i] += 0.02f * mx[move];
    w->py[i] += 0.02f * my[move];
    if (fabsf(w->px[i]) > 1 || fabsf(w->py[i]) > 1 || dtr_rng_uniform(&w->rng) < 0.01f) {   /* respawn */
        w->px[i] = 2 * dtr_rng_uniform(&w->rng) - 1;
        w->py[i] = 2 * dtr_rng_uniform(&w->rng) - 1;
    }
}

static void features(const world *w, float *x) {
    int i;
    for (i = 0; i < PLAYERS; i++) {
        x[FEATURES * i] = w->px[i];
        x[FEATURES * i + 1] = w->py[i];
        x[FEATURES * i + 2] = w->vx[i];
        x[FEATURES * i + 3] = w->vy[i];
    }
}

/* The NPCs' predictions for every player from the served weights: how many are right. */
static int npc_predict(net *srv, const float *x, const int32_t *moves) {
    int64_t shape[2] = {PLAYERS, FEATURES};
    float out[PLAYERS * MOVES];
    dtr_tensor *logits = net_forward(srv, srv->ctx, dtr_tensor_from(srv->ctx, DTR_F32, 2, shape, x));
    int i, k, ok = 0;
    if (!logits || dtr_tensor_read(logits, DTR_F32, out, PLAYERS * MOVES) != DTR_OK) return -1;
    for (i = 0; i < PLAYERS; i++) {
        int best = 0;
        for (k = 1; k < MOVES; k++)
            if (out[MOVES * i + k] > out[MOVES * i + best]) best = k;
        ok += best == moves[i];
    }
    dtr_context_reset(srv->ctx);
    return ok;
}

typedef struct opts {
    int fps, work_us;
    double seconds;
} opts;

static dtr_trainer *make_trainer(net *n, char *err, size_t errlen) {
    dtr_trainer_config c = dtr_trainer_config_init();
    dtr_trainer *tr = NULL;
    c.model = n->m;
    c.loss = net_loss;
    c.loss_user = n;
    c.optimizer = dtr_optimizer_config_init(DTR_OPT_ADAM, 1e-2f);
    c.feed.layout.x_ndim = 1;
    c.feed.layout.x_shape[0] = FEATURES;
    c.feed.layout.y_dtype = DTR_I32;
    c.feed.layout.num_classes = MOVES;
    c.feed.capacity = 4096;
    c.feed.policy = DTR_FEED_DROP_OLDEST;
    c.batch_size = 64;
    c.publish_every = 5;
    c.guard.enabled = 1;
    c.background.nice = 5;
    c.background.cpu_share = 0.5f;
    if (dtr_trainer_create(&c, &tr, err, errlen) != DTR_OK) return NULL;
    return tr;
}

/* One phase of the game; mode 0 none, 1 cooperative, 2 background. */
static int run_phase(const opts *o, int mode, world *w, double *clock_s, dtr_trainer *tr, net *srv, int64_t *version) {
    static const char *names[3] = {"none", "coop", "background"};
    int frames = (int)(o->seconds * o->fps), f, ok = 0, seen = 0, half = o->fps / 2;
    int64_t *ft = (int64_t *)malloc(sizeof(int64_t) * (size_t)frames), period = 1000000 / o->fps, next;
    int64_t trained0;
    float x[PLAYERS * FEATURES];
    int32_t moves[PLAYERS];
    dtr_trainer_stats st;
    if (!ft) return 0;
    dtr_trainer_get_stats(tr, &st);
    trained0 = st.samples_trained;
    if (mode == 2 && dtr_trainer_start(tr) != DTR_OK) return 0;
    next = ol_now_us();
    for (f = 0; f < frames; f++) {
        int64_t t0 = ol_now_us();
        int i, r;
        float gx = 0.7f * cosf((float)(*clock_s * 0.15)), gy = 0.7f * sinf((float)(*clock_s * 0.15));
        ol_work(o->work_us);                           /* the game's own work */
        features(w, x);
        for (i = 0; i < PLAYERS; i++) moves[i] = player_move(w, i, gx, gy);
        dtr_trainer_pull(tr, srv->m, version);        /* the newest published weights, if any */
        if ((r = npc_predict(srv, x, moves)) >= 0) ok += r, seen += PLAYERS;
        dtr_trainer_push(tr, x, moves, PLAYERS, 0, NULL);   /* telemetry */
        for (i = 0; i < PLAYERS; i++) player_step(w, i, moves[i]);
        if (mode == 1) dtr_trainer_tick(tr, 2000, NULL);
        ft[f] = ol_now_us() - t0;
        *clock_s += 1.0 / o->fps;
        if ((f + 1) % half == 0) {
            printf("  t=%5.1fs  %-10s accuracy %.2f  (version %lld)\n", *clock_s, names[mode], (double)ok / seen,
                   (long long)*version);
            ok = seen = 0;
        }
        next += period;
        ol_sleep_until(next);
    }
    if (mode == 2) dtr_trainer_stop(tr);
    dtr_trainer_get_stats(tr, &st);
    printf("%-10s frame time p50 %.2f ms  p99 %.2f ms  max %.2f ms  trained %.0f samples/s  published %lld, guard "
           "refused %lld  (%s)\n", names[mode], ol_percentile(ft, frames, 50) / 1e3, ol_percentile(ft, frames, 99) / 1e3,
           ol_percentile(ft, frames, 100) / 1e3, (double)(st.samples_trained - trained0) / o->seconds,
           (long long)st.published, (long long)st.guard_refused, st.behind ? st.report : "keeping up");
    free(ft);
    return 1;
}

int main(int argc, char **argv) {
    opts o = {60, 3000, 4.0};
    net n, srv;
    world w;
    dtr_trainer *tr;
    char err[256];
    double clock_s = 0;
    int64_t version = 0;
    int i, mode;
    for (i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--fps")) o.fps = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--seconds")) o.seconds = atof(argv[i + 1]);
        else if (!strcmp(argv[i], "--work-us")) o.work_us = atoi(argv[i + 1]);
        else break;
    }
    if (i < argc || o.fps < 2 || o.seconds <= 0 || o.work_us < 0) {
        fprintf(stderr, "usage: online_game [--fps 60] [--seconds 4] [--work-us 3000]\n");
        return 2;
    }
    if (!net_make(&n, 1) || !net_make(&srv, 1)) {
        fprintf(stderr, "online_game: cannot make the networks\n");
        return 1;
    }
    if (!(tr = make_trainer(&n, err, sizeof err))) {
        fprintf(stderr, "online_game: %s\n", err);
        return 1;
    }
    memset(&w, 0, sizeof w);
    dtr_rng_seed(&w.rng, 7, 0);
    for (i = 0; i < PLAYERS; i++) player_step(&w, i, 0);
    printf("online_game: %d players at %d fps, %d us of game work per frame, %.1f s per phase\n", PLAYERS, o.fps,
           o.work_us, o.seconds);
    for (mode = 0; mode < 3; mode++)
        if (!run_phase(&o, mode, &w, &clock_s, tr, &srv, &version)) {
            fprintf(stderr, "online_game: %s\n", dtr_trainer_last_error(tr));
            return 1;
        }
    dtr_trainer_destroy(tr);
    dtr_model_destroy(n.m);
    dtr_model_destroy(srv.m);
    dtr_context_destroy(n.ctx);
    dtr_context_destroy(srv.ctx);
    return 0;
}
