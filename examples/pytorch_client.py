#!/usr/bin/env python3
"""A memfl client written in Python: your PyTorch model and training loop,
memfl's server (FedAvg over gRPC, chunked, memory-bounded).

    make python                       # builds build/python/memfl
    build/memfl server configs/fedavg_fmnist_cnn.yaml --set server_configs.num_clients=3 &
    build/memfl client configs/fedavg_fmnist_cnn.yaml --client-id 1 &
    build/memfl client configs/fedavg_fmnist_cnn.yaml --client-id 2 &
    PYTHONPATH=build/python python3 examples/pytorch_client.py --client-id 0 --num-clients 3

The model is the CNN of memfl's model registry written in PyTorch, with the
same parameter names and shapes (conv1, conv2, fc1, fc2), so its state_dict
matches the server's layout; memfl.Client refuses one that does not, naming
the tensor. Data: Fashion-MNIST from Debian's dataset-fashion-mnist, this
client's share of an iid split.
"""
import argparse
import gzip
import json
import resource
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import memfl
from export_torchscript import CNN  # memfl's CNN in PyTorch (conv1, conv2, fc1, fc2)


class MLP(nn.Module):
    """memfl's built-in MLP (model_name: MLP, model_kwargs.hidden_size)."""

    def __init__(self, inputs=784, hidden=256, classes=10):
        super().__init__()
        self.fc1 = nn.Linear(inputs, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, classes)

    def forward(self, x):
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x.flatten(1))))))


def read_idx(path):
    with gzip.open(path, "rb") as f:
        data = f.read()
    dims = data[3]
    shape = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(dims)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


def load_fashion_mnist(directory):
    x = read_idx(f"{directory}/train-images-idx3-ubyte.gz")
    y = read_idx(f"{directory}/train-labels-idx1-ubyte.gz")
    # memfl's normalisation: the training set's pixel mean and std.
    x = (torch.from_numpy(x.astype(np.float32) / 255.0) - 0.2860) / 0.3530
    return x.unsqueeze(1), torch.from_numpy(y.astype(np.int64))


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def reset_peak():
    """The kernel's peak RSS (VmHWM) starts again from the current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_bytes():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:"))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--server", default="127.0.0.1:50051")
    p.add_argument("--client-id", type=int, default=0)
    p.add_argument("--num-clients", type=int, default=3)
    p.add_argument("--token", default="")
    p.add_argument("--root-cert", default="", help="PEM file: TLS")
    p.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--steps", type=int, default=0, help="local steps per round (0: --epochs)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--json", default="", help="write round times and memory here")
    p.add_argument("--model", choices=["cnn", "mlp"], default="cnn", help="the server's model_name: CNN or MLP")
    p.add_argument("--hidden", type=int, default=256, help="MLP: model_kwargs.hidden_size")
    a = p.parse_args()

    torch.set_num_threads(1)  # clients share the machine's cores, as memfl's C++ clients do
    x, y = load_fashion_mnist(a.data)
    g = torch.Generator().manual_seed(a.seed)
    mine = torch.randperm(len(y), generator=g).chunk(a.num_clients)[a.client_id]
    baseline = rss_bytes()  # interpreter, torch and the data: what any client of this kind holds
    reset_peak()
    overall = 0  # the highest VmHWM seen between resets: the run's peak from the baseline on

    model = CNN() if a.model == "cnn" else MLP(hidden=a.hidden)
    model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    client = memfl.Client(a.server, client_id=str(a.client_id), token=a.token, root_cert=a.root_cert)
    rounds = []
    for rnd in client.rounds():
        t0 = time.monotonic()
        overall = max(overall, peak_bytes())
        before = rss_bytes()
        reset_peak()
        client.receive(model.state_dict())  # the global model, straight into the parameters
        receive_over = peak_bytes() - before  # what receiving cost above the RSS it started from
        t1 = time.monotonic()
        opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=a.momentum)
        model.train()
        steps, loss_sum, seen = 0, 0.0, 0
        for _ in range(a.epochs if a.steps == 0 else 1 << 30):
            order = mine[torch.randperm(len(mine), generator=g)]
            for b in range(0, len(order), a.batch):
                idx = order[b:b + a.batch]
                opt.zero_grad()
                loss = F.cross_entropy(model(x[idx]), y[idx])
                loss.backward()
                opt.step()
                loss_sum += loss.item() * len(idx)
                seen += len(idx)
                steps += 1
                if a.steps and steps >= a.steps:
                    break
            if a.steps and steps >= a.steps:
                break
        t2 = time.monotonic()
        del opt  # as memfl's trainer: the optimizer's state does not outlive the turn
        overall = max(overall, peak_bytes())
        before = rss_bytes()
        reset_peak()
        client.send(model.state_dict(), num_samples=float(len(mine)),
                    metrics={"train_loss": loss_sum / max(1, seen), "local_steps": float(steps)})
        send_over = peak_bytes() - before
        t3 = time.monotonic()
        rounds.append({"round": rnd, "receive_s": t1 - t0, "train_s": t2 - t1, "send_s": t3 - t2,
                       "receive_peak_over_rss_bytes": receive_over, "send_peak_over_rss_bytes": send_over})
        print(f"round {rnd}: loss {loss_sum / max(1, seen):.4f}, {t3 - t0:.2f} s", flush=True)
    peak = max(overall, peak_bytes())
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rounds": rounds, "baseline_rss_bytes": baseline, "peak_rss_bytes": peak,
                       "model_bytes": model_bytes}, f, indent=2)


if __name__ == "__main__":
    main()
