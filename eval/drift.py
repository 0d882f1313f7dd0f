#!/usr/bin/python3
"""Drift of the editor's loop: how far a file's cache moves from a full
re-encode over many consecutive edits, under three refresh policies.

    KVR_BUILD=$PWD/build /usr/bin/python3 eval/drift.py [--out docs/eval]
        [--model build/eval/kvrope-code.gguf] [--edits 100]

Real edit histories of this repository (scripts/edit-history.py: a file's git
versions split hunk by hunk, each version's first 2 KB so that it fits the
trained model's context): daemon/dispatch.c (100 edits), Makefile and
cache/put.c (as many as they have). Each is replayed by `kvrope-llama replay`
through the session engine with a kvroped this script starts, once per
policy:
  none        no refresh at all: every moved token stays approximate
              (--refresh 0 --max-age 255);
  default     the CLI's and the server's default: 8 tokens after each edit
              point, and any token approximate for more than 16 edits;
  background  the default, then everything approximate re-encoded after
              each edit (what kvrope serve does when idle).
After every edit the next-token distribution of the cached path is compared
with a full re-encode of the same version: KL(full || cached) in nats.
Writes OUTDIR/drift.json, OUTDIR/drift.png (KL against edit number, one
curve per policy, log scale) and prints a Markdown table for docs/eval.md:
mean KL over the histories after 1, 5, 20 and 100 consecutive edits, with
the tokens each policy computed as a share of a full re-encode.
Python: Debian's /usr/bin/python3 (numpy; matplotlib for the picture).
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from run import Daemon  # noqa: E402

HISTORIES = [("daemon/dispatch.c", 101), ("Makefile", 101), ("cache/put.c", 101)]
POLICIES = [
    ("none", ["--refresh", "0", "--max-age", "255"]),
    ("default", ["--refresh", "8", "--max-age", "16"]),
    ("background", ["--refresh", "8", "--max-age", "16", "--background"]),
]
RANGES = [(1, 1), (2, 5), (6, 20), (21, 50), (51, 100)]


def replay(build, model, sock, hist, policy_args, tmp):
    lines = os.path.join(tmp, "lines.json")
    cmd = [os.path.join(build, "kvrope-llama"), "--model", model, "--socket", sock,
           "--threads", "2", "--json", "replay", "--history", hist, "--session", "drift",
           "--check", "--lines", lines, *policy_args]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"drift: {' '.join(cmd)} failed: {r.stderr or r.stdout}")
    rows = [json.loads(x) for x in open(lines)]
    return json.loads(r.stdout), rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default=os.environ.get("KVR_BUILD", os.path.join(ROOT, "build")))
    ap.add_argument("--model", default=None, help="GGUF (default: the trained eval model)")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "eval"))
    ap.add_argument("--window", type=int, default=2048)
    ap.add_argument("--from-json", default=None,
                    help="render the table and picture from a drift.json already measured")
    a = ap.parse_args()
    if a.from_json:
        with open(a.from_json) as f:
            results = json.load(f)["results"]
        return report(results, a.out)
    model = a.model or os.path.join(a.build, "eval", "kvrope-code.gguf")
    if not a.out:
        a.out = os.path.join(ROOT, "docs", "eval")
    if not os.path.exists(model):
        raise SystemExit(f"drift: {model} is not built (make)")
    tmp = tempfile.mkdtemp(prefix="kvr-drift-")
    d = Daemon(a.build)
    results = {}
    try:
        for path, n in HISTORIES:
            hist = os.path.join(tmp, path.replace("/", "_"))
            subprocess.run(["/usr/bin/python3", os.path.join(ROOT, "scripts", "edit-history.py"),
                            "--repo", ROOT, "--path", path, "--window", str(a.window),
                            "--max", str(n), hist], check=True, capture_output=True)
            for name, args in POLICIES:
                rep, rows = replay(a.build, model, d.socket, hist, args, tmp)
                results.setdefault(path, {})[name] = {
                    "failures": rep.get("failures"),
                    "computed_share": rep.get("computed_share"),
                    "edits": [{k: r.get(k) for k in ("version", "tokens", "computed",
                                                      "background_refreshed", "kl",
                                                      "logit_rms_err", "agrees", "error")}
                              for r in rows if r["version"] > 0],
                }
                print(f"{path:20s} {name:10s} edits {rep.get('edits'):4.0f} failures "
                      f"{rep.get('failures'):.0f} computed {100 * rep['computed_share']:.1f}% "
                      f"mean KL {rep.get('mean_kl', float('nan')):.5f}", flush=True)
    finally:
        d.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "drift.json"), "w") as f:
        json.dump({"window": a.window, "model": os.path.basename(model), "results": results},
                  f, indent=1)

    return report(results, a.out)


def report(results, out):
    # The table: mean KL over ranges of consecutive edits (one edit's KL
    # swings with where it lands; a range over every history is the signal),
    # and the tokens computed (background: its refreshes included).
    def kl_range(name, lo, hi):
        v = [e["kl"] for p in results.values() for e in p[name]["edits"]
             if lo <= e["version"] <= hi and e.get("kl") is not None]
        return (sum(v) / len(v), len(v)) if v else (None, 0)

    def share(name):
        c = [e["computed"] + (e["background_refreshed"] or 0)
             for p in results.values() for e in p[name]["edits"] if e.get("computed") is not None]
        t = [e["tokens"] for p in results.values() for e in p[name]["edits"]
             if e.get("computed") is not None]
        return sum(c) / sum(t) if t else float("nan")

    hdr = " | ".join(f"edits {lo}-{hi}" if lo != hi else f"edit {lo}" for lo, hi in RANGES)
    print(f"\n| policy | {hdr} | tokens computed (share of re-encodes) |")
    print("| --- |" + " --- |" * len(RANGES) + " --- |")
    for name, _ in POLICIES:
        cells = []
        for lo, hi in RANGES:
            m, cnt = kl_range(name, lo, hi)
            cells.append("n/a" if m is None else f"{m:.5f} ({cnt})")
        print(f"| {name} | " + " | ".join(cells) + f" | {100 * share(name):.1f}% |")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("drift: matplotlib missing (make eval installs it): no picture")
        return 0
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, _ in POLICIES:
        e = results["daemon/dispatch.c"][name]["edits"]
        xs = [r["version"] for r in e if r.get("kl") is not None]
        ys = [max(r["kl"], 1e-7) for r in e if r.get("kl") is not None]
        ax.plot(xs, ys, label=name)
    ax.set_yscale("log")
    ax.set_xlabel("consecutive edits of daemon/dispatch.c (real history)")
    ax.set_ylabel("KL(full re-encode || cached), nats")
    ax.set_title("Drift of the editor's loop by refresh policy")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "drift.png"), dpi=110)
    print(f"wrote {os.path.join(out, 'drift.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
