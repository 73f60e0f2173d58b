"""What a shard still holds for streams that pushed a block and then wait: after the round that
summed their pushes is over, nothing of those pushes should stay (service.py, ``_read_push``).

    .venv/bin/python benchmarks/idle_streams.py [--trees DIR ...] [--nodes 8] [--block-mb 4] [--repeats 3]

For each code tree (a directory holding a ``cgx_ps`` package, say ``git archive <commit> | tar -x
-C DIR``; this checkout is always the last), in turn, ``--repeats`` times: start a shard process
from that tree, let ``--nodes`` nodes each push one fp32 block of ``--block-mb`` MiB (as a warm-up
step or an auto-mode step through the shards sends it: several 1 MiB chunks, reassembled) and take
the result, then leave their streams open and idle, and read the shard's RssAnon (heap and
buffers, /proc) before the round and once it has settled after it. glibc is told to map every
buffer of 128 KiB or more on its own and to give it back when freed (``MALLOC_MMAP_THRESHOLD_``),
so what stays resident is what the shard still references. The fp32 accumulator a round leaves
(one block) is the same in every tree; the rest of the difference is what the idle streams hold.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

if __name__ == "__main__" and not __package__:  # `python benchmarks/idle_streams.py`: import the package
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.memshard import ROOT, MiB, run, settle  # noqa: E402
from cgx_ps.kernels import Codec, encode  # noqa: E402
from cgx_ps.net.security import ChannelSecurity, new_token_file  # noqa: E402
from cgx_ps.server.cluster import STARTUP_TIMEOUT_S, launch_shard, wait_for_port_file  # noqa: E402
from cgx_ps.worker.shards.client import ShardClient  # noqa: E402
from cgx_ps.worker.pipeline.blocks import Compression, TensorInfo, build_layout  # noqa: E402


async def push_and_idle(address: str, security: ChannelSecurity, nodes: int, block_mb: float) -> list[ShardClient]:
    """Every node pushes one fp32 block and takes the result; the streams stay open (the caller
    measures, then ``close`` ends them)."""
    numel = int(block_mb * MiB) // 4
    layout = build_layout([TensorInfo("w", (numel,))], 1, Compression(bits=None, compress_1d=True),
                          block_bytes=4 * numel)
    payload = encode(torch.randn(numel), Codec.FP32).to_bytes()
    clients = [ShardClient(address, f"node-{i}", nodes, layout, security=security) for i in range(nodes)]
    try:
        for c in clients:
            await c.connect()
        await asyncio.gather(*[c.exchange(0, 0, payload) for c in clients])
    except BaseException:
        await asyncio.gather(*[c.close() for c in clients])
        raise
    return clients


def measure(tree: Path, tmp: str, token: str, nodes: int, block_mb: float) -> float:
    """MiB of RssAnon the shard of ``tree`` gained over the round, its streams idle."""
    port_file = Path(tmp) / f"port-{time.monotonic_ns()}.json"
    flags = ["--host", "127.0.0.1", "--port", "0", "--metrics-port", "-1", "--token-file", token,
             "--kernel-threads", "1", "--log-level", "ERROR", "--max-inflight-mb", str(int(4 * nodes * block_mb))]
    # CGX_PS_DATA_PORT=-1: gRPC streams in every tree (the data plane is a shard's default now;
    # a variable, which trees older than it ignore, rather than a flag they would refuse)
    env = {**os.environ, "PYTHONPATH": str(tree), "MALLOC_MMAP_THRESHOLD_": str(128 << 10), "CGX_PS_DATA_PORT": "-1"}
    proc = launch_shard(flags, port_file, cwd=tree, env=env)
    clients: list[ShardClient] = []
    try:
        address = f"127.0.0.1:{wait_for_port_file(proc, port_file, time.monotonic() + STARTUP_TIMEOUT_S)['port']}"
        before = settle(proc.pid)["RssAnon"]
        clients = run(push_and_idle(address, ChannelSecurity(token_file=token), nodes, block_mb))
        after = settle(proc.pid)["RssAnon"]
        return after - before
    finally:
        run(asyncio.gather(*[c.close() for c in clients]))  # their channels, on the loop they use
        proc.terminate()
        proc.wait(timeout=30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trees", nargs="*", default=[], help="other code trees, measured beside this checkout")
    p.add_argument("--nodes", type=int, default=8)
    p.add_argument("--block-mb", type=float, default=4.0)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    trees = [Path(t).resolve() for t in args.trees] + [ROOT]
    gained: dict[Path, list[float]] = {t: [] for t in trees}
    with tempfile.TemporaryDirectory() as tmp:
        token = new_token_file(tmp)
        for r in range(args.repeats):
            for tree in trees[r % len(trees):] + trees[:r % len(trees)]:  # the order rotated every repeat
                gained[tree].append(measure(tree, tmp, token, args.nodes, args.block_mb))
                print(f"repeat {r}: {tree}: +{gained[tree][-1]:.1f} MiB", file=sys.stderr)
    print(f"{args.nodes} nodes, one fp32 block of {args.block_mb:g} MiB each, streams idle after the round: "
          f"the shard's RssAnon gained (MiB, median of {args.repeats}; each run)")
    for tree in trees:
        print(f"  {tree}: {statistics.median(gained[tree]):.1f}  {[round(x, 1) for x in gained[tree]]}")


if __name__ == "__main__":
    main()
