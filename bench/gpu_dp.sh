#!/usr/bin/env bash
# On the GPU machine (device tool): the DP-SGD clipping-mode sweep on
# the 0.5B Llama-style classifier, and Fashion-MNIST DP-SGD with the GroupNorm
# CNN — one client, and 10 clients in FL (each client's ε in privacy.csv).
# Usage: bench/gpu_dp.sh BUILD_DIR OUT_DIR [DATA_DIR]
set -uo pipefail
BUILD=${1:-build-gpu}
OUT=${2:-runs/gpu_dp}
DATA=${3:-third_party/fashion-mnist}
mkdir -p "$OUT"
timeout 240 "$BUILD/memfl" bench dp --model llama-dp-0.5b --seq 1024,2048,4096 --batch 2 --modes no_dp,naive,ghost,fused \
  --warmup 1 --iters 3 --device cuda --json "$OUT/dp_sweep.json" --report "$OUT" | tee "$OUT/dp_sweep.txt"
common="--set client_configs.train_configs.device=cuda --set client_configs.data_configs.dataset_path=$DATA -q"
for lr in 0.5:0.9 2.0:0; do
  l=${lr%:*}; m=${lr#*:}
  timeout 150 "$BUILD/memfl" run configs/dp_fmnist_cnn_gn.yaml $common --set client_configs.train_configs.optim_args.lr=$l \
    --set client_configs.train_configs.optim_args.momentum=$m --out /tmp/dp1_$l > "$OUT/dp1_lr$l.txt" 2>&1
  tail -1 /tmp/dp1_$l/metrics.csv | cut -d, -f1,8 | sed "s/^/one client lr $l momentum $m: round,test_acc = /" >> "$OUT/dp_fmnist.txt"
  tail -1 /tmp/dp1_$l/privacy.csv >> "$OUT/dp_fmnist.txt"
done
timeout 200 "$BUILD/memfl" run configs/dp_fmnist_cnn_gn.yaml $common --set server_configs.num_clients=10 \
  --set server_configs.num_global_epochs=20 --set client_configs.train_configs.train_batch_size=64 \
  --set client_configs.train_configs.dp.noise_multiplier=1.0 --set client_configs.train_configs.optim_args.lr=0.5 \
  --set client_configs.train_configs.optim_args.momentum=0.9 --out /tmp/dp10 > "$OUT/dp10.txt" 2>&1
tail -1 /tmp/dp10/metrics.csv | cut -d, -f1,8 | sed 's/^/10 clients: round,test_acc = /' >> "$OUT/dp_fmnist.txt"
tail -10 /tmp/dp10/privacy.csv >> "$OUT/dp_fmnist.txt"
cat "$OUT/dp_fmnist.txt"
