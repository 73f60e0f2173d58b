"""A worker for auto-mode tests: a few steps of a compute-heavy or a communication-heavy model
with compression="auto:<interval>"; prints the decisions as one JSON line."""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

import cgx_ps.worker as cgx


def build(kind: str) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    if kind == "conv":  # ~40K parameters, lots of compute per byte of gradient
        model = torch.nn.Sequential(torch.nn.Conv2d(3, 64, 3, padding=1), torch.nn.ReLU(),
                                    torch.nn.Conv2d(64, 64, 3, padding=1), torch.nn.ReLU(),
                                    torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(64, 10))
        x = torch.randn(32, 3, 48, 48, generator=g)
    else:  # ~2.1M parameters, little compute per byte
        model = torch.nn.Sequential(torch.nn.Linear(64, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
                                    torch.nn.ReLU(), torch.nn.Linear(1024, 10))
        x = torch.randn(16, 64, generator=g)
    return model, x, torch.randint(0, 10, (x.shape[0],), generator=g)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=["conv", "mlp"], required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--interval", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(1)
    cgx.init()
    model, x, y = build(args.model)
    opt = cgx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model.named_parameters(),
                                   compression=f"auto:{args.interval}")
    for _ in range(args.steps):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    print(json.dumps({"decisions": [d.as_dict() for d in opt.tuning_history], "compressed": opt.stats.compressed}), flush=True)
    cgx.shutdown()


if __name__ == "__main__":
    main()
