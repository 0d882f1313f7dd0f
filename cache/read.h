/*
 * read.h — the read plan shared by get and assemble (private to cache/;
 * read.c). A read is a stream of tokens taken from extents of one or more
 * contexts, each with a target position; the plan leases their blocks,
 * lets the disk tier reload spilled ones, decides per run what goes out
 * zero-copy from block memory and what is produced into a staging buffer,
 * and does that work (rotation, conversion, dequantization, APE's
 * temperature) layer by layer on any thread.
 *
 * Payload: layer-major, for each selected layer K then V of every token,
 * [n][H][D] in the output dtype. Per run (consecutive slots of one block):
 * K is zero-copy when the run is a plain block of the output dtype, every
 * target equals the stored-at position and no temperature is folded in; V
 * when the run is a plain block of the output dtype. Everything else is
 * staged, per layer:
 *
 *   [ K of the staged runs, in run order | V of the staged runs, in order ]
 *
 * and the iovecs walk the runs in order, joining neighbours that touch.
 *
 * Invariants: after kvr_read_add every run's block is leased until
 * kvr_read_free; work reads only leased slots below each block's `used`,
 * which never change, so it may run on any thread while the store changes
 * around it (even deleting the contexts). Calls the store (reservations,
 * the tier's reload hooks), blocks and quant.h; never the tier directly.
 */
#ifndef KVR_CACHE_READ_H
#define KVR_CACHE_READ_H

#include <pthread.h>
#include <sys/uio.h>

#include "cache/txn.h"

#pragma GCC visibility push(hidden)

typedef struct kvr_read_run {
    kvr_block       *b;          /* leased */
    const kvr_block *rd;         /* what work and the iovecs read: b, or its
                                    disk-tier reload view */
    uint32_t         first, count;
    size_t           tok;        /* index of its first token in the stream */
    bool             same;       /* targets equal stored-at for every token */
    bool             fold;       /* keys divided by the temperature */
    bool             k_zc, v_zc; /* zero-copy from block memory */
    bool             one_pass;   /* keys of a plain block produced in one pass:
                                    converted with 1/T (same), or rotated by
                                    the one `delta` of every token (1/T folded
                                    in the same loop) */
    int64_t          delta;
    size_t           k_off, v_off;   /* else: offsets in the layer's staging */
} kvr_read_run;

/* A piece of a streamed read (kvr_read_stage_pieces): payload layer li's
 * side kv (0 K, 1 V), stream tokens [a, b): one contiguous range of the
 * payload, its iovecs piov[iov0 .. iov0 + n_iov). */
typedef struct kvr_read_piece {
    uint32_t li;
    uint8_t  kv;
    bool     work;               /* some of it is staged: produced in its slot */
    size_t   a, b;
    size_t   iov0, n_iov, bytes;
} kvr_read_piece;

typedef struct kvr_read {
    kvr_store    *s;
    kvr_model    *m;
    kvr_dtype     odt;
    bool          meta_only, worked, all_same;
    size_t        n, nl;         /* tokens, selected layers */
    uint32_t     *layers, *tokens, *flags;
    int64_t      *targets, *from;
    int32_t      *groups;        /* NULL unless asked for */
    kvr_read_run *runs;
    size_t        n_runs, cap_runs, n_added;
    float         inv_t;         /* 1/T for folded runs */
    kvr_rope_opts ro;            /* dynamic NTK / longrope: the tables' lengths */
    kvr_reload   *rl;            /* spilled blocks, loaded by work */
    size_t        kst, vst;      /* staged bytes per layer: K, V */
    size_t        stage_need;    /* bytes the whole staging takes (0: none);
                                    reserved and allocated only once the
                                    caller says how the payload goes out
                                    (kvr_read_stage_now / _ring), never for
                                    dst or kvr_read_work_into */
    const char   *what;          /* "get" / "assemble": reservation messages */
    char          keep_id[KVR_ID_MAX + 1]; /* context kept busy while staging
                                    is reserved ("" : none) */
    pthread_t     owner;         /* the store's thread (kvr_read_init's) */
    size_t        scratch;       /* floats of scratch one layer needs */
    uint8_t      *staging;       /* or dst */
    size_t        ring_per, ring_slots; /* kvr_read_stage_ring: layer li is staged
                                    in slot (li / per) % slots; 0: no ring */
    kvr_read_piece *pieces;      /* kvr_read_stage_pieces; NULL: none */
    size_t        n_pieces, piece_tok;  /* piece k is staged in slot k % ring_slots
                                    of piece_tok rows */
    struct iovec *piov;
    uint8_t      *dst;           /* set before stage: everything is produced
                                    here, in wire order (no zero-copy runs,
                                    no staging of our own) */
    size_t        dst_cap;
    kvr_payload   out;           /* the iovecs: block memory and staging */
} kvr_read;

/* Allocates the metadata of a read of n tokens from at most max_runs
 * extents, layers[0..nl) (NULL: the first nl). 0 or KVR_ENOMEM. */
int  kvr_read_init(kvr_read *r, kvr_store *s, kvr_model *m, const uint32_t *layers,
                   size_t nl, size_t n, size_t max_runs, bool groups, bool meta_only,
                   kvr_dtype odt);
/* Appends slots [a, z) of extent e to the stream. Targets: targets[i] for
 * stream token i if given; else consecutive from *next (advanced) if
 * given, marking tokens moved off their logical position approximate when
 * mark_moved; else the logical positions. fold: divide keys by 1/inv_t. */
void kvr_read_add(kvr_read *r, const kvr_extent *e, uint32_t a, uint32_t z,
                  const int64_t *targets, int64_t *next, bool mark_moved, bool fold);
/* Disk tier: reloads of the spilled blocks of the runs (prefetching the
 * rest of pf, may be NULL); everything after reads through their views. */
int  kvr_read_reload(kvr_read *r, kvr_ctx *pf, kvr_error *err);
/* KVR_EUNSUPPORTED when keys must move and the model's RoPE does not
 * compose (assemble: its documents come from several contexts). */
int  kvr_read_check_rope(const kvr_read *r, kvr_error *err);
/* Length-dependent RoPE (dynamic NTK / longrope) read from one context c:
 * sets the tables' lengths (read.c says which) and marks every run moved
 * when the two tables differ. requested: the targets were asked for. No-op
 * for RoPE that composes. After every kvr_read_add. */
void kvr_read_rope_lens(kvr_read *r, const kvr_ctx *c, bool requested);
/* Zero-copy decisions and the staging's layout (request `what`; with
 * r->dst set: every run is produced into dst, whose per-layer layout then is
 * exactly the wire's, and nothing is reserved; `keep`, may be NULL: the
 * context made busy while the staging is reserved, so eviction spares it).
 * Lazy: the staging itself is reserved and allocated only by
 * kvr_read_stage_now (whole) or kvr_read_stage_ring (a ring), and never for
 * kvr_read_work_into; until then the iovecs are empty unless nothing is
 * staged. */
int  kvr_read_stage(kvr_read *r, kvr_ctx *keep, const char *what, kvr_error *err);
/* The store's thread: reserves and allocates the whole staging and fills
 * the iovecs. No-op when staged already or nothing is staged. 0, or the
 * reservation's error (KVR_ETOOLARGE / KVR_ENOMEM); nothing changed then. */
int  kvr_read_stage_now(kvr_read *r, kvr_error *err);
/* Raw read (quantized blocks as stored, zero-copy): *kb / *vb bytes of K /
 * V per layer; KVR_EUNSUPPORTED (naming ctx_id, token `start` + i) where
 * the runs cannot go out raw. */
int  kvr_read_stage_raw(kvr_read *r, const char *ctx_id, size_t start, size_t *kb,
                        size_t *vb, kvr_error *err);
bool kvr_read_needs_work(const kvr_read *r);
/* The store's thread, before any work. A caller that works and sends the
 * layers `per` at a time, in order, with at most `slots` such chunks staged
 * at once (the daemon's streamed get): the staging is a ring of that many
 * chunks (only the ring is reserved), reused chunk after chunk (its pages
 * faulted in once, the ring itself kept for the next request:
 * kvr_mem_staging). Chunk k's bytes are then valid from its work until
 * chunk k + slots is worked. Where the ring would not be smaller, the
 * whole staging (kvr_read_stage_now); no-op when nothing is staged or it
 * is staged already. 0, or the reservation's error. */
int  kvr_read_stage_ring(kvr_read *r, size_t per, size_t slots, kvr_error *err);
/* The whole read straight into dst (out.bytes, wire order), staged parts
 * computed in place, zero-copy ones copied; the staging is not used. Same
 * bytes as work + the iovecs. size: dst's, which must be out.bytes
 * (KVR_EINVAL naming the transaction `what` otherwise; nothing to do for
 * an empty payload). */
int  kvr_read_work_into(kvr_read *r, void *dst, size_t size, const char *what,
                        const char *nomem, kvr_error *err);
/* The store's thread, before any work: a streamed read sent in pieces of
 * about piece_bytes (whole rows, a side of a layer split at token
 * boundaries; a side with nothing staged is one piece, straight from block
 * memory), with at most `slots` pieces staged at once: only a ring of
 * `slots` pieces is reserved, and a piece's staged bytes are produced just
 * before its write reads them, while they are still in cache. Only for
 * reads whose staged runs are all produced row by row with the same bits
 * however they are split (keys of plain blocks in one pass, values of
 * plain blocks converted); for any other *n_pieces = 0 and nothing
 * changes. 0, or the reservation's error. Piece k's bytes are valid from
 * its work until piece k + slots is worked; the whole-payload iovecs and
 * kvr_read_work are not available on a read in pieces. */
int  kvr_read_stage_pieces(kvr_read *r, size_t piece_bytes, size_t slots, size_t *n_pieces,
                           kvr_error *err);
/* Piece k's work (any thread; the first call must return before any
 * other starts: it does the disk tier's load) and iovecs. */
int  kvr_read_work_piece(kvr_read *r, size_t k, const char *nomem, kvr_error *err);
void kvr_read_iov_piece(const kvr_read *r, size_t k, const struct iovec **iov, size_t *n,
                        size_t *bytes);
/* Produces layers [l0, l1) of the staging (the reload first); all layers
 * mark the read worked. nomem: the message for KVR_ENOMEM. Any thread once
 * staged; a read not staged yet is staged whole first (kvr_read_stage_now),
 * which only the store's thread may do (KVR_EINTERNAL elsewhere). */
int  kvr_read_work(kvr_read *r, size_t l0, size_t l1, const char *nomem, kvr_error *err);
/* The iovecs of layers [l0, l1). */
void kvr_read_iov_layers(const kvr_read *r, size_t l0, size_t l1, const struct iovec **iov,
                         size_t *n);
void kvr_read_free(kvr_read *r);

/* Fills the fields kvr_get_info and kvr_assemble_info share from the plan
 * (borrowed arrays, valid until the plan is freed). */
#define KVR_READ_INFO(info, r)                                                 \
    do {                                                                       \
        kvr_model_fill_info((r)->m, &(info)->model);                           \
        (info)->n_tokens = (r)->n;                                             \
        (info)->dtype = (r)->odt;                                              \
        (info)->n_layers = (r)->meta_only ? 0 : (r)->nl;                       \
        (info)->layers = (r)->layers;                                          \
        (info)->tokens = (r)->tokens;                                          \
        (info)->positions = (r)->targets;                                      \
        (info)->flags = (r)->flags;                                            \
    } while (0)

/* The public accessors (cache.h) of a read transaction: a struct `type`
 * whose members `r` and `info` are its kvr_read and info; nomem: its message for KVR_ENOMEM. */
#define KVR_READ_TXN_API(type, info_type, prefix, nomem)                       \
    const info_type *prefix##_get_info(const type *t)                          \
    {                                                                          \
        return &t->info;                                                       \
    }                                                                          \
    bool prefix##_needs_work(const type *t)                                    \
    {                                                                          \
        return kvr_read_needs_work(&t->r);                                     \
    }                                                                          \
    int prefix##_work(type *t, kvr_error *err)                                 \
    {                                                                          \
        return kvr_read_work(&t->r, 0, t->r.nl, nomem, err);                   \
    }                                                                          \
    int prefix##_stage(type *t, kvr_error *err)                                \
    {                                                                          \
        return kvr_read_stage_now(&t->r, err);                                 \
    }                                                                          \
    KVR_PAYLOAD_API(type, prefix, r.out)

#pragma GCC visibility pop

#endif /* KVR_CACHE_READ_H */
