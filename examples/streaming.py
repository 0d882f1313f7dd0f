#!/usr/bin/python3
"""Use case 4: streaming with group positions (GPE), e.g. simultaneous
translation: source and target tokens arrive interleaved in one KV cache,
but each stream keeps its own contiguous positions.

    make run                                      # in one terminal: the daemon
    /usr/bin/python3 examples/streaming.py        # in another (--socket PATH to choose)

What it does:
  1. creates a grouped context with two position groups, "src" (offset 0)
     and "tgt" (offset --target-offset, default 0);
  2. repeatedly: reads the next chunk of the source sentence and runs it with
     the model over everything cached so far (fetched from kvrope), at the
     "src" group's next positions, and appends its KV to group "src"; then
     lets the model emit a few target bytes greedily (the toy model's bytes
     are not a translation: its weights are random) at the "tgt" group's next
     positions, and appends their KV to group "tgt" -- in one cache, in
     arrival order, the daemon giving each group its next positions;
  3. shows the cache: tokens in arrival order, each group's positions
     contiguous; and checks that the next-token logits from the cache equal a
     full recompute of the interleaved stream at the same positions.

Exit 0 when they are equal (within float32 rounding), 1 if not, 2 when no
daemon answers.
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

SOURCE = ["Der Hund ", "bellt laut, ", "die Katze ", "schnurrt."]
TARGET_PER_CHUNK = 4
REL_TOL = 1e-5


def next_positions(c, cid, group, offsets, n):
    """The positions the daemon will give the next n tokens of `group`:
    offset + cursor (cursor = tokens ever appended to the group)."""
    if not c.exists(cid):
        return offsets[group] + np.arange(n)
    g = next(x for x in c.layout(cid).groups if x.name == group)
    return g.offset + g.cursor + np.arange(n)


def show(ids):
    return repr(bytes(ids))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    C.add_socket_arg(ap)
    ap.add_argument("--seed", type=int, default=0, help="weights seed (default 0)")
    ap.add_argument("--target-offset", type=int, default=0,
                    help="position offset phi of the target group (default 0)")
    args = ap.parse_args(argv)

    config, model, name, digest = C.toy_model("default", args.seed, "stream")
    c, sock = C.connect(args.socket, needs=("kvr_client_group_append", "group append"))
    if c is None:
        return 2
    offsets = {"src": 0, "tgt": args.target_offset}
    with c, tempfile.TemporaryDirectory() as tmp:
        m = c.register_model(name, L.write_config(tmp, config), dtype="f32")
        cid = f"stream-{os.getpid()}-{digest.hexdigest()[:8]}"
        if c.exists(cid):
            c.delete(cid)
        print(f"connected to {c.ping().server} at {sock}")
        print(f"model '{m.name}', context '{cid}' with groups src (offset {offsets['src']}) "
              f"and tgt (offset {offsets['tgt']})")
        logits = None
        for step, chunk in enumerate(SOURCE, 1):
            past = c.get(cid).pairs() if c.exists(cid) else None
            src = L.encode(chunk)
            pos = next_positions(c, cid, "src", offsets, len(src))
            logits, kv = model.forward(src, positions=pos, past=past)
            create = {} if step > 1 else {"groups": ["src", "tgt"],   # the first append creates
                                          "group_offsets": [offsets["src"], offsets["tgt"]]}
            r = c.group_append(cid, name, "src", src, kv, **create)
            print(f"\nstep {step}: source {chunk!r} -> group src at positions "
                  f"{r.first_pos}..{r.last_pos} (stream tokens [{r.first_index}, {r.n_tokens}))")
            past = L.kv_concat(past, kv) if past is not None else kv
            tpos = next_positions(c, cid, "tgt", offsets, TARGET_PER_CHUNK)
            out, kvs = [], []
            for i in range(TARGET_PER_CHUNK):    # greedy: the first byte from the source's logits
                b = int(np.argmax(logits[-1]))
                out.append(b)
                logits, kb = model.forward([b], positions=tpos[i:i + 1], past=past)
                past = L.kv_concat(past, kb)
                kvs.append(kb)
            r = c.group_append(cid, name, "tgt", out, L.kv_concat(*kvs))
            print(f"  target bytes {show(out)} -> group tgt at positions "
                  f"{r.first_pos}..{r.last_pos} (stream tokens [{r.first_index}, {r.n_tokens}))")

        g = c.get(cid)
        groups = {x.id: x for x in c.layout(cid).groups}
        print(f"\nthe cache holds {g.n_tokens} tokens in arrival order:")
        ok_pos = True
        for gid, info in sorted(groups.items()):
            sel = g.groups == gid
            p = g.positions[sel]
            contiguous = bool(np.array_equal(p, info.offset + np.arange(p.size)))
            ok_pos &= contiguous
            print(f"  group {info.name}: {int(sel.sum())} tokens at positions {int(p[0])}..{int(p[-1])}"
                  f" ({'contiguous' if contiguous else 'NOT contiguous'}), cursor {info.cursor}")
        print(f"  positions in stream order: {' '.join(str(int(x)) for x in g.positions)}")
        # The last target byte was emitted but not run yet: its logits from the cache vs. a
        # full recompute of the whole interleaved stream at the same positions.
        nxt = int(np.argmax(logits[-1]))
        full, _ = model.forward(g.tokens, positions=g.positions)
        diff = float(np.max(np.abs(full[-1] - logits[-1])))
        tol = REL_TOL * max(1.0, float(np.max(np.abs(full[-1]))))
        ok = diff <= tol and ok_pos and int(np.argmax(full[-1])) == nxt
        print(f"next-token logits from the cache vs. a full recompute of the stream at the same "
              f"positions: max |diff| = {diff:.3g} (tolerance {tol:.1g}) -> "
              f"{'identical' if ok else 'DIFFERENT'}")
        c.delete(cid)
        if not ok:
            print("FAILED", file=sys.stderr)
            return 1
        print("OK: both streams kept their own positions in one cache")
    return 0


if __name__ == "__main__":
    sys.exit(main())
