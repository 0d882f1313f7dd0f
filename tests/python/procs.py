"""The server processes kvrope's Python harnesses start (kvroped, kvrope
serve, llama-server): a free loopback port, whether a Unix socket answers,
waiting for an HTTP server's /health, and stopping a process with SIGTERM
(SIGKILL if it hangs). conftest.py, the benches in tests/bench and eval/run.py
all use these, so this module keeps to the standard library and does nothing
on import (unlike conftest.py, which imports pytest and sets KVROPE_LIB).
"""
import http.client
import os
import signal
import socket
import subprocess
import time


def free_tcp_port():
    """A loopback TCP port nothing listens on now (free until someone binds it)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def unix_socket_answers(path):
    """Whether something accepts connections on the Unix socket at `path`."""
    if not os.path.exists(path):
        return False
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        return True
    except OSError:
        return False
    finally:
        s.close()


def wait_health(port, proc, what, timeout=300):
    """Returns once GET /health on 127.0.0.1:port answers 200; RuntimeError
    if `proc` exits first or `timeout` seconds pass (`what` names it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited {proc.returncode}")
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{what} not ready")


def stop_process(proc, timeout=15.0):
    """SIGTERM, wait up to `timeout` seconds; SIGKILL if it hangs. Returns
    the exit status (a process already gone keeps the one it had)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode
