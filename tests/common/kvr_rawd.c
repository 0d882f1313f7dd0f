/*
 * kvr_rawd.c — tests/common/kvr_rawd.h: a kvroped spoken to in raw frames.
 * Compiled once into libtestcommon.a.
 */
#include "tests/common/kvr_rawd.h"
#include "tests/common/kvt_wire.h"

daemon_proc D;

const char *kvroped_path(void)
{
    static char path[512];
    const char *b = getenv("KVR_BUILD");
    snprintf(path, sizeof path, "%s/kvroped", b && b[0] ? b : "./build");
    return path;
}

pid_t start_daemon_args(const char *sock, const char *const *extra)
{
    const char *argv[32];
    int n = 0;
    argv[n++] = kvroped_path();
    argv[n++] = "--socket";
    argv[n++] = sock;
    argv[n++] = "--max-memory";
    argv[n++] = "256M";
    for (int i = 0; extra && extra[i] && n < 30; i++)
        argv[n++] = extra[i];
    argv[n] = NULL;
    pid_t pid = fork();
    cr_assert_neq(pid, -1);
    if (pid == 0) {
        int fd = open(D.log, O_WRONLY | O_CREAT | O_APPEND, 0600);
        if (fd >= 0) {
            dup2(fd, 2);
            close(fd);
        }
        execv(argv[0], (char *const *)(uintptr_t)argv);
        _exit(127);
    }
    return pid;
}

int connect_unix(const char *path)
{
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    cr_assert_geq(fd, 0);
    struct sockaddr_un sa = { .sun_family = AF_UNIX };
    snprintf(sa.sun_path, sizeof sa.sun_path, "%s", path);
    if (connect(fd, (struct sockaddr *)&sa, sizeof sa) < 0) {
        close(fd);
        return -1;
    }
    struct timeval tv = { 10, 0 };
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    return fd;
}

void wait_ready(const char *sock, pid_t pid)
{
    for (int i = 0; i < 1000; i++) {
        int fd = connect_unix(sock);
        if (fd >= 0) {
            close(fd);
            return;
        }
        int st;
        if (waitpid(pid, &st, WNOHANG) == pid)
            cr_assert_fail("kvroped exited during startup (see %s)", D.log);
        kvt_sleep_ms(10);
    }
    cr_assert_fail("kvroped did not start within 10 s (see %s)", D.log);
}

void start_daemon(const char *const *extra)
{
    D.pid = start_daemon_args(D.sock, extra);
    wait_ready(D.sock, D.pid);
}

void setup(void)
{
    signal(SIGPIPE, SIG_IGN);
    snprintf(D.dir, sizeof D.dir, "/tmp/kvr-test-XXXXXX");
    cr_assert_not_null(mkdtemp(D.dir));
    snprintf(D.sock, sizeof D.sock, "%s/kvroped.sock", D.dir);
    snprintf(D.log, sizeof D.log, "%s/kvroped.log", D.dir);
    D.pid = 0;
}

void dump_log(void)
{
    FILE *f = fopen(D.log, "r");
    if (!f)
        return;
    char line[1024];
    while (fgets(line, sizeof line, f))
        fprintf(stderr, "  kvroped: %s", line);
    fclose(f);
}

void stop_daemon_clean(void)
{
    if (D.pid <= 0)
        return;
    cr_assert_eq(kill(D.pid, SIGTERM), 0);
    int st = 0;
    pid_t w = 0;
    for (int i = 0; i < 3000 && w == 0; i++) {
        w = waitpid(D.pid, &st, WNOHANG);
        if (w == 0)
            kvt_sleep_ms(10);
    }
    if (w == 0) {
        kill(D.pid, SIGKILL);
        waitpid(D.pid, &st, 0);
    }
    D.pid = 0;
    if (!(WIFEXITED(st) && WEXITSTATUS(st) == 0))
        dump_log();
    cr_assert(w != 0, "kvroped did not stop within 30 s of SIGTERM");
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "kvroped exit status %d", st);
}

void teardown(void)
{
    if (D.pid > 0) {
        kill(D.pid, SIGKILL);
        waitpid(D.pid, NULL, 0);
    }
    char cmd[200];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", D.dir);
    if (system(cmd) != 0)
        fprintf(stderr, "cleanup of %s failed\n", D.dir);
}

int read_all(int fd, void *p, size_t n)
{
    uint8_t *b = p;
    size_t got = 0;
    while (got < n) {
        ssize_t k = read(fd, b + got, n - got);
        if (k < 0 && errno == EINTR)
            continue;
        if (k == 0)
            return got == 0 ? 0 : -1;
        if (k < 0)
            return got == 0 && errno == ECONNRESET ? 0 : -1;
        got += (size_t)k;
    }
    return 1;
}

void send_req(int fd, Kvrope__Request *r, const void *payload, uint64_t plen)
{
    size_t n = kvrope__request__get_packed_size(r);
    uint8_t *buf = malloc(KVR_FRAME_HEADER_SIZE + n);
    kvrope__request__pack(r, buf + KVR_FRAME_HEADER_SIZE);
    kvr_frame_header_encode(buf, (uint32_t)n, plen);
    cr_assert_eq(kvt_write_all(fd, buf, KVR_FRAME_HEADER_SIZE + n), 0);
    free(buf);
    if (payload && plen)
        cr_assert_eq(kvt_write_all(fd, payload, (size_t)plen), 0);
}

Kvrope__Response *recv_resp(int fd, uint8_t **payload, uint64_t *plen)
{
    uint8_t h[KVR_FRAME_HEADER_SIZE];
    int rc = read_all(fd, h, sizeof h);
    cr_assert_eq(rc, 1, "no response header (rc %d, errno %d)", rc, errno);
    kvr_frame_header fh;
    cr_assert_eq(kvr_frame_header_decode(h, &fh, NULL), 0);
    uint8_t *m = malloc(fh.msg_len + 1);
    cr_assert_eq(read_all(fd, m, fh.msg_len), fh.msg_len ? 1 : 0);
    Kvrope__Response *r = kvrope__response__unpack(NULL, fh.msg_len, m);
    free(m);
    cr_assert_not_null(r, "response does not decode");
    uint8_t *p = NULL;
    if (fh.payload_len) {
        p = malloc((size_t)fh.payload_len);
        cr_assert_eq(read_all(fd, p, (size_t)fh.payload_len), 1);
    }
    if (payload)
        *payload = p;
    else
        free(p);
    if (plen)
        *plen = fh.payload_len;
    return r;
}

void expect_eof(int fd)
{
    uint8_t b[256];
    for (int i = 0; i < 100; i++) {
        ssize_t k = read(fd, b, sizeof b);
        if (k == 0 || (k < 0 && errno == ECONNRESET))
            return;
        cr_assert(k > 0, "expected EOF, got error %d", errno);
    }
    cr_assert_fail("expected the daemon to close the connection");
}

Kvrope__Status ping(int fd, uint64_t id)
{
    Kvrope__Request q = KVROPE__REQUEST__INIT;
    Kvrope__Ping p = KVROPE__PING__INIT;
    q.id = id;
    q.body_case = KVROPE__REQUEST__BODY_PING;
    q.ping = &p;
    send_req(fd, &q, NULL, 0);
    Kvrope__Response *r = recv_resp(fd, NULL, NULL);
    cr_assert_eq(r->id, id);
    Kvrope__Status st = r->status;
    if (st == KVROPE__STATUS__OK) {
        cr_assert_eq(r->body_case, KVROPE__RESPONSE__BODY_PONG);
        cr_assert_eq(r->pong->protocol, 1);
    }
    kvrope__response__free_unpacked(r, NULL);
    return st;
}

void register_model(int fd)
{
    Kvrope__Request q = KVROPE__REQUEST__INIT;
    Kvrope__RegisterModel m = KVROPE__REGISTER_MODEL__INIT;
    m.name = "tiny";
    m.has_n_layers = m.has_n_kv_heads = m.has_head_dim = 1;
    m.n_layers = NL;
    m.n_kv_heads = NH;
    m.head_dim = HD;
    m.has_dtype = 1;
    m.dtype = KVROPE__DTYPE__F16;
    q.id = 7;
    q.body_case = KVROPE__REQUEST__BODY_REGISTER_MODEL;
    q.register_model = &m;
    send_req(fd, &q, NULL, 0);
    Kvrope__Response *r = recv_resp(fd, NULL, NULL);
    cr_assert_eq(r->status, KVROPE__STATUS__OK, "register_model: %s", r->message);
    cr_assert_eq(r->body_case, KVROPE__RESPONSE__BODY_MODEL);
    cr_assert_eq(r->model->n_layers, NL);
    kvrope__response__free_unpacked(r, NULL);
}

size_t payload_bytes(size_t ntok)
{
    return (size_t)NL * 2 * ntok * NH * HD * 2;
}

void fill_payload(uint16_t *p, size_t ntok, unsigned seed)
{
    /* Small f16 values: 1.0 + k/1024, exact in f16. */
    size_t n = payload_bytes(ntok) / 2;
    for (size_t i = 0; i < n; i++)
        p[i] = (uint16_t)(0x3C00u + ((i * 7u + seed) & 0x3FFu));
}

void make_put(Kvrope__Request *q, Kvrope__Put *p, const char *ctx, uint32_t *tokens,
              size_t ntok, Kvrope__PutMode mode)
{
    kvrope__put__init(p);
    p->context_id = (char *)(uintptr_t)ctx;
    p->model = "tiny";
    p->has_mode = p->has_dtype = 1;
    p->mode = mode;
    p->dtype = KVROPE__DTYPE__F16;
    p->n_tokens = ntok;
    p->tokens = tokens;
    *q = kvt_put_request(100, p);
}

uint16_t *new_payload(size_t ntok, unsigned seed, size_t *pb)
{
    *pb = payload_bytes(ntok);
    uint16_t *p = malloc(*pb);
    cr_assert_not_null(p);
    fill_payload(p, ntok, seed);
    return p;
}

void put_ok(int fd, const char *ctx, uint32_t *toks, size_t n,
            Kvrope__PutMode mode, const void *pay, size_t pb)
{
    Kvrope__Request q;
    Kvrope__Put p;
    make_put(&q, &p, ctx, toks, n, mode);
    send_req(fd, &q, pay, pb);
    Kvrope__Response *r = recv_resp(fd, NULL, NULL);
    cr_assert_eq(r->status, KVROPE__STATUS__OK, "put: %s", r->message);
    kvrope__response__free_unpacked(r, NULL);
}
