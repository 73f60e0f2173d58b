"""A shard's kernel work without gRPC: N nodes push 4-bit blocks into an Aggregator on the shard's
executor, round after round; the CPU per round of each code tree, rounds alternated between them.

    .venv/bin/python benchmarks/aggregator.py [--trees DIR ...] [--rounds 30] [--nodes 4] [--mb 100]
    .venv/bin/python benchmarks/aggregator.py --profile [--rounds 10]

Each tree (a directory holding a ``cgx_ps`` package, say ``git archive <commit> cgx_ps | tar -x -C
DIR``; this checkout is always the last) runs in a process of its own that sums one round per
request, so round r of every tree runs back to back (the order rotated every round) on the same
load: the paired ratios of CPU per round are the figure to trust on a shared machine. What a
round costs here is what the shard's kernel threads and its event loop's aggregation spend on
it (checking, keeping, summing, encoding, the executor hand-offs), without the gRPC I/O that
benchmarks/server.py adds.

``--profile`` runs this checkout's rounds in this process under cProfile instead and prints where
the Python time goes (own time per function; the pushes' payloads sit at an odd byte offset, as
gRPC leaves them), for the per-push costs that sampling profilers blur.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


async def child(nodes: int, mb: float, threads: int, profile_rounds: int = 0) -> None:
    """Sum one round per line read on stdin; print its CPU (process, event loop thread) in ms.
    With ``profile_rounds``: run that many rounds (after two warm-ups) under cProfile instead."""
    import cProfile
    import inspect
    import pstats
    import time
    from concurrent.futures import ThreadPoolExecutor

    import torch

    import cgx_ps
    from cgx_ps.kernels import quantize
    from cgx_ps.server.rounds.aggregator import Aggregator
    from cgx_ps.worker.pipeline.blocks import Compression, TensorInfo, build_layout

    layout = build_layout([TensorInfo("grad", (int(mb * 1e6 / 4),))], 1, Compression(bits=4, compress_1d=True),
                          block_bytes=4 << 20)
    gen = torch.Generator().manual_seed(0)
    payloads = {b.block_id: [quantize(torch.randn(b.numel, generator=gen), 4, 1024, stochastic=True).to_bytes()
                             for _ in range(nodes)] for b in layout.blocks}
    if profile_rounds:  # where a received push sits: a view into gRPC's message, at an odd offset
        payloads = {k: [memoryview(b"\0" * 13 + p)[13:] for p in v] for k, v in payloads.items()}

    class Sink:
        def deliver(self, *args) -> None:
            pass

        def round_failed(self, failure) -> None:
            raise SystemExit(failure.message)

    extra = {}
    if "kernel_split" in inspect.signature(Aggregator).parameters:  # as session.py passes it
        from cgx_ps.server.rounds.kernel_threads import per_call_threads
        extra["kernel_split"] = per_call_threads(0, threads)
    loop = asyncio.get_running_loop()
    print(cgx_ps.__file__, flush=True)
    with ThreadPoolExecutor(threads, thread_name_prefix="cgx-shard") as executor:
        agg = Aggregator(list(layout.blocks), nodes, executor, Sink(), {f"n{i}" for i in range(nodes)}, 60.0, **extra)

        async def node(i: int, r: int) -> None:  # one stream: a node's blocks one after another
            for b in layout.blocks:
                await agg.push(f"n{i}", 0, b.block_id, r, payloads[b.block_id][i])

        if profile_rounds:
            for r in range(2):
                await asyncio.gather(*[node(i, r) for i in range(nodes)])
            profiler = cProfile.Profile()
            profiler.enable()
            for r in range(2, 2 + profile_rounds):
                await asyncio.gather(*[node(i, r) for i in range(nodes)])
            profiler.disable()
            agg.close()
            print(f"{profile_rounds} rounds; the event loop thread's Python (and what it calls), by own time:")
            pstats.Stats(profiler).sort_stats("tottime").print_stats(20)
            return
        r = 0
        while await loop.run_in_executor(None, sys.stdin.readline):
            cpu, main = time.process_time(), time.thread_time()
            await asyncio.gather(*[node(i, r) for i in range(nodes)])
            r += 1
            print(f"{(time.process_time() - cpu) * 1e3:.2f} {(time.thread_time() - main) * 1e3:.2f}", flush=True)
        agg.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trees", nargs="*", default=[], help="directories holding a cgx_ps package to compare")
    parser.add_argument("--rounds", type=int, default=30, help="timed rounds per tree (after two warm-ups)")
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--mb", type=float, default=100.0, help="fp32 megabytes of gradient per node per round")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="executor threads")
    parser.add_argument("--profile", action="store_true", help="profile this checkout's rounds (cProfile) instead")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.profile:
        asyncio.run(child(args.nodes, args.mb, args.threads, profile_rounds=args.rounds))
        return
    if args.child:
        asyncio.run(child(args.nodes, args.mb, args.threads))
        return
    # the parent alone imports from this checkout's benchmarks/ (appended: a child must import its tree's cgx_ps)
    sys.path.append(str(HERE))
    from benchmarks.trees import TreeChildren, paired_ratio

    trees = [Path(t).resolve() for t in args.trees] + [HERE]
    cpu: list[list[float]] = [[] for _ in trees]
    loop_ms: list[list[float]] = [[] for _ in trees]
    load = os.getloadavg()[0]
    with TreeChildren(trees, [__file__, "--child", "--nodes", str(args.nodes), "--mb", str(args.mb),
                              "--threads", str(args.threads)]) as children:
        for counted, k, answer in children.rounds(args.rounds):
            total, main_thread = map(float, answer.split())
            if counted:
                cpu[k].append(total)
                loop_ms[k].append(main_thread)
    print(f"{args.nodes} nodes x {args.mb:g} MB, 4-bit, {args.threads} executor threads, {args.rounds} rounds "
          f"alternated; load average {load:.2f} before, {os.getloadavg()[0]:.2f} after")
    print("| code | CPU per round, median (min) | of which the event loop | × first, median of paired ratios |")
    print("|---|---:|---:|---:|")
    for k, tree in enumerate(trees):
        paired = paired_ratio(cpu[0], cpu[k])
        print(f"| {tree} | {statistics.median(cpu[k]):.1f} ms ({min(cpu[k]):.1f}) | "
              f"{statistics.median(loop_ms[k]):.1f} ms | {paired:.2f} |")


if __name__ == "__main__":
    main()
