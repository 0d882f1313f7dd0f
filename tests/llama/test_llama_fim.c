/*
 * test_llama_fim.c — the fill-in-the-middle vocabulary as llama.cpp itself
 * reads it (issue 28). The GGUFs are written by scripts/gen-gguf.py into a
 * temporary directory: the committed trained model (eval/model, --hf) and a
 * generated model with --fim; both must make libllama report the FIM ids of
 * the vocabulary (ids 260..266, gen-gguf.py's FIM_TOKENS, which eval/fim.py
 * trains with), so llama-server's /infill accepts them.
 *
 *  - llama_vocab_fim_pre/suf/mid/pad/rep/sep and llama_vocab_eot return
 *    260..266, each id's text is the token's text, and each is a control
 *    token; EOT, pad, rep and sep end generation (llama_vocab_is_eog);
 *  - the text of each token, tokenized with special parsing, is that one id,
 *    and ordinary text still tokenizes to one byte token per byte;
 *  - a model written without --fim reports no FIM tokens (LLAMA_TOKEN_NULL);
 *  - the /infill layout a model was trained on: --spm-infill (or an --hf
 *    config with "fim_order": "spm") writes kvrope.infill.spm = true, which
 *    kvrope serve reads through llama_model_meta_val_str; without it the key
 *    is absent (PSM), and --spm-infill without --fim is refused.
 */
#include <criterion/criterion.h>
#include <libgen.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "llama_test.h"

static const struct {
    const char *text;
    int id;
} FIM[] = {
    {"<|fim_prefix|>", 260}, {"<|fim_suffix|>", 261}, {"<|fim_middle|>", 262}, {"<|fim_pad|>", 263},
    {"<|repo_name|>", 264},  {"<|file_sep|>", 265},   {"<|endoftext|>", 266},
};
#define N_FIM ((int)(sizeof FIM / sizeof FIM[0]))

static char dir[256];

static void setup(void)
{
    snprintf(dir, sizeof dir, "/tmp/kvr-fim-XXXXXX");
    cr_assert_not_null(mkdtemp(dir));
    lt_engine_init();
}

static void teardown(void)
{
    char cmd[320];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", dir);
}

/* eval/model of this checkout (gen-gguf.py lives in scripts/ next to eval/). */
static void eval_model_dir(char *out, size_t cap)
{
    char buf[512];
    snprintf(buf, sizeof buf, "%s", KVR_LLAMA_GEN_GGUF);
    char *scripts = dirname(buf);
    snprintf(out, cap, "%s/../eval/model", scripts);
}

static void check_fim_vocab(const char *path)
{
    struct llama_model *m = llama_model_load_from_file(path, llama_model_default_params());
    cr_assert_not_null(m, "libllama could not load %s", path);
    const struct llama_vocab *v = llama_model_get_vocab(m);
    cr_assert_eq(llama_vocab_n_tokens(v), 267);
    llama_token got[N_FIM] = {
        llama_vocab_fim_pre(v), llama_vocab_fim_suf(v), llama_vocab_fim_mid(v), llama_vocab_fim_pad(v),
        llama_vocab_fim_rep(v), llama_vocab_fim_sep(v), llama_vocab_eot(v),
    };
    for (int i = 0; i < N_FIM; i++) {
        cr_expect_eq(got[i], FIM[i].id, "%s: llama.cpp says %d, the vocabulary %d", FIM[i].text, got[i],
                     FIM[i].id);
        cr_expect_str_eq(llama_vocab_get_text(v, FIM[i].id), FIM[i].text);
        cr_expect(llama_vocab_get_attr(v, FIM[i].id) & LLAMA_TOKEN_ATTR_CONTROL, "%s is not a control token",
                  FIM[i].text);
        llama_token t[8];
        int n = llama_tokenize(v, FIM[i].text, (int32_t)strlen(FIM[i].text), t, 8, false, true);
        cr_expect(n == 1 && t[0] == FIM[i].id, "%s tokenizes to %d tokens, first %d", FIM[i].text, n, t[0]);
    }
    /* llama-server stops an infill at these */
    cr_expect(llama_vocab_is_eog(v, 266) && llama_vocab_is_eog(v, 263) && llama_vocab_is_eog(v, 264) &&
              llama_vocab_is_eog(v, 265));
    cr_expect(!llama_vocab_is_eog(v, 260) && !llama_vocab_is_eog(v, 262));
    /* the byte tokens keep their ids: 'a' is 3 + 0x61, the space U+2581 (259) */
    llama_token t[8];
    int n = llama_tokenize(v, "a b", 3, t, 8, false, false);
    cr_expect(n == 3 && t[0] == 3 + 'a' && t[1] == 259 && t[2] == 3 + 'b', "\"a b\" -> %d tokens", n);
    llama_model_free(m);
}

TestSuite(llama_fim, .init = setup, .fini = teardown, .timeout = 120);

Test(llama_fim, trained_model_reports_the_fim_ids)
{
    char md[600], args[700], path[400];
    eval_model_dir(md, sizeof md);
    snprintf(args, sizeof args, "--hf %s --dtype f16 --name kvrope-code", md);
    cr_assert_eq(lt_gen_model(path, sizeof path, dir, "code", args), 0, "gen-gguf.py %s failed", args);
    check_fim_vocab(path);
}

Test(llama_fim, generated_model_with_fim_reports_the_fim_ids)
{
    char path[400];
    cr_assert_eq(lt_gen_model(path, sizeof path, dir, "gen", "--layers 2 --width 64 --heads 2 --fim"), 0);
    check_fim_vocab(path);
}

Test(llama_fim, generated_model_without_fim_has_none)
{
    char path[400];
    cr_assert_eq(lt_gen_model(path, sizeof path, dir, "plain", "--layers 2 --width 64 --heads 2"), 0);
    struct llama_model *m = llama_model_load_from_file(path, llama_model_default_params());
    cr_assert_not_null(m);
    const struct llama_vocab *v = llama_model_get_vocab(m);
    cr_expect_eq(llama_vocab_n_tokens(v), 260);
    cr_expect_eq(llama_vocab_fim_pre(v), LLAMA_TOKEN_NULL);
    cr_expect_eq(llama_vocab_fim_suf(v), LLAMA_TOKEN_NULL);
    cr_expect_eq(llama_vocab_fim_mid(v), LLAMA_TOKEN_NULL);
    cr_expect_eq(llama_vocab_fim_rep(v), LLAMA_TOKEN_NULL);
    cr_expect_eq(llama_vocab_fim_sep(v), LLAMA_TOKEN_NULL);
    llama_model_free(m);
}

/* kvrope.infill.spm as libllama reads it back: "true", or absent (< 0). */
static int spm_key(const char *path, char *val, size_t cap)
{
    struct llama_model *m = llama_model_load_from_file(path, llama_model_default_params());
    cr_assert_not_null(m, "libllama could not load %s", path);
    int n = llama_model_meta_val_str(m, "kvrope.infill.spm", val, cap);
    llama_model_free(m);
    return n;
}

Test(llama_fim, the_trained_layout_is_in_the_gguf)
{
    char path[400], val[16];
    cr_assert_eq(lt_gen_model(path, sizeof path, dir, "spm", "--layers 2 --width 64 --heads 2 --fim --spm-infill"),
                 0);
    cr_expect(spm_key(path, val, sizeof val) > 0 && !strcmp(val, "true"), "kvrope.infill.spm: %s", val);
    cr_assert_eq(lt_gen_model(path, sizeof path, dir, "psm", "--layers 2 --width 64 --heads 2 --fim"), 0);
    cr_expect_lt(spm_key(path, val, sizeof val), 0, "a PSM model has kvrope.infill.spm");
    cr_expect_neq(lt_gen_model(path, sizeof path, dir, "nofim", "--layers 2 --width 64 --heads 2 --spm-infill"), 0,
                  "--spm-infill without --fim was accepted");
}
