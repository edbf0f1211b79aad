#!/usr/bin/env python3
"""memfl's LoRA against Hugging Face PEFT, both ways, on the same weights.

Where transformers and peft are installed (the GPU machine; never a memfl
dependency):
  1. transformers writes a random Llama checkpoint (save_pretrained), peft
     wraps it with LoRA on all seven linear layers and trains the adapters a
     few AdamW steps, then saves them (adapter_config.json +
     adapter_model.safetensors). memfl reads that folder as init_adapters
     reads it (`memfl bench llm --weights FOLDER --lora-r …`) over the same
     checkpoint and gives peft's logits.
  2. memfl trains adapters federated (`memfl run`, 2 clients, 2 rounds, over
     that checkpoint); peft loads the run's adapter/ folder onto
     transformers' model (PeftModel.from_pretrained) and gives the logits
     memfl computes with those adapters.
Tolerance as tests/python/llama_oracle.py: f32 1e-4 of the largest logit,
bf16 a few units of 2^-8 per layer. One JSON line per check; exit 0 when both
are within it.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch

EPS = {"f32": 2.0 ** -23, "bf16": 2.0 ** -8}
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def memfl_logits(a, s, base, adapters, tokens, d):
    tok, out = os.path.join(d, "tokens.bin"), os.path.join(d, "logits.bin")
    tokens.numpy().tofile(tok)
    cmd = [a.memfl, "bench", "llm", "--model", "llama", "--hidden", str(s["hidden"]), "--layers", str(s["layers"]),
           "--heads", str(s["heads"]), "--kv-heads", str(s["kv_heads"]), "--intermediate", str(s["intermediate"]),
           "--vocab", str(s["vocab"]), "--dtype", a.dtype, "--device", a.device, "--batch", str(tokens.shape[0]),
           "--seq", str(tokens.shape[1] - 1), "--hf-checkpoint", base, "--lora-r", str(a.r),
           "--lora-alpha", str(a.alpha), "--target-modules", "all-linear", "--weights", adapters,
           "--tokens", tok, "--logits-out", out]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}\n{r.stdout}\n{r.stderr}")
    return torch.from_numpy(np.fromfile(out, dtype=np.float32)).view(tokens.shape[0], tokens.shape[1] - 1, -1)


def compare(name, a, s, got, ref):
    scale = ref.abs().max().item()
    diff = (got - ref).abs().max().item()
    tol = 1e-4 if a.dtype == "f32" else 4 * EPS[a.dtype] * (s["layers"] + 2)
    rec = {"check": name, "dtype": a.dtype, "device": a.device, "max_abs_logit_diff": diff, "max_abs_logit": scale,
           "relative_diff": diff / scale, "tolerance": tol, "ok": diff / scale <= tol}
    print(json.dumps(rec))
    return rec["ok"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--memfl", required=True)
    ap.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--r", type=int, default=8)
    ap.add_argument("--alpha", type=float, default=16.0)
    a = ap.parse_args()
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    # vocab 256: memfl run's SyntheticTokens are bytes.
    s = {"hidden": 128, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 256, "vocab": 256}
    dtype = DTYPES[a.dtype]
    cfg = LlamaConfig(hidden_size=s["hidden"], num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                      num_key_value_heads=s["kv_heads"], intermediate_size=s["intermediate"], vocab_size=s["vocab"],
                      rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(3)

    def base_model():
        m = LlamaForCausalLM(cfg).to(dtype).to(a.device)
        with torch.no_grad():  # weights of a visible size, the same every call
            g = torch.Generator().manual_seed(5)
            for _, p in m.named_parameters():
                v = torch.randn(p.shape, generator=g) * 0.05 + (1.0 if p.dim() == 1 else 0.0)
                p.copy_(v.to(dtype))
        return m

    ok = True
    with tempfile.TemporaryDirectory() as d:
        base_dir, adapter_dir = os.path.join(d, "base"), os.path.join(d, "peft_adapter")
        base_model().save_pretrained(base_dir, safe_serialization=True)
        tokens = torch.randint(0, s["vocab"], (2, 33), dtype=torch.int64)

        # 1. peft's adapters, trained by peft, into memfl.
        model = get_peft_model(base_model(), LoraConfig(r=a.r, lora_alpha=a.alpha, lora_dropout=0.0,
                                                        target_modules=MODULES, task_type="CAUSAL_LM"))
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        model.train()
        for _ in range(5):
            x = torch.randint(0, s["vocab"], (4, 33), device=a.device)
            model(input_ids=x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        model.eval()
        model.save_pretrained(adapter_dir)
        with torch.no_grad():
            ref = model(input_ids=tokens[:, :-1].to(a.device)).logits.float().cpu()
        ok &= compare("peft_adapters_into_memfl", a, s, memfl_logits(a, s, base_dir, adapter_dir, tokens, d), ref)

        # 2. memfl's federated adapters into peft.
        run_cfg = os.path.join(d, "lora.yaml")
        with open(run_cfg, "w") as f:
            f.write(f"""client_configs:
  train_configs:
    trainer: VanillaTrainer
    mode: step
    num_local_steps: 5
    optim: Adam
    optim_args: {{lr: 0.01}}
    train_batch_size: 4
    device: {a.device}
    lora: {{r: {a.r}, lora_alpha: {a.alpha}, target_modules: all-linear}}
  model_configs:
    model_name: llama
    hf_checkpoint: {base_dir}
    model_kwargs: {{seq_length: 32}}
  data_configs:
    dataset_name: SyntheticTokens
    dataset_kwargs: {{num_train_samples: 64, num_test_samples: 8}}
server_configs:
  num_clients: 2
  num_global_epochs: 2
  do_server_eval: false
""")
        r = subprocess.run([a.memfl, "run", run_cfg, "-q", "--out", os.path.join(d, "run")], capture_output=True,
                           text=True)
        if r.returncode != 0:
            raise RuntimeError(r.stdout + r.stderr)
        memfl_adapter = os.path.join(d, "run", "adapter")
        peft_model = PeftModel.from_pretrained(base_model(), memfl_adapter).eval()
        with torch.no_grad():
            ref = peft_model(input_ids=tokens[:, :-1].to(a.device)).logits.float().cpu()
        ok &= compare("memfl_adapters_into_peft", a, s, memfl_logits(a, s, base_dir, memfl_adapter, tokens, d), ref)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
