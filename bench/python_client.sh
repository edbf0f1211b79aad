#!/usr/bin/env bash
# the Python client (`import memfl`, examples/pytorch_client.py)
# beside two C++ clients in one FedAvg run over gRPC on Fashion-MNIST, with
# memfl's MLP (model_kwargs.hidden_size HIDDEN: 4096 → 80 MiB f32) so the
# model shows in RSS; then the same run with three C++ clients. Prints one
# JSON object: each client's RSS above its baseline (Python: after importing
# torch and loading the data; C++: before the model existed), the Python
# client's per-round receive/train/send times and the peak of each transfer
# over the RSS it started from, and both runs' final test accuracy.
# Usage: bench/python_client.sh [BUILD] [HIDDEN] [ROUNDS] [STEPS]
set -euo pipefail
BUILD=${1:-build}
HIDDEN=${2:-4096}
ROUNDS=${3:-3}
STEPS=${4:-20}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
port() { /usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
config() {  # $1 file, $2 port
  sed -e "s/127.0.0.1:50051/127.0.0.1:$2/" -e "s/num_clients: 10/num_clients: 3/" \
    -e "s/num_global_epochs: 5/num_global_epochs: $ROUNDS/" -e "s/model_name: CNN/model_name: MLP/" \
    -e "s/num_pixel: 28/num_pixel: 28\n      hidden_size: $HIDDEN/" \
    -e "s/mode: epoch/mode: step\n    num_local_steps: $STEPS/" -e "s/do_validation: true/do_validation: false/" \
    configs/fedavg_fmnist_cnn.yaml > "$1"
}
P=$(port)
config "$TMP/mixed.yaml" "$P"
"$BUILD/memfl" server "$TMP/mixed.yaml" -q --out "$TMP/server" &
S=$!
for i in 1 2; do "$BUILD/memfl" client "$TMP/mixed.yaml" --client-id $i -q --out "$TMP/c$i" & done
PYTHONPATH="$BUILD/python" /usr/bin/python3 examples/pytorch_client.py --server "127.0.0.1:$P" --client-id 0 \
  --num-clients 3 --steps "$STEPS" --model mlp --hidden "$HIDDEN" --json "$TMP/py.json" > "$TMP/py.log"
wait
P2=$(port)
config "$TMP/cpp.yaml" "$P2"
"$BUILD/memfl" launch "$TMP/cpp.yaml" --clients 3 -q --out "$TMP/cpp3" > /dev/null
/usr/bin/python3 - "$TMP" "$HIDDEN" <<'PY'
import json, sys
tmp, hidden = sys.argv[1], int(sys.argv[2])
def acc(path):
    rows = [l.strip().split(",") for l in open(path) if l.strip()]
    return float(rows[-1][rows[0].index("test_accuracy")])
py = json.load(open(f"{tmp}/py.json"))
out = {"model": f"MLP hidden {hidden}", "model_bytes": py["model_bytes"],
       "python_client": {"peak_over_baseline_bytes": py["peak_rss_bytes"] - py["baseline_rss_bytes"],
                         "baseline_rss_bytes": py["baseline_rss_bytes"], "rounds": py["rounds"]},
       "cpp_clients": [], "test_accuracy_python_plus_2_cpp": acc(f"{tmp}/server/metrics.csv"),
       "test_accuracy_3_cpp": acc(f"{tmp}/cpp3/server/metrics.csv")}
for i in (1, 2):
    s = json.load(open(f"{tmp}/c{i}/summary.json"))
    m = json.load(open(f"{tmp}/c{i}/memory.json"))
    phases = [{"round": ph["round"], "phase": ph["phase"], "seconds": (ph["end_ms"] - ph["start_ms"]) / 1000,
               "peak_rss_bytes": ph["peak_rss_bytes"]} for ph in m["phases"] if ph["round"] > 0 and ph["phase"] != "idle"]
    out["cpp_clients"].append({"client": i, "peak_over_before_model_bytes": s["peak_rss_bytes"] - s["before_model_rss_bytes"],
                               "before_model_rss_bytes": s["before_model_rss_bytes"], "phases": phases})
print(json.dumps(out))
PY
