#!/usr/bin/env python3
"""bench/generate_torch.py: PyTorch's side of bench/generate.c: the same two models (gpt: 6
layers of 384, 6 heads, vocabulary 50257, learned positions; llama: 8 layers of 512, 8 heads
over 2 kv heads, RoPE as rotate_half, RMSNorm, SwiGLU of 1408, vocabulary 32000), random
weights, a prompt of random tokens, greedy decoding, with a key/value cache of preallocated
torch tensors (cache 1) or the whole sequence each step (cache 0), under torch.no_grad(), timed
as bench/generate.c times (prefill: the prompt's pass and the first token; decode: the rest),
best of --repeat runs, printed as JSON lines with "impl":"torch". Attention: PyTorch's
scaled_dot_product_attention where it exists (2.0 on), else the same math spelled out.
Usage: generate_torch.py [--backend cpu|cuda] [--model gpt|llama|all] [--prompt P] [--tokens N]
                         [--batch B] [--threads N] [--repeat R] [--no-uncached]"""
import argparse
import json
import time

MODELS = {
    "gpt": dict(llama=0, layers=6, dim=384, heads=6, kv_heads=6, hidden=1536, vocab=50257),
    "llama": dict(llama=1, layers=8, dim=512, heads=8, kv_heads=2, hidden=1408, vocab=32000),
}


def attention(torch, q, k, v, q_start):
    """q (B, H, Tq, D) at key positions q_start.., k and v (B, Hk, Tk, D) (Hk dividing H: q head h
    reads kv head h // (H // Hk)): causal from q_start. Grouped heads without copies: SDPA's
    enable_gqa (2.5 on), else q viewed (B, Hk, rep, Tq, D) against k and v broadcast over rep."""
    B, H, Tq, D = q.shape
    Hk, Tk = k.shape[1], k.shape[2]
    mask = torch.arange(Tk, device=q.device)[None, :] <= (q_start + torch.arange(Tq, device=q.device))[:, None]
    sdpa = getattr(torch.nn.functional, "scaled_dot_product_attention", None)
    if sdpa is not None and (Hk == H or "enable_gqa" in (sdpa.__doc__ or "")):
        return sdpa(q, k, v, attn_mask=mask, **({} if Hk == H else dict(enable_gqa=True)))
    q5, k5, v5 = q.view(B, Hk, H // Hk, Tq, D), k.unsqueeze(2), v.unsqueeze(2)
    s = (q5 @ k5.transpose(-1, -2)) / (D ** 0.5)
    return (torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1) @ v5).view(B, H, Tq, D)


def build(torch, spec, positions):
    nn = torch.nn
    C, H, Hk = spec["dim"], spec["heads"], spec["kv_heads"]
    D = C // H

    def rope(x, start):   # x (B, h, T, D), rotate_half pairs, theta 10000
        T = x.shape[2]
        inv = 10000.0 ** (-torch.arange(0, D, 2, dtype=torch.float64, device=x.device) / D)
        ang = (start + torch.arange(T, dtype=torch.float64, device=x.device))[:, None] * inv[None, :]
        cos, sin = torch.cos(ang).float(), torch.sin(ang).float()
        a, b = x[..., : D // 2], x[..., D // 2:]
        return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            llama = spec["llama"]
            self.n1 = nn.LayerNorm(C) if not llama else None
            self.n2 = nn.LayerNorm(C) if not llama else None
            self.w1, self.w2 = nn.Parameter(torch.ones(C)), nn.Parameter(torch.ones(C))
            self.q = nn.Linear(C, C, bias=not llama)
            self.k = nn.Linear(C, Hk * D, bias=not llama)
            self.v = nn.Linear(C, Hk * D, bias=not llama)
            self.o = nn.Linear(C, C, bias=not llama)
            self.up = nn.Linear(C, spec["hidden"], bias=not llama)
            self.gate = nn.Linear(C, spec["hidden"], bias=False) if llama else None
            self.down = nn.Linear(spec["hidden"], C, bias=not llama)

        def norm(self, x, which):
            if not spec["llama"]:
                return (self.n1 if which == 1 else self.n2)(x)
            w = self.w1 if which == 1 else self.w2
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w

        def forward(self, x, cache, start):
            B, T, _ = x.shape
            h = self.norm(x, 1)
            q = self.q(h).view(B, T, H, D).transpose(1, 2)
            k = self.k(h).view(B, T, Hk, D).transpose(1, 2)
            v = self.v(h).view(B, T, Hk, D).transpose(1, 2)
            if spec["llama"]:
                q, k = rope(q, start), rope(k, start)
            if cache is not None:   # preallocated (B, Hk, positions, D) pairs
                cache[0][:, :, start:start + T] = k
                cache[1][:, :, start:start + T] = v
                k, v = cache[0][:, :, :start + T], cache[1][:, :, :start + T]
            y = attention(torch, q, k, v, start if cache is not None else 0)
            x = x + self.o(y.transpose(1, 2).reshape(B, T, C))
            h = self.norm(x, 2)
            if spec["llama"]:
                return x + self.down(torch.nn.functional.silu(self.gate(h)) * self.up(h))
            return x + self.down(torch.nn.functional.gelu(self.up(h), approximate="tanh"))

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(spec["vocab"], C)
            self.wpe = nn.Embedding(positions, C) if not spec["llama"] else None
            self.blocks = nn.ModuleList([Block() for _ in range(spec["layers"])])
            self.ln = nn.LayerNorm(C)
            self.head = nn.Linear(C, spec["vocab"], bias=False)

        def forward(self, ids, caches, start):
            x = self.wte(ids)
            if self.wpe is not None:
                x = x + self.wpe(start + torch.arange(ids.shape[1], device=ids.device))[None]
            for i, blk in enumerate(self.blocks):
                x = blk(x, caches[i] if caches is not None else None, start)
            return self.head(self.ln(x))

    return LM()


def run_once(torch, model, spec, seq, P, N, cached, dev, sync):
    B = seq.shape[0]
    Hk, D = spec["kv_heads"], spec["dim"] // spec["heads"]
    caches = [(torch.zeros(B, Hk, P + N, D, device=dev), torch.zeros(B, Hk, P + N, D, device=dev))
              for _ in range(spec["layers"])] if cached else None
    t0 = time.perf_counter()
    t1, at = t0, 0
    for length in range(P, P + N):
        start = at if cached else 0
        logits = model(seq[:, start:length], caches, start)
        seq[:, length] = logits[:, -1].argmax(-1)
        sync()
        at = length
        if length == P:
            t1 = time.perf_counter()
    return t1 - t0, time.perf_counter() - t1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--model", default="all")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--no-uncached", action="store_true")
    a = ap.parse_args()
    line = dict(bench="generate", impl="torch", backend=a.backend)
    try:
        import torch
    except ImportError:
        print(json.dumps(dict(line, skipped="torch not installed")))
        return
    if a.backend == "cuda" and not torch.cuda.is_available():
        print(json.dumps(dict(line, skipped="no GPU visible")))
        return
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    dev = torch.device(a.backend)
    sync = torch.cuda.synchronize if a.backend == "cuda" else (lambda: None)
    P, N, B = a.prompt, a.tokens, a.batch
    for name, spec in MODELS.items():
        if a.model not in ("all", name):
            continue
        torch.manual_seed(1)
        model = build(torch, spec, P + N).to(dev).eval()
        g = torch.Generator().manual_seed(5)
        prompt = torch.randint(0, spec["vocab"], (B, P + N), generator=g).to(dev)
        best, toks = {}, {}
        with torch.no_grad():
            for _ in range(a.repeat):
                for cached in ([0, 1] if not a.no_uncached else [1]):
                    seq = prompt.clone()
                    pf, dec = run_once(torch, model, spec, seq, P, N, cached, dev, sync)
                    if cached not in best or pf + dec < sum(best[cached]):
                        best[cached] = (pf, dec)
                    toks[cached] = seq
        for cached in sorted(best):
            pf, dec = best[cached]
            out = dict(line, model=name, torch=torch.__version__, cache=cached, batch=B, prompt=P, new_tokens=N,
                       threads=torch.get_num_threads(), prefill_ms=round(pf * 1e3, 2),
                       decode_ms_per_token=round(dec * 1e3 / (N - 1), 3), decode_tokens_per_s=round(B * (N - 1) / dec, 1))
            if cached and 0 in toks:
                out["same_tokens"] = bool(torch.equal(toks[0], toks[1]))
            print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
