/*
 * test_int_cover.c — Cover end to end through kvroped and libkvrope (and
 * the kvrope CLI): a prompt built from three cached contexts' chunks
 * shuffled behind a new header is covered by runs at the right offsets;
 * the placed get returns every run's keys rotated to their place in the
 * prompt (checked against a fresh rope(E[token], position) computed here,
 * within one f16 rounding), values bit for bit, seams flagged; the same
 * into a caller's buffer and into shared memory; bad input refused with
 * the connection and the store intact.
 */
#include <criterion/criterion.h>
#include <math.h>

#include "tests/common/kvr_testd.h"

static kvr_testd D;
static kvr_client *C;
static kvr_rope *R;
static const kvr_dtype DT = KVR_DTYPE_F16;

static void setup(void)
{
    cr_assert_eq(testd_start(&D, NULL), 0, "daemon did not start");
    C = testd_connect(&D);
    cr_assert_not_null(C);
    kvr_model m;
    cr_assert_eq(testd_register(C, "tiny", DT, &m), 0, "%s", kvr_client_last_error(C));
    kvr_error err = { 0 };
    cr_assert_eq(kvr_rope_create(&R, &m.rope, &err), 0, "%s", err.msg);
}

static void teardown(void)
{
    kvr_rope_destroy(R);
    kvr_client_close(C);
    testd_stop(&D);
}

TestSuite(int_cover, .init = setup, .fini = teardown, .timeout = 180);

static void put_ids(const char *ctx, const uint32_t *tok, size_t n)
{
    int64_t *pos = malloc(n * sizeof *pos);
    for (size_t i = 0; i < n; i++)
        pos[i] = (int64_t)i;
    size_t len;
    void *pl = testd_rope_kv(R, DT, tok, pos, n, &len);
    cr_assert_not_null(pl);
    kvr_put_args a = { .ctx_id = ctx, .model = "tiny", .dtype = DT, .tokens = tok,
                       .n_tokens = n, .has_pos_start = true, .payload = pl,
                       .payload_len = len, .mode = KVR_PUT_UPSERT };
    cr_assert_eq(kvr_client_put(C, &a, NULL), 0, "%s", kvr_client_last_error(C));
    free(pl);
    free(pos);
}

/* The stream's keys are rope(E[tok], its position), values E_V[tok]. */
static void check_kv(const kvr_kv *kv, const void *payload)
{
    char msg[200];
    cr_assert_eq(testd_rope_kv_check(R, kv, payload, msg, sizeof msg), 0, "%s", msg);
}

/* a: ids 1000.., b: 2000.., c: 3000.. (100 tokens each); the prompt is 7
 * new tokens, c[10..70), a[0..40), b[20..100). */
static size_t build(uint32_t *q)
{
    uint32_t *a = testd_tokens(1000, 100), *b = testd_tokens(2000, 100),
             *c = testd_tokens(3000, 100);
    put_ids("a", a, 100);
    put_ids("b", b, 100);
    put_ids("c", c, 100);
    size_t n = 0;
    for (uint32_t i = 0; i < 7; i++)
        q[n++] = 9000 + i;
    memcpy(q + n, c + 10, 60 * 4), n += 60;
    memcpy(q + n, a, 40 * 4), n += 40;
    memcpy(q + n, b + 20, 80 * 4), n += 80;
    free(a);
    free(b);
    free(c);
    return n;
}

Test(int_cover, runs_gaps_and_the_placed_kv)
{
    uint32_t q[200];
    size_t n = build(q);
    kvr_cover_args ca = { .model = "tiny", .tokens = q, .n_tokens = n, .dtype = DT,
                          .pos_base = 11 };
    kvr_cover_res r;
    cr_assert_eq(kvr_client_cover(C, &ca, &r), 0, "%s", kvr_client_last_error(C));
    cr_assert_eq(r.n_prompt, n);
    cr_assert_eq(r.n_runs, 3);
    cr_assert_not(r.has_kv);
    const struct { uint64_t p; const char *id; uint64_t c, len; } want[3] = {
        { 7, "c", 10, 60 }, { 67, "a", 0, 40 }, { 107, "b", 20, 80 } };
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(r.runs[i].prompt_off, want[i].p, "run %d", i);
        cr_assert_str_eq(r.runs[i].ctx_id, want[i].id);
        cr_assert_eq(r.runs[i].ctx_off, want[i].c);
        cr_assert_eq(r.runs[i].n_tokens, want[i].len);
        cr_assert_not(r.runs[i].exact);
    }
    cr_assert_eq(r.n_gaps, 1);
    cr_assert_eq(r.gaps[0].prompt_off, 0);
    cr_assert_eq(r.gaps[0].n_tokens, 7);
    kvr_cover_release(&r);
    /* the index is in the figures: 300 cached tokens, about 6.5 bytes each */
    cr_assert_geq(testd_metric(C, "cover_index_bytes"), 300 * 6);
    cr_assert_eq(testd_metric(C, "cover_index_lagging_contexts"), 0);
    cr_assert_eq(testd_metric(C, "requests_cover"), 1);

    /* the placed K/V: library buffer */
    cr_assert_eq(kvr_client_cover_get(C, &ca, &r), 0, "%s", kvr_client_last_error(C));
    cr_assert(r.has_kv);
    cr_assert_eq(r.kv.n_tokens, 180);
    for (size_t i = 0; i < r.n_runs; i++)
        for (uint64_t j = 0; j < r.runs[i].n_tokens; j++) {
            uint64_t s = r.runs[i].stream_off + j, p = r.runs[i].prompt_off + j;
            cr_assert_eq(r.kv.tokens[s], q[p]);
            cr_assert_eq(r.kv.positions[s], 11 + (int64_t)p);
            cr_assert(r.kv.flags[s] & KVR_TOKEN_APPROX, "seams are approximate");
        }
    check_kv(&r.kv, r.kv.payload);
    size_t bytes = r.kv.payload_len;
    void *lib = malloc(bytes);
    memcpy(lib, r.kv.payload, bytes);
    kvr_cover_release(&r);

    /* into the caller's buffer */
    void *buf = malloc(bytes);
    ca.dst = buf;
    ca.dst_cap = bytes;
    cr_assert_eq(kvr_client_cover_get(C, &ca, &r), 0, "%s", kvr_client_last_error(C));
    cr_assert_eq(r.kv.payload, buf);
    cr_assert_eq(memcmp(buf, lib, bytes), 0);
    kvr_cover_release(&r);
    ca.dst = NULL;
    ca.dst_cap = 0;

    /* into shared memory */
    uint32_t region;
    void *base;
    cr_assert_eq(kvr_client_region_create(C, 1 << 20, &region, &base), 0, "%s",
                 kvr_client_last_error(C));
    kvr_shm at = { .region = region, .offset = 4096 };
    cr_assert_eq(kvr_client_cover_shm(C, &ca, &at, &r), 0, "%s", kvr_client_last_error(C));
    cr_assert_eq(r.kv.payload, (uint8_t *)base + 4096);
    cr_assert_eq(memcmp(r.kv.payload, lib, bytes), 0);
    kvr_cover_release(&r);
    /* a slice too small: refused, nothing written past it */
    kvr_shm small = { .region = region, .offset = 0, .length = 64 };
    cr_assert_eq(kvr_client_cover_shm(C, &ca, &small, &r), KVR_ERANGE);
    free(buf);
    free(lib);
}

Test(int_cover, exact_prefix_is_not_flagged)
{
    uint32_t q[200];
    build(q);
    uint32_t *a = testd_tokens(1000, 100), *b = testd_tokens(2000, 100);
    memcpy(q, a, 50 * 4);
    memcpy(q + 50, b + 50, 30 * 4);
    kvr_cover_args ca = { .model = "tiny", .tokens = q, .n_tokens = 80, .dtype = DT };
    kvr_cover_res r;
    cr_assert_eq(kvr_client_cover_get(C, &ca, &r), 0, "%s", kvr_client_last_error(C));
    cr_assert_eq(r.n_runs, 2);
    cr_assert(r.runs[0].exact && !r.runs[1].exact);
    for (size_t i = 0; i < 80; i++)
        cr_assert_eq((r.kv.flags[i] & KVR_TOKEN_APPROX) != 0, i >= 50, "token %zu", i);
    check_kv(&r.kv, r.kv.payload);
    kvr_cover_release(&r);
    free(a);
    free(b);
}

Test(int_cover, bad_input_keeps_everything)
{
    uint32_t q[200];
    size_t n = build(q);
    kvr_cover_res r;
    kvr_cover_args ca = { .model = "nope", .tokens = q, .n_tokens = n };
    cr_assert_eq(kvr_client_cover(C, &ca, &r), KVR_ENOMODEL);
    cr_assert(strstr(kvr_client_last_error(C), "nope"), "%s", kvr_client_last_error(C));
    ca.model = "tiny";
    ca.n_tokens = 0;
    cr_assert_eq(kvr_client_cover(C, &ca, &r), KVR_EINVAL);
    cr_assert(strstr(kvr_client_last_error(C), "empty"), "%s", kvr_client_last_error(C));
    uint32_t *huge = calloc(KVR_COVER_MAX_TOKENS + 1, sizeof *huge);
    ca.tokens = huge;
    ca.n_tokens = KVR_COVER_MAX_TOKENS + 1;
    cr_assert_eq(kvr_client_cover(C, &ca, &r), KVR_ETOOLARGE);
    free(huge);
    ca.tokens = q;
    ca.n_tokens = n;
    ca.min_run = KVR_COVER_MAX_TOKENS + 1;
    cr_assert_eq(kvr_client_cover(C, &ca, &r), KVR_EINVAL);
    ca.min_run = 0;
    ca.layers = (const uint32_t[]){ 9 };
    ca.n_layers = 1;
    ca.dtype = DT;
    cr_assert_eq(kvr_client_cover_get(C, &ca, &r), KVR_ERANGE, "%s", kvr_client_last_error(C));
    ca.layers = NULL;
    ca.n_layers = 0;
    ca.pos_base = -1;
    cr_assert_eq(kvr_client_cover_get(C, &ca, &r), KVR_EINVAL, "%s", kvr_client_last_error(C));
    ca.pos_base = 0;
    /* the connection and the store are intact */
    kvr_context x;
    cr_assert_eq(kvr_client_stat(C, "a", &x), 0);
    cr_assert_eq(x.n_tokens, 100);
    cr_assert_eq(kvr_client_cover(C, &ca, &r), 0, "%s", kvr_client_last_error(C));
    cr_assert_eq(r.n_covered, 180);
    kvr_cover_release(&r);
}

Test(int_cover, cli)
{
    uint32_t q[200];
    size_t n = build(q);
    char path[400], out[8192], st[400], list[2048];
    snprintf(path, sizeof path, "%s/prompt.txt", D.dir);
    FILE *f = fopen(path, "w");
    for (size_t i = 0; i < n; i++)
        fprintf(f, "%u%s", q[i], i + 1 < n ? "," : "\n");
    fclose(f);
    const char *human[] = { "cover", "--model", "tiny", "--tokens-file", path, NULL };
    cr_assert_eq(testd_cli(&D, out, sizeof out, human), 0, "%s", out);
    cr_assert(strstr(out, "3 runs, 180 tokens cached"), "%s", out);
    cr_assert(strstr(out, "gap [0, 7)"), "%s", out);
    const char *json[] = { "cover", "--model", "tiny", "--tokens-file", path, "--json", NULL };
    cr_assert_eq(testd_cli(&D, out, sizeof out, json), 0, "%s", out);
    cr_assert(strstr(out, "\"prompt_start\":\t7") || strstr(out, "\"prompt_start\": 7") ||
              strstr(out, "\"prompt_start\":7"), "%s", out);
    snprintf(st, sizeof st, "%s/placed.safetensors", D.dir);
    const char *get[] = { "cover", "--model", "tiny", "--tokens-file", path, "--get", "-o", st,
                          "--pos-base", "5", NULL };
    cr_assert_eq(testd_cli(&D, out, sizeof out, get), 0, "%s", out);
    cr_assert(strstr(out, "-> "), "%s", out);
    struct stat sb;
    cr_assert_eq(stat(st, &sb), 0);
    cr_assert_gt(sb.st_size, 180 * T_LAYERS * 2 * T_HEADS * T_DIM * 2);
    /* nothing cached: exit 3; min_run 0: a usage error */
    snprintf(list, sizeof list, "%s", "77777,77778,77779,77780,77781,77782,77783,77784,"
             "77785,77786,77787,77788,77789,77790,77791,77792,77793");
    const char *none[] = { "cover", "--model", "tiny", "--tokens", list, NULL };
    cr_assert_eq(testd_cli(&D, out, sizeof out, none), 3, "%s", out);
    const char *bad[] = { "cover", "--model", "tiny", "--tokens", list, "--min-run", "0", NULL };
    cr_assert_eq(testd_cli(&D, out, sizeof out, bad), 2, "%s", out);
}
