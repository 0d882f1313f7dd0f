#!/usr/bin/python3
"""bench_serve — kvrope serve against llama.cpp's llama-server, driven as llama.vim drives them.

Both servers run the same model, the same llama.cpp code (llama-server is
built from the bundled v0.5.0 source and links the npm libraries kvrope
links: scripts/llama-server.sh), 2 threads, context 2048, batch 1024
(llama.vim's recommended --batch-size; it sets how much of the prefix and
suffix /infill keeps), one server at a time on this machine so that none
competes with another's background work. llama-server runs twice: with
llama.vim's recommended `--cache-reuse 256` (and its default host-RAM prompt
cache), and with `--cache-ram 0`; both -np 1.

The model is the 0.7 B benchmark shape of tests/common/kvr_llama_bench.h
(16 layers, width 2048, f16, seeded random weights) written with the FIM
tokens (scripts/gen-gguf.py --fim), so that llama-server accepts /infill;
KVR_SERVE_MODEL=M.gguf runs another FIM model.

Every request is an /infill as llama.vim builds it: the 256 lines before the
cursor as input_prefix, the cursor line's text before the cursor as prompt,
the rest of that line and the 64 lines after it as input_suffix, a ring of
chunks from other files of the repository as input_extra (warmed first with
llama.vim's n_predict 0 request, and rotated once half way), greedy
(temperature 0, top_k 40). Time to first token is the client's wall time of
the request asking for one token.

Three series, each on every server:
  - editor session: a file's real edit history (this repository's git
    history of HISTORY, hunk by hunk: scripts/edit-history.py), each version
    requested with the cursor at the end of the change, 0.2 s after the
    previous answer, as between keystrokes;
  - line inserted mid-prompt: a prompt cached, then the same file with a line
    inserted 12 lines above the cursor (inside the prefix /infill keeps), the
    cursor on the same code line (the change the issue measured llama-server
    on);
  - restart: the session's last request, the server restarted (kvroped stays
    up), the same request again.
Per request: prompt tokens evaluated (timings.prompt_n of the prompt's
prompt_n + cache_n) and time to first token. After each measured kvrope
request, its cached path's N_CHECK greedy tokens are compared with a full
re-encode (cache_prompt false); on random weights the logits are nearly flat,
so the same series also runs through kvrope serve on the trained model
(build/eval/kvrope-code.gguf, context 512, batch 256; no FIM tokens, so
/infill lays out chunks and prefix without the suffix), whose agreement is
the goal's.

Prints a table and `goal:` lines; ratios are measured in this run.
Run: KVR_BUILD=$PWD/build /usr/bin/python3 tests/bench/bench_serve.py
(KVR_SERVE_VERSIONS, KVR_SERVE_LINES: how many edits of each series.)
"""
import difflib
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
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
from procs import free_tcp_port, stop_process, wait_health  # noqa: E402  (shared with the tests and eval)

BUILD = os.path.abspath(os.environ.get("KVR_BUILD") or os.path.join(ROOT, "build"))
MODEL = os.environ.get("KVR_SERVE_MODEL") or os.path.join(
    BUILD, "llama-models", "bench-l16-w2048-kv8-f16-fim.gguf")
CTX = int(os.environ.get("KVR_SERVE_CTX", "2048"))
BATCH = int(os.environ.get("KVR_SERVE_BATCH", "1024"))
THREADS = "2"
N_VERSIONS = int(os.environ.get("KVR_SERVE_VERSIONS", "13"))   # 12 edits
N_LINES = int(os.environ.get("KVR_SERVE_LINES", "8"))
HISTORY = os.environ.get("KVR_SERVE_FILE", "cache/get.c")
TRAINED = os.path.join(BUILD, "eval", "kvrope-code.gguf")
UNTIL = "83afdf0"     # a fixed history, whatever is committed later
N_CHECK = 8           # greedy tokens per request, compared with a full re-encode
N_PREFIX, N_SUFFIX = 256, 64      # llama.vim's defaults (lines)
RING_FILES = ["rope/rope.c", "cache/put.c", "cache/prefix.c", "daemon/t_kv.c"]
RING_LINES = 6         # 3 chunks fit the budget for input_extra (n_ctx - batch + 2)


def post(port, path, obj, timeout=600):
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


class Proc:
    def __init__(self, argv, port, what, log):
        self.argv, self.port, self.what, self.log = argv, port, what, log
        self.proc = None

    def start(self):
        env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_ARG_")}
        self.proc = subprocess.Popen(self.argv, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env)
        wait_health(self.port, self.proc, self.what)

    def stop(self):
        if self.proc:
            stop_process(self.proc, 30)


# ---- what llama.vim sends ------------------------------------------------------

def vim_request(lines, y, x, ring):
    """/infill for the cursor at line y, byte x of `lines` (no newlines), as
    llama.vim builds it (its n_prefix / n_suffix lines around the cursor)."""
    cur = lines[y]
    prefix = "\n".join(lines[max(0, y - N_PREFIX):y]) + "\n"
    suffix = cur[x:] + "\n" + "\n".join(lines[y + 1:y + 1 + N_SUFFIX]) + "\n"
    return {"input_prefix": prefix, "input_suffix": suffix, "input_extra": ring,
            "prompt": cur[:x], "n_predict": N_CHECK, "stop": [], "n_indent": 0,
            "top_k": 40, "top_p": 0.99, "temperature": 0, "samplers": ["top_k", "temperature"],
            "cache_prompt": True, "t_max_prompt_ms": 500, "t_max_predict_ms": 60000,
            "return_tokens": True,
            "response_fields": ["content", "tokens", "timings/prompt_n", "timings/cache_n",
                                "timings/prompt_ms", "timings/predicted_n", "truncated",
                                "tokens_cached"]}


def vim_warmup(ring):
    return {"input_prefix": "", "input_suffix": "", "input_extra": ring, "prompt": "",
            "n_predict": 0, "temperature": 0.0, "samplers": ["temperature"],
            "cache_prompt": True, "t_max_prompt_ms": 1, "t_max_predict_ms": 1,
            "response_fields": [""]}


def ring_chunks(files):
    out = []
    for f in files:
        text = open(os.path.join(ROOT, f), encoding="utf-8", errors="replace").read().split("\n")
        mid = len(text) // 2
        out.append({"filename": f, "text": "\n".join(text[mid:mid + RING_LINES]) + "\n"})
    return out


def session_requests(tmp):
    """The editor session: (ring, request) per version, the cursor where it changed."""
    out = os.path.join(tmp, "history")
    subprocess.run(["/usr/bin/python3", os.path.join(ROOT, "scripts", "edit-history.py"),
                    "--repo", ROOT, "--path", HISTORY, "--until", UNTIL,
                    "--max", str(N_VERSIONS), out], check=True, capture_output=True)
    names = sorted(f for f in os.listdir(out) if f.startswith("v") and f.endswith(".txt"))
    vers = [open(os.path.join(out, f), encoding="utf-8", errors="replace").read().split("\n")
            for f in names]
    ring_a, ring_b = ring_chunks(RING_FILES[:3]), ring_chunks(RING_FILES[1:])
    reqs, y, x = [], len(vers[0]) // 2, 0
    for i, v in enumerate(vers):
        if i:
            ops = [o for o in difflib.SequenceMatcher(None, vers[i - 1], v, autojunk=False)
                   .get_opcodes() if o[0] != "equal"]
            _, _, _, j1, j2 = ops[-1]
            y = min(max(j1, j2 - 1), len(v) - 1)
            x = len(v[y]) if j2 > j1 else 0
        ring = ring_a if i <= len(vers) // 2 else ring_b
        reqs.append((ring, vim_request(v, y, x, ring)))
    return reqs


def line_insert_requests(n, above=12):
    """(cached, edited) request pairs on real source files: the cursor 3/4 down
    the file's window, then a line inserted `above` lines over the cursor (a copy of
    the line above it), the cursor on the same code line."""
    files = subprocess.run(["git", "-C", ROOT, "ls-files", "cache/*.c", "daemon/*.c"],
                           capture_output=True, text=True).stdout.split()
    ring = ring_chunks(RING_FILES[:3])
    out = []
    for f in sorted(files):
        lines = open(os.path.join(ROOT, f), encoding="utf-8", errors="replace").read().split("\n")
        if len(lines) < 200:
            continue
        y = len(lines) * 3 // 4
        x = len(lines[y]) // 2
        at = y - above                     # inside the 3/4-batch prefix kept
        edited = lines[:at] + [lines[at - 1]] + lines[at:]
        out.append((ring, vim_request(lines, y, x, ring), vim_request(edited, y + 1, x, ring)))
        if len(out) == n:
            break
    return out


# ---- the run -------------------------------------------------------------------

def measure(pr, req):
    """Time to first token: the client's wall time of the request asking for
    one token (not streamed: a random-weight model's first bytes are often
    an incomplete UTF-8 character, which a stream holds back)."""
    t0 = time.monotonic()
    r = post(pr.port, "/infill", {**req, "n_predict": 1})
    ms = (time.monotonic() - t0) * 1e3
    # response_fields: "timings/prompt_n" comes back as a root key of that name
    t = r.get("timings") or {k: r[f"timings/{k}"] for k in ("prompt_n", "cache_n")}
    n = t["prompt_n"] + t["cache_n"]
    return {"ms": ms, "n": t["prompt_n"], "total": n, "share": t["prompt_n"] / max(1, n)}


def agreement(port, req):
    """The cached path's N_CHECK greedy tokens for the prompt just measured
    (the session holds it: the same KV the measured request used) against a
    full re-encode of the same request."""
    a = post(port, "/infill", {**req, "n_predict": N_CHECK})
    b = post(port, "/infill", {**req, "n_predict": N_CHECK, "cache_prompt": False})
    return a["tokens"] == b["tokens"]


def run_server(pr, sess, inserts, check):
    """Every series on one server; check(port, req) after each measured request."""
    pr.start()
    rows = {"sess": [], "line": [], "restart": None}
    try:
        ring = None
        for r, req in sess:
            if r is not ring:                       # llama.vim warms a new ring first
                post(pr.port, "/infill", vim_warmup(r))
                ring = r
            time.sleep(0.2)
            m = measure(pr, req)
            rows["sess"].append(m)
            if check:
                check(pr.port, req)
        rows["sess"] = rows["sess"][1:]             # the first version is the session's start
        for r, cached, edited in inserts:
            measure(pr, cached)
            time.sleep(0.2)
            m = measure(pr, edited)
            rows["line"].append(m)
            if check:
                check(pr.port, edited)
        last = sess[-1][1]
        measure(pr, last)
        pr.stop()
        pr.start()
        rows["restart"] = measure(pr, last)
    finally:
        pr.stop()
    return rows


def ensure_model():
    if os.path.exists(MODEL) and os.path.getsize(MODEL) > 1000000:
        return True
    if os.environ.get("KVR_SERVE_MODEL"):
        print(f"bench_serve: no model at {MODEL}; skipped")
        return False
    os.makedirs(os.path.dirname(MODEL), exist_ok=True)
    print(f"bench_serve: writing the benchmark model with FIM tokens into {MODEL} ...", flush=True)
    subprocess.run(["/usr/bin/python3", os.path.join(ROOT, "scripts", "gen-gguf.py"), "-o",
                    MODEL + ".tmp", "--arch", "llama", "--layers", "16", "--width", "2048",
                    "--heads", "32", "--kv-heads", "8", "--ffn", "5632", "--dtype", "f16",
                    "--seed", "1", "--ctx", "4096", "--fim"], check=True)
    os.replace(MODEL + ".tmp", MODEL)
    return True


def build_peer(who):
    """llama-server from the bundled source (scripts/llama-server.sh, cached
    under BUILD/llama-server) -> its path, or None (said why)."""
    peer = subprocess.run([os.path.join(ROOT, "scripts", "llama-server.sh"),
                           os.path.join(BUILD, "llama-server"),
                           os.environ.get("LLAMA_CACHE", os.path.join(BUILD, "llama"))],
                          capture_output=True, text=True, cwd=ROOT)
    if peer.returncode != 0:
        print(f"{who}: llama-server could not be built: " + peer.stderr.strip()[-300:])
        return None
    return os.path.abspath(os.path.join(ROOT, peer.stdout.strip().splitlines()[-1]))


def goal(text, figure, met):
    """One `goal:` line as make bench prints them."""
    print(f"goal: {text}: {figure} ({'met' if met else 'not met'})")


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def prerequisites(who):
    """What a serve benchmark needs: kvroped and kvrope-llama built, the
    model, llama-server -> (free_port, llama-server's path), or None (said
    why: the bench is skipped)."""
    for p in (os.path.join(BUILD, "kvrope-llama"), os.path.join(BUILD, "kvroped")):
        if not os.path.exists(p):
            print(f"{who}: {p} is not built; skipped")
            return None
    if not ensure_model():
        return None
    llama_server = build_peer(who)
    return (free_tcp_port, llama_server) if llama_server else None


def main():
    pre = prerequisites("bench_serve")
    if not pre:
        return 0
    free_port, llama_server = pre
    tmp = tempfile.mkdtemp(prefix="kvr-bsv-")
    sess = session_requests(tmp)
    inserts = line_insert_requests(N_LINES)
    print(f"bench_serve: llama.vim /infill requests; {len(sess) - 1} consecutive real edits of "
          f"{HISTORY} (git history hunk by hunk), {len(inserts)} lines inserted mid-prompt; "
          f"model {os.path.basename(MODEL)}, context {CTX}, batch {BATCH}, {THREADS} threads, "
          f"one server at a time", flush=True)
    log = open(os.path.join(tmp, "log"), "wb")
    sock = os.path.join(tmp, "k.sock")
    kd = subprocess.Popen([os.path.join(BUILD, "kvroped"), "--socket", sock, "--max-memory",
                           "4G", "--log-level", "warn"], stdout=log, stderr=subprocess.STDOUT)
    while not os.path.exists(sock):
        time.sleep(0.02)
    agree, agree_trained = [], []

    rows = {}
    try:
        kp = free_port()
        name = "kvrope serve"
        rows[name] = run_server(Proc([os.path.join(BUILD, "kvrope-llama"), "--model", MODEL,
                                      "--socket", sock, "--threads", THREADS, "serve",
                                      "--listen", f"127.0.0.1:{kp}", "--ctx-size", str(CTX),
                                      "--batch-size", str(BATCH)], kp, name, log),
                                sess, inserts, lambda port, req: agree.append(agreement(port, req)))
        print(f"  {name}: done", flush=True)
        for name, flags in (("llama-server --cache-reuse 256", ["--cache-reuse", "256"]),
                            ("llama-server --cache-ram 0", ["--cache-ram", "0"])):
            p = free_port()
            rows[name] = run_server(Proc([llama_server, "-m", MODEL, "--host", "127.0.0.1",
                                          "--port", str(p), "-t", THREADS, "-tb", THREADS,
                                          "-np", "1", "-c", str(CTX), "-b", str(BATCH),
                                          "--no-warmup", *flags], p, name, log),
                                    sess, inserts, None)
            print(f"  {name}: done", flush=True)
        # agreement on the trained model make run serves (no FIM tokens: /infill
        # lays out chunks and prefix, no suffix), kvrope only, context 512
        if os.path.exists(TRAINED):
            tp = free_port()
            run_server(Proc([os.path.join(BUILD, "kvrope-llama"), "--model", TRAINED,
                                  "--socket", sock, "--threads", THREADS, "serve", "--listen",
                                  f"127.0.0.1:{tp}", "--ctx-size", "512", "--batch-size", "256",
                                  "--n-predict", "32"],   # as eval/infill.py: room for the cursor line
                                 tp, "kvrope serve (trained model)", log),
                            sess, line_insert_requests(N_LINES, above=3),   # its prefix: ~6 lines
                            lambda port, req: agree_trained.append(agreement(port, req)))
            print(f"  kvrope serve on {os.path.basename(TRAINED)}: done", flush=True)
    finally:
        kd.send_signal(signal.SIGTERM)
        kd.wait(30)
        log.close()
    print()
    print("| server | editor session: tokens evaluated per edit, median (share) | median TTFT ms "
          "| line inserted mid-prompt: tokens evaluated (share) | median TTFT ms "
          "| after a restart: TTFT ms |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        s, ln = r["sess"], r["line"]
        print(f"| {name} | {med([m['n'] for m in s]):.0f} ({100 * med([m['share'] for m in s]):.1f}%) "
              f"| {med([m['ms'] for m in s]):.0f} | {med([m['n'] for m in ln]):.0f} "
              f"({100 * med([m['share'] for m in ln]):.1f}%) | {med([m['ms'] for m in ln]):.0f} "
              f"| {r['restart']['ms']:.0f} |")
    print()
    names = list(rows)
    print("per request: tokens evaluated / prompt tokens, TTFT ms (" + "; ".join(names) + "); "
          "kvrope's completion equal to a full re-encode (= / x) on the random-weight and the "
          "trained model")

    def mark(a, i):
        return "=" if i < len(a) and a[i] else "x" if i < len(a) else "-"
    for series, label, off in (("sess", "edit", 1), ("line", "line insert", len(sess))):
        for i in range(len(rows[names[0]][series])):
            cells = []
            for n in names:
                m = rows[n][series][i]
                cells.append(f"{m['n']}/{m['total']} {m['ms']:.0f}")
            print(f"  {label} {i + 1}: " + " | ".join(cells) +
                  f" | agree {mark(agree, off + i)} {mark(agree_trained, off + i)}")
    k, ls = rows["kvrope serve"], rows["llama-server --cache-reuse 256"]
    share = med([m["share"] for m in k["line"]])
    sp = med([m["ms"] for m in ls["line"]]) / med([m["ms"] for m in k["line"]])
    sps = med([m["ms"] for m in ls["sess"]]) / med([m["ms"] for m in k["sess"]])
    rs = ls["restart"]["ms"] / k["restart"]["ms"]
    ag = sum(agree_trained) / max(1, len(agree_trained)) if agree_trained else float("nan")
    print()
    print(f"prompt sizes (tokens): session {med([m['total'] for m in k['sess']]):.0f}, "
          f"line inserts {med([m['total'] for m in k['line']]):.0f} (median)")
    print(f"kvrope completions identical to a full re-encode ({N_CHECK} greedy tokens, every "
          f"request of both series): trained model {sum(agree_trained)} of {len(agree_trained)}; "
          f"0.7 B random-weight model {sum(agree)} of {len(agree)}")
    print(f"editor session TTFT vs llama-server --cache-reuse 256: {sps:.2f}x")
    goal("prompt tokens evaluated after a mid-prompt line insert <= 5% of the prompt",
         f"{100 * share:.1f}%", share <= 0.05)
    goal("median TTFT after it >= 5x faster than llama-server --cache-reuse 256", f"{sp:.2f}x",
         sp >= 5)
    goal("after a restart >= 50x faster than llama-server after its restart", f"{rs:.2f}x",
         rs >= 50)
    goal("completions identical to a full re-encode in >= 95% of requests (trained model)",
         f"{100 * ag:.0f}%", ag >= 0.95)
    return 0


if __name__ == "__main__":
    sys.exit(main())
