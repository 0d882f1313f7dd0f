"""Every real Hugging Face config.json in ../shared/configs (issue 18), through
the CLI (`kvrope rope apply|remove|reposition`) and through the daemon (put
rotated keys, get them at other positions; quantized contexts un-rotate at put
and rotate at get), against a float64 reference independent of the C code:
transformers' formulas as examples/llama.py's rope_parameters computes them
(modeling_rope_utils.py: default, linear, dynamic, yarn, longrope, llama3
inv_freq and attention scaling; dynamic_rope_update /
longrope_frequency_update for the length-dependent tables), with each model's
reading of its config and its modeling code for the pairing and the rotated
dims written here.

The configs are read in place: $KVR_CONFIGS (set by the Makefile to
$(SHARED)/configs), else the sibling of $KVR_VECTORS, else ../shared/configs.
Every accepted model is checked at positions below, around and far past
max_position_embeddings (and around original_max_position_embeddings), in f32,
f16 and bf16; every refused model must name the field and the reason.

The worst relative errors seen (max |got - ref| / max |ref| per case) are
printed at the end of the session (pytest -s) and must stay under
TOL[dtype]: a wrong table is off by O(1) there.
"""
import json
import os
import subprocess
import tempfile
import uuid
import zlib

import numpy as np
import pytest

from conftest import BUILD, ROOT

import kvrope
import llama as L


def _configs_dir():
    d = os.environ.get("KVR_CONFIGS")
    if not d and os.environ.get("KVR_VECTORS"):
        d = os.path.join(os.path.dirname(os.path.abspath(os.environ["KVR_VECTORS"])), "configs")
    if not d:
        d = os.path.join(ROOT, "..", "shared", "configs")
    return os.path.abspath(d)


CONFIGS = _configs_dir()
FILES = sorted(f for f in os.listdir(CONFIGS) if f.endswith(".json")) if os.path.isdir(CONFIGS) else []
KVROPE = os.path.join(BUILD, "kvrope")
TOL = {"f32": 2e-6, "f16": 2e-3, "bf16": 1.6e-2}
WORST = {}          # dtype -> (rel, what)
COUNT = {}          # dtype -> cases checked
HEADS = 2

# Refused on purpose: the field the message must name, and words of the reason.
REFUSED = {
    "deepseek-v2-lite.json": ("kv_lora_rank", ("MLA", "latent", "k_pe")),
    "deepseek-v3.json": ("kv_lora_rank", ("MLA", "latent", "k_pe")),
}

pytestmark = pytest.mark.skipif(not FILES, reason=f"no configs in {CONFIGS}")


# ---- the reference: transformers' formulas in float64 -----------------------------------

class Ref:
    """One model's RoPE as transformers computes it, per layer."""

    def __init__(self, cfg):
        top = cfg
        cfg = cfg.get("text_config") or cfg            # composite: get_text_config()
        self.cfg = cfg
        self.model_type = cfg.get("model_type") or top.get("model_type") or ""
        mt = self.model_type
        heads = cfg.get("num_attention_heads", cfg.get("n_head"))
        hidden = cfg.get("hidden_size", cfg.get("n_embd"))
        if mt.startswith("chatglm"):
            # modeling_chatglm: rotary_dim = kv_channels; RotaryEmbedding(rotary_dim // 2)
            self.head_dim = int(cfg.get("kv_channels") or hidden // heads)
            self.rot = self.head_dim // 2
            self.theta = 10000.0 * float(cfg.get("rope_ratio", 1.0))
        else:
            self.head_dim = int(cfg.get("head_dim") or hidden // heads)
            if cfg.get("rotary_dim"):
                self.rot = int(cfg["rotary_dim"])
            else:
                prf = cfg.get("partial_rotary_factor", cfg.get("rotary_pct", 1.0))
                self.rot = int(self.head_dim * prf)
            rp = cfg.get("rope_parameters") or {}
            if "full_attention" in rp:
                rp = rp["full_attention"]
            self.theta = float(rp.get("rope_theta", cfg.get("rope_theta",
                                                           cfg.get("rotary_emb_base", 10000.0))))
        # interleaved pairs: GPT-J's rotate_every_two, ChatGLM's reshape(..., -1, 2)
        self.gptj = mt in ("gptj", "chatglm", "codegen")
        self.max_pos = int(cfg.get("max_position_embeddings") or cfg.get("n_positions")
                           or cfg.get("seq_length") or 2048)
        rs = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
        if "full_attention" in rs:
            rs = rs["full_attention"]
        self.rs = rs
        self.type = rs.get("rope_type", rs.get("type", "default"))
        if self.type == "su":
            self.type = "longrope"
        self.n_layers = int(cfg.get("num_hidden_layers", cfg.get("n_layer", cfg.get("num_layers", 1))))
        # per layer: Gemma 3 sliding layers use rope_local_base_freq, default rope
        self.local = [False] * self.n_layers
        if mt in ("gemma3", "gemma3_text"):
            pat = int(cfg.get("sliding_window_pattern", 6))
            types = cfg.get("layer_types") or [
                "sliding_attention" if (i + 1) % pat else "full_attention"
                for i in range(self.n_layers)]
            self.local = [t == "sliding_attention" for t in types]
        # The config as examples/llama.py reads it, with this model's reading of
        # each field settled here: its rotated dims, theta, context and family.
        self.hf = {"head_dim": self.head_dim, "rotary_dim": self.rot, "rope_theta": self.theta,
                   "max_position_embeddings": self.max_pos,
                   "rope_scaling": dict(rs, rope_type=self.type, rope_theta=self.theta)}
        if "original_max_position_embeddings" in cfg:      # Phi-3's longrope
            self.hf["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
        self.local_hf = {"head_dim": self.head_dim, "rotary_dim": self.rot,
                         "rope_theta": float(cfg.get("rope_local_base_freq", 10000.0))}

    # the threshold of the length-dependent tables
    def original(self):
        if self.type == "longrope":
            return int(self.cfg.get("original_max_position_embeddings") or self.max_pos)
        return int(self.rs.get("original_max_position_embeddings") or self.max_pos)

    def inv_freq(self, seq_len, layer=0):
        """(inv_freq [rot/2] float64, attention_factor): examples/llama.py's
        rope_parameters (ROPE_INIT_FUNCTIONS[rope_type]) on the config as this
        model's code reads it (self.hf; Gemma 3's sliding layers: self.local_hf)."""
        return L.rope_parameters(self.local_hf if self.local[layer] else self.hf, seq_len)

    def rotate(self, x, pos, seq_len, layer=0, sign=1):
        """x [T, H, D] float64 -> R(sign * pos) x * att^sign (HF: cos/sin * attention_factor)."""
        inv, att = self.inv_freq(seq_len, layer)
        ang = np.asarray(pos, np.float64)[:, None] * inv[None, :] * sign
        c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        y = x.copy()
        r = self.rot
        if self.gptj:
            a, b = x[..., 0:r:2], x[..., 1:r:2]
            y[..., 0:r:2] = a * c - b * s
            y[..., 1:r:2] = b * c + a * s
        else:
            a, b = x[..., : r // 2], x[..., r // 2: r]
            y[..., : r // 2] = a * c - b * s
            y[..., r // 2: r] = b * c + a * s
        y[..., :r] *= att if sign > 0 else 1.0 / att
        return y

    def apply(self, x, pos, layer=0):
        return self.rotate(x, pos, int(np.max(pos)) + 1, layer, +1)

    def remove(self, k, pos, layer=0, seq_len=None):
        return self.rotate(k, pos, seq_len or int(np.max(pos)) + 1, layer, -1)

    def reposition(self, k, frm, to, layer=0, from_len=None, to_len=None):
        x = self.remove(k, frm, layer, from_len)
        return self.rotate(x, to, to_len or int(np.max(to)) + 1, layer, +1)

    def position_sets(self):
        """(name, positions [8]) below, around and far past the context."""
        mp, orig = self.max_pos, self.original()
        out = [("below", np.arange(8) + 3),
               ("around_max", np.arange(8) + mp - 4),
               ("far", np.array([8, 9, 10, 11, 20, 33, 50, 64]) * mp + 5)]
        if orig != mp:
            out.insert(1, ("around_orig", np.arange(8) + orig - 4))
        return out


# ---- dtypes ---------------------------------------------------------------------------------

def to_dtype(x, dt):
    """float64 -> the dtype's numpy carrier (bf16 as uint16, round to nearest even)."""
    f = np.ascontiguousarray(x, dtype=np.float32)
    if dt == "f32":
        return f
    if dt == "f16":
        return f.astype(np.float16)
    u = f.view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return r


def from_dtype(a, dt):
    if dt == "bf16":
        return (np.asarray(a, np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return np.asarray(a).astype(np.float64)


def carrier(dt):
    return {"f32": np.float32, "f16": np.float16, "bf16": np.uint16}[dt]


def rel_err(got, ref):
    return float(np.max(np.abs(got - ref)) / max(np.max(np.abs(ref)), 1e-30))


def check(got, ref, dt, what, tol=None):
    e = rel_err(got, ref)
    key = dt if tol is None else f"{dt} (quantized at rest)"
    COUNT[key] = COUNT.get(key, 0) + 1
    if e > WORST.get(key, (0.0, ""))[0]:
        WORST[key] = (e, what)
    lim = tol if tol is not None else TOL[dt]
    assert e <= lim, f"{what}: relative error {e:.3g} > {lim:.3g}"


def load(name):
    with open(os.path.join(CONFIGS, name), encoding="utf-8") as f:
        return json.load(f)


def accepted():
    return [f for f in FILES if f not in REFUSED]


def layers_to_check(ref):
    """Layer 0, and one layer of every other kind (Gemma 3: a global one)."""
    ls = [0]
    for i, loc in enumerate(ref.local):
        if loc != ref.local[0]:
            ls.append(i)
            break
    return ls


@pytest.fixture(scope="session", autouse=True)
def _report_worst():
    yield
    if WORST:
        print("\nworst relative error per dtype over all configs:")
        for dt in sorted(WORST):
            print(f"  {dt:5s} {WORST[dt][0]:.3g} over {COUNT[dt]} cases  ({WORST[dt][1]})")


# ---- the CLI: kvrope rope --------------------------------------------------------------------

def cli_rope(verb, cfg_path, x, dt, pos, frm=None, layer=None, tmp=None):
    T, H, D = x.shape
    files = {}
    for key, arr in (("in", to_dtype(x, dt)), ("pos", np.asarray(pos, np.int64)),
                     ("from", None if frm is None else np.asarray(frm, np.int64))):
        if arr is None:
            continue
        p = os.path.join(tmp, f"{key}.bin")
        arr.tofile(p)
        files[key] = p
    out = os.path.join(tmp, "out.bin")
    argv = [KVROPE, "rope", verb, "--config", cfg_path, "--tokens", str(T), "--heads", str(H),
            "--dtype", dt, "--in", files["in"], "--pos", files["pos"], "--pos-dtype", "i64",
            "--out", out]
    if frm is not None:
        argv += ["--from-pos", files["from"]]
    if layer is not None:
        argv += ["--layer", str(layer)]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"{' '.join(argv)}: {r.stderr}"
    got = np.fromfile(out, dtype=carrier(dt)).reshape(T, H, D)
    return from_dtype(got, dt)


@pytest.mark.skipif(not os.access(KVROPE, os.X_OK), reason="kvrope is not built")
@pytest.mark.parametrize("name", accepted())
def test_cli_matches_transformers(name, tmp_path):
    ref = Ref(load(name))
    path = os.path.join(CONFIGS, name)
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    for layer in layers_to_check(ref):
        lay = layer if len(layers_to_check(ref)) > 1 else None
        for dt in ("f32", "f16", "bf16"):
            x = from_dtype(to_dtype(rng.standard_normal((8, HEADS, ref.head_dim)), dt), dt)
            sets = ref.position_sets()
            for pname, pos in sets:
                what = f"{name} layer {layer} {dt} {pname}"
                got = cli_rope("apply", path, x, dt, pos, layer=lay, tmp=str(tmp_path))
                check(got, ref.apply(x, pos, layer), dt, "apply " + what)
                k = from_dtype(to_dtype(ref.apply(x, pos, layer), dt), dt)
                got = cli_rope("remove", path, k, dt, pos, layer=lay, tmp=str(tmp_path))
                check(got, ref.remove(k, pos, layer), dt, "remove " + what)
            # reposition from every set to the next one (crossing the
            # thresholds both ways) and within one set
            for (fn, fp), (tn, tp) in zip(sets, sets[1:] + sets[:1]):
                k = from_dtype(to_dtype(ref.apply(x, fp, layer), dt), dt)
                got = cli_rope("reposition", path, k, dt, tp, frm=fp, layer=lay, tmp=str(tmp_path))
                check(got, ref.reposition(k, fp, tp, layer), dt,
                      f"reposition {name} layer {layer} {dt} {fn}->{tn}")


@pytest.mark.skipif(not os.access(KVROPE, os.X_OK), reason="kvrope is not built")
def test_cli_seq_len_option(tmp_path):
    """--seq-len / --from-seq-len pick the dynamic / longrope tables explicitly."""
    for name in ("phi3.5-mini-128k.json", "minicpm-2b-dynamic.json"):
        if name not in FILES:
            continue
        ref, path = Ref(load(name)), os.path.join(CONFIGS, name)
        x = np.random.default_rng(3).standard_normal((8, HEADS, ref.head_dim))
        pos = np.arange(8)
        long_len = ref.original() * 2
        tmp = str(tmp_path)
        T, H, D = x.shape
        to_dtype(x, "f32").tofile(os.path.join(tmp, "x.bin"))
        pos.astype(np.int32).tofile(os.path.join(tmp, "p.bin"))
        r = subprocess.run([KVROPE, "rope", "apply", "--config", path, "--tokens", "8",
                            "--heads", str(HEADS), "--in", os.path.join(tmp, "x.bin"),
                            "--pos", os.path.join(tmp, "p.bin"), "--seq-len", str(long_len),
                            "--out", os.path.join(tmp, "o.bin")], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        got = np.fromfile(os.path.join(tmp, "o.bin"), np.float32).reshape(T, H, D)
        check(got.astype(np.float64), ref.rotate(x, pos, long_len), "f32", f"apply --seq-len {name}")
        short = ref.rotate(x, pos, 8)
        assert rel_err(got.astype(np.float64), short) > 1e-3, "the long table was not used"


@pytest.mark.skipif(not os.access(KVROPE, os.X_OK), reason="kvrope is not built")
@pytest.mark.parametrize("name", sorted(REFUSED))
def test_cli_refuses_with_field_and_reason(name, tmp_path):
    if name not in FILES:
        pytest.skip(f"{name} not in {CONFIGS}")
    field, words = REFUSED[name]
    np.zeros((1, 1, 128), np.float32).tofile(tmp_path / "x.bin")
    np.zeros(1, np.int32).tofile(tmp_path / "p.bin")
    r = subprocess.run([KVROPE, "rope", "apply", "--config", os.path.join(CONFIGS, name),
                        "--tokens", "1", "--heads", "1", "--in", str(tmp_path / "x.bin"),
                        "--pos", str(tmp_path / "p.bin"), "--out", str(tmp_path / "o.bin")],
                       capture_output=True, text=True)
    assert r.returncode == 1
    assert field in r.stderr and any(w in r.stderr for w in words), r.stderr


def test_every_config_is_covered():
    """Each file is either checked against the reference or refused on purpose."""
    assert len(FILES) >= 23, FILES
    for name in FILES:
        Ref(load(name)) if name not in REFUSED else None


# ---- the daemon -------------------------------------------------------------------------------

def kv_of(ref, per_layer_k, v):
    """[L, 2, T, 1, D] from per-layer keys [T, 1, D] and one V."""
    return np.stack([np.stack([k, v]) for k in per_layer_k])


@pytest.mark.parametrize("name", accepted())
def test_daemon_matches_transformers(name, client):
    ref = Ref(load(name))
    path = os.path.join(CONFIGS, name)
    rng = np.random.default_rng(zlib.crc32(name.encode()) + 1)
    L, T, D = ref.n_layers, 8, ref.head_dim
    composes = ref.type not in ("dynamic", "longrope")
    for dt in ("f32", "f16", "bf16"):
        mname = f"{name}-{dt}-{uuid.uuid4().hex[:6]}"
        m = client.register_model(mname, path, dtype=dt, n_kv_heads=1)
        assert m.rope["model_type"] == ref.model_type
        assert m.rope["rotary_dim"] == ref.rot
        if ref.type == "longrope":
            assert m.rope["factor"] == pytest.approx(ref.max_pos / ref.original())
        x = rng.standard_normal((L, T, 1, D))
        v = from_dtype(to_dtype(rng.standard_normal((T, 1, D)), dt), dt)
        sets = ref.position_sets()
        for (fn, fp), (tn, tp) in zip(sets, sets[1:] + sets[:1]):
            keys = [from_dtype(to_dtype(ref.apply(x[l], fp, l), dt), dt) for l in range(L)]
            cid = f"c-{uuid.uuid4().hex[:8]}"
            wire = to_dtype(kv_of(ref, keys, v), dt)
            wire = wire.view(np.uint16) if dt == "bf16" else wire
            client.put(cid, mname, list(range(T)), wire, dtype=dt, positions=fp)
            got = client.get(cid, end=T, dtype="f32", positions=tp)
            for l in layers_to_check(ref) + [L - 1]:
                check(np.asarray(got.k(l), np.float64),
                      ref.reposition(keys[l], fp, tp, l), dt,
                      f"daemon get {name} layer {l} {dt} {fn}->{tn}")
            # V is never rotated
            assert np.array_equal(np.asarray(got.v(0), np.float64), v)
            # quantized at rest: keys un-rotated at put, rotated at get, per layer
            if composes and dt == "f32" and fn == "below":
                qid = cid + "-q"
                client.put(qid, mname, list(range(T)), wire, dtype=dt, positions=fp,
                           codec="int8")
                got = client.get(qid, end=T, dtype="f32", positions=tp)
                for l in layers_to_check(ref):
                    check(np.asarray(got.k(l), np.float64), ref.reposition(keys[l], fp, tp, l),
                          dt, f"daemon int8 get {name} layer {l}", tol=3e-2)
                client.delete(qid)
            client.delete(cid)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_daemon_refuses_with_field_and_reason(name, client):
    if name not in FILES:
        pytest.skip(f"{name} not in {CONFIGS}")
    field, words = REFUSED[name]
    with pytest.raises(kvrope.KvropeError) as ei:
        client.register_model(f"refused-{uuid.uuid4().hex[:6]}", os.path.join(CONFIGS, name))
    msg = str(ei.value)
    assert field in msg and any(w in msg for w in words), msg


def test_daemon_longrope_edit_then_get(client):
    """A PIE insert on a longrope context: the get re-rotates the suffix with
    the context's tables (it used to fail with E_UNSUPPORTED)."""
    name = "phi3.5-mini-128k.json"
    if name not in FILES:
        pytest.skip(f"{name} not in {CONFIGS}")
    ref = Ref(load(name))
    L, T, D = ref.n_layers, 8, ref.head_dim
    mname = f"phi-edit-{uuid.uuid4().hex[:6]}"
    client.register_model(mname, os.path.join(CONFIGS, name), dtype="f32", n_kv_heads=1)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((L, T, 1, D))
    v = rng.standard_normal((T, 1, D)).astype(np.float32)
    pos = np.arange(T)
    keys = [ref.apply(x[l], pos, l).astype(np.float32) for l in range(L)]
    cid = f"e-{uuid.uuid4().hex[:8]}"
    client.put(cid, mname, list(range(T)), kv_of(ref, keys, v).astype(np.float32))
    new_x = rng.standard_normal((L, 2, 1, D))
    new_k = [ref.apply(new_x[l], np.array([4, 5]), l).astype(np.float32) for l in range(L)]
    new_v = rng.standard_normal((2, 1, D)).astype(np.float32)
    client.edit(cid, [{"start": 4, "end": 4, "tokens": [90, 91]}],
                kv_of(ref, new_k, new_v).astype(np.float32))
    got = client.get(cid, dtype="f32")
    assert list(got.positions) == list(range(T + 2))
    for l in (0, L - 1):
        k = np.asarray(got.k(l), np.float64)
        check(k[:4], keys[l][:4].astype(np.float64), "f32", "edit prefix")
        check(k[4:6], new_k[l].astype(np.float64), "f32", "edit new tokens")
        check(k[6:], ref.reposition(keys[l][4:].astype(np.float64), pos[4:], pos[4:] + 2, l),
              "f32", "edit suffix")
    # the same context read far past the original context switches to the
    # long table for every key
    far = np.arange(T + 2) + 3 * ref.original()
    got = client.get(cid, end=T + 2, dtype="f32", positions=far)
    stored = np.concatenate([keys[0][:4], new_k[0], keys[0][4:]]).astype(np.float64)
    stored_pos = np.concatenate([pos[:4], [4, 5], pos[4:]])
    check(np.asarray(got.k(0), np.float64),
          ref.reposition(stored, stored_pos, far, 0, from_len=T, to_len=int(far[-1]) + 1),
          "f32", "longrope far get after edit")
    client.delete(cid)


def test_daemon_dynamic_quantized_codec_refused_with_reason(client):
    name = "internlm2.5-7b-dynamic.json"
    if name not in FILES:
        pytest.skip(f"{name} not in {CONFIGS}")
    ref = Ref(load(name))
    mname = f"dyn-q-{uuid.uuid4().hex[:6]}"
    client.register_model(mname, os.path.join(CONFIGS, name), dtype="f32", n_kv_heads=1)
    kv = np.zeros((ref.n_layers, 2, 2, 1, ref.head_dim), np.float32)
    with pytest.raises(kvrope.KvropeError) as ei:
        client.put(f"q-{uuid.uuid4().hex[:6]}", mname, [1, 2], kv, codec="int8")
    assert "length-dependent" in str(ei.value)


@pytest.mark.skipif(not os.access(KVROPE, os.X_OK), reason="kvrope is not built")
def test_models_add_overrides_theta_and_rotary_dim(kvroped):
    """`kvrope models add --config F --rotary-dim 64 --theta 20000` applies both."""
    name = "llama2-13b.json"
    if name not in FILES:
        pytest.skip(f"{name} not in {CONFIGS}")
    mn = f"over-{uuid.uuid4().hex[:6]}"
    r = subprocess.run([KVROPE, "--socket", kvroped.socket, "--json", "models", "add", mn,
                        "--config", os.path.join(CONFIGS, name), "--rotary-dim", "64",
                        "--theta", "20000"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    assert j["rope"]["rotary_dim"] == 64 and j["rope"]["theta"] == 20000
    assert j["rope"]["model_type"] == "llama"
    r = subprocess.run([KVROPE, "--socket", kvroped.socket, "models", "add", mn + "x",
                        "--config", os.path.join(CONFIGS, name), "--rotary-dim", "130"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 1 and "rotary_dim" in r.stderr


def test_gemma3_layers_reported(client):
    name = "gemma3-1b.json"
    if name not in FILES:
        pytest.skip(f"{name} not in {CONFIGS}")
    m = client.register_model(f"g3-{uuid.uuid4().hex[:6]}", os.path.join(CONFIGS, name))
    ref = Ref(load(name))
    assert m.rope["layers"] == ["local" if loc else "global" for loc in ref.local]
    assert m.rope["local_theta"] == 10000
