/* ============================================================================
 * The flight recorder of a group: a ring of the group's last operations (collectives and
 * point-to-point transfers: op, bytes, peer or root, sequence number, start and end times,
 * running / done / failed), allocated once with the group, so recording costs a lock and a
 * few stores per operation and no allocation. On the group's first communication failure
 * it is handed to the log callback and, when a folder is set (cfg.flight_dir, else
 * $DTR_FLIGHT_DIR), written to <dir>/flight-rank<N>.json (sub-groups:
 * flight-rank<N>-group<ctx>.json) with the atomic writer. dtr_comm_flight reads it.
 * ==========================================================================*/
#include "../public/api.h"
#include "../core/internal.h"
#include "comm_internal.h"

dtr_result dtr__flight_init(dtr_comm *c, int cap, const char *dir) {
    dtr__flight *fl = &c->flight;
    memset(fl, 0, sizeof *fl);
    if (pthread_mutex_init(&fl->mu, NULL) != 0) return DTR_OUT_OF_MEMORY;
    fl->inited = 1;
    fl->cap = cap == 0 ? DTR__FLIGHT_DEFAULT : cap < 0 ? 0 : cap;
    if (!dir || !*dir) dir = getenv("DTR_FLIGHT_DIR");
    snprintf(fl->dir, sizeof fl->dir, "%s", dir ? dir : "");
    if (fl->cap && !(fl->ring = (dtr_flight_record *)dtr__calloc(&c->ep->alloc, (size_t)fl->cap * sizeof *fl->ring)))
        return DTR_OUT_OF_MEMORY;
    return DTR_OK;
}

void dtr__flight_free(dtr_comm *c) {
    if (!c->flight.inited) return;
    dtr__free(&c->ep->alloc, c->flight.ring);
    pthread_mutex_destroy(&c->flight.mu);
    c->flight.inited = 0;
}

static size_t dtr__flight_bytes(const dtr__coll *a) {
    size_t es = a->kind == DTR__OP_SEND || a->kind == DTR__OP_RECV ? 1 : dtr_dtype_size(a->dtype);
    return a->count * es;
}

uint64_t dtr__flight_begin(dtr_comm *c, const dtr__coll *a) {
    dtr__flight *fl = &c->flight;
    dtr_flight_record *rec;
    uint64_t id;
    if (!fl->cap) return 0;
    pthread_mutex_lock(&fl->mu);
    id = ++fl->next_id;
    rec = &fl->ring[(id - 1) % (uint64_t)fl->cap];
    rec->id = id;
    rec->op = dtr__coll_name(a->kind);
    rec->p2p = a->kind == DTR__OP_SEND || a->kind == DTR__OP_RECV;
    rec->seq = rec->p2p ? 0 : a->seq;
    rec->bytes = dtr__flight_bytes(a);
    rec->peer = rec->p2p || a->kind == DTR__OP_BROADCAST ? a->root : -1;
    rec->tag = rec->p2p ? a->tag : 0;
    rec->start_ns = dtr_time_ns();
    rec->end_ns = 0;
    rec->state = DTR_FLIGHT_RUNNING;
    rec->result = DTR_OK;
    pthread_mutex_unlock(&fl->mu);
    return id;
}

void dtr__flight_end(dtr_comm *c, uint64_t id, dtr_result r) {
    dtr__flight *fl = &c->flight;
    dtr_flight_record *rec;
    if (!id || !fl->cap) return;
    pthread_mutex_lock(&fl->mu);
    rec = &fl->ring[(id - 1) % (uint64_t)fl->cap];
    if (rec->id == id) {   /* else overwritten by later operations */
        rec->end_ns = dtr_time_ns();
        rec->state = r == DTR_OK ? DTR_FLIGHT_DONE : DTR_FLIGHT_FAILED;
        rec->result = r;
    }
    pthread_mutex_unlock(&fl->mu);
}

int dtr_comm_flight(const dtr_comm *c, dtr_flight_record *out, int cap) {
    dtr__flight *fl;
    uint64_t first, id;
    int n = 0;
    if (!c || !c->flight.cap) return 0;
    fl = (dtr__flight *)&c->flight;
    pthread_mutex_lock(&fl->mu);
    first = fl->next_id > (uint64_t)fl->cap ? fl->next_id - (uint64_t)fl->cap + 1 : 1;
    if (!out || cap <= 0) n = (int)(fl->next_id - first + 1);
    else {
        if (fl->next_id + 1 - first > (uint64_t)cap) first = fl->next_id + 1 - (uint64_t)cap;
        for (id = first; id <= fl->next_id; id++) out[n++] = fl->ring[(id - 1) % (uint64_t)fl->cap];
    }
    pthread_mutex_unlock(&fl->mu);
    return n;
}

const char *dtr_flight_state_name(dtr_flight_state s) {
    return s == DTR_FLIGHT_RUNNING ? "running" : s == DTR_FLIGHT_DONE ? "done" : s == DTR_FLIGHT_FAILED ? "failed" : "?";
}

/* ---- the dump ---- */

/* A growing text buffer (oom: an allocation failed; what was written stays). */
typedef struct dtr__sbuf {
    const dtr_allocation_callbacks *alloc;
    char *data;
    size_t len, cap;
    int oom;
} dtr__sbuf;

static void dtr__sbuf_init(dtr__sbuf *b, const dtr_allocation_callbacks *alloc) {
    memset(b, 0, sizeof *b);
    b->alloc = alloc;
}

static void dtr__sbuf_free(dtr__sbuf *b) { dtr__free(b->alloc, b->data); }

static void dtr__sbuf_printf(dtr__sbuf *b, const char *fmt, ...) DTR__PRINTF(2, 3);
static void dtr__sbuf_printf(dtr__sbuf *b, const char *fmt, ...) {
    va_list ap;
    int n;
    if (b->oom) return;
    va_start(ap, fmt);
    n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    if (b->len + (size_t)n + 1 > b->cap) {
        size_t cap = (b->len + (size_t)n + 1) * 2;
        char *p = (char *)dtr__realloc(b->alloc, b->data, cap);
        if (!p) { b->oom = 1; return; }
        b->data = p;
        b->cap = cap;
    }
    va_start(ap, fmt);
    vsnprintf(b->data + b->len, b->cap - b->len, fmt, ap);
    va_end(ap);
    b->len += (size_t)n;
}

/* s as a JSON string body (quotes, backslashes and control characters escaped). */
static void dtr__flight_json_str(dtr__sbuf *b, const char *s) {
    for (; *s; s++) {
        unsigned char ch = (unsigned char)*s;
        if (ch == '"' || ch == '\\') dtr__sbuf_printf(b, "\\%c", ch);
        else if (ch < 0x20) dtr__sbuf_printf(b, "\\u%04x", ch);
        else dtr__sbuf_printf(b, "%c", ch);
    }
}

static void dtr__flight_json_rec(dtr__sbuf *b, const dtr_flight_record *r, int last) {
    int64_t end = r->end_ns ? r->end_ns : dtr_time_ns();
    dtr__sbuf_printf(b, "    {\"id\": %llu, \"op\": \"%s\", \"seq\": %u, \"bytes\": %zu, \"peer\": %d, \"tag\": %d, "
                     "\"start_ns\": %lld, \"end_ns\": %lld, \"ms\": %.3f, \"state\": \"%s\", \"result\": \"%s\"}%s\n",
                     (unsigned long long)r->id, r->op, r->seq, r->bytes, r->peer, r->tag, (long long)r->start_ns,
                     (long long)r->end_ns, (double)(end - r->start_ns) / 1e6, dtr_flight_state_name(r->state),
                     dtr_result_string(r->result), last ? "" : ",");
}

/* The JSON document of the group's record (b must be freed by the caller). */
static void dtr__flight_json(const dtr_comm *c, dtr__sbuf *b, const dtr_flight_record *recs, int n) {
    int i;
    dtr__sbuf_printf(b, "{\n  \"rank\": %d, \"group_rank\": %d, \"size\": %d, \"group\": %u, \"transport\": \"%s\", "
                     "\"detail\": \"", c->ep->info.rank, c->rank, c->size, c->ctx, c->ep->vt->name);
    dtr__flight_json_str(b, c->ep->info.detail);
    dtr__sbuf_printf(b, "\",\n  \"status\": \"%s\", \"failed_rank\": %d, \"time_ns\": %lld,\n  \"error\": \"",
                     dtr_result_string(c->status), c->failed_rank >= 0 ? c->failed_rank : -1, (long long)dtr_time_ns());
    dtr__flight_json_str(b, c->msg);
    dtr__sbuf_printf(b, "\",\n  \"records\": [\n");
    for (i = 0; i < n; i++) dtr__flight_json_rec(b, &recs[i], i == n - 1);
    dtr__sbuf_printf(b, "  ]\n}\n");
}

dtr_result dtr_comm_flight_dump(const dtr_comm *c, const char *path, char *err, size_t errlen) {
    dtr_flight_record *recs;
    dtr__sbuf b;
    dtr_result r;
    int n;
    if (err && errlen) err[0] = 0;
    if (!c || !path) return dtr__errf(err, errlen, DTR_NULL_HANDLE, "dtr_comm_flight_dump: %s is NULL", c ? "path" : "group");
    recs = (dtr_flight_record *)dtr__malloc(&c->ep->alloc, ((size_t)c->flight.cap + 1) * sizeof *recs);
    if (!recs) return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "dtr_comm_flight_dump: out of memory");
    n = dtr_comm_flight(c, recs, c->flight.cap);
    dtr__sbuf_init(&b, &c->ep->alloc);
    dtr__flight_json(c, &b, recs, n);
    dtr__free(&c->ep->alloc, recs);
    if (b.oom) r = dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "dtr_comm_flight_dump: out of memory");
    else r = dtr_write_file_atomic(path, b.data, b.len, err, errlen);
    dtr__sbuf_free(&b);
    return r;
}

/* The log line: the failure and the last records, newest last. */
static void dtr__flight_log(dtr_comm *c) {
    dtr_flight_record recs[DTR__FLIGHT_LOGGED];
    dtr__sbuf b;
    int n = dtr_comm_flight(c, recs, DTR__FLIGHT_LOGGED), i;
    dtr__sbuf_init(&b, &c->ep->alloc);
    dtr__sbuf_printf(&b, "flight recorder of rank %d (group rank %d/%d), last %d operations:", c->ep->info.rank,
                     c->rank, c->size, n);
    for (i = 0; i < n; i++) {
        const dtr_flight_record *r = &recs[i];
        int64_t end = r->end_ns ? r->end_ns : dtr_time_ns();
        dtr__sbuf_printf(&b, "\n  #%llu %s", (unsigned long long)r->id, r->op);
        if (!r->p2p) dtr__sbuf_printf(&b, " seq %u", r->seq);
        if (r->peer >= 0) dtr__sbuf_printf(&b, " %s %d", r->p2p ? "peer" : "root", r->peer);
        dtr__sbuf_printf(&b, " %zu bytes, %s after %.1f ms%s%s", r->bytes, dtr_flight_state_name(r->state),
                         (double)(end - r->start_ns) / 1e6, r->result != DTR_OK ? ": " : "",
                         r->result != DTR_OK ? dtr_result_string(r->result) : "");
    }
    if (!b.oom && b.data) c->log(c->log_user, DTR_LOG_ERROR, b.data);
    dtr__sbuf_free(&b);
}

void dtr__flight_failure(dtr_comm *c, dtr_result code) {
    dtr__flight *fl = &c->flight;
    int i, dump;
    if (!fl->cap) return;
    pthread_mutex_lock(&fl->mu);
    for (i = 0; i < fl->cap; i++)   /* the operations under way failed with the group */
        if (fl->ring[i].id && fl->ring[i].state == DTR_FLIGHT_RUNNING) {
            fl->ring[i].state = DTR_FLIGHT_FAILED;
            fl->ring[i].result = code;
        }
    dump = !fl->dumped;
    fl->dumped = 1;
    pthread_mutex_unlock(&fl->mu);
    if (!dump) return;
    if (c->log && c->log_level >= DTR_LOG_ERROR) dtr__flight_log(c);
    if (fl->dir[0]) {
        char path[400], err[256];
        if (c->ctx) snprintf(path, sizeof path, "%s/flight-rank%d-group%u.json", fl->dir, c->ep->info.rank, c->ctx);
        else snprintf(path, sizeof path, "%s/flight-rank%d.json", fl->dir, c->ep->info.rank);
        if (dtr_comm_flight_dump(c, path, err, sizeof err) != DTR_OK && c->log && c->log_level >= DTR_LOG_ERROR)
            c->log(c->log_user, DTR_LOG_ERROR, err);
    }
}
