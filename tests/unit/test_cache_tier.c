/*
 * test_cache_tier.c — the disk tier at store level (cache/tier.c): spill
 * and reload bit-exact for every codec under a small memory cap, prefetch,
 * persistence across a store restart (persistent contexts back exactly,
 * others gone), delete, corruption of the log, both engines.
 */
#include <criterion/criterion.h>
#include <dirent.h>
#include <fcntl.h>
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

static const char *CODECS[] = { "", "f16", "bf16", "int8", "int4", "int2", "k4v2",
                                "kivi:k4v2", "q8_0", "q4_0" };
#define N_CODECS (sizeof CODECS / sizeof CODECS[0])

static char DIR_[256];
/* Tokens per block (0: the store's default, 64). 256: plain f32 blocks of
 * 512 KiB + metadata (a 640 KiB size class). */
static uint32_t BLOCK_TOKENS;

static void fresh_dir(void)
{
    kvt_tmpdir(DIR_, sizeof DIR_, "kvr-tier");
}


static kvr_store *open_store(size_t cap, int engine, kvr_tier_recovery *rec)
{
    kvr_store_config cfg = { .max_memory = cap, .block_tokens = BLOCK_TOKENS };
    kvr_tier_config tc = { .dir = DIR_, .engine = engine };
    return kvt_store_open(&cfg, &tc, true, rec, L, H, D, KVR_DTYPE_F32);
}

static int put(kvr_store *s, const char *id, const char *codec, uint32_t seed, size_t n,
               bool persist)
{
    kvr_error e = { 0 };
    kvt_range a = { .id = id, .codec = codec, .seed = seed, .n_layers = L, .n_heads = H,
                  .head_dim = D, .n = n, .mode = KVR_PUT_UPSERT, .persist = persist };
    int rc = kvt_stream_put(s, &a, &e);
    if (rc != 0)
        fprintf(stderr, "put %s: %s\n", id, e.msg);
    else if (kvr_store_persist(s, id, NULL, NULL, &e) < 0)   /* as the daemon does */
        return KVR_EIO;
    return rc;
}

/* The whole context as f32 (or NULL); *len bytes. */
static uint8_t *get_all(kvr_store *s, const char *id, size_t *len)
{
    kvr_error e = { 0 };
    uint8_t *g = kvt_get_all(s, id, len, &e);
    if (!g)
        fprintf(stderr, "get %s: %s\n", id, e.msg);
    return g;
}

static void same(const uint8_t *a, size_t na, const uint8_t *b, size_t nb, const char *what)
{
    cr_assert(a && b, "%s: a get failed", what);
    cr_assert_eq(na, nb, "%s: %zu vs %zu bytes", what, na, nb);
    cr_assert(memcmp(a, b, na) == 0, "%s: bytes differ", what);
}

static void spill_reload(int engine)
{
    for (size_t ci = 0; ci < N_CODECS; ci++) {
        fresh_dir();
        kvr_store *s = open_store(4u << 20, engine, NULL);
        cr_assert_eq(put(s, "a", CODECS[ci], 1, NTOK, false), 0);
        size_t n0, n1;
        uint8_t *g0 = get_all(s, "a", &n0);
        /* Push "a" out of memory. */
        for (int i = 0; i < 24; i++) {
            char id[16];
            snprintf(id, sizeof id, "x%d", i);
            cr_assert_eq(put(s, id, "", 100 + (uint32_t)i, NTOK, false), 0);
        }
        kvr_tier_stats ts;
        kvr_store_tier_stats(s, &ts);
        cr_assert_gt(ts.n_spills, 0, "codec '%s': nothing spilled", CODECS[ci]);
        cr_assert_gt(ts.spilled_blocks, 0);
        kvr_ctx_info ci0;
        cr_assert_eq(kvr_store_stat(s, "a", &ci0, NULL), 0, "'a' was dropped, not spilled");
        cr_assert_eq(ci0.n_tokens, NTOK);
        uint64_t rd = ts.reads_disk;
        uint8_t *g1 = get_all(s, "a", &n1);
        same(g0, n0, g1, n1, CODECS[ci]);
        kvr_store_tier_stats(s, &ts);
        cr_assert_gt(ts.n_reloads, 0);
        cr_assert_gt(ts.reads_disk, rd);
        /* Every spilled context comes back too. */
        for (int i = 0; i < 24; i++) {
            char id[16];
            snprintf(id, sizeof id, "x%d", i);
            size_t nx;
            uint8_t *gx = get_all(s, id, &nx);
            cr_assert(gx, "%s", id);
            free(gx);
        }
        free(g0);
        free(g1);
        kvr_store_destroy(s);
        kvt_rmrf(DIR_);
    }
}

Test(tier, spill_reload_every_codec_uring) { spill_reload(0); }
Test(tier, spill_reload_every_codec_posix) { spill_reload(2); }
/* Large blocks (a context's first block whole, its tail partial): spilled
 * with O_DIRECT and reloaded, every codec. */
Test(tier, spill_reload_large_blocks_uring) { BLOCK_TOKENS = 256; spill_reload(0); }
Test(tier, spill_reload_large_blocks_posix) { BLOCK_TOKENS = 256; spill_reload(2); }

static void restart(int engine)
{
    fresh_dir();
    kvr_store *s = open_store(0, engine, NULL);
    uint8_t *g[N_CODECS];
    size_t n[N_CODECS];
    for (size_t ci = 0; ci < N_CODECS; ci++) {
        char id[16];
        snprintf(id, sizeof id, "p%zu", ci);
        cr_assert_eq(put(s, id, CODECS[ci], 7 + (uint32_t)ci, NTOK, true), 0);
        kvr_store_persist_flush(s);
        /* an append, logged as a second record */
        cr_assert_eq(put(s, id, CODECS[ci], 7 + (uint32_t)ci, 50, false), 0);
        kvr_store_persist_flush(s);
        g[ci] = get_all(s, id, &n[ci]);
    }
    cr_assert_eq(put(s, "volatile", "", 3, 100, false), 0);
    cr_assert_eq(put(s, "gone", "", 4, 100, true), 0);
    kvr_store_persist_flush(s);
    cr_assert_eq(kvr_store_delete(s, "gone", NULL), 0);
    cr_assert_eq(kvr_store_persist(s, "gone", NULL, NULL, NULL), 1);
    kvr_store_persist_flush(s);
    kvr_store_destroy(s);

    kvr_tier_recovery rec;
    s = open_store(0, engine, &rec);
    cr_assert_eq(rec.contexts, N_CODECS, "%zu contexts recovered", rec.contexts);
    cr_assert_eq(rec.dropped_contexts, 0);
    cr_assert_eq(rec.quarantined, 0);
    for (size_t ci = 0; ci < N_CODECS; ci++) {
        char id[16];
        snprintf(id, sizeof id, "p%zu", ci);
        size_t m;
        uint8_t *h = get_all(s, id, &m);
        same(g[ci], n[ci], h, m, CODECS[ci]);
        free(h);
        free(g[ci]);
    }
    cr_assert_neq(kvr_store_stat(s, "volatile", &(kvr_ctx_info){ 0 }, NULL), 0);
    cr_assert_neq(kvr_store_stat(s, "gone", &(kvr_ctx_info){ 0 }, NULL), 0);
    /* And once more, recovered state recovered again (through a checkpoint). */
    kvr_store_destroy(s);
    s = open_store(1u << 20, engine, &rec);     /* small: recovery spills */
    cr_assert_eq(rec.contexts, N_CODECS);
    kvr_store_destroy(s);
    kvt_rmrf(DIR_);
}

Test(tier, restart_recovers_persistent_only_uring) { restart(0); }
Test(tier, restart_recovers_persistent_only_posix) { restart(2); }

Test(tier, corrupt_log_quarantined_rest_served)
{
    fresh_dir();
    kvr_store *s = open_store(0, 0, NULL);
    cr_assert_eq(put(s, "a", "", 1, 100, true), 0);
    kvr_store_persist_flush(s);
    cr_assert_eq(put(s, "b", "", 2, 100, true), 0);
    kvr_store_persist_flush(s);
    size_t na;
    uint8_t *ga = get_all(s, "a", &na);
    kvr_store_destroy(s);
    /* Flip a byte near the end of the log: b's record. */
    DIR *d = opendir(DIR_);
    struct dirent *e;
    char p[600] = "";
    while ((e = readdir(d)) != NULL)
        if (strstr(e->d_name, ".kvl"))
            snprintf(p, sizeof p, "%s/%s", DIR_, e->d_name);
    closedir(d);
    int fd = open(p, O_RDWR);
    cr_assert(fd >= 0, "%s", p);
    struct stat st;
    fstat(fd, &st);
    uint8_t x;
    cr_assert_eq(pread(fd, &x, 1, st.st_size - 20), 1);
    x ^= 0x5a;
    cr_assert_eq(pwrite(fd, &x, 1, st.st_size - 20), 1);
    close(fd);
    kvr_tier_recovery rec;
    s = open_store(0, 0, &rec);
    cr_assert_geq(rec.quarantined + (rec.torn_bytes ? 1 : 0), 1);
    size_t na2;
    uint8_t *ga2 = get_all(s, "a", &na2);
    same(ga, na, ga2, na2, "a after corruption");
    cr_assert_neq(kvr_store_stat(s, "b", &(kvr_ctx_info){ 0 }, NULL), 0);
    free(ga);
    free(ga2);
    kvr_store_destroy(s);
    kvt_rmrf(DIR_);
}

Test(tier, persist_without_disk_refused)
{
    kvr_store *s;
    kvr_store_config cfg = { 0 };
    cr_assert_eq(kvr_store_create(&s, &cfg, NULL), 0);
    kvr_model_desc d = { .name = "m", .n_layers = L, .n_kv_heads = H, .head_dim = D,
                         .dtype = KVR_DTYPE_F32 };
    kvr_rope_config_init(&d.rope);
    cr_assert_eq(kvr_store_model_register(s, &d, NULL, NULL), 0);
    cr_assert_eq(put(s, "a", "", 1, 10, true), KVR_EUNSUPPORTED);
    kvr_store_destroy(s);
}
