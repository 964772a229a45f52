/* dtrun: starts N local ranks of a dtrain program with the rendezvous variables set.
 *
 *     dtrun -n N [--port P] [--secret S] [--grace SECONDS] [--] prog [args...]
 *
 * Every rank gets DTR_RANK, DTR_WORLD_SIZE, DTR_LOCAL_RANK, DTR_LOCAL_WORLD_SIZE,
 * DTR_MASTER_ADDR=127.0.0.1, DTR_MASTER_PORT and DTR_SECRET, and the torchrun names (RANK,
 * WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) for programs that read
 * those. The port is a free one (bound to 0 and read back) unless --port is given; the secret
 * is --secret, else DTR_SECRET from dtrun's environment, else 32 random hex digits (prefer
 * the environment: a command line is visible to every user in `ps`).
 *
 * Each rank's stdout and stderr go through pipes; dtrun writes every line to its own stdout
 * or stderr prefixed with "[rank] ", a whole line per write, so lines never mix (a line over
 * 64 KiB is cut into prefixed pieces). Ranks read stdin from /dev/null.
 *
 * Each rank runs in a process group of its own. SIGINT, SIGTERM and SIGHUP sent to dtrun are
 * forwarded to every rank's group. When a rank exits non-zero or is killed by a signal, dtrun
 * sends SIGTERM to the others and, after the grace period (default 5 s), SIGKILL. Exit
 * status: the first failing rank's code (128 + signal number for a signal); else 128 + the
 * signal dtrun received, if any; else 0. 2: bad usage; 127: the program could not be run.
 *
 * Build: cc -std=c99 -O2 -I. src/tools/dtrun.c -o dtrun   (the Makefile builds build/dtrun)
 */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/wait.h>
#include "../../dtrain.h"   /* DTR_VERSION_STRING only */

#define MAX_RANKS 1024
#define LINE_MAX_BYTES 65536

typedef struct stream {
    int fd;              /* read end of the pipe; -1 once closed */
    int out;             /* 1 or 2: where its lines go */
    char *buf;           /* a partial line (LINE_MAX_BYTES) */
    size_t len;
    int cut;             /* the last piece emitted filled a whole buffer */
} stream;

typedef struct rank_proc {
    pid_t pid;
    int alive;
    stream s[2];
} rank_proc;

static int sig_pipe[2] = {-1, -1};
static rank_proc *ranks;
static int nranks;

static void on_signal(int sig) {
    unsigned char b = (unsigned char)sig;
    int saved = errno;
    if (write(sig_pipe[1], &b, 1) < 0) { /* pipe full: a byte is already waiting */
    }
    errno = saved;
}

static int64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void write_all(int fd, const char *p, size_t n) {
    while (n > 0) {
        ssize_t k = write(fd, p, n);
        if (k > 0) {
            p += k;
            n -= (size_t)k;
        } else if (k < 0 && errno == EINTR) {
            continue;
        } else {
            return;   /* our output is gone (closed pipe): drop it, keep supervising */
        }
    }
}

/* Writes "[rank] " + line + "\n" with one write. */
static void emit(int fd, int rank, const char *line, size_t n) {
    static char *out;
    static size_t cap;
    char prefix[24];
    int pl = snprintf(prefix, sizeof prefix, "[%d] ", rank);
    size_t need = (size_t)pl + n + 1;
    if (need > cap) {
        char *p = (char *)realloc(out, need);
        if (!p) {   /* no memory: write in three pieces rather than not at all */
            write_all(fd, prefix, (size_t)pl);
            write_all(fd, line, n);
            write_all(fd, "\n", 1);
            return;
        }
        out = p;
        cap = need;
    }
    memcpy(out, prefix, (size_t)pl);
    memcpy(out + pl, line, n);
    out[pl + n] = '\n';
    write_all(fd, out, need);
}

/* Reads what the pipe has; emits complete lines (a line that reaches LINE_MAX_BYTES is
 * emitted in pieces). Returns 0 at EOF. */
static int pump(int rank, stream *s) {
    char chunk[16384], *p = chunk;
    ssize_t k = read(s->fd, chunk, sizeof chunk);
    size_t rem;
    if (k < 0 && (errno == EINTR || errno == EAGAIN)) return 1;
    if (k <= 0) {
        if (s->len) emit(s->out, rank, s->buf, s->len);   /* a last line without its newline */
        s->len = 0;
        return 0;
    }
    rem = (size_t)k;
    while (rem > 0) {
        char *nl = (char *)memchr(p, '\n', rem);
        size_t seg = nl ? (size_t)(nl - p) : rem;
        while (seg > 0) {
            size_t take = LINE_MAX_BYTES - s->len < seg ? LINE_MAX_BYTES - s->len : seg;
            memcpy(s->buf + s->len, p, take);
            s->len += take;
            p += take;
            rem -= take;
            seg -= take;
            s->cut = 0;
            if (s->len == LINE_MAX_BYTES) {
                emit(s->out, rank, s->buf, s->len);
                s->len = 0;
                s->cut = 1;
            }
        }
        if (nl) {
            if (s->len || !s->cut) emit(s->out, rank, s->buf, s->len);   /* not the end of a cut line */
            s->len = 0;
            s->cut = 0;
            p++;
            rem--;
        }
    }
    return 1;
}

static void signal_all(int sig) {
    int r;
    for (r = 0; r < nranks; r++)
        if (ranks[r].alive && ranks[r].pid > 0) {
            if (kill(-ranks[r].pid, sig) != 0) kill(ranks[r].pid, sig);
        }
}

static void usage(FILE *f) {
    fprintf(f,
            "usage: dtrun -n N [--port P] [--secret S] [--grace SECONDS] [--] prog [args...]\n"
            "Starts N local ranks of prog with DTR_RANK, DTR_WORLD_SIZE, DTR_LOCAL_RANK,\n"
            "DTR_LOCAL_WORLD_SIZE, DTR_MASTER_ADDR, DTR_MASTER_PORT, DTR_SECRET (and the torchrun\n"
            "names) set, prefixes their output with [rank], forwards SIGINT/SIGTERM/SIGHUP, stops\n"
            "the others when one fails and exits with the failing rank's code.\n"
            "  -n, --nproc N    number of ranks (1..%d)\n"
            "  --port P         rendezvous port (default: a free one)\n"
            "  --secret S       shared secret (default: $DTR_SECRET, else a random one)\n"
            "  --grace SECONDS  time between SIGTERM and SIGKILL when stopping ranks (default 5)\n"
            "  --servers S      parameter servers: exports DTR_PS_SERVERS=S (dtr_ps_create reads it)\n"
            "  --version        print the version\n",
            MAX_RANKS);
}

static int parse_int(const char *s, long lo, long hi, long *out) {
    char *end;
    long v;
    errno = 0;
    v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi) return 0;
    *out = v;
    return 1;
}

static int free_port(void) {
    struct sockaddr_in a;
    socklen_t sl = sizeof a;
    int fd = socket(AF_INET, SOCK_STREAM, 0), port = -1;
    if (fd < 0) return -1;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (bind(fd, (struct sockaddr *)&a, sizeof a) == 0 && getsockname(fd, (struct sockaddr *)&a, &sl) == 0)
        port = ntohs(a.sin_port);
    close(fd);
    return port;
}

static int random_secret(char *out, size_t cap) {
    unsigned char b[16];
    size_t i, got = 0;
    int fd = open("/dev/urandom", O_RDONLY);
    if (fd < 0) return 0;
    while (got < sizeof b) {
        ssize_t k = read(fd, b + got, sizeof b - got);
        if (k <= 0) break;
        got += (size_t)k;
    }
    close(fd);
    if (got < sizeof b || cap < 2 * sizeof b + 1) return 0;
    for (i = 0; i < sizeof b; i++) snprintf(out + 2 * i, 3, "%02x", b[i]);
    return 1;
}

static void set_cloexec(int fd) { (void)fcntl(fd, F_SETFD, FD_CLOEXEC); }

static void setenv_int(const char *name, long v) {
    char b[32];
    snprintf(b, sizeof b, "%ld", v);
    setenv(name, b, 1);
}

/* In the child: environment, stdio, process group, default signals, exec. Never returns. */
static void run_child(int rank, int n, int port, const char *secret, int out_fd, int err_fd, char **argv,
                      const sigset_t *oldmask) {
    static const int sigs[] = {SIGINT, SIGTERM, SIGHUP, SIGCHLD, SIGPIPE};
    size_t i;
    int devnull;
    setpgid(0, 0);
    for (i = 0; i < sizeof sigs / sizeof sigs[0]; i++) signal(sigs[i], SIG_DFL);
    sigprocmask(SIG_SETMASK, oldmask, NULL);
    devnull = open("/dev/null", O_RDONLY);
    if (devnull >= 0) {
        dup2(devnull, 0);
        if (devnull != 0) close(devnull);
    }
    dup2(out_fd, 1);
    dup2(err_fd, 2);
    if (out_fd > 2) close(out_fd);
    if (err_fd > 2) close(err_fd);
    setenv_int("DTR_RANK", rank);
    setenv_int("DTR_WORLD_SIZE", n);
    setenv_int("DTR_LOCAL_RANK", rank);
    setenv_int("DTR_LOCAL_WORLD_SIZE", n);
    setenv("DTR_MASTER_ADDR", "127.0.0.1", 1);
    setenv_int("DTR_MASTER_PORT", port);
    setenv("DTR_SECRET", secret, 1);
    setenv_int("RANK", rank);
    setenv_int("WORLD_SIZE", n);
    setenv_int("LOCAL_RANK", rank);
    setenv_int("LOCAL_WORLD_SIZE", n);
    setenv("MASTER_ADDR", "127.0.0.1", 1);
    setenv_int("MASTER_PORT", port);
    execvp(argv[0], argv);
    fprintf(stderr, "dtrun: cannot run %s: %s\n", argv[0], strerror(errno));
    _exit(127);
}

int main(int argc, char **argv) {
    long n = 0, port = 0, grace_s = 5;
    const char *secret_arg = NULL;
    char secret[256];
    char **prog;
    int i, r, alive = 0, open_streams = 0, fail_rank = -1, fail_code = 0, got_signal = 0;
    int64_t kill_at = -1, drain_until = -1;
    struct sigaction sa;
    sigset_t block, oldmask;
    struct pollfd *pfd;
    int *pfd_rank, *pfd_stream;

    for (i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--") == 0) {
            i++;
            break;
        }
        if (a[0] != '-') break;
        if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
            usage(stdout);
            return 0;
        }
        if (strcmp(a, "--version") == 0) {
            printf("dtrun (dtrain) %s\n", DTR_VERSION_STRING);
            return 0;
        }
        if (i + 1 >= argc) {
            fprintf(stderr, "dtrun: %s needs a value\n", a);
            usage(stderr);
            return 2;
        }
        if (strcmp(a, "-n") == 0 || strcmp(a, "--nproc") == 0) {
            if (!parse_int(argv[++i], 1, MAX_RANKS, &n)) {
                fprintf(stderr, "dtrun: -n %s: expected a number of ranks in 1..%d\n", argv[i], MAX_RANKS);
                return 2;
            }
        } else if (strcmp(a, "--port") == 0) {
            if (!parse_int(argv[++i], 1, 65535, &port)) {
                fprintf(stderr, "dtrun: --port %s: expected 1..65535\n", argv[i]);
                return 2;
            }
        } else if (strcmp(a, "--servers") == 0) {
            long ns;
            if (!parse_int(argv[++i], 1, MAX_RANKS - 1, &ns)) {
                fprintf(stderr, "dtrun: --servers %s: expected 1..%d\n", argv[i], MAX_RANKS - 1);
                return 2;
            }
            setenv("DTR_PS_SERVERS", argv[i], 1);   /* inherited by every rank */
        } else if (strcmp(a, "--secret") == 0) {
            secret_arg = argv[++i];
        } else if (strcmp(a, "--grace") == 0) {
            if (!parse_int(argv[++i], 0, 3600, &grace_s)) {
                fprintf(stderr, "dtrun: --grace %s: expected 0..3600 seconds\n", argv[i]);
                return 2;
            }
        } else {
            fprintf(stderr, "dtrun: unknown option %s\n", a);
            usage(stderr);
            return 2;
        }
    }
    if (n == 0 || i >= argc) {
        fprintf(stderr, "dtrun: %s\n", n == 0 ? "-n N is required" : "no program given");
        usage(stderr);
        return 2;
    }
    prog = argv + i;

    /* secret and port */
    if (!secret_arg) secret_arg = getenv("DTR_SECRET");
    if (secret_arg && secret_arg[0]) {
        if (strlen(secret_arg) >= sizeof secret) {
            fprintf(stderr, "dtrun: the secret is longer than %d bytes\n", (int)sizeof secret - 1);
            return 2;
        }
        snprintf(secret, sizeof secret, "%s", secret_arg);
    } else if (!random_secret(secret, sizeof secret)) {
        fprintf(stderr, "dtrun: cannot read /dev/urandom for a secret; set DTR_SECRET\n");
        return 2;
    }
    if (port == 0) {
        port = free_port();
        if (port < 0) {
            fprintf(stderr, "dtrun: cannot find a free port: %s\n", strerror(errno));
            return 2;
        }
    }

    /* signals: handlers write to a self-pipe; blocked while the ranks are forked */
    if (pipe(sig_pipe) != 0) {
        perror("dtrun: pipe");
        return 2;
    }
    set_cloexec(sig_pipe[0]);
    set_cloexec(sig_pipe[1]);
    (void)fcntl(sig_pipe[1], F_SETFL, O_NONBLOCK);
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGHUP, &sa, NULL);
    sigaction(SIGCHLD, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
    sigemptyset(&block);
    sigaddset(&block, SIGINT);
    sigaddset(&block, SIGTERM);
    sigaddset(&block, SIGHUP);
    sigaddset(&block, SIGCHLD);
    sigprocmask(SIG_BLOCK, &block, &oldmask);

    nranks = (int)n;
    ranks = (rank_proc *)calloc((size_t)n, sizeof *ranks);
    pfd = (struct pollfd *)calloc((size_t)(2 * n + 1), sizeof *pfd);
    pfd_rank = (int *)calloc((size_t)(2 * n + 1), sizeof *pfd_rank);
    pfd_stream = (int *)calloc((size_t)(2 * n + 1), sizeof *pfd_stream);
    if (!ranks || !pfd || !pfd_rank || !pfd_stream) {
        fprintf(stderr, "dtrun: out of memory\n");
        return 2;
    }
    for (r = 0; r < nranks; r++) ranks[r].s[0].fd = ranks[r].s[1].fd = -1;
    fflush(NULL);
    for (r = 0; r < nranks; r++) {
        int po[2], pe[2], k;
        pid_t pid;
        for (k = 0; k < 2; k++) {
            ranks[r].s[k].buf = (char *)malloc(LINE_MAX_BYTES);
            ranks[r].s[k].out = k + 1;
        }
        if (!ranks[r].s[0].buf || !ranks[r].s[1].buf) {
            fprintf(stderr, "dtrun: out of memory\n");
            break;
        }
        if (pipe(po) != 0) {
            fprintf(stderr, "dtrun: pipe: %s\n", strerror(errno));
            break;
        }
        if (pipe(pe) != 0) {
            fprintf(stderr, "dtrun: pipe: %s\n", strerror(errno));
            close(po[0]);
            close(po[1]);
            break;
        }
        set_cloexec(po[0]);
        set_cloexec(pe[0]);
        ranks[r].s[0].fd = po[0];
        ranks[r].s[1].fd = pe[0];
        pid = fork();
        if (pid < 0) {
            fprintf(stderr, "dtrun: fork: %s\n", strerror(errno));
            close(po[0]); close(po[1]); close(pe[0]); close(pe[1]);
            ranks[r].s[0].fd = ranks[r].s[1].fd = -1;
            break;
        }
        if (pid == 0) run_child(r, (int)n, (int)port, secret, po[1], pe[1], prog, &oldmask);
        setpgid(pid, pid);   /* also in the child: no race with an early signal */
        close(po[1]);
        close(pe[1]);
        ranks[r].pid = pid;
        ranks[r].alive = 1;
        alive++;
        open_streams += 2;
    }
    if (r < nranks) {   /* could not start every rank: stop those that run */
        fail_rank = r;
        fail_code = 1;
        signal_all(SIGTERM);
        kill_at = now_ms() + grace_s * 1000;
    }
    sigprocmask(SIG_SETMASK, &oldmask, NULL);

    while (alive > 0 || open_streams > 0) {
        int np = 0, timeout = -1, rc;
        int64_t now = now_ms();
        if (kill_at >= 0) {
            if (now >= kill_at) {
                signal_all(SIGKILL);
                kill_at = -1;
            } else {
                timeout = (int)(kill_at - now);
            }
        }
        if (alive == 0) {   /* all ranks are gone; a grandchild may hold a pipe: wait 1 s at most */
            if (drain_until < 0) drain_until = now + 1000;
            if (now >= drain_until) break;
            if (timeout < 0 || drain_until - now < timeout) timeout = (int)(drain_until - now);
        }
        pfd[np].fd = sig_pipe[0];
        pfd[np].events = POLLIN;
        pfd_rank[np++] = -1;
        for (r = 0; r < nranks; r++) {
            int k;
            for (k = 0; k < 2; k++) {
                if (ranks[r].s[k].fd < 0) continue;
                pfd[np].fd = ranks[r].s[k].fd;
                pfd[np].events = POLLIN;
                pfd_rank[np] = r;
                pfd_stream[np++] = k;
            }
        }
        rc = poll(pfd, (nfds_t)np, timeout);
        if (rc < 0) {
            if (errno == EINTR) continue;
            perror("dtrun: poll");
            break;
        }
        for (i = 1; i < np; i++) {
            stream *s;
            if (!pfd[i].revents) continue;
            s = &ranks[pfd_rank[i]].s[pfd_stream[i]];
            if (!pump(pfd_rank[i], s)) {
                close(s->fd);
                s->fd = -1;
                open_streams--;
            }
        }
        if (pfd[0].revents) {
            unsigned char sigs[64];
            ssize_t k = read(sig_pipe[0], sigs, sizeof sigs), j;
            for (j = 0; j < k; j++) {
                int sig = sigs[j];
                if (sig == SIGCHLD) continue;
                if (!got_signal) got_signal = sig;
                fprintf(stderr, "dtrun: got signal %d; forwarding it to the ranks\n", sig);
                signal_all(sig);
                if (kill_at < 0) kill_at = now_ms() + grace_s * 1000;
            }
            /* reap whatever has exited (SIGCHLD or not: cheap) */
        }
        for (;;) {
            int status, code;
            pid_t pid = waitpid(-1, &status, WNOHANG);
            if (pid <= 0) break;
            for (r = 0; r < nranks; r++)
                if (ranks[r].pid == pid && ranks[r].alive) break;
            if (r == nranks) continue;
            ranks[r].alive = 0;
            alive--;
            code = WIFEXITED(status) ? WEXITSTATUS(status) : WIFSIGNALED(status) ? 128 + WTERMSIG(status) : 1;
            if (code != 0 && fail_rank < 0 && !got_signal) {
                fail_rank = r;
                fail_code = code;
                if (WIFSIGNALED(status))
                    fprintf(stderr, "dtrun: rank %d was killed by signal %d", r, WTERMSIG(status));
                else
                    fprintf(stderr, "dtrun: rank %d exited with code %d", r, code);
                fprintf(stderr, "%s\n", alive > 0 ? "; stopping the other ranks" : "");
                if (alive > 0) {
                    signal_all(SIGTERM);
                    kill_at = now_ms() + grace_s * 1000;
                }
            }
        }
    }
    for (r = 0; r < nranks; r++) {
        int k;
        for (k = 0; k < 2; k++) {
            if (ranks[r].s[k].fd >= 0) {
                if (ranks[r].s[k].len) emit(ranks[r].s[k].out, r, ranks[r].s[k].buf, ranks[r].s[k].len);
                close(ranks[r].s[k].fd);
            }
            free(ranks[r].s[k].buf);
        }
    }
    free(ranks);
    free(pfd);
    free(pfd_rank);
    free(pfd_stream);
    if (fail_rank >= 0) return fail_code;
    if (got_signal) return 128 + got_signal;
    return 0;
}
