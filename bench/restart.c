/* bench/restart.c: how long an elastic restart takes, from a rank's death to the restarted
 * job's first step, under dtrun --max-restarts.
 *
 *   build/bench/restart [--provider P] [--world N] [--reps K] [--dtrun PATH]
 *
 * Runs `dtrun -n N --max-restarts 1 -- <this program> --rank P` K times (default 3; world 3,
 * provider shm; dtrun is build/dtrun beside build/bench/). Each rank opens a process group
 * over libfabric and does 10 steps of a 64 KiB all-reduce, calling dtr_elastic_step after
 * each; in attempt 0, rank 1 SIGKILLs itself at step 5. dtrun then stops the others, starts
 * attempt 1 and prints the two times this program reads back from its stderr. One JSON line
 * per run:
 *   {"bench":"restart","provider":"shm","world":3,"rep":0,"restart_ms":12,"first_step_ms":640}
 * restart_ms: from the failure to the start of attempt 1 (the others stopped and reaped);
 * first_step_ms: from the failure to the first step of attempt 1 (processes started, store
 * joined, transport opened, one all-reduce done). No checkpoint is loaded: add the
 * program's own restore time. */
#define _XOPEN_SOURCE 700   /* realpath, popen */
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "dtrain.h"

#define COUNT 16384

/* One rank: 10 steps of an all-reduce; rank 1 of attempt 0 dies at step 5. */
static int rank_main(const char *provider) {
    dtr_comm_config cfg = dtr_comm_config_init();
    dtr_comm *c = NULL;
    char err[512];
    const char *attempt = getenv("DTR_RESTART");
    static float buf[COUNT];
    int t;
    cfg.transport = "libfabric";
    cfg.fabric.provider = provider;
    if (dtr_comm_create(&cfg, &c, err, sizeof err) != DTR_OK) {
        fprintf(stderr, "restart: %s\n", err);
        return 1;
    }
    for (t = 0; t < 10; t++) {
        if (t == 5 && dtr_comm_rank(c) == 1 && attempt && atoi(attempt) == 0) raise(SIGKILL);
        if (dtr_comm_all_reduce(c, buf, buf, COUNT, DTR_F32, DTR_REDUCE_SUM) != DTR_OK) {
            fprintf(stderr, "restart: %s\n", dtr_comm_last_error(c));
            dtr_comm_destroy(c);
            return 1;
        }
        dtr_elastic_step(t);
    }
    dtr_comm_destroy(c);
    return 0;
}

/* The number after the first `what` in text, else -1. */
static long find_ms(const char *text, const char *what, const char *after) {
    const char *p = strstr(text, what);
    long v = -1;
    if (p && (p = strstr(p, after)) != NULL) {
        while (p > text && p[-1] != ' ' && p[-1] != ',') p--;
        while (p > text && p[-1] == ' ') p--;
        while (p > text && p[-1] >= '0' && p[-1] <= '9') p--;
        if (sscanf(p, "%ld", &v) != 1) v = -1;
    }
    return v;
}

/* One run of dtrun; its stderr in out. */
static int run_once(const char *dtrun, const char *self, const char *provider, int world, char *out, size_t cap) {
    char cmd[2 * PATH_MAX + 256];
    FILE *f;
    size_t n;
    snprintf(cmd, sizeof cmd, "'%s' -n %d --max-restarts 1 --timeout 20000 -- '%s' --rank '%s' 2>&1 >/dev/null", dtrun,
             world, self, provider);
    if (!(f = popen(cmd, "r"))) return -1;
    n = fread(out, 1, cap - 1, f);
    out[n] = '\0';
    return pclose(f);
}

int main(int argc, char **argv) {
    const char *provider = "shm", *dtrun_arg = NULL;
    char dtrun[PATH_MAX], self[PATH_MAX], out[65536];
    int world = 3, reps = 3, i;
    for (i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--rank") && i + 1 < argc) return rank_main(argv[i + 1]);
        if (!strcmp(argv[i], "--provider") && i + 1 < argc) provider = argv[++i];
        else if (!strcmp(argv[i], "--world") && i + 1 < argc) world = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--reps") && i + 1 < argc) reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--dtrun") && i + 1 < argc) dtrun_arg = argv[++i];
        else {
            fprintf(stderr, "usage: %s [--provider P] [--world N>=2] [--reps K] [--dtrun PATH]\n", argv[0]);
            return 2;
        }
    }
    if (world < 2 || reps < 1 || !realpath(argv[0], self)) {
        fprintf(stderr, "restart: --world must be 2 or more, --reps 1 or more\n");
        return 2;
    }
    if (dtrun_arg) {
        snprintf(dtrun, sizeof dtrun, "%s", dtrun_arg);
    } else {   /* <build>/bench/restart -> <build>/dtrun */
        char *s;
        snprintf(dtrun, sizeof dtrun, "%s", self);
        if ((s = strrchr(dtrun, '/')) != NULL) *s = '\0';
        if ((s = strrchr(dtrun, '/')) != NULL) *s = '\0';
        strncat(dtrun, "/dtrun", sizeof dtrun - strlen(dtrun) - 1);
    }
    for (i = 0; i < reps; i++) {
        int rc = run_once(dtrun, self, provider, world, out, sizeof out);
        long restart = find_ms(out, "restarting the job", " ms after the failure");
        long first = find_ms(out, "restart 1: first step", " ms after the failure");
        if (rc != 0 || restart < 0 || first < 0) {
            fprintf(stderr, "restart: run %d failed (exit %d):\n%s", i, rc, out);
            return 1;
        }
        printf("{\"bench\":\"restart\",\"provider\":\"%s\",\"world\":%d,\"rep\":%d,\"restart_ms\":%ld,"
               "\"first_step_ms\":%ld}\n", provider, world, i, restart, first);
        fflush(stdout);
    }
    return 0;
}
