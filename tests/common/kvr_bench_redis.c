/*
 * kvr_bench_redis.c — tests/common/kvr_bench_redis.h: peer processes and a minimal RESP client for the socket benches.
 * Compiled once into libtestcommon.a.
 */
#include "tests/common/kvr_bench_redis.h"

#include "client/kvrope.h"

pid_t bench_spawn(const char *const *argv, const char *log)
{
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGTERM);
        if (getppid() != parent)
            _exit(127);
        if (!freopen(log, "w", stdout) || !freopen(log, "a", stderr))
            _exit(127);
        execvp(argv[0], (char *const *)(uintptr_t)argv);
        _exit(127);
    }
    return pid;
}

void bench_stop(pid_t pid)
{
    if (pid <= 0)
        return;
    kill(pid, SIGTERM);
    for (int i = 0; i < 500; i++) {
        if (waitpid(pid, NULL, WNOHANG) == pid)
            return;
        kvt_sleep_ms(10);
    }
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
}

int resp_connect(resp *r, const char *path)
{
    memset(r, 0, sizeof *r);
    struct sockaddr_un sa = { .sun_family = AF_UNIX };
    snprintf(sa.sun_path, sizeof sa.sun_path, "%s", path);
    r->fd = socket(AF_UNIX, SOCK_STREAM, 0);
    if (r->fd < 0 || connect(r->fd, (struct sockaddr *)&sa, sizeof sa) < 0) {
        if (r->fd >= 0)
            close(r->fd);
        return -1;
    }
    int sz = 4 << 20;
    setsockopt(r->fd, SOL_SOCKET, SO_SNDBUF, &sz, sizeof sz);
    setsockopt(r->fd, SOL_SOCKET, SO_RCVBUF, &sz, sizeof sz);
    return 0;
}

int resp_fill(resp *r)
{
    if (r->pos == r->len)
        r->pos = r->len = 0;
    ssize_t n = read(r->fd, r->buf + r->len, sizeof r->buf - r->len);
    if (n <= 0)
        return -1;
    r->len += (size_t)n;
    return 0;
}

int resp_line(resp *r, char *line, size_t cap)
{
    for (;;) {
        char *nl = memchr(r->buf + r->pos, '\n', r->len - r->pos);
        if (nl) {
            size_t n = (size_t)(nl - (r->buf + r->pos));
            if (n && nl[-1] == '\r')
                n--;
            if (n >= cap)
                n = cap - 1;
            memcpy(line, r->buf + r->pos, n);
            line[n] = 0;
            r->pos = (size_t)(nl - r->buf) + 1;
            return 0;
        }
        if (r->pos > 0 && r->len == sizeof r->buf) {
            memmove(r->buf, r->buf + r->pos, r->len - r->pos);
            r->len -= r->pos;
            r->pos = 0;
        }
        if (resp_fill(r) < 0)
            return -1;
    }
}

int resp_read(resp *r, void *dst, size_t n)
{
    uint8_t *p = dst;
    size_t have = r->len - r->pos, k = have < n ? have : n;
    memcpy(p, r->buf + r->pos, k);
    r->pos += k;
    while (k < n) {
        ssize_t got = read(r->fd, p + k, n - k);
        if (got <= 0)
            return -1;
        k += (size_t)got;
    }
    return 0;
}

int resp_writev(int fd, struct iovec *iov, int n)
{
    while (n > 0) {
        ssize_t w = writev(fd, iov, n);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        while (n > 0 && (size_t)w >= iov->iov_len) {
            w -= (ssize_t)iov->iov_len;
            iov++;
            n--;
        }
        if (n > 0) {
            iov->iov_base = (char *)iov->iov_base + w;
            iov->iov_len -= (size_t)w;
        }
    }
    return 0;
}

int resp_set(resp *r, const char *key, const void *val, size_t len)
{
    char hdr[256];
    int hl = snprintf(hdr, sizeof hdr, "*3\r\n$3\r\nSET\r\n$%zu\r\n%s\r\n$%zu\r\n", strlen(key),
                      key, len);
    struct iovec iov[3] = { { hdr, (size_t)hl }, { (void *)(uintptr_t)val, len }, { "\r\n", 2 } };
    if (resp_writev(r->fd, iov, 3) < 0)
        return -1;
    char line[128];
    if (resp_line(r, line, sizeof line) < 0 || line[0] != '+')
        return -1;
    return 0;
}

int resp_get(resp *r, const char *key, void *dst, size_t cap)
{
    char hdr[256];
    int hl = snprintf(hdr, sizeof hdr, "*2\r\n$3\r\nGET\r\n$%zu\r\n%s\r\n", strlen(key), key);
    struct iovec iov[1] = { { hdr, (size_t)hl } };
    if (resp_writev(r->fd, iov, 1) < 0)
        return -1;
    char line[128], crlf[2];
    if (resp_line(r, line, sizeof line) < 0 || line[0] != '$')
        return -1;
    long n = atol(line + 1);
    if (n < 0 || (size_t)n > cap)
        return -1;
    if (resp_read(r, dst, (size_t)n) < 0 || resp_read(r, crlf, 2) < 0)
        return -1;
    return 0;
}

int resp_prepare(resp *r, const char *sock, int set, const char *key, const void *val,
                 size_t len)
{
    if (resp_connect(r, sock) < 0)
        return -1;
    return set && resp_set(r, key, val, len) < 0 ? -1 : 0;
}

int bench_drop_old(struct kvr_client *c, int job, int slice, long ops, long keep)
{
    if (ops < keep)
        return 0;
    char old[64];
    snprintf(old, sizeof old, "p%d-%d-%ld", job, slice, ops - keep);
    return kvr_client_delete_deferred(c, old);
}

int bench_peers_start(bench_peers *b, const char *name, const char *tmpl, uint32_t layers,
                      uint32_t heads, uint32_t dim)
{
    memset(b, 0, sizeof *b);
    snprintf(b->dir, sizeof b->dir, "%s", tmpl);
    if (!mkdtemp(b->dir)) {
        perror("mkdtemp");
        return -1;
    }
    const char *bd = getenv("KVR_BUILD");
    snprintf(b->kvsock, sizeof b->kvsock, "%s/kvroped.sock", b->dir);
    snprintf(b->rsock, sizeof b->rsock, "%s/redis.sock", b->dir);
    snprintf(b->kvlog, sizeof b->kvlog, "%s/kvroped.log", b->dir);
    snprintf(b->rlog, sizeof b->rlog, "%s/redis.log", b->dir);
    snprintf(b->bin, sizeof b->bin, "%s/kvroped", bd && *bd ? bd : "./build");
    snprintf(b->addr, sizeof b->addr, "unix:%s", b->kvsock);

    const char *kv_argv[] = { b->bin, "--socket", b->kvsock, "--max-memory", "4G",
                              "--log-level", "warn", NULL };
    b->kvpid = bench_spawn(kv_argv, b->kvlog);
    const char *r_argv[] = { "redis-server", "--port", "0", "--unixsocket", b->rsock,
                             "--save", "", "--appendonly", "no", "--dir", b->dir, NULL };
    b->rpid = bench_spawn(r_argv, b->rlog);

    kvr_client *c = NULL;
    for (int i = 0; i < 500 && !c; i++) {
        if (kvr_client_connect(&c, b->addr, NULL) < 0) {
            c = NULL;
            kvt_sleep_ms(10);
        }
    }
    for (int i = 0; i < 500 && !b->have_redis; i++) {
        resp r;
        if (resp_connect(&r, b->rsock) == 0) {
            b->have_redis = 1;
            close(r.fd);
        } else {
            kvt_sleep_ms(10);
        }
    }
    if (!c) {
        fprintf(stderr, "%s: kvroped (%s) did not start; see %s\n", name, b->bin, b->kvlog);
        bench_peers_stop(b);
        return -1;
    }
    if (!b->have_redis)
        fprintf(stderr, "%s: redis-server did not start; Redis columns absent\n", name);
    kvr_rope_config rc;
    kvr_rope_config_init(&rc);
    kvr_model_params mp = { .name = "bench", .n_layers = layers, .n_kv_heads = heads,
                            .head_dim = dim, .dtype = KVR_DTYPE_F16, .rope = &rc };
    int rr = kvr_client_model_register(c, &mp, NULL);
    if (rr < 0)
        fprintf(stderr, "%s: register: %s\n", name, kvr_client_last_error(c));
    kvr_client_close(c);
    if (rr < 0) {
        bench_peers_stop(b);
        return -1;
    }
    return 0;
}

void bench_peers_stop(bench_peers *b)
{
    bench_stop(b->kvpid);
    bench_stop(b->rpid);
    b->kvpid = b->rpid = 0;
    unlink(b->kvsock);
    unlink(b->rsock);
    unlink(b->kvlog);
    unlink(b->rlog);
    char dump[200];
    snprintf(dump, sizeof dump, "%s/dump.rdb", b->dir);
    unlink(dump);
    rmdir(b->dir);
}
