#!/usr/bin/python3
"""infill_serve.py — the editor's real question about the cache: does the
cached path change the completion? The middle-line cases of eval/infill.py
sent to kvrope serve (build/kvrope-llama serve on the trained model's GGUF,
kvroped behind it) as llama.vim sends them, on the paths the cache takes:

  edit       the file was edited above the cursor since the last request:
             a warm-up /infill with one line of the kept prefix changed,
             then the request. The
             server turns the difference into PIE edit ops against the cached
             context (kept tokens re-rotated, the changed line and the chosen
             refresh decoded).
  placement  the same input_extra chunks were cached in another order: a
             warm-up with the chunks reversed, then the request. The server finds them by content (kvroped's cover),
             places them re-rotated and repairs the seams (EPIC k = 16).

Each cached request is compared with the same request sent with
cache_prompt false (a full re-encode on the same server). Reported per path:
exact match of the rest of the line on both, the share of cases whose
completion differs, and the share of prompt tokens the cache supplied
(timings.cache_n / (cache_n + prompt_n)). Greedy (temperature 0), the line ends
at a newline or a special token. Debian's /usr/bin/python3; used by
eval/run.py (`--only infill`) and tests/python/test_infill.py.
"""
import http.client
import json
import os
import subprocess
import sys

import paths  # noqa: F401  (the repository's Python on sys.path)

import infill as I
import procs as P

PATHS = [("edit", "after a PIE edit (a line above the cursor changed)"),
         ("placement", "after chunk placement (input_extra cached in another order)")]


class Serve:
    """kvroped on a temporary socket and kvrope serve on a free loopback port,
    with llama-server's -c/-b of eval/infill.py (I.SERVER); stop() ends both."""

    def __init__(self, build, gguf, threads=1):
        import run as R
        self.d = R.Daemon(build)
        self.port = P.free_tcp_port()
        self.log_path = os.path.join(self.d.dir, "serve.log")
        self.log = open(self.log_path, "wb")
        exe = os.path.join(build, "kvrope-llama")
        if not os.access(exe, os.X_OK) or not os.path.exists(gguf):
            self.d.stop()
            raise SystemExit(f"eval: {exe} and {gguf} must be built (make)")
        env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_ARG_")}
        self.proc = subprocess.Popen(
            [exe, "--model", gguf, "--socket", self.d.socket, "--threads", str(threads), "serve",
             "--listen", f"127.0.0.1:{self.port}", "--ctx-size", str(I.SERVER["n_ctx"]),
             "--batch-size", str(I.SERVER["n_batch"]), "--n-predict", str(I.SERVER["n_predict"])],
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        try:
            P.wait_health(self.port, self.proc, "kvrope serve", timeout=120)
        except RuntimeError:
            self.stop()
            raise SystemExit("eval: kvrope serve did not start")

    def request(self, method, path, body=None, timeout=300):
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            c.request(method, path, body=None if body is None else json.dumps(body),
                      headers={"Content-Type": "application/json"})
            r = c.getresponse()
            return r.status, r.read()
        finally:
            c.close()

    def infill(self, body):
        st, data = self.request("POST", "/infill", body)
        if st != 200:
            raise RuntimeError(f"/infill: HTTP {st}: {data[:300]!r}")
        return json.loads(data)

    def stop(self):
        if getattr(self, "proc", None) is not None:
            P.stop_process(self.proc, 30)
        self.log.close()
        self.d.stop()


def body(case, prefix=None, chunks=None, cache=True):
    """llama.vim's /infill request for a case (text as UTF-8 strings). The
    server is started with eval/infill.py's -n, which sets its budget for
    input_extra (n_ctx - n_batch - 2 n_predict, whatever a request asks);
    the line stops at the newline."""
    ch = case["chunks"] if chunks is None else chunks
    return {"input_prefix": (case["prefix"] if prefix is None else prefix).decode("utf-8", "replace"),
            "prompt": case["prompt"].decode("utf-8", "replace"),
            "input_suffix": case["suffix"].decode("utf-8", "replace"),
            "input_extra": [{"filename": f, "text": t.decode("utf-8", "replace")} for f, t in ch],
            "n_predict": I.SERVER["n_predict"],
            "temperature": 0, "top_k": 1, "samplers": ["top_k"], "stop": ["\n"],
            "cache_prompt": cache, "n_indent": 0}


def edited_prefix(case):
    """The prefix as it was before the user's last edit: one line among the
    last 24 of those llama-server keeps, changed (a word appended)."""
    lines = case["prefix"].split(b"\n")
    if len(lines) < 4:
        return None
    k = len(lines) - 2 - (case["line"] * 7 + case["col"]) % min(24, len(lines) - 2)
    lines[k] = lines[k] + b"  # was"
    return b"\n".join(lines)


def line_of(r):
    """The completed line (up to a newline) and whether it ended (newline,
    EOT or another stop) rather than running out of tokens."""
    got = r.get("content", "").encode("utf-8", "replace")
    ended = b"\n" in got or r.get("stop_type", "") in ("eos", "word") or bool(r.get("stopped_eos")) \
        or bool(r.get("stopped_word"))
    return got.split(b"\n")[0], ended


def score(case, r):
    got, ended = line_of(r)
    return I.line_score(case["target"], got, ended) | {"got": got.decode("utf-8", "replace")}


def run(build, gguf, cases_, paths=tuple(p for p, _ in PATHS), log=None):
    """{path: {"n", "cached_exact", "full_exact", "changed", "cached_share", "per_case"}}"""
    srv = Serve(build, gguf)
    res = {}
    try:
        for path in paths:
            per = []
            for i, c in enumerate(cases_):
                if path == "edit":
                    warm = edited_prefix(c)
                    if warm is None:
                        continue
                    srv.infill(body(c, prefix=warm))
                else:
                    if len(c["chunks"]) < 2:
                        continue
                    srv.infill(body(c, chunks=list(reversed(c["chunks"]))))
                cached = srv.infill(body(c))
                full = srv.infill(body(c, cache=False))
                t = cached.get("timings", {})
                pn, cn = t.get("prompt_n", 0), t.get("cache_n", 0)
                sc, sf = score(c, cached), score(c, full)
                per.append({"cached": sc, "full": sf, "changed": sc["got"] != sf["got"],
                            "cache_n": cn, "prompt_n": pn})
                if log and i % 10 == 9:
                    log(f"  infill via serve, {path}: {i + 1}/{len(cases_)}")
            n = len(per)
            res[path] = {
                "n": n,
                "cached_exact": sum(p["cached"]["exact"] for p in per) / max(1, n),
                "full_exact": sum(p["full"]["exact"] for p in per) / max(1, n),
                "cached_right": sum(p["cached"]["right_before_miss"] for p in per) / max(1, n),
                "full_right": sum(p["full"]["right_before_miss"] for p in per) / max(1, n),
                "changed": sum(p["changed"] for p in per) / max(1, n),
                "cached_share": sum(p["cache_n"] for p in per) / max(1, sum(p["cache_n"] + p["prompt_n"] for p in per)),
                "per_case": per}
    finally:
        srv.stop()
    return res


def main(argv):
    import argparse
    import corpus
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default=os.environ.get(
        "KVR_BUILD", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "build")))
    ap.add_argument("--per-file", type=int, default=4)
    a = ap.parse_args(argv)
    _, held = corpus.split()
    cs = I.cases(held, a.per_file)
    r = run(os.path.abspath(a.build), os.path.join(os.path.abspath(a.build), "eval", "kvrope-code.gguf"), cs,
            log=lambda m: print(m, file=sys.stderr, flush=True))
    for p, name in PATHS:
        x = r[p]
        print(f"{name}: {x['n']} cases; exact cached {x['cached_exact']:.3f} vs full {x['full_exact']:.3f}; "
              f"changed {x['changed']:.3f}; cache supplied {x['cached_share']:.3f} of the prompt")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
