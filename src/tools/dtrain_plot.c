/* ============================================================================
 * dtrain-plot: standalone SVG pictures of a training run, no Python.
 *
 *   dtrain-plot [--rank R] [-o out.svg] metrics.jsonl
 *       The metrics JSON lines (docs/observability.md: one object per line, e.g.
 *       {"rank":0,"step":12,"loss":0.53,"samples_per_s":1234.5,"time":{"data":0.001,...},
 *       "skipped":0}) of one rank (default 0) as three panels: the loss per step, the
 *       throughput per step (samples/s, or tokens/s when no samples are counted) and the
 *       time of each step split into data, forward, backward, comm, optimizer and
 *       checkpoint (stacked). Steps whose update was skipped are marked on the loss.
 *   dtrain-plot --trace [--from MS --to MS] [-o out.svg] trace0.json [trace1.json ...]
 *       Chrome trace-event files ({"traceEvents":[...]} or a bare array; "X" events and
 *       "B"/"E" pairs) as a timeline: one lane per (pid, tid), nested spans below their
 *       parents, each span's name and duration in its tooltip; lanes take their names from
 *       "thread_name" metadata. --from MS --to MS draws only that window (milliseconds from
 *       the first span's start).
 *
 * Missing fields are tolerated (a series leaves the record out); a malformed line or file
 * is an error naming the file, the line and the problem, with exit code 1. The JSON reader
 * is the library's own (src/io/json.c), so this program compiles the implementation.
 * ==========================================================================*/
#define DTRAIN_IMPLEMENTATION
#include "../../dtrain.h"
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- input ---- */

/* doubles *cap (at least 64 items of `size`) keeping *p; 0 when out of memory */
static int grow(void **p, size_t *cap, size_t size) {
    size_t nc = *cap ? *cap * 2 : 64;
    void *np = realloc(*p, nc * size);
    if (!np) return 0;
    *p = np;
    *cap = nc;
    return 1;
}

/* the whole file, NUL-terminated; NULL with a message on failure */
static char *read_file(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    char *buf = NULL;
    size_t cap = 0, len = 0, k;
    if (!f) { fprintf(stderr, "dtrain-plot: cannot open %s\n", path); return NULL; }
    do {
        if (cap - len < 65536) {
            char *nb = (char *)realloc(buf, cap = cap * 2 + 65536 + 1);
            if (!nb) { free(buf); fclose(f); fprintf(stderr, "dtrain-plot: out of memory reading %s\n", path); return NULL; }
            buf = nb;
        }
        k = fread(buf + len, 1, cap - len - 1, f);
        len += k;
    } while (k > 0);
    if (ferror(f)) { free(buf); fclose(f); fprintf(stderr, "dtrain-plot: cannot read %s\n", path); return NULL; }
    fclose(f);
    buf[len] = 0;
    *n = len;
    return buf;
}

/* a JSON number at the cursor into *v (null gives NAN) */
static dtr_result json_num(dtr__json *j, double *v) {
    size_t start;
    char tmp[64];
    dtr_result r;
    if (dtr__json_peek(j) == 'n') {
        if (!dtr__json_word(j, "null")) return dtr__json_fail(j, "expected a number or null");
        *v = NAN;
        return DTR_OK;
    }
    start = j->pos;
    if ((r = dtr__json_number(j)) != DTR_OK) return r;
    if (j->pos - start >= sizeof tmp) return dtr__json_fail(j, "number too long");
    memcpy(tmp, j->s + start, j->pos - start);
    tmp[j->pos - start] = 0;
    *v = strtod(tmp, NULL);
    return DTR_OK;
}

/* ---- metrics ---- */

#define NTIME 6
static const char *const time_keys[NTIME] = {"data", "forward", "backward", "comm", "optimizer", "checkpoint"};
static const char *const time_colors[NTIME] = {"#8c564b", "#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#7f7f7f"};

typedef struct rec {
    double rank, step, loss, sps, tps, skipped;
    double t[NTIME], total;   /* time.<part>, time.step */
} rec;

typedef struct recs { rec *r; size_t n, cap; } recs;

static dtr_result parse_time(dtr__json *j, rec *out) {
    char key[32];
    dtr_result r;
    int k;
    if ((r = dtr__json_expect(j, '{')) != DTR_OK) return r;
    if (dtr__json_accept(j, '}')) return DTR_OK;
    for (;;) {
        if ((r = dtr__json_string(j, key, sizeof key, NULL)) != DTR_OK) return r;
        if ((r = dtr__json_expect(j, ':')) != DTR_OK) return r;
        for (k = 0; k < NTIME && strcmp(key, time_keys[k]) != 0; k++) {}
        if (k < NTIME) r = json_num(j, &out->t[k]);
        else r = !strcmp(key, "step") ? json_num(j, &out->total) : dtr__json_skip(j);
        if (r != DTR_OK) return r;
        if (!dtr__json_accept(j, ',')) return dtr__json_expect(j, '}');
    }
}

/* the numeric field named key of a record, or NULL for one the plot does not use */
static double *rec_field(rec *x, const char *key) {
    if (!strcmp(key, "rank")) return &x->rank;
    if (!strcmp(key, "step")) return &x->step;
    if (!strcmp(key, "loss")) return &x->loss;
    if (!strcmp(key, "samples_per_s")) return &x->sps;
    if (!strcmp(key, "tokens_per_s")) return &x->tps;
    if (!strcmp(key, "skipped")) return &x->skipped;
    return NULL;
}

static dtr_result parse_record(dtr__json *j, rec *x) {
    char key[64];
    dtr_result r;
    if ((r = dtr__json_validate(j)) != DTR_OK) return r;
    if ((r = dtr__json_expect(j, '{')) != DTR_OK) return r;
    if (dtr__json_accept(j, '}')) return DTR_OK;
    for (;;) {
        double *f;
        if ((r = dtr__json_string(j, key, sizeof key, NULL)) != DTR_OK) return r;
        if ((r = dtr__json_expect(j, ':')) != DTR_OK) return r;
        f = rec_field(x, key);
        if (f) r = json_num(j, f);
        else r = !strcmp(key, "time") && dtr__json_peek(j) == '{' ? parse_time(j, x) : dtr__json_skip(j);
        if (r != DTR_OK) return r;
        if (!dtr__json_accept(j, ',')) return dtr__json_expect(j, '}');
    }
}

static void rec_init(rec *x, size_t line) {
    int k;
    x->rank = 0;
    x->step = (double)line;
    x->loss = x->sps = x->tps = x->total = NAN;
    x->skipped = 0;
    for (k = 0; k < NTIME; k++) x->t[k] = NAN;
}

/* every record of rank `rank` in the file; 1 on error (said on stderr) */
static int load_metrics(const char *path, int rank, recs *out) {
    size_t n, pos = 0, line = 0;
    char *text = read_file(path, &n);
    if (!text) return 1;
    while (pos < n) {
        size_t end = pos;
        dtr__json j;
        rec x;
        while (end < n && text[end] != '\n') end++;
        line++;
        dtr__json_init(&j, text + pos, end - pos);
        rec_init(&x, line);
        if (dtr__json_peek(&j) != -1) {
            if (parse_record(&j, &x) != DTR_OK) {
                fprintf(stderr, "dtrain-plot: %s:%zu: not a metrics record: %s\n", path, line, j.msg);
                free(text);
                return 1;
            }
            if ((int)x.rank == rank && !(out->n == out->cap && !grow((void **)&out->r, &out->cap, sizeof(rec))))
                out->r[out->n++] = x;
        }
        pos = end + 1;
    }
    free(text);
    return 0;
}

/* ---- SVG helpers ---- */

#define W 900.0
#define PL 80.0     /* left margin of a panel (y labels) */
#define PR 150.0    /* right margin (legend) */
#define PT 34.0     /* top margin (title) */
#define PH 190.0    /* plot height */
#define PANEL 260.0 /* panel height, margins included */

typedef struct axes { double y0, xmin, xmax, ymin, ymax; } axes;

static double ax_x(const axes *a, double x) {
    return a->xmax > a->xmin ? PL + (x - a->xmin) / (a->xmax - a->xmin) * (W - PL - PR) : PL + (W - PL - PR) / 2;
}
static double ax_y(const axes *a, double y) {
    return a->ymax > a->ymin ? a->y0 + PT + PH - (y - a->ymin) / (a->ymax - a->ymin) * PH : a->y0 + PT + PH / 2;
}

static void xml_text(FILE *f, const char *s) {
    for (; *s; s++) {
        switch (*s) {
        case '&': fputs("&amp;", f); break;
        case '<': fputs("&lt;", f); break;
        case '>': fputs("&gt;", f); break;
        case '"': fputs("&quot;", f); break;
        default: if ((unsigned char)*s >= 0x20) fputc(*s, f); break;
        }
    }
}

/* the frame of a panel: box, title, the ends and middle of both axes */
static void frame(FILE *f, const axes *a, const char *title, const char *xlabel) {
    double x0 = PL, x1 = W - PR, yb = a->y0 + PT + PH;
    int k;
    fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" font-size=\"15\" font-weight=\"bold\">", PL, a->y0 + 22);
    xml_text(f, title);
    fprintf(f, "</text>\n<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"none\" stroke=\"#888\"/>\n", x0,
            a->y0 + PT, x1 - x0, PH);
    for (k = 0; k <= 2; k++) {
        double v = a->ymin + (a->ymax - a->ymin) * k / 2, y = ax_y(a, v), xv = a->xmin + (a->xmax - a->xmin) * k / 2;
        fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#ddd\"/>\n", x0, y, x1, y);
        fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" font-size=\"11\" text-anchor=\"end\">%.4g</text>\n", x0 - 6, y + 4, v);
        fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" font-size=\"11\" text-anchor=\"middle\">%.6g</text>\n", ax_x(a, xv), yb + 15, xv);
    }
    fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" font-size=\"11\" text-anchor=\"middle\">", (x0 + x1) / 2, yb + 30);
    xml_text(f, xlabel);
    fputs("</text>\n", f);
}

static void legend(FILE *f, const axes *a, int row, const char *color, const char *label) {
    double x = W - PR + 12, y = a->y0 + PT + 10 + 18 * row;
    fprintf(f, "<rect x=\"%.1f\" y=\"%.1f\" width=\"12\" height=\"12\" fill=\"%s\"/>", x, y, color);
    fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" font-size=\"12\">%s</text>\n", x + 18, y + 11, label);
}

/* ---- the metrics picture ---- */

/* value `which` of a record: 0 loss, 1 the rate, 2 + k the stacked time up to and with k,
 * TOTAL the step's whole time */
#define TOTAL 100
static double value(const rec *x, int which, int tokens) {
    double s = 0;
    int k;
    if (which == TOTAL) return x->total;
    if (which == 0) return x->loss;
    if (which == 1) return tokens ? x->tps : x->sps;
    for (k = 0; k <= which - 2; k++) s += isfinite(x->t[k]) ? x->t[k] : 0;
    return s;
}

static void fit(const recs *rs, int which, int tokens, axes *a) {
    size_t i;
    a->ymin = INFINITY;
    a->ymax = -INFINITY;
    for (i = 0; i < rs->n; i++) {
        double v = value(&rs->r[i], which, tokens);
        if (!isfinite(v)) continue;
        if (v < a->ymin) a->ymin = v;
        if (v > a->ymax) a->ymax = v;
    }
    if (!(a->ymin <= a->ymax)) a->ymin = 0, a->ymax = 1;
    if (which >= 1 && a->ymin > 0) a->ymin = 0;   /* rates and times from zero */
}

static void polyline(FILE *f, const recs *rs, const axes *a, int which, int tokens, const char *id, const char *color) {
    size_t i;
    fprintf(f, "<polyline id=\"%s\" fill=\"none\" stroke=\"%s\" stroke-width=\"1.5\"%s points=\"", id, color,
            which == TOTAL ? " stroke-dasharray=\"4 3\"" : "");
    for (i = 0; i < rs->n; i++) {
        double v = value(&rs->r[i], which, tokens);
        if (isfinite(v)) fprintf(f, "%.1f,%.1f ", ax_x(a, rs->r[i].step), ax_y(a, v));
    }
    fputs("\"/>\n", f);
}

/* marks the steps whose update was skipped ("skipped" is 1 on such a step) */
static void skipped_marks(FILE *f, const recs *rs, const axes *a) {
    size_t i;
    for (i = 0; i < rs->n; i++)
        if (rs->r[i].skipped > 0)
            fprintf(f, "<circle class=\"skipped\" cx=\"%.1f\" cy=\"%.1f\" r=\"4\" fill=\"#d62728\"/>\n", ax_x(a, rs->r[i].step),
                    a->y0 + PT + PH - 6);
}

static int has_time(const recs *rs, int k) {
    size_t i;
    for (i = 0; i < rs->n; i++)
        if (isfinite(rs->r[i].t[k])) return 1;
    return 0;
}

/* one stacked layer: its top left to right, the layer below right to left */
static void layer(FILE *f, const recs *rs, const axes *a, int k) {
    size_t i;
    fprintf(f, "<polygon id=\"time-%s\" fill=\"%s\" fill-opacity=\"0.85\" points=\"", time_keys[k], time_colors[k]);
    for (i = 0; i < rs->n; i++) fprintf(f, "%.1f,%.1f ", ax_x(a, rs->r[i].step), ax_y(a, value(&rs->r[i], 2 + k, 0)));
    for (i = rs->n; i-- > 0;) fprintf(f, "%.1f,%.1f ", ax_x(a, rs->r[i].step), ax_y(a, k ? value(&rs->r[i], 1 + k, 0) : 0));
    fputs("\"/>\n", f);
}

static void time_panel(FILE *f, const recs *rs, axes *a) {
    int k, row = 0;
    axes b;
    fit(rs, 2 + NTIME - 1, 0, a);
    fit(rs, TOTAL, 0, &b);
    if (b.ymax > a->ymax) a->ymax = b.ymax;
    frame(f, a, "Time per step (s)", "step");
    for (k = 0; k < NTIME; k++) {
        if (!has_time(rs, k)) continue;
        layer(f, rs, a, k);
        legend(f, a, row++, time_colors[k], time_keys[k]);
    }
    polyline(f, rs, a, TOTAL, 0, "time-step", "#000");
    legend(f, a, row, "#000", "whole step");
}

static int rate_is_tokens(const recs *rs) {
    size_t i;
    for (i = 0; i < rs->n; i++)
        if (rs->r[i].sps > 0) return 0;
    for (i = 0; i < rs->n; i++)
        if (rs->r[i].tps > 0) return 1;
    return 0;
}

static void write_metrics_svg(FILE *f, const recs *rs, int rank) {
    axes a;
    char title[64];
    int tokens = rate_is_tokens(rs);
    size_t i;
    a.xmin = INFINITY;
    a.xmax = -INFINITY;
    for (i = 0; i < rs->n; i++) {
        if (rs->r[i].step < a.xmin) a.xmin = rs->r[i].step;
        if (rs->r[i].step > a.xmax) a.xmax = rs->r[i].step;
    }
    if (!(a.xmin <= a.xmax)) a.xmin = 0, a.xmax = 1;
    fprintf(f, "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" "
               "height=\"%.0f\" font-family=\"sans-serif\">\n<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n",
            W, 3 * PANEL);
    a.y0 = 0;
    fit(rs, 0, tokens, &a);
    snprintf(title, sizeof title, "Loss (rank %d, %zu records)", rank, rs->n);
    frame(f, &a, title, "step");
    polyline(f, rs, &a, 0, tokens, "loss", "#1f77b4");
    skipped_marks(f, rs, &a);
    legend(f, &a, 0, "#1f77b4", "loss");
    legend(f, &a, 1, "#d62728", "skipped step");
    a.y0 = PANEL;
    fit(rs, 1, tokens, &a);
    frame(f, &a, tokens ? "Throughput (tokens/s)" : "Throughput (samples/s)", "step");
    polyline(f, rs, &a, 1, tokens, "throughput", "#2ca02c");
    a.y0 = 2 * PANEL;
    time_panel(f, rs, &a);
    fputs("</svg>\n", f);
}

/* ---- the trace picture ---- */

typedef struct span { int lane, depth; double s, e; char name[64]; } span;
typedef struct lane { double pid, tid; int depth; double y; char label[80]; } lane;
typedef struct trace {
    span *sp;
    size_t n, cap;
    lane *ln;
    size_t nl, lcap;
    double from_ms, to_ms;   /* the window drawn, from the first span's start (to <= 0: all) */
} trace;

typedef struct event { char name[64], ph[8], arg[48]; double ts, dur, pid, tid; } event;

/* an id for labels (pids and tids are small integers; anything else shows as -1) */
static long id_of(double v) { return fabs(v) < 1e9 ? (long)v : -1; }

static int lane_of(trace *t, double pid, double tid) {
    size_t i;
    for (i = 0; i < t->nl; i++)
        if (t->ln[i].pid == pid && t->ln[i].tid == tid) return (int)i;
    if (t->nl == t->lcap && !grow((void **)&t->ln, &t->lcap, sizeof(lane))) return -1;
    t->ln[t->nl].pid = pid;
    t->ln[t->nl].tid = tid;
    t->ln[t->nl].depth = -1;   /* no span yet: not drawn */
    snprintf(t->ln[t->nl].label, sizeof t->ln[t->nl].label, "rank %ld / tid %ld", id_of(pid), id_of(tid));
    return (int)t->nl++;
}

/* a string field (cut to cap) or a number (pid and tid may be either: a string counts as 0) */
static dtr_result event_field(dtr__json *j, const char *key, event *ev) {
    double *num = !strcmp(key, "ts") ? &ev->ts : !strcmp(key, "dur") ? &ev->dur : !strcmp(key, "pid") ? &ev->pid
                : !strcmp(key, "tid") ? &ev->tid : NULL;
    char *str = !strcmp(key, "name") ? ev->name : !strcmp(key, "ph") ? ev->ph : NULL;
    size_t cap = str == ev->name ? sizeof ev->name : sizeof ev->ph;
    if (str && dtr__json_peek(j) == '"') {
        size_t len = 0;
        dtr_result r = dtr__json_string(j, str, cap - 1, &len);
        str[len < cap - 1 ? len : cap - 1] = 0;
        return r;
    }
    if (num && dtr__json_peek(j) != '"') return json_num(j, num);
    return dtr__json_skip(j);
}

/* "args" of a metadata event: its "name" into ev->arg */
static dtr_result event_args(dtr__json *j, event *ev) {
    char key[32];
    dtr_result r;
    if (dtr__json_peek(j) != '{') return dtr__json_skip(j);
    j->pos++;
    if (dtr__json_accept(j, '}')) return DTR_OK;
    for (;;) {
        if ((r = dtr__json_string(j, key, sizeof key, NULL)) != DTR_OK) return r;
        if ((r = dtr__json_expect(j, ':')) != DTR_OK) return r;
        if (!strcmp(key, "name") && dtr__json_peek(j) == '"') {
            size_t len = 0;
            r = dtr__json_string(j, ev->arg, sizeof ev->arg - 1, &len);
            ev->arg[len < sizeof ev->arg - 1 ? len : sizeof ev->arg - 1] = 0;
        } else {
            r = dtr__json_skip(j);
        }
        if (r != DTR_OK) return r;
        if (!dtr__json_accept(j, ',')) return dtr__json_expect(j, '}');
    }
}

static dtr_result parse_event(dtr__json *j, event *ev) {
    char key[32];
    dtr_result r;
    memset(ev, 0, sizeof *ev);
    ev->ts = ev->dur = NAN;
    if (dtr__json_peek(j) != '{') return dtr__json_fail(j, "a trace event must be an object");
    j->pos++;
    if (dtr__json_accept(j, '}')) return DTR_OK;
    for (;;) {
        if ((r = dtr__json_string(j, key, sizeof key, NULL)) != DTR_OK) return r;
        if ((r = dtr__json_expect(j, ':')) != DTR_OK) return r;
        if ((r = strcmp(key, "args") ? event_field(j, key, ev) : event_args(j, ev)) != DTR_OK) return r;
        if (!dtr__json_accept(j, ',')) return dtr__json_expect(j, '}');
    }
}

static span *span_new(trace *t, int lane, const event *ev) {
    span *s;
    if (t->n == t->cap && !grow((void **)&t->sp, &t->cap, sizeof(span))) return NULL;
    s = &t->sp[t->n++];
    s->lane = lane;
    s->depth = 0;
    s->s = ev->ts;
    s->e = ev->ph[0] == 'X' ? ev->ts + (isfinite(ev->dur) ? ev->dur : 0) : NAN;
    memcpy(s->name, ev->name, sizeof s->name);
    return s;
}

/* an "E" closes the latest open "B" of its lane */
static void span_close(trace *t, int lane, double ts) {
    size_t i;
    for (i = t->n; i-- > 0;)
        if (t->sp[i].lane == lane && isnan(t->sp[i].e)) { t->sp[i].e = ts; return; }
}

/* "thread_name" metadata names its lane ("rank 0 / compute" with the rank from its pid) */
static dtr_result add_meta(dtr__json *j, trace *t, const event *ev) {
    int lane;
    if (strcmp(ev->name, "thread_name") != 0 || !ev->arg[0]) return DTR_OK;
    if ((lane = lane_of(t, ev->pid, ev->tid)) < 0) return dtr__json_fail(j, "out of memory");
    snprintf(t->ln[lane].label, sizeof t->ln[lane].label, "rank %ld / %s", id_of(ev->pid), ev->arg);
    return DTR_OK;
}

static dtr_result add_event(dtr__json *j, trace *t, const event *ev) {
    int lane;
    char c = ev->ph[0];
    if (c == 'M' && !ev->ph[1]) return add_meta(j, t, ev);
    if ((c != 'X' && c != 'B' && c != 'E') || ev->ph[1]) return DTR_OK;   /* counters, metadata, instants */
    if (!isfinite(ev->ts)) return dtr__json_fail(j, "a span event without a numeric \"ts\"");
    if ((lane = lane_of(t, ev->pid, ev->tid)) < 0) return dtr__json_fail(j, "out of memory");
    if (c == 'E') span_close(t, lane, ev->ts);
    else if (!span_new(t, lane, ev)) return dtr__json_fail(j, "out of memory");
    return DTR_OK;
}

static dtr_result parse_events(dtr__json *j, trace *t) {
    dtr_result r;
    if ((r = dtr__json_expect(j, '[')) != DTR_OK) return r;
    if (dtr__json_accept(j, ']')) return DTR_OK;
    for (;;) {
        event ev;
        if ((r = parse_event(j, &ev)) != DTR_OK || (r = add_event(j, t, &ev)) != DTR_OK) return r;
        if (!dtr__json_accept(j, ',')) return dtr__json_expect(j, ']');
    }
}

/* {"traceEvents":[...], ...} or [...] */
static dtr_result parse_trace(dtr__json *j, trace *t) {
    char key[32];
    dtr_result r;
    int found = 0;
    if ((r = dtr__json_validate(j)) != DTR_OK) return r;
    if (dtr__json_peek(j) == '[') return parse_events(j, t);
    if ((r = dtr__json_expect(j, '{')) != DTR_OK) return r;
    while (!dtr__json_accept(j, '}')) {
        if ((r = dtr__json_string(j, key, sizeof key, NULL)) != DTR_OK) return r;
        if ((r = dtr__json_expect(j, ':')) != DTR_OK) return r;
        if (!strcmp(key, "traceEvents")) found = 1;
        if ((r = found == 1 ? parse_events(j, t) : dtr__json_skip(j)) != DTR_OK) return r;
        if (found == 1) found = 2;
        dtr__json_accept(j, ',');
    }
    return found ? DTR_OK : dtr__json_fail(j, "no \"traceEvents\" array");
}

static int load_trace(const char *path, trace *t) {
    size_t n;
    char *text = read_file(path, &n);
    dtr__json j;
    if (!text) return 1;
    dtr__json_init(&j, text, n);
    if (parse_trace(&j, t) != DTR_OK) {
        fprintf(stderr, "dtrain-plot: %s: not a Chrome trace: %s\n", path, j.msg);
        free(text);
        return 1;
    }
    free(text);
    return 0;
}

/* keeps the spans that overlap [t0 + from, t0 + to] (to > 0), cut to it */
static void window(trace *t, double *t0, double *t1) {
    double lo = *t0 + t->from_ms * 1000.0, hi = *t0 + t->to_ms * 1000.0;
    size_t i, k = 0;
    if (!(t->to_ms > 0)) return;
    for (i = 0; i < t->n; i++) {
        span s = t->sp[i];
        if (s.e < lo || s.s > hi) continue;
        s.s = s.s < lo ? lo : s.s;
        s.e = s.e > hi ? hi : s.e;
        t->sp[k++] = s;
    }
    t->n = k;
    *t0 = lo;
    *t1 = hi;
}

static int span_cmp(const void *a, const void *b) {
    const span *x = (const span *)a, *y = (const span *)b;
    if (x->lane != y->lane) return x->lane < y->lane ? -1 : 1;
    if (x->s != y->s) return x->s < y->s ? -1 : 1;
    return x->e > y->e ? -1 : x->e < y->e ? 1 : 0;
}

/* closes open spans at the end, sorts, and gives each span its nesting depth in its lane */
static void layout(trace *t, double *t0, double *t1) {
    double stack[64];
    size_t i;
    int sp = 0, lane = -1;
    *t0 = INFINITY;
    *t1 = -INFINITY;
    for (i = 0; i < t->n; i++) {
        if (t->sp[i].s < *t0) *t0 = t->sp[i].s;
        if (isfinite(t->sp[i].e) && t->sp[i].e > *t1) *t1 = t->sp[i].e;
        if (t->sp[i].s > *t1) *t1 = t->sp[i].s;
    }
    for (i = 0; i < t->n; i++)
        if (isnan(t->sp[i].e)) t->sp[i].e = *t1;
    window(t, t0, t1);
    qsort(t->sp, t->n, sizeof(span), span_cmp);
    for (i = 0; i < t->n; i++) {
        span *s = &t->sp[i];
        if (s->lane != lane) sp = 0, lane = s->lane;
        while (sp > 0 && stack[sp - 1] <= s->s) sp--;
        s->depth = sp;
        if (sp < 64) stack[sp++] = s->e;
        if (s->depth > t->ln[lane].depth) t->ln[lane].depth = s->depth;
    }
}

static const char *span_color(const char *name) {
    static const char *const pal[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
                                      "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"};
    unsigned h = 2166136261u;
    for (; *name; name++) h = (h ^ (unsigned char)*name) * 16777619u;
    return pal[h % 10];
}

#define ROW 18.0
#define TL 130.0   /* lane labels */

static void write_span(FILE *f, const trace *t, const span *s, double t0, double scale) {
    double x = TL + (s->s - t0) * scale, w = (s->e - s->s) * scale, y = t->ln[s->lane].y + s->depth * ROW;
    fprintf(f, "<rect class=\"span\" x=\"%.2f\" y=\"%.1f\" width=\"%.2f\" height=\"%.1f\" fill=\"%s\"><title>", x, y,
            w > 0.5 ? w : 0.5, ROW - 2, span_color(s->name));
    xml_text(f, s->name);
    fprintf(f, " (%.3f ms)</title></rect>\n", (s->e - s->s) / 1000.0);
    if (w > 40) {
        char label[64];
        size_t fit = (size_t)(w / 7);
        snprintf(label, sizeof label, "%s", s->name);
        if (fit < strlen(label)) label[fit] = 0;
        fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" font-size=\"11\" fill=\"white\">", x + 3, y + 12);
        xml_text(f, label);
        fputs("</text>\n", f);
    }
}

static void write_trace_svg(FILE *f, trace *t) {
    double t0, t1, y = 40, scale;
    size_t i;
    int k;
    layout(t, &t0, &t1);
    for (i = 0; i < t->nl; i++) {
        t->ln[i].y = y;
        if (t->ln[i].depth >= 0) y += (t->ln[i].depth + 1) * ROW + 8;
    }
    scale = t1 > t0 ? (W - TL - 20) / (t1 - t0) : 1;
    fprintf(f, "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" "
               "height=\"%.0f\" font-family=\"sans-serif\">\n<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n",
            W, y + 10);
    for (k = 0; k <= 4; k++) {
        double x = TL + (W - TL - 20) * k / 4;
        fprintf(f, "<line x1=\"%.1f\" y1=\"28\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#ddd\"/>", x, x, y);
        fprintf(f, "<text x=\"%.1f\" y=\"22\" font-size=\"11\" text-anchor=\"middle\">%.3f ms</text>\n", x,
                t->from_ms + (t1 - t0) * k / 4 / 1000.0);
    }
    for (i = 0; i < t->nl; i++) {
        if (t->ln[i].depth < 0) continue;
        fprintf(f, "<text class=\"lane\" x=\"6\" y=\"%.1f\" font-size=\"12\">", t->ln[i].y + 12);
        xml_text(f, t->ln[i].label);
        fputs("</text>\n", f);
    }
    for (i = 0; i < t->n; i++) write_span(f, t, &t->sp[i], t0, scale);
    fputs("</svg>\n", f);
}

/* ---- main ---- */

static int usage(void) {
    fprintf(stderr, "usage: dtrain-plot [--rank R] [-o out.svg] metrics.jsonl\n"
                    "       dtrain-plot --trace [--from MS --to MS] [-o out.svg] trace.json [trace.json ...]\n");
    return 1;
}

/* opens `out` (NULL: stdout), runs write, closes; 1 on an error of the output */
static int emit(const char *out, void (*write)(FILE *, void *), void *arg) {
    FILE *f = out ? fopen(out, "w") : stdout;
    int bad;
    if (!f) { fprintf(stderr, "dtrain-plot: cannot write %s\n", out); return 1; }
    write(f, arg);
    bad = ferror(f) != 0;
    if (out && fclose(f) != 0) bad = 1;
    if (bad) fprintf(stderr, "dtrain-plot: error writing %s\n", out ? out : "stdout");
    return bad;
}

typedef struct metrics_job { recs rs; int rank; } metrics_job;
static void emit_metrics(FILE *f, void *arg) { write_metrics_svg(f, &((metrics_job *)arg)->rs, ((metrics_job *)arg)->rank); }
static void emit_trace(FILE *f, void *arg) { write_trace_svg(f, (trace *)arg); }

static int run_metrics(const char *path, int rank, const char *out) {
    metrics_job m;
    int rc;
    memset(&m, 0, sizeof m);
    m.rank = rank;
    if (load_metrics(path, rank, &m.rs)) { free(m.rs.r); return 1; }
    if (m.rs.n == 0) {
        fprintf(stderr, "dtrain-plot: %s: no records of rank %d\n", path, rank);
        free(m.rs.r);
        return 1;
    }
    rc = emit(out, emit_metrics, &m);
    free(m.rs.r);
    return rc;
}

static int run_trace(char **paths, int n, const char *out, double from_ms, double to_ms) {
    trace t;
    int i, rc = 0;
    memset(&t, 0, sizeof t);
    t.from_ms = from_ms;
    t.to_ms = to_ms;
    for (i = 0; i < n && !rc; i++) rc = load_trace(paths[i], &t);
    if (!rc && t.n == 0) { fprintf(stderr, "dtrain-plot: no spans (\"X\" events or \"B\"/\"E\" pairs) found\n"); rc = 1; }
    if (!rc && !(to_ms > from_ms || to_ms <= 0)) { fprintf(stderr, "dtrain-plot: --to must be after --from\n"); rc = 1; }
    if (!rc) rc = emit(out, emit_trace, &t);
    free(t.sp);
    free(t.ln);
    return rc;
}

int main(int argc, char **argv) {
    const char *out = NULL;
    char *files[256];
    int i, nf = 0, trace_mode = 0, rank = 0;
    double from_ms = 0, to_ms = 0;
    for (i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--trace")) trace_mode = 1;
        else if (!strcmp(argv[i], "-o") && i + 1 < argc) out = argv[++i];
        else if (!strcmp(argv[i], "--rank") && i + 1 < argc) rank = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--from") && i + 1 < argc) from_ms = atof(argv[++i]);
        else if (!strcmp(argv[i], "--to") && i + 1 < argc) to_ms = atof(argv[++i]);
        else if (argv[i][0] == '-' || nf == 256) return usage();
        else files[nf++] = argv[i];
    }
    if (nf == 0 || (!trace_mode && nf != 1)) return usage();
    return trace_mode ? run_trace(files, nf, out, from_ms, to_ms) : run_metrics(files[0], rank, out);
}
