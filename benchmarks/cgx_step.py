#!/usr/bin/env python3
"""One cgx-ps training worker with the same model, data and JSON output as ddp_step.py.

Launched once per worker with RANK, WORLD_SIZE, CGX_PS_SERVERS (and CGX_PS_NODE_RANK /
CGX_PS_NUM_NODES / CGX_PS_JOB_ID); trains the model of ``--model`` with cgx-ps compression
``--compression`` and prints one JSON line. Besides ddp_step.py's fields it reports
``exposed_comm_s`` (median time step() waited for communication after overlap) and
``bytes_pushed_per_step`` / ``fp32_bytes_per_step``; ``host_cpu_s_per_step`` counts the colocated
shards named in CGX_PS_BENCH_HOST_PIDS (netcluster.run_cgx sets it).

``--process-group`` also joins a gloo process group (MASTER_ADDR / MASTER_PORT, as ddp_step.py):
auto mode's uncompressed steps then all_reduce on it instead of going through the shards.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

if __name__ == "__main__" and not __package__:  # `python benchmarks/cgx_step.py`: import the package
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import cgx_ps.worker as cgx  # noqa: E402
from benchmarks.workload import (Teacher, batch_seed, eval_loss, make_batch, model_from_args,  # noqa: E402
                                 timed_training, training_parser)


def parse_args(argv=None) -> argparse.Namespace:
    p = training_parser(__doc__.split("\n\n")[0])
    p.add_argument("--process-group", action="store_true",
                   help="join a gloo group (MASTER_ADDR/PORT): auto mode's uncompressed steps all_reduce on it")
    p.add_argument("--timeout", type=float, default=300, help="process-group timeout, seconds")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    config = cgx.init()
    if args.process_group:
        dist.init_process_group("gloo", rank=config.rank, world_size=config.world_size,
                                timeout=datetime.timedelta(seconds=args.timeout))
    torch.manual_seed(args.seed)  # same initial model as ddp_step.py (and broadcast anyway)
    model = model_from_args(args)
    opt = cgx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr), model.named_parameters(),
                                   compression=args.compression, block_bytes=int(args.block_mb * (1 << 20)))
    cgx.broadcast_parameters(model.state_dict(), root_rank=0)
    teacher = Teacher(args.model, args.seed)
    total = args.warmup + args.steps
    batches = [make_batch(args.model, teacher, args.batch_size, batch_seed(args.seed, s, config.rank))
               for s in range(total)]
    eval_x, eval_y = make_batch(args.model, teacher, args.eval_size, 7_777_777 + args.seed)

    exposed, moved, paths = [], {"pushed": 0, "fp32": 0}, {}

    def optimizer_stats() -> None:
        exposed.append(opt.stats.exposed_comm_s)
        paths[opt.stats.path] = paths.get(opt.stats.path, 0) + 1
        moved["pushed"] += opt.stats.bytes_pushed
        moved["fp32"] += opt.stats.fp32_bytes

    timed = timed_training(model, opt, batches, args.warmup, args.iface, optimizer_stats)
    result = {
        "rank": config.rank, "world_size": config.world_size, "model": args.model, "scale": args.scale,
        "emulated_compute_s": getattr(model, "compute_s", None),
        "params": sum(p.numel() for p in model.parameters()), "compression": args.compression,
        "batch_size": args.batch_size, "threads": args.threads, "steps": args.steps, "warmup": args.warmup,
        **timed, "exposed_comm_s": statistics.median(exposed) if exposed else None,
        "bytes_pushed_per_step": moved["pushed"] / max(args.steps, 1),
        "fp32_bytes_per_step": moved["fp32"] / max(args.steps, 1),
        "steps_by_path": paths,  # timed steps through the shards / all_reduce on the process group
        "eval_loss": eval_loss(model, eval_x, eval_y), "iface": args.iface, "torch": torch.__version__,
        # adaptive/auto decisions: bits per tensor, compress on/off and the figures behind them
        "tuning": [d.as_dict() for d in opt.tuning_history],
    }
    if args.process_group:
        dist.barrier()
        dist.destroy_process_group()
    cgx.shutdown()
    print(json.dumps(result), flush=True)
    return 0 if math.isfinite(result["eval_loss"]) else 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # as ddp_step.py: c10d/gloo's static destructors occasionally abort after a clean
    # destroy_process_group; the result is out, skip the interpreter's teardown
    os._exit(code)
