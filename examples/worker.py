#!/usr/bin/python3
"""Use case 1: an inference worker that reuses cached prefixes from kvroped.

    make run                                   # in one terminal: the daemon
    /usr/bin/python3 examples/worker.py        # in another (--socket PATH to choose)

For each prompt the worker does what vLLM / SGLang prefix caching does:
  1. asks the daemon for the longest cached exact prefix of the prompt's
     token ids (match, with get=True so the KV comes back in the same reply);
  2. loads that KV as the model's `past` and runs the model on the rest only;
  3. stores the prompt's KV for the next worker: a prompt that extends a
     cached context is stored as a copy-on-write fork of it (keep the shared
     part, append the new tokens), so the shared prefix is held once;
  4. runs the model once more WITHOUT the cache and compares the logits.

Why the logits are identical: the model (examples/llama.py) keeps its cache
in float32 and the daemon stores this model's KV in float32 (registered with
dtype f32), so the K/V that come back are bit for bit the ones computed;
llama.py does its arithmetic in float64 from those float32 values, so the
cached run and the full run compute the same numbers, except that a matrix
product over a different number of rows may sum in a different order. That
can move a float32 logit by about one rounding step (~1e-7 relative), never
more; the worker allows 1e-5 * max|logit| and exits 1 beyond that.
"""

import argparse
import hashlib
import os
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "client", "python"))

import kvrope  # noqa: E402
import llama as L  # noqa: E402
import common as C  # noqa: E402

SYSTEM = "You are kvrope's tiny test assistant. Answer in one short line.\n"
PROMPTS = [
    SYSTEM + "Q: What does a KV cache store?\nA:",
    SYSTEM + "Q: Why rotate keys by position?\nA:",
    SYSTEM + "Q: What does a KV cache store?\nA: keys and values.\nQ: Of what?\nA:",
    SYSTEM + "Q: Why rotate keys by position?\nA:",
]
REL_TOL = 1e-5


def ctx_id_for(model_name, tokens):
    h = hashlib.sha1(model_name.encode() + b"\0" + np.asarray(tokens, np.uint32).tobytes())
    return "worker-" + h.hexdigest()[:20]


def serve(c, model, name, tokens):
    """One prompt: returns (cached length, reused, computed, max |diff|, tolerance, what was stored)."""
    n = len(tokens)
    hit = c.match(name, tokens, get=True, dtype="f32")
    # A fully cached prompt still needs the last token's logits: recompute it.
    reuse = min(hit.length, n - 1)
    past = None
    if reuse:
        past = [(k[:reuse], v[:reuse]) for k, v in hit.kv.pairs()]
    logits, kv_new = model.forward(tokens[reuse:], positions=np.arange(reuse, n), past=past)

    # Store the prompt for the next worker.
    cid = ctx_id_for(name, tokens)
    if c.exists(cid):
        stored = f"already cached as '{cid}'"
    elif hit.length == 0:
        c.put(cid, name, tokens, kv_new, mode="create")
        stored = f"stored as new context '{cid}' ({n} tokens)"
    else:
        c.fork(hit.ctx_id, cid)                       # copy-on-write: blocks shared
        if c.stat(cid).n_tokens > hit.length:
            c.keep(cid, 0, hit.length)                # drop what is not ours
        if hit.length < n:
            new = kv_new if reuse == hit.length else L.kv_slice(kv_new, hit.length - reuse)
            c.put(cid, name, tokens[hit.length:], new, mode="append")
        stored = (f"stored as '{cid}': a fork of '{hit.ctx_id}' sharing {hit.length} tokens, "
                  f"plus {n - hit.length} appended")

    full, _ = model.forward(tokens)                  # the reference: no cache at all
    diff = float(np.max(np.abs(full[reuse:] - logits))) if n else 0.0
    tol = REL_TOL * max(1.0, float(np.max(np.abs(full))))
    return hit.length, reuse, n - reuse, diff, tol, stored


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    C.add_socket_arg(ap)
    ap.add_argument("--seed", type=int, default=0, help="weights seed (default 0)")
    ap.add_argument("--rope", default="default", choices=L.ROPE_FAMILIES,
                    help="RoPE family of the toy model (default: default)")
    args = ap.parse_args(argv)

    config, model, name, _ = C.toy_model(args.rope, args.seed, "worker")
    c, sock = C.connect(args.socket)
    if c is None:
        return 2
    with c, tempfile.TemporaryDirectory() as tmp:
        path = L.write_config(tmp, config)
        m = c.register_model(name, path, dtype="f32")
        print(f"connected to {c.ping().server} at {sock}")
        print(f"model '{m.name}': {m.n_layers} layers, {m.n_kv_heads} KV heads x {m.head_dim}, "
              f"RoPE {m.rope['scaling']} ({m.rope['style']}), KV kept as {m.dtype}, "
              f"fingerprint {m.fingerprint:016x}")
        total = skipped = 0
        worst = 0.0
        failed = False
        for i, text in enumerate(PROMPTS, 1):
            tokens = L.encode(text)
            cached, reused, computed, diff, tol, stored = serve(c, model, name, tokens)
            total += len(tokens)
            skipped += reused
            worst = max(worst, diff)
            ok = diff <= tol
            failed |= not ok
            first = text[len(SYSTEM):].splitlines()[0]
            print(f"\nprompt {i} ({len(tokens)} tokens, system prompt + {first!r}...):")
            if cached:
                print(f"  the daemon had the first {cached} tokens cached; loaded their KV and "
                      f"reused {reused}" + (" (the last token is recomputed for its logits)"
                                            if cached == len(tokens) else ""))
            else:
                print("  nothing cached yet")
            print(f"  computed {computed} of {len(tokens)} tokens with the model; {stored}")
            print(f"  logits vs. a full run without the cache: max |diff| = {diff:.3g} "
                  f"(tolerance {tol:.1g}) -> {'identical' if diff == 0 else 'equal within float32 rounding' if ok else 'DIFFERENT'}")
        print(f"\nin total {skipped} of {total} prompt tokens were not recomputed "
              f"({100.0 * skipped / total:.0f}%); worst logit difference {worst:.3g}")
        if failed:
            print("FAILED: the cached logits differ from the full run beyond float32 rounding",
                  file=sys.stderr)
            return 1
        print("OK: logits with the cache are identical to the full recompute")
    return 0


if __name__ == "__main__":
    sys.exit(main())
