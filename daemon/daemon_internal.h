/*
 * daemon_internal.h — what the files of daemon/ share: the server and
 * connection structs, the connection state machine's entry points, and the
 * request dispatcher. Private to daemon/ (and its tests/fuzz targets).
 *
 * Ownership rules:
 *  - A conn is freed only when its refcount drops to zero: one reference for
 *    the handle (dropped in the close callback), one per queued write, one
 *    per queued threadpool job. So callbacks never see freed memory.
 *  - At most one request per connection is being processed at a time
 *    (state BUSY: reading is stopped); responses are written in order.
 */
#ifndef KVR_DAEMON_INTERNAL_H
#define KVR_DAEMON_INTERNAL_H

#include <uv.h>

#include "cache/cache.h"
#include "daemon/daemon.h"
#include "kvrope.pb-c.h"
#include "proto/frame.h"

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

typedef enum conn_state {
    CONN_HDR = 0,      /* reading the 24-byte header */
    CONN_MSG,          /* reading msg_len bytes of protobuf */
    CONN_PAYLOAD,      /* reading a put's payload into the store's iovecs */
    CONN_DRAIN,        /* discarding a refused payload, then the pending reply */
    CONN_BUSY,         /* a request is being processed; not reading */
    CONN_LINGER,       /* error reply sent, write side shut; discarding input */
} conn_state;

/* Requests counted per verb; index = Request body case - 10 (10..44; the
 * unused cases in between have no name and are not reported). */
#define KVR_N_VERBS 35

typedef struct kvr_conn kvr_conn;
/* A reply whose payload is produced and written chunk by chunk (conn.c). */
typedef struct kvr_stream kvr_stream;

/* Streamed replies: a get (or match+get) that needs work and whose payload
 * is over KVR_STREAM_MIN_BYTES sends its header and message at once, then
 * works and writes its layers in chunks of about KVR_STREAM_CHUNK_BYTES
 * (whole layers, at least one), at most KVR_STREAM_WINDOW chunks being
 * worked and as many written at a time, so rotation overlaps sending. */
#define KVR_STREAM_MIN_BYTES   (4u << 20)
#define KVR_STREAM_CHUNK_BYTES (8u << 20)
#define KVR_STREAM_WINDOW      2

/* What a threadpool job (or its inline equivalent) works on. */
enum {
    KVR_WORK_PUT = 1,       /* c->put: put or group append */
    KVR_WORK_GET = 2,       /* c->get */
    KVR_WORK_MATCH = 3,     /* c->get, the get half of a match */
    KVR_WORK_EDIT = 4,      /* c->edit: edit or refresh */
    KVR_WORK_ASSEMBLE = 5,  /* c->as */
    KVR_WORK_REMOTE = 6,    /* c->rjob: a fetch from the shared tier */
};

struct kvr_daemon {
    uv_loop_t          loop;
    kvr_daemon_config  cfg;
    kvr_store         *store;
    kvr_frame_limits   limits;

    uv_pipe_t  unix_srv;
    bool       has_unix;
    char       sock_path[256];
    bool       sock_created;
    uv_tcp_t   tcp_srv;
    bool       has_tcp;
    uv_signal_t sig_int, sig_term;
    bool       has_signals;
    uv_timer_t sweep;            /* lingering closes, stop grace */
    bool       has_sweep;

    struct kvr_remote *remote;   /* shared tier; NULL = none (remote.c) */

    uint8_t   *token;            /* NULL = no auth */
    size_t     token_len;

    bool       stopping;
    uint64_t   stop_ms;
    kvr_conn  *conns;            /* doubly linked, open connections */
    size_t     n_conns;
    size_t     n_unauth;         /* of n_conns: still owing Auth */

    uint8_t    scratch[KVR_SCRATCH_SIZE];   /* discarded bytes land here */

    /* metrics */
    uint64_t   start_ms;
    uint64_t   n_conn_total, n_conn_refused, n_requests, n_errors;
    uint64_t   bytes_in, bytes_out;
    uint64_t   n_streamed, n_stream_aborted;   /* streamed replies; cut short */
    uint64_t   per_verb[KVR_N_VERBS];
};

struct kvr_conn {
    union {
        uv_handle_t handle;
        uv_stream_t stream;
        uv_pipe_t   pipe;
        uv_tcp_t    tcp;
    } h;
    kvr_daemon *d;
    kvr_conn   *prev, *next;
    int         refs;
    bool        is_tcp, authed;
    bool        closing;          /* uv_close called */
    bool        close_after_write;/* close once the queued writes are done */
    bool        reading;
    bool        linger;           /* drain input briefly before closing */
    conn_state  st;
    uint64_t    linger_deadline_ms;
    uint64_t    linger_left;
    /* Timeouts (kvr_conn_sweep): Auth due by auth_deadline_ms; the last
     * time bytes arrived (or reading resumed), and the last time queued
     * reply bytes drained (write_q: libuv's queue size seen then). */
    uint64_t    auth_deadline_ms;
    uint64_t    read_ms, write_ms;
    size_t      write_q;

    uint8_t     hdr[KVR_FRAME_HEADER_SIZE];
    size_t      hdr_have;
    kvr_frame_header fh;

    uint8_t    *msg;
    size_t      msg_cap, msg_have;

    Kvrope__Request *req;

    /* put (or group append) in progress */
    kvr_put    *put;
    /* edit or refresh in progress (payload into its iovecs, like a put) */
    kvr_edit   *edit;
    const struct iovec *iov;
    size_t      niov, iov_i, iov_off;

    bool        payload_unread;   /* the frame's payload is still on the wire */
    /* drain: bytes left, then this packed reply is written */
    uint64_t    drain_left;
    uint8_t    *pending;
    size_t      pending_len;
    bool        pending_close;

    /* threadpool job (one at a time) */
    uv_work_t   work;
    int         work_kind;        /* KVR_WORK_* */
    int         work_rc;
    kvr_error   work_err;
    kvr_get    *get;
    kvr_assemble *as;
    uint64_t    match_len;
    char        match_ctx[KVR_ID_MAX + 1];

    size_t      writes_pending;
    uint64_t    out_queued;

    kvr_stream *stream;           /* streamed reply in progress (state BUSY) */

    /* shared tier: the fetch job of this request, and whether the request
     * already asked the cluster (it is then answered from what landed) */
    struct kvr_rjob *rjob;
    bool        remote_tried;
    bool        work_requeued;    /* kvr_conn_queue_work ran during after-work */
};

/* ---- config.c --------------------------------------------------------- */
int  kvr_daemon_split_listen(const char *s, char *host, size_t hcap, int *port);
bool kvr_daemon_host_is_loopback(const char *host);

/* ---- conn.c ----------------------------------------------------------- */
void kvr_conn_start(kvr_daemon *d, kvr_conn *c, bool is_tcp);
void kvr_conn_close(kvr_conn *c);
/* Sends an error reply (id 0 unless known) and closes after it is written. */
void kvr_conn_fail(kvr_conn *c, uint64_t id, int code, const char *msg);
/* Stop: close now if idle, else after the current request. */
void kvr_conn_stop(kvr_conn *c);
/* Closes c if its linger ended, `force`, or a timeout expired: Auth not
 * sent within --auth-timeout, or no progress for --io-timeout mid-frame
 * (a put/edit payload is aborted) or on a queued reply. */
void kvr_conn_sweep(kvr_conn *c, uint64_t now_ms, bool force);
/* Tests only: while > 0, each reply write fails at once (as uv_write does
 * for a stream that is gone) and the count drops by one. */
extern int kvr_conn_test_write_failures;
/* Marks c authenticated (leaves the unauthenticated count). */
void kvr_conn_set_authed(kvr_conn *c);
uint64_t kvr_now_ms(void);

/* Writes a packed response frame (header + message [+ get payload]). */
int  kvr_conn_send(kvr_conn *c, const Kvrope__Response *r, kvr_get *get,
                   size_t payload_len, bool close_after);
/* The same with an assembled stream as the payload; `as` ends in the write
 * callback (or at once if the write cannot be queued). */
int  kvr_conn_send_assemble(kvr_conn *c, const Kvrope__Response *r, kvr_assemble *as,
                            size_t payload_len);
/* Streams the reply r (status OK) to a get that needs work: header and
 * message now, then the payload chunk by chunk, each chunk's work on the
 * threadpool (kvr_get_work_layers). Takes get (ended after the last write
 * completes) and finishes the request (kvr_conn_request_done after the
 * last write; the caller must not). The status is sent before the payload
 * exists: a work failure afterwards closes the connection, as does a write
 * failure; a disconnect stops the stream, waits for the work in flight and
 * ends the get. */
void kvr_conn_send_stream(kvr_conn *c, const Kvrope__Response *r, kvr_get *get,
                          size_t payload_len);
/* Queues a packed frame (header + message, no payload); takes buf. */
int  kvr_conn_send_packed(kvr_conn *c, uint8_t *buf, size_t len);
/* A reference that keeps c's memory alive (persist.c's pending replies). */
void kvr_conn_ref(kvr_conn *c);
void kvr_conn_unref(kvr_conn *c);
/* Finishes the current request: frees it and resumes reading. */
void kvr_conn_request_done(kvr_conn *c);
/* Error reply for the current request; if the frame declared a payload, it
 * is drained (up to max_drain) first, else the connection is closed. */
void kvr_conn_reply_error(kvr_conn *c, int code, const char *msg);
/* Start receiving the payload into c->put's (or c->edit's) iovecs. */
void kvr_conn_begin_payload(kvr_conn *c);
void kvr_conn_queue_work(kvr_conn *c, int kind);

/* ---- dispatch.c ------------------------------------------------------- */
extern ProtobufCAllocator kvr_pb_allocator;
/* Called with c->req set and state BUSY. Always ends in a reply (now or
 * after payload/work) and kvr_conn_request_done, or a close. */
void kvr_dispatch(kvr_conn *c);
/* After a threadpool job, on the loop thread (c not closing). */
void kvr_dispatch_after_work(kvr_conn *c);
/* After the put / edit payload arrived in full. */
void kvr_dispatch_payload_done(kvr_conn *c);
int  kvr_status_of(int code);      /* KVR_E* -> Status */

/* After a shared-tier fetch (KVR_WORK_REMOTE), on the loop thread. */
void kvr_dispatch_remote_done(kvr_conn *c);

/* ---- persist.c: the disk tier ------------------------------------------ */
/* Opens --disk-dir and recovers the persistent contexts (before listening). */
int  kvr_persist_open(kvr_daemon *d, char *err, size_t errlen);
/* reply_ok's hook: if the request changed a persistent context, the reply
 * (r, packed now) is sent only once its record is on disk, or an error
 * instead; returns true then (the request is finished later). */
bool kvr_persist_reply(kvr_conn *c, Kvrope__Response *r);
/* Metrics of the disk tier for stats: fills up to cap, returns the count.
 * Names are static strings. */
size_t kvr_persist_metrics(kvr_daemon *d, const char **names, double *values, size_t cap);

#endif /* KVR_DAEMON_INTERNAL_H */
