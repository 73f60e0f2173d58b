"""A worker for tests/test_worker.py: one or more optimizer steps with known gradients.

Every rank's gradient is a fixed random tensor seeded by its rank, so the parent test can
compute the exact expected update with the reference codec. Writes the final parameters with
torch.save to --out.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
import zlib

import torch

import cgx_ps.worker as cgx
from cgx_ps.kernels import cpu as cpu_kernels
from cgx_ps.worker.runtime import connected_engine


def model_for(dtype: torch.dtype, hidden: int) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 10)).to(dtype)


def rank_gradient(name: str, param: torch.Tensor, rank: int, step: int, part: int) -> torch.Tensor:
    seed = zlib.crc32(f"{name}/{rank}/{step}/{part}".encode())
    scale = 10.0 if name.startswith("2.") else 1.0  # layers that differ: adaptive bits have a choice
    return (scale * torch.randn(param.shape, generator=torch.Generator().manual_seed(seed))).to(param.dtype)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--compression", default="4bit")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--accumulate", type=int, default=1, help="backward passes per step")
    p.add_argument("--hidden", type=int, default=300)
    p.add_argument("--block-bytes", type=int, default=16384)
    p.add_argument("--out", required=True)
    p.add_argument("--die-at-step", type=int, default=-1, help="exit abruptly before this step")
    p.add_argument("--stall-at-step", type=int, default=-1, help="stop (SIGSTOP) ourselves before this step")
    p.add_argument("--error-feedback", action="store_true")
    p.add_argument("--device", default="cpu", help="cpu, or cuda (every local rank on cuda:0)")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds between steps (chaos tests)")
    args = p.parse_args()
    config = cgx.init()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(100 + config.rank)  # different per rank: broadcast_parameters must fix it
    model = model_for(dtype, args.hidden).to(args.device)
    opt = cgx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), model.named_parameters(),
                                   compression=args.compression, backward_passes_per_step=args.accumulate,
                                   block_bytes=args.block_bytes, error_feedback=args.error_feedback)
    cgx.broadcast_parameters(model.state_dict(), root_rank=0)
    initial = {n: t.clone() for n, t in model.state_dict().items()}
    for step in range(args.steps):
        if step == args.die_at_step:
            os._exit(3)  # a crash: no cleanup, no goodbye
        if step == args.stall_at_step:
            os.kill(os.getpid(), signal.SIGSTOP)  # alive but hung: the test kills us later
        opt.zero_grad()
        for part in range(args.accumulate):
            # loss = sum(param * g): d loss / d param = g, a gradient we know exactly
            loss = sum((param * rank_gradient(name, param, config.rank, step, part).to(param.device)).sum()
                       for name, param in model.named_parameters())
            loss.backward()
        opt.step()
        time.sleep(args.step_sleep)
    cpu = {n: t.cpu() for n, t in model.state_dict().items()}
    initial = {n: t.cpu() for n, t in initial.items()}
    torch.save({"initial": initial, "final": cpu, "layout": opt.layout.SerializeToString(),
                "rank": config.rank, "stats": vars(opt.stats),
                "codec_threads": (connected_engine().executor._max_workers, cpu_kernels.num_threads()),
                "intranode": opt.intranode, "tuning": [d.as_dict() for d in opt.tuning_history]}, args.out)
    cgx.shutdown()


if __name__ == "__main__":
    main()
