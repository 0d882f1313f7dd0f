/*
 * disk.c — the disk tier's storage layer: spill segments, the persistence
 * log with checkpoints, recovery and the failed state. disk.h documents the
 * format and the write ordering; this file keeps these invariants:
 *
 *  - Every live extent is in exactly one segment's ext[] (sorted by offset)
 *    with refs > 0; data_bytes/data_blocks are the sums over them.
 *  - Bytes of a segment are appended at seg->size only; extents never move.
 *    A segment is "dirty" while it holds writes not yet fdatasync'ed; every
 *    log append and checkpoint first makes all dirty segments (and the
 *    directory, if a segment file was created) durable.
 *  - log_size is the end of the last good record of the current generation;
 *    nothing past it is ever acknowledged.
 *  - Once failed_errno is set (an fsync failed) no write path runs again.
 *  - All mutable state is guarded by mu, except during open/recover/
 *    recover_done/close, which the caller runs alone.
 */
#include <assert.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "cache/disk.h"
#include "base/clock.h"
#include "base/le.h"

#define EXT_ALIGN     4096u
#define EXT_HDR       32u
#define REC_HDR       24u
#define MAGIC_EXT     0x5852564Bu     /* "KVRX": a v1 extent's header */
#define MAGIC_TRL     0x5452564Bu     /* "KVRT": a v2 extent's trailer */
#define FMT_V1        1u              /* seg-XXXXXXXX.dat: header, then data */
#define FMT_V2        2u              /* seg-XXXXXXXX.v2.dat: data, then trailer */
#define MAGIC_REC     0x4C52564Bu     /* "KVRL" */
#define REC_CP_BEGIN  0xFFFFFF01u
#define REC_CP_END    0xFFFFFF02u
#define READ_WINDOW   (8u << 20)
#define CP_BUF        (1u << 20)

enum { ST_OPEN = 0, ST_RECOVERING = 1, ST_READY = 2, ST_BROKEN = 3 };

typedef struct ext {
    uint64_t off, seq;
    uint32_t alloc, refs;
} ext;

typedef struct seg {
    uint32_t id;
    int      fd;
    int      dfd;           /* the same file opened O_DIRECT, or -1 */
    uint64_t size;          /* append offset */
    uint32_t fmt;           /* FMT_V1 (read only) or FMT_V2 */
    bool     dirty;
    ext     *ext;
    size_t   n_ext, cap_ext;
} seg;

struct kvr_disk {
    kvr_disk_config cfg;
    char           *dir;
    int             dirfd, lockfd, logfd;
    pthread_mutex_t mu;
    kvr_dio        *io;
    char            note[160];
    seg           **segs;           /* sorted by id */
    size_t          n_segs, cap_segs;
    seg            *active;
    uint32_t        next_seg, gen;
    bool            dir_dirty;
    uint64_t        log_size, seq;
    int             state;
    int             failed_errno;
    char            failed_msg[200];
    uint64_t        data_bytes, data_blocks;
    uint64_t        n_spills, n_loads, n_records, n_checkpoints, n_refused_full;
    uint64_t        n_quarantined, n_torn_bytes;
    bool            claim_io_failed;  /* recover_done then refuses to reclaim */
    uint8_t        *stage;          /* O_DIRECT staging (disk.h: data path) */
    size_t          stage_cap;
    size_t          mem_align;      /* O_DIRECT buffer alignment (statx), 0 = not known yet */
    kvr_disk_recovery last;
};

struct kvr_disk_cp {
    kvr_disk *d;
    int       fd;
    uint8_t  *buf;
    size_t    used;
    uint64_t  off, count;
    int       err;              /* -errno of the first failure */
};

/* ---- little helpers ---------------------------------------------------------- */
static uint64_t align_up(uint64_t n)
{
    return (n + EXT_ALIGN - 1) & ~(uint64_t)(EXT_ALIGN - 1);
}


void kvr_disk_handle_encode(const kvr_disk_handle *h, uint8_t out[KVR_DISK_HANDLE_BYTES])
{
    kvr_le32_put(out, h->seg);
    kvr_le32_put(out + 4, h->len);
    kvr_le64_put(out + 8, h->off);
    kvr_le64_put(out + 16, h->seq);
    kvr_le32_put(out + 24, h->crc);
}

void kvr_disk_handle_decode(const uint8_t in[KVR_DISK_HANDLE_BYTES], kvr_disk_handle *h)
{
    h->seg = kvr_le32_get(in);
    h->len = kvr_le32_get(in + 4);
    h->off = kvr_le64_get(in + 8);
    h->seq = kvr_le64_get(in + 16);
    h->crc = kvr_le32_get(in + 24);
}

/* An extent's header (v1, in front of the data) or trailer (v2, after it):
 * the same 32 bytes but for the magic. */
static void ext_header(uint8_t *h, uint32_t fmt, uint64_t seq, uint32_t segid,
                       uint32_t len, uint32_t dcrc, uint64_t off)
{
    uint8_t o[8];
    memset(h, 0, EXT_HDR);
    kvr_le32_put(h, fmt == FMT_V1 ? MAGIC_EXT : MAGIC_TRL);
    kvr_le64_put(h + 8, seq);
    kvr_le32_put(h + 16, segid);
    kvr_le32_put(h + 20, len);
    kvr_le32_put(h + 24, dcrc);
    kvr_le64_put(o, off);
    kvr_le32_put(h + 4, kvr_crc32c(kvr_crc32c(0, h + 8, EXT_HDR - 8), o, 8));
}

static bool ext_header_ok(const uint8_t *h, uint32_t fmt, const kvr_disk_handle *want)
{
    uint8_t o[8];
    kvr_le64_put(o, want->off);
    return kvr_le32_get(h) == (fmt == FMT_V1 ? MAGIC_EXT : MAGIC_TRL) &&
           kvr_le32_get(h + 4) == kvr_crc32c(kvr_crc32c(0, h + 8, EXT_HDR - 8), o, 8) &&
           kvr_le64_get(h + 8) == want->seq && kvr_le32_get(h + 16) == want->seg &&
           kvr_le32_get(h + 20) == want->len && kvr_le32_get(h + 24) == want->crc;
}

static void rec_header(uint8_t *h, uint64_t seq, uint32_t type, const void *p,
                       uint32_t len)
{
    kvr_le32_put(h, MAGIC_REC);
    kvr_le64_put(h + 8, seq);
    kvr_le32_put(h + 16, type);
    kvr_le32_put(h + 20, len);
    kvr_le32_put(h + 4, kvr_crc32c(kvr_crc32c(0, h + 8, REC_HDR - 8), p, len));
}

/* Marks d failed after an fsync error (never retried) and fills err. */
static int set_failed(kvr_disk *d, int neg_errno, const char *what, kvr_error *err)
{
    if (!d->failed_errno) {
        d->failed_errno = -neg_errno;
        snprintf(d->failed_msg, sizeof d->failed_msg,
                 "disk tier failed: %s returned %s; nothing later is durable, "
                 "reopen required", what, strerror(-neg_errno));
    }
    return kvr_error_set(err, KVR_EIO, "%s", d->failed_msg);
}

static int io_error(int neg_errno, const char *what, kvr_error *err)
{
    if (neg_errno == -ENOMEM)
        return kvr_error_set(err, KVR_ENOMEM, "%s: out of memory", what);
    return kvr_error_set(err, KVR_EIO, "disk %s failed: %s", what, strerror(-neg_errno));
}

/* 0 if writes may run now. */
static int writable(kvr_disk *d, kvr_error *err)
{
    if (d->failed_errno)
        return kvr_error_set(err, KVR_EIO, "%s", d->failed_msg);
    if (d->state != ST_READY)
        return kvr_error_set(err, KVR_EINVAL,
                             "disk tier not ready: recover and recover_done first");
    return 0;
}

static int fsync_dir(kvr_disk *d)
{
    return kvr_dio_fsync(d->io, d->dirfd);
}

/* ---- segments ------------------------------------------------------------------ */
static void seg_name(char *buf, size_t cap, uint32_t id, uint32_t fmt)
{
    snprintf(buf, cap, "seg-%08" PRIx32 "%s.dat", id, fmt == FMT_V1 ? "" : ".v2");
}

/* Where an extent's data and its header / trailer sit in its image. */
static size_t img_data_at(uint32_t fmt)
{
    return fmt == FMT_V1 ? EXT_HDR : 0;
}

static size_t img_hdr_at(uint32_t fmt, uint32_t len)
{
    return fmt == FMT_V1 ? 0 : len;
}

static seg *seg_find(const kvr_disk *d, uint32_t id)
{
    size_t lo = 0, hi = d->n_segs;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (d->segs[mid]->id == id)
            return d->segs[mid];
        if (d->segs[mid]->id < id)
            lo = mid + 1;
        else
            hi = mid;
    }
    return NULL;
}

/* Index of the first extent with off >= off. */
static size_t ext_lower(const seg *s, uint64_t off)
{
    size_t lo = 0, hi = s->n_ext;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (s->ext[mid].off < off)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

static ext *ext_find(const seg *s, const kvr_disk_handle *h)
{
    size_t i = ext_lower(s, h->off);
    if (i < s->n_ext && s->ext[i].off == h->off && s->ext[i].seq == h->seq &&
        s->ext[i].refs > 0)
        return &s->ext[i];
    return NULL;
}

static int ext_insert(seg *s, uint64_t off, uint64_t seq, uint32_t alloc)
{
    if (s->n_ext == s->cap_ext) {
        size_t cap = s->cap_ext ? s->cap_ext * 2 : 16;
        ext *e = kvr_mem_realloc(s->ext, cap * sizeof *e);
        if (!e)
            return -ENOMEM;
        s->ext = e;
        s->cap_ext = cap;
    }
    size_t i = ext_lower(s, off);
    memmove(&s->ext[i + 1], &s->ext[i], (s->n_ext - i) * sizeof *s->ext);
    s->ext[i] = (ext){ .off = off, .seq = seq, .alloc = alloc, .refs = 1 };
    s->n_ext++;
    return 0;
}

static void punch(int fd, uint64_t off, uint64_t len)
{
    if (len)   /* advisory: accounting does not depend on it */
        (void)fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                        (off_t)off, (off_t)len);
}

static void seg_free(seg *s)
{
    if (!s)
        return;
    if (s->fd >= 0)
        close(s->fd);
    if (s->dfd >= 0)
        close(s->dfd);
    kvr_mem_free(s->ext);
    kvr_mem_free(s);
}

/* Removes an empty, non-active segment: file and memory. */
static void seg_drop(kvr_disk *d, seg *s)
{
    char name[64];
    seg_name(name, sizeof name, s->id, s->fmt);
    (void)unlinkat(d->dirfd, name, 0);
    for (size_t i = 0; i < d->n_segs; i++)
        if (d->segs[i] == s) {
            memmove(&d->segs[i], &d->segs[i + 1], (d->n_segs - i - 1) * sizeof *d->segs);
            d->n_segs--;
            break;
        }
    seg_free(s);
}

static int seg_add(kvr_disk *d, seg *s)
{
    if (d->n_segs == d->cap_segs) {
        size_t cap = d->cap_segs ? d->cap_segs * 2 : 16;
        seg **v = kvr_mem_realloc(d->segs, cap * sizeof *v);
        if (!v)
            return -ENOMEM;
        d->segs = v;
        d->cap_segs = cap;
    }
    size_t i = d->n_segs;
    while (i > 0 && d->segs[i - 1]->id > s->id) {
        d->segs[i] = d->segs[i - 1];
        i--;
    }
    d->segs[i] = s;
    d->n_segs++;
    return 0;
}

/* openat in the directory, or the test's injected failure (KVR_DISK_FAULT_OPEN). */
static int d_openat(kvr_disk *d, const char *name, int flags, mode_t mode)
{
    int f = kvr_dio_fault(d->io, KVR_DISK_FAULT_OPEN);
    if (f) {
        errno = -f;
        return -1;
    }
    return openat(d->dirfd, name, flags, mode);
}

/* 0, or -1 with errno for an injected ftruncate/rename failure (META). */
static int d_meta(kvr_disk *d)
{
    int f = kvr_dio_fault(d->io, KVR_DISK_FAULT_META);
    if (f)
        errno = -f;
    return f ? -1 : 0;
}

/* The O_DIRECT descriptor of a segment file, or -1 (buffered I/O then).
 * The first one also tells the buffer alignment O_DIRECT wants here
 * (statx STATX_DIOALIGN, Linux 6.1; else a page): block memory aligned
 * to it goes between the device and memory with no staging copy. */
static int open_direct(kvr_disk *d, const char *name)
{
    if (d->cfg.buffered)
        return -1;
    int fd = openat(d->dirfd, name, O_RDWR | O_DIRECT | O_CLOEXEC);
    if (fd >= 0 && !d->mem_align) {
        size_t a = 4096;
#ifdef STATX_DIOALIGN
        struct statx sx;
        if (statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &sx) == 0 &&
            (sx.stx_mask & STATX_DIOALIGN) && sx.stx_dio_mem_align &&
            sx.stx_dio_mem_align <= 4096 && sx.stx_dio_offset_align <= EXT_ALIGN)
            a = sx.stx_dio_mem_align;
#endif
        d->mem_align = a;
    }
    return fd;
}

/* A fresh active segment; the old one is sealed (and dropped if empty,
 * unless keep_old: earlier requests of the batch being planned write into
 * it, and their extents are registered only after the I/O). */
static int seg_roll(kvr_disk *d, bool keep_old, kvr_error *err)
{
    seg *s = kvr_mem_calloc(1, sizeof *s);
    if (!s)
        return kvr_error_set(err, KVR_ENOMEM, "disk: out of memory");
    s->id = d->next_seg;
    s->dfd = -1;
    s->fmt = FMT_V2;            /* new segments are always written as v2 */
    char name[64];
    seg_name(name, sizeof name, s->id, s->fmt);
    s->fd = d_openat(d, name, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (s->fd < 0) {
        int e = errno;
        kvr_mem_free(s);
        return kvr_error_set(err, KVR_EIO, "disk: cannot create %s/%s: %s",
                             d->dir, name, strerror(e));
    }
    s->dfd = open_direct(d, name);
    if (seg_add(d, s) != 0) {
        (void)unlinkat(d->dirfd, name, 0);
        seg_free(s);
        return kvr_error_set(err, KVR_ENOMEM, "disk: out of memory");
    }
    d->next_seg++;
    d->dir_dirty = true;
    seg *old = d->active;
    d->active = s;
    if (old && old->n_ext == 0 && !keep_old)
        seg_drop(d, old);
    return 0;
}

/* Makes every spill so far durable (and new segment names). An error here
 * is an fsync error: the failed state. */
static int sync_dirty(kvr_disk *d, kvr_error *err)
{
    for (size_t i = 0; i < d->n_segs; i++) {
        seg *s = d->segs[i];
        if (!s->dirty)
            continue;
        int rc = kvr_dio_fsync(d->io, s->fd);
        if (rc)
            return set_failed(d, rc, "fdatasync of a data segment", err);
        s->dirty = false;
    }
    if (d->dir_dirty) {
        int rc = fsync_dir(d);
        if (rc)
            return set_failed(d, rc, "fsync of the disk directory", err);
        d->dir_dirty = false;
    }
    return 0;
}

/* ---- open / close ---------------------------------------------------------------- */
int kvr_disk_open(kvr_disk **out, const kvr_disk_config *cfg, kvr_error *err)
{
    if (!cfg || !cfg->dir || !cfg->dir[0])
        return kvr_error_set(err, KVR_EINVAL, "disk: no directory given");
    kvr_disk *d = kvr_mem_calloc(1, sizeof *d);
    if (!d)
        return kvr_error_set(err, KVR_ENOMEM, "disk: out of memory");
    d->cfg = *cfg;
    if (!d->cfg.segment_bytes)
        d->cfg.segment_bytes = 256ull << 20;
    if (!d->cfg.checkpoint_bytes)
        d->cfg.checkpoint_bytes = 64ull << 20;
    d->dirfd = d->lockfd = d->logfd = -1;
    size_t dl = strlen(cfg->dir);
    d->dir = kvr_mem_malloc(dl + 1);
    if (!d->dir) {
        kvr_mem_free(d);
        return kvr_error_set(err, KVR_ENOMEM, "disk: out of memory");
    }
    memcpy(d->dir, cfg->dir, dl + 1);
    d->cfg.dir = d->dir;
    pthread_mutex_init(&d->mu, NULL);
    int rc;
    if (mkdir(d->dir, 0755) != 0 && errno != EEXIST) {
        rc = kvr_error_set(err, KVR_EIO, "disk: cannot create %s: %s", d->dir,
                           strerror(errno));
        goto fail;
    }
    d->dirfd = open(d->dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (d->dirfd < 0) {
        rc = kvr_error_set(err, KVR_EIO, "disk: cannot open %s: %s", d->dir,
                           strerror(errno));
        goto fail;
    }
    d->lockfd = openat(d->dirfd, "LOCK", O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (d->lockfd < 0) {
        rc = kvr_error_set(err, KVR_EIO, "disk: cannot open %s/LOCK: %s", d->dir,
                           strerror(errno));
        goto fail;
    }
    if (flock(d->lockfd, LOCK_EX | LOCK_NB) != 0) {
        rc = kvr_error_set(err, KVR_EBUSY, "disk: %s is in use by another kvr_disk",
                           d->dir);
        goto fail;
    }
    rc = kvr_dio_create(&d->io, cfg->engine, cfg->queue_depth, d->note, sizeof d->note, err);
    if (rc)
        goto fail;
    d->next_seg = 1;
    *out = d;
    return 0;

fail:
    kvr_disk_close(d);
    return rc;
}

void kvr_disk_close(kvr_disk *d)
{
    if (!d)
        return;
    for (size_t i = 0; i < d->n_segs; i++)
        seg_free(d->segs[i]);
    kvr_mem_free(d->segs);
    if (d->logfd >= 0)
        close(d->logfd);
    if (d->lockfd >= 0)
        close(d->lockfd);       /* releases the flock */
    if (d->dirfd >= 0)
        close(d->dirfd);
    kvr_dio_destroy(d->io);
    free(d->stage);
    pthread_mutex_destroy(&d->mu);
    kvr_mem_free(d->dir);
    kvr_mem_free(d);
}

const char *kvr_disk_engine_name(const kvr_disk *d)
{
    return kvr_dio_name(d->io);
}

const char *kvr_disk_engine_note(const kvr_disk *d)
{
    return d->note;
}

/* ---- recovery ---------------------------------------------------------------------- */
typedef struct reader {
    kvr_dio  *io;
    int       fd;
    uint64_t  size;
    uint8_t  *buf;
    size_t    cap;
    uint64_t  w_off;
    size_t    w_len;
    int       err;
} reader;

/* n bytes at off, or NULL past the end of file (or on error: r->err). */
static const uint8_t *rd_get(reader *r, uint64_t off, size_t n)
{
    if (off > r->size || n > r->size - off)
        return NULL;
    if (off >= r->w_off && off + n <= r->w_off + r->w_len)
        return r->buf + (off - r->w_off);
    size_t want = n > READ_WINDOW ? n : READ_WINDOW;
    if (want > r->size - off)
        want = (size_t)(r->size - off);
    if (want > r->cap) {
        uint8_t *b = kvr_mem_realloc(r->buf, want);
        if (!b) {
            r->err = -ENOMEM;
            return NULL;
        }
        r->buf = b;
        r->cap = want;
    }
    kvr_dio_req q = { .fd = r->fd, .write = false, .iovcnt = 1, .off = off };
    q.iov[0].iov_base = r->buf;
    q.iov[0].iov_len = want;
    r->w_len = 0;
    int rc = kvr_dio_run(r->io, &q, 1);
    if (rc) {
        r->err = rc;
        return NULL;
    }
    r->w_off = off;
    r->w_len = want;
    return r->buf;
}

typedef struct parsed {
    uint64_t       seq;
    uint32_t       type, len;
    const uint8_t *payload;
} parsed;

/* NULL if a valid record with seq > last starts at off, else the reason. */
static const char *parse_at(reader *r, uint64_t off, uint64_t last, parsed *p)
{
    const uint8_t *h = rd_get(r, off, REC_HDR);
    if (!h)
        return "incomplete record header";
    if (kvr_le32_get(h) != MAGIC_REC)
        return "bad record magic";
    uint32_t len = kvr_le32_get(h + 20);
    if (len > KVR_DISK_MAX_RECORD)
        return "record length out of range";
    uint32_t crc = kvr_le32_get(h + 4);
    h = rd_get(r, off, REC_HDR + (size_t)len);
    if (!h)
        return "record runs past the end of the file";
    if (crc != kvr_crc32c(kvr_crc32c(0, h + 8, REC_HDR - 8), h + REC_HDR, len))
        return "record checksum mismatch";
    p->seq = kvr_le64_get(h + 8);
    p->type = kvr_le32_get(h + 16);
    p->len = len;
    p->payload = h + REC_HDR;
    if (p->seq <= last)
        return "record sequence number not increasing";
    return NULL;
}

static uint64_t find_next(reader *r, uint64_t from, uint64_t last)
{
    for (uint64_t y = from; y + REC_HDR <= r->size; y++) {
        const uint8_t *m = rd_get(r, y, 4);
        if (!m)
            return UINT64_MAX;
        if (kvr_le32_get(m) != MAGIC_REC)
            continue;
        parsed p;
        if (!parse_at(r, y, last, &p))
            return y;
        if (r->err)
            return UINT64_MAX;
    }
    return UINT64_MAX;
}

static void log_name(char *buf, size_t cap, uint32_t gen, bool tmp)
{
    snprintf(buf, cap, "log-%08" PRIx32 ".kvl%s", gen, tmp ? ".tmp" : "");
}

static int write_all(kvr_disk *d, int fd, uint64_t off, const void *p, size_t n)
{
    kvr_dio_req q = { .fd = fd, .write = true, .iovcnt = 1, .off = off };
    q.iov[0].iov_base = (void *)(uintptr_t)p;
    q.iov[0].iov_len = n;
    return kvr_dio_run(d->io, &q, 1);
}

/* Creates generation 1 holding an empty checkpoint. */
static int log_create_first(kvr_disk *d, kvr_error *err)
{
    char name[64];
    log_name(name, sizeof name, 1, false);
    int fd = d_openat(d, name, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0)
        return kvr_error_set(err, KVR_EIO, "disk: cannot create %s/%s: %s", d->dir,
                             name, strerror(errno));
    uint8_t b[2 * REC_HDR + 12];
    uint8_t *p0 = b + REC_HDR, *p1 = b + 2 * REC_HDR + 4;
    kvr_le32_put(p0, 1);
    rec_header(b, ++d->seq, REC_CP_BEGIN, p0, 4);
    kvr_le64_put(p1, 0);
    rec_header(b + REC_HDR + 4, ++d->seq, REC_CP_END, p1, 8);
    int rc = write_all(d, fd, 0, b, sizeof b);
    if (rc == 0)
        rc = kvr_dio_fsync(d->io, fd);
    if (rc == 0)
        rc = fsync_dir(d);
    if (rc) {
        close(fd);
        (void)unlinkat(d->dirfd, name, 0);
        return io_error(rc, "log creation", err);
    }
    d->logfd = fd;
    d->gen = 1;
    d->log_size = sizeof b;
    return 0;
}

static int scan_dir(kvr_disk *d, uint32_t *max_gen, kvr_error *err)
{
    int fd = dup(d->dirfd);
    DIR *dp = fd >= 0 ? fdopendir(fd) : NULL;
    if (!dp) {
        if (fd >= 0)
            close(fd);
        return kvr_error_set(err, KVR_EIO, "disk: cannot list %s: %s", d->dir,
                             strerror(errno));
    }
    rewinddir(dp);
    *max_gen = 0;
    int rc = 0;
    struct dirent *e;
    while (rc == 0 && (e = readdir(dp)) != NULL) {
        unsigned id, ver;
        char tail[8];
        size_t nl = strlen(e->d_name);
        uint32_t fmt = 0;
        if (nl == 16 && sscanf(e->d_name, "seg-%8x.da%1s", &id, tail) == 2 &&
            !strcmp(e->d_name + 12, ".dat"))
            fmt = FMT_V1;
        else if (nl == 19 && sscanf(e->d_name, "seg-%8x.v%u", &id, &ver) == 2 &&
                 !strcmp(e->d_name + 12, ".v2.dat"))
            fmt = FMT_V2;
        else if (sscanf(e->d_name, "seg-%8x.v%u.da%1s", &id, &ver, tail) == 3 && ver > 2) {
            rc = kvr_error_set(err, KVR_EUNSUPPORTED, "disk: %s/%s is a data segment of "
                               "format v%u, newer than this kvrope (it reads v1 and v2): "
                               "run the newer kvrope, or move the directory away",
                               d->dir, e->d_name, ver);
            break;
        }
        if (fmt) {
            if (seg_find(d, id)) {
                rc = kvr_error_set(err, KVR_EUNSUPPORTED, "disk: %s holds two data "
                                   "segments with id %08x (seg-%08x.dat and "
                                   "seg-%08x.v2.dat): an older kvrope wrote to this "
                                   "directory after a newer one; move one away",
                                   d->dir, id, id, id);
                break;
            }
            seg *s = kvr_mem_calloc(1, sizeof *s);
            if (!s) {
                rc = kvr_error_set(err, KVR_ENOMEM, "disk: out of memory");
                break;
            }
            s->id = id;
            s->dfd = -1;
            s->fmt = fmt;
            s->fd = d_openat(d, e->d_name, O_RDWR | O_CLOEXEC, 0);
            struct stat st;
            if (s->fd < 0 || fstat(s->fd, &st) != 0) {
                rc = kvr_error_set(err, KVR_EIO, "disk: cannot open %s/%s: %s",
                                   d->dir, e->d_name, strerror(errno));
                seg_free(s);
                break;
            }
            s->size = (uint64_t)st.st_size;
            s->dfd = open_direct(d, e->d_name);
            if (seg_add(d, s) != 0) {
                seg_free(s);
                rc = kvr_error_set(err, KVR_ENOMEM, "disk: out of memory");
                break;
            }
            if (id >= d->next_seg)
                d->next_seg = id + 1;
        } else if (sscanf(e->d_name, "log-%8x.kv%1s", &id, tail) == 2) {
            size_t l = strlen(e->d_name);
            if (l == 16 && id > *max_gen)
                *max_gen = id;
            else if (l == 20)   /* an unfinished checkpoint */
                (void)unlinkat(d->dirfd, e->d_name, 0);
        }
    }
    closedir(dp);
    return rc;
}

static int recover(kvr_disk *d, kvr_disk_record_fn on_record,
                   kvr_disk_corrupt_fn on_corrupt, void *arg,
                   kvr_disk_recovery *out, kvr_error *err)
{
    double t0 = kvr_clock_mono_msf();
    kvr_disk_recovery rs = { 0 };
    uint32_t gen = 0;
    int rc = scan_dir(d, &gen, err);
    if (rc)
        return rc;
    rs.segments = d->n_segs;
    d->state = ST_RECOVERING;   /* the record callback may claim */
    if (gen == 0) {
        rc = log_create_first(d, err);
        if (rc)
            return rc;
        goto done;
    }
    char name[64];
    log_name(name, sizeof name, gen, false);
    int fd = d_openat(d, name, O_RDWR | O_CLOEXEC, 0);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0) {
        rc = kvr_error_set(err, KVR_EIO, "disk: cannot open %s/%s: %s", d->dir, name,
                           strerror(errno));
        if (fd >= 0)
            close(fd);
        return rc;
    }
    reader r = { .io = d->io, .fd = fd, .size = (uint64_t)st.st_size };
    uint64_t pos = 0, last = 0;
    bool in_cp = false;
    while (pos < r.size) {
        parsed p;
        const char *why = parse_at(&r, pos, last, &p);
        if (r.err)
            break;
        if (why) {
            uint64_t y = find_next(&r, pos + 1, last);
            if (r.err)
                break;
            if (y == UINT64_MAX) {
                if (on_corrupt)
                    on_corrupt(arg, name, pos, r.size - pos, why);
                rs.torn_bytes = r.size - pos;
                break;
            }
            if (on_corrupt)
                on_corrupt(arg, name, pos, y - pos, why);
            rs.quarantined++;
            pos = y;
            continue;
        }
        pos += REC_HDR + (uint64_t)p.len;
        last = p.seq;
        if (p.type == REC_CP_BEGIN) {
            in_cp = true;
        } else if (p.type == REC_CP_END) {
            in_cp = false;
        } else if (p.type > KVR_DISK_REC_USER_MAX) {
            if (on_corrupt)
                on_corrupt(arg, name, pos - REC_HDR - p.len, REC_HDR + p.len,
                           "unknown internal record type");
            rs.quarantined++;
        } else {
            kvr_disk_record rec = { .type = p.type, .seq = p.seq, .payload = p.payload,
                                    .len = p.len, .in_checkpoint = in_cp };
            rs.records++;
            rs.bytes += p.len;
            if (on_record)
                on_record(arg, d, &rec);
        }
    }
    kvr_mem_free(r.buf);
    if (r.err) {
        close(fd);
        return io_error(r.err, "read of the log during recovery", err);
    }
    rs.log_bytes = r.size;
    if (rs.torn_bytes) {
        /* Cut the torn tail so appends continue after the last good record. */
        int e = d_meta(d) != 0 || ftruncate(fd, (off_t)pos) != 0 ? -errno
                                                                   : kvr_dio_fsync(d->io, fd);
        if (e) {
            close(fd);
            return io_error(e, "truncation of the torn log tail", err);
        }
    }
    d->logfd = fd;
    d->gen = gen;
    d->log_size = pos;
    d->seq = last;
    /* Older generations are superseded (a crash hit between rename and unlink). */
    for (uint32_t g = gen - 1; g >= 1 && g + 64 >= gen; g--) {
        log_name(name, sizeof name, g, false);
        (void)unlinkat(d->dirfd, name, 0);
    }

done:
    rs.ms = kvr_clock_mono_msf() - t0;
    d->n_quarantined += rs.quarantined;
    d->n_torn_bytes += rs.torn_bytes;
    d->last = rs;
    if (out)
        *out = rs;
    return 0;
}

int kvr_disk_recover(kvr_disk *d, kvr_disk_record_fn on_record,
                     kvr_disk_corrupt_fn on_corrupt, void *arg,
                     kvr_disk_recovery *out, kvr_error *err)
{
    if (d->state != ST_OPEN)
        return kvr_error_set(err, KVR_EINVAL, "disk: recover runs once, after open");
    int rc = recover(d, on_record, on_corrupt, arg, out, err);
    /* A failed recovery leaves d usable for nothing but close. */
    d->state = rc ? ST_BROKEN : ST_RECOVERING;
    return rc;
}

/* One claim, its header (when it needs one) already read into hb with
 * result io; under d->mu. */
static int claim_one(kvr_disk *d, const kvr_disk_handle *h, const uint8_t *hb, int io,
                     kvr_error *err)
{
    seg *s = seg_find(d, h->seg);
    ext *e = ext_find(s, h);
    if (e) {   /* claimed before (or earlier in this batch): one more reference */
        e->refs++;
        return 0;
    }
    if (io) {
        /* Not proof that the extent is bad: recover_done must not reclaim
         * what it could not read (a transient error would lose data). */
        d->claim_io_failed = true;
        return io_error(io, "read of an extent header", err);
    }
    if (!ext_header_ok(hb, s->fmt, h)) {
        d->n_quarantined++;
        return kvr_error_set(err, KVR_EIO, "disk: extent seg %" PRIu32 " off %" PRIu64
                             " is corrupt or not the one the handle names", h->seg, h->off);
    }
    uint64_t alloc = align_up(EXT_HDR + (uint64_t)h->len);
    size_t i = ext_lower(s, h->off);
    if ((i > 0 && s->ext[i - 1].off + s->ext[i - 1].alloc > h->off) ||
        (i < s->n_ext && h->off + alloc > s->ext[i].off))
        return kvr_error_set(err, KVR_EIO, "disk: extent seg %" PRIu32 " off %" PRIu64
                             " overlaps another", h->seg, h->off);
    if (ext_insert(s, h->off, h->seq, (uint32_t)alloc) != 0)
        return kvr_error_set(err, KVR_ENOMEM, "disk: out of memory");
    d->data_bytes += alloc;
    d->data_blocks++;
    return 0;
}

/* The checks a claim makes before reading anything; under d->mu. */
static int claim_check(kvr_disk *d, const kvr_disk_handle *h, kvr_error *err)
{
    seg *s = seg_find(d, h->seg);
    if (!s || h->off % EXT_ALIGN || h->off >= s->size)
        return kvr_error_set(err, KVR_EIO, "disk: handle seg %" PRIu32 " off %" PRIu64
                             " points at no extent", h->seg, h->off);
    /* A handle whose extent runs past the end of its segment (a truncated
     * file) names a lost extent: corrupt, not an I/O error. */
    if (h->off + EXT_HDR + (uint64_t)h->len > s->size) {
        d->n_quarantined++;
        return kvr_error_set(err, KVR_EIO, "disk: extent seg %" PRIu32 " off %" PRIu64
                             " runs past the end of its segment (%" PRIu64 " bytes): "
                             "truncated", h->seg, h->off, s->size);
    }
    return 0;
}

/* Claims in batches: the headers of a batch are read together (one engine
 * run, io_uring's queue depth in flight), so recovery does not wait for
 * one small read per block in turn (10^6 tokens took 12 s so). The
 * outcome is the sequential claims' exactly: handles are claimed in order
 * up to the first that fails. With pk (kvr_disk_claim_peek_n), each
 * extent's peeked bytes come in the same requests: its last tail_len
 * bytes of data and the trailer after them (one read: they are adjacent
 * in format v2), its first head_len bytes in a second. */
#define CLAIM_BATCH 256

static int claim_batches(kvr_disk *d, const kvr_disk_handle *h, const kvr_disk_peek *pk,
                         size_t n, size_t *claimed, kvr_error *err)
{
    size_t done = 0;
    int rc = 0;
    uint8_t *hb = NULL;
    kvr_dio_req *q = NULL;
    size_t *qi = NULL;
    pthread_mutex_lock(&d->mu);
    if (d->state != ST_RECOVERING) {
        rc = kvr_error_set(err, KVR_EINVAL, "disk: claim only between recover and recover_done");
        goto out;
    }
    /* Peeks read v2 images only, and inside the extent's data: refused
     * before anything is claimed. */
    for (size_t i = 0; pk && i < n && rc == 0; i++) {
        seg *s = seg_find(d, h[i].seg);
        if (s && s->fmt == FMT_V1)
            rc = kvr_error_set(err, KVR_EUNSUPPORTED, "disk: extent seg %" PRIu32 " off %"
                               PRIu64 " is of format v1: no peek", h[i].seg, h[i].off);
        else if (pk[i].tail_len > h[i].len || pk[i].head_len > h[i].len ||
                 (pk[i].tail_len && !pk[i].tail) || (pk[i].head_len && !pk[i].head))
            rc = kvr_error_set(err, KVR_EINVAL, "disk: a peek of %zu + %zu bytes of a "
                               "%" PRIu32 "-byte extent", pk[i].head_len, pk[i].tail_len,
                               h[i].len);
    }
    if (rc)
        goto out;
    size_t batch = n < CLAIM_BATCH ? n : CLAIM_BATCH;
    hb = kvr_mem_malloc((batch ? batch : 1) * EXT_HDR);
    q = kvr_mem_calloc(2 * (batch ? batch : 1), sizeof *q);
    qi = kvr_mem_calloc(batch ? batch : 1, sizeof *qi);
    if (!hb || !q || !qi) {
        rc = kvr_error_set(err, KVR_ENOMEM, "disk: out of memory");
        goto out;
    }
    while (done < n && rc == 0) {
        size_t base = done, end = done + batch < n ? done + batch : n, nq = 0, stop = end;
        kvr_error ce = { 0 };
        int crc = 0;
        /* The checks first, in order: the batch ends at the first failure. */
        for (size_t i = base; i < end; i++) {
            if ((crc = claim_check(d, &h[i], &ce)) != 0) {
                stop = i;
                break;
            }
            seg *s = seg_find(d, h[i].seg);
            qi[i - base] = SIZE_MAX;
            if (pk) {
                /* Read even when claimed before: the caller wants the bytes. */
                size_t tl = pk[i].tail_len;
                q[nq] = (kvr_dio_req){ .fd = s->fd, .write = false, .iovcnt = 2,
                                       .off = h[i].off + h[i].len - tl };
                q[nq].iov[0] = (struct iovec){ pk[i].tail, tl };
                q[nq].iov[1] = (struct iovec){ hb + (i - base) * EXT_HDR, EXT_HDR };
                qi[i - base] = nq++;
                if (pk[i].head_len) {
                    q[nq] = (kvr_dio_req){ .fd = s->fd, .write = false, .iovcnt = 1,
                                           .off = h[i].off };
                    q[nq++].iov[0] = (struct iovec){ pk[i].head, pk[i].head_len };
                }
                continue;
            }
            if (ext_find(s, &h[i]))
                continue;
            q[nq] = (kvr_dio_req){ .fd = s->fd, .write = false, .iovcnt = 1,
                                   .off = h[i].off + img_hdr_at(s->fmt, h[i].len) };
            q[nq].iov[0] = (struct iovec){ hb + (i - base) * EXT_HDR, EXT_HDR };
            qi[i - base] = nq++;
        }
        if (nq)
            (void)kvr_dio_run(d->io, q, nq);   /* each request's res is its own */
        for (size_t i = base; i < stop && rc == 0; i++) {
            size_t k = qi[i - base];
            int io = k == SIZE_MAX ? 0 : q[k].res;
            if (io == 0 && k != SIZE_MAX && pk && pk[i].head_len)
                io = q[k + 1].res;
            const uint8_t *th = k == SIZE_MAX ? NULL : hb + (i - base) * EXT_HDR;
            if (pk && ext_find(seg_find(d, h[i].seg), &h[i]) &&
                (io || !ext_header_ok(th, FMT_V2, &h[i]))) {
                /* Claimed before, but its peek failed or came with a
                 * trailer that is not this extent's. */
                if (io)
                    d->claim_io_failed = true;
                rc = io ? io_error(io, "read of an extent's trailer and metadata", err)
                        : kvr_error_set(err, KVR_EIO, "disk: extent seg %" PRIu32 " off %"
                                        PRIu64 " is corrupt or not the one the handle names",
                                        h[i].seg, h[i].off);
            } else {
                rc = claim_one(d, &h[i], th, io, err);
            }
            if (rc == 0)
                done++;
        }
        if (rc == 0 && stop < end) {
            rc = crc;
            if (err)
                *err = ce;
        }
    }
out:
    pthread_mutex_unlock(&d->mu);
    kvr_mem_free(hb);
    kvr_mem_free(q);
    kvr_mem_free(qi);
    if (claimed)
        *claimed = done;
    return rc;
}

int kvr_disk_claim_n(kvr_disk *d, const kvr_disk_handle *h, size_t n, size_t *claimed,
                     kvr_error *err)
{
    return claim_batches(d, h, NULL, n, claimed, err);
}

int kvr_disk_claim_peek_n(kvr_disk *d, const kvr_disk_handle *h, const kvr_disk_peek *pk,
                          size_t n, size_t *claimed, kvr_error *err)
{
    return claim_batches(d, h, pk, n, claimed, err);
}

int kvr_disk_claim(kvr_disk *d, const kvr_disk_handle *h, kvr_error *err)
{
    return kvr_disk_claim_n(d, h, 1, NULL, err);
}

int kvr_disk_recover_done(kvr_disk *d, kvr_error *err)
{
    if (d->state != ST_RECOVERING)
        return kvr_error_set(err, KVR_EINVAL, "disk: recover_done after recover only");
    if (d->claim_io_failed) {
        d->state = ST_BROKEN;
        return kvr_error_set(err, KVR_EIO, "disk: an extent could not be read during "
                             "recovery (I/O error): nothing is reclaimed; fix the disk and "
                             "restart");
    }
    bool dropped = false;
    for (size_t i = d->n_segs; i-- > 0;) {
        seg *s = d->segs[i];
        if (s->n_ext == 0) {
            seg_drop(d, s);
            dropped = true;
            continue;
        }
        uint64_t prev = 0;
        for (size_t k = 0; k < s->n_ext; k++) {
            punch(s->fd, prev, s->ext[k].off - prev);
            prev = s->ext[k].off + s->ext[k].alloc;
        }
        if (s->size > prev)
            punch(s->fd, prev, s->size - prev);
    }
    if (dropped) {
        int rc = fsync_dir(d);
        if (rc)
            return set_failed(d, rc, "fsync of the disk directory", err);
    }
    d->state = ST_READY;
    return 0;
}

/* ---- the O_DIRECT data path (disk.h: data path) -------------------------------- */
#ifndef KVR_DIO_STAGE
#define KVR_DIO_STAGE (16u << 20)    /* staging bytes per kvr_disk (a ring) */
#endif
#define DIO_REQ_MAX   (4u << 20)     /* staged bytes per request */
#define DIO_PIECE     (64u << 10)    /* copy + checksum step (stays in cache) */
#define DIO_MEM_PIECE (4u << 20)     /* most data bytes per request straight from /
                                        into block memory (several extents) */

static size_t env_kb(const char *name, size_t lo, size_t hi, size_t dflt)
{
    const char *e = getenv(name);      /* benchmarks' tuning knobs */
    long kb = e ? atol(e) : 0;
    size_t v = kb > 0 && (size_t)kb >= lo && (size_t)kb <= hi ? (size_t)kb << 10 : dflt;
    return v & ~(size_t)(EXT_ALIGN - 1);
}

static size_t dio_stage(void)
{
    static size_t a;
    if (!a)
        a = env_kb("KVR_DISK_STAGE_KB", 8, 256 << 10, KVR_DIO_STAGE);
    return a;
}

/* Bytes per direct request; KVR_DISK_DMA_PIECE_KB=0 is not accepted (the
 * default is kept), KVR_DISK_NO_DMA=1 stages every byte (comparisons). */
static size_t dio_mem_piece(void)
{
    static size_t a;
    if (!a)
        a = env_kb("KVR_DISK_DMA_PIECE_KB", 4, 64 << 10, DIO_MEM_PIECE);
    return a;
}

/* Reads in flight at once: this deep, a stream of large sequential reads
 * keeps a device busy; deeper ones made a virtio disk slower (measured:
 * bench_disk). KVR_DISK_LOAD_DEPTH overrides (1..64). */
#define DIO_LOAD_DEPTH 4u
static size_t dio_load_depth(void)
{
    static size_t a;
    if (!a) {
        const char *e = getenv("KVR_DISK_LOAD_DEPTH");
        long v = e ? atol(e) : 0;
        a = v >= 1 && v <= (long)KVR_DIO_STREAM_MAX ? (size_t)v : DIO_LOAD_DEPTH;
    }
    return a;
}

/* KVR_DISK_LOAD_TAPER=0 sends a load's last requests at full size
 * (comparisons; see ds_run_io). */
static bool dio_taper(void)
{
    static int v = -1;
    if (v < 0) {
        const char *e = getenv("KVR_DISK_LOAD_TAPER");
        v = !(e && *e == '0');
    }
    return v;
}

static bool dio_dma_off(void)
{
    static int v = -1;
    if (v < 0) {
        const char *e = getenv("KVR_DISK_NO_DMA");
        v = e && *e && *e != '0';
    }
    return v;
}

static size_t ext_alloc(const kvr_disk_handle *h)
{
    return (size_t)align_up(EXT_HDR + (uint64_t)h->len);
}

/* An extent's data in memory, in two parts (kvr_disk_buf / kvr_disk_dst):
 * data bytes [0, n) at p, the rest at t (a block's K/V, then its
 * metadata). Only p takes direct I/O; t is always staged. */
typedef struct xmem {
    uint8_t *p, *t;
    size_t   n;
} xmem;

/* Data bytes [a, a + m) of x, out of it (get) or into it (put). */
static void x_get(const xmem *x, size_t a, uint8_t *out, size_t m)
{
    if (a < x->n) {
        size_t k = x->n - a < m ? x->n - a : m;
        memcpy(out, x->p + a, k);
        out += k;
        a += k;
        m -= k;
    }
    if (m)
        memcpy(out, x->t + (a - x->n), m);
}

static void x_put(const xmem *x, size_t a, const uint8_t *in, size_t m)
{
    if (a < x->n) {
        size_t k = x->n - a < m ? x->n - a : m;
        memcpy(x->p + a, in, k);
        in += k;
        a += k;
        m -= k;
    }
    if (m)
        memcpy(x->t + (a - x->n), in, m);
}

/* The leading data bytes of a v2 extent that go straight between the
 * device and memory p (whole granules; the rest of the image is staged),
 * or 0 when p is not aligned as O_DIRECT wants or the segment is v1. */
static size_t dma_bytes(const kvr_disk *d, const seg *s, const void *p, uint32_t len)
{
    if (s->fmt != FMT_V2 || !d->mem_align || dio_dma_off() ||
        ((uintptr_t)p & (d->mem_align - 1)))
        return 0;
    return (size_t)len & ~(size_t)(EXT_ALIGN - 1);
}

/* One part of a request: image bytes [pos, pos + len) of extent k, in
 * block memory (stage NULL) or staged at stage. */
typedef struct dpart {
    size_t   k, pos, len;
    uint8_t *stage;
} dpart;

/* A ring of staging bytes and the requests in flight, oldest first (the
 * engine completes a stream in push order). A request's parts follow one
 * another in the file; its staged parts are one region [sp, sp + sl) of
 * the ring. */
typedef struct dstream {
    kvr_disk    *d;
    uint8_t     *st;
    size_t       cap, piece;    /* ring bytes; most staged bytes per request */
    kvr_dio_req  q[KVR_DIO_STREAM_MAX];
    dpart        parts[KVR_DIO_STREAM_MAX][KVR_DIO_IOV_MAX];
    size_t       np[KVR_DIO_STREAM_MAX];
    size_t       sp[KVR_DIO_STREAM_MAX], sl[KVR_DIO_STREAM_MAX];
    size_t       qh, qn, maxq, rq;
    size_t       tail;          /* end of the newest staged bytes */
    int          err;           /* first -errno (spills) */
} dstream;

/* Staging for `total` staged bytes; kept between calls. */
static int ds_init(dstream *s, kvr_disk *d, uint64_t total, bool write)
{
    memset(s, 0, offsetof(dstream, q));
    s->qh = s->qn = s->rq = s->tail = 0;
    s->err = 0;
    s->d = d;
    s->cap = total < dio_stage() ? (size_t)total : dio_stage();
    s->piece = s->cap / 2 < DIO_REQ_MAX ? s->cap / 2 : DIO_REQ_MAX;
    s->piece &= ~(size_t)(EXT_ALIGN - 1);
    /* A request of direct extents stages at most two granules of each. */
    if (s->piece < KVR_DIO_IOV_MAX * EXT_ALIGN)
        s->piece = KVR_DIO_IOV_MAX * EXT_ALIGN;
    if (s->cap < 2 * s->piece)
        s->cap = 2 * s->piece;
    s->maxq = kvr_dio_depth(d->io);
    if (!write && s->maxq > dio_load_depth())
        s->maxq = dio_load_depth();
    if (d->stage_cap < s->cap) {
        void *p = NULL;
        /* Not accounted in kvr_mem: the tier's I/O buffer (at most
         * KVR_DIO_STAGE per kvr_disk), not the store's memory. */
        /* In huge pages where it is large enough: a request's memory in
         * few physical pieces (a device takes few segments per request). */
        bool huge = s->cap >= (4u << 20);
        if (posix_memalign(&p, huge ? (2u << 20) : EXT_ALIGN, s->cap) != 0)
            return -ENOMEM;
        if (huge)
            (void)madvise(p, s->cap & ~(size_t)((2u << 20) - 1), MADV_HUGEPAGE);
        free(d->stage);
        d->stage = p;
        d->stage_cap = s->cap;
    }
    s->st = d->stage;
    return 0;
}

typedef void (*ds_done_fn)(dstream *s, size_t slot, void *arg);

/* Waits for the oldest request in flight (the engine completes a stream
 * in push order) without handling it yet: it stays at the head, its
 * staging held, until ds_reap (s->rq: such requests, 0 or 1). */
static void ds_complete(dstream *s)
{
    kvr_dio_req *r = kvr_dio_reap(s->d->io);
    size_t slot = s->qh;
    assert(r == &s->q[slot]);
    (void)r;
    if (s->q[slot].res && !s->err)
        s->err = s->q[slot].res;
    s->rq = 1;
}

/* Handles and frees the oldest request (waiting for it first unless
 * ds_complete did); done (may be NULL) sees it. */
static void ds_reap(dstream *s, ds_done_fn done, void *arg)
{
    if (!s->rq)
        ds_complete(s);
    if (done)
        done(s, s->qh, arg);
    s->qh = (s->qh + 1) % KVR_DIO_STREAM_MAX;
    s->qn--;
    s->rq = 0;
}

/* A free request slot and len contiguous staging bytes (none if len is 0:
 * NULL). When the queue is full it waits for the oldest request but
 * handles it (a load's checksum) only at the next call, after the caller
 * pushed the next request: the device is not idle while the CPU works. */
static uint8_t *ds_alloc(dstream *s, size_t len, ds_done_fn done, void *arg)
{
    for (;;) {
        if (s->qn - s->rq < s->maxq && s->qn < KVR_DIO_STREAM_MAX) {
            if (len == 0)
                return NULL;
            size_t head = SIZE_MAX;
            for (size_t i = 0; i < s->qn; i++) {
                size_t slot = (s->qh + i) % KVR_DIO_STREAM_MAX;
                if (s->sl[slot]) {
                    head = s->sp[slot];
                    break;
                }
            }
            if (head == SIZE_MAX) {
                s->tail = 0;
                return s->st;
            }
            if (s->tail > head) {
                if (s->tail + len <= s->cap)
                    return s->st + s->tail;
                if (len <= head)
                    return s->st;           /* wrap */
            } else if (s->tail + len <= head) {
                return s->st + s->tail;
            }
        }
        if (s->rq || s->qn - s->rq < s->maxq)
            ds_reap(s, done, arg);          /* handle the completed one / make room */
        else
            ds_complete(s);
    }
}

/* Builds the next request (after ds_alloc made room): ds_new, then its
 * parts in file order with ds_add (staged parts from one ds_alloc), then
 * ds_send pushes it. */
static void ds_new(dstream *s, int fd, bool write, uint64_t off)
{
    size_t slot = (s->qh + s->qn) % KVR_DIO_STREAM_MAX;
    s->q[slot] = (kvr_dio_req){ .fd = fd, .write = write, .off = off, .eof_ok = !write };
    s->np[slot] = 0;
    s->sl[slot] = 0;
}

static void ds_add(dstream *s, size_t k, size_t pos, void *p, size_t len, bool staged)
{
    size_t slot = (s->qh + s->qn) % KVR_DIO_STREAM_MAX;
    kvr_dio_req *q = &s->q[slot];
    assert((size_t)q->iovcnt < KVR_DIO_IOV_MAX);
    q->iov[q->iovcnt].iov_base = p;
    q->iov[q->iovcnt++].iov_len = len;
    s->parts[slot][s->np[slot]++] = (dpart){ .k = k, .pos = pos, .len = len,
                                             .stage = staged ? p : NULL };
    if (staged) {
        if (!s->sl[slot])
            s->sp[slot] = (size_t)((uint8_t *)p - s->st);
        s->sl[slot] = (size_t)((uint8_t *)p + len - (s->st + s->sp[slot]));
    }
}

static void ds_send(dstream *s)
{
    size_t slot = (s->qh + s->qn) % KVR_DIO_STREAM_MAX;
#ifndef NDEBUG
    /* What O_DIRECT wants, whoever allocated the memory (block memory in
     * 4 KiB or huge pages, the staging ring): the file offset and every
     * length in whole granules, every address aligned as the filesystem
     * said (statx; the ring is granule-aligned). A request that breaks it
     * would fail with EINVAL on the device, so it is a bug here. */
    {
        const kvr_dio_req *q = &s->q[slot];
        size_t ma = s->d->mem_align ? s->d->mem_align : EXT_ALIGN;
        assert(q->off % EXT_ALIGN == 0);
        for (int v = 0; v < q->iovcnt; v++) {
            assert(q->iov[v].iov_len % EXT_ALIGN == 0);
            assert((uintptr_t)q->iov[v].iov_base % ma == 0);
        }
    }
#endif
    if (s->sl[slot])
        s->tail = s->sp[slot] + s->sl[slot];
    s->qn++;
    kvr_dio_push(s->d->io, &s->q[slot]);
}

/* Stages image bytes [a, a + n) of a v2 extent (data p[len], trailer,
 * zero padding) at out, in image order: data copied and checksummed in
 * cache-sized steps into *crc (p in its two parts); the trailer (built in trl once the data's
 * checksum is complete, i.e. when first reached) after it. */
static void stage_v2(uint8_t *out, size_t a, size_t n, const xmem *p,
                     const kvr_disk_handle *h, uint32_t segid, uint32_t *crc, uint8_t *trl,
                     bool *trl_built)
{
    size_t e = a + n, len = h->len;
    while (a < e && a < len) {
        size_t m = e < len ? e - a : len - a;
        if (m > DIO_PIECE)
            m = DIO_PIECE;
        x_get(p, a, out, m);
        *crc = kvr_crc32c(*crc, out, m);
        out += m;
        a += m;
    }
    if (a < e && a < len + EXT_HDR) {
        if (!*trl_built) {
            ext_header(trl, FMT_V2, h->seq, segid, h->len, *crc, h->off);
            *trl_built = true;
        }
        size_t m = (e < len + EXT_HDR ? e : len + EXT_HDR) - a;
        memcpy(out, trl + (a - len), m);
        out += m;
        a += m;
    }
    if (a < e)
        memset(out, 0, e - a);
}

/* A run of extents [i, j) of a batch (in order ord, or 0..n if ord is
 * NULL) that go straight from / into memory: consecutive in one v2
 * segment, each aligned for O_DIRECT. */
static size_t ds_run(const kvr_disk *d, const kvr_disk_handle *hs, const size_t *ord,
                     const xmem *mem, size_t i, size_t n)
{
#define AT(x) (ord ? ord[x] : (x))
    const kvr_disk_handle *h0 = &hs[AT(i)];
    const seg *s = seg_find(d, h0->seg);
    size_t j = i + 1;
    for (; j < n; j++) {
        const kvr_disk_handle *p = &hs[AT(j - 1)], *h = &hs[AT(j)];
        if (h->seg != h0->seg || h->off != p->off + ext_alloc(p) ||
            !dma_bytes(d, s, mem[AT(j)].p, (uint32_t)mem[AT(j)].n))
            break;
    }
#undef AT
    return j;
}

/* Cuts a run's images (contiguous in the file) into requests of at most
 * dio_req_bytes() and KVR_DIO_IOV_MAX parts, whatever the extents'
 * boundaries (full-size requests: a device splits larger ones): each
 * extent's data straight from / into memory, its tail (last partial
 * granule, trailer, zeros) staged. A write checksums each data part and
 * stages each tail (its extent's checksum then complete) before the
 * request is pushed; a read's parts are checked by ld_take. crc and
 * built are per run position (writes).
 *
 * taper (a load's last run): the run's last 2 * dio_mem_piece() bytes go
 * in requests of half what is left each (down to an eighth of a piece),
 * so what is checked after the device's last completion, with nothing
 * left in flight, is a small request, not a full one: the caller waits
 * for the whole load, and every byte checked then is device time lost
 * (bench_disk). */
static void ds_run_io(dstream *w, const kvr_disk_handle *hs, const size_t *ord,
                      const xmem *mem, size_t i, size_t j, bool write, bool taper,
                      uint8_t *hdr, uint32_t *crc, bool *built, ds_done_fn done, void *arg)
{
#define AT(x) (ord ? ord[x] : (x))
    kvr_disk *d = w->d;
    const seg *s = seg_find(d, hs[AT(i)].seg);
    size_t R = dio_mem_piece();
    size_t x = i, pos = 0;
    uint64_t left = 0;      /* image bytes of the run not yet in a request */
    for (size_t q = i; q < j; q++)
        left += ext_alloc(&hs[AT(q)]);
    while (x < j && !w->err) {
        dpart plan[KVR_DIO_IOV_MAX];
        size_t room = R;
        if (taper && dio_taper() && left < 2 * (uint64_t)R) {
            uint64_t half = align_up(left / 2), lo = R / 8 > EXT_ALIGN ? R / 8 : EXT_ALIGN;
            room = (size_t)(half < lo ? lo : half < R ? half : R);
            room &= ~(size_t)(EXT_ALIGN - 1);
        }
        size_t np = 0, stg = 0, px = x, ppos = pos;
        uint64_t wo = hs[AT(x)].off + pos;
        while (px < j && room > 0 && np < KVR_DIO_IOV_MAX) {
            const kvr_disk_handle *h = &hs[AT(px)];
            size_t D = dma_bytes(d, s, mem[AT(px)].p, (uint32_t)mem[AT(px)].n);
            size_t A = ext_alloc(h), m;
            bool st = ppos >= D;
            m = (st ? A : D) - ppos;
            if (m > room)
                m = room;
            /* Staged bytes of one request fit the ring's piece (a long
             * second part, kvr_disk_buf.tail, goes over several). */
            if (st && m > w->piece - stg)
                m = w->piece - stg;
            if (m == 0)
                break;
            plan[np++] = (dpart){ .k = px, .pos = ppos, .len = m, .stage = st ? w->st : NULL };
            if (st)
                stg += m;
            ppos += m;
            room -= m;
            if (ppos == A) {
                px++;
                ppos = 0;
            }
        }
        /* The queue is empty (a batch starts): the first request carries
         * only data from memory, checksummed while it is on the device. */
        if (write && w->qn == 0 && np > 1 && !plan[0].stage) {
            np = 1;
            stg = 0;
            px = plan[0].k;
            ppos = plan[0].pos + plan[0].len;
        }
        for (size_t q = 0; q < np; q++)
            left -= plan[q].len;
        uint8_t *out = ds_alloc(w, stg, done, arg);
        if (w->err)
            break;
        ds_new(w, s->dfd, write, wo);
        bool later[KVR_DIO_IOV_MAX] = { false };
        for (size_t q = 0; q < np; q++) {
            const dpart *p = &plan[q];
            const xmem *xm = &mem[AT(p->k)];
            uint8_t *m = xm->p;
            if (!p->stage) {
                /* A data part whose extent's tail is not in this request
                 * is checksummed after the push, while on the device. */
                later[q] = write && !(q + 1 < np && plan[q + 1].k == p->k);
                if (write && !later[q])
                    crc[p->k - i] = kvr_crc32c(crc[p->k - i], m + p->pos, p->len);
                ds_add(w, p->k, p->pos, m + p->pos, p->len, false);
                continue;
            }
            if (write)
                stage_v2(out, p->pos, p->len, xm, &hs[AT(p->k)], s->id, &crc[p->k - i],
                         hdr + AT(p->k) * EXT_HDR, &built[p->k - i]);
            ds_add(w, p->k, p->pos, out, p->len, true);
            out += p->len;
        }
        ds_send(w);
        for (size_t q = 0; q < np; q++)
            if (later[q])
                crc[plan[q].k - i] = kvr_crc32c(crc[plan[q].k - i],
                                                mem[AT(plan[q].k)].p + plan[q].pos,
                                                plan[q].len);
        x = px;
        pos = ppos;
    }
#undef AT
}

/* Writes the planned extents of a batch (hs[i].seg/off/seq/len set, all in
 * v2 segments with a direct descriptor), pushing each request as soon as
 * it is ready so the device works on the earlier ones meanwhile. An
 * extent whose memory is aligned for O_DIRECT goes from that memory in
 * requests of dio_mem_piece() bytes, each one's checksum computed while
 * it is on the device; the last data piece carries the staged tail (the
 * data's last partial granule, the trailer with the checksum, zeros).
 * Other extents are staged whole, copy and checksum fused. The trailer
 * buffers hdr (n * EXT_HDR) are scratch. Returns 0 or the first -errno. */
static int spill_direct(kvr_disk *d, const kvr_disk_buf *bufs, size_t n,
                        kvr_disk_handle *hs, uint8_t *hdr)
{
    uint64_t total = 0;
    for (size_t i = 0; i < n; i++)
        total += ext_alloc(&hs[i]) - dma_bytes(d, seg_find(d, hs[i].seg), bufs[i].data,
                                              (uint32_t)bufs[i].len);
    dstream *w = kvr_mem_malloc(sizeof *w);
    xmem *mem = kvr_mem_malloc(n * sizeof *mem);
    uint32_t *crcs = kvr_mem_calloc(n, sizeof *crcs);
    bool *built = kvr_mem_calloc(n, sizeof *built);
    if (!w || !mem || !crcs || !built) {
        kvr_mem_free(w);
        kvr_mem_free(mem);
        kvr_mem_free(crcs);
        kvr_mem_free(built);
        return -ENOMEM;
    }
    for (size_t i = 0; i < n; i++)
        mem[i] = (xmem){ (uint8_t *)(uintptr_t)bufs[i].data,       /* only read */
                         (uint8_t *)(uintptr_t)bufs[i].tail, bufs[i].len };
    int rc = ds_init(w, d, total, true);
    for (size_t i = 0; i < n && !rc && !w->err;) {
        seg *s = seg_find(d, hs[i].seg);
        assert(s->fmt == FMT_V2);
        size_t alloc = ext_alloc(&hs[i]);
        size_t dma = dma_bytes(d, s, mem[i].p, (uint32_t)mem[i].n);
        if (dma) {
            size_t j = ds_run(d, hs, NULL, mem, i, n);
            ds_run_io(w, hs, NULL, mem, i, j, true, false, hdr, crcs + i, built + i, NULL, NULL);
            for (size_t x = i; x < j; x++)
                hs[x].crc = crcs[x];
            i = j;
            continue;
        }
        /* An extent staged whole (memory not aligned for O_DIRECT): copy
         * and checksum fused, in pieces. */
        uint32_t crc = 0;
        for (size_t a = 0; a < alloc && !w->err;) {
            size_t k = alloc - a < w->piece ? alloc - a : w->piece;
            uint8_t *out = ds_alloc(w, k, NULL, NULL);
            if (w->err)
                break;
            stage_v2(out, a, k, &mem[i], &hs[i], s->id, &crc, hdr + i * EXT_HDR, &built[i]);
            ds_new(w, s->dfd, true, hs[i].off + a);
            ds_add(w, i, a, out, k, true);
            ds_send(w);
            a += k;
        }
        hs[i].crc = crc;
        i++;
    }
    while (w->qn)
        ds_reap(w, NULL, NULL);
    if (!rc)
        rc = w->err;
    kvr_mem_free(w);
    kvr_mem_free(mem);
    kvr_mem_free(crcs);
    kvr_mem_free(built);
    return rc;
}

/* A load's destination: per position k of ord, the handle ord[k]'s
 * header / trailer, running checksum and first error. */
typedef struct ldst {
    kvr_disk              *d;
    const kvr_disk_handle *hs;
    const size_t          *ord;
    const xmem            *dst;
    uint8_t               *hdr;
    uint32_t              *crc;
    int                   *res;
} ldst;

/* Staged image bytes [a, a + n) of extent k (format fmt) at b: data into
 * its destination with the running checksum, the header / trailer into
 * hdr[k]; padding ignored. Image order is data order in both formats. */
static void take_staged(ldst *l, size_t k, uint32_t fmt, size_t a, const uint8_t *b, size_t n)
{
    const kvr_disk_handle *h = &l->hs[l->ord[k]];
    size_t da = img_data_at(fmt), ha = img_hdr_at(fmt, h->len), len = h->len;
    const xmem *out = &l->dst[l->ord[k]];
    size_t e = a + n;
    while (a < e) {
        size_t m;
        if (a >= da && a < da + len) {
            m = (e < da + len ? e : da + len) - a;
            if (m > DIO_PIECE)
                m = DIO_PIECE;
            x_put(out, a - da, b, m);
            l->crc[k] = kvr_crc32c(l->crc[k], b, m);
        } else if (a >= ha && a < ha + EXT_HDR) {
            m = (e < ha + EXT_HDR ? e : ha + EXT_HDR) - a;
            memcpy(l->hdr + k * EXT_HDR + (a - ha), b, m);
        } else {                        /* padding up to the next part */
            size_t nx = e;
            if (da > a && da < nx)
                nx = da;
            if (ha > a && ha < nx)
                nx = ha;
            m = nx - a;
        }
        a += m;
        b += m;
    }
}

/* A completed read: each part's bytes go to their extent (see
 * take_staged; bytes read straight into block memory are only
 * checksummed), or the error to res[k] (-EIO if the file ended before the
 * extent's image did). */
static void ld_take(dstream *s, size_t slot, void *arg)
{
    ldst *l = arg;
    const kvr_dio_req *q = &s->q[slot];
    size_t ro = 0;
    for (size_t i = 0; i < s->np[slot]; i++) {
        const dpart *p = &s->parts[slot][i];
        size_t k = p->k;
        const kvr_disk_handle *h = &l->hs[l->ord[k]];
        size_t need = EXT_HDR + (size_t)h->len;
        size_t want = p->pos >= need ? 0 : need - p->pos < p->len ? need - p->pos : p->len;
        if (l->res[k]) {
            /* already failed */
        } else if (q->res) {
            l->res[k] = q->res;
        } else if (ro + want > q->done) {
            l->res[k] = -EIO;           /* the file ended inside the extent */
        } else if (!p->stage) {         /* v2 in memory: image offset == data offset */
            l->crc[k] = kvr_crc32c(l->crc[k], l->dst[l->ord[k]].p + p->pos, p->len);
        } else {
            take_staged(l, k, seg_find(l->d, h->seg)->fmt, p->pos, p->stage, p->len);
        }
        ro += p->len;
    }
}

/* Fresh destination memory (a reload's new block buffers) would take one
 * page fault per 4 KiB in the copy out of staging; one madvise faults in
 * the whole pages of the buffer at once, while earlier reads are on the
 * device. Advisory: a kernel without MADV_POPULATE_WRITE (5.14) refuses
 * it and the copy faults as before. Only whole pages inside [p, p + n).
 * (Direct reads into the memory fault it in as they are submitted.) */
static void prefault(void *p, size_t n)
{
#ifdef MADV_POPULATE_WRITE
    static atomic_int off;
    const uintptr_t pg = 4096;
    uintptr_t a = ((uintptr_t)p + pg - 1) & ~(pg - 1), e = ((uintptr_t)p + n) & ~(pg - 1);
    if (n < (64u << 10) || e <= a || atomic_load_explicit(&off, memory_order_relaxed))
        return;
    if (madvise((void *)a, e - a, MADV_POPULATE_WRITE) != 0 && errno == EINVAL)
        atomic_store_explicit(&off, 1, memory_order_relaxed);
#else
    (void)p;
    (void)n;
#endif
}

static int ord_cmp(const void *a, const void *b, void *arg)
{
    const kvr_disk_handle *hs = arg;
    const kvr_disk_handle *x = &hs[*(const size_t *)a];
    const kvr_disk_handle *y = &hs[*(const size_t *)b];
    if (x->seg != y->seg)
        return x->seg < y->seg ? -1 : 1;
    return x->off < y->off ? -1 : x->off > y->off;
}

/* Reads the extents ord[0..nk) of hs (all in segments with a direct
 * descriptor) into dst; hdr/crc/res are per position in ord, which is
 * sorted here by segment and offset (sequential on the device). Requests
 * stay queued up to the depth / staging; each is checked (and its staged
 * bytes copied out) as it completes while the later ones are on the
 * device. A v2 extent whose destination is aligned for O_DIRECT is read
 * straight into it, in pieces of dio_mem_piece() bytes, the last with the
 * staged tail; the others (v1, unaligned) are staged whole. */
static void load_direct(kvr_disk *d, const kvr_disk_handle *hs, const xmem *dst,
                        size_t *ord, size_t nk, uint8_t *hdr, uint32_t *crc, int *res)
{
    qsort_r(ord, nk, sizeof *ord, ord_cmp, (void *)(uintptr_t)hs);
    uint64_t total = 0;
    for (size_t k = 0; k < nk; k++) {
        const kvr_disk_handle *h = &hs[ord[k]];
        total += ext_alloc(h) - dma_bytes(d, seg_find(d, h->seg), dst[ord[k]].p,
                                          (uint32_t)dst[ord[k]].n);
    }
    ldst l = { .d = d, .hs = hs, .ord = ord, .dst = dst, .hdr = hdr, .crc = crc,
               .res = res };
    dstream *r = kvr_mem_malloc(sizeof *r);
    if (!r || ds_init(r, d, total, false) != 0) {
        for (size_t k = 0; k < nk; k++)
            res[k] = -ENOMEM;
        kvr_mem_free(r);
        return;
    }
    for (size_t k = 0; k < nk;) {
        const kvr_disk_handle *h = &hs[ord[k]];
        seg *s = seg_find(d, h->seg);
        const xmem *out = &dst[ord[k]];
        size_t alloc = ext_alloc(h);
        size_t dma = dma_bytes(d, s, out->p, (uint32_t)out->n);
        if (dma) {
            size_t j = ds_run(d, hs, ord, dst, k, nk);
            ds_run_io(r, hs, ord, dst, k, j, false, j == nk, NULL, NULL, NULL, ld_take, &l);
            k = j;
            continue;
        }
        prefault(out->p, out->n);
        for (size_t a = 0; a < alloc;) {
            size_t len = alloc - a < r->piece ? alloc - a : r->piece;
            uint8_t *p = ds_alloc(r, len, ld_take, &l);
            ds_new(r, s->dfd, false, h->off + a);
            ds_add(r, k, a, p, len, true);
            ds_send(r);
            a += len;
        }
        k++;
    }
    while (r->qn)
        ds_reap(r, ld_take, &l);
    kvr_mem_free(r);
}

/* ---- spill store ------------------------------------------------------------------ */
int kvr_disk_spill(kvr_disk *d, const kvr_disk_buf *bufs, size_t n,
                   kvr_disk_handle *hs, bool sync, kvr_error *err)
{
    if (n == 0)
        return 0;
    uint64_t need = 0;
    for (size_t i = 0; i < n; i++) {
        size_t len = bufs[i].len + bufs[i].tail_len;
        if (len == 0 || len < bufs[i].len || len > KVR_DISK_MAX_EXTENT ||
            (bufs[i].tail_len && !bufs[i].tail))
            return kvr_error_set(err, KVR_EINVAL, "disk: spill of %zu + %zu bytes (1..%u "
                                 "allowed)", bufs[i].len, bufs[i].tail_len,
                                 KVR_DISK_MAX_EXTENT);
        need += align_up(EXT_HDR + (uint64_t)len);
        hs[i].len = (uint32_t)len;
    }
    uint8_t *hdr = kvr_mem_malloc(n * EXT_HDR);
    kvr_dio_req *q = kvr_mem_calloc(n, sizeof *q);
    if (!hdr || !q) {
        kvr_mem_free(hdr);
        kvr_mem_free(q);
        return kvr_error_set(err, KVR_ENOMEM, "disk: out of memory");
    }
    pthread_mutex_lock(&d->mu);
    int rc = writable(d, err);
    if (rc)
        goto out;
    if (d->cfg.max_bytes && d->data_bytes + d->log_size + need > d->cfg.max_bytes) {
        d->n_refused_full++;
        rc = kvr_error_set(err, KVR_ELIMIT, "disk tier full: %" PRIu64 " bytes used + %"
                           PRIu64 " needed > --disk-max %" PRIu64,
                           d->data_bytes + d->log_size, need, d->cfg.max_bytes);
        goto out;
    }
    bool direct = true;
    for (size_t i = 0; i < n; i++) {
        uint64_t alloc = align_up(EXT_HDR + (uint64_t)hs[i].len);
        if (!d->active || (d->active->size > 0 &&
                           d->active->size + alloc > d->cfg.segment_bytes)) {
            /* Dropping the old segment here (no registered extent yet)
             * closed the fd this batch's first writes were queued on. */
            bool batch_in_old = d->active && i > 0 && hs[i - 1].seg == d->active->id;
            rc = seg_roll(d, batch_in_old, err);
            if (rc)
                goto undo_plan;
        }
        seg *s = d->active;
        hs[i].seg = s->id;
        hs[i].off = s->size;
        hs[i].seq = ++d->seq;
        s->size += alloc;
        if (s->dfd < 0)
            direct = false;
    }
    int io;
    if (direct) {
        /* Allocate the batch's space first (extends the file): O_DIRECT
         * writes that extend a file are synchronous and serialised on
         * ext4 (the inode lock, io_uring punts them to one worker), while
         * writes inside it go to the device together. Advisory: where the
         * filesystem refuses, the writes extend the file themselves. Not
         * for the POSIX engine (one request at a time, nothing to
         * serialise): measured slower with it (interleaved A/B of spills
         * against plain writes, 8 passes: 0.84x with, 0.92x without; with
         * two I/O threads and it, 0.86x against one thread's 0.89x). */
        for (size_t i = 0, j; i < n && kvr_dio_async(d->io); i = j) {
            for (j = i + 1; j < n && hs[j].seg == hs[i].seg; j++)
                ;
            seg *s = seg_find(d, hs[i].seg);
            (void)fallocate(s->fd, 0, (off_t)hs[i].off,
                            (off_t)(hs[j - 1].off + ext_alloc(&hs[j - 1]) - hs[i].off));
        }
        io = spill_direct(d, bufs, n, hs, hdr);
    } else {
        for (size_t i = 0; i < n; i++) {
            /* Buffered: data, then the trailer (the file may end there). */
            seg *s = seg_find(d, hs[i].seg);
            hs[i].crc = kvr_crc32c(kvr_crc32c(0, bufs[i].data, bufs[i].len), bufs[i].tail,
                                   bufs[i].tail_len);
            ext_header(hdr + i * EXT_HDR, s->fmt, hs[i].seq, s->id, hs[i].len, hs[i].crc,
                       hs[i].off);
            q[i] = (kvr_dio_req){ .fd = s->fd, .write = true, .off = hs[i].off };
            int v = 0;
            if (bufs[i].len)
                q[i].iov[v++] = (struct iovec){ (void *)(uintptr_t)bufs[i].data, bufs[i].len };
            if (bufs[i].tail_len)
                q[i].iov[v++] = (struct iovec){ (void *)(uintptr_t)bufs[i].tail,
                                                bufs[i].tail_len };
            q[i].iov[v++] = (struct iovec){ hdr + i * EXT_HDR, EXT_HDR };
            q[i].iovcnt = v;
        }
        io = kvr_dio_run(d->io, q, n);
    }
    size_t reg = 0;
    if (io == 0) {
        for (; reg < n; reg++) {
            seg *s = seg_find(d, hs[reg].seg);
            if (ext_insert(s, hs[reg].off, hs[reg].seq,
                           (uint32_t)align_up(EXT_HDR + (uint64_t)hs[reg].len)) != 0) {
                io = -ENOMEM;
                break;
            }
            s->dirty = true;
            d->data_bytes += s->ext[ext_lower(s, hs[reg].off)].alloc;
            d->data_blocks++;
        }
    }
    if (io == 0 && sync) {
        rc = sync_dirty(d, err);
        if (rc)
            io = -EIO;
    }
    if (io) {
        /* All or nothing: forget this batch; its bytes are garbage. */
        for (size_t i = 0; i < n; i++) {
            seg *s = seg_find(d, hs[i].seg);
            if (!s)
                continue;
            if (i < reg) {
                size_t k = ext_lower(s, hs[i].off);
                d->data_bytes -= s->ext[k].alloc;
                d->data_blocks--;
                memmove(&s->ext[k], &s->ext[k + 1], (s->n_ext - k - 1) * sizeof *s->ext);
                s->n_ext--;
            }
            punch(s->fd, hs[i].off, align_up(EXT_HDR + (uint64_t)hs[i].len));
        }
        if (!rc)
            rc = io_error(io, "spill write", err);
        goto drop_empty;
    }
    d->n_spills += n;
    goto out;
undo_plan:
    /* A segment could not be opened mid-plan: nothing was written. */
drop_empty:
    /* Sealed segments this batch kept for itself and left empty go. */
    for (size_t i = 0; i < d->n_segs;) {
        seg *s = d->segs[i];
        if (s != d->active && s->n_ext == 0 && s->size > 0)
            seg_drop(d, s);
        else
            i++;
    }
out:
    pthread_mutex_unlock(&d->mu);
    kvr_mem_free(hdr);
    kvr_mem_free(q);
    return rc;
}

int kvr_disk_load(kvr_disk *d, const kvr_disk_handle *hs, void *const *dst,
                  size_t n, int *status, kvr_error *err)
{
    if (n == 0)
        return 0;
    kvr_disk_dst *x = kvr_mem_malloc(n * sizeof *x);
    if (!x)
        return kvr_error_set(err, KVR_ENOMEM, "disk: out of memory");
    for (size_t i = 0; i < n; i++)
        x[i] = (kvr_disk_dst){ dst[i], hs[i].len, NULL };
    int rc = kvr_disk_load_split(d, hs, x, n, status, err);
    kvr_mem_free(x);
    return rc;
}

int kvr_disk_load_split(kvr_disk *d, const kvr_disk_handle *hs, const kvr_disk_dst *dst,
                        size_t n, int *status, kvr_error *err)
{
    if (n == 0)
        return 0;
    uint8_t *hdr = kvr_mem_malloc(n * EXT_HDR);
    kvr_dio_req *q = kvr_mem_calloc(n, sizeof *q);
    size_t *map = kvr_mem_malloc(n * sizeof *map);
    xmem *xm = kvr_mem_malloc(n * sizeof *xm);
    if (!hdr || !q || !map || !xm) {
        kvr_mem_free(hdr);
        kvr_mem_free(q);
        kvr_mem_free(map);
        kvr_mem_free(xm);
        return kvr_error_set(err, KVR_ENOMEM, "disk: out of memory");
    }
    int first = 0;
    size_t nq = 0;
    uint32_t *crc = NULL;
    int *res = NULL;
    pthread_mutex_lock(&d->mu);
    if (d->state == ST_OPEN) {
        first = kvr_error_set(err, KVR_EINVAL, "disk: load before recover");
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        seg *s = seg_find(d, hs[i].seg);
        int st = 0;
        if (!s || !ext_find(s, &hs[i]))
            st = KVR_EINVAL;
        else if (dst[i].len > hs[i].len || (dst[i].len < hs[i].len && !dst[i].tail))
            st = KVR_EINVAL;
        if (status)
            status[i] = st;
        if (st) {
            if (!first && s && ext_find(s, &hs[i]))
                first = kvr_error_set(err, st, "disk: load of %" PRIu32 " bytes into a "
                                      "%zu-byte destination without a tail", hs[i].len,
                                      dst[i].len);
            else if (!first)
                first = kvr_error_set(err, st, "disk: handle seg %" PRIu32 " off %"
                                      PRIu64 " seq %" PRIu64 " is not live",
                                      hs[i].seg, hs[i].off, hs[i].seq);
            continue;
        }
        /* Buffered: the image up to the end of the header / trailer. */
        xm[i] = (xmem){ dst[i].data, dst[i].tail, dst[i].len };
        q[nq] = (kvr_dio_req){ .fd = s->fd, .write = false, .off = hs[i].off };
        int v = 0;
        if (s->fmt == FMT_V1)
            q[nq].iov[v++] = (struct iovec){ hdr + nq * EXT_HDR, EXT_HDR };
        if (dst[i].len)
            q[nq].iov[v++] = (struct iovec){ dst[i].data, dst[i].len };
        if (dst[i].len < hs[i].len)
            q[nq].iov[v++] = (struct iovec){ dst[i].tail, hs[i].len - dst[i].len };
        if (s->fmt != FMT_V1)
            q[nq].iov[v++] = (struct iovec){ hdr + nq * EXT_HDR, EXT_HDR };
        q[nq].iovcnt = v;
        map[nq++] = i;
    }
    bool direct = nq > 0;
    for (size_t k = 0; k < nq && direct; k++)
        direct = seg_find(d, hs[map[k]].seg)->dfd >= 0;
    if (direct) {
        crc = kvr_mem_calloc(nq, sizeof *crc);
        res = kvr_mem_calloc(nq, sizeof *res);
        if (!crc || !res) {
            if (!first)
                first = kvr_error_set(err, KVR_ENOMEM, "disk: out of memory");
            for (size_t k = 0; k < nq && status; k++)
                status[map[k]] = KVR_ENOMEM;
            goto out;
        }
        load_direct(d, hs, xm, map, nq, hdr, crc, res);
        for (size_t k = 0; k < nq; k++)
            q[k].res = res[k];
    } else {
        (void)kvr_dio_run(d->io, q, nq);
    }
    for (size_t k = 0; k < nq; k++) {
        size_t i = map[k];
        int st = 0;
        if (q[k].res) {
            st = KVR_EIO;
            if (!first)
                first = io_error(q[k].res, "load read", err);
        } else if (!ext_header_ok(hdr + k * EXT_HDR, seg_find(d, hs[i].seg)->fmt, &hs[i]) ||
                   (direct ? crc[k]
                           : kvr_crc32c(kvr_crc32c(0, dst[i].data, dst[i].len), dst[i].tail,
                                        hs[i].len - dst[i].len)) != hs[i].crc) {
            st = KVR_EIO;
            d->n_quarantined++;
            if (!first)
                first = kvr_error_set(err, KVR_EIO, "disk: extent seg %" PRIu32 " off %"
                                      PRIu64 " failed its checksum (quarantined)",
                                      hs[i].seg, hs[i].off);
        }
        if (status)
            status[i] = st;
    }
    d->n_loads += nq;
out:
    pthread_mutex_unlock(&d->mu);
    kvr_mem_free(hdr);
    kvr_mem_free(q);
    kvr_mem_free(map);
    kvr_mem_free(xm);
    kvr_mem_free(crc);
    kvr_mem_free(res);
    return first;
}

int kvr_disk_ref(kvr_disk *d, const kvr_disk_handle *h, kvr_error *err)
{
    pthread_mutex_lock(&d->mu);
    seg *s = seg_find(d, h->seg);
    ext *e = s ? ext_find(s, h) : NULL;
    if (e)
        e->refs++;
    pthread_mutex_unlock(&d->mu);
    return e ? 0 : kvr_error_set(err, KVR_EINVAL, "disk: ref of a handle that is not live");
}

int kvr_disk_free(kvr_disk *d, const kvr_disk_handle *h, kvr_error *err)
{
    pthread_mutex_lock(&d->mu);
    int rc = 0;
    seg *s = seg_find(d, h->seg);
    ext *e = s ? ext_find(s, h) : NULL;
    if (!e) {
        rc = kvr_error_set(err, KVR_EINVAL, "disk: free of a handle that is not live");
    } else if (--e->refs == 0) {
        d->data_bytes -= e->alloc;
        d->data_blocks--;
        punch(s->fd, e->off, e->alloc);
        size_t k = (size_t)(e - s->ext);
        memmove(&s->ext[k], &s->ext[k + 1], (s->n_ext - k - 1) * sizeof *s->ext);
        s->n_ext--;
        if (s->n_ext == 0 && s != d->active && d->state == ST_READY)
            seg_drop(d, s);
    }
    pthread_mutex_unlock(&d->mu);
    return rc;
}

int kvr_disk_sync(kvr_disk *d, kvr_error *err)
{
    pthread_mutex_lock(&d->mu);
    int rc = writable(d, err);
    if (!rc)
        rc = sync_dirty(d, err);
    pthread_mutex_unlock(&d->mu);
    return rc;
}

/* ---- log ----------------------------------------------------------------------------- */
int kvr_disk_log_append(kvr_disk *d, const kvr_disk_rec_in *recs, size_t n,
                        uint64_t *first_seq, kvr_error *err)
{
    if (n == 0)
        return 0;
    size_t total = 0;
    for (size_t i = 0; i < n; i++) {
        if (recs[i].type > KVR_DISK_REC_USER_MAX || recs[i].len > KVR_DISK_MAX_RECORD)
            return kvr_error_set(err, KVR_EINVAL, "disk: record type %" PRIu32
                                 " / length %zu out of range", recs[i].type, recs[i].len);
        total += REC_HDR + recs[i].len;
    }
    uint8_t *buf = kvr_mem_malloc(total);
    if (!buf)
        return kvr_error_set(err, KVR_ENOMEM, "disk: out of memory");
    pthread_mutex_lock(&d->mu);
    int rc = writable(d, err);
    if (rc)
        goto out;
    rc = sync_dirty(d, err);            /* data before the records naming it */
    if (rc)
        goto out;
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        if (recs[i].len)
            memcpy(buf + o + REC_HDR, recs[i].payload, recs[i].len);
        rec_header(buf + o, d->seq + 1 + i, recs[i].type, buf + o + REC_HDR,
                   (uint32_t)recs[i].len);
        o += REC_HDR + recs[i].len;
    }
    int io = write_all(d, d->logfd, d->log_size, buf, total);
    if (io) {
        /* Cut back whatever part of the batch landed; if even that fails the
         * log's tail is unknown: failed state. */
        if (d_meta(d) != 0 || ftruncate(d->logfd, (off_t)d->log_size) != 0)
            (void)set_failed(d, -errno, "ftruncate of the log after a failed write", NULL);
        rc = io_error(io, "log write", err);
        goto out;
    }
    io = kvr_dio_fsync(d->io, d->logfd);
    if (io) {
        rc = set_failed(d, io, "fdatasync of the log", err);
        goto out;
    }
    if (first_seq)
        *first_seq = d->seq + 1;
    d->seq += n;
    d->log_size += total;
    d->n_records += n;
out:
    pthread_mutex_unlock(&d->mu);
    kvr_mem_free(buf);
    return rc;
}

bool kvr_disk_log_wants_checkpoint(kvr_disk *d)
{
    pthread_mutex_lock(&d->mu);
    bool w = d->state == ST_READY && d->log_size >= d->cfg.checkpoint_bytes;
    pthread_mutex_unlock(&d->mu);
    return w;
}

static int cp_flush(kvr_disk_cp *cp)
{
    if (cp->err || cp->used == 0)
        return cp->err;
    int rc = write_all(cp->d, cp->fd, cp->off, cp->buf, cp->used);
    if (rc) {
        cp->err = rc;
        return rc;
    }
    cp->off += cp->used;
    cp->used = 0;
    return 0;
}

static int cp_put(kvr_disk_cp *cp, uint32_t type, const void *payload, size_t len)
{
    if (cp->err)
        return cp->err;
    if (REC_HDR + len > CP_BUF - cp->used && cp_flush(cp))
        return cp->err;
    uint8_t hb[REC_HDR];
    rec_header(hb, ++cp->d->seq, type, payload, (uint32_t)len);
    if (REC_HDR + len <= CP_BUF) {
        memcpy(cp->buf + cp->used, hb, REC_HDR);
        if (len)
            memcpy(cp->buf + cp->used + REC_HDR, payload, len);
        cp->used += REC_HDR + len;
        return 0;
    }
    kvr_dio_req q = { .fd = cp->fd, .write = true, .iovcnt = 2, .off = cp->off };
    q.iov[0].iov_base = hb;
    q.iov[0].iov_len = REC_HDR;
    q.iov[1].iov_base = (void *)(uintptr_t)payload;
    q.iov[1].iov_len = len;
    int rc = kvr_dio_run(cp->d->io, &q, 1);
    if (rc)
        return cp->err = rc;
    cp->off += REC_HDR + len;
    return 0;
}

int kvr_disk_cp_add(kvr_disk_cp *cp, uint32_t type, const void *payload, size_t len)
{
    if (type > KVR_DISK_REC_USER_MAX || len > KVR_DISK_MAX_RECORD)
        return KVR_EINVAL;
    if (cp_put(cp, type, payload, len))
        return KVR_EIO;
    cp->count++;
    return 0;
}

int kvr_disk_checkpoint(kvr_disk *d, kvr_disk_snapshot_fn fn, void *arg, kvr_error *err)
{
    pthread_mutex_lock(&d->mu);
    kvr_disk_cp cp = { .d = d, .fd = -1 };
    char tmp[64], fin[64], old[64];
    log_name(tmp, sizeof tmp, d->gen + 1, true);
    log_name(fin, sizeof fin, d->gen + 1, false);
    log_name(old, sizeof old, d->gen, false);
    int rc = writable(d, err);
    if (rc)
        goto out;
    rc = sync_dirty(d, err);
    if (rc)
        goto out;
    cp.buf = kvr_mem_malloc(CP_BUF);
    if (!cp.buf) {
        rc = kvr_error_set(err, KVR_ENOMEM, "disk: out of memory");
        goto out;
    }
    cp.fd = d_openat(d, tmp, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (cp.fd < 0) {
        rc = kvr_error_set(err, KVR_EIO, "disk: cannot create %s/%s: %s", d->dir, tmp,
                           strerror(errno));
        goto out;
    }
    uint8_t g[8];
    kvr_le32_put(g, d->gen + 1);
    cp_put(&cp, REC_CP_BEGIN, g, 4);
    int frc = fn(arg, &cp);
    if (frc) {
        rc = kvr_error_set(err, frc < 0 ? frc : KVR_EINTERNAL,
                           "disk: checkpoint snapshot aborted (%d)", frc);
        goto out_unlink;
    }
    kvr_le64_put(g, cp.count);
    cp_put(&cp, REC_CP_END, g, 8);
    if (cp_flush(&cp)) {
        rc = io_error(cp.err, "checkpoint write", err);
        goto out_unlink;
    }
    int io = kvr_dio_fsync(d->io, cp.fd);
    if (io) {
        rc = set_failed(d, io, "fdatasync of a checkpoint", err);
        goto out_unlink;
    }
    if (d_meta(d) != 0 || renameat(d->dirfd, tmp, d->dirfd, fin) != 0) {
        rc = kvr_error_set(err, KVR_EIO, "disk: rename of %s failed: %s", tmp,
                           strerror(errno));
        goto out_unlink;
    }
    io = fsync_dir(d);
    if (io) {
        /* The rename may or may not be durable: either generation is a
         * complete state, but which one we cannot say. */
        rc = set_failed(d, io, "fsync of the directory after a checkpoint", err);
        close(cp.fd);
        cp.fd = -1;
        goto out;
    }
    close(d->logfd);
    (void)unlinkat(d->dirfd, old, 0);
    d->logfd = cp.fd;
    cp.fd = -1;
    d->gen++;
    d->log_size = cp.off;
    d->n_checkpoints++;
    goto out;

out_unlink:
    close(cp.fd);
    cp.fd = -1;
    (void)unlinkat(d->dirfd, tmp, 0);
out:
    if (cp.fd >= 0)
        close(cp.fd);
    kvr_mem_free(cp.buf);
    pthread_mutex_unlock(&d->mu);
    return rc;
}

/* ---- stats / faults ---------------------------------------------------------------- */
void kvr_disk_get_stats(kvr_disk *d, kvr_disk_stats *out)
{
    pthread_mutex_lock(&d->mu);
    memset(out, 0, sizeof *out);
    out->engine = kvr_dio_name(d->io);
    out->data_bytes = d->data_bytes;
    out->data_blocks = d->data_blocks;
    out->segments = d->n_segs;
    out->log_bytes = d->log_size;
    out->max_bytes = d->cfg.max_bytes;
    kvr_dio_counts(d->io, &out->n_writes, &out->n_reads, &out->n_fsyncs,
                   &out->bytes_written, &out->bytes_read);
    out->n_spills = d->n_spills;
    out->n_loads = d->n_loads;
    out->n_records = d->n_records;
    out->n_checkpoints = d->n_checkpoints;
    out->n_refused_full = d->n_refused_full;
    out->n_quarantined = d->n_quarantined;
    out->n_torn_bytes = d->n_torn_bytes;
    out->failed = d->failed_errno != 0;
    out->last_recovery = d->last;
    pthread_mutex_unlock(&d->mu);
}

void kvr_disk_fault_set(kvr_disk *d, unsigned ops, uint64_t nth, int err_no,
                        uint64_t count)
{
    pthread_mutex_lock(&d->mu);
    kvr_dio_fault_set(d->io, ops, nth, err_no, count);
    pthread_mutex_unlock(&d->mu);
}

uint64_t kvr_disk_fault_fired(const kvr_disk *d)
{
    return kvr_dio_fault_fired(d->io);
}
