/* ============================================================================
 * Data-parallel engine: every rank holds the whole model; gradients are averaged over the
 * ranks in buckets of the contiguous gradient buffer, each bucket's all-reduce starting
 * during backward as soon as its gradients are final.
 *
 * Buckets are ranges of the gradient buffer on parameter boundaries, formed from the last
 * parameter backwards (the order backward produces them), each at least bucket_bytes
 * unless it is the last. Without ZeRO they hold trainable parameters only: a frozen one
 * (dtr_model_set_trainable) ends a bucket and is in none, so its zeros are never sent and
 * the buckets around it complete during backward (LoRA adapters between frozen weights: a
 * bucket per run of adapters); the buckets are made again at the first gradient of a step
 * after the trainable set changed. ZeRO's buckets cover every parameter (its shards and
 * ZeRO-3's units are ranges of the whole buffer). The gradient-ready hook of the context counts down the parameters
 * of each bucket; buckets are started strictly in bucket order (a ready bucket waits for
 * the ones before it), so every rank issues the same all-reduces in the same order even if
 * its backward reaches parameters in another order. dtr_dp_finish starts the rest and waits.
 * The all-reduce is DTR_REDUCE_AVG: the sum over ranks in the collective's fixed order,
 * divided by the world size, identical bits on every rank. With compression (compress.c)
 * a bucket's exchange is the codec's; dtr_dp_finish decodes the buckets in bucket order.
 * Local SGD: after the warm-up the hook and dtr_dp_finish do nothing, and dtr_dp_step_done
 * averages the parameters every local_sgd_every steps.
 * ZeRO (zero.c): gradients are reduce-scattered instead of all-reduced (stage 2: a
 * bucket's start sends its slices to their owners; stage 1: dtr_dp_finish sends the whole
 * buffer's), dtr_dp_finish sums this rank's shard, and dtr_dp_step_done gathers the shards
 * the ranks updated. ZeRO-3 keeps the parameters sharded as well: the buckets are the units
 * that zero.c gathers when an op reads them, released by the gradient hook once a bucket's
 * gradients are final and at the step (in place of the gather).
 * Gradients in device memory (a GPU backend): with a transport of device memory (NCCL) the
 * buckets are reduced where they are, ZeRO's slices go from device to device and local SGD
 * averages the device parameters, and every codec (and ZeRO's 16-bit slices) encodes and
 * decodes on the device (int8, top-k and PowerSGD where the backend has the codec and
 * powersgd slots; without them the engine works on a host copy as below and the group
 * stages its host buffers to the device); with one of host memory
 * (libfabric, local) each bucket is copied to a host staging buffer when it starts, beside
 * the stream (dtr__to_host_async: backward's kernels go on), and everything above runs on
 * that copy once it has landed: the all-reduce or the codec's exchange, ZeRO's
 * reduce-scatter, started in bucket order as the copies land (looked at in each gradient
 * hook, waited for in dtr_dp_finish); dtr_dp_finish copies the result back (ZeRO: this
 * rank's shard). The parameter collectives (ZeRO's gather, local SGD's average, the
 * broadcast) go through the same buffer. The optimizer keeps its state, and ZeRO's shard of
 * it, on the device.
 * ==========================================================================*/
#include "../public/api.h"
#include "../public/api_comm.h"
#include "../public/api_engine.h"
#include "../core/internal.h"
#include "../comm/comm_internal.h"
#include "compress.h"
#include "zero.h"
#include "../obs/obs_internal.h"
#include <math.h>

typedef struct dtr__bucket {
    int64_t begin, end;     /* float range in the gradient buffer */
    int nparams, pending;   /* parameters, and those whose gradient is not final yet */
    dtr_request *req;
    dtr_event *copied;      /* staging: its copy to the host buffer, queued (NULL: landed, or none) */
    int in_backward;        /* started by the hook */
    double t_start;         /* when it started (with a dtr_metrics: the timeline's span) */
} dtr__bucket;

struct dtr_dp {
    dtr_model *m;
    dtr_comm *c;
    dtr_context *ctx;
    dtr_dp_config cfg;
    dtr__bucket *b;
    int nb;
    int *param_bucket;      /* parameter index -> bucket */
    int next;               /* next bucket to start (its gradients final; staged: copy queued) */
    int next_comm;          /* next bucket whose exchange starts (staged: once its copy landed) */
    int armed;              /* no gradient of this step seen yet: the buckets may be made again */
    unsigned gen;           /* the model's trainable set the buckets were made for */
    int no_sync;
    int hook_id;           /* our gradient hook (0: none) */
    int overlapped;
    dtr__dpc *cz;           /* gradient codec and counters */
    dtr__zero *z;           /* ZeRO: the shards (NULL without) */
    float *stage;           /* device gradients over a host-memory transport: the host copy */
    float *used;            /* find_unused: a flag a parameter, summed over the group */
    unsigned char *skip;    /* find_unused: this rank's parameters its backward did not reach */
};

/* The buffer the collectives reduce: the model's gradients, or their host staging copy. */
static float *dtr__dp_grads(const dtr_dp *dp) { return dp->stage ? dp->stage : dtr_model_grads(dp->m); }

/* Floats [begin, end) of a device buffer of the model (its gradients or its parameters) to
 * the staging buffer (to_host waits for the stream), or back; nothing without staging. */
static dtr_result dtr__dp_stage(dtr_dp *dp, float *dev, int64_t begin, int64_t end, int back) {
    dtr_context *ctx = dp->ctx;
    float *host = dp->stage + begin;
    size_t bytes = (size_t)(end - begin) * sizeof(float);
    if (!dp->stage || end <= begin) return DTR_OK;
    return back ? ctx->backend->from_host(ctx, dev + begin, host, bytes) : ctx->backend->to_host(ctx, host, dev + begin, bytes);
}

/* The parameters the parameter collectives work on: the model's, or the staging buffer. */
static float *dtr__dp_params(const dtr_dp *dp) { return dp->stage ? dp->stage : dtr_model_params(dp->m); }

dtr_dp_config dtr_dp_config_init(void) {
    dtr_dp_config c;
    memset(&c, 0, sizeof(c));
    return c;
}

/* bucket i's gradients are final: a device model's are copied to the staging buffer beside
   the stream (backward's kernels go on; the copy waits for those queued so far) */
static dtr_result dtr__dp_start(dtr_dp *dp, int i, int from_hook) {
    dtr__bucket *b = &dp->b[i];
    float *g = dtr_model_grads(dp->m);
    b->in_backward = from_hook;
    if (dp->ctx->obs) b->t_start = dtr__obs_now();
    if (!dp->stage || b->end <= b->begin) return DTR_OK;
    return dtr__to_host_async(dp->ctx, dp->stage + b->begin, g + b->begin, (size_t)(b->end - b->begin) * sizeof(float),
                              &b->copied);
}

/* bucket i's exchange: the all-reduce or the codec's, or ZeRO-2's slices to their owners */
static dtr_result dtr__dp_exchange(dtr_dp *dp, int i) {
    dtr__bucket *b = &dp->b[i];
    if (dp->cfg.zero >= 2) return dtr__zero_start(dp->z, dtr__dp_grads(dp), i, b->begin, b->end);
    return dtr__dpc_start(dp->cz, i, dtr__dp_grads(dp), b->begin, b->end, &b->req);
}

/* Starts the exchanges of the started buckets in bucket order (the same on every rank): those
   before `upto` once their copy has landed (waiting for it), the later ones only if it has. */
static dtr_result dtr__dp_exchange_ready(dtr_dp *dp, int upto) {
    while (dp->next_comm < dp->next) {
        dtr__bucket *b = &dp->b[dp->next_comm];
        int done = 1;
        dtr_result r = dp->next_comm < upto ? dtr_event_wait(dp->ctx, b->copied) : dtr_event_query(dp->ctx, b->copied, &done);
        if (r != DTR_OK) return r;
        if (!done) return DTR_OK;
        b->copied = NULL;
        if ((r = dtr__dp_exchange(dp, dp->next_comm++)) != DTR_OK) return r;
    }
    return DTR_OK;
}

/* local SGD past its warm-up: gradients stay local */
static int dtr__dp_local(const dtr_dp *dp) {
    return dp->cfg.local_sgd_every > 0 && dtr__dpc_stats(dp->cz)->steps >= dp->cfg.local_sgd_warmup;
}

/* starts every ready bucket that is next in order, then the exchanges whose copies landed;
   at most DTR__ASYNC_COPIES / 2 copies in flight (their events stay valid) */
static dtr_result dtr__dp_launch_ready(dtr_dp *dp, int from_hook) {
    dtr_result r;
    while (dp->next < dp->nb && dp->b[dp->next].pending == 0) {
        if (dp->next - dp->next_comm >= DTR__ASYNC_COPIES / 2 && (r = dtr__dp_exchange_ready(dp, dp->next_comm + 1)) != DTR_OK)
            return r;
        r = dtr__dp_start(dp, dp->next, from_hook);
        dp->next++;
        if (r != DTR_OK) return r;
    }
    return dtr__dp_exchange_ready(dp, 0);
}

static void dtr__dp_relayout(dtr_dp *dp);

static dtr_result dtr__dp_grad_ready(void *user, dtr_tensor *param, dtr_event *ready) {
    dtr_dp *dp = (dtr_dp *)user;
    dtr_result r = DTR_OK;
    dtr__bucket *b;
    if (dp->no_sync || dtr__dp_local(dp) || dp->cfg.zero == 1 || param->model != dp->m || param->param_index < 0)
        return DTR_OK;   /* ZeRO-1: nothing starts during backward */
    dtr__dp_relayout(dp);
    if (dp->param_bucket[param->param_index] < 0) return DTR_OK;
    b = &dp->b[dp->param_bucket[param->param_index]];
    if (b->pending == 0) return DTR_OK;   /* a second backward without dtr_dp_finish */
    if (b->pending == 1 && dp->cfg.zero == 3) dtr__zero3_release(dp->z, dp->param_bucket[param->param_index]);
    /* the bucket's last gradient is written once `ready` completes: a host transport reads
       host memory on its progress thread, so the host waits; a staged copy waits for it on the
       device instead, and a group of device memory orders its work after the stream's */
    if (--b->pending == 0 && !dp->stage && !dp->c->mem_ctx) r = dtr_event_wait(dp->ctx, ready);
    if (r == DTR_OK) r = dtr__dp_launch_ready(dp, 1);   /* also the exchanges whose copies landed */
    if (r == DTR_OK && dp->z) dtr__zero_grads_sent(dp->z, dtr__dp_grads(dp), 0);   /* sent: memory back */
    if (r != DTR_OK) return dtr__fail(dp->ctx, r, "data parallel: cannot start a gradient all-reduce: %s",
                                      dtr_comm_last_error(dp->c));
    return DTR_OK;
}

/* the next step's counts; a copy still queued (after an error) is waited for */
static void dtr__dp_reset(dtr_dp *dp) {
    int i;
    for (i = 0; i < dp->nb; i++) {
        if (dp->b[i].copied) (void)dtr_event_wait(dp->ctx, dp->b[i].copied);
        dp->b[i].copied = NULL;
        dp->b[i].pending = dp->b[i].nparams;
    }
    dp->next = dp->next_comm = 0;
    dp->armed = 1;
}

/* parameter i's gradient is exchanged: it is trainable, or ZeRO's buckets cover everything */
static int dtr__dp_syncs(const dtr_dp *dp, int i) { return dp->cfg.zero || dtr_model_param_trainable(dp->m, i); }

/* The buckets over the parameters dtr__dp_syncs takes (frozen ones end a bucket, and are in
   none: param_bucket -1), from the last backwards; every parameter synchronised, one bucket
   ends where the next begins. */
static void dtr__dp_fill_buckets(dtr_dp *dp) {
    int np = dtr_model_param_count(dp->m), i, k = 0, open = 0;
    int64_t per = (int64_t)(dp->cfg.bucket_bytes / sizeof(float));
    if (per < 1) per = 1;
    memset(dp->b, 0, (size_t)(np ? np : 1) * sizeof(dtr__bucket));
    for (i = np - 1; i >= 0; i--) {
        int64_t off = dtr_model_param_offset(dp->m, i);
        dp->param_bucket[i] = -1;
        if (!dtr__dp_syncs(dp, i)) continue;
        if (!open) dp->b[k].end = i + 1 < np ? dtr_model_param_offset(dp->m, i + 1) : dtr_model_numel(dp->m), open = 1;
        dp->param_bucket[i] = k;
        dp->b[k].nparams++;
        if (dp->b[k].end - off >= per || i == 0 || !dtr__dp_syncs(dp, i - 1)) dp->b[k++].begin = off, open = 0;
    }
    dp->nb = k;
    dp->gen = dtr__model_trainable_gen(dp->m);
    dtr__dp_reset(dp);
}

/* at the step's first gradient (or its finish): the buckets for a trainable set changed since
   (dtr_model_set_trainable between steps); a codec's per-bucket state starts again */
static void dtr__dp_relayout(dtr_dp *dp) {
    if (!dp->armed) return;
    dp->armed = 0;
    if (dp->cfg.zero || dp->gen == dtr__model_trainable_gen(dp->m)) return;
    dtr__dp_fill_buckets(dp);   /* re-arms: this step's first gradient is being seen */
    dtr__dpc_forget_buckets(dp->cz);
    dp->armed = 0;
}

static dtr_result dtr__dp_buckets(dtr_dp *dp) {
    dtr_context *ctx = dp->ctx;
    int np = dtr_model_param_count(dp->m);
    dp->param_bucket = (int *)dtr__calloc(&ctx->alloc, (size_t)(np ? np : 1) * sizeof(int));
    dp->b = (dtr__bucket *)dtr__calloc(&ctx->alloc, (size_t)(np ? np : 1) * sizeof(dtr__bucket));
    if (!dp->param_bucket || !dp->b) return DTR_OUT_OF_MEMORY;
    dtr__dp_fill_buckets(dp);
    return DTR_OK;
}

/* compression of a device model over a group of its device memory stays on the device (no
   host copy): bf16 / fp16 (ZeRO's 16-bit slices too: the backend's cast kernel), int8 / top-k
   where the backend has the codec slot, PowerSGD where it has the powersgd slot */
static int dtr__dp_codec_on_device(dtr_context *ctx, const dtr_comm *c, const dtr_dp_config *cfg) {
    const dtr_backend *b = ctx->backend;
    return c->mem_ctx && !dtr__host_memory(ctx) &&
           (cfg->compress == DTR_COMPRESS_BF16 || cfg->compress == DTR_COMPRESS_FP16 ||
            ((cfg->compress == DTR_COMPRESS_INT8 || cfg->compress == DTR_COMPRESS_TOPK) && b->codec) ||
            (cfg->compress == DTR_COMPRESS_POWERSGD && b->powersgd));
}

static dtr_result dtr__dp_check(dtr_context *ctx, dtr_comm *c, const dtr_dp_config *cfg) {
    if (cfg->root < 0 || cfg->root >= dtr_comm_size(c))
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_dp_create: root %d outside the group of %d", cfg->root,
                         dtr_comm_size(c));
    if (cfg->local_sgd_every < 0 || cfg->local_sgd_warmup < 0)
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_dp_create: local_sgd_every %d and local_sgd_warmup %lld "
                         "must be >= 0", cfg->local_sgd_every, (long long)cfg->local_sgd_warmup);
    if (cfg->zero < 0 || cfg->zero > 3 || cfg->zero3_units < 0)
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_dp_create: zero %d (stages 1, 2, 3) or zero3_units %d (>= 0) out "
                         "of range", cfg->zero, cfg->zero3_units);
    if (cfg->zero2_release_grads && cfg->zero != 2)
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_dp_create: zero2_release_grads is for zero = 2 (ZeRO-3 releases "
                         "gradients unless zero3_keep_grads), not %d", cfg->zero);
    if ((cfg->zero == 3 || cfg->zero2_release_grads) && !dtr__host_memory(ctx))
        return dtr__fail(ctx, DTR_UNSUPPORTED, "dtr_dp_create: %s takes a model in host memory in this version "
                         "(ZeRO-1/2 work on devices)", cfg->zero == 3 ? "ZeRO-3" : "zero2_release_grads");
    if (cfg->zero && ((cfg->compress != DTR_COMPRESS_NONE && cfg->compress != DTR_COMPRESS_BF16 &&
                       cfg->compress != DTR_COMPRESS_FP16) || cfg->local_sgd_every > 0))
        return dtr__fail(ctx, DTR_UNSUPPORTED, "dtr_dp_create: ZeRO-%d takes compress BF16 or FP16 only (its slices "
                         "in 16 bits), and no local SGD (the shards' optimizer needs every step's gradients)", cfg->zero);
    if (c->mem_ctx && cfg->compress != DTR_COMPRESS_NONE && !dtr__comm_takes_host(c) &&
        !dtr__dp_codec_on_device(ctx, c, cfg))
        return dtr__fail(ctx, DTR_UNSUPPORTED, "dtr_dp_create: compression runs on the host, and the group's transport "
                         "(%s) takes device memory only with no staging of host buffers (the backend has no `owns`)",
                         dtr_comm_transport_name(c));
    if (c->mem_ctx && c->mem_ctx != ctx)
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_dp_create: the group's device memory belongs to another context");
    if (c->mem_ctx && dtr__host_memory(ctx))
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_dp_create: a device-memory group needs a device backend");
    return DTR_OK;
}

/* ZeRO releasing gradients: the optimizer's zero_grad discards those outside this rank's
   shard (on 1) */
static void dtr__zero_shard_grads(dtr_dp *dp, int on) {
    int64_t b = 0, e = 0;
    if (dp->z) dtr__zero_shard(dp->z, &b, &e);
    dtr__model_shard_grads(dp->m, on, b, e);
}

dtr_result dtr_dp_create(dtr_model *m, dtr_comm *c, const dtr_dp_config *cfg, dtr_dp **out) {
    dtr_dp_config def = dtr_dp_config_init();
    dtr_context *ctx;
    dtr_dp *dp;
    dtr_result r;
    if (!m || !c || !out) return DTR_NULL_HANDLE;
    *out = NULL;
    if (!cfg) cfg = &def;
    ctx = dtr_model_context(m);
    if ((r = dtr__dp_check(ctx, c, cfg)) != DTR_OK) return r;
    r = dtr_model_build(m);
    if (r != DTR_OK) return r;
    dp = (dtr_dp *)dtr__calloc(&ctx->alloc, sizeof(*dp));
    if (!dp) return dtr__fail(ctx, DTR_OUT_OF_MEMORY, "dtr_dp_create: out of memory");
    dp->m = m;
    dp->c = c;
    dp->ctx = ctx;
    dp->cfg = *cfg;
    if (!dp->cfg.bucket_bytes) dp->cfg.bucket_bytes = (size_t)25 << 20;
    r = dtr__dpc_create(m, c, cfg, dtr__dp_codec_on_device(ctx, c, cfg), &dp->cz);
    if (r != DTR_OK) { dtr_dp_destroy(dp); return r; }
    dtr__dpc_stats(dp->cz)->param_bytes_peak = (uint64_t)dtr_model_numel(m) * sizeof(float);   /* ZeRO-3: its own */
    /* a device model through a host copy: over a host transport, or with a codec on the host
       (a device transport then stages its host buffers in turn) */
    if (dtr_comm_size(c) > 1 && !dtr__host_memory(ctx) &&
        (!c->mem_ctx || (cfg->compress != DTR_COMPRESS_NONE && !dtr__dp_codec_on_device(ctx, c, cfg)))) {
        dp->stage = (float *)dtr__host_alloc(ctx, (size_t)dtr_model_numel(m) * sizeof(float));   /* pinned on CUDA */
        if (!dp->stage) { dtr_dp_destroy(dp); return dtr__fail(ctx, DTR_OUT_OF_MEMORY, "dtr_dp_create: out of memory"); }
    }
    if (dtr_comm_size(c) > 1) {
        r = dtr__dp_buckets(dp);
        if (r == DTR_OK && cfg->find_unused) {
            size_t np = (size_t)dtr_model_param_count(m) + 1;
            dp->used = (float *)dtr__calloc(&ctx->alloc, np * sizeof(float));
            dp->skip = (unsigned char *)dtr__calloc(&ctx->alloc, np);
            if (!dp->used || !dp->skip) r = DTR_OUT_OF_MEMORY;
        }
        if (r != DTR_OK) { dtr_dp_destroy(dp); return dtr__fail(ctx, r, "dtr_dp_create: out of memory"); }
        if (cfg->zero && (r = dtr__zero_create(m, c, cfg, dp->nb, !dp->stage && c->mem_ctx, &dp->z)) != DTR_OK) {
            dtr_dp_destroy(dp);
            return r;
        }
        r = dtr_dp_broadcast_params(dp);
        if (r == DTR_OK) r = dtr_context_add_grad_hook(ctx, dtr__dp_grad_ready, dp, &dp->hook_id);
        if (r == DTR_OK) dtr__grad_hook_defer(ctx, dp->hook_id);   /* dtr_dp_finish starts what it did not */
        /* ZeRO-3 last: it releases the other shards, which a failure after it would lose */
        if (r == DTR_OK && cfg->zero == 3)
            r = dtr__zero3_start(dp->z, dp->nb, dp->param_bucket, cfg->zero3_units ? cfg->zero3_units : 2, dtr__dpc_stats(dp->cz));
        if (r == DTR_OK && dtr__zero_releases_grads(cfg)) dtr__zero_shard_grads(dp, 1);
        if (r != DTR_OK) { dtr_dp_destroy(dp); return r; }
    }
    *out = dp;
    return DTR_OK;
}

/* with a dtr_metrics: the wait and the bucket's whole collective as spans, the wait counted */
static void dtr__dp_observe(dtr_dp *dp, int i, double w0) {
    double t = dtr__obs_now();
    dtr__obs_span(dp->ctx->obs, "wait", DTR__OBS_COMM, 0, i, w0, t);
    dtr__obs_span(dp->ctx->obs, "all_reduce", DTR__OBS_COMM, 1 + i % 16, i, dp->b[i].t_start, t);
    dtr__obs_comm_wait(dp->ctx->obs, t - w0);
}

static dtr_result dtr__dp_wait_all(dtr_dp *dp) {
    dtr_result first = DTR_OK;
    int i;
    for (i = 0; i < dp->nb; i++) {
        if (dp->b[i].req) {
            double w0 = dp->ctx->obs ? dtr__obs_now() : 0.0;
            dtr_result r = dtr_request_wait(dp->b[i].req);
            if (dp->ctx->obs) dtr__dp_observe(dp, i, w0);
            if (r != DTR_OK && first == DTR_OK) first = r;
            dtr_request_destroy(dp->b[i].req);
            dp->b[i].req = NULL;
        }
    }
    return first;
}

void dtr_dp_destroy(dtr_dp *dp) {
    dtr_allocation_callbacks a;
    if (!dp) return;
    a = dp->ctx->alloc;
    if (dtr__zero_releases_grads(&dp->cfg)) dtr__zero_shard_grads(dp, 0);
    if (dp->b) dtr__dp_wait_all(dp), dtr__dp_reset(dp);
    if (dp->hook_id) dtr_context_remove_grad_hook(dp->ctx, dp->hook_id);
    dtr__free(&a, dp->b);
    dtr__free(&a, dp->param_bucket);
    dtr__dpc_destroy(dp->cz);
    dtr__zero_destroy(dp->z);
    if (dp->stage) dtr__host_free(dp->ctx, dp->stage);
    dtr__free(&a, dp->used);
    dtr__free(&a, dp->skip);
    dtr__free(&a, dp);
}

/* `fn` called between a synchronised backward and its finish: described on the group; the
   context stays usable */
static dtr_result dtr__dp_busy(dtr_dp *dp, const char *fn) {
    return dtr__comm_fail(dp->c, NULL, DTR_BAD_STATE, -1, 0,
                          "%s: gradient buckets are in flight (call dtr_dp_finish first)", fn);
}

dtr_result dtr_dp_set_no_sync(dtr_dp *dp, int no_sync) {
    if (!dp) return DTR_NULL_HANDLE;
    if (dp->nb && dp->next > 0) return dtr__dp_busy(dp, "dtr_dp_set_no_sync");
    dp->no_sync = no_sync ? 1 : 0;
    return DTR_OK;
}

static dtr_result dtr__dp_zero1_start(dtr_dp *dp) {
    int64_t n = dtr_model_numel(dp->m);
    dtr_result r = dtr__dp_stage(dp, dtr_model_grads(dp->m), 0, n, 0);
    return r == DTR_OK ? dtr__zero_start(dp->z, dtr__dp_grads(dp), 0, 0, n) : r;
}

/* the reduced gradients back to the device: each bucket's floats (frozen parameters, in none,
   keep the device's zeros: the staging buffer never held them), or with ZeRO this rank's shard */
static dtr_result dtr__dp_unstage_grads(dtr_dp *dp) {
    dtr_result r = DTR_OK;
    int64_t b, e;
    int i;
    if (dp->z) {
        dtr__zero_shard(dp->z, &b, &e);
        return dtr__dp_stage(dp, dtr_model_grads(dp->m), b, e, 1);
    }
    for (i = 0; i < dp->nb && r == DTR_OK; i++) r = dtr__dp_stage(dp, dtr_model_grads(dp->m), dp->b[i].begin, dp->b[i].end, 1);
    return r;
}

/* find_unused: a parameter counts as reached when some rank's backward reached it (the
   optimizer leaves the others out, on every rank alike) */
static dtr_result dtr__dp_find_unused(dtr_dp *dp) {
    int np = dtr_model_param_count(dp->m), i;
    dtr_result r;
    dtr__model_unreached(dp->m, dp->skip);
    for (i = 0; i < np; i++) dp->used[i] = dp->skip[i] ? 0.0f : 1.0f;
    r = dtr_comm_all_reduce(dp->c, dp->used, dp->used, (size_t)np, DTR_F32, DTR_REDUCE_SUM);
    for (i = 0; i < np && r == DTR_OK; i++) dtr__model_set_reached(dp->m, i, dp->used[i] > 0.0f);
    return r;
}

dtr_result dtr_dp_finish(dtr_dp *dp) {
    dtr_result r, w;
    int i;
    if (!dp) return DTR_NULL_HANDLE;
    if (!dp->param_bucket || dp->no_sync || dtr__dp_local(dp)) return DTR_OK;
    if (!dp->used) dtr__model_reach_all(dp->m);   /* the averages: every replica updates every parameter alike */
    dtr__dp_relayout(dp);   /* no gradient reached the hook */
    dtr__obs_phase_begin(dp->ctx, DTR_PHASE_COMM);
    for (i = dp->next; i < dp->nb; i++) dp->b[i].pending = 0;   /* parameters backward did not reach */
    /* ZeRO-1 reduce-scatters the whole buffer at once, in place of the buckets */
    r = dp->cfg.zero == 1 ? dtr__dp_zero1_start(dp) : dtr__dp_launch_ready(dp, 0);
    if (r == DTR_OK) r = dtr__dp_exchange_ready(dp, dp->nb);
    w = dtr__dp_wait_all(dp);
    if (dp->z) {   /* waits for the exchange even after an error */
        dtr_result zr = dtr__zero_reduce(dp->z, dtr__dp_grads(dp), dtr__dpc_stats(dp->cz));
        if (w == DTR_OK) w = zr;
    }
    for (i = 0; i < dp->nb && r == DTR_OK && w == DTR_OK && !dp->z; i++)
        w = dtr__dpc_finish(dp->cz, i, dtr__dp_grads(dp), dp->b[i].begin);
    if (r == DTR_OK && w == DTR_OK) w = dtr__dp_unstage_grads(dp);
    if (r == DTR_OK && w == DTR_OK && dp->used) w = dtr__dp_find_unused(dp);
    dtr__dpc_stats(dp->cz)->syncs++;
    dp->overlapped = 0;
    for (i = 0; i < dp->nb; i++) dp->overlapped += dp->b[i].in_backward;
    dtr__dp_reset(dp);
    dtr__obs_phase_end(dp->ctx, DTR_PHASE_COMM);
    if (r == DTR_OK) r = w;
    if (r != DTR_OK) return dtr__fail(dp->ctx, r, "dtr_dp_finish: %s", dtr_comm_last_error(dp->c));
    return DTR_OK;
}

dtr_result dtr_dp_shard(const dtr_dp *dp, int64_t *begin, int64_t *end) {
    if (!dp || !begin || !end) return DTR_NULL_HANDLE;
    *begin = 0;
    *end = dtr_model_numel(dp->m);
    if (dp->z) dtr__zero_shard(dp->z, begin, end);
    return DTR_OK;
}

dtr_result dtr_dp_shard_optimizer(const dtr_dp *dp, dtr_optimizer_config *oc) {
    if (!dp || !oc) return DTR_NULL_HANDLE;
    oc->shard_sum = dp->z ? dtr__zero_sum : NULL;
    oc->shard_sum_user = oc->shard_sum ? dp->z : NULL;
    return dtr_dp_shard(dp, &oc->shard_begin, &oc->shard_end);
}

/* ZeRO: every rank's updated shard to all; a device model's through the staging buffer */
static dtr_result dtr__dp_zero_gather(dtr_dp *dp, dtr_dp_stats *st) {
    float *prm = dtr_model_params(dp->m);
    int64_t b, e;
    dtr_result r;
    dtr__zero_shard(dp->z, &b, &e);
    r = dtr__dp_stage(dp, prm, b, e, 0);
    if (r == DTR_OK) r = dtr__zero_gather(dp->z, dtr__dp_params(dp), st);
    if (r == DTR_OK) r = dtr__dp_stage(dp, prm, 0, dtr_model_numel(dp->m), 1);
    return r;
}

/* local SGD: the parameters' average over the group */
static dtr_result dtr__dp_param_average(dtr_dp *dp, dtr_dp_stats *st) {
    float *prm = dtr_model_params(dp->m);
    int64_t n = dtr_model_numel(dp->m);
    dtr_result r = dtr__dp_stage(dp, prm, 0, n, 0);
    if (r == DTR_OK) r = dtr_comm_all_reduce(dp->c, dtr__dp_params(dp), dtr__dp_params(dp), (size_t)n, DTR_F32, DTR_REDUCE_AVG);
    if (r == DTR_OK) r = dtr__dp_stage(dp, prm, 0, n, 1);
    if (r != DTR_OK) return dtr__fail(dp->ctx, r, "local SGD: parameter average: %s", dtr_comm_last_error(dp->c));
    st->param_averages++;
    st->wire_bytes += (uint64_t)n * sizeof(float);
    st->raw_bytes += (uint64_t)n * sizeof(float);
    return DTR_OK;
}

static dtr_result dtr__dp_step_done(dtr_dp *dp) {
    dtr_dp_stats *st = dtr__dpc_stats(dp->cz);
    int64_t w;
    if (dp->z) {
        st->steps++;
        if (dp->cfg.zero != 3) return dtr__dp_zero_gather(dp, st);
        dtr__zero3_release_all(dp->z, 0);   /* the next forward gathers */
        return DTR_OK;
    }
    w = ++st->steps - dp->cfg.local_sgd_warmup;
    if (!dp->param_bucket || dp->cfg.local_sgd_every <= 0 || w <= 0 || w % dp->cfg.local_sgd_every) return DTR_OK;
    return dtr__dp_param_average(dp, st);
}

dtr_result dtr_dp_step_done(dtr_dp *dp) {
    dtr_result r;
    if (!dp) return DTR_NULL_HANDLE;
    if (dp->nb && dp->next > 0) return dtr__dp_busy(dp, "dtr_dp_step_done");
    dtr__obs_phase_begin(dp->ctx, DTR_PHASE_COMM);   /* ZeRO's gather, local SGD's average */
    r = dtr__dp_step_done(dp);
    dtr__obs_phase_end(dp->ctx, DTR_PHASE_COMM);
    return r;
}

dtr_result dtr_dp_gather_params(dtr_dp *dp) {
    dtr_result r;
    if (!dp) return DTR_NULL_HANDLE;
    if (!dp->z || dp->cfg.zero != 3) return DTR_OK;
    if (dp->next > 0) return dtr__dp_busy(dp, "dtr_dp_gather_params");
    r = dtr__zero3_gather_all(dp->z);
    return r == DTR_OK ? DTR_OK : dtr__fail(dp->ctx, r, "dtr_dp_gather_params: %s", dtr_comm_last_error(dp->c));
}

dtr_result dtr_dp_get_stats(const dtr_dp *dp, dtr_dp_stats *out) {
    if (!dp || !out) return DTR_NULL_HANDLE;
    *out = *dtr__dpc_stats(dp->cz);
    return DTR_OK;
}

dtr_result dtr_dp_broadcast_params(dtr_dp *dp) {
    float *prm;
    int64_t n;
    dtr_result r;
    if (!dp) return DTR_NULL_HANDLE;
    if (dtr_comm_size(dp->c) == 1) return DTR_OK;
    n = dtr_model_numel(dp->m);
    prm = dtr_model_params(dp->m);
    r = dtr__dp_stage(dp, prm, 0, n, 0);   /* device parameters through the staging buffer */
    if (r == DTR_OK) r = dtr_comm_broadcast(dp->c, dtr__dp_params(dp), (size_t)n, DTR_F32, dp->cfg.root);
    if (r == DTR_OK) r = dtr__dp_stage(dp, prm, 0, n, 1);
    if (r != DTR_OK) return dtr__fail(dp->ctx, r, "data parallel: parameter broadcast: %s", dtr_comm_last_error(dp->c));
    return DTR_OK;
}

dtr_result dtr_dp_average_buffers(dtr_dp *dp) {
    int64_t n;
    float *host;
    dtr_result r;
    if (!dp) return DTR_NULL_HANDLE;
    n = dtr_model_buffer_numel(dp->m);
    if (n == 0 || dtr_comm_size(dp->c) == 1) return DTR_OK;
    host = (float *)dtr__malloc(&dp->ctx->alloc, (size_t)n * sizeof(float));
    if (!host) return dtr__fail(dp->ctx, DTR_OUT_OF_MEMORY, "dtr_dp_average_buffers: out of memory");
    r = dtr_model_read_buffers(dp->m, host, n);
    if (r == DTR_OK && (r = dtr_comm_all_reduce(dp->c, host, host, (size_t)n, DTR_F32, DTR_REDUCE_AVG)) != DTR_OK)
        dtr__fail(dp->ctx, r, "dtr_dp_average_buffers: %s", dtr_comm_last_error(dp->c));
    if (r == DTR_OK) r = dtr_model_write_buffers(dp->m, host, n);
    dtr__free(&dp->ctx->alloc, host);
    return r;
}

dtr_result dtr_comm_report_metric(dtr_comm *c, dtr_optimizer *opt, double metric, double weight, dtr_metric_stats *stats) {
    dtr_context *ctx;
    double v[2];
    dtr_result r;
    if (!c || !opt) return DTR_NULL_HANDLE;
    ctx = dtr__optimizer_context(opt);
    v[0] = weight > 0.0 ? metric * weight : 0.0, v[1] = weight;   /* a rank of weight 0 adds nothing, NaN included */
    if (!(weight >= 0.0) || !isfinite(weight))   /* every rank still takes part: the others wait on it */
        v[0] = 0.0, v[1] = -HUGE_VAL;
    if ((r = dtr__comm_sum_doubles(c, ctx, v, 2, "dtr_comm_report_metric")) != DTR_OK) return r;
    if (!(v[1] > 0.0))
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_comm_report_metric: the weights sum to %g over the group "
                         "(each must be finite and >= 0, one > 0; this rank's %g)", v[1], weight);
    return dtr_optimizer_report_metric(opt, v[0] / v[1], stats);
}

dtr_result dtr_dp_report_metric(dtr_dp *dp, dtr_optimizer *opt, double metric, double weight, dtr_metric_stats *stats) {
    return dp ? dtr_comm_report_metric(dp->c, opt, metric, weight, stats) : DTR_NULL_HANDLE;
}

int dtr_dp_bucket_count(const dtr_dp *dp) { return dp ? dp->nb : 0; }

dtr_result dtr_dp_bucket_range(const dtr_dp *dp, int i, int64_t *begin, int64_t *end) {
    if (!dp || !begin || !end) return DTR_NULL_HANDLE;
    if (i < 0 || i >= dp->nb) return DTR_INVALID_ARGUMENT;
    *begin = dp->b[i].begin;
    *end = dp->b[i].end;
    return DTR_OK;
}

int dtr_dp_overlapped_buckets(const dtr_dp *dp) { return dp ? dp->overlapped : 0; }

/* ---- state ---- */

dtr_result dtr_dp_state(dtr_dp *dp, int index, dtr_state_entry *out) {
    size_t bytes;
    float *resid;
    int dev;
    if (!dp || !out) return DTR_NULL_HANDLE;
    resid = dtr__dpc_residual(dp->cz, &bytes, &dev);
    if (index == 0) return dtr__state_put(out, "no_sync", &dp->no_sync, sizeof dp->no_sync, 0);
    if (index == 1) return dtr__state_put(out, "steps", &dtr__dpc_stats(dp->cz)->steps, sizeof(int64_t), 0);
    if (index == 2 && resid) return dtr__state_put(out, "residual", resid, bytes, dev);
    return DTR_NOT_FOUND;
}

dtr_result dtr_dp_state_loaded(dtr_dp *dp) {
    if (!dp) return DTR_NULL_HANDLE;
    if (dp->no_sync != 0 && dp->no_sync != 1)
        return dtr__fail(dp->ctx, DTR_CORRUPT_FILE, "dtr_dp_state_loaded: no_sync is %d", dp->no_sync);
    if (dtr__dpc_stats(dp->cz)->steps < 0)
        return dtr__fail(dp->ctx, DTR_CORRUPT_FILE, "dtr_dp_state_loaded: steps is %lld",
                         (long long)dtr__dpc_stats(dp->cz)->steps);
    if (dp->z && dp->cfg.zero == 3) dtr__zero3_release_all(dp->z, 1);   /* the restore wrote whole parameters */
    return DTR_OK;
}
