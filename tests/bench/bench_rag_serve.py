#!/usr/bin/python3
"""bench_rag_serve — a RAG request through kvrope serve: cached chunks found
anywhere in the prompt (kvroped's cover), re-rotated into place, their seams
repaired (epic:16, serve's default), against a full prefill and against
llama.cpp's llama-server --cache-reuse 256. Debian's /usr/bin/python3.

Model: the 0.7 B benchmark shape (16 layers, width 2048, f16, seeded random
weights; bench_serve's file). Both servers: 2 threads, context CTX, batch
2048, one at a time on this machine, each a fresh process.

The store holds 1,000 cached chunks of 512 tokens. Eight of them are cached
the way a RAG app caches them, by kvrope serve itself: prompt A is a
200-token question and the eight chunks in order (a full prefill; serve
commits it to kvroped). The other 992 are put straight into kvroped under
the model serve registered (the Python client's put): real 512-token
contexts that the cover's content index holds and searches, but their K/V is
filler (one seeded random block, kept at the k2v2 codec): 992 x 512 tokens of
this shape is 31 GiB at f16, more than this machine holds, and a full
prefill of each would take two hours. The request never reads that K/V: the
tokens are seeded random ids, so no 16-token grain of the request matches a
filler chunk (the cover verifies every hit token by token).

Prompt B_i (i = 1..3) is a new 200-token question and the same eight chunks
in a new order in which no chunk keeps its neighbour. The measured sequence
is the same on both servers: A, then B_1, B_2, B_3, each asking for one
token, each sent as soon as the previous answer arrived (so kvrope's time
includes committing the previous prompt, which its engine does after
answering); time to first token is the client's wall time. llama-server
sees A first as well, so its slot holds the chunks. Its --cache-reuse
(server-context.cpp, v0.5.0) looks for cached runs of >= 256 tokens only
where the prompt stops matching the cache, and moves on in the prompt only
past a run it reused: a prompt that starts with new tokens (the question)
reuses nothing behind them. That is the case measured; llama-server's row
says how many tokens it computed.

Then, on kvrope only: for each B_i, a full prefill (cache_prompt false,
N_CHECK tokens; its TTFT is the wall time less the time of the tokens after
the first, timings.predicted_ms), and whether the cached path's N_CHECK
greedy tokens equal the full prefill's. Random weights give nearly flat
logits, so agreement here is a weak check; the share of the full encode's
gain kept by this path (cover + epic:16) is measured on the trained model by
eval/reuse.py (make eval-reuse's script, docs/eval.md), which runs the same C
cover and repair: this bench runs it on 8 of its cases (about 4 minutes).

Prints a table and `goal:` lines; ratios are measured in this run.
Run: KVR_BUILD=$PWD/build /usr/bin/python3 tests/bench/bench_rag_serve.py
"""
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_serve as S  # noqa: E402  (post, Proc, the model, the peer's build)

ROOT, BUILD = S.ROOT, S.BUILD
N_STORE = int(os.environ.get("KVR_RAG_STORE", "1000"))    # cached chunks in the store
N_DOCS = 8                    # chunks in a request
CHUNK = int(os.environ.get("KVR_RAG_CHUNK", "512"))        # tokens per chunk
QUESTION = 200                # tokens of a request's question
N_B = 3                       # requests B measured
N_CHECK = 8                   # greedy tokens compared with a full prefill
CTX = (QUESTION + N_DOCS * CHUNK + 64 + 511) // 512 * 512   # 4608 with 512-token chunks
BATCH = "2048"
FILLER_CODEC = "kivi:k2v2:r0"  # the 992 filler contexts' K/V at rest
VOCAB = 256                   # the byte tokens of the bench model's vocabulary


def derangement(rng, n):
    """An order of 0..n-1 in which no i is followed by i+1 (no chunk keeps its
    right neighbour) and no i stays in place."""
    while True:
        p = list(range(n))
        rng.shuffle(p)
        if all(p[k] != k for k in range(n)) and \
           all(p[k + 1] != p[k] + 1 for k in range(n - 1)):
            return p


def completion(port, prompt, n_predict, cache_prompt=True):
    t0 = time.monotonic()
    r = S.post(port, "/completion", {"prompt": prompt, "n_predict": n_predict,
                                     "temperature": 0, "top_k": 1,
                                     "cache_prompt": cache_prompt, "return_tokens": True},
               timeout=1800)
    ms = (time.monotonic() - t0) * 1e3
    t, k = r["timings"], r.get("kvrope") or {}     # llama-server has no "kvrope"
    return {"ms": ms, "n": t["prompt_n"], "total": t["prompt_n"] + t["cache_n"],
            "gen_ms": t.get("predicted_ms", 0.0), "tokens": r.get("tokens"),
            "placed": k.get("n_placed"), "repaired": k.get("n_repaired"),
            "runs": k.get("n_runs"), "sync_ms": k.get("sync_ms")}


def fill_store(sock, rng, chunks, n_filler):
    """n_filler filler contexts of CHUNK seeded random tokens under the model
    kvrope serve registered; -> seconds taken."""
    sys.path.insert(0, os.path.join(ROOT, "client", "python"))
    import kvrope
    t0 = time.monotonic()
    with kvrope.Client(sock) as c:
        ms = c.models()
        if len(ms) != 1:
            raise RuntimeError(f"expected the one model kvrope serve registered, got {ms}")
        m = ms[0]
        kv = np.random.default_rng(7).standard_normal(
            (m.n_layers, 2, CHUNK, m.n_kv_heads, m.head_dim), dtype=np.float32).astype(np.float16)
        seen = {tuple(ch[:16]) for ch in chunks}
        for i in range(n_filler):
            toks = [rng.randrange(VOCAB) for _ in range(CHUNK)]
            assert tuple(toks[:16]) not in seen
            c.put(f"rag-filler-{i}", m.name, toks, kv, mode="create", codec=FILLER_CODEC)
    return time.monotonic() - t0


def run(name, proc, prompts_a, prompts_b, before=None, after=None):
    """A, then every B, one token each, on a fresh server -> rows."""
    proc.start()
    try:
        if before:
            before()
        rows = {"A": completion(proc.port, prompts_a, 1), "B": []}
        for b in prompts_b:
            rows["B"].append(completion(proc.port, b, 1))
        if after:
            after(proc.port)
    finally:
        proc.stop()
    print(f"  {name}: A {rows['A']['ms']:,.0f} ms; B " +
          ", ".join(f"{m['n']}/{m['total']} computed {m['ms']:,.0f} ms" for m in rows["B"]),
          flush=True)
    return rows


def gain_kept_from_eval():
    """The trained model's share of the full encode's gain kept by kvrope
    serve's path: eval/reuse.py's cover_epic16 row (kvroped's cover, EPIC's
    16 per run through kvrope-llama repair: the C code serve runs), on 8 of
    its cases; -> (share or None, what was run or why not)."""
    gguf = os.path.join(BUILD, "eval", "kvrope-code.gguf")
    if not os.path.exists(gguf):
        return None, f"{gguf} missing (make eval writes it)"
    cmd = ["/usr/bin/python3", os.path.join(ROOT, "eval", "reuse.py"), "--build", BUILD,
           "--cases", "8", "--no-write"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "KVR_BUILD": BUILD})
    what = "eval/reuse.py --cases 8 --no-write"
    if r.returncode != 0:
        return None, f"{what} failed: {r.stderr.strip()[-300:]}"
    with open(os.path.join(BUILD, "eval", "reuse-llama.json")) as f:
        row = json.load(f)["summary"]["cover_epic16"]
    return float(row["gain_kept"]), what


def main():
    pre = S.prerequisites("bench_rag_serve")
    if not pre:
        return 0
    free_port, llama_server = pre
    model = S.MODEL
    rng = random.Random(27)
    docs = [[rng.randrange(VOCAB) for _ in range(CHUNK)] for _ in range(N_DOCS)]
    qa = [rng.randrange(VOCAB) for _ in range(QUESTION)]
    prompt_a = qa + [t for d in docs for t in d]
    prompts_b, orders = [], []
    for _ in range(N_B):
        order = derangement(rng, N_DOCS)
        orders.append(order)
        prompts_b.append([rng.randrange(VOCAB) for _ in range(QUESTION)] +
                         [t for i in order for t in docs[i]])
    print(f"bench_rag_serve: a store of {N_STORE} cached chunks of {CHUNK} tokens "
          f"({N_DOCS} cached by kvrope serve from prompt A, {N_STORE - N_DOCS} filler contexts "
          f"put directly); requests: a new {QUESTION}-token question and {N_DOCS} chunks in a "
          f"new order ({len(prompt_a)} tokens); model {os.path.basename(model)}, context {CTX}, "
          f"batch {BATCH}, {S.THREADS} threads, one server at a time", flush=True)
    tmp = tempfile.mkdtemp(prefix="kvr-brag-")
    log = open(os.path.join(tmp, "log"), "wb")
    sock = os.path.join(tmp, "k.sock")
    kd = subprocess.Popen([os.path.join(BUILD, "kvroped"), "--socket", sock, "--max-memory",
                           "10G", "--log-level", "warn"], stdout=log, stderr=subprocess.STDOUT)
    while not os.path.exists(sock):
        if kd.poll() is not None:
            raise RuntimeError(f"kvroped exited {kd.returncode}; log in {tmp}")
        time.sleep(0.02)
    rows, checks, fill = {}, [], {}

    def before():
        fill["s"] = fill_store(sock, random.Random(1000), docs, N_STORE - N_DOCS)

    def after(port):
        for b in prompts_b:
            cached = completion(port, b, N_CHECK)
            full = completion(port, b, N_CHECK, cache_prompt=False)
            checks.append({"full_ms": full["ms"] - full["gen_ms"], "full_n": full["n"],
                           "agree": cached["tokens"] == full["tokens"],
                           "first": cached["tokens"][:1] == full["tokens"][:1]})

    try:
        kp = free_port()
        rows["kvrope serve"] = run(
            "kvrope serve", S.Proc([os.path.join(BUILD, "kvrope-llama"), "--model", model,
                                    "--socket", sock, "--threads", S.THREADS, "serve",
                                    "--listen", f"127.0.0.1:{kp}", "--ctx-size", str(CTX),
                                    "--batch-size", BATCH], kp, "kvrope serve", log),
            prompt_a, prompts_b, before, after)
        p = free_port()
        rows["llama-server --cache-reuse 256"] = run(
            "llama-server --cache-reuse 256",
            S.Proc([llama_server, "-m", model, "--host", "127.0.0.1", "--port", str(p), "-t",
                    S.THREADS, "-tb", S.THREADS, "-np", "1", "-c", str(CTX), "-b", BATCH,
                    "--no-warmup", "--cache-reuse", "256",
                    # it caps a slot at the model's training context (4096 in this
                    # file; the prompt is 4,296 tokens); kvrope serve does not
                    "--override-kv", f"llama.context_length=int:{CTX}"],
                   p, "llama-server", log),
            prompt_a, prompts_b)
    finally:
        S.stop_process(kd, 60)
        log.close()
    k, ls = rows["kvrope serve"], rows["llama-server --cache-reuse 256"]
    med = statistics.median
    full_ms = med([c["full_ms"] for c in checks])
    print()
    print(f"filler: {N_STORE - N_DOCS} contexts put in {fill['s']:.1f} s")
    print("| request B (median of 3) | time to first token | prompt tokens computed |")
    print("| --- | --- | --- |")
    n_total = len(prompts_b[0])
    print(f"| full prefill (kvrope serve, cache_prompt false) | {full_ms:,.0f} ms "
          f"| {n_total:,} (100%) |")
    print(f"| llama-server --cache-reuse 256 | {med([m['ms'] for m in ls['B']]):,.0f} ms "
          f"| {med([m['n'] for m in ls['B']]):,.0f} "
          f"({100 * med([m['n'] for m in ls['B']]) / n_total:.1f}%) |")
    print(f"| kvrope serve (cover + epic:16) | {med([m['ms'] for m in k['B']]):,.0f} ms "
          f"| {med([m['n'] for m in k['B']]):,.0f} "
          f"({100 * med([m['n'] for m in k['B']]) / n_total:.1f}%) |")
    print()
    print(f"prompt A (a full prefill on both): kvrope serve {k['A']['ms']:,.0f} ms, "
          f"llama-server {ls['A']['ms']:,.0f} ms")
    for i, (a, b) in enumerate(zip(k["B"], ls["B"])):
        print(f"  B_{i + 1} order {orders[i]}: kvrope {a['n']}/{a['total']} computed "
              f"({a['placed']} placed in {a['runs']} runs, {a['repaired']} repaired) "
              f"{a['ms']:,.0f} ms, of which the prompt's sync {a['sync_ms']:,.0f} ms "
              f"| llama-server {b['n']}/{b['total']} {b['ms']:,.0f} ms | full prefill "
              f"{checks[i]['full_ms']:,.0f} ms | greedy tokens equal to the full prefill's: first "
              f"{'yes' if checks[i]['first'] else 'no'}, first {N_CHECK} "
              f"{'yes' if checks[i]['agree'] else 'no'}")
    sp_full = full_ms / med([m["ms"] for m in k["B"]])
    sp_ls = med([m["ms"] for m in ls["B"]]) / med([m["ms"] for m in k["B"]])
    gain, src = gain_kept_from_eval()
    gain_txt = (f"{100 * gain:.1f}% of the full encode's gain kept on the trained model "
                f"({src})" if gain is not None else f"gain kept not measured: {src}")
    S.goal("a RAG request >= 8x faster than a full prefill at >= 95% of its gain kept "
           "(default repair)", f"{sp_full:.2f}x, {gain_txt}",
           sp_full >= 8 and gain is not None and gain >= 0.95)
    S.goal("a RAG request >= 5x faster than llama-server --cache-reuse 256", f"{sp_ls:.2f}x",
           sp_ls >= 5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
