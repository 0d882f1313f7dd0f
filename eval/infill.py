#!/usr/bin/python3
"""infill.py — what an editor asks the code model: complete the line the
cursor is in, with the code after it known (fill-in-the-middle). Used by eval/run.py
(the infill table of docs/eval.md) and tests/python/test_infill.py.
Debian's /usr/bin/python3.

A case is a held-out file, a line of code in it and a cursor inside that
line; the rest of the line is the target. The request is llama.vim's: the
256 lines before the cursor's line (input_prefix, ending in a newline), the
line up to the cursor (prompt), and as input_suffix the line's (now empty)
rest, a newline and the 64 lines after it; input_extra holds 64-line chunks
of up to three other files of the same package (the editor's ring buffer;
top-level modules count as one package). llama-server started with -c 384
-b 192 -n 32 builds the prompt (eval/fim.py format_infill: prefix cut to its
last 144 tokens, suffix to 46 minus the prompt, extra context to its last
128 tokens), so a prompt stays within the 320-token rows the model was
fine-tuned on for FIM (eval/fim_probe.py --batch 768 measures the same
cases with ~180 bytes of suffix). The layout is the one the model was
trained on: suffix first (llama-server --spm-infill) when its config.json
says "fim_order": "spm", else PSM. Rows:

  left to right   <s> + the same prefix and prompt, no FIM tokens, no suffix
  FIM             /infill without input_extra
  FIM + extra     /infill with the chunks

Greedy generation stops at the first newline or special token (EOT ends a
FIM middle). Scores: exact match of the whole rest of the line (nothing
missing, nothing extra), and the share of its bytes right before the first
miss. Cases are seeded by the file's path: the same files give the same
cases on every machine.
"""
import os
import sys
import zlib

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import corpus  # noqa: E402
import fim  # noqa: E402

N_PREFIX_LINES, N_SUFFIX_LINES, CHUNK_LINES, N_CHUNKS = 256, 64, 64, 3   # llama.vim's sizes
SERVER = dict(n_ctx=384, n_batch=192, n_predict=32)
ROWS = [("ltr", "left to right (no suffix)"), ("fim", "FIM, no extra chunks"),
        ("fim_extra", "FIM with input_extra chunks (same package)")]
NEWLINE = int(corpus.encode(b"\n", bos=False)[0])


def cases(rels, per_file, root=corpus.ROOT):
    """per_file cursor cases in each of rels (seeded by the path)."""
    allf = corpus.files(root)
    out = []
    for rel in rels:
        lines = corpus.read(rel, root).split(b"\n")
        rng = np.random.Generator(np.random.PCG64(zlib.crc32(rel.encode())))
        ok = [i for i, ln in enumerate(lines)
              if len(ln.strip()) >= 8 and not ln.strip().startswith(b"#") and i >= 4]
        if not ok:
            continue
        peers = [f for f in allf if os.path.dirname(f) == os.path.dirname(rel) and f != rel]
        for i in rng.choice(ok, size=min(per_file, len(ok)), replace=False):
            ln = lines[i]
            ind = len(ln) - len(ln.lstrip())
            c = int(rng.integers(ind + 1, len(ln) - 1))   # inside the code: >= 1 byte each side
            chunks = []
            for f in (rng.choice(peers, size=min(N_CHUNKS, len(peers)), replace=False) if peers else []):
                fl = corpus.read(f, root).split(b"\n")
                a = int(rng.integers(0, max(1, len(fl) - CHUNK_LINES)))
                chunks.append((f, b"\n".join(fl[a:a + CHUNK_LINES]) + b"\n"))
            out.append({"file": rel, "line": int(i), "col": c,
                        "prefix": b"\n".join(lines[max(0, i - N_PREFIX_LINES):i]) + b"\n" if i else b"",
                        "prompt": ln[:c], "target": ln[c:],
                        "suffix": b"\n" + b"\n".join(lines[i + 1:i + 1 + N_SUFFIX_LINES]) + b"\n",
                        "chunks": chunks})
    return out


def spm_of(config):
    """Whether a model (its config.json) was trained on the suffix-first
    /infill layout (eval/export.py writes "fim_order")."""
    return config.get("fim_order", "psm") == "spm"


def prompt_tokens(case, row, spm=False):
    if row == "ltr":
        # the same prefix llama-server keeps (its last 3/4 of the batch) and the prompt
        p = fim.enc(case["prefix"])
        return [corpus.BOS] + p[max(0, len(p) - 3 * (SERVER["n_batch"] // 4)):] + fim.enc(case["prompt"])
    chunks = [(f, t) for f, t in case["chunks"]] if row == "fim_extra" else []
    return fim.format_infill(case["prefix"], case["suffix"], case["prompt"], chunks, spm=spm, **SERVER)


EOG = (2, fim.PAD, fim.REP, fim.SEP, fim.EOT)   # llama_vocab_is_eog here: </s> and four FIM tokens


def vim_pick(logits, top_k=40, top_p=0.99):
    """The token llama.vim's /infill sampler chain leaves on top, decoded
    greedily: top_k 40, top_p 0.99, then llama.cpp's infill sampler (end of
    generation when 3 p(eog) n > p(text) among the n candidates left, or when
    no text token has p >= 0.2 of them; byte tokens never prefix one another,
    so its merge step changes nothing here), then the likeliest that is left.
    The same chain as kvrope serve's (client/llama/worker_serve_sample.c)."""
    lg = np.asarray(logits, dtype=np.float64)
    idx = np.argsort(-lg, kind="stable")[:top_k]
    p = np.exp(lg[idx] - lg[idx[0]])
    p /= p.sum()
    keep = int(np.searchsorted(np.cumsum(p), top_p) + 1)   # top_p: smallest set reaching it
    idx, p = idx[:keep], p[:keep] / p[:keep].sum()
    eog = np.isin(idx, EOG)
    pe, pt = p[eog].sum(), p[~eog].sum()
    if 3 * pe * len(idx) > pt:
        return int(idx[eog][0])
    if not (p[~eog] >= 0.2).any():
        return fim.EOT
    return int(idx[0])


def completion_line(ids):
    """The generated ids up to the first newline or special token, as bytes;
    and whether the line was ended (not cut off by the token budget)."""
    out = []
    for t in ids:
        if t == NEWLINE or not corpus.is_byte_id(t):
            return corpus.decode(out), True
        out.append(t)
    return corpus.decode(out), False


def line_score(target, got, ended):
    """How a completed line (bytes) meets the target: exact (it ended and
    equals it) and right_before_miss (the share of the target's bytes it got
    right before the first wrong one). eval/infill_serve.py scores with it too."""
    k = 0
    while k < min(len(got), len(target)) and got[k] == target[k]:
        k += 1
    return {"exact": bool(ended and got == target), "right_before_miss": k / len(target)}


def score(case, ids):
    got, ended = completion_line(ids)
    return line_score(case["target"], got, ended) | {"got": got, "ended": ended}


def run(engine, cases_, rows=tuple(r for r, _ in ROWS), log=None):
    """{row: {"exact": rate, "right_before_miss": mean share, "n": cases, "per_case": [...]}}"""
    res = {}
    spm = spm_of(engine.config)
    for row in rows:
        per = []
        for i, c in enumerate(cases_):
            ids = engine.complete(prompt_tokens(c, row, spm), len(c["target"]) + 1, stop=NEWLINE)
            per.append(score(c, ids))
            if log and i % 20 == 19:
                log(f"  infill {row} {i + 1}/{len(cases_)}")
        res[row] = {"exact": float(np.mean([p["exact"] for p in per])),
                    "right_before_miss": float(np.mean([p["right_before_miss"] for p in per])),
                    "n": len(per), "per_case": per}
    return res
