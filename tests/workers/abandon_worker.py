"""A rank whose backward raises at one step (tests/test_abandoned_step.py): the exception comes
from a hook on a chosen parameter, after cgx-ps's own hook on it ran, as a failure inside the
loss's graph would. The training loop catches what it raises, calls ``zero_grad()`` and goes on
with the next batch. Prints one JSON line: each step's outcome and the final parameters.

    abandon_worker.py --steps 6 --fail-at 2 [--fail] [--nan] [--no-catch] [--skip] [--compression fp32]
                      [--warmup-steps N] [--allow-non-finite]

``--fail``: this rank's backward raises at step ``--fail-at``; ``--skip``: this rank leaves that
step out altogether (the reference run: no forward, no backward, no step). ``--nan``: instead of
raising, this rank's gradient of the chosen parameter is NaN at that step. ``--no-catch``: the loop
catches nothing from cgx-ps (the process ends with the error). ``--allow-non-finite``:
the loop a GradScaler's user writes (synchronize, then skip the step if a gradient is not finite,
as ``scaler.step`` does) instead of ``step()``."""

from __future__ import annotations

import argparse
import json
import time

import torch

import cgx_ps.worker as cgx


class BackwardFailed(RuntimeError):
    """What the chosen parameter's hook raises: stands for an error in the loss's graph."""


def model() -> torch.nn.Module:
    torch.manual_seed(0)  # the same initial parameters on every rank
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 4))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(16, 32, generator=gen), torch.randn(16, 4, generator=gen)


def step_as_a_scaler_does(opt: torch.optim.Optimizer, net: torch.nn.Module) -> str:
    """``scaler.step(opt)`` after ``opt.synchronize()``: the step is skipped if a gradient is not finite."""
    opt.synchronize()
    if not all(bool(torch.isfinite(p.grad).all()) for p in net.parameters()):
        return "skipped: not finite"
    with opt.skip_synchronize():
        opt.step()
    return "ok"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--fail-at", type=int, default=2)
    p.add_argument("--fail", action="store_true")
    p.add_argument("--skip", action="store_true")
    p.add_argument("--nan", action="store_true")
    p.add_argument("--no-catch", action="store_true")
    p.add_argument("--fail-param", default="2.weight",
                   help="the parameter whose hook raises, or 'last': the last of the step's gradients to arrive")
    p.add_argument("--compression", default="fp32")
    p.add_argument("--warmup-steps", type=int, default=0)
    p.add_argument("--allow-non-finite", action="store_true")
    args = p.parse_args()
    cgx.init()
    net = model()
    # small blocks: the layer backward reaches first fills blocks of its own, pushed before the failure
    opt = cgx.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9),
                                   net.named_parameters(), compression=args.compression, block_bytes=4096,
                                   warmup_steps=args.warmup_steps, allow_non_finite=args.allow_non_finite)
    named = dict(net.named_parameters())
    armed = [False]
    arrived = [0]

    def fail(_param: torch.Tensor) -> None:  # registered after cgx-ps's hook: that one ran first
        arrived[0] += 1
        if armed[0] and (args.fail_param != "last" or arrived[0] == len(named)):
            armed[0] = False
            raise BackwardFailed(f"backward failed at {args.fail_param}")

    def poison(grad: torch.Tensor) -> torch.Tensor:  # before accumulation: cgx-ps's hook reads the NaN
        return grad * float("nan") if nan_now[0] else grad

    nan_now = [False]
    for name, param in named.items():
        if args.fail_param in (name, "last"):
            param.register_post_accumulate_grad_hook(fail)
            param.register_hook(poison)
    rank = cgx.rank()
    outcomes = []
    for step in range(args.steps):
        if step == args.fail_at and args.skip:
            outcomes.append("skipped")
            continue
        t0 = time.monotonic()
        try:
            opt.zero_grad()
        except cgx.CgxPsError as exc:  # too late to abandon: apply the step, as the other ranks do
            outcomes[-1] += f"; zero_grad() said: {exc}"
            opt.step()
            opt.zero_grad()
        x, y = batch(rank, step)
        armed[0], arrived[0] = args.fail and step == args.fail_at, 0
        nan_now[0] = args.nan and step == args.fail_at
        try:
            torch.nn.functional.mse_loss(net(x), y).backward()
            if args.allow_non_finite:
                outcomes.append(step_as_a_scaler_does(opt, net))
            else:
                opt.step()
                outcomes.append("ok")
        except (BackwardFailed, cgx.CgxPsError) as exc:  # the loop skips the batch: zero_grad() next
            if args.no_catch:
                raise
            outcomes.append(f"{type(exc).__name__}: {exc}")
        outcomes[-1] += f" ({time.monotonic() - t0:.1f} s)"
    opt.zero_grad()
    print(json.dumps({"rank": rank, "outcomes": outcomes, "steps": opt.stats.step,
                      "params": {n: t.detach().flatten().tolist() for n, t in net.state_dict().items()}}),
          flush=True)
    cgx.shutdown()


if __name__ == "__main__":
    main()
