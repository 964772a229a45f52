/* bench/federated.c: federated learning throughput and accuracy of dtrain on Fashion-MNIST.
 *
 *   build/bench/federated [--clients N] [--per-round K] [--rounds R] [--epochs E]
 *                         [--per-client P] [--skew S] [--codec f32|bf16] [--data DIR]
 *
 * Workload: examples/federated_fmnist.c's (examples/fed_fmnist.h): N client processes with
 * label-skewed shards (default 8 x 800 images, 80% from two classes), MLP 784-64-10, E local
 * epochs of SGD (lr 0.02, momentum 0.9, batch 32), FedAvg, the server in this process, TCP
 * on 127.0.0.1. Output: one JSON line per round and a summary line,
 *   {"bench":"federated","impl":"dtrain","round":3,"clients":8,"per_round":8,"acc":0.79,
 *    "round_s":0.85,"bytes_sent":1629248,"bytes_received":1629248}
 *   {"bench":"federated_summary","impl":"dtrain","clients":8,"per_round":8,"rounds":20,
 *    "rounds_per_s":1.2,"bytes_per_round":3258496,"final_acc":0.83,"best_acc":0.83}
 * round_s is the server's wall time of the round (sampling, sending, local training on the
 * clients, receiving, aggregating); the accuracy is on the 10000 test images, measured
 * between rounds and not counted in round_s. */
#include "../examples/common.h"
#include "../examples/fed_fmnist.h"

typedef struct totals { const fed_options *o; double s, best, last; uint64_t bytes; int rounds; } totals;

static void each(void *user, const dtr_fed_round_stats *st, double acc) {
    totals *t = (totals *)user;
    t->s += st->seconds;
    t->bytes += st->bytes_sent + st->bytes_received;
    t->rounds++;
    t->last = acc;
    if (acc > t->best) t->best = acc;
    printf("{\"bench\":\"federated\",\"impl\":\"dtrain\",\"round\":%lld,\"clients\":%d,\"per_round\":%d,\"acc\":%.4f,"
           "\"round_s\":%.4f,\"bytes_sent\":%llu,\"bytes_received\":%llu}\n", (long long)st->round + 1, t->o->clients,
           t->o->per_round, acc, st->seconds, (unsigned long long)st->bytes_sent, (unsigned long long)st->bytes_received);
    fflush(stdout);
}

int main(int argc, char **argv) {
    fed_options o = fed_options_default();
    totals t;
    const char *dir = NULL;
    dtr_mnist data;
    dtr_result r;
    int i;
    for (i = 1; i + 1 < argc; i += 2) {
        const char *k = argv[i], *v = argv[i + 1];
        if (!strcmp(k, "--clients")) o.clients = atoi(v);
        else if (!strcmp(k, "--per-round")) o.per_round = atoi(v);
        else if (!strcmp(k, "--rounds")) o.rounds = atoi(v);
        else if (!strcmp(k, "--epochs")) o.epochs = atoi(v);
        else if (!strcmp(k, "--per-client")) o.per_client = atoi(v);
        else if (!strcmp(k, "--skew")) o.skew = atof(v);
        else if (!strcmp(k, "--codec")) o.codec = !strcmp(v, "bf16") ? DTR_FED_BF16 : DTR_FED_F32;
        else if (!strcmp(k, "--data")) dir = v;
        else break;
    }
    if (i < argc || o.clients < 1 || o.clients > 256 || o.per_round < 1 || o.rounds < 1 || o.epochs < 1 || o.per_client < 1) {
        fprintf(stderr, "usage: %s [--clients N] [--per-round K] [--rounds R] [--epochs E] [--per-client P] "
                        "[--skew S] [--codec f32|bf16] [--data DIR]\n", argv[0]);
        return 2;
    }
    if (o.per_round > o.clients) o.per_round = o.clients;
    if (fm_data_load(fm_data_dir(dir), &data) != DTR_OK) return 1;
    memset(&t, 0, sizeof t);
    t.o = &o;
    r = fed_run(&o, &data, each, &t);
    if (t.rounds > 0)
        printf("{\"bench\":\"federated_summary\",\"impl\":\"dtrain\",\"clients\":%d,\"per_round\":%d,\"rounds\":%d,"
               "\"epochs\":%d,\"codec\":\"%s\",\"rounds_per_s\":%.3f,\"bytes_per_round\":%.0f,\"final_acc\":%.4f,"
               "\"best_acc\":%.4f}\n", o.clients, o.per_round, t.rounds, o.epochs, o.codec == DTR_FED_BF16 ? "bf16" : "f32",
               t.rounds / t.s, (double)t.bytes / t.rounds, t.last, t.best);
    dtr_mnist_destroy(&data);
    return r == DTR_OK ? 0 : 1;
}
