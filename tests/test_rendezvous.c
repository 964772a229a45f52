/* tests/test_rendezvous.c: the rendezvous store (src/rendezvous/) across real processes.
 *
 * Every multi-process case forks its ranks on 127.0.0.1 with short deadlines (0.5 to 5 s);
 * each child has an alarm() so it cannot outlive its case, the parent reaps with a deadline
 * (then SIGKILL), and the whole program has an alarm() too: nothing here can hang. Children
 * end with exit(), so under ASan their leaks are checked as well.
 *
 * Cases: SHA-256 / HMAC-SHA256 vectors (FIPS 180-4, RFC 4231); environment precedence
 * (DTR_ > torchrun > Slurm > Open MPI) and parse errors; one-process store: set/get/check/
 * add/delete, limits, bad arguments, a missing key timing out with its name, a busy port,
 * a zeroed configuration; four processes exchanging keys and counters; barriers (and one
 * that times out, naming how many arrived); the intruder scenarios, one table
 * (INTRUDERS): a joiner with the wrong secret or another world size (refused at once with
 * DTR_INVALID_ARGUMENT, logged, the server keeps serving), garbage, oversize length fields
 * and bad ops sent to the port (refused and logged, the server keeps serving); a joiner that
 * connects and stays silent (nobody stalls; it is dropped after the deadline); the server
 * faults, one table (SERVER_FAULTS): the server SIGKILLed (DTR_PEER_FAILED, quickly) or
 * stopped (DTR_TIMEOUT, within the deadline); a late server (clients retry) and no server at all (DTR_TIMEOUT); a late
 * reply to a request that timed out is not taken for the next one's; generations (a rank of
 * an older world is refused at once, a newer one retries) and jobs (a rank of another job on
 * the port is refused at once, naming the cause); rank 0's destroy waits timeout_ms for a
 * rank that keeps its connection, but only grace_ms once the store failed; after
 * dtr__store_cut (the teardown of a failed group) a call waiting on another thread ends
 * within grace_ms, and so does every later one. */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <time.h>
#include <unistd.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/wait.h>
#include "test.h"
#include "posix_util.h"

/* Internal functions from src/rendezvous/sha256.c (in libdtrain.a). */
void dtr__sha256_once(const void *data, size_t n, uint8_t out[32]);
void dtr__hmac_sha256(const void *key, size_t keylen, const void *data, size_t n, uint8_t out[32]);
/* src/rendezvous/client.c: the teardown's cut of every call (src/comm/comm_internal.h). */
void dtr__store_cut(dtr_store *st);

/* ---- helpers ---- */

/* Log messages of this process (the server thread logs too). */
static char logbuf[16384];
static size_t loglen;
static pthread_mutex_t loglock = PTHREAD_MUTEX_INITIALIZER;

static void cap_log(void *user, dtr_log_level level, const char *msg) {
    size_t n = strlen(msg);
    (void)user;
    (void)level;
    pthread_mutex_lock(&loglock);
    if (loglen + n + 2 < sizeof logbuf) {
        memcpy(logbuf + loglen, msg, n);
        loglen += n;
        logbuf[loglen++] = '\n';
        logbuf[loglen] = '\0';
    }
    pthread_mutex_unlock(&loglock);
    if (getenv("DTR_TEST_VERBOSE")) fprintf(stderr, "    [pid %ld log] %s\n", (long)getpid(), msg);
}

static int log_has(const char *s) {
    int r;
    pthread_mutex_lock(&loglock);
    r = strstr(logbuf, s) != NULL;
    pthread_mutex_unlock(&loglock);
    return r;
}

static dtr_rendezvous_config cfg_for(int rank, int world, int port, const char *secret, int timeout_ms) {
    dtr_rendezvous_config c = dtr_rendezvous_config_init();
    c.rank = rank;
    c.world_size = world;
    c.port = port;
    snprintf(c.secret, sizeof c.secret, "%s", secret);
    c.timeout_ms = timeout_ms;
    c.log = cap_log;
    c.log_level = DTR_LOG_DEBUG;
    return c;
}

/* Checks inside a child: print and return 1 (the child's exit code). */
#define CC(cond) do { if (!(cond)) { \
    fprintf(stderr, "    child pid %ld %s:%d: FAILED %s\n", (long)getpid(), __FILE__, __LINE__, #cond); \
    return 1; } } while (0)
#define CC_MSG(cond, ...) do { if (!(cond)) { \
    fprintf(stderr, "    child pid %ld %s:%d: FAILED %s: ", (long)getpid(), __FILE__, __LINE__, #cond); \
    fprintf(stderr, __VA_ARGS__); fputc('\n', stderr); return 1; } } while (0)
#define CC_OK(st, expr) do { dtr_result cc__r = (expr); if (cc__r != DTR_OK) { \
    fprintf(stderr, "    child pid %ld %s:%d: %s -> %s: %s\n", (long)getpid(), __FILE__, __LINE__, #expr, \
            dtr_result_string(cc__r), (st) ? dtr_store_last_error(st) : ""); return 1; } } while (0)

/* Checks a store call in the parent, printing the store's message. */
#define CHECK_ST(st, expr) do { dtr_result ck__r = (expr); if (ck__r != DTR_OK) { \
    fprintf(stderr, "  FAIL %s:%d in %s: %s -> %s (%s)\n", __FILE__, __LINE__, test__case, #expr, \
            dtr_result_string(ck__r), (st) ? dtr_store_last_error(st) : ""); test__case_failed = 1; } } while (0)

typedef int (*child_fn)(int rank, void *arg);

/* Forks a child that runs fn(rank, arg) and exits with its result (alarm: 20 s). */
static pid_t spawn(child_fn fn, int rank, void *arg) {
    pid_t pid;
    fflush(NULL);
    pid = fork();
    if (pid < 0) {
        perror("fork");
        exit(2);
    }
    if (pid == 0) {
        int rc;
        alarm(20);
        loglen = 0;
        logbuf[0] = '\0';
        rc = fn(rank, arg);
        fflush(NULL);
        exit(rc);
    }
    return pid;
}

/* Exit code of pid (-signal when killed), waiting at most timeout_ms, then SIGKILL (-1000). */
static int reap(pid_t pid, int timeout_ms) {
    int64_t end = now_ms() + timeout_ms;
    int status;
    for (;;) {
        pid_t r = waitpid(pid, &status, WNOHANG);
        if (r == pid) return WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
        if (r < 0) return -2000;
        if (now_ms() > end) {
            kill(pid, SIGKILL);
            waitpid(pid, &status, 0);
            fprintf(stderr, "  child %ld did not finish within %d ms: killed\n", (long)pid, timeout_ms);
            return -1000;
        }
        sleep_ms(5);
    }
}

/* ---- raw sockets, for the peers that misbehave ---- */

static int raw_connect(int port, int timeout_ms) {
    int64_t end = now_ms() + timeout_ms;
    for (;;) {
        struct sockaddr_in a;
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        memset(&a, 0, sizeof a);
        a.sin_family = AF_INET;
        a.sin_port = htons((uint16_t)port);
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        if (fd >= 0 && connect(fd, (struct sockaddr *)&a, sizeof a) == 0) return fd;
        if (fd >= 0) close(fd);
        if (now_ms() > end) return -1;
        sleep_ms(10);
    }
}

/* Reads up to n bytes within timeout_ms; returns the count (short on EOF, reset or timeout). */
static size_t raw_read(int fd, void *buf, size_t n, int timeout_ms) {
    int64_t end = now_ms() + timeout_ms;
    size_t got = 0;
    while (got < n) {
        struct pollfd p;
        int left = (int)(end - now_ms());
        ssize_t k;
        if (left <= 0) break;
        p.fd = fd;
        p.events = POLLIN;
        if (poll(&p, 1, left) <= 0) continue;
        k = recv(fd, (char *)buf + got, n - got, 0);
        if (k <= 0) break;
        got += (size_t)k;
    }
    return got;
}

/* 1 when the server ends the connection (EOF or reset) within timeout_ms (data is drained). */
static int raw_wait_eof(int fd, int timeout_ms) {
    int64_t end = now_ms() + timeout_ms;
    char buf[4096];
    for (;;) {
        struct pollfd p;
        int left = (int)(end - now_ms());
        ssize_t k;
        if (left <= 0) return 0;
        p.fd = fd;
        p.events = POLLIN;
        if (poll(&p, 1, left) <= 0) continue;
        k = recv(fd, buf, sizeof buf, 0);
        if (k <= 0) return 1;
    }
}

static void raw_send(int fd, const void *p, size_t n) {
    if (send(fd, p, n, MSG_NOSIGNAL) != (ssize_t)n) { /* the server may have closed: fine */
    }
}

static void put32(uint8_t *p, uint32_t v) {
    p[0] = (uint8_t)(v >> 24); p[1] = (uint8_t)(v >> 16); p[2] = (uint8_t)(v >> 8); p[3] = (uint8_t)v;
}
static uint32_t get32(const uint8_t *p) {
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}

/* The documented handshake, written out from docs/rendezvous.md. Returns the welcome status,
 * or -1 when the server did not answer. */
static int raw_handshake(int fd, const char *secret, uint32_t rank, uint32_t world) {
    uint8_t hello[40], auth[100], msg[15 + 32 + 68], wel[44], job[32];
    if (raw_read(fd, hello, 40, 2000) != 40 || memcmp(hello, "DTRZ", 4) != 0 || get32(hello + 4) != 2) return -1;
    memcpy(auth, "DTRA", 4);
    put32(auth + 4, 2);
    put32(auth + 8, rank);
    put32(auth + 12, world);
    put32(auth + 16, 0);           /* generation */
    dtr__sha256_once("", 0, job);  /* job tag: SHA-256 of the job id "" */
    memcpy(auth + 20, job, 16);
    memset(auth + 36, 0x5a, 32);   /* client nonce */
    memcpy(msg, "dtr-rdzv-2 join", 15);
    memcpy(msg + 15, hello + 8, 32);
    memcpy(msg + 47, auth, 68);
    dtr__hmac_sha256(secret, strlen(secret), msg, sizeof msg, auth + 68);
    raw_send(fd, auth, sizeof auth);
    if (raw_read(fd, wel, 44, 2000) != 44 || memcmp(wel, "DTRW", 4) != 0) return -1;
    return (int)get32(wel + 4);
}

/* ---- SHA-256 and HMAC-SHA256 vectors ---- */

static void hex(const uint8_t *d, size_t n, char *out) {
    size_t i;
    for (i = 0; i < n; i++) sprintf(out + 2 * i, "%02x", d[i]);
}

static void test_sha256_vectors(void) {
    static const char *msgs[] = {
        "abc", "",
        "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq",
        "abcdefghbcdefghicdefghijdefghijkefghijklfghijklmghijklmnhijklmnoijklmnopjklmnopqklmnopqrlmnopqrsmnopqrstnopqrstu"};
    static const char *want[] = {
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad",
        "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
        "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1",
        "cf5b16a778af8380036ce59e7b0492370b249b11e8f07a51afac45037afee9d1"};
    uint8_t h[32], key[131], data[160];
    char s[65];
    char *million;
    int i;
    for (i = 0; i < 4; i++) {
        dtr__sha256_once(msgs[i], strlen(msgs[i]), h);
        hex(h, 32, s);
        CHECK_MSG(strcmp(s, want[i]) == 0, "SHA-256 of message %d: %s", i, s);
    }
    million = (char *)malloc(1000000);
    memset(million, 'a', 1000000);
    dtr__sha256_once(million, 1000000, h);
    free(million);
    hex(h, 32, s);
    CHECK(strcmp(s, "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0") == 0);

    /* RFC 4231 test cases 1, 2, 3, 4, 6, 7 */
    memset(key, 0x0b, 20);
    dtr__hmac_sha256(key, 20, "Hi There", 8, h);
    hex(h, 32, s);
    CHECK(strcmp(s, "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7") == 0);
    dtr__hmac_sha256("Jefe", 4, "what do ya want for nothing?", 28, h);
    hex(h, 32, s);
    CHECK(strcmp(s, "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843") == 0);
    memset(key, 0xaa, 20);
    memset(data, 0xdd, 50);
    dtr__hmac_sha256(key, 20, data, 50, h);
    hex(h, 32, s);
    CHECK(strcmp(s, "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe") == 0);
    for (i = 0; i < 25; i++) key[i] = (uint8_t)(i + 1);
    memset(data, 0xcd, 50);
    dtr__hmac_sha256(key, 25, data, 50, h);
    hex(h, 32, s);
    CHECK(strcmp(s, "82558a389a443c0ea4cc819899f2083a85f0faa3e578f8077a2e3ff46729665b") == 0);
    memset(key, 0xaa, 131);
    dtr__hmac_sha256(key, 131, "Test Using Larger Than Block-Size Key - Hash Key First", 54, h);
    hex(h, 32, s);
    CHECK(strcmp(s, "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54") == 0);
    {
        const char *m = "This is a test using a larger than block-size key and a larger than block-size data. "
                        "The key needs to be hashed before being used by the HMAC algorithm.";
        dtr__hmac_sha256(key, 131, m, strlen(m), h);
        hex(h, 32, s);
        CHECK(strcmp(s, "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2") == 0);
    }
}

/* ---- the environment ---- */

static const char *all_vars[] = {
    "DTR_RANK", "DTR_WORLD_SIZE", "DTR_LOCAL_RANK", "DTR_LOCAL_WORLD_SIZE", "DTR_MASTER_ADDR", "DTR_MASTER_PORT",
    "DTR_SECRET", "DTR_TIMEOUT_MS", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
    "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "DTR_RESTART", "DTR_JOB_ID", "DTR_GRACE_MS"};

static void clear_env(void) {
    size_t i;
    for (i = 0; i < sizeof all_vars / sizeof all_vars[0]; i++) unsetenv(all_vars[i]);
}

/* from_env on a fresh config; the result code, with the config and message out. */
static dtr_result env_cfg(dtr_rendezvous_config *c, char *err, size_t n) {
    *c = dtr_rendezvous_config_init();
    return dtr_rendezvous_config_from_env(c, err, n);
}

/* One bad value: DTR_INVALID_ARGUMENT and a message naming the variable. */
static void bad_env(const char *var, const char *value, const char *name_in_msg) {
    dtr_rendezvous_config c;
    char err[512];
    dtr_result r;
    clear_env();
    setenv(var, value, 1);
    r = env_cfg(&c, err, sizeof err);
    CHECK_MSG(r == DTR_INVALID_ARGUMENT, "%s='%s' gave %s", var, value, dtr_result_string(r));
    CHECK_MSG(strstr(err, name_in_msg) != NULL, "%s='%s': message '%s' does not name %s", var, value, err, name_in_msg);
}

static void test_env_precedence(void) {
    dtr_rendezvous_config c;
    char err[512], longs[400];
    clear_env();
    CHECK_EQ_INT(env_cfg(&c, err, sizeof err), DTR_OK);
    CHECK_EQ_INT(c.rank, 0);
    CHECK_EQ_INT(c.world_size, 1);
    CHECK_EQ_INT(c.port, 29500);
    CHECK(strcmp(c.master_addr, "127.0.0.1") == 0);
    CHECK_EQ_INT(c.timeout_ms, 300000);

    /* Open MPI alone */
    setenv("OMPI_COMM_WORLD_RANK", "1", 1);
    setenv("OMPI_COMM_WORLD_SIZE", "4", 1);
    setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1", 1);
    setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "2", 1);
    CHECK_EQ_INT(env_cfg(&c, err, sizeof err), DTR_OK);
    CHECK(c.rank == 1 && c.world_size == 4 && c.local_rank == 1 && c.local_world_size == 2);
    /* Slurm beats Open MPI */
    setenv("SLURM_PROCID", "2", 1);
    setenv("SLURM_NTASKS", "5", 1);
    setenv("SLURM_LOCALID", "0", 1);
    CHECK_EQ_INT(env_cfg(&c, err, sizeof err), DTR_OK);
    CHECK(c.rank == 2 && c.world_size == 5 && c.local_rank == 0 && c.local_world_size == 2);
    /* torchrun beats Slurm */
    setenv("RANK", "3", 1);
    setenv("WORLD_SIZE", "6", 1);
    setenv("LOCAL_RANK", "1", 1);
    setenv("LOCAL_WORLD_SIZE", "3", 1);
    setenv("MASTER_ADDR", "node-a", 1);
    setenv("MASTER_PORT", "1234", 1);
    CHECK_EQ_INT(env_cfg(&c, err, sizeof err), DTR_OK);
    CHECK(c.rank == 3 && c.world_size == 6 && c.local_rank == 1 && c.local_world_size == 3);
    CHECK(strcmp(c.master_addr, "node-a") == 0 && c.port == 1234);
    /* DTR_ beats everything */
    setenv("DTR_RANK", "4", 1);
    setenv("DTR_WORLD_SIZE", "7", 1);
    setenv("DTR_LOCAL_RANK", "2", 1);
    setenv("DTR_LOCAL_WORLD_SIZE", "4", 1);
    setenv("DTR_MASTER_ADDR", "[::1]", 1);
    setenv("DTR_MASTER_PORT", "4321", 1);
    setenv("DTR_SECRET", "s3cret", 1);
    setenv("DTR_TIMEOUT_MS", "1500", 1);
    CHECK_EQ_INT(env_cfg(&c, err, sizeof err), DTR_OK);
    CHECK(c.rank == 4 && c.world_size == 7 && c.local_rank == 2 && c.local_world_size == 4);
    CHECK(strcmp(c.master_addr, "[::1]") == 0 && c.port == 4321);
    CHECK(strcmp(c.secret, "s3cret") == 0 && c.timeout_ms == 1500);
    /* an empty variable counts as unset */
    setenv("DTR_RANK", "", 1);
    CHECK_EQ_INT(env_cfg(&c, err, sizeof err), DTR_OK);
    CHECK_EQ_INT(c.rank, 3);
    /* a set variable is never skipped: a bad DTR_RANK is an error even with a good RANK */
    setenv("DTR_RANK", "x", 1);
    CHECK_EQ_INT(env_cfg(&c, err, sizeof err), DTR_INVALID_ARGUMENT);
    CHECK(strstr(err, "DTR_RANK") != NULL && strstr(err, "'x'") != NULL);
    /* fields without a variable keep the caller's values */
    clear_env();
    c = dtr_rendezvous_config_init();
    c.rank = 2;
    c.world_size = 3;
    snprintf(c.secret, sizeof c.secret, "mine");
    CHECK_EQ_INT(dtr_rendezvous_config_from_env(&c, err, sizeof err), DTR_OK);
    CHECK(c.rank == 2 && c.world_size == 3 && strcmp(c.secret, "mine") == 0);

    /* parse errors */
    bad_env("DTR_RANK", "abc", "DTR_RANK");
    bad_env("RANK", "-1", "RANK");
    bad_env("RANK", "1 ", "RANK");
    bad_env("RANK", "+1", "RANK");
    bad_env("SLURM_PROCID", "99999999999", "SLURM_PROCID");
    bad_env("WORLD_SIZE", "0", "WORLD_SIZE");
    bad_env("OMPI_COMM_WORLD_SIZE", "4x", "OMPI_COMM_WORLD_SIZE");
    bad_env("DTR_MASTER_PORT", "70000", "DTR_MASTER_PORT");
    bad_env("MASTER_PORT", "0", "MASTER_PORT");
    bad_env("DTR_TIMEOUT_MS", "soon", "DTR_TIMEOUT_MS");
    memset(longs, 'k', sizeof longs - 1);
    longs[sizeof longs - 1] = '\0';
    bad_env("DTR_SECRET", longs, "DTR_SECRET");
    bad_env("MASTER_ADDR", longs, "MASTER_ADDR");
    /* a rank not below the world size names both sources */
    clear_env();
    setenv("DTR_RANK", "5", 1);
    setenv("WORLD_SIZE", "5", 1);
    CHECK_EQ_INT(env_cfg(&c, err, sizeof err), DTR_INVALID_ARGUMENT);
    CHECK_MSG(strstr(err, "DTR_RANK") && strstr(err, "WORLD_SIZE"), "%s", err);
    clear_env();
    setenv("LOCAL_RANK", "2", 1);
    setenv("LOCAL_WORLD_SIZE", "2", 1);
    CHECK_EQ_INT(env_cfg(&c, err, sizeof err), DTR_INVALID_ARGUMENT);
    CHECK_MSG(strstr(err, "LOCAL_RANK") != NULL, "%s", err);
    CHECK_EQ_INT(dtr_rendezvous_config_from_env(NULL, err, sizeof err), DTR_NULL_HANDLE);
    clear_env();
}

/* ---- one process ---- */

static void test_single_process(void) {
    dtr_rendezvous_config c = cfg_for(0, 1, 0, "secret", 400);
    dtr_store *st = NULL;
    char err[512], buf[64], key[300];
    size_t len = 0;
    int found = -1, i;
    int64_t v = 0, t0;
    uint8_t *big;
    dtr_result r;

    c.max_keys = 8;
    r = dtr_store_create(&c, &st, err, sizeof err);
    CHECK_MSG(r == DTR_OK, "%s", err);
    if (r != DTR_OK) return;
    CHECK(dtr_store_port(st) > 0);
    CHECK_EQ_INT(dtr_store_rank(st), 0);
    CHECK_EQ_INT(dtr_store_world_size(st), 1);

    CHECK_ST(st, dtr_store_set(st, "a", "hello", 5));
    CHECK_ST(st, dtr_store_get(st, "a", buf, sizeof buf, &len));
    CHECK(len == 5 && memcmp(buf, "hello", 5) == 0);
    CHECK_ST(st, dtr_store_set(st, "a", "bye", 3));   /* replace */
    CHECK_ST(st, dtr_store_get(st, "a", buf, sizeof buf, &len));
    CHECK(len == 3 && memcmp(buf, "bye", 3) == 0);
    CHECK_ST(st, dtr_store_set(st, "empty", NULL, 0));
    CHECK_ST(st, dtr_store_get(st, "empty", NULL, 0, &len));
    CHECK_EQ_INT(len, 0);
    CHECK_ST(st, dtr_store_check(st, "nope", buf, sizeof buf, &len, &found));
    CHECK_EQ_INT(found, 0);
    CHECK_ST(st, dtr_store_check(st, "a", buf, sizeof buf, &len, &found));
    CHECK(found == 1 && len == 3);
    /* a buffer too small: the length comes back and the call can be repeated */
    CHECK_EQ_INT(dtr_store_get(st, "a", buf, 2, &len), DTR_INVALID_ARGUMENT);
    CHECK_EQ_INT(len, 3);
    CHECK_ST(st, dtr_store_get(st, "a", buf, 3, &len));

    /* counters */
    CHECK_ST(st, dtr_store_add(st, "n", 5, &v));
    CHECK_EQ_INT(v, 5);
    CHECK_ST(st, dtr_store_add(st, "n", -7, &v));
    CHECK_EQ_INT(v, -2);
    CHECK_ST(st, dtr_store_get(st, "n", buf, sizeof buf, &len));
    CHECK(len == 2 && memcmp(buf, "-2", 2) == 0);
    CHECK_EQ_INT(dtr_store_add(st, "a", 1, &v), DTR_INVALID_ARGUMENT);   /* "bye" is no number */
    CHECK_ST(st, dtr_store_set(st, "big", "9223372036854775807", 19));
    CHECK_EQ_INT(dtr_store_add(st, "big", 1, &v), DTR_INVALID_ARGUMENT);   /* overflow */
    CHECK_ST(st, dtr_store_add(st, "big", -1, &v));
    CHECK(v == INT64_MAX - 1);
    CHECK_ST(st, dtr_store_delete(st, "big"));
    CHECK_ST(st, dtr_store_delete(st, "big"));   /* deleting nothing is fine */
    CHECK_ST(st, dtr_store_check(st, "big", NULL, 0, &len, &found));
    CHECK_EQ_INT(found, 0);

    /* a missing key: DTR_TIMEOUT within the deadline, the message names rank, op and key */
    t0 = now_ms();
    r = dtr_store_get(st, "missing/key", buf, sizeof buf, &len);
    CHECK_EQ_INT(r, DTR_TIMEOUT);
    CHECK(now_ms() - t0 >= 350 && now_ms() - t0 < 1500);
    CHECK_MSG(strstr(dtr_store_last_error(st), "missing/key") && strstr(dtr_store_last_error(st), "get") &&
              strstr(dtr_store_last_error(st), "rank 0"), "%s", dtr_store_last_error(st));
    CHECK(log_has("missing/key"));   /* errors reach the log callback too */
    CHECK_ST(st, dtr_store_set(st, "missing/key", "now", 3));   /* the connection still works */
    CHECK_ST(st, dtr_store_get(st, "missing/key", buf, sizeof buf, &len));
    CHECK(len == 3);

    /* bad arguments */
    memset(key, 'k', sizeof key - 1);
    key[sizeof key - 1] = '\0';
    key[DTR_STORE_MAX_KEY] = '\0';
    CHECK_ST(st, dtr_store_set(st, key, "x", 1));   /* the longest key */
    key[DTR_STORE_MAX_KEY] = 'k';
    key[DTR_STORE_MAX_KEY + 1] = '\0';
    CHECK_EQ_INT(dtr_store_set(st, key, "x", 1), DTR_INVALID_ARGUMENT);
    CHECK_EQ_INT(dtr_store_set(st, "", "x", 1), DTR_INVALID_ARGUMENT);
    CHECK_EQ_INT(dtr_store_set(st, NULL, "x", 1), DTR_NULL_HANDLE);
    CHECK_EQ_INT(dtr_store_set(st, "v", NULL, 1), DTR_INVALID_ARGUMENT);
    CHECK_EQ_INT(dtr_store_set(NULL, "v", "x", 1), DTR_NULL_HANDLE);
    big = (uint8_t *)malloc(DTR_STORE_MAX_VALUE + 1);
    for (i = 0; i < (int)DTR_STORE_MAX_VALUE + 1; i++) big[i] = (uint8_t)(i * 7);
    CHECK_EQ_INT(dtr_store_set(st, "huge", big, DTR_STORE_MAX_VALUE + 1), DTR_INVALID_ARGUMENT);
    CHECK_ST(st, dtr_store_set(st, "huge", big, DTR_STORE_MAX_VALUE));   /* the largest value */
    memset(big, 0, DTR_STORE_MAX_VALUE);
    CHECK_ST(st, dtr_store_get(st, "huge", big, DTR_STORE_MAX_VALUE, &len));
    CHECK(len == DTR_STORE_MAX_VALUE && big[12345] == (uint8_t)(12345 * 7));
    free(big);

    /* max_keys = 8: a, empty, n, missing/key, kkk..., huge = 6 keys; two more fit, then full */
    CHECK_ST(st, dtr_store_set(st, "k7", "x", 1));
    CHECK_ST(st, dtr_store_set(st, "k8", "x", 1));
    CHECK_EQ_INT(dtr_store_set(st, "k9", "x", 1), DTR_OUT_OF_MEMORY);
    CHECK(strstr(dtr_store_last_error(st), "full") != NULL);
    CHECK_ST(st, dtr_store_set(st, "k8", "y", 1));   /* replacing still works */
    CHECK_ST(st, dtr_store_delete(st, "k8"));
    CHECK_ST(st, dtr_store_delete(st, "k7"));
    /* barriers clean up after themselves: many of them fit in the two free keys */
    for (i = 0; i < 20; i++) CHECK_ST(st, dtr_store_barrier(st, "loop"));
    dtr_store_destroy(st);
    dtr_store_destroy(NULL);
}

/* A zeroed configuration is a one-process store on 127.0.0.1 once it has a secret. */
static void test_zero_config(void) {
    dtr_rendezvous_config c;
    dtr_store *st = NULL;
    char err[512];
    memset(&c, 0, sizeof c);
    snprintf(c.secret, sizeof c.secret, "z");
    CHECK_EQ_INT(dtr_store_create(&c, &st, err, sizeof err), DTR_OK);
    CHECK_EQ_INT(dtr_store_world_size(st), 1);
    CHECK_ST(st, dtr_store_barrier(st, NULL));
    dtr_store_destroy(st);
}

static void free_cb(void *p, void *user) {
    (void)user;
    free(p);
}

static void test_bad_config(void) {
    dtr_rendezvous_config c = cfg_for(0, 2, 29999, "", 300);
    dtr_store *st = (dtr_store *)&c;
    char err[512];
    int port = free_port(), lfd;
    struct sockaddr_in a;
    CHECK_EQ_INT(dtr_store_create(&c, &st, err, sizeof err), DTR_INVALID_ARGUMENT);   /* no secret */
    CHECK(st == NULL && strstr(err, "DTR_SECRET") != NULL);
    snprintf(c.secret, sizeof c.secret, "s");
    c.rank = 2;
    CHECK_EQ_INT(dtr_store_create(&c, &st, err, sizeof err), DTR_INVALID_ARGUMENT);   /* rank >= world */
    c.rank = 1;
    c.port = 0;
    CHECK_EQ_INT(dtr_store_create(&c, &st, err, sizeof err), DTR_INVALID_ARGUMENT);   /* port 0, world 2 */
    CHECK_EQ_INT(dtr_store_create(NULL, &st, err, sizeof err), DTR_NULL_HANDLE);
    c.alloc.malloc_fn = NULL;
    c.alloc.free_fn = free_cb;
    c.port = 1;
    CHECK_EQ_INT(dtr_store_create(&c, &st, err, sizeof err), DTR_INVALID_ARGUMENT);   /* half the callbacks */
    /* rank 0 on a port that another socket listens on */
    lfd = socket(AF_INET, SOCK_STREAM, 0);
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_port = htons((uint16_t)port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    CHECK(bind(lfd, (struct sockaddr *)&a, sizeof a) == 0 && listen(lfd, 4) == 0);
    c = cfg_for(0, 2, port, "s", 300);
    CHECK_EQ_INT(dtr_store_create(&c, &st, err, sizeof err), DTR_IO_ERROR);
    CHECK_MSG(strstr(err, "in use") != NULL, "%s", err);
    close(lfd);
    /* an address that does not resolve */
    c = cfg_for(1, 2, port, "s", 300);
    snprintf(c.master_addr, sizeof c.master_addr, "no-such-host.invalid");
    {   /* DTR_TIMEOUT where the resolver says "try again" (no DNS in a sandbox) */
        dtr_result r = dtr_store_create(&c, &st, err, sizeof err);
        CHECK_MSG(r == DTR_IO_ERROR || r == DTR_TIMEOUT, "%s", dtr_result_string(r));
    }
    CHECK_MSG(strstr(err, "no-such-host.invalid") != NULL, "%s", err);
}

/* No server at all: DTR_TIMEOUT within the deadline, naming the address. */
static void test_no_server(void) {
    int port = free_port();
    dtr_rendezvous_config c = cfg_for(1, 2, port, "s", 700);
    dtr_store *st = NULL;
    char err[512];
    int64_t t0 = now_ms();
    CHECK_EQ_INT(dtr_store_create(&c, &st, err, sizeof err), DTR_TIMEOUT);
    CHECK(now_ms() - t0 >= 650 && now_ms() - t0 < 2000);
    CHECK_MSG(strstr(err, "could not join") && strstr(err, "rank 1") && strstr(err, "127.0.0.1"), "%s", err);
}

/* ---- several processes ---- */

typedef struct mp_arg {
    int port, world, timeout_ms;
    const char *secret;
    int delay_ms;       /* before joining */
    int fd, fd2;        /* pipes or sockets between processes (-1: none) */
    const struct server_fault_case *fault;   /* the server-fault case being run, or NULL */
} mp_arg;

static int kv_child(int rank, void *p) {
    mp_arg *a = (mp_arg *)p;
    dtr_rendezvous_config c = cfg_for(rank, a->world, a->port, a->secret, a->timeout_ms);
    dtr_store *st = NULL;
    char err[512], key[32], val[64], buf[64];
    size_t len;
    int q, found;
    int64_t v = 0;
    if (a->delay_ms) sleep_ms(a->delay_ms);
    CC_MSG(dtr_store_create(&c, &st, err, sizeof err) == DTR_OK, "%s", err);
    snprintf(key, sizeof key, "addr/%d", rank);
    snprintf(val, sizeof val, "endpoint of rank %d", rank);
    CC_OK(st, dtr_store_set(st, key, val, strlen(val)));
    for (q = 0; q < a->world; q++) {
        snprintf(key, sizeof key, "addr/%d", q);
        snprintf(val, sizeof val, "endpoint of rank %d", q);
        CC_OK(st, dtr_store_get(st, key, buf, sizeof buf, &len));
        CC(len == strlen(val) && memcmp(buf, val, len) == 0);
    }
    CC_OK(st, dtr_store_add(st, "count", 1, &v));
    CC(v >= 1 && v <= a->world);
    snprintf(key, sizeof key, "ticket/%lld", (long long)v);
    CC_OK(st, dtr_store_set(st, key, "", 0));
    CC_OK(st, dtr_store_barrier(st, "kv"));
    CC_OK(st, dtr_store_get(st, "count", buf, sizeof buf, &len));
    snprintf(val, sizeof val, "%d", a->world);
    CC(len == strlen(val) && memcmp(buf, val, len) == 0);
    for (q = 1; q <= a->world; q++) {   /* every rank got a different ticket */
        snprintf(key, sizeof key, "ticket/%d", q);
        CC_OK(st, dtr_store_check(st, key, NULL, 0, &len, &found));
        CC(found == 1);
    }
    CC_OK(st, dtr_store_barrier(st, "end"));
    dtr_store_destroy(st);
    return 0;
}

static void run_ranks(child_fn fn, mp_arg *a, int timeout_ms) {
    pid_t pids[8];
    int r;
    for (r = 0; r < a->world; r++) pids[r] = spawn(fn, r, a);
    for (r = 0; r < a->world; r++) CHECK_MSG(reap(pids[r], timeout_ms) == 0, "rank %d failed", r);
}

static void test_four_processes(void) {
    mp_arg a = {0, 4, 5000, "four", 0, -1, -1, NULL};
    a.port = free_port();
    run_ranks(kv_child, &a, 10000);
}

/* Ranks start in any order: rank 0 joins last, 400 ms late; the others retry until it is up. */
static int late_child(int rank, void *p) {
    mp_arg b = *(mp_arg *)p;
    if (rank == 0) b.delay_ms = 400;
    return kv_child(rank, &b);
}

static void test_late_server(void) {
    mp_arg a = {0, 3, 5000, "late", 0, -1, -1, NULL};
    a.port = free_port();
    run_ranks(late_child, &a, 10000);
}

/* Nobody leaves a barrier before the last rank arrives. */
static int barrier_child(int rank, void *p) {
    mp_arg *a = (mp_arg *)p;
    dtr_rendezvous_config c = cfg_for(rank, a->world, a->port, a->secret, a->timeout_ms);
    dtr_store *st = NULL;
    char err[512], key[32];
    int found = 0, i;
    size_t len;
    CC_MSG(dtr_store_create(&c, &st, err, sizeof err) == DTR_OK, "%s", err);
    for (i = 0; i < 5; i++) {
        snprintf(key, sizeof key, "late/%d", i);
        if (rank == (i % a->world)) {
            sleep_ms(150);
            CC_OK(st, dtr_store_set(st, key, "", 0));
        }
        CC_OK(st, dtr_store_barrier(st, "step"));
        CC_OK(st, dtr_store_check(st, key, NULL, 0, &len, &found));
        CC_MSG(found == 1, "barrier %d: rank %d passed before the late rank arrived", i, rank);
    }
    dtr_store_destroy(st);
    return 0;
}

static void test_barrier(void) {
    mp_arg a = {0, 3, 5000, "barrier", 0, -1, -1, NULL};
    a.port = free_port();
    run_ranks(barrier_child, &a, 10000);
}

/* A barrier that one rank never reaches: DTR_TIMEOUT naming how many arrived. */
static int barrier_timeout_child(int rank, void *p) {
    mp_arg *a = (mp_arg *)p;
    dtr_rendezvous_config c = cfg_for(rank, a->world, a->port, a->secret, rank == 2 ? 5000 : 800);
    dtr_store *st = NULL;
    char err[512];
    int64_t t0;
    dtr_result r;
    CC_MSG(dtr_store_create(&c, &st, err, sizeof err) == DTR_OK, "%s", err);
    if (rank == 2) {   /* absent: waits for the others to give up, then leaves */
        CC_OK(st, dtr_store_get(st, "gave-up/0", NULL, 0, NULL));
        CC_OK(st, dtr_store_get(st, "gave-up/1", NULL, 0, NULL));
        dtr_store_destroy(st);
        return 0;
    }
    t0 = now_ms();
    r = dtr_store_barrier(st, "sync");
    CC(r == DTR_TIMEOUT);
    CC(now_ms() - t0 < 2000);
    CC_MSG(strstr(dtr_store_last_error(st), "2 of 3 ranks arrived") && strstr(dtr_store_last_error(st), "'sync'"),
           "%s", dtr_store_last_error(st));
    CC_OK(st, dtr_store_set(st, rank == 0 ? "gave-up/0" : "gave-up/1", "", 0));
    dtr_store_destroy(st);
    return 0;
}

static void test_barrier_timeout(void) {
    mp_arg a = {0, 3, 0, "bt", 0, -1, -1, NULL};
    a.port = free_port();
    run_ranks(barrier_timeout_child, &a, 10000);
}

/* ---- faults ---- */

/* Rank 0 of the fault cases: serves until rank 1 sets "done", then checks that its log
 * has each expected reason. */
typedef struct fault_arg {
    int port, timeout_ms;
    const char *expect_log;   /* ';'-separated substrings rank 0's log must contain */
} fault_arg;

static int fault_rank0(int rank, void *p) {
    fault_arg *a = (fault_arg *)p;
    dtr_rendezvous_config c = cfg_for(rank, 2, a->port, "right", a->timeout_ms);
    dtr_store *st = NULL;
    char err[512], want[256], *tok, *save = NULL;
    CC_MSG(dtr_store_create(&c, &st, err, sizeof err) == DTR_OK, "%s", err);
    CC_OK(st, dtr_store_get(st, "done", NULL, 0, NULL));
    snprintf(want, sizeof want, "%s", a->expect_log ? a->expect_log : "");
    for (tok = strtok_r(want, ";", &save); tok; tok = strtok_r(NULL, ";", &save))
        CC_MSG(log_has(tok), "rank 0's log lacks '%s'; log:\n%s", tok, logbuf);
    CC_OK(st, dtr_store_barrier(st, "end"));
    dtr_store_destroy(st);
    return 0;
}

static int fault_rank1(int rank, void *p) {
    fault_arg *a = (fault_arg *)p;
    dtr_rendezvous_config c = cfg_for(rank, 2, a->port, "right", a->timeout_ms);
    dtr_store *st = NULL;
    char err[512], buf[8];
    size_t len;
    int64_t t0 = now_ms();
    CC_MSG(dtr_store_create(&c, &st, err, sizeof err) == DTR_OK, "%s", err);
    CC_OK(st, dtr_store_set(st, "x", "1", 1));
    CC_OK(st, dtr_store_get(st, "x", buf, sizeof buf, &len));
    CC_OK(st, dtr_store_set(st, "done", "", 0));
    CC_OK(st, dtr_store_barrier(st, "end"));
    CC_MSG(now_ms() - t0 < 1000, "the good rank took %lld ms", (long long)(now_ms() - t0));
    dtr_store_destroy(st);
    return 0;
}

/* The wrong secret: refused at once with DTR_INVALID_ARGUMENT; rank 1 with the right one works. */
static int intruder(int rank, void *p) {
    fault_arg *a = (fault_arg *)p;
    dtr_rendezvous_config c = cfg_for(rank, 2, a->port, "wrong", 3000);
    dtr_store *st = NULL;
    char err[512];
    int64_t t0 = now_ms();
    dtr_result r = dtr_store_create(&c, &st, err, sizeof err);
    CC_MSG(r == DTR_INVALID_ARGUMENT, "got %s: %s", dtr_result_string(r), err);
    CC(st == NULL);
    CC_MSG(strstr(err, "secret") && strstr(err, "rank 1"), "%s", err);
    CC_MSG(now_ms() - t0 < 1500, "refusal took %lld ms", (long long)(now_ms() - t0));
    return 0;
}

/* The right secret but another world size (a rank launched with the wrong WORLD_SIZE). */
static int other_world(int rank, void *p) {
    fault_arg *a = (fault_arg *)p;
    dtr_rendezvous_config c = cfg_for(rank, 3, a->port, "right", 3000);
    dtr_store *st = NULL;
    char err[512];
    dtr_result r = dtr_store_create(&c, &st, err, sizeof err);
    CC_MSG(r == DTR_INVALID_ARGUMENT, "got %s: %s", dtr_result_string(r), err);
    CC_MSG(strstr(err, "world") != NULL, "%s", err);
    return 0;
}


/* Garbage on the port, before and after a valid handshake. */
static int garbage(int rank, void *p) {
    fault_arg *a = (fault_arg *)p;
    uint8_t junk[4096], hdr[12], reply[16];
    int fd, i;
    (void)rank;
    for (i = 0; i < (int)sizeof junk; i++) junk[i] = (uint8_t)(i * 131 + 7);
    /* 1. random bytes instead of the join message: a refusal (wrong secret), then EOF */
    fd = raw_connect(a->port, 3000);
    CC(fd >= 0);
    {
        uint8_t hello[40], wel[44];
        CC(raw_read(fd, hello, 40, 2000) == 40 && memcmp(hello, "DTRZ", 4) == 0);
        raw_send(fd, junk, 100);
        CC(raw_read(fd, wel, 44, 2000) == 44 && memcmp(wel, "DTRW", 4) == 0 && get32(wel + 4) == 1);
        CC(raw_wait_eof(fd, 2000));
    }
    close(fd);
    /* 2. a flood of 4 KiB without reading anything: closed after the first 100 bytes */
    fd = raw_connect(a->port, 3000);
    CC(fd >= 0);
    raw_send(fd, junk, sizeof junk);
    CC(raw_wait_eof(fd, 2000));
    close(fd);
    /* 3. a short HTTP request, then our end closes: dropped, logged as an incomplete join */
    fd = raw_connect(a->port, 3000);
    CC(fd >= 0);
    raw_send(fd, "GET / HTTP/1.0\r\n\r\n", 18);
    shutdown(fd, SHUT_WR);
    CC(raw_wait_eof(fd, 2000));
    close(fd);
    /* 4. after a valid handshake (the documented wire format): a good request works ... */
    fd = raw_connect(a->port, 3000);
    CC(fd >= 0);
    CC(raw_handshake(fd, "right", 1, 2) == 0);
    memset(hdr, 0, sizeof hdr);
    hdr[0] = 1;                 /* set */
    hdr[3] = 3;                 /* key length 3 */
    put32(hdr + 4, 2);          /* value length 2 */
    put32(hdr + 8, 77);         /* id */
    raw_send(fd, hdr, 12);
    raw_send(fd, "rawhi", 5);
    CC(raw_read(fd, reply, 12, 2000) == 12 && reply[0] == 0 && get32(reply + 4) == 0 && get32(reply + 8) == 77);
    hdr[0] = 2;                 /* get "raw" */
    put32(hdr + 4, 0);
    put32(hdr + 8, 78);
    raw_send(fd, hdr, 12);
    raw_send(fd, "raw", 3);
    CC(raw_read(fd, reply, 14, 2000) == 14 && reply[0] == 0 && get32(reply + 4) == 2 && get32(reply + 8) == 78 &&
       memcmp(reply + 12, "hi", 2) == 0);
    /* ... and oversize length fields close the connection at once */
    hdr[0] = 1;
    hdr[2] = 0xff;
    hdr[3] = 0xff;
    put32(hdr + 4, 0xffffffffu);
    raw_send(fd, hdr, 12);
    CC(raw_wait_eof(fd, 2000));
    close(fd);
    /* 5. a value one byte over the limit */
    fd = raw_connect(a->port, 3000);
    CC(fd >= 0);
    CC(raw_handshake(fd, "right", 1, 2) == 0);
    memset(hdr, 0, sizeof hdr);
    hdr[0] = 1;
    hdr[3] = 1;
    put32(hdr + 4, DTR_STORE_MAX_VALUE + 1);
    raw_send(fd, hdr, 12);
    CC(raw_wait_eof(fd, 2000));
    close(fd);
    /* 6. an unknown op, then a rank outside the world */
    fd = raw_connect(a->port, 3000);
    CC(fd >= 0);
    CC(raw_handshake(fd, "right", 0, 2) == 0);
    memset(hdr, 0, sizeof hdr);
    hdr[0] = 0x7f;
    hdr[3] = 1;
    raw_send(fd, hdr, 12);
    CC(raw_wait_eof(fd, 2000));
    close(fd);
    fd = raw_connect(a->port, 3000);
    CC(fd >= 0);
    CC(raw_handshake(fd, "right", 9, 2) == 2);
    CC(raw_wait_eof(fd, 2000));
    close(fd);
    fd = raw_connect(a->port, 3000);   /* another world size */
    CC(fd >= 0);
    CC(raw_handshake(fd, "right", 1, 3) == 2);
    CC(raw_wait_eof(fd, 2000));
    close(fd);
    return 0;
}

/* ---- the intruder scenarios: one table, one runner ----
 * Rank 0 of a 2-rank job starts its server; each intruder process of the case connects,
 * misbehaves and checks what it gets back (in its own process); then the real rank 1 joins
 * and the job finishes normally. Rank 0's log must contain every fragment of expect_log. */
typedef struct intruder_case {
    const char *name;
    const char *expect_log;                      /* ';'-separated fragments of rank 0's log */
    int (*intruders[3])(int rank, void *arg);    /* run one after the other; NULL ends */
    int intruder_ms;                             /* deadline of each intruder process */
} intruder_case;

static const intruder_case INTRUDERS[] = {
    {"wrong secret, then another world size", "refused 127.0.0.1;wrong secret;joins a world of 3 ranks; this job has 2",
     {intruder, other_world, NULL}, 5000},
    {"garbage before and after a valid handshake",
     "wrong secret;malformed request: key length 65535;value length 1048577;unknown op 127;"
     "rank 9 is not below;joins a world of 3 ranks;incomplete join message",
     {garbage, NULL, NULL}, 10000},
};

static void run_intruder_case(const intruder_case *ic) {
    fault_arg a = {0, 5000, NULL};
    pid_t p0, p1;
    int k;
    a.port = free_port();
    a.expect_log = ic->expect_log;
    p0 = spawn(fault_rank0, 0, &a);
    for (k = 0; k < 3 && ic->intruders[k]; k++)
        CHECK_MSG(reap(spawn(ic->intruders[k], 1, &a), ic->intruder_ms) == 0, "%s: intruder %d", ic->name, k);
    p1 = spawn(fault_rank1, 1, &a);
    CHECK_MSG(reap(p1, 8000) == 0, "%s: rank 1", ic->name);
    CHECK_MSG(reap(p0, 8000) == 0, "%s: rank 0", ic->name);
}

static void test_intruders(void) {
    size_t i;
    for (i = 0; i < sizeof INTRUDERS / sizeof INTRUDERS[0]; i++) run_intruder_case(&INTRUDERS[i]);
}

/* A joiner that connects and says nothing: the others go on at full speed; the server drops
 * it when the deadline passes. */
static int silent(int rank, void *p) {
    mp_arg *a = (mp_arg *)p;
    uint8_t hello[40];
    int64_t t0;
    int fd = raw_connect(a->port, 3000);
    char one = 1;
    (void)rank;
    CC(fd >= 0);
    t0 = now_ms();
    if (write(a->fd, &one, 1) != 1) return 1;   /* tell the parent: connected */
    CC(raw_read(fd, hello, 40, 2000) == 40);
    CC(raw_wait_eof(fd, 4000));
    CC_MSG(now_ms() - t0 >= a->timeout_ms - 200, "dropped after %lld ms", (long long)(now_ms() - t0));
    close(fd);
    return 0;
}

static int silent_rank(int rank, void *p) {
    mp_arg *a = (mp_arg *)p;
    dtr_rendezvous_config c = cfg_for(rank, 3, a->port, a->secret, a->timeout_ms);
    dtr_store *st = NULL;
    char err[512];
    int64_t t0 = now_ms();
    size_t len;
    char buf[8];
    if (rank != 0) sleep_ms(200);   /* join after the silent peer */
    CC_MSG(dtr_store_create(&c, &st, err, sizeof err) == DTR_OK, "%s", err);
    CC_OK(st, dtr_store_set(st, rank == 1 ? "one" : "zero", "x", 1));
    if (rank == 0) {
        CC_OK(st, dtr_store_get(st, "one", buf, sizeof buf, &len));
        CC_OK(st, dtr_store_get(st, "two", buf, sizeof buf, &len));
    }
    if (rank == 2) CC_OK(st, dtr_store_set(st, "two", "x", 1));
    CC_OK(st, dtr_store_barrier(st, NULL));
    if (rank != 0) CC_MSG(now_ms() - t0 < 800, "took %lld ms", (long long)(now_ms() - t0));
    CC_OK(st, dtr_store_barrier(st, NULL));
    sleep_ms(a->timeout_ms + 300);   /* meanwhile rank 0 drops the silent peer */
    if (rank == 0) CC_MSG(log_has("no valid join message"), "log:\n%s", logbuf);
    CC_OK(st, dtr_store_barrier(st, NULL));
    dtr_store_destroy(st);
    return 0;
}

static void test_silent_joiner(void) {
    mp_arg a = {0, 3, 1500, "silence", 0, -1, -1, NULL};
    int pfd[2];
    pid_t p0, ps, p1, p2;
    char b;
    a.port = free_port();
    CHECK(pipe(pfd) == 0);
    a.fd = pfd[1];
    a.timeout_ms = 1500;
    p0 = spawn(silent_rank, 0, &a);
    ps = spawn(silent, 9, &a);
    CHECK(read(pfd[0], &b, 1) == 1);
    p1 = spawn(silent_rank, 1, &a);
    p2 = spawn(silent_rank, 2, &a);
    CHECK_EQ_INT(reap(p1, 8000), 0);
    CHECK_EQ_INT(reap(p2, 8000), 0);
    CHECK_EQ_INT(reap(p0, 8000), 0);
    CHECK_EQ_INT(reap(ps, 8000), 0);
    close(pfd[0]);
    close(pfd[1]);
}

/* ---- the server faults: one table, one runner ----
 * The server (rank 0) dies or hangs while rank 1 waits on a key that never comes: rank 1's
 * get ends with `want` within [min_ms, max_ms) (its timeout is 1000 ms) and names both ranks,
 * the key and the call. */
typedef struct server_fault_case {
    const char *name;
    int sig;             /* what the parent sends the server */
    dtr_result want;     /* the pending get's result */
    int min_ms, max_ms;  /* how long the get takes */
    int stays_failed;    /* later calls answer at once with `want` */
} server_fault_case;

static const server_fault_case SERVER_FAULTS[] = {
    {"server killed (SIGKILL)", SIGKILL, DTR_PEER_FAILED, 0, 500, 1},
    {"server hung (SIGSTOP)", SIGSTOP, DTR_TIMEOUT, 900, 2000, 0},
};

static int idle_server(int rank, void *p) {
    mp_arg *a = (mp_arg *)p;
    dtr_rendezvous_config c = cfg_for(rank, 2, a->port, a->secret, 20000);
    dtr_store *st = NULL;
    char err[512];
    CC_MSG(dtr_store_create(&c, &st, err, sizeof err) == DTR_OK, "%s", err);
    sleep_ms(15000);   /* killed long before */
    dtr_store_destroy(st);
    return 0;
}

static int victim(int rank, void *p) {
    mp_arg *a = (mp_arg *)p;
    const server_fault_case *fc = a->fault;
    dtr_rendezvous_config c = cfg_for(rank, 2, a->port, a->secret, a->timeout_ms);
    dtr_store *st = NULL;
    char err[512], one = 1;
    int64_t t0;
    dtr_result r;
    CC_MSG(dtr_store_create(&c, &st, err, sizeof err) == DTR_OK, "%s", err);
    CC_OK(st, dtr_store_set(st, "x", "1", 1));
    if (write(a->fd, &one, 1) != 1) return 1;   /* the parent now kills or stops the server */
    sleep_ms(100);
    t0 = now_ms();
    r = dtr_store_get(st, "never", NULL, 0, NULL);
    CC_MSG(r == fc->want, "%s: got %s", fc->name, dtr_result_string(r));
    CC_MSG(now_ms() - t0 >= fc->min_ms && now_ms() - t0 < fc->max_ms, "%s: noticed after %lld ms", fc->name,
           (long long)(now_ms() - t0));
    CC_MSG(strstr(dtr_store_last_error(st), "rank 0") && strstr(dtr_store_last_error(st), "rank 1") &&
           strstr(dtr_store_last_error(st), "'never'") && strstr(dtr_store_last_error(st), "get"),
           "%s", dtr_store_last_error(st));
    if (fc->stays_failed) {
        t0 = now_ms();
        CC(dtr_store_set(st, "y", "1", 1) == fc->want && now_ms() - t0 < 100);
    }
    dtr_store_destroy(st);
    return 0;
}

static void run_server_fault(const server_fault_case *fc) {
    mp_arg a = {0, 2, 1000, "kill", 0, -1, -1, NULL};
    int pfd[2];
    pid_t p0, p1;
    char b;
    a.port = free_port();
    a.fault = fc;
    CHECK(pipe(pfd) == 0);
    a.fd = pfd[1];
    p0 = spawn(idle_server, 0, &a);
    p1 = spawn(victim, 1, &a);
    CHECK(read(pfd[0], &b, 1) == 1);
    kill(p0, fc->sig);
    CHECK_MSG(reap(p1, 5000) == 0, "%s: rank 1", fc->name);
    kill(p0, SIGKILL);
    reap(p0, 5000);
    close(pfd[0]);
    close(pfd[1]);
}

static void test_server_faults(void) {
    size_t i;
    for (i = 0; i < sizeof SERVER_FAULTS / sizeof SERVER_FAULTS[0]; i++) run_server_fault(&SERVER_FAULTS[i]);
}

/* A get that timed out gets its reply later; the next call must not take it for its own. */
static int stale_child(int rank, void *p) {
    mp_arg *a = (mp_arg *)p;
    dtr_rendezvous_config c = cfg_for(rank, 3, a->port, a->secret, rank == 1 ? 400 : 5000);
    dtr_store *st = NULL;
    char err[512], buf[16], b = 1;
    size_t len = 0;
    CC_MSG(dtr_store_create(&c, &st, err, sizeof err) == DTR_OK, "%s", err);
    if (rank == 2) {
        CC_OK(st, dtr_store_set(st, "other", "OTHER", 5));
        CC(read(a->fd2, &b, 1) == 1);    /* rank 1's get has timed out */
        CC_OK(st, dtr_store_set(st, "late", "LATE!!", 6));   /* answers rank 1's expired get */
        CC(write(a->fd2, &b, 1) == 1);
    }
    if (rank == 1) {
        CC_OK(st, dtr_store_get(st, "other", buf, sizeof buf, &len));   /* "other" is there */
        CC(dtr_store_get(st, "late", buf, sizeof buf, &len) == DTR_TIMEOUT);
        CC(write(a->fd, &b, 1) == 1);
        CC(read(a->fd, &b, 1) == 1);    /* "late" is set: the old reply waits on the socket */
        CC_OK(st, dtr_store_get(st, "other", buf, sizeof buf, &len));
        CC_MSG(len == 5 && memcmp(buf, "OTHER", 5) == 0, "got %.*s", (int)len, buf);
        CC_OK(st, dtr_store_get(st, "late", buf, sizeof buf, &len));
        CC(len == 6 && memcmp(buf, "LATE!!", 6) == 0);
    }
    CC_OK(st, dtr_store_set(st, rank == 0 ? "d0" : rank == 1 ? "d1" : "d2", "", 0));
    if (rank == 0) {
        CC_OK(st, dtr_store_get(st, "d1", NULL, 0, NULL));
        CC_OK(st, dtr_store_get(st, "d2", NULL, 0, NULL));
    }
    dtr_store_destroy(st);
    return 0;
}

static void test_stale_reply(void) {
    mp_arg a = {0, 3, 5000, "stale", 0, -1, -1, NULL};
    int sv[2];
    a.port = free_port();
    CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0);
    a.fd = sv[0];    /* rank 1's end */
    a.fd2 = sv[1];   /* rank 2's end */
    run_ranks(stale_child, &a, 8000);
    close(sv[0]);
    close(sv[1]);
}

/* IPv6 loopback and a host name, when the machine has them. */
static void test_ipv6_and_names(void) {
    const char *hosts[] = {"::1", "[::1]", "localhost"};
    int i;
    for (i = 0; i < 3; i++) {
        dtr_rendezvous_config c = cfg_for(0, 1, 0, "v6", 1000);
        dtr_store *st = NULL;
        char err[512];
        dtr_result r;
        snprintf(c.master_addr, sizeof c.master_addr, "%s", hosts[i]);
        r = dtr_store_create(&c, &st, err, sizeof err);
        if (r == DTR_IO_ERROR && i < 2) {   /* no IPv6 on this machine */
            printf("     (IPv6 loopback unavailable: %s)\n", err);
            continue;
        }
        CHECK_MSG(r == DTR_OK, "%s: %s", hosts[i], err);
        if (r != DTR_OK) continue;
        CHECK_ST(st, dtr_store_set(st, "k", "v", 1));
        {
            char v[4];
            size_t len = 0;
            CHECK_ST(st, dtr_store_get(st, "k", v, sizeof v, &len));
            CHECK(len == 1 && v[0] == 'v');
        }
        dtr_store_destroy(st);
    }
}

/* ---- generations and jobs (elastic restarts, two jobs on one port) ---- */

/* Rank 1 with this generation and job joins rank 0's store (generation 1, job "J"): the
 * result, the time it took and the message. */
static dtr_result join_as(int port, int gen, const char *job, int timeout_ms, int64_t *ms, char *err, size_t n) {
    dtr_rendezvous_config c = cfg_for(1, 2, port, "gen-secret", timeout_ms);
    dtr_store *st = NULL;
    int64_t t0 = now_ms();
    dtr_result r;
    c.generation = gen;
    snprintf(c.job_id, sizeof c.job_id, "%s", job);
    r = dtr_store_create(&c, &st, err, n);
    *ms = now_ms() - t0;
    dtr_store_destroy(st);
    return r;
}

/* A rank of generation 0 cannot join the store of generation 1 (refused at once, the message
 * says it is of an old world); a rank of another job is refused at once, the message says
 * another job owns the store; a rank of generation 2 retries (the old store goes away) and
 * times out naming the older store; the environment sets the three fields. */
static void test_generations(void) {
    dtr_rendezvous_config c0;
    dtr_store *s0 = NULL;
    char err[768];
    int64_t ms;
    int port = free_port();
    c0 = cfg_for(0, 2, port, "gen-secret", 5000);
    c0.generation = 1;
    snprintf(c0.job_id, sizeof c0.job_id, "J");
    CHECK_OK(NULL, dtr_store_create(&c0, &s0, err, sizeof err));
    CHECK_EQ_INT(join_as(port, 1, "J", 5000, &ms, err, sizeof err), DTR_OK);
    CHECK_EQ_INT(join_as(port, 0, "J", 5000, &ms, err, sizeof err), DTR_INVALID_ARGUMENT);
    CHECK_MSG(ms < 1000 && strstr(err, "generation 0") && strstr(err, "generation 1") && strstr(err, "old world"),
              "stale rank: %lld ms: %s", (long long)ms, err);
    CHECK_EQ_INT(join_as(port, 1, "K", 5000, &ms, err, sizeof err), DTR_INVALID_ARGUMENT);
    CHECK_MSG(ms < 1000 && strstr(err, "another job owns the store"), "other job: %lld ms: %s", (long long)ms, err);
    CHECK_EQ_INT(join_as(port, 2, "J", 600, &ms, err, sizeof err), DTR_TIMEOUT);
    CHECK_MSG(ms >= 500 && strstr(err, "older world"), "newer rank: %lld ms: %s", (long long)ms, err);
    dtr_store_destroy(s0);
    setenv("DTR_RESTART", "3", 1);
    setenv("DTR_JOB_ID", "job-7", 1);
    setenv("DTR_GRACE_MS", "250", 1);
    CHECK_EQ_INT(env_cfg(&c0, err, sizeof err), DTR_OK);
    CHECK(c0.generation == 3 && !strcmp(c0.job_id, "job-7") && c0.grace_ms == 250);
    bad_env("DTR_RESTART", "-1", "DTR_RESTART");
    clear_env();
}

/* Rank 0's destroy waits for a rank that keeps its connection: timeout_ms normally, only
 * grace_ms once the store is marked failed. */
static int64_t destroy_with_lingering_rank(int failed) {
    dtr_rendezvous_config c0, c1;
    dtr_store *s0 = NULL, *s1 = NULL;
    char err[512];
    int64_t t0;
    int port = free_port();
    c0 = cfg_for(0, 2, port, "grace", 1500);
    c1 = cfg_for(1, 2, port, "grace", 1500);
    c0.grace_ms = 200;
    if (dtr_store_create(&c0, &s0, err, sizeof err) != DTR_OK || dtr_store_create(&c1, &s1, err, sizeof err) != DTR_OK) {
        CHECK_MSG(0, "%s", err);
        return -1;
    }
    if (failed) dtr_store_mark_failed(s0);
    t0 = now_ms();
    dtr_store_destroy(s0);
    t0 = now_ms() - t0;
    dtr_store_destroy(s1);
    return t0;
}

static void test_teardown_grace(void) {
    int64_t normal = destroy_with_lingering_rank(0), failed = destroy_with_lingering_rank(1);
    CHECK_MSG(normal >= 1400, "destroy returned after %lld ms; the deadline is 1500", (long long)normal);
    CHECK_MSG(failed >= 150 && failed < 800, "destroy after a failure took %lld ms; the grace is 200", (long long)failed);
}

/* A get waiting on another thread for a key nobody sets (deadline 5 s) ends with DTR_TIMEOUT
 * within the grace (300 ms) of dtr__store_cut, and a later call waits no more than what is
 * left of it (nothing). */
typedef struct cut_arg { dtr_store *st; dtr_result r; int64_t end; } cut_arg;

static void *cut_waiter(void *p) {
    cut_arg *a = (cut_arg *)p;
    char v[8];
    size_t len;
    a->r = dtr_store_get(a->st, "never-set", v, sizeof v, &len);
    a->end = now_ms();
    return NULL;
}

static void test_teardown_cut(void) {
    dtr_rendezvous_config c0, c1;
    dtr_store *s0 = NULL, *s1 = NULL;
    char err[512], v[8];
    size_t len;
    cut_arg a;
    pthread_t t;
    int64_t t0, t1;
    int port = free_port();
    c0 = cfg_for(0, 2, port, "cut", 5000);
    c1 = cfg_for(1, 2, port, "cut", 5000);
    c1.grace_ms = 300;
    if (dtr_store_create(&c0, &s0, err, sizeof err) != DTR_OK || dtr_store_create(&c1, &s1, err, sizeof err) != DTR_OK) {
        CHECK_MSG(0, "%s", err);
        return;
    }
    a.st = s1;
    pthread_create(&t, NULL, cut_waiter, &a);
    sleep_ms(200);
    t0 = now_ms();
    dtr__store_cut(s1);
    pthread_join(t, NULL);
    CHECK_MSG(a.r == DTR_TIMEOUT && a.end - t0 >= 250 && a.end - t0 < 1000, "the waiting get: %s after %lld ms (grace 300)",
              dtr_result_string(a.r), (long long)(a.end - t0));
    t1 = now_ms();
    CHECK_EQ_INT(dtr_store_get(s1, "never-set", v, sizeof v, &len), DTR_TIMEOUT);
    CHECK_MSG(now_ms() - t1 < 300, "a get after the cut waited %lld ms", (long long)(now_ms() - t1));
    dtr_store_mark_failed(s0);
    dtr_store_destroy(s1);
    dtr_store_destroy(s0);
}

int main(void) {
    (void)test_ctx;   /* tests/test.h's helper; no context here */
    signal(SIGPIPE, SIG_IGN);
    alarm(60);   /* the whole program; each case is far shorter */
    clear_env();
    RUN(test_sha256_vectors);
    RUN(test_env_precedence);
    RUN(test_single_process);
    RUN(test_zero_config);
    RUN(test_bad_config);
    RUN(test_no_server);
    RUN(test_ipv6_and_names);
    RUN(test_four_processes);
    RUN(test_late_server);
    RUN(test_barrier);
    RUN(test_barrier_timeout);
    RUN(test_intruders);
    RUN(test_silent_joiner);
    RUN(test_server_faults);
    RUN(test_stale_reply);
    RUN(test_generations);
    RUN(test_teardown_grace);
    RUN(test_teardown_cut);
    return test_summary();
}
