/*
 * disk.h — the storage layer of kvrope's disk tier (private to cache/).
 *
 * Two things live in one directory (--disk-dir):
 *
 *  1. A spill store for block bytes. kvr_disk_spill() writes opaque byte
 *     strings (a block's data, any size) and returns handles; kvr_disk_load()
 *     reads them back bit-exact (checksummed); kvr_disk_free() releases them.
 *     Space: append-only segment files. A freed extent's space is returned to
 *     the filesystem at once with fallocate(PUNCH_HOLE) (offsets of live
 *     extents never move, so handles stay valid without compaction); a sealed
 *     segment with no live extent is unlinked. --disk-max (max_bytes) bounds
 *     live data + log bytes; a spill that would pass it fails with KVR_ELIMIT
 *     and the caller drops instead of spilling.
 *
 *  2. A persistence log of metadata records: (type, opaque payload) pairs
 *     that the store defines (MODEL, CTX_CREATE, CTX_TOKENS, CTX_EDIT,
 *     CTX_DELETE, BLOCK_REF, ...). kvr_disk_log_append() returns 0 only after
 *     the record and every spill written before it are on stable storage.
 *     kvr_disk_checkpoint() writes a snapshot (the store supplies its records)
 *     as a new log generation and drops the old one.
 *
 * ---- on-disk format (all integers little-endian) ----------------------------
 *
 *  LOCK                  flock()ed while open: one process per directory.
 *  seg-XXXXXXXX.v2.dat   data segments of format v2 (what this version
 *                        writes), XXXXXXXX = segment id (hex). Extents
 *                        start at 4096-byte boundaries:
 *      0    data[len]
 *      len  the trailer, 32 bytes:
 *           0 u32 magic "KVRT"   4 u32 tcrc = crc32c(bytes 8..31, then u64 offset)
 *           8 u64 seq           16 u32 segment id   20 u32 len
 *          24 u32 dcrc = crc32c(data)              28 u32 zero
 *      then zero padding up to the next 4096 boundary (a file written
 *      buffered may end at the trailer). An extent takes
 *      align_up(len + 32, 4096) bytes, as in v1: the data's whole granules
 *      sit at the extent's start, so they go between the device and block
 *      memory directly (O_DIRECT), and only the last partial granule and
 *      the trailer are staged.
 *  seg-XXXXXXXX.dat      data segments of format v1 (kvrope before the
 *                        v2 layout): the same 32 bytes as a header in front
 *                        (magic "KVRX", hcrc over bytes 8..31 and the
 *                        offset), data from byte 32, zero padding. Still
 *                        recovered and read; never written again (after a
 *                        restart every spill goes to a new segment, so an
 *                        upgraded directory drains its v1 segments as their
 *                        extents are freed). A segment file of a newer
 *                        format (seg-XXXXXXXX.vN.dat, N > 2) or two files
 *                        with one id refuse the open with KVR_EUNSUPPORTED
 *                        and the reason; nothing is removed. An older
 *                        kvrope does not see v2 files (their contexts are
 *                        lost to it): no downgrade.
 *  log-XXXXXXXX.kvl      the log of generation XXXXXXXX; only the highest
 *                        generation counts. Records are packed back to back:
 *      0  u32 magic "KVRL"   4 u32 crc = crc32c(bytes 8..23 + payload)
 *      8  u64 seq           16 u32 type          20 u32 len
 *     24  payload[len]
 *    A generation starts with CP_BEGIN, the snapshot records, CP_END; then
 *    appended records. Sequence numbers are strictly increasing in a file
 *    (one counter for records and extents).
 *  log-XXXXXXXX.kvl.tmp  a checkpoint being written; ignored and removed.
 *
 * ---- data path --------------------------------------------------------------
 *
 *  Spills and loads go through a second descriptor of each segment opened
 *  with O_DIRECT (unless cfg.buffered, or the filesystem refuses it: then
 *  the page cache; the bytes on disk are the same either way, so either
 *  reads what the other wrote). A batch's extents lie back to back in the
 *  file; a run of them whose memory is aligned as O_DIRECT wants (statx
 *  STATX_DIOALIGN; a page where unknown) is cut into requests of 4 MiB
 *  whatever the extents' boundaries (a device splits larger ones), each
 *  an iovec of block memory (the data's whole granules, no copy) and of
 *  staged tails (the last partial granule, trailer, zeros) from an aligned
 *  ring (KVR_DIO_STAGE = 16 MiB at most per kvr_disk, kept between calls,
 *  sized to the call's staged bytes). A spill checksums each request's
 *  data before pushing it (kvr_dio_push) while the earlier ones are on the
 *  device, or just after when its extent's trailer is in a later request;
 *  a load checks each request's data as it completes while the later ones
 *  are on the device. Memory that is not aligned (and v1 extents) is
 *  staged whole, copy and checksum fused, 4 MiB pieces. Before its writes
 *  a spill allocates the batch's space (fallocate, io_uring only): on
 *  ext4 an O_DIRECT write that extends the file is synchronous and
 *  serialised on the inode, writes inside it go to the device together.
 *  Loads keep at most 4 reads in flight (deeper made a virtio disk
 *  slower), sorted by segment and offset; once less than 8 MiB of a load
 *  are left, each request takes half of what is left (down to 0.5 MiB),
 *  so the check that runs after the last completion, with the device
 *  idle, covers about 0.5 MiB, not 4. Every request's offset and lengths are whole granules and its
 *  addresses aligned as statx said (asserted in debug builds): memory of
 *  either page size qualifies; physically contiguous memory (huge pages)
 *  reaches a device in fewer, larger segments (bench_disk prints the
 *  destination's physical runs). Durability is unchanged:
 *  O_DIRECT writes are made durable by the same fdatasync as before.

 * ---- write ordering (why a crash leaves the old state or the new) -----------
 *
 *  spill:      write(header+data+padding) at the segment tail. Not durable yet.
 *  log_append: (1) fdatasync every segment written since the last sync (and
 *              the directory once a new segment file exists), (2) write the
 *              record at the log tail, (3) fdatasync the log, (4) return 0.
 *              A crash before (3) completes leaves at most a torn or complete
 *              last record: recovery's checksum rejects the torn one and
 *              truncates the tail there. So every record that points at data
 *              finds it durable, and a record is all there or not at all.
 *  checkpoint: (1) sync data as above, (2) write log-(G+1).kvl.tmp: CP_BEGIN,
 *              the snapshot, CP_END, (3) fsync it, (4) rename to
 *              log-(G+1).kvl, (5) fsync the directory, (6) unlink log-G.
 *              Before (4) is durable, recovery sees generation G (old state);
 *              after, G+1, which is complete because (3) preceded (4).
 *  errors:     an fsync error is never retried: the layer is marked failed
 *              and every later write/sync/append/checkpoint returns KVR_EIO
 *              until it is closed and reopened. A failed write (ENOSPC, EIO)
 *              fails that call with KVR_EIO; the log tail is cut back to the
 *              last good record (if that fails too: failed state). A call
 *              that returned an error may or may not have reached the disk,
 *              exactly like a crash: the caller must not report it as done.
 *
 * ---- recovery -----------------------------------------------------------------
 *
 *  kvr_disk_open() -> kvr_disk_recover(cb) -> kvr_disk_claim() for every
 *  handle the store keeps -> kvr_disk_recover_done(). recover replays the
 *  highest generation in sequence order, handing each valid record to the
 *  callback. A corrupt record (bad magic/crc/len, seq not increasing) is
 *  reported with its offset and the reason, counted and skipped: the reader
 *  resynchronises on the next valid record. If none follows, the bytes are a
 *  torn tail: reported and truncated. recover_done unlinks segments nobody
 *  claimed and punches holes between claimed extents, unless a claim could
 *  not read its extent (an I/O error, not a mismatch): then it reclaims
 *  nothing and fails with KVR_EIO, so a transient error never loses data. Spills, appends and
 *  checkpoints are refused until recover_done.
 *
 * ---- threading ----------------------------------------------------------------
 *
 *  open/recover/recover_done/close: one thread, while nothing else uses d.
 *  Every other kvr_disk_* call is thread-safe: calls are serialised by one
 *  mutex inside d (the io_uring ring is shared), so the loop thread and any
 *  worker may call them; the I/O of large loads therefore holds that mutex —
 *  call spill/load/append from worker threads, not from the loop.
 *  Callbacks (record, corrupt, snapshot) run on the calling thread; a
 *  snapshot callback may call only kvr_disk_cp_add.
 *
 * ---- store integration (the next step) -----------------------------------------
 *
 *  - daemon: --disk-dir/--disk-max/--disk-engine -> kvr_disk_config; open and
 *    recover before accepting connections; log the engine name.
 *  - eviction: instead of dropping an unleased block, kvr_disk_spill() it on a
 *    worker, keep the handle in kvr_block (data == NULL means "on disk"),
 *    free the memory; KVR_ELIMIT/KVR_EIO -> drop as today. get/match on a
 *    spilled block: kvr_disk_load() (batch: the rest of the context as a
 *    prefetch) into fresh block memory, then kvr_disk_free() or keep the
 *    handle as a clean copy. Block unref of a spilled block -> kvr_disk_free.
 *  - persistence: encode MODEL / CTX_CREATE / CTX_TOKENS / CTX_EDIT /
 *    CTX_DELETE / BLOCK_REF (payload carries kvr_disk_handle_encode()) as
 *    records; a persistent put spills its blocks (kvr_disk_spill) and then
 *    appends its records; the put is acknowledged only when log_append
 *    returned 0. Blocks shared between contexts: kvr_disk_ref().
 *  - checkpoint when kvr_disk_log_wants_checkpoint(): the snapshot callback
 *    writes the live persistent state (models, contexts, BLOCK_REFs).
 *  - recovery callback rebuilds models/contexts, kvr_disk_claim()s each
 *    BLOCK_REF it keeps; contexts whose blocks fail to load are dropped.
 *  - stats: kvr_disk_get_stats() into kvr_store_stats (per-tier bytes/blocks,
 *    hit rates counted by the store).
 */
#ifndef KVR_DISK_H
#define KVR_DISK_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "cache/cache.h"
#include "base/crc32c.h"

typedef struct kvr_disk kvr_disk;
typedef struct kvr_disk_cp kvr_disk_cp;

typedef enum kvr_disk_engine {
    KVR_DISK_ENGINE_AUTO  = 0,   /* io_uring, POSIX if the kernel refuses it */
    KVR_DISK_ENGINE_URING = 1,   /* io_uring or fail */
    KVR_DISK_ENGINE_POSIX = 2,   /* pread/pwrite/fdatasync (forced fallback) */
} kvr_disk_engine;

typedef struct kvr_disk_config {
    const char     *dir;            /* created if missing */
    uint64_t        max_bytes;      /* --disk-max: live data + log; 0 = none */
    kvr_disk_engine engine;
    uint64_t        segment_bytes;  /* new segment past this size; 0 = 256 MiB */
    uint32_t        queue_depth;    /* io_uring entries; 0 = 64 */
    uint64_t        checkpoint_bytes; /* log size that wants a checkpoint;
                                         0 = 64 MiB */
    bool            buffered;       /* no O_DIRECT for spills and loads (used
                                       anyway where the filesystem refuses it) */
} kvr_disk_config;

/* Where a spilled byte string lives. Plain data: copy it freely; persist it
 * with kvr_disk_handle_encode (KVR_DISK_HANDLE_BYTES bytes). */
typedef struct kvr_disk_handle {
    uint32_t seg;       /* segment id */
    uint32_t len;       /* payload bytes */
    uint64_t off;       /* extent offset in the segment */
    uint64_t seq;       /* sequence number written with it */
    uint32_t crc;       /* crc32c of the payload */
} kvr_disk_handle;

#define KVR_DISK_HANDLE_BYTES 28u
#define KVR_DISK_MAX_EXTENT   0xFFFF0000u      /* bytes per spill */
#define KVR_DISK_MAX_RECORD   (256u << 20)     /* payload bytes per record */
#define KVR_DISK_REC_USER_MAX 0x7FFFFFFFu      /* record types above: internal */

void kvr_disk_handle_encode(const kvr_disk_handle *h, uint8_t out[KVR_DISK_HANDLE_BYTES]);
void kvr_disk_handle_decode(const uint8_t in[KVR_DISK_HANDLE_BYTES], kvr_disk_handle *h);

/* ---- lifetime ---------------------------------------------------------------- */
/* Opens (creating) cfg->dir, locks it (KVR_EBUSY if another kvr_disk holds
 * it), picks the engine. *out is the caller's until kvr_disk_close. */
int  kvr_disk_open(kvr_disk **out, const kvr_disk_config *cfg, kvr_error *err);
void kvr_disk_close(kvr_disk *d);                   /* NULL is a no-op */
/* "io_uring" or "posix" (static string); "posix (io_uring refused: ...)" is
 * available as kvr_disk_engine_note. */
const char *kvr_disk_engine_name(const kvr_disk *d);
const char *kvr_disk_engine_note(const kvr_disk *d);  /* borrowed, lives with d */

/* ---- recovery ---------------------------------------------------------------- */
typedef struct kvr_disk_record {
    uint32_t    type;             /* <= KVR_DISK_REC_USER_MAX */
    uint64_t    seq;
    const void *payload;          /* borrowed: valid during the callback only */
    size_t      len;
    bool        in_checkpoint;    /* part of the generation's snapshot */
} kvr_disk_record;

typedef void (*kvr_disk_record_fn)(void *arg, kvr_disk *d, const kvr_disk_record *r);
/* file is the file's name inside dir; [offset, offset+bytes) was skipped. */
typedef void (*kvr_disk_corrupt_fn)(void *arg, const char *file, uint64_t offset,
                                    uint64_t bytes, const char *reason);

typedef struct kvr_disk_recovery {
    uint64_t records;             /* handed to the callback */
    uint64_t bytes;               /* their payload bytes */
    uint64_t log_bytes;           /* bytes of log read */
    uint64_t quarantined;         /* corrupt records skipped */
    uint64_t torn_bytes;          /* truncated from the tail */
    uint64_t segments;            /* data segments found */
    double   ms;
} kvr_disk_recovery;

/* Replays the log (see above). The callbacks may be NULL. The record
 * callback may call kvr_disk_claim (and only that). */
int kvr_disk_recover(kvr_disk *d, kvr_disk_record_fn on_record,
                     kvr_disk_corrupt_fn on_corrupt, void *arg,
                     kvr_disk_recovery *out, kvr_error *err);
/* Declares a recovered handle live (checks its extent header: KVR_EIO if it
 * does not match). Claiming twice takes two references. */
int kvr_disk_claim(kvr_disk *d, const kvr_disk_handle *h, kvr_error *err);
/* kvr_disk_claim of h[0..n) in order, up to the first that fails (its
 * error returned, *claimed = how many were claimed before it); the extent
 * headers are read in batches, many in flight. */
int kvr_disk_claim_n(kvr_disk *d, const kvr_disk_handle *h, size_t n, size_t *claimed,
                     kvr_error *err);
/* What a claim reads of an extent's data besides its trailer (the
 * caller's buffers): its last tail_len bytes into tail, its first
 * head_len bytes into head (0: none). */
typedef struct kvr_disk_peek {
    void  *head;
    size_t head_len;
    void  *tail;
    size_t tail_len;
} kvr_disk_peek;
/* kvr_disk_claim_n that also reads pk[i] of each extent (an extent
 * claimed before is read too), in the same requests as the trailers: the
 * disk tier's recovery reads a block's metadata so, not its K/V. The
 * trailer is checked as by a claim; the data checksum is NOT (it covers
 * the whole extent: the caller checks what it peeked its own way, and a
 * load verifies the whole extent). Format v1 segments: KVR_EUNSUPPORTED,
 * nothing claimed (*claimed = 0); a peek longer than the extent:
 * KVR_EINVAL, nothing claimed. */
int kvr_disk_claim_peek_n(kvr_disk *d, const kvr_disk_handle *h, const kvr_disk_peek *pk,
                          size_t n, size_t *claimed, kvr_error *err);
/* Reclaims every unclaimed extent; then writes are allowed. */
int kvr_disk_recover_done(kvr_disk *d, kvr_error *err);

/* ---- spill store ------------------------------------------------------------- */
/* An extent's bytes: data[len], then tail[tail_len] (a block's K/V, then
 * its metadata, kept in two allocations: the extent is their
 * concatenation, the format does not change). tail may be NULL when
 * tail_len is 0. Only data goes to the device without staging. */
typedef struct kvr_disk_buf {
    const void *data;             /* borrowed for the call */
    size_t      len;              /* 0 < len + tail_len <= KVR_DISK_MAX_EXTENT */
    const void *tail;
    size_t      tail_len;
} kvr_disk_buf;

/* Where a load puts an extent of h.len bytes: its first len bytes at data,
 * the other h.len - len at tail (NULL when len == h.len). */
typedef struct kvr_disk_dst {
    void  *data;
    size_t len;
    void  *tail;
} kvr_disk_dst;

/* Writes n byte strings in one batch; on success hs[i] is the handle of
 * bufs[i] with one reference. All or nothing: on failure no handle is live.
 * sync: also make them durable (else log_append or kvr_disk_sync does).
 * Errors: KVR_ELIMIT (over max_bytes), KVR_EIO (disk; failed state),
 * KVR_EINVAL (bad length), KVR_ENOMEM. */
int kvr_disk_spill(kvr_disk *d, const kvr_disk_buf *bufs, size_t n,
                   kvr_disk_handle *hs, bool sync, kvr_error *err);
/* Reads n handles in one batch into dst[i] (hs[i].len bytes each, the
 * caller's) and checks every checksum. status (may be NULL) gets 0 or a
 * KVR_E* code per handle; returns 0 or the first error. A checksum
 * mismatch is KVR_EIO and is counted as quarantined; dst[i] then holds
 * garbage and must not be used. */
int kvr_disk_load(kvr_disk *d, const kvr_disk_handle *hs, void *const *dst,
                  size_t n, int *status, kvr_error *err);
/* The same into two-part destinations (KVR_EINVAL in status for one whose
 * len is over the handle's or that lacks the tail it needs). */
int kvr_disk_load_split(kvr_disk *d, const kvr_disk_handle *hs, const kvr_disk_dst *dst,
                        size_t n, int *status, kvr_error *err);
/* One more reference to a live handle (a block shared by two contexts). */
int kvr_disk_ref(kvr_disk *d, const kvr_disk_handle *h, kvr_error *err);
/* Drops a reference; the last one releases the space. KVR_EINVAL if h is
 * not live. Never does I/O that can fail the caller (punching is advisory). */
int kvr_disk_free(kvr_disk *d, const kvr_disk_handle *h, kvr_error *err);
/* Makes every spill so far durable. */
int kvr_disk_sync(kvr_disk *d, kvr_error *err);

/* ---- persistence log --------------------------------------------------------- */
typedef struct kvr_disk_rec_in {
    uint32_t    type;             /* <= KVR_DISK_REC_USER_MAX */
    const void *payload;          /* borrowed for the call */
    size_t      len;              /* <= KVR_DISK_MAX_RECORD */
} kvr_disk_rec_in;

/* Appends n records (each atomic on its own; one fsync for the batch) after
 * making all earlier spills durable. Returns 0 only when all are on stable
 * storage; *first_seq (may be NULL) gets the first record's seq, the others
 * follow by one. Not bounded by max_bytes (metadata must stay writable). */
int kvr_disk_log_append(kvr_disk *d, const kvr_disk_rec_in *recs, size_t n,
                        uint64_t *first_seq, kvr_error *err);
bool kvr_disk_log_wants_checkpoint(kvr_disk *d);

/* The snapshot callback adds the records of the current state with
 * kvr_disk_cp_add; a non-zero return aborts the checkpoint (the old
 * generation stays). */
typedef int (*kvr_disk_snapshot_fn)(void *arg, kvr_disk_cp *cp);
int kvr_disk_checkpoint(kvr_disk *d, kvr_disk_snapshot_fn fn, void *arg, kvr_error *err);
int kvr_disk_cp_add(kvr_disk_cp *cp, uint32_t type, const void *payload, size_t len);

/* ---- stats and fault injection ----------------------------------------------- */
typedef struct kvr_disk_stats {
    const char *engine;           /* static string */
    uint64_t data_bytes;          /* live extents (4 KiB granules) */
    uint64_t data_blocks;         /* live extents */
    uint64_t segments;
    uint64_t log_bytes, max_bytes;
    uint64_t n_writes, n_reads, n_fsyncs;   /* I/O operations issued */
    uint64_t bytes_written, bytes_read;
    uint64_t n_spills, n_loads, n_records, n_checkpoints;
    uint64_t n_refused_full;      /* spills refused by max_bytes */
    uint64_t n_quarantined;       /* corrupt records and extents seen */
    uint64_t n_torn_bytes;
    bool     failed;              /* an fsync failed: reopen required */
    kvr_disk_recovery last_recovery;
} kvr_disk_stats;

void kvr_disk_get_stats(kvr_disk *d, kvr_disk_stats *out);

/* Tests only: the nth (1-based, counted from this call) I/O operation of a
 * kind in `ops` fails with -err_no, and so do the next count-1 of them.
 * Kinds: every read / write request (each pread/pwrite or io_uring
 * readv/writev), every fdatasync/fsync (files and the directory), every
 * openat of a segment, log or checkpoint file, every ftruncate/renameat of
 * the log, every io_uring submission (refused: the engine drops the ring
 * and finishes on POSIX), and SHORT: a read or write that transfers only
 * half its bytes at first (the engine must finish it; err_no unused).
 * kvr_disk_fault_fired: faults injected since the last set. */
enum { KVR_DISK_FAULT_WRITE = 1, KVR_DISK_FAULT_FSYNC = 2, KVR_DISK_FAULT_READ = 4,
       KVR_DISK_FAULT_OPEN = 8, KVR_DISK_FAULT_META = 16, KVR_DISK_FAULT_SUBMIT = 32,
       KVR_DISK_FAULT_SHORT = 64 };
void kvr_disk_fault_set(kvr_disk *d, unsigned ops, uint64_t nth, int err_no,
                        uint64_t count);
uint64_t kvr_disk_fault_fired(const kvr_disk *d);

/* ---- between disk*.c files only: the I/O engines (disk_io.c) ----------------- */
typedef struct kvr_dio kvr_dio;
#define KVR_DIO_IOV_MAX 8u
typedef struct kvr_dio_req {
    int          fd;
    bool         write;
    struct iovec iov[KVR_DIO_IOV_MAX];
    int          iovcnt;
    uint64_t     off;
    bool         eof_ok;          /* a read may stop at end of file (res 0,
                                     done < length): O_DIRECT reads of a whole
                                     4 KiB granule whose file ends inside it */
    int          res;             /* out: 0 or -errno (short = -EIO/-ENOSPC); the
                                     raw system result, which disk.c turns into
                                     KVR_EIO / KVR_ENOMEM with its strerror text */
    size_t       done;            /* out: bytes transferred when res == 0 */
    bool         s_uring;         /* engine-private (a stream request in the ring) */
} kvr_dio_req;

/* engine: AUTO/URING/POSIX; note receives why io_uring was not used (not an
 * error). 0, KVR_ENOMEM, or KVR_EUNSUPPORTED when URING is forced and the
 * kernel refuses it (strerror text in err). */
int  kvr_dio_create(kvr_dio **out, kvr_disk_engine engine, uint32_t depth,
                    char *note, size_t note_cap, kvr_error *err);
void kvr_dio_destroy(kvr_dio *io);
const char *kvr_dio_name(const kvr_dio *io);
/* Whether requests of a stream run on the device together (io_uring), not
 * one after the other (the POSIX engine's one I/O thread). */
bool kvr_dio_async(const kvr_dio *io);
/* Runs n requests (batched on io_uring); returns 0 or the first request's
 * -errno (the system's value, as in kvr_dio_req.res). */
int  kvr_dio_run(kvr_dio *io, kvr_dio_req *r, size_t n);
int  kvr_dio_fsync(kvr_dio *io, int fd);     /* fdatasync semantics */
/* Streams: push starts one request (io_uring: submitted at once; posix:
 * queued to the engine's I/O thread) and returns; reap returns the oldest
 * pushed request once it is complete (res and done set), or NULL if none
 * is outstanding. At most kvr_dio_depth(io) outstanding; r and its buffers
 * stay the caller's until reaped. Between pushes and reaps the caller may
 * work on other buffers but makes no other kvr_dio call; every pushed
 * request is reaped before the next kvr_dio_run / fsync. */
#define KVR_DIO_STREAM_MAX 64u
uint32_t     kvr_dio_depth(const kvr_dio *io);   /* <= KVR_DIO_STREAM_MAX */
void         kvr_dio_push(kvr_dio *io, kvr_dio_req *r);
kvr_dio_req *kvr_dio_reap(kvr_dio *io);
void kvr_dio_fault_set(kvr_dio *io, unsigned ops, uint64_t nth, int err_no,
                       uint64_t count);
/* 0, or -errno when the test asked this operation of kind `op` to fail
 * (the sites in disk.c that are not I/O requests: open, ftruncate, rename). */
int      kvr_dio_fault(kvr_dio *io, unsigned op);
uint64_t kvr_dio_fault_fired(const kvr_dio *io);
/* Counters of issued operations. */
void kvr_dio_counts(const kvr_dio *io, uint64_t *writes, uint64_t *reads,
                    uint64_t *fsyncs, uint64_t *bw, uint64_t *br);

#endif /* KVR_DISK_H */
