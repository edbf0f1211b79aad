#!/usr/bin/env bash
# An LLM client set up from a Hugging Face checkpoint on one GPU, against
# the disk: `memfl run` of 1 client × 1 step × 1 round, once with
# client_configs.model_configs.hf_checkpoint and once from the seeded init
# of the same shape, and the time `dd` (O_DIRECT, so not the page cache)
# takes to read the checkpoint's files; memfl reads them with their pages
# dropped from the page cache first. The checkpoint is written first by
# transformers' save_pretrained (sharded safetensors, bf16) when CKPT has
# none: transformers is on the GPU machine only, never a memfl dependency.
# One JSON line per run into OUT.
#
#   bash bench/llm_checkpoint_load.sh BUILD/memfl OUT.jsonl [CKPT_DIR]
#   SHAPE=8b (Llama-3.1-8B's config) | 1b (Llama-3.2-1B's)
set -euo pipefail
MEMFL=$1 OUT=$2 CKPT=${3:-/tmp/memfl_hf_ckpt}
SHAPE=${SHAPE:-8b}
here=$(cd "$(dirname "$0")/.." && pwd)
if [ ! -f "$CKPT/config.json" ]; then
  python3 - "$CKPT" "$SHAPE" <<'PY'
import sys, time, torch
from transformers import LlamaConfig, LlamaForCausalLM
out, shape = sys.argv[1:]
kw = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
          intermediate_size=14336, vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5)
if shape == "1b":
    kw.update(hidden_size=2048, num_hidden_layers=16, intermediate_size=8192, tie_word_embeddings=True)
t = time.time()
with torch.device("cuda"):
    model = LlamaForCausalLM(LlamaConfig(**kw)).to(torch.bfloat16)
model.save_pretrained(out, safe_serialization=True, max_shard_size="5GB")
print(f"checkpoint written in {time.time() - t:.1f} s", file=sys.stderr)
PY
fi
bytes=$(cat "$CKPT"/*.safetensors | wc -c)
t0=$(date +%s.%N)
for f in "$CKPT"/*.safetensors; do dd if="$f" of=/dev/null bs=64M iflag=direct status=none; done
t1=$(date +%s.%N)
python3 -c "import json,sys; b,s=int(sys.argv[1]),float(sys.argv[3])-float(sys.argv[2]); print(json.dumps({'run':'dd_direct','bytes':b,'seconds':round(s,3),'gb_per_s':round(b/s/1e9,3)}))" \
  "$bytes" "$t0" "$t1" | tee -a "$OUT"
run() {
  local name=$1
  shift
  local dir
  dir=$(mktemp -d /tmp/memfl_ckpt_run.XXXXXX)
  local s0 s1
  s0=$(date +%s.%N)
  "$MEMFL" run "$here/configs/llama_tiny_tokens.yaml" --out "$dir/run" -q \
    --set client_configs.model_configs.model_kwargs.dtype=bf16 --set client_configs.model_configs.model_kwargs.seq_length=512 \
    --set client_configs.train_configs.device=cuda --set client_configs.train_configs.num_local_steps=1 \
    --set client_configs.train_configs.train_batch_size=4 --set client_configs.train_configs.optim_args.lr=1e-5 \
    --set server_configs.num_clients=1 --set server_configs.num_global_epochs=1 --set server_configs.do_server_eval=false \
    "$@" >&2
  s1=$(date +%s.%N)
  python3 - "$dir/run" "$name" "$s0" "$s1" "$bytes" <<'PY' | tee -a "$OUT"
import csv, json, os, sys
run, name, ckpt_bytes = sys.argv[1], sys.argv[2], int(sys.argv[5])
wall = float(sys.argv[4]) - float(sys.argv[3])
s = json.load(open(os.path.join(run, "summary.json")))
row = next(csv.DictReader(open(os.path.join(run, "metrics.csv"))))
r, down, up = float(row["round_seconds"]), float(row["download_seconds"]), float(row["upload_seconds"])
print(json.dumps({"run": name, "checkpoint_bytes": ckpt_bytes, "model_bytes": s["model_bytes"],
                  "setup_seconds": round(s["setup_seconds"], 3), "round_seconds": r, "download_seconds": down,
                  "upload_seconds": up, "first_step_done_seconds": round(s["setup_seconds"] + r - up, 3),
                  "commit_seconds": float(row["commit_seconds"]), "process_seconds": round(wall, 3),
                  "train_loss": float(row["train_loss"])}))
PY
  rm -rf "$dir"
}
# The checkpoint's pages out of the page cache (clean pages: no root
# needed), so memfl reads it from the disk as dd did.
python3 - "$CKPT" <<'PY'
import glob, os, sys
for f in glob.glob(os.path.join(sys.argv[1], "*.safetensors")):
    fd = os.open(f, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
PY
run hf_checkpoint --set client_configs.model_configs.model_name=llama \
  --set client_configs.model_configs.hf_checkpoint="$CKPT"
run seeded --set client_configs.model_configs.model_name=llama-"$SHAPE"
