/* ============================================================================
 * Pipeline parallelism: each rank of a group holds some consecutive layers of the model (a
 * stage, or with interleaving several model chunks), and the micro-batches of a batch flow
 * through the stages: activations forward by point-to-point sends, their gradients back.
 *
 * A step runs this rank's plan, a list of actions F(chunk, mb) and B(chunk, mb) that the
 * schedule fixes (GPipe: every forward, then every backward; 1F1B: P - rank - 1 forwards of
 * warm-up, then one forward and one backward in turn, then the rest of the backwards;
 * interleaved: Megatron-LM's order over `chunks` model chunks per rank). Sends never block
 * (their requests are collected and reclaimed later), receives block (with the group's
 * deadline), so a rank waits only for data it needs next: the plans of all ranks together
 * cannot deadlock, and a dead stage turns into DTR_PEER_FAILED on the others.
 *
 * Memory: each micro-batch in flight has its own tape (dtr_tape), reset as soon as its
 * backward is done and its gradient sent; 1F1B keeps at most P micro-batches of activations
 * alive on the first stage, GPipe keeps M.
 *
 * Wire format, per (sender, receiving chunk): an activation is a header of 2 + DTR_MAX_DIMS
 * int64 (ndim, shape, dtype) on tag + 3c, its data (f32, or bf16/f16 as stored with 16-bit
 * activations) on tag + 3c + 1; a gradient (shape known to both) is f32 data on tag + 3c + 2.
 * Messages of one tag arrive in order, and every stage handles the micro-batches of a chunk
 * in increasing order in both directions.
 *
 * A model in device memory (a GPU backend) over a host-memory group stages every message
 * through host buffers of its micro-batch's slot (to_host before a send, from_host after a
 * receive); over a device-memory group (NCCL) the messages go from and into the tensors on
 * the device, the received gradient seeding backward there (dtr__backward_from).
 * ==========================================================================*/
#include "../public/api.h"
#include "../public/api_comm.h"
#include "../public/api_engine.h"
#include "../core/internal.h"
#include "../comm/comm_internal.h"

/* An activation's header: ndim, the dims (DTR_MAX_DIMS, 0 past ndim), the dtype (f32, or bf16
   and f16 with 16-bit activations: the data goes as it is stored) */
#define DTR__PIPE_HDR (2 + DTR_MAX_DIMS)

/* one micro-batch in flight: its tape, input (received or NULL), output, sends */
typedef struct dtr__pipe_slot {
    dtr_tape *tape;
    dtr_tensor *in, *out;
    dtr_request *req[3];           /* header, activation, gradient sends */
    int64_t hdr[DTR__PIPE_HDR];    /* header being sent */
    int busy;                      /* 1 from its forward until its backward is done */
    void *host[3];                 /* device models: host copies of the input received, the
                                      output sent and a gradient (received, then sent) */
    size_t host_cap[3];
} dtr__pipe_slot;

typedef struct dtr__pipe_action { int fwd, chunk, mb; } dtr__pipe_action;

struct dtr_pipe {
    dtr_model *m;
    dtr_context *ctx;
    dtr_comm *c;
    dtr_pipe_config cfg;
    int rank, P, v, M;
    dtr__pipe_slot **slots;         /* each allocated once: pending sends point into them */
    int n_slots, live_now;
    dtr__pipe_slot **live;          /* [chunk * M + mb] during a step */
    dtr__pipe_action *plan;         /* 2 * v * M actions */
    double loss;                    /* weighted sum of this step's micro-batch losses */
    dtr_pipe_stats stats;
    int staged;                     /* device model over a host-memory group: messages go through host copies */
};

/* ---- configuration and plans ---- */

dtr_pipe_config dtr_pipe_config_init(void) {
    dtr_pipe_config c;
    memset(&c, 0, sizeof(c));
    c.schedule = DTR_PIPE_1F1B;
    c.microbatches = 1;
    c.chunks = 1;
    c.tag = 1 << 24;
    return c;
}

/* Megatron-LM's interleaved order: forward k runs chunk (k mod P*v) / P of micro-batch
 * (k / (P*v)) * P + k mod P; backward k the same micro-batch of the mirrored chunk. */
static dtr__pipe_action dtr__pipe_interleaved(const dtr_pipe *p, int k, int fwd) {
    dtr__pipe_action a;
    int group = p->P * p->v, chunk = (k % group) / p->P;
    a.fwd = fwd;
    a.chunk = fwd ? chunk : p->v - 1 - chunk;
    a.mb = (k / group) * p->P + k % p->P;
    return a;
}

static dtr__pipe_action dtr__pipe_nth(const dtr_pipe *p, int k, int fwd) {
    dtr__pipe_action a;
    if (p->v > 1) return dtr__pipe_interleaved(p, k, fwd);
    a.fwd = fwd, a.chunk = 0, a.mb = k;
    return a;
}

/* forwards before the first backward on this rank */
static int dtr__pipe_warmup(const dtr_pipe *p) {
    int total = p->v * p->M, w;
    if (p->cfg.schedule == DTR_PIPE_GPIPE) return total;
    if (p->v == 1) w = p->P - p->rank - 1;
    else w = p->M == p->P ? total : (p->P - p->rank - 1) * 2 + (p->v - 1) * p->P;
    return w < total ? w : total;
}

static void dtr__pipe_build_plan(dtr_pipe *p) {
    int total = p->v * p->M, w = dtr__pipe_warmup(p), n = 0, k;
    for (k = 0; k < w; k++) p->plan[n++] = dtr__pipe_nth(p, k, 1);
    for (k = 0; k < total - w; k++) {
        p->plan[n++] = dtr__pipe_nth(p, w + k, 1);
        p->plan[n++] = dtr__pipe_nth(p, k, 0);
    }
    for (k = total - w; k < total; k++) p->plan[n++] = dtr__pipe_nth(p, k, 0);
}

static dtr_result dtr__pipe_check(dtr_context *ctx, const dtr_pipe_config *cfg, int P) {
    const char *fn = "dtr_pipe_create";
    if (!cfg->forward) return dtr__fail(ctx, DTR_NULL_HANDLE, "%s: cfg.forward is NULL", fn);
    if (cfg->microbatches < 1 || cfg->microbatches > 1 << 16)
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "%s: %d micro-batches (1 to 65536)", fn, cfg->microbatches);
    if ((int)cfg->schedule < 0 || cfg->schedule > DTR_PIPE_INTERLEAVED)
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "%s: unknown schedule %d", fn, (int)cfg->schedule);
    if (cfg->chunks < 1 || cfg->chunks > 64 || (cfg->chunks > 1) != (cfg->schedule == DTR_PIPE_INTERLEAVED))
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "%s: %d model chunks per rank with the %s schedule "
                         "(the interleaved schedule takes 2 or more, the others 1)", fn, cfg->chunks,
                         dtr_pipe_schedule_name(cfg->schedule));
    if (cfg->chunks > 1 && (P < 2 || cfg->microbatches % P))
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "%s: the interleaved schedule needs 2 or more ranks and a "
                         "micro-batch count divisible by them (%d micro-batches, %d ranks)", fn, cfg->microbatches, P);
    if (cfg->batch < 0 || (cfg->batch > 0 && cfg->batch < cfg->microbatches))
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "%s: a batch of %lld samples cannot make %d micro-batches", fn,
                         (long long)cfg->batch, cfg->microbatches);
    if (cfg->tag < 0 || cfg->tag > INT32_MAX - 3 * cfg->chunks)
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "%s: tag %d out of range", fn, cfg->tag);
    return DTR_OK;
}

const char *dtr_pipe_schedule_name(dtr_pipe_schedule s) {
    switch (s) {
    case DTR_PIPE_GPIPE: return "gpipe";
    case DTR_PIPE_1F1B: return "1f1b";
    case DTR_PIPE_INTERLEAVED: return "interleaved";
    }
    return "?";
}

dtr_result dtr_pipe_create(dtr_model *m, dtr_comm *c, const dtr_pipe_config *cfg, dtr_pipe **out) {
    dtr_context *ctx;
    dtr_pipe *p;
    dtr_result r;
    if (!out) return DTR_NULL_HANDLE;
    *out = NULL;
    if (!m || !c || !cfg) return DTR_NULL_HANDLE;
    ctx = dtr_model_context(m);
    if ((r = dtr__pipe_check(ctx, cfg, dtr_comm_size(c))) != DTR_OK) return r;
    if (!dtr__comm_takes_host(c))
        return dtr__fail(ctx, DTR_UNSUPPORTED, "dtr_pipe_create: the group's transport (%s) takes device memory only and "
                         "its context's backend cannot stage the host buffers of the messages (no `owns` slot)",
                         dtr_comm_transport_name(c));
    p = (dtr_pipe *)dtr__calloc(&ctx->alloc, sizeof(*p));
    if (!p) return dtr__fail(ctx, DTR_OUT_OF_MEMORY, "dtr_pipe_create: out of memory");
    p->m = m, p->ctx = ctx, p->c = c, p->cfg = *cfg;
    p->staged = !dtr__host_memory(ctx) && !c->mem_ctx;   /* device messages through the host, unless the group takes them */
    p->rank = dtr_comm_rank(c), p->P = dtr_comm_size(c), p->v = cfg->chunks, p->M = cfg->microbatches;
    p->live = (dtr__pipe_slot **)dtr__calloc(&ctx->alloc, (size_t)(p->v * p->M) * sizeof(*p->live));
    p->plan = (dtr__pipe_action *)dtr__calloc(&ctx->alloc, (size_t)(2 * p->v * p->M) * sizeof(*p->plan));
    if (!p->live || !p->plan) {
        dtr_pipe_destroy(p);
        return dtr__fail(ctx, DTR_OUT_OF_MEMORY, "dtr_pipe_create: out of memory");
    }
    dtr__pipe_build_plan(p);
    if ((r = dtr_model_build(m)) != DTR_OK) { dtr_pipe_destroy(p); return r; }
    *out = p;
    return DTR_OK;
}

void dtr_pipe_destroy(dtr_pipe *p) {
    int i, k;
    if (!p) return;
    for (i = 0; i < p->n_slots; i++) {
        for (k = 0; k < 3; k++) dtr_request_destroy(p->slots[i]->req[k]);
        for (k = 0; k < 3; k++) dtr__free(&p->ctx->alloc, p->slots[i]->host[k]);
        dtr_tape_destroy(p->slots[i]->tape);
        dtr__free(&p->ctx->alloc, p->slots[i]);
    }
    dtr__free(&p->ctx->alloc, p->slots);
    dtr__free(&p->ctx->alloc, p->live);
    dtr__free(&p->ctx->alloc, p->plan);
    dtr__free(&p->ctx->alloc, p);
}

/* ---- queries ---- */

int dtr_pipe_stage(const dtr_pipe *p, int chunk) { return p && chunk >= 0 && chunk < p->v ? chunk * p->P + p->rank : -1; }
int dtr_pipe_stage_count(const dtr_pipe *p) { return p ? p->P * p->v : 0; }

/* dtr_optimizer_config.norm_sum: over the pipeline's group (every stage's rank) */
static dtr_result dtr__pipe_norm_sum(void *user, double *vals, int n) {
    dtr_pipe *p = (dtr_pipe *)user;
    return dtr__comm_sum_doubles(p->c, p->ctx, vals, n, "pipeline: the gradient norm over the stages");
}

dtr_result dtr_pipe_optimizer_config(dtr_pipe *p, dtr_optimizer_config *oc) {
    if (!p || !oc) return DTR_NULL_HANDLE;
    oc->norm_sum = p->P > 1 ? dtr__pipe_norm_sum : NULL;
    oc->norm_sum_user = oc->norm_sum ? p : NULL;
    return DTR_OK;
}

dtr_result dtr_pipe_microbatch_range(const dtr_pipe *p, int mb, int64_t *begin, int64_t *end) {
    if (!p || !begin || !end) return DTR_NULL_HANDLE;
    if (mb < 0 || mb >= p->M || p->cfg.batch <= 0)
        return dtr__fail(p->ctx, DTR_INVALID_ARGUMENT, "dtr_pipe_microbatch_range: micro-batch %d of %d%s", mb, p->M,
                         p->cfg.batch <= 0 ? " (cfg.batch is not set)" : "");
    *begin = p->cfg.batch * mb / p->M;
    *end = p->cfg.batch * (mb + 1) / p->M;
    return DTR_OK;
}

dtr_result dtr_pipe_get_stats(const dtr_pipe *p, dtr_pipe_stats *out) {
    if (!p || !out) return DTR_NULL_HANDLE;
    *out = p->stats;
    return DTR_OK;
}

/* ---- slots ---- */

/* 1 when every send of the slot is complete (their requests freed); errors go to *r */
static int dtr__pipe_sent(dtr__pipe_slot *s, dtr_result *r) {
    int k, done = 1, d;
    for (k = 0; k < 3; k++) {
        if (!s->req[k]) continue;
        d = 0;
        if ((*r = dtr_request_test(s->req[k], &d)) != DTR_OK) return 0;
        if (!d) { done = 0; continue; }
        dtr_request_destroy(s->req[k]);
        s->req[k] = NULL;
    }
    return done;
}

/* A free slot (backward done, sends complete, tape reset); a new one when none is. */
static dtr__pipe_slot *dtr__pipe_acquire(dtr_pipe *p, dtr_result *r) {
    dtr__pipe_slot *s, **grown;
    int i;
    *r = DTR_OK;
    for (i = 0; i < p->n_slots; i++) {
        s = p->slots[i];
        if (!s->busy && dtr__pipe_sent(s, r)) { dtr_tape_reset(s->tape); return s; }
        if (*r != DTR_OK) return NULL;
    }
    grown = (dtr__pipe_slot **)dtr__realloc(&p->ctx->alloc, p->slots, (size_t)(p->n_slots + 1) * sizeof(*grown));
    s = (dtr__pipe_slot *)dtr__calloc(&p->ctx->alloc, sizeof(*s));
    if (grown) p->slots = grown;
    if (!grown || !s || (*r = dtr_tape_create(p->ctx, &s->tape)) != DTR_OK) {
        dtr__free(&p->ctx->alloc, s);
        if (*r == DTR_OK) *r = dtr__fail(p->ctx, DTR_OUT_OF_MEMORY, "dtr_pipe_step: out of memory");
        return NULL;
    }
    p->slots[p->n_slots++] = s;
    return s;
}

/* The slot's host buffer k (0: the input received, 1: the output sent, 2: a gradient), grown
   to `bytes`; NULL with the error recorded. Its last send finished before the slot was
   acquired, so it is free. */
static void *dtr__pipe_host(dtr_pipe *p, dtr__pipe_slot *s, int k, size_t bytes) {
    void *nb;
    if (s->host_cap[k] >= bytes && s->host[k]) return s->host[k];
    nb = dtr__realloc(&p->ctx->alloc, s->host[k], bytes ? bytes : 1);
    if (!nb) {
        dtr__fail(p->ctx, DTR_OUT_OF_MEMORY, "dtr_pipe_step: out of memory");
        return NULL;
    }
    s->host[k] = nb;
    s->host_cap[k] = bytes;
    return nb;
}

/* ---- one forward and one backward ---- */

static int dtr__pipe_first(const dtr_pipe *p, int chunk) { return chunk == 0 && p->rank == 0; }
static int dtr__pipe_last(const dtr_pipe *p, int chunk) { return chunk == p->v - 1 && p->rank == p->P - 1; }
static int dtr__pipe_next(const dtr_pipe *p) { return (p->rank + 1) % p->P; }
static int dtr__pipe_prev(const dtr_pipe *p) { return (p->rank + p->P - 1) % p->P; }

static dtr_result dtr__pipe_comm_fail(dtr_pipe *p, dtr_result r, const char *what, int chunk, int mb) {
    return dtr__fail(p->ctx, r, "dtr_pipe_step: stage %d, micro-batch %d: %s: %s", dtr_pipe_stage(p, chunk), mb, what,
                     dtr_comm_last_error(p->c));
}

/* a blocking receive, its time counted as waiting */
static dtr_result dtr__pipe_recv(dtr_pipe *p, void *buf, size_t bytes, int src, int tag) {
    int64_t t0 = dtr_time_ns();
    dtr_result r = dtr_comm_recv(p->c, buf, bytes, src, tag);
    p->stats.wait_s += (double)(dtr_time_ns() - t0) * 1e-9;
    return r;
}

/* receives the activation header for (chunk, mb) and makes the input tensor on the slot's tape */
static dtr_result dtr__pipe_recv_input(dtr_pipe *p, dtr__pipe_slot *s, int chunk, int mb) {
    int64_t hdr[DTR__PIPE_HDR], dt;
    int tag = p->cfg.tag + 3 * chunk, d;
    size_t bytes;
    void *dst;
    dtr_result r = dtr__pipe_recv(p, hdr, sizeof hdr, dtr__pipe_prev(p), tag);
    if (r != DTR_OK) return dtr__pipe_comm_fail(p, r, "receiving an activation's shape", chunk, mb);
    if (hdr[0] < 1 || hdr[0] > DTR_MAX_DIMS) goto bad;
    for (d = 1; d <= hdr[0]; d++)
        if (hdr[d] < 1 || hdr[d] > ((int64_t)1 << 31)) goto bad;
    dt = hdr[DTR__PIPE_HDR - 1];   /* compared whole: an int64 off the wire */
    if (dt != DTR_F32 && dt != DTR_BF16 && dt != DTR_F16) goto bad;
    s->in = dtr_tensor_new(p->ctx, (dtr_dtype)dt, (int)hdr[0], hdr + 1);
    if (!s->in) return p->ctx->status;
    bytes = (size_t)dtr_tensor_numel(s->in) * dtr_dtype_size(s->in->dtype);
    dst = p->staged ? dtr__pipe_host(p, s, 0, bytes) : dtr__data(s->in);
    if (!dst) return p->ctx->status;
    r = dtr__pipe_recv(p, dst, bytes, dtr__pipe_prev(p), tag + 1);
    if (r != DTR_OK) return dtr__pipe_comm_fail(p, r, "receiving an activation", chunk, mb);
    if (p->staged && (r = p->ctx->backend->from_host(p->ctx, dtr__data(s->in), dst, bytes)) != DTR_OK) return r;
    dtr_tensor_requires_grad(s->in);
    return DTR_OK;
bad:
    return dtr__fail(p->ctx, DTR_INVALID_ARGUMENT, "dtr_pipe_step: stage %d, micro-batch %d: malformed activation "
                     "header from rank %d (ndim %lld, dtype %lld)", dtr_pipe_stage(p, chunk), mb, dtr__pipe_prev(p),
                     (long long)hdr[0], (long long)hdr[DTR__PIPE_HDR - 1]);
}

static dtr_result dtr__pipe_send(dtr_pipe *p, dtr__pipe_slot *s, int k, const void *buf, size_t bytes, int dst, int tag) {
    p->stats.bytes_sent += (int64_t)bytes;
    return dtr_comm_send_async(p->c, buf, bytes, dst, tag, &s->req[k]);
}

/* sends the output of (chunk, mb) to the next stage: header, then data */
static dtr_result dtr__pipe_send_output(dtr_pipe *p, dtr__pipe_slot *s, int chunk, int mb) {
    int next_chunk = chunk + (p->rank == p->P - 1), tag = p->cfg.tag + 3 * next_chunk, d;
    dtr_result r;
    size_t bytes;
    void *src;
    if (!dtr_tensor_is_contiguous(s->out) && !(s->out = dtr_contiguous(p->ctx, s->out))) return p->ctx->status;
    bytes = (size_t)dtr_tensor_numel(s->out) * dtr_dtype_size(s->out->dtype);
    src = dtr__data(s->out);
    s->hdr[0] = dtr_tensor_ndim(s->out);
    for (d = 0; d < DTR_MAX_DIMS; d++) s->hdr[1 + d] = d < s->hdr[0] ? dtr_tensor_dim(s->out, d) : 0;
    s->hdr[DTR__PIPE_HDR - 1] = s->out->dtype;   /* 16-bit activations travel as they are */
    if (p->staged) {   /* the activation through the slot's host copy */
        if (!(src = dtr__pipe_host(p, s, 1, bytes))) return p->ctx->status;
        if ((r = p->ctx->backend->to_host(p->ctx, src, dtr__data(s->out), bytes)) != DTR_OK) return r;
    }
    r = dtr__pipe_send(p, s, 0, s->hdr, sizeof s->hdr, dtr__pipe_next(p), tag);
    if (r == DTR_OK) r = dtr__pipe_send(p, s, 1, src, bytes, dtr__pipe_next(p), tag + 1);
    return r == DTR_OK ? DTR_OK : dtr__pipe_comm_fail(p, r, "sending an activation", chunk, mb);
}

/* the weight of micro-batch mb in the batch's mean loss */
static float dtr__pipe_weight(const dtr_pipe *p, int mb) {
    int64_t b, e;
    if (p->cfg.batch <= 0) return 1.0f / (float)p->M;
    dtr_pipe_microbatch_range(p, mb, &b, &e);
    return (float)(e - b) / (float)p->cfg.batch;
}

/* checks the stage's output; the last stage's loss is counted, the others' sent on */
static dtr_result dtr__pipe_take_output(dtr_pipe *p, dtr__pipe_slot *s, int chunk, int mb) {
    int stage = dtr_pipe_stage(p, chunk);
    if (!s->out)
        return p->ctx->status != DTR_OK ? p->ctx->status
                                        : dtr__fail(p->ctx, DTR_INVALID_ARGUMENT, "dtr_pipe_step: the forward of stage %d "
                                                    "returned NULL for micro-batch %d", stage, mb);
    if (!dtr__is_float(dtr_tensor_dtype(s->out)))
        return dtr__fail(p->ctx, DTR_DTYPE_MISMATCH, "dtr_pipe_step: the forward of stage %d returned %s for micro-batch %d "
                         "(stages exchange f32, bf16 or f16)", stage, dtr_dtype_name(dtr_tensor_dtype(s->out)), mb);
    if (!dtr__pipe_last(p, chunk)) return dtr__pipe_send_output(p, s, chunk, mb);
    if (dtr_tensor_numel(s->out) != 1)
        return dtr__fail(p->ctx, DTR_SHAPE_MISMATCH, "dtr_pipe_step: the last stage must return a scalar loss, not %lld "
                         "values", (long long)dtr_tensor_numel(s->out));
    p->loss += (double)dtr__pipe_weight(p, mb) * dtr_tensor_get(s->out, 0);
    return DTR_OK;
}

static dtr_result dtr__pipe_forward(dtr_pipe *p, int chunk, int mb) {
    dtr_result r;
    dtr__pipe_slot *s = dtr__pipe_acquire(p, &r);
    dtr_tape *was;
    if (!s) return r;
    was = dtr_context_set_tape(p->ctx, s->tape);
    s->in = NULL;
    r = dtr__pipe_first(p, chunk) ? DTR_OK : dtr__pipe_recv_input(p, s, chunk, mb);
    if (r == DTR_OK) {
        s->out = p->cfg.forward(p->cfg.user, p->ctx, chunk, mb, s->in);
        r = dtr__pipe_take_output(p, s, chunk, mb);
    }
    dtr_context_set_tape(p->ctx, was);
    s->busy = 1;
    p->live[chunk * p->M + mb] = s;
    if (++p->live_now > p->stats.max_live) p->stats.max_live = p->live_now;
    return r;
}

/* sends the gradient of the slot's input to the previous stage (zeros if it got none) */
static dtr_result dtr__pipe_send_grad(dtr_pipe *p, dtr__pipe_slot *s, int chunk, int mb) {
    int64_t n = dtr_tensor_numel(s->in);
    const float *g = dtr_tensor_grad(s->in);
    float *h;
    dtr_result r;
    if (p->staged) {   /* through the slot's host copy (zeros when the input got no gradient) */
        if (!(h = (float *)dtr__pipe_host(p, s, 2, (size_t)n * sizeof(float)))) return p->ctx->status;
        if (!g) memset(h, 0, (size_t)n * sizeof(float));
        else if ((r = p->ctx->backend->to_host(p->ctx, h, g, (size_t)n * sizeof(float))) != DTR_OK) return r;
        g = h;
    } else if (!g) {
        dtr_tape *was = dtr_context_set_tape(p->ctx, s->tape);
        dtr_tensor *z = dtr_tensor_zeros(p->ctx, DTR_F32, 1, &n);
        dtr_context_set_tape(p->ctx, was);
        if (!z) return p->ctx->status;
        g = dtr__f32(z);
    }
    r = dtr__pipe_send(p, s, 2, g, (size_t)n * sizeof(float), dtr__pipe_prev(p), p->cfg.tag + 3 * chunk + 2);
    return r == DTR_OK ? DTR_OK : dtr__pipe_comm_fail(p, r, "sending a gradient", chunk, mb);
}

static dtr_result dtr__pipe_backward(dtr_pipe *p, int chunk, int mb, int last_backward) {
    dtr__pipe_slot *s = p->live[chunk * p->M + mb];
    dtr_result r = DTR_OK;
    float seed = dtr__pipe_weight(p, mb), *g = &seed;
    if (p->cfg.dp && (r = dtr_dp_set_no_sync(p->cfg.dp, !last_backward)) != DTR_OK) return r;
    if (!dtr__pipe_last(p, chunk)) {   /* the gradient of the output: into host memory, or a tensor's */
        dtr_tape *was = dtr_context_set_tape(p->ctx, s->tape);
        int64_t n = dtr_tensor_numel(s->out);
        dtr_tensor *gt = p->staged ? NULL : dtr_tensor_new(p->ctx, DTR_F32, 1, &n);
        dtr_context_set_tape(p->ctx, was);
        g = p->staged ? (float *)dtr__pipe_host(p, s, 2, (size_t)n * sizeof(float)) : gt ? dtr__f32(gt) : NULL;
        if (!g) return p->ctx->status;
        r = dtr__pipe_recv(p, g, (size_t)n * sizeof(float), dtr__pipe_next(p), p->cfg.tag + 3 * (chunk + (p->rank == p->P - 1)) + 2);
        if (r != DTR_OK) return dtr__pipe_comm_fail(p, r, "receiving a gradient", chunk, mb);
    }
    /* a gradient received into a tensor (not staged) is the backend's memory */
    if ((r = dtr__backward_from(p->ctx, s->out, g, !p->staged && g != &seed)) != DTR_OK) return r;
    if (s->in && (r = dtr__pipe_send_grad(p, s, chunk, mb)) != DTR_OK) return r;
    s->busy = 0;
    p->live[chunk * p->M + mb] = NULL;
    p->live_now--;
    return DTR_OK;
}

/* ---- the step ---- */

/* waits for every send and frees every micro-batch's tape; the first error wins */
static dtr_result dtr__pipe_drain(dtr_pipe *p, dtr_result r) {
    int i, k;
    for (i = 0; i < p->n_slots; i++) {
        dtr__pipe_slot *s = p->slots[i];
        for (k = 0; k < 3; k++) {
            dtr_result w = s->req[k] ? dtr_request_wait(s->req[k]) : DTR_OK;
            if (r == DTR_OK && w != DTR_OK) r = dtr__pipe_comm_fail(p, w, "completing a send", 0, -1);
            dtr_request_destroy(s->req[k]);
            s->req[k] = NULL;
        }
        s->busy = 0;
        dtr_tape_reset(s->tape);
    }
    memset(p->live, 0, (size_t)(p->v * p->M) * sizeof(*p->live));
    p->live_now = 0;
    return r;
}

static dtr_result dtr__pipe_run_plan(dtr_pipe *p) {
    int n = 2 * p->v * p->M, i, last_b = n - 1;
    dtr_result r = DTR_OK;
    while (last_b > 0 && p->plan[last_b].fwd) last_b--;
    for (i = 0; i < n && r == DTR_OK; i++) {
        const dtr__pipe_action *a = &p->plan[i];
        r = a->fwd ? dtr__pipe_forward(p, a->chunk, a->mb) : dtr__pipe_backward(p, a->chunk, a->mb, i == last_b);
    }
    return r;
}

dtr_result dtr_pipe_step(dtr_pipe *p, float *loss) {
    int64_t t0;
    float l;
    dtr_result r;
    if (!p) return DTR_NULL_HANDLE;
    if (p->ctx->status != DTR_OK) return p->ctx->status;
    t0 = dtr_time_ns();
    p->loss = 0.0;
    p->stats.wait_s = 0.0;
    p->stats.bytes_sent = 0;
    p->stats.max_live = 0;
    r = dtr__pipe_run_plan(p);
    if (r == DTR_OK && p->cfg.dp) r = dtr_dp_finish(p->cfg.dp);
    if (r != DTR_OK && dtr_comm_status(p->c) == DTR_OK) dtr_comm_abort(p->c, dtr_context_last_error(p->ctx));
    r = dtr__pipe_drain(p, r);
    l = (float)p->loss;
    if (r == DTR_OK && (r = dtr_comm_broadcast(p->c, &l, 1, DTR_F32, p->P - 1)) != DTR_OK)
        r = dtr__pipe_comm_fail(p, r, "sharing the loss", p->v - 1, -1);
    if (r == DTR_OK && loss) *loss = l;
    p->stats.step_s = (double)(dtr_time_ns() - t0) * 1e-9;
    p->stats.bubble = p->stats.step_s > 0 ? p->stats.wait_s / p->stats.step_s : 0.0;
    p->stats.bubble_theory = (double)(p->P - 1) / (double)(p->v * p->M + p->P - 1);
    return r;
}
