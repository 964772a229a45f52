/* tests/posix_util.h: time, sleep and a free TCP port for the tests that run threads or
 * processes against deadlines. Include after test.h, in a file that defines
 * _POSIX_C_SOURCE 200809L before any header. */
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
