#!/usr/bin/python3
"""Tests for `kvrope-llama serve` (client/llama/worker_serve*.c): llama-server's
HTTP API on the trained model, kvroped as its cache.

Every test starts what it needs on loopback: a kvroped on a temporary Unix
socket (conftest.Daemon) and the server on a free TCP port, and stops them.
Clients: Python's http.client, a replay of llama.vim's /infill requests, and
the official OpenAI Node SDK (npm `openai`, pinned below, installed into
$KVR_BUILD/npm-openai when missing).

Run: KVR_BUILD=$PWD/build /usr/bin/python3 -m pytest -q tests/python/test_serve.py
Needs build/kvroped, build/kvrope-llama and build/eval/kvrope-code.gguf.
"""
import difflib
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from conftest import BUILD, ROOT, Daemon, free_tcp_port
from procs import wait_health

KVL = os.path.join(BUILD, "kvrope-llama")
MODEL = os.path.join(BUILD, "eval", "kvrope-code.gguf")
OPENAI_VERSION = "4.95.0"

CODE = '''import os
import sys


def read_lines(path):
    with open(path) as f:
        return [line.rstrip("\\n") for line in f]


def count_words(lines):
    total = 0
    for line in lines:
        total += len(line.split())
    return total


def main():
    lines = read_lines(sys.argv[1])
    print(count_words(lines))
'''


def need_build():
    for p in (KVL, MODEL, os.path.join(BUILD, "kvroped")):
        if not os.path.exists(p):
            pytest.skip(f"{p} is not built (make build/kvrope-llama build/eval/kvrope-code.gguf)")


class Server(Daemon):
    """build/kvrope-llama serve on 127.0.0.1:<free port> against a kvroped socket
    (log() and stop() as conftest.Daemon's: SIGTERM, wait, the exit status)."""

    def __init__(self, sock, *flags, port=None, ready_timeout=60.0, model=None):   # noqa: super not called
        need_build()
        self.port = port or free_tcp_port()
        self.dir = tempfile.mkdtemp(prefix="kvr-serve-")
        self.log_path = os.path.join(self.dir, "serve.log")
        self._log = open(self.log_path, "wb")
        env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_ARG_")}
        self.argv = [KVL, "--model", model or MODEL, "--socket", sock, "--threads", "1", "serve",
                     "--listen", f"127.0.0.1:{self.port}", *flags]
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env)
        try:
            wait_health(self.port, self.proc, "serve", ready_timeout)
        except RuntimeError as e:       # exited, or not ready in time (then stopped)
            if self.proc.poll() is None:
                self.stop()
            raise RuntimeError(f"{e}:\n{self.log()}") from None

    def request(self, method, path, body=None, headers=None, timeout=120):
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            if body is not None and not isinstance(body, (bytes, str)):
                body = json.dumps(body)
            c.request(method, path, body=body, headers=headers or {})
            r = c.getresponse()
            return r.status, r.read(), r
        finally:
            c.close()

    def get(self, path, timeout=120):
        st, data, _ = self.request("GET", path, timeout=timeout)
        return st, data

    def post(self, path, obj, headers=None):
        st, data, _ = self.request("POST", path, obj, headers=headers)
        return st, json.loads(data) if data else None

    def stream(self, path, obj):
        """The SSE events of a streamed answer: decoded JSON, or the string [DONE]."""
        st, data, r = self.request("POST", path, obj)
        assert st == 200, data
        assert r.getheader("Content-Type").startswith("text/event-stream")
        events = []
        for block in data.decode().split("\n\n"):
            if not block.strip():
                continue
            assert block.startswith("data: "), block
            payload = block[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
        return events

    def metric(self, name):
        st, data = self.get("/metrics")
        assert st == 200
        for line in data.decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise KeyError(name)


@pytest.fixture
def daemon():
    d = Daemon()
    yield d
    d.stop()


@pytest.fixture
def servers(daemon):
    started = []

    def make(*flags, sock=None, **kw):
        s = Server(sock or daemon.socket, *flags, **kw)
        started.append(s)
        return s
    yield make
    for s in started:
        log = s.log()
        rc = s.stop()
        assert rc == 0, f"serve exited {rc} on SIGTERM:\n{log}"


@pytest.fixture
def server(servers):
    return servers("--ctx-size", "1024", "--batch-size", "256")


def greedy(prompt, n=16, **kw):
    return {"prompt": prompt, "n_predict": n, "temperature": 0, "return_tokens": True, **kw}


def check_error(st, body, code, type_=None):
    assert st == code, body
    e = body["error"]
    assert e["code"] == code and isinstance(e["message"], str) and e["message"]
    if type_:
        assert e["type"] == type_, e


# ---- the plain endpoints ------------------------------------------------------

def test_health_props_models_metrics(server):
    st, data = server.get("/health")
    assert st == 200 and json.loads(data) == {"status": "ok"}
    st, data = server.get("/props")
    p = json.loads(data)
    assert st == 200 and p["default_generation_settings"]["n_ctx"] == 1024
    assert p["total_slots"] == 4 and p["model_path"] == MODEL and p["chat_template"]
    st, data = server.get("/v1/models")
    m = json.loads(data)
    assert st == 200 and m["object"] == "list" and m["data"][0]["id"] == "kvrope-code.gguf"
    assert m["data"][0]["meta"]["n_vocab"] == 267          # 260 + the 7 FIM tokens
    st, data = server.get("/metrics")
    text = data.decode()
    assert st == 200
    for name in ("llamacpp:prompt_tokens_total", "kvrope:prompt_tokens_reused_total",
                 "kvrope:prompt_tokens_computed_total", "kvrope:prompt_tokens_refreshed_total",
                 "kvrope:ttft_seconds_bucket", "kvrope:requests_total", "kvrope:queue_depth"):
        assert name in text, name


def test_tokenize_detokenize_template(server):
    text = "def f(x):\n    return x  # é"
    st, r = server.post("/tokenize", {"content": text})
    assert st == 200 and all(isinstance(t, int) for t in r["tokens"])
    st, d = server.post("/detokenize", {"tokens": r["tokens"]})
    assert st == 200 and d["content"] == text
    st, r2 = server.post("/tokenize", {"content": text, "add_special": True})
    assert r2["tokens"][1:] == r["tokens"] and len(r2["tokens"]) == len(r["tokens"]) + 1
    st, rp = server.post("/tokenize", {"content": "ab", "with_pieces": True})
    assert rp["tokens"] == [{"id": r["tokens"][0] - ord("d") + ord("a"), "piece": "a"},
                            {"id": r["tokens"][0] - ord("d") + ord("b"), "piece": "b"}]
    st, t = server.post("/apply-template", {"messages": [{"role": "user", "content": "hi"}]})
    assert st == 200 and "hi" in t["prompt"] and "<|im_start|>assistant" in t["prompt"]


# ---- completions ----------------------------------------------------------------

def test_completion_fields_and_stream(server):
    st, r = server.post("/completion", greedy(CODE, 12))
    assert st == 200, r
    for k in ("content", "tokens", "id_slot", "stop", "model", "tokens_predicted",
              "tokens_evaluated", "generation_settings", "truncated", "stop_type",
              "stopping_word", "tokens_cached", "timings"):
        assert k in r, k
    t = r["timings"]
    assert t["predicted_n"] == 12 == len(r["tokens"]) and r["stop_type"] == "limit"
    assert t["prompt_n"] + t["cache_n"] == r["tokens_evaluated"]
    ev = server.stream("/completion", greedy(CODE, 12, stream=True))
    assert all(e["stop"] is False for e in ev[:-1]) and ev[-1]["stop"] is True
    assert "".join(e["content"] for e in ev) == r["content"]
    assert ev[-1]["timings"]["cache_n"] > 0       # the same prompt again: from kvroped


def test_cache_hit_equals_no_cache(server):
    """Greedy: a prompt served from kvroped's cache continues exactly as a full
    re-encode (cache_prompt: false) does, token for token."""
    ref = server.post("/completion", greedy(CODE, 24, cache_prompt=False))[1]
    assert ref["timings"]["cache_n"] == 0
    first = server.post("/completion", greedy(CODE, 24))[1]
    hit = server.post("/completion", greedy(CODE, 24))[1]
    assert hit["timings"]["cache_n"] >= hit["tokens_evaluated"] - 1
    assert hit["timings"]["prompt_n"] <= 1
    assert first["tokens"] == ref["tokens"] == hit["tokens"]
    # a longer prompt sharing the cached one as its prefix
    longer = CODE + "\n\nif __name__ == \"__main__\":\n"
    ref2 = server.post("/completion", greedy(longer, 16, cache_prompt=False))[1]
    hit2 = server.post("/completion", greedy(longer, 16))[1]
    assert hit2["timings"]["cache_n"] > 100 and hit2["tokens"] == ref2["tokens"]


def test_stop_words_and_response_fields(server):
    free = server.post("/completion", greedy(CODE, 32))[1]["content"]
    assert len(free) > 4
    word = free[2:4]
    r = server.post("/completion", greedy(CODE, 32, stop=[word]))[1]
    assert r["stop_type"] == "word" and r["stopping_word"] == word
    assert r["content"] == free[:free.index(word)]
    r = server.post("/completion", greedy(CODE, 4, response_fields=[
        "content", "timings/prompt_n", "tokens_cached", "generation_settings/n_predict"]))[1]
    assert set(r) == {"content", "timings/prompt_n", "tokens_cached",
                      "generation_settings/n_predict"}
    assert r["generation_settings/n_predict"] == 4
    # an empty list is no selection (llama-server: the whole answer), stream or not
    r = server.post("/completion", greedy(CODE, 4, response_fields=[]))[1]
    assert "timings" in r and "content" in r and r["stop"] is True
    ev = server.stream("/completion", greedy(CODE, 4, response_fields=[], stream=True))
    assert "timings" in ev[-1] and ev[-1]["stop"] is True


def test_openai_routes(server):
    st, r = server.post("/v1/completions", {"prompt": CODE, "max_tokens": 8, "temperature": 0})
    assert st == 200 and r["object"] == "text_completion"
    assert r["choices"][0]["finish_reason"] == "length" and isinstance(r["choices"][0]["text"], str)
    u = r["usage"]
    assert u["completion_tokens"] == 8 and u["total_tokens"] == u["prompt_tokens"] + 8
    assert "cached_tokens" in u["prompt_tokens_details"]
    ev = server.stream("/v1/completions", {"prompt": CODE, "max_tokens": 8, "temperature": 0,
                                           "stream": True})
    assert ev[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in ev[:-1]) == r["choices"][0]["text"]
    assert ev[-2]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    msgs = [{"role": "system", "content": "You write Python."},
            {"role": "user", "content": "count words"}]
    st, c = server.post("/v1/chat/completions", {"messages": msgs, "max_tokens": 6,
                                                 "temperature": 0})
    assert st == 200 and c["object"] == "chat.completion"
    assert c["choices"][0]["message"]["role"] == "assistant"
    ev = server.stream("/v1/chat/completions", {"messages": msgs, "max_tokens": 6,
                                                "temperature": 0, "stream": True,
                                                "stream_options": {"include_usage": True}})
    assert ev[-1] == "[DONE]" and ev[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in ev[:-1]
                   if e["choices"])
    assert text == c["choices"][0]["message"]["content"]
    assert ev[-2]["choices"] == [] and ev[-2]["usage"]["completion_tokens"] == 6
    assert ev[-2]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_several_completions(server):
    r = server.post("/completion", greedy(CODE, 6, n_cmpl=2))[1]
    assert isinstance(r, list) and len(r) == 2 and [x["index"] for x in r] == [0, 1]
    assert r[0]["tokens"] == r[1]["tokens"]                     # greedy: the same twice
    st, o = server.post("/v1/completions", {"prompt": CODE, "max_tokens": 4, "n": 3,
                                            "temperature": 0})
    assert st == 200 and [c["index"] for c in o["choices"]] == [0, 1, 2]


def test_several_completions_streamed(server):
    """n_cmpl / n > 1 with stream: every completion's events carry its index,
    each ends (stop / finish_reason) once, the texts equal the unstreamed
    ones, and [DONE] and the usage chunk come once, at the end."""
    plain = server.post("/completion", greedy(CODE, 6, n_cmpl=3))[1]
    ev = server.stream("/completion", greedy(CODE, 6, n_cmpl=3, stream=True))
    for k in range(3):
        mine = [e for e in ev if e["index"] == k]
        assert sum(1 for e in mine if e["stop"]) == 1 and mine[-1]["stop"], mine
        assert "".join(e["content"] for e in mine) == plain[k]["content"]
    st, o = server.post("/v1/completions", {"prompt": CODE, "max_tokens": 5, "n": 2,
                                            "temperature": 0})
    ev = server.stream("/v1/completions", {"prompt": CODE, "max_tokens": 5, "n": 2,
                                           "temperature": 0, "stream": True,
                                           "stream_options": {"include_usage": True}})
    assert ev.count("[DONE]") == 1 and ev[-1] == "[DONE]"
    usage = [e for e in ev[:-1] if e.get("usage")]
    assert len(usage) == 1 and usage[0]["choices"] == []
    assert usage[0]["usage"]["completion_tokens"] == 10
    for k in range(2):
        mine = [e["choices"][0] for e in ev[:-1] if e["choices"] and e["choices"][0]["index"] == k]
        assert "".join(c["text"] for c in mine) == o["choices"][k]["text"]
        assert [c["finish_reason"] for c in mine if c["finish_reason"]] == ["length"]
    msgs = [{"role": "user", "content": "count words"}]
    ev = server.stream("/v1/chat/completions", {"messages": msgs, "max_tokens": 4, "n": 2,
                                                "temperature": 0, "stream": True})
    assert ev.count("[DONE]") == 1 and ev[-1] == "[DONE]"
    for k in range(2):
        mine = [e["choices"][0] for e in ev[:-1] if e["choices"][0]["index"] == k]
        assert mine[0]["delta"]["role"] == "assistant" and mine[-1]["finish_reason"]


def test_sampling_seeded(server):
    body = {"prompt": CODE, "n_predict": 16, "temperature": 1.0, "seed": 42, "top_k": 20,
            "top_p": 0.9, "min_p": 0.01, "return_tokens": True}
    a = server.post("/completion", body)[1]
    b = server.post("/completion", body)[1]
    assert a["tokens"] == b["tokens"] and len(a["tokens"]) == 16


# ---- llama.vim ---------------------------------------------------------------

def chunk(name, lines):
    return {"filename": name, "text": "\n".join(lines) + "\n"}


def vim_infill(prefix, suffix, middle, extra, n_predict=128, indent=0):
    """One /infill request exactly as llama.vim builds it."""
    return {"input_prefix": prefix, "input_suffix": suffix, "input_extra": extra,
            "prompt": middle, "n_predict": n_predict, "stop": [], "n_indent": indent,
            "top_k": 40, "top_p": 0.99, "stream": False, "samplers": ["top_k", "top_p", "infill"],
            "cache_prompt": True, "t_max_prompt_ms": 500, "t_max_predict_ms": 1000,
            "response_fields": ["content", "timings/prompt_n", "timings/prompt_ms",
                                "timings/prompt_per_token_ms", "timings/prompt_per_second",
                                "timings/predicted_n", "timings/predicted_ms",
                                "timings/predicted_per_token_ms", "timings/predicted_per_second",
                                "truncated", "tokens_cached"]}


def vim_ring_warmup(extra):
    """llama.vim's ring update: the chunks alone, n_predict 0, to warm the cache."""
    return {"input_prefix": "", "input_suffix": "", "input_extra": extra, "prompt": "",
            "n_predict": 0, "temperature": 0.0, "stream": False, "samplers": ["temperature"],
            "cache_prompt": True, "t_max_prompt_ms": 1, "t_max_predict_ms": 1,
            "response_fields": [""]}


def test_llama_vim_replay(server):
    lines = CODE.splitlines()
    ring = [chunk("util.py", ["def helper_%d(x):" % i, "    return x * %d" % i, ""])
            for i in range(4)]
    st, r = server.post("/infill", vim_ring_warmup(ring))
    assert st == 200 and r == {}
    # typing in main(): the cursor moves down line by line, the ring stays
    for cur in (14, 15, 16):
        prefix = "\n".join(lines[:cur]) + "\n"
        suffix = "\n".join(lines[cur + 1:]) + "\n"
        st, r = server.post("/infill", vim_infill(prefix, suffix, "    ", ring, indent=4))
        assert st == 200, r
        assert set(r) == {"content", "timings/prompt_n", "timings/prompt_ms",
                          "timings/prompt_per_token_ms", "timings/prompt_per_second",
                          "timings/predicted_n", "timings/predicted_ms",
                          "timings/predicted_per_token_ms", "timings/predicted_per_second",
                          "truncated", "tokens_cached"}
        assert r["tokens_cached"] > 0 and r["truncated"] is False
        # the ring (warmed above) and the lines before the cursor come from kvroped
        assert r["timings/prompt_n"] < r["tokens_cached"]
    # the ring evicts its oldest chunk and takes a new one: warm-up, then a request
    ring2 = ring[1:] + [chunk("io.py", ["def load(p):", "    return open(p).read()", ""])]
    st, r = server.post("/infill", vim_ring_warmup(ring2))
    assert st == 200
    prefix = "\n".join(lines[:16]) + "\n"
    st, r = server.post("/infill", vim_infill(prefix, "", "", ring2, n_predict=8))
    assert st == 200 and r["timings/predicted_n"] <= 8
    # n_indent: a completion never continues on a line indented less than asked
    st, r = server.post("/infill", {**vim_infill(prefix, "", "    ", ring2, indent=8),
                                    "response_fields": None})
    assert st == 200
    for line in r["content"].split("\n")[1:]:
        if line.strip():
            assert len(line) - len(line.lstrip(" \t")) >= 8, r["content"]


REUSE_CHUNKS = [
    chunk("textwrap_helpers.py", ["def indent(text, prefix, predicate=None):",
                                  "    if predicate is None:",
                                  "        def predicate(line):",
                                  "            return line.strip()",
                                  "    return ''.join(prefix + l if predicate(l) else l",
                                  "                   for l in text.splitlines(True))"]),
    chunk("paths.py", ["import os", "", "def walk_py(root):",
                       "    for d, _, files in os.walk(root):",
                       "        for f in files:",
                       "            if f.endswith('.py'):",
                       "                yield os.path.join(d, f)"]),
    chunk("counts.py", ["def count_words(lines):", "    total = 0", "    for line in lines:",
                        "        total += len(line.split())", "    return total"]),
]


def reuse_infill(extra, slot, **kw):
    return {"input_prefix": "def main(root):\n    for path in ", "input_suffix": "\n",
            "input_extra": extra, "prompt": "", "n_predict": 12, "temperature": 0,
            "samplers": ["temperature"], "id_slot": slot, **kw}


@pytest.mark.parametrize("repair", ["default", "all"])
def test_reuse_anywhere_input_extra(servers, repair):
    """input_extra chunks cached by one request are found by content in
    another order in the next one (another slot, so neither the slot's session
    nor the prefix holds them): the daemon's cover places them, the seams are
    repaired, cache_n > 0 and the answer is whole; with every placed token
    repaired (--repair all) the greedy answer is a full encode's (and cache_n
    is 0: the placed KV was all recomputed)."""
    flags = ["--ctx-size", "2048", "--batch-size", "1024", "--parallel", "2"]
    s = servers(*flags, *(["--repair", "all"] if repair == "all" else []))
    st, first = s.post("/infill", reuse_infill(REUSE_CHUNKS, 0))
    assert st == 200, first
    moved = [REUSE_CHUNKS[2], REUSE_CHUNKS[0], REUSE_CHUNKS[1]]
    st, ref = s.post("/infill", reuse_infill(moved, 1, cache_prompt=False))
    assert st == 200, ref
    st, r = s.post("/infill", reuse_infill(moved, 1))
    assert st == 200, r
    k = r["kvrope"]
    assert k["source"] == "cover", k
    assert k["n_placed"] > 100 and k["n_runs"] >= 1, k
    assert r["timings"]["cache_n"] + r["timings"]["prompt_n"] == r["tokens_evaluated"]
    assert s.metric("kvrope:prompt_tokens_placed_total") >= k["n_placed"]
    if repair == "all":
        # every placed token recomputed: nothing of the cache's KV is used
        assert k["n_repaired"] == k["n_placed"] and r["timings"]["cache_n"] == 0
        assert r["content"] == ref["content"], (r["content"], ref["content"])
    else:
        assert r["timings"]["cache_n"] > 0
        assert 0 < k["n_repaired"] <= 16 * k["n_runs"], k
        assert s.metric("kvrope:prompt_tokens_repaired_total") >= k["n_repaired"]
        assert isinstance(r["content"], str)


def test_reuse_anywhere_chat_documents(server):
    """An OpenAI chat whose system prompt changed above documents pasted into
    the user's message, in another order: no prefix of the earlier prompt
    survives past the system line, yet the documents' KV is found by content
    (the cover), placed and repaired, and the answer is whole; three turns in
    a row, each with a new system prompt and order."""
    docs = [c["text"] for c in REUSE_CHUNKS]

    def chat(system, order):
        msgs = [{"role": "system", "content": system},
                {"role": "user", "content": "Documents:\n" + "\n".join(docs[i] for i in order) +
                 "\nWhich function counts words?"}]
        return server.post("/v1/chat/completions", {"messages": msgs, "max_tokens": 6,
                                                    "temperature": 0})
    st, c = chat("You answer questions about code.", [0, 1, 2])
    assert st == 200, c
    assert c["usage"]["prompt_tokens"] > 300
    placed = server.metric("kvrope:prompt_tokens_placed_total")
    for system, order in (("Answer briefly.", [2, 0, 1]), ("Be precise, cite the file.", [1, 2, 0]),
                          ("You review Python.", [0, 2, 1])):
        st, c = chat(system, order)
        assert st == 200, c
        assert c["choices"][0]["finish_reason"] in ("length", "stop")
        assert isinstance(c["choices"][0]["message"]["content"], str)
        # most of the prompt came from the cache, not from a prefix of the last turn
        assert c["usage"]["prompt_tokens_details"]["cached_tokens"] > 200, c["usage"]
        now = server.metric("kvrope:prompt_tokens_placed_total")
        assert now - placed > 200, (system, now - placed)
        placed = now


def test_infill_layout_truncation(servers):
    """/infill lays the prompt out as llama-server does, for this model's FIM
    tokens: the repo-level form (FIM_REP, FIM_SEP and file names), then
    FIM_PRE prefix FIM_SUF suffix FIM_MID, prefix and chunks cut by its
    budgets (3/4 of the batch for the prefix, n_ctx - batch - 2 n_predict for
    the chunks, where n_predict is the server's default, -1, whatever the
    request asks). eval/fim.py's format_infill is a token-for-token copy of
    llama-server v0.5.0's builder: the prompt lengths must be its."""
    sys.path.insert(0, os.path.join(ROOT, "eval"))
    import fim
    s = servers("--ctx-size", "512", "--batch-size", "128")
    big = "x = 1\n" * 200                      # 1200 tokens
    st, r = s.post("/infill", {"input_prefix": big, "input_suffix": "", "prompt": "",
                               "n_predict": 1, "temperature": 0})
    assert st == 200, r
    want = fim.format_infill(big.encode(), b"", b"", [], n_batch=128, n_ctx=512, n_predict=-1)
    assert r["tokens_evaluated"] == len(want) == 1 + 1 + 96 + 1 + 1 + 21
    extra = [{"filename": "a.py", "text": big}]
    st, r = s.post("/infill", {"input_prefix": "y = 2\n", "input_extra": extra, "prompt": "",
                               "n_predict": 8, "temperature": 0})
    assert st == 200, r
    want = fim.format_infill(b"y = 2\n", b"", b"", [("a.py", big)], n_batch=128, n_ctx=512,
                             n_predict=-1)
    assert r["tokens_evaluated"] == len(want)
    # the chunks' budget does not depend on the request's n_predict
    for n in (0, 64):
        st, r2 = s.post("/infill", {"input_prefix": "y = 2\n", "input_extra": extra, "prompt": "",
                                    "n_predict": n, "temperature": 0})
        assert st == 200, r2
        assert r2["tokens_evaluated"] == len(want)
    # started with -n 8, as llama-server's -n: the budget and a request's default
    s8 = servers("--ctx-size", "512", "--batch-size", "128", "--n-predict", "8")
    st, r = s8.post("/infill", {"input_prefix": "y = 2\n", "input_extra": extra, "prompt": "",
                                "temperature": 0, "ignore_eos": True})
    assert st == 200, r
    assert r["tokens_evaluated"] == len(fim.format_infill(
        b"y = 2\n", b"", b"", [("a.py", big)], n_batch=128, n_ctx=512, n_predict=8))
    assert r["tokens_predicted"] == 8
    st, props = s8.get("/props")
    assert json.loads(props)["default_generation_settings"]["params"]["n_predict"] == 8


@pytest.mark.parametrize("flag", ["--spm-infill", "--no-spm-infill", None])
def test_infill_spm_layout(servers, flag):
    """--spm-infill lays /infill out suffix first, as llama-server's flag does
    (eval/fim.py format_infill(spm=True)); --no-spm-infill prefix first;
    without either, the order the model was trained on (eval/model's
    config.json fim_order, which scripts/gen-gguf.py writes into the GGUF as
    kvrope.infill.spm). Compared token for token through the cache: a
    /completion whose prompt is the expected token list, sent to the same
    slot, finds all of it but the last token cached (it is decoded again for
    its logits); the other order would match only up to its first FIM token
    (a daemon each: neither order is in kvroped before its server sends it)."""
    with open(os.path.join(ROOT, "eval", "model", "config.json")) as f:
        trained_spm = json.load(f).get("fim_order", "psm") == "spm"
    spm = flag == "--spm-infill" or (flag is None and trained_spm)
    sys.path.insert(0, os.path.join(ROOT, "eval"))
    import fim
    req = {"input_prefix": "def add(a, b):\n    return ", "input_suffix": "\n\nprint(add(1, 2))\n",
           "prompt": "a", "n_predict": 1, "temperature": 0, "id_slot": 0}
    s = servers("--ctx-size", "512", "--batch-size", "128", *([flag] if flag else []))
    st, r = s.post("/infill", req)
    assert st == 200, r
    want = fim.format_infill(req["input_prefix"].encode(), req["input_suffix"].encode(), b"a", [],
                             n_batch=128, n_ctx=512, n_predict=1, spm=spm)
    assert r["tokens_evaluated"] == len(want)
    st, c = s.post("/completion", {"prompt": want, "n_predict": 1, "temperature": 0, "id_slot": 0})
    assert st == 200, c
    assert c["timings"]["cache_n"] == len(want) - 1, (spm, c["timings"])
    other = fim.format_infill(req["input_prefix"].encode(), req["input_suffix"].encode(), b"a", [],
                              n_batch=128, n_ctx=512, n_predict=1, spm=not spm)
    st, c = s.post("/completion", {"prompt": other, "n_predict": 1, "temperature": 0, "id_slot": 0})
    assert st == 200, c
    assert c["timings"]["cache_n"] < len(want) - 1, (spm, c["timings"])


def test_infill_layout_from_the_model(servers, tmp_path):
    """A GGUF that says it was trained suffix first (kvrope.infill.spm, written
    by scripts/gen-gguf.py --spm-infill) gets the SPM layout without the flag;
    --no-spm-infill still lays it out prefix first."""
    sys.path.insert(0, os.path.join(ROOT, "eval"))
    import fim
    gguf = str(tmp_path / "spm.gguf")
    subprocess.run(["/usr/bin/python3", os.path.join(ROOT, "scripts", "gen-gguf.py"), "-o", gguf,
                    "--hf", os.path.join(ROOT, "eval", "model"), "--dtype", "f16", "--spm-infill"],
                   check=True, capture_output=True)
    req = {"input_prefix": "x = 1\n", "input_suffix": "\ny = 2\n", "prompt": "z", "n_predict": 1,
           "temperature": 0, "id_slot": 0}
    for flags, spm in (((), True), (("--no-spm-infill",), False)):
        s = servers("--ctx-size", "512", "--batch-size", "128", *flags, model=gguf)
        assert ("trained suffix first" in s.log()) == spm, s.log()
        st, r = s.post("/infill", req)
        assert st == 200, r
        want = fim.format_infill(b"x = 1\n", b"\ny = 2\n", b"z", [], n_batch=128, n_ctx=512, n_predict=1,
                                 spm=spm)
        st, c = s.post("/completion", {"prompt": want, "n_predict": 1, "temperature": 0, "id_slot": 0})
        assert st == 200, c
        assert c["timings"]["cache_n"] == len(want) - 1, (flags, c["timings"])


# ---- the cache across processes --------------------------------------------------

def test_persist_survives_a_daemon_restart(tmp_path):
    """make run's restart: kvroped (with --disk-dir) and the server (--persist)
    both stopped and started again; the next request takes its prompt from the
    disk tier. Then an edit of the restored session, and a second restart. On a
    daemon without a disk tier --persist is ignored and the cache still works."""
    disk = str(tmp_path / "disk")
    body = greedy(CODE, 8)
    edited = greedy(CODE.replace("total = 0", "total = 0  # words"), 8)
    d = Daemon("--disk-dir", disk)
    s = Server(d.socket, "--persist")
    try:
        first = s.post("/completion", body)[1]
        n = first["tokens_evaluated"]
        assert first["timings"]["cache_n"] < 5
    finally:
        assert s.stop() == 0, s.log()
        assert d.stop() == 0
    for round_ in range(2):
        d = Daemon("--disk-dir", disk)
        s = Server(d.socket, "--persist")
        try:
            again = s.post("/completion", body if round_ == 0 else edited)[1]
            assert again["timings"]["cache_n"] >= n - 40, (round_, again["timings"])
            if round_ == 0:
                assert again["tokens"] == first["tokens"]
                assert again["timings"]["cache_n"] == n - 1
        finally:
            assert s.stop() == 0, s.log()
            assert d.stop() == 0
    d = Daemon()                                      # no disk tier: --persist is ignored
    s = Server(d.socket, "--persist")
    try:
        a = s.post("/completion", body)[1]
        b = s.post("/completion", body)[1]
        assert a["tokens"] == b["tokens"] == first["tokens"]
        assert b["timings"]["cache_n"] == n - 1
        assert "no disk tier" in s.log()
    finally:
        assert s.stop() == 0, s.log()
        assert d.stop() == 0


def test_restart_and_two_servers(daemon, servers):
    a = servers()
    body = greedy(CODE, 8)
    first = a.post("/completion", body)[1]
    assert first["timings"]["cache_n"] == 0 or first["timings"]["cache_n"] < 5
    port = a.port
    assert a.stop() == 0
    a2 = servers(port=port)                       # restart: the cache is in kvroped
    again = a2.post("/completion", body)[1]
    assert again["timings"]["cache_n"] >= again["tokens_evaluated"] - 1
    assert again["tokens"] == first["tokens"]
    b = servers()                                 # a second server on the same daemon
    other = b.post("/completion", body)[1]
    assert other["timings"]["cache_n"] >= other["tokens_evaluated"] - 1
    assert other["tokens"] == first["tokens"]
    assert a2.metric("kvrope:prompt_tokens_reused_total") > 0


def test_five_consecutive_edits(server):
    """One file edited five times: every version answered, the cached part
    reported (prompt_n + cache_n = the prompt), at least the unchanged prefix
    reused, and the greedy tokens of an unchanged prompt stable."""
    text = CODE
    prev = None
    edits = [("total = 0", "total = 0  # words"), ("def main():", "def main(argv=None):"),
             ("import sys\n", "import sys\nimport re\n"), ("    return total", "    return int(total)"),
             ("print(count_words(lines))", "print(count_words(lines), file=sys.stdout)")]
    for old, new in edits:
        text = text.replace(old, new, 1)
        st, toks = server.post("/tokenize", {"content": text, "add_special": True})
        r = server.post("/completion", greedy(text, 4))[1]
        t = r["timings"]
        assert t["prompt_n"] + t["cache_n"] == len(toks["tokens"]) == r["tokens_evaluated"]
        if prev:
            same = 0
            while same < min(len(prev), len(toks["tokens"])) and prev[same] == toks["tokens"][same]:
                same += 1
            assert t["cache_n"] >= min(same, len(toks["tokens"]) - 1)
            # the file's slot (prefix + suffix similarity), its session edited in
            # place: only the new tokens, the refresh after each edit point and
            # the last token are computed (hunks closer than 8 tokens are one op)
            k = r["kvrope"]
            assert r["id_slot"] == slot and k["source"].endswith("-s%d" % slot), (r["id_slot"], k)
            sm = difflib.SequenceMatcher(None, prev, toks["tokens"], autojunk=False)
            new_toks = sum(j2 - j1 for op, _, _, j1, j2 in sm.get_opcodes() if op != "equal")
            assert k["n_ops"] >= 1
            assert t["prompt_n"] <= new_toks + k["n_refreshed"] + 1 + 8 * k["n_ops"], (new_toks, k)
        else:
            slot = r["id_slot"]
        prev = toks["tokens"]
    # idle: the background refresh re-encodes what the edits left approximate,
    # and then the cached file continues exactly as a full re-encode
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        slots = json.loads(server.get("/slots")[1])
        if all(s["kvrope"]["n_approximate"] == 0 for s in slots):
            break
        time.sleep(0.2)
    assert all(s["kvrope"]["n_approximate"] == 0 for s in slots), slots
    ref = server.post("/completion", greedy(text, 8, cache_prompt=False))[1]
    again = server.post("/completion", greedy(text, 8))[1]
    assert again["timings"]["cache_n"] >= again["tokens_evaluated"] - 1
    assert ref["tokens"] == again["tokens"]


def test_four_concurrent_requests(server):
    prompts = [CODE, CODE + "\n# a\n", "def add(a, b):\n", "class Stack:\n    def __init__(self):\n"]
    refs = [server.post("/completion", greedy(p, 12, cache_prompt=False))[1]["tokens"]
            for p in prompts]
    out = [None] * 4

    def go(i):
        out[i] = server.post("/completion", greedy(prompts[i], 12))
    th = [threading.Thread(target=go, args=(i,)) for i in range(4)]
    for t in th:
        t.start()
    for t in th:
        t.join(120)
    for i in range(4):
        st, r = out[i]
        assert st == 200 and r["tokens"] == refs[i]


def two_streams(server, prompts, n, **kw):
    """Two streamed greedy generations sent at once (id_slot 0 and 1): their
    texts, and the order in which their events arrived (0s and 1s)."""
    arrivals, texts, lock = [], ["", ""], threading.Lock()

    def go(i):
        c = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
        c.request("POST", "/completion", body=json.dumps(
            greedy(prompts[i], n, ignore_eos=True, stream=True, id_slot=i, **kw)))
        r = c.getresponse()
        assert r.status == 200
        buf = b""
        while True:
            chunk = r.read1(65536)
            if not chunk:
                break
            buf += chunk
            while b"\n\n" in buf:
                ev, buf = buf.split(b"\n\n", 1)
                e = json.loads(ev[len(b"data: "):])
                with lock:
                    arrivals.append(i)
                    texts[i] += e["content"]
        c.close()
    th = [threading.Thread(target=go, args=(i,)) for i in range(2)]
    for t in th:
        t.start()
    for t in th:
        t.join(120)
    return texts, arrivals


def interleaved(arrivals):
    first0, last0 = arrivals.index(0), len(arrivals) - 1 - arrivals[::-1].index(0)
    first1, last1 = arrivals.index(1), len(arrivals) - 1 - arrivals[::-1].index(1)
    return first1 < last0 and first0 < last1


PAIR = ["def add(a, b):\n", "class Stack:\n    def __init__(self):\n"]


def test_slots_decode_together(server):
    """--parallel: two streamed generations on two slots decode together
    (continuous batching): the second's tokens arrive while the first is
    still generating, and both are what each gives alone (greedy)."""
    n = 200
    alone = [server.post("/completion", greedy(p, n, ignore_eos=True, cache_prompt=False))[1]
             ["content"] for p in PAIR]
    texts, arrivals = two_streams(server, PAIR, n)
    assert texts == alone
    assert interleaved(arrivals), arrivals


def test_kv_size_bounds_the_slots_generating(servers):
    """--kv-size holds kv_size / ctx - 1 generations beside the prompt being
    prepared: with room for one, two requests on two slots take turns (and
    still give what each gives alone); a cache that cannot hold two
    contexts is refused at start."""
    s = servers("--ctx-size", "512", "--kv-size", "1024")
    alone = [s.post("/completion", greedy(p, 120, ignore_eos=True, cache_prompt=False))[1]
             ["content"] for p in PAIR]
    texts, arrivals = two_streams(s, PAIR, 120)
    assert texts == alone
    assert not interleaved(arrivals), arrivals
    with pytest.raises(RuntimeError, match="cannot hold two contexts"):
        servers("--ctx-size", "512", "--kv-size", "600")


def test_slots_save_restore_erase(server):
    body = greedy(CODE, 4, id_slot=2)
    server.post("/completion", body)
    st, slots = server.get("/slots")
    slots = json.loads(slots)
    assert st == 200 and len(slots) == 4 and slots[2]["id"] == 2 and slots[2]["n_ctx"] == 1024
    st, r = server.post("/slots/2?action=save", {"filename": "code.bin"})
    assert st == 200 and r["id_slot"] == 2 and r["n_saved"] > 0, r
    st, r = server.post("/slots/2?action=erase", {})
    assert st == 200 and r["n_erased"] > 0
    st, r = server.post("/slots/1?action=restore", {"filename": "code.bin"})
    assert st == 200 and r["n_restored"] > 0, r
    r = server.post("/completion", greedy(CODE, 4, id_slot=1))[1]
    assert r["timings"]["cache_n"] > 0
    st, r = server.post("/slots/1?action=restore", {"filename": "nothing.bin"})
    check_error(st, r, 404)
    st, r = server.post("/slots/9?action=save", {"filename": "x.bin"})
    check_error(st, r, 400)
    st, r = server.post("/slots/1?action=save", {"filename": "../x"})
    check_error(st, r, 400)


def test_samplers_as_llama_server_names_them(server):
    """The default chain and the penalty fields in /props; sampler names in
    llama.cpp's spellings and as a string of letters; a presence penalty
    that forbids every token of the window makes greedy output avoid them
    (the chain's arithmetic is tests/llama/test_llama_sample.c's)."""
    p = json.loads(server.get("/props")[1])["default_generation_settings"]["params"]
    assert p["samplers"] == ["penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p",
                             "xtc", "temperature"]
    assert p["repeat_last_n"] == 64 and p["repeat_penalty"] == 1 and p["dry_multiplier"] == 0
    assert p["dry_sequence_breakers"] == ["\n", ":", "\"", "*"]
    base = server.post("/completion", greedy(CODE, 8))[1]["tokens"]
    for samplers in (["Top-K", "temp"], ["topk", "min_p", "temperature"], "kt", "kpmt"):
        st, r = server.post("/completion", greedy(CODE, 8, samplers=samplers))
        assert st == 200 and r["tokens"] == base, samplers   # greedy: none drops the best
    # unknown names are skipped, as llama-server does
    st, r = server.post("/completion", greedy(CODE, 8, samplers=["no_such", "temperature"]))
    assert st == 200 and r["tokens"] == base
    ids = server.post("/tokenize", {"content": CODE})[1]["tokens"]
    st, r = server.post("/completion", greedy(CODE, 12, presence_penalty=1e9, repeat_last_n=1024))
    assert st == 200
    seen = list(ids)
    for t in r["tokens"]:
        assert t not in seen, (t, r["tokens"])
        seen.append(t)
    # huge windows are clamped, not refused
    st, r = server.post("/completion", greedy(CODE, 4, dry_penalty_last_n=1e300, repeat_last_n=1e20))
    assert st == 200 and len(r["tokens"]) == 4
    # a window of 0 is no penalty: the plain greedy output
    st, r = server.post("/completion", greedy(CODE, 8, presence_penalty=1e9, repeat_last_n=0))
    assert r["tokens"] == base


# ---- bad input -------------------------------------------------------------------

def test_bad_input(server):
    st, data, _ = server.request("POST", "/completion", b"{not json")
    check_error(st, json.loads(data), 400, "invalid_request_error")
    st, data, _ = server.request("POST", "/completion", b"[1, 2]")
    check_error(st, json.loads(data), 400)
    cases = [
        {"prompt": 5},
        {"prompt": "x", "n_predict": "many"},
        {"prompt": "x", "n_predict": -5},
        {"prompt": "x", "n_predict": 1.5},
        {"prompt": "x", "temperature": "hot"},
        {"prompt": "x", "stop": 3},
        {"prompt": "x", "stop": [1]},
        {"prompt": "x", "stream": "yes"},
        {"prompt": "x", "id_slot": 99},
        {"prompt": "x", "id_slot": -7},
        {"prompt": [1, 99999]},
        {"prompt": [1, -1]},
        {"prompt": ["a", "b"]},
        {"prompt": "x", "samplers": 5},
        {"prompt": "x", "samplers": ["top_k", 3]},
        {"prompt": "x", "repeat_last_n": -1},
        {"prompt": "x", "dry_allowed_length": 1.5},
        {"prompt": "x", "dry_base": "x"},
        {"prompt": "x", "dry_sequence_breakers": []},
        {"prompt": "x", "dry_sequence_breakers": "\n"},
        {"prompt": "x", "dry_sequence_breakers": ["\n", 4]},
        {"prompt": "x", "repeat_penalty": 0},
        {"prompt": "x", "repeat_penalty": -1.5},
        {"prompt": "x", "presence_penalty": 1e39},
        {"prompt": "x", "dry_multiplier": -1e300},
        {"prompt": "x", "n_cmpl": 9},
        {"prompt": "x", "n_cmpl": 0},
        {},
    ]
    for c in cases:
        st, r = server.post("/completion", c)
        check_error(st, r, 400, "invalid_request_error")
    st, r = server.post("/completion", {"prompt": "x" * 3000})
    check_error(st, r, 400, "exceed_context_size_error")
    assert r["error"]["n_ctx"] == 1024 and r["error"]["n_prompt_tokens"] > 1024
    for path, body in [("/infill", {"input_extra": "nope"}),
                       ("/infill", {"input_extra": [{"text": 1}]}),
                       ("/infill", {"input_prefix": 3}),
                       ("/v1/chat/completions", {"messages": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"content": "hi"}]}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}),
                       ("/v1/completions", {"prompt": "x", "max_tokens": "z"}),
                       ("/tokenize", {"content": 3}),
                       ("/detokenize", {"tokens": ["a"]}),
                       ("/detokenize", {"tokens": [100000]}),
                       ("/apply-template", {"messages": []})]:
        st, r = server.post(path, body)
        check_error(st, r, 400)
    st, data, _ = server.request("GET", "/nowhere")
    check_error(st, json.loads(data), 404, "not_found_error")
    # an oversized body: 413, the server unharmed
    st, data, _ = server.request("POST", "/completion", b"x" * (17 << 20))
    check_error(st, json.loads(data), 413)
    # n_predict huge: bounded by the context
    st, r = server.post("/completion", greedy("def f():\n", 10 ** 12))
    assert st == 200 and r["tokens_predicted"] <= 1024
    # everything still works, and the cache still holds what it held
    assert server.post("/completion", greedy(CODE, 4))[0] == 200
    assert server.post("/completion", greedy(CODE, 4))[1]["timings"]["cache_n"] > 0


def test_vanishing_client_cancels(server):
    body = json.dumps({"prompt": CODE, "n_predict": -1, "temperature": 0, "stream": True,
                       "ignore_eos": True,
                       "stop": ["\x01never"]}).encode()
    # Clients that read the first bytes of a stream and go away, until one is
    # seen cancelled (a loaded machine may finish a generation first).
    deadline = time.monotonic() + 90
    while server.metric("kvrope:requests_cancelled_total") < 1 and time.monotonic() < deadline:
        s = socket.create_connection(("127.0.0.1", server.port))
        s.sendall(b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body)
        s.recv(64)
        s.close()
        wait = time.monotonic() + 5
        while server.metric("kvrope:requests_cancelled_total") < 1 and time.monotonic() < wait:
            time.sleep(0.05)
    assert server.metric("kvrope:requests_cancelled_total") >= 1
    # a slow client that sends half a request and goes away
    s = socket.create_connection(("127.0.0.1", server.port))
    s.sendall(b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"pro")
    s.close()
    assert server.post("/completion", greedy(CODE, 4))[0] == 200


def test_api_key(servers, tmp_path):
    kf = tmp_path / "keys"
    kf.write_text("sekrit\n")
    s = servers("--api-key-file", str(kf))
    assert s.get("/health")[0] == 200 and s.get("/v1/models")[0] == 200
    st, r = s.post("/completion", greedy("x", 1))
    check_error(st, r, 401, "authentication_error")
    st, r = s.post("/completion", greedy("x", 1), headers={"Authorization": "Bearer sekrit"})
    assert st == 200


# ---- kvroped going away and coming back ------------------------------------------

def test_daemon_unreachable_then_back():
    need_build()
    d = tempfile.mkdtemp(prefix="kvr-sv-")
    sock = os.path.join(d, "k.sock")

    def daemon():
        return subprocess.Popen([os.path.join(BUILD, "kvroped"), "--socket", sock,
                                 "--max-memory", "256M", "--log-level", "warn"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def wait_sock():
        for _ in range(500):
            if os.path.exists(sock):
                try:
                    c = socket.socket(socket.AF_UNIX)
                    c.connect(sock)
                    c.close()
                    return
                except OSError:
                    pass
            time.sleep(0.02)
        raise RuntimeError("kvroped did not start")
    s = Server(sock)                              # no kvroped yet: answers anyway
    kd = None
    try:
        st, r = s.post("/completion", greedy(CODE, 4))
        assert st == 200 and r["timings"]["cache_n"] == 0
        kd = daemon()
        wait_sock()
        time.sleep(1.1)                           # reconnects are at most once a second
        assert s.post("/completion", greedy(CODE, 4))[0] == 200
        assert s.post("/completion", greedy(CODE, 4))[1]["timings"]["cache_n"] > 0
        kd.send_signal(signal.SIGTERM)
        kd.wait(15)
        st, r = s.post("/completion", greedy(CODE, 4))
        assert st == 200 and r["timings"]["cache_n"] == 0
        assert s.metric("kvrope:cache_unavailable_total") >= 1
        kd = daemon()
        wait_sock()
        time.sleep(1.1)                           # reconnects are at most once a second
        s.post("/completion", greedy(CODE, 4))    # stores again
        r = s.post("/completion", greedy(CODE, 4))[1]
        assert r["timings"]["cache_n"] > 0
    finally:
        assert s.stop() == 0
        if kd:
            kd.send_signal(signal.SIGTERM)
            kd.wait(15)
        shutil.rmtree(d, ignore_errors=True)


# ---- the OpenAI Node SDK -----------------------------------------------------------

def openai_sdk():
    node, npm = shutil.which("node"), shutil.which("npm")
    if not node or not npm:
        pytest.skip("node / npm not installed (scripts/deps.sh test)")
    prefix = os.path.join(BUILD, "npm-openai")
    pkg = os.path.join(prefix, "node_modules", "openai", "package.json")
    if not os.path.exists(pkg) or json.load(open(pkg))["version"] != OPENAI_VERSION:
        r = subprocess.run([npm, "install", "--prefix", prefix, "--no-audit", "--no-fund",
                            "--loglevel=error", f"openai@{OPENAI_VERSION}"],
                           capture_output=True, timeout=300)
        assert r.returncode == 0, r.stderr.decode()
    return node, prefix


def test_openai_node_sdk(server):
    node, prefix = openai_sdk()
    script = os.path.join(ROOT, "tests", "python", "serve_openai.mjs")
    env = {**os.environ, "NODE_PATH": os.path.join(prefix, "node_modules"),
           "KVR_SERVE_URL": f"http://127.0.0.1:{server.port}/v1", "KVR_OPENAI": prefix}
    r = subprocess.run([node, script], capture_output=True, timeout=120, env=env)
    out = r.stdout.decode()
    assert r.returncode == 0, out + r.stderr.decode()
    res = json.loads(out.strip().splitlines()[-1])
    assert res["completion"]["usage"]["completion_tokens"] == 6
    assert res["stream_text"] == res["completion"]["text"]
    assert res["chat"]["role"] == "assistant"
    assert res["chat_stream_text"] == res["chat"]["content"]
    assert res["chat_usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert res["models"][0] == "kvrope-code.gguf"


def test_sigterm_exits_cleanly(servers):
    s = servers()

    def inflight():        # answered, or closed by the stopping server: never a hang
        try:
            s.post("/completion", greedy(CODE, 200))
        except (http.client.HTTPException, OSError):
            pass
    t = threading.Thread(target=inflight)
    t.start()
    time.sleep(0.05)
    s.proc.send_signal(signal.SIGTERM)
    s.proc.wait(20)
    t.join(20)
    assert s.proc.returncode == 0, s.log()
