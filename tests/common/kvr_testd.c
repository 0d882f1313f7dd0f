/*
 * kvr_testd.c — tests/common/kvr_testd.h: starting and stopping a real kvroped, the CLI, the test model and its data.
 * Compiled once into libtestcommon.a.
 */
#include "tests/common/kvr_testd.h"
#include "tests/common/kvt_bench.h"

const char *testd_build_dir(void)
{
    const char *b = getenv("KVR_BUILD");
    return b && *b ? b : "./build";
}

void testd_print_log(const kvr_testd *d)
{
    FILE *f = fopen(d->log, "r");
    if (!f)
        return;
    char line[512];
    fprintf(stderr, "---- %s ----\n", d->log);
    while (fgets(line, sizeof line, f))
        fputs(line, stderr);
    fclose(f);
}

int testd_argv_begin(const char **argv, const char *bin, const char *sock)
{
    argv[0] = bin;
    argv[1] = "--socket";
    argv[2] = sock;
    return 3;
}

void testd_argv_end(const char **argv, int n, int cap, const char *const *more)
{
    for (int i = 0; more && more[i] && n < cap - 1; i++)
        argv[n++] = more[i];
    argv[n] = NULL;
}

int testd_start(kvr_testd *d, const char *const *extra)
{
    memset(d, 0, sizeof *d);
    snprintf(d->dir, sizeof d->dir, "/tmp/kvr-itest-XXXXXX");
    if (!mkdtemp(d->dir)) {
        perror("mkdtemp");
        return -1;
    }
    snprintf(d->sock, sizeof d->sock, "%s/kvroped.sock", d->dir);
    snprintf(d->log, sizeof d->log, "%s/kvroped.log", d->dir);
    snprintf(d->addr, sizeof d->addr, "unix:%s", d->sock);
    char bin[512];
    snprintf(bin, sizeof bin, "%s/kvroped", testd_build_dir());
    const char *argv[48];
    int n = testd_argv_begin(argv, bin, d->sock);
    argv[n++] = "--log-level";
    argv[n++] = "warn";
    testd_argv_end(argv, n, 47, extra);
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid < 0) {
        perror("fork");
        return -1;
    }
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGTERM);
        if (getppid() != parent)
            _exit(127);
        int fd = open(d->log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (fd >= 0) {
            dup2(fd, 1);
            dup2(fd, 2);
            close(fd);
        }
        execv(bin, (char *const *)(uintptr_t)argv);
        fprintf(stderr, "exec %s: %s\n", bin, strerror(errno));
        _exit(127);
    }
    d->pid = pid;
    /* Sanitizer builds start slowly: allow 30 s. */
    for (int i = 0; i < 3000; i++) {
        int st;
        if (waitpid(pid, &st, WNOHANG) == pid) {
            fprintf(stderr, "kvroped exited during start-up (status %d)\n", st);
            testd_print_log(d);
            d->pid = 0;
            return -1;
        }
        kvr_client *c;
        if (kvr_client_connect(&c, d->addr, NULL) == 0) {
            int r = kvr_client_ping(c, NULL);
            kvr_client_close(c);
            if (r == 0)
                return 0;
        }
        kvt_sleep_ms(10);
    }
    fprintf(stderr, "kvroped did not answer on %s within 30 s\n", d->sock);
    testd_print_log(d);
    return -1;
}

int testd_alive(kvr_testd *d)
{
    int st;
    return d->pid > 0 && waitpid(d->pid, &st, WNOHANG) == 0;
}

int testd_stop(kvr_testd *d)
{
    int rc = -1;
    if (d->pid > 0) {
        kill(d->pid, SIGTERM);
        for (int i = 0; i < 1000; i++) {
            int st;
            pid_t w = waitpid(d->pid, &st, WNOHANG);
            if (w == d->pid) {
                rc = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
                break;
            }
            if (w < 0)
                break;
            kvt_sleep_ms(10);
        }
        if (rc == -1) {
            kill(d->pid, SIGKILL);
            waitpid(d->pid, NULL, 0);
        }
        d->pid = 0;
    }
    if (d->dir[0]) {
        unlink(d->sock);
        unlink(d->log);
        rmdir(d->dir);
        d->dir[0] = 0;
    }
    return rc;
}

kvr_client *testd_connect(const kvr_testd *d)
{
    kvr_client *c = NULL;
    if (kvr_client_connect(&c, d->addr, NULL) < 0) {
        fprintf(stderr, "connect %s: %s\n", d->addr, kvr_client_last_error(NULL));
        return NULL;
    }
    return c;
}

int testd_spawn_stdout(const char *const *argv, unsigned limit_s, pid_t *pid)
{
    int pfd[2];
    if (pipe(pfd) < 0)
        return -1;
    *pid = fork();
    if (*pid < 0)
        return -1;
    if (*pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        alarm(limit_s);
        dup2(pfd[1], 1);
        close(pfd[0]);
        close(pfd[1]);
        execv(argv[0], (char *const *)(uintptr_t)argv);
        _exit(127);
    }
    close(pfd[1]);
    return pfd[0];
}

void testd_drain(int fd, char *out, size_t cap)
{
    size_t len = 0;
    for (;;) {
        char tmp[4096];
        ssize_t r = read(fd, tmp, sizeof tmp);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            break;
        for (ssize_t i = 0; i < r; i++)
            if (out && len + 1 < cap)
                out[len++] = tmp[i];
    }
    if (out && cap)
        out[len] = 0;
    close(fd);
}

int testd_wait_exit(pid_t pid)
{
    int st;
    if (waitpid(pid, &st, 0) != pid || !WIFEXITED(st))
        return -1;
    return WEXITSTATUS(st);
}

int testd_cli(const kvr_testd *d, char *out, size_t cap, const char *const *args)
{
    char bin[512];
    snprintf(bin, sizeof bin, "%s/kvrope", testd_build_dir());
    const char *argv[64];
    testd_argv_end(argv, testd_argv_begin(argv, bin, d->sock), 64, args);
    pid_t pid;
    int fd = testd_spawn_stdout(argv, 60, &pid);
    if (fd < 0)
        return -1;
    testd_drain(fd, out, cap);
    return testd_wait_exit(pid);
}

int testd_register(kvr_client *c, const char *name, kvr_dtype dtype, kvr_model *out)
{
    kvr_rope_config rc = kvt_rope_config(T_DIM, 0);
    kvr_model_params p = { .name = name, .n_layers = T_LAYERS, .n_kv_heads = T_HEADS,
                           .head_dim = T_DIM, .dtype = dtype, .rope = &rc };
    return kvr_client_model_register(c, &p, out);
}

float testd_val(uint32_t seed, uint32_t l, uint32_t kv, uint64_t t, uint32_t h,
                uint32_t d)
{
    uint64_t x = ((uint64_t)seed * 0x9E3779B97F4A7C15ull) ^ ((uint64_t)l << 56) ^
                 ((uint64_t)kv << 55) ^ (t << 20) ^ ((uint64_t)h << 10) ^ d;
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return (float)((double)(x >> 11) / 4503599627370496.0 - 1.0);
}

void testd_fill(void *buf, uint32_t seed, const uint32_t *layers, uint32_t nl,
                uint64_t t0, size_t n, uint32_t heads, uint32_t dim, kvr_dtype dt)
{
    size_t es = kvr_dtype_size(dt), i = 0;
    uint8_t *p = buf;
    for (uint32_t li = 0; li < nl; li++)
        for (uint32_t kv = 0; kv < 2; kv++)
            for (size_t t = 0; t < n; t++)
                for (uint32_t h = 0; h < heads; h++)
                    for (uint32_t d = 0; d < dim; d++, i++) {
                        float f = testd_val(seed, layers ? layers[li] : li, kv, t0 + t, h, d);
                        if (dt == KVR_DTYPE_F32) {
                            memcpy(p + i * es, &f, 4);
                        } else {
                            uint16_t u = dt == KVR_DTYPE_F16 ? kvr_f32_to_f16(f) : kvr_f32_to_bf16(f);
                            memcpy(p + i * es, &u, 2);
                        }
                    }
}

void *testd_payload(uint32_t seed, uint32_t nl, uint64_t t0, size_t n,
                    kvr_dtype dt, size_t *len)
{
    *len = kvr_payload_size(nl, n, T_HEADS, T_DIM, dt);
    void *b = malloc(*len ? *len : 1);
    if (b)
        testd_fill(b, seed, NULL, nl, t0, n, T_HEADS, T_DIM, dt);
    return b;
}

uint32_t *testd_tokens(uint32_t base, size_t n)
{
    uint32_t *t = malloc((n ? n : 1) * sizeof *t);
    for (size_t i = 0; t && i < n; i++)
        t[i] = base + (uint32_t)i;
    return t;
}

int testd_put_with(kvr_client *c, kvr_put_args *a, uint32_t seed, uint32_t base, uint64_t t0,
                   size_t n)
{
    size_t len;
    void *pl = testd_payload(seed, T_LAYERS, t0, n, a->dtype, &len);
    uint32_t *tok = testd_tokens(base, n);
    a->tokens = tok;
    a->n_tokens = n;
    a->payload = pl;
    a->payload_len = len;
    int r = kvr_client_put(c, a, NULL);
    free(pl);
    free(tok);
    return r;
}

int testd_put(kvr_client *c, const char *ctx, const char *model, kvr_dtype dt, uint32_t seed,
              uint32_t base, uint64_t t0, size_t n)
{
    kvr_put_args a = { .mode = KVR_PUT_UPSERT, .ctx_id = ctx, .model = model, .dtype = dt,
                       .has_pos_start = true, .pos_start = (int64_t)t0,
                       .n_layers = T_LAYERS, .n_kv_heads = T_HEADS, .head_dim = T_DIM };
    return testd_put_with(c, &a, seed, base, t0, n);
}

double testd_metric(kvr_client *c, const char *name)
{
    kvr_metric *m;
    size_t n;
    double v = -1;
    if (kvr_client_stats(c, &m, &n) == 0) {
        if (!kvr_metric_find(m, n, name, &v))
            v = -1;
        kvr_client_free(m);
    }
    return v;
}

void *testd_rope_kv(const kvr_rope *R, kvr_dtype dt, const uint32_t *tok,
                    const int64_t *pos, size_t n, size_t *len)
{
    const size_t per = (size_t)T_HEADS * T_DIM, es = kvr_dtype_size(dt);
    *len = kvr_payload_size(T_LAYERS, n, T_HEADS, T_DIM, dt);
    uint8_t *buf = malloc(*len ? *len : 1);
    float *x = malloc((n ? n : 1) * per * sizeof *x);
    size_t half = n * per * es;
    for (uint32_t l = 0; buf && x && l < T_LAYERS; l++) {
        uint8_t *k = buf + (size_t)l * 2 * half, *v = k + half;
        for (uint32_t kv = 0; kv < 2; kv++) {
            for (size_t i = 0; i < n; i++)
                for (uint32_t h = 0; h < T_HEADS; h++)
                    for (uint32_t d = 0; d < T_DIM; d++)
                        x[i * per + h * T_DIM + d] = testd_val(tok[i], l, kv, 0, h, d);
            if (kv == 1)
                kvr_convert(v, dt, x, KVR_DTYPE_F32, n * per);
            else if (n && kvr_rope_apply(R, k, dt, x, KVR_DTYPE_F32, n, T_HEADS, pos, NULL))
                goto fail;
        }
    }
    if (!x)
        goto fail;
    free(x);
    return buf;
fail:
    free(x);
    free(buf);
    return NULL;
}

int testd_rope_kv_check(const kvr_rope *R, const kvr_kv *kv, const void *payload,
                        char *msg, size_t cap)
{
    size_t n = kv->n_tokens, len, es = kvr_dtype_size(kv->dtype);
    uint8_t *want = testd_rope_kv(R, kv->dtype, kv->tokens, kv->positions, n, &len);
    int rc = 0;
    if (!want || kv->payload_len != len) {
        snprintf(msg, cap, "payload of %zu bytes, %zu expected", kv->payload_len, len);
        free(want);
        return -1;
    }
    size_t vals = n * T_HEADS * T_DIM, half = vals * es;
    float a, b;
    for (uint32_t l = 0; l < T_LAYERS && rc == 0; l++) {
        const uint8_t *gk = (const uint8_t *)payload + (size_t)l * 2 * half;
        const uint8_t *wk = want + (size_t)l * 2 * half;
        for (size_t i = 0; i < vals && rc == 0; i++) {
            kvr_convert(&a, KVR_DTYPE_F32, gk + i * es, kv->dtype, 1);
            kvr_convert(&b, KVR_DTYPE_F32, wk + i * es, kv->dtype, 1);
            if (fabsf(a - b) > (es == 4 ? 1e-5f : 1.0f / 1024.0f + 1e-6f)) {
                snprintf(msg, cap, "layer %u key value %zu: %g, want %g", l, i, (double)a,
                         (double)b);
                rc = -1;
            }
        }
        if (rc == 0 && memcmp(gk + half, wk + half, half) != 0) {
            snprintf(msg, cap, "layer %u: values differ", l);
            rc = -1;
        }
    }
    free(want);
    return rc;
}
