/*
 * llama_test.c — tests/llama/llama_test.h: the llama.cpp engine helpers.
 * Compiled once into libtestllama.a (it needs llama.h), which the llama
 * tests and benches link.
 */
#include "tests/llama/llama_test.h"

void lt_quiet_log(enum ggml_log_level level, const char *text, void *ud)
{
    (void)ud;
    if (level == GGML_LOG_LEVEL_ERROR) fputs(text, stderr);
}

void lt_engine_init(void)
{
    llama_log_set(lt_quiet_log, NULL);
    ggml_backend_load_all_from_path(KVR_LLAMA_LIBDIR);
    llama_backend_init();
}

int lt_gen_model(char *path, size_t cap, const char *dir, const char *name,
                 const char *args)
{
    snprintf(path, cap, "%s/%s.gguf", dir, name);
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "/usr/bin/python3 %s -o %s %s", KVR_LLAMA_GEN_GGUF, path, args);
    return system(cmd) == 0 ? 0 : -1;
}

int lt_open(lt_lm *lm, const char *path, int type_k, int type_v, int fa, int n_ctx)
{
    memset(lm, 0, sizeof *lm);
    lm->model = llama_model_load_from_file(path, llama_model_default_params());
    if (!lm->model) return -1;
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = (uint32_t)n_ctx;
    cp.n_batch = cp.n_ubatch = (uint32_t)n_ctx;
    cp.n_threads = cp.n_threads_batch = 2;
    cp.type_k = (enum ggml_type)type_k;
    cp.type_v = (enum ggml_type)type_v;
    cp.flash_attn_type = fa ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
    lm->ctx = llama_init_from_model(lm->model, cp);
    if (!lm->ctx) return -1;
    lm->vocab = llama_model_get_vocab(lm->model);
    lm->n_vocab = llama_vocab_n_tokens(lm->vocab);
    return 0;
}

void lt_close(lt_lm *lm)
{
    if (lm->ctx) llama_free(lm->ctx);
    if (lm->model) llama_model_free(lm->model);
    memset(lm, 0, sizeof *lm);
}

void lt_tokens(llama_token *t, int n, unsigned seed)
{
    unsigned x = seed * 2654435761u + 12345u;
    for (int i = 0; i < n; i++) {
        x = x * 1103515245u + 12345u;
        t[i] = (llama_token)(3 + (x >> 16) % 256);
    }
}

int lt_decode(lt_lm *lm, const llama_token *t, int n, int pos0, float *logits)
{
    struct llama_batch b = llama_batch_init(n, 0, 1);
    for (int i = 0; i < n; i++) {
        b.token[i] = t[i];
        b.pos[i] = pos0 + i;
        b.n_seq_id[i] = 1;
        b.seq_id[i][0] = 0;
        b.logits[i] = i == n - 1;
    }
    b.n_tokens = n;
    int rc = llama_decode(lm->ctx, b);
    llama_batch_free(b);
    if (rc == 0 && logits) memcpy(logits, llama_get_logits_ith(lm->ctx, -1), (size_t)lm->n_vocab * 4);
    return rc;
}

unsigned char *lt_state(lt_lm *lm, size_t *len)
{
    size_t n = llama_state_seq_get_size(lm->ctx, 0);
    unsigned char *b = malloc(n);
    *len = llama_state_seq_get_data(lm->ctx, b, n, 0);
    return b;
}

float lt_h2f(uint16_t h)
{
    uint32_t s = (uint32_t)(h >> 15) << 31, e = (h >> 10) & 31, m = h & 1023, f;
    if (e == 0) {
        float v = (float)m * 5.9604644775390625e-8f;
        return s ? -v : v;
    }
    if (e == 31) f = s | 0x7f800000u | (m << 13);
    else f = s | ((e + 112) << 23) | (m << 13);
    float v;
    memcpy(&v, &f, 4);
    return v;
}

double lt_ulp16(double x)
{
    x = fabs(x);
    if (x < 6.103515625e-05) return 5.9604644775390625e-08;
    int e;
    frexp(x, &e);               /* x = m * 2^e, m in [0.5, 1) */
    return ldexp(1.0, e - 11);
}

double lt_max_abs(const float *a, int n)
{
    double m = 0;
    for (int i = 0; i < n; i++) m = fabs((double)a[i]) > m ? fabs((double)a[i]) : m;
    return m;
}

double lt_max_diff(const float *a, const float *b, int n)
{
    double m = 0;
    for (int i = 0; i < n; i++) {
        double d = fabs((double)a[i] - (double)b[i]);
        m = d > m ? d : m;
    }
    return m;
}
