"""What the shard's malloc thresholds (cgx_ps/server/process/allocator.py) cost and save: page faults and
CPU per round of honest traffic, and the peak memory of a member attacking the shard at its caps.

    .venv/bin/python benchmarks/shard_allocator.py [--inflight-mb 256] [--rounds 20] [--nodes 4]
                                                   [--mb 100] [--trim-mib 16,64]

For each setting a fresh ``cgx-ps server`` process (benchmarks/memshard.start_shard) runs

  honest  --nodes nodes push 4-bit blocks of --mb fp32 MB each for --rounds rounds (after one
          warm-up): the shard's CPU and minor page faults per round (/proc), VmHWM after;
  worst   benchmarks/shard_attack.attack(worst=True) at --max-inflight-mb M: blob store, an open
          upload, partial blocks and 32 parked streams; VmHWM at its last stage, above the
          registered shard's.

The settings, passed in the shard's environment (allocator.py leaves an operator's own malloc
settings alone): ``glibc`` glibc's dynamic defaults (a malloc tunable at its default value,
``glibc.malloc.tcache_count=7``, so the shard sets nothing), ``shard`` the shard's own mallopt
(no variable), and ``trim N`` the shard's mmap threshold with a trim threshold of N MiB
(``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``). The settings run one after another, so
CPU figures carry this machine's load drift; the page faults and peak memory do not depend on it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__" and not __package__:  # `python benchmarks/shard_allocator.py`: import the package
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.memshard import MiB, run, settle, start_shard  # noqa: E402
from benchmarks.procstat import proc_cpu_seconds, proc_minor_faults  # noqa: E402
from benchmarks.shard_attack import attack  # noqa: E402
from cgx_ps.kernels import quantize  # noqa: E402
from cgx_ps.net.security import ChannelSecurity, new_token_file  # noqa: E402
from cgx_ps.server.process.allocator import MMAP_THRESHOLD  # noqa: E402
from cgx_ps.worker.shards.client import ShardClient  # noqa: E402
from cgx_ps.worker.pipeline.blocks import Compression, TensorInfo, build_layout  # noqa: E402


def settings(trims_mib: list[int]) -> dict[str, dict[str, str]]:
    """Setting name -> the shard's extra environment."""
    out = {"glibc": {"GLIBC_TUNABLES": "glibc.malloc.tcache_count=7"}, "shard": {}}
    for mib in trims_mib:
        out[f"trim {mib}"] = {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD), "MALLOC_TRIM_THRESHOLD_": str(mib * MiB)}
    return out


async def honest_rounds(address: str, token: str, pid: int, nodes: int, mb: float, rounds: int) -> tuple[float, float]:
    """(shard CPU ms, minor faults) per round over ``rounds`` timed rounds."""
    import torch

    layout = build_layout([TensorInfo("grad", (int(mb * 1e6 / 4),))], 1, Compression(bits=4, compress_1d=True),
                          block_bytes=4 << 20)
    gen = torch.Generator().manual_seed(0)
    payloads = {b.block_id: quantize(torch.randn(b.numel, generator=gen), 4, b.codec.bucket_size,
                                     stochastic=True).to_bytes() for b in layout.blocks}
    clients = [ShardClient(address, f"node-{i}", nodes, layout, security=ChannelSecurity(token_file=token))
               for i in range(nodes)]
    for c in clients:
        await c.connect()
    try:
        for r in range(rounds + 1):
            if r == 1:
                cpu0, faults0 = proc_cpu_seconds(pid), proc_minor_faults(pid)
            await asyncio.gather(*[c.exchange(b.block_id, r, payloads[b.block_id])
                                   for c in clients for b in layout.blocks])
        await asyncio.sleep(0.3)
        return (proc_cpu_seconds(pid) - cpu0) / rounds * 1e3, (proc_minor_faults(pid) - faults0) / rounds
    finally:
        for c in clients:
            await c.close()


def with_env(extra: dict[str, str]):
    """Set ``extra`` in this process's environment (the shards started meanwhile inherit it)."""
    class _Env:
        def __enter__(self) -> None:
            self.saved = {k: os.environ.get(k) for k in extra}
            os.environ.update(extra)

        def __exit__(self, *exc) -> None:
            for k, v in self.saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    return _Env()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--inflight-mb", type=int, default=256, help="--max-inflight-mb of the attacked shard (M)")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--mb", type=float, default=100.0, help="fp32 megabytes of gradient per node per round")
    p.add_argument("--trim-mib", default="16,64", help="trim thresholds to try besides glibc's and the shard's")
    args = p.parse_args()
    print(f"host: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}", flush=True)
    print(f"| setting | shard CPU per round | minor faults per round | VmHWM after {args.rounds} rounds | "
          f"worst attack at M = {args.inflight_mb} MiB: VmHWM, above the registered shard |")
    print("|---|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory(prefix="cgx-ps-alloc-") as tmp:
        token = new_token_file(tmp)
        for name, extra in settings([int(x) for x in args.trim_mib.split(",") if x]).items():
            with with_env(extra):
                shard = start_shard(tmp, token, max(args.inflight_mb, 256))
                try:
                    cpu_ms, faults = run(honest_rounds(shard.address, token, shard.pid, args.nodes, args.mb,
                                                       args.rounds))
                    honest_peak = settle(shard.pid)["VmHWM"]
                finally:
                    shard.stop()
                stages = attack(tmp, token, args.inflight_mb, worst=True)["stages"]
            registered, last = stages[0][1]["VmHWM"], stages[-1][1]["VmHWM"]
            print(f"| {name} | {cpu_ms:.0f} ms | {faults:.0f} | {honest_peak:.0f} MiB | {last:.0f} MiB, "
                  f"+{last - registered:.0f} MiB |", flush=True)
            time.sleep(0.5)


if __name__ == "__main__":
    main()
