"""The shared tier from Python: put(share=True / share_sync=True) on node A,
get and match on node B, through a 3+3 Redis Cluster on loopback that the
test starts (scripts/redis-cluster.sh) and stops. Skipped if redis-server
is not installed."""
import os
import shutil
import subprocess
import tempfile
import time

import numpy as np
import pytest

from conftest import ROOT

SCRIPT = os.path.join(ROOT, "scripts", "redis-cluster.sh")
NL, NH, HD = 2, 2, 32


@pytest.fixture(scope="module")
def cluster():
    if not shutil.which("redis-server"):
        pytest.skip("redis-server is not installed")
    d = tempfile.mkdtemp(prefix="kvr-pyrcl-")
    out = subprocess.run([SCRIPT, "start", d, str(os.getpid())], capture_output=True,
                         text=True, timeout=120)
    if out.returncode:
        pytest.fail("cluster did not start: " + out.stderr)
    ports = out.stdout.split()
    yield f"redis://127.0.0.1:{ports[0]},127.0.0.1:{ports[1]}"
    subprocess.run([SCRIPT, "stop", d], timeout=60)
    shutil.rmtree(d, ignore_errors=True)


def test_share_a_to_b(cluster, daemon_factory):
    kvrope = pytest.importorskip("kvrope")
    a = daemon_factory("--remote-tier", cluster)
    b = daemon_factory("--remote-tier", cluster)
    kv = np.random.default_rng(1).standard_normal((NL, 2, 150, NH, HD)).astype(np.float16)
    tokens = list(range(500, 650))
    with kvrope.connect(a.socket) as ca, kvrope.connect(b.socket) as cb:
        for c in (ca, cb):
            c.register_model("m", n_layers=NL, n_kv_heads=NH, head_dim=HD, dtype="f16")
        ca.put("py-doc", "m", tokens, kv, share_sync=True)
        got = cb.get("py-doc", dtype="f16")
        assert np.array_equal(got.data, ca.get("py-doc", dtype="f16").data)
        hit = cb.match("m", tokens + [1, 2, 3])
        assert hit.length in (128, 150)      # 150: the fetched context itself
        # Asynchronous: visible a little later.
        ca.put("py-later", "m", tokens[:70], kv[:, :, :70], share=True)
        for _ in range(200):
            try:
                cb.get("py-later", dtype="f16", meta_only=True)
                break
            except kvrope.UnknownContext:
                time.sleep(0.02)
        else:
            pytest.fail("the async share never showed up on B")


def test_share_without_remote_tier_is_refused(daemon_factory):
    kvrope = pytest.importorskip("kvrope")
    d = daemon_factory()
    kv = np.zeros((NL, 2, 4, NH, HD), np.float16)
    with kvrope.connect(d.socket) as c:
        c.register_model("m", n_layers=NL, n_kv_heads=NH, head_dim=HD, dtype="f16")
        with pytest.raises(kvrope.UnsupportedByDaemon, match="remote-tier"):
            c.put("x", "m", [1, 2, 3, 4], kv, share=True)
        with pytest.raises(kvrope.UnknownContext):
            c.get("x", meta_only=True)
