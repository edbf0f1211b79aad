#!/usr/bin/env python3
"""Hugging Face transformers' LlamaForCausalLM trained on the same shape and
batch as `memfl bench llm`: bf16 weights, SDPA attention, torch AdamW
(weight decay 0, so the update is memfl's Adam's), random tokens. One JSON line:
tokens/s of the timed steps, the CUDA caching allocator's peak over them
(after the warm-up, so the optimizer's state is in it), set-up seconds.
With --lora-r: PEFT's LoRA on the given modules (adapters in float32, as
get_peft_model's autocast keeps them), AdamW on the adapters alone: the
reference of bench/llm_lora_vs_peft.sh.
The side-by-side reference of bench/llm_train_vs_hf.sh; never a dependency.
"""
import argparse
import json
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

PRESETS = {  # the shapes of memfl's presets (src/model/llama.cpp)
    "llama-8b": dict(hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336, vocab=128256),
    "llama-1b": dict(hidden=2048, layers=16, heads=32, kv_heads=8, intermediate=8192, vocab=128256),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama")
    for k, v in dict(hidden=2048, layers=16, heads=16, kv_heads=8, intermediate=5632, vocab=32000).items():
        ap.add_argument("--" + k.replace("_", "-"), type=int, default=v)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--lora-r", type=int, default=0)
    ap.add_argument("--lora-alpha", type=float, default=16.0)
    ap.add_argument("--target-modules", default="all-linear")
    a = ap.parse_args()
    s = PRESETS.get(a.model, dict(hidden=a.hidden, layers=a.layers, heads=a.heads, kv_heads=a.kv_heads,
                                   intermediate=a.intermediate, vocab=a.vocab))
    t0 = time.perf_counter()
    cfg = LlamaConfig(hidden_size=s["hidden"], num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                      num_key_value_heads=s["kv_heads"], intermediate_size=s["intermediate"], vocab_size=s["vocab"],
                      rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=max(a.seq + 1, 2048),
                      tie_word_embeddings=False, attn_implementation="sdpa")
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    model.train()
    if a.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    if a.lora_r > 0:
        from peft import LoraConfig, get_peft_model
        modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"] \
            if a.target_modules == "all-linear" else a.target_modules.split(",")
        model = get_peft_model(model, LoraConfig(r=a.lora_r, lora_alpha=a.lora_alpha, lora_dropout=0.0,
                                                 target_modules=modules, task_type="CAUSAL_LM"))
        if a.gradient_checkpointing:
            model.enable_input_require_grads()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=a.lr, weight_decay=0.0)
    torch.cuda.synchronize()
    setup = time.perf_counter() - t0
    g = torch.Generator(device="cuda").manual_seed(42)

    def step():
        x = torch.randint(0, min(256, s["vocab"]), (a.batch, a.seq + 1), device="cuda", generator=g)
        out = model(input_ids=x[:, :-1], labels=x[:, 1:].contiguous())
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out.loss

    # labels are shifted inside the model too: give it the targets so that
    # the loss is over seq tokens like memfl's (logits[:, i] vs x[:, i + 1]
    # would be shifted twice; the cost is the same either way).
    for _ in range(a.warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t1 = time.perf_counter()
    for _ in range(a.steps):
        loss = step()
    loss = loss.item()
    dt = time.perf_counter() - t1
    n = sum(p.numel() for p in model.parameters() if a.lora_r == 0 or not p.requires_grad)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    # memfl bench llm's count: 6 N + 12 L H T per token (N without the input
    # embedding), two thirds of it over a frozen base.
    non_embedding = n - s["vocab"] * s["hidden"]
    flops = (2 / 3 if a.lora_r > 0 else 1) * (6 * non_embedding + 12 * s["layers"] * s["hidden"] * a.seq)
    tps = a.steps * a.batch * a.seq / dt
    print(json.dumps({
        "impl": "transformers+peft" if a.lora_r > 0 else "transformers", "model": a.model, "num_params": n,
        "trainable_params": trainable, "lora_r": a.lora_r, "flops_per_token": flops,
        "mfu_989_tflops": tps * flops / 989e12, "batch_size": a.batch, "seq_length": a.seq,
        "steps": a.steps, "gradient_checkpointing": a.gradient_checkpointing, "attention": "sdpa",
        "tokens_per_s": tps, "step_seconds": dt,
        "peak_allocated_bytes": torch.cuda.max_memory_allocated(), "setup_seconds": setup, "loss": loss,
        "torch": torch.__version__}))


if __name__ == "__main__":
    main()
