"""The shard's fused sum + encode kernel alone (``cpu.sum_maxmin_into``), one thread, code trees
compared in the same run.

    .venv/bin/python benchmarks/sum_kernel.py [--trees DIR ...] [--rounds 20] [--nodes 4] [--mb 100]
                                              [--bits 4] [--nearest]

A round is what a shard's kernel threads do for 4 nodes x 100 MB: 24 blocks of 1M elements, each
summed from ``--nodes`` kept 4-bit pushes and re-encoded (stochastic rounding
unless ``--nearest``), one kernel call per block on one thread (a shard's executor runs a thread
per core and splits no call, server/threads.py). No validation, no copies, no executor: only
the kernel, so its CPU per round (``time.thread_time``) is the figure a change to
kernels/cpu.py moves. Each tree (a directory holding a ``cgx_ps`` package, say ``git archive
<commit> cgx_ps | tar -x -C DIR``; this checkout is always the last) runs in a process of its own,
rounds alternated between them (order rotated every round), and the paired ratios of CPU per
round are the figure to trust on a shared machine. The trees' result bytes are compared too:
a faster kernel must write the same bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def child(nodes: int, mb: float, bits: int, stochastic: bool) -> None:
    """Run one round per line read on stdin; print its CPU in ms and a digest of its results."""
    import inspect
    import time

    import numpy as np
    import torch

    import cgx_ps
    from cgx_ps.kernels import cpu, quantize
    from cgx_ps.kernels.wire import HEADER_SIZE, split_maxmin_body

    numel, bucket = 1 << 20, 1024
    blocks = max(1, round(mb * 1e6 / 4 / numel))
    gen = torch.Generator().manual_seed(0)
    slots = []
    for _ in range(blocks):
        bodies = [np.frombuffer(quantize(torch.randn(numel, generator=gen) * (1 + i), bits, bucket,
                                         stochastic=True, seed=i).to_bytes(), dtype=np.uint8)[HEADER_SIZE:]
                  for i in range(nodes)]
        rows = np.zeros((nodes, -(-bodies[0].size // 8) * 8), dtype=np.uint8)
        for i, body in enumerate(bodies):
            rows[i, :body.size] = body
        slots.append(rows)
    body = np.zeros(slots[0].shape[1], dtype=np.uint8)
    meta, packed = split_maxmin_body(body, numel, bucket)
    if "slots" in inspect.signature(cpu.sum_maxmin_into).parameters:  # code before 2026-11-24: bodies in slots
        inputs = [(rows, nodes) for rows in slots]
    else:  # levels read where they are, metadata rows apart
        nmeta = 2 * -(-numel // bucket)
        inputs = [([row[4 * nmeta:] for row in rows], np.ascontiguousarray(rows[:, :4 * nmeta]).view(np.float32))
                  for rows in slots]
    print(cgx_ps.__file__, flush=True)
    r = 0
    for _ in sys.stdin:
        digest = hashlib.sha256()
        spent = 0.0
        for b, pushed in enumerate(inputs):
            t0 = time.thread_time()
            cpu.sum_maxmin_into(*pushed, numel, bits, bucket, None, False, (meta, packed), None, stochastic,
                                (r << 24) | b, 1)
            spent += time.thread_time() - t0
            digest.update(body.tobytes())
        r += 1
        print(f"{spent * 1e3:.2f} {digest.hexdigest()[:16]}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trees", nargs="*", default=[], help="directories holding a cgx_ps package to compare")
    parser.add_argument("--rounds", type=int, default=20, help="timed rounds per tree (after two warm-ups)")
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--mb", type=float, default=100.0, help="fp32 megabytes of gradient per node per round")
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--nearest", action="store_true", help="re-encode with nearest rounding")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.nodes, args.mb, args.bits, not args.nearest)
        return
    trees = [Path(t).resolve() for t in args.trees] + [HERE]
    procs = []
    for tree in trees:
        # started in the tree: `python -c/-m` would put the working directory ahead of PYTHONPATH
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), *filter(None, [os.environ.get("PYTHONPATH")])])}
        proc = subprocess.Popen([sys.executable, __file__, "--child", "--nodes", str(args.nodes), "--mb", str(args.mb),
                                 "--bits", str(args.bits), *(["--nearest"] if args.nearest else [])],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=tree)
        procs.append(proc)
        imported = Path(proc.stdout.readline().strip())
        if not imported.is_relative_to(tree):
            raise SystemExit(f"{tree}: the child imported {imported}")
    cpu: list[list[float]] = [[] for _ in trees]
    digests: list[list[str]] = [[] for _ in trees]
    load = os.getloadavg()[0]
    try:
        for r in range(args.rounds + 2):
            for k in [*range(r % len(trees), len(trees)), *range(r % len(trees))]:
                procs[k].stdin.write("round\n")
                procs[k].stdin.flush()
                spent, digest = procs[k].stdout.readline().split()
                digests[k].append(digest)
                if r >= 2:
                    cpu[k].append(float(spent))
    finally:
        for proc in procs:
            proc.stdin.close()
            proc.wait()
    rounding = "nearest" if args.nearest else "stochastic"
    print(f"{args.nodes} bodies per block, {args.mb:g} MB fp32 per node, {args.bits}-bit, {rounding} re-encode, "
          f"one thread, {args.rounds} rounds alternated; load average {load:.2f} before, "
          f"{os.getloadavg()[0]:.2f} after")
    print("| code | kernel CPU per round, median (min) | × first, median of paired ratios | same bytes as first |")
    print("|---|---:|---:|---|")
    for k, tree in enumerate(trees):
        paired = statistics.median(b / x for b, x in zip(cpu[0], cpu[k]))
        print(f"| {tree} | {statistics.median(cpu[k]):.1f} ms ({min(cpu[k]):.1f}) | {paired:.2f} | "
              f"{'yes' if digests[k] == digests[0] else 'NO'} |")


if __name__ == "__main__":
    main()
