#!/usr/bin/env python3
"""bench/gpu_gemm_torch.py: PyTorch's side of bench/gpu_gemm.c: torch.nn.functional.linear
(y = x W^T, no bias) on the same shapes, "pass":"fwd" (the product) and "pass":"fwd_bwd"
(forward, sum, backward with x and W requiring gradients), timed the same way (best of
--rounds rounds of --iters after a warm-up, synchronised at the end of a round), printed as
JSON lines with "impl":"torch". FP32 with TF32 off unless --tf32; --bf16 runs the product
under torch.autocast(bfloat16) (dtrain's --bf16 rounds the operands to bf16, sums in f32).
Needs torch with CUDA; prints a skipped line otherwise.
Usage: gpu_gemm_torch.py [--shape NAME|all] [--iters N] [--rounds N] [--tf32] [--bf16]"""
import argparse
import json
import time

SHAPES = [("gpt2_qkv", 4096, 768, 2304), ("gpt2_proj", 4096, 768, 768), ("gpt2_fc", 4096, 768, 3072),
          ("gpt2_fcproj", 4096, 3072, 768), ("gpt2_head", 4096, 768, 50257), ("gpt_fc", 2048, 384, 1536),
          ("gpt_head", 2048, 384, 50257)]


def one(torch, x, w, bwd, bf16):
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
        y = torch.nn.functional.linear(x, w)
    if bwd:
        y.float().sum().backward()


def time_pass(torch, x, w, bwd, bf16, iters, rounds):
    one(torch, x, w, bwd, bf16)
    torch.cuda.synchronize()
    best = 1e30
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(iters):
            one(torch, x, w, bwd, bf16)
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / iters)
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="all")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tf32", action="store_true")
    ap.add_argument("--bf16", action="store_true")
    a = ap.parse_args()
    try:
        import torch
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device")
    except Exception as e:  # no torch, or no GPU: say so in the output
        print(json.dumps({"bench": "gpu_gemm", "impl": "torch", "skipped": str(e)}))
        return
    torch.backends.cuda.matmul.allow_tf32 = a.tf32
    g = torch.Generator(device="cuda").manual_seed(1)
    for name, m, k, n in SHAPES:
        if a.shape != "all" and a.shape != name:
            continue
        x = (torch.rand(m, k, device="cuda", generator=g) * 2 - 1).requires_grad_()
        w = (torch.rand(n, k, device="cuda", generator=g) * 2 - 1).requires_grad_()
        for bwd in (0, 1):
            t = time_pass(torch, x, w, bwd, a.bf16, a.iters, a.rounds)
            print(json.dumps({"bench": "gpu_gemm", "impl": "torch", "backend": "cuda", "shape": name, "m": m, "k": k, "n": n,
                              "pass": "fwd_bwd" if bwd else "fwd", "tf32": int(a.tf32), "bf16": int(a.bf16),
                              "ms": round(t * 1e3, 4), "tflops": round((6.0 if bwd else 2.0) * m * k * n / t / 1e12, 2)}),
                  flush=True)
        del x, w


if __name__ == "__main__":
    main()
