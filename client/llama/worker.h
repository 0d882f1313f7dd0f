/*
 * worker.h — internals of build/kvrope-llama, the llama.cpp worker that uses
 * kvroped as its KV cache (complete / edit / rag / ppl). Private to the
 * worker's files (client/llama/worker*.c) and its bench and tests; the public
 * bridge is kvrope_llama.h.
 *
 * Pieces:
 *  - diff (worker_diff.c, no llama.cpp): token sequences -> PIE edit hunks.
 *  - state (worker_state.c, no llama.cpp): the bytes of
 *    llama_state_seq_get_data for float caches (f32/f16/bf16; v_trans 0 and
 *    1; one stream), parsed into per-layer row pointers, gathered into
 *    kvrope's layer-major payload, and built back from payload pieces with
 *    any cell positions. The general codec (quantized types, Hadamard) is the
 *    bridge's; the worker needs cell-level access the bridge does not give.
 *  - lm (worker_lm.c): one llama.cpp model + context (two sequences in a
 *    unified KV cache: seq 1 is the scratch sequence that lets tokens be
 *    decoded in the middle of seq 0, which llama.cpp otherwise refuses).
 *  - flows (worker_flows.c): the four commands, each filling a report.
 *  - score (worker_score.c): logits and greedy continuations of a token
 *    sequence over a given KV cache (KV.bin, docs/llama.md), no daemon.
 *  - repair (worker_repair.c): seam repair of a prompt whose KV is partly
 *    placed from cached runs (EPIC first-k, CacheBlend layer deviation via
 *    a probe decode), the session engine's cover path and the CLI's
 *    `repair`.
 *
 * Conventions: int return 0 or a negative code; functions that can fail for
 * a reason worth telling write it into `char *err, size_t errlen`.
 */
#ifndef KVR_LLAMA_WORKER_H
#define KVR_LLAMA_WORKER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/uio.h>

#include "client/kvrope.h"
#include "client/llama/kvrope_llama.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- diff ----------------------------------------------------------------- */
/* One changed region: old tokens [a0, a1) became new tokens [b0, b1). */
typedef struct kvr__wk_hunk {
    size_t a0, a1, b0, b1;
} kvr__wk_hunk;

/* Minimal edit script between a and b (Myers, after trimming the common
 * prefix and suffix), grouped into hunks separated by at least one equal
 * token, in increasing order. When more than max_d insertions + deletions
 * are needed, the whole differing middle is one hunk. *out is the caller's
 * (free); *n = 0 when a == b. Returns 0 or KVR_ENOMEM. */
int kvr__wk_diff(const int32_t *a, size_t na, const int32_t *b, size_t nb, size_t max_d,
                kvr__wk_hunk **out, size_t *n);

/* Joins neighbouring hunks separated by fewer than min_gap equal tokens (an
 * editor's changes come in clusters; each hunk is one edit point that costs a
 * round of decoding and refreshing). In place; *n shrinks. */
void kvr__wk_hunks_merge(kvr__wk_hunk *h, size_t *n, size_t min_gap);

/* ---- sequence states ------------------------------------------------------ */
#define KVR_WK_GGML_F32  0
#define KVR_WK_GGML_F16  1
#define KVR_WK_GGML_BF16 30
#define KVR_WK_STATE_MAGIC 0xaf143cd8u

/* A parsed state (a float-only view of the bridge's kvr_llama_state, which
 * it owns); pointers borrow the parsed buffer. */
typedef struct kvr__wk_state {
    kvr_llama_state *ls;         /* the bridge's parse (owned) */
    uint32_t        n_cells, n_layer;
    bool            v_trans;
    int32_t         type;        /* ggml type of K and V (one float type) */
    uint32_t        el;          /* bytes per element */
    uint32_t        n_embd;      /* elements per row (n_head_kv * head_dim) */
    const int32_t  *pos;         /* n_cells, in cell order (ls's) */
    const uint8_t **k, **v;      /* n_layer each (ls's arrays) */
} kvr__wk_state;

/* Parses buf as a sequence state (llama_state_seq_get_data's form) with the
 * bridge's kvr_llama_state_parse. Refuses (a KVR_E* code, reason in err)
 * what the bridge refuses (another magic, several streams, a cell with
 * several sequences, truncated or trailing bytes, ...), a session file, and
 * quantized, mixed or unequal K / V rows. */
int  kvr__wk_state_parse(kvr__wk_state *st, const uint8_t *buf, size_t len, char *err,
                        size_t errlen);
void kvr__wk_state_free(kvr__wk_state *st);

/* Cell index holding position p (first one), or -1. */
long kvr__wk_state_find(const kvr__wk_state *st, int32_t p);

/* Copies cells[0..n) (in that order) into dst as a kvrope payload:
 * layer-major, K then V, [n][n_embd] of the state's type. dst holds
 * n_layer * 2 * n * n_embd * el bytes. */
void kvr__wk_state_gather(const kvr__wk_state *st, const uint32_t *cells, size_t n, void *dst);

/* Incremental builder of a state with n_cells cells (seq id 0, v_trans as
 * the destination context needs). Pieces come from kvrope payloads. */
typedef struct kvr__wk_sbuild {
    uint8_t  *buf;
    size_t    len;
    uint32_t  n_cells, n_layer, n_embd, el, filled;
    bool      v_trans;
    bool      borrowed;          /* buf is the caller's (kvr__wk_sbuild_init_in) */
    size_t    k_off, v_off;      /* where layer 0's K / V data start */
} kvr__wk_sbuild;

int  kvr__wk_sbuild_init(kvr__wk_sbuild *b, uint32_t n_cells, uint32_t n_layer, int32_t type,
                        uint32_t n_embd, bool v_trans);
/* The same in the caller's memory when cap holds the state (a worker's warm
 * buffer: no first touch per request), else allocated. */
int  kvr__wk_sbuild_init_in(kvr__wk_sbuild *b, void *mem, size_t cap, uint32_t n_cells,
                           uint32_t n_layer, int32_t type, uint32_t n_embd, bool v_trans);
/* Adds tokens [t0, t1) of a layer-major payload holding n_tok tokens, at
 * positions pos[0 .. t1-t0). Returns KVR_EINVAL past n_cells. */
int  kvr__wk_sbuild_add(kvr__wk_sbuild *b, const void *payload, size_t n_tok, size_t t0,
                       size_t t1, const int64_t *pos);
void kvr__wk_sbuild_free(kvr__wk_sbuild *b);

/* ---- llama.cpp ------------------------------------------------------------ */
typedef struct kvr__wk_lm kvr__wk_lm;

typedef struct kvr__wk_lm_opts {
    int      n_threads;     /* 0 = the online CPUs (at most 8) */
    uint32_t n_ctx;         /* cells of the KV cache (rounded up to 256) */
    uint32_t n_batch;       /* 0 = 512 */
} kvr__wk_lm_opts;

/* Loads the model (no context yet). Errors: a missing file, a file that is
 * not a GGUF model (llama.cpp's reason is quoted). */
int  kvr__wk_lm_load(kvr__wk_lm **out, const char *gguf, int n_threads, char *err, size_t errlen);
/* (Re)creates the context with at least n_ctx cells, and warms it up with
 * one throw-away decode (its time: kvr__wk_lm_warmup_ms). */
int    kvr__wk_lm_context(kvr__wk_lm *lm, uint32_t n_ctx, char *err, size_t errlen);
double kvr__wk_lm_warmup_ms(const kvr__wk_lm *lm);
void kvr__wk_lm_destroy(kvr__wk_lm *lm);
/* Waiting compute threads sleep instead of spinning (a ggml threadpool with
 * poll 0, attached to this and every later context): what a long-running
 * process on a shared machine wants. */
int  kvr__wk_lm_threads_sleep(kvr__wk_lm *lm, char *err, size_t errlen);
int  kvr__wk_lm_n_threads(const kvr__wk_lm *lm);

typedef struct kvr__wk_lm_info {
    uint32_t n_layer, n_head, n_head_kv, head_dim, n_embd, n_vocab, n_ctx_train;
    bool     add_bos;
    int32_t  bos;
    bool     pos_mask_only;  /* cell positions only feed the causal mask (RoPE, no SWA) */
    char     arch[64];
} kvr__wk_lm_info;
const kvr__wk_lm_info *kvr__wk_lm_info_get(const kvr__wk_lm *lm);
struct llama_model;
const struct llama_model *kvr__wk_lm_model(const kvr__wk_lm *lm);   /* borrowed */
/* The bridge's profile of the model (borrowed; NULL = none): its RoPE
 * parameters go into every context created after. */
struct kvr_llama_model;
void kvr__wk_lm_set_profile(kvr__wk_lm *lm, const struct kvr_llama_model *m);
/* ggml type of K and V (KVR_WK_GGML_F32/F16/BF16; F16 by default) and the
 * number of sequences (2..256; 2 by default) of contexts created after. */
void     kvr__wk_lm_set_cache(kvr__wk_lm *lm, int32_t type, uint32_t n_seq);
uint32_t kvr__wk_lm_n_seq(const kvr__wk_lm *lm);
/* n sequences for the caller after the scratch ones (ids kvr__wk_lm_n_seq
 * and up), from the next kvr__wk_lm_context on; kvr__wk_lm_clear then
 * clears the scratch sequences only, and leaves the reserved ones' cells. */
void     kvr__wk_lm_reserve_seqs(kvr__wk_lm *lm, uint32_t n);
/* Cells of the current context (0 = none yet). */
uint32_t kvr__wk_lm_n_ctx(const kvr__wk_lm *lm);
/* Tokens per llama_decode (and per ubatch) of the current context. */
uint32_t kvr__wk_lm_n_batch(const kvr__wk_lm *lm);

/* Tokenizes text (BOS as the vocabulary says when bos). *out is the caller's. */
int kvr__wk_lm_tokenize(kvr__wk_lm *lm, const char *text, size_t len, bool bos, int32_t **out,
                       size_t *n, char *err, size_t errlen);
/* Text of a token (piece bytes into buf, NUL-terminated); returns the length. */
size_t kvr__wk_lm_piece(kvr__wk_lm *lm, int32_t tok, char *buf, size_t cap);

/* Decodes toks[0..n) at positions pos0.. in sequence seq, in batches of
 * n_batch. Logits: none, only the last token's (LAST), or every token's
 * (ALL: the callback gets each batch's rows). */
typedef enum { KVR_WK_LOGITS_NONE, KVR_WK_LOGITS_LAST, KVR_WK_LOGITS_ALL } kvr__wk_logits_mode;
typedef void (*kvr__wk_rows_fn)(void *ud, size_t first, size_t n, const float *const *rows);
int kvr__wk_lm_decode(kvr__wk_lm *lm, const int32_t *toks, size_t n, int32_t pos0, int seq,
                     kvr__wk_logits_mode mode, kvr__wk_rows_fn fn, void *ud, char *err,
                     size_t errlen);
/* One token of an explicit batch: any position, any sequence. */
typedef struct kvr__wk_btok {
    int32_t tok, pos, seq;
    bool    logits;
} kvr__wk_btok;
typedef void (*kvr__wk_row_fn)(void *ud, size_t i, const float *row);
/* Decodes t[0..n) in order, in batches of n_batch; fn(ud, i, row) for each
 * token i that asked for logits, in increasing i (row borrowed until the
 * next decode). llama.cpp's batch rules apply: per sequence, positions
 * start right after the sequence's last cell and are consecutive. */
int kvr__wk_lm_decode_batch(kvr__wk_lm *lm, const kvr__wk_btok *t, size_t n, kvr__wk_row_fn fn,
                           void *ud, char *err, size_t errlen);
/* The last token's logits after a LAST decode (n_vocab floats, borrowed). */
const float *kvr__wk_lm_logits(kvr__wk_lm *lm);
int32_t      kvr__wk_argmax(const float *x, size_t n);
/* -log softmax(x)[target] over n logits, in double (max-shifted). */
double       kvr__wk_nll(const float *x, size_t n, int32_t target);

/* The KV cache (llama_memory_*). */
void    kvr__wk_lm_clear(kvr__wk_lm *lm);
bool    kvr__wk_lm_seq_rm(kvr__wk_lm *lm, int seq, int32_t p0, int32_t p1);
void    kvr__wk_lm_seq_cp(kvr__wk_lm *lm, int src, int dst, int32_t p0, int32_t p1);
void    kvr__wk_lm_seq_add(kvr__wk_lm *lm, int seq, int32_t p0, int32_t p1, int32_t delta);
int32_t kvr__wk_lm_pos_max(kvr__wk_lm *lm, int seq);

/* Decodes toks at positions pos0.. although seq 0 holds cells after pos0:
 * through seq 1 (seq 0's cells before pos0 copied to it, metadata only),
 * then the new cells join seq 0 and seq 1 is emptied. Cells of seq 0 in
 * [pos0, pos0 + n) are removed first. */
int kvr__wk_lm_decode_middle(kvr__wk_lm *lm, const int32_t *toks, size_t n, int32_t pos0,
                            char *err, size_t errlen);

/* State of seq 0 (the caller's buffer, *len bytes) / set it from bytes. */
int kvr__wk_lm_state_get(kvr__wk_lm *lm, uint8_t **out, size_t *len, char *err, size_t errlen);
int kvr__wk_lm_state_set(kvr__wk_lm *lm, const uint8_t *buf, size_t len, char *err,
                        size_t errlen);
/* ggml type and v_trans the context's seq states carry. */
int32_t kvr__wk_lm_cache_type(const kvr__wk_lm *lm);
bool    kvr__wk_lm_v_trans(const kvr__wk_lm *lm);

/* Probing (seam repair's selection pass): contexts created after
 * kvr__wk_lm_set_probe(lm, true) carry llama.cpp's eval callback. A probe
 * decode runs toks through seq `seq` only as far as layer `layer`'s K and V
 * projections (the RoPE'd "Kcur-L" and "Vcur-L" of each ubatch), copies them
 * out ([n][row] f32 each, row = n_head_kv * head_dim) and cuts the graph
 * there: layers below L write their KV cells, layers from L on do not, and
 * no logits come out. The caller removes the sequence's cells after. */
typedef struct kvr__wk_probe {
    uint32_t layer;
    size_t   row, cap;           /* floats per token; tokens k and v hold */
    float   *k, *v;              /* the caller's, cap * row each */
    size_t   k_off, v_off;       /* tokens seen (filled by the decode) */
    char     kname[32], vname[32];
} kvr__wk_probe;
void kvr__wk_lm_set_probe(kvr__wk_lm *lm, bool on);
bool kvr__wk_lm_probe_on(const kvr__wk_lm *lm);     /* set, and a context exists */
int  kvr__wk_lm_probe_decode(kvr__wk_lm *lm, kvr__wk_probe *p, const int32_t *toks, size_t n,
                            int32_t pos0, int seq, char *err, size_t errlen);

/* ---- seam repair (worker_repair.c) ----------------------------------------
 *
 * A prompt whose KV is partly placed (runs of tokens cached elsewhere, keys
 * re-rotated to their place here, e.g. a cover from kvroped) and partly
 * gaps. Placed tokens carry KV computed with another left context, so the
 * seams (a run's first tokens, and tokens that attended much to what is no
 * longer before them) are wrong. Repair computes the gaps and a repair set:
 *  - EPIC (LegoLink): the first k tokens of every placed run;
 *  - CacheBlend: the placed tokens whose layer-L K/V deviates most from a
 *    full encode's, a share of the placed tokens.
 * Both may be combined (union). Everything computed is decoded in increasing
 * position, each token attending to what seq 0 holds before it: placed KV
 * (approximate) or what was already recomputed. `all` recomputes every
 * placed token, which equals a full encode.
 */
typedef struct kvr__wk_repair_opts {
    uint32_t first_k;        /* EPIC: first k tokens of each placed run (0 = none) */
    double   blend_share;    /* CacheBlend: share of placed tokens (0 = none) */
    uint32_t blend_layer;    /* the selection layer, >= 1 (0 = 1: layer 0's KV
                                does not depend on context) */
    bool     all;            /* recompute every placed token */
} kvr__wk_repair_opts;
/* The default policy: from docs/eval.md's reuse table (EPIC first 16). */
#define KVR_WK_REPAIR_DEFAULT_K 16u
/* Sequences of a context by default: seq 0, seq 1 scratch, and up to 16
 * scratch sequences in all so seam repair decodes 16 runs at once
 * (kvr__wk_repair). With kv_unified the cells are shared: no memory cost. */
#define KVR_WK_LM_SEQS 17u

typedef struct kvr__wk_repair_res {
    size_t n_prompt, n_placed, n_gap;
    size_t n_repaired;       /* placed tokens recomputed */
    size_t n_computed;       /* gaps + repaired (+ the last token if placed and not chosen) */
    size_t n_probed;         /* tokens through the selection pass (0 without blend) */
    double probe_layers;     /* layers the selection pass ran for each of them */
    size_t n_decodes;        /* llama_decode groups the computed runs went in */
    double t_probe_ms, t_decode_ms;
} kvr__wk_repair_res;

/* Parses "none", "all", "epic:K", "blend:SHARE[@LAYER]" (SHARE in (0, 1] or
 * "N%"), or several joined by "+" (e.g. "epic:16+blend:0.1"). */
int kvr__wk_repair_parse(const char *s, kvr__wk_repair_opts *o, char *err, size_t errlen);
/* Per prompt token: a gap (computed), placed approximate (a repair
 * candidate), or placed exact (a run at its original place after the same
 * text, e.g. a cached prefix: never repaired). */
#define KVR_WK_GAP          0
#define KVR_WK_PLACED       1
#define KVR_WK_PLACED_EXACT 2
/* The repair set, no llama.cpp: placed[i] (n entries, KVR_WK_GAP / PLACED /
 * PLACED_EXACT), run_start[i] non-zero where a placed run begins (NULL:
 * after every gap and at 0); dev[i] the deviation of placed token i (NULL
 * unless blend_share > 0; the share is of the candidates). compute[i] := 1
 * for gaps and chosen tokens, else 0. Ties in dev go to the earlier token.
 * Returns the placed tokens chosen. */
size_t kvr__wk_repair_plan(const uint8_t *placed, const uint8_t *run_start, size_t n,
                          const float *dev, const kvr__wk_repair_opts *o, uint8_t *compute);
/* Seq 0 holds cells exactly at the placed positions of toks[0..n) (and
 * nothing at or after n); this computes the gaps and the repair set, in
 * increasing position, and the prompt's last token always (its logits are
 * current afterwards: kvr__wk_lm_logits). Blend needs a probing context
 * (kvr__wk_lm_set_probe before kvr__wk_lm_context) with room for n more
 * cells (its pass runs the whole prompt through seq 1). compute_out (n entries,
 * may be NULL) receives the plan. */
int kvr__wk_repair(kvr__wk_lm *lm, const int32_t *toks, size_t n, const uint8_t *placed,
                  const uint8_t *run_start, const kvr__wk_repair_opts *o, uint8_t *compute_out,
                  kvr__wk_repair_res *res, char *err, size_t errlen);

/* ---- reports -------------------------------------------------------------- */
struct cJSON;
typedef struct kvr__wk_report {
    struct cJSON *json;          /* the --json object */
    char         *text;          /* the plain report, lines */
    size_t        len, cap;
} kvr__wk_report;

void   kvr__wk_rep_init(kvr__wk_report *r, const char *command);
void   kvr__wk_rep_free(kvr__wk_report *r);
/* group NULL = top level, else a nested object of that name. */
void   kvr__wk_rep_num(kvr__wk_report *r, const char *group, const char *key, double v);
/* Several numbers of one group in this order, e.g. a command's timings_ms. */
typedef struct kvr__wk_rep_kv {
    const char *key;
    double      v;
} kvr__wk_rep_kv;
void   kvr__wk_rep_nums(kvr__wk_report *r, const char *group, const kvr__wk_rep_kv *kv, size_t n);
void   kvr__wk_rep_str(kvr__wk_report *r, const char *group, const char *key, const char *s);
void   kvr__wk_rep_bool(kvr__wk_report *r, const char *group, const char *key, bool v);
void   kvr__wk_rep_tokens(kvr__wk_report *r, const char *key, const int32_t *t, size_t n);
void   kvr__wk_rep_line(kvr__wk_report *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
double kvr__wk_rep_get(const kvr__wk_report *r, const char *group, const char *key); /* NaN if absent */
void   kvr__wk_rep_print(const kvr__wk_report *r, bool json, FILE *out);
void   kvr__wk_quote(const char *s, size_t n, char *out, size_t cap);

/* ---- the flows (worker_flows.c) ------------------------------------------ */
struct kvr_llama_model;
/* The daemon's cover verb (kvrope.h: kvr_client_cover, kvr_client_cover_get,
 * kvr_cover_release), through pointers: the engine's cover path builds and
 * is tested before and without the verb's client side. All NULL: the
 * session engine never asks for a cover (prefix and PIE reuse only). */
typedef struct kvr__wk_cover_api {
    int  (*cover)(kvr_client *c, const kvr_cover_args *a, kvr_cover_res *out);
    int  (*cover_get)(kvr_client *c, const kvr_cover_args *a, kvr_cover_res *out);
    void (*release)(kvr_cover_res *r);
} kvr__wk_cover_api;

typedef struct kvr__wk_env {
    kvr__wk_lm     *lm;
    struct kvr_llama_model *profile;      /* the GGUF's (owned; NULL if unread) */
    kvr_client    *kc;                    /* NULL for ppl */
    char           model[KVR_ID_MAX + 1];
    uint64_t       fingerprint;
    kvr__wk_report *rep;
    int            n_gen;                 /* tokens to generate / predict */
    int            kv_code;               /* the kvrope error of a failure, else 0 */
    bool           persist;               /* sessions put persistent (a daemon with a
                                             disk tier keeps them across its restart);
                                             cleared when the daemon has none */
    /* A prefix load's buffers (the daemon's payload, the state), allocated
     * and faulted in before the timed steps; freed by kvr__wk_env_bufs_free. */
    void          *pf_fetch, *pf_state;
    size_t         pf_fetch_cap, pf_state_cap;
    kvr__wk_cover_api cover;               /* reuse anywhere (NULLs: off) */
    char           err[1024];
} kvr__wk_env;
void kvr__wk_env_bufs_free(kvr__wk_env *e);

/* Reads the GGUF's profile (the bridge's) into e->profile and hands it to
 * the llama.cpp context parameters. */
int kvr__wk_profile(kvr__wk_env *e, const char *gguf);
/* Registers the profile in kvrope under the bridge's default name (name
 * and fingerprint into e); reads the profile first if needed. */
int kvr__wk_register(kvr__wk_env *e, const char *gguf);

int kvr__wk_complete(kvr__wk_env *e, const int32_t *toks, size_t n, bool use_cache);

typedef struct kvr__wk_edit_opts {
    const char *session;   /* the file's context in kvrope (moved forward) */
    uint32_t refresh;      /* K tokens re-encoded after each edit point */
    uint32_t max_age;      /* approximate older than this: refreshed (0: default) */
    bool     refresh_all;  /* then everything approximate, as a server when idle */
    bool     check;        /* also a full re-encode of the new file */
    size_t   max_d;        /* diff budget; 0 = 2048 */
    size_t   min_gap;      /* hunks closer than this are one op; 0 = 8 */
} kvr__wk_edit_opts;
/* a NULL: the session must exist (a starts it otherwise). */
int kvr__wk_edit(kvr__wk_env *e, const int32_t *a, size_t na, const int32_t *b, size_t nb,
                const kvr__wk_edit_opts *o);

/* The CLI's `refresh`: kvr__wk_refresh_idle on the session, reported. */
int kvr__wk_refresh_cmd(kvr__wk_env *e, const char *session, size_t budget, size_t cursor);

int kvr__wk_rag(kvr__wk_env *e, const int32_t *p, size_t np, const int32_t *const *docs,
               const size_t *ndocs, size_t n_docs, const int32_t *q, size_t nq,
               bool parallel, bool check);

/* Bits per byte of text under the model (n_bytes: the text's size). */
int kvr__wk_ppl(kvr__wk_env *e, const int32_t *toks, size_t n, size_t n_bytes, bool bos);

/* ---- between kvroped and llama.cpp (worker_kv.c) -------------------------- */
/* Sets e->err from fmt; returns r when negative, else KVR_EINVAL. */
int    kvr__wk_fail(kvr__wk_env *e, int r, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* A kvrope call failed: e->kv_code = r, e->err says what and where; returns r. */
int    kvr__wk_kv_fail(kvr__wk_env *e, int r, const char *what, const char *ctx);
/* "kvl-<kind>-<hash of the model and the tokens>". */
void   kvr__wk_ctx_name(const kvr__wk_env *e, char *out, size_t cap, const char *kind,
                       const int32_t *t, size_t n, const int32_t *t2, size_t n2);
size_t   kvr__wk_n_embd(const kvr__wk_env *e);       /* n_head_kv * head_dim */
uint32_t kvr__wk_n_layer(const kvr__wk_env *e);
size_t   kvr__wk_payload_bytes(const kvr__wk_env *e, size_t n_tok);   /* f16 layer-major */
int      kvr__wk_check_kv_shape(kvr__wk_env *e, const kvr_kv *kv, const char *ctx);
/* Writes every page once (bytes unchanged): first-touch faults happen here. */
void     kvr__wk_prefault(void *buf, size_t len);
size_t   kvr__wk_state_bytes(const kvr__wk_env *e, size_t n);
void     kvr__wk_prefault_bufs(kvr__wk_env *e, size_t n);
/* Tokens [0, n) of ctx into seq 0 at positions 0..n-1 (adds to the times). */
int      kvr__wk_load_prefix(kvr__wk_env *e, const char *ctx, size_t n, double *t_fetch,
                            double *t_load);

/* The llama.cpp state of seq 0, parsed; cell index per position [0, np). */
typedef struct kvr__wk_seqstate {
    uint8_t     *buf;
    size_t       len;
    kvr__wk_state st;
    long        *cell;    /* np entries, -1 = absent */
    size_t       np;
} kvr__wk_seqstate;
int   kvr__wk_seqstate_get(kvr__wk_env *e, kvr__wk_seqstate *s, size_t np);
void  kvr__wk_seqstate_free(kvr__wk_seqstate *s);
/* Payload (malloc'ed, the caller's) of the cells at positions pos[0..n), or
 * p0.. when pos is NULL; NULL with e->err set if one is missing. */
void *kvr__wk_seqstate_payload(kvr__wk_env *e, const kvr__wk_seqstate *s, const int64_t *pos,
                              size_t n, size_t p0);
int   kvr__wk_ctx_len(kvr__wk_env *e, const char *ctx, kvr_context *info);
/* Deletes ctx; a missing one is fine. */
int   kvr__wk_del_quiet(kvr__wk_env *e, const char *ctx);
/* A fresh context dst holding tokens [0, n) of src (len: src's length).
 * dst is deleted first: never one the caller reads from. */
int   kvr__wk_fork_prefix(kvr__wk_env *e, const char *src, const char *dst, size_t n,
                         size_t len);

/* ---- sessions: the one engine behind edit, complete and serve
 * (worker_session.c) ------------------------------------------------------
 *
 * A session is one kvrope context that follows one buffer (a file, an
 * editor buffer, a server slot): each step brings a new token sequence into
 * llama.cpp's seq 0 from what kvrope holds, computing only what it must,
 * and then moves the session's context forward to that sequence.
 *
 *  kvr__wk_sync    the prompt toks[0..n) into seq 0 at positions 0..n-1:
 *                 the session's context (or, when it is missing or shares
 *                 less, the longest cached prefix of any context of the
 *                 model) is diffed against the prompt into PIE ops; kept
 *                 tokens come back with their keys re-rotated to their new
 *                 places (approximate ones too: that is the PIE trade-off),
 *                 new tokens and the refresh set are decoded. The last
 *                 token's logits are current afterwards (kvr__wk_lm_logits).
 *  kvr__wk_commit  the step's new and refreshed KV into the session's
 *                 context: one atomic edit (or put REPLACE) of that id. It
 *                 never deletes or forks over a context it read from; a
 *                 context it read that is not the session's stays as it was.
 *  kvr__wk_refresh_idle  re-encodes up to `budget` approximate tokens of the
 *                 session (oldest first, then nearest the cursor), left to
 *                 right from the first one chosen, and stores them (refresh):
 *                 what a server does when idle, and the CLI's `refresh`.
 *
 * Approximation age: every token's flags carry how many edits ago its KV was
 * last exact (KVR_TOKEN_AGE, kept by the daemon). The refresh policy: the
 * `refresh` tokens after each edit point, plus every approximate token
 * older than `max_age` edits (so drift stays bounded without idle time).
 */
typedef struct kvr__wk_sync_opts {
    const char *session;     /* context id of this buffer; NULL: derived from the
                                prompt's content (a completion cache) */
    uint32_t    refresh;     /* tokens re-encoded after each edit point */
    uint32_t    max_age;     /* approximate tokens older than this are refreshed
                                now; 0 = the default (KVR_WK_MAX_AGE) */
    bool        exact_only;  /* reuse exact tokens only (no moved KV) */
    bool        no_cache;    /* compute everything (cache_prompt: false) */
    size_t      max_d;       /* diff budget; 0 = 2048 */
    size_t      min_gap;     /* hunks closer than this are one op; 0 = 8 */
    /* Reuse anywhere (e->cover set): when the session and the longest
     * prefix leave at least KVR_COVER_MIN_RUN tokens to compute, the daemon's
     * cover of the prompt is asked for; if it places at least that many
     * more tokens, its runs are loaded re-rotated and the gaps and this
     * repair set computed (kvr__wk_repair). NULL = EPIC first
     * KVR_WK_REPAIR_DEFAULT_K. Blend's part is skipped without a probing
     * context or room for the prompt twice in it. */
    const struct kvr__wk_repair_opts *repair;
    bool        no_cover;    /* never ask for a cover */
} kvr__wk_sync_opts;
#define KVR_WK_MAX_AGE 16u

typedef struct kvr__wk_sync_res {
    size_t n_prompt;         /* n */
    size_t n_reused;         /* KV taken from kvrope (prefix + moved) */
    size_t n_computed;       /* decoded in this step (new + refreshed + last) */
    size_t n_refreshed;      /* old tokens re-encoded (after edit points, by age) */
    size_t n_ops;            /* PIE ops against the source context */
    size_t n_approx;         /* tokens of the prompt whose KV is approximate now */
    size_t n_placed;         /* cover path: tokens placed from cached runs */
    size_t n_repaired;       /* cover path: placed tokens recomputed (seams) */
    size_t n_runs;           /* cover path: runs placed */
    char   source[KVR_ID_MAX + 1];   /* the context read ("" = none; "cover" for
                                        the cover path: runs of several) */
    double t_match_ms, t_fetch_ms, t_load_ms, t_decode_ms, t_total_ms;
} kvr__wk_sync_res;

typedef struct kvr__wk_step kvr__wk_step;   /* what commit needs of a sync */

/* *step (the caller's: kvr__wk_step_free) is NULL when nothing is to be stored. */
int  kvr__wk_sync(kvr__wk_env *e, const int32_t *toks, size_t n, const kvr__wk_sync_opts *o,
                 kvr__wk_step **step, kvr__wk_sync_res *res);
/* Seq 0 must still hold the synced prompt (generated tokens after it are not
 * stored). Errors leave the session's context as it was before the step. */
int  kvr__wk_commit(kvr__wk_env *e, kvr__wk_step *step);
void kvr__wk_step_free(kvr__wk_step *step);
/* What a step's commit writes: tokens inserted / removed by its ops. */
size_t kvr__wk_step_new_tokens(const kvr__wk_step *step);
size_t kvr__wk_step_removed_tokens(const kvr__wk_step *step);

/* Refreshes at most budget approximate tokens of `session` (its whole current
 * token sequence is loaded into seq 0 for it); cursor: a token index to
 * prefer (SIZE_MAX = none). *n_done: tokens refreshed. */
int  kvr__wk_refresh_idle(kvr__wk_env *e, const char *session, size_t budget, size_t cursor,
                         size_t *n_done);

/* ---- replay (worker_replay.c): an edit history through the engine -------- */
typedef struct kvr__wk_replay_opts {
    const char       *dir;          /* DIR/v0000.txt, v0001.txt, ... */
    size_t            max_versions; /* 0 = all */
    kvr__wk_sync_opts  sync;         /* .session names the file's session */
    bool              background;   /* refresh everything approximate after each edit */
    bool              check_all;    /* a full re-encode after every version ... */
    const size_t     *check_at;     /* ... or after these versions */
    size_t            n_check_at;
    FILE             *lines;        /* one JSON object per version (NULL = none) */
} kvr__wk_replay_opts;
int kvr__wk_replay(kvr__wk_env *e, const kvr__wk_replay_opts *o);

/* ---- score (worker_score.c) --------------------------------------------- */
typedef struct kvr__wk_gen_req {
    int64_t at;        /* I: the state is the cache before I plus T[I] */
    int64_t n;         /* tokens to generate, >= 1 */
} kvr__wk_gen_req;

typedef struct kvr__wk_score_opts {
    const uint8_t        *tokens;      /* T.bin: little-endian int32 ids */
    size_t                tokens_len;
    const uint8_t        *kv;          /* KV.bin (docs/llama.md); NULL = empty cache */
    size_t                kv_len;
    bool                  has_from, has_next_pos, has_stop;
    bool                  exact;       /* in-cache rows one per decode, full-forward cells */
    int64_t               from, next_pos;
    int32_t               stop;
    const char           *logits_out;  /* NULL = not written */
    const char           *kv_out;      /* KV.bin of T[m..N) as llama.cpp computed it; NULL = none */
    const kvr__wk_gen_req *gen;
    size_t                n_gen;
} kvr__wk_score_opts;

/* Scores T over the KV cache (every refusal: KVR_EINVAL and the reason in
 * e->err, before anything is written). */
int kvr__wk_score(kvr__wk_env *e, const kvr__wk_score_opts *o);

/* KV.bin (docs/llama.md), parsed against the model (pointers borrow the
 * file's bytes; pos is owned: free it) and loaded into seq 0 with cell j at
 * meta[j] (everything else in the cache goes). */
typedef struct kvr__wk_kvbin {
    uint32_t       n_layers, m, n_kv_heads, head_dim, dtype;
    int32_t        ggml_type;
    int64_t       *pos;           /* m (owned) */
    int64_t        pos_max;
    const uint8_t *payload;       /* borrowed from the file's bytes */
} kvr__wk_kvbin;
int kvr__wk_kvbin_parse(kvr__wk_env *e, const uint8_t *b, size_t len, kvr__wk_kvbin *kv);
int kvr__wk_kvbin_load(kvr__wk_env *e, const kvr__wk_kvbin *kv, const int64_t *meta);

/* The CLI's `repair` (the reuse eval's engine): T = a prompt of n_prompt
 * tokens and a continuation; KV.bin holds cells at some of the prompt's
 * positions (the placed ones; the rest are gaps); run starts as given.
 * kvr__wk_repair with the policy, then the continuation decoded after the
 * prompt; logits rows (f32, n_vocab each) of the prompt's last token and of
 * every continuation token but the last (so row j predicts T[n_prompt + j])
 * into logits_out. Reports the repair's counts. */
typedef struct kvr__wk_repair_cmd_opts {
    const uint8_t *tokens, *kv;
    size_t         tokens_len, kv_len, n_prompt;
    const size_t  *run_starts;
    size_t         n_run_starts;
    const char    *policy, *logits_out;
} kvr__wk_repair_cmd_opts;
int kvr__wk_repair_cmd(kvr__wk_env *e, const kvr__wk_repair_cmd_opts *o);

/* ---- time ----------------------------------------------------------------- */
double kvr__wk_now_ms(void);

#ifdef __cplusplus
}
#endif
#endif /* KVR_LLAMA_WORKER_H */
