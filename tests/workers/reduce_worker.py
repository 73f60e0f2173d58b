"""A local rank for the intra-node tests: drives NodeReducer alone (no shards, no codec).

Every step, each rank writes a known gradient per block, the block's owner sums the node's
gradients and stands in for the shard exchange by halving the sum (as decode would overwrite
the buffer), then publishes; the others fetch. Writes every step's buffers with torch.save, so
the test can check them against the exact sum computed on the CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json

import torch

from cgx_ps.worker.intranode.reduction import NodeReducer
from cgx_ps.worker.pipeline.blocks import Compression, TensorInfo, build_layout

SHAPES = [("a", (300, 64)), ("b", (1000,)), ("c", (77, 130))]


def layout():
    return build_layout([TensorInfo(n, s) for n, s in SHAPES], 1, Compression(bits=None), block_bytes=16384)


def gradient(rank: int, step: int, numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(1000 * step + rank))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--local-rank", type=int, required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--run-tag", default="", help="random per run, the same for every rank (the session id in training)")
    p.add_argument("--device", default="cpu", help="cpu, cuda:0, or cuda:{rank} (one GPU per local rank)")
    p.add_argument("--transport", default="auto")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--timeout", type=float, default=30.0)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    lay = layout()
    device = torch.device(args.device.replace("{rank}", str(args.local_rank)))
    pad = torch.empty(12345, device=device)  # the buffer must not start its allocation: offset > 0 on GPUs
    reducer = NodeReducer(lay, args.local_rank, args.size, 0, args.job, timeout_s=args.timeout, device=device,
                          transport=args.transport, run_tag=args.run_tag)
    print("ready", flush=True)  # set up: the tests may kill -9 a rank from here on
    numel = reducer.offsets[-1]
    results = []

    async def in_thread(fn) -> None:
        await asyncio.to_thread(fn)

    async def one(step: int) -> None:
        seq = step + 1
        grad = gradient(args.local_rank, step, numel).to(device)
        for b in range(len(lay.blocks)):
            reducer.before_write(b, seq)
            reducer.buffer(b).copy_(grad[reducer.offsets[b]:reducer.offsets[b + 1]])
            reducer.mark_ready(b, seq)

        async def own(b: int) -> None:
            await reducer.reduce(b, seq, in_thread)
            reducer.buffer(b).mul_(0.5)  # the "exchange": the result replaces the sum
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()
            reducer.publish(b, seq)

        await asyncio.gather(*(own(b) if reducer.owner(b) == args.local_rank else
                               reducer.fetch(b, seq, run_in_thread=in_thread) for b in range(len(lay.blocks))))
        results.append(torch.cat([reducer.buffer(b) for b in range(len(lay.blocks))]).cpu().clone())

    for step in range(args.steps):
        asyncio.run(one(step))
    export = json.loads(reducer.own.export) if reducer.own.export else {}
    torch.save({"results": results, "owners": reducer.owners, "transport": reducer.transport,
                "offset_bytes": export.get("offset_bytes"), "pad": pad.numel()}, args.out)
    reducer.close()


if __name__ == "__main__":
    main()
