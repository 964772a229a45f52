/* ============================================================================
 * The element formulas, one home for each: the CPU kernels (dtrain.h) and the CUDA kernels
 * (dtrain_cuda.cu) call these same functions, so the CPU tests (finite differences, the
 * PyTorch references) check the arithmetic the GPU runs. Under nvcc they are
 * __host__ __device__; elsewhere plain static inline C99.
 *   - dtype conversions: f32 <-> bf16 / f16, round to nearest even, NaN kept quiet
 *   - the random stream: PCG32 step, jump ahead by n draws, uniform in [0, 1)
 *   - own exp, tanh and erf (branch-free: the CPU's loops vectorise), activations and their
 *     derivatives (GELU tanh and erf forms, SiLU, sigmoid, tanh, ReLU, abs, leaky ReLU, clamp,
 *     softplus, pow, maximum and minimum)
 *   - optimizer element updates (SGD with momentum / Nesterov, Adam / AdamW, LAMB's direction)
 *   - cross-entropy's row statistics, its exp terms and the probabilities its backward
 *     recomputes from them
 * ==========================================================================*/
#ifndef DTR__FORMULAS_H
#define DTR__FORMULAS_H

#include <math.h>
#include <string.h>

#if defined(__CUDACC__)
#define DTR__HD static __host__ __device__ __forceinline__
#elif defined(__clang__)   /* else Clang calls the larger ones (GELU's erf derivative) once an element */
#define DTR__HD static inline __attribute__((always_inline))
#else
#define DTR__HD static inline
#endif

#define DTR__GELU_K 0.7978845608028654f       /* sqrt(2/pi) */
#define DTR__SQRT1_2 0.7071067811865476f      /* 1/sqrt(2) */
#define DTR__INV_SQRT_2PI 0.3989422804014327f /* 1/sqrt(2 pi) */

/* ---- bits ---- */

DTR__HD uint32_t dtr__f_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
DTR__HD float dtr__f_from_bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* ---- cross-entropy ---- */

/** What cross-entropy keeps of a row of logits for its backward: the maximum and 1 / the sum
 *  of exp(x - max) (f32 terms summed in double; the backward multiplies by it rather than
 *  dividing each term). 16 bytes a row instead of the row's probabilities. */
typedef struct dtr__xent_row {
    double inv;   /* 1 / the row's sum of exp(x - max) */
    float max;
} dtr__xent_row;

/* ---- dtype conversions ---- */

/** f32 -> bf16, round to nearest even; NaN stays a quiet NaN. */
DTR__HD uint16_t dtr__f_to_bf16(float x) {
    uint32_t u = dtr__f_bits(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

DTR__HD float dtr__f_from_bf16(uint16_t x) { return dtr__f_from_bits((uint32_t)x << 16); }

/** f32 -> f16 (IEEE half), round to nearest even; overflow to inf; NaN kept. */
DTR__HD uint16_t dtr__f_to_f16(float x) {
    uint32_t u = dtr__f_bits(x);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t a = u & 0x7fffffffu;
    if (a >= 0x7f800000u) /* inf or nan */
        return (uint16_t)(sign | 0x7c00u | (a > 0x7f800000u ? 0x200u | ((a >> 13) & 0x3ffu) : 0));
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds to inf */
    if (a < 0x38800000u) {  /* subnormal or zero in f16: units of 2^-24, half to even */
        float f = dtr__f_from_bits(a) * 16777216.0f;
        uint32_t i = (uint32_t)f;
        float rem = f - (float)i;
        if (rem > 0.5f || (rem == 0.5f && (i & 1u))) i++;
        return (uint16_t)(sign | i);
    }
    a += 0xc8000fffu + ((a >> 13) & 1u); /* rebias exponent (-112 << 23) and round */
    return (uint16_t)(sign | (a >> 13));
}

DTR__HD float dtr__f_from_f16(uint16_t h) {
    uint32_t sign = ((uint32_t)h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    if (e == 0) {
        float f = (float)mant * (1.0f / 16777216.0f);
        return sign ? -f : f;
    }
    if (e == 31) return dtr__f_from_bits(sign | 0x7f800000u | (mant << 13));
    return dtr__f_from_bits(sign | ((e + 112u) << 23) | (mant << 13));
}

/** Element i of an array of dtype `dt` (DTR_F32, BF16, F16, I32, U8) as a float. */
DTR__HD float dtr__f_load(const void *src, int dt, int64_t i) {
    switch (dt) {
    case DTR_F32: return ((const float *)src)[i];
    case DTR_BF16: return dtr__f_from_bf16(((const uint16_t *)src)[i]);
    case DTR_F16: return dtr__f_from_f16(((const uint16_t *)src)[i]);
    case DTR_I32: return (float)((const int32_t *)src)[i];
    case DTR_U8: return (float)((const uint8_t *)src)[i];
    default: return 0.0f;
    }
}

/** Stores f as element i of an array of dtype `dt`: rounded to nearest even for bf16 / f16,
 *  truncated for i32, clamped to [0, 255] for u8. */
DTR__HD void dtr__f_store(void *dst, int dt, int64_t i, float f) {
    switch (dt) {
    case DTR_F32: ((float *)dst)[i] = f; break;
    case DTR_BF16: ((uint16_t *)dst)[i] = dtr__f_to_bf16(f); break;
    case DTR_F16: ((uint16_t *)dst)[i] = dtr__f_to_f16(f); break;
    case DTR_I32: ((int32_t *)dst)[i] = (int32_t)f; break;
    case DTR_U8: ((uint8_t *)dst)[i] = (uint8_t)(f < 0 ? 0 : f > 255 ? 255 : f); break;
    default: break;
    }
}

/* ---- launch shapes (CUDA kernels; plain arithmetic, tested on the CPU) ---- */

/** Blocks of `threads` for n elements in a grid-stride loop: ceil(n / threads), at least 1,
 *  at most max_blocks (each thread then takes several elements). */
static inline unsigned dtr__launch_blocks(int64_t n, int threads, unsigned max_blocks) {
    int64_t b = n > 0 ? (n + threads - 1) / threads : 1;
    return b > (int64_t)max_blocks ? max_blocks : (unsigned)b;
}

/** Threads per block for a row of n elements reduced by one block: the smallest power of two
 *  >= n, between 32 (a warp) and 1024 (the hardware's limit). */
static inline int dtr__launch_row_threads(int64_t n) {
    int t = 32;
    while (t < 1024 && t < n) t *= 2;
    return t;
}

/* ---- the random stream (PCG32, XSH RR) ---- */

#define DTR__PCG_MULT 6364136223846793005ULL

/** One draw: returns the output of `*state` and steps it. */
DTR__HD uint32_t dtr__f_pcg_next(uint64_t *state, uint64_t inc) {
    uint64_t old = *state;
    uint32_t xorshifted = (uint32_t)(((old >> 18u) ^ old) >> 27u), rot = (uint32_t)(old >> 59u);
    *state = old * DTR__PCG_MULT + inc;
    return (xorshifted >> rot) | (xorshifted << ((0u - rot) & 31u));
}

/** The state `delta` draws later, in O(log delta) (Brown's jump ahead): draw i of a stream
 *  is computed on its own, so a GPU thread per element reproduces the CPU's sequence. */
DTR__HD uint64_t dtr__f_pcg_advance(uint64_t state, uint64_t inc, uint64_t delta) {
    uint64_t mult = DTR__PCG_MULT, plus = inc, acc_mult = 1u, acc_plus = 0u;
    while (delta > 0) {
        if (delta & 1u) {
            acc_mult *= mult;
            acc_plus = acc_plus * mult + plus;
        }
        plus = (mult + 1u) * plus;
        mult *= mult;
        delta >>= 1u;
    }
    return acc_mult * state + acc_plus;
}

/** The state of draw (i / width) cols + col0 + i % width of the stream at `state`: element i of
 *  a mask whose rows of `width` elements are columns col0 .. of rows of `cols` draws (whole rows:
 *  width == cols, col0 0, draw i; dtr__draws). */
DTR__HD uint64_t dtr__f_pcg_at(uint64_t state, uint64_t inc, int64_t i, int64_t width, int64_t cols, int64_t col0) {
    return dtr__f_pcg_advance(state, inc, (uint64_t)(i / width * cols + col0 + i % width));
}

/** A draw as a float uniform in [0, 1), 24 bits. */
DTR__HD float dtr__f_uniform(uint32_t u) { return (float)(u >> 8) * (1.0f / 16777216.0f); }

/** Dropout's multiplier for a draw: 0 (dropped, draw < p) or 1 / (1 - p). */
DTR__HD float dtr__f_dropout_mask(uint32_t u, float p) { return dtr__f_uniform(u) < p ? 0.0f : 1.0f / (1.0f - p); }

/* ---- activations: y = f(x) and dy/dx ---- */

/* Own exp, tanh and erf: branch-free (a bit mask picks between pieces that are all computed),
 * so the CPU's loops of eight vectorize even at -O2 (glibc's tanhf and erff are a call of about
 * 20 ns per element; these 3-5 ns, with SSE2 alone); the CUDA kernels call the same ones. Their
 * errors, in units in the last place of the exact value, are checked over every 4999th float
 * by test_formulas (measured over every float: exp 1.30, tanh 1.34, erf 1.25). */

/** exp(y): y = k ln 2 + r with |r| <= ln 2 / 2 (ln 2 in two parts), exp(r) by a degree-6
 *  polynomial (fitted for relative error: 3.6e-9), times 2^k in two halves (so results down to
 *  the smallest denormal are rounded once); 0 below -104, inf above 88.75, NaN kept. */
DTR__HD float dtr__f_exp(float y) {
    uint32_t u = dtr__f_bits(y), sign = u & 0x80000000u, ua = u & 0x7fffffffu, lim = sign ? 0x42d00000u : 0x42b18000u;
    uint32_t out = 0u - (uint32_t)(ua >= lim), nan = 0u - (uint32_t)(ua > 0x7f800000u), v;
    float c = dtr__f_from_bits(ua < lim ? u : sign | lim);
    int k = (int)(c * 1.44269504f + 150.5f) - 150, h = k / 2;
    float kf = (float)k, r = (c - kf * 0.693145751953125f) - kf * 1.428606765330187e-06f;
    float p = 1.0f + r + r * r * (0.49999988825f + r * (0.16666518536f + r * (0.04166947856f + r * (0.00836890938f + r * 0.00137544284f))));
    v = dtr__f_bits(p * dtr__f_from_bits((uint32_t)(h + 127) << 23) * dtr__f_from_bits((uint32_t)(k - h + 127) << 23));
    v = (v & ~out) | (out & (sign ? 0u : 0x7f800000u));
    return dtr__f_from_bits((v & ~nan) | (nan & (u | 0x400000u)));
}

/** p where `first`, else q, with x's sign (tanh's and erf's pick between their pieces) */
DTR__HD float dtr__f_odd_pick(float x, int first, float p, float q) {
    uint32_t m = 0u - (uint32_t)first;
    return dtr__f_from_bits((dtr__f_bits(x) & 0x80000000u) | (dtr__f_bits(p) & m) | (dtr__f_bits(q) & ~m));
}

/** tanh(x), odd, NaN kept, +-1 past 9.5: |x| < 0.625, x + x^3 P(x^2) with P of degree 4
 *  (fitted for relative error: 4.6e-9); beyond, 1 - 2 / (exp(2|x|) + 1). */
DTR__HD float dtr__f_tanh(float x) {
    uint32_t ua = dtr__f_bits(x) & 0x7fffffffu;
    float a = dtr__f_from_bits(ua), s = a * a;
    float p = a + a * s * (-0.33333285063f + s * (0.13331509397f + s * (-0.05374443310f + s * (0.02065249493f + s * -0.00571834229f))));
    float q = 1.0f - 2.0f / (dtr__f_exp(2.0f * dtr__f_from_bits(ua < 0x41180000u ? ua : 0x41180000u)) + 1.0f);   /* 9.5 */
    return dtr__f_odd_pick(x, ua < 0x3f200000u || ua > 0x7f800000u, p, q);                                     /* 0.625, NaN */
}

/** erf(x), odd, NaN kept, +-1 past 4: |x| < 0.875, x P(x^2) with P of degree 6 (relative
 *  error 2.5e-10; as x + x (P - 1), x exact); beyond, 1 - exp(-x^2) R(x - 2.4375) with R of
 *  degree 9 (erf's error 1.4e-9). */
DTR__HD float dtr__f_erf(float x) {
    uint32_t ua = dtr__f_bits(x) & 0x7fffffffu;
    float a = dtr__f_from_bits(ua), s = a * a, b = dtr__f_from_bits(ua < 0x40800000u ? ua : 0x40800000u), t = b - 2.4375f;   /* 4 */
    float p = a + a * (0.128379167f + s * (-0.37612637877f + s * (0.11283743382f + s * (-0.026862118393f + s * (0.0052080168389f +
                  s * (-0.00082252628636f + s * 8.7351945695e-05f))))));
    float r = 0.21555246413f + t * (-0.077564291656f + t * (0.026482909918f + t * (-0.0086486143991f + t * (0.0027920282446f +
              t * (-0.00068545283284f + t * (0.00026317301672f + t * (-0.00017466815189f + t * (-8.2393598859e-05f +
              t * -3.635324174e-05f))))))));
    return dtr__f_odd_pick(x, ua < 0x3f600000u || ua > 0x7f800000u, p, 1.0f - dtr__f_exp(-(b * b)) * r);   /* 0.875, NaN */
}

/** A term of cross-entropy's row sum: exp(x - max) (the forward sums them in double). */
DTR__HD float dtr__f_xent_term(float x, float max) { return dtr__f_exp(x - max); }
/** The probability of logit x in its row: the f32 softmax the forward's sum came from. */
DTR__HD float dtr__f_xent_prob(float x, dtr__xent_row st) { return (float)((double)dtr__f_xent_term(x, st.max) * st.inv); }
/** A row's loss from its maximum, exp-sum s, target logit xt and mean logit (label smoothing
 *  eps: the target weighs 1 - eps, every class eps / K): (1 - eps)(lse - xt) + eps (lse - mean). */
DTR__HD double dtr__f_xent_loss(float max, double s, float xt, double mean, float eps) {
    double lse = (double)max + log(s);
    return eps > 0.0f ? (1.0 - (double)eps) * (lse - (double)xt) + (double)eps * (lse - mean) : lse - (double)xt;
}

DTR__HD float dtr__f_gelu(float x) { return 0.5f * x * (1.0f + dtr__f_tanh(DTR__GELU_K * (x + 0.044715f * x * x * x))); }
DTR__HD float dtr__f_gelu_grad(float x) {
    float u = DTR__GELU_K * (x + 0.044715f * x * x * x), t = dtr__f_tanh(u);
    float du = DTR__GELU_K * (1.0f + 3.0f * 0.044715f * x * x);
    return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * du;
}
DTR__HD float dtr__f_gelu_erf(float x) { return 0.5f * x * (1.0f + dtr__f_erf(x * DTR__SQRT1_2)); }
DTR__HD float dtr__f_gelu_erf_grad(float x) {
    return 0.5f * (1.0f + dtr__f_erf(x * DTR__SQRT1_2)) + x * DTR__INV_SQRT_2PI * dtr__f_exp(-0.5f * x * x);
}
DTR__HD float dtr__f_sigmoid(float x) { return 1.0f / (1.0f + dtr__f_exp(-x)); }
/** RoPE: the frequency of pair j of a head of D (j < D/2), theta^(-2j/D), in double; the pair's
 *  elements in the head: (j, j + D/2) (rotate_half) or (2j, 2j + 1) (interleaved). */
DTR__HD double dtr__f_rope_freq(int64_t j, int64_t D, double theta) { return pow(theta, -2.0 * (double)j / (double)D); }
DTR__HD int64_t dtr__f_rope_first(int64_t j, int interleaved) { return interleaved ? 2 * j : j; }
DTR__HD int64_t dtr__f_rope_second(int64_t j, int64_t D, int interleaved) { return interleaved ? 2 * j + 1 : j + D / 2; }
/** The pair (a, b) rotated by the angle whose cosine and sine are c and s (backward: by its
 *  negative, s negated): a c - b s, a s + b c. */
DTR__HD void dtr__f_rope_rotate(float a, float b, float c, float s, float *ra, float *rb) {
    *ra = a * c - b * s;
    *rb = a * s + b * c;
}

/** SiLU (swish): x sigmoid(x), and its derivative s (1 + x (1 - s)) from x. */
DTR__HD float dtr__f_silu(float x) { return x * dtr__f_sigmoid(x); }
DTR__HD float dtr__f_silu_grad(float x) {
    float s = dtr__f_sigmoid(x);
    return s * (1.0f + x * (1.0f - s));
}
/** From the output y = sigmoid(x). */
DTR__HD float dtr__f_sigmoid_grad(float y) { return y * (1.0f - y); }
/** From the output y = tanh(x). */
DTR__HD float dtr__f_tanh_grad(float y) { return 1.0f - y * y; }
/** NaN and -0 pass through, as PyTorch. */
DTR__HD float dtr__f_relu(float x) { return x < 0.0f ? 0.0f : x; }
/** 0 at and below 0, else 1 (NaN too: x <= 0 is false), as PyTorch's threshold_backward. On
 *  the bits, with no compare of floats: the CPU's loops of eight vectorise. */
DTR__HD float dtr__f_relu_grad(float x) {
    uint32_t u = dtr__f_bits(x);   /* 1 .. 0x7fffffff: above +0 (NaN included); above 0xff800000: a negative NaN */
    return dtr__f_from_bits(0x3f800000u & (0u - (uint32_t)((u - 1u < 0x7fffffffu) | (u > 0xff800000u))));
}
/** sign(x), as PyTorch's: 0 at 0 and at NaN (torch.sign(nan) is 0). */
DTR__HD float dtr__f_abs_grad(float x) { return x > 0.0f ? 1.0f : x < 0.0f ? -1.0f : 0.0f; }

/** Leaky ReLU: x above 0, else slope x (NaN: slope NaN = NaN); its derivative 1 above 0, else
 *  slope (PyTorch's leaky_relu_backward: `x > 0`). */
DTR__HD float dtr__f_leaky_relu(float x, float slope) { return x > 0.0f ? x : x * slope; }
DTR__HD float dtr__f_leaky_relu_grad(float x, float slope) { return x > 0.0f ? 1.0f : slope; }
/** clamp(x, lo, hi) = min(max(x, lo), hi), as PyTorch's: hi everywhere when lo > hi, NaN kept;
 *  the derivative 1 on [lo, hi] (ends included), else 0 (NaN: 0). */
DTR__HD float dtr__f_clamp(float x, float lo, float hi) {
    float t = x < lo ? lo : x;
    return t > hi ? hi : t;
}
DTR__HD float dtr__f_clamp_grad(float x, float lo, float hi) { return (x >= lo && x <= hi) ? 1.0f : 0.0f; }
/** softplus(x) = log(1 + exp(beta x)) / beta, and x itself where beta x > threshold (PyTorch's
 *  nn.Softplus: beta 1, threshold 20); the derivative e / (e + 1), e = exp(beta x), else 1. */
DTR__HD float dtr__f_softplus(float x, float beta, float thr) {
    float z = x * beta;
    return z > thr ? x : log1pf(dtr__f_exp(z)) / beta;
}
DTR__HD float dtr__f_softplus_grad(float x, float beta, float thr) {
    float z = x * beta, e = dtr__f_exp(z);
    return z > thr ? 1.0f : e / (e + 1.0f);
}
/** x^p (powf), and its derivative p x^(p-1); 0 for p = 0, as PyTorch's pow_backward. */
DTR__HD float dtr__f_pow_grad(float x, float p) { return p == 0.0f ? 0.0f : p * powf(x, p - 1.0f); }
/** max(a, b) and min(a, b), NaN in either giving NaN (PyTorch's maximum and minimum). */
DTR__HD float dtr__f_maximum(float a, float b) { return (a > b || a != a) ? a : b; }
DTR__HD float dtr__f_minimum(float a, float b) { return (a < b || a != a) ? a : b; }
/** The share of the gradient of maximum(a, b) (is_max) or minimum(a, b) that goes to a:
 *  0 where b wins, half at a tie, all of it otherwise (NaN: all of it to both, as PyTorch's
 *  `where(a == b, g / 2, g).masked_fill_(a < b, 0)`); b's share is this with a and b swapped. */
DTR__HD float dtr__f_pick_share(float a, float b, int is_max) {
    return a == b ? 0.5f : (is_max ? a < b : a > b) ? 0.0f : 1.0f;
}

/** An LSTM cell's gate activations from their pre-activations: i, f, o sigmoids, g a tanh. */
DTR__HD void dtr__f_lstm_gates(float ai, float af, float ag, float ao, float *i, float *f, float *g, float *o) {
    *i = dtr__f_sigmoid(ai), *f = dtr__f_sigmoid(af), *g = dtr__f_tanh(ag), *o = dtr__f_sigmoid(ao);
}
/** The cell from its activations and the cell before, c: c' = f c + i g, t = tanh(c'),
 *  h = o t (the arithmetic of the mul and add ops, in that order). */
DTR__HD void dtr__f_lstm_cell_act(float i, float f, float g, float o, float c, float *h, float *c2, float *t) {
    *c2 = f * c + i * g;
    *t = dtr__f_tanh(*c2);
    *h = o * *t;
}
/** An LSTM cell at one unit from its gates' pre-activations ai, af, ag, ao and the cell before,
 *  c: c' = sigmoid(f) c + sigmoid(i) tanh(g), h = sigmoid(o) tanh(c'). */
DTR__HD void dtr__f_lstm_cell(float ai, float af, float ag, float ao, float c, float *h, float *c2) {
    float i, f, g, o, t;
    dtr__f_lstm_gates(ai, af, ag, ao, &i, &f, &g, &o);
    dtr__f_lstm_cell_act(i, f, g, o, c, h, c2, &t);
}
/** Its gradients from the activations i, f, g, o, the cell before c, t = tanh(c'), and gh (of
 *  h) and gc (of c'): the gates' pre-activations' (i, f, g, o) and the previous cell's. */
DTR__HD void dtr__f_lstm_cell_grad_act(float i, float f, float g, float o, float c, float t, float gh, float gc, float *di, float *df,
                                       float *dg, float *dout, float *dc_prev) {
    float dc = gc + gh * o * dtr__f_tanh_grad(t);
    *di = dc * g * dtr__f_sigmoid_grad(i);
    *df = dc * c * dtr__f_sigmoid_grad(f);
    *dg = dc * i * dtr__f_tanh_grad(g);
    *dout = gh * t * dtr__f_sigmoid_grad(o);
    *dc_prev = dc * f;
}
/** dtr__f_lstm_cell_grad_act from the pre-activations (the activations computed again). */
DTR__HD void dtr__f_lstm_cell_grad(float ai, float af, float ag, float ao, float c, float gh, float gc, float *di, float *df,
                                   float *dg, float *dout, float *dc_prev) {
    float i, f, g, o, h, c2, t;
    dtr__f_lstm_gates(ai, af, ag, ao, &i, &f, &g, &o);
    dtr__f_lstm_cell_act(i, f, g, o, c, &h, &c2, &t);
    dtr__f_lstm_cell_grad_act(i, f, g, o, c, t, gh, gc, di, df, dg, dout, dc_prev);
}

/** A GRU cell at one unit from the input's parts of its gates xr, xz, xn, the hidden state's
 *  hr, hz, hn (h W_hh^T + b_hh) and the state before, h (0 for none): r = sigmoid(xr + hr),
 *  z = sigmoid(xz + hz), n = tanh(xn + r hn), h' = n + z (h - n) (the arithmetic of the ops,
 *  in their order). */
DTR__HD void dtr__f_gru_cell(float xr, float xz, float xn, float hr, float hz, float hn, float h, float *r, float *z, float *n,
                             float *h2) {
    *r = dtr__f_sigmoid(xr + hr);
    *z = dtr__f_sigmoid(xz + hz);
    *n = dtr__f_tanh(xn + *r * hn);
    *h2 = *n + *z * (h - *n);
}
/** Its gradients from r, z, n, hn and h and gh (of h'): the pre-activations' of r, z and n
 *  (dr, dz: of both parts; dn: of xn), hn's (dhn) and h's through the update (dh). */
DTR__HD void dtr__f_gru_cell_grad(float r, float z, float n, float hn, float h, float gh, float *dr, float *dz, float *dn, float *dhn,
                                  float *dh) {
    float gn = (gh - gh * z) * dtr__f_tanh_grad(n);
    *dn = gn;
    *dhn = gn * r;
    *dr = gn * hn * dtr__f_sigmoid_grad(r);
    *dz = gh * (h - n) * dtr__f_sigmoid_grad(z);
    *dh = gh * z;
}

/** Batch norm's running statistics after a batch of cnt values a channel with mean m and
 *  biased variance v: each moves by momentum towards the batch's (the variance unbiased, v
 *  cnt / (cnt - 1), as PyTorch's), in double, rounded once. */
DTR__HD void dtr__f_bn_running(float *rm, float *rv, double m, double v, int64_t cnt, float momentum) {
    double k = (double)momentum;
    *rm = (float)((1.0 - k) * *rm + k * m);
    *rv = (float)((1.0 - k) * *rv + k * v * (double)cnt / (double)(cnt - 1));
}

/** Max pooling's rule: v replaces the window's best so far when larger, or when it is NaN
 *  (NaN propagates, and its index is the one backward uses, as in PyTorch). */
DTR__HD int dtr__f_max_takes(float v, float best) { return v > best || v != v; }
/** The index of the largest of n values x[0], x[stride], ..., x[(n - 1) stride] (the first of
 *  ties; a NaN wins and ends the scan), its value in *best: max and argmax on the CPU and CUDA. */
DTR__HD int32_t dtr__f_argmax(const float *x, int64_t n, int64_t stride, float *best) {
    float b = x[0];
    int32_t bi = 0;
    int64_t k;
    for (k = 1; k < n && b == b; k++)
        if (dtr__f_max_takes(x[k * stride], b)) b = x[k * stride], bi = (int32_t)k;
    *best = b;
    return bi;
}

/* ---- optimizer element updates ---- */

/** The constants of one SGD / Adam / AdamW / LAMB / RMSprop / Adagrad update (dtr__opt_consts makes them on the
 *  host from dtr__opt_args; a kernel takes them by value). */
typedef struct dtr__opt_k {
    float lr, wd, gs, eps;
    float mom, damp;          /* SGD: momentum, 1 - dampening */
    float step_size, sbc2;    /* Adam: lr / (1 - beta1^t), sqrt(1 - beta2^t) */
    float b1, b2, c1, c2;     /* beta1, beta2, 1 - beta1, 1 - beta2 */
    double bc1, bc2;          /* LAMB: 1 - beta1^t, 1 - beta2^t */
    int adamw, nesterov, first;
} dtr__opt_k;

/** SGD without momentum buffers. */
DTR__HD void dtr__f_sgd(float *p, float g, const dtr__opt_k *k) { *p -= k->lr * (g * k->gs + k->wd * *p); }

/** SGD with a momentum buffer m: the first step stores the gradient, later ones
 *  m = mom m + (1 - dampening) d; Nesterov steps along d + mom m. The flags are arguments
 *  (k->first, k->nesterov) so that a CPU loop passing constants compiles to one branch-free,
 *  vectorised loop per variant. */
DTR__HD void dtr__f_sgd_momentum(float *p, float *m, float g, const dtr__opt_k *k, int first, int nesterov) {
    float d = g * k->gs + k->wd * *p, b;
    if (first) {
        *m = d;
        *p -= k->lr * (nesterov ? d + k->mom * d : d);
        return;
    }
    b = k->mom * *m + k->damp * d;
    *m = b;
    *p -= k->lr * (nesterov ? d + k->mom * b : b);
}

/** Adam (L2 decay added to the gradient) or AdamW (decoupled decay, `adamw` = k->adamw),
 *  bias-corrected. */
/** Adam's two halves around the square root (a CPU loop takes the roots of a block at once:
 *  sqrtf's errno keeps the compiler from vectorising them): the moments (and AdamW's decay),
 *  returning v; then the step with sv = sqrtf(v). */
DTR__HD float dtr__f_adam_moments(float *p, float *m, float *v, float g, const dtr__opt_k *k, int adamw) {
    float d = g * k->gs;
    if (adamw) *p *= 1.0f - k->lr * k->wd;
    else d += k->wd * *p;
    *m = k->b1 * *m + k->c1 * d;
    *v = k->b2 * *v + k->c2 * d * d;
    return *v;
}
DTR__HD void dtr__f_adam_apply(float *p, float m, float sv, const dtr__opt_k *k) {
    *p -= k->step_size * m / (sv / k->sbc2 + k->eps);
}
DTR__HD void dtr__f_adam(float *p, float *m, float *v, float g, const dtr__opt_k *k, int adamw) {
    float nv = dtr__f_adam_moments(p, m, v, g, k, adamw);   /* before *m is read: C leaves the */
    dtr__f_adam_apply(p, *m, sqrtf(nv), k);                  /* order of arguments open */
}

/** RMSprop (torch.optim.RMSprop, not centered) with its square average sq and, with `momentum`,
 *  its momentum buffer buf: d = g + wd p; sq = b2 sq + (1 - b2) d d; avg = sqrt(sq) + eps; then
 *  buf = mom buf + d / avg, p -= lr buf, or p -= lr d / avg. Adagrad is the second form with
 *  b2 = 1 - b2 = 1 (sq the sum of squares). */
DTR__HD void dtr__f_rmsprop(float *p, float *sq, float *buf, float g, const dtr__opt_k *k, int momentum) {
    float d = g * k->gs + k->wd * *p, avg;
    *sq = k->b2 * *sq + k->c2 * d * d;
    avg = sqrtf(*sq) + k->eps;
    if (momentum) {
        *buf = k->mom * *buf + d / avg;
        *p -= k->lr * *buf;
    } else {
        *p -= k->lr * d / avg;
    }
}

/** LAMB's first phase for one element: moments updated, returns the update direction
 *  (before the per-parameter trust ratio scales it). */
DTR__HD float dtr__f_lamb_dir(float p, float *m, float *v, float g, const dtr__opt_k *k) {
    float d = g * k->gs, mh, vh;
    *m = k->b1 * *m + k->c1 * d;
    *v = k->b2 * *v + k->c2 * d * d;
    mh = (float)(*m / k->bc1);
    vh = (float)(*v / k->bc2);
    return mh / (sqrtf(vh) + k->eps) + k->wd * p;
}

/** LAMB's trust ratio from the squared norms of the parameter and of its direction. */
DTR__HD float dtr__f_lamb_trust(double pn, double un) {
    return (pn > 0.0 && un > 0.0) ? (float)(sqrt(pn) / sqrt(un)) : 1.0f;
}

/** The constants of the update `a` describes (host side). */
static inline dtr__opt_k dtr__opt_consts(const dtr__opt_args *a) {
    dtr__opt_k k;
    double bc1 = 1.0 - pow(a->beta1, (double)a->step), bc2 = 1.0 - pow(a->beta2, (double)a->step);
    memset(&k, 0, sizeof k);
    k.lr = a->lr; k.wd = a->weight_decay; k.gs = a->grad_scale; k.eps = a->eps;
    k.mom = a->momentum; k.damp = 1.0f - a->dampening;
    k.step_size = a->lr / (float)bc1;
    k.sbc2 = sqrtf((float)bc2);
    k.b1 = (float)a->beta1; k.b2 = (float)a->beta2;
    k.c1 = (float)(1.0 - a->beta1); k.c2 = (float)(1.0 - a->beta2);
    if (a->kind == DTR_OPT_ADAGRAD) k.b2 = k.c2 = 1.0f;   /* a sum, not an average */
    k.bc1 = bc1; k.bc2 = bc2;
    k.adamw = a->kind == DTR_OPT_ADAMW;
    k.nesterov = a->nesterov;
    k.first = a->first;
    return k;
}

#endif /* DTR__FORMULAS_H */
