"""A worker for tests/test_checkpoint.py: trains with checkpoints and resumes from the newest.

Data are a function of (rank, step), the model starts from a fixed seed, and every --every steps
each rank saves its checkpoint (cgx.Checkpoints), so a run killed and restarted from its
checkpoint must end with the parameters of a run never killed. --die-at-step kills rank
--die-rank with SIGKILL before that step, in the job's first incarnation only (torchrun's
TORCHELASTIC_RESTART_COUNT or CGX_PS_INCARNATION is 0). Writes the final parameters and what
it resumed from to --out/rank-R.pt.

--fork-nodes N --fork-local M: a launcher instead of one rank. It imports torch and cgx-ps once
and forks the job's N x M ranks with the environment torchrun gives them (RANK, GROUP_RANK,
LOCAL_RANK, ...): the same job as N torchrun nodes, without paying the imports per rank (CI time).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import traceback
from pathlib import Path

import torch

import cgx_ps.worker as cgx


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 48, generator=g), torch.randn(8, 16, generator=g)


def launch(nodes: int, local: int, argv: list[str]) -> int:
    """Fork nodes x local ranks (nothing threaded or connected exists yet: fork is safe here)."""
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)  # its first use imports torch._dynamo: seconds
    children = []
    for rank in range(nodes * local):
        pid = os.fork()
        if pid == 0:
            os.environ.update(RANK=str(rank), WORLD_SIZE=str(nodes * local), LOCAL_RANK=str(rank % local),
                              LOCAL_WORLD_SIZE=str(local), GROUP_RANK=str(rank // local))
            code = 0
            try:
                main(argv)
            except BaseException:
                traceback.print_exc()
                code = 1
            finally:
                sys.stderr.flush()
                os._exit(code)
        children.append(pid)
    return max(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0 for pid in children)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--every", type=int, required=True, help="checkpoint every N steps")
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--die-at-step", type=int, default=-1)
    p.add_argument("--die-rank", type=int, default=1)
    p.add_argument("--fork-nodes", type=int, default=0)
    p.add_argument("--fork-local", type=int, default=1)
    args = p.parse_args(argv)
    if args.fork_nodes:
        argv = list(sys.argv[1:] if argv is None else argv)
        for flag in ("--fork-nodes", "--fork-local"):  # the ranks run the rest
            if flag in argv:
                del argv[argv.index(flag):argv.index(flag) + 2]
        sys.exit(launch(args.fork_nodes, args.fork_local, argv))
    config = cgx.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(48, 64), torch.nn.Tanh(), torch.nn.Linear(64, 16))
    opt = cgx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   model.named_parameters(), compression="3bit", error_feedback=True,
                                   block_bytes=4096)
    ckpt = cgx.Checkpoints(args.ckpt)
    start, state = ckpt.load_latest()
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
    for step in range(start, args.steps):
        if step == args.die_at_step and config.rank == args.die_rank and config.incarnation == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = batch(config.rank, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if (step + 1) % args.every == 0:
            ckpt.save(step + 1, {"model": model.state_dict(), "optimizer": opt.state_dict()})
    Path(args.out).mkdir(parents=True, exist_ok=True)
    torch.save({"final": model.state_dict(), "resumed_from": start, "incarnation": config.incarnation,
                "rounds": opt.state_dict()["cgx_ps"]["pipeline"]["rounds"], "intranode": opt.intranode,
                "num_nodes": config.num_nodes}, Path(args.out) / f"rank-{config.rank}.pt")
    cgx.shutdown()


if __name__ == "__main__":
    main()
