/*
 * test_int_disk.c — the disk tier through kvroped (issue 8), each test for
 * both engines (auto = io_uring where the kernel allows it, and the forced
 * POSIX fallback):
 *  - spill/reload: a small --max-memory with --disk-dir; contexts pushed out
 *    of memory come back bit-exact (f32/f16/bf16 payloads; every codec at
 *    rest, quantized ones too, in test_cache_tier);
 *  - restart: persistent contexts back exactly after SIGTERM, others gone;
 *  - kill -9 at random instants during a stream of persistent puts, edits
 *    and deletes; after each restart every acknowledged state is exact and
 *    the one operation in flight is either fully there or fully absent.
 *    A memory-only reference daemon replays the same operations, so the
 *    expected state of a context is the reference daemon's get, hashed.
 *    Trials: KVR_DISK_KILL_TRIALS (default 100; 20 under KVR_SANITIZE);
 *  - corrupted bytes at random offsets of the disk files: the daemon starts,
 *    and every context it serves is exact;
 *  - a disk that fails (injected fsync fault / full): the request fails with
 *    E_IO, memory-only contexts still work.
 */
#include <criterion/criterion.h>
#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tests/common/cache_stream.h"
#include "tests/common/kvr_testd.h"
#include "tests/common/kvt_daemon.h"
#include "tests/common/kvt.h"
#include "tests/common/kvt.h"


static void disk_dir(char *out, size_t cap)
{
    snprintf(out, cap, "/tmp/kvr-disk-XXXXXX");
    cr_assert(mkdtemp(out));
}

static int start(kvr_testd *d, const char *dir, const char *engine, const char *mem)
{
    const char *args[] = { "--disk-dir", dir, "--disk-engine", engine, "--max-memory",
                           mem ? mem : "256M", NULL };
    return testd_start(d, args);
}

/* Hash of a context as a get sees it (tokens, positions, flags, KV); 0 if
 * it does not exist, 1 on another error. */
static uint64_t ctx_hash(kvr_client *c, const char *id, kvr_dtype dt)
{
    kvr_get_args a = { .ctx_id = id, .dtype = dt };
    kvr_kv kv;
    int r = kvr_client_get(c, &a, &kv);
    if (r == KVR_ENOCTX)
        return 0;
    if (r != 0)
        return 1;
    uint64_t h = 14695981039346656037ull;
    h = kvt_fnv(h, &kv.n_tokens, sizeof kv.n_tokens);
    h = kvt_fnv(h, kv.tokens, kv.n_tokens * 4);
    h = kvt_fnv(h, kv.positions, kv.n_tokens * 8);
    h = kvt_fnv(h, kv.flags, kv.n_tokens * 4);
    h = kvt_fnv(h, kv.payload, kv.payload_len);
    kvr_kv_release(&kv);
    return h | 2;
}

static int put_p(kvr_client *c, const char *ctx, kvr_dtype dt, uint32_t seed, uint32_t base,
                 size_t n, bool persist, const char *codec)
{
    size_t len;
    void *pl = testd_payload(seed, T_LAYERS, base, n, dt, &len);
    uint32_t *tok = testd_tokens(base, n);
    kvr_put_args a = { .ctx_id = ctx, .model = "m", .dtype = dt, .tokens = tok, .n_tokens = n,
                       .n_layers = T_LAYERS, .n_kv_heads = T_HEADS, .head_dim = T_DIM,
                       .payload = pl, .payload_len = len, .mode = KVR_PUT_UPSERT,
                       .persist = persist };
    /* Codecs at rest are covered at store level (test_cache_tier); the
     * client's codec option is not wired in this tree yet. */
    (void)codec;
    int r = kvr_client_put(c, &a, NULL);
    free(pl);
    free(tok);
    return r;
}

/* Criterion tests suite int_disk::name_auto and name_posix running fn on
 * each disk engine, with a timeout of secs. */
#define ENGINE_TESTS(name, fn, secs)                                           \
    Test(int_disk, name##_auto, .timeout = secs) { fn("auto"); }              \
    Test(int_disk, name##_posix, .timeout = secs) { fn("posix"); }

/* Closes c, stops d and starts it again on dir with engine: a client of
 * the new daemon. */
static kvr_client *restart_daemon(kvr_client *c, kvr_testd *d, const char *dir,
                                  const char *engine)
{
    kvr_client_close(c);
    testd_stop(d);
    cr_assert_eq(start(d, dir, engine, NULL), 0);
    return testd_connect(d);
}

/* Starts a daemon on a fresh disk directory (disk_dir: into dir, cap
 * bytes) with engine (start) and registers the f16 test model "m" on a
 * client of it, which it returns. */
static kvr_client *start_with_model(kvr_testd *d, char *dir, size_t cap, const char *engine)
{
    disk_dir(dir, cap);
    cr_assert_eq(start(d, dir, engine, NULL), 0);
    kvr_client *c = testd_connect(d);
    cr_assert_eq(testd_register(c, "m", KVR_DTYPE_F16, NULL), 0);
    return c;
}

/* Closes c, stops d and removes its disk directory dir. */
static void stop_and_remove(kvr_client *c, kvr_testd *d, const char *dir)
{
    kvr_client_close(c);
    testd_stop(d);
    kvt_rmrf(dir);
}

/* ---- spill and reload --------------------------------------------------------- */

static void spill_reload(const char *engine)
{
    char dir[64];
    disk_dir(dir, sizeof dir);
    kvr_testd d;
    cr_assert_eq(start(&d, dir, engine, "2M"), 0);
    kvr_client *c = testd_connect(&d);
    cr_assert(c);
    cr_assert_eq(testd_register(c, "m", KVR_DTYPE_F32, NULL), 0);
    static const struct { kvr_dtype dt; const char *codec; } V[] = {
        { KVR_DTYPE_F32, NULL }, { KVR_DTYPE_F16, NULL }, { KVR_DTYPE_BF16, NULL },
    };
    enum { NV = sizeof V / sizeof V[0] };
    uint64_t h0[NV];
    for (size_t i = 0; i < NV; i++) {
        char id[16];
        snprintf(id, sizeof id, "c%zu", i);
        cr_assert_eq(put_p(c, id, V[i].dt, 10 + (uint32_t)i, 0, 400, false, V[i].codec), 0,
                     "%s", kvr_client_last_error(c));
        h0[i] = ctx_hash(c, id, V[i].dt);
        cr_assert_gt(h0[i], 2);
    }
    /* Push them out: 40 more contexts of 400 tokens through a 2 MiB cap. */
    for (int i = 0; i < 40; i++) {
        char id[16];
        snprintf(id, sizeof id, "x%d", i);
        cr_assert_eq(put_p(c, id, KVR_DTYPE_F32, 100 + (uint32_t)i, 0, 400, false, NULL), 0,
                     "%s", kvr_client_last_error(c));
    }
    cr_assert_gt(testd_metric(c, "tier_spills"), 0);
    cr_assert_gt(testd_metric(c, "tier_spilled_blocks"), 0);
    for (size_t i = 0; i < NV; i++) {
        char id[16];
        snprintf(id, sizeof id, "c%zu", i);
        cr_assert_eq(ctx_hash(c, id, V[i].dt), h0[i], "context %s (%s) changed", id,
                     V[i].codec ? V[i].codec : "f32");
    }
    cr_assert_gt(testd_metric(c, "tier_reloads"), 0);
    cr_assert_gt(testd_metric(c, "tier_reads_disk"), 0);
    double e = testd_metric(c, "disk_engine_io_uring") + testd_metric(c, "disk_engine_posix");
    cr_assert_eq(e, 1.0);
    if (!strcmp(engine, "posix"))
        cr_assert_eq(testd_metric(c, "disk_engine_posix"), 1.0);
    stop_and_remove(c, &d, dir);
}

ENGINE_TESTS(spill_reload, spill_reload, 120)

/* ---- restart -------------------------------------------------------------------- */

static void restart(const char *engine)
{
    char dir[64];
    kvr_testd d;
    kvr_client *c = start_with_model(&d, dir, sizeof dir, engine);
    cr_assert_eq(put_p(c, "p", KVR_DTYPE_F16, 1, 0, 200, true, NULL), 0, "%s",
                 kvr_client_last_error(c));
    cr_assert_eq(put_p(c, "p", KVR_DTYPE_F16, 1, 200, 77, false, NULL), 0);
    cr_assert_eq(put_p(c, "q", KVR_DTYPE_F32, 2, 0, 150, true, NULL), 0, "%s",
                 kvr_client_last_error(c));
    uint32_t nt[3] = { 9000, 9001, 9002 };
    kvr_edit_range op = { .start = 10, .end = 20, .tokens = nt, .n_tokens = 0 };
    kvr_edit_args ea = { .ctx_id = "p", .ops = &op, .n_ops = 1 };
    cr_assert_eq(kvr_client_edit(c, &ea, NULL), 0, "%s", kvr_client_last_error(c));
    cr_assert_eq(put_p(c, "v", KVR_DTYPE_F16, 3, 0, 100, false, NULL), 0);
    cr_assert_eq(put_p(c, "del", KVR_DTYPE_F16, 4, 0, 100, true, NULL), 0);
    cr_assert_eq(kvr_client_delete(c, "del"), 0);
    uint64_t hp = ctx_hash(c, "p", KVR_DTYPE_F16), hq = ctx_hash(c, "q", KVR_DTYPE_F32);
    cr_assert_eq(testd_metric(c, "persist_contexts"), 2.0);

    c = restart_daemon(c, &d, dir, engine);
    cr_assert_eq(ctx_hash(c, "p", KVR_DTYPE_F16), hp);
    cr_assert_eq(ctx_hash(c, "q", KVR_DTYPE_F32), hq);
    cr_assert_eq(ctx_hash(c, "v", KVR_DTYPE_F16), 0, "non-persistent context came back");
    cr_assert_eq(ctx_hash(c, "del", KVR_DTYPE_F16), 0, "deleted context came back");
    cr_assert_eq(testd_metric(c, "recovery_contexts"), 2.0);
    cr_assert_geq(testd_metric(c, "recovery_ms"), 0.0);
    stop_and_remove(c, &d, dir);
}

static int put_replace(kvr_client *c, const char *ctx, uint32_t seed, size_t n, bool persist)
{
    kvr_put_args a = { .ctx_id = ctx, .model = "m", .dtype = KVR_DTYPE_F16,
                       .mode = KVR_PUT_REPLACE, .persist = persist };
    return testd_put_with(c, &a, seed, seed * 1000, 0, n);
}

/* put REPLACE of persistent contexts: the replacement is what a restart
 * brings back (persistent), or nothing (not persistent: the old one's
 * record is superseded by its DELETE). */
Test(int_disk, replace_survives_restart, .timeout = 120)
{
    char dir[64];
    kvr_testd d;
    kvr_client *c = start_with_model(&d, dir, sizeof dir, "auto");
    cr_assert_eq(put_replace(c, "a", 1, 120, true), 0, "%s", kvr_client_last_error(c));
    cr_assert_eq(put_replace(c, "b", 2, 80, true), 0, "%s", kvr_client_last_error(c));
    cr_assert_eq(put_replace(c, "a", 3, 40, true), 0, "%s", kvr_client_last_error(c));
    cr_assert_eq(put_replace(c, "b", 4, 30, false), 0, "%s", kvr_client_last_error(c));
    uint64_t ha = ctx_hash(c, "a", KVR_DTYPE_F16);
    cr_assert_eq(testd_metric(c, "persist_contexts"), 1.0);

    c = restart_daemon(c, &d, dir, "auto");
    cr_assert_eq(ctx_hash(c, "a", KVR_DTYPE_F16), ha, "the replacement did not come back");
    kvr_context ci;
    cr_assert_eq(kvr_client_stat(c, "a", &ci), 0);
    cr_assert_eq(ci.n_tokens, 40);
    cr_assert_eq(ctx_hash(c, "b", KVR_DTYPE_F16), 0, "a replaced context came back");
    cr_assert_eq(testd_metric(c, "recovery_contexts"), 1.0);
    stop_and_remove(c, &d, dir);
}

ENGINE_TESTS(restart, restart, 120)

/* ---- kill -9 ----------------------------------------------------------------------- */

#define NCTX 3

typedef struct world {
    uint64_t acked[NCTX];       /* hash of each context's acknowledged state */
    uint32_t next_base;
} world;

/* One random operation on ctx k of both daemons: the reference first (its
 * result is the "post" state), then the target. Returns the target's rc. */
static int one_op(kvr_client *ref, kvr_client *tgt, unsigned *seed, int k, uint64_t *post,
                  world *w)
{
    char id[16];
    snprintf(id, sizeof id, "k%d", k);
    int kind = rand_r(seed) % 10;
    int r_ref, r;
    uint64_t exists = ctx_hash(ref, id, KVR_DTYPE_F16);
    /* The reference keeps the state before the op (a fork: exact copy). */
    kvr_client_delete(ref, "bk");
    if (exists)
        cr_assert_eq(kvr_client_fork(ref, id, "bk"), 0);
    if (exists == 0 || kind < 5) {
        size_t n = 1 + (size_t)(rand_r(seed) % 90);
        uint32_t base = w->next_base;
        w->next_base += (uint32_t)n;
        r_ref = put_p(ref, id, KVR_DTYPE_F16, (uint32_t)k, base, n, false, NULL);
        r = put_p(tgt, id, KVR_DTYPE_F16, (uint32_t)k, base, n, true, NULL);
    } else if (kind < 8) {
        kvr_get_args a = { .ctx_id = id, .dtype = KVR_DTYPE_F16, .meta_only = true };
        kvr_kv kv;
        cr_assert_eq(kvr_client_get(ref, &a, &kv), 0);
        uint64_t n = kv.n_tokens;
        kvr_kv_release(&kv);
        /* A context an earlier edit emptied has n == 0: then the op inserts
         * (no modulo by zero; the same draws from the seed either way). */
        uint64_t r1 = (uint64_t)rand_r(seed), r2 = (uint64_t)rand_r(seed);
        uint64_t s0 = n ? r1 % n : 0, len = n ? 1 + r2 % 8 : 0;
        if (s0 + len > n)
            len = n - s0;
        uint32_t nt = (uint32_t)(rand_r(seed) % 4), toks[4];
        if (n == 0 && nt == 0)
            nt = 1;
        for (uint32_t i = 0; i < nt; i++)
            toks[i] = w->next_base++;
        kvr_edit_range op = { .start = s0, .end = s0 + len, .tokens = toks, .n_tokens = nt };
        size_t plen = kvr_payload_size(T_LAYERS, nt, T_HEADS, T_DIM, KVR_DTYPE_F16);
        void *pl = testd_payload((uint32_t)k + 50, T_LAYERS, toks[0], nt, KVR_DTYPE_F16, &plen);
        kvr_edit_args ea = { .ctx_id = id, .ops = &op, .n_ops = 1, .with_kv = nt > 0,
                             .dtype = KVR_DTYPE_F16, .payload = nt ? pl : NULL,
                             .payload_len = nt ? plen : 0 };
        if (s0 + len == n && nt == 0 && s0 == 0)
            op.end = n;     /* deleting everything is fine too */
        r_ref = kvr_client_edit(ref, &ea, NULL);
        r = kvr_client_edit(tgt, &ea, NULL);
        free(pl);
    } else {
        r_ref = kvr_client_delete(ref, id);
        r = kvr_client_delete(tgt, id);
    }
    cr_assert_eq(r_ref, 0, "reference: %s", kvr_client_last_error(ref));
    *post = ctx_hash(ref, id, KVR_DTYPE_F16);
    return r;
}

static int env_int(const char *name, int dflt)
{
    const char *v = getenv(name);
    return v && *v ? atoi(v) : dflt;
}

static void kill9(const char *engine)
{
    int trials = env_int("KVR_DISK_KILL_TRIALS", getenv("KVR_SANITIZE") ? 20 : 100);
    char dir[64];
    disk_dir(dir, sizeof dir);
    kvr_testd ref;
    const char *rargs[] = { "--max-memory", "256M", NULL };
    kvr_client *rc = kvt_daemon_up_model(&ref, rargs, "m", KVR_DTYPE_F16);
    world w = { .next_base = 1 };
    unsigned seed = 12345;
    int inflight_seen = 0;
    for (int t = 0; t < trials; t++) {
        kvr_testd d;
        cr_assert_eq(start(&d, dir, engine, NULL), 0, "trial %d: start", t);
        kvr_client *c = testd_connect(&d);
        cr_assert(c);
        if (t == 0)
            cr_assert_eq(testd_register(c, "m", KVR_DTYPE_F16, NULL), 0);
        /* Every acknowledged state must be there, exactly. */
        for (int k = 0; k < NCTX; k++) {
            char id[16];
            snprintf(id, sizeof id, "k%d", k);
            cr_assert_eq(ctx_hash(c, id, KVR_DTYPE_F16), w.acked[k],
                         "trial %d: context %s differs from its acknowledged state", t, id);
        }
        /* A killer with a random delay. */
        int delay_us = rand_r(&seed) % 60000;
        pid_t target = d.pid, killer = fork();
        cr_assert(killer >= 0);
        if (killer == 0) {
            usleep((useconds_t)delay_us);
            kill(target, SIGKILL);
            _exit(0);
        }
        for (int i = 0; i < 1000; i++) {
            int k = rand_r(&seed) % NCTX;
            uint64_t post;
            uint64_t pre_ref = w.acked[k];
            int r = one_op(rc, c, &seed, k, &post, &w);
            if (r == 0) {
                w.acked[k] = post;
                continue;
            }
            /* The daemon died under this op: it is there or not, whole. */
            kvr_client_close(c);
            c = NULL;
            waitpid(killer, NULL, 0);
            testd_stop(&d);
            cr_assert_eq(start(&d, dir, engine, NULL), 0, "trial %d: restart", t);
            c = testd_connect(&d);
            cr_assert(c, "trial %d: connect after restart", t);
            char id[16];
            snprintf(id, sizeof id, "k%d", k);
            uint64_t now = ctx_hash(c, id, KVR_DTYPE_F16);
            cr_assert(now == pre_ref || now == post,
                      "trial %d: in-flight op on %s left a state that is neither before "
                      "nor after (%llx, pre %llx, post %llx)", t, id,
                      (unsigned long long)now, (unsigned long long)pre_ref,
                      (unsigned long long)post);
            if (now != post) {
                /* Not applied: the reference goes back to its state before. */
                inflight_seen++;
                kvr_client_delete(rc, id);
                if (pre_ref != 0)
                    cr_assert_eq(kvr_client_fork(rc, "bk", id), 0);
                cr_assert_eq(ctx_hash(rc, id, KVR_DTYPE_F16), pre_ref);
            }
            w.acked[k] = now;
            break;
        }
        if (c)
            kvr_client_close(c);
        waitpid(killer, NULL, 0);
        testd_stop(&d);
    }
    fprintf(stderr, "kill -9 (%s): %d trials, %d in-flight ops not applied\n", engine,
            trials, inflight_seen);
    kvr_client_close(rc);
    testd_stop(&ref);
    kvt_rmrf(dir);
}

/* A worker whose kvroped is killed gets an error from every call, never a
 * signal: SIGPIPE keeps its default disposition here (which would end this
 * process) and the payload is large enough that the send meets the closed
 * socket. */
Test(int_disk, killed_daemon_gives_errors, .timeout = 120)
{
    signal(SIGPIPE, SIG_DFL);
    kvr_testd d;
    const char *args[] = { "--max-memory", "256M", NULL };
    kvr_client *c = kvt_daemon_up_model(&d, args, "m", KVR_DTYPE_F32);
    cr_assert_eq(put_p(c, "a", KVR_DTYPE_F32, 1, 0, 10, false, NULL), 0);
    kill(d.pid, SIGKILL);
    waitpid(d.pid, NULL, 0);
    d.pid = 0;
    int r = put_p(c, "b", KVR_DTYPE_F32, 2, 0, 20000, false, NULL);
    cr_assert_lt(r, 0, "a put to a killed daemon must fail");
    cr_assert(r == KVR_ECLOSED || r == KVR_ESYS, "%d: %s", r, kvr_client_last_error(c));
    cr_assert_eq(kvr_client_ping(c, NULL), KVR_ECLOSED);
    cr_assert_eq(ctx_hash(c, "a", KVR_DTYPE_F32), 1);
    kvt_daemon_down(&d, &c, NULL);
}

ENGINE_TESTS(kill9, kill9, 600)

/* ---- corruption ----------------------------------------------------------------------- */

static void corrupt(const char *engine)
{
    char dir[64];
    kvr_testd d;
    kvr_client *c = start_with_model(&d, dir, sizeof dir, engine);
    enum { NC = 8 };
    uint64_t h[NC];
    for (int i = 0; i < NC; i++) {
        char id[16];
        snprintf(id, sizeof id, "c%d", i);
        cr_assert_eq(put_p(c, id, KVR_DTYPE_F16, (uint32_t)i, 0, 100 + 10 * (size_t)i, true,
                           NULL), 0);
        h[i] = ctx_hash(c, id, KVR_DTYPE_F16);
    }
    kvr_client_close(c);
    testd_stop(&d);
    /* Random bytes at random offsets of every file of the disk tier. */
    unsigned seed = 777;
    DIR *dd = opendir(dir);
    struct dirent *e;
    int files = 0;
    while ((e = readdir(dd)) != NULL) {
        if (e->d_name[0] == '.' || !strcmp(e->d_name, "LOCK"))
            continue;
        char p[600];
        snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
        int fd = open(p, O_RDWR);
        struct stat st;
        if (fd < 0 || fstat(fd, &st) != 0 || st.st_size == 0) {
            if (fd >= 0)
                close(fd);
            continue;
        }
        for (int k = 0; k < 2; k++) {
            off_t off = (off_t)((unsigned)rand_r(&seed) % (unsigned)st.st_size);
            uint8_t x = (uint8_t)(rand_r(&seed) | 1);
            uint8_t y;
            if (pread(fd, &y, 1, off) == 1) {
                y ^= x;
                cr_assert_eq(pwrite(fd, &y, 1, off), 1);
            }
        }
        close(fd);
        files++;
    }
    closedir(dd);
    cr_assert_gt(files, 0);
    cr_assert_eq(start(&d, dir, engine, NULL), 0, "the daemon must start on corrupt files");
    c = testd_connect(&d);
    int exact = 0, gone = 0;
    for (int i = 0; i < NC; i++) {
        char id[16];
        snprintf(id, sizeof id, "c%d", i);
        uint64_t now = ctx_hash(c, id, KVR_DTYPE_F16);
        /* A context restored from an older record says so on every token. */
        kvr_get_args ma = { .ctx_id = id, .dtype = KVR_DTYPE_F16, .meta_only = true };
        kvr_kv mk;
        bool stale = false;
        if (now > 1 && now != h[i] && kvr_client_get(c, &ma, &mk) == 0) {
            stale = mk.n_tokens > 0 && (mk.flags[0] & KVR_TOKEN_STALE);
            kvr_kv_release(&mk);
        }
        cr_assert(now == h[i] || now == 0 || now == 1 || stale,
                  "context %s is served with wrong content after corruption", id);
        if (now == h[i])
            exact++;
        else
            gone++;
    }
    fprintf(stderr, "corruption (%s): %d contexts exact, %d dropped/unreadable, "
            "%.0f quarantined\n", engine, exact, gone, testd_metric(c, "disk_quarantined"));
    if (getenv("KVR_TEST_VERBOSE"))
        testd_print_log(&d);
    /* It still serves (the model record may have been the corrupt one). */
    cr_assert_eq(testd_register(c, "m", KVR_DTYPE_F16, NULL), 0);
    cr_assert_eq(put_p(c, "after", KVR_DTYPE_F16, 99, 0, 10, true, NULL), 0, "%s",
                 kvr_client_last_error(c));
    stop_and_remove(c, &d, dir);
}

ENGINE_TESTS(corrupt, corrupt, 120)

/* ---- disk errors ------------------------------------------------------------------------ */

static void fsync_fault(const char *engine)
{
    char dir[64];
    disk_dir(dir, sizeof dir);
    kvr_testd d;
    /* The 3rd fsync after start fails with EIO (and every one after). */
    setenv("KVR_DISK_FAULT", "2:3:5:1000000", 1);
    int rc = start(&d, dir, engine, NULL);
    unsetenv("KVR_DISK_FAULT");
    cr_assert_eq(rc, 0);
    kvr_client *c = testd_connect(&d);
    cr_assert_eq(testd_register(c, "m", KVR_DTYPE_F16, NULL), 0);
    int ok = 0, io = 0;
    for (int i = 0; i < 6; i++) {
        char id[16];
        snprintf(id, sizeof id, "p%d", i);
        int r = put_p(c, id, KVR_DTYPE_F16, (uint32_t)i, 0, 50, true, NULL);
        if (r == 0)
            ok++;
        else {
            cr_assert_eq(r, KVR_EIO, "%s", kvr_client_last_error(c));
            io++;
        }
    }
    cr_assert_gt(io, 0, "no request failed with E_IO");
    /* Memory-only operation continues. */
    cr_assert_eq(put_p(c, "mem", KVR_DTYPE_F16, 9, 0, 50, false, NULL), 0);
    cr_assert_gt(ctx_hash(c, "mem", KVR_DTYPE_F16), 2);
    cr_assert_eq(testd_metric(c, "disk_failed"), 1.0);
    cr_assert_gt(testd_metric(c, "persist_errors"), 0);
    /* What was acknowledged is there after a restart; nothing else half. */
    c = restart_daemon(c, &d, dir, engine);
    cr_assert_geq(testd_metric(c, "recovery_contexts"), (double)ok);
    stop_and_remove(c, &d, dir);
}

ENGINE_TESTS(fsync_fault, fsync_fault, 120)

/* ENOSPC from a real small filesystem (needs root to mount a 1 MiB tmpfs). */
Test(int_disk, enospc_small_tmpfs, .timeout = 120)
{
    char dir[64];
    disk_dir(dir, sizeof dir);
    if (mount("tmpfs", dir, "tmpfs", 0, "size=1m") != 0) {
        rmdir(dir);
        cr_skip_test("cannot mount a 1 MiB tmpfs (%s): ENOSPC test skipped", strerror(errno));
    }
    kvr_testd d;
    cr_assert_eq(start(&d, dir, "auto", NULL), 0);
    kvr_client *c = testd_connect(&d);
    cr_assert_eq(testd_register(c, "m", KVR_DTYPE_F32, NULL), 0);
    int io = 0, ok = 0;
    uint64_t hashes[40];
    for (int i = 0; i < 40; i++) {
        char id[16];
        snprintf(id, sizeof id, "p%d", i);
        int r = put_p(c, id, KVR_DTYPE_F32, (uint32_t)i, 0, 200, true, NULL);
        hashes[i] = 0;
        if (r == 0) {
            ok++;
            hashes[i] = ctx_hash(c, id, KVR_DTYPE_F32);
        } else {
            cr_assert_eq(r, KVR_EIO, "%s", kvr_client_last_error(c));
            io++;
        }
    }
    cr_assert_gt(io, 0, "a 1 MiB filesystem took 40 x 38 KiB");
    cr_assert_eq(put_p(c, "mem", KVR_DTYPE_F32, 9, 0, 50, false, NULL), 0);
    c = restart_daemon(c, &d, dir, "auto");
    for (int i = 0; i < 40; i++) {
        if (!hashes[i])
            continue;
        char id[16];
        snprintf(id, sizeof id, "p%d", i);
        cr_assert_eq(ctx_hash(c, id, KVR_DTYPE_F32), hashes[i], "acknowledged %s lost", id);
    }
    fprintf(stderr, "ENOSPC: %d persistent puts acknowledged, %d refused with E_IO\n", ok, io);
    kvr_client_close(c);
    testd_stop(&d);
    umount(dir);
    kvt_rmrf(dir);
}

/* ---- a corrupt newest record: stale marks, never a silent roll-back --------- */

/* Offset (in the current log file of dir, *path) of the last record of
 * `type` whose payload names `id`; -1 if none. */
static long find_record(const char *dir, uint32_t type, const char *id, char *path, size_t cap)
{
    DIR *dd = opendir(dir);
    struct dirent *e;
    unsigned best = 0;
    while ((e = readdir(dd)) != NULL) {
        unsigned g;
        if (sscanf(e->d_name, "log-%8x.kvl", &g) == 1 && strlen(e->d_name) == 16 && g >= best)
            best = g;
    }
    closedir(dd);
    snprintf(path, cap, "%s/log-%08x.kvl", dir, best);
    FILE *f = fopen(path, "rb");
    cr_assert(f);
    static uint8_t buf[1 << 20];
    size_t n = fread(buf, 1, sizeof buf, f);
    fclose(f);
    long hit = -1;
    size_t idl = strlen(id);
    for (size_t off = 0; off + 24 <= n;) {
        uint32_t t, len;
        memcpy(&t, buf + off + 16, 4);
        memcpy(&len, buf + off + 20, 4);
        uint32_t nl;
        memcpy(&nl, buf + off + 28, 4);
        if (t == type && nl == idl && !memcmp(buf + off + 32, id, idl))
            hit = (long)off;
        off += 24 + len;
    }
    return hit;
}

static void flip(const char *path, long off)
{
    int fd = open(path, O_RDWR);
    cr_assert_geq(fd, 0);
    uint8_t y;
    cr_assert_eq(pread(fd, &y, 1, off), 1);
    y ^= 0x5a;
    cr_assert_eq(pwrite(fd, &y, 1, off), 1);
    close(fd);
}

/* Flags of every token of ctx OR-ed, or UINT32_MAX if it cannot be read. */
static uint32_t ctx_flags(kvr_client *c, const char *id, uint64_t *n_out, int64_t *pos0)
{
    kvr_get_args a = { .ctx_id = id, .dtype = KVR_DTYPE_F16, .meta_only = true };
    kvr_kv kv;
    if (kvr_client_get(c, &a, &kv) != 0)
        return UINT32_MAX;
    uint32_t f = 0, all = ~0u;
    for (size_t i = 0; i < kv.n_tokens; i++) {
        f |= kv.flags[i];
        all &= kv.flags[i];
    }
    if (n_out)
        *n_out = kv.n_tokens;
    if (pos0)
        *pos0 = kv.n_tokens ? kv.positions[0] : -1;
    kvr_kv_release(&kv);
    cr_assert(kv.n_tokens == 0 || f == all, "context %s: a stale mark covers every token", id);
    return f;
}

static int log_has(const kvr_testd *d, const char *needle)
{
    FILE *f = fopen(d->log, "r");
    if (!f)
        return 0;
    char line[1024];
    int hit = 0;
    while (fgets(line, sizeof line, f))
        hit |= strstr(line, needle) != NULL;
    fclose(f);
    return hit;
}

/* how: 0 = a byte of the body (the head, with its own checksum, names the
 * context); 1 = a byte of the name (the loss cannot be attributed). */
static void corrupt_newest(int how)
{
    char dir[64], logp[128];
    kvr_testd d;
    kvr_client *c = start_with_model(&d, dir, sizeof dir, "auto");
    cr_assert_eq(put_p(c, "x", KVR_DTYPE_F16, 1, 0, 100, true, NULL), 0);
    cr_assert_eq(put_p(c, "y", KVR_DTYPE_F16, 2, 0, 50, true, NULL), 0);
    cr_assert_eq(kvr_client_shift(c, "x", 0, UINT64_MAX, 1000), 0);   /* x's newest state */
    cr_assert_eq(put_p(c, "z", KVR_DTYPE_F16, 3, 0, 10, true, NULL), 0);
    cr_assert_eq(put_p(c, "w", KVR_DTYPE_F16, 4, 0, 10, true, NULL), 0);  /* one record */
    kvr_client_close(c);
    testd_stop(&d);

    long rx = find_record(dir, 2, "x", logp, sizeof logp);
    cr_assert_geq(rx, 0);
    flip(logp, rx + (how == 0 ? 24 + 4 + 4 + 1 + 4 + 20 : 24 + 4 + 4));
    if (how == 0) {
        long rw = find_record(dir, 2, "w", logp, sizeof logp);
        cr_assert_geq(rw, 0);
        flip(logp, rw + 24 + 4 + 4 + 1 + 4 + 20);
    }

    for (int round = 0; round < 2; round++) {
        cr_assert_eq(start(&d, dir, "auto", NULL), 0);
        c = testd_connect(&d);
        uint64_t n;
        int64_t p0;
        uint32_t fx = ctx_flags(c, "x", &n, &p0);
        cr_assert_eq(fx, KVR_TOKEN_STALE | KVR_TOKEN_APPROX,
                     "round %d: x was rolled back to its state before the shift without a "
                     "mark (flags %#x)", round, fx);
        cr_assert_eq(n, 100);
        cr_assert_eq(p0, 0, "x is its previous state (before the shift)");
        cr_assert_eq(ctx_flags(c, "z", NULL, NULL), 0, "z's state came after the loss");
        if (how == 0) {
            cr_assert_eq(ctx_flags(c, "y", NULL, NULL), 0, "y is not the lost record's");
            cr_assert_eq(ctx_flags(c, "w", NULL, NULL), UINT32_MAX, "w had one record: lost");
        } else {
            cr_assert_eq(ctx_flags(c, "y", NULL, NULL), KVR_TOKEN_STALE | KVR_TOKEN_APPROX,
                         "an unattributed loss marks every context older than it");
        }
        if (round == 0) {
            cr_assert(log_has(&d, "context 'x'"), "the log names x");
            cr_assert_eq(testd_metric(c, "recovery_stale_contexts"), how == 0 ? 1.0 : 2.0, "%g %g", testd_metric(c, "recovery_stale_contexts"), testd_metric(c, "recovery_lost_contexts"));
            cr_assert_eq(testd_metric(c, "recovery_lost_contexts"), how == 0 ? 1.0 : 0.0);
            if (how == 0)
                cr_assert(log_has(&d, "context 'w'"), "the log names w");
            /* An exact match does not see stale tokens. */
            uint32_t *tok = testd_tokens(0, 100);
            kvr_match_res mr;
            cr_assert_eq(kvr_client_match(c, &(kvr_match_args){ .model = "m", .tokens = tok,
                                                                .n_tokens = 100 }, &mr), 0);
            cr_assert_lt(mr.length, 100);
            free(tok);
        }
        kvr_client_close(c);
        testd_stop(&d);
    }
    kvt_rmrf(dir);
}

Test(int_disk, corrupt_newest_record_attributed, .timeout = 120) { corrupt_newest(0); }
Test(int_disk, corrupt_newest_record_unattributed, .timeout = 120) { corrupt_newest(1); }
