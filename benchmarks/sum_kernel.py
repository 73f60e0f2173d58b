"""The shard's fused sum + encode kernel alone (``cpu.sum_maxmin_into``), one thread, code trees
compared in the same run.

    .venv/bin/python benchmarks/sum_kernel.py [--trees DIR ...] [--rounds 20] [--nodes 4] [--mb 100]
                                              [--bits 4] [--nearest]
    .venv/bin/python benchmarks/sum_kernel.py --parts [--asm]

A round is what a shard's kernel threads do for 4 nodes x 100 MB: 24 blocks of 1M elements, each
summed from ``--nodes`` kept 4-bit pushes and re-encoded (stochastic rounding
unless ``--nearest``), one kernel call per block on one thread (a shard's executor runs a thread
per core and splits no call, server/rounds/kernel_threads.py). No validation, no copies, no executor: only
the kernel, so its CPU per round (``time.thread_time``) is the figure a change to
kernels/cpu.py moves. Each tree (a directory holding a ``cgx_ps`` package, say ``git archive
<commit> cgx_ps | tar -x -C DIR``; this checkout is always the last) runs in a process of its own,
rounds alternated between them (order rotated every round), and the paired ratios of CPU per
round are the figure to trust on a shared machine. The trees' result bytes are compared too:
a faster kernel must write the same bytes.

``--parts`` times the pieces of one block's call in this checkout (1M elements, 4 pushes, 4-bit,
one thread, median of 15): the decode of the pushes, the min/max scan, the levels with
stochastic or nearest rounding, the packing, and the whole fused call; ``--asm`` adds how many
of each piece's instructions use AVX2's ymm registers (numba's ``inspect_asm``, compiled afresh),
which says whether LLVM vectorized its loops on this CPU.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
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


def parts(show_asm: bool) -> None:
    """Time the pieces of the fused kernel for one block, one thread (see the module doc)."""
    import time

    import numba
    import numpy as np
    import torch

    from cgx_ps.kernels import cpu, quantize
    from cgx_ps.kernels.cpu_loops import _levels_nearest, _levels_stochastic, _scan, sum_kernel
    from cgx_ps.kernels.cpu_packing import pack as _pack, unpack as _unpack
    from cgx_ps.kernels.wire import HEADER_SIZE

    numel, bucket, bits, nodes = 1 << 20, 1024, 4, 4

    @numba.njit(nogil=True)
    def decode(rows, metas, bits):  # the pushes of each bucket into an L1 scratch buffer, as the sum kernel
        x = np.empty(bucket, dtype=np.float32)
        lv = np.empty(bucket, dtype=np.uint8)
        total = np.float32(0.0)
        for b in range(numel // bucket):
            p0 = b * bucket * bits // 8
            p1 = p0 + bucket * bits // 8
            _unpack(rows[0, p0:p1], x, metas[0, 2 * b], metas[0, 2 * b + 1], bits, False, lv)
            for k in range(1, rows.shape[0]):
                _unpack(rows[k, p0:p1], x, metas[k, 2 * b], metas[k, 2 * b + 1], bits, True, lv)
            total += x[0]
        return total

    @numba.njit(nogil=True)
    def scan(x):
        xb = x.view(np.int32)
        total = np.float32(0.0)
        for b in range(numel // bucket):
            mn, mx, _ = _scan(xb[b * bucket:(b + 1) * bucket])
            total += mn + mx
        return total

    @numba.njit(nogil=True)
    def levels(x, stochastic):
        lv = np.empty(bucket, dtype=np.uint8)
        total = 0
        for b in range(numel // bucket):
            xs = x[b * bucket:(b + 1) * bucket]
            if stochastic:
                _levels_stochastic(xs, np.float32(-4.0), np.float32(2.0), np.int32(15), lv, b * bucket, np.uint32(7))
            else:
                _levels_nearest(xs, np.float32(-4.0), np.float32(2.0), np.int32(15), lv)
            total += lv[0]
        return total

    @numba.njit(nogil=True)
    def pack(lvs, out, bits):
        for b in range(numel // bucket):
            p0 = b * bucket * bits // 8
            _pack(lvs[b * bucket:(b + 1) * bucket], out[p0:p0 + bucket * bits // 8], bits)
        return out[0]

    def median_ms(fn, *args) -> float:
        fn(*args)
        times = []
        for _ in range(15):
            t0 = time.thread_time()
            fn(*args)
            times.append(time.thread_time() - t0)
        return statistics.median(times) * 1e3

    gen = torch.Generator().manual_seed(0)
    bodies = [np.frombuffer(quantize(torch.randn(numel, generator=gen), bits, bucket, stochastic=True).to_bytes(),
                            dtype=np.uint8)[HEADER_SIZE:] for _ in range(nodes)]
    nmeta = 2 * (numel // bucket)
    metas = np.stack([b[:4 * nmeta] for b in bodies]).view(np.float32)
    rows = np.stack([b[4 * nmeta:] for b in bodies])
    x = torch.randn(numel, generator=gen).numpy()
    lvs = np.random.default_rng(0).integers(0, 1 << bits, numel).astype(np.uint8)
    out = np.empty(numel * bits // 8, dtype=np.uint8)
    meta, packed = np.empty(nmeta, dtype=np.float32), np.empty(numel * bits // 8, dtype=np.uint8)

    def fused(stochastic: bool) -> None:
        cpu.sum_maxmin_into(list(rows), metas, numel, bits, bucket, None, False, (meta, packed), None, stochastic,
                            7, 1)

    print(f"one block: {numel} elements, {nodes} pushes, {bits}-bit, bucket {bucket}, one thread; ms, median of 15 "
          f"(x, levels and packed bytes of the pieces below come from memory, the fused call's from L1)")
    print("| piece | ms per block |")
    print("|---|---:|")
    print(f"| decode of the {nodes} pushes (split levels, add) | {median_ms(decode, rows, metas, bits):.3f} |")
    print(f"| min/max scan | {median_ms(scan, x):.3f} |")
    print(f"| levels, stochastic rounding (the hash) | {median_ms(levels, x, True):.3f} |")
    print(f"| levels, nearest rounding | {median_ms(levels, x, False):.3f} |")
    print(f"| packing | {median_ms(pack, lvs, out, bits):.3f} |")
    print(f"| the fused call, stochastic | {median_ms(fused, True):.3f} |")
    print(f"| the fused call, nearest | {median_ms(fused, False):.3f} |")
    if show_asm:
        pieces = {"decode": decode, "scan": scan, "levels": levels, "pack": pack,
                  "fused": numba.njit(nogil=True)(sum_kernel(bits).py_func)}
        fused(True)
        nb = numel // bucket
        status = np.full(2, -1, dtype=np.int64)
        levels_at = np.array([r.ctypes.data for r in rows], dtype=np.uint64)
        pieces["fused"](levels_at, metas, nodes, numel, bucket, cpu._NO_F32, False, True, cpu._NO_F32, False,
                        meta, packed, True, np.uint32(7), 0, nb, status)
        for name, fn in pieces.items():
            for asm in fn.inspect_asm().values():
                code = [line for line in asm.splitlines() if line.startswith("\t") and not line.startswith("\t.")]
                print(f"{name}: {len(code)} instructions, {sum('ymm' in line for line in code)} on ymm, "
                      f"{sum('vpmulld' in line for line in code)} vpmulld")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trees", nargs="*", default=[], help="directories holding a cgx_ps package to compare")
    parser.add_argument("--rounds", type=int, default=20, help="timed rounds per tree (after two warm-ups)")
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--mb", type=float, default=100.0, help="fp32 megabytes of gradient per node per round")
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--nearest", action="store_true", help="re-encode with nearest rounding")
    parser.add_argument("--parts", action="store_true", help="time the pieces of one block's call instead")
    parser.add_argument("--asm", action="store_true", help="with --parts: count the vector instructions")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.parts:
        parts(args.asm)
        return
    if args.child:
        child(args.nodes, args.mb, args.bits, not args.nearest)
        return
    # the parent alone imports from this checkout's benchmarks/ (appended: a child must import its tree's cgx_ps)
    sys.path.append(str(HERE))
    from benchmarks.trees import TreeChildren, paired_ratio

    trees = [Path(t).resolve() for t in args.trees] + [HERE]
    cpu: list[list[float]] = [[] for _ in trees]
    digests: list[list[str]] = [[] for _ in trees]
    load = os.getloadavg()[0]
    with TreeChildren(trees, [__file__, "--child", "--nodes", str(args.nodes), "--mb", str(args.mb),
                              "--bits", str(args.bits), *(["--nearest"] if args.nearest else [])]) as children:
        for counted, k, answer in children.rounds(args.rounds):
            spent, digest = answer.split()
            digests[k].append(digest)
            if counted:
                cpu[k].append(float(spent))
    rounding = "nearest" if args.nearest else "stochastic"
    print(f"{args.nodes} bodies per block, {args.mb:g} MB fp32 per node, {args.bits}-bit, {rounding} re-encode, "
          f"one thread, {args.rounds} rounds alternated; load average {load:.2f} before, "
          f"{os.getloadavg()[0]:.2f} after")
    print("| code | kernel CPU per round, median (min) | × first, median of paired ratios | same bytes as first |")
    print("|---|---:|---:|---|")
    for k, tree in enumerate(trees):
        paired = paired_ratio(cpu[0], cpu[k])
        print(f"| {tree} | {statistics.median(cpu[k]):.1f} ms ({min(cpu[k]):.1f}) | {paired:.2f} | "
              f"{'yes' if digests[k] == digests[0] else 'NO'} |")


if __name__ == "__main__":
    main()
