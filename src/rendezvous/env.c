/* ============================================================================
 * Rendezvous, part 1 of 4: the configuration and the environment conventions (dtrun,
 * torchrun, Slurm, Open MPI), on every platform. Part 2 (wire.c) is the protocol and the
 * server logic on memory buffers, part 3 (server.c) the sockets and rank 0's server thread,
 * part 4 (client.c) the client every rank uses. docs/rendezvous.md describes the whole.
 * ==========================================================================*/
#include "../public/api.h"
#include "../public/api_rdzv.h"
#include "../core/internal.h"

#include <limits.h>
#if !defined(_WIN32)
#include <unistd.h>
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ---- configuration and the environment (every platform) ---- */

dtr_rendezvous_config dtr_rendezvous_config_init(void) {
    dtr_rendezvous_config c;
    memset(&c, 0, sizeof c);
    c.world_size = 1;
    memcpy(c.master_addr, "127.0.0.1", 10);
    c.port = 29500;
    c.timeout_ms = 300000;
    c.log_level = DTR_LOG_WARN;
    return c;
}

/* Parses a whole string of decimal digits (no sign, no spaces) into [lo, hi]. */
static int dtr__rdzv_parse_uint(const char *s, int64_t lo, int64_t hi, int64_t *out) {
    int64_t v = 0;
    if (!*s) return 0;
    for (; *s; s++) {
        int d = *s - '0';
        if (d < 0 || d > 9) return 0;
        if (v > (hi - d) / 10) return 0;
        v = v * 10 + d;
    }
    if (v < lo) return 0;
    *out = v;
    return 1;
}

/* The first non-empty variable among names[0..n); *which gets its name. */
static const char *dtr__rdzv_getenv(const char *const *names, int n, const char **which) {
    int i;
    for (i = 0; i < n; i++) {
        const char *v = getenv(names[i]);
        if (v && v[0]) {
            *which = names[i];
            return v;
        }
    }
    return NULL;
}

/* Reads an integer field from the first set variable of `names`. */
static dtr_result dtr__rdzv_env_int(const char *const *names, int n, int64_t lo, int64_t hi, int32_t *field,
                                    const char **which, char *err, size_t errlen) {
    const char *v = dtr__rdzv_getenv(names, n, which);
    int64_t x;
    if (!v) return DTR_OK;
    if (!dtr__rdzv_parse_uint(v, lo, hi, &x))
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT,
                         "rendezvous: %s='%.64s' is not a decimal integer in [%lld, %lld]", *which, v, (long long)lo,
                         (long long)hi);
    *field = (int32_t)x;
    return DTR_OK;
}

static dtr_result dtr__rdzv_env_str(const char *const *names, int n, char *field, const char **which, char *err,
                                    size_t errlen) {
    const char *v = dtr__rdzv_getenv(names, n, which);
    size_t len;
    if (!v) return DTR_OK;
    len = strlen(v);
    if (len >= DTR_RDZV_STR)
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "rendezvous: %s is %lu bytes long; at most %d", *which,
                         (unsigned long)len, DTR_RDZV_STR - 1);
    memcpy(field, v, len + 1);
    return DTR_OK;
}

/* A positive decimal variable, or `def` when it is unset or not valid. */
static int dtr__env_ms(const char *name, int def) {
    const char *v = getenv(name);
    int64_t x;
    return v && dtr__rdzv_parse_uint(v, 1, INT32_MAX, &x) ? (int)x : def;
}

int dtr__default_timeout_ms(void) { return dtr__env_ms("DTR_TIMEOUT_MS", 300000); }
int dtr__default_grace_ms(void) { return dtr__env_ms("DTR_GRACE_MS", 2000); }

/* The fields of the elastic restarts: generation, job id, grace. */
static dtr_result dtr__rdzv_env_elastic(dtr_rendezvous_config *cfg, char *err, size_t errlen) {
    static const char *const gen[] = {"DTR_RESTART"};
    static const char *const job[] = {"DTR_JOB_ID"};
    static const char *const grace[] = {"DTR_GRACE_MS"};
    const char *w = NULL;
    int32_t grace_v = cfg->grace_ms;
    dtr_result r;
    if ((r = dtr__rdzv_env_int(gen, 1, 0, INT32_MAX, &cfg->generation, &w, err, errlen)) != DTR_OK) return r;
    if ((r = dtr__rdzv_env_str(job, 1, cfg->job_id, &w, err, errlen)) != DTR_OK) return r;
    if ((r = dtr__rdzv_env_int(grace, 1, 1, INT32_MAX, &grace_v, &w, err, errlen)) != DTR_OK) return r;
    cfg->grace_ms = grace_v;
    return DTR_OK;
}

void dtr_elastic_step(int64_t step) {
#if !defined(_WIN32)
    static int done;
    int expect = 0;
    const char *fd = getenv("DTR_NOTIFY_FD");
    int64_t n;
    char line[96];
    int len;
    if (!fd || !dtr__rdzv_parse_uint(fd, 0, INT32_MAX, &n) || !DTR__ATOMIC_CAS(&done, &expect, 1)) return;
    len = snprintf(line, sizeof line, "step %s %s %lld\n", getenv("DTR_RESTART") ? getenv("DTR_RESTART") : "0",
                   getenv("DTR_RANK") ? getenv("DTR_RANK") : "0", (long long)step);
    if (write((int)n, line, (size_t)len) < 0) { /* dtrun is gone: nothing to tell */
    }
#else
    (void)step;
#endif
}

dtr_result dtr_rendezvous_config_from_env(dtr_rendezvous_config *cfg, char *err, size_t errlen) {
    static const char *const rank[] = {"DTR_RANK", "RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"};
    static const char *const world[] = {"DTR_WORLD_SIZE", "WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"};
    static const char *const lrank[] = {"DTR_LOCAL_RANK", "LOCAL_RANK", "SLURM_LOCALID",
                                        "OMPI_COMM_WORLD_LOCAL_RANK"};
    static const char *const lworld[] = {"DTR_LOCAL_WORLD_SIZE", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"};
    static const char *const addr[] = {"DTR_MASTER_ADDR", "MASTER_ADDR"};
    static const char *const port[] = {"DTR_MASTER_PORT", "MASTER_PORT"};
    static const char *const secret[] = {"DTR_SECRET"};
    static const char *const timeout[] = {"DTR_TIMEOUT_MS"};
    const char *rank_from = "the configuration", *world_from = "the configuration";
    const char *lrank_from = "the configuration", *lworld_from = "the configuration", *w = NULL;
    int32_t port_v = 0, timeout_v = 0;
    dtr_result r;
    if (err && errlen) err[0] = '\0';
    if (!cfg) return dtr__errf(err, errlen, DTR_NULL_HANDLE, "rendezvous: config is NULL");
    if ((r = dtr__rdzv_env_int(rank, 4, 0, INT32_MAX - 1, &cfg->rank, &rank_from, err, errlen)) != DTR_OK) return r;
    if ((r = dtr__rdzv_env_int(world, 4, 1, INT32_MAX, &cfg->world_size, &world_from, err, errlen)) != DTR_OK)
        return r;
    if ((r = dtr__rdzv_env_int(lrank, 4, 0, INT32_MAX - 1, &cfg->local_rank, &lrank_from, err, errlen)) != DTR_OK)
        return r;
    if ((r = dtr__rdzv_env_int(lworld, 3, 1, INT32_MAX, &cfg->local_world_size, &lworld_from, err, errlen)) !=
        DTR_OK)
        return r;
    if ((r = dtr__rdzv_env_str(addr, 2, cfg->master_addr, &w, err, errlen)) != DTR_OK) return r;
    if ((r = dtr__rdzv_env_str(secret, 1, cfg->secret, &w, err, errlen)) != DTR_OK) return r;
    port_v = cfg->port;
    if ((r = dtr__rdzv_env_int(port, 2, 1, 65535, &port_v, &w, err, errlen)) != DTR_OK) return r;
    cfg->port = port_v;
    timeout_v = cfg->timeout_ms;
    if ((r = dtr__rdzv_env_int(timeout, 1, 1, INT32_MAX, &timeout_v, &w, err, errlen)) != DTR_OK) return r;
    cfg->timeout_ms = timeout_v;
    if ((r = dtr__rdzv_env_elastic(cfg, err, errlen)) != DTR_OK) return r;
    if (cfg->rank >= cfg->world_size)
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "rendezvous: rank %ld (from %s) is not below the world size %ld (from %s)",
                         (long)cfg->rank, rank_from, (long)cfg->world_size, world_from);
    if (cfg->local_world_size > 0 && cfg->local_rank >= cfg->local_world_size)
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT,
                         "rendezvous: local rank %ld (from %s) is not below the local world size %ld (from %s)",
                         (long)cfg->local_rank, lrank_from, (long)cfg->local_world_size, lworld_from);
    return DTR_OK;
}


#ifdef __cplusplus
}
#endif
