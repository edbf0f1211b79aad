#!/usr/bin/env python3
"""memfl's hf_checkpoint against Hugging Face's own writer.

Builds a small LlamaForCausalLM with transformers, writes it with
save_pretrained (safetensors; sharded when --shard-size is given), runs
`memfl run` with client_configs.model_configs.hf_checkpoint and a
DummyTrainer that changes nothing, and compares memfl's global model, tensor
by tensor, with the model's state dict. Needs transformers (the GPU
machine); one JSON line, exit 0 when every tensor is equal bit for bit.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch


def read_safetensors(path):
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        lo, hi = t["data_offsets"]
        dtype = {"BF16": torch.bfloat16, "F32": torch.float32, "F16": torch.float16}[t["dtype"]]
        out[name] = torch.frombuffer(bytearray(data[lo:hi]), dtype=dtype).view(t["shape"])
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--memfl", required=True)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--tied", action="store_true")
    ap.add_argument("--shard-size", default=None, help="save_pretrained's max_shard_size, e.g. 200KB")
    a = ap.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=96, vocab_size=128, rope_theta=10000.0, rms_norm_eps=1e-6,
                      tie_word_embeddings=a.tied)
    torch.manual_seed(3)
    model = LlamaForCausalLM(cfg).to(getattr(torch, a.dtype))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p.float()).mul_(0.05).to(p.dtype))
    with tempfile.TemporaryDirectory() as d:
        ckpt = os.path.join(d, "ckpt")
        kw = {"safe_serialization": True}
        if a.shard_size:
            kw["max_shard_size"] = a.shard_size
        model.save_pretrained(ckpt, **kw)
        run_yaml = os.path.join(d, "run.yaml")
        with open(run_yaml, "w") as f:
            f.write("client_configs:\n  train_configs:\n    trainer: DummyTrainer\n    dummy_update_scale: 0\n"
                    f"  model_configs:\n    model_name: llama\n    hf_checkpoint: {ckpt}\n"
                    "server_configs:\n  num_clients: 2\n  num_global_epochs: 1\n  do_server_eval: false\n")
        out = subprocess.run([a.memfl, "run", run_yaml, "-q", "--out", os.path.join(d, "run")],
                             capture_output=True, text=True)
        if out.returncode != 0:
            print(out.stdout, out.stderr, file=sys.stderr)
            return 2
        got = read_safetensors(os.path.join(d, "run", "global_model.safetensors"))
        want = {k: v for k, v in model.state_dict().items() if not (a.tied and k == "lm_head.weight")}
        files = sorted(os.listdir(ckpt))
        with open(os.path.join(ckpt, "config.json")) as f:
            written = json.load(f)
        with open(os.path.join(d, "run", "config.yaml")) as f:
            resolved = f.read()
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    unequal = sorted(k for k in set(want) & set(got) if not torch.equal(want[k].contiguous(), got[k]))
    # The rotary base memfl took is the one transformers wrote.
    theta_ok = "rope_theta: 10000" in resolved
    ok = not missing and not extra and not unequal and theta_ok
    print(json.dumps({"dtype": a.dtype, "tied": a.tied, "shard_size": a.shard_size, "files": files,
                      "tensors": len(want), "missing": missing, "extra": extra, "unequal": unequal,
                      "rope_keys": {k: v for k, v in written.items() if "rope" in k or "dtype" in k},
                      "rope_theta_taken": theta_ok, "ok": ok}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
