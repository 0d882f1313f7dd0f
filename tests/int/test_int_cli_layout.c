/*
 * test_int_cli_layout.c — the kvrope CLI's position-layout commands against
 * a real daemon: put --prefix-ctx, assemble (parallel, sequential,
 * explicit, folded temperature) with --json segment tables and .safetensors
 * / raw streams whose keys are checked against a fresh local rope of the
 * pre-RoPE keys at the layout's positions (within f16 rounding), GPE groups
 * (put --group/--groups, group append, group offset), retain (sinks +
 * window, off), the layout part of stat, and exit codes for daemon
 * refusals, not-found and usage errors.
 *
 * Data: token id t's pre-RoPE key/value in layer l is E(t, l) (seeded by the
 * id, testd_val), so any assembled stream can be recomputed here.
 */
#include <criterion/criterion.h>
#include <cjson/cJSON.h>
#include <math.h>

#include "tests/common/kvt_daemon.h"
#include "tests/common/kvt.h"

/* The suite's daemon, client and tiny model (kvt_daemon.h). */
#define D kvt_suite_d
#define C kvt_suite_c
#define R kvt_suite_r
static char OUT[1 << 18];
static const kvr_dtype DT = KVR_DTYPE_F16;

/* The files the CLI wrote go before the daemon's directory does. */
static void teardown(void)
{
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "rm -f %s/*.raw %s/*.safetensors", D.dir, D.dir);
    if (system(cmd) != 0) {
    }
    kvt_tiny_suite_fini();
}

TestSuite(int_cli_layout, .init = kvt_tiny_suite_init, .fini = teardown, .timeout = 180);

#define CLI(...) KVT_CLI(&D, OUT, __VA_ARGS__)

static double jnum(const cJSON *o, const char *k)
{
    const cJSON *x = cJSON_GetObjectItemCaseSensitive(o, k);
    cr_assert(cJSON_IsNumber(x), "no number '%s'", k);
    return x->valuedouble;
}

static const char *jstr(const cJSON *o, const char *k)
{
    const cJSON *x = cJSON_GetObjectItemCaseSensitive(o, k);
    cr_assert(cJSON_IsString(x), "no string '%s'", k);
    return x->valuestring;
}

static void path(char *buf, size_t cap, const char *name)
{
    snprintf(buf, cap, "%s/%s", D.dir, name);
}

/* ---- the reference ------------------------------------------------------ */

/* Layer-major K|V of tokens tok at positions pos, keys rotated there. */
static void *make_kv(const uint32_t *tok, const int64_t *pos, size_t n, kvr_dtype dt,
                     size_t *len)
{
    return kvt_tiny_kv(R, tok, pos, n, dt, len);
}

static float elem(const uint8_t *p, kvr_dtype dt, size_t i)
{
    if (dt == KVR_DTYPE_F32) {
        float f;
        memcpy(&f, p + 4 * i, 4);
        return f;
    }
    uint16_t u;
    memcpy(&u, p + 2 * i, 2);
    return dt == KVR_DTYPE_F16 ? kvr_f16_to_f32(u) : kvr_bf16_to_f32(u);
}

/* k[l] / v[l]: [n][heads][dim] of layer l in dt. Keys equal
 * rope(E[tok], pos) * kscale[token] within f16 rounding (the stored keys
 * were f16 and are re-rotated once); values within f16 rounding too (exact
 * for an f16 stream). */
static void check_layer(const uint8_t *k, const uint8_t *v, kvr_dtype dt, uint32_t l,
                        const uint32_t *tok, const int64_t *pos, const double *kscale,
                        size_t n)
{
    size_t len;
    uint8_t *want = make_kv(tok, pos, n, KVR_DTYPE_F32, &len);
    const size_t per = (size_t)T_HEADS * T_DIM, half = n * per * 4;
    const uint8_t *wk = want + (size_t)l * 2 * half, *wv = wk + half;
    for (size_t t = 0; t < n; t++)
        for (size_t e = 0; e < per; e++) {
            size_t i = t * per + e;
            double s = kscale ? kscale[t] : 1.0;
            double a = (double)elem(k, dt, i), b = (double)elem(wk, KVR_DTYPE_F32, i) * s;
            cr_assert(fabs(a - b) <= s * (2.0 / 1024.0) + 1e-6,
                      "layer %u token %zu key %zu: %g vs %g", l, t, e, a, b);
            a = (double)elem(v, dt, i);
            b = (double)elem(wv, KVR_DTYPE_F32, i);
            cr_assert(fabs(a - b) <= 1.0 / 1024.0 + 1e-6, "layer %u token %zu value %zu", l, t,
                      e);
        }
    free(want);
}

/* Writes the raw KV of tok at positions p0.. to DIR/name, returns "a,b,c". */
static void raw_file(const char *name, const uint32_t *tok, size_t n, int64_t p0, char *file,
                     size_t fcap, char *ids, size_t icap)
{
    int64_t pos[64];
    cr_assert_leq(n, 64);
    for (size_t i = 0; i < n; i++)
        pos[i] = p0 + (int64_t)i;
    size_t len;
    void *pl = make_kv(tok, pos, n, DT, &len);
    path(file, fcap, name);
    kvt_write_file(file, pl, len);
    free(pl);
    size_t o = 0;
    ids[0] = 0;
    for (size_t i = 0; i < n; i++)
        o += (size_t)snprintf(ids + o, icap - o, "%s%u", i ? "," : "", tok[i]);
}

/* ---- a minimal independent safetensors reader --------------------------- */

typedef struct st_file {
    uint8_t *buf;
    size_t   len;
    cJSON   *hdr;
    const uint8_t *data;
} st_file;

static void st_open(st_file *f, const char *p)
{
    f->buf = kvt_read_file(p, &f->len);
    uint64_t hl;
    cr_assert_geq(f->len, 8);
    memcpy(&hl, f->buf, 8);
    cr_assert_leq(hl + 8, f->len);
    f->hdr = cJSON_ParseWithLength((const char *)f->buf + 8, (size_t)hl);
    cr_assert_not_null(f->hdr);
    f->data = f->buf + 8 + hl;
}

static void st_close(st_file *f)
{
    cJSON_Delete(f->hdr);
    free(f->buf);
}

static const uint8_t *st_get(const st_file *f, const char *name, const char *dtype,
                             const size_t *shape, int ndim)
{
    const cJSON *t = cJSON_GetObjectItemCaseSensitive(f->hdr, name);
    cr_assert_not_null(t, "no tensor %s", name);
    cr_assert_str_eq(jstr(t, "dtype"), dtype, "tensor %s", name);
    const cJSON *sh = cJSON_GetObjectItemCaseSensitive(t, "shape");
    cr_assert_eq(cJSON_GetArraySize(sh), ndim, "tensor %s rank", name);
    for (int i = 0; i < ndim; i++)
        cr_assert_eq((size_t)cJSON_GetArrayItem(sh, i)->valuedouble, shape[i],
                     "tensor %s dim %d", name, i);
    const cJSON *off = cJSON_GetObjectItemCaseSensitive(t, "data_offsets");
    size_t a = (size_t)cJSON_GetArrayItem(off, 0)->valuedouble;
    size_t b = (size_t)cJSON_GetArrayItem(off, 1)->valuedouble;
    cr_assert_leq(b, f->len - (size_t)(f->data - f->buf));
    return f->data + a;
}

static const char *st_meta(const st_file *f, const char *key)
{
    const cJSON *m = cJSON_GetObjectItemCaseSensitive(f->hdr, "__metadata__");
    cr_assert_not_null(m);
    return jstr(m, key);
}

/* ---- fixture: a prefix and two documents put through the CLI ----------- */

static uint32_t PRE[8], D1[6], D2[4];

static void put_prefix_and_docs(void)
{
    kvt_iota(PRE, 8, 10);
    kvt_iota(D1, 6, 100);
    kvt_iota(D2, 4, 200);
    char f[300], ids[300];
    raw_file("pre.raw", PRE, 8, 0, f, sizeof f, ids, sizeof ids);
    cr_assert_eq(CLI("put", "pre", f, "--model", "tiny", "--tokens", ids), 0);
    /* Documents encoded after the prefix: positions default to P = 8. */
    raw_file("d1.raw", D1, 6, 8, f, sizeof f, ids, sizeof ids);
    cr_assert_eq(CLI("put", "d1", f, "--model", "tiny", "--tokens", ids, "--prefix-ctx", "pre",
                     "--json"), 0);
    cJSON *j = kvt_json_out(OUT);
    cr_assert_eq(jnum(j, "first_pos"), 8);
    cr_assert_eq(jnum(j, "last_pos"), 13);
    cJSON_Delete(j);
    raw_file("d2.raw", D2, 4, 8, f, sizeof f, ids, sizeof ids);
    cr_assert_eq(CLI("put", "d2", f, "--model", "tiny", "--tokens", ids, "--prefix-ctx", "pre",
                     "--mode", "create"), 0);
}

/* The stream's tokens: prefix, d1, d2. */
static void stream_tokens(uint32_t *tok)
{
    memcpy(tok, PRE, sizeof PRE);
    memcpy(tok + 8, D1, sizeof D1);
    memcpy(tok + 14, D2, sizeof D2);
}

static void check_segment(const cJSON *segs, int i, const char *kind, const char *ctx,
                          int start, int end, int pos_first, int pos_last, double T, double S)
{
    const cJSON *s = cJSON_GetArrayItem(segs, i);
    cr_assert_not_null(s, "segment %d", i);
    cr_assert_str_eq(jstr(s, "kind"), kind, "segment %d", i);
    if (ctx)
        cr_assert_str_eq(jstr(s, "context_id"), ctx, "segment %d", i);
    else
        cr_assert(cJSON_IsNull(cJSON_GetObjectItem(s, "context_id")), "segment %d", i);
    cr_assert_eq(jnum(s, "start"), start, "segment %d start", i);
    cr_assert_eq(jnum(s, "end"), end, "segment %d end", i);
    cr_assert_eq(jnum(s, "n_tokens"), end - start, "segment %d n_tokens", i);
    cr_assert_eq(jnum(s, "pos_first"), pos_first, "segment %d pos_first", i);
    if (pos_last >= 0)
        cr_assert_eq(jnum(s, "pos_last"), pos_last, "segment %d pos_last", i);
    cr_assert_float_eq(jnum(s, "temperature"), T, 1e-12, "segment %d T", i);
    cr_assert_float_eq(jnum(s, "scale"), S, 1e-12, "segment %d S", i);
}

static void check_positions_json(const cJSON *j, const int64_t *pos, size_t n)
{
    const cJSON *p = cJSON_GetObjectItem(j, "positions");
    cr_assert_eq(cJSON_GetArraySize(p), (int)n);
    for (size_t i = 0; i < n; i++)
        cr_assert_eq((int64_t)cJSON_GetArrayItem(p, (int)i)->valuedouble, pos[i],
                     "position %zu", i);
}

Test(int_cli_layout, assemble_parallel_safetensors)
{
    put_prefix_and_docs();
    cr_assert_eq(CLI("stat", "d1", "--json"), 0);
    cJSON *j = kvt_json_out(OUT);
    const cJSON *lay = cJSON_GetObjectItem(j, "layout");
    cr_assert_not_null(lay);
    const cJSON *pre = cJSON_GetObjectItem(lay, "prefix");
    cr_assert_str_eq(jstr(pre, "context_id"), "pre");
    cr_assert_eq(jnum(pre, "prefix_len"), 8);
    cr_assert(cJSON_IsNull(cJSON_GetObjectItem(lay, "retention")));
    cJSON_Delete(j);
    cr_assert_eq(CLI("stat", "d1"), 0);
    cr_assert(strstr(OUT, "prefix:       pre (P = 8 tokens)") != NULL, "%s", OUT);

    char st[300];
    path(st, sizeof st, "par.safetensors");
    cr_assert_eq(CLI("assemble", "pre", "d1", "d2", "-o", st, "--json"), 0);
    j = kvt_json_out(OUT);
    cr_assert_str_eq(jstr(j, "layout"), "parallel");
    cr_assert_str_eq(jstr(j, "dtype"), "f16");     /* the model's */
    cr_assert_eq(jnum(j, "n_tokens"), 18);
    cr_assert_eq(jnum(j, "query_pos"), 14);
    cr_assert_eq(jnum(j, "prefix_len"), 8);
    cr_assert_float_eq(jnum(j, "temperature"), 0.9, 1e-12);
    cr_assert_float_eq(jnum(j, "scale"), 0.9, 1e-12);
    cr_assert(cJSON_IsFalse(cJSON_GetObjectItem(j, "temperature_folded")));
    const cJSON *segs = cJSON_GetObjectItem(j, "segments");
    cr_assert_eq(cJSON_GetArraySize(segs), 4);
    check_segment(segs, 0, "prefix", "pre", 0, 8, 0, 7, 1, 1);
    check_segment(segs, 1, "document", "d1", 8, 14, 8, 13, 0.9, 0.9);
    check_segment(segs, 2, "document", "d2", 14, 18, 8, 11, 0.9, 0.9);
    check_segment(segs, 3, "query", NULL, 18, 18, 14, -1, 1, 1);
    cr_assert_eq(jnum(cJSON_GetArrayItem(segs, 2), "doc_index"), 1);
    uint32_t tok[18];
    stream_tokens(tok);
    int64_t pos[18];
    for (int i = 0; i < 8; i++)
        pos[i] = i;
    for (int i = 0; i < 6; i++)
        pos[8 + i] = 8 + i;
    for (int i = 0; i < 4; i++)
        pos[14 + i] = 8 + i;
    check_positions_json(j, pos, 18);
    const cJSON *tk = cJSON_GetObjectItem(j, "tokens");
    for (int i = 0; i < 18; i++)
        cr_assert_eq((uint32_t)cJSON_GetArrayItem(tk, i)->valuedouble, tok[i]);
    cJSON_Delete(j);

    /* The file: k, v against a fresh rope at the layout's positions. */
    st_file f;
    st_open(&f, st);
    size_t kshape[4] = { T_LAYERS, 18, T_HEADS, T_DIM };
    const uint8_t *k = st_get(&f, "k", "F16", kshape, 4);
    const uint8_t *v = st_get(&f, "v", "F16", kshape, 4);
    size_t slab = 18 * (size_t)T_HEADS * T_DIM * 2;
    for (uint32_t l = 0; l < T_LAYERS; l++)
        check_layer(k + l * slab, v + l * slab, KVR_DTYPE_F16, l, tok, pos, NULL, 18);
    size_t n1[1] = { 18 };
    const uint8_t *ps = st_get(&f, "positions", "I64", n1, 1);
    for (int i = 0; i < 18; i++) {
        int64_t p;
        memcpy(&p, ps + 8 * i, 8);
        cr_assert_eq(p, pos[i]);
    }
    (void)st_get(&f, "tokens", "I32", n1, 1);
    (void)st_get(&f, "flags", "I32", n1, 1);
    /* The segment table as tensors ... */
    size_t sshape[2] = { 4, 6 }, tshape[2] = { 4, 2 };
    const uint8_t *sg = st_get(&f, "segments", "I64", sshape, 2);
    int64_t rows[4][6];
    memcpy(rows, sg, sizeof rows);
    const int64_t want_rows[4][6] = { { 0, 0, 8, 0, 7, -1 }, { 1, 8, 6, 8, 13, 0 },
                                      { 1, 14, 4, 8, 11, 1 }, { 2, 18, 0, 14, rows[3][4], -1 } };
    cr_assert(memcmp(rows, want_rows, sizeof rows) == 0, "segments tensor");
    const uint8_t *tsd = st_get(&f, "segment_ts", "F64", tshape, 2);
    double ts[4][2];
    memcpy(ts, tsd, sizeof ts);
    cr_assert_float_eq(ts[0][0], 1.0, 1e-12);
    cr_assert_float_eq(ts[1][0], 0.9, 1e-12);
    cr_assert_float_eq(ts[2][1], 0.9, 1e-12);
    cr_assert_float_eq(ts[3][1], 1.0, 1e-12);
    /* ... and as metadata. */
    cr_assert_str_eq(st_meta(&f, "kind"), "assemble");
    cr_assert_str_eq(st_meta(&f, "layout"), "parallel");
    cr_assert_str_eq(st_meta(&f, "query_pos"), "14");
    cr_assert_str_eq(st_meta(&f, "prefix_len"), "8");
    cr_assert_str_eq(st_meta(&f, "temperature_folded"), "false");
    cr_assert_str_eq(st_meta(&f, "documents"), "[\"d1\",\"d2\"]");
    cJSON *ms = cJSON_Parse(st_meta(&f, "segments"));
    cr_assert(cJSON_IsArray(ms));
    check_segment(ms, 2, "document", "d2", 14, 18, 8, 11, 0.9, 0.9);
    cJSON_Delete(ms);
    st_close(&f);

    /* Human output: one line per segment and the query position. */
    cr_assert_eq(CLI("assemble", "pre", "d1", "d2", "--meta"), 0);
    cr_assert(strstr(OUT, "document  d2") != NULL, "%s", OUT);
    cr_assert(strstr(OUT, "query starts at position 14") != NULL, "%s", OUT);
}

Test(int_cli_layout, assemble_sequential_explicit_folded)
{
    put_prefix_and_docs();
    uint32_t tok[18];
    stream_tokens(tok);
    int64_t pos[18];
    for (int i = 0; i < 18; i++)
        pos[i] = i;

    /* Sequential, T = 0.5, f32, raw file. */
    char raw[300];
    path(raw, sizeof raw, "seq.raw");
    cr_assert_eq(CLI("assemble", "pre", "d1", "d2", "--layout", "sequential", "--temperature",
                     "0.5", "--scale", "0.8", "--dtype", "f32", "-o", raw, "--json"), 0);
    cJSON *j = kvt_json_out(OUT);
    cr_assert_str_eq(jstr(j, "layout"), "sequential");
    cr_assert_eq(jnum(j, "query_pos"), 18);
    const cJSON *segs = cJSON_GetObjectItem(j, "segments");
    check_segment(segs, 1, "document", "d1", 8, 14, 8, 13, 0.5, 0.8);
    check_segment(segs, 2, "document", "d2", 14, 18, 14, 17, 0.5, 0.8);
    check_segment(segs, 3, "query", NULL, 18, 18, 18, -1, 1, 1);
    check_positions_json(j, pos, 18);
    const cJSON *fl = cJSON_GetObjectItem(j, "flags");
    for (int i = 0; i < 18; i++) {
        bool approx = ((uint32_t)cJSON_GetArrayItem(fl, i)->valuedouble & KVR_TOKEN_APPROX) != 0;
        cr_assert_eq(approx, i >= 14, "flag of token %d", i);
    }
    cJSON_Delete(j);
    size_t len;
    uint8_t *b = kvt_read_file(raw, &len);
    cr_assert_eq(len, kvr_payload_size(T_LAYERS, 18, T_HEADS, T_DIM, KVR_DTYPE_F32));
    size_t half = len / T_LAYERS / 2;
    for (uint32_t l = 0; l < T_LAYERS; l++)
        check_layer(b + 2 * l * half, b + (2 * l + 1) * half, KVR_DTYPE_F32, l, tok, pos, NULL,
                    18);
    free(b);

    /* Explicit starts (implied by --starts), folded temperature, one layer. */
    char st[300];
    path(st, sizeof st, "exp.safetensors");
    cr_assert_eq(CLI("assemble", "pre", "d1", "d2", "--starts", "20,40", "--temperature", "0.5",
                     "--fold-temperature", "--layers", "1", "-o", st, "--json"), 0);
    j = kvt_json_out(OUT);
    cr_assert_str_eq(jstr(j, "layout"), "explicit");
    cr_assert(cJSON_IsTrue(cJSON_GetObjectItem(j, "temperature_folded")));
    cr_assert_eq(jnum(j, "query_pos"), 44);
    segs = cJSON_GetObjectItem(j, "segments");
    check_segment(segs, 1, "document", "d1", 8, 14, 20, 25, 0.5, 0.9);
    check_segment(segs, 2, "document", "d2", 14, 18, 40, 43, 0.5, 0.9);
    for (int i = 0; i < 6; i++)
        pos[8 + i] = 20 + i;
    for (int i = 0; i < 4; i++)
        pos[14 + i] = 40 + i;
    check_positions_json(j, pos, 18);
    cJSON_Delete(j);
    double ks[18];
    for (int i = 0; i < 18; i++)
        ks[i] = i < 8 ? 1.0 : 2.0;   /* document keys are k / T */
    st_file f;
    st_open(&f, st);
    size_t kshape[4] = { 1, 18, T_HEADS, T_DIM };
    const uint8_t *k = st_get(&f, "k", "F16", kshape, 4);
    const uint8_t *v = st_get(&f, "v", "F16", kshape, 4);
    check_layer(k, v, KVR_DTYPE_F16, 1, tok, pos, ks, 18);
    cr_assert_str_eq(st_meta(&f, "temperature_folded"), "true");
    cr_assert_str_eq(st_meta(&f, "layout"), "explicit");
    st_close(&f);
}

Test(int_cli_layout, assemble_bad_input)
{
    put_prefix_and_docs();
    char f[300], ids[300];
    raw_file("pre2.raw", PRE, 8, 0, f, sizeof f, ids, sizeof ids);
    cr_assert_eq(CLI("put", "pre2", f, "--model", "tiny", "--tokens", ids), 0);
    raw_file("d3.raw", D2, 4, 8, f, sizeof f, ids, sizeof ids);
    cr_assert_eq(CLI("put", "d3", f, "--model", "tiny", "--tokens", ids, "--prefix-ctx", "pre2"),
                 0);
    /* A document of another prefix: the daemon refuses (1), naming it. */
    cr_assert_eq(CLI("assemble", "pre", "d1", "d3", "--meta", "--json"), 1);
    cJSON *j = kvt_json_out(OUT);
    const cJSON *e = cJSON_GetObjectItem(j, "error");
    cr_assert_str_eq(jstr(e, "name"), "KVR_EPREFIX");
    cr_assert(strstr(jstr(e, "message"), "d3") != NULL, "%s", jstr(e, "message"));
    cJSON_Delete(j);
    /* A prefix created without --prefix-ctx is not a document of anything. */
    cr_assert_eq(CLI("assemble", "pre", "d1", "pre2", "--meta"), 1);
    /* Unknown document or prefix: not found (3), as every unknown context. */
    cr_assert_eq(CLI("assemble", "pre", "d1", "nope", "--meta", "--json"), 3);
    j = kvt_json_out(OUT);
    e = cJSON_GetObjectItem(j, "error");
    cr_assert_str_eq(jstr(e, "name"), "KVR_ENOCTX");
    cr_assert(strstr(jstr(e, "message"), "nope") != NULL, "%s", jstr(e, "message"));
    cJSON_Delete(j);
    cr_assert_eq(CLI("assemble", "nope", "d1", "--meta", "--dtype", "f16"), 3);
    cr_assert_eq(CLI("assemble", "nope", "d1", "--meta"), 3);
    /* Putting a document against a missing prefix. */
    cr_assert_eq(CLI("put", "d4", f, "--model", "tiny", "--tokens", ids, "--prefix-ctx", "zz"),
                 3);
    /* Usage errors: 2, nothing sent. */
    cr_assert_eq(CLI("assemble", "pre", "--meta"), 2);
    cr_assert_eq(CLI("assemble", "pre", "d1"), 2);
    cr_assert_eq(CLI("assemble", "pre", "d1", "--meta", "--layout", "diagonal"), 2);
    cr_assert_eq(CLI("assemble", "pre", "d1", "d2", "--meta", "--starts", "1"), 2);
    cr_assert_eq(CLI("assemble", "pre", "d1", "--meta", "--layout", "sequential", "--starts",
                     "9"), 2);
    cr_assert_eq(CLI("assemble", "pre", "d1", "--meta", "--layout", "explicit"), 2);
    cr_assert_eq(CLI("assemble", "pre", "d1", "--meta", "--temperature", "-1"), 2);
    cr_assert_eq(CLI("assemble", "pre", "d1", "--meta", "--scale", "x"), 2);
    cr_assert_eq(CLI("assemble", "pre", "d1", "--meta", "--dtype", "f64"), 2);
    cr_assert_eq(CLI("assemble", "pre", "d1", "-o", "-", "--json"), 2);
    cr_assert_eq(CLI("assemble", "pre", "d1", "--meta", "--fold-temperature=1"), 2);
    /* Nothing changed: the good assemble still works. */
    cr_assert_eq(CLI("assemble", "pre", "d1", "d2", "--meta", "--json"), 0);
    cr_assert_eq(kvr_client_ping(C, NULL), 0);
}

Test(int_cli_layout, groups)
{
    uint32_t s1[] = { 1, 2, 3 }, t1[] = { 50, 51 }, s2[] = { 4, 5 };
    char f[300], ids[300];
    /* Create with groups src (phi 0) and tgt (phi 100), the first tokens in src. */
    raw_file("s1.raw", s1, 3, 0, f, sizeof f, ids, sizeof ids);
    cr_assert_eq(CLI("put", "g", f, "--model", "tiny", "--tokens", ids, "--group", "src",
                     "--groups", "src,tgt:100", "--json"), 0);
    cJSON *j = kvt_json_out(OUT);
    cr_assert_eq(jnum(j, "first_pos"), 0);
    cr_assert_eq(jnum(j, "last_pos"), 2);
    cJSON_Delete(j);
    raw_file("t1.raw", t1, 2, 100, f, sizeof f, ids, sizeof ids);
    cr_assert_eq(CLI("group", "append", "g", "tgt", f, "--model", "tiny", "--tokens", ids,
                     "--json"), 0);
    j = kvt_json_out(OUT);
    cr_assert_eq(jnum(j, "first_pos"), 100);
    cr_assert_eq(jnum(j, "last_pos"), 101);
    cJSON_Delete(j);
    raw_file("s2.raw", s2, 2, 3, f, sizeof f, ids, sizeof ids);
    cr_assert_eq(CLI("put", "g", f, "--model", "tiny", "--tokens", ids, "--group", "src"), 0);
    cr_assert(strstr(OUT, "positions 3..4") != NULL, "%s", OUT);

    cr_assert_eq(CLI("stat", "g", "--json"), 0);
    j = kvt_json_out(OUT);
    const cJSON *gs = cJSON_GetObjectItem(cJSON_GetObjectItem(j, "layout"), "groups");
    cr_assert_eq(cJSON_GetArraySize(gs), 2);
    const cJSON *g0 = cJSON_GetArrayItem(gs, 0), *g1 = cJSON_GetArrayItem(gs, 1);
    cr_assert_str_eq(jstr(g0, "name"), "src");
    cr_assert_eq(jnum(g0, "id"), 0);
    cr_assert_eq(jnum(g0, "offset"), 0);
    cr_assert_eq(jnum(g0, "cursor"), 5);
    cr_assert_eq(jnum(g0, "n_tokens"), 5);
    cr_assert_str_eq(jstr(g1, "name"), "tgt");
    cr_assert_eq(jnum(g1, "offset"), 100);
    cr_assert_eq(jnum(g1, "cursor"), 2);
    cJSON_Delete(j);

    /* Move tgt to phi = -7 (a negative positional). */
    cr_assert_eq(CLI("group", "offset", "g", "tgt", "-7", "--json"), 0);
    j = kvt_json_out(OUT);
    gs = cJSON_GetObjectItem(cJSON_GetObjectItem(j, "layout"), "groups");
    cr_assert_eq(jnum(cJSON_GetArrayItem(gs, 1), "offset"), -7);
    cJSON_Delete(j);
    cr_assert_eq(CLI("stat", "g"), 0);
    cr_assert(strstr(OUT, "tgt") != NULL && strstr(OUT, "offset -7") != NULL, "%s", OUT);

    /* Keys: tgt's tokens moved from 100.. to -7.., the others untouched. */
    kvr_get_args g = { .ctx_id = "g", .dtype = KVR_DTYPE_F32 };
    kvr_kv kv;
    cr_assert_eq(kvr_client_get(C, &g, &kv), 0, "%s", kvr_client_last_error(C));
    uint32_t tok[] = { 1, 2, 3, 50, 51, 4, 5 };
    int64_t pos[] = { 0, 1, 2, -7, -6, 3, 4 };
    int32_t grp[] = { 0, 0, 0, 1, 1, 0, 0 };
    cr_assert_eq(kv.n_tokens, 7);
    for (int i = 0; i < 7; i++) {
        cr_assert_eq(kv.tokens[i], tok[i]);
        cr_assert_eq(kv.positions[i], pos[i], "position %d", i);
        cr_assert_eq(kv.groups[i], grp[i], "group %d", i);
    }
    for (uint32_t l = 0; l < T_LAYERS; l++)
        check_layer(kvr_kv_k(&kv, l), kvr_kv_v(&kv, l), KVR_DTYPE_F32, l, tok, pos, NULL, 7);
    kvr_kv_release(&kv);

    /* Refusals: unknown group (1), no such context (3), usage (2). */
    cr_assert_eq(CLI("group", "offset", "g", "nope", "1", "--json"), 1);
    j = kvt_json_out(OUT);
    cr_assert_str_eq(jstr(cJSON_GetObjectItem(j, "error"), "name"), "KVR_EINVAL");
    cJSON_Delete(j);
    cr_assert_eq(CLI("group", "append", "g", "nope", f, "--model", "tiny", "--tokens", ids), 1);
    cr_assert_eq(CLI("put", "g", f, "--model", "tiny", "--tokens", ids), 1);  /* names no group */
    cr_assert_eq(CLI("group", "offset", "zz", "src", "1"), 3);
    cr_assert_eq(CLI("group", "offset", "g", "src", "x"), 2);
    cr_assert_eq(CLI("group", "offset", "g", "src"), 2);
    cr_assert_eq(CLI("group", "frob", "g"), 2);
    cr_assert_eq(CLI("group"), 2);
    cr_assert_eq(CLI("group", "append", "g", "src", f, "--group", "tgt"), 2);
    cr_assert_eq(CLI("put", "g2", f, "--model", "tiny", "--tokens", ids, "--groups", "a,b"), 2);
    cr_assert_eq(CLI("put", "g2", f, "--model", "tiny", "--tokens", ids, "--group", "a",
                     "--groups", "a,b:x"), 2);
    cr_assert_eq(CLI("put", "g2", f, "--model", "tiny", "--tokens", ids, "--group", "a",
                     "--groups", "a,,b"), 2);
    cr_assert_eq(CLI("put", "g2", f, "--model", "tiny", "--tokens", ids, "--group", "a",
                     "--pos-start", "3"), 2);
    cr_assert_eq(CLI("stat", "g2"), 3);   /* none of those created it */
}

Test(int_cli_layout, retain)
{
    uint32_t tok[10];
    for (uint32_t i = 0; i < 10; i++)
        tok[i] = 700 + i;
    char f[300], ids[300];
    raw_file("w.raw", tok, 10, 0, f, sizeof f, ids, sizeof ids);
    cr_assert_eq(CLI("put", "w", f, "--model", "tiny", "--tokens", ids), 0);
    cr_assert_eq(CLI("retain", "w", "--sinks", "2", "--window", "4", "--json"), 0);
    cJSON *j = kvt_json_out(OUT);
    const cJSON *r = cJSON_GetObjectItem(cJSON_GetObjectItem(j, "layout"), "retention");
    cr_assert_eq(jnum(r, "sinks"), 2);
    cr_assert_eq(jnum(r, "window"), 4);
    cr_assert_eq(jnum(r, "n_dropped"), 4);
    cJSON_Delete(j);
    cr_assert_eq(CLI("get", "w", "--meta", "--json"), 0);
    j = kvt_json_out(OUT);
    uint32_t kept[] = { 700, 701, 706, 707, 708, 709 };
    int64_t pos[] = { 0, 1, 2, 3, 4, 5 };
    check_positions_json(j, pos, 6);
    const cJSON *tk = cJSON_GetObjectItem(j, "tokens");
    for (int i = 0; i < 6; i++)
        cr_assert_eq((uint32_t)cJSON_GetArrayItem(tk, i)->valuedouble, kept[i]);
    cJSON_Delete(j);
    /* Keys of the window re-positioned right after the sinks. */
    kvr_get_args g = { .ctx_id = "w", .dtype = KVR_DTYPE_F32 };
    kvr_kv kv;
    cr_assert_eq(kvr_client_get(C, &g, &kv), 0, "%s", kvr_client_last_error(C));
    for (uint32_t l = 0; l < T_LAYERS; l++)
        check_layer(kvr_kv_k(&kv, l), kvr_kv_v(&kv, l), KVR_DTYPE_F32, l, kept, pos, NULL, 6);
    kvr_kv_release(&kv);

    /* A later put slides the window; stat shows the policy. */
    uint32_t more[] = { 800, 801 };
    raw_file("more.raw", more, 2, 6, f, sizeof f, ids, sizeof ids);
    cr_assert_eq(CLI("put", "w", f, "--model", "tiny", "--tokens", ids), 0);
    cr_assert_eq(CLI("get", "w", "--meta", "--json"), 0);
    j = kvt_json_out(OUT);
    uint32_t kept2[] = { 700, 701, 708, 709, 800, 801 };
    tk = cJSON_GetObjectItem(j, "tokens");
    cr_assert_eq(cJSON_GetArraySize(tk), 6);
    for (int i = 0; i < 6; i++)
        cr_assert_eq((uint32_t)cJSON_GetArrayItem(tk, i)->valuedouble, kept2[i]);
    check_positions_json(j, pos, 6);
    cJSON_Delete(j);
    cr_assert_eq(CLI("stat", "w"), 0);
    cr_assert(strstr(OUT, "retention:    sinks 2, window 4 (6 tokens dropped") != NULL, "%s",
              OUT);

    cr_assert_eq(CLI("retain", "w", "--off", "--json"), 0);
    j = kvt_json_out(OUT);
    cr_assert(cJSON_IsNull(cJSON_GetObjectItem(cJSON_GetObjectItem(j, "layout"), "retention")));
    cJSON_Delete(j);
    cr_assert_eq(CLI("retain", "w", "--off"), 0);
    cr_assert(strstr(OUT, "retention:    off") != NULL, "%s", OUT);

    /* Refusals and usage. */
    cr_assert_eq(CLI("retain", "nope", "--window", "3"), 3);
    cr_assert_eq(CLI("retain", "w", "--window", "0", "--json"), 1);
    cr_assert_eq(CLI("retain", "w"), 2);
    cr_assert_eq(CLI("retain", "w", "--sinks", "2"), 2);
    cr_assert_eq(CLI("retain", "w", "--off", "--window", "3"), 2);
    cr_assert_eq(CLI("retain", "w", "--window", "-3"), 2);
    cr_assert_eq(CLI("retain", "--window", "3"), 2);
    cr_assert_eq(CLI("--help"), 0);
    cr_assert(strstr(OUT, "assemble PREFIX DOC...") != NULL);
    cr_assert(strstr(OUT, "retain CTX") != NULL);
    cr_assert(strstr(OUT, "segments I64 [n][6]") != NULL);
}
