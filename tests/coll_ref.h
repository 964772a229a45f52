/* tests/coll_ref.h: reference all-reduce results in the documented reduction orders (see
 * docs/distributed.md, "Determinism: the exact order"), for tests/test_comm.c (local
 * transport) and tests/test_fabric.c (libfabric): the collectives must match them bit for
 * bit. x[r] is rank r's input as f32; bf16/f16 round after every operation as the library
 * does. */

static float rnd(dtr_dtype dt, float x) {
    if (dt == DTR_BF16) return dtr_bf16_to_f32(dtr_f32_to_bf16(x));
    if (dt == DTR_F16) return dtr_f16_to_f32(dtr_f32_to_f16(x));
    return x;
}

static float comb(dtr_dtype dt, dtr_reduce_op op, float a, float b, int div) {
    float v;
    if (op == DTR_REDUCE_MAX) v = (a > b || a != a) ? a : b;
    else v = div > 1 ? (a + b) / (float)div : a + b;
    return rnd(dt, v);
}

/* x[r][i]: inputs; ring order for element i of chunk k: start at rank k+1; an average
   divides by `div` in its last step */
static float ref_ring_elem(float *const *x, int N, dtr_dtype dt, dtr_reduce_op op, int k, size_t i, int div) {
    float acc;
    int j;
    if (N == 1) return x[0][i];
    acc = x[(k + 1) % N][i];
    for (j = 2; j <= N; j++) acc = comb(dt, op, acc, x[(k + j) % N][i], (j == N && op == DTR_REDUCE_AVG) ? div : 1);
    return acc;
}

static void ref_ring_div(float *const *x, int N, size_t count, dtr_dtype dt, dtr_reduce_op op, int div, float *out) {
    size_t q = count / (size_t)N, rem = count % (size_t)N, i;
    int k;
    for (k = 0; k < N; k++) {
        size_t off = (size_t)k * q + ((size_t)k < rem ? (size_t)k : rem), len = q + ((size_t)k < rem);
        for (i = off; i < off + len; i++) out[i] = ref_ring_elem(x, N, dt, op, k, i, div);
    }
}

static void ref_rd_div(float *const *x, int N, size_t count, dtr_dtype dt, dtr_reduce_op op, int div, float *out) {
    int p = 1, m, d, nr;
    size_t i;
    float v[64];   /* worlds up to 64 */
    while (p * 2 <= N) p *= 2;
    m = N - p;
    for (i = 0; i < count; i++) {
        if (N == 1) { out[i] = x[0][i]; continue; }
        for (nr = 0; nr < p; nr++) v[nr] = nr < m ? comb(dt, op, x[2 * nr][i], x[2 * nr + 1][i], 1) : x[nr + m][i];
        for (d = 1; d < p; d *= 2) {
            int dv = (d * 2 >= p && op == DTR_REDUCE_AVG) ? div : 1;
            for (nr = 0; nr < p; nr++)
                if (!(nr & d)) {
                    float s = comb(dt, op, v[nr], v[nr | d], dv);
                    v[nr] = v[nr | d] = s;
                }
        }
        out[i] = v[0];
    }
}

static void ref_ring(float *const *x, int N, size_t count, dtr_dtype dt, dtr_reduce_op op, float *out) {
    ref_ring_div(x, N, count, dt, op, N, out);
}
static void ref_rd(float *const *x, int N, size_t count, dtr_dtype dt, dtr_reduce_op op, float *out) {
    ref_rd_div(x, N, count, dt, op, N, out);
}

/* the library's AUTO choice for a group of g ranks */
static void ref_auto(float *const *x, int g, size_t count, dtr_dtype dt, dtr_reduce_op op, int div, size_t ring_bytes,
                     float *out) {
    if (count * dtr_dtype_size(dt) >= ring_bytes && count >= (size_t)g) ref_ring_div(x, g, count, dt, op, div, out);
    else ref_rd_div(x, g, count, dt, op, div, out);
}

/* Hierarchical all-reduce over hosts of k consecutive ranks (the last may hold fewer): each
   host's sum in its AUTO order (an average sums), then the leaders' AUTO order over the host
   sums in host order, an average divided by N in its last step. */
static void ref_hier(float *const *x, int N, int k, size_t count, dtr_dtype dt, dtr_reduce_op op, size_t ring_bytes,
                     float *out) {
    float *sums[64] = {0};
    int H = (N + k - 1) / k, h;
    for (h = 0; h < H; h++) {
        int g = N - h * k < k ? N - h * k : k;
        sums[h] = (float *)malloc((count + 1) * sizeof(float));
        ref_auto(x + h * k, g, count, dt, op == DTR_REDUCE_AVG ? DTR_REDUCE_SUM : op, 1, ring_bytes, sums[h]);
    }
    ref_auto(sums, H, count, dt, op, N, ring_bytes, out);
    for (h = 0; h < H; h++) free(sums[h]);
}

static void to_dtype(dtr_dtype dt, const float *src, void *dst, size_t n) { dtr_convert(dst, dt, src, DTR_F32, n); }
static void from_dtype(dtr_dtype dt, const void *src, float *dst, size_t n) { dtr_convert(dst, DTR_F32, src, dt, n); }
