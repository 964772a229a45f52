/* tests/dtrun_util.h: running build/dtrun from a test (tests/test_dtrun.c, tests/test_elastic.c):
 * finding it and this program's own absolute path (the ranks run it in helper modes), and
 * running dtrun with a deadline, its stdout and stderr captured. Include after test.h and
 * posix_util.h. */
#include <limits.h>
#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>

static char self[PATH_MAX], dtrun[PATH_MAX];

/* self = argv0 made absolute; dtrun = $DTRUN, else <build>/dtrun beside <build>/tests/. */
static int find_dtrun(const char *argv0, const char *name) {
    const char *d;
    if (argv0[0] == '/') {
        snprintf(self, sizeof self, "%s", argv0);
    } else {   /* an absolute path: ranks run it from any folder */
        char cwd[PATH_MAX];
        if (!getcwd(cwd, sizeof cwd) || strlen(cwd) + strlen(argv0) + 2 > sizeof self) {
            fprintf(stderr, "%s: cannot resolve %s\n", name, argv0);
            return 0;
        }
        memcpy(self, cwd, strlen(cwd));
        self[strlen(cwd)] = '/';
        memcpy(self + strlen(cwd) + 1, argv0, strlen(argv0) + 1);
    }
    if ((d = getenv("DTRUN")) != NULL) {
        snprintf(dtrun, sizeof dtrun, "%s", d);
    } else {   /* <build>/tests/test_x -> <build>/dtrun */
        char *slash;
        snprintf(dtrun, sizeof dtrun, "%s", self);
        slash = strrchr(dtrun, '/');
        if (slash) *slash = '\0';
        slash = strrchr(dtrun, '/');
        if (slash) *slash = '\0';
        strncat(dtrun, "/dtrun", sizeof dtrun - strlen(dtrun) - 1);
    }
    if (access(dtrun, X_OK) != 0) {
        fprintf(stderr, "%s: %s not found (make builds it; or set DTRUN)\n", name, dtrun);
        return 0;
    }
    return 1;
}

typedef struct run_result {
    int code;          /* exit code, 128 + signal, or -1 on timeout */
    char *out, *err;   /* what dtrun wrote (malloc'd, NUL-terminated) */
    int64_t ms;
} run_result;

static char *slurp(int fd) {
    size_t cap = 1 << 16, len = 0;
    char *b = (char *)malloc(cap);
    ssize_t k;
    lseek(fd, 0, SEEK_SET);
    while ((k = read(fd, b + len, cap - len - 1)) > 0) {
        len += (size_t)k;
        if (cap - len < 4096) {
            cap *= 2;
            b = (char *)realloc(b, cap);
        }
    }
    b[len] = '\0';
    return b;
}

static int temp_file(void) {
    char name[] = "/tmp/dtrun_testXXXXXX";
    int fd = mkstemp(name);
    if (fd < 0) {
        perror("mkstemp");
        exit(2);
    }
    unlink(name);
    return fd;
}

/* Waits for pid at most until `end`; SIGKILL after it (code -1). */
static int wait_code(pid_t pid, int64_t end) {
    int status;
    for (;;) {
        pid_t r = waitpid(pid, &status, WNOHANG);
        if (r == pid) return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        if (now_ms() > end) {
            kill(pid, SIGKILL);
            waitpid(pid, &status, 0);
            return -1;
        }
        sleep_ms(5);
    }
}

/* Runs dtrun with args (NULL-terminated), stdout/stderr to temp files, within timeout_ms. */
static run_result run_dtrun(const char *const *args, int timeout_ms) {
    run_result rr;
    const char *argv[32];
    int out = temp_file(), err = temp_file(), n = 0;
    int64_t t0 = now_ms();
    pid_t pid;
    argv[n++] = dtrun;
    while (*args && n < 31) argv[n++] = *args++;
    argv[n] = NULL;
    fflush(NULL);
    pid = fork();
    if (pid == 0) {
        dup2(out, 1);
        dup2(err, 2);
        execv(dtrun, (char *const *)argv);
        _exit(126);
    }
    rr.code = wait_code(pid, t0 + timeout_ms);
    rr.ms = now_ms() - t0;
    rr.out = slurp(out);
    rr.err = slurp(err);
    close(out);
    close(err);
    if (rr.code != 0 && getenv("DTR_TEST_VERBOSE"))
        fprintf(stderr, "  dtrun exit %d\n--- out\n%s--- err\n%s---\n", rr.code, rr.out, rr.err);
    return rr;
}

static void run_free(run_result *r) {
    free(r->out);
    free(r->err);
}

/* Number of lines of `text` that start with `prefix` and contain `needle` (NULL: any). */
static int count_lines(const char *text, const char *prefix, const char *needle) {
    int n = 0;
    const char *p = text;
    while (*p) {
        const char *e = strchr(p, '\n');
        size_t len = e ? (size_t)(e - p) : strlen(p);
        char *line = (char *)malloc(len + 1);
        memcpy(line, p, len);
        line[len] = '\0';
        if (strncmp(line, prefix, strlen(prefix)) == 0 && (!needle || strstr(line, needle))) n++;
        free(line);
        p += len + (e ? 1 : 0);
    }
    return n;
}
