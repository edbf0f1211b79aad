#!/usr/bin/env bash
# Installs the Debian 12 packages memfl builds, tests and runs with.
# Idempotent: packages already installed are skipped, and nothing is done when
# all are present. Uses sudo when not root. Why each package is there: README.md.
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build ccache pkg-config git
  libtorch-dev            # local training (trainer plugin only)
  libgloo-dev             # headers of libtorch's c10d Gloo group: sharded DP-SGD on the CPU (tests)
  libopenblas0-pthread    # BLAS under libtorch: about 2x faster CPU training than the reference BLAS
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler  # gRPC transport
  libopenmpi-dev openmpi-bin   # MPI transport
  libyaml-cpp-dev         # APPFL-style YAML configs
  nlohmann-json3-dev      # memory.json, reports
  libcli11-dev            # command line
  libfmt-dev libspdlog-dev     # formatting and logging
  libxxhash-dev           # chunk checksums (xxh3)
  libunwind-dev           # allocation-site stacks (profiler)
  libcpp-httplib-dev      # --http: /metrics, /healthz and the live page (a small compiled library, no event loop to host)
  zlib1g-dev              # reading the gzipped Fashion-MNIST IDX files; gzip/zlib update compression
  libzfp-dev libzstd-dev liblzma-dev libblosc-dev  # compressed updates: ZFP, zstd, lzma, blosc
  libsentencepiece-dev sentencepiece  # SentencePiece tokenizers; spm_train/spm_encode for the tests
  libsodium-dev           # secure aggregation: key agreement, share encryption, mask streams
  libssl-dev              # secure aggregation: the mask streams' ChaCha20 blocks, 3x faster (also under gRPC)
  libgtest-dev libgmock-dev libbenchmark-dev   # tests and micro-benchmarks
  pybind11-dev python3-dev  # `import memfl`: the Python client (make python)
  python3-torch python3-pytest  # the Python client's tests and examples/ (PyTorch models)
  dataset-fashion-mnist   # the default experiment's data set
  openssl                 # self-signed pairs for the TLS tests
  chromium                # the browser test of the HTML reports (headless)
  clang libclang-rt-14-dev     # libFuzzer for `make fuzz`
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

# npm fetches the report's pinned front-end libraries. A machine may already
# have Node.js from elsewhere (NodeSource bundles npm); only install Debian's
# when there is no npm at all, so the two never conflict.
if ! command -v npm >/dev/null 2>&1; then missing+=(nodejs npm); fi

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#PACKAGES[@]} packages already installed"
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
