/*
 * test_rope_config.c — reading real config.json texts of several model
 * families, the frequency tables they give (checked against HF's formulas
 * evaluated here independently), every refusal, and the canonical text.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "rope/rope.h"
#include "tests/common/kvt_vectors.h"

static kvr_rope_config parse_ok(const char *json, const char *style)
{
    kvr_rope_config c;
    kvr_error err = { 0 };
    int rc = kvr_rope_config_from_json(&c, json, strlen(json), style, &err);
    cr_assert_eq(rc, 0, "refused: %s", err.msg);
    return c;
}

static void refuse(const char *json, const char *field)
{
    kvr_rope_config c;
    kvr_error err = { 0 };
    int rc = kvr_rope_config_from_json(&c, json, strlen(json), NULL, &err);
    cr_assert_eq(rc, KVR_EINVAL, "accepted: %s", json);
    cr_assert(strstr(err.msg, field) != NULL, "message '%s' does not name '%s'", err.msg, field);
}

/* Rotates e_0 (cos component of pair i) by one position to read the engine's
 * inv_freq[i] back: apply at pos 1 to a unit vector gives (cos f, sin f). */
static double engine_freq(const kvr_rope_config *c, int i)
{
    kvr_rope *r = kvt_rope_new(c);
    float x[KVR_ROPE_MAX_HEAD_DIM] = { 0 }, y[KVR_ROPE_MAX_HEAD_DIM];
    int rot = c->rotary_dim;
    int i0 = c->style == KVR_ROPE_GPTJ ? 2 * i : i, i1 = c->style == KVR_ROPE_GPTJ ? 2 * i + 1 : i + rot / 2;
    x[i0] = 1.0f;
    int64_t p = 1;
    kvr_rope_apply(r, y, KVR_DTYPE_F32, x, KVR_DTYPE_F32, 1, 1, &p, NULL);
    kvr_rope_destroy(r);
    return atan2((double)y[i1], (double)y[i0]);
}

static const char *LLAMA31 =
    "{\"architectures\":[\"LlamaForCausalLM\"],\"attention_bias\":false,\"bos_token_id\":128000,"
    "\"eos_token_id\":128001,\"hidden_act\":\"silu\",\"hidden_size\":4096,"
    "\"initializer_range\":0.02,\"intermediate_size\":14336,\"max_position_embeddings\":131072,"
    "\"mlp_bias\":false,\"model_type\":\"llama\",\"num_attention_heads\":32,"
    "\"num_hidden_layers\":32,\"num_key_value_heads\":8,\"pretraining_tp\":1,"
    "\"rms_norm_eps\":1e-05,\"rope_scaling\":{\"factor\":8.0,\"low_freq_factor\":1.0,"
    "\"high_freq_factor\":4.0,\"original_max_position_embeddings\":8192,\"rope_type\":\"llama3\"},"
    "\"rope_theta\":500000.0,\"tie_word_embeddings\":false,\"torch_dtype\":\"bfloat16\","
    "\"transformers_version\":\"4.43.0.dev0\",\"use_cache\":true,\"vocab_size\":128256}";

Test(rope_config, llama31_llama3_scaling)
{
    kvr_rope_config c = parse_ok(LLAMA31, NULL);
    cr_assert_eq(c.head_dim, 128);
    cr_assert_eq(c.rotary_dim, 128);
    cr_assert_eq(c.num_layers, 32);
    cr_assert_eq(c.num_heads, 32);
    cr_assert_eq(c.num_kv_heads, 8);
    cr_assert_eq(c.max_position_embeddings, 131072);
    cr_assert_str_eq(c.model_type, "llama");
    cr_assert_eq(c.style, KVR_ROPE_NEOX);
    cr_assert_eq(c.scaling, KVR_ROPE_SCALING_LLAMA3);
    cr_assert_float_eq(c.theta, 500000.0, 0);
    cr_assert_float_eq(c.factor, 8.0, 0);
    cr_assert_eq(c.original_max_position_embeddings, 8192);
    cr_assert(kvr_rope_config_composes(&c));
    /* HF's llama3 rule, evaluated here for a high, a medium and a low pair */
    for (int i = 0; i < 64; i += 3) {
        double f = pow(500000.0, -(2.0 * i) / 128.0), wl = 2 * M_PI / f, want;
        if (wl < 8192.0 / 4.0) want = f;
        else if (wl > 8192.0) want = f / 8.0;
        else {
            double sm = (8192.0 / wl - 1.0) / 3.0;
            want = (1 - sm) * f / 8.0 + sm * f;
        }
        cr_assert_float_eq(engine_freq(&c, i), want, 1e-6 * want + 1e-9, "pair %d", i);
    }
}

Test(rope_config, qwen2_theta_1e6)
{
    const char *j =
        "{\"architectures\":[\"Qwen2ForCausalLM\"],\"attention_dropout\":0.0,\"bos_token_id\":151643,"
        "\"eos_token_id\":151645,\"hidden_act\":\"silu\",\"hidden_size\":3584,\"initializer_range\":0.02,"
        "\"intermediate_size\":18944,\"max_position_embeddings\":32768,\"max_window_layers\":28,"
        "\"model_type\":\"qwen2\",\"num_attention_heads\":28,\"num_hidden_layers\":28,"
        "\"num_key_value_heads\":4,\"rms_norm_eps\":1e-06,\"rope_theta\":1000000.0,"
        "\"sliding_window\":131072,\"tie_word_embeddings\":false,\"torch_dtype\":\"bfloat16\","
        "\"transformers_version\":\"4.41.2\",\"use_cache\":true,\"use_sliding_window\":false,"
        "\"vocab_size\":152064}";
    kvr_rope_config c = parse_ok(j, NULL);
    cr_assert_eq(c.head_dim, 128);
    cr_assert_eq(c.num_kv_heads, 4);
    cr_assert_eq(c.scaling, KVR_ROPE_SCALING_DEFAULT);
    cr_assert_float_eq(c.theta, 1e6, 0);
    cr_assert_float_eq(engine_freq(&c, 10), pow(1e6, -20.0 / 128.0), 1e-7);
}

#define PHI3 \
    "{\"_name_or_path\":\"Phi-3-mini-128k-instruct\",\"architectures\":[\"Phi3ForCausalLM\"]," \
    "\"attention_dropout\":0.0,\"bos_token_id\":1,\"embd_pdrop\":0.0,\"eos_token_id\":32000," \
    "\"hidden_act\":\"silu\",\"hidden_size\":3072,\"initializer_range\":0.02," \
    "\"intermediate_size\":8192,\"max_position_embeddings\":131072,\"model_type\":\"phi3\"," \
    "\"num_attention_heads\":32,\"num_hidden_layers\":32,\"num_key_value_heads\":32," \
    "\"original_max_position_embeddings\":4096,\"pad_token_id\":32000,\"resid_pdrop\":0.0," \
    "\"rms_norm_eps\":1e-05,\"rope_scaling\":{\"long_factor\":[%s],\"short_factor\":[%s]," \
    "\"type\":\"longrope\"},\"rope_theta\":10000.0,\"sliding_window\":262144," \
    "\"tie_word_embeddings\":false,\"torch_dtype\":\"bfloat16\",\"use_cache\":true," \
    "\"vocab_size\":32064}"

static char *phi3_json(int n_long, int n_short)
{
    char lf[4096] = "", sf[4096] = "";
    for (int i = 0; i < n_long; i++)
        snprintf(lf + strlen(lf), sizeof lf - strlen(lf), "%s%.4f", i ? "," : "", 1.0 + 0.9 * i);
    for (int i = 0; i < n_short; i++)
        snprintf(sf + strlen(sf), sizeof sf - strlen(sf), "%s%.4f", i ? "," : "", 1.0 + 0.01 * i);
    char *out = malloc(strlen(PHI3) + sizeof lf + sizeof sf);
    sprintf(out, PHI3, lf, sf);
    return out;
}

Test(rope_config, phi3_longrope)
{
    char *j = phi3_json(48, 48);
    kvr_rope_config c = parse_ok(j, NULL);
    free(j);
    cr_assert_eq(c.head_dim, 96);
    cr_assert_eq(c.scaling, KVR_ROPE_SCALING_LONGROPE);
    cr_assert_eq(c.n_long_factor, 48);
    cr_assert_eq(c.n_short_factor, 48);
    cr_assert_eq(c.original_max_position_embeddings, 4096);
    cr_assert_float_eq(c.long_factor[2], 2.8, 1e-12);
    cr_assert(!kvr_rope_config_composes(&c));
    /* attention factor sqrt(1 + ln(131072/4096) / ln(4096)) on the magnitude */
    kvr_rope *r;
    cr_assert_eq(kvr_rope_create(&r, &c, NULL), 0);
    float x[96] = { 0 }, y[96];
    x[0] = 1.0f;
    int64_t p = 0;
    kvr_rope_apply(r, y, KVR_DTYPE_F32, x, KVR_DTYPE_F32, 1, 1, &p, NULL);
    cr_assert_float_eq(y[0], sqrt(1 + log(32.0) / log(4096.0)), 1e-6);
    /* short table within 4096, long beyond */
    p = 1;
    kvr_rope_opts o = { .seq_len_to = 100000 };
    x[5] = 1.0f; x[0] = 0;
    kvr_rope_apply(r, y, KVR_DTYPE_F32, x, KVR_DTYPE_F32, 1, 1, &p, &o);
    double want = pow(10000.0, -10.0 / 96.0) / (1.0 + 0.9 * 5);
    cr_assert_float_eq(atan2((double)y[5 + 48], (double)y[5]), want, 1e-6);
    kvr_rope_destroy(r);
}

Test(rope_config, yarn_qwen_style)
{
    const char *j =
        "{\"model_type\":\"qwen2\",\"hidden_size\":5120,\"num_attention_heads\":40,"
        "\"num_key_value_heads\":8,\"num_hidden_layers\":64,\"max_position_embeddings\":32768,"
        "\"rope_theta\":1000000.0,\"rope_scaling\":{\"factor\":4.0,"
        "\"original_max_position_embeddings\":32768,\"type\":\"yarn\"}}";
    kvr_rope_config c = parse_ok(j, NULL);
    cr_assert_eq(c.scaling, KVR_ROPE_SCALING_YARN);
    cr_assert_float_eq(c.beta_fast, 32.0, 0);
    cr_assert_float_eq(c.beta_slow, 1.0, 0);
    cr_assert(isnan(c.attention_factor));
    cr_assert(kvr_rope_config_composes(&c));
    /* HF: find_correction_range + linear ramp; pair 0 extrapolates, last interpolates */
    double base = 1e6, dim = 128;
    double lo = floor(dim * log(32768 / (32 * 2 * M_PI)) / (2 * log(base)));
    double hi = ceil(dim * log(32768 / (1 * 2 * M_PI)) / (2 * log(base)));
    for (int i = 0; i < 64; i += 7) {
        double ramp = fmin(1, fmax(0, (i - lo) / (hi - lo))), ex = 1 - ramp;
        double f = pow(base, -2.0 * i / dim);
        double want = f / 4 * (1 - ex) + f * ex;
        cr_assert_float_eq(engine_freq(&c, i), want, 1e-6 * want + 1e-9, "pair %d", i);
    }
    /* DeepSeek style mscale / mscale_all_dim */
    const char *d =
        "{\"model_type\":\"deepseek_v3\",\"head_dim\":64,\"max_position_embeddings\":163840,"
        "\"rope_theta\":10000,\"rope_scaling\":{\"beta_fast\":32,\"beta_slow\":1,\"factor\":40,"
        "\"mscale\":1.0,\"mscale_all_dim\":0.707,\"original_max_position_embeddings\":4096,"
        "\"type\":\"yarn\"}}";
    c = parse_ok(d, NULL);
    kvr_rope *r;
    cr_assert_eq(kvr_rope_create(&r, &c, NULL), 0);
    float x[64] = { 1.0f }, y[64];
    int64_t p = 0;
    kvr_rope_apply(r, y, KVR_DTYPE_F32, x, KVR_DTYPE_F32, 1, 1, &p, NULL);
    double m = (0.1 * 1.0 * log(40) + 1) / (0.1 * 0.707 * log(40) + 1);
    cr_assert_float_eq(y[0], m, 1e-6);
    kvr_rope_destroy(r);
    /* explicit attention_factor wins */
    const char *e =
        "{\"head_dim\":64,\"max_position_embeddings\":8192,\"rope_scaling\":{\"rope_type\":\"yarn\","
        "\"factor\":2.0,\"attention_factor\":1.25}}";
    c = parse_ok(e, NULL);
    cr_assert_eq(kvr_rope_create(&r, &c, NULL), 0);
    kvr_rope_apply(r, y, KVR_DTYPE_F32, x, KVR_DTYPE_F32, 1, 1, &p, NULL);
    cr_assert_float_eq(y[0], 1.25, 1e-6);
    kvr_rope_destroy(r);
}

Test(rope_config, gptj_rotary_dim_64)
{
    const char *j =
        "{\"activation_function\":\"gelu_new\",\"architectures\":[\"GPTJForCausalLM\"],"
        "\"attn_pdrop\":0.0,\"bos_token_id\":50256,\"embd_pdrop\":0.0,\"eos_token_id\":50256,"
        "\"gradient_checkpointing\":false,\"initializer_range\":0.02,\"layer_norm_epsilon\":1e-05,"
        "\"model_type\":\"gptj\",\"n_embd\":4096,\"n_head\":16,\"n_inner\":null,\"n_layer\":28,"
        "\"n_positions\":2048,\"resid_pdrop\":0.0,\"rotary\":true,\"rotary_dim\":64,"
        "\"tie_word_embeddings\":false,\"vocab_size\":50400}";
    kvr_rope_config c = parse_ok(j, NULL);
    cr_assert_eq(c.style, KVR_ROPE_GPTJ);
    cr_assert_eq(c.head_dim, 256);
    cr_assert_eq(c.rotary_dim, 64);
    cr_assert_eq(c.num_layers, 28);
    cr_assert_eq(c.max_position_embeddings, 2048);
    cr_assert_float_eq(engine_freq(&c, 3), pow(10000.0, -6.0 / 64.0), 1e-7);
    /* explicit override */
    c = parse_ok(j, "neox");
    cr_assert_eq(c.style, KVR_ROPE_NEOX);
    /* codegen is interleaved too; gpt_neox is not */
    c = parse_ok("{\"model_type\":\"codegen\",\"n_embd\":1024,\"n_head\":16,\"rotary_dim\":32}", NULL);
    cr_assert_eq(c.style, KVR_ROPE_GPTJ);
    c = parse_ok("{\"model_type\":\"gpt_neox\",\"hidden_size\":2048,\"num_attention_heads\":16,"
                 "\"rotary_pct\":0.25,\"rotary_emb_base\":10000}", NULL);
    cr_assert_eq(c.style, KVR_ROPE_NEOX);
    cr_assert_eq(c.rotary_dim, 32);
}

Test(rope_config, partial_rotary_factor)
{
    const char *j =
        "{\"architectures\":[\"PhiForCausalLM\"],\"hidden_size\":2560,\"model_type\":\"phi\","
        "\"num_attention_heads\":32,\"num_hidden_layers\":32,\"num_key_value_heads\":32,"
        "\"partial_rotary_factor\":0.4,\"max_position_embeddings\":2048,\"rope_theta\":10000.0,"
        "\"rope_scaling\":null}";
    kvr_rope_config c = parse_ok(j, NULL);
    cr_assert_eq(c.head_dim, 80);
    cr_assert_eq(c.rotary_dim, 32);
    cr_assert_eq(c.scaling, KVR_ROPE_SCALING_DEFAULT);
}

Test(rope_config, legacy_type_key_linear_and_dynamic)
{
    kvr_rope_config c = parse_ok(
        "{\"model_type\":\"llama\",\"hidden_size\":4096,\"num_attention_heads\":32,"
        "\"max_position_embeddings\":4096,\"rope_scaling\":{\"type\":\"linear\",\"factor\":2.0}}", NULL);
    cr_assert_eq(c.scaling, KVR_ROPE_SCALING_LINEAR);
    cr_assert_float_eq(engine_freq(&c, 4), pow(10000.0, -8.0 / 128.0) / 2.0, 1e-7);
    c = parse_ok(
        "{\"model_type\":\"llama\",\"hidden_size\":4096,\"num_attention_heads\":32,"
        "\"max_position_embeddings\":4096,\"rope_scaling\":{\"type\":\"dynamic\",\"factor\":2.0}}", NULL);
    cr_assert_eq(c.scaling, KVR_ROPE_SCALING_DYNAMIC);
    cr_assert(!kvr_rope_config_composes(&c));
    /* within the original length the table is the plain one */
    cr_assert_float_eq(engine_freq(&c, 4), pow(10000.0, -8.0 / 128.0), 1e-7);
    /* transformers v5 rope_parameters */
    c = parse_ok("{\"head_dim\":64,\"rope_parameters\":{\"rope_type\":\"default\",\"rope_theta\":50000}}",
                 NULL);
    cr_assert_float_eq(c.theta, 50000.0, 0);
}

Test(rope_config, refusals)
{
    refuse("{\"head_dim\":64,\"rope_scaling\":{\"rope_type\":\"banana\",\"factor\":2}}", "rope_type");
    refuse("{\"head_dim\":64,\"rope_scaling\":{\"type\":\"mrope\"}}", "type");
    refuse("{\"head_dim\":64,\"rope_scaling\":{\"rope_type\":\"linear\"}}", "factor");
    refuse("{\"head_dim\":64,\"max_position_embeddings\":4096,\"rope_scaling\":{\"rope_type\":\"yarn\"}}",
           "factor");
    refuse("{\"head_dim\":64,\"rope_scaling\":{\"rope_type\":\"llama3\",\"low_freq_factor\":1,"
           "\"high_freq_factor\":4,\"original_max_position_embeddings\":8192}}", "factor");
    refuse("{\"head_dim\":64,\"rope_scaling\":{\"rope_type\":\"llama3\",\"factor\":8,"
           "\"high_freq_factor\":4,\"original_max_position_embeddings\":8192}}", "low_freq_factor");
    refuse("{\"head_dim\":64,\"rope_scaling\":{\"rope_type\":\"llama3\",\"factor\":8,"
           "\"low_freq_factor\":1,\"original_max_position_embeddings\":8192}}", "high_freq_factor");
    refuse("{\"head_dim\":64,\"rope_scaling\":{\"rope_type\":\"llama3\",\"factor\":8,"
           "\"low_freq_factor\":1,\"high_freq_factor\":4}}", "original_max_position_embeddings");
    refuse("{\"head_dim\":64,\"rope_scaling\":{\"rope_type\":\"yarn\",\"factor\":4}}",
           "original_max_position_embeddings");
    refuse("{\"head_dim\":64,\"rope_scaling\":{\"rope_type\":\"dynamic\",\"factor\":4}}",
           "max_position_embeddings");
    refuse("{\"head_dim\":64,\"rope_scaling\":{\"rope_type\":\"longrope\",\"long_factor\":[1]}}",
           "short_factor");
    refuse("{\"head_dim\":2,\"max_position_embeddings\":10,\"rope_scaling\":{\"rope_type\":\"longrope\","
           "\"short_factor\":[1]}}", "long_factor");
    char *j = phi3_json(47, 48);
    refuse(j, "long_factor");
    free(j);
    j = phi3_json(48, 50);
    refuse(j, "short_factor");
    free(j);
    refuse("{\"head_dim\":64,\"rope_theta\":0}", "rope_theta");
    refuse("{\"head_dim\":64,\"rope_theta\":-5}", "rope_theta");
    refuse("{\"head_dim\":64,\"rotary_dim\":33}", "rotary_dim");
    refuse("{\"head_dim\":64,\"rotary_dim\":128}", "rotary_dim");
    refuse("{\"head_dim\":64,\"rotary_dim\":0}", "rotary_dim");
    refuse("{\"head_dim\":64,\"rope_scaling\":{\"rope_type\":\"linear\",\"factor\":0}}", "factor");
    refuse("{\"head_dim\":64,\"rope_scaling\":{\"rope_type\":\"linear\",\"factor\":-2}}", "factor");
    refuse("{\"head_dim\":64,\"max_position_embeddings\":4096,\"rope_scaling\":{\"rope_type\":\"yarn\","
           "\"factor\":-1}}", "factor");
    refuse("{\"head_dim\":4096}", "head_dim");
    refuse("{\"hidden_size\":100,\"num_attention_heads\":3}", "head_dim");
    refuse("{\"model_type\":\"llama\"}", "head_dim");
    refuse("{\"head_dim\":64,\"partial_rotary_factor\":1.5}", "partial_rotary_factor");
    refuse("{\"head_dim\":64,\"rope_theta\":\"big\"}", "rope_theta");
    refuse("{\"head_dim\":64,", "JSON");

    kvr_rope_config c;
    kvr_error err = { 0 };
    cr_assert_eq(kvr_rope_config_from_json(&c, "{\"head_dim\":64}", 15, "sideways", &err), KVR_EINVAL);
    cr_assert(strstr(err.msg, "style"));
    /* validate on a hand-filled struct, and create refuses what validate refuses */
    kvr_rope_config_init(&c);
    c.head_dim = 64; c.rotary_dim = 64; c.theta = -1;
    kvr_rope *r = (kvr_rope *)&c;
    cr_assert_eq(kvr_rope_create(&r, &c, &err), KVR_EINVAL);
    cr_assert_null(r);
    cr_assert(strstr(err.msg, "rope_theta"));
    c.theta = 10000; c.scaling = KVR_ROPE_SCALING_LINEAR; c.factor = (double)NAN;
    cr_assert_eq(kvr_rope_config_validate(&c, &err), KVR_EINVAL);
    cr_assert(strstr(err.msg, "factor"));
    c.scaling = (kvr_rope_scaling)42;
    cr_assert_eq(kvr_rope_config_validate(&c, &err), KVR_EINVAL);
    cr_assert(strstr(err.msg, "rope_type"));
    /* NULL err buffer is fine */
    cr_assert_eq(kvr_rope_config_validate(&c, NULL), KVR_EINVAL);
}

Test(rope_config, from_file)
{
    char path[] = "/tmp/kvr_rope_cfg_XXXXXX";
    int fd = mkstemp(path);
    cr_assert(fd >= 0);
    cr_assert_eq(write(fd, LLAMA31, strlen(LLAMA31)), (ssize_t)strlen(LLAMA31));
    close(fd);
    kvr_rope_config c;
    kvr_error err = { 0 };
    cr_assert_eq(kvr_rope_config_from_file(&c, path, NULL, &err), 0, "%s", err.msg);
    cr_assert_eq(c.scaling, KVR_ROPE_SCALING_LLAMA3);
    unlink(path);
    cr_assert_lt(kvr_rope_config_from_file(&c, "/nonexistent/config.json", NULL, &err), 0);
    cr_assert(strstr(err.msg, "/nonexistent/config.json"));
}

Test(rope_config, canonical_text)
{
    kvr_rope_config a = parse_ok(LLAMA31, NULL), b = a;
    char t1[4096], t2[4096];
    size_t n1 = kvr_rope_config_canonical(&a, t1, sizeof t1);
    size_t n2 = kvr_rope_config_canonical(&b, t2, sizeof t2);
    cr_assert_eq(n1, strlen(t1));
    cr_assert_eq(n1, n2);
    cr_assert_str_eq(t1, t2);
    cr_assert(strstr(t1, "scaling=llama3"));
    /* shape-only fields do not change it; rotation fields do */
    b.num_layers = 99; b.num_kv_heads = 1; b.max_position_embeddings = 5;
    kvr_rope_config_canonical(&b, t2, sizeof t2);
    cr_assert_str_eq(t1, t2);
    b.theta = 500001.0;
    kvr_rope_config_canonical(&b, t2, sizeof t2);
    cr_assert_str_neq(t1, t2);
    b = a; b.style = KVR_ROPE_GPTJ;
    kvr_rope_config_canonical(&b, t2, sizeof t2);
    cr_assert_str_neq(t1, t2);
    /* truncation reports the length needed */
    char small[10];
    cr_assert_eq(kvr_rope_config_canonical(&a, small, sizeof small), n1);
    cr_assert_eq(strlen(small), 9);
    cr_assert_eq(kvr_rope_config_canonical(&a, NULL, 0), n1);
    char *j = phi3_json(48, 48);
    a = parse_ok(j, NULL);
    free(j);
    n1 = kvr_rope_config_canonical(&a, t1, sizeof t1);
    cr_assert(n1 < sizeof t1);
    cr_assert(strstr(t1, "long_factor=[1,1.8999999999999999,"), "%s", t1);
}

/* ---- issue 18: model families that transformers reads specially ---------------- */

Test(rope_config, chatglm_rotates_half_of_kv_channels_interleaved)
{
    /* modeling_chatglm.py: RotaryEmbedding(kv_channels // 2), pairs (2i, 2i+1),
     * base 10000 * rope_ratio; multi_query_group_num KV heads with MQA. */
    kvr_rope_config c = parse_ok(
        "{\"model_type\":\"chatglm\",\"hidden_size\":4096,\"num_attention_heads\":32,"
        "\"kv_channels\":128,\"multi_query_attention\":true,\"multi_query_group_num\":2,"
        "\"num_layers\":28,\"seq_length\":8192,\"rope_ratio\":50}", NULL);
    cr_assert_eq(c.head_dim, 128);
    cr_assert_eq(c.rotary_dim, 64);
    cr_assert_eq(c.style, KVR_ROPE_GPTJ);
    cr_assert_eq(c.num_kv_heads, 2);
    cr_assert_eq(c.theta, 500000.0);
    cr_assert_float_eq(engine_freq(&c, 3), 1.0 / pow(500000.0, 6.0 / 64.0), 1e-6);
    c = parse_ok("{\"model_type\":\"chatglm\",\"hidden_size\":4096,\"num_attention_heads\":32,"
                 "\"kv_channels\":128,\"multi_query_attention\":false,"
                 "\"multi_query_group_num\":2,\"num_layers\":28}", NULL);
    cr_assert_eq(c.num_kv_heads, 32);
}

Test(rope_config, composite_config_reads_text_config)
{
    kvr_rope_config c = parse_ok(
        "{\"model_type\":\"mistral3\",\"vision_config\":{\"head_dim\":64,\"rope_theta\":10000},"
        "\"text_config\":{\"model_type\":\"ministral3\",\"head_dim\":128,\"hidden_size\":3072,"
        "\"num_attention_heads\":32,\"num_key_value_heads\":8,\"num_hidden_layers\":26,"
        "\"max_position_embeddings\":262144,\"rope_parameters\":{\"rope_type\":\"yarn\","
        "\"factor\":16.0,\"original_max_position_embeddings\":16384,\"rope_theta\":1e6,"
        "\"mscale\":1.0,\"mscale_all_dim\":1.0,\"beta_fast\":32,\"beta_slow\":1}}}", NULL);
    cr_assert_str_eq(c.model_type, "ministral3");
    cr_assert_eq(c.head_dim, 128);
    cr_assert_eq(c.num_kv_heads, 8);
    cr_assert_eq(c.scaling, KVR_ROPE_SCALING_YARN);
    cr_assert_eq(c.factor, 16.0);
    cr_assert_eq(c.theta, 1e6);
    kvr_rope *r;
    cr_assert_eq(kvr_rope_create(&r, &c, NULL), 0);
    cr_assert_float_eq(kvr_rope_attention_scale(r), 1.0, 1e-12);
    kvr_rope_destroy(r);
}

Test(rope_config, mla_models_refused_naming_the_field)
{
    refuse("{\"model_type\":\"deepseek_v3\",\"hidden_size\":7168,\"num_attention_heads\":128,"
           "\"kv_lora_rank\":512,\"qk_rope_head_dim\":64,\"qk_nope_head_dim\":128}",
           "kv_lora_rank");
    refuse("{\"hidden_size\":1024,\"num_attention_heads\":8,\"qk_rope_head_dim\":64}",
           "qk_rope_head_dim");
}

Test(rope_config, gemma3_sliding_layers_use_the_local_base)
{
    kvr_rope_config c = parse_ok(
        "{\"model_type\":\"gemma3_text\",\"num_hidden_layers\":12,\"num_attention_heads\":4,"
        "\"num_key_value_heads\":1,\"head_dim\":32,\"rope_theta\":1000000,"
        "\"rope_local_base_freq\":10000,\"sliding_window_pattern\":6,"
        "\"rope_scaling\":{\"rope_type\":\"linear\",\"factor\":8.0}}", NULL);
    cr_assert_eq(c.n_layer_kinds, 12);
    for (uint32_t l = 0; l < 12; l++)
        cr_assert_eq(kvr_rope_config_layer_kind(&c, l),
                     (l + 1) % 6 ? KVR_ROPE_LAYER_LOCAL : KVR_ROPE_LAYER_GLOBAL, "layer %u", l);
    kvr_rope *r;
    cr_assert_eq(kvr_rope_create(&r, &c, NULL), 0);
    /* global layers: theta 1e6 with linear scaling; local: 1e4, no scaling */
    const kvr_rope_config *g = kvr_rope_get_config(kvr_rope_layer(r, 5));
    const kvr_rope_config *lo = kvr_rope_get_config(kvr_rope_layer(r, 0));
    cr_assert_eq(g->theta, 1e6);
    cr_assert_eq(g->scaling, KVR_ROPE_SCALING_LINEAR);
    cr_assert_eq(lo->theta, 1e4);
    cr_assert_eq(lo->scaling, KVR_ROPE_SCALING_DEFAULT);
    cr_assert_float_eq(engine_freq(lo, 2), 1.0 / pow(1e4, 4.0 / 32.0), 1e-6);
    cr_assert_float_eq(engine_freq(g, 2), 1.0 / pow(1e6, 4.0 / 32.0) / 8.0, 1e-7);
    kvr_rope_destroy(r);
    /* explicit layer_types, and transformers v5's per-layer-type rope_parameters */
    c = parse_ok("{\"model_type\":\"gemma3_text\",\"num_hidden_layers\":3,"
                 "\"num_attention_heads\":4,\"num_key_value_heads\":1,\"head_dim\":32,"
                 "\"layer_types\":[\"full_attention\",\"sliding_attention\",\"full_attention\"],"
                 "\"rope_parameters\":{\"full_attention\":{\"rope_type\":\"default\","
                 "\"rope_theta\":1e6},\"sliding_attention\":{\"rope_type\":\"default\","
                 "\"rope_theta\":20000}}}", NULL);
    cr_assert_eq(c.theta, 1e6);
    cr_assert_eq(c.local_theta, 20000.0);
    cr_assert_eq(kvr_rope_config_layer_kind(&c, 0), KVR_ROPE_LAYER_GLOBAL);
    cr_assert_eq(kvr_rope_config_layer_kind(&c, 1), KVR_ROPE_LAYER_LOCAL);
    refuse("{\"model_type\":\"gemma3_text\",\"num_hidden_layers\":3,\"num_attention_heads\":4,"
           "\"head_dim\":32,\"layer_types\":[\"full_attention\"]}", "layer_types");
    refuse("{\"model_type\":\"gemma3_text\",\"num_hidden_layers\":2,\"num_attention_heads\":4,"
           "\"head_dim\":32,\"layer_types\":[\"full_attention\",\"chunked\"]}", "layer_types[1]");
}

Test(rope_config, llama4_nope_layers)
{
    kvr_rope_config c = parse_ok(
        "{\"model_type\":\"llama4\",\"text_config\":{\"model_type\":\"llama4_text\","
        "\"num_hidden_layers\":4,\"num_attention_heads\":8,\"num_key_value_heads\":2,"
        "\"head_dim\":16,\"rope_theta\":500000,\"no_rope_layers\":[1,0,1,1]}}", NULL);
    cr_assert_eq(c.style, KVR_ROPE_GPTJ);      /* complex (interleaved) rotary */
    cr_assert_eq(kvr_rope_config_layer_kind(&c, 1), KVR_ROPE_LAYER_NONE);
    cr_assert_eq(kvr_rope_config_layer_kind(&c, 3), KVR_ROPE_LAYER_GLOBAL);
    kvr_rope *r;
    cr_assert_eq(kvr_rope_create(&r, &c, NULL), 0);
    float x[32], y[32];
    for (int i = 0; i < 32; i++)
        x[i] = (float)i - 7.5f;
    int64_t p = 12345;
    cr_assert_eq(kvr_rope_apply(kvr_rope_layer(r, 1), y, KVR_DTYPE_F32, x, KVR_DTYPE_F32,
                                1, 2, &p, NULL), 0);
    cr_assert(memcmp(x, y, sizeof x) == 0, "a NoPE layer rotated its keys");
    kvr_rope_destroy(r);
}

Test(rope_config, yarn_truncate_false)
{
    /* gpt-oss: "truncate": false keeps the correction range unrounded */
#define GPT_OSS_LIKE(extra) "{\"hidden_size\":512,\"num_attention_heads\":8,\"head_dim\":64," \
        "\"rope_theta\":150000,\"max_position_embeddings\":131072," \
        "\"rope_scaling\":{\"rope_type\":\"yarn\",\"factor\":32.0," \
        "\"original_max_position_embeddings\":4096,\"beta_fast\":32,\"beta_slow\":1" extra "}}"
    const char *a = GPT_OSS_LIKE(""), *b = GPT_OSS_LIKE(",\"truncate\":false");
#undef GPT_OSS_LIKE
    kvr_rope_config ca = parse_ok(a, NULL), cb = parse_ok(b, NULL);
    cr_assert_eq(ca.yarn_truncate, 1);
    cr_assert_eq(cb.yarn_truncate, 0);
    /* HF: low = corr(32), high = corr(1), ramp over them, not floored */
    double dim = 64, lo = dim * log(4096 / (32 * 2 * M_PI)) / (2 * log(150000.0));
    double hi = dim * log(4096 / (1 * 2 * M_PI)) / (2 * log(150000.0));
    int i = 10;
    double ramp = fmin(fmax((i - lo) / (hi - lo), 0.0), 1.0), f = 1.0 / pow(150000.0, 2.0 * i / dim);
    double want = f / 32.0 * ramp + f * (1.0 - ramp);
    cr_assert_float_eq(engine_freq(&cb, i), want, 1e-7);
    char ka[2048], kb[2048];
    kvr_rope_config_canonical(&ca, ka, sizeof ka);
    kvr_rope_config_canonical(&cb, kb, sizeof kb);
    cr_assert_str_neq(ka, kb);
}
