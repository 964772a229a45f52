/* tests/test_dtrun.c: the launcher, build/dtrun (src/tools/dtrun.c), run on this very program in
 * helper modes (`test_dtrun child-<mode>`): the variables each rank gets, "[rank] " prefixes on
 * stdout and stderr with no mixing within a line (long lines and lines written in pieces
 * included), one rank exiting 3 stopping the others and dtrun exiting 3, a rank killed by a
 * signal (exit 128 + signal), SIGTERM to dtrun forwarded to every rank (and SIGKILL after the
 * grace period for a rank that ignores it), usage errors, a program that cannot be run, and
 * three ranks meeting through the rendezvous store from the variables dtrun sets, and
 * restarts (--max-restarts: DTR_RESTART, one job id, DTR_NOTIFY_FD, --timeout's
 * DTR_TIMEOUT_MS, the restart time printed, restarts running out, --min-ranks shrinking the
 * world when one rank fails twice in a row).
 *
 * dtrun is looked for next to the tests folder (build/tests/../dtrun), or at $DTRUN. Every
 * run has a deadline (SIGKILL past it) and the program an alarm(): nothing can hang. */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <time.h>
#include <unistd.h>
#include <sys/types.h>
#include <sys/wait.h>
#include "test.h"
#include "posix_util.h"
#include "dtrun_util.h"

/* ---- helper modes: what the ranks run ---- */

static const char *env_or(const char *name) {
    const char *v = getenv(name);
    return v ? v : "(unset)";
}

static void on_term(int sig) {
    static const char msg[] = "got SIGTERM\n";
    (void)sig;
    if (write(1, msg, sizeof msg - 1) < 0) {
    }
    _exit(0);
}

static int child_main(const char *mode) {
    const char *rank_s = getenv("DTR_RANK");
    int rank = rank_s ? atoi(rank_s) : -1;
    if (strcmp(mode, "child-env") == 0) {
        printf("rank=%s world=%s local=%s lworld=%s addr=%s port=%s secret=%s\n", env_or("DTR_RANK"),
               env_or("DTR_WORLD_SIZE"), env_or("DTR_LOCAL_RANK"), env_or("DTR_LOCAL_WORLD_SIZE"),
               env_or("DTR_MASTER_ADDR"), env_or("DTR_MASTER_PORT"), env_or("DTR_SECRET"));
        printf("torch rank=%s world=%s local=%s lworld=%s addr=%s port=%s\n", env_or("RANK"), env_or("WORLD_SIZE"),
               env_or("LOCAL_RANK"), env_or("LOCAL_WORLD_SIZE"), env_or("MASTER_ADDR"), env_or("MASTER_PORT"));
        fflush(stdout);
        fprintf(stderr, "to stderr from %d\n", rank);
        return 0;
    }
    if (strcmp(mode, "child-restart") == 0) {   /* rank 1 fails in attempts 0 and 1 */
        const char *a = getenv("DTR_RESTART");
        printf("attempt=%s job=%s notify=%s timeout=%s world=%s\n", env_or("DTR_RESTART"), env_or("DTR_JOB_ID"),
               env_or("DTR_NOTIFY_FD"), env_or("DTR_TIMEOUT_MS"), env_or("DTR_WORLD_SIZE"));
        fflush(stdout);
        sleep_ms(rank == 1 ? 400 : 200);   /* the others have printed and stepped before rank 1 fails */
        if (rank == 1 && a && atoi(a) < 2) return 4;
        dtr_elastic_step(0);
        return 0;
    }
    if (strcmp(mode, "child-fail") == 0) {
        if (rank == 1) {
            sleep_ms(100);
            printf("failing\n");
            return 3;
        }
        sleep_ms(20000);
        printf("survived\n");
        return 0;
    }
    if (strcmp(mode, "child-kill") == 0) {
        if (rank == 0) raise(SIGKILL);
        sleep_ms(20000);
        return 0;
    }
    if (strcmp(mode, "child-term") == 0 || strcmp(mode, "child-stubborn") == 0) {
        signal(SIGTERM, strcmp(mode, "child-term") == 0 ? on_term : SIG_IGN);
        printf("ready\n");
        fflush(stdout);
        sleep_ms(20000);
        printf("survived\n");
        return 0;
    }
    if (strcmp(mode, "child-spam") == 0) {
        /* 200 lines of 1000 digits, each written in three pieces with pauses, then one line of
         * 150000 digits (longer than dtrun's line buffer) */
        char line[1001], *big;
        int i;
        memset(line, '0' + rank, 1000);
        line[1000] = '\n';
        for (i = 0; i < 200; i++) {
            if (write(1, line, 300) < 0 || write(1, line + 300, 400) < 0 || write(1, line + 700, 301) < 0) return 1;
            if (i % 50 == 0) sleep_ms(2);
        }
        big = (char *)malloc(150001);
        memset(big, '0' + rank, 150000);
        big[150000] = '\n';
        if (write(1, big, 150001) < 0) return 1;
        free(big);
        return 0;
    }
    if (strcmp(mode, "child-rdzv") == 0) {
        dtr_rendezvous_config cfg = dtr_rendezvous_config_init();
        dtr_store *st = NULL;
        char err[512], key[32], val[32], buf[32];
        size_t len;
        int q, world;
        if (dtr_rendezvous_config_from_env(&cfg, err, sizeof err) != DTR_OK ||
            dtr_store_create(&cfg, &st, err, sizeof err) != DTR_OK) {
            printf("error: %s\n", err);
            return 1;
        }
        world = dtr_store_world_size(st);
        snprintf(key, sizeof key, "hello/%d", cfg.rank);
        snprintf(val, sizeof val, "from %d", cfg.rank);
        if (dtr_store_set(st, key, val, strlen(val)) != DTR_OK) goto fail;
        for (q = 0; q < world; q++) {
            snprintf(key, sizeof key, "hello/%d", q);
            snprintf(val, sizeof val, "from %d", q);
            if (dtr_store_get(st, key, buf, sizeof buf, &len) != DTR_OK) goto fail;
            if (len != strlen(val) || memcmp(buf, val, len) != 0) {
                printf("error: wrong value for %s\n", key);
                return 1;
            }
        }
        if (dtr_store_barrier(st, "done") != DTR_OK) goto fail;
        printf("rdzv ok rank %d of %d\n", cfg.rank, world);
        dtr_store_destroy(st);
        return 0;
    fail:
        printf("error: %s\n", dtr_store_last_error(st));
        dtr_store_destroy(st);
        return 1;
    }
    fprintf(stderr, "test_dtrun: unknown mode %s\n", mode);
    return 2;
}

/* ---- running dtrun ---- */

/* ---- cases ---- */

static void test_env_and_prefix(void) {
    const char *args[] = {"-n", "3", "--", self, "child-env", NULL};
    run_result r = run_dtrun(args, 15000);
    char want[128], port[16] = "", secret[80] = "";
    int i;
    const char *p;
    CHECK_EQ_INT(r.code, 0);
    for (i = 0; i < 3; i++) {
        char prefix[16];
        snprintf(prefix, sizeof prefix, "[%d] ", i);
        snprintf(want, sizeof want, "[%d] rank=%d world=3 local=%d lworld=3 addr=127.0.0.1 port=", i, i, i);
        CHECK_MSG(count_lines(r.out, want, NULL) == 1, "rank %d:\n%s", i, r.out);
        snprintf(want, sizeof want, "[%d] torch rank=%d world=3 local=%d lworld=3 addr=127.0.0.1 port=", i, i, i);
        CHECK_MSG(count_lines(r.out, want, NULL) == 1, "rank %d:\n%s", i, r.out);
        snprintf(want, sizeof want, "to stderr from %d", i);
        CHECK_MSG(count_lines(r.err, prefix, want) == 1, "rank %d stderr:\n%s", i, r.err);
        CHECK(count_lines(r.out, prefix, "to stderr") == 0);
    }
    CHECK_EQ_INT(count_lines(r.out, "", NULL), 6);
    /* one port and one random secret (32 hex digits) for all ranks */
    p = strstr(r.out, " port=");
    if (p) sscanf(p, " port=%15s secret=%79s", port, secret);
    CHECK(atoi(port) > 0 && atoi(port) < 65536);
    CHECK_EQ_INT(strlen(secret), 32);
    CHECK_EQ_INT(strspn(secret, "0123456789abcdef"), 32);
    snprintf(want, sizeof want, "port=%s secret=%s", port, secret);
    CHECK_EQ_INT(count_lines(r.out, "[", want), 3);
    snprintf(want, sizeof want, "torch rank=0 world=3 local=0 lworld=3 addr=127.0.0.1 port=%s", port);
    CHECK_EQ_INT(count_lines(r.out, "[0] ", want), 1);
    run_free(&r);

    /* --port and DTR_SECRET from dtrun's environment */
    setenv("DTR_SECRET", "from-the-env", 1);
    {
        const char *args2[] = {"-n", "2", "--port", "23456", self, "child-env", NULL};
        r = run_dtrun(args2, 15000);
        CHECK_EQ_INT(r.code, 0);
        CHECK_EQ_INT(count_lines(r.out, "[", "port=23456 secret=from-the-env"), 2);
        run_free(&r);
    }
    {   /* --secret wins over the environment */
        const char *args3[] = {"-n", "1", "--secret", "from-the-flag", "--", self, "child-env", NULL};
        r = run_dtrun(args3, 15000);
        CHECK_EQ_INT(r.code, 0);
        CHECK_EQ_INT(count_lines(r.out, "[0] ", "secret=from-the-flag"), 1);
        run_free(&r);
    }
    unsetenv("DTR_SECRET");
}

static void test_failure_stops_others(void) {
    const char *args[] = {"-n", "3", "--grace", "1", "--", self, "child-fail", NULL};
    run_result r = run_dtrun(args, 15000);
    CHECK_EQ_INT(r.code, 3);
    CHECK_MSG(r.ms < 5000, "took %lld ms", (long long)r.ms);
    CHECK_EQ_INT(count_lines(r.out, "[1] ", "failing"), 1);
    CHECK_EQ_INT(count_lines(r.out, "", "survived"), 0);
    CHECK_MSG(strstr(r.err, "rank 1 exited with code 3") != NULL, "%s", r.err);
    run_free(&r);
}

static void test_killed_rank(void) {
    const char *args[] = {"-n", "2", "--grace", "1", "--", self, "child-kill", NULL};
    run_result r = run_dtrun(args, 15000);
    CHECK_EQ_INT(r.code, 128 + SIGKILL);
    CHECK(r.ms < 5000);
    CHECK_MSG(strstr(r.err, "rank 0 was killed by signal 9") != NULL, "%s", r.err);
    run_free(&r);
}

/* SIGTERM to dtrun once every rank has printed "ready". */
static void term_case(const char *mode, int want_got) {
    const char *argv[] = {dtrun, "-n", "2", "--grace", "1", "--", self, mode, NULL};
    int pfd[2], ready = 0, code;
    char buf[4096], all[8192];
    size_t alen = 0;
    int64_t t0 = now_ms(), tterm = 0;
    pid_t pid;
    CHECK(pipe(pfd) == 0);
    fflush(NULL);
    pid = fork();
    if (pid == 0) {
        dup2(pfd[1], 1);
        dup2(pfd[1], 2);
        close(pfd[0]);
        execv(dtrun, (char *const *)argv);
        _exit(126);
    }
    close(pfd[1]);
    while (now_ms() - t0 < 10000) {
        struct pollfd p;
        ssize_t k;
        p.fd = pfd[0];
        p.events = POLLIN;
        if (poll(&p, 1, 100) <= 0) continue;
        k = read(pfd[0], buf, sizeof buf);
        if (k <= 0) break;
        if (alen + (size_t)k < sizeof all - 1) {
            memcpy(all + alen, buf, (size_t)k);
            alen += (size_t)k;
            all[alen] = '\0';
        }
        if (!tterm && count_lines(all, "[", "ready") == 2 && strchr(all + alen - 1, '\n')) {
            ready = 1;
            tterm = now_ms();
            kill(pid, SIGTERM);
        }
    }
    close(pfd[0]);
    code = wait_code(pid, now_ms() + 5000);
    CHECK(ready);
    CHECK_EQ_INT(code, 128 + SIGTERM);
    CHECK_EQ_INT(count_lines(all, "[0] ", "got SIGTERM"), want_got);
    CHECK_EQ_INT(count_lines(all, "[1] ", "got SIGTERM"), want_got);
    CHECK_EQ_INT(count_lines(all, "", "survived"), 0);
    if (!want_got) CHECK_MSG(now_ms() - tterm >= 900, "SIGKILL came after %lld ms", (long long)(now_ms() - tterm));
    CHECK(now_ms() - tterm < 4000);
}

static void test_sigterm_forwarded(void) { term_case("child-term", 1); }
static void test_sigkill_after_grace(void) { term_case("child-stubborn", 0); }

static void test_no_interleaving(void) {
    const char *args[] = {"-n", "4", "--", self, "child-spam", NULL};
    run_result r = run_dtrun(args, 20000);
    const char *p = r.out;
    int lines = 0, bad = 0, long_pieces = 0;
    CHECK_EQ_INT(r.code, 0);
    while (*p) {
        const char *e = strchr(p, '\n');
        size_t len = e ? (size_t)(e - p) : strlen(p), i;
        int rank = -1;
        if (len >= 4 && p[0] == '[' && p[2] == ']' && p[3] == ' ' && p[1] >= '0' && p[1] <= '3') rank = p[1] - '0';
        if (rank < 0) bad++;
        else {
            for (i = 4; i < len; i++)
                if (p[i] != '0' + rank) break;
            if (i != len) bad++;
            if (len - 4 != 1000) long_pieces++;
        }
        lines++;
        p += len + (e ? 1 : 0);
    }
    CHECK_EQ_INT(bad, 0);
    /* 4 x (200 lines + a 150000-byte line in 3 pieces: 65536 + 65536 + 18928) */
    CHECK_EQ_INT(lines, 4 * 203);
    CHECK_EQ_INT(long_pieces, 4 * 3);
    run_free(&r);
}

static void test_usage_errors(void) {
    const char *none[] = {NULL};
    const char *zero[] = {"-n", "0", "true", NULL};
    const char *bad[] = {"-n", "2", "--frobnicate", "true", NULL};
    const char *noprog[] = {"-n", "2", "--", NULL};
    const char *missing[] = {"-n", "2", "--grace", "1", "/nonexistent/program", NULL};
    const char *min_over[] = {"-n", "2", "--min-ranks", "3", "true", NULL};
    const char *bad_restarts[] = {"-n", "2", "--max-restarts", "-1", "true", NULL};
    run_result r = run_dtrun(none, 5000);
    CHECK_EQ_INT(r.code, 2);
    CHECK(strstr(r.err, "usage") != NULL);
    run_free(&r);
    r = run_dtrun(zero, 5000);
    CHECK_EQ_INT(r.code, 2);
    run_free(&r);
    r = run_dtrun(bad, 5000);
    CHECK_EQ_INT(r.code, 2);
    CHECK(strstr(r.err, "--frobnicate") != NULL);
    run_free(&r);
    r = run_dtrun(noprog, 5000);
    CHECK_EQ_INT(r.code, 2);
    run_free(&r);
    r = run_dtrun(min_over, 5000);
    CHECK_MSG(r.code == 2 && strstr(r.err, "--min-ranks 3 is more than -n 2"), "%s", r.err);
    run_free(&r);
    r = run_dtrun(bad_restarts, 5000);
    CHECK_MSG(r.code == 2 && strstr(r.err, "--max-restarts -1"), "%s", r.err);
    run_free(&r);
    r = run_dtrun(missing, 5000);
    CHECK_EQ_INT(r.code, 127);
    CHECK_MSG(strstr(r.err, "] dtrun: cannot run /nonexistent/program") != NULL, "%s", r.err);
    run_free(&r);
}

/* --max-restarts: attempts 0 and 1 fail (rank 1 exits 4), attempt 2 succeeds; every attempt
 * gets DTR_RESTART, one job id, the notify pipe and --timeout's DTR_TIMEOUT_MS; the restart
 * time to the first step is printed. With one restart allowed dtrun exits 4. */
static void test_restarts(void) {
    const char *args[] = {"-n", "2", "--timeout", "1234", "--max-restarts", "3", "--", self, "child-restart", NULL};
    const char *one[] = {"-n", "2", "--max-restarts", "1", "--", self, "child-restart", NULL};
    const char *shrink[] = {"-n", "3", "--min-ranks", "2", "--max-restarts", "3", "--", self, "child-restart", NULL};
    run_result r = run_dtrun(args, 20000);
    char job[80] = "", want[160];
    const char *p;
    int a;
    CHECK_MSG(r.code == 0, "exit %d\n%s%s", r.code, r.out, r.err);
    p = strstr(r.out, "job=");
    if (p) sscanf(p, "job=%79s", job);
    CHECK_EQ_INT(strlen(job), 32);
    for (a = 0; a < 3; a++) {
        snprintf(want, sizeof want, "attempt=%d job=%s notify=", a, job);
        CHECK_MSG(count_lines(r.out, "[", want) == 2, "attempt %d:\n%s", a, r.out);
    }
    CHECK_EQ_INT(count_lines(r.out, "[", "timeout=1234 world=2"), 6);
    CHECK_EQ_INT(count_lines(r.err, "dtrun: rank 1 exited with code 4", NULL), 2);
    CHECK_MSG(count_lines(r.err, "dtrun: restart 1: first step (0, rank ", "ms after the failure") == 1 &&
                  count_lines(r.err, "dtrun: restart 2: first step (0, rank ", "ms after the failure") == 1,
              "%s", r.err);
    CHECK(strstr(r.err, "restarting the job (restart 2 of 3) with 2 ranks") != NULL);
    run_free(&r);
    r = run_dtrun(one, 20000);
    CHECK_MSG(r.code == 4 && strstr(r.err, "no restarts left (--max-restarts 1)"), "exit %d\n%s", r.code, r.err);
    run_free(&r);
    /* rank 1 blamed twice in a row: the third attempt has 2 ranks (and rank 1 fails once more) */
    r = run_dtrun(shrink, 20000);
    CHECK_MSG(r.code == 0 && strstr(r.err, "rank 1 failed in two attempts in a row and cannot come back: going on "
                                           "with 2 ranks"), "exit %d\n%s", r.code, r.err);
    CHECK_EQ_INT(count_lines(r.out, "[", "attempt=2 job="), 2);
    CHECK_EQ_INT(count_lines(r.out, "[", "world=3"), 6);
    CHECK_EQ_INT(count_lines(r.out, "[", "world=2"), 2);
    run_free(&r);
}

static void test_rendezvous_through_dtrun(void) {
    const char *args[] = {"-n", "3", "--", self, "child-rdzv", NULL};
    run_result r;
    setenv("DTR_TIMEOUT_MS", "5000", 1);
    r = run_dtrun(args, 20000);
    unsetenv("DTR_TIMEOUT_MS");
    CHECK_EQ_INT(r.code, 0);
    CHECK_MSG(count_lines(r.out, "[", "rdzv ok rank") == 3, "%s%s", r.out, r.err);
    CHECK_EQ_INT(count_lines(r.out, "[2] ", "rdzv ok rank 2 of 3"), 1);
    run_free(&r);
}

int main(int argc, char **argv) {
    (void)test_ctx;   /* tests/test.h's helper; no context here */
    if (argc > 1 && strncmp(argv[1], "child-", 6) == 0) return child_main(argv[1]);
    alarm(90);
    if (!find_dtrun(argv[0], "test_dtrun")) return 1;
    unsetenv("DTR_SECRET");
    RUN(test_env_and_prefix);
    RUN(test_failure_stops_others);
    RUN(test_killed_rank);
    RUN(test_sigterm_forwarded);
    RUN(test_sigkill_after_grace);
    RUN(test_no_interleaving);
    RUN(test_usage_errors);
    RUN(test_rendezvous_through_dtrun);
    RUN(test_restarts);
    return test_summary();
}
