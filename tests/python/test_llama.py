#!/usr/bin/python3
"""Tests for examples/llama.py, the numpy Llama used by kvrope's examples.

Run: /usr/bin/python3 -m pytest -q tests/python/test_llama.py
The torch comparisons skip when torch is not importable.
"""
import json
import math
import os
import sys

import numpy as np
import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import llama as L  # noqa: E402
import tokenizer as T  # noqa: E402

FAMILIES = list(L.ROPE_FAMILIES)
COMPOSING = ["default", "linear", "yarn", "llama3"]
TEXT = "def area(r):\n    return 3.14159 * r * r\n\nprint(area(2))\n"


def model(fam="default", style="neox", seed=0, **kw):
    return L.LlamaModel(L.make_config(fam, style, **kw), seed=seed)


def rng(seed=1):
    return np.random.default_rng(seed)


# ---- config, determinism, tokenizer -----------------------------------------

def test_tokenizer_round_trip():
    s = "héllo → wörld\n\tok"
    ids = T.encode(s)
    assert all(0 <= i < 256 for i in ids) and len(ids) == len(s.encode())
    assert T.decode(ids) == s and L.decode(L.encode(s)) == s
    a, b = T.byte_span(s, 6, 7)          # the arrow is 3 bytes
    assert T.decode(ids[a:b]) == "→"
    with pytest.raises(ValueError):
        T.decode([256])


def test_determinism_and_seed():
    ids = T.encode(TEXT)
    l1, kv1 = model("yarn", seed=7).forward(ids)
    l2, kv2 = model("yarn", seed=7).forward(ids)
    l3, _ = model("yarn", seed=8).forward(ids)
    assert l1.dtype == np.float32 and np.array_equal(l1, l2)
    assert all(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) for a, b in zip(kv1, kv2))
    assert not np.allclose(l1, l3)
    # weights do not depend on the RoPE family or the layer count
    w2, w4 = model(num_hidden_layers=2).weights, model("llama3", num_hidden_layers=4).weights
    for k, v in w2.items():
        assert np.array_equal(v, w4[k]) and v.dtype == np.float32


@pytest.mark.parametrize("fam", FAMILIES)
def test_config_shape_and_write(tmp_path, fam):
    cfg = L.make_config(fam, "gptj", tie_word_embeddings=True, num_hidden_layers=3)
    path = L.write_config(str(tmp_path), cfg)
    assert path.endswith("config.json")
    back = L.load_config(path)
    assert back == json.loads(json.dumps(cfg)) and L.rope_style(back) == "gptj"
    assert L.rope_type(back) == fam
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "num_hidden_layers", "rope_theta", "rms_norm_eps", "max_position_embeddings"):
        assert key in back
    m = L.LlamaModel(back)
    assert "lm_head.weight" not in m.weights and m.n_layers == 3 and m.style == "gptj"
    assert 128 <= m.hidden_size <= 256 and 32 <= m.head_dim <= 64 and m.vocab_size == 256


def test_untied_head_differs_from_tied():
    ids = T.encode("abc")
    a, _ = model(tie_word_embeddings=False).forward(ids)
    b, _ = model(tie_word_embeddings=True).forward(ids)
    assert not np.allclose(a, b)


# ---- RoPE tables: HF formulas --------------------------------------------------

def test_inv_freq_known_values():
    base = L.rope_parameters(L.make_config("default"))[0]
    assert np.allclose(base, 10000.0 ** (-np.arange(0, 32, 2) / 32), rtol=0, atol=1e-15)
    lin, af = L.rope_parameters(L.make_config("linear"))
    assert af == 1.0 and np.allclose(lin, base / 4)
    y, af = L.rope_parameters(L.make_config("yarn"))
    assert af == pytest.approx(0.1 * math.log(4) + 1)
    assert y[0] == base[0] and np.allclose(y[-6:], base[-6:] / 4)   # extrapolate high, interpolate low
    y2, af2 = L.rope_parameters(L.make_config({"rope_type": "yarn", "factor": 4.0, "attention_factor": 1.25}))
    assert af2 == 1.25
    cfg = L.make_config({"rope_type": "yarn", "factor": 4.0, "mscale": 0.707, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 64}, max_position_embeddings=256)
    _, af3 = L.rope_parameters(cfg)
    assert af3 == pytest.approx((0.1 * 0.707 * math.log(4) + 1) / (0.1 * math.log(4) + 1))
    l3, af = L.rope_parameters(L.make_config("llama3"))
    wl = 2 * math.pi / base
    assert af == 1.0
    assert np.allclose(l3[wl < 16], base[wl < 16]) and np.allclose(l3[wl > 64], base[wl > 64] / 8)
    mid = (wl >= 16) & (wl <= 64)
    assert mid.any() and np.all((l3[mid] < base[mid]) & (l3[mid] > base[mid] / 8))
    lr_cfg = L.make_config("longrope")
    s, af_s = L.rope_parameters(lr_cfg, seq_len=10)
    lg, af_l = L.rope_parameters(lr_cfg, seq_len=65)
    rs = lr_cfg["rope_scaling"]
    assert np.allclose(s, base / np.array(rs["short_factor"])) and np.allclose(lg, base / np.array(rs["long_factor"]))
    assert af_s == af_l == pytest.approx(math.sqrt(1 + math.log(4) / math.log(64)))


def test_dynamic_and_longrope_tables_depend_on_length():
    for fam in ("dynamic", "longrope"):
        cfg = L.make_config(fam)
        thr = L.rope_threshold(cfg)
        assert thr == 64
        a = L.rope_parameters(cfg, seq_len=thr)[0]
        b = L.rope_parameters(cfg, seq_len=thr + 1)[0]
        c = L.rope_parameters(cfg, seq_len=4 * thr)[0]
        assert not np.allclose(a, b)
        if fam == "dynamic":
            assert np.allclose(a, L.rope_parameters(L.make_config("default"))[0])
            assert not np.allclose(b, c) and np.all(c[1:] < b[1:])   # base grows with length
        else:
            assert np.array_equal(b, c)                            # long table is one table
    r = L.Rope(L.make_config("dynamic"))
    assert not r.composes and L.Rope(L.make_config("yarn")).composes


# ---- RoPE kernels ----------------------------------------------------------------

@pytest.mark.parametrize("style", L.STYLES)
@pytest.mark.parametrize("fam", FAMILIES)
def test_apply_remove_round_trip(fam, style):
    r = L.Rope(L.make_config(fam, style, partial_rotary_factor=0.5 if style == "gptj" else None))
    x = rng().standard_normal((40, 3, 32))
    pos = rng(2).integers(0, 300, 40)
    k = r.apply(x, pos)
    assert k.dtype == np.float64 and not np.allclose(k, x)
    assert np.allclose(r.remove(k, pos), x, atol=1e-12)
    assert np.array_equal(k[..., r.rotary_dim:], x[..., r.rotary_dim:])   # pass-through dims
    # float32 in, float32 out
    k32 = r.apply(x.astype(np.float32), pos)
    assert k32.dtype == np.float32 and np.allclose(r.remove(k32, pos), x, atol=1e-5)
    # pair norms carry exactly the attention factor
    _, af = r.table(int(pos.max()) + 1)
    if style == "neox":
        half = r.rotary_dim // 2
        n0 = x[..., :half] ** 2 + x[..., half:r.rotary_dim] ** 2
        n1 = k[..., :half] ** 2 + k[..., half:r.rotary_dim] ** 2
    else:
        n0 = x[..., 0:r.rotary_dim:2] ** 2 + x[..., 1:r.rotary_dim:2] ** 2
        n1 = k[..., 0:r.rotary_dim:2] ** 2 + k[..., 1:r.rotary_dim:2] ** 2
    assert np.allclose(n1, n0 * af * af)


def test_pairing_layouts():
    """neox pairs (i, i+rot/2); gptj pairs (2i, 2i+1). A unit vector in dim 0
    rotated at position 1 moves into the partner dim only."""
    for style, partner in (("neox", 16), ("gptj", 1)):
        r = L.Rope(L.make_config("default", style))
        x = np.zeros((1, 1, 32))
        x[0, 0, 0] = 1.0
        k = r.apply(x, [1])[0, 0]
        assert k[0] == pytest.approx(math.cos(1.0)) and k[partner] == pytest.approx(math.sin(1.0))
        assert np.count_nonzero(np.abs(k) > 1e-15) == 2


@pytest.mark.parametrize("style", L.STYLES)
@pytest.mark.parametrize("fam", COMPOSING)
def test_reposition_composes(fam, style):
    r = L.Rope(L.make_config(fam, style))
    pre = rng(3).standard_normal((50, 2, 32))
    p_old = rng(4).integers(0, 200, 50)
    p_new = p_old + rng(5).integers(-150, 5000, 50)           # negative and large shifts
    k_old = r.apply(pre, p_old)
    k_new = r.reposition(k_old, p_old, p_new)
    assert np.allclose(k_new, r.apply(pre, p_new), atol=1e-10)
    # the attention factor is not re-applied: repeated shifts keep the norm
    k = k_old
    for _ in range(20):
        k = r.reposition(k, p_old, p_old + 7)
        k = r.reposition(k, p_old + 7, p_old)
    assert np.allclose(np.linalg.norm(k, axis=-1), np.linalg.norm(k_old, axis=-1), rtol=1e-12)
    assert np.allclose(k, k_old, atol=1e-10)


@pytest.mark.parametrize("fam", ["dynamic", "longrope"])
def test_reposition_non_composing(fam):
    """Across the threshold the table changes: a delta rotation with one table
    is wrong; remove-with-old then apply-with-new is right."""
    cfg = L.make_config(fam)
    r = L.Rope(cfg)
    pre = rng(6).standard_normal((10, 2, 32))
    p_old = np.arange(10) + 20                  # table of length 30 (short)
    p_new = p_old + 100                         # table of length 130 (long)
    k_old = r.apply(pre, p_old)                 # default seq_len = max + 1
    want = r.apply(pre, p_new)
    got = r.reposition(k_old, p_old, p_new)
    assert np.allclose(got, want, atol=1e-10)
    inv_short, _ = r.table(30)
    naive = L.Rope(L.make_config("default"))   # same formula, fixed table
    naive._static = (inv_short, r.table(30)[1])
    naive.composes = True
    assert not np.allclose(naive.reposition(k_old, p_old, p_new), want, atol=1e-3)
    # explicit table lengths
    k_long = r.apply(pre, p_old, seq_len=500)
    assert np.allclose(r.reposition(k_long, p_old, p_new, seq_len_from=500, seq_len_to=130), want, atol=1e-10)


def test_positions_are_double_precision():
    r = L.Rope(L.make_config("default"))
    x = rng(7).standard_normal((1, 1, 32))
    p = 10_000_000
    k = r.apply(x, [p])
    inv = r.table()[0]
    ang = p * inv[0]
    want0 = x[0, 0, 0] * math.cos(ang) - x[0, 0, 16] * math.sin(ang)
    assert k[0, 0, 0] == pytest.approx(want0, abs=1e-9)


# ---- ggml reference vectors (shared/vectors/rope) ------------------------------------

def _vectors_dir():
    d = os.environ.get("KVR_VECTORS") or os.path.join(ROOT, "..", "shared", "vectors")
    return os.path.join(d, "rope")


def _cases():
    man = os.path.join(_vectors_dir(), "manifest.json")
    if not os.path.exists(man):
        return []
    with open(man) as f:
        return json.load(f)["cases"]


@pytest.mark.parametrize("case", _cases() or [None], ids=lambda c: c["name"] if c else "absent")
def test_ggml_vectors(case):
    if case is None:
        pytest.skip("shared/vectors/rope not found (set KVR_VECTORS)")
    d = _vectors_dir()
    shape = (case["n_tokens"], case["n_heads"], case["head_dim"])

    def load(key, dt):
        return np.fromfile(os.path.join(d, case["files"][key]), dtype=dt)

    x, k_old, k_new = (load(k, "<f4").reshape(shape) for k in ("x", "k_old", "k_new"))
    p_old, p_new = load("pos_old", "<i4"), load("pos_new", "<i4")
    rs = case["rope_scaling"]
    cfg = {"hidden_size": case["head_dim"] * case["n_heads"], "num_attention_heads": case["n_heads"],
           "head_dim": case["head_dim"], "rotary_dim": case["rotary_dim"], "rope_theta": case["theta_base"],
           "rope_scaling": rs, "max_position_embeddings": 4096}
    if rs and "original_max_position_embeddings" in rs:
        cfg["max_position_embeddings"] = int(rs["original_max_position_embeddings"] * rs["factor"])
    r = L.Rope(cfg, case["style"])
    tol = case["tolerance_abs"]
    assert np.max(np.abs(r.apply(x, p_old) - k_old)) <= tol
    assert np.max(np.abs(r.apply(x, p_new) - k_new)) <= tol
    assert np.max(np.abs(r.reposition(k_old, p_old, p_new) - k_new)) <= tol


# ---- attention -------------------------------------------------------------------------

def _naive_attention(q, k, v, mask):
    tq, h, d = q.shape
    kvh = k.shape[1]
    out = np.zeros_like(q)
    for head in range(h):
        g = head // (h // kvh)                      # HF repeat_kv mapping
        for i in range(tq):
            s = np.array([q[i, head] @ k[j, g] / math.sqrt(d) if mask[i, j] else -np.inf
                          for j in range(k.shape[0])])
            w = np.exp(s - s.max())
            w /= w.sum()
            out[i, head] = w @ v[:, g]
    return out


@pytest.mark.parametrize("h,kvh", [(4, 1), (4, 2), (4, 4), (6, 3)])
def test_gqa_matches_naive_per_head_loop(h, kvh):
    g = rng(8)
    q = g.standard_normal((5, h, 8))
    k = g.standard_normal((9, kvh, 8))
    v = g.standard_normal((9, kvh, 8))
    mask = L.causal_mask(4, 5)
    assert np.allclose(L.attention(q, k, v, mask=mask), _naive_attention(q, k, v, mask), atol=1e-12)
    # explicit repeat (HF repeat_kv) + multi-head attention gives the same
    k_rep, v_rep = np.repeat(k, h // kvh, axis=1), np.repeat(v, h // kvh, axis=1)
    assert np.allclose(L.attention(q, k_rep, v_rep, mask=mask), L.attention(q, k, v, mask=mask), atol=1e-12)


def test_gqa_head_mapping_in_model():
    """Perturbing kv head 1's V must change exactly query heads 2 and 3 (h // 2)."""
    g = rng(9)
    q = g.standard_normal((3, 4, 8))
    k = g.standard_normal((3, 2, 8))
    v = g.standard_normal((3, 2, 8))
    base = L.attention(q, k, v, mask=L.causal_mask(0, 3))
    v2 = v.copy()
    v2[:, 1] += 1.0
    diff = np.abs(L.attention(q, k, v2, mask=L.causal_mask(0, 3)) - base).max(axis=(0, 2))
    assert np.all(diff[:2] == 0) and np.all(diff[2:] > 0.1)


def test_attention_hooks():
    g = rng(10)
    q, k, v = g.standard_normal((4, 4, 8)), g.standard_normal((6, 2, 8)), g.standard_normal((6, 2, 8))
    mask = L.causal_mask(2, 4)
    ref = L.attention(q, k, v, mask=mask)
    assert np.allclose(L.attention(q, k, v, mask=mask, bias=np.zeros((4, 6)), logit_scale=np.ones(6)), ref)
    # a -inf bias on key 0 is the same as dropping key 0
    bias = np.zeros((4, 6))
    bias[:, 0] = -np.inf
    assert np.allclose(L.attention(q, k, v, mask=mask, bias=bias), L.attention(q, k[1:], v[1:], mask=mask[:, 1:]))
    # a per-key temperature on a block: logit_scale 1/T equals scaling those logits by hand
    ls = np.array([0.5, 0.5, 0.5, 1, 1, 1])
    _, w = L.attention(q, k, v, mask=mask, logit_scale=ls, return_weights=True)
    kr = np.repeat(k, 2, axis=1)
    raw = np.einsum("qhd,khd->hqk", q, kr) / math.sqrt(8) * ls
    raw = np.where(mask, raw, -np.inf)
    want = np.exp(raw - raw.max(-1, keepdims=True))
    assert np.allclose(w, want / want.sum(-1, keepdims=True))
    # a per-head scale of shape [H][Tk] equals the [Tk] one when all heads agree
    assert np.allclose(L.attention(q, k, v, mask=mask, logit_scale=np.tile(ls, (4, 1))),
                       L.attention(q, k, v, mask=mask, logit_scale=ls))
    # per-head bias of log S on a block multiplies that block's mass by S
    hb = np.zeros((4, 4, 6))
    hb[:, :, :2] = math.log(3.0)
    _, w0 = L.attention(q, k, v, mask=mask, return_weights=True)
    _, w1 = L.attention(q, k, v, mask=mask, bias=hb, return_weights=True)
    m0, m1 = w0[..., :2].sum(-1), w1[..., :2].sum(-1)
    assert np.allclose(m1 / (1 - m1), 3 * m0 / (1 - m0))


def test_model_attend_hook_is_used():
    m = model()
    ids = T.encode("hook")
    ref, _ = m.forward(ids)
    seen = []

    def spy(q, k, v, mask=None, bias=None, logit_scale=None):
        seen.append(k.shape)
        return L.attention(q, k, v, mask=mask, bias=bias, logit_scale=logit_scale)

    m.attention = spy
    out, _ = m.forward(ids)
    assert np.array_equal(out, ref) and seen == [(4, 2, 32)] * 2


# ---- forward with a KV cache ----------------------------------------------------------

@pytest.mark.parametrize("style", L.STYLES)
@pytest.mark.parametrize("fam", FAMILIES)
def test_incremental_equals_full(fam, style):
    m = model(fam, style)
    ids = T.encode(TEXT)[:48]      # stays within the dynamic/longrope threshold (64)
    full, kv_full = m.forward(ids)
    # prefill a prefix, then decode token by token, then a chunk
    logits, kv = m.forward(ids[:20])
    outs = [logits]
    for i in range(20, 30):
        lg, new = m.forward([ids[i]], past=kv)
        outs.append(lg)
        kv = L.kv_concat(kv, new)
    lg, new = m.forward(ids[30:], past=kv)
    outs.append(lg)
    kv = L.kv_concat(kv, new)
    inc = np.concatenate(outs)
    assert np.allclose(inc, full, rtol=1e-6, atol=1e-6)
    for (a, b), (c, d) in zip(kv, kv_full):
        assert a.dtype == np.float32 and a.shape == (48, 2, 32)
        assert np.allclose(a, c, atol=1e-6) and np.allclose(b, d, atol=1e-6)


def test_incremental_with_arbitrary_positions():
    m = model("llama3")
    ids = T.encode(TEXT)[:30]
    pos = np.concatenate([np.arange(10), 100 + np.arange(12), 7 + np.arange(8)])   # gaps, repeats
    full, _ = m.forward(ids, positions=pos)
    lg1, kv = m.forward(ids[:10], positions=pos[:10])
    lg2, kv2 = m.forward(ids[10:22], positions=pos[10:22], past=kv)
    lg3, _ = m.forward(ids[22:], positions=pos[22:], past=L.kv_concat(kv, kv2))
    assert np.allclose(np.concatenate([lg1, lg2, lg3]), full, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("fam", COMPOSING)
def test_shifted_cache_equals_recompute(fam):
    """RoPE is relative: computing a context at p + c gives the same hidden
    states, so every layer's cached K at p re-positioned to p + c equals the
    K computed at p + c, and decoding from the shifted cache matches."""
    m = model(fam, num_hidden_layers=3)
    ids = T.encode(TEXT)[:40]
    c = 1000
    _, kv0 = m.forward(ids[:32])
    full_c, kv_c = m.forward(ids, positions=c + np.arange(40))
    p = np.arange(32)
    shifted = m.reposition_kv(kv0, p, p + c)
    for (k1, _), (k2, _) in zip(shifted, kv_c):
        assert np.allclose(k1, k2[:32], atol=2e-5)
    lg, _ = m.forward(ids[32:], positions=c + 32 + np.arange(8), past=shifted)
    assert np.allclose(lg, full_c[32:], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fam", COMPOSING)
def test_layer0_pre_rope_keys(fam):
    """Layer-0 keys depend only on the token: rope(pre_key, p') equals the key
    computed at p', and equals the cached key re-positioned from p to p'."""
    m = model(fam, "gptj")
    ids = T.encode(TEXT)[:24]
    p, p2 = np.arange(24), np.arange(24) * 3 + 50
    _, kv, pre = m.forward(ids, return_pre_rope=True)
    _, kv2 = m.forward(ids, positions=p2)
    assert np.allclose(m.apply_rope(pre[0], p2), kv2[0][0], atol=1e-5)
    assert np.allclose(m.reposition(kv[0][0], p, p2), kv2[0][0], atol=1e-5)
    assert np.allclose(m.remove_rope(kv[0][0], p), pre[0], atol=1e-5)
    assert np.allclose(m.pre_rope_keys(ids, positions=p2)[0], pre[0])


def test_dynamic_crossing_threshold_changes_keys():
    m = model("dynamic")
    ids = (T.encode(TEXT) * 3)[:80]
    _, kv_short, pre = m.forward(ids[:10], return_pre_rope=True)
    _, kv_long = m.forward(ids[:10], seq_len=80)
    assert not np.allclose(kv_short[0][0], kv_long[0][0], atol=1e-3)
    p = np.arange(10)
    moved = m.reposition(kv_short[0][0], p, p, seq_len_from=10, seq_len_to=80)
    assert np.allclose(moved, kv_long[0][0], atol=1e-5)


def test_generate_uses_cache_consistently():
    m = model("yarn")
    ids = T.encode("hello")
    out, cache = m.generate(ids, 6)
    assert len(out) == 6 and L.kv_len(cache) == len(ids) + 5
    full, _ = m.forward(ids + out[:-1])
    assert [int(i) for i in np.argmax(full[len(ids) - 1:], axis=-1)] == out


def test_forward_rejects_bad_input():
    m = model()
    with pytest.raises(ValueError):
        m.forward([300])
    with pytest.raises(ValueError):
        m.forward([1, 2], positions=[0])
    _, kv = m.forward([1, 2])
    with pytest.raises(ValueError):
        m.forward([3], past=kv[:1])


# ---- payload layout ----------------------------------------------------------------------

def test_payload_layout_and_round_trip():
    m = model(num_hidden_layers=3)
    _, kv = m.forward(T.encode("payload!"))
    n, kvh, d = 8, m.n_kv_heads, m.head_dim
    buf = L.kv_to_payload(kv, "f32")
    assert len(buf) == L.payload_size(3, n, kvh, d, "f32") == 3 * 2 * n * kvh * d * 4
    flat = np.frombuffer(buf, dtype="<f4")
    per = n * kvh * d
    for layer, (k, v) in enumerate(kv):               # layer-major, K then V
        assert np.array_equal(flat[(2 * layer) * per:(2 * layer + 1) * per], k.reshape(-1))
        assert np.array_equal(flat[(2 * layer + 1) * per:(2 * layer + 2) * per], v.reshape(-1))
    # element [t][h][i] of layer 1's V sits at the documented offset
    t, h, i = 5, 1, 17
    off = (2 * 1 + 1) * per + (t * kvh + h) * d + i
    assert flat[off] == kv[1][1][t, h, i]
    back = L.payload_to_kv(buf, 3, n, kvh, d, "f32")
    assert all(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) for a, b in zip(back, kv))
    for dt, tol in (("f16", 1e-3), ("bf16", 8e-3), (1, 1e-3), ("BF16", 8e-3)):
        b = L.kv_to_payload(kv, dt)
        assert len(b) == len(buf) // 2
        rt = L.model_payload_to_kv(m, b, n, dt)
        for (k0, v0), (k1, v1) in zip(kv, rt):
            assert k1.dtype == np.float32
            assert np.allclose(k1, k0, rtol=tol, atol=tol) and np.allclose(v1, v0, rtol=tol, atol=tol)
        assert L.kv_to_payload(rt, dt) == b         # re-encoding is exact
    with pytest.raises(ValueError):
        L.payload_to_kv(buf[:-4], 3, n, kvh, d, "f32")
    with pytest.raises(ValueError):
        L.kv_to_payload(kv, "q4")


def test_bf16_rounding():
    bits = np.array([0x3F808000,   # tie, even below -> 0x3F80
                     0x3F818000,   # tie, odd below -> up 0x3F82
                     0x3F808001,   # above half -> 0x3F81
                     0x3F807FFF,   # below half -> 0x3F80
                     0x7F7FFFFF,   # max float rounds to inf
                     0x7F800000, 0xFF800000,   # +-inf
                     0x80000000], dtype=np.uint32)
    want = [0x3F80, 0x3F82, 0x3F81, 0x3F80, 0x7F80, 0x7F80, 0xFF80, 0x8000]
    assert L.f32_to_bf16(bits.view(np.float32)).tolist() == want
    nan = L.f32_to_bf16(np.array([np.nan, -np.nan], dtype=np.float32))
    assert np.all(np.isnan(L.bf16_to_f32(nan)))
    x = rng(11).standard_normal(1000).astype(np.float32)
    assert np.allclose(L.bf16_to_f32(L.f32_to_bf16(x)), x, rtol=2 ** -8)
    # f16 is IEEE round-to-nearest-even
    assert L.decode_tensor(L.encode_tensor(np.float32([1 + 2 ** -11]), "f16"), (1,), "f16")[0] == 1.0


# ---- torch: HF's formulas, written out in torch ------------------------------------------

def _hf_inv_freq_torch(torch, cfg, seq_len=None):
    """HF modeling_rope_utils in torch (float32, as HF computes it)."""
    base = cfg["rope_theta"]
    dim = int(cfg["head_dim"] * cfg.get("partial_rotary_factor", 1.0))
    rs = cfg.get("rope_scaling") or {}
    t = rs.get("rope_type", "default")
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if t == "default":
        return inv, 1.0
    if t == "linear":
        return inv / rs["factor"], 1.0
    if t == "llama3":
        factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old = rs["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        inv_l = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
        med = ~(wavelen < old / hi) * ~(wavelen > old / lo)
        return torch.where(med, smoothed, inv_l), 1.0
    if t == "yarn":
        orig = rs["original_max_position_embeddings"]
        factor = cfg["max_position_embeddings"] / orig
        af = 0.1 * math.log(factor) + 1.0

        def cdim(n):
            return (dim * math.log(orig / (n * 2 * math.pi))) / (2 * math.log(base))
        low, high = max(math.floor(cdim(rs["beta_fast"])), 0), min(math.ceil(cdim(rs["beta_slow"])), dim - 1)
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
        ext = 1 - ramp
        return (1.0 / (factor * pos_freqs)) * (1 - ext) + (1.0 / pos_freqs) * ext, af
    if t == "dynamic":
        mp = cfg["max_position_embeddings"]
        sl = seq_len if seq_len is not None and seq_len > mp else mp
        b = base * ((rs["factor"] * sl / mp) - (rs["factor"] - 1)) ** (dim / (dim - 2))
        return 1.0 / (b ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), 1.0
    if t == "longrope":
        orig = cfg["original_max_position_embeddings"]
        factor = cfg["max_position_embeddings"] / orig
        af = math.sqrt(1 + math.log(factor) / math.log(orig))
        ext = torch.tensor(rs["long_factor"] if seq_len and seq_len > orig else rs["short_factor"],
                           dtype=torch.float32)
        return 1.0 / (ext * base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), af
    raise AssertionError(t)


def _hf_cos_sin(torch, inv_freq, af, position_ids, dtype):
    """LlamaRotaryEmbedding.forward."""
    inv_e = inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
    pos_e = position_ids[:, None, :].float()
    freqs = (inv_e.float() @ pos_e.float()).transpose(1, 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * af).to(dtype), (emb.sin() * af).to(dtype)


def _rotate_half(torch, x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def _hf_apply_rotary_pos_emb(torch, q, k, cos, sin, unsqueeze_dim=1):
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (_rotate_half(torch, q) * sin), (k * cos) + (_rotate_half(torch, k) * sin)


@pytest.mark.parametrize("fam", FAMILIES)
def test_torch_hf_rope(fam):
    torch = pytest.importorskip("torch")
    cfg = L.make_config(fam)
    pos = np.arange(0, 120)
    x = rng(12).standard_normal((len(pos), 4, 32)).astype(np.float32)
    inv, af = _hf_inv_freq_torch(torch, cfg, seq_len=int(pos.max()) + 1)
    ours_inv, ours_af = L.rope_parameters(cfg, seq_len=int(pos.max()) + 1)
    assert np.allclose(inv.numpy(), ours_inv, rtol=1e-6) and af == pytest.approx(ours_af)
    cos, sin = _hf_cos_sin(torch, inv, af, torch.tensor(pos)[None], torch.float32)
    xt = torch.tensor(x).transpose(0, 1)[None]           # [1, H, T, D]
    q_e, _ = _hf_apply_rotary_pos_emb(torch, xt, xt, cos, sin)
    want = q_e[0].transpose(0, 1).numpy()
    got = L.Rope(cfg).apply(x, pos)
    assert np.max(np.abs(got - want)) < 5e-5                # HF angles are float32


def test_torch_gptj_partial_rotary():
    """HF modeling_gptj: rotate_every_two with repeat_interleave'd sin/cos, partial rotary_dim."""
    torch = pytest.importorskip("torch")
    hd, rot = 64, 16
    cfg = {"hidden_size": 128, "num_attention_heads": 2, "head_dim": hd, "rotary_dim": rot,
           "rope_theta": 10000.0, "rope_scaling": None, "max_position_embeddings": 2048}
    x = rng(13).standard_normal((30, 2, hd)).astype(np.float32)
    pos = np.arange(30) * 5
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=torch.int64) / rot))
    sinusoid = torch.einsum("i , j -> i j", torch.arange(300, dtype=torch.int64).float(), inv_freq).float()
    table = torch.cat((torch.sin(sinusoid), torch.cos(sinusoid)), dim=1)
    sincos = table[torch.tensor(pos)][None]               # [1, T, rot]
    sin, cos = torch.split(sincos, rot // 2, dim=-1)
    t = torch.tensor(x)[None]                             # [1, T, H, D]
    k_rot, k_pass = t[..., :rot], t[..., rot:]
    sin_r = torch.repeat_interleave(sin[:, :, None, :], 2, 3)
    cos_r = torch.repeat_interleave(cos[:, :, None, :], 2, 3)
    x1, x2 = k_rot[..., ::2], k_rot[..., 1::2]
    every_two = torch.stack((-x2, x1), dim=-1).flatten(-2)
    want = torch.cat([k_rot * cos_r + every_two * sin_r, k_pass], dim=-1)[0].numpy()
    got = L.Rope(cfg, "gptj").apply(x, pos)
    assert np.max(np.abs(got - want)) < 5e-5


@pytest.mark.parametrize("fam", ["default", "yarn", "llama3"])
def test_torch_hf_llama_forward(fam):
    """The whole model against HF LlamaModel's eager path, written out in
    torch (float64): RMSNorm, q/k/v proj, RoPE, repeat_kv, causal softmax,
    o_proj, SwiGLU, final norm, lm head."""
    torch = pytest.importorskip("torch")
    m = model(fam, tie_word_embeddings=(fam == "yarn"))
    cfg = m.config
    ids = T.encode(TEXT)[:40]
    W = {k: torch.tensor(v, dtype=torch.float64) for k, v in m.weights.items()}
    inv, af = L.rope_parameters(cfg)           # float64 tables: the formulas are checked above
    pos = torch.arange(len(ids))[None]
    # LlamaRotaryEmbedding.forward, in float64 (HF's float32 angles are checked above)
    freqs = (torch.tensor(inv)[None, :, None].double() @ pos[:, None, :].double()).transpose(1, 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos() * af, emb.sin() * af
    H, KVH, D, hs = m.n_heads, m.n_kv_heads, m.head_dim, m.hidden_size
    eps = cfg["rms_norm_eps"]

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def repeat_kv(h, n_rep):
        b, kvh, s, d = h.shape
        return h[:, :, None, :, :].expand(b, kvh, n_rep, s, d).reshape(b, kvh * n_rep, s, d)

    x = W["model.embed_tokens.weight"][torch.tensor(ids)][None]
    S = len(ids)
    causal = torch.full((S, S), float("-inf"), dtype=torch.float64).triu(1)
    for i in range(m.n_layers):
        p = f"model.layers.{i}."
        h = rms(x, W[p + "input_layernorm.weight"])
        q = (h @ W[p + "self_attn.q_proj.weight"].T).view(1, S, H, D).transpose(1, 2)
        k = (h @ W[p + "self_attn.k_proj.weight"].T).view(1, S, KVH, D).transpose(1, 2)
        v = (h @ W[p + "self_attn.v_proj.weight"].T).view(1, S, KVH, D).transpose(1, 2)
        q, k = _hf_apply_rotary_pos_emb(torch, q, k, cos, sin)
        k = k.float().double()                 # the cache holds float32
        v = v.float().double()
        ks, vs = repeat_kv(k, H // KVH), repeat_kv(v, H // KVH)
        a = torch.matmul(q, ks.transpose(2, 3)) * D ** -0.5 + causal
        a = torch.softmax(a, dim=-1)
        o = torch.matmul(a, vs).transpose(1, 2).reshape(1, S, H * D)
        x = x + o @ W[p + "self_attn.o_proj.weight"].T
        h = rms(x, W[p + "post_attention_layernorm.weight"])
        g = torch.nn.functional.silu(h @ W[p + "mlp.gate_proj.weight"].T) * (h @ W[p + "mlp.up_proj.weight"].T)
        x = x + g @ W[p + "mlp.down_proj.weight"].T
    x = rms(x, W["model.norm.weight"])
    head = W.get("lm_head.weight", W["model.embed_tokens.weight"])
    want = (x @ head.T)[0].numpy()
    got, _ = m.forward(ids)
    assert np.allclose(got, want, rtol=1e-5, atol=1e-5)
