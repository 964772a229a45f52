/* ============================================================================
 * Rendezvous, part 3 of 4: sockets (addresses, listening, non-blocking I/O) and rank 0's
 * server thread: one poll() loop over the listening sockets, a wake-up pipe and every
 * connection, feeding the server logic of wire.c.
 * ==========================================================================*/
#include "../public/api.h"
#include "../public/api_rdzv.h"
#include "../core/internal.h"

#if !defined(_WIN32)
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <pthread.h>
#include <unistd.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/types.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ======================================================================
 * Sockets: addresses, the server thread, the client.
 * ====================================================================*/

typedef struct dtr__rdzv_addr {
    struct sockaddr_storage ss;
    socklen_t len;
} dtr__rdzv_addr;

#define DTR__RDZV_MAX_ADDRS 8

/* "host:port" or "[v6]:port" of a socket address. */
static void dtr__rdzv_addr_str(const struct sockaddr *sa, char *buf, size_t cap) {
    char host[48];   /* INET6_ADDRSTRLEN is 46 */
    if (sa->sa_family == AF_INET) {
        const struct sockaddr_in *a = (const struct sockaddr_in *)(const void *)sa;
        if (!inet_ntop(AF_INET, &a->sin_addr, host, sizeof host)) snprintf(host, sizeof host, "?");
        snprintf(buf, cap, "%s:%u", host, (unsigned)ntohs(a->sin_port));
    } else if (sa->sa_family == AF_INET6) {
        const struct sockaddr_in6 *a = (const struct sockaddr_in6 *)(const void *)sa;
        if (!inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof host)) snprintf(host, sizeof host, "?");
        snprintf(buf, cap, "[%s]:%u", host, (unsigned)ntohs(a->sin6_port));
    } else {
        snprintf(buf, cap, "(family %d)", (int)sa->sa_family);
    }
}

static int dtr__rdzv_is_loopback(const dtr__rdzv_addr *a) {
    if (a->ss.ss_family == AF_INET) {
        const struct sockaddr_in *s4 = (const struct sockaddr_in *)(const void *)&a->ss;
        return (ntohl(s4->sin_addr.s_addr) >> 24) == 127;
    }
    if (a->ss.ss_family == AF_INET6) {
        const struct sockaddr_in6 *s6 = (const struct sockaddr_in6 *)(const void *)&a->ss;
        return IN6_IS_ADDR_LOOPBACK(&s6->sin6_addr);
    }
    return 0;
}

static void dtr__rdzv_set_port(dtr__rdzv_addr *a, int port) {
    if (a->ss.ss_family == AF_INET) ((struct sockaddr_in *)(void *)&a->ss)->sin_port = htons((uint16_t)port);
    else if (a->ss.ss_family == AF_INET6) ((struct sockaddr_in6 *)(void *)&a->ss)->sin6_port = htons((uint16_t)port);
}

/* Resolves host (a name, an IPv4 or an IPv6 address, "[v6]" allowed) for TCP to `port`.
 * Returns the number of addresses (>= 1), or 0 with the reason in why; *retry is 1 when the
 * failure may be temporary. */
static int dtr__rdzv_resolve(const char *host_in, int port, dtr__rdzv_addr *out, int max, char *why, size_t whylen,
                             int *retry) {
    char host[DTR_RDZV_STR];
    size_t n = strlen(host_in);
    int count = 0;
    *retry = 0;
    if (n >= 2 && host_in[0] == '[' && host_in[n - 1] == ']') {
        memcpy(host, host_in + 1, n - 2);
        host[n - 2] = '\0';
    } else {
        snprintf(host, sizeof host, "%s", host_in);
    }
    if (!host[0]) {
        dtr__errf(why, whylen, DTR_INVALID_ARGUMENT, "empty master address");
        return 0;
    }
#ifdef AI_PASSIVE
    {
        struct addrinfo hints, *res = NULL, *ai;
        char portstr[16];
        int rc;
        memset(&hints, 0, sizeof hints);
        hints.ai_family = AF_UNSPEC;
        hints.ai_socktype = SOCK_STREAM;
        snprintf(portstr, sizeof portstr, "%d", port);
        rc = getaddrinfo(host, portstr, &hints, &res);
        if (rc != 0) {
            *retry = rc == EAI_AGAIN;
            dtr__errf(why, whylen, DTR_IO_ERROR, "cannot resolve '%s': %s", host, gai_strerror(rc));
            return 0;
        }
        for (ai = res; ai && count < max; ai = ai->ai_next) {
            if ((ai->ai_family != AF_INET && ai->ai_family != AF_INET6) || ai->ai_addrlen > sizeof out[0].ss) continue;
            memset(&out[count], 0, sizeof out[count]);
            memcpy(&out[count].ss, ai->ai_addr, ai->ai_addrlen);
            out[count].len = (socklen_t)ai->ai_addrlen;
            count++;
        }
        freeaddrinfo(res);
    }
#else
    {
        struct sockaddr_in s4;
        struct sockaddr_in6 s6;
        memset(&s4, 0, sizeof s4);
        memset(&s6, 0, sizeof s6);
        if (inet_pton(AF_INET, host, &s4.sin_addr) == 1) {
            s4.sin_family = AF_INET;
            memset(&out[0], 0, sizeof out[0]);
            memcpy(&out[0].ss, &s4, sizeof s4);
            out[0].len = (socklen_t)sizeof s4;
            count = 1;
        } else if (inet_pton(AF_INET6, host, &s6.sin6_addr) == 1) {
            s6.sin6_family = AF_INET6;
            memset(&out[0], 0, sizeof out[0]);
            memcpy(&out[0].ss, &s6, sizeof s6);
            out[0].len = (socklen_t)sizeof s6;
            count = 1;
        } else {
            /* gethostbyname is not reentrant: one caller at a time, results copied out. */
            static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
            struct hostent *he;
            pthread_mutex_lock(&lock);
            he = gethostbyname(host);
            if (he && he->h_addrtype == AF_INET && he->h_length == 4) {
                int i;
                for (i = 0; he->h_addr_list[i] && count < max; i++) {
                    memset(&s4, 0, sizeof s4);
                    s4.sin_family = AF_INET;
                    memcpy(&s4.sin_addr, he->h_addr_list[i], 4);
                    memset(&out[count], 0, sizeof out[count]);
                    memcpy(&out[count].ss, &s4, sizeof s4);
                    out[count].len = (socklen_t)sizeof s4;
                    count++;
                }
            } else {
                *retry = h_errno == TRY_AGAIN;
            }
            pthread_mutex_unlock(&lock);
            if (!count) {
                dtr__errf(why, whylen, DTR_IO_ERROR,
                          "cannot resolve '%s' (IPv4 names only: this build has no getaddrinfo; use an address)",
                          host);
                return 0;
            }
        }
    }
#endif
    if (!count) {
        dtr__errf(why, whylen, DTR_IO_ERROR, "'%s' has no IPv4 or IPv6 address", host);
        return 0;
    }
    {
        int i;
        for (i = 0; i < count; i++) dtr__rdzv_set_port(&out[i], port);
    }
    return count;
}

static int dtr__rdzv_nonblock(int fd) {
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0 || fcntl(fd, F_SETFL, fl | O_NONBLOCK) < 0) return 0;
    (void)fcntl(fd, F_SETFD, FD_CLOEXEC);
    return 1;
}

static void dtr__rdzv_sockopts(int fd) {
    int one = 1;
    (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, (socklen_t)sizeof one);
#ifdef SO_NOSIGPIPE
    (void)setsockopt(fd, SOL_SOCKET, SO_NOSIGPIPE, &one, (socklen_t)sizeof one);
#endif
}

/* ---- the server thread (rank 0) ---- */

#define DTR__RDZV_MAX_LISTEN 4

typedef struct dtr__rdzv_host {
    dtr__rdzv_server core;
    int lfd[DTR__RDZV_MAX_LISTEN];
    int nlfd;
    int wake[2];                 /* write 'q' to stop now, 'd' to stop once no rank is connected */
    int64_t drain_deadline;      /* set before 'd' is written */
    pthread_t thread;
    int started;
    int port;
    struct pollfd *pfd;
    dtr__rdzv_conn **pconn;
    int pcap;
} dtr__rdzv_host;

static int dtr__rdzv_host_grow(dtr__rdzv_host *h, int n) {
    struct pollfd *p;
    dtr__rdzv_conn **c;
    int cap;
    if (n <= h->pcap) return 1;
    cap = h->pcap ? h->pcap : 32;
    while (cap < n) cap *= 2;
    p = (struct pollfd *)dtr__realloc(&h->core.cfg.alloc, h->pfd, (size_t)cap * sizeof *p);
    if (!p) return 0;
    h->pfd = p;
    c = (dtr__rdzv_conn **)dtr__realloc(&h->core.cfg.alloc, h->pconn, (size_t)cap * sizeof *c);
    if (!c) return 0;
    h->pconn = c;
    h->pcap = cap;
    return 1;
}

static void dtr__rdzv_accept(dtr__rdzv_host *h, int lfd) {
    dtr__rdzv_server *s = &h->core;
    int k;
    for (k = 0; k < 64; k++) {
        struct sockaddr_storage ss;
        socklen_t sl = (socklen_t)sizeof ss;
        char peer[64];
        dtr__rdzv_conn *c;
        int fd = accept(lfd, (struct sockaddr *)(void *)&ss, &sl);
        if (fd < 0) {
            if (errno == EINTR || errno == ECONNABORTED) continue;
            if (errno != EAGAIN && errno != EWOULDBLOCK)
                dtr__rdzv_log(&s->cfg, DTR_LOG_WARN, "rendezvous server: accept failed: %s", strerror(errno));
            return;
        }
        dtr__rdzv_addr_str((const struct sockaddr *)(const void *)&ss, peer, sizeof peer);
        if (!dtr__rdzv_nonblock(fd)) {
            close(fd);
            continue;
        }
        dtr__rdzv_sockopts(fd);
        c = dtr__rdzv_conn_open(s, fd, peer);
        if (!c) {
            s->refused++;
            dtr__rdzv_log(&s->cfg, DTR_LOG_WARN, "rendezvous server: refused %s: %d connections open (max_connections %d)",
                          peer, s->nconns, s->cfg.max_connections);
            close(fd);
            continue;
        }
        c->deadline_ms = dtr__rdzv_now_ms() + (s->cfg.timeout_ms < 30000 ? s->cfg.timeout_ms : 30000);
        dtr__rdzv_log(&s->cfg, DTR_LOG_DEBUG, "rendezvous server: connection from %s", peer);
    }
}

/* Sends what is queued; 0 when the connection is gone. */
static int dtr__rdzv_flush(dtr__rdzv_conn *c) {
    while (c->out_pos < c->out_len) {
        ssize_t k = send(c->fd, c->out + c->out_pos, c->out_len - c->out_pos, DTR__RDZV_NOSIGNAL);
        if (k > 0) c->out_pos += (size_t)k;
        else if (k < 0 && errno == EINTR) continue;
        else if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return 1;
        else return 0;
    }
    return 1;
}

static void *dtr__rdzv_thread(void *arg) {
    dtr__rdzv_host *h = (dtr__rdzv_host *)arg;
    dtr__rdzv_server *s = &h->core;
    uint8_t buf[16384];
    int draining = 0;
    for (;;) {
        int n = 0, i, nfixed, timeout = -1, rc, ready = 0;
        int64_t now = dtr__rdzv_now_ms();
        if (!dtr__rdzv_host_grow(h, 1 + h->nlfd + s->nconns)) {
            dtr__rdzv_sleep_ms(10);   /* out of memory for the poll set: try again shortly */
            continue;
        }
        h->pfd[n].fd = h->wake[0];
        h->pfd[n].events = POLLIN;
        h->pconn[n++] = NULL;
        for (i = 0; i < h->nlfd; i++) {
            h->pfd[n].fd = h->lfd[i];
            h->pfd[n].events = POLLIN;
            h->pconn[n++] = NULL;
        }
        nfixed = n;
        for (i = 0; i < s->nconns; i++) {
            dtr__rdzv_conn *c = s->conns[i];
            short ev = 0;
            if (c->out_pos < c->out_len) ev |= POLLOUT;
            else if (c->state != DTR__RDZV_C_CLOSING) ev |= POLLIN;
            if (c->state == DTR__RDZV_C_READY) ready++;
            if (c->state == DTR__RDZV_C_AUTH) {
                int64_t left = c->deadline_ms - now;
                int t = left <= 0 ? 0 : (left > INT_MAX ? INT_MAX : (int)left);
                if (timeout < 0 || t < timeout) timeout = t;
            }
            h->pfd[n].fd = c->fd;
            h->pfd[n].events = ev;
            h->pconn[n++] = c;
        }
        if (draining) {
            int t = dtr__rdzv_left_ms(h->drain_deadline);
            if (ready == 0 || t == 0) break;
            if (timeout < 0 || t < timeout) timeout = t;
        }
        rc = poll(h->pfd, (nfds_t)n, timeout);
        if (rc < 0) {
            if (errno == EINTR) continue;
            dtr__rdzv_log(&s->cfg, DTR_LOG_ERROR, "rendezvous server: poll failed: %s", strerror(errno));
            dtr__rdzv_sleep_ms(10);
            continue;
        }
        if (h->pfd[0].revents) {
            char cmd[16];
            ssize_t k = read(h->wake[0], cmd, sizeof cmd), j;
            for (j = 0; j < k; j++) {
                if (cmd[j] == 'q') return NULL;
                if (cmd[j] == 'd' && !draining) {
                    /* no new joins once the store is being destroyed: the port is free at once
                       for the next store, and a rank that opens that one cannot reach this
                       server, which only waits for its connected ranks to leave */
                    int l;
                    for (l = 0; l < h->nlfd; l++) close(h->lfd[l]);
                    h->nlfd = 0;
                    draining = 1;
                }
            }
        }
        for (i = 1; i < nfixed && !draining; i++)
            if (h->pfd[i].revents & POLLIN) dtr__rdzv_accept(h, h->pfd[i].fd);
        now = dtr__rdzv_now_ms();
        for (i = nfixed; i < n; i++) {
            dtr__rdzv_conn *c = h->pconn[i];
            short re = h->pfd[i].revents;
            int gone = 0;
            if (re & POLLNVAL) gone = 1;
            if (!gone && (re & (POLLOUT | POLLHUP | POLLERR)) && c->out_pos < c->out_len && !dtr__rdzv_flush(c))
                gone = 1;
            if (!gone && (re & (POLLHUP | POLLERR)) && !(h->pfd[i].events & POLLIN) && c->out_pos < c->out_len)
                gone = 1;   /* cannot be written and is not read: nothing more to do with it */
            if (!gone && (re & (POLLIN | POLLHUP | POLLERR)) && (h->pfd[i].events & POLLIN)) {
                size_t want = dtr__rdzv_conn_want(c);
                ssize_t k;
                if (want > sizeof buf) want = sizeof buf;
                if (want == 0) want = 1;   /* closing: only notice the peer's end */
                k = recv(c->fd, buf, want, 0);
                if (k > 0) {
                    if (c->state != DTR__RDZV_C_CLOSING) dtr__rdzv_conn_feed(s, c, buf, (size_t)k);
                } else if (k == 0 || (errno != EINTR && errno != EAGAIN && errno != EWOULDBLOCK)) {
                    if (c->state == DTR__RDZV_C_AUTH && c->in_len > 0) {
                        s->refused++;
                        dtr__rdzv_log(&s->cfg, DTR_LOG_WARN,
                                      "rendezvous server: refused %s: closed after %lu bytes of an incomplete join message",
                                      c->peer, (unsigned long)c->in_len);
                    } else if (c->state == DTR__RDZV_C_READY) {
                        dtr__rdzv_log(&s->cfg, DTR_LOG_DEBUG, "rendezvous server: rank %ld (%s) disconnected",
                                      (long)c->rank, c->peer);
                    }
                    gone = 1;
                }
            }
            if (!gone && c->state == DTR__RDZV_C_AUTH && now >= c->deadline_ms) {
                dtr__rdzv_refuse(s, c, DTR_LOG_WARN, "no valid join message within %d ms (%lu bytes received)",
                                 s->cfg.timeout_ms < 30000 ? s->cfg.timeout_ms : 30000, (unsigned long)c->in_len);
                gone = 1;
            }
            if (!gone && c->state == DTR__RDZV_C_CLOSING) {
                if (c->out_pos < c->out_len) (void)dtr__rdzv_flush(c);   /* best effort: the refusal */
                gone = 1;
            }
            if (gone) dtr__rdzv_conn_close(s, c);
        }
        /* Replies queued on other connections (woken waiters) go out on the next round. */
    }
    return NULL;
}

static void dtr__rdzv_host_free(dtr__rdzv_host *h) {
    int i;
    for (i = 0; i < h->nlfd; i++) close(h->lfd[i]);
    if (h->wake[0] >= 0) close(h->wake[0]);
    if (h->wake[1] >= 0) close(h->wake[1]);
    dtr__rdzv_free(&h->core.cfg, h->pfd);
    dtr__rdzv_free(&h->core.cfg, h->pconn);
    {
        dtr_allocation_callbacks a = h->core.cfg.alloc;
        dtr__rdzv_server_free(&h->core);
        dtr__free(&a, h);
    }
}

static void dtr__rdzv_host_stop(dtr__rdzv_host *h, char cmd, int64_t deadline) {
    if (h->started) {
        h->drain_deadline = deadline;
        while (write(h->wake[1], &cmd, 1) < 0 && errno == EINTR) {
        }
        pthread_join(h->thread, NULL);
        h->started = 0;
    }
    dtr__rdzv_host_free(h);
}

/* Binds and listens: on each loopback address of master_addr when all its addresses are
 * loopback, else on the IPv6 wildcard (dual stack) or, without IPv6, the IPv4 wildcard. */
static dtr_result dtr__rdzv_host_start(const dtr_rendezvous_config *cfg, dtr__rdzv_host **out, int *port_out,
                                       char *err, size_t errlen) {
    dtr__rdzv_addr addrs[DTR__RDZV_MAX_ADDRS], bind_to[DTR__RDZV_MAX_LISTEN];
    char why[300];
    int n, nb = 0, i, retry, all_loop = 1, port = cfg->port, last_errno = 0;
    dtr__rdzv_host *h;
    dtr_result r;
    *out = NULL;
    n = dtr__rdzv_resolve(cfg->master_addr, port, addrs, DTR__RDZV_MAX_ADDRS, why, sizeof why, &retry);
    if (n == 0)
        return dtr__errf(err, errlen, DTR_IO_ERROR, "rendezvous rank 0: master address: %s", why);
    for (i = 0; i < n; i++) all_loop &= dtr__rdzv_is_loopback(&addrs[i]);
    if (all_loop) {
        for (i = 0; i < n && nb < DTR__RDZV_MAX_LISTEN; i++) {
            int j, dup = 0;
            for (j = 0; j < nb; j++)
                if (bind_to[j].len == addrs[i].len && memcmp(&bind_to[j].ss, &addrs[i].ss, addrs[i].len) == 0) dup = 1;
            if (!dup) bind_to[nb++] = addrs[i];
        }
    } else {
        struct sockaddr_in6 s6;
        struct sockaddr_in s4;
        memset(&s6, 0, sizeof s6);
        s6.sin6_family = AF_INET6;
        s6.sin6_addr = in6addr_any;
        memset(&bind_to[0], 0, sizeof bind_to[0]);
        memcpy(&bind_to[0].ss, &s6, sizeof s6);
        bind_to[0].len = (socklen_t)sizeof s6;
        memset(&s4, 0, sizeof s4);
        s4.sin_family = AF_INET;
        s4.sin_addr.s_addr = htonl(INADDR_ANY);
        memset(&bind_to[1], 0, sizeof bind_to[1]);
        memcpy(&bind_to[1].ss, &s4, sizeof s4);
        bind_to[1].len = (socklen_t)sizeof s4;
        nb = 2;   /* the second only when the first fails */
    }
    h = (dtr__rdzv_host *)dtr__calloc(&cfg->alloc, sizeof *h);
    if (!h) return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "rendezvous rank 0: out of memory");
    h->wake[0] = h->wake[1] = -1;
    if ((r = dtr__rdzv_server_init(&h->core, cfg)) != DTR_OK) {
        dtr__rdzv_host_free(h);
        return dtr__errf(err, errlen, r, "rendezvous rank 0: out of memory");
    }
    for (i = 0; i < nb; i++) {
        int fd, one = 1;
        dtr__rdzv_addr a = bind_to[i];
        if (!all_loop && h->nlfd > 0) break;   /* wildcard: the IPv6 socket took IPv4 too */
        dtr__rdzv_set_port(&a, port);
        fd = socket(a.ss.ss_family, SOCK_STREAM, 0);
        if (fd < 0) {
            last_errno = errno;
            continue;
        }
        (void)setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, (socklen_t)sizeof one);
        if (a.ss.ss_family == AF_INET6) {
            int v6only = all_loop ? 1 : 0;
            (void)setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &v6only, (socklen_t)sizeof v6only);
        }
        if (bind(fd, (struct sockaddr *)(void *)&a.ss, a.len) != 0 || listen(fd, SOMAXCONN) != 0 ||
            !dtr__rdzv_nonblock(fd)) {
            last_errno = errno;
            close(fd);
            if (all_loop && h->nlfd == 0 && i == 0 && last_errno == EADDRINUSE) break;
            continue;
        }
        if (port == 0) {   /* the port the kernel chose: the other sockets take the same one */
            struct sockaddr_storage ss;
            socklen_t sl = (socklen_t)sizeof ss;
            if (getsockname(fd, (struct sockaddr *)(void *)&ss, &sl) == 0) {
                if (ss.ss_family == AF_INET) port = ntohs(((struct sockaddr_in *)(void *)&ss)->sin_port);
                else if (ss.ss_family == AF_INET6) port = ntohs(((struct sockaddr_in6 *)(void *)&ss)->sin6_port);
            }
        }
        h->lfd[h->nlfd++] = fd;
    }
    if (h->nlfd == 0) {
        dtr__rdzv_host_free(h);
        return dtr__errf(err, errlen, DTR_IO_ERROR, "rendezvous rank 0: cannot listen on %s port %d: %s%s",
                         all_loop ? cfg->master_addr : "every interface", cfg->port, strerror(last_errno),
                         last_errno == EADDRINUSE ? " (another job on this port? choose another DTR_MASTER_PORT)" : "");
    }
    if (pipe(h->wake) != 0) {
        h->wake[0] = h->wake[1] = -1;
        dtr__rdzv_host_free(h);
        return dtr__errf(err, errlen, DTR_IO_ERROR, "rendezvous rank 0: pipe: %s", strerror(errno));
    }
    (void)fcntl(h->wake[0], F_SETFD, FD_CLOEXEC);
    (void)fcntl(h->wake[1], F_SETFD, FD_CLOEXEC);
    h->port = port;
    if (pthread_create(&h->thread, NULL, dtr__rdzv_thread, h) != 0) {
        dtr__rdzv_host_free(h);
        return dtr__errf(err, errlen, DTR_IO_ERROR, "rendezvous rank 0: cannot start the server thread");
    }
    h->started = 1;
    *port_out = port;
    *out = h;
    return DTR_OK;
}


#ifdef __cplusplus
}
#endif

#endif /* !_WIN32 */
