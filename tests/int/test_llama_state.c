/*
 * test_llama_state.c — the llama.cpp bridge without libllama: GGUF profiles
 * (scripts/gen-gguf.py models and hand-made bad files), state parse / decode
 * / encode (both forms, every type, both V layouts), every bad input named
 * clearly, and through a real kvroped: import modes (create, append,
 * refresh, replace), refusals by model name, and nothing stored changing on
 * any refusal; the CLI's llama import/export name the flags a state needs.
 */
#include <criterion/criterion.h>
#include <criterion/logging.h>
#include <math.h>

#include "client/llama/kvrope_llama.h"
#include "tests/common/kvr_opsd.h"   /* kvr_testd.h, opsd_slurp */
#include "tests/common/kvt_llama.h"

static char TMP[256];

static const char *src_dir(void)
{
    const char *s = getenv("KVR_SRC");
    return s && *s ? s : ".";
}

static void gen(char *path, size_t cap, const char *name, const char *args)
{
    snprintf(path, cap, "%s/%s.gguf", TMP, name);
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "/usr/bin/python3 %s/scripts/gen-gguf.py -o %s %s", src_dir(), path, args);
    cr_assert_eq(system(cmd), 0, "%s", cmd);
}

static void mk_tmp(void)
{
    snprintf(TMP, sizeof TMP, "/tmp/kvr-llama-state-XXXXXX");
    cr_assert_not_null(mkdtemp(TMP));
}

static void rm_tmp(void)
{
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf %s", TMP);
    if (system(cmd) != 0) cr_log_warn("could not remove %s", TMP);
}

static void load(kvr_llama_model *m, const char *name, const char *args)
{
    char path[512], err[400];
    gen(path, sizeof path, name, args);
    cr_assert_eq(kvr_llama_gguf_read(path, m, err, sizeof err), 0, "%s", err);
}

/* Deterministic f16 payload of n cells. */
static uint16_t *payload(const kvr_llama_model *m, uint32_t n, unsigned seed)
{
    size_t cnt = kvr_llama_payload_size(m, n, KVR_DTYPE_F16) / 2;
    uint16_t *p = malloc(cnt * 2);
    unsigned x = seed * 747796405u + 1;
    for (size_t i = 0; i < cnt; i++) {
        x = x * 1103515245u + 12345u;
        p[i] = kvr_f32_to_f16(((float)((x >> 8) & 0xffff) / 32768.0f - 1.0f) * 2.0f);
    }
    return p;
}

static unsigned char *mk_state(const kvr_llama_model *m, uint32_t n, kvr_llama_type tk,
                               kvr_llama_type tv, bool vt, kvr_llama_form form, size_t *len)
{
    uint16_t *p = payload(m, n, 1);
    int32_t *pos = malloc(n * 4), *tok = malloc(n * 4);
    for (uint32_t i = 0; i < n; i++) {
        pos[i] = (int32_t)i;
        tok[i] = (int32_t)(3 + i % 200);
    }
    kvr_llama_encode_args a = { .n_cells = n, .pos = pos, .tokens = tok, .payload = p,
                                .dtype = KVR_DTYPE_F16, .type_k = tk, .type_v = tv,
                                .v_trans = vt, .form = form, .seq_id = 0 };
    void *out;
    char err[300];
    cr_assert_eq(kvr_llama_state_encode(m, &a, &out, len, err, sizeof err), 0, "%s", err);
    cr_assert_eq(*len, kvr_llama_state_size(m, &a));
    free(p);
    free(pos);
    free(tok);
    return out;
}

/* ---- GGUF profiles ----------------------------------------------------------- */

TestSuite(llama_gguf, .init = mk_tmp, .fini = rm_tmp, .timeout = 120);

Test(llama_gguf, profiles_of_generated_models)
{
    kvr_llama_model m;
    load(&m, "a", "--layers 3 --width 96 --heads 6 --kv-heads 2 --head-dim 32 --rope-base 500000");
    cr_assert_str_eq(m.arch, "llama");
    cr_assert_eq(m.n_layers, 3);
    cr_assert_eq(m.n_heads, 6);
    cr_assert_eq(m.n_kv_heads, 2);
    cr_assert_eq(m.head_dim, 32);
    cr_assert_eq(m.rotary_dim, 32);
    cr_assert_eq(m.rope_type, KVR_LLAMA_ROPE_NORM);
    cr_assert_eq(m.rope.style, KVR_ROPE_GPTJ, "llama's NORM pairing is kvrope's interleaved style");
    cr_assert_float_eq(m.rope.theta, 500000.0, 1e-9);
    cr_assert_eq(m.scaling, KVR_ROPE_SCALING_DEFAULT);
    cr_assert_eq(m.n_vocab, 260);
    cr_assert_float_eq(m.mscale, 1.0, 0);

    kvr_llama_model q;
    load(&q, "q", "--arch qwen2 --layers 2 --width 128 --heads 4 --kv-heads 2 --rope-scaling linear --rope-factor 2.5 --qkv-bias");
    cr_assert_str_eq(q.arch, "qwen2");
    cr_assert_eq(q.rope_type, KVR_LLAMA_ROPE_NEOX);
    cr_assert_eq(q.rope.style, KVR_ROPE_NEOX);
    cr_assert_eq(q.scaling, KVR_ROPE_SCALING_LINEAR);
    cr_assert_float_eq(q.rope.factor, 2.5, 1e-6);

    kvr_llama_model y;
    load(&y, "y", "--layers 1 --width 64 --heads 1 --rope-scaling yarn --rope-factor 8 --orig-ctx 1024 --ctx 8192 --yarn-beta-fast 16");
    cr_assert_eq(y.rope.scaling, KVR_ROPE_SCALING_YARN);
    cr_assert_eq(y.orig_ctx, 1024);
    cr_assert_eq(y.rope.original_max_position_embeddings, 1024);
    cr_assert_float_eq(y.yarn_beta_fast, 16.0, 1e-9);
    cr_assert_float_eq(y.yarn_beta_slow, 1.0, 1e-9);
    cr_assert_float_eq(y.mscale, 0.1 * log(8.0) + 1.0, 1e-12);
    cr_assert_float_eq(y.rope.attention_factor, y.mscale, 1e-12);

    /* fingerprints follow the weights; names follow fingerprints */
    kvr_llama_model a2, b;
    load(&a2, "a2", "--layers 3 --width 96 --heads 6 --kv-heads 2 --head-dim 32 --rope-base 500000");
    load(&b, "b", "--layers 3 --width 96 --heads 6 --kv-heads 2 --head-dim 32 --rope-base 500000 --seed 2");
    cr_assert_eq(m.fingerprint, a2.fingerprint, "same arguments, same fingerprint");
    cr_assert_neq(m.fingerprint, b.fingerprint, "another seed, another fingerprint");
    char n1[300], n2[300];
    kvr_llama_model_default_name(&m, n1, sizeof n1);
    kvr_llama_model_default_name(&b, n2, sizeof n2);
    cr_assert_str_neq(n1, n2);
}

/* A minimal GGUF v3 writer for hand-made (bad) files. */
typedef struct gb {
    unsigned char buf[8192];
    size_t len;
} gb;
static void gb_raw(gb *g, const void *p, size_t n) { memcpy(g->buf + g->len, p, n); g->len += n; }
static void gb_u32(gb *g, uint32_t v) { gb_raw(g, &v, 4); }
static void gb_u64(gb *g, uint64_t v) { gb_raw(g, &v, 8); }
static void gb_str(gb *g, const char *s) { gb_u64(g, strlen(s)); gb_raw(g, s, strlen(s)); }
static void gb_pad(gb *g, size_t n) { memset(g->buf + g->len, 0, n); g->len += n; }
static void gb_kv_str(gb *g, const char *k, const char *v) { gb_str(g, k); gb_u32(g, 8); gb_str(g, v); }
static void gb_kv_u32(gb *g, const char *k, uint32_t v) { gb_str(g, k); gb_u32(g, 4); gb_u32(g, v); }
static void gb_head(gb *g, uint64_t n_tensors, uint64_t n_kv)
{
    g->len = 0;
    gb_u32(g, 0x46554747u);
    gb_u32(g, 3);
    gb_u64(g, n_tensors);
    gb_u64(g, n_kv);
}
static void gb_tensor(gb *g, const char *name)
{
    gb_str(g, name);
    gb_u32(g, 1);
    gb_u64(g, 32);
    gb_u32(g, 0);
    gb_u64(g, 0);
}

static void expect_gguf_err(const gb *g, int code, const char *needle)
{
    kvr_llama_model m;
    char err[400] = "";
    int rc = kvr_llama_gguf_parse(g->buf, g->len, &m, err, sizeof err);
    cr_expect_eq(rc, code, "code %d (want %d): %s", rc, code, err);
    cr_expect(strstr(err, needle) != NULL, "'%s' names '%s'", err, needle);
}

static void llama_kvs(gb *g)
{
    gb_kv_str(g, "general.architecture", "llama");
    gb_kv_u32(g, "llama.block_count", 2);
    gb_kv_u32(g, "llama.embedding_length", 64);
    gb_kv_u32(g, "llama.attention.head_count", 2);
}

/* The two tensors the parser looks for: a model's, not an adapter's. */
static void model_tensors(gb *g)
{
    gb_tensor(g, "token_embd.weight");
    gb_tensor(g, "blk.0.attn_k.weight");
}

/* A llama model with one more string key, key = val, that the parser does
 * not support: refused with KVR_EUNSUPPORTED, naming needle. */
static void expect_llama_key_unsupported(gb *g, const char *key, const char *val,
                                         const char *needle)
{
    gb_head(g, 2, 5);
    llama_kvs(g);
    gb_kv_str(g, key, val);
    model_tensors(g);
    expect_gguf_err(g, KVR_EUNSUPPORTED, needle);
}

Test(llama_gguf, bad_files_are_named)
{
    gb g;
    gb_head(&g, 0, 0);
    g.buf[0] = 'X';
    expect_gguf_err(&g, KVR_EINVAL, "not a GGUF file");
    gb_head(&g, 0, 1);
    gb_kv_str(&g, "tokenizer.ggml.model", "llama");
    expect_gguf_err(&g, KVR_EUNSUPPORTED, "not a model: no general.architecture");
    /* a vocabulary-only file: the architecture but no hyperparameters / tensors */
    gb_head(&g, 0, 2);
    gb_kv_str(&g, "general.architecture", "llama");
    gb_kv_str(&g, "tokenizer.ggml.model", "llama");
    expect_gguf_err(&g, KVR_EUNSUPPORTED, "not a model: no llama.block_count");
    gb_head(&g, 0, 4);
    llama_kvs(&g);
    expect_gguf_err(&g, KVR_EUNSUPPORTED, "not a model: no tensor token_embd.weight");
    gb_head(&g, 0, 2);
    gb_kv_str(&g, "general.type", "adapter");
    gb_kv_str(&g, "general.architecture", "llama");
    expect_gguf_err(&g, KVR_EUNSUPPORTED, "general.type is 'adapter'");
    gb_head(&g, 2, 4);
    gb_kv_str(&g, "general.architecture", "mamba");
    gb_kv_u32(&g, "mamba.block_count", 2);
    gb_kv_u32(&g, "mamba.embedding_length", 64);
    gb_kv_u32(&g, "mamba.attention.head_count", 2);
    model_tensors(&g);
    expect_gguf_err(&g, KVR_EUNSUPPORTED, "architecture 'mamba' is not supported");
    expect_llama_key_unsupported(&g, "llama.rope.dimension_sections", "x", "M-RoPE");
    expect_llama_key_unsupported(&g, "llama.rope.scaling.type", "longrope",
                                 "'longrope' is not supported");
    /* huge declared lengths */
    gb_head(&g, 0, 1);
    gb_u64(&g, 1ull << 60);
    gb_pad(&g, 64);
    expect_gguf_err(&g, KVR_EINVAL, "declares 1152921504606846976 bytes");
    gb_head(&g, 0, 1ull << 40);
    expect_gguf_err(&g, KVR_EINVAL, "key/values, more than");
    gb_head(&g, 1ull << 40, 0);
    expect_gguf_err(&g, KVR_EINVAL, "tensors, more than");
    gb_head(&g, 0, 1);
    gb_str(&g, "tokenizer.ggml.tokens");
    gb_u32(&g, 9);
    gb_u32(&g, 8);
    gb_u64(&g, 1ull << 50);
    gb_pad(&g, 64);
    expect_gguf_err(&g, KVR_EINVAL, "strings declared");
    gb_head(&g, 0, 1);
    gb_str(&g, "x");
    gb_u32(&g, 99);
    gb_pad(&g, 64);
    expect_gguf_err(&g, KVR_EINVAL, "unknown value type 99");
    /* a valid model, cut anywhere in its metadata: refused, never read past */
    char path[512];
    gen(path, sizeof path, "cut", "--layers 1 --width 32 --heads 1");
    FILE *f = fopen(path, "rb");
    cr_assert_not_null(f);
    static unsigned char whole[1 << 20];
    size_t n = fread(whole, 1, sizeof whole, f);
    fclose(f);
    kvr_llama_model m;
    char err[400];
    cr_assert_eq(kvr_llama_gguf_parse(whole, n, &m, err, sizeof err), 0, "%s", err);
    for (size_t cut = 0; cut < 9000 && cut < n; cut += cut < 64 ? 1 : 7) {
        unsigned char *p = malloc(cut ? cut : 1);
        memcpy(p, whole, cut);
        int rc = kvr_llama_gguf_parse(p, cut, &m, err, sizeof err);
        free(p);
        if (rc == 0) {
            /* only possible once the whole table is present (tensor data is not needed) */
            cr_assert_gt(cut, 4000, "a file cut at %zu parsed", cut);
        }
    }
    cr_assert_neq(kvr_llama_gguf_read("/nonexistent/x.gguf", &m, err, sizeof err), 0);
    cr_assert(strstr(err, "/nonexistent/x.gguf") != NULL);
}

/* ---- states in memory --------------------------------------------------------- */

TestSuite(llama_state, .init = mk_tmp, .fini = rm_tmp, .timeout = 120);

Test(llama_state, encode_parse_decode_every_type_and_layout)
{
    kvr_llama_model m;
    load(&m, "m", "--layers 2 --width 128 --heads 2 --kv-heads 2 --head-dim 64");
    static const kvr_llama_type T[] = { KVR_LLAMA_F32, KVR_LLAMA_F16, KVR_LLAMA_BF16, KVR_LLAMA_Q8_0,
                                        KVR_LLAMA_Q4_0, KVR_LLAMA_Q4_1, KVR_LLAMA_Q5_0 };
    const uint32_t n = 37;
    uint16_t *src = payload(&m, n, 1);
    size_t pl = kvr_llama_payload_size(&m, n, KVR_DTYPE_F16);
    float *back = malloc(kvr_llama_payload_size(&m, n, KVR_DTYPE_F32));
    uint16_t *b16 = malloc(pl);
    for (size_t ik = 0; ik < 7; ik++)
        for (size_t iv = 0; iv < 7; iv++)
            for (int vt = 0; vt < 2; vt++)
                for (int form = 0; form < 2; form++) {
                    bool vq = kvr_llama_type_is_quantized(T[iv]);
                    size_t len;
                    unsigned char *s;
                    char err[300] = "";
                    if (vt && vq) {
                        kvr_llama_encode_args a = { .n_cells = 1, .pos = (int32_t[]){ 0 }, .payload = src,
                                                    .dtype = KVR_DTYPE_F16, .type_k = T[ik], .type_v = T[iv],
                                                    .v_trans = true };
                        void *o;
                        cr_assert_eq(kvr_llama_state_encode(&m, &a, &o, &len, err, sizeof err), KVR_EUNSUPPORTED);
                        continue;
                    }
                    s = mk_state(&m, n, T[ik], T[iv], vt, (kvr_llama_form)form, &len);
                    kvr_llama_state *st;
                    cr_assert_eq(kvr_llama_state_parse(s, len, &m, &st, err, sizeof err), 0, "%s", err);
                    cr_assert_eq(st->form, (kvr_llama_form)form);
                    cr_assert_eq(st->n_cells, n);
                    cr_assert_eq(st->type_k, T[ik]);
                    cr_assert_eq(st->type_v, T[iv]);
                    cr_assert_eq(st->v_trans, (bool)vt);
                    cr_assert_eq(st->n_tokens, form ? n : 0);
                    cr_assert_eq(st->pos[n - 1], (int32_t)(n - 1));
                    cr_assert_eq(kvr_llama_state_decode(st, &m, 0, n, false, KVR_DTYPE_F16, b16, pl,
                                                        err, sizeof err), 0, "%s", err);
                    size_t side = (size_t)n * 128;
                    for (int l = 0; l < 2; l++)
                        for (int kv = 0; kv < 2; kv++) {
                            kvr_llama_type t = kv ? T[iv] : T[ik];
                            const uint16_t *x = src + (size_t)(2 * l + kv) * side;
                            const uint16_t *y = b16 + (size_t)(2 * l + kv) * side;
                            if (t == KVR_LLAMA_F16 || t == KVR_LLAMA_F32) {
                                cr_assert(memcmp(x, y, side * 2) == 0, "K/V exact through %s",
                                          kvr_llama_type_name(t));
                            } else {
                                double e = 0, q = 0;
                                for (size_t i = 0; i < side; i++) {
                                    double d = (double)kvr_f16_to_f32(x[i]) - (double)kvr_f16_to_f32(y[i]);
                                    e += d * d;
                                    q += (double)kvr_f16_to_f32(x[i]) * (double)kvr_f16_to_f32(x[i]);
                                }
                                double lim = t == KVR_LLAMA_BF16 ? 0.01 : t == KVR_LLAMA_Q8_0 ? 0.02 : 0.2;
                                cr_assert_leq(sqrt(e / q), lim, "%s relative RMS %.4f",
                                              kvr_llama_type_name(t), sqrt(e / q));
                            }
                        }
                    /* re-encoding the decoded values gives the same bytes (f32 path) */
                    cr_assert_eq(kvr_llama_state_decode(st, &m, 0, n, false, KVR_DTYPE_F32, back,
                                                        kvr_llama_payload_size(&m, n, KVR_DTYPE_F32),
                                                        err, sizeof err), 0);
                    int32_t *pos = st->pos;
                    kvr_llama_encode_args a = { .n_cells = n, .pos = pos, .tokens = st->tokens,
                                                .payload = back, .dtype = KVR_DTYPE_F32, .type_k = T[ik],
                                                .type_v = T[iv], .v_trans = vt, .form = (kvr_llama_form)form };
                    void *s2;
                    size_t l2;
                    cr_assert_eq(kvr_llama_state_encode(&m, &a, &s2, &l2, err, sizeof err), 0, "%s", err);
                    cr_assert(l2 == len && memcmp(s, s2, len) == 0,
                              "K %s V %s v_trans %d form %d: decode + encode gives the state back",
                              kvr_llama_type_name(T[ik]), kvr_llama_type_name(T[iv]), vt, form);
                    kvr_llama_free(s2);
                    kvr_llama_state_free(st);
                    kvr_llama_free(s);
                }
    free(src);
    free(back);
    free(b16);
}

static void expect_state_err(const kvr_llama_model *m, const unsigned char *s, size_t len, int code,
                             const char *needle)
{
    kvr_llama_state *st = (kvr_llama_state *)(uintptr_t)1;
    char err[400] = "";
    int rc = kvr_llama_state_parse(s, len, m, &st, err, sizeof err);
    cr_expect_eq(rc, code, "code %d (want %d): %s", rc, code, err);
    cr_expect_null(st, "nothing returned on failure");
    cr_expect(needle == NULL || strstr(err, needle) != NULL, "'%s' names '%s'", err, needle);
}

/* Offsets in a raw state of n cells: header 8, n_stream 4, cell_count 4,
 * cells 12 each, v_trans 4, n_layer 4, then layer 0's K type. */
#define OFF_NSTREAM 8
#define OFF_NCELLS 12
#define OFF_CELL(i) (16 + 12 * (size_t)(i))
#define OFF_VT(n) (16 + 12 * (size_t)(n))
#define OFF_K0TYPE(n) (OFF_VT(n) + 8)

static void put32(unsigned char *p, uint32_t v) { memcpy(p, &v, 4); }

Test(llama_state, bad_states_are_named)
{
    kvr_llama_model m, other;
    load(&m, "m", "--layers 2 --width 64 --heads 2 --kv-heads 1 --head-dim 32");
    load(&other, "o", "--layers 3 --width 64 --heads 2 --kv-heads 1 --head-dim 32");
    const uint32_t n = 9;
    size_t len;
    unsigned char *s = mk_state(&m, n, KVR_LLAMA_F16, KVR_LLAMA_F16, false, KVR_LLAMA_FORM_RAW, &len);
    unsigned char *b = malloc(len + 4096);
    kvr_llama_state *st;
    char err[400];
    cr_assert_eq(kvr_llama_state_parse(s, len, &m, &st, err, sizeof err), 0, "%s", err);
    kvr_llama_state_free(st);

    /* truncated anywhere */
    for (size_t cut = 0; cut < len; cut++) {
        unsigned char *p = malloc(cut ? cut : 1);
        memcpy(p, s, cut);
        expect_state_err(&m, p, cut, KVR_EINVAL, NULL);
        free(p);
    }
    expect_state_err(&m, s, len - 1, KVR_EINVAL, "truncated");
    /* oversized */
    memcpy(b, s, len);
    b[len] = 0;
    expect_state_err(&m, b, len + 1, KVR_EINVAL, "1 bytes after the end");
    /* magic, version */
    memcpy(b, s, len);
    put32(b, 0x12345678);
    expect_state_err(&m, b, len, KVR_EINVAL, "magic 0x12345678");
    unsigned char *ss;
    size_t sl;
    ss = mk_state(&m, n, KVR_LLAMA_F16, KVR_LLAMA_F16, false, KVR_LLAMA_FORM_SESSION, &sl);
    put32(ss + 4, 2);
    expect_state_err(&m, ss, sl, KVR_EUNSUPPORTED, "version 2");
    put32(ss + 4, 3);
    put32(ss + 8, 0xfffffff0u);
    expect_state_err(&m, ss, sl, KVR_EINVAL, "4294967280 tokens declared");
    kvr_llama_free(ss);
    /* unknown / unsupported ggml types, mixed types */
    memcpy(b, s, len);
    put32(b + OFF_K0TYPE(n), 99);
    expect_state_err(&m, b, len, KVR_EUNSUPPORTED, "ggml type 99");
    put32(b + OFF_K0TYPE(n), 7);   /* q5_1: ggml's, not the bridge's */
    expect_state_err(&m, b, len, KVR_EUNSUPPORTED, "layer 0: K has ggml type 7");
    memcpy(b, s, len);
    size_t k1 = OFF_K0TYPE(n) + 12 + (size_t)n * 64;
    put32(b + k1, 0);
    expect_state_err(&m, b, len, KVR_EUNSUPPORTED, "layer 1: K type f32 differs");
    /* several streams */
    memcpy(b, s, len);
    put32(b + OFF_NSTREAM, 2);
    expect_state_err(&m, b, len, KVR_EUNSUPPORTED, "2 streams");
    /* a cell in two sequences: n_seq_id 2 and one more id */
    memcpy(b, s, OFF_CELL(4) + 12);
    put32(b + OFF_CELL(4) + 4, 2);
    put32(b + OFF_CELL(4) + 12, 1);
    memcpy(b + OFF_CELL(4) + 16, s + OFF_CELL(4) + 12, len - OFF_CELL(4) - 12);
    expect_state_err(&m, b, len + 4, KVR_EUNSUPPORTED, "cell 4 (position 4) belongs to 2 sequences");
    /* a cell of another sequence */
    memcpy(b, s, len);
    put32(b + OFF_CELL(2) + 8, 5);
    expect_state_err(&m, b, len, KVR_EUNSUPPORTED, "belongs to sequence 5");
    /* extra per-cell data (M-RoPE: 12 bytes x, y, tok after n_seq_id) */
    {
        size_t o = 0, i = 0;
        memcpy(b, s, OFF_CELL(0));
        o = OFF_CELL(0);
        for (i = 0; i < n; i++) {
            memcpy(b + o, s + OFF_CELL(i), 8);
            memset(b + o + 8, 0, 12);
            memcpy(b + o + 20, s + OFF_CELL(i) + 8, 4);
            o += 24;
        }
        memcpy(b + o, s + OFF_VT(n), len - OFF_VT(n));
        expect_state_err(&m, b, len + 12 * n, KVR_EUNSUPPORTED, "extra per-cell data");
    }
    /* huge declared lengths */
    memcpy(b, s, len);
    put32(b + OFF_NCELLS, 0xffffffffu);
    expect_state_err(&m, b, len, KVR_EINVAL, "4294967295 cells declared");
    memcpy(b, s, len);
    put32(b + OFF_VT(n) + 4, 0x7fffffffu);
    expect_state_err(&m, b, len, KVR_EINVAL, "2147483647 layers declared");
    memcpy(b, s, len);
    uint64_t huge = 1ull << 62;
    memcpy(b + OFF_K0TYPE(n) + 4, &huge, 8);
    expect_state_err(&m, b, len, KVR_EINVAL, "is not a whole number");
    huge = 64 * 4096;
    memcpy(b + OFF_K0TYPE(n) + 4, &huge, 8);
    expect_state_err(&m, b, len, KVR_EINVAL, "needs 9 rows of 262144 bytes");
    memcpy(b, s, len);
    put32(b + OFF_VT(n), 3);
    expect_state_err(&m, b, len, KVR_EINVAL, "v_trans is 3");
    memcpy(b, s, len);
    put32(b + OFF_CELL(1), 0xffffffffu);
    expect_state_err(&m, b, len, KVR_EINVAL, "negative position");
    /* V transposed with a huge element count */
    ss = mk_state(&m, n, KVR_LLAMA_F16, KVR_LLAMA_F16, true, KVR_LLAMA_FORM_RAW, &sl);
    size_t v0 = OFF_K0TYPE(n) + 2 * (12 + (size_t)n * 64);
    put32(ss + v0 + 8, 0x40000000u);
    expect_state_err(&m, ss, sl, KVR_EINVAL, "V has 1073741824 values per cell");
    put32(ss + v0 + 8, 1u << 20);
    expect_state_err(&m, ss, sl, KVR_EINVAL, "V needs");
    put32(ss + v0 + 8, 64);
    put32(ss + v0 + 4, 4);
    expect_state_err(&m, ss, sl, KVR_EINVAL, "V element size 4");
    kvr_llama_free(ss);
    /* another model's state */
    expect_state_err(&other, s, len, KVR_ESHAPE, "the state was made by another model: 2 layers");
    free(b);
    kvr_llama_free(s);
}

/* ---- through the daemon --------------------------------------------------------- */

static kvr_testd D;
static void dsetup(void)
{
    mk_tmp();
    cr_assert_eq(testd_start(&D, NULL), 0);
}
static void dteardown(void)
{
    testd_stop(&D);
    rm_tmp();
}
TestSuite(llama_import, .init = dsetup, .fini = dteardown, .timeout = 120);

Test(llama_import, modes_append_refresh_replace)
{
    kvr_client *c = testd_connect(&D);
    kvr_llama_model m;
    load(&m, "m", "--layers 2 --width 64 --heads 2 --kv-heads 1 --head-dim 32");
    char err[400];
    cr_assert_eq(kvr_llama_model_register(c, &m, NULL, NULL, err, sizeof err), 0, "%s", err);
    cr_assert_eq(kvr_llama_model_register(c, &m, NULL, NULL, err, sizeof err), 0, "again: %s", err);
    size_t len;
    unsigned char *s = mk_state(&m, 40, KVR_LLAMA_F16, KVR_LLAMA_F16, false, KVR_LLAMA_FORM_SESSION, &len);
    /* create from the first 25 cells, append the rest */
    kvr_llama_import_opts o = { .cell_end = 25 };
    kvr_llama_import_info info;
    cr_assert_eq(kvr_llama_state_import(c, "doc", s, len, &m, &o, &info, err, sizeof err), 0, "%s", err);
    cr_assert_eq(info.n_taken, 25);
    cr_assert_eq(info.ctx_tokens, 25);
    cr_assert_str_eq(info.codec, "f16");
    kvr_llama_import_opts o2 = { .mode = KVR_LLAMA_IMPORT_APPEND, .cell_start = 25 };
    cr_assert_eq(kvr_llama_state_import(c, "doc", s, len, &m, &o2, &info, err, sizeof err), 0, "%s", err);
    cr_assert_eq(info.ctx_tokens, 40);
    cr_assert_eq(info.pos_first, 25);
    kvr_llama_export_opts eo = { .form = KVR_LLAMA_FORM_SESSION };
    size_t l1;
    unsigned char *e = kvt_llama_export(c, "doc", &m, &eo, &l1);
    cr_assert(l1 == len && memcmp(e, s, len) == 0, "create + append = the whole state, byte for byte");
    kvr_llama_free(e);
    /* create again: refused, context unchanged */
    kvr_llama_import_opts o3 = { 0 };
    cr_assert_eq(kvr_llama_state_import(c, "doc", s, len, &m, &o3, NULL, err, sizeof err), KVR_EEXIST);
    /* refresh after an edit without KV: pending tokens get the state's KV */
    uint32_t nt[3] = { 9, 9, 9 };
    kvr_edit_range op = { .start = 10, .end = 13, .tokens = nt, .n_tokens = 3 };
    kvr_edit_args ea = { .ctx_id = "doc", .ops = &op, .n_ops = 1 };
    cr_assert_eq(kvr_client_edit(c, &ea, NULL), 0, "%s", kvr_client_last_error(c));
    kvr_context ed;
    cr_assert_eq(kvr_client_stat(c, "doc", &ed), 0);
    cr_assert_eq(ed.n_pending, 3);
    kvr_llama_import_opts o4 = { .mode = KVR_LLAMA_IMPORT_REFRESH, .cell_start = 10, .cell_end = 13,
                                 .ctx_start = 10 };
    cr_assert_eq(kvr_llama_state_import(c, "doc", s, len, &m, &o4, &info, err, sizeof err), 0, "%s", err);
    cr_assert_eq(kvr_client_stat(c, "doc", &ed), 0);
    cr_assert_eq(ed.n_pending, 0);
    /* refresh at the wrong positions: refused by position */
    kvr_llama_import_opts o5 = { .mode = KVR_LLAMA_IMPORT_REFRESH, .cell_start = 11, .cell_end = 14,
                                 .ctx_start = 10 };
    cr_assert_eq(kvr_llama_state_import(c, "doc", s, len, &m, &o5, NULL, err, sizeof err), KVR_ERANGE);
    cr_assert(strstr(err, "cell 11 is at position 11, context token 10 at 10") != NULL, "%s", err);
    /* replace */
    kvr_llama_import_opts o6 = { .mode = KVR_LLAMA_IMPORT_REPLACE, .cell_end = 5 };
    cr_assert_eq(kvr_llama_state_import(c, "doc", s, len, &m, &o6, &info, err, sizeof err), 0, "%s", err);
    cr_assert_eq(info.ctx_tokens, 5);
    /* replace of a missing id: a create */
    cr_assert_eq(kvr_llama_state_import(c, "new", s, len, &m, &o6, &info, err, sizeof err), 0, "%s", err);
    cr_assert_eq(info.ctx_tokens, 5);
    /* replace of another model's context of that id: deleted, then created */
    kvr_llama_model m2;
    load(&m2, "m2", "--layers 2 --width 64 --heads 2 --kv-heads 2 --head-dim 32");
    cr_assert_eq(kvr_llama_model_register(c, &m2, NULL, NULL, err, sizeof err), 0, "%s", err);
    size_t len2;
    unsigned char *s2 = mk_state(&m2, 12, KVR_LLAMA_F16, KVR_LLAMA_F16, false, KVR_LLAMA_FORM_SESSION, &len2);
    cr_assert_eq(kvr_llama_state_import(c, "other", s2, len2, &m2, NULL, &info, err, sizeof err), 0, "%s", err);
    kvr_context oc, dc;
    cr_assert_eq(kvr_client_stat(c, "other", &oc), 0);
    cr_assert_eq(kvr_client_stat(c, "doc", &dc), 0);
    cr_assert_str_neq(oc.model, dc.model);
    cr_assert_eq(kvr_llama_state_import(c, "other", s, len, &m, &o6, &info, err, sizeof err), 0, "%s", err);
    cr_assert_eq(info.ctx_tokens, 5);
    cr_assert_eq(kvr_client_stat(c, "other", &oc), 0);
    cr_assert_str_eq(oc.model, dc.model);
    cr_assert_eq(oc.n_tokens, 5);
    kvr_llama_free(s2);
    /* a quantized state imports as f32 (the exact dequantized values) */
    size_t lq;
    unsigned char *q = mk_state(&m, 40, KVR_LLAMA_Q8_0, KVR_LLAMA_Q4_0, false, KVR_LLAMA_FORM_SESSION, &lq);
    cr_assert_eq(kvr_llama_state_import(c, "q", q, lq, &m, NULL, &info, err, sizeof err), 0, "%s", err);
    cr_assert_str_eq(info.codec, "f32");
    kvr_llama_export_opts qo = { .form = KVR_LLAMA_FORM_SESSION, .type_k = KVR_LLAMA_Q8_0, .type_v = KVR_LLAMA_Q4_0 };
    e = kvt_llama_export(c, "q", &m, &qo, &l1);
    cr_assert(l1 == lq && memcmp(e, q, lq) == 0, "q8_0/q4_0 state back byte for byte");
    kvr_llama_free(e);
    kvr_llama_free(q);
    /* a quantized codec at rest: the daemon stores the keys pre-RoPE; an export
     * at other positions is the plain context's export up to int8 error */
    kvr_llama_import_opts oq = { .codec = "int8" };
    cr_assert_eq(kvr_llama_state_import(c, "i8", s, len, &m, &oq, &info, err, sizeof err), 0, "%s", err);
    cr_assert_str_eq(info.codec, "k=int8/g64,v=int8/g64,r=0");
    kvr_llama_import_opts opl = { 0 };
    cr_assert_eq(kvr_llama_state_import(c, "plain", s, len, &m, &opl, NULL, err, sizeof err), 0, "%s", err);
    kvr_llama_export_opts sh = { .has_pos_start = true, .pos_start = 500, .type_k = KVR_LLAMA_F32,
                                 .type_v = KVR_LLAMA_F32 };
    size_t la, lb;
    unsigned char *xa = kvt_llama_export(c, "i8", &m, &sh, &la);
    unsigned char *xb = kvt_llama_export(c, "plain", &m, &sh, &lb);
    cr_assert_eq(la, lb);
    kvr_llama_state *sa, *sb;
    cr_assert_eq(kvr_llama_state_parse(xa, la, &m, &sa, err, sizeof err), 0, "%s", err);
    cr_assert_eq(kvr_llama_state_parse(xb, lb, &m, &sb, err, sizeof err), 0, "%s", err);
    cr_assert_eq(sa->pos[0], 500);
    double e2 = 0, q2 = 0;
    for (uint32_t l = 0; l < m.n_layers; l++)
        for (size_t i = 0; i < (size_t)40 * 32; i++) {
            float x, y;
            memcpy(&x, sa->k[l] + i * 4, 4);
            memcpy(&y, sb->k[l] + i * 4, 4);
            e2 += ((double)x - (double)y) * ((double)x - (double)y);
            q2 += (double)y * (double)y;
        }
    cr_assert_leq(sqrt(e2 / q2), 0.02, "int8 keys re-rotated to 500: rel RMS %.4f", sqrt(e2 / q2));
    kvr_llama_state_free(sa);
    kvr_llama_state_free(sb);
    kvr_llama_free(xa);
    kvr_llama_free(xb);
    kvr_llama_free(s);
    kvr_client_close(c);
}

/* Context bytes as f16 (to check that refusals change nothing). */
static void *ctx_bytes(kvr_client *c, const char *ctx, size_t *len, uint64_t *n)
{
    kvr_kv kv;
    kvr_get_args ga = { .ctx_id = ctx, .dtype = KVR_DTYPE_F16 };
    cr_assert_eq(kvr_client_get(c, &ga, &kv), 0, "%s", kvr_client_last_error(c));
    *len = kv.payload_len;
    *n = kv.n_tokens;
    void *p = kv.payload;
    kv.payload = NULL;
    kvr_kv_release(&kv);
    return p;
}

Test(llama_import, refusals_change_nothing)
{
    kvr_client *c = testd_connect(&D);
    kvr_llama_model m, other, same_shape;
    load(&m, "m", "--layers 2 --width 64 --heads 2 --kv-heads 1 --head-dim 32");
    load(&other, "o", "--layers 1 --width 64 --heads 2 --kv-heads 1 --head-dim 32");
    load(&same_shape, "s", "--layers 2 --width 64 --heads 2 --kv-heads 1 --head-dim 32 --seed 5");
    char err[400];
    cr_assert_eq(kvr_llama_model_register(c, &m, NULL, NULL, err, sizeof err), 0, "%s", err);
    cr_assert_eq(kvr_llama_model_register(c, &same_shape, NULL, NULL, err, sizeof err), 0, "%s", err);
    size_t len;
    unsigned char *s = mk_state(&m, 20, KVR_LLAMA_F16, KVR_LLAMA_F16, false, KVR_LLAMA_FORM_SESSION, &len);
    cr_assert_eq(kvr_llama_state_import(c, "doc", s, len, &m, NULL, NULL, err, sizeof err), 0, "%s", err);
    size_t b0;
    uint64_t n0;
    void *before = ctx_bytes(c, "doc", &b0, &n0);

    unsigned char *bad = malloc(len + 64);
    struct { const char *what; size_t len; int code; const char *needle; } cases[8];
    int nc = 0;
    memcpy(bad, s, len);
    /* each bad input, as an append to doc and as a new context */
    for (int k = 0; k < 5; k++) {
        memcpy(bad, s, len);
        size_t l = len;
        int code = KVR_EINVAL;
        const char *needle = NULL;
        switch (k) {
        case 0: l = len - 3; needle = "truncated"; break;
        case 1: bad[len] = 1; l = len + 1; needle = "after the end"; break;
        case 2: put32(bad + 12 + 4 * 20, 3); code = KVR_EUNSUPPORTED; needle = "3 streams"; break;
        case 3: put32(bad + 12 + 4 * 20 + 8 + 12 * 20 + 8, 1234); code = KVR_EUNSUPPORTED; needle = "ggml type 1234"; break;
        case 4: put32(bad + 12 + 4 * 20 + 8 + 12 * 3 + 4, 2); code = KVR_EUNSUPPORTED; needle = NULL; break;
        }
        kvr_llama_import_opts oa = { .mode = KVR_LLAMA_IMPORT_APPEND };
        int rc = kvr_llama_state_import(c, "doc", bad, l, &m, &oa, NULL, err, sizeof err);
        cr_expect_eq(rc, code, "case %d: %d %s", k, rc, err);
        if (needle) cr_expect(strstr(err, needle) != NULL, "case %d: '%s' names '%s'", k, err, needle);
        rc = kvr_llama_state_import(c, "new", bad, l, &m, NULL, NULL, err, sizeof err);
        cr_expect_eq(rc, code, "case %d (create): %s", k, err);
        (void)cases;
        (void)nc;
    }
    /* another model's shape */
    kvr_llama_import_opts oa = { .mode = KVR_LLAMA_IMPORT_APPEND };
    cr_assert_eq(kvr_llama_state_import(c, "doc", s, len, &other, &oa, NULL, err, sizeof err), KVR_ESHAPE);
    cr_assert(strstr(err, "made by another model") != NULL, "%s", err);
    /* same shape, another model (other weights): refused by name */
    cr_assert_eq(kvr_llama_state_import(c, "doc", s, len, &same_shape, &oa, NULL, err, sizeof err),
                 KVR_EFINGERPRINT);
    cr_assert(strstr(err, "was made by model") != NULL, "%s", err);
    void *st;
    size_t sl;
    cr_assert_eq(kvr_llama_state_export(c, "doc", &same_shape, NULL, &st, &sl, NULL, err, sizeof err),
                 KVR_EFINGERPRINT);
    cr_assert(strstr(err, "was made by model") != NULL, "%s", err);
    /* a model that is not registered */
    cr_assert_eq(kvr_llama_state_import(c, "new", s, len, &other, NULL, NULL, err, sizeof err),
                 KVR_ESHAPE);
    size_t lo;
    unsigned char *so = mk_state(&other, 4, KVR_LLAMA_F16, KVR_LLAMA_F16, false, KVR_LLAMA_FORM_SESSION, &lo);
    cr_assert_eq(kvr_llama_state_import(c, "new", so, lo, &other, NULL, NULL, err, sizeof err),
                 KVR_ENOMODEL);
    cr_assert(strstr(err, "is not registered") != NULL, "%s", err);
    /* raw form without tokens */
    size_t lr;
    unsigned char *sr = mk_state(&m, 4, KVR_LLAMA_F16, KVR_LLAMA_F16, false, KVR_LLAMA_FORM_RAW, &lr);
    cr_assert_eq(kvr_llama_state_import(c, "new", sr, lr, &m, NULL, NULL, err, sizeof err), KVR_EINVAL);
    cr_assert(strstr(err, "carries no token ids") != NULL, "%s", err);
    /* export refusals: range, positions */
    kvr_llama_export_opts eo = { .start = 5, .end = 50 };
    cr_assert_eq(kvr_llama_state_export(c, "doc", &m, &eo, &st, &sl, NULL, err, sizeof err), KVR_ERANGE);
    kvr_llama_export_opts ep = { .has_pos_start = true, .pos_start = (int64_t)INT32_MAX - 3 };
    cr_assert_eq(kvr_llama_state_export(c, "doc", &m, &ep, &st, &sl, NULL, err, sizeof err), KVR_ERANGE);
    kvr_llama_export_opts eq = { .type_v = KVR_LLAMA_Q8_0, .v_trans = true };
    cr_assert_eq(kvr_llama_state_export(c, "doc", &m, &eq, &st, &sl, NULL, err, sizeof err), KVR_EUNSUPPORTED);

    size_t b1;
    uint64_t n1;
    void *after = ctx_bytes(c, "doc", &b1, &n1);
    cr_assert_eq(n1, n0);
    cr_assert(b0 == b1 && memcmp(before, after, b0) == 0, "the context is byte for byte as before");
    kvr_context ci;
    cr_assert_eq(kvr_client_stat(c, "new", &ci), KVR_ENOCTX, "no context was created by a refusal");
    free(before);
    free(after);
    free(bad);
    kvr_llama_free(s);
    kvr_llama_free(so);
    kvr_llama_free(sr);
    kvr_client_close(c);
}

/* `kvrope llama import|export` through the CLI: a raw state without ids is
 * refused with the flag that gives them (--tokens-file), a state with V
 * transposed is recorded as such, the export writes that layout by default
 * (or the one --no-v-trans asks for), and every export says which it wrote. */
Test(llama_import, cli_names_the_flags_a_state_needs)
{
    char gguf[512], path[600], ids[600];
    gen(gguf, sizeof gguf, "cli", "--layers 2 --width 64 --heads 2 --kv-heads 1 --head-dim 32");
    kvr_llama_model m;
    char err[400];
    cr_assert_eq(kvr_llama_gguf_read(gguf, &m, err, sizeof err), 0, "%s", err);
    size_t len;
    unsigned char *s = mk_state(&m, 6, KVR_LLAMA_F16, KVR_LLAMA_F16, true, KVR_LLAMA_FORM_RAW, &len);
    snprintf(path, sizeof path, "%s/raw.bin", TMP);
    FILE *f = fopen(path, "wb");
    cr_assert(f && fwrite(s, 1, len, f) == len && fclose(f) == 0);
    kvr_llama_free(s);
    snprintf(ids, sizeof ids, "%s/ids.txt", TMP);
    f = fopen(ids, "w");
    cr_assert(f && fputs("3 4 5 6 7 8\n", f) >= 0 && fclose(f) == 0);

    static char out[1 << 14];
    int rc = testd_cli(&D, out, sizeof out, (const char *const[]){
        "--json", "llama", "import", "vt", path, "--gguf", gguf, NULL });
    cr_assert_eq(rc, 1, "%s", out);
    cr_assert(strstr(out, "carries no token ids") && strstr(out, "--tokens-file"), "%s", out);

    rc = testd_cli(&D, out, sizeof out, (const char *const[]){
        "llama", "import", "vt", path, "--gguf", gguf, "--tokens-file", ids, NULL });
    cr_assert_eq(rc, 0, "%s", out);
    cr_assert(strstr(out, "transposed") && strstr(out, "recorded"), "%s", out);

    char st0[600], st1[600];
    snprintf(st0, sizeof st0, "%s/out0.bin", TMP);
    snprintf(st1, sizeof st1, "%s/out1.bin", TMP);
    rc = testd_cli(&D, out, sizeof out, (const char *const[]){
        "llama", "export", "vt", "-o", st1, "--gguf", gguf, NULL });
    cr_assert_eq(rc, 0, "%s", out);
    cr_assert(strstr(out, "V layout written: v_trans 1") && strstr(out, "as the context was imported"),
              "%s", out);
    rc = testd_cli(&D, out, sizeof out, (const char *const[]){
        "llama", "export", "vt", "-o", st0, "--gguf", gguf, "--no-v-trans", NULL });
    cr_assert_eq(rc, 0, "%s", out);
    cr_assert(strstr(out, "V layout written: v_trans 0") && strstr(out, "as asked"), "%s", out);
    /* The files say what the messages say. */
    const char *files[] = { st0, st1 };
    for (int i = 0; i < 2; i++) {
        size_t n;
        char *b = opsd_slurp(files[i], &n);
        cr_assert_not_null(b, "%s", files[i]);
        kvr_llama_state *st;
        cr_assert_eq(kvr_llama_state_parse(b, n, &m, &st, err, sizeof err), 0, "%s", err);
        cr_assert_eq(st->v_trans, i == 1, "%s: v_trans %d", files[i], (int)st->v_trans);
        kvr_llama_state_free(st);
        free(b);
    }
}
