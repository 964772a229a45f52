/* ============================================================================
 * Recurrent layers: LSTM and GRU (PyTorch's nn.LSTMCell and nn.GRUCell: their parameter
 * names, gate order and formulas), one step or a whole sequence, made of ops (autograd,
 * every backend). A sequence multiplies every step's input by weight_ih at once (one GEMM of
 * B T rows); each step then adds h W_hh^T and applies the gates: a whole recurrence is one op
 * (dtr_lstm_sequence, dtr_gru_sequence, over the time-major sequence); a single step is the
 * LSTM's h W_hh^T, a sum and its fused cell (dtr_lstm_cell), or the GRU's op over one step. Shapes: x (B, T, I) or one
 * step's (B, I); h, c (B, H); gate pre-activations (..., G H) with G = 4 (LSTM) or 3 (GRU).
 * ==========================================================================*/
#include "../public/api.h"
#include "../core/internal.h"
#include <math.h>

/* weight_ih (G H, I), weight_hh (G H, H), bias_ih, bias_hh (G H), all U(-1/sqrt(H), 1/sqrt(H)) */
static dtr_result dtr__rnn_init(dtr_model *m, const char *name, const char *fn, int64_t in, int64_t hidden, int gates,
                                dtr_tensor **w) {
    int64_t ih[2], hh[2], gh = gates * hidden;
    float bound;
    if (in <= 0 || hidden <= 0)
        return dtr__fail(dtr_model_context(m), DTR_INVALID_ARGUMENT, "%s: '%s' needs in, hidden > 0", fn, name ? name : "");
    bound = (float)(1.0 / sqrt((double)hidden));
    ih[0] = gh, ih[1] = in, hh[0] = gh, hh[1] = hidden;
    w[0] = dtr__named_param(m, name, "weight_ih", 2, ih, DTR_INIT_UNIFORM, bound);
    w[1] = dtr__named_param(m, name, "weight_hh", 2, hh, DTR_INIT_UNIFORM, bound);
    w[2] = dtr__named_param(m, name, "bias_ih", 1, &gh, DTR_INIT_UNIFORM, bound);
    w[3] = dtr__named_param(m, name, "bias_hh", 1, &gh, DTR_INIT_UNIFORM, bound);
    return dtr_context_status(dtr_model_context(m));
}

dtr_result dtr_lstm_layer_init(dtr_lstm_layer *l, dtr_model *m, const char *name, int64_t in, int64_t hidden) {
    dtr_tensor *w[4];
    dtr_result r;
    if (!l || !m) return DTR_NULL_HANDLE;
    memset(l, 0, sizeof(*l));
    if ((r = dtr__rnn_init(m, name, "dtr_lstm_layer_init", in, hidden, 4, w)) != DTR_OK) return r;
    l->weight_ih = w[0], l->weight_hh = w[1], l->bias_ih = w[2], l->bias_hh = w[3];
    l->in = in, l->hidden = hidden;
    return DTR_OK;
}

dtr_result dtr_gru_layer_init(dtr_gru_layer *l, dtr_model *m, const char *name, int64_t in, int64_t hidden) {
    dtr_tensor *w[4];
    dtr_result r;
    if (!l || !m) return DTR_NULL_HANDLE;
    memset(l, 0, sizeof(*l));
    if ((r = dtr__rnn_init(m, name, "dtr_gru_layer_init", in, hidden, 3, w)) != DTR_OK) return r;
    l->weight_ih = w[0], l->weight_hh = w[1], l->bias_ih = w[2], l->bias_hh = w[3];
    l->in = in, l->hidden = hidden;
    return DTR_OK;
}

/* One LSTM step from the input's part of the gates gx (..., 4H) (x W_ih^T + b_ih) and h, c
 * (..., H) or NULL (zeros): i, f, g, o = gx + h W_hh^T + b_hh; c' = sigmoid(f) c + sigmoid(i)
 * tanh(g); h' = sigmoid(o) tanh(c') (dtr_lstm_cell: one op). */
static dtr_tensor *dtr__lstm_step(dtr_context *ctx, const dtr_lstm_layer *l, dtr_tensor *gx, dtr_tensor *h, dtr_tensor *c,
                                  dtr_tensor **c_out) {
    dtr_tensor *a = dtr_add(ctx, gx, h ? dtr_linear(ctx, h, l->weight_hh, l->bias_hh) : l->bias_hh);
    return dtr_lstm_cell(ctx, a, c, c_out);
}

/* One GRU step from gx (B, 3H) and h (B, H) or NULL (zeros): the recurrence op over one step
 * (r, z = sigmoid(gx + h W_hh^T + b_hh) of their gates; n = tanh(gx_n + r (h W_hn^T + b_hn));
 * h' = n + z (h - n): one op, the bits of those made of ops). */
static dtr_tensor *dtr__gru_step(dtr_context *ctx, const dtr_gru_layer *l, dtr_tensor *gx, dtr_tensor *h) {
    int64_t one[3], two[2];
    dtr_tensor *hs;
    if (!gx) return NULL;
    one[0] = 1, one[1] = two[0] = gx->shape[0], one[2] = gx->shape[1], two[1] = l->hidden;
    hs = dtr_gru_sequence(ctx, dtr_reshape(ctx, gx, 3, one), l->weight_hh, l->bias_hh, h);
    return hs ? dtr_reshape(ctx, hs, 2, two) : NULL;
}

/* 1 when the state s is NULL or (B, H) for x (B, ...) */
static int dtr__rnn_state_ok(const dtr_tensor *x, int64_t H, const dtr_tensor *s) {
    return !s || (s->ndim == 2 && s->shape[0] == x->shape[0] && s->shape[1] == H);
}

/* 0 with the context's error set unless x is (B, [T,] in) and h, c (B, H) or NULL */
static int dtr__rnn_check(dtr_context *ctx, const char *fn, dtr_tensor *x, int xdims, int64_t in, int64_t H, dtr_tensor *h,
                          dtr_tensor *c) {
    char s1[96];
    if (!dtr__check_input(ctx, fn, x, "x") || (h && !dtr__check_input(ctx, fn, h, "h")) ||
        (c && !dtr__check_input(ctx, fn, c, "c")))
        return 0;
    if (x->ndim != xdims || x->shape[xdims - 1] != in) {
        dtr__fail(ctx, DTR_SHAPE_MISMATCH, "%s: x is %s, not (B, %s%lld)", fn, dtr__shape_str(x, s1, sizeof s1),
                  xdims == 3 ? "T, " : "", (long long)in);
        return 0;
    }
    if (!dtr__rnn_state_ok(x, H, h) || !dtr__rnn_state_ok(x, H, c)) {
        dtr__fail(ctx, DTR_SHAPE_MISMATCH, "%s: the state is %s, not (%lld, %lld)", fn,
                  dtr__shape_str(dtr__rnn_state_ok(x, H, h) ? c : h, s1, sizeof s1), (long long)x->shape[0], (long long)H);
        return 0;
    }
    return 1;
}

dtr_tensor *dtr_lstm_layer_step(dtr_context *ctx, const dtr_lstm_layer *l, dtr_tensor *x, dtr_tensor *h, dtr_tensor *c,
                                dtr_tensor **c_out) {
    dtr_tensor *cn = NULL, *hn;
    if (!ctx) return NULL;
    if (c_out) *c_out = NULL;
    if (!l || !c_out) return dtr__failt(ctx, DTR_NULL_HANDLE, "dtr_lstm_layer_step: layer or c_out is NULL");
    if (!dtr__rnn_check(ctx, "dtr_lstm_layer_step", x, 2, l->in, l->hidden, h, c)) return NULL;
    hn = dtr__lstm_step(ctx, l, dtr_linear(ctx, x, l->weight_ih, l->bias_ih), h, c, &cn);
    if (hn) *c_out = cn;
    return hn;
}

dtr_tensor *dtr_gru_layer_step(dtr_context *ctx, const dtr_gru_layer *l, dtr_tensor *x, dtr_tensor *h) {
    if (!ctx) return NULL;
    if (!l) return dtr__failt(ctx, DTR_NULL_HANDLE, "dtr_gru_layer_step: layer is NULL");
    if (!dtr__rnn_check(ctx, "dtr_gru_layer_step", x, 2, l->in, l->hidden, h, NULL)) return NULL;
    return dtr__gru_step(ctx, l, dtr_linear(ctx, x, l->weight_ih, l->bias_ih), h);
}

/* (T, B, ...) <-> (B, T, ...), contiguous */
static dtr_tensor *dtr__rnn_swap(dtr_context *ctx, dtr_tensor *x) {
    static const int perm[3] = {1, 0, 2};
    return dtr_contiguous(ctx, dtr_permute(ctx, x, perm));
}

/* step t's (B, H) of a time-major (T, B, H) sequence */
static dtr_tensor *dtr__rnn_at(dtr_context *ctx, dtr_tensor *s, int64_t t) {
    int64_t shape[2];
    shape[0] = s->shape[1], shape[1] = s->shape[2];
    return dtr_reshape(ctx, dtr_slice(ctx, s, 0, t, t + 1), 2, shape);
}

/* 1 when the B lengths are in 1..T, else 0 with the context's error (naming fn) */
static int dtr__rnn_lengths_ok(dtr_context *ctx, const char *fn, const int32_t *len, int64_t B, int64_t T) {
    int64_t b;
    for (b = 0; b < B; b++)
        if (len[b] < 1 || len[b] > T)
            return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "%s: lengths[%lld] = %d is not in 1..%lld (the sequence's steps)", fn, (long long)b,
                             (int)len[b], (long long)T), 0;
    return 1;
}

/* y (B, T, H) times a (B, T, 1) mask of 1 up to each row's length, 0 past it (PyTorch's padding
   of a packed sequence's output) */
static dtr_tensor *dtr__rnn_mask(dtr_context *ctx, const char *fn, dtr_tensor *y, const int32_t *len) {
    int64_t B = y->shape[0], T = y->shape[1], shape[3], b, t;
    float *m = (float *)dtr__arena_meta(ctx, (size_t)(B * T) * sizeof(float), fn);
    dtr_tensor *mask;
    if (!m) return NULL;
    for (b = 0; b < B; b++)
        for (t = 0; t < T; t++) m[b * T + t] = t < len[b] ? 1.0f : 0.0f;
    shape[0] = B, shape[1] = T, shape[2] = 1;
    mask = dtr_tensor_from(ctx, DTR_F32, 3, shape, m);
    if (mask && y->dtype != DTR_F32) mask = dtr_cast(ctx, mask, y->dtype);
    return mask ? dtr_mul(ctx, y, mask) : NULL;
}

/* x (T, B, F) with each row's first len[b] steps (all T without len) in reverse order, the
   padding after them where it was: a gather along time (its gradient goes back the same way) */
static dtr_tensor *dtr__rnn_reverse(dtr_context *ctx, const char *fn, dtr_tensor *x, const int32_t *len) {
    int64_t T = x->shape[0], B = x->shape[1], F = x->shape[2], t, b, f;
    int32_t *idx = (int32_t *)dtr__arena_meta(ctx, (size_t)(T * B * F) * sizeof(int32_t), fn);
    if (!idx) return NULL;
    for (t = 0; t < T; t++)
        for (b = 0; b < B; b++) {
            int64_t n = len ? len[b] : T, from = t < n ? n - 1 - t : t;
            for (f = 0; f < F; f++) idx[(t * B + b) * F + f] = (int32_t)from;
        }
    return dtr_gather(ctx, x, 0, dtr_tensor_from(ctx, DTR_I32, 3, x->shape, idx));
}

/* The recurrence `op` (DTR_OP_LSTM, DTR_OP_GRU; weights w: ih, hh, bias ih, bias hh) over x (B,
   T, I) as one op on the time-major sequence: x's gates in one GEMM over all steps, then the
   op. Returns h (B, T, H) in x's layout, zero past each row's length (cfg), and the state after
   each row's last step in *h_out, *c_out (a padded row's state is carried to the end). In
   reverse (cfg), each row's steps are reversed before and its outputs back after. */
static dtr_tensor *dtr__rnn_layer_run(dtr_context *ctx, const char *fn, int op, dtr_tensor *const *w, dtr_tensor *x, dtr_tensor *h,
                                      dtr_tensor *c, const dtr_rnn_config *cfg, dtr_tensor **h_out, dtr_tensor **c_out) {
    int64_t T = x->shape[1], H = w[1]->shape[1];
    const int32_t *len = cfg ? cfg->lengths : NULL;
    int rev = cfg && cfg->reverse;
    dtr_tensor *gx, *out, *hs, *xt, *y;
    if (len && !dtr__rnn_lengths_ok(ctx, fn, len, x->shape[0], T)) return NULL;
    xt = dtr__rnn_swap(ctx, x);
    if (rev && xt) xt = dtr__rnn_reverse(ctx, fn, xt, len);
    gx = xt ? dtr_linear(ctx, xt, w[0], w[2]) : NULL;
    if (!gx || !(out = dtr__rnn_sequence(ctx, fn, op, gx, w[1], w[3], h, c, len))) return NULL;
    hs = op == DTR_OP_LSTM ? dtr_slice(ctx, out, -1, 0, H) : out;
    y = dtr__rnn_swap(ctx, rev && hs ? dtr__rnn_reverse(ctx, fn, hs, len) : hs);
    if (len && y) y = dtr__rnn_mask(ctx, fn, y, len);
    if (h_out) *h_out = dtr__rnn_at(ctx, hs, T - 1);
    if (c_out) *c_out = dtr__rnn_at(ctx, dtr_slice(ctx, out, -1, H, 2 * H), T - 1);
    return ctx->status == DTR_OK ? y : NULL;
}

dtr_rnn_config dtr_rnn_config_init(void) {
    dtr_rnn_config c;
    memset(&c, 0, sizeof c);
    return c;
}

dtr_tensor *dtr_lstm_layer_forward_ex(dtr_context *ctx, const dtr_lstm_layer *l, dtr_tensor *x, dtr_tensor *h0, dtr_tensor *c0,
                                      const dtr_rnn_config *cfg, dtr_tensor **h_out, dtr_tensor **c_out) {
    static const char fn[] = "dtr_lstm_layer_forward";
    dtr_tensor *w[4];
    if (!ctx) return NULL;
    if (h_out) *h_out = NULL;
    if (c_out) *c_out = NULL;
    if (!l) return dtr__failt(ctx, DTR_NULL_HANDLE, "dtr_lstm_layer_forward: layer is NULL");
    if (!dtr__rnn_check(ctx, fn, x, 3, l->in, l->hidden, h0, c0)) return NULL;
    if (x->shape[1] == 0) return dtr__failt(ctx, DTR_SHAPE_MISMATCH, "dtr_lstm_layer_forward: a sequence of 0 steps");
    w[0] = l->weight_ih, w[1] = l->weight_hh, w[2] = l->bias_ih, w[3] = l->bias_hh;
    return dtr__rnn_layer_run(ctx, fn, DTR_OP_LSTM, w, x, h0, c0, cfg, h_out, c_out);
}

dtr_tensor *dtr_gru_layer_forward_ex(dtr_context *ctx, const dtr_gru_layer *l, dtr_tensor *x, dtr_tensor *h0, const dtr_rnn_config *cfg,
                                     dtr_tensor **h_out) {
    static const char fn[] = "dtr_gru_layer_forward";
    dtr_tensor *w[4];
    if (!ctx) return NULL;
    if (h_out) *h_out = NULL;
    if (!l) return dtr__failt(ctx, DTR_NULL_HANDLE, "dtr_gru_layer_forward: layer is NULL");
    if (!dtr__rnn_check(ctx, fn, x, 3, l->in, l->hidden, h0, NULL)) return NULL;
    if (x->shape[1] == 0) return dtr__failt(ctx, DTR_SHAPE_MISMATCH, "dtr_gru_layer_forward: a sequence of 0 steps");
    w[0] = l->weight_ih, w[1] = l->weight_hh, w[2] = l->bias_ih, w[3] = l->bias_hh;
    return dtr__rnn_layer_run(ctx, fn, DTR_OP_GRU, w, x, h0, NULL, cfg, h_out, NULL);
}

dtr_tensor *dtr_lstm_layer_forward(dtr_context *ctx, const dtr_lstm_layer *l, dtr_tensor *x, dtr_tensor *h0, dtr_tensor *c0,
                                   dtr_tensor **h_out, dtr_tensor **c_out) {
    return dtr_lstm_layer_forward_ex(ctx, l, x, h0, c0, NULL, h_out, c_out);
}

dtr_tensor *dtr_gru_layer_forward(dtr_context *ctx, const dtr_gru_layer *l, dtr_tensor *x, dtr_tensor *h0, dtr_tensor **h_out) {
    return dtr_gru_layer_forward_ex(ctx, l, x, h0, NULL, h_out);
}
