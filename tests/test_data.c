/* tests/test_data.c: the datasets of the data pipeline against known contents.
 * In-memory arrays (copied and borrowed, label checks), subsets, sliding windows over a time
 * series (contents, counts, horizons, a CSV series through a loader, errors), feature statistics,
 * application callbacks; CSV (headers detected or given, label by index or name, ignored
 * columns, regression and text class labels, quoting, CRLF, BOM, delimiters, number
 * syntax) and one bad file per error with the line, column and column name checked; IDX
 * datasets over small files and the real Fashion-MNIST files (skipped loudly when missing);
 * token files (uint16/uint32, header, stride, vocabulary, truncation); the resampler
 * (copy, area, bilinear); image decoding and image folders written as PNG/BMP/JPEG files
 * in a temporary folder (Fashion-MNIST images when present), with corrupt, truncated and
 * missing files. Image tests need the library built with DTR_USE_STB_IMAGE and the test
 * built with stb_image_write.h; otherwise they check the DTR_UNSUPPORTED message and say
 * loudly that they were skipped. */
#define _POSIX_C_SOURCE 200809L
#include "test.h"
#define TU_WANT_STBIW
#include "test_util.h"
#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>


/* ---- helpers ---- */

static char g_dir[256];   /* this run's temporary folder */
static char g_err[1024];

static const char *tpath(const char *name) {
    static char buf[8][512];
    static int k;
    k = (k + 1) % 8;
    snprintf(buf[k], sizeof buf[k], "%s/%s", g_dir, name);
    return buf[k];
}


static int write_text(const char *path, const char *s) { return write_file(path, s, strlen(s)); }

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

#if TU_HAVE_STBIW   /* the helpers of the image tests */
/* The whole file (malloc'd) or NULL. */
static unsigned char *read_all(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    unsigned char *p;
    long len;
    *n = 0;
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    len = ftell(f);
    fseek(f, 0, SEEK_SET);
    p = (unsigned char *)malloc((size_t)len + 1);
    if (p && fread(p, 1, (size_t)len, f) != (size_t)len) {
        free(p);
        p = NULL;
    }
    fclose(f);
    if (p) *n = (size_t)len;
    return p;
}

static int quick(void) {
    const char *q = getenv("DTR_TEST_QUICK");
    return q && q[0] && q[0] != '0';
}
#endif

/* ---- in-memory arrays, subsets, statistics, callbacks ---- */

static void test_memory_dataset(void) {
    float x[6 * 2];
    int32_t y[6];
    float xs[2];
    int32_t ys;
    int i;
    dtr_memory_dataset_config c = dtr_memory_dataset_config_init();
    dtr_dataset *ds = NULL, *cp = NULL;
    for (i = 0; i < 12; i++) x[i] = (float)i * 0.5f;
    for (i = 0; i < 6; i++) y[i] = i % 3;
    c.count = 6;
    c.layout.x_ndim = 1;
    c.layout.x_shape[0] = 2;
    c.layout.y_dtype = DTR_I32;
    c.layout.num_classes = 3;
    c.x = x;
    c.y = y;
    CHECK_EQ_INT(dtr_dataset_from_memory(&c, &ds, g_err, sizeof g_err), DTR_OK);
    c.copy = 1;
    CHECK_EQ_INT(dtr_dataset_from_memory(&c, &cp, g_err, sizeof g_err), DTR_OK);
    if (!ds || !cp) return;
    CHECK_EQ_INT(dtr_dataset_count(ds), 6);
    CHECK_EQ_INT(dtr_sample_layout_x_numel(dtr_dataset_layout(ds)), 2);
    CHECK_EQ_INT(dtr_sample_layout_y_numel(dtr_dataset_layout(ds)), 1);
    CHECK(strcmp(dtr_dataset_name(ds), "memory") == 0);
    CHECK_EQ_INT(dtr_dataset_get(ds, 4, xs, &ys, g_err, sizeof g_err), DTR_OK);
    CHECK(xs[0] == 4.0f && xs[1] == 4.5f && ys == 1);
    /* borrowed sees changes, copied does not */
    x[8] = 99.0f;
    dtr_dataset_get(ds, 4, xs, &ys, NULL, 0);
    CHECK(xs[0] == 99.0f);
    dtr_dataset_get(cp, 4, xs, &ys, NULL, 0);
    CHECK(xs[0] == 4.0f);
    CHECK_EQ_INT(dtr_dataset_get(ds, 6, xs, &ys, g_err, sizeof g_err), DTR_INVALID_ARGUMENT);
    CHECK(strstr(g_err, "sample 6") != NULL);
    CHECK_EQ_INT(dtr_dataset_get(ds, -1, xs, &ys, NULL, 0), DTR_INVALID_ARGUMENT);
    CHECK(dtr_dataset_class_name(ds, 0) == NULL);
    dtr_dataset_destroy(ds);
    dtr_dataset_destroy(cp);
    /* a label out of range names the sample */
    y[5] = 3;
    c.copy = 0;
    CHECK_EQ_INT(dtr_dataset_from_memory(&c, &ds, g_err, sizeof g_err), DTR_INVALID_ARGUMENT);
    CHECK_MSG(strstr(g_err, "sample 5") && strstr(g_err, "label 3"), "%s", g_err);
    CHECK(ds == NULL);
    /* bad layouts */
    c.layout.num_classes = 0;
    c.layout.x_ndim = 0;
    CHECK_EQ_INT(dtr_dataset_from_memory(&c, &ds, g_err, sizeof g_err), DTR_INVALID_ARGUMENT);
    CHECK(strstr(g_err, "x_ndim") != NULL);
    c.layout.x_ndim = 1;
    c.layout.x_dtype = DTR_BF16;
    CHECK_EQ_INT(dtr_dataset_from_memory(&c, &ds, g_err, sizeof g_err), DTR_INVALID_ARGUMENT);
    c.layout.x_dtype = DTR_F32;
    c.y = NULL;
    CHECK_EQ_INT(dtr_dataset_from_memory(&c, &ds, g_err, sizeof g_err), DTR_NULL_HANDLE);
    c.layout.unlabeled = 1;   /* unlabeled: y is not needed */
    CHECK_EQ_INT(dtr_dataset_from_memory(&c, &ds, g_err, sizeof g_err), DTR_OK);
    CHECK_EQ_INT(dtr_sample_layout_y_numel(dtr_dataset_layout(ds)), 0);
    CHECK_EQ_INT(dtr_dataset_get(ds, 1, xs, &ys, NULL, 0), DTR_OK);
    CHECK(xs[0] == 1.0f);
    dtr_dataset_destroy(ds);
    CHECK_EQ_INT(dtr_dataset_from_memory(NULL, &ds, NULL, 0), DTR_NULL_HANDLE);
    dtr_dataset_destroy(NULL);
}

static void test_subset_and_stats(void) {
    float x[5 * 3] = {1, 10, 100, 2, 20, 200, 3, 30, 300, 4, 40, 400, 5, 50, 500};
    float y[5] = {0.5f, 1.5f, 2.5f, 3.5f, 4.5f};
    int64_t pick[3] = {4, 0, 4}, bad[1] = {5};
    float m[3], s[3], xs[3], ys;
    dtr_memory_dataset_config c = dtr_memory_dataset_config_init();
    dtr_dataset *ds = NULL, *sub = NULL;
    c.count = 5;
    c.layout.x_ndim = 1;
    c.layout.x_shape[0] = 3;
    c.layout.y_dtype = DTR_F32;
    c.x = x;
    c.y = y;
    CHECK_OK(NULL, dtr_dataset_from_memory(&c, &ds, g_err, sizeof g_err));
    if (!ds) return;
    CHECK_OK(NULL, dtr_dataset_subset(ds, pick, 3, &sub, g_err, sizeof g_err));
    CHECK_EQ_INT(dtr_dataset_count(sub), 3);
    dtr_dataset_get(sub, 0, xs, &ys, NULL, 0);
    CHECK(xs[0] == 5.0f && xs[2] == 500.0f && ys == 4.5f);
    dtr_dataset_get(sub, 1, xs, &ys, NULL, 0);
    CHECK(xs[1] == 10.0f && ys == 0.5f);
    {
        dtr_dataset *none = NULL;
        CHECK_EQ_INT(dtr_dataset_subset(ds, bad, 1, &none, g_err, sizeof g_err), DTR_INVALID_ARGUMENT);
        CHECK(strstr(g_err, "subset index 0 is 5") != NULL && none == NULL);
    }
    /* per element: mean (3, 30, 300), population std sqrt(2) * (1, 10, 100) */
    CHECK_OK(NULL, dtr_dataset_feature_stats(ds, 0, m, s, g_err, sizeof g_err));
    CHECK_NEAR(m[0], 3.0, 1e-6);
    CHECK_NEAR(m[1], 30.0, 1e-5);
    CHECK_NEAR(m[2], 300.0, 1e-4);
    CHECK_NEAR(s[0], sqrt(2.0), 1e-6);
    CHECK_NEAR(s[2], 100.0 * sqrt(2.0), 1e-4);
    /* per channel over (3) samples: every element is its own channel here too */
    CHECK_OK(NULL, dtr_dataset_feature_stats(ds, 1, m, s, NULL, 0));
    CHECK_NEAR(m[1], 30.0, 1e-5);
    dtr_dataset_destroy(sub);
    dtr_dataset_destroy(ds);
}

typedef struct td_user {
    int closed;
    int fail_at;
} td_user;

static dtr_result td_get(void *user, int64_t index, void *x, void *y, char *err, size_t errlen) {
    td_user *u = (td_user *)user;
    if (index == u->fail_at) {
        snprintf(err, errlen, "my source: record %lld is damaged", (long long)index);
        return DTR_CORRUPT_FILE;
    }
    ((float *)x)[0] = (float)index;
    ((float *)x)[1] = -(float)index;
    *(int32_t *)y = (int32_t)(index & 1);
    return DTR_OK;
}

static void td_close(void *user) { ((td_user *)user)->closed++; }

static void test_custom_dataset(void) {
    dtr_sample_layout L;
    dtr_dataset_callbacks cb;
    td_user u = {0, 7};
    dtr_dataset *ds = NULL;
    float x[2];
    int32_t y;
    memset(&L, 0, sizeof L);
    L.x_ndim = 1;
    L.x_shape[0] = 2;
    L.y_dtype = DTR_I32;
    L.num_classes = 2;
    memset(&cb, 0, sizeof cb);
    cb.user = &u;
    cb.get = td_get;
    cb.close = td_close;
    CHECK_OK(NULL, dtr_dataset_create(10, &L, &cb, NULL, &ds, g_err, sizeof g_err));
    if (!ds) return;
    CHECK_EQ_INT(dtr_dataset_get(ds, 3, x, &y, g_err, sizeof g_err), DTR_OK);
    CHECK(x[0] == 3.0f && x[1] == -3.0f && y == 1);
    CHECK_EQ_INT(dtr_dataset_get(ds, 7, x, &y, g_err, sizeof g_err), DTR_CORRUPT_FILE);
    CHECK(strstr(g_err, "record 7 is damaged") != NULL);
    dtr_dataset_destroy(ds);
    CHECK_EQ_INT(u.closed, 1);
    cb.get = NULL;
    CHECK_EQ_INT(dtr_dataset_create(10, &L, &cb, NULL, &ds, g_err, sizeof g_err), DTR_NULL_HANDLE);
}

/* ---- CSV ---- */

static dtr_result csv_open(const char *text, const dtr_csv_config *cfg, dtr_dataset **ds) {
    return dtr_dataset_csv_from_buffer(text, strlen(text), cfg, ds, g_err, sizeof g_err);
}

/* sliding windows over a series of 10 steps x = (t, 10 + t), y = 100 + t: contents, counts,
   horizon 0, a CSV price series through a loader, and the errors */
static void test_windows(void) {
    float x[10 * 2], y[10], wx[3 * 2], wy;
    dtr_memory_dataset_config c = dtr_memory_dataset_config_init();
    dtr_window_config wc = dtr_window_config_init();
    dtr_dataset *ds = NULL, *w = NULL;
    const dtr_sample_layout *L;
    int t;
    for (t = 0; t < 10; t++) x[2 * t] = (float)t, x[2 * t + 1] = (float)(10 + t), y[t] = (float)(100 + t);
    c.count = 10, c.layout.x_ndim = 1, c.layout.x_shape[0] = 2, c.layout.y_dtype = DTR_F32, c.x = x, c.y = y;
    CHECK_OK(NULL, dtr_dataset_from_memory(&c, &ds, g_err, sizeof g_err));
    if (!ds) return;
    wc.window = 3, wc.stride = 2;   /* steps 0-2 -> y of step 3, 2-4 -> 5, 4-6 -> 7, 6-8 -> 9 */
    CHECK_OK(NULL, dtr_dataset_windows(ds, &wc, &w, g_err, sizeof g_err));
    if (!w) return;
    L = dtr_dataset_layout(w);
    CHECK(dtr_dataset_count(w) == 4 && L->x_ndim == 2 && L->x_shape[0] == 3 && L->x_shape[1] == 2 && L->y_dtype == DTR_F32);
    CHECK_OK(NULL, dtr_dataset_get(w, 1, wx, &wy, g_err, sizeof g_err));
    CHECK(wx[0] == 2.0f && wx[1] == 12.0f && wx[4] == 4.0f && wx[5] == 14.0f && wy == 105.0f);
    CHECK_OK(NULL, dtr_dataset_get(w, 3, wx, &wy, g_err, sizeof g_err));
    CHECK(wx[0] == 6.0f && wx[5] == 18.0f && wy == 109.0f);
    CHECK_EQ_INT(dtr_dataset_get(w, 4, wx, &wy, g_err, sizeof g_err), DTR_INVALID_ARGUMENT);
    dtr_dataset_destroy(w);
    wc.stride = 1, wc.horizon = 0;   /* the last step's own label: 8 windows */
    CHECK_OK(NULL, dtr_dataset_windows(ds, &wc, &w, g_err, sizeof g_err));
    CHECK_EQ_INT(dtr_dataset_count(w), 8);
    CHECK_OK(NULL, dtr_dataset_get(w, 7, wx, &wy, g_err, sizeof g_err));
    CHECK(wx[0] == 7.0f && wx[4] == 9.0f && wy == 109.0f);
    dtr_dataset_destroy(w);
    wc.window = 10, wc.horizon = 1;   /* too short: no window */
    CHECK_OK(NULL, dtr_dataset_windows(ds, &wc, &w, g_err, sizeof g_err));
    CHECK_EQ_INT(dtr_dataset_count(w), 0);
    dtr_dataset_destroy(w);
    wc.window = 0;
    CHECK_EQ_INT(dtr_dataset_windows(ds, &wc, &w, g_err, sizeof g_err), DTR_INVALID_ARGUMENT);
    CHECK(w == NULL && strstr(g_err, "need window, stride >= 1") != NULL);
    wc.window = 2, wc.horizon = -1;
    CHECK_EQ_INT(dtr_dataset_windows(ds, &wc, &w, g_err, sizeof g_err), DTR_INVALID_ARGUMENT);
    CHECK_EQ_INT(dtr_dataset_windows(NULL, &wc, &w, g_err, sizeof g_err), DTR_NULL_HANDLE);
    dtr_dataset_destroy(ds);
    {   /* a CSV series (price, volume; the next close as the target) through a shuffling loader */
        static const char csv[] = "price,volume,next\n1,10,2\n2,20,3\n3,30,4\n4,40,5\n5,50,6\n6,60,7\n";
        dtr_csv_config cc = dtr_csv_config_init();
        dtr_loader_config lc = dtr_loader_config_init();
        dtr_loader *ld = NULL;
        dtr_batch b;
        int64_t seen = 0, k;
        cc.label_kind = DTR_LABEL_REGRESSION;
        CHECK_OK(NULL, dtr_dataset_csv_from_buffer(csv, sizeof csv - 1, &cc, &ds, g_err, sizeof g_err));
        wc = dtr_window_config_init(), wc.window = 4, wc.horizon = 0;
        CHECK_OK(NULL, dtr_dataset_windows(ds, &wc, &w, g_err, sizeof g_err));
        lc.batch_size = 2, lc.shuffle = 1, lc.seed = 3;
        CHECK_OK(NULL, dtr_loader_create(w, &lc, &ld, g_err, sizeof g_err));
        for (k = 0; ld && k < dtr_loader_batches(ld) && dtr_loader_next(ld, &b) == DTR_OK; k++) {   /* one epoch */
            const float *bx = (const float *)b.x, *by = (const float *)b.y;
            int i;
            CHECK(b.x_ndim == 3 && b.x_shape[1] == 4 && b.x_shape[2] == 2);
            for (i = 0; i < b.size; i++)   /* window from price p: prices p..p+3, target p + 4 */
                CHECK(bx[i * 8 + 6] == bx[i * 8] + 3.0f && bx[i * 8 + 7] == 10.0f * bx[i * 8 + 6] && by[i] == bx[i * 8 + 6] + 1.0f);
            seen += b.size;
        }
        CHECK_EQ_INT(seen, 3);
        dtr_loader_destroy(ld);
        dtr_dataset_destroy(w);
        dtr_dataset_destroy(ds);
    }
}

static void test_csv_basic(void) {
    dtr_csv_config c = dtr_csv_config_init();
    dtr_dataset *ds = NULL;
    float x[3];
    int32_t y;
    const dtr_sample_layout *L;
    CHECK_OK(NULL, csv_open("a,b,c,label\n1,2,3,0\n4.5,-5e-1,+.25,2\n\n7,8,9,1\n", &c, &ds));
    if (!ds) return;
    L = dtr_dataset_layout(ds);
    CHECK_EQ_INT(dtr_dataset_count(ds), 3);
    CHECK_EQ_INT(L->x_ndim, 1);
    CHECK_EQ_INT(L->x_shape[0], 3);
    CHECK_EQ_INT(L->y_dtype, DTR_I32);
    CHECK_EQ_INT(L->y_ndim, 0);
    CHECK_EQ_INT(L->num_classes, 3);
    dtr_dataset_get(ds, 1, x, &y, NULL, 0);
    CHECK(x[0] == 4.5f && x[1] == -0.5f && x[2] == 0.25f && y == 2);
    dtr_dataset_get(ds, 2, x, &y, NULL, 0);
    CHECK(x[0] == 7.0f && x[2] == 9.0f && y == 1);
    dtr_dataset_destroy(ds);

    /* no header (detected), label in column 0, CRLF, a BOM, spaces, ';' */
    c.label_column = 0;
    c.delimiter = ';';
    CHECK_OK(NULL, csv_open("\xEF\xBB\xBF" "1; 0.1 ;2\r\n0;3;  4\r\n", &c, &ds));
    if (!ds) return;
    CHECK_EQ_INT(dtr_dataset_count(ds), 2);
    dtr_dataset_get(ds, 0, x, &y, NULL, 0);
    CHECK(y == 1 && x[0] == 0.1f && x[1] == 2.0f);
    dtr_dataset_get(ds, 1, x, &y, NULL, 0);
    CHECK(y == 0 && x[0] == 3.0f && x[1] == 4.0f);
    dtr_dataset_destroy(ds);

    /* header forced off: a first row of names is then a bad field */
    c = dtr_csv_config_init();
    c.header = -1;
    CHECK_EQ_INT(csv_open("x,y\n1,2\n", &c, &ds), DTR_CORRUPT_FILE);
    CHECK_MSG(strstr(g_err, "CSV text:1:1: \"x\" is not a number") != NULL, "%s", g_err);
    /* header forced on: the first row is skipped even though it is numeric */
    c.header = 1;
    CHECK_OK(NULL, csv_open("1,2\n3,4\n", &c, &ds));
    if (ds) {
        CHECK_EQ_INT(dtr_dataset_count(ds), 1);
        dtr_dataset_get(ds, 0, x, &y, NULL, 0);
        CHECK(x[0] == 3.0f && y == 4);
        dtr_dataset_destroy(ds);
    }
}

static void test_csv_columns(void) {
    dtr_csv_config c = dtr_csv_config_init();
    dtr_dataset *ds = NULL;
    float x[2], yf;
    int32_t y;
    const char *text = "id,\"price\",rooms,\"the \"\"area\"\"\"\n"
                       "17,250000.5,3,\"80\"\n"
                       "18,1.5e5,2,\"6\n0\"\n";   /* a quoted field over two lines is bad as a number */
    /* regression on a named label, an ignored id column */
    c.label_kind = DTR_LABEL_REGRESSION;
    c.label_name = "price";
    c.ignore = "id";
    CHECK_EQ_INT(csv_open(text, &c, &ds), DTR_CORRUPT_FILE);
    CHECK_MSG(strstr(g_err, "CSV text:3:4:") && strstr(g_err, "the \"area\""), "%s", g_err);
    text = "id,\"price\",rooms,\"the \"\"area\"\"\"\n17,250000.5,3,\"80\"\n18,1.5e5,2,\"60\"\n";
    CHECK_OK(NULL, csv_open(text, &c, &ds));
    if (!ds) return;
    CHECK_EQ_INT(dtr_dataset_layout(ds)->x_shape[0], 2);
    CHECK_EQ_INT(dtr_dataset_layout(ds)->y_dtype, DTR_F32);
    CHECK_EQ_INT(dtr_dataset_layout(ds)->num_classes, 0);
    dtr_dataset_get(ds, 0, x, &yf, NULL, 0);
    CHECK(x[0] == 3.0f && x[1] == 80.0f && yf == 250000.5f);
    dtr_dataset_get(ds, 1, x, &yf, NULL, 0);
    CHECK(x[0] == 2.0f && x[1] == 60.0f && yf == 150000.0f);
    dtr_dataset_destroy(ds);
    /* a quoted header name with escapes can be the label */
    c.label_name = "the \"area\"";
    c.ignore = "id,rooms";
    CHECK_OK(NULL, csv_open(text, &c, &ds));
    if (ds) {
        CHECK_EQ_INT(dtr_dataset_layout(ds)->x_shape[0], 1);
        dtr_dataset_get(ds, 1, x, &yf, NULL, 0);
        CHECK(x[0] == 150000.0f && yf == 60.0f);
        dtr_dataset_destroy(ds);
    }
    /* text class labels: sorted names, delimiter inside quotes */
    c = dtr_csv_config_init();
    CHECK_OK(NULL, csv_open("w,species\n1,virginica\n2,setosa\n3,\"versi,color\"\n4,setosa\n", &c, &ds));
    if (!ds) return;
    CHECK_EQ_INT(dtr_dataset_layout(ds)->num_classes, 3);
    CHECK(strcmp(dtr_dataset_class_name(ds, 0), "setosa") == 0);
    CHECK(strcmp(dtr_dataset_class_name(ds, 1), "versi,color") == 0);
    CHECK(strcmp(dtr_dataset_class_name(ds, 2), "virginica") == 0);
    CHECK(dtr_dataset_class_name(ds, 3) == NULL);
    dtr_dataset_get(ds, 0, x, &y, NULL, 0);
    CHECK(x[0] == 1.0f && y == 2);
    dtr_dataset_get(ds, 2, x, &y, NULL, 0);
    CHECK(x[0] == 3.0f && y == 1);
    dtr_dataset_get(ds, 3, x, &y, NULL, 0);
    CHECK(y == 0);
    dtr_dataset_destroy(ds);
    /* unlabeled: every column is a feature */
    c.label_kind = DTR_LABEL_NONE;
    CHECK_OK(NULL, csv_open("1,2,3\n4,5,6\n", &c, &ds));
    if (ds) {
        CHECK(dtr_dataset_layout(ds)->unlabeled);
        CHECK_EQ_INT(dtr_dataset_layout(ds)->x_shape[0], 3);
        dtr_dataset_destroy(ds);
    }
}

static void test_csv_numbers(void) {
    static const struct { const char *s; float v; } good[] = {
        {"0.1", 0.1f}, {"-0", -0.0f}, {"1e-3", 1e-3f}, {"-2.5E2", -250.0f}, {"3.", 3.0f}, {"+.5", 0.5f},
        {"123456789012345678901234", 1.2345679e23f}, {"0.000000000000000000000000000001", 1e-30f},
        {"3.4028234e38", 3.4028234e38f}, {"16777217", 16777216.0f}, {"00012", 12.0f}, {"1e-50", 0.0f},
    };
    static const char *const bad[] = {"1e40", "inf", "-", ".", "e5", "1e", "1.2.3", "0x10", "1,5", "1 2", "--1"};
    dtr_csv_config c = dtr_csv_config_init();
    dtr_dataset *ds = NULL;
    char text[128];
    float x;
    int32_t y;
    size_t i;
    c.header = -1;
    for (i = 0; i < sizeof good / sizeof good[0]; i++) {
        snprintf(text, sizeof text, "\"%s\",1\n", good[i].s);
        ds = NULL;
        CHECK_MSG(csv_open(text, &c, &ds) == DTR_OK, "%s: %s", good[i].s, g_err);
        if (!ds) continue;
        dtr_dataset_get(ds, 0, &x, &y, NULL, 0);
        CHECK_MSG(x == good[i].v, "%s -> %.9g, want %.9g", good[i].s, (double)x, (double)good[i].v);
        dtr_dataset_destroy(ds);
    }
    c.delimiter = ';';
    for (i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        snprintf(text, sizeof text, "%s;1\n", bad[i]);
        ds = NULL;
        CHECK_MSG(csv_open(text, &c, &ds) == DTR_CORRUPT_FILE, "%s was accepted", bad[i]);
        CHECK_MSG(strstr(g_err, ":1:1:") && strstr(g_err, "is not a number"), "%s: %s", bad[i], g_err);
        dtr_dataset_destroy(ds);
    }
}

static void expect_csv_error(const char *text, const dtr_csv_config *c, dtr_result want, const char *needle, int line) {
    dtr_dataset *ds = NULL;
    dtr_result r = csv_open(text, c, &ds);
    CHECK_MSG(r == want, "line %d: got %s, want %s (%s)", line, dtr_result_string(r), dtr_result_string(want), g_err);
    CHECK_MSG(strstr(g_err, needle) != NULL, "line %d: message \"%s\" lacks \"%s\"", line, g_err, needle);
    CHECK(ds == NULL);
    dtr_dataset_destroy(ds);
}

static void test_csv_errors(void) {
    dtr_csv_config c = dtr_csv_config_init();
    dtr_dataset *ds = NULL;
    c.path = "train.csv";
    expect_csv_error("a,b\n1,2\n3,\n", &c, DTR_CORRUPT_FILE, "train.csv:3:2: missing value (column \"b\")", __LINE__);
    expect_csv_error("a,b\n1,2\nNA,3\n", &c, DTR_CORRUPT_FILE, "train.csv:3:1: missing value (column \"a\")", __LINE__);
    expect_csv_error("a,b\n1,2\n?,3\n", &c, DTR_CORRUPT_FILE, "train.csv:3:1: missing value", __LINE__);
    expect_csv_error("a,b\n1,2\nnan,3\n", &c, DTR_CORRUPT_FILE, "train.csv:3:1: missing value", __LINE__);
    expect_csv_error("a,b,c\n1,2,3\n\n4,5\n", &c, DTR_CORRUPT_FILE, "train.csv:4: 2 fields, expected 3", __LINE__);
    expect_csv_error("a,b\n1,2\n3,4,\n", &c, DTR_CORRUPT_FILE, "train.csv:3: 3 fields, expected 2", __LINE__);
    expect_csv_error("a,b\n1x,2\n", &c, DTR_CORRUPT_FILE, "train.csv:2:1: \"1x\" is not a number (column \"a\")", __LINE__);
    expect_csv_error("a,b\n1,\"2\n", &c, DTR_CORRUPT_FILE, "train.csv:2:2: unterminated quoted field", __LINE__);
    expect_csv_error("a,b\n1,\"2\"x\n", &c, DTR_CORRUPT_FILE, "unexpected character after a closing quote", __LINE__);
    expect_csv_error("", &c, DTR_CORRUPT_FILE, "train.csv: no records", __LINE__);
    expect_csv_error("\n\n  \n", &c, DTR_CORRUPT_FILE, "no records", __LINE__);
    expect_csv_error("a,b\n", &c, DTR_CORRUPT_FILE, "no data records", __LINE__);
    expect_csv_error("a,b\n1,-1\n", &c, DTR_CORRUPT_FILE, "train.csv:2:2: class label \"-1\" is not an integer >= 0", __LINE__);
    expect_csv_error("a,b\n1,0.5\n", &c, DTR_CORRUPT_FILE, "class label \"0.5\"", __LINE__);
    expect_csv_error("a,b\n1,\n", &c, DTR_CORRUPT_FILE, "train.csv:2:2: missing value (column \"b\")", __LINE__);
    expect_csv_error("a\n1\n", &c, DTR_CORRUPT_FILE, "no feature columns", __LINE__);
    c.label_kind = DTR_LABEL_REGRESSION;
    expect_csv_error("a,b\n1,cat\n", &c, DTR_CORRUPT_FILE, "train.csv:2:2: \"cat\" is not a number (label column \"b\")", __LINE__);
    c.label_kind = DTR_LABEL_CLASS;
    c.label_name = "target";
    expect_csv_error("a,b\n1,2\n", &c, DTR_NOT_FOUND, "no column named \"target\"", __LINE__);
    expect_csv_error("1,2\n", &c, DTR_NOT_FOUND, "has no header", __LINE__);
    c.label_name = NULL;
    c.ignore = "a,zz";
    expect_csv_error("a,b,c\n1,2,3\n", &c, DTR_NOT_FOUND, "ignored column \"zz\"", __LINE__);
    c.ignore = NULL;
    c.label_column = 5;
    expect_csv_error("a,b\n1,2\n", &c, DTR_INVALID_ARGUMENT, "label_column 5 is outside the 2 columns", __LINE__);
    c.label_column = -3;
    expect_csv_error("a,b\n1,2\n", &c, DTR_INVALID_ARGUMENT, "label_column -3", __LINE__);
    /* line numbers count the lines inside quoted fields */
    c.label_column = -1;
    expect_csv_error("\"a\nb\",c\n1,2\nx,3\n", &c, DTR_CORRUPT_FILE, "train.csv:4:1:", __LINE__);
    /* from a file: a missing file names its path */
    c = dtr_csv_config_init();
    c.path = tpath("missing.csv");
    CHECK_EQ_INT(dtr_dataset_open_csv(&c, &ds, g_err, sizeof g_err), DTR_IO_ERROR);
    CHECK(strstr(g_err, "missing.csv: cannot open") != NULL);
    c.path = tpath("ok.csv");
    CHECK(write_text(c.path, "f1,f2,y\n1,2,1\n3,4,0\n5,6,x\n"));
    CHECK_EQ_INT(dtr_dataset_open_csv(&c, &ds, g_err, sizeof g_err), DTR_OK);   /* text labels: 0, 1, x */
    if (ds) {
        CHECK_EQ_INT(dtr_dataset_count(ds), 3);
        CHECK(strcmp(dtr_dataset_class_name(ds, 2), "x") == 0);
        CHECK(strcmp(dtr_dataset_name(ds), c.path) == 0);
        dtr_dataset_destroy(ds);
    }
    CHECK(write_text(c.path, "f1,f2,y\n1,2,1\n3,,0\n"));
    CHECK_EQ_INT(dtr_dataset_open_csv(&c, &ds, g_err, sizeof g_err), DTR_CORRUPT_FILE);
    CHECK_MSG(strstr(g_err, "ok.csv:3:2: missing value (column \"f2\")") != NULL, "%s", g_err);
    remove(c.path);
}

/* ---- IDX ---- */


static void test_idx_dataset(void) {
    unsigned char img[64], lab[64];
    uint32_t di[3] = {3, 2, 2}, dl[1] = {3}, dl2[1] = {2};
    size_t n, m, i;
    dtr_dataset *ds = NULL;
    float x[4];
    int32_t y;
    const dtr_sample_layout *L;
    n = idx_header(img, 0x08, 3, di);
    for (i = 0; i < 12; i++) img[n + i] = (unsigned char)(i * 20);
    m = idx_header(lab, 0x08, 1, dl);
    lab[m] = 4; lab[m + 1] = 0; lab[m + 2] = 2;
    CHECK(write_file(tpath("img.idx"), img, n + 12));
    CHECK(write_file(tpath("lab.idx"), lab, m + 3));
    CHECK_OK(NULL, dtr_dataset_open_idx(tpath("img.idx"), tpath("lab.idx"), NULL, &ds, g_err, sizeof g_err));
    if (!ds) return;
    L = dtr_dataset_layout(ds);
    CHECK_EQ_INT(dtr_dataset_count(ds), 3);
    CHECK(L->x_ndim == 3 && L->x_shape[0] == 1 && L->x_shape[1] == 2 && L->x_shape[2] == 2);
    CHECK_EQ_INT(L->num_classes, 5);
    dtr_dataset_get(ds, 1, x, &y, NULL, 0);
    CHECK(x[0] == 80.0f / 255.0f && x[3] == 140.0f / 255.0f && y == 0);
    dtr_dataset_get(ds, 0, x, &y, NULL, 0);
    CHECK(y == 4 && x[1] == 20.0f / 255.0f);
    dtr_dataset_destroy(ds);
    /* unlabeled */
    CHECK_OK(NULL, dtr_dataset_open_idx(tpath("img.idx"), NULL, NULL, &ds, g_err, sizeof g_err));
    if (ds) {
        CHECK(dtr_dataset_layout(ds)->unlabeled);
        dtr_dataset_destroy(ds);
    }
    /* count mismatch, truncated file, missing file */
    m = idx_header(lab, 0x08, 1, dl2);
    CHECK(write_file(tpath("lab2.idx"), lab, m + 2));
    CHECK_EQ_INT(dtr_dataset_open_idx(tpath("img.idx"), tpath("lab2.idx"), NULL, &ds, g_err, sizeof g_err), DTR_CORRUPT_FILE);
    CHECK_MSG(strstr(g_err, "lab2.idx: 2 labels but") != NULL, "%s", g_err);
    CHECK(write_file(tpath("trunc.idx"), img, n + 11));
    CHECK_EQ_INT(dtr_dataset_open_idx(tpath("trunc.idx"), NULL, NULL, &ds, g_err, sizeof g_err), DTR_CORRUPT_FILE);
    CHECK_MSG(strstr(g_err, "trunc.idx: truncated") != NULL, "%s", g_err);
    CHECK_EQ_INT(dtr_dataset_open_idx(tpath("nope.idx"), NULL, NULL, &ds, g_err, sizeof g_err), DTR_IO_ERROR);
    CHECK(ds == NULL);
    remove(tpath("img.idx"));
    remove(tpath("lab.idx"));
    remove(tpath("lab2.idx"));
    remove(tpath("trunc.idx"));
}

static const char *fmnist_dir(void) {
    const char *d = getenv("DTR_FMNIST_DIR");
    return d && d[0] ? d : "/usr/share/datasets/fashion-mnist";
}

static int g_have_fmnist = -1;
static dtr_mnist g_fm;

static int have_fmnist(void) {
    if (g_have_fmnist < 0) {
        g_have_fmnist = dtr_mnist_load(fmnist_dir(), NULL, &g_fm, g_err, sizeof g_err) == DTR_OK;
        if (!g_have_fmnist) printf("  SKIPPED (loudly): Fashion-MNIST not found in %s: %s\n", fmnist_dir(), g_err);
    }
    return g_have_fmnist;
}

static void test_idx_fmnist(void) {
    char ip[512], lp[512];
    dtr_dataset *ds = NULL;
    float x[784];
    int32_t y;
    int64_t idx[3] = {0, 12345, 59999};
    int k, i, ok = 1;
    if (!have_fmnist()) return;
    snprintf(ip, sizeof ip, "%s/train-images-idx3-ubyte.gz", fmnist_dir());
    snprintf(lp, sizeof lp, "%s/train-labels-idx1-ubyte.gz", fmnist_dir());
    if (dtr_dataset_open_idx(ip, lp, NULL, &ds, g_err, sizeof g_err) == DTR_UNSUPPORTED) {
        printf("  SKIPPED (loudly): gzip IDX needs DTR_USE_ZLIB: %s\n", g_err);
        return;
    }
    CHECK_MSG(ds != NULL, "%s", g_err);
    if (!ds) return;
    CHECK_EQ_INT(dtr_dataset_count(ds), 60000);
    CHECK_EQ_INT(dtr_dataset_layout(ds)->num_classes, 10);
    for (k = 0; k < 3; k++) {
        dtr_dataset_get(ds, idx[k], x, &y, NULL, 0);
        CHECK(y == g_fm.train_y[idx[k]]);
        for (i = 0; i < 784; i++) ok &= x[i] == g_fm.train_x[idx[k] * 784 + i];
    }
    CHECK(ok);
    dtr_dataset_destroy(ds);
}

/* ---- token files ---- */

static void test_tokens(void) {
    unsigned char b[2 * 21 + 8];
    dtr_token_file_config c = dtr_token_file_config_init();
    dtr_dataset *ds = NULL;
    int32_t x[4], y[4];
    int i;
    for (i = 0; i < 21; i++) {   /* tokens 1000 + i, little-endian uint16 */
        b[2 * i] = (unsigned char)((1000 + i) & 255);
        b[2 * i + 1] = (unsigned char)((1000 + i) >> 8);
    }
    CHECK(write_file(tpath("tok.bin"), b, 42));
    c.path = tpath("tok.bin");
    c.context = 4;
    CHECK_OK(NULL, dtr_dataset_open_tokens(&c, &ds, g_err, sizeof g_err));
    if (!ds) return;
    CHECK_EQ_INT(dtr_dataset_count(ds), 5);   /* (21 - 5) / 4 + 1 */
    CHECK_EQ_INT(dtr_dataset_layout(ds)->x_dtype, DTR_I32);
    dtr_dataset_get(ds, 2, x, y, NULL, 0);
    CHECK(x[0] == 1008 && x[3] == 1011 && y[0] == 1009 && y[3] == 1012);
    dtr_dataset_get(ds, 4, x, y, NULL, 0);
    CHECK(x[0] == 1016 && y[3] == 1020);
    dtr_dataset_destroy(ds);
    /* stride 1 (overlapping windows), a vocabulary too small for the last tokens */
    c.stride = 1;
    c.vocab_size = 1019;
    CHECK_OK(NULL, dtr_dataset_open_tokens(&c, &ds, g_err, sizeof g_err));
    if (ds) {
        CHECK_EQ_INT(dtr_dataset_count(ds), 17);
        CHECK_EQ_INT(dtr_dataset_layout(ds)->num_classes, 1019);
        CHECK_EQ_INT(dtr_dataset_get(ds, 13, x, y, NULL, 0), DTR_OK);
        CHECK(x[0] == 1013 && y[3] == 1017);
        CHECK_EQ_INT(dtr_dataset_get(ds, 14, x, y, NULL, 0), DTR_OK);
        CHECK_EQ_INT(dtr_dataset_get(ds, 15, x, y, g_err, sizeof g_err), DTR_CORRUPT_FILE);
        CHECK_MSG(strstr(g_err, "tok.bin: sample 15: token 1019 at position 19 is outside the vocabulary (1019)"), "%s", g_err);
        dtr_dataset_destroy(ds);
    }
    /* uint32 after a 8-byte header */
    memset(b, 0xAB, 8);
    for (i = 0; i < 10; i++) {
        uint32_t v = 70000u + (uint32_t)i;
        b[8 + 4 * i] = (unsigned char)v;
        b[9 + 4 * i] = (unsigned char)(v >> 8);
        b[10 + 4 * i] = (unsigned char)(v >> 16);
        b[11 + 4 * i] = (unsigned char)(v >> 24);
    }
    CHECK(write_file(tpath("tok32.bin"), b, 48));
    c = dtr_token_file_config_init();
    c.path = tpath("tok32.bin");
    c.token_bytes = 4;
    c.header_bytes = 8;
    c.context = 3;
    CHECK_OK(NULL, dtr_dataset_open_tokens(&c, &ds, g_err, sizeof g_err));
    if (ds) {
        CHECK_EQ_INT(dtr_dataset_count(ds), 3);
        dtr_dataset_get(ds, 1, x, y, NULL, 0);
        CHECK(x[0] == 70003 && y[2] == 70006);
        dtr_dataset_destroy(ds);
    }
    /* truncated: not a whole number of tokens */
    CHECK(write_file(tpath("tok32.bin"), b, 47));
    CHECK_EQ_INT(dtr_dataset_open_tokens(&c, &ds, g_err, sizeof g_err), DTR_CORRUPT_FILE);
    CHECK_MSG(strstr(g_err, "tok32.bin: 39 bytes of tokens is not a whole number of 4-byte tokens"), "%s", g_err);
    c.header_bytes = 100;
    CHECK_EQ_INT(dtr_dataset_open_tokens(&c, &ds, g_err, sizeof g_err), DTR_CORRUPT_FILE);
    CHECK(strstr(g_err, "shorter than the 100-byte header") != NULL);
    /* too short for one window; empty; missing; bad arguments */
    c.header_bytes = 0;
    c.context = 100;
    CHECK(write_file(tpath("tok32.bin"), b, 48));
    CHECK_OK(NULL, dtr_dataset_open_tokens(&c, &ds, g_err, sizeof g_err));
    CHECK_EQ_INT(dtr_dataset_count(ds), 0);
    dtr_dataset_destroy(ds);
    CHECK(write_file(tpath("tok32.bin"), b, 0));
    CHECK_OK(NULL, dtr_dataset_open_tokens(&c, &ds, g_err, sizeof g_err));
    CHECK_EQ_INT(dtr_dataset_count(ds), 0);
    dtr_dataset_destroy(ds);
    c.path = tpath("nope.bin");
    CHECK_EQ_INT(dtr_dataset_open_tokens(&c, &ds, g_err, sizeof g_err), DTR_IO_ERROR);
    CHECK(strstr(g_err, "nope.bin: cannot open") != NULL);
    c.token_bytes = 3;
    CHECK_EQ_INT(dtr_dataset_open_tokens(&c, &ds, g_err, sizeof g_err), DTR_INVALID_ARGUMENT);
    c.token_bytes = 2;
    c.context = 0;
    CHECK_EQ_INT(dtr_dataset_open_tokens(&c, &ds, g_err, sizeof g_err), DTR_INVALID_ARGUMENT);
    remove(tpath("tok.bin"));
    remove(tpath("tok32.bin"));
}

/* ---- resampling ---- */

static void test_resize(void) {
    float src[2 * 4 * 6], dst[2 * 8 * 12];
    int i, y, x, ok;
    for (i = 0; i < 48; i++) src[i] = (float)((i * 37) % 11) / 10.0f;
    /* same size: a copy */
    CHECK_EQ_INT(dtr_image_resize(src, 2, 4, 6, dst, 4, 6, NULL), DTR_OK);
    CHECK(memcmp(src, dst, sizeof src) == 0);
    /* halving: each output is the mean of a 2x2 block */
    CHECK_EQ_INT(dtr_image_resize(src, 2, 4, 6, dst, 2, 3, NULL), DTR_OK);
    ok = 1;
    for (i = 0; i < 2; i++)
        for (y = 0; y < 2; y++)
            for (x = 0; x < 3; x++) {
                const float *s = src + i * 24 + (2 * y) * 6 + 2 * x;
                float want = (s[0] + s[1] + s[6] + s[7]) / 4.0f;
                ok &= fabsf(dst[i * 6 + y * 3 + x] - want) < 1e-6f;
            }
    CHECK(ok);
    /* 3 -> 2 pixels: coverage weights 2/3, 1/3 | 1/3, 2/3 */
    {
        float s3[3] = {0.3f, 0.6f, 0.9f}, d2[2];
        CHECK_EQ_INT(dtr_image_resize(s3, 1, 1, 3, d2, 1, 2, NULL), DTR_OK);
        CHECK_NEAR(d2[0], (0.3 * 2 + 0.6) / 3, 1e-6);
        CHECK_NEAR(d2[1], (0.6 + 0.9 * 2) / 3, 1e-6);
    }
    /* growing a linear ramp keeps it linear between the first and last pixel centres */
    {
        float ramp[4] = {0.0f, 1.0f, 2.0f, 3.0f}, up[8];
        CHECK_EQ_INT(dtr_image_resize(ramp, 1, 1, 4, up, 1, 8, NULL), DTR_OK);
        /* output centre o maps to (o + 0.5) / 2 - 0.5, clamped to [0, 3] */
        for (x = 0; x < 8; x++) {
            double f = (x + 0.5) / 2.0 - 0.5;
            if (f < 0) f = 0;
            if (f > 3) f = 3;
            CHECK_NEAR(up[x], f, 1e-6);
        }
    }
    /* a constant image stays constant both ways, also for odd sizes */
    for (i = 0; i < 48; i++) src[i] = 0.25f;
    CHECK_EQ_INT(dtr_image_resize(src, 1, 7, 5, dst, 3, 11, NULL), DTR_OK);
    ok = 1;
    for (i = 0; i < 33; i++) ok &= fabsf(dst[i] - 0.25f) < 1e-6f;
    CHECK(ok);
    CHECK_EQ_INT(dtr_image_resize(src, 1, 0, 5, dst, 3, 3, NULL), DTR_INVALID_ARGUMENT);
    CHECK_EQ_INT(dtr_image_resize(NULL, 1, 2, 5, dst, 3, 3, NULL), DTR_NULL_HANDLE);
}

/* ---- images ---- */

static int g_stb = -1;   /* 1 when the library decodes images */

static int have_stb(void) {
    if (g_stb < 0) {
        unsigned char junk[8] = {0};
        int w, h, c;
        dtr_result r = dtr_image_info(junk, sizeof junk, &w, &h, &c, g_err, sizeof g_err);
        g_stb = r != DTR_UNSUPPORTED;
        if (!g_stb) {
            CHECK_MSG(strstr(g_err, "DTR_USE_STB_IMAGE") != NULL, "%s", g_err);
            printf("  SKIPPED (loudly): the library was built without DTR_USE_STB_IMAGE: %s\n", g_err);
        } else if (!TU_HAVE_STBIW) {
            printf("  SKIPPED (loudly): stb_image_write.h not found; the image tests need it to write files\n");
        }
    }
    return g_stb && TU_HAVE_STBIW;
}

#if TU_HAVE_STBIW
typedef struct td_mem { unsigned char *p; size_t n, cap; } td_mem;

static void td_mem_write(void *ctx, void *data, int size) {
    td_mem *m = (td_mem *)ctx;
    if (m->n + (size_t)size > m->cap) {
        m->cap = (m->n + (size_t)size) * 2;
        m->p = (unsigned char *)realloc(m->p, m->cap);
    }
    memcpy(m->p + m->n, data, (size_t)size);
    m->n += (size_t)size;
}

/* A w x h image with c channels: pixel (x, y, ch) = (x * 7 + y * 13 + ch * 50) & 255. */
static void td_pattern(unsigned char *px, int w, int h, int c) {
    int x, y, k;
    for (y = 0; y < h; y++)
        for (x = 0; x < w; x++)
            for (k = 0; k < c; k++) px[(y * w + x) * c + k] = (unsigned char)((x * 7 + y * 13 + k * 50) & 255);
}
#endif

static void test_image_decode(void) {
#if TU_HAVE_STBIW
    unsigned char px[12 * 10 * 3];
    float out[3 * 10 * 12], small[3 * 5 * 6];
    td_mem m = {NULL, 0, 0};
    int w, h, c, x, y, k, ok;
    if (!have_stb()) return;
    td_pattern(px, 12, 10, 3);
    CHECK(stbi_write_png_to_func(td_mem_write, &m, 12, 10, 3, px, 12 * 3));
    CHECK_EQ_INT(dtr_image_info(m.p, m.n, &w, &h, &c, g_err, sizeof g_err), DTR_OK);
    CHECK(w == 12 && h == 10 && c == 3);
    /* PNG is lossless: exact values, planar */
    CHECK_EQ_INT(dtr_image_decode(m.p, m.n, 3, 12, 10, out, NULL, g_err, sizeof g_err), DTR_OK);
    ok = 1;
    for (k = 0; k < 3; k++)
        for (y = 0; y < 10; y++)
            for (x = 0; x < 12; x++) ok &= out[(k * 10 + y) * 12 + x] == (float)px[(y * 12 + x) * 3 + k] / 255.0f;
    CHECK(ok);
    /* resized on decode: the same as decoding then dtr_image_resize */
    CHECK_EQ_INT(dtr_image_decode(m.p, m.n, 3, 6, 5, small, NULL, g_err, sizeof g_err), DTR_OK);
    {
        float want[3 * 5 * 6];
        dtr_image_resize(out, 3, 10, 12, want, 5, 6, NULL);
        CHECK(memcmp(want, small, sizeof want) == 0);
    }
    /* gray from RGB */
    CHECK_EQ_INT(dtr_image_decode(m.p, m.n, 1, 12, 10, out, NULL, g_err, sizeof g_err), DTR_OK);
    CHECK(out[0] >= 0.0f && out[0] <= 1.0f);
    /* truncated and corrupt */
    CHECK_EQ_INT(dtr_image_decode(m.p, m.n / 2, 3, 12, 10, out, NULL, g_err, sizeof g_err), DTR_CORRUPT_FILE);
    CHECK_MSG(strstr(g_err, "image: cannot decode") != NULL, "%s", g_err);
    m.p[m.n / 2] ^= 0x55;
    m.p[m.n / 2 + 1] ^= 0x55;
    CHECK_EQ_INT(dtr_image_decode(m.p, m.n, 3, 12, 10, out, NULL, g_err, sizeof g_err), DTR_CORRUPT_FILE);
    CHECK_EQ_INT(dtr_image_decode("GIF87a", 6, 3, 12, 10, out, NULL, g_err, sizeof g_err), DTR_CORRUPT_FILE);
    CHECK_EQ_INT(dtr_image_info("hello", 5, &w, &h, &c, g_err, sizeof g_err), DTR_CORRUPT_FILE);
    CHECK_EQ_INT(dtr_image_decode(m.p, m.n, 2, 12, 10, out, NULL, g_err, sizeof g_err), DTR_INVALID_ARGUMENT);
    /* BMP (lossless) and JPEG (lossy: close) */
    m.n = 0;
    CHECK(stbi_write_bmp_to_func(td_mem_write, &m, 12, 10, 3, px));
    CHECK_EQ_INT(dtr_image_decode(m.p, m.n, 3, 12, 10, out, NULL, g_err, sizeof g_err), DTR_OK);
    CHECK(out[(2 * 10 + 9) * 12 + 11] == (float)px[(9 * 12 + 11) * 3 + 2] / 255.0f);
    free(m.p);
    /* JPEG and GIF from the fuzz corpus, whose files are one option byte followed by the
     * image (stb_image_write's JPEG encoder trips UBSan, so the file was written once,
     * outside the sanitizers: 12 x 10 RGB, every byte 200, quality 95) */
    m.p = read_all("tests/fuzz/corpus/image/solid200_12x10.jpg", &m.n);
    if (!m.p) {
        printf("  SKIPPED (loudly): tests/fuzz/corpus/image/solid200_12x10.jpg not found (run from the repository root)\n");
        return;
    }
    CHECK_EQ_INT(dtr_image_decode(m.p + 1, m.n - 1, 3, 12, 10, out, NULL, g_err, sizeof g_err), DTR_OK);
    CHECK_NEAR(out[57], 200.0 / 255.0, 3.0 / 255.0);
    CHECK_NEAR(out[3 * 120 - 1], 200.0 / 255.0, 3.0 / 255.0);
    free(m.p);
    m.p = read_all("tests/fuzz/corpus/image/pixel_1x1.gif", &m.n);
    CHECK(m.p != NULL);
    if (m.p) {
        CHECK_EQ_INT(dtr_image_info(m.p + 1, m.n - 1, &w, &h, &c, g_err, sizeof g_err), DTR_OK);
        CHECK(w == 1 && h == 1);
        CHECK_EQ_INT(dtr_image_decode(m.p + 1, m.n - 1, 1, 2, 2, out, NULL, g_err, sizeof g_err), DTR_OK);
        CHECK(out[0] == out[3]);
        free(m.p);
    }
    /* the JPEG that overflows stb_image 2.27's Huffman tables is refused before stb sees it */
    m.p = read_all("tests/fuzz/corpus/image/jpeg_dht_over_256_codes.jpg", &m.n);
    CHECK(m.p != NULL);
    if (m.p) {
        CHECK_EQ_INT(dtr_image_info(m.p + 1, m.n - 1, &w, &h, &c, g_err, sizeof g_err), DTR_CORRUPT_FILE);
        CHECK_MSG(strstr(g_err, "more than 256 codes") != NULL, "%s", g_err);
        CHECK_EQ_INT(dtr_image_decode(m.p + 1, m.n - 1, 3, 4, 4, out, NULL, g_err, sizeof g_err), DTR_CORRUPT_FILE);
        free(m.p);
    }
#else
    have_stb();
#endif
}

#if TU_HAVE_STBIW
static int td_mkdir(const char *p) { return mkdir(p, 0755) == 0; }
#endif

static void test_image_folder(void) {
#if TU_HAVE_STBIW
    char root[512], path[600];
    static const char *const classes[] = {"zeta", "alpha", "mid"};   /* sorted: alpha, mid, zeta */
    unsigned char px[16 * 16];
    dtr_image_folder_config c = dtr_image_folder_config_init();
    dtr_dataset *ds = NULL;
    float x[3 * 8 * 8];
    int32_t y;
    int k, i;
    if (!have_stb()) return;
    snprintf(root, sizeof root, "%s/folder", g_dir);
    CHECK(td_mkdir(root));
    for (k = 0; k < 3; k++) {
        snprintf(path, sizeof path, "%s/%s", root, classes[k]);
        CHECK(td_mkdir(path));
        for (i = 0; i < 3; i++) {   /* 16 x 16 gray, pixel value = 10 * class + i + 1 */
            memset(px, 10 * k + i + 1, sizeof px);
            snprintf(path, sizeof path, "%s/%s/img%d.%s", root, classes[k], 2 - i, i == 1 ? "BMP" : "png");
            if (i == 1) CHECK(stbi_write_bmp(path, 16, 16, 1, px));
            else CHECK(stbi_write_png(path, 16, 16, 1, px, 16));
        }
    }
    /* a nested folder counts; hidden and non-image files do not */
    snprintf(path, sizeof path, "%s/alpha/sub", root);
    CHECK(td_mkdir(path));
    memset(px, 77, sizeof px);
    snprintf(path, sizeof path, "%s/alpha/sub/deep.png", root);
    CHECK(stbi_write_png(path, 16, 16, 1, px, 16));
    snprintf(path, sizeof path, "%s/alpha/.hidden.png", root);
    CHECK(stbi_write_png(path, 16, 16, 1, px, 16));
    snprintf(path, sizeof path, "%s/alpha/notes.txt", root);
    CHECK(write_text(path, "not an image"));
    snprintf(path, sizeof path, "%s/README", root);
    CHECK(write_text(path, "a file at the top is not a class"));

    c.root = root;
    c.width = 8;
    c.height = 8;
    CHECK_OK(NULL, dtr_dataset_open_image_folder(&c, &ds, g_err, sizeof g_err));
    if (!ds) return;
    CHECK_EQ_INT(dtr_dataset_count(ds), 10);
    CHECK_EQ_INT(dtr_dataset_layout(ds)->num_classes, 3);
    CHECK(dtr_dataset_layout(ds)->x_shape[0] == 3 && dtr_dataset_layout(ds)->x_shape[1] == 8);
    CHECK(strcmp(dtr_dataset_class_name(ds, 0), "alpha") == 0);
    CHECK(strcmp(dtr_dataset_class_name(ds, 1), "mid") == 0);
    CHECK(strcmp(dtr_dataset_class_name(ds, 2), "zeta") == 0);
    /* alpha (k = 1): img0.png (i = 2), img1.BMP (i = 1), img2.png (i = 0), sub/deep.png */
    CHECK_OK(NULL, dtr_dataset_get(ds, 0, x, &y, g_err, sizeof g_err));
    CHECK(y == 0 && x[0] == 13.0f / 255.0f && x[3 * 64 - 1] == 13.0f / 255.0f);
    CHECK_OK(NULL, dtr_dataset_get(ds, 1, x, &y, g_err, sizeof g_err));
    CHECK(y == 0 && x[5] == 12.0f / 255.0f);
    CHECK_OK(NULL, dtr_dataset_get(ds, 3, x, &y, g_err, sizeof g_err));
    CHECK(y == 0 && x[0] == 77.0f / 255.0f);
    CHECK_OK(NULL, dtr_dataset_get(ds, 4, x, &y, g_err, sizeof g_err));   /* mid (k = 2), img0 */
    CHECK(y == 1 && x[0] == 23.0f / 255.0f);
    CHECK_OK(NULL, dtr_dataset_get(ds, 9, x, &y, g_err, sizeof g_err));   /* zeta (k = 0), img2 */
    CHECK(y == 2 && x[0] == 1.0f / 255.0f);
    /* a corrupt image: the error names the file */
    snprintf(path, sizeof path, "%s/mid/img1.BMP", root);
    CHECK(write_text(path, "BM this is no bitmap"));
    CHECK_EQ_INT(dtr_dataset_get(ds, 5, x, &y, g_err, sizeof g_err), DTR_CORRUPT_FILE);
    CHECK_MSG(strstr(g_err, "mid/img1.BMP: cannot decode") != NULL, "%s", g_err);
    /* a file that disappeared */
    remove(path);
    CHECK_EQ_INT(dtr_dataset_get(ds, 5, x, &y, g_err, sizeof g_err), DTR_IO_ERROR);
    CHECK_MSG(strstr(g_err, "mid/img1.BMP: cannot open") != NULL, "%s", g_err);
    dtr_dataset_destroy(ds);
    /* gray */
    c.channels = 1;
    CHECK_OK(NULL, dtr_dataset_open_image_folder(&c, &ds, g_err, sizeof g_err));
    if (ds) {
        CHECK_EQ_INT(dtr_dataset_layout(ds)->x_shape[0], 1);
        CHECK_EQ_INT(dtr_dataset_count(ds), 9);   /* mid/img1.BMP is gone */
        CHECK_OK(NULL, dtr_dataset_get(ds, 8, x, &y, g_err, sizeof g_err));
        CHECK(x[63] == 1.0f / 255.0f);
        dtr_dataset_destroy(ds);
    }
    /* no images; no class folders; no folder; bad size */
    snprintf(path, sizeof path, "%s/empty", g_dir);
    CHECK(td_mkdir(path));
    c.root = path;
    CHECK_EQ_INT(dtr_dataset_open_image_folder(&c, &ds, g_err, sizeof g_err), DTR_NOT_FOUND);
    CHECK_MSG(strstr(g_err, "empty: no class folders") != NULL, "%s", g_err);
    snprintf(path, sizeof path, "%s/empty/cls", g_dir);
    CHECK(td_mkdir(path));
    snprintf(path, sizeof path, "%s/empty", g_dir);
    CHECK_EQ_INT(dtr_dataset_open_image_folder(&c, &ds, g_err, sizeof g_err), DTR_NOT_FOUND);
    CHECK_MSG(strstr(g_err, "empty: no images") != NULL, "%s", g_err);
    snprintf(path, sizeof path, "%s/nowhere", g_dir);
    CHECK_EQ_INT(dtr_dataset_open_image_folder(&c, &ds, g_err, sizeof g_err), DTR_IO_ERROR);
    CHECK_MSG(strstr(g_err, "nowhere: cannot open folder") != NULL, "%s", g_err);
    c.width = 0;
    CHECK_EQ_INT(dtr_dataset_open_image_folder(&c, &ds, g_err, sizeof g_err), DTR_INVALID_ARGUMENT);
    CHECK(ds == NULL);
    rm_rf(root);
    snprintf(path, sizeof path, "%s/empty", g_dir);
    rm_rf(path);
#else
    have_stb();
#endif
}

/* Fashion-MNIST written as PNG files: the folder gives back exactly the IDX pixels. */
static void test_image_folder_fmnist(void) {
#if TU_HAVE_STBIW
    char root[512], path[600];
    int per_class = quick() ? 5 : 50, k, n, i, ok = 1;
    int count[10] = {0};
    int64_t j, order[500];
    dtr_image_folder_config c = dtr_image_folder_config_init();
    dtr_dataset *ds = NULL;
    unsigned char px[784];
    float x[784];
    int32_t y;
    if (!have_stb() || !have_fmnist()) return;
    snprintf(root, sizeof root, "%s/fmnist", g_dir);
    CHECK(td_mkdir(root));
    for (k = 0; k < 10; k++) {
        snprintf(path, sizeof path, "%s/class%d", root, k);
        CHECK(td_mkdir(path));
    }
    /* the first per_class images of each class, named by their index (zero-padded, so the
     * sorted order is the index order) */
    n = 0;
    for (j = 0; j < g_fm.train_n && n < 10 * per_class; j++) {
        int lab = g_fm.train_y[j];
        if (count[lab] >= per_class) continue;
        count[lab]++;
        for (i = 0; i < 784; i++) px[i] = (unsigned char)(g_fm.train_x[j * 784 + i] * 255.0f + 0.5f);
        snprintf(path, sizeof path, "%s/class%d/%05lld.png", root, lab, (long long)j);
        CHECK(stbi_write_png(path, 28, 28, 1, px, 28));
        n++;
    }
    /* expected order: class by class, index order within */
    n = 0;
    for (k = 0; k < 10; k++) {
        int got = 0;
        for (j = 0; j < g_fm.train_n && got < per_class; j++)
            if (g_fm.train_y[j] == k) {
                order[n++] = j;
                got++;
            }
    }
    c.root = root;
    c.width = 28;
    c.height = 28;
    c.channels = 1;
    CHECK_OK(NULL, dtr_dataset_open_image_folder(&c, &ds, g_err, sizeof g_err));
    if (!ds) return;
    CHECK_EQ_INT(dtr_dataset_count(ds), 10 * per_class);
    CHECK(strcmp(dtr_dataset_class_name(ds, 3), "class3") == 0);
    for (i = 0; i < n; i++) {
        if (dtr_dataset_get(ds, i, x, &y, g_err, sizeof g_err) != DTR_OK) { ok = 0; break; }
        ok &= y == g_fm.train_y[order[i]];
        for (k = 0; k < 784; k++) ok &= x[k] == g_fm.train_x[order[i] * 784 + k];
    }
    CHECK_MSG(ok, "%s", g_err);
    dtr_dataset_destroy(ds);
    rm_rf(root);
#else
    have_stb();
#endif
}

int main(void) {
    (void)test_ctx;
    if (!make_tmp_dir("dtr_data", g_dir, sizeof g_dir)) return 2;
    RUN(test_memory_dataset);
    RUN(test_subset_and_stats);
    RUN(test_windows);
    RUN(test_custom_dataset);
    RUN(test_csv_basic);
    RUN(test_csv_columns);
    RUN(test_csv_numbers);
    RUN(test_csv_errors);
    RUN(test_idx_dataset);
    RUN(test_idx_fmnist);
    RUN(test_tokens);
    RUN(test_resize);
    RUN(test_image_decode);
    RUN(test_image_folder);
    RUN(test_image_folder_fmnist);
    rm_rf(g_dir);
    if (g_have_fmnist > 0) dtr_mnist_destroy(&g_fm);
    return test_summary();
}
