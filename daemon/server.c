/*
 * server.c — kvroped's lifecycle: the store, the libuv loop, the Unix and
 * TCP listeners (bound here or passed by systemd), signals, readiness
 * notification, reload, and an orderly stop.
 *
 * The Unix socket is created with mode 0600 (umask around bind, then chmod)
 * before listen(), so no other user can ever connect. An existing path is
 * probed first: a live daemon there makes us refuse to start; a stale
 * socket is removed; anything that is not a socket is left alone and we
 * refuse. The default socket's directory must be ours and writable by no
 * one else (another user could replace the socket otherwise); a --socket
 * in a directory every user can write to (/tmp) is used with a warning
 * saying why. A token file its group or others can read or write is
 * refused (kvr__daemon_read_token), as sshd refuses such a key. Stopping
 * (SIGINT/SIGTERM or kvr_daemon_stop) closes the listeners and removes the
 * socket file at once, but only if the path still names the socket we
 * bound (same device and inode: a successor may have replaced it), lets
 * each connection finish the request it is in (up to KVR_STOP_GRACE_MS),
 * then closes everything so uv_run returns.
 *
 * systemd: sockets passed with LISTEN_FDS (sd_listen_fds) replace the Unix
 * socket and the TCP listener (a stream socket named "metrics" serves
 * /metrics); such a socket belongs to systemd and is never unlinked.
 * READY=1 is sent once everything listens, STOPPING=1 when a stop begins,
 * RELOADING=1 / READY=1 around a SIGHUP reload, STATUS= with each.
 */
#include "daemon/daemon_internal.h"
#include "daemon/remote.h"

#ifdef KVR_JEMALLOC
#include <jemalloc/jemalloc.h>   /* mallctl: the idle purge */
#endif
#define KVR_STR_(x) #x
#define KVR_STR(x) KVR_STR_(x)

#include <assert.h>
#include <errno.h>
#include <stdarg.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <systemd/sd-daemon.h>
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
    kvr__conn_start(d, c, is_tcp);
    if (over) {
        d->n_conn_refused++;
        if (unauth) {
            kvr_log(KVR_LOG_WARN, "refusing a connection: %zu unauthenticated open "
                    "(--max-unauth-connections %u)", d->n_unauth - 1,
                    d->cfg.max_unauth_connections);
            kvr__conn_fail(c, 0, KVR_ELIMIT,
                          "too many unauthenticated connections (--max-unauth-connections)");
        } else {
            kvr_log(KVR_LOG_WARN, "refusing a connection: %zu open (--max-connections %u)",
                    d->n_conns - d->n_unauth - 1, d->cfg.max_connections);
            kvr__conn_fail(c, 0, KVR_ELIMIT, "too many connections (--max-connections)");
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
    kvr__conn_start(d, c, false);
    return 0;
}

/* ---- listeners ------------------------------------------------------------ */

/* The default socket's directory: created 0700 if missing; refused unless
 * it is a real directory (not a symlink) owned by us that neither group
 * nor others can write (another user's directory lets that user
 * replace the socket). */
static int private_parent(const char *path, kvr_error *err)
{
    char dir[256];
    snprintf(dir, sizeof dir, "%s", path);
    char *slash = strrchr(dir, '/');
    if (!slash || slash == dir)
        return 0;
    *slash = '\0';
    if (mkdir(dir, 0700) < 0 && errno != EEXIST)
        return kvr_error_sys(err, KVR_ESYS, errno, "cannot create %s", dir);
    struct stat st;
    if (lstat(dir, &st) < 0)
        return kvr_error_sys(err, KVR_ESYS, errno, "%s", dir);
    if (!S_ISDIR(st.st_mode))
        return kvr_error_set(err, KVR_EEXIST, "default socket directory %s is not a directory "
                             "(a symlink?): refusing to use it (remove it, or pass --socket PATH)",
                             dir);
    if (st.st_uid != geteuid())
        return kvr_error_set(err, KVR_EUNAUTH, "default socket directory %s belongs to uid %u, "
                             "not to us (uid %u): refusing to use it (another user could replace "
                             "the socket; remove it, or pass --socket PATH)", dir,
                             (unsigned)st.st_uid, (unsigned)geteuid());
    if (st.st_mode & (S_IWGRP | S_IWOTH))
        return kvr_error_set(err, KVR_EUNAUTH, "default socket directory %s is writable by %s "
                             "(mode %04o): refusing to use it (chmod 700 it, or pass --socket PATH)",
                             dir, (st.st_mode & S_IWOTH) ? "others" : "its group",
                             (unsigned)(st.st_mode & 07777));
    return 0;
}

/* A --socket path in a directory others may write to, sticky or not
 * (/tmp): warned about, not refused (docs/operations.md, "The socket
 * path"). Sticky: another user can create the path first (a socket of
 * theirs while ours is down, which clients then talk to, or a file that
 * stops us starting); not sticky: they can also replace ours. */
static void shared_dir_warning(const char *path)
{
    char dir[256];
    snprintf(dir, sizeof dir, "%s", path);
    char *slash = strrchr(dir, '/');
    if (!slash)
        snprintf(dir, sizeof dir, ".");
    else if (slash == dir)
        dir[1] = '\0';
    else
        *slash = '\0';
    struct stat st;
    if (stat(dir, &st) < 0 || !(st.st_mode & S_IWOTH))
        return;
    kvr_log(KVR_LOG_WARN, "--socket %s is in %s, a directory every user can write to (mode "
            "%04o): %s; put the socket in a directory only this user can write to (the "
            "default, $XDG_RUNTIME_DIR/kvrope or /run/kvrope)", path, dir,
            (unsigned)(st.st_mode & 07777),
            (st.st_mode & S_ISVTX)
                ? "another user can create this path before us, and clients would then talk "
                  "to their socket while ours is down"
                : "another user can remove or replace the socket");
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
        int rc = private_parent(d->sock_path, err);
        if (rc < 0)
            return rc;
    }
    if (strlen(d->sock_path) >= sizeof(((struct sockaddr_un *)0)->sun_path))
        return kvr_error_set(err, KVR_EINVAL, "socket path too long (max 107 bytes): %s",
                             d->sock_path);
    shared_dir_warning(d->sock_path);
    int rc = probe_socket_path(d->sock_path, err);
    if (rc < 0)
        return rc;
    /* Bound here rather than with uv_pipe_bind: libuv unlinks the path it
     * bound when the handle closes, whoever's socket it names by then
     *; remove_socket does it only while the inode is ours. */
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0)
        return kvr_error_sys(err, KVR_ESYS, errno, "unix socket %s", d->sock_path);
    struct sockaddr_un sa = { .sun_family = AF_UNIX };
    memcpy(sa.sun_path, d->sock_path, strlen(d->sock_path) + 1);
    mode_t old = umask(0177);
    int bind_rc = bind(fd, (struct sockaddr *)&sa, sizeof sa);
    int bind_errno = errno;
    umask(old);
    if (bind_rc < 0) {
        close(fd);
        return kvr_error_sys(err, KVR_ESYS, bind_errno, "unix socket %s", d->sock_path);
    }
    d->sock_created = true;
    struct stat st;
    if (lstat(d->sock_path, &st) == 0) {
        d->sock_dev = st.st_dev;
        d->sock_ino = st.st_ino;
    }
    if (chmod(d->sock_path, 0600) < 0) {
        int e = errno;
        close(fd);
        return kvr_error_sys(err, KVR_ESYS, e, "chmod %s", d->sock_path);
    }
    rc = uv_pipe_init(&d->loop, &d->unix_srv, 0);
    if (rc < 0) {
        close(fd);
        goto uv_fail;
    }
    d->has_unix = true;
    d->unix_srv.data = d;
    rc = uv_pipe_open(&d->unix_srv, fd);
    if (rc < 0) {
        close(fd);
        goto uv_fail;
    }
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
    if (kvr__daemon_split_listen(d->cfg.listen, host, sizeof host, &port) < 0)
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

int kvr__daemon_read_token(const char *path, uint8_t **tok, size_t *len, kvr_error *err)
{
    *tok = NULL;
    *len = 0;
    FILE *f = fopen(path, "rb");
    if (!f)
        return kvr_error_sys(err, KVR_EIO, errno, "--auth-token-file %s", path);
    /* Refused, as sshd refuses such a private key: anyone who can read
     * the token can use the daemon, and anyone who can write it can lock
     * every client out. */
    struct stat st;
    if (fstat(fileno(f), &st) == 0 && (st.st_mode & (S_IRWXG | S_IRWXO))) {
        fclose(f);
        return kvr_error_set(err, KVR_EUNAUTH, "--auth-token-file %s can be read or written by "
                             "%s (mode %04o): refusing it (anyone who reads it can use the "
                             "daemon); chmod 600 it (mode 0600 or 0400)", path,
                             (st.st_mode & S_IRWXO) ? "other users" : "its group",
                             (unsigned)(st.st_mode & 07777));
    }
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
    *tok = kvr_mem_malloc(n);
    if (!*tok)
        return kvr_error_set(err, KVR_ENOMEM, "--auth-token-file %s: out of memory for the token",
                             path);
    memcpy(*tok, buf, n);
    *len = n;
    return 0;
}

static int read_token(kvr_daemon *d, kvr_error *err)
{
    if (!d->cfg.auth_token_file[0])
        return 0;
    return kvr__daemon_read_token(d->cfg.auth_token_file, &d->token, &d->token_len, err);
}

/* ---- socket activation -------------------------------------------------------- */

/* Takes the sockets systemd passed (LISTEN_FDS/LISTEN_PID, unset for our
 * children): a Unix stream socket replaces --socket, a TCP one --listen,
 * one named "metrics" (FileDescriptorName=) serves /metrics. */
static int take_one(kvr_daemon *d, int fd, const char *name, int *metrics_fd, kvr_error *err)
{
    if (!strcmp(name, "metrics") && sd_is_socket(fd, AF_UNSPEC, SOCK_STREAM, 1) > 0) {
        if (*metrics_fd >= 0)
            return kvr_error_set(err, KVR_EINVAL, "socket activation: more than one metrics socket");
        *metrics_fd = fd;
        return 0;
    }
    int rc;
    if (sd_is_socket_unix(fd, SOCK_STREAM, 1, NULL, 0) > 0) {
        if (d->has_unix)
            return kvr_error_set(err, KVR_EINVAL, "socket activation: more than one Unix socket");
        struct sockaddr_un sa;
        socklen_t sl = sizeof sa;
        memset(&sa, 0, sizeof sa);
        if (getsockname(fd, (struct sockaddr *)&sa, &sl) == 0 && sa.sun_path[0])
            snprintf(d->sock_path, sizeof d->sock_path, "%.*s", (int)sizeof sa.sun_path,
                     sa.sun_path);
        else
            snprintf(d->sock_path, sizeof d->sock_path, "(fd %d)", fd);
        if ((rc = uv_pipe_init(&d->loop, &d->unix_srv, 0)) == 0) {
            d->has_unix = true;
            d->unix_srv.data = d;
            rc = uv_pipe_open(&d->unix_srv, fd);
        }
        if (rc == 0)
            rc = uv_listen((uv_stream_t *)&d->unix_srv, 128, on_connection);
        if (rc < 0)
            return kvr_error_sys(err, KVR_ESYS, -rc, "activated unix socket %s", d->sock_path);
        d->unix_activated = true;
        kvr_log(KVR_LOG_INFO, "listening on unix socket %s (socket activation)", d->sock_path);
        return 0;
    }
    if (sd_is_socket_inet(fd, AF_UNSPEC, SOCK_STREAM, 1, 0) > 0) {
        if (d->has_tcp)
            return kvr_error_set(err, KVR_EINVAL, "socket activation: more than one TCP socket");
        struct sockaddr_storage ss;
        socklen_t sl = sizeof ss;
        if (getsockname(fd, (struct sockaddr *)&ss, &sl) < 0 ||
            (!kvr__daemon_sockaddr_is_loopback((struct sockaddr *)&ss) && !d->token))
            return kvr_error_set(err, KVR_EINVAL, "the activated TCP socket is not on a loopback "
                                 "address: it requires --auth-token-file FILE");
        if ((rc = uv_tcp_init(&d->loop, &d->tcp_srv)) == 0) {
            d->has_tcp = true;
            d->tcp_srv.data = d;
            rc = uv_tcp_open(&d->tcp_srv, fd);
        }
        if (rc == 0)
            rc = uv_listen((uv_stream_t *)&d->tcp_srv, 128, on_connection);
        if (rc < 0)
            return kvr_error_sys(err, KVR_ESYS, -rc, "activated tcp socket");
        d->tcp_activated = true;
        kvr_log(KVR_LOG_INFO, "listening on tcp (socket activation, fd %d)%s", fd,
                d->token ? " (auth required)" : "");
        return 0;
    }
    return kvr_error_set(err, KVR_EINVAL, "socket activation: fd %d (%s) is not a listening "
                         "stream socket", fd, name[0] ? name : "unnamed");
}

static int take_activated(kvr_daemon *d, int *metrics_fd, kvr_error *err)
{
    char **names = NULL;
    int n = sd_listen_fds_with_names(1, &names);
    if (n < 0)
        return kvr_error_sys(err, KVR_ESYS, -n, "socket activation (LISTEN_FDS)");
    int rc = 0;
    for (int i = 0; i < n && rc == 0; i++)
        rc = take_one(d, SD_LISTEN_FDS_START + i, names && names[i] ? names[i] : "", metrics_fd,
                      err);
    if (names) {
        for (int i = 0; i < n; i++)
            free(names[i]);
        free(names);
    }
    return rc;
}

/* ---- timers, signals, stop --------------------------------------------------- */

/* Freed pages the allocator keeps for reuse (main.c's malloc_conf) go back
 * to the kernel once no request arrived for --idle-purge seconds, and only
 * when the operator asked for it: given back, they cost the next puts the
 * kernel's first touch again (0.35 GB/s against 23 GB/s on a VM that
 * reports free pages to its host). */

/* Freed blocks the store keeps for the next puts (cache/block.h): a put
 * REPLACE takes the block the previous one freed instead of a fresh 1 MiB
 * allocation and free. */
#define KVR_DAEMON_BLOCK_CACHE ((size_t)16 << 20)

static void idle_purge(kvr_daemon *d, uint64_t now)
{
    if (d->n_requests != d->purge_seen) {
        d->purge_seen = d->n_requests;
        d->purge_idle_ms = now;
        d->purged = false;
        return;
    }
    if (d->purged || d->cfg.idle_purge == 0 ||
        now - d->purge_idle_ms < (uint64_t)d->cfg.idle_purge * 1000u)
        return;
    d->purged = true;
    kvr_store_trim(d->store);   /* the block cache and the kept staging buffer too */
#ifdef KVR_JEMALLOC
    (void)mallctl("arena." KVR_STR(MALLCTL_ARENAS_ALL) ".purge", NULL, NULL, NULL, 0);
#endif
}

static void on_sweep(uv_timer_t *t)
{
    kvr_daemon *d = t->data;
    uint64_t now = kvr_clock_mono_ms();
    idle_purge(d, now);
    bool force = d->stopping && now >= d->stop_ms + KVR_STOP_GRACE_MS;
    for (kvr_list *l = d->conns.next, *n; l != &d->conns; l = n) {
        n = l->next;
        kvr_conn *c = kvr_list_entry(l, kvr_conn, link);
        kvr__conn_sweep(c, now, force);
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
    if (signum == SIGHUP) {
        kvr_log(KVR_LOG_INFO, "SIGHUP received: reopening the log, reloading the configuration");
        kvr_daemon_reload(d);
        return;
    }
    kvr_log(KVR_LOG_INFO, "%s received: stopping", signum == SIGINT ? "SIGINT" : "SIGTERM");
    kvr_daemon_stop(d);
}

int kvr_daemon_handle_signals(kvr_daemon *d)
{
    int rc = uv_signal_init(&d->loop, &d->sig_int);
    if (rc == 0)
        rc = uv_signal_init(&d->loop, &d->sig_term);
    if (rc == 0)
        rc = uv_signal_init(&d->loop, &d->sig_hup);
    if (rc < 0)
        return rc;
    d->has_signals = true;
    d->sig_int.data = d;
    d->sig_term.data = d;
    d->sig_hup.data = d;
    uv_signal_start(&d->sig_int, on_signal, SIGINT);
    uv_signal_start(&d->sig_term, on_signal, SIGTERM);
    uv_signal_start(&d->sig_hup, on_signal, SIGHUP);
    /* SIGHUP must not keep the loop alive on its own (SIGINT/SIGTERM do
     * not either once the listeners are closed: they are closed at stop). */
    uv_unref((uv_handle_t *)&d->sig_hup);
    return 0;
}

/* No new connections; each listener is closed once (stop, then destroy). */
static void close_listeners(kvr_daemon *d)
{
    kvr__uv_close_once((uv_handle_t *)&d->unix_srv, &d->has_unix);
    kvr__uv_close_once((uv_handle_t *)&d->tcp_srv, &d->has_tcp);
}

/* fn on every open connection; fn may unlink the one it is given. */
static void conns_each(kvr_daemon *d, void (*fn)(kvr_conn *c))
{
    for (kvr_list *l = d->conns.next, *n; l != &d->conns; l = n) {
        n = l->next;
        fn(kvr_list_entry(l, kvr_conn, link));
    }
}

static void close_signals(kvr_daemon *d)
{
    if (d->has_signals) {
        uv_close((uv_handle_t *)&d->sig_int, NULL);
        uv_close((uv_handle_t *)&d->sig_term, NULL);
        uv_close((uv_handle_t *)&d->sig_hup, NULL);
        d->has_signals = false;
    }
}

/* Unlinks the socket file only while it is still the one we bound: if the
 * path was removed and another kvroped bound it since, that socket is its
 * own. The check and the unlink are two calls; a replacement in
 * between cannot be excluded, but only by a process that can write the
 * directory, which is ours alone for the default path. */
static void remove_socket(kvr_daemon *d)
{
    if (!d->sock_created)
        return;
    d->sock_created = false;
    struct stat st;
    if (lstat(d->sock_path, &st) < 0)
        return;          /* already gone */
    if (st.st_dev != d->sock_dev || st.st_ino != d->sock_ino || !S_ISSOCK(st.st_mode)) {
        kvr_log(KVR_LOG_INFO, "%s is no longer our socket (replaced since we bound it): "
                "leaving it", d->sock_path);
        return;
    }
    if (unlink(d->sock_path) < 0 && errno != ENOENT)
        kvr_log(KVR_LOG_WARN, "cannot remove %s: %s", d->sock_path, strerror(errno));
}

/* ---- systemd notification, reload -------------------------------------------- */

static void notify_status(kvr_daemon *d, const char *state)
{
    char msg[600];
    snprintf(msg, sizeof msg, "%sSTATUS=%s: %zu connections; unix %s; tcp %s; metrics %s",
             state, d->stopping ? "stopping" : "serving", d->n_conns,
             d->has_unix || d->unix_activated ? d->sock_path : "off",
             d->has_tcp ? (d->tcp_activated ? "activated" : d->cfg.listen) : "off",
             kvr__metrics_address(d->metrics)[0] ? kvr__metrics_address(d->metrics) : "off");
    sd_notify(0, msg);
}

void kvr_daemon_set_args(kvr_daemon *d, int argc, char **argv)
{
    d->argc = argc;
    d->argv = argv;
}

void kvr_daemon_reload(kvr_daemon *d)
{
    if (d->stopping)
        return;
    sd_notify(0, "RELOADING=1\nSTATUS=reloading");
    kvr_error err = { 0 };
    kvr_daemon_config nc = d->cfg;
    bool parsed = true;
    if (d->argv) {
        kvr_daemon_config_init(&nc);
        FILE *sink = fopen("/dev/null", "w");
        char *buf = NULL;
        size_t blen = 0;
        FILE *errs = open_memstream(&buf, &blen);
        int rc = kvr_daemon_config_parse_args(&nc, d->argc, d->argv, sink ? sink : stdout,
                                              errs ? errs : stderr);
        if (errs)
            fclose(errs);
        if (sink)
            fclose(sink);
        if (rc != 0) {
            size_t n = buf ? strlen(buf) : 0;
            while (n > 0 && buf[n - 1] == '\n')
                buf[--n] = '\0';
            kvr_log(KVR_LOG_ERROR, "reload: the configuration does not parse, nothing changed: %s",
                    buf && buf[0] ? buf : "(no message)");
            parsed = false;
        }
        free(buf);
    }
    if (!parsed)
        nc = d->cfg;
    /* The log first, so what follows lands in the new one. */
    if (kvr_log_open(nc.log_file, &err) < 0) {
        kvr_log(KVR_LOG_ERROR, "reload: %s (keeping the current log)", err.msg);
        snprintf(nc.log_file, sizeof nc.log_file, "%s", d->cfg.log_file);
    }
    kvr_log_set_level(nc.log_level);
    kvr_log_set_format(nc.log_format);
    if (!parsed) {
        notify_status(d, "READY=1\n");
        return;
    }
    /* The token: re-read (rotated secrets); new connections and scrapes
     * use the new one, authenticated connections stay. */
    if (nc.auth_token_file[0]) {
        uint8_t *tok;
        size_t len;
        if (kvr__daemon_read_token(nc.auth_token_file, &tok, &len, &err) < 0) {
            kvr_log(KVR_LOG_ERROR, "reload: %s (keeping the current token)", err.msg);
            snprintf(nc.auth_token_file, sizeof nc.auth_token_file, "%s", d->cfg.auth_token_file);
        } else if (kvr__metrics_set_token(d->metrics, tok, len) < 0) {
            kvr_mem_free(tok);
            kvr_log(KVR_LOG_ERROR, "reload: out of memory (keeping the current token)");
            snprintf(nc.auth_token_file, sizeof nc.auth_token_file, "%s", d->cfg.auth_token_file);
        } else {
            kvr_mem_free(d->token);
            d->token = tok;
            d->token_len = len;
        }
    } else if (d->cfg.auth_token_file[0]) {
        /* Dropping auth while running could expose a non-loopback port. */
        kvr_log(KVR_LOG_WARN, "reload: auth-token-file cannot be removed while running "
                "(restart to change it); keeping the current token");
        snprintf(nc.auth_token_file, sizeof nc.auth_token_file, "%s", d->cfg.auth_token_file);
    }
    /* What only a restart can change: reported and kept. */
    const kvr_daemon_config *o = &d->cfg;
    struct { const char *name; bool changed; } fixed[] = {
        { "socket", strcmp(o->socket_path, nc.socket_path) != 0 },
        { "listen", strcmp(o->listen, nc.listen) != 0 },
        { "metrics-listen", strcmp(o->metrics_listen, nc.metrics_listen) != 0 },
        { "max-memory", o->max_memory != nc.max_memory },
        { "max-memory-per-model", o->max_memory_per_model != nc.max_memory_per_model },
        { "max-frame", o->max_frame != nc.max_frame },
        { "block-tokens", o->block_tokens != nc.block_tokens },
        { "threads", o->threads != nc.threads },
        { "disk-dir", strcmp(o->disk_dir, nc.disk_dir) != 0 },
        { "disk-max", o->disk_max != nc.disk_max },
        { "disk-engine", o->disk_engine != nc.disk_engine },
        { "persist-all", o->persist_all != nc.persist_all },
        { "max-regions-total", o->max_regions_total != nc.max_regions_total },
    };
    for (size_t i = 0; i < sizeof fixed / sizeof fixed[0]; i++)
        if (fixed[i].changed)
            kvr_log(KVR_LOG_WARN, "reload: %s changed but needs a restart: keeping the "
                    "current value", fixed[i].name);
    kvr_daemon_config applied = *o;
    snprintf(applied.log_file, sizeof applied.log_file, "%s", nc.log_file);
    applied.log_level = nc.log_level;
    applied.log_format = nc.log_format;
    snprintf(applied.auth_token_file, sizeof applied.auth_token_file, "%s", nc.auth_token_file);
    applied.io_timeout = nc.io_timeout;
    applied.auth_timeout = nc.auth_timeout;
    applied.max_connections = nc.max_connections;
    applied.max_unauth_connections = nc.max_unauth_connections;
    applied.max_conn_buffer = nc.max_conn_buffer;
    applied.max_drain = nc.max_drain;
    d->cfg = applied;
    kvr_log(KVR_LOG_INFO, "reloaded: log-level %d, log-format %s, io-timeout %u s, "
            "auth-timeout %u s, max-connections %u, max-unauth-connections %u, "
            "max-conn-buffer %llu, max-drain %llu%s", (int)applied.log_level,
            applied.log_format == KVR_LOG_FORMAT_JSON ? "json" : "text", applied.io_timeout,
            applied.auth_timeout, applied.max_connections, applied.max_unauth_connections,
            (unsigned long long)applied.max_conn_buffer, (unsigned long long)applied.max_drain,
            d->token ? ", token re-read" : "");
    notify_status(d, "READY=1\n");
}

void kvr_daemon_stop(kvr_daemon *d)
{
    if (d->stopping)
        return;
    d->stopping = true;
    d->stop_ms = kvr_clock_mono_ms();
    notify_status(d, "STOPPING=1\n");
    kvr__metrics_stop(d);
    remove_socket(d);
    close_listeners(d);
    close_signals(d);
    conns_each(d, kvr__conn_stop);
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
    kvr_list_init(&d->conns);
    kvr_list_init(&d->fetch_waiters);
    d->cfg = *cfg;
    d->start_ms = kvr_clock_mono_ms();
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
    kvr__shm_init(d);     /* the region cap over all connections */
    int rc = uv_loop_init(&d->loop);
    if (rc < 0) {
        kvr_mem_free(d);
        return kvr_error_sys(err, KVR_EINTERNAL, -rc, "uv_loop_init");
    }
    /* The worker pool for rotation and codecs (base/pool.c), started now
     * rather than by the first large get. */
    (void)kvr_pool_default();
    /* Contexts and models count against limits too: by default
     * one context per 4 KiB of the cap (its metadata is not evictable). */
    size_t max_ctx = cfg->max_contexts ? (size_t)cfg->max_contexts
                                       : (size_t)(cfg->max_memory / 4096);
    if (!cfg->max_contexts && max_ctx < 1024)
        max_ctx = 1024;
    kvr_store_config sc = { .max_memory = cfg->max_memory, .block_tokens = cfg->block_tokens,
                            .max_memory_per_model = cfg->max_memory_per_model,
                            .max_contexts = max_ctx, .max_models = cfg->max_models,
                            .block_cache = KVR_DAEMON_BLOCK_CACHE };
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
    if ((rc = kvr__persist_open(d, pmsg, sizeof pmsg)) < 0) {
        kvr_error_set(err, rc, "%s", pmsg[0] ? pmsg : kvr_strerror(rc));
        goto fail;
    }
    /* Shared tier: a wrong password stops the start; an unreachable
     * cluster is logged and joined later. */
    if ((rc = kvr__remote_create(&d->remote, d, err)) < 0)
        goto fail;
    kvr__dispatch_tier_install(d);   /* the store asks it on a miss */
    int metrics_fd = -1;
    if ((rc = take_activated(d, &metrics_fd, err)) < 0)
        goto fail;
    if (!d->unix_activated && (rc = listen_unix(d, err)) < 0)
        goto fail;
    if (!d->tcp_activated && (rc = listen_tcp(d, err)) < 0)
        goto fail;
    if ((rc = kvr__metrics_create(d, metrics_fd, err)) < 0)
        goto fail;
    uv_timer_init(&d->loop, &d->sweep);
    d->sweep.data = d;
    d->has_sweep = true;
    uv_timer_start(&d->sweep, on_sweep, 250, 250);
    uv_unref((uv_handle_t *)&d->sweep);
    if ((rc = kvr__warm_start(d, err)) < 0)
        goto fail;
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
    conns_each(d, kvr__conn_close);
    close_listeners(d);
    close_signals(d);
    kvr__warm_stop(d);
    kvr__metrics_stop(d);
    kvr__uv_close_once((uv_handle_t *)&d->sweep, &d->has_sweep);
    kvr__remote_close(d->remote);
    uv_run(&d->loop, UV_RUN_DEFAULT);
    if (uv_loop_close(&d->loop) == UV_EBUSY) {
        uv_walk(&d->loop, close_walk, NULL);
        uv_run(&d->loop, UV_RUN_DEFAULT);
        uv_loop_close(&d->loop);
    }
    kvr__metrics_destroy(d);
    kvr_store_set_miss_hooks(d->store, NULL);
    kvr__remote_destroy(d->remote);
    kvr_store_destroy(d->store);
    kvr_mem_free(d->token);
    kvr_mem_free(d);
}

int kvr_daemon_main(int argc, char **argv)
{
    /* Before any other libuv call. */
    kvr_daemon_init_allocator();
    signal(SIGPIPE, SIG_IGN);
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *file = NULL;
        if (!strncmp(a, "--check-config=", 15))
            file = a + 15;
        else if (!strcmp(a, "--check-config"))
            file = i + 1 < argc ? argv[i + 1] : "";
        else
            continue;
        if (argc != (a[14] == '=' ? 2 : 3) || !file[0]) {
            fprintf(stderr, "kvroped: usage: kvroped --check-config FILE (alone)\n");
            return 2;
        }
        return kvr_daemon_check_config_file(file, stdout, stderr);
    }
    kvr_daemon_config cfg;
    kvr_daemon_config_init(&cfg);
    int rc = kvr_daemon_config_parse_args(&cfg, argc, argv, stdout, stderr);
    if (rc == 1)
        return 0;
    if (rc < 0)
        return 2;
    kvr_log_set_level(cfg.log_level);
    kvr_log_set_format(cfg.log_format);
    if (cfg.log_file[0]) {
        kvr_error lerr = { 0 };
        if (kvr_log_open(cfg.log_file, &lerr) < 0) {
            fprintf(stderr, "kvroped: %s\n", lerr.msg);
            return 1;
        }
    }
    if (cfg.threads) {
        char n[16];
        snprintf(n, sizeof n, "%u", cfg.threads);
        setenv("UV_THREADPOOL_SIZE", n, 1);
    }
    /* SIGINT/SIGTERM/SIGHUP stay blocked from before the socket exists until
     * libuv's handlers are in: a stop sent as soon as the socket answers (a
     * service manager, a test) is then handled, not fatal. Threads started
     * in between keep them blocked, so they reach the loop thread. */
    sigset_t stops, old;
    sigemptyset(&stops);
    sigaddset(&stops, SIGINT);
    sigaddset(&stops, SIGTERM);
    sigaddset(&stops, SIGHUP);
    pthread_sigmask(SIG_BLOCK, &stops, &old);
    kvr_error err = { 0 };
    kvr_daemon *d;
    rc = kvr_daemon_create(&d, &cfg, &err);
    if (rc < 0) {
        kvr_log(KVR_LOG_ERROR, "cannot start: %s", err.msg[0] ? err.msg : kvr_strerror(rc));
        char st[400];
        snprintf(st, sizeof st, "STATUS=cannot start: %s", err.msg[0] ? err.msg : kvr_strerror(rc));
        sd_notify(0, st);
        return 1;
    }
    kvr_daemon_set_args(d, argc, argv);
    if (kvr_daemon_handle_signals(d) < 0) {
        kvr_log(KVR_LOG_ERROR, "cannot install signal handlers");
        kvr_daemon_destroy(d);
        return 1;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);   /* a stop that came meanwhile is taken now */
    kvr_log(KVR_LOG_INFO, "kvroped %s ready: memory cap %llu bytes, max frame %u bytes",
            KVR_DAEMON_VERSION, (unsigned long long)cfg.max_memory, cfg.max_frame);
    notify_status(d, "READY=1\n");
    kvr_daemon_run(d);
    kvr_daemon_destroy(d);
    kvr_log(KVR_LOG_INFO, "stopped");
    return 0;
}
