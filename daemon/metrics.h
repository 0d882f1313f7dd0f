/*
 * metrics.h — private to daemon/: per-request observations, the snapshot the
 * loop publishes, and the Prometheus endpoint (GET /metrics over HTTP,
 * libmicrohttpd on its own thread).
 *
 * Threads: kvr__metrics_observe and everything that reads the store or the
 * daemon run on the loop thread only. The HTTP thread reads nothing but the
 * published snapshot (under the metrics mutex); to serve a scrape it asks
 * the loop for a fresh one (uv_async) and waits a bounded time for it, so a
 * scrape shows the figures of one instant, and a stuck loop gives the last
 * snapshot rather than a hung scrape.
 */
#ifndef KVR_METRICS_H
#define KVR_METRICS_H

#include <stdint.h>
#include <stddef.h>

#include "rope/error.h"

typedef struct kvr_daemon kvr_daemon;
typedef struct kvr_metrics kvr_metrics;

/* Latency histograms share one set of buckets (50 us .. 10 s, plus one
 * above the last): kvr__metrics_bucket gives the index for a duration, so
 * other threads (the remote tier's fetches) can count into their own
 * atomic arrays and the exposition renders them alike. */
#define KVR_METRICS_N_BUCKETS 17
size_t kvr__metrics_bucket(double seconds);

/* Loop thread, in kvr_daemon_create: allocates d->metrics and, with
 * --metrics-listen (or an activated fd named "metrics", listen_fd >= 0),
 * starts the HTTP thread. 0 or a negative KVR_E* code with err filled. */
int  kvr__metrics_create(kvr_daemon *d, int listen_fd, kvr_error *err);

/* THE per-request observation, one call when a request completes (its
 * reply queued): verb = the index of the request's verb in dispatch.c's
 * table (kvr__verb_name; -1, no or an unknown body: "none"),
 * status = the reply's Status, payload bytes received / sent, seconds from
 * the frame's header to the reply. Loop thread; m may be NULL. */
void kvr__metrics_observe(kvr_metrics *m, int verb, int status, uint64_t bytes_in,
                         uint64_t bytes_out, double seconds);

/* The stats verb's figures, by name: taken from the same snapshot and the
 * same list of figures /metrics renders (metrics.c's FIG_* tables), on the
 * loop thread. names[i] are static or point into buf. 0, or KVR_ENOMEM
 * (*out empty). Free with kvr__metrics_list_free. */
typedef struct kvr_metric_list {
    size_t       n;
    const char **names;
    double      *values;
    char        *buf;
} kvr_metric_list;
int  kvr__metrics_list(kvr_daemon *d, kvr_metric_list *out, kvr_error *err);
void kvr__metrics_list_free(kvr_metric_list *l);   /* zeroed: no-op */

/* Loop thread (SIGHUP): the token scrapes must send (NULL: none). */
int  kvr__metrics_set_token(kvr_metrics *m, const uint8_t *token, size_t len);

/* Loop thread: the address /metrics is served on ("" if none). */
const char *kvr__metrics_address(const kvr_metrics *m);

/* Loop thread: stops the HTTP thread (joined) and closes the async handle.
 * Idempotent; kvr__metrics_destroy calls it. */
void kvr__metrics_stop(kvr_daemon *d);
void kvr__metrics_destroy(kvr_daemon *d);

#endif /* KVR_METRICS_H */
