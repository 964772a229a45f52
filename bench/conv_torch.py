#!/usr/bin/env python3
"""bench/conv_torch.py: PyTorch's side of bench/conv.c: F.conv2d 3x3 (padding 1) over
x (B, C, H, H), dense and depthwise (groups C), sum(y).backward() to x and w; the best of
--repeat runs after one warm-up; JSON lines with "impl":"torch" (peak_rss_mb: the process's peak
resident size so far, as bench/conv.c prints it).
Usage: conv_torch.py [--batch B] [--channels C] [--size H] [--threads N] [--repeat R]"""
import argparse
import json
import resource
import time


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--channels", type=int, default=64)
    p.add_argument("--size", type=int, default=56)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--repeat", type=int, default=5)
    a = p.parse_args()
    import torch
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    for kind, groups in (("dense", 1), ("depthwise", a.channels)):
        best = 1e30
        for r in range(a.repeat + 1):
            x = torch.full((a.batch, a.channels, a.size, a.size), 0.5, requires_grad=True)
            w = torch.full((a.channels, a.channels // groups, 3, 3), 0.1, requires_grad=True)
            t0 = time.perf_counter()
            torch.nn.functional.conv2d(x, w, padding=1, groups=groups).sum().backward()
            if r > 0:
                best = min(best, time.perf_counter() - t0)
        print(json.dumps({"bench": "conv", "impl": "torch", "version": torch.__version__, "kind": kind, "batch": a.batch,
                          "channels": a.channels, "size": a.size, "threads": torch.get_num_threads(),
                          "ms_per_step": round(1e3 * best, 3),
                          "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, 1)}))


if __name__ == "__main__":
    main()
