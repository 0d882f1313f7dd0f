#!/usr/bin/python3
"""measure.py — what kvrope's approximations cost a trained model: the four
measurements of `make eval` (docs/eval.md), each run through a live kvroped
(every positional and codec operation is the daemon's) and an engine
(eval/engines.py). Debian's /usr/bin/python3.

  pie_case(...)       one edit: full re-encode, PIE, PIE + K refreshed, naive reuse
  docs_case(...)      one RAG-style case: sequential encode, kvrope layouts, none
  quant_case(...)     one file: the prefix's cache stored with each codec
  stream_case(...)    one long file: full cache, window, sinks + window

Cases come from eval/cases.py. Each function returns plain dicts of
per-case numbers; run.py averages them into tables.
"""
import math

import numpy as np

import paths  # noqa: F401  (the repository's Python on sys.path)

import corpus
import engines as E
import llama as L

LN2 = math.log(2.0)
NEWLINE = int(corpus.encode(b"\n", bos=False)[0])
REFRESH_KS = (16, 64, 256)
NL_AFTER = 48


# ---- scores ----------------------------------------------------------------------

def scores(logits, targets, ref=None):
    """Per-position numbers for logits [n][V] predicting targets [n]; with ref
    (the full re-encode's logits at the same positions) also agreement and
    KL(ref || logits) in nats."""
    lp = E.log_softmax(logits)
    n = len(targets)
    out = {"n": n,
           "bits": float(-lp[np.arange(n), targets].sum() / LN2),
           "correct": int((lp.argmax(-1) == targets).sum())}
    if ref is not None:
        rp = E.log_softmax(ref)
        out["agree"] = int((lp.argmax(-1) == rp.argmax(-1)).sum())
        out["kl"] = float((np.exp(rp) * (rp - lp)).sum())
    return out


def cache_of(kvobj):
    """A kvrope get result -> an engine cache (kv, pos)."""
    return [(np.array(k, np.float32), np.array(v, np.float32)) for k, v in kvobj.pairs(float32=True)], \
        np.asarray(kvobj.positions, np.int64).copy()


def empty_cache(engine):
    c = engine.config
    h, d = int(c["num_key_value_heads"]), int(c["head_dim"])
    z = np.zeros((0, h, d), np.float32)
    return [(z, z) for _ in range(int(c["num_hidden_layers"]))], np.zeros(0, np.int64)


# ---- PIE edits -------------------------------------------------------------------

def token_hunks(a, b):
    """Changed regions between token lists a and b: [(a0, a1, b0, b1)] in order."""
    import difflib
    sm = difflib.SequenceMatcher(None, list(a), list(b), autojunk=False)
    return [(i1, i2, j1, j2) for tag, i1, i2, j1, j2 in sm.get_opcodes() if tag != "equal"]


def next_line_at(b, start):
    """(i, line) with b[i] the first newline at or after `start` that has a
    non-blank line after it (ending in a newline), or None."""
    n = len(b)
    i = start
    while i < n:
        if b[i] == NEWLINE:
            j = i + 1
            while j < n and b[j] != NEWLINE:
                j += 1
            if j < n and any(t != corpus.SPACE_ID for t in b[i + 1:j]):
                return i, list(b[i + 1:j + 1])
            i = j
        else:
            i += 1
    return None


def apply_pie(client, engine, model, ctx, A, B, hunks, refresh_k):
    """Forks the cached A into ctx and edits it into B through kvrope, hunk by
    hunk in order: the new tokens are encoded by the engine at the positions
    edit_plan gives, seeing the (edited) cache before them; then the first
    refresh_k tokens after the edit point are recomputed and refreshed.
    Returns (tokens encoded, tokens refreshed)."""
    n_new = n_ref = 0
    shift = 0
    for h, (a0, a1, b0, b1) in enumerate(hunks):
        s, e = a0 + shift, a1 + shift       # this hunk in the context's current indices (== b0)
        assert s == b0
        new = [int(t) for t in B[b0:b1]]
        ops = [(s, e, new)]
        if new:
            plan = client.edit_plan(ctx, ops, model=model)
            pos = plan.positions
            past = cache_of(client.get(ctx, 0, s)) if s > 0 else None
            _, kv = engine.forward(new, pos, past)
            client.edit(ctx, ops, kv=kv, model=model)
            n_new += len(new)
        else:
            client.edit(ctx, ops, model=model)
        shift += (b1 - b0) - (a1 - a0)
        if refresh_k:
            stop = hunks[h + 1][2] if h + 1 < len(hunks) else len(B)
            r1 = min(b1 + refresh_k, stop)
            if r1 > b1:
                info = client.get(ctx, b1, r1, meta_only=True)
                past = cache_of(client.get(ctx, 0, b1))
                _, kv = engine.forward([int(t) for t in B[b1:r1]], info.positions, past)
                client.refresh(ctx, b1, r1, kv=kv, model=model)
                n_ref += r1 - b1
    return n_new, n_ref


def naive_positions(A, B, hunks):
    """For each token of B, the position its cached key was computed at in
    A's encoding (new tokens: their new position): what a cache that knows
    nothing of RoPE would hand the model after the edit."""
    old = np.arange(len(B), dtype=np.int64)
    ai = bi = 0
    for a0, a1, b0, b1 in hunks + [(len(A), len(A), len(B), len(B))]:
        old[bi:b0] = np.arange(ai, a0)          # equal run: B[bi:b0] == A[ai:a0]
        ai, bi = a1, b1                          # new tokens keep their own positions
    return old


def pie_case(client, engine, model, uid, A, B, ks=REFRESH_KS, with_nextline=True):
    """One edit A -> B (token lists with BOS). Rows: full, pie, pie+K, naive."""
    A, B = np.asarray(A, np.int32), np.asarray(B, np.int32)
    hunks = token_hunks(A, B)
    if not hunks:
        raise ValueError("no change")
    first = hunks[0][2]
    targets = B[first + 1:]
    full_lg, full_kv = engine.forward(B, np.arange(len(B)))
    ref = full_lg[first:len(B) - 1]
    rows = {"full": scores(ref, targets, ref)}
    rows["full"]["encoded"] = len(B)
    # the next line is generated from the first line end at least NL_AFTER tokens past
    # the last edit, so that reused suffix cells (stale, or at the wrong positions)
    # lie between the edit and the generation point
    nl = (next_line_at(B, hunks[-1][3] + NL_AFTER) or next_line_at(B, hunks[-1][3])) \
        if with_nextline else None
    full_cache = (full_kv, np.arange(len(B), dtype=np.int64))

    def nextline(cache, r):
        """Greedy from the newline ending the last edited line: whether the
        next line comes out exactly, and how many of its bytes come out
        right before the first miss."""
        if nl is None:
            return
        i, line = nl
        g = engine.greedy(B, cache, i, len(line), NEWLINE)
        same = 0
        while same < min(len(g), len(line)) and int(g[same]) == int(line[same]):
            same += 1
        r["nextline"] = int(same == len(line) and len(g) == len(line))
        r["nl_prefix"] = same
        r["nl_len"] = len(line)

    nextline(full_cache, rows["full"])
    _, kv_a = engine.forward(A, np.arange(len(A)))
    base = f"{uid}-a"
    client.put(base, model, A, kv_a, mode="create")
    try:
        for k in (0,) + tuple(ks):
            ctx = f"{uid}-k{k}"
            client.fork(base, ctx)
            try:
                n_new, n_ref = apply_pie(client, engine, model, ctx, A, B, hunks, k)
                got = client.get(ctx)
                if not np.array_equal(np.asarray(got.tokens), B.astype(np.uint32)):
                    raise AssertionError("kvrope's edited context does not hold B's tokens")
                cache = cache_of(got)
                lg = engine.score_in_cache(B, cache, first)[:len(targets)]
                r = scores(lg, targets, ref)
                r["encoded"] = n_new + n_ref
                nextline(cache, r)
                rows["pie" if k == 0 else f"pie+{k}"] = r
                if k == 0:   # naive reuse: the same cells, keys left where A had them
                    opos = naive_positions(A, B, hunks)
                    stale = client.get(ctx, 0, len(B), positions=opos)
                    ncache = (cache_of(stale)[0], cache[1])
                    lg = engine.score_in_cache(B, ncache, first)[:len(targets)]
                    r = scores(lg, targets, ref)
                    r["encoded"] = n_new
                    nextline(ncache, r)
                    rows["naive"] = r
            finally:
                client.delete(ctx)
    finally:
        client.delete(base)
    return {"rows": rows, "n_tokens": len(B), "n_hunks": len(hunks), "first": first}


# ---- documents (APE) -------------------------------------------------------------

def ape_attention(doc_mask, temperature, scale, folded):
    """APE's attention (docs/ape.md) over a cache whose document keys are
    marked in doc_mask (the new query tokens follow and are never documents)."""
    def attn(q, k, v, mask=None, bias=None, logit_scale=None, **kw):
        tq, h, d = q.shape
        tk, kvh, _ = k.shape
        C = np.zeros(tk, dtype=bool)
        C[:doc_mask.size] = doc_mask
        t = 1.0 if folded else temperature
        rep = h // kvh
        qg = np.asarray(q, np.float64).reshape(tq, kvh, rep, d)
        lg = np.einsum("qgrd,kgd->grqk", qg, np.asarray(k, np.float64)[C]).reshape(h, tq, -1)
        lc = lg * (d ** -0.5) / t
        mx = lc.max(axis=-1, keepdims=True)
        lse_c = (mx + np.log(np.exp(lc - mx).sum(axis=-1, keepdims=True)))[..., 0]
        ls = np.where(C, 1.0 / t, 1.0)
        b = np.zeros((h, tq, tk))
        b[:, :, C] = ((scale * temperature - 1.0) * lse_c)[:, :, None]
        return L.attention(q, k, v, mask=mask, bias=b, logit_scale=ls, **kw)
    return attn


def put_documents(client, engine, model, uid, P, chunks, made):
    """Encodes the prefix P and each chunk after it (positions len(P)..) and
    puts them into kvrope, the chunks as APE documents of the prefix. Every
    id created is appended to `made` (the caller deletes them, also after a
    failure). Returns (prefix id, document ids)."""
    _, kv_p = engine.forward(P, np.arange(len(P)))
    pid = f"{uid}-p"
    client.put(pid, model, P, kv_p, mode="create")
    made.append(pid)
    dids = []
    for i, c in enumerate(chunks):
        pos = len(P) + np.arange(len(c))
        _, kv = engine.forward(c, pos, (kv_p, np.arange(len(P))))
        did = f"{uid}-d{i}"
        client.put(did, model, c, kv, mode="create", prefix=pid, positions=pos)
        made.append(did)
        dids.append(did)
    return pid, dids


def score_assembly(engine, asm, cont, ref=None, attention=None):
    """The continuation decoded after an assembled stream (at its query
    position), scored on cont[1:]."""
    q = asm.query_pos + np.arange(len(cont))
    lg, _ = engine.forward(cont, q, cache_of(asm.kv), attention=attention)
    return scores(lg[:-1], cont[1:], ref)


def docs_case(client, engine, model, uid, prefix, chunks, cont, ape_ts, numpy_ape=True):
    """prefix, chunks (k token lists, no BOS), cont: the continuation. Rows:
    sequential encode (full), kvrope sequential, APE (T, S) [numpy], APE with
    T folded into K (S = 1, at T and at the daemon's default 0.9), parallel,
    none. Scores cont[1:]."""
    P = np.asarray(prefix, np.int32)
    cont = np.asarray(cont, np.int32)
    targets = cont[1:]
    allt = np.concatenate([P] + [np.asarray(c, np.int32) for c in chunks] + [cont])
    lg, _ = engine.forward(allt, np.arange(len(allt)))
    ref = lg[len(allt) - len(cont):-1]
    rows = {"full": scores(ref, targets, ref)}
    nc = np.concatenate([P, cont])
    lg, _ = engine.forward(nc, np.arange(len(nc)))
    rows["none"] = scores(lg[len(P):-1], targets, ref)
    made = []
    try:
        pid, dids = put_documents(client, engine, model, uid, P, chunks, made)

        def run(asm, attention=None):
            return score_assembly(engine, asm, cont, ref, attention)

        rows["sequential"] = run(client.assemble(pid, dids, layout="sequential"))
        rows["parallel"] = run(client.assemble(pid, dids, layout="parallel"))
        T, S = ape_ts
        if numpy_ape and engine.name == "numpy":
            asm = client.assemble(pid, dids, layout="parallel", temperature=T, scale=S)
            rows["ape"] = run(asm, ape_attention(asm.document_mask(), asm.temperature, asm.scale, False))
        asm = client.assemble(pid, dids, layout="parallel", temperature=T, scale=1.0,
                              fold_temperature=True)
        rows["ape_folded"] = run(asm)
        # APE's own default T (the daemon's, 0.9), folded: what an engine without an
        # attention hook (llama.cpp) can apply
        asm = client.assemble(pid, dids, layout="parallel", temperature=0.9, scale=1.0,
                              fold_temperature=True)
        rows["ape_folded_09"] = run(asm)
    finally:
        for d in made:
            client.delete(d)
    return {"rows": rows}


def ape_grid(client, engine, model, uid, cases, Ts, Ss):
    """Mean continuation bits per byte of APE (numpy) for every (T, S)."""
    out = {}
    for ci, (P, chunks, cont) in enumerate(cases):
        cont = np.asarray(cont, np.int32)
        made = []
        try:
            pid, dids = put_documents(client, engine, model, f"{uid}-g{ci}",
                                      np.asarray(P, np.int32), chunks, made)
            for T in Ts:
                for S in Ss:
                    asm = client.assemble(pid, dids, layout="parallel", temperature=T, scale=S)
                    s = score_assembly(engine, asm, cont,
                                       attention=ape_attention(asm.document_mask(), T, S, False))
                    a = out.setdefault((T, S), [0.0, 0])
                    a[0] += s["bits"]
                    a[1] += s["n"]
        finally:
            for d in made:
                client.delete(d)
    return {k: v[0] / v[1] for k, v in out.items()}


# ---- quantization at rest ---------------------------------------------------------

def quant_case(client, engine, model, uid, toks, n_prefix, codecs):
    """The first n_prefix tokens encoded, their cache stored in kvrope with
    each codec, fetched back; the rest scored. Returns per codec: scores,
    bytes per token, the canonical spec; plus 'plain_f16' (the engine run on
    the f16-rounded cache without kvrope) and 'plain_f32'."""
    toks = np.asarray(toks, np.int32)
    pre, rest = toks[:n_prefix], toks[n_prefix:]
    _, kv = engine.forward(pre, np.arange(n_prefix))
    pos = np.arange(n_prefix, dtype=np.int64)
    qpos = n_prefix + np.arange(len(rest))
    out = {}

    def score_with(cache):
        lg, _ = engine.forward(rest, qpos, cache)
        return scores(lg[:-1], rest[1:]), lg

    out["plain_f32"], _ = score_with((kv, pos))
    kv16 = [(k.astype(np.float16).astype(np.float32), v.astype(np.float16).astype(np.float32))
            for k, v in kv]
    out["plain_f16"], lg16 = score_with((kv16, pos))
    out["plain_f16_logits"] = lg16
    for name, spec in codecs:
        ctx = f"{uid}-{name}"
        if spec in ("f16", "bf16", "f32"):
            client.put(ctx, model, pre, kv, mode="create", dtype=spec, codec=spec)
        else:
            client.put(ctx, model, pre, kv, mode="create", codec=spec)
        try:
            info = client.stat_codec(ctx)
            got = client.get(ctx)
            s, lg = score_with(cache_of(got))
            s["bytes_per_token"] = info.kv_bytes / n_prefix
            s["bits_per_value"] = info.bits_per_value
            s["codec"] = info.codec
            s["window"] = info.n_window
            if name == "f16":
                out["f16_logits"] = lg
            out[name] = s
        finally:
            client.delete(ctx)
    return out


# ---- retention (StreamingLLM) -----------------------------------------------------

def stream_case(client, engine, model, uid, toks, policies, chunk=32, score_from=256):
    """toks streamed through kvrope in chunks; before each chunk its cache
    is what the context's retention policy kept. policies: {name: (sinks,
    window) or None (keep all)}. Scores every token predicted at index >=
    score_from; also the part beyond the model's training context."""
    toks = np.asarray(toks, np.int32)
    train_ctx = int(engine.config.get("max_position_embeddings", 512))
    out = {}
    for name, pol in policies.items():
        ctx = f"{uid}-{name}"
        bits = {"all": [0.0, 0], "beyond": [0.0, 0]}
        created = False
        try:
            for s in range(0, len(toks) - 1, chunk):
                c = toks[s:s + chunk + 1]
                new = c[:-1] if len(c) > 1 else c
                if created:
                    cache = cache_of(client.get(ctx))
                    p0 = int(cache[1][-1]) + 1
                else:
                    cache, p0 = None, 0
                pos = p0 + np.arange(len(new))
                lg, kv = engine.forward(new, pos, cache)
                lp = E.log_softmax(lg)
                for j in range(len(new)):
                    i = s + j
                    if i + 1 >= len(toks) or i < score_from:
                        continue
                    b = -lp[j, toks[i + 1]] / LN2
                    bits["all"][0] += b
                    bits["all"][1] += 1
                    if i >= train_ctx:
                        bits["beyond"][0] += b
                        bits["beyond"][1] += 1
                client.put(ctx, model, new, kv, mode="append" if created else "create", positions=pos)
                if not created and pol is not None:
                    client.set_retention(ctx, sinks=pol[0], window=pol[1])
                created = True
        finally:
            if created:
                client.delete(ctx)
        out[name] = {k: {"bits": v[0], "n": v[1]} for k, v in bits.items()}
    return out
