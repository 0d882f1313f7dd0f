"""kvrope — Python client of kvroped, the RoPE-aware KV-cache daemon.

    import kvrope
    with kvrope.connect() as c:                       # default socket, like the CLI
        m = c.register_model("llama", "path/to/config.json", dtype="f32")
        c.put("chat-1", "llama", tokens, kv)          # kv: [layers, 2, T, kv_heads, head_dim]
        hit = c.match("llama", prompt, get=True)      # longest cached exact prefix
        past = hit.kv.pairs() if hit.length else None # [(K, V), ...] per layer

How it talks to the daemon: through libkvrope (client/kvrope.h) with ctypes.
The C library is the ONE definition of the framing rules (frame header,
protobuf messages, payload streaming, auth); this package never builds a
frame itself, so the CLI, C workers and Python see the same protocol code.
The library is looked up at $KVROPE_LIB, then <repo>/build/libkvrope.so
relative to this package, then where `make install` put it (_install.py),
then ctypes.util.find_library("kvrope").

KV layout: one array [n_layers, 2, tokens, kv_heads, head_dim] (axis 1: K, V),
which is byte for byte the daemon's layer-major payload; put() also takes a
list of (K, V) per layer or k=/v= arrays [n_layers, tokens, kv_heads,
head_dim]. Dtypes f32 / f16 / bf16; numpy has no bfloat16, so bf16 travels
as uint16 bit patterns (dtype="bf16"), or float32 data is converted with
round-to-nearest-even by libkvrope. torch tensors (float32/float16/bfloat16,
any device) are accepted when torch is importable; KV.to_torch() returns one.
Details: kvrope.tensors.

Errors: a daemon status raises a KvropeError subclass (UnknownContext,
Exists, ShapeMismatch, ...) with .code (wire Status number), .name
("E_UNKNOWN_CONTEXT"), .message (the daemon's words). Bad arguments raise
ValueError / TypeError before anything is sent.

Verbs: ping, register_model, models, model, put, get, match, delete, list,
stat, exists, pin, unpin, fork, shift, keep, stats, edit_plan, edit,
refresh, stat_edit, stat_codec, assemble, group_append, layout,
set_group_offset, set_retention, cover — one Client method each. cover()
finds cached runs anywhere in a prompt and with get=True returns their K/V
placed for it (docs/reuse.md). Codecs at rest
(docs/quantized.md): register_model(codec=), put(codec=), get(raw=True) ->
RawKV, stat_codec() -> CodecInfo. On an older libkvrope lacking a
verb's C function, its method raises kvrope.Unsupported (nothing is sent).

Editing loop: kvrope.EditSession(client, model, session_id, encoder) moves
one buffer's context forward edit after edit (sync -> logits, commit ->
one compare-and-swap edit + refreshes; refresh_idle when the caller is
idle); the same algorithm as the C session engine (kvrope.session).
"""

import os

from . import errors, tensors
from .client import (Client, Context, KV, Match, Model, Pong, PutResult, EditResult, EditSpan,
                     Assembly, Segment, Layout, Group, CodecInfo, RawKV, FLAG_APPROX,
                     FLAG_PENDING, Region, token_age, tokens_hash, Cover, CoverRun)
from .errors import *  # noqa: F401,F403  (KvropeError and its subclasses)
from .session import EditSession, SyncResult, CommitResult, diff_hunks
from .errors import KvropeError, Unsupported
from .tensors import dtype_name, bf16_to_f32, f32_to_bf16, HAVE_TORCH

__version__ = "0.3.0"   # libkvrope KVR_VERSION_* (kvr_version_string)


def default_socket():
    """The daemon's default socket path (docs/protocol.md), preceded, as in
    the kvrope CLI, by $KVROPE_SOCKET when set."""
    env = os.environ.get("KVROPE_SOCKET")
    if env:
        return env
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return os.path.join(xdg, "kvrope", "kvroped.sock")
    if os.getuid() == 0:
        return "/run/kvrope/kvroped.sock"
    return f"/tmp/kvrope-{os.getuid()}/kvroped.sock"


def connect(addr=None, token=None, timeout=None):
    """Opens a Client (a context manager). addr: a socket path, "unix:PATH",
    "HOST:PORT", "tcp:HOST:PORT" or "[V6]:PORT"; None = default_socket().
    token: the shared secret (str or bytes) for TCP daemons that require it.
    timeout: seconds per send/receive (None = wait forever)."""
    if addr is None:
        addr = default_socket()
    if isinstance(addr, str) and "/" not in addr and ":" not in addr:
        addr = "./" + addr   # a bare file name in the current directory
    return Client(addr, token=token, timeout=timeout)


def library_path():
    """Where libkvrope was loaded from."""
    from . import _lib
    return _lib.load().path
