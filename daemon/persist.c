/*
 * persist.c — the daemon's side of the disk tier (cache/tier*.c): opening
 * and recovering --disk-dir before the listeners start, and deferring the
 * replies of changes to persistent contexts until their records are on
 * disk (the disk figures of stats and /metrics are metrics.c's FIG_DISK).
 *
 * A change to a persistent context is committed in memory as usual; then
 * dispatch.c holds the packed reply and kvr__persist_defer queues the
 * context's record (kvr_store_persist); which verbs change which context
 * is in dispatch.c's verb table. One batch of records at a time runs on the
 * libuv threadpool (kvr_persist_batch_work: spill + append + fsync); its
 * after-callback (loop thread) ends the batch, which calls
 * kvr__request_persisted for each record: the held reply goes out if the
 * append returned 0, else an E_IO error. The connection stays BUSY (not
 * reading) meanwhile, so its requests are still answered in order, and the
 * request holds a reference so its memory outlives a close.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/daemon_internal.h"

typedef struct batch_job {
    uv_work_t          w;
    kvr_daemon        *d;
    kvr_persist_batch *b;
} batch_job;

static void kick(kvr_daemon *d);

static void tier_log(void *arg, int level, const char *msg)
{
    (void)arg;
    kvr_log(level == KVR_TIER_LOG_WARN ? KVR_LOG_WARN : KVR_LOG_INFO, "%s", msg);
}

int kvr__persist_open(kvr_daemon *d, char *err, size_t errlen)
{
    const kvr_daemon_config *cfg = &d->cfg;
    if (!cfg->disk_dir[0])
        return 0;
    kvr_tier_config tc = {
        .dir = cfg->disk_dir,
        .max_bytes = cfg->disk_max,
        .engine = cfg->disk_engine,
        .persist_all = cfg->persist_all,
    };
    /* Tests only: a small log so checkpoints happen. */
    const char *cp = getenv("KVR_DISK_CHECKPOINT_BYTES");
    if (cp)
        tc.checkpoint_bytes = strtoull(cp, NULL, 10);
    kvr_tier_recovery rec;
    kvr_error e = { 0 };
    int rc = kvr_store_tier_open(d->store, &tc, tier_log, d, &rec, &e);
    if (rc < 0) {
        snprintf(err, errlen, "disk tier %s: %s", cfg->disk_dir,
                 e.msg[0] ? e.msg : kvr_strerror(rc));
        return rc;
    }
    const char *note = kvr_store_tier_engine_note(d->store);
    kvr_log(KVR_LOG_INFO, "disk tier %s: engine %s%s%s%s, max %llu bytes%s", cfg->disk_dir,
            kvr_store_tier_engine(d->store), note[0] ? " (" : "", note, note[0] ? ")" : "",
            (unsigned long long)cfg->disk_max, cfg->persist_all ? ", every context persistent" : "");
    kvr_log(rec.quarantined || rec.dropped_contexts ? KVR_LOG_WARN : KVR_LOG_INFO,
            "recovered %zu models, %zu contexts, %zu tokens, %llu bytes in %.1f ms "
            "(%llu records; %llu quarantined, %llu torn bytes, %zu contexts dropped, "
            "%zu stale, %zu lost)",
            rec.models, rec.contexts, rec.tokens, (unsigned long long)rec.bytes, rec.ms,
            (unsigned long long)rec.records, (unsigned long long)rec.quarantined,
            (unsigned long long)rec.torn_bytes, rec.dropped_contexts, rec.stale_contexts,
            rec.lost_contexts);
    return 0;
}

int kvr__persist_defer(kvr_daemon *d, const char *ctx_id, kvr_request *r, kvr_error *e)
{
    int rc = kvr_store_persist(d->store, ctx_id, kvr__request_persisted, r, e);
    if (rc > 0)
        kick(d);
    return rc;
}

static void batch_work(uv_work_t *w)
{
    batch_job *j = w->data;
    kvr_persist_batch_work(j->b);
}

static void batch_after(uv_work_t *w, int status)
{
    (void)status;     /* a cancelled batch cannot happen: we never cancel */
    batch_job *j = w->data;
    kvr_daemon *d = j->d;
    kvr_persist_batch_end(j->b);
    kvr_mem_free(j);
    kick(d);
}

static void kick(kvr_daemon *d)
{
    kvr_persist_batch *b = kvr_store_persist_take(d->store);
    if (!b)
        return;
    batch_job *j = kvr_mem_calloc(1, sizeof *j);
    if (j) {
        j->d = d;
        j->b = b;
        j->w.data = j;
        if (uv_queue_work(&d->loop, &j->w, batch_work, batch_after) == 0)
            return;
        kvr_mem_free(j);
    }
    /* No threadpool: write it here (the loop stalls for it). */
    kvr_persist_batch_work(b);
    kvr_persist_batch_end(b);
    kick(d);
}
