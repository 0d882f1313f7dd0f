/*
 * worker_serve.h — internals of `kvrope-llama serve`: llama-server's HTTP API
 * on one resident model, with kvroped as its KV cache. Private to
 * worker_serve*.c.
 *
 *  worker_serve.c      HTTP (libmicrohttpd, a thread per connection): routes,
 *                      request fields, response and SSE shapes, errors.
 *  worker_serve_run.c  the engine thread: the job queue, every prompt through
 *                      the session engine (kvr__wk_sync, one session per slot),
 *                      sampling and stop rules, the commit after the response,
 *                      background refresh when idle, kvroped reconnects, metrics.
 *
 * Threads and ownership: the engine thread alone touches llama.cpp's context
 * and the kvrope connection (srv.e). Connection threads parse, tokenize (the
 * vocabulary is read-only) and wait on their job. A job is shared by its
 * connection and the engine (refs, under srv.mu); everything in it below
 * "progress" is written by the engine under srv.mu and read by the connection
 * under srv.mu. The connection cancels a job when its client goes away; the
 * engine checks between tokens.
 */
#ifndef KVR_LLAMA_WORKER_SERVE_H
#define KVR_LLAMA_WORKER_SERVE_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "client/llama/worker.h"
#include "base/list.h"
#include "base/ref.h"

#define SRV_MAX_SLOTS   64
#define SRV_MAX_STOP    16
#define SRV_MAX_BODY    (16u << 20)   /* bytes of a request body */

typedef struct srv_opts {
    const char *listen;          /* HOST:PORT (default 127.0.0.1:8080) */
    int         parallel;        /* slots (sessions); default 4 */
    uint32_t    n_ctx;           /* a request's context; 0 = the model's training context */
    uint32_t    kv_size;         /* KV cache cells for all slots; 0 = n_ctx x (parallel + 1),
                                    at most max(2 n_ctx, 131072) */
    uint32_t    n_batch;         /* /infill's layout budget; 0 = min(2048, n_ctx / 2) */
    int         n_predict;       /* a request's default n_predict, and /infill's budget for
                                    input_extra (n_ctx - n_batch - 2 n_predict), as
                                    llama-server's -n; default -1 */
    const char *api_key_file;
    uint32_t    refresh;         /* tokens refreshed after each edit point */
    uint32_t    idle_ms;         /* idle time before background refresh; default 300 */
    const char *alias;           /* model name in responses; default the file's name */
    bool        spm_infill;      /* /infill lays out suffix first (llama-server's --spm-infill) */
    bool        spm_infill_set;  /* by --spm-infill / --no-spm-infill, not by the model's key */
    bool        persist;         /* sessions put persistent (kvroped's disk tier keeps them) */
    kvr__wk_repair_opts repair;   /* seams of placed runs (reuse anywhere); default
                                    EPIC first KVR_WK_REPAIR_DEFAULT_K */
} srv_opts;

typedef enum srv_stop {
    SRV_STOP_NONE, SRV_STOP_EOS, SRV_STOP_LIMIT, SRV_STOP_WORD
} srv_stop;

/* llama-server's samplers (worker_serve_sample.c); names in samp_names[] */
enum {
    SRV_SAMP_PENALTIES, SRV_SAMP_DRY, SRV_SAMP_TOP_N_SIGMA, SRV_SAMP_TOP_K, SRV_SAMP_TYP_P,
    SRV_SAMP_TOP_P, SRV_SAMP_MIN_P, SRV_SAMP_XTC, SRV_SAMP_TEMP, SRV_SAMP_INFILL,
    SRV_SAMP_ADAPTIVE_P, SRV_SAMP_COUNT
};
#define SRV_MAX_SAMPLERS 32
#define SRV_MAX_BREAKERS 16

typedef struct srv_params {
    int      n_predict;          /* -1 = up to the end of the context */
    float    temperature, top_p, min_p;
    int      top_k;
    uint32_t seed;               /* 0xFFFFFFFF = random */
    int      samplers[SRV_MAX_SAMPLERS];   /* SRV_SAMP_*, in order */
    int      n_samplers;
    int      min_keep;
    float    typical_p, top_n_sigma, xtc_probability, xtc_threshold;
    int      repeat_last_n;      /* penalties: window of prompt + output (0 = off) */
    float    repeat_penalty, frequency_penalty, presence_penalty;
    float    dry_multiplier, dry_base;
    int      dry_allowed_length, dry_penalty_last_n;
    char    *dry_breakers[SRV_MAX_BREAKERS];   /* owned when dry_breakers_owned (a
                                                   request's), else the defaults */
    int      n_dry_breakers;
    bool     dry_breakers_owned;
    char    *stop[SRV_MAX_STOP]; /* owned */
    int      n_stop;
    int      n_indent;
    double   t_max_predict_ms;   /* 0 = none */
    bool     cache_prompt;
    int      id_slot;            /* -1 = any */
    bool     stream, return_tokens;
    bool     ignore_eos;        /* llama-server's: generate past end-of-generation tokens */
    int      n_cmpl;             /* completions of the prompt (1..slots) */
} srv_params;

/* The sampler chain of one generation (worker_serve_sample.c). p is
 * borrowed and must outlive it. kvr__srv_sample returns the next token, or
 * KVR_ENOMEM. */
struct llama_vocab;
typedef struct srv_sampler srv_sampler;
int     kvr__srv_sampler_new(srv_sampler **out, const srv_params *p, const struct llama_vocab *vocab,
                             size_t n_vocab, uint64_t seed);
int32_t kvr__srv_sample(srv_sampler *s, const float *logits, const int32_t *prompt, size_t n_prompt,
                        const int32_t *gen, size_t n_gen);
void    kvr__srv_sampler_free(srv_sampler *s);

typedef enum srv_job_kind {
    SRV_JOB_GEN, SRV_JOB_SLOT_SAVE, SRV_JOB_SLOT_RESTORE, SRV_JOB_SLOT_ERASE
} srv_job_kind;

typedef struct srv_job {
    /* input: set before the job is queued, then read-only */
    srv_job_kind kind;
    srv_params   p;
    int32_t     *toks;           /* the prompt (owned) */
    size_t       n;
    char         slot_file[256]; /* slot save / restore */
    /* progress (srv.mu) */
    char        *text;           /* generated text after stop cuts (owned) */
    size_t       len, cap;
    size_t       safe;           /* bytes of text that can be sent (no partial stop
                                    word, whole UTF-8 characters) */
    int32_t     *gen;            /* generated tokens (owned) */
    size_t       n_gen, gen_cap;
    bool         started, done, cancelled;
    int          status;         /* 0 or an HTTP error status */
    char         err_type[40], err[512];
    srv_stop     stop_type;
    char         stopping_word[128];
    bool         truncated, has_new_line;
    int          slot;
    size_t       n_cache, n_eval, tokens_cached, n_saved;
    kvr__wk_sync_res sync;        /* the engine's account of the prompt */
    bool         via_cache;
    double       t_prompt_ms, t_gen_ms, t_op_ms;
    /* queue and sharing (srv.mu) */
    kvr_ref      ref;
    kvr_list     node;           /* on srv.queue while queued */
} srv_job;

typedef struct srv_slot {
    char     session[KVR_ID_MAX + 1];
    int32_t *toks;               /* the last prompt (engine thread; written under srv.mu) */
    size_t   n;                  /* written by the engine under srv.mu (/slots reads it) */
    size_t   n_approx;           /* approximate tokens after the last step (likewise) */
    bool     processing;         /* srv.mu */
    uint64_t last_used;
    int      id_task;
} srv_slot;

typedef struct srv_metrics {
    uint64_t prompt_placed, prompt_repaired;   /* reuse anywhere: cover runs, seams */
    uint64_t requests, requests_failed, prompt_tokens, prompt_reused, prompt_refreshed,
             tokens_predicted, cache_unavailable, commit_failed, refreshed_idle, cancelled;
    double   prompt_seconds, predicted_seconds;
    uint64_t ttft_bucket[12];    /* cumulative by kvr__srv_ttft_le */
    double   ttft_sum;
    uint64_t ttft_count;
} srv_metrics;

typedef struct srv {
    srv_opts         o;
    kvr__wk_env       e;          /* engine thread only, after start */
    const char      *socket;     /* kvroped address */
    const char      *model_path;
    char             model_name[256];
    const struct llama_vocab *vocab;
    uint32_t         n_ctx, n_batch;
    uint64_t         model_hash; /* of the kvrope model name: names sessions */
    bool             connected;  /* kvroped reachable (engine thread) */
    double           t_reconnect;
    /* shared (mu) */
    pthread_mutex_t  mu;
    pthread_cond_t   wake;       /* the engine: a job, or stop */
    pthread_cond_t   progress;   /* connections: their job moved */
    kvr_list         queue;      /* srv_job.node, oldest first */
    size_t           q_len;
    bool             stopping, ready;
    srv_slot         slots[SRV_MAX_SLOTS];
    int              n_slots;
    int              n_gen_max;     /* slots generating at once: kv_size / n_ctx - 1 */
    int              next_task;
    srv_metrics      m;
    char           **keys;       /* API keys (NULL = none) */
    size_t           n_keys;
    pthread_t        engine;
} srv;

extern const double kvr__srv_ttft_le[12];

/* worker_serve_run.c */
int      kvr__srv_engine_start(srv *s);
void     kvr__srv_engine_stop(srv *s);
/* Queues a job (refs: one for the caller, one for the engine). KVR_EBUSY when
 * stopping. */
int      kvr__srv_submit(srv *s, srv_job *j);
void     kvr__srv_job_release(srv *s, srv_job *j);     /* mu held by the caller: no */
void     kvr__srv_params_free(srv_params *p);
void     kvr__srv_params_default(srv_params *p);
/* Appends n bytes of p to the NUL-terminated *buf of *len bytes (capacity
 * *cap, doubling from cap0): 0, or KVR_ENOMEM with *buf as it was. */
int      kvr__srv_buf_add(char **buf, size_t *len, size_t *cap, size_t cap0, const void *p,
                          size_t n);

/* worker_serve.c */
/* The serve command: argv holds the words after "serve". Returns the exit
 * status (0 after SIGINT / SIGTERM, 1 the model or the port cannot be used,
 * 2 usage). kvroped need not be up: the server answers without it meanwhile. */
int kvr__wk_serve_main(kvr__wk_env *e, const char *model_path, const char *socket, int threads,
                      int argc, char **argv);

#endif
