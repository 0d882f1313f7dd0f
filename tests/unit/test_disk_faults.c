/*
 * test_disk_faults.c — I/O error injection on every call site of the disk
 * tier's storage layer (cache/disk.h kvr_disk_fault_set), exhaustively: for
 * each kind of operation (read, write, fsync, open, ftruncate/rename,
 * io_uring submission, short transfer), each engine, and n = 1, 2, ... the
 * n-th such operation of a workload fails (spills into several segments,
 * loads, frees, log appends single and batched, a checkpoint, a sync, and a
 * recovery), until a run no longer reaches an n-th one. Each time:
 *  - every call returns 0 or a KVR_E* error, never crashes or hangs;
 *  - a short transfer is finished by the engine: the workload succeeds;
 *  - a load that returned 0 gave the exact bytes;
 *  - after reopening without faults, every record whose append returned 0
 *    is recovered with its exact payload (records not acknowledged may or
 *    may not be there, whole), and every extent an acknowledged record
 *    names loads back bit-exact;
 *  - a recovery that fails under a fault leaves the directory recoverable
 *    with the same guarantees.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "cache/disk.h"
#include "tests/common/kvt.h"

#define NREC 5
#define NEXT 8
#define EXT_BYTES 3000

/* A record: u32 index, u32 n handles, the handles, then filler. */
typedef struct wl {
    kvr_disk_handle h[NEXT];
    bool            live[NEXT];
    uint32_t        n_h[NREC];
    uint32_t        first_h[NREC];
    bool            acked[NREC];
    uint8_t         buf[NREC][512];
    size_t          len[NREC];
} wl;

static void make_rec(wl *w, uint32_t i, uint32_t first, uint32_t n)
{
    uint8_t *b = w->buf[i];
    memcpy(b, &i, 4);
    memcpy(b + 4, &n, 4);
    size_t off = 8;
    for (uint32_t k = 0; k < n; k++) {
        kvr_disk_handle_encode(&w->h[first + k], b + off);
        off += KVR_DISK_HANDLE_BYTES;
    }
    kvt_fill(b + off, 100, i);
    w->len[i] = off + 100;
    w->n_h[i] = n;
    w->first_h[i] = first;
}

static int spill(kvr_disk *d, wl *w, uint32_t first, uint32_t n, bool sync)
{
    static uint8_t data[NEXT][EXT_BYTES];
    kvr_disk_buf b[NEXT];
    memset(b, 0, sizeof b);
    for (uint32_t k = 0; k < n; k++) {
        kvt_fill(data[first + k], EXT_BYTES, 1000 + first + k);
        b[k] = (kvr_disk_buf){ .data = data[first + k], .len = EXT_BYTES };
    }
    kvr_error e;
    int rc = kvr_disk_spill(d, b, n, &w->h[first], sync, &e);
    if (rc && getenv("KVR_DFAULT_DEBUG"))
        fprintf(stderr, "spill: %s\n", e.msg);
    for (uint32_t k = 0; k < n; k++)
        w->live[first + k] = rc == 0;
    return rc;
}

static void load_check(kvr_disk *d, const kvr_disk_handle *h, uint32_t id, bool must)
{
    static uint8_t got[EXT_BYTES], want[EXT_BYTES];
    void *dst[1] = { got };
    kvr_error e;
    int st = 0;
    int rc = kvr_disk_load(d, h, dst, 1, &st, &e);
    if (must)
        cr_assert_eq(rc, 0, "extent %u must load: %s", id, e.msg);
    if (rc == 0) {
        kvt_fill(want, EXT_BYTES, 1000 + id);
        cr_assert_eq(memcmp(got, want, EXT_BYTES), 0, "extent %u loaded wrong bytes", id);
    }
}

static int append(kvr_disk *d, wl *w, uint32_t i0, uint32_t n)
{
    kvr_disk_rec_in r[NREC];
    for (uint32_t k = 0; k < n; k++)
        r[k] = (kvr_disk_rec_in){ .type = 1, .payload = w->buf[i0 + k], .len = w->len[i0 + k] };
    kvr_error e;
    int rc = kvr_disk_log_append(d, r, n, NULL, &e);
    cr_assert(rc == 0 || rc == KVR_EIO || rc == KVR_ENOMEM, "append: %d %s", rc, e.msg);
    for (uint32_t k = 0; k < n; k++)
        w->acked[i0 + k] = rc == 0;
    return rc;
}

static int snap(void *arg, kvr_disk_cp *cp)
{
    wl *w = arg;
    for (uint32_t i = 0; i < NREC; i++)
        if (w->acked[i] && kvr_disk_cp_add(cp, 1, w->buf[i], w->len[i]) != 0)
            return -1;
    return 0;
}

/* The workload; returns how many calls failed. */
/* 1 if a call failed (KVR_DFAULT_DEBUG=1 prints which). */
static int note(int rc, int line)
{
    if (rc && getenv("KVR_DFAULT_DEBUG"))
        fprintf(stderr, "workload line %d: rc %d\n", line, rc);
    return rc != 0;
}

static int workload(kvr_disk *d, wl *w)
{
    int failed = 0;
    kvr_error e;
    failed += note(spill(d, w, 0, 3, false), __LINE__);
    make_rec(w, 0, 0, w->live[0] ? 1 : 0);     /* names extent 0; 1 and 2 are free to go */
    failed += note(append(d, w, 0, 1), __LINE__);
    for (uint32_t k = 0; k < 3; k++)
        if (w->live[k])
            load_check(d, &w->h[k], k, false);
    if (w->live[1] && kvr_disk_free(d, &w->h[1], &e) == 0)
        w->live[1] = false;
    failed += note(spill(d, w, 3, 3, true), __LINE__);        /* a new segment (small segment_bytes) */
    make_rec(w, 1, 3, w->live[3] ? 3 : 0);
    make_rec(w, 2, 0, 0);
    failed += note(append(d, w, 1, 2), __LINE__);
    failed += note(kvr_disk_checkpoint(d, snap, w, &e), __LINE__);
    failed += note(spill(d, w, 6, 2, false), __LINE__);
    make_rec(w, 3, 6, w->live[6] ? 2 : 0);
    failed += note(append(d, w, 3, 1), __LINE__);
    failed += note(kvr_disk_sync(d, &e), __LINE__);
    make_rec(w, 4, 0, 0);
    failed += note(append(d, w, 4, 1), __LINE__);
    return failed;
}

typedef struct rec_seen {
    bool     seen[NREC];
    wl      *w;
    kvr_disk_handle claimed[NEXT * NREC];
    uint32_t claimed_id[NEXT * NREC];
    size_t   n_claimed;
    bool     faulty;       /* a fault is armed: a claim may fail with KVR_EIO */
} rec_seen;

static void on_rec(void *arg, kvr_disk *d, const kvr_disk_record *r)
{
    rec_seen *s = arg;
    uint32_t i, n;
    cr_assert_geq(r->len, 8);
    memcpy(&i, r->payload, 4);
    memcpy(&n, (const uint8_t *)r->payload + 4, 4);
    cr_assert_lt(i, NREC);
    if (!s->w->acked[i])
        return;   /* not acknowledged: may be there; the workload rebuilt it since */
    cr_assert_eq(r->len, s->w->len[i], "record %u has another length", i);
    cr_assert_eq(memcmp(r->payload, s->w->buf[i], r->len), 0, "record %u differs", i);
    s->seen[i] = true;
    for (uint32_t k = 0; k < n; k++) {
        kvr_disk_handle h;
        kvr_disk_handle_decode((const uint8_t *)r->payload + 8 + k * KVR_DISK_HANDLE_BYTES, &h);
        kvr_error e;
        int rc = kvr_disk_claim(d, &h, &e);
        if (s->faulty && rc == KVR_EIO)
            continue;      /* the store drops that context; the disk keeps the bytes */
        cr_assert_eq(rc, 0, "record %u: extent: %s", i, e.msg);
        s->claimed[s->n_claimed] = h;
        s->claimed_id[s->n_claimed++] = s->w->first_h[i] + k;
    }
}

static kvr_disk *open_dir(const char *dir, kvr_disk_engine eng)
{
    kvr_disk_config cfg = { .dir = dir, .engine = eng, .segment_bytes = 8192 };
    kvr_disk *d = NULL;
    kvr_error e;
    cr_assert_eq(kvr_disk_open(&d, &cfg, &e), 0, "%s", e.msg);
    return d;
}

/* Reopens without faults: everything acknowledged is there. */
static void verify(const char *dir, kvr_disk_engine eng, wl *w, const char *what)
{
    kvr_disk *d = open_dir(dir, eng);
    rec_seen s = { .w = w };
    kvr_error e;
    cr_assert_eq(kvr_disk_recover(d, on_rec, NULL, &s, NULL, &e), 0, "%s: %s", what, e.msg);
    cr_assert_eq(kvr_disk_recover_done(d, &e), 0, "%s: %s", what, e.msg);
    for (uint32_t i = 0; i < NREC; i++)
        if (w->acked[i])
            cr_assert(s.seen[i], "%s: acknowledged record %u is lost", what, i);
    for (size_t k = 0; k < s.n_claimed; k++)
        load_check(d, &s.claimed[k], s.claimed_id[k], true);
    kvr_disk_close(d);
}

static void run(kvr_disk_engine eng, unsigned kind, const char *kname)
{
    int total = 0, with_errors = 0;
    for (uint64_t n = 1;; n++) {
        cr_assert_lt(n, 500, "%s: the workload never ran out of such operations", kname);
        char dir[64];
        kvt_tmpdir(dir, sizeof dir, "kvr-dfault");
        wl w;
        memset(&w, 0, sizeof w);
        kvr_disk *d = open_dir(dir, eng);
        kvr_error e;
        kvr_disk_fault_set(d, kind, n, EIO, 1);
        int rc = kvr_disk_recover(d, NULL, NULL, NULL, NULL, &e);
        int failed = 0;
        if (rc == 0 && (rc = kvr_disk_recover_done(d, &e)) == 0)
            failed = workload(d, &w);
        else
            cr_assert_eq(rc, KVR_EIO, "%s n=%llu: recovery: %d %s", kname,
                         (unsigned long long)n, rc, e.msg);
        uint64_t fired = kvr_disk_fault_fired(d);
        kvr_disk_close(d);
        char what[64];
        snprintf(what, sizeof what, "%s n=%llu", kname, (unsigned long long)n);
        if (kind == KVR_DISK_FAULT_SHORT)
            cr_assert(rc == 0 && failed == 0, "%s: a short transfer failed the workload", what);
        if (rc == 0)
            verify(dir, eng, &w, what);

        /* The same fault during the recovery of the finished directory. */
        d = open_dir(dir, eng);
        kvr_disk_fault_set(d, kind, n, EIO, 1);
        rec_seen rs = { .w = &w, .faulty = true };     /* claims what the records name, as a store does */
        rc = kvr_disk_recover(d, on_rec, NULL, &rs, NULL, &e);
        if (rc == 0)
            rc = kvr_disk_recover_done(d, &e);
        cr_assert(rc == 0 || rc == KVR_EIO, "%s: recovery under a fault: %d %s", what, rc,
                  e.msg);
        uint64_t fired2 = kvr_disk_fault_fired(d);
        kvr_disk_close(d);
        strncat(what, " (recovery)", sizeof what - strlen(what) - 1);
        verify(dir, eng, &w, what);

        kvt_rmrf(dir);
        total++;
        with_errors += failed > 0;
        if (fired == 0 && fired2 == 0)
            break;
    }
    cr_log_info("%s (%s): %d runs, %d with failed calls", kname,
                eng == KVR_DISK_ENGINE_POSIX ? "posix" : "auto", total, with_errors);
    cr_assert_gt(total, 1, "%s: no operation of this kind was reached", kname);
}

#define KINDS(X)                                                                   \
    X(write, KVR_DISK_FAULT_WRITE) X(read, KVR_DISK_FAULT_READ)                    \
    X(fsync, KVR_DISK_FAULT_FSYNC) X(open, KVR_DISK_FAULT_OPEN)                    \
    X(meta, KVR_DISK_FAULT_META) X(short_io, KVR_DISK_FAULT_SHORT)

#define T(name, kind)                                                              \
    Test(disk_faults, name##_auto, .timeout = 300)                                 \
    {                                                                              \
        run(KVR_DISK_ENGINE_AUTO, kind, #name);                                    \
    }                                                                              \
    Test(disk_faults, name##_posix, .timeout = 300)                                \
    {                                                                              \
        run(KVR_DISK_ENGINE_POSIX, kind, #name);                                   \
    }
KINDS(T)

/* io_uring submissions exist only with io_uring (auto falls back to POSIX
 * where the kernel refuses it: then there is nothing to inject). */
Test(disk_faults, submit_auto, .timeout = 300)
{
    kvr_disk *d;
    char dir[64];
    kvt_tmpdir(dir, sizeof dir, "kvr-dfault");
    d = open_dir(dir, KVR_DISK_ENGINE_AUTO);
    bool uring = !strcmp(kvr_disk_engine_name(d), "io_uring");
    kvr_disk_close(d);
    kvt_rmrf(dir);
    if (!uring)
        cr_skip_test("io_uring is not available here");
    run(KVR_DISK_ENGINE_AUTO, KVR_DISK_FAULT_SUBMIT, "submit");
}
