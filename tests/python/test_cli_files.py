"""kvrope's file inputs (issue 31): .npy KV and token files, `kvrope
payload`, and the errors that say what to do. Bad input gets a clear error
and loses nothing stored. Uses the session daemon of conftest.py through the
CLI (KVROPE_SOCKET), numpy only.
"""
import io
import json
import os
import subprocess

import numpy as np
import pytest

from conftest import BUILD

KV = os.path.join(BUILD, "kvrope")


@pytest.fixture
def cli(kvroped, uid, tmp_path):
    if not os.access(KV, os.X_OK):
        pytest.skip("build/kvrope is not built")
    env = dict(os.environ, KVROPE_SOCKET=kvroped.socket)

    def run(*args, ok=True):
        r = subprocess.run([KV, *map(str, args)], capture_output=True, text=True, env=env,
                           timeout=60, cwd=tmp_path)
        if ok:
            assert r.returncode == 0, (args, r.stdout, r.stderr)
        return r
    model = f"m{uid}"
    run("models", "add", model, "--layers", 2, "--heads", 2, "--head-dim", 16, "--dtype", "f16")
    run.model, run.dir = model, tmp_path
    return run


def test_payload_is_seeded_and_in_range(cli):
    cli("payload", "--model", cli.model, "--tokens", "1,2,3", "--random", 5, "-o", "a.npy")
    cli("payload", "--model", cli.model, "--tokens", "1,2,3", "--random", 5, "-o", "b.npy")
    cli("payload", "--model", cli.model, "--tokens", "1,2,3", "--random", 6, "-o", "c.npy")
    a, b, c = (np.load(cli.dir / f) for f in ("a.npy", "b.npy", "c.npy"))
    assert a.shape == (2, 2, 3, 2, 16) and a.dtype == np.float16
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    assert a.min() >= -1 and a.max() <= 1 and a.std() > 0.3


def test_npy_round_trip_and_payload_from(cli, uid):
    kv = np.random.default_rng(0).standard_normal((2, 2, 4, 2, 16)).astype(np.float32)
    np.save(cli.dir / "kv.npy", kv)
    np.save(cli.dir / "ids.npy", np.array([7, 8, 9, 10], np.int32))
    cli("put", f"n{uid}", "kv.npy", "--model", cli.model, "--tokens-file", "ids.npy")
    cli("get", f"n{uid}", "-o", "back.npy", "--dtype", "f32")
    back = np.load(cli.dir / "back.npy")
    # Stored as the model's f16: equal to the f16 rounding of what was put.
    assert np.array_equal(back, kv.astype(np.float16).astype(np.float32))
    cli("payload", "--model", cli.model, "--tokens", "7,8,9,10", "--from", "kv.npy",
        "-o", "from.safetensors")
    cli("put", f"s{uid}", "from.safetensors")
    cli("get", f"s{uid}", "-o", "s.npy", "--dtype", "f32")
    assert np.array_equal(np.load(cli.dir / "s.npy"), back)
    assert json.loads(cli("stat", f"s{uid}", "--json").stdout)["n_tokens"] == 4


def npy_bytes(a, fortran=False):
    b = io.BytesIO()
    np.save(b, np.asfortranarray(a) if fortran else a)
    return b.getvalue()


@pytest.mark.parametrize("case,data,want", [
    ("shape", npy_bytes(np.zeros((2, 3, 2, 16), np.float16)), "shape [layers, 2, tokens"),
    ("dtype", npy_bytes(np.zeros((2, 2, 2, 2, 16), np.float64)), "'<f8' is not supported"),
    ("fortran", npy_bytes(np.zeros((2, 2, 2, 2, 16), np.float16), True), "Fortran order"),
    ("truncated", npy_bytes(np.zeros((2, 2, 2, 2, 16), np.float16))[:-10], "the shape needs"),
    ("magic", b"not an npy file at all", "no \\x93NUMPY magic"),
])
def test_bad_npy_is_refused_clearly(cli, uid, case, data, want):
    ctx = f"keep{uid}"
    cli("payload", "--model", cli.model, "--tokens", "1,2", "-o", "ok.safetensors")
    cli("put", ctx, "ok.safetensors")
    (cli.dir / "bad.npy").write_bytes(data)
    r = cli("put", ctx, "bad.npy", "--model", cli.model, "--tokens", "3,4", "--mode", "append",
            ok=False)
    assert r.returncode in (1, 2), r
    assert want in r.stderr, r.stderr
    assert "bad.npy" in r.stderr
    assert json.loads(cli("stat", ctx, "--json").stdout)["n_tokens"] == 2   # nothing lost


def test_bad_token_npy_and_payload_usage(cli):
    np.save(cli.dir / "f.npy", np.array([1.0, 2.0], np.float32))
    r = cli("payload", "--model", cli.model, "--tokens-file", "f.npy", "-o", "x.npy", ok=False)
    assert r.returncode == 1 and "1-D integer array" in r.stderr, r.stderr
    r = cli("payload", "--model", cli.model, "-o", "x.npy", ok=False)
    assert r.returncode == 2 and "--tokens" in r.stderr
    r = cli("payload", "--model", cli.model, "--tokens", "1", "--random", 1, "--from", "f.npy",
            "-o", "x.npy", ok=False)
    assert r.returncode == 2 and "not both" in r.stderr
    r = cli("payload", "--model", "no-such-model", "--tokens", "1", "-o", "x.npy", ok=False)
    assert r.returncode == 3
    cli("payload", "--model", cli.model, "--tokens", "1,2", "-o", "k.npy")
    r = cli("payload", "--model", cli.model, "--tokens", "1,2,3", "--from", "k.npy", "-o", "y.bin",
            ok=False)
    assert r.returncode == 1 and "needs [2, 2, 3, 2, 16]" in r.stderr, r.stderr


def test_get_npy_refuses_bf16(cli, uid):
    cli("payload", "--model", cli.model, "--tokens", "1,2", "-o", "p.safetensors")
    cli("put", f"b{uid}", "p.safetensors")
    r = cli("get", f"b{uid}", "-o", "x.npy", "--dtype", "bf16", ok=False)
    assert r.returncode == 2 and "no bf16" in r.stderr and ".safetensors" in r.stderr, r.stderr


def test_cannot_connect_says_what_to_do(tmp_path):
    if not os.access(KV, os.X_OK):
        pytest.skip("build/kvrope is not built")
    env = {k: v for k, v in os.environ.items() if k != "KVROPE_SOCKET"}
    env["XDG_RUNTIME_DIR"] = str(tmp_path)
    r = subprocess.run([KV, "ping"], capture_output=True, text=True, env=env, timeout=30)
    assert r.returncode == 4
    sock = f"{tmp_path}/kvrope/kvroped.sock"
    assert "is kvroped running?" in r.stderr and f"make run` starts it on {sock}" in r.stderr, r.stderr
    r = subprocess.run([KV, "--socket", "/nonexistent/x.sock", "ping"], capture_output=True,
                       text=True, env=env, timeout=30)
    assert r.returncode == 4 and "(this tried another path)" in r.stderr and "--socket" in r.stderr
