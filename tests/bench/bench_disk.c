/*
 * bench_disk.c — the disk tier's storage layer against the device it runs
 * on. In one run and one directory ($TMPDIR or /tmp; say which filesystem
 * when quoting): a plain sequential O_DIRECT write (+ one fdatasync) and
 * read of the same number of bytes (what `dd oflag=direct conv=fdatasync`
 * / `iflag=direct` measure), then spill (batched, synced: the same
 * durability as the baseline, data on stable storage at the end) and
 * reload (batched, every checksum checked, into the caller's buffers) of
 * 2 MiB blocks with each engine, and the recovery time per GiB of log.
 * Page cache is dropped before every cold read phase, the plain one
 * included (the drop makes the machine's other processes read their files
 * back: a phase right after it shares the device, so each side gets the
 * same), when /proc/sys/vm/drop_caches is writable. The device's speed
 * drifts on a shared virtual machine, so the baseline and both engines are
 * measured in KVR_BENCH_DISK_ROUNDS interleaved rounds (default 3) and
 * each ratio is the median of the per-round ratios (each round is printed
 * too: the spread is the noise); the reload goals compare each reload
 * with plain reads of the same bytes into the same memory just before and
 * after it ("side by side"), as phases seconds apart differ by more than
 * the goals' margin.
 * What the block device saw in each phase (/proc/diskstats: requests,
 * their mean size, time busy, requests in flight, flushes; other users of
 * the device included) shows what separates the layer from the baseline.
 * Never asserted; prints markdown tables and the goal lines.
 * KVR_BENCH_DISK_MB sets the size per round (default 512).
 */
#include <fcntl.h>
#include <ftw.h>
#include <stdbool.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cache/disk.h"
#include "tests/common/kvt_bench.h"

#define BLOCK (2u << 20)
#define MAX_ROUNDS 9
#define BATCH 16
#define SIDE 3

/* What the device saw during a phase (/proc/diskstats of the directory's
 * block device; all zero where it cannot be read). Other processes' I/O
 * on the same device is counted too: on a shared machine, read it as an
 * upper bound. */
typedef struct devstat {
    double   t;
    uint64_t ios, sectors, busy_ms, weighted_ms, flushes;
} devstat;

static char dev_name[64];

static void dev_find(const char *dir)
{
    struct stat st;
    if (stat(dir, &st) != 0)
        return;
    char p[128], buf[64];
    snprintf(p, sizeof p, "/sys/dev/block/%u:%u", major(st.st_dev), minor(st.st_dev));
    ssize_t n = readlink(p, buf, sizeof buf - 1);
    if (n <= 0)
        return;
    buf[n] = '\0';
    const char *b = strrchr(buf, '/');
    snprintf(dev_name, sizeof dev_name, "%s", b ? b + 1 : buf);
}

/* write: the write side (writes + flushes), else the read side. */
static devstat dev_read(int write)
{
    devstat d = { .t = kvt_now_s() };
    FILE *f = dev_name[0] ? fopen("/proc/diskstats", "r") : NULL;
    char line[512];
    while (f && fgets(line, sizeof line, f)) {
        unsigned ma, mi;
        char name[64];
        unsigned long long v[17] = { 0 };
        int got = sscanf(line, "%u %u %63s %llu %llu %llu %llu %llu %llu %llu %llu %llu %llu "
                         "%llu %llu %llu %llu %llu %llu %llu", &ma, &mi, name, &v[0], &v[1],
                         &v[2], &v[3], &v[4], &v[5], &v[6], &v[7], &v[8], &v[9], &v[10],
                         &v[11], &v[12], &v[13], &v[14], &v[15], &v[16]);
        if (got < 14 || strcmp(name, dev_name))
            continue;
        d.ios = write ? v[4] : v[0];
        d.sectors = write ? v[6] : v[2];
        d.busy_ms = v[9];
        d.weighted_ms = write ? v[7] : v[3];
        d.flushes = got >= 19 ? v[15] : 0;
    }
    if (f)
        fclose(f);
    return d;
}

/* Per-phase device figures, summed over the rounds. */
typedef struct devsum {
    double   s;
    uint64_t ios, sectors, busy_ms, weighted_ms, flushes;
} devsum;

static void dev_add(devsum *a, devstat x, devstat y)
{
    a->s += y.t - x.t;
    a->ios += y.ios - x.ios;
    a->sectors += y.sectors - x.sectors;
    a->busy_ms += y.busy_ms - x.busy_ms;
    a->weighted_ms += y.weighted_ms - x.weighted_ms;
    a->flushes += y.flushes - x.flushes;
}

static devsum dv_plain_w, dv_plain_r, dv_w[2], dv_r[2];

static void dev_print(const char *what, const devsum *a)
{
    double ms = a->s * 1e3;
    printf("| %s | %llu | %.0f | %.0f%% | %.1f | %llu |\n", what, (unsigned long long)a->ios,
           a->ios ? (double)a->sectors * 512.0 / 1024.0 / (double)a->ios : 0.0,
           ms > 0 ? 100.0 * (double)a->busy_ms / ms : 0.0,
           ms > 0 ? (double)a->weighted_ms / ms : 0.0, (unsigned long long)a->flushes);
}

/* The mean physically contiguous run (bytes) of the pages of [p, p + n),
 * from /proc/self/pagemap (frame numbers need CAP_SYS_ADMIN); 0 where it
 * cannot be read or a page is not present. A device takes a request's
 * memory in segments, one per physically contiguous run. */
static double phys_run(const void *p, size_t n)
{
    const uintptr_t pg = 4096;
    uintptr_t a = (uintptr_t)p & ~(pg - 1), e = ((uintptr_t)p + n + pg - 1) & ~(pg - 1);
    size_t np = (e - a) / pg, runs = 0;
    uint64_t *v = malloc(np * sizeof *v);
    int fd = open("/proc/self/pagemap", O_RDONLY);
    bool ok = v && fd >= 0 &&
              pread(fd, v, np * sizeof *v, (off_t)(a / pg * sizeof *v)) ==
                  (ssize_t)(np * sizeof *v);
    for (size_t i = 0; ok && i < np; i++) {
        uint64_t pfn = v[i] & ((1ull << 55) - 1);
        ok = (v[i] >> 63) && pfn;
        if (ok && (i == 0 || pfn != (v[i - 1] & ((1ull << 55) - 1)) + 1))
            runs++;
    }
    if (fd >= 0)
        close(fd);
    free(v);
    return ok && runs ? (double)n / (double)runs : 0;
}

static double pr_plain[MAX_ROUNDS], pr_layer[2][MAX_ROUNDS];    /* phys_run per round */
static int cur_round;

static int rm_one(const char *p, const struct stat *sb, int flag, struct FTW *f)
{
    (void)sb; (void)flag; (void)f;
    return remove(p);
}

static int drop_caches(void)
{
    sync();
    int fd = open("/proc/sys/vm/drop_caches", O_WRONLY);
    if (fd < 0)
        return 0;
    int ok = write(fd, "1", 1) == 1;
    close(fd);
    return ok;
}

/* dd-equivalent: O_DIRECT sequential write + fdatasync, then read. */
static void plain(const char *dir, size_t total, double *w, double *r)
{
    kvt_plain p;
    kvt_plain_open(&p, dir);
    devstat x = dev_read(1);
    *w = kvt_plain_pass(&p, total, 1);
    dev_add(&dv_plain_w, x, dev_read(1));
    drop_caches();      /* as before each reload: the same state of the machine */
    x = dev_read(0);
    *r = kvt_plain_pass(&p, total, 0);
    dev_add(&dv_plain_r, x, dev_read(0));
    pr_plain[cur_round] = phys_run(p.buf, p.chunk);
    kvt_plain_close(&p);
}

static double median(const double *v0, int n);

/* Seconds to load handles h[0..n) in batches of BATCH into dst (exits on
 * an error: a benchmark with a failing disk measures nothing). */
static double load_all(kvr_disk *d, const kvr_disk_handle *h, void **dst, size_t n)
{
    kvr_error err = { 0 };
    double t0 = kvt_now_s();
    for (size_t i = 0; i < n; i += BATCH) {
        size_t b = n - i < BATCH ? n - i : BATCH;
        if (kvr_disk_load(d, &h[i], dst, b, NULL, &err)) {
            fprintf(stderr, "bench_disk: %s\n", err.msg);
            exit(1);
        }
    }
    return kvt_now_s() - t0;
}

/* Seconds of a plain read of [off, off + len) of fd into buf, in 4 MiB
 * requests one at a time (the baseline's own pattern). */
static double plain_part(int fd, uint8_t *buf, size_t off, size_t len)
{
    size_t chunk = 4u << 20;
    double t0 = kvt_now_s();
    for (size_t o = 0; o < len; o += chunk)
        if (pread(fd, buf + o, chunk, (off_t)(off + o)) != (ssize_t)chunk)
            break;
    return kvt_now_s() - t0;
}

/* Seconds of a plain write + fdatasync of n blocks into a new file of dir
 * (O_DIRECT; extending it, as a spill extends its segment), from the
 * batch memory src, each batch of blocks in 4 MiB requests one at a time
 * (the baseline's own pattern); negative if the file cannot be made. */
static double plain_write_side(const char *dir, const uint8_t *src, size_t n)
{
    char path[512];
    snprintf(path, sizeof path, "%s/plain-side.dat", dir);
    unlink(path);
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_DIRECT, 0644);
    if (fd < 0)
        return -1;
    size_t chunk = 4u << 20;
    double t0 = kvt_now_s();
    for (size_t i = 0; i < n; i += BATCH) {
        size_t b = n - i < BATCH ? n - i : BATCH;
        for (size_t o = 0; o < b * BLOCK; o += chunk)
            if (pwrite(fd, src + o, chunk, (off_t)(i * BLOCK + o)) != (ssize_t)chunk)
                break;
    }
    fdatasync(fd);
    double t = kvt_now_s() - t0;
    close(fd);
    unlink(path);
    return t;
}

/* Seconds of a spill of n blocks from bufs in batches (synced at the end),
 * the handles into h. */
static double spill_all(kvr_disk *d, const kvr_disk_buf *bufs, size_t n, kvr_disk_handle *h)
{
    kvr_error err = { 0 };
    double t0 = kvt_now_s();
    for (size_t i = 0; i < n; i += BATCH) {
        size_t b = n - i < BATCH ? n - i : BATCH;
        if (kvr_disk_spill(d, bufs, b, &h[i], false, &err)) {
            fprintf(stderr, "bench_disk: %s\n", err.msg);
            exit(1);
        }
    }
    if (kvr_disk_sync(d, &err)) {
        fprintf(stderr, "bench_disk: %s\n", err.msg);
        exit(1);
    }
    return kvt_now_s() - t0;
}

static void spill_reload(const char *dir, kvr_disk_engine e, size_t total, double *w,
                         double *r, double *ir, double *iw, const char **name, int *cold, devsum *dw,
                         devsum *dr)
{
    char sub[512];
    snprintf(sub, sizeof sub, "%s/%s", dir, e == KVR_DISK_ENGINE_POSIX ? "posix" : "uring");
    kvr_disk_config cfg = { .dir = sub, .engine = e, .segment_bytes = 1ull << 30 };
    kvr_disk *d;
    kvr_error err = { 0 };
    if (kvr_disk_open(&d, &cfg, &err) || kvr_disk_recover(d, NULL, NULL, NULL, NULL, &err) ||
        kvr_disk_recover_done(d, &err)) {
        fprintf(stderr, "bench_disk: %s\n", err.msg);
        exit(1);
    }
    *name = kvr_disk_engine_name(d);
    size_t n = total / BLOCK;
    uint8_t *src = kvr_mem_aligned(4096, (size_t)BATCH * BLOCK);
    for (size_t i = 0; i < (size_t)BATCH * BLOCK; i++)
        src[i] = (uint8_t)(i * 131u + 7u);
    kvr_disk_handle *h = kvr_mem_malloc(n * sizeof *h);
    kvr_disk_buf bufs[BATCH];
    for (int k = 0; k < BATCH; k++)
        bufs[k] = (kvr_disk_buf){ .data = src + (size_t)k * BLOCK, .len = BLOCK };
    devstat x = dev_read(1);
    *w = (double)(n * BLOCK) / spill_all(d, bufs, n, h) / 1e9;
    dev_add(dw, x, dev_read(1));
    /* Side by side: a plain write + fdatasync of the same bytes from the
     * same memory (4 MiB requests, a new file), the spill (the layer's own
     * requests, synced at the end), and the plain write again, back to
     * back: the spill against the mean of the two plain writes around it,
     * so the device's drift over the pass cancels. The median of SIDE
     * passes; each pass's blocks are freed after it. */
    {
        kvr_disk_handle *h2 = kvr_mem_malloc(n * sizeof *h2);
        double pass_w[SIDE];
        int nw = 0;
        for (int pass = 0; h2 && pass < SIDE; pass++) {
            double p1 = plain_write_side(dir, src, n);
            double tl = spill_all(d, bufs, n, h2);
            double p2 = plain_write_side(dir, src, n);
            for (size_t i = 0; i < n; i++)
                (void)kvr_disk_free(d, &h2[i], &err);
            if (p1 > 0 && p2 > 0)
                pass_w[nw++] = (p1 + p2) / 2 / tl;
        }
        *iw = nw ? median(pass_w, nw) : 0;
        kvr_mem_free(h2);
    }
    *cold = drop_caches();
    void *dst[BATCH];
    for (int k = 0; k < BATCH; k++)
        dst[k] = src + (size_t)k * BLOCK;
    pr_layer[e == KVR_DISK_ENGINE_POSIX][cur_round] = phys_run(src, (size_t)BATCH * BLOCK);
    x = dev_read(0);
    *r = (double)(n * BLOCK) / load_all(d, h, dst, n) / 1e9;
    dev_add(dr, x, dev_read(0));
    /* Side by side: a plain read of the round's plain file (the same
     * number of bytes, 4 MiB requests one at a time) into the same memory,
     * the reload, and the plain read again, each whole and sequential as in
     * its own phase, back to back: the reload against the mean of the two
     * plain reads around it, so the device's drift over the pass cancels
     * (separate phases seconds apart differ by more than the goal's
     * margin on a shared machine). The median of SIDE passes. */
    char path[512];
    snprintf(path, sizeof path, "%s/plain.dat", dir);
    int pfd = open(path, O_RDONLY | O_DIRECT);
    double pass_r[SIDE];
    int np = 0;
    for (int pass = 0; pfd >= 0 && pass < SIDE; pass++) {
        double tp = 0;
        for (size_t i = 0; i < n; i += BATCH) {
            size_t b = n - i < BATCH ? n - i : BATCH;
            tp += plain_part(pfd, src, i * BLOCK, b * BLOCK) / 2;
        }
        double tl = load_all(d, h, dst, n);
        for (size_t i = 0; i < n; i += BATCH) {
            size_t b = n - i < BATCH ? n - i : BATCH;
            tp += plain_part(pfd, src, i * BLOCK, b * BLOCK) / 2;
        }
        pass_r[np++] = tp / tl;
    }
    *ir = np ? median(pass_r, np) : 0;
    if (pfd >= 0)
        close(pfd);
    kvr_disk_close(d);
    kvr_mem_free(h);
    kvr_mem_free(src);
}

static double recovery_ms_per_gib(const char *dir, kvr_disk_engine e, size_t log_bytes,
                                  uint64_t *nrec)
{
    char sub[512];
    snprintf(sub, sizeof sub, "%s/log-%d", dir, (int)e);
    kvr_disk_config cfg = { .dir = sub, .engine = e, .checkpoint_bytes = 1ull << 40 };
    kvr_disk *d;
    kvr_error err = { 0 };
    kvr_disk_open(&d, &cfg, &err);
    kvr_disk_recover(d, NULL, NULL, NULL, NULL, &err);
    kvr_disk_recover_done(d, &err);
    size_t rl = 16u << 10;
    uint8_t *p = kvr_mem_malloc(rl);
    memset(p, 0x33, rl);
    kvr_disk_rec_in recs[64];
    for (int k = 0; k < 64; k++)
        recs[k] = (kvr_disk_rec_in){ .type = 1, .payload = p, .len = rl };
    for (size_t w = 0; w < log_bytes; w += 64 * rl)
        if (kvr_disk_log_append(d, recs, 64, NULL, &err))
            break;
    kvr_disk_close(d);
    drop_caches();
    kvr_disk_recovery rs = { 0 };
    kvr_disk_open(&d, &cfg, &err);
    kvr_disk_recover(d, NULL, NULL, NULL, &rs, &err);
    kvr_disk_close(d);
    kvr_mem_free(p);
    *nrec = rs.records;
    return rs.ms / ((double)rs.log_bytes / (double)(1u << 30));
}

/* The CPU part of a spill / reload of `total` bytes without the device:
 * what the layer does per byte. Memory aligned for O_DIRECT (the blocks'
 * own memory, this bench's buffers): the checksum alone (copy 0); memory
 * it must stage: copy into a staging buffer + checksum (copy 1). */
static double cpu_part(size_t total, int copy)
{
    size_t n = (size_t)BATCH * BLOCK;
    uint8_t *a = kvr_mem_aligned(4096, n), *b = kvr_mem_aligned(4096, n);
    memset(a, 0x11, n);
    memset(b, 0x22, n);
    uint32_t c = 0;
    double t0 = kvt_now_s();
    for (size_t done = 0; done < total; done += n)
        for (size_t o = 0; o < n; o += 64u << 10) {
            if (copy)
                memcpy(b + o, a + o, 64u << 10);
            c ^= kvr_crc32c(0, (copy ? b : a) + o, 64u << 10);
        }
    double dt = kvt_now_s() - t0;
    if (c == 0x12345678u)
        printf("(unlikely checksum)\n");
    kvr_mem_free(a);
    kvr_mem_free(b);
    return (double)total / dt / 1e9;
}

static int dcmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Of a copy: the rounds keep their order for the per-round table. */
static double median(const double *v0, int n)
{
    double v[MAX_ROUNDS];
    memcpy(v, v0, (size_t)n * sizeof *v);
    qsort(v, (size_t)n, sizeof *v, dcmp);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

int main(void)
{
    const char *t = getenv("TMPDIR");
    int rounds = kvt_env_int("KVR_BENCH_DISK_ROUNDS", 3, 1, MAX_ROUNDS);
    size_t total = (size_t)kvt_env_int("KVR_BENCH_DISK_MB", 512, 1, 1 << 20) << 20;
    total = (total / ((size_t)BATCH * BLOCK)) * BATCH * BLOCK;
    if (!total)
        total = (size_t)BATCH * BLOCK;
    char dir[256];
    snprintf(dir, sizeof dir, "%s/kvr_bench_disk_XXXXXX", t && *t ? t : "/tmp");
    if (!mkdtemp(dir)) {
        perror("mkdtemp");
        return 1;
    }
    dev_find(dir);
    kvr_disk_engine es[2] = { KVR_DISK_ENGINE_URING, KVR_DISK_ENGINE_POSIX };
    const char *names[2] = { "io_uring", "posix" };
    double pw[MAX_ROUNDS], pr[MAX_ROUNDS], w[2][MAX_ROUNDS], r[2][MAX_ROUNDS];
    double rw[2][MAX_ROUNDS], rr[2][MAX_ROUNDS], cpu[MAX_ROUNDS], cpuc[MAX_ROUNDS];
    double ri[2][MAX_ROUNDS], wi[2][MAX_ROUNDS];
    int cold = 0;
    for (int k = 0; k < rounds; k++) {
        cur_round = k;
        plain(dir, total, &pw[k], &pr[k]);
        cpu[k] = cpu_part(total, 0);
        cpuc[k] = cpu_part(total, 1);
        for (int i = 0; i < 2; i++) {
            spill_reload(dir, es[i], total, &w[i][k], &r[i][k], &ri[i][k], &wi[i][k], &names[i], &cold,
                         &dv_w[i], &dv_r[i]);
            rw[i][k] = w[i][k] / pw[k];
            rr[i][k] = r[i][k] / pr[k];
        }
        char path[512];
        snprintf(path, sizeof path, "%s/plain.dat", dir);
        unlink(path);
    }
    printf("## bench_disk: %zu MiB x %d rounds in %s, 2 MiB blocks, batches of %d\n\n",
           total >> 20, rounds, dir, BATCH);
    printf("| what | engine | write GB/s | read GB/s | write vs plain | write vs plain, side "
           "by side | read vs plain | read vs plain, side by side | reads |\n");
    printf("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |\n");
    printf("| plain O_DIRECT sequential (dd) | - | %.2f | %.2f | 1.00 | 1.00 | 1.00 | 1.00 | "
           "cold |\n",
           median(pw, rounds), median(pr, rounds));
    double mw[2], mr[2], mside[2], mwside[2];
    for (int i = 0; i < 2; i++) {
        double a = median(w[i], rounds), b = median(r[i], rounds);
        mw[i] = median(rw[i], rounds);
        mr[i] = median(rr[i], rounds);
        mside[i] = median(ri[i], rounds);
        mwside[i] = median(wi[i], rounds);
        printf("| spill (synced) / reload (crc checked) | %s | %.2f | %.2f | %.2f | %.2f | %.2f "
               "| %.2f | %s |\n", names[i], a, b, mw[i], mwside[i], mr[i], mside[i],
               cold ? "cold" : "page cache");
    }
    double mc = median(cpu, rounds), mcc = median(cpuc, rounds);
    printf("| CPU part alone: checksum (aligned memory), no device | - | %.2f | %.2f | %.2f | "
           "- | %.2f | - | - |\n", mc, mc, mc / median(pw, rounds), mc / median(pr, rounds));
    printf("| CPU part alone: copy + checksum (staged memory), no device | - | %.2f | %.2f | "
           "%.2f | - | %.2f | - | - |\n", mcc, mcc, mcc / median(pw, rounds),
           mcc / median(pr, rounds));
    printf("\n(medians over %d rounds; ratios are medians of each round's ratio. \"write / "
           "read vs plain\": the spill / reload phase against the plain write / read phase "
           "of its round, seconds apart; \"side by side\": the median of %d passes of plain "
           "write + fdatasync, spill (synced), plain write + fdatasync (a new file each, "
           "O_DIRECT, 4 MiB requests from the same memory), or of plain read, reload, plain "
           "read of the same bytes into the same memory, back to back, the layer against "
           "the mean of the plain passes around it (the device's drift cancels; the goals "
           "use it). "
           "Block memory aligned for O_DIRECT goes between the device and memory with no "
           "copy: the layer's CPU part is one checksum pass, overlapped with the device; "
           "where it is not well above the device's rate (a loaded machine), it is what "
           "bounds the ratio.)\n", rounds, SIDE);
    printf("\nEach round (the spread is the device's and the machine's noise; the goals "
           "use the medians). Memory: the mean physically contiguous run of the read's "
           "destination, KiB (plain read / io_uring reload / posix reload; from "
           "/proc/self/pagemap, 0 where it cannot be read): a request into memory in "
           "4 KiB pieces reaches this virtio disk in up to 254-segment pieces, ~3x slower "
           "than into huge pages.\n\n| round | plain write GB/s | plain read GB/s | spill "
           "io_uring | reload io_uring | spill posix | reload posix | reload io_uring, side "
           "by side | reload posix, side by side | spill io_uring, side by side | spill posix, "
           "side by side | memory |\n| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | "
           "---: | ---: | ---: | --- |\n");
    for (int k = 0; k < rounds; k++)
        printf("| %d | %.2f | %.2f | %.2fx | %.2fx | %.2fx | %.2fx | %.2fx | %.2fx | %.2fx | "
               "%.2fx | %.0f / %.0f / %.0f |\n", k + 1, pw[k], pr[k], rw[0][k], rr[0][k],
               rw[1][k], rr[1][k], ri[0][k], ri[1][k], wi[0][k], wi[1][k], pr_plain[k] / 1024, pr_layer[0][k] / 1024,
               pr_layer[1][k] / 1024);
    printf("\nWhat the device (%s) saw, summed over the rounds (its other users' I/O "
           "included): requests, mean request size, time busy, mean requests in flight "
           "(time-weighted), cache flushes.\n\n", dev_name[0] ? dev_name : "unknown");
    printf("| phase | requests | KiB per request | busy | in flight | flushes |\n"
           "| --- | ---: | ---: | ---: | ---: | ---: |\n");
    dev_print("plain write + fdatasync", &dv_plain_w);
    dev_print("plain read", &dv_plain_r);
    for (int i = 0; i < 2; i++) {
        char what[64];
        snprintf(what, sizeof what, "spill, %s", names[i]);
        dev_print(what, &dv_w[i]);
        snprintf(what, sizeof what, "reload, %s", names[i]);
        dev_print(what, &dv_r[i]);
    }
    printf("\n| recovery | engine | records | ms per GiB of log |\n| --- | --- | ---: | ---: |\n");
    for (int i = 0; i < 2; i++) {
        uint64_t nrec;
        double ms = recovery_ms_per_gib(dir, es[i], total / 2, &nrec);
        printf("| replay of 16 KiB records | %s | %llu | %.0f |\n", names[i],
               (unsigned long long)nrec, ms);
    }
    printf("\n");
    for (int i = 0; i < 2; i++) {
        char what[64];
        snprintf(what, sizeof what, "layer, %s", names[i]);
        kvt_plain_goals(what, what, " (side by side)", mwside[i], mside[i]);
    }
    nftw(dir, rm_one, 16, FTW_DEPTH | FTW_PHYS);
    return 0;
}
