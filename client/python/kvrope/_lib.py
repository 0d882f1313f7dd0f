"""ctypes mirror of client/kvrope.h (and the parts of rope/rope.h it uses).

This module only declares: the structs exactly as the C header lays them out,
and the function prototypes. It holds no protocol knowledge. Everything about
frames, protobuf and payload streaming lives in libkvrope.

The library is found, in order, at: $KVROPE_LIB; <repo>/build/libkvrope.so
(relative to this package: client/python/kvrope/../../../build); where
`make install` put it (kvrope/_install.py, written then); then
ctypes.util.find_library("kvrope").
"""

import ctypes
import ctypes.util
import os
from ctypes import (POINTER, Structure, c_bool, c_char, c_char_p, c_double, c_int, c_int32,
                    c_int64, c_size_t, c_uint8, c_uint32, c_uint64, c_void_p, CFUNCTYPE)

# The libkvrope ABI these structs mirror: KVR_VERSION_MAJOR, KVR_VERSION_MINOR
# (0.x minors may change struct layouts; the loader refuses another one).
ABI = (0, 3)

NAME_MAX = 255            # KVR_ID_MAX (rope/types.h)
ROPE_MAX_HEAD_DIM = 1024
CODEC_MAX = 64            # KVR_CODEC_NAME_MAX
GROUP_NAME_MAX = 63       # KVR_GROUP_NAME_MAX
ROPE_MAX_LAYERS = 1024    # rope.h KVR_ROPE_MAX_LAYERS

# kvr_dtype
DTYPE_F32, DTYPE_F16, DTYPE_BF16 = 0, 1, 2
# kvr_put_mode (the store's and the wire's values)
PUT_CREATE, PUT_APPEND, PUT_UPSERT, PUT_REPLACE = 0, 1, 2, 3


class iovec(Structure):
    _fields_ = [("iov_base", c_void_p), ("iov_len", c_size_t)]


class kvr_client_opts(Structure):
    _fields_ = [("token", c_void_p), ("token_len", c_size_t), ("timeout_ms", c_int)]


class kvr_pong(Structure):
    _fields_ = [("server", c_char * 128), ("protocol", c_uint32)]


class kvr_rope_config(Structure):
    _fields_ = [
        ("num_layers", c_int32), ("num_heads", c_int32), ("num_kv_heads", c_int32),
        ("head_dim", c_int32), ("rotary_dim", c_int32),
        ("max_position_embeddings", c_int64),
        ("model_type", c_char * 32),
        ("style", c_int), ("theta", c_double), ("scaling", c_int), ("factor", c_double),
        ("original_max_position_embeddings", c_int64),
        ("beta_fast", c_double), ("beta_slow", c_double), ("attention_factor", c_double),
        ("mscale", c_double), ("mscale_all_dim", c_double),
        ("low_freq_factor", c_double), ("high_freq_factor", c_double),
        ("yarn_truncate", c_int32),
        ("local_theta", c_double), ("n_layer_kinds", c_int32),
        ("layer_kind", c_uint8 * ROPE_MAX_LAYERS),
        ("n_short_factor", c_int32), ("n_long_factor", c_int32),
        ("short_factor", c_double * (ROPE_MAX_HEAD_DIM // 2)),
        ("long_factor", c_double * (ROPE_MAX_HEAD_DIM // 2)),
    ]


class kvr_model(Structure):
    _fields_ = [("name", c_char * (NAME_MAX + 1)),
                ("n_layers", c_uint32), ("n_kv_heads", c_uint32), ("head_dim", c_uint32),
                ("dtype", c_int), ("fingerprint", c_uint64), ("n_contexts", c_uint64),
                ("codec", c_char * CODEC_MAX), ("rope", kvr_rope_config)]


class kvr_model_params(Structure):
    _fields_ = [("name", c_char_p), ("config_json", c_char_p), ("config_json_len", c_size_t),
                ("style", c_char_p),
                ("n_layers", c_uint32), ("n_kv_heads", c_uint32), ("head_dim", c_uint32),
                ("dtype", c_int), ("rope", POINTER(kvr_rope_config)), ("codec", c_char_p)]


class kvr_put_args(Structure):
    _fields_ = [("ctx_id", c_char_p), ("model", c_char_p), ("mode", c_int),
                ("fingerprint", c_uint64),
                ("n_layers", c_uint32), ("n_kv_heads", c_uint32), ("head_dim", c_uint32),
                ("dtype", c_int),
                ("tokens", POINTER(c_uint32)), ("n_tokens", c_size_t),
                ("positions", POINTER(c_int64)),
                ("has_pos_start", c_bool), ("pos_start", c_int64), ("pin", c_bool),
                ("payload", c_void_p), ("payload_len", c_size_t),
                ("iov", POINTER(iovec)), ("iovcnt", c_size_t),
                ("protect_first", c_uint64), ("has_protect", c_bool),
                ("prefix_ctx", c_char_p),
                ("groups", POINTER(c_char_p)), ("n_groups", c_size_t),
                ("group_offsets", POINTER(c_int64)),
                ("codec", c_char_p), ("persist", c_bool),
                ("share", c_bool), ("share_sync", c_bool), ("v_trans", c_bool)]


class kvr_put_res(Structure):
    _fields_ = [("n_tokens", c_uint64), ("first_index", c_uint64),
                ("first_pos", c_int64), ("last_pos", c_int64)]


LAYER_FN = CFUNCTYPE(None, c_void_p, c_uint32, c_uint32, c_void_p, c_void_p, c_size_t)
PROGRESS_FN = CFUNCTYPE(None, c_void_p, c_uint64, c_uint64)


class kvr_get_args(Structure):
    _fields_ = [("ctx_id", c_char_p), ("start", c_uint64), ("end", c_uint64), ("dtype", c_int),
                ("positions", POINTER(c_int64)), ("n_positions", c_size_t),
                ("layers", POINTER(c_uint32)), ("n_layers", c_size_t),
                ("meta_only", c_bool),
                ("dst", c_void_p), ("dst_cap", c_size_t),
                ("on_layer", LAYER_FN), ("on_layer_ud", c_void_p), ("raw", c_bool)]


class kvr_raw_layout(Structure):
    _fields_ = [("raw", c_bool), ("codec", c_char * CODEC_MAX),
                ("k_codec", c_char * 32), ("v_codec", c_char * 32),
                ("k_per_channel", c_bool), ("k_group", c_uint32), ("v_group", c_uint32),
                ("window", c_uint32), ("k_bytes", c_uint64), ("v_bytes", c_uint64),
                ("k_unit_bytes", c_uint64), ("v_unit_bytes", c_uint64)]


class kvr_kv(Structure):
    _fields_ = [("ctx_id", c_char * (NAME_MAX + 1)), ("model", c_char * (NAME_MAX + 1)),
                ("start", c_uint64), ("n_tokens", c_uint64), ("dtype", c_int),
                ("n_kv_heads", c_uint32), ("head_dim", c_uint32),
                ("n_layers", c_size_t),
                ("layers", POINTER(c_uint32)), ("tokens", POINTER(c_uint32)),
                ("positions", POINTER(c_int64)), ("flags", POINTER(c_uint32)),
                ("groups", POINTER(c_int32)),
                ("payload", c_void_p), ("payload_len", c_size_t), ("payload_owned", c_bool),
                ("raw", kvr_raw_layout), ("meta_", c_void_p)]


class kvr_match_args(Structure):
    _fields_ = [("model", c_char_p), ("tokens", POINTER(c_uint32)), ("n_tokens", c_size_t),
                ("include_approximate", c_bool), ("get", c_bool), ("dtype", c_int),
                ("layers", POINTER(c_uint32)), ("n_layers", c_size_t),
                ("dst", c_void_p), ("dst_cap", c_size_t)]


class kvr_match_res(Structure):
    _fields_ = [("length", c_uint64), ("ctx_id", c_char * (NAME_MAX + 1)),
                ("has_kv", c_bool), ("kv", kvr_kv)]


class kvr_context(Structure):
    _fields_ = [("id", c_char * (NAME_MAX + 1)), ("model", c_char * (NAME_MAX + 1)),
                ("n_tokens", c_uint64), ("n_blocks", c_uint64), ("n_shared_blocks", c_uint64),
                ("n_approximate", c_uint64), ("bytes", c_uint64),
                ("pinned", c_bool), ("busy", c_bool),
                ("pos_min", c_int64), ("pos_max", c_int64),
                ("created_ms", c_uint64), ("accessed_ms", c_uint64),
                ("n_evicted_tokens", c_uint64),
                ("n_pending", c_uint64), ("n_protected", c_uint64),
                ("codec", c_char * CODEC_MAX), ("quantized", c_bool),
                ("n_window", c_uint64), ("kv_bytes", c_uint64), ("bytes_saved", c_uint64),
                ("bits_per_value", c_double), ("rel_rms_k", c_double), ("rel_rms_v", c_double),
                ("v_trans", c_bool)]


# ---- edits (PIE) ----
class kvr_edit_range(Structure):
    _fields_ = [("start", c_uint64), ("end", c_uint64),
                ("tokens", POINTER(c_uint32)), ("n_tokens", c_size_t), ("approx", c_bool)]


class kvr_edit_args(Structure):
    _fields_ = [("ctx_id", c_char_p), ("ops", POINTER(kvr_edit_range)), ("n_ops", c_size_t),
                ("model", c_char_p), ("fingerprint", c_uint64),
                ("with_kv", c_bool),
                ("n_layers", c_uint32), ("n_kv_heads", c_uint32), ("head_dim", c_uint32),
                ("dtype", c_int),
                ("payload", c_void_p), ("payload_len", c_size_t),
                ("iov", POINTER(iovec)), ("iovcnt", c_size_t),
                ("expect", c_bool), ("expect_n_tokens", c_uint64), ("expect_hash", c_uint64)]


class kvr_edit_span_res(Structure):
    _fields_ = [("index", c_uint64), ("first_pos", c_int64), ("shift", c_int64)]


class kvr_edit_res(Structure):
    _fields_ = [("n_tokens", c_uint64), ("n_new", c_uint64), ("n_removed", c_uint64),
                ("first_change", c_uint64), ("n_approximate", c_uint64), ("n_pending", c_uint64),
                ("payload_bytes", c_uint64),
                ("spans", POINTER(kvr_edit_span_res)), ("n_spans", c_size_t)]


class kvr_refresh_args(Structure):
    _fields_ = [("ctx_id", c_char_p), ("start", c_uint64), ("end", c_uint64),
                ("model", c_char_p), ("fingerprint", c_uint64),
                ("n_layers", c_uint32), ("n_kv_heads", c_uint32), ("head_dim", c_uint32),
                ("dtype", c_int),
                ("payload", c_void_p), ("payload_len", c_size_t),
                ("iov", POINTER(iovec)), ("iovcnt", c_size_t),
                ("expect", c_bool), ("expect_n_tokens", c_uint64), ("expect_hash", c_uint64),
                ("approx", c_bool)]


# ---- position layouts (APE assemble, GPE groups, retention) ----
# kvr_layout_kind, kvr_segment_kind, KVR_MAX_GROUPS
LAYOUT_PARALLEL, LAYOUT_SEQUENTIAL, LAYOUT_EXPLICIT = 0, 1, 2
SEGMENT_PREFIX, SEGMENT_DOCUMENT, SEGMENT_QUERY = 0, 1, 2
MAX_GROUPS = 16


class kvr_assemble_args(Structure):
    _fields_ = [("prefix", c_char_p), ("docs", POINTER(c_char_p)), ("n_docs", c_size_t),
                ("layout", c_int), ("starts", POINTER(c_int64)), ("dtype", c_int),
                ("layers", POINTER(c_uint32)), ("n_layers", c_size_t),
                ("temperature", c_double), ("scale", c_double),
                ("fold_temperature", c_bool), ("meta_only", c_bool),
                ("dst", c_void_p), ("dst_cap", c_size_t)]


class kvr_segment_res(Structure):
    _fields_ = [("kind", c_int), ("start", c_uint64), ("n_tokens", c_uint64),
                ("pos_first", c_int64), ("pos_last", c_int64), ("doc_index", c_uint32),
                ("ctx_id", c_char * (NAME_MAX + 1)),
                ("temperature", c_double), ("scale", c_double)]


class kvr_assemble_res(Structure):
    _fields_ = [("kv", kvr_kv), ("segments", POINTER(kvr_segment_res)), ("n_segments", c_size_t),
                ("query_pos", c_int64), ("temperature", c_double), ("scale", c_double),
                ("temperature_folded", c_bool), ("prefix_len", c_uint64)]


class kvr_group_res(Structure):
    _fields_ = [("name", c_char * (GROUP_NAME_MAX + 1)), ("id", c_int32), ("offset", c_int64),
                ("cursor", c_uint64), ("n_tokens", c_uint64)]


class kvr_layout_res(Structure):
    _fields_ = [("has_prefix", c_bool), ("prefix_ctx", c_char * (NAME_MAX + 1)),
                ("prefix_len", c_uint64),
                ("groups", kvr_group_res * MAX_GROUPS), ("n_groups", c_size_t),
                ("retention", c_bool), ("sinks", c_uint64), ("window", c_uint64),
                ("n_dropped", c_uint64), ("v_trans", c_bool)]


class kvr_shm(Structure):
    """A slice of a shared-memory region (kvrope.h kvr_shm)."""
    _fields_ = [("region", c_uint32), ("offset", c_uint64), ("length", c_uint64)]


class kvr_metric(Structure):
    _fields_ = [("name", c_char * 120), ("value", c_double)]


# Every struct above, for the layout self-check in the tests.
STRUCTS = {c.__name__: c for c in (kvr_client_opts, kvr_pong, kvr_rope_config, kvr_model,
                                   kvr_model_params, kvr_put_args, kvr_put_res, kvr_get_args,
                                   kvr_raw_layout, kvr_kv, kvr_match_args, kvr_match_res,
                                   kvr_context, kvr_metric, kvr_edit_range,
                                   kvr_edit_args, kvr_edit_span_res, kvr_edit_res,
                                   kvr_refresh_args, kvr_assemble_args,
                                   kvr_segment_res, kvr_assemble_res, kvr_group_res,
                                   kvr_layout_res)}

H = c_void_p  # kvr_client *

# name -> (restype, argtypes): the whole of client/kvrope.h (and what it
# uses of rope/). The binding and the library are built together from one
# tree (libkvrope.so.0), so every symbol is required.
PROTOTYPES = {
    "kvr_version": (c_uint32, []),
    "kvr_version_string": (c_char_p, []),
    "kvr_strerror": (c_char_p, [c_int]),
    "kvr_error_name": (c_char_p, [c_int]),
    "kvr_error_status": (c_int, [c_int]),
    "kvr_error_status_name": (c_char_p, [c_int]),
    "kvr_error_codes": (POINTER(c_int), [POINTER(c_size_t)]),
    "kvr_client_connect": (c_int, [POINTER(H), c_char_p, POINTER(kvr_client_opts)]),
    "kvr_client_close": (None, [H]),
    "kvr_client_last_error": (c_char_p, [H]),
    "kvr_client_free": (None, [c_void_p]),
    "kvr_client_set_progress": (None, [H, PROGRESS_FN, c_void_p]),
    "kvr_client_ping": (c_int, [H, POINTER(kvr_pong)]),
    "kvr_client_model_register": (c_int, [H, POINTER(kvr_model_params), POINTER(kvr_model)]),
    "kvr_client_model_list": (c_int, [H, POINTER(POINTER(kvr_model)), POINTER(c_size_t)]),
    "kvr_client_model_get": (c_int, [H, c_char_p, POINTER(kvr_model)]),
    "kvr_client_put": (c_int, [H, POINTER(kvr_put_args), POINTER(kvr_put_res)]),
    "kvr_payload_size": (c_size_t, [c_uint32, c_size_t, c_uint32, c_uint32, c_int]),
    "kvr_kv_release": (None, [POINTER(kvr_kv)]),
    "kvr_client_get": (c_int, [H, POINTER(kvr_get_args), POINTER(kvr_kv)]),
    "kvr_client_match": (c_int, [H, POINTER(kvr_match_args), POINTER(kvr_match_res)]),
    "kvr_client_delete": (c_int, [H, c_char_p]),
    "kvr_client_delete_deferred": (c_int, [H, c_char_p]),
    "kvr_client_flush": (c_int, [H]),
    "kvr_client_deferred_failures": (c_uint64, [H, c_char_p, c_size_t]),
    "kvr_client_model_remove": (c_int, [H, c_char_p]),
    "kvr_client_stat": (c_int, [H, c_char_p, POINTER(kvr_context)]),
    "kvr_client_list": (c_int, [H, c_char_p, POINTER(POINTER(kvr_context)), POINTER(c_size_t)]),
    "kvr_client_pin": (c_int, [H, c_char_p, c_bool]),
    "kvr_client_fork": (c_int, [H, c_char_p, c_char_p]),
    "kvr_client_shift": (c_int, [H, c_char_p, c_uint64, c_uint64, c_int64]),
    "kvr_client_keep": (c_int, [H, c_char_p, c_uint64, c_uint64]),
    "kvr_client_stats": (c_int, [H, POINTER(POINTER(kvr_metric)), POINTER(c_size_t)]),
    "kvr_convert": (None, [c_void_p, c_int, c_void_p, c_int, c_size_t]),
    # edits (PIE)
    "kvr_client_edit": (c_int, [H, POINTER(kvr_edit_args), POINTER(kvr_edit_res)]),
    "kvr_client_edit_plan": (c_int, [H, POINTER(kvr_edit_args), POINTER(kvr_edit_res)]),
    "kvr_client_refresh": (c_int, [H, POINTER(kvr_refresh_args), POINTER(kvr_edit_res)]),
    # position layouts
    "kvr_client_group_append": (c_int, [H, POINTER(kvr_put_args), c_char_p,
                                        POINTER(kvr_put_res)]),
    "kvr_client_assemble": (c_int, [H, POINTER(kvr_assemble_args), POINTER(kvr_assemble_res)]),
    "kvr_assemble_release": (None, [POINTER(kvr_assemble_res)]),
    "kvr_client_layout_stat": (c_int, [H, c_char_p, POINTER(kvr_layout_res)]),
    "kvr_client_set_group_offset": (c_int, [H, c_char_p, c_char_p, c_int64,
                                            POINTER(kvr_layout_res)]),
    "kvr_client_set_retention": (c_int, [H, c_char_p, c_uint64, c_uint64, c_bool,
                                         POINTER(kvr_layout_res)]),
    # shared memory (Unix socket)
    "kvr_client_region_create": (c_int, [H, c_size_t, POINTER(c_uint32), POINTER(c_void_p)]),
    "kvr_client_region_release": (c_int, [H, c_uint32]),
    "kvr_client_put_shm": (c_int, [H, POINTER(kvr_put_args), POINTER(kvr_shm),
                                   POINTER(kvr_put_res)]),
    "kvr_client_get_shm": (c_int, [H, POINTER(kvr_get_args), POINTER(kvr_shm), POINTER(kvr_kv)]),
}
# Symbols a library may lack and still load (the method that needs one raises
# kvrope.Unsupported): none since the ABI was folded at 0.2.0.
OPTIONAL = set()


def _candidates():
    env = os.environ.get("KVROPE_LIB")
    if env:
        yield env
        return
    here = os.path.dirname(os.path.abspath(__file__))
    yield os.path.normpath(os.path.join(here, "..", "..", "..", "build", "libkvrope.so"))
    try:   # installed by `make install`, which writes _install.py
        from ._install import LIBDIR
        yield os.path.join(LIBDIR, "libkvrope.so")
    except ImportError:
        pass
    found = ctypes.util.find_library("kvrope")
    if found:
        yield found


class _Lib:
    """The loaded library: attributes are the prototyped functions; `path` is
    where it came from; `has(name)` tells whether an optional symbol exists."""

    def __init__(self, cdll, path):
        self.path = path
        self._cdll = cdll
        self._missing = set()
        for name, (res, args) in PROTOTYPES.items():
            try:
                f = getattr(cdll, name)
            except AttributeError:
                if name in OPTIONAL:
                    self._missing.add(name)
                    continue
                raise OSError(f"{path} lacks {name}: an older libkvrope? rebuild it "
                              f"(make build/libkvrope.so)") from None
            f.restype, f.argtypes = res, args
            setattr(self, name, f)
        v = self.kvr_version()
        if (v >> 16, (v >> 8) & 0xFF) != ABI:
            raise OSError(f"{path} is libkvrope {self.kvr_version_string().decode()}; this "
                          f"binding mirrors the structs of {ABI[0]}.{ABI[1]}.x: rebuild it "
                          f"(make build/libkvrope.so)")

    def has(self, name):
        return name in PROTOTYPES and name not in self._missing


_LIB = None


def load():
    global _LIB
    if _LIB is None:
        tried = []
        for p in _candidates():
            if os.path.sep in p and not os.path.exists(p):
                tried.append(f"{p} (absent)")
                continue
            try:
                _LIB = _Lib(ctypes.CDLL(p), p)
                break
            except OSError as e:
                tried.append(f"{p} ({e})")
        else:
            raise OSError("libkvrope not found; build it with `make build/libkvrope.so` or set "
                          "KVROPE_LIB. Tried: " + ("; ".join(tried) or "nothing"))
    return _LIB
