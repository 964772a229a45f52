#!/usr/bin/env python3
"""bench/autoencoder_torch.py: PyTorch's side of bench/autoencoder.c: the same convolutional
autoencoder (Conv2d 1-16 and 16-8, 3x3, stride 2, padding 1, ReLU; ConvTranspose2d 8-16 and 16-1,
3x3, stride 2, padding 1, output_padding 1), MSE against the input, backward, Adam (lr 2e-3),
on random images (B, 1, 28, 28); one warm-up step, then the best of --repeat timings of --steps
steps; a JSON line with "impl":"torch".
Usage: autoencoder_torch.py [--batch B] [--threads N] [--steps S] [--repeat R]"""
import argparse
import json
import time


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--repeat", type=int, default=3)
    a = p.parse_args()
    import torch
    nn = torch.nn
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    torch.manual_seed(1)
    net = nn.Sequential(nn.Conv2d(1, 16, 3, 2, 1), nn.ReLU(), nn.Conv2d(16, 8, 3, 2, 1), nn.ReLU(),
                        nn.ConvTranspose2d(8, 16, 3, 2, 1, 1), nn.ReLU(), nn.ConvTranspose2d(16, 1, 3, 2, 1, 1))
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    x = torch.randn(a.batch, 1, 28, 28)

    def step():
        opt.zero_grad()
        loss = nn.functional.mse_loss(net(x), x)
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
    print(json.dumps({"bench": "autoencoder", "impl": "torch", "version": torch.__version__, "batch": a.batch,
                      "threads": torch.get_num_threads(), "params": sum(q.numel() for q in net.parameters()),
                      "ms_per_step": round(1e3 * best / a.steps, 3), "images_per_s": round(a.batch * a.steps / best, 1),
                      "loss": round(loss, 5)}))


if __name__ == "__main__":
    main()
