"""Intra-node reduction: shared-memory reduce-scatter + all-gather vs a gloo allreduce, and bytes
leaving a node for 1 and 2 local ranks.

    .venv/bin/python benchmarks/intranode.py [--mb 68] [--iters 10] [--device cuda]

Part 1 times the node reduction alone (no network, no codec): every local rank writes its
gradient into shared memory, each block's owner sums it, the others copy the owner's result.
The peer is ``torch.distributed.all_reduce`` over gloo among the same two local processes on the
same float32 tensor. With ``--device cuda`` both processes put their gradient on GPU 0: cgx-ps
reduces through CUDA IPC, and the peers are gloo (which stages through host memory) and NCCL
on the same tensors. Part 2 trains mlp17m for a few steps as one node with 1, 2, ... local
ranks (``--local-sizes``) against a local shard and reports the bytes the node pushed per step.
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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reducer_worker(local_rank: int, numel: int, iters: int, job: str, device: torch.device) -> list[float]:
    from cgx_ps.worker.intranode.reduction import NodeReducer
    from cgx_ps.worker.pipeline.blocks import Compression, TensorInfo, build_layout

    layout = build_layout([TensorInfo("g", (numel,))], 1, Compression(bits=None))
    reducer = NodeReducer(layout, local_rank, 2, 0, job, timeout_s=60, device=device, run_tag=job)  # job: random per run
    grad = torch.randn(numel, device=device)
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
                tasks.append(reducer.fetch(b, seq, run_in_thread=lambda fn: asyncio.to_thread(fn)))
        await asyncio.gather(*tasks)

    for i in range(iters + 2):
        _sync(device)
        t0 = time.perf_counter()
        asyncio.run(one(i + 1))
        _sync(device)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    reducer.close()
    return times


def collective_worker(backend: str, rank: int, numel: int, iters: int, device: torch.device) -> list[float]:
    import torch.distributed as dist

    dist.init_process_group(backend, rank=rank, world_size=2)
    grad = torch.randn(numel, device=device)
    buf = torch.empty_like(grad)
    times = []
    for i in range(iters + 2):
        buf.copy_(grad)  # the same copy-in the cgx-ps path does
        dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        dist.all_reduce(buf)
        _sync(device)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    dist.destroy_process_group()
    return times


def _spawn_pair(mode: str, numel: int, iters: int, device: str) -> float | None:
    port, job = str(_free_port()), uuid.uuid4().hex[:8]
    procs = [subprocess.Popen([sys.executable, __file__, "--child", mode, "--rank", str(r), "--numel", str(numel),
                               "--iters", str(iters), "--job", job, "--device", device],
                              env=dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1"),
                              stdout=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    if any(p.returncode for p in procs):
        return None  # e.g. NCCL refuses two ranks on one GPU
    times = [json.loads(out.strip().splitlines()[-1]) for out in outs]
    return statistics.median(max(a, b) for a, b in zip(*times))


def bytes_per_node(local: int, steps: int) -> float:
    from cgx_ps.server import LocalCluster

    with LocalCluster(1, extra_args=["--log-level", "WARNING"]) as cluster:
        job = uuid.uuid4().hex[:8]
        procs = [subprocess.Popen(
            [sys.executable, str(HERE / "cgx_step.py"), "--model", "mlp17m", "--steps", str(steps), "--warmup", "1",
             "--compression", "4bit"],
            env=dict(os.environ, LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(local), RANK=str(r), WORLD_SIZE=str(local),
                     CGX_PS_NODE_RANK="0", CGX_PS_NUM_NODES="1", **cluster.worker_env(),
                     CGX_PS_JOB_ID=job, OMP_NUM_THREADS="1"),
            stdout=subprocess.PIPE, text=True) for r in range(local)]
        results = [json.loads(p.communicate(timeout=600)[0].strip().splitlines()[-1]) for p in procs]
    return sum(r["bytes_pushed_per_step"] for r in results)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mb", type=float, default=68.4, help="fp32 MB per rank (mlp17m: 68.4)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--local-sizes", type=int, nargs="+", default=[1, 2],
                   help="local world sizes for the bytes-per-node part")
    p.add_argument("--device", default="cpu", help="cpu, or cuda (both local ranks on GPU 0)")
    p.add_argument("--child", choices=["cgx", "gloo", "nccl"])
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--numel", type=int, default=0)
    p.add_argument("--job", default="")
    args = p.parse_args()
    torch.set_num_threads(1)
    device = torch.device(args.device)
    if device.type == "cuda":  # one GPU per local rank where there are enough, else both on GPU 0
        device = torch.device("cuda", args.rank % torch.cuda.device_count())
    if args.child == "cgx":
        print(json.dumps(reducer_worker(args.rank, args.numel, args.iters, args.job, device)))
        return
    if args.child:
        print(json.dumps(collective_worker(args.child, args.rank, args.numel, args.iters, device)))
        return
    numel = int(args.mb * 1e6 / 4)
    ours = _spawn_pair("cgx", numel, args.iters, args.device)
    gloo = _spawn_pair("gloo", numel, args.iters, args.device)
    if ours is None or gloo is None:
        sys.exit("a benchmark process failed (its error is above)")
    nccl = _spawn_pair("nccl", numel, args.iters, args.device) if device.type == "cuda" else None
    pushed = {n: bytes_per_node(n, args.steps) for n in args.local_sizes}
    how = "CUDA IPC" if device.type == "cuda" else "shared-memory"
    print(f"2 local ranks on {args.device}, {args.mb:g} MB fp32 each, median of {args.iters}")
    print("| measure | value |")
    print("|---|---|")
    print(f"| {how} reduce-scatter + all-gather (cgx-ps) | {ours * 1e3:.1f} ms |")
    print(f"| gloo all_reduce among the same 2 processes (peer) | {gloo * 1e3:.1f} ms |")
    print(f"| cgx-ps / gloo | {ours / gloo:.2f} |")
    if device.type == "cuda" and nccl is None:
        print("| nccl all_reduce among the same 2 processes (peer) | failed (NCCL refuses two ranks on one GPU) |")
    elif nccl is not None:
        print(f"| nccl all_reduce among the same 2 processes (peer) | {nccl * 1e3:.1f} ms |")
        print(f"| cgx-ps / nccl | {ours / nccl:.2f} |")
    for n, b in pushed.items():
        print(f"| bytes pushed per node per step, mlp17m 4-bit, {n} local rank{'s' if n > 1 else ''} | {b / 1e6:.2f} MB |")


if __name__ == "__main__":
    main()
