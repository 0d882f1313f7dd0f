/*
 * remote_fetch.c — the shared tier's fetch jobs (remote.h,
 * docs/cluster.md). The store asks the tier on a miss through its miss
 * hooks (kvr_store_miss_hooks; dispatch.c installs them and parks the
 * request that missed): a job is built on the loop thread, worked on a
 * threadpool thread (the network I/O: a manifest and its blocks by id, or
 * the probes and blocks of a prompt's prefix), and landed on the loop
 * thread as an ordinary put. A get by id runs twice: the manifest first,
 * then, once the loop opened the local put, the blocks straight into its
 * memory.
 *
 * Invariants: nothing fetched is stored before every check passed (MAC,
 * then the value's own checks, remote_wire.c); a job touches the store on
 * the loop thread only (land, free); each job ends by its deadline
 * (FETCH_MS after it was built, plus its bytes at SLOW_BYTES_PER_MS),
 * whatever the cluster does; a job freed with its put open aborts it.
 * A job with its put open is on r->landing (loop thread), so a request
 * that misses the same id meanwhile waits for it (KVR_RT_WAIT, dispatch.c)
 * rather than fetch what its own put could not land ("being written").
 */
#include "daemon/remote_internal.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <sys/stat.h>

#include "base/crc32c.h"

struct kvr_rjob {
    kvr_remote *r;
    bool        by_id;
    char        ctx_id[KVR_ID_MAX + 1];
    char        model[KVR_ID_MAX + 1];
    kvr_rt_desc desc;
    const uint32_t *prompt;     /* borrowed from the request */
    size_t      n_prompt, local_len;
    /* result */
    bool        hit;
    kvr_rt_manifest m;          /* by_id: the manifest; prefix: tokens/positions */
    uint8_t    *payload;
    size_t      n_tokens;
    /* by_id runs twice: the manifest (phase 0), then, once the loop opened
     * the local put, the blocks straight into its memory (phase 1). */
    int         phase;
    bool        have_manifest;
    kvr_put    *put;             /* open: on r->landing through link */
    kvr_list    link;
    const struct iovec *iov;
    size_t      niov;
    size_t     *starts;
    uint64_t    t0_ns;          /* created (loop), for the fetch histogram */
    uint64_t    deadline_ms;    /* created + FETCH_MS (kvr_clock_mono_ms's clock) */
    bool        worked;         /* reached the cluster (counted when freed) */
};

/* ---- fetch jobs ---------------------------------------------------------- */

/* A new job of r's, its clock started (NULL: out of memory). */
static kvr_rjob *job_new(kvr_remote *r)
{
    kvr_rjob *j = kvr_mem_calloc(1, sizeof *j);
    if (!j)
        return NULL;
    j->t0_ns = kvr_clock_mono_ns();
    j->r = r;
    j->deadline_ms = kvr_clock_mono_ms() + FETCH_MS;
    return j;
}

kvr_rjob *kvr__remote_job_get(kvr_remote *r, const char *ctx_id)
{
    kvr_rjob *j = r ? job_new(r) : NULL;
    if (!j)
        return NULL;
    j->by_id = true;
    snprintf(j->ctx_id, sizeof j->ctx_id, "%s", ctx_id);
    return j;
}

kvr_rjob *kvr__remote_job_prefix(kvr_remote *r, const char *model, const uint32_t *tokens,
                                size_t n, size_t local_len)
{
    if (!r || n < KVR_RT_GRAIN || local_len >= n)
        return NULL;     /* the cluster cannot know more than we do */
    kvr_model_info mi;
    if (kvr_store_model_find(r->d->store, model, &mi) < 0)
        return NULL;
    kvr_rjob *j = job_new(r);
    if (!j)
        return NULL;
    snprintf(j->model, sizeof j->model, "%s", mi.name);
    /* Contexts of the model's own dtype are the ones we look for. */
    j->desc = (kvr_rt_desc){ mi.fingerprint, mi.n_layers, mi.n_kv_heads, mi.head_dim,
                             mi.dtype };
    j->prompt = tokens;
    j->n_prompt = n;
    j->local_len = local_len;
    return j;
}

void kvr__remote_job_free(kvr_rjob *j)
{
    if (!j)
        return;
    if (j->worked) {
        uint64_t ns = kvr_clock_mono_ns() - j->t0_ns;
        kvr_remote *r = j->r;
        atomic_fetch_add(&r->fetch_hist[kvr__metrics_bucket((double)ns / 1e9)], 1);
        atomic_fetch_add(&r->fetch_ns, ns);
    }
    if (j->put) {
        kvr_list_remove(&j->link);
        kvr_put_abort(j->put);      /* loop thread: nothing was committed */
    }
    kvr_mem_free(j->starts);
    kvr__rt_manifest_free(&j->m);
    kvr_mem_free(j->payload);
    kvr_mem_free(j);
}

bool kvr__remote_job_by_id(const kvr_rjob *j)
{
    return j->by_id;
}

const char *kvr__remote_job_id(const kvr_rjob *j)
{
    return j->ctx_id;
}

bool kvr__remote_job_open(const kvr_rjob *j)
{
    return j->put != NULL;
}

bool kvr__remote_landing(const kvr_remote *r, const char *ctx_id)
{
    kvr_list *n;
    if (!r)
        return false;
    kvr_list_foreach(n, &r->landing)
        if (strcmp(kvr_list_entry(n, kvr_rjob, link)->ctx_id, ctx_id) == 0)
            return true;
    return false;
}

static void miss(kvr_rjob *j, bool corrupt, const char *why)
{
    atomic_fetch_add(corrupt ? &j->r->fetch_corrupt : &j->r->fetch_misses, 1);
    if (corrupt)
        kvr_log(KVR_LOG_WARN, "remote tier: %s (treated as a miss)", why);
    else
        kvr_log(KVR_LOG_DEBUG, "remote tier: miss: %s", why);
}

/* Where only a value's length is known: small begins with the magic and
 * the version, so the check reports the value as the one-shot check would. */
static const uint8_t *short_head(uint8_t *small, const char *magic)
{
    memcpy(small, magic, 4);
    put32(small + 4, RT_VERSION);
    return small;
}

/* The end of a value's check: rc < 0 (why in e) is a corrupt value, a miss
 * naming its key; else it is good. */
static bool value_checked(kvr_rjob *j, const char *key, int rc, const kvr_error *e, bool *good)
{
    if (rc < 0) {
        char why[400];
        snprintf(why, sizeof why, "%s: %s", key, e->msg);
        miss(j, true, why);
        return false;
    }
    *good = true;
    return true;
}

static void forged(kvr_rjob *j, const char *rkey)
{
    atomic_fetch_add(&j->r->fetch_forged, 1);
    kvr_log(KVR_LOG_WARN, "remote tier: %s: its MAC is not this cluster key's (forged, or "
            "written by a node with another key): treated as a miss", rkey);
}

/* The length of reply x's value under Redis key rkey without its MAC: true
 * if the MAC verifies (or no key is configured), false (a forgery, counted)
 * if not. */
static bool unseal(kvr_rjob *j, const char *rkey, size_t rklen, const redisReply *x,
                   size_t *len)
{
    kvr_remote *r = j->r;
    *len = x->len;
    if (!r->keyed)
        return true;
    if (x->len >= KVR_RT_MAC_LEN) {
        uint8_t m[KVR_RT_MAC_LEN];
        *len = x->len - KVR_RT_MAC_LEN;
        kvr__rt_mac(r->key, rkey, rklen, (const uint8_t *)x->str, *len, m);
        if (sodium_memcmp(m, x->str + *len, KVR_RT_MAC_LEN) == 0)
            return true;
    }
    forged(j, rkey);
    return false;
}

/* Every value is read with GETRANGE key 0 max, max the longest a good
 * value can be (known before it is asked for: from the key's kind, the
 * block's length, or a manifest's header), so Redis sends at most max + 1
 * bytes and a huge value under a key is refused without being read
 * (hiredis's buffers hold at most that). GETRANGE of a missing key is an
 * empty string: a miss like nil. */
typedef struct range_arg {
    char end[24];
} range_arg;

static size_t range_set(range_arg *a, size_t max, const char **argv, size_t *argl,
                        const char *key, size_t klen)
{
    argv[0] = "GETRANGE";
    argl[0] = 8;
    argv[1] = key;
    argl[1] = klen;
    argv[2] = "0";
    argl[2] = 1;
    argv[3] = a->end;
    argl[3] = (size_t)snprintf(a->end, sizeof a->end, "%zu", max);
    return 4;
}

/* The value under key if it has 1..max bytes; NULL if it is missing, the
 * command failed, or it is longer (*too_long, when not NULL). */
static redisReply *get_bounded(kvr_rc *rc, const char *key, size_t klen, size_t max,
                               bool *too_long)
{
    const char *argv[4];
    size_t argl[4];
    range_arg ra;
    range_set(&ra, max, argv, argl, key, klen);
    if (too_long)
        *too_long = false;
    redisReply *x;
    if (kvr__rc_command(rc, 4, argv, argl, &x, NULL) < 0)
        return NULL;
    if (x->type != REDIS_REPLY_STRING || x->len == 0 || x->len > max) {
        if (too_long && x->type == REDIS_REPLY_STRING && x->len > max)
            *too_long = true;
        freeReplyObject(x);
        return NULL;
    }
    return x;
}

/* The first n bytes of the value under key (a reply of 1..n bytes: fewer
 * if the value is shorter), or NULL: missing, or the command failed. */
static redisReply *get_head(kvr_rc *rc, const char *key, size_t klen, size_t n)
{
    const char *argv[4];
    size_t argl[4];
    range_arg ra;
    range_set(&ra, n - 1, argv, argl, key, klen);
    redisReply *x;
    if (kvr__rc_command(rc, 4, argv, argl, &x, NULL) < 0)
        return NULL;
    if (x->type != REDIS_REPLY_STRING || x->len == 0 || x->len > n) {
        freeReplyObject(x);
        return NULL;
    }
    return x;
}

/* The longest a manifest whose header is h (MANIFEST_HDR bytes) can be,
 * MAC included; 0 if the header is not a manifest's or names more tokens
 * than fit the bound below. A manifest is 20 bytes a token: the one of a
 * context whose KV could never fit under --max-memory is refused, and no
 * manifest above a sixteenth of the cap is read (docs/cluster.md). */
static size_t manifest_max(const kvr_remote *r, const uint8_t *h)
{
    if (memcmp(h, MANIFEST_MAGIC, 4) != 0)
        return 0;
    uint64_t nt = get64(h + 40), nb = get64(h + 48);
    if (nt > MAX_TOKENS || nb > nt)
        return 0;
    size_t max = MANIFEST_HDR + nb * 8 + nt * 20 + LAYOUT_FIXED + KVR_MAX_GROUPS * GROUP_REC +
                 QUANT_SEC + 4 + (r->keyed ? KVR_RT_MAC_LEN : 0);
    uint64_t cap = r->d->cfg.max_memory;
    if (cap && max > cap / 16)
        return 0;
    return max;
}

/* What fetch_blocks checks each block against, and each block's state
 * while it is read straight into the destination (kvr__rc_batch_sink): the
 * header, tokens and positions into hdr, the K/V into the destination, the
 * CRC32C computed as the bytes arrive (while they are in cache). */
#define HDR_MAX (BLOCK_HDR + KVR_RT_BLOCK * 12)

typedef struct blk_state {
    crypto_generichash_state mac;   /* keyed: over [0, want_len) as it arrives */
    size_t   want_len;          /* the exact length a good value has (its MAC apart) */
    size_t   got_len;           /* the reply's length, its MAC apart */
    size_t   raw_len;           /* the reply's length */
    uint32_t crc;
    bool     sized;             /* got_len == want_len: bytes go to hdr/dst */
    uint8_t  hdr[HDR_MAX];
    uint8_t  tail[4];
    uint8_t  tag[KVR_RT_MAC_LEN];
} blk_state;

typedef struct fetch_ctx {
    kvr_rjob       *j;
    const uint64_t *chains;
    size_t          n_ctx;
    const uint32_t *tokens;
    const int64_t  *pos;
    char          (*keys)[KVR_RT_KEY_MAX];
    bool           *good;
    blk_state      *st;
    size_t          row;
    rt_dst          dst;
} fetch_ctx;

static size_t blk_tokens(const fetch_ctx *f, size_t b)
{
    size_t s = b * KVR_RT_BLOCK;
    return f->n_ctx - s < KVR_RT_BLOCK ? f->n_ctx - s : KVR_RT_BLOCK;
}

static bool blk_begin(void *ud, size_t b, size_t len)
{
    fetch_ctx *f = ud;
    blk_state *st = &f->st[b];
    size_t n = blk_tokens(f, b);
    const kvr_remote *r = f->j->r;
    size_t ml = r->keyed ? KVR_RT_MAC_LEN : 0;
    st->want_len = BLOCK_HDR + n * 12 + kv_bytes(&f->j->desc, n) + 4;
    st->raw_len = len;
    st->got_len = len >= ml ? len - ml : len;
    st->crc = 0;
    st->sized = len >= ml && st->got_len == st->want_len;
    if (st->sized && ml)
        kvr__rt_mac_begin(&st->mac, r->key, f->keys[b], strlen(f->keys[b]));
    memset(st->hdr, 0, BLOCK_HDR);
    return true;     /* a wrong size is still read (up to its GETRANGE bound) and dropped */
}

/* Value offset -> where it goes: hdr, the destination (one layer side's
 * run of n rows, within one iovec), or tail. */
static uint8_t *blk_span(void *ud, size_t b, size_t off, size_t *cap)
{
    fetch_ctx *f = ud;
    blk_state *st = &f->st[b];
    if (!st->sized)
        return NULL;
    size_t n = blk_tokens(f, b), hl = BLOCK_HDR + n * 12, seg = n * f->row;
    size_t kv = st->want_len - hl - 4;
    if (off >= st->want_len) {         /* its MAC */
        *cap = st->want_len + KVR_RT_MAC_LEN - off;
        return st->tag + (off - st->want_len);
    }
    if (off < hl) {
        *cap = hl - off;
        return st->hdr + off;
    }
    if (off >= hl + kv) {
        *cap = st->want_len - off;
        return st->tail + (off - hl - kv);
    }
    size_t in = off - hl, l = in / seg, at = in % seg;
    size_t doff = (l * f->n_ctx + b * KVR_RT_BLOCK) * f->row + at;
    *cap = seg - at;
    if (f->dst.flat)
        return f->dst.flat + doff;
    size_t lo = 0, hi = f->dst.niov;
    while (hi - lo > 1) {
        size_t mid = (lo + hi) / 2;
        if (f->dst.starts[mid] <= doff)
            lo = mid;
        else
            hi = mid;
    }
    size_t iin = doff - f->dst.starts[lo], left = f->dst.iov[lo].iov_len - iin;
    if (*cap > left)
        *cap = left;
    return (uint8_t *)f->dst.iov[lo].iov_base + iin;
}

static void blk_got(void *ud, size_t b, size_t off, const uint8_t *p, size_t n)
{
    fetch_ctx *f = ud;
    blk_state *st = &f->st[b];
    if (!st->sized || off >= st->want_len)
        return;
    if (f->j->r->keyed)
        crypto_generichash_update(&st->mac, p, st->want_len - off < n ? st->want_len - off : n);
    if (off >= st->want_len - 4)
        return;
    size_t take = st->want_len - 4 - off < n ? st->want_len - 4 - off : n;
    st->crc = kvr_crc32c(st->crc, p, take);
}

static bool blk_end(void *ud, size_t b, bool is_string)
{
    fetch_ctx *f = ud;
    f->good[b] = false;
    blk_state *st = &f->st[b];
    if (!is_string || st->raw_len == 0)
        return false;            /* missing: counted once by fetch_blocks */
    size_t s = b * KVR_RT_BLOCK, n = blk_tokens(f, b);
    if (f->j->r->keyed && (st->sized ? !kvr__rt_mac_end_ok(&st->mac, st->tag)
                                     : st->raw_len == st->want_len)) {
        forged(f->j, f->keys[b]);     /* a wrong MAC, or a good value without one */
        return false;
    }
    kvr_error e = { 0 };
    bool crc_ok = st->sized && st->crc == get32(st->tail);
    uint8_t small[BLOCK_HDR];
    const uint8_t *hv = st->hdr;
    if (!st->sized)
        hv = short_head(small, BLOCK_MAGIC);
    int rc = kvr__rt_block_check(hv, st->got_len, crc_ok, &f->j->desc, f->chains[b], s,
                                 f->tokens + s, f->pos + s, n, &e);
    return value_checked(f->j, f->keys[b], rc, &e, &f->good[b]);
}

static const kvr_rc_sink blk_sink = { blk_begin, blk_span, blk_got, blk_end };

/* GETs blocks [0, nb) straight into the destination (j->payload, or the
 * open put's memory); returns how many leading blocks were good (up to
 * the first missing or bad one). */
static size_t fetch_blocks(kvr_rjob *j, const uint64_t *chains, size_t nb, size_t n_ctx,
                           const uint32_t *tokens, const int64_t *pos)
{
    kvr_remote *r = j->r;
    char (*keys)[KVR_RT_KEY_MAX] = kvr_mem_malloc(nb * KVR_RT_KEY_MAX + 1);
    kvr_rc_cmd *cmds = kvr_mem_malloc(nb * sizeof *cmds + 1);
    const char **argv = kvr_mem_malloc(nb * 4 * sizeof *argv + 1);
    size_t *argl = kvr_mem_malloc(nb * 4 * sizeof *argl + 1);
    range_arg *ra = kvr_mem_malloc(nb * sizeof *ra + 1);
    bool *good = kvr_mem_calloc(nb + 1, sizeof *good);
    blk_state *st = kvr_mem_malloc(nb * sizeof *st + 1);
    size_t n_good = 0;
    if (!keys || !cmds || !argv || !argl || !ra || !good || !st)
        goto out;
    size_t ml = r->keyed ? KVR_RT_MAC_LEN : 0;
    for (size_t b = 0; b < nb; b++) {
        size_t s = b * KVR_RT_BLOCK, n = n_ctx - s < KVR_RT_BLOCK ? n_ctx - s : KVR_RT_BLOCK;
        size_t kl = kvr__rt_block_key(chains[b], keys[b]);
        range_set(&ra[b], BLOCK_HDR + n * 12 + kv_bytes(&j->desc, n) + 4 + ml, argv + 4 * b,
                  argl + 4 * b, keys[b], kl);
        cmds[b] = (kvr_rc_cmd){ 4, argv + 4 * b, argl + 4 * b };
    }
    fetch_ctx f = { j, chains, n_ctx, tokens, pos, keys, good, st, row_bytes(&j->desc),
                    { .flat = j->put ? NULL : j->payload, .iov = j->iov, .niov = j->niov,
                      .starts = j->starts } };
    kvr__rc_batch_sink(r->rc, nb, cmds, &blk_sink, &f);
    while (n_good < nb && good[n_good])
        n_good++;
    if (n_good < nb)
        miss(j, false, "a block is missing or bad (evicted, never published, or corrupt)");
out:
    kvr_mem_free(keys);
    kvr_mem_free(cmds);
    kvr_mem_free(argv);
    kvr_mem_free(argl);
    kvr_mem_free(ra);
    kvr_mem_free(good);
    kvr_mem_free(st);
    return n_good;
}

/* A quantized context's values, read straight into its raw put's payload:
 * the chunks into the encoded part (per layer K bytes then V bytes of all
 * n_raw tokens), the window's plain blocks after it. */
typedef struct qfetch {
    kvr_rjob  *j;
    crypto_generichash_state *mac;   /* keyed: per chunk, as in blk_state */
    uint8_t  (*tag)[KVR_RT_MAC_LEN];
    size_t    *raw_len;
    size_t     nch, hmax;
    uint8_t   *base;             /* the raw put's payload */
    uint8_t   *hdr;              /* nch * hmax: each chunk's header, tokens, positions */
    uint8_t  (*tail)[4];
    uint32_t  *crc;
    size_t    *got_len;
    bool      *sized, *good;
    char     (*keys)[KVR_RT_KEY_MAX];
    fetch_ctx  w;                /* the window's blocks */
} qfetch;

static bool q_begin(void *ud, size_t i, size_t len)
{
    qfetch *q = ud;
    if (i >= q->nch)
        return blk_begin(&q->w, i - q->nch, len);
    size_t s, n;
    bool ch;
    kvr__rt_manifest_block(&q->j->m, i, &s, &n, &ch);
    const kvr_remote *r = q->j->r;
    size_t ml = r->keyed ? KVR_RT_MAC_LEN : 0;
    q->raw_len[i] = len;
    q->got_len[i] = len >= ml ? len - ml : len;
    q->sized[i] = len >= ml && q->got_len[i] == chunk_len(&q->j->m, n);
    if (q->sized[i] && ml)
        kvr__rt_mac_begin(&q->mac[i], r->key, q->keys[i], strlen(q->keys[i]));
    q->crc[i] = 0;
    memset(q->hdr + i * q->hmax, 0, CHUNK_HDR);
    return true;
}

static uint8_t *q_span(void *ud, size_t i, size_t off, size_t *cap)
{
    qfetch *q = ud;
    if (i >= q->nch)
        return blk_span(&q->w, i - q->nch, off, cap);
    if (!q->sized[i])
        return NULL;
    const kvr_rt_manifest *m = &q->j->m;
    size_t s, n;
    bool ch;
    kvr__rt_manifest_block(m, i, &s, &n, &ch);
    size_t hl = CHUNK_HDR + n * 12, kb = chunk_kb(m, n), vb = chunk_vb(m, n);
    size_t body = m->desc.n_layers * (kb + vb);
    if (off >= hl + body + 4) {        /* its MAC */
        *cap = hl + body + 4 + KVR_RT_MAC_LEN - off;
        return q->tag[i] + (off - hl - body - 4);
    }
    if (off < hl) {
        *cap = hl - off;
        return q->hdr + i * q->hmax + off;
    }
    if (off >= hl + body) {
        *cap = hl + body + 4 - off;
        return q->tail[i] + (off - hl - body);
    }
    size_t in = off - hl, l = in / (kb + vb), w = in % (kb + vb);
    if (w < kb) {
        *cap = kb - w;
        return q->base + raw_off(m, l, 0, s) + w;
    }
    *cap = kb + vb - w;
    return q->base + raw_off(m, l, 1, s) + (w - kb);
}

static void q_got(void *ud, size_t i, size_t off, const uint8_t *p, size_t n)
{
    qfetch *q = ud;
    if (i >= q->nch) {
        blk_got(&q->w, i - q->nch, off, p, n);
        return;
    }
    size_t len = q->got_len[i];
    if (!q->sized[i] || off >= len)
        return;
    if (q->j->r->keyed)
        crypto_generichash_update(&q->mac[i], p, len - off < n ? len - off : n);
    if (off >= len - 4)
        return;
    size_t take = len - 4 - off < n ? len - 4 - off : n;
    q->crc[i] = kvr_crc32c(q->crc[i], p, take);
}

static bool q_end(void *ud, size_t i, bool is_string)
{
    qfetch *q = ud;
    if (i >= q->nch)
        return blk_end(&q->w, i - q->nch, is_string);
    q->good[i] = false;
    if (!is_string || q->raw_len[i] == 0)
        return false;
    size_t cs, cn;
    bool cch;
    kvr__rt_manifest_block(&q->j->m, i, &cs, &cn, &cch);
    if (q->j->r->keyed && (q->sized[i] ? !kvr__rt_mac_end_ok(&q->mac[i], q->tag[i])
                                       : q->raw_len[i] == chunk_len(&q->j->m, cn))) {
        forged(q->j, q->keys[i]);     /* a wrong MAC, or a good value without one */
        return false;
    }
    kvr_error e = { 0 };
    bool crc_ok = q->sized[i] && q->crc[i] == get32(q->tail[i]);
    uint8_t small[CHUNK_HDR] = { 0 };
    const uint8_t *hv = q->hdr + i * q->hmax;
    if (!q->sized[i])
        hv = short_head(small, CHUNK_MAGIC);
    int rc = kvr__rt_chunk_check(hv, q->got_len[i], crc_ok, &q->j->m, i, q->j->m.chains[i], &e);
    return value_checked(q->j, q->keys[i], rc, &e, &q->good[i]);
}

static const kvr_rc_sink q_sink = { q_begin, q_span, q_got, q_end };

/* All values of a quantized context into base (the raw put's payload);
 * true if every one was good. */
static bool fetch_quant(kvr_rjob *j, uint8_t *base)
{
    kvr_remote *r = j->r;
    const kvr_rt_manifest *m = &j->m;
    size_t nb = m->n_blocks, nch = (m->n_raw + m->chunk - 1) / m->chunk, nwb = nb - nch;
    size_t nw = m->n_tokens - m->n_raw, hmax = CHUNK_HDR + (size_t)m->chunk * 12;
    qfetch q = { .j = j, .nch = nch, .hmax = hmax, .base = base };
    q.hdr = kvr_mem_malloc(nch * hmax + 1);
    q.tail = kvr_mem_malloc(nch * 4 + 1);
    q.crc = kvr_mem_malloc(nch * 4 + 1);
    q.got_len = kvr_mem_malloc(nch * sizeof *q.got_len + 1);
    q.raw_len = kvr_mem_malloc(nch * sizeof *q.raw_len + 1);
    q.mac = kvr_mem_malloc(nch * sizeof *q.mac + 1);
    q.tag = kvr_mem_malloc(nch * sizeof *q.tag + 1);
    q.sized = kvr_mem_calloc(nch + 1, 1);
    q.good = kvr_mem_calloc(nch + 1, 1);
    q.keys = kvr_mem_malloc(nb * KVR_RT_KEY_MAX + 1);
    kvr_rc_cmd *cmds = kvr_mem_malloc(nb * sizeof *cmds + 1);
    const char **argv = kvr_mem_malloc(nb * 4 * sizeof *argv + 1);
    size_t *argl = kvr_mem_malloc(nb * 4 * sizeof *argl + 1);
    range_arg *ra = kvr_mem_malloc(nb * sizeof *ra + 1);
    bool *wgood = kvr_mem_calloc(nwb + 1, 1);
    blk_state *wst = kvr_mem_malloc(nwb * sizeof *wst + 1);
    bool all = false;
    if (!q.hdr || !q.tail || !q.crc || !q.got_len || !q.raw_len || !q.mac || !q.tag ||
        !q.sized || !q.good || !q.keys || !cmds || !argv || !argl || !ra || !wgood || !wst)
        goto out;
    size_t ml = r->keyed ? KVR_RT_MAC_LEN : 0;
    for (size_t b = 0; b < nb; b++) {
        size_t s, n;
        bool ch;
        kvr__rt_manifest_block(m, b, &s, &n, &ch);
        size_t kl = b < nch ? kvr__rt_chunk_key(m->chains[b], q.keys[b])
                            : kvr__rt_block_key(m->chains[b], q.keys[b]);
        size_t want = b < nch ? chunk_len(m, n) : BLOCK_HDR + n * 12 + kv_bytes(&j->desc, n) + 4;
        range_set(&ra[b], want + ml, argv + 4 * b, argl + 4 * b, q.keys[b], kl);
        cmds[b] = (kvr_rc_cmd){ 4, argv + 4 * b, argl + 4 * b };
    }
    q.w = (fetch_ctx){ j, m->chains + nch, nw, m->tokens + m->n_raw, m->positions + m->n_raw,
                       q.keys + nch, wgood, wst, row_bytes(&j->desc),
                       { .flat = base + m->desc.n_layers * (m->raw_kb + m->raw_vb) } };
    kvr__rc_batch_sink(r->rc, nb, cmds, &q_sink, &q);
    all = true;
    for (size_t b = 0; b < nch; b++)
        all = all && q.good[b];
    for (size_t b = 0; b < nwb; b++)
        all = all && wgood[b];
    if (!all)
        miss(j, false, "a value is missing or bad (evicted, never published, or corrupt)");
out:
    kvr_mem_free(q.hdr);
    kvr_mem_free(q.tail);
    kvr_mem_free(q.crc);
    kvr_mem_free(q.got_len);
    kvr_mem_free(q.raw_len);
    kvr_mem_free(q.mac);
    kvr_mem_free(q.tag);
    kvr_mem_free(q.sized);
    kvr_mem_free(q.good);
    kvr_mem_free(q.keys);
    kvr_mem_free(cmds);
    kvr_mem_free(argv);
    kvr_mem_free(argl);
    kvr_mem_free(ra);
    kvr_mem_free(wgood);
    kvr_mem_free(wst);
    return all;
}

static void work_by_id(kvr_rjob *j)
{
    kvr_remote *r = j->r;
    if (j->phase == 1) {
        bool ok = j->m.quant
                      ? fetch_quant(j, (uint8_t *)j->iov[0].iov_base)
                      : fetch_blocks(j, j->m.chains, j->m.n_blocks, j->m.n_tokens, j->m.tokens,
                                     j->m.positions) == j->m.n_blocks;
        if (ok) {
            j->hit = true;
            j->n_tokens = j->m.n_tokens;
        }
        return;
    }
    char mk[KVR_RT_KEY_MAX];
    size_t mkl = kvr__rt_manifest_key(j->ctx_id, mk);
    /* Its header first: what it says bounds what is read of the rest. */
    bool too_long = false;
    redisReply *x = get_head(r->rc, mk, mkl, MANIFEST_HDR);
    size_t mmax = x && x->len == MANIFEST_HDR ? manifest_max(r, (const uint8_t *)x->str) : 0;
    if (x && mmax == 0) {
        freeReplyObject(x);
        char why[200];
        snprintf(why, sizeof why, "%s: not a manifest, or one larger than this node takes "
                 "(docs/cluster.md)", mk);
        miss(j, true, why);
        return;
    }
    if (x) {
        freeReplyObject(x);
        x = get_bounded(r->rc, mk, mkl, mmax, &too_long);
    }
    if (!x) {
        if (too_long) {
            char why[200];
            snprintf(why, sizeof why, "%s: longer than its header says (not read)", mk);
            miss(j, true, why);
        } else {
            miss(j, false, "no manifest");
        }
        return;
    }
    size_t vl;
    if (!unseal(j, mk, mkl, x, &vl)) {
        freeReplyObject(x);
        miss(j, false, "a manifest without this cluster's MAC");
        return;
    }
    kvr_error e = { 0 };
    int rc = kvr__rt_manifest_decode((const uint8_t *)x->str, vl, j->ctx_id, &j->m, &e);
    freeReplyObject(x);
    if (rc < 0) {
        char why[400];
        snprintf(why, sizeof why, "%s: %s", mk, e.msg);
        miss(j, true, why);
        return;
    }
    j->desc = j->m.desc;
    j->have_manifest = true;     /* the loop opens the put, then phase 1 */
}

/* The finer candidates after `run` whole blocks of the prompt (chain
 * `prev` before them): a published context's last, shorter block of 1..63
 * tokens ("kvr1:b:"), and the sub-block prefix keys of 16, 32, 48 tokens
 * ("kvr1:p:"), each as far as the prompt goes. Same hash for a length
 * either way (kvr__rt_chain_next of those tokens). */
#define FINE_MAX (KVR_RT_BLOCK - 1 + KVR_RT_BLOCK / KVR_RT_GRAIN - 1)

typedef struct fine {
    size_t   n;
    char     keys[FINE_MAX][KVR_RT_KEY_MAX];
    uint32_t len[FINE_MAX];
    bool     sub[FINE_MAX];
    uint64_t chain[FINE_MAX];
    const char *argv[FINE_MAX][2];
    size_t   argl[FINE_MAX][2];
} fine;

static void fine_build(fine *f, uint64_t prev, const uint32_t *tok, const int64_t *pos,
                       size_t avail)
{
    f->n = 0;
    if (avail > KVR_RT_BLOCK)
        avail = KVR_RT_BLOCK;
    for (uint32_t e = 1; e <= avail && e < KVR_RT_BLOCK; e++) {
        uint64_t c = kvr__rt_chain_next(prev, tok, pos, e);
        for (int sub = 0; sub < 2; sub++) {
            if (sub && e % KVR_RT_GRAIN)
                continue;
            size_t i = f->n++;
            f->len[i] = e;
            f->sub[i] = sub;
            f->chain[i] = c;
            f->argv[i][0] = "EXISTS";
            f->argl[i][0] = 6;
            f->argl[i][1] = sub ? kvr__rt_sub_key(c, f->keys[i]) : kvr__rt_block_key(c, f->keys[i]);
            f->argv[i][1] = f->keys[i];
        }
    }
}

/* The longest present candidate (a shorter block before a prefix key of
 * the same length): its index, or -1. */
static int fine_best(const fine *f, redisReply *const *rep)
{
    int best = -1;
    for (size_t i = 0; i < f->n; i++)
        if (rep[i] && rep[i]->type == REDIS_REPLY_INTEGER && rep[i]->integer == 1 &&
            (best < 0 || f->len[i] > f->len[best]))
            best = (int)i;
    return best;
}

static void work_prefix(kvr_rjob *j)
{
    kvr_remote *r = j->r;
    size_t np = j->n_prompt, nb = np / KVR_RT_BLOCK;
    uint64_t *chains = kvr_mem_malloc((nb + 1) * 8);
    int64_t *pos = kvr_mem_malloc(np * 8 + 1);
    char (*keys)[KVR_RT_KEY_MAX] = kvr_mem_malloc((nb + 1) * KVR_RT_KEY_MAX);
    kvr_rc_cmd *cmds = kvr_mem_malloc((nb + FINE_MAX) * sizeof *cmds);
    const char **argv = kvr_mem_malloc((nb + 1) * 2 * sizeof *argv);
    size_t *argl = kvr_mem_malloc((nb + 1) * 2 * sizeof *argl);
    redisReply **rep = kvr_mem_calloc(nb + FINE_MAX, sizeof *rep);
    fine *f = kvr_mem_malloc(sizeof *f);
    size_t nrep = 0;
    if (!chains || !pos || !keys || !cmds || !argv || !argl || !rep || !f)
        goto out;
    for (size_t i = 0; i < np; i++)
        pos[i] = (int64_t)i;
    uint64_t seed = kvr__rt_chain_seed(&j->desc), h = seed;
    for (size_t b = 0; b < nb; b++) {
        h = kvr__rt_chain_next(h, j->prompt + b * KVR_RT_BLOCK, pos + b * KVR_RT_BLOCK,
                              KVR_RT_BLOCK);
        chains[b] = h;
        argv[2 * b] = "EXISTS";
        argl[2 * b] = 6;
        argl[2 * b + 1] = kvr__rt_block_key(h, keys[b]);
        argv[2 * b + 1] = keys[b];
        cmds[b] = (kvr_rc_cmd){ 2, argv + 2 * b, argl + 2 * b };
    }
    /* Probe every chain hash at once (one pipelined round per node): the
     * run of present blocks from the start is the cluster's prefix. The
     * finer candidates of the first block go in the same round (a prompt
     * the cluster does not hold costs one round trip). */
    fine_build(f, seed, j->prompt, pos, np);
    for (size_t i = 0; i < f->n; i++)
        cmds[nb + i] = (kvr_rc_cmd){ 2, f->argv[i], f->argl[i] };
    nrep = nb + f->n;
    atomic_fetch_add(&r->probes, 1);
    kvr__rc_batch(r->rc, nrep, cmds, rep);
    size_t run = 0;
    while (run < nb && rep[run] && rep[run]->type == REDIS_REPLY_INTEGER && rep[run]->integer == 1)
        run++;
    int best = -1;
    if (run == 0) {
        best = fine_best(f, rep + nb);
    } else if (run * KVR_RT_BLOCK < np) {
        /* A second round: the finer candidates after the run. */
        size_t s0 = run * KVR_RT_BLOCK;
        for (size_t i = nb; i < nrep; i++) {
            if (rep[i])
                freeReplyObject(rep[i]);
            rep[i] = NULL;
        }
        fine_build(f, chains[run - 1], j->prompt + s0, pos + s0, np - s0);
        nrep = nb + f->n;
        for (size_t i = 0; i < f->n; i++)
            cmds[i] = (kvr_rc_cmd){ 2, f->argv[i], f->argl[i] };
        kvr__rc_batch(r->rc, f->n, cmds, rep + nb);
        best = fine_best(f, rep + nb);
    }
    size_t extra = best >= 0 ? f->len[best] : 0, len = run * KVR_RT_BLOCK + extra;
    if (len == 0 || len <= j->local_len) {
        miss(j, false, "the cluster's prefix is no longer than the local one");
        goto out;
    }
    j->payload = kvr_mem_malloc(kv_bytes(&j->desc, len));
    if (!j->payload)
        goto out;
    kvr__rc_set_deadline(j->deadline_ms + kv_bytes(&j->desc, len) / SLOW_BYTES_PER_MS);
    /* The whole blocks, and a shorter last block, straight into the payload. */
    bool tail_block = best >= 0 && !f->sub[best];
    if (tail_block)
        chains[run] = f->chain[best];
    size_t nfetch = run + (tail_block ? 1 : 0);
    size_t good = nfetch ? fetch_blocks(j, chains, nfetch, len, j->prompt, pos) : 0;
    size_t glen = good == nfetch ? len : good * KVR_RT_BLOCK;
    if (best >= 0 && f->sub[best] && good == nfetch) {
        /* A prefix key: the whole block it names, of which the first
         * `extra` tokens are the prompt's. */
        size_t s0 = run * KVR_RT_BLOCK;
        char vk[KVR_RT_KEY_MAX];
        size_t vkl = kvr__rt_sub_key(f->chain[best], vk);
        size_t ml = r->keyed ? KVR_RT_MAC_LEN : 0;
        redisReply *x = get_bounded(r->rc, vk, vkl, KVR_RT_SUB_LEN + ml, NULL);
        uint64_t bchain = 0;
        uint32_t bn = 0;
        kvr_error e = { 0 };
        size_t vl = 0;
        bool sealed = true;
        int rc = !x ? kvr_error_set(&e, KVR_EIO, "%s: gone", vk)
               : !(sealed = unseal(j, vk, vkl, x, &vl))
                   ? kvr_error_set(&e, KVR_EIO, "%s: MAC mismatch", vk)
                   : kvr__rt_sub_decode((const uint8_t *)x->str, vl, &j->desc, (uint32_t)extra,
                                       &bchain, &bn, &e);
        if (x)
            freeReplyObject(x);
        if (rc == 0) {
            char bk[KVR_RT_KEY_MAX];
            size_t bkl = kvr__rt_block_key(bchain, bk);
            x = bn <= KVR_RT_BLOCK
                    ? get_bounded(r->rc, bk, bkl, BLOCK_HDR + bn * 12 + kv_bytes(&j->desc, bn) +
                                  4 + ml, NULL)
                    : NULL;
            rc = !x ? kvr_error_set(&e, KVR_EIO, "%s: gone", bk)
               : !(sealed = unseal(j, bk, bkl, x, &vl))
                   ? kvr_error_set(&e, KVR_EIO, "%s: MAC mismatch", bk)
                   : kvr__rt_decode_head((const uint8_t *)x->str, vl, &j->desc,
                                 run ? chains[run - 1] : seed, bchain, s0, bn, j->prompt + s0,
                                 pos + s0, extra, j->payload, len, &e);
            if (x)
                freeReplyObject(x);
        }
        if (rc < 0) {
            char why[400];
            snprintf(why, sizeof why, "%s: %s", vk, e.msg);
            bool evicted = strstr(e.msg, ": gone") != NULL;
            miss(j, !evicted && sealed, why);    /* a forgery is counted as such */
            glen = s0;
        }
    }
    if (glen == 0 || glen <= j->local_len)
        goto out;
    /* A shorter good run still helps: the payload is laid out for len
     * tokens, so land exactly glen by compacting per layer side. */
    if (glen < len) {
        size_t row = row_bytes(&j->desc);
        for (size_t l = 0; l < 2 * (size_t)j->desc.n_layers; l++)
            memmove(j->payload + l * glen * row, j->payload + l * len * row, glen * row);
    }
    j->m.tokens = kvr_mem_malloc(glen * 4);
    j->m.positions = kvr_mem_malloc(glen * 8);
    if (!j->m.tokens || !j->m.positions)
        goto out;
    memcpy(j->m.tokens, j->prompt, glen * 4);
    memcpy(j->m.positions, pos, glen * 8);
    j->n_tokens = glen;
    /* Named after the chain hash of the prefix's last token (a whole
     * block's, or the finer one's: the same hash names the same tokens). */
    uint64_t last = glen == len && best >= 0 ? f->chain[best] : chains[glen / KVR_RT_BLOCK - 1];
    snprintf(j->ctx_id, sizeof j->ctx_id, "cluster:%016" PRIx64, last);
    j->hit = true;
out:
    for (size_t b = 0; rep && b < nrep; b++)
        if (rep[b])
            freeReplyObject(rep[b]);
    kvr_mem_free(chains);
    kvr_mem_free(pos);
    kvr_mem_free(keys);
    kvr_mem_free(cmds);
    kvr_mem_free(argv);
    kvr_mem_free(argl);
    kvr_mem_free(rep);
    kvr_mem_free(f);
}

void kvr__remote_job_work(kvr_rjob *j)
{
    /* The whole fetch (both phases of a get) ends by its deadline. */
    if (kvr_clock_mono_ms() >= j->deadline_ms) {
        miss(j, false, "the fetch deadline passed (the cluster is slow or hung)");
        return;
    }
    kvr__rc_set_deadline(j->deadline_ms);
    if (!kvr__remote_up(j->r)) {
        miss(j, false, "the cluster is unreachable");
    } else {
        j->worked = true;
        if (j->by_id)
            work_by_id(j);
        else
            work_prefix(j);
    }
    kvr__rc_set_deadline(0);
}

/* A local model for the fetched data: the named one if its fingerprint
 * agrees, else any with that fingerprint. */
static int find_model(kvr_store *s, const char *name, uint64_t fp, kvr_model_info *out)
{
    if (name[0] && kvr_store_model_find(s, name, out) == 0 && out->fingerprint == fp)
        return 0;
    kvr_model_info all[64];
    size_t n = kvr_store_model_list(s, all, 64);
    for (size_t i = 0; i < n && i < 64; i++)
        if (all[i].fingerprint == fp) {
            *out = all[i];
            return 0;
        }
    return KVR_ENOMODEL;
}

/* Does the manifest carry a layout beyond tokens and positions? */
static bool has_layout(const kvr_rt_manifest *m)
{
    if (m->layout.has_prefix || m->layout.n_groups || m->layout.has_retention ||
        m->layout.v_trans)
        return true;
    for (size_t i = 0; i < m->n_tokens; i++)
        if (m->flags[i])
            return true;
    return false;
}

/* Loop thread: the fetched K/V is in t's memory; convert if needed, commit,
 * then give the context the layout it has on the publishing node. */
static int land_commit(kvr_rjob *j, kvr_put *t)
{
    kvr_error e = { 0 };
    int rc;
    if (kvr_put_needs_work(t) && (rc = kvr_put_work(t, &e)) < 0) {
        kvr_put_abort(t);
        kvr_log(KVR_LOG_WARN, "remote tier: fetched '%s' refused: %s", j->ctx_id, e.msg);
        return rc;
    }
    kvr_put_result res;
    rc = kvr_put_commit(t, &res, &e);
    if (rc < 0) {
        kvr_log(KVR_LOG_WARN, "remote tier: cannot keep '%s' locally: %s", j->ctx_id, e.msg);
        return rc;
    }
    if (j->by_id && has_layout(&j->m) &&
        (rc = kvr_store_layout_restore(j->r->d->store, j->ctx_id, &j->m.layout, j->m.groups,
                                       j->m.flags, j->m.n_tokens, &e)) < 0) {
        /* Without its layout it is not what the publisher has: a miss. */
        kvr_store_delete(j->r->d->store, j->ctx_id, NULL);
        char why[600];
        snprintf(why, sizeof why, "the layout of '%.200s' cannot be applied: %.300s",
                 j->ctx_id, e.msg);
        miss(j, true, why);
        return KVR_ENOCTX;
    }
    atomic_fetch_add(&j->r->fetch_hits, 1);
    atomic_fetch_add(&j->r->fetch_tokens, j->n_tokens);
    kvr_log(KVR_LOG_DEBUG, "remote tier: fetched '%s' (%zu tokens)", j->ctx_id, j->n_tokens);
    return 0;
}

int kvr__remote_job_land(kvr_rjob *j)
{
    if (j->by_id && j->phase == 1) {
        kvr_put *t = j->put;
        j->put = NULL;
        kvr_list_remove(&j->link);
        if (!j->hit) {
            kvr_put_abort(t);
            return KVR_ENOCTX;
        }
        return land_commit(j, t);
    }
    if (j->by_id ? !j->have_manifest : !j->hit)
        return KVR_ENOCTX;
    kvr_remote *r = j->r;
    kvr_store *s = r->d->store;
    kvr_model_info mi;
    if (find_model(s, j->by_id ? j->m.model : j->model, j->desc.fingerprint, &mi) < 0) {
        miss(j, false, "no local model has the context's fingerprint (register it first)");
        return KVR_ENOCTX;
    }
    if (mi.n_layers != j->desc.n_layers || mi.n_kv_heads != j->desc.n_kv_heads ||
        mi.head_dim != j->desc.head_dim) {
        miss(j, true, "the fetched shape differs from the local model's");
        return KVR_ENOCTX;
    }
    if (j->by_id) {
        j->n_tokens = j->m.n_tokens;
        /* Every field of the manifest's layout passes the checks of the
         * verb that would set it here, before anything is stored. */
        kvr_error le = { 0 };
        if (kvr_layout_info_check(&j->m.layout, j->ctx_id, mi.fingerprint, j->m.groups,
                                  j->m.flags, j->m.n_tokens, &le) < 0) {
            char why[600];
            snprintf(why, sizeof why, "manifest of '%.200s': bad layout: %.300s", j->ctx_id,
                     le.msg);
            miss(j, true, why);
            return KVR_ENOCTX;
        }
    }
    kvr_put_params pp = {
        .ctx_id = j->ctx_id,
        .model = mi.name,
        .mode = KVR_PUT_CREATE,
        .fingerprint = mi.fingerprint,
        .n_layers = mi.n_layers,
        .n_kv_heads = mi.n_kv_heads,
        .head_dim = mi.head_dim,
        .dtype = j->desc.dtype,
        .n_tokens = j->n_tokens,
        .tokens = j->m.tokens,
        .positions = j->m.positions,
        .codec = j->by_id && j->m.quant ? j->m.codec : kvr_dtype_name(j->desc.dtype),
        .has_protect_first = j->by_id && j->m.n_protected > 0,
        .protect_first = j->by_id ? j->m.n_protected : 0,
        .raw = j->by_id && j->m.quant,
        .raw_tokens = j->by_id && j->m.quant ? j->m.n_raw : 0,
    };
    kvr_put *t;
    kvr_error e = { 0 };
    int rc = kvr_store_put_begin(s, &pp, &t, &e);
    if (rc == KVR_EEXIST)
        return 0;
    if (rc == KVR_EBUSY && j->by_id && kvr__remote_landing(r, j->ctx_id))
        return KVR_RT_WAIT;     /* another request's fetch of it is landing */
    if (rc == KVR_EBUSY) {      /* a client's put of that id is open: absent for now */
        miss(j, false, "the id is being written locally");
        return KVR_ENOCTX;
    }
    if (rc < 0) {
        kvr_log(KVR_LOG_WARN, "remote tier: cannot keep '%s' locally: %s", j->ctx_id, e.msg);
        return rc;
    }
    const struct iovec *iov;
    size_t niov;
    kvr_put_payload_iov(t, &iov, &niov);
    bool q = j->by_id && j->m.quant;
    size_t want = q ? j->desc.n_layers * (j->m.raw_kb + j->m.raw_vb) +
                          kv_bytes(&j->desc, j->n_tokens - j->m.n_raw)
                    : kv_bytes(&j->desc, j->n_tokens);
    if (kvr_put_payload_size(t) != want || (q && niov != 1)) {
        kvr_put_abort(t);
        miss(j, true, "the fetched context's size differs from the local put's (another "
             "codec layout?)");
        return KVR_ENOCTX;
    }
    if (j->by_id) {
        /* Phase 1: the blocks are fetched straight into the put's memory. */
        j->starts = kvr_mem_malloc((niov + 1) * sizeof *j->starts);
        if (!j->starts) {
            kvr_put_abort(t);
            return KVR_ENOMEM;
        }
        size_t off = 0;
        for (size_t i = 0; i < niov; i++) {
            j->starts[i] = off;
            off += iov[i].iov_len;
        }
        j->put = t;
        kvr_list_insert_tail(&r->landing, &j->link);
        j->iov = iov;
        j->niov = niov;
        j->phase = 1;
        /* The blocks get a deadline of their own, by their size. */
        j->deadline_ms = kvr_clock_mono_ms() + FETCH_MS + want / SLOW_BYTES_PER_MS;
        return 1;
    }
    size_t off = 0;
    for (size_t i = 0; i < niov; i++) {
        memcpy(iov[i].iov_base, j->payload + off, iov[i].iov_len);
        off += iov[i].iov_len;
    }
    return land_commit(j, t);
}
