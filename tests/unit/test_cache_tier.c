/*
 * test_cache_tier.c — the disk tier at store level (cache/tier.c): spill
 * and reload bit-exact for every codec under a small memory cap, prefetch,
 * persistence across a store restart (persistent contexts back exactly,
 * others gone; blocks back spilled, or read whole), delete, corruption of
 * the log and of a block (its metadata, its K/V), both engines.
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

/* ---- a corrupt block: its metadata at recovery, its K/V at first use ------ */

/* Where each extent of the data segments starts and its length, in file
 * order (found by their v2 trailers: "KVRT", the length at +20, the
 * extent's data ending at the trailer and starting on a 4 KiB boundary). */
typedef struct ext_at {
    char     path[600];
    uint64_t at, len;
} ext_at;

static size_t find_extents(ext_at *out, size_t cap)
{
    size_t n = 0;
    DIR *d = opendir(DIR_);
    cr_assert(d);
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (!strstr(e->d_name, ".v2.dat"))
            continue;
        char p[600];
        snprintf(p, sizeof p, "%s/%s", DIR_, e->d_name);
        int fd = open(p, O_RDONLY);
        struct stat st;
        cr_assert(fd >= 0 && fstat(fd, &st) == 0, "%s", p);
        uint8_t *b = malloc((size_t)st.st_size + 1);
        cr_assert_eq(pread(fd, b, (size_t)st.st_size, 0), st.st_size);
        close(fd);
        for (size_t i = 0; i + 32 <= (size_t)st.st_size && n < cap; i++) {
            if (memcmp(b + i, "KVRT", 4))
                continue;
            uint32_t len = (uint32_t)b[i + 20] | (uint32_t)b[i + 21] << 8 |
                           (uint32_t)b[i + 22] << 16 | (uint32_t)b[i + 23] << 24;
            if (len == 0 || len > i || (i - len) % 4096)
                continue;
            snprintf(out[n].path, sizeof out[n].path, "%s", p);
            out[n].at = i - len;
            out[n++].len = len;
        }
        free(b);
    }
    closedir(d);
    return n;
}

static void flip(const char *path, uint64_t off)
{
    int fd = open(path, O_RDWR);
    cr_assert(fd >= 0, "%s", path);
    uint8_t x;
    cr_assert_eq(pread(fd, &x, 1, (off_t)off), 1);
    x ^= 0x5a;
    cr_assert_eq(pwrite(fd, &x, 1, (off_t)off), 1);
    close(fd);
}

static char LOGBUF[8192];
static void keep_log(void *arg, int level, const char *msg)
{
    (void)arg;
    (void)level;
    size_t l = strlen(LOGBUF);
    snprintf(LOGBUF + l, sizeof LOGBUF - l, "%s\n", msg);
}

static kvr_store *open_logged(int engine, kvr_tier_recovery *rec)
{
    kvr_store_config cfg = { .block_tokens = BLOCK_TOKENS };
    kvr_tier_config tc = { .dir = DIR_, .engine = engine };
    kvr_store *s = kvt_store_new(&cfg);
    kvr_error e = { 0 };
    LOGBUF[0] = '\0';
    cr_assert_eq(kvr_store_tier_open(s, &tc, keep_log, NULL, rec, &e), 0, "%s", e.msg);
    return s;
}

/* Three persistent contexts; one byte of b's first block flipped: in its
 * K/V (what == 0) or in its metadata (what == 1). Recovery reads only the
 * metadata: a corrupt one drops b there (reported by id); a corrupt K/V
 * is found by the first get of b, which fails with a checksum error, as
 * does every later one, while b's metadata stays (nothing of b is served
 * partly). a and c come back exact either way, and again after a second
 * restart: nothing else is lost. whole: recovery reads every block whole
 * (KVR_TIER_RECOVER_EAGER, as records without metadata checksums are
 * read): either corruption drops b at recovery. */
static void corrupt_block(int engine, int what, bool whole)
{
    fresh_dir();
    kvr_store *s = open_store(0, engine, NULL);
    const char *ids[3] = { "a", "b", "c" };
    uint8_t *g[3];
    size_t n[3];
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(put(s, ids[i], "", 11 + (uint32_t)i, NTOK, true), 0);
        kvr_store_persist_flush(s);
        g[i] = get_all(s, ids[i], &n[i]);
    }
    kvr_store_destroy(s);
    ext_at x[64];
    size_t nx = find_extents(x, 64);
    cr_assert(nx >= 3 && nx % 3 == 0, "%zu extents", nx);
    const ext_at *v = &x[nx / 3];          /* b's first block: 64 slots, all used */
    cr_assert_geq(v->len, 64u * 16u + 200u);
    flip(v->path, what ? v->at + v->len - 64u * 16u + 3u : v->at + 100u);
    if (whole)
        setenv("KVR_TIER_RECOVER_EAGER", "1", 1);
    for (int round = 0; round < 2; round++) {
        kvr_tier_recovery rec;
        s = open_logged(engine, &rec);
        for (int i = 0; i < 3; i += 2) {
            size_t m;
            uint8_t *h = get_all(s, ids[i], &m);
            same(g[i], n[i], h, m, ids[i]);
            free(h);
        }
        kvr_ctx_info ci;
        if (what || whole) {
            cr_assert_eq(rec.contexts, 2, "%zu contexts recovered", rec.contexts);
            /* (The checkpoint after the first recovery left b's record out.) */
            cr_assert_eq(rec.dropped_contexts, round == 0 ? 1u : 0u);
            cr_assert_neq(kvr_store_stat(s, "b", &ci, NULL), 0, "b was kept");
            if (round == 0)
                cr_assert(strstr(LOGBUF, "context 'b'") && strstr(LOGBUF, "dropped"), "%s",
                          LOGBUF);
            if (round == 0 && what && !whole)
                cr_assert(strstr(LOGBUF, "metadata failed its checksum"), "%s", LOGBUF);
        } else {
            cr_assert_eq(rec.contexts, 3, "%zu contexts recovered", rec.contexts);
            cr_assert_eq(rec.dropped_contexts, 0);
            cr_assert_eq(kvr_store_stat(s, "b", &ci, NULL), 0);
            cr_assert_eq(ci.n_tokens, NTOK);
            for (int k = 0; k < 2; k++) {
                kvr_error e = { 0 };
                size_t m;
                uint8_t *h = kvt_get_all(s, "b", &m, &e);
                cr_assert_null(h, "a corrupt block was served");
                cr_assert_eq(e.code, KVR_EIO, "%d: %s", e.code, e.msg);
                cr_assert(strstr(e.msg, "checksum"), "%s", e.msg);
            }
            /* Its metadata alone is still served (checked at recovery). */
            kvr_get_params gp = { .ctx_id = "b", .end = SIZE_MAX, .dtype = KVR_DTYPE_F32,
                                  .meta_only = true };
            kvr_get *gt;
            cr_assert_eq(kvr_store_get_begin(s, &gp, &gt, NULL), 0);
            const kvr_get_info *gi = kvr_get_get_info(gt);
            cr_assert_eq(gi->n_tokens, NTOK);
            cr_assert(memcmp(gi->tokens, g[1] + n[1] - NTOK * 16, NTOK * 4) == 0);
            kvr_get_end(gt);
        }
        kvr_store_destroy(s);
    }
    unsetenv("KVR_TIER_RECOVER_EAGER");
    for (int i = 0; i < 3; i++)
        free(g[i]);
    kvt_rmrf(DIR_);
}

Test(tier, corrupt_block_kv_refused_at_first_get_uring) { corrupt_block(0, 0, false); }
Test(tier, corrupt_block_kv_refused_at_first_get_posix) { corrupt_block(2, 0, false); }
Test(tier, corrupt_block_meta_dropped_at_recovery) { corrupt_block(0, 1, false); }
Test(tier, corrupt_block_kv_dropped_by_whole_read) { corrupt_block(0, 0, true); }
Test(tier, corrupt_block_meta_dropped_by_whole_read) { corrupt_block(0, 1, true); }

/* Recovery reading every block whole (records without metadata checksums
 * take that path). */
Test(tier, restart_whole_read)
{
    setenv("KVR_TIER_RECOVER_EAGER", "1", 1);
    restart(0);
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
