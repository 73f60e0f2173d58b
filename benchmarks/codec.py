"""Codec throughput next to an in-place copy_ of the same tensor, measured in the same run.

    .venv/bin/python benchmarks/codec.py [--numel 25000000] [--repeats 7] [--bits 4 2 8 1 3 5 6 7] [--json out.json]

Element rate = numel / best time. The ratio column divides by copy_'s element rate (torch's
copy_ uses every core, as our kernels do), so it says how close compression gets to simply
moving the gradient once through memory. copy_ is timed first and last and the better of the
two is used, so a noisy moment at the start does not flatter every ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Callable

import torch

from cgx_ps.kernels import Codec, dequantize, encode, quantize


def best_time(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: JIT compilation, page faults
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def run(numel: int, repeats: int, widths: tuple[int, ...] = (4, 2, 8, 1, 3, 5, 6, 7)) -> list[dict]:
    x = torch.randn(numel)
    y = torch.empty_like(x)
    copy_s = best_time(lambda: y.copy_(x), repeats)
    rows = [{"op": "copy_ (peer)", "seconds": copy_s}]

    def add(op: str, fn: Callable[[], object]) -> None:
        rows.append({"op": op, "seconds": best_time(fn, repeats)})

    for bits in widths:
        for stochastic in (True, False):
            kind = "stochastic" if stochastic else "nearest"
            add(f"quantize {bits}-bit {kind}",
                lambda b=bits, s=stochastic: quantize(x, b, 1024, stochastic=s, seed=1))
        block = quantize(x, bits, 1024, stochastic=True, seed=1)
        payload = block.to_bytes()
        add(f"dequantize {bits}-bit", lambda blk=block: dequantize(blk, out=y))
        add(f"dequantize-accumulate {bits}-bit", lambda blk=block: dequantize(blk, out=y, accumulate=True))
        if bits == 4:
            add("dequantize-accumulate 4-bit from wire bytes (+crc, checks)",
                lambda p=payload: dequantize(p, out=y, accumulate=True))
            add("to_bytes 4-bit (+crc32)", block.to_bytes)
    for codec in (Codec.FP16, Codec.BF16):
        add(f"encode {codec.name}", lambda c=codec: encode(x, c))
    copy_s = rows[0]["seconds"] = min(copy_s, best_time(lambda: y.copy_(x), repeats))
    for row in rows:
        row["melem_per_s"] = numel / row["seconds"] / 1e6
        row["ratio_to_copy"] = copy_s / row["seconds"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--numel", type=int, default=25_000_000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--bits", type=int, nargs="+", default=[4, 2, 8, 1, 3, 5, 6, 7])
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args()
    rows = run(args.numel, args.repeats, tuple(args.bits))
    print(f"{args.numel:,} float32 elements, {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}")
    print(f"| {'operation':58} | {'ms':>7} | {'Melem/s':>8} | {'x copy_':>7} |")
    print(f"|{'-' * 60}|{'-' * 9}|{'-' * 10}|{'-' * 9}|")
    for r in rows:
        print(f"| {r['op']:58} | {r['seconds'] * 1e3:7.2f} | {r['melem_per_s']:8.0f} | {r['ratio_to_copy']:7.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
