/* examples/sequence_classify.c: sequences of different lengths: a bidirectional GRU tells noisy
 * waveforms apart.
 *
 * What it shows: a batch of sequences of 8 to 40 steps (zero-padded to 40) through two GRU
 * layers, one of them reversed, each told every row's length (dtr_rnn_config: PyTorch's packed
 * sequences without the packing); each row's last states (after its own last step, in each
 * direction) feed the classifier. The data, model and loop are in examples/sequence_classify.h
 * (the test that checks it learns, tests/test_train.c, uses the same code).
 *
 * Build and run from the repository:
 *     make examples && build/examples/sequence_classify [--steps S] [--seed S] [--threads N]
 * Build by hand, with dtrain.h, common.h and sequence_classify.h beside this file:
 *     cc -O2 -I. -DDTRAIN_IMPLEMENTATION sequence_classify.c -o sequence_classify -lm -lpthread
 * Prints the accuracy over 20 fresh batches (640 waveforms) before training (chance: 0.25) and
 * after each quarter of the steps (default 800). */
#include "common.h"
#include "sequence_classify.h"

int main(int argc, char **argv) {
    dtr_context_config cfg = dtr_context_config_init();
    dtr_context *ctx = NULL;
    sc_model s;
    dtr_rng rng, eval;
    long steps = 800, seed = 1, threads = 1;
    float loss = 0.0f;
    double t0;
    int i, q, rc = 1;
    for (i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--steps")) steps = strtol(argv[i + 1], NULL, 10);
        else if (!strcmp(argv[i], "--seed")) seed = strtol(argv[i + 1], NULL, 10);
        else if (!strcmp(argv[i], "--threads")) threads = strtol(argv[i + 1], NULL, 10);
        else break;
    }
    if (i != argc || steps < 4 || seed < 0 || threads < 1) {
        fprintf(stderr, "usage: %s [--steps S] [--seed S] [--threads N]\n", argv[0]);
        return 2;
    }
    cfg.threads = (int)threads;
    if (dtr_context_create(&cfg, &ctx) != DTR_OK) {
        fprintf(stderr, "context: %s\n", dtr_context_create_error());
        return 1;
    }
    dtr_rng_seed(&rng, (uint64_t)seed, 1);
    if (sc_init(&s, ctx, 3e-3f, (uint64_t)seed) != DTR_OK) goto done;
    dtr_rng_seed(&eval, 99, 2);
    printf("before training: accuracy %.3f (chance 0.25)\n", sc_accuracy(&s, &eval, 20));
    t0 = fm_now();
    for (q = 1; q <= 4; q++) {
        if (sc_train(&s, &rng, (int)(steps / 4), &loss) != DTR_OK) goto done;
        dtr_rng_seed(&eval, 99, 2);
        printf("step %5ld: loss %.4f, accuracy %.3f, %.1f s\n", steps / 4 * q, (double)loss, sc_accuracy(&s, &eval, 20), fm_now() - t0);
    }
    rc = 0;
done:
    if (rc) fprintf(stderr, "error: %s\n", dtr_context_last_error(ctx));
    sc_free(&s);
    dtr_context_destroy(ctx);
    return rc;
}
