/*
 * metrics.c — kvroped's figures for Prometheus: per-request observations
 * (kvr__metrics_observe, one call per completed request), a snapshot the
 * loop publishes, and GET /metrics in the text exposition format (0.0.4)
 * served by libmicrohttpd on its own thread.
 *
 * Invariants:
 *  - The loop thread owns `obs` (the observations) and is the only thread
 *    that reads the store, the disk tier or the daemon's counters. It
 *    copies all of them into `snap` under `lock` (publish), so a scrape
 *    shows one instant: requests_total agrees with the histogram counts.
 *  - The HTTP thread reads only `snap`, `token` and `addr`, under `lock`.
 *    A scrape asks for a fresh snapshot (uv_async_send) and waits at most
 *    SNAP_WAIT_MS for it; after that, or while stopping, it serves the last
 *    one published, never blocking on the loop for long.
 *  - The async handle outlives the HTTP thread: kvr__metrics_stop joins the
 *    thread (MHD_stop_daemon) before closing the handle, so no
 *    uv_async_send can reach a closed handle.
 *  - A scrape's text is plain malloc, outside the store's accounting, so
 *    monitoring still answers when the store is at its memory cap (at most
 *    MAX_SCRAPE_CONNS of them, ~50 KB each).
 *  - No peer holds the scrape slots (16 connections dribbling a
 *    header line every 3 s held all of them, before the token is checked):
 *    at most PER_PEER_SCRAPE_CONNS connections per peer address, and every
 *    request must be in and answered within REQUEST_DEADLINE_MS of its
 *    connection's start (or of the previous request's end, keep-alive),
 *    else the loop's watchdog shuts the socket down and libmicrohttpd
 *    closes the connection. Its idle timeout (IDLE_TIMEOUT_S) alone is
 *    reset by every byte. The watchdog knows a connection's fd only while
 *    libmicrohttpd holds it open: it is listed at NOTIFY_STARTED and
 *    unlisted at NOTIFY_CLOSED, which comes before the close, both under
 *    conn_lock, and shutdown() runs under conn_lock.
 *  - Non-loopback addresses need a token (kvr_daemon_config_check); with a
 *    token every scrape must send "Authorization: Bearer TOKEN" (compared in
 *    constant time in the token's content), loopback or not, as on TCP.
 *
 * Names follow Prometheus conventions: kvrope_ prefix, base units
 * (_seconds, _bytes), _total for counters, HELP and TYPE for every family.
 */
#include "base/clock.h"
#include "daemon/daemon_internal.h"
#include "daemon/metrics.h"
#include "daemon/remote.h"

#include <assert.h>
#include <errno.h>
#include <microhttpd.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <netinet/in.h>
#include <arpa/inet.h>

#define N_VERB_SLOTS (KVR_N_VERBS + 1)   /* + "none": no or unknown body */
#define N_STATUS 24                      /* Status 0..23 (proto/kvrope.proto) */
#define SNAP_WAIT_MS 1000
#define MAX_SCRAPE_CONNS 16
#define PER_PEER_SCRAPE_CONNS 4
#define IDLE_TIMEOUT_S 10
#define REQUEST_DEADLINE_MS 10000u
#define WATCHDOG_MS 500u

/* A scrape connection libmicrohttpd holds open (conn_lock). */
typedef struct scrape_conn {
    bool     used;
    int      fd;
    uint64_t deadline_ms;   /* kvr_clock_mono_ms; 0: shut down already */
} scrape_conn;

/* Latency buckets (seconds): 50 us .. 10 s. */
static const double BUCKETS[] = {
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01,
    0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10,
};
static const char *const BUCKET_LE[] = {
    "5e-05", "0.0001", "0.00025", "0.0005", "0.001", "0.0025", "0.005", "0.01",
    "0.025", "0.05", "0.1", "0.25", "0.5", "1", "2.5", "5", "10",
};
#define N_BUCKETS (sizeof BUCKETS / sizeof BUCKETS[0])
_Static_assert(N_BUCKETS == KVR_METRICS_N_BUCKETS, "metrics.h's bucket count");

typedef struct obs {
    uint64_t req[N_VERB_SLOTS][N_STATUS];
    uint64_t pay_in[N_VERB_SLOTS], pay_out[N_VERB_SLOTS];
    uint64_t hist[N_VERB_SLOTS][N_BUCKETS + 1];   /* per bucket, last = above 10 s */
    uint64_t hcount[N_VERB_SLOTS];
    double   hsum[N_VERB_SLOTS];
} obs;

/* Per model, as a tenant of the cap (--max-memory-per-model): one row of
 * figures per model, in the stats verb as model_<name>_<stat> and in
 * /metrics as <prom>{model="<name>"}. A snapshot holds the first
 * SNAP_MODELS models (the store counts at most 63 apart as tenants). */
#define SNAP_MODELS 64
#define FIG_MODEL(X)                                                                             \
    X("bytes", "kvrope_model_bytes", "gauge",                                                    \
      "KV bytes of a model's blocks: its share of the cap as a tenant (--max-memory-per-model "  \
      "bounds it; 0 past the 63rd model).", mf->bytes)                                            \
    X("evicted_blocks", "kvrope_model_evicted_blocks_total", "counter",                          \
      "Blocks evicted (dropped or spilled) from a model's contexts.", mf->n_evicted_blocks)        \
    X("evicted_bytes", "kvrope_model_evicted_bytes_total", "counter",                            \
      "KV bytes evicted (dropped or spilled) from a model's contexts.", mf->n_evicted_bytes)      \
    X("matches", "kvrope_model_prefix_matches_total", "counter",                                 \
      "Prefix matches asked for a model.", mf->n_matches)                                         \
    X("match_hits", "kvrope_model_prefix_match_hits_total", "counter",                           \
      "Prefix matches of a model that found at least one cached token.", mf->n_match_hits)        \
    X("refused_bound", "kvrope_model_refused_writes_total", "counter",                           \
      "Writes refused because a model reached its bound (--max-memory-per-model).",             \
      mf->n_refused_bound)

#define MODEL_FIG_N(st, pn, ty, help, expr) +1
enum { N_MODEL_FIG = 0 FIG_MODEL(MODEL_FIG_N) };
#undef MODEL_FIG_N

typedef struct model_row {
    char     name[KVR_ID_MAX + 1];
    uint64_t v[N_MODEL_FIG];
} model_row;

typedef struct snapshot {
    obs             o;
    kvr_store_stats s;
    kvr_tier_stats  t;
    char            engine[32];   /* t.engine, copied */
    bool            has_remote;   /* --remote-tier: r holds its counters */
    kvr_remote_stats r;
    uint64_t conns, unauth, conn_total, conn_refused;
    uint64_t regions, region_cap;
    uint64_t requests, errors, wire_in, wire_out, streamed, stream_aborted;
    uint64_t per_verb[KVR_N_VERBS];          /* requests dispatched, by verb */
    uint64_t msg_buffered, msg_buffer_limit, msg_limited, slow_closed;
    double   start_unix, uptime, published_unix;
    uint64_t warm_bytes;
    double   warm_seconds;
    size_t    n_models;
    model_row models[SNAP_MODELS];
    uint64_t gen;
} snapshot;

/* ---- the one list of figures ---------------------------------------------- */
/* Every scalar figure of the daemon, once: X(stats name, /metrics name,
 * Prometheus type, HELP, its value in snapshot s). The stats verb lists
 * the rows that have a stats name and /metrics renders the rows that have
 * a /metrics name, both from one snapshot taken on the loop thread
 * (build): they cannot drift apart or show two instants. "" leaves a
 * figure out of one of them (/metrics gives it as a labelled family
 * below, or it is a ratio or a detail only the stats verb lists). */
#define FIG_CORE(X)                                                                       \
    X("uptime_seconds", "kvrope_uptime_seconds", "gauge",                                 \
      "Seconds since kvroped started.", s->uptime)                                        \
    X("mem_allocated_bytes", "kvrope_memory_allocated_bytes", "gauge",                    \
      "Bytes the accounted allocator holds now.", s->s.mem_allocated)                     \
    X("mem_peak_bytes", "kvrope_memory_peak_bytes", "gauge",                              \
      "Highest value of kvrope_memory_allocated_bytes since start.", s->s.mem_peak)       \
    X("mem_cap_bytes", "kvrope_memory_cap_bytes", "gauge", "The memory cap (--max-memory).", \
      s->s.mem_cap)                                                                       \
    X("prefault_bytes", "kvrope_memory_prefaulted_bytes", "gauge",                        \
      "Memory --prefault faulted in at start and left mapped for the store (0 until "     \
      "it is done, and without --prefault or jemalloc).", s->warm_bytes)                  \
    X("prefault_seconds", "kvrope_memory_prefault_seconds", "gauge",                      \
      "How long --prefault took (its first-touch cost).", s->warm_seconds)                \
    X("block_bytes", "kvrope_memory_block_bytes", "gauge",                                \
      "Bytes held in KV blocks in memory.", s->s.block_bytes)                             \
    X("kv_held_bytes", "", "", "", s->s.kv_held_bytes)                                    \
    X("block_cache_bytes", "kvrope_memory_block_cache_bytes", "gauge",                    \
      "Bytes of freed KV blocks kept for reuse by the next puts (in allocated, "          \
      "not in block bytes; dropped first at the cap and when idle).",                     \
      s->s.block_cache_bytes)                                                             \
    X("models", "kvrope_models", "gauge", "Registered models.", s->s.n_models)            \
    X("contexts", "kvrope_contexts", "gauge", "Contexts stored.", s->s.n_contexts)        \
    X("blocks", "kvrope_blocks", "gauge", "KV blocks resident in memory.", s->s.n_blocks) \
    X("tokens", "kvrope_tokens", "gauge", "Tokens stored over all contexts.",            \
      s->s.n_tokens)                                                                      \
    X("leased_blocks", "kvrope_leased_blocks", "gauge",                                   \
      "Blocks held by reads in flight (gets, assembles).", s->s.n_leased_blocks)          \
    X("evicted_blocks", "kvrope_evicted_blocks_total", "counter",                         \
      "Blocks evicted from memory (spilled to disk or dropped).", s->s.n_evicted_blocks)  \
    X("evicted_bytes", "kvrope_evicted_bytes_total", "counter",                           \
      "Bytes of the evicted blocks.", s->s.n_evicted_bytes)                               \
    X("refused_nomem", "kvrope_refused_no_memory_total", "counter",                       \
      "Requests refused with E_NO_MEMORY by the store.", s->s.n_refused_nomem)            \
    X("store_puts", "kvrope_store_puts_total", "counter", "Puts committed by the store.", \
      s->s.n_puts)                                                                        \
    X("store_gets", "kvrope_store_gets_total", "counter", "Gets served by the store.",    \
      s->s.n_gets)                                                                        \
    X("store_matches", "", "", "", s->s.n_matches)                                        \
    X("store_match_hits", "", "", "", s->s.n_match_hits)                                  \
    X("quant_contexts", "kvrope_quantized_contexts", "gauge",                             \
      "Contexts stored with a quantized codec.", s->s.n_quant_contexts)                   \
    X("quant_bytes_saved", "kvrope_quantization_saved_bytes", "gauge",                    \
      "Bytes quantization saves over the contexts' native dtype.", s->s.quant_bytes_saved) \
    X("quant_bits_per_value", "", "", "", s->s.quant_bits_per_value)                      \
    X("", "kvrope_quantization_value_size_bytes", "gauge",                                \
      "Mean stored size of one K/V value over quantized contexts (0.5: 4 bits; 0: none).", \
      s->s.quant_bits_per_value / 8.0)                                                    \
    X("cover_index_bytes", "kvrope_cover_index_bytes", "gauge",                           \
      "Bytes the covers' content index holds (token copies, grain table).",              \
      s->s.cover_index_bytes)                                                             \
    X("cover_index_lagging_contexts", "kvrope_cover_index_lagging_contexts", "gauge",     \
      "Contexts the content index has yet to catch up with (the next cover does).",      \
      s->s.cover_index_lagging)                                                           \
    X("connections", "kvrope_connections", "gauge", "Client connections open now.",      \
      s->conns)                                                                           \
    X("", "kvrope_connections_unauthenticated", "gauge",                                  \
      "Open TCP connections that have not authenticated yet.", s->unauth)                 \
    X("connections_total", "kvrope_connections_accepted_total", "counter",                \
      "Client connections accepted.", s->conn_total)                                      \
    X("connections_refused", "kvrope_connections_refused_total", "counter",               \
      "Connections refused by --max-connections or --max-unauth-connections.",            \
      s->conn_refused)                                                                    \
    X("", "kvrope_shm_regions", "gauge",                                                  \
      "Shared-memory regions registered, all connections together.", s->regions)          \
    X("", "kvrope_shm_regions_limit", "gauge",                                            \
      "The cap on them (--max-regions-total, or from vm.max_map_count).", s->region_cap)  \
    X("requests_total", "kvrope_frames_total", "counter",                                 \
      "Request frames decoded (including those refused before a reply).", s->requests)    \
    X("errors_total", "kvrope_error_replies_total", "counter",                            \
      "Replies with a status other than OK, including protocol errors.", s->errors)       \
    X("bytes_in", "kvrope_network_received_bytes_total", "counter",                       \
      "Bytes read from client connections (frames and payloads).", s->wire_in)            \
    X("bytes_out", "kvrope_network_sent_bytes_total", "counter",                          \
      "Bytes written to client connections.", s->wire_out)                                \
    X("streamed_replies", "kvrope_streamed_replies_total", "counter",                     \
      "Replies whose payload was streamed layer chunk by chunk.", s->streamed)            \
    X("streams_aborted", "kvrope_streamed_replies_aborted_total", "counter",              \
      "Streamed replies cut short (client gone or work failed).", s->stream_aborted)      \
    X("msg_buffered_bytes", "", "", "", s->msg_buffered)                                  \
    X("msg_buffer_limit_bytes", "", "", "", s->msg_buffer_limit)                          \
    X("msg_buffer_refused", "", "", "", s->msg_limited)                                   \
    X("slow_frames_closed", "", "", "", s->slow_closed)                                   \
    X("disk_enabled", "kvrope_disk_enabled", "gauge", "1 if the disk tier (--disk-dir) is on.", \
      s->t.enabled ? 1 : 0)

/* The disk tier's: the stats verb lists them always, /metrics with a disk
 * tier. */
#define FIG_DISK(X)                                                                       \
    X("disk_engine_io_uring", "", "", "", !strcmp(s->engine, "io_uring"))                 \
    X("disk_engine_posix", "", "", "", !strcmp(s->engine, "posix"))                       \
    X("tier_mem_blocks", "", "", "", s->t.mem_blocks)                                     \
    X("tier_mem_bytes", "", "", "", s->t.mem_bytes)                                       \
    X("tier_spilled_blocks", "kvrope_disk_spilled_blocks", "gauge",                       \
      "Blocks whose data is on disk only.", s->t.spilled_blocks)                          \
    X("tier_disk_blocks", "", "", "", s->t.disk_blocks)                                   \
    X("tier_disk_bytes", "", "", "", s->t.disk_bytes)                                     \
    X("tier_disk_log_bytes", "kvrope_disk_log_bytes", "gauge",                            \
      "Bytes of the disk tier's log.", s->t.disk_log_bytes)                               \
    X("tier_disk_max_bytes", "kvrope_disk_max_bytes", "gauge",                            \
      "The disk tier's bound (0: none).", s->t.disk_max_bytes)                            \
    X("tier_reads_mem", "", "", "", s->t.reads_mem)                                       \
    X("tier_reads_disk", "", "", "", s->t.reads_disk)                                     \
    X("tier_hit_rate_mem", "", "", "", hit_rate(s->t.reads_mem, s->t.reads_disk))         \
    X("tier_hit_rate_disk", "", "", "", hit_rate(s->t.reads_disk, s->t.reads_mem))        \
    X("tier_spills", "kvrope_disk_spills_total", "counter",                               \
      "Blocks written to disk by eviction.", s->t.n_spills)                               \
    X("tier_spill_bytes", "kvrope_disk_spilled_bytes_total", "counter",                   \
      "Bytes written by spills.", s->t.spill_bytes)                                       \
    X("tier_reloads", "kvrope_disk_reloads_total", "counter",                             \
      "Blocks read back from disk.", s->t.n_reloads)                                      \
    X("tier_reload_bytes", "kvrope_disk_reloaded_bytes_total", "counter",                 \
      "Bytes read back from disk.", s->t.reload_bytes)                                    \
    X("tier_spill_refused", "kvrope_disk_spills_refused_total", "counter",                \
      "Evictions that dropped blocks because the disk tier was full.",                    \
      s->t.n_spill_refused)                                                               \
    X("persist_contexts", "kvrope_persistent_contexts", "gauge", "Persistent contexts.",  \
      s->t.persistent_contexts)                                                           \
    X("persist_records", "kvrope_persist_records_total", "counter",                       \
      "Records appended to the log (acknowledged changes).", s->t.n_persist_records)      \
    X("persist_errors", "kvrope_persist_errors_total", "counter",                         \
      "Persistence failures (the change was not acknowledged as durable).",               \
      s->t.n_persist_errors)                                                              \
    X("persist_checkpoints", "kvrope_disk_checkpoints_total", "counter",                  \
      "Log checkpoints written.", s->t.n_checkpoints)                                     \
    X("disk_quarantined", "kvrope_disk_quarantined", "gauge",                             \
      "Corrupt records and extents found and quarantined.", s->t.quarantined)             \
    X("disk_failed", "kvrope_disk_failed", "gauge",                                       \
      "1 after an fsync failure: persistence is off until a restart.", s->t.failed ? 1 : 0) \
    X("recovery_unix_ms", "", "", "", s->t.recovery.at_ms)                                \
    X("", "kvrope_last_recovery_timestamp_seconds", "gauge",                              \
      "When the last recovery of the disk tier ran (Unix time).",                         \
      (double)s->t.recovery.at_ms / 1000.0)                                               \
    X("recovery_ms", "", "", "", s->t.recovery.ms)                                        \
    X("", "kvrope_last_recovery_duration_seconds", "gauge",                               \
      "How long the last recovery took.", s->t.recovery.ms / 1000.0)                      \
    X("recovery_models", "", "", "", s->t.recovery.models)                                \
    X("recovery_contexts", "kvrope_last_recovery_contexts", "gauge",                      \
      "Contexts the last recovery restored.", s->t.recovery.contexts)                     \
    X("recovery_tokens", "kvrope_last_recovery_tokens", "gauge",                          \
      "Tokens the last recovery restored.", s->t.recovery.tokens)                         \
    X("recovery_bytes", "kvrope_last_recovery_bytes", "gauge",                            \
      "KV bytes the last recovery restored.", s->t.recovery.bytes)                        \
    X("recovery_records", "kvrope_last_recovery_records", "gauge",                        \
      "Log records the last recovery read.", s->t.recovery.records)                       \
    X("recovery_quarantined", "kvrope_last_recovery_quarantined", "gauge",                \
      "Corrupt records the last recovery quarantined.", s->t.recovery.quarantined)        \
    X("recovery_dropped_contexts", "kvrope_last_recovery_dropped_contexts", "gauge",      \
      "Contexts the last recovery could not restore.", s->t.recovery.dropped_contexts)    \
    X("recovery_stale_contexts", "", "", "", s->t.recovery.stale_contexts)                \
    X("recovery_lost_contexts", "", "", "", s->t.recovery.lost_contexts)

/* The shared tier's (--remote-tier; docs/cluster.md): both lists, with one. */
#define FIG_REMOTE(X)                                                                     \
    X("remote_joined", "kvrope_remote_joined", "gauge",                                   \
      "1 once the daemon has joined the Redis Cluster of its remote tier.",               \
      s->r.joined ? 1 : 0)                                                                \
    X("remote_published_contexts", "kvrope_remote_published_contexts_total", "counter",   \
      "Contexts published to the cluster (share, share_sync).", s->r.pub_contexts)        \
    X("remote_published_blocks", "kvrope_remote_published_blocks_total", "counter",       \
      "Blocks written to the cluster by publications.", s->r.pub_blocks)                  \
    X("remote_blocks_already_there", "kvrope_remote_blocks_already_there_total", "counter", \
      "Blocks a publication found in the cluster already and did not send.",              \
      s->r.pub_skipped)                                                                   \
    X("remote_publish_errors", "kvrope_remote_publish_errors_total", "counter",           \
      "Publications that failed.", s->r.pub_errors)                                       \
    X("remote_publish_dropped", "kvrope_remote_publish_dropped_total", "counter",         \
      "Shares dropped because the publish queue was full (the cluster slow or hung).",    \
      s->r.pub_dropped)                                                                   \
    X("remote_fetch_hits", "", "", "", s->r.fetch_hits)                                   \
    X("remote_fetch_misses", "", "", "", s->r.fetch_misses)                               \
    X("remote_fetch_corrupt", "", "", "", s->r.fetch_corrupt)                             \
    X("remote_fetch_forged", "kvrope_remote_forged_values_total", "counter",              \
      "Values read from the cluster whose MAC was not this cluster key's "                \
      "(--remote-key-file): never served, each fetch a miss.", s->r.fetch_forged)         \
    X("remote_fetched_tokens", "kvrope_remote_fetched_tokens_total", "counter",           \
      "Tokens landed locally from the cluster.", s->r.fetch_tokens)                       \
    X("remote_probes", "kvrope_remote_prefix_probes_total", "counter",                    \
      "Prefix probes (pipelined EXISTS of a prompt's block chain).", s->r.probes)         \
    X("remote_moved", "", "", "", s->r.moved)                                             \
    X("remote_ask", "", "", "", s->r.ask)                                                 \
    X("remote_map_refreshes", "kvrope_remote_slot_map_refreshes_total", "counter",        \
      "Reloads of the cluster's slot map.", s->r.refreshes)                               \
    X("remote_conn_errors", "kvrope_remote_connection_errors_total", "counter",           \
      "Connections to cluster nodes that failed or broke.", s->r.conn_errors)

#define FIG_COUNT_(st, pn, ty, help, expr) +1
enum { N_FIGURES = 0 FIG_CORE(FIG_COUNT_) FIG_DISK(FIG_COUNT_) FIG_REMOTE(FIG_COUNT_) };

static double hit_rate(uint64_t hits, uint64_t others)
{
    return hits + others ? (double)hits / (double)(hits + others) : 0;
}

struct kvr_metrics {
    kvr_daemon *d;
    obs         obs;               /* loop thread only */
    const char *verb_names[N_VERB_SLOTS];
    const char *status_names[N_STATUS];
    double      start_unix;

    uv_async_t  async;
    bool        has_async;
    snapshot   *stage;             /* loop thread: built here, then copied */

    pthread_mutex_t lock;
    pthread_cond_t  cond;
    snapshot   *snap;              /* under lock */
    uint64_t    asked, served;     /* under lock: scrape tickets; the last one a
                                      published snapshot was begun after */
    bool        closing;           /* under lock */
    uint8_t    *token;             /* under lock (malloc: also freed off-loop) */
    size_t      token_len;
    char        addr[300];

    struct MHD_Daemon *mhd;

    /* The request deadline's watchdog (loop thread timer). */
    pthread_mutex_t conn_lock;
    scrape_conn conns[MAX_SCRAPE_CONNS];   /* under conn_lock */
    uint64_t    n_deadline_closed;         /* under conn_lock */
    uv_timer_t  watchdog;
    bool        has_watchdog;
};

static double now_unix(void)
{
    return (double)kvr_clock_wall_ms() / 1e3;
}

/* ---- observations (loop thread) ------------------------------------------ */

size_t kvr__metrics_bucket(double seconds)
{
    size_t b = 0;
    while (b < N_BUCKETS && seconds > BUCKETS[b])
        b++;
    return b;
}

void kvr__metrics_observe(kvr_metrics *m, int verb, int status, uint64_t bytes_in,
                         uint64_t bytes_out, double seconds)
{
    if (!m)
        return;
    int v = verb;
    if (v < 0 || v >= KVR_N_VERBS || !m->verb_names[v])
        v = KVR_N_VERBS;
    if (status < 0 || status >= N_STATUS)
        status = KVROPE__STATUS__E_INTERNAL;
    obs *o = &m->obs;
    o->req[v][status]++;
    o->pay_in[v] += bytes_in;
    o->pay_out[v] += bytes_out;
    if (seconds < 0)
        seconds = 0;
    o->hist[v][kvr__metrics_bucket(seconds)]++;
    o->hcount[v]++;
    o->hsum[v] += seconds;
}

/* ---- snapshot (loop thread) ---------------------------------------------- */

static void build(kvr_daemon *d, snapshot *s)
{
    kvr_metrics *m = d->metrics;
    if (m)
        memcpy(&s->o, &m->obs, sizeof s->o);
    else
        memset(&s->o, 0, sizeof s->o);
    kvr_store_get_stats(d->store, &s->s);
    kvr_store_tier_stats(d->store, &s->t);
    snprintf(s->engine, sizeof s->engine, "%s", s->t.engine ? s->t.engine : "");
    s->t.engine = NULL;
    s->has_remote = d->remote != NULL;
    if (s->has_remote)
        kvr__remote_get_stats(d->remote, &s->r);
    s->conns = d->n_conns;
    s->unauth = d->n_unauth;
    s->conn_total = d->n_conn_total;
    s->conn_refused = d->n_conn_refused;
    s->regions = d->n_regions_all;
    s->region_cap = d->region_cap;
    s->requests = d->n_requests;
    s->errors = d->n_errors;
    s->wire_in = d->bytes_in;
    s->wire_out = d->bytes_out;
    s->streamed = d->n_streamed;
    s->stream_aborted = d->n_stream_aborted;
    memcpy(s->per_verb, d->per_verb, sizeof s->per_verb);
    s->msg_buffered = d->msg_buffered;
    s->msg_buffer_limit = d->msg_buffer_limit;
    s->msg_limited = d->n_msg_limited;
    s->slow_closed = d->n_slow_closed;
    s->start_unix = m ? m->start_unix : 0;
    s->uptime = (double)(kvr_clock_mono_ms() - d->start_ms) / 1000.0;
    s->published_unix = now_unix();
    s->warm_bytes = atomic_load(&d->warm_done_bytes);
    s->warm_seconds = (double)atomic_load(&d->warm_done_us) / 1e6;
    s->n_models = 0;
    /* Scratch of the loop thread for one call, plain calloc: not the
     * store's memory, so it does not count against the cap (a stats call
     * on a full store must not push the accounted peak over it). */
    kvr_model_info *mi = calloc(SNAP_MODELS, sizeof *mi);
    if (mi) {   /* out of memory: the rows are left out of this snapshot */
        size_t n = kvr_store_model_list(d->store, mi, SNAP_MODELS);
        s->n_models = n < SNAP_MODELS ? n : SNAP_MODELS;
        for (size_t i = 0; i < s->n_models; i++) {
            const kvr_model_info *mf = &mi[i];
            model_row *r = &s->models[i];
            snprintf(r->name, sizeof r->name, "%s", mf->name);
            size_t k = 0;
#define ROW_FIG(st, pn, ty, help, expr) r->v[k++] = (uint64_t)(expr);
            FIG_MODEL(ROW_FIG)
#undef ROW_FIG
            assert(k == N_MODEL_FIG);
        }
        free(mi);
    }
}

static void publish(kvr_metrics *m)
{
    pthread_mutex_lock(&m->lock);
    uint64_t serving = m->asked;   /* every scrape that asked so far sees this one */
    pthread_mutex_unlock(&m->lock);
    build(m->d, m->stage);
    pthread_mutex_lock(&m->lock);
    uint64_t gen = m->snap->gen + 1;
    memcpy(m->snap, m->stage, sizeof *m->snap);
    m->snap->gen = gen;
    m->served = serving;
    pthread_cond_broadcast(&m->cond);
    pthread_mutex_unlock(&m->lock);
}

static void on_async(uv_async_t *a)
{
    publish(a->data);
}

/* ---- exposition text ------------------------------------------------------ */

typedef struct sbuf {
    char  *p;
    size_t len, cap;
    bool   oom;
} sbuf;

static void sb_printf(sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sb_printf(sbuf *b, const char *fmt, ...)
{
    if (b->oom)
        return;
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        size_t room = b->cap - b->len;
        int n = vsnprintf(b->p ? b->p + b->len : NULL, b->p ? room : 0, fmt, ap);
        va_end(ap);
        if (n < 0) {
            b->oom = true;
            return;
        }
        if (b->p && (size_t)n < room) {
            b->len += (size_t)n;
            return;
        }
        size_t ncap = b->cap ? b->cap * 2 : 64 * 1024;
        while (ncap < b->len + (size_t)n + 1)
            ncap *= 2;
        char *np = realloc(b->p, ncap);
        if (!np) {
            b->oom = true;
            return;
        }
        b->p = np;
        b->cap = ncap;
    }
}

static void family(sbuf *b, const char *name, const char *type, const char *help)
{
    sb_printf(b, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

/* A label value as the exposition format writes it: backslash, double
 * quote and newline escaped. */
static void sb_label(sbuf *b, const char *v)
{
    for (; *v; v++) {
        if (*v == '\\' || *v == '"')
            sb_printf(b, "\\%c", *v);
        else if (*v == '\n')
            sb_printf(b, "\\n");
        else
            sb_printf(b, "%c", *v);
    }
}

static void scalar(sbuf *b, const char *name, const char *type, const char *help, double v)
{
    family(b, name, type, help);
    sb_printf(b, "%s %.17g\n", name, v);
}

/* The shared tier's labelled families (its scalars are FIG_REMOTE's). */
static void render_remote(const kvr_remote_stats *r, sbuf *b)
{
    family(b, "kvrope_remote_fetches_total", "counter",
           "Fetches from the cluster (a local miss of a get or match), by result "
           "(corrupt: a value failed its checks and was treated as a miss).");
    sb_printf(b, "kvrope_remote_fetches_total{result=\"hit\"} %llu\n",
              (unsigned long long)r->fetch_hits);
    sb_printf(b, "kvrope_remote_fetches_total{result=\"miss\"} %llu\n",
              (unsigned long long)r->fetch_misses);
    sb_printf(b, "kvrope_remote_fetches_total{result=\"corrupt\"} %llu\n",
              (unsigned long long)r->fetch_corrupt);
    family(b, "kvrope_remote_redirects_total", "counter",
           "Cluster redirections followed, by kind (MOVED, ASK).");
    sb_printf(b, "kvrope_remote_redirects_total{kind=\"moved\"} %llu\n",
              (unsigned long long)r->moved);
    sb_printf(b, "kvrope_remote_redirects_total{kind=\"ask\"} %llu\n",
              (unsigned long long)r->ask);
    family(b, "kvrope_remote_fetch_duration_seconds", "histogram",
           "Time from a fetch's start (a local miss) to its end: landed, a miss, or "
           "abandoned.");
    uint64_t cum = 0;
    for (size_t k = 0; k < N_BUCKETS; k++) {
        cum += r->fetch_hist[k];
        sb_printf(b, "kvrope_remote_fetch_duration_seconds_bucket{le=\"%s\"} %llu\n",
                  BUCKET_LE[k], (unsigned long long)cum);
    }
    cum += r->fetch_hist[N_BUCKETS];
    sb_printf(b, "kvrope_remote_fetch_duration_seconds_bucket{le=\"+Inf\"} %llu\n",
              (unsigned long long)cum);
    sb_printf(b, "kvrope_remote_fetch_duration_seconds_sum %.17g\n", r->fetch_seconds);
    sb_printf(b, "kvrope_remote_fetch_duration_seconds_count %llu\n", (unsigned long long)cum);
}

static void render(const kvr_metrics *m, const snapshot *s, sbuf *b)
{
    const obs *o = &s->o;
    /* Requests by verb and status: every verb's OK series exists (0 until
     * used), error statuses appear once they happen. */
    family(b, "kvrope_requests_total", "counter",
           "Requests completed (reply queued), by verb and status.");
    for (int v = 0; v < N_VERB_SLOTS; v++) {
        if (!m->verb_names[v])
            continue;
        for (int st = 0; st < N_STATUS; st++) {
            if (st != 0 && o->req[v][st] == 0)
                continue;
            sb_printf(b, "kvrope_requests_total{verb=\"%s\",status=\"%s\"} %llu\n",
                      m->verb_names[v], m->status_names[st],
                      (unsigned long long)o->req[v][st]);
        }
    }
    family(b, "kvrope_request_payload_received_bytes_total", "counter",
           "Tensor payload bytes received with requests, by verb.");
    for (int v = 0; v < N_VERB_SLOTS; v++)
        if (m->verb_names[v])
            sb_printf(b, "kvrope_request_payload_received_bytes_total{verb=\"%s\"} %llu\n",
                      m->verb_names[v], (unsigned long long)o->pay_in[v]);
    family(b, "kvrope_request_sent_bytes_total", "counter",
           "Reply bytes sent (frame header, message and tensor payload), by verb.");
    for (int v = 0; v < N_VERB_SLOTS; v++)
        if (m->verb_names[v])
            sb_printf(b, "kvrope_request_sent_bytes_total{verb=\"%s\"} %llu\n",
                      m->verb_names[v], (unsigned long long)o->pay_out[v]);
    family(b, "kvrope_request_duration_seconds", "histogram",
           "Time from a request's frame header to its reply being queued, by verb.");
    for (int v = 0; v < N_VERB_SLOTS; v++) {
        if (!m->verb_names[v])
            continue;
        uint64_t cum = 0;
        for (size_t k = 0; k < N_BUCKETS; k++) {
            cum += o->hist[v][k];
            sb_printf(b, "kvrope_request_duration_seconds_bucket{verb=\"%s\",le=\"%s\"} %llu\n",
                      m->verb_names[v], BUCKET_LE[k], (unsigned long long)cum);
        }
        sb_printf(b, "kvrope_request_duration_seconds_bucket{verb=\"%s\",le=\"+Inf\"} %llu\n",
                  m->verb_names[v], (unsigned long long)o->hcount[v]);
        sb_printf(b, "kvrope_request_duration_seconds_sum{verb=\"%s\"} %.17g\n",
                  m->verb_names[v], o->hsum[v]);
        sb_printf(b, "kvrope_request_duration_seconds_count{verb=\"%s\"} %llu\n",
                  m->verb_names[v], (unsigned long long)o->hcount[v]);
    }
    /* The one list's scalars (stats names too: FIG_CORE above). */
#define RENDER_FIG(st, pn, ty, help, expr) \
    if ((pn)[0])                             \
        scalar(b, pn, ty, help, (double)(expr));
    FIG_CORE(RENDER_FIG)
    family(b, "kvrope_prefix_matches_total", "counter",
           "Prefix matches, by result (hit: at least one token cached).");
    sb_printf(b, "kvrope_prefix_matches_total{result=\"hit\"} %llu\n",
              (unsigned long long)s->s.n_match_hits);
    sb_printf(b, "kvrope_prefix_matches_total{result=\"miss\"} %llu\n",
              (unsigned long long)(s->s.n_matches >= s->s.n_match_hits
                                   ? s->s.n_matches - s->s.n_match_hits : 0));

    /* Tiers: memory, disk (the remote tier, which fetches whole contexts
     * rather than serving block reads, has its kvrope_remote_ families
     * below). A block read is a hit in the first tier that holds it and a miss in
     * each tier above. */
    const kvr_tier_stats *t = &s->t;
    struct { const char *tier; bool present; uint64_t hits, misses; } tiers[] = {
        { "memory", true, t->reads_mem, t->reads_disk },
        { "disk", t->enabled, t->reads_disk, 0 },
    };
    family(b, "kvrope_tier_hits_total", "counter",
           "Block reads (get, assemble) served by a tier, by tier.");
    for (size_t i = 0; i < sizeof tiers / sizeof tiers[0]; i++)
        if (tiers[i].present)
            sb_printf(b, "kvrope_tier_hits_total{tier=\"%s\"} %llu\n", tiers[i].tier,
                      (unsigned long long)tiers[i].hits);
    family(b, "kvrope_tier_misses_total", "counter",
           "Block reads a tier did not hold and a lower tier served, by tier.");
    for (size_t i = 0; i < sizeof tiers / sizeof tiers[0]; i++)
        if (tiers[i].present)
            sb_printf(b, "kvrope_tier_misses_total{tier=\"%s\"} %llu\n", tiers[i].tier,
                      (unsigned long long)tiers[i].misses);
    family(b, "kvrope_tier_blocks", "gauge", "Blocks held by a tier, by tier.");
    sb_printf(b, "kvrope_tier_blocks{tier=\"memory\"} %llu\n", (unsigned long long)t->mem_blocks);
    if (t->enabled)
        sb_printf(b, "kvrope_tier_blocks{tier=\"disk\"} %llu\n",
                  (unsigned long long)t->disk_blocks);
    family(b, "kvrope_tier_bytes", "gauge", "KV bytes held by a tier, by tier.");
    sb_printf(b, "kvrope_tier_bytes{tier=\"memory\"} %llu\n", (unsigned long long)t->mem_bytes);
    if (t->enabled)
        sb_printf(b, "kvrope_tier_bytes{tier=\"disk\"} %llu\n",
                  (unsigned long long)t->disk_bytes);
    if (t->enabled) {
        family(b, "kvrope_disk_engine_info", "gauge", "The disk tier's I/O engine (value 1).");
        sb_printf(b, "kvrope_disk_engine_info{engine=\"%s\"} 1\n", s->engine);
        FIG_DISK(RENDER_FIG)
    }
    if (s->has_remote) {
        FIG_REMOTE(RENDER_FIG)
        render_remote(&s->r, b);
    }
#undef RENDER_FIG

    /* Per model (tenant). */
    if (s->n_models) {
        size_t k = 0;
#define RENDER_MODEL(st, pn, ty, help, expr)                                  \
        family(b, pn, ty, help);                                               \
        for (size_t i = 0; i < s->n_models; i++) {                             \
            sb_printf(b, "%s{model=\"", pn);                                    \
            sb_label(b, s->models[i].name);                                    \
            sb_printf(b, "\"} %llu\n", (unsigned long long)s->models[i].v[k]); \
        }                                                                      \
        k++;
        FIG_MODEL(RENDER_MODEL)
#undef RENDER_MODEL
        assert(k == N_MODEL_FIG);
    }

    /* Process. */
    family(b, "kvrope_build_info", "gauge", "kvroped's version (value 1).");
    sb_printf(b, "kvrope_build_info{version=\"%s\",protocol=\"%u\"} 1\n", KVR_DAEMON_VERSION,
              (unsigned)KVR_PROTOCOL_VERSION);
    scalar(b, "kvrope_start_time_seconds", "gauge", "When kvroped started (Unix time).",
           s->start_unix);
    scalar(b, "kvrope_metrics_snapshot_timestamp_seconds", "gauge",
           "When the figures of this scrape were taken (Unix time).", s->published_unix);
}

/* ---- the stats verb's list (loop thread) ------------------------------------ */

int kvr__metrics_list(kvr_daemon *d, kvr_metric_list *out, kvr_error *err)
{
    enum { VN = 40, MN = KVR_ID_MAX + 32 };
    memset(out, 0, sizeof *out);
    snapshot *s = malloc(sizeof *s);   /* transient, plain malloc as build()'s scratch */
    if (!s)
        return kvr_error_set(err, KVR_ENOMEM, "out of memory for the stats");
    build(d, s);
    size_t n_rows = N_MODEL_FIG * s->n_models;
    size_t cap = N_FIGURES + KVR_N_VERBS + n_rows;
    out->names = kvr_mem_calloc(cap, sizeof *out->names);
    out->values = kvr_mem_calloc(cap, sizeof *out->values);
    out->buf = kvr_mem_calloc(KVR_N_VERBS * VN + n_rows * MN + 1, 1);
    if (!out->names || !out->values || !out->buf) {
        free(s);
        kvr__metrics_list_free(out);
        return kvr_error_set(err, KVR_ENOMEM, "out of memory for the stats");
    }
    size_t n = 0;
    char *nb = out->buf;
#define LIST_FIG(st, pn, ty, help, expr) \
    if ((st)[0]) {                        \
        out->names[n] = st;               \
        out->values[n++] = (double)(expr); \
    }
    FIG_CORE(LIST_FIG)
    for (size_t k = 0; k < KVR_N_VERBS; k++, nb += VN) {
        snprintf(nb, VN, "requests_%s", kvr__verb_name(k));
        out->names[n] = nb;
        out->values[n++] = (double)s->per_verb[k];
    }
    FIG_DISK(LIST_FIG)
    if (s->has_remote) {
        FIG_REMOTE(LIST_FIG)
    }
#undef LIST_FIG
    /* Per model: model_<name>_<figure>, from the same snapshot. */
    static const char *const model_stat[N_MODEL_FIG] = {
#define STAT_NAME(st, pn, ty, help, expr) st,
        FIG_MODEL(STAT_NAME)
#undef STAT_NAME
    };
    for (size_t k = 0; k < n_rows; k++, nb += MN) {
        const model_row *r = &s->models[k / N_MODEL_FIG];
        snprintf(nb, MN, "model_%s_%s", r->name, model_stat[k % N_MODEL_FIG]);
        out->names[n] = nb;
        out->values[n++] = (double)r->v[k % N_MODEL_FIG];
    }
    assert(n <= cap);
    out->n = n;
    free(s);
    return 0;
}

void kvr__metrics_list_free(kvr_metric_list *l)
{
    kvr_mem_free(l->names);
    kvr_mem_free(l->values);
    kvr_mem_free(l->buf);
    memset(l, 0, sizeof *l);
}

static int render_snapshot(const kvr_metrics *m, const snapshot *s, char **out, size_t *len)
{
    sbuf b = { 0 };
    render(m, s, &b);
    if (b.oom || !b.p) {
        free(b.p);
        return KVR_ENOMEM;
    }
    *out = b.p;
    *len = b.len;
    return 0;
}

/* ---- HTTP (libmicrohttpd's thread) ---------------------------------------- */

static enum MHD_Result send_text(struct MHD_Connection *conn, unsigned code, const char *text,
                                 const char *hdr, const char *hval)
{
    struct MHD_Response *r = MHD_create_response_from_buffer(strlen(text), (void *)(uintptr_t)text,
                                                             MHD_RESPMEM_PERSISTENT);
    if (!r)
        return MHD_NO;
    MHD_add_response_header(r, "Content-Type", "text/plain; charset=utf-8");
    if (hdr)
        MHD_add_response_header(r, hdr, hval);
    enum MHD_Result rc = MHD_queue_response(conn, code, r);
    MHD_destroy_response(r);
    return rc;
}

/* Under m->lock. */
static bool authorized(const kvr_metrics *m, const char *h)
{
    if (!m->token)
        return true;
    if (!h || strncasecmp(h, "Bearer ", 7) != 0)
        return false;
    h += 7;
    while (*h == ' ')
        h++;
    size_t n = strlen(h);
    while (n > 0 && (h[n - 1] == ' ' || h[n - 1] == '\t'))
        n--;
    unsigned diff = n != m->token_len;
    for (size_t i = 0; i < m->token_len; i++) {
        uint8_t x = i < n ? (uint8_t)h[i] : 0;
        diff |= (unsigned)(x ^ m->token[i]);
    }
    return diff == 0;
}

static enum MHD_Result on_http(void *cls, struct MHD_Connection *conn, const char *url,
                               const char *method, const char *version, const char *upload,
                               size_t *upload_size, void **con_cls)
{
    kvr_metrics *m = cls;
    (void)version;
    (void)upload;
    if (!*con_cls) {
        /* First call: headers only. Answer once they are all in. */
        *con_cls = (void *)m;
        return MHD_YES;
    }
    if (*upload_size) {
        *upload_size = 0;      /* a body is ignored (and refused below) */
        return MHD_YES;
    }
    bool head = !strcmp(method, "HEAD");
    if (strcmp(method, "GET") && !head)
        return send_text(conn, MHD_HTTP_METHOD_NOT_ALLOWED, "only GET /metrics\n", "Allow",
                         "GET, HEAD");
    const char *auth = MHD_lookup_connection_value(conn, MHD_HEADER_KIND,
                                                   MHD_HTTP_HEADER_AUTHORIZATION);
    pthread_mutex_lock(&m->lock);
    bool ok = authorized(m, auth);
    pthread_mutex_unlock(&m->lock);
    if (!ok)
        return send_text(conn, MHD_HTTP_UNAUTHORIZED,
                         "authentication required: send 'Authorization: Bearer TOKEN' with the "
                         "content of --auth-token-file\n",
                         MHD_HTTP_HEADER_WWW_AUTHENTICATE, "Bearer realm=\"kvrope\"");
    if (strcmp(url, "/metrics") != 0)
        return send_text(conn, MHD_HTTP_NOT_FOUND, "kvroped serves GET /metrics only\n", NULL,
                         NULL);

    /* A snapshot the loop began after this request (its ticket), or the
     * last one published after SNAP_WAIT_MS. */
    pthread_mutex_lock(&m->lock);
    uint64_t ticket = ++m->asked;
    bool closing = m->closing;
    pthread_mutex_unlock(&m->lock);
    if (!closing)
        uv_async_send(&m->async);
    struct timespec dl = kvr_clock_deadline(SNAP_WAIT_MS);
    pthread_mutex_lock(&m->lock);
    while (!m->closing && m->served < ticket)
        if (pthread_cond_timedwait(&m->cond, &m->lock, &dl) == ETIMEDOUT)
            break;
    char *text = NULL;
    size_t len = 0;
    int rc = render_snapshot(m, m->snap, &text, &len);
    pthread_mutex_unlock(&m->lock);
    if (rc < 0)
        return send_text(conn, MHD_HTTP_SERVICE_UNAVAILABLE, "out of memory\n", NULL, NULL);
    struct MHD_Response *r = MHD_create_response_from_buffer_with_free_callback(len, text, free);
    if (!r) {
        free(text);
        return MHD_NO;
    }
    MHD_add_response_header(r, "Content-Type", "text/plain; version=0.0.4; charset=utf-8");
    MHD_add_response_header(r, "Cache-Control", "no-store");
    enum MHD_Result qr = MHD_queue_response(conn, MHD_HTTP_OK, r);
    MHD_destroy_response(r);
    return qr;
}

/* libmicrohttpd's error logger: fmt is its own printf format. */
static void mhd_log(void *cls, const char *fmt, va_list ap) __attribute__((format(printf, 2, 0)));

static void mhd_log(void *cls, const char *fmt, va_list ap)
{
    (void)cls;
    char msg[512];
    vsnprintf(msg, sizeof msg, fmt, ap);
    size_t n = strlen(msg);
    while (n > 0 && msg[n - 1] == '\n')
        msg[--n] = '\0';
    kvr_log(KVR_LOG_WARN, "metrics http: %s", msg);
}

bool kvr__daemon_sockaddr_is_loopback(const struct sockaddr *sa)
{
    if (sa->sa_family == AF_INET) {
        const struct sockaddr_in *a = (const struct sockaddr_in *)(const void *)sa;
        return (ntohl(a->sin_addr.s_addr) >> 24) == 127;
    }
    if (sa->sa_family == AF_INET6) {
        const struct sockaddr_in6 *a = (const struct sockaddr_in6 *)(const void *)sa;
        if (IN6_IS_ADDR_LOOPBACK(&a->sin6_addr))
            return true;
        return IN6_IS_ADDR_V4MAPPED(&a->sin6_addr) && a->sin6_addr.s6_addr[12] == 127;
    }
    return false;
}

static void name_of(const struct sockaddr_storage *ss, char *buf, size_t cap)
{
    char host[INET6_ADDRSTRLEN] = "?";
    int port = 0;
    if (ss->ss_family == AF_INET6) {
        const struct sockaddr_in6 *a = (const struct sockaddr_in6 *)(const void *)ss;
        inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof host);
        port = ntohs(a->sin6_port);
        snprintf(buf, cap, "[%s]:%d", host, port);
    } else {
        const struct sockaddr_in *a = (const struct sockaddr_in *)(const void *)ss;
        inet_ntop(AF_INET, &a->sin_addr, host, sizeof host);
        port = ntohs(a->sin_port);
        snprintf(buf, cap, "%s:%d", host, port);
    }
}

/* HTTP thread: a connection opens (listed, its deadline set) or closes
 * (unlisted, before libmicrohttpd closes its fd). */
static void on_mhd_conn(void *cls, struct MHD_Connection *conn, void **socket_context,
                        enum MHD_ConnectionNotificationCode code)
{
    kvr_metrics *m = cls;
    pthread_mutex_lock(&m->conn_lock);
    if (code == MHD_CONNECTION_NOTIFY_STARTED) {
        const union MHD_ConnectionInfo *ci =
            MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CONNECTION_FD);
        for (size_t i = 0; ci && i < MAX_SCRAPE_CONNS; i++) {
            if (m->conns[i].used)
                continue;
            m->conns[i] = (scrape_conn){ .used = true, .fd = ci->connect_fd,
                                         .deadline_ms = kvr_clock_mono_ms() + REQUEST_DEADLINE_MS };
            *socket_context = &m->conns[i];
            break;
        }
    } else if (*socket_context) {
        ((scrape_conn *)*socket_context)->used = false;
        *socket_context = NULL;
    }
    pthread_mutex_unlock(&m->conn_lock);
}

/* HTTP thread: a request was answered; the next one on the connection
 * (keep-alive) has REQUEST_DEADLINE_MS from now. */
static void on_mhd_done(void *cls, struct MHD_Connection *conn, void **con_cls,
                        enum MHD_RequestTerminationCode toe)
{
    kvr_metrics *m = cls;
    (void)con_cls;
    (void)toe;
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(conn, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    pthread_mutex_lock(&m->conn_lock);
    scrape_conn *sc = ci ? ci->socket_context : NULL;
    if (sc && sc->used && sc->deadline_ms)
        sc->deadline_ms = kvr_clock_mono_ms() + REQUEST_DEADLINE_MS;
    pthread_mutex_unlock(&m->conn_lock);
}

/* Loop thread: shuts down the sockets of connections past their deadline
 * (libmicrohttpd then reads EOF and closes them). */
static void on_watchdog(uv_timer_t *t)
{
    kvr_metrics *m = t->data;
    uint64_t now = kvr_clock_mono_ms();
    unsigned n = 0;
    pthread_mutex_lock(&m->conn_lock);
    for (size_t i = 0; i < MAX_SCRAPE_CONNS; i++) {
        scrape_conn *sc = &m->conns[i];
        if (!sc->used || !sc->deadline_ms || now < sc->deadline_ms)
            continue;
        shutdown(sc->fd, SHUT_RDWR);
        sc->deadline_ms = 0;
        n++;
    }
    m->n_deadline_closed += n;
    pthread_mutex_unlock(&m->conn_lock);
    if (n)
        kvr_log(KVR_LOG_INFO, "metrics: closed %u connection%s whose request was not in and "
                "answered within %u s", n, n == 1 ? "" : "s", REQUEST_DEADLINE_MS / 1000);
}

static int start_http(kvr_metrics *m, int listen_fd, kvr_error *err)
{
    const kvr_daemon_config *cfg = &m->d->cfg;
    unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_ERROR_LOG;
    struct sockaddr_storage ss;
    memset(&ss, 0, sizeof ss);
    if (listen_fd < 0) {
        char host[256];
        int port;
        if (kvr__daemon_split_listen(cfg->metrics_listen, host, sizeof host, &port) < 0) {
            return kvr_error_set(err, KVR_EINVAL, "--metrics-listen: expected HOST:PORT, got '%s'",
                     cfg->metrics_listen);
        }
        if (!strcmp(host, "localhost"))
            snprintf(host, sizeof host, "127.0.0.1");
        struct sockaddr_in *a4 = (struct sockaddr_in *)(void *)&ss;
        struct sockaddr_in6 *a6 = (struct sockaddr_in6 *)(void *)&ss;
        if (inet_pton(AF_INET, host, &a4->sin_addr) == 1) {
            a4->sin_family = AF_INET;
            a4->sin_port = htons((uint16_t)port);
        } else if (inet_pton(AF_INET6, host, &a6->sin6_addr) == 1) {
            a6->sin6_family = AF_INET6;
            a6->sin6_port = htons((uint16_t)port);
            flags |= MHD_USE_IPv6;
        } else {
            return kvr_error_set(err, KVR_EINVAL, "--metrics-listen: '%s' is not a numeric IP address", host);
        }
    } else {
        socklen_t sl = sizeof ss;
        if (getsockname(listen_fd, (struct sockaddr *)&ss, &sl) < 0 ||
            (ss.ss_family != AF_INET && ss.ss_family != AF_INET6)) {
            return kvr_error_set(err, KVR_EINVAL, "the activated metrics socket is not a TCP socket");
        }
        if (ss.ss_family == AF_INET6)
            flags |= MHD_USE_IPv6;
        if (!kvr__daemon_sockaddr_is_loopback((struct sockaddr *)&ss) && !m->token) {
            return kvr_error_set(err, KVR_EINVAL, "the activated metrics socket is not on a loopback address: "
                     "it requires --auth-token-file FILE");
        }
    }
    if (listen_fd >= 0)
        m->mhd = MHD_start_daemon(flags, 0, NULL, NULL, on_http, m,
                                  MHD_OPTION_EXTERNAL_LOGGER, mhd_log, m,
                                  MHD_OPTION_LISTEN_SOCKET, (MHD_socket)listen_fd,
                                  MHD_OPTION_CONNECTION_LIMIT, (unsigned)MAX_SCRAPE_CONNS,
                                  MHD_OPTION_PER_IP_CONNECTION_LIMIT,
                                  (unsigned)PER_PEER_SCRAPE_CONNS,
                                  MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)IDLE_TIMEOUT_S,
                                  MHD_OPTION_CONNECTION_MEMORY_LIMIT, (size_t)32768,
                                  MHD_OPTION_NOTIFY_CONNECTION, on_mhd_conn, m,
                                  MHD_OPTION_NOTIFY_COMPLETED, on_mhd_done, m,
                                  MHD_OPTION_END);
    else
        m->mhd = MHD_start_daemon(flags, 0, NULL, NULL, on_http, m,
                                  MHD_OPTION_EXTERNAL_LOGGER, mhd_log, m,
                                  MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&ss,
                                  MHD_OPTION_CONNECTION_LIMIT, (unsigned)MAX_SCRAPE_CONNS,
                                  MHD_OPTION_PER_IP_CONNECTION_LIMIT,
                                  (unsigned)PER_PEER_SCRAPE_CONNS,
                                  MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)IDLE_TIMEOUT_S,
                                  MHD_OPTION_CONNECTION_MEMORY_LIMIT, (size_t)32768,
                                  MHD_OPTION_NOTIFY_CONNECTION, on_mhd_conn, m,
                                  MHD_OPTION_NOTIFY_COMPLETED, on_mhd_done, m,
                                  MHD_OPTION_END);
    if (!m->mhd) {
        return kvr_error_set(err, KVR_EIO, "--metrics-listen %s: cannot start the HTTP server (address in "
                 "use or not available?)", listen_fd >= 0 ? "(activated)" : cfg->metrics_listen);
    }
    if (uv_timer_init(&m->d->loop, &m->watchdog) == 0) {
        m->watchdog.data = m;
        m->has_watchdog = true;
        uv_timer_start(&m->watchdog, on_watchdog, WATCHDOG_MS, WATCHDOG_MS);
        uv_unref((uv_handle_t *)&m->watchdog);    /* never keeps the loop alive */
    }
    /* The bound address (port 0 picks one). */
    const union MHD_DaemonInfo *fi = MHD_get_daemon_info(m->mhd, MHD_DAEMON_INFO_LISTEN_FD);
    if (fi) {
        struct sockaddr_storage b;
        socklen_t bl = sizeof b;
        if (getsockname(fi->listen_fd, (struct sockaddr *)&b, &bl) == 0)
            ss = b;
    }
    name_of(&ss, m->addr, sizeof m->addr);
    kvr_log(KVR_LOG_INFO, "metrics on http://%s/metrics%s%s", m->addr,
            listen_fd >= 0 ? " (socket activation)" : "", m->token ? " (bearer token required)" : "");
    return 0;
}

/* ---- lifecycle -------------------------------------------------------------- */

int kvr__metrics_set_token(kvr_metrics *m, const uint8_t *token, size_t len)
{
    if (!m)
        return 0;
    uint8_t *copy = NULL;
    if (token && len) {
        copy = malloc(len);
        if (!copy)
            return KVR_ENOMEM;
        memcpy(copy, token, len);
    }
    pthread_mutex_lock(&m->lock);
    uint8_t *old = m->token;
    m->token = copy;
    m->token_len = copy ? len : 0;
    pthread_mutex_unlock(&m->lock);
    free(old);
    return 0;
}

const char *kvr__metrics_address(const kvr_metrics *m)
{
    return m && m->mhd ? m->addr : "";
}

int kvr__metrics_create(kvr_daemon *d, int listen_fd, kvr_error *err)
{
    kvr_metrics *m = kvr_mem_calloc(1, sizeof *m);
    snapshot *a = kvr_mem_calloc(1, sizeof *a), *b = kvr_mem_calloc(1, sizeof *b);
    if (!m || !a || !b) {
        kvr_mem_free(m);
        kvr_mem_free(a);
        kvr_mem_free(b);
        return kvr_error_set(err, KVR_ENOMEM, "out of memory");
    }
    m->d = d;
    m->snap = a;
    m->stage = b;
    m->start_unix = now_unix();
    pthread_mutex_init(&m->lock, NULL);
    pthread_mutex_init(&m->conn_lock, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_cond_init(&m->cond, &ca);
    pthread_condattr_destroy(&ca);
    /* The verbs stats counts (dispatch.c's table), in its order: every
     * verb has its series, whatever its body's field number. */
    for (int v = 0; v < KVR_N_VERBS; v++)
        m->verb_names[v] = kvr__verb_name((size_t)v);
    m->verb_names[KVR_N_VERBS] = "none";
    for (int st = 0; st < N_STATUS; st++) {
        const ProtobufCEnumValue *ev =
            protobuf_c_enum_descriptor_get_value(&kvrope__status__descriptor, st);
        m->status_names[st] = ev ? ev->name : "E_INTERNAL";
    }
    d->metrics = m;
    if (kvr__metrics_set_token(m, d->token, d->token_len) < 0) {
        return kvr_error_set(err, KVR_ENOMEM, "out of memory");
    }
    int rc = uv_async_init(&d->loop, &m->async, on_async);
    if (rc < 0) {
        return kvr_error_sys(err, KVR_EINTERNAL, -rc, "uv_async_init");
    }
    m->has_async = true;
    m->async.data = m;
    uv_unref((uv_handle_t *)&m->async);    /* never keeps the loop alive */
    publish(m);
    if (listen_fd >= 0 || d->cfg.metrics_listen[0])
        return start_http(m, listen_fd, err);
    return 0;
}

void kvr__metrics_stop(kvr_daemon *d)
{
    kvr_metrics *m = d->metrics;
    if (!m)
        return;
    pthread_mutex_lock(&m->lock);
    m->closing = true;
    pthread_cond_broadcast(&m->cond);
    pthread_mutex_unlock(&m->lock);
    if (m->mhd) {
        MHD_stop_daemon(m->mhd);     /* joins the HTTP thread */
        m->mhd = NULL;
    }
    kvr__uv_close_once((uv_handle_t *)&m->async, &m->has_async);
    kvr__uv_close_once((uv_handle_t *)&m->watchdog, &m->has_watchdog);
}

void kvr__metrics_destroy(kvr_daemon *d)
{
    kvr_metrics *m = d->metrics;
    if (!m)
        return;
    kvr__metrics_stop(d);
    pthread_mutex_destroy(&m->lock);
    pthread_mutex_destroy(&m->conn_lock);
    pthread_cond_destroy(&m->cond);
    free(m->token);
    kvr_mem_free(m->snap);
    kvr_mem_free(m->stage);
    kvr_mem_free(m);
    d->metrics = NULL;
}
