/*
 * test_rope_vectors.c — the engine against ggml's reference vectors
 * (shared/vectors/rope, see its manifest.json): for every case,
 * apply(x, pos_old) ~ k_old, apply(x, pos_new) ~ k_new and
 * reposition(k_old, pos_old -> pos_new) ~ k_new, for every dtype and every
 * ISA this machine has.
 *
 * Each case's config is built as the HF config.json text a model would ship
 * (rope_scaling copied from the manifest as is) and read by the real parser.
 * ggml's YaRN with ext_factor 1 and attn_factor 1 multiplies cos/sin by
 * 1 + 0.1 ln(factor), which is HF's default attention_factor, so no mapping
 * beyond that is needed.
 *
 * Tolerances: f32 within the case's tolerance_abs. f16/bf16 within that plus
 * one rounding of the format on the input and one on the output, i.e.
 * 2.5 * u * |pair| (u = 2^-11 for f16, 2^-8 for bf16; |pair| the magnitude of
 * the rotated pair, the rotation spreads an input error over both members).
 */
#include <criterion/criterion.h>
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rope/rope.h"
#include "tests/common/kvt.h"
#include "tests/common/kvt_vectors.h"

typedef struct vcase {
    char name[64];
    kvr_rope_config cfg;
    size_t n_tokens, n_heads, hd;
    double tol;
    float *x, *k_old, *k_new;
    int64_t *pos_old, *pos_new;
} vcase;

static vcase cases[32];
static int n_cases;

static void *load_file(const char *file, size_t want_bytes)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/rope/%s", kvt_vectors_dir(), file);
    size_t len = 0;
    char *b = kvt_slurp(path, &len);
    cr_assert(b != NULL, "cannot read %s", path);
    cr_assert_eq(len, want_bytes, "%s: %zu bytes, expected %zu", path, len, want_bytes);
    return b;
}

static int64_t *load_pos(const char *file, size_t n)
{
    int32_t *p = load_file(file, n * 4);
    int64_t *q = malloc(n * sizeof *q);
    for (size_t i = 0; i < n; i++) q[i] = p[i];
    free(p);
    return q;
}

static void load_cases(void)
{
    cJSON *m = kvt_rope_manifest();
    const cJSON *cs = cJSON_GetObjectItem(m, "cases"), *c;
    n_cases = 0;
    cJSON_ArrayForEach(c, cs) {
        vcase *v = &cases[n_cases++];
        snprintf(v->name, sizeof v->name, "%s", cJSON_GetObjectItem(c, "name")->valuestring);
        v->hd = (size_t)cJSON_GetObjectItem(c, "head_dim")->valueint;
        v->n_heads = (size_t)cJSON_GetObjectItem(c, "n_heads")->valueint;
        v->n_tokens = (size_t)cJSON_GetObjectItem(c, "n_tokens")->valueint;
        v->tol = cJSON_GetObjectItem(c, "tolerance_abs")->valuedouble;
        /* the config.json a model with these parameters would ship */
        kvt_rope_case_config(c, (double)v->n_heads, &v->cfg);
        const cJSON *f = cJSON_GetObjectItem(c, "files");
        size_t nel = v->n_tokens * v->n_heads * v->hd;
        v->x = load_file(cJSON_GetObjectItem(f, "x")->valuestring, nel * 4);
        v->k_old = load_file(cJSON_GetObjectItem(f, "k_old")->valuestring, nel * 4);
        v->k_new = load_file(cJSON_GetObjectItem(f, "k_new")->valuestring, nel * 4);
        v->pos_old = load_pos(cJSON_GetObjectItem(f, "pos_old")->valuestring, v->n_tokens);
        v->pos_new = load_pos(cJSON_GetObjectItem(f, "pos_new")->valuestring, v->n_tokens);
    }
    cJSON_Delete(m);
    cr_assert(n_cases >= 12, "manifest has %d cases", n_cases);
}

static void free_cases(void)
{
    for (int i = 0; i < n_cases; i++) {
        free(cases[i].x); free(cases[i].k_old); free(cases[i].k_new);
        free(cases[i].pos_old); free(cases[i].pos_new);
    }
    n_cases = 0;
}

enum op { OP_APPLY_OLD, OP_APPLY_NEW, OP_REPOSITION, OP_REMOVE };

/* Magnitude of the pair element j belongs to (or |v[j]| past rotary_dim). */
static double pair_mag(const float *row, const kvr_rope_config *cfg, size_t j)
{
    size_t rot = (size_t)cfg->rotary_dim;
    if (j >= rot) return fabs((double)row[j]);
    size_t p;
    if (cfg->style == KVR_ROPE_GPTJ) p = j ^ 1u;
    else p = j < rot / 2 ? j + rot / 2 : j - rot / 2;
    return hypot((double)row[j], (double)row[p]);
}

static void check_case(const vcase *v, enum op op, kvr_dtype dt, kvr_isa isa)
{
    kvr_rope *r = kvt_rope_new(&v->cfg);
    size_t nel = v->n_tokens * v->n_heads * v->hd;
    size_t es = kvr_dtype_size(dt);
    void *in = malloc(nel * es), *out = malloc(nel * es);
    float *res = malloc(nel * 4);
    const float *src = op == OP_REPOSITION || op == OP_REMOVE ? v->k_old : v->x;
    const float *ref = op == OP_APPLY_OLD ? v->k_old : op == OP_REMOVE ? v->x : v->k_new;
    kvr_convert(in, dt, src, KVR_DTYPE_F32, nel);
    kvr_rope_opts o = { .isa = isa };
    int rc;
    switch (op) {
    case OP_APPLY_OLD:
        rc = kvr_rope_apply(r, out, dt, in, dt, v->n_tokens, v->n_heads, v->pos_old, &o); break;
    case OP_APPLY_NEW:
        rc = kvr_rope_apply(r, out, dt, in, dt, v->n_tokens, v->n_heads, v->pos_new, &o); break;
    case OP_REMOVE:
        rc = kvr_rope_remove(r, out, dt, in, dt, v->n_tokens, v->n_heads, v->pos_old, &o); break;
    default:
        rc = kvr_rope_reposition(r, out, dt, in, dt, v->n_tokens, v->n_heads,
                                 v->pos_old, v->pos_new, &o); break;
    }
    cr_assert_eq(rc, 0);
    kvr_convert(res, KVR_DTYPE_F32, out, dt, nel);
    double u = dt == KVR_DTYPE_F16 ? 0x1p-11 : dt == KVR_DTYPE_BF16 ? 0x1p-8 : 0.0;
    double worst = 0.0;
    size_t worst_at = 0;
    bool ok = true;
    for (size_t e = 0; e < nel; e++) {
        size_t j = e % v->hd;
        const float *row = ref + (e - j);
        double tol = v->tol + 2.5 * u * pair_mag(row, &v->cfg, j);
        double d = fabs((double)res[e] - (double)ref[e]);
        if (!(d <= tol)) ok = false;
        if (!(d <= worst)) { worst = d; worst_at = e; }
    }
    cr_expect(ok, "%s op=%d dtype=%s isa=%s: worst error %.3g at element %zu "
              "(got %g, want %g, tolerance_abs %g)", v->name, (int)op, kvr_dtype_name(dt),
              kvr_isa_name(isa), worst, worst_at, (double)res[worst_at], (double)ref[worst_at],
              v->tol);
    free(in); free(out); free(res);
    kvr_rope_destroy(r);
}

static void check_all(enum op op, kvr_dtype dt)
{
    kvr_isa isas[] = { KVR_ISA_SCALAR, KVR_ISA_AVX2, KVR_ISA_AVX512 };
    kvr_isa best = kvr_isa_best();
    for (int c = 0; c < n_cases; c++)
        for (int k = 0; k < 3; k++) {
            if (isas[k] > best) continue;
            check_case(&cases[c], op, dt, isas[k]);
        }
}

TestSuite(rope_vectors, .init = load_cases, .fini = free_cases);

Test(rope_vectors, apply_old_f32)   { check_all(OP_APPLY_OLD, KVR_DTYPE_F32); }
Test(rope_vectors, apply_new_f32)   { check_all(OP_APPLY_NEW, KVR_DTYPE_F32); }
Test(rope_vectors, reposition_f32)  { check_all(OP_REPOSITION, KVR_DTYPE_F32); }
Test(rope_vectors, remove_f32)      { check_all(OP_REMOVE, KVR_DTYPE_F32); }
Test(rope_vectors, apply_old_f16)   { check_all(OP_APPLY_OLD, KVR_DTYPE_F16); }
Test(rope_vectors, apply_new_f16)   { check_all(OP_APPLY_NEW, KVR_DTYPE_F16); }
Test(rope_vectors, reposition_f16)  { check_all(OP_REPOSITION, KVR_DTYPE_F16); }
Test(rope_vectors, apply_old_bf16)  { check_all(OP_APPLY_OLD, KVR_DTYPE_BF16); }
Test(rope_vectors, apply_new_bf16)  { check_all(OP_APPLY_NEW, KVR_DTYPE_BF16); }
Test(rope_vectors, reposition_bf16) { check_all(OP_REPOSITION, KVR_DTYPE_BF16); }

/* Mixed dtypes: f32 in, f16/bf16 out, and back. */
Test(rope_vectors, apply_mixed_dtypes)
{
    for (int c = 0; c < n_cases; c++) {
        const vcase *v = &cases[c];
        kvr_rope *r = kvt_rope_new(&v->cfg);
        size_t nel = v->n_tokens * v->n_heads * v->hd;
        uint16_t *h = malloc(nel * 2);
        float *back = malloc(nel * 4);
        kvr_dtype outs[] = { KVR_DTYPE_F16, KVR_DTYPE_BF16 };
        for (int k = 0; k < 2; k++) {
            double u = outs[k] == KVR_DTYPE_F16 ? 0x1p-11 : 0x1p-8;
            cr_assert_eq(kvr_rope_apply(r, h, outs[k], v->x, KVR_DTYPE_F32, v->n_tokens,
                                        v->n_heads, v->pos_new, NULL), 0);
            kvr_convert(back, KVR_DTYPE_F32, h, outs[k], nel);
            for (size_t e = 0; e < nel; e++) {
                size_t j = e % v->hd;
                double tol = v->tol + 1.5 * u * pair_mag(v->k_new + (e - j), &v->cfg, j);
                cr_assert_leq(fabs((double)back[e] - (double)v->k_new[e]), tol,
                              "%s %s element %zu", v->name, kvr_dtype_name(outs[k]), e);
            }
            /* reduced in, f32 out */
            kvr_convert(h, outs[k], v->k_old, KVR_DTYPE_F32, nel);
            cr_assert_eq(kvr_rope_reposition(r, back, KVR_DTYPE_F32, h, outs[k], v->n_tokens,
                                             v->n_heads, v->pos_old, v->pos_new, NULL), 0);
            for (size_t e = 0; e < nel; e++) {
                size_t j = e % v->hd;
                double tol = v->tol + 1.5 * u * pair_mag(v->k_new + (e - j), &v->cfg, j);
                cr_assert_leq(fabs((double)back[e] - (double)v->k_new[e]), tol,
                              "%s from %s element %zu", v->name, kvr_dtype_name(outs[k]), e);
            }
        }
        free(h); free(back);
        kvr_rope_destroy(r);
    }
}
