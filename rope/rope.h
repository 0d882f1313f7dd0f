/*
 * rope.h — kvrope's positional engine: the kernels that apply, remove and
 * re-position rotary embeddings on [tokens][heads][head_dim] buffers, built
 * from a model configuration (base/config.h).
 *
 * This is the whole public API of rope/. It has no dependency on libuv and
 * none on the rest of kvrope but the foundation (base/: the error space,
 * element types and their conversions, configurations, the worker pool, the
 * CPU's kernel choice, all included from here so
 * that one include gives a caller the engine's whole vocabulary); cache/,
 * daemon/ and client/ build on it.
 *
 * Conventions (the project's, base/error.h): functions return 0 on success
 * and a negative KVR_E* code on failure (KVR_EINVAL for a bad argument or
 * configuration, KVR_ENOMEM, KVR_EIO for a file that cannot be read).
 * Functions that can refuse a configuration take a `kvr_error *` (may be
 * NULL) and write a message naming the offending field there.
 *
 * Invariants the kernels keep:
 *  - Angles p * inv_freq[i] are computed in double precision.
 *  - Dimensions at index >= rotary_dim pass through unchanged (converted only).
 *  - reposition(k, from, to) is a pure rotation by (to - from): the YaRN
 *    magnitude factor (attention_factor) is multiplied in by apply, divided out
 *    by remove, and never touched by reposition, so norms are preserved.
 *  - In-place operation (dst == src with the same dtype) is allowed.
 */
#ifndef KVR_ROPE_H
#define KVR_ROPE_H

#include <stddef.h>
#include <stdint.h>
#include <stdbool.h>

#include "base/error.h"
#include "base/dtype.h"
#include "base/config.h"
#include "base/pool.h"
#include "base/cpu.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- engine ------------------------------------------------------------- */

typedef struct kvr_rope kvr_rope;   /* immutable after create; thread-safe */

/* Builds the frequency tables. The caller owns *out (kvr_rope_destroy). */
int  kvr_rope_create(kvr_rope **out, const kvr_rope_config *cfg, kvr_error *err);
void kvr_rope_destroy(kvr_rope *r);                 /* NULL is a no-op */
const kvr_rope_config *kvr_rope_get_config(const kvr_rope *r);

/* The engine of one layer: r itself for GLOBAL layers (and for configs
 * without a per-layer map), else an engine owned by r for that layer's kind
 * (LOCAL: local_theta, no scaling; NONE: no rotation, kernels only convert).
 * Never NULL for a non-NULL r. */
const kvr_rope *kvr_rope_layer(const kvr_rope *r, uint32_t layer);

/* Effective values the engine derived (what model info reports): the factor
 * (longrope: max/original positions when both are given) and the magnitude
 * applied with the rotation (YaRN / longrope attention factor, else 1). */
double kvr_rope_factor(const kvr_rope *r);
double kvr_rope_attention_scale(const kvr_rope *r);

/* True if the frequency tables for the two sequence lengths are the same
 * (always for composing types; dynamic NTK: both within the original
 * length; longrope: both on the same side of it). */
bool kvr_rope_same_table(const kvr_rope *r, int64_t seq_len_a, int64_t seq_len_b);

/* Per-call options; pass NULL for the defaults (all zero). */
typedef struct kvr_rope_opts {
    int     n_threads;      /* 0 = 1 thread for small buffers, more for large */
    kvr_isa isa;            /* force a kernel (tests, bench); AUTO by default */
    /* Dynamic NTK / longrope only: the sequence length whose frequency table
     * the key was written with (seq_len_from) and the one to rotate into
     * (seq_len_to). 0 = the table for lengths within
     * original_max_position_embeddings. For composing types these are
     * ignored. reposition with different tables removes with the old table
     * and applies with the new one (never a delta rotation). apply rotates
     * with the seq_len_to table, remove un-rotates with the seq_len_from
     * table. Tables equal for both lengths (e.g. both within the original
     * length) make reposition the plain delta rotation. Dynamic NTK:
     * base = theta * (factor*L/orig - (factor-1))^(rot/(rot-2)), L =
     * max(seq_len, orig); longrope: long_factor when seq_len > orig, else
     * short_factor (its attention factor is the same for both, so it cancels
     * in reposition). */
    int64_t seq_len_from;
    int64_t seq_len_to;
    /* The output is large and not read again soon (a whole context into a
     * caller's buffer): kvr_rope_reposition_delta, kvr_rope_apply,
     * kvr_rope_apply_src and kvr_rope_remove may write it with
     * non-temporal stores where the ISA and dst's alignment allow (no read
     * of each destination line before its write). The same bits; stores
     * are fenced before the call returns. */
    bool    stream;
} kvr_rope_opts;


/* Buffers are [n_tokens][n_heads][head_dim] contiguous, head_dim from the
 * config. pos / from / to have n_tokens entries, any int64 values
 * (non-contiguous, repeated, negative deltas are all fine).
 * apply:      dst = R(pos) x * mscale                (x un-rotated)
 * remove:     dst = R(-pos) k / mscale               (k rotated at pos)
 * reposition: dst = R(to - from) k                   (pure rotation)
 * Returns KVR_EINVAL for a bad dtype or a NULL buffer with n_tokens > 0. */
int kvr_rope_apply(const kvr_rope *r, void *dst, kvr_dtype dst_type,
                   const void *src, kvr_dtype src_type,
                   size_t n_tokens, size_t n_heads, const int64_t *pos,
                   const kvr_rope_opts *opts);
/* apply, with the f32 source rows produced on demand: src(ud, t) returns
 * token t's n_heads * head_dim values (valid until the next call), asked
 * for in token order on the calling thread (opts->n_threads is ignored).
 * The rotation is kvr_rope_apply's on the same values, to the bit; a
 * dequantizing reader decodes a few rows into cache-sized scratch instead
 * of the whole source. */
typedef const float *(*kvr_rope_src_fn)(void *ud, size_t t);
int kvr_rope_apply_src(const kvr_rope *r, void *dst, kvr_dtype dst_type,
                       kvr_rope_src_fn src, void *ud, size_t n_tokens, size_t n_heads,
                       const int64_t *pos, const kvr_rope_opts *opts);
int kvr_rope_remove(const kvr_rope *r, void *dst, kvr_dtype dst_type,
                    const void *src, kvr_dtype src_type,
                    size_t n_tokens, size_t n_heads, const int64_t *pos,
                    const kvr_rope_opts *opts);
int kvr_rope_reposition(const kvr_rope *r, void *dst, kvr_dtype dst_type,
                        const void *src, kvr_dtype src_type,
                        size_t n_tokens, size_t n_heads,
                        const int64_t *from, const int64_t *to,
                        const kvr_rope_opts *opts);

/* reposition by one delta for every token (to - from = delta), each result
 * multiplied by `scale` in f32 before it is rounded to dst_type (APE's
 * temperature folded into the keys), in one pass: the per-token table is
 * computed once per call (per thread's share) and reused for every token.
 * The same bits as kvr_rope_reposition with those positions into f32,
 * times scale, kvr_convert to dst_type; with scale 1 exactly
 * kvr_rope_reposition. For RoPE that composes, or tables of the two
 * lengths in opts that are the same; KVR_EINVAL otherwise (and for what
 * reposition refuses). dst != src unless the dtypes are equal and scale
 * is 1. */
int kvr_rope_reposition_delta(const kvr_rope *r, void *dst, kvr_dtype dst_type,
                              const void *src, kvr_dtype src_type,
                              size_t n_tokens, size_t n_heads, int64_t delta, float scale,
                              const kvr_rope_opts *opts);

#ifdef __cplusplus
}
#endif
#endif /* KVR_ROPE_H */
