/*
 * test_daemon_rcluster.c — the Redis Cluster client (daemon/rcluster.c):
 * CRC16 and hash-tag slots against the Redis Cluster specification's
 * reference values and against a real cluster's CLUSTER KEYSLOT, redirect
 * and seed parsing, and against a 3+3 loopback cluster: routing, pipelined
 * batches, ASK during a slot migration and MOVED after it, ACL auth (and a
 * wrong password), an unreachable seed list; replies read straight into
 * caller memory (kvr__rc_batch_sink) at sizes around its buffer, through an
 * ASK; the 3-lane CRC32C against the table one.
 */
#include <criterion/criterion.h>

#include "daemon/rcluster.h"
#include "base/crc32c.h"
#include "tests/common/kvr_cluster.h"

Test(rcluster, crc16_reference)
{
    /* The specification's reference: CRC16/XMODEM("123456789") = 0x31C3. */
    cr_assert_eq(kvr__rc_crc16("123456789", 9), 0x31C3);
    cr_assert_eq(kvr__rc_crc16("", 0), 0);
}

Test(rcluster, hash_tags)
{
    /* The specification's examples. */
    cr_assert_eq(kvr__rc_key_slot("{user1000}.following", 20),
                 kvr__rc_key_slot("{user1000}.followers", 20));
    cr_assert_eq(kvr__rc_key_slot("{user1000}.following", 20), kvr__rc_key_slot("user1000", 8));
    cr_assert_eq(kvr__rc_key_slot("foo{}{bar}", 10),
                 kvr__rc_crc16("foo{}{bar}", 10) & 16383);               /* whole key */
    cr_assert_eq(kvr__rc_key_slot("foo{{bar}}zap", 13), kvr__rc_key_slot("{bar", 4) ,
                 "'{bar' is hashed");
    cr_assert_eq(kvr__rc_key_slot("foo{{bar}}zap", 13), kvr__rc_crc16("{bar", 4) & 16383);
    cr_assert_eq(kvr__rc_key_slot("foo{bar}{zap}", 13), kvr__rc_key_slot("bar", 3));
    cr_assert_eq(kvr__rc_key_slot("foo{bar", 7), kvr__rc_crc16("foo{bar", 7) & 16383);
    /* Well-known slots (CLUSTER KEYSLOT). */
    cr_assert_eq(kvr__rc_key_slot("foo", 3), 12182);
    cr_assert_eq(kvr__rc_key_slot("bar", 3), 5061);
    cr_assert_eq(kvr__rc_key_slot("hello", 5), 866);
}

Test(rcluster, parse_redirect)
{
    bool ask;
    unsigned slot;
    char host[64];
    int port;
    const char *m = "MOVED 3999 127.0.0.1:6381";
    cr_assert_eq(kvr__rc_parse_redirect(m, strlen(m), &ask, &slot, host, sizeof host, &port), 0);
    cr_assert(!ask);
    cr_assert_eq(slot, 3999);
    cr_assert_str_eq(host, "127.0.0.1");
    cr_assert_eq(port, 6381);
    const char *a = "ASK 16383 ::1:7000";
    cr_assert_eq(kvr__rc_parse_redirect(a, strlen(a), &ask, &slot, host, sizeof host, &port), 0);
    cr_assert(ask);
    cr_assert_eq(slot, 16383);
    cr_assert_str_eq(host, "::1");
    cr_assert_eq(port, 7000);
    const char *bad[] = { "MOVED", "MOVED x 1.2.3.4:5", "MOVED 16384 h:1", "ASK 1 h:0",
                          "ASK 1 h", "ERR MOVED 1 h:1", "MOVED 1 :5", "CLUSTERDOWN" };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++)
        cr_assert_lt(kvr__rc_parse_redirect(bad[i], strlen(bad[i]), &ask, &slot, host,
                                           sizeof host, &port), 0, "%s", bad[i]);
}

Test(rcluster, parse_seeds)
{
    char h[4][64];
    int p[4];
    cr_assert_eq(kvr__rc_parse_seeds("redis://127.0.0.1:7000,localhost:7001", h, p, 4, NULL), 2);
    cr_assert_str_eq(h[0], "127.0.0.1");
    cr_assert_eq(p[1], 7001);
    cr_assert_eq(kvr__rc_parse_seeds("a:1,redis://b:2", h, p, 4, NULL), 2);
    kvr_error e = { 0 };
    cr_assert_eq(kvr__rc_parse_seeds("", h, p, 4, &e), KVR_EINVAL);
    cr_assert_eq(kvr__rc_parse_seeds("host", h, p, 4, &e), KVR_EINVAL);
    cr_assert(strstr(e.msg, "HOST:PORT"), "%s", e.msg);
    cr_assert_eq(kvr__rc_parse_seeds("h:1,,h:2", h, p, 4, NULL), KVR_EINVAL);
    cr_assert_eq(kvr__rc_parse_seeds("h:99999", h, p, 4, NULL), KVR_EINVAL);
    cr_assert_eq(kvr__rc_parse_seeds("a:1,b:2,c:3,d:4,e:5", h, p, 4, NULL), KVR_EINVAL);
}

static int set_get(kvr_rc *rc, const char *key, const char *val, char *got, size_t cap)
{
    const char *sv[] = { "SET", key, val };
    size_t sl[] = { 3, strlen(key), strlen(val) };
    redisReply *r;
    kvr_error e = { 0 };
    int x = kvr__rc_command(rc, 3, sv, sl, &r, &e);
    if (x < 0) {
        fprintf(stderr, "SET %s: %s\n", key, e.msg);
        return x;
    }
    freeReplyObject(r);
    const char *gv[] = { "GET", key };
    size_t gl[] = { 3, strlen(key) };
    x = kvr__rc_command(rc, 2, gv, gl, &r, &e);
    if (x < 0) {
        fprintf(stderr, "GET %s: %s\n", key, e.msg);
        return x;
    }
    snprintf(got, cap, "%s", r->type == REDIS_REPLY_STRING ? r->str : "(nil)");
    freeReplyObject(r);
    return 0;
}

static kvr_tcluster T;

static void cl_setup(void)
{
    cr_assert_eq(tcluster_start(&T), 0, "cluster did not start");
}

static void cl_teardown(void)
{
    tcluster_stop(&T);
}

Test(rcluster_live, routing_batch_auth, .init = cl_setup, .fini = cl_teardown, .timeout = 120)
{
    kvr_rc *rc;
    kvr_error e = { 0 };
    cr_assert_eq(kvr__rc_create(&rc, &(kvr_rc_config){ .seeds = T.seeds, .user = "kvr",
                                                     .password = "kvrpass" }, &e), 0);
    cr_assert_eq(kvr__rc_refresh(rc, &e), 0, "%s", e.msg);
    kvr_rc_stats st;
    kvr__rc_get_stats(rc, &st);
    cr_assert(st.have_map);
    cr_assert_eq(st.n_masters, 3);
    /* Our slots agree with the server's CLUSTER KEYSLOT. */
    const char *keys[] = { "a", "kvr1:b:{0123456789abcdef}", "{x}y", "foo{}{bar}", "zz{{q}}" };
    for (size_t i = 0; i < sizeof keys / sizeof *keys; i++) {
        char args[128], out[64];
        snprintf(args, sizeof args, "cluster keyslot '%s'", keys[i]);
        cr_assert_eq(tcluster_cli(&T, T.ports[0], args, out, sizeof out), 0);
        cr_assert_eq((unsigned)atoi(out), kvr__rc_key_slot(keys[i], strlen(keys[i])), "%s",
                     keys[i]);
    }
    /* 200 keys over every master, and pipelined back. */
    char key[200][32], val[200][32];
    for (int i = 0; i < 200; i++) {
        snprintf(key[i], 32, "k%d", i);
        snprintf(val[i], 32, "v%d", i * 7);
        char got[32];
        cr_assert_eq(set_get(rc, key[i], val[i], got, sizeof got), 0);
        cr_assert_str_eq(got, val[i]);
    }
    kvr_rc_cmd cmds[201];
    const char *argv[201][2];
    size_t argl[201][2];
    for (int i = 0; i < 201; i++) {
        argv[i][0] = "GET";
        argv[i][1] = i < 200 ? key[i] : "missing";
        argl[i][0] = 3;
        argl[i][1] = strlen(argv[i][1]);
        cmds[i] = (kvr_rc_cmd){ 2, argv[i], argl[i] };
    }
    redisReply *out[201];
    cr_assert_eq(kvr__rc_batch(rc, 201, cmds, out), 201);
    for (int i = 0; i < 200; i++) {
        cr_assert_eq(out[i]->type, REDIS_REPLY_STRING);
        cr_assert_str_eq(out[i]->str, val[i]);
        freeReplyObject(out[i]);
    }
    cr_assert_eq(out[200]->type, REDIS_REPLY_NIL);
    freeReplyObject(out[200]);
    kvr__rc_get_stats(rc, &st);
    cr_assert_eq(st.moved, 0);
    kvr__rc_destroy(rc);

    /* A wrong password: a clear error naming the user. */
    cr_assert_eq(kvr__rc_create(&rc, &(kvr_rc_config){ .seeds = T.seeds, .user = "kvr",
                                                     .password = "nope" }, &e), 0);
    cr_assert_eq(kvr__rc_refresh(rc, &e), KVR_EUNAUTH);
    cr_assert(strstr(e.msg, "AUTH") && strstr(e.msg, "kvr"), "%s", e.msg);
    kvr__rc_destroy(rc);

    /* Nobody listening: KVR_EIO, bounded. */
    cr_assert_eq(kvr__rc_create(&rc, &(kvr_rc_config){ .seeds = "127.0.0.1:1", .retry_ms = 300 },
                               &e), 0);
    cr_assert_eq(kvr__rc_refresh(rc, &e), KVR_EIO);
    char got[8];
    cr_assert_eq(set_get(rc, "x", "y", got, sizeof got), KVR_EIO);
    kvr__rc_destroy(rc);
}

/* ---- kvr__rc_batch_sink: replies read straight into caller memory ------- */

typedef struct tsink {
    uint8_t *buf[64];
    size_t   len[64], got[64], cap_max;
    uint32_t sum[64];           /* of what got() saw, to check it saw it all */
    int      begins[64], ends[64];
    bool     is_str[64];
} tsink;

static bool ts_begin(void *ud, size_t i, size_t len)
{
    tsink *t = ud;
    free(t->buf[i]);
    t->buf[i] = malloc(len + 1);
    t->len[i] = len;
    t->got[i] = 0;
    t->sum[i] = 0;
    t->begins[i]++;
    return true;
}

static uint8_t *ts_span(void *ud, size_t i, size_t off, size_t *cap)
{
    tsink *t = ud;
    *cap = t->len[i] - off;
    if (t->cap_max && *cap > t->cap_max)
        *cap = t->cap_max;
    return t->buf[i] + off;
}

static void ts_got(void *ud, size_t i, size_t off, const uint8_t *p, size_t n)
{
    tsink *t = ud;
    cr_assert_eq(off, t->got[i], "got() out of order");
    cr_assert_eq(p, t->buf[i] + off);
    for (size_t k = 0; k < n; k++)
        t->sum[i] = t->sum[i] * 31u + p[k];
    t->got[i] += n;
}

static bool ts_end(void *ud, size_t i, bool is_string)
{
    tsink *t = ud;
    t->ends[i]++;
    t->is_str[i] = is_string;
    return is_string;
}

static const kvr_rc_sink TS = { ts_begin, ts_span, ts_got, ts_end };

static void tsink_free(tsink *t)
{
    for (int i = 0; i < 64; i++)
        free(t->buf[i]);
    memset(t, 0, sizeof *t);
}

static uint32_t sum_of(const uint8_t *p, size_t n)
{
    uint32_t h = 0;
    for (size_t k = 0; k < n; k++)
        h = h * 31u + p[k];
    return h;
}

Test(rcluster_live, batch_sink, .init = cl_setup, .fini = cl_teardown, .timeout = 120)
{
    kvr_rc *rc;
    kvr_error e = { 0 };
    cr_assert_eq(kvr__rc_create(&rc, &(kvr_rc_config){ .seeds = T.seeds }, &e), 0);
    cr_assert_eq(kvr__rc_refresh(rc, &e), 0, "%s", e.msg);
    /* Sizes around the reader's 16 KiB header buffer, empty, and large. */
    static const size_t sizes[] = { 0, 1, 2, 100, 16381, 16382, 16384, 16385, 70000,
                                    1u << 20, 3u << 20, 5, 0, 33 };
    enum { NK = sizeof sizes / sizeof *sizes };
    char key[NK + 1][32];
    uint8_t *val[NK];
    for (int i = 0; i < NK; i++) {
        snprintf(key[i], 32, "sink%d", i);
        val[i] = malloc(sizes[i] + 1);
        for (size_t k = 0; k < sizes[i]; k++)
            val[i][k] = (uint8_t)((k * 131 + (size_t)i * 7) ^ (k >> 9));
        if (sizes[i] > 2)          /* bytes the reader must not take for a line end */
            memcpy(val[i] + sizes[i] / 2, "\r\n$-1\r\n", sizes[i] > 20 ? 8 : 2);
        const char *argv[] = { "SET", key[i], (const char *)val[i] };
        size_t argl[] = { 3, strlen(key[i]), sizes[i] };
        redisReply *r;
        cr_assert_eq(kvr__rc_command(rc, 3, argv, argl, &r, &e), 0, "%s", e.msg);
        freeReplyObject(r);
    }
    snprintf(key[NK], 32, "sink-missing");
    kvr_rc_cmd cmds[NK + 1];
    const char *argv[NK + 1][2];
    size_t argl[NK + 1][2];
    for (int i = 0; i <= NK; i++) {
        argv[i][0] = "GET";
        argv[i][1] = key[i];
        argl[i][0] = 3;
        argl[i][1] = strlen(key[i]);
        cmds[i] = (kvr_rc_cmd){ 2, argv[i], argl[i] };
    }
    static tsink t;
    /* Whole spans, then spans of at most 1000 bytes (many reads per value). */
    for (int pass = 0; pass < 2; pass++) {
        memset(&t, 0, sizeof t);
        t.cap_max = pass ? 1000 : 0;
        cr_assert_eq(kvr__rc_batch_sink(rc, NK + 1, cmds, &TS, &t), NK);
        for (int i = 0; i < NK; i++) {
            cr_assert_eq(t.begins[i], 1);
            cr_assert_eq(t.ends[i], 1);
            cr_assert(t.is_str[i]);
            cr_assert_eq(t.len[i], sizes[i], "value %d", i);
            cr_assert_eq(t.got[i], sizes[i]);
            cr_assert_eq(memcmp(t.buf[i], val[i], sizes[i]), 0, "value %d differs", i);
            cr_assert_eq(t.sum[i], sum_of(val[i], sizes[i]));
        }
        cr_assert_eq(t.ends[NK], 1);
        cr_assert_eq(t.begins[NK], 0);
        cr_assert(!t.is_str[NK], "a missing key is no string");
        tsink_free(&t);
    }
    /* The pooled connections are still in step: plain commands after it. */
    char got[64];
    cr_assert_eq(set_get(rc, "after-sink", "fine", got, sizeof got), 0);
    cr_assert_str_eq(got, "fine");
    for (int i = 0; i < NK; i++)
        free(val[i]);
    kvr__rc_destroy(rc);
}

/* The 3-lane SSE4.2 CRC32C (base/crc32c.c) on lengths and alignments
 * its lanes (3 x 4096 bytes) and their tails cover, against the tables. */

Test(rcluster, crc32c_lanes)
{
    size_t cap = (3u << 20) + 64;
    uint8_t *b = malloc(cap);
    for (size_t k = 0; k < cap; k++)
        b[k] = (uint8_t)((k * 2654435761u) >> 11);
    static const size_t lens[] = { 12287, 12288, 12289, 12295, 24576, 24577, 36863,
                                   65536 + 3, 1u << 20, 3u << 20 };
    for (size_t off = 0; off < 9; off++)
        for (size_t i = 0; i < sizeof lens / sizeof *lens; i++) {
            uint32_t a = kvr_crc32c(0, b + off, lens[i]);
            cr_assert_eq(a, kvr_crc32c_portable(0, b + off, lens[i]), "len %zu off %zu",
                         lens[i], off);
            cr_assert_eq(kvr_crc32c(kvr_crc32c(0, b + off, lens[i] / 3), b + off + lens[i] / 3,
                                    lens[i] - lens[i] / 3), a);
        }
    free(b);
}

static void node_id(int port, char *out, size_t cap)
{
    char buf[128];
    cr_assert_eq(tcluster_cli(&T, port, "cluster myid", buf, sizeof buf), 0);
    buf[strcspn(buf, "\r\n")] = '\0';
    snprintf(out, cap, "%s", buf);
}

Test(rcluster_live, ask_then_moved, .init = cl_setup, .fini = cl_teardown, .timeout = 120)
{
    kvr_rc *rc;
    kvr_error e = { 0 };
    cr_assert_eq(kvr__rc_create(&rc, &(kvr_rc_config){ .seeds = T.seeds }, &e), 0);
    cr_assert_eq(kvr__rc_refresh(rc, &e), 0, "%s", e.msg);
    char got[64];
    cr_assert_eq(set_get(rc, "{mig}old", "before", got, sizeof got), 0);
    unsigned slot = kvr__rc_key_slot("{mig}old", 8);
    int src = tcluster_master_of(&T, slot), dst = -1;
    cr_assert_gt(src, 0);
    for (unsigned s = 0; s < 16384 && dst < 0; s += 1000) {
        int m = tcluster_master_of(&T, s);
        if (m > 0 && m != src)
            dst = m;
    }
    cr_assert_gt(dst, 0);
    char sid[128], did[128], args[512];
    node_id(src, sid, sizeof sid);
    node_id(dst, did, sizeof did);
    snprintf(args, sizeof args, "cluster setslot %u importing %s", slot, sid);
    cr_assert_eq(tcluster_cli(&T, dst, args, NULL, 0), 0);
    snprintf(args, sizeof args, "cluster setslot %u migrating %s", slot, did);
    cr_assert_eq(tcluster_cli(&T, src, args, NULL, 0), 0);
    /* A key the source does not have: ASK to the destination. */
    cr_assert_eq(set_get(rc, "{mig}new", "during", got, sizeof got), 0);
    cr_assert_str_eq(got, "during");
    kvr_rc_stats st;
    kvr__rc_get_stats(rc, &st);
    cr_assert_geq(st.ask, 2, "SET and GET were asked on: %llu", (unsigned long long)st.ask);
    cr_assert_eq(st.moved, 0);
    /* A sink batch in the middle of it: {mig}old straight from the source,
     * {mig}new after the ASK (the one-by-one path, from a hiredis reply). */
    {
        static tsink t;
        memset(&t, 0, sizeof t);
        const char *a0[] = { "GET", "{mig}old" }, *a1[] = { "GET", "{mig}new" };
        size_t l0[] = { 3, 8 }, l1[] = { 3, 8 };
        kvr_rc_cmd c2[] = { { 2, a0, l0 }, { 2, a1, l1 } };
        cr_assert_eq(kvr__rc_batch_sink(rc, 2, c2, &TS, &t), 2);
        cr_assert_eq(t.len[0], 6);
        cr_assert_eq(memcmp(t.buf[0], "before", 6), 0);
        cr_assert_eq(t.len[1], 6);
        cr_assert_eq(memcmp(t.buf[1], "during", 6), 0);
        cr_assert_eq(t.ends[0] + t.ends[1], 2);
        tsink_free(&t);
    }
    /* Move the old key and hand the slot over. */
    snprintf(args, sizeof args, "migrate 127.0.0.1 %d \"\" 0 5000 keys {mig}old", dst);
    cr_assert_eq(tcluster_cli(&T, src, args, NULL, 0), 0);
    for (int k = 0; k < 6; k++) {
        snprintf(args, sizeof args, "cluster setslot %u node %s", slot, did);
        tcluster_cli(&T, T.ports[k], args, NULL, 0);
    }
    const char *gv[] = { "GET", "{mig}old" };
    size_t gl[] = { 3, 8 };
    redisReply *r;
    cr_assert_eq(kvr__rc_command(rc, 2, gv, gl, &r, &e), 0, "%s", e.msg);
    cr_assert_eq(r->type, REDIS_REPLY_STRING);
    cr_assert_str_eq(r->str, "before");
    freeReplyObject(r);
    kvr__rc_get_stats(rc, &st);
    cr_assert_geq(st.moved, 1);
    /* The map learned it: no more redirects for that slot. */
    uint64_t moved = st.moved;
    cr_assert_eq(kvr__rc_command(rc, 2, gv, gl, &r, &e), 0);
    freeReplyObject(r);
    kvr__rc_get_stats(rc, &st);
    cr_assert_eq(st.moved, moved);
    kvr__rc_destroy(rc);
}
