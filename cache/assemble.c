/*
 * assemble.c — the assemble transaction (APE): one prefix context plus an
 * ordered list of document contexts, laid out in parallel, sequentially or
 * at explicit starts, returned as one KV stream with a segment table.
 *
 * assemble_begin (loop thread) checks every document's APE record against
 * the prefix as it is now and computes the layout; the stream (prefix
 * tokens, then each document's) is the read plan of read.h, which copies
 * the metadata, leases the blocks and stages what cannot go out zero-copy.
 * From then on the transaction reads only leased slots below each block's
 * `used`, which never change, so assemble_work may run on any thread while
 * the store changes around it. Keys are re-rotated to the layout's
 * positions and, for documents with fold_temperature, multiplied by 1/T
 * in f32 before the final rounding.
 *
 * Flags: a document token is KVR_TOKEN_APPROX when it keeps the flag from
 * its context, or when the layout moves it away from its logical position
 * (its KV was computed at another place relative to the prefix: sequential
 * documents after the first, explicit starts other than P).
 *
 * kvr_assemble_place_begin (cover.h) builds the same transaction over
 * pieces of contexts at explicit positions: a cover's get.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cache/cover.h"
#include "cache/layout.h"
#include "cache/read.h"

struct kvr_assemble {
    kvr_read           r;
    kvr_assemble_info  info;
    kvr_segment       *segs;
};

static void asm_free(kvr_assemble *t)
{
    kvr_read_free(&t->r);
    kvr_mem_free(t->segs);
    kvr_mem_free(t);
}

/* The end of a begin, its plan laid out and its contexts touched: the disk
 * tier's spilled blocks get memory now (the leases keep them; work reads
 * them off the loop thread), the staging is planned, and t is the
 * caller's. On failure t is freed. */
static int asm_open(kvr_assemble *t, void *dst, size_t dst_cap, const char *what,
                    kvr_assemble **out, kvr_error *err)
{
    kvr_read *r = &t->r;
    r->dst = dst;
    r->dst_cap = dst_cap;
    int rc;
    if ((rc = kvr_read_reload(r, NULL, err)) != 0 ||
        (rc = kvr_read_stage(r, NULL, what, err)) != 0) {
        asm_free(t);
        return rc;
    }
    r->s->n_gets++;
    *out = t;
    return 0;
}

/* Checks that document d was encoded against prefix pc as it is now. */
static int check_doc(const kvr_ctx *pc, uint64_t phash, const kvr_ctx *d, size_t i,
                     kvr_error *err)
{
    const char *pid;
    uint64_t fp, hash;
    size_t len;
    if (d->model != pc->model)
        return kvr_error_set(err, KVR_EFINGERPRINT,
                             "document %zu '%s' belongs to model '%s', the prefix '%s' "
                             "to '%s'", i, d->id, d->model->name, pc->id, pc->model->name);
    if (!kvr_layout_ape_record(d, &pid, &fp, &len, &hash))
        return kvr_error_set(err, KVR_EPREFIX,
                             "document %zu '%s' was not encoded against a prefix (create "
                             "it with prefix_ctx '%s')", i, d->id, pc->id);
    if (strcmp(pid, pc->id) != 0)
        return kvr_error_set(err, KVR_EPREFIX,
                             "document %zu '%s' was encoded against prefix '%s', not '%s'",
                             i, d->id, pid, pc->id);
    if (fp != pc->model->fingerprint)
        return kvr_error_set(err, KVR_EFINGERPRINT,
                             "document %zu '%s' was encoded with model fingerprint "
                             "%016llx, the prefix's model has %016llx", i, d->id,
                             (unsigned long long)fp,
                             (unsigned long long)pc->model->fingerprint);
    if (len != pc->n_tokens || hash != phash)
        return kvr_error_set(err, KVR_EPREFIX,
                             "prefix '%s' changed since document %zu '%s' was encoded "
                             "after it (%zu tokens then, %zu now%s): re-encode the "
                             "document", pc->id, i, d->id, len, pc->n_tokens,
                             len == pc->n_tokens ? ", token ids differ" : "");
    return 0;
}

static bool bad_factor(double x)
{
    return !(x > 0.0) || !isfinite(x) || x > 1e6 || x < 1e-6;
}

static int cmp_ptr(const void *a, const void *b)
{
    uintptr_t x = (uintptr_t)*(const kvr_ctx *const *)a;
    uintptr_t y = (uintptr_t)*(const kvr_ctx *const *)b;
    return x < y ? -1 : x > y;
}

/* A document may appear once: the same one many times would stage (and
 * evict for) its KV as often, for a stream no model needs. Unknown ids are
 * left to the caller's lookup. */
static int docs_unique(const kvr_store *s, const kvr_assemble_params *p, kvr_error *err)
{
    if (p->n_docs < 2)
        return 0;
    const kvr_ctx **v = kvr_mem_malloc(p->n_docs * sizeof *v);
    if (!v)
        return kvr_error_set(err, KVR_ENOMEM, "out of memory checking the documents");
    size_t n = 0;
    for (size_t i = 0; i < p->n_docs; i++) {
        const kvr_ctx *d = kvr_store_ctx_find(s, p->docs[i]);
        if (d)
            v[n++] = d;
    }
    qsort(v, n, sizeof *v, cmp_ptr);
    int rc = 0;
    for (size_t i = 1; i < n && rc == 0; i++)
        if (v[i] == v[i - 1])
            rc = kvr_error_set(err, KVR_EINVAL, "document '%s' is listed twice", v[i]->id);
    kvr_mem_free(v);
    return rc;
}

int kvr_store_assemble_begin(kvr_store *s, const kvr_assemble_params *p,
                             kvr_assemble **out, kvr_error *err)
{
    int rc;
    if (!p || !out)
        return kvr_error_set(err, KVR_EBADREQUEST, "assemble: missing parameters");
    if (p->n_docs == 0 || !p->docs)
        return kvr_error_set(err, KVR_EBADREQUEST, "assemble: no documents");
    if (p->n_docs > KVR_ASSEMBLE_MAX_DOCS)
        return kvr_error_set(err, KVR_ELIMIT, "assemble of %zu documents (limit %d)",
                             p->n_docs, KVR_ASSEMBLE_MAX_DOCS);
    if (p->layout != KVR_LAYOUT_PARALLEL && p->layout != KVR_LAYOUT_SEQUENTIAL &&
        p->layout != KVR_LAYOUT_EXPLICIT)
        return kvr_error_set(err, KVR_EBADREQUEST, "unknown layout %d", (int)p->layout);
    if (p->layout == KVR_LAYOUT_EXPLICIT && !p->starts)
        return kvr_error_set(err, KVR_EBADREQUEST,
                             "explicit layout needs one start position per document");
    double T = p->temperature == 0.0 ? KVR_APE_TEMPERATURE : p->temperature;
    double S = p->scale == 0.0 ? KVR_APE_SCALE : p->scale;
    if (bad_factor(T) || bad_factor(S))
        return kvr_error_set(err, KVR_EINVAL,
                             "APE temperature %g and scale %g must be finite, in [1e-6, 1e6]",
                             T, S);
    size_t osize = kvr_dtype_size(p->dtype);
    if (!p->meta_only && osize == 0)
        return kvr_error_set(err, KVR_EINVAL, "unknown output dtype %d", (int)p->dtype);

    kvr_ctx *pc = NULL;
    if ((rc = kvr_store_ctx_live(s, p->prefix, &pc, err)) != 0)
        return kvr_error_set(err, rc, "prefix context '%s' not found",
                             p->prefix ? p->prefix : "");
    kvr_model *m = pc->model;
    size_t nl;
    if ((rc = kvr_layers_check(m, p->layers, p->n_layers_sel, &nl, err)) != 0)
        return rc;
    if ((rc = docs_unique(s, p, err)) != 0)
        return rc;
    uint64_t phash;
    if ((rc = kvr_layout_ctx_hash(pc, &phash, err)) != 0)
        return rc;

    /* Resolve and check the documents, and lay them out. */
    size_t P = pc->n_tokens, N = P, n_ext = pc->n_ext;
    int64_t qpos = (int64_t)P, cur = (int64_t)P;
    for (size_t i = 0; i < p->n_docs; i++) {
        kvr_ctx *d = NULL;
        if ((rc = kvr_store_ctx_live(s, p->docs[i], &d, err)) != 0)
            return kvr_error_set(err, rc, "document %zu '%s' not found", i,
                                 p->docs[i] ? p->docs[i] : "");
        if ((rc = check_doc(pc, phash, d, i, err)) != 0)
            return rc;
        if (__builtin_add_overflow(N, d->n_tokens, &N) ||
            __builtin_add_overflow(n_ext, d->n_ext, &n_ext))
            return kvr_error_set(err, KVR_ETOOLARGE, "assemble size overflows");
        int64_t start = p->layout == KVR_LAYOUT_PARALLEL ? (int64_t)P :
                        p->layout == KVR_LAYOUT_SEQUENTIAL ? cur : p->starts[i];
        int64_t end;
        if (start < 0 || __builtin_add_overflow(start, (int64_t)d->n_tokens, &end))
            return kvr_error_set(err, KVR_EINVAL,
                                 "document %zu '%s': start %lld for %zu tokens is negative "
                                 "or overflows int64", i, d->id, (long long)start,
                                 d->n_tokens);
        cur = end;
        if (end > qpos)
            qpos = end;
    }
    if (N > (size_t)1 << 32)
        return kvr_error_set(err, KVR_ETOOLARGE, "assemble of %zu tokens", N);

    kvr_assemble *t = kvr_mem_calloc(1, sizeof *t);
    if (!t)
        return kvr_error_set(err, KVR_ENOMEM, "out of memory starting an assemble");
    kvr_read *r = &t->r;
    size_t n_segs = p->n_docs + 2;
    t->segs = kvr_mem_calloc(n_segs, sizeof *t->segs);
    if (kvr_read_init(r, s, m, p->layers, nl, N, n_ext, false, p->meta_only,
                      p->dtype) != 0 || !t->segs) {
        rc = kvr_error_set(err, KVR_ENOMEM, "out of memory for an assemble of %zu tokens", N);
        goto fail;
    }
    r->inv_t = (float)(1.0 / T);

    /* Walk the prefix then every document, extent by extent. */
    cur = (int64_t)P;
    for (size_t src = 0; src <= p->n_docs; src++) {
        const kvr_ctx *c = src == 0 ? pc : kvr_store_ctx_find(s, p->docs[src - 1]);
        bool doc = src > 0;
        int64_t start = !doc ? 0 : p->layout == KVR_LAYOUT_PARALLEL ? (int64_t)P :
                        p->layout == KVR_LAYOUT_SEQUENTIAL ? cur : p->starts[src - 1];
        cur = start + (int64_t)c->n_tokens;
        kvr_segment *sg = &t->segs[src];
        sg->kind = doc ? KVR_SEGMENT_DOCUMENT : KVR_SEGMENT_PREFIX;
        sg->start = r->n_added;
        sg->n_tokens = c->n_tokens;
        sg->pos_first = start;
        sg->pos_last = start + (int64_t)c->n_tokens - 1;
        sg->doc_index = doc ? (uint32_t)(src - 1) : 0;
        memcpy(sg->ctx_id, c->id, c->id_len + 1);
        sg->temperature = doc ? T : 1.0;
        sg->scale = doc ? S : 1.0;
        int64_t target = start;
        for (size_t i = 0; i < c->n_ext; i++) {
            const kvr_extent *e = &c->ext[i];
            if (!p->meta_only && (e->flags & KVR_TOKEN_PENDING)) {
                rc = kvr_error_set(err, KVR_EPENDING,
                                   "%s '%s' has tokens without KV (edited without KV; "
                                   "refresh them first)", doc ? "document" : "prefix",
                                   c->id);
                goto fail;
            }
            /* A document token moved off its logical position is
             * approximate: its KV was computed at another place. */
            kvr_read_add(r, e, 0, e->count, NULL, &target, doc,
                         doc && p->fold_temperature);
        }
    }
    kvr_segment *q = &t->segs[p->n_docs + 1];
    q->kind = KVR_SEGMENT_QUERY;
    q->start = N;
    q->pos_first = qpos;
    q->pos_last = qpos - 1;
    q->temperature = q->scale = 1.0;

    if ((rc = kvr_read_check_rope(r, err)) != 0)
        goto fail;

    kvr_assemble_info *info = &t->info;
    KVR_READ_INFO(info, r);
    info->layout = p->layout;
    info->segments = t->segs;
    info->n_segments = n_segs;
    info->query_pos = qpos;
    info->temperature = T;
    info->scale = S;
    info->temperature_folded = p->fold_temperature;
    info->prefix_len = P;

    /* Touch the contexts now: nothing below looks at them again, so the
     * eviction a reservation may do cannot pull them from under us (the
     * leases keep their blocks). */
    kvr_store_touch(s, pc);
    for (size_t i = 0; i < p->n_docs; i++)
        kvr_store_touch(s, kvr_store_ctx_find(s, p->docs[i]));

    return asm_open(t, p->dst, p->dst_cap, "assemble", out, err);

fail:
    asm_free(t);
    return rc;
}

/* Extents of c holding tokens [from, from + n): the first's index and the
 * token index it starts at (*i, *k), and how many. */
static size_t place_span(const kvr_ctx *c, size_t from, size_t n, size_t *i, size_t *k)
{
    *i = *k = 0;
    kvr_ctx_seek(c, i, k, from);
    size_t j = *i, kk = *k, cnt = 0;
    for (; j < c->n_ext && kk < from + n; kk += c->ext[j].count, j++)
        cnt++;
    return cnt;
}

int kvr_assemble_place_begin(kvr_store *s, kvr_model *m, const kvr_place *pc, size_t n_pc,
                             const kvr_place_opts *o, kvr_assemble **out, kvr_error *err)
{
    int rc;
    if (!o->meta_only && kvr_dtype_size(o->dtype) == 0)
        return kvr_error_set(err, KVR_EINVAL, "unknown output dtype %d", (int)o->dtype);
    size_t nl;
    if ((rc = kvr_layers_check(m, o->layers, o->n_layers_sel, &nl, err)) != 0)
        return rc;
    size_t N = 0, n_ext = 0, i, k;
    for (size_t p = 0; p < n_pc; p++) {
        assert(pc[p].n > 0 && pc[p].from + pc[p].n <= pc[p].c->n_tokens);
        N += pc[p].n;
        n_ext += place_span(pc[p].c, pc[p].from, pc[p].n, &i, &k);
    }
    kvr_assemble *t = kvr_mem_calloc(1, sizeof *t);
    if (!t)
        return kvr_error_set(err, KVR_ENOMEM, "out of memory starting a cover's get");
    kvr_read *r = &t->r;
    t->segs = kvr_mem_calloc(n_pc + 1, sizeof *t->segs);
    if (kvr_read_init(r, s, m, o->layers, nl, N, n_ext, false, o->meta_only, o->dtype) != 0 ||
        !t->segs) {
        rc = kvr_error_set(err, KVR_ENOMEM, "out of memory for a cover's get of %zu tokens", N);
        goto fail;
    }
    for (size_t p = 0; p < n_pc; p++) {
        const kvr_place *q = &pc[p];
        kvr_segment *sg = &t->segs[p];
        *sg = (kvr_segment){ .kind = KVR_SEGMENT_DOCUMENT, .start = r->n_added,
                             .n_tokens = q->n, .pos_first = q->pos,
                             .pos_last = q->pos + (int64_t)q->n - 1, .doc_index = (uint32_t)p,
                             .temperature = 1.0, .scale = 1.0 };
        memcpy(sg->ctx_id, q->c->id, q->c->id_len + 1);
        int64_t target = q->pos;
        place_span(q->c, q->from, q->n, &i, &k);
        for (; i < q->c->n_ext && k < q->from + q->n; k += q->c->ext[i].count, i++) {
            const kvr_extent *e = &q->c->ext[i];
            size_t lo = k > q->from ? k : q->from;
            size_t hi = k + e->count < q->from + q->n ? k + e->count : q->from + q->n;
            if (!o->meta_only && (e->flags & KVR_TOKEN_PENDING)) {
                rc = kvr_error_set(err, KVR_EPENDING, "context '%s' has tokens without KV "
                                   "in [%zu, %zu)", q->c->id, lo, hi);
                goto fail;
            }
            kvr_read_add(r, e, (uint32_t)(lo - k), (uint32_t)(hi - k), NULL, &target, false,
                         false);
        }
        for (size_t j = sg->start; q->approx && j < r->n_added; j++)
            r->flags[j] |= KVR_TOKEN_APPROX;
    }
    kvr_segment *qs = &t->segs[n_pc];
    *qs = (kvr_segment){ .kind = KVR_SEGMENT_QUERY, .start = N, .pos_first = o->query_pos,
                         .pos_last = o->query_pos - 1, .temperature = 1.0, .scale = 1.0 };
    if ((rc = kvr_read_check_rope(r, err)) != 0)
        goto fail;
    kvr_assemble_info *info = &t->info;
    KVR_READ_INFO(info, r);
    info->layout = KVR_LAYOUT_EXPLICIT;
    info->segments = t->segs;
    info->n_segments = n_pc + 1;
    info->query_pos = o->query_pos;
    info->temperature = info->scale = 1.0;
    for (size_t p = 0; p < n_pc; p++)
        kvr_store_touch(s, pc[p].c);
    return asm_open(t, o->dst, o->dst_cap, "cover", out, err);

fail:
    asm_free(t);
    return rc;
}

KVR_READ_TXN_API(kvr_assemble, kvr_assemble_info, kvr_assemble,
                 "out of memory folding the temperature")

int kvr_assemble_copy_into(kvr_assemble *t, void *dst, size_t size, kvr_error *err)
{
    return kvr_read_work_into(&t->r, dst, size, "assemble", "out of memory for an assemble",
                              err);
}

void kvr_assemble_end(kvr_assemble *t)
{
    if (t)
        asm_free(t);
}
