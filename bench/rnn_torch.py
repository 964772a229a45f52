#!/usr/bin/env python3
"""bench/rnn_torch.py: PyTorch's side of bench/rnn.c: nn.LSTM / nn.GRU (one layer,
batch_first) over x (B, T, I) from a zero state, a linear readout of the last step's state,
MSE, backward, Adam (lr 1e-3); random data; one warm-up step, then the best of --repeat
timings of --steps steps; JSON lines with "impl":"torch".
Usage: rnn_torch.py [--cell lstm|gru|all] [--batch B] [--seq T] [--input I] [--hidden H]
                    [--threads N] [--steps S] [--repeat R]"""
import argparse
import json
import time


def run(torch, a, cell):
    torch.manual_seed(1)
    rnn = (torch.nn.LSTM if cell == "lstm" else torch.nn.GRU)(a.input, a.hidden, batch_first=True)
    out = torch.nn.Linear(a.hidden, 1)
    opt = torch.optim.Adam(list(rnn.parameters()) + list(out.parameters()), lr=1e-3)
    x = torch.rand(a.batch, a.seq, a.input) * 2 - 1
    y = torch.rand(a.batch, 1)

    def step():
        opt.zero_grad()
        ys, _ = rnn(x)
        loss = torch.nn.functional.mse_loss(out(ys[:, -1]), y)
        loss.backward()
        opt.step()
        return loss.item()

    loss = step()
    best = 1e30
    for _ in range(a.repeat):
        t0 = time.perf_counter()
        for _ in range(a.steps):
            loss = step()
        best = min(best, time.perf_counter() - t0)
    print(json.dumps({"bench": "rnn", "impl": "torch", "version": torch.__version__, "cell": cell, "batch": a.batch,
                      "seq": a.seq, "input": a.input, "hidden": a.hidden, "threads": torch.get_num_threads(),
                      "ms_per_step": round(1e3 * best / a.steps, 3),
                      "sequences_per_s": round(a.batch * a.steps / best, 1), "loss": round(loss, 5)}))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cell", default="all", choices=["lstm", "gru", "all"])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--input", type=int, default=32)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--repeat", type=int, default=3)
    a = p.parse_args()
    import torch
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    for cell in (["lstm", "gru"] if a.cell == "all" else [a.cell]):
        run(torch, a, cell)


if __name__ == "__main__":
    main()
