/*
 * remote.h — the shared tier on Redis Cluster (docs/cluster.md), private to
 * daemon/: the value formats and key scheme (pure functions, tested on
 * their own), the publisher thread, and the fetch jobs that a miss in the
 * store runs on the threadpool: the store asks the tier through its miss
 * hooks (kvr_store_miss_hooks) whatever verb missed, and the request that
 * missed waits for the job (dispatch.c).
 *
 * Invariants:
 *  - Nothing read from the cluster is served before it is verified: with a
 *    cluster key (--remote-key-file), its keyed BLAKE2b MAC (libsodium) over
 *    the Redis key and the value, so only a holder of the key can write a
 *    value anyone takes; then magic, version, CRC32C over the whole value,
 *    its own description (fingerprint, shape, dtype, block size, chain
 *    hash) equal to what the key promised, and its tokens and positions
 *    equal to what the reader asked for. A value that fails any check is a
 *    miss (counted: remote_fetch_forged for a MAC, remote_fetch_corrupt for
 *    the rest). Without a key, anyone who can write to the cluster is
 *    trusted (logged at start).
 *  - The store is touched on the loop thread only: a publication snapshots
 *    the context there (a get), a fetch lands through a normal put there.
 *    The cluster is spoken to on other threads only (rcluster.h).
 *  - A failing cluster costs misses and publication errors, never local
 *    data: the local put is committed before anything is published.
 */
#ifndef KVR_REMOTE_H
#define KVR_REMOTE_H

#include <stddef.h>
#include <stdint.h>
#include <stdbool.h>

#include "cache/cache.h"
#include "daemon/metrics.h"

#define KVR_RT_BLOCK 64u            /* tokens per remote block */
#define KVR_RT_GRAIN 16u            /* granule of the sub-block prefix keys */
#define KVR_RT_KEY_MAX 64

typedef struct kvr_daemon kvr_daemon;
typedef struct kvr_conn kvr_conn;
typedef struct kvr_remote kvr_remote;
typedef struct kvr_rjob kvr_rjob;

/* What a value describes (the reader checks it against what it expects). */
typedef struct kvr_rt_desc {
    uint64_t  fingerprint;
    uint32_t  n_layers, n_kv_heads, head_dim;
    kvr_dtype dtype;
} kvr_rt_desc;

/* ---- keys and hashes (pure) -------------------------------------------- */
/* The chain seed of a model/dtype; chain_k = hash(chain_{k-1}, the tokens
 * and stored-at positions of block k). */
uint64_t kvr__rt_chain_seed(const kvr_rt_desc *d);
uint64_t kvr__rt_chain_next(uint64_t prev, const uint32_t *tokens, const int64_t *pos, size_t n);
/* "kvr1:b:{<16 hex>}" and "kvr1:m:{<16 hex of the id's hash>}"; return length. */
size_t kvr__rt_block_key(uint64_t chain, char out[KVR_RT_KEY_MAX]);
size_t kvr__rt_manifest_key(const char *ctx_id, char out[KVR_RT_KEY_MAX]);
/* "kvr1:q:{<16 hex>}": an encoded chunk of a quantized context. */
size_t kvr__rt_chunk_key(uint64_t chain, char out[KVR_RT_KEY_MAX]);
/* "kvr1:p:{<16 hex>}": the sub-block prefix key of the first e tokens of a
 * block (e a multiple of KVR_RT_GRAIN below the block's length), hash =
 * kvr__rt_chain_next(chain of the block before, those e tokens). Its value
 * (kvr__rt_sub_encode) names the whole block, so a prompt that leaves a
 * published block after e tokens still finds those e. */
size_t kvr__rt_sub_key(uint64_t sub_chain, char out[KVR_RT_KEY_MAX]);
#define KVR_RT_SUB_LEN 36u
void kvr__rt_sub_encode(const kvr_rt_desc *d, uint64_t block_chain, uint32_t block_n,
                       uint32_t e, uint8_t out[KVR_RT_SUB_LEN]);
/* 0 and the block's chain and length, or KVR_EIO (corrupt or not for d, e). */
int  kvr__rt_sub_decode(const uint8_t *v, size_t len, const kvr_rt_desc *d, uint32_t e,
                       uint64_t *block_chain, uint32_t *block_n, kvr_error *err);

/* ---- the MAC of a value (pure) ----------------------------------------- */
/* With a cluster key every value is stored as value || MAC, MAC = keyed
 * BLAKE2b-256 (crypto_generichash, key = BLAKE2b-256 of the key file's
 * secret) over the Redis key's length (8 bytes LE), the Redis key and the
 * value: a value is only good under the key it was written for. */
#define KVR_RT_MAC_LEN 32u
#define KVR_RT_KEY_BYTES 32u
void kvr__rt_mac(const uint8_t key[KVR_RT_KEY_BYTES], const char *rkey, size_t rklen,
                const uint8_t *v, size_t len, uint8_t out[KVR_RT_MAC_LEN]);
/* The cluster key from a key file: its content (a trailing newline cut)
 * must be at least 32 bytes and the file readable by its owner only.
 * 0, or KVR_EIO / KVR_EINVAL with the reason. */
int kvr__rt_key_read(const char *path, uint8_t key[KVR_RT_KEY_BYTES], kvr_error *err);

/* ---- values (pure) ----------------------------------------------------- */
/* A block value: header, tokens, positions, the block's K/V (layer-major,
 * [layer][K|V][n][heads][dim]), CRC32C. Returns a kvr_mem buffer. kv_rows
 * points at the context-wide payload (layer-major over n_ctx tokens);
 * the block is tokens [start, start + n). */
uint8_t *kvr__rt_block_encode(const kvr_rt_desc *d, uint64_t chain, uint64_t start,
                             const uint32_t *tokens, const int64_t *pos, size_t n,
                             const uint8_t *ctx_payload, size_t n_ctx, size_t *len);
/* Verifies a block value against what is expected and copies its K/V into
 * the context-wide payload dst (layer-major over n_ctx tokens) at start.
 * 0, or KVR_EIO (corrupt) / KVR_EFINGERPRINT / KVR_ESHAPE (mismatch), with
 * the reason in err. */
int kvr__rt_block_decode(const uint8_t *v, size_t len, const kvr_rt_desc *d, uint64_t chain,
                        uint64_t start, const uint32_t *tokens, const int64_t *pos, size_t n,
                        uint8_t *dst, size_t n_ctx, kvr_error *err);

typedef struct kvr_rt_manifest {
    kvr_rt_desc desc;
    char        ctx_id[KVR_ID_MAX + 1];
    char        model[KVR_ID_MAX + 1];
    size_t      n_tokens, n_blocks;
    uint64_t   *chains;              /* n_blocks */
    uint32_t   *tokens;              /* n_tokens */
    int64_t    *positions;           /* stored-at positions of the published KV */
    uint32_t   *flags;               /* KVR_TOKEN_* per token (only STALE is published) */
    int32_t    *groups;              /* group id per token (0 without groups) */
    kvr_layout_info layout;          /* APE record, groups, retention (kvr_store_layout_stat) */
    size_t      n_protected;         /* first tokens edits may not touch */
    /* A quantized context: its first n_raw tokens as encoded chunks of
     * `chunk` tokens ("KVRQ" values: the raw get's bytes, raw_kb K and
     * raw_vb V bytes per layer for all n_raw), the rest (its window) as
     * plain blocks in desc.dtype; chains seeded by the codec too. */
    bool        quant;
    char        codec[KVR_CODEC_NAME_MAX];
    size_t      n_raw, raw_kb, raw_vb;
    uint32_t    chunk, ktile;
} kvr_rt_manifest;

/* Values of a manifest in order: block b covers tokens [*start, *start + *n)
 * and is an encoded chunk (*chunk) or a plain block; its chain. */
size_t kvr__rt_manifest_blocks(const kvr_rt_manifest *m);
void   kvr__rt_manifest_block(const kvr_rt_manifest *m, size_t b, size_t *start, size_t *n,
                             bool *chunk);
void   kvr__rt_manifest_chains(const kvr_rt_manifest *m, uint64_t *out);

/* Version 2: version 1's fields, then each token's group id and the layout
 * (APE record, groups with offset and cursor, retention, protected count).
 * A version 1 manifest still decodes (group ids 0, no layout). */
uint8_t *kvr__rt_manifest_encode(const kvr_rt_manifest *m, size_t *len);
/* Parses and verifies; on 0 m's arrays are kvr_mem allocations (free with
 * kvr__rt_manifest_free). */
int  kvr__rt_manifest_decode(const uint8_t *v, size_t len, const char *want_id,
                            kvr_rt_manifest *m, kvr_error *err);
void kvr__rt_manifest_free(kvr_rt_manifest *m);

/* ---- the tier in the daemon -------------------------------------------- */
/* Connects (a wrong password is KVR_EUNAUTH here: the daemon does not
 * start; an unreachable cluster is logged and joined later). NULL *out if
 * --remote-tier is not set. */
int  kvr__remote_create(kvr_remote **out, kvr_daemon *d, kvr_error *err);
/* Loop thread, at shutdown before the loop's last run: stops the thread,
 * fails what is queued, closes the async handle. Then _destroy frees. */
void kvr__remote_close(kvr_remote *r);
void kvr__remote_destroy(kvr_remote *r);

/* Loop thread: snapshots ctx_id now (its blocks leased) and queues its
 * publication. done (may be NULL) is called on the loop thread once it is
 * published (rc 0) or failed (rc < 0, msg says why). Returns 0 (queued:
 * done will be called, also at shutdown), or a negative code (nothing
 * queued, done never called). */
typedef void (*kvr_remote_done_fn)(void *arg, int rc, const char *msg);
int  kvr__remote_publish(kvr_remote *r, const char *ctx_id, kvr_remote_done_fn done, void *arg,
                        kvr_error *err);

/* Fetch jobs: built on the loop by the store's miss hooks (NULL if nothing
 * to ask; a prefix job borrows the tokens: the request's), worked on the
 * threadpool, landed on the loop (a local put; 0 if a context now holds
 * the data, < 0 a miss, 1: work the job once more, then land it again —
 * a get by id opens its local put after the manifest and fetches the
 * blocks straight into it). Free aborts a put still open. */
kvr_rjob *kvr__remote_job_get(kvr_remote *r, const char *ctx_id);
/* What land returns when another fetch of the same id holds its local put
 * open (the store answers "being written"): the caller waits for that
 * fetch to end (kvr__remote_landing) and starts its verb again. */
#define KVR_RT_WAIT 2
kvr_rjob *kvr__remote_job_prefix(kvr_remote *r, const char *model, const uint32_t *tokens,
                                size_t n, size_t local_len);
void kvr__remote_job_work(kvr_rjob *j);
int  kvr__remote_job_land(kvr_rjob *j);
void kvr__remote_job_free(kvr_rjob *j);
/* A fetch by context id (else of a prompt's prefix). */
bool kvr__remote_job_by_id(const kvr_rjob *j);
/* The context id a fetch by id asks for (borrowed from j). */
const char *kvr__remote_job_id(const kvr_rjob *j);
/* Does j hold its local put open (a get by id between its two phases)? */
bool kvr__remote_job_open(const kvr_rjob *j);
/* Loop thread: is a fetch of ctx_id holding its local put open? Requests
 * that miss ctx_id meanwhile wait for that fetch instead of fetching it
 * again (their own put would be refused as "being written"). */
bool kvr__remote_landing(const kvr_remote *r, const char *ctx_id);

/* The tier's counters, read from atomics (each exact, not one instant
 * together: workers count while it is read). fetch_hist counts every
 * fetch job from its creation on the loop to its end (landed, a miss, or
 * abandoned), in kvr__metrics_bucket's buckets; the sum is in seconds. */
typedef struct kvr_remote_stats {
    bool     joined;
    uint64_t pub_contexts, pub_blocks, pub_skipped, pub_errors, pub_dropped;
    uint64_t fetch_hits, fetch_misses, fetch_corrupt, fetch_forged, fetch_tokens, probes;
    uint64_t moved, ask, refreshes, conn_errors;
    uint64_t fetch_hist[KVR_METRICS_N_BUCKETS + 1];   /* the count is their sum */
    double   fetch_seconds;
} kvr_remote_stats;
void kvr__remote_get_stats(kvr_remote *r, kvr_remote_stats *out);

#endif /* KVR_REMOTE_H */
