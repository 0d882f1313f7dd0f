#!/usr/bin/python3
"""A real edit history of one file of this repository, as an editor makes it.

    /usr/bin/python3 scripts/edit-history.py [--repo DIR] [--path cache/get.c]
        [--until 83afdf0] [--max 51] OUTDIR

Walks the file's versions in git (oldest first, up to and including the
commit --until, so the history is fixed whatever is committed later) and
splits each commit's change into its hunks: every hunk applied on its own is
one edit, the way a person saves after each change. Writes OUTDIR/v0000.txt,
v0001.txt, ... (at most --max versions: --max 51 is 50 consecutive edits) and
OUTDIR/manifest.json (path, commits, and per version the commit and hunk it
came from). --window BYTES keeps the first BYTES of every version (cut at a
line end) and drops versions whose window is unchanged: a history that fits a
model's context, still made of real edits. Exit 0, or 1 with a message (not a git checkout, unknown path or
commit).

Used by the session tests (tests/llama/test_llama_session.c), the editor
benchmark (tests/llama/bench_session.c) and the drift evaluation
(eval/drift.py). Python: Debian's /usr/bin/python3 (standard library only).
"""
import argparse
import difflib
import json
import os
import subprocess
import sys


def git(repo, *args):
    return subprocess.run(["git", "-C", repo, *args], check=True, capture_output=True).stdout


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", default=os.path.join(os.path.dirname(__file__), ".."),
                    help="the git checkout (default: this repository)")
    ap.add_argument("--path", default="cache/get.c", help="file inside the repository")
    ap.add_argument("--until", default="83afdf0",
                    help="last commit of the history (default: a fixed one)")
    ap.add_argument("--max", type=int, default=51, help="versions to write at most")
    ap.add_argument("--window", type=int, default=0,
                    help="keep each version's first BYTES only (cut at a line end) and "
                         "drop versions whose window did not change (0: whole files)")
    ap.add_argument("outdir", help="where v0000.txt... and manifest.json go")
    a = ap.parse_args()
    try:
        revs = git(a.repo, "rev-list", "--reverse", a.until, "--", a.path).decode().split()
    except (subprocess.CalledProcessError, FileNotFoundError) as e:
        err = getattr(e, "stderr", b"") or b""
        print(f"edit-history: git rev-list {a.until} -- {a.path} in {a.repo}: "
              f"{err.decode().strip() or e}", file=sys.stderr)
        return 1
    if not revs:
        print(f"edit-history: {a.path} has no versions up to {a.until}", file=sys.stderr)
        return 1
    os.makedirs(a.outdir, exist_ok=True)
    versions, meta = [], []
    prev = None
    for rev in revs:
        try:
            cur = git(a.repo, "show", f"{rev}:{a.path}").decode("utf-8", "replace")
        except subprocess.CalledProcessError:
            continue                            # deleted in this commit
        cur = cur.splitlines(keepends=True)
        if prev is None:
            versions.append(cur)
            meta.append({"commit": rev, "hunk": 0})
        else:
            # Apply the hunks one at a time, last first, so that earlier
            # hunks' line numbers stay valid; each intermediate is a version.
            ops = [o for o in difflib.SequenceMatcher(None, prev, cur, autojunk=False)
                   .get_opcodes() if o[0] != "equal"]
            work = list(prev)
            for k, (_, i1, i2, j1, j2) in enumerate(reversed(ops)):
                work[i1:i2] = cur[j1:j2]
                versions.append(list(work))
                meta.append({"commit": rev, "hunk": k + 1, "of": len(ops)})
        prev = cur
        if not a.window and len(versions) >= a.max:
            break
    if a.window:
        cut, kept = [], []
        for v, m in zip(versions, meta):
            t = "".join(v)[:a.window]
            if len(t) == a.window and "\n" in t:
                t = t[:t.rindex("\n") + 1]
            if not cut or t != cut[-1]:
                cut.append(t)
                kept.append(m)
        versions, meta = [[t] for t in cut], kept
    versions, meta = versions[:a.max], meta[:a.max]
    for i, v in enumerate(versions):
        with open(os.path.join(a.outdir, f"v{i:04d}.txt"), "w") as f:
            f.write("".join(v))
    with open(os.path.join(a.outdir, "manifest.json"), "w") as f:
        json.dump({"path": a.path, "until": a.until, "window": a.window, "versions": meta}, f,
                  indent=1)
    print(f"edit-history: {len(versions)} versions of {a.path} in {a.outdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
