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

/* x[r][i]: inputs; ring order for element i of chunk k: start at rank k+1 */
static float ref_ring_elem(float *const *x, int N, dtr_dtype dt, dtr_reduce_op op, int k, size_t i) {
    float acc;
    int j;
    if (N == 1) return x[0][i];
    acc = x[(k + 1) % N][i];
    for (j = 2; j <= N; j++) acc = comb(dt, op, acc, x[(k + j) % N][i], (j == N && op == DTR_REDUCE_AVG) ? N : 1);
    return acc;
}

static void ref_ring(float *const *x, int N, size_t count, dtr_dtype dt, dtr_reduce_op op, float *out) {
    size_t q = count / (size_t)N, rem = count % (size_t)N, i;
    int k;
    for (k = 0; k < N; k++) {
        size_t off = (size_t)k * q + ((size_t)k < rem ? (size_t)k : rem), len = q + ((size_t)k < rem);
        for (i = off; i < off + len; i++) out[i] = ref_ring_elem(x, N, dt, op, k, i);
    }
}

static void ref_rd(float *const *x, int N, size_t count, dtr_dtype dt, dtr_reduce_op op, float *out) {
    int p = 1, m, d, nr;
    size_t i;
    float v[64];   /* worlds up to 64 */
    while (p * 2 <= N) p *= 2;
    m = N - p;
    for (i = 0; i < count; i++) {
        if (N == 1) { out[i] = x[0][i]; continue; }
        for (nr = 0; nr < p; nr++) v[nr] = nr < m ? comb(dt, op, x[2 * nr][i], x[2 * nr + 1][i], 1) : x[nr + m][i];
        for (d = 1; d < p; d *= 2) {
            int div = (d * 2 >= p && op == DTR_REDUCE_AVG) ? N : 1;
            for (nr = 0; nr < p; nr++)
                if (!(nr & d)) {
                    float s = comb(dt, op, v[nr], v[nr | d], div);
                    v[nr] = v[nr | d] = s;
                }
        }
        out[i] = v[0];
    }
}

static void to_dtype(dtr_dtype dt, const float *src, void *dst, size_t n) { dtr_convert(dst, dt, src, DTR_F32, n); }
static void from_dtype(dtr_dtype dt, const void *src, float *dst, size_t n) { dtr_convert(dst, DTR_F32, src, dt, n); }
