/* examples/online_common.h: the plumbing the online examples (online_game.c, online_control.c)
 * and bench/online.c share: a monotonic microsecond clock, sleeping until a deadline (a
 * fixed-rate loop), a busy stand-in for the app's own work, and percentiles of frame times.
 * Everything is `static`; include it once per program, before any system header. */
#ifndef DTRAIN_EXAMPLES_ONLINE_COMMON_H
#define DTRAIN_EXAMPLES_ONLINE_COMMON_H
#ifndef _POSIX_C_SOURCE
#define _POSIX_C_SOURCE 200809L
#endif
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Microseconds on the monotonic clock. */
static inline int64_t ol_now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

/* Microseconds of CPU time of the calling thread. */
static inline int64_t ol_cpu_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

/* Sleeps until ol_now_us() reaches `t` (returns at once when it has). */
static inline void ol_sleep_until(int64_t t) {
    struct timespec ts;
    ts.tv_sec = (time_t)(t / 1000000);
    ts.tv_nsec = (long)(t % 1000000) * 1000L;
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR) {
    }
}

/* The app's own work for about `us` microseconds of computation (physics, AI, rendering
 * set-up): a fixed amount of arithmetic calibrated once, so it takes longer when the CPU is
 * shared, as real work does. Returns a value to keep the compiler from removing it. */
static double ol_iters_per_us;
static inline float ol_work(int64_t us) {
    volatile float acc = 0;
    float a = 1.0001f;
    int64_t i, n;
    if (ol_iters_per_us == 0) {   /* on the thread's CPU time: preemption does not skew it */
        int64_t t0 = ol_cpu_us(), k = 0;
        while (ol_cpu_us() - t0 < 20000)
            for (i = 0; i < 1000; i++, k++) acc = acc * a + 1e-6f;
        ol_iters_per_us = (double)k / (double)(ol_cpu_us() - t0);
    }
    n = (int64_t)(ol_iters_per_us * (double)us);
    for (i = 0; i < n; i++) acc = acc * a + 1e-6f;
    return acc;
}

static int ol_cmp_i64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return x < y ? -1 : x > y;
}

/* The p-th percentile (0..100) of n values (sorted in place); 0 for n 0. */
static inline int64_t ol_percentile(int64_t *v, int n, double p) {
    int k;
    if (n <= 0) return 0;
    qsort(v, (size_t)n, sizeof *v, ol_cmp_i64);
    k = (int)(p / 100.0 * (double)(n - 1) + 0.5);
    return v[k < 0 ? 0 : (k >= n ? n - 1 : k)];
}
#endif
