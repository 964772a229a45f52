/* tests/posix_util.h: time, sleep and a free TCP port for the tests that run threads or
 * processes against deadlines. Include after test.h, in a file that defines
 * _POSIX_C_SOURCE 200809L before any header. */
#include <dirent.h>
#include <errno.h>
#include <time.h>
#include <unistd.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

/* Seconds and milliseconds on the monotonic clock (one clock for every process of the machine). */
static inline double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}
static inline int64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Sleeps ms milliseconds, resuming after signals. */
static inline void sleep_ms(int ms) {
    struct timespec ts;
    ts.tv_sec = ms / 1000;
    ts.tv_nsec = (long)(ms % 1000) * 1000000L;
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

/* A loopback TCP port that is free right now (bound to 0 and read back); exits on failure. */
static inline int free_port(void) {
    struct sockaddr_in a;
    socklen_t sl = sizeof a;
    int fd = socket(AF_INET, SOCK_STREAM, 0), port;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof a) != 0 || getsockname(fd, (struct sockaddr *)&a, &sl) != 0) {
        fprintf(stderr, "free_port: %s\n", strerror(errno));
        exit(2);
    }
    port = ntohs(a.sin_port);
    close(fd);
    return port;
}

/* dtr_request_wait_any over group c (ranks 0, 1 and 2 take part; others return at once):
   rank 0 waits on receives from ranks 1 and 2; rank 2 sends after 30 ms and must be the one
   that wakes it; a second wait of 60 ms on rank 1's receive times out (index -1, DTR_OK, the
   group fine) having slept, not spun (under 30 ms of the thread's CPU); then rank 1, told to, sends and wakes the third. Argument errors too.
   Returns 0, or 1 with `why`. */
static inline int wait_any_case(dtr_comm *c, char *why, size_t wl) {
    int me = dtr_comm_rank(c), a = 0, b = 0, go = 1, v = me * 11, idx = 9, n;
    dtr_request *q[2] = {NULL, NULL}, *none[2] = {NULL, NULL};
    dtr_result r1, r2, r3, e[4];
    double t0, t1, t2, cpu;
    struct timespec c0, c1;
    if (me == 1) return dtr_comm_recv(c, &go, sizeof go, 0, 41) != DTR_OK || dtr_comm_send(c, &v, sizeof v, 0, 40) != DTR_OK;
    if (me == 2) { sleep_ms(30); return dtr_comm_send(c, &v, sizeof v, 0, 40) != DTR_OK; }
    if (me != 0) return 0;
    if (dtr_comm_recv_async(c, &a, sizeof a, 1, 40, &q[0]) != DTR_OK || dtr_comm_recv_async(c, &b, sizeof b, 2, 40, &q[1]) != DTR_OK) {
        snprintf(why, wl, "posting the receives failed");
        return 1;
    }
    t0 = now_s();
    r1 = dtr_request_wait_any(q, 2, 5000, &idx);
    t1 = now_s() - t0;
    n = idx;
    dtr_request_destroy(q[1]);
    q[1] = NULL;
    t0 = now_s();
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &c0);
    r2 = dtr_request_wait_any(q, 2, 60, &idx);
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &c1);
    t2 = now_s() - t0;
    cpu = (double)(c1.tv_sec - c0.tv_sec) + 1e-9 * (double)(c1.tv_nsec - c0.tv_nsec);
    if (r1 != DTR_OK || n != 1 || b != 22 || t1 > 2.5 || r2 != DTR_OK || idx != -1 || t2 < 0.055 || cpu > 0.03 ||
        dtr_comm_status(c) != DTR_OK) {
        snprintf(why, wl, "first wait %s, index %d, value %d after %.3f s; second %s, index %d after %.3f s (%.3f s CPU)",
                 dtr_result_string(r1), n, b, t1, dtr_result_string(r2), idx, t2, cpu);
        dtr_comm_send(c, &go, sizeof go, 1, 41);   /* rank 1 still finishes */
        dtr_request_wait(q[0]);
        dtr_request_destroy(q[0]);
        return 1;
    }
    dtr_comm_send(c, &go, sizeof go, 1, 41);
    r3 = dtr_request_wait_any(q, 2, 5000, &idx);
    n = idx;
    e[0] = dtr_request_wait_any(q, 0, 10, &idx);
    e[1] = dtr_request_wait_any(q, 2, -1, &idx);
    e[2] = dtr_request_wait_any(q, 2, 10, NULL);
    e[3] = dtr_request_wait_any(none, 2, 1000, &idx);   /* nothing to wait for: at once */
    dtr_request_destroy(q[0]);
    if (r3 != DTR_OK || n != 0 || a != 11 || e[0] != DTR_INVALID_ARGUMENT || e[1] != DTR_INVALID_ARGUMENT ||
        e[2] != DTR_NULL_HANDLE || e[3] != DTR_OK || idx != -1) {
        snprintf(why, wl, "third wait %s, index %d, value %d; errors %d %d %d %d (index %d)", dtr_result_string(r3), n, a,
                 (int)e[0], (int)e[1], (int)e[2], (int)e[3], idx);
        return 1;
    }
    return 0;
}

/* Removes a file, or a folder and everything in it. */
static inline void rm_tree(const char *path) {
    DIR *d = opendir(path);
    struct dirent *de;
    char p[4400];
    if (!d) {
        remove(path);
        return;
    }
    while ((de = readdir(d)) != NULL) {
        if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) continue;
        if (snprintf(p, sizeof p, "%s/%s", path, de->d_name) >= (int)sizeof p) continue;
        if (remove(p) != 0) rm_tree(p);
    }
    closedir(d);
    rmdir(path);
}
