#!/usr/bin/env python3
"""bench/fmnist_dp_torch.py: the PyTorch peer of bench/fmnist_dp.c (DistributedDataParallel).

    python3 bench/fmnist_dp_torch.py [--world 1,2] [--epochs E] [--batches K] [--batch B]
                                     [--bucket-mb M] [--repeat R] [--seed S] [--data DIR]

The workload of bench/fmnist_dp.c: the MLP 784-256-128-10 (ReLU; Kaiming-uniform weights as
bench/fmnist_torch.py), global batch B (default 128) split over the ranks, SGD lr 0.1 momentum
0.9, cross-entropy, one epoch; each rank a process with one compute thread
(torch.set_num_threads(1)), gradients averaged by DistributedDataParallel over gloo on
127.0.0.1 (buckets of --bucket-mb MiB, default 25: torch's own). The world-1 run is plain
training in one process, as bench/fmnist_dp.c's world 1 has no engine. Each rank takes its
own shard of a per-epoch permutation (as DistributedSampler). train_s covers the training
steps only (the slowest rank); --repeat R keeps each world size's best of R runs, the world
sizes interleaved so that the ratios hold on a noisy machine.

Output, as bench/fmnist_dp.c (impl "torch"):
  {"bench":"fmnist_dp","impl":"torch","transport":"gloo","world":2,"global_batch":128,
   "epochs":1,"steps":469,"train_s":1.2,"samples_per_s":50000,"test_acc":0.82,"best_of":3}
  {"bench":"fmnist_dp_speedup","impl":"torch","transport":"gloo","world":2,"vs_world":1,"speedup":1.1}
Data: --data, else $DTR_FMNIST_DIR, else /usr/share/datasets/fashion-mnist.
"""
import argparse
import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fmnist_torch import MLP, evaluate, init_weights, load  # noqa: E402


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(rank, world, a, data, port, out):
    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    (xtr, ytr), (xte, yte) = data
    torch.manual_seed(a.seed)
    model = MLP()
    init_weights(model)
    net = model
    if world > 1:
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
        dist.init_process_group("gloo", rank=rank, world_size=world)
        net = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=a.bucket_mb)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    per, n = a.batch // world, xtr.shape[0]
    gen = torch.Generator().manual_seed(a.seed)
    steps, train_s = 0, 0.0
    for _ in range(a.epochs):
        order = torch.randperm(n, generator=gen)[rank::world]
        if world > 1:
            dist.barrier()
        t0 = time.perf_counter()
        for k, s in enumerate(range(0, order.shape[0] - per + 1, per)):
            if a.batches and k >= a.batches:
                break
            idx = order[s:s + per]
            loss = F.cross_entropy(net(xtr[idx]), ytr[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            steps += 1
        train_s += time.perf_counter() - t0
    if world > 1:
        t = torch.tensor([train_s], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        train_s = t.item()
    if rank == 0:
        out.put({"train_s": train_s, "steps": steps, "samples": steps * per * world,
                 "test_acc": evaluate(model, xte, yte)})
    if world > 1:
        dist.destroy_process_group()


def run(world, a, data):
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=train, args=(r, world, a, data, port, out)) for r in range(world)]
    for p in procs:
        p.start()
    res = out.get()
    for p in procs:
        p.join()
    if any(p.exitcode != 0 for p in procs):
        sys.exit(f"fmnist_dp_torch: a rank of world {world} failed")
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", default="1,2")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--batches", type=int, default=0)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--data", default=None)
    a = ap.parse_args()
    worlds = [int(w) for w in a.world.split(",")]
    data = load(a.data or os.environ.get("DTR_FMNIST_DIR") or "/usr/share/datasets/fashion-mnist")
    best = {}
    for _ in range(a.repeat):
        for w in worlds:
            r = run(w, a, data)
            if w not in best or r["samples"] / r["train_s"] > best[w]["samples"] / best[w]["train_s"]:
                best[w] = r
    for w in worlds:
        r = best[w]
        sps = r["samples"] / r["train_s"]
        print(json.dumps({"bench": "fmnist_dp", "impl": "torch", "torch": torch.__version__, "transport": "gloo",
                          "world": w, "global_batch": a.batch, "epochs": a.epochs, "steps": r["steps"],
                          "train_s": round(r["train_s"], 3), "samples_per_s": round(sps),
                          "test_acc": round(r["test_acc"], 4), "best_of": a.repeat}, separators=(",", ":")))
        if w != worlds[0]:
            base = best[worlds[0]]["samples"] / best[worlds[0]]["train_s"]
            print(json.dumps({"bench": "fmnist_dp_speedup", "impl": "torch", "transport": "gloo", "world": w,
                              "vs_world": worlds[0], "speedup": round(sps / base, 3)}, separators=(",", ":")))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
