"""Seam repair on the committed trained model (eval/model), in the numpy Llama
(examples/llama.py: llama.repair) and through llama.cpp (`kvrope-llama
repair`, client/llama/worker_repair.c). No daemon: chunks cached in prompt A
are placed in prompt B by re-rotating their keys (the daemon's rotation,
llama.reposition_kv), B's header and question are gaps. What holds whatever
the numbers:

  - numpy: with every token repaired the logits equal a full encode's, bit
    for bit (the same forward over the same tokens and positions);
  - numpy and llama.cpp: no policy makes the mean KL from a full encode larger
    than no repair;
  - both engines choose the same EPIC set for the same placed runs, and
    llama.cpp's `all` equals its full encode;
  - the CLI refuses bad policies and KV files that do not fit the prompt.
"""
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import pytest

from conftest import BUILD, ROOT

sys.path.insert(0, os.path.join(ROOT, "eval"))
sys.path.insert(0, os.path.join(ROOT, "examples"))
import corpus  # noqa: E402
import engines as E  # noqa: E402
import llama as L  # noqa: E402

MODEL = os.path.join(ROOT, "eval", "model")
GGUF = os.path.join(BUILD, "eval", "kvrope-code.gguf")
WORKER = os.path.join(BUILD, "kvrope-llama")
# Float noise of the repair path against a full encode (llama.cpp: 1e-4 of
# the logits). On the retrained model (session 8) the placed chunks of this
# case cost only ~2e-7 nats, below this bound, so "never hurts" is a weak
# check on it until the case has a continuation that depends on the chunks.
KL_EPS = 1e-6

HDR_A = b"# retrieved for the question below\n"
HDR_B = b"# file: lib/textwrap_helpers.py\n"
CHUNKS = [b"def indent(text, prefix, predicate=None):\n    if predicate is None:\n"
          b"        def predicate(line):\n            return line.strip()\n",
          b"    def prefixed_lines():\n        for line in text.splitlines(True):\n"
          b"            yield (prefix + line if predicate(line) else line)\n",
          b"def dedent(text):\n    margin = None\n    indents = _leading_re.findall(text)\n"]
QUESTION = b"\n# and now the function that wraps a paragraph:\ndef wrap("
CONT = b"text, width=70, **kwargs):\n    w = TextWrapper(width=width, **kwargs)\n"
ORDER_B = [2, 0, 1]
POLICIES = ["epic:4", "epic:16", "blend:0.05", "blend:0.15", "epic:8+blend:0.1"]


def _llama_ok():
    if not (os.path.exists(GGUF) and os.access(WORKER, os.X_OK)):
        return False
    r = subprocess.run([WORKER, "--help"], capture_output=True, text=True)
    return "repair" in (r.stdout + r.stderr)


def kl(ref, x):
    rp, lp = E.log_softmax(ref), E.log_softmax(x)
    return float((np.exp(rp) * (rp - lp)).sum(-1).mean())


@pytest.fixture(scope="module")
def model():
    return L.load_model(MODEL)


@pytest.fixture(scope="module")
def case(model):
    """Prompts, the placed KV of B's chunks (from A's encode, re-rotated), masks."""
    ct = [corpus.encode(c, bos=False) for c in CHUNKS]
    A = [corpus.encode(HDR_A)]
    off_a = {}
    for i, c in enumerate(ct):
        off_a[i] = sum(len(x) for x in A)
        A.append(c)
    A = np.concatenate(A).astype(np.int32)
    B = [corpus.encode(HDR_B)]
    off_b = {}
    for i in ORDER_B:
        off_b[i] = sum(len(x) for x in B)
        B.append(ct[i])
    B.append(corpus.encode(QUESTION, bos=False))
    B = np.concatenate(B).astype(np.int32)
    cont = corpus.encode(CONT, bos=False)
    _, kv_a = model.forward(A, positions=np.arange(len(A)))
    n = len(B)
    kv = [(np.zeros((n,) + k.shape[1:], np.float32), np.zeros((n,) + v.shape[1:], np.float32))
          for k, v in kv_a]
    placed = np.zeros(n, bool)
    run_start = np.zeros(n, bool)
    pos, parts = [], []
    for i in ORDER_B:
        a0, b0, m = off_a[i], off_b[i], len(ct[i])
        piece = L.kv_slice(kv_a, a0, a0 + m)
        moved = model.reposition_kv(piece, np.arange(a0, a0 + m), np.arange(b0, b0 + m))
        for li, (k, v) in enumerate(moved):
            kv[li][0][b0:b0 + m] = k
            kv[li][1][b0:b0 + m] = v
        placed[b0:b0 + m] = True
        run_start[b0] = True
        pos.append(np.arange(b0, b0 + m))
        parts.append(moved)
    return {"B": B, "cont": cont, "kv": kv, "placed": placed, "run_start": run_start,
            "runs": sorted(off_b.values())}


def numpy_rows(model, c, policy):
    """Logits predicting cont[0..] after B repaired by policy (None: full encode)."""
    B, cont = c["B"], c["cont"]
    if policy is None:
        lg, kv = model.forward(B, positions=np.arange(len(B)))
        last = lg[-1]
    else:
        last, kv, _, st = L.repair(model, B, c["kv"], c["placed"], c["run_start"], policy)
    lg, _ = model.forward(cont[:-1], positions=len(B) + np.arange(len(cont) - 1), past=kv)
    return np.vstack([last[None], lg])


def test_numpy_all_is_full_and_repair_never_hurts(model, case):
    full = numpy_rows(model, case, None)
    assert np.array_equal(numpy_rows(model, case, "all"), full), "all repaired == full encode"
    none = kl(full, numpy_rows(model, case, "none"))
    assert none > 0, f"the placed chunks are approximate (KL {none})"
    for p in POLICIES:
        k = kl(full, numpy_rows(model, case, p))
        print(f"numpy {p}: KL {k:.3g} (no repair {none:.3g})")
        assert k <= none + KL_EPS, f"{p}: repair made the KL larger ({k} > {none})"


def test_numpy_plan_matches_c_plan():
    """llama.repair_plan is kvr__wk_repair_plan (test_llama_repair's cases)."""
    placed = np.array([0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1], bool)
    starts = np.array([0, 0, 1, 0, 0, 0, 0, 1, 0, 0, 0, 1, 0], bool)
    c, k = L.repair_plan(placed, starts, first_k=2)
    assert c.astype(int).tolist() == [1, 1, 1, 1, 0, 0, 0, 1, 1, 0, 1, 1, 1] and k == 6
    placed = np.array([0, 1, 1, 1, 1, 1, 1, 1], bool)
    dev = np.array([99, 0.5, 3, 3, 0.1, np.nan, 2, 0])
    c, k = L.repair_plan(placed, None, dev, blend_share=2 / 7)
    assert c.astype(int).tolist() == [1, 0, 1, 0, 0, 1, 0, 0] and k == 2
    with pytest.raises(ValueError):
        L.parse_repair_policy("blend:2")


def run_cli(tmp, c, kv=None, pos=None, runs=None, policy=None, extra=()):
    tp, lp = os.path.join(tmp, "t.bin"), os.path.join(tmp, "l.bin")
    np.concatenate([c["B"], c["cont"]]).astype("<i4").tofile(tp)
    argv = [WORKER, "--model", GGUF, "--threads", "1", "--json", "repair", "--tokens", tp,
            "--prompt-len", str(len(c["B"])), "--logits-out", lp]
    if kv is not None:
        kp = os.path.join(tmp, "kv.bin")
        E.write_kv_file(kp, kv, pos)
        argv += ["--kv", kp]
    if runs:
        argv += ["--runs", ",".join(map(str, runs))]
    if policy:
        argv += ["--policy", policy]
    argv += list(extra)
    r = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    return r, (np.fromfile(lp, "<f4").reshape(-1, 267) if r.returncode == 0 else None)


@pytest.fixture(scope="module")
def llama_case(case):
    if not _llama_ok():
        if os.environ.get("KVR_REQUIRE_LLAMA") == "1":
            pytest.fail(f"KVR_REQUIRE_LLAMA=1 but {WORKER} repair or {GGUF} is missing")
        pytest.skip("kvrope-llama repair or the eval GGUF is not built")
    pos = np.flatnonzero(case["placed"]).astype(np.int64)
    kv = [(k[pos], v[pos]) for k, v in case["kv"]]
    return dict(case, placed_kv=kv, pos=pos)


def test_llama_all_is_full_and_repair_never_hurts(llama_case):
    c = llama_case
    with tempfile.TemporaryDirectory() as tmp:
        r, full = run_cli(tmp, c)
        assert r.returncode == 0, r.stderr
        r, allr = run_cli(tmp, c, c["placed_kv"], c["pos"], c["runs"], "all")
        assert r.returncode == 0, r.stderr
        assert np.abs(allr - full).max() <= 1e-4 * np.abs(full).max(), "all == full encode"
        r, none = run_cli(tmp, c, c["placed_kv"], c["pos"], c["runs"], "none")
        k_none = kl(full, none)
        assert k_none > 0
        for p in POLICIES:
            r, x = run_cli(tmp, c, c["placed_kv"], c["pos"], c["runs"], p)
            assert r.returncode == 0, r.stderr
            rep = json.loads(r.stdout.strip().splitlines()[-1])["repair"]
            k = kl(full, x)
            print(f"llama.cpp {p}: KL {k:.3g} (no repair {k_none:.3g}), repaired {rep['repaired']}")
            assert k <= k_none + KL_EPS, f"{p}: repair made the KL larger ({k} > {k_none})"
            if p.startswith("epic:") and "+" not in p:
                want = L.repair_plan(c["placed"], c["run_start"], first_k=int(p[5:]))[1]
                assert rep["repaired"] == want, "the engines choose the same EPIC set"


def test_llama_cli_refuses_bad_input(llama_case):
    c = llama_case
    with tempfile.TemporaryDirectory() as tmp:
        r, _ = run_cli(tmp, c, c["placed_kv"], c["pos"], c["runs"], "blend:7")
        assert r.returncode == 1 and "repair policy" in r.stderr
        bad = c["pos"].copy()
        bad[-1] = len(c["B"]) + 3
        r, _ = run_cli(tmp, c, c["placed_kv"], bad, None, "none")
        assert r.returncode == 1 and "not in the prompt" in r.stderr
        r, _ = run_cli(tmp, c, c["placed_kv"], c["pos"], [0], "none")
        assert r.returncode == 1 and "--runs" in r.stderr
        assert not os.path.exists(os.path.join(tmp, "l.bin"))
