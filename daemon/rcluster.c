/*
 * rcluster.c — the Redis Cluster client of the remote tier (rcluster.h).
 *
 * State: a table of known nodes (host, port, a pool of idle connections,
 * each under its own mutex) and the slot map (slot -> node index, -1 =
 * unknown) under rc->mu. Nodes are only ever added (a failed-over master
 * stays in the table, unused once the map no longer points at it), so a
 * node index stays valid for the client's life.
 *
 * Routing: slot(argv[1]) -> node from the map; MOVED updates that slot at
 * once and asks for a refresh (the whole map is probably stale after a
 * resharding or a failover); ASK sends ASKING + the command to the named
 * node once, without touching the map; a connection error or CLUSTERDOWN
 * drops the connection, refreshes (at most every REFRESH_MIN_MS) and tries
 * again until the retry budget is spent. A command is retried only where
 * that is safe: GET/EXISTS/SET of immutable, content-addressed values.
 *
 * Deadlines: besides each operation's retry budget, a thread may set a
 * deadline (kvr__rc_set_deadline) that every blocking step it takes then
 * respects: a connection attempt, each socket read and write (the
 * connection's timeouts are set to what is left before every use, and the
 * sink reader polls with it), a map refresh (which gives up between nodes
 * and never waits for another thread's refresh), the back-off sleeps. So a
 * cluster whose nodes accept and never answer costs a caller its deadline,
 * not the sum of every node's I/O timeout.
 */
#include "base/clock.h"
#include "daemon/rcluster.h"

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

#include "cache/cache.h"

#define POOL_MAX 8
#define REFRESH_MIN_MS 100
#define MAX_REDIRECTS 16
#define DL_RESET_MS 10          /* socket timeouts follow a deadline this closely */

typedef struct rc_node {
    char            host[64];
    int             port;
    pthread_mutex_t mu;
    redisContext   *idle[POOL_MAX];
    int             n_idle;
} rc_node;

struct kvr_rc {
    char     user[128], password[256];
    bool     auth;
    int      connect_ms, io_ms, retry_ms;
    char     seed_host[KVR_RC_MAX_SEEDS][64];
    int      seed_port[KVR_RC_MAX_SEEDS];
    int      n_seeds;

    pthread_mutex_t mu;          /* nodes[] growth, slots[], refresh state */
    rc_node *nodes[KVR_RC_MAX_NODES];
    int      n_nodes;
    int16_t  slots[KVR_RC_SLOTS];
    bool     have_map;
    unsigned n_masters;
    uint64_t last_refresh_ms;
    pthread_mutex_t refresh_mu;  /* one refresh at a time */

    /* statistics (under mu) */
    uint64_t moved, ask, refreshes, conn_errors, tryagain, commands;
};

/* The calling thread's deadline (kvr__rc_set_deadline), 0 = none. */
static _Thread_local uint64_t tl_deadline;

void kvr__rc_set_deadline(uint64_t deadline_ms)
{
    tl_deadline = deadline_ms;
}

/* The earlier of two deadlines (0 = none). */
static uint64_t dl_min(uint64_t a, uint64_t b)
{
    return !a ? b : !b ? a : a < b ? a : b;
}

/* Milliseconds left before deadline, at most cap (cap if no deadline); 0
 * once it has passed. */
static int dl_left(uint64_t deadline, int cap)
{
    if (!deadline)
        return cap;
    uint64_t now = kvr_clock_mono_ms();
    if (now >= deadline)
        return 0;
    return deadline - now < (uint64_t)cap ? (int)(deadline - now) : cap;
}

static void sleep_ms(int ms)
{
    struct timespec ts = { ms / 1000, (long)(ms % 1000) * 1000000L };
    while (nanosleep(&ts, &ts) < 0 && errno == EINTR) {
    }
}

/* ---- slots ------------------------------------------------------------- */

/* Table-driven (a probe hashes hundreds of keys per match). */
static uint16_t crc16_tab[256];
static pthread_once_t crc16_once = PTHREAD_ONCE_INIT;

static void crc16_init(void)
{
    for (unsigned i = 0; i < 256; i++) {
        uint16_t crc = (uint16_t)(i << 8);
        for (int k = 0; k < 8; k++)
            crc = (crc & 0x8000) ? (uint16_t)((crc << 1) ^ 0x1021) : (uint16_t)(crc << 1);
        crc16_tab[i] = crc;
    }
}

uint16_t kvr__rc_crc16(const void *p, size_t n)
{
    pthread_once(&crc16_once, crc16_init);
    const uint8_t *b = p;
    uint16_t crc = 0;
    for (size_t i = 0; i < n; i++)
        crc = (uint16_t)((crc << 8) ^ crc16_tab[((crc >> 8) ^ b[i]) & 0xFF]);
    return crc;
}

unsigned kvr__rc_key_slot(const void *key, size_t n)
{
    const char *k = key;
    size_t s, e;
    for (s = 0; s < n; s++)
        if (k[s] == '{')
            break;
    if (s < n) {
        for (e = s + 1; e < n; e++)
            if (k[e] == '}')
                break;
        if (e < n && e != s + 1)
            return kvr__rc_crc16(k + s + 1, e - s - 1) & (KVR_RC_SLOTS - 1);
    }
    return kvr__rc_crc16(k, n) & (KVR_RC_SLOTS - 1);
}

int kvr__rc_parse_redirect(const char *s, size_t n, bool *is_ask, unsigned *slot, char *host,
                          size_t hcap, int *port)
{
    char buf[160];
    if (n >= sizeof buf)
        return KVR_EINVAL;
    memcpy(buf, s, n);
    buf[n] = '\0';
    const char *p;
    if (!strncmp(buf, "MOVED ", 6)) {
        *is_ask = false;
        p = buf + 6;
    } else if (!strncmp(buf, "ASK ", 4)) {
        *is_ask = true;
        p = buf + 4;
    } else {
        return KVR_EINVAL;
    }
    char *end;
    errno = 0;
    unsigned long sl = strtoul(p, &end, 10);
    if (errno || end == p || *end != ' ' || sl >= KVR_RC_SLOTS)
        return KVR_EINVAL;
    p = end + 1;
    const char *colon = strrchr(p, ':');
    if (!colon || colon == p || (size_t)(colon - p) >= hcap)
        return KVR_EINVAL;
    long pt = strtol(colon + 1, &end, 10);
    if (*end || end == colon + 1 || pt <= 0 || pt > 65535)
        return KVR_EINVAL;
    memcpy(host, p, (size_t)(colon - p));
    host[colon - p] = '\0';
    *slot = (unsigned)sl;
    *port = (int)pt;
    return 0;
}

int kvr__rc_parse_seeds(const char *s, char hosts[][64], int *ports, int cap, kvr_error *err)
{
    int n = 0;
    if (!strncmp(s, "redis://", 8))
        s += 8;
    while (*s) {
        const char *e = strchr(s, ',');
        size_t len = e ? (size_t)(e - s) : strlen(s);
        char one[128];
        if (len == 0 || len >= sizeof one) {
            kvr_error_set(err, KVR_EINVAL, "--remote-tier: empty or too long entry in '%s'", s);
            return KVR_EINVAL;
        }
        memcpy(one, s, len);
        one[len] = '\0';
        char *o = one;
        if (!strncmp(o, "redis://", 8))
            o += 8;
        char *colon = strrchr(o, ':');
        char *end = NULL;
        long pt = colon ? strtol(colon + 1, &end, 10) : 0;
        if (!colon || colon == o || !end || *end || pt <= 0 || pt > 65535 ||
            (size_t)(colon - o) >= 64) {
            kvr_error_set(err, KVR_EINVAL, "--remote-tier: '%s' is not HOST:PORT", one);
            return KVR_EINVAL;
        }
        if (n == cap) {
            kvr_error_set(err, KVR_EINVAL, "--remote-tier: more than %d seed nodes", cap);
            return KVR_EINVAL;
        }
        memcpy(hosts[n], o, (size_t)(colon - o));
        hosts[n][colon - o] = '\0';
        ports[n] = (int)pt;
        n++;
        s += len;
        if (*s == ',')
            s++;
    }
    if (n == 0) {
        kvr_error_set(err, KVR_EINVAL, "--remote-tier: no seed node given");
        return KVR_EINVAL;
    }
    return n;
}

/* ---- nodes and connections ------------------------------------------- */

/* rc->mu held. Index of host:port, adding it if new; -1 if the table is full. */
static int node_index_locked(kvr_rc *rc, const char *host, int port)
{
    for (int i = 0; i < rc->n_nodes; i++)
        if (rc->nodes[i]->port == port && !strcmp(rc->nodes[i]->host, host))
            return i;
    if (rc->n_nodes == KVR_RC_MAX_NODES)
        return -1;
    rc_node *nd = calloc(1, sizeof *nd);
    if (!nd)
        return -1;
    snprintf(nd->host, sizeof nd->host, "%s", host);
    nd->port = port;
    pthread_mutex_init(&nd->mu, NULL);
    rc->nodes[rc->n_nodes] = nd;
    return rc->n_nodes++;
}

static int node_index(kvr_rc *rc, const char *host, int port)
{
    pthread_mutex_lock(&rc->mu);
    int i = node_index_locked(rc, host, port);
    pthread_mutex_unlock(&rc->mu);
    return i;
}

static rc_node *node_at(kvr_rc *rc, int i)
{
    pthread_mutex_lock(&rc->mu);
    rc_node *nd = i >= 0 && i < rc->n_nodes ? rc->nodes[i] : NULL;
    pthread_mutex_unlock(&rc->mu);
    return nd;
}

static void count(kvr_rc *rc, uint64_t *field)
{
    pthread_mutex_lock(&rc->mu);
    (*field)++;
    pthread_mutex_unlock(&rc->mu);
}

static struct timeval tv_ms(int ms)
{
    struct timeval tv = { ms / 1000, (long)(ms % 1000) * 1000L };
    return tv;
}

/* A connection to host:port, authenticated, within deadline. NULL with
 * err filled: code KVR_EUNAUTH if the node refused the credentials, else
 * KVR_EIO. */
static redisContext *connect_to(kvr_rc *rc, const char *host, int port, kvr_error *err,
                                uint64_t deadline)
{
    int cms = dl_left(deadline, rc->connect_ms);
    if (cms == 0) {
        kvr_error_set(err, KVR_EIO, "%s:%d: the deadline passed", host, port);
        return NULL;
    }
    redisContext *x = redisConnectWithTimeout(host, port, tv_ms(cms));
    if (!x || x->err) {
        kvr_error_set(err, KVR_EIO, "cannot connect to %s:%d: %s", host, port,
                      x ? x->errstr : "out of memory");
        if (x)
            redisFree(x);
        return NULL;
    }
    int ims = dl_left(deadline, rc->io_ms);
    if (ims == 0) {
        kvr_error_set(err, KVR_EIO, "%s:%d: the deadline passed", host, port);
        redisFree(x);
        return NULL;
    }
    redisSetTimeout(x, tv_ms(ims));
    if (rc->auth) {
        redisReply *r;
        if (rc->user[0])
            r = redisCommand(x, "AUTH %s %s", rc->user, rc->password);
        else
            r = redisCommand(x, "AUTH %s", rc->password);
        if (!r) {
            kvr_error_set(err, KVR_EIO, "%s:%d: AUTH: %s", host, port, x->errstr);
            redisFree(x);
            return NULL;
        }
        if (r->type == REDIS_REPLY_ERROR) {
            kvr_error_set(err, KVR_EUNAUTH, "%s:%d refused AUTH%s%s: %s", host, port,
                          rc->user[0] ? " of user " : "", rc->user, r->str);
            freeReplyObject(r);
            redisFree(x);
            return NULL;
        }
        freeReplyObject(r);
    }
    return x;
}

/* A pooled or new connection to nd whose socket timeouts end by deadline
 * (the I/O timeout at most). */
static redisContext *node_get(kvr_rc *rc, rc_node *nd, kvr_error *err, uint64_t deadline)
{
    int ims = dl_left(deadline, rc->io_ms);
    if (ims == 0) {
        kvr_error_set(err, KVR_EIO, "%s:%d: the deadline passed", nd->host, nd->port);
        return NULL;
    }
    pthread_mutex_lock(&nd->mu);
    redisContext *x = nd->n_idle ? nd->idle[--nd->n_idle] : NULL;
    pthread_mutex_unlock(&nd->mu);
    if (x) {
        redisSetTimeout(x, tv_ms(ims));
        return x;
    }
    x = connect_to(rc, nd->host, nd->port, err, deadline);
    if (!x)
        count(rc, &rc->conn_errors);
    return x;
}

/* Returns x to the pool if it is healthy, else closes it. */
static void node_put(rc_node *nd, redisContext *x, bool healthy)
{
    if (!x)
        return;
    if (healthy && !x->err) {
        pthread_mutex_lock(&nd->mu);
        if (nd->n_idle < POOL_MAX) {
            nd->idle[nd->n_idle++] = x;
            x = NULL;
        }
        pthread_mutex_unlock(&nd->mu);
    }
    if (x)
        redisFree(x);
}

/* ---- the slot map ------------------------------------------------------ */

/* Applies a CLUSTER SLOTS reply; 0 if it covers every slot. */
static int apply_slots(kvr_rc *rc, const redisReply *r)
{
    if (r->type != REDIS_REPLY_ARRAY)
        return KVR_EIO;
    int16_t *map = malloc(sizeof(int16_t) * KVR_RC_SLOTS);
    if (!map)
        return KVR_ENOMEM;
    for (unsigned i = 0; i < KVR_RC_SLOTS; i++)
        map[i] = -1;
    unsigned covered = 0, masters = 0;
    pthread_mutex_lock(&rc->mu);
    for (size_t i = 0; i < r->elements; i++) {
        const redisReply *e = r->element[i];
        if (e->type != REDIS_REPLY_ARRAY || e->elements < 3 ||
            e->element[0]->type != REDIS_REPLY_INTEGER ||
            e->element[1]->type != REDIS_REPLY_INTEGER ||
            e->element[2]->type != REDIS_REPLY_ARRAY || e->element[2]->elements < 2)
            continue;
        long long lo = e->element[0]->integer, hi = e->element[1]->integer;
        const redisReply *m = e->element[2];
        if (lo < 0 || hi >= KVR_RC_SLOTS || lo > hi || m->element[0]->type != REDIS_REPLY_STRING ||
            m->element[1]->type != REDIS_REPLY_INTEGER)
            continue;
        int idx = node_index_locked(rc, m->element[0]->str, (int)m->element[1]->integer);
        if (idx < 0)
            continue;
        masters++;
        for (long long s = lo; s <= hi; s++) {
            if (map[s] < 0)
                covered++;
            map[s] = (int16_t)idx;
        }
    }
    bool full = covered == KVR_RC_SLOTS;
    if (full) {
        memcpy(rc->slots, map, sizeof(int16_t) * KVR_RC_SLOTS);
        rc->have_map = true;
        rc->n_masters = masters;   /* slot ranges; a master may own several */
    }
    rc->refreshes++;
    pthread_mutex_unlock(&rc->mu);
    free(map);
    return full ? 0 : KVR_EIO;
}

/* Tries the known nodes (those the map used first), then the seeds, until
 * deadline. */
static int refresh_now(kvr_rc *rc, kvr_error *err, uint64_t deadline)
{
    char hosts[KVR_RC_MAX_NODES + KVR_RC_MAX_SEEDS][64];
    int ports[KVR_RC_MAX_NODES + KVR_RC_MAX_SEEDS];
    int n = 0;
    pthread_mutex_lock(&rc->mu);
    for (int i = 0; i < rc->n_nodes; i++) {
        snprintf(hosts[n], 64, "%s", rc->nodes[i]->host);
        ports[n++] = rc->nodes[i]->port;
    }
    pthread_mutex_unlock(&rc->mu);
    for (int i = 0; i < rc->n_seeds; i++) {
        snprintf(hosts[n], 64, "%s", rc->seed_host[i]);
        ports[n++] = rc->seed_port[i];
    }
    kvr_error last = { 0 };
    kvr_error_set(&last, KVR_EIO, "no seed node");
    int rc_auth = 0;
    for (int i = 0; i < n; i++) {
        kvr_error e = { 0 };
        if (deadline && kvr_clock_mono_ms() >= deadline) {
            kvr_error_set(&last, KVR_EIO, "no node answered CLUSTER SLOTS before the deadline "
                          "(last: %.300s)", last.msg);
            break;
        }
        redisContext *x = connect_to(rc, hosts[i], ports[i], &e, deadline);
        if (!x) {
            if (e.code == KVR_EUNAUTH)
                rc_auth = KVR_EUNAUTH;
            last = e;
            continue;
        }
        redisReply *r = redisCommand(x, "CLUSTER SLOTS");
        if (!r) {
            kvr_error_set(&last, KVR_EIO, "%s:%d: CLUSTER SLOTS: %s", hosts[i], ports[i],
                          x->errstr);
            redisFree(x);
            continue;
        }
        int a = r->type == REDIS_REPLY_ERROR ? KVR_EIO : apply_slots(rc, r);
        if (a < 0)
            kvr_error_set(&last, KVR_EIO, "%s:%d: %s", hosts[i], ports[i],
                          r->type == REDIS_REPLY_ERROR ? r->str
                                                       : "the cluster does not cover every slot yet");
        freeReplyObject(r);
        redisFree(x);
        if (a == 0)
            return 0;
    }
    if (err)
        *err = last;
    if (rc_auth && err) {
        err->code = KVR_EUNAUTH;
        return KVR_EUNAUTH;
    }
    return KVR_EIO;
}

int kvr__rc_refresh(kvr_rc *rc, kvr_error *err)
{
    uint64_t deadline = tl_deadline;
    if (deadline) {
        /* Never wait for another thread's refresh past our deadline. */
        if (pthread_mutex_trylock(&rc->refresh_mu) != 0) {
            kvr_error_set(err, KVR_EIO, "a slot map refresh is in progress");
            return KVR_EIO;
        }
    } else {
        pthread_mutex_lock(&rc->refresh_mu);
    }
    int r = refresh_now(rc, err, deadline);
    pthread_mutex_lock(&rc->mu);
    rc->last_refresh_ms = kvr_clock_mono_ms();
    pthread_mutex_unlock(&rc->mu);
    pthread_mutex_unlock(&rc->refresh_mu);
    return r;
}

/* A refresh from a failure path, at most every REFRESH_MIN_MS, within
 * deadline: a caller that finds one in progress does not wait for it (it
 * retries with the map it has, which the refresh then updates). */
static void refresh_soon(kvr_rc *rc, uint64_t deadline)
{
    uint64_t t0 = kvr_clock_mono_ms();
    if (pthread_mutex_trylock(&rc->refresh_mu) != 0)
        return;
    pthread_mutex_lock(&rc->mu);
    bool recent = rc->last_refresh_ms >= t0 ||
                  (rc->last_refresh_ms && t0 - rc->last_refresh_ms < REFRESH_MIN_MS);
    pthread_mutex_unlock(&rc->mu);
    if (!recent) {
        refresh_now(rc, NULL, deadline);
        pthread_mutex_lock(&rc->mu);
        rc->last_refresh_ms = kvr_clock_mono_ms();
        pthread_mutex_unlock(&rc->mu);
    }
    pthread_mutex_unlock(&rc->refresh_mu);
}

static int slot_node(kvr_rc *rc, unsigned slot)
{
    pthread_mutex_lock(&rc->mu);
    int i = rc->have_map ? rc->slots[slot] : -1;
    pthread_mutex_unlock(&rc->mu);
    return i;
}

/* ---- commands ---------------------------------------------------------- */

static bool err_is(const redisReply *r, const char *prefix)
{
    return r->type == REDIS_REPLY_ERROR && !strncmp(r->str, prefix, strlen(prefix));
}

/* Retries until deadline (the retry budget); every step's I/O ends by the
 * thread's deadline (tl_deadline) too, which deadline never passes. */
static int command_until(kvr_rc *rc, int argc, const char **argv, const size_t *argvlen,
                         redisReply **out, kvr_error *err, uint64_t deadline)
{
    *out = NULL;
    unsigned slot = kvr__rc_key_slot(argv[1], argvlen[1]);
    int ask_node = -1, redirects = 0, backoff = 10;
    kvr_error last = { 0 };
    kvr_error_set(&last, KVR_EIO, "remote tier: no reachable node serves slot %u", slot);
    count(rc, &rc->commands);
    for (;;) {
        int idx = ask_node >= 0 ? ask_node : slot_node(rc, slot);
        bool asking = ask_node >= 0;
        ask_node = -1;
        bool retry_now = false;
        if (idx < 0) {
            refresh_soon(rc, tl_deadline);
            idx = slot_node(rc, slot);
        }
        rc_node *nd = node_at(rc, idx);
        if (nd) {
            kvr_error ce = { 0 };
            redisContext *x = node_get(rc, nd, &ce, tl_deadline);
            if (!x) {
                last = ce;
                if (ce.code == KVR_EUNAUTH) {
                    if (err)
                        *err = ce;
                    return KVR_EUNAUTH;
                }
                refresh_soon(rc, tl_deadline);
            } else {
                redisReply *r = NULL;
                bool ok = true;
                if (asking) {
                    redisAppendCommand(x, "ASKING");
                    redisAppendCommandArgv(x, argc, argv, argvlen);
                    redisReply *a = NULL;
                    ok = redisGetReply(x, (void **)&a) == REDIS_OK;
                    if (a)
                        freeReplyObject(a);
                    ok = ok && redisGetReply(x, (void **)&r) == REDIS_OK;
                } else {
                    r = redisCommandArgv(x, argc, argv, argvlen);
                    ok = r != NULL;
                }
                if (!ok || !r) {
                    kvr_error_set(&last, KVR_EIO, "%s:%d: %s", nd->host, nd->port,
                                  x->errstr[0] ? x->errstr : "no reply");
                    if (r)
                        freeReplyObject(r);
                    node_put(nd, x, false);
                    count(rc, &rc->conn_errors);
                    refresh_soon(rc, tl_deadline);
                } else if (r->type != REDIS_REPLY_ERROR) {
                    node_put(nd, x, true);
                    *out = r;
                    return 0;
                } else {
                    node_put(nd, x, true);
                    bool is_ask;
                    unsigned rs;
                    char host[64];
                    int port;
                    if (kvr__rc_parse_redirect(r->str, r->len, &is_ask, &rs, host, sizeof host,
                                              &port) == 0) {
                        int ni = node_index(rc, host, port);
                        if (is_ask) {
                            count(rc, &rc->ask);
                            ask_node = ni;
                        } else {
                            count(rc, &rc->moved);
                            pthread_mutex_lock(&rc->mu);
                            if (ni >= 0 && rc->have_map)
                                rc->slots[rs] = (int16_t)ni;
                            pthread_mutex_unlock(&rc->mu);
                            refresh_soon(rc, tl_deadline);
                        }
                        kvr_error_set(&last, KVR_EIO, "too many redirects (last: %s)", r->str);
                        freeReplyObject(r);
                        if (++redirects > MAX_REDIRECTS) {
                            if (err)
                                *err = last;
                            return KVR_EIO;
                        }
                        retry_now = true;
                    } else if (err_is(r, "TRYAGAIN") || err_is(r, "CLUSTERDOWN") ||
                               err_is(r, "LOADING") || err_is(r, "MASTERDOWN")) {
                        count(rc, &rc->tryagain);
                        kvr_error_set(&last, KVR_EIO, "%s:%d: %s", nd->host, nd->port, r->str);
                        freeReplyObject(r);
                        refresh_soon(rc, tl_deadline);
                    } else {
                        int code = err_is(r, "NOAUTH") || err_is(r, "WRONGPASS") ||
                                           err_is(r, "NOPERM")
                                       ? KVR_EUNAUTH
                                       : KVR_EIO;
                        kvr_error_set(err, code, "%s:%d: %s", nd->host, nd->port, r->str);
                        freeReplyObject(r);
                        return code;
                    }
                }
            }
        }
        if (retry_now)
            continue;
        int left = dl_left(deadline, backoff);
        if (left == 0)
            break;
        sleep_ms(left);
        if (backoff < 200)
            backoff *= 2;
    }
    if (err)
        *err = last;
    return KVR_EIO;
}

int kvr__rc_command(kvr_rc *rc, int argc, const char **argv, const size_t *argvlen,
                   redisReply **out, kvr_error *err)
{
    return command_until(rc, argc, argv, argvlen, out, err,
                         dl_min(kvr_clock_mono_ms() + (uint64_t)rc->retry_ms, tl_deadline));
}

/* One node's share of a batch: a pipeline on one connection. Each part
 * touches only its own commands' entries of done[] and out[]. */
typedef struct batch_part {
    kvr_rc           *rc;
    int               idx;          /* node index */
    size_t           *ix;           /* its commands */
    size_t            nix;
    const kvr_rc_cmd *cmds;
    bool             *done;
    redisReply      **out;          /* NULL: cb consumes */
    kvr_rc_reply_fn   cb;
    const kvr_rc_sink *sink;        /* non-NULL: replies read straight into it */
    void             *ud;
    size_t            ok;
    uint64_t          deadline;     /* the calling thread's (0: none) */
    redisContext     *x;            /* between part_send and part_recv */
    bool              healthy;
    pthread_t         th;
    bool              threaded;
} batch_part;

/* A hiredis reply handed to a sink as if it had been read into it. */
static bool sink_reply(const kvr_rc_sink *k, void *ud, size_t j, const redisReply *r)
{
    if (r->type != REDIS_REPLY_STRING)
        return k->end(ud, j, false);
    size_t len = (size_t)r->len;
    bool want = k->begin(ud, j, len);
    for (size_t off = 0; want && off < len;) {
        size_t cap = len - off;
        uint8_t *d = k->span(ud, j, off, &cap);
        if (cap == 0 || cap > len - off)
            cap = len - off;
        if (d)
            memcpy(d, r->str + off, cap);
        k->got(ud, j, off, d ? d : (const uint8_t *)r->str + off, cap);
        off += cap;
    }
    return k->end(ud, j, true);
}

static bool deliver(batch_part *p, size_t j, redisReply *r)
{
    if (p->sink) {
        bool keep = sink_reply(p->sink, p->ud, j, r);
        freeReplyObject(r);
        return keep;
    }
    if (p->cb) {
        bool keep = p->cb(p->ud, j, r);
        freeReplyObject(r);
        return keep;
    }
    p->out[j] = r;
    return true;
}

/* ---- replies read straight from the socket (kvr__rc_batch_sink) -------- */

#define RD_BUF 16384

typedef struct rd {
    int     fd;
    uint64_t deadline;          /* every read ends by then (0: none) */
    uint8_t buf[RD_BUF];       /* reply headers (and whatever came with them) */
    size_t  pos, len;
} rd;

/* read(2) with the connection's timeout (SO_RCVTIMEO) and, with a
 * deadline, only once poll says bytes are there before it: > 0 bytes, or
 * -1. */
static ssize_t rd_sys(const rd *b, void *p, size_t n)
{
    int fd = b->fd;
    for (;;) {
        if (b->deadline) {
            int left = dl_left(b->deadline, INT32_MAX);
            struct pollfd pf = { .fd = fd, .events = POLLIN };
            int pr = left ? poll(&pf, 1, left) : 0;
            if (pr < 0 && errno == EINTR)
                continue;
            if (pr <= 0)
                return -1;       /* the deadline passed */
        }
        ssize_t k = read(fd, p, n);
        if (k > 0)
            return k;
        if (k < 0 && errno == EINTR)
            continue;
        return -1;               /* EOF, timeout (EAGAIN) or an error */
    }
}

/* The next "\r\n"-terminated line (without it, NUL-terminated in place);
 * NULL if the connection failed or the line is absurdly long. */
static char *rd_line(rd *b)
{
    for (;;) {
        for (size_t i = b->pos; i + 1 < b->len; i++)
            if (b->buf[i] == '\r' && b->buf[i + 1] == '\n') {
                char *line = (char *)b->buf + b->pos;
                b->buf[i] = '\0';
                b->pos = i + 2;
                return line;
            }
        if (b->pos > 0) {
            memmove(b->buf, b->buf + b->pos, b->len - b->pos);
            b->len -= b->pos;
            b->pos = 0;
        }
        if (b->len >= RD_BUF - 1)
            return NULL;
        ssize_t k = rd_sys(b, b->buf + b->len, RD_BUF - 1 - b->len);
        if (k < 0)
            return NULL;
        b->len += (size_t)k;
    }
}

/* Reads a bulk string's len bytes and its "\r\n" into the sink. */
static bool rd_bulk(rd *b, const kvr_rc_sink *k, void *ud, size_t j, size_t len)
{
    bool want = k->begin(ud, j, len);
    uint8_t scratch[4096];
    size_t off = 0;
    while (off < len) {
        size_t cap = len - off;
        uint8_t *d = want ? k->span(ud, j, off, &cap) : NULL;
        if (cap == 0 || cap > len - off)
            cap = len - off;
        uint8_t *to = d;
        if (!to) {
            to = scratch;
            if (cap > sizeof scratch)
                cap = sizeof scratch;
        }
        size_t n;
        if (b->pos < b->len) {           /* what came with the header first */
            n = b->len - b->pos < cap ? b->len - b->pos : cap;
            memcpy(to, b->buf + b->pos, n);
            b->pos += n;
        } else {
            ssize_t r = rd_sys(b, to, cap);
            if (r < 0)
                return false;
            n = (size_t)r;
        }
        if (want)
            k->got(ud, j, off, to, n);
        off += n;
    }
    /* The terminating CRLF. */
    while (b->len - b->pos < 2) {
        if (b->pos > 0) {
            memmove(b->buf, b->buf + b->pos, b->len - b->pos);
            b->len -= b->pos;
            b->pos = 0;
        }
        ssize_t r = rd_sys(b, b->buf + b->len, RD_BUF - 1 - b->len);
        if (r < 0)
            return false;
        b->len += (size_t)r;
    }
    if (b->buf[b->pos] != '\r' || b->buf[b->pos + 1] != '\n')
        return false;
    b->pos += 2;
    return true;
}

/* One node's pipeline with its replies read by rd_*: the connection is
 * healthy afterwards only if every reply was read whole. */
static void *run_part_sink(void *arg)
{
    batch_part *p = arg;
    kvr_rc *rc = p->rc;
    rc_node *nd = node_at(rc, p->idx);
    redisContext *x = nd ? node_get(rc, nd, NULL, p->deadline) : NULL;
    if (!x)
        return NULL;
    /* hiredis never reads ahead of a reply it was asked for, so a pooled
     * connection's reader is empty; if not, it is not ours to parse. */
    redisReader *rr = x->reader;
    rd *b = rr->len == rr->pos ? malloc(sizeof *b) : NULL;
    bool healthy = b != NULL;
    if (healthy) {
        b->fd = x->fd;
        b->deadline = p->deadline;
        b->pos = b->len = 0;
        for (size_t k = 0; k < p->nix; k++) {
            const kvr_rc_cmd *c = &p->cmds[p->ix[k]];
            redisAppendCommandArgv(x, c->argc, c->argv, c->argvlen);
        }
        int wdone = 0;
        while (healthy && !wdone)
            healthy = redisBufferWrite(x, &wdone) == REDIS_OK;
    }
    for (size_t k = 0; k < p->nix && healthy; k++) {
        size_t j = p->ix[k];
        char *line = rd_line(b);
        if (!line) {
            healthy = false;
            break;
        }
        if (line[0] == '$') {
            char *end;
            errno = 0;
            long long len = strtoll(line + 1, &end, 10);
            if (errno || *end || len < -1) {
                healthy = false;
                break;
            }
            if (len == -1) {
                p->done[j] = true;
                if (p->sink->end(p->ud, j, false))
                    p->ok++;
                continue;
            }
            if (!rd_bulk(b, p->sink, p->ud, j, (size_t)len)) {
                healthy = false;          /* retried one by one */
                break;
            }
            p->done[j] = true;
            if (p->sink->end(p->ud, j, true))
                p->ok++;
        } else if (line[0] == '-') {
            continue;                      /* redirect or failure: one by one */
        } else if (line[0] == '+' || line[0] == ':') {
            p->done[j] = true;
            if (p->sink->end(p->ud, j, false))
                p->ok++;
        } else {
            healthy = false;               /* not a reply to a GET */
        }
    }
    if (!healthy)
        count(rc, &rc->conn_errors);
    /* Nothing may be left unread: the next user of the connection would
     * take it for its own reply. */
    if (b && healthy && b->pos != b->len)
        healthy = false;
    free(b);
    node_put(nd, x, healthy);
    return NULL;
}

/* A part in two halves: send its pipeline (part_send), then read its
 * replies (part_recv). Small batches send every node's pipeline first and
 * then read them in turn, on this thread: the nodes work at once and no
 * thread is started (a probe of hundreds of EXISTS). */
static void part_send(batch_part *p)
{
    rc_node *nd = node_at(p->rc, p->idx);
    p->x = nd ? node_get(p->rc, nd, NULL, p->deadline) : NULL;
    if (!p->x)
        return;                      /* all left to the one-by-one path */
    for (size_t k = 0; k < p->nix; k++) {
        const kvr_rc_cmd *c = &p->cmds[p->ix[k]];
        redisAppendCommandArgv(p->x, c->argc, c->argv, c->argvlen);
    }
    int wdone = 0;
    p->healthy = true;
    while (p->healthy && !wdone)
        p->healthy = redisBufferWrite(p->x, &wdone) == REDIS_OK;
}

static void part_recv(batch_part *p)
{
    kvr_rc *rc = p->rc;
    redisContext *x = p->x;
    if (!x)
        return;
    bool healthy = p->healthy;
    uint64_t set_ms = kvr_clock_mono_ms();          /* node_get set the timeouts */
    for (size_t k = 0; k < p->nix && healthy; k++) {
        size_t j = p->ix[k];
        redisReply *r = NULL;
        if (p->deadline) {
            /* Each reply by the deadline: the socket timeouts shrink with
             * what is left, reset at most every DL_RESET_MS (a probe reads
             * hundreds of small replies; two setsockopt calls each would
             * cost more than the replies), so at most that late. */
            uint64_t now = kvr_clock_mono_ms();
            if (now >= p->deadline) {
                healthy = false;
                break;
            }
            if (now - set_ms >= DL_RESET_MS) {
                redisSetTimeout(x, tv_ms(dl_left(p->deadline, rc->io_ms)));
                set_ms = now;
            }
        }
        if (redisGetReply(x, (void **)&r) != REDIS_OK || !r) {
            healthy = false;
            break;
        }
        if (r->type == REDIS_REPLY_ERROR) {
            freeReplyObject(r);     /* redirect or failure: one by one */
            continue;
        }
        p->done[j] = true;
        if (deliver(p, j, r))
            p->ok++;
    }
    if (!healthy)
        count(rc, &rc->conn_errors);
    node_put(node_at(rc, p->idx), x, healthy);
    p->x = NULL;
}

static void *run_part(void *arg)
{
    batch_part *p = arg;
    if (p->sink)
        return run_part_sink(arg);
    part_send(p);
    part_recv(p);
    return NULL;
}

#define FANOUT_MAX_BYTES (256u << 10)    /* below: no threads */

static size_t batch_run(kvr_rc *rc, size_t n, const kvr_rc_cmd *cmds, redisReply **out,
                        kvr_rc_reply_fn cb, const kvr_rc_sink *sink, void *ud)
{
    /* One retry budget for the whole batch, not one per command. */
    uint64_t deadline = dl_min(kvr_clock_mono_ms() + (uint64_t)rc->retry_ms, tl_deadline);
    if (n == 0)
        return 0;
    for (size_t i = 0; out && i < n; i++)
        out[i] = NULL;
    int *node = malloc(n * sizeof *node);
    size_t *ix = malloc(n * sizeof *ix);
    bool *done = calloc(n, sizeof *done);
    batch_part *parts = calloc(KVR_RC_MAX_NODES, sizeof *parts);
    if (!node || !ix || !done || !parts) {
        free(node);
        free(ix);
        free(done);
        free(parts);
        return 0;
    }
    int np = 0;
    for (size_t i = 0; i < n; i++) {
        node[i] = slot_node(rc, kvr__rc_key_slot(cmds[i].argv[1], cmds[i].argvlen[1]));
        int k;
        for (k = 0; k < np && parts[k].idx != node[i]; k++) {
        }
        if (node[i] >= 0 && k == np)
            parts[np++] = (batch_part){ .rc = rc, .idx = node[i], .cmds = cmds, .done = done,
                                        .out = out, .cb = cb, .sink = sink, .ud = ud,
                                        .deadline = tl_deadline };
    }
    /* Each part's commands, in order, in one array. */
    size_t at = 0;
    for (int k = 0; k < np; k++) {
        parts[k].ix = ix + at;
        for (size_t i = 0; i < n; i++)
            if (node[i] == parts[k].idx)
                ix[at++] = i;
        parts[k].nix = (size_t)(ix + at - parts[k].ix);
    }
    /* The nodes' pipelines run at once: one thread per node but the last,
     * which runs here (large values then arrive from every master in
     * parallel, and each thread checks what it received while it is hot). */
    size_t bytes = 0;
    for (size_t i = 0; !sink && i < n; i++)
        for (int a = 0; a < cmds[i].argc; a++)
            bytes += cmds[i].argvlen[a];
    if (!sink && bytes < FANOUT_MAX_BYTES) {
        for (int k = 0; k < np; k++)
            part_send(&parts[k]);
        for (int k = 0; k < np; k++)
            part_recv(&parts[k]);
    } else {
        for (int k = 0; k + 1 < np; k++)
            parts[k].threaded = pthread_create(&parts[k].th, NULL, run_part, &parts[k]) == 0;
        for (int k = 0; k < np; k++)
            if (!parts[k].threaded)
                run_part(&parts[k]);
    }
    size_t ok = 0;
    for (int k = 0; k < np; k++) {
        if (parts[k].threaded)
            pthread_join(parts[k].th, NULL);
        ok += parts[k].ok;
    }
    batch_part one = { .rc = rc, .idx = -1, .cmds = cmds, .done = done, .out = out, .cb = cb,
                       .sink = sink, .ud = ud };
    for (size_t i = 0; i < n; i++) {
        if (done[i])
            continue;
        redisReply *r;
        if (command_until(rc, cmds[i].argc, cmds[i].argv, cmds[i].argvlen, &r, NULL,
                          deadline) == 0 && deliver(&one, i, r))
            ok++;
    }
    pthread_mutex_lock(&rc->mu);
    rc->commands += n;
    pthread_mutex_unlock(&rc->mu);
    free(node);
    free(ix);
    free(done);
    free(parts);
    return ok;
}

size_t kvr__rc_batch_cb(kvr_rc *rc, size_t n, const kvr_rc_cmd *cmds, redisReply **out,
                       kvr_rc_reply_fn cb, void *ud)
{
    return batch_run(rc, n, cmds, out, cb, NULL, ud);
}

size_t kvr__rc_batch_sink(kvr_rc *rc, size_t n, const kvr_rc_cmd *cmds, const kvr_rc_sink *sink,
                         void *ud)
{
    return batch_run(rc, n, cmds, NULL, NULL, sink, ud);
}

size_t kvr__rc_batch(kvr_rc *rc, size_t n, const kvr_rc_cmd *cmds, redisReply **out)
{
    return kvr__rc_batch_cb(rc, n, cmds, out, NULL, NULL);
}

/* ---- life cycle -------------------------------------------------------- */

int kvr__rc_create(kvr_rc **out, const kvr_rc_config *cfg, kvr_error *err)
{
    *out = NULL;
    kvr_rc *rc = calloc(1, sizeof *rc);
    if (!rc) {
        kvr_error_set(err, KVR_ENOMEM, "remote tier: out of memory");
        return KVR_ENOMEM;
    }
    int n = kvr__rc_parse_seeds(cfg->seeds ? cfg->seeds : "", rc->seed_host, rc->seed_port,
                               KVR_RC_MAX_SEEDS, err);
    if (n < 0) {
        free(rc);
        return n;
    }
    rc->n_seeds = n;
    if (cfg->password && cfg->password[0]) {
        rc->auth = true;
        snprintf(rc->password, sizeof rc->password, "%s", cfg->password);
        snprintf(rc->user, sizeof rc->user, "%s", cfg->user ? cfg->user : "");
    }
    rc->connect_ms = cfg->connect_timeout_ms > 0 ? cfg->connect_timeout_ms : 500;
    rc->io_ms = cfg->io_timeout_ms > 0 ? cfg->io_timeout_ms : 5000;
    rc->retry_ms = cfg->retry_ms > 0 ? cfg->retry_ms : 3000;
    pthread_mutex_init(&rc->mu, NULL);
    pthread_mutex_init(&rc->refresh_mu, NULL);
    for (unsigned i = 0; i < KVR_RC_SLOTS; i++)
        rc->slots[i] = -1;
    *out = rc;
    return 0;
}

void kvr__rc_destroy(kvr_rc *rc)
{
    if (!rc)
        return;
    for (int i = 0; i < rc->n_nodes; i++) {
        rc_node *nd = rc->nodes[i];
        for (int k = 0; k < nd->n_idle; k++)
            redisFree(nd->idle[k]);
        pthread_mutex_destroy(&nd->mu);
        free(nd);
    }
    pthread_mutex_destroy(&rc->mu);
    pthread_mutex_destroy(&rc->refresh_mu);
    memset(rc->password, 0, sizeof rc->password);
    free(rc);
}

void kvr__rc_get_stats(kvr_rc *rc, kvr_rc_stats *o)
{
    pthread_mutex_lock(&rc->mu);
    o->moved = rc->moved;
    o->ask = rc->ask;
    o->refreshes = rc->refreshes;
    o->conn_errors = rc->conn_errors;
    o->tryagain = rc->tryagain;
    o->commands = rc->commands;
    o->n_masters = rc->n_masters;
    o->have_map = rc->have_map;
    pthread_mutex_unlock(&rc->mu);
}
