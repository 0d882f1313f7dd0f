/*
 * store_internal.h — private structures of cache/: blocks, extents,
 * contexts, models, the per-model prefix index and the store itself.
 *
 * Invariants:
 *  - A block holds `block_tokens` token slots for ALL layers: for each layer
 *    K [B][H][D] then V [B][H][D] in the context's storage dtype, followed by
 *    per-slot metadata (stored-at position, token id, group id). Slots below
 *    `used` are immutable once committed; only an exclusively owned block
 *    (refcount 1) gets its free tail slots filled by a later put.
 *  - refcount = extents referencing the block + get leases + open put txns
 *    that write into it. The block (and its accounted memory) is freed when
 *    it drops to zero, never earlier.
 *  - A context is an ordered array of extents {block, first slot, count,
 *    pos_delta, flags}; token logical position = stored-at + pos_delta.
 *    Extents are never empty.
 *  - Every committed context sits in its model's two prefix trees (exact
 *    prefix, full sequence) with its current token sequences, except that a
 *    context of length 0 in a tree has no node there.
 *  - Everything is allocated with kvr_mem_*.
 */
#ifndef KVR_STORE_INTERNAL_H
#define KVR_STORE_INTERNAL_H

#include "cache/cache.h"
#include "cache/codec.h"
#include "cache/disk.h"

#define KVR_DEFAULT_BLOCK_TOKENS 64u
#define KVR_BLOCK_ALIGN 64u
#define KVR_MAX_PUT_TOKENS (1u << 24)

typedef struct kvr_block kvr_block;
typedef struct kvr_ctx kvr_ctx;
typedef struct kvr_model kvr_model;
typedef struct pnode pnode;

/* Header of a quantized block, in the first KVR_QHDR_BYTES of its data (so
 * plain blocks keep their small struct). */
typedef struct kvr_qhdr {
    kvr_codec kc, vc;
    uint32_t  ktile;        /* 1 = K rows; else K tile tokens (cap % ktile == 0) */
    size_t    krow, vrow, kslab, vslab;
} kvr_qhdr;
#define KVR_QHDR_BYTES 128u
#define QH(b) ((const kvr_qhdr *)(const void *)(b)->data)

struct kvr_block {
    uint32_t  refcount;
    uint32_t  holds;        /* part of refcount: leases + open puts */
    uint32_t  leases;       /* part of holds: get leases */
    uint32_t  mark, mcount; /* scratch for whole-store scans (epoch, count) */
    uint32_t  used;         /* committed slots (a prefix of the block) */
    uint32_t  cap;          /* slots (the store's block_tokens) */
    kvr_dtype dtype;        /* plain blocks: storage dtype; quant: window dtype */
    /* Quantized blocks (quant.c). K and V hold encoded rows (per-token
     * codecs: `krow`/`vrow` bytes per slot) or, for a per-channel K codec,
     * tiles of `ktile` slots (`krow` bytes per tile); keys are stored
     * UN-ROTATED (pre-RoPE), so stored_pos is metadata only. */
    bool      quant;        /* header (kvr_qhdr) at the start of data */
    bool      spilled;      /* tier.c: `data` holds only the metadata (the
                               quantized header, then stored_pos/tokens/
                               groups); the K/V bytes are on disk */
    size_t    bytes;        /* accounted bytes of data */
    uint8_t  *data;         /* kvr_mem_aligned; layers then metadata */
    int64_t  *stored_pos;   /* [cap], inside data */
    uint32_t *tokens;       /* [cap], inside data */
    int32_t  *groups;       /* [cap], inside data */
    /* edit.c: bounds of stored_pos over slots [0, bounds_used), kept lazily
     * (slots below `used` never change) for O(1) overflow checks. */
    int64_t   pos_lo, pos_hi;
    uint32_t  bounds_used;
    /* tier.c: the disk copy (NULL: none), allocated only for blocks that
     * have one so that memory-only blocks stay small. */
    struct kvr_block_disk *disk;
};

/* A block's disk copy: h is a live handle the block owns one reference
 * of; it is a valid copy iff used == the block's used (slots below `used`
 * never change). A spilled block always has a valid copy. */
typedef struct kvr_block_disk {
    kvr_disk_handle h;
    uint32_t        used;
} kvr_block_disk;

typedef struct kvr_extent {
    kvr_block *block;
    uint32_t   first, count;
    int64_t    pos_delta;
    uint32_t   flags;        /* KVR_TOKEN_* for every token of the extent */
} kvr_extent;

/* ---- prefix index (prefix.c) -------------------------------------------- */
struct pnode {
    uint32_t  *label;        /* edge label (empty for the root) */
    size_t     len;
    size_t     depth;        /* tokens from the root to the end of the label */
    size_t     n_pass;       /* contexts whose sequence covers the whole label */
    pnode     *parent;
    pnode    **children;     /* sorted by label[0] */
    uint32_t   n_children, cap_children;
    kvr_ctx  **ends;         /* contexts whose sequence ends exactly here */
    uint32_t   n_ends, cap_ends;
};

typedef struct kvr_ptree {
    pnode  root;
    int    which;            /* 0 exact, 1 full: index into ctx->idx_* */
    size_t n_nodes;
} kvr_ptree;

void ptree_init(kvr_ptree *t, int which);
void ptree_free(kvr_ptree *t);
/* ctx currently has length ctx->idx_len[which] in the tree; makes it
 * `n` tokens long where seq[0..n) is the full new sequence and its first
 * `keep` tokens equal the old sequence's (keep <= both lengths). */
int  ptree_set(kvr_ptree *t, kvr_ctx *c, const uint32_t *seq, size_t n, size_t keep);
/* Appends suffix[0..n) to ctx's sequence in the tree. On failure the tree
 * is unchanged. */
int  ptree_append(kvr_ptree *t, kvr_ctx *c, const uint32_t *suffix, size_t n);
/* Truncates ctx's sequence in the tree to n tokens (n <= current). Never fails. */
void ptree_truncate(kvr_ptree *t, kvr_ctx *c, size_t n);
/* Adds `dst` at the same place as `src` (fork). */
int  ptree_clone(kvr_ptree *t, kvr_ctx *src, kvr_ctx *dst);
size_t ptree_match(const kvr_ptree *t, const uint32_t *q, size_t n, kvr_ctx **rep);

/* ---- models, contexts, store -------------------------------------------- */
/* A storage codec of a model or context (quant.c). plain: blocks in
 * `dtype`, keys rotated at their stored-at positions (the historical
 * format). quant: quantized blocks with pre-RoPE keys, plus plain window
 * blocks in `dtype` (the model's) for the most recent tokens. */
typedef struct kvr_qspec {
    bool           quant;
    kvr_dtype      dtype;
    kvr_codec_pair pair;
    char           name[KVR_CODEC_NAME_MAX];
} kvr_qspec;

struct kvr_model {
    char            name[KVR_ID_MAX + 1];
    kvr_qspec       codec;      /* default codec of new contexts */
    uint32_t        n_layers, n_kv_heads, head_dim;
    kvr_dtype       dtype;
    uint64_t        fingerprint;
    kvr_rope_config rope_cfg;
    kvr_rope       *engine;
    size_t          n_contexts;
    kvr_ptree       tree[2];    /* 0: exact prefixes, 1: full sequences */
    size_t          n_stale;    /* contexts with idx_stale set (edit.c) */
};

struct kvr_ctx {
    char        id[KVR_ID_MAX + 1];
    size_t      id_len;
    uint64_t    hash;
    kvr_ctx    *hnext;          /* hash chain */
    kvr_ctx    *lru_prev, *lru_next;  /* prev = more recent */
    kvr_model  *model;
    kvr_dtype   dtype;          /* plain (window) blocks' storage dtype */
    kvr_qspec   codec;
    double      q_sse[2], q_ss[2];  /* K, V: sum sq. error / sum sq. of quantized data */
    kvr_extent *ext;
    size_t      n_ext, cap_ext;
    size_t      n_tokens;
    size_t      n_exact;        /* tokens before the first approximate one */
    bool        pinned, busy, pending;  /* pending: created by an open put */
    uint64_t    created_ms, accessed_ms;
    size_t      n_evicted_tokens;
    pnode      *idx_node[2];
    size_t      idx_len[2];
    /* edit.c. idx_stale: the full-sequence tree holds only a true prefix
     * (idx_len[1] < n_tokens) of c's sequence after an edit; the rest is
     * re-inserted on the next include_approx match (edit_index_fresh), so
     * an edit never costs O(suffix). Writers that append to tree[1] skip a
     * stale context; ctx_index_rebuild clears the flag. */
    bool        idx_stale;
    size_t      n_protected;    /* first tokens edits may not touch */
    struct kvr_layout *layout;  /* layout.c: APE record, groups, retention; NULL = none */
    bool        persist;        /* tier.c: every change is logged to disk */
};

struct kvr_store {
    kvr_store_config cfg;
    uint32_t     B;
    kvr_model  **models;
    size_t       n_models, cap_models;
    kvr_ctx    **buckets;
    size_t       n_buckets, n_ctx;   /* n_ctx includes pending */
    kvr_ctx     *lru_head, *lru_tail;   /* head = most recent */
    size_t       n_blocks, block_bytes, n_leased_blocks;
    uint64_t     n_evicted_blocks, n_evicted_bytes;
    uint64_t     n_puts, n_gets, n_matches, n_match_hits, n_refused_nomem;
    uint32_t     epoch;
    struct kvr_tier *tier;           /* tier.c: disk tier, NULL = memory only */
};

/* block.c */
size_t     block_data_bytes(const kvr_store *s, const kvr_model *m, kvr_dtype dt);
kvr_block *block_new(kvr_store *s, const kvr_model *m, kvr_dtype dt);
void       block_ref(kvr_block *b);
void       block_unref(kvr_store *s, kvr_block *b);
/* Pointer to K (kv=0) or V (kv=1) of `layer` at slot `slot`. */
uint8_t   *block_kv(const kvr_block *b, const kvr_model *m, uint32_t layer,
                    int kv, uint32_t slot);

/* store.c helpers shared by put.c / get.c */
uint64_t   now_ms(void);
kvr_ctx   *ctx_find(const kvr_store *s, const char *id);   /* includes pending */
/* Committed (non-pending) context by id: 0, or EBADREQUEST / ENOCTX. */
int        ctx_find_live(const kvr_store *s, const char *id, kvr_ctx **out,
                         kvr_error *err);
int        ctx_id_check(const char *id, kvr_error *err);
kvr_ctx   *ctx_new(kvr_store *s, kvr_model *m, const char *id);  /* pending, in map */
void       ctx_destroy(kvr_store *s, kvr_ctx *c);   /* unlink + free everything */
void       lru_touch(kvr_store *s, kvr_ctx *c);
/* Makes token index idx (0 <= idx <= n_tokens) start an extent and returns
 * that extent's index (n_ext for the end); needs one free extent slot
 * (ctx_ext_reserve). */
size_t     ctx_split_at(kvr_ctx *c, size_t idx);
/* Merges neighbours contiguous in one block with equal delta and flags. */
void       ctx_merge_extents(kvr_store *s, kvr_ctx *c);
int        ctx_ext_reserve(kvr_ctx *c, size_t n);
int64_t    ctx_last_pos(const kvr_ctx *c);
kvr_model *model_find(const kvr_store *s, const char *name);
/* Gathers c's token ids (kvr_mem_malloc'ed, caller frees). */
uint32_t  *ctx_gather_tokens(const kvr_ctx *c, kvr_error *err);
/* Makes room for `need` more bytes under the cap (evicting), or KVR_ENOMEM. */
int        store_reserve(kvr_store *s, size_t need, kvr_error *err);
/* The most one request (a put, edit, refresh, or a get's / assemble's
 * staging) may reserve: a quarter of the cap, but at least
 * KVR_REQUEST_FLOOR (or the whole cap if smaller). SIZE_MAX without a cap. */
#define KVR_REQUEST_FLOOR ((size_t)4 << 20)
size_t     store_request_max(const kvr_store *s);
/* A get's / assemble's layer selection: every id below m->n_layers and
 * none twice (a read cannot ask for 64x the context's bytes of staging).
 * 0, KVR_ERANGE, KVR_EINVAL or KVR_ENOMEM. */
int        layers_check(const kvr_model *m, const uint32_t *layers, size_t nl,
                        kvr_error *err);
/* store_reserve for one request's `need` bytes; KVR_ETOOLARGE (naming
 * `what`, evicting nothing) over store_request_max, so a single request
 * cannot evict the whole cache before it sends a byte. */
int        store_reserve_request(kvr_store *s, size_t need, const char *what,
                                 kvr_error *err);
/* Recomputes n_exact and resyncs both trees; the first `common` tokens are
 * known unchanged. On allocation failure c is left out of the index (which
 * then under-reports, never lies). */
void       ctx_index_rebuild(kvr_store *s, kvr_ctx *c, size_t common);
void       model_fill_info(const kvr_model *m, kvr_model_info *out);

/* edit.c */
/* Re-inserts the full sequence of every stale context of m into tree[1]
 * (best effort: on allocation failure a context stays stale). */
void       edit_index_fresh(kvr_store *s, kvr_model *m);
/* Clears c's stale mark (c is leaving the store or was fully resynced). */
void       edit_stale_clear(kvr_ctx *c);

/* layout.c: per-context position layouts. A put carries a layout_put from
 * begin to commit: begin validates (group names, prefix) and computes the
 * group's positions, commit installs a created context's layout, advances
 * the group cursor and applies the retention policy. */
typedef struct kvr_layout kvr_layout;
typedef struct layout_put {
    kvr_layout *created;     /* create: the new context's layout (owned until commit) */
    int32_t     group;       /* group id of the new tokens */
    bool        has_first;   /* positions come from the layout (group cursor, APE P) */
    int64_t     first;
} layout_put;
int  layout_put_begin(kvr_store *s, const kvr_ctx *c, const kvr_model *m,
                      const kvr_put_params *p, layout_put *lp, kvr_error *err);
/* Returns how far the new tokens' positions moved (retention), 0 usually. */
int64_t layout_put_commit(kvr_store *s, kvr_ctx *c, layout_put *lp, size_t n);
void layout_put_free(layout_put *lp);
void layout_ctx_free(kvr_ctx *c);
int  layout_ctx_clone(const kvr_ctx *src, kvr_ctx *dst);   /* 0 or KVR_ENOMEM */
/* Hash of c's token ids (the APE record's prefix hash). */
int  layout_ctx_hash(const kvr_ctx *c, uint64_t *out, kvr_error *err);
/* c's APE record (borrowed strings): false if c was not created with one. */
bool layout_ape_record(const kvr_ctx *c, const char **prefix, uint64_t *fp,
                       size_t *len, uint64_t *hash);

/* quant.c: codecs at rest. */
/* Parses a codec spec (docs/quantized.md) for a model of dtype mdt and
 * shape; "" or NULL = plain mdt. KVR_EINVAL with a message on error. */
int  qspec_parse(const char *spec, const kvr_model *m, kvr_dtype mdt, kvr_qspec *out,
                 kvr_error *err);
/* Slots per quantized block of a context with this codec. */
uint32_t qspec_block_cap(const kvr_store *s, const kvr_qspec *q);
kvr_block *block_new_quant(kvr_store *s, const kvr_model *m, const kvr_qspec *q);
size_t     block_quant_bytes(const kvr_store *s, const kvr_model *m, const kvr_qspec *q);
/* Tile size alignment of a context's quantized K (1 for rows). */
uint32_t qspec_ktile(const kvr_qspec *q);

/* Encodes n tokens of one layer side (kv 0: keys, already pre-RoPE, f32
 * [n][row]; kv 1: values) into consecutive slots of quantized blocks
 * (runs). K tiles must start on a tile boundary; a run's last partial tile
 * is padded by repeating its last token (so the group ranges do not grow).
 * Accumulates the measured squared error and squared values. `scratch`
 * holds 2 * ktile * row floats. */
typedef struct qrun {
    kvr_block *b;
    uint32_t   first, count;
} qrun;
int  quant_encode_side(const kvr_model *m, const qrun *runs, size_t n_runs, uint32_t layer,
                       int kv, const float *src, float *scratch, double *sse, double *ss);
/* Decodes slots [first, first+count) of layer/kv of a quantized block into
 * f32 [count][row]. tilebuf: ktile * row floats (K tiles only). */
void quant_decode_side(const kvr_model *m, const kvr_block *b, uint32_t layer, int kv,
                       uint32_t first, uint32_t count, float *dst, float *tilebuf);
/* Reads keys (kv 0) or values (kv 1) of slots [first, first+count) of any
 * block into dst (odt), keys rotated from their stored form to `to`
 * (plain blocks: reposition from `from`; quantized: apply at `to`).
 * scratch: (count + ktile) * row floats for quantized blocks. Every layer
 * rotates with its own RoPE (kvr_rope_layer). ro: the sequence lengths of
 * length-dependent RoPE (dynamic NTK / longrope; NULL = the base table). */
int  block_read_side(const kvr_model *m, const kvr_block *b, uint32_t layer, int kv,
                     uint32_t first, uint32_t count, void *dst, kvr_dtype odt,
                     const int64_t *from, const int64_t *to, float *scratch,
                     const kvr_rope_opts *ro);
/* Finds the first non-finite value of a payload [layers][2][n][row] in dt:
 * true and the layer / kv / token index if any. */
bool quant_find_nonfinite(const void *payload, kvr_dtype dt, uint32_t n_layers, size_t n,
                          size_t row, uint32_t *layer, int *kv, size_t *tok);

/* tier.c: the disk tier (see its header comment). Loop thread, except
 * tier_reload_work. */
/* Bytes of a block's full data allocation (K/V + metadata). */
size_t tier_data_len(const kvr_block *b);
/* Frees one block's worth of memory by spilling the least recently used
 * resident, unheld block of an evictable context: 1 if memory was freed,
 * 0 if there is nothing to spill, a KVR_E* code if the disk refused. */
int  tier_evict_one(kvr_store *s);
/* Bytes that spilling every resident unheld block of evictable contexts
 * would give back. */
size_t tier_freeable(kvr_store *s);
/* Makes blocks bs[0..n) resident (synchronous batched load on the calling
 * thread: begin + work + end below; the blocks must be held so that
 * eviction cannot take them back), and prefetches the other spilled blocks
 * of `pf` (may be NULL) as far as memory allows. */
int  tier_fault_in(kvr_store *s, kvr_block *const *bs, size_t n, kvr_ctx *pf,
                   kvr_error *err);
/* A transaction's reload of spilled blocks, off the loop thread:
 *  begin (loop): for the spilled blocks among bs[0..n) (held by the
 *    caller), reserves memory (store_reserve: evicts/spills others; ENOMEM
 *    if impossible), allocates their buffers and takes a reference; adds
 *    the other spilled blocks of `pf` (may be NULL; made busy meanwhile) as
 *    a prefetch while they fit under the cap without evicting (bounded
 *    look-ahead). *out = NULL when nothing is spilled.
 *  view (loop, at begin): what to read b through: b itself if resident,
 *    else a copy of its fields whose data is the buffer (filled by work;
 *    valid until end). Iovecs may point into it (zero-copy).
 *  pending: work has not run yet.
 *  work (any thread, idempotent): one batched kvr_disk_load; KVR_EIO with
 *    a message if a block of the request failed (checksum / I/O; the layer
 *    quarantines it), prefetch failures are ignored. Touches no store map.
 *  end (loop; NULL ok): installs loaded buffers into blocks still spilled
 *    and still referenced elsewhere; frees the others (reloaded meanwhile
 *    by another request, or deleted); drops the references; stats. */
typedef struct tier_reload tier_reload;
int  tier_reload_begin(kvr_store *s, kvr_block *const *bs, size_t n, kvr_ctx *pf,
                       tier_reload **out, kvr_error *err);
const kvr_block *tier_reload_view(const tier_reload *r, const kvr_block *b);
bool tier_reload_pending(const tier_reload *r);
int  tier_reload_work(tier_reload *r, kvr_error *err);
void tier_reload_end(kvr_store *s, tier_reload *r);
/* block_unref's last reference: releases the disk copy (deferred while a
 * persisted record may still point at it). */
void tier_block_gone(kvr_store *s, kvr_block *b);
/* ctx_destroy of a persistent context: remembered for the DELETE record. */
void tier_ctx_gone(kvr_store *s, kvr_ctx *c);
/* kvr_store_destroy: tier_destroy before the contexts go (fails queued
 * records, stops logging), tier_close after (closes the disk). */
void tier_destroy(kvr_store *s);
void tier_close(kvr_store *s);
bool tier_persist_all(const kvr_store *s);

/* layout.c: the layout as an opaque blob (tier.c's records). */
size_t layout_blob_size(void);
bool   layout_blob_get(const kvr_ctx *c, void *out);   /* false: no layout */
int    layout_blob_set(kvr_ctx *c, const void *in);    /* 0 or KVR_ENOMEM */

#endif /* KVR_STORE_INTERNAL_H */
