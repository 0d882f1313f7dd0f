#!/usr/bin/python3
"""Use case 2: a code editor's loop. A file of this repository is edited 20
times in a row; after each edit the editor wants the next-token logits, and
kvrope.EditSession moves the file's cached KV forward instead of re-encoding.

    make run                                   # in one terminal: the daemon
    /usr/bin/python3 examples/editor.py        # in another

Command line (all optional):
    --socket PATH    the daemon's socket (default $KVROPE_SOCKET, else the
                     daemon's default socket)
    --file PATH      the source file (default client/llama/worker_diff.c)
    --bytes N        use its first N bytes, cut at a line end (default 1500)
    --edits N        consecutive edits (default 20)
    --refresh K      tokens re-encoded after each edit point (default 8)
    --max-age N      approximate tokens older than N edits are re-encoded at
                     the next edit (default 16)
    --seed S         weights seed and edit placement (default 0)
    --rope FAMILY    RoPE family of the toy model (default: default)

What it does:
  1. tokenises the file by bytes (examples/tokenizer.py) and encodes it once
     with the numpy Llama (examples/llama.py) through an EditSession (the
     session is missing, so it is created);
  2. makes N edits as an editor's user would: insert a comment line, rename
     an identifier at all its sites (each site one PIE op of one atomic
     edit), delete a line, change a number, type at the end of a line,
     delete a word, replace a word, add a block, duplicate a line. Each
     version goes to EditSession.sync (diff against the cached context, kept
     KV fetched re-rotated to its new positions, only the new tokens +
     refreshes + the last token run through the model) and commit (one
     compare-and-swap edit + refreshes). Per edit it prints the tokens
     computed / reused / still approximate and the next-token logits'
     difference from a full re-encode of the edited file, with both times;
  3. then refresh_idle() re-encodes every approximate token (what an editor
     does when the user pauses), and the cached logits equal a full
     re-encode (within float tolerance).

The per-edit difference is PIE's approximation (tokens after an edit point
keep values and pre-RoPE keys computed against the old text), not rounding:
the KV is kept in float32 and the re-rotation is exact. The policy bounds it:
no token stays approximate for more than --max-age edits.

Exit status: 0 when the run is consistent (after every edit the daemon holds
exactly the edited file at positions 0..n-1, no token is older than
--max-age, and after the idle refresh the logits equal a full re-encode);
1 if any of that fails; 2 when no daemon answers (or libkvrope lacks the edit
verbs).
"""

import argparse
import hashlib
import os
import random
import re
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "client", "python"))

import kvrope  # noqa: E402
import llama as L  # noqa: E402
import common as C  # noqa: E402

ROOT = os.path.normpath(os.path.join(HERE, ".."))
DEFAULT_FILE = os.path.join(ROOT, "client", "llama", "worker_diff.c")
REL_TOL = 1e-5
C_WORDS = set(b"""static const return sizeof size_t include define while break continue struct
typedef unsigned signed long short void char else for int NULL bool true false if do goto switch
case default double float enum union extern inline volatile restrict uint8_t uint16_t uint32_t
uint64_t int8_t int16_t int32_t int64_t errno""".split())


def load_source(path, limit):
    data = open(path, "rb").read()
    if len(data) > limit:
        cut = data.rfind(b"\n", 0, limit)
        data = data[:cut + 1 if cut > 0 else limit]
    return data


# ---- the edits: (text, rng, i) -> (description, new text) -------------------------

def _lines(text):
    """[(start, end)] of every line (end after its newline)."""
    out, a = [], 0
    for m in re.finditer(rb"\n", text):
        out.append((a, m.end()))
        a = m.end()
    if a < len(text):
        out.append((a, len(text)))
    return out


def _code_lines(text):
    ls = [(a, b) for a, b in _lines(text) if text[a:b].strip() and
          not text[a:b].lstrip().startswith((b"/*", b"*", b"//", b"#"))]
    return ls or _lines(text)


def _pick_line(text, rng):
    ls = _code_lines(text)
    return ls[rng.randrange(len(ls))]


def edit_insert_comment(text, rng, i):
    a, _ = _pick_line(text, rng)
    indent = re.match(rb"[ \t]*", text[a:]).group(0)
    line = indent + b"/* edit %d: a note the user typed */\n" % i
    return f"insert a comment line at byte {a}", text[:a] + line + text[a:]


def _identifiers(text, fresh):
    """{identifier: occurrences} of the code (comments and strings left out;
    fresh: only names not renamed by this script yet)."""
    code = re.sub(rb'/\*.*?(?:\*/|$)|//[^\n]*|"(?:\\.|[^"\\\n])*"', b" ", text, flags=re.S)
    counts = {}
    for w in re.findall(rb"\b[A-Za-z_][A-Za-z_0-9]{2,}\b", code):
        if w not in C_WORDS and not (fresh and re.search(rb"_\d+$", w)):
            counts[w] = counts.get(w, 0) + 1
    return counts


def edit_rename(text, rng, i):
    """An identifier of the code used at 2+ sites renamed at all of them
    (as an editor's rename does; the diff makes it one op per site)."""
    counts = _identifiers(text, True)
    if not any(n >= 2 for n in counts.values()):
        counts = _identifiers(text, False)
    cands = sorted((w for w, n in counts.items() if n >= 2), key=lambda w: (-counts[w], w))
    if not cands:
        return edit_insert_comment(text, rng, i)
    old = cands[rng.randrange(min(5, len(cands)))]
    new = old + b"_%d" % i
    spans = [m.span() for m in re.finditer(rb"\b" + re.escape(old) + rb"\b", text)]
    out, last = [], 0
    for s, e in spans:
        out += [text[last:s], new]
        last = e
    out.append(text[last:])
    return (f"rename '{old.decode()}' to '{new.decode()}' ({len(spans)} sites)",
            b"".join(out))


def edit_delete_line(text, rng, i):
    a, b = _pick_line(text, rng)
    gone = text[a:b].decode(errors="replace").strip()
    return f"delete the line {gone[:40]!r}", text[:a] + text[b:]


def edit_number(text, rng, i):
    ms = list(re.finditer(rb"\b\d+\b", text))
    if not ms:
        return edit_insert_comment(text, rng, i)
    m = ms[rng.randrange(len(ms))]
    new = b"%d" % (int(m.group(0)) + 1)
    return (f"change the number {m.group(0).decode()} to {new.decode()} at byte {m.start()}",
            text[:m.start()] + new + text[m.end():])


def edit_type_at_line_end(text, rng, i):
    a, b = _pick_line(text, rng)
    at = b - 1 if text[b - 1:b] == b"\n" else b
    typed = b" /* ok */"
    return f"type {typed.decode()!r} at the end of a line (byte {at})", text[:at] + typed + text[at:]


def edit_delete_word(text, rng, i):
    ms = [m for m in re.finditer(rb"[A-Za-z_][A-Za-z_0-9]* ", text)]
    if not ms:
        return edit_delete_line(text, rng, i)
    m = ms[rng.randrange(len(ms))]
    return (f"delete the word {m.group(0).decode().strip()!r} at byte {m.start()}",
            text[:m.start()] + text[m.end():])


def edit_replace_word(text, rng, i):
    ms = [m for m in re.finditer(rb"\b[a-z]{4,}\b", text)]
    if not ms:
        return edit_insert_comment(text, rng, i)
    m = ms[rng.randrange(len(ms))]
    new = m.group(0)[::-1]
    if new == m.group(0):
        new += b"x"
    return (f"replace the word '{m.group(0).decode()}' by '{new.decode()}' at byte {m.start()}",
            text[:m.start()] + new + text[m.end():])


def edit_insert_block(text, rng, i):
    ls = [(a, b) for a, b in _lines(text) if text[a:b] == b"\n"] or _lines(text)
    a, _ = ls[rng.randrange(len(ls))]
    block = (b"static int helper_%d(int x)\n{\n    return x * %d;\n}\n\n" % (i, i))
    return f"add a 4-line function at byte {a}", text[:a] + block + text[a:]


def edit_duplicate_line(text, rng, i):
    a, b = _pick_line(text, rng)
    line = text[a:b] if text[a:b].endswith(b"\n") else text[a:b] + b"\n"
    return f"duplicate the line at byte {a}", text[:b] + line + text[b:]


EDITS = (edit_insert_comment, edit_rename, edit_delete_line, edit_number,
         edit_type_at_line_end, edit_delete_word, edit_replace_word, edit_insert_block,
         edit_duplicate_line, edit_rename)


def show_byte(b):
    return repr(chr(b)) if 32 <= b < 127 or b in (9, 10) else f"byte {b}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    C.add_socket_arg(ap)
    ap.add_argument("--file", default=DEFAULT_FILE,
                    help="source file (default client/llama/worker_diff.c)")
    ap.add_argument("--bytes", type=int, default=1500, help="bytes of it to use (default 1500)")
    ap.add_argument("--edits", type=int, default=20, help="consecutive edits (default 20)")
    ap.add_argument("--refresh", type=int, default=8,
                    help="tokens re-encoded after each edit point (default 8)")
    ap.add_argument("--max-age", type=int, default=16,
                    help="re-encode tokens approximate for more edits than this (default 16)")
    ap.add_argument("--seed", type=int, default=0, help="weights seed and edit placement")
    ap.add_argument("--rope", default="default", choices=L.ROPE_FAMILIES,
                    help="RoPE family of the toy model (default: default)")
    args = ap.parse_args(argv)
    if args.bytes < 64 or args.edits < 1:
        ap.error("--bytes must be >= 64 and --edits >= 1")

    config, model, name, _ = C.toy_model(args.rope, args.seed, "editor")
    c, sock = C.connect(args.socket, needs=("kvr_client_edit", "edit verbs"))
    if c is None:
        return 2

    text = load_source(args.file, args.bytes)
    rel = os.path.relpath(args.file, ROOT)
    rng = random.Random(args.seed)
    failed = False
    with c, tempfile.TemporaryDirectory() as tmp:
        m = c.register_model(name, L.write_config(tmp, config), dtype="f32")
        sid = "editor-" + hashlib.sha1(name.encode() + rel.encode()).hexdigest()[:16]
        if c.exists(sid):
            c.delete(sid)          # this demo's own context from an earlier run
        print(f"connected to {c.ping().server} at {sock}")
        print(f"model '{m.name}': {m.n_layers} layers, {m.n_kv_heads} KV heads x {m.head_dim}, "
              f"RoPE {m.rope['scaling']} ({m.rope['style']}), KV kept as {m.dtype}")
        s = kvrope.EditSession(c, name, sid, model, refresh=args.refresh,
                               max_age=args.max_age)
        r = s.step(list(text))
        n_lines = text.count(b"\n")
        print(f"\nencoded {rel} (first {len(text)} bytes, {n_lines} lines) once: "
              f"{r.n_computed} byte tokens stored as session '{sid}' ({r.kind})")
        print(f"policy: refresh {args.refresh} tokens after each edit point, re-encode tokens "
              f"approximate for more than {args.max_age} edits")

        shares, speedups, diffs = [], [], []
        total_n = total_comp = 0
        for i in range(1, args.edits + 1):
            make = EDITS[(i - 1) % len(EDITS)]
            what, new = make(text, rng, i)
            if new == text:
                what, new = edit_insert_comment(text, rng, i)
            toks = list(new)
            t0 = time.perf_counter()
            r = s.sync(toks)
            s.commit()
            t_sess = time.perf_counter() - t0
            t0 = time.perf_counter()
            full = model.forward(toks)[0][-1]          # the reference: a full re-encode
            t_full = time.perf_counter() - t0
            text = new
            got = c.get(sid, meta_only=True)
            ages = kvrope.token_age(got.flags)
            if bytes(got.tokens.astype(np.uint8)) != text or \
                    not np.array_equal(got.positions, np.arange(len(text))):
                print("  MISMATCH: the daemon's tokens are not the edited file", file=sys.stderr)
                failed = True
            if int(ages.max()) > args.max_age:
                print(f"  POLICY BROKEN: a token approximate for {int(ages.max())} edits",
                      file=sys.stderr)
                failed = True
            diff = float(np.max(np.abs(r.logits - full)))
            agree = int(np.argmax(r.logits)) == int(np.argmax(full))
            share = r.n_computed / r.n_tokens
            shares.append(share)
            speedups.append(t_full / t_sess if t_sess > 0 else float("inf"))
            diffs.append(diff)
            total_n += r.n_tokens
            total_comp += r.n_computed
            extra = r.n_computed - r.n_new - r.n_refreshed
            print(f"\nedit {i}: {what}")
            print(f"  {r.n_ops} op(s): {r.n_new} new tokens, {r.n_removed} removed; computed "
                  f"{r.n_computed} of {r.n_tokens} tokens ({100 * share:.1f}%): {r.n_new} new + "
                  f"{r.n_refreshed} refreshed + {extra} for the logits; reused {r.n_reused}")
            print(f"  approximate now: {r.n_approx} tokens, the oldest {int(ages.max())} "
                  f"edit(s) old")
            print(f"  next-token logits vs a full re-encode: max |logit diff| = {diff:.4g} "
                  f"(max |logit| {float(np.max(np.abs(full))):.3g}); argmax "
                  f"{'agrees' if agree else 'differs'} ({show_byte(int(np.argmax(r.logits)))} "
                  f"vs {show_byte(int(np.argmax(full)))}); {1000 * t_sess:.0f} ms vs "
                  f"{1000 * t_full:.0f} ms")

        print(f"\nover {args.edits} edits: computed {total_comp} of {total_n} token encodings "
              f"({100.0 * total_comp / total_n:.1f}%), median {100 * float(np.median(shares)):.1f}% "
              f"per edit; median speedup over a full re-encode {float(np.median(speedups)):.1f}x; "
              f"max |logit diff| {max(diffs):.4g}")

        # The user pauses: re-encode what is approximate, oldest first.
        n_approx = c.stat(sid).n_approximate
        n = s.refresh_idle(cursor=len(text) - 1)
        r = s.sync(list(text))
        s.commit()
        full = model.forward(list(text))[0][-1]
        diff = float(np.max(np.abs(r.logits - full)))
        tol = REL_TOL * max(1.0, float(np.max(np.abs(full))))
        left = c.stat(sid).n_approximate
        ok = diff <= tol and left == 0 and n == n_approx and r.n_computed == 1
        failed |= not ok
        print(f"idle: refresh_idle re-encoded {n} of {n_approx} approximate tokens; "
              f"{left} approximate left; the cached logits now differ from a full re-encode "
              f"by {diff:.3g} -> {'exact' if ok else 'NOT EXACT'}")
        c.delete(sid)
        if failed:
            print("FAILED", file=sys.stderr)
            return 1
        print(f"OK: {args.edits} consecutive edits moved one context forward; each computed "
              f"only its new tokens and the policy's refreshes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
