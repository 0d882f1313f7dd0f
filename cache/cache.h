/*
 * cache.h — kvrope's store: model profiles, contexts of tokens with their
 * K/V blocks, the per-model prefix index, memory accounting and eviction.
 * This is the whole public API of cache/; it depends on rope/ and libc only
 * (no libuv), so it builds and tests on its own.
 *
 * Threading. A kvr_store is single-threaded: every kvr_store_* call, and the
 * begin/commit/abort/end calls of a transaction, happen on one thread (the
 * daemon's loop thread). The *_work calls of a transaction may run on any
 * other thread while the store goes on serving: they touch only memory the
 * transaction owns or has leased, never the store's maps.
 *
 * Per-token model (docs/formats.md, docs/protocol.md). Every token of a context has: its token id,
 * its logical position (what attention sees now), the position its stored key
 * is rotated at ("stored-at"), a group id and flags (KVR_TOKEN_APPROX). Edits,
 * shifts and layouts change logical positions only; a key is rotated from its
 * stored form once per read, so error never accumulates.
 *
 * Memory. Every allocation of the daemon goes through kvr_mem_* (jemalloc in
 * release builds, libc under sanitizers); the cap is checked against what the
 * allocator really holds (usable sizes), not what was requested.
 *
 * Errors: 0 or a negative KVR_E* code; functions that can fail take a
 * kvr_error * (may be NULL) and fill a human-readable message.
 */
#ifndef KVR_CACHE_H
#define KVR_CACHE_H

#include <stddef.h>
#include <stdint.h>
#include <stdbool.h>
#include <sys/uio.h>

#include "rope/rope.h"
#include "base/types.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- errors: KVR_E*, kvr_error, kvr_error_set, kvr_strerror come from
 * base/error.h (included through rope/rope.h): one space for the project. */

/* ---- accounted memory --------------------------------------------------- */
/* Process-wide and thread-safe. All of kvroped's allocations (store, libuv via
 * uv_replace_allocator, protobuf-c via kvr_mem_protobuf_allocator) go here. */
void  *kvr_mem_malloc(size_t n);
void  *kvr_mem_calloc(size_t count, size_t size);
void  *kvr_mem_realloc(void *p, size_t n);
/* The same, from the prefix index's own arena (huge pages under jemalloc:
 * mem.c); freed with kvr_mem_free. */
void  *kvr_mem_index_malloc(size_t n);
void  *kvr_mem_index_calloc(size_t count, size_t size);
void  *kvr_mem_index_realloc(void *p, size_t n);
void  *kvr_mem_aligned(size_t align, size_t n);    /* free with kvr_mem_free */
void   kvr_mem_free(void *p);
/* What an allocation of n will really hold (its size class; a large one
 * from kvr_mem_malloc / calloc / realloc also holds a page more: kvr_mem_held). */
size_t kvr_mem_size_class(size_t n);
/* What the allocator holds for p, a kvr_mem_* pointer: what is accounted
 * for it (mem.c). 0 for NULL. */
size_t kvr_mem_held(const void *p);
/* A request's staging buffer (at least 64-byte aligned): large ones are kept
 * for the next request of about their size instead of being handed back
 * (no page faults; one kept per process, of at most 256 MiB, unaccounted
 * while unused); kvr_mem_trim frees the kept one (idle purge, the store's
 * cap reached, store destroy). Free with kvr_mem_staging_free. */
#define KVR_STAGING_ALIGN 64u
void  *kvr_mem_staging(size_t n);
void   kvr_mem_staging_free(void *p);
void   kvr_mem_trim(void);
/* memcpy for part of a large copy (over the cache's size) into memory
 * nobody reads soon (a put's blocks): non-temporal stores, so the
 * destination's lines are not read in first. The same bytes. */
void   kvr_mem_copy_stream(void *dst, const void *src, size_t n);
size_t kvr_mem_allocated(void);   /* bytes the allocator holds for us now */
size_t kvr_mem_peak(void);
/* Test hook (mem.c): the nth kvr_mem_* allocation from now fails (NULL),
 * and with sticky every later one too; 0 turns it off. Returns false if
 * compiled out (KVR_NO_FAULT_INJECT). kvr_mem_fault_failed: allocations
 * failed since the last set. */
bool     kvr_mem_fault_set(uint64_t nth, bool sticky);
uint64_t kvr_mem_fault_failed(void);

/* ---- store -------------------------------------------------------------- */
/* KVR_ID_MAX, KVR_CODEC_NAME_MAX: base/types.h (shared with kvrope.h). */

typedef struct kvr_store kvr_store;

typedef struct kvr_store_config {
    size_t   max_memory;        /* cap on kvr_mem_allocated(); 0 = unlimited */
    uint32_t block_tokens;      /* tokens per block; 0 = default (64) */
    size_t   max_contexts;      /* contexts (forks included); 0 = unlimited;
                                   a create or fork past it is KVR_ELIMIT */
    uint32_t max_models;        /* registered models; 0 = unlimited (KVR_ELIMIT) */
    size_t   max_memory_per_model; /* bound on one model's block bytes (its
                                   tenants' share of the cap); 0 = none. A
                                   put over it evicts that model's own least
                                   recently used contexts, never another
                                   model's; the first 63 models are bounded */
    size_t   block_cache;       /* bytes of freed blocks kept for reuse by the next
                                   blocks of the same geometry (at most
                                   KVR_BLOCK_CACHE_N, never over max_memory / 16);
                                   0 = none. Counted in mem_allocated, dropped
                                   first at the memory cap (kvr_store_trim) */
} kvr_store_config;

int  kvr_store_create(kvr_store **out, const kvr_store_config *cfg, kvr_error *err);
void kvr_store_destroy(kvr_store *s);                /* NULL is a no-op */
/* Gives back memory kept for reuse (the block cache, the kept staging
 * buffer): the daemon's idle purge. Returns the cache's bytes freed. */
size_t kvr_store_trim(kvr_store *s);

/* A tier that holds contexts the store does not (the daemon's Redis
 * Cluster tier, docs/cluster.md): the store asks it on a miss, as it asks
 * the disk tier through its hooks (store.h), so every verb that names a
 * context or matches a prefix sees the tier's contexts the same way.
 * Fetching is slow I/O and the store's verbs do not wait: a hook that takes
 * a miss arranges the fetch and the verb fails with KVR_EFETCH, changing
 * nothing; its caller fetches (off its loop thread), lands what it got with
 * an ordinary put, and runs the verb again (when the hook declines, the
 * verb sees the plain miss). Both hooks run on the thread that called the
 * verb, with the store's arguments borrowed for the call. */
typedef struct kvr_store_miss_hooks {
    /* Context id (a valid id) is not in the store, or only pending (an
     * open create-put, which readers do not see): true to take the miss.
     * Delete and put never ask. */
    bool  (*ctx)(void *arg, const char *id);
    /* A match of n tokens of model found only `local` of them: true to take
     * the miss. */
    bool  (*prefix)(void *arg, const char *model, const uint32_t *tokens, size_t n,
                    size_t local);
    void   *arg;
} kvr_store_miss_hooks;
/* Installs (copies) h; NULL removes the hooks. */
void kvr_store_set_miss_hooks(kvr_store *s, const kvr_store_miss_hooks *h);

/* ---- models ------------------------------------------------------------- */
typedef struct kvr_model_desc {
    const char     *name;
    uint32_t        n_layers, n_kv_heads, head_dim;
    kvr_dtype       dtype;             /* native dtype of the model's KV */
    kvr_rope_config rope;              /* head_dim must agree */
    const char     *codec;             /* default codec of its contexts
                                          (docs/quantized.md grammar, e.g.
                                          "k4v2"); NULL/"" = dtype, plain */
} kvr_model_desc;

typedef struct kvr_model_info {
    char     name[KVR_ID_MAX + 1];
    uint32_t n_layers, n_kv_heads, head_dim;
    kvr_dtype dtype;
    uint64_t fingerprint;              /* shape + RoPE parameters + dtype */
    const kvr_rope_config *rope;       /* borrowed; lives as long as the store */
    const kvr_rope *engine;            /* borrowed; likewise */
    size_t   n_contexts;
    char     codec[KVR_CODEC_NAME_MAX];  /* default codec, canonical spec */
    /* As a tenant: bytes of its blocks (0 if not counted apart: past the
     * 63rd model), blocks / bytes evicted from its contexts (dropped or
     * spilled), prefix matches asked and found, writes refused at its
     * bound (max_memory_per_model). */
    size_t   bytes;
    uint64_t n_evicted_blocks, n_evicted_bytes, n_matches, n_match_hits;
    uint64_t n_refused_bound;
} kvr_model_info;

/* Canonical form of a codec spec for model `model` (0, KVR_ENOMODEL or
 * KVR_EINVAL with a message naming what is wrong). */
int kvr_store_codec_check(const kvr_store *s, const char *model, const char *spec,
                          char out[KVR_CODEC_NAME_MAX], kvr_error *err);

/* Registering a name again with an identical fingerprint succeeds (and
 * returns the existing profile); with a different one it is KVR_EEXIST. */
int kvr_store_model_register(kvr_store *s, const kvr_model_desc *d,
                             kvr_model_info *out, kvr_error *err);
int kvr_store_model_find(const kvr_store *s, const char *name, kvr_model_info *out);
/* The shape alone (what a request that leaves it out defaults to), without
 * filling a whole kvr_model_info; KVR_ENOMODEL if absent. */
int kvr_store_model_shape(const kvr_store *s, const char *name, uint32_t *n_layers,
                          uint32_t *n_kv_heads, uint32_t *head_dim);
/* Removes a model that no context uses (KVR_EBUSY naming how many do, or
 * while any read holds leases: its work may still use a model whose last
 * context was deleted meanwhile; KVR_ENOMODEL if unknown). A model the disk tier has persisted is
 * KVR_EUNSUPPORTED (its record would bring it back at the next start). */
int kvr_store_model_remove(kvr_store *s, const char *name, kvr_error *err);
/* Fills up to cap entries, returns the number of models. */
size_t kvr_store_model_list(const kvr_store *s, kvr_model_info *out, size_t cap);

/* ---- put: create or append ---------------------------------------------- */
/* kvr_put_mode (KVR_PUT_CREATE / APPEND / UPSERT): base/types.h. */

typedef struct kvr_put_params {
    const char     *ctx_id;
    const char     *model;
    kvr_put_mode    mode;
    uint64_t        fingerprint;   /* 0 = unchecked; else must equal the model's */
    uint32_t        n_layers, n_kv_heads, head_dim;  /* as the client states them */
    kvr_dtype       dtype;         /* dtype of the payload */
    size_t          n_tokens;
    const uint32_t *tokens;        /* n_tokens ids; copied by put_begin */
    const int64_t  *positions;     /* NULL: contiguous from pos_start; copied */
    bool            has_pos_start; /* default: last position + 1 (0 if new) */
    int64_t         pos_start;
    bool            pin;           /* pin the context after commit */
    /* Position layouts (layout.c); all optional, zero = unused. */
    const char     *prefix_ctx;    /* create: the APE prefix context this KV was
                                      encoded after; recorded (id, model
                                      fingerprint, length P, token hash) and
                                      positions default to P, P+1, ... */
    const char *const *groups;     /* create: n_groups group names (GPE) */
    size_t          n_groups;
    const int64_t  *group_offsets; /* create: start offset phi per group, NULL = 0 */
    bool            v_trans;       /* create: the KV comes from an engine whose V
                                      cache is transposed (llama.cpp, flash
                                      attention off). Only recorded (layout.c;
                                      kept by fork, persistence, the shared
                                      tier) so an export can default to it;
                                      V is stored per token either way. An
                                      append keeps the context's record. */
    const char     *group;         /* grouped context: the group these tokens
                                      join; they take its next positions
                                      (phi + cursor, ...); no explicit positions */
    const char     *codec;         /* create: storage codec (docs/quantized.md);
                                      NULL/"" = the model's default. Quantized
                                      codecs store keys pre-RoPE: the put's
                                      rotated keys are un-rotated at their
                                      positions (full precision) first. A
                                      payload with nan/inf is KVR_EINVAL
                                      naming the layer and token. */
    bool            has_payload_bytes; /* the sender's declared payload length:  */
    size_t          payload_bytes;     /* checked before anything is reserved or
                                          evicted (KVR_EPAYLOAD), so a refused
                                          put changes nothing */
    bool            persist;       /* mark the context persistent (tier.c):
                                      every later change is logged to disk
                                      (kvr_store_persist); needs a disk tier */
    bool            has_protect_first; /* set n_protected at commit (0 removes */
    size_t          protect_first;     /* it), after retention, clamped to what
                                          the context then holds: part of the
                                          put, so a stored put never fails on
                                          it. KVR_ERANGE at begin if beyond the
                                          length the context will have. */
    /* Encoded data (the shared tier: a context another node published):
     * create only, quantized codec. The first raw_tokens tokens (a multiple
     * of the codec's K tile) arrive encoded, as a raw get returns them
     * (for each layer K bytes then V bytes; keys pre-RoPE), and go into
     * quantized blocks as they are; the rest arrives in `dtype` (keys
     * rotated at their positions) and goes to the window. The payload is
     * those raw bytes followed by the window's layer-major K/V. Nothing is
     * re-quantized: the context holds exactly the sender's codes. */
    bool            raw;
    size_t          raw_tokens;
    /* The payload will be handed to kvr_put_work_from (private memory), not
     * written into the iovecs: a put that converts or quantizes then
     * reserves and allocates no staging buffer, and its payload iovecs are
     * empty (one stored as it is keeps its iovecs into the blocks). */
    bool            work_from;
} kvr_put_params;

typedef struct kvr_put_result {
    size_t  n_tokens;              /* context length after the put */
    size_t  first_index;           /* index of the first token put */
    int64_t first_pos, last_pos;   /* positions given to the new tokens */
} kvr_put_result;

typedef struct kvr_put kvr_put;

/* Validates everything that can be validated before the payload arrives
 * (model, fingerprint, shapes, positions, id rules, busy), reserves memory
 * (evicting if it must; KVR_ENOMEM if the cap cannot be met) and prepares
 * destination memory. While a put is open its context is busy: another put
 * (or edit) of the same id fails with KVR_EBUSY; reads see only committed
 * tokens. On success the caller owns *out until commit or abort. */
int    kvr_store_put_begin(kvr_store *s, const kvr_put_params *p, kvr_put **out,
                           kvr_error *err);
/* Exact payload size in bytes: n_layers * 2 * n_tokens * heads * dim * dsize. */
size_t kvr_put_payload_size(const kvr_put *t);
/* Where the payload's bytes go, in wire order (layer-major: for each layer K
 * then V, each [tokens][heads][dim]); the iovecs cover exactly
 * payload_size bytes and point into block memory when no conversion is
 * needed. Borrowed, valid until commit/abort. */
void   kvr_put_payload_iov(const kvr_put *t, const struct iovec **iov, size_t *n);
/* Heavy part (dtype conversion, checks on the values): any thread. */
bool   kvr_put_needs_work(const kvr_put *t);
int    kvr_put_work(kvr_put *t, kvr_error *err);
/* Instead of filling the iovecs and kvr_put_work: the payload (len must be
 * payload_size; wire order) read from the caller's memory, which must stay
 * valid and unchanged during the call. A put that converts or quantizes
 * reads it straight from there (no staging copy: a quantized put encodes
 * from it); one stored as it is copies it into the blocks. Any thread,
 * once; the same checks and errors as kvr_put_work (KVR_EPAYLOAD for a
 * wrong len). After a failure the put can only be aborted (a commit fails
 * too; the staging was never filled). Begin the put with work_from set so
 * that it allocates no staging it would never use.
 * Never on memory another process (or an unsynchronized thread) can write:
 * not a client's shared-memory region (daemon/shm.c). The work reads a
 * value more than once: the nan/inf scan of the window tokens (and of a
 * raw put's window) and then their copy into the blocks, a quantized
 * side's encode and then its error measure; on memory that changes in
 * between, a value checked finite could be stored as a nan or inf. A
 * shared region is copied into the iovecs first and then worked
 * (kvr_put_work: every check runs on the daemon's copy; dispatch.c's
 * shm_copy_in). */
int    kvr_put_work_from(kvr_put *t, const void *payload, size_t len, kvr_error *err);
/* Loop thread. Links the new tokens into the context and the prefix index,
 * and frees t whether it succeeds or not; on failure nothing changed. */
int    kvr_put_commit(kvr_put *t, kvr_put_result *res, kvr_error *err);
/* Loop thread. Discards everything; the context is exactly as before. */
void   kvr_put_abort(kvr_put *t);

/* ---- get ---------------------------------------------------------------- */
/* Token flags KVR_TOKEN_APPROX / _PENDING / _STALE: base/types.h. */

typedef struct kvr_get_params {
    const char     *ctx_id;
    size_t          start;         /* token index range [start, end) */
    size_t          end;           /* SIZE_MAX = to the end */
    kvr_dtype       dtype;         /* output dtype */
    const int64_t  *positions;     /* NULL = current logical positions, else
                                      end-start target positions (copied) */
    size_t          n_positions;   /* entries in positions; 0 = end-start
                                      (added: lets the store check the count) */
    const uint32_t *layers;        /* NULL = all layers, else n_layers_sel ids */
    size_t          n_layers_sel;
    bool            meta_only;     /* no payload, just tokens/positions/flags */
    bool            raw;           /* quantized contexts: the encoded rows/tiles
                                      as stored (docs/quantized.md), keys
                                      pre-RoPE; dtype and positions ignored */
    void           *dst;           /* NULL, or where work produces the whole
                                      payload (wire order) instead of staging
                                      plus zero-copy runs: a client's shared
                                      memory. dst_cap bytes, caller's, valid
                                      until kvr_get_end; KVR_ERANGE if the
                                      payload does not fit. Not for raw gets.
                                      The payload iovecs then point into dst. */
    size_t          dst_cap;
} kvr_get_params;

typedef struct kvr_get_info {
    kvr_model_info  model;
    size_t          start, n_tokens;
    kvr_dtype       dtype;
    size_t          n_layers;      /* layers in the payload */
    const uint32_t *layers;        /* their ids */
    const uint32_t *tokens;        /* n_tokens ids */
    const int64_t  *positions;     /* positions the keys are rotated at */
    const uint32_t *flags;         /* KVR_TOKEN_* per token */
    const int32_t  *groups;        /* group id per token */
    bool            raw;           /* payload is encoded (docs/quantized.md) */
    char            codec[KVR_CODEC_NAME_MAX];  /* the context's codec */
    size_t          k_bytes, v_bytes;  /* raw: bytes of one layer's K / V */
} kvr_get_info;

typedef struct kvr_get kvr_get;

/* Resolves the range, leases the blocks (nothing they hold is freed until
 * kvr_get_end, whatever happens to the context meanwhile) and copies the
 * metadata. Owned by the caller until kvr_get_end. */
int  kvr_store_get_begin(kvr_store *s, const kvr_get_params *p, kvr_get **out,
                         kvr_error *err);
const kvr_get_info *kvr_get_get_info(const kvr_get *t);  /* borrowed */
/* Staging on demand: begin reserves no staging. A caller says how the
 * payload goes out, on the loop thread, before any work: kvr_get_stage (the
 * iovecs: the whole staging buffer is reserved against the memory cap and
 * allocated), kvr_get_stage_ring (streamed: only a ring of chunks), or
 * nothing for kvr_get_copy_into and gets with a dst (no staging at all).
 * No-op when nothing is staged or it is staged already; 0, or the
 * reservation's KVR_ETOOLARGE / KVR_ENOMEM (the get is unchanged: end it).
 * A get that needs staging and was not staged is staged whole by its first
 * kvr_get_work / kvr_get_work_layers, which then must run on the loop
 * thread (KVR_EINTERNAL on any other). Until staged, the payload iovecs are
 * empty unless nothing needs staging. */
int  kvr_get_stage(kvr_get *t, kvr_error *err);
/* Rotation / conversion into the response buffer: any thread (once staged). */
bool kvr_get_needs_work(const kvr_get *t);
int  kvr_get_work(kvr_get *t, kvr_error *err);
/* The payload, in wire order, valid after work (if needed) until end. May
 * point straight into block memory (zero-copy). */
size_t kvr_get_payload_size(const kvr_get *t);
void   kvr_get_payload_iov(const kvr_get *t, const struct iovec **iov, size_t *n);
/* Layer by layer, for streaming a response while it is produced (payload
 * layer i = the i-th entry of kvr_get_info.layers, not a model layer id):
 *  - kvr_get_work_layers does the work of payload layers [l0, l1) only
 *    (KVR_EINVAL if l0 > l1 or l1 > n_layers). Any thread. The first call
 *    must return before any other starts (it also does the get's one-time
 *    preparation, such as the disk-tier load); after that, calls on
 *    disjoint ranges may run concurrently. Once every layer has been worked
 *    the payload is complete; kvr_get_needs_work still answers for the
 *    whole-range kvr_get_work, which remains the call for everyone else.
 *  - kvr_get_payload_iov_layers gives the iovecs covering exactly those
 *    layers' bytes, in wire order (a sub-array of kvr_get_payload_iov's;
 *    n = 0 for an empty or invalid range). Their bytes are valid once the
 *    range has been worked (if work is needed), until kvr_get_end. */
int  kvr_get_work_layers(kvr_get *t, size_t l0, size_t l1, kvr_error *err);
void kvr_get_payload_iov_layers(const kvr_get *t, size_t l0, size_t l1,
                                const struct iovec **iov, size_t *n);
/* A streamed get that works and sends its layers `per` at a time, in
 * order, with at most `slots` chunks between their work and the end of
 * their write: instead of kvr_get_stage, the staging is a ring of `slots`
 * chunks, and only the ring is reserved (memory bounded by the chunk, not
 * the context; pages reused, not faulted in per request). Chunk k's
 * iovecs then stay valid only until chunk k + slots is worked. Loop
 * thread, before any work; where the ring would not be smaller, the whole
 * staging (kvr_get_stage). 0, or as kvr_get_stage. */
int  kvr_get_stage_ring(kvr_get *t, size_t per, size_t slots, kvr_error *err);
/* A streamed get sent in pieces of about piece_bytes instead of whole
 * layers (so memory holds a ring, not a layer): a layer's side (K or V) is split at token boundaries,
 * a side with nothing to produce is one piece straight from block memory,
 * and at most `slots` pieces are staged at once (only that ring is
 * reserved), so a piece's rotated bytes are still in cache when its write
 * reads them. Loop thread, before any work, instead of kvr_get_stage /
 * kvr_get_stage_ring. Only where every produced row has the same bits
 * however it is split (plain blocks: keys moved by one delta or converted,
 * values converted); else *n_pieces = 0 and nothing changed (stage as
 * before). 0, or as kvr_get_stage. With pieces, kvr_get_work(_layers) and
 * the whole-payload iovecs are not available: piece k is worked by
 * kvr_get_work_piece (any thread; the first call returns before any other
 * starts, later ones may run concurrently) and sent from
 * kvr_get_payload_iov_piece's iovecs (`bytes` in all), valid from its work
 * until piece k + slots is worked. Pieces come in payload order. */
int    kvr_get_stage_pieces(kvr_get *t, size_t piece_bytes, size_t slots, size_t *n_pieces,
                            kvr_error *err);
size_t kvr_get_n_pieces(const kvr_get *t);
/* Bytes one payload layer stages (0: nothing staged, or staged already). */
size_t kvr_get_staged_layer_bytes(const kvr_get *t);
int    kvr_get_work_piece(kvr_get *t, size_t k, kvr_error *err);
void   kvr_get_payload_iov_piece(const kvr_get *t, size_t k, const struct iovec **iov,
                                 size_t *n, size_t *bytes);
/* In-process callers: the whole payload (kvr_get_payload_size bytes, wire
 * order) straight into dst, instead of work + iovecs + a copy. Keys are
 * re-rotated and quantized sides decoded in place, zero-copy parts copied;
 * no staging is touched, so it adds no memory beyond one layer's f32
 * scratch per thread. Any thread; layers split across threads as for
 * kvr_get_work. The iovecs are not filled by it. KVR_EINVAL unless size is
 * the payload size. */
int  kvr_get_copy_into(kvr_get *t, void *dst, size_t size, kvr_error *err);
/* Loop thread: releases the leases and frees t. */
void kvr_get_end(kvr_get *t);

/* ---- prefix index ------------------------------------------------------- */
typedef struct kvr_match_result {
    size_t length;                      /* tokens of the query that are cached */
    char   ctx_id[KVR_ID_MAX + 1];      /* a context whose first `length` tokens
                                           equal the query's ("" if length 0) */
} kvr_match_result;

/* Longest exact cached prefix across all contexts of `model`. Tokens marked
 * approximate end a context's exact prefix unless include_approx. Shorter
 * than n: KVR_EFETCH if the miss hooks took it (kvr_store_miss_hooks). */
int kvr_store_match(kvr_store *s, const char *model, const uint32_t *tokens,
                    size_t n, bool include_approx, kvr_match_result *res,
                    kvr_error *err);

/* ---- context management ------------------------------------------------- */
typedef struct kvr_ctx_info {
    char     id[KVR_ID_MAX + 1];
    char     model[KVR_ID_MAX + 1];
    size_t   n_tokens, n_blocks, n_shared_blocks, n_approx;
    size_t   bytes;                /* block memory this context references */
    bool     pinned, busy;
    int64_t  pos_min, pos_max;     /* logical; 0, -1 if empty */
    uint64_t created_ms, accessed_ms;  /* CLOCK_REALTIME ms */
    size_t   n_evicted_tokens;     /* tail tokens dropped by eviction, ever */
    size_t   n_pending;            /* tokens flagged KVR_TOKEN_PENDING */
    size_t   n_protected;          /* first tokens edits may not touch (sinks) */
    /* Codec at rest (docs/quantized.md). */
    char     codec[KVR_CODEC_NAME_MAX];
    size_t   n_window;             /* tokens in full-precision (plain) blocks */
    size_t   kv_bytes;             /* K/V bytes its tokens occupy (incl. scales) */
    size_t   bytes_saved;          /* vs the model dtype, plain: 0 */
    double   bits_per_value;       /* kv_bytes * 8 / values */
    double   rel_rms_k, rel_rms_v; /* measured at put time on quantized data */
    bool     v_trans;              /* created from a transposed V cache */
} kvr_ctx_info;

int kvr_store_delete(kvr_store *s, const char *ctx_id, kvr_error *err);
int kvr_store_stat(kvr_store *s, const char *ctx_id, kvr_ctx_info *out, kvr_error *err);
/* All contexts (of `model` if non-NULL), sorted by id. *out is the caller's,
 * freed with kvr_mem_free. */
int kvr_store_list(kvr_store *s, const char *model, kvr_ctx_info **out, size_t *n,
                   kvr_error *err);
int kvr_store_pin(kvr_store *s, const char *ctx_id, bool pin, kvr_error *err);
/* Copy-on-write: dst shares src's blocks until one side changes them. */
int kvr_store_fork(kvr_store *s, const char *src, const char *dst, kvr_error *err);
/* llama.cpp seq_add: logical positions of tokens [start, end) += delta (their
 * keys are re-rotated on read). KVR_EINVAL if a position would overflow. */
int kvr_store_shift(kvr_store *s, const char *ctx_id, size_t start, size_t end,
                    int64_t delta, kvr_error *err);
/* llama.cpp seq_keep on a token range: keep [start, end), drop the rest. */
int kvr_store_keep(kvr_store *s, const char *ctx_id, size_t start, size_t end,
                   kvr_error *err);

/* ---- edits (PIE): replace / insert / delete, refresh, protected sinks --- */
/*
 * An edit replaces the token range [start, end) of the context's CURRENT
 * sequence with n_tokens new tokens (start == end: insert before index
 * start, start == n_tokens: append; n_tokens == 0: delete). Several ops in
 * one request are all in the current coordinates, may come in any order and
 * must not overlap: sorted by start, each must end at or before the next one
 * starts, and no two may start at the same index (so [2,4) + [4,6) is fine,
 * [2,4) + insert at 4 is fine, two inserts at 4 or insert at 4 + [4,6) are
 * KVR_EINVAL: their order would be ambiguous). An op that changes nothing
 * (start == end, no tokens) is KVR_EINVAL.
 *
 * Positions. The new tokens of an op take consecutive logical positions
 * from the position of old token `start` (or last position + 1 when start
 * == n_tokens, 0 in an empty context), moved by the shift of the ops before
 * it; every old token after an op moves by (new - removed) tokens of all
 * ops before it. Old tokens are never copied or rotated: only their
 * extents' pos_delta changes (cost O(extents + ops), whatever the suffix
 * length), and get rotates each key once from its stored form.
 *
 * Flags. Old tokens at or after the first edit point become
 * KVR_TOKEN_APPROX; new tokens are exact (or KVR_TOKEN_PENDING when sent
 * without KV). The exact prefix index stops at the first approximate or
 * pending token; match(include_approx) sees the full current sequence.
 *
 * The transaction works like put: begin validates everything and reserves
 * memory (context busy until commit/abort, KVR_EBUSY for other writers),
 * the payload (with_kv: layer-major, for each layer K then V of ALL new
 * tokens of all ops in request order, [n_new][heads][dim] in `dtype`, K
 * rotated at the planned positions) goes straight into fresh blocks through
 * the iovecs, work converts off the loop thread, commit splices. Any
 * refusal, at begin or commit, leaves the context exactly as it was.
 */
typedef struct kvr_edit_op {
    size_t          start, end;    /* [start, end) of the current sequence */
    size_t          n_tokens;      /* new tokens (0: delete) */
    const uint32_t *tokens;        /* n_tokens ids; copied by begin */
    bool            approx;        /* the new tokens' KV saw approximate tokens:
                                      stored KVR_TOKEN_APPROX (age 0) */
} kvr_edit_op;

/* An edit's or refresh's precondition: the context still holds the token
 * sequence the client planned against (n_tokens ids whose kvr_tokens_hash
 * is hash), else KVR_EBUSY and nothing changes. set false: none. */
typedef struct kvr_expect {
    bool     set;
    uint64_t n_tokens, hash;
} kvr_expect;

typedef struct kvr_edit_params {
    const char        *ctx_id;
    const char        *model;       /* NULL or "": unchecked; else the context's */
    uint64_t           fingerprint; /* 0 = unchecked */
    const kvr_edit_op *ops;         /* n_ops ops, any order; copied */
    size_t             n_ops;
    bool               with_kv;     /* payload follows; else new tokens PENDING */
    uint32_t           n_layers, n_kv_heads, head_dim;  /* with_kv: as stated */
    kvr_dtype          dtype;       /* with_kv: payload dtype */
    size_t             payload_bytes; /* with_kv: bytes the client sends; must
                                         equal kvr_edit_payload_size (EPAYLOAD) */
    kvr_expect         expect;      /* compare-and-swap: the sequence planned against */
} kvr_edit_params;

/* Per op, in request order: where its new tokens land. */
typedef struct kvr_edit_span {
    size_t  index;         /* index of its first new token after the edit */
    int64_t first_pos;     /* logical position of that token; the op's new
                              tokens have first_pos, first_pos + 1, ... */
    int64_t shift;         /* position change of the old tokens after it */
} kvr_edit_span;

typedef struct kvr_edit_result {
    size_t n_tokens;       /* context length after */
    size_t n_new, n_removed;
    size_t first_change;   /* index of the first edit point */
    size_t n_approx, n_pending;   /* of the whole context after */
    size_t payload_bytes;  /* bytes of KV this request moves */
} kvr_edit_result;

typedef struct kvr_edit kvr_edit;   /* an open edit or refresh transaction */

/* Validates p exactly as edit_begin does and returns what the edit would
 * do (spans: caller's array of n_ops entries, may be NULL; res may be NULL)
 * without changing anything: the worker computes the new tokens' KV at
 * spans[i].first_pos.. and then sends the edit with KV. */
int kvr_store_edit_plan(kvr_store *s, const kvr_edit_params *p, kvr_edit_span *spans,
                        kvr_edit_result *res, kvr_error *err);
/* Opens an edit. On success the caller owns *out until commit or abort. */
int kvr_store_edit_begin(kvr_store *s, const kvr_edit_params *p, kvr_edit **out,
                         kvr_error *err);

/* Refresh: overwrite the KV of tokens [start, end) with recomputed values
 * (payload as for an edit, end-start tokens, K rotated at the tokens'
 * current logical positions) and clear their APPROX/PENDING flags. The KV
 * goes into fresh blocks spliced in at commit: blocks shared with a fork
 * (or leased by a get) are never written. */
typedef struct kvr_refresh_params {
    const char *ctx_id;
    const char *model;             /* NULL or "": unchecked */
    uint64_t    fingerprint;       /* 0 = unchecked */
    size_t      start, end;        /* end SIZE_MAX = to the end; non-empty */
    uint32_t    n_layers, n_kv_heads, head_dim;
    kvr_dtype   dtype;
    size_t      payload_bytes;     /* must equal kvr_edit_payload_size */
    kvr_expect  expect;            /* as kvr_edit_params.expect */
    bool        approx;            /* the KV saw approximate tokens before start:
                                      the range stays APPROX, age 0 */
} kvr_refresh_params;
int kvr_store_refresh_begin(kvr_store *s, const kvr_refresh_params *p, kvr_edit **out,
                            kvr_error *err);

/* As the kvr_put_* calls: exact payload size (0 for an edit without KV);
 * iovecs in wire order (borrowed, valid until commit/abort); work (dtype
 * conversion) on any thread; commit/abort on the loop thread, both free t.
 * commit fills spans (n_ops entries, may be NULL; for a refresh one entry)
 * and res (may be NULL). */
size_t kvr_edit_payload_size(const kvr_edit *t);
void   kvr_edit_payload_iov(const kvr_edit *t, const struct iovec **iov, size_t *n);
bool   kvr_edit_needs_work(const kvr_edit *t);
int    kvr_edit_work(kvr_edit *t, kvr_error *err);
int    kvr_edit_commit(kvr_edit *t, kvr_edit_span *spans, kvr_edit_result *res,
                       kvr_error *err);
void   kvr_edit_abort(kvr_edit *t);

/* Protects the context's first n tokens (attention sinks): an edit op
 * starting before n is KVR_EPROTECTED (an insert at index n is allowed).
 * n <= n_tokens (KVR_ERANGE); 0 removes the protection. */
int kvr_store_protect(kvr_store *s, const char *ctx_id, size_t n, kvr_error *err);

/* ---- statistics --------------------------------------------------------- */
typedef struct kvr_store_stats {
    size_t   mem_allocated, mem_peak, mem_cap;
    size_t   block_bytes;              /* bytes held in blocks */
    size_t   kv_held_bytes;            /* K/V the committed tokens of in-memory
                                          blocks need: what block_bytes holds */
    size_t   block_cache_bytes, n_block_cache;  /* freed blocks kept for reuse */
    size_t   n_models, n_contexts, n_blocks, n_tokens;
    uint64_t n_evicted_blocks, n_evicted_bytes;
    uint64_t n_puts, n_gets, n_matches, n_match_hits;
    uint64_t n_refused_nomem;
    size_t   n_leased_blocks;
    size_t   n_quant_contexts;         /* contexts with a quantized codec */
    size_t   quant_bytes_saved;        /* sum of their bytes_saved */
    double   quant_bits_per_value;     /* over their tokens (0 if none) */
    size_t   cover_index_bytes;        /* the covers' content index (grain.h), all models */
    size_t   cover_index_lagging;      /* contexts it has yet to catch up with */
} kvr_store_stats;

void kvr_store_get_stats(const kvr_store *s, kvr_store_stats *out);

/* ---- position layouts: APE assemble, GPE groups, sinks + window -------- */
/*
 * APE (parallel encoding for RAG). A prefix context holds positions 0..P-1;
 * each document context was created with kvr_put_params.prefix_ctx naming
 * it (the worker computed the document's KV with that prefix in view, at
 * positions P..P+L-1). Assemble concatenates the prefix and an ordered list
 * of documents into one KV stream, keys re-rotated from their stored-at
 * positions to the layout's positions in one pass (docs/ape.md gives the
 * attention formula a worker applies with the segment table).
 */
/* kvr_layout_kind, kvr_segment_kind, KVR_APE_TEMPERATURE / SCALE: base/types.h. */
#define KVR_ASSEMBLE_MAX_DOCS 4096

typedef struct kvr_assemble_params {
    const char         *prefix;        /* prefix context id */
    const char *const  *docs;          /* n_docs document context ids, in order */
    size_t              n_docs;        /* 1..KVR_ASSEMBLE_MAX_DOCS */
    kvr_layout_kind     layout;
    const int64_t      *starts;        /* EXPLICIT: n_docs start positions (copied) */
    kvr_dtype           dtype;         /* output dtype */
    const uint32_t     *layers;        /* NULL = all, else n_layers_sel ids */
    size_t              n_layers_sel;
    double              temperature;   /* APE T for documents; 0 = 0.9 */
    double              scale;         /* APE S for documents; 0 = 0.9 */
    bool                fold_temperature; /* document keys come out as k / T */
    bool                meta_only;     /* no payload */
    void               *dst;           /* as kvr_get_params.dst */
    size_t              dst_cap;
} kvr_assemble_params;

typedef struct kvr_segment {
    kvr_segment_kind kind;
    size_t   start, n_tokens;          /* token range [start, start+n) of the stream */
    int64_t  pos_first, pos_last;      /* positions of its first/last token (query:
                                          pos_first = query position, pos_last =
                                          pos_first - 1, as it is empty) */
    uint32_t doc_index;                /* DOCUMENT: index in params.docs */
    char     ctx_id[KVR_ID_MAX + 1];   /* prefix / document context ("" for query) */
    double   temperature, scale;       /* APE T and S to apply (1, 1 outside documents) */
} kvr_segment;

typedef struct kvr_assemble_info {
    kvr_model_info     model;
    kvr_layout_kind    layout;
    size_t             n_tokens;       /* stream length: prefix + documents */
    kvr_dtype          dtype;
    size_t             n_layers;       /* layers in the payload */
    const uint32_t    *layers;
    const uint32_t    *tokens;         /* n_tokens ids, stream order */
    const int64_t     *positions;      /* positions the keys are rotated at */
    const uint32_t    *flags;          /* KVR_TOKEN_* */
    const kvr_segment *segments;       /* prefix, documents..., query */
    size_t             n_segments;
    int64_t            query_pos;      /* first position of the query tokens */
    double             temperature, scale;
    bool               temperature_folded;  /* document keys are k / T */
    size_t             prefix_len;     /* P */
} kvr_assemble_info;

typedef struct kvr_assemble kvr_assemble;

/* Loop thread. Resolves the prefix and the documents, checks that every
 * document was encoded against this prefix as it is now (same context id,
 * same model fingerprint, same length and token hash; else KVR_EPREFIX, or
 * KVR_EFINGERPRINT for another model, naming the document), computes the
 * layout (KVR_EINVAL if a position overflows), leases the blocks and copies
 * the metadata. Nothing stored changes. Owned by the caller until
 * kvr_assemble_end. */
int  kvr_store_assemble_begin(kvr_store *s, const kvr_assemble_params *p,
                              kvr_assemble **out, kvr_error *err);
const kvr_assemble_info *kvr_assemble_get_info(const kvr_assemble *t); /* borrowed */
/* Loop thread, before work: reserves and allocates the staging the
 * iovecs need, exactly as kvr_get_stage (begin reserves none; not needed
 * for kvr_assemble_copy_into or a dst). */
int    kvr_assemble_stage(kvr_assemble *t, kvr_error *err);
/* Rotation (one kvr_rope_reposition per run), conversion and temperature
 * folding into the response buffer: any thread (once staged). */
bool   kvr_assemble_needs_work(const kvr_assemble *t);
int    kvr_assemble_work(kvr_assemble *t, kvr_error *err);
/* Payload in wire order (layer-major, for each layer K then V of all
 * stream tokens), valid after work until end; may point into blocks. */
size_t kvr_assemble_payload_size(const kvr_assemble *t);
void   kvr_assemble_payload_iov(const kvr_assemble *t, const struct iovec **iov,
                                size_t *n);
/* In-process callers: the whole payload straight into dst, as
 * kvr_get_copy_into (no staging; the iovecs are not filled). */
int    kvr_assemble_copy_into(kvr_assemble *t, void *dst, size_t size, kvr_error *err);
void   kvr_assemble_end(kvr_assemble *t);       /* loop thread; NULL is a no-op */

/* ---- cover: cached runs anywhere in a prompt (docs/reuse.md) ------------ */
/*
 * Every context's tokens are indexed by content in grains of
 * KVR_COVER_GRAIN tokens at its offsets 0, 16, 32, ... (grain.h), kept in
 * step with every change of its tokens. A cover of a prompt: a rolling hash
 * over every prompt offset finds grains, each candidate is verified token
 * by token (never trusted on a hash alone) and extended left and right to a
 * maximal run; then non-overlapping pieces of those runs are chosen, the
 * longest exact prefix first (a run at prompt offset 0 from its context's
 * offset 0: its KV is what a full encode gives), then greedily the run
 * reaching furthest, so the pieces are few and long; pieces shorter than
 * min_run are dropped. What no piece covers is a gap. Each call is bounded
 * whatever the prompt: at most KVR_COVER_MAX_TOKENS tokens, candidates per
 * grain and chain steps capped, a work budget on the token comparisons.
 * KVR_COVER_*: base/types.h.
 */
typedef struct kvr_cover_params {
    const char     *model;
    const uint32_t *tokens;            /* the prompt */
    size_t          n_tokens;          /* 1..KVR_COVER_MAX_TOKENS */
    size_t          min_run;           /* 1..KVR_COVER_MAX_TOKENS (KVR_COVER_MIN_RUN
                                          is the wire's default) */
    /* The placed get (kvr_store_cover_get_begin): */
    int64_t         pos_base;          /* position of prompt token 0, >= 0 */
    kvr_dtype       dtype;
    const uint32_t *layers;            /* NULL = all, else n_layers_sel ids */
    size_t          n_layers_sel;
    bool            meta_only;
    void           *dst;               /* as kvr_get_params.dst */
    size_t          dst_cap;
} kvr_cover_params;

typedef struct kvr_cover_piece {
    size_t   prompt_off;               /* prompt tokens [prompt_off, +n_tokens) */
    size_t   ctx_off;                  /* are the context's [ctx_off, +n_tokens) */
    size_t   n_tokens;
    size_t   n_approx;                 /* of them KVR_TOKEN_APPROX in the context */
    size_t   stream_off;               /* its first token in the placed stream */
    bool     exact;                    /* at its context's place after the same text */
    char     ctx_id[KVR_ID_MAX + 1];
} kvr_cover_piece;

typedef struct kvr_cover_result {
    size_t           n_prompt, n_covered;
    kvr_cover_piece *pieces;           /* prompt order; kvr_cover_result_free */
    size_t           n_pieces;
    /* What the search did: grain lookups, entries whose hash matched,
     * of them refused by the token check, maximal runs found; truncated:
     * the work budget ended the search early (the cover is valid, maybe
     * not the best). */
    size_t           n_lookups, n_hits, n_rejected, n_runs;
    bool             truncated;
} kvr_cover_result;

/* Loop thread. Computes the cover of p->tokens (the get fields are
 * ignored); marks the contexts it uses recently used. Nothing stored
 * changes (the index may catch up with contexts changed since the last
 * cover). KVR_ENOMODEL, KVR_EINVAL (empty prompt, min_run), KVR_EBADREQUEST,
 * KVR_ETOOLARGE (over KVR_COVER_MAX_TOKENS), KVR_ENOMEM. On success res
 * owns pieces (kvr_cover_result_free); on failure it owns nothing. */
int  kvr_store_cover(kvr_store *s, const kvr_cover_params *p, kvr_cover_result *res,
                     kvr_error *err);
void kvr_cover_result_free(kvr_cover_result *res);   /* NULL ok */
/* Loop thread. The pieces' K/V as one read (an assemble transaction: the
 * kvr_assemble_* calls stage, work and send it): pieces in prompt order,
 * keys re-rotated to p->pos_base + prompt offset, one DOCUMENT segment per
 * piece (T = S = 1) then the QUERY at pos_base + n_prompt. Flags: a token
 * keeps its context's and is KVR_TOKEN_APPROX when its piece is not exact.
 * Every piece is checked against the prompt token by token again:
 * KVR_EBUSY if a context changed since res was computed. */
int  kvr_store_cover_get_begin(kvr_store *s, const kvr_cover_params *p,
                               const kvr_cover_result *res, kvr_assemble **out,
                               kvr_error *err);

/*
 * GPE groups. A context created with kvr_put_params.groups has named groups
 * (ids 0..n-1 in the order given), each with a cursor (tokens appended to it,
 * ever) and an offset phi; a put naming a group gives its tokens positions
 * phi + cursor, phi + cursor + 1, ... Tokens are stored in arrival order;
 * get reports each token's group id (kvr_get_info.groups).
 */
/* KVR_MAX_GROUPS, KVR_GROUP_NAME_MAX: base/types.h. */

typedef struct kvr_group_info {
    char     name[KVR_GROUP_NAME_MAX + 1];
    int32_t  id;
    int64_t  offset;        /* phi */
    uint64_t cursor;        /* tokens appended to the group, ever */
    size_t   n_tokens;      /* of them, in the context now */
} kvr_group_info;

/* Per-context layout state, for stat. */
typedef struct kvr_layout_info {
    bool     has_prefix;                  /* created with prefix_ctx */
    char     prefix_ctx[KVR_ID_MAX + 1];
    uint64_t prefix_fingerprint;
    size_t   prefix_len;                  /* P when encoded */
    uint64_t prefix_hash;                 /* of its token ids then */
    size_t   n_groups;
    kvr_group_info groups[KVR_MAX_GROUPS];
    bool     has_retention;
    size_t   sinks, window;
    size_t   n_dropped;                   /* tokens dropped by the window, ever */
    bool     v_trans;                     /* created from a transposed V cache
                                             (kvr_put_params.v_trans) */
} kvr_layout_info;

int kvr_store_layout_stat(kvr_store *s, const char *ctx_id, kvr_layout_info *out,
                          kvr_error *err);
/* Sets group `name`'s offset to phi: the logical positions of its tokens
 * move by (phi - old phi) (keys re-rotated at read, no copy), as do its next
 * positions. Other groups are untouched. KVR_EINVAL for an unknown name or
 * an overflowing position; nothing changes on error. */
int kvr_store_set_group_offset(kvr_store *s, const char *ctx_id, const char *name,
                               int64_t phi, kvr_error *err);

/*
 * StreamingLLM sinks + window. With a policy, whenever the context is longer
 * than sinks + window (now, and after every put), tokens [sinks, n - window)
 * are dropped (blocks freed when nothing references them) and the window's
 * positions move so they continue right after the last sink (metadata only).
 * Not supported together with groups (KVR_EUNSUPPORTED).
 */
#define KVR_RETENTION_MAX (1u << 30)
typedef struct kvr_retention {
    size_t sinks, window;   /* window >= 1; sinks + window <= KVR_RETENTION_MAX */
    bool   off;             /* remove the policy (sinks/window ignored) */
} kvr_retention;

int kvr_store_set_retention(kvr_store *s, const char *ctx_id, const kvr_retention *r,
                            kvr_error *err);

/* Checks a layout from outside (a shared-tier manifest, a disk record)
 * with the same functions as the verbs that set each field locally: group
 * count, names (1..KVR_GROUP_NAME_MAX bytes, distinct), offsets and cursors
 * (no position overflow), the APE record (a valid context id, the
 * context's own model fingerprint, a length that fits a position; all zero
 * without a prefix), retention (set_retention's sinks/window checks, never
 * with groups, at most sinks + window of the n tokens), n_dropped (fits a
 * position), and per token (groups / flags may be NULL): a group id that
 * names a group (0 without groups), no flag but KVR_TOKEN_STALE.
 * fingerprint: the model of the context it is for. 0 or KVR_E* with err. */
int kvr_layout_info_check(const kvr_layout_info *li, const char *ctx_id, uint64_t fingerprint,
                          const int32_t *groups, const uint32_t *flags, size_t n,
                          kvr_error *err);

/* The shared tier (daemon/remote_fetch.c): gives a context just created from
 * another node's publication the layout it has there, as kvr_store_layout_stat
 * reported it (APE record, groups with offsets and cursors, retention
 * numbers), each token's group id (groups, NULL: 0 each, as a put writes
 * them; without groups every id must be 0) and the KVR_TOKEN_STALE flag of
 * each token (flags, NULL: none). Everything is checked first by
 * kvr_layout_info_check. The context must hold n tokens in blocks it alone
 * references and have no layout yet. Metadata only; nothing changes on
 * error. */
int kvr_store_layout_restore(kvr_store *s, const char *ctx_id, const kvr_layout_info *li,
                             const int32_t *groups, const uint32_t *flags, size_t n,
                             kvr_error *err);

/* ---- disk tier and persistence (tier.c) --------------------------------- */
/*
 * With a disk tier, eviction spills blocks to disk instead of dropping them
 * (the block keeps its metadata; get/assemble/put reload it), and contexts
 * marked persistent have every change logged so that a restart recovers
 * them. Everything here is loop-thread only except kvr_persist_batch_work.
 */
typedef struct kvr_tier_config {
    const char *dir;            /* created if missing */
    uint64_t    max_bytes;      /* live data + log; 0 = unbounded */
    int         engine;         /* 0 auto, 1 io_uring only, 2 POSIX (forced) */
    bool        persist_all;    /* every created context is persistent */
    uint64_t    checkpoint_bytes; /* log size that triggers a checkpoint; 0 = 64 MiB */
} kvr_tier_config;

typedef struct kvr_tier_recovery {
    size_t   models, contexts, tokens, blocks;
    uint64_t bytes;             /* block bytes recovered (their extents; read later) */
    uint64_t records;           /* log records replayed */
    uint64_t quarantined;       /* corrupt records / extents skipped */
    uint64_t torn_bytes;        /* cut from the log's tail */
    size_t   dropped_contexts;  /* contexts whose data could not be read */
    size_t   stale_contexts;    /* restored from an older state, marked KVR_TOKEN_STALE */
    size_t   lost_contexts;     /* newest record corrupt and no older one */
    double   ms;
    uint64_t at_ms;             /* wall clock when it finished */
} kvr_tier_recovery;

/* level: KVR_TIER_LOG_INFO / _WARN; msg is borrowed for the call. */
enum { KVR_TIER_LOG_INFO = 1, KVR_TIER_LOG_WARN = 2 };
typedef void (*kvr_tier_log_fn)(void *arg, int level, const char *msg);

/* Opens the disk tier in cfg->dir, replays its log (reporting corrupt or
 * torn records through log, which may be NULL) and rebuilds the persistent
 * models and contexts in s (which must have no contexts yet). Contexts
 * whose blocks cannot be read are dropped and reported. rec may be NULL. */
int  kvr_store_tier_open(kvr_store *s, const kvr_tier_config *cfg, kvr_tier_log_fn log,
                         void *arg, kvr_tier_recovery *rec, kvr_error *err);
/* "io_uring" / "posix", or NULL without a disk tier (static string). */
const char *kvr_store_tier_engine(const kvr_store *s);
/* Why io_uring was not used ("" if it was); borrowed. */
const char *kvr_store_tier_engine_note(const kvr_store *s);

typedef struct kvr_tier_stats {
    bool     enabled;
    const char *engine;
    size_t   mem_blocks, mem_bytes;        /* resident blocks / their bytes */
    size_t   spilled_blocks;               /* blocks whose data is on disk only */
    uint64_t disk_blocks, disk_bytes;      /* live extents on disk (4 KiB granules) */
    uint64_t disk_log_bytes, disk_max_bytes;
    uint64_t n_spills, spill_bytes;        /* blocks written by eviction */
    uint64_t n_reloads, reload_bytes;      /* blocks read back */
    uint64_t n_spill_refused;              /* evictions that fell back to dropping */
    uint64_t reads_mem, reads_disk;        /* get/assemble served from memory / needing disk */
    uint64_t n_persist_records, n_persist_errors, n_checkpoints;
    size_t   persistent_contexts;
    uint64_t quarantined;                  /* corrupt records and extents seen */
    bool     failed;                       /* an fsync failed: restart required */
    kvr_tier_recovery recovery;            /* the last recovery */
} kvr_tier_stats;
void kvr_store_tier_stats(const kvr_store *s, kvr_tier_stats *out);

/* Persistence. After a change to context ctx_id was committed (or after it
 * was deleted), kvr_store_persist queues one record of its whole state
 * (blocks not yet on disk are written first) if the context is (or was)
 * persistent, and returns 1: done(arg, rc, err) runs from the
 * kvr_persist_batch_end that wrote it (rc 0: on stable storage). Returns 0
 * if there is nothing to log, a KVR_E* code if nothing could be queued.
 * Records reach the disk in the order they were queued. */
typedef void (*kvr_persist_done_fn)(void *arg, int rc, const kvr_error *err);
int  kvr_store_persist(kvr_store *s, const char *ctx_id, kvr_persist_done_fn done,
                       void *arg, kvr_error *err);
bool kvr_store_ctx_persistent(const kvr_store *s, const char *ctx_id);
/* A batch of every queued record, or NULL if none is queued or a batch is
 * still in flight (one at a time, so records stay in order). */
typedef struct kvr_persist_batch kvr_persist_batch;
kvr_persist_batch *kvr_store_persist_take(kvr_store *s);
void kvr_persist_batch_work(kvr_persist_batch *b);   /* any thread: spill + append */
void kvr_persist_batch_end(kvr_persist_batch *b);    /* loop: install, done()s, free */
/* Loop thread: takes, works and ends batches inline until none is queued. */
void kvr_store_persist_flush(kvr_store *s);
/* Spills least recently used unheld blocks until `bytes` of memory are
 * freed (SIZE_MAX: everything spillable), then makes the spills durable.
 * Returns the bytes freed, or a KVR_E* code (benchmarks, admin). */
int64_t kvr_store_tier_evict(kvr_store *s, size_t bytes, kvr_error *err);

#ifdef __cplusplus
}
#endif
#endif /* KVR_CACHE_H */
