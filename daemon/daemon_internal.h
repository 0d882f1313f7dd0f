/*
 * daemon_internal.h — what the files of daemon/ share: the server and
 * connection structs, the connection's byte-moving entry points (conn.c),
 * the request dispatcher and its verb table (dispatch.c), streamed replies
 * (stream.c), persistence (persist.c) and the protobuf conversions
 * (convert.h). Private to daemon/ (and its tests/fuzz targets).
 *
 * Who owns what:
 *  - conn.c moves bytes: it reads a frame's header and message and hands
 *    them to kvr__dispatch_frame, reads a payload into the iovecs dispatch
 *    gives it, drains refused payloads, and writes the packed buffers (plus
 *    payload iovecs) it is handed. It never looks inside a request.
 *  - dispatch.c owns the request (kvr_request: the decoded message, the
 *    store transaction, the threadpool job, the held reply); every request
 *    ends in exactly one kvr__request_end. kvr_conn.req is dispatch's field.
 *  - A conn is freed only when its refcount drops to zero: one reference for
 *    the handle (dropped in the close callback), one per queued write, one
 *    per queued threadpool job, one per reply held for persistence. So
 *    callbacks never see freed memory.
 *  - At most one request per connection is being processed at a time
 *    (state BUSY: nothing is read); responses are written in order (those
 *    made while a read callback runs are corked and written together when
 *    libuv stops reading that connection, conn.c).
 */
#ifndef KVR_DAEMON_INTERNAL_H
#define KVR_DAEMON_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <uv.h>

#include "base/clock.h"
#include "base/list.h"
#include "base/ref.h"
#include "cache/cache.h"
#include "daemon/convert.h"
#include "daemon/daemon.h"
#include "kvrope.pb-c.h"
#include "proto/frame.h"
#include "daemon/metrics.h"

#include <sys/types.h>

#define KVR_SCRATCH_SIZE (64u * 1024u)
#define KVR_LINGER_BYTES (1u << 20)    /* discarded before an error close */
#define KVR_LINGER_MS    2000
#define KVR_STOP_GRACE_MS 10000
/* Before Auth a frame is at most this message (Auth is tiny) and no
 * payload, so unauthenticated peers cannot make us buffer or unpack much. */
#define KVR_UNAUTH_MAX_MSG 4096u
/* protobuf-c's unpacked request can take ~20x the message's bytes (repeated
 * small sub-messages become structs plus pointer arrays), all outside the
 * store's reservations: one message's unpack is kept under a quarter of the
 * memory cap (the effective message limit is lowered at start if needed). */
#define KVR_UNPACK_FACTOR 20u
#define KVR_MAX_FRAME_CEILING (64u << 20)

/* Closes a handle the owner keeps with an `open` flag (no close callback:
 * its memory is the owner's and outlives the loop's run) and clears the
 * flag, so the stop and destroy paths may both ask and it closes once. */
static inline void kvr__uv_close_once(uv_handle_t *h, bool *open)
{
    if (*open) {
        uv_close(h, NULL);
        *open = false;
    }
}

typedef enum kvr_conn_state {
    KVR_CONN_HDR = 0,      /* reading the 24-byte header */
    KVR_CONN_MSG,          /* reading msg_len bytes of protobuf */
    KVR_CONN_PAYLOAD,      /* reading a payload into the iovecs dispatch gave */
    KVR_CONN_DRAIN,        /* discarding a refused payload, then the pending reply */
    KVR_CONN_BUSY,         /* a request is being processed; not reading */
    KVR_CONN_LINGER,       /* error reply sent, write side shut; discarding input */
} kvr_conn_state;

/* Requests counted per verb: one counter per entry of dispatch.c's verb
 * table, in its order (kvr__verb_name gives the names). */
#define KVR_N_VERBS 27

typedef struct kvr_conn kvr_conn;
/* A reply held back while a read callback runs (conn.c's cork). */
typedef void (*kvr_write_cb)(void *arg, int status);
#define KVR_CORK_MAX 16
#define KVR_INBUF_SIZE 4096u
typedef struct kvr_cork {
    uint8_t            *buf;      /* header + message (kvr_mem; may be NULL) */
    size_t              len;
    const struct iovec *iov;      /* payload, borrowed until cb */
    size_t              niov;
    size_t              total;    /* len + payload bytes */
    kvr_write_cb       cb;
    void               *arg;
} kvr_cork;
/* A shared-memory region of a connection (shm.c). */
typedef struct kvr_region kvr_region;
struct kvr_region {
    uint32_t     id;
    kvr_ref      refs;           /* taken on the loop thread */
    uint8_t     *base;           /* mapped read-write, size bytes */
    size_t       size;
    kvr_list     link;           /* on the connection's regions, newest first */
};
/* One request in progress (dispatch.c; opaque elsewhere). */
typedef struct kvr_request kvr_request;

/* Streamed replies: a get (or match+get) that needs work and whose payload
 * is over KVR_STREAM_MIN_BYTES sends its header and message at once, then
 * works and writes its layers in chunks of about KVR_STREAM_CHUNK_BYTES
 * (whole layers, at least one), at most KVR_STREAM_WINDOW chunks being
 * worked and as many written at a time, so rotation overlaps sending. */
#define KVR_STREAM_MIN_BYTES   (4u << 20)
#define KVR_STREAM_CHUNK_BYTES (8u << 20)
/* ... or, where a ring of such chunks would stage more than
 * KVR_STREAM_PIECES_FROM bytes (more than the last-level cache holds beside
 * the socket's buffers) and the get can be produced in pieces
 * (kvr_get_stage_pieces), pieces of about KVR_STREAM_PIECE_BYTES: a ring of
 * KVR_STREAM_WINDOW + 1 of them stays in cache between their work and
 * their write. */
#define KVR_STREAM_PIECE_BYTES (2u << 20)
#define KVR_STREAM_PIECES_FROM (16u << 20)
#define KVR_STREAM_WINDOW      2

struct kvr_daemon {
    uv_loop_t          loop;
    kvr_daemon_config  cfg;
    kvr_store         *store;
    struct kvr_remote *remote;   /* shared tier; NULL = none (remote_pub.c) */
    /* The request whose verb is starting, while it may still ask the shared
     * tier: the store's miss hooks give their fetch to it (dispatch.c). */
    struct kvr_request *fetch_req;
    /* Requests waiting for another request's fetch of the context they
     * missed to end (kvr_request.wait_link, dispatch.c; loop thread). */
    kvr_list   fetch_waiters;
    kvr_frame_limits   limits;

    uv_pipe_t  unix_srv;
    bool       has_unix;
    char       sock_path[256];
    bool       sock_created;
    uv_tcp_t   tcp_srv;
    bool       has_tcp;
    uv_signal_t sig_int, sig_term, sig_hup;
    bool       has_signals;
    /* The socket file we bound (unlink only if it is still ours). */
    dev_t      sock_dev;
    ino_t      sock_ino;
    bool       unix_activated, tcp_activated;   /* fds passed by systemd */
    int        argc;                 /* kvr_daemon_set_args: re-read on SIGHUP */
    char     **argv;
    kvr_metrics *metrics;
    uv_timer_t sweep;            /* lingering closes, stop grace */
    bool       has_sweep;

    uint8_t   *token;            /* NULL = no auth */
    size_t     token_len;

    bool       stopping;
    uint64_t   stop_ms;
    kvr_list   conns;            /* open connections (kvr_conn.link) */
    size_t     n_conns;
    size_t     n_unauth;         /* of n_conns: still owing Auth */

    uint8_t    scratch[KVR_SCRATCH_SIZE];   /* discarded bytes land here */

    /* metrics */
    uint64_t   start_ms;
    uint64_t   n_conn_total, n_conn_refused, n_requests, n_errors;
    uint64_t   bytes_in, bytes_out;
    uint64_t   n_streamed, n_stream_aborted;   /* streamed replies; cut short */
    /* server.c's idle purge of the allocator's retained pages (only with
     * --idle-purge: else what was once used stays mapped) */
    uint64_t   purge_seen, purge_idle_ms;
    bool       purged;
    /* warm.c: --prefault's thread and what it did */
    pthread_t  warm_thread;
    bool       has_warm;
    unsigned   warm_arena;
    uint64_t   warm_want;
    atomic_bool warm_stop;
    _Atomic uint64_t warm_done_bytes, warm_done_us;
    uint64_t   per_verb[KVR_N_VERBS];
    /* Unfinished messages of all connections (conn.c) against their limit. */
    uint64_t   msg_buffered, msg_buffer_limit;
    /* Shared-memory regions of all connections against their cap (shm.c:
     * each is one mapping, and the kernel's vm.max_map_count is global). */
    uint32_t   n_regions_all, region_cap;
    uint64_t   n_msg_limited, n_slow_closed;
    /* Connections with corked replies, flushed after the I/O phase. */
    kvr_conn  *corked;
    uv_check_t cork_check;
    bool       has_cork_check, cork_check_failed;
};

struct kvr_conn {
    union {
        uv_handle_t handle;
        uv_stream_t stream;
        uv_pipe_t   pipe;
        uv_tcp_t    tcp;
    } h;
    kvr_daemon *d;
    kvr_list    link;             /* on d->conns */
    int         refs;
    bool        is_tcp, authed;
    bool        closing;          /* uv_close called */
    bool        close_after_write;/* close once the queued writes are done */
    bool        reading;
    bool        linger;           /* drain input briefly before closing */
    kvr_conn_state st;
    uint64_t    linger_deadline_ms;
    uint64_t    linger_left;
    /* Timeouts (kvr__conn_sweep): Auth due by auth_deadline_ms; the last
     * time bytes arrived (or reading resumed), and the last time queued
     * reply bytes drained (write_q: libuv's queue size seen then). */
    uint64_t    auth_deadline_ms;
    uint64_t    read_ms, write_ms;
    size_t      write_q;

    uint8_t     hdr[KVR_FRAME_HEADER_SIZE];
    size_t      hdr_have;
    kvr_frame_header fh;
    /* Read-ahead at a frame boundary (conn.c): a header is read with what
     * follows it, up to KVR_INBUF_SIZE bytes in one recvmsg (a small
     * request whole, a put's message and first payload bytes), and fed to
     * the frame machine from here. in_pos..in_len: bytes not fed yet. */
    uint8_t    *inbuf;            /* kvr_mem, KVR_INBUF_SIZE; NULL until used */
    size_t      in_pos, in_len;
    bool        feeding;          /* feed_inbuf is on the stack */
    bool        drained;          /* a direct read found the socket empty: libuv's
                                     next read in this batch is skipped */
    bool        drain_skip;       /* the UV_ENOBUFS of that skip */
    int         read_fd;          /* an fd that came with a direct payload read
                                     (-1: none; kvr__conn_take_fd) */

    uint8_t    *msg;
    size_t      msg_cap, msg_have;
    bool        msg_over_limit;   /* growing msg would pass d->msg_buffer_limit */
    /* The frame deadline (--min-rate): set when its first header byte came. */
    uint64_t    frame_ms, frame_deadline_ms;

    /* The payload being read (PAYLOAD): dispatch's iovecs, borrowed. */
    const struct iovec *iov;
    size_t      niov, iov_i, iov_off;
    uint64_t    payload_left;     /* bytes of it still to come */

    bool        payload_unread;   /* the frame's payload is still on the wire */
    /* drain: bytes left, then this packed reply is written */
    uint64_t    drain_left;
    uint8_t    *pending;
    size_t      pending_len;

    size_t      writes_pending;
    uint64_t    out_queued;

    /* Shared-memory regions (shm.c), Unix socket only. */
    kvr_list    regions;        /* kvr_region.link, newest first */
    uint32_t    n_regions, region_seq;
    uint64_t    region_bytes;

    /* Replies corked while a read callback runs (conn.c). */
    kvr_cork   cork[KVR_CORK_MAX];
    size_t      n_cork;
    bool        in_read;
    kvr_conn   *cork_next, **cork_prev;   /* d->corked list; prev NULL: not in it */

    kvr_request *req;            /* dispatch.c's: the request in progress */
    kvr_request *req_spare;      /* dispatch.c's: storage for the next one
                                     (kvr_mem; freed with the connection) */
};

/* ---- config.c --------------------------------------------------------- */
int  kvr__daemon_split_listen(const char *s, char *host, size_t hcap, int *port);
bool kvr__daemon_host_is_loopback(const char *host);

/* ---- server.c --------------------------------------------------------- */
/* Reads a token file (trailing newline ignored, 1..4096 bytes) into a
 * kvr_mem buffer the caller frees; warns (log) when group or others may
 * read it. 0, or KVR_EIO / KVR_EINVAL / KVR_ENOMEM with err filled. */
int  kvr__daemon_read_token(const char *path, uint8_t **tok, size_t *len, kvr_error *err);

/* ---- metrics.c (besides metrics.h) ----------------------------------- */
/* Is this bound/listening socket address loopback (127/8, ::1, ::ffff:127/8)? */
bool kvr__daemon_sockaddr_is_loopback(const struct sockaddr *sa);

/* ---- conn.c ----------------------------------------------------------- */
void kvr__conn_start(kvr_daemon *d, kvr_conn *c, bool is_tcp);
void kvr__conn_close(kvr_conn *c);
/* Sends an error reply (id 0 unless known) and closes after it is written. */
void kvr__conn_fail(kvr_conn *c, uint64_t id, int code, const char *msg);
/* Stop: close now if idle, else after the current request. */
void kvr__conn_stop(kvr_conn *c);
/* Closes c if its linger ended, `force`, or a timeout expired: Auth not
 * sent within --auth-timeout, or no progress for --io-timeout mid-frame
 * (a put/edit payload is aborted) or on a queued reply. */
void kvr__conn_sweep(kvr_conn *c, uint64_t now_ms, bool force);
/* Tests only: while > 0, each reply write fails at once (as uv_write does
 * for a stream that is gone) and the count drops by one. */
extern int kvr__conn_test_write_failures;
/* Marks c authenticated (leaves the unauthenticated count). */
void kvr__conn_set_authed(kvr_conn *c);

/* Queues buf (header + message, kvr_mem; taken in every case, NULL for
 * none) and then payload_len bytes from iov. On 0, cb(arg, status) runs
 * once the write completes or fails (status 0 or a negative libuv code);
 * on an error return (the connection is closing, or the write could not be
 * queued: then the connection is closed) cb never runs. */
int  kvr__conn_write(kvr_conn *c, uint8_t *buf, size_t len, const struct iovec *iov,
                     size_t niov, size_t payload_len, kvr_write_cb cb, void *arg);
/* The same; with sync_ok a reply the socket takes in full at once returns
 * 1 and cb never runs (the caller releases the payload's source itself):
 * no write request and no callback a loop iteration later. */
int  kvr__conn_write_ex(kvr_conn *c, uint8_t *buf, size_t len, const struct iovec *iov,
                        size_t niov, size_t payload_len, kvr_write_cb cb, void *arg,
                        bool sync_ok);
/* Writes (or queues) the replies held back in c's cork now. */
void kvr__conn_cork_flush(kvr_conn *c);
/* Error reply (id, code, msg or kvr_strerror(code)) to the current frame;
 * if its payload is still unread it is drained first (up to max_drain; over
 * it the reply is sent and the connection closed). */
void kvr__conn_reply_error(kvr_conn *c, uint64_t id, int code, const char *msg);
/* Reads the current frame's payload into iov (borrowed until
 * kvr__dispatch_payload_done, which runs when the last byte arrived, maybe
 * at once). State BUSY. */
void kvr__conn_read_payload(kvr_conn *c, const struct iovec *iov, size_t niov);
/* Are bytes of a later frame read ahead already (in the inbuf, past the
 * current frame's payload)? The fds that came with a read belong to a frame
 * that started in it: dispatch hands them to a RegisterRegion, and only the
 * last frame read ahead closes strays (shm.c). */
bool kvr__conn_frames_ahead(const kvr_conn *c);
/* The fds that came with the current frame's read: libuv's queue
 * (kvr__shm_take_fd) and one a direct payload read took; the first is
 * returned (-1: none), the others are closed. */
int  kvr__conn_take_fd(kvr_conn *c);
/* The current request is answered: read the next frame (after the drain,
 * if one runs; nothing if the connection is closing or closes after its
 * writes; closes it if the daemon is stopping). */
void kvr__conn_request_done(kvr_conn *c);
/* A reference that keeps c's memory alive (work, held replies, streams). */
void kvr__conn_ref(kvr_conn *c);
void kvr__conn_unref(kvr_conn *c);

/* Stops the read watcher of a connection that is not reading (libuv's
 * uv_accept re-arms it when it hands over the last queued fd). */
void kvr__conn_quiet(kvr_conn *c);

/* ---- shm.c: shared-memory regions ------------------------------------- */
/* The fds that came with the current frame: the first is returned (the
 * caller's, or -1 if none came), any others are closed. */
int  kvr__shm_take_fd(kvr_conn *c);
/* Closes every fd queued on c's handle. */
void kvr__shm_drop_fds(kvr_conn *c);
/* Validates fd (a memfd sealed against shrinking, >= size bytes, not
 * write-sealed), the per-connection limits, and maps it; the region is
 * the connection's (*out borrowed). fd stays the caller's. */
int  kvr__shm_register(kvr_conn *c, int fd, uint64_t size, kvr_region **out, kvr_error *e);
/* At start: d->region_cap from --max-regions-total, or derived from
 * /proc/sys/vm/max_map_count less headroom for the daemon's own maps. */
void kvr__shm_init(kvr_daemon *d);
kvr_region *kvr__shm_find(kvr_conn *c, uint32_t id);
int  kvr__shm_release(kvr_conn *c, uint32_t id, kvr_error *e);
/* The connection closes: its references go (requests keep theirs). */
void kvr__shm_conn_closed(kvr_conn *c);
/* [offset, offset + length) of region `region`, checked; on success the
 * caller holds a reference (*out, kvr__region_unref) and *p points there. */
int  kvr__shm_slice(kvr_conn *c, uint32_t region, uint64_t offset, uint64_t length,
                    kvr_region **out, uint8_t **p, kvr_error *e);
void kvr__region_ref(kvr_region *g);
void kvr__region_unref(kvr_region *g);   /* NULL: no-op; the last one unmaps */

/* ---- dispatch.c ------------------------------------------------------- */
/* A complete frame's message arrived (fh: its header; msg: fh->msg_len
 * bytes, borrowed for the call); state BUSY. Decodes it and runs its verb;
 * always ends in a reply (now or later) and kvr__conn_request_done, or a
 * close. */
void kvr__dispatch_frame(kvr_conn *c, const kvr_frame_header *fh, const uint8_t *msg);
/* The payload kvr__conn_read_payload was asked for arrived in full. */
/* With a shared tier: installs the store's miss hooks (kvr_store_miss_hooks)
 * that fetch for the request whose verb meets the miss (dispatch.c). */
void kvr__dispatch_tier_install(kvr_daemon *d);
void kvr__dispatch_payload_done(kvr_conn *c);
/* kvr__conn_close: a request waiting for payload bytes is aborted (nothing
 * it would have changed is kept); one in work, in a stream or waiting for
 * its record finishes when that comes back. */
void kvr__dispatch_conn_closing(kvr_conn *c);
/* Name of verb i of the table (i < KVR_N_VERBS): "put", ... */
const char *kvr__verb_name(size_t i);
/* The one end of every request: status is the KVR_E* code it was answered
 * with (0 OK). Records the per-request figures, frees it and lets the
 * connection read its next frame. stream.c and persist.c end theirs here. */
void kvr__request_end(kvr_request *r, int status);
/* persist.c's completion callback for a reply held until its record is on
 * disk (arg is the request). */
void kvr__request_persisted(void *arg, int rc, const kvr_error *e);

/* ---- stream.c: replies produced and written chunk by chunk ------------ */
/* Streams a get that needs work: buf (header + message, status OK, taken)
 * now, then the payload (payload_len bytes) in chunks of whole layers,
 * each chunk's work on the threadpool (kvr_get_work_layers) overlapping
 * the writes. Takes get (ended when the stream ends) and ends r
 * (kvr__request_end) when the last write completes, or once everything in
 * flight came back after a failure or a close (a failure after the header
 * closes the connection). Returns KVR_ENOMEM without taking anything if the
 * stream cannot start. */
int  kvr__stream_start(kvr_request *r, kvr_conn *c, kvr_get *get, uint8_t *buf, size_t len,
                       size_t payload_len);
/* Loop thread, before kvr__stream_start and before anything is sent: the
 * get's staging as the stream will use it (a ring of chunks when that is
 * smaller than the whole staging, kvr_get_stage_ring). 0, or the store's
 * refusal (reply with it: nothing was sent). */
int  kvr__stream_stage(kvr_get *get, kvr_error *err);

/* ---- persist.c: the disk tier ------------------------------------------ */
/* Opens --disk-dir and recovers the persistent contexts (before listening). */
int  kvr__persist_open(kvr_daemon *d, char *err, size_t errlen);
/* A change to context ctx_id was committed: if it is persistent, queue its
 * record and return 1 (kvr__request_persisted(r, ...) runs once the record
 * is on disk or failed); 0 if it is not persistent (reply now); negative
 * KVR_E* (e filled) if the record could not be queued. */
int  kvr__persist_defer(kvr_daemon *d, const char *ctx_id, kvr_request *r, kvr_error *e);

/* ---- t_cover.c: the Cover verb ------------------------------------------ */
/* The verb's state from its start to its reply (t_cover.c has the rest). */
typedef struct kvr__cover kvr__cover;
/* Loop thread: computes the cover of q's prompt and, with q->get, opens
 * the placed read into *as (dst: the shm slice it is produced into, or
 * NULL). On failure nothing is owned (*out, *as NULL) and e says why. */
int  kvr__cover_begin(kvr_store *s, const Kvrope__Cover *q, void *dst, size_t dst_cap,
                      kvr__cover **out, kvr_assemble **as, kvr_error *e);
/* True when the reply has no payload (no get, or meta_only). */
bool kvr__cover_meta(const kvr__cover *cv);
/* The CoverResult (as: the placed read, or NULL), owned by cv and valid
 * until kvr__cover_free; KVR_ENOMEM. */
int  kvr__cover_result(kvr__cover *cv, const kvr_assemble *as, Kvrope__CoverResult **out);
void kvr__cover_free(kvr__cover *cv);   /* NULL: no-op */

/* ---- warm.c: --prefault ------------------------------------------------ */
/* Starts faulting in --prefault bytes in the background (0: nothing). */
int  kvr__warm_start(kvr_daemon *d, kvr_error *err);
/* Stops and joins it (no-op if not started). */
void kvr__warm_stop(kvr_daemon *d);

#endif /* KVR_DAEMON_INTERNAL_H */
