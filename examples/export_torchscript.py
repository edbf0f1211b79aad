#!/usr/bin/env python3
"""Exports a PyTorch model as TorchScript for memfl's C++ trainer.

    python3 examples/export_torchscript.py --model cnn --out runs/torchscript/cnn.pt
    build/memfl run configs/torchscript_fmnist_cnn.yaml     # trains it federatedly

The module's forward takes N×C×H×W images and returns N×classes logits; its
parameters and buffers become the arena's tensors under their state_dict
names. --trace records the forward with torch.jit.trace instead of compiling
it with torch.jit.script (either loads the same way).
Models: cnn (Fashion-MNIST, the shape of memfl's built-in CNN) and resnet18
(32×32 inputs, the CIFAR variant, the shape of memfl's built-in ResNet18).
"""
import argparse
import os

import torch
import torch.nn as nn
import torch.nn.functional as F


class CNN(nn.Module):
    def __init__(self, channels: int = 1, pixels: int = 28, classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, 32, 5)
        self.conv2 = nn.Conv2d(32, 64, 5)
        side = ((pixels - 4) // 2 - 4) // 2
        self.fc1 = nn.Linear(64 * side * side, 512)
        self.fc2 = nn.Linear(512, classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + self.shortcut(x))


class ResNet18(nn.Module):
    def __init__(self, channels: int = 3, classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, 64, 3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        layers, cin = [], 64
        for i, width in enumerate([64, 128, 256, 512]):
            blocks = []
            for b in range(2):
                blocks.append(BasicBlock(cin, width, 2 if b == 0 and i > 0 else 1))
                cin = width
            layers.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.linear = nn.Linear(512, classes)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.linear(F.adaptive_avg_pool2d(x, 1).flatten(1))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["cnn", "resnet18"], default="cnn")
    p.add_argument("--out", default="runs/torchscript/cnn.pt")
    p.add_argument("--trace", action="store_true", help="torch.jit.trace instead of torch.jit.script")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    torch.manual_seed(a.seed)
    model = CNN() if a.model == "cnn" else ResNet18()
    example = torch.zeros(2, 1, 28, 28) if a.model == "cnn" else torch.zeros(2, 3, 32, 32)
    scripted = torch.jit.trace(model, example) if a.trace else torch.jit.script(model)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    scripted.save(a.out)
    n = sum(t.numel() for t in model.state_dict().values())
    print(f"wrote {a.out}: {a.model}, {'traced' if a.trace else 'scripted'}, {n} elements in "
          f"{len(model.state_dict())} tensors")


if __name__ == "__main__":
    main()
