#!/usr/bin/python3
"""PIE edits through the Python binding (Client.edit_plan / edit / refresh)
against a real kvroped, with the KV of new tokens computed by examples/llama.py.

Run: /usr/bin/python3 -m pytest -q tests/python/test_edit.py
"""
import os

import numpy as np
import pytest

import kvrope
import llama as L
from tokenizer import byte_span

CFG = L.make_config("default", num_hidden_layers=2, num_key_value_heads=2, head_dim=32)
YARN = L.make_config("yarn", style="gptj", num_hidden_layers=2, num_key_value_heads=2,
                     head_dim=32)
SRC = "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n"


@pytest.fixture(scope="module")
def llm():
    return L.LlamaModel(CFG, seed=3)


def need_edit(client):
    if not client._lib.has("kvr_client_edit"):
        pytest.skip("libkvrope without kvr_client_edit")


def setup_ctx(client, llm, uid, dtype="f32", text=SRC, cfg=CFG):
    """Registers a model, encodes `text` and stores it; -> (model name, ctx id,
    tokens, pre-RoPE keys per layer, kv)."""
    need_edit(client)
    name = f"ed-{dtype}-{uid}"
    client.register_model(name, cfg, dtype=dtype)
    toks = L.encode(text)
    _, kv, pre = llm.forward(toks, return_pre_rope=True)
    cid = f"ed-{uid}"
    client.put(cid, name, toks, kv, mode="create")
    return name, cid, toks, pre, kv


def tol(dtype):
    # f16 keeps 11 significant bits: relative rounding 2^-11 (values here are O(1..10)).
    return {"f32": 1e-5, "f16": 2e-2}[dtype]


def expected_keys(llm, pre_old, old_index, positions):
    """K of old tokens (their pre-RoPE keys) rotated at new positions: what a get
    after an edit must return for the moved suffix."""
    return [llm.apply_rope(p[old_index], positions).astype(np.float32) for p in pre_old]


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_plan_then_edit_with_kv(client, uid, llm, dtype):
    name, cid, toks, pre, kv = setup_ctx(client, llm, uid, dtype)
    n = len(toks)
    new = L.encode("sum_of")                         # rename add -> sum_of: [4, 7) -> 6 tokens
    ops = [(4, 7, new)]
    before = client.get(cid, dtype="f32")
    plan = client.edit_plan(cid, ops, model=name)
    assert (plan.n_tokens, plan.n_new, plan.n_removed, plan.first_change) == (n + 3, 6, 3, 4)
    assert len(plan.spans) == 1 and plan.spans[0].index == 4 and plan.spans[0].shift == 3
    assert plan.positions.tolist() == list(range(4, 10))
    esize = {"f32": 4, "f16": 2}[dtype]
    assert plan.payload_bytes == 2 * 2 * 6 * 2 * 32 * esize
    after_plan = client.get(cid, dtype="f32")        # a plan changes nothing
    assert np.array_equal(after_plan.data, before.data)
    assert after_plan.tokens.tolist() == toks and not after_plan.flags.any()

    past = client.get(cid, 0, plan.first_change).pairs()
    _, kv_new = llm.forward(new, positions=plan.positions, past=past)
    r = client.edit(cid, ops, kv_new, model=name)
    assert (r.n_tokens, r.n_new, r.n_removed, r.n_pending) == (n + 3, 6, 3, 0)
    assert r.n_approximate == n - 7                 # the old suffix [7, n) moved

    g = client.get(cid, dtype="f32")
    new_toks = toks[:4] + new + toks[7:]
    assert g.tokens.tolist() == new_toks and L.decode(g.tokens).startswith("def sum_of(a, b)")
    assert g.positions.tolist() == list(range(n + 3))
    assert not g.flags[:10].any()
    assert ((g.flags[10:] & 0xff) == kvrope.FLAG_APPROX).all() and g.approximate[10:].all()
    assert (kvrope.token_age(g.flags[10:]) == 1).all()          # one edit old
    assert not g.pending.any()
    t = tol(dtype)
    for i in range(2):
        # prefix untouched, new tokens as sent (rounded to the model dtype)
        np.testing.assert_allclose(g.k(i)[:4], kv[i][0][:4], rtol=t, atol=t)
        np.testing.assert_allclose(g.k(i)[4:10], kv_new[i][0], rtol=t, atol=t)
        np.testing.assert_allclose(g.v(i)[4:10], kv_new[i][1], rtol=t, atol=t)
        # suffix: fresh RoPE keys = pre-RoPE keys re-rotated at the new positions
        want = expected_keys(llm, pre, slice(7, n), np.arange(10, n + 3))[i]
        np.testing.assert_allclose(g.k(i)[10:], want, rtol=t, atol=t)
        np.testing.assert_allclose(g.v(i)[10:], kv[i][1][7:], rtol=t, atol=t)
    st = client.stat(cid)
    assert st.n_tokens == n + 3 and st.n_approximate == n - 7
    assert client.stat_edit(cid) == (0, 0)


def test_multi_op_edit_flags_and_positions(client, uid, llm):
    name, cid, toks, pre, kv = setup_ctx(client, llm, uid)
    n = len(toks)
    text = SRC
    line2 = text.index("    return")
    a, b = byte_span(text, line2, text.index("\n", line2) + 1)   # the return line
    ins = L.encode("# adds\n")
    ops = [(0, 0, ins), (a, b, []), (n, n, L.encode("# end\n"))]  # insert, delete, append
    plan = client.edit_plan(cid, ops, model=name)
    d = len(ins)
    assert [s.index for s in plan.spans] == [0, a + d, n + d - (b - a)]
    assert [s.n_tokens for s in plan.spans] == [d, 0, 6]
    assert plan.positions.size == d + 6
    # Each op's new tokens' KV, computed op by op over the edited text so far.
    new_text = L.decode(ins) + text[:line2] + text[text.index("\n", line2) + 1:] + "# end\n"
    new_toks = L.encode(new_text)
    _, full = llm.forward(new_toks)
    idx = plan.indices
    assert np.array_equal(np.asarray(new_toks)[idx], np.concatenate([ins, L.encode("# end\n")]))
    kv_new = [(k[idx], v[idx]) for k, v in full]   # exact KV at the planned positions
    r = client.edit(cid, ops, kv_new, model=name)
    assert r.n_tokens == len(new_toks) and r.first_change == 0
    g = client.get(cid)
    assert L.decode(g.tokens) == new_text
    flags = g.flags
    assert (flags[idx] == 0).all()                            # new tokens carry exact KV
    rest = np.setdiff1d(np.arange(len(new_toks)), idx)
    assert ((flags[rest] & 0xff) == kvrope.FLAG_APPROX).all()         # everything after the first edit
    assert r.n_approximate == rest.size == client.stat(cid).n_approximate
    # moved keys are the old pre-RoPE keys at their new positions
    old_idx = np.r_[0:a, b:n]
    for i in range(2):
        want = expected_keys(llm, pre, old_idx, rest)[i]
        np.testing.assert_allclose(g.k(i)[rest], want, rtol=1e-5, atol=1e-5)


def test_edit_without_kv_pending_then_refresh(client, uid, llm):
    name, cid, toks, pre, kv = setup_ctx(client, llm, uid)
    n = len(toks)
    new = L.encode("# header\n")
    r = client.edit(cid, [(0, 0, new)], model=name)
    m = len(new)
    assert r.n_new == m and r.n_pending == m and r.n_approximate == n
    assert client.stat_edit(cid) == (m, 0)
    meta = client.get(cid, meta_only=True)
    assert meta.data is None
    assert (meta.flags[:m] & kvrope.FLAG_PENDING).all() and meta.pending[:m].all()
    assert ((meta.flags[m:] & 0xff) == kvrope.FLAG_APPROX).all()
    with pytest.raises(kvrope.Pending) as e:
        client.get(cid)
    assert e.value.name == "E_PENDING" and e.value.code == 22 and "refresh" in e.value.message
    assert client.get(cid, m, n + m).n_tokens == n            # the rest is readable

    # refresh the new tokens with KV computed at their current positions
    _, kv_head = llm.forward(new, positions=meta.positions[:m])
    rr = client.refresh(cid, 0, m, kv_head, model=name)
    assert rr.n_pending == 0 and rr.n_approximate == n and len(rr.spans) == 1
    assert client.stat_edit(cid) == (0, 0)
    assert not client.get(cid, meta_only=True).pending.any()

    # refresh the whole approximate suffix from a full re-encode: exact again
    full_toks = new + toks
    _, full = llm.forward(full_toks)
    rr = client.refresh(cid, m, None, L.kv_slice(full, m), model=name)
    assert rr.n_approximate == 0
    g = client.get(cid)
    assert not g.flags.any()
    for i in range(2):
        np.testing.assert_array_equal(g.k(i), full[i][0])
        np.testing.assert_array_equal(g.v(i), full[i][1])


def test_gptj_yarn_rotation(client, uid):
    llm = L.LlamaModel(YARN, seed=5)
    name, cid, toks, pre, kv = setup_ctx(client, llm, uid, "f32", cfg=YARN)
    n = len(toks)
    r = client.edit(cid, [(2, 5, [])], model=name)           # delete 3 tokens
    assert r.n_new == 0 and r.n_removed == 3 and r.n_pending == 0
    g = client.get(cid)
    for i in range(2):
        want = expected_keys(llm, pre, slice(5, n), np.arange(2, n - 3))[i]
        np.testing.assert_allclose(g.k(i)[2:], want, rtol=1e-5, atol=1e-5)


def test_edit_errors_raise_with_code_names(client, uid, llm):
    name, cid, toks, pre, kv = setup_ctx(client, llm, uid)
    n = len(toks)
    before = client.get(cid)

    def refused(exc, code, cname, call):
        with pytest.raises(exc) as e:
            call()
        assert e.value.code == code and e.value.name == cname and e.value.message
        return e.value

    refused(kvrope.InvalidArgument, 15, "E_INVALID",
            lambda: client.edit(cid, [(4, 8, [1]), (6, 9, [2])]))          # overlapping
    refused(kvrope.InvalidArgument, 15, "E_INVALID", lambda: client.edit(cid, [(3, 3, [])]))
    refused(kvrope.RangeError, 11, "E_RANGE", lambda: client.edit_plan(cid, [(n, n + 1, [1])]))
    refused(kvrope.UnknownContext, 7, "E_UNKNOWN_CONTEXT",
            lambda: client.edit(f"nope-{uid}", [(0, 1, [1])]))
    # KV for the wrong shape (3 layers): the daemon refuses, nothing changes
    kv3 = np.zeros((3, 2, 1, 2, 32), np.float32)
    e = refused(kvrope.ShapeMismatch, 9, "E_SHAPE", lambda: client.edit(cid, [(0, 1, [7])], kv3))
    assert e.message
    other = f"ed-other-{uid}"
    client.register_model(other, L.make_config("linear"), dtype="f32")
    with pytest.raises(kvrope.KvropeError) as e:              # the context is another model's
        client.edit(cid, [(0, 1, [7])], model=other)
    assert e.value.code > 0 and e.value.name.startswith("E_")
    # the context is byte-identical after every refusal
    after = client.get(cid)
    assert np.array_equal(after.data, before.data) and not after.flags.any()
    assert after.tokens.tolist() == toks


def test_edit_validation_raises_before_sending(client, uid, llm):
    name, cid, toks, pre, kv = setup_ctx(client, llm, uid)
    s0 = client.stats()["requests_total"]
    one = np.zeros((2, 2, 1, 2, 32), np.float32)
    with pytest.raises(ValueError):
        client.edit(cid, [(0, 1, [1, 2])], one)                # 1 token of KV for 2 new
    with pytest.raises(ValueError):
        client.edit(cid, [(0, 1, [])], one)                    # KV but nothing inserted
    with pytest.raises(ValueError):
        client.edit(cid, [(0, 1, [1])], np.zeros((2, 2, 1, 2, 16), np.float32), model=name)
    with pytest.raises(ValueError):
        client.edit(cid, [(5, 4, [1])])                        # reversed
    with pytest.raises(ValueError):
        client.edit(cid, [])
    with pytest.raises(TypeError):
        client.edit(cid, [(0, 1)])
    with pytest.raises(ValueError):
        client.edit(cid, [(0, 1, [1 << 33])])                  # not a uint32 id
    with pytest.raises(TypeError):
        client.edit(cid, [(0, 1, [1])], one.astype(np.float64))   # float64 needs a dtype
    with pytest.raises(TypeError):
        client.refresh(cid, 0, 1)                              # refresh needs KV
    with pytest.raises(ValueError):
        client.refresh(cid, 0, 2, one)
    assert client.stats()["requests_total"] == s0 + 1          # only the stats call


def test_single_op_forms_and_dict_ops(client, uid, llm):
    name, cid, toks, pre, kv = setup_ctx(client, llm, uid)
    p1 = client.edit_plan(cid, (1, 2, [65]))
    p2 = client.edit_plan(cid, [{"start": 1, "end": 2, "tokens": [65]}])
    assert p1 == p2 and p1.spans[0].first_pos == 1
    # k=/v= form and dtype conversion on the wire
    past = client.get(cid, 0, 1).pairs()
    _, kvn = llm.forward([65], positions=p1.positions, past=past)
    k = np.stack([x[0] for x in kvn])
    v = np.stack([x[1] for x in kvn])
    r = client.edit(cid, (1, 2, [65]), k=k, v=v, dtype="f16")
    assert r.n_new == 1 and r.n_pending == 0
    g = client.get(cid, 1, 2)
    np.testing.assert_allclose(g.k(0), kvn[0][0], rtol=2e-3, atol=2e-3)


# ---- examples/editor.py (use case 2) end to end ------------------------------------

def test_editor_example(kvroped, client):
    """examples/editor.py: 20 consecutive edits through kvrope.EditSession
    (a small file cut keeps the full re-encodes it compares against cheap)."""
    import re
    import subprocess
    from conftest import PYTHON, ROOT
    need_edit(client)
    env = dict(os.environ)
    r = subprocess.run([PYTHON, os.path.join(ROOT, "examples", "editor.py"),
                        "--socket", kvroped.socket, "--bytes", "1000", "--max-age", "6"],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "encoded client/llama/worker_diff.c (first" in out and "(create)" in out
    for i in range(1, 21):
        assert f"\nedit {i}: " in out
    assert "edit 21: " not in out
    assert "rename '" in out and "delete the line" in out
    renames = [(int(a), int(b)) for a, b in
               re.findall(r"rename '[^']+' to '[^']+' \((\d+) sites\)\n  (\d+) op", out)]
    assert renames and all(n_ops <= sites for sites, n_ops in renames)
    assert max(n_ops for _, n_ops in renames) > 1      # a rename is one op per site
    diffs = [float(x) for x in re.findall(r"max \|logit diff\| = ([0-9.e+-]+)", out)]
    assert len(diffs) == 20 and all(np.isfinite(diffs))
    assert len(re.findall(r"argmax (agrees|differs)", out)) == 20
    ages = [int(x) for x in re.findall(r"the oldest (\d+) edit", out)]
    assert len(ages) == 20 and max(ages) <= 6
    shares = [float(x) for x in re.findall(r"computed \d+ of \d+ tokens \(([0-9.]+)%\)", out)]
    assert len(shares) == 20 and float(np.median(shares)) < 15.0
    assert "0 approximate left" in out and "-> exact" in out
    assert out.rstrip().endswith("the policy's refreshes")


def test_editor_without_daemon_exits_2(tmp_path):
    import subprocess
    from conftest import PYTHON, ROOT
    r = subprocess.run([PYTHON, os.path.join(ROOT, "examples", "editor.py"),
                        "--socket", str(tmp_path / "none.sock")], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "make run" in r.stderr
