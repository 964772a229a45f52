#!/usr/bin/env python3
"""bench/gpu_torch.py: PyTorch's side of bench/gpu.c: the same five models (mlp, cnn, gpt,
gpt2, llama: RMSNorm, RoPE as rotate_half, scaled_dot_product_attention with enable_gqa,
SwiGLU), the same batch shapes, AdamW, random data, timed the same way, printed as JSON lines
with "impl":"torch" and "mode":"eager" or "compile" (torch.compile). FP32 with TF32 matmuls
off unless --tf32, as dtrain's FP32 GEMMs; --bf16 runs forward and loss under
torch.autocast(bfloat16) (dtrain's --bf16 rounds only the matrix products' operands). Needs
torch with CUDA, or --backend cpu (bench/gpu --backend cpu's peer; --threads N as its threads);
prints a skipped line otherwise.
--lora R: LoRA adapters of rank R (alpha 2R; PEFT's initialisation) on the attention's input
projections (GPT: qkv; Llama: q and v), everything else frozen (requires_grad False).
Usage: gpu_torch.py [--backend cuda|cpu] [--model mlp|cnn|gpt|gpt2|llama|all] [--steps N] [--warmup N]
                    [--peak-tflops F] [--threads N] [--tf32] [--bf16] [--no-compile] [--lora R]"""
import argparse
import json
import math
import time

MODELS = {
    "mlp": dict(kind=0, batch=256),
    "cnn": dict(kind=1, batch=256),
    "gpt": dict(kind=2, batch=8, layers=6, dim=384, heads=6, context=256, vocab=50257),
    "gpt2": dict(kind=2, batch=4, layers=12, dim=768, heads=12, context=1024, vocab=50257),
    "llama": dict(kind=3, batch=8, layers=8, dim=512, heads=8, kv_heads=2, hidden=1408, context=512, vocab=32000),
}


def build(torch, spec, drop=0.0):
    nn = torch.nn
    F = torch.nn.functional
    if spec["kind"] == 0:
        return nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 10))
    if spec["kind"] == 1:
        return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(16, 32, 3, padding=1),
                             nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(32 * 7 * 7, 10))

    class Block(nn.Module):
        def __init__(self, C, H):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(C), nn.LayerNorm(C)
            self.qkv, self.proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
            self.fc, self.fc_proj = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)
            self.H = H

        def forward(self, x):
            B, T, C = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
            q, k, v = (t.view(B, T, self.H, C // self.H).transpose(1, 2) for t in (q, k, v))
            att = (q @ k.transpose(-2, -1)) / math.sqrt(C // self.H)
            att = att.masked_fill(torch.ones(T, T, device=x.device, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
            att = F.dropout(att, drop, self.training)   # --dropout: nanoGPT's three places
            x = x + F.dropout(self.proj((att @ v).transpose(1, 2).reshape(B, T, C)), drop, self.training)
            return x + F.dropout(self.fc_proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh")), drop, self.training)

    class GPT(nn.Module):
        def __init__(self, s):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(s["vocab"], s["dim"]), nn.Embedding(s["context"], s["dim"])
            self.h = nn.ModuleList([Block(s["dim"], s["heads"]) for _ in range(s["layers"])])
            self.ln_f, self.head = nn.LayerNorm(s["dim"]), nn.Linear(s["dim"], s["vocab"], bias=False)

        def forward(self, ids):
            x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
            for b in self.h:
                x = b(x)
            return self.head(self.ln_f(x))

    class LlamaBlock(nn.Module):
        def __init__(self, s):
            super().__init__()
            C, H, Hk, F = s["dim"], s["heads"], s["kv_heads"], s["hidden"]
            D = C // H
            self.n1, self.n2 = nn.RMSNorm(C, eps=1e-6), nn.RMSNorm(C, eps=1e-6)
            self.q, self.k, self.v, self.o = (nn.Linear(C, C, bias=False), nn.Linear(C, Hk * D, bias=False),
                                              nn.Linear(C, Hk * D, bias=False), nn.Linear(C, C, bias=False))
            self.gate, self.up, self.down = nn.Linear(C, F, bias=False), nn.Linear(C, F, bias=False), nn.Linear(F, C, bias=False)
            self.H, self.Hk, self.D = H, Hk, D

        def rope(self, x):   # (B, heads, T, D), rotate_half pairs, theta 10000
            T, D = x.shape[2], self.D
            f = 10000.0 ** (-torch.arange(0, D, 2, device=x.device, dtype=torch.float32) / D)
            a = torch.arange(T, device=x.device, dtype=torch.float32)[:, None] * f[None, :]
            c, s_ = torch.cat([a.cos(), a.cos()], -1).to(x.dtype), torch.cat([a.sin(), a.sin()], -1).to(x.dtype)
            x1, x2 = x[..., :D // 2], x[..., D // 2:]
            return x * c + torch.cat([-x2, x1], -1) * s_

        def forward(self, x):
            B, T, C = x.shape
            h = self.n1(x)
            q = self.q(h).view(B, T, self.H, self.D).transpose(1, 2)
            k = self.k(h).view(B, T, self.Hk, self.D).transpose(1, 2)
            v = self.v(h).view(B, T, self.Hk, self.D).transpose(1, 2)
            y = F.scaled_dot_product_attention(self.rope(q), self.rope(k), v, is_causal=True, enable_gqa=True,
                                               dropout_p=drop if self.training else 0.0)
            x = x + self.o(y.transpose(1, 2).reshape(B, T, C))
            h = self.n2(x)
            return x + self.down(torch.nn.functional.silu(self.gate(h)) * self.up(h))

    class Llama(nn.Module):
        def __init__(self, s):
            super().__init__()
            self.emb = nn.Embedding(s["vocab"], s["dim"])
            self.layers = nn.ModuleList([LlamaBlock(s) for _ in range(s["layers"])])
            self.norm, self.head = nn.RMSNorm(s["dim"], eps=1e-6), nn.Linear(s["dim"], s["vocab"], bias=False)

        def forward(self, ids):
            x = self.emb(ids)
            for b in self.layers:
                x = b(x)
            return self.head(self.norm(x))

    return Llama(spec) if spec["kind"] == 3 else GPT(spec)


def add_lora(torch, model, spec, r):
    """LoRA (x A^T B^T scaled by alpha / r, B zero) on GPT's qkv or Llama's q and v; the rest frozen."""
    nn = torch.nn

    class LoRA(nn.Module):
        def __init__(self, base):
            super().__init__()
            self.base, self.s = base, 2.0
            self.A = nn.Parameter(torch.empty(r, base.in_features))
            self.B = nn.Parameter(torch.zeros(base.out_features, r))
            nn.init.kaiming_uniform_(self.A, a=math.sqrt(5))

        def forward(self, x):
            return self.base(x) + (x @ self.A.t() @ self.B.t()) * self.s

    for p in model.parameters():
        p.requires_grad_(False)
    for b in (model.h if spec["kind"] == 2 else model.layers):
        for attr in (["qkv"] if spec["kind"] == 2 else ["q", "v"]):
            setattr(b, attr, LoRA(getattr(b, attr)))


def run(torch, name, spec, args, compile_):
    dev = args.backend
    torch.manual_seed(1)
    model = build(torch, spec, args.dropout if spec["kind"] >= 2 else 0.0)
    lora = args.lora if spec["kind"] >= 2 else 0
    if lora:
        add_lora(torch, model, spec, lora)
    model = model.to(dev)
    fwd = torch.compile(model) if compile_ else model
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    B = spec["batch"]
    if spec["kind"] >= 2:
        x = torch.randint(0, spec["vocab"], (B, spec["context"]), device=dev)
        y = torch.randint(0, spec["vocab"], (B * spec["context"],), device=dev)
        items = B * spec["context"]
    else:
        x = torch.rand(B, 784, device=dev) if spec["kind"] == 0 else torch.rand(B, 1, 28, 28, device=dev)
        y = torch.randint(0, 10, (B,), device=dev)
        items = B
    best, t0 = 1e30, None
    for s in range(args.warmup + args.steps):
        ts = time.perf_counter()
        if s == args.warmup:
            t0 = ts
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=args.bf16):
            out = fwd(x)
            loss = torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss.item()
        dt = time.perf_counter() - ts
        if s >= args.warmup:
            best = min(best, dt)
    per = (time.perf_counter() - t0) / args.steps
    params = sum(p.numel() for p in model.parameters())
    flops = 6 * params + 12 * spec.get("layers", 0) * spec.get("context", 0) * spec.get("dim", 0) if spec["kind"] >= 2 else 0
    line = {"bench": "gpu", "impl": "torch", "backend": dev, "mode": "compile" if compile_ else "eager", "torch": torch.__version__,
            "threads": torch.get_num_threads(), "model": name, "params": params, "batch": B, "tf32": int(args.tf32), "bf16": int(args.bf16), "step_ms": round(per * 1e3, 3), "best_step_ms": round(best * 1e3, 3),
            ("tokens_per_s" if spec["kind"] >= 2 else "samples_per_s"): round(items / per, 1),
            "mfu": round(flops * items / per / (args.peak_tflops * 1e12), 4) if flops else 0.0,
            "peak_mem_mb": round(torch.cuda.max_memory_allocated() / 2**20, 1) if dev == "cuda" else 0.0, "lora": lora,
            "dropout": args.dropout if spec["kind"] >= 2 else 0.0,
            "optimizer_state_mb": round(sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values()
                                            if torch.is_tensor(t) and t.dim() > 0) / 2**20, 2)}
    print(json.dumps(line), flush=True)
    del model, opt, fwd
    if dev == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="all")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--peak-tflops", type=float, default=494.7)
    p.add_argument("--tf32", action="store_true")
    p.add_argument("--bf16", action="store_true")   # torch.autocast(bfloat16); dtrain: matmul_precision BF16
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--backend", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--lora", type=int, default=0)
    p.add_argument("--dropout", type=float, default=0.0)   # the GPT's dropout (nanoGPT's), the Llama's SDPA dropout_p
    args = p.parse_args()
    try:
        import torch
    except ImportError:
        print(json.dumps({"bench": "gpu", "impl": "torch", "skipped": "torch is not installed"}))
        return
    if args.backend == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"bench": "gpu", "impl": "torch", "skipped": "no GPU visible to torch"}))
        return
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    torch.backends.cudnn.allow_tf32 = args.tf32
    for name, spec in MODELS.items():
        if args.model in ("all", name):
            for compile_ in ([False] if args.no_compile else [False, True]):
                try:
                    run(torch, name, spec, args, compile_)
                except Exception as e:  # a model that does not fit or compile: say so, go on
                    print(json.dumps({"bench": "gpu", "impl": "torch", "model": name,
                                      "mode": "compile" if compile_ else "eager", "error": str(e)[:200]}))


if __name__ == "__main__":
    main()
