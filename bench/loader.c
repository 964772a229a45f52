/* bench/loader.c: throughput of dtrain's data pipeline, and whether it keeps a trainer fed.
 *
 *   build/bench/loader [--quick] [--data DIR]
 *
 * Workloads (written to a temporary folder first, removed at the end):
 *   image28   Fashion-MNIST training images as 28 x 28 gray PNG files in 10 class folders
 *             (synthetic images when Fashion-MNIST is missing), augmentation: random crop
 *             with 2 pixels of padding, horizontal flip, normalisation; without and with the
 *             cache of decoded images (the cached run is timed after one warm-up epoch)
 *   image224  256 x 256 RGB JPEG files (smooth random colour fields, quality 90) resized to
 *             224 x 224, crop padding 16, flip, per-channel normalisation
 *   idx       Fashion-MNIST train-images/labels IDX files (normalisation only)
 *   csv       a 100000-row, 20-feature CSV (parse time, then batches)
 * each through a loader of batch 64 with 1 and 2 prefetch threads. Then the single-thread
 * MLP of examples/common.h (784-256-128-10, SGD) is timed on in-memory batches, and trained
 * again fed by the 2-thread image28 loader (cache on and off), reporting how long it
 * waited for data.
 *
 * Output: JSON lines on stdout, e.g.
 *   {"bench":"loader","dataset":"image28","format":"png","augment":"crop+flip+norm","cache":false,
 *    "threads":2,"batch":64,"samples":20032,"seconds":1.02,"samples_per_s":19600,"cpu_s":2.0,
 *    "samples_per_cpu_s":10000}
 *   {"bench":"loader","dataset":"csv","parse_s":0.21,"rows_per_s":476000}
 *   {"bench":"mlp_train","threads":1,"samples_per_s":52000,"cpu_s":...,"samples_per_cpu_s":...}
 *   {"bench":"feed","loader":"image28","loader_threads":2,"cache":true,"loader_samples_per_s":...,
 *    "mlp_samples_per_s":...,"ratio":...,"ratio_cpu":...,"target":5,"ok":true}
 * cpu_s is the CPU time of the whole process (every thread) during the timed part, so
 * samples_per_cpu_s does not depend on how busy the machine is; ratio_cpu is the feed ratio
 * for two cores given to the loader (2 x its single-thread cached rate per CPU second) and one
 * to the MLP. ok compares the measured rates.
 *   {"bench":"train_fed","loader":"image28","loader_threads":2,"cache":true,"train_s":...,
 *    "samples_per_s":...,"wait_s":...,"wait_fraction":...}
 * Progress and notes go to stderr. --quick shrinks every workload (a smoke run). */
#include "../examples/common.h"
#include <math.h>
#include <time.h>
#include <sys/stat.h>
#include <unistd.h>
#include <dirent.h>

#if defined(__has_include)
#if __has_include(<stb/stb_image_write.h>)
#define LB_HAVE_STBIW 1
#define STB_IMAGE_WRITE_STATIC
#define STB_IMAGE_WRITE_IMPLEMENTATION
#if defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function"
#endif
#include <stb/stb_image_write.h>
#if defined(__GNUC__)
#pragma GCC diagnostic pop
#endif
#endif
#endif
#ifndef LB_HAVE_STBIW
#define LB_HAVE_STBIW 0
#endif

#define BATCH 64

static char g_dir[256];
static char g_err[512];
static int g_quick;

static void rm_rf(const char *path) {
    struct stat st;
    if (lstat(path, &st) != 0) return;
    if (S_ISDIR(st.st_mode)) {
        DIR *d = opendir(path);
        struct dirent *e;
        char sub[1024];
        while (d && (e = readdir(d)) != NULL) {
            if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
            snprintf(sub, sizeof sub, "%s/%s", path, e->d_name);
            rm_rf(sub);
        }
        if (d) closedir(d);
        rmdir(path);
    } else {
        remove(path);
    }
}

/* ---- workloads ---- */

/* n 28 x 28 gray PNG files in 10 class folders under g_dir/image28. */
static int make_image28(const dtr_mnist *fm, int n) {
#if LB_HAVE_STBIW
    char path[600];
    unsigned char px[784];
    dtr_rng rng;
    int i, k;
    snprintf(path, sizeof path, "%s/image28", g_dir);
    mkdir(path, 0755);
    for (k = 0; k < 10; k++) {
        snprintf(path, sizeof path, "%s/image28/c%d", g_dir, k);
        mkdir(path, 0755);
    }
    dtr_rng_seed(&rng, 28, 0);
    for (i = 0; i < n; i++) {
        int cls = fm ? fm->train_y[i % fm->train_n] : i % 10;
        for (k = 0; k < 784; k++)
            px[k] = fm ? (unsigned char)(fm->train_x[(int64_t)(i % fm->train_n) * 784 + k] * 255.0f + 0.5f)
                       : (unsigned char)(dtr_rng_u32(&rng) >> 24);
        snprintf(path, sizeof path, "%s/image28/c%d/%06d.png", g_dir, cls, i);
        if (!stbi_write_png(path, 28, 28, 1, px, 28)) return 0;
    }
    return 1;
#else
    (void)fm; (void)n;
    return 0;
#endif
}

/* n 256 x 256 RGB JPEG files (smooth colour fields plus noise) in 4 class folders. */
static int make_image224(int n) {
#if LB_HAVE_STBIW
    char path[600];
    unsigned char *px = (unsigned char *)malloc(256 * 256 * 3);
    dtr_rng rng;
    int i, k, x, y;
    if (!px) return 0;
    snprintf(path, sizeof path, "%s/image224", g_dir);
    mkdir(path, 0755);
    for (k = 0; k < 4; k++) {
        snprintf(path, sizeof path, "%s/image224/c%d", g_dir, k);
        mkdir(path, 0755);
    }
    dtr_rng_seed(&rng, 224, 0);
    for (i = 0; i < n; i++) {
        float f[3], p[3];
        for (k = 0; k < 3; k++) {
            f[k] = 0.01f + 0.05f * dtr_rng_uniform(&rng);
            p[k] = 6.28f * dtr_rng_uniform(&rng);
        }
        for (y = 0; y < 256; y++)
            for (x = 0; x < 256; x++)
                for (k = 0; k < 3; k++) {
                    float v = 128.0f + 90.0f * sinf(f[k] * (float)(x + 2 * y) + p[k]) * cosf(f[(k + 1) % 3] * (float)(y - x)) +
                              12.0f * dtr_rng_normal(&rng);
                    px[(y * 256 + x) * 3 + k] = (unsigned char)(v < 0 ? 0 : v > 255 ? 255 : v);
                }
        snprintf(path, sizeof path, "%s/image224/c%d/%05d.jpg", g_dir, i % 4, i);
        if (!stbi_write_jpg(path, 256, 256, 3, px, 90)) {
            free(px);
            return 0;
        }
    }
    free(px);
    return 1;
#else
    (void)n;
    return 0;
#endif
}

static int make_csv(const char *path, int rows, int cols) {
    FILE *f = fopen(path, "w");
    dtr_rng rng;
    int i, k;
    if (!f) return 0;
    dtr_rng_seed(&rng, 20, 0);
    for (k = 0; k < cols; k++) fprintf(f, "f%d,", k);
    fprintf(f, "target\n");
    for (i = 0; i < rows; i++) {
        double s = 0.0;
        for (k = 0; k < cols; k++) {
            float v = dtr_rng_normal(&rng) * 10.0f;
            s += v * (k % 3 - 1);
            fprintf(f, "%.4f,", v);
        }
        fprintf(f, "%.5f\n", s);
    }
    return fclose(f) == 0;
}

/* ---- measuring ---- */

/* Samples per second of a loader: `warm` epochs untimed, then batches until at least
 * min_samples and min_s have passed. */
static double measure(dtr_dataset *ds, const dtr_loader_config *c, int warm, int64_t min_samples, double min_s,
                      int64_t *samples, double *secs, double *cpu) {
    dtr_loader *l = NULL;
    dtr_batch b;
    int64_t n = 0, k;
    double t0;
    clock_t c0;
    *samples = 0;
    *secs = 0;
    *cpu = 0;
    if (dtr_loader_create(ds, c, &l, g_err, sizeof g_err) != DTR_OK) {
        fprintf(stderr, "loader: %s\n", g_err);
        return 0.0;
    }
    for (k = 0; k < warm * dtr_loader_batches(l); k++)
        if (dtr_loader_next(l, &b) != DTR_OK) break;
    t0 = fm_now();
    c0 = clock();
    while (n < min_samples || fm_now() - t0 < min_s) {
        if (dtr_loader_next(l, &b) != DTR_OK) {
            fprintf(stderr, "loader: %s\n", dtr_loader_last_error(l));
            break;
        }
        n += b.size;
    }
    *secs = fm_now() - t0;
    *cpu = (double)(clock() - c0) / CLOCKS_PER_SEC;   /* every thread of the process */
    *samples = n;
    dtr_loader_destroy(l);
    return *secs > 0 ? (double)n / *secs : 0.0;
}

/* Prints one loader line; returns samples/s, and samples per CPU second in *per_cpu. */
static double report(const char *dataset, const char *format, const char *augment, int cache, dtr_dataset *ds,
                     const dtr_loader_config *c, int warm, int64_t min_samples, double min_s, double *per_cpu) {
    int64_t n;
    double s, cpu, rate = measure(ds, c, warm, min_samples, min_s, &n, &s, &cpu);
    double pc = cpu > 0 ? (double)n / cpu : 0.0;
    printf("{\"bench\":\"loader\",\"dataset\":\"%s\",\"format\":\"%s\",\"augment\":\"%s\",\"cache\":%s,\"threads\":%d,"
           "\"batch\":%d,\"samples\":%lld,\"seconds\":%.3f,\"samples_per_s\":%.0f,\"cpu_s\":%.3f,\"samples_per_cpu_s\":%.0f}\n",
           dataset, format, augment, cache ? "true" : "false", c->threads, BATCH, (long long)n, s, rate, cpu, pc);
    fflush(stdout);
    if (per_cpu) *per_cpu = pc;
    return rate;
}

/* Single-thread MLP training rate on in-memory batches (the trainer the loader must feed). */
static double mlp_rate(const float *X, const int32_t *Y, int64_t n, double min_s, double *per_cpu) {
    dtr_context_config cc = dtr_context_config_init();
    dtr_context *ctx = NULL;
    dtr_optimizer *opt = NULL;
    fm_net net;
    fm_batch b;
    fm_epoch_stats st;
    int32_t *order = (int32_t *)malloc((size_t)n * sizeof(int32_t));
    dtr_rng rng;
    double t0, secs, cpu, samples = 0;
    clock_t c0;
    memset(&net, 0, sizeof net);
    memset(&b, 0, sizeof b);
    cc.threads = 1;
    if (!order || dtr_context_create(&cc, &ctx) != DTR_OK || fm_net_init(&net, ctx, FM_MLP, DTR_INIT_KAIMING_UNIFORM, 1) != DTR_OK ||
        fm_sgd(&net, 0.05f, 0.9f, 0, &opt) != DTR_OK || fm_batch_alloc(&b, BATCH) != DTR_OK) {
        fprintf(stderr, "mlp: setup failed\n");
        return 0.0;
    }
    dtr_rng_seed(&rng, 1, 1);
    fm_shuffle(&rng, order, n);
    fm_train_epoch(ctx, &net, opt, X, Y, order, n < 2048 ? n : 2048, &b, 0, &st);   /* warm-up */
    t0 = fm_now();
    c0 = clock();
    do {
        fm_shuffle(&rng, order, n);
        if (fm_train_epoch(ctx, &net, opt, X, Y, order, n, &b, 0, &st) != DTR_OK) break;
        samples += (double)st.samples;
    } while (fm_now() - t0 < min_s);
    secs = fm_now() - t0;
    cpu = (double)(clock() - c0) / CLOCKS_PER_SEC;
    free(order);
    fm_batch_free(&b);
    dtr_optimizer_destroy(opt);
    fm_net_free(&net);
    dtr_context_destroy(ctx);
    printf("{\"bench\":\"mlp_train\",\"threads\":1,\"batch\":%d,\"samples\":%.0f,\"seconds\":%.3f,\"samples_per_s\":%.0f,"
           "\"cpu_s\":%.3f,\"samples_per_cpu_s\":%.0f}\n", BATCH, samples, secs, samples / secs, cpu, cpu > 0 ? samples / cpu : 0.0);
    fflush(stdout);
    *per_cpu = cpu > 0 ? samples / cpu : 0.0;
    return samples / secs;
}

/* The MLP trained from a loader: time per epoch and the time it waited for batches. */
static void train_fed(dtr_dataset *ds, const dtr_loader_config *c, int epochs, int warm) {
    dtr_context_config cc = dtr_context_config_init();
    dtr_context *ctx = NULL;
    dtr_optimizer *opt = NULL;
    dtr_loader *l = NULL;
    dtr_loader_stats s0, s1;
    fm_net net;
    double t0, secs;
    int64_t samples = 0, b, e;
    memset(&net, 0, sizeof net);
    cc.threads = 1;
    if (dtr_context_create(&cc, &ctx) != DTR_OK || fm_net_init(&net, ctx, FM_MLP, DTR_INIT_KAIMING_UNIFORM, 1) != DTR_OK ||
        fm_sgd(&net, 0.05f, 0.9f, 0, &opt) != DTR_OK || dtr_loader_create(ds, c, &l, g_err, sizeof g_err) != DTR_OK) {
        fprintf(stderr, "train_fed: setup failed: %s\n", g_err);
        goto done;
    }
    for (b = 0; b < warm * dtr_loader_batches(l); b++) {   /* fills the cache */
        dtr_batch bt;
        dtr_loader_next(l, &bt);
    }
    dtr_loader_get_stats(l, &s0);
    t0 = fm_now();
    for (e = 0; e < epochs; e++) {
        for (b = 0; b < dtr_loader_batches(l); b++) {
            dtr_batch bt;
            dtr_tensor *x, *y, *loss;
            if (dtr_loader_next(l, &bt) != DTR_OK || dtr_batch_tensors(ctx, &bt, &x, &y) != DTR_OK) goto done;
            loss = dtr_cross_entropy(ctx, fm_net_forward(ctx, &net, x), y);
            if (!loss || dtr_backward(ctx, loss) != DTR_OK) goto done;
            dtr_optimizer_step(opt, NULL);
            dtr_context_reset(ctx);
            samples += bt.size;
        }
    }
    secs = fm_now() - t0;
    dtr_loader_get_stats(l, &s1);
    printf("{\"bench\":\"train_fed\",\"model\":\"mlp\",\"compute_threads\":1,\"loader\":\"image28\",\"loader_threads\":%d,"
           "\"cache\":%s,\"samples\":%lld,\"train_s\":%.3f,\"samples_per_s\":%.0f,\"wait_s\":%.3f,\"wait_fraction\":%.4f}\n",
           c->threads, c->cache_bytes ? "true" : "false", (long long)samples, secs, (double)samples / secs,
           s1.wait_s - s0.wait_s, (s1.wait_s - s0.wait_s) / secs);
    fflush(stdout);
done:
    dtr_loader_destroy(l);
    dtr_optimizer_destroy(opt);
    fm_net_free(&net);
    dtr_context_destroy(ctx);
}

int main(int argc, char **argv) {
    static const float m28[1] = {FM_MEAN}, s28[1] = {FM_STD};
    static const float m224[3] = {0.485f, 0.456f, 0.406f}, s224[3] = {0.229f, 0.224f, 0.225f};
    const char *data = NULL, *t = getenv("TMPDIR");
    dtr_mnist fm;
    int have_fm, n28, n224, csv_rows, th, i;
    double mlp = 0.0, mlp_cpu = 0.0, feed2 = 0.0, feed_cpu = 0.0, rate, pc;
    char path[600], p2[600];
    dtr_dataset *ds = NULL;
    dtr_loader_config c;
    for (i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--quick") == 0) g_quick = 1;
        else if (strcmp(argv[i], "--data") == 0 && i + 1 < argc) data = argv[++i];
        else { fprintf(stderr, "usage: %s [--quick] [--data DIR]\n", argv[0]); return 2; }
    }
    n28 = g_quick ? 2000 : 20000;
    n224 = g_quick ? 64 : 512;
    csv_rows = g_quick ? 10000 : 100000;
    snprintf(g_dir, sizeof g_dir, "%s/dtr_bench_loader_XXXXXX", t && *t ? t : "/tmp");
    if (!mkdtemp(g_dir)) { fprintf(stderr, "loader: cannot make a temporary folder\n"); return 1; }
    have_fm = dtr_mnist_load(fm_data_dir(data), NULL, &fm, g_err, sizeof g_err) == DTR_OK;
    if (!have_fm) fprintf(stderr, "loader: Fashion-MNIST not found (%s): image28 uses random images, idx and mlp are skipped\n", g_err);

    /* ---- image folders ---- */
    if (!LB_HAVE_STBIW) {
        fprintf(stderr, "loader: stb_image_write.h not found: the image folder workloads are skipped\n");
    } else {
        dtr_image_folder_config ic = dtr_image_folder_config_init();
        fprintf(stderr, "loader: writing %d PNG (28x28) and %d JPEG (256x256) files to %s\n", n28, n224, g_dir);
        if (!make_image28(have_fm ? &fm : NULL, n28) || !make_image224(n224)) {
            fprintf(stderr, "loader: cannot write the image files\n");
            goto out;
        }
        snprintf(path, sizeof path, "%s/image28", g_dir);
        ic.root = path;
        ic.width = ic.height = 28;
        ic.channels = 1;
        if (dtr_dataset_open_image_folder(&ic, &ds, g_err, sizeof g_err) != DTR_OK) {
            fprintf(stderr, "loader: %s\n", g_err);   /* e.g. built without DTR_USE_STB_IMAGE */
        } else {
            for (th = 1; th <= 2; th++) {
                c = dtr_loader_config_init();
                c.batch_size = BATCH;
                c.shuffle = 1;
                c.threads = th;
                c.augment.crop_padding = 2;
                c.augment.hflip = 1;
                c.augment.norm_count = 1;
                c.augment.mean = m28;
                c.augment.std = s28;
                report("image28", "png", "crop+flip+norm", 0, ds, &c, 0, n28 / 2, 1.0, NULL);
                c.cache_bytes = (size_t)1 << 30;
                rate = report("image28", "png", "crop+flip+norm", 1, ds, &c, 1, n28, 1.0, &pc);
                if (th == 1) feed_cpu = pc;
                if (th == 2) feed2 = rate;
            }
            if (have_fm) {
                mlp = mlp_rate(fm.train_x, fm.train_y, g_quick ? 4096 : fm.train_n, g_quick ? 0.5 : 2.0, &mlp_cpu);
                /* ratio: measured rates (a busy machine shares its cores); ratio_cpu: per CPU
                 * second, with 2 cores for the loader and one for the MLP */
                printf("{\"bench\":\"feed\",\"loader\":\"image28\",\"loader_threads\":2,\"cache\":true,"
                       "\"loader_samples_per_s\":%.0f,\"mlp_samples_per_s\":%.0f,\"ratio\":%.2f,\"ratio_cpu\":%.2f,"
                       "\"target\":5,\"ok\":%s}\n",
                       feed2, mlp, mlp > 0 ? feed2 / mlp : 0.0, mlp_cpu > 0 ? 2.0 * feed_cpu / mlp_cpu : 0.0,
                       mlp > 0 && feed2 >= 5.0 * mlp ? "true" : "false");
                fflush(stdout);
            }
            c = dtr_loader_config_init();
            c.batch_size = BATCH;
            c.shuffle = 1;
            c.threads = 2;
            c.augment.crop_padding = 2;
            c.augment.hflip = 1;
            c.augment.norm_count = 1;
            c.augment.mean = m28;
            c.augment.std = s28;
            c.flatten = 1;   /* the MLP takes (B, 784) */
            c.cache_bytes = (size_t)1 << 30;
            train_fed(ds, &c, g_quick ? 1 : 2, 1);
            c.cache_bytes = 0;
            train_fed(ds, &c, 1, 0);
            dtr_dataset_destroy(ds);
            ds = NULL;
        }
        snprintf(path, sizeof path, "%s/image224", g_dir);
        ic.root = path;
        ic.width = ic.height = 224;
        ic.channels = 3;
        if (dtr_dataset_open_image_folder(&ic, &ds, g_err, sizeof g_err) == DTR_OK) {
            for (th = 1; th <= 2; th++) {
                c = dtr_loader_config_init();
                c.batch_size = BATCH;
                c.shuffle = 1;
                c.threads = th;
                c.augment.crop_padding = 16;
                c.augment.hflip = 1;
                c.augment.norm_count = 3;
                c.augment.mean = m224;
                c.augment.std = s224;
                report("image224", "jpeg256", "resize+crop+flip+norm", 0, ds, &c, 0, n224 / 2, 1.0, NULL);
            }
            dtr_dataset_destroy(ds);
            ds = NULL;
        }
    }

    /* ---- IDX ---- */
    if (have_fm) {
        snprintf(path, sizeof path, "%s/train-images-idx3-ubyte.gz", fm_data_dir(data));
        snprintf(p2, sizeof p2, "%s/train-labels-idx1-ubyte.gz", fm_data_dir(data));
        if (dtr_dataset_open_idx(path, p2, NULL, &ds, g_err, sizeof g_err) == DTR_OK) {
            for (th = 1; th <= 2; th++) {
                c = dtr_loader_config_init();
                c.batch_size = BATCH;
                c.shuffle = 1;
                c.threads = th;
                c.augment.norm_count = 1;
                c.augment.mean = m28;
                c.augment.std = s28;
                report("idx", "idx.gz", "norm", 0, ds, &c, 0, g_quick ? 20000 : 60000, 1.0, NULL);
            }
            dtr_dataset_destroy(ds);
            ds = NULL;
        } else {
            fprintf(stderr, "loader: idx: %s\n", g_err);
        }
    }

    /* ---- CSV ---- */
    snprintf(path, sizeof path, "%s/bench.csv", g_dir);
    if (make_csv(path, csv_rows, 20)) {
        dtr_csv_config cc = dtr_csv_config_init();
        double t0 = fm_now(), secs;
        cc.path = path;
        cc.label_kind = DTR_LABEL_REGRESSION;
        if (dtr_dataset_open_csv(&cc, &ds, g_err, sizeof g_err) == DTR_OK) {
            secs = fm_now() - t0;
            printf("{\"bench\":\"loader\",\"dataset\":\"csv\",\"rows\":%d,\"columns\":21,\"parse_s\":%.3f,\"rows_per_s\":%.0f}\n",
                   csv_rows, secs, (double)csv_rows / secs);
            for (th = 1; th <= 2; th++) {
                c = dtr_loader_config_init();
                c.batch_size = BATCH;
                c.shuffle = 1;
                c.threads = th;
                report("csv", "csv", "none", 0, ds, &c, 0, csv_rows, 1.0, NULL);
            }
            dtr_dataset_destroy(ds);
            ds = NULL;
        } else {
            fprintf(stderr, "loader: csv: %s\n", g_err);
        }
    }
out:
    if (have_fm) dtr_mnist_destroy(&fm);
    rm_rf(g_dir);
    return 0;
}
