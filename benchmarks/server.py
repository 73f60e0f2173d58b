"""One shard on loopback, N simulated nodes pushing 4-bit gradients; a raw TCP copy as the peer.

    .venv/bin/python benchmarks/server.py [--nodes 4] [--mb 100] [--rounds 5] [--bits 4]

The shard runs as its own process (``cgx-ps server``), the nodes as asyncio clients in this
process with payloads encoded up front, so the figure is the shard's: receive, validate,
dequantize-accumulate, re-quantize, send to every node. The peer is a plain TCP socket moving the
same compressed bytes between two processes on loopback, measured in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import socket
import statistics
import time

import torch

from cgx_ps.kernels import quantize
from cgx_ps.security import ChannelSecurity
from cgx_ps.server import LocalCluster
from cgx_ps.worker.client import ShardClient
from cgx_ps.worker.layout import Compression, TensorInfo, build_layout


def _sink(port_queue: mp.Queue, total: int) -> None:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port_queue.put(srv.getsockname()[1])
    conn, _ = srv.accept()
    buf = bytearray(1 << 20)
    got = 0
    while got < total:
        n = conn.recv_into(buf)
        if not n:
            break
        got += n
    conn.sendall(b"k")
    conn.close()


def tcp_copy_seconds(payload: bytes, copies: int) -> float:
    """Send `copies` x payload over a loopback TCP socket to another process; return seconds."""
    q: mp.Queue = mp.Queue()
    proc = mp.Process(target=_sink, args=(q, len(payload) * copies))
    proc.start()
    sock = socket.create_connection(("127.0.0.1", q.get()))
    t0 = time.perf_counter()
    for _ in range(copies):
        sock.sendall(payload)
    sock.recv(1)
    elapsed = time.perf_counter() - t0
    sock.close()
    proc.join()
    return elapsed


async def run_rounds(address: str, nodes: int, layout, payloads: dict[int, bytes], rounds: int,
                     security: ChannelSecurity) -> list[float]:
    clients = [ShardClient(address, f"node-{i}", nodes, layout, security=security) for i in range(nodes)]
    for c in clients:
        await c.connect()
    times = []
    try:
        for r in range(rounds + 1):  # round 0 warms up (JIT, allocations)
            t0 = time.perf_counter()
            await asyncio.gather(*[c.exchange(b.block_id, r, payloads[b.block_id])
                                   for c in clients for b in layout.blocks])
            if r:
                times.append(time.perf_counter() - t0)
    finally:
        for c in clients:
            await c.close()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--mb", type=float, default=100.0, help="fp32 megabytes of gradient per node per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--block-mb", type=float, default=4.0, help="fp32 MB per block")
    args = parser.parse_args()

    numel = int(args.mb * 1e6 / 4)
    layout = build_layout([TensorInfo("grad", (numel,))], 1, Compression(bits=args.bits, compress_1d=True),
                          block_bytes=int(args.block_mb * (1 << 20)))
    gen = torch.Generator().manual_seed(0)
    payloads = {b.block_id: quantize(torch.randn(b.numel, generator=gen), args.bits, 1024, stochastic=True).to_bytes()
                for b in layout.blocks}
    wire_bytes = sum(len(p) for p in payloads.values())

    with LocalCluster(1) as cluster:
        security = ChannelSecurity(token_file=cluster.token_file)  # the shard requires the job token
        times = asyncio.run(run_rounds(cluster.addresses[0], args.nodes, layout, payloads, args.rounds, security))
    t = statistics.median(times)
    compressed_in = args.nodes * wire_bytes / t / 1e6
    summed = args.nodes * numel * 4 / t / 1e6
    tcp_s = tcp_copy_seconds(b"".join(payloads.values()), args.nodes * 3) / 3
    tcp_mb_s = args.nodes * wire_bytes / tcp_s / 1e6

    print(f"{args.nodes} nodes x {args.mb:g} MB fp32 gradient ({len(layout.blocks)} blocks, {args.bits}-bit: "
          f"{wire_bytes / 1e6:.1f} MB on the wire per node), median of {args.rounds} rounds")
    print("| measure | value |")
    print("|---|---|")
    print(f"| round time (all nodes push, shard sums, all nodes pull) | {t * 1e3:.0f} ms |")
    print(f"| compressed input into the shard | {compressed_in:.0f} MB/s |")
    print(f"| aggregated gradient (fp32 MB summed per second) | {summed:.0f} MB/s |")
    print(f"| peer: raw TCP copy of the same compressed bytes, loopback | {tcp_mb_s:.0f} MB/s |")
    print(f"| shard input / raw TCP | {compressed_in / tcp_mb_s:.2f} |")
    print(f"| 1 Gbit/s link (125 MB/s) covered | {compressed_in / 125:.1f}x |")


if __name__ == "__main__":
    main()
