/* tests/test_nccl.c: the NCCL transport (src/transport/nccl.c, in dtrain_comm.c) on a machine
 * without a GPU, and its watchdog decisions against a fake clock:
 *   test_watch_decisions  an error wins over completion, completion over a dead peer, the
 *                         deadline comes last; a wait that never completes ends at the deadline
 *   test_naps             naps double from 2 us to the cap and never pass the deadline
 *   test_open_without_gpu dtr_transport_find("nccl") finds it when the unit has NCCL, and a group
 *                         over it fails at once with DTR_UNSUPPORTED and a message saying why
 *                         (here: no GPU); with a GPU, a world of one opens (make test-gpu runs
 *                         this program on the device)
 * Built against the internal API for the watchdog's pure functions. */
#define _POSIX_C_SOURCE 200809L
#define DTRAIN_INTERNAL_API
#include "test.h"
#include "posix_util.h"

static void test_watch_decisions(void) {
    int64_t deadline = 1000000, now;
    int polls = 0;
    dtr__nccl_next next = DTR__NCCL_WAIT;
    CHECK_EQ_INT(dtr__nccl_watch(1, 2, -1, 0, deadline), DTR__NCCL_ERROR);
    CHECK_EQ_INT(dtr__nccl_watch(1, 0, 3, 0, deadline), DTR__NCCL_DONE);
    CHECK_EQ_INT(dtr__nccl_watch(1, 1, -1, deadline + 5, deadline), DTR__NCCL_DONE);
    CHECK_EQ_INT(dtr__nccl_watch(0, 1, 3, 0, deadline), DTR__NCCL_PEER_DEAD);
    CHECK_EQ_INT(dtr__nccl_watch(0, 1, -1, deadline, deadline), DTR__NCCL_TIMEOUT);
    CHECK_EQ_INT(dtr__nccl_watch(0, 0, -1, deadline - 1, deadline), DTR__NCCL_WAIT);
    /* a wait on work that never completes, on a fake clock advanced by each nap */
    for (now = 0, polls = 0; polls < 100000; polls++) {
        int64_t nap;
        next = dtr__nccl_watch(0, 1, -1, now, deadline);
        if (next != DTR__NCCL_WAIT) break;
        nap = dtr__nccl_nap(polls ? 4000 : 0, 100000, now, deadline);
        CHECK(nap > 0);
        now += nap;
    }
    CHECK_EQ_INT(next, DTR__NCCL_TIMEOUT);
    CHECK_EQ_INT(now, deadline);   /* the last nap stopped exactly at the deadline */
    CHECK(polls < 400);            /* naps, not a spin */
}

static void test_naps(void) {
    int64_t nap = 0;
    int k;
    nap = dtr__nccl_nap(nap, 100000, 0, 1000000000);
    CHECK_EQ_INT(nap, 2000);
    for (k = 0; k < 20; k++) nap = dtr__nccl_nap(nap, 100000, 0, 1000000000);
    CHECK_EQ_INT(nap, 100000);
    CHECK_EQ_INT(dtr__nccl_nap(50000, 100000, 990000, 1000000), 10000);
    CHECK_EQ_INT(dtr__nccl_nap(50000, 100000, 1000000, 1000000), 0);
}

static void test_open_without_gpu(void) {
    const dtr_transport_vtable *vt = dtr_nccl_transport();
    dtr_rendezvous_config rc = dtr_rendezvous_config_init();
    dtr_comm_config cfg = dtr_comm_config_init();
    dtr_store *st = NULL;
    dtr_comm *c = NULL;
    char err[512] = "";
    dtr_result r;
    int64_t t0;
    if (!vt) {
        printf("*** dtrain_comm.c was built without NCCL (nccl.h not found): NCCL transport tests SKIPPED ***\n");
        return;
    }
    CHECK(dtr_transport_find("nccl") == vt);
    rc.rank = 0;
    rc.world_size = 1;
    rc.port = free_port();
    snprintf(rc.secret, sizeof rc.secret, "nccl-test");
    rc.timeout_ms = 5000;
    r = dtr_store_create(&rc, &st, err, sizeof err);
    CHECK_MSG(r == DTR_OK, "store: %s", err);
    if (r != DTR_OK) return;
    cfg.transport = "nccl";
    cfg.store = st;
    cfg.timeout_ms = 5000;
    /* host buffers: refused by the group before the transport opens */
    r = dtr_comm_create(&cfg, &c, err, sizeof err);
    CHECK_EQ_INT(r, DTR_UNSUPPORTED);
    CHECK_MSG(strstr(err, "'nccl' does not take host memory") != NULL, "%s", err);
    /* the transport's own open: without a GPU it says so at once */
    {
        void *state = NULL;
        dtr_transport_info info;
        memset(&info, 0, sizeof info);
        t0 = now_ms();
        r = vt->open(&cfg, &state, &info, err, sizeof err);
        if (r == DTR_OK) {
            printf("a GPU is visible: the NCCL world of one opened (%s)\n", info.detail);
            CHECK(info.rank == 0 && info.size == 1);
            vt->close(state);
        } else {
            CHECK_EQ_INT(r, DTR_UNSUPPORTED);
            CHECK_MSG(strstr(err, "no CUDA device") != NULL, "%s", err);
            CHECK(state == NULL);
            CHECK(now_ms() - t0 < 3000);   /* at once, not at the deadline */
            printf("*** no GPU: the NCCL transport refused to open, as it must; collectives on the GPU SKIPPED ***\n");
        }
    }
    dtr_comm_destroy(c);
    dtr_store_destroy(st);
}

int main(void) {
    (void)test_ctx;
    RUN(test_watch_decisions);
    RUN(test_naps);
    RUN(test_open_without_gpu);
    return test_summary();
}
