#!/usr/bin/python3
"""kvrope.EditSession (client/python/kvrope/session.py): the editing loop of
issue 25 for numpy users, against a real kvroped, with a tiny numpy Llama
(examples/llama.py, random weights) as the encoder.

  - 20 consecutive edits (insert / delete / replace / a rename at several
    sites, one op per site) through one session: the context always holds
    the latest version, the encoder runs only new + refreshed + 1 tokens,
    ages follow the daemon's ageing and the policy caps them at max_age;
  - two sessions on one id racing: one commit lands, the other gets Busy,
    the context holds one consistent version, and the loser can sync again;
  - refresh_idle: oldest (then nearest the cursor) first, and after it the
    cached logits equal a full re-encode;
  - bad input gets a clear error and changes nothing.

Run: /usr/bin/python3 -m pytest -q tests/python/test_session.py
"""
import re

import numpy as np
import pytest

import kvrope
import llama as L

CFG = L.make_config("default", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=16)
REFRESH, MAX_AGE, MIN_GAP = 4, 3, 8

SRC = b"""/* counter.c: counts words */
#include <stdio.h>

static int count_words(const char *s)
{
    int count = 0, in_word = 0;
    for (; *s; s++) {
        if (*s == ' ' || *s == '\\n') {
            in_word = 0;
        } else if (!in_word) {
            in_word = 1;
            count++;
        }
    }
    return count;
}

int main(void)
{
    char line[256];
    int total = 0;
    while (fgets(line, sizeof line, stdin))
        total += count_words(line);
    printf("%d\\n", total);
    return 0;
}
"""


# ---- the edits: text -> (new text, bytes inserted, sites) ---------------------------

def _ins(text, at, s):
    return text[:at] + s + text[at:], len(s), 1


def _rename(old, new):
    def f(text):
        spans = [m.span() for m in re.finditer(rb"\b" + re.escape(old) + rb"\b", text)]
        assert len(spans) >= 2, (old, text)
        out, last = [], 0
        for a, b in spans:
            out += [text[last:a], new]
            last = b
        out.append(text[last:])
        return b"".join(out), len(new) * len(spans), len(spans)
    return f


def _replace(old, new):
    def f(text):
        i = text.index(old)
        return text[:i] + new + text[i + len(old):], len(new), 1
    return f


def _delete_line(pattern):
    def f(text):
        m = re.search(pattern, text, re.M)
        assert m, pattern
        return text[:m.start()] + text[m.end():], 0, 1
    return f


EDITS = [
    lambda t: _ins(t, t.index(b"int main"), b"/* entry point */\n"),
    _rename(b"count", b"n_words"),
    lambda t: _ins(t, t.index(b"#include") + len(b"#include <stdio.h>\n"),
                   b"#include <string.h>\n"),
    _replace(b"256", b"4096"),
    _delete_line(rb"^/\* entry point \*/\n"),
    lambda t: _ins(t, len(t), b"/* end of file */\n"),
    _replace(b"' '", b"'\\t'"),
    _rename(b"in_word", b"inside"),
    lambda t: _ins(t, t.index(b"    return 0;"), b"    fflush(stdout);\n"),
    _delete_line(rb"^#include <string\.h>\n"),
    _replace(b"counts words", b"counts the words of stdin"),
    lambda t: _ins(t, 0, b"// SPDX-License-Identifier: MIT\n"),
    _rename(b"total", b"sum"),
    _delete_line(rb"^    fflush\(stdout\);\n"),
    _replace(b"%d", b"%i"),
    lambda t: _ins(t, t.index(b"static int"), b"/* one word: a run of non-blanks */\n"),
    _rename(b"line", b"buf"),
    _replace(b"return 0;", b"return sum > 0 ? 0 : 1;"),
    _delete_line(rb"^// SPDX[^\n]*\n"),
    lambda t: _ins(t, t.index(b"}\n\nint main") + 2, b"\n/* main */"),
]
assert len(EDITS) == 20


class Counting:
    """The tiny model as an EditSession encoder, counting the tokens it runs."""

    def __init__(self, model):
        self.model, self.n = model, 0

    def forward(self, tokens, positions, past):
        self.n += len(tokens)
        return self.model.forward(tokens, positions, past)


@pytest.fixture(scope="module")
def llm():
    return L.LlamaModel(CFG, seed=5)


@pytest.fixture
def model(client, uid):
    if not client._lib.has("kvr_client_edit"):
        pytest.skip("libkvrope without kvr_client_edit")
    name = f"sess-{uid}"
    client.register_model(name, CFG, dtype="f32")
    return name


def full_logits(llm, text):
    return llm.forward(list(text))[0][-1]


def meta(client, sid):
    return client.get(sid, meta_only=True)


def test_twenty_consecutive_edits(client, model, llm, uid):
    sid = f"sess-{uid}"
    enc = Counting(llm)
    s = kvrope.EditSession(client, model, sid, enc, refresh=REFRESH, max_age=MAX_AGE,
                           min_gap=MIN_GAP)
    text = SRC
    r = s.step(list(text))
    assert r.kind == "create" and r.n_computed == len(text) == enc.n
    ages_seen = []
    for i, edit in enumerate(EDITS, 1):
        before = meta(client, sid)
        new, inserted, sites = edit(text)
        assert new != text
        enc.n = 0
        r = s.sync(list(new))
        assert r.kind == "edit", i
        # The encoder ran exactly what the result says, and that is the new
        # tokens, the refreshes and the last token; refreshes are the policy's.
        assert enc.n == r.n_computed, i
        assert r.n_computed <= r.n_new + r.n_refreshed + 1, i
        age_b = kvrope.token_age(before.flags)
        at_cap = int(np.count_nonzero(age_b == MAX_AGE))
        assert r.n_refreshed <= REFRESH * r.n_ops + at_cap, i
        assert r.n_new - r.n_removed == len(new) - len(text), i
        assert r.n_new <= inserted + (MIN_GAP - 1) * sites, (i, r)
        assert r.n_ops <= sites, (i, r.hunks)
        assert r.n_reused + r.n_computed == len(new), i
        # The logits come from approximate KV: close to a full re-encode, not equal.
        full = full_logits(llm, new)
        assert r.logits.shape == full.shape
        assert np.all(np.isfinite(r.logits))
        c = s.commit()
        assert c.kind == "edit" and c.n_tokens == len(new)
        after = meta(client, sid)
        assert bytes(after.tokens.astype(np.uint8)) == new, i
        assert np.array_equal(after.positions, np.arange(len(new)))
        assert not np.any(after.flags & kvrope.FLAG_PENDING)
        age_a = kvrope.token_age(after.flags)
        assert int(age_a.max()) <= MAX_AGE, (i, int(age_a.max()))
        assert int(np.count_nonzero(after.flags & kvrope.FLAG_APPROX)) == c.n_approx, i
        # An aged token is approximate; an approximate one may be age 0 (its KV
        # was recomputed this step, but against approximate tokens before it).
        assert np.all((age_a == 0) | ((after.flags & kvrope.FLAG_APPROX) != 0)), i
        # Ages: the daemon aged every kept token from the first edit point on
        # by one, unless this step refreshed it (age 0).
        first_b = r.hunks[0][2]
        j = delta = 0
        for h in list(r.hunks) + [(len(text), len(text), None, None)]:
            for old in range(j, h[0]):
                at = old + delta
                want = age_b[old] + 1 if at >= first_b else age_b[old]
                assert age_a[at] in (want, 0), (i, old, at, age_b[old], age_a[at])
                if want > MAX_AGE:
                    assert age_a[at] == 0, (i, at)
            if h[2] is not None:
                j = h[1]
                delta += (h[3] - h[2]) - (h[1] - h[0])
        ages_seen.append(int(age_a.max()))
        text = new
    assert max(ages_seen) == MAX_AGE            # ages grew to the cap, never past it
    assert client.stat(sid).n_tokens == len(text)

    # Idle: everything refreshed, and the cached logits are a full re-encode's.
    n_approx = int(np.count_nonzero(meta(client, sid).flags & kvrope.FLAG_APPROX))
    assert n_approx > 0
    assert s.refresh_idle() == n_approx
    assert client.stat(sid).n_approximate == 0
    enc.n = 0
    r = s.sync(list(text))
    assert r.n_ops == 0 and r.n_computed == 1 == enc.n and r.n_approx == 0
    full = full_logits(llm, text)
    tol = 1e-5 * max(1.0, float(np.max(np.abs(full))))
    assert float(np.max(np.abs(r.logits - full))) <= tol
    assert s.commit().kind == "none"
    assert bytes(meta(client, sid).tokens.astype(np.uint8)) == text
    client.delete(sid)


def test_race_two_sessions_one_wins(client, model, llm, uid):
    sid = f"race-{uid}"
    s1 = kvrope.EditSession(client, model, sid, llm, refresh=REFRESH)
    s2 = kvrope.EditSession(client, model, sid, llm, refresh=REFRESH)
    v0 = SRC
    s1.step(list(v0))
    v1 = EDITS[0](v0)[0]
    v2 = EDITS[1](v0)[0]
    s1.sync(list(v1))
    s2.sync(list(v2))
    s1.commit()
    with pytest.raises(kvrope.Busy) as ei:
        s2.commit()
    assert ei.value.name == "E_BUSY"
    m = meta(client, sid)
    assert bytes(m.tokens.astype(np.uint8)) == v1      # one consistent version
    assert np.array_equal(m.positions, np.arange(len(v1)))
    assert not np.any(m.flags & kvrope.FLAG_PENDING)
    with pytest.raises(ValueError):
        s2.commit()                                    # the refused step is spent
    # The loser continues from the winner's version.
    v12 = EDITS[1](v1)[0]
    r = s2.sync(list(v12))
    assert r.kind == "edit"
    s2.commit()
    assert bytes(meta(client, sid).tokens.astype(np.uint8)) == v12
    # Both refresh_idle at once: the second one's expect fails only if the
    # tokens changed; they did not, so both land.
    assert s1.refresh_idle(budget=10) == 10
    s2.refresh_idle()
    r = s1.sync(list(v12))
    full = full_logits(llm, v12)
    assert float(np.max(np.abs(r.logits - full))) <= 1e-5 * max(1.0, float(np.abs(full).max()))
    client.delete(sid)


def test_race_on_create(client, model, llm, uid):
    sid = f"race-new-{uid}"
    s1 = kvrope.EditSession(client, model, sid, llm)
    s2 = kvrope.EditSession(client, model, sid, llm)
    assert s1.sync(list(SRC)).kind == "create"
    assert s2.sync(list(SRC[:200])).kind == "create"
    s1.commit()
    with pytest.raises(kvrope.Busy):
        s2.commit()
    assert bytes(meta(client, sid).tokens.astype(np.uint8)) == SRC
    client.delete(sid)


def test_refresh_idle_order(client, model, llm, uid):
    sid = f"idle-{uid}"
    s = kvrope.EditSession(client, model, sid, llm, refresh=0, max_age=200)
    text = SRC
    s.step(list(text))
    for edit in EDITS[:6]:
        text = edit(text)[0]
        s.step(list(text))
    m0 = meta(client, sid)
    age0 = kvrope.token_age(m0.flags)
    assert int(age0.max()) >= 3
    n = s.refresh_idle(budget=25)
    assert n == 25
    age1 = kvrope.token_age(meta(client, sid).flags)
    done = np.flatnonzero((age0 > 0) & (age1 == 0))
    left = np.flatnonzero(age1 > 0)
    assert done.size == 25
    assert int(age0[done].min()) >= int(age0[left].max())     # oldest first
    # Equal ages: nearest the cursor first.
    cur = len(text) - 1
    top = int(age1.max())
    cand = np.flatnonzero(age1 == top)
    k = min(5, cand.size - 1)
    assert s.refresh_idle(budget=k, cursor=cur) == k
    age2 = kvrope.token_age(meta(client, sid).flags)
    got = np.flatnonzero((age1 == top) & (age2 == 0))
    want = cand[np.argsort(np.abs(cand - cur), kind="stable")[:k]]
    assert sorted(got.tolist()) == sorted(want.tolist())
    assert s.refresh_idle() > 0
    assert s.refresh_idle() == 0
    assert client.stat(sid).n_approximate == 0
    client.delete(sid)


def test_bad_input_changes_nothing(client, model, llm, uid):
    sid = f"bad-{uid}"
    s = kvrope.EditSession(client, model, sid, llm)
    with pytest.raises(ValueError):
        s.commit()                                     # no sync yet
    with pytest.raises(ValueError):
        s.sync([])
    with pytest.raises(kvrope.UnknownContext):
        s.refresh_idle()
    s.step(list(SRC))
    before = meta(client, sid)
    with pytest.raises(ValueError):
        s.sync(list(SRC) + [300])                      # outside the vocabulary
    with pytest.raises(ValueError):
        s.commit()
    with pytest.raises(ValueError):
        s.refresh_idle(budget=-1)

    class Wrong:
        def forward(self, tokens, positions, past):
            lg, kv = llm.forward(tokens, positions, past)
            return lg, kv[:1]                          # one layer short
    with pytest.raises(ValueError, match="shape"):
        kvrope.EditSession(client, model, sid, Wrong()).sync(list(SRC[:-3]))
    with pytest.raises(TypeError):
        kvrope.EditSession(client, model, sid, object())
    with pytest.raises(ValueError):
        kvrope.EditSession(client, model, sid, llm, max_age=0)
    after = meta(client, sid)
    assert np.array_equal(after.tokens, before.tokens)
    assert np.array_equal(after.flags, before.flags)
    client.delete(sid)


def test_unreadable_context_is_replaced(client, model, llm, uid):
    sid = f"odd-{uid}"
    toks = list(SRC[:100])
    _, kv = llm.forward(toks, np.arange(5, 105))
    client.put(sid, model, toks, kv, pos_start=5)      # positions not 0..n-1
    s = kvrope.EditSession(client, model, sid, llm)
    r = s.sync(list(SRC))
    assert r.kind == "create"
    s.commit()
    m = meta(client, sid)
    assert bytes(m.tokens.astype(np.uint8)) == SRC
    assert np.array_equal(m.positions, np.arange(len(SRC)))
    client.delete(sid)


def test_diff_hunks():
    assert kvrope.diff_hunks([1, 2, 3], [1, 2, 3]) == []
    assert kvrope.diff_hunks([1, 2, 3], [1, 9, 3]) == [(1, 2, 1, 2)]
    assert kvrope.diff_hunks([1, 2, 3], [1, 2, 3, 4]) == [(3, 3, 3, 4)]
    assert kvrope.diff_hunks([1, 2, 3], [2, 3]) == [(0, 1, 0, 0)]
    a = list(range(100, 140))
    b = a[:5] + [1] + a[5:30] + [2] + a[30:]
    assert kvrope.diff_hunks(a, b) == [(5, 5, 5, 6), (30, 30, 31, 32)]
    b = a[:5] + [1] + a[5:9] + [2] + a[9:]        # 4 equal tokens apart: one op
    assert kvrope.diff_hunks(a, b, min_gap=8) == [(5, 9, 5, 11)]
    assert kvrope.diff_hunks(a, b, min_gap=1) == [(5, 5, 5, 6), (9, 9, 10, 11)]


def apply_hunks(a, b, hunks):
    out, last = [], 0
    for a0, a1, b0, b1 in hunks:
        assert a0 >= last and b0 <= b1
        out += a[last:a0] + b[b0:b1]
        last = a1
    return out + a[last:]


def test_diff_hunks_long_sequences():
    """Past a few hundred tokens the diff goes through content-defined chunks:
    still exact (the hunks turn a into b), still one region per edit site."""
    from conftest import ROOT
    with open(f"{ROOT}/client/llama/worker_session.c", "rb") as f:
        src = f.read()
    a = list(src)
    sites = len(re.findall(rb"\bkvr__wk_fail\b", src))
    assert sites >= 10
    b = list(re.sub(rb"\bkvr__wk_fail\b", b"kvr__worker_fail", src))
    h = kvrope.diff_hunks(a, b)
    assert apply_hunks(a, b, h) == b
    assert len(h) == sites                                   # one region per site
    assert all(x[3] - x[2] <= len(b"worker") for x in h)     # each only its site
    assert sum((x[3] - x[2]) - (x[1] - x[0]) for x in h) == 4 * sites
    for b in (a[:700] + [1, 2, 3] + a[700:-900] + a[-890:],      # insert + delete
              a[:5000] + list(range(256)) * 4 + a[9000:],          # a rewritten block
              list(range(256)) * 3,                                # nothing in common
              a + a[:100], a[50:]):
        h = kvrope.diff_hunks(a, b)
        assert apply_hunks(a, b, h) == b
        assert all(h[i][1] < h[i + 1][0] for i in range(len(h) - 1))
    h = kvrope.diff_hunks(a, a[:700] + [1, 2, 3] + a[700:-900] + a[-890:])
    assert [(x[1] - x[0], x[3] - x[2]) for x in h] == [(0, 3), (10, 0)]


def test_writer_between_edit_and_refresh(client, model, llm, uid):
    """Another writer lands after this step's edit, before its refreshes: the
    refresh is refused (Busy), and the context is the other writer's version,
    whole (every token with KV, positions 0..n-1)."""
    sid = f"mid-{uid}"
    s1 = kvrope.EditSession(client, model, sid, llm, refresh=REFRESH)
    s2 = kvrope.EditSession(client, model, sid, llm, refresh=REFRESH)
    s1.step(list(SRC))
    v1 = EDITS[0](SRC)[0]
    v2 = EDITS[2](v1)[0]
    r = s1.sync(list(v1))
    assert r.n_refreshed > 0                           # commit will refresh after its edit
    real_refresh = client.refresh
    calls = []

    def refresh(*a, **kw):
        if not calls:
            calls.append(1)
            s2.step(list(v2))                          # the other writer, from v1
        return real_refresh(*a, **kw)
    client.refresh = refresh
    try:
        with pytest.raises(kvrope.Busy):
            s1.commit()
    finally:
        del client.refresh
    m = meta(client, sid)
    assert bytes(m.tokens.astype(np.uint8)) == v2
    assert np.array_equal(m.positions, np.arange(len(v2)))
    assert not np.any(m.flags & kvrope.FLAG_PENDING)
    s1.refresh_idle()
    r = s1.sync(list(v2))
    full = full_logits(llm, v2)
    assert float(np.max(np.abs(r.logits - full))) <= 1e-5 * max(1.0, float(np.abs(full).max()))
    client.delete(sid)


def test_f16_model(client, llm, uid):
    """A model kept as f16: the session sends float32 KV, the daemon stores
    f16; the loop works the same and the idle refresh brings the logits to a
    full encode's within f16 rounding."""
    name = f"sess16-{uid}"
    client.register_model(name, CFG, dtype="f16")
    sid = f"s16-{uid}"
    s = kvrope.EditSession(client, name, sid, llm, refresh=REFRESH, max_age=MAX_AGE)
    text = SRC
    s.step(list(text))
    for edit in EDITS[:8]:
        text = edit(text)[0]
        r = s.step(list(text))
        assert r.kind == "edit"
        assert bytes(meta(client, sid).tokens.astype(np.uint8)) == text
        assert int(kvrope.token_age(meta(client, sid).flags).max()) <= MAX_AGE
    assert s.refresh_idle() > 0
    r = s.sync(list(text))
    full = full_logits(llm, text)
    assert float(np.max(np.abs(r.logits - full))) <= 2e-2 * max(1.0, float(np.abs(full).max()))
    client.delete(sid)
