#!/usr/bin/python3
"""export.py — turns a training run's output (eval/train.py --out DIR) into
the committed model, eval/model/: config.json, weights.npz (float16, HF
names: the numpy Llama's format, examples/llama.py load_model) and
train.json (how it was trained, its held-out bits per byte; with
--no-final-eval eval/score.py fills those in afterwards from the GGUF; a
run that started from another model (--init) keeps that model's summary
as init_model). The GGUF that
llama.cpp runs is made from these by `scripts/gen-gguf.py --hf eval/model
--dtype f16` (make does it), so both engines run the same float16 weights.

    /usr/bin/python3 eval/export.py SRC_DIR [DST_DIR]
"""
import json
import os
import sys

import numpy as np


def main(argv):
    if not 1 <= len(argv) <= 2:
        print(__doc__, file=sys.stderr)
        return 2
    src = argv[0]
    dst = argv[1] if len(argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "model")
    os.makedirs(dst, exist_ok=True)
    with np.load(os.path.join(src, "weights.npz")) as z:
        w = {k: z[k].astype(np.float16) for k in z.files}
    bad = [k for k, x in w.items() if not np.isfinite(x).all()]
    if bad:
        raise SystemExit(f"export: {bad[0]} has values that do not fit float16")
    np.savez_compressed(os.path.join(dst, "weights.npz"), **w)
    with open(os.path.join(src, "train.json")) as f:
        meta = json.load(f)
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    # which /infill layout the FIM rows were written in: scripts/gen-gguf.py
    # turns "spm" into the GGUF key kvrope serve reads (kvrope.infill.spm)
    cfg["fim_order"] = "spm" if meta.get("spm") else "psm"
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    meta["weights_dtype"] = "f16"
    init = meta.get("init")
    if init and os.path.exists(os.path.join(init, "train.json")):
        # the run started from another trained model: keep how that one was trained
        with open(os.path.join(init, "train.json")) as f:
            p = json.load(f)
        meta["init_model"] = {k: p[k] for k in ("held_out_bpb", "steps", "batch", "seq", "lr", "seed",
                                                "tokens_seen", "train_seconds", "params") if k in p}
    with open(os.path.join(dst, "train.json"), "w") as f:
        json.dump(meta, f, indent=1)
    bpb = meta.get("held_out_bpb")
    print(f"export: {dst}: {sum(x.size for x in w.values())} parameters, held-out "
          + (f"{bpb:.3f} bits per byte" if bpb is not None else "not scored yet (eval/score.py)"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
