"""CUDA codec bandwidth next to a device-to-device copy_ of the same tensor, in the same run.

    .venv/bin/python benchmarks/codec_gpu.py [--numel 25000000] [--bits 4] [--iters 50]

Times come from CUDA events around ``--iters`` back-to-back calls. Each operation is measured
twice: "kernel" launches only the CuPy kernel (what the memory system can do), "API" is the
public call with its checks (header copy, the NaN/metadata flag read back to the host once per
call), which adds a fixed per-call latency that matters for small tensors. GB/s counts the bytes
an operation must move (copy_: read + write 4 B/element; quantize: read 4 B + write the body;
dequantize: read the body + write 4 B; accumulate: + read 4 B); the ratio divides by copy_'s GB/s.
"""

from __future__ import annotations

import argparse
from typing import Callable

import torch

from cgx_ps.kernels import cuda, dequantize, quantize, wire
from cgx_ps.kernels.wire import HEADER_SIZE, Codec, Header

__all__ = ["main", "run"]


def seconds_per_call(fn: Callable[[], object], iters: int) -> float:
    fn()  # warm-up: NVRTC compile, allocator
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def run(numel: int, bits: int, bucket_size: int, iters: int) -> list[tuple[str, float, float]]:
    """Rows of (operation, seconds per call, bytes moved per call)."""
    import cupy as cp  # here, not at the top: the module docstring stays readable without it
    x = torch.randn(numel, device="cuda")
    y = torch.empty_like(x)
    header = Header(Codec.MAXMIN, bits, wire.FLAG_STOCHASTIC, numel, bucket_size, 0)
    nearest = Header(Codec.MAXMIN, bits, 0, numel, bucket_size, 0)
    payload = torch.empty(HEADER_SIZE + header.body_size, dtype=torch.uint8, device="cuda")
    block = quantize(x, bits, bucket_size, stochastic=True, seed=1)
    body = header.body_size
    rows = [("copy_ (device to device)", seconds_per_call(lambda: y.copy_(x), iters), 8 * numel)]

    def add(op: str, fn: Callable[[], object], nbytes: int) -> None:
        rows.append((op, seconds_per_call(fn, iters), nbytes))

    name = f"{bits}-bit, bucket {bucket_size}"
    add(f"quantize stochastic {name}, kernel",
        lambda: cuda.encode_maxmin_async(cp, x, payload, header, 1), 4 * numel + body)
    add(f"quantize nearest {name}, kernel",
        lambda: cuda.encode_maxmin_async(cp, x, payload, nearest, 1), 4 * numel + body)
    add(f"dequantize {name}, kernel",
        lambda: cuda.decode_maxmin_async(cp, block.payload, header, y, False), body + 4 * numel)
    add(f"dequantize-accumulate {name}, kernel",
        lambda: cuda.decode_maxmin_async(cp, block.payload, header, y, True), body + 8 * numel)
    add(f"quantize stochastic {name}, API",
        lambda: quantize(x, bits, bucket_size, stochastic=True, seed=1), 4 * numel + body)
    add(f"dequantize {name}, API", lambda: dequantize(block, out=y), body + 4 * numel)
    add(f"dequantize-accumulate {name}, API",
        lambda: dequantize(block, out=y, accumulate=True), body + 8 * numel)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--numel", type=int, default=25_000_000)
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--bucket-size", type=int, default=1024)
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    rows = run(args.numel, args.bits, args.bucket_size, args.iters)
    copy_gbs = rows[0][2] / rows[0][1] / 1e9
    print(f"{args.numel:,} float32 elements on {torch.cuda.get_device_name()}")
    print(f"| {'operation':48} | {'ms':>7} | {'GB/s':>7} | {'x copy_':>7} |")
    print(f"|{'-' * 50}|{'-' * 9}|{'-' * 9}|{'-' * 9}|")
    for op, seconds, nbytes in rows:
        gbs = nbytes / seconds / 1e9
        print(f"| {op:48} | {seconds * 1e3:7.3f} | {gbs:7.0f} | {gbs / copy_gbs:7.2f} |")


if __name__ == "__main__":
    main()
