/* ============================================================================
 * CSV datasets: a whole file (or buffer) parsed into an in-memory dataset.
 *
 * Grammar (RFC 4180 with the usual leniencies): records end with LF or CRLF; fields are
 * separated by the delimiter; a field may be quoted ("..." with "" for a quote inside, and
 * may then span lines); spaces and tabs around a field are dropped (unless the delimiter is
 * a tab: then only spaces); empty and blank records are skipped; a UTF-8 BOM is skipped.
 * Numbers are parsed here, not by strtod, so the C locale of the application (a decimal
 * comma) cannot change them: [+-]digits[.digits][(e|E)[+-]digits]. Every error names
 * "file:line:column" (column = the 1-based field number) and the column's header name.
 * ==========================================================================*/
#include "../public/api.h"
#include "../public/api_data.h"
#include "../core/internal.h"
#include "data_internal.h"
#include <math.h>

/* ---- fields ---- */

typedef struct dtr__csv_field {
    const char *p;      /* content (inside the quotes) */
    size_t n;
    int quoted;
    int escaped;        /* contains "" */
} dtr__csv_field;

typedef struct dtr__csv {
    const char *name;                 /* for messages */
    const char *s, *end;              /* the text */
    const char *cur;
    int64_t line;                     /* line of `cur` (1-based) */
    char delim;
    dtr__csv_field *f;                /* fields of the current record */
    int nf, capf;
    int64_t rec_line;                 /* first line of the current record */
    const dtr_allocation_callbacks *alloc;
    char *err;
    size_t errlen;
} dtr__csv;

static int dtr__csv_space(const dtr__csv *c, char ch) {
    return ch == ' ' || (ch == '\t' && c->delim != '\t');
}

/* Reads the next record into c->f. Returns 1 with a record, 0 at the end, or a negative
 * dtr_result. Blank records (one empty unquoted field) are skipped. */
static int dtr__csv_record(dtr__csv *c) {
    for (;;) {
        const char *p = c->cur;
        if (p >= c->end) return 0;
        c->nf = 0;
        c->rec_line = c->line;
        for (;;) {
            dtr__csv_field fld;
            while (p < c->end && dtr__csv_space(c, *p)) p++;
            memset(&fld, 0, sizeof fld);
            if (p < c->end && *p == '"') {
                int64_t qline = c->line;
                fld.quoted = 1;
                fld.p = ++p;
                for (;;) {
                    if (p >= c->end)
                        return dtr__errf(c->err, c->errlen, DTR_CORRUPT_FILE, "%s:%lld:%d: unterminated quoted field",
                                         c->name, (long long)qline, c->nf + 1);
                    if (*p == '"') {
                        if (p + 1 < c->end && p[1] == '"') {
                            fld.escaped = 1;
                            p += 2;
                            continue;
                        }
                        break;
                    }
                    if (*p == '\n') c->line++;
                    p++;
                }
                fld.n = (size_t)(p - fld.p);
                p++;   /* closing quote */
                while (p < c->end && dtr__csv_space(c, *p)) p++;
                if (p < c->end && *p != c->delim && *p != '\n' && !(*p == '\r' && (p + 1 == c->end || p[1] == '\n')))
                    return dtr__errf(c->err, c->errlen, DTR_CORRUPT_FILE,
                                     "%s:%lld:%d: unexpected character after a closing quote", c->name,
                                     (long long)c->line, c->nf + 1);
            } else {
                const char *q;
                fld.p = p;
                while (p < c->end && *p != c->delim && *p != '\n') p++;
                q = p;
                if (q > fld.p && q[-1] == '\r' && (q == c->end || *q == '\n')) q--;
                while (q > fld.p && dtr__csv_space(c, q[-1])) q--;
                fld.n = (size_t)(q - fld.p);
            }
            if (c->nf == c->capf) {
                int cap = c->capf ? c->capf * 2 : 16;
                dtr__csv_field *nfp;
                if (cap > (1 << 24))
                    return dtr__errf(c->err, c->errlen, DTR_CORRUPT_FILE, "%s:%lld: more than %d fields in a record",
                                     c->name, (long long)c->rec_line, 1 << 24);
                nfp = (dtr__csv_field *)dtr__realloc(c->alloc, c->f, (size_t)cap * sizeof *nfp);
                if (!nfp) return dtr__errf(c->err, c->errlen, DTR_OUT_OF_MEMORY, "%s: out of memory", c->name);
                c->f = nfp;
                c->capf = cap;
            }
            c->f[c->nf++] = fld;
            if (p < c->end && *p == c->delim) {
                p++;
                continue;
            }
            if (p < c->end && *p == '\r') p++;
            if (p < c->end && *p == '\n') {
                p++;
                c->line++;
            }
            break;
        }
        c->cur = p;
        if (c->nf == 1 && !c->f[0].quoted && c->f[0].n == 0) continue;   /* blank line */
        return 1;
    }
}

/* The content of a field with "" turned into ", as a NUL-terminated copy (NULL on OOM). */
static char *dtr__csv_text(const dtr_allocation_callbacks *a, const dtr__csv_field *f) {
    char *s = (char *)dtr__malloc(a, f->n + 1);
    size_t i, k = 0;
    if (!s) return NULL;
    for (i = 0; i < f->n; i++) {
        s[k++] = f->p[i];
        if (f->escaped && f->p[i] == '"' && i + 1 < f->n && f->p[i + 1] == '"') i++;
    }
    s[k] = '\0';
    return s;
}

/* ---- numbers ---- */

static int dtr__ieq(const char *p, size_t n, const char *word) {
    size_t i;
    for (i = 0; i < n; i++) {
        char a = p[i], b = word[i];
        if (!b) return 0;
        if (a >= 'A' && a <= 'Z') a = (char)(a - 'A' + 'a');
        if (a != b) return 0;
    }
    return word[n] == '\0';
}

/* 1 when the field is a missing value: empty, NA, N/A, NaN, null, none or ?. */
static int dtr__csv_missing(const dtr__csv_field *f) {
    return f->n == 0 || dtr__ieq(f->p, f->n, "na") || dtr__ieq(f->p, f->n, "n/a") || dtr__ieq(f->p, f->n, "nan") ||
           dtr__ieq(f->p, f->n, "null") || dtr__ieq(f->p, f->n, "none") || dtr__ieq(f->p, f->n, "?");
}

/* Parses the whole of p[0..n) as a finite decimal number. Returns 1 on success. Up to 19
 * significant digits are kept exactly; the power of ten is applied in double, which is
 * far more precise than the f32 the values become. */
static int dtr__parse_number(const char *p, size_t n, double *out) {
    static const double pow10[] = {1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10, 1e11,
                                   1e12, 1e13, 1e14, 1e15, 1e16, 1e17, 1e18, 1e19, 1e20, 1e21, 1e22};
    size_t i = 0;
    int neg = 0, digits = 0, sig = 0;
    uint64_t m = 0;
    long e10 = 0;
    double v;
    if (i < n && (p[i] == '+' || p[i] == '-')) neg = p[i++] == '-';
    for (; i < n && p[i] >= '0' && p[i] <= '9'; i++, digits++) {
        if (sig < 19) {
            if (m || p[i] != '0') sig++;
            m = m * 10 + (uint64_t)(p[i] - '0');
        } else {
            e10++;
        }
    }
    if (i < n && p[i] == '.') {
        for (i++; i < n && p[i] >= '0' && p[i] <= '9'; i++, digits++) {
            if (sig < 19) {
                if (m || p[i] != '0') sig++;
                m = m * 10 + (uint64_t)(p[i] - '0');
                e10--;
            }
        }
    }
    if (!digits) return 0;
    if (i < n && (p[i] == 'e' || p[i] == 'E')) {
        int eneg = 0, ed = 0;
        long ev = 0;
        i++;
        if (i < n && (p[i] == '+' || p[i] == '-')) eneg = p[i++] == '-';
        for (; i < n && p[i] >= '0' && p[i] <= '9'; i++, ed++)
            if (ev < 100000) ev = ev * 10 + (p[i] - '0');
        if (!ed) return 0;
        e10 += eneg ? -ev : ev;
    }
    if (i != n) return 0;
    v = (double)m;
    if (m == 0) {
        v = 0.0;
    } else if (e10 > 0) {
        while (e10 > 22 && v < 1e300) { v *= 1e22; e10 -= 22; }
        v = e10 > 22 ? HUGE_VAL : v * pow10[e10];
    } else if (e10 < 0) {
        while (e10 < -22 && v > 1e-300) { v /= 1e22; e10 += 22; }
        v = e10 < -22 ? 0.0 : v / pow10[-e10];
    }
    if (!(v <= 3.4028234663852886e38)) return 0;   /* passes f32 (or inf) */
    *out = neg ? -v : v;
    return 1;
}

/* ---- the dataset ---- */

dtr_csv_config dtr_csv_config_init(void) {
    dtr_csv_config c;
    memset(&c, 0, sizeof c);
    c.label_column = -1;
    return c;
}

/* One data record's label: its number, or where its text is. */
typedef struct dtr__csv_label {
    double v;
    int numeric;
    dtr__csv_field f;
    int64_t line;
} dtr__csv_label;

typedef struct dtr__csv_parse {
    char **names;          /* ncols column names */
    int ncols;
    unsigned char *role;   /* per column: 0 feature, 1 label, 2 ignored */
    float *x;
    int64_t xcap, rows;
    dtr__csv_label *lab;
    int64_t labcap;
} dtr__csv_parse;

static void dtr__csv_parse_free(const dtr_allocation_callbacks *a, dtr__csv_parse *P) {
    int i;
    if (P->names) {
        for (i = 0; i < P->ncols; i++) dtr__free(a, P->names[i]);
        dtr__free(a, P->names);
    }
    dtr__free(a, P->role);
    dtr__free(a, P->x);
    dtr__free(a, P->lab);
}

/* Column roles from the configuration and the header. */
static dtr_result dtr__csv_roles(dtr__csv *c, const dtr_csv_config *cfg, dtr__csv_parse *P, int has_header) {
    int j, label = -1;
    P->role = (unsigned char *)dtr__calloc(c->alloc, (size_t)P->ncols);
    if (!P->role) return dtr__errf(c->err, c->errlen, DTR_OUT_OF_MEMORY, "%s: out of memory", c->name);
    if (cfg->label_kind != DTR_LABEL_NONE) {
        if (cfg->label_name) {
            if (!has_header)
                return dtr__errf(c->err, c->errlen, DTR_NOT_FOUND, "%s: label_name \"%s\" given but the file has no header",
                                 c->name, cfg->label_name);
            for (j = 0; j < P->ncols && label < 0; j++)
                if (strcmp(P->names[j], cfg->label_name) == 0) label = j;
            if (label < 0)
                return dtr__errf(c->err, c->errlen, DTR_NOT_FOUND, "%s: no column named \"%s\" in the header", c->name,
                                 cfg->label_name);
        } else {
            label = cfg->label_column < 0 ? P->ncols + cfg->label_column : cfg->label_column;
            if (label < 0 || label >= P->ncols)
                return dtr__errf(c->err, c->errlen, DTR_INVALID_ARGUMENT, "%s: label_column %d is outside the %d columns",
                                 c->name, cfg->label_column, P->ncols);
        }
        P->role[label] = 1;
    }
    if (cfg->ignore && cfg->ignore[0]) {
        const char *s = cfg->ignore;
        if (!has_header)
            return dtr__errf(c->err, c->errlen, DTR_NOT_FOUND, "%s: ignore \"%s\" given but the file has no header", c->name,
                             cfg->ignore);
        while (*s) {
            const char *e = strchr(s, ',');
            size_t n = e ? (size_t)(e - s) : strlen(s);
            int found = 0;
            for (j = 0; j < P->ncols; j++) {
                if (strlen(P->names[j]) == n && memcmp(P->names[j], s, n) == 0) {
                    if (P->role[j] == 0) P->role[j] = 2;
                    found = 1;
                }
            }
            if (!found && n)
                return dtr__errf(c->err, c->errlen, DTR_NOT_FOUND, "%s: ignored column \"%.*s\" is not in the header",
                                 c->name, (int)n, s);
            s += n;
            if (*s == ',') s++;
        }
    }
    return DTR_OK;
}

/* Parses every data record into P (features as f32, labels kept for later). */
static dtr_result dtr__csv_rows(dtr__csv *c, const dtr_csv_config *cfg, dtr__csv_parse *P, int first_is_data,
                                int64_t nfeat) {
    int rc, j;
    for (;;) {
        int64_t k;
        if (first_is_data) {
            first_is_data = 0;   /* the record already in c->f */
        } else {
            rc = dtr__csv_record(c);
            if (rc < 0) return (dtr_result)rc;
            if (rc == 0) break;
        }
        if (c->nf != P->ncols)
            return dtr__errf(c->err, c->errlen, DTR_CORRUPT_FILE, "%s:%lld: %d fields, expected %d", c->name,
                             (long long)c->rec_line, c->nf, P->ncols);
        if (P->rows == P->xcap) {
            int64_t cap = P->xcap ? P->xcap * 2 : 256;
            float *nx;
            dtr__csv_label *nl;
            if ((uint64_t)cap > (uint64_t)((size_t)-1 / 8) / (uint64_t)(nfeat + 8))
                return dtr__errf(c->err, c->errlen, DTR_OUT_OF_MEMORY, "%s: too many records", c->name);
            nx = (float *)dtr__realloc(c->alloc, P->x, (size_t)(cap * (nfeat ? nfeat : 1)) * sizeof(float));
            if (!nx) return dtr__errf(c->err, c->errlen, DTR_OUT_OF_MEMORY, "%s: out of memory after %lld records", c->name,
                                      (long long)P->rows);
            P->x = nx;
            nl = (dtr__csv_label *)dtr__realloc(c->alloc, P->lab, (size_t)cap * sizeof *nl);
            if (!nl) return dtr__errf(c->err, c->errlen, DTR_OUT_OF_MEMORY, "%s: out of memory after %lld records", c->name,
                                      (long long)P->rows);
            P->lab = nl;
            P->xcap = cap;
        }
        k = 0;
        for (j = 0; j < P->ncols; j++) {
            const dtr__csv_field *f = &c->f[j];
            double v = 0.0;
            int num;
            if (P->role[j] == 2) continue;
            if (dtr__csv_missing(f))
                return dtr__errf(c->err, c->errlen, DTR_CORRUPT_FILE, "%s:%lld:%d: missing value (column \"%s\")", c->name,
                                 (long long)c->rec_line, j + 1, P->names[j]);
            num = dtr__parse_number(f->p, f->n, &v);
            if (P->role[j] == 1) {
                dtr__csv_label *L = &P->lab[P->rows];
                if (!num && cfg->label_kind == DTR_LABEL_REGRESSION)
                    return dtr__errf(c->err, c->errlen, DTR_CORRUPT_FILE, "%s:%lld:%d: \"%.*s\" is not a number (label column \"%s\")",
                                     c->name, (long long)c->rec_line, j + 1, (int)(f->n > 40 ? 40 : f->n), f->p, P->names[j]);
                L->v = v;
                L->numeric = num;
                L->f = *f;
                L->line = c->rec_line;
                continue;
            }
            if (!num)
                return dtr__errf(c->err, c->errlen, DTR_CORRUPT_FILE, "%s:%lld:%d: \"%.*s\" is not a number (column \"%s\")",
                                 c->name, (long long)c->rec_line, j + 1, (int)(f->n > 40 ? 40 : f->n), f->p, P->names[j]);
            P->x[P->rows * nfeat + k++] = (float)v;
        }
        P->rows++;
    }
    return DTR_OK;
}

/* Turns the collected labels into an i32 or f32 array (and class names for text classes). */
static dtr_result dtr__csv_labels(dtr__csv *c, const dtr_csv_config *cfg, dtr__csv_parse *P, int label_col,
                                  void **y_out, char ***names_out, int *nclasses) {
    int64_t i, text = 0;
    *y_out = NULL;
    *names_out = NULL;
    *nclasses = 0;
    if (cfg->label_kind == DTR_LABEL_NONE) return DTR_OK;
    if (cfg->label_kind == DTR_LABEL_REGRESSION) {
        float *y = (float *)dtr__malloc(c->alloc, (size_t)P->rows * sizeof(float));
        if (!y) return dtr__errf(c->err, c->errlen, DTR_OUT_OF_MEMORY, "%s: out of memory", c->name);
        for (i = 0; i < P->rows; i++) y[i] = (float)P->lab[i].v;
        *y_out = y;
        return DTR_OK;
    }
    for (i = 0; i < P->rows; i++) text += !P->lab[i].numeric;
    if (!text) {   /* integer class indices */
        int32_t *y = (int32_t *)dtr__malloc(c->alloc, (size_t)P->rows * sizeof(int32_t));
        int32_t mx = -1;
        if (!y) return dtr__errf(c->err, c->errlen, DTR_OUT_OF_MEMORY, "%s: out of memory", c->name);
        for (i = 0; i < P->rows; i++) {
            double v = P->lab[i].v;
            if (!(v >= 0.0 && v < 2147483647.0 && v == floor(v))) {
                dtr__free(c->alloc, y);
                return dtr__errf(c->err, c->errlen, DTR_CORRUPT_FILE,
                                 "%s:%lld:%d: class label \"%.*s\" is not an integer >= 0 (column \"%s\")", c->name,
                                 (long long)P->lab[i].line, label_col + 1, (int)(P->lab[i].f.n > 40 ? 40 : P->lab[i].f.n),
                                 P->lab[i].f.p, P->names[label_col]);
            }
            y[i] = (int32_t)v;
            if (y[i] > mx) mx = y[i];
        }
        *y_out = y;
        *nclasses = mx + 1;
        return DTR_OK;
    } else {   /* text classes: sorted unique names */
        size_t total = 0, *off;
        char *buf;
        int64_t *ord, *tmp, k = 0;
        int32_t *y;
        char **names = NULL;
        dtr_result r = DTR_OK;
        for (i = 0; i < P->rows; i++) total += P->lab[i].f.n + 1;
        buf = (char *)dtr__malloc(c->alloc, total + 1);
        off = (size_t *)dtr__malloc(c->alloc, (size_t)P->rows * sizeof(size_t));
        ord = (int64_t *)dtr__malloc(c->alloc, (size_t)P->rows * sizeof(int64_t));
        tmp = (int64_t *)dtr__malloc(c->alloc, (size_t)P->rows * sizeof(int64_t));
        y = (int32_t *)dtr__malloc(c->alloc, (size_t)P->rows * sizeof(int32_t));
        if (!buf || !off || !ord || !tmp || !y) {
            r = dtr__errf(c->err, c->errlen, DTR_OUT_OF_MEMORY, "%s: out of memory", c->name);
            goto done;
        }
        total = 0;
        for (i = 0; i < P->rows; i++) {
            const dtr__csv_field *f = &P->lab[i].f;
            size_t j;
            off[i] = total;
            for (j = 0; j < f->n; j++) {
                buf[total++] = f->p[j];
                if (f->escaped && f->p[j] == '"' && j + 1 < f->n && f->p[j + 1] == '"') j++;
            }
            buf[total++] = '\0';
            ord[i] = i;
        }
        dtr__sort_by_text(ord, tmp, P->rows, buf, off);
        for (i = 0; i < P->rows; i++) {   /* class of each row, counting distinct names */
            if (i > 0 && strcmp(buf + off[ord[i - 1]], buf + off[ord[i]]) != 0) k++;
            y[ord[i]] = (int32_t)k;
            if (k >= (1 << 24)) {
                r = dtr__errf(c->err, c->errlen, DTR_CORRUPT_FILE, "%s: more than %d distinct class names", c->name, 1 << 24);
                goto done;
            }
        }
        k = P->rows ? k + 1 : 0;
        names = (char **)dtr__calloc(c->alloc, (size_t)(k ? k : 1) * sizeof(char *));
        if (!names) {
            r = dtr__errf(c->err, c->errlen, DTR_OUT_OF_MEMORY, "%s: out of memory", c->name);
            goto done;
        }
        for (i = 0; i < P->rows; i++) {
            int32_t cls = y[ord[i]];
            if (!names[cls] && !(names[cls] = dtr__strdup(c->alloc, buf + off[ord[i]]))) {
                r = dtr__errf(c->err, c->errlen, DTR_OUT_OF_MEMORY, "%s: out of memory", c->name);
                goto done;
            }
        }
    done:
        dtr__free(c->alloc, buf);
        dtr__free(c->alloc, off);
        dtr__free(c->alloc, ord);
        dtr__free(c->alloc, tmp);
        if (r != DTR_OK) {
            if (names)
                for (i = 0; i < k; i++) dtr__free(c->alloc, names[i]);
            dtr__free(c->alloc, names);
            dtr__free(c->alloc, y);
            return r;
        }
        *y_out = y;
        *names_out = names;
        *nclasses = (int)k;
        return DTR_OK;
    }
}

dtr_result dtr_dataset_csv_from_buffer(const void *bytes, size_t size, const dtr_csv_config *cfg, dtr_dataset **out,
                                       char *err, size_t errlen) {
    dtr__csv c;
    dtr__csv_parse P;
    dtr_sample_layout L;
    dtr_dataset *ds = NULL;
    void *y = NULL;
    char **class_names = NULL;
    int nclasses = 0, has_header, label_col = -1, j, rc;
    int64_t nfeat = 0;
    dtr_result r;
    if (err && errlen) err[0] = '\0';
    if (!out) return dtr__errf(err, errlen, DTR_NULL_HANDLE, "dtr_dataset_csv_from_buffer: out is NULL");
    *out = NULL;
    if (!cfg || (!bytes && size)) return dtr__errf(err, errlen, DTR_NULL_HANDLE, "dtr_dataset_csv_from_buffer: NULL argument");
    if ((int)cfg->label_kind < 0 || (int)cfg->label_kind > 2)
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "CSV: label_kind %d is not a dtr_label_kind", (int)cfg->label_kind);
    memset(&c, 0, sizeof c);
    memset(&P, 0, sizeof P);
    c.name = cfg->path ? cfg->path : "CSV text";
    c.s = bytes ? (const char *)bytes : "";
    c.end = c.s + size;
    c.cur = c.s;
    c.line = 1;
    c.delim = cfg->delimiter ? cfg->delimiter : ',';
    c.alloc = &cfg->alloc;
    c.err = err;
    c.errlen = errlen;
    if (c.delim == '"' || c.delim == '\n' || c.delim == '\r' || c.delim == ' ')
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "%s: the delimiter cannot be a quote, space or line break", c.name);
    if (size >= 3 && memcmp(c.s, "\xEF\xBB\xBF", 3) == 0) c.cur += 3;
    rc = dtr__csv_record(&c);
    if (rc < 0) { r = (dtr_result)rc; goto fail; }
    if (rc == 0) {
        r = dtr__errf(err, errlen, DTR_CORRUPT_FILE, "%s: no records (empty file)", c.name);
        goto fail;
    }
    /* the header: given, or detected (no field of the first record is a number) */
    if (cfg->header > 0) {
        has_header = 1;
    } else if (cfg->header < 0) {
        has_header = 0;
    } else {
        double v;
        has_header = 1;
        for (j = 0; j < c.nf; j++)
            if (dtr__parse_number(c.f[j].p, c.f[j].n, &v)) has_header = 0;
    }
    P.ncols = c.nf;
    P.names = (char **)dtr__calloc(c.alloc, (size_t)P.ncols * sizeof(char *));
    if (!P.names) { r = dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "%s: out of memory", c.name); goto fail; }
    for (j = 0; j < P.ncols; j++) {
        char tmp[32];
        if (!has_header) snprintf(tmp, sizeof tmp, "%d", j + 1);
        P.names[j] = has_header ? dtr__csv_text(c.alloc, &c.f[j]) : dtr__strdup(c.alloc, tmp);
        if (!P.names[j]) { r = dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "%s: out of memory", c.name); goto fail; }
    }
    if ((r = dtr__csv_roles(&c, cfg, &P, has_header)) != DTR_OK) goto fail;
    for (j = 0; j < P.ncols; j++) {
        if (P.role[j] == 0) nfeat++;
        if (P.role[j] == 1) label_col = j;
    }
    if (nfeat == 0) {
        r = dtr__errf(err, errlen, DTR_CORRUPT_FILE, "%s: no feature columns (%d columns, all label or ignored)", c.name, P.ncols);
        goto fail;
    }
    if ((r = dtr__csv_rows(&c, cfg, &P, !has_header, nfeat)) != DTR_OK) goto fail;
    if (P.rows == 0) {
        r = dtr__errf(err, errlen, DTR_CORRUPT_FILE, "%s: no data records after the header", c.name);
        goto fail;
    }
    if ((r = dtr__csv_labels(&c, cfg, &P, label_col, &y, &class_names, &nclasses)) != DTR_OK) goto fail;
    memset(&L, 0, sizeof L);
    L.x_dtype = DTR_F32;
    L.x_ndim = 1;
    L.x_shape[0] = nfeat;
    L.unlabeled = cfg->label_kind == DTR_LABEL_NONE;
    L.y_dtype = cfg->label_kind == DTR_LABEL_REGRESSION ? DTR_F32 : DTR_I32;
    L.y_ndim = 0;
    L.num_classes = cfg->label_kind == DTR_LABEL_CLASS ? nclasses : 0;
    r = dtr__memory_dataset(c.alloc, P.rows, &L, P.x, y, c.name, &ds, err, errlen);
    P.x = NULL;   /* adopted (or freed) by the dataset */
    y = NULL;
    if (r != DTR_OK) goto fail;
    ds->class_names = class_names;
    ds->n_class_names = class_names ? nclasses : 0;
    class_names = NULL;
    dtr__csv_parse_free(c.alloc, &P);
    dtr__free(c.alloc, c.f);
    *out = ds;
    return DTR_OK;
fail:
    if (class_names) {
        for (j = 0; j < nclasses; j++) dtr__free(c.alloc, class_names[j]);
        dtr__free(c.alloc, class_names);
    }
    dtr__free(c.alloc, y);
    dtr__csv_parse_free(c.alloc, &P);
    dtr__free(c.alloc, c.f);
    return r;
}

dtr_result dtr_dataset_open_csv(const dtr_csv_config *cfg, dtr_dataset **out, char *err, size_t errlen) {
    unsigned char *buf = NULL;
    size_t size = 0;
    dtr_result r;
    if (err && errlen) err[0] = '\0';
    if (!out) return dtr__errf(err, errlen, DTR_NULL_HANDLE, "dtr_dataset_open_csv: out is NULL");
    *out = NULL;
    if (!cfg || !cfg->path) return dtr__errf(err, errlen, DTR_NULL_HANDLE, "dtr_dataset_open_csv: cfg or path is NULL");
    if ((r = dtr__read_file(cfg->path, &cfg->alloc, &buf, &size, err, errlen)) != DTR_OK) return r;
    r = dtr_dataset_csv_from_buffer(buf, size, cfg, out, err, errlen);
    dtr__free(&cfg->alloc, buf);
    return r;
}
