/*
 * test_cache_tier_async.c — reloads of spilled blocks off the loop thread
 * (cache/tier.c tier_reload_*): a get / assemble of a spilled context goes
 * begin (this thread, "the loop") -> work (a pthread, while this thread
 * keeps serving store calls) -> end, as the daemon drives it:
 *  - puts to other contexts (which spill more blocks) while the load runs;
 *    the result is bit-exact and the blocks are resident after end;
 *  - a delete of the context being read while the load runs: the get still
 *    returns its data, the reloaded buffers are freed at end;
 *  - two concurrent gets of the same spilled blocks: both exact, one copy
 *    is installed, the other freed (either end order);
 *  - a raw get and an assemble of spilled contexts, likewise;
 *  - a load failure (a corrupted extent: checksum mismatch; an injected
 *    read fault: EIO) fails that request with KVR_EIO and a message, and
 *    the store stays consistent (other contexts served, the context can be
 *    deleted; after an injected one-shot fault the next get succeeds).
 */
#include <criterion/criterion.h>
#include <dirent.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cache/cache.h"
#include "tests/common/kvt.h"
#include "tests/common/kvt_store.h"
#include "tests/common/kvt.h"
#include "tests/common/cache_stream.h"

#define L 2
#define H 2
#define D 64
#define ROW (H * D)
#define NTOK 300

static char DIR_[256];


static kvr_store *open_store(size_t cap, int engine)
{
    kvt_tmpdir(DIR_, sizeof DIR_, "kvr-tiera");
    kvr_store_config cfg = { .max_memory = cap };
    kvr_tier_config tc = { .dir = DIR_, .engine = engine };
    return kvt_store_open(&cfg, &tc, true, NULL, L, H, D, KVR_DTYPE_F32);
}

static void close_store(kvr_store *s)
{
    kvr_store_destroy(s);
    kvt_rmrf(DIR_);
}

static int put_ex(kvr_store *s, const char *id, const char *codec, uint32_t seed, size_t n,
                  const char *prefix)
{
    kvr_error e = { 0 };
    kvt_range a = { .id = id, .codec = codec, .prefix = prefix, .seed = seed, .n_layers = L,
                  .n_heads = H, .head_dim = D, .n = n,
                  .mode = prefix ? KVR_PUT_CREATE : KVR_PUT_UPSERT };
    int rc = kvt_stream_put(s, &a, &e);
    if (rc != 0)
        fprintf(stderr, "put %s: %s\n", id, e.msg);
    return rc;
}

static int put(kvr_store *s, const char *id, const char *codec, uint32_t seed, size_t n)
{
    return put_ex(s, id, codec, seed, n, NULL);
}

/* Pushes everything older out of memory with `count` fresh contexts. */
static void push_out(kvr_store *s, const char *tag, int count)
{
    for (int i = 0; i < count; i++) {
        char id[32];
        snprintf(id, sizeof id, "%s%d", tag, i);
        cr_assert_eq(put(s, id, "", 500 + (uint32_t)i, NTOK), 0);
    }
}

static uint8_t *copy_iov(const struct iovec *iov, size_t ni, size_t total)
{
    uint8_t *out = malloc(total ? total : 1), *w = out;
    size_t got = 0;
    for (size_t i = 0; i < ni; i++) {
        memcpy(w, iov[i].iov_base, iov[i].iov_len);
        w += iov[i].iov_len;
        got += iov[i].iov_len;
    }
    cr_assert_eq(got, total);
    return out;
}

static kvr_get *get_begin(kvr_store *s, const char *id, bool raw, kvr_error *e)
{
    kvr_get_params gp = { .ctx_id = id, .start = 0, .end = SIZE_MAX, .dtype = KVR_DTYPE_F32,
                          .raw = raw };
    kvr_get *g = NULL;
    cr_assert_eq(kvr_store_get_begin(s, &gp, &g, e), 0, "get %s: %s", id, e->msg);
    return g;
}

static uint8_t *get_payload(kvr_get *g, size_t *len)
{
    const struct iovec *iov;
    size_t ni;
    kvr_get_payload_iov(g, &iov, &ni);
    *len = kvr_get_payload_size(g);
    return copy_iov(iov, ni, *len);
}

/* The whole payload of a get done synchronously (NULL on failure). */
static uint8_t *get_sync(kvr_store *s, const char *id, bool raw, size_t *len)
{
    kvr_error e = { 0 };
    kvr_get *g = get_begin(s, id, raw, &e);
    if (kvr_get_needs_work(g) && kvr_get_work(g, &e) != 0) {
        kvr_get_end(g);
        return NULL;
    }
    uint8_t *out = get_payload(g, len);
    kvr_get_end(g);
    return out;
}

static bool spilled_all(kvr_store *s)
{
    kvr_tier_stats ts;
    kvr_store_tier_stats(s, &ts);
    return ts.spilled_blocks > 0;
}

/* ---- work on another thread ------------------------------------------------- */

typedef struct job {
    pthread_t   th;
    kvr_get    *g;
    kvr_assemble *a;
    int         rc;
    kvr_error   e;
} job;

static void *job_run(void *arg)
{
    job *j = arg;
    j->rc = j->g ? kvr_get_work(j->g, &j->e) : kvr_assemble_work(j->a, &j->e);
    return NULL;
}

static void job_start(job *j)
{
    /* The staging is reserved on the store's thread (cache.h), as the
     * daemon does before it queues the work. */
    int rc = j->g ? kvr_get_stage(j->g, &j->e) : kvr_assemble_stage(j->a, &j->e);
    cr_assert_eq(rc, 0, "%s", j->e.msg);
    cr_assert_eq(pthread_create(&j->th, NULL, job_run, j), 0);
}

/* A get of the whole of id (f32), begun (get_begin) and its work started
 * on another thread as *j; the get. */
static kvr_get *get_job(kvr_store *s, const char *id, job *j, kvr_error *e)
{
    kvr_get *g = get_begin(s, id, false, e);
    *j = (job){ .g = g };
    job_start(j);
    return g;
}

static void job_join(job *j)
{
    cr_assert_eq(pthread_join(j->th, NULL), 0);
}

/* A store (cap, engine) holding context "a" (codec, seed 1, NTOK tokens)
 * whose whole get is in *g0 (*n0 bytes), then pushed out of memory by
 * `fill` contexts "x..." (push_out). */
static kvr_store *pushed_out(size_t cap, int engine, const char *codec, int fill, uint8_t **g0,
                             size_t *n0)
{
    kvr_store *s = open_store(cap, engine);
    cr_assert_eq(put(s, "a", codec, 1, NTOK), 0);
    *g0 = get_sync(s, "a", false, n0);
    push_out(s, "x", fill);
    return s;
}

/* ---- tests ------------------------------------------------------------------ */

static void get_while_loop_serves(int engine, const char *codec)
{
    size_t n0, n1;
    uint8_t *g0;
    kvr_store *s = pushed_out(4u << 20, engine, codec, 24, &g0, &n0);
    cr_assert(spilled_all(s));
    kvr_tier_stats ts0, ts1;
    kvr_store_tier_stats(s, &ts0);

    kvr_error e = { 0 };
    kvr_get *g = get_begin(s, "a", false, &e);
    cr_assert(kvr_get_needs_work(g), "a reload must be work");
    job j = { .g = g };
    job_start(&j);
    /* The loop thread carries on: puts that spill more, gets, stats. */
    push_out(s, "y", 6);
    size_t nx;
    uint8_t *gx = get_sync(s, "y0", false, &nx);
    cr_assert(gx);
    free(gx);
    kvr_store_tier_stats(s, &ts1);
    job_join(&j);
    cr_assert_eq(j.rc, 0, "%s", j.e.msg);
    cr_assert_not(kvr_get_needs_work(g));
    uint8_t *g1 = get_payload(g, &n1);
    cr_assert_eq(n0, n1);
    cr_assert(memcmp(g0, g1, n0) == 0, "codec '%s': reloaded bytes differ", codec);
    kvr_get_end(g);
    kvr_store_tier_stats(s, &ts1);
    cr_assert_gt(ts1.n_reloads, ts0.n_reloads);
    cr_assert_gt(ts1.reads_disk, ts0.reads_disk);
    /* Installed: the next get of "a" reads memory, and is exact. */
    free(g1);
    g1 = get_sync(s, "a", false, &n1);
    cr_assert(g1 && n1 == n0 && memcmp(g0, g1, n0) == 0);
    kvr_tier_stats ts2;
    kvr_store_tier_stats(s, &ts2);
    cr_assert_eq(ts2.reads_disk, ts1.reads_disk, "the installed blocks were read again");
    free(g0);
    free(g1);
    close_store(s);
}

Test(tier_async, get_while_loop_serves_plain_uring) { get_while_loop_serves(0, ""); }
Test(tier_async, get_while_loop_serves_plain_posix) { get_while_loop_serves(2, ""); }
Test(tier_async, get_while_loop_serves_quant) { get_while_loop_serves(0, "kivi:k4v2"); }
Test(tier_async, get_while_loop_serves_f16) { get_while_loop_serves(2, "f16"); }

Test(tier_async, delete_while_loading)
{
    size_t n0, n1;
    uint8_t *g0;
    kvr_store *s = pushed_out(4u << 20, 0, "", 24, &g0, &n0);
    kvr_store_stats st0, st1;
    kvr_store_get_stats(s, &st0);
    kvr_error e = { 0 };
    job j;
    kvr_get *g = get_job(s, "a", &j, &e);
    cr_assert_eq(kvr_store_delete(s, "a", &e), 0, "%s", e.msg);
    cr_assert_neq(kvr_store_stat(s, "a", &(kvr_ctx_info){ 0 }, NULL), 0);
    push_out(s, "y", 4);     /* and the loop keeps spilling meanwhile */
    job_join(&j);
    cr_assert_eq(j.rc, 0, "%s", j.e.msg);
    uint8_t *g1 = get_payload(g, &n1);      /* the transaction holds the data */
    cr_assert(n0 == n1 && memcmp(g0, g1, n0) == 0);
    kvr_get_end(g);                        /* frees the reloaded buffers */
    kvr_store_get_stats(s, &st1);
    cr_assert_eq(st1.n_leased_blocks, 0);
    cr_assert_eq(st1.n_contexts, st0.n_contexts - 1 + 4);
    /* A new "a" is a new context; the old one's blocks are gone. */
    cr_assert_eq(put(s, "a", "", 2, 10), 0);
    kvr_ctx_info ci;
    cr_assert_eq(kvr_store_stat(s, "a", &ci, NULL), 0);
    cr_assert_eq(ci.n_tokens, 10);
    free(g0);
    free(g1);
    close_store(s);
}

Test(tier_async, delete_before_work)
{
    /* Deleted between begin and work: work still reads the leased copy. */
    size_t n0, n1;
    uint8_t *g0;
    kvr_store *s = pushed_out(4u << 20, 2, "int8", 24, &g0, &n0);
    kvr_error e = { 0 };
    kvr_get *g = get_begin(s, "a", false, &e);
    cr_assert_eq(kvr_store_delete(s, "a", &e), 0);
    push_out(s, "y", 4);
    job j = { .g = g };
    job_start(&j);
    job_join(&j);
    cr_assert_eq(j.rc, 0, "%s", j.e.msg);
    uint8_t *g1 = get_payload(g, &n1);
    cr_assert(n0 == n1 && memcmp(g0, g1, n0) == 0);
    kvr_get_end(g);
    /* And a transaction that ends without its work ran: freed as well. */
    cr_assert_eq(put(s, "b", "", 3, NTOK), 0);
    push_out(s, "z", 24);
    g = get_begin(s, "b", false, &e);
    cr_assert(kvr_get_needs_work(g));
    kvr_get_end(g);
    free(g0);
    free(g1);
    g1 = get_sync(s, "b", false, &n1);
    cr_assert(g1);
    free(g1);
    close_store(s);
}

static void concurrent_same(bool first_ends_first)
{
    size_t n0, n1, n2;
    uint8_t *g0;
    kvr_store *s = pushed_out(8u << 20, 0, "", 48, &g0, &n0);
    cr_assert(spilled_all(s));
    kvr_tier_stats ts0, ts1;
    kvr_store_tier_stats(s, &ts0);
    kvr_error e = { 0 };
    kvr_get *ga = get_begin(s, "a", false, &e);
    kvr_get *gb = get_begin(s, "a", false, &e);
    cr_assert(kvr_get_needs_work(ga) && kvr_get_needs_work(gb));
    job ja = { .g = ga }, jb = { .g = gb };
    job_start(&ja);
    job_start(&jb);
    job_join(&ja);
    job_join(&jb);
    cr_assert_eq(ja.rc, 0, "%s", ja.e.msg);
    cr_assert_eq(jb.rc, 0, "%s", jb.e.msg);
    uint8_t *p1 = get_payload(ga, &n1), *p2 = get_payload(gb, &n2);
    cr_assert(n1 == n0 && memcmp(p1, g0, n0) == 0);
    cr_assert(n2 == n0 && memcmp(p2, g0, n0) == 0);
    /* The one that ends first installs; the other's copy is freed, and a
     * third get that began meanwhile reads memory. */
    kvr_get_end(first_ends_first ? ga : gb);
    kvr_get *gc = get_begin(s, "a", false, &e);
    kvr_get_end(first_ends_first ? gb : ga);
    if (kvr_get_needs_work(gc))
        cr_assert_eq(kvr_get_work(gc, &e), 0, "%s", e.msg);
    uint8_t *p3 = get_payload(gc, &n1);
    cr_assert(n1 == n0 && memcmp(p3, g0, n0) == 0);
    kvr_get_end(gc);
    kvr_store_tier_stats(s, &ts1);
    cr_assert_eq(ts1.reads_disk, ts0.reads_disk + 2, "the third get read the disk");
    cr_assert_eq(ts1.reads_mem, ts0.reads_mem + 1);
    kvr_store_stats st;
    kvr_store_get_stats(s, &st);
    cr_assert_eq(st.n_leased_blocks, 0);
    free(p1);
    free(p2);
    free(p3);
    free(g0);
    close_store(s);
}

Test(tier_async, concurrent_gets_same_block) { concurrent_same(true); }
Test(tier_async, concurrent_gets_same_block_other_order) { concurrent_same(false); }

Test(tier_async, raw_get_of_spilled_quantized)
{
    kvr_store *s = open_store(4u << 20, 0);
    cr_assert_eq(put(s, "q", "k4v2", 9, NTOK), 0);
    /* Raw reads the quantized blocks only: move the window out of the way
     * by asking for a range of the quantized part. */
    kvr_get_params gp = { .ctx_id = "q", .start = 0, .end = 128, .raw = true };
    kvr_get *g = NULL;
    kvr_error e = { 0 };
    int rc = kvr_store_get_begin(s, &gp, &g, &e);
    cr_assert_eq(rc, 0, "%s", e.msg);
    size_t n0, n1;
    uint8_t *r0 = get_payload(g, &n0);
    kvr_get_end(g);
    push_out(s, "x", 24);
    cr_assert_eq(kvr_store_get_begin(s, &gp, &g, &e), 0, "%s", e.msg);
    cr_assert(kvr_get_needs_work(g), "a raw get of spilled blocks must load");
    job j = { .g = g };
    job_start(&j);
    push_out(s, "y", 2);
    job_join(&j);
    cr_assert_eq(j.rc, 0, "%s", j.e.msg);
    uint8_t *r1 = get_payload(g, &n1);
    cr_assert(n0 == n1 && memcmp(r0, r1, n0) == 0, "raw bytes differ after reload");
    kvr_get_end(g);
    free(r0);
    free(r1);
    close_store(s);
}

static float *assemble_sync(kvr_store *s, const kvr_assemble_params *ap, size_t *len,
                            bool threaded, bool serve)
{
    kvr_assemble *a = NULL;
    kvr_error e = { 0 };
    cr_assert_eq(kvr_store_assemble_begin(s, ap, &a, &e), 0, "%s", e.msg);
    if (kvr_assemble_needs_work(a)) {
        job j = { .a = a };
        if (threaded) {
            job_start(&j);
            if (serve)
                push_out(s, "y", 3);
            job_join(&j);
        } else {
            job_run(&j);
        }
        cr_assert_eq(j.rc, 0, "%s", j.e.msg);
    } else {
        cr_assert_not(serve, "the spilled assemble needs work");
    }
    const struct iovec *iov;
    size_t ni;
    kvr_assemble_payload_iov(a, &iov, &ni);
    *len = kvr_assemble_payload_size(a);
    float *out = (float *)(void *)copy_iov(iov, ni, *len);
    kvr_assemble_end(a);
    return out;
}

Test(tier_async, assemble_of_spilled_contexts)
{
    kvr_store *s = open_store(4u << 20, 0);
    cr_assert_eq(put(s, "pre", "", 1, 64), 0);
    cr_assert_eq(put_ex(s, "d0", "", 2, 100, "pre"), 0);
    cr_assert_eq(put_ex(s, "d1", "int8", 3, 100, "pre"), 0);
    const char *docs[] = { "d0", "d1" };
    kvr_assemble_params ap = { .prefix = "pre", .docs = docs, .n_docs = 2,
                               .layout = KVR_LAYOUT_SEQUENTIAL, .dtype = KVR_DTYPE_F16 };
    size_t n0, n1;
    float *a0 = assemble_sync(s, &ap, &n0, false, false);
    push_out(s, "x", 24);
    float *a1 = assemble_sync(s, &ap, &n1, true, true);
    cr_assert(n0 == n1 && memcmp(a0, a1, n0) == 0, "assemble differs after reload");
    free(a0);
    free(a1);
    close_store(s);
}

/* First data segment file of DIR_. */
static void seg_path(char *p, size_t cap)
{
    DIR *d = opendir(DIR_);
    struct dirent *e;
    p[0] = '\0';
    char best[300] = "";
    while ((e = readdir(d)) != NULL)
        if (!strncmp(e->d_name, "seg-", 4) && (!best[0] || strcmp(e->d_name, best) < 0))
            snprintf(best, sizeof best, "%s", e->d_name);
    closedir(d);
    cr_assert(best[0], "no segment file");
    snprintf(p, cap, "%s/%s", DIR_, best);
}

static void load_failure(int engine)
{
    kvr_store *s = open_store(4u << 20, engine);
    cr_assert_eq(put(s, "a", "", 1, NTOK), 0);
    cr_assert_eq(put(s, "b", "", 2, NTOK), 0);
    size_t nb0, nb1;
    uint8_t *b0 = get_sync(s, "b", false, &nb0);
    push_out(s, "x", 24);
    cr_assert(spilled_all(s));
    /* The first extent written is the least recently used context's: "a". */
    char p[600];
    seg_path(p, sizeof p);
    int fd = open(p, O_RDWR);
    cr_assert(fd >= 0);
    uint8_t x;
    cr_assert_eq(pread(fd, &x, 1, 32 + 1000), 1);
    x ^= 0xa5;
    cr_assert_eq(pwrite(fd, &x, 1, 32 + 1000), 1);
    close(fd);
    kvr_tier_stats ts0, ts1;
    kvr_store_tier_stats(s, &ts0);

    kvr_error e = { 0 };
    job j;
    kvr_get *g = get_job(s, "a", &j, &e);
    push_out(s, "y", 2);
    job_join(&j);
    cr_assert_eq(j.rc, KVR_EIO, "a corrupt block was served (rc %d)", j.rc);
    cr_assert(strstr(j.e.msg, "spilled block"), "message: %s", j.e.msg);
    kvr_get_end(g);
    kvr_store_tier_stats(s, &ts1);
    cr_assert_gt(ts1.quarantined, ts0.quarantined);
    kvr_store_stats st;
    kvr_store_get_stats(s, &st);
    cr_assert_eq(st.n_leased_blocks, 0);
    /* Nothing else is affected: "b" (spilled too) comes back exact. */
    uint8_t *b1 = get_sync(s, "b", false, &nb1);
    cr_assert(b1 && nb0 == nb1 && memcmp(b0, b1, nb0) == 0);
    /* "a" is never served from the bad copy, and can be deleted. */
    cr_assert_null(get_sync(s, "a", false, &nb1));
    cr_assert_eq(kvr_store_delete(s, "a", NULL), 0);
    cr_assert_eq(put(s, "a", "", 3, 50), 0);
    uint8_t *a2 = get_sync(s, "a", false, &nb1);
    cr_assert(a2);
    free(a2);
    free(b0);
    free(b1);
    close_store(s);
}

Test(tier_async, corrupt_block_fails_get_uring) { load_failure(0); }
Test(tier_async, corrupt_block_fails_get_posix) { load_failure(2); }

Test(tier_async, injected_read_fault_fails_only_that_get)
{
    /* disk.h fault hook through the tier: the first read fails with EIO. */
    setenv("KVR_DISK_FAULT", "4:1:5:1", 1);
    kvr_store *s = open_store(4u << 20, 2);
    unsetenv("KVR_DISK_FAULT");
    cr_assert_eq(put(s, "a", "", 1, NTOK), 0);
    size_t n0, n1;
    uint8_t *g0 = get_sync(s, "a", false, &n0);
    push_out(s, "x", 24);
    kvr_error e = { 0 };
    job j;
    kvr_get *g = get_job(s, "a", &j, &e);
    job_join(&j);
    cr_assert_eq(j.rc, KVR_EIO, "rc %d", j.rc);
    cr_assert(j.e.msg[0]);
    /* Retrying the work of the failed transaction gives the same answer. */
    cr_assert_eq(kvr_get_work(g, &e), KVR_EIO);
    kvr_get_end(g);
    /* The fault was one-shot: the block on disk is fine, the next get works. */
    uint8_t *g1 = get_sync(s, "a", false, &n1);
    cr_assert(g1 && n0 == n1 && memcmp(g0, g1, n0) == 0);
    free(g0);
    free(g1);
    close_store(s);
}
