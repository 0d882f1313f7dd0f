/*
 * test_cache_rope_layers.c — per-layer RoPE and length-dependent RoPE through
 * the store (issue 18): every path that rotates keys (a plain get re-rotating
 * from stored-at, a quantized put un-rotating and its get rotating to the
 * targets) must use each layer's own configuration, and dynamic NTK keys move
 * with the context's length.
 *
 * The reference here is independent of rope/: NeoX rotation in double
 * precision with the layer's base (Gemma 3: rope_local_base_freq 1e4 on
 * sliding layers, rope_theta 1e6 on the others; Llama 4: no rotation on
 * NoPE layers; Cohere 2: no rotation on full-attention layers). The real
 * Gemma 3 config.json is read in place from $KVR_CONFIGS (else the sibling
 * of $KVR_VECTORS, else ../shared/configs).
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cache/cache.h"
#include "tests/common/kvt_store.h"

#define T 16
#define SHIFT 1000

static char *configs_path(const char *file)
{
    static char buf[4096];
    const char *d = getenv("KVR_CONFIGS");
    const char *v = getenv("KVR_VECTORS");
    if (d && *d)
        snprintf(buf, sizeof buf, "%s/%s", d, file);
    else if (v && *v)
        snprintf(buf, sizeof buf, "%s/../configs/%s", v, file);
    else
        snprintf(buf, sizeof buf, "../shared/configs/%s", file);
    return buf;
}

static float pre_val(uint32_t l, int kv, size_t tok, size_t j)
{
    uint32_t h = (l * 7919u + (uint32_t)kv * 104729u) ^ (uint32_t)(tok * 2654435761u) ^
                 (uint32_t)(j * 40503u);
    h ^= h >> 13;
    h *= 0x5bd1e995u;
    h ^= h >> 15;
    return (float)(h % 20001u) / 10000.0f - 1.0f;
}

/* The reference: x [n][H][D] rotated (NeoX over rot dims) by pos * theta^(-2i/rot);
 * theta 0 = no RoPE. */
static void ref_rotate(double *out, const double *x, size_t n, uint32_t H, uint32_t D,
                       uint32_t rot, double theta, const int64_t *pos)
{
    memcpy(out, x, n * H * D * sizeof *out);
    if (theta == 0.0)
        return;
    for (size_t t = 0; t < n; t++)
        for (uint32_t h = 0; h < H; h++) {
            const double *a = x + (t * H + h) * D;
            double *o = out + (t * H + h) * D;
            for (uint32_t i = 0; i < rot / 2; i++) {
                double f = 1.0 / pow(theta, (double)(2 * i) / (double)rot);
                double c = cos((double)pos[t] * f), s = sin((double)pos[t] * f);
                o[i] = a[i] * c - a[i + rot / 2] * s;
                o[i + rot / 2] = a[i + rot / 2] * c + a[i] * s;
            }
        }
}

typedef struct model {
    kvr_store *s;
    kvr_model_info mi;
    uint32_t L, H, D, rot;
    double theta[64];              /* per layer; 0 = no RoPE */
} model;

static void mk(model *m, const char *name, const kvr_rope_config *rc, uint32_t kv_heads)
{
    kvr_error e = { 0 };
    kvr_store_config cfg = { 0 };
    if (!m->s)
        cr_assert_eq(kvr_store_create(&m->s, &cfg, &e), 0);
    kvr_model_desc d = { .name = name, .n_layers = (uint32_t)rc->num_layers,
                         .n_kv_heads = kv_heads, .head_dim = (uint32_t)rc->head_dim,
                         .dtype = KVR_DTYPE_F32, .rope = *rc };
    d.rope.num_kv_heads = (int32_t)kv_heads;
    cr_assert_eq(kvr_store_model_register(m->s, &d, &m->mi, &e), 0, "%s", e.msg);
    m->L = d.n_layers;
    m->H = kv_heads;
    m->D = d.head_dim;
    m->rot = (uint32_t)rc->rotary_dim;
    cr_assert(m->L <= 64);
    for (uint32_t l = 0; l < m->L; l++) {
        kvr_rope_layer_kind k = kvr_rope_config_layer_kind(rc, l);
        m->theta[l] = k == KVR_ROPE_LAYER_LOCAL ? rc->local_theta
                    : k == KVR_ROPE_LAYER_NONE ? 0.0 : rc->theta;
    }
}

/* Pre-RoPE keys E (double, [L][T][H][D]) and the put payload: K = ref(E, pos). */
static double *pre_keys(const model *m)
{
    size_t row = (size_t)m->H * m->D;
    double *E = malloc((size_t)m->L * T * row * sizeof *E);
    for (uint32_t l = 0; l < m->L; l++)
        for (size_t t = 0; t < T; t++)
            for (size_t j = 0; j < row; j++)
                E[((size_t)l * T + t) * row + j] = (double)pre_val(l, 0, t, j);
    return E;
}

static void put_ex(model *m, const char *id, const char *codec, const double *E,
                   const int64_t *pos, const char *prefix)
{
    size_t row = (size_t)m->H * m->D, part = T * row;
    float *pl = malloc((size_t)m->L * 2 * part * sizeof *pl);
    double *k = malloc(part * sizeof *k);
    for (uint32_t l = 0; l < m->L; l++) {
        ref_rotate(k, E + (size_t)l * part, T, m->H, m->D, m->rot, m->theta[l], pos);
        for (size_t i = 0; i < part; i++) {
            pl[(size_t)l * 2 * part + i] = (float)k[i];
            pl[(size_t)l * 2 * part + part + i] = pre_val(l, 1, i / row, i % row);
        }
    }
    uint32_t tok[T];
    for (uint32_t i = 0; i < T; i++)
        tok[i] = 100 + i;
    kvr_put_params p = { .ctx_id = id, .model = m->mi.name, .mode = KVR_PUT_CREATE,
                         .n_layers = m->L, .n_kv_heads = m->H, .head_dim = m->D,
                         .dtype = KVR_DTYPE_F32, .n_tokens = T, .tokens = tok,
                         .positions = pos, .codec = codec, .prefix_ctx = prefix };
    kvt_src src = { pl, (size_t)m->L * 2 * part * sizeof *pl, 0 };
    kvt_put(m->s, &p, kvt_fill_src, &src);
    free(k);
    free(pl);
}

static void put(model *m, const char *id, const char *codec, const double *E,
                const int64_t *pos)
{
    put_ex(m, id, codec, E, pos, NULL);
}

static float *get(model *m, const char *id, const int64_t *targets)
{
    kvr_get_params p = { .ctx_id = id, .end = SIZE_MAX, .dtype = KVR_DTYPE_F32,
                         .positions = targets };
    size_t n;
    return (float *)(void *)kvt_get_payload(m->s, &p, &n, NULL);
}

/* Worst relative error (max abs diff / max abs ref) of every layer's keys
 * against ref(E, to) with the layer's own base. */
static void check_layers(const model *m, const float *got, const double *E, const int64_t *to,
                         double tol, const char *what)
{
    size_t row = (size_t)m->H * m->D, part = T * row;
    double *ref = malloc(part * sizeof *ref);
    for (uint32_t l = 0; l < m->L; l++) {
        ref_rotate(ref, E + (size_t)l * part, T, m->H, m->D, m->rot, m->theta[l], to);
        double md = 0, mr = 0;
        for (size_t i = 0; i < part; i++) {
            double d = fabs((double)got[(size_t)l * 2 * part + i] - ref[i]);
            md = d > md ? d : md;
            mr = fabs(ref[i]) > mr ? fabs(ref[i]) : mr;
        }
        cr_assert(md / mr <= tol, "%s: layer %u (theta %g): relative error %g > %g", what, l,
                  m->theta[l], md / mr, tol);
    }
    free(ref);
}

/* A get of id (at positions at, NULL: as stored) checked against E
 * rotated to want, per layer (check_layers). */
static void get_check(model *m, const char *id, const int64_t *at, const double *E,
                      const int64_t *want, double tol, const char *what)
{
    float *got = get(m, id, at);
    check_layers(m, got, E, want, tol, what);
    free(got);
}

/* Model "gemma3" (one KV head) of shared/configs' gemma3-1b.json. */
static void mk_gemma3(model *m)
{
    kvr_rope_config rc;
    kvr_error err = { 0 };
    const char *path = configs_path("gemma3-1b.json");
    cr_assert_eq(kvr_rope_config_from_file(&rc, path, NULL, &err), 0, "%s: %s",
                 path, err.msg);
    mk(m, "gemma3", &rc, 1);
}

Test(rope_layers, gemma3_every_read_path_uses_the_layers_base)
{
    model m = { 0 };
    mk_gemma3(&m);
    cr_assert_eq(m.theta[0], 10000.0);
    cr_assert_eq(m.theta[5], 1e6);
    double *E = pre_keys(&m);
    int64_t pos[T], to[T];
    for (int i = 0; i < T; i++) {
        pos[i] = i;
        to[i] = i + SHIFT;
    }
    /* plain: stored rotated, re-rotated on read (a shift, then explicit targets) */
    put(&m, "plain", NULL, E, pos);
    get_check(&m, "plain", NULL, E, pos, 1e-6, "plain get at stored positions");
    kvr_error e = { 0 };
    cr_assert_eq(kvr_store_shift(m.s, "plain", 0, T, SHIFT, &e), 0, "%s", e.msg);
    get_check(&m, "plain", NULL, E, to, 2e-6, "plain get after a shift");
    /* quantized at rest: un-rotated at put and rotated at get, per layer */
    put(&m, "q", "int8", E, pos);
    get_check(&m, "q", to, E, to, 2e-2, "int8 get at other positions");
    cr_assert_eq(kvr_store_shift(m.s, "q", 0, T, 7, &e), 0, "%s", e.msg);
    int64_t to7[T];
    for (int i = 0; i < T; i++)
        to7[i] = i + 7;
    get_check(&m, "q", NULL, E, to7, 2e-2, "int8 get after a shift");
    free(E);
    kvr_store_destroy(m.s);
}

/* APE assemble: a document moved to an explicit start rotates per layer. */
Test(rope_layers, gemma3_assemble_uses_the_layers_base)
{
    model m = { 0 };
    mk_gemma3(&m);
    double *E = pre_keys(&m);
    int64_t pos[T], dpos[T], to[T];
    for (int i = 0; i < T; i++) {
        pos[i] = i;
        dpos[i] = T + i;
        to[i] = 700 + i;
    }
    put(&m, "p", NULL, E, pos);
    put_ex(&m, "d", NULL, E, dpos, "p");
    const char *docs[] = { "d" };
    int64_t starts[] = { 700 };
    kvr_assemble_params ap = { .prefix = "p", .docs = docs, .n_docs = 1,
                               .layout = KVR_LAYOUT_EXPLICIT, .starts = starts,
                               .dtype = KVR_DTYPE_F32, .temperature = 1.0, .scale = 1.0 };
    kvr_assemble *a = NULL;
    kvr_error e = { 0 };
    cr_assert_eq(kvr_store_assemble_begin(m.s, &ap, &a, &e), 0, "%s", e.msg);
    if (kvr_assemble_needs_work(a))
        cr_assert_eq(kvr_assemble_work(a, &e), 0, "%s", e.msg);
    size_t n = kvr_assemble_payload_size(a), off = 0, niov;
    const struct iovec *iov;
    kvr_assemble_payload_iov(a, &iov, &niov);
    float *out = malloc(n);
    for (size_t i = 0; i < niov; i++) {
        memcpy((uint8_t *)out + off, iov[i].iov_base, iov[i].iov_len);
        off += iov[i].iov_len;
    }
    kvr_assemble_end(a);
    size_t row = (size_t)m.H * m.D, part = T * row;
    cr_assert_eq(n, (size_t)m.L * 2 * 2 * part * sizeof(float));
    /* the document's keys: stream tokens T..2T-1 of each layer's K */
    float *doc = malloc((size_t)m.L * 2 * part * sizeof *doc);
    for (uint32_t l = 0; l < m.L; l++) {
        memcpy(doc + (size_t)l * 2 * part, out + (size_t)l * 4 * part + part,
               part * sizeof *doc);
        memset(doc + (size_t)l * 2 * part + part, 0, part * sizeof *doc);
    }
    check_layers(&m, doc, E, to, 2e-6, "assembled document at an explicit start");
    /* the prefix did not move */
    for (uint32_t l = 0; l < m.L; l++)
        memcpy(doc + (size_t)l * 2 * part, out + (size_t)l * 4 * part, part * sizeof *doc);
    check_layers(&m, doc, E, pos, 1e-6, "assembled prefix");
    free(doc);
    free(out);
    free(E);
    kvr_store_destroy(m.s);
}

Test(rope_layers, nope_layers_pass_keys_through)
{
    static const char *const cfgs[] = {
        /* Llama 4: every 4th layer has no RoPE (no_rope_layer_interval) */
        "{\"model_type\":\"llama4_text\",\"num_hidden_layers\":8,\"num_attention_heads\":4,"
        "\"num_key_value_heads\":2,\"head_dim\":16,\"rope_theta\":500000}",
        /* Cohere 2: sliding layers rotate, full-attention layers do not */
        "{\"model_type\":\"cohere2\",\"num_hidden_layers\":8,\"num_attention_heads\":4,"
        "\"num_key_value_heads\":2,\"hidden_size\":64,\"rope_theta\":50000,"
        "\"sliding_window_pattern\":4}",
    };
    for (size_t c = 0; c < sizeof cfgs / sizeof *cfgs; c++) {
        kvr_rope_config rc;
        kvr_error err = { 0 };
        cr_assert_eq(kvr_rope_config_from_json(&rc, cfgs[c], strlen(cfgs[c]), "neox", &err),
                     0, "%s", err.msg);
        cr_assert_eq(kvr_rope_config_layer_kind(&rc, 3), KVR_ROPE_LAYER_NONE);
        cr_assert_eq(kvr_rope_config_layer_kind(&rc, 7), KVR_ROPE_LAYER_NONE);
        cr_assert_eq(kvr_rope_config_layer_kind(&rc, 2), KVR_ROPE_LAYER_GLOBAL);
        model m = { 0 };
        mk(&m, "nope", &rc, 2);
        double *E = pre_keys(&m);
        int64_t pos[T], to[T];
        for (int i = 0; i < T; i++) {
            pos[i] = 3 * i;
            to[i] = 5000 + i;
        }
        put(&m, "x", NULL, E, pos);
        float *got = get(&m, "x", to);
        check_layers(&m, got, E, to, 2e-6, "plain get at other positions");
        /* NoPE layer keys: exactly what was put */
        size_t part = (size_t)T * m.H * m.D;
        for (size_t i = 0; i < part; i++)
            cr_assert_eq(got[3 * 2 * part + i], (float)E[3 * part + i]);
        free(got);
        put(&m, "q", "int8", E, pos);
        get_check(&m, "q", to, E, to, 2e-2, "int8 get");
        free(E);
        kvr_store_destroy(m.s);
    }
}

Test(rope_layers, fingerprint_includes_the_layer_map)
{
    const char *a = "{\"model_type\":\"gemma3_text\",\"num_hidden_layers\":6,"
                    "\"num_attention_heads\":2,\"num_key_value_heads\":1,\"head_dim\":16,"
                    "\"rope_theta\":1000000,\"rope_local_base_freq\":10000}";
    const char *b = "{\"model_type\":\"gemma3_text\",\"num_hidden_layers\":6,"
                    "\"num_attention_heads\":2,\"num_key_value_heads\":1,\"head_dim\":16,"
                    "\"rope_theta\":1000000,\"rope_local_base_freq\":20000}";
    const char *c = "{\"model_type\":\"gemma3_text\",\"num_hidden_layers\":6,"
                    "\"num_attention_heads\":2,\"num_key_value_heads\":1,\"head_dim\":16,"
                    "\"rope_theta\":1000000,\"rope_local_base_freq\":10000,"
                    "\"sliding_window_pattern\":3}";
    const char *g = "{\"model_type\":\"gemma\",\"num_hidden_layers\":6,"
                    "\"num_attention_heads\":2,\"num_key_value_heads\":1,\"head_dim\":16,"
                    "\"rope_theta\":1000000}";
    const char *const all[] = { a, b, c, g };
    uint64_t fp[4];
    model m = { 0 };
    for (int i = 0; i < 4; i++) {
        kvr_rope_config rc;
        kvr_error err = { 0 };
        char name[16];
        cr_assert_eq(kvr_rope_config_from_json(&rc, all[i], strlen(all[i]), NULL, &err),
                     0, "%s", err.msg);
        snprintf(name, sizeof name, "m%d", i);
        mk(&m, name, &rc, 1);
        fp[i] = m.mi.fingerprint;
        for (int j = 0; j < i; j++)
            cr_assert_neq(fp[i], fp[j], "configs %d and %d share a fingerprint", i, j);
    }
    /* a layer count other than the map's is refused */
    kvr_rope_config rc;
    cr_assert_eq(kvr_rope_config_from_json(&rc, a, strlen(a), NULL, NULL), 0);
    kvr_model_desc d = { .name = "short", .n_layers = 4, .n_kv_heads = 1, .head_dim = 16,
                         .dtype = KVR_DTYPE_F32, .rope = rc };
    kvr_error e = { 0 };
    cr_assert_eq(kvr_store_model_register(m.s, &d, NULL, &e), KVR_ESHAPE);
    cr_assert(strstr(e.msg, "per-layer"), "%s", e.msg);
    kvr_store_destroy(m.s);
}

/* Dynamic NTK: moved past the original context, keys come out with the
 * table of the target length (removed with the one they were written with). */
Test(rope_layers, dynamic_ntk_get_uses_the_target_length)
{
    const char *js = "{\"model_type\":\"llama\",\"num_hidden_layers\":2,"
                     "\"num_attention_heads\":2,\"num_key_value_heads\":2,\"head_dim\":16,"
                     "\"rope_theta\":10000,\"max_position_embeddings\":64,"
                     "\"rope_scaling\":{\"type\":\"dynamic\",\"factor\":2.0}}";
    kvr_rope_config rc;
    kvr_error err = { 0 };
    cr_assert_eq(kvr_rope_config_from_json(&rc, js, strlen(js), NULL, &err), 0,
                 "%s", err.msg);
    model m = { 0 };
    mk(&m, "dyn", &rc, 2);
    double *E = pre_keys(&m);
    int64_t pos[T], to[T];
    for (int i = 0; i < T; i++) {
        pos[i] = i;
        to[i] = 200 + i;
    }
    put(&m, "d", NULL, E, pos);     /* T = 16 <= 64: the base table */
    float *got = get(&m, "d", to);
    /* HF: base' = base * (factor * L / max - (factor - 1))^(rot / (rot - 2)), L = 216 */
    double Ls = 216.0, base = 10000.0 * pow(2.0 * Ls / 64.0 - 1.0, 16.0 / 14.0);
    for (uint32_t l = 0; l < m.L; l++)
        m.theta[l] = base;
    check_layers(&m, got, E, to, 2e-6, "dynamic get past the original context");
    free(got);
    /* within the original context the table does not change: a delta move */
    int64_t near[T];
    for (int i = 0; i < T; i++)
        near[i] = 40 + i;
    got = get(&m, "d", near);
    for (uint32_t l = 0; l < m.L; l++)
        m.theta[l] = 10000.0;
    check_layers(&m, got, E, near, 2e-6, "dynamic get within the original context");
    free(got);
    free(E);
    kvr_store_destroy(m.s);
}
