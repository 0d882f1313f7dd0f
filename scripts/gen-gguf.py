#!/usr/bin/python3
"""gen-gguf.py — writes a Llama-architecture GGUF v3 model with seeded random
weights, for tests and benchmarks (no gguf library: the format is written here,
after ggml's docs/gguf.md and gguf.h of the pinned llama.cpp release).

    /usr/bin/python3 scripts/gen-gguf.py -o m.gguf [--arch llama|qwen2]
        [--layers 2] [--width 128] [--heads 4] [--kv-heads 2] [--head-dim D]
        [--ffn 256] [--rope-base 10000] [--rope-dim R]
        [--rope-scaling none|linear|yarn] [--rope-factor F] [--orig-ctx N]
        [--yarn-beta-fast 32] [--yarn-beta-slow 1] [--yarn-ext-factor E]
        [--yarn-attn-factor A] [--yarn-log-mul M]
        [--ctx 4096] [--dtype f32|f16] [--seed 1] [--eps 1e-5] [--qkv-bias]
        [--std S] [--name NAME] [--fim]
    /usr/bin/python3 scripts/gen-gguf.py -o m.gguf --hf DIR [--dtype f16]
        trained weights instead of random ones: DIR/config.json (HF Llama
        shape, rope_style "gptj") and DIR/weights.npz (HF tensor names,
        [out, in]); the shape flags are then read from the config, and a
        vocab_size of 267 means the FIM tokens (--fim)

Invariants:
  - Same arguments, same bytes (the weights come from numpy's PCG64 seeded with
    --seed; nothing depends on time or the machine).
  - `llama` pairs RoPE dimensions (2i, 2i+1) (llama.cpp's NORM rope type);
    `qwen2` pairs (i, i + rot/2) (NEOX). Shape keys are written so that
    llama.cpp's loader accepts them: head_dim via attention.key_length /
    value_length, rotary dims via rope.dimension_count (llama requires it equal
    to head_dim; qwen2 requires heads * head_dim == width).
  - Tokenizer: SentencePiece-style ("llama" model) with <unk>, <s>, </s>, the
    256 byte tokens <0x00>..<0xFF> and U+2581 (the space), so llama_tokenize
    turns any text into one token per byte (plus BOS), and detokenises it back.
    No space prefix is added.
  - --fim appends the fill-in-the-middle tokens of FIM_TOKENS (ids 260..266,
    control tokens, Qwen2.5-Coder's texts) and writes their ids under the keys
    llama.cpp v0.5.0 reads (tokenizer.ggml.fim_*_token_id, eot_token_id), so
    llama_vocab_fim_pre() etc. return them and llama-server's /infill accepts
    the model. The byte tokens keep their ids. eval/fim.py reads FIM_TOKENS
    from here: one table for the tokenizer and the training.
  - Matrices are f32 or f16 (--dtype); norms and biases are always f32.
  - YaRN: the writer records every parameter given. llama.cpp v0.5.0 reads
    rope.scaling.{type,factor,original_context_length,attn_factor} for these
    architectures but not the yarn_beta_* / yarn_ext_factor keys (it uses its
    defaults 32 / 1 / 1 unless the context parameters say otherwise), so a
    worker sets llama_context_params from the profile the bridge reads.
"""
import argparse
import struct
import sys

import numpy as np

GGUF_MAGIC = 0x46554747  # "GGUF"
GGUF_VERSION = 3
ALIGN = 32

# Fill-in-the-middle tokens (--fim), in id order after the byte vocabulary:
# (name, text, GGUF key holding its id).
FIM_TOKENS = [
    ("pre", "<|fim_prefix|>", "tokenizer.ggml.fim_pre_token_id"),
    ("suf", "<|fim_suffix|>", "tokenizer.ggml.fim_suf_token_id"),
    ("mid", "<|fim_middle|>", "tokenizer.ggml.fim_mid_token_id"),
    ("pad", "<|fim_pad|>", "tokenizer.ggml.fim_pad_token_id"),
    ("rep", "<|repo_name|>", "tokenizer.ggml.fim_rep_token_id"),
    ("sep", "<|file_sep|>", "tokenizer.ggml.fim_sep_token_id"),
    ("eot", "<|endoftext|>", "tokenizer.ggml.eot_token_id"),
]

# gguf_type
T_UINT8, T_INT8, T_UINT16, T_INT16, T_UINT32, T_INT32, T_FLOAT32, T_BOOL, \
    T_STRING, T_ARRAY, T_UINT64, T_INT64, T_FLOAT64 = range(13)
# ggml_type
GGML_F32, GGML_F16 = 0, 1


def w_str(f, s):
    b = s.encode("utf-8")
    f.write(struct.pack("<Q", len(b)))
    f.write(b)


class KV:
    def __init__(self):
        self.items = []

    def add(self, key, vtype, value, atype=None):
        self.items.append((key, vtype, value, atype))

    def u32(self, k, v): self.add(k, T_UINT32, int(v))
    def i32(self, k, v): self.add(k, T_INT32, int(v))
    def f32(self, k, v): self.add(k, T_FLOAT32, float(v))
    def b(self, k, v): self.add(k, T_BOOL, bool(v))
    def s(self, k, v): self.add(k, T_STRING, str(v))
    def arr(self, k, atype, v): self.add(k, T_ARRAY, list(v), atype)

    def write(self, f):
        for key, vtype, value, atype in self.items:
            w_str(f, key)
            f.write(struct.pack("<I", vtype))
            if vtype == T_ARRAY:
                f.write(struct.pack("<IQ", atype, len(value)))
                if atype == T_STRING:
                    for x in value:
                        w_str(f, x)
                elif atype == T_FLOAT32:
                    f.write(np.asarray(value, dtype="<f4").tobytes())
                elif atype == T_INT32:
                    f.write(np.asarray(value, dtype="<i4").tobytes())
                else:
                    raise ValueError("array type %d" % atype)
            else:
                write_scalar(f, vtype, value)


def write_scalar(f, vtype, v):
    if vtype == T_UINT32:
        f.write(struct.pack("<I", v))
    elif vtype == T_INT32:
        f.write(struct.pack("<i", v))
    elif vtype == T_FLOAT32:
        f.write(struct.pack("<f", v))
    elif vtype == T_BOOL:
        f.write(struct.pack("<B", 1 if v else 0))
    elif vtype == T_STRING:
        w_str(f, v)
    else:
        raise ValueError("type %d" % vtype)


def parse_args(argv):
    p = argparse.ArgumentParser(description="write a seeded random Llama-architecture GGUF v3 model")
    p.add_argument("-o", "--out", required=True, help="the GGUF file to write")
    p.add_argument("--arch", choices=["llama", "qwen2"], default="llama",
                   help="general.architecture: llama (RoPE pairs adjacent values) or qwen2 "
                   "(NEOX halves; needs heads * head-dim == width) (default llama)")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks (default 2)")
    p.add_argument("--width", type=int, default=128, help="embedding width n_embd (default 128)")
    p.add_argument("--heads", type=int, default=4, help="query heads (default 4)")
    p.add_argument("--kv-heads", type=int, default=None,
                   help="key/value heads, dividing --heads (GQA) (default: --heads)")
    p.add_argument("--head-dim", type=int, default=None,
                   help="values per head (default: width / heads)")
    p.add_argument("--ffn", type=int, default=None,
                   help="feed-forward width (default: 2 * width)")
    p.add_argument("--rope-base", type=float, default=10000.0,
                   help="RoPE frequency base theta (default 10000)")
    p.add_argument("--rope-dim", type=int, default=None,
                   help="rotated values per head, even, at most --head-dim (qwen2 only; "
                   "default: head-dim)")
    p.add_argument("--rope-scaling", choices=["none", "linear", "yarn"], default="none",
                   help="RoPE context extension (linear and yarn need --rope-factor) "
                   "(default none)")
    p.add_argument("--rope-factor", type=float, default=None,
                   help="scaling factor of --rope-scaling, > 0")
    p.add_argument("--orig-ctx", type=int, default=None,
                   help="YaRN: the original training context length (default: --ctx)")
    p.add_argument("--yarn-beta-fast", type=float, default=None,
                   help="YaRN beta_fast, recorded in the GGUF (llama.cpp uses 32 unless its "
                   "context parameters say otherwise)")
    p.add_argument("--yarn-beta-slow", type=float, default=None,
                   help="YaRN beta_slow, recorded (llama.cpp's default 1)")
    p.add_argument("--yarn-ext-factor", type=float, default=None,
                   help="YaRN extrapolation mix, recorded (llama.cpp's default 1)")
    p.add_argument("--yarn-attn-factor", type=float, default=None,
                   help="YaRN attention magnitude factor (rope.scaling.attn_factor)")
    p.add_argument("--yarn-log-mul", type=float, default=None,
                   help="YaRN log multiplier (rope.scaling.yarn_log_multiplier)")
    p.add_argument("--ctx", type=int, default=4096,
                   help="context_length the model declares (default 4096)")
    p.add_argument("--dtype", choices=["f32", "f16"], default="f32",
                   help="type of the weight matrices; norms and biases stay f32 (default f32)")
    p.add_argument("--seed", type=int, default=1,
                   help="seed of the random weights: same seed, same file (default 1)")
    p.add_argument("--eps", type=float, default=1e-5,
                   help="RMSNorm epsilon (default 1e-5)")
    p.add_argument("--qkv-bias", action="store_true",
                   help="add q/k/v biases (as qwen2 has)")
    p.add_argument("--std", type=float, default=None,
                   help="weight std (default 1/sqrt(fan_in); embeddings 1)")
    p.add_argument("--name", default=None,
                   help="general.name (default kvrope-ARCH-random-NL-WIDTH; -trained- with --hf)")
    p.add_argument("--hf", default=None, help="trained weights: a directory with config.json (the shape) and weights.npz (HF tensor names)")
    p.add_argument("--fim", action="store_true",
                   help="add the fill-in-the-middle tokens (ids 260..266) and their GGUF keys")
    p.add_argument("--spm-infill", action="store_true",
                   help="write kvrope.infill.spm = true: the model was trained on /infill's suffix-first "
                        "layout, and kvrope serve lays its prompts out so (implied by an --hf config "
                        "with \"fim_order\": \"spm\")")
    a = p.parse_args(argv)
    a.weights = None
    if a.hf is not None:
        hf_shape(a, p)
    a.kv_heads = a.kv_heads or a.heads
    a.head_dim = a.head_dim or a.width // a.heads
    a.ffn = a.ffn or 2 * a.width
    a.rope_dim = a.rope_dim or a.head_dim

    def die(msg):
        p.error(msg)
    if a.spm_infill and not a.fim:
        die("--spm-infill needs the FIM tokens (--fim)")
    if min(a.layers, a.width, a.heads, a.kv_heads, a.head_dim, a.ffn) <= 0:
        die("shape values must be positive")
    if a.heads % a.kv_heads:
        die("--heads must be a multiple of --kv-heads")
    if a.rope_dim % 2 or a.rope_dim > a.head_dim:
        die("--rope-dim must be even and at most --head-dim")
    if a.arch == "llama" and a.rope_dim != a.head_dim:
        die("llama.cpp requires rope.dimension_count == head_dim for arch llama")
    if a.arch == "qwen2" and a.heads * a.head_dim != a.width:
        die("llama.cpp's qwen2 requires heads * head_dim == width")
    if a.rope_scaling != "none":
        if a.rope_factor is None or a.rope_factor <= 0:
            die("--rope-scaling %s needs --rope-factor > 0" % a.rope_scaling)
    if a.rope_scaling == "yarn" and a.orig_ctx is None:
        a.orig_ctx = a.ctx
    return a


# HF Llama tensor names for the GGUF ones (llama arch, interleaved RoPE: the
# weights were trained with ggml's pairing, so q/k need no permutation).
def hf_name(gguf):
    fixed = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
    if gguf in fixed:
        return fixed[gguf]
    _, i, rest = gguf.split(".", 2)
    m = {"attn_norm.weight": "input_layernorm.weight", "attn_q.weight": "self_attn.q_proj.weight",
         "attn_k.weight": "self_attn.k_proj.weight", "attn_v.weight": "self_attn.v_proj.weight",
         "attn_output.weight": "self_attn.o_proj.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
         "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
         "ffn_down.weight": "mlp.down_proj.weight"}
    return "model.layers.%s.%s" % (i, m[rest])


def hf_shape(a, p):
    import json
    import os
    try:
        with open(os.path.join(a.hf, "config.json")) as f:
            c = json.load(f)
        w = np.load(os.path.join(a.hf, "weights.npz"))
    except (OSError, ValueError) as e:
        p.error("--hf %s: %s" % (a.hf, e))
    if c.get("model_type") != "llama" or c.get("rope_style") != "gptj" or c.get("rope_scaling"):
        p.error("--hf: only llama configs with rope_style gptj and no rope_scaling are supported")
    a.arch = "llama"
    a.layers, a.width = int(c["num_hidden_layers"]), int(c["hidden_size"])
    a.heads, a.kv_heads = int(c["num_attention_heads"]), int(c["num_key_value_heads"])
    a.head_dim = int(c.get("head_dim") or a.width // a.heads)
    a.ffn, a.rope_base = int(c["intermediate_size"]), float(c.get("rope_theta", 10000.0))
    a.eps, a.ctx = float(c.get("rms_norm_eps", 1e-5)), int(c.get("max_position_embeddings", 4096))
    a.rope_dim, a.qkv_bias = a.head_dim, False
    a.weights = {k: w[k] for k in w.files}
    if int(c["vocab_size"]) == len(vocab(True)[0]):
        a.fim = True
    if c.get("fim_order", "psm") == "spm":
        a.spm_infill = True
    elif int(c["vocab_size"]) != len(vocab(a.fim)[0]):
        p.error("--hf: vocab_size %s, the byte tokenizer has %d (%d with the FIM tokens)"
                % (c["vocab_size"], len(vocab(False)[0]), len(vocab(True)[0])))


def vocab(fim=False):
    toks = ["<unk>", "<s>", "</s>"] + ["<0x%02X>" % i for i in range(256)] + ["\u2581"]
    types = [2, 3, 3] + [6] * 256 + [1]
    scores = [0.0] * len(toks)
    scores[-1] = -1.0
    if fim:
        toks += [t for _, t, _ in FIM_TOKENS]
        types += [3] * len(FIM_TOKENS)     # LLAMA_TOKEN_TYPE_CONTROL
        scores += [0.0] * len(FIM_TOKENS)
    return toks, scores, types


FIM_FIRST_ID = len(vocab(False)[0])


def tensors(a, n_vocab):
    """(name, ne list innermost first, is_matrix, fan_in)"""
    E, H, Hk, D, F = a.width, a.heads, a.kv_heads, a.head_dim, a.ffn
    out = [("token_embd.weight", [E, n_vocab], True, None)]
    for i in range(a.layers):
        b = "blk.%d." % i
        out += [
            (b + "attn_norm.weight", [E], False, None),
            (b + "attn_q.weight", [E, H * D], True, E),
            (b + "attn_k.weight", [E, Hk * D], True, E),
            (b + "attn_v.weight", [E, Hk * D], True, E),
        ]
        if a.qkv_bias:
            out += [
                (b + "attn_q.bias", [H * D], False, "bias"),
                (b + "attn_k.bias", [Hk * D], False, "bias"),
                (b + "attn_v.bias", [Hk * D], False, "bias"),
            ]
        out += [
            (b + "attn_output.weight", [H * D, E], True, H * D),
            (b + "ffn_norm.weight", [E], False, None),
            (b + "ffn_gate.weight", [E, F], True, E),
            (b + "ffn_up.weight", [E, F], True, E),
            (b + "ffn_down.weight", [F, E], True, F),
        ]
    out += [("output_norm.weight", [E], False, None),
            ("output.weight", [E, n_vocab], True, E)]
    return out


def main(argv):
    a = parse_args(argv)
    arch = a.arch
    toks, scores, types = vocab(a.fim)
    n_vocab = len(toks)

    kv = KV()
    kv.s("general.architecture", arch)
    kv.s("general.name", a.name or "kvrope-%s-%s-%dL-%d" % (arch, "trained" if a.weights else "random",
                                                            a.layers, a.width))
    kv.u32("general.file_type", 1 if a.dtype == "f16" else 0)
    kv.u32("general.alignment", ALIGN)
    kv.u32(arch + ".context_length", a.ctx)
    kv.u32(arch + ".embedding_length", a.width)
    kv.u32(arch + ".block_count", a.layers)
    kv.u32(arch + ".feed_forward_length", a.ffn)
    kv.u32(arch + ".attention.head_count", a.heads)
    kv.u32(arch + ".attention.head_count_kv", a.kv_heads)
    kv.u32(arch + ".attention.key_length", a.head_dim)
    kv.u32(arch + ".attention.value_length", a.head_dim)
    kv.f32(arch + ".attention.layer_norm_rms_epsilon", a.eps)
    kv.u32(arch + ".rope.dimension_count", a.rope_dim)
    kv.f32(arch + ".rope.freq_base", a.rope_base)
    kv.u32(arch + ".vocab_size", n_vocab)
    if a.rope_scaling != "none":
        kv.s(arch + ".rope.scaling.type", a.rope_scaling)
        kv.f32(arch + ".rope.scaling.factor", a.rope_factor)
        if a.orig_ctx is not None:
            kv.u32(arch + ".rope.scaling.original_context_length", a.orig_ctx)
    if a.rope_scaling == "yarn":
        if a.yarn_beta_fast is not None:
            kv.f32(arch + ".rope.scaling.yarn_beta_fast", a.yarn_beta_fast)
        if a.yarn_beta_slow is not None:
            kv.f32(arch + ".rope.scaling.yarn_beta_slow", a.yarn_beta_slow)
        if a.yarn_ext_factor is not None:
            kv.f32(arch + ".rope.scaling.yarn_ext_factor", a.yarn_ext_factor)
        if a.yarn_attn_factor is not None:
            kv.f32(arch + ".rope.scaling.attn_factor", a.yarn_attn_factor)
        if a.yarn_log_mul is not None:
            kv.f32(arch + ".rope.scaling.yarn_log_multiplier", a.yarn_log_mul)
    kv.s("tokenizer.ggml.model", "llama")
    kv.arr("tokenizer.ggml.tokens", T_STRING, toks)
    kv.arr("tokenizer.ggml.scores", T_FLOAT32, scores)
    kv.arr("tokenizer.ggml.token_type", T_INT32, types)
    kv.u32("tokenizer.ggml.unknown_token_id", 0)
    kv.u32("tokenizer.ggml.bos_token_id", 1)
    kv.u32("tokenizer.ggml.eos_token_id", 2)
    kv.b("tokenizer.ggml.add_bos_token", True)
    kv.b("tokenizer.ggml.add_eos_token", False)
    kv.b("tokenizer.ggml.add_space_prefix", False)
    if a.fim:
        for i, (_, _, key) in enumerate(FIM_TOKENS):
            kv.u32(key, FIM_FIRST_ID + i)
    if a.spm_infill:
        kv.b("kvrope.infill.spm", True)

    tlist = tensors(a, n_vocab)
    wtype = GGML_F16 if a.dtype == "f16" else GGML_F32
    infos, offset = [], 0
    for name, ne, is_mat, fan in tlist:
        n = int(np.prod(ne))
        gt = wtype if is_mat else GGML_F32
        nbytes = n * (2 if gt == GGML_F16 else 4)
        infos.append((name, ne, gt, offset, nbytes, is_mat, fan))
        offset += (nbytes + ALIGN - 1) // ALIGN * ALIGN

    rng = np.random.Generator(np.random.PCG64(a.seed))
    with open(a.out, "wb") as f:
        f.write(struct.pack("<IIQQ", GGUF_MAGIC, GGUF_VERSION, len(infos), len(kv.items)))
        kv.write(f)
        for name, ne, gt, off, _, _, _ in infos:
            w_str(f, name)
            f.write(struct.pack("<I", len(ne)))
            f.write(struct.pack("<%dQ" % len(ne), *ne))
            f.write(struct.pack("<IQ", gt, off))
        pad = (-f.tell()) % ALIGN
        f.write(b"\0" * pad)
        base = f.tell()
        for name, ne, gt, off, nbytes, is_mat, fan in infos:
            n = int(np.prod(ne))
            if a.weights is not None:
                x = np.asarray(a.weights[hf_name(name)], dtype=np.float32)
                if x.size != n or list(x.shape[::-1]) != list(ne):
                    raise SystemExit("gen-gguf: %s has shape %s, expected %s" % (hf_name(name), x.shape,
                                                                                 tuple(ne[::-1])))
                x = x.reshape(-1)
            elif fan == "bias":
                x = rng.standard_normal(n, dtype=np.float32) * np.float32(0.1)
            elif not is_mat:
                # norms: around 1, so that activations stay well scaled
                x = (1.0 + 0.1 * rng.standard_normal(n, dtype=np.float32)).astype(np.float32)
            else:
                std = a.std if a.std is not None else (1.0 if fan is None else 1.0 / np.sqrt(fan))
                x = rng.standard_normal(n, dtype=np.float32) * np.float32(std)
            data = x.astype("<f2" if gt == GGML_F16 else "<f4").tobytes()
            assert len(data) == nbytes
            assert f.tell() == base + off
            f.write(data)
            f.write(b"\0" * ((-nbytes) % ALIGN))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
