#!/usr/bin/python3
"""Use case 2: a code editor that keeps a file's KV cached in kvroped and
sends each edit as a PIE edit instead of re-encoding the file.

    make run                                   # in one terminal: the daemon
    /usr/bin/python3 examples/editor.py        # in another (--socket PATH to choose)

What it does:
  1. takes a real source file of this repository (rope/rope.c, its first
     ~1500 bytes, cut at a line end), tokenises it by bytes
     (examples/tokenizer.py), encodes it once with the numpy Llama
     (examples/llama.py) and stores its KV in the daemon;
  2. applies a series of edits -- insert a comment line, rename an identifier
     everywhere (one op per occurrence, all in one atomic request), delete a
     line -- each as a PIE edit:
       edit_plan  -> where the new tokens land (indices, positions);
       the model computes ONLY the new tokens' KV, with as `past` the cached
       prefix before each op fetched from kvrope at its new positions (the
       daemon re-rotates the keys; earlier ops' new tokens are included);
       edit       -> the daemon splices the new KV in and moves the suffix by
                     a pure rotation of its keys (flagged approximate: their
                     KV was computed against the old text);
  3. after every edit, the next-token logits after the file are computed
     from the cached (edited, approximate) KV and compared with a full
     re-encode of the edited file: max |logit difference|, whether the argmax
     (the predicted next byte) agrees, and the share of tokens not re-encoded;
  4. finally refreshes the approximate tokens with the re-encoded KV
     (Refresh), after which the cached logits equal the full re-encode.

The difference in step 3 is PIE's approximation (the suffix's values and
pre-RoPE keys were computed against the old text), not rounding: the model's
KV is kept in float32 and the rotation is exact. Exit 0 when the run is
consistent (the daemon's tokens are the edited file, refresh is exact), 1 if
not, 2 when no daemon answers.
"""

import argparse
import hashlib
import json
import os
import re
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "client", "python"))

import kvrope  # noqa: E402
import llama as L  # noqa: E402
from tokenizer import decode_bytes  # noqa: E402

ROOT = os.path.normpath(os.path.join(HERE, ".."))
DEFAULT_FILE = os.path.join(ROOT, "rope", "rope.c")
REL_TOL = 1e-5


def load_source(path, limit):
    data = open(path, "rb").read()
    if len(data) > limit:
        cut = data.rfind(b"\n", 0, limit)
        data = data[:cut + 1 if cut > 0 else limit]
    return data


# ---- the edits, as byte ranges of the current text ---------------------------------
# Each returns (description, [(start, end, replacement bytes), ...]) in the
# CURRENT text's coordinates (byte = token index), sorted, non-overlapping.

def edit_insert_comment(text):
    anchor = text.find(b"#define ")
    if anchor < 0:
        anchor = text.find(b"\n", len(text) // 2) + 1
    line = b"/* edited by examples/editor.py: a comment line inserted here */\n"
    return f"insert a comment line before byte {anchor}", [(anchor, anchor, line)]


def edit_rename(text, old=b"inv_freq", new=b"inverse_frequency"):
    spots = [m.span() for m in re.finditer(rb"\b" + re.escape(old) + rb"\b", text)]
    if not spots:   # another file: rename its most frequent long identifier
        words = re.findall(rb"\b[A-Za-z_][A-Za-z_0-9]{5,}\b", text)
        old = max(set(words), key=words.count)
        new = old + b"_renamed"
        spots = [m.span() for m in re.finditer(rb"\b" + re.escape(old) + rb"\b", text)]
    return (f"rename '{old.decode()}' to '{new.decode()}' ({len(spots)} occurrences, "
            f"one op each)", [(a, b, new) for a, b in spots])


def edit_delete_line(text):
    m = re.search(rb"^#include <unistd\.h>\n", text, re.M) or \
        re.search(rb"^#include[^\n]*\n", text, re.M)
    if m is None:
        a = text.find(b"\n", len(text) // 3) + 1
        m_span = (a, text.find(b"\n", a) + 1)
    else:
        m_span = m.span()
    gone = text[m_span[0]:m_span[1]].decode(errors="replace").rstrip("\n")
    return f"delete the line {gone!r}", [(m_span[0], m_span[1], b"")]


EDITS = (edit_insert_comment, edit_rename, edit_delete_line)


def apply_text(text, ops):
    out, last = [], 0
    for a, b, rep in ops:
        out += [text[last:a], rep]
        last = b
    out.append(text[last:])
    return b"".join(out)


# ---- PIE edit through kvrope --------------------------------------------------------

def new_tokens_kv(c, model, cid, ops, plan):
    """The KV of every op's new tokens, computed at the planned positions, with
    as past the cached text before it in the EDITED sequence: old segments
    fetched from kvrope re-rotated to their new positions (get positions=),
    earlier ops' new tokens from this computation. -> (kv list, tokens run)."""
    past, out, last_old, computed = None, [], 0, 0
    for (a, b, rep), span in zip(ops, plan.spans):
        if a > last_old:   # the old tokens [last_old, a) now sit at these positions
            pos = span.first_pos - (a - last_old) + np.arange(a - last_old, dtype=np.int64)
            seg = c.get(cid, last_old, a, positions=pos, dtype="f32").pairs()
            past = seg if past is None else L.kv_concat(past, seg)
        if rep:
            toks = list(rep)
            _, kv = model.forward(toks, positions=span.positions, past=past)
            out.append(kv)
            past = kv if past is None else L.kv_concat(past, kv)
            computed += len(toks)
        last_old = b
    return (L.kv_concat(*out) if out else None), computed


def logits_from_cache(c, model, cid, tokens):
    """Next-token logits after the file from the cached KV: past = cached
    [0, n-1), the model runs only the last token (at its cached position)."""
    n = len(tokens)
    past = c.get(cid, 0, n - 1, dtype="f32")
    last = c.get(cid, n - 1, n, meta_only=True)
    logits, _ = model.forward([tokens[-1]], positions=last.positions, past=past.pairs())
    return logits[-1], past


def show_byte(b):
    return repr(chr(b)) if 32 <= b < 127 or b in (9, 10) else f"byte {b}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--socket", default=None,
                    help="daemon socket (default: $KVROPE_SOCKET, else the daemon's default, "
                         f"here {kvrope.default_socket()})")
    ap.add_argument("--file", default=DEFAULT_FILE, help="source file (default rope/rope.c)")
    ap.add_argument("--bytes", type=int, default=1500, help="bytes of it to use (default 1500)")
    ap.add_argument("--seed", type=int, default=0, help="weights seed (default 0)")
    ap.add_argument("--rope", default="default", choices=L.ROPE_FAMILIES,
                    help="RoPE family of the toy model (default: default)")
    args = ap.parse_args(argv)

    config = L.make_config(args.rope)
    model = L.LlamaModel(config, seed=args.seed)
    digest = hashlib.sha1((json.dumps(config, sort_keys=True) + f"/{args.seed}").encode())
    name = f"editor-llama-{digest.hexdigest()[:10]}"
    sock = args.socket or kvrope.default_socket()
    try:
        c = kvrope.connect(sock)
    except kvrope.KvropeError as e:
        print(f"cannot reach kvroped at {sock}: {e.message}\n"
              f"start it with `make run` (or pass --socket PATH)", file=sys.stderr)
        return 2
    if not c._lib.has("kvr_client_edit"):
        print("this libkvrope has no edit verbs; rebuild it (make build/libkvrope.so)",
              file=sys.stderr)
        return 2

    text = load_source(args.file, args.bytes)
    rel = os.path.relpath(args.file, ROOT)
    failed = False
    with c, tempfile.TemporaryDirectory() as tmp:
        m = c.register_model(name, L.write_config(tmp, config), dtype="f32")
        cid = "editor-" + hashlib.sha1(name.encode() + text).hexdigest()[:16]
        if c.exists(cid):
            c.delete(cid)
        print(f"connected to {c.ping().server} at {sock}")
        print(f"model '{m.name}': {m.n_layers} layers, {m.n_kv_heads} KV heads x {m.head_dim}, "
              f"RoPE {m.rope['scaling']} ({m.rope['style']}), KV kept as {m.dtype}")
        tokens = list(text)
        _, kv = model.forward(tokens)
        c.put(cid, name, tokens, kv, mode="create")
        n_lines = text.count(b"\n")
        print(f"\nencoded {rel} (first {len(text)} bytes, {n_lines} lines) once: "
              f"{len(tokens)} byte tokens stored as context '{cid}'")

        total_len = total_computed = 0
        for i, make_edit in enumerate(EDITS, 1):
            what, ops = make_edit(text)
            wire = [(a, b, list(rep)) for a, b, rep in ops]
            plan = c.edit_plan(cid, wire, model=name)
            kv_new, computed = new_tokens_kv(c, model, cid, ops, plan)
            res = c.edit(cid, wire, kv_new, model=name)
            text = apply_text(text, ops)
            tokens = list(text)
            n = len(tokens)
            print(f"\nedit {i}: {what}")
            print(f"  plan: {len(plan.spans)} op(s), first change at token {plan.first_change}, "
                  f"{plan.n_new} new tokens at positions "
                  f"{_ranges(plan.positions)}, {plan.n_removed} removed")
            if computed:
                print(f"  computed the KV of the {computed} new tokens with the model and sent "
                      f"it with the edit ({plan.payload_bytes} bytes)")
            else:
                print("  nothing to compute: a pure deletion sends no KV")
            print(f"  the file is now {n} tokens; {res.n_approximate} of them are approximate "
                  f"(after the first edit point, their keys moved by a rotation in the daemon)")
            got = c.get(cid, meta_only=True)
            if decode_bytes(got.tokens) != text:
                print("  MISMATCH: the daemon's tokens are not the edited file", file=sys.stderr)
                failed = True
            cached, _ = logits_from_cache(c, model, cid, tokens)
            full_all, kv_full = model.forward(tokens)   # the reference: a full re-encode
            full = full_all[-1]
            diff = float(np.max(np.abs(cached - full)))
            agree = int(np.argmax(cached)) == int(np.argmax(full))
            share = 1.0 - (computed + 1) / n     # +1: the last token run for its logits
            total_len += n
            total_computed += computed + 1
            print(f"  next-token logits from the cache vs. a full re-encode: max |logit diff| = "
                  f"{diff:.4g} (max |logit| {float(np.max(np.abs(full))):.3g}); argmax "
                  f"{'agrees' if agree else 'differs'} ({show_byte(int(np.argmax(cached)))} vs "
                  f"{show_byte(int(np.argmax(full)))})")
            print(f"  tokens not re-encoded: {n - computed - 1} of {n} ({100 * share:.1f}%)")

        print(f"\nover {len(EDITS)} edits: {total_len - total_computed} of {total_len} token "
              f"encodings avoided ({100.0 * (total_len - total_computed) / total_len:.1f}% not "
              f"re-encoded)")

        # Make the cache exact again: refresh every approximate token from the
        # last re-encode (kv_full, full: of the final text).
        meta = c.get(cid, meta_only=True)
        approx = np.flatnonzero(meta.flags)
        if approx.size:
            a = int(approx[0])
            r = c.refresh(cid, a, len(tokens), L.kv_slice(kv_full, a), model=name)
            cached, _ = logits_from_cache(c, model, cid, tokens)
            diff = float(np.max(np.abs(cached - full)))
            tol = REL_TOL * max(1.0, float(np.max(np.abs(full))))
            ok = diff <= tol and r.n_approximate == 0
            failed |= not ok
            print(f"refresh of tokens [{a}, {len(tokens)}) with re-encoded KV: "
                  f"{r.n_approximate} approximate left; logits now differ by {diff:.3g} "
                  f"-> {'exact' if ok else 'NOT EXACT'}")
        c.delete(cid)
        if failed:
            print("FAILED", file=sys.stderr)
            return 1
        print("OK: every edit was applied in place; only the new tokens were encoded")
    return 0


def _ranges(pos):
    """'10..25, 40..44' for a sorted int array."""
    pos = [int(p) for p in pos]
    if not pos:
        return "(none)"
    out, a, prev = [], pos[0], pos[0]
    for p in pos[1:] + [None]:
        if p is not None and p == prev + 1:
            prev = p
            continue
        out.append(f"{a}" if a == prev else f"{a}..{prev}")
        if p is not None:
            a = prev = p
    return ", ".join(out)


if __name__ == "__main__":
    sys.exit(main())
