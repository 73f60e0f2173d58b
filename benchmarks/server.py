"""One shard on loopback, N simulated nodes pushing 4-bit gradients, in plaintext, with the job
token, over TLS and over mutual TLS; raw TCP (and TLS) copies as the peers.

    .venv/bin/python benchmarks/server.py [--nodes 4] [--mb 100] [--rounds 5] [--bits 4]
                                          [--configs plain,token,tls,mtls] [--sequential]
                                          [--baseline DIR]

Each configuration gets its own shard process (``cgx-ps server``), started together; the nodes are
asyncio clients in this process with payloads encoded up front, so the figure is the shard's:
receive (and decrypt), check the token, validate, dequantize-accumulate, re-quantize, send (and
encrypt) to every node. Rounds are interleaved across the configurations (round r of each in
turn, the order rotated every round), so a machine whose speed drifts during the run slows them
all alike; ``--sequential`` runs each configuration's rounds back to back instead. Besides wall
time, each shard's CPU time (/proc) over its timed rounds is reported: on a shared machine the
ratio of CPU per round is the steadier estimate of what TLS costs a shard with a core of its own.
The peers are a plain TCP socket and a Python ``ssl`` socket moving the same compressed bytes
between two processes on loopback, in the same run.

``--baseline DIR`` adds one more plaintext shard whose code is the ``cgx_ps`` package under DIR
(say, ``git archive <commit> cgx_ps | tar -x -C DIR``), listed first and interleaved with the
others: before/after figures of a change from the same run, on the same load. That shard starts
in DIR (``shard_source``), and which package it imports is checked first.

The shard's capacity is also given per CPU-second (compressed input / the shard's CPU time):
what one shard process would take in with a core of its own, which on this 2-core machine,
shared with the nodes' process and with other work, the wall time cannot show.

Certificates come from a throwaway CA (``trustme``) written to a temporary directory that is
removed at exit: no key material is ever written into the repository.

    plain  no token, no TLS
    token  the job token on every call (authorization: Bearer ...)
    tls    token + TLS (the shard's certificate checked against the CA)
    mtls   token + mutual TLS (the shard also requires a client certificate signed by the CA)
    raw    plaintext, no token, the Exchange streams over the shard's raw data plane
           (``--data-port``, the nodes' ShardClient with CGX_PS_DATAPLANE=raw): compare with plain
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing as mp
import os
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

if __name__ == "__main__" and not __package__:  # `python benchmarks/server.py`: import the package
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.argtypes import at_least, bits, fp32_megabytes  # noqa: E402
from benchmarks.procstat import (CPU_RESOLUTION_S, cpu_ratio, figure, per_cpu, proc_cpu_seconds, proc_minor_faults,  # noqa: E402
                                 resident_mb, thread_cpu_seconds, thread_cpu_snapshot)
from cgx_ps.kernels import quantize  # noqa: E402
from cgx_ps.net.security import ChannelSecurity, new_token_file  # noqa: E402
from cgx_ps.server import LocalCluster  # noqa: E402
from cgx_ps.worker.shards.client import ShardClient  # noqa: E402
from cgx_ps.worker.pipeline.blocks import Compression, TensorInfo, build_layout  # noqa: E402
from cgx_ps.v1 import ps_pb2  # noqa: E402

CONFIG_ORDER = ("plain", "token", "tls", "mtls", "raw")
DESCRIPTIONS = {"baseline": "plaintext, the --baseline code", "plain": "plaintext, no token", "token": "token only", "tls": "TLS + token",
                "mtls": "mutual TLS + token", "raw": "plaintext, no token, raw data plane"}
DATAPLANE = {"raw": "raw"}  # the nodes' CGX_PS_DATAPLANE per configuration; the others: grpc
TLS_TARGET = 0.8  # issue: TLS must keep >= 0.8x of plaintext throughput


# ---- credentials (temporary directory only) -------------------------------------------------------

@dataclass(frozen=True)
class Credentials:
    token: str
    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str


def shard_workload(mb: float, bits: int, block_mb: float) -> tuple[int, ps_pb2.Layout, dict[int, bytes]]:
    """One node's gradient of ``mb`` MB fp32 as the shard benchmarks push it: (elements, the
    layout, each block's payload encoded once up front at ``bits``, seeded: the same in every run)."""
    numel = int(mb * 1e6 / 4)
    layout = build_layout([TensorInfo("grad", (numel,))], 1, Compression(bits=bits, compress_1d=True),
                          block_bytes=int(block_mb * (1 << 20)))
    gen = torch.Generator().manual_seed(0)
    payloads = {b.block_id: quantize(torch.randn(b.numel, generator=gen), bits, 1024, stochastic=True).to_bytes()
                for b in layout.blocks}
    return numel, layout, payloads


def make_credentials(directory: str) -> Credentials:
    import trustme  # a dev dependency: only this benchmark and the tests need it

    d = Path(directory)
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("worker.cgx-ps.invalid")
    ca.cert_pem.write_to_path(str(d / "ca.pem"))
    for name, leaf in (("server", server), ("client", client)):
        (d / f"{name}.pem").write_bytes(b"".join(pem.bytes() for pem in leaf.cert_chain_pems))
        leaf.private_key_pem.write_to_path(str(d / f"{name}.key"))
        os.chmod(d / f"{name}.key", 0o600)
    return Credentials(token=new_token_file(d), ca=str(d / "ca.pem"), server_cert=str(d / "server.pem"),
                       server_key=str(d / "server.key"), client_cert=str(d / "client.pem"),
                       client_key=str(d / "client.key"))


def shard_setup(config: str, creds: Credentials) -> tuple[str, list[str], ChannelSecurity]:
    """(token file for the shard, extra shard args, the clients' security) of a configuration."""
    tls_args = ["--tls-cert", creds.server_cert, "--tls-key", creds.server_key]
    if config == "plain":
        return "", [], ChannelSecurity()
    if config == "baseline":  # on gRPC, as "plain": a baseline from before gRPC became the default would take its raw plane
        return "", ["--data-port", "-1"], ChannelSecurity()
    if config == "raw":
        return "", ["--data-port", "0"], ChannelSecurity()
    if config == "token":
        return creds.token, [], ChannelSecurity(token_file=creds.token)
    if config == "tls":
        return creds.token, tls_args, ChannelSecurity(token_file=creds.token, tls_ca=creds.ca)
    if config == "mtls":
        return creds.token, tls_args + ["--tls-client-ca", creds.ca], ChannelSecurity(
            token_file=creds.token, tls_ca=creds.ca, tls_cert=creds.client_cert, tls_key=creds.client_key)
    raise ValueError(f"unknown configuration {config!r}; choose from {', '.join(CONFIG_ORDER)}")


# ---- peers: raw TCP and TLS copies ------------------------------------------------------------------

def _sink(port_queue: mp.Queue, total: int, cert: str | None, key: str | None) -> None:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port_queue.put(srv.getsockname()[1])
    conn, _ = srv.accept()
    if cert:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(cert, key)
        conn = ctx.wrap_socket(conn, server_side=True)
    buf = bytearray(1 << 20)
    got = 0
    while got < total:
        n = conn.recv_into(buf)
        if not n:
            break
        got += n
    conn.sendall(b"k")
    conn.close()


def copy_seconds(payload: bytes, copies: int, creds: Credentials | None = None) -> float:
    """Send ``copies`` x payload over a loopback socket (TLS when ``creds``) to another process;
    return seconds (handshake excluded)."""
    q: mp.Queue = mp.Queue()
    proc = mp.Process(target=_sink, args=(q, len(payload) * copies, creds and creds.server_cert,
                                          creds and creds.server_key))
    proc.start()
    sock = socket.create_connection(("127.0.0.1", q.get()))
    if creds is not None:
        ctx = ssl.create_default_context(cafile=creds.ca)
        sock = ctx.wrap_socket(sock, server_hostname="localhost")
        sock.do_handshake()
    t0 = time.perf_counter()
    for _ in range(copies):
        sock.sendall(payload)
    sock.recv(1)
    elapsed = time.perf_counter() - t0
    sock.close()
    proc.join()
    return elapsed


# ---- the shard rounds -------------------------------------------------------------------------------

def shard_cpu_seconds(pid: int) -> float:
    seconds = proc_cpu_seconds(pid)
    if seconds is None:
        raise SystemExit(f"the shard (pid {pid}) is gone: see its log above")
    return seconds


@dataclass
class Measured:
    wall: list[float] = field(default_factory=list)  # seconds per timed round
    shard_cpu: float = 0.0  # CPU seconds the shard spent in the timed rounds, in total
    client_cpu: float = 0.0  # CPU seconds this process (the N nodes) spent in them
    threads: dict[str, float] = field(default_factory=dict)  # shard CPU seconds by thread group, in them
    rss_mb: float = 0.0  # the shard's resident memory after the rounds
    minflt: int = 0  # the shard's minor page faults in the timed rounds (fresh pages faulted in)


async def one_round(clients: list[ShardClient], layout, payloads: dict[int, bytes], r: int) -> float:
    t0 = time.perf_counter()
    await asyncio.gather(*[c.exchange(b.block_id, r, payloads[b.block_id]) for c in clients for b in layout.blocks])
    return time.perf_counter() - t0


async def run_rounds(targets: dict[str, tuple[str, int, ChannelSecurity]], nodes: int, layout,
                     payloads: dict[int, bytes], rounds: int, interleave: bool) -> dict[str, Measured]:
    """Round times and CPU per configuration; round 0 of each warms up (JIT, allocations, handshakes)."""
    clients = {name: [ShardClient(address, f"node-{i}", nodes, layout, security=security,
                                  dataplane=DATAPLANE.get(name, "grpc")) for i in range(nodes)]
               for name, (address, _, security) in targets.items()}
    out = {name: Measured() for name in targets}
    try:
        for group in clients.values():
            for c in group:
                await c.connect()
        names = list(targets)
        if interleave:  # round r of each in turn, the order rotated by one every round: no
            # configuration always runs right after the same other one (or first after a pause)
            schedule = [(r, name) for r in range(rounds + 1)
                        for name in names[r % len(names):] + names[:r % len(names)]]
        else:
            schedule = [(r, name) for name in names for r in range(rounds + 1)]
        started: dict[str, float] = {}
        threads: dict[str, dict[str, float]] = {}
        faults: dict[str, int] = {}
        for r, name in schedule:
            pid = targets[name][1]
            if r == 1:  # the shard's CPU from its first timed round to the end: work it finishes
                started[name] = shard_cpu_seconds(pid)  # after a round ends is counted too
                threads[name] = thread_cpu_snapshot(pid)
                faults[name] = proc_minor_faults(pid) or 0
            client0 = time.process_time()
            t = await one_round(clients[name], layout, payloads, r)
            if r:
                out[name].wall.append(t)
                out[name].client_cpu += time.process_time() - client0
        await asyncio.sleep(0.5)
        for name, cpu0 in started.items():
            out[name].shard_cpu = shard_cpu_seconds(targets[name][1]) - cpu0
            out[name].threads = thread_cpu_seconds(targets[name][1], since=threads[name])
            out[name].rss_mb = resident_mb(targets[name][1])
            out[name].minflt = (proc_minor_faults(targets[name][1]) or 0) - faults[name]
    finally:
        for group in clients.values():
            for c in group:
                await c.close()
    return out


@contextlib.contextmanager
def shard_source(directory: str | None):
    """Shards started inside import cgx_ps from ``directory`` (None: as this process does).

    ``python -m`` puts its working directory first on sys.path, ahead of PYTHONPATH, so a shard
    started from a checkout's root imports that checkout's cgx_ps whatever PYTHONPATH says: the
    ``--baseline`` shard ran the current code until 2026-11-23. It is started in ``directory`` too,
    and the package it will import is checked."""
    if directory is None:
        yield
        return
    root = Path(directory).resolve()
    old, cwd = os.environ.get("PYTHONPATH"), os.getcwd()
    os.environ["PYTHONPATH"] = os.pathsep.join([str(root), *([old] if old else [])])
    os.chdir(root)
    try:
        found = subprocess.run([sys.executable, "-c", "import cgx_ps; print(cgx_ps.__file__)"], check=True,
                               capture_output=True, text=True).stdout.strip()
        if not Path(found).resolve().is_relative_to(root):
            raise SystemExit(f"--baseline: a shard would import {found}, not the cgx_ps under {root}")
        yield
    finally:
        os.chdir(cwd)
        if old is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = old


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=at_least(1), default=4)
    parser.add_argument("--mb", type=fp32_megabytes, default=100.0, help="fp32 megabytes of gradient per node per round")
    parser.add_argument("--rounds", type=at_least(1), default=5, help="timed rounds per configuration (after one warm-up)")
    parser.add_argument("--bits", type=bits, default=4)
    parser.add_argument("--block-mb", type=fp32_megabytes, default=4.0, help="fp32 MB per block")
    parser.add_argument("--configs", default=",".join(CONFIG_ORDER),
                        help=f"comma-separated subset of {','.join(CONFIG_ORDER)} (default: all, in that order)")
    parser.add_argument("--sequential", action="store_true",
                        help="run each configuration's rounds back to back instead of interleaving them")
    parser.add_argument("--baseline", metavar="DIR",
                        help="also run a plaintext shard from the cgx_ps package under DIR, listed first")
    args = parser.parse_args()
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIG_ORDER]
    if unknown or not configs or len(set(configs)) != len(configs):
        parser.error(f"--configs: choose distinct names from {', '.join(CONFIG_ORDER)}, got {args.configs!r}")
    if args.baseline:
        if not (Path(args.baseline) / "cgx_ps" / "server").is_dir():
            parser.error(f"--baseline: no cgx_ps package under {args.baseline}")
        configs.insert(0, "baseline")

    numel, layout, payloads = shard_workload(args.mb, args.bits, args.block_mb)
    wire_bytes = sum(len(p) for p in payloads.values())
    load_before = os.getloadavg()

    with tempfile.TemporaryDirectory(prefix="cgx-ps-bench-tls-") as tmp, contextlib.ExitStack() as stack:
        creds = make_credentials(tmp)
        targets = {}
        for name in configs:
            token_file, extra, security = shard_setup(name, creds)
            with shard_source(args.baseline if name == "baseline" else None):
                cluster = stack.enter_context(LocalCluster(1, extra_args=["--log-level", "WARNING", *extra],
                                                           token_file=token_file))
            targets[name] = (cluster.addresses[0], cluster.procs[0].pid, security)
        measured = asyncio.run(run_rounds(targets, args.nodes, layout, payloads, args.rounds,
                                       interleave=not args.sequential))
        stack.close()  # shards down before the peers run: they would share the two cores otherwise
        blob = b"".join(payloads.values())
        tcp_s = copy_seconds(blob, args.nodes * 3) / 3
        tls_s = copy_seconds(blob, args.nodes * 3, creds) / 3
    load_after = os.getloadavg()

    def mb_s(seconds: float) -> float:
        return args.nodes * wire_bytes / seconds / 1e6

    def input_per_cpu_s(cpu_s: float) -> float | None:  # MB/s of compressed input per shard CPU-second
        return per_cpu(args.nodes * wire_bytes * args.rounds / 1e6, cpu_s)

    base = configs[0]
    print(f"{args.nodes} nodes x {args.mb:g} MB fp32 gradient ({len(layout.blocks)} blocks, {args.bits}-bit: "
          f"{wire_bytes / 1e6:.1f} MB on the wire per node), {args.rounds} timed rounds per configuration, "
          f"{'sequential' if args.sequential else 'interleaved'}; load average "
          f"{load_before[0]:.2f} before, {load_after[0]:.2f} after ({os.cpu_count()} CPUs)")
    print(f"| configuration | round time (median) | compressed input into the shard, median (min–max) | "
          f"× {base}: ratio of medians; median of per-round ratios | shard CPU per round | × {base} by shard "
          f"CPU | input per shard CPU-second | nodes' CPU per round | fp32 summed |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    base_t = statistics.median(measured[base].wall)
    base_cpu = measured[base].shard_cpu
    for name in configs:
        m = measured[name]
        t = statistics.median(m.wall)
        rates = [mb_s(x) for x in m.wall]
        paired = statistics.median(b / x for b, x in zip(measured[base].wall, m.wall))
        mark = ""
        if name in ("tls", "mtls") and base == "plain":
            mark = " ✓" if base_t / t >= TLS_TARGET else f" ✗ (target ≥ {TLS_TARGET})"
        print(f"| {name}: {DESCRIPTIONS[name]} | {t * 1e3:.0f} ms | {mb_s(t):.0f} MB/s ({min(rates):.0f}–"
              f"{max(rates):.0f}) | {base_t / t:.2f}; {paired:.2f}{mark} | {m.shard_cpu / args.rounds * 1e3:.0f} ms | "
              f"{figure(cpu_ratio(base_cpu, m.shard_cpu), '.2f')} | "
              f"{figure(input_per_cpu_s(m.shard_cpu), '.0f', ' MB/s')} | "
              f"{m.client_cpu / args.rounds * 1e3:.0f} ms | "
              f"{args.nodes * numel * 4 / t / 1e6:.0f} MB/s |")
    print(f"| peer: raw TCP copy of the same compressed bytes, loopback | | {mb_s(tcp_s):.0f} MB/s | "
          f"{mb_s(tcp_s) / mb_s(base_t):.1f} | | | | | |")
    print(f"| peer: TLS (Python ssl) copy of the same bytes, loopback | | {mb_s(tls_s):.0f} MB/s | "
          f"{mb_s(tls_s) / mb_s(base_t):.1f} | | | | | |")
    print(f"shard CPU: user+system seconds of the shard process during the timed rounds; '× {base} by shard CPU' "
          f"is the throughput ratio a shard with a core of its own would see (less sensitive to other load)")
    if any(measured[name].shard_cpu < CPU_RESOLUTION_S for name in configs):
        print(f"n/a: a shard's CPU over the timed rounds was under /proc's resolution ({CPU_RESOLUTION_S * 1e3:.0f} "
              f"ms): more --rounds or --mb give figures")
    for name in configs:
        split = ", ".join(f"{group} {seconds / args.rounds * 1e3:.0f} ms" for group, seconds in
                          measured[name].threads.items())
        print(f"{name} shard CPU per round by thread: {split}; minor page faults per round "
              f"{measured[name].minflt / args.rounds:.0f}; resident memory after the rounds {measured[name].rss_mb:.0f} MB")
    for name in configs:
        wall = mb_s(statistics.median(measured[name].wall))
        by_cpu = input_per_cpu_s(measured[name].shard_cpu)
        print(f"{name} shard input / raw TCP: {wall / mb_s(tcp_s):.2f} by wall time, "
              f"{figure(None if by_cpu is None else by_cpu / mb_s(tcp_s), '.2f')} per shard CPU-second; "
              f"1 Gbit/s link (125 MB/s) covered: {wall / 125:.1f}x")


if __name__ == "__main__":
    main()
