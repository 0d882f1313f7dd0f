#!/usr/bin/python3
"""bench_serve — kvrope serve against llama.cpp's llama-server on editor edits.

Both servers run the same model (build/eval/kvrope-code.gguf), the same
llama.cpp code (llama-server is built from the bundled v0.5.0 source and links
the npm libraries kvrope links: scripts/llama-server.sh), one thread each,
one after the other on this machine. llama-server runs twice: with llama.vim's
recommended `--cache-reuse 256` (and its default host-RAM prompt cache), and
with `--cache-ram 0 -np 1`.

Requests replay a real editor session: a file's versions from this
repository's git history split hunk by hunk (scripts/edit-history.py, the
window of its first WINDOW bytes, so the prompt fits the model's context),
each version sent after the previous one, as an editor asks after each change:
an edit lands inside a cached prompt. This model has no FIM tokens
(llama-server answers /infill with 501), so both get the window as a
/completion prompt, the way /infill would put the file around the cursor.
Per request: prompt tokens evaluated (timings.prompt_n), time to first token
(client wall time of an n_predict 1 request, 0.2 s after the previous answer,
as between keystrokes; kvrope stores the previous step meanwhile), and for
kvrope whether its greedy continuation equals a full re-encode's
(cache_prompt false). Then both servers restart and the last version is sent
again. KVR_SERVE_MODEL=M.gguf (with KVR_SERVE_CTX, KVR_SERVE_WINDOW) runs
another model, e.g. the 0.7 B benchmark model of tests/common/kvr_llama_bench.h.

Prints a table and `goal:` lines; ratios are measured in this run.
Run: KVR_BUILD=$PWD/build /usr/bin/python3 tests/bench/bench_serve.py
"""
import http.client
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BUILD = os.path.abspath(os.environ.get("KVR_BUILD") or os.path.join(ROOT, "build"))
MODEL = os.environ.get("KVR_SERVE_MODEL") or os.path.join(BUILD, "eval", "kvrope-code.gguf")
CTX = int(os.environ.get("KVR_SERVE_CTX", "512"))       # the trained model's context
WINDOW = int(os.environ.get("KVR_SERVE_WINDOW", "440"))  # bytes (= tokens: byte vocabulary)
N_VERSIONS = int(os.environ.get("KVR_SERVE_VERSIONS", "21"))
HISTORY = os.environ.get("KVR_SERVE_FILE", "daemon/dispatch.c")
UNTIL = "3e761cf"     # a fixed history, whatever is committed later
N_CHECK = 16          # greedy tokens compared with a full re-encode


def post(port, path, obj, timeout=120):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request("POST", path, json.dumps(obj), {"Content-Type": "application/json"})
        r = c.getresponse()
        data = r.read()
        if r.status != 200:
            raise RuntimeError(f"{path}: {r.status} {data[:300]!r}")
        return json.loads(data)
    finally:
        c.close()


def wait_health(port, proc, what, timeout=120):
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


class Proc:
    def __init__(self, argv, port, what, log):
        self.argv, self.port, self.what, self.log = argv, port, what, log
        self.start()

    def start(self):
        env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_ARG_")}
        self.proc = subprocess.Popen(self.argv, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env)
        wait_health(self.port, self.proc, self.what)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def restart(self):
        self.stop()
        self.start()


def versions(tmp):
    """The editor session: consecutive versions, one hunk apart."""
    out = os.path.join(tmp, "history")
    subprocess.run(["/usr/bin/python3", os.path.join(ROOT, "scripts", "edit-history.py"),
                    "--repo", ROOT, "--path", HISTORY, "--until", UNTIL, "--window", str(WINDOW),
                    "--max", str(N_VERSIONS), out], check=True, capture_output=True)
    names = sorted(f for f in os.listdir(out) if f.startswith("v") and f.endswith(".txt"))
    return [open(os.path.join(out, f), encoding="utf-8", errors="replace").read() for f in names]


def line_edits(n=12):
    """(cached, edited) windows of real source files: the edited one has a line
    inserted (a copy of the line before it) in the middle, the change the issue
    measured llama-server on."""
    files = subprocess.run(["git", "-C", ROOT, "ls-files", "cache/*.c", "daemon/*.c", "rope/*.c"],
                           capture_output=True, text=True).stdout.split()
    out = []
    for f in sorted(files):
        text = open(os.path.join(ROOT, f), encoding="utf-8", errors="replace").read()
        start = text.find("\n", len(text) // 3) + 1          # code, past the header comment
        w = text[start:start + WINDOW - 40]
        w = w[:w.rfind("\n") + 1]
        lines = w.splitlines(keepends=True)
        if len(lines) < 8:
            continue
        mid = len(lines) // 2
        edited = "".join(lines[:mid + 1] + [lines[mid]] + lines[mid + 1:])
        out.append((w, edited))
        if len(out) == n:
            break
    return out


def ttft(port, prompt, **kw):
    t0 = time.monotonic()
    r = post(port, "/completion", {"prompt": prompt, "n_predict": 1, "temperature": 0,
                                   "cache_prompt": True, **kw})
    return (time.monotonic() - t0) * 1e3, r


def main():
    sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
    from conftest import free_tcp_port as free_port  # the tests' helper, not repeated here
    for p in (MODEL, os.path.join(BUILD, "kvrope-llama"), os.path.join(BUILD, "kvroped")):
        if not os.path.exists(p):
            print(f"bench_serve: {p} is not built; skipped")
            return 0
    peer = subprocess.run([os.path.join(ROOT, "scripts", "llama-server.sh"),
                           os.path.join(BUILD, "llama-server"),
                           os.environ.get("LLAMA_CACHE", os.path.join(BUILD, "llama"))],
                          capture_output=True, text=True, cwd=ROOT)
    if peer.returncode != 0:
        print("bench_serve: llama-server could not be built: " + peer.stderr.strip()[-300:])
        return 0
    llama_server = os.path.abspath(os.path.join(ROOT, peer.stdout.strip().splitlines()[-1]))
    tmp = tempfile.mkdtemp(prefix="kvr-bsv-")
    vers = versions(tmp)
    print(f"bench_serve: {len(vers) - 1} consecutive real edits of {HISTORY} (git history "
          f"hunk by hunk, first {WINDOW} bytes), model {os.path.basename(MODEL)}, context {CTX}, "
          f"1 thread each")
    log = open(os.path.join(tmp, "log"), "wb")
    sock = os.path.join(tmp, "k.sock")
    kd = subprocess.Popen([os.path.join(BUILD, "kvroped"), "--socket", sock, "--max-memory",
                           "512M", "--log-level", "warn"], stdout=log, stderr=subprocess.STDOUT)
    while not os.path.exists(sock):
        time.sleep(0.02)
    procs = {}
    try:
        kp = free_port()
        procs["kvrope serve"] = Proc([os.path.join(BUILD, "kvrope-llama"), "--model", MODEL,
                                      "--socket", sock, "--threads", "1", "serve", "--listen",
                                      f"127.0.0.1:{kp}", "--ctx-size", str(CTX)],
                                     kp, "kvrope serve", log)
        for name, flags in (("llama-server --cache-reuse 256", ["--cache-reuse", "256"]),
                            ("llama-server --cache-ram 0", ["--cache-ram", "0"])):
            p = free_port()
            procs[name] = Proc([llama_server, "-m", MODEL, "--host", "127.0.0.1", "--port",
                                str(p), "-t", "1", "-tb", "1", "-np", "1", "-c", str(CTX),
                                "--no-warmup", *flags], p, name, log)
        rows = {n: {"share": [], "ttft": [], "n": []} for n in procs}
        agree = 0
        for name, pr in procs.items():
            ttft(pr.port, vers[0])                      # the file as the session starts
        for new in vers[1:]:
            for name, pr in procs.items():
                time.sleep(0.2)
                ms, r = ttft(pr.port, new)
                t = r["timings"]
                rows[name]["ttft"].append(ms)
                rows[name]["share"].append(t["prompt_n"] / max(1, t["prompt_n"] + t["cache_n"]))
                rows[name]["n"].append(t["prompt_n"])
            kp = procs["kvrope serve"].port
            a = post(kp, "/completion", {"prompt": new, "n_predict": N_CHECK, "temperature": 0,
                                         "return_tokens": True})
            b = post(kp, "/completion", {"prompt": new, "n_predict": N_CHECK, "temperature": 0,
                                         "return_tokens": True, "cache_prompt": False})
            agree += a["tokens"] == b["tokens"]
        # one line inserted in the middle of a cached prompt
        lrows = {n: {"share": [], "ttft": []} for n in procs}
        for cached, edited in line_edits():
            for name, pr in procs.items():
                ttft(pr.port, cached)
                time.sleep(0.2)
                ms, r = ttft(pr.port, edited)
                t = r["timings"]
                lrows[name]["ttft"].append(ms)
                lrows[name]["share"].append(t["prompt_n"] / max(1, t["prompt_n"] + t["cache_n"]))
        # restart: the last prompt again
        last = vers[-1]
        restart = {}
        for name, pr in procs.items():
            ttft(pr.port, last)
            pr.restart()
            restart[name] = ttft(pr.port, last)[0]
        print()
        print("| server | editor session: tokens evaluated per edit (median, share) | median TTFT ms "
              "| line inserted mid-prompt: share evaluated | median TTFT ms | after restart ms |")
        print("|---|---|---|---|---|---|")
        for name in procs:
            r, lr = rows[name], lrows[name]
            print(f"| {name} | {statistics.median(r['n']):.0f} ({100 * statistics.median(r['share']):.1f}%) "
                  f"| {statistics.median(r['ttft']):.1f} | {100 * statistics.median(lr['share']):.1f}% "
                  f"| {statistics.median(lr['ttft']):.1f} | {restart[name]:.1f} |")
        k, ls = lrows["kvrope serve"], lrows["llama-server --cache-reuse 256"]
        share = statistics.median(k["share"])
        sp = statistics.median(ls["ttft"]) / statistics.median(k["ttft"])
        sps = (statistics.median(rows["llama-server --cache-reuse 256"]["ttft"]) /
               statistics.median(rows["kvrope serve"]["ttft"]))
        rs = restart["llama-server --cache-reuse 256"] / restart["kvrope serve"]
        n_req = len(vers) - 1
        ag = agree / max(1, n_req)
        print()
        print(f"kvrope completions identical to a full re-encode ({N_CHECK} greedy tokens), "
              f"editor session: {agree} of {n_req}; editor session TTFT vs llama-server "
              f"--cache-reuse 256: {sps:.2f}x")
        print(f"goal: prompt tokens evaluated after a mid-prompt line insert <= 5% of the prompt: "
              f"{100 * share:.1f}% ({'met' if share <= 0.05 else 'not met'})")
        print(f"goal: median TTFT after it >= 5x faster than llama-server --cache-reuse 256: "
              f"{sp:.2f}x ({'met' if sp >= 5 else 'not met'})")
        print(f"goal: after a restart >= 50x faster than llama-server after its restart: {rs:.2f}x "
              f"({'met' if rs >= 50 else 'not met'})")
        print(f"goal: completions identical to a full re-encode in >= 95% of requests: "
              f"{100 * ag:.0f}% ({'met' if ag >= 0.95 else 'not met'})")
    finally:
        for pr in procs.values():
            pr.stop()
        kd.send_signal(signal.SIGTERM)
        kd.wait(20)
        log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
