/*
 * test_disk_crash.c — kill -9 at random instants. A child spills a block,
 * appends a BLOCK_REF-like record naming it, and after the append returns
 * writes the record's index to a pipe (= acknowledged); every 40 records it
 * checkpoints the whole state. The parent SIGKILLs it after a random delay,
 * recovers, and checks: the records are exactly 0..k in order with k the
 * last acknowledged index or the one after (in flight, complete), every
 * record's block loads bit-exact, nothing corrupt is handed out.
 * KVR_DISK_CRASH_TRIALS (default 100) sets the number of trials; they
 * alternate between io_uring and the forced POSIX engine.
 * Note: SIGKILL loses no page cache, so this checks process crashes; torn
 * writes of a power loss are covered by test_disk_log's truncation and
 * corruption tests.
 */
#include <criterion/criterion.h>
#include <poll.h>
#include <ftw.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cache/disk.h"
#include "tests/common/kvt.h"
#include "tests/common/kvt_disk.h"

#define MAXREC 20000
#define REC_BYTES (4 + KVR_DISK_HANDLE_BYTES)

static size_t blk_len(uint32_t i) { return 1 + (i * 2654435761u) % 200000; }

typedef struct state { uint8_t rec[MAXREC][REC_BYTES]; uint32_t n; } state;

static int snap(void *arg, kvr_disk_cp *cp)
{
    state *s = arg;
    for (uint32_t i = 0; i < s->n; i++)
        if (kvr_disk_cp_add(cp, 1, s->rec[i], REC_BYTES))
            return -1;
    return 0;
}

static void child(const char *dir, kvr_disk_engine e, int wfd)
{
    kvr_disk_config cfg = { .dir = dir, .engine = e, .segment_bytes = 4u << 20 };
    kvr_disk *d;
    if (kvr_disk_open(&d, &cfg, NULL) || kvr_disk_recover(d, NULL, NULL, NULL, NULL, NULL) ||
        kvr_disk_recover_done(d, NULL))
        _exit(2);
    static state s;
    static uint8_t blk[200000];
    for (uint32_t i = 0; i < MAXREC; i++) {
        size_t n = blk_len(i);
        kvt_fill(blk, n, i);
        kvr_disk_buf b = { .data = blk, .len = n };
        kvr_disk_handle h;
        if (kvr_disk_spill(d, &b, 1, &h, false, NULL))
            _exit(3);
        memcpy(s.rec[i], &i, 4);
        kvr_disk_handle_encode(&h, s.rec[i] + 4);
        kvr_disk_rec_in r = { .type = 1, .payload = s.rec[i], .len = REC_BYTES };
        if (i % 40 == 39) {
            s.n = i + 1;     /* the new state includes record i */
            if (kvr_disk_checkpoint(d, snap, &s, NULL))
                _exit(4);
        } else if (kvr_disk_log_append(d, &r, 1, NULL, NULL)) {
            _exit(5);
        }
        if (write(wfd, &i, 4) != 4)
            _exit(6);
    }
    _exit(0);
}

typedef struct rec_list { uint32_t idx[MAXREC]; kvr_disk_handle h[MAXREC]; size_t n;
                          int bad; } rec_list;

static void on_rec(void *arg, kvr_disk *d, const kvr_disk_record *r)
{
    rec_list *l = arg;
    if (r->len != REC_BYTES || r->type != 1 || l->n >= MAXREC) {
        l->bad++;
        return;
    }
    memcpy(&l->idx[l->n], r->payload, 4);
    kvr_disk_handle_decode((const uint8_t *)r->payload + 4, &l->h[l->n]);
    kvr_error err = { 0 };
    if (kvr_disk_claim(d, &l->h[l->n], &err)) {
        cr_log_error("record %u: %s", l->idx[l->n], err.msg);
        l->bad++;
    }
    l->n++;
}

static void on_bad(void *arg, const char *file, uint64_t off, uint64_t bytes,
                   const char *why)
{
    (void)arg; (void)file; (void)off; (void)bytes; (void)why;
}

Test(disk_crash, kill9_random_instants, .timeout = 600)
{
    const char *env = getenv("KVR_DISK_CRASH_TRIALS");
    int trials = env ? atoi(env) : 100;
    srand((unsigned)time(NULL));
    static rec_list l;
    static uint8_t out[200000], want[200000];
    int max_acked_seen = 0;
    for (int trial = 0; trial < trials; trial++) {
        kvr_disk_engine e = trial % 2 ? KVR_DISK_ENGINE_POSIX : KVR_DISK_ENGINE_URING;
        char dir[256];
        kvt_tmpdir(dir, sizeof dir, "kvr_crash");
        int p[2];
        cr_assert_eq(pipe(p), 0);
        pid_t pid = fork();
        cr_assert_geq(pid, 0);
        if (pid == 0) {
            close(p[0]);
            child(dir, e, p[1]);
        }
        close(p[1]);
        int64_t acked = -1;
        uint32_t v;
        /* Every fourth trial first waits for 45 acknowledgements (past the
         * first checkpoint at 40), so the checkpoint paths are crashed into
         * however slow the machine is; the others die at a random instant
         * of their first 61 ms. */
        if (trial % 4 == 3) {
            struct pollfd pf = { .fd = p[0], .events = POLLIN };
            for (int waited = 0; acked < 45 && waited < 30000;) {
                int r = poll(&pf, 1, 100);
                if (r == 0) {
                    waited += 100;
                    continue;
                }
                if (r < 0 || read(p[0], &v, 4) != 4)
                    break;
                cr_assert_eq((int64_t)v, acked + 1);
                acked = v;
            }
            usleep((useconds_t)(rand() % 5000));
        } else {
            usleep((useconds_t)(1000 + rand() % 60000));
        }
        kill(pid, SIGKILL);
        int wst;
        waitpid(pid, &wst, 0);
        cr_assert(WIFSIGNALED(wst), "child exited %d", WEXITSTATUS(wst));
        while (read(p[0], &v, 4) == 4) {
            cr_assert_eq((int64_t)v, acked + 1);
            acked = v;
        }
        close(p[0]);
        if (acked > max_acked_seen)
            max_acked_seen = (int)acked;

        kvr_disk_config cfg = { .dir = dir, .engine = e };
        kvr_error err = { 0 };
        memset(&l, 0, sizeof l);
        kvr_disk *d = kvt_disk_open(&cfg, on_rec, on_bad, &l, NULL, true);
        cr_assert_eq(l.bad, 0, "trial %d", trial);
        cr_assert(l.n == (size_t)(acked + 1) || l.n == (size_t)(acked + 2),
                  "trial %d: acked up to %lld, recovered %zu", trial, (long long)acked, l.n);
        for (size_t i = 0; i < l.n; i++) {
            cr_assert_eq(l.idx[i], i, "trial %d: record %zu is %u", trial, i, l.idx[i]);
            void *dst = out;
            cr_assert_eq(kvr_disk_load(d, &l.h[i], &dst, 1, NULL, &err), 0,
                         "trial %d rec %zu: %s", trial, i, err.msg);
            cr_assert_eq(l.h[i].len, blk_len((uint32_t)i));
            kvt_fill(want, l.h[i].len, i);
            cr_assert_eq(memcmp(out, want, l.h[i].len), 0);
        }
        kvr_disk_close(d);
        kvt_rmrf(dir);
    }
    cr_log_info("%d kill -9 trials, up to %d records acknowledged", trials, max_acked_seen);
    cr_assert_gt(max_acked_seen, 40, "children never got past a checkpoint");
}
