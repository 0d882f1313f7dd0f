/*
 * dispatch.h — a request as dispatch.c and the verb files (t_*.c) see it;
 * private to them (conn.c moves a request's bytes and never looks inside:
 * it has daemon_internal.h's opaque kvr_request).
 *
 *   dispatch.c   a request's life: the frame in, the verb table, phases,
 *                replies, the threadpool, shared-memory payloads, the
 *                shared tier's fetch on a miss, the end;
 *   t_server.c   auth, ping, stats, shared-memory regions;
 *   t_model.c    register_model, list_models, remove_model;
 *   t_ctx.c      list, stat, delete, pin, fork, shift, keep, and the
 *                layout verbs (layout_stat, set_group_offset,
 *                set_retention);
 *   t_kv.c       the verbs that carry K/V: put, group_append, get, match,
 *                assemble;
 *   t_edit.c     edit, refresh, edit_plan (PIE).
 *
 * A verb's start handler runs on the loop thread and ends in exactly one
 * of: a reply (kvr__reply_* / kvr__send_ok, which end the request), or
 * handing the request on (kvr__read_payload, kvr__run, a stream, a
 * persistence or publication wait, a fetch), whose path replies later.
 * Its work handler runs on a threadpool thread and touches only its
 * transaction; its finish handler runs on the loop thread.
 */
#ifndef KVR_DAEMON_DISPATCH_H
#define KVR_DAEMON_DISPATCH_H

#include <assert.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "daemon/daemon_internal.h"
#include "daemon/remote.h"

/* The generated structs take non-const pointers; the data is only read. */
#define UNCONST(T, p) ((T)(uintptr_t)(p))

/* Bytes of a request's inline arena for its unpacked message: a put's
 * Request, Put, ids and a few hundred tokens fit. */
#define KVR_PB_ARENA 2048

typedef enum rq_phase {
    RQ_RUN = 0,     /* in a handler on the loop thread */
    RQ_PAYLOAD,     /* conn.c reads the payload into the transaction */
    RQ_WORK,        /* the threadpool works on the transaction */
    RQ_PERSIST,     /* the reply is held until the record is on disk */
    RQ_STREAM,      /* stream.c owns the get and ends the request */
    RQ_WAIT,        /* parked until another request's fetch of its context ends */
} rq_phase;

enum {
    V_PAYLOAD_IN  = 1u << 0,   /* takes a payload (else one is E_BAD_REQUEST) */
    V_PAYLOAD_OUT = 1u << 1,   /* may answer with a payload */
    V_OPEN        = 1u << 2,   /* allowed before Auth */
};

typedef struct kvr_verb {
    const char *name;                    /* "put"; stats: requests_<name> */
    Kvrope__Request__BodyCase body;
    unsigned    flags;                   /* V_* */
    void      (*start)(kvr_request *r);
    /* The context a successful request changes (its reply then waits for
     * the record when the context is persistent); NULL: changes none. */
    const char *(*changes)(const Kvrope__Request *q);
    /* Threadpool part (any thread; NULL: none) and the loop-thread part
     * after it (or instead of it when the transaction needs no work). */
    int       (*work)(kvr_request *r, kvr_error *e);
    void      (*finish)(kvr_request *r);
} kvr_verb;

struct kvr_request {
    kvr_conn        *c;
    kvr_daemon      *d;
    const kvr_verb *verb;          /* NULL: no body, or a verb we do not know */
    Kvrope__Request *msg;           /* freed early by a stream (packed by then) */
    uint64_t         id;
    uint64_t         msg_len, payload_len;   /* of its frame */
    uint64_t         start_ns;      /* uv_hrtime() when the message arrived */
    uint64_t         bytes_out;     /* reply bytes handed to conn.c */
    rq_phase         phase;
    /* the store transaction (at most one) */
    kvr_put         *put;
    kvr_edit        *edit;
    kvr_get         *get;
    kvr_assemble    *as;
    kvr__cover      *cover;         /* cover: its runs (t_cover.c); as: its get */
    /* PERSIST: the packed reply */
    uint8_t         *held;
    size_t           held_len;
    /* Request.shm (shm.c): the payload's place instead of the socket; the
     * region is referenced until the request ends. */
    kvr_region     *shm;
    uint8_t         *shm_p;
    size_t           shm_len;
    bool             meta;          /* get/assemble: meta_only (no payload) */
    bool             needs_work;    /* run(): the verb's work is to be done */
    int              fd;            /* came with the frame (-1 none); closed at the end */
    /* The shared tier under the store (remote_fetch.c): the fetch a miss of this
     * request's verb gave it, the fetches it has made, and whether it is
     * done asking (then its verb sees the store's plain misses). */
    struct kvr_rjob *rjob;
    unsigned         n_fetches;
    bool             remote_tried;
    /* From here on each field is set before it is read, so a reused
     * request is cleared only up to `work`. */
    /* threadpool job */
    uv_work_t        work;
    int              work_rc;
    kvr_error        work_err;
    /* RQ_WAIT: on d->fetch_waiters, waiting for the fetch of wait_id */
    kvr_list         wait_link;
    char             wait_id[KVR_ID_MAX + 1];
    /* match: what matched (the get half reads it) */
    uint64_t         match_len;
    char             match_ctx[KVR_ID_MAX + 1];
    /* The unpacked message's first bytes (pb_arena_*): a request's message
     * is a few small allocations (the Request, its body, ids, tokens), made
     * here instead of one malloc + free each; what does not fit is
     * allocated. Reset for each request (with the struct: see req_spare). */
    ProtobufCAllocator pb;
    size_t           arena_used;
    size_t           arena_heap;   /* allocations that did not fit (kvr_mem_malloc) */
    _Alignas(16) uint8_t arena[KVR_PB_ARENA];
};

/* ---- dispatch.c: ending, replying, running ------------------------------- */
/* Aborts the request's open transaction (and a fetch it holds), if any. */
void kvr__release_txn(kvr_request *r);
/* A finish handler's first step: when the verb's work failed (work_rc <
 * 0), aborts the open transaction, replies the work's error and returns
 * true (the request has ended, or is parked on its fetch); false when the
 * work succeeded and the transaction is still the request's to finish. */
bool kvr__work_failed(kvr_request *r);
/* Errors (code < 0; KVR_EFETCH parks the request on its fetch instead):
 * reply and end the request. */
void kvr__reply_error(kvr_request *r, int code, const char *msg);
void kvr__reply_err(kvr_request *r, int code, const kvr_error *e);
void kvr__reply_errf(kvr_request *r, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Sends resp (status OK) and then payload_len bytes from iov; done(arg)
 * releases the payload's source once written. Ends the request. */
void kvr__send_ok(kvr_request *r, Kvrope__Response *resp, const struct iovec *iov,
                  size_t niov, size_t payload_len, kvr_write_cb done, void *arg);
/* A reply with no payload: held until the record is on disk when the verb
 * changes a persistent context. Ends the request (then or later). */
void kvr__reply_ok(kvr_request *r, Kvrope__Response *resp);
/* kvr__reply_ok with a response whose only field is one body of the
 * oneof: REPLY_BODY(r, MODEL, model, &mi) sends body_case
 * KVROPE__RESPONSE__BODY_MODEL with .model = &mi (the compiler checks the
 * body's type against the field's). The body is borrowed until it returns. */
#define REPLY_BODY(r, CASE, member, body)                \
    do {                                                 \
        Kvrope__Response resp_ = KVROPE__RESPONSE__INIT; \
        resp_.body_case = KVROPE__RESPONSE__BODY_##CASE; \
        resp_.member = (body);                           \
        kvr__reply_ok((r), &resp_);                      \
    } while (0)

/* A put with share_sync: the reply waits for the publication. */
void kvr__reply_shared(kvr_request *r, Kvrope__Response *resp, const char *ctx_id);
/* The verb's work on the threadpool when needs_work (or inline), then its
 * finish on the loop thread. */
void kvr__run(kvr_request *r, bool needs_work);
/* The open put's (or edit's) payload into its iovecs, then run. */
void kvr__read_payload(kvr_request *r);
/* Frees the request's unpacked message (a stream packed it already). */
void kvr__msg_free(kvr_request *r);

/* ---- t_ctx.c: replies about a context ------------------------------------ */
/* Replies with the context's ContextInfo. */
void kvr__reply_ctx(kvr_request *r, const char *id);
/* A store call's outcome: the error, else ContextInfo of ctx_for_info
 * (NULL: an empty OK). */
void kvr__reply_simple(kvr_request *r, int rc, const kvr_error *e, const char *ctx_for_info);

/* ---- t_*.c: the verbs (start handlers: do_<name>) ------------------------- */
void kvr__do_assemble(kvr_request *r);
/* An assembly begun (r->as, r->meta): its payload must fit the region slice
 * if any ("shm: the <what> payload is ..."), its staging is reserved, then
 * it runs (t_kv.c; cover's placed K/V too). */
void kvr__assemble_run(kvr_request *r, const char *what);
void kvr__do_auth(kvr_request *r);
void kvr__do_delete(kvr_request *r);
void kvr__do_edit(kvr_request *r);
void kvr__do_edit_plan(kvr_request *r);
void kvr__do_fork(kvr_request *r);
void kvr__do_get(kvr_request *r);
void kvr__do_group_append(kvr_request *r);
void kvr__do_keep(kvr_request *r);
void kvr__do_layout_stat(kvr_request *r);
void kvr__do_list(kvr_request *r);
void kvr__do_list_models(kvr_request *r);
void kvr__do_match(kvr_request *r);
void kvr__do_pin(kvr_request *r);
void kvr__do_ping(kvr_request *r);
void kvr__do_put(kvr_request *r);
void kvr__do_refresh(kvr_request *r);
void kvr__do_register_model(kvr_request *r);
void kvr__do_register_region(kvr_request *r);
void kvr__do_release_region(kvr_request *r);
void kvr__do_remove_model(kvr_request *r);
void kvr__do_set_group_offset(kvr_request *r);
void kvr__do_set_retention(kvr_request *r);
void kvr__do_shift(kvr_request *r);
void kvr__do_stat(kvr_request *r);
void kvr__do_stats(kvr_request *r);
int  kvr__work_put(kvr_request *r, kvr_error *e);
int  kvr__work_edit(kvr_request *r, kvr_error *e);
int  kvr__work_get(kvr_request *r, kvr_error *e);
int  kvr__work_assemble(kvr_request *r, kvr_error *e);
void kvr__finish_put(kvr_request *r);
void kvr__finish_get(kvr_request *r);
void kvr__finish_edit(kvr_request *r);
void kvr__finish_assemble(kvr_request *r);
/* t_cover.c: the runs, and with get their placed K/V, sent as an assemble's. */
void kvr__do_cover(kvr_request *r);
void kvr__finish_cover(kvr_request *r);
/* t_kv.c: ends the assemble a reply's payload came from (send_ok's callback). */
void kvr__end_assemble_cb(void *arg, int status);
/* t_kv.c: an OK reply whose payload (payload bytes) is in the client's
 * region already (r->shm): resp names the slice. */
void kvr__send_shm_ok(kvr_request *r, Kvrope__Response *resp, size_t payload);
/* t_kv.c: an assembly's OK reply (t NULL: no payload): its payload named in
 * the client's region, or sent from t's memory; t ends either way. */
void kvr__send_assembled(kvr_request *r, Kvrope__Response *resp, kvr_assemble *t,
                         size_t payload);

#endif /* KVR_DAEMON_DISPATCH_H */
