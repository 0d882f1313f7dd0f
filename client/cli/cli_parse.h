/*
 * cli_parse.h — the CLI's parsers of outside input that take a buffer, not a
 * path, so the fuzz targets (tests/fuzz/fuzz_cli_*.c) can reach them without
 * the rest of the CLI. Private to client/cli and the tests.
 */
#ifndef KVR_CLI_PARSE_H
#define KVR_CLI_PARSE_H

#include <stddef.h>
#include <stdint.h>

#include "client/cli/cli.h"

/* Parses a safetensors image buf[0..len) (borrowed: st->k and st->v point
 * into it; st->file stays empty). 0, or -1 with err set (st freed). */
int kvr__cli_st_parse(const void *buf, size_t len, cli_st_kv *st, char *err, size_t errlen);

/* Parses edit ops JSON: [{"start": S, "end": E, "tokens": [..]}, ...] ("end"
 * defaults to "start": an insert; "tokens" to none: a delete). On success
 * *out (n ops) and *tokbuf (n_new ids, the ops' tokens point into it) are
 * the caller's (free both). Returns 0, -1 for input that is not such an
 * array (err says why), -2 out of memory. */
int kvr__cli_edit_ops_parse(const char *json, size_t len, kvr_edit_range **out, size_t *n,
                       uint32_t **tokbuf, size_t *n_new, char *err, size_t errlen);

#endif
