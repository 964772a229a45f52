/* tests/cmake_consumer/comm_main.c: a consumer of the installed libfabric transport
 * (libdtrain_comm through pkg-config dtrain-comm or CMake's dtrain::comm). It names no symbol
 * of the unit: the transport must be found by name, registered by linking alone. It opens a
 * one-rank world over shm (its own rendezvous store on a free port), all-reduces, and checks
 * that with DTR_FABRIC_SIGNALS=keep the program's own SIGSEGV and SIGTERM handlers survive
 * the group's creation (the shm provider installs its own). Exit status 0 on success. */
#define _POSIX_C_SOURCE 200809L
#include <dtrain.h>

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void own_handler(int sig) { (void)sig; }

static int handler_is_own(int sig) {
    struct sigaction sa;
    return sigaction(sig, NULL, &sa) == 0 && sa.sa_handler == own_handler;
}

static int run(dtr_store *st, int keep_cfg) {
    dtr_comm_config cfg = dtr_comm_config_init();
    dtr_comm *c = NULL;
    char err[512];
    float x = 3.0f, y = 0.0f;
    int ok;
    cfg.transport = "libfabric";
    cfg.store = st;
    cfg.fabric.provider = "shm";
    cfg.fabric.keep_signal_handlers = keep_cfg;
    cfg.timeout_ms = 20000;
    if (dtr_comm_create(&cfg, &c, err, sizeof err) != DTR_OK) {
        fprintf(stderr, "comm consumer: dtr_comm_create: %s\n", err);
        return 0;
    }
    ok = dtr_comm_all_reduce(c, &x, &y, 1, DTR_F32, DTR_REDUCE_SUM) == DTR_OK && y == 3.0f;
    printf("comm consumer: transport %s, 1 rank over shm: all-reduce %s\n", dtr_comm_transport_name(c),
           ok ? "ok" : "WRONG");
    dtr_comm_destroy(c);
    return ok;
}

int main(int argc, char **argv) {
    dtr_rendezvous_config rc = dtr_rendezvous_config_init();
    dtr_store *st = NULL;
    struct sigaction sa;
    char err[512];
    const char *keep = getenv("DTR_FABRIC_SIGNALS");
    int keep_cfg = argc > 1 && !strcmp(argv[1], "--keep-signals"), ok;
    if (!dtr_transport_find("libfabric")) {
        fprintf(stderr, "comm consumer: the libfabric transport is not registered: was libdtrain_comm linked?\n");
        return 1;
    }
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = own_handler;
    sigaction(SIGSEGV, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    rc.port = 0;
    snprintf(rc.secret, sizeof rc.secret, "comm-consumer");
    if (dtr_store_create(&rc, &st, err, sizeof err) != DTR_OK) {
        fprintf(stderr, "comm consumer: dtr_store_create: %s\n", err);
        return 1;
    }
    ok = run(st, keep_cfg);
    dtr_store_destroy(st);
    {
        int kept = handler_is_own(SIGSEGV) && handler_is_own(SIGTERM);
        int must = keep_cfg || (keep && !strcmp(keep, "keep"));
        printf("comm consumer: %s: the program's SIGSEGV and SIGTERM handlers %s\n",
               keep_cfg ? "cfg.fabric.keep_signal_handlers = 1" : keep ? keep : "DTR_FABRIC_SIGNALS unset",
               kept ? "kept" : must ? "REPLACED" : "replaced by the provider's");
        ok &= kept || !must;
    }
    return ok ? 0 : 1;
}
