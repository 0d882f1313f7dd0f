/*
 * cli_payload.c — `kvrope payload`: a KV file for a registered model made
 * from seeded random values or a given .npy array, with the token ids and
 * positions a put needs, so every step of the README's tour can be tried
 * without writing code or computing a real model's KV.
 *
 *   kvrope payload --model M (--tokens 1,2,3 | --tokens-file F)
 *                  [--random SEED | --from KV.npy] [--pos-start N] [--dtype D]
 *                  -o OUT.safetensors | OUT.npy | OUT (raw)
 *
 * The shape (layers, kv heads, head dim) and default dtype come from the
 * model as the daemon holds it; --from must have exactly that shape
 * ([layers, 2, tokens, kv_heads, head_dim], docs/formats.md). Random values
 * are uniform in [-1, 1) from splitmix64(SEED), the same bytes on every
 * machine, so a test can compare two runs. Nothing in the daemon changes.
 */
#include "client/cli/cli.h"
#include "rope/rope.h"

#include <cjson/cJSON.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char kvr__cli_payload_help[] =
"  payload --model M (--tokens 1,2,3 | --tokens-file F) -o FILE [--random SEED]\n"
"        [--from KV.npy] [--pos-start N] [--dtype f32|f16|bf16]\n"
"                                     a KV file for put/edit/refresh: M's shape,\n"
"                                     values uniform in [-1, 1) from SEED (default 1)\n"
"                                     or the array in KV.npy ([layers, 2, tokens,\n"
"                                     kv_heads, head_dim]); tokens and positions (from\n"
"                                     N, default 0) included. FILE by extension:\n"
"                                     .safetensors, .npy or raw (docs/formats.md)\n";

bool kvr__cli_payload_command(const char *cmd) { return cmd && !strcmp(cmd, "payload"); }

bool kvr__cli_payload_option_takes_value(const char *n)
{
    return !strcmp(n, "random") || !strcmp(n, "from");
}

static uint64_t splitmix64(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

int kvr__cli_payload_run(kvr_client *c, const cli_args *a)
{
    const char *model = kvr__cli_opt(a, "model"), *out = kvr__cli_opt(a, "output");
    const char *seed_s = kvr__cli_opt(a, "random"), *from = kvr__cli_opt(a, "from");
    if (!model || !out || a->npos)
        return kvr__cli_usage_err("usage: kvrope payload --model M --tokens 1,2,3 -o FILE "
                             "[--random SEED | --from KV.npy] (kvrope payload --help)");
    if (seed_s && from)
        return kvr__cli_usage_err("payload: give --random or --from, not both");
    uint64_t seed = 1;
    if (seed_s && kvr__cli_parse_u64(seed_s, &seed) < 0)
        return kvr__cli_usage_err("payload: --random wants an unsigned integer seed");
    const char *tl = kvr__cli_opt(a, "tokens"), *tf = kvr__cli_opt(a, "tokens-file");
    if (!tl == !tf)
        return kvr__cli_usage_err("payload: give the token ids: --tokens 1,2,3 or --tokens-file F");
    char err[400];
    uint32_t *tokens = NULL;
    long n = tl ? kvr__cli_parse_u32_list(tl, &tokens) : kvr__cli_read_tokens_file(tf, &tokens, err, sizeof err);
    if (n <= 0) {
        free(tokens);
        return tl || n == 0 ? kvr__cli_usage_err("payload: want at least one token id (unsigned integers)")
                            : kvr__cli_io_err(a, err);
    }
    int64_t pos0 = 0;
    const char *ps = kvr__cli_opt(a, "pos-start");
    if (ps) {
        char *e;
        pos0 = strtoll(ps, &e, 10);
        if (e == ps || *e) {
            free(tokens);
            return kvr__cli_usage_err("payload: --pos-start wants an integer");
        }
    }
    kvr_model m;
    int r = kvr_client_model_get(c, model, &m);
    if (r < 0) {
        free(tokens);
        return kvr__cli_fail(a, c, r, "payload");
    }
    kvr_dtype dt = m.dtype;
    const char *ds = kvr__cli_opt(a, "dtype");
    if (ds && kvr_dtype_parse(ds, &dt)) {
        free(tokens);
        return kvr__cli_usage_err("payload: --dtype wants f32, f16 or bf16");
    }
    size_t nt = (size_t)n, es = kvr_dtype_size(dt);
    size_t elems = kvr_payload_size(m.n_layers, nt, m.n_kv_heads, m.head_dim, KVR_DTYPE_F32) / 4;
    void *payload = malloc(elems ? elems * es : 1);
    int64_t *pos = malloc(nt * sizeof *pos);
    uint32_t *zeros = calloc(nt, 4);
    int rc = CLI_OK;
    if (!payload || !pos || !zeros) {
        rc = kvr__cli_io_err(a, "out of memory");
        goto out;
    }
    if (from) {
        cli_npy f;
        kvr_dtype fdt;
        uint32_t fl, fh, fd;
        size_t ftok;
        if (kvr__cli_npy_read(from, &f, err, sizeof err) < 0 ||
            kvr__cli_npy_kv_shape(&f, from, &fdt, &fl, &ftok, &fh, &fd, err, sizeof err) < 0) {
            rc = kvr__cli_io_err(a, err);
            goto out;
        }
        if (fl != m.n_layers || ftok != nt || fh != m.n_kv_heads || fd != m.head_dim) {
            snprintf(err, sizeof err, "%s has shape [%u, 2, %zu, %u, %u]; model %s with %zu "
                     "tokens needs [%u, 2, %zu, %u, %u]", from, fl, ftok, fh, fd, model, nt,
                     m.n_layers, nt, m.n_kv_heads, m.head_dim);
            kvr__cli_npy_free(&f);
            rc = kvr__cli_io_err(a, err);
            goto out;
        }
        kvr_convert(payload, dt, f.data, fdt, elems);
        kvr__cli_npy_free(&f);
    } else {
        uint64_t s = seed;
        for (size_t i = 0; i < elems; i++) {
            float x = (float)((double)(splitmix64(&s) >> 11) * 0x1p-52 - 1.0);
            if (dt == KVR_DTYPE_F32)
                ((float *)payload)[i] = x;
            else
                ((uint16_t *)payload)[i] = dt == KVR_DTYPE_F16 ? kvr_f32_to_f16(x)
                                                              : kvr_f32_to_bf16(x);
        }
    }
    for (size_t i = 0; i < nt; i++)
        pos[i] = pos0 + (int64_t)i;
    kvr_kv kv;
    memset(&kv, 0, sizeof kv);
    snprintf(kv.model, sizeof kv.model, "%s", model);
    kv.n_tokens = nt;
    kv.dtype = dt;
    kv.n_kv_heads = m.n_kv_heads;
    kv.head_dim = m.head_dim;
    kv.n_layers = m.n_layers;
    kv.tokens = tokens;
    kv.positions = pos;
    kv.flags = zeros;
    kv.groups = (int32_t *)zeros;
    kv.payload = payload;
    kv.payload_len = elems * es;
    rc = kvr__cli_write_kv(a, &kv, out);
    if (rc == CLI_OK && a->json) {
        cJSON *j = cJSON_CreateObject();
        cJSON_AddStringToObject(j, "output", out);
        cJSON_AddStringToObject(j, "model", model);
        cJSON_AddNumberToObject(j, "n_tokens", (double)nt);
        cJSON_AddStringToObject(j, "dtype", kvr_dtype_name(dt));
        cJSON_AddNumberToObject(j, "bytes", (double)(elems * es));
        kvr__cli_print_json(j);
    } else if (rc == CLI_OK && !a->quiet) {
        printf("%s: %zu tokens of model %s (%u layers x %u kv heads x %u dims, %s, %s), "
               "positions %lld..%lld\n", out, nt, model, m.n_layers, m.n_kv_heads, m.head_dim,
               kvr_dtype_name(dt), from ? from : "random", (long long)pos0,
               (long long)(pos0 + (int64_t)nt - 1));
    }
out:
    free(payload);
    free(pos);
    free(zeros);
    free(tokens);
    return rc;
}
