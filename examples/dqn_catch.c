/* examples/dqn_catch.c: reinforcement learning in C: a deep Q-network learns to catch a falling
 * ball.
 *
 * What it shows: the pieces a DQN (or a DDPG / SAC critic) needs, on the context's backend: the
 * value of the action taken (dtr_gather), the best next value on a target network (dtr_max, no
 * gradient), the Huber loss, the target network's soft update (dtr_model_lerp), the greedy action
 * (dtr_argmax). The game, the replay buffer and the learner are in examples/dqn_catch.h (the
 * test that checks it learns, tests/test_train.c, uses the same code).
 *
 * Build and run from the repository:
 *     make examples && build/examples/dqn_catch [--steps S] [--seed S]
 * Build by hand, with dtrain.h and dqn_catch.h beside this file:
 *     cc -O2 -I. -DDTRAIN_IMPLEMENTATION dqn_catch.c -o dqn_catch -lm -lpthread
 * Prints the greedy policy's catch rate over 200 games before training (a random network's:
 * about 0.2) and after each quarter of the steps (default 4000, epsilon falling over the first
 * half: every game caught at the end, well under a second on one core). */
#define _POSIX_C_SOURCE 200809L
#include "dtrain.h"
#include <stdio.h>
#include <stdlib.h>
#include "dqn_catch.h"

int main(int argc, char **argv) {
    dtr_context_config cfg = dtr_context_config_init();
    dtr_context *ctx = NULL;
    dqn *d = (dqn *)calloc(1, sizeof(dqn));
    dtr_rng rng, eval;
    long steps = 4000, seed = 1;
    float loss = 0.0f;
    int i, q, rc = 1;
    for (i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--steps")) steps = strtol(argv[i + 1], NULL, 10);
        else if (!strcmp(argv[i], "--seed")) seed = strtol(argv[i + 1], NULL, 10);
        else break;
    }
    if (i != argc || steps < 4 || seed < 0) {
        fprintf(stderr, "usage: %s [--steps S] [--seed S]\n", argv[0]);
        free(d);
        return 2;
    }
    cfg.threads = 1;   /* a 25-64-3 network: one thread is fastest */
    if (!d || dtr_context_create(&cfg, &ctx) != DTR_OK || dqn_init(d, ctx, 2e-3f, (uint64_t)seed) != DTR_OK) {
        fprintf(stderr, "error: %s\n", ctx ? dtr_context_last_error(ctx) : "out of memory");
        goto done;
    }
    d->decay = steps / 2;
    dtr_rng_seed(&rng, (uint64_t)seed, 1);
    dtr_rng_seed(&eval, 1000 + (uint64_t)seed, 2);
    printf("dqn_catch: before training, the greedy policy catches %.2f of 200 games\n", dqn_evaluate(d, &eval, 200));
    for (q = 1; q <= 4; q++) {   /* a quarter of the steps, then a score */
        if (dqn_train(d, &rng, steps / 4, &loss) != DTR_OK) { fprintf(stderr, "error: %s\n", dtr_context_last_error(ctx)); goto done; }
        printf("after %ld steps: loss %.4f, catches %.2f of 200 games\n", steps / 4 * q, (double)loss, dqn_evaluate(d, &eval, 200));
    }
    rc = 0;
done:
    if (d) dqn_free(d);
    dtr_context_destroy(ctx);
    free(d);
    return rc;
}
