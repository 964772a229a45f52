/* bench/conv.c: a 3x3 convolution's forward and backward (padding 1) on the CPU, as JSON lines
 * ("impl":"dtrain"; bench/conv_torch.py prints the same lines for F.conv2d): x (B, C, H, H),
 * dense (groups 1) and depthwise (groups C) weights, loss sum(y), backward to x and w. The best
 * of --repeat runs after one warm-up. Prints ms_per_step per kind and peak_rss_mb, the process's
 * peak resident size so far (the dense kind runs first: its line's is the dense layer's peak;
 * Linux and macOS, else -1).
 * Usage: conv [--batch B] [--channels C] [--size H] [--threads N] [--repeat R]
 * Build: make bench. */
#define _POSIX_C_SOURCE 200809L
#include "../dtrain.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#if defined(__unix__) || defined(__APPLE__)
#include <sys/resource.h>
#endif

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* the best time of `repeat` forward + backward passes of one convolution of `groups` groups */
static double conv_best(dtr_context *ctx, int64_t B, int64_t C, int64_t H, int groups, int repeat) {
    int64_t xs[4] = {B, C, H, H}, ws[4] = {C, C / groups, 3, 3};
    dtr_conv_config cc = dtr_conv_config_init();
    double best = 1e30;
    int r;
    cc.padding[0] = cc.padding[1] = 1;
    cc.groups = groups;
    for (r = -1; r < repeat; r++) {   /* r = -1: the warm-up */
        dtr_tensor *x = dtr_tensor_requires_grad(dtr_tensor_full(ctx, 4, xs, 0.5f));
        dtr_tensor *w = dtr_tensor_requires_grad(dtr_tensor_full(ctx, 4, ws, 0.1f));
        double t0 = now_s();
        if (dtr_backward(ctx, dtr_sum_all(ctx, dtr_conv2d_ex(ctx, x, w, NULL, &cc))) != DTR_OK) return -1.0;
        if (r >= 0 && now_s() - t0 < best) best = now_s() - t0;
        dtr_context_reset(ctx);
    }
    return best;
}

/* the process's peak resident size in MiB (-1 where unknown) */
static double peak_rss_mb(void) {
#if defined(__unix__) || defined(__APPLE__)
    struct rusage ru;
    if (getrusage(RUSAGE_SELF, &ru) == 0)
#if defined(__APPLE__)
        return (double)ru.ru_maxrss / (1024.0 * 1024.0);   /* bytes */
#else
        return (double)ru.ru_maxrss / 1024.0;               /* KiB */
#endif
#endif
    return -1.0;
}

int main(int argc, char **argv) {
    int64_t B = 32, C = 64, H = 56;
    int threads = 0, repeat = 5, i, k;
    dtr_context_config cfg = dtr_context_config_init();
    dtr_context *ctx = NULL;
    for (i = 1; i + 1 < argc; i += 2) {
        long v = strtol(argv[i + 1], NULL, 10);
        if (!strcmp(argv[i], "--batch")) B = v;
        else if (!strcmp(argv[i], "--channels")) C = v;
        else if (!strcmp(argv[i], "--size")) H = v;
        else if (!strcmp(argv[i], "--threads")) threads = (int)v;
        else if (!strcmp(argv[i], "--repeat")) repeat = (int)v;
        else break;
    }
    if (i != argc || B < 1 || C < 1 || H < 3 || threads < 0 || repeat < 1) {
        fprintf(stderr, "usage: %s [--batch B] [--channels C] [--size H] [--threads N] [--repeat R]\n", argv[0]);
        return 2;
    }
    cfg.threads = threads;
    if (dtr_context_create(&cfg, &ctx) != DTR_OK) return 1;
    for (k = 0; k < 2; k++) {
        double t = conv_best(ctx, B, C, H, k ? (int)C : 1, repeat);
        if (t < 0) { fprintf(stderr, "conv: %s\n", dtr_context_last_error(ctx)); return 1; }
        printf("{\"bench\":\"conv\",\"impl\":\"dtrain\",\"kind\":\"%s\",\"batch\":%lld,\"channels\":%lld,\"size\":%lld,"
               "\"threads\":%d,\"ms_per_step\":%.3f,\"peak_rss_mb\":%.1f}\n", k ? "depthwise" : "dense", (long long)B,
               (long long)C, (long long)H, dtr_context_threads(ctx), 1e3 * t, peak_rss_mb());
    }
    dtr_context_destroy(ctx);
    return 0;
}
