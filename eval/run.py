#!/usr/bin/python3
"""run.py — `make eval`: what kvrope's approximations cost the trained code
model (eval/model), measured through a kvroped it starts and through both
engines (llama.cpp, the numpy Llama as a cross-check). Writes docs/eval.md,
the pictures in docs/eval/, the README's quality tables (between the
`eval:begin` / `eval:end` markers) and build/eval/results.json.
Debian's /usr/bin/python3.

    /usr/bin/python3 eval/run.py [--build build] [--engines llama,numpy]
        [--edits N] [--real N] [--docs N] [--quant N] [--long N] [--infill N]
        [--only infill --merge RESULTS.json] [--no-write]

Every number is an average over the cases named in its table's caption;
cases are seeded (eval/cases.py), so a rerun on the same corpus and model
gives the same tables (up to llama.cpp's threading: its float sums may
differ in the last bits between thread counts).
"""
import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

from paths import HERE, ROOT  # also puts the repository's Python on sys.path

import cases as C
import corpus
import engines as E
import infill as I
import infill_serve as IS
import measure as M
import procs as P

MODEL_DIR = os.environ.get("KVR_EVAL_MODEL") or os.path.join(HERE, "model")
CODECS = [  # (row name, spec) — docs/quantized.md
    ("f16", "f16"), ("bf16", "bf16"), ("int8", "int8"), ("int4", "int4"), ("int2", "int2"),
    ("k4v2", "k4v2"), ("k2v4", "k2v4"),
    ("k4v2 r0", "k=int4/g128/c,v=int2/g64,r=0"), ("k2v4 r0", "k=int2/g128/c,v=int4/g64,r=0"),
    ("kivi k4v2 r32", "kivi:k4v2:g32:r32"), ("kivi k2v4 r32", "kivi:k2v4:g32:r32"),
    ("kivi k2v2 r32", "kivi:k2v2:g32:r32"),
    ("q8_0", "q8_0"), ("q4_0", "q4_0"),
]
APE_T = (0.7, 0.8, 0.9, 1.0)
APE_S = (0.8, 0.9, 1.0, 1.1)


class Daemon:
    """A kvroped of the build on a temporary Unix socket, stopped by stop()."""

    def __init__(self, build, max_memory="2G"):
        exe = os.path.join(build, "kvroped")
        if not os.access(exe, os.X_OK):
            raise SystemExit(f"eval: {exe} is not built (make)")
        self.dir = tempfile.mkdtemp(prefix="kvr-eval-")
        self.socket = os.path.join(self.dir, "kvroped.sock")
        self.log = open(os.path.join(self.dir, "kvroped.log"), "wb")
        self.proc = subprocess.Popen([exe, "--socket", self.socket, "--max-memory", max_memory,
                                      "--log-level", "warn"], stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 15
        while not P.unix_socket_answers(self.socket):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise SystemExit("eval: kvroped did not start")
            time.sleep(0.02)

    def stop(self):
        P.stop_process(self.proc, 15)
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def make_engine(name, build, model_dir=MODEL_DIR, threads=2):
    if name == "numpy":
        return E.NumpyEngine(model_dir)
    gguf = os.path.join(build, "eval", "kvrope-code.gguf")
    worker = os.path.join(build, "kvrope-llama")
    for f in (gguf, worker):
        if not os.path.exists(f):
            raise SystemExit(f"eval: {f} is missing (make {os.path.relpath(f, ROOT)})")
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    return E.LlamaEngine(gguf, worker, cfg, threads)


def register(client, name, model_dir=MODEL_DIR, dtype="f32"):
    """The eval model in the daemon. f32 at rest for the positional measurements
    (only the approximation under test shows); f16 for the codecs (their
    full-precision windows are then f16, as KIVI keeps them)."""
    return client.register_model(name, os.path.join(model_dir, "config.json"), dtype=dtype)


# ---- aggregation -------------------------------------------------------------------

def pool(rowsets, key):
    """Sums per-position counts of one row over cases."""
    s = {"n": 0, "bits": 0.0, "correct": 0, "agree": 0, "kl": 0.0, "encoded": 0, "tokens": 0,
         "nextline": 0, "lines": 0, "nl_prefix": 0, "nl_len": 0}
    for case in rowsets:
        r = case["rows"].get(key)
        if r is None:
            continue
        for k in ("n", "bits", "correct", "agree", "kl"):
            s[k] += r.get(k, 0)
        s["encoded"] += r.get("encoded", 0)
        s["tokens"] += case.get("n_tokens", 0)
        if r.get("nextline") is not None:
            s["nextline"] += r["nextline"]
            s["lines"] += 1
            s["nl_prefix"] += r.get("nl_prefix", 0)
            s["nl_len"] += r.get("nl_len", 0)
    return s


def fmt(x, d=3):
    return "–" if x is None else f"{x:.{d}f}"


def pct(x):
    return "–" if x is None else f"{100 * x:.1f}%"


# ---- the four measurements -----------------------------------------------------------

def run_pie(client, engine, model, edits, log):
    out = []
    for i, (kind, name, a, b) in enumerate(edits):
        A, B = corpus.encode(a), corpus.encode(b)
        try:
            r = M.pie_case(client, engine, model, f"pie{i}", A, B)
        except ValueError:
            continue
        r.update(kind=kind, name=name)
        out.append(r)
        log(f"  pie {i + 1}/{len(edits)} {kind} {name}: KL pie {r['rows']['pie']['kl'] / r['rows']['pie']['n']:.3f}"
            f" naive {r['rows']['naive']['kl'] / r['rows']['naive']['n']:.3f}")
    return out


def run_docs(client, engine, model, cases_, ts, log):
    out = []
    for i, (p, chunks, cont) in enumerate(cases_):
        r = M.docs_case(client, engine, model, f"doc{i}", corpus.encode(p),
                        [corpus.encode(c, bos=False) for c in chunks], corpus.encode(cont, bos=False), ts)
        out.append(r)
        log(f"  docs {i + 1}/{len(cases_)}")
    return out


def run_quant(client, engine, model, files, log, n_prefix=384):
    out = []
    for i, (name, data) in enumerate(files):
        r = M.quant_case(client, engine, model, f"q{i}", corpus.encode(data), n_prefix, CODECS)
        r.pop("plain_f16_logits", None)
        r.pop("f16_logits", None)
        out.append(r)
        log(f"  quant {i + 1}/{len(files)} {name}")
    return out


def run_infill(engine, cases_, log):
    """Middle-line completion (eval/infill.py): per row the exact-match rate
    and the share of bytes right before the first miss."""
    r = I.run(engine, cases_, log=log)
    for row, _ in I.ROWS:
        log(f"  infill {row}: exact {pct(r[row]['exact'])}, right before miss {pct(r[row]['right_before_miss'])}")
    return {row: {k: v for k, v in x.items() if k != "per_case"} |
            {"got": [c["got"].decode("latin-1") for c in x["per_case"]],
             "ended": sum(c["ended"] for c in x["per_case"])} for row, x in r.items()}


def run_stream(client, engine, model, files, log, window=256, sinks=4):
    pols = {"full": None, "window": (0, window), "sinks+window": (sinks, window - sinks)}
    out = []
    for i, (name, data) in enumerate(files):
        out.append(M.stream_case(client, engine, model, f"s{i}", corpus.encode(data), pols,
                                 score_from=window))
        log(f"  stream {i + 1}/{len(files)} {name}")
    return out


# ---- tables ----------------------------------------------------------------------------

PIE_ROWS = [("full", "full re-encode"), ("pie", "kvrope PIE edit (new tokens only)")] + \
    [(f"pie+{k}", f"PIE, {k} tokens refreshed after each edit point") for k in M.REFRESH_KS] + \
    [("naive", "naive reuse (suffix keys at their old positions)")]


def pie_tables(res):
    kinds = sorted({c["kind"] for c in res}, key=["insert", "delete", "multi", "real"].index)
    lines = ["| method | next-token acc. | agrees with full | mean KL from full (nats) | next line exact | "
             "next line: bytes right before the first miss | tokens encoded |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for key, label in PIE_ROWS:
        s = pool(res, key)
        if not s["n"]:
            continue
        lines.append(f"| {label} | {pct(s['correct'] / s['n'])} | {pct(s['agree'] / s['n'])} | "
                     f"{fmt(s['kl'] / s['n'], 4)} | "
                     f"{pct(s['nextline'] / s['lines']) if s['lines'] else '–'} | "
                     f"{pct(s['nl_prefix'] / s['nl_len']) if s['nl_len'] else '–'} | "
                     f"{pct(s['encoded'] / s['tokens'])} |")
    by = ["| mean KL from full re-encode | " + " | ".join(f"{k} ({sum(1 for c in res if c['kind'] == k)})"
                                                        for k in kinds) + " |",
          "| --- |" + " --- |" * len(kinds)]
    for key, label in PIE_ROWS[1:]:
        cells = []
        for k in kinds:
            s = pool([c for c in res if c["kind"] == k], key)
            cells.append(fmt(s["kl"] / s["n"], 4) if s["n"] else "–")
        by.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines), "\n".join(by), kinds


DOC_ROWS = [("full", "full sequential encode"), ("sequential", "kvrope sequential re-layout"),
            ("ape", "APE parallel, T = {T}, S = {S}"), ("ape_folded", "APE parallel, T = {T} folded into K, S = 1"),
            ("ape_folded_09", "APE parallel, T = 0.9 (the daemon's default) folded into K, S = 1"),
            ("parallel", "plain parallel"), ("none", "no chunks")]


def docs_table(res, ts):
    full = pool(res, "full")
    none = pool(res, "none")
    bf, bn = full["bits"] / full["n"], none["bits"] / none["n"]
    lines = ["| layout | continuation bits/byte | share of the full encode's gain kept |",
             "| --- | --- | --- |"]
    for key, label in DOC_ROWS:
        s = pool(res, key)
        if not s["n"]:
            continue
        b = s["bits"] / s["n"]
        gain = (bn - b) / (bn - bf) if bn != bf else None
        lines.append(f"| {label.format(T=ts[0], S=ts[1])} | {fmt(b)} | {pct(gain)} |")
    return "\n".join(lines)


def quant_table(res):
    f16 = sum(r["f16"]["bits"] for r in res) / sum(r["f16"]["n"] for r in res)
    lines = ["| codec | canonical spec | bytes/token | bits/value | bits/byte of the rest | added vs f16 |",
             "| --- | --- | --- | --- | --- | --- |"]
    pts = []
    for name, _ in CODECS:
        rs = [r[name] for r in res if name in r]
        if not rs:
            continue
        b = sum(r["bits"] for r in rs) / sum(r["n"] for r in rs)
        bpt = float(np.mean([r["bytes_per_token"] for r in rs]))
        bpv = float(np.mean([r["bits_per_value"] for r in rs]))
        lines.append(f"| {name} | `{rs[0]['codec']}` | {bpt:.0f} | {bpv:.2f} | {fmt(b, 4)} | {b - f16:+.4f} |")
        pts.append((name, bpt, b - f16))
    return "\n".join(lines), pts


def run_infill_serve(build, cases_, log):
    """The infill cases through kvrope serve on the cached paths (eval/infill_serve.py)."""
    gguf = os.path.join(build, "eval", "kvrope-code.gguf")
    log(f"infill through kvrope serve: {len(cases_)} cases per path")
    r = IS.run(build, gguf, cases_, log=log)
    for p, _ in IS.PATHS:
        x = r[p]
        log(f"  {p}: exact cached {pct(x['cached_exact'])} / full {pct(x['full_exact'])}, "
            f"changed {pct(x['changed'])}, cache supplied {pct(x['cached_share'])}")
    return r


def infill_serve_section(res):
    rows = ["| path | cases | exact match, cached | exact match, full re-encode | bytes right before the "
            "first miss, cached / full | completion differs from full | prompt tokens from the cache |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for p, name in IS.PATHS:
        if p in res:
            x = res[p]
            rows.append(f"| {name} | {x['n']} | {pct(x['cached_exact'])} | {pct(x['full_exact'])} | "
                        f"{pct(x['cached_right'])} / {pct(x['full_right'])} | {pct(x['changed'])} | "
                        f"{pct(x['cached_share'])} |")
    cap = ("The same middle-line cases sent to kvrope serve (build/kvrope-llama serve on the committed "
           f"model's GGUF, -c {I.SERVER['n_ctx']} -b {I.SERVER['n_batch']}, kvroped behind it) as llama.vim "
           "sends /infill, each after a warm-up request that leaves the cache on one of its "
           "paths: PIE edit (one line of the kept prefix changed since the warm-up: kept tokens re-rotated, the "
           "changed line and the default refresh decoded) or chunk placement (the input_extra chunks cached in "
           "the reverse order: found by content, placed, seams repaired with EPIC k = 16). Each is compared "
           "with the same request sent with cache_prompt false (a full re-encode on the same server). "
           "Greedy. Made by eval/infill_serve.py (run by `make eval` and `eval/run.py --only infill`).")
    return ["### Infill through kvrope serve: does the cache change the completion?", "", cap, "",
            "\n".join(rows), ""]


def infill_table(res):
    rows = ["| request | middle-line exact match | bytes right before the first miss | cases |",
            "| --- | --- | --- | --- |"]
    for row, name in I.ROWS:
        if row in res:
            x = res[row]
            rows.append(f"| {name} | {pct(x['exact'])} | {pct(x['right_before_miss'])} | {x['n']} |")
    return "\n".join(rows)


def infill_caption(res, per_file):
    n = next(iter(res.values()))["n"]
    return (f"Infill: {n} middle-line cases on the held-out files (up to {per_file} cursors per "
            "file, seeded by its path): the cursor inside a line of code, the rest of that line the target, "
            f"the request as llama.vim sends it ({I.N_PREFIX_LINES} lines before, {I.N_SUFFIX_LINES} after, "
            f"up to {I.N_CHUNKS} chunks of {I.CHUNK_LINES} lines of other files of the same package as "
            "input_extra) and the prompt as llama-server builds it for /infill with "
            f"-c {I.SERVER['n_ctx']} -b {I.SERVER['n_batch']} -n {I.SERVER['n_predict']} (eval/fim.py "
            "format_infill, token for token); left to right gets the same prefix without FIM tokens or "
            "suffix. Greedy; the line ends at a newline or a special token (EOT). Exact match: the whole "
            "rest of the line, nothing more. The same requests through kvrope serve's cached paths: the "
            "next table.")


def stream_table(res, window=256, sinks=4):
    lines = [f"| cache | bits/byte, tokens {window}.. | bits/byte beyond the 512-token training context |",
             "| --- | --- | --- |"]
    labels = {"full": "full cache (nothing dropped)", "window": f"window of the last {window} tokens",
              "sinks+window": f"{sinks} sinks + window of {window - sinks}"}
    for name in ("full", "window", "sinks+window"):
        a = [r[name]["all"] for r in res]
        b = [r[name]["beyond"] for r in res]
        va = sum(x["bits"] for x in a) / max(1, sum(x["n"] for x in a))
        vb = sum(x["bits"] for x in b) / max(1, sum(x["n"] for x in b))
        lines.append(f"| {labels[name]} | {fmt(va)} | {fmt(vb)} |")
    return "\n".join(lines)


# ---- pictures ------------------------------------------------------------------------

def can_plot(log):
    """matplotlib present (scripts/deps.sh eval); without it the pictures of
    the last run are kept, so a partial run (--only) still writes its tables."""
    try:
        import matplotlib  # noqa: F401
        return True
    except ImportError:
        log("matplotlib is not installed: docs/eval/*.png kept as they are")
        return False


@contextlib.contextmanager
def _figure(path):
    """One plot: yields its axes, then lays the figure out and saves it to path."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    try:
        yield ax
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)


def plot_pie(res, kinds, path, engine_name):
    with _figure(path) as ax:
        xs = [0] + list(M.REFRESH_KS)
        for k in kinds:
            sub = [c for c in res if c["kind"] == k]
            ys = []
            for key in ["pie"] + [f"pie+{x}" for x in M.REFRESH_KS]:
                s = pool(sub, key)
                ys.append(s["kl"] / s["n"])
            line, = ax.plot(xs, [max(y, 1e-6) for y in ys], marker="o", label=f"PIE, {k} ({len(sub)})")
            s = pool(sub, "naive")
            ax.axhline(s["kl"] / s["n"], color=line.get_color(), linestyle=":", linewidth=1)
        ax.plot([], [], color="gray", linestyle=":", label="naive reuse (same colour)")
        ax.set_yscale("log")
        ax.set_xscale("symlog", linthresh=16)
        ax.set_xticks(xs)
        ax.set_xticklabels([str(x) for x in xs])
        ax.set_xlabel("tokens refreshed after each edit point")
        ax.set_ylabel("mean KL from full re-encode (nats/token, log;\nfull re-encode = 0)")
        ax.set_title(f"PIE edits: divergence vs refresh ({engine_name})")
        ax.legend(fontsize=8)


def plot_quant(pts, path, engine_name):
    with _figure(path) as ax:
        for i, (name, bpt, add) in enumerate(sorted(pts, key=lambda p: (p[1], p[2]))):
            ax.scatter([bpt], [add])
            ax.annotate(name, (bpt, add), textcoords="offset points", xytext=(6, 6 if i % 2 else -7),
                        fontsize=7, va="center")
        ax.set_yscale("symlog", linthresh=1e-3)
        ax.set_xlabel("bytes per token at rest (K+V, all layers, scales included)")
        ax.set_ylabel("added bits per byte vs f16 (symlog)")
        ax.set_title(f"Quantization at rest: cost vs size ({engine_name})")
        ax.grid(alpha=0.3)


# ---- main ----------------------------------------------------------------------------

def main(argv):
    ap = argparse.ArgumentParser(description="make eval: quality tables for kvrope's approximations")
    ap.add_argument("--build", default=os.environ.get("KVR_BUILD", os.path.join(ROOT, "build")))
    ap.add_argument("--engines", default="llama,numpy")
    ap.add_argument("--edits", type=int, default=24, help="synthetic edits per kind")
    ap.add_argument("--real", type=int, default=24, help="real edits from git history")
    ap.add_argument("--docs", type=int, default=32)
    ap.add_argument("--tune", type=int, default=8, help="document cases to choose APE's T, S on")
    ap.add_argument("--quant", type=int, default=16)
    ap.add_argument("--long", type=int, default=8)
    ap.add_argument("--infill", type=int, default=4, help="middle-line cursor cases per held-out file")
    ap.add_argument("--only", default=None, choices=["infill"],
                    help="measure only this section; the others come from --merge")
    ap.add_argument("--merge", default=None, help="results.json of an earlier run for the sections not measured")
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs and README")
    ap.add_argument("--from-results", default=None,
                    help="rewrite the report from a results.json of an earlier run (no measuring)")
    a = ap.parse_args(argv)
    t0 = time.time()
    if a.from_results:
        with open(a.from_results) as f:
            res = json.load(f)
        res["ape_ts"] = tuple(res["ape_ts"])
        write_report(res, a, res.get("seconds", 0), print)
        return 0

    def log(msg):
        print(f"[{time.time() - t0:6.0f}s] {msg}", flush=True)

    with open(os.path.join(MODEL_DIR, "train.json")) as f:
        meta = json.load(f)
    tr, ho = corpus.split()
    if corpus.corpus_digest(tr + ho) != meta["corpus_digest"]:
        log("note: this machine's /usr/lib/python3.11 differs from the one the model was trained on")
    ic = I.cases(ho, a.infill)
    if a.only == "infill":
        if not a.merge:
            raise SystemExit("eval: --only infill needs --merge RESULTS.json (the other sections)")
        with open(a.merge) as f:
            results = json.load(f)
        results["ape_ts"] = tuple(results["ape_ts"])
        results["infill_model"] = meta
        results["infill_per_file"] = a.infill
        for en in [x for x in a.engines.split(",") if x]:
            eng = make_engine(en, a.build)
            log(f"engine {eng.name}: {len(ic)} infill cases")
            results["engines"].setdefault(eng.name, {})["infill"] = run_infill(eng, ic, log)
        results["infill_serve"] = run_infill_serve(a.build, ic, log)
        results["seconds_infill"] = time.time() - t0
        with open(os.path.join(MODEL_DIR, "train.json")) as f:   # eval/score.py may have filled it in meanwhile
            results["infill_model"] = json.load(f)
        os.makedirs(os.path.join(a.build, "eval"), exist_ok=True)
        with open(os.path.join(a.build, "eval", "results.json"), "w") as f:   # before the report: kept if it fails
            json.dump(results, f, indent=1, default=float)
        write_report(results, a, results.get("seconds", 0), log)
        return 0
    edits = C.synthetic_edits(a.edits) + C.git_edits(a.real, ROOT)
    docs = C.doc_cases(a.docs, skip=a.tune)
    tune = C.doc_cases(a.tune)
    qf = C.quant_files(a.quant)
    lf = C.long_files(a.long)
    log(f"{len(edits)} edits, {len(docs)} document cases (+{len(tune)} to tune APE), "
        f"{len(qf)} quantization files, {len(lf)} long files")
    import kvrope
    d = Daemon(a.build)
    results = {"model": meta, "infill_model": meta, "infill_per_file": a.infill, "engines": {}}
    try:
        with kvrope.Client("unix:" + d.socket) as client:
            register(client, "code")
            register(client, "code16", dtype="f16")
            np_engine = E.NumpyEngine(MODEL_DIR)
            grid = M.ape_grid(client, np_engine, "code", "tune", [
                (corpus.encode(p), [corpus.encode(c, bos=False) for c in ch], corpus.encode(q, bos=False))
                for p, ch, q in tune], APE_T, APE_S)
            ts = min(grid, key=grid.get)
            results["ape_grid"] = {f"T={k[0]},S={k[1]}": v for k, v in grid.items()}
            results["ape_ts"] = ts
            log(f"APE T, S chosen on {len(tune)} tuning cases: T = {ts[0]}, S = {ts[1]} "
                f"({grid[ts]:.4f} bits/byte; T = S = 1: {grid[(1.0, 1.0)]:.4f})")
            for en in [x for x in a.engines.split(",") if x]:
                eng = np_engine if en == "numpy" else make_engine(en, a.build)
                log(f"engine {eng.name}")
                r = {"pie": run_pie(client, eng, "code", edits, log),
                     "docs": run_docs(client, eng, "code", docs, ts, log),
                     "quant": run_quant(client, eng, "code16", qf, log),
                     "stream": run_stream(client, eng, "code", lf, log),
                     "infill": run_infill(eng, ic, log)}
                results["engines"][eng.name] = r
    finally:
        d.stop()
    results["infill_serve"] = run_infill_serve(a.build, ic, log)
    results["seconds"] = time.time() - t0
    write_report(results, a, results["seconds"], log)
    return 0


def findings(results):
    """What the tables say, computed from them (so the words stay true)."""
    en = "llama.cpp" if "llama.cpp" in results["engines"] else next(iter(results["engines"]))
    r = results["engines"][en]
    kl = lambda key: (lambda s: s["kl"] / s["n"])(pool(r["pie"], key))
    out = ["## What the tables say", "", f"From the {en} tables above (the numpy engine agrees to the "
           "third decimal):", ""]
    out.append(f"- **PIE.** A kvrope PIE edit that encodes only the new tokens ({pct(pool(r['pie'], 'pie')['encoded'] / pool(r['pie'], 'pie')['tokens'])} "
               f"of a re-encode) stays at a mean KL of {kl('pie'):.4f} nats from the full re-encode, "
               f"{kl('naive') / max(kl('pie'), 1e-12):.0f}x below naive reuse ({kl('naive'):.3f}); refreshing "
               f"16 tokens after each edit point cuts it to {kl('pie+16'):.4f}, 64 to {kl('pie+64'):.4f}. "
               "Several edits at once (multi) cost most without a refresh.")
    d = {k: pool(r["docs"], k) for k in ("full", "none", "sequential", "parallel", "ape", "ape_folded",
                                          "ape_folded_09")}
    b = {k: v["bits"] / v["n"] for k, v in d.items() if v["n"]}
    share = lambda k: (b["none"] - b[k]) / (b["none"] - b["full"])
    ape_txt = (f"APE with T = {results['ape_ts'][0]}, S = {results['ape_ts'][1]} (numpy) {pct(share('ape'))}, "
               if "ape" in b else "")
    out.append(f"- **Documents.** Re-laid out sequentially by kvrope, separately encoded chunks keep "
               f"{pct(share('sequential'))} of the full encode's gain; in parallel {pct(share('parallel'))}; "
               f"{ape_txt}T = 0.9 folded {pct(share('ape_folded_09'))}. " +
               ("On this model APE's temperature and scale do not beat plain parallel attention on the "
                "reported cases" if "ape" in b and share("ape") <= share("parallel") else
                "APE's temperature and scale improve on plain parallel attention") +
               f" (the grid's best: T = {results['ape_ts'][0]}, S = {results['ape_ts'][1]}); the "
               "sequential re-layout keeps the most when the order of the chunks is known.")
    q = r["quant"]
    f16 = sum(x["f16"]["bits"] for x in q) / sum(x["f16"]["n"] for x in q)
    add = lambda k: sum(x[k]["bits"] for x in q) / sum(x[k]["n"] for x in q) - f16
    pairs = [("k4v2", "k2v4"), ("k4v2 r0", "k2v4 r0"), ("kivi k4v2 r32", "kivi k2v4 r32")]
    won = sum(1 for a_, b_ in pairs if add(a_) < add(b_))
    out.append("- **Quantization.** At the same bits, 4-bit keys with 2-bit values beat 2-bit keys with "
               f"4-bit values in {won} of {len(pairs)} pairings: " +
               "; ".join(f"{a_} {add(a_):+.4f} vs {b_} {add(b_):+.4f}" for a_, b_ in pairs) +
               " bits/byte (KV-AdaQuant's finding " +
               ("holds here" if won == len(pairs) else "does not hold here" if won == 0 else "holds in part") +
               f"). int8 adds {add('int8'):+.4f}, int4 "
               f"{add('int4'):+.4f}, int2 {add('int2'):+.4f}; q8_0 {add('q8_0'):+.4f}, q4_0 {add('q4_0'):+.4f}.")
    st = r["stream"]
    sb = {k: sum(x[k]["all"]["bits"] for x in st) / sum(x[k]["all"]["n"] for x in st)
          for k in ("full", "window", "sinks+window")}
    out.append(f"- **Retention.** Past the 512-token training context the full cache degrades "
               f"({sb['full']:.3f} bits/byte from token 256 on), a 256-token window does not "
               f"({sb['window']:.3f}), and 4 attention sinks in the same budget are better still "
               f"({sb['sinks+window']:.3f}), as StreamingLLM reports.")
    if "infill" in r:
        x = r["infill"]
        better = x["fim"]["exact"] > x["ltr"]["exact"]
        out.append(f"- **Infill.** Completing the rest of a line with the code after it known, FIM gets "
                   f"{pct(x['fim']['exact'])} of the lines exactly (with input_extra chunks of the same package "
                   f"{pct(x['fim_extra']['exact'])}) against {pct(x['ltr']['exact'])} left to right"
                   + (": the suffix helps." if better else ": on this model the suffix does not help yet.")
                   + f" Bytes right before the first miss: {pct(x['fim']['right_before_miss'])} / "
                   f"{pct(x['fim_extra']['right_before_miss'])} / {pct(x['ltr']['right_before_miss'])}.")
    out.append("")
    return out


def model_paragraph(meta):
    v = meta.get("vocab", 260)
    toks = "260 byte tokens" if v == 260 else f"{v} tokens: 260 byte-level ones and {v - 260} fill-in-the-middle ones"
    with open(os.path.join(MODEL_DIR, "config.json")) as f:
        c = json.load(f)
    head = (f"A {meta['params'] / 1e6:.2f} M-parameter Llama-architecture model (eval/model/config.json: "
            f"{c['num_hidden_layers']} layers, width {c['hidden_size']}, {c['num_attention_heads']} query heads "
            f"and {c['num_key_value_heads']} KV heads of dimension {c['head_dim']}, SwiGLU FFN of "
            f"{c['intermediate_size']}, RMSNorm, interleaved RoPE with base {c['rope_theta']:g}, context "
            f"{c['max_position_embeddings']}, {toks}) trained by `make eval-model` (eval/train.py) "
            f"on the Python standard library of Debian 12 ({meta['train_files']} files, "
            f"{meta['train_tokens'] / 1e6:.1f} M bytes), ")
    run = lambda m: (f"{m['steps']} steps of {m['batch']} x {m['seq']} tokens"
                     + (f" (the last {m['steps'] - m['long_from']} of {m['batch'] * m['seq'] // m['context']} x "
                        f"{m['context']}, so the whole context is trained)" if m.get("long_from") is not None else "")
                     + f" ({m['tokens_seen'] / 1e6:.1f} M "
                     f"tokens seen, {m['train_seconds'] / 60:.0f} min of wall time, "
                     f"{m['tokens_seen'] / max(1.0, m['train_seconds']) / 1e3:.1f} k tokens a second"
                     + (", bfloat16 matrix products" if m.get("bf16") else "") + ")")
    order = ("SPM: suffix first, as llama-server --spm-infill builds it; the GGUF says so and kvrope serve "
             "follows" if meta.get("spm") else "PSM")
    p = meta.get("init_model")
    if p:
        body = (f"first left to right, {run(p)}, then from those weights {run(meta)} with "
                f"{meta['fim_rate']:.0%} of the rows fill-in-the-middle samples laid out as llama-server's "
                f"/infill prompt ({order}; {meta['repo_share']:.0%} of them with the repo-level FIM_REP / FIM_SEP "
                "context of input_extra; eval/fim.py), the rest left to right. ")
    elif meta.get("fim_rate"):
        body = (f"from random weights, {run(meta)}, with {meta['fim_rate']:.0%} of the rows "
                f"fill-in-the-middle samples laid out as llama-server's /infill prompt ({order}; "
                f"{meta['repo_share']:.0%} of them with the repo-level FIM_REP / FIM_SEP context of input_extra; "
                f"a middle's tokens weigh {meta.get('mid_weight', 1):g} in the loss; eval/fim.py), the rest left "
                "to right" + (f", each of those with {meta['mid_noise']} FIM_MID tokens put at random places and "
                              "not scored (so the model reads the byte after a FIM_MID as continuing the text "
                              "before it: an SPM middle's first byte)" if meta.get("mid_noise") else "") + ". ")
    else:
        body = run(meta) + ". "
    o = meta.get("other_python")
    other = (f" On Python that is not the standard library, {len(o['files'])} files of Debian's "
             f"{o['package']} ({o['bytes']} bytes, chosen by the same path hash, never trained on): "
             f"**{o['bpb']:.3f}** bits per byte." if o else "")
    sw = meta.get("lr_sweep")
    if sw:
        body += ("Learning rate: " + sw["how"] + " " + "; ".join(
            f"lr {r['lr']:g} ({r['run']}): {r['bpb']:.3f}" for r in sw["runs"]) + ". ")
    hb = meta.get("held_out_bpb")
    return (head + body + f"**Held-out bits per byte, left to right: "
            f"{'not scored (eval/score.py)' if hb is None else format(hb, '.3f')}** over "
            f"{meta['held_out_files']} files never trained on ({meta['held_out_tokens']} bytes"
            + (f", scored through llama.cpp in windows of {meta['score_window']} tokens" if meta.get("score_window") else "")
            + f"; random weights give ~8).{other} The committed weights are float16 (eval/model/weights.npz, the numpy "
            "Llama's format); `scripts/gen-gguf.py --hf eval/model` writes the GGUF llama.cpp runs "
            "(build/eval/kvrope-code.gguf), with the FIM token ids under the keys llama.cpp reads.")


# Where docs/eval.md's hand-written account of the FIM training goes (kept
# from the file being replaced; this placeholder when there is none).
FIM_NOTES = "<!-- fim:begin (hand-written, kept by eval/run.py) -->\n<!-- fim:end -->"


def write_report(results, a, seconds, log):
    meta = results["model"]
    ts = results["ape_ts"]
    cmd = "make eval"
    md = ["# What the approximations cost: quality on a trained code model", "",
          "Generated by `make eval` (eval/run.py); do not edit by hand. "
          f"Run took {seconds / 60:.0f} min on the 2-core machine.", "",
          "## The model", "", model_paragraph(results.get("infill_model", meta)), "",
          *([f"Note: only the infill tables were measured on this model (`eval/run.py --only infill`). The "
             "PIE, documents, quantization and retention tables are the last full run's, on the model before "
             f"fill-in-the-middle training (held-out {meta['held_out_bpb']:.3f} bits/byte); the next full "
             "`make eval` measures them on this one.", ""]
            if results.get("infill_model", meta) is not meta and results["infill_model"] != meta else []),
          FIM_NOTES, "",
          "Every cache below lives in a kvroped that eval/run.py starts: the edits, re-rotations, "
          "layouts, codecs and retention are the daemon's. An engine only encodes tokens and scores "
          "them from the KV kvrope returns. llama.cpp (`kvrope-llama score`, docs/llama.md) is the "
          "engine of the headline tables; the numpy Llama (examples/llama.py) runs the same cases as "
          "a cross-check and is the only one that can apply APE's scale S.", ""]
    readme = []
    for en, r in results["engines"].items():
        md += [f"## Engine: {en}", ""]
        pt, by, kinds = pie_tables(r["pie"])
        nk = {k: sum(1 for c in r["pie"] if c["kind"] == k) for k in kinds}
        cap = (f"PIE edits: {len(r['pie'])} edits ({', '.join(f'{v} {k}' for k, v in nk.items())}; synthetic "
               "ones on held-out files as in the PIE paper, real ones replayed from this repository's git "
               "history of its Python files). Scored over every token after the first edit point: the "
               "next byte's accuracy, agreement of the argmax with a full re-encode, KL(full || method), "
               "and, generating greedily from the first line end at least 48 tokens after the last edit (so "
               "reused suffix cells lie in between), whether the next line comes out "
               "exactly and what share of its bytes comes out right before the first miss (this 3 M "
               "model rarely gets a whole line: greedy decoding falls into runs of spaces). "
               "Tokens encoded: new + refreshed tokens as a share of a full re-encode.")
        md += [f"### PIE edits ({en})", "", cap, "", pt, "", by, ""]
        if not a.no_write:
            os.makedirs(os.path.join(ROOT, "docs", "eval"), exist_ok=True)
            tag = "llama" if en.startswith("llama") else "numpy"
            if can_plot(log):
                plot_pie(r["pie"], kinds, os.path.join(ROOT, "docs", "eval", f"pie-{tag}.png"), en)
            md += [f"![divergence vs tokens refreshed](eval/pie-{tag}.png)", ""]
        dt = docs_table(r["docs"], ts)
        dcap = (f"Documents: {len(r['docs'])} cases, each 3 chunks of 96 bytes of a held-out file encoded one "
                "by one after a shared header line, then the 128 bytes that follow them in the file (which "
                "depend on them) scored. Share of gain = (none - row) / (none - full).")
        md += [f"### Documents ({en})", "", dcap, "", dt, ""]
        qt, pts = quant_table(r["quant"])
        qcap = (f"Quantization at rest: {len(r['quant'])} held-out files; the first 384 tokens encoded, "
                "their cache put into kvrope with each codec and fetched back, the next 128 bytes scored. "
                "Bytes per token are the daemon's own count (the context's kv_bytes, scales included, over its "
                "384 tokens; 4 layers x 2 KV heads x 32 dims, so f16 is 1,024 B). `r=R` keeps the newest R "
                "tokens in f16 (KIVI's residual window), and those count at f16; bits/value is the daemon's "
                "figure for the whole context.")
        md += [f"### Quantization at rest ({en})", "", qcap, "", qt, ""]
        if not a.no_write:
            if can_plot(log):
                plot_quant(pts, os.path.join(ROOT, "docs", "eval", f"quant-{tag}.png"), en)
            md += [f"![added bits per byte vs bytes per token](eval/quant-{tag}.png)", ""]
        st = stream_table(r["stream"])
        scap = (f"Retention: {len(r['stream'])} long held-out files (1,024 bytes each) streamed through "
                "kvrope in 32-token chunks, the cache before each chunk being what the context's retention "
                "policy kept (kvrope drops the middle and moves the window's positions up to the sinks).")
        md += [f"### Retention ({en})", "", scap, "", st, ""]
        if "infill" in r:
            icap, it = infill_caption(r["infill"], results.get("infill_per_file", 4)), infill_table(r["infill"])
            md += [f"### Infill: completing the middle of a line ({en})", "", icap, "", it, ""]
        if en.startswith("llama") or len(results["engines"]) == 1 or not readme:
            readme = [f"Quality on a trained {meta['params'] / 1e6:.2f} M-parameter code model "
                      f"(held-out {meta['held_out_bpb']:.2f} bits/byte), through {en}; "
                      f"made by `{cmd}`, details and the numpy cross-check in [docs/eval.md](docs/eval.md).",
                      "", cap, "", pt, "", dcap, "", dt, "", qcap, "", qt, "", scap, "", st]
            if "infill" in r:
                readme += ["", icap, "", it]
    if "infill_serve" in results:
        md += infill_serve_section(results["infill_serve"])
    fnd = findings(results)
    md += fnd
    readme = readme + [""] + fnd[3:-1]
    g = results["ape_grid"]
    md += ["## How APE's T and S were chosen", "",
           f"A grid over T in {APE_T} and S in {APE_S}, scored (numpy, full APE attention) on "
           f"{len(C.doc_cases(a.tune))} document cases that are not among the reported ones; the lowest "
           f"mean continuation bits per byte won: **T = {ts[0]}, S = {ts[1]}**.", "",
           "| T \\ S | " + " | ".join(str(s) for s in APE_S) + " |", "| --- |" + " --- |" * len(APE_S)]
    for T in APE_T:
        md.append(f"| {T} | " + " | ".join(fmt(g[f'T={T},S={S}'], 4) for S in APE_S) + " |")
    md.append("")
    text = "\n".join(md) + "\n"
    if a.no_write:
        print(text)
        return
    # the reuse section (eval/reuse.py, its own run) and the drift section
    # (eval/drift.py) are kept as they are, and so is the hand-written
    # history of the FIM training, each between its markers
    ep = os.path.join(ROOT, "docs", "eval.md")
    rb, re_ = "<!-- reuse:begin", "<!-- reuse:end"
    if os.path.exists(ep):
        with open(ep) as f:
            old = f.read()
        fb, fe = "<!-- fim:begin", "<!-- fim:end -->"
        if fb in old and fe in old:
            text = text.replace(FIM_NOTES, old[old.index(fb):old.index(fe) + len(fe)], 1)
        db, de = "<!-- drift:begin", "<!-- drift:end -->"
        if db in old and de in old:   # eval/drift.py's table, pasted by hand (its own 20-minute run)
            text = text.rstrip("\n") + "\n\n" + old[old.index(db):old.index(de) + len(de)] + "\n"
        if rb in old and re_ in old:
            end = old.index("-->", old.rindex(re_)) + 3
            text = text.rstrip("\n") + "\n\n" + old[old.index(rb):end] + "\n"
    with open(ep, "w") as f:
        f.write(text)
    os.makedirs(os.path.join(a.build, "eval"), exist_ok=True)
    with open(os.path.join(a.build, "eval", "results.json"), "w") as f:
        json.dump(results, f, indent=1, default=float)
    rp = os.path.join(ROOT, "README.md")
    with open(rp) as f:
        rd = f.read()
    b, e = "<!-- eval:begin -->", "<!-- eval:end -->"
    if b in rd and e in rd:
        rd = rd[:rd.index(b) + len(b)] + "\n" + "\n".join(readme) + "\n" + rd[rd.index(e):]
        with open(rp, "w") as f:
            f.write(rd)
    log("wrote docs/eval.md, docs/eval/*.png, README.md's quality tables, build/eval/results.json")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
