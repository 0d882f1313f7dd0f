#!/usr/bin/python3
"""score.py — the committed model's bits per byte, left to right, through
llama.cpp (`kvrope-llama score` on the GGUF made from eval/model, so the
shipped float16 weights are what is scored), on two sets of code it was
never trained on:

  - the held-out 1-in-20 of the standard library (eval/corpus.py's split);
  - Python that is not the standard library: the files of Debian's
    python3-numpy (/usr/lib/python3/dist-packages/numpy, tests excluded)
    that the same path hash picks (corpus.is_held_out), 16 files. The
    training corpus is /usr/lib/python3.11 only, so none of it was seen.

Both are scored as eval/train.py scores its held-out stream: the files'
tokens (each after a BOS) concatenated, cut into windows of the model's
context (config.json max_position_embeddings) + 1 tokens, each window's
first token context only, BOS targets not counted. Writes
held_out_bpb and other_python into DIR/train.json (default eval/model).

    /usr/bin/python3 eval/score.py [--build build] [--model-dir eval/model] [--no-write]
"""
import argparse
import json
import math
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import corpus  # noqa: E402
import engines as E  # noqa: E402

OTHER_ROOT = "/usr/lib/python3/dist-packages/numpy"
OTHER_PACKAGE = "python3-numpy"
SEQ = 512          # windows when config.json has no max_position_embeddings


def other_files():
    fs = [f for f in corpus.files(OTHER_ROOT) if corpus.is_held_out(f)]
    if not fs:
        raise SystemExit(f"score: no files under {OTHER_ROOT} (is {OTHER_PACKAGE} installed?)")
    return fs


def stream(rels, root):
    return np.concatenate([corpus.encode(corpus.read(r, root)) for r in rels])


def stream_bpb(engine, ids, seq=SEQ):
    nll, n = 0.0, 0
    for a in range(0, len(ids) - 1, seq):
        w = ids[a:a + seq + 1]
        if len(w) < 2:
            break
        _, lg, _ = engine._run(np.asarray(w, np.int32), None, first=0)
        lp = E.log_softmax(lg)
        tgt = np.asarray(w[1:], np.int64)
        keep = tgt != corpus.BOS
        nll -= lp[np.arange(len(tgt)), tgt][keep].sum()
        n += int(keep.sum())
    return nll / n / math.log(2), n


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--build", default=os.path.join(os.path.dirname(HERE), "build"))
    p.add_argument("--model-dir", default=os.path.join(HERE, "model"))
    p.add_argument("--no-write", action="store_true")
    a = p.parse_args(argv)
    with open(os.path.join(a.model_dir, "config.json")) as f:
        cfg = json.load(f)
    eng = E.LlamaEngine(os.path.join(a.build, "eval", "kvrope-code.gguf"),
                        os.path.join(a.build, "kvrope-llama"), cfg)
    _, held = corpus.split()
    seq = int(cfg.get("max_position_embeddings", SEQ))
    bpb, n = stream_bpb(eng, stream(held, corpus.ROOT), seq)
    print(f"held-out standard library ({len(held)} files, {n} bytes, windows of {seq}): {bpb:.4f} bits/byte",
          flush=True)
    of = other_files()
    obpb, on = stream_bpb(eng, stream(of, OTHER_ROOT), seq)
    print(f"{OTHER_PACKAGE} ({len(of)} files, {on} bytes): {obpb:.4f} bits/byte", flush=True)
    if not a.no_write:
        path = os.path.join(a.model_dir, "train.json")
        with open(path) as f:
            meta = json.load(f)
        meta.update({"held_out_bpb": bpb, "held_out_bpb_engine": "llama.cpp f16",
                     "held_out_files": len(held), "held_out_tokens": int(n), "score_window": seq,
                     "other_python": {"package": OTHER_PACKAGE, "root": OTHER_ROOT, "files": of,
                                      "bytes": int(on), "bpb": obpb}})
        with open(path, "w") as f:
            json.dump(meta, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
