#!/usr/bin/python3
"""Tests of the Python binding (client/python/kvrope) against a real kvroped.

Run: /usr/bin/python3 -m pytest -q tests/python/test_client.py
(the fixtures in conftest.py start $KVR_BUILD/kvroped on a temporary socket).
Torch tests skip when torch is not importable.
"""
import os
import subprocess
import threading

import numpy as np
import pytest

import kvrope
import llama as L
from conftest import PYTHON, ROOT, free_tcp_port

CFG = L.make_config("default", num_hidden_layers=2, num_key_value_heads=2, head_dim=32)
NL, NH, HD = 2, 2, 32


@pytest.fixture(scope="module")
def llm():
    return L.LlamaModel(CFG, seed=3)


def model_name(c, uid, dtype="f32", cfg=CFG):
    name = f"py-{dtype}-{uid}"
    c.register_model(name, cfg, dtype=dtype)
    return name


def rand_kv(n, seed=0, layers=NL):
    """Random finite f32 KV, stacked [L, 2, n, H, D]."""
    return np.random.default_rng(seed).standard_normal((layers, 2, n, NH, HD)).astype(np.float32)


def toks(n, seed=0):
    return np.random.default_rng(seed + 100).integers(0, 256, n).tolist()


def bits(a):
    a = np.ascontiguousarray(a)
    return a.view({4: np.uint32, 2: np.uint16}[a.dtype.itemsize])


# ---- connection, ping, models ---------------------------------------------------

def test_ping_and_library(client, kvroped):
    p = client.ping()
    assert p.server.startswith("kvroped") and p.protocol == 1
    assert os.path.exists(kvrope.library_path())
    assert kvrope.default_socket().endswith("kvroped.sock")
    with kvrope.connect("unix:" + kvroped.socket) as c2:   # both address forms
        assert c2.ping().protocol == 1
    assert c2.closed


def test_connect_failure_is_client_error(tmp_path):
    with pytest.raises(kvrope.ConnectionFailed) as e:
        kvrope.connect(str(tmp_path / "nobody.sock"))
    assert e.value.code == kvrope.errors.KVR_ESYS and e.value.name == "KVR_ESYS" and "nobody.sock" in e.value.message


def test_register_model_forms(client, uid, tmp_path):
    m = client.register_model(f"dict-{uid}", CFG, dtype="f32")
    assert (m.n_layers, m.n_kv_heads, m.head_dim, m.dtype) == (NL, NH, HD, "f32")
    assert m.rope["style"] == "neox" and m.rope["theta"] == 10000.0
    path = L.write_config(str(tmp_path), CFG)                    # a file...
    assert client.register_model(f"dict-{uid}", path, dtype="f32") == m   # identical: fine
    assert client.register_model(f"dict-{uid}", str(tmp_path), dtype="f32") == m  # ...a directory
    import json
    assert client.register_model(f"dict-{uid}", json.dumps(CFG), dtype="f32") == m  # JSON text
    g = client.register_model(f"gptj-{uid}", L.make_config(style="gptj"))  # rope_style honoured
    assert g.rope["style"] == "gptj" and g.dtype == "f16"
    y = client.register_model(f"yarn-{uid}", L.make_config("yarn"), dtype="bf16")
    assert y.rope["scaling"] == "yarn" and y.fingerprint != m.fingerprint
    e = client.register_model(f"explicit-{uid}", None, n_layers=3, n_kv_heads=1, head_dim=16)
    assert (e.n_layers, e.n_kv_heads, e.head_dim) == (3, 1, 16)
    names = {x.name for x in client.models()}
    assert {f"dict-{uid}", f"gptj-{uid}", f"yarn-{uid}", f"explicit-{uid}"} <= names
    assert client.model(f"yarn-{uid}", refresh=True) == y


def test_register_errors(client, uid):
    client.register_model(f"m-{uid}", CFG, dtype="f32")
    with pytest.raises(kvrope.Exists) as e:                    # other fingerprint, same name
        client.register_model(f"m-{uid}", CFG, dtype="f16")
    assert e.value.code == 8 and e.value.name == "E_EXISTS" and f"m-{uid}" in e.value.message
    with pytest.raises(kvrope.ConfigRefused) as e:
        client.register_model(f"bad-{uid}", {"hidden_size": 3})
    assert e.value.code == 21 and "head_dim" in e.value.message
    with pytest.raises(kvrope.UnknownModel) as e:
        client.model(f"absent-{uid}")
    assert e.value.code == 6 and e.value.c_code == kvrope.errors.KVR_ENOMODEL
    with pytest.raises(FileNotFoundError):
        client.register_model(f"nofile-{uid}", "/nonexistent/config.json")
    with pytest.raises(ValueError):
        client.register_model(f"x-{uid}", CFG, style="rotated")
    client.ping()                                              # still usable


# ---- put / get --------------------------------------------------------------------

def test_put_get_forms_and_metadata(client, uid, llm):
    name = model_name(client, uid)
    t = L.encode("kvrope keeps keys rotated")
    _, kv = llm.forward(t)                        # llama.py's list of (K, V)
    r = client.put(f"pairs-{uid}", name, t, kv)
    assert (r.n_tokens, r.first_index, r.first_pos, r.last_pos) == (len(t), 0, 0, len(t) - 1)
    stacked = np.stack([np.stack(p) for p in kv])                  # [L, 2, T, H, D]
    client.put(f"stacked-{uid}", name, t, stacked, pos_start=100)
    client.put(f"kv-{uid}", name, t, k=stacked[:, 0], v=stacked[:, 1],
               positions=np.arange(len(t)) * 2)
    for cid, pos in ((f"pairs-{uid}", np.arange(len(t))), (f"stacked-{uid}", 100 + np.arange(len(t))),
                     (f"kv-{uid}", 2 * np.arange(len(t)))):
        g = client.get(cid, positions=None)
        assert g.ctx_id == cid and g.model == name and g.dtype == "f32" and g.start == 0
        assert g.shape == (NL, 2, len(t), NH, HD) and g.layers == (0, 1)
        assert g.tokens.tolist() == t and np.array_equal(g.positions, pos)
        assert not g.approximate.any() and g.groups.shape == (len(t),)
        assert np.array_equal(g.data, stacked)
        assert all(np.array_equal(a, k) and np.array_equal(b, v)
                   for (a, b), (k, v) in zip(g.pairs(), kv))
        assert np.array_equal(g.keys, stacked[:, 0]) and np.array_equal(g.v(1), stacked[1, 1])
    # append, range, layer subset (in the order asked), meta_only
    t2 = L.encode(" and never drifts")
    _, kv2 = llm.forward(t2, positions=np.arange(len(t), len(t) + len(t2)), past=kv)
    r = client.put(f"pairs-{uid}", name, t2, kv2, mode="append")
    assert r.first_index == len(t) and r.n_tokens == len(t) + len(t2) and r.first_pos == len(t)
    g = client.get(f"pairs-{uid}", 3, len(t) + 4, layers=[1, 0])
    assert g.start == 3 and g.layers == (1, 0) and g.n_tokens == len(t) + 1
    full = np.concatenate([stacked, np.stack([np.stack(p) for p in kv2])], axis=2)
    assert np.array_equal(g.data[0], full[1, :, 3:len(t) + 4])
    assert np.array_equal(g.data[1], full[0, :, 3:len(t) + 4])
    m = client.get(f"pairs-{uid}", meta_only=True)
    assert m.data is None and m.tokens.tolist() == t + t2
    with pytest.raises(ValueError):
        m.k(0)


def test_get_into_buffer_and_streaming(client, uid):
    name = model_name(client, uid)
    kv = rand_kv(70, seed=1)                          # more than one 64-token block
    client.put(f"c-{uid}", name, toks(70), kv)
    out = np.full(kv.shape, np.nan, dtype=np.float32)
    seen = []
    g = client.get(f"c-{uid}", out=out,
                   on_layer=lambda layer, k, v: seen.append((layer, k.shape, float(k[0, 0, 0]),
                                                            float(v[-1, -1, -1]))))
    assert g.data is out and np.array_equal(out, kv)
    assert seen == [(i, (70, NH, HD), float(kv[i, 0, 0, 0, 0]), float(kv[i, 1, -1, -1, -1]))
                    for i in range(NL)]
    big = np.zeros(kv.size + 10, dtype=np.float32)    # larger buffer: a view of its head
    g = client.get(f"c-{uid}", out=big)
    assert np.array_equal(g.data, kv) and np.shares_memory(g.data, big)
    with pytest.raises(kvrope.BufferTooSmall) as e:
        client.get(f"c-{uid}", out=np.zeros(10, dtype=np.float32))
    assert e.value.code == kvrope.errors.KVR_EBUFFER
    assert np.array_equal(client.get(f"c-{uid}").data, kv)     # connection kept

    def boom(*_):
        raise KeyError("from the callback")
    with pytest.raises(KeyError):
        client.get(f"c-{uid}", on_layer=boom)
    client.ping()


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_dtype_round_trip_bit_exact(client, uid, dtype):
    name = model_name(client, uid, dtype)             # stored at rest in this dtype
    rng = np.random.default_rng(7)
    f = rng.standard_normal((NL, 2, 33, NH, HD)).astype(np.float32) * 10
    f.flat[:4] = [0.0, -0.0, 65504.0, 1e-7]           # zeros, f16 max, a subnormal-ish value
    data = {"f32": f, "f16": f.astype(np.float16), "bf16": kvrope.f32_to_bf16(f)}[dtype]
    client.put(f"rt-{uid}", name, toks(33), data, dtype=dtype if dtype == "bf16" else None)
    g = client.get(f"rt-{uid}", dtype=dtype)
    assert g.dtype == dtype and g.data.dtype == kvrope.tensors.NUMPY[dtype]
    assert np.array_equal(bits(g.data), bits(data))
    # widening is exact; f32 from any stored dtype
    assert np.array_equal(g.to_float32(), client.get(f"rt-{uid}", dtype="f32").data)
    # f32 data converted on the way in (RNE, the daemon's kernel) == numpy / llama.py RNE
    client.put(f"cv-{uid}", name, toks(33), f, dtype=dtype)
    back = client.get(f"cv-{uid}", dtype=dtype).data
    ref = {"f32": f, "f16": f.astype(np.float16), "bf16": L.f32_to_bf16(f)}[dtype]
    assert np.array_equal(bits(back), bits(ref))


def test_bf16_conversion_helpers():
    x = np.array([1.0, 1.00390625, 1.01171875, -2.5, np.inf, 3.3895314e38], dtype=np.float32)
    b = kvrope.f32_to_bf16(x)
    assert np.array_equal(b, L.f32_to_bf16(x))
    assert np.array_equal(kvrope.bf16_to_f32(b), L.bf16_to_f32(b))
    assert kvrope.dtype_name("bfloat16") == "bf16" and kvrope.dtype_name(np.float16) == "f16"
    with pytest.raises(TypeError):
        kvrope.dtype_name(np.uint16)
    with pytest.raises(ValueError):
        kvrope.dtype_name("int8")


def test_get_rerotated_positions(client, uid, llm):
    """Keys fetched at requested positions equal llama.py's reposition."""
    name = model_name(client, uid)
    t = L.encode("move me")
    _, kv = llm.forward(t)
    client.put(f"r-{uid}", name, t, kv)
    to = np.arange(len(t)) + 1000
    g = client.get(f"r-{uid}", 0, len(t), positions=to)
    assert np.array_equal(g.positions, to)
    for i, (k, v) in enumerate(kv):
        want = llm.reposition(k, np.arange(len(t)), to)
        assert np.allclose(g.k(i), want, atol=2e-5, rtol=1e-5)
        assert np.array_equal(g.v(i), v)


# ---- match ----------------------------------------------------------------------------

def test_match(client, uid):
    name = model_name(client, uid)
    a, kv = toks(40, seed=5), rand_kv(40, seed=5)
    client.put(f"m-{uid}", name, a, kv)
    q = a[:25] + [(a[25] + 1) % 256] + a[26:]
    hit = client.match(name, q)
    assert (hit.length, hit.ctx_id, hit.kv) == (25, f"m-{uid}", None)
    hit = client.match(name, q, get=True, dtype="f16", layers=[1])
    assert hit.kv.n_tokens == 25 and hit.kv.layers == (1,) and hit.kv.dtype == "f16"
    assert np.array_equal(hit.kv.data[0], kv[1, :, :25].astype(np.float16))
    assert hit.kv.tokens.tolist() == a[:25]
    full = client.match(name, a + [1, 2, 3], get=True)
    assert full.length == 40 and np.array_equal(full.kv.data, kv)
    miss = client.match(name, [(a[0] + 1) % 256] + a[1:], get=True)
    assert (miss.length, miss.ctx_id, miss.kv) == (0, None, None)
    with pytest.raises(kvrope.UnknownModel):
        client.match(f"nomodel-{uid}", a)


# ---- context management -------------------------------------------------------

def test_list_stat_pin_fork_shift_keep_delete(client, uid):
    name = model_name(client, uid)
    kv = rand_kv(20, seed=2)
    client.put(f"a-{uid}", name, toks(20), kv)
    s = client.stat(f"a-{uid}")
    assert (s.id, s.model, s.n_tokens, s.pos_min, s.pos_max, s.pinned) == (f"a-{uid}", name, 20, 0, 19, False)
    assert s.bytes > 0 and s.n_blocks >= 1
    client.pin(f"a-{uid}")
    assert client.stat(f"a-{uid}").pinned
    client.unpin(f"a-{uid}")
    assert not client.stat(f"a-{uid}").pinned
    client.fork(f"a-{uid}", f"b-{uid}")
    b = client.stat(f"b-{uid}")
    assert b.n_tokens == 20 and b.n_shared_blocks >= 1
    assert [c.id for c in client.list(name)] == [f"a-{uid}", f"b-{uid}"]
    assert {f"a-{uid}", f"b-{uid}"} <= {c.id for c in client.list()}
    client.shift(f"b-{uid}", 5, 20, 10)
    assert client.get(f"b-{uid}", meta_only=True).positions.tolist() == list(range(5)) + list(range(15, 30))
    assert client.get(f"a-{uid}", meta_only=True).positions.tolist() == list(range(20))  # fork is a copy
    client.keep(f"b-{uid}", 2, 8)
    g = client.get(f"b-{uid}")
    assert g.positions.tolist() == [2, 3, 4, 15, 16, 17]
    assert np.array_equal(g.values, kv[:, 1, 2:8])            # values are never rotated
    with pytest.raises(kvrope.Exists):
        client.fork(f"a-{uid}", f"b-{uid}")
    client.delete(f"b-{uid}")
    assert not client.exists(f"b-{uid}") and client.exists(f"a-{uid}")
    with pytest.raises(kvrope.UnknownContext):
        client.delete(f"b-{uid}")
    assert [c.id for c in client.list(name)] == [f"a-{uid}"]


def test_put_replace(client, uid):
    """mode="replace": a create, or the id's context replaced at once (its
    tokens leave the index, nothing of it carries over); refused puts leave
    the old one as it was."""
    name = model_name(client, uid)
    other = model_name(client, uid, dtype="f16")
    ka, kb = rand_kv(12, seed=21), rand_kv(5, seed=22)
    ta, tb = toks(12, seed=21), toks(5, seed=22)
    r = client.put(f"r-{uid}", name, ta, ka, mode="replace")         # missing: created
    assert r.n_tokens == 12
    client.pin(f"r-{uid}")
    r = client.put(f"r-{uid}", name, tb, kb, mode="replace", pos_start=7)
    assert (r.n_tokens, r.first_index, r.first_pos) == (5, 0, 7)
    g = client.get(f"r-{uid}")
    assert np.array_equal(bits(g.data), bits(kb))            # stored and read at 7..11
    assert g.positions.tolist() == list(range(7, 12)) and g.tokens.tolist() == tb
    assert not client.stat(f"r-{uid}").pinned
    assert client.match(name, ta).length == 0
    m = client.match(name, tb)
    assert (m.length, m.ctx_id) == (5, f"r-{uid}")
    with pytest.raises(kvrope.FingerprintMismatch):          # another model's: delete it first
        client.put(f"r-{uid}", other, tb, kb, mode="replace")
    with pytest.raises(kvrope.ShapeMismatch):
        client.put(f"r-{uid}", name, tb, rand_kv(5, layers=NL + 1), mode="replace",
                   check_model=False)
    g2 = client.get(f"r-{uid}")
    assert np.array_equal(bits(g2.values), bits(g.values)) and g2.tokens.tolist() == tb
    assert [c.id for c in client.list(name)] == [f"r-{uid}"]


def test_deferred_delete(client, uid):
    """delete(deferred=True) rides with the next call, flush() sends what
    waits; a context already gone counts as done, not as a failure."""
    name = model_name(client, uid)
    kv = rand_kv(8, seed=5)
    for i in range(3):
        client.put(f"dd{i}-{uid}", name, toks(8), kv)
    client.delete(f"dd0-{uid}", deferred=True)
    client.delete(f"never-{uid}", deferred=True)
    assert client.exists(f"dd2-{uid}")          # carries both deletes
    assert not client.exists(f"dd0-{uid}")
    client.delete(f"dd1-{uid}", deferred=True)
    g = client.get(f"dd2-{uid}")                # a reply with a payload: the delete goes ahead
    assert np.array_equal(g.data, kv)
    assert not client.exists(f"dd1-{uid}")
    client.flush()                               # nothing waits
    client.delete(f"dd2-{uid}", deferred=True)
    client.flush()
    assert not client.exists(f"dd2-{uid}")
    client.delete(f"dd2-{uid}", deferred=True)
    client.flush()                               # gone already: done
    assert client.deferred_failures() == (0, "")
    with pytest.raises(ValueError):
        client.delete("", deferred=True)             # refused before anything is queued


def test_deferred_delete_is_sent_at_close(kvroped, client, uid):
    """close() (and leaving a with block) sends the deferred deletes still
    queued: none is dropped."""
    name = model_name(client, uid)
    kv = rand_kv(8, seed=6)
    client.put(f"dc0-{uid}", name, toks(8), kv)
    client.put(f"dc1-{uid}", name, toks(8), kv)
    c2 = kvrope.connect(kvroped.socket)
    c2.delete(f"dc0-{uid}", deferred=True)
    c2.close()
    assert c2.closed
    assert not client.exists(f"dc0-{uid}")
    with kvrope.connect(kvroped.socket) as c3:
        c3.delete(f"dc1-{uid}", deferred=True)
    assert not client.exists(f"dc1-{uid}")
    c3.close()                                   # closed already: nothing to do


def test_stats(client):
    s0 = client.stats()
    for key in ("uptime_seconds", "contexts", "tokens", "requests_total", "requests_put",
                "requests_stats", "mem_cap_bytes"):
        assert key in s0
    client.ping()
    s1 = client.stats()
    assert s1["requests_ping"] == s0["requests_ping"] + 1
    assert s1["requests_total"] == s0["requests_total"] + 2


# ---- errors ------------------------------------------------------------------------

def test_daemon_errors_carry_code_and_message(client, uid):
    name = model_name(client, uid)
    kv = rand_kv(4)
    cases = [
        (lambda: client.get(f"none-{uid}"), kvrope.UnknownContext, 7, "E_UNKNOWN_CONTEXT", f"none-{uid}"),
        (lambda: client.put(f"none-{uid}", name, toks(4), kv, mode="append"), kvrope.UnknownContext,
         7, "E_UNKNOWN_CONTEXT", f"none-{uid}"),
        (lambda: client.put(f"x-{uid}", f"nomodel-{uid}", toks(4), kv, check_model=False),
         kvrope.UnknownModel, 6, "E_UNKNOWN_MODEL", f"nomodel-{uid}"),
        (lambda: client.put(f"x-{uid}", name, toks(4), rand_kv(4, layers=3), check_model=False),
         kvrope.ShapeMismatch, 9, "E_SHAPE", ""),
        (lambda: client.get(f"e-{uid}", 2, 99), kvrope.RangeError, 11, "E_RANGE", "99"),
        (lambda: client.put(f"e-{uid}", name, toks(4), kv, mode="create"), kvrope.Exists, 8,
         "E_EXISTS", f"e-{uid}"),
    ]
    client.put(f"e-{uid}", name, toks(4), kv)
    for call, cls, code, cname, words in cases:
        with pytest.raises(cls) as e:
            call()
        err = e.value
        assert isinstance(err, kvrope.KvropeError) and isinstance(err, kvrope.DaemonError)
        assert (err.code, err.name, err.c_code) == (code, cname, getattr(kvrope.errors, kvrope.errors.STATUS[code][1]))
        assert err.message and words in err.message and cname in str(err)
    assert np.array_equal(client.get(f"e-{uid}").data, kv)     # the connection and data survive


def test_validation_raises_before_sending(client, uid):
    name = model_name(client, uid)
    client.put(f"v-{uid}", name, toks(4), rand_kv(4))
    kv = rand_kv(4)
    bad = [
        (ValueError, lambda: client.put(f"v-{uid}", name, toks(5), kv)),              # token count
        (ValueError, lambda: client.put(f"v-{uid}", name, toks(4), kv[:, :1])),       # axis 1 != 2
        (ValueError, lambda: client.put(f"v-{uid}", name, toks(4), kv[0])),           # 4-D
        (ValueError, lambda: client.put(f"v-{uid}", name, toks(4), rand_kv(4, layers=3))),  # vs model
        (ValueError, lambda: client.put(f"v-{uid}", name, toks(4), kv[:, :, :, :1])),  # heads
        (ValueError, lambda: client.put(f"v-{uid}", name, toks(4), kv[..., :16])),    # head_dim
        (TypeError, lambda: client.put(f"v-{uid}", name, toks(4), kv.astype(np.float64))),
        (TypeError, lambda: client.put(f"v-{uid}", name, toks(4), kv.astype(np.int32))),
        (TypeError, lambda: client.put(f"v-{uid}", name, toks(4), kv.view(np.uint16)[..., ::2])),
        (TypeError, lambda: client.put(f"v-{uid}", name, toks(4), kv.view(np.uint16)[..., ::2],
                                       dtype="f16")),
        (TypeError, lambda: client.put(f"v-{uid}", name, toks(4), kv.tolist())),
        (ValueError, lambda: client.put(f"v-{uid}", name, toks(4), [(kv[0, 0], kv[0, 1][:3])])),
        (TypeError, lambda: client.put(f"v-{uid}", name, toks(4), [kv[0, 0]])),
        (TypeError, lambda: client.put(f"v-{uid}", name, toks(4),
                                       [(kv[0, 0], kv[0, 1].astype(np.float16)), (kv[1, 0], kv[1, 1])])),
        (ValueError, lambda: client.put(f"v-{uid}", name, toks(4), k=kv[:, 0], v=kv[:, 1, :3])),
        (TypeError, lambda: client.put(f"v-{uid}", name, toks(4), k=kv[:, 0])),
        (TypeError, lambda: client.put(f"v-{uid}", name, toks(4), kv, k=kv[:, 0], v=kv[:, 1])),
        (ValueError, lambda: client.put(f"v-{uid}", name, toks(4), kv, dtype="int8")),
        (ValueError, lambda: client.put(f"v-{uid}", name, toks(4), kv, mode="overwrite")),
        (ValueError, lambda: client.put(f"v-{uid}", name, toks(4), kv, positions=[0, 1, 2])),
        (ValueError, lambda: client.put(f"v-{uid}", name, toks(4), kv, positions=[0, 1, 2, 3],
                                        pos_start=0)),
        (ValueError, lambda: client.put(f"v-{uid}", name, [0, 1, 2, -1], kv)),
        (ValueError, lambda: client.put(f"v-{uid}", name, [0, 1, 2, 1 << 32], kv)),
        (TypeError, lambda: client.put(f"v-{uid}", name, [0.5, 1, 2, 3], kv)),
        (ValueError, lambda: client.put(f"v-{uid}", name, [], kv[:, :, :0])),
        (ValueError, lambda: client.put("", name, toks(4), kv)),
        (ValueError, lambda: client.put("x" * 256, name, toks(4), kv)),
        (TypeError, lambda: client.put(7, name, toks(4), kv)),
        (ValueError, lambda: client.get(f"v-{uid}", 3, 3)),
        (ValueError, lambda: client.get(f"v-{uid}", 0, positions=[1, 2])),
        (ValueError, lambda: client.get(f"v-{uid}", 0, 2, positions=[1, 2, 3])),
        (ValueError, lambda: client.get(f"v-{uid}", -1)),
        (ValueError, lambda: client.get(f"v-{uid}", dtype="q4_0")),
        (TypeError, lambda: client.get(f"v-{uid}", out=np.zeros(kv.shape, np.float16))),
        (ValueError, lambda: client.get(f"v-{uid}", out=np.zeros((4, 2, 4, NH, HD), np.float32)[::2])),
        (ValueError, lambda: client.match(name, [[1, 2]])),
        (ValueError, lambda: client.shift(f"v-{uid}", 0, 4, 1 << 63)),
        (TypeError, lambda: client.keep(f"v-{uid}", 0, "4")),
    ]
    s0 = client.stats()
    for exc, call in bad:
        with pytest.raises(exc):
            call()
    s1 = client.stats()
    assert s1["requests_total"] - s0["requests_total"] == 1         # only the stats call itself
    for verb in ("put", "get", "match", "shift", "keep"):
        assert s1[f"requests_{verb}"] == s0[f"requests_{verb}"]
    assert client.get(f"v-{uid}", meta_only=True).n_tokens == 4


def test_unsupported_when_the_library_lacks_a_verb(client, monkeypatch):
    lib = client._lib
    monkeypatch.setattr(lib, "has", lambda name: name != "kvr_client_keep")
    with pytest.raises(kvrope.Unsupported) as e:
        client.keep("anything", 0, 1)
    assert e.value.code == 16 and "kvr_client_keep" in e.value.message
    assert isinstance(e.value, NotImplementedError)
    monkeypatch.undo()
    later = {"edit": ("c", [(0, 1, [1])]), "edit_plan": ("c", [(0, 1, [1])]), "refresh": ("c", 0),
             "assemble": ("p", ["d"]), "group_append": ("c", "m", "g", [1])}
    s0 = client.stats()
    for verb, args in later.items():
        if not lib.has(f"kvr_client_{verb}"):
            with pytest.raises(kvrope.Unsupported, match=f"kvr_client_{verb}"):
                getattr(client, verb)(*args)
    assert client.stats()["requests_total"] == s0["requests_total"] + 1


def test_closed_client_and_dead_daemon(daemon_factory):
    d = daemon_factory()
    c = kvrope.connect(d.socket)
    c.ping()
    assert d.stop() == 0
    with pytest.raises(kvrope.ConnectionFailed) as e:
        c.ping()
    assert e.value.code in (kvrope.errors.KVR_ESYS, kvrope.errors.KVR_ECLOSED)
    with pytest.raises(kvrope.ConnectionFailed) as e:
        c.ping()                                   # stays closed
    c.close()
    with pytest.raises(kvrope.ConnectionFailed):
        c.stats()


def test_tcp_with_token(daemon_factory, tmp_path):
    tok = tmp_path / "token"
    tok.write_text("s3cret-token\n")
    tok.chmod(0o600)                               # others may not read it
    port = free_tcp_port()
    d = daemon_factory("--listen", f"127.0.0.1:{port}", "--auth-token-file", str(tok))
    with kvrope.connect(f"127.0.0.1:{port}", token="s3cret-token", timeout=5) as c:
        assert c.ping().protocol == 1
    with pytest.raises(kvrope.Unauthenticated) as e:
        kvrope.connect(f"tcp:127.0.0.1:{port}", token=b"wrong")
    assert e.value.code == 5
    with kvrope.connect(f"127.0.0.1:{port}") as c:   # no token: the first request is refused
        with pytest.raises(kvrope.Unauthenticated):
            c.ping()
    with kvrope.connect(d.socket) as c:               # Unix socket: no auth needed
        c.ping()


def test_threads_share_a_client(client, uid):
    name = model_name(client, uid)
    errs = []

    def work(i):
        try:
            kv = rand_kv(8, seed=i)
            for j in range(5):
                client.put(f"t{i}-{j}-{uid}", name, toks(8, seed=i), kv)
                assert np.array_equal(client.get(f"t{i}-{j}-{uid}").data, kv)
        except Exception as e:  # pragma: no cover
            errs.append(e)
    ts = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert not errs
    assert len(client.list(name)) == 20


# ---- torch ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_torch_tensors(client, uid, dtype):
    torch = pytest.importorskip("torch")
    tdt = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[dtype]
    name = model_name(client, uid, dtype)
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(NL, 2, 9, NH, HD, generator=g).to(tdt)
    tokens = torch.arange(9, dtype=torch.int64)
    client.put(f"s-{uid}", name, tokens, kv)                      # stacked tensor
    back = client.get(f"s-{uid}", dtype=dtype).to_torch()
    assert back.dtype == tdt and torch.equal(back, kv)
    client.put(f"p-{uid}", name, tokens, [(kv[i, 0], kv[i, 1]) for i in range(NL)])
    client.put(f"kv-{uid}", name, tokens, k=kv[:, 0], v=kv[:, 1])
    for cid in (f"p-{uid}", f"kv-{uid}"):
        assert torch.equal(client.get(cid, dtype=dtype).to_torch(), kv)
    # a float32 tensor converted to the model dtype on the way in
    client.put(f"c-{uid}", name, tokens, kv.float(), dtype=dtype)
    assert torch.equal(client.get(f"c-{uid}", dtype=dtype).to_torch(), kv)
    with pytest.raises(TypeError):
        client.put(f"x-{uid}", name, tokens, kv.to(torch.int32))


# ---- example 1 end to end ------------------------------------------------------------

def test_worker_example_identical_logits(kvroped):
    cmd = [PYTHON, os.path.join(ROOT, "examples", "worker.py"), "--socket", kvroped.socket]
    env = dict(os.environ)
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert first.returncode == 0, first.stdout + first.stderr
    out = first.stdout
    assert "OK: logits with the cache are identical" in out
    assert "nothing cached yet" in out and "fork of" in out
    diffs = [float(line.split("max |diff| = ")[1].split()[0])
             for line in out.splitlines() if "max |diff| = " in line]
    assert len(diffs) == 4 and max(diffs) <= 1e-5 * 100
    # A second worker finds every prompt cached and recomputes one token each.
    second = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert second.returncode == 0, second.stdout + second.stderr
    assert second.stdout.count("computed 1 of") == 4 and "already cached" in second.stdout


def test_worker_without_daemon_exits_2(tmp_path):
    r = subprocess.run([PYTHON, os.path.join(ROOT, "examples", "worker.py"), "--socket",
                        str(tmp_path / "none.sock")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "make run" in r.stderr


def test_error_space_comes_from_the_library():
    # The codes are base/error.h's, read from libkvrope: every class the
    # binding maps names a code the library has, and every wire Status has
    # a class.
    t = kvrope.errors._tables()
    assert set(kvrope.errors.CLASS_OF) <= set(t.by_name)
    for status, (sname, cname) in kvrope.errors.STATUS.items():
        assert status > 0 and sname.startswith("E_") and cname in kvrope.errors.CLASS_OF
        err = kvrope.errors.from_c(t.by_name[cname], "m")
        assert err.code == status and err.name == sname and isinstance(err, kvrope.DaemonError)
    assert kvrope.errors.STATUS[7] == ("E_UNKNOWN_CONTEXT", "KVR_ENOCTX")
    assert kvrope.errors.KVR_ENOCTX < -4096           # never a -errno
    e = kvrope.errors.from_c(kvrope.errors.KVR_ECLOSED, "gone")
    assert isinstance(e, kvrope.ConnectionFailed) and e.code == e.c_code and e.name == "KVR_ECLOSED"
