"""What one shard process really holds in memory: idle, after a realistic session, and under
attack at its caps; then a sizing rule fitted to the measurements.

    .venv/bin/python benchmarks/shard_memory.py [--inflight-mb 64,256,1024] [--params 25e6]
                                                [--rounds 5] [--sweep 12.5e6,50e6] [--imports]

Every measurement starts a fresh shard process,

    python -m cgx_ps.cli server --host 127.0.0.1 --port 0 --port-file F --metrics-port -1
        --token-file T --max-inflight-mb M --kernel-threads 1 [--error-feedback]

and reads VmRSS (now) and VmHWM (peak) from /proc/PID/status, plus RssAnon (heap, tensors,
buffers) and RssFile (mapped shared libraries: numba/LLVM, grpc; a shard never imports torch; they count against a
container's memory cgroup too). Scenarios, for each M:

  idle      started, nothing connected
  session   2 nodes push 4-bit blocks of a model of --params fp32 parameters (25 tensors, 4 MiB
            blocks) for --rounds rounds and pull the sums; with and without --error-feedback
  attack    one registered member (it has the token: a compromised or buggy worker) fills the blob
            store to its capacity (M) with one blob, then opens streams that each hold a partial
            block until the in-flight budget (M) is taken
  worst     what the code allows beyond that: 7/8 of the blob store stored and the last 1/8
            held by a PutBlob left unfinished (uploads reserve from the store's capacity M),
            partial blocks up to the in-flight budget (M), and 32 more Exchange streams each
            parked with a 7 MiB chunk while they wait for budget (per-stream cost; the shard
            admits --max-concurrent-rpcs calls)

The attack shards run with --round-timeout 600 so the partial uploads are not timed out while
the script measures; the caps themselves are the defaults. Then, from the same run:
RSS ≈ base + a × M + b × (fp32 model bytes owned) [+ e × model with error feedback].
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np
import torch

if __name__ == "__main__" and not __package__:  # `python benchmarks/shard_memory.py`: import the package
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.memshard import ROOT, MiB, run, settle, shown, start_shard  # noqa: E402
from benchmarks.shard_attack import PARKED_CHUNK, PARKED_STREAMS, attack  # noqa: E402
from cgx_ps.kernels import quantize  # noqa: E402
from cgx_ps.net.security import ChannelSecurity, new_token_file  # noqa: E402
from cgx_ps.worker.shards.client import ShardClient  # noqa: E402
from cgx_ps.worker.pipeline.blocks import Compression, TensorInfo, build_layout  # noqa: E402


# ---- (b) a realistic session -------------------------------------------------------------------------

def model_layout(params: float, bits: int = 4):
    """``params`` fp32 parameters as 25 equal 2-D tensors, 4 MiB blocks, 4-bit (CGX defaults)."""
    per = int(params) // 25
    cols = 1000
    tensors = [TensorInfo(f"layer{i:02d}.weight", (per // cols, cols)) for i in range(25)]
    return build_layout(tensors, 1, Compression(bits=bits), block_bytes=4 * MiB)


async def run_session(address: str, security: ChannelSecurity, layout, rounds: int, nodes: int = 2) -> None:
    gen = torch.Generator().manual_seed(0)
    payloads = {b.block_id: quantize(torch.randn(b.numel, generator=gen), b.codec.bits, b.codec.bucket_size,
                                     stochastic=True).to_bytes()
                for b in layout.blocks}
    clients = [ShardClient(address, f"node-{i}", nodes, layout, security=security) for i in range(nodes)]
    for c in clients:
        await c.connect()
    try:
        for r in range(rounds):
            await asyncio.gather(*[c.exchange(b.block_id, r, payloads[b.block_id])
                                   for c in clients for b in layout.blocks])
    finally:
        for c in clients:
            await c.close()


def session(tmp: str, token: str, inflight_mb: int, params: float, rounds: int, error_feedback: bool) -> dict:
    layout = model_layout(params)
    shard = start_shard(tmp, token, inflight_mb, error_feedback)
    try:
        idle = settle(shard.pid)
        run(run_session(shard.address, ChannelSecurity(token_file=token), layout, rounds))
        after = settle(shard.pid)
    finally:
        shard.stop()
    model_bytes = 4 * sum(b.numel for b in layout.blocks)
    return {"idle": idle, "after": after, "model_mib": model_bytes / MiB, "cmd": shown(shard.cmd),
            "blocks": len(layout.blocks)}


# ---- what the imports cost ----------------------------------------------------------------------------

IMPORT_PROBE = r"""
import sys
def rss():
    for line in open('/proc/self/status'):
        if line.startswith(('VmRSS', 'RssAnon', 'RssFile')):
            yield line.split()[1]
def show(what):
    r = list(rss()); print(what, *r, flush=True)
show('python')
import grpc, grpc_health.v1.health, google.protobuf; show('grpc+protobuf')
import numpy; show('numpy')
import numba; show('numba')
import uvloop, prometheus_client; show('uvloop+prometheus')
import cgx_ps.server.main; show('cgx_ps.server.main (all the shard imports)')
print('modules', 'torch' in sys.modules, 'numba' in sys.modules, 'llvmlite' in sys.modules, 'cupy' in sys.modules)
"""


def imports_rss() -> list[tuple[str, float, float, float]]:
    out = subprocess.run([sys.executable, "-c", IMPORT_PROBE], capture_output=True, text=True, cwd=ROOT,
                         check=True).stdout
    rows = []
    for line in out.splitlines():
        if line.startswith("modules"):
            continue
        *name, rss, anon, file = line.split()
        rows.append((" ".join(name), int(rss) / 1024, int(anon) / 1024, int(file) / 1024))
    return rows


# ---- report --------------------------------------------------------------------------------------------

def row(m: int | str, what: str, s: dict, note: str = "") -> str:
    return (f"| {m} | {what} | {s['VmRSS']:.0f} | {s['VmHWM']:.0f} | {s['RssAnon']:.0f} | {s['RssFile']:.0f} | "
            f"{note} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--inflight-mb", default="64,256,1024", help="values of --max-inflight-mb (M)")
    p.add_argument("--params", type=float, default=25e6, help="fp32 parameters of the session's model")
    p.add_argument("--sweep", default="12.5e6,50e6",
                   help="more model sizes (no error feedback, the middle M) for the model-bytes slope")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--imports", action="store_true", help="also: RSS after each import a shard makes")
    args = p.parse_args()
    ms = [int(x) for x in args.inflight_mb.split(",")]
    sweep = [float(x) for x in args.sweep.split(",") if x]
    print(f"host: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}; python {sys.version.split()[0]}, "
          f"torch {torch.__version__}, grpcio {grpc.__version__}", flush=True)

    rows, fit_session, fit_attack, fit_worst = [], [], [], []
    idles, ef_extra, cmds = [], [], {}
    with tempfile.TemporaryDirectory(prefix="cgx-ps-mem-") as tmp:
        token = new_token_file(tmp)
        for m in ms:
            shard = start_shard(tmp, token, m)
            try:
                time.sleep(1.0)
                idle = settle(shard.pid)
            finally:
                shard.stop()
            cmds["idle"] = shown(shard.cmd)
            idles.append(idle)
            rows.append(row(m, "(a) idle after start", idle))
            print(rows[-1], flush=True)
            for ef in (False, True):
                s = session(tmp, token, m, args.params, args.rounds, ef)
                cmds["session-ef" if ef else "session"] = s["cmd"]
                label = f"(b) after {args.params / 1e6:g}M-param session{' + error feedback' if ef else ''}"
                rows.append(row(m, label, s["after"], f"{s['model_mib']:.0f} MiB fp32 model, {s['blocks']} blocks, "
                                                      f"{args.rounds} rounds x 2 nodes"))
                print(rows[-1], flush=True)
                (ef_extra if ef else fit_session).append((s["model_mib"], s["after"], s["idle"], m))
            for worst in (False, True):
                a = attack(tmp, token, m, worst)
                cmds["attack"] = a["cmd"]
                for name, st in a["stages"]:
                    rows.append(row(m, f"({'c' if not worst else 'c+'}) {name}", st))
                    print(rows[-1], flush=True)
                (fit_worst if worst else fit_attack).append((m, a["stages"][0][1], a["stages"]))
        mid = ms[len(ms) // 2]
        for params in sweep:
            s = session(tmp, token, mid, params, args.rounds, False)
            rows.append(row(mid, f"(b) after {params / 1e6:g}M-param session", s["after"],
                            f"{s['model_mib']:.0f} MiB fp32 model (slope sweep)"))
            print(rows[-1], flush=True)
            fit_session.append((s["model_mib"], s["after"], s["idle"], mid))

    print()
    print("commands (F: a port file, T: a token file, both in a temp dir):")
    for k, v in cmds.items():
        print(f"  {k}: {v}")
    print()
    print("| M (--max-inflight-mb) | state | VmRSS MiB | VmHWM MiB | RssAnon MiB | RssFile MiB | notes |")
    print("|---:|---|---:|---:|---:|---:|---|")
    for r in rows:
        print(r)

    # ---- the fit ----
    base = statistics.median(i["VmRSS"] for i in idles)
    base_hwm = statistics.median(i["VmHWM"] for i in idles)
    # model slope: (RSS after a session - that shard's own idle RSS) against model MiB; the intercept is
    # what any first session adds whatever the model's size (numba kernels loaded, gRPC and malloc buffers)
    xs = np.array([x for x, *_ in fit_session])
    for key in ("VmRSS", "VmHWM"):
        ys = np.array([a[key] - i["VmRSS"] for _, a, i, _ in fit_session])
        b, c = np.polyfit(xs, ys, 1)
        print(f"session, {key}: shard RSS - its idle RSS = {c:.0f} MiB + {b:.2f} x model fp32 MiB "
              f"(points: {', '.join(f'{x:.0f}->{y:.0f}' for x, y in zip(xs, ys))})")
    for x, a, _i, m in ef_extra:
        plain = next(pa for px, pa, _, pm in fit_session if pm == m and abs(px - x) < 1)
        print(f"error feedback at M={m}: +{(a['VmRSS'] - plain['VmRSS']) / x:.2f} x model (RSS), "
              f"+{(a['VmHWM'] - plain['VmHWM']) / x:.2f} x model (HWM)")
    for name, data, last in (("attack (store full + partial blocks)", fit_attack, -1),
                             ("worst without the parked streams (7/8 store + an open upload + partial blocks)",
                              fit_worst, -2)):
        mx = np.array([m for m, *_ in data], dtype=float)
        for key in ("VmRSS", "VmHWM"):
            ys = np.array([stages[last][1][key] - reg["VmRSS"] for _, reg, stages in data])
            a, c = np.polyfit(mx, ys, 1)
            print(f"{name}, {key} above the registered shard: {c:.0f} MiB + {a:.2f} x M "
                  f"(points: {', '.join(f'{int(x)}->{y:.0f}' for x, y in zip(mx, ys))})")
    per = [(stages[-1][1]["VmRSS"] - stages[-2][1]["VmRSS"]) / PARKED_STREAMS for _, _, stages in fit_worst]
    print(f"a stream parked on the budget with a {PARKED_CHUNK / MiB:g} MiB chunk: "
          f"{', '.join(f'{x:.1f}' for x in per)} MiB each (one per M); the shard admits --max-concurrent-rpcs "
          f"(default 1024) calls")
    print(f"base: idle VmRSS median {base:.0f} MiB (VmHWM {base_hwm:.0f} MiB)")

    if args.imports:
        print()
        print("| after importing | VmRSS MiB | RssAnon MiB | RssFile MiB |")
        print("|---|---:|---:|---:|")
        for name, rss, anon, file in imports_rss():
            print(f"| {name} | {rss:.0f} | {anon:.0f} | {file:.0f} |")


if __name__ == "__main__":
    main()
