#!/usr/bin/python3
"""fim_probe.py — does a trained model fill in the middle, and if not, why.
Debian's /usr/bin/python3 (torch from apt).

    /usr/bin/python3 eval/fim_probe.py [MODEL_DIR | TRAIN_DIR] [--rows N]

MODEL_DIR is an exported model (eval/model: weights.npz, config.json);
TRAIN_DIR a training run's --out (its train.pt checkpoint, shape from
eval/model/config.json). On N training-distribution FIM rows (the
/infill layout of eval/fim.py, seeded, no repo-level context) it prints:

  1. the bits of the first middle token (the one after FIM_MID) by the
     length of the suffix between FIM_SUF and FIM_MID, beside the bits of
     the same bytes scored left to right (the prefix, then the middle: no
     FIM tokens, no suffix) and of the rest of the middle. A model that
     reads the prefix's end from FIM_MID does at least as well as left to
     right at every suffix length;
  2. where FIM_MID's attention goes, per layer and head: itself, FIM_SUF,
     the prefix's last three tokens, the suffix, the rest of the prefix.
     Infilling needs some head to reach the prefix's end (directly, or via
     FIM_SUF after FIM_SUF has gathered it).

With --cases N (a model directory with weights.npz: eval/model, or a
finished run's --out), it also scores eval/infill.py's middle-line cases
on the held-out files (N cursors per file, first --files files) through
the numpy Llama, for the layouts left to right, PSM /infill and SPM
/infill (llama-server --spm-infill), and SPM's two differences from left
to right taken one at a time (left to right with a FIM_MID after the
cursor; SPM with an empty suffix): bits of the first byte of the rest of
the line, mean bits of the rest of the line (+ its end), greedy exact
match, the bits of its first four bytes and of its end one by one.

Nothing is asserted: this is the measurement behind docs/eval.md's
paragraph on why the committed model does not infill yet.
"""
import argparse
import json
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import corpus  # noqa: E402
import fim  # noqa: E402
import train  # noqa: E402

REGIONS = ("self", "FIM_SUF", "prefix last 3", "suffix", "prefix rest")


def load(d):
    cfg_dir = d if os.path.exists(os.path.join(d, "config.json")) else os.path.join(HERE, "model")
    with open(os.path.join(cfg_dir, "config.json")) as f:
        cfg = json.load(f)
    m = train.Model(cfg, cfg["max_position_embeddings"])
    ck = os.path.join(d, "train.pt")
    if os.path.exists(ck):
        m.load_state_dict(torch.load(ck)["model"])
    else:
        train.load_init(m, d)
    return m.eval(), cfg


def bucket(n):
    return "0" if n == 0 else "1-8" if n <= 8 else "9-32" if n <= 32 else ">32"


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default=os.path.join(HERE, "model"))
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cases", type=int, default=0, help="middle-line cursors a held-out file (0: skip)")
    ap.add_argument("--files", type=int, default=12, help="held-out files for --cases")
    ap.add_argument("--batch", type=int, default=0,
                    help="the server's -b for --cases (its -c is then -b + 256; default eval/infill.py's "
                         "-c 384 -b 192): 768 keeps ~180 bytes of suffix")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    m, cfg = load(a.model)
    tr, _ = corpus.split()
    data, starts = train.stream(tr)
    rows = train.Batches(tr, data, starts, 7, 1.0, 0.0).rows(30000, a.rows, 512)[:, :-1]
    mids = [r.tolist().index(fim.MID) for r in rows]
    sufs = [r.tolist().index(fim.SUF) for r in rows]
    attn = []
    with torch.no_grad():
        lp = F.log_softmax(m(rows, probe=lambda w: attn.append(
            torch.stack([w[i, :, j, :] for i, j in enumerate(mids)]).numpy())).float(), -1)
    first, rest, ltr = {}, [], []
    for i, r in enumerate(rows.tolist()):
        j, s = mids[i], sufs[i]
        k = r.index(fim.EOT) if fim.EOT in r else len(r) - 1
        bits = [-lp[i, p, r[p + 1]].item() / np.log(2) for p in range(j, k)]
        first.setdefault(bucket(j - s - 1), []).append(bits[0])
        rest += bits[1:]
        # the same byte left to right: the prefix without FIM_PRE, then the middle
        ltr_in = torch.tensor([[t for t in r[:s] if t != fim.PRE]])
        with torch.no_grad():
            ltr.append(-F.log_softmax(m(ltr_in)[0, -1].float(), -1)[r[j + 1]].item() / np.log(2))
    print(f"{a.model}: {a.rows} FIM rows")
    print("first middle token, bits by suffix length (tokens):")
    for b in ("0", "1-8", "9-32", ">32"):
        if b in first:
            print(f"  {b:>5}: {np.mean(first[b]):.2f} bits ({len(first[b])} rows)")
    print(f"the same first bytes left to right (prefix, then the middle): {np.mean(ltr):.2f} bits")
    print(f"rest of the middle: {np.mean(rest):.2f} bits")
    print("FIM_MID's attention mass (mean over rows), per layer and head: " + " | ".join(REGIONS))
    for li, w in enumerate(attn):
        for h in range(w.shape[1]):
            acc = np.zeros(len(REGIONS))
            for i in range(w.shape[0]):
                j, s, x = mids[i], sufs[i], w[i, h]
                acc += [x[j], x[s], x[max(0, s - 3):s].sum(), x[s + 1:j].sum(), x[:max(0, s - 3)].sum()]
            print(f"  layer {li} head {h}: " + " ".join(f"{v:.2f}" for v in acc / w.shape[0]))
    if a.cases:
        held_out_cases(a)
    return 0


def held_out_cases(a):
    import engines
    import infill
    eng = engines.NumpyEngine(a.model)
    _, ho = corpus.split()
    cs = infill.cases(ho[:a.files], a.cases)
    if a.batch:
        infill.SERVER.update(n_batch=a.batch, n_ctx=a.batch + 256)
    srv = infill.SERVER
    lays = {"left to right": lambda c: infill.prompt_tokens(c, "ltr"),
            "FIM, PSM": lambda c: fim.format_infill(c["prefix"], c["suffix"], c["prompt"], [], **srv),
            "FIM, SPM": lambda c: fim.format_infill(c["prefix"], c["suffix"], c["prompt"], [], spm=True, **srv),
            # the two halves of SPM's difference from left to right: the
            # FIM_MID between the cursor and the middle, and the suffix
            "ltr + FIM_MID": lambda c: infill.prompt_tokens(c, "ltr") + [fim.MID],
            "SPM, no suffix": lambda c: fim.format_infill(c["prefix"], b"", c["prompt"], [], spm=True, **srv)}
    print(f"held-out middle-line cases: {len(cs)} ({a.cases} a file, {a.files} files), "
          f"-c {srv['n_ctx']} -b {srv['n_batch']}")
    for name, build in lays.items():
        first, mean, exact, vim, by_pos, end = [], [], 0, 0, {}, []
        ltr = name in ("left to right", "ltr + FIM_MID")   # ends with a newline, not EOT
        for c in cs:
            p = build(c)
            tgt = fim.enc(c["target"]) + ([infill.NEWLINE] if ltr else [fim.EOT])
            toks = p + tgt
            logits, _ = eng.forward(toks, np.arange(len(toks)))
            lp = engines.log_softmax(logits[len(p) - 1:len(toks) - 1])
            bits = -np.array([lp[i, t] for i, t in enumerate(tgt)]) / np.log(2)
            first.append(bits[0])
            mean.append(bits.mean())
            for i, b in enumerate(bits[:-1][:4]):
                by_pos.setdefault(i, []).append(b)
            end.append(bits[-1])
            exact += infill.score(c, eng.complete(p, len(c["target"]) + 1, stop=infill.NEWLINE))["exact"]
            if not ltr:   # as llama.vim asks: its sampler chain (infill.vim_pick)
                vim += infill.score(c, eng.complete(p, len(c["target"]) + 1, stop=infill.NEWLINE,
                                                    pick=infill.vim_pick))["exact"]
        print(f"  {name:14s} first byte {np.mean(first):.2f} bits, line {np.mean(mean):.2f} bits/token, "
              f"exact {exact}/{len(cs)}"
              + (f" (llama.vim's sampler chain {vim}/{len(cs)})" if not ltr else "")
              + "; bytes 1-4: "
              + " ".join(f"{np.mean(by_pos[i]):.2f}" for i in sorted(by_pos))
              + f", the line's end (newline / EOT) {np.mean(end):.2f}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
