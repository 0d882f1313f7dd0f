#!/usr/bin/python3
"""Cover (docs/reuse.md) through the Python binding against a real kvroped:
cached chunks found anywhere in a prompt, runs and gaps at the right
offsets, the placed K/V equal to a get of each run's source at its new
positions (keys re-rotated, values as stored), seams flagged approximate,
the shared-memory form equal to the buffer form, and bad input refused.

Run: /usr/bin/python3 -m pytest -q tests/python/test_cover.py
"""
import numpy as np
import pytest

import kvrope
import llama as L

CFG = L.make_config("default", num_hidden_layers=2, num_key_value_heads=2, head_dim=32)
NL, NH, HD = 2, 2, 32


def kv_for(n, seed):
    return np.random.default_rng(seed).standard_normal((NL, 2, n, NH, HD)).astype(np.float32)


def ids(n, base, seed):
    return (base + np.random.default_rng(seed).permutation(100000)[:n]).astype(np.uint32)


@pytest.fixture
def store(client, uid):
    model = f"cover-{uid}"
    client.register_model(model, CFG, dtype="f32")
    chunks = {}
    for i, name in enumerate(("a", "b", "c")):
        t = ids(160, 1_000_000 * (i + 1), i)
        cid = f"{name}-{uid}"
        client.put(cid, model, t, kv_for(160, i))
        chunks[name] = (cid, t)
    return model, chunks


def test_shuffled_chunks_behind_a_header(client, store):
    model, ch = store
    (a, ta), (b, tb), (c, tc) = ch["a"], ch["b"], ch["c"]
    header = ids(23, 9_000_000, 7)
    prompt = np.concatenate([header, tc[40:120], ta[:100], tb[16:160]])
    cov = client.cover(model, prompt)
    assert cov.n_prompt == prompt.size
    assert [(r.prompt_off, r.ctx_id, r.ctx_off, r.n_tokens) for r in cov.runs] == [
        (23, c, 40, 80), (103, a, 0, 100), (203, b, 16, 144)]
    assert cov.gaps == ((0, 23),)
    assert cov.n_covered == 324 and cov.kv is None
    assert not any(r.exact for r in cov.runs)

    # the same with the K/V: each run equals a get of its source re-rotated
    got = client.cover(model, prompt, get=True, pos_base=5)
    assert got.runs == tuple(r for r in got.runs) and len(got.runs) == 3
    kv = got.kv
    assert kv.n_tokens == 324 and kv.data.shape == (NL, 2, 324, NH, HD)
    assert np.array_equal(kv.tokens, prompt[got.placed()])
    assert np.array_equal(kv.positions, 5 + got.placed())
    assert np.all(kv.flags & kvrope.FLAG_APPROX), "every run is away from its left context"
    for r in got.runs:
        src = client.get(r.ctx_id, r.ctx_off, r.ctx_off + r.n_tokens,
                         positions=np.arange(r.prompt_off, r.end) + 5)
        s = slice(r.stream_off, r.stream_off + r.n_tokens)
        np.testing.assert_allclose(kv.data[:, 0, s], src.data[:, 0], rtol=0, atol=1e-5)
        assert np.array_equal(kv.data[:, 1, s], src.data[:, 1]), "values move bit for bit"


def test_exact_prefix_and_min_run(client, store):
    model, ch = store
    (a, ta), (b, tb) = ch["a"], ch["b"]
    prompt = np.concatenate([ta[:64], tb[:40], ids(5, 8_000_000, 1)])
    cov = client.cover(model, prompt, get=True, dtype="f16")
    assert [(r.prompt_off, r.ctx_id, r.exact) for r in cov.runs] == [(0, a, True), (64, b, False)]
    flags = cov.kv.flags & kvrope.FLAG_APPROX
    assert not flags[:64].any() and flags[64:].all(), "the seam is where b starts"
    assert cov.gaps == ((104, 5),)
    cov = client.cover(model, prompt, min_run=50)
    assert [r.n_tokens for r in cov.runs] == [64]
    assert cov.gaps == ((64, 45),)


def test_cover_into_shared_memory(client, store):
    model, ch = store
    (a, ta), (c, tc) = ch["a"], ch["c"]
    prompt = np.concatenate([ids(9, 9_500_000, 3), tc[20:100], ta[30:90]])
    want = client.cover(model, prompt, get=True, pos_base=2)
    reg = client.region(1 << 20)
    got = client.cover(model, prompt, get=True, pos_base=2, shm=reg)
    assert got.runs == want.runs
    assert np.array_equal(got.kv.data, want.kv.data)
    assert np.array_equal(got.kv.flags, want.kv.flags)
    meta = client.cover(model, prompt, get=True, meta_only=True)
    assert meta.kv.data is None and np.array_equal(meta.kv.tokens, want.kv.tokens)


def test_bad_input(client, store):
    model, ch = store
    with pytest.raises(kvrope.UnknownModel):
        client.cover("no-such-model", [1, 2, 3])
    with pytest.raises(kvrope.InvalidArgument):
        client.cover(model, [])
    with pytest.raises(kvrope.TooLarge):
        client.cover(model, np.zeros(kvrope._lib.COVER_MAX_TOKENS + 1, dtype=np.uint32))
    with pytest.raises(ValueError):
        client.cover(model, [1, 2], min_run=0)
    with pytest.raises(ValueError):
        client.cover(model, [1, 2], shm=None, out=np.zeros(4, np.float32))
    # nothing stored changed, and the connection still works
    cid, t = ch["a"]
    assert client.stat(cid).n_tokens == 160
    assert client.cover(model, t).n_covered == 160
