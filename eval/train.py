#!/usr/bin/python3
"""train.py — trains kvrope's eval model: a small Llama-architecture
transformer (RMSNorm, SwiGLU, grouped-query attention, interleaved RoPE,
byte vocabulary) on the Python standard library (eval/corpus.py), on the CPU
with Debian's python3-torch. Run with /usr/bin/python3 (`make eval-model`).

    /usr/bin/python3 eval/train.py --out DIR [--steps N] [--seed S] [--threads T]

Writes DIR/train.pt (checkpoint, resumed when present: the run can be
interrupted) and, at the end, DIR/weights.npz (HF tensor names, [out, in],
float32) + DIR/config.json (HF-shaped, rope_style "gptj") + DIR/train.json
(corpus digest, held-out bits per byte, steps, seconds). eval/export.py turns
those into the committed files.

Reproducible: the weights, the data order (numpy PCG64 seeded from --seed)
and the schedule depend only on the arguments and the corpus; float
summation order inside torch depends on the thread count, so two runs with
the same --threads give the same model.

Shapes match what llama.cpp's `llama` architecture and kvrope's RoPE engine
both take: pairs (2i, 2i+1) rotate by p * base^(-2i/head_dim) (ggml's NORM
rope type, the numpy Llama's "gptj" style).
"""
import argparse
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

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import corpus  # noqa: E402

SHAPE = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2, head_dim=32, intermediate_size=704,
             vocab_size=corpus.VOCAB, rope_theta=10000.0, rms_norm_eps=1e-5)
SEQ = 512          # training context (tokens)
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

    def forward(s, t):
        c = s.c
        H, K, D = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        b, n = t.shape
        x = s.emb(t)
        mask = torch.full((n, n), float("-inf")).triu(1)
        for blk in s.blocks:
            h = s.rms(x, blk.ln1)
            q = s.rope(blk.q(h).view(b, n, H, D).transpose(1, 2))
            k = s.rope(blk.k(h).view(b, n, K, D).transpose(1, 2)).repeat_interleave(H // K, 1)
            v = blk.v(h).view(b, n, K, D).transpose(1, 2).repeat_interleave(H // K, 1)
            a = ((q @ k.transpose(-1, -2)) / math.sqrt(D) + mask).softmax(-1)
            x = x + blk.o((a @ v).transpose(1, 2).reshape(b, n, H * D))
            h = s.rms(x, blk.ln2)
            x = x + blk.down(F.silu(blk.gate(h)) * blk.up(h))
        return s.head(s.rms(x, s.norm))


def hf_weights(m):
    """The model's tensors under HF Llama names, float32 numpy [out, in]."""
    w = {"model.embed_tokens.weight": m.emb.weight, "model.norm.weight": m.norm,
         "lm_head.weight": m.head.weight}
    for i, b in enumerate(m.blocks):
        p = f"model.layers.{i}."
        w.update({p + "self_attn.q_proj.weight": b.q.weight, p + "self_attn.k_proj.weight": b.k.weight,
                  p + "self_attn.v_proj.weight": b.v.weight, p + "self_attn.o_proj.weight": b.o.weight,
                  p + "mlp.gate_proj.weight": b.gate.weight, p + "mlp.up_proj.weight": b.up.weight,
                  p + "mlp.down_proj.weight": b.down.weight, p + "input_layernorm.weight": b.ln1,
                  p + "post_attention_layernorm.weight": b.ln2})
    return {k: v.detach().float().numpy().copy() for k, v in w.items()}


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


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=450)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--eval-every", type=int, default=100)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.set_flush_denormal(True)   # subnormal gradients are ~100x slower on x86 and change nothing
    os.makedirs(a.out, exist_ok=True)
    train_files, held = corpus.split()
    data, starts = stream(train_files)
    held_ids = stream(held)[0]
    cfg = dict(SHAPE)
    torch.manual_seed(a.seed)
    m = Model(cfg, SEQ)
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
    warm = max(1, a.steps // 25)
    t_run = time.time()
    while step < a.steps:
        # the batch of step `step` depends only on (seed, step): resumable and reproducible
        rng = np.random.Generator(np.random.PCG64([a.seed, step]))
        offs = rng.integers(0, len(data) - SEQ - 1, BATCH)
        at_start = rng.random(BATCH) < 0.25      # a quarter of windows begin at a file's BOS
        pick = starts[rng.integers(0, len(starts), BATCH)]
        offs = np.where(at_start & (pick < len(data) - SEQ - 1), pick, offs)
        x = torch.from_numpy(np.stack([data[o:o + SEQ + 1] for o in offs]).astype(np.int64))
        lr = a.lr * (step + 1) / warm if step < warm else \
            a.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warm) / (a.steps - warm))))
        for g in opt.param_groups:
            g["lr"] = lr
        t0 = time.time()
        loss = F.cross_entropy(m(x[:, :-1]).reshape(-1, cfg["vocab_size"]), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        spent += time.time() - t0
        step += 1
        if step % 10 == 0 or step == a.steps or step <= 3:
            print(f"step {step}/{a.steps} loss {loss.item() / math.log(2):.3f} bits/byte lr {lr:.2e} "
                  f"{spent:.0f}s", flush=True)
        if step % a.eval_every == 0 or step == a.steps:
            bpb = held_out_bpb(m, held_ids[:65536], SEQ)
            log.append({"step": step, "held_out_bpb_64k": bpb, "seconds": spent})
            print(f"  held-out (first 64 KiB) {bpb:.3f} bits/byte", flush=True)
            torch.save({"model": m.state_dict(), "opt": opt.state_dict(), "step": step,
                        "seconds": spent, "log": log}, ck + ".tmp")
            os.replace(ck + ".tmp", ck)
    bpb = held_out_bpb(m, held_ids, SEQ)
    print(f"held-out bits per byte (all {len(held)} files, {len(held_ids)} tokens): {bpb:.4f}")
    w = hf_weights(m)
    np.savez(os.path.join(a.out, "weights.npz"), **w)
    hf = dict(cfg, architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
              max_position_embeddings=SEQ, tie_word_embeddings=False, attention_bias=False,
              mlp_bias=False, rope_scaling=None, torch_dtype="float32", rope_style="gptj",
              bos_token_id=corpus.BOS, eos_token_id=2)
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(hf, f, indent=1, sort_keys=True)
    meta = {"held_out_bpb": bpb, "held_out_files": len(held), "held_out_tokens": int(len(held_ids)),
            "train_files": len(train_files), "train_tokens": int(len(data)), "steps": a.steps,
            "batch": BATCH, "seq": SEQ, "lr": a.lr, "seed": a.seed, "threads": a.threads,
            "tokens_seen": a.steps * BATCH * SEQ, "train_seconds": round(spent, 1),
            "wall_seconds_last_run": round(time.time() - t_run, 1),
            "corpus_digest": corpus.corpus_digest(train_files + held), "log": log,
            "params": int(sum(p_.numel() for p_ in m.parameters())), "torch": torch.__version__}
    with open(os.path.join(a.out, "train.json"), "w") as f:
        json.dump(meta, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
