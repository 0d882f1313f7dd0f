#!/usr/bin/python3
"""A small, faithful Llama-architecture forward pass in numpy, for kvrope's
examples and tests (the daemon does not use it).

What it is: RMSNorm, grouped-query attention, rotary position embeddings
computed from an HF-shaped config dict exactly by the conventions of
transformers' modeling_rope_utils (default, linear, dynamic, yarn, longrope,
llama3, with their attention scaling), SwiGLU MLP, tied or untied lm head,
causal mask. Weights are seeded random float32; vocabulary 256 = bytes
(examples/tokenizer.py).

Invariants the code keeps (the same ones rope/rope.h states for the daemon):
  - Angles p * inv_freq[i] are computed in float64 (HF computes them in
    float32; we are closer to the true value, the formulas are the same).
  - K as returned (and as stored in a cache) is AFTER RoPE, including the
    attention scaling factor (HF multiplies cos and sin by it, so q and k
    both carry it). apply = R(p) x * af, remove = R(-p) k / af,
    reposition = R(p' - p) k: a pure rotation, af is never re-applied.
  - Dimensions at index >= rotary_dim pass through unchanged (and unscaled).
  - Attention always consumes K/V rounded to float32, the cache's
    representation, so a forward that continues from a cached `past` computes
    exactly what a full forward computes (up to summation order; internal
    arithmetic is float64).
  - Same config + same seed -> same weights -> same logits. Each weight tensor
    has its own seed derived from (seed, name), so layer i's weights do not
    depend on how many layers the model has or on the RoPE family.

Pairing styles: "neox" (HF rotate_half, ggml NEOX), rot=8 --> [ccccssss],
pairs (i, i + rot/2); "gptj" (interleaved, ggml NORMAL), rot=8 -->
[cscscscs], pairs (2i, 2i+1). Pair i rotates by p * inv_freq[i] in both.

Shapes: token sequences are 1-D; per-token tensors are [tokens][heads][dim].
A kv list has one (K, V) tuple per layer, each [tokens][kv_heads][head_dim].

API (all arrays numpy):
  make_config(rope="default"|family|rope_scaling dict, style="neox"|"gptj", **shape) -> dict
  write_config(path, config=None, **kw) -> path;  load_config(path) -> dict
  rope_parameters(config, seq_len=None) -> (inv_freq, attention_factor)
  Rope(config, style=None): .apply(x, pos) .remove(k, pos) .reposition(k, from, to)
  LlamaModel(config, seed=0, weights=None): .forward(tokens, positions=None, past=None) -> (logits, kv)
      .apply_rope / .remove_rope / .reposition / .reposition_kv / .pre_rope_keys
  load_model(dir) -> LlamaModel with trained weights (config.json + weights.npz)
  attention(q, k, v, mask=None, bias=None, logit_scale=None) -> out
  kv_to_payload(kv, dtype) -> bytes;  payload_to_kv(buf, n_layers, n_tokens, kv_heads,
      head_dim, dtype) -> kv;  f32_to_bf16 / bf16_to_f32;  kv_concat / kv_slice
  encode(text) / decode(ids): the byte tokenizer (examples/tokenizer.py)

Dynamic NTK and longrope pick their frequency table from a sequence length.
HF takes it as max(position_ids) + 1 of the current call (dynamic also keeps
a grow-only cache of it across calls); here it is stateless: `seq_len`, if
given, else max(positions) + 1 of the call. Such keys do not compose:
reposition() removes with the old table and applies the new one.
"""

import json
import math
import os
import zlib

import numpy as np

try:  # the tokenizer lives next to this file; re-export it for convenience
    from tokenizer import encode, decode, ByteTokenizer  # noqa: F401
except ImportError:  # pragma: no cover - imported as examples.llama
    from .tokenizer import encode, decode, ByteTokenizer  # noqa: F401

STYLES = ("neox", "gptj")
ROPE_FAMILIES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
COMPOSING = frozenset(("default", "linear", "yarn", "llama3"))

# The presets keep their "original" context short so that tests can cross it
# with a few dozen tokens.
ORIGINAL_CONTEXT = 64


# ---- configuration ---------------------------------------------------------

def _longrope_factors(n):
    short = [round(1.0 + 0.1 * i / max(n - 1, 1), 6) for i in range(n)]
    long = [round(1.0 + 15.0 * (i / max(n - 1, 1)) ** 2, 6) for i in range(n)]
    return short, long


def make_config(rope="default", style="neox", *, hidden_size=128, intermediate_size=256,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=32, vocab_size=256, rms_norm_eps=1e-5, rope_theta=10000.0,
                max_position_embeddings=None, tie_word_embeddings=False,
                partial_rotary_factor=None, original_context=ORIGINAL_CONTEXT, **extra):
    """Returns an HF-shaped Llama config.json dict.

    rope: a family name from ROPE_FAMILIES (a preset with a short original
    context), a full `rope_scaling` dict, or None (= "default").
    style: "neox" or "gptj". HF Llama has no interleaved option; the style is
    recorded in the non-HF key "rope_style" (HF ignores unknown keys); give it
    to the daemon as RegisterModel.style. `extra` keys are added verbatim
    (e.g. {"rope_scaling": ...} overrides, "attention_factor" via a dict).
    """
    if style not in STYLES:
        raise ValueError(f"style must be one of {STYLES}, got {style!r}")
    if num_attention_heads % num_key_value_heads:
        raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
    rot = int(head_dim * (partial_rotary_factor or 1.0))
    orig = int(original_context)
    top = {}
    if rope is None or rope == "default":
        scaling, max_pos = None, 4096
    elif isinstance(rope, dict):
        scaling, max_pos = dict(rope), 4096
    elif rope == "linear":
        scaling, max_pos = {"rope_type": "linear", "factor": 4.0}, 4096
    elif rope == "dynamic":
        # Dynamic NTK's threshold is max_position_embeddings itself.
        scaling, max_pos = {"rope_type": "dynamic", "factor": 4.0}, orig
    elif rope == "yarn":
        scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": orig,
                   "beta_fast": 32.0, "beta_slow": 1.0}
        max_pos = 4 * orig   # factor 4 over the original context
    elif rope == "longrope":
        short, long = _longrope_factors(rot // 2)
        scaling = {"rope_type": "longrope", "short_factor": short, "long_factor": long}
        max_pos = 4 * orig
        top["original_max_position_embeddings"] = orig   # Phi-3 puts it at top level
    elif rope == "llama3":
        scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": orig}
        max_pos = 8 * orig
    else:
        raise ValueError(f"unknown RoPE family {rope!r}; expected one of {ROPE_FAMILIES} or a dict")
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(vocab_size),
        "hidden_size": int(hidden_size),
        "intermediate_size": int(intermediate_size),
        "num_hidden_layers": int(num_hidden_layers),
        "num_attention_heads": int(num_attention_heads),
        "num_key_value_heads": int(num_key_value_heads),
        "head_dim": int(head_dim),
        "hidden_act": "silu",
        "rms_norm_eps": float(rms_norm_eps),
        "rope_theta": float(rope_theta),
        "rope_scaling": scaling,
        "max_position_embeddings": int(max_position_embeddings or max_pos),
        "tie_word_embeddings": bool(tie_word_embeddings),
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
        "rope_style": style,
    }
    if partial_rotary_factor is not None:
        cfg["partial_rotary_factor"] = float(partial_rotary_factor)
    cfg.update(top)
    cfg.update(extra)
    return cfg


def write_config(path, config=None, **kw):
    """Writes config (or make_config(**kw)) as JSON. If path is a directory,
    writes path/config.json. Returns the file's path."""
    if config is None:
        config = make_config(**kw)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    with open(path, "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    return path


def load_config(path):
    """Reads a config.json (or a directory holding one) into a dict."""
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    with open(path) as f:
        return json.load(f)


def rope_style(config):
    """"neox" or "gptj" for a config: our "rope_style" key, else by model_type
    (the interleaved HF families), else neox."""
    s = config.get("rope_style")
    if s:
        if s not in STYLES:
            raise ValueError(f"rope_style must be one of {STYLES}, got {s!r}")
        return s
    if config.get("model_type") in ("gptj", "codegen", "chatglm", "glm"):
        return "gptj"
    return "neox"


def _rope_scaling(config):
    """The rope dict (transformers v4 `rope_scaling`, or v5 `rope_parameters`)."""
    rs = config.get("rope_scaling")
    if rs is None:
        rs = config.get("rope_parameters")
    return dict(rs) if rs else {}


def rope_type(config):
    rs = _rope_scaling(config)
    t = rs.get("rope_type", rs.get("type", "default"))   # BC: "type" was the old name
    if t not in ROPE_FAMILIES:
        raise ValueError(f"unsupported rope_type {t!r}")
    return t


def head_dim_of(config):
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def rotary_dim_of(config):
    """HF: int(head_dim * partial_rotary_factor); GPT-J style configs say rotary_dim."""
    hd = head_dim_of(config)
    if config.get("rotary_dim"):
        dim = int(config["rotary_dim"])
    else:
        prf = config.get("partial_rotary_factor", _rope_scaling(config).get("partial_rotary_factor", 1.0))
        dim = int(hd * prf)
    if dim <= 0 or dim % 2 or dim > hd:
        raise ValueError(f"rotary dim {dim} must be even and in (0, head_dim={hd}]")
    return dim


# ---- RoPE parameters, as transformers' modeling_rope_utils computes them ----

def _theta(config):
    return float(_rope_scaling(config).get("rope_theta", config.get("rope_theta", 10000.0)))


def _base_inv_freq(base, dim):
    return 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float64) / dim))


def rope_parameters(config, seq_len=None):
    """(inv_freq float64 [rotary_dim/2], attention_factor), following
    ROPE_INIT_FUNCTIONS[rope_type](config, device, seq_len)."""
    t = rope_type(config)
    rs = _rope_scaling(config)
    base = _theta(config)
    dim = rotary_dim_of(config)
    max_pos = int(config.get("max_position_embeddings", 2048))

    if t == "default":
        return _base_inv_freq(base, dim), 1.0

    if t == "linear":
        return _base_inv_freq(base, dim) / float(rs["factor"]), 1.0

    if t == "dynamic":
        factor = float(rs["factor"])
        sl = seq_len if seq_len is not None and seq_len > max_pos else max_pos
        base = base * ((factor * sl / max_pos) - (factor - 1)) ** (dim / (dim - 2))
        return _base_inv_freq(base, dim), 1.0

    if t == "yarn":
        factor = float(rs["factor"])
        attention_factor = rs.get("attention_factor")
        mscale = rs.get("mscale")
        mscale_all_dim = rs.get("mscale_all_dim")
        # The stated factor, as transformers computes it since PR #40320
        # (transformers issue #38224; older versions took max_pos / original when the
        # rope dict names original_max_position_embeddings) and as kvrope's
        # engine does.
        orig = int(rs.get("original_max_position_embeddings") or max_pos)

        def get_mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if attention_factor is None:
            if mscale and mscale_all_dim:
                attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
            else:
                attention_factor = get_mscale(factor)
        beta_fast = rs.get("beta_fast") or 32
        beta_slow = rs.get("beta_slow") or 1

        def correction_dim(n_rot):
            return (dim * math.log(orig / (n_rot * 2 * math.pi))) / (2 * math.log(base))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if rs.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001   # HF: prevent singularity
        ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
        extrapolation_factor = 1.0 - ramp
        pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
        inv_extra = 1.0 / pos_freqs
        inv_inter = 1.0 / (factor * pos_freqs)
        inv = inv_inter * (1 - extrapolation_factor) + inv_extra * extrapolation_factor
        return inv, float(attention_factor)

    if t == "longrope":
        long_factor = np.asarray(rs["long_factor"], dtype=np.float64)
        short_factor = np.asarray(rs["short_factor"], dtype=np.float64)
        if len(long_factor) != dim // 2 or len(short_factor) != dim // 2:
            raise ValueError(f"longrope short/long factors must have rotary_dim/2 = {dim // 2} entries")
        factor = rs.get("factor")
        attention_factor = rs.get("attention_factor")
        if "original_max_position_embeddings" in config:   # Phi-3
            orig = int(config["original_max_position_embeddings"])
            factor = max_pos / orig
        else:
            orig = max_pos
        if attention_factor is None:
            if factor is None or factor <= 1.0:
                attention_factor = 1.0
            else:
                attention_factor = math.sqrt(1 + math.log(factor) / math.log(orig))
        ext = long_factor if (seq_len and seq_len > orig) else short_factor
        return _base_inv_freq(base, dim) / ext, float(attention_factor)

    if t == "llama3":
        inv = _base_inv_freq(base, dim)
        factor = float(rs["factor"])
        low_ff = float(rs["low_freq_factor"])
        high_ff = float(rs["high_freq_factor"])
        old_len = float(rs["original_max_position_embeddings"])
        low_wl, high_wl = old_len / low_ff, old_len / high_ff
        wavelen = 2 * math.pi / inv
        inv_l = np.where(wavelen > low_wl, inv / factor, inv)
        smooth = (old_len / wavelen - low_ff) / (high_ff - low_ff)
        smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
        medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
        return np.where(medium, smoothed, inv_l), 1.0

    raise AssertionError(t)


def rope_threshold(config):
    """The length past which dynamic/longrope switch tables (None otherwise)."""
    t = rope_type(config)
    if t == "dynamic":
        return int(config["max_position_embeddings"])
    if t == "longrope":
        return int(config.get("original_max_position_embeddings", config["max_position_embeddings"]))
    return None


class Rope:
    """RoPE for one config: apply / remove / reposition on [T][H][head_dim]."""

    def __init__(self, config, style=None):
        self.config = dict(config)
        self.style = style or rope_style(config)
        if self.style not in STYLES:
            raise ValueError(f"style must be one of {STYLES}, got {self.style!r}")
        self.rope_type = rope_type(config)
        self.head_dim = head_dim_of(config)
        self.rotary_dim = rotary_dim_of(config)
        self.composes = self.rope_type in COMPOSING
        self.threshold = rope_threshold(config)
        self._static = None if not self.composes else rope_parameters(config)

    def table(self, seq_len=None):
        """(inv_freq float64 [rotary_dim/2], attention_factor) for seq_len."""
        if self._static is not None:
            return self._static
        return rope_parameters(self.config, seq_len)

    def _rotate(self, x, angles, mul):
        x = np.asarray(x)
        out_dtype = x.dtype if np.issubdtype(x.dtype, np.floating) else np.float64
        if x.shape[-1] != self.head_dim:
            raise ValueError(f"last dim {x.shape[-1]} != head_dim {self.head_dim}")
        y = np.array(x, dtype=np.float64)
        # angles [T, rot/2] -> broadcast over the heads axis
        c = np.cos(angles)[:, None, :]
        s = np.sin(angles)[:, None, :]
        rot = self.rotary_dim
        if self.style == "neox":
            half = rot // 2
            x1, x2 = y[..., :half].copy(), y[..., half:rot].copy()
            y[..., :half] = (x1 * c - x2 * s) * mul
            y[..., half:rot] = (x2 * c + x1 * s) * mul
        else:
            x1, x2 = y[..., 0:rot:2].copy(), y[..., 1:rot:2].copy()
            y[..., 0:rot:2] = (x1 * c - x2 * s) * mul
            y[..., 1:rot:2] = (x2 * c + x1 * s) * mul
        return y.astype(out_dtype, copy=False)

    @staticmethod
    def _positions(positions, n):
        p = np.asarray(positions, dtype=np.int64).reshape(-1)
        if p.shape[0] != n:
            raise ValueError(f"{p.shape[0]} positions for {n} tokens")
        return p

    def _default_seq_len(self, p, seq_len):
        if seq_len is not None:
            return int(seq_len)
        return int(p.max()) + 1 if p.size else None

    def apply(self, x, positions, seq_len=None):
        """R(p) x * attention_factor (x un-rotated, [T][H][D] or [T][D])."""
        x, squeeze = _as3(x)
        p = self._positions(positions, x.shape[0])
        inv, af = self.table(self._default_seq_len(p, seq_len))
        return _unsq(self._rotate(x, p[:, None].astype(np.float64) * inv[None, :], af), squeeze)

    def remove(self, k, positions, seq_len=None):
        """R(-p) k / attention_factor (k rotated at p)."""
        k, squeeze = _as3(k)
        p = self._positions(positions, k.shape[0])
        inv, af = self.table(self._default_seq_len(p, seq_len))
        return _unsq(self._rotate(k, -(p[:, None].astype(np.float64) * inv[None, :]), 1.0 / af), squeeze)

    def reposition(self, k, pos_from, pos_to, seq_len_from=None, seq_len_to=None):
        """Moves keys rotated at pos_from to pos_to. Composing families: one
        pure rotation by (to - from), the integer delta taken exactly.
        Dynamic/longrope: remove with the table of seq_len_from, apply with
        the one of seq_len_to (each defaults to max(positions) + 1)."""
        k, squeeze = _as3(k)
        a = self._positions(pos_from, k.shape[0])
        b = self._positions(pos_to, k.shape[0])
        if self.composes:
            inv, _ = self.table()
            d = (b - a).astype(np.float64)
            return _unsq(self._rotate(k, d[:, None] * inv[None, :], 1.0), squeeze)
        raw = self.remove(k, a, seq_len_from)
        return _unsq(self.apply(raw, b, seq_len_to), squeeze)


def _as3(x):
    x = np.asarray(x)
    if x.ndim == 2:
        return x[:, None, :], True
    if x.ndim != 3:
        raise ValueError(f"expected [tokens][heads][dim] (or [tokens][dim]), got shape {x.shape}")
    return x, False


def _unsq(x, squeeze):
    return x[:, 0, :] if squeeze else x


def apply_rope(x, positions, config, style=None, seq_len=None):
    return Rope(config, style).apply(x, positions, seq_len)


def remove_rope(k, positions, config, style=None, seq_len=None):
    return Rope(config, style).remove(k, positions, seq_len)


def reposition_rope(k, pos_from, pos_to, config, style=None, seq_len_from=None, seq_len_to=None):
    return Rope(config, style).reposition(k, pos_from, pos_to, seq_len_from, seq_len_to)


# ---- attention ---------------------------------------------------------------

def causal_mask(n_past, n_new):
    """bool [n_new][n_past + n_new]: new token i sees every cached token and
    new tokens 0..i. Causality follows sequence order, not position values,
    so it stays right for re-positioned or parallel-encoded caches."""
    j = np.arange(n_past + n_new)[None, :]
    i = np.arange(n_new)[:, None]
    return j <= n_past + i


def attention(q, k, v, mask=None, bias=None, logit_scale=None, scale=None, return_weights=False):
    """Grouped-query attention for one sequence.

    q [Tq][H][D]; k, v [Tk][KVH][D], H a multiple of KVH. Query head h reads
    kv head h // (H / KVH) (HF repeat_kv order). Logits are
        (q . k) * scale * logit_scale[key] + bias,  then masked,
    scale defaulting to D ** -0.5. Hooks for position-aware variants (APE
    temperature, segment scaling):
      logit_scale: [Tk] or [H][Tk], multiplies a key's logit (1/T = temperature)
      bias:        [Tq][Tk] or [H][Tq][Tk], added (e.g. log S on a block)
      mask:        bool [Tq][Tk] or [H][Tq][Tk], True = may attend.
    Returns out [Tq][H][D] (float64), and the weights [H][Tq][Tk] if asked.
    """
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    tq, h, d = q.shape
    tk, kvh, _ = k.shape
    if h % kvh:
        raise ValueError(f"{h} query heads are not a multiple of {kvh} kv heads")
    rep = h // kvh
    qg = q.reshape(tq, kvh, rep, d)
    logits = np.einsum("qgrd,kgd->grqk", qg, k).reshape(h, tq, tk)
    logits *= (d ** -0.5) if scale is None else scale
    if logit_scale is not None:
        ls = np.asarray(logit_scale, dtype=np.float64)
        logits = logits * (ls[None, None, :] if ls.ndim == 1 else ls[:, None, :])
    if bias is not None:
        logits = logits + np.asarray(bias, dtype=np.float64)
    if mask is not None:
        logits = np.where(np.asarray(mask, dtype=bool), logits, -np.inf)
    m = logits.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(logits - m)
    den = e.sum(axis=-1, keepdims=True)
    w = e / np.where(den > 0, den, 1.0)        # a fully masked row gives zeros
    out = np.einsum("grqk,kgd->qgrd", w.reshape(kvh, rep, tq, tk), v).reshape(tq, h, d)
    return (out, w) if return_weights else out


# ---- the model -----------------------------------------------------------------

def _rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _silu(x):
    return x / (1.0 + np.exp(-x))


def init_weights(config, seed=0):
    """Seeded float32 weights with HF names and shapes ([out, in])."""
    hs = config["hidden_size"]
    inter = config["intermediate_size"]
    nh, nkv = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    hd = head_dim_of(config)
    vocab = config["vocab_size"]

    def rnd(name, shape, std, mean=0.0):
        rng = np.random.default_rng([int(seed) & 0xFFFFFFFF, zlib.crc32(name.encode())])
        return (mean + std * rng.standard_normal(shape)).astype(np.float32)

    w = {"model.embed_tokens.weight": rnd("embed", (vocab, hs), 1.0)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        # q/k a little larger than 1/sqrt(fan_in) so attention is not uniform
        # and positions visibly matter.
        w[p + "self_attn.q_proj.weight"] = rnd(p + "q", (nh * hd, hs), 1.5 / math.sqrt(hs))
        w[p + "self_attn.k_proj.weight"] = rnd(p + "k", (nkv * hd, hs), 1.5 / math.sqrt(hs))
        w[p + "self_attn.v_proj.weight"] = rnd(p + "v", (nkv * hd, hs), 1.0 / math.sqrt(hs))
        w[p + "self_attn.o_proj.weight"] = rnd(p + "o", (hs, nh * hd), 1.0 / math.sqrt(nh * hd))
        w[p + "mlp.gate_proj.weight"] = rnd(p + "gate", (inter, hs), 1.0 / math.sqrt(hs))
        w[p + "mlp.up_proj.weight"] = rnd(p + "up", (inter, hs), 1.0 / math.sqrt(hs))
        w[p + "mlp.down_proj.weight"] = rnd(p + "down", (hs, inter), 1.0 / math.sqrt(inter))
        w[p + "input_layernorm.weight"] = rnd(p + "ln1", (hs,), 0.1, 1.0)
        w[p + "post_attention_layernorm.weight"] = rnd(p + "ln2", (hs,), 0.1, 1.0)
    w["model.norm.weight"] = rnd("norm", (hs,), 0.1, 1.0)
    if not config.get("tie_word_embeddings", False):
        w["lm_head.weight"] = rnd("lm_head", (vocab, hs), 1.0 / math.sqrt(hs))
    return w


def init_weights_shapes(config):
    """{HF tensor name: shape} of a config's weights."""
    hs, inter = config["hidden_size"], config["intermediate_size"]
    nh = config["num_attention_heads"]
    nkv = config.get("num_key_value_heads", nh)
    hd, vocab = head_dim_of(config), config["vocab_size"]
    w = {"model.embed_tokens.weight": (vocab, hs), "model.norm.weight": (hs,)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w.update({p + "self_attn.q_proj.weight": (nh * hd, hs), p + "self_attn.k_proj.weight": (nkv * hd, hs),
                  p + "self_attn.v_proj.weight": (nkv * hd, hs), p + "self_attn.o_proj.weight": (hs, nh * hd),
                  p + "mlp.gate_proj.weight": (inter, hs), p + "mlp.up_proj.weight": (inter, hs),
                  p + "mlp.down_proj.weight": (hs, inter), p + "input_layernorm.weight": (hs,),
                  p + "post_attention_layernorm.weight": (hs,)})
    if not config.get("tie_word_embeddings", False):
        w["lm_head.weight"] = (vocab, hs)
    return w


def load_model(path):
    """A trained model from a directory holding config.json and weights.npz
    (HF names, any float dtype; eval/model is one) -> LlamaModel."""
    config = load_config(path)
    with np.load(os.path.join(path, "weights.npz")) as z:
        weights = {k: z[k] for k in z.files}
    return LlamaModel(config, weights=weights)


class LlamaModel:
    """model = LlamaModel(make_config("yarn"), seed=0)
    logits, kv = model.forward(tokens)                      # prefill
    logits, kv2 = model.forward([t], past=kv)               # decode one token
    kv_all = kv_concat(kv, kv2)

    `attend` is the per-layer attention hook (override it in a subclass, or
    assign a function with attention()'s signature to `model.attention`).
    """

    def __init__(self, config, seed=0, style=None, weights=None):
        self.config = dict(config)
        self.seed = seed
        self.rope = Rope(config, style)
        self.style = self.rope.style
        self.n_layers = int(config["num_hidden_layers"])
        self.n_heads = int(config["num_attention_heads"])
        self.n_kv_heads = int(config.get("num_key_value_heads", self.n_heads))
        self.head_dim = head_dim_of(config)
        self.hidden_size = int(config["hidden_size"])
        self.vocab_size = int(config["vocab_size"])
        self.eps = float(config.get("rms_norm_eps", 1e-6))
        if self.n_heads % self.n_kv_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if weights is None:
            self.weights = init_weights(config, seed)
        else:   # trained weights under HF names (load_model); every tensor must be there
            want = init_weights_shapes(config)
            missing = sorted(set(want) - set(weights))
            if missing:
                raise ValueError(f"weights lack {missing[:3]}")
            for k, shp in want.items():
                if tuple(np.shape(weights[k])) != shp:
                    raise ValueError(f"{k}: shape {np.shape(weights[k])}, config says {shp}")
            self.weights = {k: np.asarray(weights[k], dtype=np.float32) for k in want}
        self._w = {k: v.astype(np.float64) for k, v in self.weights.items()}
        self._lm_head = self._w.get("lm_head.weight", self._w["model.embed_tokens.weight"])
        self.attention = attention

    # RoPE, bound to this model's config
    def apply_rope(self, x, positions, seq_len=None):
        return self.rope.apply(x, positions, seq_len)

    def remove_rope(self, k, positions, seq_len=None):
        return self.rope.remove(k, positions, seq_len)

    def reposition(self, k, pos_from, pos_to, seq_len_from=None, seq_len_to=None):
        return self.rope.reposition(k, pos_from, pos_to, seq_len_from, seq_len_to)

    def reposition_kv(self, kv, pos_from, pos_to, seq_len_from=None, seq_len_to=None):
        """Every layer's K moved from pos_from to pos_to (V is untouched), float32."""
        return [(self.reposition(k, pos_from, pos_to, seq_len_from, seq_len_to).astype(np.float32), v)
                for k, v in kv]

    def attend(self, layer, q, k, v, mask, bias=None, logit_scale=None):
        return self.attention(q, k, v, mask=mask, bias=bias, logit_scale=logit_scale)

    def forward(self, tokens, positions=None, past=None, *, seq_len=None, bias=None,
                logit_scale=None, return_pre_rope=False):
        """Runs the new `tokens` after the cached `past`.

        tokens: 1-D ids. positions: one int per new token (any values);
        default past_len + arange(T). past: per-layer (K, V), K already
        rotated, [P][kv_heads][head_dim] (any float dtype). seq_len: the
        dynamic/longrope table length (default max(positions) + 1).
        bias / logit_scale: passed to every layer's attention over the P + T
        keys (see attention()).
        Returns (logits float32 [T][vocab], kv) with kv the NEW tokens' (K, V)
        per layer, float32, K after RoPE; with return_pre_rope also the new
        tokens' pre-RoPE keys per layer (float32): (logits, kv, pre_k).
        """
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        t = tokens.shape[0]
        if t == 0:
            raise ValueError("forward needs at least one token")
        if tokens.min() < 0 or tokens.max() >= self.vocab_size:
            raise ValueError("token id out of range")
        if past is not None and len(past) != self.n_layers:
            raise ValueError(f"past has {len(past)} layers, model has {self.n_layers}")
        n_past = 0 if past is None else int(np.asarray(past[0][0]).shape[0])
        if positions is None:
            positions = n_past + np.arange(t, dtype=np.int64)
        positions = np.asarray(positions, dtype=np.int64).reshape(-1)
        if positions.shape[0] != t:
            raise ValueError(f"{positions.shape[0]} positions for {t} tokens")
        if seq_len is None:
            seq_len = int(positions.max()) + 1
        mask = causal_mask(n_past, t)
        h_, kvh, d = self.n_heads, self.n_kv_heads, self.head_dim
        w = self._w
        x = w["model.embed_tokens.weight"][tokens]
        kv, pre = [], []
        for i in range(self.n_layers):
            p = f"model.layers.{i}."
            hn = _rms_norm(x, w[p + "input_layernorm.weight"], self.eps)
            q = (hn @ w[p + "self_attn.q_proj.weight"].T).reshape(t, h_, d)
            k = (hn @ w[p + "self_attn.k_proj.weight"].T).reshape(t, kvh, d)
            v = (hn @ w[p + "self_attn.v_proj.weight"].T).reshape(t, kvh, d)
            if return_pre_rope:
                pre.append(k.astype(np.float32))
            q = self.rope.apply(q, positions, seq_len)
            k32 = self.rope.apply(k, positions, seq_len).astype(np.float32)
            v32 = v.astype(np.float32)
            kv.append((k32, v32))
            if past is not None:
                pk, pv = past[i]
                pk, pv = np.asarray(pk), np.asarray(pv)
                if pk.shape != (n_past, kvh, d) or pv.shape != (n_past, kvh, d):
                    raise ValueError(f"past layer {i}: K {pk.shape} / V {pv.shape}, "
                                     f"expected ({n_past}, {kvh}, {d})")
                k_all = np.concatenate([pk.astype(np.float64), k32.astype(np.float64)])
                v_all = np.concatenate([pv.astype(np.float64), v32.astype(np.float64)])
            else:
                k_all, v_all = k32.astype(np.float64), v32.astype(np.float64)
            a = self.attend(i, q, k_all, v_all, mask, bias=bias, logit_scale=logit_scale)
            x = x + a.reshape(t, h_ * d) @ w[p + "self_attn.o_proj.weight"].T
            hn = _rms_norm(x, w[p + "post_attention_layernorm.weight"], self.eps)
            g = _silu(hn @ w[p + "mlp.gate_proj.weight"].T) * (hn @ w[p + "mlp.up_proj.weight"].T)
            x = x + g @ w[p + "mlp.down_proj.weight"].T
        x = _rms_norm(x, w["model.norm.weight"], self.eps)
        logits = (x @ self._lm_head.T).astype(np.float32)
        if return_pre_rope:
            return logits, kv, pre
        return logits, kv

    __call__ = forward

    def pre_rope_keys(self, tokens, positions=None, past=None, seq_len=None):
        """The new tokens' keys before RoPE, per layer, [T][kv_heads][head_dim] float32."""
        return self.forward(tokens, positions, past, seq_len=seq_len, return_pre_rope=True)[2]

    def generate(self, tokens, n_new, past=None, positions=None):
        """Greedy decoding: returns (new token ids, kv of prompt + new tokens
        except the last generated one, which has not been run)."""
        logits, kv = self.forward(tokens, positions, past)
        cache = kv if past is None else kv_concat(past, kv)
        last_pos = int(np.asarray(positions)[-1]) if positions is not None else kv_len(cache) - 1
        out = []
        for _ in range(n_new):
            nxt = int(np.argmax(logits[-1]))
            out.append(nxt)
            if len(out) == n_new:
                break
            last_pos += 1
            logits, kv = self.forward([nxt], [last_pos], cache)
            cache = kv_concat(cache, kv)
        return out, cache


# ---- kv helpers ------------------------------------------------------------------

def kv_len(kv):
    return int(np.asarray(kv[0][0]).shape[0])


def kv_concat(*kvs):
    """Concatenates caches along tokens, layer by layer."""
    kvs = [kv for kv in kvs if kv is not None]
    return [(np.concatenate([np.asarray(kv[i][0]) for kv in kvs]),
             np.concatenate([np.asarray(kv[i][1]) for kv in kvs])) for i in range(len(kvs[0]))]


def kv_slice(kv, start, end=None):
    return [(k[start:end], v[start:end]) for k, v in kv]


# ---- seam repair (the engine half of "reuse anywhere"; C: client/llama/worker_repair.c) --

def parse_repair_policy(s):
    """"none", "all", "epic:K", "blend:SHARE[@LAYER]" (SHARE in (0, 1] or "N%"),
    joined by "+" -> dict(first_k, blend_share, blend_layer, all)."""
    o = {"first_k": 0, "blend_share": 0.0, "blend_layer": 1, "all": False}
    for part in (s or "none").split("+"):
        if part == "none":
            continue
        if part == "all":
            o["all"] = True
        elif part.startswith("epic:") and part[5:].isdigit():
            o["first_k"] = int(part[5:])
        elif part.startswith("blend:"):
            v, _, layer = part[6:].partition("@")
            share = float(v[:-1]) / 100 if v.endswith("%") else float(v)
            if not 0 < share <= 1 or (layer and (not layer.isdigit() or int(layer) < 1)):
                raise ValueError(f"repair policy {part!r}: SHARE in (0, 1], LAYER >= 1")
            o["blend_share"], o["blend_layer"] = share, int(layer or 1)
        else:
            raise ValueError(f"repair policy {part!r}: expected none, all, epic:K, blend:SHARE[@L]")
    return o


def repair_plan(placed, run_start=None, dev=None, first_k=0, blend_share=0.0, all=False, **_):
    """The repair set, exactly as kvr__wk_repair_plan. placed per token: 0 a
    gap, 1 placed approximate (a candidate), 2 placed exact (never repaired);
    booleans mean 0 / 1. Gaps always; with `all` every token; EPIC: the first
    first_k tokens of every placed run (runs begin where run_start says,
    default after every gap) that are candidates; CacheBlend: the
    ceil(share * candidates) candidates of largest dev (ties: the earlier
    token), counted apart from EPIC's. -> (compute bool [n], placed chosen)."""
    placed = np.asarray(placed).astype(np.int64)
    n = placed.size
    compute = placed == 0
    cand = placed == 1
    if all:
        return np.ones(n, bool), int((placed != 0).sum())
    chosen = 0
    if first_k:
        since = 0
        for i in range(n):
            if not placed[i]:
                since = 0
                continue
            starts = run_start[i] if run_start is not None else (i == 0 or not placed[i - 1])
            since = 1 if starts else since + 1
            if since <= first_k and cand[i] and not compute[i]:
                compute[i] = True
                chosen += 1
    n_cand = int(cand.sum())
    if blend_share > 0 and dev is not None and n_cand:
        budget = int(math.ceil(blend_share * n_cand - 1e-9))
        idx = np.flatnonzero(cand)
        d = np.nan_to_num(np.asarray(dev, np.float64)[idx], nan=np.inf)
        order = idx[np.lexsort((idx, -d))][:budget]
        for i in order:
            if not compute[i]:
                compute[i] = True
                chosen += 1
    return compute, chosen


def repair(model, tokens, kv, placed, run_start=None, policy="none"):
    """A prompt whose KV is placed where `placed` is non-zero (1 approximate,
    2 exact: never repaired; kv: per layer K, V
    [n][kv_heads][head_dim] at the prompt's positions 0..n-1, K rotated there;
    rows of gaps are ignored) repaired as the C engine does: gaps and the
    repair set recomputed in increasing position, each run of them seeing
    the cache before it (placed or already recomputed); the last token
    always. CacheBlend's deviation is taken at layer L against a full
    forward's K/V: the same numbers a probe that stops after layer L's
    projections gives (layer L's K/V depend only on layers < L), computed here
    with the whole forward for simplicity (the C engine stops the graph).
    -> (last token's logits [vocab], repaired kv, compute mask, stats)."""
    o = parse_repair_policy(policy) if isinstance(policy, str) else dict(policy)
    tokens = np.asarray(tokens, np.int64)
    n = tokens.size
    placed = np.asarray(placed).astype(np.int64)
    kv = [(np.array(k, np.float32), np.array(v, np.float32)) for k, v in kv]
    dev = None
    probed = 0
    if o["blend_share"] > 0 and not o["all"] and (placed == 1).any():
        L = o["blend_layer"]
        if L >= model.n_layers:
            raise ValueError(f"blend layer {L}: the model has {model.n_layers} layers")
        _, fresh = model.forward(tokens, positions=np.arange(n))
        fk, fv = fresh[L]
        pk, pv = kv[L]
        dev = (((fk.astype(np.float64) - pk) ** 2).sum((1, 2)) +
               ((fv.astype(np.float64) - pv) ** 2).sum((1, 2)))
        probed = n
    compute, chosen = repair_plan(placed, run_start, dev, **o)
    compute[n - 1] = True
    logits = None
    i = 0
    while i < n:
        if not compute[i]:
            i += 1
            continue
        j = i
        while j < n and compute[j]:
            j += 1
        past = [(k[:i], v[:i]) for k, v in kv] if i else None
        lg, new = model.forward(tokens[i:j], positions=np.arange(i, j), past=past)
        for li, (nk, nv) in enumerate(new):
            kv[li][0][i:j] = nk
            kv[li][1][i:j] = nv
        logits = lg[-1]
        i = j
    stats = {"prompt": n, "placed": int((placed != 0).sum()), "gaps": int((placed == 0).sum()),
             "repaired": chosen, "computed": int(compute.sum()), "probed": probed,
             "probe_layers": (o["blend_layer"] + 0.5) if probed else 0.0}
    return logits, kv, compute, stats


# ---- payload layout (the daemon's wire/storage order) ------------------------------

_DTYPE_NAMES = {"f32": "f32", "float32": "f32", "F32": "f32", 0: "f32",
                "f16": "f16", "float16": "f16", "F16": "f16", 1: "f16",
                "bf16": "bf16", "bfloat16": "bf16", "BF16": "bf16", 2: "bf16"}
DTYPE_SIZE = {"f32": 4, "f16": 2, "bf16": 2}


def dtype_name(dtype):
    try:
        return _DTYPE_NAMES[dtype]
    except (KeyError, TypeError):
        raise ValueError(f"unknown dtype {dtype!r}; expected f32, f16 or bf16") from None


def f32_to_bf16(a):
    """float32 array -> uint16 bf16 bits, round to nearest even; NaN stays NaN
    (quiet bit set), infinities are kept."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
    nan = np.isnan(np.asarray(a, dtype=np.float32))
    out = np.where(nan, ((u >> 16) | 0x0040) & 0xFFFF, rounded)
    return out.astype(np.uint16)


def bf16_to_f32(h):
    return (np.asarray(h, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def encode_tensor(a, dtype="f32"):
    """Array -> little-endian bytes in dtype (f32 / f16 RNE / bf16 RNE)."""
    dt = dtype_name(dtype)
    a = np.ascontiguousarray(a, dtype=np.float32)
    if dt == "f32":
        return a.astype("<f4").tobytes()
    if dt == "f16":
        return a.astype("<f2").tobytes()
    return f32_to_bf16(a).astype("<u2").tobytes()


def decode_tensor(buf, shape, dtype="f32"):
    """Little-endian bytes in dtype -> float32 array of shape."""
    dt = dtype_name(dtype)
    n = int(np.prod(shape))
    if len(buf) != n * DTYPE_SIZE[dt]:
        raise ValueError(f"{len(buf)} bytes for {n} {dt} elements")
    if dt == "f32":
        a = np.frombuffer(buf, dtype="<f4").astype(np.float32)
    elif dt == "f16":
        a = np.frombuffer(buf, dtype="<f2").astype(np.float32)
    else:
        a = bf16_to_f32(np.frombuffer(buf, dtype="<u2"))
    return a.reshape(shape)


def payload_size(n_layers, n_tokens, n_kv_heads, head_dim, dtype="f32"):
    return 2 * n_layers * n_tokens * n_kv_heads * head_dim * DTYPE_SIZE[dtype_name(dtype)]


def kv_to_payload(kv, dtype="f32"):
    """Per-layer (K, V) -> bytes: layer-major, for each layer K then V, each
    [tokens][kv_heads][head_dim] contiguous, little-endian dtype."""
    parts = []
    shape = None
    for i, (k, v) in enumerate(kv):
        for name, a in (("K", k), ("V", v)):
            a = np.asarray(a)
            if a.ndim != 3 or (shape is not None and a.shape != shape):
                raise ValueError(f"layer {i} {name} has shape {a.shape}, expected {shape or '3-D'}")
            shape = a.shape
            parts.append(encode_tensor(a, dtype))
    return b"".join(parts)


def payload_to_kv(buf, n_layers, n_tokens, n_kv_heads, head_dim, dtype="f32"):
    """Inverse of kv_to_payload; returns per-layer (K, V) float32 arrays."""
    dt = dtype_name(dtype)
    want = payload_size(n_layers, n_tokens, n_kv_heads, head_dim, dt)
    buf = bytes(buf) if not isinstance(buf, (bytes, memoryview)) else buf
    if len(buf) != want:
        raise ValueError(f"payload has {len(buf)} bytes, expected {want}")
    shape = (n_tokens, n_kv_heads, head_dim)
    step = want // (2 * n_layers) if n_layers else 0
    out = []
    for i in range(n_layers):
        o = 2 * i * step
        out.append((decode_tensor(buf[o:o + step], shape, dt),
                    decode_tensor(buf[o + step:o + 2 * step], shape, dt)))
    return out


def model_payload_to_kv(model, buf, n_tokens, dtype="f32"):
    return payload_to_kv(buf, model.n_layers, n_tokens, model.n_kv_heads, model.head_dim, dtype)


if __name__ == "__main__":   # a quick smoke run: python3 examples/llama.py [family]
    import sys
    fam = sys.argv[1] if len(sys.argv) > 1 else "default"
    m = LlamaModel(make_config(fam), seed=0)
    ids = encode("def add(a, b):\n    return a + b\n")
    lg, cache = m.forward(ids)
    print(f"{fam}: {len(ids)} tokens, {m.n_layers} layers, kv payload "
          f"{len(kv_to_payload(cache, 'f16'))} bytes (f16), next byte {int(np.argmax(lg[-1]))}")
