#!/usr/bin/python3
"""engines.py — the two inference engines the eval runs kvrope's caches
through, behind one interface (Debian's /usr/bin/python3):

  NumpyEngine(model_dir)       examples/llama.py's numpy Llama with the trained
                               weights (float64 arithmetic, K/V rounded to f32)
  LlamaEngine(gguf, worker)    llama.cpp, through `kvrope-llama score`
                               (docs/llama.md): the real engine

A cache is (kv, pos): kv a list of (K, V) per layer, each [T][kv_heads][dim]
float32 with K already rotated (what a kvrope get returns), pos int64 [T]
the cells' positions. Methods:

  forward(tokens, positions, cache=None, attention=None) -> (logits [n][V], kv)
      the new tokens decoded after the cache (each sees every cached cell and
      the new tokens before it); kv: the new tokens' K/V.
  score_in_cache(tokens, cache, first) -> logits [m - first][V]
      PIE's measurement: token i (first <= i < m, m = len(cache)) decoded fresh
      at pos[i] seeing only cells < i and itself; predicts tokens[i + 1].
  greedy(tokens, cache, i, n, stop) -> ids
      from cells < i plus tokens[i] decoded at pos[i], n greedy tokens
      (stopping after `stop`).
  complete(tokens, n, stop) -> ids
      a prompt decoded from position 0 with no cache, then up to n greedy
      tokens (stopping after `stop`): what a server does with a request.
attention (numpy only): an attention function with llama.attention's
signature (APE's T and S); the llama.cpp engine has no such hook, so APE's
S cannot run there (T can: kvrope folds it into the keys).
"""
import json
import os
import subprocess
import struct
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "examples"))
import llama as L  # noqa: E402


def log_softmax(x):
    x = np.asarray(x, dtype=np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def kv_take(kv, idx):
    return [(k[idx], v[idx]) for k, v in kv]


class NumpyEngine:
    name = "numpy"

    def __init__(self, model_dir):
        self.model = L.load_model(model_dir)
        self.config = self.model.config

    def forward(self, tokens, positions, cache=None, attention=None):
        past = None if cache is None or len(cache[1]) == 0 else cache[0]
        saved = self.model.attention
        if attention is not None:
            self.model.attention = attention
        try:
            return self.model.forward(np.asarray(tokens), positions=np.asarray(positions), past=past)
        finally:
            self.model.attention = saved

    def score_in_cache(self, tokens, cache, first):
        kv, pos = cache
        m = len(pos)
        if first >= m:
            return np.zeros((0, self.model.vocab_size), np.float32)
        n = m - first
        j = np.arange(m + n)[None, :]
        q = np.arange(n)[:, None]
        mask = np.where(j < m, j < first + q, (j - m) == q)     # cells < i, and itself
        saved = self.model.attention
        self.model.attention = lambda qq, k, v, mask=None, **kw: L.attention(qq, k, v, mask=mask_, **kw)
        mask_ = mask
        try:
            logits, _ = self.model.forward(np.asarray(tokens[first:m]), positions=pos[first:m], past=kv)
        finally:
            self.model.attention = saved
        return logits

    def greedy(self, tokens, cache, i, n, stop=None):
        kv, pos = cache
        past = (kv_take(kv, slice(0, i)), pos[:i])
        p = int(pos[i])
        logits, new = self.forward([tokens[i]], [p], past if i > 0 else None)
        return self._decode(logits, L.kv_concat(past[0], new) if i > 0 else new, p, n, stop)

    def complete(self, tokens, n, stop=None, pick=None):
        logits, cur = self.forward(tokens, np.arange(len(tokens)))
        return self._decode(logits, cur, len(tokens) - 1, n, stop, pick)

    def _decode(self, logits, cur, p, n, stop, pick=None):
        """Up to n tokens after the one at position p (logits: its row last;
        cur: the cache including it), stopping after `stop`; each the argmax,
        or pick(logits) (eval/infill.py's llama.vim sampler chain)."""
        out = []
        for _ in range(n):
            t = int(np.argmax(logits[-1])) if pick is None else int(pick(logits[-1]))
            out.append(t)
            if t == stop or len(out) == n:
                break
            p += 1
            logits, new = self.model.forward([t], positions=[p], past=cur)
            cur = L.kv_concat(cur, new)
        return out


KV_MAGIC = b"KVRKV1\0\0"


def write_kv_file(path, kv, pos):
    """The KV file `kvrope-llama score --kv` reads (docs/llama.md)."""
    m, h, d = kv[0][0].shape
    with open(path, "wb") as f:
        f.write(KV_MAGIC)
        f.write(struct.pack("<6I", len(kv), m, h, d, 0, 0))
        f.write(np.asarray(pos, dtype="<i8").tobytes())
        for k, v in kv:
            f.write(np.ascontiguousarray(k, dtype="<f4").tobytes())
            f.write(np.ascontiguousarray(v, dtype="<f4").tobytes())


def read_kv_file(path):
    with open(path, "rb") as f:
        b = f.read()
    if b[:8] != KV_MAGIC:
        raise ValueError(f"{path}: not a KV file")
    nl, m, h, d, dt, _ = struct.unpack_from("<6I", b, 8)
    if dt not in (0, 1):
        raise ValueError(f"{path}: dtype {dt}, expected f32 or f16")
    el, fmt_ = (4, "<f4") if dt == 0 else (2, "<f2")
    off = 32
    pos = np.frombuffer(b, "<i8", m, off).copy()
    off += 8 * m
    kv, sz = [], m * h * d
    for _ in range(nl):
        k = np.frombuffer(b, fmt_, sz, off).reshape(m, h, d).astype(np.float32)
        off += el * sz
        v = np.frombuffer(b, fmt_, sz, off).reshape(m, h, d).astype(np.float32)
        off += el * sz
        kv.append((k, v))
    return kv, pos


class LlamaEngine:
    """llama.cpp through `kvrope-llama score` (one process per call; the
    model is tiny, so loading it costs milliseconds)."""
    name = "llama.cpp"

    def __init__(self, gguf, worker, config, threads=1):
        self.gguf, self.worker, self.threads = gguf, worker, threads
        self.config = config
        self.vocab = int(config["vocab_size"])
        self.tmp = tempfile.mkdtemp(prefix="kvr-eval-")

    def _run(self, tokens, cache, first=None, next_pos=None, kv_out=False, generate=None, stop=None):
        tp = os.path.join(self.tmp, "t.bin")
        np.asarray(tokens, dtype="<i4").tofile(tp)
        argv = [self.worker, "--model", self.gguf, "--threads", str(self.threads), "--json", "score",
                "--tokens", tp, "--logits-out", os.path.join(self.tmp, "l.bin")]
        if cache is not None and len(cache[1]):
            kp = os.path.join(self.tmp, "kv.bin")
            write_kv_file(kp, cache[0], cache[1])
            argv += ["--kv", kp]
        if first is not None:
            argv += ["--from", str(first)]
        if next_pos is not None:
            argv += ["--next-pos", str(int(next_pos))]
        if kv_out:
            argv += ["--kv-out", os.path.join(self.tmp, "kvo.bin")]
        if generate is not None:
            argv += ["--generate", "%d:%d" % generate]
            if stop is not None:
                argv += ["--stop-token", str(stop)]
        r = subprocess.run(argv, capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            raise RuntimeError(f"kvrope-llama score failed ({r.returncode}): {r.stderr.strip()[-800:]}")
        js = json.loads(r.stdout.strip().splitlines()[-1])
        lg = np.fromfile(os.path.join(self.tmp, "l.bin"), dtype="<f4").reshape(-1, self.vocab)
        kv = read_kv_file(os.path.join(self.tmp, "kvo.bin"))[0] if kv_out else None
        return js, lg, kv

    def forward(self, tokens, positions, cache=None, attention=None):
        if attention is not None:
            raise NotImplementedError("llama.cpp has no attention hook (APE's S)")
        positions = np.asarray(positions, dtype=np.int64)
        if len(positions) > 1 and not (np.diff(positions) == 1).all():
            raise ValueError("llama.cpp engine: new tokens need contiguous positions")
        m = 0 if cache is None else len(cache[1])
        toks = np.concatenate([np.full(m, 3, np.int32), np.asarray(tokens, np.int32)])
        # logits for every new token: score from m - 1 would need in-cache scoring of
        # the last cached token; instead score [m, N-1) and add the last token's
        # logits by scoring one extra (dummy) position.
        toks = np.concatenate([toks, [3]])
        js, lg, kv = self._run(toks, cache, first=m, next_pos=positions[0], kv_out=True)
        # kv-out holds the appended tokens, the dummy one last
        kv = [(k[:-1], v[:-1]) for k, v in kv]
        return lg, kv

    def score_in_cache(self, tokens, cache, first):
        m = len(cache[1])
        toks = np.asarray(tokens[:m + 1], np.int32) if len(tokens) > m else \
            np.concatenate([np.asarray(tokens[:m], np.int32), [3]])
        js, lg, _ = self._run(toks, cache, first=first)
        return lg[:m - first]

    def greedy(self, tokens, cache, i, n, stop=None):
        m = len(cache[1])
        toks = np.asarray(tokens[:m], np.int32)
        if len(toks) < m + 1:
            toks = np.concatenate([toks, [3]])
        js, _, _ = self._run(toks, cache, first=m, generate=(i, n), stop=stop)
        return list(js["generated"][0])

    def complete(self, tokens, n, stop=None):
        toks = np.concatenate([np.asarray(tokens, np.int32), [3]])   # row len-1 needs a token after it
        js, _, _ = self._run(toks, None, generate=(len(tokens) - 1, n), stop=stop)
        return list(js["generated"][0])
