#!/usr/bin/python3
"""The ctypes structs of kvrope._lib against client/kvrope.h: a small C
program prints sizeof and offsetof of every struct and field the binding
declares, compiled with the system C compiler; every number must match.

Run: /usr/bin/python3 -m pytest -q tests/python/test_layout.py
"""
import ctypes
import os
import shutil
import subprocess

import pytest

from conftest import ROOT

from kvrope import _lib


def c_layout(tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        pytest.skip("no C compiler")
    lines = ['#include <stdio.h>', '#include <stddef.h>', '#include "client/kvrope.h"',
             'int main(void) {']
    for name, cls in _lib.STRUCTS.items():
        lines.append(f'    printf("{name} %zu %zu\\n", sizeof({name}), _Alignof({name}));')
        for f in cls._fields_:
            lines.append(f'    printf("{name}.{f[0]} %zu\\n", offsetof({name}, {f[0]}));')
    lines += ['    return 0;', '}']
    src = tmp_path / "layout.c"
    src.write_text("\n".join(lines) + "\n")
    exe = tmp_path / "layout"
    r = subprocess.run([cc, "-std=c11", "-I", ROOT, "-o", str(exe), str(src)],
                       capture_output=True, text=True)
    assert r.returncode == 0, f"layout probe does not compile (a field renamed?):\n{r.stderr}"
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    got = {}
    for line in out.splitlines():
        key, *nums = line.split()
        got[key] = tuple(int(x) for x in nums)
    return got


def test_ctypes_structs_match_the_header(tmp_path):
    c = c_layout(tmp_path)
    bad = []
    for name, cls in _lib.STRUCTS.items():
        if c[name] != (ctypes.sizeof(cls), ctypes.alignment(cls)):
            bad.append(f"{name}: C sizeof/align {c[name]}, ctypes "
                       f"{(ctypes.sizeof(cls), ctypes.alignment(cls))}")
        for f in cls._fields_:
            off = getattr(cls, f[0]).offset
            if c[f"{name}.{f[0]}"] != (off,):
                bad.append(f"{name}.{f[0]}: C offset {c[name + '.' + f[0]][0]}, ctypes {off}")
    assert not bad, "\n".join(bad)


def test_edit_structs_are_declared():
    for s in ("kvr_edit_range", "kvr_edit_args", "kvr_edit_span_res", "kvr_edit_res",
              "kvr_refresh_args", "kvr_context"):
        assert s in _lib.STRUCTS
    assert os.path.exists(os.path.join(ROOT, "client", "kvrope.h"))


# ---- position layouts through the binding: APE assemble, GPE groups, retention -----

import numpy as np  # noqa: E402

import kvrope  # noqa: E402
import llama as L  # noqa: E402

CFG = L.make_config("default", num_hidden_layers=2, num_key_value_heads=2, head_dim=32)


@pytest.fixture(scope="module")
def llm():
    return L.LlamaModel(CFG, seed=7)


def need(client, fn):
    if not client._lib.has(fn):
        pytest.skip(f"libkvrope without {fn}")


def new_model(client, name, fn):
    """`name` registered with CFG on the shared daemon, the test skipped first
    if libkvrope lacks `fn` (the verb it tests)."""
    need(client, fn)
    client.register_model(name, CFG, dtype="f32")
    return name


def rag_setup(client, llm, uid, docs=("Doc A: cats purr.\n", "Doc B: dogs bark loudly.\n")):
    name = new_model(client, f"lay-{uid}", "kvr_client_assemble")
    pre = L.encode("System: answer from the documents.\n")
    _, kvp = llm.forward(pre)
    client.put(f"p-{uid}", name, pre, kvp, mode="create")
    out = []
    for i, d in enumerate(docs):
        t = L.encode(d)
        P = len(pre)
        _, kvd, pk = llm.forward(t, positions=np.arange(P, P + len(t)), past=kvp,
                                 return_pre_rope=True)
        r = client.put(f"d{i}-{uid}", name, t, kvd, mode="create", prefix=f"p-{uid}")
        assert (r.first_pos, r.last_pos) == (P, P + len(t) - 1)
        out.append((t, kvd, pk))
    return name, pre, kvp, out


def test_assemble_parallel_and_sequential(client, llm, uid):
    name, pre, kvp, docs = rag_setup(client, llm, uid)
    P = len(pre)
    ids = [f"d{i}-{uid}" for i in range(len(docs))]
    lay = client.layout(ids[0])
    assert lay.prefix_ctx == f"p-{uid}" and lay.prefix_len == P and not lay.groups
    a = client.assemble(f"p-{uid}", ids)
    lens = [len(t) for t, _, _ in docs]
    kinds = [s.kind for s in a.segments]
    assert kinds == ["prefix", "document", "document", "query"]
    assert a.query_pos == P + max(lens) and a.prefix_len == P
    assert (a.temperature, a.scale, a.temperature_folded) == (0.9, 0.9, False)
    d0, d1 = a.segments[1], a.segments[2]
    assert (d0.start, d0.n_tokens, d0.pos_first, d0.ctx_id) == (P, lens[0], P, ids[0])
    assert (d1.start, d1.pos_first, d1.doc_index) == (P + lens[0], P, 1)
    assert a.kv.tokens.tolist() == pre + docs[0][0] + docs[1][0]
    assert not a.kv.flags.any()                       # parallel: every doc where it was encoded
    assert a.document_mask().sum() == sum(lens)
    for i in range(2):                                # keys exactly as stored
        np.testing.assert_array_equal(a.kv.k(i)[:P], kvp[i][0])
        np.testing.assert_array_equal(a.kv.k(i)[d1.start:d1.end], docs[1][1][i][0])

    s = client.assemble(f"p-{uid}", ids, layout="sequential", temperature=1.0, scale=1.0)
    assert s.query_pos == P + sum(lens)
    assert s.kv.positions.tolist() == list(range(P + sum(lens)))
    assert not s.kv.flags[:P + lens[0]].any() and s.kv.approximate[P + lens[0]:].all()
    d1 = s.segments[2]
    for i in range(2):                                # doc 1 re-rotated after doc 0
        want = llm.apply_rope(docs[1][2][i], np.arange(d1.pos_first, d1.pos_last + 1))
        np.testing.assert_allclose(s.kv.k(i)[d1.start:d1.end], want, rtol=1e-5, atol=1e-5)

    e = client.assemble(f"p-{uid}", ids, layout="explicit", starts=[P, P + 100], meta_only=True)
    assert e.kv.data is None and e.segments[2].pos_first == P + 100
    f = client.assemble(f"p-{uid}", ids[:1], fold_temperature=True, temperature=0.5)
    assert f.temperature_folded
    np.testing.assert_allclose(f.kv.k(0)[P:], docs[0][1][0][0] / 0.5, rtol=1e-6)


def test_assemble_refusals(client, llm, uid):
    name, pre, kvp, docs = rag_setup(client, llm, uid)
    other = L.encode("Another prefix.\n")
    _, kvo = llm.forward(other)
    client.put(f"q-{uid}", name, other, kvo, mode="create")
    with pytest.raises(kvrope.PrefixMismatch) as e:
        client.assemble(f"q-{uid}", [f"d0-{uid}"])
    assert e.value.name == "E_PREFIX" and e.value.code == 23 and f"d0-{uid}" in e.value.message
    with pytest.raises(kvrope.UnknownContext):
        client.assemble(f"p-{uid}", [f"nope-{uid}"])
    with pytest.raises(ValueError):
        client.assemble(f"p-{uid}", [f"d0-{uid}"], layout="explicit")     # no starts
    with pytest.raises(ValueError):
        client.assemble(f"p-{uid}", [])
    with pytest.raises(ValueError):
        client.assemble(f"p-{uid}", [f"d0-{uid}"], layout="diagonal")


def test_group_append_positions(client, llm, uid):
    name = new_model(client, f"grp-{uid}", "kvr_client_group_append")
    src, tgt = L.encode("Hallo Welt"), L.encode("Hello world")
    _, ks = llm.forward(src)
    _, kt = llm.forward(tgt)
    cid = f"g-{uid}"
    r = client.group_append(cid, name, "src", src[:4], L.kv_slice(ks, 0, 4),
                            groups=["src", "tgt"], group_offsets=[0, 1000])
    assert (r.first_pos, r.last_pos) == (0, 3)
    r = client.group_append(cid, name, "tgt", tgt[:3], L.kv_slice(kt, 0, 3))
    assert (r.first_index, r.first_pos, r.last_pos) == (4, 1000, 1002)
    r = client.group_append(cid, name, "src", src[4:], L.kv_slice(ks, 4))
    assert (r.first_pos, r.last_pos) == (4, len(src) - 1)
    g = client.get(cid)
    assert g.groups.tolist() == [0] * 4 + [1] * 3 + [0] * (len(src) - 4)
    np.testing.assert_array_equal(g.k(0)[7:], ks[0][0][4:])   # keys where they were computed
    lay = client.set_group_offset(cid, "tgt", 2000)
    assert [(x.name, x.offset, x.cursor) for x in lay.groups] == \
        [("src", 0, len(src)), ("tgt", 2000, 3)]
    r = client.group_append(cid, name, "tgt", tgt[3:4], L.kv_slice(kt, 3, 4))
    assert r.first_pos == 2003
    with pytest.raises(kvrope.KvropeError) as e:
        client.group_append(cid, name, "nope", tgt[:1], L.kv_slice(kt, 0, 1))
    assert e.value.code > 0


def test_retention_sinks_and_window(client, llm, uid):
    name = new_model(client, f"ret-{uid}", "kvr_client_set_retention")
    t = L.encode("abcdefghij")
    _, kv = llm.forward(t)
    cid = f"r-{uid}"
    client.put(cid, name, t[:6], L.kv_slice(kv, 0, 6), mode="create")
    lay = client.set_retention(cid, sinks=2, window=3)
    assert lay.retention and (lay.sinks, lay.window) == (2, 3)
    client.put(cid, name, t[6:], L.kv_slice(kv, 6), mode="append")
    g = client.get(cid, meta_only=True)
    # StreamingLLM: the window is renumbered to follow the sinks (positions within the cache)
    assert L.decode(g.tokens) == "abhij" and g.positions.tolist() == [0, 1, 2, 3, 4]
    assert client.layout(cid).n_dropped == 5
    assert not client.set_retention(cid, off=True).retention


# ---- examples/rag.py (use case 3) end to end ---------------------------------------

def test_rag_example(kvroped, client):
    import re
    import subprocess
    from conftest import PYTHON
    need(client, "kvr_client_assemble")
    for run in (1, 2):                                # the second run reuses every document
        r = subprocess.run([PYTHON, os.path.join(ROOT, "examples", "rag.py"),
                            "--socket", kvroped.socket], capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        out = r.stdout
        assert "parallel layout: the daemon assembled" in out
        assert "sequential layout: the daemon assembled" in out
        assert "APE with T = S = 1 vs ordinary attention: max |diff| = 0 -> identical" in out \
            or "-> identical" in out
        assert "re-rotated (approximate)" in out and "T=0.9 S=0.9" in out
        assert len(re.findall(r"max \|logit diff\| = [0-9.e+-]+; argmax (agrees|differs)", out)) == 2
        assert "OK: documents were encoded once" in out
        if run == 2:
            assert "this run encoded 0 of them" in out


# ---- examples/streaming.py (use case 4) end to end ---------------------------------

@pytest.mark.parametrize("offset", [0, 1000])
def test_streaming_example(kvroped, client, offset):
    import subprocess
    from conftest import PYTHON
    need(client, "kvr_client_group_append")
    r = subprocess.run([PYTHON, os.path.join(ROOT, "examples", "streaming.py"),
                        "--socket", kvroped.socket, "--target-offset", str(offset)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "step 4: source 'schnurrt.' -> group src at positions 31..39" in out
    assert "group src: 40 tokens at positions 0..39 (contiguous)" in out
    assert f"group tgt: 16 tokens at positions {offset}..{offset + 15} (contiguous)" in out
    assert "-> identical" in out and "OK: both streams kept their own positions" in out


def test_put_records_the_v_layout(client, llm, uid):
    # v_trans=True on create is a record the context keeps (llama export's
    # default layout), a fork copies it, an append cannot change it, and a
    # context put without it records False.
    name = new_model(client, f"vt-{uid}", "kvr_client_layout_stat")
    t = L.encode("def f(x):\n    return x\n")
    _, kv = llm.forward(t)
    client.put(f"vt1-{uid}", name, t, kv, mode="create", v_trans=True)
    client.put(f"vt0-{uid}", name, t, kv, mode="create")
    assert client.layout(f"vt1-{uid}").v_trans is True
    assert client.layout(f"vt0-{uid}").v_trans is False
    client.fork(f"vt1-{uid}", f"vt2-{uid}")
    assert client.layout(f"vt2-{uid}").v_trans is True
    t2 = L.encode("#")
    _, kv2 = llm.forward(t2, positions=np.arange(len(t), len(t) + len(t2)), past=kv)
    client.put(f"vt0-{uid}", name, t2, kv2, mode="append", v_trans=True)
    assert client.layout(f"vt0-{uid}").v_trans is False
