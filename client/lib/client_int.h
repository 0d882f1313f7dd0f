/*
 * client_int.h — private to client/lib: the handle's layout and the request
 * exchange shared by the verbs (ops.c) and the connection code (client.c).
 */
#ifndef KVR_CLIENT_INT_H
#define KVR_CLIENT_INT_H

#include <stddef.h>
#include <stdint.h>

#include "client/kvrope.h"
#include "kvrope.pb-c.h"

struct kvr_client {
    int             fd;            /* -1 once closed */
    int             timeout_ms;    /* receive wait (poll); 0 = forever */
    uint64_t        next_id;
    char            err[512];      /* last error message, "" after success */
    kvr_progress_fn progress;
    void           *progress_ud;
    uint8_t        *rbuf;          /* read-ahead: bytes [rpos, rlen) pending */
    size_t          rcap, rpos, rlen;
    /* Placed receive: the caller's buffer for the next answer's payload
     * (rx_dst, rx_cap; set around one call), and payload bytes already
     * received there ahead of the message's parsing (pre, pre_len: they
     * are consumed before anything else, in place when read into pre). */
    uint8_t        *rx_dst;
    size_t          rx_cap;
    uint8_t        *pre;
    size_t          pre_len;
    uint8_t        *wbuf;          /* header + packed request */
    size_t          wcap;
    /* Shared memory (shm.c). */
    struct kvr__region *regions;   /* n_regions registered on this connection */
    size_t          n_regions, cap_regions;
    bool            shm_next;      /* kvr_client_shm_next: the next call's */
    kvr_shm         shm_at;        /*   payload is at shm_at */
    bool            shm_got;       /* the last response's payload is in a region */
    kvr_shm         shm_res;       /*   there (length = its size) */
    int             send_fd;       /* sent with the next frame (-1: none) */
    bool            just_sent;     /* a request went out since the last receive:
                                      the answer is rarely there yet (poll first) */
    /* Deferred requests (kvr_client_delete_deferred): packed frames sent
     * ahead of the next call's, their ids, and failures so far. */
    uint8_t        *dbuf;
    size_t          dlen, dcap;
    uint64_t        did[KVR_DEFER_MAX];
    size_t          n_deferred;
    uint64_t        defer_failures;
    char            defer_err[256];
};

struct kvr__region {
    uint32_t id;
    uint8_t *base;
    size_t   size;
    int      fd;                   /* the library's (created or mapped): closed */
    bool     owned;                /* base was mapped by the library */
};


/* Sets c->err and returns code (the connection stays open). */
#define KVR_HIDDEN __attribute__((visibility("hidden")))

KVR_HIDDEN int kvr__fail(kvr_client *c, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Sends req (id assigned here) with an optional payload, reads the response.
 * A non-OK status becomes its negated code with c->err set, and *out stays
 * NULL. On success *out is the caller's (kvrope__response__free_unpacked).
 * resp_payload NULL: any response payload is drained; else its length is
 * stored and the payload is left on the socket for kvr__recv_payload. */
KVR_HIDDEN int kvr__call(kvr_client *c, Kvrope__Request *req, const struct iovec *piov, size_t piovcnt,
              uint64_t payload_len, Kvrope__Response **out, uint64_t *resp_payload);
/* Declares req, a request whose body is `body` in its oneof case CASE
 * (field: the member protobuf-c gives it). */
#define KVR_REQUEST(req, CASE, field, body)                                     \
    Kvrope__Request req = KVROPE__REQUEST__INIT;                                \
    req.body_case = KVROPE__REQUEST__BODY_##CASE;                               \
    req.field = (body)

/* Where the next kvr__call's answer payload will go (the caller's buffer,
 * given to kvr__recv_payload as dst): it may be received there together
 * with the message, with no copy. Cleared by that call. */
KVR_HIDDEN void kvr__place_next(kvr_client *c, void *dst, size_t cap);

/* Receives a response payload of pl bytes into dst (or a library buffer)
 * and records it in kv; kv->n_layers/layers must be set for on_layer. */
KVR_HIDDEN int kvr__recv_payload(kvr_client *c, uint64_t pl, kvr_kv *kv, void *dst, size_t dst_cap,
                      kvr_layer_fn fn, void *ud);
KVR_HIDDEN int kvr__drain(kvr_client *c, uint64_t n);
/* Queues req (no payload; id assigned here) to go out ahead of the next
 * call's frame (kvr_client_delete_deferred). */
KVR_HIDDEN int kvr__defer(kvr_client *c, Kvrope__Request *req);

/* The region's bytes at [offset, offset + len) in this process, or NULL. */
KVR_HIDDEN void *kvr__shm_ptr(kvr_client *c, const kvr_shm *at);
KVR_HIDDEN void kvr__shm_free_all(kvr_client *c);

#endif
