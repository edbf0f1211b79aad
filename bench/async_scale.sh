#!/usr/bin/env bash
# Many asynchronous clients in one process: `memfl run` of a
# DummyTrainer 100 k-parameter model, lognormal speeds (step time 0.1 s,
# sigma 0.5), 5 updates per client, evaluated every CLIENTS updates, for
# FedAsync, FedBuff (K 3) and FedCompass at each client count. One JSON line
# per run: updates, global versions, virtual and wall seconds (/usr/bin/time),
# max RSS, mean staleness. Usage: bench/async_scale.sh [BUILD_DIR] > out.jsonl
set -euo pipefail
BUILD=${1:-build}
COUNTS=${COUNTS:-"100 1000"}
work=$(mktemp -d /tmp/memfl-async-scale-XXXXXX)
trap 'rm -rf "$work"' EXIT
cat > "$work/c.yaml" <<'YAML'
client_configs:
  train_configs:
    trainer: DummyTrainer
    dummy_update_scale: 0.001
    mode: step
    num_local_steps: 10
  model_configs:
    model_name: synthetic
    model_kwargs:
      num_params: 100000
server_configs:
  scheduler: AsyncScheduler
  aggregator: FedAsyncAggregator
  aggregator_kwargs:
    alpha: 0.9
    staleness_fn: polynomial
    staleness_fn_kwargs:
      a: 0.5
  client_speed_distribution: lognormal
  client_step_time_s: 0.1
  client_speed_sigma: 0.5
YAML
for agg in FedAsyncAggregator FedBuffAggregator FedCompassAggregator; do
  sched=AsyncScheduler
  [ "$agg" = FedCompassAggregator ] && sched=CompassScheduler
  for n in $COUNTS; do
    rm -rf "$work/out"
    /usr/bin/time -f "%e %M" -o "$work/time" "$BUILD/memfl" run "$work/c.yaml" -q --out "$work/out" \
      --set server_configs.num_clients=$n --set server_configs.num_global_epochs=$((n * 5)) \
      --set server_configs.async_eval_every=$n --set server_configs.aggregator=$agg \
      --set server_configs.scheduler=$sched > /dev/null
    python3 - "$work/out/summary.json" "$work/time" "$agg" "$n" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
wall, rss_kb = open(sys.argv[2]).read().split()
print(json.dumps({"aggregator": sys.argv[3], "clients": int(sys.argv[4]), "updates": s["updates"],
                  "versions": s["global_versions"], "virtual_seconds": round(s["virtual_seconds"], 2),
                  "wall_seconds": float(wall), "max_rss_kb": int(rss_kb),
                  "mean_staleness": round(s["mean_staleness"], 1)}))
PY
  done
done
