"""examples/export_torchscript.py with Debian's python3-torch: a CNN written
in Python, saved as TorchScript (scripted and traced), trained federatedly by
memfl's C++ trainer under its own parameter names; and with naive DP-SGD."""
import json
import os
import struct
import subprocess
import sys

BIN = os.environ["MEMFL_BINARY"]
SRC = os.environ["MEMFL_SOURCE_DIR"]
sys.path.insert(0, os.path.join(SRC, "examples"))
from export_torchscript import CNN  # noqa: E402

SHORT = ["--set", "server_configs.num_clients=2", "--set", "server_configs.num_global_epochs=2",
         "--set", "client_configs.train_configs.mode=step", "--set", "client_configs.train_configs.num_local_steps=40",
         "--set", "client_configs.data_configs.dataset_kwargs.max_test_samples=1000"]


def export(tmp_path, *flags):
    out = tmp_path / ("cnn%s.pt" % "".join(f.strip("-") for f in flags))
    r = subprocess.run([sys.executable, os.path.join(SRC, "examples/export_torchscript.py"), "--model", "cnn",
                        "--out", str(out), *flags], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return str(out)


def safetensors_names(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    return [k for k in header if k != "__metadata__"]


def last_row(csv):
    rows = [l.strip().split(",") for l in open(csv) if l.strip()]
    return dict(zip(rows[0], rows[-1]))


def test_an_exported_cnn_trains_federatedly_scripted_or_traced(tmp_path):
    for flags in [(), ("--trace",)]:
        model = export(tmp_path, *flags)
        run = tmp_path / ("run" + "".join(flags))
        r = subprocess.run([BIN, "run", os.path.join(SRC, "configs/torchscript_fmnist_cnn.yaml"), "-q", "--out", str(run),
                            "--set", f"client_configs.model_configs.torchscript_path={model}", *SHORT],
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout + r.stderr
        assert float(last_row(run / "metrics.csv")["test_accuracy"]) > 0.6
        assert sorted(safetensors_names(run / "global_model.safetensors")) == sorted(CNN().state_dict().keys())


def test_naive_dp_sgd_trains_an_exported_cnn(tmp_path):
    model = export(tmp_path)
    run = tmp_path / "dp"
    r = subprocess.run([BIN, "run", os.path.join(SRC, "configs/torchscript_fmnist_cnn.yaml"), "-q", "--out", str(run),
                        "--set", f"client_configs.model_configs.torchscript_path={model}", *SHORT,
                        "--set", "client_configs.train_configs.num_local_steps=5",
                        "--set", "client_configs.train_configs.train_batch_size=16",
                        "--set", "client_configs.train_configs.dp.enabled=true",
                        "--set", "client_configs.train_configs.dp.clipping=naive",
                        "--set", "client_configs.train_configs.dp.noise_multiplier=1.0"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    privacy = [l.strip().split(",") for l in open(run / "privacy.csv") if l.strip()]
    assert privacy[0][:3] == ["round", "client", "dp_steps"]
    assert len(privacy) == 1 + 2 * 2 and all(int(row[2]) > 0 for row in privacy[1:])
    assert float(privacy[-1][5]) > 0  # a finite, positive epsilon
