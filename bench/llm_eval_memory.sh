#!/usr/bin/env bash
# A Llama's server-side evaluation against its vocabulary and batch: the
# same 1-client, 1-step run with and without do_server_eval, the kernel's
# peak RSS of each (summary.json), and the difference beside what the full
# [batch, seq, vocab] f32 logits would take and what one chunk of the
# chunked loss takes (max(64, 256 MiB / (4 · vocab)) rows). CPU, f32,
# hidden 64, 1 layer, seq 256. One JSON line per (vocab, eval_batch_size).
#   bash bench/llm_eval_memory.sh BUILD/memfl [VOCABS] [BATCHES] > out.jsonl
set -euo pipefail
MEMFL=$1
VOCABS=${2:-"8000 32000 128000"}
BATCHES=${3:-"16 64"}
SEQ=256
tmp=$(mktemp -d /tmp/memfl_eval_mem.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
for vocab in $VOCABS; do
  for batch in $BATCHES; do
    cat > "$tmp/c.yaml" <<YAML
client_configs:
  train_configs: {trainer: VanillaTrainer, mode: step, num_local_steps: 1, optim: SGD, train_batch_size: 1,
                  num_threads: 1, do_validation: false}
  model_configs:
    model_name: llama
    model_kwargs: {hidden_size: 64, num_layers: 1, num_heads: 4, num_kv_heads: 2, intermediate_size: 128,
                   vocab_size: $vocab, seq_length: $SEQ}
  data_configs:
    dataset_name: SyntheticTokens
    dataset_kwargs: {num_train_samples: 8, num_test_samples: $batch}
server_configs: {num_clients: 1, num_global_epochs: 1, eval_batch_size: $batch}
YAML
    rm -rf "$tmp/eval" "$tmp/plain"
    "$MEMFL" run "$tmp/c.yaml" -q --out "$tmp/eval" >/dev/null 2>&1
    "$MEMFL" run "$tmp/c.yaml" -q --out "$tmp/plain" --set server_configs.do_server_eval=false >/dev/null 2>&1
    python3 - "$tmp" "$vocab" "$batch" "$SEQ" <<'PY'
import json, sys
tmp, vocab, batch, seq = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
peak = lambda d: json.load(open(f"{tmp}/{d}/summary.json"))["peak_rss_bytes"]
e, p = peak("eval"), peak("plain")
rows = max(64, (256 << 20) // (4 * vocab))
print(json.dumps({"vocab": vocab, "eval_batch_size": batch, "seq_length": seq, "peak_rss_eval_bytes": e,
                  "peak_rss_no_eval_bytes": p, "eval_above_training_bytes": e - p,
                  "chunk_logits_bytes": rows * vocab * 4, "full_logits_bytes": batch * seq * vocab * 4,
                  "eval_above_training_over_chunk": round((e - p) / (rows * vocab * 4), 3)}))
PY
  done
done
