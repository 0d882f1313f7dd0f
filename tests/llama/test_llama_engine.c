/*
 * test_llama_engine.c — the pinned llama.cpp (v0.5.0 from npm, see
 * client/llama/llama.mk) loads the models scripts/gen-gguf.py writes,
 * tokenizes any text one token per byte and decodes it.
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <llama.h>

static void quiet_log(enum ggml_log_level level, const char *text, void *ud)
{
    (void)ud;
    if (level == GGML_LOG_LEVEL_ERROR) fputs(text, stderr);
}

static void engine_init(void)
{
    llama_log_set(quiet_log, NULL);
    ggml_backend_load_all_from_path(KVR_LLAMA_LIBDIR);
    llama_backend_init();
}

static void gen_model(const char *path, const char *args)
{
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "/usr/bin/python3 %s -o %s %s", KVR_LLAMA_GEN_GGUF, path, args);
    cr_assert_eq(system(cmd), 0, "%s", cmd);
}

Test(llama_engine, generated_models_load_and_decode, .init = engine_init)
{
    static const struct { const char *args; int rope_type; } cases[] = {
        { "--arch llama --layers 2 --width 128 --heads 4 --kv-heads 2", LLAMA_ROPE_TYPE_NORM },
        { "--arch qwen2 --layers 2 --width 128 --heads 2 --kv-heads 1 --qkv-bias --dtype f16",
          LLAMA_ROPE_TYPE_NEOX },
        { "--arch llama --layers 1 --width 64 --heads 2 --rope-scaling yarn --rope-factor 4 "
          "--orig-ctx 512", LLAMA_ROPE_TYPE_NORM },
    };
    char path[] = "/tmp/kvr-llama-engine-XXXXXX";
    int fd = mkstemp(path);
    cr_assert_geq(fd, 0);
    close(fd);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        gen_model(path, cases[i].args);
        struct llama_model *m = llama_model_load_from_file(path, llama_model_default_params());
        cr_assert_not_null(m, "load %s", cases[i].args);
        cr_assert_eq(llama_model_rope_type(m), cases[i].rope_type);
        struct llama_context_params cp = llama_context_default_params();
        cp.n_ctx = 256;
        cp.n_threads = cp.n_threads_batch = 1;
        struct llama_context *c = llama_init_from_model(m, cp);
        cr_assert_not_null(c);
        const char *text = "int main(void) { return 0; } /* \xc3\xa9t\xc3\xa9 */";
        llama_token toks[128];
        int n = llama_tokenize(llama_model_get_vocab(m), text, (int32_t)strlen(text), toks, 128,
                               true, false);
        cr_assert_eq(n, (int)strlen(text) + 1, "one token per byte plus BOS: %d", n);
        cr_assert_eq(llama_decode(c, llama_batch_get_one(toks, n)), 0);
        const float *lg = llama_get_logits_ith(c, -1);
        cr_assert_not_null(lg);
        float mx = 0;
        for (int j = 0; j < llama_vocab_n_tokens(llama_model_get_vocab(m)); j++)
            if (lg[j] > mx || lg[j] < -mx) mx = lg[j] < 0 ? -lg[j] : lg[j];
        cr_assert(mx > 0 && mx < 1e4f, "logits are finite and not all zero (%g)", (double)mx);
        llama_free(c);
        llama_model_free(m);
    }
    unlink(path);
}
