/* ============================================================================
 * Parameter servers (docs/parameter-server.md). Ranks 0..S-1 of the engine's group are
 * servers, the others workers. Server s owns floats [range[s], range[s + 1]) of the model's
 * parameter buffer and its optimizer state; workers push gradients and pull parameters.
 *
 * Wire: a worker sends requests (PUSH, PULL, DONE: src/engine/ps.h) on tag REQ, in order;
 * a server listens with one receive per worker and answers a PULL on tag REP when the mode
 * allows (SYNC: its clock reached the one wanted; SSP: the slowest live worker within s
 * clocks; ASYNC: at once). A worker posts the receive of the reply before it asks, so the
 * server's replies never wait on a worker's progress.
 *
 * The server's own group (a split of the application's) has a deadline far away: a listening
 * receive may wait as long as a worker computes. The engine keeps its own deadline instead
 * (worker_deadline_ms, on the workers a server waits on), so that no wait is unbounded.
 * ==========================================================================*/
#include "../public/api.h"
#include "../public/api_comm.h"
#include "../public/api_engine.h"
#include "../core/internal.h"
#include "compress.h"
#include "ps.h"
#include <errno.h>
#include <sys/stat.h>

#define DTR__PS_LISTEN_MS (24 * 3600 * 1000)   /* the server group's deadline: a day */

enum { DTR__PS_LIVE = 0, DTR__PS_FINISHED = 1, DTR__PS_DROPPED = 2 };

typedef struct dtr__ps_peer {  /* a server's view of one worker */
    uint8_t *in, *out;         /* the listening receive's buffer, the reply's */
    uint8_t *held;             /* SYNC: a buffer like `in` holding this round's push (f32 after the header) */
    dtr_request *rreq, *sreq;
    int state, pushed, waiting, dead;
    int snap_out;              /* sreq sends the shared reply (ps->snap) */
    int64_t clock, want, last_ns;
    int64_t seen;              /* replicas, ASYNC / SSP: the clock after its last push (resent pushes are duplicates) */
} dtr__ps_peer;

struct dtr_ps {
    dtr_model *m;
    dtr_context *ctx;
    dtr_comm *g;               /* the engine's group (a split of the application's) */
    dtr_ps_config cfg;
    int S, W, server, index;
    int NS;                    /* server ranks: S (1 + replicas); workers are ranks NS.. */
    int64_t *range;            /* S + 1 offsets */
    int64_t maxlen;            /* the longest range */
    dtr_ps_stats st;
    /* server */
    dtr_optimizer *opt;
    dtr__ps_peer *peer;
    float *scratch;            /* a range of floats: decoded rows */
    dtr_request **waitq;       /* 2W + 1: what an idle server waits on */
    uint8_t *snap;             /* the sealed reply at clock snap_clock, sent to every worker it suits */
    int64_t snap_clock;        /* -1: none */
    int snap_users;            /* replies in flight from snap */
    int64_t clock, last_any_ns;
    int summed;                /* ASYNC / SSP: pushes summed into the gradient range since the last update */
    int backup_role;           /* replicas: a backup that has not taken over (it follows its primary) */
    int has_backup;            /* replicas: a primary whose backup is alive */
    uint8_t *repl_in;          /* backup: the forwarded message */
    dtr_request *repl_req;     /* backup: its receive */
    /* worker */
    int *target;               /* S: the rank serving each range (its primary, after a failover its backup) */
    uint8_t **msg, **rep;      /* S request and S reply buffers */
    int64_t *sclock;           /* SYNC: each server's clock at the last pull */
    int64_t wclock;            /* pushes made */
    int wire;                  /* a push's payload dtype: push_dtype, or push_compress's (DTR__PS_INT8: blocks) */
    float *resid;              /* INT8: error feedback, what the blocks lost (numel floats) */
    int pushed;                /* a push since the last pull */
    float *stage;              /* a model in device memory: the host copy of its gradients (numel floats) */
    /* server checkpoints (cfg.checkpoint_dir) */
    dtr_ckpt *ck;
    int64_t ck_range[3];       /* the "range" entry: begin, end, the model's floats */
    int64_t ck_saved;          /* the update count of the last checkpoint started (or resumed) */
};

static const size_t dtr__ps_hdr_bytes = sizeof(dtr__ps_hdr);

/* ---- configuration ---- */

dtr_ps_config dtr_ps_config_init(void) {
    dtr_ps_config c;
    memset(&c, 0, sizeof c);
    c.mode = DTR_PS_SYNC;
    c.staleness = 2;
    c.opt = dtr_optimizer_config_init(DTR_OPT_SGD, 0.01f);
    c.push_dtype = DTR_F32;
    c.worker_deadline_ms = 60000;
    c.policy = DTR_PS_FAIL;
    return c;
}

int dtr_ps_servers_from_env(int fallback) {
    const char *s = getenv("DTR_PS_SERVERS");
    char *end = NULL;
    long v;
    if (!s || !*s) return fallback;
    v = strtol(s, &end, 10);
    return (*end == 0 && v > 0 && v < 65536) ? (int)v : fallback;
}

static void dtr__ps_log(const dtr_ps *ps, dtr_log_level lv, const char *fmt, ...) DTR__PRINTF(3, 4);
static void dtr__ps_log(const dtr_ps *ps, dtr_log_level lv, const char *fmt, ...) {
    char msg[320];
    va_list ap;
    if (!ps->cfg.log) return;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    ps->cfg.log(ps->cfg.log_user, lv, msg);
}

/* ---- the wire ---- */

uint64_t dtr__ps_trailer(const dtr__ps_hdr *h) {
    return ((uint64_t)h->clock * 0x9E3779B97F4A7C15ull) ^ ((uint64_t)h->magic << 16) ^ h->kind;
}

/* bytes of n values of wire dtype dt (0 <= n <= 2^40); 0 and *ok = 0 for an unknown dtype */
static size_t dtr__ps_payload_bytes(int dt, int64_t n, int *ok) {
    size_t es = dt == DTR__PS_INT8 ? 1 : dtr_dtype_size((dtr_dtype)dt);
    *ok = es > 0;
    if (dt == DTR__PS_INT8) return (size_t)n + (size_t)((n + DTR__PS_INT8_BLOCK - 1) / DTR__PS_INT8_BLOCK) * sizeof(float);
    return (size_t)n * es;
}

size_t dtr__ps_message_bytes(const dtr__ps_hdr *h) {
    int rows = h->kind == DTR__PS_PUSH_ROWS || h->kind == DTR__PS_PULL_ROWS, ok = 1;
    int values = h->kind == DTR__PS_PUSH || h->kind == DTR__PS_REPLY || h->kind == DTR__PS_PUSH_ROWS;
    size_t pay, segs = 0;
    if (h->kind < DTR__PS_PUSH || h->kind > DTR__PS_DROP || h->count < 0 || h->count > ((int64_t)1 << 40)) return 0;
    pay = values ? dtr__ps_payload_bytes(h->dtype, h->count, &ok) : 0;
    if (!ok) return 0;
    if (!values && !rows && h->count != 0) return 0;
    if (rows && (h->begin < 1 || h->begin > DTR__PS_MAX_SEGMENTS)) return 0;
    if (rows) segs = (size_t)h->begin * 16;
    return sizeof *h + segs + pay + 8;
}

/* worker: the gradients the pushes read: the model's, or a device model's host copy */
static const float *dtr__ps_grads(const dtr_ps *ps) { return ps->stage ? ps->stage : dtr_model_grads(ps->m); }

/* worker: floats [b, b + n) of the gradients into the host copy (a device model's; else nothing) */
static dtr_result dtr__ps_stage(dtr_ps *ps, int64_t b, int64_t n) {
    if (!ps->stage || n <= 0) return DTR_OK;
    return ps->ctx->backend->to_host(ps->ctx, ps->stage + b, dtr_model_grads(ps->m) + b, (size_t)n * sizeof(float));
}

/* worker: n pulled floats into the model's parameters at b (a device model's through the backend) */
static dtr_result dtr__ps_put_params(dtr_ps *ps, int64_t b, const void *src, int64_t n) {
    float *p = dtr_model_params(ps->m) + b;
    if (ps->stage) return ps->ctx->backend->from_host(ps->ctx, p, src, (size_t)n * sizeof(float));
    memcpy(p, src, (size_t)n * sizeof(float));
    return DTR_OK;
}

/* worker: range s's gradient into msg[s]'s payload in wire dtype dt; INT8 adds the residual
   of error feedback first and keeps what the blocks lost in it */
static void dtr__ps_encode(dtr_ps *ps, int s, int dt) {
    int64_t b = ps->range[s], len = ps->range[s + 1] - b, c;
    const float *g = dtr__ps_grads(ps) + b;
    uint8_t *out = ps->msg[s] + dtr__ps_hdr_bytes;
    float *acc = ps->resid + b;   /* allocated with the INT8 wire */
    if (dt != DTR__PS_INT8) {
        dtr_convert(out, (dtr_dtype)dt, g, DTR_F32, (size_t)len);
        return;
    }
    DTR__ELEMENTWISE(0, len, acc[i] += g[i]);
    for (c = 0; c < len; c += DTR__PS_INT8_BLOCK) {
        int64_t n = len - c < DTR__PS_INT8_BLOCK ? len - c : DTR__PS_INT8_BLOCK;
        dtr__int8_encode(acc + c, n, out + c / DTR__PS_INT8_BLOCK * (DTR__PS_INT8_BLOCK + sizeof(float)), acc + c);
    }
}

/* server: a push's len values of wire dtype dt into f32 at dst */
static void dtr__ps_decode(float *dst, const uint8_t *payload, int dt, int64_t len) {
    int64_t c;
    if (dt != DTR__PS_INT8) {
        dtr_convert(dst, DTR_F32, payload, (dtr_dtype)dt, (size_t)len);
        return;
    }
    for (c = 0; c < len; c += DTR__PS_INT8_BLOCK) {
        const uint8_t *blk = payload + c / DTR__PS_INT8_BLOCK * (DTR__PS_INT8_BLOCK + sizeof(float));
        const int8_t *q = (const int8_t *)(blk + sizeof(float));
        int64_t n = len - c < DTR__PS_INT8_BLOCK ? len - c : DTR__PS_INT8_BLOCK;
        float scale, *d = dst + c;
        memcpy(&scale, blk, sizeof scale);
        DTR__ELEMENTWISE(0, n, d[i] = scale * (float)q[i]);
    }
}

/* the segments of a ROWS message: each inside the server's range, their lengths summing to count */
static dtr_result dtr__ps_parse_segments(const uint8_t *buf, const dtr__ps_hdr *h, const dtr__ps_expect *e, char *why,
                                         size_t whylen) {
    int64_t i, sum = 0;
    if (h->count > e->count) return dtr__errf(why, whylen, DTR_CORRUPT_FILE, "%lld row values, the range holds %lld",
                                              (long long)h->count, (long long)e->count);
    for (i = 0; i < h->begin; i++) {
        int64_t seg[2];
        memcpy(seg, buf + sizeof *h + (size_t)i * 16, 16);
        if (seg[1] < 1 || seg[0] < e->begin || seg[1] > e->count || seg[0] - e->begin > e->count - seg[1])
            return dtr__errf(why, whylen, DTR_CORRUPT_FILE, "segment %lld [%lld, +%lld) outside the range", (long long)i,
                             (long long)seg[0], (long long)seg[1]);
        sum += seg[1];
        if (sum > h->count) break;
    }
    if (sum != h->count) return dtr__errf(why, whylen, DTR_CORRUPT_FILE, "segments do not sum to %lld values", (long long)h->count);
    return DTR_OK;
}

static dtr_result dtr__ps_parse_push(const dtr__ps_hdr *h, const dtr__ps_expect *e, char *why, size_t whylen) {
    if (!dtr__is_float((dtr_dtype)h->dtype) && h->dtype != DTR__PS_INT8)
        return dtr__errf(why, whylen, DTR_CORRUPT_FILE, "push of dtype %d", (int)h->dtype);
    if (h->begin != e->begin || h->count != e->count)
        return dtr__errf(why, whylen, DTR_CORRUPT_FILE, "push of [%lld, +%lld), this server holds [%lld, +%lld)",
                         (long long)h->begin, (long long)h->count, (long long)e->begin, (long long)e->count);
    return DTR_OK;
}

dtr_result dtr__ps_parse(const void *buf, size_t cap, int from, const dtr__ps_expect *e, dtr__ps_hdr *h, char *why,
                         size_t whylen) {
    size_t n;
    uint64_t tr;
    dtr_result r;
    if (!buf || cap < sizeof *h) return dtr__errf(why, whylen, DTR_CORRUPT_FILE, "%zu bytes: shorter than a header", cap);
    memcpy(h, buf, sizeof *h);
    if (h->magic != DTR__PS_MAGIC) return dtr__errf(why, whylen, DTR_CORRUPT_FILE, "bad magic %08x", (unsigned)h->magic);
    if (h->version != DTR__PS_VERSION) return dtr__errf(why, whylen, DTR_CORRUPT_FILE, "version %u", (unsigned)h->version);
    if (h->worker != from) return dtr__errf(why, whylen, DTR_CORRUPT_FILE, "claims to be worker %d", (int)h->worker);
    if (h->clock < 0) return dtr__errf(why, whylen, DTR_CORRUPT_FILE, "negative clock %lld", (long long)h->clock);
    if (h->kind == DTR__PS_REPLY || h->kind < DTR__PS_PUSH || h->kind > DTR__PS_PULL_ROWS)
        return dtr__errf(why, whylen, DTR_CORRUPT_FILE, "unknown kind %u", (unsigned)h->kind);
    if (h->kind == DTR__PS_PUSH && (r = dtr__ps_parse_push(h, e, why, whylen)) != DTR_OK) return r;
    if (h->kind == DTR__PS_PUSH_ROWS && h->dtype != DTR_F32 && h->dtype != DTR_BF16)
        return dtr__errf(why, whylen, DTR_CORRUPT_FILE, "push of dtype %d", (int)h->dtype);
    if ((n = dtr__ps_message_bytes(h)) == 0 || n > cap)
        return dtr__errf(why, whylen, DTR_CORRUPT_FILE, "%lld values of dtype %d do not fit %zu bytes", (long long)h->count,
                         (int)h->dtype, cap);
    memcpy(&tr, (const uint8_t *)buf + n - 8, 8);
    if (tr != dtr__ps_trailer(h)) return dtr__errf(why, whylen, DTR_CORRUPT_FILE, "truncated (no trailer after %zu bytes)", n - 8);
    if (h->kind == DTR__PS_PUSH_ROWS || h->kind == DTR__PS_PULL_ROWS)
        return dtr__ps_parse_segments((const uint8_t *)buf, h, e, why, whylen);
    return DTR_OK;
}

/* writes the trailer after the header and payload at buf; returns the message's bytes */
static size_t dtr__ps_seal(uint8_t *buf, const dtr__ps_hdr *h) {
    size_t n = dtr__ps_message_bytes(h);
    uint64_t tr = dtr__ps_trailer(h);
    memcpy(buf, h, sizeof *h);
    memcpy(buf + n - 8, &tr, 8);
    return n;
}

static dtr__ps_hdr dtr__ps_header(int kind, int who, int64_t clock, int64_t begin, int64_t count, int dtype) {
    dtr__ps_hdr h;
    memset(&h, 0, sizeof h);
    h.magic = DTR__PS_MAGIC;
    h.version = DTR__PS_VERSION;
    h.kind = (uint16_t)kind;
    h.worker = who;
    h.dtype = dtype;
    h.clock = clock;
    h.begin = begin;
    h.count = count;
    return h;
}

/* ---- creation ---- */

/* server s's range starts at s / S of the buffer, rounded down to 16 floats */
static void dtr__ps_layout(dtr_ps *ps) {
    int64_t total = dtr_model_numel(ps->m);
    int s;
    for (s = 0; s <= ps->S; s++) ps->range[s] = s == ps->S ? total : total * s / ps->S / 16 * 16;
    for (s = 0; s < ps->S; s++)
        if (ps->range[s + 1] - ps->range[s] > ps->maxlen) ps->maxlen = ps->range[s + 1] - ps->range[s];
}

/* a push's payload dtype on the wire */
static int dtr__ps_wire(const dtr_ps_config *cfg) {
    switch (cfg->push_compress) {
    case DTR_COMPRESS_INT8: return DTR__PS_INT8;
    case DTR_COMPRESS_BF16: return DTR_BF16;
    case DTR_COMPRESS_FP16: return DTR_F16;
    default: return cfg->push_dtype;
    }
}

/* what goes on the wire, and how rounds form (W workers) */
static dtr_result dtr__ps_check_rounds(dtr_context *ctx, const dtr_ps_config *cfg, int W) {
    if ((cfg->push_dtype != DTR_F32 && cfg->push_dtype != DTR_BF16) ||
        (cfg->push_dtype != DTR_F32 && cfg->push_compress != DTR_COMPRESS_NONE))
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_ps_create: push_dtype must be f32 or bf16 (f32 with push_compress)");
    if ((unsigned)cfg->push_compress > DTR_COMPRESS_POWERSGD)
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_ps_create: push_compress %d", (int)cfg->push_compress);
    if (cfg->push_compress == DTR_COMPRESS_TOPK || cfg->push_compress == DTR_COMPRESS_POWERSGD)
        return dtr__fail(ctx, DTR_UNSUPPORTED, "dtr_ps_create: push_compress top-k and PowerSGD are not in this version "
                         "(bf16, fp16 and int8 are)");
    if (cfg->backup_workers < 0 || cfg->backup_workers >= W || (cfg->backup_workers > 0 && cfg->mode != DTR_PS_SYNC))
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_ps_create: backup_workers %d (0 to workers - 1, SYNC only)",
                         cfg->backup_workers);
    if (cfg->aggregate < 0 || cfg->aggregate > 1024 || (cfg->aggregate > 1 && cfg->mode == DTR_PS_SYNC))
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_ps_create: aggregate %d (0 to 1024; above 1 only in ASYNC and "
                         "SSP: a SYNC round averages every worker already)", cfg->aggregate);
    return DTR_OK;
}

static dtr_result dtr__ps_check(dtr_context *ctx, const dtr_ps_config *cfg, int S, dtr_comm *c) {
    int size = dtr_comm_size(c);
    if (!dtr__host_memory(ctx) && dtr_comm_rank(c) < S * (1 + (cfg->replicas > 0)))
        return dtr__fail(ctx, DTR_UNSUPPORTED, "dtr_ps_create: a server keeps its range in host memory in this version "
                         "(backend %s: give the server ranks CPU contexts; workers may train on a device)",
                         ctx->backend->name);
    if (cfg->replicas < 0 || cfg->replicas > 1)
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_ps_create: replicas %d (0 or 1)", cfg->replicas);
    if (S < 1 || S * (1 + cfg->replicas) >= size || S > 64)
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_ps_create: %d servers (x%d with replicas) in a group of %d (1 to "
                         "size - 1 server ranks, at most 64 ranges)", S, 1 + cfg->replicas, size);
    if (cfg->replicas && !dtr_comm_isolates_peer_failures(c))
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_ps_create: replicas need a group whose transport isolates peer "
                         "failures (dtr_comm_config.isolate_peer_failures)");
    if ((unsigned)cfg->mode > DTR_PS_SSP || cfg->staleness < 0 || (unsigned)cfg->policy > DTR_PS_CONTINUE)
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_ps_create: mode %d, staleness %d or policy %d out of range",
                         (int)cfg->mode, cfg->staleness, (int)cfg->policy);
    if (cfg->opt.kind == DTR_OPT_LAMB || cfg->opt.clip_norm > 0 || cfg->opt.shard_sum)
        return dtr__fail(ctx, DTR_UNSUPPORTED, "dtr_ps_create: LAMB and clip_norm need the whole gradient, not a server's range");
    return dtr__ps_check_rounds(ctx, cfg, size - S * (1 + cfg->replicas));
}

/* a buffer for the messages of a range of len floats: header, f32 values (an INT8 push of a
   range under 4 floats needs its scale more), trailer */
static size_t dtr__ps_buf_bytes(int64_t len) { return dtr__ps_hdr_bytes + (size_t)(len + 1) * sizeof(float) + 8; }

static dtr_result dtr__ps_alloc_server(dtr_ps *ps) {
    dtr_allocation_callbacks *a = &ps->ctx->alloc;
    int64_t len = ps->range[ps->index + 1] - ps->range[ps->index];
    size_t cap = dtr__ps_buf_bytes(len);
    int w;
    dtr_result r;
    ps->peer = (dtr__ps_peer *)dtr__calloc(a, (size_t)ps->W * sizeof(dtr__ps_peer));
    ps->scratch = (float *)dtr__calloc(a, (size_t)(len + 1) * sizeof(float));
    ps->snap = (uint8_t *)dtr__calloc(a, cap);
    ps->snap_clock = -1;
    ps->waitq = (dtr_request **)dtr__calloc(a, (size_t)(2 * ps->W + 1) * sizeof(dtr_request *));
    if (ps->backup_role) ps->repl_in = (uint8_t *)dtr__calloc(a, cap);
    if (!ps->peer || !ps->scratch || !ps->snap || !ps->waitq || (ps->backup_role && !ps->repl_in)) return DTR_OUT_OF_MEMORY;
    for (w = 0; w < ps->W; w++) {
        dtr__ps_peer *p = &ps->peer[w];
        p->in = (uint8_t *)dtr__calloc(a, cap);
        p->out = (uint8_t *)dtr__calloc(a, cap);
        if (ps->cfg.mode == DTR_PS_SYNC) p->held = (uint8_t *)dtr__calloc(a, cap);
        if (!p->in || !p->out || (ps->cfg.mode == DTR_PS_SYNC && !p->held)) return DTR_OUT_OF_MEMORY;
    }
    if (len > 0) {
        dtr_optimizer_config oc = ps->cfg.opt;
        oc.shard_begin = ps->range[ps->index];
        oc.shard_end = ps->range[ps->index + 1];
        if ((r = dtr_optimizer_create(ps->m, &oc, &ps->opt)) == DTR_OK) dtr__optimizer_keep_grads(ps->opt);
        return r;
    }
    return DTR_OK;
}

static dtr_result dtr__ps_alloc_worker(dtr_ps *ps) {
    dtr_allocation_callbacks *a = &ps->ctx->alloc;
    size_t cap = dtr__ps_buf_bytes(ps->maxlen);
    int s;
    if (ps->wire == DTR__PS_INT8) {
        ps->resid = (float *)dtr__calloc(a, (size_t)dtr_model_numel(ps->m) * sizeof(float) + 1);
        if (!ps->resid) return DTR_OUT_OF_MEMORY;
    }
    ps->msg = (uint8_t **)dtr__calloc(a, (size_t)ps->S * sizeof(uint8_t *));
    ps->rep = (uint8_t **)dtr__calloc(a, (size_t)ps->S * sizeof(uint8_t *));
    ps->sclock = (int64_t *)dtr__calloc(a, (size_t)ps->S * sizeof(int64_t));
    ps->target = (int *)dtr__calloc(a, (size_t)ps->S * sizeof(int));
    if (!ps->msg || !ps->rep || !ps->sclock || !ps->target) return DTR_OUT_OF_MEMORY;
    for (s = 0; s < ps->S; s++) ps->target[s] = s;
    if (!dtr__host_memory(ps->ctx)) {   /* pinned on CUDA */
        ps->stage = (float *)dtr__host_alloc(ps->ctx, (size_t)dtr_model_numel(ps->m) * sizeof(float));
        if (!ps->stage) return DTR_OUT_OF_MEMORY;
    }
    for (s = 0; s < ps->S; s++) {
        ps->msg[s] = (uint8_t *)dtr__calloc(a, cap);
        ps->rep[s] = (uint8_t *)dtr__calloc(a, cap);
        if (!ps->msg[s] || !ps->rep[s]) return DTR_OUT_OF_MEMORY;
    }
    return DTR_OK;
}

static int64_t dtr__ps_len(const dtr_ps *ps) { return ps->range[ps->index + 1] - ps->range[ps->index]; }

/* ---- checkpoints of a server's range (cfg.checkpoint_dir) ----
 * Each server (and its backup) has a checkpointer of its own over <dir>/server-<s>/
 * (dtr_ckpt, no group: servers save independently, beside serving): the server's optimizer
 * (its range's state) and the "ps" object below, every checkpoint_every updates and when
 * serving ends. At dtr_ps_create every rank gathers the servers' lists of complete
 * checkpoints; a server resumes from the newest one (SYNC: the newest update count on every
 * server rank, so the ranges come from the same round), then every rank learns that every
 * server resumed. The protocol's clocks start again at 0 (workers start again too); the
 * update count goes on. */

#define DTR__PS_CK_LIST 16   /* per rank: a status, then up to 15 complete checkpoints, newest first */

/* the "ps" object: the range of the parameters, the update count, the range's bounds */
static dtr_result dtr__ps_state(void *obj, int i, dtr_state_entry *e) {
    dtr_ps *ps = (dtr_ps *)obj;
    memset(e, 0, sizeof *e);
    if (i == 0) e->name = "params", e->data = dtr_model_params(ps->m) + ps->range[ps->index];
    if (i == 0) e->bytes = (size_t)dtr__ps_len(ps) * sizeof(float);
    if (i == 1) e->name = "updates", e->data = &ps->st.updates, e->bytes = sizeof ps->st.updates;
    if (i == 2) e->name = "range", e->data = ps->ck_range, e->bytes = sizeof ps->ck_range;
    return i <= 2 ? DTR_OK : DTR_NOT_FOUND;
}

static void dtr__ps_live_range(dtr_ps *ps) {
    ps->ck_range[0] = ps->range[ps->index];
    ps->ck_range[1] = ps->range[ps->index + 1];
    ps->ck_range[2] = dtr_model_numel(ps->m);
}

/* after a restore: the checkpoint's range must be this server's */
static dtr_result dtr__ps_state_loaded(void *obj) {
    dtr_ps *ps = (dtr_ps *)obj;
    int64_t b = ps->ck_range[0], e = ps->ck_range[1], n = ps->ck_range[2];
    dtr__ps_live_range(ps);
    if (b == ps->ck_range[0] && e == ps->ck_range[1] && n == ps->ck_range[2]) return DTR_OK;
    return dtr__fail(ps->ctx, DTR_INVALID_ARGUMENT, "parameter server %d: the checkpoint holds floats [%lld, %lld) of %lld, "
                     "this server [%lld, %lld) of %lld (another model or number of servers)", ps->index, (long long)b,
                     (long long)e, (long long)n, (long long)ps->ck_range[0], (long long)ps->ck_range[1], (long long)n);
}

/* a server's checkpointer over dir, <checkpoint_dir>/server-<s>/ */
static dtr_result dtr__ps_ck_open(dtr_ps *ps, const char *dir) {
    dtr_ckpt_config cc = dtr_ckpt_config_init();
    dtr_result r;
    if (mkdir(ps->cfg.checkpoint_dir, 0777) != 0 && errno != EEXIST)
        return dtr__fail(ps->ctx, DTR_IO_ERROR, "dtr_ps_create: cannot make %s: %s", ps->cfg.checkpoint_dir, strerror(errno));
    cc.dir = dir;
    cc.ctx = ps->ctx;
    cc.optimizer = ps->opt;
    cc.keep = ps->cfg.checkpoint_keep;
    cc.busy = DTR_CKPT_BUSY_SKIP;   /* serving never waits for the disk */
    dtr__ps_live_range(ps);
    if ((r = dtr_ckpt_create(&cc, &ps->ck)) != DTR_OK) return dtr__fail(ps->ctx, r, "dtr_ps_create: cannot open %s", dir);
    return dtr_ckpt_add_object(ps->ck, "ps", ps, dtr__ps_state, dtr__ps_state_loaded);
}

/* every rank's DTR__PS_CK_LIST int64 of `mine`, gathered into *all (freed by the caller) */
static dtr_result dtr__ps_ck_gather(dtr_ps *ps, const int64_t *mine, int64_t **all) {
    size_t bytes = (size_t)DTR__PS_CK_LIST * sizeof(int64_t);
    *all = (int64_t *)dtr__calloc(&ps->ctx->alloc, (size_t)dtr_comm_size(ps->g) * bytes);
    if (!*all) return DTR_OUT_OF_MEMORY;
    return dtr_comm_all_gather(ps->g, mine, *all, bytes, DTR_U8);
}

/* the first server rank whose status (the first int64 of its list) is not DTR_OK, or -1 */
static int dtr__ps_ck_failed(const dtr_ps *ps, const int64_t *all) {
    int i;
    for (i = 0; i < ps->NS; i++)
        if (all[(size_t)i * DTR__PS_CK_LIST] != DTR_OK) return i;
    return -1;
}

/* SYNC: the newest update count in every server rank's list (-1: none) */
static int64_t dtr__ps_ck_common(const dtr_ps *ps, const int64_t *all) {
    int k, i, j, in_all;
    for (k = 1; k < DTR__PS_CK_LIST && all[k] >= 0; k++) {
        for (i = 1, in_all = 1; i < ps->NS && in_all; i++) {
            for (j = 1; j < DTR__PS_CK_LIST && all[(size_t)i * DTR__PS_CK_LIST + j] != all[k]; j++) {}
            in_all = j < DTR__PS_CK_LIST;
        }
        if (in_all) return all[k];
    }
    return -1;
}

/* a server: restores update count `step` from dir (none: a fresh start) */
static dtr_result dtr__ps_ck_restore(dtr_ps *ps, const char *dir, int64_t step) {
    char path[4200];
    dtr_result r;
    if (step < 0) return DTR_OK;
    snprintf(path, sizeof path, "%s/step-%08lld", dir, (long long)step);
    if ((r = dtr_ckpt_restore(ps->ck, path, NULL)) != DTR_OK)
        return dtr__fail(ps->ctx, r, "dtr_ps_create: server %d cannot resume from %s: %s", ps->index, path,
                         dtr_ckpt_last_error(ps->ck));
    ps->st.resumed_updates = ps->ck_saved = ps->st.updates;
    return DTR_OK;
}

/* a worker: the least update count the server ranks resumed from (their lists' second int64) */
static int64_t dtr__ps_ck_least(const dtr_ps *ps, const int64_t *all) {
    int64_t least = all[1];
    int i;
    for (i = 1; i < ps->NS; i++)
        if (all[(size_t)i * DTR__PS_CK_LIST + 1] < least) least = all[(size_t)i * DTR__PS_CK_LIST + 1];
    return least;
}

/* every rank, twice: the servers' lists, then whether each server resumed. A server's failure
   fails dtr_ps_create on every rank: its own message there, naming its rank elsewhere. */
static dtr_result dtr__ps_resume(dtr_ps *ps) {
    int64_t mine[DTR__PS_CK_LIST], *all = NULL, newest = -1;
    char dir[4096];
    dtr_result r, own = DTR_OK;
    int i, bad = -1, pass;
    snprintf(dir, sizeof dir, "%s/server-%d", ps->cfg.checkpoint_dir, ps->index);
    for (pass = 0; pass < 2 && bad < 0; pass++) {
        for (i = 0; i < DTR__PS_CK_LIST; i++) mine[i] = -1;
        if (pass == 0 && ps->server && (own = dtr__ps_ck_open(ps, dir)) == DTR_OK &&
            dtr__ckpt_steps(dir, mine + 1, DTR__PS_CK_LIST - 1) > 0)
            newest = mine[1];
        if (pass == 1 && ps->server)
            own = dtr__ps_ck_restore(ps, dir, ps->cfg.mode == DTR_PS_SYNC ? dtr__ps_ck_common(ps, all) : newest);
        mine[0] = own;
        if (pass == 1) mine[1] = ps->st.resumed_updates;
        dtr__free(&ps->ctx->alloc, all);
        if ((r = dtr__ps_ck_gather(ps, mine, &all)) != DTR_OK) {
            dtr__free(&ps->ctx->alloc, all);
            return r;
        }
        bad = dtr__ps_ck_failed(ps, all);
    }
    r = bad < 0 ? DTR_OK : (dtr_result)all[(size_t)bad * DTR__PS_CK_LIST];
    if (r == DTR_OK && !ps->server) ps->st.resumed_updates = dtr__ps_ck_least(ps, all);
    dtr__free(&ps->ctx->alloc, all);
    if (r == DTR_OK || own != DTR_OK) return own != DTR_OK ? own : DTR_OK;
    return dtr__fail(ps->ctx, r, "dtr_ps_create: parameter server rank %d could not resume from its checkpoints under %s (%s)",
                     bad, ps->cfg.checkpoint_dir, dtr_result_string(r));
}

/* a checkpoint that failed: counted and logged */
static void dtr__ps_ck_report(dtr_ps *ps) {
    ps->st.checkpoint_failures++;
    dtr__ps_log(ps, DTR_LOG_ERROR, "parameter server %d: checkpoint failed (update %lld): %s", ps->index,
                (long long)ps->st.updates, dtr_ckpt_last_error(ps->ck));
}

/* the range's checkpoint as of the update count. `final` (serving ended): after the write in
   flight (its failure reported), waits for this one and returns its error; otherwise a
   failure is reported and serving goes on. */
static dtr_result dtr__ps_checkpoint(dtr_ps *ps, int final) {
    dtr_result r;
    int started = 0;
    if (!ps->ck || ps->backup_role || ps->st.updates == ps->ck_saved) return DTR_OK;
    if (final && dtr_ckpt_wait(ps->ck) != DTR_OK) dtr__ps_ck_report(ps);
    r = dtr_ckpt_save(ps->ck, ps->st.updates, &started);
    if (r == DTR_OK && final) r = dtr_ckpt_wait(ps->ck);
    if (started) ps->st.checkpoints++, ps->ck_saved = ps->st.updates;
    if (r == DTR_OK) return DTR_OK;
    dtr__ps_ck_report(ps);
    return final ? dtr__fail(ps->ctx, r, "dtr_ps_serve: checkpoint: %s", dtr_ckpt_last_error(ps->ck)) : DTR_OK;
}

dtr_result dtr_ps_create(dtr_model *m, dtr_comm *c, const dtr_ps_config *cfg, dtr_ps **out) {
    dtr_ps_config def = dtr_ps_config_init();
    dtr_context *ctx;
    dtr_ps *ps;
    dtr_result r;
    int me;
    if (out) *out = NULL;
    if (!m || !c || !out) return DTR_NULL_HANDLE;
    ctx = dtr_model_context(m);
    if (!cfg) cfg = &def;
    def = *cfg;
    if (def.servers <= 0) def.servers = dtr_ps_servers_from_env(1);
    if (def.worker_deadline_ms <= 0) def.worker_deadline_ms = 60000;
    if (def.checkpoint_every <= 0) def.checkpoint_every = 1000;
    if (def.checkpoint_keep <= 0) def.checkpoint_keep = 3;
    if ((r = dtr__ps_check(ctx, &def, def.servers, c)) != DTR_OK) return r;
    ps = (dtr_ps *)dtr__calloc(&ctx->alloc, sizeof *ps);
    if (!ps) return dtr__fail(ctx, DTR_OUT_OF_MEMORY, "dtr_ps_create: out of memory");
    ps->m = m, ps->ctx = ctx, ps->cfg = def, ps->S = def.servers, ps->NS = def.servers * (1 + def.replicas);
    ps->W = dtr_comm_size(c) - ps->NS;
    ps->wire = dtr__ps_wire(&def);
    me = dtr_comm_rank(c);
    ps->server = me < ps->NS;
    ps->index = ps->server ? me % ps->S : me - ps->NS;
    ps->backup_role = ps->server && me >= ps->S;
    ps->has_backup = ps->server && !ps->backup_role && def.replicas > 0;
    ps->range = (int64_t *)dtr__calloc(&ctx->alloc, (size_t)(ps->S + 1) * sizeof(int64_t));
    r = ps->range ? DTR_OK : DTR_OUT_OF_MEMORY;
    if (r == DTR_OK) dtr__ps_layout(ps);
    if (r == DTR_OK) r = ps->server ? dtr__ps_alloc_server(ps) : dtr__ps_alloc_worker(ps);
    if (r == DTR_OK) r = dtr_comm_split(c, 0, me, &ps->g);
    if (r == DTR_OK && def.checkpoint_dir) r = dtr__ps_resume(ps);
    if (r == DTR_OK && ps->server) r = dtr_comm_set_timeout(ps->g, DTR__PS_LISTEN_MS);
    if (r != DTR_OK) {
        dtr_ps_destroy(ps);
        return r == DTR_OUT_OF_MEMORY ? dtr__fail(ctx, r, "dtr_ps_create: out of memory") : r;
    }
    *out = ps;
    return DTR_OK;
}

static void dtr__ps_free_bufs(dtr_ps *ps, uint8_t **b, int n) {
    int i;
    if (!b) return;
    for (i = 0; i < n; i++) dtr__free(&ps->ctx->alloc, b[i]);
    dtr__free(&ps->ctx->alloc, b);
}

/* ends worker p's reply in flight (none: nothing) */
static void dtr__ps_reply_done(dtr_ps *ps, dtr__ps_peer *p) {
    dtr_request_destroy(p->sreq);
    p->sreq = NULL;
    if (p->snap_out) ps->snap_users--;
    p->snap_out = 0;
}

/* waits for worker p's previous reply (the worker received it before it sent what came now) */
static dtr_result dtr__ps_reply_wait(dtr_ps *ps, dtr__ps_peer *p) {
    dtr_result r = p->sreq ? dtr_request_wait(p->sreq) : DTR_OK;
    dtr__ps_reply_done(ps, p);
    return r;
}

/* cancels what a server still has in flight: its listening receives would wait a day, so a
   server leaving with some aborts the group first */
static void dtr__ps_cancel(dtr_ps *ps) {
    int w, pending = 0;
    for (w = 0; w < ps->W; w++) pending += ps->peer[w].rreq != NULL || ps->peer[w].sreq != NULL;
    if ((pending || ps->repl_req) && ps->g) dtr_comm_abort(ps->g, "parameter server leaving");
    dtr_request_destroy(ps->repl_req);
    ps->repl_req = NULL;
    for (w = 0; w < ps->W; w++) {
        dtr_request_destroy(ps->peer[w].rreq);
        ps->peer[w].rreq = NULL;
        dtr__ps_reply_done(ps, &ps->peer[w]);
        dtr__free(&ps->ctx->alloc, ps->peer[w].in);
        dtr__free(&ps->ctx->alloc, ps->peer[w].out);
        dtr__free(&ps->ctx->alloc, ps->peer[w].held);
    }
}

void dtr_ps_destroy(dtr_ps *ps) {
    dtr_allocation_callbacks a;
    if (!ps) return;
    a = ps->ctx->alloc;
    if (ps->peer) dtr__ps_cancel(ps);
    dtr__free(&a, ps->peer);
    dtr__free(&a, ps->snap);
    dtr__free(&a, ps->waitq);
    dtr__free(&a, ps->scratch);
    dtr__free(&a, ps->repl_in);
    dtr__free(&a, ps->target);
    dtr_ckpt_destroy(ps->ck);
    dtr_optimizer_destroy(ps->opt);
    dtr__ps_free_bufs(ps, ps->msg, ps->S);
    dtr__ps_free_bufs(ps, ps->rep, ps->S);
    dtr__free(&a, ps->sclock);
    dtr__free(&a, ps->resid);
    if (ps->stage) dtr__host_free(ps->ctx, ps->stage);
    dtr__free(&a, ps->range);
    dtr_comm_destroy(ps->g);
    dtr__free(&a, ps);
}

dtr_comm *dtr__ps_group(dtr_ps *ps) { return ps ? ps->g : NULL; }

int dtr_ps_is_server(const dtr_ps *ps) { return ps ? ps->server : 0; }
int dtr_ps_index(const dtr_ps *ps) { return ps ? ps->index : -1; }
int dtr_ps_workers(const dtr_ps *ps) { return ps ? ps->W : 0; }

dtr_result dtr_ps_range(const dtr_ps *ps, int s, int64_t *begin, int64_t *end) {
    if (!ps || !begin || !end) return DTR_NULL_HANDLE;
    if (s < 0 || s >= ps->S) return DTR_INVALID_ARGUMENT;
    *begin = ps->range[s];
    *end = ps->range[s + 1];
    return DTR_OK;
}

dtr_result dtr_ps_get_stats(const dtr_ps *ps, dtr_ps_stats *out) {
    if (!ps || !out) return DTR_NULL_HANDLE;
    *out = ps->st;
    return DTR_OK;
}

/* ---- server ---- */

/* a server's receive and reply buffers: the largest message it takes or sends */
static size_t dtr__ps_cap(const dtr_ps *ps) { return dtr__ps_buf_bytes(dtr__ps_len(ps)); }

static dtr_result dtr__ps_worker_gone(dtr_ps *ps, int w, dtr_result r);

static dtr_result dtr__ps_listen(dtr_ps *ps, int w) {
    dtr_result r = dtr_comm_recv_async(ps->g, ps->peer[w].in, dtr__ps_cap(ps), ps->NS + w, DTR__PS_TAG_REQ, &ps->peer[w].rreq);
    return r == DTR_OK ? DTR_OK : dtr__ps_worker_gone(ps, w, r);
}

/* the smallest clock of the live workers (INT64_MAX when none is live) */
static int64_t dtr__ps_min_clock(const dtr_ps *ps) {
    int64_t lo = INT64_MAX;
    int w;
    for (w = 0; w < ps->W; w++)
        if (ps->peer[w].state == DTR__PS_LIVE && ps->peer[w].clock < lo) lo = ps->peer[w].clock;
    return lo;
}

static void dtr__ps_count_staleness(dtr_ps *ps, int64_t st) {
    if (st < 0) st = 0;
    ps->st.staleness[st < DTR_PS_STALENESS_BINS - 1 ? st : DTR_PS_STALENESS_BINS - 1]++;
    if (st > ps->st.max_staleness) ps->st.max_staleness = st;
}

/* one optimizer update of this server's range with the gradient in the model's buffer */
static dtr_result dtr__ps_apply(dtr_ps *ps) {
    int64_t b = ps->range[ps->index], len = dtr__ps_len(ps);
    dtr_result r = len > 0 ? dtr_optimizer_step_range(ps->opt, b, b + len, NULL) : DTR_OK;
    ps->clock++;
    ps->st.updates++;
    if (r == DTR_OK && ps->ck && ps->st.updates % ps->cfg.checkpoint_every == 0) r = dtr__ps_checkpoint(ps, 0);
    return r;
}

/* SYNC: the round's n pushes into g (len floats), summed in worker order and divided by n, a
   cache-sized chunk at a time */
static void dtr__ps_average(dtr_ps *ps, float *g, int64_t len, int n) {
    int64_t c, e;
    int w, k;
    for (c = 0; c < len; c = e) {
        e = c + 4096 < len ? c + 4096 : len;
        for (w = 0, k = 0; w < ps->W; w++) {
            const float *x = (const float *)(ps->peer[w].held + dtr__ps_hdr_bytes);
            if (!ps->peer[w].pushed) continue;
            if (k++ == 0) memcpy(g + c, x + c, (size_t)(e - c) * sizeof(float));
            else DTR__ELEMENTWISE(c, e, g[i] += x[i]);
        }
        DTR__ELEMENTWISE(c, e, g[i] /= (float)n);
    }
}

/* SYNC: once every live worker but cfg.backup_workers pushed this round: their average,
   summed in worker order */
static dtr_result dtr__ps_round(dtr_ps *ps) {
    int w, n = 0, missing = 0;
    for (w = 0; w < ps->W; w++) {
        missing += ps->peer[w].state == DTR__PS_LIVE && !ps->peer[w].pushed;
        n += ps->peer[w].pushed;
    }
    if (n == 0 || missing > ps->cfg.backup_workers) return DTR_OK;
    dtr__ps_average(ps, dtr_model_grads(ps->m) + ps->range[ps->index], dtr__ps_len(ps), n);
    for (w = 0; w < ps->W; w++) ps->peer[w].pushed = 0;
    ps->st.pushes_applied += n;
    return dtr__ps_apply(ps);
}

/* ASYNC / SSP: the summed pushes' average is one update (their sum is in the gradient range) */
static dtr_result dtr__ps_apply_summed(dtr_ps *ps) {
    float *g = dtr_model_grads(ps->m) + ps->range[ps->index];
    int k = ps->summed;
    if (k == 0) return DTR_OK;
    if (k > 1) DTR__ELEMENTWISE(0, dtr__ps_len(ps), g[i] /= (float)k);
    ps->st.pushes_applied += k;
    ps->summed = 0;
    return dtr__ps_apply(ps);
}

/* ASYNC / SSP: a push's payload into the gradient range (the first of an update written, the
   others added in arrival order); every cfg.aggregate pushes make one update */
static dtr_result dtr__ps_accumulate(dtr_ps *ps, const uint8_t *payload, int dtype) {
    float *g = dtr_model_grads(ps->m) + ps->range[ps->index];
    const float *x = (const float *)payload;
    int64_t len = dtr__ps_len(ps);
    if (ps->summed == 0) {
        dtr__ps_decode(g, payload, dtype, len);
    } else {
        if (dtype != DTR_F32) dtr__ps_decode(ps->scratch, payload, dtype, len), x = ps->scratch;
        DTR__ELEMENTWISE(0, len, g[i] += x[i]);
    }
    return ++ps->summed >= ps->cfg.aggregate ? dtr__ps_apply_summed(ps) : DTR_OK;
}

static dtr_result dtr__ps_on_push(dtr_ps *ps, int w, const dtr__ps_hdr *h) {
    dtr__ps_peer *p = &ps->peer[w];
    int64_t len = dtr__ps_len(ps);
    const uint8_t *payload = p->in + dtr__ps_hdr_bytes;
    if (ps->cfg.mode == DTR_PS_SYNC) {
        if (h->clock != ps->clock || p->pushed) {   /* with backup workers, expected: the round went without it */
            ps->st.stale_discarded++;
            dtr__ps_log(ps, ps->cfg.backup_workers ? DTR_LOG_DEBUG : DTR_LOG_WARN, "parameter server %d: push of worker "
                        "%d for step %lld discarded (round %lld)", ps->index, w, (long long)h->clock, (long long)ps->clock);
            return DTR_OK;
        }
        if (h->dtype == DTR_F32) {   /* the message is the slot: the next one goes to the other buffer */
            uint8_t *t = p->held;
            p->held = p->in, p->in = t;
        } else
            dtr__ps_decode((float *)(p->held + dtr__ps_hdr_bytes), payload, h->dtype, len);
        p->pushed = 1;
        p->clock = h->clock + 1;
        dtr__ps_count_staleness(ps, 0);
        return dtr__ps_round(ps);
    }
    if (ps->cfg.replicas && h->clock < p->seen) {   /* a push resent after a failover: held already */
        ps->st.stale_discarded++;
        return DTR_OK;
    }
    p->seen = h->clock + 1;
    dtr__ps_count_staleness(ps, h->clock - dtr__ps_min_clock(ps));
    if (h->clock + 1 > p->clock) p->clock = h->clock + 1;
    return dtr__ps_accumulate(ps, payload, h->dtype);
}

/* a dropped worker that speaks again */
static void dtr__ps_rejoin(dtr_ps *ps, int w, const dtr__ps_hdr *h) {
    dtr__ps_peer *p = &ps->peer[w];
    int64_t lo = dtr__ps_min_clock(ps);
    p->state = DTR__PS_LIVE;
    p->pushed = 0;
    p->clock = ps->cfg.mode == DTR_PS_SYNC ? ps->clock : (lo == INT64_MAX || h->clock > lo ? h->clock : lo);
    ps->st.rejoined++;
    dtr__ps_log(ps, DTR_LOG_WARN, "parameter server %d: worker %d rejoined", ps->index, w);
}

static void dtr__ps_refuse(dtr_ps *ps, int w, const char *why) {
    ps->st.refused++;
    dtr__ps_log(ps, DTR_LOG_WARN, "parameter server %d: message from worker %d (rank %d) refused: %s", ps->index, w,
                ps->NS + w, why);
}

/* segment i of the ROWS message in buf: [seg[0], seg[0] + seg[1]) */
static void dtr__ps_segment(const uint8_t *buf, int64_t i, int64_t *seg) {
    memcpy(seg, buf + dtr__ps_hdr_bytes + (size_t)i * 16, 16);
}

/* PUSH_ROWS, applied on arrival in every mode: plain SGD on the rows at the optimizer's
   learning rate (no moments for rows) */
static dtr_result dtr__ps_on_push_rows(dtr_ps *ps, int w, const dtr__ps_hdr *h) {
    const uint8_t *in = ps->peer[w].in, *val = in + dtr__ps_hdr_bytes + (size_t)h->begin * 16;
    size_t es = dtr_dtype_size((dtr_dtype)h->dtype);
    float lr = ps->opt ? dtr_optimizer_lr(ps->opt) : 0.0f, *p = dtr_model_params(ps->m);
    int64_t i, k, at = 0, seg[2];
    for (i = 0; i < h->begin; i++) {
        dtr__ps_segment(in, i, seg);
        dtr_convert(ps->scratch, DTR_F32, val + (size_t)at * es, (dtr_dtype)h->dtype, (size_t)seg[1]);
        for (k = 0; k < seg[1]; k++) p[seg[0] + k] -= lr * ps->scratch[k];
        at += seg[1];
    }
    ps->st.row_pushes++;
    ps->snap_clock = -1;   /* the parameters changed at the same clock */
    return DTR_OK;
}

/* PULL_ROWS, answered at once with the rows' current values */
static dtr_result dtr__ps_on_pull_rows(dtr_ps *ps, int w, const dtr__ps_hdr *h) {
    dtr__ps_peer *p = &ps->peer[w];
    const float *params = dtr_model_params(ps->m);
    int64_t i, at = 0, seg[2];
    dtr__ps_hdr rh;
    size_t n;
    dtr_result r = dtr__ps_reply_wait(ps, p);
    if (r != DTR_OK) return r;
    for (i = 0; i < h->begin; i++) {
        dtr__ps_segment(p->in, i, seg);
        memcpy(p->out + dtr__ps_hdr_bytes + (size_t)at * sizeof(float), params + seg[0], (size_t)seg[1] * sizeof(float));
        at += seg[1];
    }
    rh = dtr__ps_header(DTR__PS_REPLY, ps->index, ps->clock, h->begin, h->count, DTR_F32);
    n = dtr__ps_seal(p->out, &rh);
    ps->st.row_pulls++;
    ps->st.bytes_sent += n;
    return dtr_comm_send_async(ps->g, p->out, n, ps->NS + w, DTR__PS_TAG_REP, &p->sreq);
}

/* applies request h of worker w (its payload in the worker's buffer) */
static dtr_result dtr__ps_handle(dtr_ps *ps, int w, const dtr__ps_hdr *h) {
    dtr__ps_peer *p = &ps->peer[w];
    if (p->state == DTR__PS_DROPPED && h->kind != DTR__PS_DONE) dtr__ps_rejoin(ps, w, h);
    if (h->kind == DTR__PS_DONE) p->state = DTR__PS_FINISHED, p->pushed = 0, p->waiting = 0;
    else if (h->kind == DTR__PS_PULL) p->waiting = 1, p->want = h->clock;
    else if (h->kind == DTR__PS_PUSH_ROWS) return dtr__ps_on_push_rows(ps, w, h);
    else if (h->kind == DTR__PS_PULL_ROWS) return dtr__ps_on_pull_rows(ps, w, h);
    else return dtr__ps_on_push(ps, w, h);
    return ps->cfg.mode == DTR_PS_SYNC ? dtr__ps_round(ps) : DTR_OK;
}

/* ---- replication (docs/parameter-server.md, "Replication") ---- */

/* is group rank `rank` gone (an isolated group says so)? */
static int dtr__ps_gone(const dtr_ps *ps, dtr_result r, int rank) {
    return r == DTR_PEER_FAILED && dtr_comm_isolates_peer_failures(ps->g) && dtr_comm_peer_alive(ps->g, rank) == 0;
}

/* primary: hands the n bytes of msg to the backup and waits until it holds them (the worker
   deadline bounds the wait); a backup that died leaves this range unreplicated */
static dtr_result dtr__ps_forward(dtr_ps *ps, const void *msg, size_t n) {
    uint64_t ack = 0;
    int b = ps->S + ps->index;
    dtr_result r;
    if (!ps->has_backup) return DTR_OK;
    dtr_comm_set_timeout(ps->g, ps->cfg.worker_deadline_ms);
    r = dtr_comm_send(ps->g, msg, n, b, DTR__PS_TAG_REPL);
    if (r == DTR_OK) r = dtr_comm_recv(ps->g, &ack, sizeof ack, b, DTR__PS_TAG_REPL_ACK);
    dtr_comm_set_timeout(ps->g, DTR__PS_LISTEN_MS);
    if (r == DTR_OK) ps->st.forwarded++;
    if (r == DTR_OK || !dtr__ps_gone(ps, r, b)) return r;
    ps->has_backup = 0;
    dtr__ps_log(ps, DTR_LOG_WARN, "parameter server %d: its backup (rank %d) died: the range goes on unreplicated",
                ps->index, b);
    return DTR_OK;
}

/* primary: tells the backup that worker w left the rounds */
static dtr_result dtr__ps_forward_drop(dtr_ps *ps, int w) {
    uint8_t buf[sizeof(dtr__ps_hdr) + 8];
    dtr__ps_hdr h = dtr__ps_header(DTR__PS_DROP, w, ps->clock, ps->range[ps->index], 0, 0);
    return dtr__ps_forward(ps, buf, dtr__ps_seal(buf, &h));
}

/* takes worker w out of the rounds (why: for the log) */
static dtr_result dtr__ps_drop(dtr_ps *ps, int w, const char *why) {
    dtr_result r;
    ps->peer[w].state = DTR__PS_DROPPED;
    ps->peer[w].pushed = 0;
    ps->st.dropped++;
    dtr__ps_log(ps, DTR_LOG_WARN, "parameter server %d: worker %d (rank %d) %s: dropped", ps->index, w, ps->NS + w, why);
    if ((r = dtr__ps_forward_drop(ps, w)) != DTR_OK) return r;
    return ps->cfg.mode == DTR_PS_SYNC ? dtr__ps_round(ps) : DTR_OK;
}

/* worker w's process is gone (an isolated group): policy FAIL fails the job naming it on
   every rank (the group is aborted), CONTINUE drops it for good; one that had finished (a
   backup that took over listens to those too) just closed */
static dtr_result dtr__ps_worker_died(dtr_ps *ps, int w) {
    dtr__ps_peer *p = &ps->peer[w];
    dtr_request_destroy(p->rreq);
    p->rreq = NULL;
    dtr__ps_reply_done(ps, p);
    p->dead = 1;
    p->waiting = 0;
    if (p->state == DTR__PS_FINISHED) return DTR_OK;
    if (ps->cfg.policy == DTR_PS_FAIL) {
        dtr_result r = dtr__fail(ps->ctx, DTR_PEER_FAILED, "parameter server %d: worker %d (rank %d) died", ps->index, w,
                                 ps->NS + w);
        dtr_comm_abort(ps->g, dtr_context_last_error(ps->ctx));
        return r;
    }
    ps->st.workers_lost++;
    return p->state == DTR__PS_LIVE ? dtr__ps_drop(ps, w, "died") : DTR_OK;
}

/* an operation with worker w that failed: its death is handled, anything else is the group's error */
static dtr_result dtr__ps_worker_gone(dtr_ps *ps, int w, dtr_result r) {
    return dtr__ps_gone(ps, r, ps->NS + w) ? dtr__ps_worker_died(ps, w) : r;
}

/* replicas: tells worker w that its PUSH or DONE is held (after the backup acknowledged it) */
static dtr_result dtr__ps_ack(dtr_ps *ps, int w, int64_t clock) {
    dtr__ps_peer *p = &ps->peer[w];
    dtr__ps_hdr h = dtr__ps_header(DTR__PS_ACK, ps->index, clock, ps->range[ps->index], 0, 0);
    dtr_result r = dtr__ps_reply_wait(ps, p);
    size_t n = dtr__ps_seal(p->out, &h);
    if (r == DTR_OK) r = dtr_comm_send_async(ps->g, p->out, n, ps->NS + w, DTR__PS_TAG_REP, &p->sreq);
    if (r == DTR_OK) ps->st.bytes_sent += n;
    return r == DTR_OK ? DTR_OK : dtr__ps_worker_gone(ps, w, r);
}

/* a request arrived from worker w: validated, then its header and trailer wiped from the buffer */
static dtr_result dtr__ps_on_request(dtr_ps *ps, int w) {
    dtr__ps_peer *p = &ps->peer[w];
    dtr__ps_expect e;
    dtr__ps_hdr h;
    char why[200];
    size_t n;
    dtr_result r;
    e.server = ps->index, e.workers = ps->W, e.begin = ps->range[ps->index], e.count = dtr__ps_len(ps);
    if (dtr__ps_parse(p->in, dtr__ps_cap(ps), w, &e, &h, why, sizeof why) != DTR_OK) {
        dtr__ps_refuse(ps, w, why);
        memset(p->in, 0, sizeof h);
        return DTR_OK;
    }
    n = dtr__ps_message_bytes(&h);
    if (h.kind != DTR__PS_PULL_ROWS && (r = dtr__ps_forward(ps, p->in, n)) != DTR_OK) return r;
    memset(p->in, 0, sizeof h);
    memset(p->in + n - 8, 0, 8);
    ps->st.bytes_received += n;
    p->last_ns = ps->last_any_ns = dtr_time_ns();
    r = dtr__ps_handle(ps, w, &h);
    if (r == DTR_OK && ps->cfg.replicas && !ps->backup_role && (h.kind == DTR__PS_PUSH || h.kind == DTR__PS_DONE))
        r = dtr__ps_ack(ps, w, h.clock);
    return r;
}

/* can worker w's waiting pull be answered now? */
static int dtr__ps_ready(const dtr_ps *ps, int w) {
    const dtr__ps_peer *p = &ps->peer[w];
    if (!p->waiting) return 0;
    if (ps->cfg.mode == DTR_PS_SYNC) return ps->clock >= p->want;
    if (ps->cfg.mode == DTR_PS_SSP) return dtr__ps_min_clock(ps) >= p->want - ps->cfg.staleness;
    return 1;
}

/* the reply to worker p's pull (sealed; *n bytes): the shared copy of the range at this clock
   (made when none is in flight at an older one; sealed once, as sends of it to other workers
   may be reading it), or p's own */
static const uint8_t *dtr__ps_reply(dtr_ps *ps, dtr__ps_peer *p, size_t *n) {
    int64_t b = ps->range[ps->index], len = dtr__ps_len(ps);
    dtr__ps_hdr h = dtr__ps_header(DTR__PS_REPLY, ps->index, ps->clock, b, len, DTR_F32);
    uint8_t *buf = ps->snap_clock == ps->clock || ps->snap_users == 0 ? ps->snap : p->out;
    *n = dtr__ps_message_bytes(&h);
    if (buf != ps->snap || ps->snap_clock != ps->clock) {
        memcpy(buf + dtr__ps_hdr_bytes, dtr_model_params(ps->m) + b, (size_t)len * sizeof(float));
        dtr__ps_seal(buf, &h);
    }
    if (buf == ps->snap) ps->snap_clock = ps->clock, ps->snap_users++, p->snap_out = 1;
    return buf;
}

/* answers the pulls that may be answered (one reply in flight per worker) */
static dtr_result dtr__ps_answer(dtr_ps *ps, int *progressed) {
    int w;
    for (w = 0; w < ps->W; w++) {
        dtr__ps_peer *p = &ps->peer[w];
        const uint8_t *buf;
        size_t n;
        dtr_result r;
        if (p->sreq || p->state != DTR__PS_LIVE || !dtr__ps_ready(ps, w)) continue;
        buf = dtr__ps_reply(ps, p, &n);
        if ((r = dtr_comm_send_async(ps->g, buf, n, ps->NS + w, DTR__PS_TAG_REP, &p->sreq)) != DTR_OK) {
            dtr__ps_reply_done(ps, p);
            return dtr__ps_worker_gone(ps, w, r);
        }
        p->waiting = 0;
        ps->st.pulls_answered++;
        ps->st.bytes_sent += n;
        *progressed = 1;
    }
    return DTR_OK;
}

/* is live worker w holding up another worker or the end of serving? */
static int dtr__ps_blocking(const dtr_ps *ps, int w) {
    int v, others = 0;
    for (v = 0; v < ps->W; v++) {
        const dtr__ps_peer *q = &ps->peer[v];
        if (v == w || q->state != DTR__PS_LIVE) continue;
        others++;
        if (!q->waiting || dtr__ps_ready(ps, v)) continue;
        if (ps->cfg.mode == DTR_PS_SYNC && !ps->peer[w].pushed) return 1;
        if (ps->cfg.mode == DTR_PS_SSP && ps->peer[w].clock < q->want - ps->cfg.staleness) return 1;
    }
    return others == 0;
}

/* drops (or fails the job for) the live workers that are waited on and silent too long */
static dtr_result dtr__ps_deadlines(dtr_ps *ps) {
    int64_t now = dtr_time_ns(), limit = (int64_t)ps->cfg.worker_deadline_ms * 1000000;
    int w;
    for (w = 0; w < ps->W; w++) {
        dtr__ps_peer *p = &ps->peer[w];
        if (p->state != DTR__PS_LIVE || now - p->last_ns < limit || !dtr__ps_blocking(ps, w)) continue;
        if (ps->cfg.policy == DTR_PS_FAIL) {
            dtr_result r = dtr__fail(ps->ctx, DTR_TIMEOUT, "parameter server %d: worker %d (rank %d) silent for %d ms",
                                     ps->index, w, ps->NS + w, ps->cfg.worker_deadline_ms);
            dtr_comm_abort(ps->g, dtr_context_last_error(ps->ctx));
            return r;
        }
        {
            char why[64];
            dtr_result r;
            snprintf(why, sizeof why, "silent for %d ms", ps->cfg.worker_deadline_ms);
            if ((r = dtr__ps_drop(ps, w, why)) != DTR_OK) return r;
        }
    }
    return DTR_OK;
}

/* polls worker w's reply and receive; handles a request that arrived */
static dtr_result dtr__ps_poll(dtr_ps *ps, int w, int *progressed) {
    dtr__ps_peer *p = &ps->peer[w];
    int done = 0;
    dtr_result r;
    if (p->sreq) {
        r = dtr_request_test(p->sreq, &done);
        if (done) dtr__ps_reply_done(ps, p), *progressed = 1;
        if (r != DTR_OK) return dtr__ps_worker_gone(ps, w, r);
    }
    if (!p->rreq) return DTR_OK;
    r = dtr_request_test(p->rreq, &done);
    if (!done) return r;
    dtr_request_destroy(p->rreq);
    p->rreq = NULL;
    *progressed = 1;
    if (r == DTR_INVALID_ARGUMENT) dtr__ps_refuse(ps, w, "longer than any message this server takes");
    else if (r != DTR_OK) return dtr__ps_worker_gone(ps, w, r);
    else if ((r = dtr__ps_on_request(ps, w)) != DTR_OK) return r;
    return p->state == DTR__PS_FINISHED || p->dead ? DTR_OK : dtr__ps_listen(ps, w);
}

static int dtr__ps_all_gone(const dtr_ps *ps) {
    int w;
    for (w = 0; w < ps->W; w++)
        if (ps->peer[w].state == DTR__PS_LIVE || ps->peer[w].sreq) return 0;
    return 1;
}

/* nothing happened: sleeps in the transport until one of the server's requests completes (a
   worker's message, a reply taken, the primary's forward) or, at the latest, the next look at
   the workers' deadlines. What woke it is handled by the next round (its failures too). */
static void dtr__ps_idle(dtr_ps *ps) {
    dtr_request **q = ps->waitq;
    int w, n = 0, idx, ms = ps->cfg.worker_deadline_ms / 8;
    if (ps->repl_req) q[n++] = ps->repl_req;
    for (w = 0; w < ps->W; w++) {
        if (ps->peer[w].rreq) q[n++] = ps->peer[w].rreq;
        if (ps->peer[w].sreq) q[n++] = ps->peer[w].sreq;
    }
    if (n > 1024) n = 1024, ms = 1;   /* the rest are polled each round */
    if (n > 0) {
        (void)dtr_request_wait_any(q, n, ms < 1 ? 1 : ms > 100 ? 100 : ms, &idx);
    } else {   /* nothing posted (not expected while a worker is live): no busy loop either */
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
    }
}

/* backup: the next message its primary forwards */
static dtr_result dtr__ps_repl_listen(dtr_ps *ps) {
    return dtr_comm_recv_async(ps->g, ps->repl_in, dtr__ps_cap(ps), ps->index, DTR__PS_TAG_REPL, &ps->repl_req);
}

/* backup: the primary died; this rank serves the range from now on (the workers' pulls that
   the primary had not answered come again, so none is answered twice). It listens to the
   workers that finished too: one whose DONE the primary held but did not acknowledge sends
   it again. */
static dtr_result dtr__ps_promote(dtr_ps *ps, dtr_result why) {
    int64_t now = dtr_time_ns();
    dtr_result r = DTR_OK;
    int w;
    if (!dtr__ps_gone(ps, why, ps->index)) return why;
    ps->backup_role = 0;
    ps->st.failovers++;
    ps->last_any_ns = now;
    dtr__ps_log(ps, DTR_LOG_WARN, "parameter server %d: primary (rank %d) died: its backup (rank %d) takes over at clock %lld",
                ps->index, ps->index, ps->S + ps->index, (long long)ps->clock);
    for (w = 0; w < ps->W && r == DTR_OK; w++) {
        ps->peer[w].waiting = 0;
        ps->peer[w].last_ns = now;
        if (!ps->peer[w].dead) r = dtr__ps_listen(ps, w);
    }
    return r;
}

/* serving is over: the listens of a backup that took over for workers that had finished are
   cancelled */
static void dtr__ps_end_listens(dtr_ps *ps) {
    int w;
    for (w = 0; w < ps->W; w++)
        if (ps->peer[w].state == DTR__PS_FINISHED && ps->peer[w].rreq) {
            dtr_request_destroy(ps->peer[w].rreq);
            ps->peer[w].rreq = NULL;
        }
}

/* backup: applies a message its primary forwarded (a worker's request or a DROP) */
static dtr_result dtr__ps_replay(dtr_ps *ps) {
    dtr__ps_hdr h;
    size_t n;
    memcpy(&h, ps->repl_in, sizeof h);
    n = dtr__ps_message_bytes(&h);
    if (h.magic != DTR__PS_MAGIC || h.worker < 0 || h.worker >= ps->W || n == 0 || n > dtr__ps_cap(ps)) {
        ps->st.refused++;
        dtr__ps_log(ps, DTR_LOG_WARN, "parameter server %d (backup): malformed message from its primary", ps->index);
        return DTR_OK;
    }
    memset(ps->repl_in, 0, sizeof h);
    if (h.kind == DTR__PS_DROP) {
        if (ps->peer[h.worker].state != DTR__PS_LIVE) return DTR_OK;
        return dtr__ps_drop(ps, h.worker, "dropped by the primary");
    }
    memcpy(ps->peer[h.worker].in, &h, sizeof h);
    memcpy(ps->peer[h.worker].in + sizeof h, ps->repl_in + sizeof h, n - sizeof h);
    return dtr__ps_on_request(ps, h.worker);
}

/* backup: polls the forwarded stream; acknowledges each message once applied */
static dtr_result dtr__ps_repl_poll(dtr_ps *ps, int *progressed) {
    uint64_t ack = 1;
    int done = 0;
    dtr_result r = dtr_request_test(ps->repl_req, &done);
    if (!done) return r;
    dtr_request_destroy(ps->repl_req);
    ps->repl_req = NULL;
    *progressed = 1;
    if (r != DTR_OK) return dtr__ps_promote(ps, r);
    if ((r = dtr__ps_replay(ps)) != DTR_OK) return r;
    r = dtr_comm_send(ps->g, &ack, sizeof ack, ps->index, DTR__PS_TAG_REPL_ACK);
    if (r != DTR_OK) return dtr__ps_promote(ps, r);
    if (dtr__ps_all_gone(ps) || (r = dtr__ps_repl_listen(ps)) == DTR_OK) return DTR_OK;
    return dtr__ps_promote(ps, r);
}

/* one round of a serving rank's loop */
static dtr_result dtr__ps_serve_round(dtr_ps *ps, int *progressed) {
    dtr_result r = DTR_OK;
    int w;
    if (ps->backup_role) return dtr__ps_repl_poll(ps, progressed);
    for (w = 0; w < ps->W && r == DTR_OK; w++) r = dtr__ps_poll(ps, w, progressed);
    if (r == DTR_OK) r = dtr__ps_answer(ps, progressed);
    if (r == DTR_OK) r = dtr__ps_deadlines(ps);
    return r;
}

dtr_result dtr_ps_serve(dtr_ps *ps) {
    dtr_result r = DTR_OK;
    int w;
    if (!ps) return DTR_NULL_HANDLE;
    if (!ps->server) return dtr__fail(ps->ctx, DTR_BAD_STATE, "dtr_ps_serve: rank is a worker");
    ps->last_any_ns = dtr_time_ns();
    for (w = 0; w < ps->W && r == DTR_OK && !ps->backup_role; w++) {
        ps->peer[w].last_ns = ps->last_any_ns;
        if (ps->peer[w].state != DTR__PS_FINISHED && !ps->peer[w].dead && !ps->peer[w].rreq) r = dtr__ps_listen(ps, w);
    }
    if (ps->backup_role && !ps->repl_req && (r = dtr__ps_repl_listen(ps)) != DTR_OK) r = dtr__ps_promote(ps, r);
    while (r == DTR_OK && !dtr__ps_all_gone(ps)) {
        int progressed = 0;
        r = dtr__ps_serve_round(ps, &progressed);
        if (r == DTR_OK && !progressed) dtr__ps_idle(ps);
    }
    if (r == DTR_OK) dtr__ps_end_listens(ps);
    if (r == DTR_OK) r = dtr__ps_apply_summed(ps);   /* fewer than cfg.aggregate pushes left at the end */
    if (r == DTR_OK) r = dtr__ps_checkpoint(ps, 1);
    if (r != DTR_OK && dtr_context_status(ps->ctx) == DTR_OK)
        dtr__fail(ps->ctx, r, "dtr_ps_serve: %s", dtr_comm_last_error(ps->g));
    return r;
}

/* ---- worker ---- */

static dtr_result dtr__ps_waitall(dtr_request **q, int n) {
    dtr_result first = DTR_OK;
    int i;
    for (i = 0; i < n; i++) {
        dtr_result r = q[i] ? dtr_request_wait(q[i]) : DTR_OK;
        if (r != DTR_OK && first == DTR_OK) first = r;
        dtr_request_destroy(q[i]);
        q[i] = NULL;
    }
    return first;
}

static dtr_result dtr__ps_worker_fail(dtr_ps *ps, const char *what, dtr_result r) {
    if (dtr_context_status(ps->ctx) != DTR_OK) return r;
    return dtr__fail(ps->ctx, r, "%s: %s", what, dtr_comm_last_error(ps->g));
}

/* sends a request of kind `kind` with `clock` (and the gradient of server s's range for a
   push) to every server */
static dtr_result dtr__ps_send_all(dtr_ps *ps, int kind, const int64_t *clock) {
    dtr_request *q[64];
    dtr_result r = DTR_OK;
    int s, n = 0;
    for (s = 0; s < ps->S && r == DTR_OK; s++) {
        int64_t b = ps->range[s], len = kind == DTR__PS_PUSH ? ps->range[s + 1] - b : 0;
        int dt = kind == DTR__PS_PUSH ? ps->wire : 0;
        dtr__ps_hdr h = dtr__ps_header(kind, ps->index, clock[s], b, len, dt);
        size_t bytes;
        if (len) dtr__ps_encode(ps, s, dt);
        bytes = dtr__ps_seal(ps->msg[s], &h);
        ps->st.bytes_sent += bytes;
        r = dtr_comm_send_async(ps->g, ps->msg[s], bytes, s, DTR__PS_TAG_REQ, &q[n]);
        if (r == DTR_OK) n++;
        if (n == 64 || s == ps->S - 1 || r != DTR_OK) {
            dtr_result w = dtr__ps_waitall(q, n);
            if (r == DTR_OK) r = w;
            n = 0;
        }
    }
    return r;
}

/* replicas: range s's primary died (an isolated group says so): its backup serves it now */
static int dtr__ps_failover(dtr_ps *ps, int s, dtr_result r) {
    if (!ps->cfg.replicas || ps->target[s] != s || !dtr__ps_gone(ps, r, s)) return 0;
    ps->target[s] = ps->S + s;
    ps->st.failovers++;
    dtr__ps_log(ps, DTR_LOG_WARN, "worker %d: parameter server %d (rank %d) died: its backup (rank %d) serves the range now",
                ps->index, s, s, ps->S + s);
    return 1;
}

/* replicas: writes the request of `kind` for range s into msg[s] (a push: the gradient) */
static size_t dtr__ps_request(dtr_ps *ps, int s, int kind, int64_t clock) {
    int64_t b = ps->range[s], len = kind == DTR__PS_PUSH ? ps->range[s + 1] - b : 0;
    int dt = kind == DTR__PS_PUSH ? ps->wire : 0;
    dtr__ps_hdr h = dtr__ps_header(kind, ps->index, clock, b, len, dt);
    if (len) dtr__ps_encode(ps, s, dt);
    return dtr__ps_seal(ps->msg[s], &h);
}

/* replicas: sends msg[s] (`bytes`) to the server of range s and waits for its answer in
   rep[s]; when the primary died, the same request goes to the backup */
static dtr_result dtr__ps_exchange(dtr_ps *ps, int s, size_t bytes) {
    size_t cap = dtr__ps_buf_bytes(ps->maxlen);
    for (;;) {
        dtr_request *q[2] = {NULL, NULL};
        dtr_result r = dtr_comm_recv_async(ps->g, ps->rep[s], cap, ps->target[s], DTR__PS_TAG_REP, &q[0]), r2;
        if (r == DTR_OK) r = dtr_comm_send_async(ps->g, ps->msg[s], bytes, ps->target[s], DTR__PS_TAG_REQ, &q[1]);
        if ((r2 = dtr__ps_waitall(q, 2)) != DTR_OK && r == DTR_OK) r = r2;
        if (r == DTR_OK) {
            ps->st.bytes_sent += bytes;
            return DTR_OK;
        }
        if (!dtr__ps_failover(ps, s, r)) return r;
    }
}

/* replicas: checks the acknowledgment of range s's server */
static dtr_result dtr__ps_check_ack(dtr_ps *ps, int s) {
    dtr__ps_hdr h;
    uint64_t tr;
    memcpy(&h, ps->rep[s], sizeof h);
    memcpy(&tr, ps->rep[s] + sizeof h, 8);
    if (h.magic != DTR__PS_MAGIC || h.kind != DTR__PS_ACK || h.worker != s || h.count != 0 || tr != dtr__ps_trailer(&h))
        return dtr__fail(ps->ctx, DTR_CORRUPT_FILE, "parameter server %d sent a malformed acknowledgment", s);
    ps->st.bytes_received += sizeof h + 8;
    return DTR_OK;
}

/* replicas: a PUSH or DONE to every range, each acknowledged. A DONE that a backup which
   took over no longer takes (it finished serving and left) is done. */
static dtr_result dtr__ps_send_acked(dtr_ps *ps, int kind, const int64_t *clock) {
    dtr_result r = DTR_OK;
    int s;
    for (s = 0; s < ps->S && r == DTR_OK; s++) {
        if ((r = dtr__ps_exchange(ps, s, dtr__ps_request(ps, s, kind, clock[s]))) == DTR_OK) r = dtr__ps_check_ack(ps, s);
        else if (kind == DTR__PS_DONE && ps->target[s] != s && dtr__ps_gone(ps, r, ps->target[s])) r = DTR_OK;
    }
    return r;
}

dtr_result dtr_ps_push(dtr_ps *ps) {
    int64_t clock[64];
    dtr_result r;
    int s;
    if (!ps) return DTR_NULL_HANDLE;
    if (ps->server) return dtr__fail(ps->ctx, DTR_BAD_STATE, "dtr_ps_push: rank is a server");
    for (s = 0; s < ps->S; s++) clock[s] = ps->cfg.mode == DTR_PS_SYNC ? ps->sclock[s] : ps->wclock;
    if ((r = dtr__ps_stage(ps, 0, dtr_model_numel(ps->m))) != DTR_OK) return r;
    r = ps->cfg.replicas ? dtr__ps_send_acked(ps, DTR__PS_PUSH, clock) : dtr__ps_send_all(ps, DTR__PS_PUSH, clock);
    if (r != DTR_OK) return dtr__ps_worker_fail(ps, "dtr_ps_push", r);
    if (ps->cfg.replicas) ps->st.pushes_acked++;
    ps->wclock++;
    ps->pushed = 1;
    ps->st.pushes++;
    return dtr_model_zero_grad(ps->m);
}

/* checks server s's reply: a REPLY of `count` f32 values with `begin`, whole */
static dtr_result dtr__ps_check_reply(dtr_ps *ps, int s, int64_t begin, int64_t count, dtr__ps_hdr *h) {
    uint64_t tr;
    size_t n;
    memcpy(h, ps->rep[s], sizeof *h);
    n = dtr__ps_message_bytes(h);
    if (h->magic != DTR__PS_MAGIC || h->kind != DTR__PS_REPLY || h->worker != s || h->begin != begin || h->count != count ||
        h->dtype != DTR_F32 || n == 0)
        return dtr__fail(ps->ctx, DTR_CORRUPT_FILE, "parameter server %d sent a malformed reply", s);
    memcpy(&tr, ps->rep[s] + n - 8, 8);
    if (tr != dtr__ps_trailer(h)) return dtr__fail(ps->ctx, DTR_CORRUPT_FILE, "parameter server %d: truncated reply", s);
    ps->st.bytes_received += n;
    return DTR_OK;
}

/* checks server s's reply to a pull and copies its range into the model */
static dtr_result dtr__ps_take_reply(dtr_ps *ps, int s) {
    int64_t b = ps->range[s], len = ps->range[s + 1] - b;
    dtr__ps_hdr h;
    dtr_result r = dtr__ps_check_reply(ps, s, b, len, &h);
    if (r == DTR_OK) r = dtr__ps_put_params(ps, b, ps->rep[s] + dtr__ps_hdr_bytes, len);
    if (r == DTR_OK) ps->sclock[s] = h.clock;
    return r;
}

/* replicas: one range after the other, each from the server that holds it now */
static dtr_result dtr__ps_pull_replicated(dtr_ps *ps, const int64_t *want, int64_t t0) {
    dtr_result r = DTR_OK;
    int s;
    for (s = 0; s < ps->S && r == DTR_OK; s++)
        if ((r = dtr__ps_exchange(ps, s, dtr__ps_request(ps, s, DTR__PS_PULL, want[s]))) == DTR_OK) r = dtr__ps_take_reply(ps, s);
    if (r != DTR_OK) return dtr__ps_worker_fail(ps, "dtr_ps_pull", r);
    ps->pushed = 0;
    ps->st.pulls++;
    ps->st.wait_ns += dtr_time_ns() - t0;
    return DTR_OK;
}

dtr_result dtr_ps_pull(dtr_ps *ps) {
    dtr_request *q[64];
    int64_t want[64], t0;
    size_t cap;
    dtr_result r = DTR_OK, r2;
    int s, n = 0;
    if (!ps) return DTR_NULL_HANDLE;
    if (ps->server) return dtr__fail(ps->ctx, DTR_BAD_STATE, "dtr_ps_pull: rank is a server");
    cap = dtr__ps_buf_bytes(ps->maxlen);
    t0 = dtr_time_ns();
    for (s = 0; s < ps->S; s++) want[s] = ps->cfg.mode == DTR_PS_SYNC ? ps->sclock[s] + ps->pushed : ps->wclock;
    if (ps->cfg.replicas) return dtr__ps_pull_replicated(ps, want, t0);
    for (s = 0; s < ps->S && r == DTR_OK; s++)
        if ((r = dtr_comm_recv_async(ps->g, ps->rep[s], cap, s, DTR__PS_TAG_REP, &q[n])) == DTR_OK) n++;
    if (r == DTR_OK) r = dtr__ps_send_all(ps, DTR__PS_PULL, want);
    if (r != DTR_OK) dtr_comm_abort(ps->g, "dtr_ps_pull failed");   /* the posted receives must end */
    if ((r2 = dtr__ps_waitall(q, n)) != DTR_OK && r == DTR_OK) r = r2;
    if (r != DTR_OK) return dtr__ps_worker_fail(ps, "dtr_ps_pull", r);
    for (s = 0; s < ps->S && r == DTR_OK; s++) r = dtr__ps_take_reply(ps, s);
    ps->pushed = 0;
    ps->st.pulls++;
    ps->st.wait_ns += dtr_time_ns() - t0;
    return r;
}

dtr_result dtr_ps_step(dtr_ps *ps) {
    dtr_result r = dtr_ps_push(ps);
    return r == DTR_OK ? dtr_ps_pull(ps) : r;
}

dtr_result dtr_ps_finish(dtr_ps *ps) {
    int64_t clock[64];
    dtr_result r;
    int s;
    if (!ps) return DTR_NULL_HANDLE;
    if (ps->server) return dtr__fail(ps->ctx, DTR_BAD_STATE, "dtr_ps_finish: rank is a server");
    for (s = 0; s < ps->S; s++) clock[s] = ps->wclock;
    r = ps->cfg.replicas ? dtr__ps_send_acked(ps, DTR__PS_DONE, clock) : dtr__ps_send_all(ps, DTR__PS_DONE, clock);
    return r == DTR_OK ? DTR_OK : dtr__ps_worker_fail(ps, "dtr_ps_finish", r);
}

/* ---- sparse rows ---- */

/* param's offset in the buffer and row width; rows in range and distinct */
static dtr_result dtr__ps_rows_check(dtr_ps *ps, const char *fn, const dtr_tensor *param, const int64_t *rows, int n,
                                     int64_t *off, int64_t *dim) {
    int i, np = dtr_model_param_count(ps->m), k = -1;
    int64_t nrows;
    uint8_t *seen;
    if (ps->server) return dtr__fail(ps->ctx, DTR_BAD_STATE, "%s: rank is a server", fn);
    if (ps->cfg.replicas) return dtr__fail(ps->ctx, DTR_UNSUPPORTED, "%s: sparse rows are not replicated in this version", fn);
    for (i = 0; i < np && k < 0; i++)
        if (dtr_model_param_at(ps->m, i) == param) k = i;
    if (k < 0 || dtr_tensor_ndim(param) < 1 || n < 0 || (n > 0 && !rows))
        return dtr__fail(ps->ctx, DTR_INVALID_ARGUMENT, "%s: not a parameter of the model, or %d rows", fn, n);
    nrows = dtr_tensor_dim(param, 0);
    *off = dtr_model_param_offset(ps->m, k);
    *dim = nrows ? dtr_tensor_numel(param) / nrows : 0;
    seen = (uint8_t *)dtr__calloc(&ps->ctx->alloc, (size_t)nrows + 1);
    if (!seen) return dtr__fail(ps->ctx, DTR_OUT_OF_MEMORY, "%s: out of memory", fn);
    for (i = 0; i < n && rows[i] >= 0 && rows[i] < nrows && !seen[rows[i]]; i++) seen[rows[i]] = 1;
    dtr__free(&ps->ctx->alloc, seen);
    if (i < n) return dtr__fail(ps->ctx, DTR_INVALID_ARGUMENT, "%s: row %lld is outside [0, %lld) or repeated", fn,
                                (long long)rows[i], (long long)nrows);
    return DTR_OK;
}

/* writes server s's pieces of the rows as segments after msg[s]'s header; returns how many,
   *values their floats; DTR_INVALID_ARGUMENT when they would not fit one message */
static dtr_result dtr__ps_rows_segments(dtr_ps *ps, int s, int64_t off, int64_t dim, const int64_t *rows, int n,
                                        size_t es, int64_t *nseg, int64_t *values) {
    int64_t lo = ps->range[s], hi = ps->range[s + 1];
    int i;
    *nseg = *values = 0;
    for (i = 0; i < n; i++) {
        int64_t a = off + rows[i] * dim, b = a + dim, seg[2];
        a = a > lo ? a : lo;
        b = b < hi ? b : hi;
        if (a >= b) continue;
        seg[0] = a, seg[1] = b - a;
        *values += seg[1];
        if ((size_t)(*nseg + 1) * 16 + (size_t)*values * es > (size_t)(hi - lo) * sizeof(float))
            return dtr__fail(ps->ctx, DTR_INVALID_ARGUMENT, "%d rows do not fit one message to server %d: send fewer at once", n, s);
        memcpy(ps->msg[s] + dtr__ps_hdr_bytes + (size_t)*nseg * 16, seg, 16);
        (*nseg)++;
    }
    return DTR_OK;
}

dtr_result dtr_ps_push_rows(dtr_ps *ps, const dtr_tensor *param, const int64_t *rows, int n) {
    dtr_request *q[64];
    int64_t off, dim, nseg, values, i, at, seg[2];
    size_t es;
    dtr_result r, r2;
    int s, k = 0;
    if (!ps || !param) return DTR_NULL_HANDLE;
    if ((r = dtr__ps_rows_check(ps, "dtr_ps_push_rows", param, rows, n, &off, &dim)) != DTR_OK) return r;
    es = dtr_dtype_size(ps->cfg.push_dtype);
    for (s = 0; s < ps->S && r == DTR_OK; s++) {
        uint8_t *val;
        dtr__ps_hdr h;
        if ((r = dtr__ps_rows_segments(ps, s, off, dim, rows, n, es, &nseg, &values)) != DTR_OK || nseg == 0) continue;
        val = ps->msg[s] + dtr__ps_hdr_bytes + (size_t)nseg * 16;
        for (i = 0, at = 0; i < nseg && r == DTR_OK; at += seg[1], i++) {
            dtr__ps_segment(ps->msg[s], i, seg);
            if ((r = dtr__ps_stage(ps, seg[0], seg[1])) == DTR_OK)
                dtr_convert(val + (size_t)at * es, ps->cfg.push_dtype, dtr__ps_grads(ps) + seg[0], DTR_F32, (size_t)seg[1]);
        }
        if (r != DTR_OK) break;
        h = dtr__ps_header(DTR__PS_PUSH_ROWS, ps->index, ps->wclock, nseg, values, (int)ps->cfg.push_dtype);
        ps->st.bytes_sent += dtr__ps_message_bytes(&h);
        r = dtr_comm_send_async(ps->g, ps->msg[s], dtr__ps_seal(ps->msg[s], &h), s, DTR__PS_TAG_REQ, &q[k]);
        if (r == DTR_OK) k++;
    }
    if ((r2 = dtr__ps_waitall(q, k)) != DTR_OK && r == DTR_OK) r = r2;
    if (r != DTR_OK) return dtr__ps_worker_fail(ps, "dtr_ps_push_rows", r);
    for (i = 0; i < n && r == DTR_OK; i++) r = ps->ctx->backend->memset0(ps->ctx, dtr_model_grads(ps->m) + off + rows[i] * dim,
                                                                   (size_t)dim * sizeof(float));
    ps->st.row_pushes++;
    return r;
}

/* scatters server s's reply to a PULL_ROWS of nseg segments (in msg[s]) into the parameters */
static dtr_result dtr__ps_take_rows(dtr_ps *ps, int s, int64_t nseg, int64_t values) {
    dtr__ps_hdr h;
    int64_t i, at = 0, seg[2];
    dtr_result r = dtr__ps_check_reply(ps, s, nseg, values, &h);
    for (i = 0; i < nseg && r == DTR_OK; i++) {
        dtr__ps_segment(ps->msg[s], i, seg);
        r = dtr__ps_put_params(ps, seg[0], ps->rep[s] + dtr__ps_hdr_bytes + (size_t)at * sizeof(float), seg[1]);
        at += seg[1];
    }
    return r;
}

dtr_result dtr_ps_pull_rows(dtr_ps *ps, const dtr_tensor *param, const int64_t *rows, int n) {
    dtr_request *q[128];
    int64_t off, dim, nseg[64], values[64];
    size_t cap = dtr__ps_buf_bytes(ps ? ps->maxlen : 0);
    dtr_result r, r2;
    int s, k = 0;
    if (!ps || !param) return DTR_NULL_HANDLE;
    if ((r = dtr__ps_rows_check(ps, "dtr_ps_pull_rows", param, rows, n, &off, &dim)) != DTR_OK) return r;
    for (s = 0; s < ps->S && r == DTR_OK; s++) {
        dtr__ps_hdr h;
        if ((r = dtr__ps_rows_segments(ps, s, off, dim, rows, n, 0, &nseg[s], &values[s])) != DTR_OK || nseg[s] == 0) continue;
        h = dtr__ps_header(DTR__PS_PULL_ROWS, ps->index, ps->wclock, nseg[s], values[s], 0);
        ps->st.bytes_sent += dtr__ps_message_bytes(&h);
        if ((r = dtr_comm_recv_async(ps->g, ps->rep[s], cap, s, DTR__PS_TAG_REP, &q[k])) != DTR_OK) break;
        k++;
        if ((r = dtr_comm_send_async(ps->g, ps->msg[s], dtr__ps_seal(ps->msg[s], &h), s, DTR__PS_TAG_REQ, &q[k])) == DTR_OK) k++;
    }
    if (r != DTR_OK && k > 0) dtr_comm_abort(ps->g, "dtr_ps_pull_rows failed");   /* the posted receives must end */
    if ((r2 = dtr__ps_waitall(q, k)) != DTR_OK && r == DTR_OK) r = r2;
    if (r != DTR_OK) return dtr__ps_worker_fail(ps, "dtr_ps_pull_rows", r);
    for (s = 0; s < ps->S && r == DTR_OK; s++)
        if (nseg[s] > 0) r = dtr__ps_take_rows(ps, s, nseg[s], values[s]);
    ps->st.row_pulls++;
    return r;
}
