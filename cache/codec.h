/*
 * codec.h — kvrope's codecs for K/V at rest (private to cache/).
 *
 * A codec turns a run of float values into bytes and back. The store keeps
 * every block's K and V in the codec its model was configured with; this
 * header is the kernel layer only: it knows nothing of contexts or blocks,
 * allocates nothing, and can be linked and tested without the store.
 *
 * Codecs
 *   F32, F16, BF16     plain element types (lossless for data already in them)
 *   INT8, INT4, INT2   uniform, group-wise ASYMMETRIC: each group of `group`
 *                      values has a minimum m and a scale s; a value x is
 *                      stored as q = round((x - m) / s) in [0, 2^bits - 1]
 *                      and read back as y = q*s + m.
 *   Q8_0 Q4_0 Q4_1 Q5_0  ggml's legacy blocks of 32, BIT FOR BIT what ggml's
 *                      quantize_row_*_ref writes and dequantize_row_* reads,
 *                      so llama.cpp caches can be exchanged byte for byte.
 *
 * Uniform groups — exact encoding rule (the scalar reference; the SIMD kernels
 * produce the same bytes):
 *   lo, hi  = min and max of the group's values
 *   m       = PARAMS_F16: the largest f16 <= lo ("min rounded down");
 *             PARAMS_F32: lo
 *   s       = 0 if hi == m, else the smallest f16 (or f32 >= 2^-100) with
 *             m + L*s >= hi evaluated in double, L = 2^bits - 1 ("scale
 *             rounded up"; for f16 the check is exact)
 *   inv     = s > 0 ? 1.0f / s : 0
 *   q       = clamp(rintf((x - m) * inv), 0, L)   (float ops, no FMA, RNE)
 *   decode: y = (float)q * s + m                  (float mul then add)
 * Because m and s are chosen from the values as they are STORED (not the
 * exact ones), every x lies in [m, m + L*s], so |y - x| <= s/2 against the
 * stored scale, up to float rounding of the three operations above (a few
 * ulps of max(|x|, |m| + L*s); tests allow 2^-20 of that). A constant group
 * has s = 0 and decodes exactly whenever the constant is representable in the
 * parameter type: always for PARAMS_F32, and for PARAMS_F16 whenever the data
 * came from f16 (or bf16 inside f16's range). Zeros decode to zeros.
 * Why f16 parameters by default: they cost 32 bits per group (int4 at group 64
 * is 4.5 bits per value, the same as ggml q4_0), and rounding m down and s up
 * keeps the half-step bound; the price is a value range limit |x| <= 65504
 * (f16's), which K/V from f16/bf16 models respects. PARAMS_F32 costs 64 bits
 * per group and accepts |x| <= 2^64.
 *
 * Byte layout of a uniform row of n values (group G, bits b, P = 4 bytes of
 * parameters for PARAMS_F16, 8 for PARAMS_F32), groups back to back:
 *
 *   group:  [ s (f16|f32, LE) ][ m (f16|f32, LE) ][ qs: chunks of 32 values ]
 *   chunk of 32 quants q[0..31], 32*b/8 bytes:
 *     INT8  byte j (0..31) = q[j]
 *     INT4  byte j (0..15) = q[j] | q[j+16] << 4         (ggml q4 nibble order)
 *     INT2  byte j (0..7)  = q[j] | q[j+8] << 2 | q[j+16] << 4 | q[j+24] << 6
 *   The last group may be short (n % G values); its last chunk is padded
 *   with q = 0. row_bytes = ceil(n/G)*P + ceil(n/32)*4*b.
 *
 * KIVI. Keys are quantized per CHANNEL over groups of G tokens, values per
 * TOKEN over groups of G channels; the most recent `window` tokens stay in
 * full precision and are quantized as they age out (kvr_kivi_split says how
 * many). A key tile is [G tokens][n_ch channels] (token-major, as the store
 * holds the data); it is encoded as n_ch uniform groups of G values, channel
 * after channel:   tile = group(ch 0: tokens 0..G-1) group(ch 1) ...
 * Values (and non-KIVI keys) use the row functions on each token's
 * [heads*head_dim] row.
 *
 * ggml blocks (n must be a multiple of 32; d, m are f16):
 *   Q8_0 34 B: d, int8 qs[32]               y = qs[j]*d
 *   Q4_0 18 B: d, qs[16] = q[j] | q[j+16]<<4   y = (q - 8)*d
 *   Q4_1 20 B: d, m, qs[16] (as Q4_0)        y = q*d + m
 *   Q5_0 22 B: d, qh[4] (bit 4 of q[j] at bit j, LE u32), qs[16] (low nibbles
 *              as Q4_0)                      y = (q - 16)*d
 *
 * Errors: 0 on success, a negative KVR_E* code (cache/cache.h) on failure.
 * Input that is NaN or infinite, or outside the codec's value range, is
 * refused with KVR_EINVAL and the index of the first offending element in
 * *bad (when bad is non-NULL) — the store turns it into "layer L token T".
 * On error dst holds unspecified bytes. Functions never allocate; buffers
 * are the caller's and only borrowed for the duration of the call.
 *
 * Threading: every function is reentrant; CPU features are detected once
 * (the first call) through __builtin_cpu_supports.
 *
 * Kernels: the uniform codecs' row encode/decode (f32/f16 in and out) and
 * the KIVI tile transposes have AVX2+FMA+F16C versions (codec_avx2.c) that
 * produce the scalar reference's bytes exactly. KVR_ISA_AVX512 (and AUTO on
 * a CPU with AVX-512 F/BW/VL/DQ) adds codec_avx512.c: row encoding 16
 * groups at a time with vectorised parameter choice, and whole KIVI tiles
 * encoded/decoded vectorised across channels, f16 parameters (f32
 * parameters use the AVX2 kernels); same bytes again. bf16 goes through f32
 * a group at a time. The ggml block codecs have AVX2 kernels
 * (codec_ggml_avx2.c) and an AVX-512 encoder (codec_ggml_avx512.c) for
 * f32/f16 data, with the scalar reference's bytes; bf16 data uses the
 * scalar reference.
 */
#ifndef KVR_CACHE_CODEC_H
#define KVR_CACHE_CODEC_H

#include <stddef.h>
#include <stdint.h>
#include <stdbool.h>

#include "rope/rope.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum kvr_codec_type {
    KVR_CODEC_F32  = 0,
    KVR_CODEC_F16  = 1,
    KVR_CODEC_BF16 = 2,
    KVR_CODEC_INT8 = 3,
    KVR_CODEC_INT4 = 4,
    KVR_CODEC_INT2 = 5,
    KVR_CODEC_Q8_0 = 6,
    KVR_CODEC_Q4_0 = 7,
    KVR_CODEC_Q4_1 = 8,
    KVR_CODEC_Q5_0 = 9,
    KVR_CODEC_TYPE_COUNT_ = 10,
} kvr_codec_type;

/* Which way a uniform codec's groups run (only the store acts on it: the
 * row functions always group contiguous values, the tile functions always
 * group a channel's tokens). */
typedef enum kvr_codec_axis {
    KVR_CODEC_AXIS_TOKEN   = 0,  /* per token: a group is G channels of one token */
    KVR_CODEC_AXIS_CHANNEL = 1,  /* KIVI keys: a group is G tokens of one channel */
} kvr_codec_axis;

typedef enum kvr_codec_params {
    KVR_CODEC_PARAMS_F16 = 0,    /* s and m as f16: 32 bits per group, |x| <= 65504 */
    KVR_CODEC_PARAMS_F32 = 1,    /* s and m as f32: 64 bits per group, |x| <= 2^64 */
} kvr_codec_params;

#define KVR_CODEC_GROUP_DEFAULT 64u
/* The K4V2 default ("k4v2", "quant", kvr_codec_pair_default): chosen by
 * docs/quantized.md's size table and docs/eval.md's quality table. Keys per
 * channel over tiles of 128 tokens, values per token over 256 channels:
 * 4.25 + 2.125 bits a value, 5.02x smaller than f16 in the Llama-3-8B shape,
 * at +0.0013 bits/byte on the trained model against f16 (g64 everywhere:
 * 4.57x, the same +0.0013). */
#define KVR_CODEC_K4V2_KTILE    128u
#define KVR_CODEC_K4V2_VGROUP   256u
#define KVR_CODEC_K4V2_WINDOW   128u
#define KVR_CODEC_GROUP_MAX     256u   /* uniform groups: multiples of 32 up to this */
#define KVR_CODEC_F16_LIMIT     65504.0f
#define KVR_CODEC_F32_LIMIT     18446744073709551616.0f  /* 2^64 */

/* A codec descriptor: a plain value, zero-initialised fields are defaults
 * (group 64, per token, f16 parameters, best ISA). */
typedef struct kvr_codec {
    kvr_codec_type   type;
    uint32_t         group;   /* INT*: values per group, 0 = 64; others ignore it */
    kvr_codec_axis   axis;
    kvr_codec_params params;
    kvr_isa          isa;     /* force a kernel (tests, bench); AUTO = best */
} kvr_codec;

/* K and V codecs of a model, and the KIVI full-precision window: the most
 * recent `window` tokens are kept in f16/f32 (the model's dtype) and are
 * quantized as they leave it. */
typedef struct kvr_codec_pair {
    kvr_codec k;
    kvr_codec v;
    uint32_t  window;
} kvr_codec_pair;

/* ---- descriptors -------------------------------------------------------- */

const char *kvr_codec_type_name(kvr_codec_type t);   /* "int4", "q4_0", ...; "?" */
/* Parses "f32" "f16" "bf16" "int8" "int4" "int2" "q8_0" "q4_0" "q4_1" "q5_0",
 * optionally followed by "/g<group>" (e.g. "int4/g32"). Other fields of *out
 * are the defaults. 0 or KVR_EINVAL. */
int  kvr_codec_parse(const char *s, kvr_codec *out);
/* KVR_EINVAL for an unknown type, a group that is not a multiple of 32 in
 * [32, 256], an unknown axis/params/isa; KVR_EUNSUPPORTED for a channel axis
 * on a non-uniform codec. */
int  kvr_codec_validate(const kvr_codec *c);
bool kvr_codec_is_uniform(kvr_codec_type t);          /* INT8/INT4/INT2 */
bool kvr_codec_is_ggml(kvr_codec_type t);             /* Q8_0..Q5_0 */
unsigned kvr_codec_value_bits(kvr_codec_type t);      /* 32 16 16 8 4 2 8 4 4 5 */
uint32_t kvr_codec_group(const kvr_codec *c);         /* effective group (32 for ggml, 1 plain) */

/* "k4v2": K int4 per channel over KVR_CODEC_K4V2_KTILE tokens, V int2 per
 * token over KVR_CODEC_K4V2_VGROUP channels, f16 parameters, window 128
 * (KIVI's residual length). The store's "k4v2" spec is this pair. */
kvr_codec_pair kvr_codec_pair_default(void);
int kvr_codec_pair_validate(const kvr_codec_pair *p); /* both codecs valid */

/* ---- sizes and accounting ----------------------------------------------- */

/* Bytes of an encoded row of n values; 0 if the codec is invalid or n is not
 * allowed (ggml blocks: n % 32 != 0). n = 0 gives 0. */
size_t kvr_codec_row_bytes(const kvr_codec *c, size_t n);
/* Bytes of an encoded key tile of group() tokens by n_ch channels (uniform
 * codecs only, else 0): n_ch * row_bytes(group). */
size_t kvr_codec_tile_bytes(const kvr_codec *c, size_t n_ch);
/* Bits per value including scales/mins, for a row of n values (n = 0: in
 * the limit of long rows, i.e. bits + parameter bits / group). */
double kvr_codec_bits_per_value(const kvr_codec *c, size_t n);
/* Steady-state bytes per token of a model with the pair (K and V, all
 * layers), the window not counted (it is f16-sized and bounded). */
double kvr_codec_pair_bytes_per_token(const kvr_codec_pair *p, uint32_t n_layers,
                                      uint32_t n_kv_heads, uint32_t head_dim);

/* ---- rows --------------------------------------------------------------- */

/* Encodes n values of src (src_type) into dst (row_bytes(c, n) bytes).
 * Returns 0, KVR_EINVAL (bad codec, NULL buffer with n > 0, non-finite or
 * out-of-range input: *bad = first such index) or KVR_EUNSUPPORTED (ggml
 * block codec and n % 32 != 0). dst and src must not overlap. */
int kvr_codec_encode(const kvr_codec *c, void *dst, const void *src,
                     kvr_dtype src_type, size_t n, size_t *bad);
/* Decodes a row of n values into dst (dst_type). Never fails on well-formed
 * codecs/sizes (it does not validate the bytes: any bytes decode to
 * something); KVR_EINVAL for a bad codec or dtype. Decoding to f16 clamps to
 * +-65504 so a value at the edge of f16's range never becomes infinite. */
int kvr_codec_decode(const kvr_codec *c, void *dst, kvr_dtype dst_type,
                     const void *src, size_t n);

/* kvr_codec_decode with non-temporal stores where the ISA and dst allow
 * (AVX-512, f32 or f16 output, uniform codecs with f16 parameters or ggml
 * blocks, dst on 64 bytes; otherwise ordinary stores): the same bytes, no
 * read of each destination line before its write. For output that is
 * large and not read again soon (a whole context into a caller's buffer).
 * The stores are fenced before it returns. */
int kvr_codec_decode_stream(const kvr_codec *c, void *dst, kvr_dtype dst_type,
                            const void *src, size_t n);

/* Stored parameters of group g of an encoded uniform row (tests, tools). */
int kvr_codec_group_params(const kvr_codec *c, const void *src, size_t n, size_t g,
                           float *scale, float *min);

/* ---- KIVI key tiles ----------------------------------------------------- */

/* src is [G tokens][ld elements] (G = group(c)), of which the first n_ch
 * channels are encoded, channel by channel, into tile_bytes(c, n_ch) bytes.
 * *bad is the token-major element index t*n_ch + ch of the first offending
 * value. Uniform codecs only (else KVR_EUNSUPPORTED). */
int kvr_codec_encode_tile(const kvr_codec *c, void *dst, const void *src,
                          kvr_dtype src_type, size_t n_ch, size_t ld, size_t *bad);
/* The inverse: writes G rows of n_ch values at stride ld elements. */
int kvr_codec_decode_tile(const kvr_codec *c, void *dst, kvr_dtype dst_type,
                          size_t ld, const void *src, size_t n_ch);

/* Window bookkeeping for a context of n_tokens tokens (token indices
 * 0..n-1). Keys [0, *k_quant) are in finished tiles, the rest in full
 * precision: for a per-channel K codec *k_quant is the largest multiple of G
 * with n - k_quant >= window (so between window and window+G-1 keys stay
 * full precision); per token it is max(0, n - window). Values [0, *v_quant),
 * v_quant = max(0, n - window). Plain (f32/f16/bf16) sides report n. After an
 * append from n0 to n1 tokens, the store encodes keys [k(n0), k(n1)) as tiles
 * and values [v(n0), v(n1)) as rows. */
void kvr_kivi_split(const kvr_codec_pair *p, size_t n_tokens,
                    size_t *k_quant, size_t *v_quant);

/* ---- error measure ------------------------------------------------------ */

/* sqrt(sum (dec - ref)^2 / sum ref^2) over n values (double accumulation);
 * 0 for n = 0 or an exact match, +inf if ref is all zeros but dec is not. */
double kvr_codec_rel_rms(const float *ref, const void *dec, kvr_dtype dec_type, size_t n);

/* The store's error measure of n_rows rows of len values each (row i at
 * ref + i*len, dec + i*len): e[i] ~ sum over k of (dec - ref)^2 and q[i] ~
 * sum of ref^2, computed in a fixed order that every ISA follows, so every
 * ISA returns the same doubles. A row's elements go to KVR_ERR_LANES = 64
 * lanes (element k to lane k mod 64); each lane adds, in element order and
 * in float, t*t (t = dec - ref, the product and each sum rounded on their
 * own: no fused multiply-add) and ref*ref, from 0 for every block of
 * KVR_ERR_BLOCK = 1024 elements, at whose end each lane's two floats are
 * added to its two doubles; the row's e and q are its 64 doubles added in
 * a fixed tree (lane l + w onto lane l, w = 32, 16, .., 1:
 * kvr_codec_err_finish). Floats keep every term's relative
 * error near 1e-7 and the sums' near 1e-6. A row whose float sums overflow
 * (values past about 1e18) or whose q is under 2^-60 (values under about
 * 1e-20, whose squares underflow in float) is measured again in double
 * (kvr_codec_err_row_wide: one chain in element order, each product and
 * sum rounded on its own; q's exact squares may be added with an FMA). */
void kvr_codec_err_rows(kvr_isa isa, const float *ref, const float *dec, size_t n_rows,
                        size_t len, double *e, double *q);
/* The same with the reference rows in f16 (each value converted exactly, as
 * kvr_f16_to_f32): the doubles kvr_codec_err_rows returns for their f32
 * conversion (a quantized put measures f16 payload rows straight from it). */
void kvr_codec_err_rows_f16(kvr_isa isa, const uint16_t *ref, const float *dec, size_t n_rows,
                            size_t len, double *e, double *q);

/* Encodes n_rows rows of len values each (src_type f32 or f16), back to
 * back at dst, exactly as kvr_codec_encode encodes their n_rows * len
 * values, and measures each row as it is quantized: e[i], q[i] are the
 * doubles kvr_codec_err_rows returns for row i decoded to f32 against its
 * values at src (one pass; nothing is decoded). scratch holds len floats
 * (a row measured wide is decoded into it). Returns 0; the error
 * kvr_codec_encode returns (and its *bad) for a value the codec refuses; or
 * 1 where no kernel does it (another ISA; a
 * uniform codec with f32 parameters or a group that is not 32, 64, 128 or
 * 256 or does not divide len; a ggml codec whose rows are not whole
 * blocks; any other codec; bf16 input) or the arguments are not valid (an
 * invalid codec, NULL pointers, no rows): the caller encodes, decodes and
 * measures, and kvr_codec_encode reports what is wrong. */
int kvr_codec_encode_measured(const kvr_codec *c, void *dst, const void *src,
                              kvr_dtype src_type, size_t n_rows, size_t len, float *scratch,
                              double *e, double *q, size_t *bad);

/* ---- internal: kernels and dispatch (codec*.c only) --------------------- */

/* Parameters of one uniform group, as stored (see the rule above). */
typedef struct kvr_codec_gparams {
    float s, m, inv;
    uint32_t s_bits, m_bits;   /* the stored encodings (f16 in the low half) */
} kvr_codec_gparams;
void kvr_codec_gparams_compute(kvr_codec_gparams *gp, float lo, float hi,
                               unsigned bits, kvr_codec_params params);
/* The coverage check that defines s: m + (2^bits - 1)*s >= hi, in double. */
int kvr_codec_scale_covers(float m, float s, float hi, unsigned bits);

/* A uniform row kernel set. Encoders assume validated input (finite, within
 * the params' range) and return 0; an encoder may return -1 if it finds a bad
 * value, and the caller then locates it with the scalar check. */
typedef struct kvr_codec_kernels {
    int  (*enc_f32)(uint8_t *dst, const float *src, size_t n, unsigned bits,
                    uint32_t group, kvr_codec_params params);
    int  (*enc_f16)(uint8_t *dst, const uint16_t *src, size_t n, unsigned bits,
                    uint32_t group, kvr_codec_params params);
    void (*dec_f32)(float *dst, const uint8_t *src, size_t n, unsigned bits,
                    uint32_t group, kvr_codec_params params);
    void (*dec_f16)(uint16_t *dst, const uint8_t *src, size_t n, unsigned bits,
                    uint32_t group, kvr_codec_params params);
    /* Optional: dec_f32 (dt f32) / dec_f16 (dt f16) with non-temporal
     * stores, fenced before it returns; false, nothing written, where it
     * does not apply (dst not on 64 bytes, these params or dtype). */
    bool (*dec_nt)(void *dst, kvr_dtype dt, const uint8_t *src, size_t n, unsigned bits,
                   uint32_t group, kvr_codec_params params);
    /* KIVI tiles: buf[j*G + t] = src[t*ld + j] for j < cc <= 8 (converted to
     * f32), and the inverse (f16 output clamped to +-65504, like decode). */
    void (*tile_gather)(float *buf, const void *src, kvr_dtype t, size_t G,
                        size_t ld, size_t cc);
    void (*tile_scatter)(void *dst, kvr_dtype t, size_t ld, const float *buf,
                         size_t G, size_t cc);
    /* Optional whole-tile kernels (NULL: gather/scatter + rows). A tile of G
     * tokens x n_ch channels at stride ld, as kvr_codec_encode_tile /
     * decode_tile. Return 0 done, 1 not handled (this dtype/params: use the
     * generic path), -1 (encode) a bad value somewhere in the tile. */
    int  (*tile_enc)(uint8_t *dst, const void *src, kvr_dtype t, size_t n_ch, size_t ld,
                     size_t G, unsigned bits, kvr_codec_params params);
    int  (*tile_dec)(void *dst, kvr_dtype t, size_t ld, const uint8_t *src, size_t n_ch,
                     size_t G, unsigned bits, kvr_codec_params params);
    /* Optional ggml block kernels (NULL: the scalar reference), f32 or f16
     * in / out, n a multiple of 32; the encoder returns 0, or -1 when it
     * meets a bad value (the caller reruns the scalar path to name it). */
    int  (*ggml_enc)(kvr_codec_type t, uint8_t *dst, const void *src, kvr_dtype st, size_t n);
    void (*ggml_dec)(kvr_codec_type t, void *dst, kvr_dtype dt, const uint8_t *src, size_t n);
    /* Optional: ggml_dec with non-temporal stores, as dec_nt. */
    bool (*ggml_dec_nt)(kvr_codec_type t, void *dst, kvr_dtype dt, const uint8_t *src,
                        size_t n);
    /* Optional: kvr_codec_encode_measured for a ggml codec, n_rows rows of
     * len values (a multiple of 32) back to back, f32 or f16 input: 0, -1
     * at a bad value, 1 for a type it does not know; wide[i] as
     * enc_err_rows. */
    int  (*ggml_enc_err)(kvr_codec_type t, uint8_t *dst, const void *src, kvr_dtype st,
                         size_t n_rows, size_t len, double *e, double *q, bool *wide);
    /* kvr_codec_err_rows (required). */
    void (*err_rows)(const float *ref, const float *dec, size_t n_rows, size_t len,
                     double *e, double *q);
    /* kvr_codec_err_rows_f16 (optional; NULL: the scalar reference). */
    void (*err_rows_h)(const uint16_t *ref, const float *dec, size_t n_rows, size_t len,
                       double *e, double *q);
    /* kvr_codec_encode_measured (optional), f16 parameters, G in 32..256
     * dividing len, h: f16 input: 0, or -1 at a bad value (dst then holds
     * anything). wide[i] is set for a row kvr_codec_err_finish refused (its
     * e[i], q[i] are then to be measured wide by the caller). */
    int  (*enc_err_rows)(uint8_t *dst, const void *src, int h, size_t n_rows, size_t len,
                         unsigned bits, uint32_t G, double *e, double *q, bool *wide);
} kvr_codec_kernels;

/* The scalar encoder of one ggml block of 32 checked values (0, or -1 when d
 * or m overflows f16); the SIMD kernels use it for blocks they leave. */
int kvr_codec_ggml_block_enc(kvr_codec_type t, uint8_t *dst, const float *x);
int  kvr_codec_ggml_enc_avx2(kvr_codec_type t, uint8_t *dst, const void *src, kvr_dtype st,
                             size_t n);
void kvr_codec_ggml_dec_avx2(kvr_codec_type t, void *dst, kvr_dtype dt, const uint8_t *src,
                             size_t n);
int  kvr_codec_ggml_enc_avx512(kvr_codec_type t, uint8_t *dst, const void *src, kvr_dtype st,
                               size_t n);
void kvr_codec_ggml_dec_avx512(kvr_codec_type t, void *dst, kvr_dtype dt, const uint8_t *src,
                               size_t n);
int  kvr_codec_ggml_enc_err_avx512(kvr_codec_type t, uint8_t *dst, const void *src,
                                   kvr_dtype st, size_t n_rows, size_t len, double *e,
                                   double *q, bool *wide);
bool kvr_codec_ggml_dec_nt_avx512(kvr_codec_type t, void *dst, kvr_dtype dt,
                                  const uint8_t *src, size_t n);

/* The scalar encoder of one group of m <= 256 checked values; returns the
 * bytes written. The SIMD kernels use it for a row's short last group. */
size_t kvr_codec_scalar_group(uint8_t *dst, const float *x, size_t m, unsigned bits,
                              kvr_codec_params params);

/* The error measure's fixed order (kvr_codec_err_rows above). */
#define KVR_ERR_LANES 64
#define KVR_ERR_BLOCK 1024
/* Whether a row's sums e, q from the lanes stand (finite, q >= 2^-60);
 * else the row is measured wide. */
static inline bool kvr_codec_err_ok(double e, double q)
{
    return e - e == 0.0 && q - q == 0.0 && q >= 0x1p-60;   /* finite */
}

/* A row's e and q from its lanes' doubles E[64], Q[64] (added in the
 * fixed tree); false when the row must be measured wide instead. */
static inline bool kvr_codec_err_finish(const double *E, const double *Q, double *e, double *q)
{
    /* lane l + w added onto lane l, w = 32, 16, .., 1 */
    double se[KVR_ERR_LANES / 2], sq[KVR_ERR_LANES / 2];
    for (size_t l = 0; l < KVR_ERR_LANES / 2; l++) {
        se[l] = E[l] + E[l + KVR_ERR_LANES / 2];
        sq[l] = Q[l] + Q[l + KVR_ERR_LANES / 2];
    }
    for (size_t w = KVR_ERR_LANES / 4; w >= 1; w /= 2)
        for (size_t l = 0; l < w; l++) {
            se[l] += se[l + w];
            sq[l] += sq[l + w];
        }
    *e = se[0];
    *q = sq[0];
    return kvr_codec_err_ok(se[0], sq[0]);
}
/* One row measured in double (the wide measure; h: ref is f16). */
void kvr_codec_err_row_wide(const void *ref, int h, const float *dec, size_t len, double *e,
                            double *q);

extern const kvr_codec_kernels kvr_codec_kernels_scalar;
extern const kvr_codec_kernels kvr_codec_kernels_avx2;    /* codec_avx2.c */
extern const kvr_codec_kernels kvr_codec_kernels_avx512;  /* codec_avx512.c */

#ifdef __cplusplus
}
#endif
#endif /* KVR_CACHE_CODEC_H */
