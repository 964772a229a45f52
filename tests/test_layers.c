/* Layers made of ops, against PyTorch 1.13's numbers (computed in double; the tolerances
 * are f32's):
 *   test_lstm_gru_torch   dtr_lstm_layer / dtr_gru_layer over a sequence (B 2, T 3, I 3, H 2)
 *                         from a given state, with fixed weights: the outputs, the last state,
 *                         and the gradients of sum(y * R) for x, weight_hh and bias_ih equal
 *                         nn.LSTM's and nn.GRU's (batch_first); the step functions give the
 *                         sequence's rows; a NULL state is zeros.
 *   test_lstm_gru_sequence dtr_lstm_sequence's h and c and dtr_gru_sequence's h at every step
 *                         equal, bit for bit, the steps made of ops (dtr_linear, dtr_add,
 *                         dtr_lstm_cell; the GRU's sigmoid, mul, tanh and sub) at 1, 2 and 5
 *                         threads, with and without bias and state; their gradients are the
 *                         same bits whether each worker walks its own rows or the steps run
 *                         over the whole pool; bad shapes are errors.
 *   test_rnn_lengths      an LSTM and a GRU over rows of 7, 3, 1, 5 and 7 steps (dtr_rnn_config),
 *                         forward and in reverse (each row's steps reversed, its outputs
 *                         reversed back), equal each row run alone: outputs and last states bit
 *                         for bit, zeros past each row's end (a huge gradient there changes
 *                         nothing), the weights' gradients within 1e-4; lengths outside 1..T
 *                         are errors.
 *   test_rnn_learns       an LSTM and a GRU learn to add two numbers shown at marked steps of
 *                         a noisy sequence (a memory task a feed-forward net cannot do).
 *   test_group_norm_torch dtr_group_norm and its layer against F.group_norm, with the
 *                         gradients of x, weight and bias; groups = C (instance norm).
 *   test_batch_norm_torch dtr_batchnorm_layer against nn.BatchNorm2d: a training step's output
 *                         and gradients, the running statistics after two batches, evaluation
 *                         mode; its running statistics are model buffers (found by name, no
 *                         gradient, not in dtr_model_numel) saved and loaded by name.
 *   test_buffers          buffers in the model's state ("buffers"), so in a full-state checkpoint
 *                         (saved, overwritten, restored), and split by dtr_model_keep; a
 *                         name taken; a batch norm inside dtr_checkpoint moves its statistics
 *                         once a step (the recomputation in backward leaves them).
 *   test_conv_torch       dtr_conv2d_layer_init_ex (2 x 3 kernel, stride (2, 1), padding (1, 2),
 *                         dilation (2, 1), 2 groups) against nn.Conv2d and a depthwise dilated
 *                         dtr_conv1d_layer against nn.Conv1d: outputs and the gradients of x,
 *                         weight and bias, at 1 and 2 threads; a transposed convolution layer
 *                         (stride 2, output padding, dilation, 2 groups) against
 *                         nn.ConvTranspose2d likewise; max_pool1d and avg_pool1d.
 *   test_model_lerp       dtr_model_lerp: parameters and buffers become (1 - tau) t + tau s with
 *                         PyTorch's roundings; tau 0 leaves, tau 1 copies; another layout (naming
 *                         the parameter), another context, a bad tau: errors.
 *   test_lora             a LoRA adapter on a linear layer: PEFT's names and shapes, the base
 *                         layer's output bits at init, only "*lora_" trainable (the base keeps
 *                         its bits, AdamW holds moments for the adapter alone), the trained
 *                         output against x W^T + b + s (x A^T) B^T in double, merging (the same
 *                         output, B zero), a base file loaded with "*lora_" optional (without:
 *                         DTR_NOT_FOUND), the adapter alone saved (dtr_save_config.only: two
 *                         tensors) and read back with "*" optional, and the errors.
 *   test_conv_bands       the input's gradient made a band of output rows at a time (three bands;
 *                         stride 1 and 2) against direct loops in double, the same bits on 1, 2
 *                         and 5 threads (more threads than samples: slabs of pixels, channels)
 *   test_tied_weights     one parameter read by an embedding and an output head (GPT-2's tied
 *                         weights), or by an embedding and a matmul: its gradient is the sum of
 *                         the two uses'.
 *   test_layer_errors     wrong shapes and counts, batch norm's and convolution's bad
 *                         arguments: a clear error, no tensor. */
#define _POSIX_C_SOURCE 200809L
#define _DEFAULT_SOURCE
#include "test.h"
#include "test_util.h"
#include "posix_util.h"

#define I_ 3
#define H_ 2
#define B_ 2
#define T_ 3

static void fill(float *x, int n, double a, double f, double ph, int cosine) {
    int k;
    for (k = 0; k < n; k++) x[k] = (float)(a * (cosine ? cos(f * k + ph) : sin(f * k + ph)));
}

typedef struct rnn_ref { const double *y, *hn, *cn, *gx, *gwhh, *gbih; } rnn_ref;

static const double k_lstm_y[12] = {0.183872125, -0.0640050726, 0.118518845, -0.0876014379, -0.0272368799, 0.0193222333,
                                    0.248909794, -0.0961583236, 0.145328894, -0.104764491, -0.0190352311, 0.00338488826};
static const double k_lstm_hn[4] = {-0.0272368799, 0.0193222333, -0.0190352311, 0.00338488826};
static const double k_lstm_cn[4] = {-0.0620594772, 0.0332678789, -0.0430557449, 0.00584265743};
static const double k_lstm_gx[18] = {0.0778889192, 0.147834385, 0.0818615987, 0.040521901, 0.0823210464, 0.0484346014,
                                     0.00299210162, 0.00732203787, 0.00492012626, -0.0397050897, -0.0513564991, -0.01579098,
                                     -0.0392873723, -0.0561728899, -0.0214133115, 0.0150420481, 0.0533326958, 0.042589509};
static const double k_lstm_gwhh[16] = {0.0254011041, 0.0170982517, -0.0178601226, -0.0249955097, -0.0088632868, 0.00649024244,
                                       0.0160727281, -0.00528928242, 0.0530047828, 0.0936150624, -0.06736777, 0.102048142,
                                       0.0108776044, 0.0104216028, -0.00330219365, -0.0135383359};
static const double k_lstm_gbih[8] = {0.0670715876, 0.0225193697, -0.0448573753, 0.0705141374,
                                      0.133194738, -0.545435863, 0.0472632908, 0.0154066552};
static const double k_gru_y[12] = {0.303596211, -0.27662126, 0.21405732, -0.216193956, -0.17166192, -0.0430292539,
                                   0.177971522, -0.420165466, 0.165170383, -0.291798769, -0.182123326, -0.0955949819};
static const double k_gru_hn[4] = {-0.17166192, -0.0430292539, -0.182123326, -0.0955949819};
static const double k_gru_gx[18] = {-0.0386515928, -0.108409596, -0.0784963161, 0.045336175, 0.0643672663, 0.0242193898,
                                    0.0352290272, 0.0703850447, 0.0408293767, 0.0540463802, 0.155302253, 0.11377395,
                                    -0.0267268881, 0.0270264718, 0.0559318182, -0.0910017936, -0.146127557, -0.066904318};
static const double k_gru_gwhh[12] = {-0.00155998881, 0.0104546642, 0.00156155584, -0.0211518317, -0.0231454911, -0.0133271886,
                                      0.0783434909, -0.026869735, 0.0722873343, 0.153264666, 0.00929958271, 0.233905036};
static const double k_gru_gbih[6] = {-0.0276949358, 0.0488418918, -0.0260378314, 0.276711217, -0.155674018, -0.766778885};

static void check_near(const char *what, const float *got, const double *want, int n) {
    int i;
    double worst = 0.0;
    for (i = 0; i < n; i++) worst = fmax(worst, fabs(got[i] - want[i]) / (1.0 + fabs(want[i])));
    CHECK_MSG(worst < 2e-6, "%s: worst relative difference %.3g from PyTorch", what, worst);
}

static void check_tensor(const char *what, dtr_tensor *t, const double *want, int n) {
    float v[32];
    CHECK_MSG(t && dtr_tensor_numel(t) == n, "%s: missing or of %lld elements", what, t ? (long long)dtr_tensor_numel(t) : -1LL);
    if (!t || dtr_tensor_numel(t) != n) return;
    dtr_tensor_read(t, DTR_F32, v, (size_t)n);
    check_near(what, v, want, n);
}

/* the weights of the reference: weight_ih[k] = 0.3 sin(k + 1), weight_hh[k] = 0.3 cos(k + 1),
   bias_ih[k] = 0.1 sin(2k + 1), bias_hh[k] = 0.1 cos(3k + 1) */
static void set_weights(dtr_tensor *const *w, int G) {
    float buf[64];
    fill(buf, G * H_ * I_, 0.3, 1, 1, 0), dtr_tensor_write(w[0], DTR_F32, buf, (size_t)(G * H_ * I_));
    fill(buf, G * H_ * H_, 0.3, 1, 1, 1), dtr_tensor_write(w[1], DTR_F32, buf, (size_t)(G * H_ * H_));
    fill(buf, G * H_, 0.1, 2, 1, 0), dtr_tensor_write(w[2], DTR_F32, buf, (size_t)(G * H_));
    fill(buf, G * H_, 0.1, 3, 1, 1), dtr_tensor_write(w[3], DTR_F32, buf, (size_t)(G * H_));
}

/* x[k] = sin(0.7k + 0.2) (B, T, I), h0[k] = 0.2 cos(k), c0[k] = 0.1 sin(k), R[k] = cos(0.3k) */
static void check_rnn(int lstm, const rnn_ref *ref) {
    dtr_context *ctx = test_ctx(1);
    dtr_model *m;
    dtr_lstm_layer ll;
    dtr_gru_layer gl;
    float xs[B_ * T_ * I_], h0s[B_ * H_], c0s[B_ * H_], rs[B_ * T_ * H_];
    int64_t xshape[3] = {B_, T_, I_}, sshape[2] = {B_, H_}, yshape[3] = {B_, T_, H_};
    dtr_tensor *x, *h0, *c0, *y, *hn = NULL, *cn = NULL, *w[4];
    const char *what = lstm ? "lstm" : "gru";
    dtr_model_create(ctx, 1, &m);
    if (lstm) CHECK_OK(ctx, dtr_lstm_layer_init(&ll, m, "rnn", I_, H_));
    else CHECK_OK(ctx, dtr_gru_layer_init(&gl, m, "rnn", I_, H_));
    CHECK_OK(ctx, dtr_model_build(m));
    w[0] = dtr_model_find(m, "rnn.weight_ih"), w[1] = dtr_model_find(m, "rnn.weight_hh");
    w[2] = dtr_model_find(m, "rnn.bias_ih"), w[3] = dtr_model_find(m, "rnn.bias_hh");
    CHECK(w[0] && w[1] && w[2] && w[3] && w[0] == (lstm ? ll.weight_ih : gl.weight_ih));
    set_weights(w, lstm ? 4 : 3);
    fill(xs, B_ * T_ * I_, 1, 0.7, 0.2, 0), fill(h0s, B_ * H_, 0.2, 1, 0, 1), fill(c0s, B_ * H_, 0.1, 1, 0, 0);
    fill(rs, B_ * T_ * H_, 1, 0.3, 0, 1);
    x = dtr_tensor_requires_grad(dtr_tensor_from(ctx, DTR_F32, 3, xshape, xs));
    h0 = dtr_tensor_from(ctx, DTR_F32, 2, sshape, h0s), c0 = dtr_tensor_from(ctx, DTR_F32, 2, sshape, c0s);
    y = lstm ? dtr_lstm_layer_forward(ctx, &ll, x, h0, c0, &hn, &cn) : dtr_gru_layer_forward(ctx, &gl, x, h0, &hn);
    CHECK_OK(ctx, dtr_backward(ctx, dtr_sum_all(ctx, dtr_mul(ctx, y, dtr_tensor_from(ctx, DTR_F32, 3, yshape, rs)))));
    CHECK_MSG(dtr_tensor_ndim(y) == 3 && dtr_tensor_dim(y, 1) == T_ && dtr_tensor_dim(y, 2) == H_, "%s: y's shape", what);
    check_tensor(what, y, ref->y, 12);
    check_tensor("last h", hn, ref->hn, 4);
    if (lstm) check_tensor("last c", cn, ref->cn, 4);
    check_near("x's gradient", dtr_tensor_grad(x), ref->gx, 18);
    check_near("weight_hh's gradient", dtr_tensor_grad(w[1]), ref->gwhh, lstm ? 16 : 12);
    check_near("bias_ih's gradient", dtr_tensor_grad(w[2]), ref->gbih, lstm ? 8 : 6);
    dtr_model_destroy(m);
    dtr_context_destroy(ctx);
}

/* the step functions give the sequence's rows; NULL state = zeros */
static void check_steps(int lstm) {
    dtr_context *ctx = test_ctx(1);
    dtr_model *m;
    dtr_lstm_layer ll;
    dtr_gru_layer gl;
    float xs[B_ * T_ * I_], seq[B_ * T_ * H_], step[B_ * H_], zero[B_ * H_] = {0};
    int64_t xshape[3] = {B_, T_, I_}, x1[2] = {B_, I_}, sshape[2] = {B_, H_};
    dtr_tensor *h = NULL, *c = NULL, *hz, *cz;
    int t, b, j;
    dtr_model_create(ctx, 1, &m);
    if (lstm) dtr_lstm_layer_init(&ll, m, "rnn", I_, H_);
    else dtr_gru_layer_init(&gl, m, "rnn", I_, H_);
    CHECK_OK(ctx, dtr_model_build(m));
    fill(xs, B_ * T_ * I_, 1, 0.7, 0.2, 0);
    dtr_tensor_read(lstm ? dtr_lstm_layer_forward(ctx, &ll, dtr_tensor_from(ctx, DTR_F32, 3, xshape, xs), NULL, NULL, NULL, NULL)
                         : dtr_gru_layer_forward(ctx, &gl, dtr_tensor_from(ctx, DTR_F32, 3, xshape, xs), NULL, NULL),
                    DTR_F32, seq, B_ * T_ * H_);
    for (t = 0; t < T_; t++) {
        float xt[B_ * I_];
        dtr_tensor *xv, *hz2;
        for (b = 0; b < B_; b++) memcpy(xt + b * I_, xs + (b * T_ + t) * I_, I_ * sizeof(float));
        xv = dtr_tensor_from(ctx, DTR_F32, 2, x1, xt);
        if (t == 0) {   /* zeros given explicitly = NULL */
            hz = dtr_tensor_from(ctx, DTR_F32, 2, sshape, zero), cz = dtr_tensor_from(ctx, DTR_F32, 2, sshape, zero);
            hz2 = lstm ? dtr_lstm_layer_step(ctx, &ll, xv, hz, cz, &cz) : dtr_gru_layer_step(ctx, &gl, xv, hz);
        }
        h = lstm ? dtr_lstm_layer_step(ctx, &ll, xv, h, c, &c) : dtr_gru_layer_step(ctx, &gl, xv, h);
        CHECK_OK(ctx, dtr_context_status(ctx));
        dtr_tensor_read(h, DTR_F32, step, B_ * H_);
        for (b = 0; b < B_; b++)
            for (j = 0; j < H_; j++)
                CHECK_MSG(fabsf(step[b * H_ + j] - seq[(b * T_ + t) * H_ + j]) < 1e-6f, "%s step %d", lstm ? "lstm" : "gru", t);
        if (t == 0) {
            float zs[B_ * H_];
            dtr_tensor_read(hz2, DTR_F32, zs, B_ * H_);
            CHECK(memcmp(zs, step, sizeof zs) == 0);
        }
    }
    dtr_model_destroy(m);
    dtr_context_destroy(ctx);
}

static void test_lstm_gru_torch(void) {
    rnn_ref lstm = {k_lstm_y, k_lstm_hn, k_lstm_cn, k_lstm_gx, k_lstm_gwhh, k_lstm_gbih};
    rnn_ref gru = {k_gru_y, k_gru_hn, NULL, k_gru_gx, k_gru_gwhh, k_gru_gbih};
    check_rnn(1, &lstm);
    check_rnn(0, &gru);
    check_steps(1);
    check_steps(0);
}

/* ---- dtr_lstm_sequence: the same bits as its steps made of ops ---- */

enum { SQ_T = 4, SQ_B = 33, SQ_H = 40 };

/* a GRU step made of ops, as dtr_gru_layer_step's: gh = h W^T + b (b alone without h, zeros
   without either), r and z sigmoids of gx + gh, n = tanh(gx_n + r gh_n), h' = n + z (h - n) */
static dtr_tensor *gru_step_ops(dtr_context *ctx, dtr_tensor *gx, dtr_tensor *h, dtr_tensor *W, dtr_tensor *Bv) {
    int64_t H = dtr_tensor_dim(W, 1), zs[2] = {dtr_tensor_dim(gx, 0), 3 * H};
    dtr_tensor *gh = h ? dtr_linear(ctx, h, W, Bv) : Bv ? Bv : dtr_tensor_zeros(ctx, DTR_F32, 2, zs);
    dtr_tensor *sg = dtr_sigmoid(ctx, dtr_add(ctx, dtr_slice(ctx, gx, -1, 0, 2 * H), dtr_slice(ctx, gh, -1, 0, 2 * H)));
    dtr_tensor *z = dtr_slice(ctx, sg, -1, H, 2 * H), *rh = dtr_mul(ctx, dtr_slice(ctx, sg, -1, 0, H), dtr_slice(ctx, gh, -1, 2 * H, 3 * H));
    dtr_tensor *n = dtr_tanh(ctx, dtr_add(ctx, dtr_slice(ctx, gx, -1, 2 * H, 3 * H), rh));
    return h ? dtr_add(ctx, n, dtr_mul(ctx, z, dtr_sub(ctx, h, n))) : dtr_sub(ctx, n, dtr_mul(ctx, z, n));
}

/* dtr_lstm_sequence's h and c (dtr_gru_sequence's h) at every step against the steps made of
   ops (the LSTM's: dtr_linear + dtr_add + dtr_lstm_cell), bit for bit, with b_hh and the state
   or without; every unit compared */
static void check_sequence_bits(int gru, int threads, int full) {
    static float gx[SQ_T * SQ_B * 4 * SQ_H], w[4 * SQ_H * SQ_H], b[4 * SQ_H], h0[SQ_B * SQ_H], c0[SQ_B * SQ_H];
    static float seq_h[SQ_T * SQ_B * SQ_H], seq_c[SQ_T * SQ_B * SQ_H], step_h[SQ_B * SQ_H], step_c[SQ_B * SQ_H];
    dtr_context *ctx = test_ctx(threads);
    int64_t NG = (gru ? 3 : 4) * SQ_H, gs[3] = {SQ_T, SQ_B, NG}, ws[2] = {NG, SQ_H}, ss[2] = {SQ_B, SQ_H}, g2[2] = {SQ_B, NG};
    dtr_tensor *G, *W, *Bv, *H0, *C0, *cs = NULL, *hs, *h, *c;
    int t, bad = 0, k;
    fill(gx, SQ_T * SQ_B * (int)NG, 1.5, 0.37, 0.1, 0), fill(w, (int)NG * SQ_H, 0.3, 0.71, 0.4, 1), fill(b, (int)NG, 0.5, 1.3, 0.2, 0);
    fill(h0, SQ_B * SQ_H, 0.8, 0.53, 0.3, 1), fill(c0, SQ_B * SQ_H, 1.2, 0.29, 0.7, 0);
    G = dtr_tensor_from(ctx, DTR_F32, 3, gs, gx), W = dtr_tensor_from(ctx, DTR_F32, 2, ws, w);
    Bv = full ? dtr_tensor_from(ctx, DTR_F32, 1, &NG, b) : NULL;
    H0 = full ? dtr_tensor_from(ctx, DTR_F32, 2, ss, h0) : NULL, C0 = full && !gru ? dtr_tensor_from(ctx, DTR_F32, 2, ss, c0) : NULL;
    hs = gru ? dtr_gru_sequence(ctx, G, W, Bv, H0) : dtr_lstm_sequence(ctx, G, W, Bv, H0, C0, &cs);
    CHECK_OK(ctx, dtr_context_status(ctx));
    CHECK(dtr_tensor_ndim(hs) == 3 && dtr_tensor_dim(hs, 0) == SQ_T && dtr_tensor_dim(hs, 1) == SQ_B && dtr_tensor_dim(hs, 2) == SQ_H);
    dtr_tensor_read(hs, DTR_F32, seq_h, SQ_T * SQ_B * SQ_H);
    if (!gru) dtr_tensor_read(cs, DTR_F32, seq_c, SQ_T * SQ_B * SQ_H);
    h = H0, c = C0;
    for (t = 0; t < SQ_T; t++) {
        dtr_tensor *gt = dtr_tensor_from(ctx, DTR_F32, 2, g2, gx + t * SQ_B * NG);
        if (gru) {
            h = gru_step_ops(ctx, gt, h, W, Bv);
        } else {
            dtr_tensor *a = h ? dtr_add(ctx, gt, dtr_linear(ctx, h, W, Bv)) : Bv ? dtr_add(ctx, gt, Bv) : gt;
            h = dtr_lstm_cell(ctx, a, c, &c);
        }
        CHECK_OK(ctx, dtr_context_status(ctx));
        dtr_tensor_read(h, DTR_F32, step_h, SQ_B * SQ_H);
        if (!gru) dtr_tensor_read(c, DTR_F32, step_c, SQ_B * SQ_H);
        for (k = 0; k < SQ_B * SQ_H; k++)
            bad += memcmp(&step_h[k], &seq_h[t * SQ_B * SQ_H + k], 4) != 0 || (!gru && memcmp(&step_c[k], &seq_c[t * SQ_B * SQ_H + k], 4) != 0);
    }
    CHECK_MSG(bad == 0, "%s: %d of %d units differ from the steps made of ops (%d threads, %s)", gru ? "gru" : "lstm", bad, SQ_T * SQ_B * SQ_H,
              threads, full ? "bias and state" : "none");
    dtr_context_destroy(ctx);
}

/* the gradients of gx, w_hh, b_hh, h0 (and c0) from every step's h (and c) (dtr_backward_from
   with a fixed gradient) into g (in that order): each worker walking its own rows (1 and 2
   threads) or the steps over the whole pool (5 threads: 33 rows are too few to split) */
static void sequence_grads(int gru, int threads, float *g) {
    static float gx[SQ_T * SQ_B * 4 * SQ_H], w[4 * SQ_H * SQ_H], b[4 * SQ_H], h0[SQ_B * SQ_H], c0[SQ_B * SQ_H];
    static float dy[SQ_T * SQ_B * 2 * SQ_H];
    dtr_context *ctx = test_ctx(threads);
    int64_t NG = (gru ? 3 : 4) * SQ_H, gs[3] = {SQ_T, SQ_B, NG}, ws[2] = {NG, SQ_H}, ss[2] = {SQ_B, SQ_H};
    dtr_tensor *in[5], *cs, *hs, *both[2];
    int i;
    int64_t n[5] = {SQ_T * SQ_B * NG, NG * SQ_H, NG, SQ_B * SQ_H, SQ_B * SQ_H};
    fill(gx, (int)n[0], 1.5, 0.37, 0.1, 0), fill(w, (int)n[1], 0.3, 0.71, 0.4, 1), fill(b, (int)n[2], 0.5, 1.3, 0.2, 0);
    fill(h0, (int)n[3], 0.8, 0.53, 0.3, 1), fill(c0, (int)n[4], 1.2, 0.29, 0.7, 0), fill(dy, SQ_T * SQ_B * 2 * SQ_H, 1.0, 0.61, 0.5, 1);
    in[0] = dtr_tensor_requires_grad(dtr_tensor_from(ctx, DTR_F32, 3, gs, gx));
    in[1] = dtr_tensor_requires_grad(dtr_tensor_from(ctx, DTR_F32, 2, ws, w));
    in[2] = dtr_tensor_requires_grad(dtr_tensor_from(ctx, DTR_F32, 1, &NG, b));
    in[3] = dtr_tensor_requires_grad(dtr_tensor_from(ctx, DTR_F32, 2, ss, h0));
    in[4] = dtr_tensor_requires_grad(dtr_tensor_from(ctx, DTR_F32, 2, ss, c0));
    if (gru) {
        CHECK_OK(ctx, dtr_backward_from(ctx, dtr_gru_sequence(ctx, in[0], in[1], in[2], in[3]), dy));
    } else {
        hs = dtr_lstm_sequence(ctx, in[0], in[1], in[2], in[3], in[4], &cs);
        both[0] = hs, both[1] = cs;
        CHECK_OK(ctx, dtr_backward_from(ctx, dtr_concat(ctx, both, 2, -1), dy));
    }
    for (i = 0; i < (gru ? 4 : 5); i++) {
        CHECK(dtr_tensor_read_grad(in[i], g, n[i]) == DTR_OK);
        g += n[i];
    }
    dtr_context_destroy(ctx);
}

static void check_sequence_grads(int gru) {
    enum { NG = SQ_T * SQ_B * 4 * SQ_H + 4 * SQ_H * SQ_H + 4 * SQ_H + 2 * SQ_B * SQ_H };
    static float g1[NG], g2[NG], g5[NG];
    int k, nonzero = 0, used = gru ? SQ_T * SQ_B * 3 * SQ_H + 3 * SQ_H * SQ_H + 3 * SQ_H + SQ_B * SQ_H : NG;
    memset(g1, 0, sizeof g1), memset(g2, 0, sizeof g2), memset(g5, 0, sizeof g5);
    sequence_grads(gru, 1, g1), sequence_grads(gru, 2, g2), sequence_grads(gru, 5, g5);
    for (k = 0; k < used; k++) nonzero += g1[k] != 0.0f;
    CHECK_MSG(nonzero > used * 9 / 10, "%s: %d of %d gradients nonzero", gru ? "gru" : "lstm", nonzero, used);
    CHECK_MSG(memcmp(g1, g2, sizeof g1) == 0, "%s: the gradients at 2 threads (rows split) differ from 1 thread's", gru ? "gru" : "lstm");
    CHECK_MSG(memcmp(g1, g5, sizeof g1) == 0, "%s: the gradients at 5 threads (step by step) differ from 1 thread's", gru ? "gru" : "lstm");
}

/* bad shapes: a clear error and no tensor */
static void check_sequence_errors(void) {
    dtr_context *ctx = test_ctx(1);
    int64_t g[3] = {2, 3, 8}, w[2] = {8, 2}, g6[2] = {6, 2}, w3[2] = {8, 3}, b5 = 5, s[2] = {3, 2}, s4[2] = {4, 2}, g0[3] = {0, 3, 8};
    dtr_tensor *G = dtr_tensor_zeros(ctx, DTR_F32, 3, g), *W = dtr_tensor_zeros(ctx, DTR_F32, 2, w), *S = dtr_tensor_zeros(ctx, DTR_F32, 2, s), *cs;
    struct { dtr_tensor *g, *w, *b, *h0, *c0; const char *msg; } bad[] = {
        {G, dtr_tensor_zeros(ctx, DTR_F32, 2, w3), NULL, NULL, NULL, "w_hh is (8, 3), not (4H, H)"},
        {dtr_tensor_zeros(ctx, DTR_F32, 2, w), W, NULL, NULL, NULL, "gx is (8, 2), not (T, B, 8)"},
        {dtr_tensor_zeros(ctx, DTR_F32, 3, g0), W, NULL, NULL, NULL, "gx is (0, 3, 8)"},
        {G, W, dtr_tensor_zeros(ctx, DTR_F32, 1, &b5), NULL, NULL, "b_hh is (5), not (8)"},
        {G, W, NULL, S, dtr_tensor_zeros(ctx, DTR_F32, 2, s4), "c0 is (4, 2), not (3, 2)"},
        {G, W, NULL, dtr_tensor_zeros(ctx, DTR_F32, 2, s4), S, "h0 is (4, 2), not (3, 2)"},
    };
    size_t i;
    for (i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        CHECK(dtr_lstm_sequence(ctx, bad[i].g, bad[i].w, bad[i].b, bad[i].h0, bad[i].c0, &cs) == NULL && cs == NULL);
        CHECK_MSG(dtr_context_status(ctx) == DTR_SHAPE_MISMATCH && strstr(dtr_context_last_error(ctx), bad[i].msg),
                  "case %d: %s", (int)i, dtr_context_last_error(ctx));
        dtr_context_clear_error(ctx);
    }
    CHECK(dtr_lstm_sequence(ctx, G, W, NULL, NULL, NULL, NULL) == NULL && dtr_context_status(ctx) == DTR_NULL_HANDLE);
    dtr_context_clear_error(ctx);
    CHECK(dtr_gru_sequence(ctx, G, dtr_tensor_zeros(ctx, DTR_F32, 2, g6), NULL, NULL) == NULL);   /* gx (2, 3, 8) for w_hh (6, 2) */
    CHECK_MSG(dtr_context_status(ctx) == DTR_SHAPE_MISMATCH && strstr(dtr_context_last_error(ctx), "dtr_gru_sequence: gx is (2, 3, 8), not (T, B, 6)"),
              "%s", dtr_context_last_error(ctx));
    dtr_context_clear_error(ctx);
    CHECK(dtr_gru_sequence(ctx, G, W, NULL, NULL) == NULL && strstr(dtr_context_last_error(ctx), "w_hh is (8, 2), not (3H, H)"));
    dtr_context_destroy(ctx);
}

static void test_lstm_gru_sequence(void) {
    int gru;
    for (gru = 0; gru < 2; gru++) {
        check_sequence_bits(gru, 1, 1);
        check_sequence_bits(gru, 2, 1);
        check_sequence_bits(gru, 2, 0);
        check_sequence_bits(gru, 5, 1);
        check_sequence_grads(gru);
    }
    check_sequence_errors();
}

/* ---- sequences of different lengths (dtr_rnn_config.lengths) ---- */

enum { PL_B = 5, PL_T = 7, PL_I = 4, PL_H = 6 };

/* the layer (LSTM or GRU) over x (rows, T, I) with lengths (or NULL): y, the last h and c read into
   the arrays; the weights' gradients of sum(y * dy) + sum(h * dh) (dy and dh of those rows) into gw */
static void padded_run(dtr_context *ctx, dtr_model *m, int gru, const dtr_lstm_layer *ll, const dtr_gru_layer *gl, const float *x,
                       int64_t rows, int64_t T, const int32_t *lengths, int reverse, const float *dy, const float *dh, float *y, float *h,
                       float *c, float *gw) {
    dtr_rnn_config cfg = dtr_rnn_config_init();
    int64_t xs[3] = {rows, T, PL_I}, ys[3] = {rows, T, PL_H}, hs[2] = {rows, PL_H};
    dtr_tensor *X = dtr_tensor_from(ctx, DTR_F32, 3, xs, x), *Y, *Hn = NULL, *Cn = NULL, *l;
    cfg.lengths = lengths, cfg.reverse = reverse;
    dtr_model_zero_grad(m);
    Y = gru ? dtr_gru_layer_forward_ex(ctx, gl, X, NULL, &cfg, &Hn) : dtr_lstm_layer_forward_ex(ctx, ll, X, NULL, NULL, &cfg, &Hn, &Cn);
    l = dtr_add(ctx, dtr_sum_all(ctx, dtr_mul(ctx, Y, dtr_tensor_from(ctx, DTR_F32, 3, ys, dy))),
                dtr_sum_all(ctx, dtr_mul(ctx, Hn, dtr_tensor_from(ctx, DTR_F32, 2, hs, dh))));
    CHECK_OK(ctx, dtr_backward(ctx, l));
    dtr_tensor_read(Y, DTR_F32, y, (size_t)(rows * T * PL_H));
    dtr_tensor_read(Hn, DTR_F32, h, (size_t)(rows * PL_H));
    if (!gru) dtr_tensor_read(Cn, DTR_F32, c, (size_t)(rows * PL_H));
    CHECK_OK(ctx, dtr_model_read_grads(m, gw, (size_t)dtr_model_numel(m)));
    dtr_context_reset(ctx);
}

/* rows n steps of x (T, I) in reverse order, into xr */
static void reverse_steps(const float *x, int n, int width, float *xr) {
    int t;
    for (t = 0; t < n; t++) memcpy(xr + t * width, x + (n - 1 - t) * width, (size_t)width * sizeof(float));
}

/* A batch of rows of 7, 3, 1, 5 and 7 steps equals each row run alone over its own steps (in
   reverse: over its steps reversed, its outputs reversed back): the outputs and last states bit
   for bit (zeros past each row's length), the weights' gradients within 1e-4 (summed in another
   order); lengths outside 1..T are errors. */
static void check_padded(int gru, int rev) {
    static const int32_t len[PL_B] = {7, 3, 1, 5, 7};
    float x[PL_B * PL_T * PL_I], dy[PL_B * PL_T * PL_H], dh[PL_B * PL_H], y[PL_B * PL_T * PL_H], h[PL_B * PL_H], c[PL_B * PL_H];
    float y1[PL_T * PL_H], h1[PL_H], c1[PL_H], gw[2048], gsum[2048] = {0}, g1[2048];
    dtr_context *ctx = test_ctx(2);
    dtr_model *m;
    dtr_lstm_layer ll;
    dtr_gru_layer gl;
    int b, k, bad = 0;
    int64_t n;
    double worst = 0;
    dtr_model_create(ctx, 3, &m);
    if (gru) dtr_gru_layer_init(&gl, m, "rnn", PL_I, PL_H);
    else dtr_lstm_layer_init(&ll, m, "rnn", PL_I, PL_H);
    CHECK_OK(ctx, dtr_model_build(m));
    n = dtr_model_numel(m);
    fill(x, PL_B * PL_T * PL_I, 1.0, 0.77, 0.3, 0), fill(dy, PL_B * PL_T * PL_H, 1.0, 0.41, 0.9, 1), fill(dh, PL_B * PL_H, 1.0, 0.93, 0.2, 0);
    for (b = 0; b < PL_B; b++)   /* the padding's gradient is never used: make it loud */
        for (k = len[b] * PL_H; k < PL_T * PL_H; k++) dy[b * PL_T * PL_H + k] = 1e6f;
    padded_run(ctx, m, gru, &ll, &gl, x, PL_B, PL_T, len, rev, dy, dh, y, h, c, gw);
    for (b = 0; b < PL_B; b++) {
        float xr[PL_T * PL_I], dyr[PL_T * PL_H], yr[PL_T * PL_H];
        reverse_steps(x + b * PL_T * PL_I, rev ? len[b] : 0, PL_I, xr), reverse_steps(dy + b * PL_T * PL_H, rev ? len[b] : 0, PL_H, dyr);
        padded_run(ctx, m, gru, &ll, &gl, rev ? xr : x + b * PL_T * PL_I, 1, len[b], NULL, 0, rev ? dyr : dy + b * PL_T * PL_H, dh + b * PL_H,
                   y1, h1, c1, g1);
        if (rev) reverse_steps(y1, len[b], PL_H, yr), memcpy(y1, yr, (size_t)(len[b] * PL_H) * sizeof(float));
        bad += memcmp(y + b * PL_T * PL_H, y1, (size_t)(len[b] * PL_H) * sizeof(float)) != 0;
        for (k = len[b] * PL_H; k < PL_T * PL_H; k++) bad += y[b * PL_T * PL_H + k] != 0.0f;
        bad += memcmp(h + b * PL_H, h1, sizeof h1) != 0 || (!gru && memcmp(c + b * PL_H, c1, sizeof c1) != 0);
        for (k = 0; k < n; k++) gsum[k] += g1[k];
    }
    for (k = 0; k < n; k++) {
        double d = fabs((double)gw[k] - gsum[k]) / (fabs(gsum[k]) + 1e-3);
        if (d > worst) worst = d;
    }
    CHECK_MSG(bad == 0, "%s%s: %d rows differ from the rows run alone", gru ? "gru" : "lstm", rev ? " in reverse" : "", bad);
    CHECK_MSG(worst < 1e-4, "%s%s: the weights' gradients differ from the rows' sum by %g", gru ? "gru" : "lstm", rev ? " in reverse" : "",
              worst);
    {
        static const int32_t zero[PL_B] = {7, 0, 1, 5, 7}, over[PL_B] = {7, 3, 8, 5, 7};
        dtr_rnn_config cfg = dtr_rnn_config_init();
        int64_t xs[3] = {PL_B, PL_T, PL_I};
        dtr_tensor *X = dtr_tensor_from(ctx, DTR_F32, 3, xs, x);
        cfg.lengths = zero;
        CHECK((gru ? dtr_gru_layer_forward_ex(ctx, &gl, X, NULL, &cfg, NULL) : dtr_lstm_layer_forward_ex(ctx, &ll, X, NULL, NULL, &cfg, NULL, NULL)) == NULL);
        CHECK_MSG(dtr_context_status(ctx) == DTR_INVALID_ARGUMENT && strstr(dtr_context_last_error(ctx), "lengths[1] = 0 is not in 1..7"), "%s",
                  dtr_context_last_error(ctx));
        dtr_context_clear_error(ctx);
        cfg.lengths = over;
        CHECK((gru ? dtr_gru_layer_forward_ex(ctx, &gl, X, NULL, &cfg, NULL) : dtr_lstm_layer_forward_ex(ctx, &ll, X, NULL, NULL, &cfg, NULL, NULL)) == NULL);
        CHECK(strstr(dtr_context_last_error(ctx), "lengths[2] = 8 is not in 1..7") != NULL);
    }
    dtr_model_destroy(m);
    dtr_context_destroy(ctx);
}

static void test_rnn_lengths(void) {
    check_padded(0, 0);
    check_padded(1, 0);
    check_padded(0, 1);
    check_padded(1, 1);
}

/* ---- learning: the sum of the two values marked in a sequence of 12 noisy steps ---- */

enum { SEQ = 12, BATCH = 32, HID = 16 };

/* x (BATCH, SEQ, 2): (value, mark); the target is the sum of the two marked values */
static void adding_batch(dtr_rng *rng, float *x, float *y) {
    int b, t;
    for (b = 0; b < BATCH; b++) {
        int i = (int)(dtr_rng_u32(rng) % (SEQ / 2)), j = SEQ / 2 + (int)(dtr_rng_u32(rng) % (SEQ / 2));
        for (t = 0; t < SEQ; t++) {
            x[(b * SEQ + t) * 2] = dtr_rng_uniform(rng);
            x[(b * SEQ + t) * 2 + 1] = (t == i || t == j) ? 1.0f : 0.0f;
        }
        y[b] = x[(b * SEQ + i) * 2] + x[(b * SEQ + j) * 2];
    }
}

/* mean squared error of the last step's readout after `steps` Adam steps */
static double train_adding(int lstm, int steps) {
    dtr_context *ctx = test_ctx(1);
    dtr_model *m;
    dtr_lstm_layer ll;
    dtr_gru_layer gl;
    dtr_linear_layer out;
    dtr_optimizer *opt;
    dtr_optimizer_config oc = dtr_optimizer_config_init(DTR_OPT_ADAM, 0.01f);
    dtr_rng rng;
    float x[BATCH * SEQ * 2], y[BATCH], loss = 0;
    int64_t xs[3] = {BATCH, SEQ, 2}, ys[2] = {BATCH, 1};
    int s;
    dtr_model_create(ctx, 5, &m);
    if (lstm) dtr_lstm_layer_init(&ll, m, "rnn", 2, HID);
    else dtr_gru_layer_init(&gl, m, "rnn", 2, HID);
    dtr_linear_layer_init(&out, m, "out", HID, 1, 1, DTR_INIT_TORCH_DEFAULT);
    CHECK_OK(ctx, dtr_optimizer_create(m, &oc, &opt));
    dtr_rng_seed(&rng, 9, 0);
    for (s = 0; s < steps; s++) {
        dtr_tensor *h = NULL, *l;
        adding_batch(&rng, x, y);
        if (lstm) dtr_lstm_layer_forward(ctx, &ll, dtr_tensor_from(ctx, DTR_F32, 2 + 1, xs, x), NULL, NULL, &h, NULL);
        else dtr_gru_layer_forward(ctx, &gl, dtr_tensor_from(ctx, DTR_F32, 3, xs, x), NULL, &h);
        l = dtr_mse(ctx, dtr_linear_layer_forward(ctx, &out, h), dtr_tensor_from(ctx, DTR_F32, 2, ys, y));
        CHECK_OK(ctx, dtr_backward(ctx, l));
        if (s >= steps - 20) loss += dtr_tensor_get(l, 0) / 20.0f;
        dtr_optimizer_step(opt, NULL);
        dtr_context_reset(ctx);
    }
    dtr_optimizer_destroy(opt);
    dtr_model_destroy(m);
    dtr_context_destroy(ctx);
    return loss;
}

static void test_rnn_learns(void) {
    double l = train_adding(1, 600), g = train_adding(0, 600);
    /* predicting the mean (1.0) scores the variance of the sum, 1/6 = 0.167 */
    printf("    adding task, MSE over the last 20 of 600 steps: LSTM %.4f, GRU %.4f (the mean's 0.167)\n", l, g);
    CHECK(l < 0.02 && g < 0.02);
}

/* ---- group norm ---- */

/* PyTorch 1.13: F.group_norm(x, 3, w, b, 1e-5) of x (2, 6, 2, 3), x[k] = sin(0.37k) + k / 40,
   w[c] = 1 + 0.1c, b[c] = 0.05c - 0.1; (y R).sum().backward(), R[k] = cos(0.21k); y and x's
   gradient at k_gn_at. Instance norm: F.group_norm(x2, 6) of x2 (2, 6, 5), x2[k] = cos(0.53k)
   (1 + k / 30), at k_in_at. */
static const int k_gn_at[8] = {0, 5, 13, 30, 41, 50, 66, 71};
static const double k_gn_y[8] = {-0.972030479, 1.08643351, -1.64836062, -1.68773159, 0.456752219, -1.27392214, -0.624249484,
                                 3.01034473};
static const double k_gn_gx[8] = {1.94616636, -0.449997513, 0.184164892, 0.0874160711, -0.412407324, -0.229556294, -0.508730325,
                                  -0.0349718676};
static const double k_gn_gw[6] = {0.501228008, 7.7515989, 8.36941846, 1.13126546, -4.81788175, -3.75240619};
static const double k_gn_gb[6] = {3.57709505, -6.79824745, -7.73513309, 2.06717848, 8.99948935, 3.43721354};
static const int k_in_at[5] = {0, 7, 19, 33, 59};
static const double k_in_y[5] = {1.07584163, -0.616567786, -0.445251736, 0.711382684, 1.22446236};

static void pick(const float *all, const int *at, int n, float *out) {
    int i;
    for (i = 0; i < n; i++) out[i] = all[at[i]];
}

static void test_group_norm_torch(void) {
    dtr_context *ctx = test_ctx(1);
    dtr_model *m;
    dtr_groupnorm_layer gn;
    float xs[72], rs[72], ys[72], w[6], b[6], got[8], x2s[60];
    int64_t shape[4] = {2, 6, 2, 3}, s2[3] = {2, 6, 5};
    dtr_tensor *x, *y;
    int k;
    for (k = 0; k < 72; k++) xs[k] = (float)(sin(0.37 * k) + k / 40.0), rs[k] = (float)cos(0.21 * k);
    for (k = 0; k < 6; k++) w[k] = (float)(1 + 0.1 * k), b[k] = (float)(0.05 * k - 0.1);
    for (k = 0; k < 60; k++) x2s[k] = (float)(cos(0.53 * k) * (1 + k / 30.0));
    dtr_model_create(ctx, 1, &m);
    CHECK_OK(ctx, dtr_groupnorm_layer_init(&gn, m, "gn", 3, 6));
    CHECK_OK(ctx, dtr_model_build(m));
    dtr_tensor_write(gn.weight, DTR_F32, w, 6), dtr_tensor_write(gn.bias, DTR_F32, b, 6);
    x = dtr_tensor_requires_grad(dtr_tensor_from(ctx, DTR_F32, 4, shape, xs));
    y = dtr_groupnorm_layer_forward(ctx, &gn, x);
    CHECK_OK(ctx, dtr_backward(ctx, dtr_sum_all(ctx, dtr_mul(ctx, y, dtr_tensor_from(ctx, DTR_F32, 4, shape, rs)))));
    CHECK(dtr_tensor_ndim(y) == 4 && dtr_tensor_dim(y, 1) == 6 && dtr_tensor_dim(y, 3) == 3);
    dtr_tensor_read(y, DTR_F32, ys, 72);
    pick(ys, k_gn_at, 8, got), check_near("group norm", got, k_gn_y, 8);
    pick(dtr_tensor_grad(x), k_gn_at, 8, got), check_near("group norm: x's gradient", got, k_gn_gx, 8);
    check_near("group norm: weight's gradient", dtr_tensor_grad(gn.weight), k_gn_gw, 6);
    check_near("group norm: bias's gradient", dtr_tensor_grad(gn.bias), k_gn_gb, 6);
    y = dtr_group_norm(ctx, dtr_tensor_from(ctx, DTR_F32, 3, s2, x2s), 6, NULL, NULL, 1e-5f);   /* instance norm */
    dtr_tensor_read(y, DTR_F32, ys, 60);
    pick(ys, k_in_at, 5, got), check_near("instance norm", got, k_in_y, 5);
    dtr_model_destroy(m);
    dtr_context_destroy(ctx);
}

/* ---- batch norm ---- */

/* PyTorch 1.13, nn.BatchNorm2d(4), weight[c] = 1 + 0.2c, bias[c] = 0.1c - 0.15, x (3, 4, 2, 3),
   x[k] = sin(0.41k) (1 + k / 50): a training step ((y R).sum().backward(), R[k] = cos(0.17k)),
   a second forward of 1.5 x + 0.3, then eval() on x */
static const int k_bn_at[6] = {0, 7, 19, 33, 50, 71};
static const double k_bn_y[6] = {-0.434620651, 0.570943625, 1.72902667, 1.62220999, 1.24621376, -2.32853231};
static const double k_bn_gx[6] = {0.8243073, 0.0843682088, -0.757425759, -0.0616616657, -0.475064197, 0.368226966};
static const double k_bn_gw[4] = {-0.651217042, 11.4459816, 0.606518223, -7.06505203};
static const double k_bn_gb[4] = {0.215660912, -0.760485401, -1.01168524, -0.298477818};
static const double k_bn_rm[4] = {0.111022143, -0.0465098691, 0.0621851424, 0.0642467793};
static const double k_bn_rv[4] = {1.27922722, 1.29597431, 1.25074997, 1.33186902};
static const double k_bn_eval[6] = {-0.24815989, 0.321394015, 1.97024154, 1.43608369, 1.51452817, -2.42768054};

static void check_bn_statistics(const dtr_batchnorm_layer *bn) {
    float v[4];
    dtr_tensor_read(bn->running_mean, DTR_F32, v, 4), check_near("running mean", v, k_bn_rm, 4);
    dtr_tensor_read(bn->running_var, DTR_F32, v, 4), check_near("running var", v, k_bn_rv, 4);
}

static void test_batch_norm_torch(void) {
    dtr_context *ctx = test_ctx(1);
    dtr_model *m, *m2;
    dtr_batchnorm_layer bn, bn2;
    float xs[72], x2s[72], rs[72], ys[72], w[4], b[4], got[6];
    char path[512];
    int64_t shape[4] = {3, 4, 2, 3};
    dtr_tensor *x, *y;
    int k;
    for (k = 0; k < 72; k++) xs[k] = (float)(sin(0.41 * k) * (1 + k / 50.0)), rs[k] = (float)cos(0.17 * k);
    for (k = 0; k < 72; k++) x2s[k] = xs[k] * 1.5f + 0.3f;
    for (k = 0; k < 4; k++) w[k] = (float)(1 + 0.2 * k), b[k] = (float)(0.1 * k - 0.15);
    dtr_model_create(ctx, 1, &m);
    CHECK_OK(ctx, dtr_batchnorm_layer_init(&bn, m, "bn", 4));
    CHECK_OK(ctx, dtr_model_build(m));
    CHECK_EQ_INT(dtr_model_buffer_count(m), 2);
    CHECK(dtr_model_find(m, "bn.running_var") == bn.running_var && dtr_model_buffer_at(m, 0) == bn.running_mean);
    CHECK_EQ_INT(dtr_model_numel(m), 2 * 16);   /* the parameters alone (16-float aligned) */
    dtr_tensor_write(bn.weight, DTR_F32, w, 4), dtr_tensor_write(bn.bias, DTR_F32, b, 4);
    x = dtr_tensor_requires_grad(dtr_tensor_from(ctx, DTR_F32, 4, shape, xs));
    y = dtr_batchnorm_layer_forward(ctx, &bn, x);
    CHECK_OK(ctx, dtr_backward(ctx, dtr_sum_all(ctx, dtr_mul(ctx, y, dtr_tensor_from(ctx, DTR_F32, 4, shape, rs)))));
    dtr_tensor_read(y, DTR_F32, ys, 72);
    pick(ys, k_bn_at, 6, got), check_near("batch norm", got, k_bn_y, 6);
    pick(dtr_tensor_grad(x), k_bn_at, 6, got), check_near("batch norm: x's gradient", got, k_bn_gx, 6);
    check_near("batch norm: weight's gradient", dtr_tensor_grad(bn.weight), k_bn_gw, 4);
    check_near("batch norm: bias's gradient", dtr_tensor_grad(bn.bias), k_bn_gb, 4);
    CHECK(dtr_tensor_grad(bn.running_mean) == NULL);
    dtr_batchnorm_layer_forward(ctx, &bn, dtr_tensor_from(ctx, DTR_F32, 4, shape, x2s));
    check_bn_statistics(&bn);
    dtr_context_set_training(ctx, 0);
    dtr_tensor_read(dtr_batchnorm_layer_forward(ctx, &bn, dtr_tensor_from(ctx, DTR_F32, 4, shape, xs)), DTR_F32, ys, 72);
    pick(ys, k_bn_at, 6, got), check_near("batch norm, evaluation", got, k_bn_eval, 6);
    tmp_path("dtr_layers", "bn.safetensors", path, sizeof path);
    CHECK_OK(ctx, dtr_model_save(m, path, DTR_F32));   /* buffers saved and loaded by name */
    dtr_model_create(ctx, 2, &m2);
    dtr_batchnorm_layer_init(&bn2, m2, "bn", 4);
    CHECK_OK(ctx, dtr_model_load(m2, path));
    check_bn_statistics(&bn2);
    remove(path);
    dtr_model_destroy(m2);
    dtr_model_destroy(m);
    dtr_context_destroy(ctx);
}

/* a region for dtr_checkpoint: batch norm of its input */
static dtr_tensor *bn_region(void *user, dtr_context *ctx, dtr_tensor *const *in) {
    return dtr_batchnorm_layer_forward(ctx, (const dtr_batchnorm_layer *)user, in[0]);
}

/* buffers in the model's state and in dtr_model_keep; a checkpointed region moves the running
   statistics once a step (its recomputation in backward leaves them) */
static void test_buffers(void) {
    dtr_context *ctx = test_ctx(1);
    dtr_model *m, *part;
    dtr_batchnorm_layer a, b, pa, pb;
    dtr_state_entry e;
    const char *keep[1] = {"b."};
    float xs[24], once[64], twice[64], fresh[64];
    int64_t shape[3] = {4, 3, 2};
    dtr_tensor *x, *y;
    int k;
    for (k = 0; k < 24; k++) xs[k] = (float)sin(0.9 * k) + 0.2f * (float)k;
    dtr_model_create(ctx, 1, &m);
    dtr_batchnorm_layer_init(&a, m, "a", 3), dtr_batchnorm_layer_init(&b, m, "b", 5);
    CHECK_OK(ctx, dtr_model_state(m, 2, &e));
    CHECK(strcmp(e.name, "buffers") == 0 && e.bytes == 4 * 16 * sizeof(float));
    CHECK(dtr_model_state(m, 3, &e) == DTR_NOT_FOUND);
    CHECK(dtr_model_buffer(m, "a.running_mean", 1, shape, 0.0f) == NULL);   /* a name taken */
    CHECK(dtr_context_status(ctx) == DTR_BAD_STATE);   /* (the model is built by then) */
    dtr_context_clear_error(ctx);
    dtr_model_create(ctx, 1, &part);   /* a stage keeps its own buffers */
    dtr_batchnorm_layer_init(&pa, part, "a", 3), dtr_batchnorm_layer_init(&pb, part, "b", 5);
    CHECK_OK(ctx, dtr_model_keep(part, keep, 1));
    CHECK_OK(ctx, dtr_model_build(part));
    CHECK(dtr_model_buffer_count(part) == 2 && dtr_model_buffer_at(part, 0) == pb.running_mean);
    CHECK(dtr_model_buffer_numel(part) == 32 && dtr_model_find(part, "a.running_mean") == NULL);
    dtr_model_destroy(part);
    /* the same step plain and inside a checkpoint: the same running statistics */
    CHECK_OK(ctx, dtr_model_read_buffers(m, fresh, 64));
    x = dtr_tensor_requires_grad(dtr_tensor_from(ctx, DTR_F32, 3, shape, xs));
    CHECK_OK(ctx, dtr_backward(ctx, dtr_sum_all(ctx, dtr_batchnorm_layer_forward(ctx, &a, x))));
    CHECK_OK(ctx, dtr_model_read_buffers(m, once, 64));
    dtr_context_reset(ctx);
    {   /* a full-state checkpoint holds the buffers: written back by a restore */
        dtr_ckpt_config kc = dtr_ckpt_config_init();
        dtr_ckpt *ck = NULL;
        char dir[512];
        float back[64];
        CHECK(make_tmp_dir("dtr_layers_ckpt", dir, sizeof dir));
        kc.dir = dir, kc.ctx = ctx, kc.model = m, kc.sync = 1;
        CHECK(dtr_ckpt_create(&kc, &ck) == DTR_OK);
        CHECK_OK(ctx, dtr_ckpt_save(ck, 1, NULL));
        CHECK_OK(ctx, dtr_model_write_buffers(m, fresh, 64));
        CHECK_OK(ctx, dtr_ckpt_restore(ck, NULL, NULL));
        CHECK_OK(ctx, dtr_model_read_buffers(m, back, 64));
        CHECK(memcmp(back, once, sizeof once) == 0);
        dtr_ckpt_destroy(ck);
        rm_tree(dir);
    }
    CHECK_OK(ctx, dtr_model_write_buffers(m, fresh, 64));   /* as they were before the step */
    x = dtr_tensor_requires_grad(dtr_tensor_from(ctx, DTR_F32, 3, shape, xs));
    y = dtr_checkpoint(ctx, bn_region, &a, 1, &x);
    CHECK_OK(ctx, dtr_backward(ctx, dtr_sum_all(ctx, y)));
    CHECK_OK(ctx, dtr_model_read_buffers(m, twice, 64));
    CHECK_MSG(memcmp(once, twice, sizeof once) == 0 && once[0] != 0.0f, "running mean %g, %g in a checkpoint; var %g, %g", (double)once[0], (double)twice[0], (double)once[16], (double)twice[16]);
    dtr_context_reset(ctx);
    dtr_model_destroy(m);
    dtr_context_destroy(ctx);
}

/* dtr_batch_norm's argument errors */
static dtr_tensor *bn_bad(dtr_context *c, int i, dtr_tensor *x, dtr_tensor *v3, dtr_tensor *v4, dtr_tensor *one) {
    switch (i) {
    case 0: return dtr_batch_norm(c, x, v4, NULL, NULL, NULL, 1, 0.1f, 1e-5f);     /* weight (4) for 3 channels */
    case 1: return dtr_batch_norm(c, x, NULL, NULL, v3, NULL, 1, 0.1f, 1e-5f);     /* mean without var */
    case 2: return dtr_batch_norm(c, x, NULL, NULL, NULL, NULL, 0, 0.1f, 1e-5f);   /* evaluation without statistics */
    case 3: return dtr_batch_norm(c, x, NULL, NULL, NULL, NULL, 1, 1.5f, 1e-5f);   /* momentum */
    case 4: return dtr_batch_norm(c, x, NULL, NULL, NULL, NULL, 1, 0.1f, 0.0f);    /* eps */
    case 5: return dtr_batch_norm(c, one, NULL, NULL, NULL, NULL, 1, 0.1f, 1e-5f); /* one value a channel */
    default: return dtr_batch_norm(c, x, NULL, NULL, dtr_tensor_requires_grad(v3), v3, 1, 0.1f, 1e-5f);   /* a trained tensor */
    }
}

static void check_bn_errors(dtr_context *ctx) {
    static const dtr_result want[7] = {DTR_SHAPE_MISMATCH, DTR_INVALID_ARGUMENT, DTR_INVALID_ARGUMENT, DTR_INVALID_ARGUMENT,
                                       DTR_INVALID_ARGUMENT, DTR_SHAPE_MISMATCH, DTR_INVALID_ARGUMENT};
    int64_t xs[3] = {2, 3, 4}, s3 = 3, s4 = 4, s1[2] = {1, 3};
    int i;
    for (i = 0; i < 7; i++) {
        dtr_tensor *x = dtr_tensor_zeros(ctx, DTR_F32, 3, xs), *v3 = dtr_tensor_zeros(ctx, DTR_F32, 1, &s3);
        dtr_tensor *t = bn_bad(ctx, i, x, v3, dtr_tensor_zeros(ctx, DTR_F32, 1, &s4), dtr_tensor_zeros(ctx, DTR_F32, 2, s1));
        CHECK_MSG(t == NULL && dtr_context_status(ctx) == want[i], "batch norm case %d: %s (%s)", i,
                  dtr_result_string(dtr_context_status(ctx)), dtr_context_last_error(ctx));
        dtr_context_clear_error(ctx);
        dtr_context_reset(ctx);
    }
}

/* ---- convolution ---- */

/* PyTorch 1.13 in double: nn.Conv2d(4, 6, (2, 3), stride (2, 1), padding (1, 2), dilation (2, 1),
   groups 2) on x (2, 4, 7, 6), x[k] = sin(0.31k) (1 + k / 60), weight[k] = 0.3 cos(0.23k),
   bias[o] = 0.1o - 0.2, (y R).sum().backward() with R[k] = cos(0.17k); y (2, 6, 4, 8). Then
   nn.Conv1d(4, 4, 3, padding 2, dilation 2, groups 4) on x (2, 4, 9), x[k] = cos(0.27k) + k / 50,
   weight[k] = 0.5 - 0.07k, bias[o] = 0.05o, R[k] = sin(0.19k). x's row 0 is never read by the
   2-D one (stride 2, dilation 2, padding 1 read the odd rows): its gradient is 0. */
static const int k_c2_at_y[7] = {0, 9, 27, 50, 77, 120, 191};
static const int k_c2_at_x[7] = {0, 6, 62, 119, 177, 286, 313};
static const double k_c2_y[7] = {-0.396440638, 0.122699308, -0.680044181, 0.0783538857, 0.223965, 1.35843059, 0.417954784};
static const double k_c2_gx[7] = {0, 0.0762433218, 0.617330137, 0.417043131, 0.105258237, 0.460146254, -0.127419281};
static const double k_c2_gw[11] = {2.18800101, 9.40035696, -2.16736286, -5.93233614, -1.94025616, -9.22892962, -15.9204859,
                                   -15.9063477, -19.0868321, 11.3485932, 16.930613};
static const double k_c2_gb[6] = {-7.84646102, -5.83872938, 0.0799288625, 5.94504875, 7.82802668, 4.46759705};
static const int k_c1_at[7] = {0, 5, 17, 30, 44, 61, 71};
static const double k_c1_y[7] = {0.753175125, 0.449350291, 0.00659090478, -0.0135234589, 1.29985509, 0.12132961, -0.630098381};
static const double k_c1_gx[7] = {0.185460235, 1.02961039, 0.0236974117, 0.358043672, 0.733258239, 0.0503412228, -0.299215326};
static const double k_c1_gw[12] = {5.62383611, 6.69624645, 5.84746407, -2.55976697, -0.482534473, 1.21600856, -9.26948327,
                                   -11.5843915, -8.79944101, 3.48221196, 1.88921062, -0.421447559};
static const double k_c1_gb[4] = {13.1798591, 5.86078444, -14.80628, -1.75190746};

/* nn.ConvTranspose2d(4, 6, (3, 2), stride 2, padding (1, 0), output_padding (1, 1), groups 2,
   dilation (1, 2)) on x (2, 4, 3, 4), x[k] = sin(0.43k) + 0.01k, weight[k] = 0.25 cos(0.37k),
   bias[o] = 0.2 - 0.05o, R[k] = cos(0.13k); y (2, 6, 6, 10) (positions no input reaches hold the
   bias) */
static const int k_ct_at[8] = {0, 7, 33, 58, 101, 150, 222, 287};
static const int k_ct_at_x[6] = {0, 9, 23, 47, 61, 95};
static const double k_ct_y[8] = {0.114320608, 0.2, 0.2, 0.294646058, 0.15, 0.559672335, -0.162398557, 0};
static const double k_ct_gx[6] = {0.273056071, -1.14853018, -0.971778174, -0.0702572904, 0.267796071, -0.476624354};
static const double k_ct_gw[9] = {0.903820449, -4.43931923, 6.88560176, 0.324651738, 7.55030187, -1.61948426, 6.85751314,
                                  -1.95300154, 4.02117023};
static const double k_ct_gb[6] = {-1.73046409, -3.03263104, 1.40321033, 3.18405265, -1.05961653, -3.29839676};

/* The input's gradient (and, after it in gx_out, the output) of a convolution large enough that it is made a band of output rows
 * at a time (32 channels, 3x3, 48x48: three bands; stride 2 and 4 x 4 for the strided loops),
 * against direct loops in double: dx[c, ih, iw] = sum over o, ki, kj of w[o, c, ki, kj] dy[o, oh, ow]
 * where oh s - p + ki = ih; every element within 1e-5, and the same bits on 1 and 2 threads. */
static void conv_bands_once(int stride, int k, int threads, float *gx_out) {
    enum { N = 2, C = 32, O = 16, H = 48, W = 48 };
    static float xv[N * C * H * W], wv[O * C * 16], gy[N * O * H * W];
    dtr_context *ctx = test_ctx(threads);
    dtr_conv_config cf = dtr_conv_config_init();
    int64_t xs[4] = {N, C, H, W}, ws[4] = {O, C, k, k}, i, ny, Ho;
    dtr_tensor *x, *w, *y;
    cf.stride[0] = cf.stride[1] = stride, cf.padding[0] = cf.padding[1] = 1;
    for (i = 0; i < N * C * H * W; i++) xv[i] = (float)sin(0.37 * (double)i);
    for (i = 0; i < O * C * k * k; i++) wv[i] = (float)(0.1 * cos(0.53 * (double)i));
    x = dtr_tensor_requires_grad(dtr_tensor_from(ctx, DTR_F32, 4, xs, xv));
    w = dtr_tensor_from(ctx, DTR_F32, 4, ws, wv);
    y = dtr_conv2d_ex(ctx, x, w, NULL, &cf);
    CHECK(y != NULL);
    if (!y) { dtr_context_destroy(ctx); return; }
    ny = dtr_tensor_numel(y), Ho = dtr_tensor_dim(y, 2);
    for (i = 0; i < ny; i++) gy[i] = (float)cos(0.11 * (double)i);
    CHECK_OK(ctx, dtr_backward_from(ctx, y, gy));
    CHECK_OK(ctx, dtr_tensor_read_grad(x, gx_out, N * C * H * W));
    CHECK_OK(ctx, dtr_tensor_read(y, DTR_F32, gx_out + N * C * H * W, (size_t)ny));   /* the forward's too (after it) */
    if (threads == 1) {   /* the reference, once */
        double worst = 0.0;
        int64_t n, c, ih, iw, o, ki, kj;
        for (n = 0; n < N; n++)
            for (c = 0; c < C; c++)
                for (ih = 0; ih < H; ih++)
                    for (iw = 0; iw < W; iw++) {
                        double s = 0.0;
                        for (o = 0; o < O; o++)
                            for (ki = 0; ki < k; ki++)
                                for (kj = 0; kj < k; kj++) {
                                    int64_t a = ih + 1 - ki, b = iw + 1 - kj;
                                    if (a < 0 || b < 0 || a % stride || b % stride || a / stride >= Ho || b / stride >= Ho) continue;
                                    s += (double)wv[((o * C + c) * k + ki) * k + kj] * gy[((n * O + o) * Ho + a / stride) * Ho + b / stride];
                                }
                        worst = fmax(worst, fabs(s - gx_out[((n * C + c) * H + ih) * W + iw]) / (1.0 + fabs(s)));
                    }
        CHECK_MSG(worst <= 1e-5, "conv bands (stride %d, %dx%d): input gradient off by %g", stride, k, k, worst);
    }
    dtr_context_destroy(ctx);
}

static void test_conv_bands(void) {
    static float a[2 * 32 * 48 * 48 + 2 * 16 * 48 * 48], b[2 * 32 * 48 * 48 + 2 * 16 * 48 * 48];
    int s, t;
    for (s = 1; s <= 2; s++) {
        conv_bands_once(s, s == 1 ? 3 : 4, 1, a);
        for (t = 2; t <= 5; t += 3) {   /* 5 threads for 2 samples: each split in slabs of pixels and channels */
            conv_bands_once(s, s == 1 ? 3 : 4, t, b);
            CHECK_MSG(memcmp(a, b, sizeof a) == 0, "conv bands (stride %d): 1 and %d threads differ", s, t);
        }
    }
}

/* y = the layer's forward of x (n values from xs), then backward of sum(y R) */
static dtr_tensor *conv_step(dtr_context *ctx, const void *layer, int one_d, int nd, const int64_t *shape, const float *xs,
                             dtr_tensor **x, int sine) {
    float rs[720];
    dtr_tensor *y;
    *x = dtr_tensor_requires_grad(dtr_tensor_from(ctx, DTR_F32, nd, shape, xs));
    y = one_d ? dtr_conv1d_layer_forward(ctx, (const dtr_conv1d_layer *)layer, *x)
              : dtr_conv2d_layer_forward(ctx, (const dtr_conv2d_layer *)layer, *x);
    CHECK(y != NULL && dtr_tensor_numel(y) <= 720);
    if (!y) return NULL;
    fill(rs, (int)dtr_tensor_numel(y), 1.0, sine == 1 ? 0.19 : sine == 2 ? 0.13 : 0.17, 0.0, sine != 1);
    {
        int64_t n = dtr_tensor_numel(y);
        CHECK_OK(ctx, dtr_backward(ctx, dtr_sum_all(ctx, dtr_mul(ctx, dtr_reshape(ctx, y, 1, &n), dtr_tensor_from(ctx, DTR_F32, 1, &n, rs)))));
    }
    return y;
}

static void check_conv2d_torch(int threads) {
    dtr_context *ctx = test_ctx(threads);
    dtr_model *m;
    dtr_conv2d_layer cv;
    dtr_conv_config c = dtr_conv_config_init();
    float xs[336], w[72], b[6], ys[384], got[11];
    int64_t shape[4] = {2, 4, 7, 6};
    dtr_tensor *x, *y;
    int k;
    for (k = 0; k < 336; k++) xs[k] = (float)(sin(0.31 * k) * (1 + k / 60.0));
    for (k = 0; k < 72; k++) w[k] = (float)(0.3 * cos(0.23 * k));
    for (k = 0; k < 6; k++) b[k] = (float)(0.1 * k - 0.2);
    c.stride[0] = 2; c.padding[0] = 1; c.padding[1] = 2; c.dilation[0] = 2; c.groups = 2;
    dtr_model_create(ctx, 1, &m);
    CHECK_OK(ctx, dtr_conv2d_layer_init_ex(&cv, m, "conv", 4, 6, 2, 3, &c, 1, DTR_INIT_TORCH_DEFAULT));
    CHECK_OK(ctx, dtr_model_build(m));
    CHECK(dtr_tensor_dim(cv.weight, 1) == 2 && dtr_tensor_dim(cv.weight, 2) == 2 && dtr_tensor_dim(cv.weight, 3) == 3);
    dtr_tensor_write(cv.weight, DTR_F32, w, 72), dtr_tensor_write(cv.bias, DTR_F32, b, 6);
    y = conv_step(ctx, &cv, 0, 4, shape, xs, &x, 0);
    CHECK(y && dtr_tensor_dim(y, 1) == 6 && dtr_tensor_dim(y, 2) == 4 && dtr_tensor_dim(y, 3) == 8);
    if (y) {
        dtr_tensor_read(y, DTR_F32, ys, 384);
        pick(ys, k_c2_at_y, 7, got), check_near("conv2d", got, k_c2_y, 7);
        pick(dtr_tensor_grad(x), k_c2_at_x, 7, got), check_near("conv2d: x's gradient", got, k_c2_gx, 7);
        for (k = 0; k < 11; k++) got[k] = dtr_tensor_grad(cv.weight)[7 * k];
        check_near("conv2d: weight's gradient", got, k_c2_gw, 11);
        check_near("conv2d: bias's gradient", dtr_tensor_grad(cv.bias), k_c2_gb, 6);
    }
    dtr_model_destroy(m);
    dtr_context_destroy(ctx);
}

static void check_conv1d_torch(int threads) {
    dtr_context *ctx = test_ctx(threads);
    dtr_model *m;
    dtr_conv1d_layer cv;
    float xs[72], w[12], b[4], ys[72], got[7];
    int64_t shape[3] = {2, 4, 9};
    dtr_tensor *x, *y;
    int k;
    for (k = 0; k < 72; k++) xs[k] = (float)(cos(0.27 * k) + k / 50.0);
    for (k = 0; k < 12; k++) w[k] = (float)(0.5 - 0.07 * k);
    for (k = 0; k < 4; k++) b[k] = (float)(0.05 * k);
    dtr_model_create(ctx, 1, &m);
    CHECK_OK(ctx, dtr_conv1d_layer_init(&cv, m, "tcn", 4, 4, 3, 1, 2, 2, 4, 1, DTR_INIT_TORCH_DEFAULT));
    CHECK_OK(ctx, dtr_model_build(m));
    dtr_tensor_write(cv.weight, DTR_F32, w, 12), dtr_tensor_write(cv.bias, DTR_F32, b, 4);
    y = conv_step(ctx, &cv, 1, 3, shape, xs, &x, 1);
    CHECK(y && dtr_tensor_ndim(y) == 3 && dtr_tensor_dim(y, 1) == 4 && dtr_tensor_dim(y, 2) == 9);
    if (y) {
        dtr_tensor_read(y, DTR_F32, ys, 72);
        pick(ys, k_c1_at, 7, got), check_near("conv1d", got, k_c1_y, 7);
        pick(dtr_tensor_grad(x), k_c1_at, 7, got), check_near("conv1d: x's gradient", got, k_c1_gx, 7);
        check_near("conv1d: weight's gradient", dtr_tensor_grad(cv.weight), k_c1_gw, 12);
        check_near("conv1d: bias's gradient", dtr_tensor_grad(cv.bias), k_c1_gb, 4);
    }
    dtr_model_destroy(m);
    dtr_context_destroy(ctx);
}

static void check_conv_transpose_torch(int threads) {
    dtr_context *ctx = test_ctx(threads);
    dtr_model *m;
    dtr_conv2d_layer cv;
    dtr_conv_config c = dtr_conv_config_init();
    float xs[96], w[72], b[6], ys[720], got[9];
    int64_t shape[4] = {2, 4, 3, 4};
    dtr_tensor *x, *y;
    int k;
    for (k = 0; k < 96; k++) xs[k] = (float)(sin(0.43 * k) + 0.01 * k);
    for (k = 0; k < 72; k++) w[k] = (float)(0.25 * cos(0.37 * k));
    for (k = 0; k < 6; k++) b[k] = (float)(0.2 - 0.05 * k);
    c.stride[0] = c.stride[1] = 2; c.padding[0] = 1; c.output_padding[0] = c.output_padding[1] = 1;
    c.dilation[1] = 2; c.groups = 2;
    dtr_model_create(ctx, 1, &m);
    CHECK_OK(ctx, dtr_conv_transpose2d_layer_init(&cv, m, "up", 4, 6, 3, 2, &c, 1, DTR_INIT_TORCH_DEFAULT));
    CHECK_OK(ctx, dtr_model_build(m));
    CHECK(dtr_tensor_dim(cv.weight, 0) == 4 && dtr_tensor_dim(cv.weight, 1) == 3 && dtr_tensor_dim(cv.bias, 0) == 6);
    dtr_tensor_write(cv.weight, DTR_F32, w, 72), dtr_tensor_write(cv.bias, DTR_F32, b, 6);
    y = conv_step(ctx, &cv, 0, 4, shape, xs, &x, 2);
    CHECK(y && dtr_tensor_dim(y, 1) == 6 && dtr_tensor_dim(y, 2) == 6 && dtr_tensor_dim(y, 3) == 10);
    if (y) {
        dtr_tensor_read(y, DTR_F32, ys, 720);
        pick(ys, k_ct_at, 8, got), check_near("conv_transpose2d", got, k_ct_y, 8);
        pick(dtr_tensor_grad(x), k_ct_at_x, 6, got), check_near("conv_transpose2d: x's gradient", got, k_ct_gx, 6);
        for (k = 0; k < 9; k++) got[k] = dtr_tensor_grad(cv.weight)[8 * k];
        check_near("conv_transpose2d: weight's gradient", got, k_ct_gw, 9);
        check_near("conv_transpose2d: bias's gradient", dtr_tensor_grad(cv.bias), k_ct_gb, 6);
    }
    dtr_model_destroy(m);
    dtr_context_destroy(ctx);
}

/* PyTorch 1.13 in double: F.max_pool1d(x, 3, 2, 1) and F.avg_pool1d(x, 4, 3, 2) of x (2, 3, 10),
   x[k] = sin(0.9k) (1 + k / 20); backward of sum(y1 R1) + sum(y2 R2), R1[k] = cos(0.3k),
   R2[k] = cos(0.5k); y1 (2, 3, 5), y2 (2, 3, 4) */
static const int k_p1_at1[6] = {0, 4, 9, 13, 21, 29}, k_p1_at2[5] = {0, 5, 11, 17, 23}, k_p1_atx[8] = {0, 1, 9, 17, 26, 37, 45, 59};
static const double k_p1_max[6] = {0.822493255, 1.40634023, 0.73397006, -1.09614265, 2.65214416, 3.64485989};
static const double k_p1_avg[5] = {0.205623314, -0.869698084, 0.109996388, 0.951389875, 2.03708879};
static const double k_p1_gx[8] = {0.25, 1.46939564, 0.380042055, -1.38568444, 0.0709155464, 1.74454005, 0.587942535, 0.12082619};

static void check_pool1d_torch(void) {
    dtr_context *ctx = test_ctx(2);
    float xs[60], r1[30], r2[24], y1[30], y2[24], got[8];
    int64_t shape[3] = {2, 3, 10}, n1 = 30, n2 = 24;
    dtr_tensor *x, *a, *b;
    int k;
    for (k = 0; k < 60; k++) xs[k] = (float)(sin(0.9 * k) * (1 + k / 20.0));
    fill(r1, 30, 1.0, 0.3, 0.0, 1), fill(r2, 24, 1.0, 0.5, 0.0, 1);
    x = dtr_tensor_requires_grad(dtr_tensor_from(ctx, DTR_F32, 3, shape, xs));
    a = dtr_maxpool1d(ctx, x, 3, 2, 1);
    b = dtr_avgpool1d(ctx, x, 4, 3, 2);
    CHECK(a && b && dtr_tensor_ndim(a) == 3 && dtr_tensor_dim(a, 2) == 5 && dtr_tensor_dim(b, 2) == 4);
    if (!a || !b) { dtr_context_destroy(ctx); return; }
    dtr_tensor_read(a, DTR_F32, y1, 30), dtr_tensor_read(b, DTR_F32, y2, 24);
    a = dtr_sum_all(ctx, dtr_mul(ctx, dtr_reshape(ctx, a, 1, &n1), dtr_tensor_from(ctx, DTR_F32, 1, &n1, r1)));
    b = dtr_sum_all(ctx, dtr_mul(ctx, dtr_reshape(ctx, b, 1, &n2), dtr_tensor_from(ctx, DTR_F32, 1, &n2, r2)));
    CHECK_OK(ctx, dtr_backward(ctx, dtr_add(ctx, a, b)));

    pick(y1, k_p1_at1, 6, got), check_near("maxpool1d", got, k_p1_max, 6);
    pick(y2, k_p1_at2, 5, got), check_near("avgpool1d", got, k_p1_avg, 5);
    pick(dtr_tensor_grad(x), k_p1_atx, 8, got), check_near("pool1d: x's gradient", got, k_p1_gx, 8);
    dtr_context_destroy(ctx);
}

static void test_conv_torch(void) {
    int t;
    for (t = 1; t <= 2; t++) check_conv2d_torch(t), check_conv1d_torch(t), check_conv_transpose_torch(t);
    check_pool1d_torch();
}

/* ---- moving a model toward another ---- */

typedef struct lerp_net { dtr_model *m; dtr_linear_layer l; dtr_batchnorm_layer bn; } lerp_net;

static void lerp_make(dtr_context *ctx, lerp_net *n, uint64_t seed, int out) {
    CHECK_OK(ctx, dtr_model_create(ctx, seed, &n->m));
    CHECK_OK(ctx, dtr_linear_layer_init(&n->l, n->m, "l", 5, out, 1, DTR_INIT_TORCH_DEFAULT));
    CHECK_OK(ctx, dtr_batchnorm_layer_init(&n->bn, n->m, "bn", out));
    CHECK_OK(ctx, dtr_model_build(n->m));
}

static void test_model_lerp(void) {
    dtr_context *ctx = test_ctx(1), *other = test_ctx(1);
    lerp_net t, s, wide, elsewhere;
    float tv[24], sv[24], got[24], bt[6], bs[6], bv[6];
    float mean[3] = {1.0f, 2.0f, 3.0f};
    int k;
    lerp_make(ctx, &t, 1, 3), lerp_make(ctx, &s, 2, 3), lerp_make(ctx, &wide, 1, 4), lerp_make(other, &elsewhere, 2, 3);
    CHECK(dtr_model_numel(t.m) == 64 && dtr_model_buffer_numel(t.m) == 32);   /* 16-float slots */
    dtr_tensor_write(s.bn.running_mean, DTR_F32, mean, 3);
    dtr_tensor_read(t.l.weight, DTR_F32, tv, 15), dtr_tensor_read(s.l.weight, DTR_F32, sv, 15);
    dtr_tensor_read(t.bn.running_mean, DTR_F32, bt, 3), dtr_tensor_read(s.bn.running_mean, DTR_F32, bs, 3);
    CHECK_OK(ctx, dtr_model_lerp(t.m, s.m, 0.25f));
    dtr_tensor_read(t.l.weight, DTR_F32, got, 15), dtr_tensor_read(t.bn.running_mean, DTR_F32, bv, 3);
    for (k = 0; k < 15; k++) {   /* PyTorch's mul_(0.75), add_(s, alpha=0.25): two products, one sum */
        float a = tv[k] * 0.75f, b = sv[k] * 0.25f;
        CHECK_MSG(got[k] == a + b, "weight %d: %.9g, want %.9g", k, (double)got[k], (double)(a + b));
    }
    for (k = 0; k < 3; k++) CHECK(bv[k] == bt[k] * 0.75f + bs[k] * 0.25f);   /* buffers too */
    CHECK_OK(ctx, dtr_model_lerp(t.m, s.m, 0.0f));   /* nothing moves */
    dtr_tensor_read(t.l.weight, DTR_F32, tv, 15);
    CHECK(memcmp(tv, got, 15 * sizeof(float)) == 0);
    CHECK_OK(ctx, dtr_model_lerp(t.m, s.m, 1.0f));   /* a copy */
    dtr_tensor_read(t.l.weight, DTR_F32, tv, 15), dtr_tensor_read(t.bn.running_mean, DTR_F32, bv, 3);
    CHECK(memcmp(tv, sv, 15 * sizeof(float)) == 0 && bv[2] == 3.0f);
    CHECK(dtr_model_lerp(t.m, s.m, 1.5f) == DTR_INVALID_ARGUMENT);
    CHECK(dtr_model_lerp(t.m, s.m, NAN) == DTR_INVALID_ARGUMENT);
    dtr_context_clear_error(ctx);
    CHECK(dtr_model_lerp(t.m, wide.m, 0.5f) == DTR_SHAPE_MISMATCH);
    CHECK(strstr(dtr_context_last_error(ctx), "'l.weight'") != NULL);
    dtr_context_clear_error(ctx);
    CHECK_OK(ctx, dtr_model_lerp(t.m, elsewhere.m, 0.5f));   /* from another context: s's weights (seed 2), zero means */
    dtr_tensor_read(t.l.weight, DTR_F32, tv, 15), dtr_tensor_read(t.bn.running_mean, DTR_F32, bv, 3);
    CHECK(memcmp(tv, sv, 15 * sizeof(float)) == 0 && bv[0] == 0.5f && bv[2] == 1.5f);
    CHECK(dtr_model_lerp(NULL, s.m, 0.5f) == DTR_NULL_HANDLE);
    dtr_model_destroy(t.m), dtr_model_destroy(s.m), dtr_model_destroy(wide.m), dtr_model_destroy(elsewhere.m);
    dtr_context_destroy(ctx);
    dtr_context_destroy(other);
}

/* each call fails with `code` and gives no tensor */
static void expect_fail(dtr_context *ctx, dtr_tensor *y, dtr_result code, const char *what) {
    CHECK_MSG(y == NULL && dtr_context_status(ctx) == code, "%s: got %s", what, dtr_result_string(dtr_context_status(ctx)));
    dtr_context_clear_error(ctx);
}

static void check_conv_errors(dtr_context *ctx, dtr_model *m) {
    int64_t xs[4] = {1, 4, 5, 5}, ws[4] = {6, 2, 3, 3}, x1[3] = {1, 4, 5}, w1[3] = {4, 1, 3}, wt[4] = {4, 1, 3, 3};
    dtr_tensor *x = dtr_tensor_zeros(ctx, DTR_F32, 4, xs), *w = dtr_tensor_zeros(ctx, DTR_F32, 4, ws);
    dtr_conv_config c = dtr_conv_config_init();
    dtr_conv1d_layer l1;
    expect_fail(ctx, dtr_conv2d_ex(ctx, x, w, NULL, &c), DTR_SHAPE_MISMATCH, "groups 1 with w (6, 2, 3, 3)");
    c.groups = 3;
    expect_fail(ctx, dtr_conv2d_ex(ctx, x, w, NULL, &c), DTR_SHAPE_MISMATCH, "groups 3 of 4 channels");
    c.groups = 2, c.dilation[1] = 0;
    expect_fail(ctx, dtr_conv2d_ex(ctx, x, w, NULL, &c), DTR_INVALID_ARGUMENT, "dilation 0");
    c.dilation[1] = 3;   /* 3 taps 3 apart span 7 > 5 */
    expect_fail(ctx, dtr_conv2d_ex(ctx, x, w, NULL, &c), DTR_SHAPE_MISMATCH, "a dilated kernel past the input");
    c.padding[1] = 1;   /* now 7 <= 5 + 2: (1, 6, 3, 1) */
    CHECK(dtr_conv2d_ex(ctx, x, w, NULL, &c) != NULL && dtr_tensor_dim(dtr_conv2d_ex(ctx, x, w, NULL, &c), 3) == 1);
    expect_fail(ctx, dtr_conv1d(ctx, x, w, NULL, 1, 0, 1, 2), DTR_SHAPE_MISMATCH, "conv1d of a 4-D x");
    expect_fail(ctx, dtr_conv1d(ctx, dtr_tensor_zeros(ctx, DTR_F32, 3, x1), dtr_tensor_zeros(ctx, DTR_F32, 3, w1), NULL, 0, 0, 1, 4),
                DTR_INVALID_ARGUMENT, "conv1d stride 0");
    c = dtr_conv_config_init(), c.output_padding[0] = 1;
    expect_fail(ctx, dtr_conv2d_ex(ctx, x, dtr_tensor_zeros(ctx, DTR_F32, 4, xs), NULL, &c), DTR_INVALID_ARGUMENT,
                "a convolution's output padding");
    expect_fail(ctx, dtr_conv_transpose2d(ctx, x, w, NULL, &c), DTR_INVALID_ARGUMENT, "output padding 1 at stride 1");
    c.output_padding[0] = 0;
    expect_fail(ctx, dtr_conv_transpose2d(ctx, x, w, NULL, &c), DTR_SHAPE_MISMATCH, "w (6, ...) for 4 input channels");
    c.padding[0] = 4;   /* (5 - 1) + 3 - 8 < 1 */
    expect_fail(ctx, dtr_conv_transpose2d(ctx, x, dtr_tensor_zeros(ctx, DTR_F32, 4, wt), NULL, &c), DTR_SHAPE_MISMATCH,
                "a transposed convolution padded to nothing");
    c.padding[0] = 1;   /* the same w fits */
    CHECK(dtr_conv_transpose2d(ctx, x, dtr_tensor_zeros(ctx, DTR_F32, 4, wt), NULL, &c) != NULL);
    CHECK(dtr_conv1d_layer_init(&l1, m, "c1", 4, 6, 3, 1, 0, 1, 4, 1, DTR_INIT_TORCH_DEFAULT) == DTR_INVALID_ARGUMENT);
    dtr_context_clear_error(ctx);
    CHECK(dtr_conv1d_layer_init(&l1, m, "c1", 4, 4, 3, 1, 0, 0, 4, 1, DTR_INIT_TORCH_DEFAULT) == DTR_INVALID_ARGUMENT);
    dtr_context_clear_error(ctx);
}

/* ---- LoRA ---- */

enum { LR_B = 4, LR_IN = 6, LR_OUT = 5, LR_R = 2 };

typedef struct lora_net { dtr_model *m; dtr_linear_layer fc; } lora_net;

static void lora_make(dtr_context *ctx, lora_net *n, int adapter) {
    memset(n, 0, sizeof *n);
    CHECK_OK(ctx, dtr_model_create(ctx, 5, &n->m));
    CHECK_OK(ctx, dtr_linear_layer_init(&n->fc, n->m, "fc", LR_IN, LR_OUT, 1, DTR_INIT_TORCH_DEFAULT));
    if (adapter) CHECK_OK(ctx, dtr_linear_layer_add_lora(&n->fc, n->m, LR_R, 4.0f));
    CHECK_OK(ctx, dtr_model_build(n->m));
}

/* the layer's output for x (LR_B, LR_IN) into y */
static void lora_out(dtr_context *ctx, const lora_net *n, const float *x, float *y) {
    int64_t xs[2] = {LR_B, LR_IN};
    dtr_tensor *t = dtr_linear_layer_forward(ctx, &n->fc, dtr_tensor_from(ctx, DTR_F32, 2, xs, (void *)x));
    CHECK(t && dtr_tensor_read(t, DTR_F32, y, LR_B * LR_OUT) == DTR_OK);
    dtr_context_reset(ctx);
}

/* x W^T + b + s (x A^T) B^T in double, from the layer's tensors */
static double lora_gap(const lora_net *n, const float *x, const float *y) {
    float w[LR_OUT * LR_IN], b[LR_OUT], a[LR_R * LR_IN], bb[LR_OUT * LR_R];
    double worst = 0.0;
    int i, o, k, j;
    dtr_tensor_read(n->fc.weight, DTR_F32, w, LR_OUT * LR_IN), dtr_tensor_read(n->fc.bias, DTR_F32, b, LR_OUT);
    dtr_tensor_read(n->fc.lora_a, DTR_F32, a, LR_R * LR_IN), dtr_tensor_read(n->fc.lora_b, DTR_F32, bb, LR_OUT * LR_R);
    for (i = 0; i < LR_B; i++)
        for (o = 0; o < LR_OUT; o++) {
            double base = b[o], low = 0.0;
            for (j = 0; j < LR_IN; j++) base += (double)x[i * LR_IN + j] * w[o * LR_IN + j];
            for (k = 0; k < LR_R; k++) {
                double xa = 0.0;
                for (j = 0; j < LR_IN; j++) xa += (double)x[i * LR_IN + j] * a[k * LR_IN + j];
                low += xa * bb[o * LR_R + k];
            }
            worst = fmax(worst, fabs(y[i * LR_OUT + o] - (base + 2.0 * low)));   /* s = alpha / rank = 2 */
        }
    return worst;
}

/* a few AdamW steps of the adapter alone toward a target: the base's bits stay, the loss falls */
static void lora_train(dtr_context *ctx, lora_net *n, const float *x, const float *w0) {
    dtr_optimizer_config oc = dtr_optimizer_config_init(DTR_OPT_ADAMW, 0.05f);
    dtr_optimizer *o = NULL;
    const char *ad[1] = {"*lora_"};
    float target[LR_B * LR_OUT], w[LR_OUT * LR_IN], first = 0.0f, last = 0.0f;
    int64_t xs[2] = {LR_B, LR_IN}, ys[2] = {LR_B, LR_OUT};
    int t, i;
    for (i = 0; i < LR_B * LR_OUT; i++) target[i] = (float)sin(0.7 * i);
    CHECK_OK(ctx, dtr_model_set_trainable(n->m, NULL, 0, 0));
    CHECK_OK(ctx, dtr_model_set_trainable(n->m, ad, 1, 1));
    CHECK(!dtr_model_param_trainable(n->m, 0) && !dtr_model_param_trainable(n->m, 1));
    CHECK(dtr_model_param_trainable(n->m, 2) && dtr_model_param_trainable(n->m, 3));
    CHECK_OK(ctx, dtr_optimizer_create(n->m, &oc, &o));
    CHECK_EQ_INT(test_moment_bytes(o), 2 * (16 + 16) * sizeof(float));   /* A and B, each padded to 16 floats */
    for (t = 0; t < 60; t++) {
        dtr_tensor *y = dtr_linear_layer_forward(ctx, &n->fc, dtr_tensor_from(ctx, DTR_F32, 2, xs, (void *)x));
        dtr_tensor *l = dtr_mse(ctx, y, dtr_tensor_from(ctx, DTR_F32, 2, ys, target));
        CHECK_OK(ctx, dtr_backward(ctx, l));
        if (t == 0) first = dtr_tensor_get(l, 0);
        last = dtr_tensor_get(l, 0);
        CHECK_OK(ctx, dtr_optimizer_step(o, NULL));
        dtr_context_reset(ctx);
    }
    dtr_tensor_read(n->fc.weight, DTR_F32, w, LR_OUT * LR_IN);
    CHECK(memcmp(w, w0, sizeof w) == 0);
    CHECK_MSG(last < 0.5f * first, "adapter training: loss %.4f -> %.4f", (double)first, (double)last);
    dtr_optimizer_destroy(o);
}

/* lora_dropout 0.5 (the adapter trained, so B != 0): in evaluation mode the output is y, the
   one without dropout; in training mode the adapter's input loses about half its elements, so
   the output moves off y; a negative probability fails */
static void lora_dropout(dtr_context *ctx, lora_net *n, const float *x, const float *y) {
    float yd[LR_B * LR_OUT];
    int64_t xs[2] = {LR_B, LR_IN};
    int i, moved = 0;
    n->fc.lora_dropout = 0.5f;
    dtr_context_set_training(ctx, 0);
    lora_out(ctx, n, x, yd);
    CHECK(memcmp(yd, y, sizeof yd) == 0);
    dtr_context_set_training(ctx, 1);
    lora_out(ctx, n, x, yd);
    for (i = 0; i < LR_B * LR_OUT; i++) moved += fabsf(yd[i] - y[i]) > 1e-6f;
    CHECK_MSG(moved > LR_B * LR_OUT / 2, "training-mode dropout moved %d of %d outputs", moved, LR_B * LR_OUT);
    n->fc.lora_dropout = -0.5f;
    CHECK(dtr_linear_layer_forward(ctx, &n->fc, dtr_tensor_from(ctx, DTR_F32, 2, xs, (void *)x)) == NULL);
    dtr_context_clear_error(ctx);
    dtr_context_reset(ctx);
    n->fc.lora_dropout = 0.0f;
}

/* the adapter alone saved (dtr_save_config.only) and read back into a model with its base:
   the file holds two tensors, and the adapted output comes back */
static void lora_adapter_file(dtr_context *ctx, lora_net *n, const float *x) {
    const char *only[1] = {"*lora_"}, *all[1] = {"*"}, *none[1] = {"nothing."};
    dtr_save_config sc = dtr_save_config_init(DTR_F32);
    dtr_load_config lc = dtr_load_config_init();
    float b[LR_OUT * LR_R], y[LR_B * LR_OUT], y2[LR_B * LR_OUT];
    char path[256], err[256];
    dtr_st_file f;
    int i;
    for (i = 0; i < LR_OUT * LR_R; i++) b[i] = 0.1f * (float)(i % 7) - 0.3f;
    dtr_tensor_write(n->fc.lora_b, DTR_F32, b, LR_OUT * LR_R);
    lora_out(ctx, n, x, y);
    tmp_path("dtr_lora", "adapter.safetensors", path, sizeof path);
    sc.only = none, sc.n_only = 1;
    CHECK(dtr_model_save_ex(n->m, path, &sc) == DTR_NOT_FOUND);
    dtr_context_clear_error(ctx);
    sc.only = only;
    CHECK_OK(ctx, dtr_model_save_ex(n->m, path, &sc));
    CHECK(dtr_st_open(path, NULL, &f, err, sizeof err) == DTR_OK && f.count == 2);
    dtr_st_destroy(&f);
    memset(b, 0, sizeof b);
    CHECK_OK(ctx, dtr_tensor_write(n->fc.lora_b, DTR_F32, b, LR_OUT * LR_R));   /* cleared, then restored from the file */
    lc.optional = all, lc.n_optional = 1;
    CHECK_OK(ctx, dtr_model_load_ex(n->m, path, &lc));
    lora_out(ctx, n, x, y2);
    CHECK(memcmp(y, y2, sizeof y) == 0);
    remove(path);
}

static void test_lora(void) {
    dtr_context *ctx = test_ctx(1);
    lora_net n, base;
    float x[LR_B * LR_IN], y0[LR_B * LR_OUT], y[LR_B * LR_OUT], ym[LR_B * LR_OUT], w0[LR_OUT * LR_IN], bz[LR_OUT * LR_R];
    const char *opt[1] = {"*lora_"}, *all[1] = {"*"};
    dtr_load_config lc = dtr_load_config_init();
    char path[256];
    int i;
    for (i = 0; i < LR_B * LR_IN; i++) x[i] = (float)cos(0.37 * i);
    lora_make(ctx, &n, 1);
    lora_make(ctx, &base, 0);
    CHECK(dtr_model_find(n.m, "fc.lora_A.weight") == n.fc.lora_a && dtr_model_find(n.m, "fc.lora_B.weight") == n.fc.lora_b);
    CHECK(dtr_tensor_dim(n.fc.lora_a, 0) == LR_R && dtr_tensor_dim(n.fc.lora_a, 1) == LR_IN);
    CHECK(dtr_tensor_dim(n.fc.lora_b, 0) == LR_OUT && dtr_tensor_dim(n.fc.lora_b, 1) == LR_R);
    lora_out(ctx, &n, x, y);   /* B = 0: the base layer's output (the same weights: declared first) */
    lora_out(ctx, &base, x, y0);
    CHECK(memcmp(y, y0, sizeof y) == 0);
    dtr_tensor_read(n.fc.weight, DTR_F32, w0, LR_OUT * LR_IN);
    lora_train(ctx, &n, x, w0);
    lora_out(ctx, &n, x, y);
    CHECK_MSG(lora_gap(&n, x, y) < 1e-5, "LoRA forward: %.3g from the double reference", lora_gap(&n, x, y));
    lora_dropout(ctx, &n, x, y);
    CHECK_OK(ctx, dtr_linear_layer_merge_lora(&n.fc));
    lora_out(ctx, &n, x, ym);
    CHECK_MSG(test_rel_gap(ym, y, LR_B * LR_OUT) < 1e-5, "merged: %.3g", test_rel_gap(ym, y, LR_B * LR_OUT));
    memset(bz, 0, sizeof bz);
    CHECK(memcmp(dtr_tensor_data(n.fc.lora_b), bz, sizeof bz) == 0);
    /* a base file (no adapter) into the model with one: only with the adapter optional */
    tmp_path("dtr_lora", "base.safetensors", path, sizeof path);
    CHECK_OK(ctx, dtr_model_save(base.m, path, DTR_F32));
    CHECK(dtr_model_load(n.m, path) == DTR_NOT_FOUND && strstr(dtr_context_last_error(ctx), "lora_A"));
    dtr_context_clear_error(ctx);
    lc.optional = opt, lc.n_optional = 1;
    CHECK_OK(ctx, dtr_model_load_ex(n.m, path, &lc));
    lora_out(ctx, &n, x, y);   /* the base's weights, B still zero */
    CHECK(memcmp(y, y0, sizeof y) == 0);
    remove(path);
    lora_adapter_file(ctx, &n, x);
    /* errors */
    CHECK(dtr_linear_layer_add_lora(&n.fc, n.m, 2, 4.0f) == DTR_INVALID_ARGUMENT);   /* one there already */
    dtr_context_clear_error(ctx);
    CHECK(dtr_linear_layer_add_lora(&base.fc, base.m, 0, 4.0f) == DTR_INVALID_ARGUMENT);
    dtr_context_clear_error(ctx);
    CHECK(dtr_linear_layer_add_lora(&base.fc, base.m, 2, 4.0f) == DTR_BAD_STATE && !base.fc.lora_a);   /* built */
    dtr_context_clear_error(ctx);
    CHECK(dtr_linear_layer_merge_lora(&base.fc) == DTR_INVALID_ARGUMENT);
    dtr_context_clear_error(ctx);
    lc.optional = all;   /* a file with none of the model's tensors */
    tmp_path("dtr_lora", "other.safetensors", path, sizeof path);
    {
        dtr_model *om = NULL;
        dtr_linear_layer ol;
        CHECK_OK(ctx, dtr_model_create(ctx, 1, &om));
        CHECK_OK(ctx, dtr_linear_layer_init(&ol, om, "head", 3, 2, 0, DTR_INIT_ZEROS));
        CHECK_OK(ctx, dtr_model_save(om, path, DTR_F32));
        CHECK(dtr_model_load_ex(n.m, path, &lc) == DTR_NOT_FOUND && strstr(dtr_context_last_error(ctx), "none of"));
        dtr_context_clear_error(ctx);
        dtr_model_destroy(om);
    }
    remove(path);
    dtr_model_destroy(n.m), dtr_model_destroy(base.m);
    dtr_context_destroy(ctx);
}

/* Weights tied (GPT-2's token embedding as its output head): one parameter W (V, C) read by an
   embedding and by a linear layer (logits = h W^T), or by an embedding and a matmul (x W); its
   gradient is the sum of the two uses' (each taken from an untied copy of W), to 1e-6. */
enum { TW_V = 11, TW_C = 8, TW_N = 10 };

/* the loss of the net on W_emb and W_out (the same tensor when tied); head 1: cross-entropy of
   tanh(emb) W_out^T, 0: sum((emb + x W_out) * R) */
static dtr_tensor *tied_loss(dtr_context *ctx, dtr_tensor *w_emb, dtr_tensor *w_out, int head) {
    static const int64_t n = TW_N, xs[2] = {TW_N, TW_V};
    int32_t ids[TW_N], tgt[TW_N];
    float x[TW_N * TW_V], r[TW_N * TW_C];
    dtr_tensor *e;
    int i;
    for (i = 0; i < TW_N; i++) ids[i] = (int32_t)((i * 7 + 2) % TW_V), tgt[i] = (int32_t)((i * 5 + 1) % TW_V);
    for (i = 0; i < TW_N * TW_V; i++) x[i] = (float)sin(0.3 * i);
    for (i = 0; i < TW_N * TW_C; i++) r[i] = (float)cos(0.7 * i);
    e = dtr_embedding(ctx, w_emb, dtr_tensor_from(ctx, DTR_I32, 1, &n, ids));
    if (head) return dtr_cross_entropy(ctx, dtr_linear(ctx, dtr_tanh(ctx, e), w_out, NULL), dtr_tensor_from(ctx, DTR_I32, 1, &n, tgt));
    e = dtr_add(ctx, e, dtr_matmul(ctx, dtr_tensor_from(ctx, DTR_F32, 2, xs, x), w_out));
    return dtr_sum_all(ctx, dtr_mul(ctx, e, dtr_tensor_from(ctx, DTR_F32, 2, (const int64_t[]){TW_N, TW_C}, r)));
}

static void test_tied_weights(void) {
    static const int64_t ws[2] = {TW_V, TW_C};
    dtr_context *ctx = test_ctx(2);
    float w[TW_V * TW_C], tied[TW_V * TW_C], g1[TW_V * TW_C], g2[TW_V * TW_C], sum[TW_V * TW_C];
    int i, head;
    for (i = 0; i < TW_V * TW_C; i++) w[i] = (float)sin(1.3 * i) * 0.5f;
    for (head = 0; head < 2; head++) {
        dtr_tensor *t = dtr_tensor_requires_grad(dtr_tensor_from(ctx, DTR_F32, 2, ws, w));
        dtr_tensor *a = dtr_tensor_requires_grad(dtr_tensor_from(ctx, DTR_F32, 2, ws, w));
        dtr_tensor *b = dtr_tensor_requires_grad(dtr_tensor_from(ctx, DTR_F32, 2, ws, w));
        CHECK_OK(ctx, dtr_backward(ctx, tied_loss(ctx, t, t, head)));
        CHECK_OK(ctx, dtr_backward(ctx, tied_loss(ctx, a, b, head)));
        CHECK_OK(ctx, dtr_tensor_read_grad(t, tied, TW_V * TW_C));
        CHECK_OK(ctx, dtr_tensor_read_grad(a, g1, TW_V * TW_C));
        CHECK_OK(ctx, dtr_tensor_read_grad(b, g2, TW_V * TW_C));
        for (i = 0; i < TW_V * TW_C; i++) sum[i] = g1[i] + g2[i];
        CHECK_MSG(test_rel_gap(tied, sum, TW_V * TW_C) < 1e-6, "tied weights (%s): the gradient is not the two uses' sum (%.3g)",
                  head ? "embedding and output head" : "embedding and matmul", test_rel_gap(tied, sum, TW_V * TW_C));
        CHECK(test_rel_gap(g1, g2, TW_V * TW_C) > 1e-2);   /* the two uses' gradients differ: the sum is a test */
        dtr_context_reset(ctx);
    }
    dtr_context_destroy(ctx);
}

static void test_layer_errors(void) {
    dtr_context *ctx = test_ctx(1);
    dtr_model *m;
    dtr_lstm_layer ll;
    dtr_gru_layer gl;
    dtr_groupnorm_layer gn;
    int64_t bad_x[3] = {2, 3, 5}, x2[2] = {2, 3}, hs[2] = {3, 4}, img[4] = {2, 6, 2, 2};
    dtr_tensor *c = NULL, *x;
    dtr_model_create(ctx, 1, &m);
    CHECK(dtr_lstm_layer_init(&ll, m, "l", 0, 4) == DTR_INVALID_ARGUMENT);
    dtr_context_clear_error(ctx);
    CHECK(dtr_groupnorm_layer_init(&gn, m, "g", 4, 6) == DTR_INVALID_ARGUMENT);
    dtr_context_clear_error(ctx);
    CHECK_OK(ctx, dtr_lstm_layer_init(&ll, m, "l", 3, 4));
    CHECK_OK(ctx, dtr_gru_layer_init(&gl, m, "g", 3, 4));
    CHECK_OK(ctx, dtr_groupnorm_layer_init(&gn, m, "n", 2, 4));
    CHECK_OK(ctx, dtr_model_build(m));
    x = dtr_tensor_zeros(ctx, DTR_F32, 3, bad_x);
    CHECK(dtr_lstm_layer_forward(ctx, &ll, x, NULL, NULL, NULL, NULL) == NULL);
    CHECK(dtr_context_status(ctx) == DTR_SHAPE_MISMATCH && strstr(dtr_context_last_error(ctx), "not (B, T, 3)"));
    dtr_context_clear_error(ctx);
    CHECK(dtr_gru_layer_step(ctx, &gl, dtr_tensor_zeros(ctx, DTR_F32, 2, x2), dtr_tensor_zeros(ctx, DTR_F32, 2, hs)) == NULL);
    CHECK(dtr_context_status(ctx) == DTR_SHAPE_MISMATCH && strstr(dtr_context_last_error(ctx), "not (2, 4)"));
    dtr_context_clear_error(ctx);
    CHECK(dtr_lstm_layer_step(ctx, &ll, dtr_tensor_zeros(ctx, DTR_F32, 2, x2), NULL, NULL, NULL) == NULL);
    CHECK(dtr_context_status(ctx) == DTR_NULL_HANDLE);
    dtr_context_clear_error(ctx);
    CHECK(dtr_lstm_layer_step(ctx, &ll, dtr_tensor_zeros(ctx, DTR_F32, 2, x2), NULL, NULL, &c) != NULL && c != NULL);
    CHECK(dtr_groupnorm_layer_forward(ctx, &gn, dtr_tensor_zeros(ctx, DTR_F32, 4, img)) == NULL);
    CHECK(dtr_context_status(ctx) == DTR_SHAPE_MISMATCH);
    dtr_context_clear_error(ctx);
    CHECK(dtr_group_norm(ctx, dtr_tensor_zeros(ctx, DTR_F32, 4, img), 4, NULL, NULL, 1e-5f) == NULL);
    CHECK(dtr_context_status(ctx) == DTR_SHAPE_MISMATCH);
    dtr_context_clear_error(ctx);
    check_bn_errors(ctx);
    check_conv_errors(ctx, m);
    dtr_model_destroy(m);
    dtr_context_destroy(ctx);
}

int main(void) {
    RUN(test_lstm_gru_torch);
    RUN(test_lstm_gru_sequence);
    RUN(test_rnn_lengths);
    RUN(test_rnn_learns);
    RUN(test_group_norm_torch);
    RUN(test_batch_norm_torch);
    RUN(test_buffers);
    RUN(test_conv_torch);
    RUN(test_conv_bands);
    RUN(test_model_lerp);
    RUN(test_lora);
    RUN(test_tied_weights);
    RUN(test_layer_errors);
    return test_summary();
}
