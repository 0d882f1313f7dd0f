/*
 * server.c — kvroped's lifecycle: the store, the libuv loop, the Unix and
 * TCP listeners, signals, and an orderly stop.
 *
 * The Unix socket is created with mode 0600 (umask around bind, then chmod)
 * before listen(), so no other user can ever connect. An existing path is
 * probed first: a live daemon there makes us refuse to start; a stale
 * socket is removed; anything that is not a socket is left alone and we
 * refuse. Stopping (SIGINT/SIGTERM or kvr_daemon_stop) closes the
 * listeners and removes the socket file at once, lets each connection finish
 * the request it is in (up to KVR_STOP_GRACE_MS), then closes everything so
 * uv_run returns.
 */
#include "daemon/daemon_internal.h"

#ifdef KVR_JEMALLOC
#include <jemalloc/jemalloc.h>   /* mallctl: the idle purge */
#endif
#define KVR_STR_(x) #x
#define KVR_STR(x) KVR_STR_(x)

#include <assert.h>
#include <errno.h>
#include <stdarg.h>
#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>


static void *uv_realloc_cb(void *p, size_t n)
{
    return kvr_mem_realloc(p, n);
}

void kvr_daemon_init_allocator(void)
{
    static int done;
    if (done)
        return;
    done = 1;
    uv_replace_allocator(kvr_mem_malloc, uv_realloc_cb, kvr_mem_calloc, kvr_mem_free);
}

/* ---- accepting ------------------------------------------------------------ */

static void refuse_conn_closed(uv_handle_t *h)
{
    kvr_mem_free(h);
}

static void on_connection(uv_stream_t *srv, int status)
{
    kvr_daemon *d = srv->data;
    if (status < 0) {
        kvr_log(KVR_LOG_WARN, "accept: %s", uv_strerror(status));
        return;
    }
    bool is_tcp = srv->type == UV_TCP;
    kvr_conn *c = kvr_mem_calloc(1, sizeof *c);
    if (!c) {
        kvr_log(KVR_LOG_ERROR, "out of memory accepting a connection");
        return;
    }
    /* Unix connections in ipc mode: a client may send a memfd (shm.c). */
    int rc = is_tcp ? uv_tcp_init(&d->loop, &c->h.tcp) : uv_pipe_init(&d->loop, &c->h.pipe, 1);
    if (rc < 0) {
        kvr_mem_free(c);
        return;
    }
    if (uv_accept(srv, &c->h.stream) < 0) {
        c->h.handle.data = c;
        uv_close(&c->h.handle, refuse_conn_closed);
        return;
    }
    if (is_tcp)
        uv_tcp_nodelay(&c->h.tcp, 1);
    /* Room for a whole MiB-sized reply in the socket: with the default
     * (~208 KiB) a 1 MiB get is written in five rounds of write, EAGAIN and
     * wake-up. The kernel caps it at net.core.wmem_max. */
    int sndbuf = 4 << 20;
    (void)uv_send_buffer_size(&c->h.handle, &sndbuf);
    /* Clients that still owe Auth have their own (smaller) limit, so anyone
     * who can reach the TCP port cannot lock local workers out. */
    bool unauth = is_tcp && d->token;
    bool over = unauth ? d->n_unauth >= d->cfg.max_unauth_connections
                       : d->n_conns - d->n_unauth >= d->cfg.max_connections;
    kvr_conn_start(d, c, is_tcp);
    if (over) {
        d->n_conn_refused++;
        if (unauth) {
            kvr_log(KVR_LOG_WARN, "refusing a connection: %zu unauthenticated open "
                    "(--max-unauth-connections %u)", d->n_unauth - 1,
                    d->cfg.max_unauth_connections);
            kvr_conn_fail(c, 0, KVR_ELIMIT,
                          "too many unauthenticated connections (--max-unauth-connections)");
        } else {
            kvr_log(KVR_LOG_WARN, "refusing a connection: %zu open (--max-connections %u)",
                    d->n_conns - d->n_unauth - 1, d->cfg.max_connections);
            kvr_conn_fail(c, 0, KVR_ELIMIT, "too many connections (--max-connections)");
        }
        return;
    }
    kvr_log(KVR_LOG_DEBUG, "connection %p accepted (%s)", (void *)c, is_tcp ? "tcp" : "unix");
}

int kvr_daemon_adopt_fd(kvr_daemon *d, int fd)
{
    kvr_conn *c = kvr_mem_calloc(1, sizeof *c);
    if (!c)
        return KVR_ENOMEM;
    int rc = uv_pipe_init(&d->loop, &c->h.pipe, 1);
    if (rc == 0)
        rc = uv_pipe_open(&c->h.pipe, fd);
    if (rc < 0) {
        kvr_mem_free(c);
        return KVR_EINTERNAL;
    }
    kvr_conn_start(d, c, false);
    return 0;
}

/* ---- listeners ------------------------------------------------------------ */

static int mkdir_parent(const char *path, kvr_error *err)
{
    char dir[256];
    snprintf(dir, sizeof dir, "%s", path);
    char *slash = strrchr(dir, '/');
    if (!slash || slash == dir)
        return 0;
    *slash = '\0';
    if (mkdir(dir, 0700) < 0 && errno != EEXIST)
        return kvr_error_sys(err, KVR_ESYS, errno, "cannot create %s", dir);
    return 0;
}

/* 0: path free (or stale socket removed); <0: refuse. */
static int probe_socket_path(const char *path, kvr_error *err)
{
    struct stat st;
    if (lstat(path, &st) < 0)
        return errno == ENOENT ? 0 : kvr_error_sys(err, KVR_ESYS, errno, "%s", path);
    if (!S_ISSOCK(st.st_mode))
        return kvr_error_set(err, KVR_EEXIST,
                             "%s exists and is not a socket: refusing to replace it", path);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return kvr_error_sys(err, KVR_ESYS, errno, "%s: socket", path);
    struct sockaddr_un sa = { .sun_family = AF_UNIX };
    size_t plen = strlen(path);
    if (plen >= sizeof sa.sun_path) {
        close(fd);
        return kvr_error_set(err, KVR_EINVAL, "socket path too long (max 107 bytes): %s", path);
    }
    memcpy(sa.sun_path, path, plen + 1);
    int rc = connect(fd, (struct sockaddr *)&sa, sizeof sa);
    int e = errno;
    close(fd);
    if (rc == 0)
        return kvr_error_set(err, KVR_EEXIST,
                             "%s: another kvroped is listening there (stop it first)", path);
    if (e == ECONNREFUSED || e == ENOENT) {
        kvr_log(KVR_LOG_INFO, "removing stale socket %s", path);
        if (unlink(path) < 0 && errno != ENOENT)
            return kvr_error_sys(err, KVR_ESYS, errno, "cannot remove stale socket %s", path);
        return 0;
    }
    return kvr_error_sys(err, KVR_ESYS, e, "%s: cannot probe existing socket", path);
}

static int listen_unix(kvr_daemon *d, kvr_error *err)
{
    const char *cfgp = d->cfg.socket_path;
    if (!strcmp(cfgp, "none"))
        return 0;
    if (cfgp[0]) {
        snprintf(d->sock_path, sizeof d->sock_path, "%s", cfgp);
    } else {
        kvr_daemon_default_socket(d->sock_path, sizeof d->sock_path);
        int rc = mkdir_parent(d->sock_path, err);
        if (rc < 0)
            return rc;
    }
    if (strlen(d->sock_path) >= sizeof(((struct sockaddr_un *)0)->sun_path))
        return kvr_error_set(err, KVR_EINVAL, "socket path too long (max 107 bytes): %s",
                             d->sock_path);
    int rc = probe_socket_path(d->sock_path, err);
    if (rc < 0)
        return rc;
    rc = uv_pipe_init(&d->loop, &d->unix_srv, 0);
    if (rc < 0)
        goto uv_fail;
    d->has_unix = true;
    d->unix_srv.data = d;
    mode_t old = umask(0177);
    rc = uv_pipe_bind(&d->unix_srv, d->sock_path);
    umask(old);
    if (rc < 0)
        goto uv_fail;
    d->sock_created = true;
    if (chmod(d->sock_path, 0600) < 0)
        return kvr_error_sys(err, KVR_ESYS, errno, "chmod %s", d->sock_path);
    rc = uv_listen((uv_stream_t *)&d->unix_srv, 128, on_connection);
    if (rc < 0)
        goto uv_fail;
    kvr_log(KVR_LOG_INFO, "listening on unix socket %s", d->sock_path);
    return 0;
uv_fail:   /* libuv's codes are -errno on Unix */
    return kvr_error_sys(err, KVR_ESYS, -rc, "unix socket %s", d->sock_path);
}

static int listen_tcp(kvr_daemon *d, kvr_error *err)
{
    if (!d->cfg.listen[0])
        return 0;
    char host[256];
    int port;
    if (kvr_daemon_split_listen(d->cfg.listen, host, sizeof host, &port) < 0)
        return kvr_error_set(err, KVR_EINVAL, "--listen: expected HOST:PORT, got '%s'",
                             d->cfg.listen);
    if (!strcmp(host, "localhost"))
        snprintf(host, sizeof host, "127.0.0.1");
    struct sockaddr_storage ss;
    int rc;
    if (strchr(host, ':'))
        rc = uv_ip6_addr(host, port, (struct sockaddr_in6 *)&ss);
    else
        rc = uv_ip4_addr(host, port, (struct sockaddr_in *)&ss);
    if (rc < 0)
        return kvr_error_set(err, KVR_EINVAL, "--listen: '%s' is not a numeric IP address", host);
    rc = uv_tcp_init(&d->loop, &d->tcp_srv);
    if (rc < 0)
        goto fail;
    d->has_tcp = true;
    d->tcp_srv.data = d;
    rc = uv_tcp_bind(&d->tcp_srv, (const struct sockaddr *)&ss, 0);
    if (rc == 0)
        rc = uv_listen((uv_stream_t *)&d->tcp_srv, 128, on_connection);
    if (rc < 0)
        goto fail;
    struct sockaddr_storage bound;
    int blen = sizeof bound;
    char name[64] = "?";
    int bport = port;
    if (uv_tcp_getsockname(&d->tcp_srv, (struct sockaddr *)&bound, &blen) == 0) {
        if (bound.ss_family == AF_INET6) {
            uv_ip6_name((struct sockaddr_in6 *)&bound, name, sizeof name);
            bport = ntohs(((struct sockaddr_in6 *)&bound)->sin6_port);
        } else {
            uv_ip4_name((struct sockaddr_in *)&bound, name, sizeof name);
            bport = ntohs(((struct sockaddr_in *)&bound)->sin_port);
        }
    }
    kvr_log(KVR_LOG_INFO, "listening on tcp %s:%d%s", name, bport,
            d->token ? " (auth required)" : "");
    return 0;
fail:
    return kvr_error_sys(err, KVR_ESYS, -rc, "--listen %s", d->cfg.listen);
}

static int read_token(kvr_daemon *d, kvr_error *err)
{
    const char *path = d->cfg.auth_token_file;
    if (!path[0])
        return 0;
    FILE *f = fopen(path, "rb");
    if (!f)
        return kvr_error_sys(err, KVR_EIO, errno, "--auth-token-file %s", path);
    uint8_t buf[4097];
    size_t n = fread(buf, 1, sizeof buf, f);
    fclose(f);
    if (n == sizeof buf)
        return kvr_error_set(err, KVR_EINVAL, "--auth-token-file %s: token longer than 4096 bytes",
                             path);
    if (n > 0 && buf[n - 1] == '\n')
        n--;
    if (n > 0 && buf[n - 1] == '\r')
        n--;
    if (n == 0)
        return kvr_error_set(err, KVR_EINVAL, "--auth-token-file %s: empty token", path);
    d->token = kvr_mem_malloc(n);
    if (!d->token)
        return kvr_error_set(err, KVR_ENOMEM, "--auth-token-file %s: out of memory for the token",
                             path);
    memcpy(d->token, buf, n);
    d->token_len = n;
    return 0;
}

/* ---- timers, signals, stop --------------------------------------------------- */

/* Freed pages the allocator keeps for reuse (main.c's malloc_conf) go back
 * to the kernel once no request arrived for KVR_IDLE_PURGE_MS. */
#define KVR_IDLE_PURGE_MS 2000

static void idle_purge(kvr_daemon *d, uint64_t now)
{
    if (d->n_requests != d->purge_seen) {
        d->purge_seen = d->n_requests;
        d->purge_idle_ms = now;
        d->purged = false;
        return;
    }
    if (d->purged || now - d->purge_idle_ms < KVR_IDLE_PURGE_MS)
        return;
    d->purged = true;
#ifdef KVR_JEMALLOC
    (void)mallctl("arena." KVR_STR(MALLCTL_ARENAS_ALL) ".purge", NULL, NULL, NULL, 0);
#endif
}

static void on_sweep(uv_timer_t *t)
{
    kvr_daemon *d = t->data;
    uint64_t now = kvr_now_ms();
    idle_purge(d, now);
    bool force = d->stopping && now >= d->stop_ms + KVR_STOP_GRACE_MS;
    for (kvr_conn *c = d->conns, *n; c; c = n) {
        n = c->next;
        kvr_conn_sweep(c, now, force);
    }
    if (d->stopping && d->n_conns == 0 && d->has_sweep) {
        uv_timer_stop(&d->sweep);
        uv_close((uv_handle_t *)&d->sweep, NULL);
        d->has_sweep = false;
    }
}

static void on_signal(uv_signal_t *s, int signum)
{
    kvr_daemon *d = s->data;
    kvr_log(KVR_LOG_INFO, "%s received: stopping", signum == SIGINT ? "SIGINT" : "SIGTERM");
    kvr_daemon_stop(d);
}

int kvr_daemon_handle_signals(kvr_daemon *d)
{
    int rc = uv_signal_init(&d->loop, &d->sig_int);
    if (rc == 0)
        rc = uv_signal_init(&d->loop, &d->sig_term);
    if (rc < 0)
        return rc;
    d->has_signals = true;
    d->sig_int.data = d;
    d->sig_term.data = d;
    uv_signal_start(&d->sig_int, on_signal, SIGINT);
    uv_signal_start(&d->sig_term, on_signal, SIGTERM);
    return 0;
}

static void remove_socket(kvr_daemon *d)
{
    if (d->sock_created) {
        if (unlink(d->sock_path) < 0 && errno != ENOENT)
            kvr_log(KVR_LOG_WARN, "cannot remove %s: %s", d->sock_path, strerror(errno));
        d->sock_created = false;
    }
}

void kvr_daemon_stop(kvr_daemon *d)
{
    if (d->stopping)
        return;
    d->stopping = true;
    d->stop_ms = kvr_now_ms();
    if (d->has_unix) {
        uv_close((uv_handle_t *)&d->unix_srv, NULL);
        d->has_unix = false;
    }
    remove_socket(d);
    if (d->has_tcp) {
        uv_close((uv_handle_t *)&d->tcp_srv, NULL);
        d->has_tcp = false;
    }
    if (d->has_signals) {
        uv_close((uv_handle_t *)&d->sig_int, NULL);
        uv_close((uv_handle_t *)&d->sig_term, NULL);
        d->has_signals = false;
    }
    for (kvr_conn *c = d->conns, *n; c; c = n) {
        n = c->next;
        kvr_conn_stop(c);
    }
    /* The sweep timer keeps the loop alive until the grace period ends. */
    if (d->has_sweep)
        uv_ref((uv_handle_t *)&d->sweep);
}

/* ---- create / run / destroy ------------------------------------------------- */

int kvr_daemon_create(kvr_daemon **out, const kvr_daemon_config *cfg, kvr_error *err)
{
    kvr_daemon_init_allocator();
    kvr_error_set(err, KVR_OK, "%s", "");
    kvr_daemon *d = kvr_mem_calloc(1, sizeof *d);
    if (!d)
        return kvr_error_set(err, KVR_ENOMEM, "out of memory");
    d->cfg = *cfg;
    d->start_ms = kvr_now_ms();
    d->limits.max_msg_len = cfg->max_frame;
    d->limits.max_payload_len = cfg->max_memory;
    uint64_t unpack_max = cfg->max_memory / (4u * KVR_UNPACK_FACTOR);
    if (unpack_max < KVR_UNAUTH_MAX_MSG)
        unpack_max = KVR_UNAUTH_MAX_MSG;
    if (unpack_max < d->limits.max_msg_len) {
        d->limits.max_msg_len = (uint32_t)unpack_max;
        kvr_log(KVR_LOG_INFO, "messages limited to %u bytes (not --max-frame %u): unpacking "
                "one takes up to %ux its size, kept under a quarter of --max-memory",
                d->limits.max_msg_len, cfg->max_frame, KVR_UNPACK_FACTOR);
    }
    /* Unfinished messages of all connections (conn.c): a share of the cap,
     * and always room for one whole frame. */
    d->msg_buffer_limit = cfg->max_msg_buffers ? cfg->max_msg_buffers : cfg->max_memory / 8;
    if (d->msg_buffer_limit < d->limits.max_msg_len)
        d->msg_buffer_limit = d->limits.max_msg_len;
    int rc = uv_loop_init(&d->loop);
    if (rc < 0) {
        kvr_mem_free(d);
        return kvr_error_sys(err, KVR_EINTERNAL, -rc, "uv_loop_init");
    }
    /* The worker pool for rotation and codecs (rope/pool.c), started now
     * rather than by the first large get. */
    (void)kvr_pool_default();
    /* Contexts and models count against limits too (issue 12): by default
     * one context per 4 KiB of the cap (its metadata is not evictable). */
    size_t max_ctx = cfg->max_contexts ? (size_t)cfg->max_contexts
                                       : (size_t)(cfg->max_memory / 4096);
    if (!cfg->max_contexts && max_ctx < 1024)
        max_ctx = 1024;
    kvr_store_config sc = { .max_memory = cfg->max_memory, .block_tokens = cfg->block_tokens,
                            .max_contexts = max_ctx, .max_models = cfg->max_models };
    kvr_error e = { 0 };
    rc = kvr_store_create(&d->store, &sc, &e);
    if (rc < 0) {
        kvr_error_set(err, rc, "store: %s", e.msg[0] ? e.msg : kvr_strerror(rc));
        d->store = NULL;
        goto fail;
    }
    if ((rc = read_token(d, err)) < 0)
        goto fail;
    /* Disk tier: recovered before anything is accepted. */
    char pmsg[sizeof e.msg] = "";
    if ((rc = kvr_persist_open(d, pmsg, sizeof pmsg)) < 0) {
        kvr_error_set(err, rc, "%s", pmsg[0] ? pmsg : kvr_strerror(rc));
        goto fail;
    }
    if ((rc = listen_unix(d, err)) < 0)
        goto fail;
    if ((rc = listen_tcp(d, err)) < 0)
        goto fail;
    uv_timer_init(&d->loop, &d->sweep);
    d->sweep.data = d;
    d->has_sweep = true;
    uv_timer_start(&d->sweep, on_sweep, 250, 250);
    uv_unref((uv_handle_t *)&d->sweep);
    *out = d;
    return 0;
fail:
    kvr_daemon_destroy(d);
    assert(rc < 0 && (!err || err->code == rc));
    return rc;
}

int kvr_daemon_run(kvr_daemon *d)
{
    uv_run(&d->loop, UV_RUN_DEFAULT);
    return 0;
}

int kvr_daemon_run_nowait(kvr_daemon *d)
{
    return uv_run(&d->loop, UV_RUN_NOWAIT);
}

size_t kvr_daemon_connections(const kvr_daemon *d)
{
    return d->n_conns;
}

static void close_walk(uv_handle_t *h, void *arg)
{
    (void)arg;
    if (!uv_is_closing(h))
        uv_close(h, NULL);
}

void kvr_daemon_destroy(kvr_daemon *d)
{
    if (!d)
        return;
    remove_socket(d);
    /* Close whatever is left and let the close callbacks run. */
    for (kvr_conn *c = d->conns, *n; c; c = n) {
        n = c->next;
        kvr_conn_close(c);
    }
    if (d->has_unix)
        uv_close((uv_handle_t *)&d->unix_srv, NULL);
    if (d->has_tcp)
        uv_close((uv_handle_t *)&d->tcp_srv, NULL);
    if (d->has_signals) {
        uv_close((uv_handle_t *)&d->sig_int, NULL);
        uv_close((uv_handle_t *)&d->sig_term, NULL);
    }
    if (d->has_sweep)
        uv_close((uv_handle_t *)&d->sweep, NULL);
    d->has_unix = d->has_tcp = d->has_signals = d->has_sweep = false;
    uv_run(&d->loop, UV_RUN_DEFAULT);
    if (uv_loop_close(&d->loop) == UV_EBUSY) {
        uv_walk(&d->loop, close_walk, NULL);
        uv_run(&d->loop, UV_RUN_DEFAULT);
        uv_loop_close(&d->loop);
    }
    kvr_store_destroy(d->store);
    kvr_mem_free(d->token);
    kvr_mem_free(d);
}

int kvr_daemon_main(int argc, char **argv)
{
    /* Before any other libuv call. */
    kvr_daemon_init_allocator();
    signal(SIGPIPE, SIG_IGN);
    kvr_daemon_config cfg;
    kvr_daemon_config_init(&cfg);
    int rc = kvr_daemon_config_parse_args(&cfg, argc, argv, stdout, stderr);
    if (rc == 1)
        return 0;
    if (rc < 0)
        return 2;
    kvr_log_set_level(cfg.log_level);
    if (cfg.threads) {
        char n[16];
        snprintf(n, sizeof n, "%u", cfg.threads);
        setenv("UV_THREADPOOL_SIZE", n, 1);
    }
    kvr_error err = { 0 };
    kvr_daemon *d;
    rc = kvr_daemon_create(&d, &cfg, &err);
    if (rc < 0) {
        kvr_log(KVR_LOG_ERROR, "cannot start: %s", err.msg[0] ? err.msg : kvr_strerror(rc));
        return 1;
    }
    if (kvr_daemon_handle_signals(d) < 0) {
        kvr_log(KVR_LOG_ERROR, "cannot install signal handlers");
        kvr_daemon_destroy(d);
        return 1;
    }
    kvr_log(KVR_LOG_INFO, "kvroped %s ready: memory cap %llu bytes, max frame %u bytes",
            KVR_DAEMON_VERSION, (unsigned long long)cfg.max_memory, cfg.max_frame);
    kvr_daemon_run(d);
    kvr_daemon_destroy(d);
    kvr_log(KVR_LOG_INFO, "stopped");
    return 0;
}
