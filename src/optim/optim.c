/* ============================================================================
 * Optimizers (SGD, Adam, AdamW, LAMB) as fused updates over the model's contiguous
 * buffers, learning-rate schedules, gradient clipping and accumulation.
 * The update formulas follow torch.optim (SGD, Adam, AdamW) and You et al. 2019 (LAMB).
 * ==========================================================================*/
#include "../public/api.h"
#include "../core/internal.h"
#include "../core/formulas.h"
#include "../obs/obs_internal.h"
#include <math.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#define DTR__OPT_SQRT4(p) _mm_storeu_ps((p), _mm_sqrt_ps(_mm_loadu_ps(p)))
#elif defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#define DTR__OPT_SQRT4(p) vst1q_f32((p), vsqrtq_f32(vld1q_f32(p)))
#endif

/* Where the state of the trainable floats lives: run r is [lo[r], hi[r]) of the model's
   buffers (parameters alike in weight decay, in learning rate and in the update their state started at), its
   state from float at[r] on; frozen parameters (dtr_model_set_trainable) have none. Without
   frozen parameters and decay exceptions, one run: the optimizer's whole range. */
typedef struct dtr__state_map {
    int64_t *lo, *hi, *at;    /* room for one run more than the model has parameters */
    int *first;               /* the run's first parameter (its decay flag, rate and start stand for the run's) */
    int n;
    int64_t floats;           /* the runs' total: the length of each state buffer */
    unsigned gen;             /* the model's trainable set it was made for (dtr__model_trainable_gen) */
} dtr__state_map;

struct dtr_optimizer {
    dtr_model *model;
    dtr_optimizer_config cfg;
    float *m, *v, *work;      /* backend memory, map.floats each (NULL when unused) */
    int nbuf;                 /* the moment buffers its kind keeps: 0, 1 (m) or 2 (m, v) */
    unsigned char *decays;    /* per parameter, 1 when it takes weight decay (cfg's no_decay read at create) */
    float *lr_scales;         /* per parameter, its learning rate's multiplier (cfg's lr_groups read at create) */
    unsigned char *skip;      /* per parameter, 1 when the update under way leaves it out: no backward reached it */
    int split;                /* the map's runs split on skip (the last update left parameters out) */
    int64_t *started;         /* per parameter, the update count when its state started, moved on by
                                 each update that left it out (-1: frozen, none): steps - started
                                 is its own count, as torch.optim counts a step per parameter (its
                                 bias correction, its first momentum step) */
    int64_t base, len;        /* the floats it updates: [base, base + len) of the model's buffers */
    dtr__state_map map;
    int64_t *seg_begin, *seg_end;   /* LAMB: its parameters' ranges, relative to their run (with
                                       shard_sum: their parts inside the shard) */
    int *seg_param;           /* LAMB: the parameter of each segment */
    int *run_seg;             /* LAMB: run r's segments are [run_seg[r], run_seg[r + 1]) */
    int nseg;
    int64_t steps;            /* updates applied */
    int micro;                /* micro-batches since the last update */
    int64_t skipped;          /* updates skipped for a non-finite gradient (DTR_NONFINITE_SKIP) */
    double last_norm;         /* the last update's gradient norm (-1: none measured) */
    double given_norm;        /* dtr__optimizer_give_norm: the next step's norm, when norm_given */
    int norm_given;
    int keep_grads;           /* an update does not zero the gradients (dtr__optimizer_keep_grads) */
    dtr_metric_stats reports; /* dtr_optimizer_report_metric's counts (saved) */
};

/* ---- schedules ---- */

/* the fraction of the way through a decay of `total` steps at t (1 past its end) */
static double dtr__sched_frac(double t, int64_t total) { return total <= 0 || t >= (double)total ? 1.0 : t / (double)total; }

/* from a (pct 0) to b (pct 1) along half a cosine, as torch's OneCycleLR (_annealing_cos) */
static double dtr__anneal_cos(double a, double b, double pct) { return b + (a - b) / 2.0 * (cos(3.14159265358979323846 * pct) + 1.0); }

/* one-cycle at `step`: 0 while rising (to lr at warmup_steps - 1), 1 while falling (to min_lr at
   warmup_steps + total_steps - 1, and after), with the phase's fraction done (torch's phases) */
static int dtr__cycle_at(const dtr_schedule *s, int64_t step, double *pct) {
    double e1 = (double)s->warmup_steps - 1.0, e2 = (double)(s->warmup_steps + s->total_steps) - 1.0, t = (double)step;
    if (t <= e1) {
        *pct = e1 > 0.0 ? t / e1 : 1.0;
        return 0;
    }
    *pct = t >= e2 ? 1.0 : (t - e1) / (e2 - e1);
    return 1;
}

/* cosine restarts at t: lr from min_lr's side, the cycle's step over its length (torch's
   T_cur / T_i, counted as its step() does: each cycle gamma times the last) */
static double dtr__restart_frac(const dtr_schedule *s, int64_t t) {
    int64_t len = s->step_size, mult = (int64_t)s->gamma;
    if (mult <= 1) return (double)(t % len) / (double)len;
    while (t >= len && len <= INT64_MAX / mult) t -= len, len *= mult;
    return (double)t / (double)len;
}

/* multi-step: the milestones at or before t */
static int dtr__milestones_passed(const dtr_schedule *s, int64_t t) {
    int k = 0;
    while (k < DTR_SCHED_MAX_MILESTONES && s->milestones[k] > 0 && s->milestones[k] <= t) k++;
    return k;
}

/* dtr_schedule_momentum in double (beta1 stays double, as the config's) */
static double dtr__schedule_momentum_d(const dtr_schedule *s, int64_t step, double momentum) {
    double pct;
    if (!s || s->kind != DTR_SCHED_ONE_CYCLE || !(s->max_momentum > 0.0f)) return momentum;
    if (step < 0) step = 0;
    return dtr__cycle_at(s, step, &pct) == 0 ? dtr__anneal_cos(s->max_momentum, s->base_momentum, pct)
                                              : dtr__anneal_cos(s->base_momentum, s->max_momentum, pct);
}

float dtr_schedule_momentum(const dtr_schedule *s, int64_t step, float momentum) {
    return (float)dtr__schedule_momentum_d(s, step, momentum);
}

float dtr_schedule_lr(const dtr_schedule *s, int64_t step) {
    double lr = s ? s->lr : 0.0, mn = s ? s->min_lr : 0.0, t, f, ts;
    if (!s) return 0.0f;
    if (step < 0) step = 0;
    if (s->kind == DTR_SCHED_ONE_CYCLE)   /* its warm-up is the cosine's rise */
        return (float)(dtr__cycle_at(s, step, &f) == 0 ? dtr__anneal_cos(s->start_lr, lr, f) : dtr__anneal_cos(lr, mn, f));
    if (s->warmup_steps > 0 && step < s->warmup_steps) return (float)(lr * (double)(step + 1) / (double)s->warmup_steps);
    t = (double)(step - (s->warmup_steps > 0 ? s->warmup_steps : 0));
    f = dtr__sched_frac(t, s->total_steps);
    switch (s->kind) {
    case DTR_SCHED_STEP: return (float)(lr * pow(s->gamma, floor(t / (double)(s->step_size > 0 ? s->step_size : 1))));
    case DTR_SCHED_COSINE:
        return (float)(f >= 1.0 ? mn : mn + 0.5 * (lr - mn) * (1.0 + cos(3.14159265358979323846 * t / (double)s->total_steps)));
    case DTR_SCHED_LINEAR: return (float)(lr + (mn - lr) * f);
    case DTR_SCHED_EXPONENTIAL: return (float)(lr * pow(s->gamma, t));
    case DTR_SCHED_POLY: return (float)(mn + (lr - mn) * pow(1.0 - f, s->gamma));
    case DTR_SCHED_INV_SQRT:
        ts = (double)(s->step_size > 0 ? s->step_size : s->warmup_steps > 0 ? s->warmup_steps : 10000);
        return (float)(lr / sqrt((t + ts) / ts));
    case DTR_SCHED_MULTISTEP: return (float)(lr * pow(s->gamma, dtr__milestones_passed(s, (int64_t)t)));
    case DTR_SCHED_COSINE_RESTARTS:
        return (float)(mn + (lr - mn) * (1.0 + cos(3.14159265358979323846 * dtr__restart_frac(s, (int64_t)t))) / 2.0);
    default: return (float)lr;   /* constant, plateau (the optimizer lowers s->lr) */
    }
}

/* dtr__schedule_bad's checks of the milestones and one-cycle's fields */
static const char *dtr__schedule_bad_more(const dtr_schedule *s) {
    int k;
    for (k = 0; s->kind == DTR_SCHED_MULTISTEP && k < DTR_SCHED_MAX_MILESTONES; k++)
        if (s->milestones[k] < 0 || (k > 0 && s->milestones[k] && s->milestones[k] <= s->milestones[k - 1]) ||
            (k > 0 && s->milestones[k] && !s->milestones[k - 1]))
            return "milestones must be > 0 and ascending, a 0 ending them";
    if (s->max_momentum != 0.0f && s->kind != DTR_SCHED_ONE_CYCLE) return "max_momentum is for one-cycle schedules";
    if (s->kind != DTR_SCHED_ONE_CYCLE) return NULL;
    if (!(s->start_lr >= 0.0f) || !isfinite(s->start_lr)) return "one-cycle needs a finite start_lr >= 0";
    if (s->max_momentum != 0.0f && !(s->max_momentum > 0.0f && s->max_momentum < 1.0f && s->base_momentum > 0.0f &&
                                     s->base_momentum < 1.0f))
        return "one-cycle's max_momentum and base_momentum must be in (0, 1) (max_momentum 0: not cycled)";
    return NULL;
}

/* NULL when s is a schedule dtr_schedule_lr can follow, else what is wrong with it (its lr
   aside: dtr_optimizer_create checks it, dtr_optimizer_set_lr replaces it) */
static const char *dtr__schedule_bad(const dtr_schedule *s) {
    dtr_schedule_kind k = s->kind;
    int decays = k == DTR_SCHED_COSINE || k == DTR_SCHED_LINEAR || k == DTR_SCHED_POLY || k == DTR_SCHED_ONE_CYCLE;
    if ((int)k < 0 || k > DTR_SCHED_PLATEAU) return "unknown kind";
    if (s->warmup_steps < 0 || s->step_size < 0) return "warmup_steps and step_size must be >= 0";
    if (decays && (s->total_steps <= 0 || !(s->min_lr >= 0.0f) || !isfinite(s->min_lr)))
        return "a decay (cosine, linear, polynomial, one-cycle) needs total_steps > 0 and a finite min_lr >= 0";
    if ((k == DTR_SCHED_COSINE_RESTARTS || k == DTR_SCHED_PLATEAU) && (!(s->min_lr >= 0.0f) || !isfinite(s->min_lr)))
        return "min_lr must be finite and >= 0";
    if ((k == DTR_SCHED_STEP || k == DTR_SCHED_EXPONENTIAL || k == DTR_SCHED_POLY || k == DTR_SCHED_MULTISTEP) &&
        !(s->gamma > 0.0f && isfinite(s->gamma)))
        return "gamma (the step and exponential factor, the polynomial power) must be > 0";
    if ((k == DTR_SCHED_STEP || k == DTR_SCHED_COSINE_RESTARTS) && s->step_size <= 0)
        return "the step and restarts schedules need step_size > 0";
    if (k == DTR_SCHED_COSINE_RESTARTS && !(s->gamma >= 1.0f && s->gamma <= 1e6f && s->gamma == (float)(int64_t)s->gamma))
        return "the restarts' gamma (each cycle's growth) must be a whole number from 1 to 1e6";
    if (k == DTR_SCHED_PLATEAU && !(s->gamma > 0.0f && s->gamma < 1.0f)) return "the plateau's gamma must be in (0, 1)";
    if (!(s->threshold >= 0.0f) || !isfinite(s->threshold) || s->cooldown < 0)
        return "threshold must be finite and >= 0, cooldown >= 0";
    return dtr__schedule_bad_more(s);
}

/* ---- configuration ---- */

dtr_optimizer_config dtr_optimizer_config_init(dtr_optimizer_kind kind, float lr) {
    dtr_optimizer_config c;
    memset(&c, 0, sizeof(c));
    c.kind = kind;
    c.schedule.kind = DTR_SCHED_CONSTANT;
    c.schedule.lr = lr;
    c.schedule.gamma = 0.1f;
    c.beta1 = 0.9;
    c.beta2 = 0.999;
    if (kind == DTR_OPT_RMSPROP) c.beta2 = 0.99;   /* torch's alpha */
    c.eps = kind == DTR_OPT_LAMB ? 1e-6f : kind == DTR_OPT_ADAGRAD ? 1e-10f : 1e-8f;
    c.weight_decay = kind == DTR_OPT_ADAMW ? 0.01f : 0.0f;
    c.grad_accum_steps = 1;
    return c;
}

/* 1 when x is 0, the buffer's end, or where a parameter starts or ends */
static int dtr__on_boundary(const dtr_model *m, int64_t x) {
    int i;
    if (x == 0 || x == dtr_model_numel(m)) return 1;
    for (i = 0; i < dtr_model_param_count(m); i++) {
        int64_t b = dtr_model_param_offset(m, i);
        if (x == b || x == b + dtr_tensor_numel(dtr_model_param_at(m, i))) return 1;
    }
    return 0;
}

static dtr_result dtr__check_shard(dtr_model *m, const dtr_optimizer_config *cfg) {
    if (cfg->shard_end <= 0 && cfg->shard_begin == 0) return DTR_OK;
    if (cfg->shard_begin < 0 || cfg->shard_end < cfg->shard_begin || cfg->shard_end > dtr_model_numel(m))
        return dtr__fail(dtr_model_context(m), DTR_INVALID_ARGUMENT, "dtr_optimizer_create: shard [%lld, %lld) is not a "
                         "range of the parameter buffer (%lld floats)", (long long)cfg->shard_begin,
                         (long long)cfg->shard_end, (long long)dtr_model_numel(m));
    if (cfg->kind == DTR_OPT_LAMB && !cfg->shard_sum &&
        (!dtr__on_boundary(m, cfg->shard_begin) || !dtr__on_boundary(m, cfg->shard_end)))
        return dtr__fail(dtr_model_context(m), DTR_INVALID_ARGUMENT, "dtr_optimizer_create: LAMB's trust ratio is per "
                         "parameter: shard [%lld, %lld) must hold whole parameters (dtr_dp_config.zero_whole_params) "
                         "or give shard_sum", (long long)cfg->shard_begin, (long long)cfg->shard_end);
    if (cfg->kind == DTR_OPT_LAMB && cfg->shard_sum && !dtr__host_memory(dtr_model_context(m)))
        return dtr__fail(dtr_model_context(m), DTR_UNSUPPORTED, "dtr_optimizer_create: LAMB with shard_sum needs "
                                                                "parameters in host memory");
    return DTR_OK;
}

/* LAMB's per-parameter segments: the parameters inside each run, relative to the run's start;
   with shard_sum (one run, the shard) the parts of those that cross its ends too */
static void dtr__lamb_segments(dtr_optimizer *o) {
    int i, r;
    o->nseg = 0;
    for (r = 0; r < o->map.n; r++) {
        int64_t lo = o->map.lo[r], hi = o->map.hi[r];
        o->run_seg[r] = o->nseg;
        for (i = 0; i < dtr_model_param_count(o->model); i++) {
            int64_t b = dtr_model_param_offset(o->model, i), e = b + dtr_tensor_numel(dtr_model_param_at(o->model, i));
            if (o->cfg.shard_sum) b = b > lo ? b : lo, e = e < hi ? e : hi;
            if (b < lo || e > hi || b >= e) continue;
            o->seg_param[o->nseg] = i;
            o->seg_begin[o->nseg] = b - lo;
            o->seg_end[o->nseg++] = e - lo;
        }
    }
    o->run_seg[o->map.n] = o->nseg;
}

/* ---- the state's layout ---- */

/* Parameter i's weight decay flag from cfg: not for fewer than 2 dimensions with
   decay_matrices_only, nor for a name no_decay matches. */
static int dtr__decays(const dtr_model *m, const dtr_optimizer_config *cfg, int i) {
    const dtr_tensor *t = dtr_model_param_at(m, i);
    if (cfg->decay_matrices_only && dtr_tensor_ndim(t) < 2) return 0;
    return !(cfg->n_no_decay > 0 && cfg->no_decay && dtr__name_matches(dtr_tensor_name(t), cfg->no_decay, cfg->n_no_decay));
}

/* Parameters i and j share a run of state: both trainable, alike in decay, learning rate and
   start, and both in the update under way or both out of it. */
static int dtr__same_run(const dtr_optimizer *o, int i, int j) {
    return dtr_model_param_trainable(o->model, j) && o->decays[j] == o->decays[i] && o->started[j] == o->started[i] &&
           o->lr_scales[j] == o->lr_scales[i] && o->skip[j] == o->skip[i];
}

/* map's runs: consecutive trainable parameters alike in decay, learning rate and start (from the first one's
   offset to the next parameter's: the padding between them included), inside [base, base + len) */
static void dtr__map_fill(const dtr_optimizer *o, dtr__state_map *map) {
    int64_t lo = o->base, hi = o->base + o->len;
    int np = dtr_model_param_count(o->model), i = 0, j;
    map->n = 0, map->floats = 0;
    map->gen = dtr__model_trainable_gen(o->model);
    for (; i < np; i = j) {
        int64_t rb = dtr_model_param_offset(o->model, i), re;
        if (!dtr_model_param_trainable(o->model, i)) { j = i + 1; continue; }
        for (j = i + 1; j < np && dtr__same_run(o, i, j); j++) {}
        re = j < np ? dtr_model_param_offset(o->model, j) : dtr_model_numel(o->model);
        rb = rb > lo ? rb : lo, re = re < hi ? re : hi;
        if (rb >= re) continue;
        map->lo[map->n] = rb, map->hi[map->n] = re, map->first[map->n] = i, map->at[map->n++] = map->floats;
        map->floats += re - rb;
    }
}

static void dtr__map_free(dtr_context *ctx, dtr__state_map *map) {
    dtr__free(&ctx->alloc, map->lo), dtr__free(&ctx->alloc, map->hi), dtr__free(&ctx->alloc, map->at);
    dtr__free(&ctx->alloc, map->first);
    memset(map, 0, sizeof *map);
}

/* Copies the floats both maps hold from state src (laid out by `from`) to dst (by `to`). */
static dtr_result dtr__map_carry(dtr_context *ctx, const dtr__state_map *from, const float *src, const dtr__state_map *to,
                                 float *dst) {
    dtr_result r = DTR_OK;
    int a, b;
    for (a = 0; a < to->n && r == DTR_OK; a++)
        for (b = 0; b < from->n && r == DTR_OK; b++) {
            int64_t lo = to->lo[a] > from->lo[b] ? to->lo[a] : from->lo[b], hi = to->hi[a] < from->hi[b] ? to->hi[a] : from->hi[b];
            if (lo < hi)
                r = dtr__mem_copy(ctx, dst + to->at[a] + (lo - to->lo[a]), src + from->at[b] + (lo - from->lo[b]),
                                  (size_t)(hi - lo) * sizeof(float));
        }
    return r;
}

static void dtr__state_free(dtr_context *ctx, float *buf[3]) {
    int k;
    for (k = 0; k < 3; k++)
        if (buf[k]) ctx->backend->mem_free(ctx, buf[k]);
}

/* The state buffers of `floats` each: the kind's moments (zeroed) and LAMB's work. */
static dtr_result dtr__state_alloc(dtr_optimizer *o, int64_t floats, float *buf[3]) {
    dtr_context *ctx = dtr_model_context(o->model);
    size_t bytes = (size_t)(floats ? floats : 1) * sizeof(float);
    int k;
    for (k = 0; k < 3; k++) {
        if (k < 2 ? k >= o->nbuf : o->cfg.kind != DTR_OPT_LAMB) continue;
        buf[k] = (float *)ctx->backend->mem_alloc(ctx, bytes);
        if (!buf[k] || (k < 2 && ctx->backend->memset0(ctx, buf[k], bytes) != DTR_OK)) return DTR_OUT_OF_MEMORY;
    }
    return DTR_OK;
}

/* o->started for the model's trainable set: newly trainable parameters start at this update,
   frozen ones hold no state (-1), the others keep theirs */
static void dtr__mark_started(dtr_optimizer *o) {
    int i;
    for (i = 0; i < dtr_model_param_count(o->model); i++)
        if (!dtr_model_param_trainable(o->model, i)) o->started[i] = -1;
        else if (o->started[i] < 0) o->started[i] = o->steps;
}

/* Lays the state out for the model's trainable set, at create and again after it changed
   (dtr_model_set_trainable after dtr_optimizer_create): the moments of floats trainable before
   and now are carried over, newly trainable ones start from zero (and from step 1 of their bias
   correction), frozen ones hold none. */
static dtr_result dtr__layout(dtr_optimizer *o) {
    dtr_context *ctx = dtr_model_context(o->model);
    size_t cap = (size_t)(dtr_model_param_count(o->model) + 1) * sizeof(int64_t);
    float *buf[3] = {NULL, NULL, NULL}, *old[3];
    dtr__state_map map;
    dtr_result r = DTR_OK;
    if (o->map.lo && o->map.gen == dtr__model_trainable_gen(o->model)) return DTR_OK;
    memset(&map, 0, sizeof map);
    map.lo = (int64_t *)dtr__malloc(&ctx->alloc, cap), map.hi = (int64_t *)dtr__malloc(&ctx->alloc, cap);
    map.at = (int64_t *)dtr__malloc(&ctx->alloc, cap), map.first = (int *)dtr__malloc(&ctx->alloc, cap);
    if (!map.lo || !map.hi || !map.at || !map.first) r = DTR_OUT_OF_MEMORY;
    if (r == DTR_OK) dtr__mark_started(o), dtr__map_fill(o, &map), r = dtr__state_alloc(o, map.floats, buf);
    if (r == DTR_OK && o->m) r = dtr__map_carry(ctx, &o->map, o->m, &map, buf[0]);
    if (r == DTR_OK && o->v) r = dtr__map_carry(ctx, &o->map, o->v, &map, buf[1]);
    if (r != DTR_OK) {
        int64_t floats = map.floats;
        dtr__state_free(ctx, buf), dtr__map_free(ctx, &map);
        return dtr__fail(ctx, r, "dtr_optimizer: out of memory for the optimizer state (%lld floats a buffer)", (long long)floats);
    }
    old[0] = o->m, old[1] = o->v, old[2] = o->work;
    dtr__state_free(ctx, old);
    dtr__map_free(ctx, &o->map);
    o->map = map, o->m = buf[0], o->v = buf[1], o->work = buf[2];
    if (o->run_seg) dtr__lamb_segments(o);
    return DTR_OK;
}

/* Parameter i's learning-rate multiplier: the first lr group naming it, else 1. */
static float dtr__lr_scale(const dtr_model *m, const dtr_optimizer_config *cfg, int i) {
    const char *name = dtr_tensor_name(dtr_model_param_at(m, i));
    int k;
    for (k = 0; k < cfg->n_lr_groups; k++)
        if (dtr__name_matches(name, &cfg->lr_groups[k].match, 1)) return cfg->lr_groups[k].scale;
    return 1.0f;
}

/* o->decays and o->lr_scales from the config (whose no_decay patterns and lr groups are not
   kept: the app's arrays may go; without weight decay every flag is 1, so the exceptions split
   no run), o->started empty */
static dtr_result dtr__param_flags(dtr_optimizer *o) {
    dtr_context *ctx = dtr_model_context(o->model);
    int np = dtr_model_param_count(o->model), i;
    o->decays = (unsigned char *)dtr__malloc(&ctx->alloc, (size_t)np + 1);
    o->started = (int64_t *)dtr__malloc(&ctx->alloc, ((size_t)np + 1) * sizeof(int64_t));
    o->lr_scales = (float *)dtr__malloc(&ctx->alloc, ((size_t)np + 1) * sizeof(float));
    o->skip = (unsigned char *)dtr__calloc(&ctx->alloc, (size_t)np + 1);
    if (!o->decays || !o->started || !o->lr_scales || !o->skip) return dtr__fail(ctx, DTR_OUT_OF_MEMORY, "dtr_optimizer_create: out of memory");
    o->started[np] = -1;
    for (i = 0; i < np; i++) {
        o->started[i] = -1;
        o->decays[i] = (unsigned char)(o->cfg.weight_decay == 0.0f || dtr__decays(o->model, &o->cfg, i));
        o->lr_scales[i] = dtr__lr_scale(o->model, &o->cfg, i);
    }
    o->cfg.no_decay = NULL, o->cfg.n_no_decay = 0;
    o->cfg.lr_groups = NULL, o->cfg.n_lr_groups = 0;
    return DTR_OK;
}

/* cfg's schedule and learning-rate groups can be followed */
static dtr_result dtr__check_rates(dtr_context *ctx, const dtr_optimizer_config *cfg) {
    const char *bad = dtr__schedule_bad(&cfg->schedule);
    int k;
    if (bad) return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_optimizer_create: schedule (kind %d): %s", (int)cfg->schedule.kind, bad);
    if (cfg->n_lr_groups < 0 || (cfg->n_lr_groups > 0 && !cfg->lr_groups))
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_optimizer_create: %d lr_groups at %p", cfg->n_lr_groups,
                         (const void *)cfg->lr_groups);
    for (k = 0; k < cfg->n_lr_groups; k++)
        if (!cfg->lr_groups[k].match || !(cfg->lr_groups[k].scale >= 0.0f) || !isfinite(cfg->lr_groups[k].scale))
            return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_optimizer_create: lr group %d needs a name pattern and a "
                             "finite scale >= 0 (has %s, %g)", k, cfg->lr_groups[k].match ? "one" : "NULL",
                             (double)cfg->lr_groups[k].scale);
    return DTR_OK;
}

/* the momentum the update starts with: one-cycle's max_momentum when it cycles it, else cfg's */
static float dtr__start_momentum(const dtr_optimizer_config *cfg) {
    return cfg->schedule.max_momentum > 0.0f ? cfg->schedule.max_momentum : cfg->momentum;
}

/* cfg's fields in range, and its schedule one dtr_schedule_lr can follow */
static dtr_result dtr__check_config(dtr_context *ctx, const dtr_optimizer_config *cfg) {
    if ((int)cfg->kind < 0 || cfg->kind > DTR_OPT_ADAGRAD)
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_optimizer_create: unknown optimizer kind %d", (int)cfg->kind);
    if (!(cfg->schedule.lr >= 0.0f) || !(cfg->momentum >= 0.0f) || !(cfg->weight_decay >= 0.0f) || !(cfg->eps >= 0.0f) ||
        !(cfg->beta1 >= 0.0 && cfg->beta1 < 1.0) || !(cfg->beta2 >= 0.0 && cfg->beta2 < 1.0) || cfg->grad_accum_steps < 0 ||
        !(cfg->clip_norm >= 0.0f))
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_optimizer_create: lr, momentum, weight_decay, eps, clip_norm must be "
                                                    ">= 0 and betas in [0, 1)");
    if ((int)cfg->nonfinite < 0 || cfg->nonfinite > DTR_NONFINITE_OFF)
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_optimizer_create: unknown nonfinite policy %d", (int)cfg->nonfinite);
    if (cfg->nesterov && (dtr__start_momentum(cfg) <= 0.0f || cfg->dampening != 0.0f))
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_optimizer_create: Nesterov needs momentum > 0 and zero dampening");
    if (cfg->kind == DTR_OPT_ADAGRAD && cfg->schedule.max_momentum > 0.0f)
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_optimizer_create: Adagrad has no momentum for one-cycle to cycle "
                         "(schedule.max_momentum 0)");
    return dtr__check_rates(ctx, cfg);
}

dtr_result dtr_optimizer_create(dtr_model *model, const dtr_optimizer_config *cfg, dtr_optimizer **out) {
    dtr_context *ctx;
    dtr_optimizer *o;
    dtr_result r;
    float momentum;
    if (!model || !cfg || !out) return DTR_NULL_HANDLE;
    *out = NULL;
    ctx = dtr_model_context(model);
    if ((r = dtr__check_config(ctx, cfg)) != DTR_OK) return r;
    momentum = dtr__start_momentum(cfg);
    r = dtr_model_build(model);
    if (r != DTR_OK) return r;
    if ((r = dtr__check_shard(model, cfg)) != DTR_OK) return r;
    o = (dtr_optimizer *)dtr__calloc(&ctx->alloc, sizeof(*o));
    if (!o) return dtr__fail(ctx, DTR_OUT_OF_MEMORY, "dtr_optimizer_create: out of memory");
    o->model = model;
    o->cfg = *cfg;
    o->last_norm = -1.0;
    if (o->cfg.grad_accum_steps < 1) o->cfg.grad_accum_steps = 1;
    o->base = cfg->shard_end > 0 ? cfg->shard_begin : 0;
    o->len = cfg->shard_end > 0 ? cfg->shard_end - cfg->shard_begin : dtr_model_numel(model);
    o->nbuf = cfg->kind == DTR_OPT_SGD ? (momentum > 0.0f ? 1 : 0)
              : cfg->kind == DTR_OPT_ADAGRAD || (cfg->kind == DTR_OPT_RMSPROP && momentum <= 0.0f) ? 1 : 2;
    o->reports.best = cfg->schedule.maximize ? -HUGE_VAL : HUGE_VAL;
    if ((r = dtr__param_flags(o)) != DTR_OK) {
        dtr_optimizer_destroy(o);
        return r;
    }
    if (cfg->kind == DTR_OPT_LAMB) {
        size_t n = (size_t)dtr_model_param_count(model) + 2;
        o->seg_begin = (int64_t *)dtr__malloc(&ctx->alloc, n * sizeof(int64_t));
        o->seg_end = (int64_t *)dtr__malloc(&ctx->alloc, n * sizeof(int64_t));
        o->seg_param = (int *)dtr__malloc(&ctx->alloc, n * sizeof(int));
        o->run_seg = (int *)dtr__malloc(&ctx->alloc, n * sizeof(int));
        if (!o->seg_begin || !o->seg_end || !o->seg_param || !o->run_seg) {
            dtr_optimizer_destroy(o);
            return dtr__fail(ctx, DTR_OUT_OF_MEMORY, "dtr_optimizer_create: out of memory");
        }
    }
    if ((r = dtr__layout(o)) != DTR_OK) {
        dtr_optimizer_destroy(o);
        return r;
    }
    *out = o;
    return DTR_OK;
}

void dtr_optimizer_destroy(dtr_optimizer *o) {
    dtr_context *ctx;
    float *buf[3];
    if (!o) return;
    ctx = dtr_model_context(o->model);
    buf[0] = o->m, buf[1] = o->v, buf[2] = o->work;
    dtr__state_free(ctx, buf);
    dtr__map_free(ctx, &o->map);
    dtr__free(&ctx->alloc, o->seg_begin);
    dtr__free(&ctx->alloc, o->seg_end);
    dtr__free(&ctx->alloc, o->seg_param);
    dtr__free(&ctx->alloc, o->run_seg);
    dtr__free(&ctx->alloc, o->decays);
    dtr__free(&ctx->alloc, o->started);
    dtr__free(&ctx->alloc, o->lr_scales);
    dtr__free(&ctx->alloc, o->skip);
    dtr__free(&ctx->alloc, o);
}

int64_t dtr_optimizer_steps(const dtr_optimizer *o) { return o ? o->steps : 0; }
int64_t dtr_optimizer_skipped(const dtr_optimizer *o) { return o ? o->skipped : 0; }
double dtr_optimizer_grad_norm(const dtr_optimizer *o) { return o ? o->last_norm : 0.0; }
float dtr_optimizer_lr(const dtr_optimizer *o) { return o ? dtr_schedule_lr(&o->cfg.schedule, o->steps) : 0.0f; }
void dtr_optimizer_set_lr(dtr_optimizer *o, float lr) { if (o) o->cfg.schedule.lr = lr; }

/* metric a improves on best by s's threshold (torch's ReduceLROnPlateau.is_better; NaN never) */
static int dtr__metric_better(const dtr_schedule *s, double a, double best) {
    double th = s->threshold;
    if (s->maximize) return s->threshold_abs ? a > best + th : a > best * (th + 1.0);
    return s->threshold_abs ? a < best - th : a < best * (1.0 - th);
}

dtr_result dtr_optimizer_report_metric(dtr_optimizer *o, double metric, dtr_metric_stats *stats) {
    dtr_metric_stats *st;
    dtr_schedule *s;
    if (!o) return DTR_NULL_HANDLE;
    st = &o->reports, s = &o->cfg.schedule;
    st->reports++;
    st->improved = dtr__metric_better(s, metric, st->best), st->dropped = 0;
    if (st->improved) st->best = metric, st->bad = 0, st->stale = 0;
    else st->bad++, st->stale++;
    if (st->cooldown > 0) st->cooldown--, st->bad = 0;
    if (s->kind == DTR_SCHED_PLATEAU && st->bad > s->step_size) {   /* torch's _reduce_lr */
        double lr = (double)s->lr, next = lr * (double)s->gamma > (double)s->min_lr ? lr * (double)s->gamma : (double)s->min_lr;
        if (lr - next > 1e-8) {
            s->lr = (float)next, st->dropped = 1, st->drops++;
            dtr__ctx_log(dtr_model_context(o->model), DTR_LOG_INFO, "dtr_optimizer: no improvement on %g in %lld reports: "
                         "the learning rate drops from %g to %g", st->best, (long long)st->bad, lr, next);
        }
        st->cooldown = s->cooldown, st->bad = 0;
    }
    if (stats) *stats = *st;
    return DTR_OK;
}

dtr_result dtr_optimizer_metric_stats(const dtr_optimizer *o, dtr_metric_stats *stats) {
    if (!o || !stats) return DTR_NULL_HANDLE;
    *stats = o->reports;
    return DTR_OK;
}

float *dtr_optimizer_moments(dtr_optimizer *o, int index, int *count) {
    int n;
    if (!o || dtr__layout(o) != DTR_OK) { if (count) *count = 0; return NULL; }
    n = (o->m ? 1 : 0) + (o->v ? 1 : 0);
    if (count) *count = n;
    if (index == 0) return o->m;
    if (index == 1) return o->v;
    return NULL;
}

size_t dtr_optimizer_state_bytes(dtr_optimizer *o) {
    int n = 0;
    if (!dtr_optimizer_moments(o, 0, &n)) return 0;
    return (size_t)n * (size_t)o->map.floats * sizeof(float);
}

/* ---- clipping ---- */

/* the whole model's gradient norm (tensor-parallel shards summed over their group) */
static dtr_result dtr__grad_norm(dtr_model *m, double *norm) {
    double s = 0.0;
    dtr_result r = dtr__model_grad_sumsq(m, 0, dtr_model_numel(m), &s);
    *norm = sqrt(s);
    return r;
}

dtr_result dtr_clip_grad_norm(dtr_model *m, float max_norm, float *norm_out) {
    dtr_context *ctx;
    double norm;
    dtr_result r;
    if (!m) return DTR_NULL_HANDLE;
    ctx = dtr_model_context(m);
    if (!(max_norm > 0.0f)) return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_clip_grad_norm: max_norm must be > 0");
    r = dtr_model_build(m);
    if (r != DTR_OK) return r;
    r = dtr__grad_norm(m, &norm);
    if (r != DTR_OK) return r;
    if (norm_out) *norm_out = (float)norm;
    if (!isfinite(norm))   /* never scale by NaN: leave the gradients to the optimizer's policy */
        return dtr__note(ctx, DTR_NONFINITE, "dtr_clip_grad_norm: the gradients' global norm is %s: not clipped "
                         "(anomaly mode, dtr_context_set_anomaly, names the op that made it)", isnan(norm) ? "NaN" : "Inf");
    if (norm > max_norm) return dtr__model_grad_scale(m, (float)(max_norm / (norm + 1e-6)));
    return DTR_OK;
}

/* ---- the update ---- */

/* the norm clip_norm takes: the whole buffer's, with shard_sum the group's over the shards,
   and with norm_sum over the model's other parts too (tensor-parallel shards are summed over
   their group in every case) */
dtr_result dtr__optimizer_grad_norm(dtr_optimizer *o, double *norm) {
    double s = 0.0;
    dtr_result r;
    if (!o->cfg.shard_sum && !o->cfg.norm_sum) return dtr__grad_norm(o->model, norm);
    r = dtr__model_grad_sumsq(o->model, o->base, o->base + o->len, &s);
    if (r == DTR_OK && o->cfg.shard_sum) r = o->cfg.shard_sum(o->cfg.shard_sum_user, &s, 1);
    if (r == DTR_OK && o->cfg.norm_sum) r = o->cfg.norm_sum(o->cfg.norm_sum_user, &s, 1);
    *norm = sqrt(s);
    return r;
}

/* The norm of the floats an update over [begin, end) reads: the optimizer's norm for all of
 * them (the whole gradient, or the group's with shard_sum), else the range's own. */
static dtr_result dtr__range_norm(dtr_optimizer *o, int64_t begin, int64_t end, double *norm) {
    double s = 0.0;
    dtr_result r;
    if (begin == o->base && end == o->base + o->len) {
        if (!o->norm_given) return dtr__optimizer_grad_norm(o, norm);
        *norm = o->given_norm;   /* the loss scaler's, measured on these gradients */
        return DTR_OK;
    }
    r = dtr__grad_sumsq_range(o->model, begin, end, &s);
    *norm = sqrt(s);
    return r;
}

/* A non-finite norm under the policy: 1 in *skip to skip the update, or the error */
static dtr_result dtr__nonfinite(dtr_optimizer *o, double norm, int *skip) {
    dtr_context *ctx = dtr_model_context(o->model);
    const char *k = isnan(norm) ? "NaN" : "Inf";
    if (o->cfg.nonfinite == DTR_NONFINITE_STOP)
        return dtr__fail(ctx, DTR_NONFINITE, "dtr_optimizer_step: the gradient's global norm is %s before update %lld: "
                         "stopped (nonfinite policy STOP; anomaly mode, dtr_context_set_anomaly, names the op that made "
                         "it)", k, (long long)o->steps + 1);
    if (o->cfg.nonfinite == DTR_NONFINITE_WARN) {
        dtr__ctx_log(ctx, DTR_LOG_WARN, "dtr_optimizer_step: the gradient's global norm is %s before update %lld: "
                     "applied anyway (nonfinite policy WARN)", k, (long long)o->steps + 1);
        return DTR_OK;
    }
    *skip = 1;
    o->skipped++;
    dtr__ctx_log(ctx, DTR_LOG_WARN, "dtr_optimizer_step: the gradient's global norm is %s before update %lld: update "
                 "skipped, gradients zeroed (%lld skipped so far)", k, (long long)o->steps + 1, (long long)o->skipped);
    return DTR_OK;
}

/* Before an update: the gradient norm (for clip_norm and the nonfinite policy), clipping
 * folded into a->grad_scale, and the policy's decision (*skip 1: no update). */
static dtr_result dtr__check_grads(dtr_optimizer *o, dtr__opt_args *a, int64_t begin, int64_t end, int *skip) {
    double norm;
    dtr_result r;
    *skip = 0;
    if (o->cfg.clip_norm <= 0.0f && o->cfg.nonfinite == DTR_NONFINITE_OFF) return DTR_OK;
    if ((r = dtr__range_norm(o, begin, end, &norm)) != DTR_OK) return r;
    norm *= a->grad_scale;
    o->last_norm = norm;
    if (!isfinite(norm) && o->cfg.nonfinite != DTR_NONFINITE_OFF && (r = dtr__nonfinite(o, norm, skip)) != DTR_OK) return r;
    if (o->cfg.clip_norm > 0.0f && norm > o->cfg.clip_norm) a->grad_scale *= (float)(o->cfg.clip_norm / (norm + 1e-6));
    return DTR_OK;
}

/* A range the update can take: inside the optimizer's floats; for LAMB on parameter
 * boundaries; without clipping unless it is all of them. */
static dtr_result dtr__check_range(dtr_optimizer *o, int64_t begin, int64_t end) {
    dtr_context *ctx = dtr_model_context(o->model);
    int64_t lo = o->base, hi = o->base + o->len;
    if (begin < lo || end > hi || begin > end)
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_optimizer_step_range: [%lld, %lld) outside the optimizer's "
                         "[%lld, %lld)", (long long)begin, (long long)end, (long long)lo, (long long)hi);
    if ((o->cfg.clip_norm > 0.0f || o->cfg.shard_sum) && (begin != lo || end != hi))
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_optimizer_step_range: clip_norm and shard_sum need the whole "
                                                    "gradient's norm; clip globally (dtr_clip_grad_norm) and step ranges "
                                                    "without them");
    if (o->cfg.kind != DTR_OPT_LAMB || o->cfg.shard_sum) return DTR_OK;   /* shard_sum: the whole shard */
    if (!dtr__on_boundary(o->model, begin) || !dtr__on_boundary(o->model, end))
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_optimizer_step_range: LAMB's trust ratio is per parameter: "
                                                    "[%lld, %lld) must start and end on parameter boundaries",
                         (long long)begin, (long long)end);
    return DTR_OK;
}

dtr_result dtr_optimizer_step(dtr_optimizer *o, int *updated) {
    if (updated) *updated = 0;
    if (!o) return DTR_NULL_HANDLE;
    return dtr_optimizer_step_range(o, o->base, o->base + o->len, updated);
}

static dtr_result dtr__optimizer_update(dtr_optimizer *o, int64_t begin, int64_t end, int *updated);

dtr_result dtr_optimizer_step_range(dtr_optimizer *o, int64_t begin, int64_t end, int *updated) {
    dtr_context *ctx;
    dtr_result r;
    if (updated) *updated = 0;
    if (!o) return DTR_NULL_HANDLE;
    ctx = dtr_model_context(o->model);
    if (ctx->status != DTR_OK) return ctx->status;
    if (ctx->capturing)   /* its step count, learning rate and checks change every step */
        return dtr__fail(ctx, DTR_BAD_STATE, "dtr_optimizer_step: inside a captured step (dtr_graph_capture's fn): "
                         "an optimizer step changes its arguments every step; call it after dtr_graph_launch");
    if ((r = dtr__check_range(o, begin, end)) == DTR_OK && ++o->micro >= o->cfg.grad_accum_steps) {
        dtr__obs_phase_begin(ctx, DTR_PHASE_OPTIMIZER);
        r = dtr__optimizer_update(o, begin, end, updated);
        dtr__obs_phase_end(ctx, DTR_PHASE_OPTIMIZER);
    }
    o->norm_given = 0;   /* for this call only */
    return r;
}

void dtr__optimizer_give_norm(dtr_optimizer *o, double norm) {
    o->given_norm = norm;
    o->norm_given = 1;
}

/* a's step for parameters whose state started at update `started`: their own update count,
   from 1 (torch.optim's state["step"]) */
static void dtr__run_step(const dtr_optimizer *o, dtr__opt_args *a, int64_t started) {
    a->first = o->steps == started;
    a->step = o->steps - started + 1;
}

/* parameter i's learning rate for the next update: its group's scale times the schedule's */
static float dtr__param_lr(const dtr_optimizer *o, int i) {
    return (float)((double)dtr_schedule_lr(&o->cfg.schedule, o->steps) * o->lr_scales[i]);
}

/* a's buffers for run r of the state map: the run's parameters, gradients and state */
static void dtr__run_args(const dtr_optimizer *o, dtr__opt_args *a, int r) {
    int64_t lo = o->map.lo[r], at = o->map.at[r];
    a->param = dtr_model_params(o->model) + lo;
    a->grad = dtr_model_grads(o->model) + lo;
    a->m = o->m ? o->m + at : NULL;
    a->v = o->v ? o->v + at : NULL;
    a->work = o->work ? o->work + at : NULL;
    a->weight_decay = o->decays[o->map.first[r]] ? o->cfg.weight_decay : 0.0f;
    a->lr = dtr__param_lr(o, o->map.first[r]);
    dtr__run_step(o, a, o->started[o->map.first[r]]);
    if (o->run_seg) {
        a->nseg = o->run_seg[r + 1] - o->run_seg[r];
        a->seg_begin = o->seg_begin + o->run_seg[r];
        a->seg_end = o->seg_end + o->run_seg[r];
    }
}

/* LAMB over a shard whose ends may split parameters (shard_sum given; host memory): the
 * kernel with lr 0 updates each run's moments and writes its update directions to work
 * without moving the parameters; each parameter's norms (of p and of its direction) are
 * summed over the shards in one call; then p -= lr * trust * work, as the kernel's last loop. */
static dtr_result dtr__lamb_sharded(dtr_optimizer *o, dtr__opt_args *a) {
    dtr_context *ctx = dtr_model_context(o->model);
    int np = dtr_model_param_count(o->model), s, k;
    double *v = (double *)dtr__calloc(&ctx->alloc, (size_t)(2 * np + 1) * sizeof(double));
    dtr_result r = v ? DTR_OK : DTR_OUT_OF_MEMORY;
    int64_t i;
    for (k = 0; k < o->map.n && r == DTR_OK; k++) {
        if (o->skip[o->map.first[k]]) continue;
        dtr__run_args(o, a, k);
        a->lr = 0.0f, a->begin = 0, a->n = o->map.hi[k] - o->map.lo[k];
        r = ctx->backend->optimizer_update(ctx, a);
        for (s = o->run_seg[k]; s < o->run_seg[k + 1] && r == DTR_OK; s++)
            for (i = o->seg_begin[s]; i < o->seg_end[s]; i++) {
                v[2 * o->seg_param[s]] += (double)a->param[i] * a->param[i];
                v[2 * o->seg_param[s] + 1] += (double)a->work[i] * a->work[i];
            }
    }
    if (r == DTR_OK) r = o->cfg.shard_sum(o->cfg.shard_sum_user, v, 2 * np);
    for (k = 0; k < o->map.n && r == DTR_OK; k++) {
        if (o->skip[o->map.first[k]]) continue;
        dtr__run_args(o, a, k);
        for (s = o->run_seg[k]; s < o->run_seg[k + 1]; s++) {
            double pn = v[2 * o->seg_param[s]], un = v[2 * o->seg_param[s] + 1];
            float lr = a->lr * (pn > 0.0 && un > 0.0 ? (float)(sqrt(pn) / sqrt(un)) : 1.0f);
            for (i = o->seg_begin[s]; i < o->seg_end[s]; i++) a->param[i] -= lr * a->work[i];
        }
    }
    dtr__free(&ctx->alloc, v);
    return r;
}

/* The update over [begin, end), one call a run of trainable parameters: frozen ones
   (dtr_model_set_trainable) keep their values, weight decay included. */
static dtr_result dtr__update_runs(dtr_optimizer *o, dtr__opt_args *a, int64_t begin, int64_t end) {
    dtr_context *ctx = dtr_model_context(o->model);
    int k;
    dtr_result r = DTR_OK;
    if (a->kind == DTR_OPT_LAMB && o->cfg.shard_sum) {   /* its norms are collectives: one call over every run */
        r = dtr__lamb_sharded(o, a);
        return r == DTR_OK ? DTR_OK : dtr__fail(ctx, r, "dtr_optimizer_step: update failed");
    }
    for (k = 0; k < o->map.n && r == DTR_OK; k++) {
        int64_t lo = o->map.lo[k], rb = lo > begin ? lo : begin, re = o->map.hi[k] < end ? o->map.hi[k] : end;
        if (rb >= re || o->skip[o->map.first[k]]) continue;
        dtr__run_args(o, a, k);
        a->begin = rb - lo, a->n = re - lo;
        r = ctx->backend->optimizer_update(ctx, a);
    }
    return r == DTR_OK ? DTR_OK : dtr__fail(ctx, r, "dtr_optimizer_step: update failed");
}

/* o->skip for the update under way: the trainable parameters no backward reached since the
   last zero_grad, which torch.optim leaves out (their .grad is None); the runs split there */
static void dtr__mark_skips(dtr_optimizer *o) {
    int n = dtr__model_unreached(o->model, o->skip);
    if (n > 0 || o->split) {
        dtr__map_fill(o, &o->map);
        if (o->run_seg) dtr__lamb_segments(o);
    }
    o->split = n > 0;
}

/* after an update: the parameters it left out hold their own update count (their start moves
   with the optimizer's count), as torch.optim's state["step"] */
static void dtr__hold_skipped(dtr_optimizer *o) {
    int i;
    for (i = 0; o->split && i < dtr_model_param_count(o->model); i++)
        if (o->skip[i] && o->started[i] >= 0) o->started[i]++;
}

/* one update (the micro-batch count reached grad_accum_steps) */
static dtr_result dtr__optimizer_update(dtr_optimizer *o, int64_t begin, int64_t end, int *updated) {
    dtr_context *ctx = dtr_model_context(o->model);
    dtr__opt_args a;
    dtr_result r;
    double norm = -1.0;
    int skip;
    o->micro = 0;
    if ((r = dtr__layout(o)) != DTR_OK) return r;
    dtr__mark_skips(o);
    memset(&a, 0, sizeof(a));
    a.kind = o->cfg.kind;
    a.begin = begin - o->base;   /* the kernel sees the optimizer's floats, state-aligned */
    a.n = end - o->base;
    a.param = dtr_model_params(o->model) + o->base;
    a.grad = dtr_model_grads(o->model) + o->base;
    a.m = o->m;
    a.v = o->v;
    a.lr = dtr_schedule_lr(&o->cfg.schedule, o->steps);
    a.momentum = (float)dtr__schedule_momentum_d(&o->cfg.schedule, o->steps, o->cfg.momentum);   /* one-cycle may cycle */
    a.dampening = o->cfg.dampening;
    a.nesterov = o->cfg.nesterov;
    a.beta1 = dtr__schedule_momentum_d(&o->cfg.schedule, o->steps, o->cfg.beta1);   /* them */
    a.beta2 = o->cfg.beta2;
    a.eps = o->cfg.eps;
    a.weight_decay = o->cfg.weight_decay;
    a.grad_scale = 1.0f / (float)o->cfg.grad_accum_steps;
    a.first = o->steps == 0;
    a.step = o->steps + 1;
    a.nseg = o->nseg;
    a.seg_begin = o->seg_begin;
    a.seg_end = o->seg_end;
    a.work = o->work;
    if ((r = dtr__check_grads(o, &a, begin, end, &skip)) != DTR_OK) return r;
    if (skip) return o->keep_grads ? DTR_OK : dtr_model_zero_grad(o->model);
    if (o->cfg.clip_norm > 0.0f || o->cfg.nonfinite != DTR_NONFINITE_OFF) norm = o->last_norm;
    else if (ctx->obs && dtr__obs_wants_grad_norm(ctx->obs)) {   /* no check measured it: the metrics ask */
        if ((r = dtr__range_norm(o, begin, end, &norm)) != DTR_OK) return r;
        norm *= a.grad_scale;
    }
    if (ctx->obs) dtr__obs_optimizer(ctx->obs, a.lr, norm);
    if ((r = dtr__update_runs(o, &a, begin, end)) != DTR_OK) return r;
    dtr__hold_skipped(o);
    o->steps++;
    if (updated) *updated = 1;
    return o->keep_grads ? DTR_OK : dtr_model_zero_grad(o->model);
}

#if defined(DTR__OPT_SQRT4)
/* 8 elements of Adam from i0: the square roots taken as two SSE or NEON vectors between the
   halves of dtr__f_adam (the halves vectorise; the bits are the scalar loop's: both roots are
   IEEE's correctly rounded one) */
static inline void dtr__cpu_adam8(float *p, float *m, float *v, const float *g, int64_t i0, const dtr__opt_k *k,
                                  int adamw) {
    float sv[8];
    int j;
    DTR__IVDEP for (j = 0; j < 8; j++) sv[j] = dtr__f_adam_moments(&p[i0 + j], &m[i0 + j], &v[i0 + j], g[i0 + j], k, adamw);
    DTR__OPT_SQRT4(sv);
    DTR__OPT_SQRT4(sv + 4);
    DTR__IVDEP for (j = 0; j < 8; j++) dtr__f_adam_apply(&p[i0 + j], m[i0 + j], sv[j], k);
}
#endif

/* Adam's loop (sqrtf's errno keeps the compiler from vectorising the plain one) */
static void dtr__cpu_adam(float *p, float *m, float *v, const float *g, int64_t b, int64_t n, const dtr__opt_k *k,
                          int adamw) {
    int64_t i0 = b, i;
#if defined(DTR__OPT_SQRT4)
    if (adamw)
        for (; i0 + 8 <= n; i0 += 8) dtr__cpu_adam8(p, m, v, g, i0, k, 1);
    else
        for (; i0 + 8 <= n; i0 += 8) dtr__cpu_adam8(p, m, v, g, i0, k, 0);
#endif
    for (i = i0; i < n; i++) dtr__f_adam(&p[i], &m[i], &v[i], g[i], k, adamw);
}

/* CPU reference of the fused update; other backends are tested against it. */
dtr_result dtr__cpu_optimizer_update(dtr_context *ctx, const dtr__opt_args *a) {
    int64_t i, n = a->n, b = a->begin;
    float *p = a->param, *g = a->grad, *m = a->m, *v = a->v;
    dtr__opt_k k = dtr__opt_consts(a);
    int s;
    (void)ctx;
    switch (a->kind) {
    case DTR_OPT_SGD:
        /* one loop per variant, the flags constant in each: the compiler vectorises them */
        if (!m) DTR__ELEMENTWISE(b, n, dtr__f_sgd(&p[i], g[i], &k));
        else if (k.first) DTR__ELEMENTWISE(b, n, dtr__f_sgd_momentum(&p[i], &m[i], g[i], &k, 1, k.nesterov));
        else if (k.nesterov) DTR__ELEMENTWISE(b, n, dtr__f_sgd_momentum(&p[i], &m[i], g[i], &k, 0, 1));
        else DTR__ELEMENTWISE(b, n, dtr__f_sgd_momentum(&p[i], &m[i], g[i], &k, 0, 0));
        break;
    case DTR_OPT_RMSPROP:   /* m: the square average (Adagrad's sum); v: the momentum buffer, if any */
    case DTR_OPT_ADAGRAD:
        if (v) DTR__ELEMENTWISE(b, n, dtr__f_rmsprop(&p[i], &m[i], &v[i], g[i], &k, 1));
        else DTR__ELEMENTWISE(b, n, dtr__f_rmsprop(&p[i], &m[i], NULL, g[i], &k, 0));
        break;
    case DTR_OPT_ADAM: dtr__cpu_adam(p, m, v, g, b, n, &k, 0); break;
    case DTR_OPT_ADAMW: dtr__cpu_adam(p, m, v, g, b, n, &k, 1); break;
    case DTR_OPT_LAMB:
        for (s = 0; s < a->nseg; s++) {
            double pn = 0.0, un = 0.0;
            float trust;
            if (a->seg_begin[s] < b || a->seg_end[s] > n) continue;   /* outside the range */
            for (i = a->seg_begin[s]; i < a->seg_end[s]; i++) {
                a->work[i] = dtr__f_lamb_dir(p[i], &m[i], &v[i], g[i], &k);
                pn += (double)p[i] * p[i];
                un += (double)a->work[i] * a->work[i];
            }
            trust = dtr__f_lamb_trust(pn, un);
            for (i = a->seg_begin[s]; i < a->seg_end[s]; i++) p[i] -= a->lr * trust * a->work[i];
        }
        break;
    default: return DTR_INVALID_ARGUMENT;
    }
    return DTR_OK;
}

/* ---- state ---- */

/* the bytes of dtr_schedule saved as "schedule" (its fields before the milestones, as they
   were before them); the rest is "schedule2" */
#define DTR__SCHEDULE_HEAD offsetof(dtr_schedule, milestones)

/* the loaded report counts are counts */
static int dtr__reports_bad(const dtr_metric_stats *st) {
    return st->reports < 0 || st->bad < 0 || st->cooldown < 0 || st->drops < 0 || st->bad > st->stale ||
           st->stale > st->reports ||
           st->drops > st->reports || (st->improved & ~1) || (st->dropped & ~1) || st->best != st->best;
}

dtr_result dtr_optimizer_state(dtr_optimizer *o, int index, dtr_state_entry *out) {
    size_t bytes;
    dtr_result r;
    int dev;
    if (!o || !out) return DTR_NULL_HANDLE;
    if (index >= 3 && (r = dtr__layout(o)) != DTR_OK) return r;
    bytes = (size_t)o->map.floats * sizeof(float);   /* 0 for an empty shard, or all frozen */
    dev = !dtr__host_memory(dtr_model_context(o->model));
    if (index == 0) return dtr__state_put(out, "steps", &o->steps, sizeof o->steps, 0);
    if (index == 1) return dtr__state_put(out, "micro", &o->micro, sizeof o->micro, 0);
    if (index == 2) return dtr__state_put(out, "schedule", &o->cfg.schedule, DTR__SCHEDULE_HEAD, 0);
    if (index == 3 && o->m) return dtr__state_put(out, "m", o->m, bytes, dev);
    if (index == 4 && o->v) return dtr__state_put(out, "v", o->v, bytes, dev);
    /* last, in the order they came: files from before them lack them */
    if (index == 3 + o->nbuf)
        return dtr__state_put(out, "started", o->started, (size_t)dtr_model_param_count(o->model) * sizeof(int64_t), 0);
    if (index == 4 + o->nbuf)
        return dtr__state_put(out, "schedule2", (char *)&o->cfg.schedule + DTR__SCHEDULE_HEAD,
                              sizeof o->cfg.schedule - DTR__SCHEDULE_HEAD, 0);
    if (index == 5 + o->nbuf) return dtr__state_put(out, "reports", &o->reports, sizeof o->reports, 0);
    return DTR_NOT_FOUND;
}

/* The loaded starts fit the loaded step count and the model's trainable set. */
static dtr_result dtr__check_started(dtr_optimizer *o) {
    int i;
    for (i = 0; i < dtr_model_param_count(o->model); i++) {
        int trainable = dtr_model_param_trainable(o->model, i);
        if (o->started[i] < -1 || o->started[i] > o->steps || (o->started[i] >= 0) != trainable)
            return dtr__fail(dtr_model_context(o->model), DTR_CORRUPT_FILE, "dtr_optimizer_state_loaded: parameter "
                             "'%s' %s, its state started at update %lld (of %lld): saved with other trainable "
                             "parameters (dtr_model_set_trainable), or corrupt", dtr_tensor_name(dtr_model_param_at(o->model, i)),
                             trainable ? "is trainable" : "is frozen", (long long)o->started[i], (long long)o->steps);
    }
    return DTR_OK;
}

dtr_result dtr_optimizer_state_loaded(dtr_optimizer *o) {
    dtr_result r;
    if (!o) return DTR_NULL_HANDLE;
    if (o->steps < 0 || o->micro < 0 || o->micro >= o->cfg.grad_accum_steps)
        return dtr__fail(dtr_model_context(o->model), DTR_CORRUPT_FILE,
                         "dtr_optimizer_state_loaded: steps %lld / micro %d do not fit this optimizer", (long long)o->steps,
                         o->micro);
    if (dtr__schedule_bad(&o->cfg.schedule))
        return dtr__fail(dtr_model_context(o->model), DTR_CORRUPT_FILE, "dtr_optimizer_state_loaded: the saved schedule "
                         "(kind %d): %s", (int)o->cfg.schedule.kind, dtr__schedule_bad(&o->cfg.schedule));
    if (dtr__reports_bad(&o->reports))
        return dtr__fail(dtr_model_context(o->model), DTR_CORRUPT_FILE, "dtr_optimizer_state_loaded: the saved metric "
                         "reports (%lld, %lld bad, %lld drops) are not counts", (long long)o->reports.reports,
                         (long long)o->reports.bad, (long long)o->reports.drops);
    if ((r = dtr__layout(o)) != DTR_OK || (r = dtr__check_started(o)) != DTR_OK) return r;
    dtr__map_fill(o, &o->map);   /* the runs split where the starts differ; the state stays where it is */
    if (o->run_seg) dtr__lamb_segments(o);
    return DTR_OK;
}

void dtr__optimizer_range(const dtr_optimizer *o, int64_t *base, int64_t *len) {
    *base = o ? o->base : 0;
    *len = o ? o->len : 0;
}

void dtr__optimizer_keep_grads(dtr_optimizer *o) { if (o) o->keep_grads = 1; }

dtr_context *dtr__optimizer_context(const dtr_optimizer *o) { return dtr_model_context(o->model); }

void dtr__optimizer_restart_accum(dtr_optimizer *o) { if (o) o->micro = 0; }

int dtr__optimizer_updates_next(const dtr_optimizer *o) { return o && o->micro + 1 >= o->cfg.grad_accum_steps; }
