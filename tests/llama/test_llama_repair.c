/*
 * test_llama_repair.c — seam repair (client/llama/worker_repair.c) on the
 * committed trained model (build/eval/kvrope-code.gguf), in process, no
 * daemon.
 *
 * The setup every llama test here shares: prompt A = header A + chunks
 * c0 c1 c2 is encoded; its cells are read back (llama.cpp's own state), each
 * chunk's keys re-rotated to where the chunk sits in prompt B = header B +
 * c2 c0 c1 + a question (the rotation kvroped does: a pure RoPE rotation by
 * the position delta, pairs (2i, 2i+1), base 10000, in f32 then rounded to
 * f16), and loaded as B's placed cells; B's header and question are gaps.
 * After the repair, a continuation is decoded and its logits compared with
 * those of a full encode of B.
 *
 * What holds whatever the numbers:
 *  - with every token repaired (`all`) the logits equal a full encode's
 *    (tolerance TOL_ALL: the same tokens, positions and batches; only the
 *    cells llama.cpp picks may differ, and flash attention visits cells in
 *    cell order, so the sums may round differently; printed);
 *  - no repair policy makes the mean KL from the full encode larger than no
 *    repair (plus KL_EPS for the f16 noise of recomputing the same KV);
 *  - the computed runs go into fewer llama_decode calls than runs (runs
 *    batched in scratch sequences; a run holding a gap ends a group);
 *  - the probe decode's layer-1 K and V equal the full encode's cells (f16);
 *  - plans and policy strings, without llama.cpp;
 *  - the session engine's cover path (kvr__wk_sync with a stand-in for the
 *    daemon's cover verb over a real test daemon): runs placed, the default
 *    seams repaired, the stored context exact up to the first unrepaired
 *    placed token and flagged approximate after it; with every token
 *    repaired the greedy continuation is a full encode's; a cover that
 *    places too little is not taken, one that does not match the prompt is
 *    refused and stores nothing.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "client/llama/worker.h"
#include "rope/rope.h"
#include "tests/common/kvr_testd.h"
#include "tests/common/kvt_bench.h"

#define TOL_ALL 1e-4
#define KL_EPS  1e-5

static const char HDR_A[] = "# retrieved for the question below\n";
static const char HDR_B[] = "# file: lib/textwrap_helpers.py\n";
static const char *CHUNK[3] = {
    "def indent(text, prefix, predicate=None):\n"
    "    if predicate is None:\n"
    "        def predicate(line):\n"
    "            return line.strip()\n",
    "    def prefixed_lines():\n"
    "        for line in text.splitlines(True):\n"
    "            yield (prefix + line if predicate(line) else line)\n"
    "    return ''.join(prefixed_lines())\n",
    "def dedent(text):\n"
    "    margin = None\n"
    "    text = _whitespace_only_re.sub('', text)\n"
    "    indents = _leading_whitespace_re.findall(text)\n",
};
static const char QUESTION[] = "\n# and now the function that wraps a paragraph:\ndef wrap(";
static const char CONT[] = "text, width=70, **kwargs):\n    w = TextWrapper(width=width, **kwargs)\n";

static kvr__wk_lm *LM;
static char err[1024];
static const kvr__wk_lm_info *IN;

static int32_t *tokens(const char *s, bool bos, size_t *n)
{
    int32_t *t = NULL;
    cr_assert_eq(kvr__wk_lm_tokenize(LM, s, strlen(s), bos, &t, n, err, sizeof err), 0, "%s", err);
    return t;
}

static void setup(void)
{
    char model[600];
    snprintf(model, sizeof model, "%s/eval/kvrope-code.gguf", testd_build_dir());
    cr_assert_eq(access(model, R_OK), 0, "the trained model %s is built (make)", model);
    cr_assert_eq(kvr__wk_lm_load(&LM, model, 1, err, sizeof err), 0, "%s", err);
    kvr__wk_lm_set_probe(LM, true);
    cr_assert_eq(kvr__wk_lm_context(LM, 2048, err, sizeof err), 0, "%s", err);
    IN = kvr__wk_lm_info_get(LM);
}

static void teardown(void)
{
    kvr__wk_lm_destroy(LM);
    LM = NULL;
}

/* ---- the prompts ------------------------------------------------------------- */
typedef struct prompts {
    int32_t *a, *b, *cont;
    size_t   na, nb, ncont;
    size_t   a_off[3], b_off[3], len[3];
    int      order_b[3];
} prompts;

static void append(int32_t **dst, size_t *n, const int32_t *src, size_t m)
{
    *dst = realloc(*dst, (*n + m) * sizeof **dst);
    cr_assert_not_null(*dst);
    memcpy(*dst + *n, src, m * sizeof *src);
    *n += m;
}

static void make_prompts(prompts *p)
{
    memset(p, 0, sizeof *p);
    size_t n;
    int32_t *t = tokens(HDR_A, true, &n);
    append(&p->a, &p->na, t, n);
    free(t);
    int32_t *ch[3];
    for (int i = 0; i < 3; i++) {
        ch[i] = tokens(CHUNK[i], false, &p->len[i]);
        p->a_off[i] = p->na;
        append(&p->a, &p->na, ch[i], p->len[i]);
    }
    t = tokens(HDR_B, true, &n);
    append(&p->b, &p->nb, t, n);
    free(t);
    const int ob[3] = { 2, 0, 1 };
    for (int j = 0; j < 3; j++) {
        int i = ob[j];
        p->order_b[j] = i;
        p->b_off[i] = p->nb;
        append(&p->b, &p->nb, ch[i], p->len[i]);
    }
    t = tokens(QUESTION, false, &n);
    append(&p->b, &p->nb, t, n);
    free(t);
    p->cont = tokens(CONT, false, &p->ncont);
    for (int i = 0; i < 3; i++)
        free(ch[i]);
}

static void free_prompts(prompts *p)
{
    free(p->a);
    free(p->b);
    free(p->cont);
}

/* ---- placed cells -------------------------------------------------------------- */

/* Rotates the K rows of a layer-major f16 payload of n tokens by delta
 * positions (NORM pairs, base 10000): what kvroped's reposition does. */
static void rotate_payload(uint16_t *pay, size_t n, int64_t delta)
{
    size_t row = (size_t)IN->n_head_kv * IN->head_dim, hd = IN->head_dim;
    for (uint32_t l = 0; l < IN->n_layer; l++) {
        uint16_t *k = pay + (size_t)l * 2 * n * row;
        for (size_t t = 0; t < n; t++)
            for (size_t h = 0; h < IN->n_head_kv; h++)
                for (size_t i = 0; i < hd / 2; i++) {
                    double th = (double)delta * pow(10000.0, -2.0 * (double)i / (double)hd);
                    uint16_t *x = k + t * row + h * hd + 2 * i;
                    double a = kvr_f16_to_f32(x[0]), b = kvr_f16_to_f32(x[1]);
                    x[0] = kvr_f32_to_f16((float)(a * cos(th) - b * sin(th)));
                    x[1] = kvr_f32_to_f16((float)(a * sin(th) + b * cos(th)));
                }
    }
}

/* A's encode, read back: the state every placed load builds from. */
typedef struct source {
    uint8_t     *buf;
    size_t       len;
    kvr__wk_state st;
} source;

static void encode_source(const prompts *p, source *s)
{
    kvr__wk_lm_clear(LM);
    cr_assert_eq(kvr__wk_lm_decode(LM, p->a, p->na, 0, 0, KVR_WK_LOGITS_NONE, NULL, NULL, err,
                                  sizeof err), 0, "%s", err);
    cr_assert_eq(kvr__wk_lm_state_get(LM, &s->buf, &s->len, err, sizeof err), 0, "%s", err);
    char why[256];
    cr_assert_eq(kvr__wk_state_parse(&s->st, s->buf, s->len, why, sizeof why), 0, "%s", why);
    kvr__wk_lm_clear(LM);
}

static void free_source(source *s)
{
    kvr__wk_state_free(&s->st);
    free(s->buf);
}

/* Seq 0 := B's placed cells (every chunk, re-rotated); placed[] and
 * run_start[] (nb entries) filled. */
static void load_placed(const prompts *p, const source *s, uint8_t *placed, uint8_t *run_start)
{
    size_t row = (size_t)IN->n_head_kv * IN->head_dim, total = 0;
    memset(placed, 0, p->nb);
    memset(run_start, 0, p->nb);
    for (int i = 0; i < 3; i++)
        total += p->len[i];
    kvr__wk_sbuild sb;
    cr_assert_eq(kvr__wk_sbuild_init(&sb, (uint32_t)total, IN->n_layer, s->st.type, (uint32_t)row,
                                     kvr__wk_lm_v_trans(LM)), 0);
    for (int j = 0; j < 3; j++) {
        int i = p->order_b[j];
        size_t n = p->len[i];
        uint32_t *cells = malloc(n * sizeof *cells);
        int64_t *pos = malloc(n * sizeof *pos);
        uint16_t *pay = malloc((size_t)IN->n_layer * 2 * n * row * 2);
        cr_assert(cells && pos && pay);
        for (size_t t = 0; t < n; t++) {
            long c = kvr__wk_state_find(&s->st, (int32_t)(p->a_off[i] + t));
            cr_assert_geq(c, 0);
            cells[t] = (uint32_t)c;
            pos[t] = (int64_t)(p->b_off[i] + t);
            placed[p->b_off[i] + t] = 1;
        }
        run_start[p->b_off[i]] = 1;
        kvr__wk_state_gather(&s->st, cells, n, pay);
        rotate_payload(pay, n, (int64_t)p->b_off[i] - (int64_t)p->a_off[i]);
        cr_assert_eq(kvr__wk_sbuild_add(&sb, pay, n, 0, n, pos), 0);
        free(cells);
        free(pos);
        free(pay);
    }
    kvr__wk_lm_clear(LM);
    cr_assert_eq(kvr__wk_lm_state_set(LM, sb.buf, sb.len, err, sizeof err), 0, "%s", err);
    kvr__wk_sbuild_free(&sb);
}

/* ---- runs ----------------------------------------------------------------------------- */
typedef struct rows {
    float *x;      /* (ncont) rows of n_vocab: row j predicts cont[j] */
    size_t n, nv;
} rows;

static void on_rows(void *ud, size_t first, size_t n, const float *const *r)
{
    rows *o = ud;
    for (size_t j = 0; j < n; j++)
        if (first + j + 1 < o->n)
            memcpy(o->x + (first + j + 1) * o->nv, r[j], o->nv * sizeof(float));
}

/* B repaired by `policy` (placed: the chunks; NULL policy: nothing placed,
 * i.e. a full encode), then the continuation. */
static void run(const prompts *p, const source *s, const char *policy, rows *out,
                kvr__wk_repair_res *res)
{
    uint8_t *placed = calloc(p->nb, 1), *rs = calloc(p->nb, 1);
    cr_assert(placed && rs);
    kvr__wk_repair_opts o;
    if (policy) {
        cr_assert_eq(kvr__wk_repair_parse(policy, &o, err, sizeof err), 0, "%s", err);
        load_placed(p, s, placed, rs);
    } else {
        memset(&o, 0, sizeof o);
        kvr__wk_lm_clear(LM);
    }
    uint8_t *cmp = calloc(p->nb, 1);
    cr_assert_not_null(cmp);
    cr_assert_eq(kvr__wk_repair(LM, p->b, p->nb, placed, rs, &o, cmp, res, err, sizeof err), 0,
                 "%s: %s", policy ? policy : "full", err);
    /* the computed runs went into groups of up to n_seq - 1 runs (a run
     * holding a gap ends a group), at least one decode */
    size_t n_runs = 0, n_gap_runs = 0;
    for (size_t i = 0; i < p->nb; i++)
        if (cmp[i] && (i == 0 || !cmp[i - 1])) {
            n_runs++;
            size_t j = i;
            while (j < p->nb && cmp[j] && placed[j])
                j++;
            n_gap_runs += j < p->nb && cmp[j];
        }
    size_t per = kvr__wk_lm_n_seq(LM) - 1;
    cr_assert(res->n_decodes >= 1 && res->n_decodes <= n_gap_runs + 1 + n_runs / per &&
              res->n_decodes <= n_runs, "%s: %zu decodes for %zu runs (%zu with gaps)",
              policy ? policy : "full", res->n_decodes, n_runs, n_gap_runs);
    free(cmp);
    out->nv = IN->n_vocab;
    out->n = p->ncont;
    out->x = malloc(out->n * out->nv * sizeof(float));
    cr_assert_not_null(out->x);
    memcpy(out->x, kvr__wk_lm_logits(LM), out->nv * sizeof(float));
    cr_assert_eq(kvr__wk_lm_decode(LM, p->cont, p->ncont, (int32_t)p->nb, 0, KVR_WK_LOGITS_ALL,
                                  on_rows, out, err, sizeof err), 0, "%s", err);
    free(placed);
    free(rs);
}

static double mean_kl(const rows *ref, const rows *x)
{
    double s = 0;
    for (size_t j = 0; j < ref->n; j++) {
        s += kvt_kl_logits(ref->x + j * ref->nv, x->x + j * x->nv, ref->nv);
    }
    return s / (double)ref->n;
}

static double max_rel_diff(const rows *a, const rows *b)
{
    double d = 0, m = 0;
    for (size_t i = 0; i < a->n * a->nv; i++) {
        d = fmax(d, fabs((double)a->x[i] - (double)b->x[i]));
        m = fmax(m, fabs((double)a->x[i]));
    }
    return d / (m > 0 ? m : 1);
}

/* ---- tests ---------------------------------------------------------------------- */

TestSuite(llama_repair, .init = setup, .fini = teardown, .timeout = 600);

Test(llama_repair, all_equals_full_and_repair_never_hurts)
{
    prompts p;
    make_prompts(&p);
    source s;
    encode_source(&p, &s);
    kvr__wk_repair_res res;
    rows full, none, all;
    run(&p, &s, NULL, &full, &res);
    cr_assert_eq(res.n_computed, p.nb);
    run(&p, &s, "none", &none, &res);
    size_t n_chunks = p.len[0] + p.len[1] + p.len[2];
    cr_assert_eq(res.n_placed, n_chunks);
    cr_assert_eq(res.n_gap, p.nb - n_chunks);
    cr_assert_eq(res.n_repaired, 0);
    run(&p, &s, "all", &all, &res);
    cr_assert_eq(res.n_repaired, n_chunks);
    cr_assert_eq(res.n_computed, p.nb);
    double d_all = max_rel_diff(&full, &all), kl_none = mean_kl(&full, &none);
    cr_log_info("all vs full: max |diff| / max |logit| %.3g; KL(full || no repair) %.4g", d_all,
                kl_none);
    cr_assert_leq(d_all, TOL_ALL, "every token repaired equals a full encode (%g)", d_all);
    /* On the retrained model (session 8) this case's placed chunks cost
     * only ~2e-6 nats, under KL_EPS: the never-hurts check below is weak on
     * it until the case's continuation depends on the chunks. */
    cr_assert_gt(kl_none, 0, "the placed chunks are approximate (KL %g)", kl_none);
    const char *pol[] = { "epic:4", "epic:16", "epic:32", "blend:0.05", "blend:0.15",
                          "blend:0.3", "epic:8+blend:0.1", "blend:0.15@2" };
    for (size_t i = 0; i < sizeof pol / sizeof pol[0]; i++) {
        rows r;
        run(&p, &s, pol[i], &r, &res);
        double kl = mean_kl(&full, &r);
        cr_log_info("%-18s repaired %3zu of %zu placed in %zu decodes: KL %.4g (no repair "
                    "%.4g)", pol[i], res.n_repaired, res.n_placed, res.n_decodes, kl, kl_none);
        cr_assert_gt(res.n_repaired, 0, "%s repairs something", pol[i]);
        cr_assert_leq(kl, kl_none + KL_EPS, "%s: repair made the KL from a full encode larger "
                      "(%g > %g)", pol[i], kl, kl_none);
        if (strncmp(pol[i], "blend", 5) == 0)
            cr_assert_eq(res.n_probed, p.nb, "the selection pass ran over the prompt");
        free(r.x);
    }
    free(full.x);
    free(none.x);
    free(all.x);
    free_source(&s);
    free_prompts(&p);
}

/* The probe's layer-1 K and V (RoPE'd, f32) equal the cells a full encode
 * writes (f16): the selection compares against the right numbers; and the
 * probe leaves seq 0 as it was and seq 1 empty. */
Test(llama_repair, probe_matches_full_encode)
{
    prompts p;
    make_prompts(&p);
    kvr__wk_lm_clear(LM);
    cr_assert_eq(kvr__wk_lm_decode(LM, p.b, p.nb, 0, 0, KVR_WK_LOGITS_NONE, NULL, NULL, err,
                                  sizeof err), 0, "%s", err);
    uint8_t *before = NULL;
    size_t nbefore = 0;
    cr_assert_eq(kvr__wk_lm_state_get(LM, &before, &nbefore, err, sizeof err), 0);
    kvr__wk_state st;
    char why[256];
    cr_assert_eq(kvr__wk_state_parse(&st, before, nbefore, why, sizeof why), 0, "%s", why);
    size_t row = (size_t)IN->n_head_kv * IN->head_dim;
    for (uint32_t layer = 1; layer < IN->n_layer && layer <= 2; layer++) {
        kvr__wk_probe pr = { .layer = layer, .row = row, .cap = p.nb };
        pr.k = malloc(p.nb * row * sizeof(float));
        pr.v = malloc(p.nb * row * sizeof(float));
        cr_assert(pr.k && pr.v);
        cr_assert_eq(kvr__wk_lm_probe_decode(LM, &pr, p.b, p.nb, 0, 1, err, sizeof err), 0, "%s",
                     err);
        kvr__wk_lm_seq_rm(LM, 1, -1, -1);
        double dk = 0, dv = 0, mk = 0;
        for (size_t i = 0; i < p.nb; i++) {
            long c = kvr__wk_state_find(&st, (int32_t)i);
            cr_assert_geq(c, 0);
            for (size_t j = 0; j < row; j++) {
                uint16_t hk, hv;
                memcpy(&hk, st.k[layer] + ((size_t)c * row + j) * 2, 2);
                size_t vi = st.v_trans ? j * st.n_cells + (size_t)c : (size_t)c * row + j;
                memcpy(&hv, st.v[layer] + vi * 2, 2);
                dk = fmax(dk, fabs((double)(pr.k[i * row + j] - kvr_f16_to_f32(hk))));
                dv = fmax(dv, fabs((double)(pr.v[i * row + j] - kvr_f16_to_f32(hv))));
                mk = fmax(mk, fabs((double)pr.k[i * row + j]));
            }
        }
        cr_log_info("probe layer %u: max |dK| %.3g, |dV| %.3g (max |K| %.3g)", layer, dk, dv, mk);
        /* f16 keeps 11 significant bits: 2^-11 of the largest value, plus the
         * summation-order noise of two batch layouts */
        cr_assert_leq(dk, mk * 2e-3 + 1e-3, "layer %u K", layer);
        cr_assert_leq(dv, mk * 2e-3 + 1e-3, "layer %u V", layer);
        free(pr.k);
        free(pr.v);
    }
    uint8_t *after = NULL;
    size_t nafter = 0;
    cr_assert_eq(kvr__wk_lm_state_get(LM, &after, &nafter, err, sizeof err), 0);
    cr_assert(nafter == nbefore && memcmp(before, after, nbefore) == 0,
              "seq 0 is unchanged by probes");
    cr_assert_lt(kvr__wk_lm_pos_max(LM, 1), 0, "seq 1 is empty after probes");
    kvr__wk_state_free(&st);
    free(before);
    free(after);
    free_prompts(&p);
}

/* The eval callback of a probing context asks for no tensor outside a probe:
 * a decode there computes exactly what it computes without probing. */
Test(llama_repair, probing_context_computes_the_same)
{
    prompts p;
    make_prompts(&p);
    float *with = malloc(IN->n_vocab * sizeof *with);
    cr_assert_not_null(with);
    kvr__wk_lm_clear(LM);
    cr_assert_eq(kvr__wk_lm_decode(LM, p.b, p.nb, 0, 0, KVR_WK_LOGITS_LAST, NULL, NULL, err,
                                  sizeof err), 0, "%s", err);
    memcpy(with, kvr__wk_lm_logits(LM), IN->n_vocab * sizeof *with);
    kvr__wk_lm_set_probe(LM, false);
    cr_assert_eq(kvr__wk_lm_context(LM, 2048, err, sizeof err), 0, "%s", err);
    cr_assert_eq(kvr__wk_lm_decode(LM, p.b, p.nb, 0, 0, KVR_WK_LOGITS_LAST, NULL, NULL, err,
                                  sizeof err), 0, "%s", err);
    cr_assert_eq(memcmp(with, kvr__wk_lm_logits(LM), IN->n_vocab * sizeof *with), 0,
                 "the same logits with and without the probe callback");
    free(with);
    free_prompts(&p);
}

/* A context made without probing refuses blend, with a reason. */
Test(llama_repair, blend_needs_probe)
{
    kvr__wk_lm_set_probe(LM, false);
    cr_assert_eq(kvr__wk_lm_context(LM, 512, err, sizeof err), 0, "%s", err);
    int32_t t[8] = { 1, 40, 41, 42, 43, 44, 45, 46 };
    uint8_t placed[8] = { 0, 0, 1, 1, 1, 1, 0, 0 };
    kvr__wk_repair_opts o = { .blend_share = 0.5 };
    kvr__wk_repair_res res;
    kvr__wk_lm_clear(LM);
    cr_assert_eq(kvr__wk_lm_decode(LM, t, 6, 0, 0, KVR_WK_LOGITS_NONE, NULL, NULL, err, sizeof err),
                 0);
    kvr__wk_lm_seq_rm(LM, 0, 0, 2);
    err[0] = 0;
    cr_assert_lt(kvr__wk_repair(LM, t, 8, placed, NULL, &o, NULL, &res, err, sizeof err), 0);
    cr_assert(strstr(err, "probing"), "%s", err);
}

/* ---- without llama.cpp ---------------------------------------------------------- */

Test(repair_plan, epic_runs_and_gaps)
{
    /* gap gap [run 2..7) [run 7..10) gap [run 11..13) */
    uint8_t placed[13] = { 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1 };
    uint8_t starts[13] = { 0, 0, 1, 0, 0, 0, 0, 1, 0, 0, 0, 1, 0 };
    uint8_t c[13];
    kvr__wk_repair_opts o = { .first_k = 2 };
    size_t k = kvr__wk_repair_plan(placed, starts, 13, NULL, &o, c);
    uint8_t want[13] = { 1, 1, 1, 1, 0, 0, 0, 1, 1, 0, 1, 1, 1 };
    cr_assert_arr_eq(c, want, 13);
    cr_assert_eq(k, 6);
    /* without run starts: runs begin after gaps only */
    k = kvr__wk_repair_plan(placed, NULL, 13, NULL, &o, c);
    uint8_t want2[13] = { 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1 };
    cr_assert_arr_eq(c, want2, 13);
    cr_assert_eq(k, 4);
    o = (kvr__wk_repair_opts){ .all = true };
    cr_assert_eq(kvr__wk_repair_plan(placed, starts, 13, NULL, &o, c), 10);
    for (int i = 0; i < 13; i++)
        cr_assert_eq(c[i], 1);
    o = (kvr__wk_repair_opts){ 0 };
    cr_assert_eq(kvr__wk_repair_plan(placed, starts, 13, NULL, &o, c), 0);
    for (int i = 0; i < 13; i++)
        cr_assert_eq(c[i], !placed[i]);
}

Test(repair_plan, blend_budget_and_ties)
{
    uint8_t placed[8] = { 0, 1, 1, 1, 1, 1, 1, 1 };
    float dev[8] = { 99, 0.5f, 3, 3, 0.1f, NAN, 2, 0 };
    uint8_t c[8];
    /* 7 placed, 30% -> ceil(2.1) = 3: NaN counts as largest, then the tie at
     * 3 goes to both (index 2 and 3) */
    kvr__wk_repair_opts o = { .blend_share = 0.3 };
    cr_assert_eq(kvr__wk_repair_plan(placed, NULL, 8, dev, &o, c), 3);
    uint8_t want[8] = { 1, 0, 1, 1, 0, 1, 0, 0 };
    cr_assert_arr_eq(c, want, 8);
    /* 2/7 -> ceil(0.2857*7) = 2: NaN, then the earlier of the tie */
    o.blend_share = 2.0 / 7.0;
    cr_assert_eq(kvr__wk_repair_plan(placed, NULL, 8, dev, &o, c), 2);
    uint8_t want2[8] = { 1, 0, 1, 0, 0, 1, 0, 0 };
    cr_assert_arr_eq(c, want2, 8);
    /* EPIC + blend: the blend's budget is its own */
    o = (kvr__wk_repair_opts){ .first_k = 1, .blend_share = 2.0 / 7.0 };
    cr_assert_eq(kvr__wk_repair_plan(placed, NULL, 8, dev, &o, c), 3);
}

Test(repair_plan, policy_strings)
{
    kvr__wk_repair_opts o;
    char e[256];
    cr_assert_eq(kvr__wk_repair_parse("epic:16+blend:15%@2", &o, e, sizeof e), 0, "%s", e);
    cr_assert_eq(o.first_k, 16);
    cr_assert_float_eq(o.blend_share, 0.15, 1e-12);
    cr_assert_eq(o.blend_layer, 2);
    cr_assert_eq(kvr__wk_repair_parse("all", &o, e, sizeof e), 0);
    cr_assert(o.all);
    cr_assert_eq(kvr__wk_repair_parse("none", &o, e, sizeof e), 0);
    cr_assert(!o.all && !o.first_k && o.blend_share == 0);
    const char *bad[] = { "epic", "epic:x", "blend:0", "blend:1.5", "blend:0.1@0", "foo",
                          "epic:4+", "+", "blend:", "epic:-3" };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        e[0] = 0;
        cr_assert_lt(kvr__wk_repair_parse(bad[i], &o, e, sizeof e), 0, "%s refused", bad[i]);
        cr_assert(strstr(e, "repair policy"), "%s: %s", bad[i], e);
    }
}

/* ---- the session engine's cover path (kvr__wk_sync), with a stand-in verb ----
 *
 * A real kvroped (the test daemon) holds prompt A's context, stored by the
 * session engine itself. The daemon's cover verb is the other half of issue
 * 27 (w-cover); here a stand-in with the same signature (kvr__wk_cover_api)
 * answers the runs the test knows, each fetched by a real get re-rotated to
 * its place in B: what the verb's get returns. */

static kvr_testd D;

typedef struct fake_run {
    size_t ctx_off, prompt_off, n;
} fake_run;
static fake_run FR[8];
static size_t NFR;
static const char *F_CTX;
static bool F_CORRUPT;      /* a stream whose tokens do not match the prompt */

static int fake_fill(kvr_client *c, const kvr_cover_args *a, kvr_cover_res *out, bool get)
{
    memset(out, 0, sizeof *out);
    out->n_prompt = a->n_tokens;
    out->runs = calloc(NFR ? NFR : 1, sizeof *out->runs);
    if (!out->runs)
        return KVR_ENOMEM;
    out->n_runs = NFR;
    size_t covered = 0;
    for (size_t i = 0; i < NFR; i++) {
        out->runs[i] = (kvr_cover_run){ .prompt_off = FR[i].prompt_off, .ctx_id = F_CTX,
                                        .ctx_off = FR[i].ctx_off, .n_tokens = FR[i].n,
                                        .exact = false, .stream_off = covered };
        covered += FR[i].n;
    }
    out->n_covered = covered;
    if (!get)
        return 0;
    /* the stream: runs in prompt order, layer-major f16 */
    kvr_kv *kv = &out->kv;
    out->has_kv = true;
    kv->n_tokens = covered;
    kv->tokens = calloc(covered, sizeof *kv->tokens);
    kv->positions = calloc(covered, sizeof *kv->positions);
    kv->flags = calloc(covered, sizeof *kv->flags);
    kvr_kv part[8];
    memset(part, 0, sizeof part);
    size_t row = 0, nl = 0;
    for (size_t i = 0; i < NFR; i++) {
        int64_t pos[512];
        for (size_t t = 0; t < FR[i].n; t++)
            pos[t] = (int64_t)(FR[i].prompt_off + t);
        kvr_get_args g = { .ctx_id = F_CTX, .start = FR[i].ctx_off,
                           .end = FR[i].ctx_off + FR[i].n, .dtype = KVR_DTYPE_F16,
                           .positions = pos, .n_positions = FR[i].n };
        int r = kvr_client_get(c, &g, &part[i]);
        if (r < 0)
            return r;
        row = (size_t)part[i].n_kv_heads * part[i].head_dim;
        nl = part[i].n_layers;
        size_t so = out->runs[i].stream_off;
        for (size_t t = 0; t < FR[i].n; t++) {
            kv->tokens[so + t] = part[i].tokens[t] + (F_CORRUPT && i == 1 && t == 3);
            kv->positions[so + t] = part[i].positions[t];
            kv->flags[so + t] = part[i].flags[t] | KVR_TOKEN_APPROX;
        }
    }
    kv->dtype = KVR_DTYPE_F16;
    kv->n_layers = nl;
    kv->n_kv_heads = part[0].n_kv_heads;
    kv->head_dim = part[0].head_dim;
    snprintf(kv->model, sizeof kv->model, "%s", part[0].model);
    kv->payload_len = nl * 2 * covered * row * 2;
    uint8_t *pl = malloc(kv->payload_len);
    kv->payload = pl;
    for (size_t l = 0; l < nl; l++)
        for (int w = 0; w < 2; w++)
            for (size_t i = 0; i < NFR; i++) {
                const uint8_t *src = (const uint8_t *)part[i].payload +
                                     (l * 2 + (size_t)w) * FR[i].n * row * 2;
                memcpy(pl + (l * 2 + (size_t)w) * covered * row * 2 +
                           out->runs[i].stream_off * row * 2,
                       src, FR[i].n * row * 2);
            }
    for (size_t i = 0; i < NFR; i++)
        kvr_kv_release(&part[i]);
    return 0;
}

static int fake_cover(kvr_client *c, const kvr_cover_args *a, kvr_cover_res *out)
{
    return fake_fill(c, a, out, false);
}

static int fake_cover_get(kvr_client *c, const kvr_cover_args *a, kvr_cover_res *out)
{
    return fake_fill(c, a, out, true);
}

static void fake_release(kvr_cover_res *r)
{
    free(r->runs);
    free(r->kv.tokens);
    free(r->kv.positions);
    free(r->kv.flags);
    free(r->kv.payload);
    memset(r, 0, sizeof *r);
}

static kvr__wk_env E;
static kvr__wk_report REP;

static void cover_setup(void)
{
    cr_assert_eq(testd_start(&D, NULL), 0, "kvroped starts");
    char model[600];
    snprintf(model, sizeof model, "%s/eval/kvrope-code.gguf", testd_build_dir());
    cr_assert_eq(access(model, R_OK), 0, "the trained model %s is built (make)", model);
    memset(&E, 0, sizeof E);
    kvr__wk_rep_init(&REP, "test");
    E.rep = &REP;
    E.n_gen = 1;
    cr_assert_eq(kvr_client_connect(&E.kc, D.addr, NULL), 0);
    cr_assert_eq(kvr__wk_lm_load(&E.lm, model, 1, E.err, sizeof E.err), 0, "%s", E.err);
    cr_assert_eq(kvr__wk_register(&E, model), 0, "%s", E.err);
    cr_assert_eq(kvr__wk_lm_context(E.lm, 2048, E.err, sizeof E.err), 0, "%s", E.err);
    LM = E.lm;
    IN = kvr__wk_lm_info_get(LM);
    NFR = 0;
    F_CORRUPT = false;
}

static void cover_teardown(void)
{
    kvr__wk_lm_destroy(E.lm);
    LM = NULL;
    kvr__wk_env_bufs_free(&E);
    free(E.profile);
    kvr_client_close(E.kc);
    kvr__wk_rep_free(&REP);
    testd_stop(&D);
}

static void sync_commit(const int32_t *t, size_t n, const kvr__wk_sync_opts *o,
                        kvr__wk_sync_res *res)
{
    kvr__wk_step *st = NULL;
    cr_assert_eq(kvr__wk_sync(&E, t, n, o, &st, res), 0, "%s", E.err);
    cr_assert_eq(kvr__wk_commit(&E, st), 0, "%s", E.err);
    kvr__wk_step_free(st);
}

/* n greedy tokens after the synced prompt of length np (seq 0). */
static void greedy(size_t np, int32_t *out, size_t n)
{
    const float *lg = kvr__wk_lm_logits(LM);
    for (size_t i = 0; i < n; i++) {
        out[i] = kvr__wk_argmax(lg, IN->n_vocab);
        cr_assert_eq(kvr__wk_lm_decode(LM, &out[i], 1, (int32_t)(np + i), 0, KVR_WK_LOGITS_LAST,
                                      NULL, NULL, err, sizeof err), 0, "%s", err);
        lg = kvr__wk_lm_logits(LM);
    }
}

/* Prompt A stored as context ctx-a by the session engine; the stand-in verb
 * answers B's three chunks from it. */
static void cover_prompt_a(const prompts *p, kvr__wk_sync_res *res)
{
    kvr__wk_sync_opts oa = { .session = "ctx-a", .no_cover = true };
    sync_commit(p->a, p->na, &oa, res);
    F_CTX = "ctx-a";
    E.cover = (kvr__wk_cover_api){ fake_cover, fake_cover_get, fake_release };
    NFR = 0;
    for (int j = 0; j < 3; j++) {
        int i = p->order_b[j];
        FR[NFR++] = (fake_run){ p->a_off[i], p->b_off[i], p->len[i] };
    }
}

TestSuite(llama_cover, .init = cover_setup, .fini = cover_teardown, .timeout = 600);

Test(llama_cover, sync_places_runs_repairs_seams_and_stores_flags)
{
    prompts p;
    make_prompts(&p);
    kvr__wk_sync_res res;
    cover_prompt_a(&p, &res);
    size_t placed = p.len[0] + p.len[1] + p.len[2];

    /* the default repair: EPIC first 16 of each run */
    kvr__wk_sync_opts ob = { .session = "ctx-b" };
    sync_commit(p.b, p.nb, &ob, &res);
    cr_assert_str_eq(res.source, "cover");
    cr_assert_eq(res.n_placed, placed);
    cr_assert_eq(res.n_runs, 3);
    cr_assert_eq(res.n_repaired, 3 * KVR_WK_REPAIR_DEFAULT_K);
    cr_assert_eq(res.n_computed, p.nb - placed + res.n_repaired);
    cr_assert_eq(res.n_reused + res.n_computed, p.nb);
    /* stored: B's tokens at 0..n-1, exact before the first unrepaired placed
     * token, approximate from there */
    kvr_get_args g = { .ctx_id = "ctx-b", .dtype = KVR_DTYPE_F16, .meta_only = true };
    kvr_kv m;
    cr_assert_eq(kvr_client_get(E.kc, &g, &m), 0, "%s", kvr_client_last_error(E.kc));
    cr_assert_eq(m.n_tokens, p.nb);
    size_t f = p.b_off[p.order_b[0]] + KVR_WK_REPAIR_DEFAULT_K;
    cr_assert_eq(res.n_approx, p.nb - f);
    for (size_t i = 0; i < p.nb; i++) {
        cr_assert_eq(m.tokens[i], (uint32_t)p.b[i]);
        cr_assert_eq(m.positions[i], (int64_t)i);
        cr_assert_eq(!!(m.flags[i] & KVR_TOKEN_APPROX), i >= f, "token %zu flagged %s", i,
                     i >= f ? "approximate" : "exact");
    }
    kvr_kv_release(&m);

    /* everything repaired: the greedy continuation is a full encode's */
    int32_t want[16], got[16];
    kvr__wk_sync_opts full = { .no_cache = true };
    kvr__wk_step *st = NULL;
    cr_assert_eq(kvr__wk_sync(&E, p.b, p.nb, &full, &st, &res), 0, "%s", E.err);
    kvr__wk_step_free(st);
    greedy(p.nb, want, 16);
    kvr__wk_repair_opts all = { .all = true };
    kvr__wk_sync_opts oc = { .session = "ctx-c", .repair = &all };
    sync_commit(p.b, p.nb, &oc, &res);
    cr_assert_str_eq(res.source, "cover");
    cr_assert_eq(res.n_repaired, placed);
    cr_assert_eq(res.n_approx, 0);
    greedy(p.nb, got, 16);
    cr_assert_arr_eq(got, want, sizeof want, "all repaired: the same greedy tokens as a full "
                     "encode");
    free_prompts(&p);
}

/* A cover that places too little is not taken; one that does not match the
 * prompt is refused with a reason and stores nothing. */
Test(llama_cover, small_or_wrong_covers)
{
    prompts p;
    make_prompts(&p);
    kvr__wk_sync_res res;
    cover_prompt_a(&p, &res);
    F_CORRUPT = true;
    kvr__wk_step *st = NULL;
    kvr__wk_sync_opts od = { .session = "ctx-d" };
    cr_assert_lt(kvr__wk_sync(&E, p.b, p.nb, &od, &st, &res), 0);
    cr_assert_null(st);
    cr_assert(strstr(E.err, "does not match the prompt"), "%s", E.err);
    kvr_context info;
    cr_assert_eq(kvr_client_stat(E.kc, "ctx-d", &info), KVR_ENOCTX, "nothing stored");
    F_CORRUPT = false;
    int i = p.order_b[1];
    NFR = 1;
    FR[0] = (fake_run){ p.a_off[i], p.b_off[i], KVR_COVER_MIN_RUN - 1 };
    kvr__wk_sync_opts ob = { .session = "ctx-b" };
    sync_commit(p.b, p.nb, &ob, &res);
    cr_assert_str_neq(res.source, "cover");
    cr_assert_eq(res.n_placed, 0);

    free_prompts(&p);
}
