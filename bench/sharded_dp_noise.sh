#!/usr/bin/env bash
# How far the models of ShardedDp.AFederatedClientShardedOverRanksTrainsAsAnUnshardedOne
# lie apart, and how far another draw of the noise moves them: the scale its
# tolerance is measured against (a fraction of the noise's own effect). The test's own
# arguments (DP-SGD on the GroupNorm CNN, 2 clients × 2 rounds of 3 Poisson
# steps), run with 1, 2 and 3 ranks per client (train_configs.num_gpus),
# noise_multiplier 0.5, the default seed and seed 7. Prints one JSON object:
# the largest absolute element difference of each pair of global models
# (read from the safetensors files here, not by memfl).
# Usage: bench/sharded_dp_noise.sh [BUILD_DIR] > out.json
set -euo pipefail
BUILD=${1:-build}
SRC=$(cd "$(dirname "$0")/.." && pwd)
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
ARGS=("$SRC/configs/dp_fmnist_cnn_gn.yaml" -q --set client_configs.train_configs.mode=step
  --set client_configs.train_configs.num_local_steps=3 --set client_configs.train_configs.train_batch_size=32
  --set server_configs.num_clients=2 --set server_configs.num_global_epochs=2
  --set client_configs.train_configs.optim_args.lr=0.5
  --set client_configs.data_configs.dataset_kwargs.max_test_samples=500
  --set client_configs.train_configs.dp.noise_multiplier=0.5)
for ranks in 1 2 3; do
  "$BUILD/memfl" run "${ARGS[@]}" --set client_configs.train_configs.num_gpus=$ranks --out "$OUT/r$ranks" >/dev/null
done
"$BUILD/memfl" run "${ARGS[@]}" --set client_configs.train_configs.num_gpus=2 --set server_configs.seed=7 \
  --out "$OUT/r2_seed7" >/dev/null
python3 - "$OUT" <<'PY'
import json, struct, sys
def tensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        head = json.loads(f.read(n))
        body = f.read()
    out = {}
    for name, t in head.items():
        if name == "__metadata__":
            continue
        assert t["dtype"] == "F32", (name, t["dtype"])
        a, b = t["data_offsets"]
        out[name] = struct.unpack(f"<{(b - a) // 4}f", body[a:b])
    return out
def max_diff(x, y):
    a, b = tensors(f"{sys.argv[1]}/{x}/global_model.safetensors"), tensors(f"{sys.argv[1]}/{y}/global_model.safetensors")
    assert a.keys() == b.keys()
    return max(abs(p - q) for k in a for p, q in zip(a[k], b[k]))
print(json.dumps({
    "ranks_2_vs_3": max_diff("r2", "r3"),
    "ranks_1_vs_2": max_diff("r1", "r2"),
    "ranks_1_vs_3": max_diff("r1", "r3"),
    "seed_default_vs_7_ranks_2": max_diff("r2", "r2_seed7"),
}))
PY
