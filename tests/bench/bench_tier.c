/*
 * bench_tier.c — the disk tier through the store (cache/tier.c), against a
 * plain sequential O_DIRECT write (+ one fdatasync) and read of the same
 * number of bytes in the same directory and run (what `dd oflag=direct
 * conv=fdatasync` / `iflag=direct` measure):
 *  - spill: every block of the store written out and its memory freed
 *    (kvr_store_tier_evict, synced at the end: the baseline's durability);
 *  - reload: a get of every context (spilled blocks read back, checksummed,
 *    with the context's prefetch; the get's own work included); page cache
 *    dropped first when possible. The same gets with everything resident
 *    are timed too, to show the part that is not disk I/O;
 *  - persist: persistent puts acknowledged (blocks + record, synced);
 *  - recovery: a new store recovering all of it (ms per GiB).
 * Per engine, in KVR_BENCH_TIER_ROUNDS interleaved rounds (default 3: the
 * device's speed drifts on a shared machine); ratios are medians of each
 * round's ratio. Never asserted; prints a markdown table and the goal
 * lines. KVR_BENCH_TIER_MB sets the size (default 256).
 */
#include <fcntl.h>
#include <stdbool.h>
#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cache/cache.h"
#include "tests/common/kvt_bench.h"

#define NL 8
#define NH 8
#define HD 128
#define CTX_TOKENS 1024

static int rm_one(const char *p, const struct stat *sb, int flag, struct FTW *f)
{
    (void)sb;
    (void)flag;
    (void)f;
    return remove(p);
}

static void drop_caches(void)
{
    sync();
    FILE *f = fopen("/proc/sys/vm/drop_caches", "w");
    if (f) {
        fputs("3\n", f);
        fclose(f);
    }
}

static void plain(const char *dir, size_t total, double *w, double *r)
{
    kvt_plain p;
    kvt_plain_open(&p, dir);
    *w = kvt_plain_pass(&p, total, 1);
    drop_caches();
    *r = kvt_plain_pass(&p, total, 0);
    kvt_plain_close(&p);
    unlink(p.path);
}

static kvr_store *open_store(const char *dir, int engine, kvr_tier_recovery *rec)
{
    kvr_store *s;
    kvr_store_config cfg = { 0 };
    kvr_error e = { 0 };
    if (kvr_store_create(&s, &cfg, &e) != 0)
        return NULL;
    kvr_tier_config tc = { .dir = dir, .engine = engine, .checkpoint_bytes = 1ull << 30 };
    kvr_tier_recovery r;
    if (kvr_store_tier_open(s, &tc, NULL, NULL, &r, &e) != 0) {
        fprintf(stderr, "tier: %s\n", e.msg);
        kvr_store_destroy(s);
        return NULL;
    }
    if (rec)
        *rec = r;
    if (kvr_store_model_find(s, "m", NULL) != 0) {
        kvr_model_desc d = { .name = "m", .n_layers = NL, .n_kv_heads = NH, .head_dim = HD,
                             .dtype = KVR_DTYPE_F16 };
        kvr_rope_config_init(&d.rope);
        kvr_store_model_register(s, &d, NULL, NULL);
    }
    return s;
}

static int put(kvr_store *s, const char *id, const void *payload, bool persist)
{
    static uint32_t tok[CTX_TOKENS];
    for (uint32_t i = 0; i < CTX_TOKENS; i++)
        tok[i] = i;
    kvr_put_params pp = { .ctx_id = id, .model = "m", .n_layers = NL, .n_kv_heads = NH,
                          .head_dim = HD, .dtype = KVR_DTYPE_F16, .n_tokens = CTX_TOKENS,
                          .tokens = tok, .persist = persist };
    kvr_put *t;
    if (kvr_store_put_begin(s, &pp, &t, NULL) != 0)
        return -1;
    const struct iovec *iov;
    size_t ni;
    kvr_put_payload_iov(t, &iov, &ni);
    const uint8_t *src = payload;
    for (size_t i = 0; i < ni; i++) {
        memcpy(iov[i].iov_base, src, iov[i].iov_len);
        src += iov[i].iov_len;
    }
    if (kvr_put_commit(t, NULL, NULL) != 0)
        return -1;
    if (persist && kvr_store_persist(s, id, NULL, NULL, NULL) < 0)
        return -1;
    kvr_store_persist_flush(s);
    return 0;
}

static double get_all(kvr_store *s, size_t n_ctx)
{
    double t0 = kvt_now_s();
    for (size_t i = 0; i < n_ctx; i++) {
        char id[32];
        snprintf(id, sizeof id, "c%zu", i);
        kvr_get_params gp = { .ctx_id = id, .end = SIZE_MAX, .dtype = KVR_DTYPE_F16 };
        kvr_get *g;
        if (kvr_store_get_begin(s, &gp, &g, NULL) != 0)
            return -1;
        if (kvr_get_needs_work(g))
            kvr_get_work(g, NULL);
        kvr_get_end(g);
    }
    return kvt_now_s() - t0;
}

/* What a reload pays before any I/O: fresh memory for the blocks it
 * brings back (the spill gave theirs back to the system), faulted in page
 * by page, filled once: GB/s for `total` bytes in blocks of `blk`. */
static double fresh_fill(size_t total, size_t blk)
{
    size_t n = total / blk ? total / blk : 1;
    uint8_t **v = malloc(n * sizeof *v);
    double t0 = kvt_now_s();
    for (size_t i = 0; i < n; i++) {
        v[i] = kvr_mem_aligned(64, blk);
        if (v[i])
            memset(v[i], (int)i, blk);
    }
    double dt = kvt_now_s() - t0;
    for (size_t i = 0; i < n; i++)
        kvr_mem_free(v[i]);
    free(v);
    return (double)(n * blk) / dt / 1e9;
}

static int dcmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, dcmp);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

#define MAX_ROUNDS 9

int main(void)
{
    int rounds = kvt_env_int("KVR_BENCH_TIER_ROUNDS", 3, 1, MAX_ROUNDS);
    size_t total = (size_t)kvt_env_int("KVR_BENCH_TIER_MB", 256, 1, 1 << 20) << 20;
    size_t ctx_bytes = (size_t)NL * 2 * CTX_TOKENS * NH * HD * 2;
    size_t n_ctx = total / ctx_bytes ? total / ctx_bytes : 1;
    total = n_ctx * ctx_bytes;
    const char *tmp = getenv("TMPDIR");
    char dir[512];
    snprintf(dir, sizeof dir, "%s/kvr-bench-tier-XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(dir)) {
        perror("mkdtemp");
        return 1;
    }
    uint8_t *payload = malloc(ctx_bytes);
    for (size_t i = 0; i < ctx_bytes; i++)
        payload[i] = (uint8_t)(i * 131u >> 3);
    static const int engines[] = { 0, 2 };
    const char *eng[2] = { "?", "?" };
    double pw[MAX_ROUNDS], pr[MAX_ROUNDS];
    double sg[2][MAX_ROUNDS], rg[2][MAX_ROUNDS], mg[2][MAX_ROUNDS], pg[2][MAX_ROUNDS];
    double rs[2][MAX_ROUNDS], rr[2][MAX_ROUNDS], rec_ms[2][MAX_ROUNDS], ff[MAX_ROUNDS];
    size_t rec_ctx[2] = { 0, 0 };
    bool ok[2] = { true, true };
    for (int k = 0; k < rounds; k++) {
        plain(dir, total, &pw[k], &pr[k]);
        ff[k] = fresh_fill(total, (size_t)NL * 2 * 64 * NH * HD * 2);    /* 64-token blocks */
        for (int ei = 0; ei < 2; ei++) {
            char sub[600];
            snprintf(sub, sizeof sub, "%.500s/e%d", dir, ei);
            kvr_store *s = open_store(sub, engines[ei], NULL);
            if (!s) {
                ok[ei] = false;
                continue;
            }
            eng[ei] = kvr_store_tier_engine(s);
            for (size_t i = 0; i < n_ctx; i++) {
                char id[32];
                snprintf(id, sizeof id, "c%zu", i);
                put(s, id, payload, false);
            }
            double tm = get_all(s, n_ctx);     /* resident */
            double t0 = kvt_now_s();
            int64_t freed = kvr_store_tier_evict(s, SIZE_MAX, NULL);
            double ts = kvt_now_s() - t0;
            drop_caches();
            double tr = get_all(s, n_ctx);
            kvr_store_destroy(s);
            nftw(sub, rm_one, 16, FTW_DEPTH | FTW_PHYS);
            /* Persistent puts, then recovery. */
            s = open_store(sub, engines[ei], NULL);
            t0 = kvt_now_s();
            for (size_t i = 0; i < n_ctx; i++) {
                char id[32];
                snprintf(id, sizeof id, "c%zu", i);
                put(s, id, payload, true);
            }
            double tp = kvt_now_s() - t0;
            kvr_store_destroy(s);
            drop_caches();
            kvr_tier_recovery rec;
            s = open_store(sub, engines[ei], &rec);
            kvr_store_destroy(s);
            nftw(sub, rm_one, 16, FTW_DEPTH | FTW_PHYS);
            sg[ei][k] = freed > 0 ? (double)freed / ts / 1e9 : 0;
            rg[ei][k] = (double)total / tr / 1e9;
            mg[ei][k] = (double)total / tm / 1e9;
            pg[ei][k] = (double)total / tp / 1e9;
            rs[ei][k] = sg[ei][k] / pw[k];
            rr[ei][k] = rg[ei][k] / pr[k];
            rec_ms[ei][k] = rec.ms / ((double)rec.bytes / (double)(1u << 30));
            rec_ctx[ei] = rec.contexts;
        }
    }
    printf("\nbench_tier: %zu MiB (%zu contexts of %d tokens, %dx%dx%d f16) x %d rounds in %s\n\n",
           total >> 20, n_ctx, CTX_TOKENS, NL, NH, HD, rounds, dir);
    printf("| engine | plain write GB/s | spill GB/s | spill / plain | plain read GB/s | "
           "reload GB/s | reload / plain | resident get GB/s | persist put GB/s | "
           "recovery ms/GiB |\n");
    printf("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n");
    double ms_[2], mr_[2];
    for (int ei = 0; ei < 2; ei++) {
        if (!ok[ei])
            continue;
        ms_[ei] = median(rs[ei], rounds);
        mr_[ei] = median(rr[ei], rounds);
        printf("| %s | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.0f (%zu ctx) |\n",
               eng[ei], median(pw, rounds), median(sg[ei], rounds), ms_[ei], median(pr, rounds),
               median(rg[ei], rounds), mr_[ei], median(mg[ei], rounds), median(pg[ei], rounds),
               median(rec_ms[ei], rounds), rec_ctx[ei]);
    }
    printf("\nfresh memory for the reloaded blocks (allocate + fault in + fill, no I/O): "
           "%.2f GB/s = %.2fx the plain read. A reload pays it as its reads land in that "
           "memory (faulted in as they are submitted); where it is not well above the "
           "device's rate, it bounds the reload.\n",
           median(ff, rounds), median(ff, rounds) / median(pr, rounds));
    printf("\n(medians over %d rounds; ratios are medians of each round's ratio.) spill = "
           "kvr_store_tier_evict of every block + one sync; reload = get of every context "
           "(checksummed, prefetch, the get's own copy included: resident get is the same "
           "gets with nothing spilled); persist put = put + record, acknowledged durable.\n\n",
           rounds);
    for (int ei = 0; ei < 2; ei++) {
        if (!ok[ei])
            continue;
        char spill[64], reload[96];
        snprintf(spill, sizeof spill, "store, %s", eng[ei]);
        snprintf(reload, sizeof reload, "store, %s: get of spilled contexts", eng[ei]);
        kvt_plain_goals(spill, reload, "", ms_[ei], mr_[ei]);
    }
    free(payload);
    nftw(dir, rm_one, 16, FTW_DEPTH | FTW_PHYS);
    return 0;
}
