"""A worker for tests/test_worker_metrics.py: a few steps with CGX_PS_WORKER_METRICS_PORT set,
then this process's own /metrics, fetched over HTTP as Prometheus would, printed to stdout."""

from __future__ import annotations

import argparse
import os
import urllib.request

import torch
import torch.nn.functional as F

import cgx_ps.worker as cgx


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--compression", default="adaptive:2")
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(1)
    config = cgx.init()
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    x, y = torch.randn(16, 64, generator=g), torch.randint(0, 10, (16,), generator=g)
    opt = cgx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model.named_parameters(),
                                   compression=args.compression, block_bytes=16384)
    for _ in range(args.steps):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    port = int(os.environ["CGX_PS_WORKER_METRICS_PORT"]) + config.local_rank
    print(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode(), flush=True)
    cgx.shutdown()


if __name__ == "__main__":
    main()
