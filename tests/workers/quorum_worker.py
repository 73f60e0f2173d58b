"""A worker for tests/test_quorum.py: a small model trained with DistributedOptimizer (or, with --ddp, DDP over
gloo with the cgx-ps comm hook, its SGD caught up by cgx.catch_up_with) until the job has taken --steps steps, with seeded per-node data; --stall-at/--stall-s make this node stall (a sleep) before one of
the steps it computes; --sigstop-at makes it SIGSTOP itself there instead (the whole process frozen, its gRPC
threads too, until the test sends SIGCONT); --die-at makes it SIGKILL itself after that step's backward (its pushes
under way).

Prints one JSON line: the node's steps, how many it computed itself (the rest it caught up on),
a digest of its final parameters and the seconds its training loop took; saves them with torch.save to --out.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import time

import torch

import cgx_ps.worker as cgx


def small_job() -> tuple[cgx.WorkerConfig, torch.nn.Module, torch.optim.Optimizer, torch.Generator]:
    """``cgx.init()``, a small model, the same on every node, its DistributedOptimizer (SGD with
    momentum, 4 bits) and this rank's seeded data (also tests/workers/join_worker.py's)."""
    config = cgx.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = cgx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   model.named_parameters(), compression="4bit", block_bytes=4096)
    cgx.broadcast_parameters(model.state_dict(), root_rank=0)
    return config, model, opt, torch.Generator().manual_seed(1000 + config.rank)


def ddp_job() -> tuple[cgx.WorkerConfig, torch.nn.Module, torch.optim.Optimizer, torch.Generator, cgx.DDPHookState]:
    """``small_job``'s model and data under DDP (gloo: MASTER_ADDR/PORT from the test) with the cgx-ps hook."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    config = cgx.init()
    dist.init_process_group("gloo", rank=config.rank, world_size=config.world_size)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    ddp = DDP(model)  # broadcasts rank 0's parameters
    state = cgx.DDPHookState(ddp, compression="4bit", block_bytes=4096)
    ddp.register_comm_hook(state, cgx.ddp_comm_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    cgx.catch_up_with(opt, hook_state=state)
    return config, ddp, opt, torch.Generator().manual_seed(1000 + config.rank), state


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--stall-at", type=int, default=-1, help="computed step before which this node stalls")
    p.add_argument("--stall-s", type=float, default=0.0)
    p.add_argument("--sigstop-at", type=int, default=-1, help="computed step before which this node stops itself")
    p.add_argument("--die-at", type=int, default=-1, help="computed step in whose backward this node is killed")
    p.add_argument("--step-s", type=float, default=0.05, help="emulated compute per step (a sleep)")
    p.add_argument("--ddp", action="store_true", help="DDP with the cgx-ps comm hook instead of DistributedOptimizer")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if args.ddp:
        config, model, opt, data, state = ddp_job()
        steps_taken = lambda: state.open().pipe.steps  # noqa: E731
    else:
        config, model, opt, data = small_job()
        steps_taken = lambda: opt._cgx_pipe.steps  # noqa: E731
    computed = 0
    started = time.monotonic()
    while steps_taken() < args.steps:  # finished steps, those caught up on included
        if computed == args.stall_at:
            time.sleep(args.stall_s)  # a stalled node: the others go on without it
        if computed == args.sigstop_at:
            os.kill(os.getpid(), signal.SIGSTOP)  # frozen until the test's SIGCONT
        x = torch.randn(16, 32, generator=data)
        loss = (model(x) - x[:, :4]).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        if computed == args.die_at:
            time.sleep(0.01)  # its pushes under way: a node killed mid-round
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(args.step_s)
        opt.step()
        computed += 1
    params = {n: t.detach().clone() for n, t in model.state_dict().items()}
    params.update({f"momentum/{i}": opt.state[p]["momentum_buffer"].clone()
                   for i, p in enumerate(model.parameters()) if p in opt.state})
    torch.save(params, args.out)
    digest = hashlib.sha256(b"".join(t.numpy().tobytes() for t in params.values())).hexdigest()
    print(json.dumps({"node": config.node_rank, "rank": config.rank, "steps": steps_taken(), "computed": computed,
                      "digest": digest, "train_s": time.monotonic() - started}), flush=True)
    cgx.shutdown()


if __name__ == "__main__":
    main()
