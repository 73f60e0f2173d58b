"""What Python gRPC costs the shard: the same rounds over gRPC (A) and over a raw data plane (B).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/dataplane.py [--nodes 4] [--mb 100] [--rounds 20]
        [--runs 3] [--bits 4] [--tls] [--protocol] [--json PATH] [--profile DIR]

The workload of ``benchmarks/server.py --nodes 4 --mb 100``: N simulated nodes in this process
push every block of a 4-bit layout (24 blocks of 4 MiB fp32) each round and wait for the result.
Each run starts a shard process per path, with the same flags and the job token:

    A  ``cgx-ps server`` (LocalCluster), the nodes' ShardClients on gRPC: the shipped path;
    B  the same ShardServer (gRPC for Register) plus ``benchmarks/rawplane.py``'s listener, the
       nodes' ShardClients on CGX_PS_DATAPLANE=raw sending the same serialized Exchange messages
       over one plain TCP connection each, length-prefixed, received into buffers of their
       announced size;
    C, D  with ``--tls``: A and B over TLS (the raw plane through Python's ssl on memory BIOs);
    E     with ``--protocol``: B with the shard receiving through a BufferedProtocol.

In B the frames go into the service's own Exchange handler, so the shard does the same work on
them as in A (PushAssembler's size, budget and deadline checks, the aggregator's header, crc and
meta checks, the fused kernel, the result encode, the NodeStream writer); only the bytes' way in
and out differs; the stream goes through the shipped gate and stream context. What B's listener
leaves out compared with the shipped one (E's: its cap, frame timeout, keepalive) is listed in
rawplane.py's docstring; the token is checked once per connection there, per call in A.

Rounds alternate between the paths (the order rotated every round), so load on the shared
machine drifts on all alike. Per run and per path: the shard's CPU per timed round (from /proc, from the first
timed round to 0.5 s after the last, split by thread as benchmarks/procstat.py groups them),
compressed input per shard CPU-second, and the nodes' CPU per round (this process:
``process_time``, of which the event loop's thread ``thread_time``; the rest is gRPC's threads
and the kernel-free remainder). The first round of each path warms up and is not counted. Each
run's results are compared block by block between A and B (same pushes, same rounds: the sums
must agree; the stochastic rounding is seeded by block and round).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import statistics
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

if __name__ == "__main__" and not __package__:  # `python benchmarks/dataplane.py`: import the package
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.loopprofile import main as loop_profile  # noqa: E402
from benchmarks.argtypes import at_least, bits, fp32_megabytes  # noqa: E402
from benchmarks.procstat import (CPU_RESOLUTION_S, cpu_ratio, figure, per_cpu, thread_cpu_seconds,  # noqa: E402
                                 thread_cpu_snapshot)
from benchmarks.rawplane import IO_ENV, raw_plane_client  # noqa: E402
from benchmarks.server import make_credentials, shard_cpu_seconds, shard_workload  # noqa: E402
from cgx_ps.net.security import ChannelSecurity  # noqa: E402
from cgx_ps.server import LocalCluster  # noqa: E402
from cgx_ps.server.cluster import launch_shard  # noqa: E402
from cgx_ps.worker.shards.client import ShardClient  # noqa: E402

NAMES = {"A": "gRPC (cgx-ps server)", "B": "raw TCP data plane", "C": "gRPC over TLS", "D": "raw data plane, TLS",
         "E": "raw plane, BufferedProtocol"}


@dataclass(frozen=True)
class Target:
    """One path: its shard process and how a node reaches it."""

    address: str
    pid: int
    security: ChannelSecurity
    raw_port: int | None = None  # the raw data plane's port; None: Exchange over gRPC

    def client(self, node: int, nodes: int, layout) -> ShardClient:
        if self.raw_port is None:
            return ShardClient(self.address, f"node-{node}", nodes, layout, security=self.security)
        return raw_plane_client(self.address, f"node-{node}", nodes, layout, self.security, self.raw_port)


def loop_system_seconds(pid: int) -> float:
    """System (kernel) CPU seconds of a process's main thread, the event loop: the socket copies
    and allocations' page faults show there, not in a Python profile."""
    fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[12]) / os.sysconf("SC_CLK_TCK")  # proc(5) field 15, stime


def start_profiler(pid: int, out: Path) -> subprocess.Popen:
    """py-spy sampling ``pid``'s threads (native frames too) until it is interrupted."""
    spy = Path(sys.executable).with_name("py-spy")
    return subprocess.Popen([str(spy), "record", "--pid", str(pid), "--threads", "--native", "-r", "100",
                             "--format", "raw", "-o", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


class RawPlaneCluster(LocalCluster):
    """LocalCluster whose shards are ``python -m benchmarks.rawplane server ...``: the same shard
    plus the raw listener, its port in the port file as ``raw_port``; ``io``: the listener's
    receive path (rawplane.serve_raw)."""

    def __init__(self, *args, io: str = "sock", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.io = io

    def _spawn(self, i: int, port: int, metrics_port: int, data_port: int, health_port: int):
        port_file = Path(self._tmp.name) / f"shard{i}.json"
        port_file.unlink(missing_ok=True)
        flags = ["--host", self.host, "--port", str(port), "--shard-index", str(i), "--num-shards",
                 str(self.shards), "--metrics-port", str(metrics_port), "--data-port", str(data_port),
                 "--health-port", str(health_port), "--token-file", self.token_file or "", *self.extra_args]

        def spawn(argv: list[str], **kwargs) -> subprocess.Popen:
            assert argv[1:4] == ["-m", "cgx_ps.cli", "server"], argv  # launch_shard's command line
            return subprocess.Popen([argv[0], "-m", "benchmarks.rawplane", *argv[3:]],
                                    env={**os.environ, IO_ENV: self.io}, **kwargs)

        return launch_shard(flags, port_file, spawn=spawn), port_file

    def raw_port(self, i: int = 0) -> int:
        return json.loads((Path(self._tmp.name) / f"shard{i}.json").read_text())["raw_port"]


@dataclass
class PathRun:
    """One path's figures in one run (seconds are totals over the timed rounds)."""

    wall: list[float] = field(default_factory=list)  # per timed round
    shard_cpu: float = 0.0
    shard_threads: dict[str, float] = field(default_factory=dict)
    shard_loop_system: float = 0.0  # the event loop's system (kernel) part
    client_cpu: float = 0.0  # this process (the N nodes)
    client_loop: float = 0.0  # of which the event loop's thread


async def _round(clients: list[ShardClient], layout, payloads: dict[int, bytes], r: int) -> list[list]:
    return await asyncio.gather(*[asyncio.gather(*[c.exchange(b.block_id, r, payloads[b.block_id])
                                                   for b in layout.blocks]) for c in clients])


async def one_run(targets: dict[str, Target], nodes: int, layout, payloads: dict[int, bytes], rounds: int,
                  profile: Path | None = None) -> tuple[dict[str, PathRun], int]:
    """Interleaved rounds on every path; (figures per path, rounds whose results differed)."""
    paths = list(targets)
    clients = {p: [t.client(i, nodes, layout) for i in range(nodes)] for p, t in targets.items()}
    pids = {p: t.pid for p, t in targets.items()}
    out = {p: PathRun() for p in paths}
    start_cpu: dict[str, float] = {}
    start_threads: dict[str, dict[str, float]] = {}
    start_system: dict[str, float] = {}
    profilers: list[subprocess.Popen] = []
    differing = 0
    try:
        for group in clients.values():
            for c in group:
                await c.connect()
        for r in range(rounds + 1):
            results = {}
            # round r of each path in turn, the order rotated every round: no path always runs
            # right after the same other one
            for path in paths[r % len(paths):] + paths[:r % len(paths)]:
                if r == 1:  # from the first timed round on, as benchmarks/server.py counts
                    start_cpu[path] = shard_cpu_seconds(pids[path])
                    start_threads[path] = thread_cpu_snapshot(pids[path])
                    start_system[path] = loop_system_seconds(pids[path])
                    if profile is not None:
                        profilers.append(start_profiler(pids[path], profile / f"{path}.txt"))
                cpu0, loop0, t0 = time.process_time(), time.thread_time(), time.perf_counter()
                results[path] = await _round(clients[path], layout, payloads, r)
                t, cpu, loop_cpu = time.perf_counter() - t0, time.process_time() - cpu0, time.thread_time() - loop0
                if r:
                    m = out[path]
                    m.wall.append(t)
                    m.client_cpu += cpu
                    m.client_loop += loop_cpu
            # every node of every path gets the same sums: the shards summed the same pushes
            sums = [[bytes(x) for x in node] for p in paths for node in results[p]]
            differing += any(node != sums[0] for node in sums)
        await asyncio.sleep(0.5)
        for path in paths:
            out[path].shard_cpu = shard_cpu_seconds(pids[path]) - start_cpu[path]
            out[path].shard_threads = thread_cpu_seconds(pids[path], since=start_threads[path])
            out[path].shard_loop_system = loop_system_seconds(pids[path]) - start_system[path]
    finally:
        for spy in profilers:
            spy.send_signal(signal.SIGINT)  # py-spy writes what it sampled and exits
            spy.wait(timeout=60)
        for group in clients.values():
            for c in group:
                await c.close()
    return out, differing


def median_of_measured(values: list[float | None]) -> float | None:
    """The median over the runs; None if a run's figure was not measured (a median of the
    others would be a different statistic under the same name)."""
    return None if None in values else statistics.median(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=at_least(1), default=4)
    parser.add_argument("--mb", type=fp32_megabytes, default=100.0, help="fp32 megabytes of gradient per node per round")
    parser.add_argument("--rounds", type=at_least(1), default=20, help="timed rounds per path and run (after one warm-up)")
    parser.add_argument("--runs", type=at_least(1), default=3, help="runs, each with fresh shard processes")
    parser.add_argument("--bits", type=bits, default=4)
    parser.add_argument("--block-mb", type=fp32_megabytes, default=4.0, help="fp32 MB per block")
    parser.add_argument("--tls", action="store_true", help="also C: gRPC over TLS, and D: the raw plane over "
                        "TLS (Python ssl), certificates from a throwaway CA (trustme)")
    parser.add_argument("--protocol", action="store_true", help="also E: the raw plane's shard receiving "
                        "through a BufferedProtocol instead of sock_recv_into (the nodes' side unchanged)")
    parser.add_argument("--json", metavar="PATH", help="also write every run's figures here")
    parser.add_argument("--profile", metavar="DIR", help="py-spy both shards over the timed rounds (raw samples "
                        "in DIR/A.txt and DIR/B.txt, the last run's; slows the shards: not for the figures)")
    args = parser.parse_args()
    if args.profile:  # py-spy does not create it, and writes nothing where it cannot
        Path(args.profile).mkdir(parents=True, exist_ok=True)

    _, layout, payloads = shard_workload(args.mb, args.bits, args.block_mb)
    wire = sum(len(p) for p in payloads.values())
    per_round_in = args.nodes * wire  # compressed bytes into the shard per round

    def mb_per_cpu_s(cpu_s: float) -> float | None:
        return per_cpu(per_round_in * args.rounds / 1e6, cpu_s)

    runs: list[dict[str, PathRun]] = []
    loads = [os.getloadavg()]
    # One event loop for every run, not an asyncio.run each: grpc.aio's completion queue outlives
    # a loop, and a closed channel's cancelled calls report their end to it after close() has
    # returned. Whatever came in after a run's loop had closed was then handed to that closed loop
    # from the next run's ("RuntimeError: Event loop is closed", a traceback now and then).
    with tempfile.TemporaryDirectory(prefix="cgx-ps-bench-dataplane-") as tmp, asyncio.Runner() as loop:
        creds = make_credentials(tmp)  # the token file, and TLS files for --tls
        flags = ["--log-level", "WARNING"]
        tls_flags = [*flags, "--tls-cert", creds.server_cert, "--tls-key", creds.server_key]
        plain = ChannelSecurity(token_file=creds.token)
        tls = ChannelSecurity(token_file=creds.token, tls_ca=creds.ca)
        raw = functools.partial(RawPlaneCluster, io="sock")
        shards = {"A": (LocalCluster, flags, plain), "B": (raw, flags, plain)}
        if args.tls:
            shards |= {"C": (LocalCluster, tls_flags, tls), "D": (raw, tls_flags, tls)}
        if args.protocol:
            shards["E"] = (functools.partial(RawPlaneCluster, io="protocol"), flags, plain)
        for run in range(args.runs):
            with contextlib.ExitStack() as stack:
                targets = {}
                for path, (kind, extra, security) in shards.items():
                    cluster = stack.enter_context(kind(1, extra_args=extra, token_file=creds.token))
                    targets[path] = Target(cluster.addresses[0], cluster.procs[0].pid, security,
                                           cluster.raw_port() if isinstance(cluster, RawPlaneCluster) else None)
                measured, differing = loop.run(one_run(targets, args.nodes, layout, payloads, args.rounds,
                                                       Path(args.profile) if args.profile else None))
            if differing:
                raise SystemExit(f"run {run}: {differing} rounds' results differ between gRPC and the raw plane")
            runs.append(measured)
            loads.append(os.getloadavg())
            line = "; ".join(f"{p}: shard {m.shard_cpu / args.rounds * 1e3:.0f} ms/round, "
                             f"{figure(mb_per_cpu_s(m.shard_cpu), '.0f', ' MB/s')} per CPU-s"
                             for p, m in measured.items())
            print(f"run {run + 1}/{args.runs}: {line}", flush=True)

    paths = list(runs[0])
    print(f"\n{args.nodes} nodes x {args.mb:g} MB fp32 ({len(layout.blocks)} blocks, {args.bits}-bit: "
          f"{wire / 1e6:.1f} MB per node per round, {per_round_in / 1e6:.1f} MB into the shard), "
          f"{args.rounds} timed rounds per path per run, {args.runs} runs, paths interleaved; results identical "
          f"on every path in every round; load average (1 min) {', '.join(f'{x[0]:.2f}' for x in loads)} "
          f"({os.cpu_count()} CPUs)")
    groups = list(runs[0]["A"].shard_threads)
    print(f"| path | run | shard CPU per round | {' | '.join(groups)} | input per shard CPU-second | round (wall, "
          f"median) | nodes' CPU per round | of which their event loop |")
    print("|---|---|---:|" + "---:|" * len(groups) + "---:|---:|---:|---:|---:|")

    def row(path: str, label: str, ms: list[float | None]) -> str:
        return f"| {path}: {NAMES[path]} | {label} | " + " | ".join(
            figure(x, ".0f", " ms" if i != len(groups) + 2 else " MB/s") for i, x in enumerate(ms)) + " |"

    def figures(m: PathRun) -> list[float | None]:
        n = args.rounds
        return ([m.shard_cpu / n * 1e3] + [m.shard_threads[g] / n * 1e3 for g in groups]
                + [m.shard_loop_system / n * 1e3, mb_per_cpu_s(m.shard_cpu), statistics.median(m.wall) * 1e3, m.client_cpu / n * 1e3,
                   m.client_loop / n * 1e3])

    for path in paths:
        per_run = [figures(r[path]) for r in runs]
        for i, f in enumerate(per_run):
            print(row(path, str(i + 1), f))
        print(row(path, "median", [median_of_measured(col) for col in zip(*per_run)]))
    for new, old in (("B", "A"), ("D", "C"), ("C", "A"), ("D", "B"), ("E", "B"), ("E", "A")):
        if new not in paths:
            continue
        ratio = [cpu_ratio(r[old].shard_cpu, r[new].shard_cpu) for r in runs]
        client_ratio = [r[old].client_cpu / r[new].client_cpu for r in runs]
        print(f"{new} / {old}, input per shard CPU-second: {', '.join(figure(x, '.2f') for x in ratio)} (median "
              f"{figure(median_of_measured(ratio), '.2f')}); nodes' CPU per round {old} / {new}: "
              f"{', '.join(f'{x:.2f}' for x in client_ratio)} (median {statistics.median(client_ratio):.2f})")
    if any(r[p].shard_cpu < CPU_RESOLUTION_S for r in runs for p in paths):
        print(f"n/a: a shard's CPU over a run's timed rounds was under /proc's resolution "
              f"({CPU_RESOLUTION_S * 1e3:.0f} ms): more --rounds or --mb give figures")
    if args.profile:  # the last run's
        loop_profile([str(Path(args.profile) / f"{p}.txt") for p in paths])
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "loads": loads, "runs": [
            {p: asdict(m) for p, m in r.items()} for r in runs]}, indent=1))


if __name__ == "__main__":
    main()
