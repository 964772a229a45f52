/* examples/federated_fmnist.c: federated learning on Fashion-MNIST, all on this machine.
 *
 * One server (this process) and 8 clients (forked processes, each holding its own
 * label-skewed shard: 80% of its images from two classes) talk over TCP on 127.0.0.1. Each
 * round the server samples K clients, sends them the global MLP (784-64-10), they train E
 * local epochs and send back their update; the server averages them weighted by sample
 * count (FedAvg) and prints the test accuracy of the new global model. The clients never
 * send data, only weights. examples/fed_fmnist.h holds the shards, the local training and
 * the process plumbing; the federated API is src/public/api_fed.h (docs/federated.md).
 *
 *     make examples && build/examples/federated_fmnist [options]
 * Options: [--data DIR] [--clients N] [--per-round K] [--rounds R] [--epochs E] [--mu MU]
 * [--skew S] [--per-client P] [--codec f32|bf16] [--aggregator mean|median|trimmed]
 * [--server-opt avg|momentum|adam]. Data: --data, $DTR_FMNIST_DIR or Debian's folder. */
#include "common.h"
#include "fed_fmnist.h"

static void print_round(void *user, const dtr_fed_round_stats *st, double acc) {
    (void)user;
    printf("round %2lld  test accuracy %.2f%%  (%d/%d updates, %llu samples, %.2f s, %.2f MB sent)\n",
           (long long)st->round + 1, 100.0 * acc, st->accepted, st->sampled, (unsigned long long)st->samples,
           st->seconds, (double)st->bytes_sent / 1e6);
    fflush(stdout);
}

/* Parses the options into o; returns 0, or 2 for a bad option. */
static int parse(int argc, char **argv, fed_options *o, const char **dir) {
    int i;
    for (i = 1; i + 1 < argc; i += 2) {
        const char *k = argv[i], *v = argv[i + 1];
        if (!strcmp(k, "--data")) *dir = v;
        else if (!strcmp(k, "--clients")) o->clients = atoi(v);
        else if (!strcmp(k, "--per-round")) o->per_round = atoi(v);
        else if (!strcmp(k, "--rounds")) o->rounds = atoi(v);
        else if (!strcmp(k, "--epochs")) o->epochs = atoi(v);
        else if (!strcmp(k, "--per-client")) o->per_client = atoi(v);
        else if (!strcmp(k, "--mu")) o->mu = (float)atof(v);
        else if (!strcmp(k, "--skew")) o->skew = atof(v);
        else if (!strcmp(k, "--codec")) o->codec = !strcmp(v, "bf16") ? DTR_FED_BF16 : DTR_FED_F32;
        else if (!strcmp(k, "--aggregator"))
            o->aggregator = !strcmp(v, "median") ? DTR_FED_MEDIAN : !strcmp(v, "trimmed") ? DTR_FED_TRIMMED_MEAN : DTR_FED_MEAN;
        else if (!strcmp(k, "--server-opt"))
            o->server_opt = !strcmp(v, "momentum") ? DTR_FED_OPT_MOMENTUM : !strcmp(v, "adam") ? DTR_FED_OPT_ADAM : DTR_FED_OPT_AVG;
        else return 2;
    }
    if (i < argc || o->clients < 1 || o->clients > 256 || o->per_round < 1 || o->rounds < 1 || o->epochs < 1 ||
        o->per_client < 1 || o->skew < 0 || o->skew > 1)
        return 2;
    if (o->per_round > o->clients) o->per_round = o->clients;
    return 0;
}

int main(int argc, char **argv) {
    fed_options o = fed_options_default();
    const char *dir = NULL;
    dtr_mnist data;
    dtr_result r;
    if (parse(argc, argv, &o, &dir)) {
        fprintf(stderr, "usage: %s [--data DIR] [--clients N] [--per-round K] [--rounds R] [--epochs E] [--mu MU] "
                        "[--skew S] [--per-client P] [--codec f32|bf16] [--aggregator mean|median|trimmed] "
                        "[--server-opt avg|momentum|adam]\n", argv[0]);
        return 2;
    }
    if (fm_data_load(fm_data_dir(dir), &data) != DTR_OK) return 1;
    printf("federated_fmnist: %d clients (%d images each, %.0f%% from two classes), %d per round, %d rounds of "
           "%d local epochs, MLP 784-%d-10%s\n", o.clients, o.per_client, 100.0 * o.skew, o.per_round, o.rounds,
           o.epochs, o.hidden, o.mu > 0 ? ", FedProx" : "");
    r = fed_run(&o, &data, print_round, NULL);
    dtr_mnist_destroy(&data);
    return r == DTR_OK ? 0 : 1;
}
