/* tests/test_plot.c: build/dtrain-plot (src/tools/dtrain_plot.c), run as a program. From a
 * metrics JSON-lines file it writes well-formed XML (checked by the small checker below)
 * with the expected series and their point counts (a record without a loss is left out of
 * the loss only; another rank's records are left out; each skipped step is marked); from
 * Chrome traces (X events, nested B/E pairs, two ranks) one rectangle per span and one lane
 * per (pid, tid); malformed input gives exit code 1 and a message naming the line, never a
 * crash. The program is looked for beside the tests folder (build/tests/../dtrain-plot) or
 * at $DTRAIN_PLOT. Also dtrun's forwarding of progress lines (a line ending in "\r" stays
 * one), with build/dtrun beside it. */
#define _POSIX_C_SOURCE 200809L
#include "test.h"
#include "test_util.h"
#include <ctype.h>
#include <sys/wait.h>

static char g_plot[1024];

/* ---- a small XML well-formedness checker ---- */

static int xml_name(const char **p, char *out, size_t n) {
    size_t k = 0;
    while (**p && (isalnum((unsigned char)**p) || **p == '-' || **p == '_' || **p == ':' || **p == '.')) {
        if (k + 1 < n) out[k++] = **p;
        (*p)++;
    }
    out[k] = 0;
    return k > 0;
}

/* text or an attribute value up to `end`: no '<', '&' only as an entity */
static int xml_chars(const char **p, char end) {
    while (**p && **p != end) {
        if (**p == '<' && end != '<') return 0;
        if (**p == '&') {
            const char *q = *p + 1;
            while (isalnum((unsigned char)*q) || *q == '#') q++;
            if (*q != ';' || q == *p + 1) return 0;
            *p = q;
        }
        (*p)++;
    }
    return 1;
}

/* one start tag after '<': name, attributes (name="value", no duplicates checked), / or > */
static int xml_tag(const char **p, char *name, size_t n, int *empty) {
    char attr[64];
    if (!xml_name(p, name, n)) return 0;
    for (;;) {
        while (isspace((unsigned char)**p)) (*p)++;
        if (**p == '/' && (*p)[1] == '>') { *p += 2; *empty = 1; return 1; }
        if (**p == '>') { (*p)++; *empty = 0; return 1; }
        if (!xml_name(p, attr, sizeof attr) || **p != '=' || (*p)[1] != '"') return 0;
        *p += 2;
        if (!xml_chars(p, '"') || **p != '"') return 0;
        (*p)++;
    }
}

/* 1 when s is one XML declaration and one well-formed root element */
static int xml_well_formed(const char *s) {
    char stack[32][32], name[32];
    int depth = 0, roots = 0, empty;
    if (strncmp(s, "<?xml ", 6) == 0 && !(s = strstr(s, "?>"))) return 0;
    if (s[0] == '?') s += 2;
    for (;;) {
        if (!xml_chars(&s, '<')) return 0;
        if (!*s) break;
        s++;
        if (*s == '/') {
            s++;
            if (depth == 0 || !xml_name(&s, name, sizeof name) || strcmp(name, stack[depth - 1]) != 0 || *s != '>') return 0;
            depth--;
            s++;
            continue;
        }
        if (depth == 0 && roots++) return 0;
        if (!xml_tag(&s, name, sizeof name, &empty)) return 0;
        if (!empty) {
            if (depth == 32) return 0;
            snprintf(stack[depth++], sizeof stack[0], "%s", name);
        }
    }
    return depth == 0 && roots == 1;
}

/* points in the `points` attribute of the element with id="id"; -1 when there is none */
static int points_of(const char *svg, const char *id) {
    char key[64];
    const char *p, *end;
    int n = 0;
    snprintf(key, sizeof key, "id=\"%s\"", id);
    if (!(p = strstr(svg, key)) || !(p = strstr(p, "points=\"")) || !(end = strchr(p + 8, '"'))) return -1;
    for (p += 8; p < end; p++) n += *p == ',';
    return n;
}

static int count_of(const char *s, const char *what) {
    int n = 0;
    while ((s = strstr(s, what)) != NULL) { n++; s++; }
    return n;
}

/* ---- running the program ---- */

static char *slurp(const char *path) {
    FILE *f = fopen(path, "rb");
    char *b;
    long n;
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    n = ftell(f);
    fseek(f, 0, SEEK_SET);
    b = (char *)malloc((size_t)n + 1);
    if (b && fread(b, 1, (size_t)n, f) != (size_t)n) { free(b); b = NULL; }
    if (b) b[n] = 0;
    fclose(f);
    return b;
}

/* runs dtrain-plot with args; its exit code (-1 when it did not exit normally); stderr in err */
static int plot(const char *args, char *err, size_t n) {
    char cmd[4096], errpath[512];
    char *e;
    int st;
    tmp_path("test_plot", "stderr", errpath, sizeof errpath);
    snprintf(cmd, sizeof cmd, "'%s' %s 2>'%s'", g_plot, args, errpath);
    st = system(cmd);
    e = slurp(errpath);
    snprintf(err, n, "%s", e ? e : "");
    free(e);
    remove(errpath);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/* ---- metrics ---- */

static void write_metrics(const char *path) {
    FILE *f = fopen(path, "w");
    int s, r;
    for (s = 1; s <= 30; s++)
        for (r = 0; r < 2; r++) {
            fprintf(f, "{\"rank\":%d,\"step\":%d,\"epoch\":0,", r, s);
            if (!(r == 0 && s == 10)) fprintf(f, "\"loss\":%g,", 2.0 / s);
            fprintf(f, "\"lr\":0.01,\"grad_norm\":1.2,\"samples\":64,\"tokens\":0,\"samples_per_s\":%g,\"tokens_per_s\":0,"
                       "\"time\":{\"step\":0.012,\"data\":0.001,\"forward\":0.004,\"backward\":0.005,\"comm\":0.001,"
                       "\"optimizer\":0.001,\"checkpoint\":0},\"flops\":1.2e9,\"mfu\":0.12,\"skipped\":%d,"
                       "\"extra\":{\"nested\":[1,{\"a\":null}]}}\n", 1000.0 + s, s == 20 || s == 25);
        }
    fclose(f);
}

static void t_metrics_svg(void) {
    char in[512], out[512], args[1200], err[1024];
    char *svg;
    static const char *const parts[6] = {"time-data", "time-forward", "time-backward", "time-comm", "time-optimizer",
                                         "time-checkpoint"};
    int k;
    write_metrics(tmp_path("test_plot", "m.jsonl", in, sizeof in));
    tmp_path("test_plot", "m.svg", out, sizeof out);
    snprintf(args, sizeof args, "-o '%s' '%s'", out, in);
    CHECK_EQ_INT(plot(args, err, sizeof err), 0);
    svg = slurp(out);
    CHECK(svg != NULL);
    if (svg) {
        CHECK(xml_well_formed(svg));
        CHECK_EQ_INT(points_of(svg, "loss"), 29);         /* rank 0's step 10 has no loss */
        CHECK_EQ_INT(points_of(svg, "throughput"), 30);
        CHECK_EQ_INT(points_of(svg, "time-step"), 30);
        for (k = 0; k < 6; k++) CHECK_EQ_INT(points_of(svg, parts[k]), 60);   /* top and bottom of each layer */
        CHECK_EQ_INT(count_of(svg, "class=\"skipped\""), 2);
        CHECK(strstr(svg, "Throughput (samples/s)") != NULL);
    }
    free(svg);
    snprintf(args, sizeof args, "--rank 1 -o '%s' '%s'", out, in);
    CHECK_EQ_INT(plot(args, err, sizeof err), 0);
    svg = slurp(out);
    CHECK(svg && xml_well_formed(svg) && points_of(svg, "loss") == 30);
    free(svg);
    snprintf(args, sizeof args, "--rank 5 -o '%s' '%s'", out, in);
    CHECK_EQ_INT(plot(args, err, sizeof err), 1);
    CHECK_MSG(strstr(err, "no records of rank 5"), "%s", err);
    remove(in);
    remove(out);
}

/* a metrics file with only a few fields: the series that exist, no crash */
static void t_metrics_sparse(void) {
    char in[512], out[512], args[1200], err[1024];
    const char *text = "{\"step\":1,\"tokens_per_s\":50}\n\n  \n{\"step\":2,\"loss\":null,\"tokens_per_s\":60,\"time\":{}}\n";
    char *svg;
    CHECK(write_file(tmp_path("test_plot", "s.jsonl", in, sizeof in), text, strlen(text)));
    tmp_path("test_plot", "s.svg", out, sizeof out);
    snprintf(args, sizeof args, "-o '%s' '%s'", out, in);
    CHECK_EQ_INT(plot(args, err, sizeof err), 0);
    svg = slurp(out);
    CHECK(svg && xml_well_formed(svg));
    if (svg) {
        CHECK_EQ_INT(points_of(svg, "loss"), 0);
        CHECK_EQ_INT(points_of(svg, "throughput"), 2);
        CHECK(strstr(svg, "Throughput (tokens/s)") != NULL);
        CHECK_EQ_INT(points_of(svg, "time-data"), -1);
    }
    free(svg);
    remove(in);
    remove(out);
}

/* ---- traces ---- */

static void t_trace_svg(void) {
    char in0[512], in1[512], out[512], args[2000], err[1024];
    const char *t0 = "{\"traceEvents\":[{\"name\":\"step\",\"ph\":\"B\",\"ts\":0,\"pid\":0,\"tid\":0},"
                     "{\"name\":\"forward\",\"ph\":\"X\",\"ts\":10,\"dur\":400,\"pid\":0,\"tid\":0},"
                     "{\"name\":\"backward <&>\",\"ph\":\"B\",\"ts\":420,\"pid\":0,\"tid\":0},"
                     "{\"name\":\"backward <&>\",\"ph\":\"E\",\"ts\":900,\"pid\":0,\"tid\":0},"
                     "{\"name\":\"allreduce\",\"ph\":\"X\",\"ts\":600,\"dur\":300,\"pid\":0,\"tid\":1},"
                     "{\"name\":\"counter\",\"ph\":\"C\",\"ts\":5,\"pid\":0,\"args\":{\"x\":1}},"
                     "{\"name\":\"step\",\"ph\":\"E\",\"ts\":1000,\"pid\":0,\"tid\":0}],\"displayTimeUnit\":\"ms\"}";
    const char *t1 = "[{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":1,\"tid\":0,\"args\":{\"name\":\"compute\"}},"
                     "{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":1,\"tid\":7,\"args\":{\"name\":\"idle\"}},"
                     "{\"name\":\"step\",\"ph\":\"X\",\"ts\":0,\"dur\":990,\"pid\":1,\"tid\":0}]";
    char *svg;
    CHECK(write_file(tmp_path("test_plot", "t0.json", in0, sizeof in0), t0, strlen(t0)));
    CHECK(write_file(tmp_path("test_plot", "t1.json", in1, sizeof in1), t1, strlen(t1)));
    tmp_path("test_plot", "t.svg", out, sizeof out);
    snprintf(args, sizeof args, "--trace -o '%s' '%s' '%s'", out, in0, in1);
    CHECK_EQ_INT(plot(args, err, sizeof err), 0);
    svg = slurp(out);
    CHECK(svg && xml_well_formed(svg));
    if (svg) {
        CHECK_EQ_INT(count_of(svg, "class=\"span\""), 5);
        CHECK_EQ_INT(count_of(svg, "class=\"lane\""), 3);   /* the lane without spans is not drawn */
        CHECK(strstr(svg, "backward &lt;&amp;&gt; (0.480 ms)") != NULL);
        CHECK(strstr(svg, ">rank 1 / compute<") != NULL && strstr(svg, ">rank 0 / tid 1<") != NULL);
    }
    free(svg);
    /* a window: 0.5 ms to 0.7 ms cuts the spans to it */
    snprintf(args, sizeof args, "--trace --from 0.5 --to 0.7 -o '%s' '%s' '%s'", out, in0, in1);
    CHECK_EQ_INT(plot(args, err, sizeof err), 0);
    svg = slurp(out);
    CHECK(svg && xml_well_formed(svg));
    if (svg) {
        CHECK_EQ_INT(count_of(svg, "class=\"span\""), 4);   /* step, backward, allreduce, rank 1's step */
        CHECK(strstr(svg, "backward &lt;&amp;&gt; (0.200 ms)") != NULL);
    }
    free(svg);
    snprintf(args, sizeof args, "--trace --from 0.7 --to 0.5 -o '%s' '%s'", out, in0);
    CHECK_EQ_INT(plot(args, err, sizeof err), 1);
    remove(in0);
    remove(in1);
    remove(out);
}

/* ---- malformed input ---- */

typedef struct bad_case { const char *what, *text, *mode, *expect; } bad_case;

static const bad_case BAD[] = {
    {"truncated line", "{\"step\":1,\"loss\":1}\n{\"step\":2,\"loss\":\n", "", ":2: not a metrics record"},
    {"not an object", "{\"step\":1}\n[1,2]\n", "", ":2: not a metrics record"},
    {"string loss", "{\"step\":1,\"loss\":\"high\"}\n", "", ":1: not a metrics record"},
    {"garbage", "\x01\x02\xff{{{", "", ":1: not a metrics record"},
    {"deep nesting", "{\"a\":[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]]]"
                     "]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}\n", "", "nested too deeply"},
    {"empty file", "", "", "no records of rank 0"},
    {"trace: no events", "{\"other\":1}", "--trace", "no \"traceEvents\" array"},
    {"trace: event not an object", "{\"traceEvents\":[1]}", "--trace", "must be an object"},
    {"trace: no ts", "{\"traceEvents\":[{\"ph\":\"X\",\"name\":\"a\"}]}", "--trace", "without a numeric"},
    {"trace: truncated", "{\"traceEvents\":[{\"ph\":\"X\",", "--trace", "not a Chrome trace"},
    {"trace: only counters", "[{\"ph\":\"C\",\"ts\":1}]", "--trace", "no spans"},
};

static void t_malformed(void) {
    char in[512], args[1200], err[1024];
    size_t i;
    for (i = 0; i < sizeof BAD / sizeof BAD[0]; i++) {
        CHECK(write_file(tmp_path("test_plot", "bad", in, sizeof in), BAD[i].text, strlen(BAD[i].text)));
        snprintf(args, sizeof args, "%s -o /dev/null '%s'", BAD[i].mode, in);
        CHECK_MSG(plot(args, err, sizeof err) == 1, "%s", BAD[i].what);
        CHECK_MSG(strstr(err, BAD[i].expect) != NULL, "%s: %s", BAD[i].what, err);
    }
    remove(in);
    CHECK_EQ_INT(plot("/nonexistent/metrics.jsonl", err, sizeof err), 1);
    CHECK(strstr(err, "cannot open") != NULL);
    CHECK_EQ_INT(plot("", err, sizeof err), 1);
    CHECK(strstr(err, "usage") != NULL);
    CHECK_EQ_INT(plot("--bogus x", err, sizeof err), 1);
}

static void t_checker_rejects(void) {   /* the checker itself */
    CHECK(xml_well_formed("<?xml version=\"1.0\"?>\n<a x=\"1\"><b/>t &amp; u</a>\n"));
    CHECK(!xml_well_formed("<a><b></a></b>"));
    CHECK(!xml_well_formed("<a x=\"<\"/>"));
    CHECK(!xml_well_formed("<a>&</a>"));
    CHECK(!xml_well_formed("<a/><b/>"));
    CHECK(!xml_well_formed("<a>"));
}

/* ---- dtrun forwards a progress line ("\r") as one ---- */

static void t_dtrun_progress(void) {
    char cmd[2400], outpath[512], dtrun[1100];
    const char *want = "[0] step 1\r[0] step 2\r[0] done\n";
    char *out;
    const char *slash = strrchr(g_plot, '/');
    snprintf(dtrun, sizeof dtrun, "%.*s/dtrun", slash ? (int)(slash - g_plot) : 1, slash ? g_plot : ".");
    tmp_path("test_plot", "dtrun.out", outpath, sizeof outpath);
    snprintf(cmd, sizeof cmd, "'%s' -n 1 -- sh -c 'printf \"step 1\\rstep 2\\rdone\\n\"; env' >'%s' 2>&1 </dev/null", dtrun,
             outpath);
    CHECK_EQ_INT(system(cmd), 0);
    out = slurp(outpath);
    CHECK_MSG(out && strncmp(out, want, strlen(want)) == 0, "%s", out ? out : "(none)");
    CHECK(out && !strstr(out, "DTR_TTY="));   /* its stdout is a file here */
    free(out);
    remove(outpath);
}

int main(int argc, char **argv) {
    const char *env = getenv("DTRAIN_PLOT");
    const char *slash = strrchr(argv[0], '/');
    (void)argc;
    (void)test_ctx;   /* test.h's, unused here */
    if (env) snprintf(g_plot, sizeof g_plot, "%s", env);
    else snprintf(g_plot, sizeof g_plot, "%.*s/../dtrain-plot", slash ? (int)(slash - argv[0]) : 1, slash ? argv[0] : ".");
    RUN(t_checker_rejects);
    RUN(t_metrics_svg);
    RUN(t_metrics_sparse);
    RUN(t_trace_svg);
    RUN(t_malformed);
    RUN(t_dtrun_progress);
    return test_summary();
}
