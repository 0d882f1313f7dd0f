/*
 * bridge_gguf.c — model profiles from GGUF files (v2/v3, ggml's docs/gguf.md):
 * the header, the metadata key/values and the tensor table are parsed with
 * bounds checks on every length (nothing is allocated for a declared size
 * before the bytes are known to be there), then the hyperparameters llama.cpp
 * v0.5.0 reads for the architecture become a kvr_llama_model and a kvrope
 * RoPE configuration.
 *
 * Invariants: a file is only ever mapped read-only; the parser never reads
 * past len; every refusal names the key, tensor or offset at fault.
 */
#include "client/llama/bridge_int.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define GGUF_MAGIC 0x46554747u   /* "GGUF" */

enum { T_U8, T_I8, T_U16, T_I16, T_U32, T_I32, T_F32, T_BOOL, T_STR, T_ARR, T_U64, T_I64, T_F64,
       T_COUNT };

static const uint8_t TSIZE[T_COUNT] = { 1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8 };

typedef struct kv {
    const char    *key;
    uint64_t       klen;
    uint32_t       type;
    const uint8_t *val;      /* scalar value, string (u64 len + bytes) or array header */
    uint32_t       atype;    /* arrays: element type */
    uint64_t       an;       /* arrays: count */
} kv;

typedef struct gguf {
    const uint8_t *p;
    size_t         len, off;
    uint32_t       version;
    uint64_t       n_tensors, n_kv;
    kv            *kvs;
    size_t         meta_end;        /* end of the tensor table */
    size_t         data_off;        /* start of the data section */
    bool           has_tok_embd, has_attn_k0, has_blk0;
} gguf;

static bool have(const gguf *g, uint64_t n) { return n <= g->len - g->off; }

static int rd_str(gguf *g, const char **s, uint64_t *n, const char *what, char *err, size_t errlen)
{
    if (!have(g, 8))
        return kvr__br_fail(err, errlen, KVR_EINVAL, "GGUF truncated at offset %zu (%s)", g->off, what);
    uint64_t l = kvr__br_rd64(g->p + g->off);
    g->off += 8;
    if (!have(g, l))
        return kvr__br_fail(err, errlen, KVR_EINVAL,
                           "GGUF %s at offset %zu declares %llu bytes, %zu are left", what,
                           g->off - 8, (unsigned long long)l, g->len - g->off);
    *s = (const char *)g->p + g->off;
    *n = l;
    g->off += l;
    return 0;
}

static int skip_value(gguf *g, uint32_t type, const char *key, char *err, size_t errlen)
{
    if (type >= T_COUNT)
        return kvr__br_fail(err, errlen, KVR_EINVAL, "GGUF key '%s': unknown value type %u", key, type);
    if (type == T_STR) {
        const char *s;
        uint64_t n;
        return rd_str(g, &s, &n, key, err, errlen);
    }
    if (type == T_ARR) {
        if (!have(g, 12))
            return kvr__br_fail(err, errlen, KVR_EINVAL, "GGUF key '%s': truncated array header", key);
        uint32_t at = kvr__br_rd32(g->p + g->off);
        uint64_t an = kvr__br_rd64(g->p + g->off + 4);
        g->off += 12;
        if (at >= T_COUNT || at == T_ARR)
            return kvr__br_fail(err, errlen, KVR_EINVAL,
                               "GGUF key '%s': array of unsupported type %u", key, at);
        if (at == T_STR) {
            if (an > (g->len - g->off) / 8)
                return kvr__br_fail(err, errlen, KVR_EINVAL,
                                   "GGUF key '%s': %llu strings declared, %zu bytes left", key,
                                   (unsigned long long)an, g->len - g->off);
            for (uint64_t i = 0; i < an; i++) {
                const char *s;
                uint64_t n;
                int rc = rd_str(g, &s, &n, key, err, errlen);
                if (rc) return rc;
            }
            return 0;
        }
        if (an > (g->len - g->off) / TSIZE[at])
            return kvr__br_fail(err, errlen, KVR_EINVAL,
                               "GGUF key '%s': %llu elements declared, %zu bytes left", key,
                               (unsigned long long)an, g->len - g->off);
        g->off += an * TSIZE[at];
        return 0;
    }
    if (!have(g, TSIZE[type]))
        return kvr__br_fail(err, errlen, KVR_EINVAL, "GGUF key '%s': truncated value", key);
    g->off += TSIZE[type];
    return 0;
}

static const kv *find(const gguf *g, const char *key)
{
    size_t kl = strlen(key);
    for (uint64_t i = 0; i < g->n_kv; i++)
        if (g->kvs[i].klen == kl && memcmp(g->kvs[i].key, key, kl) == 0) return &g->kvs[i];
    return NULL;
}

static const kv *findf(const gguf *g, const char *arch, const char *suffix)
{
    char k[160];
    snprintf(k, sizeof k, "%s.%s", arch, suffix);
    return find(g, k);
}

static bool num_at(uint32_t t, const uint8_t *v, double *out)
{
    switch (t) {
    case T_U8:  *out = v[0]; return true;
    case T_I8:  *out = (int8_t)v[0]; return true;
    case T_U16: { uint16_t x; memcpy(&x, v, 2); *out = x; return true; }
    case T_I16: { int16_t x; memcpy(&x, v, 2); *out = x; return true; }
    case T_U32: { uint32_t x; memcpy(&x, v, 4); *out = x; return true; }
    case T_I32: { int32_t x; memcpy(&x, v, 4); *out = x; return true; }
    case T_F32: { float x; memcpy(&x, v, 4); *out = (double)x; return true; }
    case T_BOOL: *out = v[0] != 0; return true;
    case T_U64: { uint64_t x; memcpy(&x, v, 8); *out = (double)x; return true; }
    case T_I64: { int64_t x; memcpy(&x, v, 8); *out = (double)x; return true; }
    case T_F64: { double x; memcpy(&x, v, 8); *out = x; return true; }
    default: return false;
    }
}

/* A number (or a per-layer array whose entries are all equal). 1 found, 0
 * absent, negative error. */
static int get_num(const gguf *g, const kv *e, double *out, bool allow_arr, char *err, size_t errlen)
{
    if (!e) return 0;
    if (e->type == T_ARR) {
        if (!allow_arr || e->atype == T_STR || e->an == 0)
            return kvr__br_fail(err, errlen, KVR_EUNSUPPORTED, "GGUF key '%.*s' is an array",
                               (int)e->klen, e->key);
        double first = 0;
        for (uint64_t i = 0; i < e->an; i++) {
            double x;
            num_at(e->atype, e->val + 12 + i * TSIZE[e->atype], &x);
            if (i == 0) first = x;
            else if (x != first)
                return kvr__br_fail(err, errlen, KVR_EUNSUPPORTED,
                                   "GGUF key '%.*s' differs between layers (%g and %g): per-layer "
                                   "shapes are not supported", (int)e->klen, e->key, first, x);
        }
        *out = first;
        return 1;
    }
    if (!num_at(e->type, e->val, out))
        return kvr__br_fail(err, errlen, KVR_EINVAL, "GGUF key '%.*s' is not a number",
                           (int)e->klen, e->key);
    (void)g;
    return 1;
}

static int get_u32(const gguf *g, const kv *e, uint32_t *out, bool allow_arr, char *err, size_t errlen)
{
    double x;
    int rc = get_num(g, e, &x, allow_arr, err, errlen);
    if (rc <= 0) return rc;
    if (!(x >= 0 && x <= 4294967295.0) || x != floor(x))
        return kvr__br_fail(err, errlen, KVR_EINVAL, "GGUF key '%.*s' = %g is not a count",
                           (int)e->klen, e->key, x);
    *out = (uint32_t)x;
    return 1;
}

static bool get_str(const kv *e, const char **s, uint64_t *n)
{
    if (!e || e->type != T_STR) return false;
    *n = kvr__br_rd64(e->val);
    *s = (const char *)e->val + 8;
    return true;
}

static bool str_is(const kv *e, const char *want)
{
    const char *s;
    uint64_t n;
    return get_str(e, &s, &n) && n == strlen(want) && memcmp(s, want, n) == 0;
}

static int parse_file(gguf *g, char *err, size_t errlen)
{
    if (g->len < 24)
        return kvr__br_fail(err, errlen, KVR_EINVAL, "not a GGUF file: %zu bytes", g->len);
    uint32_t magic = kvr__br_rd32(g->p);
    if (magic != GGUF_MAGIC)
        return kvr__br_fail(err, errlen, KVR_EINVAL,
                           "not a GGUF file: magic 0x%08x (expected \"GGUF\")", magic);
    g->version = kvr__br_rd32(g->p + 4);
    if (g->version != 2 && g->version != 3)
        return kvr__br_fail(err, errlen, KVR_EUNSUPPORTED,
                           "GGUF version %u (2 and 3 are supported)", g->version);
    g->n_tensors = kvr__br_rd64(g->p + 8);
    g->n_kv = kvr__br_rd64(g->p + 16);
    g->off = 24;
    /* a key/value needs >= 8 + 1 + 4 + 1 bytes, a tensor >= 8 + 1 + 4 + 8 + 4 + 8 */
    if (g->n_kv > (g->len - g->off) / 14)
        return kvr__br_fail(err, errlen, KVR_EINVAL,
                           "GGUF declares %llu key/values, more than its %zu bytes can hold",
                           (unsigned long long)g->n_kv, g->len);
    if (g->n_tensors > (g->len - g->off) / 33)
        return kvr__br_fail(err, errlen, KVR_EINVAL,
                           "GGUF declares %llu tensors, more than its %zu bytes can hold",
                           (unsigned long long)g->n_tensors, g->len);
    g->kvs = calloc(g->n_kv ? g->n_kv : 1, sizeof *g->kvs);
    if (!g->kvs) return kvr__br_fail(err, errlen, KVR_ENOMEM, "out of memory");
    for (uint64_t i = 0; i < g->n_kv; i++) {
        kv *e = &g->kvs[i];
        int rc = rd_str(g, &e->key, &e->klen, "key", err, errlen);
        if (rc) return rc;
        if (!have(g, 4))
            return kvr__br_fail(err, errlen, KVR_EINVAL, "GGUF truncated at key '%.*s'",
                               (int)(e->klen > 80 ? 80 : e->klen), e->key);
        e->type = kvr__br_rd32(g->p + g->off);
        g->off += 4;
        e->val = g->p + g->off;
        if (e->type == T_ARR && have(g, 12)) {
            e->atype = kvr__br_rd32(e->val);
            e->an = kvr__br_rd64(e->val + 4);
        }
        char kname[96];
        snprintf(kname, sizeof kname, "%.*s", (int)(e->klen > 80 ? 80 : e->klen), e->key);
        if ((rc = skip_value(g, e->type, kname, err, errlen)) != 0) return rc;
    }
    uint32_t align = 32;
    const kv *al = find(g, "general.alignment");
    if (al) {
        uint32_t a;
        if (get_u32(g, al, &a, false, err, errlen) < 0 || a == 0 || (a & (a - 1)))
            return kvr__br_fail(err, errlen, KVR_EINVAL, "GGUF general.alignment is not a power of two");
        align = a;
    }
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        const char *name;
        uint64_t nl;
        int rc = rd_str(g, &name, &nl, "tensor name", err, errlen);
        if (rc) return rc;
        if (!have(g, 4)) return kvr__br_fail(err, errlen, KVR_EINVAL, "GGUF truncated in tensor %llu", (unsigned long long)i);
        uint32_t nd = kvr__br_rd32(g->p + g->off);
        g->off += 4;
        if (nd == 0 || nd > 4)
            return kvr__br_fail(err, errlen, KVR_EINVAL, "GGUF tensor '%.*s' has %u dimensions",
                               (int)(nl > 80 ? 80 : nl), name, nd);
        if (!have(g, (uint64_t)nd * 8 + 12))
            return kvr__br_fail(err, errlen, KVR_EINVAL, "GGUF truncated in tensor '%.*s'",
                               (int)(nl > 80 ? 80 : nl), name);
        g->off += (size_t)nd * 8 + 12;
#define IS(s) (nl == sizeof(s) - 1 && memcmp(name, s, nl) == 0)
        if (IS("token_embd.weight")) g->has_tok_embd = true;
        if (IS("blk.0.attn_k.weight") || IS("blk.0.attn_qkv.weight")) g->has_attn_k0 = true;
        if (nl > 6 && memcmp(name, "blk.0.", 6) == 0) g->has_blk0 = true;
#undef IS
    }
    g->meta_end = g->off;
    size_t d = (g->off + align - 1) / align * align;
    g->data_off = d <= g->len ? d : g->len;
    return 0;
}

static uint64_t fnv(uint64_t h, const uint8_t *p, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        h ^= p[i];
        h *= 0x100000001b3ull;
    }
    return h;
}

/* Architectures whose rope pairing the bridge knows (llama_model_rope_type). */
static const struct { const char *arch; int rope; } ARCHS[] = {
    { "llama", KVR_LLAMA_ROPE_NORM },   { "deci", KVR_LLAMA_ROPE_NORM },
    { "granite", KVR_LLAMA_ROPE_NORM }, { "baichuan", KVR_LLAMA_ROPE_NORM },
    { "qwen2", KVR_LLAMA_ROPE_NEOX },   { "qwen3", KVR_LLAMA_ROPE_NEOX },
    { "qwen2moe", KVR_LLAMA_ROPE_NEOX },{ "qwen3moe", KVR_LLAMA_ROPE_NEOX },
    { "phi3", KVR_LLAMA_ROPE_NEOX },    { "stablelm", KVR_LLAMA_ROPE_NEOX },
    { "gptneox", KVR_LLAMA_ROPE_NEOX }, { "starcoder2", KVR_LLAMA_ROPE_NEOX },
};

static int profile(const gguf *g, kvr_llama_model *m, char *err, size_t errlen)
{
    memset(m, 0, sizeof *m);
    const char *s;
    uint64_t n;
    const kv *ty = find(g, "general.type");
    if (ty && !str_is(ty, "model") && get_str(ty, &s, &n))
        return kvr__br_fail(err, errlen, KVR_EUNSUPPORTED,
                           "not a model: general.type is '%.*s'", (int)(n > 40 ? 40 : n), s);
    if (!get_str(find(g, "general.architecture"), &s, &n))
        return kvr__br_fail(err, errlen, KVR_EUNSUPPORTED,
                           "not a model: no general.architecture string");
    if (n == 0 || n >= sizeof m->arch || memchr(s, '\0', n))
        return kvr__br_fail(err, errlen, KVR_EUNSUPPORTED, "bad general.architecture");
    memcpy(m->arch, s, n);
    m->arch[n] = '\0';
    if (get_str(find(g, "general.name"), &s, &n)) {
        size_t k = n < KVR_ID_MAX - 20 ? n : KVR_ID_MAX - 20;
        memcpy(m->name, s, k);
        m->name[k] = '\0';
        for (size_t i = 0; i < k; i++)
            if ((unsigned char)m->name[i] < 0x20 || m->name[i] == '/') m->name[i] = '_';
    }
    const char *A = m->arch;
    int rc;
    if ((rc = get_u32(g, findf(g, A, "block_count"), &m->n_layers, false, err, errlen)) < 0) return rc;
    if (rc == 0 || m->n_layers == 0)
        return kvr__br_fail(err, errlen, KVR_EUNSUPPORTED,
                           "not a model: no %s.block_count (a vocabulary-only or adapter GGUF?)", A);
    if (!g->has_tok_embd || !g->has_attn_k0)
        return kvr__br_fail(err, errlen, KVR_EUNSUPPORTED,
                           "not a model: no tensor %s (a vocabulary-only or adapter GGUF?)",
                           g->has_tok_embd ? "blk.0.attn_k.weight" : "token_embd.weight");
    if (findf(g, A, "rope.dimension_sections") || strstr(A, "vl"))
        return kvr__br_fail(err, errlen, KVR_EUNSUPPORTED,
                           "architecture %s uses M-RoPE (extra per-cell positions): not supported", A);
    m->rope_type = -1;
    for (size_t i = 0; i < sizeof ARCHS / sizeof ARCHS[0]; i++)
        if (strcmp(ARCHS[i].arch, A) == 0) m->rope_type = ARCHS[i].rope;
    if (m->rope_type < 0)
        return kvr__br_fail(err, errlen, KVR_EUNSUPPORTED,
                           "architecture '%s' is not supported by the bridge (its RoPE pairing is "
                           "not known; llama, qwen2, qwen3, phi3, ... are)", A);
    if ((rc = get_u32(g, findf(g, A, "embedding_length"), &m->n_embd, false, err, errlen)) < 0) return rc;
    if (rc == 0 || m->n_embd == 0)
        return kvr__br_fail(err, errlen, KVR_EUNSUPPORTED, "not a model: no %s.embedding_length", A);
    if ((rc = get_u32(g, findf(g, A, "attention.head_count"), &m->n_heads, true, err, errlen)) < 0) return rc;
    if (rc == 0 || m->n_heads == 0)
        return kvr__br_fail(err, errlen, KVR_EUNSUPPORTED, "not a model: no %s.attention.head_count", A);
    m->n_kv_heads = m->n_heads;
    if ((rc = get_u32(g, findf(g, A, "attention.head_count_kv"), &m->n_kv_heads, true, err, errlen)) < 0) return rc;
    if (m->n_kv_heads == 0 || m->n_heads % m->n_kv_heads)
        return kvr__br_fail(err, errlen, KVR_EUNSUPPORTED,
                           "%s.attention.head_count_kv = %u does not divide head_count %u", A,
                           m->n_kv_heads, m->n_heads);
    m->head_dim = m->n_embd / m->n_heads;
    if ((rc = get_u32(g, findf(g, A, "attention.key_length"), &m->head_dim, false, err, errlen)) < 0) return rc;
    uint32_t hv = m->head_dim;
    if ((rc = get_u32(g, findf(g, A, "attention.value_length"), &hv, false, err, errlen)) < 0) return rc;
    if (hv != m->head_dim)
        return kvr__br_fail(err, errlen, KVR_EUNSUPPORTED,
                           "%s.attention.value_length %u differs from key_length %u: not supported",
                           A, hv, m->head_dim);
    if (m->head_dim == 0 || m->head_dim > KVR_ROPE_MAX_HEAD_DIM || m->head_dim % 2)
        return kvr__br_fail(err, errlen, KVR_EUNSUPPORTED, "head_dim %u out of range", m->head_dim);
    if ((uint64_t)m->n_kv_heads * m->head_dim > (1u << 20) || m->n_layers > 65536)
        return kvr__br_fail(err, errlen, KVR_EUNSUPPORTED,
                           "%u layers x %u KV heads x %u: a shape beyond the bridge's limits "
                           "(65536 layers, 2^20 values per cell)", m->n_layers, m->n_kv_heads,
                           m->head_dim);
    m->rotary_dim = m->head_dim;
    if ((rc = get_u32(g, findf(g, A, "rope.dimension_count"), &m->rotary_dim, false, err, errlen)) < 0) return rc;
    if (m->rotary_dim == 0 || m->rotary_dim % 2 || m->rotary_dim > m->head_dim)
        return kvr__br_fail(err, errlen, KVR_EUNSUPPORTED,
                           "%s.rope.dimension_count %u: must be even and at most head_dim %u", A,
                           m->rotary_dim, m->head_dim);
    m->n_ctx_train = 0;
    if ((rc = get_u32(g, findf(g, A, "context_length"), &m->n_ctx_train, false, err, errlen)) < 0) return rc;
    const kv *toks = find(g, "tokenizer.ggml.tokens");
    if (toks && toks->type == T_ARR) m->n_vocab = toks->an > UINT32_MAX ? UINT32_MAX : (uint32_t)toks->an;

    double x;
    m->rope_base = 10000.0;
    if ((rc = get_num(g, findf(g, A, "rope.freq_base"), &x, false, err, errlen)) < 0) return rc;
    if (rc) m->rope_base = x;
    if (!(m->rope_base > 0) || !isfinite(m->rope_base))
        return kvr__br_fail(err, errlen, KVR_EUNSUPPORTED, "%s.rope.freq_base %g", A, m->rope_base);
    /* llama.cpp: the type defaults to "linear", the factor to none (1) */
    const kv *st = findf(g, A, "rope.scaling.type");
    m->factor = 1.0;
    if ((rc = get_num(g, findf(g, A, "rope.scaling.factor"), &x, false, err, errlen)) < 0) return rc;
    if (rc == 0 && (rc = get_num(g, findf(g, A, "rope.scale_linear"), &x, false, err, errlen)) < 0) return rc;
    if (rc && x != 0) m->factor = x;
    if (!(m->factor > 0) || !isfinite(m->factor))
        return kvr__br_fail(err, errlen, KVR_EUNSUPPORTED, "%s.rope.scaling.factor %g", A, m->factor);
    m->scaling = m->factor != 1.0 ? KVR_ROPE_SCALING_LINEAR : KVR_ROPE_SCALING_DEFAULT;
    if (st) {
        if (str_is(st, "none")) { m->scaling = KVR_ROPE_SCALING_DEFAULT; m->factor = 1.0; }
        else if (str_is(st, "linear")) m->scaling = m->factor != 1.0 ? KVR_ROPE_SCALING_LINEAR : KVR_ROPE_SCALING_DEFAULT;
        else if (str_is(st, "yarn")) m->scaling = KVR_ROPE_SCALING_YARN;
        else {
            const char *ts = "?";
            uint64_t tn = 1;
            get_str(st, &ts, &tn);
            return kvr__br_fail(err, errlen, KVR_EUNSUPPORTED,
                               "%s.rope.scaling.type '%.*s' is not supported (none, linear, yarn)",
                               A, (int)(tn > 40 ? 40 : tn), ts);
        }
    }
    m->orig_ctx = m->n_ctx_train;
    if ((rc = get_u32(g, findf(g, A, "rope.scaling.original_context_length"), &m->orig_ctx, false, err, errlen)) < 0) return rc;
    m->yarn_beta_fast = 32.0;
    m->yarn_beta_slow = 1.0;
    m->yarn_ext_factor = m->scaling == KVR_ROPE_SCALING_YARN ? 1.0 : 0.0;
    m->rope_attn_factor = 1.0;
    if ((rc = get_num(g, findf(g, A, "rope.scaling.yarn_beta_fast"), &x, false, err, errlen)) < 0) return rc;
    if (rc) m->yarn_beta_fast = x;
    if ((rc = get_num(g, findf(g, A, "rope.scaling.yarn_beta_slow"), &x, false, err, errlen)) < 0) return rc;
    if (rc) m->yarn_beta_slow = x;
    if ((rc = get_num(g, findf(g, A, "rope.scaling.yarn_ext_factor"), &x, false, err, errlen)) < 0) return rc;
    if (rc && x >= 0) m->yarn_ext_factor = x;
    if ((rc = get_num(g, findf(g, A, "rope.scaling.yarn_log_multiplier"), &x, false, err, errlen)) < 0) return rc;
    if (rc) m->yarn_log_mul = x;
    if ((rc = get_num(g, findf(g, A, "rope.scaling.attn_factor"), &x, false, err, errlen)) < 0) return rc;
    if (rc && x != 0) m->rope_attn_factor = x;

    m->mscale = m->rope_attn_factor;
    if (m->scaling == KVR_ROPE_SCALING_YARN) {
        if (m->yarn_ext_factor != 1.0)
            return kvr__br_fail(err, errlen, KVR_EUNSUPPORTED,
                               "%s.rope.scaling.yarn_ext_factor %g: kvrope's YaRN (Hugging Face's) "
                               "mixes with factor 1", A, m->yarn_ext_factor);
        if (m->orig_ctx == 0)
            return kvr__br_fail(err, errlen, KVR_EUNSUPPORTED,
                               "YaRN without an original context length");
        double f = m->factor;
        double ms = f <= 1 ? 1.0 : 0.1 * log(f) + 1.0;
        if (m->yarn_log_mul != 0) {
            double msa = f <= 1 ? 1.0 : 0.1 * m->yarn_log_mul * log(f) + 1.0;
            ms = ms / msa;
        }
        m->mscale = ms * m->rope_attn_factor;
    } else if (m->rope_attn_factor != 1.0) {
        return kvr__br_fail(err, errlen, KVR_EUNSUPPORTED,
                           "%s.rope.scaling.attn_factor %g without YaRN: not supported", A,
                           m->rope_attn_factor);
    }

    kvr_rope_config *c = &m->rope;
    kvr_rope_config_init(c);
    c->num_layers = (int32_t)m->n_layers;
    c->num_heads = (int32_t)m->n_heads;
    c->num_kv_heads = (int32_t)m->n_kv_heads;
    c->head_dim = (int32_t)m->head_dim;
    c->rotary_dim = (int32_t)m->rotary_dim;
    c->max_position_embeddings = m->n_ctx_train;
    size_t al = strlen(m->arch) < sizeof c->model_type - 1 ? strlen(m->arch) : sizeof c->model_type - 1;
    memcpy(c->model_type, m->arch, al);
    c->model_type[al] = '\0';
    c->style = m->rope_type == KVR_LLAMA_ROPE_NORM ? KVR_ROPE_GPTJ : KVR_ROPE_NEOX;
    c->theta = m->rope_base;
    c->scaling = m->scaling;
    c->factor = m->factor;
    if (m->scaling == KVR_ROPE_SCALING_YARN) {
        c->original_max_position_embeddings = m->orig_ctx;
        c->beta_fast = m->yarn_beta_fast;
        c->beta_slow = m->yarn_beta_slow;
        c->attention_factor = m->mscale;
    }
    kvr_error verr;
    if (kvr_rope_config_validate(c, &verr) != 0)
        return kvr__br_fail(err, errlen, KVR_EUNSUPPORTED, "the model's RoPE is refused: %s", verr.msg);

    /* fingerprint: metadata + tensor table + samples of the data section */
    uint64_t h = 0xcbf29ce484222325ull;
    h = fnv(h, g->p, g->meta_end);
    size_t dl = g->len - g->data_off, sample = 4096;
    const uint8_t *d = g->p + g->data_off;
    if (dl <= 3 * sample) h = fnv(h, d, dl);
    else {
        h = fnv(h, d, sample);
        h = fnv(h, d + dl / 2, sample);
        h = fnv(h, d + dl - sample, sample);
    }
    char canon[512];
    size_t cl = kvr_rope_config_canonical(c, canon, sizeof canon);
    h = fnv(h, (const uint8_t *)canon, cl < sizeof canon ? cl : sizeof canon);
    m->fingerprint = h ? h : 1;
    return 0;
}

int kvr_llama_gguf_parse(const void *buf, size_t len, kvr_llama_model *out, char *err,
                         size_t errlen)
{
    if (!buf || !out) return kvr__br_fail(err, errlen, KVR_EINVAL, "no GGUF bytes");
    gguf g;
    memset(&g, 0, sizeof g);
    g.p = buf;
    g.len = len;
    int rc = parse_file(&g, err, errlen);
    if (rc == 0) rc = profile(&g, out, err, errlen);
    free(g.kvs);
    if (rc) memset(out, 0, sizeof *out);
    return rc;
}

int kvr_llama_gguf_read(const char *path, kvr_llama_model *out, char *err, size_t errlen)
{
    if (!path || !out) return kvr__br_fail(err, errlen, KVR_EINVAL, "no GGUF path");
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return kvr__br_fail(err, errlen, KVR_ESYS, "%s: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        int e = errno;
        close(fd);
        return kvr__br_fail(err, errlen, KVR_ESYS, "%s: %s", path,
                           S_ISREG(sb.st_mode) ? strerror(e) : "not a regular file");
    }
    if (sb.st_size < 24) {
        close(fd);
        return kvr__br_fail(err, errlen, KVR_EINVAL, "%s: not a GGUF file (%lld bytes)", path,
                           (long long)sb.st_size);
    }
    void *p = mmap(NULL, (size_t)sb.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (p == MAP_FAILED) return kvr__br_fail(err, errlen, KVR_ESYS, "%s: mmap: %s", path, strerror(errno));
    char e2[400] = "";
    int rc = kvr_llama_gguf_parse(p, (size_t)sb.st_size, out, e2, sizeof e2);
    munmap(p, (size_t)sb.st_size);
    if (rc) return kvr__br_fail(err, errlen, rc, "%s: %s", path, e2);
    return 0;
}

char *kvr_llama_model_default_name(const kvr_llama_model *m, char *buf, size_t cap)
{
    if (!cap) return buf;
    snprintf(buf, cap, "%s-%012llx", m->name[0] ? m->name : m->arch,
             (unsigned long long)(m->fingerprint & 0xffffffffffffull));
    return buf;
}
