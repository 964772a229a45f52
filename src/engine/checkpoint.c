/* ============================================================================
 * Full-state checkpoints (api_engine.h, "full-state checkpoints"; docs/fault-tolerance.md).
 * A checkpoint is a loop over the objects' state entries (dtr_<object>_state) plus a
 * manifest:
 *   save     the app's thread lists every entry and copies it into the staging buffer; the
 *            writer thread (or the caller with cfg.sync) writes this rank's safetensors file
 *            (one U8 tensor per entry), reads it back for its CRC-32C, all-gathers the ranks'
 *            records over a private group, and rank 0 writes manifest.json last, then prunes.
 *   restore  picks a complete checkpoint (rank 0's choice, broadcast), verifies the manifest
 *            and every file and tensor it needs into the staging buffer, agrees with the other
 *            ranks (an all-reduce of failures), and only then writes the live entries and calls
 *            the objects' state_loaded, putting the previous bytes back if one refuses.
 * World-size changes: a plan per entry says where its bytes come from (the same rank, old
 * rank r mod N, the ZeRO shards overlapping this rank's range, or zeros).
 * ==========================================================================*/
#include "../public/api.h"
#include "../public/api_engine.h"
#include "../core/internal.h"
#include "../obs/obs_internal.h"
#include <errno.h>
#include <pthread.h>
#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>
#include <fcntl.h>

#define DTR__CK_MAX_ENTRIES 64
#define DTR__CK_MAX_OBJS 21      /* 5 of the library's + 16 of the app's */
#define DTR__CK_NAME 64          /* "<object>/<entry>" */
#define DTR__CK_MAX_META 32
#define DTR__CK_MANIFEST "manifest.json"
#define DTR__CK_CRC_KEY "\"manifest_crc32c\":\""

enum { DTR__CK_CTX, DTR__CK_MODEL, DTR__CK_OPT, DTR__CK_LOADER, DTR__CK_DP, DTR__CK_USER };

typedef struct dtr__ck_obj {
    char name[32];
    int kind;
    void *obj;
    dtr_ckpt_state_fn state;
    dtr_ckpt_loaded_fn loaded;
} dtr__ck_obj;

typedef struct dtr__ck_entry {   /* one live entry */
    char name[DTR__CK_NAME];
    int obj;                     /* index in objs */
    dtr_state_entry e;
    size_t off;                  /* in the staging buffer */
} dtr__ck_entry;

typedef struct dtr__ck_trec { char name[DTR__CK_NAME]; uint64_t bytes; uint32_t crc, pad; } dtr__ck_trec;

/* What a rank reports after writing its file (all-gathered as bytes), and what the manifest
   says of each file. */
typedef struct dtr__ck_rec {
    int32_t ok, count;
    uint64_t bytes;
    uint32_t crc, model;
    int64_t numel, shard_begin, shard_end;
    char msg[192];
    dtr__ck_trec t[DTR__CK_MAX_ENTRIES];
} dtr__ck_rec;

typedef struct dtr__ck_meta { int n; char key[DTR__CK_MAX_META][64]; char val[DTR__CK_MAX_META][256]; } dtr__ck_meta;

typedef struct dtr__ck_manifest {
    int64_t step, numel;
    int world;
    uint32_t model;
    dtr__ck_meta meta;
    dtr__ck_rec *files;          /* world of them */
} dtr__ck_manifest;

struct dtr_ckpt {
    dtr_ckpt_config cfg;
    char *dir;
    dtr_comm *group;             /* private: the writer's collectives (NULL alone) */
    int rank, world;
    dtr__ck_obj objs[DTR__CK_MAX_OBJS];
    int nobj;
    dtr__ck_entry ents[DTR__CK_MAX_ENTRIES];
    int nent;
    unsigned char *stage;
    size_t stage_cap, stage_bytes;
    dtr__ck_meta meta, wmeta;    /* the app's; the snapshot's (the writer's copy) */
    dtr__ck_rec rec;             /* this rank's, for the write in flight */
    int64_t wstep;
    pthread_t thread;
    int running, done;           /* done: set by the writer (atomic) */
    dtr_result wresult;          /* the last write's result, not yet returned */
    char msg[512], wmsg[512];
    dtr_ckpt_stats stats;
};

static double dtr__ck_now(void) { return (double)dtr_time_ns() * 1e-9; }

/* dst = a (+ "/" b when b): cut to cap - 1 bytes (memcpy: the buffers may share a struct). */
static void dtr__ck_str(char *dst, size_t cap, const char *a, const char *b) {
    size_t n = strlen(a) < cap - 1 ? strlen(a) : cap - 1, m;
    memmove(dst, a, n);
    if (b && n + 1 < cap) {
        dst[n++] = '/';
        m = strlen(b) < cap - 1 - n ? strlen(b) : cap - 1 - n;
        memmove(dst + n, b, m);
        n += m;
    }
    dst[n] = '\0';
}

/* The largest of every rank's small non-negative int (collectives reduce floats only). A
   failure of the group (a peer died or hung) is described in msg. */
static dtr_result dtr__ck_max(dtr_comm *c, int32_t *v, char *msg, size_t cap) {
    float f = (float)*v;
    dtr_result r = dtr_comm_all_reduce(c, &f, &f, 1, DTR_F32, DTR_REDUCE_MAX);
    *v = (int32_t)f;
    if (r != DTR_OK) dtr__errf(msg, cap, r, "checkpoint: %s", dtr_comm_last_error(c));
    return r;
}

/* ---- configuration and creation ---- */

dtr_ckpt_config dtr_ckpt_config_init(void) {
    dtr_ckpt_config c;
    memset(&c, 0, sizeof c);
    c.keep = 3;
    c.busy = DTR_CKPT_BUSY_WAIT;
    return c;
}

static int dtr__ck_name_ok(const char *s, size_t max) {
    size_t i, n = strlen(s);
    if (n == 0 || n > max) return 0;
    for (i = 0; i < n; i++)
        if (!((s[i] >= 'a' && s[i] <= 'z') || (s[i] >= 'A' && s[i] <= 'Z') || (s[i] >= '0' && s[i] <= '9') ||
              s[i] == '_' || s[i] == '.' || s[i] == '-'))
            return 0;
    return 1;
}

static void dtr__ck_add(dtr_ckpt *ck, const char *name, int kind, void *obj) {
    dtr__ck_obj *o;
    if (!obj) return;
    o = &ck->objs[ck->nobj++];
    dtr__ck_str(o->name, sizeof o->name, name, NULL);
    o->kind = kind;
    o->obj = obj;
}

static int dtr__ck_mkdir(const char *path) {
    return mkdir(path, 0777) == 0 || errno == EEXIST ? 0 : errno;
}

dtr_result dtr_ckpt_create(const dtr_ckpt_config *cfg, dtr_ckpt **out) {
    dtr_ckpt *ck;
    dtr_result r = DTR_OK;
    int e;
    if (out) *out = NULL;
    if (!cfg || !out || !cfg->dir || !cfg->ctx) return DTR_NULL_HANDLE;
    ck = (dtr_ckpt *)dtr__calloc(NULL, sizeof *ck);
    if (ck) ck->dir = (char *)dtr__malloc(NULL, strlen(cfg->dir) + 1);
    if (!ck || !ck->dir) { dtr__free(NULL, ck); return DTR_OUT_OF_MEMORY; }
    strcpy(ck->dir, cfg->dir);
    ck->cfg = *cfg;
    ck->cfg.dir = ck->dir;
    ck->world = cfg->comm ? dtr_comm_size(cfg->comm) : 1;
    ck->rank = cfg->comm ? dtr_comm_rank(cfg->comm) : 0;
    dtr__ck_add(ck, "context", DTR__CK_CTX, cfg->ctx);
    dtr__ck_add(ck, "model", DTR__CK_MODEL, cfg->model);
    dtr__ck_add(ck, "optimizer", DTR__CK_OPT, cfg->optimizer);
    dtr__ck_add(ck, "loader", DTR__CK_LOADER, cfg->loader);
    dtr__ck_add(ck, "dp", DTR__CK_DP, cfg->dp);
    if ((e = dtr__ck_mkdir(ck->dir)) != 0)
        r = dtr__fail(cfg->ctx, DTR_IO_ERROR, "dtr_ckpt_create: cannot make folder %s: %s", ck->dir, strerror(e));
    if (r == DTR_OK && ck->world > 1) r = dtr_comm_split(cfg->comm, 0, ck->rank, &ck->group);
    if (r != DTR_OK) { dtr__free(NULL, ck->dir); dtr__free(NULL, ck); return r; }
    *out = ck;
    return DTR_OK;
}

dtr_result dtr_ckpt_add_object(dtr_ckpt *ck, const char *name, void *obj, dtr_ckpt_state_fn state,
                               dtr_ckpt_loaded_fn loaded) {
    int i;
    if (!ck || !name || !state) return DTR_NULL_HANDLE;
    if (ck->running) return DTR_BAD_STATE;
    if (!dtr__ck_name_ok(name, 31) || ck->nobj >= DTR__CK_MAX_OBJS)
        return dtr__errf(ck->msg, sizeof ck->msg, DTR_INVALID_ARGUMENT, "dtr_ckpt_add_object: bad name '%s' or too "
                         "many objects (%d)", name, ck->nobj);
    for (i = 0; i < ck->nobj; i++)
        if (strcmp(ck->objs[i].name, name) == 0)
            return dtr__errf(ck->msg, sizeof ck->msg, DTR_INVALID_ARGUMENT, "dtr_ckpt_add_object: '%s' is taken", name);
    dtr__ck_add(ck, name, DTR__CK_USER, obj);
    ck->objs[ck->nobj - 1].state = state;
    ck->objs[ck->nobj - 1].loaded = loaded;
    return DTR_OK;
}

/* ---- metadata ---- */

static int dtr__ck_printable(const char *s, size_t max) {
    size_t n = strlen(s), i;
    if (n > max) return 0;
    for (i = 0; i < n; i++)
        if ((unsigned char)s[i] < 0x20 || (unsigned char)s[i] > 0x7e) return 0;
    return 1;
}

static int dtr__ck_meta_find(const dtr__ck_meta *m, const char *key) {
    int i;
    for (i = 0; i < m->n; i++)
        if (strcmp(m->key[i], key) == 0) return i;
    return -1;
}

static dtr_result dtr__ck_meta_set(dtr__ck_meta *m, const char *key, const char *value) {
    int i = dtr__ck_meta_find(m, key);
    if (!value) {
        if (i >= 0) {
            memmove(m->key[i], m->key[i + 1], (size_t)(m->n - i - 1) * sizeof m->key[0]);
            memmove(m->val[i], m->val[i + 1], (size_t)(m->n - i - 1) * sizeof m->val[0]);
            m->n--;
        }
        return DTR_OK;
    }
    if (i < 0 && m->n == DTR__CK_MAX_META) return DTR_INVALID_ARGUMENT;
    if (i < 0) i = m->n++;
    dtr__ck_str(m->key[i], sizeof m->key[i], key, NULL);
    dtr__ck_str(m->val[i], sizeof m->val[i], value, NULL);
    return DTR_OK;
}

dtr_result dtr_ckpt_set_meta(dtr_ckpt *ck, const char *key, const char *value) {
    if (!ck || !key) return DTR_NULL_HANDLE;
    if (!*key || !dtr__ck_printable(key, 63) || (value && !dtr__ck_printable(value, 255)) ||
        dtr__ck_meta_set(&ck->meta, key, value) != DTR_OK)
        return dtr__errf(ck->msg, sizeof ck->msg, DTR_INVALID_ARGUMENT, "dtr_ckpt_set_meta: key '%.63s': empty, too "
                         "long, not printable ASCII, or more than %d keys", key, DTR__CK_MAX_META);
    return DTR_OK;
}

const char *dtr_ckpt_get_meta(const dtr_ckpt *ck, const char *key) {
    int i;
    if (!ck || !key) return NULL;
    i = dtr__ck_meta_find(&ck->meta, key);
    return i < 0 ? NULL : ck->meta.val[i];
}

/* ---- the live entries ---- */

static dtr_result dtr__ck_state(dtr__ck_obj *o, int i, dtr_state_entry *e) {
    switch (o->kind) {
    case DTR__CK_CTX: return dtr_context_state((dtr_context *)o->obj, i, e);
    case DTR__CK_MODEL: return dtr_model_state((dtr_model *)o->obj, i, e);
    case DTR__CK_OPT: return dtr_optimizer_state((dtr_optimizer *)o->obj, i, e);
    case DTR__CK_LOADER: return dtr_loader_state((dtr_loader *)o->obj, i, e);
    case DTR__CK_DP: return dtr_dp_state((dtr_dp *)o->obj, i, e);
    default: return o->state(o->obj, i, e);
    }
}

static dtr_result dtr__ck_loaded(dtr__ck_obj *o) {
    switch (o->kind) {
    case DTR__CK_CTX: return dtr_context_state_loaded((dtr_context *)o->obj);
    case DTR__CK_MODEL: return dtr_model_state_loaded((dtr_model *)o->obj);
    case DTR__CK_OPT: return dtr_optimizer_state_loaded((dtr_optimizer *)o->obj);
    case DTR__CK_LOADER: return dtr_loader_state_loaded((dtr_loader *)o->obj);
    case DTR__CK_DP: return dtr_dp_state_loaded((dtr_dp *)o->obj);
    default: return o->loaded ? o->loaded(o->obj) : DTR_OK;
    }
}

/* Lists every entry of every object into ck->ents with its staging offset; grows the
   staging buffer to hold them all. */
static dtr_result dtr__ck_list(dtr_ckpt *ck) {
    int k, i;
    dtr_state_entry e;
    dtr_result r = DTR_NOT_FOUND;
    size_t off = 0;
    ck->nent = 0;
    for (k = 0; k < ck->nobj; k++)
        for (i = 0; (r = dtr__ck_state(&ck->objs[k], i, &e)) == DTR_OK; i++) {
            dtr__ck_entry *d;
            if (ck->nent == DTR__CK_MAX_ENTRIES)
                return dtr__errf(ck->msg, sizeof ck->msg, DTR_UNSUPPORTED, "checkpoint: more than %d state entries",
                                 DTR__CK_MAX_ENTRIES);
            d = &ck->ents[ck->nent++];
            dtr__ck_str(d->name, sizeof d->name, ck->objs[k].name, e.name ? e.name : "?");
            d->obj = k;
            d->e = e;
            d->off = off;
            off += (e.bytes + 63) & ~(size_t)63;
        }
    if (r != DTR_NOT_FOUND) return dtr__errf(ck->msg, sizeof ck->msg, r, "checkpoint: listing the state of '%s' failed: %s",
                                             ck->objs[k < ck->nobj ? k : 0].name, dtr_result_string(r));
    ck->stage_bytes = off;
    if (off > ck->stage_cap) {
        unsigned char *p = (unsigned char *)dtr__realloc(NULL, ck->stage, off);
        if (!p) return dtr__errf(ck->msg, sizeof ck->msg, DTR_OUT_OF_MEMORY, "checkpoint: no memory for %zu staging bytes", off);
        ck->stage = p;
        ck->stage_cap = off;
    }
    return DTR_OK;
}

/* Copies between a live entry and `host` (to_live 0: live to host). */
static dtr_result dtr__ck_copy(dtr_ckpt *ck, const dtr__ck_entry *d, void *host, int to_live) {
    dtr_context *ctx = ck->cfg.ctx;
    if (!d->e.bytes) return DTR_OK;
    if (!d->e.device) {
        if (to_live) memcpy(d->e.data, host, d->e.bytes);
        else memcpy(host, d->e.data, d->e.bytes);
        return DTR_OK;
    }
    return to_live ? ctx->backend->from_host(ctx, d->e.data, host, d->e.bytes)
                   : ctx->backend->to_host(ctx, host, d->e.data, d->e.bytes);
}

/* The model's identity: CRC-32C of its parameter names, dims and shapes. */
static uint32_t dtr__ck_model_id(dtr_model *m) {
    uint32_t c = 0;
    int i, n = m ? dtr_model_param_count(m) : 0;
    for (i = 0; i < n; i++) {
        dtr_tensor *t = dtr_model_param_at(m, i);
        int d, nd = dtr_tensor_ndim(t);
        const char *name = dtr_tensor_name(t);
        c = dtr_crc32c(c, name ? name : "", name ? strlen(name) + 1 : 1);
        c = dtr_crc32c(c, &nd, sizeof nd);
        for (d = 0; d < nd; d++) {
            int64_t s = dtr_tensor_dim(t, d);
            c = dtr_crc32c(c, &s, sizeof s);
        }
    }
    return c;
}

/* This rank's identity fields of a record: model, numel, the optimizer's range. */
static void dtr__ck_identity(dtr_ckpt *ck, dtr__ck_rec *rec) {
    int64_t base, len;
    rec->model = dtr__ck_model_id(ck->cfg.model);
    rec->numel = ck->cfg.model ? dtr_model_numel(ck->cfg.model) : 0;
    dtr__optimizer_range(ck->cfg.optimizer, &base, &len);
    rec->shard_begin = base;
    rec->shard_end = base + len;
}

/* ---- paths ---- */

static void dtr__ck_step_dir(const dtr_ckpt *ck, int64_t step, char *out, size_t cap) {
    snprintf(out, cap, "%s/step-%08lld", ck->dir, (long long)step);
}

static void dtr__ck_file(const char *stepdir, int rank, char *out, size_t cap) {
    snprintf(out, cap, "%s/rank-%05d.safetensors", stepdir, rank);
}

static int dtr__ck_exists(const char *path) {
    struct stat st;
    return stat(path, &st) == 0;
}

static void dtr__ck_sync_dir(const char *dir) {
    int fd = open(dir, O_RDONLY);
    if (fd >= 0) { (void)fsync(fd); close(fd); }
}

/* Steps of the folders under dir, newest first; complete ones only when `complete`.
   Returns the count (up to cap), -1 when dir cannot be read. */
static int dtr__ck_scan(const char *dir, int complete, int64_t *steps, int cap) {
    DIR *d = opendir(dir);
    struct dirent *de;
    int n = 0, i, j;
    if (!d) return -1;
    while ((de = readdir(d)) != NULL) {
        char path[4096], *end;
        long long s;
        if (strncmp(de->d_name, "step-", 5) != 0 || strlen(de->d_name) != 13) continue;
        s = strtoll(de->d_name + 5, &end, 10);
        if (*end || s < 0) continue;
        snprintf(path, sizeof path, "%s/%s/" DTR__CK_MANIFEST, dir, de->d_name);
        if (complete && !dtr__ck_exists(path)) continue;
        if (n < cap) steps[n++] = s;
    }
    closedir(d);
    for (i = 1; i < n; i++)   /* insertion sort, descending */
        for (j = i; j > 0 && steps[j] > steps[j - 1]; j--) { int64_t t = steps[j]; steps[j] = steps[j - 1]; steps[j - 1] = t; }
    return n;
}

int dtr__ckpt_steps(const char *dir, int64_t *steps, int cap) { return dtr__ck_scan(dir, 1, steps, cap); }

dtr_result dtr_ckpt_latest(const char *dir, int64_t *step, char *path, size_t pathlen) {
    int64_t steps[1024];
    int n;
    if (!dir || !step) return DTR_NULL_HANDLE;
    n = dtr__ck_scan(dir, 1, steps, 1024);
    if (n <= 0) return DTR_NOT_FOUND;
    *step = steps[0];
    if (path && pathlen) snprintf(path, pathlen, "%s/step-%08lld", dir, (long long)steps[0]);
    return DTR_OK;
}

/* Removes a checkpoint folder: its manifest first (so a crash leaves it incomplete), then
   every file in it, then the folder. */
static void dtr__ck_remove(const dtr_ckpt *ck, int64_t step) {
    char sd[4096], path[4400];
    DIR *d;
    struct dirent *de;
    dtr__ck_step_dir(ck, step, sd, sizeof sd);
    snprintf(path, sizeof path, "%s/" DTR__CK_MANIFEST, sd);
    if (remove(path) == 0) dtr__ck_sync_dir(sd);
    if ((d = opendir(sd)) == NULL) return;
    while ((de = readdir(d)) != NULL) {
        if (strcmp(de->d_name, ".") == 0 || strcmp(de->d_name, "..") == 0) continue;
        snprintf(path, sizeof path, "%s/%s", sd, de->d_name);
        remove(path);
    }
    closedir(d);
    rmdir(sd);
}

/* After committing `step`: keeps the newest cfg.keep complete checkpoints and removes the
   incomplete folders of older steps (a crashed or abandoned write). */
static void dtr__ck_prune(dtr_ckpt *ck, int64_t step) {
    int64_t all[1024], done[1024];
    int na = dtr__ck_scan(ck->dir, 0, all, 1024), nd = dtr__ck_scan(ck->dir, 1, done, 1024), i, j;
    for (i = 0; i < na; i++) {
        int complete = 0, rank_in_done = -1;
        for (j = 0; j < nd; j++)
            if (done[j] == all[i]) { complete = 1; rank_in_done = j; }
        if (!complete && all[i] < step) dtr__ck_remove(ck, all[i]);
        if (complete && ck->cfg.keep >= 0 && rank_in_done >= (ck->cfg.keep ? ck->cfg.keep : 1)) dtr__ck_remove(ck, all[i]);
    }
    dtr__ck_sync_dir(ck->dir);
}

/* ---- the manifest ---- */

typedef struct dtr__ck_buf { char *p; size_t n, cap; int oom; } dtr__ck_buf;

static void dtr__ck_printf(dtr__ck_buf *b, const char *fmt, ...) DTR__PRINTF(2, 3);
static void dtr__ck_printf(dtr__ck_buf *b, const char *fmt, ...) {
    va_list ap;
    int n;
    if (b->oom) return;
    if (b->cap - b->n < 1024) {
        char *p = (char *)dtr__realloc(NULL, b->p, b->cap * 2 + 4096);
        if (!p) { b->oom = 1; return; }
        b->p = p;
        b->cap = b->cap * 2 + 4096;
    }
    va_start(ap, fmt);
    n = vsnprintf(b->p + b->n, b->cap - b->n, fmt, ap);
    va_end(ap);
    if (n < 0 || (size_t)n >= b->cap - b->n) { b->oom = 1; return; }
    b->n += (size_t)n;
}

/* A JSON string of printable ASCII (quotes and backslashes escaped). */
static void dtr__ck_jstr(dtr__ck_buf *b, const char *s) {
    char tmp[600];
    size_t k = 0;
    for (; *s && k < sizeof tmp - 3; s++) {
        if (*s == '"' || *s == '\\') tmp[k++] = '\\';
        tmp[k++] = *s;
    }
    tmp[k] = '\0';
    dtr__ck_printf(b, "\"%s\"", tmp);
}

static void dtr__ck_put_file(dtr__ck_buf *b, const dtr__ck_rec *r, int rank) {
    int i;
    dtr__ck_printf(b, "    {\"rank\": %d, \"file\": \"rank-%05d.safetensors\", \"bytes\": %llu, \"crc32c\": \"%08x\",\n"
                   "     \"model\": \"%08x\", \"numel\": %lld, \"shard_begin\": %lld, \"shard_end\": %lld,\n"
                   "     \"tensors\": [", rank, rank, (unsigned long long)r->bytes, r->crc, r->model, (long long)r->numel,
                   (long long)r->shard_begin, (long long)r->shard_end);
    for (i = 0; i < r->count; i++)
        dtr__ck_printf(b, "%s\n      {\"name\": \"%s\", \"bytes\": %llu, \"crc32c\": \"%08x\"}", i ? "," : "", r->t[i].name,
                       (unsigned long long)r->t[i].bytes, r->t[i].crc);
    dtr__ck_printf(b, "]}");
}

/* The manifest's text for `step` from every rank's record; its last member is the CRC-32C
   of every byte before that member's key. */
static void dtr__ck_manifest_text(dtr_ckpt *ck, const dtr__ck_rec *recs, dtr__ck_buf *b) {
    int i;
    dtr__ck_printf(b, "{\"format\": \"dtrain-checkpoint\", \"version\": 1, \"step\": %lld, \"world\": %d,\n"
                   " \"model\": \"%08x\", \"numel\": %lld,\n \"meta\": {", (long long)ck->wstep, ck->world, recs[0].model,
                   (long long)recs[0].numel);
    for (i = 0; i < ck->wmeta.n; i++) {
        dtr__ck_printf(b, "%s", i ? ", " : "");
        dtr__ck_jstr(b, ck->wmeta.key[i]);
        dtr__ck_printf(b, ": ");
        dtr__ck_jstr(b, ck->wmeta.val[i]);
    }
    dtr__ck_printf(b, "},\n \"files\": [\n");
    for (i = 0; i < ck->world; i++) {
        dtr__ck_put_file(b, &recs[i], i);
        dtr__ck_printf(b, "%s\n", i + 1 < ck->world ? "," : "");
    }
    dtr__ck_printf(b, " ],\n ");
    if (!b->oom) dtr__ck_printf(b, DTR__CK_CRC_KEY "%08x\"}\n", dtr_crc32c(0, b->p, b->n));
}

/* ---- reading the manifest ---- */

static int dtr__ck_hex32(const char *s, uint32_t *out) {
    uint32_t v = 0;
    int i;
    if (strlen(s) != 8) return 0;
    for (i = 0; i < 8; i++) {
        int c = s[i], d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
        if (d < 0) return 0;
        v = v << 4 | (uint32_t)d;
    }
    *out = v;
    return 1;
}

/* "key": at the cursor; returns 1 with the key, 0 at the object's end, -1 on error. */
static int dtr__ck_key(dtr__json *j, char *key, size_t cap, int first) {
    size_t len;
    if (dtr__json_accept(j, '}')) return 0;
    if (!first && dtr__json_expect(j, ',') != DTR_OK) return -1;
    if (dtr__json_string(j, key, cap, &len) != DTR_OK || len >= cap || dtr__json_expect(j, ':') != DTR_OK) return -1;
    return 1;
}

static int dtr__ck_hexval(dtr__json *j, uint32_t *out) {
    char s[16];
    size_t len;
    return dtr__json_string(j, s, sizeof s, &len) == DTR_OK && dtr__ck_hex32(s, out);
}

static int dtr__ck_i64(dtr__json *j, int64_t *out) {
    uint64_t v;
    if (dtr__json_u64(j, &v) != DTR_OK || v > (uint64_t)INT64_MAX) return 0;
    *out = (int64_t)v;
    return 1;
}

static int dtr__ck_parse_tensors(dtr__json *j, dtr__ck_rec *r) {
    if (dtr__json_expect(j, '[') != DTR_OK) return 0;
    if (dtr__json_accept(j, ']')) return 1;
    do {
        dtr__ck_trec *t;
        char key[32];
        int first = 1, k;
        int64_t bytes = -1;
        if (r->count == DTR__CK_MAX_ENTRIES || dtr__json_expect(j, '{') != DTR_OK) return 0;
        t = &r->t[r->count++];
        while ((k = dtr__ck_key(j, key, sizeof key, first)) == 1) {
            size_t len;
            int ok = strcmp(key, "name") == 0 ? dtr__json_string(j, t->name, sizeof t->name, &len) == DTR_OK && len < sizeof t->name
                   : strcmp(key, "bytes") == 0 ? dtr__ck_i64(j, &bytes)
                   : strcmp(key, "crc32c") == 0 ? dtr__ck_hexval(j, &t->crc) : dtr__json_skip(j) == DTR_OK;
            if (!ok) return 0;
            first = 0;
        }
        if (k < 0 || bytes < 0 || !t->name[0]) return 0;
        t->bytes = (uint64_t)bytes;
    } while (dtr__json_accept(j, ','));
    return dtr__json_expect(j, ']') == DTR_OK;
}

static int dtr__ck_parse_file(dtr__json *j, dtr__ck_rec *r, int *rank) {
    char key[32];
    int first = 1, k;
    int64_t v;
    if (dtr__json_expect(j, '{') != DTR_OK) return 0;
    memset(r, 0, sizeof *r);
    while ((k = dtr__ck_key(j, key, sizeof key, first)) == 1) {
        int ok = 1;
        first = 0;
        if (strcmp(key, "rank") == 0) ok = dtr__ck_i64(j, &v) && v < 65536 && (*rank = (int)v, 1);
        else if (strcmp(key, "bytes") == 0) ok = dtr__ck_i64(j, &v) && (r->bytes = (uint64_t)v, 1);
        else if (strcmp(key, "crc32c") == 0) ok = dtr__ck_hexval(j, &r->crc);
        else if (strcmp(key, "model") == 0) ok = dtr__ck_hexval(j, &r->model);
        else if (strcmp(key, "numel") == 0) ok = dtr__ck_i64(j, &r->numel);
        else if (strcmp(key, "shard_begin") == 0) ok = dtr__ck_i64(j, &r->shard_begin);
        else if (strcmp(key, "shard_end") == 0) ok = dtr__ck_i64(j, &r->shard_end);
        else if (strcmp(key, "tensors") == 0) ok = dtr__ck_parse_tensors(j, r);
        else ok = dtr__json_skip(j) == DTR_OK;
        if (!ok) return 0;
    }
    return k == 0;
}

static int dtr__ck_parse_meta(dtr__json *j, dtr__ck_meta *m) {
    char key[64], val[256];
    int first = 1, k;
    size_t len;
    if (dtr__json_expect(j, '{') != DTR_OK) return 0;
    while ((k = dtr__ck_key(j, key, sizeof key, first)) == 1) {
        if (dtr__json_string(j, val, sizeof val, &len) != DTR_OK || len >= sizeof val ||
            dtr__ck_meta_set(m, key, val) != DTR_OK)
            return 0;
        first = 0;
    }
    return k == 0;
}

static int dtr__ck_parse_files(dtr__json *j, dtr__ck_manifest *m) {
    int n = 0, rank = -1;
    if (m->world < 1 || dtr__json_expect(j, '[') != DTR_OK) return 0;
    m->files = (dtr__ck_rec *)dtr__calloc(NULL, (size_t)m->world * sizeof *m->files);
    if (!m->files) return 0;
    do {
        if (n == m->world || !dtr__ck_parse_file(j, &m->files[n], &rank) || rank != n) return 0;
        n++;
    } while (dtr__json_accept(j, ','));
    return n == m->world && dtr__json_expect(j, ']') == DTR_OK;
}

/* Parses the manifest body (the caller checked its checksum); world must precede files. */
static int dtr__ck_parse(dtr__json *j, dtr__ck_manifest *m) {
    char key[32], s[64];
    int first = 1, k, ok;
    size_t len;
    int64_t v;
    if (dtr__json_expect(j, '{') != DTR_OK) return 0;
    while ((k = dtr__ck_key(j, key, sizeof key, first)) == 1) {
        first = 0;
        if (strcmp(key, "format") == 0) ok = dtr__json_string(j, s, sizeof s, &len) == DTR_OK && strcmp(s, "dtrain-checkpoint") == 0;
        else if (strcmp(key, "version") == 0) ok = dtr__ck_i64(j, &v) && v == 1;
        else if (strcmp(key, "step") == 0) ok = dtr__ck_i64(j, &m->step);
        else if (strcmp(key, "world") == 0) ok = dtr__ck_i64(j, &v) && v >= 1 && v <= 65536 && (m->world = (int)v, 1);
        else if (strcmp(key, "model") == 0) ok = dtr__ck_hexval(j, &m->model);
        else if (strcmp(key, "numel") == 0) ok = dtr__ck_i64(j, &m->numel);
        else if (strcmp(key, "meta") == 0) ok = dtr__ck_parse_meta(j, &m->meta);
        else if (strcmp(key, "files") == 0) ok = !m->files && dtr__ck_parse_files(j, m);
        else ok = dtr__json_skip(j) == DTR_OK;
        if (!ok) return 0;
    }
    return k == 0 && m->files != NULL;
}

/* Reads a whole file into a buffer (dtr__free it). 0 or errno. */
static int dtr__ck_read(const char *path, char **out, size_t *size) {
    FILE *fp = fopen(path, "rb");
    char *p = NULL;
    long n;
    *out = NULL;
    if (!fp) return errno ? errno : EIO;
    if (fseek(fp, 0, SEEK_END) != 0 || (n = ftell(fp)) < 0 || fseek(fp, 0, SEEK_SET) != 0 ||
        (p = (char *)dtr__malloc(NULL, (size_t)n + 1)) == NULL || fread(p, 1, (size_t)n, fp) != (size_t)n) {
        int e = errno ? errno : EIO;
        fclose(fp);
        dtr__free(NULL, p);
        return e;
    }
    fclose(fp);
    p[n] = '\0';
    *out = p;
    *size = (size_t)n;
    return 0;
}

/* 1 when the manifest's last member holds the CRC-32C of every byte before it. */
static int dtr__ck_manifest_sealed(const char *text, size_t n) {
    const char *at = n >= 40 ? strstr(text + n - 40, DTR__CK_CRC_KEY) : NULL;
    char hex[9];
    uint32_t want;
    if (!at) return 0;
    memcpy(hex, at + strlen(DTR__CK_CRC_KEY), 8);
    hex[8] = '\0';
    return dtr__ck_hex32(hex, &want) && strcmp(at + strlen(DTR__CK_CRC_KEY) + 8, "\"}\n") == 0 &&
           dtr_crc32c(0, text, (size_t)(at - text)) == want;
}

static dtr_result dtr__ck_load_manifest(dtr_ckpt *ck, const char *sd, dtr__ck_manifest *m) {
    char path[4200], *text;
    size_t n;
    dtr__json j;
    int e;
    snprintf(path, sizeof path, "%s/" DTR__CK_MANIFEST, sd);
    if ((e = dtr__ck_read(path, &text, &n)) != 0)
        return dtr__errf(ck->msg, sizeof ck->msg, e == ENOENT ? DTR_NOT_FOUND : DTR_IO_ERROR, "%s: %s", path, strerror(e));
    if (strlen(text) != n || !dtr__ck_manifest_sealed(text, n)) {
        dtr__free(NULL, text);
        return dtr__errf(ck->msg, sizeof ck->msg, DTR_CORRUPT_FILE, "%s: the manifest's checksum does not match (truncated "
                         "or altered)", path);
    }
    dtr__json_init(&j, text, n);
    e = dtr__ck_parse(&j, m);
    dtr__free(NULL, text);
    if (!e) return dtr__errf(ck->msg, sizeof ck->msg, DTR_CORRUPT_FILE, "%s: malformed manifest (%s)", path, j.msg);
    return DTR_OK;
}

/* ---- writing ---- */

/* CRC-32C and size of a file as it is on disk. 0 or errno. */
static int dtr__ck_file_crc(const char *path, uint64_t *bytes, uint32_t *crc) {
    FILE *fp = fopen(path, "rb");
    unsigned char buf[65536];
    size_t n;
    *bytes = 0;
    *crc = 0;
    if (!fp) return errno ? errno : EIO;
    while ((n = fread(buf, 1, sizeof buf, fp)) > 0) { *crc = dtr_crc32c(*crc, buf, n); *bytes += n; }
    n = (size_t)ferror(fp);
    fclose(fp);
    return n ? EIO : 0;
}

/* Writes this rank's file from the staging buffer; fills ck->rec. */
static dtr_result dtr__ck_write_file(dtr_ckpt *ck, const char *sd) {
    dtr_st_entry *st = (dtr_st_entry *)dtr__calloc(NULL, (size_t)(ck->nent ? ck->nent : 1) * sizeof *st);
    const void **data = (const void **)dtr__calloc(NULL, (size_t)(ck->nent ? ck->nent : 1) * sizeof *data);
    char path[4200];
    dtr_result r;
    int i, e;
    if (!st || !data) {
        dtr__free(NULL, st); dtr__free(NULL, data);
        return dtr__errf(ck->wmsg, sizeof ck->wmsg, DTR_OUT_OF_MEMORY, "checkpoint: out of memory");
    }
    for (i = 0; i < ck->nent; i++) {
        const dtr__ck_entry *d = &ck->ents[i];
        dtr__ck_str(st[i].name, sizeof st[i].name, d->name, NULL);
        st[i].dtype = DTR_U8;
        st[i].ndim = 1;
        st[i].shape[0] = (int64_t)d->e.bytes;
        data[i] = ck->stage + d->off;
        dtr__ck_str(ck->rec.t[i].name, sizeof ck->rec.t[i].name, d->name, NULL);
        ck->rec.t[i].bytes = d->e.bytes;
        ck->rec.t[i].crc = dtr_crc32c(0, ck->stage + d->off, d->e.bytes);
    }
    ck->rec.count = ck->nent;
    dtr__ck_file(sd, ck->rank, path, sizeof path);
    r = dtr_st_write(path, st, data, ck->nent, ck->wmsg, sizeof ck->wmsg);
    if (r == DTR_OK && (e = dtr__ck_file_crc(path, &ck->rec.bytes, &ck->rec.crc)) != 0)
        r = dtr__errf(ck->wmsg, sizeof ck->wmsg, DTR_IO_ERROR, "%s: cannot read it back: %s", path, strerror(e));
    dtr__free(NULL, st);
    dtr__free(NULL, data);
    return r;
}

/* Rank 0, before any rank writes: makes the folder and removes an old manifest of the same
   step, so the folder is incomplete while its files change. */
static dtr_result dtr__ck_prepare_dir(dtr_ckpt *ck, const char *sd) {
    char path[4200];
    int e;
    if ((e = dtr__ck_mkdir(sd)) != 0)
        return dtr__errf(ck->wmsg, sizeof ck->wmsg, DTR_IO_ERROR, "checkpoint: cannot make folder %s: %s", sd, strerror(e));
    snprintf(path, sizeof path, "%s/" DTR__CK_MANIFEST, sd);
    if (remove(path) == 0) dtr__ck_sync_dir(sd);
    dtr__ck_sync_dir(ck->dir);
    return DTR_OK;
}

static dtr_result dtr__ck_commit(dtr_ckpt *ck, const char *sd, const dtr__ck_rec *recs) {
    dtr__ck_buf b = {NULL, 0, 0, 0};
    char path[4200];
    dtr_result r;
    int i;
    for (i = 0; i < ck->world; i++)
        if (!recs[i].ok)
            return dtr__errf(ck->wmsg, sizeof ck->wmsg, DTR_IO_ERROR, "checkpoint step %lld: rank %d failed to write its "
                             "file: %s", (long long)ck->wstep, i, recs[i].msg);
    dtr__ck_manifest_text(ck, recs, &b);
    if (b.oom) { dtr__free(NULL, b.p); return dtr__errf(ck->wmsg, sizeof ck->wmsg, DTR_OUT_OF_MEMORY, "checkpoint: manifest"); }
    snprintf(path, sizeof path, "%s/" DTR__CK_MANIFEST, sd);
    r = dtr_write_file_atomic(path, b.p, b.n, ck->wmsg, sizeof ck->wmsg);
    dtr__free(NULL, b.p);
    if (r == DTR_OK) dtr__ck_prune(ck, ck->wstep);
    return r;
}

/* The whole write of one checkpoint (writer thread or caller). */
static dtr_result dtr__ck_write(dtr_ckpt *ck) {
    char sd[4096];
    dtr__ck_rec *recs = &ck->rec;
    dtr_result r = DTR_OK, r2;
    int32_t flag;
    double t0 = dtr__ck_now();
    dtr__ck_step_dir(ck, ck->wstep, sd, sizeof sd);
    if (ck->rank == 0) r = dtr__ck_prepare_dir(ck, sd);
    if (ck->world > 1) {   /* everyone waits for rank 0's folder */
        flag = r != DTR_OK;
        if ((r2 = dtr__ck_max(ck->group, &flag, ck->wmsg, sizeof ck->wmsg)) != DTR_OK) return r2;
        if (flag && r == DTR_OK) r = dtr__errf(ck->wmsg, sizeof ck->wmsg, DTR_IO_ERROR, "checkpoint: rank 0 failed to make %s", sd);
    }
    if (r == DTR_OK) r = dtr__ck_write_file(ck, sd);
    ck->rec.ok = r == DTR_OK;
    memcpy(ck->rec.msg, ck->wmsg, sizeof ck->rec.msg - 1);   /* cut to fit the record */
    ck->rec.msg[sizeof ck->rec.msg - 1] = '\0';
    if (r == DTR_OK) ck->rec.msg[0] = '\0';
    if (ck->world > 1) {
        recs = (dtr__ck_rec *)dtr__malloc(NULL, (size_t)ck->world * sizeof *recs);
        if (!recs) return dtr__errf(ck->wmsg, sizeof ck->wmsg, DTR_OUT_OF_MEMORY, "checkpoint: out of memory");
        r2 = dtr_comm_all_gather(ck->group, &ck->rec, recs, sizeof ck->rec, DTR_U8);
        if (r2 != DTR_OK) { dtr__free(NULL, recs); return dtr__errf(ck->wmsg, sizeof ck->wmsg, r2, "checkpoint: %s", dtr_comm_last_error(ck->group)); }
    }
    if (ck->rank == 0 && r == DTR_OK) r = dtr__ck_commit(ck, sd, recs);
    if (ck->world > 1) {   /* everyone learns whether rank 0 committed */
        dtr__free(NULL, recs);
        flag = r != DTR_OK;
        if ((r2 = dtr__ck_max(ck->group, &flag, ck->wmsg, sizeof ck->wmsg)) != DTR_OK) return r2;
        if (flag && r == DTR_OK) r = dtr__errf(ck->wmsg, sizeof ck->wmsg, DTR_IO_ERROR, "checkpoint step %lld: another rank "
                                               "failed (rank 0's log says which)", (long long)ck->wstep);
    }
    ck->stats.write_s = dtr__ck_now() - t0;
    if (r == DTR_OK) ck->stats.committed++;
    return r;
}

static void *dtr__ck_thread(void *arg) {
    dtr_ckpt *ck = (dtr_ckpt *)arg;
    ck->wresult = dtr__ck_write(ck);
    DTR__ATOMIC_STORE(&ck->done, 1);
    return NULL;
}

/* Joins the writer; returns its result once (DTR_OK afterwards). */
static dtr_result dtr__ck_join(dtr_ckpt *ck) {
    dtr_result r;
    if (ck->running) {
        pthread_join(ck->thread, NULL);
        ck->running = 0;
    }
    r = ck->wresult;
    ck->wresult = DTR_OK;
    if (r != DTR_OK) dtr__ck_str(ck->msg, sizeof ck->msg, ck->wmsg, NULL);
    return r;
}

/* 1 when the writer (on any rank, with a group) is still busy. */
static int dtr__ck_busy(dtr_ckpt *ck, dtr_result *r) {
    int32_t busy = ck->running && !DTR__ATOMIC_LOAD(&ck->done);
    *r = DTR_OK;
    if (ck->world > 1) *r = dtr__ck_max(ck->cfg.comm, &busy, ck->msg, sizeof ck->msg);
    return busy != 0;
}

static dtr_result dtr__ck_snapshot(dtr_ckpt *ck) {
    dtr_result r = dtr__ck_list(ck);
    int i;
    for (i = 0; r == DTR_OK && i < ck->nent; i++)
        if ((r = dtr__ck_copy(ck, &ck->ents[i], ck->stage + ck->ents[i].off, 0)) != DTR_OK)
            dtr__errf(ck->msg, sizeof ck->msg, r, "checkpoint: copying %s from the device failed", ck->ents[i].name);
    if (r != DTR_OK) return r;
    memset(&ck->rec, 0, sizeof ck->rec);
    dtr__ck_identity(ck, &ck->rec);
    ck->wmeta = ck->meta;
    ck->stats.bytes = (uint64_t)ck->stage_bytes;
    return DTR_OK;
}

/* ZeRO-3: the engine gathers the parameters first (every rank saves: a collective), so the
   model's entry holds the whole model; sharded parameters without the engine are refused */
static dtr_result dtr__ck_whole_params(dtr_ckpt *ck) {
    dtr_model *m = ck->cfg.model;
    dtr_result r;
    if (!m) return DTR_OK;
    r = ck->cfg.dp ? dtr_dp_gather_params(ck->cfg.dp) : DTR_OK;
    if (r == DTR_OK) r = dtr__model_present(m, "dtr_ckpt_save");
    if (r == DTR_OK) return DTR_OK;
    return dtr__errf(ck->msg, sizeof ck->msg, r, "%s", dtr_context_last_error(dtr_model_context(m)));
}

static dtr_result dtr__ck_save(dtr_ckpt *ck, int64_t step, int *started) {
    dtr_result r, prev = DTR_OK;
    double t0 = dtr__ck_now();
    if (started) *started = 0;
    if (!ck) return DTR_NULL_HANDLE;
    if (step < 0 || step > 99999999)
        return dtr__errf(ck->msg, sizeof ck->msg, DTR_INVALID_ARGUMENT, "dtr_ckpt_save: step %lld is outside [0, 99999999]",
                         (long long)step);
    if ((r = dtr__ck_whole_params(ck)) != DTR_OK) return r;
    if (dtr__ck_busy(ck, &r) && ck->cfg.busy == DTR_CKPT_BUSY_SKIP && r == DTR_OK) { ck->stats.skipped++; return DTR_OK; }
    if (r != DTR_OK) return r;
    prev = dtr__ck_join(ck);
    if ((r = dtr__ck_snapshot(ck)) != DTR_OK) return r;
    ck->stats.snapshot_s = dtr__ck_now() - t0;
    ck->wstep = step;
    ck->stats.saves++;
    if (started) *started = 1;
    if (ck->cfg.sync) {
        ck->wresult = dtr__ck_write(ck);
        r = dtr__ck_join(ck);
        return prev != DTR_OK ? prev : r;
    }
    ck->done = 0;
    if (pthread_create(&ck->thread, NULL, dtr__ck_thread, ck) != 0) {
        ck->wresult = dtr__ck_write(ck);   /* no thread: write now */
        ck->done = 1;
    } else ck->running = 1;
    return prev;
}

dtr_result dtr_ckpt_save(dtr_ckpt *ck, int64_t step, int *started) {
    dtr_result r;
    if (ck && ck->cfg.ctx) dtr__obs_phase_begin(ck->cfg.ctx, DTR_PHASE_CHECKPOINT);   /* the metrics' checkpoint time */
    r = dtr__ck_save(ck, step, started);
    if (ck && ck->cfg.ctx) dtr__obs_phase_end(ck->cfg.ctx, DTR_PHASE_CHECKPOINT);
    return r;
}

dtr_result dtr_ckpt_wait(dtr_ckpt *ck) {
    return ck ? dtr__ck_join(ck) : DTR_NULL_HANDLE;
}

/* ---- restoring ---- */

/* The checkpoint's files this restore opened (verified), by old rank. */
typedef struct dtr__ck_src {
    const dtr__ck_manifest *m;
    const char *sd;
    dtr_st_file *files;
    int *opened;
} dtr__ck_src;

/* Opens old rank k's file once: checks its size and CRC-32C against the manifest, parses it. */
static dtr_result dtr__ck_open(dtr_ckpt *ck, dtr__ck_src *s, int k) {
    char path[4200];
    const dtr__ck_rec *fr = &s->m->files[k];
    char err[256];
    dtr_result r;
    if (s->opened[k]) return DTR_OK;
    dtr__ck_file(s->sd, k, path, sizeof path);
    r = dtr_st_open(path, NULL, &s->files[k], err, sizeof err);
    if (r == DTR_IO_ERROR || (r != DTR_OK && !dtr__ck_exists(path)))
        return dtr__errf(ck->msg, sizeof ck->msg, DTR_IO_ERROR, "%s: missing or unreadable (rank %d's shard): %s", path, k, err);
    if (r == DTR_OK && (s->files[k].size != fr->bytes || dtr_crc32c(0, s->files[k].bytes, s->files[k].size) != fr->crc)) {
        dtr__errf(ck->msg, sizeof ck->msg, DTR_CORRUPT_FILE, "%s: %zu bytes with CRC-32C %08x, the manifest says %llu bytes "
                  "with %08x (truncated or altered)", path, s->files[k].size, dtr_crc32c(0, s->files[k].bytes, s->files[k].size),
                  (unsigned long long)fr->bytes, fr->crc);
        dtr_st_destroy(&s->files[k]);
        return DTR_CORRUPT_FILE;
    }
    if (r != DTR_OK)   /* a size the manifest also has but a parse failure: altered consistently? still corrupt */
        return dtr__errf(ck->msg, sizeof ck->msg, DTR_CORRUPT_FILE, "%s: %s", path, err);
    s->opened[k] = 1;
    return DTR_OK;
}

static int dtr__ck_has(const dtr__ck_rec *fr, const char *name) {
    int i;
    for (i = 0; i < fr->count; i++)
        if (strcmp(fr->t[i].name, name) == 0) return 1;
    return 0;
}

/* The bytes of tensor `name` of old rank k's file, checked against the manifest. */
static dtr_result dtr__ck_tensor(dtr_ckpt *ck, dtr__ck_src *s, int k, const char *name, const unsigned char **data,
                                 uint64_t *bytes) {
    const dtr__ck_rec *fr = &s->m->files[k];
    dtr_result r = dtr__ck_open(ck, s, k);
    int i;
    if (r != DTR_OK) return r;
    for (i = 0; i < fr->count && strcmp(fr->t[i].name, name) != 0; i++) {}
    if (i == fr->count)
        return dtr__errf(ck->msg, sizeof ck->msg, DTR_INVALID_ARGUMENT, "%s/rank-%05d.safetensors: the checkpoint has no "
                         "entry '%s' (saved with other objects or options)", s->sd, k, name);
    for (r = DTR_CORRUPT_FILE, *data = NULL, *bytes = 0, i = 0; i < s->files[k].count; i++) {
        const dtr_st_entry *e = &s->files[k].entries[i];
        if (strcmp(e->name, name) != 0) continue;
        *data = (const unsigned char *)e->data;
        *bytes = e->end - e->begin;
        r = DTR_OK;
    }
    for (i = 0; i < fr->count && strcmp(fr->t[i].name, name) != 0; i++) {}
    if (r != DTR_OK || *bytes != fr->t[i].bytes || dtr_crc32c(0, *data, (size_t)*bytes) != fr->t[i].crc)
        return dtr__errf(ck->msg, sizeof ck->msg, DTR_CORRUPT_FILE, "%s/rank-%05d.safetensors: tensor '%s' is missing or "
                         "does not match its size and CRC-32C in the manifest", s->sd, k, name);
    return DTR_OK;
}

static dtr_result dtr__ck_size_err(dtr_ckpt *ck, const dtr__ck_src *s, int k, const dtr__ck_entry *d, uint64_t bytes) {
    return dtr__errf(ck->msg, sizeof ck->msg, DTR_INVALID_ARGUMENT, "%s/rank-%05d.safetensors: tensor '%s' holds %llu "
                     "bytes, this run's entry %zu (another configuration)", s->sd, k, d->name, (unsigned long long)bytes,
                     d->e.bytes);
}

/* The moments' floats for model floats [a, b): the trainable ones (the optimizer keeps none for
   frozen parameters, and packs the others in the buffer's order) */
static int64_t dtr__ck_packed(dtr_model *m, int64_t a, int64_t b) {
    int64_t n = 0, lo, hi;
    int i = 0;
    if (!m || !dtr__model_frozen(m)) return b > a ? b - a : 0;
    while (dtr__model_next_run(m, &i, &lo, &hi)) {
        lo = lo > a ? lo : a, hi = hi < b ? hi : b;
        if (lo < hi) n += hi - lo;
    }
    return n;
}

/* ZeRO re-split: this rank's optimizer range gathered from the old ranks' shards (with frozen
   parameters the trainable floats of each: packed in the same order, those of [lo, hi) are one
   stretch in either buffer). */
static dtr_result dtr__ck_gather_shard(dtr_ckpt *ck, dtr__ck_src *s, const dtr__ck_entry *d, unsigned char *dst) {
    dtr_model *m = ck->cfg.model;
    int64_t base, len, covered = 0, want;
    int k;
    dtr__optimizer_range(ck->cfg.optimizer, &base, &len);
    want = dtr__ck_packed(m, base, base + len);
    if ((int64_t)d->e.bytes != want * (int64_t)sizeof(float)) return dtr__ck_size_err(ck, s, 0, d, (uint64_t)want * 4);
    for (k = 0; k < s->m->world; k++) {
        const dtr__ck_rec *fr = &s->m->files[k];
        int64_t lo = fr->shard_begin > base ? fr->shard_begin : base, hi = fr->shard_end < base + len ? fr->shard_end : base + len;
        const unsigned char *src;
        uint64_t bytes;
        dtr_result r;
        if (hi <= lo) continue;
        if ((r = dtr__ck_tensor(ck, s, k, d->name, &src, &bytes)) != DTR_OK) return r;
        if (bytes != (uint64_t)dtr__ck_packed(m, fr->shard_begin, fr->shard_end) * sizeof(float))
            return dtr__ck_size_err(ck, s, k, d, bytes);
        memcpy(dst + dtr__ck_packed(m, base, lo) * 4, src + dtr__ck_packed(m, fr->shard_begin, lo) * 4,
               (size_t)dtr__ck_packed(m, lo, hi) * 4);
        if (lo >= base + covered) covered = hi - base;   /* shards are ordered and disjoint */
    }
    if (covered != len)
        return dtr__errf(ck->msg, sizeof ck->msg, DTR_CORRUPT_FILE, "%s: the optimizer shards of the checkpoint do not cover "
                         "[%lld, %lld)", s->sd, (long long)base, (long long)(base + len));
    return DTR_OK;
}

/* Loader cursor of old rank k moved to this world: the same samples seen, rounded down. */
static void dtr__ck_fix_cursor(dtr_ckpt *ck, unsigned char *dst) {
    dtr_loader_cursor c, live;
    memcpy(&c, dst, sizeof c);
    dtr_loader_get_cursor(ck->cfg.loader, &live);
    if (c.world > 0 && live.world > 0 && c.batch_size == live.batch_size)
        c.position = c.position * c.world / live.world;
    else c.position = 0, c.epoch += 1;   /* another batch size: the next epoch */
    c.rank = live.rank;
    c.world = live.world;
    memcpy(dst, &c, sizeof c);
}

/* 1 for the optimizer's entries added after the format's first checkpoints (per-parameter
   steps, the schedule's later fields, metric reports): an older file lacks them */
static int dtr__ck_newer(const char *name) {
    return strcmp(name, "optimizer/started") == 0 || strcmp(name, "optimizer/schedule2") == 0 ||
           strcmp(name, "optimizer/reports") == 0;
}

/* Stages live entry d from the checkpoint (verified) at ck->stage + d->off. */
static dtr_result dtr__ck_stage(dtr_ckpt *ck, dtr__ck_src *s, const dtr__ck_entry *d) {
    int same = s->m->world == ck->world, k = same ? ck->rank : ck->rank % s->m->world;
    const dtr__ck_obj *o = &ck->objs[d->obj];
    const unsigned char *src;
    uint64_t bytes;
    dtr_result r;
    if (!same && o->kind == DTR__CK_OPT && (strcmp(d->name, "optimizer/m") == 0 || strcmp(d->name, "optimizer/v") == 0))
        return dtr__ck_gather_shard(ck, s, d, ck->stage + d->off);
    if (!same && o->kind == DTR__CK_DP && strcmp(d->name, "dp/residual") == 0) {
        memset(ck->stage + d->off, 0, d->e.bytes);
        return DTR_OK;
    }
    if (!same && o->kind == DTR__CK_DP && !dtr__ck_has(&s->m->files[k], d->name))   /* saved without an engine */
        return dtr__ck_copy(ck, d, ck->stage + d->off, 0);
    if (o->kind == DTR__CK_OPT && dtr__ck_newer(d->name) && !dtr__ck_has(&s->m->files[k], d->name))
        return dtr__ck_copy(ck, d, ck->stage + d->off, 0);   /* a file from before the entry: as created */
    if ((r = dtr__ck_tensor(ck, s, k, d->name, &src, &bytes)) != DTR_OK) return r;
    if (bytes != d->e.bytes) return dtr__ck_size_err(ck, s, k, d, bytes);
    memcpy(ck->stage + d->off, src, d->e.bytes);
    if (!same && o->kind == DTR__CK_LOADER && d->e.bytes == sizeof(dtr_loader_cursor)) dtr__ck_fix_cursor(ck, ck->stage + d->off);
    return DTR_OK;
}

/* Checks the manifest against this run: the model, and whether a world change is possible. */
static dtr_result dtr__ck_check_layout(dtr_ckpt *ck, const char *sd, const dtr__ck_manifest *m) {
    dtr__ck_rec me;
    int k, k0 = m->world == ck->world ? ck->rank : ck->rank % m->world;
    memset(&me, 0, sizeof me);
    dtr__ck_identity(ck, &me);
    if (ck->cfg.model && (m->files[k0].model != me.model || m->files[k0].numel != me.numel))
        return dtr__errf(ck->msg, sizeof ck->msg, DTR_INVALID_ARGUMENT, "%s/" DTR__CK_MANIFEST ": another model (identity %08x, "
                         "%lld parameters; this one %08x, %lld)", sd, m->files[k0].model, (long long)m->files[k0].numel,
                         me.model, (long long)me.numel);
    if (m->world == ck->world) return DTR_OK;
    for (k = 1; k < m->world; k++)
        if (m->files[k].model != m->files[0].model || m->files[k].numel != m->files[0].numel)
            return dtr__errf(ck->msg, sizeof ck->msg, DTR_UNSUPPORTED, "%s: saved on %d ranks whose models differ (pipeline "
                             "stages or tensor shards): restore it on %d ranks, not %d", sd, m->world, m->world, ck->world);
    return DTR_OK;
}

static void dtr__ck_close_src(dtr__ck_src *s) {
    int k;
    for (k = 0; s->opened && k < s->m->world; k++)
        if (s->opened[k]) dtr_st_destroy(&s->files[k]);
    dtr__free(NULL, s->files);
    dtr__free(NULL, s->opened);
}

/* Verifies checkpoint folder `sd` and stages every live entry from it; touches no live state. */
static dtr_result dtr__ck_verify(dtr_ckpt *ck, const char *sd, dtr__ck_manifest *m) {
    dtr__ck_src s;
    dtr_result r;
    int i;
    if ((r = dtr__ck_load_manifest(ck, sd, m)) != DTR_OK) return r;
    if ((r = dtr__ck_check_layout(ck, sd, m)) != DTR_OK) return r;
    if ((r = dtr__ck_list(ck)) != DTR_OK) return r;
    s.m = m;
    s.sd = sd;
    s.files = (dtr_st_file *)dtr__calloc(NULL, (size_t)m->world * sizeof *s.files);
    s.opened = (int *)dtr__calloc(NULL, (size_t)m->world * sizeof *s.opened);
    if (!s.files || !s.opened) r = dtr__errf(ck->msg, sizeof ck->msg, DTR_OUT_OF_MEMORY, "checkpoint: out of memory");
    for (i = 0; r == DTR_OK && i < ck->nent; i++) r = dtr__ck_stage(ck, &s, &ck->ents[i]);
    dtr__ck_close_src(&s);
    return r;
}

/* Writes the staged entries into the live objects; on a refusal puts the old bytes back. */
static dtr_result dtr__ck_apply(dtr_ckpt *ck) {
    unsigned char *old = (unsigned char *)dtr__malloc(NULL, ck->stage_bytes ? ck->stage_bytes : 1);
    dtr_result r = old ? DTR_OK : DTR_OUT_OF_MEMORY;
    int i, k, undo;
    for (i = 0; r == DTR_OK && i < ck->nent; i++) r = dtr__ck_copy(ck, &ck->ents[i], old + ck->ents[i].off, 0);
    for (i = 0; r == DTR_OK && i < ck->nent; i++) r = dtr__ck_copy(ck, &ck->ents[i], ck->stage + ck->ents[i].off, 1);
    for (k = 0; r == DTR_OK && k < ck->nobj; k++)
        if ((r = dtr__ck_loaded(&ck->objs[k])) != DTR_OK)
            dtr__errf(ck->msg, sizeof ck->msg, r, "checkpoint: '%s' refused the restored state (%s); the previous state is back",
                      ck->objs[k].name, dtr_result_string(r));
    undo = r != DTR_OK && old;
    for (i = 0; undo && i < ck->nent; i++) dtr__ck_copy(ck, &ck->ents[i], old + ck->ents[i].off, 1);
    for (k = 0; undo && k < ck->nobj; k++) dtr__ck_loaded(&ck->objs[k]);
    dtr__free(NULL, old);
    if (r == DTR_OUT_OF_MEMORY && !old) dtr__errf(ck->msg, sizeof ck->msg, r, "checkpoint: no memory to restore");
    return r;
}

/* The step of candidate i (rank 0's list, broadcast), -1 past the last. */
static dtr_result dtr__ck_candidate(dtr_ckpt *ck, const int64_t *steps, int n, int i, int64_t *step) {
    dtr_result r = DTR_OK;
    *step = i < n ? steps[i] : -1;
    if (ck->world > 1 && (r = dtr_comm_broadcast(ck->group, step, sizeof *step, DTR_U8, 0)) != DTR_OK)
        dtr__errf(ck->msg, sizeof ck->msg, r, "checkpoint: %s", dtr_comm_last_error(ck->group));
    return r;
}

/* Every rank's verdict: the first failure's code on all (DTR_OK when all verified). */
static dtr_result dtr__ck_agree(dtr_ckpt *ck, dtr_result mine) {
    int32_t v = (int32_t)-mine;
    dtr_result r;
    if (ck->world == 1) return mine;
    if ((r = dtr__ck_max(ck->group, &v, ck->msg, sizeof ck->msg)) != DTR_OK) return r;
    if (v != 0 && mine == DTR_OK) snprintf(ck->msg, sizeof ck->msg, "checkpoint: another rank failed to verify it (%s)",
                                           dtr_result_string((dtr_result)-v));
    return (dtr_result)-v;
}

static dtr_result dtr__ck_try(dtr_ckpt *ck, const char *sd, int64_t *step) {
    dtr__ck_manifest m;
    dtr_result r;
    memset(&m, 0, sizeof m);
    r = dtr__ck_agree(ck, dtr__ck_verify(ck, sd, &m));
    if (r == DTR_OK) r = dtr__ck_agree(ck, dtr__ck_apply(ck));
    if (r == DTR_OK) {
        ck->meta = m.meta;
        if (step) *step = m.step;
    }
    dtr__free(NULL, m.files);
    return r;
}

dtr_result dtr_ckpt_restore(dtr_ckpt *ck, const char *path, int64_t *step) {
    int64_t steps[1024], s;
    char sd[4096], first[512] = "";
    dtr_result r = DTR_NOT_FOUND, rc;
    int n = 0, i;
    if (!ck) return DTR_NULL_HANDLE;
    (void)dtr__ck_join(ck);
    ck->msg[0] = '\0';
    if (path) return dtr__ck_try(ck, path, step);
    if (ck->rank == 0 && (n = dtr__ck_scan(ck->dir, 1, steps, 1024)) < 0) n = 0;
    for (i = 0;; i++) {
        if ((rc = dtr__ck_candidate(ck, steps, n, i, &s)) != DTR_OK) return rc;
        if (s < 0) break;
        dtr__ck_step_dir(ck, s, sd, sizeof sd);
        r = dtr__ck_try(ck, sd, step);
        if (r == DTR_OK || !ck->cfg.fallback || (r != DTR_CORRUPT_FILE && r != DTR_IO_ERROR && r != DTR_NOT_FOUND)) break;
        if (!first[0]) dtr__ck_str(first, sizeof first, ck->msg, NULL);
    }
    if (r == DTR_NOT_FOUND && !ck->msg[0]) snprintf(ck->msg, sizeof ck->msg, "no complete checkpoint under %s", ck->dir);
    if (first[0] && r != DTR_OK) dtr__ck_str(ck->msg, sizeof ck->msg, first, NULL);
    return r;
}

/* ---- the rest ---- */

const char *dtr_ckpt_last_error(const dtr_ckpt *ck) {
    return ck ? ck->msg : "";
}

dtr_result dtr_ckpt_get_stats(const dtr_ckpt *ck, dtr_ckpt_stats *out) {
    if (!ck || !out) return DTR_NULL_HANDLE;
    *out = ck->stats;
    return DTR_OK;
}

void dtr_ckpt_destroy(dtr_ckpt *ck) {
    if (!ck) return;
    (void)dtr__ck_join(ck);
    if (ck->group) dtr_comm_destroy(ck->group);
    dtr__free(NULL, ck->stage);
    dtr__free(NULL, ck->dir);
    dtr__free(NULL, ck);
}
