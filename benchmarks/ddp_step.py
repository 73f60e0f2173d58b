#!/usr/bin/env python3
"""One torch.distributed DDP (gloo) training worker; prints one JSON line.

Launched once per host (see ``netcluster.run_ddp``) with the usual env
``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` (and
``GLOO_SOCKET_IFNAME``).  With ``WORLD_SIZE=1`` (or no env at all) it trains
the bare model without a process group and reports the median step time as
``single_process_compute_s``: the compute cost of one step with no
communication at all.

The data are synthetic but learnable: inputs are Gaussian, labels are the
argmax of a fixed random "teacher" network.  Everything is seeded from
``--seed``, so the same seed gives the same initial model, batches (per rank
and step) and evaluation set in every run, and losses are comparable across
hooks.  Batches are generated before the timed loop.

Output (one line of JSON on stdout), among others: ``step_times_s`` (every
step, warm-up included), ``median_step_s`` (after warm-up), ``eval_loss``
(held-out loss after training), ``train_loss`` (last local batch),
``tx_bytes_per_step``/``rx_bytes_per_step`` (from /proc/net/dev of
``--iface``, over the timed steps; null if the interface is absent),
``cpu_s_per_step`` (user + system CPU seconds of this process, all threads,
over the timed steps) and ``host_cpu_s_per_step`` (the same plus the
processes named in ``CGX_PS_BENCH_HOST_PIDS``, the colocated cgx-ps shards:
what one host spends per step; equal to ``cpu_s_per_step`` for DDP).

``--hook allreduce`` registers torch's own ``default_hooks.allreduce_hook``: DDP's allreduce as a
Python comm hook (divide, all_reduce, ``future.then``), the peer that shows what any Python hook
costs over DDP's built-in path. ``thread_cpu_s_per_step`` splits ``cpu_s_per_step`` by thread
role (``procstat.ThreadCpu``: training, communication, codec, other).

``--hook cgx`` registers the cgx-ps DDP communication hook (``cgx.DDPHookState(ddp,
compression=--compression, block_bytes=--block-mb)`` with ``cgx.ddp_comm_hook``): DDP's own
bucketing and overlap, with every bucket averaged through the cgx-ps shards in CGX_PS_SERVERS
(``netcluster.run_cgx(..., front_end="ddp-hook")`` starts them and sets the env). It needs the
cgx-ps env as well as the torch.distributed one (``cgx.init()`` runs first), and adds cgx_step.py's
``exposed_comm_s`` (median over the timed steps of ``DDPHookState.stats.exposed_comm_s``: from the
last bucket handed over to the last block decoded) and ``bytes_pushed_per_step`` /
``fp32_bytes_per_step``, and ``timed_paths``: how each timed step was averaged ("allreduce": DDP's,
auto mode; "shards"; "compressed"), to split ``step_cpu_s`` by path.
"""


from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

if __name__ == "__main__" and not __package__:  # `python benchmarks/ddp_step.py`: import the package
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.workload import (Teacher, batch_seed, eval_loss, make_batch, model_from_args,  # noqa: E402
                                 timed_training, training_parser)

HOOKS = ("none", "allreduce", "fp16", "powersgd", "cgx")
# The built-in powerSGD_hook chains futures with ``.then`` and calls ``.wait()`` on a
# new all_reduce *inside* the callbacks.  Gloo runs future callbacks on its worker
# threads (2 per process group), so two buckets in flight can block both workers
# while the all_reduces they wait for sit in the queue behind them: a deadlock
# (seen with mlp17m and DDP's default 25 MiB buckets).  One bucket (an explicit
# bucket_cap_mb >= model size also disables DDP's small first bucket) avoids it.
POWERSGD_BUCKET_CAP_MB = 1024


def register_hook(ddp: nn.parallel.DistributedDataParallel, hook: str, seed: int, rank_pq: int,
                  compression: str = "4bit", block_mb: float = 4.0) -> object:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if hook == "cgx":
        import cgx_ps.worker as cgx

        state = cgx.DDPHookState(ddp, compression=compression, block_bytes=int(block_mb * (1 << 20)))
        ddp.register_comm_hook(state, cgx.ddp_comm_hook)
        return state
    if hook == "allreduce":  # what DDP does without a hook, as a Python hook: the cost of any comm hook
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        return None
    if hook == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return None
    if hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=rank_pq,
            start_powerSGD_iter=2,  # the minimum with error feedback / warm start; warm-up covers it
            use_error_feedback=True, warm_start=True, random_seed=seed,
        )
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return state
    return None


# --------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = training_parser(__doc__.split("\n\n")[0])
    p.add_argument("--hook", choices=HOOKS, default="none", help="cgx: the cgx-ps DDP hook (--compression, --block-mb)")
    p.add_argument("--powersgd-rank", type=int, default=4)
    p.add_argument("--bucket-cap-mb", type=float, default=None,
                   help="DDP bucket size in MiB (default: DDP's 25; for powersgd %d, see POWERSGD_BUCKET_CAP_MB)"
                   % POWERSGD_BUCKET_CAP_MB)
    p.add_argument("--bucket-view", choices=("default", "on", "off"), default="default",
                   help="DDP's gradient_as_bucket_view (default: on for --hook cgx, DDP's off otherwise)")
    p.add_argument("--timeout", type=float, default=300, help="process-group timeout, seconds")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.hook == "powersgd" and args.warmup < 2:
        args.warmup = 2  # PowerSGD runs plain allreduce before its start_powerSGD_iter
    torch.set_num_threads(args.threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    distributed = world > 1

    if args.hook == "cgx" and not distributed:
        raise SystemExit("--hook cgx needs WORLD_SIZE > 1 (and the cgx-ps env: CGX_PS_SERVERS, ...)")
    cgx = None
    if args.hook == "cgx":
        import cgx_ps.worker as cgx

        cgx.init()  # before the process group: the hook's state registers with the shards it names
    t_init = time.perf_counter()
    if distributed:
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=args.timeout))
    init_s = time.perf_counter() - t_init

    torch.manual_seed(args.seed)  # identical initial model on every rank (DDP broadcasts it anyway)
    model = model_from_args(args)
    n_params = sum(p.numel() for p in model.parameters())
    if args.hook == "powersgd" and args.bucket_cap_mb is None:
        args.bucket_cap_mb = POWERSGD_BUCKET_CAP_MB
    ddp_kw = {} if args.bucket_cap_mb is None else {"bucket_cap_mb": args.bucket_cap_mb}
    if args.bucket_view == "on" or (args.bucket_view == "default" and args.hook == "cgx"):
        ddp_kw["gradient_as_bucket_view"] = True  # the hook decodes into the bucket; .grad is the bucket: no copy back
    net = nn.parallel.DistributedDataParallel(model, **ddp_kw) if distributed else model
    hook_state = (register_hook(net, args.hook, args.seed, args.powersgd_rank, args.compression, args.block_mb)                  if distributed else None)
    opt = torch.optim.SGD(net.parameters(), lr=args.lr)

    teacher = Teacher(args.model, args.seed)
    total = args.warmup + args.steps
    batches = [make_batch(args.model, teacher, args.batch_size, batch_seed(args.seed, s, rank)) for s in range(total)]
    eval_x, eval_y = make_batch(args.model, teacher, args.eval_size, 7_777_777 + args.seed)
    eval_initial = eval_loss(model, eval_x, eval_y)
    if distributed:
        dist.barrier()

    exposed, paths, moved = [], [], {"pushed": 0, "fp32": 0}  # --hook cgx only

    def hook_stats() -> None:
        if args.hook == "cgx":  # the step ended in the last bucket's future, which backward() waited for
            exposed.append(hook_state.stats.exposed_comm_s)
            paths.append(hook_state.stats.path if not hook_state.stats.compressed else "compressed")
            moved["pushed"] += hook_state.stats.bytes_pushed
            moved["fp32"] += hook_state.stats.fp32_bytes

    timed = timed_training(net, opt, batches, args.warmup, args.iface, hook_stats)
    median = timed["median_step_s"]
    result = {
        "rank": rank,
        "world_size": world,
        "model": args.model,
        "scale": args.scale,
        "emulated_compute_s": getattr(model, "compute_s", None),
        "params": n_params,
        "hook": args.hook if distributed else None,
        "batch_size": args.batch_size,
        "bucket_cap_mb": args.bucket_cap_mb if distributed else None,
        "gradient_as_bucket_view": bool(ddp_kw.get("gradient_as_bucket_view")) if distributed else None,
        "threads": args.threads,
        "steps": args.steps,
        "warmup": args.warmup,
        "init_s": init_s,
        **timed,
        "single_process_compute_s": median if not distributed else None,
        "eval_loss_initial": eval_initial,
        "eval_loss": eval_loss(model, eval_x, eval_y),
        "iface": args.iface,
        "torch": torch.__version__,
    }
    if args.hook == "cgx":
        result.update({"compression": args.compression, "block_mb": args.block_mb,
                       "exposed_comm_s": statistics.median(exposed) if exposed else None,
                       "bytes_pushed_per_step": moved["pushed"] / max(args.steps, 1),
                       "fp32_bytes_per_step": moved["fp32"] / max(args.steps, 1),
                       "tuning": [d.as_dict() for d in hook_state.tuning_history],
                       "timed_paths": paths})
    if distributed:
        dist.barrier()
        dist.destroy_process_group()
    if cgx is not None:
        cgx.shutdown()
    ok = math.isfinite(result["eval_loss"]) and math.isfinite(result["train_loss"])
    print(json.dumps(result), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # The result is out; skip interpreter teardown. c10d/gloo's static destructors occasionally
    # abort (SIGABRT) after a clean destroy_process_group, which turned a finished run into rc -6.
    os._exit(code)
