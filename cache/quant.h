/*
 * quant.h — codecs at rest (private to cache/): a context's codec spec, the
 * geometry of its quantized blocks, and encoding / decoding / reading one
 * side (K or V) of one layer of a block. Sits on the block layer and knows
 * nothing of contexts, models or the store: a model's shape comes in as
 * row sizes, its RoPE as the engine.
 */
#ifndef KVR_CACHE_QUANT_H
#define KVR_CACHE_QUANT_H

#include "cache/block.h"

#pragma GCC visibility push(hidden)

/* A storage codec of a model or context. plain: blocks in `dtype`, keys
 * rotated at their stored-at positions (the historical format). quant:
 * quantized blocks with pre-RoPE keys, plus plain window blocks in `dtype`
 * (the model's) for the most recent tokens. */
typedef struct kvr_qspec {
    bool           quant;
    kvr_dtype      dtype;
    kvr_codec_pair pair;
    char           name[KVR_CODEC_NAME_MAX];
} kvr_qspec;

/* Parses a codec spec (docs/quantized.md) for a model called `model` with
 * RoPE `rc`, rows of `row` values and dtype mdt; "" or NULL = plain mdt.
 * KVR_EINVAL / KVR_EUNSUPPORTED with a message on error. */
int      kvr_qspec_parse(const char *spec, const kvr_rope_config *rc, const char *model,
                         uint32_t row, kvr_dtype mdt, kvr_qspec *out, kvr_error *err);
/* Tile size alignment of a context's quantized K (1 for rows). */
uint32_t kvr_qspec_ktile(const kvr_qspec *q);
/* Slots per quantized block for a store of B-token blocks. */
uint32_t kvr_qspec_block_cap(const kvr_qspec *q, uint32_t B);
/* Geometry of a quantized block of this codec (q->quant). */
void     kvr_qspec_geom(const kvr_qspec *q, uint32_t B, uint32_t n_layers, uint32_t row,
                        kvr_block_geom *g);

/* Encodes n tokens of one layer side (kv 0: keys, already pre-RoPE, f32
 * [n][row]; kv 1: values; src in sdt: f32, or f16 for rows coded per token,
 * measured without a conversion) into consecutive slots of quantized blocks
 * (runs). K tiles must start on a tile boundary; a run's last partial tile
 * is padded by repeating its last token (so the group ranges do not grow).
 * Accumulates the measured squared error and squared values into acc.
 * `scratch` holds 2 * ktile * row floats. */
/* Where an encode's error sums go: added to *sse / *ss (rec NULL), or, for
 * layers encoded in parallel, recorded as (e, q) pairs in order (at most
 * one per slot encoded plus one per run), to be replayed in layer order:
 * the same additions in the same order, so the totals do not depend on the
 * thread count. */
typedef struct kvr_qacc {
    double *sse, *ss;
    double *rec;
    size_t  n, cap;
} kvr_qacc;
void kvr_qacc_replay(const kvr_qacc *a, double *sse, double *ss);
int  kvr_quant_encode_side(const kvr_brun *runs, size_t n_runs, uint32_t layer, int kv,
                           const void *src, kvr_dtype sdt, float *scratch, kvr_qacc *acc);
/* Reads keys (kv 0) or values (kv 1) of slots [first, first+count) of any
 * block into dst (odt), keys rotated from their stored form to `to`
 * (plain blocks: reposition from `from`, or converted when from is NULL;
 * quantized: applied at `to`) by `engine` (the layer's own RoPE: callers
 * pass kvr_rope_layer(model engine, layer)) for rows of n_heads heads.
 * scratch: (count + ktile) * row floats for quantized blocks. ro: the
 * sequence lengths of length-dependent RoPE (dynamic NTK / longrope; NULL =
 * the base table). ro->stream: a quantized block's keys and values are
 * written with non-temporal stores where they can be (the same bytes;
 * fenced before the return; plain blocks ignore it). */
int  kvr_block_read_side(const kvr_rope *engine, uint32_t n_heads, const kvr_block *b,
                         uint32_t layer, int kv, uint32_t first, uint32_t count, void *dst,
                         kvr_dtype odt, const int64_t *from, const int64_t *to,
                         float *scratch, const kvr_rope_opts *ro);
/* Finds the first non-finite value of a payload [layers][2][n][row] in dt:
 * true and the layer / kv / token index if any. */
/* AVX2: true if any of the n values is NaN or infinite (scan_avx2.c). */
bool kvr_any_nonfinite_avx2(const void *p, kvr_dtype dt, size_t n);
bool kvr_quant_find_nonfinite(const void *payload, kvr_dtype dt, uint32_t n_layers, size_t n,
                              size_t row, uint32_t *layer, int *kv, size_t *tok);

#pragma GCC visibility pop

#endif /* KVR_CACHE_QUANT_H */
