/*
 * kvt_daemon.c — tests/common/kvt_daemon.h: daemon up and down, models with
 * their RoPE engines, the tiny model's reference K/V.
 */
#include "tests/common/kvt_daemon.h"

#include <cjson/cJSON.h>
#include <criterion/criterion.h>

kvr_client *kvt_daemon_up(kvr_testd *d, const char *const *extra)
{
    cr_assert_eq(testd_start(d, extra), 0, "daemon did not start");
    kvr_client *c = testd_connect(d);
    cr_assert_not_null(c);
    return c;
}

kvr_client *kvt_daemon_up_model(kvr_testd *d, const char *const *extra, const char *name,
                                kvr_dtype dtype)
{
    kvr_client *c = kvt_daemon_up(d, extra);
    cr_assert_eq(testd_register(c, name, dtype, NULL), 0);
    return c;
}

int kvt_daemon_down(kvr_testd *d, kvr_client **c, kvr_rope **r)
{
    if (r) {
        kvr_rope_destroy(*r);
        *r = NULL;
    }
    if (c) {
        kvr_client_close(*c);
        *c = NULL;
    }
    return testd_stop(d);
}

kvr_testd   kvt_suite_d;
kvr_client *kvt_suite_c;
kvr_rope   *kvt_suite_r;

void kvt_tiny_suite_init(void)
{
    kvt_suite_c = kvt_daemon_up(&kvt_suite_d, NULL);
    kvt_suite_r = kvt_register_tiny(kvt_suite_c, "tiny", KVR_DTYPE_F16, NULL);
}

void kvt_tiny_suite_fini(void)
{
    kvt_daemon_down(&kvt_suite_d, &kvt_suite_c, &kvt_suite_r);
}

kvr_rope *kvt_model_rope(const kvr_model *m)
{
    kvr_rope *r = NULL;
    kvr_error err = { 0 };
    cr_assert_eq(kvr_rope_create(&r, &m->rope, &err), 0, "%s", err.msg);
    return r;
}

kvr_rope *kvt_register_tiny(kvr_client *c, const char *name, kvr_dtype dt, kvr_model *out)
{
    kvr_model m;
    cr_assert_eq(testd_register(c, name, dt, &m), 0, "%s", kvr_client_last_error(c));
    if (out)
        *out = m;
    return kvt_model_rope(&m);
}

kvr_rope *kvt_register_model(kvr_client *c, const char *name, uint32_t n_layers,
                             uint32_t n_kv_heads, uint32_t head_dim, kvr_dtype dt,
                             kvr_model *out)
{
    kvr_rope_config rc;
    kvr_rope_config_init(&rc);
    rc.head_dim = (int32_t)head_dim;
    rc.rotary_dim = (int32_t)head_dim;
    kvr_model_params p = { .name = name, .n_layers = n_layers, .n_kv_heads = n_kv_heads,
                           .head_dim = head_dim, .dtype = dt, .rope = &rc };
    kvr_model m;
    cr_assert_eq(kvr_client_model_register(c, &p, &m), 0, "%s", kvr_client_last_error(c));
    if (out)
        *out = m;
    return kvt_model_rope(&m);
}

void kvt_tiny_embed(uint32_t id, uint32_t layer, uint32_t kv, float *out)
{
    for (uint32_t h = 0; h < T_HEADS; h++)
        for (uint32_t d = 0; d < T_DIM; d++)
            out[h * T_DIM + d] = testd_val(id, layer, kv, 0, h, d);
}

void *kvt_tiny_kv(const kvr_rope *r, const uint32_t *tok, const int64_t *pos, size_t n,
                  kvr_dtype dt, size_t *len)
{
    const size_t per = (size_t)T_HEADS * T_DIM;
    *len = kvr_payload_size(T_LAYERS, n, T_HEADS, T_DIM, dt);
    uint8_t *buf = malloc(*len ? *len : 1);
    float *x = malloc((n ? n : 1) * per * sizeof *x);
    cr_assert(buf && x);
    size_t half = n * per * kvr_dtype_size(dt);
    for (uint32_t l = 0; l < T_LAYERS; l++) {
        uint8_t *k = buf + (size_t)l * 2 * half, *v = k + half;
        for (size_t i = 0; i < n; i++)
            kvt_tiny_embed(tok[i], l, 0, x + i * per);
        if (n)
            cr_assert_eq(kvr_rope_apply(r, k, dt, x, KVR_DTYPE_F32, n, T_HEADS, pos, NULL), 0);
        for (size_t i = 0; i < n; i++)
            kvt_tiny_embed(tok[i], l, 1, x + i * per);
        kvr_convert(v, dt, x, KVR_DTYPE_F32, n * per);
    }
    free(x);
    return buf;
}

struct cJSON *kvt_json_out(const char *out)
{
    cJSON *j = cJSON_Parse(out);
    cr_assert_not_null(j, "not JSON: %s", out);
    return j;
}
