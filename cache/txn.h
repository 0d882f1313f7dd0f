/*
 * txn.h — what the transactions share (private to cache/; txn.c): the
 * payload a request sends or receives as iovecs, and for writes (put, edit,
 * refresh) the payload received straight into the destination blocks
 * (zero-copy, when the payload dtype is the storage dtype) or into a
 * staging buffer their work converts from.
 */
#ifndef KVR_CACHE_TXN_H
#define KVR_CACHE_TXN_H

#include "cache/store.h"

#pragma GCC visibility push(hidden)

/* A payload in wire order: `bytes` in total over iov[0..n_iov). */
typedef struct kvr_payload {
    struct iovec *iov;
    size_t        n_iov, bytes;
} kvr_payload;

/* The public payload accessors (cache.h) of a transaction: a struct `type`
 * whose member `member` is its kvr_payload. */
#define KVR_PAYLOAD_API(type, prefix, member)                                  \
    size_t prefix##_payload_size(const type *t)                                \
    {                                                                          \
        return t->member.bytes;                                                \
    }                                                                          \
    void prefix##_payload_iov(const type *t, const struct iovec **iov, size_t *n) \
    {                                                                          \
        *iov = t->member.iov;                                                  \
        *n = t->member.n_iov;                                                  \
    }

typedef struct kvr_wpay {
    kvr_payload   p;
    uint8_t      *staging;      /* NULL when zero-copy or not staged */
    bool          work;         /* the payload is converted by work (not
                                   zero-copy): from the staging, or from the
                                   caller's memory (kvr_put_work_from) */
    bool          worked;
} kvr_wpay;

/* Sets w up for `payload` bytes: iovecs into runs[0..n) (for n_layers
 * layers) when zero_copy, else work, from one staging buffer when `stage`
 * (else no iovecs: the caller hands the payload to work itself). 0 or
 * KVR_ENOMEM. */
int  kvr_wpay_init(kvr_wpay *w, const kvr_brun *runs, size_t n, uint32_t n_layers,
                   size_t payload, bool zero_copy, bool stage);
void kvr_wpay_free(kvr_wpay *w);

/* The public accessors of a write transaction: a struct `type` whose
 * member `w` is its kvr_wpay. */
#define KVR_WRITE_TXN_API(type, prefix)                                        \
    KVR_PAYLOAD_API(type, prefix, w.p)                                         \
    bool prefix##_needs_work(const type *t)                                    \
    {                                                                          \
        return t->w.work && !t->w.worked;                           \
    }

#pragma GCC visibility pop

#endif /* KVR_CACHE_TXN_H */
