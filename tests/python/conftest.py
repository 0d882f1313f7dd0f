"""Shared pytest fixtures for kvrope's Python tests.

  ROOT, BUILD          repo root; the build dir ($KVR_BUILD, set by the test
                       runner; default <repo>/build)
  Daemon(*flags)       a kvroped from BUILD on a fresh temporary Unix socket
                       (.socket, .addr, .proc, .log(), .stop() -> exit status)
  kvroped              session-scoped Daemon shared by the tests (SIGTERM at
                       teardown; the daemon must exit 0)
  daemon_factory       function-scoped: daemon_factory(*flags) -> Daemon, each
                       stopped at teardown (for flags like --listen / auth)
  client               a kvrope.Client connected to `kvroped` (closed after)
  uid                  a unique string for context ids / model names in the
                       shared daemon
  free_tcp_port()      a free loopback port (from procs.py, the process helpers
                       conftest shares with tests/bench and eval/run.py)

sys.path gets client/python (the kvrope package) and examples/ (llama.py);
KVROPE_LIB defaults to $KVR_BUILD/libkvrope.so so the binding uses the
library of the same build as the daemon.
"""
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid

import pytest

# free_tcp_port: the tests import it from here
from procs import free_tcp_port, stop_process, unix_socket_answers  # noqa: F401

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BUILD = os.path.abspath(os.environ.get("KVR_BUILD") or os.path.join(ROOT, "build"))
PYTHON = "/usr/bin/python3"

for p in (os.path.join(ROOT, "examples"), os.path.join(ROOT, "client", "python")):
    if p not in sys.path:
        sys.path.insert(0, p)
if not os.environ.get("KVROPE_LIB") and os.path.exists(os.path.join(BUILD, "libkvrope.so")):
    os.environ["KVROPE_LIB"] = os.path.join(BUILD, "libkvrope.so")


class Daemon:
    """kvroped on a temporary socket. Extra command-line flags are passed through."""

    def __init__(self, *flags, build=BUILD, max_memory="256M", ready_timeout=10.0):
        exe = os.path.join(build, "kvroped")
        if not os.access(exe, os.X_OK):
            pytest.skip(f"{exe} is not built (make build/kvroped)")
        self.dir = tempfile.mkdtemp(prefix="kvr-py-")     # short: sun_path is 108 bytes
        self.socket = os.path.join(self.dir, "kvroped.sock")
        self.addr = "unix:" + self.socket
        self.log_path = os.path.join(self.dir, "kvroped.log")
        self.argv = [exe, "--socket", self.socket, "--max-memory", max_memory,
                     "--log-level", "warn", *flags]
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + ready_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvroped exited {self.proc.returncode} at start:\n{self.log()}")
            if unix_socket_answers(self.socket):
                break
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"kvroped did not listen on {self.socket}:\n{self.log()}")
            time.sleep(0.02)

    def log(self):
        try:
            with open(self.log_path, "rb") as f:
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def stop(self, timeout=15.0):
        """SIGTERM, wait; SIGKILL if it hangs. Returns the exit status."""
        rc = stop_process(self.proc, timeout)
        self._log.close()
        shutil.rmtree(self.dir, ignore_errors=True)
        return rc


@pytest.fixture(scope="session")
def kvroped():
    d = Daemon()
    yield d
    log = d.log()
    rc = d.stop()
    assert rc == 0, f"kvroped exited {rc} on SIGTERM:\n{log}"


@pytest.fixture
def daemon_factory():
    started = []

    def make(*flags, **kw):
        d = Daemon(*flags, **kw)
        started.append(d)
        return d
    yield make
    for d in started:
        d.stop()


@pytest.fixture
def client(kvroped):
    kvrope = pytest.importorskip("kvrope")
    with kvrope.connect(kvroped.socket) as c:
        yield c


@pytest.fixture
def uid():
    return uuid.uuid4().hex[:12]
