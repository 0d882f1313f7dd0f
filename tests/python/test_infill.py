"""Fill-in-the-middle on the committed trained model (eval/model, issue 28),
with the numpy Llama (no build needed):

  - eval/fim.py's format_infill lays a request out as llama-server's
    format_prompt_infill does (checked on a small request against the layout
    written out by hand from tools/server/server-common.cpp of v0.5.0: the
    extra context's tail, <s>, FIM_PRE, the prefix's tail, the prompt,
    FIM_SUF, the suffix's head, FIM_MID), including its cuts;
  - the model is really trained for FIM: on three held-out files, the
    middle-line exact match of /infill requests is above left to right's on
    the same cursors (whatever the numbers; both are printed);
  - FIM completions end: most of them stop at a special token or a newline
    within the budget instead of running on.
The last two are marked xfail for the committed model (see NOT_YET). No
timing is asserted.
"""
import os
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "eval"))
import corpus  # noqa: E402
import engines as E  # noqa: E402
import fim  # noqa: E402
import infill as I  # noqa: E402

MODEL = os.path.join(ROOT, "eval", "model")
FILES = ["shutil.py", "ssl.py", "http/server.py"]   # held out: never trained on
PER_FILE = 12


def test_format_infill_is_llama_servers_layout():
    b = fim.enc
    ids = fim.format_infill(b"abcdefgh", b"XYZW", b"pq", [("m.py", "import os\n")],
                            n_batch=16, n_ctx=64, n_predict=4)
    # n_prefix_take = min(8, 3 * 4) = 8; n_suffix_take = min(4, 4 - (2 + 2)) = 0;
    # n_extra_take = min(64 - 16 - 8, len(extra)) = all of it
    extra = [fim.REP] + b("myproject\n") + [fim.SEP] + b("m.py\n") + b("import os\n") + [fim.SEP] + b("filename\n")
    assert ids == extra + [corpus.BOS, fim.PRE] + b("abcdefgh") + b("pq") + [fim.SUF, fim.MID]
    # a larger batch takes the suffix's head and the prefix's tail; no room: no extra
    ids = fim.format_infill(b"0123456789" * 4, b"XYZW", b"", [("m.py", "x")], n_batch=32, n_ctx=32, n_predict=4)
    assert ids == [corpus.BOS, fim.PRE] + b(("0123456789" * 4)[-24:]) + [fim.SUF] + b("XYZW") + [fim.MID]
    # the extra context keeps its tail
    ids = fim.format_infill(b"a", b"", b"", [("m.py", "0123456789")], n_batch=8, n_ctx=24, n_predict=2)
    # n_extra_take = 24 - 8 - 4 = 12: the last 12 tokens of the extra context, then <s> FIM_PRE "a" FIM_SUF FIM_MID
    full = [fim.REP] + b("myproject\n") + [fim.SEP] + b("m.py\n") + b("0123456789") + [fim.SEP] + b("filename\n")
    assert ids == full[-12:] + [corpus.BOS, fim.PRE] + b("a") + [fim.SUF, fim.MID]


def test_fim_ids_follow_the_bytes():
    assert [fim.ID[n] for n in ("pre", "suf", "mid", "pad", "rep", "sep", "eot")] == list(range(260, 267))
    assert corpus.VOCAB == 267 and not corpus.is_byte_id(fim.PRE) and corpus.is_byte_id(259)


def test_vim_pick_is_llama_vims_chain():
    """eval/infill.py's vim_pick: top_k 40, top_p 0.99, llama.cpp's infill
    sampler, then the likeliest left (kvrope serve's chain, decoded greedily)."""
    import numpy as np
    lg = np.full(corpus.VOCAB, -30.0)
    a, b = fim.enc("a")[0], fim.enc("b")[0]
    lg[a], lg[b] = 3.0, 1.0                 # a clear text token: it is the pick
    assert I.vim_pick(lg) == a
    lg2 = lg.copy()
    lg2[fim.EOT] = 0.0                      # p(EOT) 0.04 of 3 left by top_p: 3 p n < p(text)
    assert I.vim_pick(lg2) == a
    lg2[fim.EOT] = 1.5                      # p(EOT) 0.16: 3 p n > p(text) -> the end
    assert I.vim_pick(lg2) == fim.EOT
    flat = np.full(corpus.VOCAB, -30.0)
    flat[[fim.enc(c)[0] for c in "abcdefgh"]] = 0.0   # no text token reaches 0.2: the end
    assert I.vim_pick(flat) == fim.EOT
    flat[a] = 2.0                           # one does: it is the pick
    assert I.vim_pick(flat) == a


@pytest.fixture(scope="module")
def results():
    _, held = corpus.split()
    assert all(f in held for f in FILES)
    cases = I.cases(FILES, PER_FILE)
    eng = E.NumpyEngine(MODEL)
    if eng.config["vocab_size"] != corpus.VOCAB:
        pytest.fail(f"eval/model has vocab {eng.config['vocab_size']}, not the FIM vocabulary {corpus.VOCAB}")
    return cases, I.run(eng, cases, rows=("ltr", "fim"))


# The committed model (session 15: SPM rows, and FIM_MID tokens sprinkled
# unscored into the left-to-right rows so the byte after one continues the
# text before it) completes a FIM middle as well as left to right: 4 of 36
# exact each, the completions nearly the same case for case. The suffix does
# not yet make them better, and 17 of 36 FIM completions end within the
# budget. These two say what the model must do; they are expected to fail
# until a training run teaches that, and pass then (strict=False).
NOT_YET = pytest.mark.xfail(reason="issue 28: FIM ties left to right (4/36 exact each) and 17/36 FIM "
                                   "completions end: the FIM_MID costs 0.5 bits on a middle's first byte "
                                   "and the suffix changes nothing (docs/eval.md, session 16)",
                            strict=False)


@NOT_YET
def test_fim_beats_left_to_right_on_the_middle_of_a_line(results):
    cases, r = results
    print(f"{len(cases)} cases: exact match FIM {r['fim']['exact']:.3f}, left to right {r['ltr']['exact']:.3f}; "
          f"bytes before the first miss FIM {r['fim']['right_before_miss']:.3f}, "
          f"left to right {r['ltr']['right_before_miss']:.3f}")
    assert r["fim"]["exact"] > r["ltr"]["exact"]


@NOT_YET
def test_fim_completions_end(results):
    cases, r = results
    ended = sum(1 for p in r["fim"]["per_case"] if p["ended"])
    print(f"{ended} of {len(cases)} FIM completions ended within the budget")
    assert ended * 2 >= len(cases)


def test_serve_paths_take_the_prompt_from_the_cache():
    """eval/infill_serve.py on a few cases: after a warm-up whose prefix had one
    line changed (PIE edit) or whose input_extra chunks came in another order
    (placement), kvrope serve takes most of the prompt from kvroped, answers
    every request, and reports a completion for the cached and the full
    re-encode path alike (how often they agree is docs/eval.md's table)."""
    from conftest import BUILD
    import infill_serve as IS
    gguf = os.path.join(BUILD, "eval", "kvrope-code.gguf")
    for p in (os.path.join(BUILD, "kvrope-llama"), os.path.join(BUILD, "kvroped"), gguf):
        if not os.path.exists(p):
            pytest.skip(f"{p} is not built")
    cases = I.cases(["ssl.py", "http/server.py"], 2)
    assert all(len(c["chunks"]) >= 2 for c in cases)
    r = IS.run(BUILD, gguf, cases)
    for path in ("edit", "placement"):
        x = r[path]
        print(f"{path}: {x['n']} cases, cache supplied {x['cached_share']:.3f} of the prompt, "
              f"completion differs from full in {x['changed']:.3f}")
        assert x["n"] == len(cases)
        for p in x["per_case"]:
            assert p["cache_n"] + p["prompt_n"] > 0 and p["prompt_n"] >= 1
        # the edit path keeps all but the changed line (and its refresh); the
        # placement path the chunks (the prefix and suffix after them move)
        assert x["cached_share"] > (0.8 if path == "edit" else 0.3), x["cached_share"]
