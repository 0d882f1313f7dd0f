/*
 * convert.h — the protobuf <-> store conversions of the daemon, and the
 * packing of response frames. Pure functions: no connection, no loop, no
 * store calls (so tests/unit/test_daemon_convert.c runs them alone).
 * Private to daemon/ (and its tests).
 *
 * Conventions:
 *  - wire -> store (`kvr__*_from_pb`): validate what the message alone can
 *    tell, fill the store's parameter struct, return 0 or a negative KVR_E*
 *    code with the reason in err (kvr_error_set; may be NULL). The store
 *    structs borrow strings and arrays from the message: keep the message
 *    alive while they are used.
 *  - store -> wire (`kvr__pb_*`): fill a generated message that borrows the
 *    store struct's strings and arrays (the store struct must outlive the
 *    packing). Those that allocate (lists, spans, segments) return 0 or
 *    KVR_ENOMEM and have a `_free` that releases exactly what they took;
 *    calling it on a message they failed to fill is safe.
 */
#ifndef KVR_DAEMON_CONVERT_H
#define KVR_DAEMON_CONVERT_H

#include <stddef.h>
#include <stdint.h>

#include "cache/cache.h"
#include "kvrope.pb-c.h"

#define KVR_ERR_MAX 512

/* protobuf-c's allocations go through kvr_mem (the memory cap is real). */
extern ProtobufCAllocator kvr__pb_allocator;

/* KVR_E* -> Status (0 -> OK; out of range -> E_INTERNAL). */
int kvr__status_of(int code);

/* ---- wire -> store ------------------------------------------------------ */
bool kvr__dtype_ok(int t);
/* RopeParams over rc (fields the message has; NULL p changes nothing). */
int kvr__rope_from_pb(const Kvrope__RopeParams *p, kvr_rope_config *rc, kvr_error *err);
/* RegisterModel -> model description (its rope built in out->rope from
 * config_json or the shape fields; strings borrowed from m). */
int kvr__model_desc_from_pb(const Kvrope__RegisterModel *m, kvr_model_desc *out,
                            kvr_error *err);
/* Put (or a GroupAppend's put, with `group`) -> put params, without the
 * layout options (kvr__put_layout_from_pb) and with n_layers / n_kv_heads /
 * head_dim as given (0 when absent: the caller fills in the model's). */
int kvr__put_params_from_pb(const Kvrope__Put *p, const char *group, uint64_t payload_len,
                            kvr_put_params *out, kvr_error *err);
int kvr__put_layout_from_pb(const Kvrope__LayoutPutOptions *lo, kvr_put_params *out,
                            kvr_error *err);
/* Get -> get params; the count of positions is checked against the range by
 * the caller (it needs the context's length). */
int kvr__get_params_from_pb(const Kvrope__Get *g, kvr_get_params *out, kvr_error *err);
int kvr__assemble_params_from_pb(const Kvrope__Assemble *q, kvr_assemble_params *out,
                                 kvr_error *err);
/* Edit / Refresh -> params; shapes as given, ops left to kvr__edit_ops_from_pb. */
int kvr__edit_params_from_pb(const Kvrope__Edit *q, uint64_t payload_len,
                             kvr_edit_params *out, kvr_error *err);
int kvr__refresh_params_from_pb(const Kvrope__Refresh *q, uint64_t payload_len,
                                kvr_refresh_params *out, kvr_error *err);
/* The wire ops as store ops in *out (kvr_mem, caller frees; NULL for none);
 * tokens borrowed from the message. */
int kvr__edit_ops_from_pb(Kvrope__EditOp *const *in, size_t n, kvr_edit_op **out,
                          kvr_error *err);
/* A [start, end) range of uint64 on the wire as size_t (KVR_ERANGE). */
int kvr__range_from_pb(const char *verb, uint64_t start, uint64_t end, size_t *s, size_t *e,
                       kvr_error *err);

/* ---- store -> wire ------------------------------------------------------ */
void kvr__pb_rope(const kvr_rope_config *rc, Kvrope__RopeParams *p);
void kvr__pb_model(const kvr_model_info *m, Kvrope__ModelInfo *o, Kvrope__RopeParams *rp);
void kvr__pb_context(const kvr_ctx_info *i, Kvrope__ContextInfo *o);
void kvr__pb_put_result(const kvr_put_result *res, Kvrope__PutResult *o);

int  kvr__pb_model_list(const kvr_model_info *infos, size_t n, Kvrope__ModelList *o);
void kvr__pb_model_list_free(Kvrope__ModelList *o);
int  kvr__pb_context_list(const kvr_ctx_info *infos, size_t n, Kvrope__ContextList *o);
void kvr__pb_context_list_free(Kvrope__ContextList *o);

int  kvr__pb_edit_result(const kvr_edit_result *res, const kvr_edit_span *spans, size_t n,
                         uint64_t payload_bytes, Kvrope__EditResult *o);
void kvr__pb_edit_result_free(Kvrope__EditResult *o);

/* KVResult of a get (context ctx_id); raw gets also get o->raw = rl, its
 * strings in buf. meta_only: no RawLayout. */
void kvr__pb_kv_of_get(const kvr_get_info *gi, const char *ctx_id, bool meta_only,
                       Kvrope__KVResult *o, Kvrope__RawLayout *rl, char buf[3][64]);
/* RawLayout of a raw get from its canonical codec "k=K,v=V,r=R". */
void kvr__pb_raw_layout(const kvr_get_info *gi, Kvrope__RawLayout *rl, char buf[3][64]);
/* AssembleResult (and its KVResult kv, stream of prefix `prefix`). */
int  kvr__pb_assemble_result(const kvr_assemble_info *ai, const char *prefix,
                             Kvrope__AssembleResult *o, Kvrope__KVResult *kv);
void kvr__pb_assemble_result_free(Kvrope__AssembleResult *o);
/* LayoutInfo of context id; the groups in the caller's arrays. */
void kvr__pb_layout(const kvr_layout_info *li, const char *id, Kvrope__LayoutInfo *o,
                    Kvrope__GroupInfo gi[KVR_MAX_GROUPS], Kvrope__GroupInfo *gp[KVR_MAX_GROUPS]);

/* ---- frames ------------------------------------------------------------- */
/* Header + packed message in one kvr_mem buffer (*len bytes), the header
 * announcing payload_len bytes to follow; NULL if out of memory or over the
 * frame's limits. */
uint8_t *kvr__pack_response(const Kvrope__Response *r, uint64_t payload_len, size_t *len);
/* An error response (msg NULL: kvr_strerror(code)), truncated to 511 bytes. */
uint8_t *kvr__pack_error(uint64_t id, int code, const char *msg, size_t *len);

#endif /* KVR_DAEMON_CONVERT_H */
