/*
 * test_int_shm.c — shared-memory payloads end to end (issue 14): a real
 * kvroped and libkvrope. Round trips through a region are bit-identical to
 * the socket path for every dtype and codec, with re-rotation, dtype
 * conversion, match+get, assemble, edits and refresh; every refusal
 * (unsealed, too small, not a memfd, write-sealed, out-of-range offsets,
 * overflowing lengths, unknown regions, per-connection limits, TCP); a
 * client that unmaps its region, closes its fd or exits mid-request leaves
 * the daemon serving everyone else; many regions and clients at once.
 */
#include <criterion/criterion.h>

#include <arpa/inet.h>
#include <math.h>
#include <netinet/in.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <dirent.h>

#include "kvrope.pb-c.h"
#include "proto/frame.h"
#include "tests/common/kvt_daemon.h"
#include "tests/common/kvt.h"

static kvr_testd D;
static kvr_client *C;

static void setup(void)
{
    const char *extra[] = { "--max-regions", "4", "--max-region-bytes", "64M", NULL };
    C = kvt_daemon_up(&D, extra);
}

static void teardown(void)
{
    kvt_daemon_down(&D, &C, NULL);
}

TestSuite(int_shm, .init = setup, .fini = teardown, .timeout = 180);

/* For a test that starts its own daemon: stops the suite's (a test's
 * .init = NULL does not skip the suite's setup in Criterion: it runs all the
 * same, and a second testd_start on D would orphan that daemon and leave its
 * directory behind). The suite's teardown then stops the test's daemon. */
static void own_daemon(void)
{
    kvt_daemon_down(&D, &C, NULL);
}

#define REGION (4u << 20)

static uint32_t make_region(kvr_client *c, void **base)
{
    uint32_t id = 0;
    int r = kvr_client_region_create(c, REGION, &id, base);
    cr_assert_eq(r, 0, "%s", kvr_client_last_error(c));
    cr_assert_neq(id, 0);
    return id;
}

/* Puts n tokens into ctx, through the region when id != 0. */
static void put_ctx(kvr_client *c, uint32_t id, void *base, const char *ctx, const char *model,
                    kvr_dtype dt, const char *codec, uint32_t seed, size_t n)
{
    size_t len;
    void *pl = testd_payload(seed, T_LAYERS, 0, n, dt, &len);
    uint32_t *tok = testd_tokens(1000 + seed, n);
    kvr_put_args a = { .ctx_id = ctx, .model = model, .dtype = dt, .tokens = tok, .n_tokens = n,
                       .has_pos_start = true, .pos_start = 0, .n_layers = T_LAYERS,
                       .n_kv_heads = T_HEADS, .head_dim = T_DIM };
    a.codec = codec;
    int r;
    if (id) {
        memcpy((uint8_t *)base + 4096, pl, len);
        kvr_shm at = { id, 4096, len };
        r = kvr_client_put_shm(c, &a, &at, NULL);
    } else {
        a.payload = pl;
        a.payload_len = len;
        r = kvr_client_put(c, &a, NULL);
    }
    cr_assert_eq(r, 0, "put %s: %s", ctx, kvr_client_last_error(c));
    free(pl);
    free(tok);
}

/* Gets ctx over the socket and through the region and compares them. */
static void same_get(uint32_t id, void *base, const char *ctx_sock, const char *ctx_shm,
                     const kvr_get_args *g0, bool raw)
{
    kvr_get_args g = *g0;
    g.raw = raw;
    kvr_kv a, b;
    g.ctx_id = ctx_sock;
    cr_assert_eq(kvr_client_get(C, &g, &a), 0, "%s", kvr_client_last_error(C));
    g.ctx_id = ctx_shm;
    memset(base, 0xA5, REGION);
    kvr_shm at = { id, 8192, 0 };
    cr_assert_eq(kvr_client_get_shm(C, &g, &at, &b), 0, "%s",
                 kvr_client_last_error(C));
    cr_assert_eq(a.payload_len, b.payload_len);
    cr_assert_eq(b.payload, (uint8_t *)base + 8192, "the result is a view of the region");
    cr_assert_not(b.payload_owned);
    cr_assert(a.payload_len > 0);
    cr_assert_eq(memcmp(a.payload, b.payload, a.payload_len), 0, "shm get differs from socket");
    cr_assert_eq(a.n_tokens, b.n_tokens);
    cr_assert_eq(memcmp(a.positions, b.positions, a.n_tokens * sizeof *a.positions), 0);
    /* Nothing written past the payload. */
    cr_assert_eq(((uint8_t *)base)[8192 + b.payload_len], 0xA5);
    kvr_kv_release(&a);
    kvr_kv_release(&b);
}

Test(int_shm, roundtrip_every_dtype_and_codec)
{
    void *base;
    uint32_t id = make_region(C, &base);
    const kvr_dtype dts[] = { KVR_DTYPE_F32, KVR_DTYPE_F16, KVR_DTYPE_BF16 };
    const char *codecs[] = { NULL, "int8", "k4v2", "q8_0", "kivi:k4v2:g32:r32" };
    int64_t pos[150];
    for (size_t i = 0; i < 150; i++)
        pos[i] = 37 + 2 * (int64_t)i;
    for (size_t d = 0; d < 3; d++) {
        char model[32];
        snprintf(model, sizeof model, "m%zu", d);
        cr_assert_eq(testd_register(C, model, dts[d], NULL), 0, "%s", kvr_client_last_error(C));
        for (size_t k = 0; k < sizeof codecs / sizeof codecs[0]; k++) {
            char cs[32], cm[32];
            snprintf(cs, sizeof cs, "sock-%zu-%zu", d, k);
            snprintf(cm, sizeof cm, "shm-%zu-%zu", d, k);
            put_ctx(C, 0, NULL, cs, model, dts[d], codecs[k], (uint32_t)(d * 10 + k), 150);
            put_ctx(C, id, base, cm, model, dts[d], codecs[k], (uint32_t)(d * 10 + k), 150);
            for (size_t o = 0; o < 3; o++) {
                /* stored positions, re-rotated, and a subrange + layer subset */
                kvr_get_args g = { .dtype = dts[o] };
                same_get(id, base, cs, cm, &g, false);
                g.positions = pos;
                g.n_positions = 150;
                same_get(id, base, cs, cm, &g, false);
                uint32_t layers[] = { 2, 0 };
                kvr_get_args g2 = { .dtype = dts[o], .start = 10, .end = 77, .layers = layers,
                                    .n_layers = 2, .positions = pos, .n_positions = 67 };
                same_get(id, base, cs, cm, &g2, false);
            }
            if (codecs[k] && (!strcmp(codecs[k], "int8") || !strcmp(codecs[k], "q8_0"))) {
                kvr_get_args g = { .dtype = dts[d], .end = 128 };
                same_get(id, base, cs, cm, &g, true);
            }
        }
    }
}

Test(int_shm, match_assemble_edit_refresh)
{
    void *base;
    uint32_t id = make_region(C, &base);
    cr_assert_eq(testd_register(C, "tiny", KVR_DTYPE_F16, NULL), 0);
    put_ctx(C, 0, NULL, "a", "tiny", KVR_DTYPE_F16, NULL, 5, 90);

    /* match + get */
    uint32_t *tok = testd_tokens(1005, 90);
    kvr_match_args m = { .model = "tiny", .tokens = tok, .n_tokens = 90, .get = true,
                         .dtype = KVR_DTYPE_F32 };
    kvr_match_res ms, mm;
    cr_assert_eq(kvr_client_match(C, &m, &ms), 0, "%s", kvr_client_last_error(C));
    kvr_shm at = { id, 0, 0 };
    cr_assert_eq(kvr_client_match_shm(C, &m, &at, &mm), 0, "%s", kvr_client_last_error(C));
    cr_assert(ms.has_kv && mm.has_kv);
    cr_assert_eq(ms.kv.payload_len, mm.kv.payload_len);
    cr_assert_eq(mm.kv.payload, base);
    cr_assert_eq(memcmp(ms.kv.payload, mm.kv.payload, ms.kv.payload_len), 0);
    kvr_kv_release(&ms.kv);
    kvr_kv_release(&mm.kv);

    /* assemble: a prefix and two documents encoded after it */
    put_ctx(C, 0, NULL, "pre", "tiny", KVR_DTYPE_F16, NULL, 6, 20);
    for (int i = 0; i < 2; i++) {
        size_t len;
        void *pl = testd_payload(40 + (uint32_t)i, T_LAYERS, 20, 30, KVR_DTYPE_F16, &len);
        uint32_t *dt = testd_tokens(5000 + 100 * (uint32_t)i, 30);
        kvr_put_args a = { .ctx_id = i ? "d1" : "d0", .model = "tiny", .dtype = KVR_DTYPE_F16,
                           .tokens = dt, .n_tokens = 30, .payload = pl, .payload_len = len };
        a.prefix_ctx = "pre";
        cr_assert_eq(kvr_client_put(C, &a, NULL), 0, "%s", kvr_client_last_error(C));
        free(pl);
        free(dt);
    }
    const char *docs[] = { "d0", "d1" };
    kvr_assemble_args as = { .prefix = "pre", .docs = docs, .n_docs = 2,
                             .layout = KVR_LAYOUT_SEQUENTIAL, .dtype = KVR_DTYPE_F16 };
    kvr_assemble_res r1, r2;
    cr_assert_eq(kvr_client_assemble(C, &as, &r1), 0, "%s", kvr_client_last_error(C));
    at.offset = 64;
    cr_assert_eq(kvr_client_assemble_shm(C, &as, &at, &r2), 0, "%s", kvr_client_last_error(C));
    cr_assert_eq(r1.kv.payload_len, r2.kv.payload_len);
    cr_assert_eq(r2.kv.payload, (uint8_t *)base + 64);
    cr_assert_eq(memcmp(r1.kv.payload, r2.kv.payload, r1.kv.payload_len), 0);
    kvr_assemble_release(&r1);
    kvr_assemble_release(&r2);

    /* edit with KV and refresh, through the region and over the socket */
    put_ctx(C, 0, NULL, "e-sock", "tiny", KVR_DTYPE_F16, NULL, 8, 64);
    put_ctx(C, 0, NULL, "e-shm", "tiny", KVR_DTYPE_F16, NULL, 8, 64);
    uint32_t nt[5] = { 1, 2, 3, 4, 5 };
    kvr_edit_range op = { .start = 10, .end = 12, .tokens = nt, .n_tokens = 5 };
    size_t len;
    void *kv = testd_payload(77, T_LAYERS, 10, 5, KVR_DTYPE_F16, &len);
    kvr_edit_args e = { .ctx_id = "e-sock", .ops = &op, .n_ops = 1, .with_kv = true,
                        .dtype = KVR_DTYPE_F16, .payload = kv, .payload_len = len };
    cr_assert_eq(kvr_client_edit(C, &e, NULL), 0, "%s", kvr_client_last_error(C));
    memcpy((uint8_t *)base + 100, kv, len);
    kvr_edit_args e2 = { .ctx_id = "e-shm", .ops = &op, .n_ops = 1, .with_kv = true,
                         .dtype = KVR_DTYPE_F16 };
    kvr_shm pat = { id, 100, len };
    cr_assert_eq(kvr_client_edit_shm(C, &e2, &pat, NULL), 0, "%s", kvr_client_last_error(C));
    free(kv);
    void *rk = testd_payload(78, T_LAYERS, 0, 6, KVR_DTYPE_F16, &len);
    kvr_refresh_args f = { .ctx_id = "e-sock", .start = 20, .end = 26, .dtype = KVR_DTYPE_F16,
                           .payload = rk, .payload_len = len };
    cr_assert_eq(kvr_client_refresh(C, &f, NULL), 0, "%s", kvr_client_last_error(C));
    memcpy((uint8_t *)base + 333, rk, len);
    kvr_refresh_args f2 = { .ctx_id = "e-shm", .start = 20, .end = 26, .dtype = KVR_DTYPE_F16 };
    kvr_shm rat = { id, 333, len };
    cr_assert_eq(kvr_client_refresh_shm(C, &f2, &rat, NULL), 0, "%s", kvr_client_last_error(C));
    free(rk);
    kvr_get_args g = { .dtype = KVR_DTYPE_F16 };
    same_get(id, base, "e-sock", "e-shm", &g, false);
    free(tok);
}

Test(int_shm, put_checks_the_daemons_copy)
{
    void *base;
    uint32_t id = make_region(C, &base);
    cr_assert_eq(testd_register(C, "tiny", KVR_DTYPE_F32, NULL), 0);
    size_t len;
    float *pl = testd_payload(1, T_LAYERS, 0, 40, KVR_DTYPE_F32, &len);
    pl[17] = NAN;   /* a quantized codec refuses nan at put */
    memcpy(base, pl, len);
    uint32_t *tok = testd_tokens(1, 40);
    kvr_put_args a = { .ctx_id = "q", .model = "tiny", .dtype = KVR_DTYPE_F32, .tokens = tok,
                       .n_tokens = 40, .n_layers = T_LAYERS, .n_kv_heads = T_HEADS,
                       .head_dim = T_DIM };
    a.codec = "int8";
    kvr_shm at = { id, 0, len };
    cr_assert_eq(kvr_client_put_shm(C, &a, &at, NULL), KVR_EINVAL);
    cr_assert(strstr(kvr_client_last_error(C), "nan") || strstr(kvr_client_last_error(C), "NaN")
              || strstr(kvr_client_last_error(C), "finite"), "%s", kvr_client_last_error(C));
    kvr_context ci;
    cr_assert_eq(kvr_client_stat(C, "q", &ci), KVR_ENOCTX, "a refused put stores nothing");
    /* a slice of the wrong length is E_PAYLOAD */
    at.length = len - 4;
    cr_assert_eq(kvr_client_put_shm(C, &a, &at, NULL), KVR_EPAYLOAD);
    free(pl);
    free(tok);
}

static int raw_memfd(size_t size, unsigned seals)
{
    int fd = memfd_create("t", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    cr_assert_geq(fd, 0);
    cr_assert_eq(ftruncate(fd, (off_t)size), 0);
    if (seals)
        cr_assert_eq(fcntl(fd, F_ADD_SEALS, seals), 0);
    return fd;
}

Test(int_shm, refusals)
{
    uint32_t id;
    static uint8_t dummy[8192];
    /* unsealed */
    int fd = raw_memfd(8192, 0);
    cr_assert_eq(kvr_client_region_register(C, fd, 8192, NULL, &id), KVR_EINVAL);
    cr_assert(strstr(kvr_client_last_error(C), "F_SEAL_SHRINK"), "%s", kvr_client_last_error(C));
    close(fd);
    /* too small */
    fd = raw_memfd(4096, F_SEAL_SHRINK);
    cr_assert_eq(kvr_client_region_register(C, fd, 8192, dummy, &id), KVR_ERANGE);
    cr_assert(strstr(kvr_client_last_error(C), "fewer"), "%s", kvr_client_last_error(C));
    close(fd);
    /* write-sealed */
    fd = raw_memfd(8192, F_SEAL_SHRINK | F_SEAL_WRITE);
    cr_assert_eq(kvr_client_region_register(C, fd, 8192, dummy, &id), KVR_EINVAL);
    close(fd);
    /* not a memfd: a regular file, and a pipe */
    char path[400];
    snprintf(path, sizeof path, "%s/plain", D.dir);
    fd = open(path, O_RDWR | O_CREAT, 0600);
    cr_assert_eq(ftruncate(fd, 8192), 0);
    cr_assert_eq(kvr_client_region_register(C, fd, 8192, NULL, &id), KVR_EINVAL);
    cr_assert(strstr(kvr_client_last_error(C), "not a memfd"), "%s", kvr_client_last_error(C));
    close(fd);
    int p[2];
    cr_assert_eq(pipe(p), 0);
    cr_assert_eq(kvr_client_region_register(C, p[0], 8192, dummy, &id), KVR_EINVAL);
    close(p[0]);
    close(p[1]);

    /* slices */
    void *base;
    uint32_t good = make_region(C, &base);
    cr_assert_eq(testd_register(C, "tiny", KVR_DTYPE_F16, NULL), 0);
    put_ctx(C, 0, NULL, "c", "tiny", KVR_DTYPE_F16, NULL, 1, 100);
    kvr_get_args g = { .ctx_id = "c", .dtype = KVR_DTYPE_F16 };
    kvr_kv kv;
    kvr_shm bad[] = {
        { good, REGION + 1, 1 },                 /* offset past the end */
        { good, 16, REGION },                    /* runs past the end */
        { good, UINT64_MAX - 8, 64 },            /* offset + length overflows */
        { good, 8, UINT64_MAX },                 /* length overflows */
        { good + 100, 0, 64 },                   /* unknown region */
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        int r = kvr_client_get_shm(C, &g, &bad[i], &kv);
        cr_assert(r == KVR_ERANGE || r == KVR_EINVAL, "slice %zu: %d %s", i, r,
                  kvr_client_last_error(C));
    }
    /* too small for the payload: nothing written */
    memset(base, 0x5A, 64);
    kvr_shm small = { good, 0, 64 };
    cr_assert_eq(kvr_client_get_shm(C, &g, &small, &kv), KVR_ERANGE);
    cr_assert_eq(((uint8_t *)base)[0], 0x5A);
    /* shm on a request without a payload */
    kvr_client_shm_next(C, &small);
    cr_assert_eq(kvr_client_ping(C, NULL), KVR_EBADREQUEST);
    cr_assert_eq(kvr_client_ping(C, NULL), 0, "the placement is one-shot");

    /* per-connection limits: --max-regions 4, --max-region-bytes 64M */
    uint32_t ids[3];
    for (int i = 0; i < 3; i++)
        ids[i] = make_region(C, NULL);
    cr_assert_eq(kvr_client_region_create(C, 4096, &id, NULL), KVR_ELIMIT);
    cr_assert(strstr(kvr_client_last_error(C), "max-regions"), "%s", kvr_client_last_error(C));
    for (int i = 0; i < 3; i++)
        cr_assert_eq(kvr_client_region_release(C, ids[i]), 0, "%s", kvr_client_last_error(C));
    cr_assert_eq(kvr_client_region_create(C, (size_t)80 << 20, &id, NULL), KVR_ELIMIT);
    cr_assert(strstr(kvr_client_last_error(C), "max-region-bytes"), "%s",
              kvr_client_last_error(C));
    /* released: gone for the daemon too */
    kvr_shm rel = { ids[0], 0, 0 };
    kvr_client_shm_next(C, &rel);
    kvr_get_args g2 = { .ctx_id = "c", .dtype = KVR_DTYPE_F16 };
    cr_assert_eq(kvr_client_get(C, &g2, &kv), KVR_EINVAL);
    /* another connection cannot name this one's region */
    kvr_client *o = testd_connect(&D);
    kvr_shm other = { good, 0, 0 };
    kvr_client_shm_next(o, &other);
    cr_assert_eq(kvr_client_get(o, &g2, &kv), KVR_EINVAL);
    kvr_client_close(o);
    /* and the connection still works */
    cr_assert_eq(kvr_client_ping(C, NULL), 0);
}

Test(int_shm, tcp_refuses_shared_memory)
{
    own_daemon();
    char listen[64], addr[80];
    int port = kvt_free_tcp_port();
    snprintf(listen, sizeof listen, "127.0.0.1:%d", port);
    snprintf(addr, sizeof addr, "tcp:127.0.0.1:%d", port);
    const char *extra[] = { "--listen", listen, NULL };
    cr_assert_eq(testd_start(&D, extra), 0);
    kvr_client *t = NULL;
    for (int i = 0; i < 500 && kvr_client_connect(&t, addr, NULL) < 0; i++)
        kvt_sleep_ms(10);
    cr_assert_not_null(t);
    uint32_t id;
    /* SCM_RIGHTS does not cross TCP: the fd never arrives, the frame is refused */
    int r = kvr_client_region_create(t, 4096, &id, NULL);
    cr_assert_eq(r, KVR_EUNSUPPORTED, "%d %s", r, kvr_client_last_error(t));
    cr_assert(strstr(kvr_client_last_error(t), "Unix socket"), "%s", kvr_client_last_error(t));
    kvr_shm at = { 1, 0, 0 };
    kvr_client_shm_next(t, &at);
    kvr_get_args g = { .ctx_id = "x", .dtype = KVR_DTYPE_F16 };
    kvr_kv kv;
    cr_assert_eq(kvr_client_get(t, &g, &kv), KVR_EUNSUPPORTED);
    cr_assert_eq(kvr_client_ping(t, NULL), 0);
    kvt_daemon_down(&D, &t, NULL);
}

/* A child that registers a region and asks for a large re-rotating get
 * into it, then goes away: killed by a timer while the daemon works on the
 * get (how & 1: after unmapping its view; how & 2: its own memfd, closed
 * and unmapped before the request), or (how 4) closing its socket right
 * after the request was sent. */
static void vanishing_client(int how)
{
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        kvr_client *c = testd_connect(&D);
        if (!c)
            _exit(2);
        void *base;
        uint32_t id;
        if (how & 2) {
            int fd = memfd_create("v", MFD_CLOEXEC | MFD_ALLOW_SEALING);
            if (fd < 0 || ftruncate(fd, REGION) < 0 || fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK) < 0)
                _exit(3);
            base = mmap(NULL, REGION, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
            if (base == MAP_FAILED || kvr_client_region_register(c, fd, REGION, base, &id) < 0)
                _exit(4);
            close(fd);
            munmap(base, REGION);
        } else if (kvr_client_region_create(c, REGION, &id, &base) < 0) {
            _exit(5);
        }
        if (how & 1)
            munmap(base, REGION);
        int64_t *pos = malloc(2000 * sizeof *pos);
        for (int i = 0; i < 2000; i++)
            pos[i] = 5000 + i;
        kvr_get_args g = { .ctx_id = "big", .dtype = KVR_DTYPE_F32, .positions = pos,
                           .n_positions = 2000 };
        kvr_shm at = { id, 0, 0 };
        kvr_kv kv;
        signal(SIGALRM, SIG_DFL);
        struct itimerval it = { { 0, 0 }, { 0, 300 } };
        setitimer(ITIMER_REAL, &it, NULL);
        kvr_client_get_shm(c, &g, &at, &kv);
        _exit(0);
    }
    int st;
    cr_assert_eq(waitpid(pid, &st, 0), pid);
}

Test(int_shm, clients_that_vanish)
{
    cr_assert_eq(testd_register(C, "tiny", KVR_DTYPE_F16, NULL), 0);
    put_ctx(C, 0, NULL, "big", "tiny", KVR_DTYPE_F16, NULL, 3, 2000);
    for (int round = 0; round < 2; round++)
        for (int how = 0; how < 4; how++)
            vanishing_client(how);
    cr_assert(testd_alive(&D), "the daemon survived");
    kvr_get_args g = { .ctx_id = "big", .dtype = KVR_DTYPE_F16 };
    kvr_kv kv;
    cr_assert_eq(kvr_client_get(C, &g, &kv), 0, "%s", kvr_client_last_error(C));
    size_t len;
    void *want = testd_payload(3, T_LAYERS, 0, 2000, KVR_DTYPE_F16, &len);
    cr_assert_eq(kv.payload_len, len);
    cr_assert_eq(memcmp(kv.payload, want, len), 0);
    free(want);
    kvr_kv_release(&kv);
    /* and shared memory still works for the others */
    void *base;
    uint32_t id = make_region(C, &base);
    kvr_shm at = { id, 0, 0 };
    cr_assert_eq(kvr_client_get_shm(C, &g, &at, &kv), 0, "%s",
                 kvr_client_last_error(C));
    want = testd_payload(3, T_LAYERS, 0, 2000, KVR_DTYPE_F16, &len);
    cr_assert_eq(memcmp(base, want, len), 0);
    free(want);
    kvr_kv_release(&kv);
}

typedef struct worker_arg {
    int   idx;
    int   fails;
    char  why[256];
} worker_arg;

static void *worker(void *p)
{
    worker_arg *w = p;
    kvr_client *c = testd_connect(&D);
    if (!c) {
        w->fails++;
        return NULL;
    }
    uint32_t ids[3];
    void *bases[3];
    for (int i = 0; i < 3; i++)
        if (kvr_client_region_create(c, 1 << 20, &ids[i], &bases[i]) < 0) {
            snprintf(w->why, sizeof w->why, "create: %s", kvr_client_last_error(c));
            w->fails++;
            kvr_client_close(c);
            return NULL;
        }
    for (int it = 0; it < 20; it++) {
        char ctx[32];
        snprintf(ctx, sizeof ctx, "w%d-%d", w->idx, it);
        int ri = it % 3;
        size_t n = 40 + (size_t)it;
        size_t len;
        void *pl = testd_payload((uint32_t)(w->idx * 100 + it), T_LAYERS, 0, n, KVR_DTYPE_F16,
                                 &len);
        memcpy(bases[ri], pl, len);
        uint32_t *tok = testd_tokens((uint32_t)it, n);
        kvr_put_args a = { .ctx_id = ctx, .model = "tiny", .dtype = KVR_DTYPE_F16, .tokens = tok,
                           .n_tokens = n, .has_pos_start = true };
        kvr_shm at = { ids[ri], 0, len };
        if (kvr_client_put_shm(c, &a, &at, NULL) < 0) {
            snprintf(w->why, sizeof w->why, "put: %s", kvr_client_last_error(c));
            w->fails++;
        }
        kvr_get_args g = { .ctx_id = ctx, .dtype = KVR_DTYPE_F16 };
        kvr_shm out = { ids[(ri + 1) % 3], 512, 0 };
        kvr_kv kv;
        if (kvr_client_get_shm(c, &g, &out, &kv) < 0) {
            snprintf(w->why, sizeof w->why, "get: %s", kvr_client_last_error(c));
            w->fails++;
        } else {
            if (kv.payload_len != len || memcmp(kv.payload, pl, len) != 0)
                w->fails++;
            kvr_kv_release(&kv);
        }
        free(pl);
        free(tok);
    }
    kvr_client_close(c);
    return NULL;
}

Test(int_shm, many_regions_and_clients)
{
    cr_assert_eq(testd_register(C, "tiny", KVR_DTYPE_F16, NULL), 0);
    enum { N = 6 };
    pthread_t th[N];
    worker_arg wa[N];
    for (int i = 0; i < N; i++) {
        wa[i] = (worker_arg){ .idx = i };
        cr_assert_eq(pthread_create(&th[i], NULL, worker, &wa[i]), 0);
    }
    for (int i = 0; i < N; i++) {
        pthread_join(th[i], NULL);
        cr_assert_eq(wa[i].fails, 0, "worker %d: %s", i, wa[i].why);
    }
    cr_assert_eq(kvr_client_ping(C, NULL), 0);
}

Test(int_shm, cli_put_and_get_through_shared_memory)
{
    cr_assert_eq(testd_register(C, "tiny", KVR_DTYPE_F16, NULL), 0);
    size_t len;
    void *pl = testd_payload(9, T_LAYERS, 0, 12, KVR_DTYPE_F16, &len);
    char in[400], out1[400], out2[400];
    snprintf(in, sizeof in, "%s/in.bin", D.dir);
    snprintf(out1, sizeof out1, "%s/o1.bin", D.dir);
    snprintf(out2, sizeof out2, "%s/o2.bin", D.dir);
    FILE *f = fopen(in, "wb");
    cr_assert_eq(fwrite(pl, 1, len, f), len);
    fclose(f);
    const char *put[] = { "put", "cli", in, "--model", "tiny", "--tokens",
                          "1,2,3,4,5,6,7,8,9,10,11,12", "--shm", "-q", NULL };
    cr_assert_eq(testd_cli(&D, NULL, 0, put), 0);
    const char *g1[] = { "get", "cli", "-o", out1, "--shm", "--pos-start", "50", "-q", NULL };
    const char *g2[] = { "get", "cli", "-o", out2, "--pos-start", "50", "-q", NULL };
    cr_assert_eq(testd_cli(&D, NULL, 0, g1), 0);
    cr_assert_eq(testd_cli(&D, NULL, 0, g2), 0);
    char *b1 = malloc(len + 1), *b2 = malloc(len + 1);
    f = fopen(out1, "rb");
    cr_assert_eq(fread(b1, 1, len + 1, f), len);
    fclose(f);
    f = fopen(out2, "rb");
    cr_assert_eq(fread(b2, 1, len + 1, f), len);
    fclose(f);
    cr_assert_eq(memcmp(b1, b2, len), 0, "--shm get equals the socket get");
    kvr_get_args g = { .ctx_id = "cli", .dtype = KVR_DTYPE_F16 };
    kvr_kv kv;
    cr_assert_eq(kvr_client_get(C, &g, &kv), 0);
    cr_assert_eq(memcmp(kv.payload, pl, len), 0, "--shm put stored the file's bytes");
    kvr_kv_release(&kv);
    free(b1);
    free(b2);
    free(pl);
}

/* ---- raw frames: descriptors that come without a RegisterRegion, and a
 * RegisterRegion that comes without one ---------------------------------- */

static int raw_connect(void)
{
    return kvt_unix_connect(D.sock, 20);
}

/* Sends req, with `pass` (>= 0) attached by SCM_RIGHTS; returns the status. */
static int raw_call(int fd, Kvrope__Request *req, int pass)
{
    uint8_t buf[512];
    size_t n = kvrope__request__get_packed_size(req);
    cr_assert(n + KVR_FRAME_HEADER_SIZE <= sizeof buf);
    kvr_frame_header_encode(buf, (uint32_t)n, 0);
    kvrope__request__pack(req, buf + KVR_FRAME_HEADER_SIZE);
    size_t len = n + KVR_FRAME_HEADER_SIZE;
    cr_assert_eq(kvt_send_fds(fd, buf, len, pass, pass >= 0 ? 1 : 0), (ssize_t)len);
    uint8_t hdr[KVR_FRAME_HEADER_SIZE];
    cr_assert_eq(recv(fd, hdr, sizeof hdr, MSG_WAITALL), (ssize_t)sizeof hdr);
    kvr_frame_header fh;
    cr_assert_eq(kvr_frame_header_decode(hdr, &fh, NULL), 0);
    uint8_t *m = malloc(fh.msg_len ? fh.msg_len : 1);
    cr_assert_eq(recv(fd, m, fh.msg_len, MSG_WAITALL), (ssize_t)fh.msg_len);
    Kvrope__Response *r = kvrope__response__unpack(NULL, fh.msg_len, m);
    free(m);
    cr_assert_not_null(r);
    int st = (int)r->status;
    kvrope__response__free_unpacked(r, NULL);
    return st;
}

/* Frames written together are read together (the daemon reads a header
 * with what follows it): a descriptor on a write whose RegisterRegion
 * comes after other frames is that RegisterRegion's. */
static void pack_frame(uint8_t *buf, size_t cap, size_t *off, Kvrope__Request *q)
{
    size_t n = kvrope__request__get_packed_size(q);
    cr_assert_leq(*off + KVR_FRAME_HEADER_SIZE + n, cap);
    kvr_frame_header_encode(buf + *off, (uint32_t)n, 0);
    kvrope__request__pack(q, buf + *off + KVR_FRAME_HEADER_SIZE);
    *off += KVR_FRAME_HEADER_SIZE + n;
}

/* sendmsg of len bytes with `copies` copies of fd `pass` (none if 0);
 * the bytes sent, or -1. */
static void send_with_fd(int fd, const uint8_t *buf, size_t len, int pass)
{
    cr_assert_eq(kvt_send_fds(fd, buf, len, pass, 1), (ssize_t)len);
}

static Kvrope__Response *recv_answer(int fd)
{
    uint8_t hdr[KVR_FRAME_HEADER_SIZE];
    cr_assert_eq(recv(fd, hdr, sizeof hdr, MSG_WAITALL), (ssize_t)sizeof hdr);
    kvr_frame_header fh;
    cr_assert_eq(kvr_frame_header_decode(hdr, &fh, NULL), 0);
    cr_assert_eq(fh.payload_len, 0);
    uint8_t *m = malloc(fh.msg_len ? fh.msg_len : 1);
    cr_assert_eq(recv(fd, m, fh.msg_len, MSG_WAITALL), (ssize_t)fh.msg_len);
    Kvrope__Response *r = kvrope__response__unpack(NULL, fh.msg_len, m);
    free(m);
    cr_assert_not_null(r);
    return r;
}

/* The refusal of descriptors on a frame that takes none: E_BAD_REQUEST
 * (with id `id`, or `alt`) saying only register_region carries one, then
 * the daemon closes the connection. */
static void expect_fd_refusal(int fd, uint64_t id, uint64_t alt)
{
    Kvrope__Response *r = recv_answer(fd);
    cr_assert_eq(r->status, KVROPE__STATUS__E_BAD_REQUEST, "%d %s", r->status, r->message);
    cr_assert(r->id == id || r->id == alt, "id %llu", (unsigned long long)r->id);
    cr_assert(r->message && strstr(r->message, "only a register_region frame carries one"),
              "%s", r->message);
    kvrope__response__free_unpacked(r, NULL);
    uint8_t b;
    cr_assert_eq(recv(fd, &b, 1, 0), 0, "the connection stays open");
}

/* Waits (up to 5 s) for the daemon's descriptors to drop to at most max. */
static int fds_settle(int max)
{
    int n = kvt_count_fds(D.pid);
    for (int i = 0; i < 250 && n > max; i++) {
        usleep(20000);
        n = kvt_count_fds(D.pid);
    }
    return n;
}

/* A raw connection the daemon has answered a ping on (accepted, its fds
 * counted); *q is that ping (id 1), for more. */
static int pinged_connect(Kvrope__Request *q, Kvrope__Ping *ping)
{
    int fd = raw_connect();
    kvrope__request__init(q);
    kvrope__ping__init(ping);
    q->id = 1;
    q->body_case = KVROPE__REQUEST__BODY_PING;
    q->ping = ping;
    cr_assert_eq(raw_call(fd, q, -1), KVROPE__STATUS__OK);
    return fd;
}

/* pinged_connect, then the daemon's descriptor count (*before) and a
 * 4096-byte memfd sealed against shrinking (*mfd). The connection. */
static int pinged_with_memfd(Kvrope__Request *q, Kvrope__Ping *ping, int *before, int *mfd)
{
    int fd = pinged_connect(q, ping);
    *before = kvt_count_fds(D.pid);
    *mfd = raw_memfd(4096, F_SEAL_SHRINK);
    return fd;
}

/* q (request id) a RegisterRegion of 4096 bytes through rr. */
static void region_request(Kvrope__Request *q, Kvrope__RegisterRegion *rr, uint64_t id)
{
    kvrope__register_region__init(rr);
    rr->size = 4096;
    kvrope__request__init(q);
    q->id = id;
    q->body_case = KVROPE__REQUEST__BODY_REGISTER_REGION;
    q->register_region = rr;
}

/* Issue 29 item 6: a descriptor on a frame that takes none (here pings)
 * is refused, not silently closed: the peer learns its fd went nowhere. */
Test(int_shm, descriptors_on_frames_that_take_none_are_refused)
{
    Kvrope__Request q;
    Kvrope__Ping ping;
    int before, mfd;
    int fd = pinged_with_memfd(&q, &ping, &before, &mfd);
    uint8_t buf[512];
    size_t off = 0;
    q.id = 7;
    pack_frame(buf, sizeof buf, &off, &q);
    send_with_fd(fd, buf, off, mfd);
    expect_fd_refusal(fd, 7, 7);
    close(fd);
    int after = fds_settle(before);
    cr_assert_leq(after, before, "the daemon kept descriptors: %d -> %d", before, after);
    /* a RegisterRegion without a descriptor: refused, the connection stays */
    fd = raw_connect();
    Kvrope__RegisterRegion rr;
    Kvrope__Request g;
    region_request(&g, &rr, 2);
    cr_assert_eq(raw_call(fd, &g, -1), KVROPE__STATUS__E_BAD_REQUEST);
    cr_assert_eq(raw_call(fd, &q, -1), KVROPE__STATUS__OK);
    /* and with one it works; the connection's close unmaps it */
    cr_assert_eq(raw_call(fd, &g, mfd), KVROPE__STATUS__OK);
    close(mfd);
    close(fd);
    cr_assert_eq(kvr_client_ping(C, NULL), 0);
}

Test(int_shm, descriptors_of_pipelined_frames)
{
    Kvrope__Request q;
    Kvrope__Ping ping;
    int before, mfd;
    int fd = pinged_with_memfd(&q, &ping, &before, &mfd);
    Kvrope__RegisterRegion rr;
    Kvrope__Request g;
    region_request(&g, &rr, 0);
    uint32_t regions[4];   /* --max-regions 4 */
    for (int i = 0; i < 4; i++) {
        /* two pings, then the RegisterRegion, in one write, the fd on its
         * first bytes (the first ping's); then a ping in a write of its own */
        uint8_t buf[512];
        size_t off = 0;
        q.id = 100 + (uint64_t)i * 4;
        pack_frame(buf, sizeof buf, &off, &q);
        q.id++;
        pack_frame(buf, sizeof buf, &off, &q);
        g.id = q.id + 1;
        pack_frame(buf, sizeof buf, &off, &g);
        send_with_fd(fd, buf, off, mfd);
        q.id = g.id + 1;
        off = 0;
        pack_frame(buf, sizeof buf, &off, &q);
        cr_assert_eq(send(fd, buf, off, MSG_NOSIGNAL), (ssize_t)off);
        for (int k = 0; k < 4; k++) {
            Kvrope__Response *r = recv_answer(fd);
            cr_assert_eq(r->id, 100 + (uint64_t)i * 4 + (uint64_t)k);
            cr_assert_eq(r->status, KVROPE__STATUS__OK, "frame %d: %s", k, r->message);
            if (k == 2) {
                cr_assert_eq(r->body_case, KVROPE__RESPONSE__BODY_REGION);
                regions[i] = r->region->region;
            }
            kvrope__response__free_unpacked(r, NULL);
        }
        for (int j = 0; j < i; j++)
            cr_assert_neq(regions[j], regions[i]);
    }
    /* A stray on a write of two pings is the last frame's: the first is
     * answered, the second refused, the connection closed. */
    uint8_t buf[256];
    size_t off = 0;
    q.id = 1000;
    pack_frame(buf, sizeof buf, &off, &q);
    q.id++;
    pack_frame(buf, sizeof buf, &off, &q);
    send_with_fd(fd, buf, off, mfd);
    Kvrope__Response *r = recv_answer(fd);
    cr_assert_eq(r->id, 1000);
    cr_assert_eq(r->status, KVROPE__STATUS__OK);
    kvrope__response__free_unpacked(r, NULL);
    expect_fd_refusal(fd, 1001, 1001);
    close(mfd);
    close(fd);
    /* the connection's regions are unmapped and its fds closed with it */
    int after = fds_settle(before);
    cr_assert_leq(after, before, "the daemon kept descriptors: %d -> %d", before, after);
    cr_assert_eq(kvr_client_ping(C, NULL), 0);
}

/* Sends a put frame's header and message for n tokens of ctx (the payload
 * is the caller's to send). */
static void send_put_head(int fd, uint64_t id, const char *ctx, uint32_t *tok, size_t n,
                          size_t len)
{
    Kvrope__Put p = KVROPE__PUT__INIT;
    p.context_id = (char *)(uintptr_t)ctx;
    p.model = "pm";
    p.has_mode = 1;
    p.mode = KVROPE__PUT_MODE__CREATE;
    p.n_tokens = n;
    p.tokens = tok;
    Kvrope__Request r = KVROPE__REQUEST__INIT;
    r.id = id;
    r.body_case = KVROPE__REQUEST__BODY_PUT;
    r.put = &p;
    uint8_t head[1024];
    size_t m = kvrope__request__get_packed_size(&r);
    cr_assert_leq(m + KVR_FRAME_HEADER_SIZE, sizeof head);
    kvr_frame_header_encode(head, (uint32_t)m, len);
    kvrope__request__pack(&r, head + KVR_FRAME_HEADER_SIZE);
    cr_assert_eq(send(fd, head, m + KVR_FRAME_HEADER_SIZE, MSG_NOSIGNAL),
                 (ssize_t)(m + KVR_FRAME_HEADER_SIZE));
}

/* Issue 29 item 6, the old open item: a descriptor riding on a put's
 * payload bytes used to wait for the next descriptor-taking frame. It is
 * refused at once: the put is aborted (nothing stored), E_BAD_REQUEST,
 * the connection closed. A payload's tail written together with a
 * RegisterRegion and its memfd is fine: the fd is the RegisterRegion's. */
Test(int_shm, descriptors_on_payload_bytes_are_refused)
{
    cr_assert_eq(testd_register(C, "pm", KVR_DTYPE_F16, NULL), 0);
    int before = kvt_count_fds(D.pid);
    int mfd = raw_memfd(4096, F_SEAL_SHRINK);
    const size_t n = 70;   /* two blocks: several iovecs */
    size_t len;
    void *pl = testd_payload(3, T_LAYERS, 0, n, KVR_DTYPE_F16, &len);
    uint32_t *tok = testd_tokens(0, n);
    for (int part = 0; part < 2; part++) {
        /* the descriptor on the payload's first part, or on its second */
        int fd = raw_connect();
        char id[16];
        snprintf(id, sizeof id, "fp%d", part);
        send_put_head(fd, 10, id, tok, n, len);
        cr_assert_eq(kvt_send_fds(fd, pl, len / 3, mfd, part == 0), (ssize_t)(len / 3));
        usleep(20000);   /* read apart, when the daemon is still reading */
        ssize_t w = kvt_send_fds(fd, (uint8_t *)pl + len / 3, len - len / 3, mfd, part == 1);
        cr_assert(w == (ssize_t)(len - len / 3) || part == 0, "%zd", w);
        /* id 0: they came with payload bytes; 10: read with the put's
         * message (the kernel joined the two writes), so the put's own */
        expect_fd_refusal(fd, 0, 10);
        close(fd);
        kvr_get_args g = { .ctx_id = id, .dtype = KVR_DTYPE_F16 };
        kvr_kv kv;
        cr_assert_eq(kvr_client_get(C, &g, &kv), KVR_ENOCTX, "an aborted put stored %s",
                     id);
    }
    int after = fds_settle(before);
    cr_assert_leq(after, before, "the daemon kept descriptors: %d -> %d", before, after);
    /* The payload's tail, then a RegisterRegion, in one write with the fd. */
    int fd = raw_connect();
    send_put_head(fd, 20, "fp-ok", tok, n, len);
    cr_assert_eq(send(fd, pl, len / 2, MSG_NOSIGNAL), (ssize_t)(len / 2));
    Kvrope__RegisterRegion rr;
    Kvrope__Request rg;
    region_request(&rg, &rr, 21);
    size_t rest = len - len / 2, off = rest;
    uint8_t *buf = malloc(rest + 512);
    memcpy(buf, (uint8_t *)pl + len / 2, rest);
    pack_frame(buf, rest + 512, &off, &rg);
    send_with_fd(fd, buf, off, mfd);
    /* The kernel hands the descriptor to the first read of that write: when
     * the daemon's read takes the payload's tail alone (its reads into the
     * block stop at the payload's end), the descriptor came with payload
     * bytes and is refused like any other; when the read also takes the
     * RegisterRegion, that frame has it. Either way the answer is clear and
     * what is stored is whole: the put and the region, or a refusal naming
     * the descriptors and no fp-ok. (libkvrope never writes a payload and a
     * RegisterRegion together.) */
    Kvrope__Response *r = recv_answer(fd);
    bool refused = r->status == KVROPE__STATUS__E_BAD_REQUEST;
    if (refused) {
        cr_assert(r->message && strstr(r->message, "descriptor"), "%s", r->message);
        kvrope__response__free_unpacked(r, NULL);
    } else {
        cr_assert_eq(r->id, 20);
        cr_assert_eq(r->status, KVROPE__STATUS__OK, "20: %s", r->message);
        kvrope__response__free_unpacked(r, NULL);
        r = recv_answer(fd);
        cr_assert_eq(r->id, 21);
        cr_assert_eq(r->status, KVROPE__STATUS__OK, "21: %s", r->message);
        kvrope__response__free_unpacked(r, NULL);
    }
    kvr_get_args g = { .ctx_id = "fp-ok", .dtype = KVR_DTYPE_F16 };
    kvr_kv kv;
    if (refused) {
        cr_assert_eq(kvr_client_get(C, &g, &kv), KVR_ENOCTX, "a refused put stored fp-ok");
    } else {
        cr_assert_eq(kvr_client_get(C, &g, &kv), 0, "%s", kvr_client_last_error(C));
        cr_assert_eq(kv.payload_len, len);
        cr_assert_eq(memcmp(kv.payload, pl, len), 0);
        kvr_kv_release(&kv);
    }
    close(mfd);
    close(fd);
    free(buf);
    free(pl);
    free(tok);
}

/* Issue 29 item 6: clients each sending an unfinished frame a byte per
 * sendmsg, every byte with 253 copies of a memfd, drove the daemon to its
 * descriptor limit. The descriptors waiting for one frame are bounded:
 * past the bound they are closed and the connection refused; the daemon's
 * descriptor count stays where it was, and others are served. */
Test(int_shm, a_client_cannot_hoard_descriptors)
{
    int mfd = raw_memfd(4096, F_SEAL_SHRINK);
    enum { NC = 8 };
    int fds[NC];
    int refused = 0;
    uint8_t hdr[KVR_FRAME_HEADER_SIZE];
    kvr_frame_header_encode(hdr, 16, 0);
    Kvrope__Request q;
    Kvrope__Ping ping;
    for (int i = 0; i < NC; i++)
        fds[i] = pinged_connect(&q, &ping);
    int before = kvt_count_fds(D.pid);
    for (size_t b = 0; b + 1 < sizeof hdr; b++) {   /* never a whole header */
        for (int i = 0; i < NC; i++) {
            if (fds[i] < 0)
                continue;
            if (kvt_send_fds(fds[i], hdr + b, 1, mfd, 253) != 1) {
                close(fds[i]);    /* refused and closed already */
                fds[i] = -1;
                refused++;
            }
        }
        /* While the frames are unfinished the daemon holds none of them
         * (a few may be in flight in a socket buffer or being closed). */
        usleep(2000);
    }
    int during = fds_settle(before + 4);
    cr_assert_leq(during, before + 4, "the daemon holds %d descriptors (%d before)", during,
                  before);
    for (int i = 0; i < NC; i++) {
        if (fds[i] < 0)
            continue;
        Kvrope__Response *r = recv_answer(fds[i]);
        cr_assert_eq(r->status, KVROPE__STATUS__E_BAD_REQUEST, "%s", r->message);
        cr_assert(strstr(r->message, "file descriptors arrived for one frame"), "%s",
                  r->message);
        kvrope__response__free_unpacked(r, NULL);
        close(fds[i]);
    }
    cr_assert_eq(kvr_client_ping(C, NULL), 0);
    uint32_t id;
    void *base;
    cr_assert_eq(kvr_client_region_create(C, 4096, &id, &base), 0, "%s",
                 kvr_client_last_error(C));
    close(mfd);
    (void)refused;
}

/* Issue 29 item 7: regions are mappings and vm.max_map_count is global, so
 * the daemon caps them over all connections (here 6; 4 per connection):
 * the client that asks past the cap gets E_LIMIT saying so, the others
 * keep working (puts, gets and their own regions), and a release or a
 * closed connection gives the room back. */
Test(int_shm, regions_of_all_connections_are_capped)
{
    own_daemon();
    const char *extra[] = { "--max-regions", "4", "--max-regions-total", "6", NULL };
    cr_assert_eq(testd_start(&D, extra), 0, "daemon did not start");
    kvr_client *a = testd_connect(&D), *b = testd_connect(&D), *p = testd_connect(&D);
    cr_assert(a && b && p);
    uint32_t ia[4], ib[3], id;
    void *base;
    for (int i = 0; i < 4; i++)
        cr_assert_eq(kvr_client_region_create(a, 4096, &ia[i], &base), 0, "%s",
                     kvr_client_last_error(a));
    for (int i = 0; i < 2; i++)
        cr_assert_eq(kvr_client_region_create(b, 4096, &ib[i], &base), 0, "%s",
                     kvr_client_last_error(b));
    int r = kvr_client_region_create(b, 4096, &ib[2], &base);
    cr_assert_eq(r, KVR_ELIMIT, "%d %s", r, kvr_client_last_error(b));
    cr_assert(strstr(kvr_client_last_error(b), "over all connections") &&
              strstr(kvr_client_last_error(b), "--max-regions-total 6"), "%s",
              kvr_client_last_error(b));
    /* Unrelated work goes on: a put and a get on a third connection, and
     * b's regions still serve. */
    cr_assert_eq(testd_register(p, "cm", KVR_DTYPE_F16, NULL), 0);
    cr_assert_eq(testd_put(p, "capped", "cm", KVR_DTYPE_F16, 1, 0, 0, 40), 0, "%s",
                 kvr_client_last_error(p));
    kvr_get_args g = { .ctx_id = "capped", .dtype = KVR_DTYPE_F16 };
    kvr_kv kv;
    cr_assert_eq(kvr_client_get(p, &g, &kv), 0, "%s", kvr_client_last_error(p));
    kvr_kv_release(&kv);
    cr_assert_eq(kvr_client_ping(b, NULL), 0);
    /* A release makes room for b; a's connection closing makes room too. */
    cr_assert_eq(kvr_client_region_release(a, ia[0]), 0);
    cr_assert_eq(kvr_client_region_create(b, 4096, &ib[2], &base), 0, "%s",
                 kvr_client_last_error(b));
    cr_assert_eq(kvr_client_region_create(p, 4096, &id, &base), KVR_ELIMIT);
    kvr_client_close(a);
    int rc = -1;
    for (int i = 0; i < 1000 && rc != 0; i++) {   /* the close is seen by the loop soon */
        rc = kvr_client_region_create(p, 4096, &id, &base);
        if (rc != 0)
            kvt_sleep_ms(10);
    }
    cr_assert_eq(rc, 0, "%s", kvr_client_last_error(p));
    kvr_client_close(b);
    kvt_daemon_down(&D, &p, NULL);
}

/* Without --max-regions-total the cap comes from vm.max_map_count, with
 * room left for the daemon's own mappings. */
Test(int_shm, the_default_region_cap_leaves_room_for_the_daemons_maps)
{
    own_daemon();
    const char *extra[] = { "--log-level", "info", NULL };
    cr_assert_eq(testd_start(&D, extra), 0, "daemon did not start");
    unsigned long long maps = 65530;
    FILE *f = fopen("/proc/sys/vm/max_map_count", "r");
    if (f) {
        cr_assert_eq(fscanf(f, "%llu", &maps), 1);
        fclose(f);
    }
    unsigned long long room = maps / 4 > 16384 ? maps / 4 : 16384;
    unsigned long long cap = maps > 2 * room ? maps - room : maps / 2;
    if (cap > (1ull << 30))
        cap = 1ull << 30;
    char want[160];
    snprintf(want, sizeof want, "shared-memory regions: at most %llu over all connections "
             "(vm.max_map_count %llu)", cap, maps);
    cr_assert(cap < maps && cap + 16384 <= maps);
    char *log = NULL;
    for (int i = 0; i < 100; i++) {
        FILE *l = fopen(D.log, "r");
        if (l) {
            static char buf[1 << 16];
            size_t n = fread(buf, 1, sizeof buf - 1, l);
            buf[n] = 0;
            fclose(l);
            if ((log = strstr(buf, want)))
                break;
        }
        kvt_sleep_ms(10);
    }
    cr_assert_not_null(log, "no '%s' in %s", want, D.log);
    testd_stop(&D);
}
