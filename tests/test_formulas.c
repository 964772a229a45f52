/* tests/test_formulas.c: the element formulas of src/core/formulas.h, which the CPU kernels
 * and the CUDA kernels both call, checked on the CPU against independent references:
 *   test_pcg_jump        jumping ahead n draws equals n steps; dropout's per-element draw (how a
 *                        GPU thread gets its mask) equals the CPU op's mask
 *   test_conversions     bf16 / f16 rounding (ties to even, subnormals, overflow, NaN) against
 *                        double-precision references; load/store over every dtype
 *   test_activations     each activation against a double reference, each derivative against
 *                        a central difference of it
 *   test_own_math        the own exp, tanh and erf (GELU's, sigmoid's) within 1.5
 *                        units in the last place of double's, special values
 *   test_optimizer       SGD (momentum, Nesterov), Adam, AdamW and LAMB element updates over
 *                        10 steps against textbook double-precision updates
 *   test_adam_blocks     the CPU backend's Adam / AdamW loop (square roots taken 8 at a time)
 *                        equals dtr__f_adam element by element, bit for bit
 *   test_launch_shapes   the CUDA launch arithmetic: grid sizes and row-reduction block sizes
 * Built against the internal API (DTRAIN_INTERNAL_API) to reach the static inline formulas. */
#define DTRAIN_INTERNAL_API
#include "test.h"

static void test_pcg_jump(void) {
    dtr_rng r, j;
    uint64_t n;
    int k;
    dtr_rng_seed(&r, 1234, 7);
    j = r;
    for (n = 0; n < 300; n++) {
        CHECK(dtr__f_pcg_advance(j.state, j.inc, n) == r.state);
        dtr_rng_u32(&r);
    }
    {   /* a large jump against stepping */
        dtr_rng a = j;
        uint64_t st = dtr__f_pcg_advance(j.state, j.inc, 100000);
        for (k = 0; k < 100000; k++) dtr_rng_u32(&a);
        CHECK(st == a.state);
    }
    {   /* dropout: the CPU's mask is draw i of the op's stream, each computable on its own */
        dtr_context *ctx = test_ctx(1);
        int64_t shape[1] = {257};
        float ones[257], out[257];
        dtr_tensor *x, *y;
        dtr_rng start;
        int bad = 0;
        for (k = 0; k < 257; k++) ones[k] = 1.0f;
        dtr_context_set_training(ctx, 1);
        start = ctx->rng;
        x = dtr_tensor_from(ctx, DTR_F32, 1, shape, ones);
        y = dtr_dropout(ctx, x, 0.3f);
        CHECK(y && dtr_tensor_read(y, DTR_F32, out, 257) == DTR_OK);
        for (k = 0; y && k < 257; k++) {
            uint64_t st = dtr__f_pcg_advance(start.state, start.inc, (uint64_t)k);
            float m = dtr__f_dropout_mask(dtr__f_pcg_next(&st, start.inc), 0.3f);
            bad += out[k] != m;
        }
        CHECK_EQ_INT(bad, 0);
        dtr_context_destroy(ctx);
    }
}

/* The nearest bf16 (ties to even) of x, computed in double from the float's value. */
static float bf16_ref(float x) {
    double a = fabs((double)x), scale, q, fl;
    int e;
    if (a == 0.0 || isinf(x)) return x;
    frexp(a, &e);                     /* a = m 2^e, m in [0.5, 1) */
    scale = ldexp(1.0, 8 - e);        /* 8 significant bits */
    q = a * scale;
    fl = floor(q);
    if (q - fl > 0.5 || (q - fl == 0.5 && fmod(fl, 2.0) != 0.0)) fl += 1.0;
    return (float)((x < 0 ? -1.0 : 1.0) * fl / scale);
}

static void test_conversions(void) {
    dtr_rng r;
    int k, bad = 0;
    float vals[] = {1.0f, -2.5f, 1.00390625f /* 1 + 2^-8: a tie, stays 1 */, 1.01171875f /* 1 + 3 2^-8: tie, up */,
                    3.0e38f, 1e-30f, 0.0f, -0.0f};
    for (k = 0; k < (int)(sizeof vals / sizeof vals[0]); k++) bad += dtr__f_from_bf16(dtr__f_to_bf16(vals[k])) != bf16_ref(vals[k]);
    dtr_rng_seed(&r, 3, 3);
    for (k = 0; k < 100000; k++) {
        uint32_t u = dtr_rng_u32(&r);
        float f;
        if (((u >> 23) & 0xffu) == 0xffu || ((u >> 23) & 0xffu) == 0) continue;   /* normal numbers here */
        memcpy(&f, &u, 4);
        if (fabsf(f) > 3.38e38f) continue;                                           /* rounds to inf */
        bad += dtr__f_from_bf16(dtr__f_to_bf16(f)) != bf16_ref(f);
    }
    CHECK_EQ_INT(bad, 0);
    CHECK(isnan(dtr__f_from_bf16(dtr__f_to_bf16(NAN))));
    CHECK(dtr__f_to_f16(65504.0f) == 0x7bff && dtr__f_to_f16(65520.0f) == 0x7c00);   /* the largest half, then inf */
    CHECK(dtr__f_to_f16(5.960464477539063e-8f) == 0x0001);                           /* the smallest subnormal */
    CHECK(dtr__f_to_f16(2.98023223876953125e-8f) == 0x0000);                         /* half of it: a tie, to even (0) */
    CHECK(dtr__f_to_f16(8.940696716308594e-8f) == 0x0002);                           /* 1.5 units: a tie, to even (2) */
    CHECK(dtr__f_from_f16(0x3c00) == 1.0f && dtr__f_from_f16(0xc000) == -2.0f && isnan(dtr__f_from_f16(0x7e00)));
    for (k = -300; k <= 300; k++) {   /* every f16 in a range round-trips exactly */
        float f = (float)k / 64.0f;
        bad += dtr__f_from_f16(dtr__f_to_f16(f)) != f;
    }
    CHECK_EQ_INT(bad, 0);
    {   /* load / store over every dtype */
        float f32[1];
        uint16_t h[1];
        int32_t i32[1];
        uint8_t u8[1];
        dtr__f_store(f32, DTR_F32, 0, 1.5f);
        dtr__f_store(h, DTR_BF16, 0, 1.5f);
        CHECK(dtr__f_load(f32, DTR_F32, 0) == 1.5f && dtr__f_load(h, DTR_BF16, 0) == 1.5f);
        dtr__f_store(h, DTR_F16, 0, -0.25f);
        CHECK(dtr__f_load(h, DTR_F16, 0) == -0.25f);
        dtr__f_store(i32, DTR_I32, 0, -7.9f);
        CHECK(i32[0] == -7 && dtr__f_load(i32, DTR_I32, 0) == -7.0f);
        dtr__f_store(u8, DTR_U8, 0, 300.0f);
        CHECK(u8[0] == 255);
        dtr__f_store(u8, DTR_U8, 0, -3.0f);
        CHECK(u8[0] == 0);
    }
}

static double gelu_d(double x) { return 0.5 * x * (1.0 + tanh(0.7978845608028654 * (x + 0.044715 * x * x * x))); }
static double gelu_erf_d(double x) { return 0.5 * x * (1.0 + erf(x / sqrt(2.0))); }
static double sigmoid_d(double x) { return 1.0 / (1.0 + exp(-x)); }
static double silu_d(double x) { return x / (1.0 + exp(-x)); }

static void test_activations(void) {
    int k;
    double worst = 0.0, worst_g = 0.0, h = 1e-5;
    for (k = -400; k <= 400; k++) {
        double x = k / 50.0, e;
        float xf = (float)x;
        e = fabs(dtr__f_gelu(xf) - gelu_d(xf)) / (1.0 + fabs(gelu_d(xf)));
        e = fmax(e, fabs(dtr__f_gelu_erf(xf) - gelu_erf_d(xf)) / (1.0 + fabs(gelu_erf_d(xf))));
        e = fmax(e, fabs(dtr__f_sigmoid(xf) - sigmoid_d(xf)));
        e = fmax(e, fabs(dtr__f_silu(xf) - silu_d(xf)) / (1.0 + fabs(silu_d(xf))));
        worst = fmax(worst, e);
        e = fabs(dtr__f_gelu_grad(xf) - (gelu_d(xf + h) - gelu_d(xf - h)) / (2 * h));
        e = fmax(e, fabs(dtr__f_gelu_erf_grad(xf) - (gelu_erf_d(xf + h) - gelu_erf_d(xf - h)) / (2 * h)));
        e = fmax(e, fabs(dtr__f_sigmoid_grad(dtr__f_sigmoid(xf)) - (sigmoid_d(xf + h) - sigmoid_d(xf - h)) / (2 * h)));
        e = fmax(e, fabs(dtr__f_silu_grad(xf) - (silu_d(xf + h) - silu_d(xf - h)) / (2 * h)));
        e = fmax(e, fabs(dtr__f_tanh_grad(dtr__f_tanh(xf)) - (tanh(xf + h) - tanh(xf - h)) / (2 * h)));
        worst_g = fmax(worst_g, e);
    }
    CHECK_MSG(worst < 2e-6, "activation error %.3g", worst);
    CHECK_MSG(worst_g < 2e-5, "derivative error %.3g", worst_g);
    CHECK(dtr__f_relu(-1.0f) == 0.0f && dtr__f_relu(2.0f) == 2.0f && isnan(dtr__f_relu(NAN)));
    CHECK(dtr__f_relu_grad(0.0f) == 0.0f && dtr__f_relu_grad(1e-9f) == 1.0f);
    {   /* x <= 0 ? 0 : 1 on special values: zeros, denormals, infinities, NaNs of both signs */
        static const float xs[] = {0.0f, -0.0f, 1e-45f, -1e-45f, INFINITY, -INFINITY, NAN, -NAN, 3.0f, -3.0f, 3.4e38f, -3.4e38f};
        for (k = 0; k < (int)(sizeof xs / sizeof xs[0]); k++)
            CHECK_MSG(dtr__f_relu_grad(xs[k]) == (xs[k] <= 0.0f ? 0.0f : 1.0f), "relu' at %g", (double)xs[k]);
    }
    CHECK(dtr__f_abs_grad(-3.0f) == -1.0f && dtr__f_abs_grad(0.0f) == 0.0f && dtr__f_abs_grad(NAN) == 0.0f);
}

/* The own exp, tanh and erf (GELU's, sigmoid's and the tanh op's, CPU and CUDA) against
 * double's: every 4999th float and every float within 2^-10 of a piece's edge (tanh 0.625, erf
 * 0.875), in units in the last place of the exact value (measured over every float: 1.30,
 * 1.34, 1.25); odd; NaN, infinities, zeros, saturation, overflow and denormal results. */
static double ulps(float v, double ref) {
    double ulp = fabs(ref) < 1.1754943508222875e-38 ? ldexp(1.0, -149) : ldexp(1.0, ilogb(ref) - 23);
    if (isinf(ref)) return isinf(v) && (v > 0) == (ref > 0) ? 0.0 : INFINITY;
    return fabs((double)v - ref) / ulp;
}

static void own_math_at(float x, double *worst) {
    double e[3];
    int i;
    if (isnan(x)) return;
    e[0] = exp((double)x) > 3.4028234663852886e38 ? (isinf(dtr__f_exp(x)) ? 0.0 : INFINITY) : ulps(dtr__f_exp(x), exp((double)x));
    e[1] = ulps(dtr__f_tanh(x), tanh((double)x));
    e[2] = ulps(dtr__f_erf(x), erf((double)x));
    for (i = 0; i < 3; i++) worst[i] = fmax(worst[i], e[i]);
}

static void test_own_math(void) {
    static const float edges[] = {0.625f, 0.875f};
    double worst[3] = {0.0, 0.0, 0.0};
    uint64_t u;
    int odd = 1, i;
    for (u = 0; u <= 0xffffffffu; u += 4999) {
        float x = dtr__f_from_bits((uint32_t)u);
        own_math_at(x, worst);
        odd &= isnan(x) || (dtr__f_tanh(-x) == -dtr__f_tanh(x) && dtr__f_erf(-x) == -dtr__f_erf(x));
    }
    for (i = 0; i < 2; i++)
        for (u = dtr__f_bits(edges[i]) - 16384; u < dtr__f_bits(edges[i]) + 16384; u++) own_math_at(dtr__f_from_bits((uint32_t)u), worst);
    CHECK_MSG(worst[0] <= 1.5 && worst[1] <= 1.5 && worst[2] <= 1.5, "exp %.3f, tanh %.3f, erf %.3f units in the last place",
              worst[0], worst[1], worst[2]);
    CHECK(odd);
    CHECK(isnan(dtr__f_exp(NAN)) && isnan(dtr__f_tanh(NAN)) && isnan(dtr__f_erf(NAN)));
    CHECK(dtr__f_exp(INFINITY) == INFINITY && dtr__f_exp(-INFINITY) == 0.0f && dtr__f_exp(0.0f) == 1.0f);
    CHECK(dtr__f_exp(89.0f) == INFINITY && dtr__f_exp(-104.0f) == 0.0f && dtr__f_exp(-100.0f) == expf(-100.0f));   /* a denormal */
    CHECK(dtr__f_tanh(INFINITY) == 1.0f && dtr__f_tanh(-INFINITY) == -1.0f && dtr__f_tanh(-30.0f) == -1.0f);
    CHECK(dtr__f_tanh(0.0f) == 0.0f && signbit(dtr__f_tanh(-0.0f)) && dtr__f_tanh(1e-30f) == 1e-30f);
    CHECK(dtr__f_erf(INFINITY) == 1.0f && dtr__f_erf(-5.0f) == -1.0f && signbit(dtr__f_erf(-0.0f)));
}

/* Ten steps of each update on one element against double-precision textbook updates. */
static void test_optimizer(void) {
    dtr__opt_args a;
    float g[10];
    int kind, step, k;
    for (k = 0; k < 10; k++) g[k] = 0.3f * (float)(k % 3) - 0.4f + 0.05f * (float)k;
    for (kind = 0; kind < 5; kind++) {   /* SGD momentum, SGD Nesterov, Adam, AdamW, LAMB (one element) */
        float p = 0.8f, m = 0.0f, v = 0.0f;
        double pd = 0.8, md = 0.0, vd = 0.0, lr = 0.01, wd = 0.1, b1 = 0.9, b2 = 0.999, eps = 1e-8;
        memset(&a, 0, sizeof a);
        a.kind = kind < 2 ? DTR_OPT_SGD : kind == 2 ? DTR_OPT_ADAM : kind == 3 ? DTR_OPT_ADAMW : DTR_OPT_LAMB;
        a.lr = (float)lr; a.weight_decay = (float)wd; a.momentum = 0.9f; a.dampening = 0.0f; a.nesterov = kind == 1;
        a.beta1 = b1; a.beta2 = b2; a.eps = (float)eps; a.grad_scale = 1.0f;
        for (step = 1; step <= 10; step++) {
            dtr__opt_k kk;
            double gd = g[step - 1];
            a.step = step;
            a.first = step == 1;
            kk = dtr__opt_consts(&a);
            if (kind < 2) {
                double d = gd + wd * pd;
                md = step == 1 ? d : 0.9 * md + d;
                pd -= lr * (kind == 1 ? d + 0.9 * md : md);
                dtr__f_sgd_momentum(&p, &m, g[step - 1], &kk, kk.first, kk.nesterov);
            } else if (kind < 4) {
                double d = gd;
                if (kind == 3) pd *= 1.0 - lr * wd;
                else d += wd * pd;
                md = b1 * md + (1 - b1) * d;
                vd = b2 * vd + (1 - b2) * d * d;
                pd -= lr * (md / (1 - pow(b1, step))) / (sqrt(vd / (1 - pow(b2, step))) + eps);
                dtr__f_adam(&p, &m, &v, g[step - 1], &kk, kk.adamw);
            } else {
                double u, pn, un;
                float w;
                md = b1 * md + (1 - b1) * gd;
                vd = b2 * vd + (1 - b2) * gd * gd;
                u = (md / (1 - pow(b1, step))) / (sqrt(vd / (1 - pow(b2, step))) + eps) + wd * pd;
                pn = pd * pd;
                un = u * u;
                w = dtr__f_lamb_dir(p, &m, &v, g[step - 1], &kk);
                p -= (float)lr * dtr__f_lamb_trust((double)p * p, (double)w * w) * w;
                pd -= lr * (sqrt(pn) / sqrt(un)) * u;
            }
        }
        CHECK_MSG(fabs(p - pd) <= 1e-5 * (1.0 + fabs(pd)), "kind %d: %.9g vs %.9g", kind, (double)p, pd);
    }
}

/* The CPU backend's fused Adam update takes the square roots of 8 elements at once (SSE): over
   a range that starts mid-block and ends with a rest, three steps, every bit must equal the
   one-element formula's. */
static void test_adam_blocks(void) {
    enum { N = 8 * 9 + 5 };
    dtr_context *ctx = test_ctx(1);
    float p[N], m[N], v[N], g[N], pr[N], mr[N], vr[N];
    int adamw, step, i, bad = 0;
    for (adamw = 0; adamw < 2; adamw++) {
        dtr__opt_args a;
        for (i = 0; i < N; i++) {
            p[i] = pr[i] = 0.5f - 0.013f * (float)i;
            m[i] = mr[i] = v[i] = vr[i] = 0.0f;
            g[i] = (float)((i * 37) % 11) * 0.07f - 0.3f + (i == 9 ? 1e-30f : 0.0f);
        }
        memset(&a, 0, sizeof a);
        a.kind = adamw ? DTR_OPT_ADAMW : DTR_OPT_ADAM;
        a.n = N, a.begin = 3, a.param = p, a.grad = g, a.m = m, a.v = v;
        a.lr = 0.01f, a.eps = 1e-8f, a.weight_decay = 0.1f, a.beta1 = 0.9, a.beta2 = 0.999, a.grad_scale = 0.5f;
        for (step = 1; step <= 3; step++) {
            dtr__opt_k k;
            a.step = step;
            k = dtr__opt_consts(&a);
            CHECK(ctx->backend->optimizer_update(ctx, &a) == DTR_OK);
            for (i = 3; i < N; i++) dtr__f_adam(&pr[i], &mr[i], &vr[i], g[i], &k, adamw);
        }
        for (i = 0; i < N; i++) bad += memcmp(&p[i], &pr[i], 4) != 0 || memcmp(&m[i], &mr[i], 4) != 0 || memcmp(&v[i], &vr[i], 4) != 0;
        CHECK_MSG(bad == 0, "adamw %d: %d elements differ from dtr__f_adam", adamw, bad);
        CHECK(p[0] == 0.5f && p[2] == 0.5f - 0.026f);   /* before begin: untouched */
    }
    dtr_context_destroy(ctx);
}

static void test_launch_shapes(void) {
    CHECK_EQ_INT(dtr__launch_blocks(0, 256, 65535), 1);
    CHECK_EQ_INT(dtr__launch_blocks(1, 256, 65535), 1);
    CHECK_EQ_INT(dtr__launch_blocks(256, 256, 65535), 1);
    CHECK_EQ_INT(dtr__launch_blocks(257, 256, 65535), 2);
    CHECK_EQ_INT(dtr__launch_blocks((int64_t)1 << 40, 256, 65535), 65535);   /* grid-stride loops take the rest */
    CHECK_EQ_INT(dtr__launch_blocks(1000000, 256, 1024), 1024);
    CHECK_EQ_INT(dtr__launch_row_threads(1), 32);
    CHECK_EQ_INT(dtr__launch_row_threads(32), 32);
    CHECK_EQ_INT(dtr__launch_row_threads(33), 64);
    CHECK_EQ_INT(dtr__launch_row_threads(768), 1024);
    CHECK_EQ_INT(dtr__launch_row_threads(50257), 1024);
}

int main(void) {
    RUN(test_pcg_jump);
    RUN(test_conversions);
    RUN(test_activations);
    RUN(test_own_math);
    RUN(test_optimizer);
    RUN(test_adam_blocks);
    RUN(test_launch_shapes);
    return test_summary();
}
