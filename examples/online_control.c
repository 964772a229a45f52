/* examples/online_control.c: a 1 kHz control loop that learns its plant's dynamics online.
 *
 * What it shows: a fixed-rate loop (1000 Hz by default) that drives a pendulum with damping
 * that drifts (friction grows as the "bearing" wears), pushes each step's (angle, velocity,
 * torque) -> angular acceleration into a dtr_trainer, predicts the acceleration of the next
 * step from the last published weights (dtr_trainer_pull into a serving model: never waits on
 * training), and trains cooperatively with dtr_trainer_tick(tr, budget) inside the 1 ms
 * period. The model must learn the sine of the angle and follow the drifting damping.
 *
 * Prints every half second the prediction error relative to the spread of the acceleration
 * (1.0: no better than predicting the mean; it falls as the model learns), the loop's
 * work time p50/p99/max, and the periods whose work ran past the deadline.
 *
 * Build and run from the repository:
 *     make examples && build/examples/online_control [--hz 1000] [--seconds 4] [--budget-us 200]
 * Build by hand, with dtrain.h beside this file:
 *     cc -O2 -I. -DDTRAIN_IMPLEMENTATION online_control.c -o online_control -lm -lpthread
 * Expect the relative error to fall from about 1 to below 0.2 within two seconds and no
 * missed deadline on an idle machine. */
#include "online_common.h"
#include <math.h>
#include <stdio.h>
#include "../dtrain.h"

typedef struct net {
    dtr_context *ctx;
    dtr_model *m;
    dtr_linear_layer l1, l2;
} net;

static dtr_tensor *net_forward(net *n, dtr_context *ctx, dtr_tensor *x) {
    return dtr_linear_layer_forward(ctx, &n->l2, dtr_tanh(ctx, dtr_linear_layer_forward(ctx, &n->l1, x)));
}

static dtr_tensor *net_loss(void *user, dtr_context *ctx, dtr_tensor *x, dtr_tensor *y) {
    return dtr_mse(ctx, net_forward((net *)user, ctx, x), y);
}

static int net_make(net *n) {
    dtr_context_config cc = dtr_context_config_init();
    cc.threads = 1;
    memset(n, 0, sizeof *n);
    if (dtr_context_create(&cc, &n->ctx) != DTR_OK || dtr_model_create(n->ctx, 3, &n->m) != DTR_OK) return 0;
    return dtr_linear_layer_init(&n->l1, n->m, "l1", 3, 32, 1, DTR_INIT_XAVIER_UNIFORM) == DTR_OK &&
           dtr_linear_layer_init(&n->l2, n->m, "l2", 32, 1, 1, DTR_INIT_XAVIER_UNIFORM) == DTR_OK &&
           dtr_model_build(n->m) == DTR_OK;
}

static dtr_trainer *make_trainer(net *n, char *err, size_t errlen) {
    dtr_trainer_config c = dtr_trainer_config_init();
    dtr_trainer *tr = NULL;
    c.model = n->m;
    c.loss = net_loss;
    c.loss_user = n;
    c.optimizer = dtr_optimizer_config_init(DTR_OPT_ADAM, 1e-2f);
    c.feed.layout.x_ndim = 1;
    c.feed.layout.x_shape[0] = 3;
    c.feed.layout.y_dtype = DTR_F32;
    c.feed.layout.y_ndim = 1;
    c.feed.layout.y_shape[0] = 1;
    c.feed.capacity = 2048;
    c.feed.policy = DTR_FEED_DROP_OLDEST;
    c.batch_size = 16;
    c.publish_every = 10;
    if (dtr_trainer_create(&c, &tr, err, errlen) != DTR_OK) return NULL;
    return tr;
}

/* The served model's acceleration for features x (3 floats), in units of 10 rad/s^2. */
static float predict(net *srv, const float *x) {
    int64_t shape[2] = {1, 3};
    dtr_tensor *y = net_forward(srv, srv->ctx, dtr_tensor_from(srv->ctx, DTR_F32, 2, shape, x));
    float v = y ? dtr_tensor_get(y, 0) : 0;
    dtr_context_reset(srv->ctx);
    return v;
}

int main(int argc, char **argv) {
    int hz = 1000, budget = 200, i, steps, window;
    double seconds = 4, th = 0.5, om = 0, u = 0, dt;
    double se = 0, sum = 0, sum2 = 0;
    int64_t version = 0, period, next, *work, missed = 0;
    net n, srv;
    dtr_trainer *tr;
    dtr_rng rng;
    char err[256];
    for (i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--hz")) hz = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--seconds")) seconds = atof(argv[i + 1]);
        else if (!strcmp(argv[i], "--budget-us")) budget = atoi(argv[i + 1]);
        else break;
    }
    if (i < argc || hz < 10 || seconds <= 0 || budget < 0) {
        fprintf(stderr, "usage: online_control [--hz 1000] [--seconds 4] [--budget-us 200]\n");
        return 2;
    }
    if (!net_make(&n) || !net_make(&srv) || !(tr = make_trainer(&n, err, sizeof err))) {
        fprintf(stderr, "online_control: cannot set up: %s\n", err);
        return 1;
    }
    steps = (int)(seconds * hz);
    window = hz / 2;
    dt = 1.0 / hz;
    period = 1000000 / hz;
    work = (int64_t *)malloc(sizeof(int64_t) * (size_t)window);
    if (!work) return 1;
    dtr_rng_seed(&rng, 11, 0);
    printf("online_control: %d Hz, %d us training budget per period, %.1f s\n", hz, budget, seconds);
    next = ol_now_us();
    for (i = 0; i < steps; i++) {
        int64_t t0 = ol_now_us();
        double damping = 0.3 + 1.5 * i / steps;   /* the bearing wears */
        double acc = -9.81 * sin(th) - damping * om + u;
        float x[3] = {(float)th, (float)(om / 4), (float)(u / 5)}, y = (float)(acc / 10), p;
        dtr_trainer_pull(tr, srv.m, &version);
        p = predict(&srv, x);                       /* what the model expects of this step */
        se += (double)(p - y) * (p - y), sum += y, sum2 += (double)y * y;
        dtr_trainer_push(tr, x, &y, 1, 0, NULL);
        om += acc * dt, th += om * dt;              /* the plant moves */
        if (i % (hz / 20) == 0) u = 8 * (dtr_rng_uniform(&rng) - 0.5);   /* excitation */
        u += -2.0 * th * dt;                        /* a weak controller keeps it near the bottom */
        if (budget > 0) dtr_trainer_tick(tr, budget, NULL);
        work[i % window] = ol_now_us() - t0;
        missed += work[i % window] > period;
        if ((i + 1) % window == 0) {
            double var = sum2 / window - (sum / window) * (sum / window);
            printf("  t=%4.1fs  damping %.2f  relative error %.3f  work p50 %3lld us p99 %3lld us max %4lld us  missed %lld  "
                   "(version %lld)\n",
                   (i + 1) * dt, damping, sqrt(se / window / (var > 1e-12 ? var : 1e-12)),
                   (long long)ol_percentile(work, window, 50), (long long)ol_percentile(work, window, 99),
                   (long long)ol_percentile(work, window, 100), (long long)missed, (long long)version);
            se = sum = sum2 = 0;
        }
        next += period;
        ol_sleep_until(next);
    }
    {
        dtr_trainer_stats st;
        dtr_trainer_get_stats(tr, &st);
        printf("trained %lld samples in %lld updates; ticks over budget + slack: %lld of %lld\n",
               (long long)st.samples_trained, (long long)st.updates, (long long)st.tick_overruns, (long long)st.ticks);
    }
    free(work);
    dtr_trainer_destroy(tr);
    dtr_model_destroy(n.m);
    dtr_model_destroy(srv.m);
    dtr_context_destroy(n.ctx);
    dtr_context_destroy(srv.ctx);
    return 0;
}
