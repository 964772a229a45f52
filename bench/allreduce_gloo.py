#!/usr/bin/env python3
"""bench/allreduce_gloo.py: PyTorch's gloo all-reduce, the peer of bench/allreduce.c.

    python3 bench/allreduce_gloo.py [--world N] [--min BYTES] [--max BYTES] [--iters K]
                                    [--timeout SECONDS]

Starts N ranks itself (torch.multiprocessing, one process per rank, rendezvous through a
file in a temporary folder; gloo's pairs use TCP over loopback unless GLOO_SOCKET_IFNAME is
set) and prints, on rank 0, one JSON line per message size in the format of
bench/allreduce.c:
  {"bench":"allreduce","impl":"gloo","transport":"gloo","provider":"tcp","world":2,
   "algo":"auto","bytes":4096,"us":60.1,"algbw_gbps":0.07,"busbw_gbps":0.07}
Measured the same way: sizes from --min (4 KiB) to --max (64 MiB), doubling; an in-place
float32 SUM all_reduce of a tensor of ones; 2 warm-up calls, a barrier, then the mean time of
K calls on rank 0 (default: about 256 MiB of traffic, between 5 and 1000 calls);
algbw = bytes / us, busbw = algbw * 2(N-1)/N. "algo":"auto" is gloo's own choice. Each rank
runs with torch.set_num_threads(1). Needs PyTorch with gloo (python3-torch; make bench-deps).
"""
import argparse
import datetime
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def iterations(nbytes, forced):
    if forced > 0:
        return forced
    budget = (256 << 20) // nbytes  # about 256 MiB of traffic per size
    return min(max(budget, 5), 1000)


def run_rank(rank, args, init_file):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=args.world,
                            timeout=datetime.timedelta(seconds=args.timeout))
    n_world = dist.get_world_size()
    buf = torch.empty(args.max // 4, dtype=torch.float32)
    nbytes = args.min
    while nbytes <= args.max:
        x = buf[: nbytes // 4]
        iters = iterations(nbytes, args.iters)
        x.fill_(1.0)
        for _ in range(2):
            dist.all_reduce(x, op=dist.ReduceOp.SUM)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x, op=dist.ReduceOp.SUM)
        us = (time.perf_counter() - t0) * 1e6 / iters
        algbw = nbytes / us * 1e-3
        if rank == 0:  # the line of bench/allreduce.c, number formats included
            print('{"bench":"allreduce","impl":"gloo","transport":"gloo","provider":"tcp","world":%d,'
                  '"algo":"auto","bytes":%d,"us":%.2f,"algbw_gbps":%.3f,"busbw_gbps":%.3f}'
                  % (n_world, nbytes, us, algbw, algbw * 2.0 * (n_world - 1) / n_world), flush=True)
        nbytes *= 2
    dist.barrier()
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description="gloo all-reduce bandwidth (JSON lines, as bench/allreduce.c)")
    p.add_argument("--world", type=int, default=2, help="ranks (processes) to start (default 2)")
    p.add_argument("--min", type=int, default=4 << 10, help="smallest message in bytes (default 4 KiB)")
    p.add_argument("--max", type=int, default=64 << 20, help="largest message in bytes (default 64 MiB)")
    p.add_argument("--iters", type=int, default=0, help="timed calls per size (default: about 256 MiB of traffic)")
    p.add_argument("--timeout", type=float, default=300.0, help="gloo's timeout for one operation, seconds")
    args = p.parse_args()
    if args.world < 1 or args.min < 4 or args.max < args.min:
        p.error("need --world >= 1 and 4 <= --min <= --max")
    if not dist.is_available() or not dist.is_gloo_available():
        sys.exit("allreduce_gloo: this PyTorch has no gloo backend")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with tempfile.TemporaryDirectory(prefix="allreduce_gloo.") as tmp:
        try:
            mp.spawn(run_rank, args=(args, os.path.join(tmp, "rendezvous")), nprocs=args.world, join=True)
        except Exception as e:  # a rank raised or died: its traceback is on stderr already
            sys.exit(f"allreduce_gloo: {type(e).__name__}: {e}")


if __name__ == "__main__":
    main()
