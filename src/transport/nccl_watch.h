/* ============================================================================
 * The NCCL transport's watchdog decisions, kept pure (no NCCL, no clock of their own) so the
 * CPU tests drive them with a fake clock: what a thread waiting on NCCL work does next, and
 * how long it naps between polls. src/transport/nccl.c (dtrain_comm.c) calls them.
 * ==========================================================================*/
#ifndef DTR__NCCL_WATCH_H
#define DTR__NCCL_WATCH_H

/** What a waiter does next. */
typedef enum dtr__nccl_next {
    DTR__NCCL_WAIT = 0,      /* nap, then poll again */
    DTR__NCCL_DONE = 1,      /* the work completed: its result is valid */
    DTR__NCCL_ERROR = 2,     /* NCCL reported an asynchronous error: abort the communicator */
    DTR__NCCL_PEER_DEAD = 3, /* a peer process on this host is gone: abort, name it */
    DTR__NCCL_TIMEOUT = 4    /* the deadline passed: abort (NCCL would wait forever), name the peer */
} dtr__nccl_next;

/** The decision from one poll: `done` (the work's event completed), `async_error` (0 none,
 *  1 an operation still in progress, 2 an error: ncclCommGetAsyncError's answer mapped),
 *  `dead_peer` (a peer found dead, or -1), the clock and the deadline. An error wins over
 *  completion (the result cannot be trusted); completed work wins over a peer that died
 *  after it; the deadline is checked last. */
static inline dtr__nccl_next dtr__nccl_watch(int done, int async_error, int dead_peer, int64_t now_ns, int64_t deadline_ns) {
    if (async_error == 2) return DTR__NCCL_ERROR;
    if (done) return DTR__NCCL_DONE;
    if (dead_peer >= 0) return DTR__NCCL_PEER_DEAD;
    if (now_ns >= deadline_ns) return DTR__NCCL_TIMEOUT;
    return DTR__NCCL_WAIT;
}

/** The next nap: doubling from 2 us up to max_ns, never past the deadline. */
static inline int64_t dtr__nccl_nap(int64_t prev_ns, int64_t max_ns, int64_t now_ns, int64_t deadline_ns) {
    int64_t nap = prev_ns <= 0 ? 2000 : prev_ns * 2;
    if (nap > max_ns) nap = max_ns;
    if (nap > deadline_ns - now_ns) nap = deadline_ns - now_ns;
    return nap > 0 ? nap : 0;
}

#endif /* DTR__NCCL_WATCH_H */
