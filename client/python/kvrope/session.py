"""kvrope.EditSession: one kvrope context follows one buffer (a file, an
editor buffer) edit after edit, for numpy (or torch) users. It is the Python
twin of the C session engine (client/llama/worker_session.c): the same
algorithm, the same policy, the same wire calls, so a context written by one
can be moved forward by the other.

    s = kvrope.EditSession(client, "my-model", "file:src/main.c", encoder)
    for text in versions:                      # each version of the buffer
        r = s.sync(tokenize(text))             # -> SyncResult (.logits, counts)
        s.commit()                             # moves the context to `text`
        use(r.logits)                          # next-token logits after the buffer
    s.refresh_idle(budget=256, cursor=pos)     # when the user pauses

A step is sync then commit:
  sync    reads the session context (get meta_only: tokens, positions, flags),
          diffs it against the new tokens (difflib on the token lists, on
          content-defined chunks first when they are long; one PIE op per
          changed region, regions closer than min_gap equal tokens merged
          into one), fetches the kept tokens' KV with their keys
          re-rotated to their new positions (get positions=; approximate
          tokens are reused like exact ones, that is PIE's trade-off), and
          runs the encoder on: the new tokens, the `refresh` tokens after each
          edit point, every kept token whose age after this edit would exceed
          max_age, and the last token (for its logits). Those runs are
          computed in increasing position order, each with all the KV before
          it (kept, new and recomputed) as its past. A missing session, one
          this engine cannot read (another model, positions not 0..n-1,
          tokens without KV) and one that shares no token with the new
          sequence are encoded whole.
  commit  one atomic edit of the session with the new tokens' KV and
          expect=the sequence sync read, then one refresh per recomputed run
          of old tokens with expect=the new sequence (compare-and-swap: when
          another writer got there first the daemon refuses with E_BUSY and
          changes nothing; kvrope.Busy is raised and the context holds the
          other writer's consistent version; sync again to continue from it).
          A missing session is created (put mode="create"; someone else
          creating it first is reported as kvrope.Busy too); an existing
          one encoded whole is replaced at once (put mode="replace", no
          compare-and-swap: nothing of it was reused).

Approximation age: every token's flags carry how many edits ago its KV was
last exact (kvrope.token_age, flag bits 8..15); the daemon's edit ages the
tokens at and after the first edit point, a refresh clears it. The policy
keeps every token's age <= max_age after each committed step, so drift is
bounded even when the caller is never idle; refresh_idle() re-encodes the
rest (oldest first, then nearest the cursor).

The encoder protocol (examples/llama.py's LlamaModel satisfies it as is):

    encoder.forward(tokens, positions, past) -> (logits, kv)

  tokens     1-D int64 array of the T token ids to run (T >= 1);
  positions  1-D int64 array of their T positions (consecutive here);
  past       None, or one (K, V) pair per layer, each [P, kv_heads, head_dim]
             float32, K already rotated at its position: the P tokens before
             `tokens`, all of which every token of the run attends to;
  logits     [T, vocab] (or [vocab]: the last token's) next-token logits;
  kv         the T new tokens' KV: one (K, V) per layer, each [T, kv_heads,
             head_dim], K after RoPE at `positions`; or one array
             [n_layers, 2, T, kv_heads, head_dim].

Invariants:
  - A step writes only the session's own context, and only at commit, with
    compare-and-swap on the token sequence; sync and refresh_idle never
    change anything until their writes, which are refused whole on a race.
  - The session's tokens sit at positions 0..n-1 (new tokens land at their
    index, the suffix shifts with them), as the C engine keeps them.
  - Bad input (empty tokens, an encoder returning the wrong shape, commit
    without a sync) raises ValueError / TypeError before anything is sent.
"""

import difflib
from dataclasses import dataclass
from typing import Optional

import numpy as np

from . import errors
from .client import FLAG_APPROX, FLAG_PENDING, token_age, tokens_array

DEFAULT_REFRESH = 8
DEFAULT_MAX_AGE = 16     # KVR_WK_MAX_AGE
DEFAULT_MIN_GAP = 8


# ---- the diff -------------------------------------------------------------------

CHUNK_AVG = 16           # content-defined chunks: ~16 tokens on average
CHUNK_WINDOW = 4         # tokens hashed to decide a chunk boundary
DIRECT_MAX = 1 << 16     # len(a) * len(b) up to which tokens are diffed directly
REFINE_MAX = 1 << 22     # a changed chunk region larger than this stays one hunk


def _chunk_bounds(t):
    """Content-defined chunk boundaries of a token array: a chunk ends after
    token i when a hash of tokens [i - CHUNK_WINDOW + 1, i] is 0 mod
    CHUNK_AVG, so an edit moves only the boundaries within a window of it and
    equal text cuts into equal chunks wherever it sits. -> [0, ..., n]."""
    n = t.size
    x = t.astype(np.uint64)
    h = np.zeros(n, dtype=np.uint64)
    for k in range(CHUNK_WINDOW):               # uint64 arithmetic wraps: a hash
        sh = np.zeros(n, dtype=np.uint64)
        sh[k:] = x[:n - k]
        h = h * np.uint64(0x9E3779B97F4A7C15) + (sh + np.uint64(k + 1)) * \
            np.uint64(0xFF51AFD7ED558CCD)
        h ^= h >> np.uint64(31)
    cut = np.flatnonzero(h % np.uint64(CHUNK_AVG) == 0) + 1
    return np.unique(np.concatenate(([0], cut, [n]))).tolist()


def _opcodes(a, b, a_off, b_off, out):
    """Appends [a0, a1, b0, b1] per changed region of token lists a, b
    (difflib, no junk heuristic: with byte or BPE tokens the frequent ones
    are what code is made of), offset into the full sequences."""
    sm = difflib.SequenceMatcher(None, a, b, autojunk=False)
    for tag, i0, i1, j0, j1 in sm.get_opcodes():
        if tag != "equal":
            out.append([a_off + i0, a_off + i1, b_off + j0, b_off + j1])


def diff_hunks(a, b, min_gap=DEFAULT_MIN_GAP):
    """The changed regions between token sequences a (old) and b (new):
    [(a0, a1, b0, b1), ...] in increasing order, old [a0, a1) became new
    [b0, b1). The common prefix and suffix are trimmed first. A small middle
    goes to difflib.SequenceMatcher token by token; a large one (difflib is
    quadratic on it) is cut into content-defined chunks, the chunk sequences
    are diffed, and each changed chunk region is diffed again token by token
    (a region too large for that stays one hunk: correct, less economical).
    Regions separated by fewer than min_gap equal tokens are merged into one
    (the equal tokens between become part of it): each region is an edit
    point that costs a round of computing and refreshing. [] when a == b."""
    a = np.asarray(a, dtype=np.int64).reshape(-1)
    b = np.asarray(b, dtype=np.int64).reshape(-1)
    na, nb = a.size, b.size
    m = min(na, nb)
    neq = np.flatnonzero(a[:m] != b[:m])
    p = int(neq[0]) if neq.size else m
    if p == na == nb:
        return []
    m2 = min(na, nb) - p
    neq = np.flatnonzero(a[na - m2:][::-1] != b[nb - m2:][::-1]) if m2 else np.empty(0)
    s = int(neq[0]) if neq.size else m2
    ma, mb = a[p:na - s], b[p:nb - s]
    hunks = []
    if not ma.size or not mb.size:
        hunks.append([p, na - s, p, nb - s])
    elif ma.size * mb.size <= DIRECT_MAX:
        _opcodes(ma.tolist(), mb.tolist(), p, p, hunks)
    else:
        ca, cb = _chunk_bounds(ma), _chunk_bounds(mb)
        ka = [ma[ca[i]:ca[i + 1]].tobytes() for i in range(len(ca) - 1)]
        kb = [mb[cb[i]:cb[i + 1]].tobytes() for i in range(len(cb) - 1)]
        sm = difflib.SequenceMatcher(None, ka, kb, autojunk=False)
        for tag, i0, i1, j0, j1 in sm.get_opcodes():
            if tag == "equal":
                continue
            a0, a1, b0, b1 = ca[i0], ca[i1], cb[j0], cb[j1]
            if a0 == a1 or b0 == b1 or (a1 - a0) * (b1 - b0) > REFINE_MAX:
                hunks.append([p + a0, p + a1, p + b0, p + b1])
            else:
                _opcodes(ma[a0:a1].tolist(), mb[b0:b1].tolist(), p + a0, p + b0, hunks)
    out = []
    for h in hunks:
        if out and h[0] == out[-1][1] and h[2] == out[-1][3]:
            out[-1][1], out[-1][3] = h[1], h[3]     # adjacent: one region
        elif out and h[0] - out[-1][1] < min_gap:
            out[-1][1], out[-1][3] = h[1], h[3]
        else:
            out.append(h)
    return [tuple(h) for h in out]


def _runs(mask):
    """[(s, e), ...]: the runs of True in a bool array, increasing."""
    m = np.concatenate(([False], np.asarray(mask, dtype=bool), [False]))
    d = np.flatnonzero(m[1:] != m[:-1])
    return [(int(d[i]), int(d[i + 1])) for i in range(0, d.size, 2)]


def _split(runs, rx):
    """Runs cut where rx (1 exact, 2 approximate) changes: [(s, e, approx)]."""
    out = []
    for s, e in runs:
        while s < e:
            k = s + 1
            while k < e and rx[k] == rx[s]:
                k += 1
            out.append((s, k, bool(rx[s] == 2)))
            s = k
    return out


def _busy(message):
    return errors.from_c(errors.KVR_EBUSY, message)


# ---- results --------------------------------------------------------------------

@dataclass
class SyncResult:
    """What sync computed. logits: the last token's next-token logits
    (float32 [vocab]); kv: the whole sequence's KV as used for them,
    [n_layers, 2, n_tokens, kv_heads, head_dim] float32 (kept tokens as
    fetched, the rest computed now): continue generating from it."""
    logits: np.ndarray
    kv: np.ndarray
    kind: str            # "edit" (the session moved forward) | "create" (encoded whole)
    n_tokens: int
    n_ops: int           # PIE ops against the session (edit)
    n_new: int           # tokens the ops insert (create: all of them)
    n_removed: int       # tokens the ops remove
    n_reused: int        # KV taken from kvrope
    n_computed: int      # tokens the encoder ran: new + refreshed (+1 for the logits)
    n_refreshed: int     # old tokens recomputed (after edit points, by age)
    n_approx: int        # tokens whose KV is approximate after this step
    hunks: tuple = ()    # edit: the ops, (a0, a1, b0, b1): old [a0, a1) -> new [b0, b1)

    @property
    def share_computed(self):
        return self.n_computed / self.n_tokens


@dataclass(frozen=True)
class CommitResult:
    kind: str            # "edit" | "create" | "none" (nothing to store)
    n_tokens: int        # the session's length after the commit
    n_refreshed: int     # old tokens whose exact KV was stored (refresh)
    n_approx: int        # approximate tokens of the session afterwards


@dataclass
class _Step:
    kind: str
    b: np.ndarray            # the new sequence (uint32)
    kv: np.ndarray           # its KV [L, 2, n, H, D] float32
    a: Optional[np.ndarray]  # edit: the session's sequence planned against
    hunks: list              # edit: [(a0, a1, b0, b1)]
    refresh_runs: list       # edit: recomputed runs of old approximate tokens
    n_approx: int
    rx: Optional[np.ndarray]  # per new token: 1 computed exact, 2 against approx ones
    exists: bool             # create: replace (True) or create (False)


# ---- the session ----------------------------------------------------------------

class EditSession:
    """One buffer's context in kvroped, moved forward edit after edit.

    client: a kvrope.Client (not shared with another thread while a step
    runs); model_name: a registered model whose shape the encoder's KV has;
    session_id: the context id of this buffer; encoder: see the module
    docstring (examples/llama.py's LlamaModel). refresh: tokens re-encoded
    after each edit point; max_age: approximate tokens older than this many
    edits are re-encoded at the next step; min_gap: changed regions closer
    than this are one op."""

    def __init__(self, client, model_name, session_id, encoder, refresh=DEFAULT_REFRESH,
                 max_age=DEFAULT_MAX_AGE, min_gap=DEFAULT_MIN_GAP):
        for nm, x in (("refresh", refresh), ("max_age", max_age), ("min_gap", min_gap)):
            if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < 0:
                raise ValueError(f"{nm} must be an int >= 0, got {x!r}")
        if not 1 <= max_age <= 254:
            raise ValueError(f"max_age must be in 1..254 (ages saturate at 255), got {max_age}")
        if not callable(getattr(encoder, "forward", None)):
            raise TypeError("encoder must have forward(tokens, positions, past) -> (logits, kv)")
        self.client = client
        self.model_name = model_name
        self.session_id = session_id
        self.encoder = encoder
        self.refresh, self.max_age, self.min_gap = int(refresh), int(max_age), int(min_gap)
        m = client.model(model_name)          # UnknownModel if absent
        self.shape = (m.n_layers, m.n_kv_heads, m.head_dim)
        self._step = None

    def __repr__(self):
        return (f"<kvrope.EditSession {self.session_id!r} model={self.model_name!r} "
                f"refresh={self.refresh} max_age={self.max_age}>")

    # -- reading the session

    def _read(self):
        """-> (ok, exists, meta KV or None). ok: a session this engine can
        move forward."""
        try:
            meta = self.client.get(self.session_id, meta_only=True)
        except errors.UnknownContext:
            return False, False, None
        except errors.Pending:              # a token without KV: replaced, not read
            return False, True, None
        n = meta.n_tokens
        ok = (meta.model == self.model_name and n > 0
              and np.array_equal(meta.positions, np.arange(n, dtype=np.int64))
              and not np.any(meta.flags & FLAG_PENDING))
        return ok, True, meta

    def _fetch(self, tokens, positions=None):
        """The session's KV (f32 [L, 2, n, H, D]) with keys at `positions`
        (default: where they are); Busy if its tokens are no longer `tokens`
        (another writer between the meta read and this get)."""
        n = tokens.size
        kv = self.client.get(self.session_id, 0, n, dtype="f32", positions=positions)
        if not np.array_equal(kv.tokens, tokens):
            raise _busy(f"session {self.session_id} changed while it was being read "
                        f"(another writer); sync again")
        return np.array(kv.to_float32(), dtype=np.float32, copy=True)

    # -- the encoder

    def _decode(self, kv, toks, runs, apx):
        """Runs `runs` in increasing order (each with the KV before it as
        past) and says which came out exact: apx (bool per token) marks KV that
        is approximate or not there yet; a run is exact when nothing before it
        is. -> rx (uint8 per token: 1 exact, 2 computed against approximate
        tokens, 0 not computed); the last run's logits in self._last_logits."""
        apx = np.array(apx, dtype=bool)
        rx = np.zeros(apx.size, dtype=np.uint8)
        self._last_logits = None
        for s, e in runs:
            self._last_logits = self._run(kv, toks, s, e)
            exact = not apx[:s].any()
            apx[s:e] = not exact
            rx[s:e] = 1 if exact else 2
        return rx

    def _run(self, kv, toks, s, e):
        """Runs tokens [s, e) of the sequence with kv[:, :, :s] as past, writes
        their KV into kv[:, :, s:e]; -> their last token's logits."""
        n_l = kv.shape[0]
        past = None if s == 0 else [(kv[i, 0, :s], kv[i, 1, :s]) for i in range(n_l)]
        logits, new = self.encoder.forward(np.asarray(toks[s:e], dtype=np.int64),
                                           np.arange(s, e, dtype=np.int64), past)
        if isinstance(new, np.ndarray):
            arr = new
        else:
            try:
                arr = np.asarray([[np.asarray(k), np.asarray(v)] for k, v in new])
            except (TypeError, ValueError) as ex:
                raise TypeError(f"encoder.forward returned kv that is not one (K, V) per "
                                f"layer: {ex}") from None
        want = (n_l, 2, e - s) + self.shape[1:]
        if arr.shape != want:
            raise ValueError(f"encoder.forward returned kv of shape {arr.shape}, expected "
                             f"{want} (layers, K/V, tokens, kv_heads, head_dim)")
        kv[:, :, s:e] = arr
        lg = np.asarray(logits, dtype=np.float32)
        if lg.ndim == 2:
            lg = lg[-1]
        if lg.ndim != 1:
            raise ValueError(f"encoder.forward returned logits of shape {np.shape(logits)}")
        return lg

    def _empty_kv(self, n):
        n_l, h, d = self.shape
        return np.zeros((n_l, 2, n, h, d), dtype=np.float32)

    # -- sync / commit

    def sync(self, tokens):
        """Computes the next-token logits of `tokens` (the buffer's new
        content) from the session's cached KV, computing only what the policy
        says; -> SyncResult. Changes nothing in the daemon: commit() does.
        A previous sync not committed is dropped."""
        b = tokens_array(tokens)
        if b.size == 0:
            raise ValueError("sync needs at least one token")
        self._step = None
        ok, exists, meta = self._read()
        hunks, keep = [], 0
        if ok:
            hunks = diff_hunks(meta.tokens, b, self.min_gap)
            keep = b.size - sum(h[3] - h[2] for h in hunks)
        if ok and keep > 0:
            res, step = self._sync_edit(meta, b, hunks)
        else:
            res, step = self._sync_full(b, exists)
        self._step = step
        return res

    def _sync_full(self, b, exists):
        n = b.size
        kv = self._empty_kv(n)
        logits = self._run(kv, b, 0, n)
        step = _Step("create", b, kv, None, [], [], 0, None, exists)
        return SyncResult(logits, kv, "create", n, 0, n, 0, 0, n, 0, 0), step

    def _sync_edit(self, meta, b, hunks):
        A, flags = meta.tokens, meta.flags
        na, nb = A.size, b.size
        first_b = hunks[0][2] if hunks else nb
        approx_old = (flags & FLAG_APPROX) != 0
        age_old = token_age(flags).astype(np.int64)
        # Where each old token lands; what is new; what the policy recomputes.
        newpos = np.arange(na, dtype=np.int64)   # removed tokens: fetched, unused
        kept = np.zeros(na, dtype=bool)
        comp = np.zeros(nb, dtype=bool)
        isnew = np.zeros(nb, dtype=bool)
        delta, j = 0, 0
        for i in range(len(hunks) + 1):
            end = hunks[i][0] if i < len(hunks) else na
            if end > j:
                at = np.arange(j, end, dtype=np.int64) + delta
                newpos[j:end] = at
                kept[j:end] = True
            j = end
            if i < len(hunks):
                a0, a1, b0, b1 = hunks[i]
                j = a1
                comp[b0:b1] = isnew[b0:b1] = True
                room = (hunks[i + 1][2] if i + 1 < len(hunks) else nb) - b1
                comp[b1:b1 + min(self.refresh, room)] = True
                delta += (b1 - b0) - (a1 - a0)
        at = newpos[kept]
        moved = at >= first_b                    # the edit ages these by one
        approx_now = approx_old[kept] | moved
        age_now = age_old[kept] + moved
        comp[at[approx_now & (age_now > self.max_age)]] = True
        last_extra = not comp[nb - 1]
        comp[nb - 1] = True                      # the last token's logits
        n_new = int(isnew.sum())

        kv = self._empty_kv(nb)
        if kept.any():
            old = self._fetch(A, newpos)
            kv[:, :, at] = old[:, :, kept]
            del old
        # The loaded KV that is approximate (new tokens: not there yet).
        apx = isnew.copy()
        apx[at] = approx_now
        runs = _runs(comp)
        logits, rx = None, self._decode(kv, b, runs, apx)
        logits = self._last_logits
        n_dec = int(comp.sum())

        # What commit refreshes: recomputed old tokens that are approximate
        # after the edit (exact ones before the first edit point did not
        # change: not stored).
        store = comp & ~isnew
        store[at[~approx_now & (rx[at] == 1)]] = False
        apx[rx == 1], apx[rx == 2] = False, True   # after this step's decodes
        n_approx = int(np.count_nonzero(apx))
        step = _Step("edit", b, kv, A.copy(), hunks, _split(_runs(store), rx), n_approx, rx,
                     True)
        n_keep = nb - n_new
        res = SyncResult(logits, kv, "edit", nb, len(hunks), n_new,
                         sum(h[1] - h[0] for h in hunks), n_keep - (n_dec - n_new), n_dec,
                         n_dec - n_new - (1 if last_extra else 0), n_approx, tuple(hunks))
        return res, step

    def commit(self):
        """Stores the synced step: -> CommitResult. Raises kvrope.Busy when
        another writer changed the session since sync (nothing of this step
        is stored then, or, if the race hit between the edit and a refresh,
        the edit is stored and the rest stays approximate: either way the
        context is one consistent version). The step is spent either way."""
        st, self._step = self._step, None
        if st is None:
            raise ValueError("commit without a sync (or the sync was already committed)")
        c, sid = self.client, self.session_id
        if st.kind == "create":
            try:
                r = c.put(sid, self.model_name, st.b, st.kv,
                          mode="replace" if st.exists else "create", pos_start=0)
            except errors.Exists:
                raise _busy(f"session {sid} was created by another writer since sync; "
                            f"sync again") from None
            return CommitResult("create", r.n_tokens, 0, 0)
        if st.hunks:
            ops, parts = [], []
            for a0, a1, b0, b1 in st.hunks:
                ops.append((a0, a1, st.b[b0:b1], bool(b1 > b0 and st.rx[b0] == 2)))
                if b1 > b0:
                    parts.append(st.kv[:, :, b0:b1])
            new_kv = np.ascontiguousarray(np.concatenate(parts, axis=2)) if parts else None
            r = c.edit(sid, ops, new_kv, model=self.model_name, expect=st.a)
            if r.n_tokens != st.b.size:
                raise errors.from_c(errors.KVR_EINTERNAL,
                                    f"session {sid} holds {r.n_tokens} tokens after the "
                                    f"edit, not {st.b.size}")
        n_ref = 0
        for s, e, apx in st.refresh_runs:
            c.refresh(sid, s, e, np.ascontiguousarray(st.kv[:, :, s:e]),
                      model=self.model_name, expect=st.b, approx=apx)
            n_ref += e - s
        kind = "edit" if st.hunks or st.refresh_runs else "none"
        return CommitResult(kind, int(st.b.size), n_ref, st.n_approx)

    def step(self, tokens):
        """sync(tokens) then commit(); -> the SyncResult."""
        r = self.sync(tokens)
        self.commit()
        return r

    # -- idle refresh

    def refresh_idle(self, budget=None, cursor=None):
        """Re-encodes up to `budget` (None: all) approximate tokens of the
        session, oldest first, then nearest `cursor` (a token index; None: no
        preference), computed left to right, each run with the KV before it
        as past, and stores them (refresh, expect=the session's tokens);
        -> the number of tokens refreshed. Busy if another writer changes the
        session meanwhile (what was already stored stays, consistent)."""
        if budget is not None and (isinstance(budget, bool) or budget < 0):
            raise ValueError(f"budget must be None or an int >= 0, got {budget!r}")
        if cursor is not None and (isinstance(cursor, bool) or cursor < 0):
            raise ValueError(f"cursor must be None or a token index >= 0, got {cursor!r}")
        ok, exists, meta = self._read()
        if not ok:
            if exists:
                raise errors.from_c(errors.KVR_EINVAL,
                                    f"context {self.session_id} is not a session this engine "
                                    f"can refresh (another model, positions or KV missing)")
            raise errors.from_c(errors.KVR_ENOCTX, f"no session {self.session_id}")
        toks, n = meta.tokens, meta.n_tokens
        idx = np.flatnonzero(meta.flags & FLAG_APPROX)
        if idx.size == 0 or budget == 0:
            return 0
        age = token_age(meta.flags[idx]).astype(np.int64)
        dist = np.zeros_like(idx) if cursor is None else np.abs(idx - int(cursor))
        order = np.lexsort((idx, dist, -age))    # age desc, distance asc, index asc
        chosen = idx[order[:budget]] if budget is not None else idx
        mark = np.zeros(n, dtype=bool)
        mark[chosen] = True
        kv = self._fetch(toks)
        runs = _runs(mark)
        rx = self._decode(kv, toks, runs, (meta.flags & FLAG_APPROX) != 0)
        done = 0
        for s, e, apx in _split(runs, rx):
            self.client.refresh(self.session_id, s, e, np.ascontiguousarray(kv[:, :, s:e]),
                                model=self.model_name, expect=toks, approx=apx)
            done += e - s
        return done
