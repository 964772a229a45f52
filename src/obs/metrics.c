/* ============================================================================
 * Metrics: the phase clock, FLOP counts, the per-step record (callback and JSON lines) and
 * the straggler report.
 *
 * Phase clock. A stack of open phases; at each mark the time since the previous mark goes
 * to the innermost open phase (FORWARD when none is open), so the parts of a step add up to
 * its time exactly. Marks come from the thread that drives the context; nothing is locked.
 *
 * FLOPs. Each op's forward and backward count by kind: matmul and linear 2*M*N*K (+ one per
 * output for a bias), conv2d 2*out*Cin*kh*kw (+ bias), a transposed one 2*in*Cout*kh*kw (+ bias),
 * their backward twice the products
 * (the gradients of both operands) plus the bias's sum; views and communication ops none; everything else
 * (element-wise, reductions, softmax, losses) one per element of its largest tensor.
 * Attention (dtr_attention, one fused op) counts what its unfused form would: q k^T and P v,
 * 2*B*T*T*C each, and a scale and a softmax, one per score (B*H*T*T each); backward twice that.
 * The recurrences (dtr_lstm_sequence, dtr_gru_sequence) count their recurrent products,
 * 2*T*B*G*H*H (G = 4, 3); backward twice that (the gradients of h and of W_hh).
 * ==========================================================================*/
#include "../public/api.h"
#include "../public/api_data.h"
#include "../public/api_comm.h"
#include "../public/api_obs.h"
#include "obs_internal.h"

static const char *const dtr__phase_names[DTR_PHASE_COUNT] = {"data", "forward", "backward", "comm", "optimizer",
                                                              "checkpoint"};

double dtr__obs_now(void) { return 1e-9 * (double)dtr_time_ns(); }

/* ---- life cycle ---- */

dtr_metrics_config dtr_metrics_config_init(void) {
    dtr_metrics_config c;
    memset(&c, 0, sizeof c);
    c.trace_events = 65536;
    return c;
}

static char *dtr__obs_strdup(const dtr_allocation_callbacks *a, const char *s) {
    size_t n = s ? strlen(s) + 1 : 0;
    char *p = s ? (char *)dtr__malloc(a, n) : NULL;
    if (p) memcpy(p, s, n);
    return p;
}

static dtr_result dtr__obs_open(dtr_metrics *m) {
    dtr_context *ctx = m->ctx;
    const dtr_metrics_config *c = &m->cfg;
    if ((c->jsonl_path && !(m->jsonl_path = dtr__obs_strdup(&ctx->alloc, c->jsonl_path))) ||
        (c->trace_path && !(m->trace_path = dtr__obs_strdup(&ctx->alloc, c->trace_path))))
        return dtr__fail(ctx, DTR_OUT_OF_MEMORY, "dtr_metrics_create: out of memory");
    m->cfg.jsonl_path = m->jsonl_path;
    m->cfg.trace_path = m->trace_path;
    if (c->trace_path) {
        m->cap = c->trace_events ? c->trace_events : 65536;
        m->ring = (dtr__obs_event *)dtr__malloc(&ctx->alloc, m->cap * sizeof(dtr__obs_event));
        if (!m->ring)
            return dtr__fail(ctx, DTR_OUT_OF_MEMORY, "dtr_metrics_create: no memory for %zu trace events", m->cap);
    }
    if (c->jsonl_path && !(m->jsonl = fopen(c->jsonl_path, "a")))
        return dtr__fail(ctx, DTR_IO_ERROR, "dtr_metrics_create: cannot open '%s' for appending", c->jsonl_path);
    return DTR_OK;
}

dtr_result dtr_metrics_create(dtr_context *ctx, const dtr_metrics_config *cfg, dtr_metrics **out) {
    dtr_metrics_config def = dtr_metrics_config_init();
    dtr_metrics *m;
    dtr_result r;
    if (!ctx || !out) return DTR_NULL_HANDLE;
    *out = NULL;
    if (ctx->obs) return dtr__fail(ctx, DTR_BAD_STATE, "dtr_metrics_create: the context has a dtr_metrics already");
    if (!cfg) cfg = &def;
    if (cfg->peak_flops < 0)
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_metrics_create: peak_flops %g is negative", cfg->peak_flops);
    m = (dtr_metrics *)dtr__calloc(&ctx->alloc, sizeof *m);
    if (!m) return dtr__fail(ctx, DTR_OUT_OF_MEMORY, "dtr_metrics_create: out of memory");
    m->ctx = ctx;
    m->cfg = *cfg;
    m->step = cfg->first_step;
    m->grad_norm = -1.0;
    if ((r = dtr__obs_open(m)) != DTR_OK) {
        ctx->obs = m;
        dtr_metrics_destroy(m);
        return r;
    }
    m->t_begin = m->t_last = dtr__obs_now();
    ctx->obs = m;
    *out = m;
    return DTR_OK;
}

void dtr_metrics_destroy(dtr_metrics *m) {
    dtr_allocation_callbacks a;
    if (!m) return;
    a = m->ctx->alloc;
    if (m->trace_path && m->ring) dtr_metrics_write_trace(m);
    if (m->jsonl) fclose(m->jsonl);
    if (m->ctx->obs == m) m->ctx->obs = NULL;
    dtr__free(&a, m->ring);
    dtr__free(&a, m->jsonl_path);
    dtr__free(&a, m->trace_path);
    dtr__free(&a, m);
}

/* ---- the phase clock ---- */

static void dtr__obs_tick(dtr_metrics *m, double t) {
    int cur = m->depth ? m->stack[m->depth - 1] : DTR_PHASE_FORWARD;
    if (t > m->t_last) m->phase[cur] += t - m->t_last;
    if (t > m->t_last) m->t_last = t;
}

void dtr__obs_enter(dtr_metrics *m, int phase, double t) {
    if (m->depth >= DTR__OBS_DEPTH) return;
    dtr__obs_tick(m, t);
    m->stack[m->depth] = phase;
    m->stack_t0[m->depth++] = t;
}

void dtr__obs_leave(dtr_metrics *m, int phase, double t) {
    if (!m->depth || m->stack[m->depth - 1] != phase) return;
    dtr__obs_tick(m, t);
    m->depth--;
    if (phase != DTR_PHASE_FORWARD)
        dtr__obs_span(m, dtr__phase_names[phase], DTR__OBS_PHASE, 0, -1, m->stack_t0[m->depth], t);
}

void dtr__obs_phase_begin(dtr_context *ctx, int phase) {
    if (ctx && ctx->obs) dtr__obs_enter(ctx->obs, phase, dtr__obs_now());
}

void dtr__obs_phase_end(dtr_context *ctx, int phase) {
    if (ctx && ctx->obs) dtr__obs_leave(ctx->obs, phase, dtr__obs_now());
}

static dtr_result dtr__obs_check_phase(dtr_metrics *m, dtr_phase phase, const char *fn) {
    if ((int)phase < 0 || phase >= DTR_PHASE_COUNT)
        return dtr__fail(m->ctx, DTR_INVALID_ARGUMENT, "%s: phase %d is not a dtr_phase", fn, (int)phase);
    return DTR_OK;
}

dtr_result dtr_metrics_phase_begin(dtr_metrics *m, dtr_phase phase) {
    dtr_result r;
    if (!m) return DTR_NULL_HANDLE;
    if ((r = dtr__obs_check_phase(m, phase, "dtr_metrics_phase_begin")) != DTR_OK) return r;
    if (m->depth >= DTR__OBS_DEPTH)
        return dtr__fail(m->ctx, DTR_BAD_STATE, "dtr_metrics_phase_begin: phases nested more than %d deep",
                         DTR__OBS_DEPTH);
    dtr__obs_enter(m, (int)phase, dtr__obs_now());
    return DTR_OK;
}

dtr_result dtr_metrics_phase_end(dtr_metrics *m, dtr_phase phase) {
    dtr_result r;
    if (!m) return DTR_NULL_HANDLE;
    if ((r = dtr__obs_check_phase(m, phase, "dtr_metrics_phase_end")) != DTR_OK) return r;
    if (!m->depth || m->stack[m->depth - 1] != (int)phase)
        return dtr__fail(m->ctx, DTR_BAD_STATE, "dtr_metrics_phase_end: '%s' is not the innermost open phase",
                         dtr__phase_names[phase]);
    dtr__obs_leave(m, (int)phase, dtr__obs_now());
    return DTR_OK;
}

dtr_result dtr_metrics_watch_loader(dtr_metrics *m, dtr_loader *loader) {
    if (!loader) return DTR_NULL_HANDLE;
    dtr__loader_set_obs(loader, m);
    return DTR_OK;
}

/* ---- what the library reports ---- */

static double dtr__obs_numel(const dtr_tensor *t) { return t ? (double)dtr__numel(t->ndim, t->shape) : 0.0; }

/* 1 when n adds a bias (one FLOP per output) to its products */
static int dtr__obs_has_bias(const dtr__node *n) {
    return (n->op == DTR_OP_LINEAR || n->op == DTR_OP_CONV2D || n->op == DTR_OP_CONV_TRANSPOSE2D) && n->n_in > 2 && n->in[2];
}

/* forward FLOPs of node n (see the header comment) */
static double dtr__obs_flops(const dtr__node *n) {
    double out = dtr__obs_numel(n->out), big = out;
    int i;
    switch (n->op) {
    case DTR_OP_MATMUL: case DTR_OP_LINEAR: {
        const dtr_tensor *a = n->in[0];
        return 2.0 * out * (double)a->shape[a->ndim - 1] + (dtr__obs_has_bias(n) ? out : 0.0);
    }
    case DTR_OP_CONV2D: {
        const dtr_tensor *w = n->in[1];   /* (Cout, Cin, kh, kw) */
        return 2.0 * out * (double)(w->shape[1] * w->shape[2] * w->shape[3]) + (dtr__obs_has_bias(n) ? out : 0.0);
    }
    case DTR_OP_CONV_TRANSPOSE2D: {   /* each input element times its (Cout / G, kh, kw) weights */
        const dtr_tensor *w = n->in[1];
        return 2.0 * dtr__obs_numel(n->in[0]) * (double)(w->shape[1] * w->shape[2] * w->shape[3]) + (dtr__obs_has_bias(n) ? out : 0.0);
    }
    case DTR_OP_LSTM: case DTR_OP_GRU:   /* every step's h W_hh^T: gx (T, B, G H) times H; the gates' arithmetic not counted */
        return 2.0 * dtr__obs_numel(n->in[0]) * (double)n->in[1]->shape[1];
    case DTR_OP_ATTENTION: {   /* q (B, Tq, C), k, v (B, Tk, C), H heads: every score counted, causal or not */
        const dtr_tensor *q = n->in[0];
        double B = (double)q->shape[0], TT = (double)q->shape[1] * (double)n->in[1]->shape[1], C = (double)q->shape[2];
        return 4.0 * B * TT * C + 2.0 * B * (double)n->p.attention.heads * TT;
    }
    case DTR_OP_RESHAPE: case DTR_OP_PERMUTE: case DTR_OP_SLICE: case DTR_OP_CONCAT: case DTR_OP_CONTIGUOUS:
    case DTR_OP_CAST: case DTR_OP_TP_COPY: case DTR_OP_TP_REDUCE: case DTR_OP_TP_GATHER: case DTR_OP_CHECKPOINT:
        return 0.0;
    default:
        for (i = 0; i < n->n_in; i++)
            if (dtr__obs_numel(n->in[i]) > big) big = dtr__obs_numel(n->in[i]);
        return big;
    }
}

void dtr__obs_op(dtr_metrics *m, const dtr__node *n, int bwd, double t0, double t1) {
    double f = dtr__obs_flops(n);
    if (bwd && (n->op == DTR_OP_MATMUL || n->op == DTR_OP_LINEAR || n->op == DTR_OP_CONV2D || n->op == DTR_OP_CONV_TRANSPOSE2D)) {
        double bias = dtr__obs_has_bias(n) ? dtr__obs_numel(n->out) : 0.0;
        f = 2.0 * (f - bias) + bias;   /* both operands' gradients; the bias's is a sum */
    }
    if (bwd && (n->op == DTR_OP_ATTENTION || n->op == DTR_OP_LSTM || n->op == DTR_OP_GRU)) f *= 2.0;   /* recurrences: dh and dW_hh */
    m->flops += f;
    if (m->ring)
        dtr__obs_span(m, dtr__op_name(n->op), bwd ? DTR__OBS_BACKWARD : DTR__OBS_FORWARD, 0, -1, t0, t1);
}

void dtr__obs_comm_wait(dtr_metrics *m, double secs) { m->comm_wait += secs; }

void dtr__obs_optimizer(dtr_metrics *m, double lr, double norm) {
    m->lr = lr;
    if (norm >= 0) m->grad_norm = norm;
}

int dtr__obs_wants_grad_norm(const dtr_metrics *m) { return m->cfg.grad_norm != 0; }

/* ---- the step record ---- */

dtr_result dtr_metrics_step_begin(dtr_metrics *m) {
    if (!m) return DTR_NULL_HANDLE;
    m->t_begin = m->t_last = dtr__obs_now();
    memset(m->phase, 0, sizeof m->phase);
    m->flops = m->comm_wait = 0.0;
    return DTR_OK;
}

static void dtr__obs_fill(dtr_metrics *m, const dtr_step_info *in, double t, dtr_step_metrics *s) {
    int p;
    memset(s, 0, sizeof *s);
    s->rank = m->cfg.rank;
    s->step = m->step;
    s->epoch = in->epoch;
    s->loss = in->loss;
    s->lr = in->lr != 0 ? in->lr : m->lr;
    s->grad_norm = in->grad_norm != 0 ? in->grad_norm : m->grad_norm;
    s->samples = in->samples;
    s->tokens = in->tokens;
    s->time_step = t - m->t_begin;
    for (p = 0; p < DTR_PHASE_COUNT; p++) s->time[p] = m->phase[p];
    s->samples_per_s = s->time_step > 0 ? (double)s->samples / s->time_step : 0.0;
    s->tokens_per_s = s->time_step > 0 ? (double)s->tokens / s->time_step : 0.0;
    s->flops = m->flops;
    s->mfu = s->time_step > 0 && m->cfg.peak_flops > 0 ? s->flops / s->time_step / m->cfg.peak_flops : 0.0;
    s->skipped = in->skipped;
    s->comm_wait = m->comm_wait;
}

/* a JSON number, or null for NaN and infinities */
static void dtr__obs_num(char *buf, size_t n, double v) {
    if (v != v || v > 1e308 || v < -1e308) snprintf(buf, n, "null");
    else snprintf(buf, n, "%.9g", v);
}

static dtr_result dtr__obs_write_line(dtr_metrics *m, const dtr_step_metrics *s) {
    char v[12][40];
    const double x[12] = {s->loss, s->lr, s->grad_norm, s->samples_per_s, s->tokens_per_s, s->time_step,
                          s->flops, s->mfu, s->comm_wait, 0, 0, 0};
    int i, w;
    for (i = 0; i < 9; i++) dtr__obs_num(v[i], sizeof v[i], x[i]);
    w = fprintf(m->jsonl, "{\"rank\":%d,\"step\":%lld,\"epoch\":%lld,\"loss\":%s,\"lr\":%s,\"grad_norm\":%s,"
                "\"samples\":%lld,\"tokens\":%lld,\"samples_per_s\":%s,\"tokens_per_s\":%s,\"time\":{\"step\":%s",
                (int)s->rank, (long long)s->step, (long long)s->epoch, v[0], v[1], v[2], (long long)s->samples,
                (long long)s->tokens, v[3], v[4], v[5]);
    for (i = 0; i < DTR_PHASE_COUNT && w >= 0; i++) {
        dtr__obs_num(v[9], sizeof v[9], s->time[i]);
        w = fprintf(m->jsonl, ",\"%s\":%s", dtr__phase_names[i], v[9]);
    }
    if (w >= 0)
        w = fprintf(m->jsonl, "},\"flops\":%s,\"mfu\":%s,\"skipped\":%d,\"comm_wait\":%s}\n", v[6], v[7], s->skipped,
                    v[8]);
    if (w >= 0 && dtr__obs_now() - m->flushed >= 1.0) {   /* at most one write(2) a second */
        m->flushed = dtr__obs_now();
        if (fflush(m->jsonl) != 0) w = -1;
    }
    if (w < 0)
        return dtr__fail(m->ctx, DTR_IO_ERROR, "dtr_metrics_step_end: cannot write '%s'", m->jsonl_path);
    return DTR_OK;
}

dtr_result dtr_metrics_step_end(dtr_metrics *m, const dtr_step_info *info, dtr_step_metrics *out) {
    dtr_step_info none;
    dtr_step_metrics s;
    double t;
    if (!m) return DTR_NULL_HANDLE;
    if (!info) { memset(&none, 0, sizeof none); info = &none; }
    t = dtr__obs_now();
    dtr__obs_tick(m, t);
    dtr__obs_fill(m, info, t, &s);
    /* the straggler window: the engine's waits on its buckets, or (ZeRO-2, local SGD, whose
       exchanges have no bucket requests) the exposed communication */
    m->waits[m->nwaits++ % DTR__OBS_WINDOW] = m->comm_wait > 0 ? m->comm_wait : m->phase[DTR_PHASE_COMM];
    m->step++;
    m->t_begin = t;
    memset(m->phase, 0, sizeof m->phase);
    m->flops = m->comm_wait = 0.0;
    if (out) *out = s;
    if (m->cfg.callback) m->cfg.callback(m->cfg.user, &s);
    return m->jsonl ? dtr__obs_write_line(m, &s) : DTR_OK;
}

/* ---- stragglers ---- */

/* the rank that waited least in window slot k (rows of W+1: the count, then the window) */
static int dtr__obs_last_arriver(const double *all, int size, int k) {
    int r, best = 0;
    for (r = 1; r < size; r++)
        if (all[r * (DTR__OBS_WINDOW + 1) + 1 + k] < all[best * (DTR__OBS_WINDOW + 1) + 1 + k]) best = r;
    return best;
}

static void dtr__obs_tally(const double *all, int size, dtr_straggler_report *out, int64_t *counts) {
    int64_t n = DTR__OBS_WINDOW, k;
    int r;
    double sum_slow = 0.0, sum_all = 0.0;
    for (r = 0; r < size; r++) {
        counts[r] = 0;
        if ((int64_t)all[r * (DTR__OBS_WINDOW + 1)] < n) n = (int64_t)all[r * (DTR__OBS_WINDOW + 1)];
    }
    for (k = DTR__OBS_WINDOW - n; k < DTR__OBS_WINDOW; k++) counts[dtr__obs_last_arriver(all, size, (int)k)]++;
    out->steps = n;
    for (r = 0; n > 0 && r < size; r++)
        if (out->slowest_rank < 0 || counts[r] > out->slowest_count) {
            out->slowest_rank = r;
            out->slowest_count = counts[r];
        }
    for (r = 0; n > 0 && r < size; r++)
        for (k = DTR__OBS_WINDOW - n; k < DTR__OBS_WINDOW; k++) {
            double w = all[r * (DTR__OBS_WINDOW + 1) + 1 + k];
            if (r == out->slowest_rank) sum_slow += w;
            else sum_all += w;
        }
    if (n > 0) out->slowest_wait_s = sum_slow / (double)n;
    if (n > 0 && size > 1) out->others_wait_s = sum_all / (double)(n * (size - 1));
}

dtr_result dtr_metrics_stragglers(dtr_metrics *m, dtr_comm *c, dtr_straggler_report *out, int64_t *counts) {
    const dtr_allocation_callbacks *a;
    int size, k, n;
    float *mine, *all;
    double *dall;
    int64_t *cnt;
    dtr_result r;
    if (!m || !c || !out) return DTR_NULL_HANDLE;
    memset(out, 0, sizeof *out);
    out->slowest_rank = -1;
    size = dtr_comm_size(c);
    n = (int)(m->nwaits < DTR__OBS_WINDOW ? m->nwaits : DTR__OBS_WINDOW);
    a = &m->ctx->alloc;
    /* rows of W+1 values: the count, then the window with the last n waits at its end, oldest
       first (f32: the collectives' type) */
    mine = (float *)dtr__calloc(a, (size_t)(DTR__OBS_WINDOW + 1) * sizeof(float));
    all = (float *)dtr__malloc(a, (size_t)size * (DTR__OBS_WINDOW + 1) * sizeof(float));
    dall = (double *)dtr__malloc(a, (size_t)size * (DTR__OBS_WINDOW + 1) * sizeof(double));
    cnt = (int64_t *)dtr__malloc(a, (size_t)size * sizeof(int64_t));
    r = mine && all && dall && cnt ? DTR_OK : dtr__fail(m->ctx, DTR_OUT_OF_MEMORY, "dtr_metrics_stragglers: out of memory");
    if (r == DTR_OK) {
        mine[0] = (float)n;
        for (k = 0; k < n; k++) mine[1 + DTR__OBS_WINDOW - n + k] = (float)m->waits[(m->nwaits - n + k) % DTR__OBS_WINDOW];
        r = dtr_comm_all_gather(c, mine, all, DTR__OBS_WINDOW + 1, DTR_F32);
        if (r != DTR_OK) dtr__fail(m->ctx, r, "dtr_metrics_stragglers: all-gather: %s", dtr_comm_last_error(c));
    }
    if (r == DTR_OK) {
        for (k = 0; k < size * (DTR__OBS_WINDOW + 1); k++) dall[k] = all[k];
        dtr__obs_tally(dall, size, out, cnt);
        if (counts) memcpy(counts, cnt, (size_t)size * sizeof(int64_t));
    }
    dtr__free(a, mine);
    dtr__free(a, all);
    dtr__free(a, dall);
    dtr__free(a, cnt);
    return r;
}
