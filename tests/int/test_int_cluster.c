/*
 * test_int_cluster.c — the shared tier end to end: a 3-master / 3-replica
 * Redis Cluster on loopback (scripts/redis-cluster.sh, one per test) and
 * two kvroped nodes A and B with --remote-tier.
 *
 *  - put on A with share, then get and match on B: bit-exact, at the
 *    positions asked; an asynchronous share shows up on B;
 *  - the layout travels: group ids, group offsets and cursors, protection,
 *    the APE record; B's get answers what A's does, and the groups go on
 *    the same way on both;
 *  - a value overwritten with garbage (block or manifest): a miss, counted;
 *  - a master SIGKILLed during traffic from both nodes: at worst misses and
 *    "not shared" replies meanwhile, never a lost local put, never bad data;
 *    traffic goes on after the failover;
 *  - slots resharded (redis-cli --cluster reshard) during traffic: MOVED /
 *    ASK handled, everything still readable;
 *  - the cluster unreachable at start: local service, a log line, joined
 *    once it appears; a wrong password: kvroped does not start and says why.
 */
#include <criterion/criterion.h>

#include <pthread.h>
#include <sys/stat.h>

#include "daemon/rcluster.h"
#include "daemon/remote.h"
#include "tests/common/kvr_cluster.h"
#include "tests/common/kvr_opsd.h"
#include "tests/common/kvr_testd.h"
#include "tests/common/kvt_daemon.h"

/* How a test put publishes. */
#define SHARE      1u
#define SHARE_SYNC 2u

static kvr_tcluster T;
static kvr_testd A, B;
static kvr_client *CA, *CB;
static char AUTH[300];
static kvr_model MA;

static void write_auth(const char *line)
{
    snprintf(AUTH, sizeof AUTH, "%s/auth", T.dir);
    FILE *f = fopen(AUTH, "w");
    cr_assert_not_null(f);
    fprintf(f, "%s\n", line);
    fclose(f);
}

/* Every node serves /metrics on a port of its own (logged at info). */
static int start_node(kvr_testd *d, const char *seeds)
{
    const char *extra[] = { "--remote-tier", seeds, "--remote-auth-file", AUTH,
                            "--metrics-listen", "127.0.0.1:0", "--log-level",
                            getenv("KVR_T_DEBUG") ? "debug" : "info", NULL };
    return testd_start(d, extra);
}

/* d's /metrics text (malloc), promtool-checked. */
static char *scrape(kvr_testd *d)
{
    int port = opsd_metrics_port(d->log);
    cr_assert(port > 0, "no metrics address in %s", d->log);
    char *body = NULL;
    int st = opsd_http(port, "GET", "/metrics", NULL, &body);
    cr_assert_eq(st, 200, "GET /metrics: HTTP %d", st);
    cr_assert_eq(opsd_promtool(body), 0);
    return body;
}

static void setup(void)
{
    cr_assert_eq(tcluster_start(&T), 0, "cluster did not start");
    write_auth("kvr kvrpass");
    cr_assert_eq(start_node(&A, T.seeds), 0);
    cr_assert_eq(start_node(&B, T.seeds), 0);
    CA = testd_connect(&A);
    CB = testd_connect(&B);
    cr_assert(CA && CB);
    cr_assert_eq(testd_register(CA, "tiny", KVR_DTYPE_F16, &MA), 0);
    cr_assert_eq(testd_register(CB, "tiny", KVR_DTYPE_F16, NULL), 0);
}

static void teardown(void)
{
    kvr_client_close(CA);
    kvr_client_close(CB);
    CA = CB = NULL;
    testd_stop(&A);
    testd_stop(&B);
    tcluster_stop(&T);
}

/* Put n tokens (ids base.., data seed) on c with the given flags. */
static int put_flags(kvr_client *c, const char *ctx, uint32_t seed, uint32_t base, size_t n,
                     unsigned flags)
{
    size_t len;
    void *pl = testd_payload(seed, T_LAYERS, 0, n, KVR_DTYPE_F16, &len);
    uint32_t *tok = testd_tokens(base, n);
    kvr_put_args a = { .ctx_id = ctx, .model = "tiny", .dtype = KVR_DTYPE_F16, .tokens = tok,
                       .n_tokens = n, .has_pos_start = true, .pos_start = 0,
                       .payload = pl, .payload_len = len, .share = flags != 0,
                       .share_sync = (flags & SHARE_SYNC) != 0 };
    int r = kvr_client_put(c, &a, NULL);
    free(pl);
    free(tok);
    return r;
}

/* A get on c (positions NULL = stored); 0 and *kv, or the error. */
static int get_kv(kvr_client *c, const char *ctx, uint64_t start, uint64_t end,
                  const int64_t *pos, kvr_kv *kv)
{
    kvr_get_args g = { .ctx_id = ctx, .start = start, .end = end, .dtype = KVR_DTYPE_F16,
                       .positions = pos, .n_positions = pos ? end - start : 0 };
    return kvr_client_get(c, &g, kv);
}

/* A match+get of n tokens of tok on c, in F16: 0 and *m, or the error. */
static int match_kv(kvr_client *c, const uint32_t *tok, size_t n, kvr_match_res *m)
{
    return kvr_client_match(c, &(kvr_match_args){ .model = "tiny", .tokens = tok, .n_tokens = n,
                                                 .get = true, .dtype = KVR_DTYPE_F16 }, m);
}

static void assert_same(const kvr_kv *x, const kvr_kv *y)
{
    cr_assert_eq(x->n_tokens, y->n_tokens);
    cr_assert_eq(x->payload_len, y->payload_len);
    cr_assert_eq(memcmp(x->payload, y->payload, x->payload_len), 0, "payloads differ");
    cr_assert_eq(memcmp(x->tokens, y->tokens, x->n_tokens * 4), 0);
    cr_assert_eq(memcmp(x->positions, y->positions, x->n_tokens * 8), 0);
}

/* The whole of ctx is the same from A as from B (assert_same). */
static void same_on_both(const char *ctx)
{
    kvr_kv ka, kb;
    cr_assert_eq(get_kv(CA, ctx, 0, 0, NULL, &ka), 0);
    cr_assert_eq(get_kv(CB, ctx, 0, 0, NULL, &kb), 0, "%s", kvr_client_last_error(CB));
    assert_same(&ka, &kb);
    kvr_kv_release(&ka);
    kvr_kv_release(&kb);
}

/* tok with tokens [from, n) set to t (a prompt that goes on past a
 * stored context's tokens); returns tok. */
static uint32_t *prompt_after(uint32_t *tok, size_t from, size_t n, uint32_t t)
{
    for (size_t i = from; i < n; i++)
        tok[i] = t;
    return tok;
}

TestSuite(int_cluster, .init = setup, .fini = teardown, .timeout = 240);

Test(int_cluster, share_on_a_get_and_match_on_b)
{
    cr_assert_eq(put_flags(CA, "doc", 7, 1000, 200, SHARE_SYNC), 0);
    /* B has never seen it: the get fetches manifest + blocks. */
    kvr_kv ka, kb;
    same_on_both("doc");
    /* Positional work on the fetched data: re-rotated to 1000.. on both. */
    int64_t pos[50];
    for (int i = 0; i < 50; i++)
        pos[i] = 1000 + 3 * i;
    cr_assert_eq(get_kv(CA, "doc", 100, 150, pos, &ka), 0);
    cr_assert_eq(get_kv(CB, "doc", 100, 150, pos, &kb), 0);
    assert_same(&ka, &kb);
    kvr_kv_release(&kb);
    kvr_kv_release(&ka);

    /* A prompt that starts with doc's tokens, on B (contexts at B: the
     * fetched "doc" matches it locally, so delete it first). */
    cr_assert_eq(kvr_client_delete(CB, "doc"), 0);
    uint32_t *prompt = prompt_after(testd_tokens(1000, 260), 200, 260, 5);
    kvr_match_res m;
    cr_assert_eq(match_kv(CB, prompt, 260, &m), 0);
    /* All 200: three whole blocks and doc's last, shorter one. */
    cr_assert_eq(m.length, 200, "remote prefix: %llu", (unsigned long long)m.length);
    cr_assert(!strncmp(m.ctx_id, "cluster:", 8), "%s", m.ctx_id);
    cr_assert(m.has_kv);
    cr_assert_eq(get_kv(CA, "doc", 0, 200, NULL, &ka), 0);
    assert_same(&ka, &m.kv);
    kvr_kv_release(&ka);
    kvr_kv_release(&m.kv);
    /* A second match is local. */
    double hits = testd_metric(CB, "remote_fetch_hits");
    cr_assert_eq(kvr_client_match(CB, &(kvr_match_args){ .model = "tiny", .tokens = prompt,
                                                        .n_tokens = 260 }, &m), 0);
    cr_assert_eq(m.length, 200);
    cr_assert_eq(testd_metric(CB, "remote_fetch_hits"), hits);
    /* Finer than a block, to 16 tokens: a prompt leaving doc after 100
     * tokens finds 96 (a block, then the prefix key of 32 tokens into the
     * second), after 140 finds 128 (12 tokens into the third: no grain),
     * after 180 finds 176, after 30 finds 16. Bit-exact each time. */
    cr_assert_eq(kvr_client_delete(CB, m.ctx_id), 0);
    static const struct { size_t diverge, want; } fin[] = { { 100, 96 }, { 140, 128 },
                                                            { 180, 176 }, { 30, 16 } };
    for (size_t t = 0; t < sizeof fin / sizeof *fin; t++) {
        uint32_t *pr = testd_tokens(1000, 260);
        for (size_t i = fin[t].diverge; i < 260; i++)
            pr[i] = 7;
        cr_assert_eq(match_kv(CB, pr, 260, &m), 0);
        cr_assert_eq(m.length, fin[t].want, "diverging at %zu: %llu", fin[t].diverge,
                     (unsigned long long)m.length);
        cr_assert_eq(get_kv(CA, "doc", 0, fin[t].want, NULL, &ka), 0);
        assert_same(&ka, &m.kv);
        kvr_kv_release(&ka);
        kvr_kv_release(&m.kv);
        cr_assert_eq(kvr_client_delete(CB, m.ctx_id), 0);
        free(pr);
    }
    /* A prompt the cluster does not have: a plain miss. */
    for (int i = 0; i < 260; i++)
        prompt[i] = 77;
    cr_assert_eq(kvr_client_match(CB, &(kvr_match_args){ .model = "tiny", .tokens = prompt,
                                                        .n_tokens = 260 }, &m), 0);
    cr_assert_eq(m.length, 0);
    free(prompt);

    /* Asynchronous share: acknowledged first, visible on B shortly after. */
    cr_assert_eq(put_flags(CA, "later", 9, 3000, 70, SHARE), 0);
    int r = -1;
    for (int i = 0; i < 500 && r != 0; i++) {
        r = get_kv(CB, "later", 0, 0, NULL, &kb);
        if (r != 0)
            kvt_sleep_ms(20);
    }
    cr_assert_eq(r, 0, "the async share never showed up on B");
    cr_assert_eq(get_kv(CA, "later", 0, 0, NULL, &ka), 0);
    assert_same(&ka, &kb);
    kvr_kv_release(&kb);
    kvr_kv_release(&ka);
    /* The CLI: kvrope put --share-sync on A, get on B. */
    {
        char in[400], toks[400], out[8192];
        snprintf(in, sizeof in, "%s/cli.raw", A.dir);
        snprintf(toks, sizeof toks, "%s/cli.tok", A.dir);
        size_t pl_len;
        void *raw = testd_payload(11, T_LAYERS, 0, 10, KVR_DTYPE_F16, &pl_len);
        FILE *fp = fopen(in, "wb");
        fwrite(raw, 1, pl_len, fp);
        fclose(fp);
        free(raw);
        fp = fopen(toks, "w");
        fprintf(fp, "1,2,3,4,5,6,7,8,9,10\n");
        fclose(fp);
        const char *args[] = { "put", "cli-doc", in, "--model", "tiny", "--tokens-file", toks,
                               "--share-sync", NULL };
        cr_assert_eq(testd_cli(&A, out, sizeof out, args), 0, "%s", out);
        cr_assert_eq(get_kv(CB, "cli-doc", 0, 0, NULL, &kb), 0);
        cr_assert_eq(kb.n_tokens, 10);
        kvr_kv_release(&kb);
    }
    /* Unknown everywhere: still "unknown context". */
    cr_assert_eq(get_kv(CB, "nowhere", 0, 0, NULL, &kb), KVR_ENOCTX);

    /* Prometheus sees what the stats verb sees: B fetched, A published. */
    char *mb = scrape(&B);
    double hit = opsd_sample(mb, "kvrope_remote_fetches_total{result=\"hit\"}");
    cr_assert_eq(opsd_sample(mb, "kvrope_remote_joined"), 1);
    cr_assert_eq(hit, testd_metric(CB, "remote_fetch_hits"));
    cr_assert_geq(hit, 3, "doc, the prefix matches, later, cli-doc: %g", hit);
    cr_assert_eq(opsd_sample(mb, "kvrope_remote_fetches_total{result=\"miss\"}"),
                 testd_metric(CB, "remote_fetch_misses"));
    cr_assert_eq(opsd_sample(mb, "kvrope_remote_fetched_tokens_total"),
                 testd_metric(CB, "remote_fetched_tokens"));
    cr_assert_eq(opsd_sample(mb, "kvrope_remote_prefix_probes_total"),
                 testd_metric(CB, "remote_probes"));
    /* Every fetch that reached the cluster is in the histogram once it
     * ended; the hits at least, each taking some time. */
    double cnt = opsd_sample(mb, "kvrope_remote_fetch_duration_seconds_count");
    cr_assert_geq(cnt, hit);
    cr_assert_eq(opsd_sample(mb, "kvrope_remote_fetch_duration_seconds_bucket{le=\"+Inf\"}"), cnt);
    cr_assert_gt(opsd_sample(mb, "kvrope_remote_fetch_duration_seconds_sum"), 0);
    free(mb);
    char *ma = scrape(&A);
    cr_assert_geq(opsd_sample(ma, "kvrope_remote_published_contexts_total"), 3);
    cr_assert_eq(opsd_sample(ma, "kvrope_remote_published_contexts_total"),
                 testd_metric(CA, "remote_published_contexts"));
    cr_assert_geq(opsd_sample(ma, "kvrope_remote_published_blocks_total"), 4);
    cr_assert_eq(opsd_sample(ma, "kvrope_remote_publish_errors_total"), 0);
    free(ma);
}

/* ---- quantized contexts travel as their codes ------------------------------ */

static kvr_rc *test_rc(void);
/* testd_tokens(first, n), their positions 0.. in pos[0..n). */
static uint32_t *tokens_from_zero(uint32_t first, size_t n, int64_t *pos)
{
    for (size_t i = 0; i < n; i++)
        pos[i] = (int64_t)i;
    return testd_tokens(first, n);
}

static void rc_set(kvr_rc *rc, const char *key, const void *v, size_t n);

/* Puts n tokens of codec `codec` on A in two puts (the second shares). */
static int put_quant(const char *ctx, const char *codec, uint32_t seed, uint32_t base, size_t n,
                     size_t first)
{
    for (int k = 0; k < 2; k++) {
        size_t from = k ? first : 0, cnt = k ? n - first : first;
        size_t len;
        void *pl = testd_payload(seed, T_LAYERS, from, cnt, KVR_DTYPE_F16, &len);
        uint32_t *tok = testd_tokens(base + (uint32_t)from, cnt);
        kvr_put_args a = { .ctx_id = ctx, .model = "tiny", .dtype = KVR_DTYPE_F16,
                           .tokens = tok, .n_tokens = cnt, .payload = pl, .payload_len = len,
                           .codec = k ? NULL : codec, .mode = k ? KVR_PUT_APPEND : KVR_PUT_CREATE,
                           .has_pos_start = true, .pos_start = (int64_t)from,
                           .share_sync = k == 1 };
        int r = kvr_client_put(CA, &a, NULL);
        free(pl);
        free(tok);
        if (r != 0)
            return r;
    }
    return 0;
}

/* A's and B's raw get of ctx's encoded tokens [0, end) are the same codes. */
static void same_raw_codes(const char *ctx, uint64_t end)
{
    kvr_get_args g = { .ctx_id = ctx, .start = 0, .end = end, .raw = true };
    kvr_kv ka, kb;
    cr_assert_eq(kvr_client_get(CA, &g, &ka), 0, "%s", kvr_client_last_error(CA));
    cr_assert_eq(kvr_client_get(CB, &g, &kb), 0, "%s", kvr_client_last_error(CB));
    cr_assert_eq(ka.payload_len, kb.payload_len);
    cr_assert_eq(memcmp(ka.payload, kb.payload, ka.payload_len), 0, "%s: codes differ", ctx);
    kvr_kv_release(&ka);
    kvr_kv_release(&kb);
}

Test(int_cluster, quantized_travels)
{
    /* Per-token int8 (no window), KIVI k4v2 with a 32-token tile (K per
     * channel: encoded tokens in whole tiles, then a plain window), and
     * ggml's Q8_0. */
    static const struct { const char *id, *codec; size_t n, first; } q[] = {
        { "q-int8", "int8/g32", 600, 300 },                /* 3 chunks of 256 */
        { "q-kivi", "kivi:k4v2:g32:r32", 200, 70 },
        { "q-q8", "q8_0", 130, 64 },
        { "q-short", "kivi:k4v2:g32:r32", 20, 10 },       /* window only */
    };
    for (size_t i = 0; i < sizeof q / sizeof *q; i++) {
        cr_assert_eq(put_quant(q[i].id, q[i].codec, 40 + (uint32_t)i, 5000, q[i].n, q[i].first),
                     0, "%s: %s", q[i].codec, kvr_client_last_error(CA));
        kvr_context sa, sb;
        cr_assert_eq(kvr_client_stat(CA, q[i].id, &sa), 0);
        kvr_kv ka, kb;
        cr_assert_eq(get_kv(CA, q[i].id, 0, 0, NULL, &ka), 0);
        cr_assert_eq(get_kv(CB, q[i].id, 0, 0, NULL, &kb), 0, "%s: %s", q[i].codec,
                     kvr_client_last_error(CB));
        assert_same(&ka, &kb);
        kvr_kv_release(&ka);
        kvr_kv_release(&kb);
        /* Held as the same codes: same codec, window and bytes at rest... */
        cr_assert_eq(kvr_client_stat(CB, q[i].id, &sb), 0);
        cr_assert_str_eq(sa.codec, sb.codec);
        cr_assert_eq(sa.n_window, sb.n_window, "%s: window %llu vs %llu", q[i].codec,
                     (unsigned long long)sa.n_window, (unsigned long long)sb.n_window);
        cr_assert_eq(sa.kv_bytes, sb.kv_bytes);
        /* ...so any other positions give the same bits too (pre-RoPE keys
         * rotated once on both), and so do the raw bytes. */
        int64_t pos[20];
        for (int k = 0; k < 20; k++)
            pos[k] = 777 + 5 * k;
        cr_assert_eq(get_kv(CA, q[i].id, 0, 20, pos, &ka), 0);
        cr_assert_eq(get_kv(CB, q[i].id, 0, 20, pos, &kb), 0);
        assert_same(&ka, &kb);
        kvr_kv_release(&ka);
        kvr_kv_release(&kb);
        size_t nq = (size_t)(sa.n_tokens - sa.n_window);
        cr_assert(i == 3 ? nq == 0 : nq > 0, "%s: %zu encoded tokens", q[i].codec, nq);
        if (nq) {
            kvr_get_args g = { .ctx_id = q[i].id, .start = 0, .end = nq, .raw = true };
            cr_assert_eq(kvr_client_get(CA, &g, &ka), 0, "%s", kvr_client_last_error(CA));
            cr_assert_eq(kvr_client_get(CB, &g, &kb), 0, "%s", kvr_client_last_error(CB));
            cr_assert_eq(ka.payload_len, kb.payload_len);
            cr_assert_eq(memcmp(ka.payload, kb.payload, ka.payload_len), 0, "%s: codes differ",
                         q[i].codec);
            kvr_kv_release(&ka);
            kvr_kv_release(&kb);
        }
        /* And it goes on as a quantized context on B: an append flushes the
         * window the same way on both. */
        size_t len;
        void *pl = testd_payload(90, T_LAYERS, 0, 40, KVR_DTYPE_F16, &len);
        uint32_t *tok = testd_tokens(9000, 40);
        kvr_put_args a = { .ctx_id = q[i].id, .model = "tiny", .dtype = KVR_DTYPE_F16,
                           .tokens = tok, .n_tokens = 40, .payload = pl, .payload_len = len,
                           .mode = KVR_PUT_APPEND };
        cr_assert_eq(kvr_client_put(CA, &a, NULL), 0, "%s", kvr_client_last_error(CA));
        cr_assert_eq(kvr_client_put(CB, &a, NULL), 0, "%s", kvr_client_last_error(CB));
        free(pl);
        free(tok);
        same_on_both(q[i].id);
    }
    /* The default grouping, k4v2 (K int4 per channel over 128 tokens, V
     * int2 over 256 channels, 128-token window), on a model whose rows are
     * 256 values wide: 400 tokens = 256 encoded + a window of 144. */
    {
        kvr_rope_config rc;
        kvr_rope_config_init(&rc);
        rc.head_dim = 128;
        rc.rotary_dim = 128;
        kvr_model_params mp = { .name = "wide", .n_layers = 2, .n_kv_heads = 2,
                                .head_dim = 128, .dtype = KVR_DTYPE_F16, .rope = &rc };
        cr_assert_eq(kvr_client_model_register(CA, &mp, NULL), 0);
        cr_assert_eq(kvr_client_model_register(CB, &mp, NULL), 0);
        size_t len = kvr_payload_size(2, 400, 2, 128, KVR_DTYPE_F16);
        void *pl = malloc(len);
        testd_fill(pl, 77, NULL, 2, 0, 400, 2, 128, KVR_DTYPE_F16);
        uint32_t *tok = testd_tokens(100, 400);
        kvr_put_args a = { .ctx_id = "q-k4v2", .model = "wide", .dtype = KVR_DTYPE_F16,
                           .tokens = tok, .n_tokens = 400, .payload = pl, .payload_len = len,
                           .codec = "k4v2", .has_pos_start = true, .share_sync = true };
        cr_assert_eq(kvr_client_put(CA, &a, NULL), 0, "%s", kvr_client_last_error(CA));
        free(pl);
        free(tok);
        kvr_context sa, sb;
        cr_assert_eq(kvr_client_stat(CA, "q-k4v2", &sa), 0);
        cr_assert_eq(sa.n_window, 144);
        same_on_both("q-k4v2");
        cr_assert_eq(kvr_client_stat(CB, "q-k4v2", &sb), 0);
        cr_assert_str_eq(sa.codec, sb.codec);
        cr_assert_eq(sa.n_window, sb.n_window);
        cr_assert_eq(sa.kv_bytes, sb.kv_bytes);
        same_raw_codes("q-k4v2", 256);
    }
    /* A spoilt chunk: a miss, counted, never served. */
    cr_assert_eq(put_quant("q-bad", "int8/g32", 60, 7000, 100, 50), 0);
    kvr_rc *rc = test_rc();
    /* Find its chunk by its manifest (the key scheme of docs/cluster.md). */
    char mk[KVR_RT_KEY_MAX];
    kvr__rt_manifest_key("q-bad", mk);
    const char *gv[] = { "GET", mk };
    size_t gl[] = { 3, strlen(mk) };
    redisReply *x;
    cr_assert_eq(kvr__rc_command(rc, 2, gv, gl, &x, NULL), 0);
    kvr_rt_manifest m;
    cr_assert_eq(kvr__rt_manifest_decode((const uint8_t *)x->str, x->len, "q-bad", &m, NULL), 0);
    freeReplyObject(x);
    cr_assert(m.quant);
    cr_assert_eq(m.n_raw, 100);
    char ck[KVR_RT_KEY_MAX];
    kvr__rt_chunk_key(m.chains[0], ck);
    rc_set(rc, ck, "garbage!", 8);
    kvr__rt_manifest_free(&m);
    double c0 = testd_metric(CB, "remote_fetch_corrupt");
    kvr_kv kb;
    cr_assert_eq(get_kv(CB, "q-bad", 0, 0, NULL, &kb), KVR_ENOCTX);
    cr_assert_gt(testd_metric(CB, "remote_fetch_corrupt"), c0);
    /* A manifest that names another codec (well-formed, checksum right):
     * its chains and values do not fit it, a miss. */
    cr_assert_eq(put_quant("q-mis", "int8/g32", 61, 8000, 100, 50), 0);
    kvr__rt_manifest_key("q-mis", mk);
    gl[1] = strlen(mk);
    cr_assert_eq(kvr__rc_command(rc, 2, gv, gl, &x, NULL), 0);
    cr_assert_eq(kvr__rt_manifest_decode((const uint8_t *)x->str, x->len, "q-mis", &m, NULL), 0);
    freeReplyObject(x);
    snprintf(m.codec, sizeof m.codec, "k=int4/g32,v=int4/g32,r=0");
    size_t ml;
    uint8_t *mv = kvr__rt_manifest_encode(&m, &ml);
    rc_set(rc, mk, mv, ml);
    kvr_mem_free(mv);
    kvr__rt_manifest_free(&m);
    c0 = testd_metric(CB, "remote_fetch_corrupt");
    cr_assert_eq(get_kv(CB, "q-mis", 0, 0, NULL, &kb), KVR_ENOCTX);
    cr_assert_gt(testd_metric(CB, "remote_fetch_corrupt"), c0);
    kvr_kv ka;
    cr_assert_eq(get_kv(CA, "q-mis", 0, 0, NULL, &ka), 0, "A's own is untouched");
    kvr_kv_release(&ka);
    kvr__rc_destroy(rc);
}

static kvr_rc *test_rc(void)
{
    kvr_rc *rc;
    cr_assert_eq(kvr__rc_create(&rc, &(kvr_rc_config){ .seeds = T.seeds }, NULL), 0);
    cr_assert_eq(kvr__rc_refresh(rc, NULL), 0);
    return rc;
}

static void rc_set(kvr_rc *rc, const char *key, const void *v, size_t n)
{
    const char *argv[] = { "SET", key, v };
    size_t argl[] = { 3, strlen(key), n };
    redisReply *r;
    cr_assert_eq(kvr__rc_command(rc, 3, argv, argl, &r, NULL), 0);
    freeReplyObject(r);
}

/* Prefix key pk set to the n bytes of v: a match on B of the 130 tokens
 * of pr finds nothing, and counts a corrupt fetch. */
static void prefix_value_misses(kvr_rc *rc, const char *pk, const void *v, size_t n,
                                const uint32_t *pr)
{
    rc_set(rc, pk, v, n);
    double c0 = testd_metric(CB, "remote_fetch_corrupt");
    kvr_match_res m;
    cr_assert_eq(kvr_client_match(CB, &(kvr_match_args){ .model = "tiny", .tokens = pr,
                                                        .n_tokens = 130 }, &m), 0);
    cr_assert_eq(m.length, 0);
    cr_assert_gt(testd_metric(CB, "remote_fetch_corrupt"), c0);
}

Test(int_cluster, garbage_is_a_miss)
{
    cr_assert_eq(put_flags(CA, "g1", 3, 10, 130, SHARE_SYNC), 0);
    cr_assert_eq(put_flags(CA, "g2", 4, 10, 10, SHARE_SYNC), 0);
    kvr_rt_desc desc = { MA.fingerprint, T_LAYERS, T_HEADS, T_DIM, KVR_DTYPE_F16 };
    int64_t pos[130];
    uint32_t *tok = tokens_from_zero(10, 130, pos);
    uint64_t h = kvr__rt_chain_seed(&desc);
    h = kvr__rt_chain_next(h, tok, pos, 64);
    h = kvr__rt_chain_next(h, tok + 64, pos + 64, 64);   /* the second block */
    char key[KVR_RT_KEY_MAX];
    kvr__rt_block_key(h, key);
    kvr_rc *rc = test_rc();
    /* The block exists (the key scheme is what docs/cluster.md says)... */
    const char *ev[] = { "EXISTS", key };
    size_t el[] = { 6, strlen(key) };
    redisReply *r;
    cr_assert_eq(kvr__rc_command(rc, 2, ev, el, &r, NULL), 0);
    cr_assert_eq(r->integer, 1, "block key %s not found", key);
    freeReplyObject(r);
    /* ...and is now garbage, then a bit flip of a real value. */
    rc_set(rc, key, "garbage!", 8);
    kvr_kv kb;
    cr_assert_eq(get_kv(CB, "g1", 0, 0, NULL, &kb), KVR_ENOCTX);
    cr_assert_geq(testd_metric(CB, "remote_fetch_corrupt"), 1);
    /* A match on B gets the first block only (the second is bad). */
    kvr_match_res m;
    cr_assert_eq(kvr_client_match(CB, &(kvr_match_args){ .model = "tiny", .tokens = tok,
                                                        .n_tokens = 130 }, &m), 0);
    cr_assert_eq(m.length, 64);
    cr_assert_eq(kvr_client_delete(CB, m.ctx_id), 0);
    /* A prefix key overwritten with garbage, then with well-formed entries
     * naming another block (g2's, too short; g1's second, which is
     * garbage): misses, counted, never served. */
    uint64_t seed = kvr__rt_chain_seed(&desc);
    char pk[KVR_RT_KEY_MAX];
    kvr__rt_sub_key(kvr__rt_chain_next(seed, tok, pos, 16), pk);
    uint32_t *pr = prompt_after(testd_tokens(10, 130), 20, 130, 3);
    cr_assert_eq(kvr_client_match(CB, &(kvr_match_args){ .model = "tiny", .tokens = pr,
                                                        .n_tokens = 130 }, &m), 0);
    cr_assert_eq(m.length, 16, "the prefix key works before it is spoilt");
    cr_assert_eq(kvr_client_delete(CB, m.ctx_id), 0);
    prefix_value_misses(rc, pk, "garbage!", 8, pr);
    uint8_t sv[KVR_RT_SUB_LEN];
    uint32_t *t2 = testd_tokens(10, 10);
    kvr__rt_sub_encode(&desc, kvr__rt_chain_next(seed, t2, pos, 10), 10, 16, sv);
    free(t2);
    prefix_value_misses(rc, pk, sv, sizeof sv, pr);
    kvr__rt_sub_encode(&desc, h, 64, 16, sv);
    prefix_value_misses(rc, pk, sv, sizeof sv, pr);
    free(pr);
    /* The manifest of g2, one byte flipped: a miss. */
    char mk[KVR_RT_KEY_MAX];
    kvr__rt_manifest_key("g2", mk);
    const char *gv[] = { "GET", mk };
    size_t gl[] = { 3, strlen(mk) };
    cr_assert_eq(kvr__rc_command(rc, 2, gv, gl, &r, NULL), 0);
    cr_assert_eq(r->type, REDIS_REPLY_STRING);
    char *copy = malloc(r->len);
    memcpy(copy, r->str, r->len);
    copy[r->len / 2] ^= 0x10;
    rc_set(rc, mk, copy, r->len);
    freeReplyObject(r);
    free(copy);
    double corrupt = testd_metric(CB, "remote_fetch_corrupt");
    cr_assert_eq(get_kv(CB, "g2", 0, 0, NULL, &kb), KVR_ENOCTX);
    cr_assert_gt(testd_metric(CB, "remote_fetch_corrupt"), corrupt);
    /* A's data is untouched. */
    cr_assert_eq(get_kv(CA, "g2", 0, 0, NULL, &kb), 0);
    kvr_kv_release(&kb);
    kvr__rc_destroy(rc);
    free(tok);
}

/* ---- traffic under failures ------------------------------------------------ */

typedef struct traffic {
    volatile int stop;
    int   n_put, n_put_unshared, n_bad, n_get_hit, n_get_miss, n_local_ok;
    char  why[256];
    int   next;           /* contexts t0..t(next-1) were put on A */
    pthread_mutex_t mu;
} traffic;

static void *a_traffic(void *arg)
{
    traffic *t = arg;
    kvr_client *c = testd_connect(&A);
    while (!t->stop) {
        char id[32];
        int k = t->next;
        snprintf(id, sizeof id, "t%d", k);
        int r = put_flags(c, id, 100 + (uint32_t)k, 50000 + 1000 * (uint32_t)k, 150,
                          SHARE_SYNC);
        if (r == 0) {
            t->n_put++;
        } else if (r == KVR_EIO && strstr(kvr_client_last_error(c), "stored locally")) {
            t->n_put_unshared++;
        } else {
            t->n_bad++;
            snprintf(t->why, sizeof t->why, "put %s: %d %s", id, r, kvr_client_last_error(c));
        }
        /* Local data is never lost, whatever the cluster does. */
        kvr_kv kv;
        if (get_kv(c, id, 0, 0, NULL, &kv) == 0) {
            size_t len;
            void *want = testd_payload(100 + (uint32_t)k, T_LAYERS, 0, 150, KVR_DTYPE_F16, &len);
            if (kv.payload_len == len && !memcmp(kv.payload, want, len))
                t->n_local_ok++;
            else
                t->n_bad++;
            free(want);
            kvr_kv_release(&kv);
        } else {
            t->n_bad++;
            snprintf(t->why, sizeof t->why, "local get %s failed", id);
        }
        pthread_mutex_lock(&t->mu);
        t->next = k + 1;
        pthread_mutex_unlock(&t->mu);
        kvt_sleep_ms(20);
    }
    kvr_client_close(c);
    return NULL;
}

static void *b_traffic(void *arg)
{
    traffic *t = arg;
    kvr_client *c = testd_connect(&B);
    unsigned i = 0;
    while (!t->stop) {
        pthread_mutex_lock(&t->mu);
        int n = t->next;
        pthread_mutex_unlock(&t->mu);
        if (n == 0) {
            kvt_sleep_ms(10);
            continue;
        }
        int k = (int)(i++ % (unsigned)n);
        char id[32];
        snprintf(id, sizeof id, "t%d", k);
        kvr_kv kv;
        int r = get_kv(c, id, 0, 0, NULL, &kv);
        if (r == 0) {
            size_t len;
            void *want = testd_payload(100 + (uint32_t)k, T_LAYERS, 0, 150, KVR_DTYPE_F16, &len);
            if (kv.payload_len == len && !memcmp(kv.payload, want, len)) {
                t->n_get_hit++;
            } else {
                t->n_bad++;
                snprintf(t->why, sizeof t->why, "B served bad data for %s", id);
            }
            free(want);
            kvr_kv_release(&kv);
            kvr_client_delete(c, id);     /* so the next get asks the cluster again */
        } else if (r == KVR_ENOCTX) {
            t->n_get_miss++;
        } else {
            t->n_bad++;
            snprintf(t->why, sizeof t->why, "B get %s: %d %s", id, r, kvr_client_last_error(c));
        }
        /* And matches of the same prompts. */
        uint32_t *tok = testd_tokens(50000 + 1000 * (uint32_t)k, 150);
        kvr_match_res m;
        r = kvr_client_match(c, &(kvr_match_args){ .model = "tiny", .tokens = tok,
                                                   .n_tokens = 150 }, &m);
        if (r != 0 || m.length > 150 || (m.length != 150 && m.length % 16 != 0)) {
            t->n_bad++;
            snprintf(t->why, sizeof t->why, "B match: %d length %llu", r,
                     (unsigned long long)m.length);
        }
        if (r == 0 && m.length)
            kvr_client_delete(c, m.ctx_id);
        free(tok);
    }
    kvr_client_close(c);
    return NULL;
}

static void run_traffic(traffic *t, pthread_t *ta, pthread_t *tb)
{
    memset(t, 0, sizeof *t);
    pthread_mutex_init(&t->mu, NULL);
    pthread_create(ta, NULL, a_traffic, t);
    pthread_create(tb, NULL, b_traffic, t);
}

static void stop_traffic(traffic *t, pthread_t ta, pthread_t tb)
{
    t->stop = 1;
    pthread_join(ta, NULL);
    pthread_join(tb, NULL);
    cr_assert_eq(t->n_bad, 0, "%s", t->why);
    cr_assert_eq(t->n_local_ok, t->n_put + t->n_put_unshared);
}

Test(int_cluster, master_killed_during_traffic)
{
    traffic t;
    pthread_t ta, tb;
    run_traffic(&t, &ta, &tb);
    kvt_sleep_ms(1500);
    int victim = tcluster_master_of(&T, 0);
    cr_assert_gt(victim, 0);
    cr_assert_eq(tcluster_kill(&T, victim), 0);
    /* The replica takes over (node timeout 1 s): wait until another
     * master serves slot 0 and the cluster says ok. */
    int owner = victim;
    for (int i = 0; i < 300 && (owner == victim || owner <= 0); i++) {
        kvt_sleep_ms(100);
        owner = tcluster_master_of(&T, 0);
    }
    cr_assert(owner > 0 && owner != victim, "no failover");
    cr_assert_eq(tcluster_wait_ok(&T, 30), 0, "no failover");
    /* A put in flight may spend its whole retry budget (3 s). */
    kvt_sleep_ms(3500);
    int before = t.n_put;
    kvt_sleep_ms(2000);
    stop_traffic(&t, ta, tb);
    if (t.n_put <= before) {
        testd_print_log(&A);
        fprintf(stderr, "next %d puts %d (before %d), unshared %d, hits %d, misses %d\n", t.next, t.n_put,
                before, t.n_put_unshared, t.n_get_hit, t.n_get_miss);
    }
    cr_assert_gt(t.n_put, before, "puts were not shared again after the failover");
    cr_assert_gt(t.n_get_hit, 0);
    /* After the failover a new share is visible on B. */
    cr_assert_eq(put_flags(CA, "after", 5, 99, 100, SHARE_SYNC), 0,
                 "%s", kvr_client_last_error(CA));
    kvr_kv kv;
    cr_assert_eq(get_kv(CB, "after", 0, 0, NULL, &kv), 0);
    kvr_kv_release(&kv);
    cr_assert(testd_alive(&A) && testd_alive(&B));
}

static void *reshard(void *arg)
{
    (void)arg;
    char from[128], to[128], args[512], out[256];
    int src = tcluster_master_of(&T, 0), dst = tcluster_master_of(&T, 16383);
    tcluster_cli(&T, src, "cluster myid", from, sizeof from);
    tcluster_cli(&T, dst, "cluster myid", to, sizeof to);
    from[strcspn(from, "\r\n")] = '\0';
    to[strcspn(to, "\r\n")] = '\0';
    snprintf(args, sizeof args, "--cluster reshard 127.0.0.1:%d --cluster-from %s "
             "--cluster-to %s --cluster-slots 3000 --cluster-yes --cluster-pipeline 2 >/dev/null",
             src, from, to);
    int *rc = malloc(sizeof *rc);
    /* Moving 3000 slots is thousands of commands: bounded, but not by the
     * 20 s of a single command on a loaded machine (and under sanitizers). */
    *rc = tcluster_cli_for(&T, src, args, out, sizeof out, 180);
    return rc;
}

Test(int_cluster, reshard_during_traffic)
{
    traffic t;
    pthread_t ta, tb, tr;
    run_traffic(&t, &ta, &tb);
    kvt_sleep_ms(1000);
    pthread_create(&tr, NULL, reshard, NULL);
    void *res;
    pthread_join(tr, &res);
    cr_assert_eq(*(int *)res, 0, "reshard failed");
    free(res);
    kvt_sleep_ms(1000);
    stop_traffic(&t, ta, tb);
    cr_assert_gt(t.n_get_hit, 0);
    /* Everything published is still there for B, wherever it moved. */
    int ok = 0;
    for (int k = 0; k < t.next; k++) {
        char id[32];
        snprintf(id, sizeof id, "t%d", k);
        kvr_kv kv;
        kvr_client_delete(CB, id);
        if (get_kv(CB, id, 0, 0, NULL, &kv) == 0) {
            ok++;
            kvr_kv_release(&kv);
        }
    }
    cr_assert_geq(ok, t.n_put, "%d of %d shared contexts readable after the reshard", ok,
                  t.n_put);
    cr_assert_gt(testd_metric(CA, "remote_moved") + testd_metric(CA, "remote_ask") +
                 testd_metric(CB, "remote_moved") + testd_metric(CB, "remote_ask"), 0,
                 "no redirect was ever seen");
}

static bool log_has(const kvr_testd *d, const char *s)
{
    FILE *f = fopen(d->log, "r");
    if (!f)
        return false;
    char line[1024];
    bool found = false;
    while (!found && fgets(line, sizeof line, f))
        found = strstr(line, s) != NULL;
    fclose(f);
    return found;
}

/* No suite setup here: these tests manage their own cluster. */
Test(int_cluster_start, unreachable_then_joined, .timeout = 420)
{
    memset(&T, 0, sizeof T);
    snprintf(T.dir, sizeof T.dir, "/tmp/kvr-rcl-XXXXXX");
    cr_assert_not_null(mkdtemp(T.dir));
    write_auth("kvr kvrpass");
    srand((unsigned)getpid());
    const char *script = tcluster_script(T.script, sizeof T.script);
    char seeds[64], cmd[1024];
    int base = 0;
    kvr_testd d;
    kvr_client *c = NULL;
    bool up = false;
    /* A node first, its cluster's ports picked at random; where the cluster
     * cannot start on them (taken, or it did not come up), another base:
     * three tries before the test gives up (a skip, said why). */
    for (int attempt = 0; attempt < 3 && !up; attempt++) {
        base = 20000 + rand() % 25000;
        snprintf(seeds, sizeof seeds, "redis://127.0.0.1:%d,127.0.0.1:%d", base, base + 1);
        cr_assert_eq(start_node(&d, seeds), 0, "kvroped must start without its cluster");
        cr_assert(log_has(&d, "unreachable"), "no log line about the cluster");
        c = testd_connect(&d);
        cr_assert_eq(testd_register(c, "tiny", KVR_DTYPE_F16, NULL), 0);
        /* Local service goes on; a share is "stored locally, not shared". */
        cr_assert_eq(put_flags(c, "local", 1, 1, 100, 0), 0);
        cr_assert_eq(put_flags(c, "s", 1, 1, 100, SHARE_SYNC), KVR_EIO);
        cr_assert(strstr(kvr_client_last_error(c), "stored locally"), "%s",
                  kvr_client_last_error(c));
        kvr_kv kv;
        cr_assert_eq(get_kv(c, "local", 0, 0, NULL, &kv), 0);
        kvr_kv_release(&kv);
        cr_assert_eq(get_kv(c, "s", 0, 0, NULL, &kv), 0);
        kvr_kv_release(&kv);
        cr_assert_eq(get_kv(c, "absent", 0, 0, NULL, &kv), KVR_ENOCTX);
        /* The cluster appears on those ports. */
        snprintf(cmd, sizeof cmd, "KVR_CLUSTER_BASE=%d %s start %s %d >/dev/null", base,
                 script, T.dir, (int)getpid());
        if (system(cmd) == 0) {
            up = true;
            break;
        }
        fprintf(stderr, "unreachable_then_joined: no cluster on ports %d..%d, try %d of 3\n",
                base, base + 5, attempt + 1);
        kvr_client_close(c);
        testd_stop(&d);
        snprintf(cmd, sizeof cmd, "%s stop %s >/dev/null 2>&1", script, T.dir);
        if (system(cmd) != 0)
            fprintf(stderr, "unreachable_then_joined: stop after a failed start failed\n");
    }
    if (!up) {
        tcluster_stop(&T);
        cr_skip_test("no cluster could start on three random bases of ports (taken?)");
    }
    int r = -1;
    for (int i = 0; i < 100 && r != 0; i++) {
        char id[32];
        snprintf(id, sizeof id, "s2-%d", i);
        r = put_flags(c, id, 2, 2, 100, SHARE_SYNC);
        if (r != 0)
            kvt_sleep_ms(100);
    }
    cr_assert_eq(r, 0, "never joined: %s", kvr_client_last_error(c));
    cr_assert(log_has(&d, "joined"));
    cr_assert_eq(testd_metric(c, "remote_joined"), 1);
    kvr_client_close(c);
    testd_stop(&d);

    /* A wrong password: no start, and the reason. */
    write_auth("kvr not-the-password");
    snprintf(T.seeds, sizeof T.seeds, "127.0.0.1:%d", base);
    kvr_testd w;
    cr_assert_neq(start_node(&w, T.seeds), 0, "kvroped started with a wrong password");
    cr_assert(log_has(&w, "refused AUTH") && log_has(&w, "remote-auth-file"),
              "no clear error in %s", w.log);
    char rm[400];
    snprintf(rm, sizeof rm, "rm -rf %s", w.dir);     /* a failed start leaves its dir */
    if (system(rm) != 0)
        fprintf(stderr, "could not remove %s\n", w.dir);
    tcluster_stop(&T);
}

/* ---- layout metadata travels with the manifest ---------------------------- */

static int group_put(kvr_client *c, const char *ctx, const char *group, uint32_t seed,
                     uint32_t base, size_t n, const char *const *groups, size_t n_groups,
                     const int64_t *offsets, bool share, uint64_t protect)
{
    size_t len;
    void *pl = testd_payload(seed, T_LAYERS, 0, n, KVR_DTYPE_F16, &len);
    uint32_t *tok = testd_tokens(base, n);
    kvr_put_args a = { .ctx_id = ctx, .model = "tiny", .dtype = KVR_DTYPE_F16, .tokens = tok,
                       .n_tokens = n, .payload = pl, .payload_len = len,
                       .mode = groups ? KVR_PUT_CREATE : KVR_PUT_APPEND, .groups = groups,
                       .n_groups = n_groups, .group_offsets = offsets, .share_sync = share,
                       .protect_first = protect, .has_protect = protect > 0 };
    int r = kvr_client_group_append(c, &a, group, NULL);
    free(pl);
    free(tok);
    return r;
}

static void assert_same_meta(const kvr_kv *x, const kvr_kv *y)
{
    assert_same(x, y);
    cr_assert_eq(memcmp(x->flags, y->flags, x->n_tokens * 4), 0, "flags differ");
    cr_assert((x->groups == NULL) == (y->groups == NULL));
    if (x->groups)
        cr_assert_eq(memcmp(x->groups, y->groups, x->n_tokens * 4), 0, "group ids differ");
}

static void assert_same_layout(const char *ctx)
{
    kvr_layout_res la, lb;
    cr_assert_eq(kvr_client_layout_stat(CA, ctx, &la), 0);
    cr_assert_eq(kvr_client_layout_stat(CB, ctx, &lb), 0, "%s", kvr_client_last_error(CB));
    cr_assert_eq(la.has_prefix, lb.has_prefix);
    cr_assert_str_eq(la.prefix_ctx, lb.prefix_ctx);
    cr_assert_eq(la.prefix_len, lb.prefix_len);
    cr_assert_eq(la.n_groups, lb.n_groups);
    for (size_t g = 0; g < la.n_groups; g++) {
        cr_assert_str_eq(la.groups[g].name, lb.groups[g].name);
        cr_assert_eq(la.groups[g].offset, lb.groups[g].offset);
        cr_assert_eq(la.groups[g].cursor, lb.groups[g].cursor);
        cr_assert_eq(la.groups[g].n_tokens, lb.groups[g].n_tokens);
    }
    cr_assert_eq(la.retention, lb.retention);
    kvr_context sa, sb;
    cr_assert_eq(kvr_client_stat(CA, ctx, &sa), 0);
    cr_assert_eq(kvr_client_stat(CB, ctx, &sb), 0);
    cr_assert_eq(sa.n_protected, sb.n_protected);
}

/* Releases ka and kb, then compares ctx's layout on A and B
 * (assert_same_layout). */
static void release_same_layout(kvr_kv *ka, kvr_kv *kb, const char *ctx)
{
    kvr_kv_release(ka);
    kvr_kv_release(kb);
    assert_same_layout(ctx);
}

/* The whole of ctx from A (into ka) and from B (kb), whose metadata are
 * the same (assert_same_meta). */
static void get_both_same_meta(const char *ctx, kvr_kv *ka, kvr_kv *kb)
{
    cr_assert_eq(get_kv(CA, ctx, 0, 0, NULL, ka), 0);
    cr_assert_eq(get_kv(CB, ctx, 0, 0, NULL, kb), 0, "%s", kvr_client_last_error(CB));
    assert_same_meta(ka, kb);
}

Test(int_cluster, layout_travels)
{
    /* A grouped context: "sys" from 0, "doc" moved to 1000, tokens of both
     * interleaved in arrival order, the first 10 protected; published with
     * its last put. */
    const char *names[] = { "sys", "doc" };
    int64_t offs[] = { 0, 500 };
    cr_assert_eq(group_put(CA, "gp", "sys", 1, 100, 40, names, 2, offs, false, 0), 0,
                 "%s", kvr_client_last_error(CA));
    cr_assert_eq(kvr_client_set_group_offset(CA, "gp", "doc", 1000, NULL), 0);
    cr_assert_eq(group_put(CA, "gp", "doc", 2, 200, 100, NULL, 0, NULL, false, 0), 0);
    cr_assert_eq(group_put(CA, "gp", "sys", 3, 300, 30, NULL, 0, NULL, true, 10), 0,
                 "%s", kvr_client_last_error(CA));
    kvr_kv ka, kb;
    cr_assert_eq(get_kv(CA, "gp", 0, 0, NULL, &ka), 0);
    cr_assert_eq(get_kv(CB, "gp", 0, 0, NULL, &kb), 0, "%s", kvr_client_last_error(CB));
    cr_assert_eq(testd_metric(CB, "remote_fetch_hits"), 1);
    assert_same_meta(&ka, &kb);
    cr_assert_eq(ka.groups[0], 0);
    cr_assert_eq(ka.groups[40], 1);
    cr_assert_eq(ka.positions[40], 1000);
    release_same_layout(&ka, &kb, "gp");
    /* The layout works on B as on A: the next tokens of a group take the
     * same positions, a new group offset moves the same tokens. */
    cr_assert_eq(group_put(CA, "gp", "doc", 4, 400, 5, NULL, 0, NULL, false, 0), 0);
    cr_assert_eq(group_put(CB, "gp", "doc", 4, 400, 5, NULL, 0, NULL, false, 0), 0,
                 "%s", kvr_client_last_error(CB));
    cr_assert_eq(kvr_client_set_group_offset(CA, "gp", "sys", 7, NULL), 0);
    cr_assert_eq(kvr_client_set_group_offset(CB, "gp", "sys", 7, NULL), 0);
    get_both_same_meta("gp", &ka, &kb);
    cr_assert_eq(ka.positions[0], 7);
    cr_assert_eq(ka.positions[170], 1100);
    release_same_layout(&ka, &kb, "gp");
    /* Protection travelled (assert_same_layout compared it). */
    kvr_context sb;
    cr_assert_eq(kvr_client_stat(CB, "gp", &sb), 0);
    cr_assert_eq(sb.n_protected, 10);

    /* An APE document: its prefix record travels (the prefix itself is
     * another context, published or not). */
    cr_assert_eq(put_flags(CA, "pfx", 5, 10, 20, 0), 0);
    size_t len;
    void *pl = testd_payload(6, T_LAYERS, 0, 30, KVR_DTYPE_F16, &len);
    uint32_t *tok = testd_tokens(600, 30);
    kvr_put_args a = { .ctx_id = "ape", .model = "tiny", .dtype = KVR_DTYPE_F16, .tokens = tok,
                       .n_tokens = 30, .payload = pl, .payload_len = len,
                       .prefix_ctx = "pfx", .share_sync = true };
    cr_assert_eq(kvr_client_put(CA, &a, NULL), 0, "%s", kvr_client_last_error(CA));
    free(pl);
    free(tok);
    get_both_same_meta("ape", &ka, &kb);
    cr_assert_eq(ka.positions[0], 20);
    release_same_layout(&ka, &kb, "ape");
    kvr_layout_res lb;
    cr_assert_eq(kvr_client_layout_stat(CB, "ape", &lb), 0);
    cr_assert(lb.has_prefix);
    cr_assert_str_eq(lb.prefix_ctx, "pfx");
    cr_assert_eq(lb.prefix_len, 20);

    /* The record of a V cache imported transposed (Put.v_trans): a layout
     * of its own, which travels with the manifest. */
    pl = testd_payload(7, T_LAYERS, 0, 12, KVR_DTYPE_F16, &len);
    tok = testd_tokens(700, 12);
    kvr_put_args v = { .ctx_id = "vt", .model = "tiny", .dtype = KVR_DTYPE_F16, .tokens = tok,
                       .n_tokens = 12, .payload = pl, .payload_len = len, .v_trans = true,
                       .share_sync = true };
    cr_assert_eq(kvr_client_put(CA, &v, NULL), 0, "%s", kvr_client_last_error(CA));
    free(pl);
    free(tok);
    cr_assert_eq(get_kv(CB, "vt", 0, 0, NULL, &kb), 0, "%s", kvr_client_last_error(CB));
    kvr_kv_release(&kb);
    cr_assert_eq(kvr_client_stat(CB, "vt", &sb), 0);
    cr_assert(sb.v_trans, "B's copy says it came from a transposed V cache");
    cr_assert_eq(kvr_client_layout_stat(CB, "vt", &lb), 0);
    cr_assert(lb.v_trans && !lb.has_prefix && lb.n_groups == 0);
}

/* ---- crafted layouts in a manifest (issue 29, finding 2) ------------------ */

/* Puts n more tokens (ids base..) on c, appending, published synchronously. */
static int append_share(kvr_client *c, const char *ctx, uint32_t seed, uint32_t base, size_t n)
{
    size_t len;
    void *pl = testd_payload(seed, T_LAYERS, 0, n, KVR_DTYPE_F16, &len);
    uint32_t *tok = testd_tokens(base, n);
    kvr_put_args a = { .ctx_id = ctx, .model = "tiny", .dtype = KVR_DTYPE_F16, .tokens = tok,
                       .n_tokens = n, .payload = pl, .payload_len = len,
                       .mode = KVR_PUT_APPEND, .share = true, .share_sync = true };
    int r = kvr_client_put(c, &a, NULL);
    free(pl);
    free(tok);
    return r;
}

/* The manifest published for ctx, decoded. */
static void fetch_manifest(kvr_rc *rc, const char *ctx, kvr_rt_manifest *m)
{
    char mk[KVR_RT_KEY_MAX];
    kvr__rt_manifest_key(ctx, mk);
    const char *gv[] = { "GET", mk };
    size_t gl[] = { 3, strlen(mk) };
    redisReply *x;
    cr_assert_eq(kvr__rc_command(rc, 2, gv, gl, &x, NULL), 0);
    cr_assert_eq(x->type, REDIS_REPLY_STRING, "no manifest for %s", ctx);
    kvr_error e = { 0 };
    cr_assert_eq(kvr__rt_manifest_decode((const uint8_t *)x->str, x->len, ctx, m, &e), 0, "%s",
                 e.msg);
    freeReplyObject(x);
}

static void plant_manifest(kvr_rc *rc, const kvr_rt_manifest *m)
{
    char mk[KVR_RT_KEY_MAX];
    kvr__rt_manifest_key(m->ctx_id, mk);
    size_t ml;
    uint8_t *mv = kvr__rt_manifest_encode(m, &ml);
    cr_assert_not_null(mv);
    rc_set(rc, mk, mv, ml);
    kvr_mem_free(mv);
}

Test(int_cluster, crafted_layouts_are_misses)
{
    /* Every kind of layout travels first: retention (set on a context that
     * had no layout), retention on an APE document. */
    cr_assert_eq(put_flags(CA, "r", 1, 100, 30, 0), 0);
    cr_assert_eq(kvr_client_set_retention(CA, "r", 2, 8, false, NULL), 0);
    cr_assert_eq(append_share(CA, "r", 2, 200, 4), 0, "%s", kvr_client_last_error(CA));
    cr_assert_eq(put_flags(CA, "pfx", 5, 10, 20, 0), 0);
    size_t len;
    void *pl = testd_payload(6, T_LAYERS, 0, 30, KVR_DTYPE_F16, &len);
    uint32_t *tok = testd_tokens(600, 30);
    kvr_put_args a = { .ctx_id = "ar", .model = "tiny", .dtype = KVR_DTYPE_F16, .tokens = tok,
                       .n_tokens = 30, .payload = pl, .payload_len = len, .prefix_ctx = "pfx" };
    cr_assert_eq(kvr_client_put(CA, &a, NULL), 0, "%s", kvr_client_last_error(CA));
    free(pl);
    free(tok);
    cr_assert_eq(kvr_client_set_retention(CA, "ar", 1, 5, false, NULL), 0);
    cr_assert_eq(append_share(CA, "ar", 7, 700, 2), 0, "%s", kvr_client_last_error(CA));
    kvr_kv ka, kb;
    const char *kinds[] = { "r", "ar" };
    for (int k = 0; k < 2; k++) {
        cr_assert_eq(get_kv(CA, kinds[k], 0, 0, NULL, &ka), 0);
        cr_assert_eq(get_kv(CB, kinds[k], 0, 0, NULL, &kb), 0, "%s: %s", kinds[k],
                     kvr_client_last_error(CB));
        assert_same_meta(&ka, &kb);
        release_same_layout(&ka, &kb, kinds[k]);
    }
    /* Now planted manifests (well-formed, checksum right) whose layout no
     * verb would have set: each a miss on B, counted, B unharmed. */
    cr_assert_eq(put_flags(CA, "v", 8, 800, 20, SHARE_SYNC), 0);
    kvr_rc *rc = test_rc();
    kvr_rt_manifest good;
    fetch_manifest(rc, "v", &good);
    cr_assert_eq(good.n_tokens, 20);
    enum { RET_HUGE, RET_ZERO, RET_WRAP, GIDS_NO_GROUPS, APE_LEN, DROPPED, DUP_GROUPS,
           BAD_FLAG, N_CRAFT };
    for (int v = 0; v < N_CRAFT; v++) {
        kvr_rt_manifest m;
        fetch_manifest(rc, "v", &m);
        kvr_layout_info *L = &m.layout;
        switch (v) {
        case RET_HUGE: L->has_retention = true; L->sinks = L->window = (size_t)1 << 63; break;
        case RET_ZERO: L->has_retention = true; L->sinks = L->window = 0; break;
        case RET_WRAP: L->has_retention = true; L->sinks = SIZE_MAX; L->window = 1; break;
        case GIDS_NO_GROUPS: m.groups[3] = 1; break;
        case APE_LEN:
            L->has_prefix = true;
            snprintf(L->prefix_ctx, sizeof L->prefix_ctx, "pfx");
            L->prefix_fingerprint = MA.fingerprint;
            L->prefix_len = (size_t)1 << 63;
            break;
        case DROPPED: L->has_retention = true; L->sinks = 4; L->window = 16;
                      L->n_dropped = SIZE_MAX; break;
        case DUP_GROUPS:
            L->n_groups = 2;
            snprintf(L->groups[0].name, sizeof L->groups[0].name, "g");
            snprintf(L->groups[1].name, sizeof L->groups[1].name, "g");
            break;
        case BAD_FLAG: m.flags[5] = 1u << 30; break;
        }
        plant_manifest(rc, &m);
        kvr__rt_manifest_free(&m);
        double c0 = testd_metric(CB, "remote_fetch_corrupt");
        cr_assert_eq(get_kv(CB, "v", 0, 0, NULL, &kb), KVR_ENOCTX, "crafted %d: served", v);
        cr_assert_gt(testd_metric(CB, "remote_fetch_corrupt"), c0, "crafted %d: not counted", v);
        cr_assert_neq(kvr_client_stat(CB, "v", &(kvr_context){ 0 }), 0, "crafted %d: kept", v);
        /* B is alive and serves what it has. */
        cr_assert_eq(get_kv(CB, "r", 0, 0, NULL, &kb), 0, "crafted %d: B hurt", v);
        kvr_kv_release(&kb);
    }
    /* The good manifest back: a hit. */
    plant_manifest(rc, &good);
    kvr__rt_manifest_free(&good);
    cr_assert_eq(get_kv(CB, "v", 0, 0, NULL, &kb), 0, "%s", kvr_client_last_error(CB));
    kvr_kv_release(&kb);
    kvr__rc_destroy(rc);
}

/* ---- a cluster key: every value carries a MAC (issue 29, finding 5) ------- */

static char KEYF[300];

static void write_key(const char *path, const char *secret, int mode)
{
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fprintf(f, "%s\n", secret);
    fclose(f);
    cr_assert_eq(chmod(path, (mode_t)mode), 0);
}

static int start_keyed(kvr_testd *d, const char *seeds, const char *keyfile)
{
    const char *extra[] = { "--remote-tier", seeds, "--remote-auth-file", AUTH,
                            "--remote-key-file", keyfile, "--metrics-listen", "127.0.0.1:0",
                            "--log-level", getenv("KVR_T_DEBUG") ? "debug" : "info", NULL };
    return testd_start(d, extra);
}

static void setup_mac(void)
{
    cr_assert_eq(tcluster_start(&T), 0, "cluster did not start");
    write_auth("kvr kvrpass");
    snprintf(KEYF, sizeof KEYF, "%s/cluster.key", T.dir);
    write_key(KEYF, "c2VjcmV0LWNsdXN0ZXIta2V5LWZvci10aGUtdGVzdHMh", 0600);
    cr_assert_eq(start_keyed(&A, T.seeds, KEYF), 0);
    cr_assert_eq(start_keyed(&B, T.seeds, KEYF), 0);
    CA = testd_connect(&A);
    CB = testd_connect(&B);
    cr_assert(CA && CB);
    cr_assert_eq(testd_register(CA, "tiny", KVR_DTYPE_F16, &MA), 0);
    cr_assert_eq(testd_register(CB, "tiny", KVR_DTYPE_F16, NULL), 0);
}

TestSuite(int_cluster_mac, .init = setup_mac, .fini = teardown, .timeout = 240);

/* The raw value under key (malloc), *len bytes. */
static uint8_t *raw_get(kvr_rc *rc, const char *key, size_t *len)
{
    const char *gv[] = { "GET", key };
    size_t gl[] = { 3, strlen(key) };
    redisReply *x;
    cr_assert_eq(kvr__rc_command(rc, 2, gv, gl, &x, NULL), 0);
    cr_assert_eq(x->type, REDIS_REPLY_STRING, "nothing under %s", key);
    uint8_t *v = malloc(x->len);
    memcpy(v, x->str, x->len);
    *len = x->len;
    freeReplyObject(x);
    return v;
}

static uint32_t crc32c_sw(const uint8_t *p, size_t n)
{
    uint32_t c = ~0u;
    for (size_t i = 0; i < n; i++) {
        c ^= p[i];
        for (int k = 0; k < 8; k++)
            c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1)));
    }
    return ~c;
}

/* A daemon with the remote tier keyed by keyf does not start, and its log
 * names --remote-key-file and why; its directory is removed. */
static void key_refused(const char *keyf, const char *why)
{
    kvr_testd w;
    cr_assert_neq(start_keyed(&w, "127.0.0.1:1", keyf), 0, "started with key file %s", keyf);
    cr_assert(log_has(&w, "remote-key-file") && log_has(&w, why), "no clear error in %s",
              w.log);
    char rm[400];
    snprintf(rm, sizeof rm, "rm -rf %s", w.dir);
    if (system(rm) != 0)
        fprintf(stderr, "could not remove %s\n", w.dir);
}

Test(int_cluster_mac, sealed_values_travel_forged_ones_are_misses)
{
    cr_assert(log_has(&A, "keyed BLAKE2b MAC"), "no log line about the key");
    /* Sealed values travel: a get by id (manifest + streamed blocks) and a
     * match (probes, prefix keys, a block read whole). */
    cr_assert_eq(put_flags(CA, "m1", 3, 10, 130, SHARE_SYNC), 0, "%s",
                 kvr_client_last_error(CA));
    uint32_t *pr = testd_tokens(10, 100);
    for (int i = 40; i < 100; i++)
        pr[i] = 7;
    kvr_match_res mr;
    cr_assert_eq(kvr_client_match(CB, &(kvr_match_args){ .model = "tiny", .tokens = pr,
                                                         .n_tokens = 100 }, &mr), 0);
    cr_assert_eq(mr.length, 32, "a prefix key under the MAC");
    free(pr);
    kvr_kv kb;
    same_on_both("m1");
    cr_assert_eq(testd_metric(CB, "remote_fetch_forged"), 0);

    kvr_rc *rc = test_rc();
    uint8_t key[KVR_RT_KEY_BYTES];
    cr_assert_eq(kvr__rt_key_read(KEYF, key, NULL), 0);
    /* A manifest without a MAC (checksum right), then with a wrong one:
     * misses, counted as forged, never served. */
    cr_assert_eq(put_flags(CA, "m2", 4, 500, 70, SHARE_SYNC), 0);
    char mk[KVR_RT_KEY_MAX];
    kvr__rt_manifest_key("m2", mk);
    size_t ml;
    uint8_t *good = raw_get(rc, mk, &ml);
    cr_assert_gt(ml, KVR_RT_MAC_LEN);
    uint8_t mac[KVR_RT_MAC_LEN];
    kvr__rt_mac(key, mk, strlen(mk), good, ml - KVR_RT_MAC_LEN, mac);
    cr_assert_eq(memcmp(mac, good + ml - KVR_RT_MAC_LEN, KVR_RT_MAC_LEN), 0,
                 "the MAC is not the documented one");
    rc_set(rc, mk, good, ml - KVR_RT_MAC_LEN);
    double f0 = testd_metric(CB, "remote_fetch_forged");
    cr_assert_eq(get_kv(CB, "m2", 0, 0, NULL, &kb), KVR_ENOCTX, "an unsealed manifest served");
    cr_assert_gt(testd_metric(CB, "remote_fetch_forged"), f0);
    uint8_t *bad = malloc(ml);
    memcpy(bad, good, ml);
    bad[ml - 1] ^= 1;
    rc_set(rc, mk, bad, ml);
    f0 = testd_metric(CB, "remote_fetch_forged");
    cr_assert_eq(get_kv(CB, "m2", 0, 0, NULL, &kb), KVR_ENOCTX, "a wrong MAC served");
    cr_assert_gt(testd_metric(CB, "remote_fetch_forged"), f0);
    /* A good manifest moved under another context's key: its MAC names
     * the key it was written for. */
    cr_assert_eq(put_flags(CA, "m3", 5, 900, 70, SHARE_SYNC), 0);
    char mk3[KVR_RT_KEY_MAX];
    kvr__rt_manifest_key("m3", mk3);
    rc_set(rc, mk3, good, ml);
    f0 = testd_metric(CB, "remote_fetch_forged");
    cr_assert_eq(get_kv(CB, "m3", 0, 0, NULL, &kb), KVR_ENOCTX);
    cr_assert_gt(testd_metric(CB, "remote_fetch_forged"), f0);
    /* The good one back: a hit. */
    rc_set(rc, mk, good, ml);
    cr_assert_eq(get_kv(CB, "m2", 0, 0, NULL, &kb), 0, "%s", kvr_client_last_error(CB));
    kvr_kv_release(&kb);

    /* A forged block of m4 (K/V changed, CRC recomputed, the old MAC kept
     * or none at all): a miss, counted, never served. */
    cr_assert_eq(put_flags(CA, "m4", 6, 2000, 64, SHARE_SYNC), 0);
    kvr_rt_desc desc = { MA.fingerprint, T_LAYERS, T_HEADS, T_DIM, KVR_DTYPE_F16 };
    int64_t pos[64];
    uint32_t *tok = tokens_from_zero(2000, 64, pos);
    char bk[KVR_RT_KEY_MAX];
    kvr__rt_block_key(kvr__rt_chain_next(kvr__rt_chain_seed(&desc), tok, pos, 64), bk);
    free(tok);
    size_t bl;
    uint8_t *blk = raw_get(rc, bk, &bl);
    size_t body = bl - KVR_RT_MAC_LEN;
    blk[body - 100] ^= 0x40;
    uint32_t crc = crc32c_sw(blk, body - 4);
    memcpy(blk + body - 4, &crc, 4);
    rc_set(rc, bk, blk, bl);
    f0 = testd_metric(CB, "remote_fetch_forged");
    cr_assert_eq(get_kv(CB, "m4", 0, 0, NULL, &kb), KVR_ENOCTX, "a forged block served");
    cr_assert_gt(testd_metric(CB, "remote_fetch_forged"), f0);
    rc_set(rc, bk, blk, body);
    f0 = testd_metric(CB, "remote_fetch_forged");
    cr_assert_eq(get_kv(CB, "m4", 0, 0, NULL, &kb), KVR_ENOCTX, "an unsealed block served");
    cr_assert_gt(testd_metric(CB, "remote_fetch_forged"), f0);
    /* Sealed with the cluster key, the same forgery is taken: the MAC is
     * what makes the difference (a writer without the key cannot). */
    kvr__rt_mac(key, bk, strlen(bk), blk, body, blk + body);
    rc_set(rc, bk, blk, bl);
    cr_assert_eq(get_kv(CB, "m4", 0, 0, NULL, &kb), 0, "%s", kvr_client_last_error(CB));
    kvr_kv_release(&kb);
    free(blk);
    free(bad);
    free(good);
    kvr__rc_destroy(rc);
}

Test(int_cluster_start, key_file_refused_unless_private_and_long)
{
    memset(&T, 0, sizeof T);
    snprintf(T.dir, sizeof T.dir, "/tmp/kvr-rcl-XXXXXX");
    cr_assert_not_null(mkdtemp(T.dir));
    write_auth("kvr kvrpass");
    snprintf(KEYF, sizeof KEYF, "%s/cluster.key", T.dir);
    const struct { const char *secret; int mode; const char *why; } bad[] = {
        { "c2VjcmV0LWNsdXN0ZXIta2V5LWZvci10aGUtdGVzdHMh", 0644, "chmod 600" },
        { "short", 0600, "at least 32" },
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        write_key(KEYF, bad[i].secret, bad[i].mode);
        key_refused(KEYF, bad[i].why);
    }
    /* The I/O errors of reading it: a missing file (open fails), a
     * directory (open succeeds, the read fails with EISDIR). */
    char kd[400];
    snprintf(kd, sizeof kd, "%s/keydir", T.dir);
    cr_assert_eq(mkdir(kd, 0700), 0);
    key_refused(kd, "read error");
    char missing[400];
    snprintf(missing, sizeof missing, "%s/nope", T.dir);
    key_refused(missing, "remote-key-file");
    /* Without a key the log says whom the tier trusts. */
    kvr_testd d;
    cr_assert_eq(start_node(&d, "127.0.0.1:1"), 0);
    cr_assert(log_has(&d, "trusts everyone who can write"), "no warning in %s", d.log);
    testd_stop(&d);
    char rm[400];
    snprintf(rm, sizeof rm, "rm -rf %s", T.dir);
    if (system(rm) != 0)
        fprintf(stderr, "could not remove %s\n", T.dir);
}

Test(int_cluster_mac, quantized_values_sealed_and_checked)
{
    /* Chunks and window blocks are streamed into the put with their MACs. */
    cr_assert_eq(put_quant("qk", "kivi:k4v2:g32:r32", 62, 3000, 200, 70), 0, "%s",
                 kvr_client_last_error(CA));
    kvr_context sa;
    cr_assert_eq(kvr_client_stat(CA, "qk", &sa), 0);
    same_raw_codes("qk", 200 - sa.n_window);
    kvr_kv kb;
    /* Its first chunk with a wrong MAC: a miss, counted as forged. */
    cr_assert_eq(put_quant("qf", "int8/g32", 63, 4000, 300, 260), 0);
    kvr_rc *rc = test_rc();
    char mk[KVR_RT_KEY_MAX];
    kvr__rt_manifest_key("qf", mk);
    size_t ml;
    uint8_t *mv = raw_get(rc, mk, &ml);
    kvr_rt_manifest m;
    cr_assert_eq(kvr__rt_manifest_decode(mv, ml - KVR_RT_MAC_LEN, "qf", &m, NULL), 0);
    free(mv);
    char ck[KVR_RT_KEY_MAX];
    kvr__rt_chunk_key(m.chains[0], ck);
    kvr__rt_manifest_free(&m);
    size_t cl;
    uint8_t *cv = raw_get(rc, ck, &cl);
    cv[cl - 1] ^= 0x80;
    rc_set(rc, ck, cv, cl);
    free(cv);
    double f0 = testd_metric(CB, "remote_fetch_forged");
    cr_assert_eq(get_kv(CB, "qf", 0, 0, NULL, &kb), KVR_ENOCTX, "a forged chunk served");
    cr_assert_gt(testd_metric(CB, "remote_fetch_forged"), f0);
    kvr__rc_destroy(rc);
}

/* ---- big values are refused unread (issue 29, finding 3) ------------------ */

/* Peak resident memory of pid, KiB (VmHWM). */
static long peak_kib(pid_t pid)
{
    char p[64], line[256];
    snprintf(p, sizeof p, "/proc/%d/status", (int)pid);
    FILE *f = fopen(p, "r");
    cr_assert_not_null(f);
    long v = -1;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "VmHWM: %ld kB", &v) == 1)
            break;
    fclose(f);
    return v;
}

Test(int_cluster, big_values_refused_unread)
{
    /* A node capped at 64 MiB and 16 MiB under a manifest key (the issue
     * had 128 MiB against a 256 MiB cap; a 128 MiB SET makes the test
     * cluster, with its 1 s node timeout, fail over on this machine): as
     * garbage, and behind a manifest header that claims 2^22 tokens.
     * Neither is read: the get is a miss, counted, and the node's peak
     * memory does not grow by anything like the value. */
    kvr_testd C;
    const char *extra[] = { "--remote-tier", T.seeds, "--remote-auth-file", AUTH,
                            "--max-memory", "64M", NULL };
    kvr_client *cc = kvt_daemon_up_model(&C, extra, "tiny", KVR_DTYPE_F16);
    size_t big = (size_t)16 << 20;
    uint8_t *v = calloc(1, big);
    cr_assert_not_null(v);
    memset(v, 'x', big);
    kvr_rc *rc = test_rc();
    char mk[KVR_RT_KEY_MAX];
    kvr__rt_manifest_key("big", mk);
    rc_set(rc, mk, v, big);
    long p0 = peak_kib(C.pid);
    double c0 = testd_metric(cc, "remote_fetch_corrupt");
    kvr_kv kv;
    for (int i = 0; i < 4; i++)
        cr_assert_eq(get_kv(cc, "big", 0, 0, NULL, &kv), KVR_ENOCTX);
    cr_assert_gt(testd_metric(cc, "remote_fetch_corrupt"), c0);
    /* A real manifest's header, claiming 2^22 tokens. */
    cr_assert_eq(put_flags(CA, "big", 1, 1, 20, SHARE_SYNC), 0);
    kvr_rt_manifest m;
    fetch_manifest(rc, "big", &m);
    size_t ml;
    uint8_t *mv = kvr__rt_manifest_encode(&m, &ml);
    kvr__rt_manifest_free(&m);
    memcpy(v, mv, 568);                      /* MANIFEST_HDR */
    kvr_mem_free(mv);
    uint64_t nt = (uint64_t)1 << 22, nb = nt / KVR_RT_BLOCK;
    memcpy(v + 40, &nt, 8);
    memcpy(v + 48, &nb, 8);
    rc_set(rc, mk, v, big);
    free(v);
    c0 = testd_metric(cc, "remote_fetch_corrupt");
    for (int i = 0; i < 4; i++)
        cr_assert_eq(get_kv(cc, "big", 0, 0, NULL, &kv), KVR_ENOCTX);
    cr_assert_gt(testd_metric(cc, "remote_fetch_corrupt"), c0);
    long p1 = peak_kib(C.pid);
    cr_assert_lt(p1 - p0, 8 * 1024, "peak memory grew by %ld KiB reading refused values",
                 p1 - p0);
    kvr__rc_destroy(rc);
    kvt_daemon_down(&C, &cc, NULL);
}

/* ---- a hung cluster (issue 29, finding 4) ---------------------------------- */

#include <signal.h>
#include <time.h>

static double mono_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* SIGSTOPs (or SIGCONTs) every server of the cluster: their sockets still
 * accept connections (the kernel's backlog), nothing ever answers. */
static void cluster_signal(int sig)
{
    for (int k = 0; k < 6; k++) {
        char pf[300];
        snprintf(pf, sizeof pf, "%s/%d/redis.pid", T.dir, T.ports[k]);
        FILE *f = fopen(pf, "r");
        cr_assert_not_null(f, "%s", pf);
        int pid = 0;
        cr_assert_eq(fscanf(f, "%d", &pid), 1);
        fclose(f);
        cr_assert_eq(kill(pid, sig), 0);
    }
}

/* The documented deadlines (docs/cluster.md: a fetch 3 s, a publication
 * 5 s); the test allows three times each. */
#define FETCH_S 3.0
#define PUBLISH_S 5.0

Test(int_cluster, hung_cluster_deadlines_hold, .timeout = 300)
{
    cr_assert_eq(put_flags(CA, "warm", 1, 1, 70, SHARE_SYNC), 0);   /* both joined */
    kvr_kv kv;
    cr_assert_eq(get_kv(CB, "warm", 0, 0, NULL, &kv), 0);
    kvr_kv_release(&kv);
    cluster_signal(SIGSTOP);
    /* A get of an id B does not have: a miss, within the deadline. */
    double t0 = mono_s();
    cr_assert_eq(get_kv(CB, "elsewhere", 0, 0, NULL, &kv), KVR_ENOCTX);
    double dt = mono_s() - t0;
    cr_assert_lt(dt, 3 * FETCH_S, "a get took %.1f s with the cluster hung", dt);
    /* A match of a prompt B does not hold. */
    uint32_t *pr = testd_tokens(5000, 300);
    kvr_match_res mr;
    t0 = mono_s();
    cr_assert_eq(kvr_client_match(CB, &(kvr_match_args){ .model = "tiny", .tokens = pr,
                                                         .n_tokens = 300 }, &mr), 0);
    dt = mono_s() - t0;
    cr_assert_eq(mr.length, 0);
    cr_assert_lt(dt, 3 * FETCH_S, "a match took %.1f s with the cluster hung", dt);
    free(pr);
    /* 12 asynchronous shares, then a synchronous one behind them: answered
     * ("stored locally, not shared") within its deadline; the put stands. */
    for (int i = 0; i < 12; i++) {
        char id[32];
        snprintf(id, sizeof id, "async-%d", i);
        cr_assert_eq(put_flags(CA, id, 2, 100, 70, SHARE), 0, "%s", kvr_client_last_error(CA));
    }
    t0 = mono_s();
    int r = put_flags(CA, "sync", 3, 200, 70, SHARE_SYNC);
    dt = mono_s() - t0;
    cr_assert_eq(r, KVR_EIO, "%s", kvr_client_last_error(CA));
    cr_assert(strstr(kvr_client_last_error(CA), "stored locally"), "%s",
              kvr_client_last_error(CA));
    cr_assert_lt(dt, 3 * PUBLISH_S, "a share_sync took %.1f s with the cluster hung", dt);
    cr_assert_eq(get_kv(CA, "sync", 0, 0, NULL, &kv), 0);
    kvr_kv_release(&kv);
    /* 300 more shares: the queue is bounded, the rest dropped and counted;
     * every local put goes on succeeding (no E_NO_MEMORY). */
    for (int i = 0; i < 300; i++) {
        char id[32];
        snprintf(id, sizeof id, "many-%d", i);
        cr_assert_eq(put_flags(CA, id, 4, 300, 70, SHARE), 0, "put %d: %s", i,
                     kvr_client_last_error(CA));
    }
    cr_assert_gt(testd_metric(CA, "remote_publish_dropped"), 0);
    cr_assert_eq(put_flags(CA, "local", 5, 400, 70, 0), 0, "%s", kvr_client_last_error(CA));
    cluster_signal(SIGCONT);
}

/* Every verb that names a context, or matches a prefix, sees a context
 * another node published the same way: the cluster is a tier under B's
 * store, asked on a miss (not by a few verbs of the daemon's). Each verb
 * below (stat, the CLI's get, fork, pin, layout_stat, edit, match) meets
 * the miss itself: B deletes its landed copy before the next.
 * The CLI's get stats the context first, which is how a user met this. */
Test(int_cluster, every_verb_sees_published_contexts)
{
    cr_assert_eq(put_flags(CA, "pub", 11, 3000, 150, SHARE_SYNC), 0);
    kvr_kv ka;
    cr_assert_eq(get_kv(CA, "pub", 0, 0, NULL, &ka), 0);

    kvr_context ci;
    cr_assert_eq(kvr_client_stat(CB, "pub", &ci), 0, "stat: %s", kvr_client_last_error(CB));
    cr_assert_eq(ci.n_tokens, 150);
    cr_assert_eq(kvr_client_delete(CB, "pub"), 0);

    char raw[300], out[256];
    snprintf(raw, sizeof raw, "%s/pub.raw", B.dir);
    cr_assert_eq(testd_cli(&B, out, sizeof out, (const char *const[]){ "get", "pub", "-o", raw,
                                                                       NULL }), 0,
                 "kvrope get of a published context failed: %s", out);
    FILE *f = fopen(raw, "rb");
    cr_assert_not_null(f);
    uint8_t *got = malloc(ka.payload_len + 1);
    cr_assert_eq(fread(got, 1, ka.payload_len + 1, f), ka.payload_len);
    fclose(f);
    unlink(raw);
    cr_assert_eq(memcmp(got, ka.payload, ka.payload_len), 0, "the CLI's get differs from A's");
    free(got);
    cr_assert_eq(kvr_client_delete(CB, "pub"), 0);

    cr_assert_eq(kvr_client_fork(CB, "pub", "pub2"), 0, "fork: %s", kvr_client_last_error(CB));
    cr_assert_eq(kvr_client_stat(CB, "pub2", &ci), 0);
    cr_assert_eq(ci.n_tokens, 150);
    cr_assert_eq(kvr_client_delete(CB, "pub2"), 0);
    cr_assert_eq(kvr_client_delete(CB, "pub"), 0);

    cr_assert_eq(kvr_client_pin(CB, "pub", true), 0, "pin: %s", kvr_client_last_error(CB));
    cr_assert_eq(kvr_client_pin(CB, "pub", false), 0);
    cr_assert_eq(kvr_client_delete(CB, "pub"), 0);

    kvr_layout_res lr;
    cr_assert_eq(kvr_client_layout_stat(CB, "pub", &lr), 0, "layout_stat: %s",
                 kvr_client_last_error(CB));
    cr_assert_eq(kvr_client_delete(CB, "pub"), 0);

    /* An edit (PIE) of the published context: tokens [10, 20) removed from
     * B's copy; A's is untouched. */
    kvr_edit_range cut = { .start = 10, .end = 20 };
    cr_assert_eq(kvr_client_edit(CB, &(kvr_edit_args){ .ctx_id = "pub", .ops = &cut,
                                                       .n_ops = 1 }, NULL), 0,
                 "edit: %s", kvr_client_last_error(CB));
    cr_assert_eq(kvr_client_stat(CB, "pub", &ci), 0);
    cr_assert_eq(ci.n_tokens, 140);
    cr_assert_eq(kvr_client_stat(CA, "pub", &ci), 0);
    cr_assert_eq(ci.n_tokens, 150);
    cr_assert_eq(kvr_client_delete(CB, "pub"), 0);

    /* A match of its tokens (and more): all 150 found, bit-exact. */
    uint32_t *prompt = prompt_after(testd_tokens(3000, 170), 150, 170, 9);
    kvr_match_res m;
    cr_assert_eq(match_kv(CB, prompt, 170, &m), 0);
    cr_assert_eq(m.length, 150, "match: %llu", (unsigned long long)m.length);
    cr_assert(m.has_kv);
    cr_assert_eq(m.kv.payload_len, ka.payload_len);
    cr_assert_eq(memcmp(m.kv.payload, ka.payload, ka.payload_len), 0);
    kvr_kv_release(&m.kv);
    free(prompt);

    /* What the cluster does not hold stays a plain miss for every verb. */
    cr_assert_eq(kvr_client_stat(CB, "nowhere", &ci), KVR_ENOCTX);
    cr_assert(strstr(kvr_client_last_error(CB), "nowhere"), "%s", kvr_client_last_error(CB));
    cr_assert_eq(kvr_client_fork(CB, "nowhere", "x"), KVR_ENOCTX);
    cr_assert_eq(testd_cli(&B, out, sizeof out, (const char *const[]){ "get", "nowhere", "-o",
                                                                       raw, NULL }) != 0, 1);
    kvr_kv_release(&ka);
}

/* ---- two clients asking B for the same id at once ------------------------ */

typedef struct same_get {
    kvr_client        *c;
    pthread_barrier_t *go;
    const char        *id;          /* NULL: "both" */
    kvr_kv             kv;
    int                rc;
    char               err[300];
} same_get;

static void *same_get_run(void *arg)
{
    same_get *s = arg;
    pthread_barrier_wait(s->go);
    s->rc = get_kv(s->c, s->id ? s->id : "both", 0, 0, NULL, &s->kv);
    if (s->rc != 0)
        snprintf(s->err, sizeof s->err, "%s", kvr_client_last_error(s->c));
    return NULL;
}

/* Two clients' gets of one id, released at the same moment. */
typedef struct get_pair {
    pthread_barrier_t go;
    same_get          s[2];
    pthread_t         t[2];
} get_pair;

/* Starts both gets (c1's and c2's of id) and returns once they are released. */
static void pair_start(get_pair *p, kvr_client *c1, kvr_client *c2, const char *id)
{
    kvr_client *c[2] = { c1, c2 };
    pthread_barrier_init(&p->go, NULL, 3);
    for (int k = 0; k < 2; k++) {
        p->s[k] = (same_get){ .c = c[k], .go = &p->go, .id = id };
        pthread_create(&p->t[k], NULL, same_get_run, &p->s[k]);
    }
    pthread_barrier_wait(&p->go);
}

static void pair_join(get_pair *p)
{
    for (int k = 0; k < 2; k++)
        pthread_join(p->t[k], NULL);
    pthread_barrier_destroy(&p->go);
}

/* Two clients of B get a context only the cluster holds at the same moment:
 * whichever misses while the other's fetch is landing waits for it (its own
 * put of the same id would be refused as "being written") and is then
 * answered from what landed. Both get A's bytes; B fetched it once a round. */
Test(int_cluster, two_clients_get_one_id_at_once)
{
    enum { N = 8192, ROUNDS = 6 };
    cr_assert_eq(put_flags(CA, "both", 21, 4000, N, SHARE_SYNC), 0);
    kvr_kv ka;
    cr_assert_eq(get_kv(CA, "both", 0, 0, NULL, &ka), 0);
    kvr_client *c1 = testd_connect(&B), *c2 = testd_connect(&B);
    cr_assert(c1 && c2);
    double hits0 = testd_metric(CB, "remote_fetch_hits");
    for (int round = 0; round < ROUNDS; round++) {
        get_pair p;
        pair_start(&p, c1, c2, "both");
        pair_join(&p);
        for (int k = 0; k < 2; k++) {
            cr_assert_eq(p.s[k].rc, 0, "round %d, client %d: %s", round, k + 1, p.s[k].err);
            assert_same(&ka, &p.s[k].kv);
            kvr_kv_release(&p.s[k].kv);
        }
        cr_assert_eq(testd_metric(CB, "remote_fetch_hits"), hits0 + round + 1,
                     "round %d: B fetched the context more than once", round);
        cr_assert_eq(kvr_client_delete(CB, "both"), 0);
    }
    kvr_client_close(c1);
    kvr_client_close(c2);
    kvr_kv_release(&ka);
}

/* B is stopped while one client's request fetches a context and another's
 * waits for that fetch: both are answered (the fetch lands within the stop's
 * grace, the waiter is served from it) or see their connection end, none
 * hangs, and B exits cleanly (under the sanitizers: nothing leaked, the
 * waiter's parking included). */
Test(int_cluster, stop_while_a_request_waits_for_a_fetch)
{
    enum { N = 32768 };
    cr_assert_eq(put_flags(CA, "late", 31, 7000, N, SHARE_SYNC), 0);
    kvr_kv ka;
    cr_assert_eq(get_kv(CA, "late", 0, 0, NULL, &ka), 0);
    kvr_client *c1 = testd_connect(&B), *c2 = testd_connect(&B);
    cr_assert(c1 && c2);
    get_pair p;
    pair_start(&p, c1, c2, "late");
    usleep(3000);
    cr_assert_eq(testd_stop(&B), 0, "B did not exit cleanly while a request waited for a fetch");
    pair_join(&p);
    for (int k = 0; k < 2; k++) {
        if (p.s[k].rc == 0)
            assert_same(&ka, &p.s[k].kv);
        kvr_kv_release(&p.s[k].kv);
    }
    kvr_client_close(c1);
    kvr_client_close(c2);
    kvr_kv_release(&ka);
}

/* ---- a client that goes away while B fetches for it ------------------------ */

#include <sys/socket.h>
#include <sys/un.h>
#include "kvrope.pb-c.h"
#include "proto/frame.h"
#include "tests/common/kvt_wire.h"

/* Sends a get of ctx on a raw connection to sock and returns the socket
 * without reading anything (-1 on failure). */
static int send_get_raw(const char *sock, const char *ctx)
{
    Kvrope__Get g = KVROPE__GET__INIT;
    g.context_id = (char *)(uintptr_t)ctx;
    Kvrope__Request q = KVROPE__REQUEST__INIT;
    q.id = 1;
    q.body_case = KVROPE__REQUEST__BODY_GET;
    q.get = &g;
    return kvt_wire_send_raw(sock, &q, 0);
}

/* Opens a create-put of ctx (one token of the tiny model) on a raw
 * connection to sock and sends no payload: the context stays pending (the
 * put open) until the socket closes. The socket, or -1. */
static int open_put_raw(const char *sock, const char *ctx)
{
    return kvt_wire_open_put(sock, ctx, "tiny", KVROPE__PUT_MODE__CREATE,
                             kvr_payload_size(T_LAYERS, 1, T_HEADS, T_DIM, KVR_DTYPE_F16));
}

/* A client's own put of an id is open on B (its payload not sent) while
 * another client gets that id, which the cluster holds: the get is a plain
 * miss at once (no wait: only a fetch's put is waited for; nothing of the
 * cluster's lands over the open put). Once the put is gone, the get
 * fetches it. */
Test(int_cluster, a_clients_open_put_is_not_waited_for)
{
    cr_assert_eq(put_flags(CA, "busy", 41, 9000, 300, SHARE_SYNC), 0);
    kvr_kv ka;
    cr_assert_eq(get_kv(CA, "busy", 0, 0, NULL, &ka), 0);
    double puts = testd_metric(CB, "requests_put");
    int fd = open_put_raw(B.sock, "busy");
    cr_assert(fd >= 0);
    /* The put is open (pending) once B counted it (stats never fetch). */
    for (int i = 0; i < 200 && testd_metric(CB, "requests_put") < puts + 1; i++)
        usleep(5000);
    cr_assert_eq(testd_metric(CB, "requests_put"), puts + 1, "the raw put never came");
    kvr_kv kb;
    cr_assert_eq(get_kv(CB, "busy", 0, 0, NULL, &kb), KVR_ENOCTX, "%s",
                 kvr_client_last_error(CB));
    close(fd);
    int rc = KVR_ENOCTX;
    for (int i = 0; i < 200 && (rc = get_kv(CB, "busy", 0, 0, NULL, &kb)) != 0; i++)
        usleep(5000);    /* until B saw the close and aborted the put */
    cr_assert_eq(rc, 0, "%s", kvr_client_last_error(CB));
    assert_same(&ka, &kb);
    kvr_kv_release(&kb);
    kvr_kv_release(&ka);
}

/* A client asks B for a context only the cluster holds and closes its
 * connection at once, while a second client asks for the same id: whether
 * the second waited for the first's fetch (then aborted with its
 * connection: nothing half-landed) or fetched it itself, it gets A's bytes,
 * and B goes on serving. */
Test(int_cluster, client_gone_during_fetch)
{
    enum { N = 8192, ROUNDS = 6 };
    kvr_kv ka[ROUNDS];
    char id[ROUNDS][16];
    for (int round = 0; round < ROUNDS; round++) {
        snprintf(id[round], sizeof id[round], "gone%d", round);
        /* Tokens of their own: equal tokens would be equal blocks (keys). */
        uint32_t base = 100000 + 10000 * (uint32_t)round;
        cr_assert_eq(put_flags(CA, id[round], 23 + (uint32_t)round, base, N, SHARE_SYNC), 0);
        cr_assert_eq(get_kv(CA, id[round], 0, 0, NULL, &ka[round]), 0);
    }
    for (int round = 0; round < ROUNDS; round++) {
        int fd = send_get_raw(B.sock, id[round]);
        cr_assert(fd >= 0);
        if (round % 2)
            usleep(2000);       /* the first fetch under way (its put open, likely) */
        close(fd);
        kvr_kv kb;
        cr_assert_eq(get_kv(CB, id[round], 0, 0, NULL, &kb), 0, "round %d: %s", round,
                     kvr_client_last_error(CB));
        assert_same(&ka[round], &kb);
        kvr_kv_release(&kb);
    }
    /* The abandoned requests end too (their fetches landed whole before the
     * close was seen, or were aborted with it): whatever B holds of each id
     * now is all of A's. */
    usleep(200 * 1000);
    for (int round = 0; round < ROUNDS; round++) {
        kvr_kv kb;
        cr_assert_eq(get_kv(CB, id[round], 0, 0, NULL, &kb), 0, "%s",
                     kvr_client_last_error(CB));
        assert_same(&ka[round], &kb);
        kvr_kv_release(&kb);
        kvr_kv_release(&ka[round]);
    }
    cr_assert(testd_alive(&B));
}
