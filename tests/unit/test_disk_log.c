/*
 * test_disk_log.c — the disk tier's persistence log (cache/disk.h): append
 * and reopen recovers every acknowledged record in order; checkpoints (and
 * aborted ones); flipped bytes at random offsets are detected, reported,
 * quarantined and the rest recovered; truncated tails; injected ENOSPC/EIO
 * on write and fsync (nothing acknowledged that did not reach the disk, the
 * failed state after an fsync error until reopen); a real ENOSPC on a tiny
 * tmpfs when mounting one is allowed. Both engines throughout.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cache/disk.h"
#include "tests/common/kvt.h"
#include "tests/common/kvt_disk.h"
#include "tests/common/kvt_bench.h"

static const kvr_disk_engine engines[] = { KVR_DISK_ENGINE_URING, KVR_DISK_ENGINE_POSIX };

static uint64_t rng_state = 0x1234567887654321ull;
static uint64_t rnd(void)
{
    return kvt_xorshift(&rng_state);
}

/* Record i: type 1 + i%5, payload = u32 i, then kvt_fill(i) of a length from i. */
static size_t rec_len(uint32_t i) { return 4 + (i * 2654435761u) % 3000; }

static void make_rec(uint32_t i, uint8_t *buf, kvr_disk_rec_in *r)
{
    size_t n = rec_len(i);
    memcpy(buf, &i, 4);
    kvt_fill(buf + 4, n - 4, i);
    *r = (kvr_disk_rec_in){ .type = 1 + i % 5, .payload = buf, .len = n };
}

/* Collected recovery output. */
typedef struct got {
    uint32_t idx[4096];
    uint64_t seq[4096];
    bool     in_cp[4096];
    size_t   n;
    size_t   n_bad_payload;
    size_t   n_reports;
    uint64_t last_seq;
} got;

static void on_rec(void *arg, kvr_disk *d, const kvr_disk_record *r)
{
    (void)d;
    got *g = arg;
    uint32_t i;
    static uint8_t want[4096];
    cr_assert_gt(r->seq, g->last_seq, "records out of order");
    g->last_seq = r->seq;
    memcpy(&i, r->payload, 4);
    kvt_fill(want, rec_len(i) - 4, i);
    if (r->len != rec_len(i) || r->type != 1 + i % 5 ||
        memcmp((const uint8_t *)r->payload + 4, want, r->len - 4))
        g->n_bad_payload++;
    if (g->n < 4096) {
        g->idx[g->n] = i;
        g->seq[g->n] = r->seq;
        g->in_cp[g->n] = r->in_checkpoint;
        g->n++;
    }
}

static void on_bad(void *arg, const char *file, uint64_t off, uint64_t bytes,
                   const char *why)
{
    got *g = arg;
    (void)file; (void)off; (void)bytes; (void)why;
    g->n_reports++;
}

static kvr_disk *reopen(const char *dir, kvr_disk_engine e, got *g, kvr_disk_recovery *rs)
{
    kvr_disk_config cfg = { .dir = dir, .engine = e };
    memset(g, 0, sizeof *g);
    kvr_disk *d = kvt_disk_open(&cfg, on_rec, on_bad, g, rs, true);
    cr_assert_eq(g->n_bad_payload, 0, "a corrupt record was handed out");
    return d;
}

static void append_n(kvr_disk *d, uint32_t from, uint32_t n, uint64_t *ends)
{
    static uint8_t buf[4096];
    kvr_error err = { 0 };
    for (uint32_t i = from; i < from + n; i++) {
        kvr_disk_rec_in r;
        make_rec(i, buf, &r);
        cr_assert_eq(kvr_disk_log_append(d, &r, 1, NULL, &err), 0, "%s", err.msg);
        if (ends) {
            kvr_disk_stats st;
            kvr_disk_get_stats(d, &st);
            ends[i] = st.log_bytes;
        }
    }
}

/* A fresh got (*g; free it) and dir's log opened with records 0..n-1
 * appended. */
static kvr_disk *log_of(const char *dir, kvr_disk_engine e, got **g, kvr_disk_recovery *rs,
                        uint32_t n)
{
    *g = calloc(1, sizeof **g);
    kvr_disk *d = reopen(dir, e, *g, rs);
    append_n(d, 0, n, NULL);
    return d;
}

static void log_path(char *p, size_t cap, const char *dir)
{
    /* The one live generation. */
    char cmd[512];
    snprintf(cmd, sizeof cmd, "ls %s | grep '^log-.*kvl$'", dir);
    FILE *f = popen(cmd, "r");
    char name[64] = "";
    cr_assert(f && fscanf(f, "%63s", name) == 1);
    pclose(f);
    snprintf(p, cap, "%s/%s", dir, name);
}

KVT_DISK_TEST(disk_log, append_reopen)
{
    got *g = calloc(1, sizeof *g);
    kvr_disk_recovery rs;
    kvr_disk *d = reopen(dir, e, g, &rs);
    cr_assert_eq(g->n, 0);
    append_n(d, 0, 200, NULL);
    /* A batch: one fsync, consecutive seqs. */
    static uint8_t b1[4096], b2[4096];
    kvr_disk_rec_in rr[2];
    make_rec(200, b1, &rr[0]);
    make_rec(201, b2, &rr[1]);
    uint64_t seq0 = 0;
    kvr_error err = { 0 };
    cr_assert_eq(kvr_disk_log_append(d, rr, 2, &seq0, &err), 0);
    kvr_disk_stats st;
    kvr_disk_get_stats(d, &st);
    cr_assert_eq(st.n_records, 202);
    cr_assert_geq(st.n_fsyncs, 201);
    kvr_disk_close(d);
    for (int round = 0; round < 2; round++) {
        d = reopen(dir, e, g, &rs);
        cr_assert_eq(g->n, 202 + (size_t)round);
        cr_assert_eq(rs.records, 202 + (uint64_t)round);
        cr_assert_eq(rs.quarantined, 0);
        cr_assert_eq(rs.torn_bytes, 0);
        cr_assert_eq(g->n_reports, 0);
        for (size_t i = 0; i < g->n; i++)
            cr_assert_eq(g->idx[i], i);
        cr_assert_eq(g->seq[201], seq0 + 1);
        append_n(d, 202 + (uint32_t)round, 1, NULL);
        kvr_disk_get_stats(d, &st);
        cr_assert_eq(st.last_recovery.records, 202 + (uint64_t)round);
        kvr_disk_close(d);
    }
    free(g);
}

typedef struct snap { uint32_t from, n; int fail; } snap;
static int snapshot(void *arg, kvr_disk_cp *cp)
{
    snap *s = arg;
    static uint8_t buf[4096];
    for (uint32_t i = s->from; i < s->from + s->n; i++) {
        kvr_disk_rec_in r;
        make_rec(i, buf, &r);
        cr_assert_eq(kvr_disk_cp_add(cp, r.type, r.payload, r.len), 0);
    }
    return s->fail;
}

KVT_DISK_TEST(disk_log, checkpoint)
{
    got *g = calloc(1, sizeof *g);
    kvr_disk_recovery rs;
    kvr_disk_config cfg = { .dir = dir, .engine = e, .checkpoint_bytes = 100000 };
    kvr_disk *d = kvt_disk_open(&cfg, NULL, NULL, NULL, NULL, true);
    kvr_error err = { 0 };
    cr_assert(!kvr_disk_log_wants_checkpoint(d));
    append_n(d, 0, 300, NULL);
    cr_assert(kvr_disk_log_wants_checkpoint(d));
    /* An aborted snapshot leaves the old generation. */
    snap s = { .from = 1000, .n = 10, .fail = -1 };
    cr_assert_neq(kvr_disk_checkpoint(d, snapshot, &s, &err), 0);
    append_n(d, 300, 1, NULL);
    /* The state "is" records 1000..1999 now; then 3 more appends. */
    s = (snap){ .from = 1000, .n = 1000, .fail = 0 };
    cr_assert_eq(kvr_disk_checkpoint(d, snapshot, &s, &err), 0, "%s", err.msg);
    cr_assert(kvr_disk_log_wants_checkpoint(d));   /* 1000 records > 100 KB */
    append_n(d, 2000, 3, NULL);
    kvr_disk_stats st;
    kvr_disk_get_stats(d, &st);
    cr_assert_eq(st.n_checkpoints, 1);
    kvr_disk_close(d);
    d = reopen(dir, e, g, &rs);
    cr_assert_eq(g->n, 1003);
    for (size_t i = 0; i < 1000; i++) {
        cr_assert_eq(g->idx[i], 1000 + i);
        cr_assert(g->in_cp[i]);
    }
    for (size_t i = 0; i < 3; i++) {
        cr_assert_eq(g->idx[1000 + i], 2000 + i);
        cr_assert(!g->in_cp[1000 + i]);
    }
    cr_assert_eq(g->n_reports, 0);
    /* One generation on disk, no leftovers. */
    FILE *f = popen("true", "r");
    pclose(f);
    char cmd[512];
    snprintf(cmd, sizeof cmd, "test $(ls %s | grep -c '^log-') = 1", dir);
    cr_assert_eq(system(cmd), 0);
    kvr_disk_close(d);
    free(g);
}

typedef struct list_snap { uint32_t idx[64]; size_t n; } list_snap;
static int snapshot_list(void *arg, kvr_disk_cp *cp)
{
    list_snap *s = arg;
    static uint8_t buf[4096];
    for (size_t i = 0; i < s->n; i++) {
        kvr_disk_rec_in r;
        make_rec(s->idx[i], buf, &r);
        if (kvr_disk_cp_add(cp, r.type, r.payload, r.len))
            return -1;
    }
    return 0;
}

/* Random trials per engine of the flipped-byte and cut-tail tests, each on a
 * fresh log of 60 (40) records: 12 trials are about 30 flipped bytes and 12
 * cuts per engine, spread over the header, middle and tail records. */
#define KVT_LOG_TRIALS 12

/* Flip 1..4 random bytes at random offsets; every surviving record is exact,
 * at most one record is lost per flip, losses are reported; a checkpoint of
 * what survived makes the log clean again. */
static void corrupt(kvr_disk_engine e)
{
    char dir[256];
    got *g = calloc(1, sizeof *g);
    kvr_disk_recovery rs;
    for (int trial = 0; trial < KVT_LOG_TRIALS; trial++) {
        kvt_tmpdir(dir, sizeof dir, "kvr_disk");
        kvr_disk *d = reopen(dir, e, g, &rs);
        append_n(d, 0, 60, NULL);
        kvr_disk_close(d);
        char path[512];
        log_path(path, sizeof path, dir);
        int fd = open(path, O_RDWR);
        struct stat stt;
        fstat(fd, &stt);
        int flips = 1 + (int)(rnd() % 4);
        for (int k = 0; k < flips; k++) {
            off_t off = (off_t)(rnd() % (uint64_t)stt.st_size);
            uint8_t c;
            cr_assert_eq(pread(fd, &c, 1, off), 1);
            c ^= (uint8_t)(1u + rnd() % 255);
            cr_assert_eq(pwrite(fd, &c, 1, off), 1);
        }
        close(fd);
        d = reopen(dir, e, g, &rs);
        cr_assert_geq(g->n, 60 - (size_t)flips, "trial %d: %zu of 60 after %d flips",
                      trial, g->n, flips);
        if (g->n < 60)
            cr_assert_gt(g->n_reports, 0);
        cr_assert_eq(rs.quarantined + (rs.torn_bytes ? 1 : 0) > 0, g->n_reports > 0);
        for (size_t i = 1; i < g->n; i++)
            cr_assert_gt(g->idx[i], g->idx[i - 1]);
        /* Rewrite the survivors as a checkpoint: clean afterwards. */
        list_snap ls = { .n = g->n };
        memcpy(ls.idx, g->idx, g->n * sizeof *ls.idx);
        kvr_error err = { 0 };
        cr_assert_eq(kvr_disk_checkpoint(d, snapshot_list, &ls, &err), 0, "%s", err.msg);
        kvr_disk_close(d);
        d = reopen(dir, e, g, &rs);
        cr_assert_eq(g->n, ls.n);
        cr_assert_eq(g->n_reports, 0);
        for (size_t i = 0; i < g->n; i++)
            cr_assert_eq(g->idx[i], ls.idx[i]);
        kvr_disk_close(d);
        kvt_rmrf(dir);
    }
    free(g);
}

KVT_DISK_TESTS(disk_log, corrupt, corrupt)

/* Cut the log at a random length: exactly the records wholly before the cut
 * come back, the tail is reported and truncated, appends continue. */
static void truncated(kvr_disk_engine e)
{
    char dir[256];
    got *g = calloc(1, sizeof *g);
    kvr_disk_recovery rs;
    static uint64_t ends[64];
    for (int trial = 0; trial < KVT_LOG_TRIALS; trial++) {
        kvt_tmpdir(dir, sizeof dir, "kvr_disk");
        kvr_disk *d = reopen(dir, e, g, &rs);
        kvr_disk_stats st;
        kvr_disk_get_stats(d, &st);
        uint64_t base = st.log_bytes;
        append_n(d, 0, 40, ends);
        kvr_disk_close(d);
        char path[512];
        log_path(path, sizeof path, dir);
        uint64_t cut = base + rnd() % (ends[39] - base);
        cr_assert_eq(truncate(path, (off_t)cut), 0);
        size_t want = 0;
        while (want < 40 && ends[want] <= cut)
            want++;
        uint64_t good = want ? ends[want - 1] : base;
        d = reopen(dir, e, g, &rs);
        cr_assert_eq(g->n, want, "cut %llu", (unsigned long long)cut);
        cr_assert_eq(rs.torn_bytes, cut - good);
        cr_assert_eq(rs.quarantined, 0);
        cr_assert_eq(g->n_reports, cut > good ? 1u : 0u);
        append_n(d, (uint32_t)want, 1, NULL);
        kvr_disk_close(d);
        d = reopen(dir, e, g, &rs);
        cr_assert_eq(g->n, want + 1);
        cr_assert_eq(g->n_reports, 0);
        kvr_disk_close(d);
        kvt_rmrf(dir);
    }
    free(g);
}

KVT_DISK_TESTS(disk_log, truncated, truncated)

/* Injected faults. */
KVT_DISK_TEST(disk_log, faults)
{
    got *g;
    kvr_disk_recovery rs;
    kvr_disk *d = log_of(dir, e, &g, &rs, 5);
    kvr_error err = { 0 };
    static uint8_t buf[4096];
    kvr_disk_rec_in r;

    /* ENOSPC on the log write: error, not acknowledged, not failed. */
    make_rec(5, buf, &r);
    kvr_disk_fault_set(d, KVR_DISK_FAULT_WRITE, 1, ENOSPC, 1);
    cr_assert_eq(kvr_disk_log_append(d, &r, 1, NULL, &err), KVR_EIO);
    cr_assert(strstr(err.msg, "No space left"), "%s", err.msg);
    append_n(d, 5, 1, NULL);

    /* EIO on a spill write: no handle is live afterwards. */
    uint8_t data[10000];
    kvt_fill(data, sizeof data, 77);
    kvr_disk_buf kb[3] = { { .data = data, .len = 100 }, { .data = data, .len = 5000 },
                          { .data = data, .len = 10000 } };
    kvr_disk_handle h[3];
    kvr_disk_fault_set(d, KVR_DISK_FAULT_WRITE, 2, EIO, 1);
    cr_assert_eq(kvr_disk_spill(d, kb, 3, h, false, &err), KVR_EIO);
    kvr_disk_stats st;
    kvr_disk_get_stats(d, &st);
    cr_assert_eq(st.data_blocks, 0);
    cr_assert_eq(kvr_disk_free(d, &h[0], &err), KVR_EINVAL);
    cr_assert_eq(kvr_disk_spill(d, kb, 3, h, false, &err), 0, "%s", err.msg);

    /* Read fault: the load fails, the next one works. */
    static uint8_t out[10000];
    void *dst = out;
    kvr_disk_fault_set(d, KVR_DISK_FAULT_READ, 1, EIO, 1);
    cr_assert_eq(kvr_disk_load(d, &h[2], &dst, 1, NULL, &err), KVR_EIO);
    cr_assert_eq(kvr_disk_load(d, &h[2], &dst, 1, NULL, &err), 0);
    cr_assert_eq(memcmp(out, data, 10000), 0);

    /* EIO on the data fsync that precedes a record: the record is not
     * written, the tier is failed from now on. */
    make_rec(6, buf, &r);
    kvr_disk_fault_set(d, KVR_DISK_FAULT_FSYNC, 1, EIO, 1);
    cr_assert_eq(kvr_disk_log_append(d, &r, 1, NULL, &err), KVR_EIO);
    cr_assert(strstr(err.msg, "reopen required"), "%s", err.msg);
    kvr_disk_get_stats(d, &st);
    cr_assert(st.failed);
    /* Never retried into a success: every write path refuses. */
    cr_assert_eq(kvr_disk_log_append(d, &r, 1, NULL, &err), KVR_EIO);
    cr_assert(strstr(err.msg, "reopen required"));
    cr_assert_eq(kvr_disk_sync(d, &err), KVR_EIO);
    cr_assert_eq(kvr_disk_spill(d, kb, 1, h, false, &err), KVR_EIO);
    snap s = { .from = 0, .n = 1 };
    cr_assert_eq(kvr_disk_checkpoint(d, snapshot, &s, &err), KVR_EIO);
    /* Reads of what is there still work (memory-only operation goes on). */
    cr_assert_eq(kvr_disk_load(d, &h[0], &dst, 1, NULL, &err), 0);
    kvr_disk_close(d);

    d = reopen(dir, e, g, &rs);
    cr_assert_eq(g->n, 6);      /* 0..5 acknowledged; 6 never written */
    for (size_t i = 0; i < 6; i++)
        cr_assert_eq(g->idx[i], i);

    /* fsync error on the log itself: failed; after reopen the record may
     * or may not be there (as after a crash), the acknowledged ones are. */
    make_rec(6, buf, &r);
    kvr_disk_fault_set(d, KVR_DISK_FAULT_FSYNC, 1, EIO, 1);
    cr_assert_eq(kvr_disk_log_append(d, &r, 1, NULL, &err), KVR_EIO);
    make_rec(7, buf, &r);
    cr_assert_eq(kvr_disk_log_append(d, &r, 1, NULL, &err), KVR_EIO);
    kvr_disk_close(d);
    d = reopen(dir, e, g, &rs);
    cr_assert(g->n == 6 || g->n == 7);
    append_n(d, (uint32_t)g->n, 1, NULL);

    /* A write fault inside a checkpoint: the old generation stays. */
    size_t before = g->n + 1;
    kvr_disk_fault_set(d, KVR_DISK_FAULT_WRITE, 1, ENOSPC, 1);
    s = (snap){ .from = 0, .n = 3 };
    cr_assert_eq(kvr_disk_checkpoint(d, snapshot, &s, &err), KVR_EIO);
    kvr_disk_get_stats(d, &st);
    cr_assert(!st.failed);
    /* And an fsync fault inside one: failed. */
    kvr_disk_fault_set(d, KVR_DISK_FAULT_FSYNC, 1, EIO, 1);
    cr_assert_eq(kvr_disk_checkpoint(d, snapshot, &s, &err), KVR_EIO);
    kvr_disk_get_stats(d, &st);
    cr_assert(st.failed);
    kvr_disk_close(d);
    d = reopen(dir, e, g, &rs);
    cr_assert_eq(g->n, before);
    kvr_disk_close(d);

    /* A read fault during recovery fails the recovery with KVR_EIO. */
    kvr_disk_config cfg = { .dir = dir, .engine = e };
    cr_assert_eq(kvr_disk_open(&d, &cfg, &err), 0);
    kvr_disk_fault_set(d, KVR_DISK_FAULT_READ, 1, EIO, 1);
    cr_assert_eq(kvr_disk_recover(d, NULL, NULL, NULL, NULL, &err), KVR_EIO);
    kvr_disk_close(d);
    free(g);
}

/* A real ENOSPC: a 1 MiB tmpfs (needs CAP_SYS_ADMIN; skipped otherwise). */
static void real_enospc(kvr_disk_engine e)
{
    char dir[256];
    kvt_tmpdir(dir, sizeof dir, "kvr_disk");
    if (mount("tmpfs", dir, "tmpfs", 0, "size=1m") != 0) {
        rmdir(dir);
        cr_skip_test("cannot mount a tmpfs here (%s)", strerror(errno));
    }
    got *g;
    kvr_disk_recovery rs;
    kvr_disk *d = log_of(dir, e, &g, &rs, 3);
    kvr_error err = { 0 };
    static uint8_t data[100000];
    kvt_fill(data, sizeof data, 5);
    kvr_disk_buf kb = { .data = data, .len = sizeof data };
    kvr_disk_handle h[32];
    int n = kvt_spill_until_refused(d, &kb, h, 32, true, KVR_EIO, "No space left");
    cr_assert_gt(n, 3);
    kvr_disk_stats st;
    kvr_disk_get_stats(d, &st);
    cr_assert(!st.failed);
    cr_assert_eq(st.data_blocks, (uint64_t)n);
    /* Freeing punches the space back; spilling and logging work again. */
    cr_assert_eq(kvr_disk_free(d, &h[0], &err), 0);
    cr_assert_eq(kvr_disk_free(d, &h[1], &err), 0);
    cr_assert_eq(kvr_disk_spill(d, &kb, 1, &h[0], true, &err), 0, "%s", err.msg);
    append_n(d, 3, 1, NULL);
    static uint8_t out[100000];
    void *dst = out;
    cr_assert_eq(kvr_disk_load(d, &h[2], &dst, 1, NULL, &err), 0);
    cr_assert_eq(memcmp(out, data, sizeof data), 0);
    kvr_disk_close(d);
    d = reopen(dir, e, g, &rs);
    cr_assert_eq(g->n, 4);
    kvr_disk_close(d);
    free(g);
    umount2(dir, MNT_DETACH);
    rmdir(dir);
}

KVT_DISK_TESTS(disk_log, real_enospc, real_enospc)

Test(disk_log, bad_args)
{
    char dir[256];
    kvt_tmpdir(dir, sizeof dir, "kvr_disk");
    got *g = calloc(1, sizeof *g);
    kvr_disk_recovery rs;
    kvr_error err = { 0 };
    kvr_disk *d = reopen(dir, engines[0], g, &rs);
    kvr_disk_rec_in r = { .type = 0x80000000u, .payload = "", .len = 0 };
    cr_assert_eq(kvr_disk_log_append(d, &r, 1, NULL, &err), KVR_EINVAL);
    r = (kvr_disk_rec_in){ .type = 9, .payload = NULL, .len = 0 };
    cr_assert_eq(kvr_disk_log_append(d, &r, 1, NULL, &err), 0);   /* empty payload */
    cr_assert_eq(kvr_disk_recover(d, NULL, NULL, NULL, NULL, &err), KVR_EINVAL);
    kvr_disk_close(d);
    free(g);
    kvt_rmrf(dir);
}
