"""Shards at node counts this machine cannot host as real workers: replayed nodes, pre-encoded pushes.

    .venv/bin/python benchmarks/shard_scale.py [--nodes 2 4 8 16 32] [--model resnet50] [--shards 1]
                                               [--rounds 3] [--bits 4] [--plane grpc|raw] [--json FILE]

Each of N nodes is a set of ``ShardClient`` s (one per shard) in this process, pushing the blocks of
a real model's gradient (``--model``: its tensors' names and shapes, cgx_ps.planning.shapes), each
block encoded once up front, and pulling the sum: what a shard does for N workers, without their
forward, backward or codec. The nodes' own work (gRPC framing in one Python process) shares the 2
cores with the shards, so round times at large N measure this process, not the shards; the figure
is the shards' CPU per round (/proc), and from it the compressed input a shard takes in per
CPU-second. The performance model (cgx_ps.planning.model) assumes that rate does not depend on N:
a shard's CPU per step = N x the bytes a node pushes to it / ``Speeds.shard_ingest_Bps``; that is
what extrapolates it to 16-256 nodes. Each N is printed beside the model's shard CPU per round and
their ratio. Peer: a raw TCP copy of the same compressed bytes between two processes (the
``net_cpu_Bps`` the model charges a host for moving bytes), in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

import torch

if __name__ == "__main__" and not __package__:  # `python benchmarks/shard_scale.py`: import the package
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.argtypes import at_least, bits  # noqa: E402
from benchmarks.procstat import figure, per_cpu  # noqa: E402
from benchmarks.server import copy_seconds, shard_cpu_seconds  # noqa: E402
from cgx_ps.kernels import encode  # noqa: E402
from cgx_ps.model_layout import codec_of  # noqa: E402
from cgx_ps.planning.model import Speeds  # noqa: E402
from cgx_ps.planning.shapes import MODELS, workload  # noqa: E402
from cgx_ps.server import LocalCluster  # noqa: E402
from cgx_ps.worker.pipeline.blocks import Compression, TensorInfo, build_layout  # noqa: E402
from cgx_ps.worker.shards.client import ShardClient  # noqa: E402


def model_blocks(model: str, shards: int, bits_: int, block_mb: float):
    """(layout, each block's payload encoded once, seeded) of ``model``'s gradient."""
    tensors = [TensorInfo(t.name, tuple(t.shape)) for t in workload(model, 0.0).tensors]
    layout = build_layout(tensors, shards, Compression(bits=bits_),
                          block_bytes=int(block_mb * (1 << 20)))
    gen = torch.Generator().manual_seed(0)
    # each block in its own codec: the layout leaves small tensors (here: blocks of them) fp32
    payloads = {b.block_id: encode(torch.randn(b.numel, generator=gen), codec_of(b.codec), bits=b.codec.bits or bits_,
                                   bucket_size=b.codec.bucket_size or 1024, seed=1).to_bytes()
                for b in layout.blocks}
    return layout, payloads


async def replay(addresses: list[str], pids: list[int], nodes: int, layout, payloads: dict[int, bytes],
                 rounds: int, plane: str) -> dict:
    """Timed rounds (after one warm-up) of ``nodes`` replayed nodes: wall time, the shards' CPU and
    this process's CPU per round."""
    job = f"shard-scale-{uuid.uuid4().hex[:8]}"
    clients = [[ShardClient(a, f"node-{i}", nodes, layout, job_id=job, dataplane=plane) for a in addresses]
               for i in range(nodes)]
    try:
        await asyncio.gather(*[c.connect() for per_node in clients for c in per_node])
        walls = []
        for r in range(rounds + 1):
            if r == 1:
                shard0, client0 = sum(shard_cpu_seconds(p) for p in pids), time.process_time()
            t0 = time.perf_counter()
            await asyncio.gather(*[per_node[b.shard].exchange(b.block_id, r, payloads[b.block_id])
                                   for per_node in clients for b in layout.blocks])
            walls.append(time.perf_counter() - t0)
        client_s = time.process_time() - client0
        await asyncio.sleep(0.5)  # work a shard finishes after the last result is sent
        shard_s = sum(shard_cpu_seconds(p) for p in pids) - shard0
    finally:
        await asyncio.gather(*[c.close() for per_node in clients for c in per_node], return_exceptions=True)
    return {"round_s": statistics.median(walls[1:]), "shard_cpu_s": shard_s / rounds, "nodes_cpu_s": client_s / rounds}


async def sweep(args: argparse.Namespace, layout, payloads: dict[int, bytes], pushed: int, speeds: Speeds) -> list[dict]:
    """Every node count in turn, each on shards of its own, in one event loop (grpc.aio keeps a
    poller bound to the first loop: a second ``asyncio.run`` in the process left its callbacks
    failing on a closed loop)."""
    rows = []
    for nodes in args.nodes:
        extra = ["--log-level", "WARNING"]  # otherwise a shard as `cgx-ps server` starts, as benchmarks/server.py runs it
        with LocalCluster(args.shards, extra_args=extra, token_file="",
                          data_base_port=0 if args.plane == "raw" else -1) as cluster:
            got = await replay(cluster.addresses, [proc.pid for proc in cluster.procs], nodes, layout, payloads,
                               args.rounds, args.plane)
        per_shard_in = nodes * pushed / args.shards
        model_cpu = per_shard_in / speeds.shard_ingest_Bps  # one shard's CPU per round, as the model has it
        shard_cpu = got["shard_cpu_s"] * args.rounds / args.shards  # one shard's, over the timed rounds
        ingest = per_cpu(per_shard_in * args.rounds / 1e6, shard_cpu)  # None: under /proc's resolution
        ratio = shard_cpu / (model_cpu * args.rounds) if ingest is not None else None
        rows.append({"nodes": nodes, **got, "input_per_shard_MB": per_shard_in / 1e6, "ingest_MBps_per_cpu_s": ingest,
                     "model_shard_cpu_s": model_cpu, "measured_over_model": ratio})
        print(f"{nodes:4d} nodes: round {got['round_s']:.3f} s; per shard per round {per_shard_in / 1e6:.0f} MB in, "
              f"CPU {shard_cpu / args.rounds * 1e3:.0f} ms ({figure(ingest, '.0f', ' MB')} of input per CPU-second), "
              f"the model's {model_cpu * 1e3:.0f} ms (x{figure(ratio, '.2f')}); the nodes' process "
              f"{got['nodes_cpu_s'] * 1e3:.0f} ms", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=at_least(1), nargs="+", default=[2, 4, 8, 16, 32])
    p.add_argument("--model", choices=MODELS, default="resnet50")
    p.add_argument("--shards", type=at_least(1), default=1)
    p.add_argument("--rounds", type=at_least(1), default=3, help="timed rounds per node count (after a warm-up)")
    p.add_argument("--bits", type=bits, default=4)
    p.add_argument("--block-mb", type=float, default=4.0, help="fp32 MB per block")
    p.add_argument("--plane", choices=("grpc", "raw"), default="grpc")
    p.add_argument("--json", type=Path)
    args = p.parse_args()

    layout, payloads = model_blocks(args.model, args.shards, args.bits, args.block_mb)
    pushed = sum(len(v) for v in payloads.values())  # bytes one node pushes per round, all shards
    speeds, load_before = Speeds(), os.getloadavg()
    rows = asyncio.run(sweep(args, layout, payloads, pushed, speeds))
    tcp_s = copy_seconds(b"".join(payloads.values()), 8) / 8
    print(f"{args.model}: {len(layout.blocks)} blocks, {pushed / 1e6:.1f} MB pushed per node per round at "
          f"{args.bits}-bit, {args.shards} shard(s), {args.plane}; peer: raw TCP copy of one node's bytes "
          f"{pushed / tcp_s / 1e6:.0f} MB/s; load {load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after; "
          f"the model's shard ingest {speeds.shard_ingest_Bps / 1e6:.0f} MB per CPU-second")
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "shards": args.shards, "bits": args.bits,
                                         "plane": args.plane, "pushed_per_node_MB": pushed / 1e6,
                                         "tcp_copy_MBps": pushed / tcp_s / 1e6, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
