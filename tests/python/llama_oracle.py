#!/usr/bin/env python3
"""memfl's Llama against an outside implementation on the same weights.

Writes a random Llama checkpoint (safetensors, Hugging Face tensor names),
random tokens, asks `memfl bench llm --weights` for its logits and loss, and
compares them with the oracle's:
  --oracle torch         a Llama forward written here in plain torch ops
                         (Debian's python3-torch; what CI runs)
  --oracle transformers  Hugging Face's LlamaForCausalLM, checkpoint written by
                         its save_pretrained (the GPU machine)
Tolerance: f32 1e-4 (relative to the largest logit), bf16/f16 a few units of
the dtype's rounding (2^-8 for bf16) per layer, since every layer rounds its
output once.
Exit 0 when within tolerance; one JSON line with the figures either way.
"""
import argparse
import json
import math
import os
import struct
import subprocess
import sys
import tempfile

import torch

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
ST_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
EPS = {"f32": 2.0 ** -23, "bf16": 2.0 ** -8, "f16": 2.0 ** -11}


def write_safetensors(path, tensors):
    """tensors: list of (name, tensor) in the order to store them."""
    header, offset, blobs = {}, 0, []
    for name, t in tensors:
        t = t.detach().contiguous().cpu()
        raw = t.view(torch.uint8).numpy().tobytes() if t.dtype == torch.bfloat16 else t.numpy().tobytes()
        header[name] = {"dtype": ST_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
        blobs.append(raw)
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)


def random_weights(s, dtype, seed):
    g = torch.Generator().manual_seed(seed)

    def mat(*shape):
        return (torch.randn(*shape, generator=g) * 0.05).to(dtype)

    def norm(n):  # not all ones, so a wrong norm weight would show
        return (1.0 + 0.1 * torch.randn(n, generator=g)).to(dtype)

    hd = s["hidden"] // s["heads"]
    w = [("model.embed_tokens.weight", mat(s["vocab"], s["hidden"]))]
    for i in range(s["layers"]):
        p = f"model.layers.{i}."
        w += [
            (p + "input_layernorm.weight", norm(s["hidden"])),
            (p + "self_attn.q_proj.weight", mat(s["heads"] * hd, s["hidden"])),
            (p + "self_attn.k_proj.weight", mat(s["kv_heads"] * hd, s["hidden"])),
            (p + "self_attn.v_proj.weight", mat(s["kv_heads"] * hd, s["hidden"])),
            (p + "self_attn.o_proj.weight", mat(s["hidden"], s["heads"] * hd)),
            (p + "post_attention_layernorm.weight", norm(s["hidden"])),
            (p + "mlp.gate_proj.weight", mat(s["intermediate"], s["hidden"])),
            (p + "mlp.up_proj.weight", mat(s["intermediate"], s["hidden"])),
            (p + "mlp.down_proj.weight", mat(s["hidden"], s["intermediate"])),
        ]
    w += [("model.norm.weight", norm(s["hidden"])), ("lm_head.weight", mat(s["vocab"], s["hidden"]))]
    return w


def torch_reference(s, weights, x):
    """The Llama forward in f32 from the published architecture: RMSNorm,
    rotary embedding on the two halves of each head, grouped-query causal
    attention, SwiGLU MLP; written independently of memfl's module."""
    w = {k: v.float() for k, v in weights}
    hd = s["hidden"] // s["heads"]
    b, t = x.shape

    def rms(v, weight):
        return weight * (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + s["eps"]))

    inv = 1.0 / (s["theta"] ** (torch.arange(0, hd, 2).float() / hd))
    ang = torch.outer(torch.arange(t).float(), inv)
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)

    def rope(v):
        x1, x2 = v[..., : hd // 2], v[..., hd // 2 :]
        return v * cos + torch.cat([-x2, x1], -1) * sin

    h = w["model.embed_tokens.weight"][x]
    mask = torch.full((t, t), float("-inf")).triu(1)
    for i in range(s["layers"]):
        p = f"model.layers.{i}."
        a = rms(h, w[p + "input_layernorm.weight"])
        q = (a @ w[p + "self_attn.q_proj.weight"].T).view(b, t, s["heads"], hd).transpose(1, 2)
        k = (a @ w[p + "self_attn.k_proj.weight"].T).view(b, t, s["kv_heads"], hd).transpose(1, 2)
        v = (a @ w[p + "self_attn.v_proj.weight"].T).view(b, t, s["kv_heads"], hd).transpose(1, 2)
        q, k = rope(q), rope(k)
        rep = s["heads"] // s["kv_heads"]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd) + mask, -1) @ v
        h = h + att.transpose(1, 2).reshape(b, t, -1) @ w[p + "self_attn.o_proj.weight"].T
        m = rms(h, w[p + "post_attention_layernorm.weight"])
        g = m @ w[p + "mlp.gate_proj.weight"].T
        u = m @ w[p + "mlp.up_proj.weight"].T
        h = h + (torch.nn.functional.silu(g) * u) @ w[p + "mlp.down_proj.weight"].T
    return rms(h, w["model.norm.weight"]) @ w["lm_head.weight"].T


def transformers_reference(s, dtype, seed, folder, x, device):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=s["hidden"], num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"], intermediate_size=s["intermediate"], vocab_size=s["vocab"],
        rope_theta=s["theta"], rms_norm_eps=s["eps"], max_position_embeddings=max(2048, x.shape[1]),
        tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(dtype).to(device).eval()
    with torch.no_grad():  # weights of a visible size (the default init gives tiny logits)
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p.float()).mul_(0.05).add_(1.0 if p.dim() == 1 else 0.0).to(dtype))
    model.save_pretrained(folder, safe_serialization=True)
    with torch.no_grad():
        return model(input_ids=x.to(device)).logits.float().cpu()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--memfl", required=True)
    ap.add_argument("--oracle", choices=["torch", "transformers"], default="torch")
    ap.add_argument("--dtype", choices=list(DTYPES), default="f32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=96)
    ap.add_argument("--vocab", type=int, default=200)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=24)
    ap.add_argument("--seed", type=int, default=7)
    a = ap.parse_args()
    s = {"hidden": a.hidden, "layers": a.layers, "heads": a.heads, "kv_heads": a.kv_heads,
         "intermediate": a.intermediate, "vocab": a.vocab, "theta": 500000.0, "eps": 1e-5}
    dtype = DTYPES[a.dtype]
    torch.manual_seed(a.seed)
    tokens = torch.randint(0, a.vocab, (a.batch, a.seq + 1), dtype=torch.int64)
    x, y = tokens[:, :-1], tokens[:, 1:]
    with tempfile.TemporaryDirectory() as d:
        if a.oracle == "transformers":
            ref = transformers_reference(s, dtype, a.seed, d, x, a.device)
            ckpt = os.path.join(d, "model.safetensors")
        else:
            weights = random_weights(s, dtype, a.seed)
            ckpt = os.path.join(d, "model.safetensors")
            write_safetensors(ckpt, weights)
            ref = torch_reference(s, weights, x)
        tok_path, logit_path = os.path.join(d, "tokens.bin"), os.path.join(d, "logits.bin")
        tokens.numpy().tofile(tok_path)
        cmd = [a.memfl, "bench", "llm", "--model", "llama", "--hidden", str(a.hidden), "--layers", str(a.layers),
               "--heads", str(a.heads), "--kv-heads", str(a.kv_heads), "--intermediate", str(a.intermediate),
               "--vocab", str(a.vocab), "--dtype", a.dtype, "--device", a.device, "--batch", str(a.batch),
               "--seq", str(a.seq), "--weights", ckpt, "--tokens", tok_path, "--logits-out", logit_path]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            print(out.stdout, out.stderr, file=sys.stderr)
            return 2
        got = json.loads(out.stdout.strip().splitlines()[-1])
        import numpy as np
        logits = torch.from_numpy(np.fromfile(logit_path, dtype=np.float32)).view(a.batch, a.seq, a.vocab)
    ref_loss = torch.nn.functional.cross_entropy(ref.reshape(-1, a.vocab), y.reshape(-1)).item()
    scale = ref.abs().max().item()
    diff = (logits - ref).abs().max().item()
    # f32: summation order only; lower precisions round once per layer and
    # op, so a few units of the dtype's epsilon per layer.
    tol = 1e-4 if a.dtype == "f32" else 4 * EPS[a.dtype] * (a.layers + 2)
    loss_tol = 1e-4 if a.dtype == "f32" else 4 * EPS[a.dtype] * (a.layers + 2)
    rec = {"oracle": a.oracle, "dtype": a.dtype, "device": a.device, "max_abs_logit_diff": diff,
           "max_abs_logit": scale, "relative_diff": diff / scale, "tolerance": tol, "memfl_loss": got["loss"],
           "oracle_loss": ref_loss, "loss_rel_diff": abs(got["loss"] - ref_loss) / ref_loss,
           "attention": got.get("attention")}
    ok = rec["relative_diff"] <= tol and rec["loss_rel_diff"] <= loss_tol
    rec["ok"] = ok
    print(json.dumps(rec))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
