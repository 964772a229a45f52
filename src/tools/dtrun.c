/* dtrun: starts N local ranks of a dtrain program with the rendezvous variables set, and
 * restarts the job after a failure when asked to (elastic restarts).
 *
 *     dtrun -n N [--port P] [--secret S] [--grace SECONDS] [--timeout MS]
 *           [--max-restarts R] [--min-ranks M] [--] prog [args...]
 *
 * Every rank gets DTR_RANK, DTR_WORLD_SIZE, DTR_LOCAL_RANK, DTR_LOCAL_WORLD_SIZE,
 * DTR_MASTER_ADDR=127.0.0.1, DTR_MASTER_PORT and DTR_SECRET, and the torchrun names (RANK,
 * WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) for programs that read
 * those; also DTR_RESTART (the attempt: 0, then 1, 2, ... after restarts; the store's
 * generation), DTR_JOB_ID (the job's identity: $DTR_JOB_ID, else a random one; the store
 * refuses ranks of other jobs), DTR_NOTIFY_FD (see "first step" below) and, with --timeout,
 * DTR_TIMEOUT_MS. The port is a free one (bound to 0 and read back) unless --port is given;
 * it stays the same across restarts. The secret is --secret, else DTR_SECRET from dtrun's
 * environment, else 32 random hex digits (prefer the environment: a command line is visible
 * to every user in `ps`).
 *
 * Each rank's stdout and stderr go through pipes; dtrun writes every line to its own stdout
 * or stderr prefixed with "[rank] ", a whole line per write, so lines never mix (a line over
 * 64 KiB is cut into prefixed pieces). A line that ends in "\r" (a progress line redrawn in
 * place) is forwarded ending in "\r", and when dtrun's stdout is a terminal the ranks get
 * DTR_TTY=1, so they may draw such lines. Ranks read stdin from /dev/null.
 *
 * Each rank runs in a process group of its own. SIGINT, SIGTERM and SIGHUP sent to dtrun are
 * forwarded to every rank's group. When a rank exits non-zero or is killed by a signal, dtrun
 * sends SIGTERM (and SIGCONT, for a stopped rank) to the others and, after the grace period
 * (default 5 s), SIGKILL. A hung rank is seen through the others: they fail at their deadline
 * (DTR_TIMEOUT_MS); a rank that is stopped (SIGSTOP) when the job fails is the one blamed.
 *
 * Restarts (--max-restarts R, default 0): after a failure, once every rank is gone, dtrun
 * starts the whole job again with DTR_RESTART one higher (the program restores its latest
 * checkpoint), at most R times. A rank "cannot come back" when the same rank number is the
 * one blamed in two attempts in a row: then the job restarts with one rank fewer, as long as
 * that leaves at least --min-ranks (default N: never fewer; --max-ranks is another name for
 * -n); else it is restarted as it is (R bounds the attempts). First step: a rank that calls dtr_elastic_step() writes one line to
 * the pipe DTR_NOTIFY_FD names; on the first of a restarted attempt dtrun prints to its
 * stderr "dtrun: restart k: first step ... ms after the failure".
 *
 * Exit status: 0 when the last attempt succeeded; else the failing rank's code of the last
 * attempt (128 + signal number for a signal); else 128 + the signal dtrun received, if any.
 * 2: bad usage; 127: the program could not be run.
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
#include "../../dtrain.h"   /* DTR_VERSION_STRING, dtr_trace_merge */

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
    int stopped;         /* stopped by a signal (SIGSTOP, SIGTSTP) */
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

/* Writes "[rank] " + line + end ("\n", or "\r" for a line redrawn in place) with one write. */
static void emit_end(int fd, int rank, const char *line, size_t n, char end) {
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
            write_all(fd, &end, 1);
            return;
        }
        out = p;
        cap = need;
    }
    memcpy(out, prefix, (size_t)pl);
    memcpy(out + pl, line, n);
    out[pl + n] = end;
    write_all(fd, out, need);
}
static void emit(int fd, int rank, const char *line, size_t n) { emit_end(fd, rank, line, n, '\n'); }

/* the first "\n" or "\r" of p[0, n), or NULL */
static char *line_end(char *p, size_t n) {
    char *nl = (char *)memchr(p, '\n', n), *cr = (char *)memchr(p, '\r', nl ? (size_t)(nl - p) : n);
    return cr ? cr : nl;
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
        char *nl = line_end(p, rem);
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
            if (*nl == '\r' && s->len) emit_end(s->out, rank, s->buf, s->len, '\r');
            else if (*nl == '\n' && (s->len || !s->cut)) emit(s->out, rank, s->buf, s->len);   /* not the end of a cut line */
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
            if (sig == SIGTERM) kill(-ranks[r].pid, SIGCONT);   /* a stopped rank must see it */
        }
}

static void usage(FILE *f) {
    fprintf(f,
            "usage: dtrun -n N [--port P] [--secret S] [--grace SECONDS] [--timeout MS]\n"
            "             [--max-restarts R] [--min-ranks M] [--] prog [args...]\n"
            "Starts N local ranks of prog with DTR_RANK, DTR_WORLD_SIZE, DTR_LOCAL_RANK,\n"
            "DTR_LOCAL_WORLD_SIZE, DTR_MASTER_ADDR, DTR_MASTER_PORT, DTR_SECRET (and the torchrun\n"
            "names), DTR_RESTART, DTR_JOB_ID and DTR_NOTIFY_FD set, prefixes their output with [rank],\n"
            "forwards SIGINT/SIGTERM/SIGHUP, stops the others when one fails and exits with the\n"
            "failing rank's code, or restarts the job (which resumes from its latest checkpoint).\n"
            "  -n, --nproc N      number of ranks (1..%d); --max-ranks is another name\n"
            "  --port P           rendezvous port (default: a free one; the same for every restart)\n"
            "  --secret S         shared secret (default: $DTR_SECRET, else a random one)\n"
            "  --grace SECONDS    time between SIGTERM and SIGKILL when stopping ranks (default 5)\n"
            "  --timeout MS       sets DTR_TIMEOUT_MS: the deadline of every blocking call of the ranks\n"
            "  --max-restarts R   restart the job after a failure at most R times (default 0); each\n"
            "                     attempt gets DTR_RESTART=<attempt> and the store's generation\n"
            "  --min-ranks M      a rank blamed in two attempts in a row cannot come back: go on with\n"
            "                     one rank fewer while at least M remain (default N: never fewer)\n"
            "  --servers S        parameter servers: exports DTR_PS_SERVERS=S (dtr_ps_create reads it)\n"
            "  --version          print the version\n"
            "After a restart dtrun prints the time from the failure to the first step of the new\n"
            "attempt (the first dtr_elastic_step() call of a rank).\n"
            "or:    dtrun --merge-traces OUT IN...   merge the ranks' timelines (dtr_metrics) into OUT\n",
            MAX_RANKS);
}

/* dtrun --merge-traces OUT IN...: one Perfetto file with a process row per rank */
static int merge_traces(int argc, char **argv) {
    char err[512];
    if (argc < 2) {
        fprintf(stderr, "dtrun: --merge-traces needs OUT and at least one input file\n");
        return 2;
    }
    if (dtr_trace_merge((const char *const *)(argv + 1), argc - 1, argv[0], err, sizeof err) != DTR_OK) {
        fprintf(stderr, "dtrun: %s\n", err);
        return 1;
    }
    return 0;
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

/* What the whole job shares, across attempts. */
typedef struct job {
    long n, min_ranks, max_restarts, grace_s, timeout_ms, port;
    char secret[256], job_id[64];
    char **prog;
    int notify[2];          /* the ranks write "step <attempt> <rank> <step>" lines to [1] */
    char note[256];         /* a partial line read from notify[0] */
    size_t note_len;
} job;

/* What one attempt came to. */
typedef struct outcome {
    int fail_rank, fail_code, got_signal;
    int64_t fail_at;        /* when dtrun saw the failure (ms) */
} outcome;

/* In the child: environment, stdio, process group, default signals, exec. Never returns. */
static void run_child(const job *j, int rank, int n, int attempt, int out_fd, int err_fd, const sigset_t *oldmask) {
    static const int sigs[] = {SIGINT, SIGTERM, SIGHUP, SIGCHLD, SIGPIPE};
    size_t i;
    int devnull;
    setpgid(0, 0);
    for (i = 0; i < sizeof sigs / sizeof sigs[0]; i++) signal(sigs[i], SIG_DFL);
    sigprocmask(SIG_SETMASK, oldmask, NULL);
    if (isatty(1)) setenv("DTR_TTY", "1", 1);   /* dtrun's own stdout, before the pipe replaces it */
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
    setenv_int("DTR_MASTER_PORT", j->port);
    setenv("DTR_SECRET", j->secret, 1);
    setenv_int("DTR_RESTART", attempt);
    setenv("DTR_JOB_ID", j->job_id, 1);
    setenv_int("DTR_NOTIFY_FD", j->notify[1]);
    if (j->timeout_ms > 0) setenv_int("DTR_TIMEOUT_MS", j->timeout_ms);
    setenv_int("RANK", rank);
    setenv_int("WORLD_SIZE", n);
    setenv_int("LOCAL_RANK", rank);
    setenv_int("LOCAL_WORLD_SIZE", n);
    setenv("MASTER_ADDR", "127.0.0.1", 1);
    setenv_int("MASTER_PORT", j->port);
    execvp(j->prog[0], j->prog);
    fprintf(stderr, "dtrun: cannot run %s: %s\n", j->prog[0], strerror(errno));
    _exit(127);
}

/* Forks rank r of an attempt with its two pipes. 0 on failure (message printed). */
static int start_rank(const job *j, int r, int attempt, const sigset_t *oldmask) {
    int po[2], pe[2], k;
    pid_t pid;
    for (k = 0; k < 2; k++) {
        ranks[r].s[k].buf = (char *)malloc(LINE_MAX_BYTES);
        ranks[r].s[k].out = k + 1;
        ranks[r].s[k].len = 0;
        ranks[r].s[k].cut = 0;
    }
    if (!ranks[r].s[0].buf || !ranks[r].s[1].buf) {
        fprintf(stderr, "dtrun: out of memory\n");
        return 0;
    }
    if (pipe(po) != 0) {
        fprintf(stderr, "dtrun: pipe: %s\n", strerror(errno));
        return 0;
    }
    if (pipe(pe) != 0) {
        fprintf(stderr, "dtrun: pipe: %s\n", strerror(errno));
        close(po[0]);
        close(po[1]);
        return 0;
    }
    set_cloexec(po[0]);
    set_cloexec(pe[0]);
    pid = fork();
    if (pid < 0) {
        fprintf(stderr, "dtrun: fork: %s\n", strerror(errno));
        close(po[0]); close(po[1]); close(pe[0]); close(pe[1]);
        return 0;
    }
    if (pid == 0) run_child(j, r, nranks, attempt, po[1], pe[1], oldmask);
    setpgid(pid, pid);   /* also in the child: no race with an early signal */
    close(po[1]);
    close(pe[1]);
    ranks[r].s[0].fd = po[0];
    ranks[r].s[1].fd = pe[0];
    ranks[r].pid = pid;
    ranks[r].alive = 1;
    return 1;
}

/* Reads the ranks' "step <attempt> <rank> <step>" lines; prints the restart time on the first
 * step of a restarted attempt. */
static void read_notes(job *j, int attempt, int64_t failed_at, int *reported) {
    ssize_t k = read(j->notify[0], j->note + j->note_len, sizeof j->note - 1 - j->note_len);
    char *line, *nl;
    if (k <= 0) return;
    j->note_len += (size_t)k;
    j->note[j->note_len] = '\0';
    line = j->note;
    while ((nl = strchr(line, '\n')) != NULL) {
        long a = -1, r = -1;
        long long step = -1;
        *nl = '\0';
        if (sscanf(line, "step %ld %ld %lld", &a, &r, &step) == 3 && a == attempt && !*reported && failed_at >= 0) {
            *reported = 1;
            fprintf(stderr, "dtrun: restart %d: first step (%lld, rank %ld) %lld ms after the failure\n", attempt, step,
                    r, (long long)(now_ms() - failed_at));
        }
        line = nl + 1;
    }
    j->note_len = strlen(line);
    memmove(j->note, line, j->note_len);
    if (j->note_len == sizeof j->note - 1) j->note_len = 0;   /* not our format: drop it */
}

/* Handles the signals dtrun received (forwarded to the ranks). */
static void read_signals(const job *j, outcome *o, int64_t *kill_at) {
    unsigned char sigs[64];
    ssize_t k = read(sig_pipe[0], sigs, sizeof sigs), i;
    for (i = 0; i < k; i++) {
        int sig = sigs[i];
        if (sig == SIGCHLD) continue;
        if (!o->got_signal) o->got_signal = sig;
        fprintf(stderr, "dtrun: got signal %d; forwarding it to the ranks\n", sig);
        signal_all(sig);
        if (*kill_at < 0) *kill_at = now_ms() + j->grace_s * 1000;
    }
}

/* The rank blamed for a failure first seen at rank r: a stopped rank if there is one. */
static int blame(int r) {
    int i;
    for (i = 0; i < nranks; i++)
        if (ranks[i].alive && ranks[i].stopped) return i;
    return r;
}

/* Reaps what has exited; the first failure stops the others. Returns the ranks still alive. */
static int reap(const job *j, outcome *o, int alive, int64_t *kill_at) {
    for (;;) {
        int status, code, r;
        pid_t pid = waitpid(-1, &status, WNOHANG | WUNTRACED | WCONTINUED);
        if (pid <= 0) break;
        for (r = 0; r < nranks; r++)
            if (ranks[r].pid == pid && ranks[r].alive) break;
        if (r == nranks) continue;
        if (WIFSTOPPED(status) || WIFCONTINUED(status)) {
            ranks[r].stopped = WIFSTOPPED(status);
            continue;
        }
        ranks[r].alive = 0;
        alive--;
        code = WIFEXITED(status) ? WEXITSTATUS(status) : WIFSIGNALED(status) ? 128 + WTERMSIG(status) : 1;
        if (code == 0 || o->fail_rank >= 0 || o->got_signal) continue;
        o->fail_rank = blame(r);
        o->fail_code = code;
        o->fail_at = now_ms();
        if (WIFSIGNALED(status))
            fprintf(stderr, "dtrun: rank %d was killed by signal %d", r, WTERMSIG(status));
        else
            fprintf(stderr, "dtrun: rank %d exited with code %d", r, code);
        if (o->fail_rank != r) fprintf(stderr, "; rank %d is stopped: blaming it", o->fail_rank);
        fprintf(stderr, "%s\n", alive > 0 ? "; stopping the other ranks" : "");
        if (alive > 0) {
            signal_all(SIGTERM);
            *kill_at = now_ms() + j->grace_s * 1000;
        }
    }
    return alive;
}

/* Closes the finished streams of every rank. */
static void free_streams(void) {
    int r, k;
    for (r = 0; r < nranks; r++)
        for (k = 0; k < 2; k++) {
            if (ranks[r].s[k].fd >= 0) {
                if (ranks[r].s[k].len) emit(ranks[r].s[k].out, r, ranks[r].s[k].buf, ranks[r].s[k].len);
                close(ranks[r].s[k].fd);
            }
            free(ranks[r].s[k].buf);
            ranks[r].s[k].buf = NULL;
            ranks[r].s[k].fd = -1;
        }
}

/* Forks the `nranks` ranks of an attempt with the signals blocked. The number started. */
static int start_all(const job *j, int attempt) {
    sigset_t block, oldmask;
    int r;
    sigemptyset(&block);
    sigaddset(&block, SIGINT);
    sigaddset(&block, SIGTERM);
    sigaddset(&block, SIGHUP);
    sigaddset(&block, SIGCHLD);
    sigprocmask(SIG_BLOCK, &block, &oldmask);   /* no signal while the ranks are forked */
    fflush(NULL);
    for (r = 0; r < nranks; r++)
        if (!start_rank(j, r, attempt, &oldmask)) break;
    sigprocmask(SIG_SETMASK, &oldmask, NULL);
    return r;
}

/* The poll set: the signal pipe, the notify pipe, every open stream. Its size. */
static int poll_set(const job *j, struct pollfd *pfd, int *pfd_rank, int *pfd_stream) {
    int np = 0, r, k;
    pfd[np].fd = sig_pipe[0];
    pfd[np++].events = POLLIN;
    pfd[np].fd = j->notify[0];
    pfd[np++].events = POLLIN;
    for (r = 0; r < nranks; r++)
        for (k = 0; k < 2; k++) {
            if (ranks[r].s[k].fd < 0) continue;
            pfd[np].fd = ranks[r].s[k].fd;
            pfd[np].events = POLLIN;
            pfd_rank[np] = r;
            pfd_stream[np++] = k;
        }
    return np;
}

/* Copies the ranks' output, reaps them and handles signals and step notes until every rank
 * is gone and its pipes are closed (or 1 s after the last exit: a grandchild may hold one). */
static void supervise(job *j, outcome *o, int alive, int attempt, int64_t failed_at, int64_t kill_at) {
    int n2 = 2 * nranks + 2, open_streams = 2 * alive, reported = 0, i;
    int64_t drain_until = -1;
    struct pollfd *pfd = (struct pollfd *)calloc((size_t)n2, sizeof *pfd);
    int *pfd_rank = (int *)calloc((size_t)n2, sizeof(int)), *pfd_stream = (int *)calloc((size_t)n2, sizeof(int));
    while (pfd && pfd_rank && pfd_stream && (alive > 0 || open_streams > 0)) {
        int np, timeout = -1;
        int64_t now = now_ms();
        if (kill_at >= 0 && now >= kill_at) {
            signal_all(SIGKILL);
            kill_at = -1;
        }
        if (kill_at >= 0) timeout = (int)(kill_at - now);
        if (alive == 0) {
            if (drain_until < 0) drain_until = now + 1000;
            if (now >= drain_until) break;
            if (timeout < 0 || drain_until - now < timeout) timeout = (int)(drain_until - now);
        }
        np = poll_set(j, pfd, pfd_rank, pfd_stream);
        if (poll(pfd, (nfds_t)np, timeout) < 0) {
            if (errno == EINTR) continue;
            perror("dtrun: poll");
            break;
        }
        for (i = 2; i < np; i++) {
            stream *s = &ranks[pfd_rank[i]].s[pfd_stream[i]];
            if (pfd[i].revents && !pump(pfd_rank[i], s)) {
                close(s->fd);
                s->fd = -1;
                open_streams--;
            }
        }
        if (pfd[1].revents) read_notes(j, attempt, failed_at, &reported);
        if (pfd[0].revents) read_signals(j, o, &kill_at);
        alive = reap(j, o, alive, &kill_at);   /* SIGCHLD or not: cheap */
    }
    if (!pfd || !pfd_rank || !pfd_stream) fprintf(stderr, "dtrun: out of memory\n");
    free(pfd);
    free(pfd_rank);
    free(pfd_stream);
}

/* Runs one attempt of `world` ranks to its end. */
static outcome run_attempt(job *j, int world, int attempt, int64_t failed_at) {
    outcome o = {-1, 0, 0, -1};
    int r, started;
    int64_t kill_at = -1;
    nranks = world;
    memset(ranks, 0, sizeof *ranks * (size_t)world);
    for (r = 0; r < nranks; r++) ranks[r].s[0].fd = ranks[r].s[1].fd = -1;
    started = start_all(j, attempt);
    if (started < nranks) {   /* could not start every rank: stop those that run */
        o.fail_rank = started;
        o.fail_code = 1;
        o.fail_at = now_ms();
        signal_all(SIGTERM);
        kill_at = now_ms() + j->grace_s * 1000;
    }
    supervise(j, &o, started, attempt, failed_at, kill_at);
    free_streams();
    return o;
}

/* Secret, port, job id, the notify pipe and the signal handlers. Returns -1, or 2 on failure. */
static int setup_job(job *j, const char *secret_arg) {
    struct sigaction sa;
    const char *id = getenv("DTR_JOB_ID");
    if (!secret_arg) secret_arg = getenv("DTR_SECRET");
    if (secret_arg && secret_arg[0]) {
        if (strlen(secret_arg) >= sizeof j->secret) {
            fprintf(stderr, "dtrun: the secret is longer than %d bytes\n", (int)sizeof j->secret - 1);
            return 2;
        }
        snprintf(j->secret, sizeof j->secret, "%s", secret_arg);
    } else if (!random_secret(j->secret, sizeof j->secret)) {
        fprintf(stderr, "dtrun: cannot read /dev/urandom for a secret; set DTR_SECRET\n");
        return 2;
    }
    if (id && id[0]) snprintf(j->job_id, sizeof j->job_id, "%.63s", id);
    else if (!random_secret(j->job_id, sizeof j->job_id)) snprintf(j->job_id, sizeof j->job_id, "dtrun-%ld", (long)getpid());
    if (j->port == 0 && (j->port = free_port()) < 0) {
        fprintf(stderr, "dtrun: cannot find a free port: %s\n", strerror(errno));
        return 2;
    }
    if (pipe(sig_pipe) != 0 || pipe(j->notify) != 0) {
        perror("dtrun: pipe");
        return 2;
    }
    set_cloexec(sig_pipe[0]);
    set_cloexec(sig_pipe[1]);
    set_cloexec(j->notify[0]);   /* the ranks inherit the write end only */
    (void)fcntl(sig_pipe[1], F_SETFL, O_NONBLOCK);
    (void)fcntl(j->notify[0], F_SETFL, O_NONBLOCK);
    (void)fcntl(j->notify[1], F_SETFL, O_NONBLOCK);   /* a rank never blocks on it */
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGHUP, &sa, NULL);
    sigaction(SIGCHLD, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
    return -1;
}

/* After a failed attempt: the world of the next one. `*last_blamed` is the rank blamed in
 * the attempt before (-1: none). */
static int next_world(const job *j, const outcome *o, int world, int *last_blamed) {
    if (o->fail_rank != *last_blamed) {
        *last_blamed = o->fail_rank;
        return world;
    }
    if (world - 1 < j->min_ranks) {   /* cannot shrink: the same world again (R bounds it) */
        if (j->min_ranks < j->n)
            fprintf(stderr, "dtrun: rank %d failed in two attempts in a row; %d ranks would be fewer than "
                    "--min-ranks %ld: restarting it\n", o->fail_rank, world - 1, j->min_ranks);
        return world;
    }
    *last_blamed = -1;   /* the numbering changes with the world */
    fprintf(stderr, "dtrun: rank %d failed in two attempts in a row and cannot come back: going on with %d ranks\n",
            o->fail_rank, world - 1);
    return world - 1;
}

/* Parses the command line into j. Returns -1 to go on, else the exit code. */
static int parse_args(int argc, char **argv, job *j) {
    int i;
    const char *secret_arg = NULL;
    for (i = 1; i < argc; i++) {
        const char *a = argv[i];
        long *dst = NULL, lo = 0, hi = 0;
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
        if (strcmp(a, "-n") == 0 || strcmp(a, "--nproc") == 0 || strcmp(a, "--max-ranks") == 0)
            dst = &j->n, lo = 1, hi = MAX_RANKS;
        else if (strcmp(a, "--port") == 0) dst = &j->port, lo = 1, hi = 65535;
        else if (strcmp(a, "--grace") == 0) dst = &j->grace_s, lo = 0, hi = 3600;
        else if (strcmp(a, "--timeout") == 0) dst = &j->timeout_ms, lo = 1, hi = 2147483647L;
        else if (strcmp(a, "--max-restarts") == 0) dst = &j->max_restarts, lo = 0, hi = 1000000;
        else if (strcmp(a, "--min-ranks") == 0) dst = &j->min_ranks, lo = 1, hi = MAX_RANKS;
        else if (strcmp(a, "--servers") == 0) {
            long ns;
            if (!parse_int(argv[++i], 1, MAX_RANKS - 1, &ns)) {
                fprintf(stderr, "dtrun: --servers %s: expected 1..%d\n", argv[i], MAX_RANKS - 1);
                return 2;
            }
            setenv("DTR_PS_SERVERS", argv[i], 1);   /* inherited by every rank */
            continue;
        } else if (strcmp(a, "--secret") == 0) {
            secret_arg = argv[++i];
            continue;
        } else {
            fprintf(stderr, "dtrun: unknown option %s\n", a);
            usage(stderr);
            return 2;
        }
        if (!parse_int(argv[++i], lo, hi, dst)) {
            fprintf(stderr, "dtrun: %s %s: expected a number in %ld..%ld\n", a, argv[i], lo, hi);
            return 2;
        }
    }
    if (j->n == 0 || i >= argc) {
        fprintf(stderr, "dtrun: %s\n", j->n == 0 ? "-n N is required" : "no program given");
        usage(stderr);
        return 2;
    }
    if (j->min_ranks > j->n) {
        fprintf(stderr, "dtrun: --min-ranks %ld is more than -n %ld\n", j->min_ranks, j->n);
        return 2;
    }
    if (j->min_ranks == 0) j->min_ranks = j->n;
    j->prog = argv + i;
    return setup_job(j, secret_arg);
}

int main(int argc, char **argv) {
    job j;
    outcome o;
    int rc, attempt, world, last_blamed = -1;
    int64_t failed_at = -1;
    memset(&j, 0, sizeof j);
    j.grace_s = 5;
    j.notify[0] = j.notify[1] = -1;
    if (argc > 1 && strcmp(argv[1], "--merge-traces") == 0) return merge_traces(argc - 2, argv + 2);
    if ((rc = parse_args(argc, argv, &j)) >= 0) return rc;
    ranks = (rank_proc *)calloc((size_t)j.n, sizeof *ranks);
    if (!ranks) {
        fprintf(stderr, "dtrun: out of memory\n");
        return 2;
    }
    world = (int)j.n;
    for (attempt = 0;; attempt++) {
        o = run_attempt(&j, world, attempt, failed_at);
        if (o.fail_rank < 0 || o.got_signal) break;
        if (attempt >= j.max_restarts) {
            if (j.max_restarts > 0) fprintf(stderr, "dtrun: no restarts left (--max-restarts %ld)\n", j.max_restarts);
            break;
        }
        world = next_world(&j, &o, world, &last_blamed);
        failed_at = o.fail_at;
        fprintf(stderr, "dtrun: restarting the job (restart %d of %ld) with %d ranks, %lld ms after the failure\n",
                attempt + 1, j.max_restarts, world, (long long)(now_ms() - failed_at));
    }
    free(ranks);
    if (o.fail_rank >= 0) return o.fail_code;
    if (o.got_signal) return 128 + o.got_signal;
    return 0;
}
