/*
 * test_disk_format.c — the disk tier's two extent formats (cache/disk.h):
 * v2 segments (seg-XXXXXXXX.v2.dat: data, then a 32-byte trailer, so data
 * goes between the device and block memory with no staging) are what is
 * written; v1 segments (seg-XXXXXXXX.dat: header, then data) written by
 * an older kvrope are still recovered and read, bit-exact, next to v2
 * ones. Truncated and corrupt records of both formats are refused as
 * corrupt (never as an I/O error that would stop recovery from
 * reclaiming), the others of the same segment still load; a segment of a
 * newer format or two files of one id are refused with a clear error.
 * Memory that O_DIRECT cannot use directly (unaligned) is staged and gives
 * the same bytes. A load's last, smaller requests fail alone and lose
 * nothing. Claims that peek at an extent's first and last bytes (recovery
 * reading a block's metadata) read v2 extents only. Every behaviour runs on
 * io_uring and on POSIX.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cache/disk.h"
#include "tests/common/kvt.h"
#include "tests/common/kvt_disk.h"

static const kvr_disk_engine engines[] = { KVR_DISK_ENGINE_URING, KVR_DISK_ENGINE_POSIX };

/* v little-endian into the `bytes` bytes at p (a header field). */
static void put_le(uint8_t *p, uint64_t v, int bytes)
{
    for (int i = 0; i < bytes; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

/* Opens dir, recovers (no records), leaves it recovering. rc of recover. */
static int open_recovering(kvr_disk **d, const char *dir, kvr_disk_engine e, kvr_error *err)
{
    kvr_disk_config cfg = { .dir = dir, .engine = e };
    cr_assert_eq(kvr_disk_open(d, &cfg, err), 0, "%s", err->msg);
    int rc = kvr_disk_recover(*d, NULL, NULL, NULL, NULL, err);
    if (rc) {
        kvr_disk_close(*d);
        *d = NULL;
    }
    return rc;
}

/* A fresh directory dir (cap bytes) with an empty disk on it, recovered
 * and taking writes. */
static kvr_disk *open_fresh(char *dir, size_t cap, kvr_disk_engine e)
{
    kvr_disk *d;
    kvr_error err = { 0 };
    kvt_tmpdir(dir, cap, "kvr_dfmt");
    cr_assert_eq(open_recovering(&d, dir, e, &err), 0, "%s", err.msg);
    cr_assert_eq(kvr_disk_recover_done(d, &err), 0, "%s", err.msg);
    return d;
}

/* Reopens dir, claims the n extents of h (each must claim), ends recovery. */
static kvr_disk *reopen_claim_all(const char *dir, kvr_disk_engine e, const kvr_disk_handle *h,
                                  int n)
{
    kvr_disk *d;
    kvr_error err = { 0 };
    cr_assert_eq(open_recovering(&d, dir, e, &err), 0, "%s", err.msg);
    for (int i = 0; i < n; i++)
        cr_assert_eq(kvr_disk_claim(d, &h[i], &err), 0, "extent %d: %s", i, err.msg);
    cr_assert_eq(kvr_disk_recover_done(d, &err), 0, "%s", err.msg);
    return d;
}

/* Closes d (if open), frees the n buffers of bufs, removes dir. */
static void finish(kvr_disk *d, const char *dir, uint8_t **bufs, int n)
{
    if (d)
        kvr_disk_close(d);
    for (int i = 0; i < n; i++)
        free(bufs[i]);
    kvt_rmrf(dir);
}

static void file_path(char *p, size_t cap, const char *dir, uint32_t seg, bool v2)
{
    snprintf(p, cap, "%s/seg-%08x%s.dat", dir, seg, v2 ? ".v2" : "");
}

static void flip(const char *path, uint64_t off)
{
    kvt_flip_byte(path, off, 0x10);
}

static void cut(const char *path, uint64_t size)
{
    cr_assert_eq(truncate(path, (off_t)size), 0, "%s", path);
}

/* ---- v1 segments, as an older kvrope wrote them --------------------------- */
enum { V1N = 5 };
static const size_t v1_sizes[V1N] = { 5000, 8192, 100, (2u << 20) + 3, 4070 };

/* Writes seg-00000001.dat in the v1 layout (header, data, zero padding to
 * 4 KiB; the last extent ends at its data, as buffered writes left it)
 * and returns its handles. */
static void write_v1(const char *dir, kvr_disk_handle *h, uint8_t **data)
{
    char path[512];
    file_path(path, sizeof path, dir, 1, false);
    int fd = open(path, O_RDWR | O_CREAT | O_TRUNC, 0644);
    cr_assert_geq(fd, 0);
    uint64_t off = 0;
    for (int i = 0; i < V1N; i++) {
        size_t n = v1_sizes[i];
        data[i] = malloc(n);
        kvt_fill(data[i], n, 500u + (uint64_t)i);
        h[i] = (kvr_disk_handle){ .seg = 1, .len = (uint32_t)n, .off = off,
                                  .seq = 1000u + (uint64_t)i,
                                  .crc = kvr_crc32c(0, data[i], n) };
        uint8_t hd[32] = { 0 }, o[8];
        put_le(hd, 0x5852564Bu, 4);                 /* "KVRX" */
        put_le(hd + 8, h[i].seq, 8);
        put_le(hd + 16, 1, 4);
        put_le(hd + 20, h[i].len, 4);
        put_le(hd + 24, h[i].crc, 4);
        put_le(o, off, 8);
        put_le(hd + 4, kvr_crc32c(kvr_crc32c(0, hd + 8, 24), o, 8), 4);
        cr_assert_eq(pwrite(fd, hd, 32, (off_t)off), 32);
        cr_assert_eq(pwrite(fd, data[i], n, (off_t)(off + 32)), (ssize_t)n);
        off += (32 + n + 4095) & ~(uint64_t)4095;
    }
    close(fd);
}

static void load_check(kvr_disk *d, const kvr_disk_handle *h, uint8_t **want, int n,
                       const int *expect)
{
    kvr_error err = { 0 };
    void *dst[16] = { NULL };
    int st[16] = { 0 };
    cr_assert_leq(n, 16);
    for (int i = 0; i < n; i++)
        dst[i] = malloc(h[i].len);
    int rc = kvr_disk_load(d, h, dst, (size_t)n, st, &err);
    bool any = false;
    for (int i = 0; i < n; i++) {
        cr_assert_eq(st[i], expect[i], "extent %d: %d", i, st[i]);
        if (!expect[i])
            cr_assert_eq(memcmp(dst[i], want[i], h[i].len), 0, "extent %d", i);
        any |= expect[i] != 0;
        free(dst[i]);
    }
    cr_assert_eq(rc != 0, any);
}

static void v1_read(kvr_disk_engine e)
{
    char dir[256];
    kvr_disk *d = open_fresh(dir, sizeof dir, e);
    kvr_error err = { 0 };
    kvr_disk_close(d);
    kvr_disk_handle h[V1N + 1];
    uint8_t *data[V1N + 1];
    write_v1(dir, h, data);

    d = reopen_claim_all(dir, e, h, V1N);
    int ok[V1N + 1] = { 0 };
    load_check(d, h, data, V1N, ok);
    /* A new spill goes to a new, v2 segment; a batch mixes both formats. */
    data[V1N] = malloc(3u << 20);
    kvt_fill(data[V1N], 3u << 20, 77);
    kvr_disk_buf b = { .data = data[V1N], .len = 3u << 20 };
    cr_assert_eq(kvr_disk_spill(d, &b, 1, &h[V1N], true, &err), 0, "%s", err.msg);
    cr_assert_gt(h[V1N].seg, 1);
    char path[512];
    file_path(path, sizeof path, dir, h[V1N].seg, true);
    cr_assert_eq(access(path, F_OK), 0, "%s", path);
    load_check(d, h, data, V1N + 1, ok);
    kvr_disk_close(d);

    /* Corrupt data of a v1 extent: claimed (its header is fine), its load
     * fails, the others load. A corrupt header: the claim fails. */
    file_path(path, sizeof path, dir, 1, false);
    flip(path, h[1].off + 32 + 77);
    flip(path, h[2].off + 9);
    cr_assert_eq(open_recovering(&d, dir, e, &err), 0, "%s", err.msg);
    /* Claimed as recovery claims a context's blocks, in one batch (headers
     * read together): in order, up to the corrupt header. */
    size_t got = 99;
    cr_assert_eq(kvr_disk_claim_n(d, h, V1N + 1, &got, &err), KVR_EIO);
    cr_assert_eq(got, 2, "claimed %zu: in order up to the corrupt header", got);
    cr_assert(strstr(err.msg, "corrupt"), "%s", err.msg);
    cr_assert_eq(kvr_disk_claim_n(d, h + 3, V1N + 1 - 3, &got, &err), 0, "%s", err.msg);
    cr_assert_eq(got, V1N + 1 - 3);
    cr_assert_eq(kvr_disk_claim(d, &h[2], &err), KVR_EIO, "still corrupt alone");
    cr_assert_eq(kvr_disk_recover_done(d, &err), 0, "%s", err.msg);
    kvr_disk_handle h2[V1N];
    uint8_t *d2[V1N];
    int ex[V1N] = { 0, KVR_EIO, 0, 0, 0 };
    for (int i = 0, k = 0; i <= V1N; i++)
        if (i != 2) {
            h2[k] = h[i];
            d2[k++] = data[i];
        }
    ex[1] = KVR_EIO;
    load_check(d, h2, d2, V1N, ex);
    finish(d, dir, data, V1N + 1);
}

KVT_DISK_TESTS(disk_format, v1_read, v1_read)

/* kvr_disk_claim_peek_n: claims that also read each v2 extent's first and
 * last bytes (the tier's recovery reads a block's metadata so, not its
 * K/V): the bytes are the extent's, an extent claimed before is read
 * again, the claimed extents load as after any claim; a peek longer than
 * its extent is refused with nothing claimed; a corrupt trailer stops the
 * claims in order as kvr_disk_claim_n does; an extent of a v1 segment
 * refuses the call with nothing claimed (the caller reads it whole). */
static void peek(kvr_disk_engine e)
{
    char dir[256];
    kvr_disk *d = open_fresh(dir, sizeof dir, e);
    kvr_error err = { 0 };
    enum { N = 4 };
    static const size_t sz[N] = { 5000, 8192, 100, (1u << 20) + 3 };
    uint8_t *data[N];
    kvr_disk_handle h[N];
    kvr_disk_buf b[N];
    kvt_disk_fill_bufs(N, sz, 900, false, data, b);
    cr_assert_eq(kvr_disk_spill(d, b, N, h, true, &err), 0, "%s", err.msg);
    kvr_disk_close(d);

    cr_assert_eq(open_recovering(&d, dir, e, &err), 0, "%s", err.msg);
    uint8_t head[N][64], tail[N][96];
    kvr_disk_peek pk[N];
    size_t tl[N];
    for (int i = 0; i < N; i++) {
        tl[i] = sz[i] < 96 ? sz[i] : 96;
        pk[i] = (kvr_disk_peek){ head[i], 64, tail[i], tl[i] };
    }
    size_t got = 99;
    kvr_disk_peek big = { NULL, 0, tail[2], sz[2] + 1 };
    cr_assert_eq(kvr_disk_claim_peek_n(d, &h[2], &big, 1, &got, &err), KVR_EINVAL);
    cr_assert_eq(got, 0);
    cr_assert_eq(kvr_disk_claim_peek_n(d, h, pk, N, &got, &err), 0, "%s", err.msg);
    cr_assert_eq(got, N);
    for (int i = 0; i < N; i++) {
        cr_assert_eq(memcmp(head[i], data[i], 64), 0, "extent %d's head", i);
        cr_assert_eq(memcmp(tail[i], data[i] + sz[i] - tl[i], tl[i]), 0, "extent %d's tail", i);
    }
    memset(tail[0], 0, sizeof tail[0]);
    cr_assert_eq(kvr_disk_claim_peek_n(d, h, pk, 1, &got, &err), 0, "%s", err.msg);
    cr_assert_eq(memcmp(tail[0], data[0] + sz[0] - tl[0], tl[0]), 0, "claimed twice: read again");
    cr_assert_eq(kvr_disk_recover_done(d, &err), 0, "%s", err.msg);
    int ok[N] = { 0 };
    load_check(d, h, data, N, ok);
    kvr_disk_close(d);

    char path[512];
    file_path(path, sizeof path, dir, h[1].seg, true);
    flip(path, h[1].off + h[1].len + 9);          /* extent 1's trailer */
    cr_assert_eq(open_recovering(&d, dir, e, &err), 0, "%s", err.msg);
    got = 99;
    cr_assert_eq(kvr_disk_claim_peek_n(d, h, pk, N, &got, &err), KVR_EIO);
    cr_assert_eq(got, 1, "claimed %zu: in order up to the corrupt trailer", got);
    cr_assert(strstr(err.msg, "corrupt"), "%s", err.msg);
    cr_assert_eq(kvr_disk_recover_done(d, &err), 0, "%s", err.msg);
    finish(d, dir, data, N);

    /* v1: refused before anything is claimed; a plain claim still works. */
    d = open_fresh(dir, sizeof dir, e);
    kvr_disk_close(d);
    kvr_disk_handle h1[V1N];
    uint8_t *d1[V1N];
    write_v1(dir, h1, d1);
    cr_assert_eq(open_recovering(&d, dir, e, &err), 0, "%s", err.msg);
    got = 99;
    cr_assert_eq(kvr_disk_claim_peek_n(d, h1, pk, 1, &got, &err), KVR_EUNSUPPORTED);
    cr_assert_eq(got, 0);
    cr_assert_eq(kvr_disk_claim_n(d, h1, V1N, &got, &err), 0, "%s", err.msg);
    cr_assert_eq(kvr_disk_recover_done(d, &err), 0, "%s", err.msg);
    finish(d, dir, d1, V1N);
}

KVT_DISK_TESTS(disk_format, peek, peek)

/* A v1 segment cut inside an extent: that claim fails as corrupt (not as
 * an I/O error: recover_done still reclaims), the earlier ones load. */
static void v1_truncated(kvr_disk_engine e)
{
    char dir[256];
    kvr_disk *d = open_fresh(dir, sizeof dir, e);
    kvr_error err = { 0 };
    kvr_disk_close(d);
    kvr_disk_handle h[V1N];
    uint8_t *data[V1N];
    write_v1(dir, h, data);
    char path[512];
    file_path(path, sizeof path, dir, 1, false);
    cut(path, h[3].off + 32 + 1000);          /* inside extent 3's data */
    cr_assert_eq(open_recovering(&d, dir, e, &err), 0, "%s", err.msg);
    for (int i = 0; i < V1N; i++) {
        int want = i < 3 ? 0 : KVR_EIO;
        cr_assert_eq(kvr_disk_claim(d, &h[i], &err), want, "extent %d: %s", i, err.msg);
    }
    cr_assert_eq(kvr_disk_recover_done(d, &err), 0, "%s", err.msg);
    int ok[3] = { 0 };
    load_check(d, h, data, 3, ok);
    kvr_disk_stats st;
    kvr_disk_get_stats(d, &st);
    cr_assert_eq(st.data_blocks, 3);
    cr_assert_geq(st.n_quarantined, 1);     /* extent 4 starts past the end: no extent */
    finish(d, dir, data, V1N);
}

KVT_DISK_TESTS(disk_format, v1_truncated, v1_truncated)

/* ---- v2: truncated and corrupt records ---------------------------------------- */
enum { V2N = 10 };
static const size_t v2_sizes[V2N] = { 4065, 4095, 8192, 1, (2u << 20), (9u << 20) + 123,
                                      70000, 4064, (4u << 20) - 16, 12288 };

static void v2_damage(kvr_disk_engine e)
{
    char dir[256];
    kvr_disk *d = open_fresh(dir, sizeof dir, e);
    kvr_error err = { 0 };
    uint8_t *data[V2N];
    kvr_disk_buf b[V2N];
    kvr_disk_handle h[V2N];
    kvt_disk_fill_bufs(V2N, v2_sizes, 900, true, data, b);
    cr_assert_eq(kvr_disk_spill(d, b, V2N, h, true, &err), 0, "%s", err.msg);
    for (int i = 1; i < V2N; i++)
        cr_assert_eq(h[i].seg, h[0].seg);
    int ok[V2N] = { 0 };
    load_check(d, h, data, V2N, ok);
    kvr_disk_close(d);

    char path[512];
    file_path(path, sizeof path, dir, h[0].seg, true);
    flip(path, h[1].off + h[1].len + 9);       /* extent 1's trailer (seq) */
    flip(path, h[0].off + h[0].len + 2);       /* extent 0's trailer magic */
    flip(path, h[5].off + (5u << 20));         /* extent 5's data */
    flip(path, h[7].off + h[7].len + 20);      /* extent 7's trailer (len) */
    cut(path, h[9].off + h[9].len + 10);       /* inside extent 9's trailer */
    cr_assert_eq(open_recovering(&d, dir, e, &err), 0, "%s", err.msg);
    kvr_disk_handle kept[V2N];
    uint8_t *kd[V2N];
    int ex[V2N];
    int nk = 0;
    for (int i = 0; i < V2N; i++) {
        bool bad = i == 0 || i == 1 || i == 7 || i == 9;
        cr_assert_eq(kvr_disk_claim(d, &h[i], &err), bad ? KVR_EIO : 0, "extent %d: %s", i,
                     err.msg);
        if (!bad) {
            kept[nk] = h[i];
            kd[nk] = data[i];
            ex[nk++] = i == 5 ? KVR_EIO : 0;
        }
    }
    cr_assert_eq(kvr_disk_recover_done(d, &err), 0, "%s", err.msg);
    load_check(d, kept, kd, nk, ex);
    kvr_disk_close(d);

    /* Cut inside extent 8's data: 8 is lost, 2..6 still load. */
    cut(path, h[8].off + 5000);
    cr_assert_eq(open_recovering(&d, dir, e, &err), 0, "%s", err.msg);
    cr_assert_eq(kvr_disk_claim(d, &h[8], &err), KVR_EIO);
    for (int i = 2; i <= 6; i++)
        cr_assert_eq(kvr_disk_claim(d, &h[i], &err), 0, "extent %d: %s", i, err.msg);
    cr_assert_eq(kvr_disk_recover_done(d, &err), 0, "%s", err.msg);
    int ex2[5] = { 0, 0, 0, KVR_EIO, 0 };
    load_check(d, h + 2, data + 2, 5, ex2);
    finish(d, dir, data, V2N);
}

KVT_DISK_TESTS(disk_format, v2_damage, v2_damage)

/* Memory at every alignment: straight to / from the device when O_DIRECT
 * can use it, staged otherwise; the bytes are the same either way, in
 * batches that mix both (and a reopen reads them all). */
static void alignments(kvr_disk_engine e)
{
    char dir[256];
    kvr_disk *d = open_fresh(dir, sizeof dir, e);
    kvr_error err = { 0 };
    enum { N = 12 };
    static const size_t sizes[N] = { 2u << 20, 2u << 20, (2u << 20) + 1, 4096, 4097,
                                     (5u << 20) + 4000, 64u << 10, 1u << 20, 4095,
                                     (2u << 20) - 4096, 8u << 20, 123457 };
    static const size_t shift[N] = { 0, 1, 0, 512, 0, 8, 0, 4096, 3, 0, 0, 64 };
    uint8_t *raw[N], *src[N], *want[N];
    kvr_disk_buf b[N];
    kvr_disk_handle h[N];
    for (int i = 0; i < N; i++) {
        cr_assert_eq(posix_memalign((void **)&raw[i], 4096, sizes[i] + 8192), 0);
        src[i] = raw[i] + shift[i];
        kvt_fill(src[i], sizes[i], 40u + (uint64_t)i);
        want[i] = src[i];
        b[i] = (kvr_disk_buf){ .data = src[i], .len = sizes[i] };
    }
    cr_assert_eq(kvr_disk_spill(d, b, 7, h, false, &err), 0, "%s", err.msg);
    cr_assert_eq(kvr_disk_spill(d, b + 7, N - 7, h + 7, true, &err), 0, "%s", err.msg);
    /* Destinations at other alignments than the sources had. */
    for (int pass = 0; pass < 2; pass++) {
        void *dst[N];
        uint8_t *dr[N];
        int st[N];
        for (int i = 0; i < N; i++) {
            cr_assert_eq(posix_memalign((void **)&dr[i], 4096, sizes[i] + 8192), 0);
            dst[i] = dr[i] + (pass ? shift[N - 1 - i] : 0);
        }
        cr_assert_eq(kvr_disk_load(d, h, dst, N, st, &err), 0, "%s", err.msg);
        for (int i = 0; i < N; i++) {
            cr_assert_eq(st[i], 0);
            cr_assert_eq(memcmp(dst[i], want[i], sizes[i]), 0, "pass %d extent %d", pass, i);
            free(dr[i]);
        }
    }
    kvr_disk_close(d);
    d = reopen_claim_all(dir, e, h, N);
    int ok[N] = { 0 };
    load_check(d, h, want, N, ok);
    finish(d, dir, raw, N);
}

KVT_DISK_TESTS(disk_format, alignments, alignments)

/* A segment of a format newer than this build, or two files with one id
 * (an older kvrope wrote after a newer one): recovery refuses, saying why,
 * and removes nothing. */
Test(disk_format, unknown_and_duplicate_segments)
{
    for (size_t k = 0; k < sizeof engines / sizeof *engines; k++) {
        char dir[256], path[512];
        kvr_disk *d = open_fresh(dir, sizeof dir, engines[k]);
        kvr_error err = { 0 };
        kvr_disk_close(d);

        snprintf(path, sizeof path, "%s/seg-00000007.v3.dat", dir);
        int fd = open(path, O_RDWR | O_CREAT, 0644);
        cr_assert_geq(fd, 0);
        close(fd);
        cr_assert_eq(open_recovering(&d, dir, engines[k], &err), KVR_EUNSUPPORTED);
        cr_assert_not_null(strstr(err.msg, "v3"), "%s", err.msg);
        cr_assert_eq(access(path, F_OK), 0);
        unlink(path);

        kvr_disk_handle h[V1N];
        uint8_t *data[V1N];
        write_v1(dir, h, data);
        file_path(path, sizeof path, dir, 1, true);
        fd = open(path, O_RDWR | O_CREAT, 0644);
        cr_assert_geq(fd, 0);
        close(fd);
        cr_assert_eq(open_recovering(&d, dir, engines[k], &err), KVR_EUNSUPPORTED);
        cr_assert_not_null(strstr(err.msg, "two data segments"), "%s", err.msg);
        file_path(path, sizeof path, dir, 1, false);
        cr_assert_eq(access(path, F_OK), 0);
        finish(NULL, dir, data, V1N);
    }
}

/* ---- a load's last requests (smaller: disk.h, data path) ------------------------ */
/* A load whose last 8 MiB go in smaller requests than the rest, into
 * memory O_DIRECT uses directly: the bytes are those spilled; a read error
 * in any one of its requests fails only the extents that request carried
 * (the last request carries the last extent's end), loses nothing (the
 * next load has every byte); a corrupt byte in the last two extents'
 * data (one read into memory, one staged) is refused for those extents
 * alone. */
enum { TN = 6 };
static const size_t t_sizes[TN] = { 4u << 20, (3u << 20) + 5, 2u << 20, (1u << 20) + 4097,
                                    700000, 4095 };

static void t_load(kvr_disk *d, const kvr_disk_handle *h, uint8_t **want, uint8_t **dst,
                   int *st, int *rc)
{
    kvr_error err = { 0 };
    for (int i = 0; i < TN; i++)
        memset(dst[i], 0xEE, t_sizes[i]);
    *rc = kvr_disk_load(d, h, (void *const *)dst, TN, st, &err);
    for (int i = 0; i < TN; i++)
        if (st[i] == 0)
            cr_assert_eq(memcmp(dst[i], want[i], t_sizes[i]), 0, "extent %d", i);
}

static void last_requests(kvr_disk_engine e)
{
    char dir[256];
    kvr_disk *d = open_fresh(dir, sizeof dir, e);
    kvr_error err = { 0 };
    uint8_t *data[TN], *dst[TN];
    kvr_disk_buf b[TN];
    kvr_disk_handle h[TN];
    uint64_t image = 0;
    for (int i = 0; i < TN; i++) {
        cr_assert_eq(posix_memalign((void **)&data[i], 4096, t_sizes[i]), 0);
        cr_assert_eq(posix_memalign((void **)&dst[i], 4096, t_sizes[i]), 0);
        kvt_fill(data[i], t_sizes[i], 300u + (uint64_t)i);
        b[i] = (kvr_disk_buf){ .data = data[i], .len = t_sizes[i] };
        image += (32 + t_sizes[i] + 4095) & ~(uint64_t)4095;
    }
    cr_assert_eq(kvr_disk_spill(d, b, TN, h, true, &err), 0, "%s", err.msg);
    int st[TN], rc;
    kvr_disk_stats s0, s1;
    kvr_disk_get_stats(d, &s0);
    t_load(d, h, data, dst, st, &rc);
    kvr_disk_get_stats(d, &s1);
    cr_assert_eq(rc, 0);
    uint64_t nreq = s1.n_reads - s0.n_reads;
    cr_assert_geq(nreq, (image + (4u << 20) - 1) / (4u << 20));
    {
        /* One 12 MiB extent: 4 + 4 MiB, then 2, 1, 0.5 and the last 0.5
         * MiB with the tail; 4 MiB requests alone would take 4. */
        size_t big = 12u << 20;
        uint8_t *p, *q;
        cr_assert_eq(posix_memalign((void **)&p, 4096, big), 0);
        cr_assert_eq(posix_memalign((void **)&q, 4096, big), 0);
        kvt_fill(p, big, 77);
        kvr_disk_buf bb = { .data = p, .len = big };
        kvr_disk_handle hb;
        cr_assert_eq(kvr_disk_spill(d, &bb, 1, &hb, false, &err), 0, "%s", err.msg);
        kvr_disk_get_stats(d, &s0);
        void *qd = q;
        cr_assert_eq(kvr_disk_load(d, &hb, &qd, 1, NULL, &err), 0, "%s", err.msg);
        kvr_disk_get_stats(d, &s1);
        cr_assert_eq(memcmp(p, q, big), 0);
        cr_assert_eq(s1.n_reads - s0.n_reads, 6, "%llu requests",
                     (unsigned long long)(s1.n_reads - s0.n_reads));
        cr_assert_eq(kvr_disk_free(d, &hb, &err), 0, "%s", err.msg);
        free(p);
        free(q);
    }

    for (uint64_t k = 1; k <= nreq; k++) {
        kvr_disk_fault_set(d, KVR_DISK_FAULT_READ, k, EIO, 1);
        t_load(d, h, data, dst, st, &rc);
        cr_assert_eq(kvr_disk_fault_fired(d), 1, "request %llu", (unsigned long long)k);
        int failed = 0;
        for (int i = 0; i < TN; i++) {
            cr_assert(st[i] == 0 || st[i] == KVR_EIO, "request %llu extent %d: %d",
                      (unsigned long long)k, i, st[i]);
            failed += st[i] != 0;
        }
        cr_assert_eq(rc, KVR_EIO);
        cr_assert_geq(failed, 1);
        cr_assert_lt(failed, TN, "request %llu failed every extent", (unsigned long long)k);
        if (k == nreq)
            cr_assert_eq(st[TN - 1], KVR_EIO);
        kvr_disk_fault_set(d, 0, 0, 0, 0);
        t_load(d, h, data, dst, st, &rc);      /* nothing lost */
        cr_assert_eq(rc, 0, "after request %llu failed", (unsigned long long)k);
    }
    kvr_disk_close(d);

    char path[512];
    file_path(path, sizeof path, dir, h[0].seg, true);
    flip(path, h[TN - 2].off + h[TN - 2].len - 1);     /* the last granule of extent 4 */
    flip(path, h[TN - 1].off + 100);                   /* extent 5's data (staged) */
    d = reopen_claim_all(dir, e, h, TN);
    t_load(d, h, data, dst, st, &rc);
    cr_assert_eq(rc, KVR_EIO);
    for (int i = 0; i < TN; i++)
        cr_assert_eq(st[i], i >= TN - 2 ? KVR_EIO : 0, "extent %d: %d", i, st[i]);
    for (int i = 0; i < TN; i++)
        free(dst[i]);
    finish(d, dir, data, TN);
}

KVT_DISK_TESTS(disk_format, last_requests, last_requests)
