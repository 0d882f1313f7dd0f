#!/usr/bin/python3
"""Codecs at rest through the Python binding (docs/quantized.md): a model's
default codec, put(codec=) then get() in f32 within the codec's error,
stat_codec() figures, get(raw=True) layout and size, bad specs.

Run: /usr/bin/python3 -m pytest -q tests/python/test_quant.py
"""
import numpy as np
import pytest

import kvrope

L, H, D = 2, 2, 64


def _kv(n, seed=1):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((L, 2, n, H, D)).astype(np.float32)


@pytest.fixture
def model(client, uid):
    name = f"q-{uid}"
    m = client.register_model(name, n_layers=L, n_kv_heads=H, head_dim=D, dtype="f32")
    assert m.codec == "f32"
    return name


def test_codec_put_get_round_trip_and_stat(client, model, uid):
    n = 256
    kv = _kv(n)
    ctx = f"c-{uid}"
    client.put(ctx, model, np.arange(n), kv, mode="create", codec="int8")
    got = client.get(ctx, dtype="f32")
    assert got.data.shape == kv.shape
    # keys come back rotated at the same positions: close to what was put
    err = np.sqrt(np.mean((got.data - kv) ** 2) / np.mean(kv ** 2))
    assert err < 0.02, err
    ci = client.stat_codec(ctx)
    assert ci.codec == "k=int8/g64,v=int8/g64,r=0"
    assert ci.quantized and ci.n_window == 0
    assert 8.0 < ci.bits_per_value < 9.0, ci.bits_per_value
    assert ci.bytes_saved > 0 and ci.kv_bytes > 0
    assert 0.0 < ci.rel_rms_k < 0.02 and 0.0 < ci.rel_rms_v < 0.02
    raw = client.get(ctx, raw=True)
    lay = raw.layout
    assert raw.codec == ci.codec and lay["k_codec"] == "int8/g64" and not lay["k_per_channel"]
    assert lay["v_unit_bytes"] == H * D + 2 * 4   # 128 int8 + (s, m) f16 per 64-value group
    assert lay["k_bytes"] == n * lay["k_unit_bytes"]
    assert raw.data.dtype == np.uint8 and raw.data.size == L * (lay["k_bytes"] + lay["v_bytes"])
    assert raw.v(1).size == lay["v_bytes"]
    assert list(raw.positions) == list(range(n))
    # The daemon reports the metrics.
    st = client.stats()
    assert st["quant_contexts"] >= 1 and st["quant_bits_per_value"] > 0


def test_model_default_codec_window_and_bad_specs(client, uid):
    name = f"qd-{uid}"
    m = client.register_model(name, n_layers=L, n_kv_heads=H, head_dim=D, dtype="f16",
                              codec="k4v2")
    assert m.codec == "k=int4/g128/c,v=int2/g256,r=128"
    assert [x.codec for x in client.models() if x.name == name] == [m.codec]
    ctx = f"d-{uid}"
    client.put(ctx, name, np.arange(300), _kv(300, 2).astype(np.float16), mode="create")
    ci = client.stat_codec(ctx)
    assert ci.codec == m.codec and ci.n_window == 300 - 128
    with pytest.raises(kvrope.UnsupportedByDaemon):
        client.get(ctx, raw=True)                 # the window is in full precision
    raw = client.get(ctx, end=128, raw=True)
    assert raw.layout["k_per_channel"] and raw.layout["k_group"] == 128
    with pytest.raises(kvrope.InvalidArgument, match="codec"):
        client.put(f"bad-{uid}", name, [1], _kv(1), mode="create", codec="int3")
    assert not client.exists(f"bad-{uid}")
    with pytest.raises(kvrope.InvalidArgument, match="bad codec spec"):
        client.register_model(f"qb-{uid}", n_layers=L, n_kv_heads=H, head_dim=D, codec="q9")
    # nan in a payload: refused naming layer and token, nothing changes
    kv = _kv(4, 3)
    kv[1, 1, 2, 0, 5] = np.nan
    with pytest.raises(kvrope.InvalidArgument, match=r"layer 1.*token 2"):
        client.put(ctx, name, [7, 8, 9, 10], kv, mode="append")
    assert client.stat(ctx).n_tokens == 300
