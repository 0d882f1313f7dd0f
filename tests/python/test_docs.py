"""The documentation runs as written (issue 31).

Every fenced block of README.md and then docs/*.md whose info string says
`runnable` (```sh runnable, ```python runnable, ```c runnable file=NAME) is
run in document order against a daemon started by scripts/run-daemon.sh --
what `make run` runs -- on a temporary socket and disk directory, from one
scratch directory whose entries link the checkout's (build/ -> $KVR_BUILD),
so `build/kvrope`, `client/python` and `examples/` read as in a checkout.
KVROPE_SOCKET names the daemon's socket (the CLI, Python and C default to
it); blocks that need kvrope-llama's HTTP server (`serve`) get the test's
own port in place of make run's 127.0.0.1:8012, and are skipped, with the
reason, when this kvrope-llama has no serve subcommand; `llama` blocks need
build/kvrope-llama. Each block is bounded in time.

Also here: make run's script prints the socket the CLI finds by default,
sets up the disk tier, and SIGTERM stops everything it started; and
test_make_run_from_a_fresh_clone, which types `make run` in a git clone and
then runs every README block there (its docstring says what it reuses).
"""
import glob
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time

import pytest

from conftest import BUILD, PYTHON, ROOT, free_tcp_port

RUN = os.path.join(ROOT, "scripts", "run-daemon.sh")
SERVE_ADDR = "127.0.0.1:8012"       # make run's default, as the blocks write it
BLOCK_TIMEOUT = 180

FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.S | re.M)


def doc_files(root=ROOT):
    return [os.path.join(root, "README.md")] + sorted(glob.glob(os.path.join(root, "docs", "*.md")))


def runnable_blocks(root=ROOT):
    """[(file, line, lang, needs, attrs, text)] in document order."""
    out = []
    for path in doc_files(root):
        with open(path) as f:
            text = f.read()
        for m in FENCE.finditer(text):
            words = m.group(1).split()
            if len(words) < 2 or words[1] != "runnable":
                continue
            attrs = dict(w.split("=", 1) for w in words[2:] if "=" in w)
            needs = [w for w in words[2:] if "=" not in w]
            line = text.count("\n", 0, m.start()) + 1
            out.append((os.path.relpath(path, root), line, words[0], needs, attrs, m.group(2)))
    return out


BLOCKS = runnable_blocks()


def children(pid):
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def descendants(pid):
    out, todo = [], [pid]
    while todo:
        for k in children(todo.pop()):
            out.append(k)
            todo.append(k)
    return out


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:   # a zombie is not running
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


class MakeRun:
    """scripts/run-daemon.sh BUILD/kvroped, as `make run` starts it; or, with
    argv, that command (`make run` itself) in cwd, in its own process group,
    stopped as Ctrl-C stops it (SIGINT to the group)."""

    def __init__(self, env_extra, serve_timeout=60.0, argv=None, cwd=ROOT, start_timeout=30.0):
        self.dir = tempfile.mkdtemp(prefix="kvr-doc-")
        self.final = None
        self.err_path = os.path.join(self.dir, "run.err")
        env = dict(os.environ)
        env.pop("KVROPE_SOCKET", None)
        env.update(env_extra)
        self.env = env
        self.err = open(self.err_path, "wb")
        self.group = argv is not None
        argv = argv or ["sh", RUN, os.path.join(BUILD, "kvroped"), "--log-level", "warn"]
        self.proc = subprocess.Popen(argv, stdout=self.err, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env, cwd=cwd,
                                     start_new_session=self.group)
        deadline = time.monotonic() + start_timeout
        while "Ctrl-C stops" not in self.output():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"make run's script did not start:\n{self.output()}")
            time.sleep(0.05)
        m = re.search(r"^kvroped: socket (\S+), disk tier (\S+),", self.output(), re.M)
        assert m, self.output()
        self.socket, self.disk = m.group(1).rstrip(","), m.group(2)
        m = re.search(r"^kvrope serve: http://(\S+) ", self.output(), re.M)
        self.serve = m.group(1) if m else None
        m = re.search(r"^kvrope serve: not started: (.*)$", self.output(), re.M)
        self.no_serve_why = m.group(1) if m else None
        if self.serve:   # the model loads before the port answers
            deadline = time.monotonic() + serve_timeout
            host, port = self.serve.rsplit(":", 1)
            while True:
                try:
                    socket.create_connection((host, int(port)), timeout=1).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        self.stop()
                        raise RuntimeError(f"kvrope serve did not listen:\n{self.output()}")
                    time.sleep(0.2)

    def output(self):
        if self.final is not None:
            return self.final
        with open(self.err_path, "rb") as f:
            return f.read().decode(errors="replace")

    def stop(self):
        kids = descendants(self.proc.pid)
        if self.proc.poll() is None:
            if self.group:   # Ctrl-C: the terminal signals the whole group
                os.killpg(self.proc.pid, signal.SIGINT)
            else:
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                if self.group:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                else:
                    self.proc.kill()
                self.proc.wait()
        self.err.close()
        self.final = self.output()
        shutil.rmtree(self.dir, ignore_errors=True)
        return kids


@pytest.fixture(scope="module")
def docs_env():
    """make run on a temporary socket, disk dir and port; a scratch checkout."""
    if not os.access(os.path.join(BUILD, "kvrope"), os.X_OK):
        pytest.skip("build/kvrope is not built")
    tmp = tempfile.mkdtemp(prefix="kvr-docw-")
    port = free_tcp_port()
    run = MakeRun({"KVROPE_RUN_DIR": os.path.join(tmp, "run"),
                   "KVROPE_DISK_DIR": os.path.join(tmp, "disk"),
                   "KVROPE_LISTEN": f"127.0.0.1:{port}"})
    work = os.path.join(tmp, "work")
    os.mkdir(work)
    for name in os.listdir(ROOT):
        if name.startswith(".") or name == "build":
            continue
        os.symlink(os.path.join(ROOT, name), os.path.join(work, name))
    os.symlink(BUILD, os.path.join(work, "build"))
    env = dict(os.environ)
    env["KVROPE_SOCKET"] = run.socket
    env["PYTHONPATH"] = "client/python"
    env.setdefault("KVROPE_LIB", os.path.join(BUILD, "libkvrope.so"))
    yield {"run": run, "work": work, "env": env}
    kids = run.stop()
    shutil.rmtree(tmp, ignore_errors=True)
    for k in kids:
        assert not alive(k), f"make run left pid {k} running after SIGTERM"


def block_id(b):
    return f"{b[0]}:{b[1]}:{b[2]}"


def run_block(block, run, work, env, build):
    """Runs one block in work; returns why it was skipped, or None."""
    path, line, lang, needs, attrs, text = block
    if "serve" in needs:
        if not run.serve:
            return f"{path}:{line} needs kvrope serve: {run.no_serve_why}"
        text = text.replace(SERVE_ADDR, run.serve)
    if "llama" in needs and not os.access(os.path.join(build, "kvrope-llama"), os.X_OK):
        return f"{path}:{line} needs build/kvrope-llama (llama.cpp from npm)"
    if lang == "c":
        assert "file" in attrs, f"{path}:{line}: a runnable c block names its file=NAME"
        with open(os.path.join(work, attrs["file"]), "w") as f:
            f.write(text)
        return None
    if lang == "sh":
        argv = ["bash", "-e", "-o", "pipefail", "-c", text]
    elif lang == "python":
        argv = [PYTHON, "-c", text]
    else:
        pytest.fail(f"{path}:{line}: runnable block of unknown language {lang!r}")
    r = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True,
                       timeout=BLOCK_TIMEOUT)
    assert r.returncode == 0, (f"{path}:{line} ({lang}) exited {r.returncode}\n--- block\n{text}"
                               f"--- stdout\n{r.stdout[-3000:]}\n--- stderr\n{r.stderr[-3000:]}")
    return None


@pytest.mark.parametrize("block", BLOCKS, ids=[block_id(b) for b in BLOCKS])
def test_block_runs(docs_env, block):
    why = run_block(block, docs_env["run"], docs_env["work"], docs_env["env"], BUILD)
    if why:
        pytest.skip(why)


def test_blocks_found():
    """The README has runnable blocks for each user (the markers did not rot)."""
    readme = [b for b in BLOCKS if b[0] == "README.md"]
    langs = {b[2] for b in readme}
    assert {"sh", "python", "c"} <= langs, langs
    assert any("serve" in b[3] for b in readme)
    assert any(b[0] == "docs/formats.md" for b in BLOCKS)


def test_make_run_defaults_and_sigterm(tmp_path):
    """With no KVROPE_* set, make run's socket is the one the CLI finds by
    default, the disk tier is there for --persist, and SIGTERM stops all."""
    xdg = tmp_path / "xdg"
    xdg.mkdir()
    env = {"XDG_RUNTIME_DIR": str(xdg), "KVROPE_DISK_DIR": str(tmp_path / "disk"),
           "KVROPE_SERVE": "0"}
    run = MakeRun(env)
    try:
        assert run.socket == str(xdg / "kvrope" / "kvroped.sock"), run.output()
        out = run.output()
        assert "kvrope serve: not started: KVROPE_SERVE=0" in out
        for want in ("kvrope ping", "KVROPE_SOCKET", "Python:", "Ctrl-C stops it"):
            assert want in out, out
        cli_env = dict(os.environ)
        cli_env.pop("KVROPE_SOCKET", None)
        cli_env["XDG_RUNTIME_DIR"] = str(xdg)
        kv = os.path.join(BUILD, "kvrope")
        r = subprocess.run([kv, "ping"], env=cli_env, capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr
        subprocess.run([kv, "models", "add", "m", "--layers", "1", "--heads", "1", "--head-dim",
                        "8"], env=cli_env, check=True, capture_output=True, timeout=30)
        subprocess.run([kv, "payload", "--model", "m", "--tokens", "1,2", "-o",
                        str(tmp_path / "p.safetensors")], env=cli_env, check=True,
                       capture_output=True, timeout=30)
        r = subprocess.run([kv, "put", "keep", str(tmp_path / "p.safetensors"), "--persist"],
                           env=cli_env, capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr
    finally:
        kids = run.stop()
    assert kids, "run-daemon.sh started no child"
    for k in kids:
        assert not alive(k), f"pid {k} still running after SIGTERM to make run"
    # Not answering any more: the CLI says so and names where make run puts it.
    r = subprocess.run([os.path.join(BUILD, "kvrope"), "ping"], env=cli_env,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 4
    assert "is kvroped running?" in r.stderr and "make run" in r.stderr, r.stderr


def test_cannot_connect_names_sudo_make_run(tmp_path):
    """A user whose `make run` ran as root (sudo) gets, from "cannot connect",
    where that socket is and what to do instead."""
    import pwd
    if os.geteuid() != 0:
        pytest.skip("needs root to run the CLI as another user")
    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user nobody")
    made = not os.path.isdir("/run/kvrope")
    if made:
        os.makedirs("/run/kvrope", mode=0o700)
    try:
        env = {k: v for k, v in os.environ.items()
               if k not in ("KVROPE_SOCKET", "XDG_RUNTIME_DIR", "KVROPE_CONNECT")}
        env["HOME"] = str(tmp_path)

        def as_nobody():
            os.setgid(nobody.pw_gid)
            os.setgroups([])
            os.setuid(nobody.pw_uid)
        kv = os.path.join(BUILD, "kvrope")
        if not os.access(kv, os.X_OK):
            pytest.skip("build/kvrope is not built")
        r = subprocess.run([kv, "ping"], env=env, capture_output=True, text=True, timeout=30,
                           preexec_fn=as_nobody, cwd=str(tmp_path))
        if r.returncode == 126 or "Permission denied" in r.stderr and "kvrope:" not in r.stderr:
            pytest.skip(f"nobody cannot run {kv}")
        assert r.returncode == 4, r.stderr
        assert "is kvroped running?" in r.stderr, r.stderr
        assert "/run/kvrope" in r.stderr and "as yourself" in r.stderr, r.stderr
    finally:
        if made:
            os.rmdir("/run/kvrope")


def test_make_run_installs_run_time_packages_only():
    """scripts/deps.sh: `make run` (level run) gets what kvroped, kvrope-llama
    and the served model's GGUF need, none of the test tools; `make test`
    (level test) gets all of run's and the test tools."""
    def pkgs(level):
        r = subprocess.run(["sh", os.path.join(ROOT, "scripts", "deps.sh"), "--list", level],
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr
        return set(r.stdout.split())
    run, test = pkgs("run"), pkgs("test")
    for p in ("libuv1-dev", "python3-numpy", "npm", "git"):
        assert p in run, p
    for p in ("python3-torch", "redis-server", "libcriterion-dev", "prometheus", "python3-pytest"):
        assert p not in run and p in test, p
    assert run <= test
    with open(os.path.join(ROOT, "Makefile")) as f:
        mk = f.read()
    assert re.search(r"^run: deps-run$", mk, re.M) and "scripts/deps.sh run" in mk


FAKE_SERVER = """#!/bin/sh
# A stand-in for kvrope-llama: `serve --help` names --listen; `serve` answers HTTP.
case "$*" in *"serve --help"*) echo "serve --listen HOST:PORT"; exit 0 ;; esac
echo "$*" > "$0.args"
while [ $# -gt 0 ]; do [ "$1" = --listen ] && listen=$2; shift; done
exec /usr/bin/python3 -m http.server --bind "${listen%:*}" "${listen##*:}"
"""


def test_make_run_starts_the_server_and_stops_both(tmp_path):
    """When kvrope-llama has serve, make run starts it on the daemon's socket,
    prints how to reach it (curl, llama.vim, OpenAI), and SIGTERM stops both."""
    fake = tmp_path / "kvrope-llama"
    fake.write_text(FAKE_SERVER)
    fake.chmod(0o755)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    port = free_tcp_port()
    run = MakeRun({"KVROPE_RUN_DIR": str(tmp_path / "run"), "KVROPE_DISK_DIR": str(tmp_path / "d"),
                   "KVROPE_LISTEN": f"127.0.0.1:{port}", "KVROPE_LLAMA": str(fake),
                   "KVROPE_MODEL": str(model)})
    try:
        out = run.output()
        assert run.serve == f"127.0.0.1:{port}", out
        for want in (f"curl -s http://127.0.0.1:{port}/v1/completions",
                     f"'endpoint': 'http://127.0.0.1:{port}/infill'",
                     f"base URL http://127.0.0.1:{port}/v1", "Ctrl-C stops both"):
            assert want in out, out
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
        args = (tmp_path / "kvrope-llama.args").read_text().split()
        # --persist: the sessions outlive a restart of both (the disk tier keeps them)
        assert args == ["--model", str(model), "--socket", run.socket, "serve", "--listen",
                        f"127.0.0.1:{port}", "--persist"], args
    finally:
        kids = run.stop()
    assert len(kids) >= 2, kids   # kvroped, the server (and perhaps a sleep of the wait loop)
    for k in kids:
        assert not alive(k), f"pid {k} still running after SIGTERM to make run"


# `make run` from a fresh clone: its build step builds everything in the clone,
# as a new user's `make run` does (serially; 3.5 min at a load average of 10 on
# 2 cores), unless KVR_DOCS_REUSE_BUILD=1, with which the clone reuses this build.
FRESH_BUILD = os.environ.get("KVR_DOCS_REUSE_BUILD") != "1"
FRESH_BUILD_TIMEOUT = 1800.0


def test_make_run_from_a_fresh_clone(tmp_path):
    """Issue 31: `make run` typed in a fresh clone, then every runnable block
    of the README in order in that clone, as a user in a second terminal
    would, then Ctrl-C.

    What is exact: the clone is `git clone` of this repository (its HEAD);
    `make run` is the Makefile's target, run with make from the clone's
    root (scripts/deps.sh run, which installs nothing when the packages are
    there, as after `make test`'s own deps; the build of everything it runs,
    in the clone's own build/; then scripts/run-daemon.sh); the blocks find
    the daemon the way the README
    says, by make run's default socket ($XDG_RUNTIME_DIR/kvrope/kvroped.sock,
    no KVROPE_SOCKET), and the Python binding finds the clone's
    build/libkvrope.so by itself (no KVROPE_LIB); they get
    PYTHONPATH=client/python as the README tells a user in a checkout. The
    whole run (clone, start, blocks, stop) is bounded.

    What is not: XDG_RUNTIME_DIR, KVROPE_DISK_DIR and KVROPE_LISTEN point at
    this test's temporary directory and a free port (a user's own make run
    may be up on the defaults; blocks get the port in place of 8012); and
    llama.cpp's prebuilt libraries are not fetched from npm again:
    LLAMA_CACHE is $LLAMA_CACHE, else this build's llama/ when it has them
    (the same pinned release; no network). With KVR_DOCS_REUSE_BUILD=1 (a
    quick run while working on the docs) nothing is compiled either: the
    clone's build/ is a link to this build ($KVR_BUILD) and the clone's
    files are dated in the past, so make run's build step finds everything
    up to date (asserted: it compiles nothing)."""
    if not os.access(os.path.join(BUILD, "kvroped"), os.X_OK):
        pytest.skip("build/kvroped is not built")
    if not shutil.which("git") or not os.path.isdir(os.path.join(ROOT, ".git")) and \
            not os.path.isfile(os.path.join(ROOT, ".git")):
        pytest.skip("not a git checkout")
    clone = tmp_path / "kvrope"
    subprocess.run(["git", "clone", "--quiet", ROOT, str(clone)], check=True, timeout=300,
                   capture_output=True)
    env = {"XDG_RUNTIME_DIR": str(tmp_path / "xdg"), "KVROPE_DISK_DIR": str(tmp_path / "disk"),
           "KVROPE_LISTEN": f"127.0.0.1:{free_tcp_port()}"}
    (tmp_path / "xdg").mkdir(mode=0o700)
    cache = os.environ.get("LLAMA_CACHE") or os.path.join(BUILD, "llama")
    if os.path.isdir(os.path.join(cache, "npm")):
        env["LLAMA_CACHE"] = os.path.abspath(cache)
    build = str(clone / "build")
    if not FRESH_BUILD:
        old = time.time() - 10 * 365 * 86400
        for d, dirs, files in os.walk(clone):
            dirs[:] = [x for x in dirs if x != ".git"]
            for f in files:
                os.utime(os.path.join(d, f), (old, old), follow_symlinks=False)
        os.symlink(BUILD, build)
    run = MakeRun(env, argv=["make", "run"], cwd=str(clone),
                  start_timeout=FRESH_BUILD_TIMEOUT if FRESH_BUILD else 120.0,
                  serve_timeout=120.0)
    try:
        out = run.output()
        assert run.socket == str(tmp_path / "xdg" / "kvrope" / "kvroped.sock"), out
        if not FRESH_BUILD:
            assert not re.search(r"^(cc|gcc|clang) ", out, re.M), \
                f"make run rebuilt in the reused build dir ({BUILD} is stale?):\n{out}"
        benv = dict(os.environ)
        for k in ("KVROPE_SOCKET", "KVROPE_LIB", "KVROPE_CONNECT"):
            benv.pop(k, None)
        benv["XDG_RUNTIME_DIR"] = env["XDG_RUNTIME_DIR"]
        benv["PYTHONPATH"] = "client/python"
        readme = [b for b in runnable_blocks(str(clone)) if b[0] == "README.md"]
        assert len(readme) >= 5, readme
        skipped, ran = [], 0
        for b in readme:
            why = run_block(b, run, str(clone), benv, build)
            if why:
                skipped.append(why)
            else:
                ran += 1
        if run.serve is None:
            assert skipped, "the server did not start, yet no block needed it"
    finally:
        kids = run.stop()
        if os.path.islink(build):
            os.unlink(build)          # never remove the linked build
        shutil.rmtree(clone, ignore_errors=True)   # its own build: some 100 MB
    assert kids, f"make run started nothing:\n{run.final}"
    for k in kids:
        assert not alive(k), f"pid {k} still running after Ctrl-C to make run:\n{run.final}"
    print(f"make run from a fresh clone: {ran} README blocks ran, {len(skipped)} skipped")
    for why in skipped:
        print("skipped:", why)
