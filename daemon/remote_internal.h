/*
 * remote_internal.h — what the three files of the shared tier share, and
 * nothing else includes (private to remote_wire.c, remote_pub.c and
 * remote_fetch.c; remote.h is the tier's face to the rest of daemon/):
 *
 *   remote_wire.c   the value formats and keys: pure functions, no I/O,
 *                   no store (tested on their own);
 *   remote_pub.c    the tier's life (create, close, destroy, joining the
 *                   cluster), the publisher thread and its queue, the
 *                   counters;
 *   remote_fetch.c  the fetch jobs a miss in the store runs on the
 *                   threadpool, and their landing on the loop thread.
 *
 * Invariants: the fields of struct kvr_remote above the counters are
 * written on the loop thread before the publisher starts and after it
 * stopped, or under mu; the counters are atomics any thread adds to. The
 * wire helpers below read and write little-endian bytes and never
 * allocate more than a length they checked.
 */
#ifndef KVR_REMOTE_INTERNAL_H
#define KVR_REMOTE_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <string.h>

#include <sodium.h>

#include "daemon/daemon_internal.h"
#include "daemon/rcluster.h"
#include "daemon/remote.h"

#define BLOCK_MAGIC "KVRB"
#define MANIFEST_MAGIC "KVRM"
#define RT_VERSION 1u            /* of block values */
#define MANIFEST_VERSION 2u      /* 2: + group ids and the layout */
#define LAYOUT_FIXED (4 + 256 + 24 + 4 + 32)   /* flags, prefix record, n_groups, ret, protected */
#define GROUP_REC (KVR_GROUP_NAME_MAX + 1 + 16)
#define BLOCK_HDR 56u
#define MANIFEST_HDR 568u
#define MAX_TOKENS (1u << 28)
#define QUANT_SEC (KVR_CODEC_NAME_MAX + 32)   /* a quantized manifest's codec section */
#define SET_GROUP 16            /* blocks encoded and SET per pipeline, at most */
#define SET_GROUP_BYTES (32u << 20)   /* and about this many bytes */
#define REJOIN_MS 1000
/* Deadlines (docs/cluster.md): a fetch (get or match that asks the
 * cluster) ends FETCH_MS after the request asked, whatever the cluster
 * does, plus, once it knows how much K/V it is reading, 1 ms per
 * SLOW_BYTES_PER_MS of it (a large context is not cut off by a cluster
 * that answers at 100 MiB/s or more); a publication PUBLISH_MS (+ the same
 * for its bytes) after it was queued (a share_sync is answered by then);
 * the queue holds at most PUB_QUEUE_MAX publications and snapshots of at
 * most a quarter of --max-memory, beyond which a share is dropped (counted)
 * instead of waiting. */
#define FETCH_MS 3000
#define PUBLISH_MS 5000
#define SLOW_BYTES_PER_MS ((100u << 20) / 1000)
#define PUB_QUEUE_MAX 32

/* ---- wire helpers (remote_wire.c) --------------------------------------- */

static inline void put32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }
static inline void put64(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); }
static inline uint32_t get32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline uint64_t get64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }

static inline size_t row_bytes(const kvr_rt_desc *d)
{
    return (size_t)d->n_kv_heads * d->head_dim * kvr_dtype_size(d->dtype);
}

/* Bytes of n tokens' K/V over all layers, or 0 on overflow. */
static inline size_t kv_bytes(const kvr_rt_desc *d, size_t n)
{
    size_t row = row_bytes(d);
    if (row == 0 || n > SIZE_MAX / row / 2 / (d->n_layers ? d->n_layers : 1))
        return 0;
    return (size_t)d->n_layers * 2 * n * row;
}

/* Where decoded K/V goes: one flat layer-major payload, or the same bytes
 * spread over iovecs (a put's, straight into block memory); starts[i] is
 * the payload offset of iov[i]. */
typedef struct rt_dst {
    uint8_t            *flat;
    const struct iovec *iov;
    size_t              niov;
    const size_t       *starts;
} rt_dst;

/* Where a block's K/V is read from when it is encoded: the same two forms
 * (a flat payload, or a get's iovecs: block memory, leased). */
typedef rt_dst rt_src;

#define CHUNK_MAGIC "KVRQ"
#define CHUNK_HDR 128u

/* Per layer, the K and V bytes of n encoded tokens (n a multiple of the
 * K tile): proportional to the manifest's totals for n_raw tokens. */
static inline size_t chunk_kb(const kvr_rt_manifest *m, size_t n)
{
    return m->n_raw ? m->raw_kb / (m->n_raw / m->ktile) * (n / m->ktile) : 0;
}

static inline size_t chunk_vb(const kvr_rt_manifest *m, size_t n)
{
    return m->n_raw ? m->raw_vb / m->n_raw * n : 0;
}

static inline size_t chunk_len(const kvr_rt_manifest *m, size_t n)
{
    return CHUNK_HDR + n * 12 + m->desc.n_layers * (chunk_kb(m, n) + chunk_vb(m, n)) + 4;
}

/* Offset in the raw payload (a raw get's / a raw put's: per layer K bytes
 * then V bytes of all n_raw tokens) of layer l's K (kv 0) or V of the
 * tokens from s. */
static inline size_t raw_off(const kvr_rt_manifest *m, size_t l, int kv, size_t s)
{
    return l * (m->raw_kb + m->raw_vb) + (kv ? m->raw_kb + chunk_vb(m, s) : chunk_kb(m, s));
}

/* A block value's checks (magic, version, length, CRC32C unless crc_ok,
 * its description, tokens and positions) against what the reader expects. */
int kvr__rt_block_check(const uint8_t *v, size_t len, bool crc_ok, const kvr_rt_desc *d,
                        uint64_t chain, uint64_t start, const uint32_t *tokens,
                        const int64_t *pos, size_t n, kvr_error *err);
/* The head of a block value named by a prefix key: its first e tokens
 * checked and their K/V decoded into dst (see remote_wire.c). */
int kvr__rt_decode_head(const uint8_t *v, size_t len, const kvr_rt_desc *d, uint64_t prev,
                        uint64_t chain, uint64_t start, size_t n, const uint32_t *tokens,
                        const int64_t *pos, size_t e, uint8_t *dst, size_t n_ctx,
                        kvr_error *err);
/* kvr__rt_block_encode from either form of source (a flat payload or a
 * get's iovecs). */
uint8_t *kvr__rt_encode_from(const kvr_rt_desc *d, uint64_t chain, uint64_t start,
                             const uint32_t *tokens, const int64_t *pos, size_t n,
                             const rt_src *src, size_t n_ctx, size_t *len);
/* Value b of a quantized manifest as an encoded chunk ("KVRQ"), from the
 * raw get's bytes; its checks. */
uint8_t *kvr__rt_chunk_encode(const kvr_rt_manifest *m, size_t b, uint64_t chain,
                              const rt_src *raw, size_t *len);
int kvr__rt_chunk_check(const uint8_t *v, size_t len, bool crc_ok, const kvr_rt_manifest *m,
                        size_t b, uint64_t chain, kvr_error *err);
/* A value's MAC in steps (kvr__rt_mac's): begin with the key and the Redis
 * key, crypto_generichash_update the value, then compare with tag. */
void kvr__rt_mac_begin(crypto_generichash_state *st, const uint8_t *key, const char *rkey,
                       size_t rklen);
bool kvr__rt_mac_end_ok(crypto_generichash_state *st, const uint8_t *tag);

/* ---- the tier (remote_pub.c) --------------------------------------------- */

typedef struct pub_job pub_job;

struct kvr_remote {
    kvr_daemon     *d;
    kvr_rc         *rc;
    pthread_t       th;
    bool            th_started;
    pthread_mutex_t mu;
    pthread_cond_t  cv;
    bool            stop;
    kvr_list        queue;           /* pub_job.link, oldest first (mu) */
    kvr_list        finished;        /* published or failed, oldest first (mu) */
    kvr_list        landing;         /* fetch jobs with their local put open
                                      * (kvr_rjob.link; loop thread) */
    size_t          q_len;
    size_t          pending_bytes;   /* snapshots queued or being published (mu) */
    uv_async_t      async;
    bool            has_async;
    atomic_bool     joined;
    atomic_uint_fast64_t last_try_ms;
    bool            keyed;      /* values carry a MAC under key */
    uint8_t         key[KVR_RT_KEY_BYTES];
    /* metrics */
    atomic_uint_fast64_t pub_contexts, pub_blocks, pub_skipped, pub_errors, pub_dropped;
    atomic_uint_fast64_t fetch_hits, fetch_misses, fetch_corrupt, fetch_forged, fetch_tokens;
    atomic_uint_fast64_t probes;
    atomic_uint_fast64_t fetch_hist[KVR_METRICS_N_BUCKETS + 1], fetch_ns;
};

/* Is the cluster usable? If we have not joined, try (at most every
 * REJOIN_MS; between tries callers get a fast "no"). Any thread. */
bool kvr__remote_up(kvr_remote *r);

#endif /* KVR_REMOTE_INTERNAL_H */
