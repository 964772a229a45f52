/* tests/test_idx.c: IDX reader (MNIST family) and the MNIST / Fashion-MNIST loader.
 * Every IDX element type parsed and converted; plain and gzip files through dtr_idx_read
 * (gzip files are built here with stored deflate blocks, so no zlib is needed to make
 * them: a build with -DDTR_USE_ZLIB must read them, one without must refuse them with
 * DTR_UNSUPPORTED and a hint); one bad file per validation rule, each checked for its
 * dtr_result and message; corrupt and truncated gzip streams; the loader on small
 * synthetic files (good, bad label, count mismatch, missing file) and on the real
 * Fashion-MNIST files (skipped with a loud message when the directory is missing;
 * DTR_FMNIST_DIR overrides /usr/share/datasets/fashion-mnist). */
#include "test.h"
#include "test_util.h"
#ifndef _WIN32
#include <sys/stat.h>
#include <unistd.h>
#endif

/* ---- helpers ---- */

static void put_be(unsigned char *p, uint64_t v, int bytes) {
    int i;
    for (i = 0; i < bytes; i++) p[i] = (unsigned char)(v >> (8 * (bytes - 1 - i)));
}

static void expect_bad(const unsigned char *b, size_t n, dtr_result want, const char *needle, int line) {
    dtr_idx x;
    char err[512] = "";
    dtr_result r = dtr_idx_parse(b, n, NULL, &x, err, sizeof err);
    CHECK_MSG(r == want, "line %d: got %d (%s), want %d; message: %s", line, (int)r, dtr_result_string(r), (int)want, err);
    CHECK_MSG(strstr(err, needle) != NULL, "line %d: message \"%s\" lacks \"%s\"", line, err, needle);
    CHECK_MSG(x.data == NULL, "line %d: data not NULL on failure", line);
    dtr_idx_destroy(&x);
}
#define BAD(b, n, want, needle) expect_bad(b, n, want, needle, __LINE__)


/* CRC-32 (IEEE) for the gzip trailer. */
static uint32_t crc32_ieee(const unsigned char *p, size_t n) {
    uint32_t c = 0xffffffffu;
    size_t i;
    int k;
    for (i = 0; i < n; i++) {
        c ^= p[i];
        for (k = 0; k < 8; k++) c = (c >> 1) ^ (0xedb88320u & (0u - (c & 1u)));
    }
    return c ^ 0xffffffffu;
}

/* A gzip member holding `n` (< 65536) bytes in one stored deflate block. Returns its length. */
static size_t make_gzip(unsigned char *out, const unsigned char *p, size_t n) {
    static const unsigned char head[10] = { 0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 0xff };
    uint32_t crc = crc32_ieee(p, n);
    size_t o = 0;
    int i;
    memcpy(out, head, 10); o = 10;
    out[o++] = 0x01;   /* BFINAL, stored */
    out[o++] = (unsigned char)n; out[o++] = (unsigned char)(n >> 8);
    out[o++] = (unsigned char)~n; out[o++] = (unsigned char)(~n >> 8);
    memcpy(out + o, p, n); o += n;
    for (i = 0; i < 4; i++) out[o++] = (unsigned char)(crc >> (8 * i));
    for (i = 0; i < 4; i++) out[o++] = (unsigned char)(n >> (8 * i));
    return o;
}

/* ---- parsing every type ---- */

static void test_parse_all_types(void) {
    unsigned char b[256];
    uint32_t dims[2] = { 2, 3 };
    dtr_idx x;
    char err[512] = "";
    size_t h;
    int i;

    h = idx_header(b, 0x08, 2, dims);
    for (i = 0; i < 6; i++) b[h + i] = (unsigned char)(250 + i);
    CHECK_MSG(dtr_idx_parse(b, h + 6, NULL, &x, err, sizeof err) == DTR_OK, "%s", err);
    CHECK(x.dtype == DTR_U8 && x.ndim == 2 && x.dims[0] == 2 && x.dims[1] == 3 && x.numel == 6);
    CHECK(x.data && ((unsigned char *)x.data)[5] == 255);
    dtr_idx_destroy(&x);
    CHECK(x.data == NULL);
    dtr_idx_destroy(&x);
    dtr_idx_destroy(NULL);

    dims[0] = 4;
    h = idx_header(b, 0x09, 1, dims);
    b[h] = 0x80; b[h + 1] = 0xff; b[h + 2] = 0; b[h + 3] = 0x7f;
    CHECK_MSG(dtr_idx_parse(b, h + 4, NULL, &x, err, sizeof err) == DTR_OK, "%s", err);
    CHECK(x.dtype == DTR_I32 && x.numel == 4);
    if (x.data) {
        int32_t *v = (int32_t *)x.data;
        CHECK(v[0] == -128 && v[1] == -1 && v[2] == 0 && v[3] == 127);
    }
    dtr_idx_destroy(&x);

    dims[0] = 3;
    h = idx_header(b, 0x0B, 1, dims);
    put_be(b + h, 0x8000, 2); put_be(b + h + 2, 0xfffe, 2); put_be(b + h + 4, 300, 2);
    CHECK_MSG(dtr_idx_parse(b, h + 6, NULL, &x, err, sizeof err) == DTR_OK, "%s", err);
    CHECK(x.dtype == DTR_I32);
    if (x.data) {
        int32_t *v = (int32_t *)x.data;
        CHECK(v[0] == -32768 && v[1] == -2 && v[2] == 300);
    }
    dtr_idx_destroy(&x);

    dims[0] = 2;
    h = idx_header(b, 0x0C, 1, dims);
    put_be(b + h, 0x80000000u, 4); put_be(b + h + 4, 123456789, 4);
    CHECK_MSG(dtr_idx_parse(b, h + 8, NULL, &x, err, sizeof err) == DTR_OK, "%s", err);
    CHECK(x.dtype == DTR_I32);
    if (x.data) {
        int32_t *v = (int32_t *)x.data;
        CHECK(v[0] == INT32_MIN && v[1] == 123456789);
    }
    dtr_idx_destroy(&x);

    h = idx_header(b, 0x0D, 1, dims);
    put_be(b + h, 0x3fc00000u, 4);       /* 1.5 */
    put_be(b + h + 4, 0xbe800000u, 4);   /* -0.25 */
    CHECK_MSG(dtr_idx_parse(b, h + 8, NULL, &x, err, sizeof err) == DTR_OK, "%s", err);
    CHECK(x.dtype == DTR_F32);
    if (x.data) CHECK(((float *)x.data)[0] == 1.5f && ((float *)x.data)[1] == -0.25f);
    dtr_idx_destroy(&x);

    h = idx_header(b, 0x0E, 1, dims);
    put_be(b + h, 0x400a000000000000ull, 8);       /* 3.25 */
    put_be(b + h + 8, 0xc202a05f20000000ull, 8);   /* -1e10 */
    CHECK_MSG(dtr_idx_parse(b, h + 16, NULL, &x, err, sizeof err) == DTR_OK, "%s", err);
    CHECK(x.dtype == DTR_F32);
    if (x.data) CHECK(((float *)x.data)[0] == 3.25f && ((float *)x.data)[1] == -1e10f);
    dtr_idx_destroy(&x);

    /* a zero dim is an empty array, not an error */
    dims[0] = 0; dims[1] = 5;
    h = idx_header(b, 0x08, 2, dims);
    CHECK_MSG(dtr_idx_parse(b, h, NULL, &x, err, sizeof err) == DTR_OK, "%s", err);
    CHECK(x.numel == 0 && x.ndim == 2 && x.dims[1] == 5);
    dtr_idx_destroy(&x);
}

/* ---- bad images ---- */

static void test_bad_images(void) {
    unsigned char b[256];
    uint32_t dims[7] = { 2, 3, 1, 1, 1, 1, 1 };
    uint32_t huge[6] = { 0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu };
    size_t h = idx_header(b, 0x08, 2, dims);
    memset(b + h, 7, 6);

    BAD(b, h + 5, DTR_CORRUPT_FILE, "truncated: expected 18 bytes (12-byte header + 6 u8 elements), the file has 17");
    BAD(b, h + 7, DTR_CORRUPT_FILE, "trailing bytes: expected 18 bytes (12-byte header + 6 u8 elements), the file has 19");
    BAD(b, 3, DTR_CORRUPT_FILE, "too short");
    BAD(b, 0, DTR_CORRUPT_FILE, "too short");
    BAD(b, 9, DTR_CORRUPT_FILE, "need a 12-byte header");

    b[0] = 0x1f; b[1] = 0x8b;
    BAD(b, h + 6, DTR_CORRUPT_FILE, "bad magic 1f 8b");
    b[0] = 0; b[1] = 0;
    b[2] = 0x0A;
    BAD(b, h + 6, DTR_CORRUPT_FILE, "bad data type 0x0a");
    b[2] = 0x08;
    b[3] = 0;
    BAD(b, h + 6, DTR_CORRUPT_FILE, "ndim is 0");
    h = idx_header(b, 0x08, 7, dims);
    b[h] = 1; b[h + 1] = 2; b[h + 2] = 3; b[h + 3] = 4; b[h + 4] = 5; b[h + 5] = 6;
    BAD(b, h + 6, DTR_UNSUPPORTED, "7 dims");

    h = idx_header(b, 0x0E, 6, huge);
    BAD(b, h, DTR_CORRUPT_FILE, "overflow");
    BAD(b, h, DTR_CORRUPT_FILE, "dims 4294967295 x 4294967295 x 4294967295");
    huge[1] = 0x7fffffffu;   /* large but representable: a plain truncation */
    h = idx_header(b, 0x08, 2, huge);
    BAD(b, h + 1, DTR_CORRUPT_FILE, "truncated: expected 9223372030412324877 bytes");

    {
        dtr_idx x;
        char err[64];
        CHECK(dtr_idx_parse(b, 4, NULL, NULL, err, sizeof err) == DTR_NULL_HANDLE);
        CHECK(dtr_idx_parse(NULL, 4, NULL, &x, err, sizeof err) == DTR_NULL_HANDLE);
        CHECK(dtr_idx_read(NULL, NULL, &x, err, sizeof err) == DTR_NULL_HANDLE);
    }
}

/* ---- files, plain and gzip ---- */

static void test_read_files(void) {
    unsigned char b[64], gz[128];
    uint32_t dims[1] = { 5 };
    size_t h = idx_header(b, 0x08, 1, dims), gn;
    char path[512], err[512] = "";
    dtr_idx x;
    dtr_result r;
    int have_zlib;

    memcpy(b + h, "\x00\x01\x02\x03\x09", 5);
    tmp_path("dtr_idx", "plain.idx", path, sizeof path);
    CHECK(write_file(path, b, h + 5));
    CHECK_MSG(dtr_idx_read(path, NULL, &x, err, sizeof err) == DTR_OK, "%s", err);
    CHECK(x.numel == 5 && x.dtype == DTR_U8 && x.data && ((unsigned char *)x.data)[4] == 9);
    dtr_idx_destroy(&x);

    /* a truncated file: the message names the path and both sizes */
    CHECK(write_file(path, b, h + 4));
    CHECK(dtr_idx_read(path, NULL, &x, err, sizeof err) == DTR_CORRUPT_FILE);
    CHECK_MSG(strstr(err, path) && strstr(err, "expected 13 bytes") && strstr(err, "has 12"), "%s", err);
    remove(path);

    CHECK(dtr_idx_read("/nonexistent/dir/x-idx1-ubyte", NULL, &x, err, sizeof err) == DTR_IO_ERROR);
    CHECK(strstr(err, "/nonexistent/dir/x-idx1-ubyte") != NULL);

    /* gzip: read with zlib, refused with a hint without it */
    gn = make_gzip(gz, b, h + 5);
    tmp_path("dtr_idx", "good.idx.gz", path, sizeof path);
    CHECK(write_file(path, gz, gn));
    r = dtr_idx_read(path, NULL, &x, err, sizeof err);
    have_zlib = r == DTR_OK;
    if (have_zlib) {
        CHECK(x.numel == 5 && x.data && ((unsigned char *)x.data)[3] == 3);
    } else {
        CHECK_EQ_INT(r, DTR_UNSUPPORTED);
        CHECK_MSG(strstr(err, "DTR_USE_ZLIB") && strstr(err, "gunzip") && strstr(err, path), "%s", err);
    }
#ifdef DTR_USE_ZLIB
    CHECK_MSG(have_zlib, "built with DTR_USE_ZLIB but the gzip file was not read: %s", err);
#endif
    dtr_idx_destroy(&x);
    remove(path);

    {   /* corrupt streams: bad checksum, bad block type, truncated, garbage after the magic */
        static const char *what[4] = { "bad crc", "bad block", "truncated", "garbage" };
        int k;
        for (k = 0; k < 4; k++) {
            unsigned char c[128];
            size_t cn = gn;
            memcpy(c, gz, gn);
            if (k == 0) c[gn - 8] ^= 0x55;
            if (k == 1) c[10] = 0x07;
            if (k == 2) cn = gn - 6;
            if (k == 3) { memset(c + 3, 0xa5, gn - 3); c[2] = 8; c[3] = 0; memset(c + 10, 0xff, gn - 10); }
            tmp_path("dtr_idx", "bad.idx.gz", path, sizeof path);
            CHECK(write_file(path, c, cn));
            r = dtr_idx_read(path, NULL, &x, err, sizeof err);
            CHECK_MSG(r == (have_zlib ? DTR_CORRUPT_FILE : DTR_UNSUPPORTED), "%s: got %d: %s", what[k], (int)r, err);
            CHECK_MSG(strstr(err, path) != NULL, "%s: %s", what[k], err);
            if (have_zlib) CHECK_MSG(strstr(err, "gzip") != NULL, "%s: %s", what[k], err);
            CHECK(x.data == NULL);
            dtr_idx_destroy(&x);
            remove(path);
        }
    }
}

/* ---- the MNIST loader ---- */

#ifndef _WIN32
static void write_idx(const char *dir, const char *name, int type, int ndim, const uint32_t *dims,
                      const unsigned char *data, size_t n) {
    unsigned char b[512];
    char path[600];
    size_t h = idx_header(b, type, ndim, dims);
    memcpy(b + h, data, n);
    snprintf(path, sizeof path, "%s/%s", dir, name);
    CHECK(write_file(path, b, h + n));
}

static void remove_in(const char *dir, const char *name) {
    char path[600];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    remove(path);
}

static void test_mnist_synthetic(void) {
    char dir[512], err[512] = "";
    unsigned char px[3 * 2 * 2], lb[3] = { 0, 9, 5 };
    uint32_t tri[3] = { 3, 2, 2 }, tei[3] = { 2, 2, 2 }, trl[1] = { 3 }, tel[1] = { 2 }, bad3[3] = { 2, 3, 2 };
    dtr_mnist d;
    dtr_result r;
    int i;
    for (i = 0; i < 12; i++) px[i] = (unsigned char)(i * 20);
    tmp_path("dtr_idx", "mnist", dir, sizeof dir);
    CHECK(mkdir(dir, 0700) == 0);
    write_idx(dir, "train-images-idx3-ubyte", 0x08, 3, tri, px, 12);
    write_idx(dir, "train-labels-idx1-ubyte", 0x08, 1, trl, lb, 3);
    write_idx(dir, "t10k-images-idx3-ubyte", 0x08, 3, tei, px, 8);

    /* one file missing */
    CHECK(dtr_mnist_load(dir, NULL, &d, err, sizeof err) == DTR_IO_ERROR);
    CHECK_MSG(strstr(err, "t10k-labels-idx1-ubyte") != NULL, "%s", err);
    CHECK(d.train_x == NULL);

    write_idx(dir, "t10k-labels-idx1-ubyte", 0x08, 1, tel, lb, 2);
    r = dtr_mnist_load(dir, NULL, &d, err, sizeof err);
    CHECK_MSG(r == DTR_OK, "%s", err);
    if (r == DTR_OK) {
        CHECK(d.train_n == 3 && d.test_n == 2 && d.rows == 2 && d.cols == 2);
        CHECK_NEAR(d.train_x[5], 100.0 / 255.0, 1e-7);
        CHECK_NEAR(d.test_x[7], 140.0 / 255.0, 1e-7);
        CHECK(d.train_y[1] == 9 && d.test_y[1] == 9);
    }
    dtr_mnist_destroy(&d);
    CHECK(d.train_x == NULL);
    dtr_mnist_destroy(&d);
    dtr_mnist_destroy(NULL);

    {   /* allocation callbacks: used, balanced, and every failure reported as out of memory */
        count_alloc c;
        dtr_allocation_callbacks a;
        long k, calls;
        memset(&c, 0, sizeof c);
        a = count_alloc_callbacks(&c);
        CHECK(dtr_mnist_load(dir, &a, &d, err, sizeof err) == DTR_OK);
        CHECK(d.alloc == &a);
        dtr_mnist_destroy(&d);
        CHECK(c.calls > 0);
        CHECK_EQ_INT(c.live, 0);
        calls = c.calls;
        for (k = 1; k <= calls; k++) {
            memset(&c, 0, sizeof c);
            c.fail_at = k;
            r = dtr_mnist_load(dir, &a, &d, err, sizeof err);
            CHECK_MSG(r == DTR_OUT_OF_MEMORY && strstr(err, "out of memory"), "allocation %ld: %d %s", k, (int)r, err);
            CHECK(d.train_x == NULL && d.test_y == NULL);
            dtr_mnist_destroy(&d);
            CHECK_EQ_INT(c.live, 0);
        }
    }

    /* a label outside 0..9 */
    lb[1] = 10;
    write_idx(dir, "t10k-labels-idx1-ubyte", 0x08, 1, tel, lb, 2);
    CHECK(dtr_mnist_load(dir, NULL, &d, err, sizeof err) == DTR_CORRUPT_FILE);
    CHECK_MSG(strstr(err, "t10k-labels-idx1-ubyte") && strstr(err, "label 1 is 10"), "%s", err);
    CHECK(d.train_x == NULL && d.test_x == NULL);
    lb[1] = 9;

    /* counts that disagree */
    write_idx(dir, "t10k-labels-idx1-ubyte", 0x08, 1, trl, lb, 3);
    CHECK(dtr_mnist_load(dir, NULL, &d, err, sizeof err) == DTR_CORRUPT_FILE);
    CHECK_MSG(strstr(err, "2 images but") && strstr(err, "3 labels"), "%s", err);
    write_idx(dir, "t10k-labels-idx1-ubyte", 0x08, 1, tel, lb, 2);

    /* test images of another size than the training images */
    write_idx(dir, "t10k-images-idx3-ubyte", 0x08, 3, bad3, px, 12);
    CHECK(dtr_mnist_load(dir, NULL, &d, err, sizeof err) == DTR_CORRUPT_FILE);
    CHECK_MSG(strstr(err, "3 x 2 but the training images are 2 x 2"), "%s", err);

    /* images that are not u8 (N, rows, cols) */
    write_idx(dir, "t10k-images-idx3-ubyte", 0x08, 2, tri, px, 6);
    CHECK(dtr_mnist_load(dir, NULL, &d, err, sizeof err) == DTR_CORRUPT_FILE);
    CHECK_MSG(strstr(err, "expected u8 images"), "%s", err);

    remove_in(dir, "train-images-idx3-ubyte");
    remove_in(dir, "train-labels-idx1-ubyte");
    remove_in(dir, "t10k-images-idx3-ubyte");
    remove_in(dir, "t10k-labels-idx1-ubyte");
    rmdir(dir);
}
#endif

static void test_fashion_mnist(void) {
    const char *env = getenv("DTR_FMNIST_DIR");
    const char *dir = env && env[0] ? env : "/usr/share/datasets/fashion-mnist";
    char probe[600], err[512] = "";
    long hist[10], test_hist[10];
    double sum = 0;
    dtr_mnist d;
    dtr_result r;
    FILE *f;
    int64_t i;

    snprintf(probe, sizeof probe, "%s/train-labels-idx1-ubyte.gz", dir);
    f = fopen(probe, "rb");
    if (!f) {
        snprintf(probe, sizeof probe, "%s/train-labels-idx1-ubyte", dir);
        f = fopen(probe, "rb");
    }
    if (!f) {
        fprintf(stderr, "\n*** SKIP test_fashion_mnist: %s has no Fashion-MNIST files "
                        "(make installs them; or set DTR_FMNIST_DIR) ***\n\n", dir);
        return;
    }
    fclose(f);
    r = dtr_mnist_load(dir, NULL, &d, err, sizeof err);
    if (r == DTR_UNSUPPORTED) {
        CHECK_MSG(strstr(err, "DTR_USE_ZLIB") != NULL, "%s", err);
        fprintf(stderr, "\n*** SKIP test_fashion_mnist: the files are gzip and this build has no zlib: %s ***\n\n", err);
        return;
    }
    CHECK_MSG(r == DTR_OK, "%s", err);
    if (r != DTR_OK) return;
    CHECK_EQ_INT(d.train_n, 60000);
    CHECK_EQ_INT(d.test_n, 10000);
    CHECK_EQ_INT(d.rows, 28);
    CHECK_EQ_INT(d.cols, 28);
    memset(hist, 0, sizeof hist);
    memset(test_hist, 0, sizeof test_hist);
    for (i = 0; i < d.train_n; i++) if (d.train_y[i] >= 0 && d.train_y[i] < 10) hist[d.train_y[i]]++;
    for (i = 0; i < d.test_n; i++) if (d.test_y[i] >= 0 && d.test_y[i] < 10) test_hist[d.test_y[i]]++;
    for (i = 0; i < 10; i++) {
        CHECK_EQ_INT(hist[i], 6000);
        CHECK_EQ_INT(test_hist[i], 1000);
    }
    CHECK_EQ_INT(d.train_y[0], 9);   /* an ankle boot */
    CHECK_EQ_INT(d.test_y[0], 9);
    for (i = 0; i < d.train_n * 784; i++) {
        float v = d.train_x[i];
        if (!(v >= 0.0f && v <= 1.0f)) { CHECK_MSG(0, "pixel %lld = %g", (long long)i, v); break; }
        sum += floor((double)v * 255.0 + 0.5);
    }
    CHECK_NEAR(sum, 3431114169.0, 1.0);   /* the sum of every training pixel, from Python */
    dtr_mnist_destroy(&d);
}

int main(void) {
    (void)test_ctx;
    RUN(test_parse_all_types);
    RUN(test_bad_images);
    RUN(test_read_files);
#ifndef _WIN32
    RUN(test_mnist_synthetic);
#endif
    RUN(test_fashion_mnist);
    return test_summary();
}
