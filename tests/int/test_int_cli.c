/*
 * test_int_cli.c — the kvrope command-line tool against a real daemon:
 * raw and safetensors put/get round trips (bit-exact, and the safetensors
 * file read back independently), --json output parsed with cJSON, exit
 * codes for success, daemon errors, usage, not-found and connect failures.
 */
#include <criterion/criterion.h>
#include <cjson/cJSON.h>

#include "tests/common/kvt_daemon.h"
#include "tests/common/kvt.h"

static kvr_testd D;
static kvr_client *C;
static char OUT[1 << 16];

static void setup(void)
{
    C = kvt_daemon_up(&D, NULL);
}

static void teardown(void)
{
    kvr_client_close(C);
    C = NULL;
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "rm -f %s/*.bin %s/*.raw %s/*.safetensors %s/*.txt %s/*.json",
             D.dir, D.dir, D.dir, D.dir, D.dir);
    if (system(cmd) != 0) {
    }
    testd_stop(&D);
}

TestSuite(int_cli, .init = setup, .fini = teardown, .timeout = 120);

#define CLI(...) KVT_CLI(&D, OUT, __VA_ARGS__)

static void path(char *buf, size_t cap, const char *name)
{
    snprintf(buf, cap, "%s/%s", D.dir, name);
}

Test(int_cli, ping_stats_models_json)
{
    cr_assert_eq(CLI("ping"), 0);
    cr_assert(strstr(OUT, "kvroped") != NULL);
    cr_assert_eq(CLI("--json", "ping"), 0);
    cJSON *j = kvt_json_out(OUT);
    cr_assert_eq(cJSON_GetObjectItem(j, "protocol")->valueint, 1);
    cJSON_Delete(j);

    char cfg[300];
    path(cfg, sizeof cfg, "config.json");
    const char *txt = "{\"model_type\":\"llama\",\"num_hidden_layers\":3,"
                      "\"num_attention_heads\":4,\"num_key_value_heads\":2,"
                      "\"hidden_size\":64,\"rope_theta\":10000.0}";
    kvt_write_file(cfg, txt, strlen(txt));
    cr_assert_eq(CLI("models", "add", "cfgm", "--config", cfg, "--dtype", "bf16", "--json"), 0);
    j = kvt_json_out(OUT);
    cr_assert_eq(cJSON_GetObjectItem(j, "n_layers")->valueint, 3);
    cr_assert_eq(cJSON_GetObjectItem(j, "head_dim")->valueint, 16);
    cr_assert_str_eq(cJSON_GetObjectItem(j, "dtype")->valuestring, "bf16");
    cJSON_Delete(j);
    cr_assert_eq(CLI("models", "--json"), 0);
    j = kvt_json_out(OUT);
    cr_assert(cJSON_IsArray(j));
    cr_assert_eq(cJSON_GetArraySize(j), 1);
    cJSON_Delete(j);
    cr_assert_eq(CLI("stats", "--json"), 0);
    j = kvt_json_out(OUT);
    cr_assert(cJSON_IsNumber(cJSON_GetObjectItem(j, "models")));
    cr_assert_eq(cJSON_GetObjectItem(j, "models")->valueint, 1);
    cJSON_Delete(j);
    cr_assert_eq(CLI("stats"), 0);
    cr_assert(strstr(OUT, "mem_cap_bytes") != NULL);
}

Test(int_cli, raw_put_get_roundtrip)
{
    cr_assert_eq(testd_register(C, "m", KVR_DTYPE_F16, NULL), 0);
    size_t len;
    void *pl = testd_payload(5, T_LAYERS, 0, 20, KVR_DTYPE_F16, &len);
    char in[300], out[300], toks[300];
    path(in, sizeof in, "in.raw");
    path(out, sizeof out, "out.raw");
    path(toks, sizeof toks, "tokens.txt");
    kvt_write_file(in, pl, len);
    const char *tt = "10 11 12 13 14 15 16 17 18 19\n20,21,22,23,24,25,26,27,28,29\n";
    kvt_write_file(toks, tt, strlen(tt));
    cr_assert_eq(CLI("put", "raw", in, "--model", "m", "--tokens-file", toks, "--json"), 0);
    cJSON *j = kvt_json_out(OUT);
    cr_assert_eq(cJSON_GetObjectItem(j, "n_tokens")->valueint, 20);
    cJSON_Delete(j);
    cr_assert_eq(CLI("get", "raw", "-o", out), 0);
    size_t got_len;
    void *got = kvt_read_file(out, &got_len);
    cr_assert_eq(got_len, len);
    cr_assert(memcmp(got, pl, len) == 0);
    free(got);
    /* Sub-range, one layer, to stdout. */
    cr_assert_eq(CLI("get", "raw", "--start", "5", "--end", "7", "--layers", "1", "-o", "-"), 0);
    size_t one = kvr_payload_size(1, 2, T_HEADS, T_DIM, KVR_DTYPE_F16);
    void *want = malloc(one);
    uint32_t l1 = 1;
    testd_fill(want, 5, &l1, 1, 5, 2, T_HEADS, T_DIM, KVR_DTYPE_F16);
    cr_assert(memcmp(OUT, want, one) == 0);
    free(want);
    /* --meta --json carries tokens and positions. */
    cr_assert_eq(CLI("get", "raw", "--meta", "--json"), 0);
    j = kvt_json_out(OUT);
    cJSON *tk = cJSON_GetObjectItem(j, "tokens");
    cr_assert_eq(cJSON_GetArraySize(tk), 20);
    cr_assert_eq(cJSON_GetArrayItem(tk, 19)->valueint, 29);
    cJSON_Delete(j);
    /* Wrong file size for the shape: refused before sending, exit 1. */
    kvt_write_file(in, pl, len - 2);
    cr_assert_eq(CLI("put", "raw2", in, "--model", "m", "--tokens-file", toks), 1);
    free(pl);
}

/* Minimal independent safetensors reader for the test: finds `name` and
 * returns its data pointer, dtype and shape. */
static const uint8_t *st_tensor(const uint8_t *file, size_t len, const char *name,
                                char *dtype, size_t *shape, int *ndim)
{
    uint64_t hl;
    memcpy(&hl, file, 8);
    cr_assert_leq(hl + 8, len);
    cJSON *j = cJSON_ParseWithLength((const char *)file + 8, (size_t)hl);
    cr_assert_not_null(j);
    cJSON *t = cJSON_GetObjectItem(j, name);
    cr_assert_not_null(t, "no tensor %s", name);
    strcpy(dtype, cJSON_GetObjectItem(t, "dtype")->valuestring);
    cJSON *sh = cJSON_GetObjectItem(t, "shape");
    *ndim = cJSON_GetArraySize(sh);
    for (int i = 0; i < *ndim; i++)
        shape[i] = (size_t)cJSON_GetArrayItem(sh, i)->valuedouble;
    size_t off = (size_t)cJSON_GetArrayItem(cJSON_GetObjectItem(t, "data_offsets"), 0)->valuedouble;
    cJSON_Delete(j);
    return file + 8 + hl + off;
}

Test(int_cli, safetensors_roundtrip)
{
    cr_assert_eq(testd_register(C, "m", KVR_DTYPE_BF16, NULL), 0);
    const size_t n = 37;
    cr_assert_eq(testd_put(C, "src", "m", KVR_DTYPE_BF16, 8, 400, 0, n), 0);
    char st[300], st2[300];
    path(st, sizeof st, "kv.safetensors");
    path(st2, sizeof st2, "kv2.safetensors");
    cr_assert_eq(CLI("get", "src", "-o", st), 0);
    size_t flen;
    uint8_t *f = kvt_read_file(st, &flen);
    char dt[16];
    size_t shape[8];
    int nd;
    const uint8_t *k = st_tensor(f, flen, "k", dt, shape, &nd);
    cr_assert_str_eq(dt, "BF16");
    cr_assert_eq(nd, 4);
    cr_assert_eq(shape[0], T_LAYERS);
    cr_assert_eq(shape[1], n);
    cr_assert_eq(shape[2], T_HEADS);
    cr_assert_eq(shape[3], T_DIM);
    const uint8_t *v = st_tensor(f, flen, "v", dt, shape, &nd);
    /* k = every layer's K slab, v = every layer's V slab. */
    size_t len;
    uint8_t *pl = testd_payload(8, T_LAYERS, 0, n, KVR_DTYPE_BF16, &len);
    size_t slab = len / T_LAYERS / 2;
    for (int l = 0; l < T_LAYERS; l++) {
        cr_assert(memcmp(k + l * slab, pl + 2 * l * slab, slab) == 0, "k layer %d", l);
        cr_assert(memcmp(v + l * slab, pl + (2 * l + 1) * slab, slab) == 0, "v layer %d", l);
    }
    const uint8_t *tk = st_tensor(f, flen, "tokens", dt, shape, &nd);
    cr_assert_str_eq(dt, "I32");
    int32_t t0;
    memcpy(&t0, tk, 4);
    cr_assert_eq(t0, 400);
    const uint8_t *ps = st_tensor(f, flen, "positions", dt, shape, &nd);
    cr_assert_str_eq(dt, "I64");
    int64_t p5;
    memcpy(&p5, ps + 5 * 8, 8);
    cr_assert_eq(p5, 5);
    free(f);

    /* Put it back under another id (model from the file's metadata), then
     * get again: the two files are identical but for the context id. */
    cr_assert_eq(CLI("put", "copy", st, "--mode", "create"), 0);
    cr_assert_eq(CLI("get", "copy", "-o", st2), 0);
    kvr_kv kv;
    kvr_get_args g = { .ctx_id = "copy", .dtype = KVR_DTYPE_BF16 };
    cr_assert_eq(kvr_client_get(C, &g, &kv), 0);
    cr_assert(memcmp(kv.payload, pl, len) == 0);
    cr_assert_eq(kv.tokens[n - 1], 400 + n - 1);
    kvr_kv_release(&kv);
    /* --mode replace: the same file again replaces the copy (a create is
     * refused, an upsert would append). */
    cr_assert_eq(CLI("put", "copy", st, "--mode", "create"), 1);
    cr_assert_eq(CLI("put", "copy", st, "--mode", "replace"), 0);
    cr_assert_eq(CLI("put", "copy", st, "--mode", "overwrite"), 2);
    kvr_context cc;
    cr_assert_eq(kvr_client_stat(C, "copy", &cc), 0);
    cr_assert_eq(cc.n_tokens, n);
    cr_assert_eq(kvr_client_get(C, &g, &kv), 0);
    cr_assert(memcmp(kv.payload, pl, len) == 0);
    kvr_kv_release(&kv);
    free(pl);
    /* match through the CLI finds the copy's prefix. */
    cr_assert_eq(CLI("match", "--model", "m", "--tokens", "400,401,402,9", "--json"), 0);
    cJSON *j = kvt_json_out(OUT);
    cr_assert_eq(cJSON_GetObjectItem(j, "length")->valueint, 3);
    cJSON_Delete(j);
}

Test(int_cli, management_and_exit_codes)
{
    cr_assert_eq(testd_register(C, "m", KVR_DTYPE_F16, NULL), 0);
    cr_assert_eq(testd_put(C, "a", "m", KVR_DTYPE_F16, 1, 0, 0, 50), 0);
    cr_assert_eq(CLI("ls", "--json"), 0);
    cJSON *j = kvt_json_out(OUT);
    cr_assert_eq(cJSON_GetArraySize(j), 1);
    cr_assert_str_eq(cJSON_GetObjectItem(cJSON_GetArrayItem(j, 0), "id")->valuestring, "a");
    cJSON_Delete(j);
    cr_assert_eq(CLI("fork", "a", "b"), 0);
    cr_assert_eq(CLI("shift", "b", "10", "50", "-5"), 0);
    cr_assert_eq(CLI("stat", "b", "--json"), 0);
    j = kvt_json_out(OUT);
    cr_assert_eq(cJSON_GetObjectItem(j, "pos_max")->valueint, 44);
    cJSON_Delete(j);
    cr_assert_eq(CLI("keep", "b", "0", "20"), 0);
    cr_assert_eq(CLI("pin", "b"), 0);
    cr_assert_eq(CLI("stat", "b", "--json"), 0);
    j = kvt_json_out(OUT);
    cr_assert(cJSON_IsTrue(cJSON_GetObjectItem(j, "pinned")));
    cr_assert_eq(cJSON_GetObjectItem(j, "n_tokens")->valueint, 20);
    cJSON_Delete(j);
    cr_assert_eq(CLI("unpin", "b"), 0);
    cr_assert_eq(CLI("rm", "b"), 0);

    /* not found: 3, with a JSON error document */
    cr_assert_eq(CLI("stat", "b", "--json"), 3);
    j = kvt_json_out(OUT);
    cr_assert_str_eq(cJSON_GetObjectItem(cJSON_GetObjectItem(j, "error"), "name")->valuestring,
                     "KVR_ENOCTX");
    cJSON_Delete(j);
    cr_assert_eq(CLI("match", "--model", "m", "--tokens", "999,998"), 3);
    /* daemon refusal: 1 */
    cr_assert_eq(CLI("fork", "a", "a"), 1);
    cr_assert_eq(CLI("keep", "a", "0", "500"), 1);
    /* usage: 2 */
    cr_assert_eq(CLI("frobnicate"), 2);
    cr_assert_eq(CLI("stat"), 2);
    cr_assert_eq(CLI("get", "a"), 2);
    cr_assert_eq(CLI("ls", "--bogus"), 2);
    cr_assert_eq(CLI("--help"), 0);
    cr_assert(strstr(OUT, "Exit status") != NULL);
    /* cannot connect: 4 */
    cr_assert_eq(testd_cli(&D, OUT, sizeof OUT,
                           (const char *const[]){ "--socket", "/nonexistent/x.sock", "ping",
                                                  NULL }), 4);
    /* The daemon is fine after all that. */
    cr_assert_eq(kvr_client_ping(C, NULL), 0);
}

/* `kvrope put --persist`: the flag is accepted, refused with a clear error
 * (not a usage error) by a daemon without a disk tier, and with one the
 * context survives a restart bit for bit. */
Test(int_cli_persist, put_persist_survives_restart, .timeout = 120)
{
    char disk[64] = "/tmp/kvr-cli-persist-XXXXXX";
    cr_assert_not_null(mkdtemp(disk));
    const char *const extra[] = { "--disk-dir", disk, NULL };
    kvr_testd d;
    kvr_client *c = kvt_daemon_up_model(&d, extra, "m", KVR_DTYPE_F16);
    size_t len;
    void *pl = testd_payload(9, T_LAYERS, 0, 12, KVR_DTYPE_F16, &len);
    char in[300], out[300];
    snprintf(in, sizeof in, "%s/in.raw", disk);
    snprintf(out, sizeof out, "%s/out.raw", disk);
    kvt_write_file(in, pl, len);
    cr_assert_eq(testd_cli(&d, OUT, sizeof OUT,
                           (const char *const[]){ "put", "p", in, "--model", "m", "--tokens",
                                                  "1,2,3,4,5,6,7,8,9,10,11,12", "--persist",
                                                  NULL }), 0, "%s", OUT);
    kvr_client_close(c);
    testd_stop(&d);
    cr_assert_eq(testd_start(&d, extra), 0);
    cr_assert_eq(testd_cli(&d, OUT, sizeof OUT,
                           (const char *const[]){ "get", "p", "-o", out, NULL }), 0, "%s", OUT);
    size_t got_len;
    void *got = kvt_read_file(out, &got_len);
    cr_assert_eq(got_len, len);
    cr_assert(memcmp(got, pl, len) == 0);
    free(got);
    testd_stop(&d);

    /* Without a disk tier: the daemon's refusal, exit 1 (not usage, 2). */
    cr_assert_eq(testd_start(&d, NULL), 0);
    c = testd_connect(&d);
    cr_assert_eq(testd_register(c, "m", KVR_DTYPE_F16, NULL), 0);
    int rc = testd_cli(&d, OUT, sizeof OUT,
                       (const char *const[]){ "put", "p", in, "--model", "m", "--tokens",
                                              "1,2,3,4,5,6,7,8,9,10,11,12", "--persist", NULL });
    cr_assert_eq(rc, 1, "exit %d: %s", rc, OUT);
    kvr_client_close(c);
    testd_stop(&d);
    free(pl);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", disk);
    if (system(cmd) != 0) {
    }
}
