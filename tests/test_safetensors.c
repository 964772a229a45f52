/* tests/test_safetensors.c: safetensors reader and writer.
 * Round trips of every dtype through dtr_st_write / dtr_st_open, a file laid out as the
 * reference (Python) implementation writes it, and one hand-made bad file per validation
 * rule: each must give the specific dtr_result and a message that names the problem.
 * Also: allocation callbacks (every byte freed; a failing allocator gives
 * DTR_OUT_OF_MEMORY), writer argument checks and atomic replacement. */
#define _POSIX_C_SOURCE 200809L
#include "test.h"
#include "test_util.h"
#ifndef _WIN32
#include <dirent.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include "posix_util.h"
#endif

/* ---- helpers ---- */

static int file_exists(const char *path) {
    FILE *f = fopen(path, "rb");
    if (f) fclose(f);
    return f != NULL;
}

/* An image: 8-byte little-endian length of `header` (plus `pad` spaces), the header, then
 * `data_len` data bytes (0, 1, 2, ...). The length field can be overridden. */
static unsigned char img[1 << 16];
static size_t make_img_len(const char *header, size_t pad, size_t data_len, uint64_t hlen_override) {
    size_t h = strlen(header), i;
    uint64_t hlen = hlen_override ? hlen_override : (uint64_t)(h + pad);
    for (i = 0; i < 8; i++) img[i] = (unsigned char)(hlen >> (8 * i));
    memcpy(img + 8, header, h);
    memset(img + 8 + h, ' ', pad);
    for (i = 0; i < data_len; i++) img[8 + h + pad + i] = (unsigned char)i;
    return 8 + h + pad + data_len;
}
static size_t make_img(const char *header, size_t data_len) { return make_img_len(header, 0, data_len, 0); }

/* Parses `n` bytes of img and checks the result code and that the message contains `needle`. */
static void expect_bad(size_t n, dtr_result want, const char *needle, int line) {
    dtr_st_file f;
    char err[512] = "";
    dtr_result r = dtr_st_parse(img, n, NULL, &f, err, sizeof err);
    CHECK_MSG(r == want, "line %d: got %d (%s), want %d; message: %s", line, (int)r, dtr_result_string(r), (int)want, err);
    CHECK_MSG(strstr(err, needle) != NULL, "line %d: message \"%s\" lacks \"%s\"", line, err, needle);
    CHECK_MSG(f.entries == NULL && f.count == 0, "line %d: out not emptied on failure", line);
    dtr_st_destroy(&f);
}
#define BAD(header, data_len, want, needle) expect_bad(make_img(header, data_len), want, needle, __LINE__)


/* ---- round trips ---- */

static void test_roundtrip_all_dtypes(void) {
    static const dtr_dtype dts[5] = { DTR_F32, DTR_BF16, DTR_F16, DTR_I32, DTR_U8 };
    unsigned char buf[5][2 * 3 * 4 * 4];
    const void *data[8];
    dtr_st_entry e[8];
    dtr_st_file f;
    char path[512], err[512] = "";
    int i, k;
    memset(e, 0, sizeof e);
    for (i = 0; i < 5; i++) {
        size_t es = dtr_dtype_size(dts[i]);
        snprintf(e[i].name, sizeof e[i].name, "layer%d.%s", i, dtr_dtype_name(dts[i]));
        e[i].dtype = dts[i];
        e[i].ndim = 3;
        e[i].shape[0] = 2; e[i].shape[1] = 3; e[i].shape[2] = 4;
        for (k = 0; k < (int)(24 * es); k++) buf[i][k] = (unsigned char)(k * 7 + i);
        data[i] = buf[i];
    }
    /* a scalar, an empty tensor, and a name that needs JSON escapes */
    strcpy(e[5].name, "scalar");
    e[5].dtype = DTR_F32; e[5].ndim = 0;
    data[5] = buf[0];
    strcpy(e[6].name, "empty");
    e[6].dtype = DTR_BF16; e[6].ndim = 2; e[6].shape[0] = 0; e[6].shape[1] = 5;
    data[6] = NULL;
    strcpy(e[7].name, "q\"uote\\back\nline/\xc3\xa9");
    e[7].dtype = DTR_U8; e[7].ndim = 1; e[7].shape[0] = 3;
    data[7] = buf[4];

    tmp_path("dtr_st", "all.safetensors", path, sizeof path);
    CHECK_MSG(dtr_st_write(path, e, data, 8, err, sizeof err) == DTR_OK, "%s", err);
    CHECK_MSG(dtr_st_open(path, NULL, &f, err, sizeof err) == DTR_OK, "%s", err);
    CHECK_EQ_INT(f.count, 8);
    if (f.count == 8) {
        uint64_t hlen = 0;
        for (k = 7; k >= 0; k--) hlen = (hlen << 8) | ((unsigned char *)f.bytes)[k];
        CHECK_EQ_INT(hlen % 8, 0);   /* padded: data 8-byte aligned in the file */
        for (i = 0; i < 8; i++) {
            size_t nb = (size_t)(f.entries[i].end - f.entries[i].begin);
            CHECK(strcmp(f.entries[i].name, e[i].name) == 0);   /* order kept */
            CHECK_EQ_INT(f.entries[i].dtype, e[i].dtype);
            CHECK_EQ_INT(f.entries[i].ndim, e[i].ndim);
            for (k = 0; k < e[i].ndim; k++) CHECK_EQ_INT(f.entries[i].shape[k], e[i].shape[k]);
            if (i < 5) CHECK_EQ_INT(nb, 24 * dtr_dtype_size(e[i].dtype));
            if (nb) CHECK(memcmp(f.entries[i].data, data[i], nb) == 0);
            CHECK_EQ_INT((const unsigned char *)f.entries[i].data - (const unsigned char *)f.bytes,
                         (long long)(8 + hlen + f.entries[i].begin));
        }
        CHECK_EQ_INT(f.entries[5].end - f.entries[5].begin, 4);
        CHECK_EQ_INT(f.entries[6].end - f.entries[6].begin, 0);
    }
    dtr_st_destroy(&f);
    CHECK(f.entries == NULL && f.bytes == NULL);
    dtr_st_destroy(&f);   /* twice is harmless */
    dtr_st_destroy(NULL);
    remove(path);
}

static void test_write_replaces_atomically(void) {
    float a[4] = { 1, 2, 3, 4 }, b[2] = { 5, 6 };
    const void *da[1], *db[1];
    dtr_st_entry e;
    dtr_st_file f;
    char path[512], tmp[600], err[512] = "";
    memset(&e, 0, sizeof e);
    strcpy(e.name, "w");
    e.dtype = DTR_F32; e.ndim = 1; e.shape[0] = 4;
    da[0] = a; db[0] = b;
    tmp_path("dtr_st", "replace.safetensors", path, sizeof path);
    CHECK(dtr_st_write(path, &e, da, 1, err, sizeof err) == DTR_OK);
    e.shape[0] = 2;
    CHECK(dtr_st_write(path, &e, db, 1, err, sizeof err) == DTR_OK);
    CHECK_MSG(dtr_st_open(path, NULL, &f, err, sizeof err) == DTR_OK, "%s", err);
    CHECK_EQ_INT(f.count, 1);
    if (f.count == 1) {
        CHECK_EQ_INT(f.entries[0].shape[0], 2);
        CHECK(memcmp(f.entries[0].data, b, sizeof b) == 0);
    }
    dtr_st_destroy(&f);
#ifndef _WIN32
    snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid());
    CHECK(!file_exists(tmp));
#else
    (void)tmp;
#endif
    remove(path);
}

static void test_zero_tensors(void) {
    dtr_st_file f;
    char path[512], err[512] = "";
    tmp_path("dtr_st", "none.safetensors", path, sizeof path);
    CHECK_MSG(dtr_st_write(path, NULL, NULL, 0, err, sizeof err) == DTR_OK, "%s", err);
    CHECK_MSG(dtr_st_open(path, NULL, &f, err, sizeof err) == DTR_OK, "%s", err);
    CHECK_EQ_INT(f.count, 0);
    CHECK_EQ_INT(f.size, 16);   /* 8 + "{}" padded to 8 */
    dtr_st_destroy(&f);
    remove(path);
}

/* Tensors "f32", "bf16", "f16", "i32", "u8" of shape (2, 3, 4) holding 0, 1, ... 23, plus
 * "scalar" = 7.5 (f32) and "empty" (0, 3) (f16). With DTR_ST_EXPORT=<path> the file is
 * kept there for tests/make_fixtures.py (`check --arange <path>`: the pure-Python reader
 * and PyTorch read it back); otherwise it goes to the temp directory and is removed. */
static void test_export_arange(void) {
    static const dtr_dtype dts[5] = { DTR_F32, DTR_BF16, DTR_F16, DTR_I32, DTR_U8 };
    float f[24], scalar = 7.5f;
    int32_t ints[24];
    uint16_t bf[24], hf[24];
    unsigned char u[24];
    const void *data[7];
    dtr_st_entry e[7];
    dtr_st_file f_in;
    const char *exp = getenv("DTR_ST_EXPORT");
    char path[512], err[512] = "";
    int i;
    for (i = 0; i < 24; i++) {
        f[i] = (float)i;
        ints[i] = i;
        bf[i] = dtr_f32_to_bf16((float)i);
        hf[i] = dtr_f32_to_f16((float)i);
        u[i] = (unsigned char)i;
    }
    data[0] = f; data[1] = bf; data[2] = hf; data[3] = ints; data[4] = u; data[5] = &scalar; data[6] = NULL;
    memset(e, 0, sizeof e);
    for (i = 0; i < 5; i++) {
        strcpy(e[i].name, i == 0 ? "f32" : i == 1 ? "bf16" : i == 2 ? "f16" : i == 3 ? "i32" : "u8");
        e[i].dtype = dts[i];
        e[i].ndim = 3;
        e[i].shape[0] = 2; e[i].shape[1] = 3; e[i].shape[2] = 4;
    }
    strcpy(e[5].name, "scalar"); e[5].dtype = DTR_F32;
    strcpy(e[6].name, "empty"); e[6].dtype = DTR_F16; e[6].ndim = 2; e[6].shape[1] = 3;
    if (exp && exp[0]) snprintf(path, sizeof path, "%s", exp);
    else tmp_path("dtr_st", "arange.safetensors", path, sizeof path);
    CHECK_MSG(dtr_st_write(path, e, data, 7, err, sizeof err) == DTR_OK, "%s", err);
    CHECK_MSG(dtr_st_open(path, NULL, &f_in, err, sizeof err) == DTR_OK, "%s", err);
    CHECK_EQ_INT(f_in.count, 7);
    if (f_in.count == 7) {
        uint16_t v;
        memcpy(&v, (const unsigned char *)f_in.entries[1].data + 2 * 23, 2);
        CHECK(dtr_bf16_to_f32(v) == 23.0f);
        memcpy(&v, (const unsigned char *)f_in.entries[2].data + 2 * 23, 2);
        CHECK(dtr_f16_to_f32(v) == 23.0f);
    }
    dtr_st_destroy(&f_in);
    if (!(exp && exp[0])) remove(path);
}

/* The layout of the reference implementation: __metadata__ first, keys sorted, header
 * padded with spaces, JSON whitespace allowed. */
static void test_reference_layout(void) {
    dtr_st_file f;
    char err[512] = "";
    size_t n = make_img_len("{\"__metadata__\":{\"format\":\"pt\",\"note\":\"caf\\u00e9 \\ud83d\\ude00\"},"
                            " \"a\" : {\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},\n"
                            "\"b\":{\"data_offsets\":[8,12],\"shape\":[1,2],\"dtype\":\"BF16\"}}", 5, 12, 0);
    CHECK_MSG(dtr_st_parse(img, n, NULL, &f, err, sizeof err) == DTR_OK, "%s", err);
    CHECK_EQ_INT(f.count, 2);
    if (f.count == 2) {
        CHECK(strcmp(f.entries[0].name, "a") == 0 && strcmp(f.entries[1].name, "b") == 0);
        CHECK(f.entries[1].dtype == DTR_BF16 && f.entries[1].ndim == 2 && f.entries[1].shape[1] == 2);
        CHECK(f.entries[1].data == img + n - 4);
        CHECK(f.bytes == NULL);   /* the caller owns the image */
    }
    dtr_st_destroy(&f);
}

/* ---- bad files: length and framing ---- */

static void test_bad_header_length(void) {
    size_t n;
    expect_bad(5, DTR_CORRUPT_FILE, "too short", __LINE__);
    n = make_img_len("{}", 0, 0, 1000);
    expect_bad(n, DTR_CORRUPT_FILE, "bad header length 1000", __LINE__);
    n = make_img_len("{}", 0, 0, 200000000ull);
    expect_bad(n, DTR_CORRUPT_FILE, "100 MB", __LINE__);
    n = make_img_len("{}", 0, 0, ~0ull);
    expect_bad(n, DTR_CORRUPT_FILE, "bad header length", __LINE__);
    n = make_img_len("", 0, 0, 0);   /* a zero-length header */
    expect_bad(n, DTR_CORRUPT_FILE, "must start with '{'", __LINE__);
}

static void test_truncated(void) {
    /* valid with 8 data bytes; cut the data, then cut into the header */
    size_t n = make_img("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8);
    expect_bad(n - 3, DTR_CORRUPT_FILE, "out of range", __LINE__);
    expect_bad(n - 20, DTR_CORRUPT_FILE, "bad header length", __LINE__);
}

static void test_not_json(void) {
    BAD("hello world", 0, DTR_CORRUPT_FILE, "must start with '{'");
    BAD("{\"a\": }", 0, DTR_CORRUPT_FILE, "not valid JSON");
    BAD("{\"a\":{\"dtype\":\"F32\",\"shape\":[],\"data_offsets\":[0,4]},}", 4, DTR_CORRUPT_FILE, "expected a string");
    BAD("{} x", 0, DTR_CORRUPT_FILE, "trailing characters");
    BAD("{}{}", 0, DTR_CORRUPT_FILE, "trailing characters");
    BAD("{\"a\\q\":1}", 0, DTR_CORRUPT_FILE, "bad escape");
    BAD("{\"a\\ud800\":1}", 0, DTR_CORRUPT_FILE, "surrogate");
    BAD("{\"a\tb\":1}", 0, DTR_CORRUPT_FILE, "control character");
    BAD("{\"\xff\":1}", 0, DTR_CORRUPT_FILE, "invalid UTF-8");
    BAD("{\"\xc0\xaf\":1}", 0, DTR_CORRUPT_FILE, "invalid UTF-8");   /* overlong */
    BAD("{\"a\":{\"dtype\":\"F32\",\"shape\":[01],\"data_offsets\":[0,4]}}", 4, DTR_CORRUPT_FILE, "not valid JSON");
    BAD("{\"a\":tru}", 0, DTR_CORRUPT_FILE, "expected a JSON value");
    BAD("{\"unterminated", 0, DTR_CORRUPT_FILE, "unterminated string");
    BAD("[1,2]", 0, DTR_CORRUPT_FILE, "must start with '{'");
}

static void test_deep_nesting(void) {
    static char h[4096];
    int i, n = 0;
    n += sprintf(h + n, "{\"__metadata__\":");
    for (i = 0; i < 1000; i++) h[n++] = '[';
    for (i = 0; i < 1000; i++) h[n++] = ']';
    h[n++] = '}';
    h[n] = '\0';
    BAD(h, 0, DTR_CORRUPT_FILE, "nested too deeply");
    /* 1000 unclosed: must not recurse past the limit either */
    h[16 + 1000] = '\0';
    BAD(h, 0, DTR_CORRUPT_FILE, "nested too deeply");
}

/* ---- bad files: entries ---- */

static void test_missing_and_unknown_fields(void) {
    BAD("{\"w\":{\"dtype\":\"F32\",\"shape\":[1]}}", 4, DTR_CORRUPT_FILE, "tensor \"w\": missing field \"data_offsets\"");
    BAD("{\"w\":{\"shape\":[1],\"data_offsets\":[0,4]}}", 4, DTR_CORRUPT_FILE, "missing field \"dtype\"");
    BAD("{\"w\":{\"dtype\":\"F32\",\"data_offsets\":[0,4]}}", 4, DTR_CORRUPT_FILE, "missing field \"shape\"");
    BAD("{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4],\"extra\":1}}", 4, DTR_CORRUPT_FILE,
        "tensor \"w\": unknown field \"extra\"");
    BAD("{\"w\":{\"dtype\":\"F32\",\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4, DTR_CORRUPT_FILE,
        "duplicate field \"dtype\"");
    BAD("{\"w\":[1]}", 0, DTR_CORRUPT_FILE, "tensor \"w\": entry is not an object");
    BAD("{\"w\":{\"dtype\":7,\"shape\":[1],\"data_offsets\":[0,4]}}", 4, DTR_CORRUPT_FILE, "dtype: expected a string");
    BAD("{\"w\":{\"dtype\":\"F32\",\"shape\":1,\"data_offsets\":[0,4]}}", 4, DTR_CORRUPT_FILE, "shape is not an array");
    BAD("{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0]}}", 4, DTR_CORRUPT_FILE, "data_offsets must be [begin, end]");
    BAD("{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4,8]}}", 4, DTR_CORRUPT_FILE, "data_offsets must be [begin, end]");
}

/* Dtypes of the format that dtrain does not hold parse as `foreign` entries, sizes checked;
 * names outside the format are refused. */
static void test_unknown_dtype(void) {
    dtr_st_file f;
    char err[256];
    size_t n = make_img("{\"w\":{\"dtype\":\"F64\",\"shape\":[1],\"data_offsets\":[0,8]},"
                        "\"ids\":{\"dtype\":\"I64\",\"shape\":[2],\"data_offsets\":[8,24]},"
                        "\"m\":{\"dtype\":\"BOOL\",\"shape\":[3],\"data_offsets\":[24,27]}}", 27);
    CHECK_OK(NULL, dtr_st_parse(img, n, NULL, &f, err, sizeof err));
    CHECK_EQ_INT(f.count, 3);
    if (f.count == 3) {
        CHECK(f.entries[0].foreign && strcmp(f.entries[0].dtype_name, "F64") == 0);
        CHECK(f.entries[1].foreign && strcmp(f.entries[1].dtype_name, "I64") == 0 && f.entries[1].end - f.entries[1].begin == 16);
        CHECK(f.entries[2].foreign && strcmp(f.entries[2].dtype_name, "BOOL") == 0);
    }
    dtr_st_destroy(&f);
    BAD("{\"ids\":{\"dtype\":\"I64\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8, DTR_CORRUPT_FILE, "I64 x 2 elements need 16");
    BAD("{\"w\":{\"dtype\":\"f32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4, DTR_UNSUPPORTED, "dtype \"f32\" is not a safetensors dtype");
    BAD("{\"w\":{\"dtype\":\"Q7\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4, DTR_UNSUPPORTED, "dtype \"Q7\"");
}

/* dtr_model_load skips entries it does not ask for whatever their dtype (Hugging Face files
 * carry I64 position_ids), and refuses a parameter stored as such a dtype. */
static void test_model_load_skips_foreign(void) {
    static const char hdr[] = "{\"position_ids\":{\"dtype\":\"I64\",\"shape\":[2],\"data_offsets\":[0,16]},"
                              "\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[16,24]},"
                              "\"flag\":{\"dtype\":\"BOOL\",\"shape\":[1],\"data_offsets\":[24,25]}}";
    dtr_context *ctx = test_ctx(1);
    dtr_model *m = NULL;
    int64_t two = 2;
    char path[512];
    float w[2] = {1.5f, -2.0f};
    size_t n = make_img(hdr, 25);
    FILE *fp;
    memcpy(img + 8 + strlen(hdr) + 16, w, sizeof w);
    tmp_path("dtr_st", "foreign.safetensors", path, sizeof path);
    fp = fopen(path, "wb");
    CHECK(fp && fwrite(img, 1, n, fp) == n);
    if (fp) fclose(fp);
    CHECK_OK(ctx, dtr_model_create(ctx, 1, &m));
    dtr_model_param(m, "w", 1, &two, DTR_INIT_ZEROS, 0.0f);
    CHECK_OK(ctx, dtr_model_load(m, path));
    CHECK(dtr_model_params(m)[0] == 1.5f && dtr_model_params(m)[1] == -2.0f);
    dtr_model_destroy(m);
    CHECK_OK(ctx, dtr_model_create(ctx, 1, &m));
    dtr_model_param(m, "position_ids", 1, &two, DTR_INIT_ZEROS, 0.0f);
    CHECK_EQ_INT(dtr_model_load(m, path), DTR_DTYPE_MISMATCH);
    CHECK(strstr(dtr_context_last_error(ctx), "'position_ids' is I64") != NULL);
    dtr_model_destroy(m);
    remove(path);
    dtr_context_destroy(ctx);
}

static void test_bad_shapes(void) {
    BAD("{\"w\":{\"dtype\":\"F32\",\"shape\":[2,-1],\"data_offsets\":[0,8]}}", 8, DTR_CORRUPT_FILE, "tensor \"w\": shape[1] is negative");
    BAD("{\"w\":{\"dtype\":\"F32\",\"shape\":[2.0],\"data_offsets\":[0,8]}}", 8, DTR_CORRUPT_FILE, "fraction or exponent");
    BAD("{\"w\":{\"dtype\":\"F32\",\"shape\":[2e0],\"data_offsets\":[0,8]}}", 8, DTR_CORRUPT_FILE, "fraction or exponent");
    BAD("{\"w\":{\"dtype\":\"F32\",\"shape\":[\"2\"],\"data_offsets\":[0,8]}}", 8, DTR_CORRUPT_FILE, "shape[0]: expected a non-negative integer");
    BAD("{\"w\":{\"dtype\":\"U8\",\"shape\":[1,1,1,1,1,1,1],\"data_offsets\":[0,1]}}", 1, DTR_UNSUPPORTED, "more than 6 dims");
    BAD("{\"w\":{\"dtype\":\"U8\",\"shape\":[99999999999999999999],\"data_offsets\":[0,1]}}", 1, DTR_CORRUPT_FILE, "overflows 64 bits");
    BAD("{\"w\":{\"dtype\":\"U8\",\"shape\":[9223372036854775808],\"data_offsets\":[0,1]}}", 1, DTR_CORRUPT_FILE, "too large");
    BAD("{\"w\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296],\"data_offsets\":[0,1]}}", 1, DTR_CORRUPT_FILE, "overflows");
}

static void test_bad_offsets(void) {
    BAD("{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,16]}}", 8, DTR_CORRUPT_FILE, "size mismatch");
    BAD("{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,0]}}", 8, DTR_CORRUPT_FILE, "begin is after end");
    BAD("{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,16]}}", 8, DTR_CORRUPT_FILE, "out of range");
    BAD("{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,-8]}}", 8, DTR_CORRUPT_FILE, "data_offsets");
    BAD("{\"w\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[18446744073709551615,18446744073709551615]}}", 0,
        DTR_CORRUPT_FILE, "out of range");
    BAD("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
        "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}", 12, DTR_CORRUPT_FILE,
        "tensors \"a\" [0, 8) and \"b\" [4, 12) overlap");
    BAD("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
        "\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,12]}}", 12, DTR_CORRUPT_FILE,
        "gap in the data section: bytes [4, 8) before tensor \"b\"");
    BAD("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}", 8, DTR_CORRUPT_FILE, "gap in the data section: bytes [0, 4)");
    BAD("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 6, DTR_CORRUPT_FILE, "2 bytes left over");
    BAD("{}", 3, DTR_CORRUPT_FILE, "no tensors but the data section has 3 bytes");
}

static void test_names(void) {
    static char h[1024];
    char name[300];
    memset(name, 'n', 256);
    name[256] = '\0';
    BAD("{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]},"
        "\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[1,2]}}", 2, DTR_CORRUPT_FILE, "duplicate tensor name \"a\"");
    /* the same name spelled with an escape is still a duplicate */
    BAD("{\"ab\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]},"
        "\"\\u0061b\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[1,2]}}", 2, DTR_CORRUPT_FILE, "duplicate tensor name \"ab\"");
    snprintf(h, sizeof h, "{\"%s\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}", name);
    BAD(h, 1, DTR_CORRUPT_FILE, "is 256 bytes long (the limit is 255)");
    name[255] = '\0';   /* 255 bytes is fine */
    snprintf(h, sizeof h, "{\"%s\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}", name);
    {
        dtr_st_file f;
        char err[512] = "";
        CHECK_MSG(dtr_st_parse(img, make_img(h, 1), NULL, &f, err, sizeof err) == DTR_OK, "%s", err);
        CHECK(f.count == 1 && strlen(f.entries[0].name) == 255);
        dtr_st_destroy(&f);
    }
    BAD("{\"a\\u0000b\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}", 1, DTR_CORRUPT_FILE, "NUL character");
}

static void test_metadata(void) {
    BAD("{\"__metadata__\":{\"k\":1}}", 0, DTR_CORRUPT_FILE, "value of \"k\" must be a string");
    BAD("{\"__metadata__\":[]}", 0, DTR_CORRUPT_FILE, "__metadata__ is not an object");
    BAD("{\"__metadata__\":{},\"__metadata__\":{}}", 0, DTR_CORRUPT_FILE, "duplicate \"__metadata__\"");
}

/* ---- open, allocation, writer arguments ---- */

static void test_open_errors(void) {
    dtr_st_file f;
    char path[512], err[512] = "";
    FILE *fp;
    size_t n;
    CHECK(dtr_st_open("/nonexistent/dir/x.safetensors", NULL, &f, err, sizeof err) == DTR_IO_ERROR);
    CHECK(strstr(err, "/nonexistent/dir/x.safetensors") != NULL);
    tmp_path("dtr_st", "bad.safetensors", path, sizeof path);
    n = make_img("{\"w\":{\"dtype\":\"F32\",\"shape\":[-2],\"data_offsets\":[0,8]}}", 8);
    fp = fopen(path, "wb");
    CHECK(fp != NULL);
    if (fp) {
        fwrite(img, 1, n, fp);
        fclose(fp);
    }
    CHECK(dtr_st_open(path, NULL, &f, err, sizeof err) == DTR_CORRUPT_FILE);
    CHECK_MSG(strstr(err, path) != NULL && strstr(err, "shape[0] is negative") != NULL, "%s", err);
    CHECK(f.entries == NULL && f.bytes == NULL);
    remove(path);
    CHECK(dtr_st_parse(img, n, NULL, NULL, err, sizeof err) == DTR_NULL_HANDLE);
    CHECK(dtr_st_parse(NULL, 10, NULL, &f, err, sizeof err) == DTR_NULL_HANDLE);
    CHECK(dtr_st_parse(img, n, NULL, &f, NULL, 0) == DTR_CORRUPT_FILE);   /* err may be NULL */
}

static void test_allocation_callbacks(void) {
    count_alloc c;
    dtr_allocation_callbacks a;
    dtr_st_file f;
    char err[512] = "";
    long k, calls;
    size_t n = make_img("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
                        "\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}", 8);
    memset(&c, 0, sizeof c);
    a = count_alloc_callbacks(&c);
    CHECK(dtr_st_parse(img, n, &a, &f, err, sizeof err) == DTR_OK);
    CHECK(c.calls > 0);
    dtr_st_destroy(&f);
    CHECK_EQ_INT(c.live, 0);
    calls = c.calls;
    for (k = 1; k <= calls; k++) {   /* every allocation failing in turn */
        memset(&c, 0, sizeof c);
        c.fail_at = k;
        CHECK_EQ_INT(dtr_st_parse(img, n, &a, &f, err, sizeof err), DTR_OUT_OF_MEMORY);
        CHECK(strstr(err, "out of memory") != NULL);
        dtr_st_destroy(&f);
        CHECK_EQ_INT(c.live, 0);
    }
}

static void test_write_bad_arguments(void) {
    float x[2] = { 0, 0 };
    const void *data[2];
    dtr_st_entry e[2];
    char path[512], err[512] = "";
    data[0] = x; data[1] = x;
    memset(e, 0, sizeof e);
    strcpy(e[0].name, "a"); e[0].dtype = DTR_F32; e[0].ndim = 1; e[0].shape[0] = 2;
    e[1] = e[0];
    tmp_path("dtr_st", "args.safetensors", path, sizeof path);
    CHECK(dtr_st_write(path, e, data, 2, err, sizeof err) == DTR_INVALID_ARGUMENT);
    CHECK(strstr(err, "duplicate tensor name \"a\"") != NULL);
    strcpy(e[1].name, "__metadata__");
    CHECK(dtr_st_write(path, e, data, 2, err, sizeof err) == DTR_INVALID_ARGUMENT);
    CHECK(strstr(err, "reserved") != NULL);
    strcpy(e[1].name, "b");
    e[1].shape[0] = -2;
    CHECK(dtr_st_write(path, e, data, 2, err, sizeof err) == DTR_INVALID_ARGUMENT);
    CHECK(strstr(err, "negative") != NULL);
    e[1].shape[0] = 2;
    e[1].dtype = (dtr_dtype)42;
    CHECK(dtr_st_write(path, e, data, 2, err, sizeof err) == DTR_INVALID_ARGUMENT);
    CHECK(strstr(err, "unknown dtype") != NULL);
    e[1].dtype = DTR_F32;
    e[1].ndim = 7;
    CHECK(dtr_st_write(path, e, data, 2, err, sizeof err) == DTR_INVALID_ARGUMENT);
    e[1].ndim = 1;
    memset(e[1].name, 'x', sizeof e[1].name);
    CHECK(dtr_st_write(path, e, data, 2, err, sizeof err) == DTR_INVALID_ARGUMENT);
    CHECK(strstr(err, "NUL-terminated") != NULL);
    strcpy(e[1].name, "b");
    data[1] = NULL;
    CHECK(dtr_st_write(path, e, data, 2, err, sizeof err) == DTR_NULL_HANDLE);
    CHECK(dtr_st_write(NULL, e, data, 2, err, sizeof err) == DTR_NULL_HANDLE);
    CHECK(dtr_st_write(path, e, data, -1, err, sizeof err) == DTR_INVALID_ARGUMENT);
    CHECK(!file_exists(path));
    /* a directory that does not exist: I/O error naming the path, nothing left behind */
    data[1] = x;
    CHECK(dtr_st_write("/nonexistent/dir/m.safetensors", e, data, 2, err, sizeof err) == DTR_IO_ERROR);
    CHECK_MSG(strstr(err, "/nonexistent/dir/m.safetensors") != NULL, "%s", err);
#ifndef _WIN32
    {   /* the target is a directory: refused before anything is written */
        char tmp[600];
        tmp_path("dtr_st", "isdir", path, sizeof path);
        CHECK(mkdir(path, 0700) == 0);
        CHECK(dtr_st_write(path, e, data, 2, err, sizeof err) == DTR_INVALID_ARGUMENT);
        CHECK_MSG(strstr(err, "not a regular file (a folder)") != NULL, "%s", err);
        snprintf(tmp, sizeof tmp, "%s.tmp.%ld.1", path, (long)getpid());
        CHECK(!file_exists(tmp));
        rmdir(path);
    }
#endif
}

/* ---- checksums and hardening ---- */

/* Three tensors written by dtr_st_write into `path`; returns the file's size. */
static void write_three(const char *path, float *a, int16_t *b, float *c) {
    dtr_st_entry e[3];
    const void *data[3];
    char err[512] = "";
    int i;
    memset(e, 0, sizeof e);
    for (i = 0; i < 64; i++) a[i] = (float)i * 0.25f - 3.0f;
    for (i = 0; i < 32; i++) b[i] = (int16_t)(i * 77);
    for (i = 0; i < 16; i++) c[i] = 1.0f / (float)(i + 1);
    strcpy(e[0].name, "layer.weight"); e[0].dtype = DTR_F32; e[0].ndim = 2; e[0].shape[0] = 8; e[0].shape[1] = 8;
    strcpy(e[1].name, "layer.bias"); e[1].dtype = DTR_BF16; e[1].ndim = 1; e[1].shape[0] = 32;
    strcpy(e[2].name, "head"); e[2].dtype = DTR_F32; e[2].ndim = 1; e[2].shape[0] = 16;
    data[0] = a; data[1] = b; data[2] = c;
    CHECK_MSG(dtr_st_write(path, e, data, 3, err, sizeof err) == DTR_OK, "%s", err);
}

static unsigned char *read_whole(const char *path, size_t *n) {
    FILE *fp = fopen(path, "rb");
    unsigned char *p = NULL;
    long sz;
    *n = 0;
    if (!fp) return NULL;
    if (fseek(fp, 0, SEEK_END) == 0 && (sz = ftell(fp)) > 0 && fseek(fp, 0, SEEK_SET) == 0) {
        p = (unsigned char *)malloc((size_t)sz);
        if (p && fread(p, 1, (size_t)sz, fp) == (size_t)sz) *n = (size_t)sz;
    }
    fclose(fp);
    return p;
}

/* The writer stores a CRC-32C per tensor; every bit flipped in the data section, every
 * truncation and every flip in the header is refused naming the problem. */
static void test_checksums(void) {
    static float a[64], c[16];
    static int16_t b[32];
    dtr_st_file f;
    dtr_rng r;
    char path[512], err[512] = "";
    unsigned char *bytes, *copy;
    size_t n = 0, k, data_start, missed = 0;
    uint64_t hlen = 0;
    int i;
    CHECK_EQ_INT(dtr_crc32c(0, "123456789", 9), 0xE3069283u);   /* the standard check value */
    CHECK_EQ_INT(dtr_crc32c(dtr_crc32c(0, "1234", 4), "56789", 5), 0xE3069283u);
    tmp_path("dtr_st", "crc.safetensors", path, sizeof path);
    write_three(path, a, b, c);
    bytes = read_whole(path, &n);
    CHECK(bytes != NULL && n > 8);
    if (!bytes || n <= 8) return;
    CHECK(strstr((const char *)bytes + 8, "\"crc32c.layer.weight\":\"") != NULL);
    CHECK_MSG(dtr_st_parse(bytes, n, NULL, &f, err, sizeof err) == DTR_OK, "%s", err);
    for (i = 0; i < f.count; i++) CHECK(f.entries[i].has_crc32c);
    if (f.count == 3) CHECK_EQ_INT(f.entries[0].crc32c, dtr_crc32c(0, a, sizeof a));
    dtr_st_destroy(&f);
    for (i = 7; i >= 0; i--) hlen = (hlen << 8) | bytes[i];
    data_start = 8 + (size_t)hlen;
    copy = (unsigned char *)malloc(n);
    dtr_rng_seed(&r, 77, 1);
    for (i = 0; i < 2000 && copy; i++) {   /* the data section: each flip names the tensor */
        size_t at = data_start + dtr_rng_u32(&r) % (n - data_start);
        memcpy(copy, bytes, n);
        copy[at] ^= (unsigned char)(1u << (dtr_rng_u32(&r) % 8));
        if (dtr_st_parse(copy, n, NULL, &f, err, sizeof err) != DTR_CORRUPT_FILE || !strstr(err, "checksum mismatch")) missed++;
        dtr_st_destroy(&f);
    }
    CHECK_EQ_INT(missed, 0);
    for (k = 0; k < n * 8 && copy; k++) {   /* every bit of the length and the header */
        if (k / 8 >= data_start) break;
        memcpy(copy, bytes, n);
        copy[k / 8] ^= (unsigned char)(1u << (k % 8));
        if (dtr_st_parse(copy, n, NULL, &f, err, sizeof err) == DTR_OK) {
            fprintf(stderr, "  header bit %zu (byte %zu '%c') flipped and not detected\n", k, k / 8, bytes[k / 8]);
            missed++;
        }
        dtr_st_destroy(&f);
    }
    CHECK_EQ_INT(missed, 0);
    for (k = 0; k < n; k++) {   /* every truncation */
        if (dtr_st_parse(bytes, k, NULL, &f, err, sizeof err) != DTR_CORRUPT_FILE) missed++;
        dtr_st_destroy(&f);
    }
    CHECK_EQ_INT(missed, 0);
    free(copy);
    free(bytes);
    remove(path);
}

/* Hand-made headers: a checksum missing for one tensor, one for a tensor that is not there,
 * one that is not 8 lowercase hex digits; the app's own metadata keys are left alone. */
static void test_checksum_metadata(void) {
    static const char body[] = "\"a\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0,2]},"
                               "\"b\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[2,3]}}";
    char hdr[512], hex[9];
    uint32_t ca = dtr_crc32c(0, "\x00\x01", 2);
    snprintf(hex, sizeof hex, "%08x", (unsigned)ca);
    snprintf(hdr, sizeof hdr, "{\"__metadata__\":{\"format\":\"pt\",\"crc32c.a\":\"%s\"},%s", hex, body);
    BAD(hdr, 3, DTR_CORRUPT_FILE, "tensor \"b\" has no checksum while the others have one");
    snprintf(hdr, sizeof hdr, "{\"__metadata__\":{\"crc32c.zz\":\"%s\"},%s", hex, body);
    BAD(hdr, 3, DTR_CORRUPT_FILE, "checksum for \"zz\", which is not a tensor");
    snprintf(hdr, sizeof hdr, "{\"__metadata__\":{\"crc32c.a\":\"%.7sX\"},%s", hex, body);
    BAD(hdr, 3, DTR_CORRUPT_FILE, "is not 8 lowercase hex digits");
    snprintf(hdr, sizeof hdr, "{\"__metadata__\":{\"crc32c.a\":\"%s\",\"crc32c.b\":\"%08x\",\"mine\":\"x\"},%s", hex,
             (unsigned)dtr_crc32c(0, "\x02", 1), body);
    {
        dtr_st_file f;
        char err[512] = "";
        size_t n = make_img(hdr, 3);
        CHECK_MSG(dtr_st_parse(img, n, NULL, &f, err, sizeof err) == DTR_OK, "%s", err);
        CHECK(f.count == 2 && f.entries[0].has_crc32c && f.entries[1].has_crc32c);
        dtr_st_destroy(&f);
    }
}

#ifndef _WIN32
/* Saves killed midway leave "<path>.tmp.<pid>.<n>"; the next save removes those of dead
 * processes (a real SIGKILL during writes, and a planted one) and keeps a live one's. */
static void test_stale_temporaries(void) {
    static float big[1 << 20];
    char path[512], planted[600], live[600], err[512] = "";
    dtr_st_entry e;
    const void *data[1];
    pid_t child;
    int st, round;
    memset(&e, 0, sizeof e);
    strcpy(e.name, "w");
    e.dtype = DTR_F32; e.ndim = 1; e.shape[0] = 1 << 20;
    data[0] = big;
    tmp_path("dtr_st", "stale.safetensors", path, sizeof path);
    for (round = 0; round < 3; round++) {   /* a child that saves in a loop, killed midway */
        child = fork();
        if (child == 0) {
            for (;;) dtr_st_write(path, &e, data, 1, err, sizeof err);
        }
        sleep_ms(20 + 15 * round);
        kill(child, SIGKILL);
        waitpid(child, &st, 0);
    }
    child = fork();
    if (child == 0) _exit(0);
    waitpid(child, &st, 0);
    snprintf(planted, sizeof planted, "%s.tmp.%ld.7", path, (long)child);
    snprintf(live, sizeof live, "%s.tmp.1.7", path);   /* pid 1 is alive */
    CHECK(write_file(planted, "junk", 4) && write_file(live, "junk", 4));
    CHECK_MSG(dtr_st_write(path, &e, data, 1, err, sizeof err) == DTR_OK, "%s", err);
    CHECK(!file_exists(planted));
    CHECK(file_exists(live));
    {   /* nothing but the file and the live process's temporary is left */
        char dir[512], *slash;
        const char *base;
        int others = 0;
        DIR *dp;
        struct dirent *d;
        snprintf(dir, sizeof dir, "%s", path);
        slash = strrchr(dir, '/');
        *slash = '\0';
        base = slash + 1;
        dp = opendir(dir);
        while (dp && (d = readdir(dp)) != NULL)
            if (strncmp(d->d_name, base, strlen(base)) == 0 && strstr(d->d_name, ".tmp.") && strcmp(d->d_name, strrchr(live, '/') + 1) != 0) others++;
        if (dp) closedir(dp);
        CHECK_EQ_INT(others, 0);
    }
    remove(live);
    remove(path);
}

/* A FIFO, a folder or a device at the target is refused and left as it was; reading a
 * folder is an I/O error naming it, for dtr_st_open and dtr_model_load. */
static void test_special_paths(void) {
    dtr_context *ctx = test_ctx(1);
    dtr_model *m = NULL;
    dtr_st_entry e;
    dtr_st_file f;
    const void *data[1];
    float w[2] = { 1, 2 };
    int64_t two = 2;
    char fifo[512], dir[512], err[512] = "";
    struct stat st;
    memset(&e, 0, sizeof e);
    strcpy(e.name, "w");
    e.dtype = DTR_F32; e.ndim = 1; e.shape[0] = 2;
    data[0] = w;
    tmp_path("dtr_st", "fifo", fifo, sizeof fifo);
    tmp_path("dtr_st", "folder", dir, sizeof dir);
    CHECK(mkfifo(fifo, 0600) == 0 && mkdir(dir, 0700) == 0);
    CHECK(dtr_st_write(fifo, &e, data, 1, err, sizeof err) == DTR_INVALID_ARGUMENT);
    CHECK_MSG(strstr(err, "(a FIFO): refusing to replace it") != NULL, "%s", err);
    CHECK(stat(fifo, &st) == 0 && S_ISFIFO(st.st_mode));
    CHECK(dtr_st_write("/dev/null", &e, data, 1, err, sizeof err) == DTR_INVALID_ARGUMENT);
    CHECK(stat("/dev/null", &st) == 0 && S_ISCHR(st.st_mode));
    CHECK(dtr_st_open(dir, NULL, &f, err, sizeof err) == DTR_IO_ERROR);
    CHECK_MSG(strstr(err, dir) && strstr(err, "not a regular file"), "%s", err);
    CHECK_OK(ctx, dtr_model_create(ctx, 1, &m));
    dtr_model_param(m, "w", 1, &two, DTR_INIT_ZEROS, 0.0f);
    CHECK_EQ_INT(dtr_model_load(m, dir), DTR_IO_ERROR);
    CHECK_MSG(strstr(dtr_context_last_error(ctx), dir) != NULL, "%s", dtr_context_last_error(ctx));
    CHECK_EQ_INT(dtr_model_save(m, fifo, DTR_F32), DTR_INVALID_ARGUMENT);
    dtr_model_destroy(m);
    dtr_context_destroy(ctx);
    remove(fifo);
    rmdir(dir);
}
#endif

/* dtr_model_save's file carries the checksums: a flipped bit in the weights is refused and
 * the model keeps its values. */
static void test_model_checksum(void) {
    dtr_context *ctx = test_ctx(1);
    dtr_model *m = NULL;
    int64_t shape[2] = { 4, 3 };
    char path[512];
    unsigned char *bytes;
    size_t n = 0;
    float before;
    tmp_path("dtr_st", "model_crc.safetensors", path, sizeof path);
    CHECK_OK(ctx, dtr_model_create(ctx, 1, &m));
    dtr_model_param(m, "w", 2, shape, DTR_INIT_NORMAL, 1.0f);
    CHECK_OK(ctx, dtr_model_save(m, path, DTR_F32));
    bytes = read_whole(path, &n);
    CHECK(bytes != NULL && n > 8);
    if (bytes && n > 8) {
        bytes[n - 5] ^= 0x10;
        CHECK(write_file(path, bytes, n));
        before = dtr_model_params(m)[10];
        CHECK_EQ_INT(dtr_model_load(m, path), DTR_CORRUPT_FILE);
        CHECK_MSG(strstr(dtr_context_last_error(ctx), "tensor \"w\": checksum mismatch") != NULL, "%s",
                  dtr_context_last_error(ctx));
        CHECK(dtr_model_params(m)[10] == before);
    }
    free(bytes);
    dtr_model_destroy(m);
    dtr_context_destroy(ctx);
    remove(path);
}

int main(void) {
    (void)test_ctx;
    RUN(test_roundtrip_all_dtypes);
    RUN(test_write_replaces_atomically);
    RUN(test_zero_tensors);
    RUN(test_export_arange);
    RUN(test_reference_layout);
    RUN(test_bad_header_length);
    RUN(test_truncated);
    RUN(test_not_json);
    RUN(test_deep_nesting);
    RUN(test_missing_and_unknown_fields);
    RUN(test_unknown_dtype);
    RUN(test_model_load_skips_foreign);
    RUN(test_bad_shapes);
    RUN(test_bad_offsets);
    RUN(test_names);
    RUN(test_metadata);
    RUN(test_open_errors);
    RUN(test_allocation_callbacks);
    RUN(test_write_bad_arguments);
    RUN(test_checksums);
    RUN(test_checksum_metadata);
    RUN(test_model_checksum);
#ifndef _WIN32
    RUN(test_stale_temporaries);
    RUN(test_special_paths);
#endif
    return test_summary();
}
