/*
 * codec.c — descriptors, sizes, dispatch, and the scalar reference of every
 * codec (codec.h documents the rules and byte layouts).
 *
 * Invariants: the scalar kernels here ARE the definition of the uniform
 * codecs; the SIMD kernels (codec_avx2.c) must produce the same bytes and
 * the same decoded values, and fall back to the scalar group encoder for the
 * short last group of a row. The ggml block codecs' scalar reference is
 * base/ggml_quants.c (ggml's quantize_row_*_ref / dequantize_row_* operation
 * for operation, shared with the llama.cpp bridge); this file adds the
 * checks (non-finite input, an f16 scale that overflows) and the SIMD
 * dispatch.
 */
#include "cache/codec.h"
#include "cache/codec_inl.h"
#include "base/le.h"
#include "cache/cache.h"
#include "base/ggml_quants.h"

#include <errno.h>
#include <math.h>
#include <string.h>
#include <stdlib.h>
#include <float.h>

/* ---- small helpers ------------------------------------------------------ */

static uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

static float load_elem(const void *src, kvr_dtype t, size_t i)
{
    switch (t) {
    case KVR_DTYPE_F16:  return kvr_f16_to_f32(((const uint16_t *)src)[i]);
    case KVR_DTYPE_BF16: return kvr_bf16_to_f32(((const uint16_t *)src)[i]);
    default:             return ((const float *)src)[i];
    }
}

static float clamp_f16(float y)
{
    if (y > KVR_CODEC_F16_LIMIT) return KVR_CODEC_F16_LIMIT;
    if (y < -KVR_CODEC_F16_LIMIT) return -KVR_CODEC_F16_LIMIT;
    return y;
}

static void store_elem(void *dst, kvr_dtype t, size_t i, float y)
{
    switch (t) {
    case KVR_DTYPE_F16:  ((uint16_t *)dst)[i] = kvr_f32_to_f16(clamp_f16(y)); break;
    case KVR_DTYPE_BF16: ((uint16_t *)dst)[i] = kvr_f32_to_bf16(y); break;
    default:             ((float *)dst)[i] = y; break;
    }
}

static bool dtype_ok(kvr_dtype t)
{
    return t == KVR_DTYPE_F32 || t == KVR_DTYPE_F16 || t == KVR_DTYPE_BF16;
}

/* ---- descriptors -------------------------------------------------------- */

static const char *const type_names[KVR_CODEC_TYPE_COUNT_] = {
    "f32", "f16", "bf16", "int8", "int4", "int2", "q8_0", "q4_0", "q4_1", "q5_0",
};

const char *kvr_codec_type_name(kvr_codec_type t)
{
    return ((unsigned)t < KVR_CODEC_TYPE_COUNT_) ? type_names[t] : "?";
}

bool kvr_codec_is_uniform(kvr_codec_type t)
{
    return t == KVR_CODEC_INT8 || t == KVR_CODEC_INT4 || t == KVR_CODEC_INT2;
}

bool kvr_codec_is_ggml(kvr_codec_type t)
{
    return t == KVR_CODEC_Q8_0 || t == KVR_CODEC_Q4_0 || t == KVR_CODEC_Q4_1 || t == KVR_CODEC_Q5_0;
}

unsigned kvr_codec_value_bits(kvr_codec_type t)
{
    static const unsigned b[KVR_CODEC_TYPE_COUNT_] = { 32, 16, 16, 8, 4, 2, 8, 4, 4, 5 };
    return ((unsigned)t < KVR_CODEC_TYPE_COUNT_) ? b[t] : 0;
}

uint32_t kvr_codec_group(const kvr_codec *c)
{
    if (kvr_codec_is_uniform(c->type)) return c->group ? c->group : KVR_CODEC_GROUP_DEFAULT;
    if (kvr_codec_is_ggml(c->type)) return 32;
    return 1;
}

int kvr_codec_validate(const kvr_codec *c)
{
    if (!c || (unsigned)c->type >= KVR_CODEC_TYPE_COUNT_) return KVR_EINVAL;
    if ((unsigned)c->axis > KVR_CODEC_AXIS_CHANNEL) return KVR_EINVAL;
    if ((unsigned)c->params > KVR_CODEC_PARAMS_F32) return KVR_EINVAL;
    if ((unsigned)c->isa > KVR_ISA_AVX512) return KVR_EINVAL;
    if (kvr_codec_is_uniform(c->type)) {
        uint32_t g = kvr_codec_group(c);
        if (g % 32 != 0 || g > KVR_CODEC_GROUP_MAX) return KVR_EINVAL;
    } else if (c->axis == KVR_CODEC_AXIS_CHANNEL) {
        return KVR_EUNSUPPORTED;
    }
    return 0;
}

int kvr_codec_parse(const char *s, kvr_codec *out)
{
    if (!s || !out) return KVR_EINVAL;
    memset(out, 0, sizeof *out);
    const char *slash = strchr(s, '/');
    size_t len = slash ? (size_t)(slash - s) : strlen(s);
    for (unsigned t = 0; t < KVR_CODEC_TYPE_COUNT_; t++) {
        if (strlen(type_names[t]) == len && memcmp(type_names[t], s, len) == 0) {
            out->type = (kvr_codec_type)t;
            if (slash) {
                if (slash[1] != 'g' || slash[2] < '0' || slash[2] > '9') return KVR_EINVAL;
                char *end;
                unsigned long g = strtoul(slash + 2, &end, 10);
                if (*end || g == 0 || g > KVR_CODEC_GROUP_MAX || !kvr_codec_is_uniform(out->type))
                    return KVR_EINVAL;
                out->group = (uint32_t)g;
            }
            return kvr_codec_validate(out);
        }
    }
    return KVR_EINVAL;
}

kvr_codec_pair kvr_codec_pair_default(void)
{
    kvr_codec_pair p = {
        .k = { .type = KVR_CODEC_INT4, .group = KVR_CODEC_K4V2_KTILE,
               .axis = KVR_CODEC_AXIS_CHANNEL },
        .v = { .type = KVR_CODEC_INT2, .group = KVR_CODEC_K4V2_VGROUP,
               .axis = KVR_CODEC_AXIS_TOKEN },
        .window = KVR_CODEC_K4V2_WINDOW,
    };
    return p;
}

int kvr_codec_pair_validate(const kvr_codec_pair *p)
{
    if (!p) return KVR_EINVAL;
    int rc = kvr_codec_validate(&p->k);
    if (rc == 0) rc = kvr_codec_validate(&p->v);
    return rc;
}

/* ggml's type for a block codec (base/ggml_quants.h holds the quantizers). */
static kvr_ggml_qtype qtype(kvr_codec_type t)
{
    switch (t) {
    case KVR_CODEC_Q8_0: return KVR_GGML_Q8_0;
    case KVR_CODEC_Q4_0: return KVR_GGML_Q4_0;
    case KVR_CODEC_Q4_1: return KVR_GGML_Q4_1;
    case KVR_CODEC_Q5_0: return KVR_GGML_Q5_0;
    default:             return (kvr_ggml_qtype)0;
    }
}

/* ---- sizes -------------------------------------------------------------- */

static size_t param_bytes(const kvr_codec *c) { return c->params == KVR_CODEC_PARAMS_F32 ? 8 : 4; }

/* Size without validation of c (callers validated). */
static size_t row_bytes(const kvr_codec *c, size_t n)
{
    if (kvr_codec_is_uniform(c->type)) {
        size_t g = kvr_codec_group(c);
        return (n + g - 1) / g * param_bytes(c) + (n + 31) / 32 * 4 * kvr_codec_value_bits(c->type);
    }
    if (kvr_codec_is_ggml(c->type)) {
        if (n % 32) return 0;
        return n / 32 * kvr_ggml_block_bytes(qtype(c->type));
    }
    return n * (kvr_codec_value_bits(c->type) / 8);
}

size_t kvr_codec_row_bytes(const kvr_codec *c, size_t n)
{
    if (kvr_codec_validate(c) != 0) return 0;
    /* Overflow guard: rows beyond 2^56 values are no request we serve. */
    if (n > ((size_t)1 << 56)) return 0;
    return row_bytes(c, n);
}

size_t kvr_codec_tile_bytes(const kvr_codec *c, size_t n_ch)
{
    if (kvr_codec_validate(c) != 0 || !kvr_codec_is_uniform(c->type)) return 0;
    if (n_ch > ((size_t)1 << 40)) return 0;
    return n_ch * row_bytes(c, kvr_codec_group(c));
}

double kvr_codec_bits_per_value(const kvr_codec *c, size_t n)
{
    if (kvr_codec_validate(c) != 0) return 0.0;
    if (n == 0) {
        if (kvr_codec_is_uniform(c->type))
            return kvr_codec_value_bits(c->type) + 8.0 * (double)param_bytes(c) / kvr_codec_group(c);
        if (kvr_codec_is_ggml(c->type)) return 8.0 * (double)kvr_ggml_block_bytes(qtype(c->type)) / 32.0;
        return kvr_codec_value_bits(c->type);
    }
    size_t b = kvr_codec_row_bytes(c, n);
    return 8.0 * (double)b / (double)n;
}

double kvr_codec_pair_bytes_per_token(const kvr_codec_pair *p, uint32_t n_layers,
                                      uint32_t n_kv_heads, uint32_t head_dim)
{
    if (kvr_codec_pair_validate(p) != 0) return 0.0;
    double per_layer = (double)n_kv_heads * head_dim;
    double k = kvr_codec_bits_per_value(&p->k, 0), v = kvr_codec_bits_per_value(&p->v, 0);
    return (double)n_layers * per_layer * (k + v) / 8.0;
}

void kvr_kivi_split(const kvr_codec_pair *p, size_t n, size_t *k_quant, size_t *v_quant)
{
    size_t w = p->window;
    size_t aged = n > w ? n - w : 0;
    size_t k = n, v = n;
    if (kvr_codec_is_uniform(p->k.type) || kvr_codec_is_ggml(p->k.type)) {
        if (p->k.axis == KVR_CODEC_AXIS_CHANNEL && kvr_codec_is_uniform(p->k.type)) {
            size_t g = kvr_codec_group(&p->k);
            k = aged / g * g;
        } else {
            k = aged;
        }
    }
    if (kvr_codec_is_uniform(p->v.type) || kvr_codec_is_ggml(p->v.type)) v = aged;
    if (k_quant) *k_quant = k;
    if (v_quant) *v_quant = v;
}

/* ---- uniform groups: parameters ----------------------------------------- */

/* The stored parameters are defined as unique values (the largest f16 <= lo,
 * the smallest s passing the coverage check), so any first guess converges to
 * the same bits: the AVX2 kernels guess differently (F16C) and still agree. */
int kvr_codec_scale_covers(float m, float s, float hi, unsigned bits)
{
    return (double)m + (double)((1u << bits) - 1) * (double)s >= (double)hi;
}

void kvr_codec_gparams_compute(kvr_codec_gparams *gp, float lo, float hi,
                               unsigned bits, kvr_codec_params params)
{
    const double L = (double)((1u << bits) - 1);
    /* -0 and +0 compare equal, and min/max kernels may pick either: make the
     * stored bytes independent of which one was seen. */
    lo = lo + 0.0f;
    hi = hi + 0.0f;
    if (params == KVR_CODEC_PARAMS_F32) {
        float m = lo, s = 0.0f;
        if (hi > m) {
            const float smin = 0x1p-100f;   /* keeps 1/s finite */
            s = (float)(((double)hi - (double)m) / L);
            if (s < smin) s = smin;
            while (!kvr_codec_scale_covers(m, s, hi, bits)) s = nextafterf(s, INFINITY);
            while (s > smin && kvr_codec_scale_covers(m, nextafterf(s, 0.0f), hi, bits))
                s = nextafterf(s, 0.0f);
        }
        gp->m = m; gp->s = s;
        gp->m_bits = f32_bits(m); gp->s_bits = f32_bits(s);
    } else {
        uint16_t mh = kvr_f32_to_f16(lo);
        if (kvr_f16_to_f32(mh) > lo) mh = f16_down(mh);
        float m = kvr_f16_to_f32(mh);
        uint16_t sh = 0;
        if (hi > m) {
            sh = kvr_f32_to_f16((float)(((double)hi - (double)m) / L));
            if (sh == 0) sh = 1;
            while (!kvr_codec_scale_covers(m, kvr_f16_to_f32(sh), hi, bits)) sh = f16_up(sh);
            while (sh > 1 && kvr_codec_scale_covers(m, kvr_f16_to_f32((uint16_t)(sh - 1)), hi, bits))
                sh--;
        }
        gp->m = m; gp->s = kvr_f16_to_f32(sh);
        gp->m_bits = mh; gp->s_bits = sh;
    }
    gp->inv = gp->s > 0.0f ? 1.0f / gp->s : 0.0f;
}

static float params_limit(kvr_codec_params p)
{
    return p == KVR_CODEC_PARAMS_F32 ? KVR_CODEC_F32_LIMIT : KVR_CODEC_F16_LIMIT;
}

/* ---- uniform groups: scalar kernels ------------------------------------- */

static void pack_chunk(uint8_t *qs, const uint8_t *q, unsigned bits)
{
    switch (bits) {
    case 8: memcpy(qs, q, 32); break;
    case 4:
        for (int j = 0; j < 16; j++) qs[j] = (uint8_t)(q[j] | q[j + 16] << 4);
        break;
    default:
        for (int j = 0; j < 8; j++)
            qs[j] = (uint8_t)(q[j] | q[j + 8] << 2 | q[j + 16] << 4 | q[j + 24] << 6);
        break;
    }
}

static void unpack_chunk(uint8_t *q, const uint8_t *qs, unsigned bits)
{
    switch (bits) {
    case 8: memcpy(q, qs, 32); break;
    case 4:
        for (int j = 0; j < 16; j++) { q[j] = qs[j] & 15; q[j + 16] = qs[j] >> 4; }
        break;
    default:
        for (int j = 0; j < 8; j++) {
            q[j] = qs[j] & 3; q[j + 8] = (qs[j] >> 2) & 3;
            q[j + 16] = (qs[j] >> 4) & 3; q[j + 24] = qs[j] >> 6;
        }
        break;
    }
}

static void write_params(uint8_t *dst, const kvr_codec_gparams *gp, kvr_codec_params params)
{
    if (params == KVR_CODEC_PARAMS_F32) {
        kvr_le32_put(dst, gp->s_bits); kvr_le32_put(dst + 4, gp->m_bits);
    } else {
        kvr_le16_put(dst, (uint16_t)gp->s_bits); kvr_le16_put(dst + 2, (uint16_t)gp->m_bits);
    }
}

static void read_params(const uint8_t *src, float *s, float *m, kvr_codec_params params)
{
    if (params == KVR_CODEC_PARAMS_F32) {
        *s = bits_f32(kvr_le32_get(src)); *m = bits_f32(kvr_le32_get(src + 4));
    } else {
        *s = kvr_f16_to_f32(kvr_le16_get(src)); *m = kvr_f16_to_f32(kvr_le16_get(src + 2));
    }
}

/* Encodes one group of m <= 256 values (already checked) at dst; returns
 * the bytes written. Shared with the SIMD kernels for short groups. */
size_t kvr_codec_scalar_group(uint8_t *dst, const float *x, size_t m, unsigned bits,
                              kvr_codec_params params)
{
    float lo = x[0], hi = x[0];
    for (size_t i = 1; i < m; i++) {
        if (x[i] < lo) lo = x[i];
        if (x[i] > hi) hi = x[i];
    }
    kvr_codec_gparams gp;
    kvr_codec_gparams_compute(&gp, lo, hi, bits, params);
    size_t pb = params == KVR_CODEC_PARAMS_F32 ? 8 : 4;
    write_params(dst, &gp, params);
    const int L = (1 << bits) - 1;
    uint8_t q[KVR_CODEC_GROUP_MAX];
    size_t mp = (m + 31) / 32 * 32;
    for (size_t i = 0; i < mp; i++) {
        int v = 0;
        if (i < m) {
            float t = (x[i] - gp.m) * gp.inv;
            v = (int)rintf(t);
            if (v < 0) v = 0;
            if (v > L) v = L;
        }
        q[i] = (uint8_t)v;
    }
    uint8_t *qs = dst + pb;
    for (size_t c = 0; c < mp / 32; c++) pack_chunk(qs + c * 4 * bits, q + 32 * c, bits);
    return pb + mp / 32 * 4 * bits;
}

static int check_f32(const float *x, size_t n, float limit)
{
    for (size_t i = 0; i < n; i++)
        if (!(fabsf(x[i]) <= limit)) return -1;
    return 0;
}

static int sc_enc_f32(uint8_t *dst, const float *src, size_t n, unsigned bits,
                      uint32_t group, kvr_codec_params params)
{
    if (check_f32(src, n, params_limit(params))) return -1;
    for (size_t i = 0; i < n; i += group) {
        size_t m = n - i < group ? n - i : group;
        dst += kvr_codec_scalar_group(dst, src + i, m, bits, params);
    }
    return 0;
}

static int sc_enc_f16(uint8_t *dst, const uint16_t *src, size_t n, unsigned bits,
                      uint32_t group, kvr_codec_params params)
{
    float buf[KVR_CODEC_GROUP_MAX];
    for (size_t i = 0; i < n; i += group) {
        size_t m = n - i < group ? n - i : group;
        for (size_t j = 0; j < m; j++) buf[j] = kvr_f16_to_f32(src[i + j]);
        if (check_f32(buf, m, params_limit(params))) return -1;
        dst += kvr_codec_scalar_group(dst, buf, m, bits, params);
    }
    return 0;
}

/* Decodes one group of m values into y (f32). Returns bytes consumed. */
static size_t sc_dec_group(float *y, const uint8_t *src, size_t m, unsigned bits,
                           kvr_codec_params params)
{
    float s, mn;
    read_params(src, &s, &mn, params);
    size_t pb = params == KVR_CODEC_PARAMS_F32 ? 8 : 4;
    const uint8_t *qs = src + pb;
    uint8_t q[32];
    size_t nc = (m + 31) / 32;
    for (size_t c = 0; c < nc; c++) {
        unpack_chunk(q, qs + c * 4 * bits, bits);
        size_t e = m - c * 32 < 32 ? m - c * 32 : 32;
        for (size_t j = 0; j < e; j++) {
            float p = (float)q[j] * s;
            y[c * 32 + j] = p + mn;
        }
    }
    return pb + nc * 4 * bits;
}

static void sc_dec_f32(float *dst, const uint8_t *src, size_t n, unsigned bits,
                       uint32_t group, kvr_codec_params params)
{
    for (size_t i = 0; i < n; i += group) {
        size_t m = n - i < group ? n - i : group;
        src += sc_dec_group(dst + i, src, m, bits, params);
    }
}

static void sc_dec_f16(uint16_t *dst, const uint8_t *src, size_t n, unsigned bits,
                       uint32_t group, kvr_codec_params params)
{
    float buf[KVR_CODEC_GROUP_MAX];
    for (size_t i = 0; i < n; i += group) {
        size_t m = n - i < group ? n - i : group;
        src += sc_dec_group(buf, src, m, bits, params);
        for (size_t j = 0; j < m; j++) dst[i + j] = kvr_f32_to_f16(clamp_f16(buf[j]));
    }
}

static void sc_tile_gather(float *buf, const void *src, kvr_dtype t, size_t G,
                           size_t ld, size_t cc)
{
    for (size_t tk = 0; tk < G; tk++)
        for (size_t j = 0; j < cc; j++) buf[j * G + tk] = load_elem(src, t, tk * ld + j);
}

static void sc_tile_scatter(void *dst, kvr_dtype t, size_t ld, const float *buf,
                            size_t G, size_t cc)
{
    for (size_t tk = 0; tk < G; tk++)
        for (size_t j = 0; j < cc; j++) store_elem(dst, t, tk * ld + j, buf[j * G + tk]);
}

/* ---- the error measure (codec.h: kvr_codec_err_rows) -------------------- */

void kvr_codec_err_row_wide(const void *ref, int h, const float *dec, size_t len, double *e,
                            double *q)
{
    const float *rf = ref;
    const uint16_t *rh = ref;
    double se = 0.0, sq = 0.0;
    for (size_t k = 0; k < len; k++) {
        double x = h ? (double)kvr_f16_to_f32(rh[k]) : (double)rf[k];
        double d = (double)dec[k] - x;
        double s = d * d, t = x * x;
        se += s;
        sq += t;
    }
    *e = se;
    *q = sq;
}

/* One row in the lanes' order, one element at a time (the reference the
 * SIMD kernels follow). */
static void sc_err_row(const void *ref, int h, const float *dec, size_t len, double *e,
                       double *q)
{
    const float *rf = ref;
    const uint16_t *rh = ref;
    double E[KVR_ERR_LANES] = { 0 }, Q[KVR_ERR_LANES] = { 0 };
    for (size_t b = 0; b < len; b += KVR_ERR_BLOCK) {
        float fe[KVR_ERR_LANES] = { 0 }, fq[KVR_ERR_LANES] = { 0 };
        size_t end = len - b < KVR_ERR_BLOCK ? len : b + KVR_ERR_BLOCK;
        for (size_t k = b; k < end; k++) {
            float r = h ? kvr_f16_to_f32(rh[k]) : rf[k];
            float t = dec[k] - r;
            float s = t * t, r2 = r * r;
            fe[k % KVR_ERR_LANES] += s;
            fq[k % KVR_ERR_LANES] += r2;
        }
        for (size_t l = 0; l < KVR_ERR_LANES; l++) {
            E[l] += (double)fe[l];
            Q[l] += (double)fq[l];
        }
    }
    if (!kvr_codec_err_finish(E, Q, e, q))
        kvr_codec_err_row_wide(ref, h, dec, len, e, q);
}

static void sc_err_rows(const float *ref, const float *dec, size_t n_rows, size_t len,
                        double *e, double *q)
{
    for (size_t i = 0; i < n_rows; i++)
        sc_err_row(ref + i * len, 0, dec + i * len, len, &e[i], &q[i]);
}

static void sc_err_rows_h(const uint16_t *ref, const float *dec, size_t n_rows, size_t len,
                          double *e, double *q)
{
    for (size_t i = 0; i < n_rows; i++)
        sc_err_row(ref + i * len, 1, dec + i * len, len, &e[i], &q[i]);
}

const kvr_codec_kernels kvr_codec_kernels_scalar = {
    .enc_f32 = sc_enc_f32, .enc_f16 = sc_enc_f16,
    .dec_f32 = sc_dec_f32, .dec_f16 = sc_dec_f16,
    .tile_gather = sc_tile_gather, .tile_scatter = sc_tile_scatter,
    .err_rows = sc_err_rows, .err_rows_h = sc_err_rows_h,
};

/* ---- dispatch ----------------------------------------------------------- */

static const kvr_codec_kernels *kernels_for(kvr_isa isa)
{
    /* One CPU probe for the project: rope/'s (AVX2 implies FMA and F16C there). */
    kvr_isa best = kvr_isa_best();
    if (isa == KVR_ISA_SCALAR || best == KVR_ISA_SCALAR)
        return &kvr_codec_kernels_scalar;
    if (isa == KVR_ISA_AVX2 || best == KVR_ISA_AVX2)
        return &kvr_codec_kernels_avx2;
    return &kvr_codec_kernels_avx512;
}

/* ---- ggml blocks (the reference is base/ggml_quants.c) -------------------- */

#define QK 32

/* Index of the first element of largest magnitude (for refusing a block
 * whose f16 d or m would overflow). */
static size_t argmax_abs(const float *x, size_t n)
{
    size_t k = 0;
    for (size_t i = 1; i < n; i++)
        if (fabsf(x[i]) > fabsf(x[k])) k = i;
    return k;
}

int kvr_codec_ggml_block_enc(kvr_codec_type t, uint8_t *dst, const float *x)
{
    return kvr_ggml_block_enc(qtype(t), dst, x);
}

/* ---- public encode / decode --------------------------------------------- */

/* First index (in element order) that is non-finite or beyond limit; n if
 * none. A branch-free pass per block of 256 (which the compiler vectorises)
 * finds the block, a scalar pass the element. */
static size_t locate_bad(const void *src, kvr_dtype t, size_t n, float limit)
{
    for (size_t i0 = 0; i0 < n; i0 += 256) {
        size_t e = n - i0 < 256 ? n - i0 : 256;
        int any = 0;
        if (t == KVR_DTYPE_F16 && limit >= KVR_CODEC_F16_LIMIT) {
            const uint16_t *h = (const uint16_t *)src + i0;
            for (size_t i = 0; i < e; i++) any |= (h[i] & 0x7C00) == 0x7C00;
        } else if (t == KVR_DTYPE_F32) {
            const float *x = (const float *)src + i0;
            for (size_t i = 0; i < e; i++) any |= !(fabsf(x[i]) <= limit);
        } else {
            any = 1;
        }
        if (!any) continue;
        for (size_t i = i0; i < i0 + e; i++)
            if (!(fabsf(load_elem(src, t, i)) <= limit)) return i;
    }
    return n;
}

static int encode_plain(const kvr_codec *c, void *dst, const void *src, kvr_dtype st,
                        size_t n, size_t *bad)
{
    kvr_dtype dt = c->type == KVR_CODEC_F32 ? KVR_DTYPE_F32
                 : c->type == KVR_CODEC_F16 ? KVR_DTYPE_F16 : KVR_DTYPE_BF16;
    /* f16 storage cannot hold more than its range; f32/bf16 only need finite. */
    float limit = dt == KVR_DTYPE_F16 ? KVR_CODEC_F16_LIMIT
                : dt == KVR_DTYPE_BF16 ? 0x1.fep127f   /* largest finite bf16 */
                : FLT_MAX;
    size_t b = locate_bad(src, st, n, limit);
    if (b < n) {
        if (bad) *bad = b;
        return KVR_EINVAL;
    }
    kvr_convert(dst, dt, src, st, n);
    return 0;
}

static int encode_ggml(const kvr_codec *c, uint8_t *dst, const void *src, kvr_dtype st,
                       size_t n, size_t *bad)
{
    if (n % QK) return KVR_EUNSUPPORTED;
    const kvr_codec_kernels *k = kernels_for(c->isa);
    /* The SIMD kernels check as they go; on a bad value the scalar path
     * below (re)writes dst and names the element. */
    if (k->ggml_enc && (st == KVR_DTYPE_F32 || st == KVR_DTYPE_F16) &&
        k->ggml_enc(c->type, dst, src, st, n) == 0)
        return 0;
    size_t b = locate_bad(src, st, n, FLT_MAX);
    if (b < n) {
        if (bad) *bad = b;
        return KVR_EINVAL;
    }
    size_t bb = kvr_ggml_block_bytes(qtype(c->type));
    float x[QK];
    for (size_t i = 0; i < n; i += QK) {
        for (size_t j = 0; j < QK; j++) x[j] = load_elem(src, st, i + j);
        if (kvr_ggml_block_enc(qtype(c->type), dst + i / QK * bb, x) != 0) {
            if (bad) *bad = i + argmax_abs(x, QK);
            return KVR_EINVAL;
        }
    }
    return 0;
}

static int encode_uniform(const kvr_codec *c, uint8_t *dst, const void *src, kvr_dtype st,
                          size_t n, size_t *bad)
{
    const kvr_codec_kernels *k = kernels_for(c->isa);
    unsigned bits = kvr_codec_value_bits(c->type);
    uint32_t g = kvr_codec_group(c);
    int rc;
    if (st == KVR_DTYPE_F32) {
        rc = k->enc_f32(dst, src, n, bits, g, c->params);
    } else if (st == KVR_DTYPE_F16) {
        rc = k->enc_f16(dst, src, n, bits, g, c->params);
    } else {
        /* bf16: widen a group at a time (exact), encode as f32. */
        float buf[KVR_CODEC_GROUP_MAX];
        size_t gb = row_bytes(c, g);
        rc = 0;
        for (size_t i = 0; i < n && rc == 0; i += g) {
            size_t m = n - i < g ? n - i : g;
            for (size_t j = 0; j < m; j++) buf[j] = kvr_bf16_to_f32(((const uint16_t *)src)[i + j]);
            rc = k->enc_f32(dst + i / g * gb, buf, m, bits, g, c->params);
        }
    }
    if (rc != 0) {
        if (bad) *bad = locate_bad(src, st, n, params_limit(c->params));
        return KVR_EINVAL;
    }
    return 0;
}

int kvr_codec_encode(const kvr_codec *c, void *dst, const void *src,
                     kvr_dtype src_type, size_t n, size_t *bad)
{
    int rc = kvr_codec_validate(c);
    if (rc) return rc;
    if (!dtype_ok(src_type)) return KVR_EINVAL;
    if (n == 0) return 0;
    if (!dst || !src) return KVR_EINVAL;
    if (kvr_codec_is_uniform(c->type)) return encode_uniform(c, dst, src, src_type, n, bad);
    if (kvr_codec_is_ggml(c->type)) return encode_ggml(c, dst, src, src_type, n, bad);
    return encode_plain(c, dst, src, src_type, n, bad);
}

int kvr_codec_decode_stream(const kvr_codec *c, void *dst, kvr_dtype dst_type,
                            const void *src, size_t n)
{
    if (kvr_codec_validate(c) == 0 && n > 0 && dst && src &&
        (dst_type == KVR_DTYPE_F32 || dst_type == KVR_DTYPE_F16)) {
        const kvr_codec_kernels *k = kernels_for(c->isa);
        if (kvr_codec_is_uniform(c->type) && k->dec_nt &&
            k->dec_nt(dst, dst_type, src, n, kvr_codec_value_bits(c->type),
                      kvr_codec_group(c), c->params))
            return 0;
        if (kvr_codec_is_ggml(c->type) && n % QK == 0 && k->ggml_dec_nt &&
            k->ggml_dec_nt(c->type, dst, dst_type, src, n))
            return 0;
    }
    return kvr_codec_decode(c, dst, dst_type, src, n);
}

int kvr_codec_decode(const kvr_codec *c, void *dst, kvr_dtype dst_type,
                     const void *src, size_t n)
{
    int rc = kvr_codec_validate(c);
    if (rc) return rc;
    if (!dtype_ok(dst_type)) return KVR_EINVAL;
    if (n == 0) return 0;
    if (!dst || !src) return KVR_EINVAL;
    if (kvr_codec_is_uniform(c->type)) {
        const kvr_codec_kernels *k = kernels_for(c->isa);
        unsigned bits = kvr_codec_value_bits(c->type);
        uint32_t g = kvr_codec_group(c);
        if (dst_type == KVR_DTYPE_F32) {
            k->dec_f32(dst, src, n, bits, g, c->params);
        } else if (dst_type == KVR_DTYPE_F16) {
            k->dec_f16(dst, src, n, bits, g, c->params);
        } else {
            float buf[KVR_CODEC_GROUP_MAX];
            size_t gb = row_bytes(c, g);
            for (size_t i = 0; i < n; i += g) {
                size_t m = n - i < g ? n - i : g;
                k->dec_f32(buf, (const uint8_t *)src + i / g * gb, m, bits, g, c->params);
                for (size_t j = 0; j < m; j++) ((uint16_t *)dst)[i + j] = kvr_f32_to_bf16(buf[j]);
            }
        }
        return 0;
    }
    if (kvr_codec_is_ggml(c->type)) {
        if (n % QK) return KVR_EUNSUPPORTED;
        const kvr_codec_kernels *k = kernels_for(c->isa);
        if (k->ggml_dec && (dst_type == KVR_DTYPE_F32 || dst_type == KVR_DTYPE_F16)) {
            k->ggml_dec(c->type, dst, dst_type, src, n);
            return 0;
        }
        size_t bb = kvr_ggml_block_bytes(qtype(c->type));
        float y[QK];
        for (size_t i = 0; i < n; i += QK) {
            kvr_ggml_block_dec(qtype(c->type), y, (const uint8_t *)src + i / QK * bb);
            if (dst_type == KVR_DTYPE_F32) memcpy((float *)dst + i, y, sizeof y);
            else for (size_t j = 0; j < QK; j++) store_elem(dst, dst_type, i + j, y[j]);
        }
        return 0;
    }
    kvr_dtype st = c->type == KVR_CODEC_F32 ? KVR_DTYPE_F32
                 : c->type == KVR_CODEC_F16 ? KVR_DTYPE_F16 : KVR_DTYPE_BF16;
    if (dst_type == KVR_DTYPE_F16 && st != KVR_DTYPE_F16) {
        float buf[256];
        for (size_t i = 0; i < n; i += 256) {
            size_t e = n - i < 256 ? n - i : 256;
            kvr_convert(buf, KVR_DTYPE_F32, (const uint8_t *)src + i * kvr_dtype_size(st), st, e);
            for (size_t j = 0; j < e; j++) buf[j] = clamp_f16(buf[j]);
            kvr_convert((uint16_t *)dst + i, KVR_DTYPE_F16, buf, KVR_DTYPE_F32, e);
        }
    } else {
        kvr_convert(dst, dst_type, src, st, n);
    }
    return 0;
}

int kvr_codec_group_params(const kvr_codec *c, const void *src, size_t n, size_t g,
                           float *scale, float *min)
{
    int rc = kvr_codec_validate(c);
    if (rc) return rc;
    if (!kvr_codec_is_uniform(c->type)) return KVR_EUNSUPPORTED;
    uint32_t G = kvr_codec_group(c);
    if (!src || g >= (n + G - 1) / G) return KVR_EINVAL;
    float s, m;
    read_params((const uint8_t *)src + g * row_bytes(c, G), &s, &m, c->params);
    if (scale) *scale = s;
    if (min) *min = m;
    return 0;
}

/* ---- KIVI tiles --------------------------------------------------------- */

#define TILE_CH 8

int kvr_codec_encode_tile(const kvr_codec *c, void *dst, const void *src,
                          kvr_dtype src_type, size_t n_ch, size_t ld, size_t *bad)
{
    int rc = kvr_codec_validate(c);
    if (rc) return rc;
    if (!kvr_codec_is_uniform(c->type)) return KVR_EUNSUPPORTED;
    if (!dtype_ok(src_type) || ld < n_ch) return KVR_EINVAL;
    if (n_ch == 0) return 0;
    if (!dst || !src) return KVR_EINVAL;
    const kvr_codec_kernels *k = kernels_for(c->isa);
    unsigned bits = kvr_codec_value_bits(c->type);
    size_t G = kvr_codec_group(c), gb = row_bytes(c, G);
    int krc = k->tile_enc ? k->tile_enc(dst, src, src_type, n_ch, ld, G, bits, c->params) : 1;
    if (krc == 0) return 0;
    if (krc > 0) {
        float buf[TILE_CH * KVR_CODEC_GROUP_MAX];
        for (size_t c0 = 0; c0 < n_ch && krc > 0; c0 += TILE_CH) {
            size_t cc = n_ch - c0 < TILE_CH ? n_ch - c0 : TILE_CH;
            k->tile_gather(buf, (const uint8_t *)src + c0 * kvr_dtype_size(src_type), src_type,
                           G, ld, cc);
            if (k->enc_f32((uint8_t *)dst + c0 * gb, buf, cc * G, bits, (uint32_t)G, c->params))
                krc = -1;
            else if (c0 + cc >= n_ch)
                krc = 0;
        }
        if (krc == 0) return 0;
    }
    float lim = params_limit(c->params);
    for (size_t t = 0; t < G; t++)
        for (size_t j = 0; j < n_ch; j++)
            if (!(fabsf(load_elem(src, src_type, t * ld + j)) <= lim)) {
                if (bad) *bad = t * n_ch + j;
                return KVR_EINVAL;
            }
    return KVR_EINVAL;
}

int kvr_codec_decode_tile(const kvr_codec *c, void *dst, kvr_dtype dst_type,
                          size_t ld, const void *src, size_t n_ch)
{
    int rc = kvr_codec_validate(c);
    if (rc) return rc;
    if (!kvr_codec_is_uniform(c->type)) return KVR_EUNSUPPORTED;
    if (!dtype_ok(dst_type) || ld < n_ch) return KVR_EINVAL;
    if (n_ch == 0) return 0;
    if (!dst || !src) return KVR_EINVAL;
    const kvr_codec_kernels *k = kernels_for(c->isa);
    unsigned bits = kvr_codec_value_bits(c->type);
    size_t G = kvr_codec_group(c), gb = row_bytes(c, G);
    if (k->tile_dec && k->tile_dec(dst, dst_type, ld, src, n_ch, G, bits, c->params) == 0)
        return 0;
    float buf[TILE_CH * KVR_CODEC_GROUP_MAX];
    for (size_t c0 = 0; c0 < n_ch; c0 += TILE_CH) {
        size_t cc = n_ch - c0 < TILE_CH ? n_ch - c0 : TILE_CH;
        k->dec_f32(buf, (const uint8_t *)src + c0 * gb, cc * G, bits, (uint32_t)G, c->params);
        k->tile_scatter((uint8_t *)dst + c0 * kvr_dtype_size(dst_type), dst_type, ld, buf, G, cc);
    }
    return 0;
}

/* ---- error measure ------------------------------------------------------ */

void kvr_codec_err_rows(kvr_isa isa, const float *ref, const float *dec, size_t n_rows,
                        size_t len, double *e, double *q)
{
    kernels_for(isa)->err_rows(ref, dec, n_rows, len, e, q);
}

void kvr_codec_err_rows_f16(kvr_isa isa, const uint16_t *ref, const float *dec, size_t n_rows,
                            size_t len, double *e, double *q)
{
    const kvr_codec_kernels *k = kernels_for(isa);
    (k->err_rows_h ? k->err_rows_h : sc_err_rows_h)(ref, dec, n_rows, len, e, q);
}

int kvr_codec_encode_measured(const kvr_codec *c, void *dst, const void *src,
                              kvr_dtype src_type, size_t n_rows, size_t len, float *scratch,
                              double *e, double *q, size_t *bad)
{
    if (kvr_codec_validate(c) != 0 || !dst || !src || n_rows == 0 ||
        (src_type != KVR_DTYPE_F32 && src_type != KVR_DTYPE_F16))
        return 1;
    const kvr_codec_kernels *k = kernels_for(c->isa);
    bool ggml = kvr_codec_is_ggml(c->type);
    uint32_t G = ggml ? QK : kvr_codec_group(c);
    if (ggml ? !k->ggml_enc_err
             : !k->enc_err_rows || !kvr_codec_is_uniform(c->type) ||
                   c->params != KVR_CODEC_PARAMS_F16 || G < 32 || G > 256 || (G & (G - 1)))
        return 1;
    if (len == 0 || len % G)
        return 1;
    unsigned bits = ggml ? 0 : kvr_codec_value_bits(c->type);
    int h = src_type == KVR_DTYPE_F16;
    size_t rb = row_bytes(c, len), es = h ? 2 : 4;
    bool wide[64];
    for (size_t i0 = 0; i0 < n_rows; i0 += 64) {
        size_t m = n_rows - i0 < 64 ? n_rows - i0 : 64;
        uint8_t *d = (uint8_t *)dst + i0 * rb;
        const char *s = (const char *)src + i0 * len * es;
        int kr = ggml ? k->ggml_enc_err(c->type, d, s, src_type, m, len, e + i0, q + i0, wide)
                      : k->enc_err_rows(d, s, h, m, len, bits, G, e + i0, q + i0, wide);
        if (kr > 0)
            return 1;   /* not handled after all: the caller encodes it all again */
        if (kr < 0) {
            /* A bad value: kvr_codec_encode names it (rows before i0 are
             * done). Its kernels refuse the same values; were it to take
             * them, the rows are encoded and the caller measures them (1). */
            int rc = kvr_codec_encode(c, d, s, src_type, (n_rows - i0) * len, bad);
            if (rc != 0 && bad)
                *bad += i0 * len;
            return rc != 0 ? rc : 1;
        }
        for (size_t i = 0; i < m; i++) {
            if (!wide[i])
                continue;
            kvr_codec_decode(c, scratch, KVR_DTYPE_F32, d + i * rb, len);
            kvr_codec_err_row_wide(s + i * len * es, h, scratch, len, &e[i0 + i], &q[i0 + i]);
        }
    }
    return 0;
}

double kvr_codec_rel_rms(const float *ref, const void *dec, kvr_dtype dec_type, size_t n)
{
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < n; i++) {
        double r = (double)ref[i], d = (double)load_elem(dec, dec_type, i) - r;
        num += d * d;
        den += r * r;
    }
    if (num == 0.0) return 0.0;
    if (den == 0.0) return (double)INFINITY;
    return sqrt(num / den);
}
