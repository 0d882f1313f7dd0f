#!/usr/bin/python3
"""reuse.py — what reuse anywhere keeps: cached chunks placed at new places in a
prompt (keys re-rotated by kvroped), their seams repaired by the engine
(client/llama/worker_repair.c through `kvrope-llama repair`, or the numpy
Llama's llama.repair), against a full encode. Debian's /usr/bin/python3.

  /usr/bin/python3 eval/reuse.py [--build B] [--cases N] [--chunks K] [--engine llama|numpy]
                                 [--no-write] [--from-results JSON]

Each case: K consecutive chunks of a held-out file and the bytes after them.
Prompt A ("# retrieved from <file>" then the chunks in one shuffled order) is
encoded once and put into kvroped: that is where every chunk is cached.
Prompt B ("# file: <file>" then the chunks in another shuffled order) is what
the user sends; the continuation after it is scored. Each chunk of B is
fetched from A's context with its keys re-rotated to its place in B (the
daemon's get with target positions); B's header is a gap. Rows:

  full encode            B encoded from scratch (the reference)
  placed, no repair      chunks placed, header computed, nothing repaired
  EPIC first k           + the first k tokens of every placed chunk
  CacheBlend p%          + the p% placed tokens whose layer-1 K/V deviates most
                           (found by a probe pass through layer 1: its cost is
                           counted in "with selection")
  kvroped's cover        the daemon's cover verb finds B's runs by content in
                           A's context and places them (what kvrope serve
                           does), EPIC's 16 per run repaired
  prefix caching         the longest common prefix with A reused (what
                           llama-server and vLLM reuse), the rest computed
  APE parallel           the chunks encoded once after B's header as APE
                           documents, laid out in parallel by kvroped (T = 1,
                           S = 1: what llama.cpp can apply)
  no chunks              header and continuation only (the floor of the gain)

Columns: share of the full encode's gain kept ((none - row) / (none - full) in
bits), mean KL(full || row) per continuation token in nats, prompt tokens
computed as a share of a full encode (decoded through every layer), and the
same with the selection pass (probed tokens x layers it ran / n_layer).
Writes build/eval/reuse-<engine>.json and, unless --no-write, the table into
docs/eval.md (between the engine's reuse markers, which eval/run.py keeps) and
docs/eval/reuse.png (reuse-numpy.png for the numpy cross-check);
--from-results rewrites both from a json of an earlier run.
"""
import argparse
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time

import numpy as np

from paths import HERE, ROOT  # also puts the repository's Python on sys.path

import cases as C
import corpus
import engines as E
import llama as L
import measure as M

LN2 = math.log(2.0)
METHODS = ["full", "none_repair", "epic:4", "epic:16", "epic:32", "blend:0.05", "blend:0.15",
           "blend:0.3", "cover_epic16", "prefix", "ape_parallel", "nochunks"]
LABEL = {"full": "full encode", "none_repair": "placed runs, no repair",
         "epic:4": "EPIC first 4 of each run", "epic:16": "EPIC first 16 of each run",
         "epic:32": "EPIC first 32 of each run", "blend:0.05": "CacheBlend 5% (layer 1)",
         "blend:0.15": "CacheBlend 15% (layer 1)", "blend:0.3": "CacheBlend 30% (layer 1)",
         "cover_epic16": "kvroped's cover + EPIC 16 (kvrope serve's path)",
         "prefix": "plain prefix caching", "ape_parallel": "APE parallel (T = 1, S = 1)",
         "nochunks": "no chunks"}
MARK_BEGIN = "<!-- reuse:begin {} (eval/reuse.py) -->"     # one block per engine
MARK_END = "<!-- reuse:end {} -->"


def policy_of(method):
    return {"full": None, "none_repair": "none", "nochunks": None}.get(method, method)


# ---- the engines -------------------------------------------------------------------

class LlamaRepair:
    """`kvrope-llama repair` (one process per call; the model is tiny)."""
    name = "llama.cpp"

    def __init__(self, build, threads=1):
        self.worker = os.path.join(build, "kvrope-llama")
        self.gguf = os.path.join(build, "eval", "kvrope-code.gguf")
        for f in (self.worker, self.gguf):
            if not os.path.exists(f):
                raise SystemExit(f"reuse: {f} is missing (make {os.path.relpath(f, ROOT)})")
        self.threads = threads
        self.tmp = tempfile.mkdtemp(prefix="kvr-reuse-")
        with open(os.path.join(HERE, "model", "config.json")) as f:
            self.vocab = int(json.load(f)["vocab_size"])

    def run(self, prompt, cont, placed_kv=None, placed_pos=None, runs=None, policy=None):
        """-> (logits [len(cont)][V] predicting cont, repair report)."""
        tp, lp = os.path.join(self.tmp, "t.bin"), os.path.join(self.tmp, "l.bin")
        np.concatenate([prompt, cont]).astype("<i4").tofile(tp)
        argv = [self.worker, "--model", self.gguf, "--threads", str(self.threads), "--json",
                "repair", "--tokens", tp, "--prompt-len", str(len(prompt)), "--logits-out", lp]
        if placed_kv is not None and len(placed_pos):
            kp = os.path.join(self.tmp, "kv.bin")
            E.write_kv_file(kp, placed_kv, placed_pos)
            argv += ["--kv", kp]
            if runs:
                argv += ["--runs", ",".join(str(r) for r in runs)]
        argv += ["--policy", policy or "none"]
        r = subprocess.run(argv, capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            raise RuntimeError(f"kvrope-llama repair failed ({r.returncode}): {r.stderr.strip()[-800:]}")
        js = json.loads(r.stdout.strip().splitlines()[-1])
        lg = np.fromfile(lp, dtype="<f4").reshape(-1, self.vocab)
        return lg, js["repair"]


class NumpyRepair:
    """examples/llama.py's repair with the trained weights."""
    name = "numpy"

    def __init__(self, build, threads=1):
        self.model = L.load_model(os.path.join(HERE, "model"))

    def run(self, prompt, cont, placed_kv=None, placed_pos=None, runs=None, policy=None):
        n = len(prompt)
        cfg = self.model
        kv = [(np.zeros((n, cfg.n_kv_heads, cfg.head_dim), np.float32),
               np.zeros((n, cfg.n_kv_heads, cfg.head_dim), np.float32)) for _ in range(cfg.n_layers)]
        placed = np.zeros(n, bool)
        if placed_kv is not None and len(placed_pos):
            for li, (k, v) in enumerate(placed_kv):
                kv[li][0][placed_pos] = k
                kv[li][1][placed_pos] = v
            placed[placed_pos] = True
        rs = None
        if runs:
            rs = np.zeros(n, bool)
            rs[list(runs)] = True
        last, kv, _, st = L.repair(self.model, prompt, kv, placed, rs, policy or "none")
        rows = [last]
        if len(cont) > 1:
            lg, _ = self.model.forward(cont[:-1], positions=n + np.arange(len(cont) - 1), past=kv)
            rows += list(lg)
        return np.asarray(rows, np.float32), dict(st, n_layer=cfg.n_layers)


# ---- one case ----------------------------------------------------------------------------

def lcp(a, b):
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def reuse_case(client, enc, rep, model, uid, rel, chunks, cont, rng):
    """Rows of one case (see the module's docstring)."""
    k = len(chunks)
    ct = [corpus.encode(c, bos=False) for c in chunks]
    cont = corpus.encode(cont, bos=False)
    order_a = list(range(k))
    rng.shuffle(order_a)
    order_b = list(range(k))
    while k > 1 and order_b == order_a:
        rng.shuffle(order_b)
    ha = corpus.encode(b"# retrieved from " + rel.encode() + b"\n")
    hb = corpus.encode(b"# file: " + rel.encode() + b"\n")

    def layout(h, order):
        toks, off = [h], {}
        at = len(h)
        for i in order:
            off[i] = at
            toks.append(ct[i])
            at += len(ct[i])
        return np.concatenate(toks).astype(np.int32), off

    A, off_a = layout(ha, order_a)
    B, off_b = layout(hb, order_b)
    rows, made = {}, []
    try:
        _, kv_a = enc.forward(A, np.arange(len(A)))
        ida = f"{uid}-a"
        client.put(ida, model, A, kv_a, mode="create")
        made.append(ida)
        # every chunk of B fetched from A's context, keys re-rotated to B's places
        pos, parts, runs = [], [], []
        for i in order_b:
            s, n = off_a[i], len(ct[i])
            got = client.get(ida, s, s + n, positions=off_b[i] + np.arange(n))
            kv_i, p_i = M.cache_of(got)
            parts.append(kv_i)
            pos.append(p_i)
            runs.append(off_b[i])
        pos = np.concatenate(pos)
        placed_kv = [(np.concatenate([p[li][0] for p in parts]), np.concatenate([p[li][1] for p in parts]))
                     for li in range(len(parts[0]))]
        ref, st = rep.run(B, cont)
        rows["full"] = (ref, st)
        for m in METHODS:
            if m in ("full", "prefix", "ape_parallel", "nochunks", "cover_epic16"):
                continue
            rows[m] = rep.run(B, cont, placed_kv, pos, runs, policy_of(m))
        # what kvrope serve does: the daemon finds the runs by content (its cover
        # verb), places them re-rotated, the engine repairs EPIC's 16 per run
        cov = client.cover(model, B, get=True)
        if cov.n_covered:
            kv_c, p_c = M.cache_of(cov.kv)
            rows["cover_epic16"] = rep.run(B, cont, kv_c, p_c, [r.prompt_off for r in cov.runs],
                                           "epic:16")
        else:
            rows["cover_epic16"] = rep.run(B, cont)
        # prefix caching: the longest common prefix with A, exact, at the same positions
        P = lcp(A, B)
        if P:
            got = client.get(ida, 0, P)
            kv_p, p_p = M.cache_of(got)
            rows["prefix"] = rep.run(B, cont, kv_p, p_p, None, "none")
        else:
            lg, st = rep.run(B, cont)
            rows["prefix"] = (lg, st)
        # no chunks: the header and the continuation
        rows["nochunks"] = rep.run(hb, cont)
        # APE parallel: the chunks as documents of B's header, in B's order
        pid, dids = M.put_documents(client, enc, model, f"{uid}-ape", hb, [ct[i] for i in order_b], made)
        asm = client.assemble(pid, dids, layout="parallel", temperature=1.0, scale=1.0,
                              fold_temperature=True)
        q = asm.query_pos + np.arange(len(cont))
        # row j predicts cont[j]: the header's last token is in the assembly, so
        # the first row is the assembly's prediction after it; scored on cont[1:]
        lg, _ = enc.forward(cont, q, M.cache_of(asm.kv))
        rows["ape_parallel"] = (np.concatenate([rows["full"][0][:1], lg[:-1]]),
                                {"prompt": len(B), "computed": 0, "probed": 0, "probe_layers": 0})
    finally:
        for d in made:
            client.delete(d)
    # scores on cont[1:] (row 0 of APE is the reference's, so every row skips it)
    full_lg = rows["full"][0]
    out = {"n_prompt": len(B), "n_cont": len(cont) - 1, "rows": {}}
    for m, (lg, st) in rows.items():
        s = M.scores(lg[1:], cont[1:], full_lg[1:])
        n_layer = st.get("n_layer", 4) or 4
        comp = st.get("computed", len(B)) if m not in ("full", "nochunks") else len(B)
        sel = st.get("probed", 0) * st.get("probe_layers", 0) / n_layer
        s.update(computed=comp, with_selection=comp + sel, prompt=len(B))
        out["rows"][m] = s
    return out


# ---- tables --------------------------------------------------------------------------------

def summarize(results):
    tot = {}
    for r in results:
        for m, s in r["rows"].items():
            a = tot.setdefault(m, {"n": 0, "bits": 0.0, "kl": 0.0, "agree": 0, "computed": 0.0,
                                   "with_selection": 0.0, "prompt": 0})
            for key in a:
                a[key] += s[key]
    full, none = tot["full"], tot["nochunks"]
    out = {}
    for m, a in tot.items():
        bpb = a["bits"] / a["n"]
        gain = (none["bits"] / none["n"] - bpb) / (none["bits"] / none["n"] - full["bits"] / full["n"])
        out[m] = {"bits_per_byte": bpb, "gain_kept": gain, "kl": a["kl"] / a["n"],
                  "agree": a["agree"] / a["n"], "computed": a["computed"] / a["prompt"],
                  "with_selection": a["with_selection"] / a["prompt"]}
    return out


def table(summary):
    lines = ["| method | share of the full encode's gain kept | mean KL from full (nats) | "
             "argmax agrees with full | prompt tokens computed | with the selection pass |",
             "| --- | --- | --- | --- | --- | --- |"]
    for m in METHODS:
        s = summary[m]
        comp = "(cached documents)" if m == "ape_parallel" else f"{100 * s['computed']:.1f}%"
        sel = "" if m == "ape_parallel" else f"{100 * s['with_selection']:.1f}%"
        lines.append(f"| {LABEL[m]} | {100 * s['gain_kept']:.1f}% | {s['kl']:.5f} | "
                     f"{100 * s['agree']:.1f}% | {comp} | {sel} |")
    return "\n".join(lines)


def plot(summary, path, engine):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: docs/eval/reuse.png kept as it is")
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    base = summary["none_repair"]
    curves = (("EPIC (first k of each run)", ["epic:4", "epic:16", "epic:32"], "o-", "computed"),
              ("CacheBlend (layer-1 deviation), with its selection pass",
               ["blend:0.05", "blend:0.15", "blend:0.3"], "s-", "with_selection"),
              ("CacheBlend, recomputed tokens only", ["blend:0.05", "blend:0.15", "blend:0.3"],
               "s--", "computed"))
    for ax, key, scale, ylabel in ((axes[0], "gain_kept", 100, "share of the full encode's gain kept (%)"),
                                   (axes[1], "kl", 1, "mean KL from the full encode (nats)")):
        for name, keys, mk, col in curves:
            xs = [100 * base["computed"]] + [100 * summary[k][col] for k in keys]
            ys = [scale * base[key]] + [scale * summary[k][key] for k in keys]
            ax.plot(xs, ys, mk, label=name)
        for m, mk in (("prefix", "rv"), ("none_repair", "gx"), ("cover_epic16", "mD")):
            ax.plot([100 * summary[m]["computed"]], [scale * summary[m][key]], mk, label=LABEL[m])
        if key == "gain_kept":
            ax.plot([100.0], [100.0], "k*", label=LABEL["full"])
        ax.axhline(scale * summary["ape_parallel"][key], color="grey", ls=":",
                   label="APE parallel (no tokens computed)")
        ax.set_xlabel("prompt tokens computed (% of a full encode)")
        ax.set_ylabel(ylabel)
        if key == "kl":
            ax.set_yscale("symlog", linthresh=1e-5)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, loc="lower right")
    fig.suptitle(f"Reuse anywhere: cached chunks placed by re-rotation, seams repaired ({engine})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_doc(text, engine):
    path = os.path.join(ROOT, "docs", "eval.md")
    with open(path) as f:
        doc = f.read()
    mb, me = MARK_BEGIN.format(engine), MARK_END.format(engine)
    block = mb + "\n" + text + "\n" + me
    if mb in doc and me in doc:
        a = doc.index(mb)
        b = doc.index(me) + len(me)
        doc = doc[:a] + block + doc[b:]
    else:
        doc = doc.rstrip("\n") + "\n\n" + block + "\n"
    with open(path, "w") as f:
        f.write(doc)


def main(argv):
    ap = argparse.ArgumentParser(description="reuse anywhere: placed chunks, seams repaired")
    ap.add_argument("--build", default=os.environ.get("KVR_BUILD", os.path.join(ROOT, "build")))
    ap.add_argument("--cases", type=int, default=16)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--chunk-bytes", type=int, default=96)
    ap.add_argument("--cont", type=int, default=96)
    ap.add_argument("--engine", default="llama", choices=["llama", "numpy"])
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--from-results", default=None,
                    help="rewrite the table and picture from a reuse-<engine>.json of an earlier run")
    a = ap.parse_args(argv)
    a.build = os.path.abspath(a.build)
    os.environ["KVR_BUILD"] = a.build
    if a.from_results:
        with open(a.from_results) as f:
            js = json.load(f)
        report(a, js["summary"], js["cases"], js["seconds"], js["n_prompt"],
               "llama.cpp" if a.engine == "llama" else "numpy")
        return
    import kvrope
    import run as R
    t0 = time.monotonic()
    rep = LlamaRepair(a.build) if a.engine == "llama" else NumpyRepair(a.build)
    enc = R.make_engine("llama" if a.engine == "llama" else "numpy", a.build, threads=1)
    cases = C.doc_cases(a.cases, seed=7, k=a.chunks, chunk=a.chunk_bytes, cont=a.cont)
    rng = random.Random(11)
    d = R.Daemon(a.build)
    results = []
    try:
        with kvrope.Client("unix:" + d.socket) as client:
            R.register(client, "code")
            for i, (hdr, chunks, cont) in enumerate(cases):
                rel = hdr.decode()[len("# file: "):].strip()
                results.append(reuse_case(client, enc, rep, "code", f"reuse{i}", rel, chunks, cont, rng))
                print(f"  reuse {i + 1}/{len(cases)}", file=sys.stderr, flush=True)
    finally:
        d.stop()
    summary = summarize(results)
    secs = time.monotonic() - t0
    n_prompt = sum(r["n_prompt"] for r in results) / len(results)
    os.makedirs(os.path.join(a.build, "eval"), exist_ok=True)
    with open(os.path.join(a.build, "eval", f"reuse-{a.engine}.json"), "w") as f:
        json.dump({"summary": summary, "cases": len(results), "seconds": secs,
                   "n_prompt": n_prompt}, f, indent=1)
    report(a, summary, len(results), secs, n_prompt, rep.name)


def findings(s):
    """What the table says, and why serve's default repair is what it is."""
    pct = lambda m, k: f"{100 * s[m][k]:.1f}%"  # noqa: E731
    kl = lambda m: f"{s[m]['kl']:.5f}"  # noqa: E731
    return (f"Placed without any repair, the chunks keep {pct('none_repair', 'gain_kept')} of the "
            f"gain at a KL of {kl('none_repair')} nats (APE's parallel layout: "
            f"{pct('ape_parallel', 'gain_kept')}, KL {kl('ape_parallel')}; plain prefix caching is "
            f"exact but computes {pct('prefix', 'computed')} of the prompt, since the chunks moved). "
            f"Repair lowers the KL further: EPIC's first 16 tokens of each run to {kl('epic:16')} "
            f"for {pct('epic:16', 'computed')} of the tokens, 32 to {kl('epic:32')} for "
            f"{pct('epic:32', 'computed')}; CacheBlend's deviation choice gets more per recomputed "
            f"token ({kl('blend:0.15')} for {pct('blend:0.15', 'computed')} at 15%), but its "
            f"selection pass costs {pct('blend:0.15', 'with_selection')} in all on this 4-layer "
            f"model. Through kvroped's cover verb (runs found by content, what kvrope serve "
            f"does), chunks that stand next to each other in both prompts come back as one run, "
            f"so EPIC 16 repairs fewer seams: {pct('cover_epic16', 'computed')} computed, KL "
            f"{kl('cover_epic16')}. The share of gain kept is within noise of 100% for every repaired row on this "
            f"small model (its chunks are short and attention is mostly local), so KL decides. "
            f"kvrope serve's default is `epic:16`: no selection pass, each run's first tokens "
            f"recomputed against what now precedes them, about {pct('epic:16', 'computed')} of a full encode here "
            f"(on longer chunks the 16 tokens per run are a smaller share); `--repair blend:0.15` "
            f"is the choice for deeper models, where the probe's 1.5 layers are a small part.")


def report(a, summary, n_cases, secs, n_prompt, engine):
    tab = table(summary)
    png = "reuse.png" if a.engine == "llama" else f"reuse-{a.engine}.png"
    print(tab)
    if a.no_write:
        return
    cmd = "make eval-reuse" if a.engine == "llama" else "/usr/bin/python3 eval/reuse.py --engine numpy"
    if n_cases != 16:
        cmd += f" --cases {n_cases}" if a.engine == "numpy" else f" (eval/reuse.py --cases {n_cases})"
    text = (f"### Reuse anywhere: cached chunks placed, seams repaired ({engine})\n\n"
            f"Generated by `{cmd}` (eval/reuse.py; {secs / 60:.0f} min on the shared 2-core machine, "
            f"niced). {n_cases} cases, each {a.chunks} consecutive {a.chunk_bytes}-byte chunks of a "
            f"held-out file: cached once in prompt A (\"# retrieved from FILE\" and the chunks in one "
            f"shuffled order), reused in prompt B (\"# file: FILE\" and the chunks in another order; "
            f"{n_prompt:.0f} tokens on average) by fetching each chunk from A's context with its keys "
            f"re-rotated by kvroped to its place in B; B's header is a gap. The {a.cont} bytes after "
            f"the chunks in the file are scored (every byte but the first). Share of gain = "
            f"(no chunks - row) / (no chunks - full) in bits. Tokens computed: prompt tokens "
            f"decoded through every layer, as a share of B; \"with the selection pass\" adds "
            f"CacheBlend's probe (every prompt token through layer 0 and layer 1's projections, "
            f"counted as 1.5 of the model's 4 layers: on a 4-layer model the probe costs more than "
            f"the tokens it saves; on a 24-layer model it is ~6%). APE's chunks were encoded once "
            f"after B's header (its documents cost nothing at request time) and laid out in "
            f"parallel; llama.cpp cannot apply APE's S, so T = S = 1."
            + ("" if a.engine == "llama" else
               " The numpy Llama (examples/llama.py's `repair`, the cross-check) takes CacheBlend's "
               "layer-1 K/V from a whole forward (the same numbers as llama.cpp's probe); the cost "
               "column counts what the probe costs.")
            + "\n\n" + tab + "\n\n" + findings(summary) +
            f"\n\n![share of gain kept and KL vs tokens computed](eval/{png})\n")
    write_doc(text, a.engine)
    os.makedirs(os.path.join(ROOT, "docs", "eval"), exist_ok=True)
    plot(summary, os.path.join(ROOT, "docs", "eval", png), engine)
    print("wrote docs/eval.md (reuse section), docs/eval/reuse.png", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
