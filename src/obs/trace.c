/* ============================================================================
 * Timeline: a bounded ring of spans (no allocation per event: the ring is made with the
 * dtr_metrics), written as Chrome trace-event JSON ("X" complete events, microseconds of
 * the monotonic clock of dtr_time_ns, pid = rank) that Perfetto and chrome://tracing open; and the merge of
 * the ranks' files into one (dtrun --merge-traces).
 *
 * Rows (tid) of a rank: 0 is the thread driving the context (op forward and backward spans,
 * the phases data, backward, comm, optimizer, checkpoint, and the waits on collectives
 * inside comm); 1 + (k mod 16) holds data-parallel bucket k's collective from its start to
 * the end of its wait, so buckets in flight together sit on rows of their own.
 * ==========================================================================*/
#include "../public/api.h"
#include "../public/api_data.h"
#include "../public/api_obs.h"
#include "obs_internal.h"

static const char *const dtr__obs_cat_names[DTR__OBS_CAT_COUNT] = {"forward", "backward", "comm", "phase"};

void dtr__obs_span(dtr_metrics *m, const char *name, int cat, int tid, int arg, double t0, double t1) {
    dtr__obs_event *e;
    if (!m->ring) return;
    e = &m->ring[(m->head + m->count) % m->cap];
    if (m->count < m->cap) m->count++;
    else { m->head = (m->head + 1) % m->cap; m->dropped++; }
    e->t0 = t0;
    e->t1 = t1 > t0 ? t1 : t0;
    e->name = name;
    e->arg = arg;
    e->cat = (uint8_t)cat;
    e->tid = (uint8_t)tid;
}

uint64_t dtr_metrics_trace_dropped(const dtr_metrics *m) { return m ? m->dropped : 0; }

/* ---- writing ---- */

static void dtr__obs_meta(dtr__afile *f, int rank, uint64_t dropped) {
    char line[256];
    int k, n = snprintf(line, sizeof line,
                        "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":%d,\"tid\":0,\"args\":{\"name\":\"rank %d\","
                        "\"dropped_events\":%llu}},\n", rank, rank, (unsigned long long)dropped);
    dtr__afile_write(f, line, (size_t)n);
    n = snprintf(line, sizeof line, "{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":%d,\"tid\":0,\"args\":{\"name\":"
                 "\"compute\"}}", rank);
    dtr__afile_write(f, line, (size_t)n);
    for (k = 0; k < 16; k++) {
        n = snprintf(line, sizeof line, ",\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":%d,\"tid\":%d,\"args\":"
                     "{\"name\":\"collectives %d\"}}", rank, 1 + k, k);
        dtr__afile_write(f, line, (size_t)n);
    }
}

static void dtr__obs_event_write(dtr__afile *f, int rank, const dtr__obs_event *e) {
    char line[320], arg[48] = "";
    int n;
    if (e->arg >= 0) snprintf(arg, sizeof arg, ",\"args\":{\"bucket\":%d}", (int)e->arg);
    n = snprintf(line, sizeof line, ",\n{\"name\":\"%s\",\"cat\":\"%s\",\"ph\":\"X\",\"pid\":%d,\"tid\":%d,"
                 "\"ts\":%.3f,\"dur\":%.3f%s}", e->name, dtr__obs_cat_names[e->cat], rank, (int)e->tid, e->t0 * 1e6,
                 (e->t1 - e->t0) * 1e6, arg);
    dtr__afile_write(f, line, (size_t)n);
}

dtr_result dtr_metrics_write_trace(dtr_metrics *m) {
    static const char head[] = "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n";
    dtr__afile *f;
    char err[256];
    size_t i;
    dtr_result r;
    if (!m) return DTR_NULL_HANDLE;
    if (!m->trace_path || !m->ring) return DTR_OK;
    if ((r = dtr__afile_open(&f, m->trace_path, err, sizeof err)) != DTR_OK)
        return dtr__fail(m->ctx, r, "dtr_metrics_write_trace: %s", err);
    dtr__afile_write(f, head, sizeof head - 1);
    dtr__obs_meta(f, (int)m->cfg.rank, m->dropped);
    for (i = 0; i < m->count; i++) dtr__obs_event_write(f, (int)m->cfg.rank, &m->ring[(m->head + i) % m->cap]);
    dtr__afile_write(f, "\n]}\n", 4);
    if ((r = dtr__afile_commit(f, err, sizeof err)) != DTR_OK)
        return dtr__fail(m->ctx, r, "dtr_metrics_write_trace: %s", err);
    return DTR_OK;
}

/* ---- merging ---- */

/* Copies the elements of the "traceEvents" array of the JSON text s (already validated) to
 * f, each preceded by a comma unless it is the very first (*first). */
static dtr_result dtr__trace_copy(dtr__json *j, dtr__afile *f, int *first) {
    char key[32];
    size_t len;
    dtr_result r;
    if ((r = dtr__json_expect(j, '{')) != DTR_OK) return r;
    if (dtr__json_accept(j, '}')) return dtr__json_fail(j, "no \"traceEvents\" array");
    for (;;) {
        if ((r = dtr__json_string(j, key, sizeof key, &len)) != DTR_OK) return r;
        if ((r = dtr__json_expect(j, ':')) != DTR_OK) return r;
        if (strcmp(key, "traceEvents") == 0 && dtr__json_accept(j, '[')) break;
        if ((r = dtr__json_skip(j)) != DTR_OK) return r;
        if (!dtr__json_accept(j, ',')) return dtr__json_fail(j, "no \"traceEvents\" array");
    }
    if (dtr__json_accept(j, ']')) return DTR_OK;
    do {
        size_t start;
        dtr__json_ws(j);
        start = j->pos;
        if ((r = dtr__json_skip(j)) != DTR_OK) return r;
        dtr__afile_write(f, *first ? "\n" : ",\n", *first ? 1 : 2);
        dtr__afile_write(f, j->s + start, j->pos - start);
        *first = 0;
    } while (dtr__json_accept(j, ','));
    return dtr__json_expect(j, ']');
}

static dtr_result dtr__trace_merge_one(const char *path, dtr__afile *f, int *first, char *err, size_t errlen) {
    unsigned char *buf = NULL;
    size_t size = 0;
    dtr__json j;
    dtr_result r = dtr__read_file(path, NULL, &buf, &size, err, errlen);
    if (r != DTR_OK) return r;
    dtr__json_init(&j, (const char *)buf, size);
    r = dtr__json_validate(&j);
    if (r == DTR_OK) r = dtr__trace_copy(&j, f, first);
    if (r != DTR_OK) dtr__errf(err, errlen, r, "dtr_trace_merge: '%s': %s", path, j.msg);
    dtr__free(NULL, buf);
    return r;
}

dtr_result dtr_trace_merge(const char *const *inputs, int n, const char *output, char *err, size_t errlen) {
    static const char head[] = "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[";
    dtr__afile *f;
    dtr_result r;
    int i, first = 1;
    if (err && errlen) err[0] = '\0';
    if (!inputs || !output) return dtr__errf(err, errlen, DTR_NULL_HANDLE, "dtr_trace_merge: NULL argument");
    if (n < 1) return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "dtr_trace_merge: %d input files", n);
    for (i = 0; i < n; i++)
        if (!inputs[i]) return dtr__errf(err, errlen, DTR_NULL_HANDLE, "dtr_trace_merge: input %d is NULL", i);
    if ((r = dtr__afile_open(&f, output, err, errlen)) != DTR_OK) return r;
    dtr__afile_write(f, head, sizeof head - 1);
    for (i = 0; i < n && r == DTR_OK; i++) r = dtr__trace_merge_one(inputs[i], f, &first, err, errlen);
    if (r != DTR_OK) {
        dtr__afile_abort(f);
        return r;
    }
    dtr__afile_write(f, "\n]}\n", 4);
    return dtr__afile_commit(f, err, errlen);
}
