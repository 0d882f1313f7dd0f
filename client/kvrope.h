/*
 * kvrope.h — libkvrope, the C client of kvroped. This is the whole public
 * API of the library (together with rope/rope.h, which it includes: the
 * library bundles the RoPE engine so that a worker can re-position keys
 * locally with the same kernels the daemon uses).
 *
 * Model. A kvr_client is one blocking connection to one daemon. Each call
 * sends one request frame and reads its response before returning; calls on
 * one handle must not overlap (use one handle per thread). Different handles
 * are independent and may be used from different threads at once.
 *
 * Errors. Every call returns 0 on success or a negative KVR_E* code
 * (rope/error.h): a daemon's Status s arrives as KVR_E_FROM_STATUS(s), the
 * very code the daemon's store returned (KVR_ENOCTX for E_UNKNOWN_CONTEXT);
 * KVR_ESYS, KVR_ECLOSED, KVR_EPROTO and KVR_EBUFFER are the client's own
 * (connection, protocol, buffers), KVR_ENOMEM also when the client cannot
 * allocate. After a failure kvr_client_last_error() returns the daemon's
 * message (or the client's own description). A daemon error leaves the
 * connection usable; KVR_ESYS, KVR_ECLOSED and KVR_EPROTO leave it closed,
 * and every later call fails with KVR_ECLOSED.
 *
 * Ownership, in one sentence per kind of thing:
 *  - Every pointer argument is borrowed for the duration of the call only.
 *  - Arrays returned through `T **out` (models, contexts, metrics) are the
 *    caller's, one allocation each, freed with kvr_client_free().
 *  - A kvr_kv result owns its metadata arrays and, unless the caller supplied
 *    the destination buffer, its payload: release it with kvr_kv_release().
 *  - Strings returned as `const char *` are borrowed from the handle (or are
 *    static) and valid until the next call on the same handle.
 *
 * Payload layout (put, get, match+get): layer-major; for each layer, K then
 * V, each [n_tokens][n_kv_heads][head_dim] little-endian elements of dtype.
 */
#ifndef KVR_KVROPE_H
#define KVR_KVROPE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

#include "rope/rope.h"
#include "rope/types.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- version ------------------------------------------------------------ */
/* The library's version. The ABI is that of the major version (SONAME
 * libkvrope.so.KVR_VERSION_MAJOR); 0.x releases may change it in a minor. */
#define KVR_VERSION_MAJOR 0
#define KVR_VERSION_MINOR 3
#define KVR_VERSION_PATCH 0
#define KVR_VERSION_HEX ((KVR_VERSION_MAJOR << 16) | (KVR_VERSION_MINOR << 8) | KVR_VERSION_PATCH)

/* Of the library actually loaded (compare with KVR_VERSION_HEX, the one
 * compiled against): (major << 16) | (minor << 8) | patch, and "0.3.0". */
unsigned    kvr_version(void);
const char *kvr_version_string(void);

/* ---- errors ------------------------------------------------------------- */
/* The codes (KVR_E*), kvr_strerror, kvr_error_name and the wire mapping are
 * rope/error.h's, included through rope/rope.h: the library, the daemon and
 * the store share one error space. */

/* ---- connection --------------------------------------------------------- */
typedef struct kvr_client kvr_client;

typedef struct kvr_client_opts {
    const void *token;      /* shared-secret token (borrowed), NULL = none */
    size_t      token_len;  /* 0 = strlen(token) */
    int         timeout_ms; /* send/receive timeout; 0 = wait forever */
} kvr_client_opts;

/* Connects to `addr`: "unix:PATH", a path containing '/', "tcp:HOST:PORT",
 * "HOST:PORT" or "[V6ADDR]:PORT"; NULL: $KVROPE_SOCKET, else the daemon's
 * default socket (the CLI's and `make run`'s: $XDG_RUNTIME_DIR/kvrope/
 * kvroped.sock, /run/kvrope/kvroped.sock as root, /tmp/kvrope-$UID/
 * kvroped.sock). With a token, authenticates first.
 * opts may be NULL. On success *out is the caller's (kvr_client_close). On
 * failure *out is NULL and kvr_client_last_error(NULL) returns the reason
 * (thread-local, valid until the next failed connect on this thread). */
int  kvr_client_connect(kvr_client **out, const char *addr, const kvr_client_opts *opts);
void kvr_client_close(kvr_client *c);          /* NULL is a no-op */

/* The message of the last failed call on c ("" if the last call succeeded);
 * borrowed, valid until the next call on c. c = NULL: see connect. */
const char *kvr_client_last_error(const kvr_client *c);

/* Frees an array returned by this library. NULL is a no-op. */
void kvr_client_free(void *p);

/* Called while a payload is sent or received: done/total bytes of the
 * current call's payload. Runs on the calling thread, inside the call. */
typedef void (*kvr_progress_fn)(void *ud, uint64_t done, uint64_t total);
void kvr_client_set_progress(kvr_client *c, kvr_progress_fn fn, void *ud);

typedef struct kvr_pong {
    char     server[128];   /* daemon name and version */
    uint32_t protocol;      /* protocol version */
} kvr_pong;
int kvr_client_ping(kvr_client *c, kvr_pong *out /* may be NULL */);

/* ---- models ------------------------------------------------------------- */
/* Names (context ids, model names) are at most KVR_ID_MAX bytes, canonical
 * codec specs fit in KVR_CODEC_NAME_MAX bytes with the NUL (rope/types.h).
 * Codec specs (docs/quantized.md): "f32" | "f16" | "bf16" (plain), "int8" |
 * "int4" | "int2" ["/gN"], "q8_0" | "q4_0" | "q4_1" | "q5_0", "k4v2"-style
 * "k<b>v<b>" (the default grouping; "quant" = "k4v2"),
 * "kivi:k<b>v<b>[:gG][:rR]", "k=<codec>[/c],v=<codec>[,r=R]". A bad spec is
 * KVR_EINVAL with the daemon's explanation. */

typedef struct kvr_model {
    char     name[KVR_ID_MAX + 1];
    uint32_t n_layers, n_kv_heads, head_dim;
    kvr_dtype dtype;
    uint64_t fingerprint;      /* shape + RoPE parameters + dtype */
    uint64_t n_contexts;
    char     codec[KVR_CODEC_NAME_MAX]; /* default codec of its contexts, canonical
                                           ("f16": plain, "k=int4/g128/c,v=..,r=128") */
    kvr_rope_config rope;      /* the RoPE parameters; shape fields as above */
} kvr_model;

typedef struct kvr_model_params {
    const char *name;
    /* Text of an HF config.json (shape and RoPE), or NULL. len 0 = strlen. */
    const char *config_json;
    size_t      config_json_len;
    const char *style;         /* NULL, "neox" or "gptj": overrides the config */
    /* Explicit shape: 0 = from config_json. */
    uint32_t    n_layers, n_kv_heads, head_dim;
    kvr_dtype   dtype;         /* native dtype of the model's KV (F32 is 0: set it) */
    /* Explicit RoPE parameters, used when config_json is NULL (borrowed). The
     * shape fields of the struct are ignored; NULL = the HF defaults. */
    const kvr_rope_config *rope;
    const char *codec;         /* default codec of the model's contexts; NULL or
                                  "": the dtype, plain */
} kvr_model_params;

/* Registers (or re-registers identically) a model; out may be NULL. */
int kvr_client_model_register(kvr_client *c, const kvr_model_params *p, kvr_model *out);
/* Convenience: config.json read from a file / given as a NUL-terminated text. */
int kvr_client_model_register_file(kvr_client *c, const char *name, const char *config_path,
                                   const char *style, kvr_dtype dtype, kvr_model *out);
int kvr_client_model_register_json(kvr_client *c, const char *name, const char *json,
                                   const char *style, kvr_dtype dtype, kvr_model *out);
/* *out is the caller's (kvr_client_free), *n entries. */
int kvr_client_model_list(kvr_client *c, kvr_model **out, size_t *n);

/* Looks one model up by name (via the list); KVR_ENOMODEL if absent. */
int kvr_client_model_get(kvr_client *c, const char *name, kvr_model *out);
/* Removes a model no context uses (KVR_EBUSY otherwise, KVR_ENOMODEL if
 * absent; KVR_EUNSUPPORTED for a model persisted on the disk tier). */
int kvr_client_model_remove(kvr_client *c, const char *name);

/* ---- put ---------------------------------------------------------------- */
/* Modes: kvr_put_mode, the store's (rope/types.h): KVR_PUT_CREATE = 0
 * (KVR_EEXIST if the context exists), KVR_PUT_APPEND (KVR_ENOCTX if it does
 * not), KVR_PUT_UPSERT (create or append), KVR_PUT_REPLACE (create, or
 * replace an existing context of the same model at once, as Redis' SET: a
 * new context is built beside the old one, which stays readable until the
 * put commits and then goes as a delete would; a refused or aborted put
 * leaves the old one as it was; KVR_EBUSY while the old one is being
 * written). */
typedef struct kvr_put_args {
    const char     *ctx_id;
    const char     *model;
    kvr_put_mode    mode;
    uint64_t        fingerprint;      /* 0 = unchecked */
    uint32_t        n_layers, n_kv_heads, head_dim;  /* 0 = the model's */
    kvr_dtype       dtype;            /* of the payload (F32 is 0: set it) */
    const uint32_t *tokens;           /* n_tokens ids */
    size_t          n_tokens;
    const int64_t  *positions;        /* NULL, or one per token */
    bool            has_pos_start;    /* contiguous from pos_start; neither:
                                         the context's last position + 1 */
    int64_t         pos_start;
    bool            pin;
    /* The payload: either one contiguous layer-major buffer, or an iovec
     * list whose concatenation is that buffer (e.g. K and V of each layer
     * where they already lie). Sent with sendmsg, never copied. Borrowed. */
    const void         *payload;
    size_t              payload_len;
    const struct iovec *iov;
    size_t              iovcnt;
    /* What a put can do besides storing KV; zero = unused. */
    uint64_t            protect_first;  /* after the put, edits may not touch
                                           tokens [0, n) (attention sinks);
                                           KVR_ERANGE if n > length */
    bool                has_protect;    /* send protect_first (0 = unprotect) */
    /* Create only (position layouts): */
    const char         *prefix_ctx;     /* APE: this KV was encoded after that
                                           prefix context; positions default
                                           to P, P+1, ... */
    const char *const  *groups;         /* GPE: n_groups group names */
    size_t              n_groups;
    const int64_t      *group_offsets;  /* phi per group, NULL = 0 */
    const char         *codec;          /* create: storage codec of the new
                                           context (docs/quantized.md), NULL =
                                           the model's default. On an existing
                                           context it must be its codec. */
    bool                persist;        /* the put, and every later change of the
                                           context, is acknowledged only once on
                                           disk; it survives restarts and kill -9
                                           (a daemon without --disk-dir refuses
                                           it with KVR_EUNSUPPORTED) */
    bool                share;          /* publish the context to the daemon's
                                           shared tier (kvroped --remote-tier,
                                           docs/cluster.md) after the local
                                           acknowledgement (ABI 0.3) */
    bool                share_sync;     /* with or without share: acknowledge
                                           only once published; if that fails,
                                           KVR_EIO "stored locally, not shared:
                                           ..." (the local put stands). A daemon
                                           without a remote tier refuses a share
                                           with KVR_EUNSUPPORTED, storing nothing */
    bool                v_trans;        /* create: the KV comes from an engine whose
                                           V cache is transposed (llama.cpp with
                                           flash attention off). Only recorded (V is
                                           stored per token either way) and reported
                                           by stat, so an export can default to that
                                           layout; an append keeps the context's
                                           record */
} kvr_put_args;

typedef struct kvr_put_res {
    uint64_t n_tokens;       /* context length after the put */
    uint64_t first_index;    /* index of the first token put */
    int64_t  first_pos, last_pos;
} kvr_put_res;

int kvr_client_put(kvr_client *c, const kvr_put_args *a, kvr_put_res *out /* may be NULL */);


/* Bytes of a layer-major payload: n_layers * 2 * tokens * heads * dim * dsize.
 * 0 on overflow or an unknown dtype. */
size_t kvr_payload_size(uint32_t n_layers, size_t n_tokens, uint32_t n_kv_heads,
                        uint32_t head_dim, kvr_dtype dtype);

/* ---- get ---------------------------------------------------------------- */
/* Per-token flags: KVR_TOKEN_APPROX (KV computed against text that has
 * changed since), KVR_TOKEN_PENDING (inserted by an edit without KV: none
 * until a refresh; a get of it is KVR_EPENDING, a meta_only get works),
 * KVR_TOKEN_STALE (with APPROX: restored from an older state after the
 * newest log record was found corrupt; docs/protocol.md, Persistence). */

/* Called during a get as soon as every byte of one layer has arrived, with
 * that layer's K and V in the destination buffer (borrowed for the callback). */
typedef void (*kvr_layer_fn)(void *ud, uint32_t index, uint32_t layer,
                             const void *k, const void *v, size_t bytes_each);

typedef struct kvr_get_args {
    const char     *ctx_id;
    uint64_t        start;          /* token index range [start, end) */
    uint64_t        end;            /* 0 = to the end of the context */
    kvr_dtype       dtype;          /* of the result (F32 is 0: set it) */
    const int64_t  *positions;      /* NULL = the current positions, else one
                                       target position per token in the range */
    size_t          n_positions;
    const uint32_t *layers;         /* NULL = all layers, else a subset */
    size_t          n_layers;
    bool            meta_only;      /* tokens/positions/flags, no payload */
    /* Destination: the caller's buffer (borrowed; the payload is received
     * straight into it; KVR_EBUFFER if too small, connection kept), or
     * NULL for a buffer the library allocates and kvr_kv_release frees. */
    void           *dst;
    size_t          dst_cap;
    kvr_layer_fn    on_layer;       /* optional streaming callback */
    void           *on_layer_ud;
    bool            raw;            /* the stored encoded bytes of a quantized
                                       context (kvr_kv.raw says how they are
                                       laid out); a get of tokens still in the
                                       full-precision window is
                                       KVR_EUNSUPPORTED; dtype, positions and
                                       on_layer are ignored */
} kvr_get_args;

/* Raw get of a quantized context: the stored encoded bytes, keys pre-RoPE
 * (docs/quantized.md). For each layer of kv->layers: k_bytes of K, then
 * v_bytes of V. V: one row of v_unit_bytes per token. K per token: likewise
 * (k_unit_bytes). K per channel: ceil(n/k_group) tiles of k_unit_bytes, token
 * i = row i % k_group of tile i / k_group (rows past the end are padding).
 * A worker decodes, then rotates the keys at kv->positions. Filled in
 * kvr_kv.raw by a get with kvr_get_args.raw (raw.raw false otherwise). */
typedef struct kvr_raw_layout {
    bool     raw;                     /* the payload is encoded (else ignore) */
    char     codec[KVR_CODEC_NAME_MAX]; /* the context's canonical codec */
    char     k_codec[32], v_codec[32];/* "int4/g128", "q4_0", ... (no "/c") */
    bool     k_per_channel;           /* K in tiles of k_group tokens (KIVI) */
    uint32_t k_group, v_group;        /* values per group (ggml 32, plain 1) */
    uint32_t window;                  /* full-precision window R */
    uint64_t k_bytes, v_bytes;        /* of one layer */
    uint64_t k_unit_bytes, v_unit_bytes;
} kvr_raw_layout;

typedef struct kvr_kv {
    char      ctx_id[KVR_ID_MAX + 1];
    char      model[KVR_ID_MAX + 1];
    uint64_t  start, n_tokens;
    kvr_dtype dtype;
    uint32_t  n_kv_heads, head_dim;
    size_t    n_layers;
    uint32_t *layers;         /* the layer ids in the payload, in order */
    uint32_t *tokens;         /* n_tokens each */
    int64_t  *positions;      /* positions the returned keys are rotated at */
    uint32_t *flags;          /* KVR_TOKEN_* */
    int32_t  *groups;
    void     *payload;        /* payload_len bytes (NULL if meta_only) */
    size_t    payload_len;
    bool      payload_owned;  /* true: allocated by the library. To keep it
                                 past kvr_kv_release, take the pointer, set
                                 payload = NULL and kvr_client_free it later. */
    kvr_raw_layout raw;       /* a raw get: how the payload is encoded */
    void     *meta_;          /* internal: the block holding the arrays above */
} kvr_kv;

/* Frees what the result owns and zeroes it. NULL is a no-op; so is a zeroed kv. */
void kvr_kv_release(kvr_kv *kv);

/* Pointers to layer i's (index into kv->layers) K and V inside kv->payload. */
const void *kvr_kv_k(const kvr_kv *kv, size_t i);
const void *kvr_kv_v(const kvr_kv *kv, size_t i);

/* On failure *out is zeroed and owns nothing. */
int kvr_client_get(kvr_client *c, const kvr_get_args *a, kvr_kv *out);

/* Layer i's K and V in a raw result (NULL if out of range or not raw). */
const void *kvr_kv_raw_k(const kvr_kv *kv, size_t i);
const void *kvr_kv_raw_v(const kvr_kv *kv, size_t i);

/* ---- match -------------------------------------------------------------- */
typedef struct kvr_match_args {
    const char     *model;
    const uint32_t *tokens;
    size_t          n_tokens;
    bool            include_approximate;
    bool            get;              /* also return the matched KV */
    kvr_dtype       dtype;            /* with get (F32 is 0: set it) */
    const uint32_t *layers;
    size_t          n_layers;
    void           *dst;              /* as kvr_get_args */
    size_t          dst_cap;
} kvr_match_args;

typedef struct kvr_match_res {
    uint64_t length;                  /* cached prefix length, 0 = none */
    char     ctx_id[KVR_ID_MAX + 1];
    bool     has_kv;
    kvr_kv   kv;                      /* with get and length > 0: release it */
} kvr_match_res;

int kvr_client_match(kvr_client *c, const kvr_match_args *a, kvr_match_res *out);

/* ---- context management ------------------------------------------------- */
typedef struct kvr_context {
    char     id[KVR_ID_MAX + 1];
    char     model[KVR_ID_MAX + 1];
    uint64_t n_tokens, n_blocks, n_shared_blocks, n_approximate, bytes;
    bool     pinned, busy;
    int64_t  pos_min, pos_max;
    uint64_t created_ms, accessed_ms, n_evicted_tokens;
    /* Edits. */
    uint64_t n_pending;             /* tokens edited in without KV (KVR_TOKEN_PENDING) */
    uint64_t n_protected;           /* first tokens edits may not touch */
    /* Codec figures (docs/quantized.md, Statistics). */
    char     codec[KVR_CODEC_NAME_MAX];  /* canonical spec; plain: the dtype name */
    bool     quantized;
    uint64_t n_window;              /* tokens in full-precision blocks */
    uint64_t kv_bytes;              /* K/V bytes its tokens occupy, scales included */
    uint64_t bytes_saved;           /* against the model's dtype (plain: 0) */
    double   bits_per_value;
    double   rel_rms_k, rel_rms_v;  /* measured at quantization, keys pre-RoPE */
    bool     v_trans;               /* created from a transposed V cache
                                       (kvr_put_args.v_trans) */
} kvr_context;

int kvr_client_delete(kvr_client *c, const char *ctx_id);
/* Pipelining: a delete queued here is not sent at once but in the same
 * write as the next call's request (or by kvr_client_flush), so a put that
 * retires an older context costs one round trip, not two; its answer is
 * read before that call's. A deferred delete of a context that is already
 * gone counts as done; any other failure is counted (and its message kept)
 * in kvr_client_deferred_failures, and never fails the call it rode with.
 * At most KVR_DEFER_MAX wait: one more sends them first (kvr_client_flush).
 * kvr_client_close does no I/O: deferred requests still queued are dropped
 * (kvr_client_flush first; Python's close() does).
 * 0, KVR_EINVAL (bad id), or an error of that flush. */
#define KVR_DEFER_MAX 64
int kvr_client_delete_deferred(kvr_client *c, const char *ctx_id);
/* Sends the deferred requests (if any) and reads their answers: 0 if all
 * were done, else the code of the first that failed (each failure is also
 * counted), or a connection error. */
int kvr_client_flush(kvr_client *c);
/* Deferred requests that failed since the connection opened; msg (may be
 * NULL) gets the last failure's message. */
uint64_t kvr_client_deferred_failures(const kvr_client *c, char *msg, size_t cap);
/* Everything the daemon reports of one context (list fills the same
 * struct; the codec figures and edit counters of a listed context are
 * those the daemon sends in its listing). */
int kvr_client_stat(kvr_client *c, const char *ctx_id, kvr_context *out);
/* model NULL = all. *out is the caller's (kvr_client_free). */
int kvr_client_list(kvr_client *c, const char *model, kvr_context **out, size_t *n);
int kvr_client_pin(kvr_client *c, const char *ctx_id, bool pin);
int kvr_client_fork(kvr_client *c, const char *src, const char *dst);
int kvr_client_shift(kvr_client *c, const char *ctx_id, uint64_t start, uint64_t end,
                     int64_t delta);
int kvr_client_keep(kvr_client *c, const char *ctx_id, uint64_t start, uint64_t end);

/* ---- edits (PIE) -------------------------------------------------------- */
/*
 * An op replaces the tokens [start, end) of the context's CURRENT sequence
 * with n_tokens new tokens: start == end inserts before `start` (start ==
 * length appends), n_tokens == 0 deletes. The ops of one request are all in
 * the current coordinates and are applied atomically; sorted by start, each
 * must end at or before the next one starts and no two may share a start
 * (KVR_EINVAL); an op that changes nothing is KVR_EINVAL too.
 *
 * The suffix after an edit point moves by a pure rotation of its keys (done
 * at read time, never accumulated); its tokens become KVR_TOKEN_APPROX. The
 * new tokens' KV either comes with the edit (with_kv: layer-major, for each
 * layer K then V of ALL new tokens of all ops in request order, K rotated at
 * the positions kvr_client_edit_plan returns), or later through
 * kvr_client_refresh (until then they are KVR_TOKEN_PENDING).
 * Any refusal leaves the context byte-identical.
 */
typedef struct kvr_edit_range {
    uint64_t        start, end;     /* [start, end) of the current sequence */
    const uint32_t *tokens;         /* n_tokens new ids (borrowed) */
    size_t          n_tokens;
    bool            approx;         /* the new tokens' KV was computed against a
                                       context holding approximate tokens: they
                                       are stored KVR_TOKEN_APPROX (age 0) */
} kvr_edit_range;

typedef struct kvr_edit_args {
    const char           *ctx_id;
    const kvr_edit_range *ops;
    size_t                n_ops;
    const char           *model;        /* NULL = unchecked */
    uint64_t              fingerprint;  /* 0 = unchecked */
    /* Edit only (ignored by edit_plan). */
    bool                  with_kv;      /* the payload below is the new tokens' KV */
    uint32_t              n_layers, n_kv_heads, head_dim;  /* 0 = the model's */
    kvr_dtype             dtype;        /* of the payload (F32 is 0: set it) */
    const void           *payload;      /* as kvr_put_args: buffer or iovecs */
    size_t                payload_len;
    const struct iovec   *iov;
    size_t                iovcnt;
    /* Compare-and-swap (edit and plan): the context must still hold the
     * sequence planned against, expect_n_tokens ids whose kvr_tokens_hash
     * (rope/types.h) is expect_hash, else KVR_EBUSY and nothing changes. */
    bool                  expect;
    uint64_t              expect_n_tokens, expect_hash;
} kvr_edit_args;

/* Where one op's new tokens land (one per op, in request order). */
typedef struct kvr_edit_span_res {
    uint64_t index;       /* index of its first new token after the edit */
    int64_t  first_pos;   /* their positions: first_pos, first_pos + 1, ... */
    int64_t  shift;       /* position change of the old tokens after the op */
} kvr_edit_span_res;

typedef struct kvr_edit_res {
    uint64_t           n_tokens;       /* context length after */
    uint64_t           n_new, n_removed;
    uint64_t           first_change;   /* index of the first edit point */
    uint64_t           n_approximate, n_pending;   /* of the whole context */
    uint64_t           payload_bytes;  /* KV bytes moved (plan: to send with KV,
                                          in the model's dtype) */
    kvr_edit_span_res *spans;          /* n_spans; the caller's (kvr_client_free) */
    size_t             n_spans;
} kvr_edit_res;

/* Applies the edit. out may be NULL; on failure it owns nothing. */
int kvr_client_edit(kvr_client *c, const kvr_edit_args *a, kvr_edit_res *out);
/* What the edit would do (spans, positions), without changing anything. */
int kvr_client_edit_plan(kvr_client *c, const kvr_edit_args *a, kvr_edit_res *out);

typedef struct kvr_refresh_args {
    const char         *ctx_id;
    uint64_t            start, end;     /* token range; end 0 = to the end */
    const char         *model;          /* NULL = unchecked */
    uint64_t            fingerprint;
    uint32_t            n_layers, n_kv_heads, head_dim;  /* 0 = the model's */
    kvr_dtype           dtype;
    /* KV of the range recomputed, K rotated at the tokens' current positions. */
    const void         *payload;
    size_t              payload_len;
    const struct iovec *iov;
    size_t              iovcnt;
    bool                expect;         /* as kvr_edit_args */
    uint64_t            expect_n_tokens, expect_hash;
    bool                approx;         /* the KV saw approximate tokens before
                                           start: the range stays approximate
                                           (age 0); else its flags are cleared */
} kvr_refresh_args;

/* Overwrites the range's KV and clears its approximate/pending flags; one
 * span. out may be NULL. */
int kvr_client_refresh(kvr_client *c, const kvr_refresh_args *a, kvr_edit_res *out);

/* ---- position layouts: APE assemble, GPE groups, sinks + window --------- */
/* Semantics: docs/protocol.md (Position layouts) and docs/ape.md. */

/* A put to one group of a grouped context: the tokens take the group's next
 * positions (no positions / pos_start in a). To create the context, give
 * the group names in a->groups (mode CREATE or UPSERT). out has the
 * positions given. */
int kvr_client_group_append(kvr_client *c, const kvr_put_args *a, const char *group,
                            kvr_put_res *out);

/* Layouts and segment kinds: kvr_layout_kind (KVR_LAYOUT_PARALLEL,
 * _SEQUENTIAL, _EXPLICIT) and kvr_segment_kind (KVR_SEGMENT_PREFIX,
 * _DOCUMENT, _QUERY), the store's (rope/types.h). */

typedef struct kvr_assemble_args {
    const char         *prefix;
    const char *const  *docs;
    size_t              n_docs;
    kvr_layout_kind     layout;
    const int64_t      *starts;         /* EXPLICIT: n_docs start positions */
    kvr_dtype           dtype;          /* of the stream (F32 is 0: set it) */
    const uint32_t     *layers;         /* NULL = all */
    size_t              n_layers;
    double              temperature;    /* APE T; 0 = KVR_APE_TEMPERATURE */
    double              scale;          /* APE S; 0 = KVR_APE_SCALE */
    bool                fold_temperature;  /* document keys come as k / T */
    bool                meta_only;
    void               *dst;            /* as kvr_get_args */
    size_t              dst_cap;
} kvr_assemble_args;

typedef struct kvr_segment_res {
    kvr_segment_kind kind;
    uint64_t start, n_tokens;           /* token range in the stream */
    int64_t  pos_first, pos_last;       /* query: pos_first = query position, empty */
    uint32_t doc_index;
    char     ctx_id[KVR_ID_MAX + 1];    /* "" for the query */
    double   temperature, scale;        /* 1, 1 outside documents */
} kvr_segment_res;

typedef struct kvr_assemble_res {
    kvr_kv           kv;                /* the stream: tokens, positions, flags, K/V */
    kvr_segment_res *segments;          /* prefix, documents..., query */
    size_t           n_segments;
    int64_t          query_pos;
    double           temperature, scale;
    bool             temperature_folded;
    uint64_t         prefix_len;
} kvr_assemble_res;

/* On success release out with kvr_assemble_release; on failure it owns nothing. */
int  kvr_client_assemble(kvr_client *c, const kvr_assemble_args *a, kvr_assemble_res *out);
void kvr_assemble_release(kvr_assemble_res *r);   /* NULL / zeroed: no-op */

typedef struct kvr_group_res {
    char     name[KVR_GROUP_NAME_MAX + 1];
    int32_t  id;
    int64_t  offset;       /* phi */
    uint64_t cursor;       /* tokens ever appended */
    uint64_t n_tokens;     /* of them in the context now */
} kvr_group_res;

typedef struct kvr_layout_res {
    bool          has_prefix;               /* an APE document */
    char          prefix_ctx[KVR_ID_MAX + 1];
    uint64_t      prefix_len;
    kvr_group_res groups[KVR_MAX_GROUPS];
    size_t        n_groups;
    bool          retention;
    uint64_t      sinks, window, n_dropped;
    bool          v_trans;                  /* kvr_put_args.v_trans when created */
} kvr_layout_res;

/* out may be NULL in all three. */
int kvr_client_layout_stat(kvr_client *c, const char *ctx_id, kvr_layout_res *out);
int kvr_client_set_group_offset(kvr_client *c, const char *ctx_id, const char *group,
                                int64_t offset, kvr_layout_res *out);
/* Keep the first `sinks` and the last `window` tokens (after every put too);
 * off = remove the policy. */
int kvr_client_set_retention(kvr_client *c, const char *ctx_id, uint64_t sinks,
                             uint64_t window, bool off, kvr_layout_res *out);

/* ---- shared memory (Unix socket only; docs/protocol.md) ------------------ */
/*
 * A region is a memfd this process and the daemon both map. Register it
 * once per connection; then a put reads its payload from the region and a
 * get (match+get, assemble) has the daemon write its result straight into
 * it, from its worker threads, with nothing on the socket. The memfd must
 * be sealed against shrinking (F_SEAL_SHRINK) and not write-sealed;
 * kvr_client_region_create makes one that is. Regions belong to the
 * connection: the daemon unmaps them when it closes. TCP connections
 * refuse shared memory (KVR_EUNSUPPORTED).
 *
 * The daemon copies a put's bytes out of the region before it checks them,
 * and writes a get's bytes while the call is in progress: do not change a
 * put's slice, or read a get's, until the call returned.
 */
typedef struct kvr_shm {
    uint32_t region;      /* id from kvr_client_region_create/_register */
    uint64_t offset;      /* byte offset in the region */
    uint64_t length;      /* put/edit/refresh: the payload's bytes; get,
                             match, assemble: the room there (0 = to the
                             end of the region) */
} kvr_shm;

/* Creates a memfd of `size` bytes (memfd_create + ftruncate + F_SEAL_SHRINK
 * | F_SEAL_GROW), maps it here and registers it. *base (may be NULL) is
 * this process's mapping, valid until the region is released or the
 * client closed. */
int kvr_client_region_create(kvr_client *c, size_t size, uint32_t *id, void **base);
/* Registers the caller's memfd (it stays the caller's; the library maps
 * its own view when base is NULL, else base must map its first size bytes). */
int kvr_client_region_register(kvr_client *c, int fd, uint64_t size, void *base,
                               uint32_t *id);
/* Unregisters it (the daemon unmaps once no request uses it) and unmaps
 * the library's view. */
int kvr_client_region_release(kvr_client *c, uint32_t id);
/* This process's view of a region (NULL if unknown); *size may be NULL. */
void *kvr_client_region_base(kvr_client *c, uint32_t id, size_t *size);

/* The next call's payload is at `at` instead of on the socket: any call
 * with a payload (put, group_append, edit, refresh, get, match+get,
 * assemble, and later verbs such as the llama.cpp export). Cleared by the
 * next call that sends a request. */
void kvr_client_shm_next(kvr_client *c, const kvr_shm *at);

/* Per-call placement. A get's kv->payload points into the region
 * (payload_owned false; the bytes are the caller's, valid while the region
 * is); KVR_ERANGE if the slice is too small for the payload. */
int kvr_client_put_shm(kvr_client *c, const kvr_put_args *a, const kvr_shm *at,
                       kvr_put_res *out);
int kvr_client_get_shm(kvr_client *c, const kvr_get_args *a, const kvr_shm *at, kvr_kv *out);
int kvr_client_match_shm(kvr_client *c, const kvr_match_args *a, const kvr_shm *at,
                         kvr_match_res *out);
int kvr_client_assemble_shm(kvr_client *c, const kvr_assemble_args *a, const kvr_shm *at,
                            kvr_assemble_res *out);
int kvr_client_edit_shm(kvr_client *c, const kvr_edit_args *a, const kvr_shm *at,
                        kvr_edit_res *out);
int kvr_client_refresh_shm(kvr_client *c, const kvr_refresh_args *a, const kvr_shm *at,
                           kvr_edit_res *out);

/* ---- statistics --------------------------------------------------------- */
typedef struct kvr_metric {
    char   name[120];
    double value;
} kvr_metric;

/* *out is the caller's (kvr_client_free), *n entries, in the daemon's order. */
int kvr_client_stats(kvr_client *c, kvr_metric **out, size_t *n);
/* Finds a metric by name in such an array; false if absent. */
bool kvr_metric_find(const kvr_metric *m, size_t n, const char *name, double *value);

#ifdef __cplusplus
}
#endif
#endif /* KVR_KVROPE_H */
