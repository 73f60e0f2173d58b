#!/usr/bin/env python3
"""Host-side cost of one step's block work on a worker, without a network: what the issue-16
profile blamed on gradient copies and fresh encode buffers.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/grad_memory.py [--model mlp17m] [--rounds 5] [--steps 10]

One process, the model's gradients (fresh tensors every step, as autograd leaves them after
``zero_grad(set_to_none=True)``), 4-bit blocks of ``--block-mb``, and an engine whose "shard"
returns the push itself (one node alone). The timed part is what a DistributedOptimizer step adds
on the host: submit every block (copy in or not, encode), the exchange, decode, and the write-back
into ``.grad``. Three modes, interleaved round by round in the same process:

    in place      blocks that are slices of one float32 gradient are encoded from and decoded
                  into it (the default now); payload memory reused
    copy          every block copied into the block buffers and back (in_place=False), payload
                  memory reused
    copy, fresh   as before this change: copies, and a fresh payload buffer every encode

Prints, per mode, the median over rounds of wall and CPU seconds (all threads) per step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

if __name__ == "__main__" and not __package__:  # `python benchmarks/grad_memory.py`: import the package
    sys.path[0] = str(Path(__file__).resolve().parents[1])
from benchmarks.workload import MODELS, build_model  # noqa: E402

from cgx_ps.kernels import HEADER_SIZE, PayloadScratch  # noqa: E402
from cgx_ps.worker import WorkerConfig  # noqa: E402
from cgx_ps.worker.shards.engine import CommEngine  # noqa: E402
from cgx_ps.worker.pipeline.blocks import Compression, TensorInfo, build_layout  # noqa: E402
from cgx_ps.worker.pipeline.block_pipeline import BlockPipeline  # noqa: E402


class EchoEngine(CommEngine):
    """The aggregate of a round is the push itself: the block work without a network."""

    async def push_pull(self, shard: int, block_id: int, round_: int, payload: bytes) -> bytes:
        return bytes(payload)  # the worker's push comes framed (PushFrames)


class FreshPayloads(PayloadScratch):
    """The old behaviour: a zeroed payload buffer allocated for every encode."""

    def payload(self, header):  # noqa: D102
        return np.zeros(HEADER_SIZE + header.body_size, dtype=np.uint8)


def one_step(pipe: BlockPipeline, template: dict[str, torch.Tensor], in_place: bool) -> tuple[float, float]:
    grads = {n: t.clone() for n, t in template.items()}  # what backward leaves (not timed)
    wall, cpu = time.perf_counter(), time.process_time()
    for b in pipe.tensors_ready(list(grads)):
        pipe.submit(b, grads.get, in_place)
    pipe.finish_step()
    for b in range(pipe.num_blocks):
        pipe.copy_out(b, grads.get)
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=MODELS, default="mlp17m")
    p.add_argument("--block-mb", type=float, default=4.0)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=10, help="steps per mode per round")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    named = list(build_model(args.model).named_parameters())
    template = {n: torch.randn(t.shape, generator=torch.Generator().manual_seed(i)) for i, (n, t) in enumerate(named)}
    layout = build_layout([TensorInfo.of(n, t) for n, t in named], 2, Compression.parse("4bit"),
                          int(args.block_mb * 2**20))
    engine = EchoEngine(WorkerConfig(servers=("127.0.0.1:9",)), "node-0", 1)
    try:
        pipes = {mode: BlockPipeline(layout, engine, engine.config, {n: torch.device("cpu") for n, _ in named})
                 for mode in ("in place", "copy", "copy, fresh")}
        for block in pipes["copy, fresh"]._blocks:
            block.scratch = FreshPayloads()
        results: dict[str, list[tuple[float, float]]] = {m: [] for m in pipes}
        for _ in range(args.rounds):
            for mode, pipe in pipes.items():
                one_step(pipe, template, mode == "in place")  # warm this mode's memory up
                runs = [one_step(pipe, template, mode == "in place") for _ in range(args.steps)]
                results[mode].append((statistics.mean(w for w, _ in runs), statistics.mean(c for _, c in runs)))
    finally:
        engine.close()
    summary = {m: {"wall_s": statistics.median(w for w, _ in r), "cpu_s": statistics.median(c for _, c in r),
                   "in_place_blocks": pipes[m].stats.in_place_blocks, "blocks": pipes[m].num_blocks}
               for m, r in results.items()}
    for mode, s in summary.items():
        print(f"{mode:12s}  {s['wall_s'] * 1e3:7.1f} ms wall  {s['cpu_s'] * 1e3:7.1f} ms CPU per step  "
              f"({s['in_place_blocks']}/{s['blocks']} blocks in place)")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
