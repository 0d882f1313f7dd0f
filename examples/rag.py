#!/usr/bin/python3
"""Use case 3: a RAG pipeline that encodes each document once and assembles
them per query from kvroped, with APE's attention for the parallel layout.

    make run                                   # in one terminal: the daemon
    /usr/bin/python3 examples/rag.py           # in another (--socket PATH to choose)

What it does:
  1. encodes a shared prefix (the system prompt) once and stores it;
  2. encodes each document ONCE after that prefix (positions P, P+1, ...)
     and stores it with put(prefix=...), so the daemon knows which prefix it
     belongs to (and refuses it after another prefix: E_PREFIX);
  3. for a query, asks the daemon to assemble prefix + documents:
       parallel   (APE): every document at P.., the query at P + max L_i;
                  keys exactly as stored, no document is re-encoded;
       sequential: documents back to back, the moved ones re-rotated by the
                  daemon (flagged approximate);
     and runs only the query tokens with the model over the assembled KV.
     For the parallel layout it applies APE's attention (docs/ape.md) from
     the segment table through llama.py's attention hooks: document keys get
     logit_scale 1/T and a bias (S*T - 1) * LSE_C, i.e. the documents'
     log-sum-exp is scaled by S*T when merged with the prefix + query block;
  4. compares the answers' next-token logits with a full re-encode of
     prefix + documents + query (what a pipeline without kvrope computes),
     and checks that APE with T = S = 1 is exactly ordinary attention.

The differences from the full re-encode are the approximation the layouts
make (documents did not see each other), not rounding. Exit 0 when the
T = S = 1 check holds, 1 if not, 2 when no daemon answers.
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

PREFIX = "You answer questions using only the documents below.\n"
DOCUMENTS = [
    "Document 1: kvrope is a KV-cache daemon written in C. It stores keys and values.\n",
    "Document 2: RoPE rotates each key by an angle proportional to its position.\n",
    "Document 3: APE encodes documents in parallel and rescales their attention.\n",
]
QUERY = "Question: what does RoPE rotate?\nAnswer:"


def ape_attention(doc_keys, temperature, scale, folded):
    """An attention function with llama.attention's signature applying APE
    (docs/ape.md) for keys marked in doc_keys (bool over the cached keys; the
    new query tokens' keys follow them and are never documents)."""

    def attn(q, k, v, mask=None, bias=None, logit_scale=None, **kw):
        tq, h, d = q.shape
        tk, kvh, _ = k.shape
        C = np.zeros(tk, dtype=bool)
        C[:doc_keys.size] = doc_keys
        if not C.any():
            return L.attention(q, k, v, mask=mask, bias=bias, logit_scale=logit_scale, **kw)
        t = 1.0 if folded else temperature         # folded: keys already k / T
        rep = h // kvh
        qg = np.asarray(q, np.float64).reshape(tq, kvh, rep, d)
        logits = np.einsum("qgrd,kgd->grqk", qg, np.asarray(k, np.float64)[C]).reshape(h, tq, -1)
        lc = logits * (d ** -0.5) / t
        mx = lc.max(axis=-1, keepdims=True)
        lse_c = (mx + np.log(np.exp(lc - mx).sum(axis=-1, keepdims=True)))[..., 0]  # [h, tq]
        ls = np.where(C, 1.0 / t, 1.0)
        b = np.zeros((h, tq, tk))
        b[:, :, C] = ((scale * temperature - 1.0) * lse_c)[:, :, None]
        return L.attention(q, k, v, mask=mask, bias=b, logit_scale=ls, **kw)
    return attn


def run_query(model, asm, query, attention=None):
    """Next-token logits after `query` run over the assembled stream."""
    past = asm.kv.pairs()
    pos = asm.query_pos + np.arange(len(query))
    saved = model.attention
    if attention is not None:
        model.attention = attention
    try:
        logits, _ = model.forward(query, positions=pos, past=past)
    finally:
        model.attention = saved
    return logits[-1]


def show_byte(b):
    return repr(chr(b)) if 32 <= b < 127 or b in (9, 10) else f"byte {b}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    C.add_socket_arg(ap)
    ap.add_argument("--seed", type=int, default=0, help="weights seed (default 0)")
    ap.add_argument("--temperature", type=float, default=None, help="APE T (default 0.9)")
    ap.add_argument("--scale", type=float, default=None, help="APE S (default 0.9)")
    args = ap.parse_args(argv)

    config, model, name, _ = C.toy_model("default", args.seed, "rag")
    c, sock = C.connect(args.socket, needs=("kvr_client_assemble", "assemble"))
    if c is None:
        return 2
    failed = False
    with c, tempfile.TemporaryDirectory() as tmp:
        m = c.register_model(name, L.write_config(tmp, config), dtype="f32")
        print(f"connected to {c.ping().server} at {sock}")
        print(f"model '{m.name}': {m.n_layers} layers, {m.n_kv_heads} KV heads x {m.head_dim}, "
              f"KV kept as {m.dtype}")
        pre = L.encode(PREFIX)
        P = len(pre)
        tag = hashlib.sha1(name.encode() + PREFIX.encode()).hexdigest()[:10]
        pid = f"rag-prefix-{tag}"
        _, kv_pre = model.forward(pre)
        encoded = 0
        if not c.exists(pid):
            c.put(pid, name, pre, kv_pre, mode="create")
            encoded += P
        doc_ids = []
        for i, d in enumerate(DOCUMENTS):
            toks = L.encode(d)
            did = f"rag-doc-{tag}-{hashlib.sha1(d.encode()).hexdigest()[:10]}"
            if not c.exists(did):
                _, kvd = model.forward(toks, positions=P + np.arange(len(toks)), past=kv_pre)
                c.put(did, name, toks, kvd, mode="create", prefix=pid)
                encoded += len(toks)
            doc_ids.append(did)
        print(f"\nprefix: {P} tokens as '{pid}'; {len(DOCUMENTS)} documents, each encoded once "
              f"after it ({', '.join(str(len(L.encode(d))) for d in DOCUMENTS)} tokens); "
              f"this run encoded {encoded} of them" + (" (the others were cached by an earlier run)"
                                                      if encoded < P + sum(len(L.encode(d)) for d in DOCUMENTS) else ""))

        query = L.encode(QUERY)
        full_toks = pre + [t for d in DOCUMENTS for t in L.encode(d)] + query
        full, _ = model.forward(full_toks)
        full = full[-1]
        n_docs_tok = sum(len(L.encode(d)) for d in DOCUMENTS)
        print(f"query: {QUERY!r} ({len(query)} tokens); reference: a full re-encode of "
              f"prefix + documents + query ({len(full_toks)} tokens) predicts "
              f"{show_byte(int(np.argmax(full)))}")

        for layout in ("parallel", "sequential"):
            asm = c.assemble(pid, doc_ids, layout=layout, temperature=args.temperature,
                             scale=args.scale)
            print(f"\n{layout} layout: the daemon assembled {asm.kv.n_tokens} tokens; "
                  f"the query goes at position {asm.query_pos}")
            for s in asm.segments:
                if s.kind == "query":
                    continue
                what = "prefix" if s.kind == "prefix" else f"document {s.doc_index + 1}"
                extra = (f", T={s.temperature:g} S={s.scale:g}" if s.kind == "document" else "")
                n_apx = int(asm.kv.approximate[s.start:s.end].sum())
                print(f"  {what:11s} tokens [{s.start}, {s.end}) at positions "
                      f"{s.pos_first}..{s.pos_last}{extra}"
                      + (f", {n_apx} re-rotated (approximate)" if n_apx else ""))
            docs = asm.document_mask()
            if layout == "parallel":
                seg = next(s for s in asm.segments if s.kind == "document")
                attn = ape_attention(docs, seg.temperature, seg.scale, asm.temperature_folded)
                logits = run_query(model, asm, query, attn)
                how = "APE attention from the segment table"
                # The formula's sanity check: T = S = 1 is ordinary softmax attention.
                plain = run_query(model, asm, query)
                one = run_query(model, asm, query, ape_attention(docs, 1.0, 1.0, False))
                chk = float(np.max(np.abs(plain - one)))
                ok = chk <= 1e-9 * max(1.0, float(np.max(np.abs(plain))))
                failed |= not ok
                print(f"  check: APE with T = S = 1 vs ordinary attention: max |diff| = "
                      f"{chk:.2g} -> {'identical' if ok else 'DIFFERENT'}")
            else:
                logits = run_query(model, asm, query)
                how = "ordinary causal attention"
            diff = float(np.max(np.abs(logits - full)))
            agree = int(np.argmax(logits)) == int(np.argmax(full))
            print(f"  ran {len(query)} query tokens with {how}; re-encoded 0 of {n_docs_tok} "
                  f"document tokens")
            print(f"  next-token logits vs. the full re-encode: max |logit diff| = {diff:.4g}; "
                  f"argmax {'agrees' if agree else 'differs'} "
                  f"({show_byte(int(np.argmax(logits)))} vs {show_byte(int(np.argmax(full)))})")
        if failed:
            print("FAILED: APE with T = S = 1 is not ordinary attention", file=sys.stderr)
            return 1
        print("\nOK: documents were encoded once and reused in both layouts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
