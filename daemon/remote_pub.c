/*
 * remote_pub.c — the shared tier's life and its publisher thread
 * (remote.h, docs/cluster.md): create (connects; a wrong password stops
 * the start), close and destroy; joining the cluster (kvr__remote_up);
 * publications, which run on one publisher thread, in order, and come back
 * to the loop through an async handle (a synchronous put's reply is sent
 * from there); the tier's counters for stats and /metrics.
 *
 * Invariants: a publication snapshots its context on the loop thread (a
 * get: its blocks leased until the job ends there), after the local put
 * committed, so the cluster can only lack what is local, never hold what
 * is not; the queue is bounded (PUB_QUEUE_MAX, a quarter of --max-memory
 * of snapshots) and a share beyond it is dropped and counted, never
 * waited for; every queued job's done callback runs exactly once on the
 * loop thread, at shutdown too.
 */
#include "base/clock.h"
#include "daemon/remote_internal.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <sys/stat.h>

/* ---- the tier ---------------------------------------------------------- */

struct pub_job {
    kvr_list        link;       /* on r->queue, then r->finished */
    kvr_rt_manifest m;
    kvr_get  *get;              /* the snapshot: leased blocks (ended on the loop);
                                   quantized: a raw get of the encoded tokens */
    const struct iovec *iov;    /* its payload (after its work, if any) */
    size_t    niov;
    size_t   *starts;           /* payload offset of each iov */
    kvr_get  *get2;             /* quantized: a get of the window (NULL: none) */
    const struct iovec *iov2;
    size_t    niov2;
    size_t   *starts2;
    kvr_remote_done_fn done;    /* loop thread, when finished (may be NULL) */
    void     *done_arg;
    uint64_t  deadline_ms;      /* queued + PUBLISH_MS */
    size_t    bytes;            /* the snapshot's K/V (counted in pending_bytes) */
    int       rc;
    char      msg[512];
};



/* Is the cluster usable? If we have not joined, try (at most every
 * REJOIN_MS; between tries callers get a fast "no"). */
bool kvr__remote_up(kvr_remote *r)
{
    if (atomic_load(&r->joined))
        return true;
    uint64_t now = kvr_clock_mono_ms(), last = atomic_load(&r->last_try_ms);
    if (last && now - last < REJOIN_MS)
        return false;
    if (!atomic_compare_exchange_strong(&r->last_try_ms, &last, now))
        return false;
    kvr_error e = { 0 };
    if (kvr__rc_refresh(r->rc, &e) == 0) {
        kvr_rc_stats st;
        kvr__rc_get_stats(r->rc, &st);
        if (!atomic_exchange(&r->joined, true))
            kvr_log(KVR_LOG_WARN, "remote tier: joined the cluster (%u slot ranges)",
                    st.n_masters);
        return true;
    }
    return false;
}

/* With a cluster key: appends the MAC of the value *v (*len bytes, a
 * kvr_mem buffer, reallocated) under Redis key rkey. false: out of memory
 * (*v unchanged). */
static bool seal(const kvr_remote *r, const char *rkey, size_t rklen, uint8_t **v, size_t *len)
{
    if (!r->keyed)
        return true;
    uint8_t *n = kvr_mem_realloc(*v, *len + KVR_RT_MAC_LEN);
    if (!n)
        return false;
    kvr__rt_mac(r->key, rkey, rklen, n, *len, n + *len);
    *v = n;
    *len += KVR_RT_MAC_LEN;
    return true;
}

/* SETs every block's sub-block prefix keys, pipelined. */
static int publish_subs(kvr_remote *r, const kvr_rt_manifest *m)
{
    size_t per = KVR_RT_BLOCK / KVR_RT_GRAIN - 1, cap = m->n_blocks * per + 1;
    char (*keys)[KVR_RT_KEY_MAX] = kvr_mem_malloc(cap * KVR_RT_KEY_MAX);
    uint8_t (*vals)[KVR_RT_SUB_LEN + KVR_RT_MAC_LEN] = kvr_mem_malloc(cap * sizeof *vals);
    kvr_rc_cmd *cmds = kvr_mem_malloc(cap * sizeof *cmds);
    const char **argv = kvr_mem_malloc(cap * 3 * sizeof *argv);
    size_t *argl = kvr_mem_malloc(cap * 3 * sizeof *argl);
    redisReply **rep = kvr_mem_calloc(cap, sizeof *rep);
    int rc = KVR_ENOMEM;
    if (!keys || !vals || !cmds || !argv || !argl || !rep)
        goto out;
    size_t k = 0;
    for (size_t b = 0; b < m->n_blocks; b++) {
        size_t s = b * KVR_RT_BLOCK, n = m->n_tokens - s < KVR_RT_BLOCK ? m->n_tokens - s
                                                                        : KVR_RT_BLOCK;
        uint64_t prev = b ? m->chains[b - 1] : kvr__rt_chain_seed(&m->desc);
        for (uint32_t e = KVR_RT_GRAIN; e < n; e += KVR_RT_GRAIN, k++) {
            uint64_t sub = kvr__rt_chain_next(prev, m->tokens + s, m->positions + s, e);
            argl[3 * k + 1] = kvr__rt_sub_key(sub, keys[k]);
            kvr__rt_sub_encode(&m->desc, m->chains[b], (uint32_t)n, e, vals[k]);
            if (r->keyed)
                kvr__rt_mac(r->key, keys[k], argl[3 * k + 1], vals[k], KVR_RT_SUB_LEN,
                           vals[k] + KVR_RT_SUB_LEN);
            argv[3 * k] = "SET";
            argl[3 * k] = 3;
            argv[3 * k + 1] = keys[k];
            argv[3 * k + 2] = (const char *)vals[k];
            argl[3 * k + 2] = KVR_RT_SUB_LEN + (r->keyed ? KVR_RT_MAC_LEN : 0);
            cmds[k] = (kvr_rc_cmd){ 3, argv + 3 * k, argl + 3 * k };
        }
    }
    size_t ok = kvr__rc_batch(r->rc, k, cmds, rep);
    for (size_t i = 0; i < k; i++)
        if (rep[i])
            freeReplyObject(rep[i]);
    rc = ok == k ? 0 : KVR_EIO;
out:
    kvr_mem_free(keys);
    kvr_mem_free(vals);
    kvr_mem_free(cmds);
    kvr_mem_free(argv);
    kvr_mem_free(argl);
    kvr_mem_free(rep);
    return rc;
}

static void publish_one(kvr_remote *r, pub_job *j)
{
    kvr_rt_manifest *m = &j->m;
    if (!kvr__remote_up(r)) {
        j->rc = KVR_EIO;
        snprintf(j->msg, sizeof j->msg, "remote tier: the cluster is unreachable");
        return;
    }
    /* The snapshot's conversion/rotation (if any) and its layout, here,
     * off the loop thread; the bytes are read straight from its leased
     * block memory. */
    kvr_get *gs[2] = { j->get, j->get2 };
    for (int k = 0; k < 2; k++) {
        kvr_error ge = { 0 };
        if (gs[k] && kvr_get_needs_work(gs[k]) && kvr_get_work(gs[k], &ge) < 0) {
            j->rc = KVR_EIO;
            snprintf(j->msg, sizeof j->msg, "remote tier: snapshot of '%.200s': %.250s",
                     m->ctx_id, ge.msg);
            return;
        }
    }
    if (j->get)
        kvr_get_payload_iov(j->get, &j->iov, &j->niov);
    if (j->get2)
        kvr_get_payload_iov(j->get2, &j->iov2, &j->niov2);
    j->starts = kvr_mem_malloc((j->niov + 1) * sizeof *j->starts);
    j->starts2 = kvr_mem_malloc((j->niov2 + 1) * sizeof *j->starts2);
    if (!j->starts || !j->starts2) {
        j->rc = KVR_ENOMEM;
        snprintf(j->msg, sizeof j->msg, "remote tier: out of memory publishing");
        return;
    }
    size_t off = 0;
    for (size_t i = 0; i < j->niov; i++) {
        j->starts[i] = off;
        off += j->iov[i].iov_len;
    }
    off = 0;
    for (size_t i = 0; i < j->niov2; i++) {
        j->starts2[i] = off;
        off += j->iov2[i].iov_len;
    }
    /* Plain: one get of everything. Quantized: the raw get's bytes for the
     * chunks, the window's get for the plain blocks after them. */
    rt_src src = { .iov = j->iov, .niov = j->niov, .starts = j->starts };
    rt_src wsrc = { .iov = j->iov2, .niov = j->niov2, .starts = j->starts2 };
    size_t nb = m->n_blocks, wbase = m->quant ? m->n_raw : 0;
    kvr__rt_manifest_chains(m, m->chains);
    /* Which blocks are there already (content-addressed: equal key, equal
     * bytes)? EXISTS is one pipelined round per node. */
    char (*keys)[KVR_RT_KEY_MAX] = kvr_mem_malloc((nb + 1) * KVR_RT_KEY_MAX);
    size_t *klen = kvr_mem_malloc((nb + 1) * sizeof *klen);
    kvr_rc_cmd *cmds = kvr_mem_malloc((nb + 1) * sizeof *cmds);
    const char **argv = kvr_mem_malloc((nb + 1) * 3 * sizeof *argv);
    size_t *argl = kvr_mem_malloc((nb + 1) * 3 * sizeof *argl);
    redisReply **rep = kvr_mem_calloc(nb + 1, sizeof *rep);
    bool *have = kvr_mem_calloc(nb + 1, sizeof *have);
    if (!keys || !klen || !cmds || !argv || !argl || !rep || !have) {
        j->rc = KVR_ENOMEM;
        snprintf(j->msg, sizeof j->msg, "remote tier: out of memory publishing");
        goto out;
    }
    for (size_t b = 0; b < nb; b++) {
        size_t bs, bn;
        bool ch;
        kvr__rt_manifest_block(m, b, &bs, &bn, &ch);
        klen[b] = ch ? kvr__rt_chunk_key(m->chains[b], keys[b])
                     : kvr__rt_block_key(m->chains[b], keys[b]);
        argv[3 * b] = "EXISTS";
        argl[3 * b] = 6;
        argv[3 * b + 1] = keys[b];
        argl[3 * b + 1] = klen[b];
        cmds[b] = (kvr_rc_cmd){ 2, argv + 3 * b, argl + 3 * b };
    }
    kvr__rc_batch(r->rc, nb, cmds, rep);
    for (size_t b = 0; b < nb; b++) {
        have[b] = rep[b] && rep[b]->type == REDIS_REPLY_INTEGER && rep[b]->integer == 1;
        if (rep[b])
            freeReplyObject(rep[b]);
        rep[b] = NULL;
    }
    size_t failed = 0;
    for (size_t b = 0; b < nb;) {
        /* A pipeline of at most SET_GROUP values and about SET_GROUP_BYTES:
         * hiredis holds a copy of what it sends (its output buffer). */
        size_t k = 0, bytes = 0;
        uint8_t *vals[SET_GROUP];
        size_t vlen[SET_GROUP];
        for (; b < nb && k < SET_GROUP && bytes < SET_GROUP_BYTES; b++) {
            if (have[b]) {
                atomic_fetch_add(&r->pub_skipped, 1);
                continue;
            }
            size_t s, n;
            bool ch;
            kvr__rt_manifest_block(m, b, &s, &n, &ch);
            /* A quantized context's window blocks count from the window's
             * start, in the window get's payload. */
            vals[k] = ch ? kvr__rt_chunk_encode(m, b, m->chains[b], &src, &vlen[k])
                    : m->quant
                        ? kvr__rt_encode_from(&m->desc, m->chains[b], s - wbase, m->tokens + s,
                                      m->positions + s, n, &wsrc, m->n_tokens - wbase, &vlen[k])
                        : kvr__rt_encode_from(&m->desc, m->chains[b], s, m->tokens + s,
                                      m->positions + s, n, &src, m->n_tokens, &vlen[k]);
            if (vals[k] && !seal(r, keys[b], klen[b], &vals[k], &vlen[k])) {
                kvr_mem_free(vals[k]);
                vals[k] = NULL;
            }
            if (!vals[k]) {
                failed++;
                continue;
            }
            argv[3 * k] = "SET";
            argl[3 * k] = 3;
            argv[3 * k + 1] = keys[b];
            argl[3 * k + 1] = klen[b];
            argv[3 * k + 2] = (const char *)vals[k];
            argl[3 * k + 2] = vlen[k];
            cmds[k] = (kvr_rc_cmd){ 3, argv + 3 * k, argl + 3 * k };
            bytes += vlen[k];
            k++;
        }
        size_t ok = kvr__rc_batch(r->rc, k, cmds, rep);
        for (size_t i = 0; i < k; i++) {
            if (rep[i])
                freeReplyObject(rep[i]);
            rep[i] = NULL;
            kvr_mem_free(vals[i]);
        }
        failed += k - ok;
        atomic_fetch_add(&r->pub_blocks, ok);
    }
    if (failed) {
        j->rc = KVR_EIO;
        snprintf(j->msg, sizeof j->msg, "remote tier: %zu of %zu blocks of '%.200s' not published",
                 failed, nb, m->ctx_id);
        goto out;
    }
    /* The sub-block prefix keys (tiny, content-addressed: written again
     * whatever is there), so a match finds a shared prefix to 16 tokens. */
    if (!m->quant && publish_subs(r, m) < 0) {
        j->rc = KVR_EIO;
        snprintf(j->msg, sizeof j->msg, "remote tier: the prefix keys of '%.200s' were not "
                 "all published", m->ctx_id);
        goto out;
    }
    /* The manifest last: whoever finds it finds its blocks (unless Redis
     * evicted them since, which is a miss). */
    size_t ml;
    char mk[KVR_RT_KEY_MAX];
    size_t mkl = kvr__rt_manifest_key(m->ctx_id, mk);
    uint8_t *mv = kvr__rt_manifest_encode(m, &ml);
    if (mv && !seal(r, mk, mkl, &mv, &ml)) {
        kvr_mem_free(mv);
        mv = NULL;
    }
    if (!mv) {
        j->rc = KVR_ENOMEM;
        snprintf(j->msg, sizeof j->msg, "remote tier: out of memory publishing");
        goto out;
    }
    const char *sv[] = { "SET", mk, (const char *)mv };
    size_t sl[] = { 3, mkl, ml };
    redisReply *x;
    kvr_error e = { 0 };
    int rc = kvr__rc_command(r->rc, 3, sv, sl, &x, &e);
    kvr_mem_free(mv);
    if (rc < 0) {
        j->rc = rc;
        snprintf(j->msg, sizeof j->msg, "remote tier: manifest of '%.200s': %.250s", m->ctx_id, e.msg);
        goto out;
    }
    freeReplyObject(x);
    atomic_fetch_add(&r->pub_contexts, 1);
    j->rc = 0;
out:
    if (j->rc < 0)
        atomic_fetch_add(&r->pub_errors, 1);
    kvr_mem_free(keys);
    kvr_mem_free(klen);
    kvr_mem_free(cmds);
    kvr_mem_free(argv);
    kvr_mem_free(argl);
    kvr_mem_free(rep);
    kvr_mem_free(have);
}

static void *publisher(void *arg)
{
    kvr_remote *r = arg;
    pthread_mutex_lock(&r->mu);
    for (;;) {
        while (!r->stop && kvr_list_empty(&r->queue)) {
            if (!atomic_load(&r->joined)) {
                /* Not joined yet: look for the cluster every REJOIN_MS. */
                struct timespec ts = kvr_clock_deadline(1000);
                pthread_cond_timedwait(&r->cv, &r->mu, &ts);
                if (!r->stop && kvr_list_empty(&r->queue)) {
                    pthread_mutex_unlock(&r->mu);
                    kvr__rc_set_deadline(kvr_clock_mono_ms() + FETCH_MS);
                    kvr__remote_up(r);
                    kvr__rc_set_deadline(0);
                    pthread_mutex_lock(&r->mu);
                }
            } else {
                pthread_cond_wait(&r->cv, &r->mu);
            }
        }
        if (r->stop)
            break;
        pub_job *j = kvr_list_entry(kvr_list_first(&r->queue), pub_job, link);
        kvr_list_remove(&j->link);
        r->q_len--;
        pthread_mutex_unlock(&r->mu);
        /* Everything it does ends by its deadline, so whatever waits behind
         * it is answered by its own. */
        if (kvr_clock_mono_ms() >= j->deadline_ms) {
            j->rc = KVR_EIO;
            snprintf(j->msg, sizeof j->msg, "remote tier: '%.200s' was not published within "
                     "%d ms of its share (the cluster is slow or hung)", j->m.ctx_id, PUBLISH_MS);
            atomic_fetch_add(&r->pub_errors, 1);
        } else {
            kvr__rc_set_deadline(j->deadline_ms);
            publish_one(r, j);
            kvr__rc_set_deadline(0);
        }
        pthread_mutex_lock(&r->mu);
        kvr_list_insert_tail(&r->finished, &j->link);
        pthread_mutex_unlock(&r->mu);
        uv_async_send(&r->async);
        pthread_mutex_lock(&r->mu);
    }
    pthread_mutex_unlock(&r->mu);
    return NULL;
}

static void job_finish(kvr_remote *r, pub_job *j)
{
    pthread_mutex_lock(&r->mu);
    r->pending_bytes -= j->bytes;
    pthread_mutex_unlock(&r->mu);
    if (j->rc < 0)
        kvr_log(KVR_LOG_WARN, "%s", j->msg);
    if (j->done)
        j->done(j->done_arg, j->rc, j->msg);
    kvr_get_end(j->get);     /* loop thread: the leases go */
    kvr_get_end(j->get2);
    kvr__rt_manifest_free(&j->m);
    kvr_mem_free(j->starts);
    kvr_mem_free(j->starts2);
    kvr_mem_free(j);
}

/* Moves every job of `from` (r's, under mu) to the end of `to`, in order. */
static void take_all(kvr_remote *r, kvr_list *from, kvr_list *to)
{
    pthread_mutex_lock(&r->mu);
    kvr_list_move_tail(to, from);
    pthread_mutex_unlock(&r->mu);
}

static void on_async(uv_async_t *a)
{
    kvr_remote *r = a->data;
    kvr_list list;
    kvr_list_init(&list);
    take_all(r, &r->finished, &list);
    /* Oldest first. */
    for (kvr_list *n; (n = kvr_list_first(&list));) {
        kvr_list_remove(n);
        job_finish(r, kvr_list_entry(n, pub_job, link));
    }
}

/* "USER PASSWORD" or "PASSWORD" on the first line. */
static int read_auth(const char *path, char *user, size_t ucap, char *pass, size_t pcap,
                     kvr_error *err)
{
    FILE *f = fopen(path, "r");
    if (!f)
        return kvr_error_set(err, KVR_EIO, "--remote-auth-file %s: %s", path, strerror(errno));
    char line[512] = "";
    bool got = fgets(line, sizeof line, f) != NULL;
    fclose(f);
    line[strcspn(line, "\r\n")] = '\0';
    char a[256] = "", b[256] = "";
    int n = got ? sscanf(line, "%255s %255s", a, b) : 0;
    if (n < 1)
        return kvr_error_set(err, KVR_EINVAL, "--remote-auth-file %s: empty (want 'USER "
                             "PASSWORD' or 'PASSWORD' on the first line)", path);
    if (n == 1) {
        user[0] = '\0';
        snprintf(pass, pcap, "%s", a);
    } else {
        snprintf(user, ucap, "%s", a);
        snprintf(pass, pcap, "%s", b);
    }
    memset(line, 0, sizeof line);
    memset(a, 0, sizeof a);
    memset(b, 0, sizeof b);
    return 0;
}

int kvr__remote_create(kvr_remote **out, kvr_daemon *d, kvr_error *err)
{
    *out = NULL;
    const kvr_daemon_config *cfg = &d->cfg;
    if (!cfg->remote_tier[0])
        return 0;
    char user[256] = "", pass[256] = "";
    int rc;
    if (cfg->remote_auth_file[0] &&
        (rc = read_auth(cfg->remote_auth_file, user, sizeof user, pass, sizeof pass, err)) < 0)
        return rc;
    kvr_remote *r = kvr_mem_calloc(1, sizeof *r);
    if (!r)
        return kvr_error_set(err, KVR_ENOMEM, "remote tier: out of memory");
    r->d = d;
    kvr_list_init(&r->queue);
    kvr_list_init(&r->finished);
    kvr_list_init(&r->landing);
    if (cfg->remote_key_file[0]) {
        if ((rc = kvr__rt_key_read(cfg->remote_key_file, r->key, err)) < 0) {
            kvr_mem_free(r);
            return rc;
        }
        r->keyed = true;
        kvr_log(KVR_LOG_INFO, "remote tier: every value carries a keyed BLAKE2b MAC "
                "(--remote-key-file %s)", cfg->remote_key_file);
    } else {
        kvr_log(KVR_LOG_WARN, "remote tier: no --remote-key-file: values are not "
                "authenticated, so the shared tier trusts everyone who can write to the "
                "cluster (docs/cluster.md)");
    }
    rc = kvr__rc_create(&r->rc, &(kvr_rc_config){ .seeds = cfg->remote_tier, .user = user,
                                                 .password = pass }, err);
    memset(pass, 0, sizeof pass);
    if (rc < 0) {
        sodium_memzero(r->key, sizeof r->key);
        kvr_mem_free(r);
        return rc;
    }
    kvr_error e = { 0 };
    kvr__rc_set_deadline(kvr_clock_mono_ms() + FETCH_MS);    /* start-up waits no longer */
    rc = kvr__rc_refresh(r->rc, &e);
    kvr__rc_set_deadline(0);
    if (rc == KVR_EUNAUTH) {
        kvr_error_set(err, KVR_EUNAUTH, "remote tier: %s (check --remote-auth-file)", e.msg);
        kvr__rc_destroy(r->rc);
        sodium_memzero(r->key, sizeof r->key);
        kvr_mem_free(r);
        return KVR_EUNAUTH;
    }
    if (rc == 0) {
        kvr_rc_stats st;
        kvr__rc_get_stats(r->rc, &st);
        atomic_store(&r->joined, true);
        kvr_log(KVR_LOG_INFO, "remote tier: cluster %s, %u slot ranges", cfg->remote_tier,
                st.n_masters);
    } else {
        atomic_store(&r->last_try_ms, kvr_clock_mono_ms());
        kvr_log(KVR_LOG_WARN, "remote tier: cluster %s unreachable (%s); serving from memory"
                "%s, joining when it answers", cfg->remote_tier, e.msg,
                cfg->disk_dir[0] ? " and disk" : "");
    }
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->cv, NULL);
    uv_async_init(&d->loop, &r->async, on_async);
    r->async.data = r;
    r->has_async = true;
    uv_unref((uv_handle_t *)&r->async);
    if (pthread_create(&r->th, NULL, publisher, r) != 0) {
        kvr__uv_close_once((uv_handle_t *)&r->async, &r->has_async);
        kvr__remote_destroy(r);
        return kvr_error_set(err, KVR_EINTERNAL, "remote tier: cannot start its thread");
    }
    r->th_started = true;
    *out = r;
    return 0;
}

void kvr__remote_close(kvr_remote *r)
{
    if (!r)
        return;
    if (r->th_started) {
        pthread_mutex_lock(&r->mu);
        r->stop = true;
        pthread_cond_broadcast(&r->cv);
        pthread_mutex_unlock(&r->mu);
        pthread_join(r->th, NULL);
        r->th_started = false;
    }
    /* What finished, then what never ran (a failure: shutting down). */
    if (r->has_async)
        on_async(&r->async);
    kvr_list left;
    kvr_list_init(&left);
    take_all(r, &r->queue, &left);
    for (kvr_list *n; (n = kvr_list_first(&left));) {
        kvr_list_remove(n);
        pub_job *j = kvr_list_entry(n, pub_job, link);
        j->rc = KVR_EIO;
        snprintf(j->msg, sizeof j->msg, "remote tier: shutting down before '%.200s' was published",
                 j->m.ctx_id);
        job_finish(r, j);
    }
    kvr__uv_close_once((uv_handle_t *)&r->async, &r->has_async);
}

void kvr__remote_destroy(kvr_remote *r)
{
    if (!r)
        return;
    kvr__rc_destroy(r->rc);
    pthread_mutex_destroy(&r->mu);
    pthread_cond_destroy(&r->cv);
    sodium_memzero(r->key, sizeof r->key);
    kvr_mem_free(r);
}

/* The codec of ctx as a plain dtype, or KVR_EUNSUPPORTED. */
static int plain_dtype(const char *codec, kvr_dtype *out)
{
    return kvr_dtype_parse(codec, out) == 0 ? 0 : KVR_EUNSUPPORTED;
}

/* The K tile of a canonical codec spec ("k=int4/g128/c,v=...": per channel
 * over 128 tokens; a per-token K: 1), docs/quantized.md. */
static uint32_t ktile_of(const char *canon)
{
    if (strncmp(canon, "k=", 2) != 0)
        return 1;
    size_t n = strcspn(canon, ",");
    char side[KVR_CODEC_NAME_MAX];
    snprintf(side, sizeof side, "%.*s", (int)n, canon);
    if (n < 2 || strcmp(side + strlen(side) - 2, "/c") != 0)
        return 1;
    const char *g = strstr(side, "/g");
    long v = g ? strtol(g + 2, NULL, 10) : 64;
    return v >= 1 && v <= 256 ? (uint32_t)v : 1;
}

int kvr__remote_publish(kvr_remote *r, const char *ctx_id, kvr_remote_done_fn done, void *arg,
                       kvr_error *err)
{
    kvr_store *s = r->d->store;
    kvr_ctx_info ci;
    int rc = kvr_store_stat(s, ctx_id, &ci, err);
    if (rc < 0)
        return rc;
    kvr_model_info mi;
    if (kvr_store_model_find(s, ci.model, &mi) < 0)
        return kvr_error_set(err, KVR_ENOMODEL, "share: model '%s' is gone", ci.model);
    kvr_dtype dt;
    bool quant = plain_dtype(ci.codec, &dt) < 0;
    if (quant)
        dt = mi.dtype;               /* the window's */
    if (ci.n_tokens == 0)
        return kvr_error_set(err, KVR_EINVAL, "share: '%s' is empty", ctx_id);
    /* A bounded queue: a share that would wait behind too many (or hold
     * too much memory leased while it waits) is dropped, counted. */
    uint64_t cap = r->d->cfg.max_memory;
    pthread_mutex_lock(&r->mu);
    size_t ql = r->q_len, qb = r->pending_bytes;
    pthread_mutex_unlock(&r->mu);
    if (ql >= PUB_QUEUE_MAX || (cap && qb + ci.kv_bytes > cap / 4)) {
        atomic_fetch_add(&r->pub_dropped, 1);
        return kvr_error_set(err, KVR_EBUSY, "share: the publish queue is full (%zu "
                             "publications, %zu bytes waiting: the cluster is slow or hung); "
                             "'%s' is not published", ql, qb, ctx_id);
    }
    if (ci.n_pending)
        return kvr_error_set(err, KVR_EPENDING, "share: '%s' has %zu tokens without KV "
                             "(refresh them first)", ctx_id, ci.n_pending);
    /* A reader lands what it fetches as exact KV: approximate tokens (an
     * edit's suffix, a parallel encoding) are not published. */
    if (ci.n_approx)
        return kvr_error_set(err, KVR_EUNSUPPORTED, "share: '%s' has %zu approximate tokens "
                             "(refresh them first)", ctx_id, ci.n_approx);
    /* The snapshot is a get of the whole context: its blocks are leased
     * (whatever happens to the context meanwhile) until the publication is
     * done and job_finish ends it on the loop. Nothing is copied here. A
     * quantized context: a raw get of its encoded tokens (which must be one
     * tile-aligned run before its window, as puts leave it) and a get of
     * its window in the model's dtype. */
    size_t n = ci.n_tokens, nq = quant ? n - ci.n_window : 0;
    uint32_t G = quant ? ktile_of(ci.codec) : 1;
    if (quant && nq % G)
        return kvr_error_set(err, KVR_EUNSUPPORTED, "share: '%s' (%s) has %zu quantized "
                             "tokens, not whole %u-token key tiles", ctx_id, ci.codec, nq, G);
    kvr_get *g = NULL, *g2 = NULL;
    if (!quant || nq) {
        kvr_get_params gp = { .ctx_id = ctx_id, .start = 0, .end = quant ? nq : SIZE_MAX,
                              .dtype = dt, .raw = quant };
        kvr_error ge = { 0 };
        if ((rc = kvr_store_get_begin(s, &gp, &g, &ge)) < 0) {
            if (!quant) {
                if (err)
                    *err = ge;
                return rc;
            }
            return kvr_error_set(err, KVR_EUNSUPPORTED, "share: '%s' (%s): its encoded tokens "
                                 "are not one run before its window (edited?): %.300s", ctx_id,
                                 ci.codec, ge.msg);
        }
    }
    if (quant && nq < n) {
        kvr_get_params gp = { .ctx_id = ctx_id, .start = nq, .end = n, .dtype = dt };
        if ((rc = kvr_store_get_begin(s, &gp, &g2, err)) < 0) {
            kvr_get_end(g);
            return rc;
        }
    }
    /* Their staging (if any), here on the loop: the work runs on a worker. */
    if ((g && (rc = kvr_get_stage(g, err)) < 0) || (g2 && (rc = kvr_get_stage(g2, err)) < 0)) {
        kvr_get_end(g);
        kvr_get_end(g2);
        return rc;
    }
    const kvr_get_info *gi = g ? kvr_get_get_info(g) : NULL;
    const kvr_get_info *gw = g2 ? kvr_get_get_info(g2) : NULL;
    if ((gi ? gi->n_tokens : 0) + (gw ? gw->n_tokens : 0) != n || (quant && gi && !gi->raw)) {
        kvr_get_end(g);
        kvr_get_end(g2);
        return kvr_error_set(err, KVR_EINTERNAL, "share: '%s' changed while it was read", ctx_id);
    }
    pub_job *j = kvr_mem_calloc(1, sizeof *j);
    if (j) {
        j->m.quant = quant;
        if (quant) {
            snprintf(j->m.codec, sizeof j->m.codec, "%s", ci.codec);
            j->m.n_raw = nq;
            j->m.raw_kb = gi ? gi->k_bytes : 0;
            j->m.raw_vb = gi ? gi->v_bytes : 0;
            j->m.ktile = G;
            j->m.chunk = G >= 256 ? G : 256 / G * G;
        }
        j->m.n_tokens = n;
    }
    size_t nb = j ? kvr__rt_manifest_blocks(&j->m) : 0;
    if (j) {
        j->m.chains = kvr_mem_malloc(nb * 8 + 1);
        j->m.tokens = kvr_mem_malloc(n * 4 + 1);
        j->m.positions = kvr_mem_malloc(n * 8 + 1);
        j->m.flags = kvr_mem_calloc(n + 1, 4);
        j->m.groups = kvr_mem_calloc(n + 1, 4);
    }
    if (!j || !j->m.chains || !j->m.tokens || !j->m.positions || !j->m.flags || !j->m.groups) {
        if (j) {
            kvr__rt_manifest_free(&j->m);
            kvr_mem_free(j);
        }
        kvr_get_end(g);
        kvr_get_end(g2);
        return kvr_error_set(err, KVR_ENOMEM, "share: out of memory for the snapshot");
    }
    j->get = g;
    j->get2 = g2;
    j->m.desc = (kvr_rt_desc){ mi.fingerprint, mi.n_layers, mi.n_kv_heads, mi.head_dim, dt };
    snprintf(j->m.ctx_id, sizeof j->m.ctx_id, "%s", ctx_id);
    snprintf(j->m.model, sizeof j->m.model, "%s", mi.name);
    j->m.n_blocks = nb;
    const kvr_get_info *parts[2] = { gi, gw };
    for (size_t k = 0, at = 0; k < 2; k++) {
        const kvr_get_info *x = parts[k];
        if (!x)
            continue;
        memcpy(j->m.tokens + at, x->tokens, x->n_tokens * 4);
        memcpy(j->m.positions + at, x->positions, x->n_tokens * 8);
        if (x->flags)
            memcpy(j->m.flags + at, x->flags, x->n_tokens * 4);
        if (x->groups)
            memcpy(j->m.groups + at, x->groups, x->n_tokens * 4);
        at += x->n_tokens;
    }
    /* The layout a reader needs for its get to answer what ours does (the
     * group of every token, the groups' offsets and cursors, the APE
     * record, retention, protection). */
    if (kvr_store_layout_stat(s, ctx_id, &j->m.layout, NULL) < 0)
        memset(&j->m.layout, 0, sizeof j->m.layout);
    j->m.n_protected = ci.n_protected;
    j->done = done;
    j->done_arg = arg;
    j->deadline_ms = kvr_clock_mono_ms() + PUBLISH_MS + ci.kv_bytes / SLOW_BYTES_PER_MS;
    j->bytes = ci.kv_bytes;
    pthread_mutex_lock(&r->mu);
    r->pending_bytes += j->bytes;
    kvr_list_insert_tail(&r->queue, &j->link);
    r->q_len++;
    pthread_cond_signal(&r->cv);
    pthread_mutex_unlock(&r->mu);
    return 0;
}



void kvr__remote_get_stats(kvr_remote *r, kvr_remote_stats *o)
{
    memset(o, 0, sizeof *o);
    kvr_rc_stats st;
    kvr__rc_get_stats(r->rc, &st);
    o->joined = atomic_load(&r->joined);
    o->pub_contexts = atomic_load(&r->pub_contexts);
    o->pub_blocks = atomic_load(&r->pub_blocks);
    o->pub_skipped = atomic_load(&r->pub_skipped);
    o->pub_errors = atomic_load(&r->pub_errors);
    o->pub_dropped = atomic_load(&r->pub_dropped);
    o->fetch_hits = atomic_load(&r->fetch_hits);
    o->fetch_misses = atomic_load(&r->fetch_misses);
    o->fetch_corrupt = atomic_load(&r->fetch_corrupt);
    o->fetch_forged = atomic_load(&r->fetch_forged);
    o->fetch_tokens = atomic_load(&r->fetch_tokens);
    o->probes = atomic_load(&r->probes);
    o->moved = st.moved;
    o->ask = st.ask;
    o->refreshes = st.refreshes;
    o->conn_errors = st.conn_errors;
    o->fetch_seconds = (double)atomic_load(&r->fetch_ns) / 1e9;
    for (size_t i = 0; i <= KVR_METRICS_N_BUCKETS; i++)
        o->fetch_hist[i] = atomic_load(&r->fetch_hist[i]);
}

