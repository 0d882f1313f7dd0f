/*
 * worker_lm.c — the worker's one llama.cpp model and context.
 *
 * The context has a unified KV cache of two sequences, f16 K and V, flash
 * attention on (so states carry V untransposed). Sequence 0 is the text;
 * sequence 1 is scratch: llama.cpp's batch check wants every decode of a
 * sequence to start right after the last position it holds, so tokens that
 * go in the middle of seq 0 (an edit, a refresh) are decoded in seq 1 over
 * a metadata-only copy of seq 0's cells before them, then handed to seq 0
 * (kvr__wk_lm_decode_middle). Attention masks by position within a sequence,
 * so those tokens see exactly the cells before them.
 *
 * Probing (seam repair's CacheBlend selection): a context created after
 * kvr__wk_lm_set_probe(lm, true) carries llama.cpp's eval callback; it asks
 * for no tensor unless a probe decode is running, so other decodes compute
 * the whole graph as before (one graph view, the same kernels). A probe
 * decode copies layer L's RoPE'd K and V out and stops the graph there.
 *
 * llama.cpp's log goes nowhere unless KVR_LLAMA_VERBOSE is set; its last
 * error line is kept and quoted in our error messages.
 */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "ggml-backend.h"
#include "llama.h"

#include "client/llama/kvrope_llama.h"
#include "client/llama/worker.h"
#include "base/clock.h"

#ifndef KVR_LLAMA_LIBDIR
#define KVR_LLAMA_LIBDIR ""
#endif

struct kvr__wk_lm {
    struct llama_model       *model;
    struct llama_context     *ctx;
    const struct llama_vocab *vocab;
    kvr__wk_lm_info            info;
    int                       n_threads;
    uint32_t                  n_batch, n_ctx;
    struct llama_batch        batch;
    const float              *last_logits;
    double                    warmup_ms;
    const kvr_llama_model    *profile;
    int32_t                   cache_type;   /* ggml type of K and V (F16 unless set) */
    uint32_t                  n_seq;        /* scratch sequences 0..n_seq-1 (>= 2) */
    uint32_t                  n_reserved;   /* the caller's sequences after them, which
                                               kvr__wk_lm_clear leaves alone */
    struct ggml_threadpool   *tp;           /* sleeping threads (poll 0), or NULL */
    bool                      probe_on;     /* contexts get the eval callback below */
    kvr__wk_probe             *probe;        /* the active probe of a decode, or NULL */
};

/* llama.cpp's eval callback (set only when probing is on): asks for no
 * tensor unless a probe is active; then observes the probe's layer's
 * "Kcur-L" / "Vcur-L" (RoPE'd K, V of the ubatch's tokens, f32
 * [head_dim][n_head_kv][n_tokens]) and stops the graph once it has both
 * (ggml's scheduler breaks out of the split when the callback says false). */
static bool probe_cb(struct ggml_tensor *t, bool ask, void *ud)
{
    kvr__wk_lm *lm = ud;
    kvr__wk_probe *p = lm->probe;
    if (!p)
        return ask ? false : true;
    const char *nm = ggml_get_name(t);
    int which = strcmp(nm, p->kname) == 0 ? 0 : strcmp(nm, p->vname) == 0 ? 1 : -1;
    if (ask)
        return which >= 0;
    /* K: the RoPE'd tensor (the projection before it carries the same name);
     * V: its 3-D reshape (the 2-D projection shares the name). */
    if (which < 0 || t->type != GGML_TYPE_F32 || !ggml_is_contiguous(t) ||
        t->op != (which == 0 ? GGML_OP_ROPE : GGML_OP_RESHAPE))
        return true;
    size_t row = (size_t)t->ne[0] * (size_t)t->ne[1];
    size_t ntok = (size_t)t->ne[2];
    size_t *off = which == 0 ? &p->k_off : &p->v_off;
    float *dst = which == 0 ? p->k : p->v;
    if (row != p->row || *off + ntok > p->cap)
        return true;            /* not what the probe sized for: counted as missing */
    ggml_backend_tensor_get(t, dst + *off * row, 0, ntok * row * sizeof(float));
    *off += ntok;
    /* both of this ubatch seen: the rest of the graph is not needed */
    return p->k_off != p->v_off;
}

void kvr__wk_lm_set_probe(kvr__wk_lm *lm, bool on) { lm->probe_on = on; }
bool kvr__wk_lm_probe_on(const kvr__wk_lm *lm) { return lm->probe_on && lm->ctx; }

int kvr__wk_lm_probe_decode(kvr__wk_lm *lm, kvr__wk_probe *p, const int32_t *toks, size_t n,
                           int32_t pos0, int seq, char *err, size_t errlen)
{
    if (!lm->probe_on) {
        snprintf(err, errlen, "the context was created without probing (kvr__wk_lm_set_probe)");
        return KVR_EINVAL;
    }
    snprintf(p->kname, sizeof p->kname, "Kcur-%u", p->layer);
    snprintf(p->vname, sizeof p->vname, "Vcur-%u", p->layer);
    p->k_off = p->v_off = 0;
    lm->probe = p;
    int r = kvr__wk_lm_decode(lm, toks, n, pos0, seq, KVR_WK_LOGITS_NONE, NULL, NULL, err, errlen);
    lm->probe = NULL;
    lm->last_logits = NULL;      /* whatever the cut graph left is not logits */
    if (r == 0 && (p->k_off != n || p->v_off != n)) {
        snprintf(err, errlen, "probe: saw %zu / %zu of %zu tokens' %s / %s", p->k_off, p->v_off,
                 n, p->kname, p->vname);
        r = -EIO;
    }
    return r;
}

void kvr__wk_lm_set_profile(kvr__wk_lm *lm, const kvr_llama_model *m) { lm->profile = m; }

void kvr__wk_lm_set_cache(kvr__wk_lm *lm, int32_t type, uint32_t n_seq)
{
    lm->cache_type = type;
    lm->n_seq = n_seq < 2 ? 2 : n_seq > 256 ? 256 : n_seq;
}

uint32_t kvr__wk_lm_n_seq(const kvr__wk_lm *lm) { return lm->n_seq; }

void kvr__wk_lm_reserve_seqs(kvr__wk_lm *lm, uint32_t n)
{
    lm->n_reserved = n > 256 - lm->n_seq ? 256 - lm->n_seq : n;
}

uint32_t kvr__wk_lm_n_batch(const kvr__wk_lm *lm) { return lm->n_batch; }

uint32_t kvr__wk_lm_n_ctx(const kvr__wk_lm *lm)
{
    return lm->ctx ? (uint32_t)llama_n_ctx(lm->ctx) : 0;
}

static char log_last[512];
static int  log_verbose = -1;

static void log_cb(enum ggml_log_level level, const char *text, void *ud)
{
    (void)ud;
    if (log_verbose)
        fputs(text, stderr);
    if (level == GGML_LOG_LEVEL_ERROR || level == GGML_LOG_LEVEL_WARN) {
        size_t n = strlen(text);
        while (n && (text[n - 1] == '\n' || text[n - 1] == ' '))
            n--;
        if (n) {
            if (n >= sizeof log_last)
                n = sizeof log_last - 1;
            memcpy(log_last, text, n);
            log_last[n] = 0;
        }
    }
}

/* The reason a llama.cpp call failed: fmt's text, then llama.cpp's last
 * warning or error when it logged one since log_last was cleared (before
 * the call). Returns code. */
static int llama_fail(char *err, size_t errlen, int code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static int llama_fail(char *err, size_t errlen, int code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
    if (log_last[0] && n >= 0 && (size_t)n < errlen)
        snprintf(err + n, errlen - (size_t)n, ": %s", log_last);
    return code;
}

double kvr__wk_now_ms(void)
{
    return kvr_clock_mono_msf();
}

static void init_once(void)
{
    static int done;
    if (done)
        return;
    done = 1;
    const char *v = getenv("KVR_LLAMA_VERBOSE");
    log_verbose = v && *v && strcmp(v, "0") != 0;
    llama_log_set(log_cb, NULL);
    const char *dir = getenv("KVR_LLAMA_LIBDIR");
    if (!dir || !*dir)
        dir = KVR_LLAMA_LIBDIR;
    if (dir && *dir)
        ggml_backend_load_all_from_path(dir);
    else
        ggml_backend_load_all();
    llama_backend_init();
}

static int default_threads(void)
{
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n < 1 ? 1 : n > 8 ? 8 : (int)n;
}

int kvr__wk_lm_load(kvr__wk_lm **out, const char *gguf, int n_threads, char *err, size_t errlen)
{
    *out = NULL;
    struct stat sb;
    if (stat(gguf, &sb) < 0) {
        snprintf(err, errlen, "model %s: %s", gguf, strerror(errno));
        return KVR_ESYS;
    }
    if (!S_ISREG(sb.st_mode)) {
        snprintf(err, errlen, "model %s: not a regular file", gguf);
        return KVR_EINVAL;
    }
    FILE *f = fopen(gguf, "rb");
    char magic[4] = { 0 };
    if (!f || fread(magic, 1, 4, f) != 4 || memcmp(magic, "GGUF", 4) != 0) {
        if (f)
            fclose(f);
        snprintf(err, errlen, "model %s: not a GGUF file (no GGUF magic)", gguf);
        return KVR_EINVAL;
    }
    fclose(f);
    init_once();
    kvr__wk_lm *lm = calloc(1, sizeof *lm);
    if (!lm) {
        snprintf(err, errlen, "out of memory");
        return KVR_ENOMEM;
    }
    lm->n_threads = n_threads > 0 ? n_threads : default_threads();
    lm->cache_type = KVR_WK_GGML_F16;
    lm->n_seq = KVR_WK_LM_SEQS;
    struct llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    /* Read the weights in now, not page by page during the first decodes:
     * timings then measure decoding, and the load is reported apart. */
    mp.load_mode = LLAMA_LOAD_MODE_NONE;
    log_last[0] = 0;
    lm->model = llama_model_load_from_file(gguf, mp);
    if (!lm->model) {
        free(lm);
        return llama_fail(err, errlen, KVR_EINVAL, "model %s: llama.cpp cannot load it", gguf);
    }
    lm->vocab = llama_model_get_vocab(lm->model);
    kvr__wk_lm_info *in = &lm->info;
    in->n_layer = (uint32_t)llama_model_n_layer(lm->model);
    in->n_head = (uint32_t)llama_model_n_head(lm->model);
    in->n_head_kv = (uint32_t)llama_model_n_head_kv(lm->model);
    in->n_embd = (uint32_t)llama_model_n_embd(lm->model);
    in->head_dim = in->n_head ? in->n_embd / in->n_head : 0;
    char buf[128];
    if (llama_model_meta_val_str(lm->model, "general.architecture", in->arch, sizeof in->arch) < 0)
        snprintf(in->arch, sizeof in->arch, "?");
    snprintf(buf, sizeof buf, "%s.attention.key_length", in->arch);
    char val[32];
    if (llama_model_meta_val_str(lm->model, buf, val, sizeof val) > 0)
        in->head_dim = (uint32_t)strtoul(val, NULL, 10);
    in->n_vocab = (uint32_t)llama_vocab_n_tokens(lm->vocab);
    in->n_ctx_train = (uint32_t)llama_model_n_ctx_train(lm->model);
    in->add_bos = llama_vocab_get_add_bos(lm->vocab);
    in->bos = llama_vocab_bos(lm->vocab);
    /* Cell positions feed nothing but the causal mask (and the batch
     * checks) when keys are rotated once at encode time: RoPE, no sliding
     * window, no M-RoPE. */
    int rt = llama_model_rope_type(lm->model);
    in->pos_mask_only = rt == LLAMA_ROPE_TYPE_NORM || rt == LLAMA_ROPE_TYPE_NEOX;
    if (llama_model_n_swa(lm->model) > 0)
        in->pos_mask_only = false;
    *out = lm;
    return 0;
}

int kvr__wk_lm_context(kvr__wk_lm *lm, uint32_t n_ctx, char *err, size_t errlen)
{
    if (lm->ctx) {
        llama_free(lm->ctx);
        lm->ctx = NULL;
        llama_batch_free(lm->batch);
    }
    n_ctx = (n_ctx + 255) / 256 * 256;
    if (n_ctx < 256)
        n_ctx = 256;
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = n_ctx;
    cp.n_batch = 512;
    cp.n_ubatch = 512;
    cp.n_seq_max = lm->n_seq + lm->n_reserved;
    cp.kv_unified = true;
    cp.n_threads = lm->n_threads;
    cp.n_threads_batch = lm->n_threads;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_ENABLED;
    cp.type_k = (enum ggml_type)lm->cache_type;
    cp.type_v = (enum ggml_type)lm->cache_type;
    cp.no_perf = true;
    if (lm->probe_on) {
        cp.cb_eval = probe_cb;
        cp.cb_eval_user_data = lm;
    }
    if (lm->profile)
        kvr_llama_model_context_params(lm->profile, &cp);
    log_last[0] = 0;
    lm->ctx = llama_init_from_model(lm->model, cp);
    if (!lm->ctx)
        return llama_fail(err, errlen, KVR_EINVAL,
                          "llama.cpp cannot create a context of %u cells", n_ctx);
    if (lm->tp)
        llama_attach_threadpool(lm->ctx, lm->tp, lm->tp);
    lm->n_ctx = llama_n_ctx(lm->ctx);
    lm->n_batch = llama_n_batch(lm->ctx);
    lm->batch = llama_batch_init((int32_t)lm->n_batch, 0, 2);
    lm->last_logits = NULL;
    /* One throw-away decode (seq 1, removed after): threads, buffers and the
     * weights' cache lines come up here rather than in the first timed step,
     * as they would be in a worker that has served a request before. */
    double t0 = kvr__wk_now_ms();
    int32_t tok = lm->info.bos >= 0 ? lm->info.bos : 0;
    int r = kvr__wk_lm_decode(lm, &tok, 1, 0, 1, KVR_WK_LOGITS_LAST, NULL, NULL, err, errlen);
    llama_memory_seq_rm(llama_get_memory(lm->ctx), 1, -1, -1);
    lm->last_logits = NULL;
    lm->warmup_ms = kvr__wk_now_ms() - t0;
    return r;
}

double kvr__wk_lm_warmup_ms(const kvr__wk_lm *lm) { return lm->warmup_ms; }

void kvr__wk_lm_destroy(kvr__wk_lm *lm)
{
    if (!lm)
        return;
    if (lm->ctx) {
        llama_batch_free(lm->batch);
        llama_free(lm->ctx);
    }
    if (lm->model)
        llama_model_free(lm->model);
    if (lm->tp) {
        ggml_backend_reg_t reg = ggml_backend_reg_by_name("CPU");
        void *sym = reg ? ggml_backend_reg_get_proc_address(reg, "ggml_threadpool_free") : NULL;
        void (*tp_free)(struct ggml_threadpool *) = NULL;
        memcpy(&tp_free, &sym, sizeof sym);     /* dlsym's idiom: ISO C has no cast */
        if (tp_free)
            tp_free(lm->tp);
    }
    free(lm);
}

const kvr__wk_lm_info *kvr__wk_lm_info_get(const kvr__wk_lm *lm) { return &lm->info; }

const struct llama_model *kvr__wk_lm_model(const kvr__wk_lm *lm) { return lm->model; }

int kvr__wk_lm_tokenize(kvr__wk_lm *lm, const char *text, size_t len, bool bos, int32_t **out,
                       size_t *n, char *err, size_t errlen)
{
    *out = NULL;
    *n = 0;
    if (len > (size_t)INT32_MAX / 2) {
        snprintf(err, errlen, "text of %zu bytes is too long", len);
        return KVR_EINVAL;
    }
    size_t cap = len + 8;
    int32_t *t = malloc(cap * sizeof *t);
    if (!t) {
        snprintf(err, errlen, "out of memory");
        return KVR_ENOMEM;
    }
    int32_t r = llama_tokenize(lm->vocab, text, (int32_t)len, t, (int32_t)cap, bos, false);
    if (r < 0) {
        cap = (size_t)-r;
        int32_t *nt = realloc(t, cap * sizeof *t);
        if (!nt) {
            free(t);
            return KVR_ENOMEM;
        }
        t = nt;
        r = llama_tokenize(lm->vocab, text, (int32_t)len, t, (int32_t)cap, bos, false);
    }
    if (r < 0) {
        free(t);
        snprintf(err, errlen, "tokenization failed");
        return KVR_EINVAL;
    }
    *out = t;
    *n = (size_t)r;
    return 0;
}

size_t kvr__wk_lm_piece(kvr__wk_lm *lm, int32_t tok, char *buf, size_t cap)
{
    int32_t r = llama_token_to_piece(lm->vocab, tok, buf, (int32_t)(cap - 1), 0, false);
    if (r < 0)
        r = 0;
    buf[r] = 0;
    return (size_t)r;
}

/* Row j of a batch: one token of one sequence at pos (common_batch_add's
 * job), with its logits asked for or not. */
static void batch_set(struct llama_batch *b, size_t j, int32_t tok, int32_t pos, int seq,
                      bool logits)
{
    b->token[j] = tok;
    b->pos[j] = pos;
    b->n_seq_id[j] = 1;
    b->seq_id[j][0] = seq;
    b->logits[j] = logits;
}

/* llama_decode of the batch's first m rows (batch_set), log_last cleared
 * first so that a failure can quote llama.cpp. */
static int batch_decode(kvr__wk_lm *lm, size_t m)
{
    lm->batch.n_tokens = (int32_t)m;
    log_last[0] = 0;
    return llama_decode(lm->ctx, lm->batch);
}

int kvr__wk_lm_decode(kvr__wk_lm *lm, const int32_t *toks, size_t n, int32_t pos0, int seq,
                     kvr__wk_logits_mode mode, kvr__wk_rows_fn fn, void *ud, char *err,
                     size_t errlen)
{
    lm->last_logits = NULL;
    for (size_t i = 0; i < n;) {
        size_t m = n - i < lm->n_batch ? n - i : lm->n_batch;
        struct llama_batch *b = &lm->batch;
        for (size_t j = 0; j < m; j++)
            batch_set(b, j, toks[i + j], pos0 + (int32_t)(i + j), seq,
                      mode == KVR_WK_LOGITS_ALL || (mode == KVR_WK_LOGITS_LAST && i + j == n - 1));
        int r = batch_decode(lm, m);
        if (r != 0)
            return llama_fail(err, errlen, KVR_EIO,
                              "llama_decode of %zu tokens at position %d failed (%d)", m,
                              pos0 + (int)i, r);
        if (mode == KVR_WK_LOGITS_ALL && fn) {
            const float *rows[512];
            for (size_t j0 = 0; j0 < m; j0 += 512) {
                size_t c = m - j0 < 512 ? m - j0 : 512;
                for (size_t j = 0; j < c; j++)
                    rows[j] = llama_get_logits_ith(lm->ctx, (int32_t)(j0 + j));
                fn(ud, i + j0, c, rows);
            }
        }
        i += m;
        if (i == n && mode == KVR_WK_LOGITS_LAST)
            lm->last_logits = llama_get_logits_ith(lm->ctx, (int32_t)m - 1);
    }
    return 0;
}

int kvr__wk_lm_decode_batch(kvr__wk_lm *lm, const kvr__wk_btok *t, size_t n, kvr__wk_row_fn fn,
                           void *ud, char *err, size_t errlen)
{
    lm->last_logits = NULL;
    for (size_t i = 0; i < n;) {
        size_t m = n - i < lm->n_batch ? n - i : lm->n_batch;
        struct llama_batch *b = &lm->batch;
        for (size_t j = 0; j < m; j++)
            batch_set(b, j, t[i + j].tok, t[i + j].pos, t[i + j].seq, t[i + j].logits);
        int r = batch_decode(lm, m);
        if (r != 0)
            return llama_fail(err, errlen, KVR_EIO,
                              "llama_decode of %zu tokens (the first at position %d, sequence "
                              "%d) failed (%d)", m, t[i].pos, t[i].seq, r);
        for (size_t j = 0; j < m; j++) {
            if (!t[i + j].logits)
                continue;
            const float *row = llama_get_logits_ith(lm->ctx, (int32_t)j);
            if (!row) {
                snprintf(err, errlen, "llama.cpp has no logits for batch row %zu", j);
                return KVR_EIO;
            }
            if (fn)
                fn(ud, i + j, row);
            if (i + j == n - 1)
                lm->last_logits = row;
        }
        i += m;
    }
    return 0;
}

const float *kvr__wk_lm_logits(kvr__wk_lm *lm) { return lm->last_logits; }

int32_t kvr__wk_argmax(const float *x, size_t n)
{
    size_t best = 0;
    for (size_t i = 1; i < n; i++)
        if (x[i] > x[best])
            best = i;
    return (int32_t)best;
}

double kvr__wk_nll(const float *x, size_t n, int32_t target)
{
    double mx = (double)x[0];
    for (size_t i = 1; i < n; i++)
        if ((double)x[i] > mx)
            mx = (double)x[i];
    double s = 0;
    for (size_t i = 0; i < n; i++)
        s += exp((double)x[i] - mx);
    return mx + log(s) - (double)x[target];
}

void kvr__wk_lm_clear(kvr__wk_lm *lm)
{
    llama_memory_t mem = llama_get_memory(lm->ctx);
    if (!lm->n_reserved) {
        llama_memory_clear(mem, true);
        return;
    }
    for (uint32_t q = 0; q < lm->n_seq; q++)
        llama_memory_seq_rm(mem, (llama_seq_id)q, -1, -1);
}

bool kvr__wk_lm_seq_rm(kvr__wk_lm *lm, int seq, int32_t p0, int32_t p1)
{
    return llama_memory_seq_rm(llama_get_memory(lm->ctx), seq, p0, p1);
}

void kvr__wk_lm_seq_cp(kvr__wk_lm *lm, int src, int dst, int32_t p0, int32_t p1)
{
    llama_memory_seq_cp(llama_get_memory(lm->ctx), src, dst, p0, p1);
}

void kvr__wk_lm_seq_add(kvr__wk_lm *lm, int seq, int32_t p0, int32_t p1, int32_t delta)
{
    llama_memory_seq_add(llama_get_memory(lm->ctx), seq, p0, p1, delta);
}

int32_t kvr__wk_lm_pos_max(kvr__wk_lm *lm, int seq)
{
    return llama_memory_seq_pos_max(llama_get_memory(lm->ctx), seq);
}

int kvr__wk_lm_decode_middle(kvr__wk_lm *lm, const int32_t *toks, size_t n, int32_t pos0,
                            char *err, size_t errlen)
{
    llama_memory_t mem = llama_get_memory(lm->ctx);
    if (n == 0)
        return 0;
    llama_memory_seq_rm(mem, 0, pos0, pos0 + (int32_t)n);
    if (llama_memory_seq_pos_max(mem, 0) < pos0)     /* nothing after: plain append */
        return kvr__wk_lm_decode(lm, toks, n, pos0, 0, KVR_WK_LOGITS_LAST, NULL, NULL, err,
                                errlen);
    llama_memory_seq_rm(mem, 1, -1, -1);
    if (pos0 > 0)
        llama_memory_seq_cp(mem, 0, 1, 0, pos0);
    int r = kvr__wk_lm_decode(lm, toks, n, pos0, 1, KVR_WK_LOGITS_LAST, NULL, NULL, err, errlen);
    if (r == 0)
        llama_memory_seq_cp(mem, 1, 0, pos0, pos0 + (int32_t)n);
    llama_memory_seq_rm(mem, 1, -1, -1);
    return r;
}

int kvr__wk_lm_state_get(kvr__wk_lm *lm, uint8_t **out, size_t *len, char *err, size_t errlen)
{
    size_t n = llama_state_seq_get_size(lm->ctx, 0);
    uint8_t *b = malloc(n ? n : 1);
    if (!b) {
        snprintf(err, errlen, "out of memory for a state of %zu bytes", n);
        return KVR_ENOMEM;
    }
    size_t w = llama_state_seq_get_data(lm->ctx, b, n, 0);
    if (w == 0 || w > n) {
        free(b);
        snprintf(err, errlen, "llama_state_seq_get_data failed%s%s", log_last[0] ? ": " : "",
                 log_last);
        return KVR_EIO;
    }
    *out = b;
    *len = w;
    return 0;
}

int kvr__wk_lm_state_set(kvr__wk_lm *lm, const uint8_t *buf, size_t len, char *err,
                        size_t errlen)
{
    log_last[0] = 0;
    lm->last_logits = NULL;
    if (llama_state_seq_set_data(lm->ctx, buf, len, 0) == 0) {
        snprintf(err, errlen, "llama_state_seq_set_data refused the state%s%s",
                 log_last[0] ? ": " : "", log_last);
        return KVR_EINVAL;
    }
    return 0;
}

int32_t kvr__wk_lm_cache_type(const kvr__wk_lm *lm) { return lm->cache_type; }

bool kvr__wk_lm_v_trans(const kvr__wk_lm *lm)
{
    (void)lm;
    return false;   /* flash attention on */
}

int kvr__wk_lm_threads_sleep(kvr__wk_lm *lm, char *err, size_t errlen)
{
    if (lm->tp)
        return 0;
    /* ggml_threadpool_new lives in the CPU backend, a shared object loaded at
     * run time: reached through the backend registry, not linked. */
    ggml_backend_reg_t reg = ggml_backend_reg_by_name("CPU");
    void *sym = reg ? ggml_backend_reg_get_proc_address(reg, "ggml_threadpool_new") : NULL;
    struct ggml_threadpool *(*tp_new)(struct ggml_threadpool_params *) = NULL;
    memcpy(&tp_new, &sym, sizeof sym);
    if (!tp_new) {
        snprintf(err, errlen, "the CPU backend does not export ggml_threadpool_new");
        return KVR_EUNSUPPORTED;
    }
    struct ggml_threadpool_params tpp = ggml_threadpool_params_default(lm->n_threads);
    tpp.poll = 0;
    lm->tp = tp_new(&tpp);
    if (!lm->tp) {
        snprintf(err, errlen, "ggml cannot create a threadpool of %d threads", lm->n_threads);
        return KVR_ENOMEM;
    }
    if (lm->ctx)
        llama_attach_threadpool(lm->ctx, lm->tp, lm->tp);
    return 0;
}

int kvr__wk_lm_n_threads(const kvr__wk_lm *lm) { return lm->n_threads; }
