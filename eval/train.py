#!/usr/bin/python3
"""train.py — trains kvrope's eval model: a small Llama-architecture
transformer (RMSNorm, SwiGLU, grouped-query attention, interleaved RoPE,
byte vocabulary + the fill-in-the-middle tokens of eval/fim.py) on the
Python standard library (eval/corpus.py), on the CPU with Debian's
python3-torch. Run with /usr/bin/python3 (`make eval-model`).

    /usr/bin/python3 eval/train.py --out DIR [--steps N] [--seed S] [--threads T]
        [--lr LR] [--batch B] [--seq S] [--context C] [--long-from STEP]
        [--fim RATE] [--repo SHARE] [--mid-weight W] [shape: --hidden --layers
        --heads --kv-heads --head-dim --ffn] [--no-bf16]

Writes DIR/train.pt (checkpoint, resumed when present: the run can be
interrupted) and, at the end, DIR/weights.npz (HF tensor names, [out, in],
float32) + DIR/config.json (HF-shaped, rope_style "gptj") + DIR/train.json
(corpus digest, held-out bits per byte, steps, seconds). eval/export.py turns
those into the committed files.

Samples: a share --fim of each batch's rows is a fill-in-the-middle sample
laid out exactly as llama-server's /infill prompt (eval/fim.py: PSM order,
a cursor mostly in the middle of a line, the rest of the line or a few lines
as the middle, then EOT); --repo of those carry the repo-level context
(FIM_REP / FIM_SEP, file names, chunks of other files of the same package)
that /infill builds from input_extra. The other rows are plain windows of
the corpus, left to right; with --mid-noise K each carries K FIM_MID tokens
at random places, not scored, so the byte after a FIM_MID is read as
continuing the text before it (in the suffix-first layout, --spm, that is
all a middle's first byte needs, and a FIM row teaches it only once).
Padding (FIM_PAD) and FIM_MID targets are not scored; a FIM row's
middle (after FIM_MID, EOT included) weighs --mid-weight in the loss, so the
few tokens that teach infilling are not drowned by the prefix and suffix.

A run can be cut short on a loaded machine without changing a step taken:
--stop-after N checkpoints at step N and exits, and a rerun with a smaller
--steps resumes there (warmup-stable-decay: the steps before the new decay
are the same). make eval-model does exactly what the committed model went
through.

Speed on a 2-core CPU: matrix products in bfloat16 (autocast; weights,
gradients and optimizer state stay float32), rows shorter than the context
for most of the run (--seq, then --long-from: the whole context with half
the rows), and glibc kept from handing the step's large buffers back to the
kernel (see the re-exec below). docs/eval.md compares the tokens a second
of this run with the previous committed run of the same shape (float32,
glibc's defaults).

Reproducible: the weights, the data order (numpy PCG64 seeded from --seed)
and the schedule depend only on the arguments and the corpus; float
summation order inside torch depends on the thread count, so two runs with
the same --threads give the same model.

Shapes match what llama.cpp's `llama` architecture and kvrope's RoPE engine
both take: pairs (2i, 2i+1) rotate by p * base^(-2i/head_dim) (ggml's NORM
rope type, the numpy Llama's "gptj" style).
"""
import argparse
import hashlib
import json
import math
import os
import sys
import time

# Before torch loads: idle OpenMP threads sleep instead of spinning (on a shared
# 2-core machine spinning halves the speed), and OpenBLAS does not start a
# second pool of threads under torch's.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

# glibc serves every buffer over 32 MiB (the attention scores of a batch) with
# a fresh mmap and unmaps it on free, so each step writes ~1 GB of never-touched
# pages; on VMs that hand free pages back to the host that first write runs
# ~67x slower than a warm one and made a step 10x slower. Keep every
# allocation on the heap and never trim it: glibc reads these at start, hence
# the re-exec (`KVR_TRAIN_MALLOC=0` keeps glibc's defaults).
_MALLOC = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40), "MALLOC_TOP_PAD_": str(1 << 30)}
if __name__ == "__main__" and os.environ.get("KVR_TRAIN_MALLOC", "1") != "0" and \
        any(os.environ.get(k) != v for k, v in _MALLOC.items()):
    os.execve(sys.executable, [sys.executable] + sys.argv, dict(os.environ, **_MALLOC))

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import corpus  # noqa: E402
import fim  # noqa: E402

SHAPE = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2, head_dim=32, intermediate_size=704,
             vocab_size=corpus.VOCAB, rope_theta=10000.0, rms_norm_eps=1e-5)
SEQ = 1024         # the model's context (tokens, --context); rows are --seq long
BATCH = 16


class Block(nn.Module):
    def __init__(s, c):
        super().__init__()
        E, H, K, D, Fd = (c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"],
                          c["head_dim"], c["intermediate_size"])
        s.q = nn.Linear(E, H * D, bias=False)
        s.k = nn.Linear(E, K * D, bias=False)
        s.v = nn.Linear(E, K * D, bias=False)
        s.o = nn.Linear(H * D, E, bias=False)
        s.gate = nn.Linear(E, Fd, bias=False)
        s.up = nn.Linear(E, Fd, bias=False)
        s.down = nn.Linear(Fd, E, bias=False)
        s.ln1 = nn.Parameter(torch.ones(E))
        s.ln2 = nn.Parameter(torch.ones(E))


class Model(nn.Module):
    def __init__(s, c, seq):
        super().__init__()
        s.c = c
        s.emb = nn.Embedding(c["vocab_size"], c["hidden_size"])
        s.blocks = nn.ModuleList(Block(c) for _ in range(c["num_hidden_layers"]))
        s.norm = nn.Parameter(torch.ones(c["hidden_size"]))
        s.head = nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)
        D = c["head_dim"]
        inv = c["rope_theta"] ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
        ang = torch.arange(seq, dtype=torch.float64)[:, None] * inv[None]
        s.register_buffer("cos", ang.cos().float(), persistent=False)
        s.register_buffer("sin", ang.sin().float(), persistent=False)
        s.register_buffer("mask", torch.full((seq, seq), float("-inf")).triu(1), persistent=False)
        for n, p in s.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02 if n != "emb.weight" else 1.0)
        for b in s.blocks:   # residual projections scaled down (GPT-2)
            nn.init.normal_(b.o.weight, std=0.02 / math.sqrt(2 * len(s.blocks)))
            nn.init.normal_(b.down.weight, std=0.02 / math.sqrt(2 * len(s.blocks)))

    def rms(s, x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + s.c["rms_norm_eps"]) * w

    def rope(s, x):
        n = x.shape[2]
        c, sn = s.cos[:n], s.sin[:n]
        x0, x1 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x0 * c - x1 * sn, x0 * sn + x1 * c], -1).flatten(-2)

    def forward(s, t, probe=None):
        """Logits for token ids t [batch, n]; probe(attn) is called with
        each layer's attention weights [batch, heads, n, n], first layer
        first (eval/fim_probe.py)."""
        c = s.c
        H, K, D = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        b, n = t.shape
        x = s.emb(t)
        mask = s.mask[:n, :n]
        for blk in s.blocks:
            h = s.rms(x, blk.ln1)
            q = s.rope(blk.q(h).view(b, n, H, D).transpose(1, 2))
            k = s.rope(blk.k(h).view(b, n, K, D).transpose(1, 2)).repeat_interleave(H // K, 1)
            v = blk.v(h).view(b, n, K, D).transpose(1, 2).repeat_interleave(H // K, 1)
            a = ((q @ k.transpose(-1, -2)) / math.sqrt(D) + mask).softmax(-1)
            if probe is not None:
                probe(a)
            x = x + blk.o((a @ v).transpose(1, 2).reshape(b, n, H * D))
            h = s.rms(x, blk.ln2)
            x = x + blk.down(F.silu(blk.gate(h)) * blk.up(h))
        return s.head(s.rms(x, s.norm))


def hf_params(m):
    """The model's parameters under HF Llama names ([out, in] matrices)."""
    w = {"model.embed_tokens.weight": m.emb.weight, "model.norm.weight": m.norm,
         "lm_head.weight": m.head.weight}
    for i, b in enumerate(m.blocks):
        p = f"model.layers.{i}."
        w.update({p + "self_attn.q_proj.weight": b.q.weight, p + "self_attn.k_proj.weight": b.k.weight,
                  p + "self_attn.v_proj.weight": b.v.weight, p + "self_attn.o_proj.weight": b.o.weight,
                  p + "mlp.gate_proj.weight": b.gate.weight, p + "mlp.up_proj.weight": b.up.weight,
                  p + "mlp.down_proj.weight": b.down.weight, p + "input_layernorm.weight": b.ln1,
                  p + "post_attention_layernorm.weight": b.ln2})
    return w


def hf_weights(m):
    """The model's tensors under HF Llama names, float32 numpy [out, in]."""
    return {k: v.detach().float().numpy().copy() for k, v in hf_params(m).items()}


@torch.no_grad()
def load_init(m, d):
    """Start from a trained model (DIR/weights.npz, HF names, any float
    dtype) whose vocabulary may be smaller: its rows keep their ids, the new
    tokens' rows keep this model's seeded initialisation."""
    with np.load(os.path.join(d, "weights.npz")) as z:
        src = {k: torch.from_numpy(z[k].astype(np.float32)) for k in z.files}
    dst = hf_params(m)
    if set(src) != set(dst):
        raise SystemExit(f"train: --init {d}: tensor names differ from this model's")
    for k, p_ in dst.items():
        t = src[k]
        if t.shape == p_.shape:
            p_.copy_(t)
        elif t.dim() == 2 and t.shape[1:] == p_.shape[1:] and t.shape[0] < p_.shape[0]:
            p_[:t.shape[0]].copy_(t)   # vocabulary rows: the old ids keep their rows
        else:
            raise SystemExit(f"train: --init {d}: {k} is {tuple(t.shape)}, this model's {tuple(p_.shape)}")


def stream(rels):
    parts = [corpus.encode(corpus.read(r)) for r in rels]
    starts = np.cumsum([0] + [len(p) for p in parts[:-1]])
    return np.concatenate(parts), starts


@torch.no_grad()
def held_out_bpb(m, ids, seq):
    """Bits per byte over the held-out stream in non-overlapping windows of
    `seq` tokens (each window's first token is context only; BOS targets are
    not counted)."""
    m.eval()
    nll, n = 0.0, 0
    for a in range(0, len(ids) - 1, seq):
        w = torch.from_numpy(ids[a:a + seq + 1].astype(np.int64))[None]
        if w.shape[1] < 2:
            break
        lp = F.log_softmax(m(w[:, :-1]).double(), -1)[0]
        tgt = w[0, 1:]
        keep = tgt != corpus.BOS
        nll -= lp[torch.arange(len(tgt)), tgt][keep].sum().item()
        n += int(keep.sum())
    m.train()
    return nll / n / math.log(2)


def lr_factor(step, steps, decay):
    """Warmup over the first 4% of the steps, then constant, then a linear
    decay to 10% over the last `decay` share (warmup-stable-decay): the end
    of the stable phase can be moved (resume with another --steps) without
    changing any step already taken."""
    warm = max(1, steps // 25)
    d0 = steps - int(decay * steps)
    if step < warm:
        return (step + 1) / warm
    if step < d0:
        return 1.0
    return 1.0 - 0.9 * (step - d0 + 1) / max(1, steps - d0)


class Batches:
    """The rows of step `step`: a function of (seed, step) only, so a run
    resumes and repeats exactly."""

    def __init__(s, files, data, starts, seed, fim_rate, repo_share, pack=False, spm=False,
                 n_batches=fim.N_BATCHES, line=None, mid_noise=0):
        s.files, s.data, s.starts = files, data, starts
        s.mid_noise = mid_noise
        s.pack, s.spm, s.n_batches, s.line = pack, spm, n_batches, line
        s.ends = np.append(starts[1:], len(data))
        s.seed, s.fim_rate, s.repo_share = seed, fim_rate, repo_share
        by_dir = {}
        for i, r in enumerate(files):
            by_dir.setdefault(os.path.dirname(r), []).append(i)
        s.peers = [by_dir[os.path.dirname(r)] for r in files]

    def tokens(s, i):
        return s.data[s.starts[i] + 1:s.ends[i]]

    def chunks(s, i):
        """Chunks of 1-3 other files of file i's package, as an editor's ring
        buffer holds them (llama.vim: 64 lines each)."""
        def pick(rng):
            others = [j for j in s.peers[i] if j != i] or [int(rng.integers(0, len(s.files)))]
            out = []
            for j in rng.choice(others, size=min(len(others), int(rng.integers(1, 4))), replace=False):
                ft = s.tokens(int(j))
                nl = np.flatnonzero(ft == fim.enc("\n")[0])
                a0 = int(nl[rng.integers(0, len(nl))]) + 1 if len(nl) else 0
                e = np.searchsorted(nl, a0)
                e = int(nl[e + 63]) + 1 if e + 63 < len(nl) else len(ft)
                out.append((s.files[int(j)], ft[a0:e]))
            return out
        return pick

    def fim_sample(s, rng, seq):
        while True:
            i = int(np.searchsorted(s.starts, rng.integers(0, len(s.data)), "right") - 1)
            if s.ends[i] - s.starts[i] < 16:
                continue
            src = s.chunks(i) if rng.random() < s.repo_share else None
            row = fim.sample(rng, s.tokens(i), seq, src, s.spm, s.n_batches, s.line)
            if row is not None:
                return row

    def fim_row(s, rng, seq):
        """One FIM sample padded to seq + 1 tokens; with pack, the padding is
        filled with further samples while at least 96 tokens are left (each
        begins with its own prompt, so every middle is still a whole /infill
        answer; the attention sees the samples before it, as after a
        BOS-separated document)."""
        row = s.fim_sample(rng, seq)
        if not s.pack:
            return row
        out = []
        while True:
            out += row[:len(row) - row[::-1].index(fim.EOT)]   # up to its EOT (every sample has one)
            if seq + 1 - len(out) < 96:
                return out + [fim.PAD] * (seq + 1 - len(out))
            row = s.fim_sample(rng, seq - len(out))

    def with_mids(s, rng, row, seq):
        """A left-to-right row with mid_noise FIM_MID tokens put between its
        bytes at random places (the row keeps seq + 1 tokens). The loss skips
        the MIDs themselves, so the model learns that the byte after a MID
        continues the text before it: the one thing an SPM middle's first
        byte needs, which the FIM rows teach only once each."""
        k = min(s.mid_noise, seq // 8)
        text = np.asarray(row[:seq + 1 - k])
        at = np.sort(rng.choice(np.arange(1, len(text)), size=k, replace=False))
        return np.insert(text, at, fim.MID)   # each MID before the byte at `at`

    def rows(s, step, n, seq):
        rng = np.random.Generator(np.random.PCG64([s.seed, step]))
        data, starts = s.data, s.starts
        out = []
        for _ in range(n):
            row = None
            if rng.random() < s.fim_rate:
                row = s.fim_row(rng, seq)
            else:
                o = int(rng.integers(0, len(data) - seq - 1))
                if rng.random() < 0.25:      # a quarter of windows begin at a file's BOS
                    pk = int(starts[rng.integers(0, len(starts))])
                    o = pk if pk < len(data) - seq - 1 else o
                row = data[o:o + seq + 1]
                if s.mid_noise:
                    row = s.with_mids(rng, row, seq)
            out.append(np.asarray(row, dtype=np.int64))
        return torch.from_numpy(np.stack(out))


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=450)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--batch", type=int, default=BATCH)
    p.add_argument("--seq", type=int, default=None, help="tokens per training row (default and at most the context)")
    p.add_argument("--context", type=int, default=SEQ, help="the model's context (max_position_embeddings)")
    p.add_argument("--hidden", type=int, default=SHAPE["hidden_size"])
    p.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"])
    p.add_argument("--heads", type=int, default=SHAPE["num_attention_heads"])
    p.add_argument("--kv-heads", type=int, default=SHAPE["num_key_value_heads"])
    p.add_argument("--head-dim", type=int, default=SHAPE["head_dim"])
    p.add_argument("--ffn", type=int, default=SHAPE["intermediate_size"])
    p.add_argument("--long-from", type=int, default=None,
                   help="from this step on, rows of the whole --context with half as many rows a step (the "
                        "same tokens a step): the steps before train on --seq rows, which are faster")
    p.add_argument("--no-bf16", dest="bf16", action="store_false",
                   help="float32 matrix products (default: bfloat16 autocast, weights and optimizer in float32)")
    p.add_argument("--decay", type=float, default=0.3, help="share of the steps spent decaying the lr")
    p.add_argument("--fim", type=float, default=0.5, help="share of rows that are FIM samples")
    p.add_argument("--repo", type=float, default=0.5, help="share of FIM rows with repo-level context")
    p.add_argument("--mid-weight", type=float, default=1.0,
                   help="loss weight of a FIM row's middle tokens (the rest weigh 1)")
    p.add_argument("--mid-first", type=int, default=0,
                   help="the first N targets of each FIM middle weigh --mid-first-weight (0: off)")
    p.add_argument("--mid-first-weight", type=float, default=8.0)
    p.add_argument("--spm", action="store_true",
                   help="FIM samples in llama-server's --spm-infill order (suffix first) instead of PSM")
    p.add_argument("--fim-batches", default=",".join(map(str, fim.N_BATCHES)),
                   help="the /infill batch sizes FIM samples are laid out for (prefix <= 3/4, suffix <= 1/4 "
                        "of one): smaller ones pack more middles into a row")
    p.add_argument("--fim-line", type=float, default=None,
                   help="share of FIM samples whose middle is exactly the rest of the cursor's line "
                        "(default: eval/fim.py sample's mix)")
    p.add_argument("--mid-noise", type=int, default=0,
                   help="FIM_MID tokens put at random places in each left-to-right row (not scored), "
                        "so a MID is read as transparent")
    p.add_argument("--mid-noise-weight", type=float, default=1.0,
                   help="loss weight of the byte right after each --mid-noise MID")
    p.add_argument("--fim-pack", action="store_true",
                   help="fill a FIM row's padding with further FIM samples (more middles a step)")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-bytes", type=int, default=65536,
                   help="held-out tokens scored at each --eval-every (the start of the held-out stream)")
    p.add_argument("--no-final-eval", action="store_true",
                   help="skip the full held-out score at the end (eval/score.py measures it faster with llama.cpp)")
    p.add_argument("--stop-after", type=int, default=None,
                   help="checkpoint after this step and exit (resume with other --steps: a shorter schedule)")
    p.add_argument("--init", default=None,
                   help="start from this trained model's weights (eval/model layout) instead of random ones")
    a = p.parse_args(argv)
    a.seq = a.context if a.seq is None else a.seq
    if not 16 <= a.seq <= a.context:
        p.error(f"--seq must be in 16..{a.context}")
    if a.heads % a.kv_heads or a.head_dim % 2 or min(a.hidden, a.layers, a.heads, a.ffn) < 1:
        p.error("--heads must be a multiple of --kv-heads, --head-dim even, every size positive")
    torch.set_num_threads(a.threads)
    torch.set_flush_denormal(True)   # subnormal gradients are ~100x slower on x86 and change nothing
    os.makedirs(a.out, exist_ok=True)
    train_files, held = corpus.split()
    data, starts = stream(train_files)
    held_ids = stream(held)[0]
    batches = Batches(train_files, data, starts, a.seed, a.fim, a.repo, a.fim_pack, a.spm,
                      tuple(int(v) for v in a.fim_batches.split(",")), a.fim_line, a.mid_noise)
    cfg = dict(SHAPE, hidden_size=a.hidden, num_hidden_layers=a.layers, num_attention_heads=a.heads,
               num_key_value_heads=a.kv_heads, head_dim=a.head_dim, intermediate_size=a.ffn)
    torch.manual_seed(a.seed)
    m = Model(cfg, a.context)
    init_sha = None
    if a.init:
        load_init(m, a.init)
        with open(os.path.join(a.init, "weights.npz"), "rb") as f:
            init_sha = hashlib.sha256(f.read()).hexdigest()
    decay = [p_ for n, p_ in m.named_parameters() if p_.dim() == 2]
    other = [p_ for n, p_ in m.named_parameters() if p_.dim() != 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": other, "weight_decay": 0.0}], lr=a.lr, betas=(0.9, 0.95))
    ck = os.path.join(a.out, "train.pt")
    step, spent, log = 0, 0.0, []
    if os.path.exists(ck):
        st = torch.load(ck)
        m.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        step, spent, log = st["step"], st["seconds"], st["log"]
        print(f"resumed at step {step}", flush=True)
        if a.stop_after is not None and step >= a.stop_after:
            print(f"already at step {step} (--stop-after {a.stop_after}): nothing to do", flush=True)
            return 0
    t_run, c_run = time.time(), time.process_time()
    while step < a.steps:
        if a.long_from is not None and step >= a.long_from:
            x = batches.rows(step, max(1, a.batch * a.seq // a.context), a.context)
        else:
            x = batches.rows(step, a.batch, a.seq)
        lr = a.lr * lr_factor(step, a.steps, a.decay)
        for g in opt.param_groups:
            g["lr"] = lr
        t0 = time.time()
        tgt = x[:, 1:]
        with torch.cpu.amp.autocast(enabled=a.bf16, dtype=torch.bfloat16):
            logits = m(x[:, :-1])
        nll = F.cross_entropy(logits.float().reshape(-1, cfg["vocab_size"]), tgt.reshape(-1),
                              ignore_index=fim.PAD, reduction="none").view(tgt.shape)
        # a FIM middle (the targets after a FIM_MID up to its EOT, EOT included)
        # weighs --mid-weight; a packed row has several
        inp = x[:, :-1]
        in_mid = (inp == fim.MID).cumsum(1) > (inp == fim.EOT).cumsum(1)
        fim_row = (inp == fim.SUF).any(1, keepdim=True)
        in_mid &= fim_row   # a FIM row's, not a --mid-noise MID's
        w = 1.0 + (a.mid_weight - 1.0) * in_mid.float()
        if a.mid_first:
            # the first --mid-first targets of each middle (the ones only the
            # cursor's context, far back before FIM_SUF, can predict) weigh
            # --mid-first-weight
            pos = torch.arange(inp.shape[1]).expand_as(inp)
            last_mid = torch.cummax(torch.where(inp == fim.MID, pos, torch.zeros_like(pos)), 1).values
            first = in_mid & (pos - last_mid < a.mid_first)
            w = torch.where(first, torch.full_like(w, a.mid_first_weight), w)
        if a.mid_noise_weight != 1.0:
            # the byte right after a --mid-noise MID (a left-to-right row's):
            # the one an SPM middle's first byte is like
            after = (inp == fim.MID) & ~fim_row
            w = torch.where(after, torch.full_like(w, a.mid_noise_weight), w)
        w = w * ((tgt != fim.PAD) & (tgt != fim.MID)).float()
        loss = (nll * w).sum() / w.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        spent += time.time() - t0
        step += 1
        if step % 10 == 0 or step == a.steps or step <= 3:
            print(f"step {step}/{a.steps} loss {loss.item() / math.log(2):.3f} bits/byte lr {lr:.2e} "
                  f"{spent:.0f}s (cpu {time.process_time() - c_run:.0f}s this run)", flush=True)
        if step % a.eval_every == 0 or step == a.steps or step == a.stop_after:
            bpb = held_out_bpb(m, held_ids[:a.eval_bytes], a.context)
            log.append({"step": step, "held_out_bpb_start": bpb, "eval_tokens": a.eval_bytes, "seconds": spent})
            print(f"  held-out (first {a.eval_bytes} tokens) {bpb:.3f} bits/byte", flush=True)
            torch.save({"model": m.state_dict(), "opt": opt.state_dict(), "step": step,
                        "seconds": spent, "log": log}, ck + ".tmp")
            os.replace(ck + ".tmp", ck)
            if step == a.stop_after:
                print(f"stopped after step {step} (--stop-after)", flush=True)
                return 0
    bpb = None if a.no_final_eval else held_out_bpb(m, held_ids, a.context)
    if bpb is not None:
        print(f"held-out bits per byte (all {len(held)} files, {len(held_ids)} tokens): {bpb:.4f}")
    w = hf_weights(m)
    np.savez(os.path.join(a.out, "weights.npz"), **w)
    hf = dict(cfg, architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
              max_position_embeddings=a.context, tie_word_embeddings=False, attention_bias=False,
              mlp_bias=False, rope_scaling=None, torch_dtype="float32", rope_style="gptj",
              bos_token_id=corpus.BOS, eos_token_id=2)
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(hf, f, indent=1, sort_keys=True)
    meta = {"held_out_bpb": bpb, "held_out_files": len(held), "held_out_tokens": int(len(held_ids)),
            "train_files": len(train_files), "train_tokens": int(len(data)), "steps": a.steps,
            "batch": a.batch, "seq": a.seq, "context": a.context, "bf16": a.bf16, "lr": a.lr, "seed": a.seed, "threads": a.threads,
            "decay": a.decay, "init": a.init, "init_weights_sha256": init_sha, "fim_rate": a.fim, "mid_weight": a.mid_weight, "repo_share": a.repo, "fim_pack": a.fim_pack, "spm": a.spm, "fim_batches": a.fim_batches, "fim_line": a.fim_line, "mid_noise": a.mid_noise, "mid_noise_weight": a.mid_noise_weight, "mid_first": a.mid_first, "mid_first_weight": a.mid_first_weight, "vocab": cfg["vocab_size"],
            "tokens_seen": a.steps * a.batch * a.seq, "long_from": a.long_from, "train_seconds": round(spent, 1),
            "wall_seconds_last_run": round(time.time() - t_run, 1),
            "cpu_seconds_last_run": round(time.process_time() - c_run, 1),
            "corpus_digest": corpus.corpus_digest(train_files + held), "log": log,
            "params": int(sum(p_.numel() for p_ in m.parameters())), "torch": torch.__version__}
    with open(os.path.join(a.out, "train.json"), "w") as f:
        json.dump(meta, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
