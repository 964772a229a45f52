/* ============================================================================
 * The progress line of training loops (dtr_progress_format): epoch and step, a bar, the
 * rate, the loss and the time left at the mean pace so far. Pure formatting.
 * ==========================================================================*/
#include "../public/api.h"
#include "internal.h"

/* appends to buf at *len like snprintf, keeping *len the untruncated length */
static void dtr__app(char *buf, size_t n, size_t *len, const char *fmt, ...) DTR__PRINTF(4, 5);
static void dtr__app(char *buf, size_t n, size_t *len, const char *fmt, ...) {
    va_list ap;
    int k;
    va_start(ap, fmt);
    k = vsnprintf(*len < n ? buf + *len : NULL, *len < n ? n - *len : 0, fmt, ap);
    va_end(ap);
    if (k > 0) *len += (size_t)k;
}

/* "42s", "3m05s", "2h07m" */
static void dtr__eta(char *buf, size_t n, size_t *len, double s) {
    long t = s < 0 ? 0 : (long)(s + 0.5);
    if (t < 60) dtr__app(buf, n, len, " | ETA %lds", t);
    else if (t < 3600) dtr__app(buf, n, len, " | ETA %ldm%02lds", t / 60, t % 60);
    else dtr__app(buf, n, len, " | ETA %ldh%02ldm", t / 3600, (t / 60) % 60);
}

static void dtr__bar(char *buf, size_t n, size_t *len, int64_t step, int64_t steps) {
    char bar[21];
    int i, full = (int)(20 * (step < steps ? step : steps) / steps);
    for (i = 0; i < 20; i++) bar[i] = i < full ? '#' : '.';
    bar[20] = 0;
    dtr__app(buf, n, len, " [%s] %3d%% %lld/%lld", bar, (int)(100 * (step < steps ? step : steps) / steps),
             (long long)step, (long long)steps);
}

size_t dtr_progress_format(char *buf, size_t n, const dtr_progress_info *p) {
    size_t len = 0;
    int64_t done, total;
    if (!buf || !p || n == 0) return 0;
    buf[0] = 0;
    if (p->epochs > 0) dtr__app(buf, n, &len, "epoch %lld/%lld", (long long)p->epoch + 1, (long long)p->epochs);
    else dtr__app(buf, n, &len, "epoch %lld", (long long)p->epoch + 1);
    if (p->steps > 0) dtr__bar(buf, n, &len, p->step, p->steps);
    else dtr__app(buf, n, &len, " step %lld", (long long)p->step);
    if (p->rate > 0) dtr__app(buf, n, &len, " | %.0f %s", p->rate, p->rate_unit ? p->rate_unit : "samples/s");
    if (p->has_loss) dtr__app(buf, n, &len, " | loss %.4f", p->loss);
    done = p->epoch * p->steps + p->step;
    total = p->epochs > 0 ? p->epochs * p->steps : (p->epoch + 1) * p->steps;
    if (p->steps > 0 && done > 0 && p->elapsed_s > 0 && total >= done)
        dtr__eta(buf, n, &len, p->elapsed_s * (double)(total - done) / (double)done);
    return len;
}
