#!/usr/bin/python3
"""cases.py — the eval's test cases, all from held-out code (eval/corpus.py)
or from this repository's own git history; seeded, so the same corpus gives
the same cases. Debian's /usr/bin/python3.

  synthetic_edits(n, seed, kinds)  PIE-paper style edits on held-out files:
      insert (1-3 lines copied from elsewhere in the file), delete (1-3
      lines), multi (an insertion, a deletion and a replaced line at three
      places at once). -> [(kind, name, old_bytes, new_bytes)]
  git_edits(n, repo)               real edits: for each commit that changed a
      .py file, the first changed region with its surroundings, old and new.
  doc_cases(n, seed)               (prefix, [chunks], continuation) as bytes:
      k consecutive chunks of a held-out file and the code that follows them.
  quant_files(n) / long_files(n)   (name, bytes) windows of held-out files.

Windows are at most WINDOW bytes (the model was trained on 512 tokens).
"""
import difflib
import os
import random
import subprocess

import corpus

WINDOW = 440


def _lines(b):
    return b.splitlines(keepends=True)


def _held_out():
    return [(r, corpus.read(r)) for r in corpus.split()[1]]


def _window_lines(data, rng, budget=WINDOW):
    """A run of whole lines of at most `budget` bytes starting at a random
    line, or None."""
    ls = _lines(data)
    if sum(len(x) for x in ls) < budget // 2 or len(ls) < 12:
        return None
    for _ in range(20):
        s = rng.randrange(0, max(1, len(ls) - 10))
        out, n = [], 0
        for x in ls[s:]:
            if n + len(x) > budget:
                break
            out.append(x)
            n += len(x)
        if len(out) >= 10 and sum(1 for x in out if x.strip()) >= 6:
            return ls, s, out
    return None


def _pick_lines(ls, rng, avoid, k):
    """k consecutive non-blank lines of ls not overlapping the index range avoid."""
    for _ in range(50):
        i = rng.randrange(0, max(1, len(ls) - k))
        if avoid[0] <= i < avoid[1] or avoid[0] <= i + k - 1 < avoid[1]:
            continue
        cand = ls[i:i + k]
        if all(x.strip() for x in cand) and all(len(x) < 100 for x in cand):
            return cand
    return None


def synthetic_edits(n_per_kind, seed=1, kinds=("insert", "delete", "multi"), files=None):
    rng = random.Random(seed)
    files = files if files is not None else _held_out()
    out = {k: [] for k in kinds}
    order = list(range(len(files)))
    rng.shuffle(order)
    rounds = 0
    while any(len(v) < n_per_kind for v in out.values()) and rounds < 6:
        rounds += 1
        for fi in order:
            rel, data = files[fi]
            for kind in kinds:
                if len(out[kind]) >= n_per_kind:
                    continue
                w = _window_lines(data, rng, WINDOW - 120)
                if w is None:
                    continue
                ls, s, win = w
                nl = len(win)
                new = list(win)
                ok = True
                if kind == "insert":
                    at = rng.randrange(nl // 4, max(nl // 4 + 1, nl * 11 // 20))
                    ins = _pick_lines(ls, rng, (s, s + nl), rng.randint(1, 3))
                    ok = ins is not None
                    if ok:
                        new[at:at] = ins
                elif kind == "delete":
                    at = rng.randrange(nl // 4, max(nl // 4 + 1, nl * 11 // 20))
                    k = rng.randint(1, 3)
                    ok = at + k < nl - 3 and all(x.strip() for x in new[at:at + k])
                    if ok:
                        del new[at:at + k]
                else:   # multi: replace one line, delete one, insert one, at three places
                    a, b, c = sorted(rng.sample(range(nl // 6, max(nl // 6 + 3, nl * 3 // 4)), 3))
                    ins = _pick_lines(ls, rng, (s, s + nl), 1)
                    rep = _pick_lines(ls, rng, (s, s + nl), 1)
                    ok = ins is not None and rep is not None and c - a >= 3 and \
                        win[b].strip() != "" and win[a] != rep[0]
                    if ok:
                        new = win[:a] + rep + win[a + 1:b] + win[b + 1:c] + ins + win[c:]
                old_b, new_b = b"".join(win), b"".join(new)
                if not ok or old_b == new_b or len(new_b) > WINDOW + 60:
                    continue
                out[kind].append((kind, f"{rel}:{s + 1}", old_b, new_b))
    return [c for k in kinds for c in out[k]]


def _git(repo, *args):
    r = subprocess.run(["git", "-C", repo, *args], capture_output=True, timeout=60)
    return r.stdout if r.returncode == 0 else None


def git_edits(n, repo, budget=WINDOW, per_file=2):
    """Real edits replayed from the repository's history of its Python files
    (oldest first). Each case: one changed region of one file in one commit
    (up to `per_file` regions per file and commit), with up to 8 unchanged
    lines before it and unchanged lines after it up to `budget` bytes, the
    window holding that one change only."""
    log = _git(repo, "log", "--reverse", "--format=%H", "--", "*.py")
    if not log:
        return []
    out = []
    for c in log.decode().split():
        names = _git(repo, "diff", "--name-only", "--diff-filter=M", c + "^", c, "--", "*.py")
        if not names:
            continue
        for f in names.decode().split():
            old, new = _git(repo, "show", f"{c}^:{f}"), _git(repo, "show", f"{c}:{f}")
            if old is None or new is None:
                continue
            for k, case in enumerate(_real_windows(old, new, budget)[:per_file]):
                out.append(("real", f"{f}@{c[:8]}#{k}", case[0], case[1]))
                if len(out) >= n:
                    return out
    return out


def _real_windows(old, new, budget):
    lo, ln = _lines(old), _lines(new)
    ops = difflib.SequenceMatcher(None, lo, ln, autojunk=False).get_opcodes()
    ch = [o for o in ops if o[0] != "equal"]
    out = []
    for q, (tag, i1, i2, j1, j2) in enumerate(ch):
        changed = sum(len(x) for x in lo[i1:i2]) + sum(len(x) for x in ln[j1:j2])
        if changed > 300 or changed == 0:
            continue
        prev = ch[q - 1][2] if q > 0 else 0            # old lines before i1 back to prev are unchanged
        s = max(prev, i1 - 8)
        if i1 - s < 2:
            continue
        nxt = ch[q + 1][1] if q + 1 < len(ch) else len(lo)   # stop before the next change
        size = sum(len(x) for x in lo[s:i2])
        e = i2
        while e < min(nxt, len(lo)) and size + len(lo[e]) <= budget:
            size += len(lo[e])
            e += 1
        if e - i2 < 4 or sum(len(x) for x in lo[i2:e]) < 96:
            continue
        d = j1 - i1                                     # old line x before the change is new line x + d
        ob = b"".join(lo[s:e])
        nb = b"".join(ln[s + d:j2]) + b"".join(lo[i2:e])
        if ob != nb and len(nb) <= budget + 200 and len(ob) <= budget + 200:
            out.append((ob, nb))
    return out


def doc_cases(n, seed=2, k=3, chunk=96, cont=128, files=None, skip=0):
    """(prefix, chunks, continuation): the prefix is a header naming the file
    (as a RAG pipeline would label a source); the chunks are k consecutive
    pieces of `chunk` bytes and the continuation the `cont` bytes after them,
    so the continuation depends on the chunks (names, indentation, style)."""
    rng = random.Random(seed)
    files = files if files is not None else _held_out()
    need = k * chunk + cont
    cands = [(r, d) for r, d in files if len(d) >= need + 64]
    out = []
    rounds = 0
    while len(out) < n + skip and cands and rounds < 8:
        rounds += 1
        for rel, data in cands:
            starts = [i + 1 for i in range(len(data) - need - 1) if data[i] == 0x0a]
            if not starts:
                continue
            s = rng.choice(starts)
            body = data[s:s + need]
            chunks = [body[i * chunk:(i + 1) * chunk] for i in range(k)]
            out.append((b"# file: " + rel.encode() + b"\n", chunks, body[k * chunk:]))
            if len(out) >= n + skip:
                break
    return out[skip:skip + n]


def quant_files(n, size=512, files=None):
    files = files if files is not None else _held_out()
    return [(r, d[:size]) for r, d in files if len(d) >= size][:n]


def long_files(n, size=1024, files=None):
    files = files if files is not None else _held_out()
    return [(r, d[:size]) for r, d in sorted(files, key=lambda x: -len(x[1])) if len(d) >= size][:n]


if __name__ == "__main__":
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    se = synthetic_edits(3)
    for kind, name, a, b in se:
        print(kind, name, len(a), len(b))
    for kind, name, a, b in git_edits(5, root):
        print(kind, name, len(a), len(b))
    print(len(doc_cases(4)), "doc cases")
