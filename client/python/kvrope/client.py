"""kvrope.Client: one blocking connection to kvroped, a method per verb.

Each method packs its arguments into libkvrope's structs, calls the C
function, turns a negative return into a KvropeError and copies results out.
Shape/dtype/argument checks happen in Python before the call, so a wrong
argument raises ValueError/TypeError and nothing is sent.

Adding a verb: declare the struct(s) and prototype in _lib.py (a new
optional symbol goes in _lib.OPTIONAL), then a method here that calls
self._fn("kvr_client_<verb>") (raises kvrope.Unsupported when the loaded
library lacks it) and self._call(...).
"""

import ctypes
import json
import os
import threading
from ctypes import POINTER, byref, c_size_t, c_uint32, c_int64, c_void_p
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from . import _lib, errors, tensors as T


def _b(s, what):
    if isinstance(s, bytes):
        b = s
    elif isinstance(s, str):
        b = s.encode()
    else:
        raise TypeError(f"{what} must be a str, got {type(s).__name__}")
    if not 1 <= len(b) <= _lib.NAME_MAX or b"\0" in b:
        raise ValueError(f"{what} must be 1..{_lib.NAME_MAX} bytes without NUL, got {s!r}")
    return b


def _u64(x, what):
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
        raise TypeError(f"{what} must be an int, got {type(x).__name__}")
    if not 0 <= int(x) < 1 << 64:
        raise ValueError(f"{what} out of range: {x}")
    return int(x)


def _token_range(start, end):
    """start and end (None: to the end) checked as u64s, end after start."""
    start = _u64(start, "start")
    if end is not None:
        end = _u64(end, "end")
        if end <= start:
            raise ValueError(f"empty or reversed token range [{start}, {end})")
    return start, end


def _i64(x, what):
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
        raise TypeError(f"{what} must be an int, got {type(x).__name__}")
    if not -(1 << 63) <= int(x) < 1 << 63:
        raise ValueError(f"{what} out of range: {x}")
    return int(x)


def _int_array(x, dt, what, lo, hi):
    if T.is_tensor(x):
        x = x.detach().cpu().numpy()
    a = np.asarray(x)
    if a.ndim != 1:
        raise ValueError(f"{what} must be 1-D, got shape {a.shape}")
    if a.size and a.dtype.kind not in "iu":
        raise TypeError(f"{what} must be integers, got {a.dtype}")
    if a.size and (int(a.min()) < lo or int(a.max()) > hi):
        raise ValueError(f"{what} out of range [{lo}, {hi}]")
    return np.ascontiguousarray(a, dtype=dt)


def tokens_array(tokens, what="tokens"):
    """1-D uint32 token ids (list, array or tensor); ValueError/TypeError otherwise."""
    return _int_array(tokens, np.uint32, what, 0, (1 << 32) - 1)


def positions_array(pos, n, what="positions"):
    a = _int_array(pos, np.int64, what, -(1 << 63), (1 << 63) - 1)
    if a.size != n:
        raise ValueError(f"{what}: {a.size} given for {n} tokens")
    return a


def _ptr(a, ctype):
    return a.ctypes.data_as(POINTER(ctype)) if a is not None and a.size else None


# ---- result types -------------------------------------------------------------

STYLES = {0: "neox", 1: "gptj"}
LAYER_KINDS = {0: "global", 1: "local", 2: "none"}
SCALINGS = {0: "default", 1: "linear", 2: "dynamic", 3: "yarn", 4: "longrope", 5: "llama3"}


@dataclass(frozen=True)
class Model:
    name: str
    n_layers: int
    n_kv_heads: int
    head_dim: int
    dtype: str             # native KV dtype at rest: f32 / f16 / bf16
    fingerprint: int       # shape + RoPE parameters + dtype
    n_contexts: int
    rope: dict = field(compare=False)   # style, theta, scaling, factor, rotary_dim, ...
    codec: str = field(default="", compare=False)
    # default codec of its contexts, canonical (docs/quantized.md)

    @classmethod
    def _from(cls, m):
        r = m.rope
        rope = {"style": STYLES.get(r.style, r.style), "theta": r.theta,
                "scaling": SCALINGS.get(r.scaling, r.scaling), "factor": r.factor,
                "rotary_dim": r.rotary_dim, "head_dim": r.head_dim,
                "max_position_embeddings": r.max_position_embeddings,
                "original_max_position_embeddings": r.original_max_position_embeddings,
                "attention_factor": r.attention_factor, "model_type": r.model_type.decode(),
                # per-layer RoPE: "global" / "local" (base local_theta) / "none" per layer
                "local_theta": r.local_theta,
                "layers": [LAYER_KINDS.get(r.layer_kind[i], r.layer_kind[i])
                           for i in range(min(r.n_layer_kinds, len(r.layer_kind)))]}
        return cls(m.name.decode(), m.n_layers, m.n_kv_heads, m.head_dim,
                   T.NAMES.get(m.dtype, str(m.dtype)), m.fingerprint, m.n_contexts, rope,
                   m.codec.decode())


@dataclass(frozen=True)
class CodecInfo:
    """A context's codec at rest (docs/quantized.md, Statistics)."""
    codec: str             # canonical spec; plain contexts: the dtype name
    quantized: bool
    n_window: int          # tokens in full-precision blocks
    kv_bytes: int          # K/V bytes its tokens occupy, scales included
    bytes_saved: int       # against the model's dtype
    bits_per_value: float
    rel_rms_k: float       # measured at quantization (keys pre-RoPE)
    rel_rms_v: float

    @classmethod
    def _from(cls, c):
        return cls(c.codec.decode(), bool(c.quantized), c.n_window, c.kv_bytes, c.bytes_saved,
                   c.bits_per_value, c.rel_rms_k, c.rel_rms_v)


class RawKV:
    """A raw get (get(raw=True)) of a quantized context: the stored encoded
    bytes, keys pre-RoPE. `data` is a uint8 array; for each layer of `layers`,
    layout["k_bytes"] of K then layout["v_bytes"] of V (docs/quantized.md).
    layout: codec, k_codec, v_codec, k_per_channel, k_group, v_group, window,
    k_bytes, v_bytes, k_unit_bytes, v_unit_bytes. positions: where to rotate
    the decoded keys."""

    def __init__(self, ctx_id, model, start, layers, tokens, positions, flags, groups, data,
                 layout, n_kv_heads, head_dim):
        self.ctx_id, self.model, self.start, self.layers = ctx_id, model, start, layers
        self.tokens, self.positions, self.flags, self.groups = tokens, positions, flags, groups
        self.data, self.layout = data, layout
        self.n_kv_heads, self.head_dim = n_kv_heads, head_dim

    n_tokens = property(lambda self: int(self.tokens.size))
    n_layers = property(lambda self: len(self.layers))
    codec = property(lambda self: self.layout["codec"])

    def __len__(self):
        return self.n_tokens

    def k(self, i):
        """Encoded K bytes of the i-th returned layer."""
        kb, vb = self.layout["k_bytes"], self.layout["v_bytes"]
        return self.data[i * (kb + vb): i * (kb + vb) + kb]

    def v(self, i):
        kb, vb = self.layout["k_bytes"], self.layout["v_bytes"]
        return self.data[i * (kb + vb) + kb: (i + 1) * (kb + vb)]


@dataclass(frozen=True)
class Context:
    id: str
    model: str
    n_tokens: int
    n_blocks: int
    n_shared_blocks: int
    n_approximate: int
    bytes: int
    pinned: bool
    busy: bool
    pos_min: int
    pos_max: int
    created_ms: int
    accessed_ms: int
    n_evicted_tokens: int

    @classmethod
    def _from(cls, c):
        return cls(c.id.decode(), c.model.decode(), c.n_tokens, c.n_blocks, c.n_shared_blocks,
                   c.n_approximate, c.bytes, bool(c.pinned), bool(c.busy), c.pos_min, c.pos_max,
                   c.created_ms, c.accessed_ms, c.n_evicted_tokens)


@dataclass(frozen=True)
class PutResult:
    n_tokens: int       # context length after the put
    first_index: int    # index of the first token put
    first_pos: int
    last_pos: int


@dataclass(frozen=True)
class Pong:
    server: str
    protocol: int


FLAG_APPROX = 0x1     # KV computed against text that has changed since (edits)
AGE_SHIFT, AGE_MASK = 8, 0xFF00   # flag bits 8..15: edits since the token was exact


def token_age(flags):
    """Approximation age(s) of flags (int or array): how many edits ago each
    token's KV was last exact (base/types.h KVR_TOKEN_AGE)."""
    return (np.asarray(flags) & AGE_MASK) >> AGE_SHIFT


class KV:
    """A get/match result. `data` is the payload as one array
    [n_layers, 2, n_tokens, n_kv_heads, head_dim] (axis 1: 0 = K, 1 = V) of
    numpy float32 / float16 / uint16 (bf16 bit patterns), or None for
    meta_only. It is the libkvrope receive buffer itself (no copy), freed when
    the last view of it is gone. Per token: tokens (uint32), positions (int64:
    the positions the returned keys are rotated at), flags (uint32,
    FLAG_APPROX), groups (int32). `layers` lists the layer ids along axis 0."""

    def __init__(self, ctx_id, model, start, dtype, layers, tokens, positions, flags, groups,
                 data, n_kv_heads, head_dim):
        self.ctx_id, self.model, self.start, self.dtype = ctx_id, model, start, dtype
        self.layers, self.tokens, self.positions = layers, tokens, positions
        self.flags, self.groups, self.data = flags, groups, data
        self.n_kv_heads, self.head_dim = n_kv_heads, head_dim

    n_tokens = property(lambda self: int(self.tokens.size))
    n_layers = property(lambda self: len(self.layers))
    approximate = property(lambda self: (self.flags & FLAG_APPROX) != 0)
    pending = property(lambda self: (self.flags & 0x2) != 0)   # FLAG_PENDING
    shape = property(lambda self: (self.n_layers, 2, self.n_tokens, self.n_kv_heads, self.head_dim))

    def __len__(self):
        return self.n_tokens

    def __repr__(self):
        return (f"<kvrope.KV {self.ctx_id!r} [{self.start}, {self.start + self.n_tokens}) "
                f"layers={list(self.layers)} {self.dtype} shape={self.shape}"
                f"{' meta-only' if self.data is None else ''}>")

    def _need(self):
        if self.data is None:
            raise ValueError("this result has no payload (meta_only)")
        return self.data

    def k(self, i):
        """K of the i-th returned layer (index into .layers): [T, H, D] view."""
        return self._need()[i, 0]

    def v(self, i):
        return self._need()[i, 1]

    @property
    def keys(self):
        """All K: [n_layers, T, H, D] view."""
        return self._need()[:, 0]

    @property
    def values(self):
        return self._need()[:, 1]

    def pairs(self, float32=False):
        """[(K, V), ...] per layer: examples/llama.py's kv form (views, or
        float32 copies with float32=True)."""
        d = self.to_float32() if float32 else self._need()
        return [(d[i, 0], d[i, 1]) for i in range(d.shape[0])]

    def to_float32(self):
        """The payload widened to float32 (exact for f16 and bf16)."""
        d = self._need()
        if self.dtype == "f32":
            return d
        if self.dtype == "f16":
            return d.astype(np.float32)
        return T.bf16_to_f32(d)

    def to_torch(self):
        """The payload as a torch tensor sharing its memory (bf16 ->
        torch.bfloat16). Requires torch."""
        import torch   # ImportError when absent
        d = self._need()
        t = torch.from_numpy(d if self.dtype != "bf16" else d.view(np.int16))
        return t.view(torch.bfloat16) if self.dtype == "bf16" else t


class Region:
    """A shared-memory region of one connection (Client.region): a memfd the
    daemon maps too. put(..., shm=region) reads the payload from it; get(...,
    shm=region) has the daemon write the result straight into it, and the
    returned KV.data is a numpy view of the region (no copy; KV.to_torch()
    shares it too). Views stay valid until release() or the client closes;
    do not use them after that. Unix socket only (TCP: UnsupportedByDaemon)."""

    def __init__(self, client, rid, base, size):
        self._client, self.id, self.base, self.size = client, rid, base, size
        self._buf = (ctypes.c_uint8 * size).from_address(base)
        self._buf._kvrope_owner = self

    def array(self, dtype="u1", shape=None, offset=0):
        """A numpy view of the region's bytes from offset (dtype: a numpy dtype
        or a kvrope dtype name; shape None: as many elements as fit)."""
        dt = np.dtype(T.NUMPY[dtype]) if dtype in T.NUMPY else np.dtype(dtype)
        if self.base is None:
            raise ValueError("the region was released")
        offset = _u64(offset, "offset")
        n = (self.size - offset) // dt.itemsize if shape is None else int(np.prod(shape))
        if offset > self.size or n * dt.itemsize > self.size - offset:
            raise ValueError(f"{n} x {dt} at offset {offset} does not fit the {self.size}-byte region")
        a = np.frombuffer(self._buf, dtype=dt, count=n, offset=offset)
        return a if shape is None else a.reshape(shape)

    def tensor(self, dtype="f32", shape=None, offset=0):
        """array() as a torch tensor sharing the region's memory (bf16 ->
        torch.bfloat16). Requires torch."""
        import torch   # ImportError when absent
        if dtype == "bf16":
            return torch.from_numpy(self.array("u2", shape, offset).view(np.int16)).view(
                torch.bfloat16)
        return torch.from_numpy(self.array(dtype, shape, offset))

    def offset_of(self, arr):
        """Byte offset of arr's memory in the region, or None if it lies elsewhere."""
        if not isinstance(arr, np.ndarray) or not arr.flags.c_contiguous or self.base is None:
            return None
        p = arr.ctypes.data
        if self.base <= p and p + arr.nbytes <= self.base + self.size:
            return p - self.base
        return None

    def _view(self, ptr, nbytes, dt):
        off = ptr - self.base
        return self.array(dt, (nbytes // T.SIZE[dt],), off)

    def release(self):
        """Unregisters the region (the daemon unmaps it once no request uses
        it) and unmaps this process's view."""
        if self.base is not None:
            self._client._call("kvr_client_region_release", self.id)
            self.base = None

    def __repr__(self):
        return f"<kvrope.Region {self.id} {self.size} bytes{' released' if self.base is None else ''}>"


def _shm_place(shm):
    """(Region, offset) from shm=Region or shm=(Region, offset)."""
    if isinstance(shm, Region):
        return shm, None
    if isinstance(shm, tuple) and len(shm) == 2 and isinstance(shm[0], Region):
        return shm[0], _u64(shm[1], "shm offset")
    raise TypeError("shm must be a Region or (Region, offset)")


def _shm_out(what, shm, out):
    """Where a get's or cover's payload lands when shm is given (out may not
    be): (Region, the kvr_shm placement)."""
    if out is not None:
        raise ValueError(f"{what}: out and shm exclude each other")
    reg, off = _shm_place(shm)
    return reg, _lib.kvr_shm(reg.id, off or 0, 0)


@dataclass
class Match:
    length: int                 # cached exact prefix length, 0 = none
    ctx_id: Optional[str]       # a context holding tokens [0, length)
    kv: Optional[KV] = None     # with get=True and length > 0


# ---- the client -----------------------------------------------------------------

_MODES = {"upsert": _lib.PUT_UPSERT, "create": _lib.PUT_CREATE, "append": _lib.PUT_APPEND,
          "replace": _lib.PUT_REPLACE}


class Client:
    """One connection. Use kvrope.connect(); close() or a `with` block ends it.

    Calls on one Client are serialised with a lock (libkvrope handles must not
    be used concurrently); use one Client per thread for parallelism. The GIL
    is released while libkvrope waits for the daemon."""

    def __init__(self, addr, token=None, timeout=None):
        self._lib = _lib.load()
        self._lock = threading.Lock()
        self._models = {}
        self.addr = os.fspath(addr) if isinstance(addr, os.PathLike) else addr
        if not isinstance(self.addr, str) or not self.addr:
            raise TypeError("addr must be a socket path, 'unix:PATH', 'HOST:PORT' or 'tcp:HOST:PORT'")
        opts = _lib.kvr_client_opts()
        if token is not None:
            tok = token.encode() if isinstance(token, str) else bytes(token)
            if not tok:
                raise ValueError("empty token")
            self._tok = ctypes.create_string_buffer(tok, len(tok))
            opts.token = ctypes.cast(self._tok, c_void_p)
            opts.token_len = len(tok)
        if timeout is not None:
            if timeout <= 0:
                raise ValueError("timeout must be > 0 seconds (None = wait forever)")
            opts.timeout_ms = max(1, int(round(timeout * 1000)))
        h = c_void_p()
        rc = self._lib.kvr_client_connect(byref(h), self.addr.encode(), byref(opts))
        if rc < 0:
            msg = (self._lib.kvr_client_last_error(None) or b"").decode(errors="replace")
            raise errors.from_c(rc, msg)
        self._h = h

    # -- plumbing
    def _fn(self, name):
        if not self._lib.has(name):
            raise errors.Unsupported(f"libkvrope at {self._lib.path} has no {name}; "
                                     f"rebuild it (make build/libkvrope.so)")
        return getattr(self._lib, name)

    def _call(self, name, *args):
        f = self._fn(name)
        with self._lock:
            if self._h is None:
                raise errors.ConnectionFailed(errors.KVR_ECLOSED, "the client is closed")
            rc = f(self._h, *args)
            if rc < 0:
                msg = (self._lib.kvr_client_last_error(self._h) or b"").decode(errors="replace")
                raise errors.from_c(rc, msg)
        return rc

    def close(self):
        """Closes the connection. Deferred deletes still queued are sent
        first (flush()): closing a live connection never drops a delete the
        caller asked for; if one failed, the connection is closed all the
        same and that error is raised (a connection already lost raises
        nothing here: its calls said so)."""
        self._close(flush=True)

    def _close(self, flush):
        err = None
        with self._lock:
            if getattr(self, "_h", None) is None:
                return
            if flush and self._lib.has("kvr_client_flush"):
                rc = self._lib.kvr_client_flush(self._h)
                if rc < 0:
                    msg = (self._lib.kvr_client_last_error(self._h) or b"").decode(
                        errors="replace")
                    err = errors.from_c(rc, msg)
                    if isinstance(err, errors.ConnectionFailed):
                        err = None
            self._lib.kvr_client_close(self._h)
            self._h = None
        if err is not None:
            raise err

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self._close(flush=False)   # never I/O from the garbage collector
        except Exception:
            pass

    @property
    def closed(self):
        return self._h is None

    # -- verbs
    def ping(self):
        """-> Pong(server, protocol)."""
        p = _lib.kvr_pong()
        self._call("kvr_client_ping", byref(p))
        return Pong(p.server.decode(), p.protocol)

    def register_model(self, name, config=None, *, style=None, dtype="f16",
                       n_layers=0, n_kv_heads=0, head_dim=0, codec=None):
        """Registers (or identically re-registers) a model; -> Model.

        config: a dict (sent as JSON text), a path to an HF config.json (or a
        directory holding one), JSON text (a str starting with '{'), or None
        with explicit n_layers/n_kv_heads/head_dim (HF default RoPE).
        style: None, "neox" or "gptj"; None honours a "rope_style" key in the
        config (examples/llama.py writes one; HF and the daemon ignore it),
        else the daemon's rule (by model_type).
        dtype: the model's native KV dtype at rest (default f16, as the daemon's).
        codec: default codec of its contexts at rest (docs/quantized.md: "k4v2",
        "int8", "q4_0", "kivi:k4v2:r64", ...); None = the dtype, plain. A bad
        spec raises InvalidArgument (E_INVALID) with the daemon's explanation."""
        nm = _b(name, "model name")
        text = None
        if isinstance(config, dict):
            text = json.dumps(config)
        elif isinstance(config, bytes):
            text = config.decode()
        elif isinstance(config, str) and config.lstrip().startswith("{"):
            text = config
        elif isinstance(config, (str, os.PathLike)):
            path = os.fspath(config)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            with open(path, encoding="utf-8") as f:
                text = f.read()
        elif config is not None:
            raise TypeError(f"config must be a dict, a path or JSON text, got {type(config).__name__}")
        if text is None and not (n_layers and n_kv_heads and head_dim):
            raise ValueError("without a config, give n_layers, n_kv_heads and head_dim")
        if style is None and text is not None:
            try:
                s = json.loads(text).get("rope_style")
                style = s if s in ("neox", "gptj") else None
            except (ValueError, AttributeError):
                pass   # the daemon judges the JSON
        if style is not None and style not in ("neox", "gptj"):
            raise ValueError(f"style must be None, 'neox' or 'gptj', got {style!r}")
        p = _lib.kvr_model_params()
        p.name = nm
        tb = text.encode() if text is not None else None
        p.config_json = tb
        p.config_json_len = len(tb) if tb is not None else 0
        p.style = style.encode() if style else None
        p.n_layers, p.n_kv_heads, p.head_dim = (_u64(n_layers, "n_layers"),
                                                _u64(n_kv_heads, "n_kv_heads"),
                                                _u64(head_dim, "head_dim"))
        p.dtype = T.CODES[T.dtype_name(dtype)]
        p.codec = _b(codec, "codec") if codec is not None else None
        out = _lib.kvr_model()
        self._call("kvr_client_model_register", byref(p), byref(out))
        m = Model._from(out)
        self._models[m.name] = m
        return m

    def models(self):
        """-> [Model] (every registered model)."""
        arr, n = POINTER(_lib.kvr_model)(), c_size_t()
        self._call("kvr_client_model_list", byref(arr), byref(n))
        try:
            ms = [Model._from(arr[i]) for i in range(n.value)]
        finally:
            self._lib.kvr_client_free(arr)
        for m in ms:
            self._models[m.name] = m
        return ms

    def model(self, name, refresh=False):
        """-> Model by name (cached per connection: a name's shape and
        fingerprint never change once registered). UnknownModel if absent."""
        nm = _b(name, "model name").decode()
        if refresh or nm not in self._models:
            out = _lib.kvr_model()
            self._call("kvr_client_model_get", nm.encode(), byref(out))
            self._models[nm] = Model._from(out)
        return self._models[nm]

    def region(self, size):
        """A new shared-memory region of `size` bytes (memfd, sealed against
        shrinking, registered on this connection) -> Region. Unix socket only."""
        size = _u64(size, "size")
        rid, base = c_uint32(0), c_void_p(0)
        self._call("kvr_client_region_create", size, byref(rid), byref(base))
        return Region(self, rid.value, base.value, size)

    def put(self, ctx_id, model, tokens, kv=None, *, k=None, v=None, dtype=None, mode="upsert",
            positions=None, pos_start=None, pin=False, check_model=True, protect_first=None,
            prefix=None, groups=None, group_offsets=None, codec=None, shm=None, share=False,
            share_sync=False, v_trans=False):
        """Stores the KV of `tokens` in context `ctx_id` (created or appended
        to); -> PutResult.

        v_trans=True records, on create, that this KV came from an engine
        cache with V transposed (llama.cpp with flash attention off), so
        `kvrope llama export` writes that layout by default (a record only:
        the payload's layout is the same either way).

        share=True publishes the context to the daemon's shared tier
        (kvroped --remote-tier, docs/cluster.md) after the acknowledgement;
        share_sync=True acknowledges only once it is published (else
        kvrope.IOFailure "stored locally, not shared: ..."; the put stands).

        shm=Region or (Region, offset): the payload goes through shared
        memory instead of the socket. A kv array that already lies in the
        region (Region.array()) is used where it is; otherwise its bytes are
        copied into the region at offset (default 0) first.

        kv: [n_layers, 2, T, kv_heads, head_dim] array/tensor, or a list of
        (K, V) per layer ([T, kv_heads, head_dim] each); or k=, v= each
        [n_layers, T, kv_heads, head_dim]. dtype: wire dtype (default: the
        data's; see kvrope.tensors). mode: "upsert" | "create" | "append" |
        "replace" (create, or replace an existing context of the model at once).
        Positions: `positions` (one per token) or `pos_start` (contiguous), or
        neither (the context's last position + 1; 0 for a new context).
        check_model: look the model's shape up (once per connection, cached)
        and refuse a mismatch locally; the put also carries the model's
        fingerprint, so the daemon refuses a model re-defined under the name.

        Options (kvr_put_args): protect_first=n: edits may not touch
        tokens [0, n) (attention sinks; 0 unprotects). On create only:
        prefix=ctx: an APE document encoded after that prefix context
        (positions default to P, P+1, ...; see assemble()); groups=[names],
        group_offsets=[phi...]: a grouped context (GPE, see group_append());
        codec="k4v2" (docs/quantized.md): the new context's codec at rest
        (default: the model's); the daemon quantizes off its loop thread. On
        an existing context it must be the context's codec."""
        a, keep = self._put_args(ctx_id, model, tokens, kv, k, v, dtype, mode, positions,
                                 pos_start, pin, check_model, protect_first, prefix,
                                 groups, group_offsets, codec)
        a.share, a.share_sync = bool(share or share_sync), bool(share_sync)
        a.v_trans = bool(v_trans)
        out = _lib.kvr_put_res()
        if shm is not None:
            reg, off = _shm_place(shm)
            parts = keep[4]
            n = sum(p.nbytes for p in parts)
            at = reg.offset_of(parts[0]) if len(parts) == 1 else None
            if at is None:
                at = off or 0
                dst = reg.array("u1", (n,), at)
                k = 0
                for p in parts:
                    dst[k:k + p.nbytes] = np.ascontiguousarray(p).reshape(-1).view(np.uint8)
                    k += p.nbytes
            place = _lib.kvr_shm(reg.id, at, n)
            self._call("kvr_client_put_shm", byref(a), byref(place), byref(out))
        else:
            self._call("kvr_client_put", byref(a), byref(out))
        del keep
        return PutResult(out.n_tokens, out.first_index, out.first_pos, out.last_pos)

    def _put_args(self, ctx_id, model, tokens, kv, k, v, dtype, mode, positions, pos_start,
                  pin, check_model, protect_first=None, prefix=None, groups=None,
                  group_offsets=None, codec=None):
        cid, mn = _b(ctx_id, "ctx_id"), _b(model, "model")
        toks = tokens_array(tokens)
        if not toks.size:
            raise ValueError("put needs at least one token")
        if mode not in _MODES:
            raise ValueError(f"mode must be one of {sorted(_MODES)}, got {mode!r}")
        pos = positions_array(positions, toks.size) if positions is not None else None
        if pos is not None and pos_start is not None:
            raise ValueError("give positions or pos_start, not both")
        a = _lib.kvr_put_args()
        okeep = self._put_opts(a, protect_first, prefix, groups, group_offsets, codec)
        parts, dt, (L, n, H, D) = T.as_kv_parts(kv, k, v, toks.size, dtype)
        fp = 0
        if check_model:
            m = self.model(mn.decode())
            if (L, H, D) != (m.n_layers, m.n_kv_heads, m.head_dim):
                raise ValueError(f"KV shape (layers, kv_heads, head_dim) = {(L, H, D)} but model "
                                 f"{m.name!r} has {(m.n_layers, m.n_kv_heads, m.head_dim)}")
            fp = m.fingerprint
        a.ctx_id, a.model, a.mode, a.fingerprint = cid, mn, _MODES[mode], fp
        a.n_layers, a.n_kv_heads, a.head_dim, a.dtype = L, H, D, T.CODES[dt]
        a.tokens, a.n_tokens = _ptr(toks, c_uint32), toks.size
        a.positions = _ptr(pos, c_int64)
        if pos_start is not None:
            a.has_pos_start, a.pos_start = True, _i64(pos_start, "pos_start")
        a.pin = bool(pin)
        keep = [cid, mn, toks, pos, parts, _set_payload(a, parts), okeep]
        return a, keep

    def _put_opts(self, o, protect_first, prefix, groups, group_offsets, codec=None):
        """Fills the put options of kvr_put_args o; -> what must stay alive."""
        keep = []
        if codec is not None:
            o.codec = _b(codec, "codec")
        if protect_first is not None:
            o.has_protect, o.protect_first = True, _u64(protect_first, "protect_first")
        if prefix is not None:
            o.prefix_ctx = _b(prefix, "prefix")
        if group_offsets is not None and groups is None:
            raise ValueError("group_offsets need groups")
        if groups is not None:
            if isinstance(groups, (str, bytes)) or not len(groups):
                raise ValueError("groups must be a non-empty list of group names")
            if len(groups) > _lib.MAX_GROUPS:
                raise ValueError(f"at most {_lib.MAX_GROUPS} groups")
            names = (ctypes.c_char_p * len(groups))(*[_b(g, "group name") for g in groups])
            o.groups, o.n_groups = ctypes.cast(names, POINTER(ctypes.c_char_p)), len(groups)
            keep.append(names)
            if group_offsets is not None:
                offs = positions_array(group_offsets, len(groups), "group_offsets")
                o.group_offsets = _ptr(offs, c_int64)
                keep.append(offs)
        return keep

    def _layers(self, layers):
        if layers is None:
            return None
        return _int_array(list(layers) if not isinstance(layers, np.ndarray) else layers,
                          np.uint32, "layers", 0, (1 << 32) - 1)

    @staticmethod
    def _out_buf(out, dt):
        if out is None:
            return None, 0
        if not isinstance(out, np.ndarray):
            raise TypeError("out must be a numpy array")
        if out.dtype != T.NUMPY[dt]:
            raise TypeError(f"out has dtype {out.dtype}, a {dt} result needs {T.NUMPY[dt]}")
        if not out.flags.c_contiguous or not out.flags.writeable:
            raise ValueError("out must be C-contiguous and writeable")
        return out.ctypes.data, out.nbytes

    def _take(self, kvs, out, region=None):
        """KV from a filled kvr_kv (releases what libkvrope owns)."""
        try:
            n, L = kvs.n_tokens, kvs.n_layers
            dt = T.NAMES[kvs.dtype]
            def arr(p, dt_):
                return np.ctypeslib.as_array(p, (n,)).copy() if n else np.empty(0, dt_)
            tokens, pos = arr(kvs.tokens, np.uint32), arr(kvs.positions, np.int64)
            flags, groups = arr(kvs.flags, np.uint32), arr(kvs.groups, np.int32)
            layers = tuple(kvs.layers[i] for i in range(L))
            shape = (L, 2, n, kvs.n_kv_heads, kvs.head_dim)
            data = None
            if kvs.payload:
                nbytes = kvs.payload_len
                if kvs.payload_owned:
                    flat = T.adopt(kvs.payload, nbytes, dt)
                    kvs.payload = None          # ours now, freed with the array
                elif region is not None:        # a view of the shared region
                    flat = region._view(kvs.payload, nbytes, dt)
                else:
                    flat = out.reshape(-1).view(np.uint8)[:nbytes].view(T.NUMPY[dt])
                data = flat.reshape(shape)
                if out is not None and out.shape == shape:
                    data = out
            return KV(kvs.ctx_id.decode(), kvs.model.decode(), kvs.start, dt, layers, tokens,
                      pos, flags, groups, data, kvs.n_kv_heads, kvs.head_dim)
        finally:
            self._lib.kvr_kv_release(byref(kvs))

    def _layer_cb(self, on_layer, kvs, errs):
        if on_layer is None:
            return _lib.LAYER_FN()

        def cb(_ud, index, layer, kp, vp, nbytes):
            try:
                dt = T.NAMES[kvs.dtype]
                shape = (kvs.n_tokens, kvs.n_kv_heads, kvs.head_dim)
                n = nbytes // T.SIZE[dt]
                on_layer(layer, T.view(kp, n, dt).reshape(shape), T.view(vp, n, dt).reshape(shape))
            except BaseException as e:  # re-raised after the call
                errs.append(e)
        return _lib.LAYER_FN(cb)

    def _take_raw(self, kvs, rl):
        """RawKV from a filled kvr_kv of a raw get (releases what libkvrope owns)."""
        try:
            n, L = kvs.n_tokens, kvs.n_layers
            def arr(p, dt_):
                return np.ctypeslib.as_array(p, (n,)).copy() if n else np.empty(0, dt_)
            data = None
            if kvs.payload:
                buf = (ctypes.c_uint8 * kvs.payload_len).from_address(kvs.payload)
                if kvs.payload_owned:   # ours now, freed with the array
                    buf._kvrope_owner = T._Free(kvs.payload)
                    kvs.payload = None
                    data = np.frombuffer(buf, dtype=np.uint8)
                else:
                    data = np.frombuffer(buf, dtype=np.uint8).copy()
            layout = {"codec": rl.codec.decode(), "k_codec": rl.k_codec.decode(),
                      "v_codec": rl.v_codec.decode(), "k_per_channel": bool(rl.k_per_channel),
                      "k_group": rl.k_group, "v_group": rl.v_group, "window": rl.window,
                      "k_bytes": rl.k_bytes, "v_bytes": rl.v_bytes,
                      "k_unit_bytes": rl.k_unit_bytes, "v_unit_bytes": rl.v_unit_bytes}
            return RawKV(kvs.ctx_id.decode(), kvs.model.decode(), kvs.start,
                         tuple(kvs.layers[i] for i in range(L)), arr(kvs.tokens, np.uint32),
                         arr(kvs.positions, np.int64), arr(kvs.flags, np.uint32),
                         arr(kvs.groups, np.int32), data, layout, kvs.n_kv_heads, kvs.head_dim)
        finally:
            self._lib.kvr_kv_release(byref(kvs))

    def get(self, ctx_id, start=0, end=None, *, dtype="f32", positions=None, layers=None,
            meta_only=False, out=None, on_layer=None, raw=False, shm=None):
        """Fetches tokens [start, end) (end None = to the end) of a context; -> KV.

        shm=Region or (Region, offset): the daemon writes the result straight
        into the region (its workers rotate / convert into it; nothing on the
        socket) and KV.data is a numpy view there, no copy (out does not apply).

        dtype: of the result (default f32). positions: one target position
        per token, keys are re-rotated to them (default: current positions).
        layers: a subset of layer ids, in the order wanted. out: a C-contiguous
        numpy array of the result dtype (np.float32/np.float16/np.uint16) to
        receive the payload straight into (BufferTooSmall if too small).
        on_layer(layer_id, K, V): called as soon as each layer has arrived;
        K and V are [T, H, D] views valid during the callback (copy to keep).
        raw=True (quantized contexts): -> RawKV, the stored encoded bytes with
        their layout (keys pre-RoPE; docs/quantized.md); dtype, positions, out
        and on_layer do not apply. Tokens still in the full-precision window
        raise UnsupportedByDaemon (E_UNSUPPORTED): fetch those with raw=False."""
        cid = _b(ctx_id, "ctx_id")
        if raw:
            if positions is not None or out is not None or on_layer is not None:
                raise ValueError("raw get: positions, out and on_layer do not apply")
            start, end = _token_range(start, end)
            lay = self._layers(layers)
            a = _lib.kvr_get_args()
            a.ctx_id, a.start, a.end, a.dtype = cid, start, end or 0, T.CODES["f32"]
            a.layers, a.n_layers = _ptr(lay, c_uint32), 0 if lay is None else lay.size
            a.meta_only, a.raw = bool(meta_only), True
            kvs = _lib.kvr_kv()
            self._call("kvr_client_get", byref(a), byref(kvs))
            return self._take_raw(kvs, kvs.raw)
        start, end = _token_range(start, end)
        dt = T.dtype_name(dtype)
        lay = self._layers(layers)
        pos = None
        if positions is not None:
            if end is None:
                raise ValueError("positions need an explicit end (one position per token)")
            pos = positions_array(positions, end - start)
        dst, cap = self._out_buf(out, dt)
        kvs, errs = _lib.kvr_kv(), []
        cb = self._layer_cb(on_layer, kvs, errs)
        a = _lib.kvr_get_args()
        a.ctx_id, a.start, a.end, a.dtype = cid, start, end or 0, T.CODES[dt]
        a.positions, a.n_positions = _ptr(pos, c_int64), 0 if pos is None else pos.size
        a.layers, a.n_layers = _ptr(lay, c_uint32), 0 if lay is None else lay.size
        a.meta_only = bool(meta_only)
        a.dst, a.dst_cap = dst, cap
        a.on_layer = cb
        if shm is not None:
            reg, place = _shm_out("get", shm, out)
            self._call("kvr_client_get_shm", byref(a), byref(place), byref(kvs))
            res = self._take(kvs, None, reg)
            if errs:
                raise errs[0]
            return res
        self._call("kvr_client_get", byref(a), byref(kvs))
        res = self._take(kvs, out)
        if errs:
            raise errs[0]
        return res

    def match(self, model, tokens, *, get=False, dtype="f32", layers=None,
              include_approximate=False, out=None):
        """Longest cached exact prefix of `tokens` for `model`; -> Match
        (length, ctx_id, kv). With get=True and length > 0, kv holds tokens
        [0, length) of ctx_id (see get() for dtype/layers/out)."""
        mn = _b(model, "model")
        toks = tokens_array(tokens)
        dt = T.dtype_name(dtype)
        lay = self._layers(layers)
        dst, cap = self._out_buf(out, dt)
        a = _lib.kvr_match_args()
        a.model, a.tokens, a.n_tokens = mn, _ptr(toks, c_uint32), toks.size
        a.include_approximate, a.get, a.dtype = bool(include_approximate), bool(get), T.CODES[dt]
        a.layers, a.n_layers = _ptr(lay, c_uint32), 0 if lay is None else lay.size
        a.dst, a.dst_cap = dst, cap
        r = _lib.kvr_match_res()
        self._call("kvr_client_match", byref(a), byref(r))
        kv = self._take(r.kv, out) if r.has_kv else None
        return Match(int(r.length), r.ctx_id.decode() if r.length else None, kv)

    def remove_model(self, name):
        """Removes a model that no context uses (Busy otherwise)."""
        nm = _b(name, "model name")
        self._call("kvr_client_model_remove", nm)
        self._models.pop(name if isinstance(name, str) else nm.decode(errors="replace"), None)

    def delete(self, ctx_id, deferred=False):
        """Deletes a context. deferred=True queues the delete instead: it is
        sent in the same write as the next call's request (or by flush()), so
        a put that retires an older context costs one round trip, not two. A
        deferred delete of a context already gone counts as done; any other
        failure never fails the call it rode with: it is counted in
        deferred_failures()."""
        if deferred:
            self._call("kvr_client_delete_deferred", _b(ctx_id, "ctx_id"))
        else:
            self._call("kvr_client_delete", _b(ctx_id, "ctx_id"))

    def flush(self):
        """Sends the deferred deletes now and reads their answers; raises the
        first one's error if any failed (each is also counted)."""
        self._call("kvr_client_flush")

    def deferred_failures(self):
        """-> (count, last message): deferred requests that failed since the
        connection opened."""
        with self._lock:
            if self._h is None:
                raise errors.ConnectionFailed(errors.KVR_ECLOSED, "the client is closed")
            buf = ctypes.create_string_buffer(512)
            n = self._lib.kvr_client_deferred_failures(self._h, buf, len(buf))
        return int(n), buf.value.decode(errors="replace")

    def stat(self, ctx_id):
        """-> Context."""
        c = _lib.kvr_context()
        self._call("kvr_client_stat", _b(ctx_id, "ctx_id"), byref(c))
        return Context._from(c)

    def exists(self, ctx_id):
        try:
            self.stat(ctx_id)
            return True
        except errors.UnknownContext:
            return False

    def list(self, model=None):
        """-> [Context], sorted by id; model filters."""
        arr, n = POINTER(_lib.kvr_context)(), c_size_t()
        self._call("kvr_client_list", _b(model, "model") if model is not None else None,
                   byref(arr), byref(n))
        try:
            return [Context._from(arr[i]) for i in range(n.value)]
        finally:
            self._lib.kvr_client_free(arr)

    def pin(self, ctx_id, pin=True):
        """Protects a context from eviction (pin=False unpins)."""
        self._call("kvr_client_pin", _b(ctx_id, "ctx_id"), bool(pin))

    def unpin(self, ctx_id):
        self.pin(ctx_id, False)

    def fork(self, src, dst):
        """Copy-on-write copy of context src as dst (llama.cpp seq_cp)."""
        self._call("kvr_client_fork", _b(src, "src"), _b(dst, "dst"))

    def shift(self, ctx_id, start, end, delta):
        """Logical positions of tokens [start, end) += delta (llama.cpp seq_add)."""
        self._call("kvr_client_shift", _b(ctx_id, "ctx_id"), _u64(start, "start"),
                   _u64(end, "end"), _i64(delta, "delta"))

    def keep(self, ctx_id, start, end):
        """Keeps tokens [start, end), drops the rest (llama.cpp seq_keep)."""
        self._call("kvr_client_keep", _b(ctx_id, "ctx_id"), _u64(start, "start"),
                   _u64(end, "end"))

    def stats(self):
        """-> {metric name: value} in the daemon's order (docs/protocol.md)."""
        arr, n = POINTER(_lib.kvr_metric)(), c_size_t()
        self._call("kvr_client_stats", byref(arr), byref(n))
        try:
            return {arr[i].name.decode(): arr[i].value for i in range(n.value)}
        finally:
            self._lib.kvr_client_free(arr)

    # -- edits (PIE): kvr_client_edit / _edit_plan / _refresh

    def _edit_args(self, ctx_id, ops, model):
        """kvr_edit_args with ctx_id, ops, model and fingerprint set; plus the
        objects that must outlive the call and the per-op token counts."""
        cid = _b(ctx_id, "ctx_id")
        norm = _edit_ops(ops)
        rng = (_lib.kvr_edit_range * len(norm))()
        keep = [rng]
        for i, (s, e, t, apx) in enumerate(norm):
            rng[i].start, rng[i].end = s, e
            rng[i].tokens, rng[i].n_tokens = _ptr(t, c_uint32), t.size
            rng[i].approx = apx
            keep.append(t)
        a = _lib.kvr_edit_args()
        a.ctx_id = cid
        a.ops, a.n_ops = ctypes.cast(rng, POINTER(_lib.kvr_edit_range)), len(norm)
        m = None
        if model is not None:
            m = self.model(_b(model, "model").decode())
            a.model, a.fingerprint = m.name.encode(), m.fingerprint
        return a, keep, [t.size for _, _, t, _ in norm], m

    def _edit_result(self, out, counts):
        try:
            spans = []
            for i in range(out.n_spans):
                sp = out.spans[i]
                n = counts[i] if counts is not None and i < len(counts) else None
                spans.append(EditSpan(int(sp.index), int(sp.first_pos), int(sp.shift), n))
            return EditResult(int(out.n_tokens), int(out.n_new), int(out.n_removed),
                              int(out.first_change), int(out.n_approximate),
                              int(out.n_pending), int(out.payload_bytes), tuple(spans))
        finally:
            if out.spans:
                self._lib.kvr_client_free(out.spans)
                out.spans = None

    def edit_plan(self, ctx_id, ops, *, model=None, expect=None):
        """Where an edit's new tokens would go, without changing anything;
        -> EditResult (spans[i].positions: the positions to compute op i's new
        tokens at; .positions: all of them in request order; payload_bytes:
        the KV to send, in the model's dtype).

        ops: [(start, end, new_tokens), ...] in the context's current token
        indices: start == end inserts before `start`, empty new_tokens deletes.
        model: checked by the daemon (name and fingerprint) when given.
        expect: the token sequence the ops were planned against; the daemon
        refuses with KVR_EBUSY (nothing changed) when the context holds
        another (compare-and-swap: another writer's edit landed first)."""
        fn_name = "kvr_client_edit_plan"
        self._fn(fn_name)
        a, keep, counts, _ = self._edit_args(ctx_id, ops, model)
        _set_expect(a, expect)
        out = _lib.kvr_edit_res()
        self._call(fn_name, byref(a), byref(out))
        del keep
        return self._edit_result(out, counts)

    def edit(self, ctx_id, ops, kv=None, *, k=None, v=None, model=None, dtype=None,
             expect=None):
        """Applies a PIE edit atomically; -> EditResult.

        ops: as edit_plan. kv: the new tokens' KV, ALL new tokens of all ops
        in request order, K rotated at the positions edit_plan returned; given
        like put's (stacked [n_layers, 2, T, kv_heads, head_dim], a list of
        (K, V), or k=/v=). Without KV the new tokens are FLAG_PENDING until
        refresh(). The tokens after the first edit point become FLAG_APPROX
        (their keys are re-rotated by the daemon, their values are unchanged).
        model: checked locally (shape) and by the daemon (fingerprint).
        expect: as edit_plan (compare-and-swap on the token sequence)."""
        fn_name = "kvr_client_edit"
        self._fn(fn_name)
        a, keep, counts, m = self._edit_args(ctx_id, ops, model)
        _set_expect(a, expect)
        parts = None
        if kv is not None or k is not None or v is not None:
            n_new = sum(counts)
            if n_new == 0:
                raise ValueError("KV given but the ops insert no tokens")
            parts, dt, (L, n, H, D) = T.as_kv_parts(kv, k, v, n_new, dtype)
            if m is not None and (L, H, D) != (m.n_layers, m.n_kv_heads, m.head_dim):
                raise ValueError(f"KV shape (layers, kv_heads, head_dim) = {(L, H, D)} but model "
                                 f"{m.name!r} has {(m.n_layers, m.n_kv_heads, m.head_dim)}")
            a.with_kv = True
            a.n_layers, a.n_kv_heads, a.head_dim, a.dtype = L, H, D, T.CODES[dt]
            keep.append(_set_payload(a, parts))
        out = _lib.kvr_edit_res()
        self._call(fn_name, byref(a), byref(out))
        del keep, parts
        return self._edit_result(out, counts)

    def refresh(self, ctx_id, start, end=None, kv=None, *, k=None, v=None, model=None,
                dtype=None, expect=None, approx=False):
        """Overwrites the KV of tokens [start, end) with recomputed KV (K
        rotated at the tokens' current positions, see get(meta_only=True))
        and clears their FLAG_APPROX / FLAG_PENDING; -> EditResult (one span).
        end None = start + the KV's token count. kv as in put().
        expect: as edit_plan (compare-and-swap on the token sequence).
        approx: the recomputed KV still saw approximate tokens before start:
        the range stays FLAG_APPROX (age 0) instead of becoming exact."""
        fn_name = "kvr_client_refresh"
        self._fn(fn_name)
        cid = _b(ctx_id, "ctx_id")
        start = _u64(start, "start")
        if kv is None and k is None and v is None:
            raise TypeError("refresh needs the range's recomputed KV (kv=, or k= and v=)")
        if end is not None:
            end = _u64(end, "end")
            if end <= start:
                raise ValueError(f"empty or reversed token range [{start}, {end})")
            n = end - start
        else:
            n = None
        parts, dt, (L, n_kv, H, D) = T.as_kv_parts(kv, k, v, n if n is not None else -1, dtype,
                                                    check_tokens=n is not None)
        if end is None:
            end = start + n_kv
        a = _lib.kvr_refresh_args()
        a.ctx_id, a.start, a.end = cid, start, end
        if model is not None:
            m = self.model(_b(model, "model").decode())
            if (L, H, D) != (m.n_layers, m.n_kv_heads, m.head_dim):
                raise ValueError(f"KV shape (layers, kv_heads, head_dim) = {(L, H, D)} but model "
                                 f"{m.name!r} has {(m.n_layers, m.n_kv_heads, m.head_dim)}")
            a.model, a.fingerprint = m.name.encode(), m.fingerprint
        a.n_layers, a.n_kv_heads, a.head_dim, a.dtype = L, H, D, T.CODES[dt]
        _set_expect(a, expect)
        a.approx = bool(approx)
        keep = _set_payload(a, parts)
        out = _lib.kvr_edit_res()
        self._call(fn_name, byref(a), byref(out))
        del keep, parts
        return self._edit_result(out, [end - start])

    def stat_codec(self, ctx_id):
        """-> CodecInfo of a context: codec, window, bytes, bytes saved,
        bits per value, relative RMS error of K and V (kvr_client_stat)."""
        cc = _lib.kvr_context()
        self._call("kvr_client_stat", _b(ctx_id, "ctx_id"), byref(cc))
        return CodecInfo._from(cc)

    def stat_edit(self, ctx_id):
        """-> (n_pending, n_protected) of a context (kvr_client_stat)."""
        ed = _lib.kvr_context()
        self._call("kvr_client_stat", _b(ctx_id, "ctx_id"), byref(ed))
        return int(ed.n_pending), int(ed.n_protected)

    # -- position layouts: APE assemble, GPE groups, sinks + window retention

    def group_append(self, ctx_id, model, group, tokens, kv=None, *, k=None, v=None, dtype=None,
                     mode="upsert", pin=False, check_model=True, groups=None,
                     group_offsets=None):
        """Appends tokens to one position group of a grouped context (GPE):
        they take the group's next positions (cursor + phi), so interleaved
        streams (e.g. source and target of a simultaneous translation) each
        keep contiguous positions. To create the context, give all group
        names in `groups` (and optionally their offsets phi). -> PutResult
        (first_pos..last_pos: the positions given). kv as in put()."""
        self._fn("kvr_client_group_append")
        g = _b(group, "group")
        a, keep = self._put_args(ctx_id, model, tokens, kv, k, v, dtype, mode, None, None,
                                 pin, check_model, None, None, groups, group_offsets)
        out = _lib.kvr_put_res()
        self._call("kvr_client_group_append", byref(a), g, byref(out))
        del keep
        return PutResult(out.n_tokens, out.first_index, out.first_pos, out.last_pos)

    def assemble(self, prefix, documents, *, layout="parallel", starts=None, dtype="f32",
                 layers=None, temperature=None, scale=None, fold_temperature=False,
                 meta_only=False, out=None):
        """One KV stream: the prefix context, then each document context (put
        with prefix=<that prefix>), laid out "parallel" (APE: every document
        at P..), "sequential" (back to back; moved documents approximate) or
        "explicit" (document i at starts[i]); -> Assembly (kv: a KV of the
        whole stream; segments: the segment table; query_pos: where the
        worker's query tokens go; temperature / scale: APE's T and S, default
        0.9; temperature_folded). See docs/ape.md for the attention to apply."""
        self._fn("kvr_client_assemble")
        pf = _b(prefix, "prefix")
        if isinstance(documents, (str, bytes)) or not len(documents):
            raise ValueError("documents must be a non-empty list of context ids")
        docs = (ctypes.c_char_p * len(documents))(*[_b(d, "document") for d in documents])
        if layout not in _LAYOUTS:
            raise ValueError(f"layout must be one of {sorted(_LAYOUTS)}, got {layout!r}")
        st = None
        if layout == "explicit":
            if starts is None:
                raise ValueError("layout='explicit' needs starts (one per document)")
            st = positions_array(starts, len(documents), "starts")
        elif starts is not None:
            raise ValueError("starts are for layout='explicit'")
        dt = T.dtype_name(dtype)
        lay = self._layers(layers)
        for nm, x in (("temperature", temperature), ("scale", scale)):
            if x is not None and not (float(x) > 0):
                raise ValueError(f"{nm} must be > 0 (None = the daemon's default 0.9)")
        dst, cap = self._out_buf(out, dt)
        a = _lib.kvr_assemble_args()
        a.prefix, a.docs, a.n_docs = pf, ctypes.cast(docs, POINTER(ctypes.c_char_p)), len(documents)
        a.layout, a.starts, a.dtype = _LAYOUTS[layout], _ptr(st, c_int64), T.CODES[dt]
        a.layers, a.n_layers = _ptr(lay, c_uint32), 0 if lay is None else lay.size
        a.temperature = float(temperature) if temperature is not None else 0.0
        a.scale = float(scale) if scale is not None else 0.0
        a.fold_temperature, a.meta_only = bool(fold_temperature), bool(meta_only)
        a.dst, a.dst_cap = dst, cap
        r = _lib.kvr_assemble_res()
        self._call("kvr_client_assemble", byref(a), byref(r))
        try:
            segs = tuple(Segment._from(r.segments[i]) for i in range(r.n_segments))
            meta = (int(r.query_pos), float(r.temperature), float(r.scale),
                    bool(r.temperature_folded), int(r.prefix_len))
            kv = self._take(r.kv, out)       # releases (and zeroes) r.kv
        finally:
            self._lib.kvr_assemble_release(byref(r))
        return Assembly(kv, segs, *meta)

    def layout(self, ctx_id):
        """-> Layout of a context (APE prefix, groups, retention)."""
        r = _lib.kvr_layout_res()
        self._call("kvr_client_layout_stat", _b(ctx_id, "ctx_id"), byref(r))
        return Layout._from(r)

    def set_group_offset(self, ctx_id, group, offset):
        """Sets a group's position offset phi (later appends use it); -> Layout."""
        r = _lib.kvr_layout_res()
        self._call("kvr_client_set_group_offset", _b(ctx_id, "ctx_id"), _b(group, "group"),
                   _i64(offset, "offset"), byref(r))
        return Layout._from(r)

    def set_retention(self, ctx_id, sinks=0, window=0, off=False):
        """Keeps the first `sinks` and the last `window` tokens (after every
        put too; StreamingLLM); off=True removes the policy. -> Layout."""
        r = _lib.kvr_layout_res()
        self._call("kvr_client_set_retention", _b(ctx_id, "ctx_id"), _u64(sinks, "sinks"),
                   _u64(window, "window"), bool(off), byref(r))
        return Layout._from(r)


    def cover(self, model, tokens, *, min_run=None, get=False, pos_base=0, dtype="f32",
              layers=None, meta_only=False, out=None, shm=None):
        """Which cached runs make up `tokens` (a prompt of up to 131072 ids),
        found anywhere in it, not only as a prefix (docs/reuse.md); -> Cover
        (runs in prompt order, gaps: what the engine must compute).
        min_run: the shortest run worth placing (default 16; >= 1).
        get=True: also the runs' K/V in one stream (Cover.kv, tokens in prompt
        order, each key re-rotated to pos_base + its prompt offset; flags bit 0
        on every token of a run that is not exact); dtype, layers, meta_only,
        out and shm=Region or (Region, offset) as for get()."""
        mn = _b(model, "model")
        toks = tokens_array(tokens)
        if min_run is not None and (isinstance(min_run, bool) or
                                    not isinstance(min_run, (int, np.integer))):
            raise TypeError(f"min_run must be an int, got {type(min_run).__name__}")
        if min_run is not None and not 1 <= int(min_run) <= _lib.COVER_MAX_TOKENS:
            raise ValueError(f"min_run must be 1..{_lib.COVER_MAX_TOKENS}, got {min_run}")
        if not get and (out is not None or shm is not None or meta_only):
            raise ValueError("cover: out, shm and meta_only are for get=True")
        dt = T.dtype_name(dtype)
        lay = self._layers(layers)
        dst, cap = self._out_buf(out, dt)
        a = _lib.kvr_cover_args()
        a.model, a.tokens, a.n_tokens = mn, _ptr(toks, c_uint32), toks.size
        a.min_run = 0 if min_run is None else int(min_run)
        a.pos_base, a.dtype = _i64(pos_base, "pos_base"), T.CODES[dt]
        a.layers, a.n_layers = _ptr(lay, c_uint32), 0 if lay is None else lay.size
        a.meta_only, a.dst, a.dst_cap = bool(meta_only), dst, cap
        r = _lib.kvr_cover_res()
        reg = None
        if shm is not None:
            reg, place = _shm_out("cover", shm, out)
            self._call("kvr_client_cover_shm", byref(a), byref(place), byref(r))
        elif get:
            self._call("kvr_client_cover_get", byref(a), byref(r))
        else:
            self._call("kvr_client_cover", byref(a), byref(r))
        try:
            runs = tuple(CoverRun(int(x.prompt_off), x.ctx_id.decode(), int(x.ctx_off),
                                  int(x.n_tokens), int(x.n_approx), bool(x.exact),
                                  int(x.stream_off))
                         for x in (r.runs[i] for i in range(r.n_runs)))
            gaps = tuple((int(r.gaps[i].prompt_off), int(r.gaps[i].n_tokens))
                         for i in range(r.n_gaps))
            n_prompt, n_covered = int(r.n_prompt), int(r.n_covered)
            kv = self._take(r.kv, out, reg) if r.has_kv else None
        finally:
            self._lib.kvr_cover_release(byref(r))
        return Cover(n_prompt, n_covered, runs, gaps, kv)


_LAYOUTS = {"parallel": _lib.LAYOUT_PARALLEL, "sequential": _lib.LAYOUT_SEQUENTIAL,
            "explicit": _lib.LAYOUT_EXPLICIT}
SEGMENT_KINDS = {_lib.SEGMENT_PREFIX: "prefix", _lib.SEGMENT_DOCUMENT: "document",
                 _lib.SEGMENT_QUERY: "query"}


@dataclass(frozen=True)
class Segment:
    kind: str              # "prefix" | "document" | "query"
    start: int             # token range [start, start + n_tokens) of the stream
    n_tokens: int
    pos_first: int         # positions of its keys (query: the query position)
    pos_last: int
    doc_index: int
    ctx_id: str            # "" for the query
    temperature: float     # APE T (1 outside documents)
    scale: float           # APE S (1 outside documents)

    end = property(lambda self: self.start + self.n_tokens)

    @classmethod
    def _from(cls, s):
        return cls(SEGMENT_KINDS.get(s.kind, str(s.kind)), int(s.start), int(s.n_tokens),
                   int(s.pos_first), int(s.pos_last), int(s.doc_index), s.ctx_id.decode(),
                   float(s.temperature), float(s.scale))


@dataclass
class Assembly:
    kv: KV                   # the stream: prefix, documents (tokens, positions, flags, K/V)
    segments: tuple          # Segment per prefix / document / query
    query_pos: int           # the worker's first query token goes here
    temperature: float
    scale: float
    temperature_folded: bool # document keys came as k / T
    prefix_len: int

    def document_mask(self):
        """bool [n_tokens]: True for document (APE "context") tokens."""
        m = np.zeros(self.kv.n_tokens, dtype=bool)
        for s in self.segments:
            if s.kind == "document":
                m[s.start:s.end] = True
        return m


@dataclass(frozen=True)
class CoverRun:
    prompt_off: int        # prompt tokens [prompt_off, end) ...
    ctx_id: str
    ctx_off: int           # ... are the context's [ctx_off, ctx_off + n_tokens)
    n_tokens: int
    n_approx: int          # of them approximate in the context
    exact: bool            # at its context's own place after the same text
    stream_off: int        # get: its first token in Cover.kv

    end = property(lambda self: self.prompt_off + self.n_tokens)


@dataclass
class Cover:
    n_prompt: int
    n_covered: int
    runs: tuple            # CoverRun, in prompt order
    gaps: tuple            # (prompt_off, n_tokens) the engine computes
    kv: Optional["KV"] = None   # get=True: the runs' K/V, placed

    def placed(self):
        """int64 [n_covered]: the prompt offset of each token of kv's stream."""
        out = np.empty(self.n_covered, dtype=np.int64)
        for r in self.runs:
            out[r.stream_off:r.stream_off + r.n_tokens] = np.arange(r.prompt_off, r.end)
        return out


@dataclass(frozen=True)
class Group:
    name: str
    id: int
    offset: int      # phi
    cursor: int      # tokens ever appended
    n_tokens: int    # of them in the context now


@dataclass(frozen=True)
class Layout:
    prefix_ctx: Optional[str]
    prefix_len: int
    groups: tuple
    retention: bool
    sinks: int
    window: int
    n_dropped: int
    v_trans: bool = False   # created from a transposed V cache (put's v_trans)

    @classmethod
    def _from(cls, r):
        gs = tuple(Group(g.name.decode(), int(g.id), int(g.offset), int(g.cursor),
                         int(g.n_tokens)) for g in r.groups[:r.n_groups])
        return cls(r.prefix_ctx.decode() if r.has_prefix else None, int(r.prefix_len), gs,
                   bool(r.retention), int(r.sinks), int(r.window), int(r.n_dropped),
                   bool(r.v_trans))


def _set_payload(a, parts):
    """Points a's payload (or iov list) at parts; returns what must stay alive."""
    if len(parts) == 1:
        a.payload, a.payload_len = parts[0].ctypes.data, parts[0].nbytes
        return None
    iov = (_lib.iovec * len(parts))()
    for i, p in enumerate(parts):
        iov[i].iov_base, iov[i].iov_len = p.ctypes.data, p.nbytes
    a.iov, a.iovcnt = ctypes.cast(iov, POINTER(_lib.iovec)), len(parts)
    return iov


TOKENS_HASH_INIT = 1469598103934665603


def tokens_hash(tokens):
    """kvr_tokens_hash (base/types.h): FNV-1a 64 over the ids' little-endian
    bytes; what an edit's or refresh's `expect` sends."""
    t = np.ascontiguousarray(np.asarray(tokens, dtype="<u4"))
    h = TOKENS_HASH_INIT
    for byte in t.tobytes():
        h = ((h ^ byte) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return h


def _set_expect(a, expect):
    if expect is None:
        return
    t = np.asarray(expect)
    if t.ndim != 1:
        raise ValueError("expect: a 1-D sequence of token ids")
    a.expect, a.expect_n_tokens, a.expect_hash = True, int(t.size), tokens_hash(t)


def _edit_ops(ops):
    """[(start, end, uint32 tokens, approx)] from ops given as (start, end,
    tokens[, approx]) tuples or {"start", "end", "tokens"[, "approx"]} dicts
    (approx: the new tokens' KV was computed against approximate tokens, so
    the daemon stores them FLAG_APPROX). Types only: the daemon judges order,
    overlap and ranges (and refuses the whole request)."""
    if isinstance(ops, dict) or (isinstance(ops, tuple) and len(ops) == 3
                                 and isinstance(ops[0], (int, np.integer))):
        ops = [ops]                      # one op given bare
    if not isinstance(ops, (list, tuple)) or not ops:
        raise ValueError("ops must be a non-empty list of (start, end, new_tokens)")
    out = []
    for i, op in enumerate(ops):
        if isinstance(op, dict):
            try:
                s, e, t = op["start"], op["end"], op.get("tokens", ())
                apx = bool(op.get("approx", False))
            except KeyError as ex:
                raise ValueError(f"op {i}: missing {ex.args[0]!r}") from None
        elif isinstance(op, (tuple, list)) and len(op) in (3, 4):
            s, e, t = op[:3]
            apx = bool(op[3]) if len(op) == 4 else False
        else:
            raise TypeError(f"op {i} must be (start, end, new_tokens[, approx]), got {op!r}")
        s, e = _u64(s, f"op {i} start"), _u64(e, f"op {i} end")
        if e < s:
            raise ValueError(f"op {i}: end {e} < start {s}")
        out.append((s, e, tokens_array(t if t is not None else (), f"op {i} tokens"), apx))
    return out


FLAG_PENDING = 0x2


@dataclass(frozen=True)
class EditSpan:
    index: int            # index of the op's first new token after the edit
    first_pos: int        # their positions: first_pos, first_pos + 1, ...
    shift: int            # position change of the old tokens after the op
    n_tokens: Optional[int] = None   # the op's new tokens (known from the request)

    @property
    def positions(self):
        return np.arange(self.first_pos, self.first_pos + (self.n_tokens or 0), dtype=np.int64)

    @property
    def indices(self):
        return np.arange(self.index, self.index + (self.n_tokens or 0), dtype=np.int64)


@dataclass(frozen=True)
class EditResult:
    n_tokens: int          # context length after
    n_new: int
    n_removed: int
    first_change: int      # index of the first edit point
    n_approximate: int     # of the whole context
    n_pending: int
    payload_bytes: int     # KV bytes moved (plan: to send with KV, in the model's dtype)
    spans: tuple           # EditSpan per op, request order

    @property
    def positions(self):
        """Positions of all new tokens, request order (where to compute their K)."""
        ps = [s.positions for s in self.spans]
        return np.concatenate(ps) if ps else np.empty(0, np.int64)

    @property
    def indices(self):
        ps = [s.indices for s in self.spans]
        return np.concatenate(ps) if ps else np.empty(0, np.int64)
