#!/usr/bin/python3
"""Shared-memory payloads through the Python binding (issue 14): results are
numpy arrays (and torch tensors) viewing the client's region, bit-identical
to the socket path; puts read from the region; TCP refuses.

Run: /usr/bin/python3 -m pytest -q tests/python/test_shm.py
"""
import numpy as np
import pytest

import kvrope
import llama as L
from conftest import free_tcp_port

CFG = L.make_config("default", num_hidden_layers=2, num_key_value_heads=2, head_dim=32)
NL, NH, HD = 2, 2, 32


def model(c, uid, dtype="f16"):
    name = f"shm-{dtype}-{uid}"
    c.register_model(name, CFG, dtype=dtype)
    return name


def rand_kv(n, seed=0):
    return np.random.default_rng(seed).standard_normal((NL, 2, n, NH, HD)).astype(np.float32)


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_get_is_a_view_of_the_region(client, uid, dtype):
    m = model(client, uid, dtype)
    kv = rand_kv(50, 1)
    client.put(f"s-{uid}", m, list(range(50)), kv, dtype=dtype)
    reg = client.region(1 << 20)
    for d in ("f32", "f16", "bf16"):
        for pos in (None, np.arange(50) + 333):
            a = client.get(f"s-{uid}", dtype=d, positions=pos, end=50)
            b = client.get(f"s-{uid}", dtype=d, positions=pos, end=50, shm=(reg, 4096))
            assert b.data.shape == a.data.shape
            assert b.data.ctypes.data == reg.base + 4096          # no copy: in the region
            assert np.array_equal(a.data.view(np.uint8), b.data.view(np.uint8))
            assert np.array_equal(a.positions, b.positions)
    reg.release()


def test_put_from_the_region(client, uid):
    m = model(client, uid, "f32")
    reg = client.region(1 << 20)
    kv = rand_kv(40, 2)
    inreg = reg.array("f32", kv.shape, 128)
    inreg[...] = kv
    client.put(f"p-{uid}", m, list(range(40)), inreg, dtype="f32", shm=reg)   # in place
    client.put(f"q-{uid}", m, list(range(40)), kv, dtype="f32", shm=(reg, 65536))  # copied
    for cid in (f"p-{uid}", f"q-{uid}"):
        assert np.array_equal(client.get(cid, dtype="f32").data, kv)


def test_torch_tensor_shares_the_region(client, uid):
    torch = pytest.importorskip("torch")
    m = model(client, uid, "f16")
    kv = rand_kv(30, 3)
    client.put(f"t-{uid}", m, list(range(30)), kv, dtype="f16")
    reg = client.region(1 << 20)
    r = client.get(f"t-{uid}", dtype="f16", shm=reg)
    t = r.to_torch()
    assert t.data_ptr() == reg.base
    assert torch.equal(t.float(), torch.from_numpy(kv.astype(np.float16).astype(np.float32)))
    tt = reg.tensor("f16", r.shape)
    assert tt.data_ptr() == reg.base


def test_tcp_refuses_shared_memory(daemon_factory):
    port = free_tcp_port()
    d = daemon_factory("--listen", f"127.0.0.1:{port}")
    with kvrope.connect(f"127.0.0.1:{port}") as c:
        with pytest.raises(kvrope.KvropeError) as e:
            c.region(4096)
        assert "Unix socket" in str(e.value)
        c.ping()
