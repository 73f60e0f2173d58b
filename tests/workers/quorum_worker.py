"""A worker for tests/test_quorum.py: a small model trained with DistributedOptimizer (or, with
--ddp, DDP over gloo with the cgx-ps comm hook, its SGD caught up by cgx.catch_up_with) until the
job has taken --steps steps, with seeded per-node data; --stall-at/--stall-s make this node stall
(a sleep) before one of the steps it computes; --sigstop-at makes it SIGSTOP itself there instead
(the whole process frozen, its gRPC threads too, until the test sends SIGCONT); --die-at makes it
SIGKILL itself after that step's backward (its pushes under way); --save/--resume write and load
a checkpoint (the model's and the optimizer's state_dict()).

Prints one JSON line: the node's steps, how many it computed itself and which it caught up on,
a digest of its final parameters, the seconds its training loop took, and what the tuner left
(--compression adaptive:N or auto:N): each block's bits, auto mode's choice, the decisions and the
checkpoint's counters and settings; saves the parameters with torch.save to --out. A ConfigError
at setup prints {"refused": message} instead.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import time
from pathlib import Path

import torch

import cgx_ps.worker as cgx


def small_model(compression: str) -> torch.nn.Module:
    """The model, the same on every node; with adaptive bits a layer more, so that two tensors are
    quantized and the bits chosen for them differ and change (one alone always gets 4 bits)."""
    if compression.startswith("adaptive"):
        return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                   torch.nn.Linear(64, 4))
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))


def small_job(compression: str = "4bit", via: str = "allreduce"
              ) -> tuple[cgx.WorkerConfig, torch.nn.Module, torch.optim.Optimizer, torch.Generator]:
    """``cgx.init()``, a small model, the same on every node, its DistributedOptimizer (SGD with
    momentum, 4 bits) and this rank's seeded data (also tests/workers/join_worker.py's)."""
    config = cgx.init()
    torch.manual_seed(0)
    model = small_model(compression)
    opt = cgx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   model.named_parameters(), compression=compression, block_bytes=4096,
                                   uncompressed_via=via)
    cgx.broadcast_parameters(model.state_dict(), root_rank=0)
    return config, model, opt, torch.Generator().manual_seed(1000 + config.rank)


def per_step_schedule(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    """A learning rate that falls every step (as a warm-up or a cosine decay moves it): a round
    applied at another step's rate shows in the parameters' last bits."""
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1.0 + 0.1 * step))


def ddp_job(compression: str = "4bit", via: str = "allreduce", schedulers: list | None = None
            ) -> tuple[cgx.WorkerConfig, torch.nn.Module, torch.optim.Optimizer, torch.Generator, cgx.DDPHookState]:
    """``small_job``'s model and data under DDP (gloo: MASTER_ADDR/PORT from the test) with the cgx-ps hook;
    with ``schedulers`` (a list), a per-step scheduler of the optimizer is appended to it and caught up with."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    config = cgx.init()
    dist.init_process_group("gloo", rank=config.rank, world_size=config.world_size)
    torch.manual_seed(0)
    model = small_model(compression)
    ddp = DDP(model)  # broadcasts rank 0's parameters
    state = cgx.DDPHookState(ddp, compression=compression, block_bytes=4096, uncompressed_via=via)
    ddp.register_comm_hook(state, cgx.ddp_comm_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    if schedulers is not None:
        schedulers.append(per_step_schedule(opt))
    cgx.catch_up_with(opt, hook_state=state, schedulers=schedulers or [])
    return config, ddp, opt, torch.Generator().manual_seed(1000 + config.rank), state


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--stall-at", type=int, default=-1, help="computed step before which this node stalls")
    p.add_argument("--stall-s", type=float, default=0.0)
    p.add_argument("--sigstop-at", type=int, default=-1, help="computed step before which this node stops itself")
    p.add_argument("--sigstop-at-step", type=int, default=-1,
                   help="stops itself before the first step numbered this or later and of its parity (a node that caught "
                        "up on rounds before may have passed the number itself; the parity keeps the stop where it is "
                        "in a tuning interval of 2)")
    p.add_argument("--die-at", type=int, default=-1, help="computed step in whose backward this node is killed")
    p.add_argument("--step-s", type=float, default=0.05, help="emulated compute per step (a sleep)")
    p.add_argument("--ddp", action="store_true", help="DDP with the cgx-ps comm hook instead of DistributedOptimizer")
    p.add_argument("--compression", default="4bit", help="e.g. adaptive:3, auto:3 (tuned every 3 steps)")
    p.add_argument("--via", default="shards", help="uncompressed_via (auto mode's uncompressed steps)")
    p.add_argument("--scheduler", action="store_true", help="a per-step LR scheduler, given to cgx.catch_up_with")
    p.add_argument("--out", required=True)
    p.add_argument("--progress", help="a file this node writes its finished step count to after each step")
    p.add_argument("--save", help="a file the model's and the optimizer's state_dict() go to at the end")
    p.add_argument("--resume", help="a --save file to load before training (the steps count on from its own)")
    args = p.parse_args()
    schedulers: list = []  # stepped after every opt.step() of the loop, and for every round caught up on
    try:
        if args.ddp:
            config, model, opt, data, state = ddp_job(args.compression, args.via, schedulers if args.scheduler else None)
            steps_taken = lambda: state.steps_done  # noqa: E731
            driver = state.open()  # here, not at the first backward: a refusal comes now
        else:
            config, model, opt, data = small_job(args.compression, args.via)
            steps_taken, driver = (lambda: opt.steps_done), opt._cgx_driver  # noqa: E731
            if args.scheduler:
                schedulers.append(per_step_schedule(opt))
                cgx.catch_up_with(opt, schedulers=schedulers)
        if args.resume:
            saved = torch.load(args.resume)
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["optimizer"])
    except cgx.ConfigError as refused:  # settings refused (the DDP hook: at open())
        print(json.dumps({"refused": str(refused)}), flush=True)
        return
    computed, caught_up = 0, []
    started = time.monotonic()
    while steps_taken() < args.steps:  # finished steps, those caught up on included
        if computed == args.stall_at:
            time.sleep(args.stall_s)  # a stalled node: the others go on without it
        if computed == args.sigstop_at:
            os.kill(os.getpid(), signal.SIGSTOP)  # frozen until the test's SIGCONT
        if 0 <= args.sigstop_at_step <= steps_taken() and (steps_taken() - args.sigstop_at_step) % 2 == 0:
            args.sigstop_at_step = -1  # once
            os.kill(os.getpid(), signal.SIGSTOP)
        x = torch.randn(16, 32, generator=data)
        if args.compression.startswith("adaptive") and steps_taken() // 4 % 2:
            # every other 4 steps of the job, the first layer's gradients 30x smaller: the bits
            # chosen for the two quantized tensors change back and forth, SetCodecs after SetCodecs
            x = x / 30
        loss = (model(x) - x[:, :4]).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        if computed == args.die_at:
            time.sleep(0.01)  # its pushes under way: a node killed mid-round
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(args.step_s)
        before = steps_taken()
        opt.step()
        for scheduler in schedulers:
            scheduler.step()
        caught_up += range(before + 1, steps_taken())  # the steps of the rounds it applied without computing
        computed += 1
        if args.progress:  # a test that stalls another node waits on it (test_quorum_tuning.run_with_a_stall)
            Path(args.progress).write_text(str(steps_taken()))
    params = {n: t.detach().clone() for n, t in model.state_dict().items()}
    params.update({f"momentum/{i}": opt.state[p]["momentum_buffer"].clone()
                   for i, p in enumerate(model.parameters()) if p in opt.state})
    torch.save(params, args.out)
    if args.save:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, args.save)
    digest = hashlib.sha256(b"".join(t.numpy().tobytes() for t in params.values())).hexdigest()
    # what the tuner left: the settings and mode each round travels with, and the checkpoint's state
    pipe, saved = driver.pipe, driver.state_dict()
    print(json.dumps({"node": config.node_rank, "rank": config.rank, "steps": steps_taken(), "computed": computed,
                      "caught_up": caught_up, "digest": digest, "lr": opt.param_groups[0]["lr"], "train_s": time.monotonic() - started,
                      "bits": [pipe.settings(b).bits for b in range(pipe.num_blocks)], "compress": pipe.compress,
                      "decisions": [{k: d[k] for k in ("from_round", "compress", "bits") if k in d}
                                    for d in (d.as_dict() for d in driver.tuner.history)]
                      if driver.tuner is not None else [],
                      "checkpoint": {k: saved["pipeline"][k] for k in ("steps", "compress", "rounds", "settings")}}),
          flush=True)
    cgx.shutdown()


if __name__ == "__main__":
    main()
