"""Dtypes, shapes and the layer-major layout, on the Python side.

Convention (one, used everywhere in the package):

  A KV block of T tokens is ONE array of shape [n_layers, 2, T, n_kv_heads, head_dim]
  ("stacked"): index 0 of the second axis is K, 1 is V. A C-contiguous stacked
  array is byte for byte the wire payload (layer-major; per layer K then V,
  each [T][heads][dim]), so it is sent and received without a copy.

  put() also accepts, for convenience, and converts without stacking (each
  part becomes one iovec entry):
    - a sequence of n_layers (K, V) pairs, each [T, kv_heads, head_dim]
      (examples/llama.py's kv list; KV.pairs() gives it back);
    - k=K, v=V, each [n_layers, T, kv_heads, head_dim].

Dtypes: "f32", "f16", "bf16" (aliases: float32, float16, bfloat16, and numpy /
torch dtypes). numpy has no bfloat16, so bf16 data in numpy is a uint16 array
of the raw bit patterns, which put() accepts only with dtype="bf16" given
explicitly. put(dtype=...) converts float32/float16/uint16(bf16)/float64
sources to the requested wire dtype with libkvrope's kvr_convert
(round-to-nearest-even, the daemon's own kernel); float64 must be asked for
explicitly (dtype=...), it is never narrowed silently. Results come back as
float32 / float16 / uint16 (bf16) numpy arrays; KV.to_float32() widens
exactly and KV.to_torch() gives torch.bfloat16 for bf16.
"""

import ctypes

import numpy as np

from . import _lib

import importlib.util
import sys

# torch is optional and slow to import: never import it for numpy users. A
# tensor can only exist once the caller imported torch, so the checks below
# look in sys.modules; to_torch() imports it on demand.
HAVE_TORCH = importlib.util.find_spec("torch") is not None


def _torch():
    return sys.modules.get("torch")


CODES = {"f32": _lib.DTYPE_F32, "f16": _lib.DTYPE_F16, "bf16": _lib.DTYPE_BF16}
NAMES = {v: k for k, v in CODES.items()}
NUMPY = {"f32": np.dtype("<f4"), "f16": np.dtype("<f2"), "bf16": np.dtype("<u2")}
SIZE = {"f32": 4, "f16": 2, "bf16": 2}
_ALIASES = {"f32": "f32", "float32": "f32", "float": "f32", "fp32": "f32",
            "f16": "f16", "float16": "f16", "half": "f16", "fp16": "f16",
            "bf16": "bf16", "bfloat16": "bf16"}


def dtype_name(d):
    """'f32' | 'f16' | 'bf16' for a name, a libkvrope code, a numpy float32/
    float16 dtype or a torch dtype. uint16 is NOT accepted here (it is only
    the container of bf16 bits). Raises ValueError / TypeError."""
    if isinstance(d, str):
        try:
            return _ALIASES[d.lower()]
        except KeyError:
            raise ValueError(f"unknown dtype {d!r}; expected f32, f16 or bf16") from None
    if isinstance(d, (int, np.integer)) and not isinstance(d, bool):
        if int(d) in NAMES:
            return NAMES[int(d)]
        raise ValueError(f"unknown dtype code {d!r}")
    torch = _torch()
    if torch is not None and isinstance(d, torch.dtype):
        m = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
        if d in m:
            return m[d]
        raise TypeError(f"torch dtype {d} is not a KV dtype (float32, float16, bfloat16)")
    try:
        nd = np.dtype(d)
    except TypeError:
        raise TypeError(f"not a dtype: {d!r}") from None
    if nd == np.float32:
        return "f32"
    if nd == np.float16:
        return "f16"
    raise TypeError(f"numpy dtype {nd} is not a KV dtype; use float32, float16, or uint16 "
                    f"bit patterns with dtype='bf16'")


def is_tensor(x):
    torch = _torch()
    return torch is not None and isinstance(x, torch.Tensor)


def to_numpy(x, what):
    """(array, source dtype name or None for float64, 'u16' for raw uint16).
    torch tensors are detached and moved to the CPU; bfloat16 tensors become
    their uint16 bit patterns (no conversion). Raises TypeError for anything
    that is not float32/float16/bfloat16(uint16)/float64."""
    if is_tensor(x):
        torch = _torch()
        t = x.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        if t.dtype == torch.bfloat16:
            return t.contiguous().view(torch.int16).numpy().view(np.uint16), "bf16"
        if t.dtype not in (torch.float32, torch.float16, torch.float64):
            raise TypeError(f"{what}: torch dtype {t.dtype} is not a KV dtype")
        x = t.numpy()
    if not isinstance(x, np.ndarray):
        if isinstance(x, (list, tuple)):
            raise TypeError(f"{what}: expected an array, got a {type(x).__name__} "
                            f"(wrap it with numpy.asarray(..., dtype=numpy.float32))")
        raise TypeError(f"{what}: expected a numpy array or torch tensor, got {type(x).__name__}")
    k = x.dtype
    if k.kind == "f" and k.itemsize == 4:
        src = "f32"
    elif k.kind == "f" and k.itemsize == 2:
        src = "f16"
    elif k.kind == "u" and k.itemsize == 2:
        src = "u16"
    elif k.kind == "f" and k.itemsize == 8:
        src = None
    else:
        raise TypeError(f"{what}: dtype {k} is not a KV dtype (float32, float16, "
                        f"uint16 bf16 bits with dtype='bf16', or float64 with an explicit dtype)")
    if k.byteorder == ">":
        x = x.astype(k.newbyteorder("<"))
    return x, src


def resolve_dtype(srcs, dtype):
    """Target wire dtype from the sources' dtypes and the dtype argument."""
    srcs = set(srcs)
    if len(srcs) > 1:
        raise TypeError(f"K/V parts have different dtypes: {sorted(map(str, srcs))}")
    src = srcs.pop() if srcs else "f32"
    if dtype is not None:
        want = dtype_name(dtype)
        if src == "u16" and want != "bf16":
            raise TypeError("uint16 arrays are bf16 bit patterns: pass dtype='bf16' "
                            "(or give float32 data to convert)")
        return src, want
    if src == "u16":
        raise TypeError("uint16 array: pass dtype='bf16' to send it as bfloat16 bit patterns")
    if src is None:
        raise TypeError("float64 array: pass dtype='f32'/'f16'/'bf16' explicitly "
                        "(kvrope does not narrow float64 silently)")
    return src, src


def convert(a, src, want):
    """Contiguous little-endian array of wire dtype `want` from `a` (source
    dtype `src`: f32/f16/bf16/u16(=bf16)/None(float64)). Returns a view when
    nothing needs changing."""
    if src == "u16":
        src = "bf16"
    if src is None:
        a, src = np.asarray(a, dtype=np.float32), "f32"
    if src == want:
        return np.ascontiguousarray(a, dtype=NUMPY[want])
    a = np.ascontiguousarray(a, dtype=NUMPY[src])
    out = np.empty(a.shape, dtype=NUMPY[want])
    _lib.load().kvr_convert(out.ctypes.data, CODES[want], a.ctypes.data, CODES[src], a.size)
    return out


def bf16_to_f32(bits):
    """uint16 bf16 bit patterns -> float32 (exact)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(a):
    """float32 -> uint16 bf16 bit patterns, round-to-nearest-even (libkvrope's kvr_convert)."""
    return convert(np.asarray(a, dtype=np.float32), "f32", "bf16")


def as_kv_parts(kv, k, v, n_tokens, dtype, check_tokens=True):
    """Normalises put()'s KV argument(s). Returns (parts, wire dtype name,
    (n_layers, T, heads, dim)); `parts` is either [one stacked contiguous
    array] or a list of 2*n_layers contiguous [T, H, D] arrays (K0, V0, K1, ...),
    all in the wire dtype. Raises ValueError / TypeError; sends nothing."""
    if kv is not None and (k is not None or v is not None):
        raise TypeError("give either kv or k= and v=, not both")
    if kv is None:
        if k is None or v is None:
            raise TypeError("put needs kv (stacked [L,2,T,H,D] or a list of (K, V)), or both k= and v=")
        ka, ks = to_numpy(k, "k")
        va, vs = to_numpy(v, "v")
        if ka.ndim != 4 or va.ndim != 4:
            raise ValueError(f"k and v must be [n_layers, tokens, kv_heads, head_dim]; got "
                             f"{ka.shape} and {va.shape}")
        if ka.shape != va.shape:
            raise ValueError(f"k {ka.shape} and v {va.shape} differ in shape")
        src, want = resolve_dtype([ks, vs], dtype)
        L, T, H, D = ka.shape
        parts = []
        for i in range(L):
            parts += [convert(ka[i], src, want), convert(va[i], src, want)]
        shape = (L, T, H, D)
    elif is_tensor(kv) or isinstance(kv, np.ndarray):
        a, src = to_numpy(kv, "kv")
        if a.ndim != 5 or a.shape[1] != 2:
            raise ValueError(f"kv must be [n_layers, 2, tokens, kv_heads, head_dim] (axis 1: K, V); "
                             f"got shape {a.shape}")
        src, want = resolve_dtype([src], dtype)
        L, _, T, H, D = a.shape
        parts = [convert(a, src, want)]
        shape = (L, T, H, D)
    elif isinstance(kv, (list, tuple)):
        if not kv:
            raise ValueError("kv is an empty list: expected one (K, V) pair per layer")
        arrs, srcs = [], []
        for i, pair in enumerate(kv):
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise TypeError(f"kv[{i}] must be a (K, V) pair")
            for name, x in zip("KV", pair):
                a, s = to_numpy(x, f"layer {i} {name}")
                if a.ndim != 3:
                    raise ValueError(f"layer {i} {name} must be [tokens, kv_heads, head_dim]; "
                                     f"got {a.shape}")
                if arrs and a.shape != arrs[0].shape:
                    raise ValueError(f"layer {i} {name} has shape {a.shape}, layer 0 K has "
                                     f"{arrs[0].shape}")
                arrs.append(a)
                srcs.append(s)
        src, want = resolve_dtype(srcs, dtype)
        parts = [convert(a, src, want) for a in arrs]
        T, H, D = arrs[0].shape
        shape = (len(kv), T, H, D)
    else:
        raise TypeError(f"kv: expected an array/tensor [L,2,T,H,D] or a list of (K, V) pairs, "
                        f"got {type(kv).__name__}")
    if check_tokens and shape[1] != n_tokens:
        raise ValueError(f"the KV holds {shape[1]} tokens but {n_tokens} token ids were given")
    if min(shape[0], shape[2], shape[3]) == 0:
        raise ValueError(f"empty KV shape (layers, tokens, heads, dim) = {shape}")
    return parts, want, shape


class _Free:
    """Owns a buffer malloc'ed by libkvrope; frees it when the last numpy view dies."""
    __slots__ = ("ptr",)

    def __init__(self, ptr):
        self.ptr = ptr

    def __del__(self):
        if self.ptr:
            _lib.load().kvr_client_free(self.ptr)
            self.ptr = None


def adopt(ptr, nbytes, dtype_name_):
    """A 1-D numpy array over libkvrope-owned memory that frees it with the array."""
    buf = (ctypes.c_uint8 * nbytes).from_address(ptr)
    buf._kvrope_owner = _Free(ptr)
    return np.frombuffer(buf, dtype=NUMPY[dtype_name_])


def view(ptr, n_elems, dtype_name_):
    """A borrowed 1-D view (no ownership) of n elements at ptr."""
    if not n_elems:
        return np.empty(0, dtype=NUMPY[dtype_name_])
    buf = (ctypes.c_uint8 * (n_elems * SIZE[dtype_name_])).from_address(ptr)
    return np.frombuffer(buf, dtype=NUMPY[dtype_name_])
