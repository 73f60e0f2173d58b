"""Intra-node reduction: shared-memory reduce-scatter + all-gather vs a gloo allreduce, and bytes
leaving a node for 1 and 2 local ranks.

    .venv/bin/python benchmarks/intranode.py [--mb 68] [--iters 10]

Part 1 times the node reduction alone (no network, no codec): every local rank writes its
gradient into shared memory, each block's owner sums it, the others copy the owner's result.
The peer is ``torch.distributed.all_reduce`` over gloo among the same two local processes on the
same float32 tensor. Part 2 trains mlp17m for a few steps as one node with 1 and with 2 local
ranks against a local shard and reports the bytes the node pushed per step.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reducer_worker(local_rank: int, numel: int, iters: int, job: str) -> list[float]:
    from cgx_ps.worker.intranode import NodeReducer
    from cgx_ps.worker.layout import Compression, TensorInfo, build_layout

    layout = build_layout([TensorInfo("g", (numel,))], 1, Compression(bits=None))
    reducer = NodeReducer(layout, local_rank, 2, 0, job, timeout_s=60)
    grad = torch.randn(numel)
    times = []

    async def one(seq: int) -> None:
        for b in range(len(layout.blocks)):
            reducer.before_write(b, seq)
            a, z = reducer.offsets[b], reducer.offsets[b + 1]
            reducer.buffer(b).copy_(grad[a:z])
            reducer.mark_ready(b, seq)
        tasks = []
        for b in range(len(layout.blocks)):
            if reducer.owner(b) == local_rank:
                async def own(b=b):
                    await reducer.reduce(b, seq, lambda fn: asyncio.to_thread(fn))
                    reducer.publish(b, seq)
                tasks.append(own())
            else:
                tasks.append(reducer.fetch(b, seq))
        await asyncio.gather(*tasks)

    for i in range(iters + 2):
        t0 = time.perf_counter()
        asyncio.run(one(i + 1))
        if i >= 2:
            times.append(time.perf_counter() - t0)
    reducer.close()
    return times


def gloo_worker(rank: int, numel: int, iters: int) -> list[float]:
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=2)
    grad = torch.randn(numel)
    buf = torch.empty_like(grad)
    times = []
    for i in range(iters + 2):
        buf.copy_(grad)  # the same copy-in the shared-memory path does
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(buf)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    dist.destroy_process_group()
    return times


def _spawn_pair(mode: str, numel: int, iters: int) -> float:
    port, job = str(_free_port()), uuid.uuid4().hex[:8]
    procs = [subprocess.Popen([sys.executable, __file__, "--child", mode, "--rank", str(r), "--numel", str(numel),
                               "--iters", str(iters), "--job", job],
                              env=dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1"),
                              stdout=subprocess.PIPE, text=True) for r in range(2)]
    times = [json.loads(p.communicate(timeout=600)[0].strip().splitlines()[-1]) for p in procs]
    return statistics.median(max(a, b) for a, b in zip(*times))


def bytes_per_node(local: int, steps: int) -> float:
    from cgx_ps.server import LocalCluster

    with LocalCluster(1, extra_args=["--log-level", "WARNING"]) as cluster:
        job = uuid.uuid4().hex[:8]
        procs = [subprocess.Popen(
            [sys.executable, str(HERE / "cgx_step.py"), "--model", "mlp17m", "--steps", str(steps), "--warmup", "1",
             "--compression", "4bit"],
            env=dict(os.environ, LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(local), RANK=str(r), WORLD_SIZE=str(local),
                     CGX_PS_NODE_RANK="0", CGX_PS_NUM_NODES="1", CGX_PS_SERVERS=cluster.addresses[0],
                     CGX_PS_JOB_ID=job, OMP_NUM_THREADS="1"),
            stdout=subprocess.PIPE, text=True) for r in range(local)]
        results = [json.loads(p.communicate(timeout=600)[0].strip().splitlines()[-1]) for p in procs]
    return sum(r["bytes_pushed_per_step"] for r in results)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mb", type=float, default=68.4, help="fp32 MB per rank (mlp17m: 68.4)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--child", choices=["shm", "gloo"])
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--numel", type=int, default=0)
    p.add_argument("--job", default="")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.child == "shm":
        print(json.dumps(reducer_worker(args.rank, args.numel, args.iters, args.job)))
        return
    if args.child == "gloo":
        print(json.dumps(gloo_worker(args.rank, args.numel, args.iters)))
        return
    numel = int(args.mb * 1e6 / 4)
    shm = _spawn_pair("shm", numel, args.iters)
    gloo = _spawn_pair("gloo", numel, args.iters)
    one, two = bytes_per_node(1, args.steps), bytes_per_node(2, args.steps)
    print(f"2 local ranks, {args.mb:g} MB fp32 each, median of {args.iters}")
    print("| measure | value |")
    print("|---|---|")
    print(f"| shared-memory reduce-scatter + all-gather (cgx-ps) | {shm * 1e3:.1f} ms |")
    print(f"| gloo all_reduce among the same 2 processes (peer) | {gloo * 1e3:.1f} ms |")
    print(f"| cgx-ps / gloo | {shm / gloo:.2f} |")
    print(f"| bytes pushed per node per step, mlp17m 4-bit, 1 local rank | {one / 1e6:.2f} MB |")
    print(f"| bytes pushed per node per step, mlp17m 4-bit, 2 local ranks | {two / 1e6:.2f} MB |")


if __name__ == "__main__":
    main()
