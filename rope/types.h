/*
 * types.h — the vocabulary the store (cache/cache.h) and the client library
 * (client/kvrope.h) share: name limits, write modes, per-token flags,
 * assemble layouts and segment kinds, group limits. Where both sides speak
 * of the same thing they use these names and these values, which are also
 * the wire's (proto/frame.c asserts each against the generated enums).
 *
 * Header only; it lives in rope/, the lowest layer, next to error.h, so that
 * libkvrope's public headers need nothing from cache/.
 */
#ifndef KVR_TYPES_H
#define KVR_TYPES_H

#define KVR_ID_MAX 255          /* context id and model name, bytes (no NUL) */
#define KVR_CODEC_NAME_MAX 64   /* canonical codec spec, with its NUL */

/* How a put treats an existing context (wire PutMode). */
typedef enum kvr_put_mode {
    KVR_PUT_CREATE = 0,         /* KVR_EEXIST if the id exists */
    KVR_PUT_APPEND = 1,         /* KVR_ENOCTX if it does not */
    KVR_PUT_UPSERT = 2,         /* create or append */
    KVR_PUT_REPLACE = 3,        /* create, or replace the id's context at once
                                   (as a delete then a create, atomically) */
} kvr_put_mode;

/* Per-token flags (a get's flags array). */
#define KVR_TOKEN_APPROX 0x1u   /* KV computed against text that changed since */
#define KVR_TOKEN_PENDING 0x2u  /* inserted by an edit without KV: no KV until a
                                   refresh; a get of its KV is KVR_EPENDING, a
                                   meta_only get works */
#define KVR_TOKEN_STALE 0x4u    /* restored from an older record: the context's
                                   newest persisted state was lost (corrupt log
                                   record); set with KVR_TOKEN_APPROX */
/* Bits 8..15: the token's approximation age, how many edits ago its KV was
 * last exact (0 for exact tokens; saturates at 255). An edit ages every
 * approximate token after its first edit point by one and makes the exact
 * ones there age 1; a refresh or a put clears it. It travels with the flags
 * (wire, persistence, the shared tier). */
#define KVR_TOKEN_AGE_SHIFT 8u
#define KVR_TOKEN_AGE_MASK  0xff00u
#define KVR_TOKEN_AGE(f)    (((f) & KVR_TOKEN_AGE_MASK) >> KVR_TOKEN_AGE_SHIFT)

/* A token sequence's fingerprint for compare-and-swap writes (an edit or
 * refresh that says which sequence it was planned against; KVR_EBUSY when
 * the context holds another): FNV-1a 64 over the ids' little-endian bytes,
 * continued from h (start with KVR_TOKENS_HASH_INIT). */
#define KVR_TOKENS_HASH_INIT 1469598103934665603ull
static inline uint64_t kvr_tokens_hash(uint64_t h, const uint32_t *t, size_t n)
{
    for (size_t i = 0; i < n; i++)
        for (unsigned k = 0; k < 32; k += 8)
            h = (h ^ ((t[i] >> k) & 0xffu)) * 1099511628211ull;
    return h;
}

/* Assemble layouts (APE, docs/ape.md; wire Layout). */
typedef enum kvr_layout_kind {
    KVR_LAYOUT_PARALLEL   = 0,  /* every document at P..P+L_i-1; query at P + max L_i */
    KVR_LAYOUT_SEQUENTIAL = 1,  /* documents back to back: P, P+L_1, ... (moved
                                   documents' tokens are KVR_TOKEN_APPROX) */
    KVR_LAYOUT_EXPLICIT   = 2,  /* document i at starts[i]..; query at
                                   max(P, max(starts[i] + L_i)) */
} kvr_layout_kind;

/* Segments of an assembled stream (wire SegmentKind). */
typedef enum kvr_segment_kind {
    KVR_SEGMENT_PREFIX   = 0,
    KVR_SEGMENT_DOCUMENT = 1,
    KVR_SEGMENT_QUERY    = 2,   /* always last, empty: where the query goes */
} kvr_segment_kind;

#define KVR_APE_TEMPERATURE 0.9   /* APE paper defaults */
#define KVR_APE_SCALE       0.9

/* Position groups (GPE). */
#define KVR_MAX_GROUPS 16
#define KVR_GROUP_NAME_MAX 63     /* bytes, without the NUL */

/* Cover (cached runs anywhere in a prompt; docs/reuse.md): contexts are
 * indexed in grains of KVR_COVER_GRAIN tokens at offsets 0, 16, 32, ...;
 * a prompt may have up to KVR_COVER_MAX_TOKENS tokens; runs shorter than
 * the minimum run (default KVR_COVER_MIN_RUN) are left as gaps. */
#define KVR_COVER_GRAIN      16u
#define KVR_COVER_MIN_RUN    16u
#define KVR_COVER_MAX_TOKENS (128u * 1024u)

#endif /* KVR_TYPES_H */
