#!/usr/bin/python3
"""corpus.py — the code kvrope's eval model is trained and scored on, and its
tokenizer. Run with Debian's /usr/bin/python3.

The corpus is the Python standard library that every Debian 12 system has
(/usr/lib/python3.11, packages libpython3.11-minimal and -stdlib), without
its test suites. A fixed 1-in-20 of the files, chosen by a hash of the
relative path, is held out: never trained on, used for every measurement.
The hash makes the split independent of the order files are listed in and
stable across machines; corpus_digest() records which files and sizes a
model saw, so a different Python version is detected rather than silently
mixed.

Tokens are bytes, numbered as the GGUF tokenizer of scripts/gen-gguf.py
numbers them (so llama.cpp's llama_tokenize gives the same ids): <unk> 0,
<s> (BOS) 1, </s> 2, byte b -> 3 + b, except the space, which llama.cpp's
SentencePiece tokenizer turns into U+2581, id 259: 260 byte-level ids.
The fill-in-the-middle special tokens follow them, 260..266 (eval/fim.py):
vocabulary 267. decode() drops every special token.
"""
import hashlib
import os
import zlib

import numpy as np

ROOT = "/usr/lib/python3.11"
BYTE_VOCAB = 260   # <unk>, <s>, </s>, the 256 bytes (space as U+2581)
VOCAB = 267        # + the FIM tokens of eval/fim.py
BOS = 1
SPACE_ID = 259
HELD_OUT_MOD = 20
_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}


def files(root=ROOT):
    """Sorted relative paths of the corpus's .py files."""
    out = []
    for d, dirs, names in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in _SKIP_DIRS)
        for n in sorted(names):
            if n.endswith(".py"):
                out.append(os.path.relpath(os.path.join(d, n), root))
    return sorted(out)


def is_held_out(rel):
    return zlib.crc32(rel.encode()) % HELD_OUT_MOD == 0


def split(root=ROOT):
    fs = files(root)
    if not fs:
        raise SystemExit(f"corpus: no .py files under {root} (is libpython3.11-stdlib installed?)")
    return [f for f in fs if not is_held_out(f)], [f for f in fs if is_held_out(f)]


def read(rel, root=ROOT):
    with open(os.path.join(root, rel), "rb") as f:
        return f.read()


def corpus_digest(rels, root=ROOT):
    h = hashlib.sha256()
    for r in rels:
        h.update(r.encode() + b"\0" + str(os.path.getsize(os.path.join(root, r))).encode() + b"\n")
    return h.hexdigest()[:16]


_BYTE_TO_ID = np.arange(256, dtype=np.int32) + 3
_BYTE_TO_ID[0x20] = SPACE_ID
_ID_TO_BYTE = np.zeros(VOCAB, dtype=np.int32) - 1
_ID_TO_BYTE[3:259] = np.arange(256)
_ID_TO_BYTE[SPACE_ID] = 0x20


def encode(data, bos=True):
    """bytes -> int32 ids (BOS first when bos)."""
    ids = _BYTE_TO_ID[np.frombuffer(bytes(data), dtype=np.uint8)]
    return np.concatenate([[BOS], ids]).astype(np.int32) if bos else ids.astype(np.int32)


def decode(ids):
    """ids -> bytes (special tokens dropped)."""
    b = _ID_TO_BYTE[np.asarray(ids, dtype=np.int64)]
    return bytes(b[b >= 0].astype(np.uint8).tolist())


def is_byte_id(i):
    return 3 <= i < BYTE_VOCAB


if __name__ == "__main__":
    tr, ho = split()
    size = lambda rs: sum(os.path.getsize(os.path.join(ROOT, r)) for r in rs)
    print(f"train {len(tr)} files {size(tr)} bytes; held out {len(ho)} files {size(ho)} bytes")
    for r in ho:
        print("  held out:", r)
