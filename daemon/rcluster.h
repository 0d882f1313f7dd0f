/*
 * rcluster.h — a small Redis Cluster client on hiredis (Debian packages no
 * cluster client for C): CRC16 key slots with hash tags, the slot map from
 * CLUSTER SLOTS, MOVED and ASK redirects, a map refresh when a node fails
 * or a redirect says the map is stale, per-node connection pools, AUTH with
 * an ACL user and password.
 *
 * Threading: every call is blocking and thread-safe; the daemon calls it
 * from worker threads only (the remote tier's publisher thread and libuv's
 * threadpool), never from the loop thread, so a slow or failing cluster can
 * stall no request that does not need it. Connections are pooled per node:
 * a thread takes one, uses it for one command or one pipeline, gives it
 * back (or closes it if anything went wrong on it).
 *
 * Failures are bounded in time: an operation retries across redirects,
 * CLUSTERDOWN/TRYAGAIN and node failures (a failover) until retry_ms have
 * passed, then fails with KVR_EIO. Nothing here ever blocks forever, and a
 * thread with a deadline (kvr__rc_set_deadline) never past it.
 */
#ifndef KVR_RCLUSTER_H
#define KVR_RCLUSTER_H

#include <stddef.h>
#include <stdint.h>
#include <stdbool.h>

#include <hiredis/hiredis.h>

#include "base/clock.h"
#include "base/error.h"

#define KVR_RC_SLOTS 16384u
#define KVR_RC_MAX_NODES 64
#define KVR_RC_MAX_SEEDS 16

typedef struct kvr_rc kvr_rc;

typedef struct kvr_rc_config {
    const char *seeds;          /* "host:port[,host:port...]"; "redis://" prefix allowed */
    const char *user;           /* ACL user; NULL/"" = the default user */
    const char *password;       /* NULL/"" = no AUTH */
    int connect_timeout_ms;     /* per connection attempt; 0 = 500 */
    int io_timeout_ms;          /* per reply; 0 = 5000 */
    int retry_ms;               /* an operation's whole retry budget; 0 = 3000 */
} kvr_rc_config;

typedef struct kvr_rc_stats {
    uint64_t moved, ask, refreshes, conn_errors, tryagain, commands;
    unsigned n_masters;          /* in the current map */
    bool     have_map;
} kvr_rc_stats;

/* CRC16/XMODEM as Redis Cluster uses it (poly 0x1021, init 0). */
uint16_t kvr__rc_crc16(const void *p, size_t n);
/* The slot of a key: CRC16 of its hash tag (the bytes between the first
 * '{' and the first '}' after it, if that is non-empty) else of the whole
 * key, mod 16384. */
unsigned kvr__rc_key_slot(const void *key, size_t n);
/* Parses "MOVED 3999 127.0.0.1:6381" / "ASK ..." (0, or KVR_EINVAL if s is
 * no redirect). host gets the address (hcap bytes). */
int kvr__rc_parse_redirect(const char *s, size_t n, bool *is_ask, unsigned *slot,
                          char *host, size_t hcap, int *port);
/* Parses a seed list into hosts/ports; returns the count or KVR_EINVAL. */
int kvr__rc_parse_seeds(const char *s, char hosts[][64], int *ports, int cap, kvr_error *err);

/* Creates the client; does not connect (kvr__rc_refresh does). Copies cfg's
 * strings. KVR_EINVAL for a bad seed list. */
int  kvr__rc_create(kvr_rc **out, const kvr_rc_config *cfg, kvr_error *err);
void kvr__rc_destroy(kvr_rc *rc);        /* NULL is a no-op */

/* Loads the slot map now from a seed or a known node: 0, KVR_EUNAUTH (a
 * node refused the credentials: the message says which and why), KVR_EIO
 * (no node answered, or the cluster has no full map yet). */
int  kvr__rc_refresh(kvr_rc *rc, kvr_error *err);

/* One command whose key is argv[1], routed by its slot. On 0 *out is the
 * reply (never an error reply; the caller frees it with freeReplyObject).
 * KVR_EIO when the budget ran out or the command failed (message in err),
 * KVR_EUNAUTH on NOAUTH/WRONGPASS. */
int  kvr__rc_command(kvr_rc *rc, int argc, const char **argv, const size_t *argvlen,
                    redisReply **out, kvr_error *err);

/* Several single-key commands (key = argv[1] of each), pipelined per node
 * (one round trip per node when the map is right); redirected or failed
 * ones are retried one by one. out[i] = the reply or NULL (failed; never an
 * error reply). Returns how many succeeded. */
typedef struct kvr_rc_cmd {
    int            argc;
    const char   **argv;
    const size_t  *argvlen;
} kvr_rc_cmd;
size_t kvr__rc_batch(kvr_rc *rc, size_t n, const kvr_rc_cmd *cmds, redisReply **out);
/* The same, each node's pipeline on its own thread, and every reply handed
 * to cb(ud, i, reply) as it arrives (possibly concurrently, for distinct
 * i; the reply is freed when cb returns) instead of stored in out (NULL).
 * Returns how many replies cb accepted (returned true for). */
typedef bool (*kvr_rc_reply_fn)(void *ud, size_t i, const redisReply *r);
size_t kvr__rc_batch_cb(kvr_rc *rc, size_t n, const kvr_rc_cmd *cmds, redisReply **out,
                       kvr_rc_reply_fn cb, void *ud);

/* Large string replies read straight from the socket into the caller's
 * memory: no hiredis reply object, no intermediate buffer (the bytes are
 * copied once, by the kernel, to where sink->span says). For command i:
 *  - begin(ud, i, len): the reply is a string of len bytes; return false to
 *    have them read and dropped (end is still called);
 *  - span(ud, i, off, &cap): where bytes [off, off + cap) go (cap > 0, at
 *    most len - off); NULL drops them;
 *  - got(ud, i, off, p, n): bytes [off, off + n) have landed at p, in order
 *    (p may be a scratch buffer when span returned NULL);
 *  - end(ud, i, is_string): the reply is complete (is_string false: nil or
 *    not a string); return true to count it as accepted.
 * A connection that fails mid-reply is dropped and the command retried (on
 * the one-by-one path, from a hiredis reply): begin is then called again
 * and must reset whatever it keeps for i. Calls for distinct i may run
 * concurrently (one thread per node). Returns how many end accepted. */
typedef struct kvr_rc_sink {
    bool     (*begin)(void *ud, size_t i, size_t len);
    uint8_t *(*span)(void *ud, size_t i, size_t off, size_t *cap);
    void     (*got)(void *ud, size_t i, size_t off, const uint8_t *p, size_t n);
    bool     (*end)(void *ud, size_t i, bool is_string);
} kvr_rc_sink;
size_t kvr__rc_batch_sink(kvr_rc *rc, size_t n, const kvr_rc_cmd *cmds, const kvr_rc_sink *sink,
                         void *ud);

void kvr__rc_get_stats(kvr_rc *rc, kvr_rc_stats *out);

/* The calling thread's deadline (CLOCK_MONOTONIC milliseconds, as
 * kvr_clock_mono_ms; 0 = none) for every call it makes until it sets another:
 * each connection attempt, socket read and write, map refresh and retry
 * sleep ends by then, so no call returns more than a few milliseconds
 * after it (the rest fails with KVR_EIO or as a failed command of a
 * batch). Without one, each step has its own timeout (connect 500 ms, each
 * reply 5 s) and an operation retries for its budget (3 s). */
void     kvr__rc_set_deadline(uint64_t deadline_ms);

#endif /* KVR_RCLUSTER_H */
