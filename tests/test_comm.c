/* Process groups over the local transport (ranks are threads of this process).
 *
 *   test_create_errors     bad configurations, unknown transport, double open, registry
 *   test_all_reduce        world sizes 1-5, f32/bf16/f16, sum/avg/max, ring and recursive
 *                          doubling (and AUTO), 0 to ~1M elements, in place and not: every
 *                          result is compared bit for bit with a reference that reduces in
 *                          the documented order (so the order itself is tested)
 *   test_determinism       random floats: two runs give the same bits on every rank
 *   test_broadcast         every root, tree and pipelined chain, dtypes, sizes
 *   test_reduce_scatter    world sizes 1-5, dtypes, ops, uneven and zero counts
 *   test_all_gather        world sizes 1-5, in place and not
 *   test_barrier           nobody leaves before everybody arrived
 *   test_send_recv         ring, FIFO per tag, tags out of order, 0 bytes, 1 MiB, truncation,
 *                          argument errors that do not break the group
 *   test_split_grid        a 2x3 grid: row and column groups (collectives running at once
 *                          on both), key order, DTR_COMM_UNDEFINED, nested split
 *   test_async             queued collectives, a blocking one behind them, overlap, size 1
 *   test_native_transport  a transport with a native all-reduce: dispatch, group handles for
 *                          sub-groups, no_native
 *   test_fault_hang        a rank stops answering: every other rank gets DTR_TIMEOUT or
 *                          DTR_PEER_FAILED naming it within the deadline
 *   test_fault_leave       a rank leaves (destroys its group) before a collective
 *   test_fault_abort       dtr_comm_abort stops the others at once
 *   test_isolate           isolate_peer_failures: rank 2 leaves; a receive from it and a send
 *                          to it fail with DTR_PEER_FAILED naming it, dtr_comm_peer_alive says
 *                          0 for it and 1 for rank 1, the group stays DTR_OK and ranks 0 and 1
 *                          still exchange messages; a collective then fails as a whole.
 *                          Without the option the same receive breaks the group (and
 *                          dtr_comm_peer_alive says 1: the world failed, not rank 2 alone)
 *   test_fault_async       a failure seen through a request
 *   test_fault_deadlock    mismatched calls: both time out and say so
 *   test_flight            the flight recorder: the last operations with their op, bytes,
 *                          peer or root, sequence number, times and state; a ring of 8 keeps
 *                          the newest 8; a timeout marks the running one failed, logs the ring
 *                          and writes <dir>/flight-rank<N>.json; turned off it holds nothing
 * Each rank thread counts its own failed checks; the main thread checks the counts.
 * alarm() bounds the whole program: a hang is a crash, never a stuck CI job.
 * DTR_TEST_QUICK=1 (sanitizers) shrinks the largest sizes. */
#define _POSIX_C_SOURCE 200809L
#define DTRAIN_INTERNAL_API   /* t_memory_kinds wraps the CPU backend's reduction */
#include <pthread.h>
#include <signal.h>
#include <time.h>
#include <unistd.h>
#include "test.h"
#include "test_util.h"
#include "posix_util.h"

static int g_quick;

/* ---- rank threads ---- */

typedef struct rank_ctx {
    int rank, size;
    dtr_comm *comm;
    void *arg;
    int fails;
    dtr_result result;      /* for fault tests */
    int failed_rank;
    double secs;
    char msg[512];
} rank_ctx;

typedef void (*rank_fn)(rank_ctx *rc);

typedef struct rank_thread {
    rank_ctx rc;
    rank_fn fn;
    dtr_local_world *w;
    dtr_comm_config cfg;
    pthread_t tid;
} rank_thread;

#define RCHECK(rc, cond) do { if (!(cond)) { if ((rc)->fails++ < 5) \
    fprintf(stderr, "  rank %d: FAIL %s:%d: %s\n", (rc)->rank, __FILE__, __LINE__, #cond); } } while (0)
#define RCHECK_OK(rc, expr) do { dtr_result r__ = (expr); if (r__ != DTR_OK) { if ((rc)->fails++ < 5) \
    fprintf(stderr, "  rank %d: FAIL %s:%d: %s -> %s (%s)\n", (rc)->rank, __FILE__, __LINE__, #expr, \
            dtr_result_string(r__), dtr_comm_last_error((rc)->comm)); } } while (0)

static void *rank_main(void *p) {
    rank_thread *t = (rank_thread *)p;
    char err[256];
    dtr_result r;
    t->cfg.local.world = t->w;
    t->cfg.local.rank = t->rc.rank;
    r = dtr_comm_create(&t->cfg, &t->rc.comm, err, sizeof err);
    if (r != DTR_OK) {
        fprintf(stderr, "  rank %d: dtr_comm_create: %s (%s)\n", t->rc.rank, dtr_result_string(r), err);
        t->rc.fails++;
        return NULL;
    }
    t->fn(&t->rc);
    dtr_comm_destroy(t->rc.comm);
    return NULL;
}

/* Runs fn on n rank threads of a new local world with configuration cfg (NULL: a 20 s
   deadline). Results stay in out[0..n) when given. Returns the total of failed checks. */
static int run_ranks(int n, const dtr_comm_config *cfg, rank_fn fn, void *arg, rank_ctx *out) {
    rank_thread *t = (rank_thread *)calloc((size_t)n, sizeof(*t));
    dtr_local_world *w = NULL;
    dtr_comm_config def = dtr_comm_config_init();
    int i, fails = 0;
    def.timeout_ms = 20000;
    if (!cfg) cfg = &def;
    if (!t || dtr_local_world_create(n, NULL, &w) != DTR_OK) { free(t); return 1; }
    for (i = 0; i < n; i++) {
        t[i].rc.rank = i;
        t[i].rc.size = n;
        t[i].rc.arg = arg;
        t[i].rc.failed_rank = -2;
        t[i].fn = fn;
        t[i].w = w;
        t[i].cfg = *cfg;
    }
    for (i = 0; i < n; i++) pthread_create(&t[i].tid, NULL, rank_main, &t[i]);
    for (i = 0; i < n; i++) pthread_join(t[i].tid, NULL);
    dtr_local_world_destroy(w);
    for (i = 0; i < n; i++) {
        fails += t[i].rc.fails;
        if (out) out[i] = t[i].rc;
    }
    free(t);
    return fails;
}

#include "coll_ref.h"

/* element i of rank r's input: small integers (exact sums) or random floats */
static float input_val(int r, size_t i, int random) {
    if (random) {
        uint64_t h = ((uint64_t)r * 0x9E3779B97F4A7C15ULL) ^ ((uint64_t)i * 0xBF58476D1CE4E5B9ULL);
        h ^= h >> 31; h *= 0x94D049BB133111EBULL; h ^= h >> 29;
        return (float)((double)(h >> 11) / 9007199254740992.0 * 2.0 - 1.0) * 3.0f;
    }
    return (float)((int)((r * 7 + i * 3) % 41) - 20);
}

/* ---- cases ---- */

static dtr_result nop_hook(void *user, dtr_tensor *param, dtr_event *ready) {
    (void)user; (void)param; (void)ready;
    return DTR_OK;
}

static void t_create_errors(void) {
    dtr_comm_config cfg = dtr_comm_config_init();
    dtr_local_world *w = NULL;
    dtr_comm *c = NULL, *c2 = NULL;
    dtr_transport_vtable vt;
    char err[256];
    CHECK_EQ_INT(dtr_local_world_create(0, NULL, &w), DTR_INVALID_ARGUMENT);
    CHECK_EQ_INT(dtr_local_world_create(2, NULL, NULL), DTR_NULL_HANDLE);
    CHECK_EQ_INT(dtr_comm_create(&cfg, &c, err, sizeof err), DTR_INVALID_ARGUMENT);   /* no world */
    CHECK(strstr(err, "local_world") != NULL);
    CHECK_OK(NULL, dtr_local_world_create(2, NULL, &w));
    CHECK_EQ_INT(dtr_local_world_size(w), 2);
    cfg.local.world = w;
    cfg.local.rank = 2;
    CHECK_EQ_INT(dtr_comm_create(&cfg, &c, err, sizeof err), DTR_INVALID_ARGUMENT);
    cfg.local.rank = 1;
    cfg.transport = "no-such-transport";
    CHECK_EQ_INT(dtr_comm_create(&cfg, &c, err, sizeof err), DTR_NOT_FOUND);
    CHECK(strstr(err, "no-such-transport") != NULL);
    cfg.transport = "libfabric";
    if (!dtr_transport_find("libfabric")) CHECK_EQ_INT(dtr_comm_create(&cfg, &c, err, sizeof err), DTR_NOT_FOUND);
    cfg.transport = NULL;
    CHECK_OK(NULL, dtr_comm_create(&cfg, &c, err, sizeof err));
    CHECK_EQ_INT(dtr_comm_rank(c), 1);
    CHECK_EQ_INT(dtr_comm_size(c), 2);
    CHECK_EQ_INT(dtr_comm_local_rank(c), 1);
    CHECK_EQ_INT(dtr_comm_local_size(c), 2);
    CHECK_EQ_INT(dtr_comm_world_rank(c, 0), 0);
    CHECK_EQ_INT(dtr_comm_world_rank(c, 5), -1);
    CHECK(strcmp(dtr_comm_transport_name(c), "local") == 0 && dtr_comm_transport_detail(c)[0] == 0);
    CHECK_EQ_INT(dtr_comm_status(c), DTR_OK);
    CHECK_EQ_INT(dtr_comm_failed_rank(c), -1);
    CHECK_EQ_INT(dtr_comm_create(&cfg, &c2, err, sizeof err), DTR_INVALID_ARGUMENT);  /* rank 1 again */
    CHECK(strstr(err, "opened already") != NULL);
    /* argument errors are described and do not break the group */
    CHECK_EQ_INT(dtr_comm_broadcast(c, err, 1, DTR_U8, 7), DTR_INVALID_ARGUMENT);
    CHECK(strstr(dtr_comm_last_error(c), "root 7") != NULL);
    CHECK_EQ_INT(dtr_comm_all_reduce(c, err, err, 4, DTR_I32, DTR_REDUCE_SUM), DTR_DTYPE_MISMATCH);
    CHECK_EQ_INT(dtr_comm_all_reduce(c, err, err + 4, 4, DTR_F32, DTR_REDUCE_SUM), DTR_INVALID_ARGUMENT); /* overlap */
    CHECK_EQ_INT(dtr_comm_send(c, err, 1, 1, 0), DTR_INVALID_ARGUMENT);   /* to itself */
    CHECK_EQ_INT(dtr_comm_set_timeout(c, 0), DTR_INVALID_ARGUMENT);
    CHECK_EQ_INT(dtr_comm_status(c), DTR_OK);
    dtr_comm_destroy(c);
    dtr_local_world_destroy(w);
    /* registry */
    CHECK(dtr_transport_find("local") == dtr_local_transport());
    CHECK_EQ_INT(dtr_transport_register(dtr_local_transport()), DTR_OK);
    vt = *dtr_local_transport();
    vt.name = "local";
    CHECK_EQ_INT(dtr_transport_register(&vt), DTR_INVALID_ARGUMENT);     /* the name is taken */
    vt.name = "test-copy";
    vt.abi_version = 1;
    CHECK_EQ_INT(dtr_transport_register(&vt), DTR_VERSION_MISMATCH);
    vt.abi_version = DTR_VERSION_NUMBER;
    vt.isend = NULL;
    CHECK_EQ_INT(dtr_transport_register(&vt), DTR_INVALID_ARGUMENT);
    CHECK(strcmp(dtr_reduce_op_name(DTR_REDUCE_AVG), "avg") == 0);
    {   /* the gradient hook list's errors (tests/test_dp.c covers the hooks themselves) */
        dtr_context *ctx = test_ctx(1);
        int id = 0, k;
        CHECK_EQ_INT(dtr_context_add_grad_hook(NULL, NULL, NULL, NULL), DTR_NULL_HANDLE);
        CHECK_EQ_INT(dtr_context_add_grad_hook(ctx, NULL, NULL, NULL), DTR_NULL_HANDLE);
        dtr_context_clear_error(ctx);
        CHECK_EQ_INT(dtr_context_remove_grad_hook(ctx, 12345), DTR_INVALID_ARGUMENT);
        dtr_context_clear_error(ctx);
        for (k = 0; k < 8; k++) CHECK_OK(ctx, dtr_context_add_grad_hook(ctx, nop_hook, NULL, &id));
        CHECK_EQ_INT(dtr_context_add_grad_hook(ctx, nop_hook, NULL, NULL), DTR_BAD_STATE);
        dtr_context_clear_error(ctx);
        CHECK_OK(ctx, dtr_context_remove_grad_hook(ctx, id));
        CHECK_OK(ctx, dtr_context_add_grad_hook(ctx, nop_hook, NULL, NULL));
        dtr_context_destroy(ctx);
    }
    CHECK(strcmp(dtr_allreduce_algo_name(DTR_ALLREDUCE_RING), "ring") == 0);
}

/* a registered copy of the local transport, found by name */
static dtr_transport_vtable g_copy_vt;
static void rk_registered(rank_ctx *rc) {
    float v = (float)rc->rank;
    RCHECK(rc, strcmp(dtr_comm_transport_name(rc->comm), "local-copy") == 0);
    RCHECK_OK(rc, dtr_comm_all_reduce(rc->comm, &v, &v, 1, DTR_F32, DTR_REDUCE_SUM));
    RCHECK(rc, v == 3.0f);
}
static void t_registered_transport(void) {
    dtr_comm_config cfg = dtr_comm_config_init();
    g_copy_vt = *dtr_local_transport();
    g_copy_vt.name = "local-copy";
    CHECK_EQ_INT(dtr_transport_register(&g_copy_vt), DTR_OK);
    CHECK_EQ_INT(dtr_transport_register(&g_copy_vt), DTR_OK);
    CHECK(dtr_transport_find("local-copy") == &g_copy_vt);
    cfg.transport = "local-copy";
    cfg.timeout_ms = 20000;
    CHECK_EQ_INT(run_ranks(3, &cfg, rk_registered, NULL, NULL), 0);
}

/* ---- memory kinds: the nested config, and reductions through the buffers' backend ---- */

static dtr_backend g_count_be;              /* the CPU backend with a counting reduce */
static dtr_result (*g_cpu_reduce)(dtr_context *, void *, const void *, const void *, size_t, dtr_dtype, int, int);
static pthread_mutex_t g_count_mu = PTHREAD_MUTEX_INITIALIZER;
static int g_reduces;

static dtr_result count_reduce(dtr_context *ctx, void *out, const void *a, const void *b, size_t n, dtr_dtype dt, int op,
                               int div) {
    pthread_mutex_lock(&g_count_mu);
    g_reduces++;
    pthread_mutex_unlock(&g_count_mu);
    return g_cpu_reduce(ctx, out, a, b, n, dt, op, div);
}

static void rk_device_sum(rank_ctx *rc) {
    float v[5];
    int i;
    for (i = 0; i < 5; i++) v[i] = (float)(rc->rank * 10 + i);
    RCHECK_OK(rc, dtr_comm_all_reduce(rc->comm, v, v, 5, DTR_F32, DTR_REDUCE_SUM));
    for (i = 0; i < 5; i++) RCHECK(rc, v[i] == (float)(30 + 3 * i));
}

static void t_memory_kinds(void) {
    dtr_comm_config cfg = dtr_comm_config_init();
    dtr_context_config cc = dtr_context_config_init();
    dtr_transport_vtable dev_vt = *dtr_local_transport();
    dtr_local_world *w = NULL;
    dtr_context *cpu = test_ctx(1), *owner = NULL;
    dtr_comm *c = NULL;
    char err[256];
    CHECK(cfg.memory == DTR_MEM_HOST && cfg.nccl.device == -1 && cfg.local.world == NULL);
    CHECK(cfg.fabric.provider == NULL && cfg.fabric.keep_signal_handlers == 0);
    CHECK(dtr_local_transport()->mem_kinds == DTR_MEM_HOST);
    CHECK_OK(NULL, dtr_local_world_create(1, NULL, &w));
    cfg.local.world = w;
    cfg.memory = DTR_MEM_DEVICE;                       /* device memory needs an owner ... */
    CHECK_EQ_INT(dtr_comm_create(&cfg, &c, err, sizeof err), DTR_INVALID_ARGUMENT);
    CHECK(strstr(err, "cfg.context") != NULL);
    cfg.context = cpu;                                 /* a CPU's device memory is host memory */
    CHECK_OK(NULL, dtr_comm_create(&cfg, &c, err, sizeof err));
    {
        float v[3] = {1, 2, 3};
        CHECK_OK(NULL, dtr_comm_all_reduce(c, v, v, 3, DTR_F32, DTR_REDUCE_SUM));
        CHECK(v[0] == 1 && v[2] == 3);
    }
    dtr_comm_destroy(c);
    c = NULL;
    /* (a device backend over this host transport: staged, tests/test_comm_devsim.c) */
    cfg.memory = (dtr_mem_kind)7;
    CHECK_EQ_INT(dtr_comm_create(&cfg, &c, err, sizeof err), DTR_INVALID_ARGUMENT);
    dtr_local_world_destroy(w);
    /* a transport taking device memory: the collectives reduce through the owner's backend */
    g_count_be = *cpu->backend;
    g_cpu_reduce = g_count_be.reduce;
    g_count_be.reduce = count_reduce;
    cc.backend = &g_count_be;
    cc.threads = 1;
    CHECK_OK(NULL, dtr_context_create(&cc, &owner));
    dev_vt.name = "local-device";
    dev_vt.mem_kinds = DTR_MEM_HOST | DTR_MEM_DEVICE;
    cfg = dtr_comm_config_init();
    cfg.transport_vtable = &dev_vt;
    cfg.memory = DTR_MEM_DEVICE;
    cfg.context = owner;
    cfg.timeout_ms = 20000;
    g_reduces = 0;
    CHECK_EQ_INT(run_ranks(3, &cfg, rk_device_sum, NULL, NULL), 0);
    CHECK(g_reduces >= 3);   /* every rank reduced through the backend */
    dtr_context_destroy(owner);
    dtr_context_destroy(cpu);
}

/* ---- all-reduce ---- */

typedef struct ar_arg { int random; int big; } ar_arg;

static void rk_all_reduce(rank_ctx *rc) {
    static const dtr_dtype dts[3] = {DTR_F32, DTR_BF16, DTR_F16};
    static const dtr_reduce_op ops[3] = {DTR_REDUCE_SUM, DTR_REDUCE_AVG, DTR_REDUCE_MAX};
    static const int algos[3] = {DTR_ALLREDUCE_RING, DTR_ALLREDUCE_RECURSIVE_DOUBLING, DTR_ALLREDUCE_AUTO};
    size_t counts[12] = {0, 1, 2, 3, 4, 5, 7, 64, 1000, 4099, 70000, 0};
    int N = rc->size, nc = 11, a, d, o, ci, r;
    ar_arg *arg = (ar_arg *)rc->arg;
    size_t maxc;
    float **x, *ref, *got, *in;
    void *buf, *src;
    if (arg->big) { counts[0] = g_quick ? 200000 : 1000000; nc = 1; }
    maxc = 0;
    for (ci = 0; ci < nc; ci++) if (counts[ci] > maxc) maxc = counts[ci];
    x = (float **)malloc((size_t)N * sizeof(float *));
    for (r = 0; r < N; r++) {
        size_t i;
        x[r] = (float *)malloc((maxc + 1) * sizeof(float));
        for (i = 0; i < maxc; i++) x[r][i] = input_val(r, i, arg->random);
    }
    ref = (float *)malloc((maxc + 1) * sizeof(float));
    got = (float *)malloc((maxc + 1) * sizeof(float));
    in = (float *)malloc((maxc + 1) * sizeof(float));
    buf = malloc((maxc + 1) * 4);
    src = malloc((maxc + 1) * 4);
    for (a = 0; a < 3; a++) {
        dtr_comm_set_allreduce_algo(rc->comm, (dtr_allreduce_algo)algos[a], 4096);
        for (d = 0; d < 3; d++) {
            dtr_dtype dt = dts[d];
            size_t es = dtr_dtype_size(dt), i;
            for (o = 0; o < 3; o++) {
                if (arg->big && (o != 0 || (d != 0 && a != 0))) continue;
                for (ci = 0; ci < nc; ci++) {
                    size_t n = counts[ci];
                    int inplace = (int)((ci + o + d) % 2), algo = algos[a];
                    /* inputs rounded to the dtype: the reference starts from the same values */
                    for (r = 0; r < N; r++)
                        for (i = 0; i < n; i++) x[r][i] = rnd(dt, input_val(r, i, arg->random));
                    if (algo == DTR_ALLREDUCE_AUTO)
                        algo = (n * es >= 4096 && n >= (size_t)N) ? DTR_ALLREDUCE_RING : DTR_ALLREDUCE_RECURSIVE_DOUBLING;
                    if (algo == DTR_ALLREDUCE_RING) ref_ring(x, N, n, dt, ops[o], ref);
                    else ref_rd(x, N, n, dt, ops[o], ref);
                    for (i = 0; i < n; i++) in[i] = x[rc->rank][i];
                    if (inplace) {
                        to_dtype(dt, in, buf, n);
                        RCHECK_OK(rc, dtr_comm_all_reduce(rc->comm, buf, buf, n, dt, ops[o]));
                    } else {
                        to_dtype(dt, in, src, n);
                        memset(buf, 0x7f, n * es);
                        RCHECK_OK(rc, dtr_comm_all_reduce(rc->comm, src, buf, n, dt, ops[o]));
                        /* the input is untouched */
                        from_dtype(dt, src, got, n);
                        RCHECK(rc, n == 0 || memcmp(got, in, n * sizeof(float)) == 0);
                    }
                    from_dtype(dt, buf, got, n);
                    if (n && memcmp(got, ref, n * sizeof(float)) != 0) {
                        for (i = 0; i < n && got[i] == ref[i]; i++) {}
                        if (rc->fails++ < 5)
                            fprintf(stderr, "  rank %d: all_reduce N=%d %s %s %s n=%zu inplace=%d: [%zu] %.9g != %.9g\n",
                                    rc->rank, N, dtr_allreduce_algo_name((dtr_allreduce_algo)algos[a]), dtr_dtype_name(dt),
                                    dtr_reduce_op_name(ops[o]), n, inplace, i, (double)got[i], (double)ref[i]);
                    }
                }
            }
        }
    }
    for (r = 0; r < N; r++) free(x[r]);
    free(x); free(ref); free(got); free(in); free(buf); free(src);
}

static void t_all_reduce(void) {
    ar_arg arg = {0, 0};
    int n;
    for (n = 1; n <= 5; n++) CHECK_MSG(run_ranks(n, NULL, rk_all_reduce, &arg, NULL) == 0, "world %d", n);
    arg.big = 1;
    for (n = 2; n <= 5; n += (g_quick ? 3 : 1)) CHECK_MSG(run_ranks(n, NULL, rk_all_reduce, &arg, NULL) == 0, "big, world %d", n);
}

/* random floats: the reference order is matched bit for bit, and two runs agree */
static void rk_determinism(rank_ctx *rc) {
    size_t n = 100003, i;
    float *a = (float *)malloc(n * sizeof(float)), *b = (float *)malloc(n * sizeof(float));
    int algo;
    for (algo = DTR_ALLREDUCE_RING; algo <= DTR_ALLREDUCE_RECURSIVE_DOUBLING; algo++) {
        dtr_comm_set_allreduce_algo(rc->comm, (dtr_allreduce_algo)algo, 0);
        for (i = 0; i < n; i++) a[i] = b[i] = input_val(rc->rank, i, 1);
        RCHECK_OK(rc, dtr_comm_all_reduce(rc->comm, a, a, n, DTR_F32, DTR_REDUCE_AVG));
        RCHECK_OK(rc, dtr_comm_all_reduce(rc->comm, b, b, n, DTR_F32, DTR_REDUCE_AVG));
        RCHECK(rc, memcmp(a, b, n * sizeof(float)) == 0);
        /* every rank has the same bits: compare with rank 0's copy */
        memcpy(b, a, n * sizeof(float));
        RCHECK_OK(rc, dtr_comm_broadcast(rc->comm, b, n, DTR_F32, 0));
        RCHECK(rc, memcmp(a, b, n * sizeof(float)) == 0);
    }
    free(a);
    free(b);
}

static void t_determinism(void) {
    ar_arg arg = {1, 0};
    int n;
    for (n = 2; n <= 5; n++) CHECK_MSG(run_ranks(n, NULL, rk_all_reduce, &arg, NULL) == 0, "random, world %d", n);
    for (n = 3; n <= 4; n++) CHECK_MSG(run_ranks(n, NULL, rk_determinism, NULL, NULL) == 0, "world %d", n);
}

/* ---- broadcast ---- */

static void rk_broadcast(rank_ctx *rc) {
    size_t counts[6] = {0, 1, 3, 1000, 300000, 0}, i;
    static const dtr_dtype dts[3] = {DTR_F32, DTR_U8, DTR_BF16};
    int root, ci, d;
    unsigned char *buf = (unsigned char *)malloc(300000 * 4);
    for (root = 0; root < rc->size; root++)
        for (d = 0; d < 3; d++)
            for (ci = 0; ci < 5; ci++) {
                size_t bytes = counts[ci] * dtr_dtype_size(dts[d]);
                for (i = 0; i < bytes; i++)
                    buf[i] = rc->rank == root ? (unsigned char)(i * 7 + (size_t)root * 13 + (size_t)d) : 0xee;
                RCHECK_OK(rc, dtr_comm_broadcast(rc->comm, buf, counts[ci], dts[d], root));
                for (i = 0; i < bytes; i++)
                    if (buf[i] != (unsigned char)(i * 7 + (size_t)root * 13 + (size_t)d)) break;
                RCHECK(rc, i == bytes);
            }
    free(buf);
}

static void t_broadcast(void) {
    dtr_comm_config cfg = dtr_comm_config_init();
    int n;
    cfg.timeout_ms = 20000;
    for (n = 1; n <= 5; n++) CHECK_MSG(run_ranks(n, &cfg, rk_broadcast, NULL, NULL) == 0, "tree/chain, world %d", n);
    cfg.chain_threshold_bytes = 1;   /* the pipelined chain for everything, 4 KiB segments */
    cfg.segment_bytes = 4096;
    for (n = 2; n <= 5; n++) CHECK_MSG(run_ranks(n, &cfg, rk_broadcast, NULL, NULL) == 0, "chain, world %d", n);
}

/* ---- reduce-scatter, all-gather, barrier ---- */

static void rk_reduce_scatter(rank_ctx *rc) {
    static const dtr_dtype dts[3] = {DTR_F32, DTR_BF16, DTR_F16};
    static const dtr_reduce_op ops[3] = {DTR_REDUCE_SUM, DTR_REDUCE_AVG, DTR_REDUCE_MAX};
    size_t counts[5] = {0, 1, 3, 100, 5001};
    int N = rc->size, d, o, ci, r;
    float **x = (float **)malloc((size_t)N * sizeof(float *)), *ref = (float *)malloc(5001 * sizeof(float));
    float *got = (float *)malloc(5001 * sizeof(float));
    void *src = malloc((size_t)N * 5001 * 4), *dst = malloc(5001 * 4);
    for (r = 0; r < N; r++) x[r] = (float *)malloc((size_t)N * 5001 * sizeof(float));
    for (d = 0; d < 3; d++)
        for (o = 0; o < 3; o++)
            for (ci = 0; ci < 5; ci++) {
                size_t n = counts[ci], i, es = dtr_dtype_size(dts[d]);
                for (r = 0; r < N; r++)
                    for (i = 0; i < (size_t)N * n; i++) x[r][i] = rnd(dts[d], input_val(r, i, 1));
                /* block k reduces like the ring's chunk k, starting at rank k+1 */
                for (i = 0; i < n; i++) ref[i] = ref_ring_elem(x, N, dts[d], ops[o], rc->rank, (size_t)rc->rank * n + i, N);
                to_dtype(dts[d], x[rc->rank], src, (size_t)N * n);
                memset(dst, 0x55, n * es);
                RCHECK_OK(rc, dtr_comm_reduce_scatter(rc->comm, src, dst, n, dts[d], ops[o]));
                from_dtype(dts[d], dst, got, n);
                RCHECK(rc, n == 0 || memcmp(got, ref, n * sizeof(float)) == 0);
            }
    for (r = 0; r < N; r++) free(x[r]);
    free(x); free(ref); free(got); free(src); free(dst);
}

static void rk_all_gather(rank_ctx *rc) {
    size_t counts[4] = {0, 1, 5, 1000};
    int N = rc->size, ci, inplace, r;
    int32_t *dst = (int32_t *)malloc((size_t)N * 1000 * 4), *src = (int32_t *)malloc(1000 * 4);
    for (inplace = 0; inplace < 2; inplace++)
        for (ci = 0; ci < 4; ci++) {
            size_t n = counts[ci], i;
            int32_t *s = inplace ? dst + (size_t)rc->rank * n : src;
            for (i = 0; i < (size_t)N * n; i++) dst[i] = -1;
            for (i = 0; i < n; i++) s[i] = (int32_t)(rc->rank * 100000 + (int)i);
            RCHECK_OK(rc, dtr_comm_all_gather(rc->comm, s, dst, n, DTR_I32));
            for (r = 0; r < N; r++)
                for (i = 0; i < n; i++) RCHECK(rc, dst[(size_t)r * n + i] == (int32_t)(r * 100000 + (int)i));
        }
    free(dst);
    free(src);
}

static pthread_mutex_t g_bar_mu = PTHREAD_MUTEX_INITIALIZER;
static int g_bar_count;

static void rk_barrier(rank_ctx *rc) {
    int it, seen;
    for (it = 0; it < 20; it++) {
        if ((it + rc->rank) % 3 == 0) sleep_ms(1);
        pthread_mutex_lock(&g_bar_mu);
        g_bar_count++;
        pthread_mutex_unlock(&g_bar_mu);
        RCHECK_OK(rc, dtr_comm_barrier(rc->comm));
        pthread_mutex_lock(&g_bar_mu);
        seen = g_bar_count;
        pthread_mutex_unlock(&g_bar_mu);
        RCHECK(rc, seen >= (it + 1) * rc->size);
    }
}

static void t_reduce_scatter(void) {
    int n;
    for (n = 1; n <= 5; n++) CHECK_MSG(run_ranks(n, NULL, rk_reduce_scatter, NULL, NULL) == 0, "world %d", n);
}

static void t_all_gather(void) {
    int n;
    for (n = 1; n <= 5; n++) CHECK_MSG(run_ranks(n, NULL, rk_all_gather, NULL, NULL) == 0, "world %d", n);
}

static void t_barrier(void) {
    int n;
    for (n = 1; n <= 5; n++) {
        g_bar_count = 0;
        CHECK_MSG(run_ranks(n, NULL, rk_barrier, NULL, NULL) == 0, "world %d", n);
    }
}

/* ---- point-to-point ---- */

static void rk_send_recv(rank_ctx *rc) {
    dtr_comm *c = rc->comm;
    int N = rc->size, me = rc->rank, right = (me + 1) % N, left = (me + N - 1) % N, v, i;
    dtr_request *q[3];
    size_t big = (size_t)1 << 20;
    unsigned char *sb = (unsigned char *)malloc(big), *rb = (unsigned char *)malloc(big);
    char small[8] = "1234567";
    /* a ring of values; the even ranks send first, the odd ones receive first */
    v = me * 100;
    if (me % 2 == 0) {
        RCHECK_OK(rc, dtr_comm_send(c, &v, sizeof v, right, 5));
        RCHECK_OK(rc, dtr_comm_recv(c, &v, sizeof v, left, 5));
    } else {
        int w = v;
        RCHECK_OK(rc, dtr_comm_recv(c, &v, sizeof v, left, 5));
        RCHECK_OK(rc, dtr_comm_send(c, &w, sizeof w, right, 5));
    }
    RCHECK(rc, v == left * 100);
    /* FIFO per (source, tag), and tags received in another order than sent */
    if (me == 0) {
        int vals[3] = {1, 2, 3}, t1 = 11, t2 = 22;
        for (i = 0; i < 3; i++) RCHECK_OK(rc, dtr_comm_send_async(c, &vals[i], sizeof(int), 1, 7, &q[i]));
        for (i = 0; i < 3; i++) { RCHECK_OK(rc, dtr_request_wait(q[i])); dtr_request_destroy(q[i]); }
        RCHECK_OK(rc, dtr_comm_send_async(c, &t1, sizeof t1, 1, 1, &q[0]));
        RCHECK_OK(rc, dtr_comm_send_async(c, &t2, sizeof t2, 1, 2, &q[1]));
        RCHECK_OK(rc, dtr_request_wait(q[1]));
        RCHECK_OK(rc, dtr_request_wait(q[0]));
        dtr_request_destroy(q[0]);
        dtr_request_destroy(q[1]);
    } else if (me == 1) {
        int got;
        for (i = 0; i < 3; i++) {
            RCHECK_OK(rc, dtr_comm_recv(c, &got, sizeof got, 0, 7));
            RCHECK(rc, got == i + 1);
        }
        RCHECK_OK(rc, dtr_comm_recv(c, &got, sizeof got, 0, 2));
        RCHECK(rc, got == 22);
        RCHECK_OK(rc, dtr_comm_recv(c, &got, sizeof got, 0, 1));
        RCHECK(rc, got == 11);
    }
    /* 1 MiB both ways at once (the receiver copies), and 0 bytes */
    for (i = 0; i < (int)big; i++) sb[i] = (unsigned char)(i + me);
    RCHECK_OK(rc, dtr_comm_recv_async(c, rb, big, left, 9, &q[0]));
    RCHECK_OK(rc, dtr_comm_send_async(c, sb, big, right, 9, &q[1]));
    RCHECK_OK(rc, dtr_comm_send_async(c, NULL, 0, right, 10, &q[2]));
    RCHECK_OK(rc, dtr_comm_recv(c, NULL, 0, left, 10));
    for (i = 0; i < 3; i++) { RCHECK_OK(rc, dtr_request_wait(q[i])); dtr_request_destroy(q[i]); }
    for (i = 0; i < (int)big; i++) if (rb[i] != (unsigned char)(i + left)) break;
    RCHECK(rc, i == (int)big);
    /* a message longer than the receive buffer fails both sides; the group goes on */
    if (me == 0) RCHECK(rc, dtr_comm_send(c, small, 8, 1, 3) == DTR_INVALID_ARGUMENT);
    if (me == 1) {
        RCHECK(rc, dtr_comm_recv(c, small, 4, 0, 3) == DTR_INVALID_ARGUMENT);
        RCHECK(rc, strstr(dtr_comm_last_error(c), "longer") != NULL);
    }
    RCHECK(rc, dtr_comm_send(c, small, 1, N, 0) == DTR_INVALID_ARGUMENT);
    RCHECK(rc, dtr_comm_recv(c, small, 1, left, -1) == DTR_INVALID_ARGUMENT);
    RCHECK_OK(rc, dtr_comm_barrier(c));
    RCHECK(rc, dtr_comm_status(c) == DTR_OK);
    if (N >= 3) {   /* dtr_request_wait_any through the local transport's wait_some */
        char why[300] = "";
        if (wait_any_case(c, why, sizeof why) != 0 && rc->fails++ < 5) fprintf(stderr, "  rank %d: FAIL wait_any: %s\n", me, why);
        RCHECK_OK(rc, dtr_comm_barrier(c));
    }
    free(sb);
    free(rb);
}

static void t_send_recv(void) {
    int n;
    for (n = 2; n <= 4; n++) CHECK_MSG(run_ranks(n, NULL, rk_send_recv, NULL, NULL) == 0, "world %d", n);
}

/* ---- split ---- */

static void rk_split(rank_ctx *rc) {
    dtr_comm *c = rc->comm, *row = NULL, *col = NULL, *rev = NULL, *odd = NULL, *sub = NULL;
    int me = rc->rank, r = me / 3, k = me % 3, i;
    float a[1000], b[1000];
    dtr_request *qa = NULL, *qb = NULL;
    RCHECK_OK(rc, dtr_comm_split(c, r, k, &row));
    RCHECK_OK(rc, dtr_comm_split(c, k, r, &col));
    if (!row || !col) { rc->fails++; return; }
    RCHECK(rc, dtr_comm_size(row) == 3 && dtr_comm_rank(row) == k);
    RCHECK(rc, dtr_comm_size(col) == 2 && dtr_comm_rank(col) == r);
    RCHECK(rc, dtr_comm_local_rank(row) == k && dtr_comm_local_size(row) == 3);
    for (i = 0; i < 3; i++) RCHECK(rc, dtr_comm_world_rank(row, i) == r * 3 + i);
    for (i = 0; i < 2; i++) RCHECK(rc, dtr_comm_world_rank(col, i) == i * 3 + k);
    /* collectives on the row and the column groups at the same time: messages never mix */
    for (i = 0; i < 1000; i++) { a[i] = (float)(me + i); b[i] = (float)(me * 10 + i); }
    RCHECK_OK(rc, dtr_comm_all_reduce_async(row, a, a, 1000, DTR_F32, DTR_REDUCE_SUM, &qa));
    RCHECK_OK(rc, dtr_comm_all_reduce_async(col, b, b, 1000, DTR_F32, DTR_REDUCE_SUM, &qb));
    RCHECK_OK(rc, dtr_request_wait(qb));
    RCHECK_OK(rc, dtr_request_wait(qa));
    dtr_request_destroy(qa);
    dtr_request_destroy(qb);
    for (i = 0; i < 1000; i++) {
        RCHECK(rc, a[i] == (float)(3 * r * 3 + 0 + 1 + 2 + 3 * i));
        RCHECK(rc, b[i] == (float)(10 * (k + k + 3) + 2 * i));
    }
    /* the world still works after the sub-groups were used */
    a[0] = 1.0f;
    RCHECK_OK(rc, dtr_comm_all_reduce(c, a, a, 1, DTR_F32, DTR_REDUCE_SUM));
    RCHECK(rc, a[0] == 6.0f);
    /* key order: reversed ranks */
    RCHECK_OK(rc, dtr_comm_split(c, 0, -me, &rev));
    RCHECK(rc, rev && dtr_comm_rank(rev) == 5 - me && dtr_comm_world_rank(rev, 0) == 5);
    /* DTR_COMM_UNDEFINED: no group */
    RCHECK_OK(rc, dtr_comm_split(c, me % 2 ? 1 : DTR_COMM_UNDEFINED, 0, &odd));
    RCHECK(rc, me % 2 ? (odd && dtr_comm_size(odd) == 3 && dtr_comm_rank(odd) == me / 2) : odd == NULL);
    if (odd) {
        a[0] = (float)me;
        RCHECK_OK(rc, dtr_comm_all_reduce(odd, a, a, 1, DTR_F32, DTR_REDUCE_MAX));
        RCHECK(rc, a[0] == 5.0f);
    }
    /* nested: the row group split by column parity */
    RCHECK_OK(rc, dtr_comm_split(row, k % 2, 0, &sub));
    RCHECK(rc, sub && dtr_comm_size(sub) == (k % 2 ? 1 : 2));
    if (sub) {
        a[0] = (float)me;
        RCHECK_OK(rc, dtr_comm_all_reduce(sub, a, a, 1, DTR_F32, DTR_REDUCE_SUM));
        RCHECK(rc, a[0] == (k % 2 ? (float)me : (float)(r * 3 + r * 3 + 2)));
    }
    dtr_comm_destroy(sub);
    RCHECK(rc, dtr_comm_split(c, -5, 0, &sub) == DTR_INVALID_ARGUMENT && sub == NULL);
    dtr_comm_destroy(odd);
    dtr_comm_destroy(rev);
    /* destroying the parent first is fine: the endpoint closes with the last group */
    dtr_comm_destroy(row);
    dtr_comm_destroy(col);
}

static void t_split_grid(void) { CHECK_EQ_INT(run_ranks(6, NULL, rk_split, NULL, NULL), 0); }

/* Hierarchical all-reduce on fake hosts of k ranks ($DTR_RANKS_PER_HOST): local ranks, every
   dtype x reduction x count against the documented order (host sums, then the leaders'),
   and on 2 hosts x 2 the flat recursive doubling's bits, which add in the same order. */
static void rk_hier(rank_ctx *rc) {
    static const dtr_dtype dts[3] = {DTR_F32, DTR_BF16, DTR_F16};
    static const dtr_reduce_op ops[3] = {DTR_REDUCE_SUM, DTR_REDUCE_AVG, DTR_REDUCE_MAX};
    static const size_t counts[6] = {1, 3, 64, 1000, 4099, 70000};
    int N = rc->size, k = *(const int *)rc->arg, d, o, ci, r;
    float *x[8], *ref = (float *)malloc(70001 * sizeof(float)), *flat = (float *)malloc(70001 * sizeof(float));
    float *got = (float *)malloc(70001 * sizeof(float));
    void *buf = malloc(70001 * 4);
    RCHECK(rc, dtr_comm_local_rank(rc->comm) == rc->rank % k);
    RCHECK(rc, dtr_comm_local_size(rc->comm) == (N - rc->rank / k * k < k ? N - rc->rank / k * k : k));
    RCHECK_OK(rc, dtr_comm_set_allreduce_algo(rc->comm, DTR_ALLREDUCE_HIERARCHICAL, 4096));
    for (r = 0; r < N; r++) x[r] = (float *)malloc(70001 * sizeof(float));
    for (d = 0; d < 3; d++)
        for (o = 0; o < 3; o++)
            for (ci = 0; ci < 6; ci++) {
                size_t n = counts[ci], i;
                for (r = 0; r < N; r++)
                    for (i = 0; i < n; i++) x[r][i] = rnd(dts[d], input_val(r, i, 1));
                ref_hier(x, N, k, n, dts[d], ops[o], 4096, ref);
                to_dtype(dts[d], x[rc->rank], buf, n);
                RCHECK_OK(rc, dtr_comm_all_reduce(rc->comm, buf, buf, n, dts[d], ops[o]));
                from_dtype(dts[d], buf, got, n);
                if (memcmp(got, ref, n * sizeof(float)) != 0 && rc->fails++ < 5)
                    fprintf(stderr, "  rank %d: hierarchical N=%d k=%d %s %s n=%zu differs from the reference\n", rc->rank, N,
                            k, dtr_dtype_name(dts[d]), dtr_reduce_op_name(ops[o]), n);
                if (N == 4 && k == 2) {
                    ref_rd(x, N, n, dts[d], ops[o], flat);
                    RCHECK(rc, memcmp(got, flat, n * sizeof(float)) == 0);
                }
            }
    for (r = 0; r < N; r++) free(x[r]);
    free(ref), free(flat), free(got), free(buf);
}

static void t_hierarchical(void) {
    static const int shapes[4][2] = {{4, 2}, {5, 2}, {6, 3}, {3, 1}};
    int i;
    for (i = 0; i < 4; i++) {
        char v[8];
        snprintf(v, sizeof v, "%d", shapes[i][1]);
        setenv("DTR_RANKS_PER_HOST", v, 1);
        CHECK_MSG(run_ranks(shapes[i][0], NULL, rk_hier, (void *)&shapes[i][1], NULL) == 0, "world %d, %d per host",
                  shapes[i][0], shapes[i][1]);
        unsetenv("DTR_RANKS_PER_HOST");
    }
}

/* ---- non-blocking ---- */

static void rk_async(rank_ctx *rc) {
    enum { K = 8, M = 10000 };
    float *bufs = (float *)malloc((size_t)K * M * sizeof(float));
    dtr_request *q[K];
    int i, j, done, polls = 0, N = rc->size;
    double acc = 0.0;
    for (i = 0; i < K * M; i++) bufs[i] = (float)(rc->rank + i % 17);
    for (i = 0; i < K; i++)
        RCHECK_OK(rc, dtr_comm_all_reduce_async(rc->comm, bufs + i * M, bufs + i * M, M, DTR_F32, DTR_REDUCE_SUM, &q[i]));
    /* compute while they run */
    for (j = 0; j < 200000; j++) acc += (double)j * 1e-9;
    RCHECK(rc, acc > 0.0);
    /* a blocking collective runs after the queued ones */
    RCHECK_OK(rc, dtr_comm_barrier(rc->comm));
    for (i = 0; i < K; i++) {
        RCHECK_OK(rc, dtr_request_test(q[i], &done));
        RCHECK(rc, done == 1);
        RCHECK_OK(rc, dtr_request_wait(q[i]));
        dtr_request_destroy(q[i]);
    }
    for (i = 0; i < K * M; i++)
        if (bufs[i] != (float)(N * (N - 1) / 2 + N * (i % 17))) break;
    RCHECK(rc, i == K * M);
    /* poll one to completion */
    RCHECK_OK(rc, dtr_comm_broadcast_async(rc->comm, bufs, M, DTR_F32, N - 1, &q[0]));
    do { RCHECK_OK(rc, dtr_request_test(q[0], &done)); polls++; if (!done) sleep_ms(1); } while (!done && polls < 20000);
    RCHECK(rc, done);
    dtr_request_destroy(q[0]);
    RCHECK_OK(rc, dtr_comm_reduce_scatter_async(rc->comm, bufs, bufs + K * M / 2, 10, DTR_F32, DTR_REDUCE_SUM, &q[0]));
    RCHECK_OK(rc, dtr_comm_all_gather_async(rc->comm, bufs + K * M / 2, bufs, 10, DTR_F32, &q[1]));
    RCHECK_OK(rc, dtr_comm_barrier_async(rc->comm, &q[2]));
    for (i = 2; i >= 0; i--) { RCHECK_OK(rc, dtr_request_wait(q[i])); dtr_request_destroy(q[i]); }
    free(bufs);
}

static void t_async(void) {
    int n;
    for (n = 1; n <= 4; n++) CHECK_MSG(run_ranks(n, NULL, rk_async, NULL, NULL) == 0, "world %d", n);
}

/* ---- a transport with native collectives ---- */

/* The local transport plus a native all-reduce (f32 sum: gather to the group's first rank,
   add in group order, send back) and barrier, to check the dispatch to native hooks, the
   group handles (made per group with its transport ranks and context id) and no_native. */
typedef struct ngroup { int n, ranks[8]; uint32_t ctx; } ngroup;
typedef struct nstate { void *inner; int rank; } nstate;   /* wraps the local endpoint */
static int g_native_calls;
static pthread_mutex_t g_native_mu = PTHREAD_MUTEX_INITIALIZER;
#define LV dtr_local_transport()
#define IN(st) (((nstate *)(st))->inner)

static dtr_result nat_open(const dtr_comm_config *cfg, void **state, dtr_transport_info *info, char *err, size_t len) {
    nstate *s = (nstate *)calloc(1, sizeof *s);
    dtr_result r = s ? LV->open(cfg, &s->inner, info, err, len) : DTR_OUT_OF_MEMORY;
    if (r != DTR_OK) { free(s); return r; }
    s->rank = info->rank;
    *state = s;
    return DTR_OK;
}
static void nat_close(void *st) { LV->close(IN(st)); free(st); }
static dtr_result nat_isend(void *st, const void *b, size_t n, int d, uint64_t t, void **q, dtr_transport_error *e) {
    return LV->isend(IN(st), b, n, d, t, q, e);
}
static dtr_result nat_irecv(void *st, void *b, size_t n, int s, uint64_t t, void **q, dtr_transport_error *e) {
    return LV->irecv(IN(st), b, n, s, t, q, e);
}
static dtr_result nat_test(void *st, void *q, int *done, dtr_transport_error *e) { return LV->test(IN(st), q, done, e); }
static dtr_result nat_wait_any(void *st, void *const *q, int n, int64_t dl, dtr_transport_error *e) {
    return LV->wait_any(IN(st), q, n, dl, e);
}
static void nat_release(void *st, void *q) { LV->release(IN(st), q); }
static void nat_abort(void *st, int r, const char *why) { LV->abort(IN(st), r, why); }

static dtr_result nat_group_create(void *st, const int *ranks, int n, uint32_t ctx, void **group) {
    ngroup *g = (ngroup *)calloc(1, sizeof *g);
    int i;
    (void)st;
    if (!g || n > 8) { free(g); return DTR_OUT_OF_MEMORY; }
    g->n = n;
    g->ctx = ctx;
    for (i = 0; i < n; i++) g->ranks[i] = ranks[i];
    *group = g;
    return DTR_OK;
}
static void nat_group_destroy(void *st, void *group) { (void)st; free(group); }

static dtr_result nat_xfer(void *st, int send, void *buf, size_t bytes, int peer, uint64_t tag, int64_t deadline,
                           dtr_transport_error *err) {
    void *req = NULL;
    int done = 0;
    dtr_result r = send ? nat_isend(st, buf, bytes, peer, tag, &req, err) : nat_irecv(st, buf, bytes, peer, tag, &req, err);
    while (r == DTR_OK && (r = nat_test(st, req, &done, err)) == DTR_OK && !done) r = nat_wait_any(st, &req, 1, deadline, err);
    if (req) nat_release(st, req);
    return r;
}

static dtr_result nat_all_reduce(void *st, void *group, const void *src, void *dst, size_t count, dtr_dtype dt,
                                 dtr_reduce_op op, int64_t deadline, dtr_transport_error *err) {
    ngroup *g = (ngroup *)group;
    uint64_t tag = ((uint64_t)0xfeed << 48) | g->ctx;
    float *d = (float *)dst, *tmp;
    dtr_result r = DTR_OK;
    int me, i;
    size_t k;
    if (dt != DTR_F32 || op != DTR_REDUCE_SUM) return DTR_UNSUPPORTED;
    pthread_mutex_lock(&g_native_mu);
    g_native_calls++;
    pthread_mutex_unlock(&g_native_mu);
    if (src != dst) memcpy(dst, src, count * sizeof(float));
    me = -1;   /* this endpoint's rank in the group */
    for (i = 0; i < g->n; i++) if (g->ranks[i] == ((nstate *)st)->rank) me = i;
    if (me < 0) return DTR_INVALID_ARGUMENT;
    tmp = (float *)malloc(count * sizeof(float) + 1);
    if (me == 0) {
        for (i = 1; i < g->n && r == DTR_OK; i++) {
            r = nat_xfer(st, 0, tmp, count * sizeof(float), g->ranks[i], tag, deadline, err);
            for (k = 0; k < count && r == DTR_OK; k++) d[k] += tmp[k];
        }
        for (i = 1; i < g->n && r == DTR_OK; i++) r = nat_xfer(st, 1, d, count * sizeof(float), g->ranks[i], tag + 1, deadline, err);
    } else {
        r = nat_xfer(st, 1, d, count * sizeof(float), g->ranks[0], tag, deadline, err);
        if (r == DTR_OK) r = nat_xfer(st, 0, d, count * sizeof(float), g->ranks[0], tag + 1, deadline, err);
    }
    free(tmp);
    return r;
}

static dtr_transport_vtable g_native_vt;

static void rk_native(rank_ctx *rc) {
    dtr_comm *sub = NULL;
    float v[3];
    int i, calls0;
    pthread_mutex_lock(&g_native_mu);
    calls0 = g_native_calls;
    pthread_mutex_unlock(&g_native_mu);
    for (i = 0; i < 3; i++) v[i] = (float)(rc->rank * 10 + i);
    RCHECK_OK(rc, dtr_comm_all_reduce(rc->comm, v, v, 3, DTR_F32, DTR_REDUCE_SUM));
    for (i = 0; i < 3; i++) RCHECK(rc, v[i] == (float)(10 * rc->size * (rc->size - 1) / 2 + rc->size * i));
    /* no native broadcast: built over point-to-point */
    RCHECK_OK(rc, dtr_comm_broadcast(rc->comm, v, 3, DTR_F32, 1));
    RCHECK_OK(rc, dtr_comm_split(rc->comm, rc->rank % 2, 0, &sub));
    if (sub) {
        v[0] = 1.0f;
        RCHECK_OK(rc, dtr_comm_all_reduce(sub, v, v, 1, DTR_F32, DTR_REDUCE_SUM));
        RCHECK(rc, v[0] == (float)dtr_comm_size(sub));
        dtr_comm_destroy(sub);
    }
    RCHECK_OK(rc, dtr_comm_barrier(rc->comm));
    pthread_mutex_lock(&g_native_mu);
    if (*(int *)rc->arg) RCHECK(rc, g_native_calls > calls0);
    else RCHECK(rc, g_native_calls == 0);
    pthread_mutex_unlock(&g_native_mu);
}

static void t_native_transport(void) {
    dtr_comm_config cfg = dtr_comm_config_init();
    int expect;
    memset(&g_native_vt, 0, sizeof g_native_vt);
    g_native_vt.abi_version = DTR_VERSION_NUMBER;
    g_native_vt.name = "local-native";
    g_native_vt.open = nat_open;
    g_native_vt.close = nat_close;
    g_native_vt.isend = nat_isend;
    g_native_vt.irecv = nat_irecv;
    g_native_vt.test = nat_test;
    g_native_vt.wait_any = nat_wait_any;
    g_native_vt.release = nat_release;
    g_native_vt.abort = nat_abort;
    g_native_vt.group_create = nat_group_create;
    g_native_vt.group_destroy = nat_group_destroy;
    g_native_vt.all_reduce = nat_all_reduce;
    cfg.transport_vtable = &g_native_vt;
    cfg.timeout_ms = 20000;
    expect = 1;
    g_native_calls = 0;
    CHECK_EQ_INT(run_ranks(4, &cfg, rk_native, &expect, NULL), 0);
    CHECK_MSG(g_native_calls >= 4 * 2, "native all-reduce called %d times", g_native_calls);
    /* no_native: the same through point-to-point */
    cfg.no_native = 1;
    expect = 0;
    g_native_calls = 0;
    CHECK_EQ_INT(run_ranks(3, &cfg, rk_native, &expect, NULL), 0);
    CHECK_EQ_INT(g_native_calls, 0);
}

/* ---- faults ---- */

typedef struct fault_arg { int culprit; int mode; int sleep_ms; int kind; } fault_arg;
enum { FAULT_HANG = 0, FAULT_LEAVE = 1, FAULT_ABORT = 2, FAULT_ASYNC = 3, FAULT_DEADLOCK = 4 };
static pthread_mutex_t g_fault_mu = PTHREAD_MUTEX_INITIALIZER;
static int g_fault_done;   /* survivors that finished the scenario */

static void rk_fault(rank_ctx *rc) {
    fault_arg *fa = (fault_arg *)rc->arg;
    float buf[4096];
    double t0;
    int i;
    for (i = 0; i < 4096; i++) buf[i] = 1.0f;
    /* a working collective first: everybody is up */
    RCHECK_OK(rc, dtr_comm_barrier(rc->comm));
    t0 = now_s();
    if (rc->rank == fa->culprit) {
        if (fa->mode == FAULT_HANG) {
            /* stops answering until every other rank has given up (at most sleep_ms), then
               comes back too late */
            int waited = 0, done = 0;
            while (waited < fa->sleep_ms && done < rc->size - 1) {
                sleep_ms(10);
                waited += 10;
                pthread_mutex_lock(&g_fault_mu);
                done = g_fault_done;
                pthread_mutex_unlock(&g_fault_mu);
            }
            rc->result = dtr_comm_all_reduce(rc->comm, buf, buf, 4096, DTR_F32, DTR_REDUCE_SUM);
        } else if (fa->mode == FAULT_LEAVE) {
            dtr_comm_destroy(rc->comm);   /* leaves; rank_main's destroy gets NULL */
            rc->comm = NULL;
            rc->result = DTR_PEER_FAILED;
        } else if (fa->mode == FAULT_ABORT) {
            sleep_ms(100);
            dtr_comm_abort(rc->comm, "test abort");
            rc->result = dtr_comm_barrier(rc->comm);   /* broken at once */
        } else if (fa->mode == FAULT_ASYNC) {
            sleep_ms(fa->sleep_ms);
            rc->result = DTR_PEER_FAILED;
        } else {
            rc->result = dtr_comm_recv(rc->comm, buf, 4, (rc->rank + 1) % rc->size, 99);
        }
    } else if (fa->mode == FAULT_ASYNC) {
        dtr_request *q = NULL;
        RCHECK_OK(rc, dtr_comm_all_reduce_async(rc->comm, buf, buf, 4096, DTR_F32, DTR_REDUCE_SUM, &q));
        rc->result = dtr_request_wait(q);
        dtr_request_destroy(q);
    } else if (fa->mode == FAULT_DEADLOCK) {
        rc->result = dtr_comm_recv(rc->comm, buf, 4, (rc->rank + 1) % rc->size, 99);
    } else {
        if (fa->kind == 0) rc->result = dtr_comm_all_reduce(rc->comm, buf, buf, 4096, DTR_F32, DTR_REDUCE_SUM);
        else if (fa->kind == 1) rc->result = dtr_comm_barrier(rc->comm);
        else rc->result = dtr_comm_broadcast(rc->comm, buf, 4096, DTR_F32, 0);
        /* a rank whose part did not need the culprit finishes; its next call fails */
        if (rc->result == DTR_OK) rc->result = dtr_comm_barrier(rc->comm);
    }
    rc->secs = now_s() - t0;
    if (rc->rank != fa->culprit) {
        pthread_mutex_lock(&g_fault_mu);
        g_fault_done++;
        pthread_mutex_unlock(&g_fault_mu);
    }
    if (rc->comm) {
        rc->failed_rank = dtr_comm_failed_rank(rc->comm);
        snprintf(rc->msg, sizeof rc->msg, "%s", dtr_comm_last_error(rc->comm));
        /* the group stays broken */
        if (rc->result != DTR_OK) RCHECK(rc, dtr_comm_barrier(rc->comm) != DTR_OK);
    }
}

/* runs a fault scenario on n ranks and checks every survivor */
static void check_fault(int n, int timeout_ms, fault_arg *fa, double max_secs, const char *what) {
    dtr_comm_config cfg = dtr_comm_config_init();
    rank_ctx rc[8];
    int i;
    cfg.timeout_ms = timeout_ms;
    g_fault_done = 0;
    CHECK_MSG(run_ranks(n, &cfg, rk_fault, fa, rc) == 0, "%s", what);
    for (i = 0; i < n; i++) {
        if (i == fa->culprit && fa->mode != FAULT_DEADLOCK) continue;
        CHECK_MSG(rc[i].result == DTR_TIMEOUT || rc[i].result == DTR_PEER_FAILED, "%s: rank %d got %s", what, i,
                  dtr_result_string(rc[i].result));
        if (fa->mode != FAULT_DEADLOCK) {
            char needle[32];
            CHECK_MSG(rc[i].failed_rank == fa->culprit, "%s: rank %d blames rank %d: %s", what, i, rc[i].failed_rank,
                      rc[i].msg);
            snprintf(needle, sizeof needle, "rank %d", fa->culprit);
            CHECK_MSG(strstr(rc[i].msg, needle) != NULL, "%s: rank %d: message does not name rank %d: %s", what, i,
                      fa->culprit, rc[i].msg);
        }
        CHECK_MSG(rc[i].secs < max_secs, "%s: rank %d took %.2f s (limit %.2f)", what, i, rc[i].secs, max_secs);
    }
    if (fa->mode == FAULT_HANG || fa->mode == FAULT_ABORT)
        CHECK_MSG(rc[fa->culprit].result == DTR_PEER_FAILED, "%s: the culprit got %s", what,
                  dtr_result_string(rc[fa->culprit].result));
}

static void t_fault_hang(void) {
    fault_arg fa;
    int kind;
    memset(&fa, 0, sizeof fa);
    fa.mode = FAULT_HANG;
    fa.sleep_ms = 10000;
    for (kind = 0; kind < 3; kind++) {
        fa.kind = kind;
        fa.culprit = 2;
        /* deadline 500 ms: survivors must be out within the deadline plus scheduling slack */
        check_fault(4, 500, &fa, 1.5, kind == 0 ? "hang, all_reduce" : kind == 1 ? "hang, barrier" : "hang, broadcast");
    }
    fa.kind = 0;
    fa.culprit = 0;
    check_fault(5, 500, &fa, 1.5, "hang, world 5, rank 0");
}

static void t_fault_leave(void) {
    fault_arg fa;
    memset(&fa, 0, sizeof fa);
    fa.mode = FAULT_LEAVE;
    fa.culprit = 1;
    /* a long deadline: leaving must be noticed at once, not at the deadline */
    check_fault(3, 30000, &fa, 5.0, "leave");
    fa.culprit = 3;
    check_fault(4, 30000, &fa, 5.0, "leave, world 4");
}

/* rank 2 leaves at once; ranks 0 and 1 go on with each other (arg: isolation on) */
static void sc_isolate(rank_ctx *rc) {
    int iso = *(const int *)rc->arg, x = 7, y = 0;
    dtr_comm *c = rc->comm;
    RCHECK(rc, dtr_comm_isolates_peer_failures(c) == iso);
    RCHECK(rc, dtr_comm_peer_alive(c, 3) == -1 && dtr_comm_peer_alive(NULL, 0) == -1);
    if (rc->rank == 2) return;
    if (rc->rank == 0) {
        RCHECK(rc, dtr_comm_recv(c, &y, sizeof y, 2, 5) == DTR_PEER_FAILED);
        RCHECK(rc, strstr(dtr_comm_last_error(c), "rank 2") != NULL);
        /* without isolation the world failed: that is no peer's alone */
        RCHECK(rc, dtr_comm_peer_alive(c, 2) == !iso && dtr_comm_peer_alive(c, 1) == 1);
        RCHECK(rc, dtr_comm_status(c) == (iso ? DTR_OK : DTR_PEER_FAILED));
        if (!iso) return;
        RCHECK(rc, dtr_comm_send(c, &x, sizeof x, 2, 5) == DTR_PEER_FAILED);
        RCHECK_OK(rc, dtr_comm_send(c, &x, sizeof x, 1, 6));
        RCHECK_OK(rc, dtr_comm_recv(c, &y, sizeof y, 1, 6));
        RCHECK(rc, y == 8);
    } else {
        dtr_result r = dtr_comm_recv(c, &y, sizeof y, 0, 6);
        RCHECK(rc, r == (iso ? DTR_OK : DTR_PEER_FAILED));
        if (!iso) return;
        y++;
        RCHECK_OK(rc, dtr_comm_send(c, &y, sizeof y, 0, 6));
    }
    RCHECK(rc, dtr_comm_status(c) == DTR_OK);
    RCHECK(rc, dtr_comm_barrier(c) == DTR_PEER_FAILED);   /* collectives still fail as a whole */
}

static void t_isolate(void) {
    dtr_comm_config cfg = dtr_comm_config_init();
    int iso;
    cfg.timeout_ms = 20000;
    for (iso = 1; iso >= 0; iso--) {
        cfg.isolate_peer_failures = iso;
        CHECK_MSG(run_ranks(3, &cfg, sc_isolate, &iso, NULL) == 0, "isolate_peer_failures %d", iso);
    }
}

static void t_fault_abort(void) {
    fault_arg fa;
    memset(&fa, 0, sizeof fa);
    fa.mode = FAULT_ABORT;
    fa.culprit = 0;
    check_fault(3, 30000, &fa, 5.0, "abort");
}

static void t_fault_async(void) {
    fault_arg fa;
    memset(&fa, 0, sizeof fa);
    fa.mode = FAULT_ASYNC;
    fa.culprit = 1;
    fa.sleep_ms = 1000;
    check_fault(2, 400, &fa, 1.4, "async");
    check_fault(3, 400, &fa, 1.4, "async, world 3");
}

static void t_fault_deadlock(void) {
    dtr_comm_config cfg = dtr_comm_config_init();
    fault_arg fa;
    rank_ctx rc[2];
    memset(&fa, 0, sizeof fa);
    fa.mode = FAULT_DEADLOCK;
    fa.culprit = 0;
    cfg.timeout_ms = 300;
    CHECK_EQ_INT(run_ranks(2, &cfg, rk_fault, &fa, rc), 0);
    CHECK(rc[0].result == DTR_TIMEOUT || rc[0].result == DTR_PEER_FAILED);
    CHECK(rc[1].result == DTR_TIMEOUT || rc[1].result == DTR_PEER_FAILED);
    CHECK_MSG(strstr(rc[0].msg, "wait") != NULL || strstr(rc[1].msg, "wait") != NULL, "%s | %s", rc[0].msg, rc[1].msg);
    CHECK(rc[0].secs < 1.5 && rc[1].secs < 1.5);
}

/* ---- the flight recorder ---- */

static pthread_mutex_t g_flight_mu = PTHREAD_MUTEX_INITIALIZER;
static int g_flight_logged[8];   /* per rank: the log got its flight record */

static void flight_log(void *user, dtr_log_level level, const char *msg) {
    int r;
    (void)user;
    if (level != DTR_LOG_ERROR || sscanf(msg, "flight recorder of rank %d", &r) != 1 || r < 0 || r >= 8) return;
    pthread_mutex_lock(&g_flight_mu);
    if (strstr(msg, "all_reduce seq 12") && strstr(msg, "failed")) g_flight_logged[r]++;
    pthread_mutex_unlock(&g_flight_mu);
}

static void rk_flight(rank_ctx *rc) {
    dtr_comm *c = rc->comm;
    dtr_flight_record rec[16];
    float buf[100], x = 1.0f;
    int i, n, next = (rc->rank + 1) % rc->size, prev = (rc->rank + rc->size - 1) % rc->size;
    for (i = 0; i < 100; i++) buf[i] = 1.0f;
    RCHECK(rc, dtr_comm_flight(c, NULL, 0) == 0);
    for (i = 0; i < 10; i++) RCHECK_OK(rc, dtr_comm_all_reduce(c, buf, buf, 100, DTR_F32, DTR_REDUCE_AVG));   /* seq 0-9 */
    RCHECK_OK(rc, dtr_comm_broadcast(c, buf, 50, DTR_F32, 1));                                            /* seq 10 */
    if (rc->rank % 2 == 0) {   /* a ring of send/recv, even ranks send first */
        RCHECK_OK(rc, dtr_comm_send(c, &x, sizeof x, next, 7));
        RCHECK_OK(rc, dtr_comm_recv(c, &x, sizeof x, prev, 7));
    } else {
        RCHECK_OK(rc, dtr_comm_recv(c, &x, sizeof x, prev, 7));
        RCHECK_OK(rc, dtr_comm_send(c, &x, sizeof x, next, 7));
    }
    RCHECK_OK(rc, dtr_comm_barrier(c));                                                                   /* seq 11 */
    /* 14 operations, the ring keeps 8: ids 7..14 */
    RCHECK(rc, dtr_comm_flight(c, NULL, 0) == 8);
    n = dtr_comm_flight(c, rec, 16);
    RCHECK(rc, n == 8);
    for (i = 0; i < n; i++) {
        RCHECK(rc, rec[i].id == (uint64_t)(7 + i));
        RCHECK(rc, rec[i].state == DTR_FLIGHT_DONE && rec[i].result == DTR_OK);
        RCHECK(rc, rec[i].end_ns >= rec[i].start_ns && rec[i].start_ns > 0);
        if (i) RCHECK(rc, rec[i].start_ns >= rec[i - 1].end_ns);
    }
    RCHECK(rc, !strcmp(rec[3].op, "all_reduce") && rec[3].seq == 9 && rec[3].bytes == 400 && rec[3].peer == -1);
    RCHECK(rc, !strcmp(rec[4].op, "broadcast") && rec[4].seq == 10 && rec[4].bytes == 200 && rec[4].peer == 1);
    RCHECK(rc, !strcmp(rec[5].op, rc->rank % 2 ? "recv" : "send") && rec[5].p2p && rec[5].tag == 7 && rec[5].bytes == 4);
    RCHECK(rc, rec[5].peer == (rc->rank % 2 ? prev : next) && rec[6].peer == (rc->rank % 2 ? next : prev));
    RCHECK(rc, !strcmp(rec[7].op, "barrier") && rec[7].seq == 11 && !rec[7].p2p);
    RCHECK(rc, dtr_comm_flight(c, rec, 2) == 2 && rec[0].id == 13 && rec[1].id == 14);   /* the newest 2 */
    /* rank 2 comes too late to all-reduce #12: the others time out, their running record fails */
    RCHECK_OK(rc, dtr_comm_set_timeout(c, 300));
    if (rc->rank == 2) sleep_ms(900);
    rc->result = dtr_comm_all_reduce(c, buf, buf, 100, DTR_F32, DTR_REDUCE_SUM);
    n = dtr_comm_flight(c, rec, 16);
    RCHECK(rc, n == 8 && !strcmp(rec[n - 1].op, "all_reduce") && rec[n - 1].seq == 12);
    RCHECK(rc, rec[n - 1].state == DTR_FLIGHT_FAILED && rec[n - 1].result == rc->result && rc->result != DTR_OK);
    RCHECK(rc, rec[n - 1].end_ns > rec[n - 1].start_ns);
}

static void rk_flight_off(rank_ctx *rc) {
    float v = 1.0f;
    RCHECK_OK(rc, dtr_comm_all_reduce(rc->comm, &v, &v, 1, DTR_F32, DTR_REDUCE_SUM));
    RCHECK(rc, dtr_comm_flight(rc->comm, NULL, 0) == 0);
}

static void t_flight(void) {
    dtr_comm_config cfg = dtr_comm_config_init();
    char dir[512], path[600], err[256];
    rank_ctx rc[3];
    int i;
    if (!make_tmp_dir("dtr_flight", dir, sizeof dir)) { CHECK(0); return; }
    memset(g_flight_logged, 0, sizeof g_flight_logged);
    cfg.timeout_ms = 20000;
    cfg.flight_records = 8;
    cfg.flight_dir = dir;
    cfg.log = flight_log;
    CHECK_EQ_INT(run_ranks(3, &cfg, rk_flight, NULL, rc), 0);
    for (i = 0; i < 3; i++) {
        size_t len = 0;
        char *json;
        FILE *fp;
        snprintf(path, sizeof path, "%s/flight-rank%d.json", dir, i);
        fp = fopen(path, "rb");
        CHECK_MSG(fp != NULL, "no dump %s", path);
        if (!fp) continue;
        json = (char *)calloc(1, 65536);
        len = fread(json, 1, 65535, fp);
        fclose(fp);
        CHECK(len > 0 && json[len - 2] == '}');
        CHECK_MSG(strstr(json, "\"op\": \"all_reduce\", \"seq\": 12") && strstr(json, "\"state\": \"failed\""), "%s", json);
        CHECK(strstr(json, "\"transport\": \"local\"") != NULL);
        if (i != 2) CHECK_MSG(strstr(json, "\"failed_rank\": 2") != NULL, "rank %d: %s", i, json);
        free(json);
        remove(path);
        if (i != 2) CHECK_MSG(g_flight_logged[i] == 1, "rank %d logged its flight record %d times", i, g_flight_logged[i]);
    }
    CHECK(dtr_comm_flight(NULL, NULL, 0) == 0);
    CHECK(dtr_comm_flight_dump(NULL, path, err, sizeof err) == DTR_NULL_HANDLE);
    CHECK(!strcmp(dtr_flight_state_name(DTR_FLIGHT_FAILED), "failed"));
    remove(dir);
    cfg = dtr_comm_config_init();
    cfg.flight_records = -1;
    CHECK_EQ_INT(run_ranks(2, &cfg, rk_flight_off, NULL, NULL), 0);
}

/* The shared-memory collectives over the local transport's threads (shared_memory = 2,
 * here through $DTR_COMM_SHM): a group opens its block without waiting for the other ranks,
 * and every collective test above, splits and the hierarchical all-reduce included, gives
 * the same bits as through the transport. */
static void t_local_shm(void) {
    dtr_comm_config cfg = dtr_comm_config_init();
    dtr_local_world *w = NULL;
    dtr_comm *c = NULL;
    char err[256];
    setenv("DTR_COMM_SHM", "2", 1);
    CHECK_OK(NULL, dtr_local_world_create(2, NULL, &w));
    cfg.local.world = w;
    cfg.local.rank = 0;
    CHECK_OK(NULL, dtr_comm_create(&cfg, &c, err, sizeof err));   /* alone: no collective at creation */
    CHECK(dtr_comm_shared_memory(c) == 1);
    dtr_comm_destroy(c);
    dtr_local_world_destroy(w);
    t_all_reduce();
    t_determinism();
    t_broadcast();
    t_reduce_scatter();
    t_all_gather();
    t_barrier();
    t_split_grid();
    t_hierarchical();
    unsetenv("DTR_COMM_SHM");
}

int main(void) {
    const char *q = getenv("DTR_TEST_QUICK");
    g_quick = q && strcmp(q, "1") == 0;
    alarm(g_quick ? 900 : 300);   /* a hang kills the program (SIGALRM) instead of blocking CI */
    RUN(t_create_errors);
    RUN(t_registered_transport);
    RUN(t_memory_kinds);
    RUN(t_all_reduce);
    RUN(t_determinism);
    RUN(t_broadcast);
    RUN(t_reduce_scatter);
    RUN(t_all_gather);
    RUN(t_barrier);
    RUN(t_send_recv);
    RUN(t_split_grid);
    RUN(t_hierarchical);
    RUN(t_async);
    RUN(t_native_transport);
    RUN(t_fault_hang);
    RUN(t_fault_leave);
    RUN(t_fault_abort);
    RUN(t_isolate);
    RUN(t_fault_async);
    RUN(t_fault_deadlock);
    RUN(t_flight);
    RUN(t_local_shm);
    return test_summary();
}
