/*
 * test_disk_spill.c — the disk tier's spill store (cache/disk.h): CRC32C
 * vectors, bit-exact spill/load round trips of random sizes, batch loads,
 * references and frees (space returned, empty segments unlinked), handles
 * surviving a reopen through claim, --disk-max, corrupt extents quarantined,
 * the directory lock, and the O_DIRECT and buffered paths reading each
 * other's files (the three-lane CRC too). Every behaviour runs on io_uring
 * and on the forced POSIX fallback.
 */
#include <criterion/criterion.h>
#include <fcntl.h>
#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cache/disk.h"
#include "tests/common/kvt.h"
#include "tests/common/kvt_disk.h"
#include "tests/common/kvt_bench.h"

static const kvr_disk_engine engines[] = { KVR_DISK_ENGINE_URING, KVR_DISK_ENGINE_POSIX };

static kvr_disk *open_ready(const char *dir, kvr_disk_engine e, uint64_t max,
                            uint64_t seg_bytes)
{
    kvr_disk_config cfg = { .dir = dir, .engine = e, .max_bytes = max,
                            .segment_bytes = seg_bytes };
    return kvt_disk_open(&cfg, NULL, NULL, NULL, NULL, true);
}

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint64_t rnd(void)
{
    return kvt_xorshift(&rng_state);
}

/* free() of a[0..n). */
static void free_n(void **a, int n)
{
    for (int i = 0; i < n; i++)
        free(a[i]);
}

static size_t count_files(const char *dir, const char *prefix)
{
    char cmd[512];
    snprintf(cmd, sizeof cmd, "ls %s | grep -c '^%s' ", dir, prefix);
    FILE *f = popen(cmd, "r");
    size_t n = 0;
    if (f) {
        if (fscanf(f, "%zu", &n) != 1)
            n = 0;
        pclose(f);
    }
    return n;
}

Test(disk_crc, vectors)
{
    cr_assert_eq(kvr_crc32c(0, "123456789", 9), 0xE3069283u);
    cr_assert_eq(kvr_crc32c_portable(0, "123456789", 9), 0xE3069283u);
    cr_assert_eq(kvr_crc32c(0, "", 0), 0u);
    uint8_t z[32] = { 0 };
    cr_assert_eq(kvr_crc32c(0, z, 32), 0x8A9136AAu);   /* RFC 3720 B.4 */
    uint8_t buf[4099];
    kvt_fill(buf, sizeof buf, 7);
    for (size_t off = 0; off < 9; off++)
        for (size_t n = 0; n + off <= sizeof buf; n += 37) {
            uint32_t a = kvr_crc32c(0, buf + off, n);
            cr_assert_eq(a, kvr_crc32c_portable(0, buf + off, n));
            /* Incremental = one shot. */
            cr_assert_eq(kvr_crc32c(kvr_crc32c(0, buf + off, n / 3), buf + off + n / 3,
                                    n - n / 3), a);
        }
}

Test(disk_spill, engine_names)
{
    char dir[256];
    kvt_tmpdir(dir, sizeof dir, "kvr_disk");
    kvr_disk *d = open_ready(dir, KVR_DISK_ENGINE_POSIX, 0, 0);
    cr_assert_str_eq(kvr_disk_engine_name(d), "posix");
    kvr_disk_close(d);
    d = open_ready(dir, KVR_DISK_ENGINE_AUTO, 0, 0);
    cr_assert(!strcmp(kvr_disk_engine_name(d), "io_uring") ||
              !strcmp(kvr_disk_engine_name(d), "posix"));
    kvr_disk_stats st;
    kvr_disk_get_stats(d, &st);
    cr_assert_str_eq(st.engine, kvr_disk_engine_name(d));
    kvr_disk_close(d);
    kvt_rmrf(dir);
}

KVT_DISK_TEST(disk_spill, round_trips)
{
    kvr_disk *d = open_ready(dir, e, 0, 1u << 20);   /* small segments: rolls */
    enum { N = 96 };
    size_t len[N];
    uint8_t *src[N];
    kvr_disk_handle h[N];
    kvr_error err = { 0 };
    for (int i = 0; i < N; i++) {
        len[i] = 1 + (size_t)(rnd() % (i % 8 == 0 ? 600000 : 9000));
        src[i] = malloc(len[i]);
        kvt_fill(src[i], len[i], (uint64_t)i + 1);
    }
    /* Batches of various sizes, some synced. */
    for (int i = 0; i < N;) {
        int b = 1 + (int)(rnd() % 9);
        if (i + b > N)
            b = N - i;
        kvr_disk_buf bufs[9];
        for (int k = 0; k < b; k++)
            bufs[k] = (kvr_disk_buf){ .data = src[i + k], .len = len[i + k] };
        cr_assert_eq(kvr_disk_spill(d, bufs, (size_t)b, &h[i], (i & 1) != 0, &err), 0,
                     "%s", err.msg);
        i += b;
    }
    kvr_disk_stats st;
    kvr_disk_get_stats(d, &st);
    cr_assert_eq(st.data_blocks, N);
    cr_assert_gt(st.segments, 1);
    /* One batch load of everything, in reverse order. */
    void *dst[N];
    kvr_disk_handle hr[N];
    int status[N];
    for (int i = 0; i < N; i++) {
        hr[i] = h[N - 1 - i];
        dst[i] = malloc(hr[i].len);
    }
    cr_assert_eq(kvr_disk_load(d, hr, dst, N, status, &err), 0, "%s", err.msg);
    for (int i = 0; i < N; i++) {
        cr_assert_eq(status[i], 0);
        cr_assert_eq(memcmp(dst[i], src[N - 1 - i], len[N - 1 - i]), 0, "block %d", i);
    }
    /* Handles survive encode/decode. */
    uint8_t enc[KVR_DISK_HANDLE_BYTES];
    kvr_disk_handle back;
    kvr_disk_handle_encode(&h[5], enc);
    kvr_disk_handle_decode(enc, &back);
    cr_assert_eq(memcmp(&back, &h[5], offsetof(kvr_disk_handle, crc) + 4), 0);
    /* Free everything: space goes back, full segments are unlinked. */
    for (int i = 0; i < N; i++)
        cr_assert_eq(kvr_disk_free(d, &h[i], &err), 0, "%s", err.msg);
    cr_assert_eq(kvr_disk_free(d, &h[0], &err), KVR_EINVAL);
    cr_assert_eq(kvr_disk_load(d, &h[1], dst, 1, NULL, &err), KVR_EINVAL);
    kvr_disk_get_stats(d, &st);
    cr_assert_eq(st.data_blocks, 0);
    cr_assert_eq(st.data_bytes, 0);
    cr_assert_leq(st.segments, 1);
    cr_assert_leq(count_files(dir, "seg-"), 1);
    free_n((void **)src, N);
    free_n(dst, N);
    kvr_disk_close(d);
}

/* Two-part extents (a block's K/V, then its metadata, in two allocations):
 * written from and read into any split, page-aligned or not, the image is
 * the concatenation; a whole load of one matches, and a split load puts
 * each part where it belongs. */
KVT_DISK_TEST(disk_spill, two_part)
{
    kvr_disk *d = open_ready(dir, e, 0, 4u << 20);
    enum { N = 24 };
    size_t len[N], cut[N];
    uint8_t *src[N], *kv[N];
    kvr_disk_handle h[N];
    kvr_disk_buf bufs[N];
    kvr_error err = { 0 };
    for (int i = 0; i < N; i++) {
        /* K/V parts of whole pages (aligned memory: direct I/O) and of
         * odd lengths; tails of 0 .. 3 pages and a few bytes. */
        size_t a = i % 3 == 0 ? (size_t)(1 + i) << 16 : 1 + (size_t)(rnd() % 300000);
        size_t t = i % 4 == 0 ? 0 : 1 + (size_t)(rnd() % 13000);
        len[i] = a + t;
        cut[i] = a;
        src[i] = malloc(len[i]);
        kvt_fill(src[i], len[i], (uint64_t)i + 7);
        cr_assert_eq(posix_memalign((void **)&kv[i], 4096, a), 0);
        memcpy(kv[i], src[i], a);
        bufs[i] = (kvr_disk_buf){ .data = kv[i], .len = a, .tail = t ? src[i] + a : NULL,
                                  .tail_len = t };
    }
    cr_assert_eq(kvr_disk_spill(d, bufs, N, h, true, &err), 0, "%s", err.msg);
    for (int i = 0; i < N; i++)
        cr_assert_eq(h[i].len, len[i]);
    /* Whole loads. */
    void *dst[N];
    for (int i = 0; i < N; i++)
        dst[i] = malloc(len[i]);
    cr_assert_eq(kvr_disk_load(d, h, dst, N, NULL, &err), 0, "%s", err.msg);
    for (int i = 0; i < N; i++)
        cr_assert_eq(memcmp(dst[i], src[i], len[i]), 0, "extent %d", i);
    /* Split loads at the written cut (aligned K/V memory) and elsewhere. */
    for (int pass = 0; pass < 2; pass++) {
        kvr_disk_dst x[N];
        uint8_t *tails[N];
        int status[N];
        for (int i = 0; i < N; i++) {
            size_t c = pass == 0 ? cut[i] : (size_t)(rnd() % (len[i] + 1));
            memset(kv[i], 0, cut[i]);
            uint8_t *p = pass == 0 ? kv[i] : dst[i];
            tails[i] = malloc(len[i] - c + 1);
            x[i] = (kvr_disk_dst){ p, c, c < len[i] ? tails[i] : NULL };
        }
        cr_assert_eq(kvr_disk_load_split(d, h, x, N, status, &err), 0, "%s", err.msg);
        for (int i = 0; i < N; i++) {
            cr_assert_eq(status[i], 0);
            cr_assert_eq(memcmp(x[i].data, src[i], x[i].len), 0, "extent %d", i);
            cr_assert_eq(memcmp(tails[i], src[i] + x[i].len, len[i] - x[i].len), 0,
                         "extent %d tail", i);
            free(tails[i]);
        }
    }
    /* A destination shorter than the extent without a tail is refused. */
    kvr_disk_dst bad = { dst[1], len[1] - 1, NULL };
    int st1 = 0;
    cr_assert_eq(kvr_disk_load_split(d, &h[1], &bad, 1, &st1, &err), KVR_EINVAL);
    cr_assert_eq(st1, KVR_EINVAL);
    cr_assert(strstr(err.msg, "without a tail"), "%s", err.msg);
    /* So is a tail length without a tail. */
    kvr_disk_buf nb = { .data = kv[0], .len = 10, .tail = NULL, .tail_len = 5 };
    kvr_disk_handle hx;
    cr_assert_eq(kvr_disk_spill(d, &nb, 1, &hx, false, &err), KVR_EINVAL);
    free_n((void **)src, N);
    free_n((void **)kv, N);
    free_n(dst, N);
    kvr_disk_close(d);
}

/* Spilled + synced data survives a reopen; claimed handles stay, the rest
 * is reclaimed. */
KVT_DISK_TEST(disk_spill, reopen_claim)
{
    kvr_disk *d = open_ready(dir, e, 0, 256u << 10);
    enum { N = 40 };
    kvr_disk_handle h[N];
    kvr_error err = { 0 };
    static uint8_t buf[70000];
    for (int i = 0; i < N; i++) {
        size_t n = 1 + (size_t)(rnd() % sizeof buf);
        kvt_fill(buf, n, (uint64_t)i * 31);
        kvr_disk_buf b = { .data = buf, .len = n };
        cr_assert_eq(kvr_disk_spill(d, &b, 1, &h[i], false, &err), 0, "%s", err.msg);
    }
    cr_assert_eq(kvr_disk_sync(d, &err), 0, "%s", err.msg);
    kvr_disk_close(d);

    kvr_disk_config cfg = { .dir = dir, .engine = e };
    cr_assert_eq(kvr_disk_open(&d, &cfg, &err), 0, "%s", err.msg);
    /* Before recover: nothing may be written. */
    kvr_disk_buf b0 = { .data = buf, .len = 10 };
    kvr_disk_handle hx;
    cr_assert_eq(kvr_disk_spill(d, &b0, 1, &hx, false, &err), KVR_EINVAL);
    kvr_disk_recovery rs;
    cr_assert_eq(kvr_disk_recover(d, NULL, NULL, NULL, &rs, &err), 0, "%s", err.msg);
    cr_assert_gt(rs.segments, 1);
    for (int i = 0; i < N; i += 2)
        cr_assert_eq(kvr_disk_claim(d, &h[i], &err), 0, "%s", err.msg);
    kvr_disk_handle bad = h[1];
    bad.seq += 1000;
    cr_assert_eq(kvr_disk_claim(d, &bad, &err), KVR_EIO);
    cr_assert_eq(kvr_disk_recover_done(d, &err), 0, "%s", err.msg);
    kvr_disk_stats st;
    kvr_disk_get_stats(d, &st);
    cr_assert_eq(st.data_blocks, N / 2);
    static uint8_t out[70000], want[70000];
    for (int i = 0; i < N; i++) {
        void *dst = out;
        int rc = kvr_disk_load(d, &h[i], &dst, 1, NULL, &err);
        if (i % 2) {
            cr_assert_eq(rc, KVR_EINVAL);
            continue;
        }
        cr_assert_eq(rc, 0, "%s", err.msg);
        kvt_fill(want, h[i].len, (uint64_t)i * 31);
        cr_assert_eq(memcmp(out, want, h[i].len), 0);
    }
    /* New spills go to fresh segments and coexist. */
    kvr_disk_handle hn;
    cr_assert_eq(kvr_disk_spill(d, &b0, 1, &hn, true, &err), 0, "%s", err.msg);
    cr_assert_gt(hn.seg, h[N - 1].seg);
    kvr_disk_close(d);
}

KVT_DISK_TEST(disk_spill, refs)
{
    kvr_disk *d = open_ready(dir, e, 0, 0);
    kvr_error err = { 0 };
    uint8_t b[5000];
    kvt_fill(b, sizeof b, 3);
    kvr_disk_buf kb = { .data = b, .len = sizeof b };
    kvr_disk_handle h;
    cr_assert_eq(kvr_disk_spill(d, &kb, 1, &h, false, &err), 0);
    cr_assert_eq(kvr_disk_ref(d, &h, &err), 0);
    cr_assert_eq(kvr_disk_free(d, &h, &err), 0);
    uint8_t out[5000];
    void *dst = out;
    cr_assert_eq(kvr_disk_load(d, &h, &dst, 1, NULL, &err), 0, "%s", err.msg);
    cr_assert_eq(memcmp(out, b, sizeof b), 0);
    cr_assert_eq(kvr_disk_free(d, &h, &err), 0);
    cr_assert_eq(kvr_disk_ref(d, &h, &err), KVR_EINVAL);
    kvr_disk_close(d);
}

KVT_DISK_TEST(disk_spill, disk_max)
{
    kvr_disk *d = open_ready(dir, e, 1u << 20, 0);   /* 1 MiB */
    kvr_error err = { 0 };
    static uint8_t b[100000];
    kvt_fill(b, sizeof b, 9);
    kvr_disk_buf kb = { .data = b, .len = sizeof b };
    kvr_disk_handle h[16];
    int ok = kvt_spill_until_refused(d, &kb, h, 16, false, KVR_ELIMIT, "--disk-max");
    cr_assert_geq(ok, 8);
    cr_assert_lt(ok, 11);
    kvr_disk_stats st;
    kvr_disk_get_stats(d, &st);
    cr_assert_leq(st.data_bytes + st.log_bytes, 1u << 20);
    cr_assert_eq(st.n_refused_full, 1);
    /* Metadata stays writable; freeing makes room again. */
    kvr_disk_rec_in r = { .type = 1, .payload = "x", .len = 1 };
    cr_assert_eq(kvr_disk_log_append(d, &r, 1, NULL, &err), 0, "%s", err.msg);
    cr_assert_eq(kvr_disk_free(d, &h[0], &err), 0);
    cr_assert_eq(kvr_disk_spill(d, &kb, 1, &h[0], false, &err), 0, "%s", err.msg);
    /* The earlier ones still read back. */
    static uint8_t out[100000];
    void *dst = out;
    cr_assert_eq(kvr_disk_load(d, &h[1], &dst, 1, NULL, &err), 0);
    cr_assert_eq(memcmp(out, b, sizeof b), 0);
    kvr_disk_close(d);
}

/* A flipped byte inside an extent fails its load (quarantined); the
 * neighbours still load. */
KVT_DISK_TEST(disk_spill, corrupt_extent)
{
    kvr_disk *d = open_ready(dir, e, 0, 0);
    kvr_error err = { 0 };
    enum { N = 12 };
    static uint8_t b[N][20000];
    kvr_disk_buf kb[N];
    kvr_disk_handle h[N];
    for (int i = 0; i < N; i++) {
        kvt_fill(b[i], sizeof b[i], (uint64_t)i + 100);
        kb[i] = (kvr_disk_buf){ .data = b[i], .len = sizeof b[i] };
    }
    cr_assert_eq(kvr_disk_spill(d, kb, N, h, true, &err), 0);
    char path[512];
    snprintf(path, sizeof path, "%s/seg-%08x.v2.dat", dir, h[4].seg);
    int fd = open(path, O_RDWR);
    cr_assert_geq(fd, 0);
    for (int t = 0; t < 2; t++) {
        /* t=0: in the data; t=1: in the trailer (after the data, v2
         * segments) of another extent. */
        int which = t ? 7 : 4;
        off_t off = (off_t)(h[which].off + (t ? sizeof b[0] + 9 : rnd() % sizeof b[0]));
        uint8_t c;
        cr_assert_eq(pread(fd, &c, 1, off), 1);
        c ^= (uint8_t)(1u << (rnd() % 8));
        cr_assert_eq(pwrite(fd, &c, 1, off), 1);
    }
    close(fd);
    static uint8_t out[N][20000];
    void *dst[N];
    int st[N];
    for (int i = 0; i < N; i++)
        dst[i] = out[i];
    cr_assert_eq(kvr_disk_load(d, h, dst, N, st, &err), KVR_EIO);
    for (int i = 0; i < N; i++) {
        if (i == 4 || i == 7) {
            cr_assert_eq(st[i], KVR_EIO);
            continue;
        }
        cr_assert_eq(st[i], 0);
        cr_assert_eq(memcmp(out[i], b[i], sizeof b[i]), 0);
    }
    kvr_disk_stats s;
    kvr_disk_get_stats(d, &s);
    cr_assert_eq(s.n_quarantined, 2);
    kvr_disk_close(d);
}

Test(disk_spill, lock_and_args)
{
    char dir[256];
    kvt_tmpdir(dir, sizeof dir, "kvr_disk");
    kvr_disk *d = open_ready(dir, KVR_DISK_ENGINE_AUTO, 0, 0);
    kvr_disk_config cfg = { .dir = dir };
    kvr_disk *d2 = NULL;
    kvr_error err = { 0 };
    cr_assert_eq(kvr_disk_open(&d2, &cfg, &err), KVR_EBUSY);
    kvr_disk_buf b = { .data = "x", .len = 0 };
    kvr_disk_handle h;
    cr_assert_eq(kvr_disk_spill(d, &b, 1, &h, false, &err), KVR_EINVAL);
    kvr_disk_close(d);
    cr_assert_eq(kvr_disk_open(&d2, &cfg, &err), 0, "%s", err.msg);
    kvr_disk_close(d2);
    kvr_disk_close(NULL);
    cfg.dir = "";
    cr_assert_eq(kvr_disk_open(&d2, &cfg, &err), KVR_EINVAL);
    kvt_rmrf(dir);
}

/* Many threads spill, load and free at once (the documented contract). */
#include <pthread.h>
static kvr_disk *mt_disk;
static void *mt_worker(void *arg)
{
    uint64_t id = (uint64_t)(uintptr_t)arg;
    uint8_t *b = malloc(30000), *o = malloc(30000);
    int bad = 0;
    for (int i = 0; i < 50 && !bad; i++) {
        size_t n = 1 + (id * 7919 + (uint64_t)i * 104729) % 30000;
        kvt_fill(b, n, id * 1000 + (uint64_t)i);
        kvr_disk_buf kb = { .data = b, .len = n };
        kvr_disk_handle h;
        if (kvr_disk_spill(mt_disk, &kb, 1, &h, i % 5 == 0, NULL) != 0) {
            bad = 1;
            break;
        }
        void *dst = o;
        if (kvr_disk_load(mt_disk, &h, &dst, 1, NULL, NULL) != 0 || memcmp(o, b, n))
            bad = 1;
        if (kvr_disk_free(mt_disk, &h, NULL) != 0)
            bad = 1;
    }
    free(b);
    free(o);
    return (void *)(uintptr_t)bad;
}

Test(disk_spill, threads)
{
    char dir[256];
    kvt_tmpdir(dir, sizeof dir, "kvr_disk");
    for (int e = 0; e < 2; e++) {
        mt_disk = open_ready(dir, engines[e], 0, 1u << 20);
        pthread_t t[4];
        for (uintptr_t i = 0; i < 4; i++)
            pthread_create(&t[i], NULL, mt_worker, (void *)i);
        for (int i = 0; i < 4; i++) {
            void *r;
            pthread_join(t[i], &r);
            cr_assert_null(r);
        }
        kvr_disk_stats st;
        kvr_disk_get_stats(mt_disk, &st);
        cr_assert_eq(st.data_blocks, 0);
        kvr_disk_close(mt_disk);
    }
    kvt_rmrf(dir);
}

/* Large buffers take the three-lane path (>= 24 KiB): same results as the
 * portable tables at every length and alignment around its boundaries. */
Test(disk_crc, lanes)
{
    static uint8_t buf[200000];
    kvt_fill(buf, sizeof buf, 11);
    static const size_t lens[] = { 24575, 24576, 24577, 32768, 49151, 49152, 49160,
                                   73728, 100003, 199990 };
    for (size_t off = 0; off < 9; off++)
        for (size_t k = 0; k < sizeof lens / sizeof lens[0]; k++) {
            size_t n = lens[k];
            uint32_t a = kvr_crc32c(0, buf + off, n);
            cr_assert_eq(a, kvr_crc32c_portable(0, buf + off, n), "off %zu n %zu", off, n);
            cr_assert_eq(kvr_crc32c(0x12345678u, buf + off, n),
                         kvr_crc32c_portable(0x12345678u, buf + off, n));
            cr_assert_eq(kvr_crc32c(kvr_crc32c(0, buf + off, n / 2), buf + off + n / 2,
                                    n - n / 2), a);
        }
}

/* The O_DIRECT path and the buffered one (cfg.buffered) write the same
 * bytes: each reads what the other wrote, including a file whose last
 * extent ends inside its 4 KiB granule (buffered writes stop at the data),
 * extents larger than a request, and batches larger than the staging ring,
 * loaded in one call in a scrambled order with a repeat. */
static void cross_path(kvr_disk_engine e, bool write_buffered)
{
    char dir[256];
    kvt_tmpdir(dir, sizeof dir, "kvr_disk");
    kvr_disk_config cfg = { .dir = dir, .engine = e, .buffered = write_buffered,
                            .segment_bytes = 16u << 20 };
    kvr_disk *d = kvt_disk_open(&cfg, NULL, NULL, NULL, NULL, true);
    kvr_error err = { 0 };
    enum { N = 16 };
    static const size_t sizes[N] = { 1, 100, 4064, 4065, 5000, 2u << 20, (2u << 20) + 777,
                                     9u << 20, 3000, 1u << 20, (3u << 20) + 5, 70000,
                                     4096, 8191, (2u << 20) - 32, 12345 };
    uint8_t *src[N];
    kvr_disk_buf bufs[N];
    kvr_disk_handle h[N];
    kvt_disk_fill_bufs(N, sizes, 1000, false, src, bufs);
    /* Batches of 1, 5 and 10 extents. */
    cr_assert_eq(kvr_disk_spill(d, bufs, 1, h, false, &err), 0, "%s", err.msg);
    cr_assert_eq(kvr_disk_spill(d, bufs + 1, 5, h + 1, false, &err), 0, "%s", err.msg);
    cr_assert_eq(kvr_disk_spill(d, bufs + 6, 10, h + 6, true, &err), 0, "%s", err.msg);
    kvr_disk_close(d);

    cfg.buffered = !write_buffered;
    d = kvt_disk_open(&cfg, NULL, NULL, NULL, NULL, false);
    for (int i = 0; i < N; i++)
        cr_assert_eq(kvr_disk_claim(d, &h[i], &err), 0, "%s", err.msg);
    cr_assert_eq(kvr_disk_recover_done(d, &err), 0, "%s", err.msg);
    enum { M = N + 2 };
    kvr_disk_handle hl[M];
    void *dst[M];
    int st[M], idx[M];
    for (int k = 0; k < M; k++) {
        idx[k] = k < N ? (k * 7 + 3) % N : k - N;   /* scrambled, 0 and 1 twice */
        hl[k] = h[idx[k]];
        dst[k] = malloc(sizes[idx[k]]);
    }
    cr_assert_eq(kvr_disk_load(d, hl, dst, M, st, &err), 0, "%s", err.msg);
    for (int k = 0; k < M; k++) {
        cr_assert_eq(st[k], 0);
        cr_assert_eq(memcmp(dst[k], src[idx[k]], sizes[idx[k]]), 0, "extent %d", idx[k]);
        free(dst[k]);
    }
    /* And one by one. */
    for (int i = 0; i < N; i++) {
        void *o = malloc(sizes[i]);
        cr_assert_eq(kvr_disk_load(d, &h[i], &o, 1, NULL, &err), 0, "%s", err.msg);
        cr_assert_eq(memcmp(o, src[i], sizes[i]), 0);
        free(o);
    }
    /* A corrupted byte is still caught on this path. */
    kvr_disk_close(d);
    char path[512];
    snprintf(path, sizeof path, "%s/seg-%08x.v2.dat", dir, h[5].seg);
    kvt_flip_byte(path, h[5].off + 1000, 0x40);
    d = kvt_disk_open(&cfg, NULL, NULL, NULL, NULL, false);
    for (int i = 0; i < N; i++)
        cr_assert_eq(kvr_disk_claim(d, &h[i], &err), 0, "%s", err.msg);
    cr_assert_eq(kvr_disk_recover_done(d, &err), 0, "%s", err.msg);
    void *o5 = malloc(sizes[5]), *o6 = malloc(sizes[6]);
    kvr_disk_handle two[2] = { h[5], h[6] };
    void *d2[2] = { o5, o6 };
    int s2[2];
    cr_assert_eq(kvr_disk_load(d, two, d2, 2, s2, &err), KVR_EIO);
    cr_assert_eq(s2[0], KVR_EIO);
    cr_assert_eq(s2[1], 0);
    cr_assert_eq(memcmp(o6, src[6], sizes[6]), 0);
    free(o5);
    free(o6);
    kvr_disk_close(d);
    for (int i = 0; i < N; i++)
        free(src[i]);
    kvt_rmrf(dir);
}

Test(disk_spill, cross_path_uring) { cross_path(KVR_DISK_ENGINE_URING, true);
                                     cross_path(KVR_DISK_ENGINE_URING, false); }
Test(disk_spill, cross_path_posix) { cross_path(KVR_DISK_ENGINE_POSIX, true);
                                     cross_path(KVR_DISK_ENGINE_POSIX, false); }
