/*
 * worker_score.c — `kvrope-llama score`: the next-token logits of a token
 * sequence T over a KV cache handed over as a file (KV.bin, docs/llama.md:
 * the payload a kvrope get returns, with its positions), and greedy
 * continuations from chosen points. No daemon: the caller (eval/run.py's measurements)
 * does every kvrope operation itself and gives llama.cpp the resulting KV.
 *
 * Rows: row i (F <= i < N-1) is the logits after T[i], predicting T[i+1].
 *  - i >= m (after the cache): T[m..N) are decoded in seq 0 at P, P+1, ...,
 *    in batches: a plain causal decode on top of every cached cell.
 *  - i < m (inside the cache, for PIE): T[i] is decoded afresh at
 *    positions[i] in a scratch sequence that holds the cached cells 0..i-1
 *    only (llama_memory_seq_cp, metadata only in the unified cache), up to
 *    n_seq - 1 queries per decode in distinct scratch sequences, each
 *    removed after (llama_memory_seq_rm). Needs positions strictly
 *    increasing.
 *
 * Cell positions. For RoPE models without a sliding window (pos_mask_only)
 * llama.cpp uses a cell's position only in the causal mask (the cell is
 * visible to a query at p when cell.pos <= p) and in the batch check that a
 * sequence's new tokens start right after its last cell; the keys carry
 * their rotation already. The cells are loaded at positions[] whenever that
 * works, otherwise at positions giving the same visibility:
 *  - inside the cache: cell j at positions[j+1]-1 (j < m-1), so query i's
 *    scratch sequence ends at positions[i]-1 whatever the gaps (the same as
 *    positions[] when there are none);
 *  - after the cache: cell j at min(positions[j], P-1) and the cells at the
 *    largest position at P-1 (the same as positions[] when P = max+1, the
 *    default).
 * Either way each query attends to exactly the cells it should. For other
 * models the positions go in as given and the cases that would need the
 * move are refused.
 *
 * --exact: the in-cache rows one at a time, from the last down, each T[i]
 * decoded in seq 0 itself after the cells from i on are dropped, so that it
 * sits in cell i as in a full forward and flash attention groups the cells
 * as there: with a cache that is llama.cpp's own, the rows are the full
 * forward's bit for bit (otherwise ~1e-7 of the logits, more where f16
 * weights round the activations), at one padded decode per row.
 *
 * One kernel for every row. llama.cpp's CPU flash attention takes a tiled
 * kernel for a batch of 64 query rows or more and another one below, and
 * the two differ by ~1e-3 of the logits; a row's result in the tiled kernel
 * does not depend on the other rows of its batch. Likewise its matrix
 * products take one kernel (llamafile's sgemm) for two rows or more and
 * another for one, and the last layer's FFN and the output projection run
 * on the output rows only. So every decode that produces rows (and the
 * first one of each generation) carries at least PAD_MIN tokens and never
 * a single output row, filled up with throw-away tokens in a sequence of
 * their own (the last one, emptied after): every row is what a full forward
 * of 64 tokens or more with every row's logits gives. The greedy steps after the first decode one
 * token at a time, as plain llama.cpp generation does.
 *
 * Invariants: every input is checked before the context is created or the
 * logits file opened; the logits file appears complete or not at all
 * (written under a temporary name, renamed at the end); rows are written
 * in increasing i.
 */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "client/llama/worker.h"
#include "base/le.h"

#define KVBIN_MAGIC "KVRKV1\0\0"
#define KVBIN_HDR   32
#define MAX_TOKENS  (1u << 24)
#define MAX_QUERIES 126           /* scratch sequences per in-cache decode */
#define PAD_MIN     64            /* tokens per llama_decode at least (GGML_FA_TILE_Q) */


/* ---- KV.bin ------------------------------------------------------------- */
/* Writes the KV of the n appended tokens (positions P..P+n-1 of sequence 0)
 * as a KV.bin in the cache's own type: what llama.cpp computed for them, so
 * a caller can store it in kvrope. Under a temporary name, renamed when whole. */
static int kv_out_write(kvr__wk_env *e, const char *path, int64_t P, size_t n)
{
    const kvr__wk_lm_info *in = kvr__wk_lm_info_get(e->lm);
    uint8_t *buf = NULL, *pay = NULL;
    size_t len = 0;
    uint32_t *cells = NULL;
    kvr__wk_state st;
    memset(&st, 0, sizeof st);
    FILE *f = NULL;
    char tmp[4200];
    int r = kvr__wk_lm_state_get(e->lm, &buf, &len, e->err, sizeof e->err);
    if (r < 0)
        return r;
    if ((r = kvr__wk_state_parse(&st, buf, len, e->err, sizeof e->err)) < 0)
        goto out;
    uint32_t dt = st.type == KVR_WK_GGML_F32 ? 0 : st.type == KVR_WK_GGML_F16 ? 1 : 2;
    size_t bytes = (size_t)st.n_layer * 2 * n * st.n_embd * st.el;
    cells = malloc((n ? n : 1) * sizeof *cells);
    pay = malloc(bytes ? bytes : 1);
    if (!cells || !pay) {
        r = kvr__wk_fail(e, KVR_ENOMEM, "out of memory for the --kv-out payload");
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        long c = kvr__wk_state_find(&st, (int32_t)(P + (int64_t)i));
        if (c < 0) {
            r = kvr__wk_fail(e, KVR_EIO, "--kv-out: llama.cpp's state has no cell at position %lld",
                     (long long)(P + (int64_t)i));
            goto out;
        }
        cells[i] = (uint32_t)c;
    }
    kvr__wk_state_gather(&st, cells, n, pay);
    snprintf(tmp, sizeof tmp, "%s.tmp-%ld", path, (long)getpid());
    if (!(f = fopen(tmp, "wb"))) {
        r = kvr__wk_fail(e, KVR_ESYS, "--kv-out %s: %s", path, strerror(errno));
        goto out;
    }
    uint8_t h[32];
    memcpy(h, "KVRKV1\0\0", 8);
    uint32_t hv[6] = { st.n_layer, (uint32_t)n, in->n_head_kv, in->head_dim, dt, 0 };
    for (int k = 0; k < 6; k++)
        for (int b = 0; b < 4; b++)
            h[8 + 4 * k + b] = (uint8_t)(hv[k] >> (8 * b));
    bool ok = fwrite(h, 1, sizeof h, f) == sizeof h;
    for (size_t i = 0; ok && i < n; i++) {
        uint64_t p = (uint64_t)(P + (int64_t)i);
        uint8_t pb[8];
        for (int b = 0; b < 8; b++)
            pb[b] = (uint8_t)(p >> (8 * b));
        ok = fwrite(pb, 1, 8, f) == 8;
    }
    ok = ok && fwrite(pay, 1, bytes, f) == bytes;
    ok = fflush(f) == 0 && ok;
    if (fclose(f) != 0)
        ok = false;
    f = NULL;
    if (!ok || rename(tmp, path) != 0) {
        r = kvr__wk_fail(e, KVR_EIO, "--kv-out %s: %s", path, strerror(errno ? errno : EIO));
        unlink(tmp);
        goto out;
    }
out:
    if (f) {
        fclose(f);
        unlink(tmp);
    }
    kvr__wk_state_free(&st);
    free(cells);
    free(pay);
    free(buf);
    return r;
}

typedef kvr__wk_kvbin kvbin;

static const char *dtype_name(uint32_t d) { return d == 0 ? "f32" : d == 1 ? "f16" : "bf16"; }

int kvr__wk_kvbin_parse(kvr__wk_env *e, const uint8_t *b, size_t len, kvbin *kv)
{
    const kvr__wk_lm_info *in = kvr__wk_lm_info_get(e->lm);
    memset(kv, 0, sizeof *kv);
    if (len < 8 || memcmp(b, KVBIN_MAGIC, 8) != 0)
        return kvr__wk_fail(e, KVR_EINVAL, "KV file: not a KV.bin file (no \"KVRKV1\" magic)");
    if (len < KVBIN_HDR)
        return kvr__wk_fail(e, KVR_EINVAL, "KV file: truncated in its header (%zu of %d bytes)", len,
                    KVBIN_HDR);
    kv->n_layers = kvr_le32_get(b + 8);
    kv->m = kvr_le32_get(b + 12);
    kv->n_kv_heads = kvr_le32_get(b + 16);
    kv->head_dim = kvr_le32_get(b + 20);
    kv->dtype = kvr_le32_get(b + 24);
    uint32_t reserved = kvr_le32_get(b + 28);
    if (reserved != 0)
        return kvr__wk_fail(e, KVR_EINVAL, "KV file: reserved header field is %u (must be 0)", reserved);
    if (kv->dtype > 2)
        return kvr__wk_fail(e, KVR_EINVAL, "KV file: dtype %u unknown (0 f32, 1 f16, 2 bf16)", kv->dtype);
    if (kv->n_layers != in->n_layer)
        return kvr__wk_fail(e, KVR_EINVAL, "KV file: %u layers, the model has %u (another model?)",
                    kv->n_layers, in->n_layer);
    if (kv->n_kv_heads != in->n_head_kv)
        return kvr__wk_fail(e, KVR_EINVAL, "KV file: %u KV heads, the model has %u (another model?)",
                    kv->n_kv_heads, in->n_head_kv);
    if (kv->head_dim != in->head_dim)
        return kvr__wk_fail(e, KVR_EINVAL, "KV file: head_dim %u, the model's is %u (another model?)",
                    kv->head_dim, in->head_dim);
    kv->ggml_type = kv->dtype == 0 ? KVR_WK_GGML_F32 : kv->dtype == 1 ? KVR_WK_GGML_F16
                                                                       : KVR_WK_GGML_BF16;
    uint64_t el = kv->dtype == 0 ? 4 : 2;
    uint64_t row = (uint64_t)kv->n_kv_heads * kv->head_dim * el;
    /* Layers, heads and head_dim are the model's (small): no overflow for
     * any 32-bit token count. */
    uint64_t need = KVBIN_HDR + 8 * (uint64_t)kv->m + (uint64_t)kv->n_layers * 2 * kv->m * row;
    if ((uint64_t)len < need)
        return kvr__wk_fail(e, KVR_EINVAL, "KV file: truncated: %zu bytes, %llu needed for %u tokens", len,
                    (unsigned long long)need, kv->m);
    if ((uint64_t)len > need)
        return kvr__wk_fail(e, KVR_EINVAL, "KV file: %llu trailing bytes after %u tokens",
                    (unsigned long long)((uint64_t)len - need), kv->m);
    kv->pos = malloc((kv->m ? kv->m : 1) * sizeof *kv->pos);
    if (!kv->pos)
        return kvr__wk_fail(e, KVR_ENOMEM, "out of memory for %u positions", kv->m);
    kv->pos_max = -1;
    for (uint32_t j = 0; j < kv->m; j++) {
        int64_t p = (int64_t)kvr_le64_get(b + KVBIN_HDR + 8 * (size_t)j);
        if (p < 0 || p >= INT32_MAX)
            return kvr__wk_fail(e, KVR_EINVAL, "KV file: position %lld of token %u is out of range "
                        "(0..%d)", (long long)p, j, INT32_MAX - 1);
        kv->pos[j] = p;
        if (p > kv->pos_max)
            kv->pos_max = p;
    }
    kv->payload = b + KVBIN_HDR + 8 * (size_t)kv->m;
    return 0;
}

/* Loads the cache into seq 0 with cell j at meta[j]; everything else goes. */
int kvr__wk_kvbin_load(kvr__wk_env *e, const kvbin *kv, const int64_t *meta)
{
    kvr__wk_lm_clear(e->lm);
    if (kv->m == 0)
        return 0;
    kvr__wk_sbuild sb;
    int r = kvr__wk_sbuild_init(&sb, kv->m, kv->n_layers, kv->ggml_type,
                               kv->n_kv_heads * kv->head_dim, kvr__wk_lm_v_trans(e->lm));
    if (r == 0)
        r = kvr__wk_sbuild_add(&sb, kv->payload, kv->m, 0, kv->m, meta);
    if (r < 0) {
        kvr__wk_sbuild_free(&sb);
        return kvr__wk_fail(e, r, "cannot build a llama.cpp state of %u cells", kv->m);
    }
    r = kvr__wk_lm_state_set(e->lm, sb.buf, sb.len, e->err, sizeof e->err);
    kvr__wk_sbuild_free(&sb);
    return r;
}

/* ---- rows ----------------------------------------------------------------- */
typedef struct sink {
    kvr__wk_env    *e;
    FILE          *f;
    const int32_t *T;
    size_t         nv;
    int64_t        off;     /* batch index + off = i */
    double         nll;
    size_t         top1, rows;
    int            werr;
} sink;

static void on_row(void *ud, size_t bi, const float *row)
{
    sink *s = ud;
    int64_t i = s->off + (int64_t)bi;
    int32_t next = s->T[i + 1];
    if (s->f && fwrite(row, sizeof *row, s->nv, s->f) != s->nv)
        s->werr = errno ? errno : EIO;
    s->nll += kvr__wk_nll(row, s->nv, next);
    s->top1 += kvr__wk_argmax(row, s->nv) == next;
    s->rows++;
}

typedef struct padded {
    kvr__wk_row_fn fn;
    void         *ud;
    size_t        n;
} padded;

static void on_padded(void *ud, size_t i, const float *row)
{
    padded *p = ud;
    if (i < p->n)
        p->fn(p->ud, i, row);
}

/* Decodes bt[0..n) (room for n + PAD_MIN), filled up to PAD_MIN tokens with
 * throw-away ones in sequence `pad_seq` (emptied after); a lone output row
 * gets a throw-away one beside it. */
static int decode_padded(kvr__wk_env *e, kvr__wk_btok *bt, size_t n, int pad_seq, kvr__wk_row_fn fn,
                         void *ud)
{
    const kvr__wk_lm_info *in = kvr__wk_lm_info_get(e->lm);
    size_t outs = 0;
    for (size_t k = 0; k < n; k++)
        outs += bt[k].logits;
    size_t pad = n < PAD_MIN ? PAD_MIN - n : 0, extra = outs == 1;
    if (pad < extra)
        pad = extra;
    for (size_t k = 0; k < pad; k++)
        bt[n + k] = (kvr__wk_btok){ in->bos >= 0 ? in->bos : 0, (int32_t)k, pad_seq, k < extra };
    padded pd = { fn, ud, n };
    int r = kvr__wk_lm_decode_batch(e->lm, bt, n + pad, on_padded, &pd, e->err, sizeof e->err);
    if (pad)
        kvr__wk_lm_seq_rm(e->lm, pad_seq, -1, -1);
    return r;
}

typedef struct first_row {
    float *row;
    size_t nv;
} first_row;

static void on_first(void *ud, size_t i, const float *row)
{
    first_row *f = ud;
    if (i == 0)
        memcpy(f->row, row, f->nv * sizeof *row);
}

/* Greedy from "seq 1 holds the cells before tok": tok decoded at pos (a
 * padded decode, as a scored row), then up to n tokens one at a time
 * (stopping after stop). seq 1 is emptied after. bt: room for PAD_MIN + 1,
 * row: n_vocab floats. */
static int greedy(kvr__wk_env *e, int32_t tok, int32_t pos, int64_t n, bool has_stop,
                  int32_t stop, int pad_seq, kvr__wk_btok *bt, float *row, int32_t *out,
                  size_t *n_out)
{
    size_t nv = kvr__wk_lm_info_get(e->lm)->n_vocab;
    *n_out = 0;
    bt[0] = (kvr__wk_btok){ tok, pos, 1, true };
    first_row fr = { row, nv };
    int r = decode_padded(e, bt, 1, pad_seq, on_first, &fr);
    const float *l = row;
    for (int64_t k = 0; r == 0 && k < n; k++) {
        out[k] = kvr__wk_argmax(l, nv);
        (*n_out)++;
        if ((has_stop && out[k] == stop) || k + 1 == n)
            break;
        r = kvr__wk_lm_decode(e->lm, &out[k], 1, pos + 1 + (int32_t)k, 1, KVR_WK_LOGITS_LAST,
                             NULL, NULL, e->err, sizeof e->err);
        l = kvr__wk_lm_logits(e->lm);
    }
    kvr__wk_lm_seq_rm(e->lm, 1, -1, -1);
    return r;
}

/* ---- the command ---------------------------------------------------------- */
int kvr__wk_score(kvr__wk_env *e, const kvr__wk_score_opts *o)
{
    kvr__wk_report *R = e->rep;
    const kvr__wk_lm_info *in = kvr__wk_lm_info_get(e->lm);
    size_t nv = in->n_vocab;
    kvbin kv;
    memset(&kv, 0, sizeof kv);
    kv.pos_max = -1;                /* no cache: P defaults to 0 */
    int32_t *T = NULL, **gen = NULL;
    size_t *n_out = NULL;
    int64_t *metaA = NULL, *metaB = NULL;
    kvr__wk_btok *bt = NULL;
    float *row = NULL;
    char tmp[4200] = "";
    FILE *f = NULL;
    int r = 0;

    /* Tokens. */
    if (o->tokens_len % 4)
        return kvr__wk_fail(e, KVR_EINVAL, "token file: %zu bytes is not a whole number of int32 ids",
                    o->tokens_len);
    size_t N = o->tokens_len / 4;
    if (N == 0)
        return kvr__wk_fail(e, KVR_EINVAL, "token file: no tokens");
    if (N > MAX_TOKENS)
        return kvr__wk_fail(e, KVR_EINVAL, "token file: %zu tokens, at most %u", N, MAX_TOKENS);
    T = malloc(N * sizeof *T);
    if (!T)
        return kvr__wk_fail(e, KVR_ENOMEM, "out of memory for %zu tokens", N);
    for (size_t i = 0; i < N; i++) {
        T[i] = (int32_t)kvr_le32_get(o->tokens + 4 * i);
        if (T[i] < 0 || (uint32_t)T[i] >= nv) {
            r = kvr__wk_fail(e, KVR_EINVAL, "token file: id %d at index %zu is not in the vocabulary "
                     "(0..%zu)", T[i], i, nv - 1);
            goto out;
        }
    }
    /* The cache. */
    if (o->kv && (r = kvr__wk_kvbin_parse(e, o->kv, o->kv_len, &kv)) < 0)
        goto out;
    size_t m = kv.m;
    if (m > N) {
        r = kvr__wk_fail(e, KVR_EINVAL, "KV file holds %zu tokens, more than the %zu of the token file "
                 "(T must start with the cached tokens)", m, N);
        goto out;
    }
    int64_t F = o->has_from ? o->from : (int64_t)m;
    if (F < 0 || F > (int64_t)N) {
        r = kvr__wk_fail(e, KVR_EINVAL, "--from %lld is outside 0..%zu", (long long)F, N);
        goto out;
    }
    int64_t P = o->has_next_pos ? o->next_pos : kv.pos_max + 1;
    if (o->kv_out && N == m) {
        r = kvr__wk_fail(e, KVR_EINVAL, "--kv-out: no tokens after the cache to write the KV of");
        goto out;
    }
    if (o->has_stop && (o->stop < 0 || (uint32_t)o->stop >= nv)) {
        r = kvr__wk_fail(e, KVR_EINVAL, "--stop-token %d is not in the vocabulary (0..%zu)", o->stop,
                 nv - 1);
        goto out;
    }
    int64_t endA = (int64_t)(m < N - 1 ? m : N - 1);         /* in-cache rows [F, endA) */
    int64_t startB = F > (int64_t)m ? F : (int64_t)m;         /* appended rows [startB, N-1) */
    int64_t rowsA = F < endA ? endA - F : 0;
    int64_t rowsB = startB < (int64_t)N - 1 ? (int64_t)N - 1 - startB : 0;
    bool genA = false, genB = false;
    int64_t max_gen = 0;
    for (size_t g = 0; g < o->n_gen; g++) {
        const kvr__wk_gen_req *q = &o->gen[g];
        if (q->at < 0 || q->at >= (int64_t)N) {
            r = kvr__wk_fail(e, KVR_EINVAL, "--generate %lld:%lld: %lld is past the last token (%zu "
                     "tokens)", (long long)q->at, (long long)q->n, (long long)q->at, N);
            goto out;
        }
        if (q->n < 1) {
            r = kvr__wk_fail(e, KVR_EINVAL, "--generate %lld:%lld: nothing to generate", (long long)q->at,
                     (long long)q->n);
            goto out;
        }
        int64_t p0 = q->at < (int64_t)m ? kv.pos[q->at] : P + (q->at - (int64_t)m);
        if (p0 + q->n > INT32_MAX) {
            r = kvr__wk_fail(e, KVR_EINVAL, "--generate %lld:%lld runs past position %d", (long long)q->at,
                     (long long)q->n, INT32_MAX);
            goto out;
        }
        if (q->at < (int64_t)m)
            genA = true;
        else
            genB = true;
        if (q->n > max_gen)
            max_gen = q->n;
    }
    bool needA = rowsA > 0 || genA, needB = N > m && (rowsB > 0 || genB || o->kv_out);
    /* Where the cells sit in each phase (see the top of the file). */
    metaA = malloc((m ? m : 1) * sizeof *metaA);
    metaB = malloc((m ? m : 1) * sizeof *metaB);
    if (!metaA || !metaB) {
        r = kvr__wk_fail(e, KVR_ENOMEM, "out of memory");
        goto out;
    }
    bool same = true;
    if (needA) {
        for (size_t j = 1; j < m; j++)
            if (kv.pos[j] <= kv.pos[j - 1]) {
                r = kvr__wk_fail(e, KVR_EINVAL, "in-cache scoring (%s) needs strictly increasing cached "
                         "positions: token %zu is at %lld after %lld",
                         rowsA > 0 ? "--from before the end of the cache"
                                   : "--generate inside the cache",
                         j, (long long)kv.pos[j], (long long)kv.pos[j - 1]);
                goto out;
            }
        for (size_t j = 0; j < m; j++) {
            metaA[j] = j + 1 < m ? kv.pos[j + 1] - 1 : kv.pos[j];
            if (metaA[j] != kv.pos[j] && !in->pos_mask_only) {
                r = kvr__wk_fail(e, KVR_EINVAL, "in-cache scoring over positions with gaps (%lld after "
                         "%lld) is not supported for this model (%s)", (long long)kv.pos[j + 1],
                         (long long)kv.pos[j], in->arch);
                goto out;
            }
        }
    }
    if (needB) {
        if (m > 0 && P < 1) {
            r = kvr__wk_fail(e, KVR_EINVAL, "--next-pos 0 leaves no room for the cached cells before it");
            goto out;
        }
        if (P + (int64_t)(N - m) > INT32_MAX) {
            r = kvr__wk_fail(e, KVR_EINVAL, "--next-pos %lld + %zu tokens runs past position %d",
                     (long long)P, N - m, INT32_MAX);
            goto out;
        }
        for (size_t j = 0; j < m; j++) {
            metaB[j] = kv.pos[j] == kv.pos_max ? P - 1 : kv.pos[j] < P - 1 ? kv.pos[j] : P - 1;
            if (metaB[j] != kv.pos[j] && !in->pos_mask_only) {
                r = kvr__wk_fail(e, KVR_EINVAL, "--next-pos %lld must be the cache's last position + 1 "
                         "(%lld) for this model (%s)", (long long)P,
                         (long long)kv.pos_max + 1, in->arch);
                goto out;
            }
            if (needA && metaB[j] != metaA[j])
                same = false;
        }
    } else if (o->has_next_pos && P < 0) {
        r = kvr__wk_fail(e, KVR_EINVAL, "--next-pos %lld is negative", (long long)P);
        goto out;
    }

    /* The context: cells for the tokens plus the scratch queries or the
     * longest continuation. */
    uint32_t Q = needA && !o->exact ? (uint32_t)(rowsA < MAX_QUERIES ? (rowsA > 0 ? rowsA : 1)
                                                                     : MAX_QUERIES)
                                    : 1;
    uint64_t extra = (uint64_t)(Q > max_gen + 1 ? Q : max_gen + 1) + PAD_MIN;
    if ((uint64_t)N + extra + 16 > UINT32_MAX / 2) {
        r = kvr__wk_fail(e, KVR_EINVAL, "%zu tokens and %lld generated do not fit a context", N,
                 (long long)max_gen);
        goto out;
    }
    kvr__wk_lm_set_cache(e->lm, kv.m ? kv.ggml_type : KVR_WK_GGML_F16, 2 + Q);
    double t0 = kvr__wk_now_ms();
    if ((r = kvr__wk_lm_context(e->lm, (uint32_t)(N + extra + 16), e->err, sizeof e->err)) < 0)
        goto out;
    int pad_seq = (int)kvr__wk_lm_n_seq(e->lm) - 1;
    Q = (uint32_t)pad_seq - 1;
    size_t chunk = kvr__wk_lm_n_batch(e->lm) - 1;   /* one decode = one ubatch, with room
                                                     * for a throw-away output */
    if (chunk <= PAD_MIN + Q) {
        r = kvr__wk_fail(e, KVR_EINVAL, "the context's batch of %zu tokens is too small", chunk);
        goto out;
    }
    bt = malloc(((N > Q ? N : Q) + PAD_MIN + 1) * sizeof *bt);
    row = malloc(nv * sizeof *row);
    gen = calloc(o->n_gen ? o->n_gen : 1, sizeof *gen);
    n_out = calloc(o->n_gen ? o->n_gen : 1, sizeof *n_out);
    if (!bt || !row || !gen || !n_out) {
        r = kvr__wk_fail(e, KVR_ENOMEM, "out of memory");
        goto out;
    }
    for (size_t g = 0; g < o->n_gen; g++)
        if (!(gen[g] = malloc((size_t)o->gen[g].n * sizeof **gen))) {
            r = kvr__wk_fail(e, KVR_ENOMEM, "out of memory");
            goto out;
        }
    if (o->logits_out) {
        snprintf(tmp, sizeof tmp, "%s.tmp-%ld", o->logits_out, (long)getpid());
        if (!(f = fopen(tmp, "wb"))) {
            r = kvr__wk_fail(e, KVR_ESYS, "logits file %s: %s", o->logits_out, strerror(errno));
            tmp[0] = 0;
            goto out;
        }
    }
    sink sk = { .e = e, .f = f, .T = T, .nv = nv };
    double t_ctx = kvr__wk_now_ms() - t0, t_a = 0, t_b = 0, t_gen = 0, t_load = 0;

    /* Inside the cache. */
    if (needA) {
        double ta0 = kvr__wk_now_ms();
        if ((r = kvr__wk_kvbin_load(e, &kv, metaA)) < 0)
            goto out;
        t_load += kvr__wk_now_ms() - ta0;
        /* --exact: from the last row down, the cells from i on dropped (no
         * lower row needs them), T[i] decoded in seq 0 itself: it lands in
         * cell i, where the full forward has it. */
        for (int64_t i = endA - 1; o->exact && i >= F; i--) {
            kvr__wk_lm_seq_rm(e->lm, 0, (int32_t)kv.pos[i], -1);
            bt[0] = (kvr__wk_btok){ T[i], (int32_t)kv.pos[i], 0, true };
            sk.off = i;
            if (f && fseek(f, (long)((i - F) * (int64_t)nv * 4), SEEK_SET) != 0)
                sk.werr = errno ? errno : EIO;
            if (!sk.werr && (r = decode_padded(e, bt, 1, pad_seq, on_row, &sk)) < 0)
                goto out;
            if (sk.werr) {
                r = kvr__wk_fail(e, -sk.werr, "logits file %s: %s", o->logits_out, strerror(sk.werr));
                goto out;
            }
        }
        if (o->exact && f && fseek(f, (long)(rowsA * (int64_t)nv * 4), SEEK_SET) != 0) {
            r = kvr__wk_fail(e, KVR_EIO, "logits file %s: %s", o->logits_out, strerror(errno));
            goto out;
        }
        if (o->exact && genA && (r = kvr__wk_kvbin_load(e, &kv, metaA)) < 0)
            goto out;
        for (int64_t i0 = F; !o->exact && i0 < endA; i0 += Q) {
            size_t cnt = (size_t)(endA - i0 < (int64_t)Q ? endA - i0 : (int64_t)Q);
            for (size_t k = 0; k < cnt; k++) {
                int64_t i = i0 + (int64_t)k;
                int s = 1 + (int)k;
                kvr__wk_lm_seq_rm(e->lm, s, -1, -1);
                kvr__wk_lm_seq_cp(e->lm, 0, s, 0, (int32_t)kv.pos[i]);   /* cells 0..i-1 */
                bt[k] = (kvr__wk_btok){ T[i], (int32_t)kv.pos[i], s, true };
            }
            sk.off = i0;
            r = decode_padded(e, bt, cnt, pad_seq, on_row, &sk);
            for (size_t k = 0; k < cnt; k++)
                kvr__wk_lm_seq_rm(e->lm, 1 + (int)k, -1, -1);
            if (r < 0)
                goto out;
            if (sk.werr) {
                r = kvr__wk_fail(e, -sk.werr, "logits file %s: %s", o->logits_out, strerror(sk.werr));
                goto out;
            }
        }
        t_a = kvr__wk_now_ms() - ta0;
        double tg0 = kvr__wk_now_ms();
        for (size_t g = 0; g < o->n_gen; g++) {
            int64_t I = o->gen[g].at;
            if (I >= (int64_t)m)
                continue;
            kvr__wk_lm_seq_rm(e->lm, 1, -1, -1);
            kvr__wk_lm_seq_cp(e->lm, 0, 1, 0, (int32_t)kv.pos[I]);
            if ((r = greedy(e, T[I], (int32_t)kv.pos[I], o->gen[g].n, o->has_stop, o->stop,
                            pad_seq, bt, row, gen[g], &n_out[g])) < 0)
                goto out;
        }
        t_gen += kvr__wk_now_ms() - tg0;
    }
    /* After the cache. */
    if (needB) {
        double tb0 = kvr__wk_now_ms();
        if (!needA || !same || (o->exact && !genA)) {
            if ((r = kvr__wk_kvbin_load(e, &kv, metaB)) < 0)
                goto out;
        }
        t_load += kvr__wk_now_ms() - tb0;
        for (size_t c0 = 0; c0 < N - m; c0 += chunk) {
            size_t cnt = N - m - c0 < chunk ? N - m - c0 : chunk;
            for (size_t k = 0; k < cnt; k++) {
                int64_t i = (int64_t)(m + c0 + k);
                bt[k] = (kvr__wk_btok){ T[i], (int32_t)(P + (int64_t)(c0 + k)), 0,
                                       i >= startB && i < (int64_t)N - 1 };
            }
            sk.off = (int64_t)(m + c0);
            if ((r = decode_padded(e, bt, cnt, pad_seq, on_row, &sk)) < 0)
                goto out;
            if (sk.werr) {
                r = kvr__wk_fail(e, -sk.werr, "logits file %s: %s", o->logits_out, strerror(sk.werr));
                goto out;
            }
        }
        t_b = kvr__wk_now_ms() - tb0;
        if (o->kv_out && (r = kv_out_write(e, o->kv_out, P, N - m)) < 0)
            goto out;
        double tg0 = kvr__wk_now_ms();
        for (size_t g = 0; g < o->n_gen; g++) {
            int64_t I = o->gen[g].at;
            if (I < (int64_t)m)
                continue;
            int32_t p = (int32_t)(P + (I - (int64_t)m));
            kvr__wk_lm_seq_rm(e->lm, 1, -1, -1);
            kvr__wk_lm_seq_cp(e->lm, 0, 1, 0, p);     /* cache + T[m..I) */
            if ((r = greedy(e, T[I], p, o->gen[g].n, o->has_stop, o->stop, pad_seq, bt, row,
                            gen[g], &n_out[g])) < 0)
                goto out;
        }
        t_gen += kvr__wk_now_ms() - tg0;
    }
    if (f) {
        int fe = fflush(f) != 0 || ferror(f) ? errno : 0;
        if (fclose(f) != 0 && !fe)
            fe = errno;
        f = NULL;
        if (fe || rename(tmp, o->logits_out) != 0) {
            r = kvr__wk_fail(e, KVR_EIO, "logits file %s: %s", o->logits_out, strerror(fe ? fe : errno));
            goto out;
        }
        tmp[0] = 0;
    }

    /* The report. */
    size_t n_scored = sk.rows;
    cJSON *j = R->json;
    kvr__wk_rep_num(R, NULL, "n_tokens", (double)N);
    kvr__wk_rep_num(R, NULL, "n_cached", (double)m);
    kvr__wk_rep_num(R, NULL, "from", (double)F);
    kvr__wk_rep_num(R, NULL, "n_scored", (double)n_scored);
    kvr__wk_rep_num(R, NULL, "n_vocab", (double)nv);
    kvr__wk_rep_num(R, NULL, "next_pos", (double)P);
    kvr__wk_rep_str(R, NULL, "cache_type", dtype_name(kv.m ? kv.dtype : 1));
    if (j) {
        if (o->logits_out)
            cJSON_AddStringToObject(j, "logits", o->logits_out);
        else
            cJSON_AddNullToObject(j, "logits");
        cJSON *ga = cJSON_AddArrayToObject(j, "generated");
        for (size_t g = 0; ga && g < o->n_gen; g++) {
            cJSON *a = cJSON_CreateArray();
            for (size_t k = 0; a && k < n_out[g]; k++)
                cJSON_AddItemToArray(a, cJSON_CreateNumber(gen[g][k]));
            if (a)
                cJSON_AddItemToArray(ga, a);
        }
    }
    double bpt = n_scored ? sk.nll / (double)n_scored / log(2.0) : (double)NAN;
    kvr__wk_rep_num(R, NULL, "nll_sum", sk.nll);
    kvr__wk_rep_num(R, NULL, "bits_per_token", bpt);
    kvr__wk_rep_num(R, NULL, "top1_correct", (double)sk.top1);
    const kvr__wk_rep_kv tm[] = {
        { "context", t_ctx }, { "load", t_load }, { "in_cache", t_a }, { "append", t_b },
        { "generate", t_gen },
    };
    kvr__wk_rep_nums(R, "timings_ms", tm, sizeof tm / sizeof tm[0]);
    kvr__wk_rep_line(R, "score: %zu tokens, %zu cached (%s), next position %lld", N, m,
                    dtype_name(kv.m ? kv.dtype : 1), (long long)P);
    if (n_scored)
        kvr__wk_rep_line(R, "scored: rows %lld..%zu (%zu rows: %lld in the cache, %lld after) "
                        "of %zu logits%s%s", (long long)F, N - 2, n_scored, (long long)rowsA,
                        (long long)rowsB, nv, o->logits_out ? " -> " : "",
                        o->logits_out ? o->logits_out : "");
    else
        kvr__wk_rep_line(R, "scored: no rows (from %lld, %zu tokens)%s%s", (long long)F, N,
                        o->logits_out ? "; empty " : "", o->logits_out ? o->logits_out : "");
    if (n_scored)
        kvr__wk_rep_line(R, "next token: %.4f bits/token, top-1 %zu of %zu", bpt, sk.top1,
                        n_scored);
    for (size_t g = 0; g < o->n_gen; g++) {
        char ids[1024];
        size_t w = 0;
        for (size_t k = 0; k < n_out[g] && w + 16 < sizeof ids; k++)
            w += (size_t)snprintf(ids + w, sizeof ids - w, "%s%d", k ? " " : "", gen[g][k]);
        ids[w] = 0;
        kvr__wk_rep_line(R, "generated from %lld: %zu tokens: %s%s", (long long)o->gen[g].at,
                        n_out[g], ids, w + 16 >= sizeof ids ? " ..." : "");
    }
    r = 0;
out:
    if (f)
        fclose(f);
    if (tmp[0])
        unlink(tmp);
    if (gen)
        for (size_t g = 0; g < o->n_gen; g++)
            free(gen[g]);
    free(gen);
    free(n_out);
    free(bt);
    free(row);
    free(metaA);
    free(metaB);
    free(kv.pos);
    free(T);
    return r;
}
