#!/usr/bin/env python3
"""bench/gpu_attention_torch.py: PyTorch's side of bench/gpu_attention.c:
torch.nn.functional.scaled_dot_product_attention on the same shapes (is_causal as there), heads
split from (B, T, C) as a GPT does, "pass":"fwd" and "pass":"fwd_bwd" (forward, sum, backward
with q, k and v requiring gradients), timed the same way, printed as JSON lines with
"impl":"torch". --bf16: q, k, v are f32 leaves cast to bf16 first (as dtrain's --bf16), so
PyTorch picks its flash kernel; otherwise f32 (TF32 with --tf32).
Needs torch with CUDA; prints a skipped line otherwise.
Usage: gpu_attention_torch.py [--shape gpt2|gpt|d128|vit|bert|all] [--iters N] [--rounds N] [--bf16] [--tf32]"""
import argparse
import json
import time

SHAPES = [("gpt2", 4, 1024, 12, 64, 1), ("gpt", 8, 256, 6, 64, 1), ("d128", 2, 2048, 16, 128, 1), ("vit", 32, 197, 12, 64, 0),
          ("bert", 8, 512, 12, 64, 0)]


def one(torch, qkv, heads, causal, bwd, bf16):
    b, t, c = qkv[0].shape
    xs = [(x.to(torch.bfloat16) if bf16 else x).view(b, t, heads, c // heads).transpose(1, 2) for x in qkv]
    y = torch.nn.functional.scaled_dot_product_attention(*xs, is_causal=bool(causal)).transpose(1, 2).reshape(b, t, c)
    if bwd:
        y.float().sum().backward()


def time_pass(torch, qkv, heads, causal, bwd, bf16, iters, rounds):
    one(torch, qkv, heads, causal, bwd, bf16)
    torch.cuda.synchronize()
    best = 1e30
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(iters):
            one(torch, qkv, heads, causal, bwd, bf16)
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / iters)
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="all")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--tf32", action="store_true")
    a = ap.parse_args()
    try:
        import torch
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device")
    except Exception as e:  # no torch, or no GPU: say so in the output
        print(json.dumps({"bench": "gpu_attention", "impl": "torch", "skipped": str(e)}))
        return
    torch.backends.cuda.matmul.allow_tf32 = a.tf32
    g = torch.Generator(device="cuda").manual_seed(1)
    for name, b, t, h, d, causal in SHAPES:
        if a.shape != "all" and a.shape != name:
            continue
        qkv = [(torch.rand(b, t, h * d, device="cuda", generator=g) * 2 - 1).requires_grad_() for _ in range(3)]
        f = float(b * h * t * t * d) * (1 if causal else 2)
        for bwd in (0, 1):
            s = time_pass(torch, qkv, h, causal, bwd, a.bf16, a.iters, a.rounds)
            print(json.dumps({"bench": "gpu_attention", "impl": "torch", "backend": "cuda", "shape": name, "batch": b, "context": t,
                              "heads": h, "head_dim": d, "causal": causal, "pass": "fwd_bwd" if bwd else "fwd", "bf16": int(a.bf16),
                              "tf32": int(a.tf32), "ms": round(s * 1e3, 4),
                              "tflops": round((7.0 if bwd else 2.0) * f / s / 1e12, 2)}), flush=True)
        del qkv


if __name__ == "__main__":
    main()
