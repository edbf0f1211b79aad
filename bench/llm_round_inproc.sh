#!/usr/bin/env bash
# An LLM round in process on one GPU, split by phase: `memfl run` of
# MODEL (llama-8b by default: Llama-3.1-8B's shape), bf16, CLIENTS clients ×
# STEPS local steps of BATCH × SEQ tokens, ROUNDS rounds, no server
# evaluation. One JSON line per round from metrics.csv: the round's seconds,
# its download (the global model into the worker), upload (the update folded)
# and commit seconds, the training (the rest of the round), and the share of
# the round outside training. A last line sums the run up: the wall time per
# round from the first round's start to the last commit's end (the commit
# of a round is written while the next one trains, so it is in the wall
# time, not in round_seconds), and the share of it outside training.
#
#   bash bench/llm_round_inproc.sh BUILD_DIR/memfl > bench/results/llm_round_8b_inproc_….jsonl
#   MODEL=llama-8b CLIENTS=2 STEPS=10 BATCH=4 SEQ=512 ROUNDS=3 (defaults)
set -euo pipefail
MEMFL=${1:-build/memfl}
MODEL=${MODEL:-llama-8b} CLIENTS=${CLIENTS:-2} STEPS=${STEPS:-10} BATCH=${BATCH:-4} SEQ=${SEQ:-512} ROUNDS=${ROUNDS:-3}
RUN=$(mktemp -d /tmp/memfl_llm_round.XXXXXX)
trap 'rm -rf "$RUN"' EXIT
here=$(cd "$(dirname "$0")/.." && pwd)
"$MEMFL" run "$here/configs/llama_tiny_tokens.yaml" --out "$RUN/run" -q \
  --set client_configs.model_configs.model_name="$MODEL" --set client_configs.model_configs.model_kwargs.dtype=bf16 \
  --set client_configs.model_configs.model_kwargs.seq_length="$SEQ" --set client_configs.train_configs.device=cuda \
  --set client_configs.train_configs.num_local_steps="$STEPS" --set client_configs.train_configs.train_batch_size="$BATCH" \
  --set client_configs.train_configs.optim_args.lr=1e-5 --set server_configs.num_clients="$CLIENTS" \
  --set server_configs.num_global_epochs="$ROUNDS" --set server_configs.do_server_eval=false >&2
python3 - "$RUN/run" "$MODEL" "$CLIENTS" "$STEPS" "$BATCH" "$SEQ" <<'PY'
import csv, json, os, sys
run, model, clients, steps, batch, seq = sys.argv[1:]
s = json.load(open(os.path.join(run, "summary.json")))
rows = list(csv.DictReader(open(os.path.join(run, "metrics.csv"))))
trained = 0.0
for row in rows:
    r, down, up = float(row["round_seconds"]), float(row["download_seconds"]), float(row["upload_seconds"])
    train = r - down - up
    trained += train
    print(json.dumps({"model": model, "clients": int(clients), "local_steps": int(steps), "batch": int(batch),
                      "seq_length": int(seq), "round": int(row["round"]), "round_seconds": r,
                      "download_seconds": down, "upload_seconds": up, "training_seconds": round(train, 3),
                      "commit_seconds": float(row["commit_seconds"]),
                      "outside_training_share": round((r - train) / r, 4),
                      "peak_rss_over_model": s.get("peak_rss_over_model"), "wall_seconds": s.get("wall_seconds")}))
per_round = (s["wall_seconds"] - s["setup_seconds"]) / len(rows)
print(json.dumps({"model": model, "summary": True, "rounds": len(rows), "setup_seconds": s["setup_seconds"],
                  "wall_seconds_per_round": round(per_round, 3),
                  "training_seconds_per_round": round(trained / len(rows), 3),
                  "outside_training_share_of_wall": round(1 - trained / len(rows) / per_round, 4)}))
PY
