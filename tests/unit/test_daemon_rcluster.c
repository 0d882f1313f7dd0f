/*
 * test_daemon_rcluster.c — the Redis Cluster client (daemon/rcluster.c):
 * CRC16 and hash-tag slots against the Redis Cluster specification's
 * reference values and against a real cluster's CLUSTER KEYSLOT, redirect
 * and seed parsing, and against a 3+3 loopback cluster: routing, pipelined
 * batches, ASK during a slot migration and MOVED after it, ACL auth (and a
 * wrong password), an unreachable seed list.
 */
#include <criterion/criterion.h>

#include "daemon/rcluster.h"
#include "tests/common/kvr_cluster.h"

Test(rcluster, crc16_reference)
{
    /* The specification's reference: CRC16/XMODEM("123456789") = 0x31C3. */
    cr_assert_eq(kvr_rc_crc16("123456789", 9), 0x31C3);
    cr_assert_eq(kvr_rc_crc16("", 0), 0);
}

Test(rcluster, hash_tags)
{
    /* The specification's examples. */
    cr_assert_eq(kvr_rc_key_slot("{user1000}.following", 20),
                 kvr_rc_key_slot("{user1000}.followers", 20));
    cr_assert_eq(kvr_rc_key_slot("{user1000}.following", 20), kvr_rc_key_slot("user1000", 8));
    cr_assert_eq(kvr_rc_key_slot("foo{}{bar}", 10),
                 kvr_rc_crc16("foo{}{bar}", 10) & 16383);               /* whole key */
    cr_assert_eq(kvr_rc_key_slot("foo{{bar}}zap", 13), kvr_rc_key_slot("{bar", 4) ,
                 "'{bar' is hashed");
    cr_assert_eq(kvr_rc_key_slot("foo{{bar}}zap", 13), kvr_rc_crc16("{bar", 4) & 16383);
    cr_assert_eq(kvr_rc_key_slot("foo{bar}{zap}", 13), kvr_rc_key_slot("bar", 3));
    cr_assert_eq(kvr_rc_key_slot("foo{bar", 7), kvr_rc_crc16("foo{bar", 7) & 16383);
    /* Well-known slots (CLUSTER KEYSLOT). */
    cr_assert_eq(kvr_rc_key_slot("foo", 3), 12182);
    cr_assert_eq(kvr_rc_key_slot("bar", 3), 5061);
    cr_assert_eq(kvr_rc_key_slot("hello", 5), 866);
}

Test(rcluster, parse_redirect)
{
    bool ask;
    unsigned slot;
    char host[64];
    int port;
    const char *m = "MOVED 3999 127.0.0.1:6381";
    cr_assert_eq(kvr_rc_parse_redirect(m, strlen(m), &ask, &slot, host, sizeof host, &port), 0);
    cr_assert(!ask);
    cr_assert_eq(slot, 3999);
    cr_assert_str_eq(host, "127.0.0.1");
    cr_assert_eq(port, 6381);
    const char *a = "ASK 16383 ::1:7000";
    cr_assert_eq(kvr_rc_parse_redirect(a, strlen(a), &ask, &slot, host, sizeof host, &port), 0);
    cr_assert(ask);
    cr_assert_eq(slot, 16383);
    cr_assert_str_eq(host, "::1");
    cr_assert_eq(port, 7000);
    const char *bad[] = { "MOVED", "MOVED x 1.2.3.4:5", "MOVED 16384 h:1", "ASK 1 h:0",
                          "ASK 1 h", "ERR MOVED 1 h:1", "MOVED 1 :5", "CLUSTERDOWN" };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++)
        cr_assert_lt(kvr_rc_parse_redirect(bad[i], strlen(bad[i]), &ask, &slot, host,
                                           sizeof host, &port), 0, "%s", bad[i]);
}

Test(rcluster, parse_seeds)
{
    char h[4][64];
    int p[4];
    cr_assert_eq(kvr_rc_parse_seeds("redis://127.0.0.1:7000,localhost:7001", h, p, 4, NULL), 2);
    cr_assert_str_eq(h[0], "127.0.0.1");
    cr_assert_eq(p[1], 7001);
    cr_assert_eq(kvr_rc_parse_seeds("a:1,redis://b:2", h, p, 4, NULL), 2);
    kvr_error e = { 0 };
    cr_assert_eq(kvr_rc_parse_seeds("", h, p, 4, &e), KVR_EINVAL);
    cr_assert_eq(kvr_rc_parse_seeds("host", h, p, 4, &e), KVR_EINVAL);
    cr_assert(strstr(e.msg, "HOST:PORT"), "%s", e.msg);
    cr_assert_eq(kvr_rc_parse_seeds("h:1,,h:2", h, p, 4, NULL), KVR_EINVAL);
    cr_assert_eq(kvr_rc_parse_seeds("h:99999", h, p, 4, NULL), KVR_EINVAL);
    cr_assert_eq(kvr_rc_parse_seeds("a:1,b:2,c:3,d:4,e:5", h, p, 4, NULL), KVR_EINVAL);
}

static int set_get(kvr_rc *rc, const char *key, const char *val, char *got, size_t cap)
{
    const char *sv[] = { "SET", key, val };
    size_t sl[] = { 3, strlen(key), strlen(val) };
    redisReply *r;
    kvr_error e = { 0 };
    int x = kvr_rc_command(rc, 3, sv, sl, &r, &e);
    if (x < 0) {
        fprintf(stderr, "SET %s: %s\n", key, e.msg);
        return x;
    }
    freeReplyObject(r);
    const char *gv[] = { "GET", key };
    size_t gl[] = { 3, strlen(key) };
    x = kvr_rc_command(rc, 2, gv, gl, &r, &e);
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
    cr_assert_eq(kvr_rc_create(&rc, &(kvr_rc_config){ .seeds = T.seeds, .user = "kvr",
                                                     .password = "kvrpass" }, &e), 0);
    cr_assert_eq(kvr_rc_refresh(rc, &e), 0, "%s", e.msg);
    kvr_rc_stats st;
    kvr_rc_get_stats(rc, &st);
    cr_assert(st.have_map);
    cr_assert_eq(st.n_masters, 3);
    /* Our slots agree with the server's CLUSTER KEYSLOT. */
    const char *keys[] = { "a", "kvr1:b:{0123456789abcdef}", "{x}y", "foo{}{bar}", "zz{{q}}" };
    for (size_t i = 0; i < sizeof keys / sizeof *keys; i++) {
        char args[128], out[64];
        snprintf(args, sizeof args, "cluster keyslot '%s'", keys[i]);
        cr_assert_eq(tcluster_cli(&T, T.ports[0], args, out, sizeof out), 0);
        cr_assert_eq((unsigned)atoi(out), kvr_rc_key_slot(keys[i], strlen(keys[i])), "%s",
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
    cr_assert_eq(kvr_rc_batch(rc, 201, cmds, out), 201);
    for (int i = 0; i < 200; i++) {
        cr_assert_eq(out[i]->type, REDIS_REPLY_STRING);
        cr_assert_str_eq(out[i]->str, val[i]);
        freeReplyObject(out[i]);
    }
    cr_assert_eq(out[200]->type, REDIS_REPLY_NIL);
    freeReplyObject(out[200]);
    kvr_rc_get_stats(rc, &st);
    cr_assert_eq(st.moved, 0);
    kvr_rc_destroy(rc);

    /* A wrong password: a clear error naming the user. */
    cr_assert_eq(kvr_rc_create(&rc, &(kvr_rc_config){ .seeds = T.seeds, .user = "kvr",
                                                     .password = "nope" }, &e), 0);
    cr_assert_eq(kvr_rc_refresh(rc, &e), KVR_EUNAUTH);
    cr_assert(strstr(e.msg, "AUTH") && strstr(e.msg, "kvr"), "%s", e.msg);
    kvr_rc_destroy(rc);

    /* Nobody listening: KVR_EIO, bounded. */
    cr_assert_eq(kvr_rc_create(&rc, &(kvr_rc_config){ .seeds = "127.0.0.1:1", .retry_ms = 300 },
                               &e), 0);
    cr_assert_eq(kvr_rc_refresh(rc, &e), KVR_EIO);
    char got[8];
    cr_assert_eq(set_get(rc, "x", "y", got, sizeof got), KVR_EIO);
    kvr_rc_destroy(rc);
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
    cr_assert_eq(kvr_rc_create(&rc, &(kvr_rc_config){ .seeds = T.seeds }, &e), 0);
    cr_assert_eq(kvr_rc_refresh(rc, &e), 0, "%s", e.msg);
    char got[64];
    cr_assert_eq(set_get(rc, "{mig}old", "before", got, sizeof got), 0);
    unsigned slot = kvr_rc_key_slot("{mig}old", 8);
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
    kvr_rc_get_stats(rc, &st);
    cr_assert_geq(st.ask, 2, "SET and GET were asked on: %llu", (unsigned long long)st.ask);
    cr_assert_eq(st.moved, 0);
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
    cr_assert_eq(kvr_rc_command(rc, 2, gv, gl, &r, &e), 0, "%s", e.msg);
    cr_assert_eq(r->type, REDIS_REPLY_STRING);
    cr_assert_str_eq(r->str, "before");
    freeReplyObject(r);
    kvr_rc_get_stats(rc, &st);
    cr_assert_geq(st.moved, 1);
    /* The map learned it: no more redirects for that slot. */
    uint64_t moved = st.moved;
    cr_assert_eq(kvr_rc_command(rc, 2, gv, gl, &r, &e), 0);
    freeReplyObject(r);
    kvr_rc_get_stats(rc, &st);
    cr_assert_eq(st.moved, moved);
    kvr_rc_destroy(rc);
}
