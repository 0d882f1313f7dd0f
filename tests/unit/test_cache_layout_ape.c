/*
 * test_cache_layout_ape.c — assemble (APE) at the store level: for every
 * RoPE family of shared/vectors/rope/manifest.json and every layout, the
 * assembled keys equal a fresh rope of the pre-RoPE keys at the layout's
 * positions; exact segment tables, positions and flags; a reference APE
 * attention from the stream and its segment table (T = S = 1 is ordinary
 * softmax attention; folded temperature gives the same output); refusals.
 */
#include <criterion/criterion.h>
#include <cjson/cJSON.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cache/cache.h"
#include "tests/common/kvt.h"
#include "tests/common/kvt_store.h"
#include "tests/common/kvt_vectors.h"

#define NL 2
#define MAXD 256

typedef struct fam {
    kvr_store     *s;
    kvr_model_info mi;
    size_t         H, D;
    const float   *x;      /* [32][H][D] pre-RoPE keys (layer l: x * 2^-l) */
    double         tol;
} fam;

static float xk(const fam *f, uint32_t uid, uint32_t l, size_t j)
{
    return f->x[(size_t)uid * f->H * f->D + j] * (l ? 0.5f : 1.0f);
}

static float xv(uint32_t uid, uint32_t l, size_t j)
{
    return (float)((int)((uid * 31u + l * 7u + (uint32_t)j * 13u) % 61u) - 30) / 8.0f;
}

static void key_at(const fam *f, uint32_t uid, uint32_t l, int64_t pos, float *out)
{
    float x[MAXD * 2];
    for (size_t j = 0; j < f->H * f->D; j++)
        x[j] = xk(f, uid, l, j);
    cr_assert_eq(kvr_rope_apply(f->mi.engine, out, KVR_DTYPE_F32, x, KVR_DTYPE_F32, 1, f->H,
                                &pos, NULL), 0);
}

static int put_doc(const fam *f, const char *id, const char *prefix, uint32_t uid0,
                   size_t n, int64_t pos0, kvr_error *e)
{
    uint32_t u[64];
    for (size_t i = 0; i < n; i++)
        u[i] = uid0 + (uint32_t)i;
    kvr_put_params p = { .ctx_id = id, .model = f->mi.name, .mode = KVR_PUT_CREATE,
                         .n_layers = NL, .n_kv_heads = (uint32_t)f->H,
                         .head_dim = (uint32_t)f->D, .dtype = KVR_DTYPE_F32,
                         .n_tokens = n, .tokens = u, .prefix_ctx = prefix };
    size_t row = f->H * f->D;
    float *pl = malloc(NL * 2 * n * row * sizeof *pl);
    for (uint32_t l = 0; l < NL; l++) {
        float *k = pl + (size_t)l * 2 * n * row, *v = k + n * row;
        for (size_t i = 0; i < n; i++) {
            key_at(f, u[i], l, pos0 + (int64_t)i, k + i * row);
            for (size_t j = 0; j < row; j++)
                v[i * row + j] = xv(u[i], l, j);
        }
    }
    kvt_src src = { pl, NL * 2 * n * row * sizeof *pl, 0 };
    kvr_put_result r;
    int rc = kvt_put_try(f->s, &p, kvt_fill_src, &src, &r, e);
    free(pl);
    if (rc == 0)
        cr_assert_eq(r.first_pos, pos0, "%s stored at %lld, not %lld", id,
                     (long long)r.first_pos, (long long)pos0);
    return rc;
}

/* Runs an assemble and returns its payload as floats (caller frees). */
static float *run(const fam *f, const kvr_assemble_params *p, kvr_assemble **out)
{
    kvr_error e = { 0 };
    int rc = kvr_store_assemble_begin(f->s, p, out, &e);
    cr_assert_eq(rc, 0, "%s", e.msg);
    if (kvr_assemble_needs_work(*out))
        cr_assert_eq(kvr_assemble_work(*out, &e), 0, "%s", e.msg);
    size_t bytes = kvr_assemble_payload_size(*out), off = 0, niov;
    char *pl = malloc(bytes ? bytes : 1);
    const struct iovec *iov;
    kvr_assemble_payload_iov(*out, &iov, &niov);
    for (size_t i = 0; i < niov; i++) {
        memcpy(pl + off, iov[i].iov_base, iov[i].iov_len);
        off += iov[i].iov_len;
    }
    cr_assert_eq(off, bytes);
    return (float *)(void *)pl;
}

/* Prefix uids 0..5 at 0..5; documents A (6..17), B (18..27), C (28..31),
 * each encoded at P = 6. */
#define P 6
static const char *const DOCS[3] = { "A", "B", "C" };
static const uint32_t DU[3] = { 6, 18, 28 };
static const size_t DL[3] = { 12, 10, 4 };

static void build(fam *f)
{
    kvr_error e = { 0 };
    cr_assert_eq(put_doc(f, "pre", NULL, 0, P, 0, &e), 0, "%s", e.msg);
    for (int i = 0; i < 3; i++)
        cr_assert_eq(put_doc(f, DOCS[i], "pre", DU[i], DL[i], P, &e), 0, "%s", e.msg);
}

static void check_layout(fam *f, kvr_layout_kind kind, const int64_t *starts)
{
    kvr_assemble_params p = { .prefix = "pre", .docs = DOCS, .n_docs = 3, .layout = kind,
                              .starts = starts, .dtype = KVR_DTYPE_F32 };
    kvr_assemble *t = NULL;
    float *pl = run(f, &p, &t);
    const kvr_assemble_info *in = kvr_assemble_get_info(t);
    size_t N = P + 12 + 10 + 4, row = f->H * f->D;
    cr_assert_eq(in->n_tokens, N);
    cr_assert_eq(in->n_segments, 5);
    cr_assert_eq(in->prefix_len, P);
    /* Expected positions and segment table. */
    int64_t st[3], q = P, cur = P;
    for (int i = 0; i < 3; i++) {
        st[i] = kind == KVR_LAYOUT_PARALLEL ? P : kind == KVR_LAYOUT_SEQUENTIAL ? cur
                                                                                : starts[i];
        cur = st[i] + (int64_t)DL[i];
        if (cur > q)
            q = cur;
    }
    const kvr_segment *sg = in->segments;
    cr_assert_eq(sg[0].kind, KVR_SEGMENT_PREFIX);
    cr_assert_eq(sg[0].start, 0);
    cr_assert_eq(sg[0].n_tokens, P);
    cr_assert_eq(sg[0].pos_first, 0);
    cr_assert_eq(sg[0].pos_last, P - 1);
    cr_assert_str_eq(sg[0].ctx_id, "pre");
    cr_assert_eq(sg[0].temperature, 1.0);
    size_t tok = P;
    for (int i = 0; i < 3; i++) {
        const kvr_segment *d = &sg[1 + i];
        cr_assert_eq(d->kind, KVR_SEGMENT_DOCUMENT);
        cr_assert_eq(d->start, tok);
        cr_assert_eq(d->n_tokens, DL[i]);
        cr_assert_eq(d->pos_first, st[i]);
        cr_assert_eq(d->pos_last, st[i] + (int64_t)DL[i] - 1);
        cr_assert_eq(d->doc_index, (uint32_t)i);
        cr_assert_str_eq(d->ctx_id, DOCS[i]);
        cr_assert_eq(d->temperature, KVR_APE_TEMPERATURE);
        cr_assert_eq(d->scale, KVR_APE_SCALE);
        tok += DL[i];
    }
    cr_assert_eq(sg[4].kind, KVR_SEGMENT_QUERY);
    cr_assert_eq(sg[4].start, N);
    cr_assert_eq(sg[4].n_tokens, 0);
    cr_assert_eq(sg[4].pos_first, q);
    cr_assert_eq(in->query_pos, q);
    /* Per token: id, position, flag, key = rope(x, position), value exact. */
    for (uint32_t l = 0; l < NL; l++) {
        const float *k = pl + (size_t)l * 2 * N * row, *v = k + N * row;
        size_t i = 0;
        for (int sgi = 0; sgi < 4; sgi++) {
            uint32_t u0 = sgi == 0 ? 0 : DU[sgi - 1];
            int64_t p0 = sgi == 0 ? 0 : st[sgi - 1];
            for (size_t j = 0; j < sg[sgi].n_tokens; j++, i++) {
                int64_t pos = p0 + (int64_t)j;
                cr_assert_eq(in->tokens[i], u0 + j);
                cr_assert_eq(in->positions[i], pos);
                bool moved = sgi > 0 && p0 != P;
                cr_assert_eq(in->flags[i], moved ? KVR_TOKEN_APPROX : 0u,
                             "token %zu flags %u", i, in->flags[i]);
                float want[MAXD * 2];
                key_at(f, u0 + (uint32_t)j, l, pos, want);
                for (size_t d = 0; d < row; d++) {
                    cr_assert(fabs((double)k[i * row + d] - (double)want[d]) <= f->tol,
                              "layer %u token %zu dim %zu pos %lld: %g vs %g (tol %g)", l,
                              i, d, (long long)pos, (double)k[i * row + d],
                              (double)want[d], f->tol);
                    cr_assert_eq(v[i * row + d], xv(u0 + (uint32_t)j, l, d));
                }
            }
        }
    }
    free(pl);
    kvr_assemble_end(t);
}

Test(layout_ape, every_family_every_layout_keys_exact)
{
    char path[1024];
    cJSON *m = kvt_rope_manifest();
    const cJSON *c;
    int n_cases = 0;
    cJSON_ArrayForEach(c, cJSON_GetObjectItem(m, "cases")) {
        fam f = { 0 };
        const char *name = cJSON_GetObjectItem(c, "name")->valuestring;
        f.H = (size_t)cJSON_GetObjectItem(c, "n_heads")->valueint;
        f.D = (size_t)cJSON_GetObjectItem(c, "head_dim")->valueint;
        f.tol = cJSON_GetObjectItem(c, "tolerance_abs")->valuedouble;
        cr_assert_leq(f.H * f.D, 2 * MAXD);
        kvr_model_desc d = { .name = name, .n_layers = NL, .n_kv_heads = (uint32_t)f.H,
                             .head_dim = (uint32_t)f.D, .dtype = KVR_DTYPE_F32 };
        kvt_rope_case_config(c, (double)f.H, &d.rope);
        snprintf(path, sizeof path, "%s/rope/%s", kvt_vectors_dir(),
                 cJSON_GetObjectItem(cJSON_GetObjectItem(c, "files"), "x")->valuestring);
        size_t xl;
        char *x = kvt_slurp(path, &xl);
        cr_assert(x && xl >= 32 * f.H * f.D * 4, "%s", path);
        f.x = (const float *)(void *)x;
        kvr_store_config sc = { .block_tokens = 16 };
        kvr_error e = { 0 };
        cr_assert_eq(kvr_store_create(&f.s, &sc, &e), 0);
        cr_assert_eq(kvr_store_model_register(f.s, &d, &f.mi, &e), 0, "%s: %s", name, e.msg);
        build(&f);
        check_layout(&f, KVR_LAYOUT_PARALLEL, NULL);
        check_layout(&f, KVR_LAYOUT_SEQUENTIAL, NULL);
        int64_t starts[3] = { 40, P, 1000 };
        check_layout(&f, KVR_LAYOUT_EXPLICIT, starts);
        kvr_store_stats st;
        kvr_store_get_stats(f.s, &st);
        cr_assert_eq(st.n_leased_blocks, 0);
        kvr_store_destroy(f.s);
        free(x);
        n_cases++;
    }
    cr_assert_geq(n_cases, 6);
    cJSON_Delete(m);
}

/* ---- APE reference attention ------------------------------------------- */

/* A small NeoX model with random-ish x. */
static float XS[32 * 2 * 16];

static void small(fam *f)
{
    for (size_t i = 0; i < sizeof XS / sizeof *XS; i++)
        XS[i] = (float)((int)((i * 2654435761u) >> 7) % 97 - 48) / 24.0f;
    f->H = 2;
    f->D = 16;
    f->x = XS;
    f->tol = 1e-4;
    kvr_store_config sc = { .block_tokens = 8 };
    kvr_error e = { 0 };
    cr_assert_eq(kvr_store_create(&f->s, &sc, &e), 0);
    kvr_model_desc d = { .name = "m", .n_layers = NL, .n_kv_heads = 2, .head_dim = 16,
                         .dtype = KVR_DTYPE_F32 };
    kvr_rope_config_init(&d.rope);
    cr_assert_eq(kvr_store_model_register(f->s, &d, &f->mi, &e), 0, "%s", e.msg);
}

/* APE for one query vector q (head h, layer l) over the stream plus one
 * query token (qk, qv) at the query position, exactly as docs/ape.md says:
 * document ("context") logits / T, their block's log-sum-exp times S*T,
 * combined with the prefix + query block by a softmax over the two LSEs.
 * With folded keys the document logits are already divided by T. */
static void ape_ref(const kvr_assemble_info *in, const float *pl, size_t H, size_t D,
                    uint32_t l, size_t h, const float *q, const float *qk, const float *qv,
                    bool folded, double *out)
{
    size_t N = in->n_tokens, row = H * D;
    const float *K = pl + (size_t)l * 2 * N * row, *V = K + N * row;
    double lse[2] = { -(double)INFINITY, -(double)INFINITY };    /* 0: documents, 1: the rest */
    double acc[2][MAXD] = { { 0 } };
    double isd = 1.0 / sqrt((double)D);
    for (size_t sgi = 0; sgi < in->n_segments; sgi++) {
        const kvr_segment *sg = &in->segments[sgi];
        int b = sg->kind == KVR_SEGMENT_DOCUMENT ? 0 : 1;
        double T = sg->temperature;
        size_t n = sg->kind == KVR_SEGMENT_QUERY ? 1 : sg->n_tokens;
        for (size_t j = 0; j < n; j++) {
            const float *k = sg->kind == KVR_SEGMENT_QUERY ? qk : K + (sg->start + j) * row + h * D;
            const float *v = sg->kind == KVR_SEGMENT_QUERY ? qv : V + (sg->start + j) * row + h * D;
            double dot = 0;
            for (size_t d = 0; d < D; d++)
                dot += (double)q[d] * (double)k[d];
            double lg = dot * isd / ((b == 0 && !folded) ? T : 1.0);
            /* online softmax accumulation */
            double mx = lse[b] > lg ? lse[b] : lg;
            double a = exp(lse[b] - mx), w = exp(lg - mx);
            for (size_t d = 0; d < D; d++)
                acc[b][d] = acc[b][d] * a + w * (double)v[d];
            lse[b] = mx + log(a + w);
            for (size_t d = 0; d < D; d++)
                acc[b][d] /= (a + w);
            (void)0;
        }
    }
    /* Scale the documents' LSE by S*T (same S, T on every document here). */
    double S = in->scale, T = in->temperature;
    double l0 = lse[0] * S * T, l1 = lse[1];
    double mx = l0 > l1 ? l0 : l1;
    double w0 = exp(l0 - mx), w1 = exp(l1 - mx);
    for (size_t d = 0; d < D; d++)
        out[d] = (w0 * acc[0][d] + w1 * acc[1][d]) / (w0 + w1);
}

/* The small model with its contexts built (small, build). */
static fam small_built(void)
{
    fam f = { 0 };
    small(&f);
    build(&f);
    return f;
}

/* Plain softmax attention over the stream + the query token. */
static void plain_ref(const kvr_assemble_info *in, const float *pl, size_t H, size_t D,
                      uint32_t l, size_t h, const float *q, const float *qk, const float *qv,
                      double *out)
{
    size_t N = in->n_tokens, row = H * D;
    const float *K = pl + (size_t)l * 2 * N * row, *V = K + N * row;
    double lg[64], mx = -(double)INFINITY, sum = 0;
    for (size_t j = 0; j <= N; j++) {
        const float *k = j == N ? qk : K + j * row + h * D;
        double dot = 0;
        for (size_t d = 0; d < D; d++)
            dot += (double)q[d] * (double)k[d];
        lg[j] = dot / sqrt((double)D);
        if (lg[j] > mx)
            mx = lg[j];
    }
    for (size_t d = 0; d < D; d++)
        out[d] = 0;
    for (size_t j = 0; j <= N; j++) {
        double w = exp(lg[j] - mx);
        sum += w;
        const float *v = j == N ? qv : V + j * row + h * D;
        for (size_t d = 0; d < D; d++)
            out[d] += w * (double)v[d];
    }
    for (size_t d = 0; d < D; d++)
        out[d] /= sum;
}

Test(layout_ape, reference_attention)
{
    fam f = small_built();
    float q[16], qk[16], qv[16];
    for (int d = 0; d < 16; d++) {
        q[d] = (float)((d * 7) % 11 - 5) / 4.0f;
        qk[d] = (float)((d * 5) % 9 - 4) / 4.0f;
        qv[d] = (float)((d * 3) % 7 - 3) / 2.0f;
    }
    kvr_layout_kind kinds[2] = { KVR_LAYOUT_PARALLEL, KVR_LAYOUT_SEQUENTIAL };
    for (int ki = 0; ki < 2; ki++) {
        /* T = S = 1: APE is ordinary softmax attention. */
        kvr_assemble_params p = { .prefix = "pre", .docs = DOCS, .n_docs = 3,
                                  .layout = kinds[ki], .dtype = KVR_DTYPE_F32,
                                  .temperature = 1.0, .scale = 1.0 };
        kvr_assemble *t = NULL;
        float *pl = run(&f, &p, &t);
        const kvr_assemble_info *in = kvr_assemble_get_info(t);
        for (uint32_t l = 0; l < NL; l++)
            for (size_t h = 0; h < 2; h++) {
                double a[16], b[16];
                ape_ref(in, pl, 2, 16, l, h, q, qk, qv, false, a);
                plain_ref(in, pl, 2, 16, l, h, q, qk, qv, b);
                for (int d = 0; d < 16; d++)
                    cr_assert(fabs(a[d] - b[d]) < 1e-9 * (1 + fabs(b[d])),
                              "T=S=1: %g vs %g", a[d], b[d]);
            }
        free(pl);
        kvr_assemble_end(t);

        /* Defaults, unfolded vs folded: same output; and it differs from plain. */
        p.temperature = p.scale = 0;
        float *pu = run(&f, &p, &t);
        kvr_assemble *tf = NULL;
        p.fold_temperature = true;
        float *pf = run(&f, &p, &tf);
        const kvr_assemble_info *iu = kvr_assemble_get_info(t);
        const kvr_assemble_info *iff = kvr_assemble_get_info(tf);
        cr_assert(iff->temperature_folded);
        double maxdiff = 0;
        for (uint32_t l = 0; l < NL; l++)
            for (size_t h = 0; h < 2; h++) {
                double a[16], b[16], c[16];
                ape_ref(iu, pu, 2, 16, l, h, q, qk, qv, false, a);
                ape_ref(iff, pf, 2, 16, l, h, q, qk, qv, true, b);
                plain_ref(iu, pu, 2, 16, l, h, q, qk, qv, c);
                for (int d = 0; d < 16; d++) {
                    cr_assert(fabs(a[d] - b[d]) < 1e-5 * (1 + fabs(a[d])),
                              "folded %g vs unfolded %g", b[d], a[d]);
                    if (fabs(a[d] - c[d]) > maxdiff)
                        maxdiff = fabs(a[d] - c[d]);
                }
            }
        cr_assert_gt(maxdiff, 1e-4, "APE with T=S=0.9 should differ from plain attention");
        /* Folding touches document keys only: prefix keys identical. */
        size_t row = 32, N = iu->n_tokens;
        cr_assert_eq(memcmp(pu, pf, P * row * sizeof(float)), 0);
        for (size_t i = P; i < N; i++)
            for (size_t d = 0; d < row; d++)
                cr_assert(fabs((double)pf[i * row + d] - (double)pu[i * row + d] / 0.9) < 1e-5,
                          "folded key");
        free(pu);
        free(pf);
        kvr_assemble_end(t);
        kvr_assemble_end(tf);
    }
    kvr_store_destroy(f.s);
}

/* f16 output with folding and a layer subset: close to the f32 result. */
Test(layout_ape, f16_layers_subset)
{
    fam f = small_built();
    uint32_t layers[1] = { 1 };
    kvr_assemble_params p = { .prefix = "pre", .docs = DOCS, .n_docs = 3,
                              .layout = KVR_LAYOUT_SEQUENTIAL, .dtype = KVR_DTYPE_F32,
                              .layers = layers, .n_layers_sel = 1, .fold_temperature = true };
    kvr_assemble *a = NULL, *b = NULL;
    float *pa = run(&f, &p, &a);
    p.dtype = KVR_DTYPE_F16;
    uint16_t *pb = (uint16_t *)(void *)run(&f, &p, &b);
    size_t n = kvr_assemble_get_info(a)->n_tokens * 32 * 2;
    cr_assert_eq(kvr_assemble_payload_size(b), n * 2);
    for (size_t i = 0; i < n; i++)
        cr_assert(fabs((double)kvr_f16_to_f32(pb[i]) - (double)pa[i]) <=
                  1e-3 * (1 + fabs((double)pa[i])), "%zu", i);
    free(pa);
    free(pb);
    kvr_assemble_end(a);
    kvr_assemble_end(b);
    kvr_store_destroy(f.s);
}

/* A document or a layer listed twice is refused: reads must not multiply
 * their staging (and evict the cache for it) by repeating what they ask. */
Test(layout_ape, duplicates_refused)
{
    fam f = small_built();
    kvr_error e = { 0 };
    kvr_assemble *t = NULL;
    const char *d[3] = { "A", "B", "A" };
    kvr_assemble_params p = { .prefix = "pre", .docs = d, .n_docs = 3,
                              .dtype = KVR_DTYPE_F32 };
    int rc = kvr_store_assemble_begin(f.s, &p, &t, &e);
    cr_assert_eq(rc, KVR_EINVAL, "rc %d: %s", rc, e.msg);
    cr_assert(strstr(e.msg, "'A'") && strstr(e.msg, "twice"), "%s", e.msg);
    cr_assert_null(t);
    d[2] = "C";
    uint32_t layers[2] = { 1, 1 };
    p.layers = layers;
    p.n_layers_sel = 2;
    rc = kvr_store_assemble_begin(f.s, &p, &t, &e);
    cr_assert_eq(rc, KVR_EINVAL, "rc %d: %s", rc, e.msg);
    cr_assert(strstr(e.msg, "layer 1") && strstr(e.msg, "twice"), "%s", e.msg);
    layers[0] = 0;
    cr_assert_eq(kvr_store_assemble_begin(f.s, &p, &t, &e), 0, "%s", e.msg);
    kvr_assemble_end(t);
    kvr_store_stats st;
    kvr_store_get_stats(f.s, &st);
    cr_assert_eq(st.n_leased_blocks, 0);
    kvr_store_destroy(f.s);
}

Test(layout_ape, refusals)
{
    fam f = small_built();
    kvr_error e = { 0 };
    /* A second prefix, a document encoded against it, a document without a
     * prefix, and a model of another shape with its own prefix + document. */
    cr_assert_eq(put_doc(&f, "pre2", NULL, 0, 5, 0, &e), 0);
    cr_assert_eq(put_doc(&f, "D2", "pre2", 6, 4, 5, &e), 0, "%s", e.msg);
    cr_assert_eq(put_doc(&f, "plain", NULL, 6, 4, 0, &e), 0);
    kvr_store_stats before;
    kvr_store_get_stats(f.s, &before);
    kvr_assemble *t = NULL;
    const char *d1[2] = { "A", "D2" };
    kvr_assemble_params p = { .prefix = "pre", .docs = d1, .n_docs = 2,
                              .dtype = KVR_DTYPE_F32 };
    cr_assert_eq(kvr_store_assemble_begin(f.s, &p, &t, &e), KVR_EPREFIX);
    cr_assert(strstr(e.msg, "'D2'") && strstr(e.msg, "pre2"), "%s", e.msg);
    d1[1] = "plain";
    cr_assert_eq(kvr_store_assemble_begin(f.s, &p, &t, &e), KVR_EPREFIX);
    cr_assert(strstr(e.msg, "'plain'"), "%s", e.msg);
    d1[1] = "missing";
    cr_assert_eq(kvr_store_assemble_begin(f.s, &p, &t, &e), KVR_ENOCTX);
    cr_assert(strstr(e.msg, "missing"), "%s", e.msg);
    p.prefix = "nope";
    d1[1] = "B";
    cr_assert_eq(kvr_store_assemble_begin(f.s, &p, &t, &e), KVR_ENOCTX);
    p.prefix = "pre";
    /* Explicit starts: overflow and negative. */
    int64_t starts[2] = { INT64_MAX - 3, 6 };
    p.layout = KVR_LAYOUT_EXPLICIT;
    p.starts = starts;
    cr_assert_eq(kvr_store_assemble_begin(f.s, &p, &t, &e), KVR_EINVAL);
    cr_assert(strstr(e.msg, "'A'"), "%s", e.msg);
    starts[0] = -1;
    cr_assert_eq(kvr_store_assemble_begin(f.s, &p, &t, &e), KVR_EINVAL);
    p.starts = NULL;
    cr_assert_eq(kvr_store_assemble_begin(f.s, &p, &t, &e), KVR_EBADREQUEST);
    p.layout = KVR_LAYOUT_PARALLEL;
    p.temperature = -1;
    cr_assert_eq(kvr_store_assemble_begin(f.s, &p, &t, &e), KVR_EINVAL);
    p.temperature = 0;
    p.n_docs = 0;
    cr_assert_eq(kvr_store_assemble_begin(f.s, &p, &t, &e), KVR_EBADREQUEST);
    p.n_docs = 2;
    /* Another model. */
    kvr_model_desc d = { .name = "m2", .n_layers = NL, .n_kv_heads = 2, .head_dim = 16,
                         .dtype = KVR_DTYPE_F32 };
    kvr_rope_config_init(&d.rope);
    d.rope.theta = 500000;
    cr_assert_eq(kvr_store_model_register(f.s, &d, NULL, &e), 0);
    uint32_t u[3] = { 1, 2, 3 };
    kvr_put_params pp = { .ctx_id = "X", .model = "m2", .n_layers = NL, .n_kv_heads = 2,
                          .head_dim = 16, .dtype = KVR_DTYPE_F32, .n_tokens = 3,
                          .tokens = u, .prefix_ctx = "pre" };
    kvr_put *pt = NULL;
    cr_assert_eq(kvr_store_put_begin(f.s, &pp, &pt, &e), KVR_EFINGERPRINT, "%s", e.msg);
    pp.prefix_ctx = "nope";
    cr_assert_eq(kvr_store_put_begin(f.s, &pp, &pt, &e), KVR_ENOCTX, "%s", e.msg);
    pp.prefix_ctx = NULL;
    cr_assert_eq(kvr_store_put_begin(f.s, &pp, &pt, &e), 0);
    kvr_put_abort(pt);
    kvr_store_stats after;
    kvr_store_get_stats(f.s, &after);
    cr_assert_eq(after.n_blocks, before.n_blocks);
    cr_assert_eq(after.n_leased_blocks, 0);
    cr_assert_eq(after.n_contexts, before.n_contexts);

    /* The prefix changes: appended to (length), then replaced with other
     * tokens of the same length (hash). Both refuse, naming the document. */
    const char *d3[1] = { "A" };
    p.docs = d3;
    p.n_docs = 1;
    cr_assert_eq(kvr_store_assemble_begin(f.s, &p, &t, &e), 0, "%s", e.msg);
    kvr_assemble_end(t);
    cr_assert_eq(kvr_store_keep(f.s, "pre", 0, 5, &e), 0);
    cr_assert_eq(kvr_store_assemble_begin(f.s, &p, &t, &e), KVR_EPREFIX);
    cr_assert(strstr(e.msg, "'A'") && strstr(e.msg, "changed"), "%s", e.msg);
    cr_assert_eq(kvr_store_delete(f.s, "pre", &e), 0);
    cr_assert_eq(put_doc(&f, "pre", NULL, 1, P, 0, &e), 0);
    cr_assert_eq(kvr_store_assemble_begin(f.s, &p, &t, &e), KVR_EPREFIX);
    cr_assert(strstr(e.msg, "token ids differ"), "%s", e.msg);
    kvr_store_destroy(f.s);
}
