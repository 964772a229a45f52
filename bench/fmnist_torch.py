#!/usr/bin/env python3
"""bench/fmnist_torch.py: the PyTorch peer of bench/fmnist.c (same workload, same JSON line).

    python3 bench/fmnist_torch.py [--model mlp|cnn] [--epochs E] [--threads T] [--batches N]
                                  [--batch B] [--lr LR] [--schedule constant|cosine|onecycle] [--seed S]
                                  [--data DIR]

Workload, as in bench/fmnist.c and examples/common.h:
  * MLP 784-256-128-10 (ReLU), or the CNN conv 3x3 32 -> relu -> maxpool 2 -> conv 3x3 64 ->
    relu -> maxpool 2 -> linear 1600-128 -> relu -> linear 10 (no padding);
  * weights Kaiming-uniform (U(-b, b), b = sqrt(6 / fan_in)), biases PyTorch's default
    (U(-1/sqrt(fan_in), +));
  * data read from the same IDX .gz files with gzip + numpy, pixels / 255 standardised with
    mean 0.2860 and std 0.3530, pre-loaded as tensors;
  * a seeded torch.Generator shuffles the training set each epoch; batches of 64, the last one
    smaller; SGD lr 0.05 momentum 0.9, constant or (--schedule cosine) CosineAnnealingLR to 0
    over the run, or (--schedule onecycle) OneCycleLR with max_lr lr over the run (its
    defaults), stepped per batch; cross-entropy (mean);
  * --batches N stops each epoch after N steps.
torch.set_num_threads(T) (and set_num_interop_threads(1)). train_s covers the training steps
only (no loading, no evaluation). Prints one JSON line on stdout; progress on stderr.
Data: --data, else $DTR_FMNIST_DIR, else /usr/share/datasets/fashion-mnist.
"""
import argparse
import gzip
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

MEAN, STD = 0.2860, 0.3530


def read_idx(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        raw = f.read()
    if raw[0] != 0 or raw[1] != 0 or raw[2] != 8:
        sys.exit(f"fmnist_torch: {path}: not an unsigned-byte IDX file")
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if data.size != int(np.prod(dims)):
        sys.exit(f"fmnist_torch: {path}: truncated")
    return data.reshape(dims)


def find(folder, name):
    for cand in (name + ".gz", name):
        p = os.path.join(folder, cand)
        if os.path.exists(p):
            return p
    sys.exit(f"fmnist_torch: {folder}: cannot find {name}.gz or {name} (make deps installs Fashion-MNIST)")


def load(folder):
    def split(img, lbl):
        x = read_idx(find(folder, img)).reshape(-1, 784).astype(np.float32) / np.float32(255.0)
        x = (x - np.float32(MEAN)) / np.float32(STD)
        y = read_idx(find(folder, lbl)).astype(np.int64)
        return torch.from_numpy(x), torch.from_numpy(y)
    return (split("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
            split("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(784, 256), nn.Linear(256, 128), nn.Linear(128, 10)

    def forward(self, x):
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 32, 3), nn.Conv2d(32, 64, 3)
        self.fc1, self.fc2 = nn.Linear(64 * 5 * 5, 128), nn.Linear(128, 10)

    def forward(self, x):
        x = x.view(-1, 1, 28, 28)
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def init_weights(model):
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Conv2d)):
            nn.init.kaiming_uniform_(m.weight, a=0.0, nonlinearity="relu")  # b = sqrt(6 / fan_in)
            fan_in = m.weight[0].numel()
            nn.init.uniform_(m.bias, -1.0 / math.sqrt(fan_in), 1.0 / math.sqrt(fan_in))


def evaluate(model, x, y):
    model.eval()
    correct = 0
    with torch.no_grad():
        for s in range(0, x.shape[0], 1000):
            correct += (model(x[s:s + 1000]).argmax(1) == y[s:s + 1000]).sum().item()
    model.train()
    return correct / x.shape[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["mlp", "cnn"], default="mlp")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batches", type=int, default=0)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--schedule", choices=["constant", "cosine", "onecycle"], default="constant")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--data", default=None)
    a = ap.parse_args()
    folder = a.data or os.environ.get("DTR_FMNIST_DIR") or "/usr/share/datasets/fashion-mnist"

    torch.set_num_threads(max(1, a.threads))
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    torch.manual_seed(a.seed)
    (xtr, ytr), (xte, yte) = load(folder)
    model = MLP() if a.model == "mlp" else CNN()
    init_weights(model)
    opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.9)
    gen = torch.Generator().manual_seed(a.seed)
    n = xtr.shape[0]
    per_epoch = (n + a.batch - 1) // a.batch
    if a.batches:
        per_epoch = min(per_epoch, a.batches)
    sched = (torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=a.epochs * per_epoch, eta_min=0.0)
             if a.schedule == "cosine" else
             torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=a.lr, total_steps=a.epochs * per_epoch)
             if a.schedule == "onecycle" else None)

    train_s, samples, steps, acc, best = 0.0, 0, 0, 0.0, 0.0
    for epoch in range(1, a.epochs + 1):
        order = torch.randperm(n, generator=gen)
        loss_sum, correct, seen = 0.0, 0, 0
        t0 = time.perf_counter()
        for k, s in enumerate(range(0, n, a.batch)):
            if a.batches and k >= a.batches:
                break
            idx = order[s:s + a.batch]
            xb, yb = xtr[idx], ytr[idx]
            logits = model(xb)
            loss = F.cross_entropy(logits, yb)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if sched is not None:
                sched.step()
            loss_sum += loss.item() * yb.shape[0]
            correct += (logits.detach().argmax(1) == yb).sum().item()
            seen += yb.shape[0]
            steps += 1
        train_s += time.perf_counter() - t0
        samples += seen
        acc = evaluate(model, xte, yte)
        best = max(best, acc)
        print(f"fmnist torch {a.model}: epoch {epoch} loss {loss_sum / seen:.4f} train_acc {correct / seen:.4f} "
              f"test_acc {acc:.4f} ({train_s:.1f} s training so far)", file=sys.stderr, flush=True)

    print(json.dumps({"bench": "fmnist", "impl": "torch", "model": a.model, "threads": a.threads,
                      "epochs": a.epochs, "batches": steps, "schedule": a.schedule, "train_s": round(train_s, 3),
                      "samples_per_s": round(samples / train_s, 1) if train_s > 0 else 0.0,
                      "test_acc": round(acc, 4), "best_test_acc": round(best, 4)}, separators=(",", ":")))


if __name__ == "__main__":
    main()
