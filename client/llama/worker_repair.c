/*
 * worker_repair.c — seam repair: a prompt whose KV is partly placed (runs
 * of tokens cached with another left context, keys re-rotated to their
 * place here) and partly gaps is made usable by computing the gaps and a
 * repair set of placed tokens (worker.h, "seam repair").
 *
 * Policies:
 *  - EPIC (LegoLink): the first k tokens of every placed run. A run's first
 *    tokens attended to a left context that is gone; attention sinks form
 *    there, so they deviate most, and they are cheap to find.
 *  - CacheBlend: the placed tokens whose K/V at one early layer L deviates
 *    most from what a full encode gives (HKVD tokens). A share of the
 *    placed tokens. How the full encode's layer-L K/V is obtained here:
 *    layer 0's K and V depend only on a token and its position, so the
 *    placed tokens' layer-0 KV (re-rotated exactly) already equals a full
 *    encode's; layer L's inputs therefore need layers 0..L-1 run over the
 *    whole prompt, which a probe decode does (every token through seq 1, the
 *    graph cut right after layer L's K and V projections: L layers of
 *    attention and FFN plus one projection per token, about L / n_layer of
 *    a full encode; kvr__wk_repair_res.probe_layers). For L = 1 the fresh
 *    K/V the selection compares against is exactly the full encode's. What
 *    is approximated is CacheBlend's premise itself: that the tokens that
 *    deviate most at layer L are the ones whose recomputation helps most at
 *    every layer. CacheBlend also refines the set layer by layer inside one
 *    forward pass; llama.cpp's API has no partial-layer recompute, so the set
 *    chosen at layer L is recomputed through all layers.
 *
 * Invariants:
 *  - Gaps are always computed; `all` computes every token, so the result
 *    is a full encode in the same decode order (runs in increasing
 *    position, each seeing everything before it).
 *  - Tokens are decoded in increasing position, runs batched into as few
 *    llama_decode calls as the scratch sequences and free cells allow
 *    (decode_plan): a run sees every gap before it computed, the repaired
 *    KV of earlier groups and the placed KV of earlier runs of its group. A
 *    gap ends a group. `all` is one run, one group: a full encode.
 *  - The prompt's last token is always computed: its logits are current
 *    afterwards, as after kvr__wk_sync.
 *  - The selection pass leaves seq 1 empty and seq 0 as it was.
 */
#include <assert.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "client/llama/worker.h"
#include "rope/rope.h"

/* ---- policy text ---------------------------------------------------------- */

static int parse_one(const char *s, size_t len, kvr__wk_repair_opts *o, char *err, size_t errlen)
{
    char buf[64];
    if (len == 0 || len >= sizeof buf)
        goto bad;
    memcpy(buf, s, len);
    buf[len] = 0;
    char *end;
    if (strcmp(buf, "none") == 0)
        return 0;
    if (strcmp(buf, "all") == 0) {
        o->all = true;
        return 0;
    }
    if (strncmp(buf, "epic:", 5) == 0) {
        unsigned long k = strtoul(buf + 5, &end, 10);
        if (end == buf + 5 || *end || k > 1u << 20)
            goto bad;
        o->first_k = (uint32_t)k;
        return 0;
    }
    if (strncmp(buf, "blend:", 6) == 0) {
        double v = strtod(buf + 6, &end);
        if (end == buf + 6)
            goto bad;
        if (*end == '%')
            v /= 100.0, end++;
        unsigned long layer = 1;
        if (*end == '@') {
            char *e2;
            layer = strtoul(end + 1, &e2, 10);
            if (e2 == end + 1 || layer == 0 || layer > 4096)
                goto bad;
            end = e2;
        }
        if (*end || !(v > 0.0 && v <= 1.0))
            goto bad;
        o->blend_share = v;
        o->blend_layer = (uint32_t)layer;
        return 0;
    }
bad:
    snprintf(err, errlen,
             "repair policy '%.*s': expected none, all, epic:K or blend:SHARE[@LAYER] "
             "(SHARE in (0, 1] or N%%), joined by '+'", (int)(len < 64 ? len : 64), s);
    return KVR_EINVAL;
}

int kvr__wk_repair_parse(const char *s, kvr__wk_repair_opts *o, char *err, size_t errlen)
{
    memset(o, 0, sizeof *o);
    if (!s || !*s)
        return parse_one("", 0, o, err, errlen);
    for (const char *p = s;;) {
        const char *q = strchr(p, '+');
        size_t len = q ? (size_t)(q - p) : strlen(p);
        int r = parse_one(p, len, o, err, errlen);
        if (r < 0)
            return r;
        if (!q)
            return 0;
        p = q + 1;
    }
}

/* ---- the plan (no llama.cpp) ---------------------------------------------- */

typedef struct scored {
    float  dev;
    size_t i;
} scored;

static int by_dev_desc(const void *a, const void *b)
{
    const scored *x = a, *y = b;
    if (x->dev != y->dev)
        return x->dev > y->dev ? -1 : 1;
    return x->i < y->i ? -1 : x->i > y->i;
}

size_t kvr__wk_repair_plan(const uint8_t *placed, const uint8_t *run_start, size_t n,
                          const float *dev, const kvr__wk_repair_opts *o, uint8_t *compute)
{
    size_t n_cand = 0, chosen = 0;     /* candidates: placed approximate tokens */
    for (size_t i = 0; i < n; i++) {
        compute[i] = placed[i] ? 0 : 1;
        n_cand += placed[i] == KVR_WK_PLACED;
    }
    if (o->all) {
        for (size_t i = 0; i < n; i++) {
            chosen += placed[i] != 0;
            compute[i] = 1;
        }
        return chosen;
    }
    if (o->first_k) {
        size_t since = 0;     /* tokens of the current run so far */
        for (size_t i = 0; i < n; i++) {
            if (!placed[i]) {
                since = 0;
                continue;
            }
            bool starts = run_start ? run_start[i] != 0 : (i == 0 || !placed[i - 1]);
            since = starts ? 1 : since + 1;
            if (since <= o->first_k && placed[i] == KVR_WK_PLACED && !compute[i]) {
                compute[i] = 1;
                chosen++;
            }
        }
    }
    if (o->blend_share > 0 && dev && n_cand) {
        size_t budget = (size_t)ceil(o->blend_share * (double)n_cand - 1e-9);
        scored *sc = malloc(n_cand * sizeof *sc);
        if (sc) {
            size_t m = 0;
            for (size_t i = 0; i < n; i++)
                if (placed[i] == KVR_WK_PLACED)
                    sc[m++] = (scored){ isnan(dev[i]) ? INFINITY : dev[i], i };
            qsort(sc, m, sizeof *sc, by_dev_desc);
            /* the budget is the blend's own: tokens EPIC already took count */
            for (size_t j = 0; j < m && j < budget; j++)
                if (!compute[sc[j].i]) {
                    compute[sc[j].i] = 1;
                    chosen++;
                }
            free(sc);
        } else {
            /* no memory for the ranking: recompute every candidate (the safe
             * side: exact, only slower) */
            for (size_t i = 0; i < n; i++)
                if (placed[i] == KVR_WK_PLACED && !compute[i]) {
                    compute[i] = 1;
                    chosen++;
                }
        }
    }
    return chosen;
}

/* ---- the selection pass ----------------------------------------------------- */

static float elem(const uint8_t *base, size_t idx, int32_t type)
{
    uint16_t h;
    if (type == KVR_WK_GGML_F32) {
        float f;
        memcpy(&f, base + idx * 4, 4);
        return f;
    }
    memcpy(&h, base + idx * 2, 2);
    return type == KVR_WK_GGML_BF16 ? kvr_bf16_to_f32(h) : kvr_f16_to_f32(h);
}

/* dev[i] for every placed token: squared distance of layer L's K and V in
 * seq 0 (placed) from the probe's (full-encode) K and V. */
static int deviations(kvr__wk_lm *lm, const int32_t *toks, size_t n, const uint8_t *placed,
                      uint32_t layer, float *dev, kvr__wk_repair_res *res, char *err,
                      size_t errlen)
{
    const kvr__wk_lm_info *in = kvr__wk_lm_info_get(lm);
    if (layer >= in->n_layer) {
        snprintf(err, errlen, "blend layer %u: the model has %u layers", layer, in->n_layer);
        return KVR_EINVAL;
    }
    if (!kvr__wk_lm_probe_on(lm)) {
        snprintf(err, errlen, "blend repair needs a probing context (kvr__wk_lm_set_probe)");
        return KVR_EINVAL;
    }
    size_t row = (size_t)in->n_head_kv * in->head_dim;
    kvr__wk_probe p = { .layer = layer, .row = row, .cap = n };
    p.k = malloc(n * row * sizeof(float));
    p.v = malloc(n * row * sizeof(float));
    uint8_t *sb = NULL;
    size_t slen = 0;
    kvr__wk_state st;
    memset(&st, 0, sizeof st);
    long *cell = malloc(n * sizeof *cell);
    int r = 0;
    if (!p.k || !p.v || !cell) {
        snprintf(err, errlen, "out of memory for the selection pass of %zu tokens", n);
        r = KVR_ENOMEM;
        goto out;
    }
    double t0 = kvr__wk_now_ms();
    kvr__wk_lm_seq_rm(lm, 1, -1, -1);
    r = kvr__wk_lm_probe_decode(lm, &p, toks, n, 0, 1, err, errlen);
    kvr__wk_lm_seq_rm(lm, 1, -1, -1);
    if (r < 0)
        goto out;
    res->n_probed = n;
    res->probe_layers = layer + 0.5;   /* L full layers + the QKV projection (~half a layer) */
    if ((r = kvr__wk_lm_state_get(lm, &sb, &slen, err, errlen)) < 0)
        goto out;
    char why[256];
    if ((r = kvr__wk_state_parse(&st, sb, slen, why, sizeof why)) < 0) {
        snprintf(err, errlen, "llama.cpp's own state: %s", why);
        goto out;
    }
    if (st.n_cells && (st.n_layer != in->n_layer || st.n_embd != row)) {
        snprintf(err, errlen, "llama.cpp's state has %u layers x %u, the model %u x %zu",
                 st.n_layer, st.n_embd, in->n_layer, row);
        r = KVR_EINVAL;
        goto out;
    }
    for (size_t i = 0; i < n; i++)
        cell[i] = -1;
    for (uint32_t c = 0; c < st.n_cells; c++)
        if (st.pos[c] >= 0 && (size_t)st.pos[c] < n)
            cell[st.pos[c]] = c;
    for (size_t i = 0; i < n; i++) {
        dev[i] = 0;
        if (placed[i] != KVR_WK_PLACED)
            continue;
        if (cell[i] < 0) {
            snprintf(err, errlen, "placed token %zu has no cell in seq 0", i);
            r = KVR_EINVAL;
            goto out;
        }
        size_t c = (size_t)cell[i];
        double d = 0;
        for (size_t j = 0; j < row; j++) {
            double dk = p.k[i * row + j] - elem(st.k[layer], c * row + j, st.type);
            size_t vi = st.v_trans ? j * st.n_cells + c : c * row + j;
            double dv = p.v[i * row + j] - elem(st.v[layer], vi, st.type);
            d += dk * dk + dv * dv;
        }
        dev[i] = (float)d;
    }
    res->t_probe_ms += kvr__wk_now_ms() - t0;
out:
    kvr__wk_state_free(&st);
    free(sb);
    free(cell);
    free(p.k);
    free(p.v);
    return r;
}

/* ---- repair ------------------------------------------------------------------ */

/* One llama_decode for a group of computed runs [s, e): run g in scratch
 * sequence 1 + g over a metadata copy of seq 0's cells before s (llama.cpp
 * wants each sequence's batch positions consecutive and right after its
 * last cell, so runs with placed cells between them cannot share one
 * sequence). Every run sees seq 0 as it was before the group: the repaired
 * KV of earlier groups, the placed (not yet repaired) KV of earlier runs of
 * its own group. The new cells are handed to seq 0 afterwards. */
typedef struct crun {
    size_t s, e;
} crun;

static int decode_group(kvr__wk_lm *lm, const int32_t *toks, size_t n, const crun *g, size_t ng,
                        kvr__wk_btok *bt, char *err, size_t errlen)
{
    size_t m = 0;
    for (size_t k = 0; k < ng; k++) {
        int q = 1 + (int)k;
        kvr__wk_lm_seq_rm(lm, q, -1, -1);
        if (g[k].s > 0)
            kvr__wk_lm_seq_cp(lm, 0, q, 0, (int32_t)g[k].s);
        for (size_t i = g[k].s; i < g[k].e; i++)
            bt[m++] = (kvr__wk_btok){ toks[i], (int32_t)i, q, i == n - 1 };
    }
    for (size_t k = 0; k < ng; k++)
        kvr__wk_lm_seq_rm(lm, 0, (int32_t)g[k].s, (int32_t)g[k].e);
    int r = kvr__wk_lm_decode_batch(lm, bt, m, NULL, NULL, err, errlen);
    for (size_t k = 0; k < ng; k++) {
        if (r == 0)
            kvr__wk_lm_seq_cp(lm, 1 + (int)k, 0, (int32_t)g[k].s, (int32_t)g[k].e);
        kvr__wk_lm_seq_rm(lm, 1 + (int)k, -1, -1);
    }
    return r;
}

/* Decodes the plan's runs in increasing position, as few decodes as the
 * scratch sequences allow (kvr__wk_lm_n_seq - 1 runs a group). A run holding
 * a gap token ends its group: runs after it must see the gap's KV, which
 * only exists once it is decoded. With one scratch sequence every run is
 * its own decode, each seeing every run before it repaired. */
static int decode_plan(kvr__wk_lm *lm, const int32_t *toks, size_t n, const uint8_t *placed,
                       const uint8_t *cmp, kvr__wk_repair_res *res, char *err, size_t errlen)
{
    size_t max_g = kvr__wk_lm_n_seq(lm) > 1 ? kvr__wk_lm_n_seq(lm) - 1 : 1;
    size_t n_c = 0;
    for (size_t i = 0; i < n; i++)
        n_c += cmp[i] != 0;
    crun *g = malloc(max_g * sizeof *g);
    kvr__wk_btok *bt = malloc((n_c ? n_c : 1) * sizeof *bt);
    int r = 0;
    if (!g || !bt) {
        snprintf(err, errlen, "out of memory for the repair decode of %zu tokens", n_c);
        r = KVR_ENOMEM;
        goto out;
    }
    /* free cells: the removed cells of a group's earlier runs stay held by
     * the later runs' scratch copies while the group decodes */
    uint32_t cap = kvr__wk_lm_n_ctx(lm);
    size_t room = cap > n + 1 ? cap - n - 1 : 0, held_next = 0;
    size_t ng = 0;
    for (size_t i = 0; i < n;) {
        if (!cmp[i]) {
            i++;
            continue;
        }
        size_t j = i, n_pl = 0;
        bool gap = false;
        while (j < n && cmp[j]) {
            n_pl += placed[j] != 0;
            gap |= !placed[j++];
        }
        if (ng && held_next + j - i > room) {   /* this run's cells would not fit */
            if ((r = decode_group(lm, toks, n, g, ng, bt, err, errlen)) < 0)
                goto out;
            res->n_decodes++;
            ng = 0;
            held_next = 0;
        }
        held_next += n_pl;
        g[ng++] = (crun){ i, j };
        res->n_computed += j - i;
        i = j;
        if (gap || ng == max_g || i >= n) {
            if ((r = decode_group(lm, toks, n, g, ng, bt, err, errlen)) < 0)
                goto out;
            res->n_decodes++;
            ng = 0;
            held_next = 0;
        }
    }
    if (ng && (r = decode_group(lm, toks, n, g, ng, bt, err, errlen)) == 0)
        res->n_decodes++;
out:
    free(g);
    free(bt);
    return r;
}


int kvr__wk_repair(kvr__wk_lm *lm, const int32_t *toks, size_t n, const uint8_t *placed,
                  const uint8_t *run_start, const kvr__wk_repair_opts *o, uint8_t *compute_out,
                  kvr__wk_repair_res *res, char *err, size_t errlen)
{
    memset(res, 0, sizeof *res);
    res->n_prompt = n;
    if (n == 0)
        return 0;
    for (size_t i = 0; i < n; i++)
        res->n_placed += placed[i] != 0;
    res->n_gap = n - res->n_placed;
    uint8_t *cmp = compute_out ? compute_out : malloc(n);
    size_t n_cand = 0;
    for (size_t i = 0; i < n; i++)
        n_cand += placed[i] == KVR_WK_PLACED;
    bool blend = o->blend_share > 0 && !o->all && n_cand > 0;
    float *dev = blend ? malloc(n * sizeof *dev) : NULL;
    int r = 0;
    if (!cmp || (blend && !dev)) {
        snprintf(err, errlen, "out of memory for the repair plan of %zu tokens", n);
        r = KVR_ENOMEM;
        goto out;
    }
    if (dev && (r = deviations(lm, toks, n, placed, o->blend_layer ? o->blend_layer : 1, dev,
                               res, err, errlen)) < 0)
        goto out;
    res->n_repaired = kvr__wk_repair_plan(placed, run_start, n, dev, o, cmp);
    cmp[n - 1] = 1;   /* its logits */
    double t0 = kvr__wk_now_ms();
    if ((r = decode_plan(lm, toks, n, placed, cmp, res, err, errlen)) < 0)
        goto out;
    res->t_decode_ms = kvr__wk_now_ms() - t0;
out:
    if (cmp != compute_out)
        free(cmp);
    free(dev);
    return r;
}

/* ---- the CLI's `repair` (the reuse eval's engine) ------------------------------ */

typedef struct rows_out {
    FILE  *f;
    size_t nv, skip_last;    /* the continuation's last row is not written */
    size_t n, written;
    int    werr;
} rows_out;

static void put_row(rows_out *o, const float *row)
{
    if (o->f && fwrite(row, sizeof *row, o->nv, o->f) != o->nv)
        o->werr = errno ? errno : EIO;
    o->written++;
}

static void on_rows(void *ud, size_t first, size_t n, const float *const *rows)
{
    rows_out *o = ud;
    for (size_t j = 0; j < n; j++)
        if (first + j + 1 < o->n)
            put_row(o, rows[j]);
}

int kvr__wk_repair_cmd(kvr__wk_env *e, const kvr__wk_repair_cmd_opts *o)
{
    kvr__wk_repair_opts ro;
    int r = kvr__wk_repair_parse(o->policy ? o->policy : "none", &ro, e->err, sizeof e->err);
    if (r < 0)
        return r;
    if (o->tokens_len % 4)
        return kvr__wk_fail(e, KVR_EINVAL, "token file: %zu bytes is not a whole number of int32 ids",
                           o->tokens_len);
    size_t N = o->tokens_len / 4, np = o->n_prompt;
    if (np == 0 || np > N)
        return kvr__wk_fail(e, KVR_EINVAL, "--prompt-len %zu: the token file holds %zu tokens", np, N);
    const kvr__wk_lm_info *in = kvr__wk_lm_info_get(e->lm);
    int32_t *T = malloc(N * sizeof *T);
    uint8_t *placed = calloc(np, 1), *starts = calloc(np, 1), *cmp = calloc(np, 1);
    kvr__wk_kvbin kv;
    memset(&kv, 0, sizeof kv);
    FILE *f = NULL;
    char tmp[4200] = "";
    if (!T || !placed || !starts || !cmp) {
        r = kvr__wk_fail(e, KVR_ENOMEM, "out of memory for %zu tokens", N);
        goto out;
    }
    for (size_t i = 0; i < N; i++) {
        const uint8_t *b = o->tokens + 4 * i;
        T[i] = (int32_t)((uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 |
                         (uint32_t)b[3] << 24);
        if (T[i] < 0 || (uint32_t)T[i] >= in->n_vocab) {
            r = kvr__wk_fail(e, KVR_EINVAL, "token %zu is %d: outside the vocabulary (0..%u)", i,
                            T[i], in->n_vocab - 1);
            goto out;
        }
    }
    if (o->kv && (r = kvr__wk_kvbin_parse(e, o->kv, o->kv_len, &kv)) < 0)
        goto out;
    for (uint32_t j = 0; j < kv.m; j++) {
        if (kv.pos[j] >= (int64_t)np) {
            r = kvr__wk_fail(e, KVR_EINVAL, "KV file: cell %u at position %lld is not in the prompt "
                            "(0..%zu)", j, (long long)kv.pos[j], np - 1);
            goto out;
        }
        if (placed[kv.pos[j]]) {
            r = kvr__wk_fail(e, KVR_EINVAL, "KV file: position %lld twice", (long long)kv.pos[j]);
            goto out;
        }
        placed[kv.pos[j]] = 1;
    }
    for (size_t i = 0; i < o->n_run_starts; i++) {
        if (o->run_starts[i] >= np || !placed[o->run_starts[i]]) {
            r = kvr__wk_fail(e, KVR_EINVAL, "--runs: %zu is not a placed position of the prompt",
                            o->run_starts[i]);
            goto out;
        }
        starts[o->run_starts[i]] = 1;
    }
    if (!o->n_run_starts)
        for (size_t i = 0; i < np; i++)
            starts[i] = placed[i] && (i == 0 || !placed[i - 1]);
    kvr__wk_lm_set_cache(e->lm, kv.m ? kv.ggml_type : KVR_WK_GGML_F16, KVR_WK_LM_SEQS);
    kvr__wk_lm_set_probe(e->lm, ro.blend_share > 0 && !ro.all);
    /* the selection pass holds the prompt twice (placed cells in seq 0, the
     * probe's in seq 1); so does a batched repair decode, at most */
    size_t cells = N + 16 + np;
    if ((r = kvr__wk_lm_context(e->lm, (uint32_t)cells, e->err, sizeof e->err)) < 0)
        goto out;
    if ((r = kvr__wk_kvbin_load(e, &kv, kv.pos)) < 0)
        goto out;
    kvr__wk_repair_res res;
    if ((r = kvr__wk_repair(e->lm, T, np, placed, starts, &ro, cmp, &res, e->err,
                           sizeof e->err)) < 0)
        goto out;
    rows_out ro_ = { .nv = in->n_vocab, .n = N - np };
    if (o->logits_out) {
        snprintf(tmp, sizeof tmp, "%s.tmp-%ld", o->logits_out, (long)getpid());
        if (!(f = fopen(tmp, "wb"))) {
            r = kvr__wk_fail(e, -errno, "logits file %s: %s", o->logits_out, strerror(errno));
            goto out;
        }
        ro_.f = f;
    }
    if (N > np)
        put_row(&ro_, kvr__wk_lm_logits(e->lm));
    double t0 = kvr__wk_now_ms();
    if (N - np > 1 && (r = kvr__wk_lm_decode(e->lm, T + np, N - np, (int32_t)np, 0,
                                            KVR_WK_LOGITS_ALL, on_rows, &ro_, e->err,
                                            sizeof e->err)) < 0)
        goto out;
    double t_cont = kvr__wk_now_ms() - t0;
    if (f) {
        int fe = ro_.werr;
        if (fclose(f) != 0 && !fe)
            fe = errno ? errno : EIO;
        f = NULL;
        if (fe || rename(tmp, o->logits_out) != 0) {
            r = kvr__wk_fail(e, -EIO, "logits file %s: %s", o->logits_out,
                            strerror(fe ? fe : errno));
            goto out;
        }
        tmp[0] = 0;
    }
    kvr__wk_rep_num(e->rep, "repair", "prompt", (double)res.n_prompt);
    kvr__wk_rep_num(e->rep, "repair", "placed", (double)res.n_placed);
    kvr__wk_rep_num(e->rep, "repair", "gaps", (double)res.n_gap);
    kvr__wk_rep_num(e->rep, "repair", "repaired", (double)res.n_repaired);
    kvr__wk_rep_num(e->rep, "repair", "computed", (double)res.n_computed);
    kvr__wk_rep_num(e->rep, "repair", "probed", (double)res.n_probed);
    kvr__wk_rep_num(e->rep, "repair", "decodes", (double)res.n_decodes);
    kvr__wk_rep_num(e->rep, "repair", "probe_layers", res.probe_layers);
    kvr__wk_rep_num(e->rep, "repair", "n_layer", (double)in->n_layer);
    kvr__wk_rep_num(e->rep, NULL, "rows", (double)ro_.written);
    kvr__wk_rep_num(e->rep, "timings_ms", "probe", res.t_probe_ms);
    kvr__wk_rep_num(e->rep, "timings_ms", "repair_decode", res.t_decode_ms);
    kvr__wk_rep_num(e->rep, "timings_ms", "continuation", t_cont);
    kvr__wk_rep_line(e->rep, "repair: %zu prompt tokens, %zu placed, %zu gaps; %zu placed tokens "
                    "repaired, %zu computed%s", res.n_prompt, res.n_placed, res.n_gap,
                    res.n_repaired, res.n_computed, res.n_probed ? " (after a selection pass)" : "");
out:
    if (f)
        fclose(f);
    if (tmp[0])
        unlink(tmp);
    free(kv.pos);
    free(T);
    free(placed);
    free(starts);
    free(cmp);
    return r;
}
