/* tests/test_data_loader.c: the loader and the streaming dataset.
 * Batching (sizes, epochs, positions, drop_last, flatten, tensors); sharding for world
 * sizes 1 to 5 (equal batch counts on every rank; shards disjoint and complete when the
 * size divides, complete with wrap-around padding, disjoint with shard_drop_tail); seeded
 * shuffles; prefetch with 1 to 4 threads and several queue depths delivering bit-for-bit
 * the batches of the synchronous path, augmentation included; a restored cursor (taken
 * mid-epoch while prefetch threads run) giving the batches of an uninterrupted run, and
 * cursor validation; augmentation checked against its definition (crop window with zero
 * padding, mirror, normalisation); the cache (no second decode, same batches); bad samples
 * (an error naming the sample, or skip_bad with replacements counted); destroy in the
 * middle of an epoch; token batches; the streaming ring (timeouts honoured, drop_oldest,
 * close and drain, a producer thread racing the trainer); a short training run fed by the
 * loader. DTR_TEST_QUICK=1 shrinks the workloads. */
#define _POSIX_C_SOURCE 200809L
#include "test.h"
#include "posix_util.h"
#include "test_util.h"
#include <pthread.h>
#include <time.h>
#include <unistd.h>

static char g_err[1024];

static int quick(void) {
    const char *q = getenv("DTR_TEST_QUICK");
    return q && q[0] && q[0] != '0';
}

/* ---- datasets for the tests ---- */

/* n samples of (C, H, W): x[i][k] = i + k / 1000, label i % classes. */
typedef struct td_mem {
    float *x;
    int32_t *y;
    dtr_dataset *ds;
} td_mem;

static void td_mem_make(td_mem *m, int64_t n, int C, int H, int W, int classes) {
    dtr_memory_dataset_config c = dtr_memory_dataset_config_init();
    int64_t k, e = (int64_t)C * H * W, i;
    m->x = (float *)malloc((size_t)(n * e + 1) * sizeof(float));
    m->y = (int32_t *)malloc((size_t)(n + 1) * sizeof(int32_t));
    for (i = 0; i < n; i++) {
        for (k = 0; k < e; k++) m->x[i * e + k] = (float)i + (float)k / 1000.0f;
        m->y[i] = (int32_t)(i % classes);
    }
    c.count = n;
    c.layout.x_ndim = 3;
    c.layout.x_shape[0] = C;
    c.layout.x_shape[1] = H;
    c.layout.x_shape[2] = W;
    c.layout.y_dtype = DTR_I32;
    c.layout.num_classes = classes;
    c.x = m->x;
    c.y = m->y;
    m->ds = NULL;
    if (dtr_dataset_from_memory(&c, &m->ds, g_err, sizeof g_err) != DTR_OK) fprintf(stderr, "td_mem_make: %s\n", g_err);
}

static void td_mem_free(td_mem *m) {
    dtr_dataset_destroy(m->ds);
    free(m->x);
    free(m->y);
}

/* A "decoding" dataset through callbacks: counts calls, fails on chosen indices, can be slow. */
typedef struct td_cb {
    pthread_mutex_t mu;
    int64_t calls;
    int fail_mod, fail_rem;   /* index % fail_mod == fail_rem fails (fail_mod 0: never) */
    int fail_all;
    int slow;                 /* busy-work iterations per sample */
    int e;                    /* elements per sample */
    int hold_ms;              /* > 0: the first read of sample `hold` takes this long */
    int64_t hold;
    int64_t reads[64];        /* reads of each sample (indices below 64) */
} td_cb;

static dtr_result td_cb_get(void *user, int64_t index, void *x, void *y, char *err, size_t errlen) {
    td_cb *t = (td_cb *)user;
    volatile float acc = 0.0f;
    int k;
    int64_t seen;
    pthread_mutex_lock(&t->mu);
    t->calls++;
    seen = index < 64 ? t->reads[index]++ : 1;
    pthread_mutex_unlock(&t->mu);
    if (t->hold_ms > 0 && index == t->hold && seen == 0) {
        struct timespec ts = {0, t->hold_ms * 1000000L};
        nanosleep(&ts, NULL);
    }
    for (k = 0; k < t->slow; k++) acc += (float)k;
    (void)acc;
    if (t->fail_all || (t->fail_mod && index % t->fail_mod == t->fail_rem)) {
        snprintf(err, errlen, "cb dataset: sample %lld is broken", (long long)index);
        return DTR_CORRUPT_FILE;
    }
    for (k = 0; k < t->e; k++) ((float *)x)[k] = (float)index * 10.0f + (float)k;
    *(int32_t *)y = (int32_t)(index % 5);
    return DTR_OK;
}

static dtr_dataset *td_cb_make(td_cb *t, int64_t n, int H, int W) {
    dtr_sample_layout L;
    dtr_dataset_callbacks cb;
    dtr_dataset *ds = NULL;
    memset(&L, 0, sizeof L);
    L.x_ndim = 3;
    L.x_shape[0] = 1;
    L.x_shape[1] = H;
    L.x_shape[2] = W;
    L.y_dtype = DTR_I32;
    L.num_classes = 5;
    memset(&cb, 0, sizeof cb);
    cb.user = t;
    cb.get = td_cb_get;
    t->e = H * W;
    pthread_mutex_init(&t->mu, NULL);
    if (dtr_dataset_create(n, &L, &cb, NULL, &ds, g_err, sizeof g_err) != DTR_OK) fprintf(stderr, "td_cb_make: %s\n", g_err);
    return ds;
}

/* ---- recording batches ---- */

typedef struct td_rec {
    int nb;
    float *x;                 /* concatenated x of every batch */
    int32_t *y;
    int64_t *idx;
    int64_t nx, ns;           /* floats and samples so far */
    int64_t ep[1024], pos[1024], size[1024];   /* per batch (at most 1024 batches) */
    int last[1024];
} td_rec;

static void td_rec_init(td_rec *r, int64_t max_samples, int64_t x_numel) {
    memset(r, 0, sizeof *r);
    r->x = (float *)malloc((size_t)(max_samples * x_numel + 1) * sizeof(float));
    r->y = (int32_t *)malloc((size_t)(max_samples + 1) * sizeof(int32_t));
    r->idx = (int64_t *)malloc((size_t)(max_samples + 1) * sizeof(int64_t));
}

static void td_rec_free(td_rec *r) {
    free(r->x);
    free(r->y);
    free(r->idx);
}

/* Takes `nb` batches from l into r. Returns 0 on an error. */
static int td_take(dtr_loader *l, td_rec *r, int nb) {
    int i;
    for (i = 0; i < nb; i++) {
        dtr_batch b;
        int64_t e;
        int d;
        dtr_result res = r->nb < 1024 ? dtr_loader_next(l, &b) : DTR_INVALID_ARGUMENT;
        if (res != DTR_OK) {
            fprintf(stderr, "  td_take: %s: %s\n", dtr_result_string(res), dtr_loader_last_error(l));
            return 0;
        }
        e = 1;
        for (d = 1; d < b.x_ndim; d++) e *= b.x_shape[d];
        memcpy(r->x + r->nx, b.x, (size_t)(b.size * e) * sizeof(float));
        if (b.y) memcpy(r->y + r->ns, b.y, (size_t)b.size * sizeof(int32_t));
        memcpy(r->idx + r->ns, b.indices, (size_t)b.size * sizeof(int64_t));
        r->nx += b.size * e;
        r->ns += b.size;
        r->ep[r->nb] = b.epoch;
        r->pos[r->nb] = b.position;
        r->size[r->nb] = b.size;
        r->last[r->nb] = b.last;
        r->nb++;
    }
    return 1;
}

static int td_same(const td_rec *a, const td_rec *b) {
    int i;
    if (a->nb != b->nb || a->ns != b->ns || a->nx != b->nx) return 0;
    for (i = 0; i < a->nb; i++)
        if (a->ep[i] != b->ep[i] || a->pos[i] != b->pos[i] || a->size[i] != b->size[i]) return 0;
    return memcmp(a->x, b->x, (size_t)a->nx * sizeof(float)) == 0 && memcmp(a->y, b->y, (size_t)a->ns * 4) == 0 &&
           memcmp(a->idx, b->idx, (size_t)a->ns * 8) == 0;
}

/* ---- batching ---- */

static void test_batching(void) {
    td_mem m;
    dtr_loader_config c = dtr_loader_config_init();
    dtr_loader *l = NULL;
    dtr_batch b;
    dtr_context *ctx;
    dtr_tensor *tx, *ty;
    int i;
    td_mem_make(&m, 10, 1, 2, 2, 3);
    c.batch_size = 4;
    CHECK_OK(NULL, dtr_loader_create(m.ds, &c, &l, g_err, sizeof g_err));
    if (!l) return;
    CHECK_EQ_INT(dtr_loader_batches(l), 3);
    for (i = 0; i < 7; i++) {   /* over two epochs */
        CHECK_OK(NULL, dtr_loader_next(l, &b));
        CHECK_EQ_INT(b.epoch, i / 3);
        CHECK_EQ_INT(b.position, i % 3);
        CHECK_EQ_INT(b.last, i % 3 == 2);
        CHECK_EQ_INT(b.size, i % 3 == 2 ? 2 : 4);
        CHECK(b.x_ndim == 4 && b.x_shape[0] == b.size && b.x_shape[1] == 1 && b.x_shape[3] == 2);
        CHECK(b.y_ndim == 1 && b.y_shape[0] == b.size && b.y_dtype == DTR_I32);
        CHECK_EQ_INT(b.indices[0], (i % 3) * 4);   /* no shuffle: in order */
        CHECK(((float *)b.x)[4] == (float)((i % 3) * 4 + 1));
        CHECK_EQ_INT(((int32_t *)b.y)[1], ((i % 3) * 4 + 1) % 3);
    }
    /* as tensors */
    ctx = test_ctx(1);
    CHECK_OK(ctx, dtr_batch_tensors(ctx, &b, &tx, &ty));
    CHECK(tx && ty && dtr_tensor_ndim(tx) == 4 && dtr_tensor_dim(tx, 0) == 4 && dtr_tensor_dtype(ty) == DTR_I32);
    CHECK(dtr_tensor_get(tx, 5) == ((float *)b.x)[5]);
    dtr_context_destroy(ctx);
    dtr_loader_destroy(l);
    /* drop_last, flatten */
    c.drop_last = 1;
    c.flatten = 1;
    CHECK_OK(NULL, dtr_loader_create(m.ds, &c, &l, g_err, sizeof g_err));
    if (l) {
        CHECK_EQ_INT(dtr_loader_batches(l), 2);
        dtr_loader_next(l, &b);
        dtr_loader_next(l, &b);
        CHECK(b.last && b.x_ndim == 2 && b.x_shape[1] == 4);
        dtr_loader_next(l, &b);
        CHECK(b.epoch == 1 && b.position == 0);
        dtr_loader_destroy(l);
    }
    /* bad configurations */
    c = dtr_loader_config_init();
    c.rank = 2;
    c.world = 2;
    CHECK_EQ_INT(dtr_loader_create(m.ds, &c, &l, g_err, sizeof g_err), DTR_INVALID_ARGUMENT);
    CHECK(strstr(g_err, "rank 2 / world 2") != NULL);
    c = dtr_loader_config_init();
    c.batch_size = 11;
    c.drop_last = 1;
    CHECK_EQ_INT(dtr_loader_create(m.ds, &c, &l, g_err, sizeof g_err), DTR_INVALID_ARGUMENT);
    CHECK(strstr(g_err, "no complete batch") != NULL);
    c = dtr_loader_config_init();
    c.augment.norm_count = 3;   /* neither 1, C = 1 nor 4 */
    c.augment.mean = c.augment.std = (const float *)m.x;
    CHECK_EQ_INT(dtr_loader_create(m.ds, &c, &l, g_err, sizeof g_err), DTR_INVALID_ARGUMENT);
    CHECK(strstr(g_err, "norm_count 3") != NULL);
    CHECK(l == NULL);
    td_mem_free(&m);
}

/* ---- sharding ---- */

static void test_sharding(void) {
    static const int64_t sizes[] = {20, 23, 7};
    int world, rank, si, drop;
    for (si = 0; si < 3; si++) {
        int64_t n = sizes[si];
        td_mem m;
        td_mem_make(&m, n, 1, 1, 3, 4);
        for (drop = 0; drop < 2; drop++) {
            for (world = 1; world <= 5; world++) {
                int *seen = (int *)calloc((size_t)n, sizeof(int));
                int64_t nb0 = -1, total = 0, i;
                int ok = 1;
                for (rank = 0; rank < world; rank++) {
                    dtr_loader_config c = dtr_loader_config_init();
                    dtr_loader *l = NULL;
                    int64_t nb, j;
                    c.batch_size = 3;
                    c.shuffle = 1;
                    c.seed = 42;
                    c.rank = rank;
                    c.world = world;
                    c.shard_drop_tail = drop;
                    c.threads = rank % 2;   /* mixed: the sharding must not depend on it */
                    if (dtr_loader_create(m.ds, &c, &l, g_err, sizeof g_err) != DTR_OK) {
                        CHECK_MSG(0, "n %lld world %d rank %d: %s", (long long)n, world, rank, g_err);
                        ok = 0;
                        break;
                    }
                    nb = dtr_loader_batches(l);
                    if (nb0 < 0) nb0 = nb;
                    ok &= nb == nb0;   /* equal batch counts on every rank */
                    for (j = 0; j < nb; j++) {
                        dtr_batch b;
                        int64_t s;
                        if (dtr_loader_next(l, &b) != DTR_OK) { ok = 0; break; }
                        ok &= b.epoch == 0;
                        for (s = 0; s < b.size; s++) {
                            int64_t id = b.indices[s];
                            ok &= id >= 0 && id < n;
                            if (id >= 0 && id < n) seen[id]++;
                            ok &= ((float *)b.x)[s * 3] == (float)id;   /* the sample behind the index */
                            total++;
                        }
                    }
                    dtr_loader_destroy(l);
                }
                if (drop) {   /* disjoint: no sample twice; n % world left out */
                    int64_t covered = 0;
                    for (i = 0; i < n; i++) {
                        ok &= seen[i] <= 1;
                        covered += seen[i];
                    }
                    ok &= covered == n - n % world && total == n - n % world;
                } else {      /* complete: every sample, padding repeats at most one per rank */
                    int64_t per = (n + world - 1) / world;
                    for (i = 0; i < n; i++) ok &= seen[i] >= 1 && seen[i] <= 2;
                    ok &= total == per * world;
                    if (n % world == 0)
                        for (i = 0; i < n; i++) ok &= seen[i] == 1;   /* disjoint too */
                }
                CHECK_MSG(ok, "n %lld world %d drop %d", (long long)n, world, drop);
                free(seen);
            }
        }
        td_mem_free(&m);
    }
}

static void test_shuffle(void) {
    td_mem m;
    dtr_loader_config c = dtr_loader_config_init();
    dtr_loader *a = NULL, *b = NULL;
    td_rec ra, rb;
    int i, same01 = 1, sorted = 1, perm = 1;
    int seen[50] = {0};
    td_mem_make(&m, 50, 1, 1, 1, 2);
    c.batch_size = 50;
    c.shuffle = 1;
    c.seed = 7;
    dtr_loader_create(m.ds, &c, &a, NULL, 0);
    dtr_loader_create(m.ds, &c, &b, NULL, 0);
    td_rec_init(&ra, 200, 1);
    td_rec_init(&rb, 200, 1);
    CHECK(a && b && td_take(a, &ra, 2) && td_take(b, &rb, 2));
    CHECK(td_same(&ra, &rb));   /* the same seed: the same order */
    for (i = 0; i < 50; i++) {
        same01 &= ra.idx[i] == ra.idx[50 + i];
        sorted &= ra.idx[i] == i;
        if (ra.idx[i] >= 0 && ra.idx[i] < 50) seen[ra.idx[i]]++;
    }
    for (i = 0; i < 50; i++) perm &= seen[i] == 1;
    CHECK(!same01 && !sorted && perm);   /* a permutation, new each epoch */
    dtr_loader_destroy(b);
    c.seed = 8;
    dtr_loader_create(m.ds, &c, &b, NULL, 0);
    td_rec_free(&rb);
    td_rec_init(&rb, 200, 1);
    CHECK(b && td_take(b, &rb, 1));
    CHECK(memcmp(ra.idx, rb.idx, 50 * sizeof(int64_t)) != 0);   /* another seed, another order */
    dtr_loader_destroy(a);
    dtr_loader_destroy(b);
    td_rec_free(&ra);
    td_rec_free(&rb);
    td_mem_free(&m);
}

/* ---- prefetch = synchronous, with augmentation ---- */

static void test_prefetch_matches_sync(void) {
    static const float mean[2] = {0.5f, -1.0f}, stdv[2] = {2.0f, 0.25f};
    static const int threads[] = {1, 2, 3, 4}, depth[] = {0, 1, 3, 16};
    td_mem m;
    dtr_loader_config c = dtr_loader_config_init();
    dtr_loader *l = NULL;
    td_rec ref, got;
    int t, nb;
    int64_t n = quick() ? 37 : 1003;
    td_mem_make(&m, n, 2, 6, 5, 7);
    c.batch_size = 8;
    c.shuffle = 1;
    c.seed = 1234;
    c.augment.crop_padding = 2;
    c.augment.hflip = 1;
    c.augment.norm_count = 2;
    c.augment.mean = mean;
    c.augment.std = stdv;
    CHECK_OK(NULL, dtr_loader_create(m.ds, &c, &l, g_err, sizeof g_err));
    if (!l) return;
    nb = (int)(dtr_loader_batches(l) * 3 - 2);   /* nearly three epochs */
    td_rec_init(&ref, nb * 8, 60);
    CHECK(td_take(l, &ref, nb));
    dtr_loader_destroy(l);
    for (t = 0; t < 4; t++) {
        c.threads = threads[t];
        c.prefetch = depth[t];
        l = NULL;
        CHECK_OK(NULL, dtr_loader_create(m.ds, &c, &l, g_err, sizeof g_err));
        if (!l) continue;
        td_rec_init(&got, nb * 8, 60);
        CHECK(td_take(l, &got, nb));
        CHECK_MSG(td_same(&ref, &got), "threads %d prefetch %d", threads[t], depth[t]);
        td_rec_free(&got);
        dtr_loader_destroy(l);
    }
    td_rec_free(&ref);
    td_mem_free(&m);
}

/* ---- cursor ---- */

static void test_cursor_restore(void) {
    static const float mean[1] = {3.0f}, stdv[1] = {0.5f};
    td_mem m;
    dtr_loader_config c = dtr_loader_config_init();
    dtr_loader *l = NULL;
    dtr_loader_cursor cur, saved;
    td_rec ref, a, b;
    int nb, cut, ok;
    td_mem_make(&m, 45, 1, 4, 4, 3);
    c.batch_size = 4;
    c.shuffle = 1;
    c.seed = 99;
    c.rank = 1;
    c.world = 2;
    c.augment.crop_padding = 1;
    c.augment.hflip = 1;
    c.augment.norm_count = 1;
    c.augment.mean = mean;
    c.augment.std = stdv;
    CHECK_OK(NULL, dtr_loader_create(m.ds, &c, &l, g_err, sizeof g_err));
    if (!l) return;
    nb = (int)(dtr_loader_batches(l) * 5 / 2);   /* 2.5 epochs uninterrupted */
    td_rec_init(&ref, nb * 4, 16);
    CHECK(td_take(l, &ref, nb));
    dtr_loader_destroy(l);
    /* interrupted at every possible point: prefetch threads running, destroyed mid-epoch,
     * a new loader (another thread count) continues from the saved cursor */
    for (cut = 1; cut < nb; cut += quick() ? 5 : 1) {
        c.threads = 2;
        c.prefetch = 4;
        l = NULL;
        dtr_loader_create(m.ds, &c, &l, NULL, 0);
        td_rec_init(&a, nb * 4, 16);
        ok = l && td_take(l, &a, cut);
        dtr_loader_get_cursor(l, &saved);
        memcpy(&cur, &saved, sizeof cur);   /* a checkpoint stores the bytes */
        dtr_loader_destroy(l);
        c.threads = cut % 3;
        l = NULL;
        dtr_loader_create(m.ds, &c, &l, NULL, 0);
        ok = ok && l && dtr_loader_set_cursor(l, &cur) == DTR_OK && td_take(l, &a, nb - cut);
        CHECK_MSG(ok && td_same(&ref, &a), "cut after %d batches (epoch %lld position %lld)", cut,
                  (long long)cur.epoch, (long long)cur.position);
        dtr_loader_destroy(l);
        td_rec_free(&a);
    }
    CHECK_EQ_INT(sizeof(dtr_loader_cursor), 64);
    /* set_cursor on a running loader rewinds it, also with threads; and adopts the seed */
    c.threads = 3;
    l = NULL;
    dtr_loader_create(m.ds, &c, &l, NULL, 0);
    if (l) {
        td_rec_init(&b, nb * 4, 16);
        td_take(l, &b, 3);
        dtr_loader_get_cursor(l, &cur);
        CHECK(cur.magic == DTR_LOADER_CURSOR_MAGIC && cur.epoch == 0 && cur.position == 3 && cur.seed == 99 &&
              cur.count == 45 && cur.batch_size == 4 && cur.world == 2 && cur.rank == 1);
        cur.position = 0;
        CHECK_OK(NULL, dtr_loader_set_cursor(l, &cur));
        td_rec_free(&b);
        td_rec_init(&b, nb * 4, 16);
        CHECK(td_take(l, &b, nb));
        CHECK(td_same(&ref, &b));
        /* validation */
        cur.count = 44;
        CHECK_EQ_INT(dtr_loader_set_cursor(l, &cur), DTR_INVALID_ARGUMENT);
        CHECK(strstr(dtr_loader_last_error(l), "45") != NULL);
        cur.count = 45;
        cur.position = 2;
        cur.batch_size = 8;
        CHECK_EQ_INT(dtr_loader_set_cursor(l, &cur), DTR_INVALID_ARGUMENT);
        CHECK(strstr(dtr_loader_last_error(l), "batch size") != NULL);
        cur.position = 0;   /* at an epoch boundary the batch size may change */
        CHECK_EQ_INT(dtr_loader_set_cursor(l, &cur), DTR_OK);
        cur.position = 1000;
        CHECK_EQ_INT(dtr_loader_set_cursor(l, &cur), DTR_INVALID_ARGUMENT);
        cur.position = 0;
        cur.magic = 1;
        CHECK_EQ_INT(dtr_loader_set_cursor(l, &cur), DTR_INVALID_ARGUMENT);
        /* a different seed changes the batches */
        dtr_loader_get_cursor(l, &cur);
        cur.seed = 100;
        cur.epoch = 0;
        cur.position = 0;
        CHECK_OK(NULL, dtr_loader_set_cursor(l, &cur));
        td_rec_free(&b);
        td_rec_init(&b, nb * 4, 16);
        td_take(l, &b, 2);
        CHECK(memcmp(b.idx, ref.idx, 8 * sizeof(int64_t)) != 0);
        td_rec_free(&b);
        dtr_loader_destroy(l);
    }
    td_rec_free(&ref);
    td_mem_free(&m);
}

/* ---- augmentation against its definition ---- */

/* 1 when every output of the batch is a crop (shift within +-P, zero outside) of its
 * input, possibly mirrored; counts flips and non-zero shifts. */
static int td_check_crops(const td_mem *m, const dtr_batch *b, int H, int W, int P, int *flips, int *shifts) {
    int64_t s;
    int ok = 1;
    for (s = 0; s < b->size; s++) {   /* find the (dy, dx, flip) that explains each output */
        const float *src = m->x + b->indices[s] * 3 * H * W, *out = (const float *)b->x + s * 3 * H * W;
        int dy, dx, f, found = 0;
        for (f = 0; f < 2 && !found; f++)
            for (dy = -P; dy <= P && !found; dy++)
                for (dx = -P; dx <= P && !found; dx++) {
                    int ch, y, x, match = 1;
                    for (ch = 0; ch < 3 && match; ch++)
                        for (y = 0; y < H && match; y++)
                            for (x = 0; x < W && match; x++) {
                                int sy = y + dy, sx = (f ? W - 1 - x : x) + dx;
                                float want = (sy >= 0 && sy < H && sx >= 0 && sx < W) ? src[(ch * H + sy) * W + sx] : 0.0f;
                                match = out[(ch * H + y) * W + x] == want;
                            }
                    if (match) {
                        found = 1;
                        *flips += f;
                        *shifts += dy != 0 || dx != 0;
                    }
                }
        ok &= found;
    }
    return ok;
}

static void test_augment_values(void) {
    static const float mean[3] = {0.1f, 0.2f, 0.3f}, stdv[3] = {0.5f, 2.0f, 4.0f};
    td_mem m;
    dtr_loader_config c = dtr_loader_config_init();
    dtr_loader *l = NULL;
    dtr_batch b;
    int64_t s, k;
    int H = 5, W = 7, P = 2, flips = 0, shifts = 0, ok = 1;
    td_mem_make(&m, 64, 3, H, W, 2);
    c.batch_size = 64;
    c.augment.crop_padding = P;
    c.augment.hflip = 1;
    CHECK_OK(NULL, dtr_loader_create(m.ds, &c, &l, g_err, sizeof g_err));
    if (!l) return;
    dtr_loader_next(l, &b);
    CHECK(td_check_crops(&m, &b, H, W, P, &flips, &shifts));
    CHECK(flips > 10 && flips < 54 && shifts > 40);   /* both kinds happen, at random */
    dtr_loader_destroy(l);
    /* padding wider than the image (many windows are all zeros), from prefetch threads */
    c.augment.crop_padding = 9;
    c.threads = 2;
    CHECK_OK(NULL, dtr_loader_create(m.ds, &c, &l, g_err, sizeof g_err));
    if (!l) return;
    dtr_loader_next(l, &b);
    flips = shifts = 0;
    CHECK(td_check_crops(&m, &b, H, W, 9, &flips, &shifts));
    dtr_loader_destroy(l);
    /* normalisation per channel: exact */
    c = dtr_loader_config_init();
    c.batch_size = 4;
    c.augment.norm_count = 3;
    c.augment.mean = mean;
    c.augment.std = stdv;
    CHECK_OK(NULL, dtr_loader_create(m.ds, &c, &l, g_err, sizeof g_err));
    if (!l) return;
    dtr_loader_next(l, &b);
    for (s = 0; s < 4; s++)
        for (k = 0; k < 3 * H * W; k++) {
            int ch = (int)(k / (H * W));
            ok &= ((float *)b.x)[s * 3 * H * W + k] == (m.x[s * 3 * H * W + k] - mean[ch]) / stdv[ch];
        }
    CHECK(ok);
    dtr_loader_destroy(l);
    /* crop and flip need (.., H, W) f32 samples */
    {
        dtr_csv_config cc = dtr_csv_config_init();
        dtr_dataset *csv = NULL;
        dtr_dataset_csv_from_buffer("a,b\n1,0\n2,1\n", 12, &cc, &csv, NULL, 0);
        c = dtr_loader_config_init();
        c.augment.hflip = 1;
        CHECK_EQ_INT(dtr_loader_create(csv, &c, &l, g_err, sizeof g_err), DTR_INVALID_ARGUMENT);
        CHECK(strstr(g_err, "crop and flip need") != NULL);
        dtr_dataset_destroy(csv);
    }
    td_mem_free(&m);
}

/* ---- cache ---- */

static void test_cache(void) {
    td_cb t;
    dtr_dataset *ds;
    dtr_loader_config c = dtr_loader_config_init();
    dtr_loader *l = NULL, *ref = NULL;
    dtr_loader_stats st;
    td_rec a, r;
    int64_t calls;
    memset(&t, 0, sizeof t);
    ds = td_cb_make(&t, 30, 3, 3);
    if (!ds) return;
    c.batch_size = 7;
    c.shuffle = 1;
    c.augment.hflip = 1;
    c.threads = 2;
    dtr_loader_create(ds, &c, &ref, NULL, 0);
    c.cache_bytes = 1 << 20;
    CHECK_OK(NULL, dtr_loader_create(ds, &c, &l, g_err, sizeof g_err));
    if (!l || !ref) return;
    td_rec_init(&a, 400, 9);
    td_rec_init(&r, 400, 9);
    CHECK(td_take(ref, &r, 15) && td_take(l, &a, 15));   /* three epochs of 5 batches */
    CHECK(td_same(&r, &a));
    dtr_loader_destroy(ref);
    pthread_mutex_lock(&t.mu);
    calls = t.calls;
    pthread_mutex_unlock(&t.mu);
    dtr_loader_get_stats(l, &st);
    /* the reference loader read 3 epochs (90) plus prefetch; the cached one only epoch 0, and
       epochs 1 and 2 (60 samples) from the cache: a sample asked for by one prefetch thread
       while the other still loads it for epoch 0 waits for that load, never reads it again */
    CHECK_MSG(st.cache_hits == 60, "cache hits %lld", (long long)st.cache_hits);
    CHECK_MSG(calls >= 90 + 30 && calls <= 90 + 30 + 4 * 7 + 7, "calls %lld", (long long)calls);
    dtr_loader_destroy(l);
    /* without threads nothing is in flight: exactly epochs 1 and 2 from the cache */
    c.threads = 0;
    dtr_loader_create(ds, &c, &l, NULL, 0);
    if (l) {
        td_rec_free(&a);
        td_rec_init(&a, 400, 9);
        CHECK(td_take(l, &a, 15) && td_same(&r, &a));
        dtr_loader_get_stats(l, &st);
        CHECK_MSG(st.cache_hits == 60, "cache hits without threads %lld", (long long)st.cache_hits);
        dtr_loader_destroy(l);
    }
    /* a cache too small for everything keeps the first samples only */
    c.cache_bytes = 10 * (9 + 1) * 4;
    dtr_loader_create(ds, &c, &l, NULL, 0);
    if (l) {
        td_rec_free(&a);
        td_rec_init(&a, 400, 9);
        td_take(l, &a, 10);
        dtr_loader_get_stats(l, &st);
        CHECK_EQ_INT(st.cache_hits, 10);
        dtr_loader_destroy(l);
    }
    td_rec_free(&a);
    td_rec_free(&r);
    dtr_dataset_destroy(ds);
    pthread_mutex_destroy(&t.mu);
}

/* A sample asked for while another thread reads it into the cache waits for that read: 7
 * samples, batches of 7 (every epoch one batch of all of them), two prefetch threads. The
 * first read of sample 3 takes 100 ms, so the thread that prefetches epoch 1 asks for it while
 * the one of epoch 0 still reads it (and takes the samples after it that are not claimed yet).
 * Every sample is read once in 4 epochs; the batches equal an uncached loader's. */
static void test_cache_in_flight(void) {
    td_cb t;
    dtr_dataset *ds;
    dtr_loader_config c = dtr_loader_config_init();
    dtr_loader *l = NULL, *ref = NULL;
    dtr_loader_stats st;
    td_rec a, r;
    int i;
    memset(&t, 0, sizeof t);
    if (!(ds = td_cb_make(&t, 7, 2, 2))) return;
    c.batch_size = 7;
    c.shuffle = 1;
    c.threads = 0;
    td_rec_init(&a, 40, 4);
    td_rec_init(&r, 40, 4);
    CHECK_OK(NULL, dtr_loader_create(ds, &c, &ref, g_err, sizeof g_err));
    CHECK(ref && td_take(ref, &r, 4));
    dtr_loader_destroy(ref);
    memset(t.reads, 0, sizeof t.reads);
    t.hold = 3;
    t.hold_ms = 100;
    c.threads = 2;
    c.cache_bytes = 1 << 16;
    CHECK_OK(NULL, dtr_loader_create(ds, &c, &l, g_err, sizeof g_err));
    CHECK(l && td_take(l, &a, 4) && td_same(&r, &a));
    dtr_loader_get_stats(l, &st);
    CHECK_MSG(st.cache_hits == 4 * 7 - 7, "cache hits %lld", (long long)st.cache_hits);   /* every sample read once */
    dtr_loader_destroy(l);   /* (its prefetch of later epochs reads from the cache too) */
    for (i = 0; i < 7; i++) CHECK_MSG(t.reads[i] == 1, "sample %d read %lld times", i, (long long)t.reads[i]);
    td_rec_free(&a);
    td_rec_free(&r);
    dtr_dataset_destroy(ds);
    pthread_mutex_destroy(&t.mu);
}

/* ---- bad samples ---- */

/* An allocator that fails from the n-th allocation on (n < 0: never), counting live blocks. */
typedef struct td_oom {
    int n, done, live;
} td_oom;
static void *td_oom_malloc(size_t bytes, void *user) {
    td_oom *o = (td_oom *)user;
    void *p = o->n >= 0 && o->done >= o->n ? NULL : malloc(bytes);
    o->done++;
    o->live += p != NULL;
    return p;
}
static void *td_oom_realloc(void *p, size_t bytes, void *user) {
    td_oom *o = (td_oom *)user;
    void *q = o->n >= 0 && o->done >= o->n ? NULL : realloc(p, bytes);
    o->done++;
    o->live += !p && q;
    return q;
}
static void td_oom_free(void *p, void *user) {
    ((td_oom *)user)->live -= p != NULL;
    free(p);
}

/* Every allocation of dtr_loader_create failing in turn (with prefetch threads, the cache and
 * augmentation: every part of it): DTR_OUT_OF_MEMORY with a message and nothing left
 * allocated, until enough succeed; the loader made then gives the batches of one made with
 * the C library's allocator. */
static void test_create_out_of_memory(void) {
    td_cb t;
    dtr_dataset *ds;
    dtr_loader_config c = dtr_loader_config_init();
    dtr_loader *l = NULL, *ref = NULL;
    td_oom o = {0, 0, 0};
    td_rec a, r;
    int n, made = 0;
    memset(&t, 0, sizeof t);
    if (!(ds = td_cb_make(&t, 30, 3, 3))) return;
    c.batch_size = 7, c.shuffle = 1, c.threads = 2, c.augment.hflip = 1, c.cache_bytes = 1 << 20;
    CHECK_OK(NULL, dtr_loader_create(ds, &c, &ref, g_err, sizeof g_err));
    c.alloc.user = &o, c.alloc.malloc_fn = td_oom_malloc, c.alloc.realloc_fn = td_oom_realloc, c.alloc.free_fn = td_oom_free;
    for (n = 0; n < 200 && !made; n++) {
        dtr_result res;
        o.n = n, o.done = 0, o.live = 0;
        g_err[0] = '\0';
        res = dtr_loader_create(ds, &c, &l, g_err, sizeof g_err);
        made = res == DTR_OK;
        CHECK_MSG(made || (res == DTR_OUT_OF_MEMORY && l == NULL && strstr(g_err, "loader") && o.live == 0),
                  "allocation %d failing: %s (%s), %d blocks left", n, dtr_result_string(res), g_err, o.live);
    }
    CHECK_MSG(made && n > 5, "created after %d allocations", n);
    if (made && ref) {
        td_rec_init(&a, 400, 9);
        td_rec_init(&r, 400, 9);
        CHECK(td_take(ref, &r, 10) && td_take(l, &a, 10) && td_same(&r, &a));
        td_rec_free(&a);
        td_rec_free(&r);
    }
    dtr_loader_destroy(l);
    CHECK_EQ_INT(o.live, 0);
    dtr_loader_destroy(ref);
    dtr_dataset_destroy(ds);
    pthread_mutex_destroy(&t.mu);
}

static void test_bad_samples(void) {
    td_cb t;
    dtr_dataset *ds;
    dtr_loader_config c = dtr_loader_config_init();
    dtr_loader *l = NULL;
    dtr_loader_stats st;
    dtr_batch b;
    int th, i, ok;
    memset(&t, 0, sizeof t);
    t.fail_mod = 7;
    t.fail_rem = 3;
    ds = td_cb_make(&t, 20, 1, 2);
    if (!ds) return;
    for (th = 0; th < 3; th += 2) {
        /* default: the batch with sample 3 fails, names it, and the loader goes on */
        c = dtr_loader_config_init();
        c.batch_size = 5;
        c.threads = th;
        CHECK_OK(NULL, dtr_loader_create(ds, &c, &l, g_err, sizeof g_err));
        if (!l) continue;
        CHECK_EQ_INT(dtr_loader_next(l, &b), DTR_CORRUPT_FILE);
        CHECK_MSG(strstr(dtr_loader_last_error(l), "batch 0 of epoch 0: cb dataset: sample 3 is broken") != NULL, "%s",
                  dtr_loader_last_error(l));
        CHECK_EQ_INT(dtr_loader_next(l, &b), DTR_OK);   /* samples 5..9 */
        CHECK(b.position == 1 && b.size == 5);
        CHECK_EQ_INT(dtr_loader_next(l, &b), DTR_CORRUPT_FILE);
        CHECK(strstr(dtr_loader_last_error(l), "batch 2 of epoch 0: cb dataset: sample 10 is broken") != NULL);
        dtr_loader_destroy(l);
        /* skip_bad: replaced by the next index, counted */
        c.skip_bad = 1;
        CHECK_OK(NULL, dtr_loader_create(ds, &c, &l, g_err, sizeof g_err));
        if (!l) continue;
        ok = 1;
        for (i = 0; i < 8; i++) {   /* two epochs */
            int s;
            ok &= dtr_loader_next(l, &b) == DTR_OK && b.size == 5;
            for (s = 0; s < 5 && ok; s++) {
                int64_t want = i % 4 * 5 + s;
                if (want % 7 == 3) want++;
                ok &= b.indices[s] == want && ((float *)b.x)[0 + s * 2] == (float)want * 10.0f;
            }
        }
        CHECK(ok);
        dtr_loader_get_stats(l, &st);
        CHECK_EQ_INT(st.skipped, 6);   /* 3, 10, 17 per epoch */
        CHECK_MSG(strstr(st.last_bad, "sample 17 is broken") != NULL, "%s", st.last_bad);
        dtr_loader_destroy(l);
    }
    /* everything broken: skip_bad gives up after a while, with a message */
    t.fail_all = 1;
    c.threads = 1;
    CHECK_OK(NULL, dtr_loader_create(ds, &c, &l, g_err, sizeof g_err));
    if (l) {
        CHECK_EQ_INT(dtr_loader_next(l, &b), DTR_CORRUPT_FILE);
        CHECK_MSG(strstr(dtr_loader_last_error(l), "samples in a row") != NULL, "%s", dtr_loader_last_error(l));
        dtr_loader_destroy(l);
    }
    dtr_dataset_destroy(ds);
    pthread_mutex_destroy(&t.mu);
}

/* ---- destroy while the threads work ---- */

static void test_destroy_midway(void) {
    td_cb t;
    dtr_dataset *ds;
    dtr_loader_config c = dtr_loader_config_init();
    dtr_loader *l = NULL;
    dtr_batch b;
    int k;
    memset(&t, 0, sizeof t);
    t.slow = 20000;
    ds = td_cb_make(&t, 500, 8, 8);
    if (!ds) return;
    c.batch_size = 16;
    c.threads = 4;
    c.prefetch = 8;
    c.shuffle = 1;
    for (k = 0; k < 3; k++) {
        CHECK_OK(NULL, dtr_loader_create(ds, &c, &l, g_err, sizeof g_err));
        if (!l) break;
        if (k > 0) CHECK_OK(NULL, dtr_loader_next(l, &b));
        if (k > 1) CHECK_OK(NULL, dtr_loader_next(l, &b));
        dtr_loader_destroy(l);   /* joins threads in the middle of batches */
    }
    dtr_dataset_destroy(ds);
    pthread_mutex_destroy(&t.mu);
}

/* ---- tokens through the loader ---- */

static void test_token_batches(void) {
    char path[512];
    unsigned char buf[2 * 101];
    dtr_token_file_config tc = dtr_token_file_config_init();
    dtr_loader_config c = dtr_loader_config_init();
    dtr_dataset *ds = NULL;
    dtr_loader *l = NULL;
    dtr_batch b;
    FILE *f;
    int i, ok = 1;
    tmp_path("dtr_tokens", "tokens.bin", path, sizeof path);
    for (i = 0; i < 101; i++) {
        buf[2 * i] = (unsigned char)(i * 3);
        buf[2 * i + 1] = 0;
    }
    f = fopen(path, "wb");
    CHECK(f && fwrite(buf, 1, sizeof buf, f) == sizeof buf);
    if (f) fclose(f);
    tc.path = path;
    tc.context = 10;
    CHECK_OK(NULL, dtr_dataset_open_tokens(&tc, &ds, g_err, sizeof g_err));
    c.batch_size = 4;
    c.shuffle = 1;
    c.threads = 2;
    CHECK_OK(NULL, dtr_loader_create(ds, &c, &l, g_err, sizeof g_err));
    if (l) {
        CHECK_EQ_INT(dtr_loader_batches(l), 3);   /* 10 windows */
        CHECK_OK(NULL, dtr_loader_next(l, &b));
        CHECK(b.x_dtype == DTR_I32 && b.y_dtype == DTR_I32 && b.x_ndim == 2 && b.x_shape[1] == 10 && b.y_shape[1] == 10);
        for (i = 0; i < 4 * 10; i++) {
            int64_t s = i / 10, t = i % 10, start = b.indices[s] * 10;
            ok &= ((int32_t *)b.x)[i] == (int32_t)(((start + t) * 3) & 255) &&
                  ((int32_t *)b.y)[i] == (int32_t)(((start + t + 1) * 3) & 255);
        }
        CHECK(ok);
        dtr_loader_destroy(l);
    }
    dtr_dataset_destroy(ds);
    remove(path);
}

/* ---- streaming ---- */

static dtr_feed *td_stream(int64_t cap, int64_t max_batch, int drop) {
    dtr_feed_config c = dtr_feed_config_init();
    dtr_feed *s = NULL;
    c.layout.x_ndim = 1;
    c.layout.x_shape[0] = 2;
    c.layout.y_dtype = DTR_F32;
    c.capacity = cap;
    c.max_batch = max_batch;
    c.drop_oldest = drop;
    if (dtr_feed_create(&c, &s, g_err, sizeof g_err) != DTR_OK) fprintf(stderr, "td_stream: %s\n", g_err);
    return s;
}

static void test_stream_basic(void) {
    dtr_feed *s = td_stream(4, 3, 0);
    dtr_feed_stats st;
    dtr_batch b;
    float x[12], y[6];
    int64_t pushed;
    double t0, dt;
    int i;
    if (!s) return;
    for (i = 0; i < 12; i++) x[i] = (float)i;
    for (i = 0; i < 6; i++) y[i] = -(float)i;
    /* empty: next times out at once, or after about the time asked */
    CHECK_EQ_INT(dtr_feed_next(s, 3, 1, 0, &b), DTR_TIMEOUT);
    t0 = now_s();
    CHECK_EQ_INT(dtr_feed_next(s, 3, 1, 60, &b), DTR_TIMEOUT);
    dt = now_s() - t0;
    CHECK_MSG(dt >= 0.05 && dt < 0.5, "waited %.3f s for a 60 ms timeout", dt);
    /* push 6 into 4 with timeout 0: 4 go in, DTR_TIMEOUT at once */
    t0 = now_s();
    CHECK_EQ_INT(dtr_feed_push(s, x, y, 6, 0, &pushed), DTR_TIMEOUT);
    CHECK(now_s() - t0 < 0.05);
    CHECK_EQ_INT(pushed, 4);
    t0 = now_s();
    CHECK_EQ_INT(dtr_feed_push(s, x + 8, y + 4, 2, 40, &pushed), DTR_TIMEOUT);
    dt = now_s() - t0;
    CHECK_MSG(dt >= 0.03 && dt < 0.5, "push waited %.3f s for a 40 ms timeout", dt);
    CHECK_EQ_INT(pushed, 0);
    /* min_size larger than what is there: timeout; then a batch of up to max_batch (3) */
    CHECK_OK(NULL, dtr_feed_next(s, 10, 2, 0, &b));
    CHECK(b.size == 3 && b.x_ndim == 2 && b.x_shape[0] == 3 && b.x_shape[1] == 2 && b.y_ndim == 1);
    CHECK(((float *)b.x)[5] == 5.0f && ((float *)b.y)[2] == -2.0f && b.indices[2] == 2 && b.position == 0);
    CHECK_EQ_INT(dtr_feed_next(s, 3, 2, 0, &b), DTR_TIMEOUT);   /* one left */
    CHECK_OK(NULL, dtr_feed_push(s, x + 8, y + 4, 2, 0, &pushed));
    CHECK_OK(NULL, dtr_feed_next(s, 3, 3, 0, &b));
    CHECK(b.size == 3 && ((float *)b.x)[0] == 6.0f && ((float *)b.x)[4] == 10.0f && b.indices[2] == 5 && b.position == 1);
    dtr_feed_get_stats(s, &st);
    CHECK(st.pushed == 6 && st.popped == 6 && st.size == 0 && st.dropped == 0 && st.timeouts == 2);
    /* close: pushes refused, the rest drains, then the end */
    CHECK_OK(NULL, dtr_feed_push(s, x, y, 1, 0, NULL));
    dtr_feed_end(s);
    CHECK_EQ_INT(dtr_feed_push(s, x, y, 1, 0, NULL), DTR_BAD_STATE);
    CHECK_OK(NULL, dtr_feed_next(s, 3, 3, -1, &b));
    CHECK_EQ_INT(b.size, 1);
    CHECK_EQ_INT(dtr_feed_next(s, 3, 1, -1, &b), DTR_BAD_STATE);
    dtr_feed_destroy(s);
    /* drop_oldest: never blocks, keeps the newest */
    s = td_stream(4, 4, 1);
    if (!s) return;
    CHECK_OK(NULL, dtr_feed_push(s, x, y, 6, 0, &pushed));
    CHECK_EQ_INT(pushed, 6);
    CHECK_OK(NULL, dtr_feed_next(s, 4, 4, 0, &b));
    CHECK(b.size == 4 && b.indices[0] == 2 && ((float *)b.x)[0] == 4.0f);
    dtr_feed_get_stats(s, &st);
    CHECK_EQ_INT(st.dropped, 2);
    dtr_feed_destroy(s);
}

typedef struct td_prod {
    dtr_feed *s;
    int n;
    int64_t timeouts;
} td_prod;

static void *td_producer(void *arg) {
    td_prod *p = (td_prod *)arg;
    int i;
    for (i = 0; i < p->n; i++) {
        float x[2] = {(float)i, (float)(2 * i)}, y = (float)(3 * i);
        while (dtr_feed_push(p->s, x, &y, 1, 5, NULL) == DTR_TIMEOUT) p->timeouts++;
    }
    dtr_feed_end(p->s);
    return NULL;
}

static void test_stream_threads(void) {
    td_prod p;
    pthread_t th;
    dtr_batch b;
    int64_t got = 0;
    int ok = 1;
    dtr_result r;
    p.s = td_stream(16, 8, 0);
    p.n = quick() ? 2000 : 20000;
    p.timeouts = 0;
    if (!p.s) return;
    CHECK(pthread_create(&th, NULL, td_producer, &p) == 0);
    while ((r = dtr_feed_next(p.s, 8, 4, 100, &b)) != DTR_BAD_STATE) {
        int64_t i;
        if (r == DTR_TIMEOUT) continue;
        for (i = 0; i < b.size; i++) {   /* in order, nothing lost */
            ok &= b.indices[i] == got && ((float *)b.x)[2 * i + 1] == (float)(2 * got) && ((float *)b.y)[i] == (float)(3 * got);
            got++;
        }
    }
    pthread_join(th, NULL);
    CHECK(ok);
    CHECK_EQ_INT(got, p.n);
    dtr_feed_destroy(p.s);
}

/* ---- the trainer fed by the loader ---- */

static void test_train_from_loader(void) {
    /* two well separated classes in 4-D; a linear model must fit them */
    int64_t n = 256, i, k;
    float *x = (float *)malloc((size_t)n * 4 * sizeof(float));
    int32_t *y = (int32_t *)malloc((size_t)n * sizeof(int32_t));
    dtr_memory_dataset_config mc = dtr_memory_dataset_config_init();
    dtr_loader_config c = dtr_loader_config_init();
    dtr_optimizer_config oc = dtr_optimizer_config_init(DTR_OPT_SGD, 0.1f);
    dtr_dataset *ds = NULL;
    dtr_loader *l = NULL;
    dtr_context *ctx = test_ctx(1);
    dtr_model *model = NULL;
    dtr_linear_layer fc;
    dtr_optimizer *opt = NULL;
    dtr_rng rng;
    float first = 0.0f, last = 0.0f;
    int step;
    dtr_rng_seed(&rng, 5, 0);
    for (i = 0; i < n; i++) {
        y[i] = (int32_t)(i & 1);
        for (k = 0; k < 4; k++) x[i * 4 + k] = dtr_rng_normal(&rng) * 0.5f + (y[i] ? 1.0f : -1.0f) * (k == 2 ? 2.0f : 0.0f);
    }
    mc.count = n;
    mc.layout.x_ndim = 1;
    mc.layout.x_shape[0] = 4;
    mc.layout.y_dtype = DTR_I32;
    mc.layout.num_classes = 2;
    mc.x = x;
    mc.y = y;
    mc.copy = 1;
    CHECK_OK(NULL, dtr_dataset_from_memory(&mc, &ds, g_err, sizeof g_err));
    free(x);
    free(y);
    c.batch_size = 32;
    c.shuffle = 1;
    c.threads = 2;
    CHECK_OK(NULL, dtr_loader_create(ds, &c, &l, g_err, sizeof g_err));
    CHECK_OK(ctx, dtr_model_create(ctx, 1, &model));
    CHECK_OK(ctx, dtr_linear_layer_init(&fc, model, "fc", 4, 2, 1, DTR_INIT_TORCH_DEFAULT));
    CHECK_OK(ctx, dtr_optimizer_create(model, &oc, &opt));
    for (step = 0; l && opt && step < 80; step++) {
        dtr_batch b;
        dtr_tensor *tx, *ty, *loss;
        if (dtr_loader_next(l, &b) != DTR_OK || dtr_batch_tensors(ctx, &b, &tx, &ty) != DTR_OK) break;
        loss = dtr_cross_entropy(ctx, dtr_linear_layer_forward(ctx, &fc, tx), ty);
        if (!loss || dtr_backward(ctx, loss) != DTR_OK) break;
        if (step == 0) first = dtr_tensor_get(loss, 0);
        last = dtr_tensor_get(loss, 0);
        dtr_optimizer_step(opt, NULL);
        dtr_context_reset(ctx);
    }
    CHECK_EQ_INT(step, 80);
    CHECK_MSG(last < 0.3f * first, "loss %g -> %g", (double)first, (double)last);
    dtr_optimizer_destroy(opt);
    dtr_model_destroy(model);
    dtr_context_destroy(ctx);
    dtr_loader_destroy(l);
    dtr_dataset_destroy(ds);
}

int main(void) {
    RUN(test_batching);
    RUN(test_sharding);
    RUN(test_shuffle);
    RUN(test_prefetch_matches_sync);
    RUN(test_cursor_restore);
    RUN(test_augment_values);
    RUN(test_cache);
    RUN(test_cache_in_flight);
    RUN(test_create_out_of_memory);
    RUN(test_bad_samples);
    RUN(test_destroy_midway);
    RUN(test_token_batches);
    RUN(test_stream_basic);
    RUN(test_stream_threads);
    RUN(test_train_from_loader);
    return test_summary();
}
