#!/usr/bin/python3
"""fim.py — fill-in-the-middle for kvrope's eval model: the special tokens,
the prompt llama-server's /infill builds (format_infill, a transcription of
format_prompt_infill in tools/server/server-common.cpp of the pinned
llama.cpp v0.5.0), and the training samples that teach the model that
layout (eval/train.py). Debian's /usr/bin/python3.

Invariants:
  - The byte tokens keep their ids (corpus.py: 0..259); the FIM tokens come
    after them, 260..266, in the order of TOKENS, which is scripts/gen-gguf.py's
    FIM_TOKENS: it writes these texts and ids (--fim) and the GGUF keys llama.cpp
    reads (tokenizer.ggml.fim_{pre,suf,mid,pad,rep,sep}_token_id,
    tokenizer.ggml.eot_token_id), so llama_vocab_fim_pre() etc. return them.
  - format_infill() gives token for token what llama-server sends to the
    model for the same request (add_bos on, no space prefix, PSM order):
        [extra tail] <s> FIM_PRE prefix prompt FIM_SUF suffix FIM_MID
    where extra = FIM_REP "myproject\\n" {FIM_SEP name "\\n" text}* FIM_SEP
    "filename\\n" and only its last n_ctx - n_batch - 2 n_predict tokens are
    kept (none when the batch is not smaller than the context).
  - A training sample is that prompt followed by the middle and EOT, so what
    the model learns is exactly what /infill asks; the rest of the sequence
    is FIM_PAD, which the loss skips.
"""
import importlib.util
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import corpus  # noqa: E402

def _gguf_writer():
    spec = importlib.util.spec_from_file_location(
        "gen_gguf", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts", "gen-gguf.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# (name, text, GGUF key): the GGUF writer's table, so the tokenizer llama.cpp
# loads and the training cannot disagree.
TOKENS = _gguf_writer().FIM_TOKENS
FIRST = corpus.BYTE_VOCAB
ID = {name: FIRST + i for i, (name, _, _) in enumerate(TOKENS)}
PRE, SUF, MID, PAD, REP, SEP, EOT = (ID[n] for n in ("pre", "suf", "mid", "pad", "rep", "sep", "eot"))
assert FIRST + len(TOKENS) == corpus.VOCAB and FIRST == _gguf_writer().FIM_FIRST_ID

REPO = "myproject\n"      # llama-server's fixed project name
CUR_FILE = "filename\n"   # and its fixed name of the current file


def enc(text):
    return [int(x) for x in corpus.encode(text.encode() if isinstance(text, str) else text, bos=False)]


def extra_tokens(chunks):
    """The repo-level context llama-server builds from input_extra:
    chunks = [(filename, text bytes or str)]."""
    out = [REP] + enc(REPO)
    for name, text in chunks:
        out += [SEP] + enc(name + "\n") + enc(text)
    return out + [SEP] + enc(CUR_FILE)


def _order(pre, suf, spm):
    """PSM: <s> FIM_PRE pre FIM_SUF suf FIM_MID; SPM (llama-server
    --spm-infill): <s> FIM_SUF suf FIM_PRE pre FIM_MID."""
    if spm:
        return [corpus.BOS, SUF] + suf + [PRE] + pre + [MID]
    return [corpus.BOS, PRE] + pre + [SUF] + suf + [MID]


def format_infill(prefix, suffix, prompt=b"", chunks=(), n_batch=256, n_ctx=512, n_predict=32, spm=False):
    """llama-server's /infill prompt (token ids) for input_prefix, input_suffix,
    prompt and input_extra chunks, with its batch, slot context and n_predict
    (spm: as started with --spm-infill). n_predict is the server's (its -n,
    default -1), not a request's: llama-server budgets the chunks with it."""
    tp, ts, tq = enc(prefix), enc(suffix), enc(prompt)
    ex = extra_tokens(chunks)
    n_pre = min(len(tp), 3 * (n_batch // 4))
    n_suf = min(len(ts), max(0, n_batch // 4 - (2 + len(tq))))
    n_ex = min(max(0, n_ctx - n_batch - 2 * n_predict), len(ex))
    tp = tp[len(tp) - n_pre:]
    ts = ts[:n_suf]
    return ex[len(ex) - n_ex:] + _order(tp + tq, ts, spm)


def _line_end(ft, c, nl):
    j = np.searchsorted(nl, c)
    return int(nl[j]) if j < len(nl) else len(ft)


N_BATCHES = (128, 192, 256, 384)   # the /infill batch sizes a sample is laid out for


def sample(rng, ft, seq, chunk_src=None, spm=False, n_batches=N_BATCHES, line=None):
    """One FIM training sequence of seq + 1 tokens from file tokens ft (no BOS):
    the /infill prompt (a cursor, mostly mid-line with the rest of the line or a
    few lines as the middle, else a random span), then the middle and EOT,
    padded with FIM_PAD. chunk_src(rng) -> [(name, tokens)] gives other files'
    chunks for the repo-level form (None: no extra). line: the share of
    samples whose middle is exactly the rest of the cursor's line (the rest
    split evenly between the rest of the line and more lines, and a random
    span); None: 70% cursor cases with a geometric number of extra lines
    (0 with p 0.6), 30% random spans."""
    n = len(ft)
    nl = np.flatnonzero(ft == corpus.encode(b"\n", bos=False)[0])
    c = int(rng.integers(0, n))
    u = rng.random()
    if line is not None:
        if u < line:
            e = _line_end(ft, c, nl)
        elif u < line + (1 - line) / 2:
            e = _line_end(ft, c, nl)
            for _ in range(int(rng.geometric(0.5))):
                if e < n:
                    e = _line_end(ft, e + 1, nl)
        else:
            e = min(n, c + int(rng.integers(0, 160)))
    elif u < 0.7:   # the editor's case: cursor in a line, the rest of it (+ lines)
        e = _line_end(ft, c, nl)
        for _ in range(int(rng.geometric(0.6)) - 1):
            if e < n:
                e = _line_end(ft, e + 1, nl)
    else:
        e = min(n, c + int(rng.integers(0, 160)))
    mid = ft[c:e]
    # llama.vim: prompt = current line up to the cursor, prefix = lines before
    ls = int(nl[np.searchsorted(nl, c) - 1]) + 1 if np.searchsorted(nl, c) > 0 else 0
    budget = seq + 1 - len(mid) - 1
    n_batch = int(rng.choice(list(n_batches)))
    n_pre = min(ls, 3 * (n_batch // 4))
    n_suf = min(n - e, max(0, n_batch // 4 - (2 + c - ls)))
    pre, suf = list(ft[ls - n_pre:c]), list(ft[e:e + n_suf])
    if len(pre) + len(suf) + 4 > budget:   # a long middle or line: drop prefix from the front
        cut = len(pre) + len(suf) + 4 - budget
        if cut > len(pre):
            return None      # not even the suffix fits: draw another sample
        pre = pre[cut:]
    head = _order(pre, suf, spm)
    if chunk_src is not None:
        ex = extra_tokens_ids(chunk_src(rng))
        room = budget - len(head)
        head = ex[len(ex) - min(room, len(ex)):] + head
    out = head + list(mid) + [EOT]
    return out + [PAD] * (seq + 1 - len(out))


def extra_tokens_ids(chunks):
    """extra_tokens() for chunks whose names are str and texts token ids."""
    out = [REP] + enc(REPO)
    for name, toks in chunks:
        out += [SEP] + enc(name + "\n") + list(toks)
    return out + [SEP] + enc(CUR_FILE)
