"""Pieces of a worker's step measured apart, per step of a model's layout (mlp17m: 18 blocks), as
CPU time of the calling thread (``time.thread_time``), old and new forms interleaved in one process.

    .venv/bin/python benchmarks/worker_pieces.py [--model mlp17m] [--reps 30]

Where a piece changed, its old form is written out here (the code before the change, as it was)
so both run on the same data, alternating, and the medians are comparable on a shared machine:

- result reading (communication thread): the protobuf parse of each result chunk and its
  ``.data`` (two copies of the block) against ``client.read_result`` (a view of the message);
- the seed key (codec thread, once per block encoded): numpy on one-element arrays against
  ``rng.seed_key`` in Python integers;
- the training thread's per-block work in the optimizer's hooks: ``BlockBuffers.span`` of every
  block that is a slice of one gradient, and ``fill`` + ``copy_out`` of the blocks that pack
  several tensors (what a cache of spans could save, against what the copies cost);
- the codec calls against their kernels alone: what the Python around encode and decode costs;
  the encode kernel on one block's gradient again and again (in cache) against a step's blocks
  (from memory): what memory costs it; ``to_bytes``'s crc32 and copy apart;
- the push's framing (``chunk_frames``: the payload copied a second time, after ``to_bytes``).

The codec kernels run on this thread only (``cpu.set_num_threads(1)``, as the worker's plan does
on 2 cores), so thread time is their whole cost. Minor page faults are counted too: alone in this
process, each fresh 0.5 MB buffer would fault its pages in (glibc gives a freed heap top back to
the kernel), which a worker's communication and codec threads do not (``ThreadCpu`` in
benchmarks/worker_cpu.py counts ~0 faults per step on them), so glibc is told to keep its heap
here (``mallopt``), as a worker's; ``--fresh-pages`` leaves glibc's defaults.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

if __name__ == "__main__" and not __package__:  # `python benchmarks/worker_pieces.py`: import the package
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.workload import build_model  # noqa: E402
from cgx_ps.net.chunk_frames import PUSH_FIELD, chunk_frames  # noqa: E402
from cgx_ps.kernels import Codec, PayloadScratch, cpu, dequantize, encode_block, rng, wire  # noqa: E402
from cgx_ps.server.rpc.push_frames import result_frames  # noqa: E402
from cgx_ps.v1 import ps_pb2  # noqa: E402
from cgx_ps.worker.pipeline.buffers import BlockBuffers  # noqa: E402
from cgx_ps.worker.shards.client import read_result  # noqa: E402
from cgx_ps.worker.pipeline.blocks import Compression, TensorInfo, build_layout  # noqa: E402


def thread_ms(fn: Callable[[], object]) -> tuple[float, int]:
    """CPU ms of this thread in ``fn()``, and its minor page faults (a fresh buffer's pages)."""
    faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    start = time.thread_time()
    fn()
    return (time.thread_time() - start) * 1e3, resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - faults


def seed_key_numpy(seed: int) -> int:
    """rng.seed_key before this change: the same arithmetic on one-element numpy arrays."""
    seed &= (1 << 64) - 1
    hi = rng.mix32(np.array([seed >> 32], dtype=np.uint64))
    return int(rng.mix32(np.array([seed & 0xFFFFFFFF], dtype=np.uint64) ^ hi)[0])


def pieces(model: str) -> dict[str, tuple[Callable[[], object], Callable[[], object] | None]]:
    """name -> (new or only form, old form or None), each one step's worth."""
    named = list(build_model(model).named_parameters())
    layout = build_layout([TensorInfo.of(n, p) for n, p in named], 2, Compression())
    blocks = list(layout.blocks)
    gen = torch.Generator().manual_seed(0)
    grads = {n: torch.randn(p.shape, generator=gen) for n, p in named}
    buffers = BlockBuffers(layout, [torch.device("cpu")] * len(blocks))
    single = [b.block_id for b in blocks if buffers.span(b.block_id, grads.get) is not None]
    packed = [b.block_id for b in blocks if b.block_id not in single]
    x = {b.block_id: torch.randn(b.numel, generator=gen) for b in blocks}
    scratch = {b.block_id: PayloadScratch() for b in blocks}

    def encode(b) -> bytes:
        codec = Codec.MAXMIN if b.codec.bits else Codec.FP32
        return encode_block(x[b.block_id], codec, bits=b.codec.bits or 4, bucket_size=b.codec.bucket_size or 1024,
                            stochastic=b.codec.stochastic, seed=b.block_id, scratch=scratch[b.block_id]).to_bytes()

    payloads = {b.block_id: encode(b) for b in blocks}
    frames = [result_frames(b.block_id, 123, payloads[b.block_id]) for b in blocks]
    quantized = [b for b in blocks if b.codec.bits]
    bodies = {b.block_id: wire.split_maxmin_body(np.frombuffer(payloads[b.block_id], np.uint8)[wire.HEADER_SIZE:],
                                                 b.numel, b.codec.bucket_size) for b in quantized}
    encoded = {b: (meta.copy(), levels.copy()) for b, (meta, levels) in bodies.items()}  # the kernel's output
    out = {b.block_id: torch.empty(b.numel) for b in blocks}
    seeds = [1_000_003 * b.block_id + 17 for b in blocks]
    # the encode kernel on one block's gradient again and again (in cache after the first), as
    # many elements as a step: the kernel's own cost, against its cost reading the step's 68 MB
    one = max(quantized, key=lambda b: b.numel)
    hot = [one] * round(sum(b.numel for b in quantized) / one.numel)
    stamped = {b.block_id: encode_block(x[b.block_id], Codec.MAXMIN if b.codec.bits else Codec.FP32,
                                        bits=b.codec.bits or 4, bucket_size=b.codec.bucket_size or 1024,
                                        stochastic=b.codec.stochastic, seed=b.block_id) for b in blocks}
    return {
        "result reading (communication)": (
            lambda: [read_result(f) for fs in frames for f in fs],
            lambda: [ps_pb2.ExchangeResponse.FromString(f).pull.data for fs in frames for f in fs]),
        "push frames: chunk_frames, the payload's second copy (communication)": (
            lambda: [chunk_frames(PUSH_FIELD, b.block_id, 123, payloads[b.block_id]) for b in blocks], None),
        "seed key (codec)": (lambda: [rng.seed_key(s) for s in seeds], lambda: [seed_key_numpy(s) for s in seeds]),
        f"span of the {len(single)} one-gradient blocks (training)": (
            lambda: [buffers.span(b, grads.get) for b in single], None),
        f"fill + copy_out of the {len(packed)} packed blocks (training)": (
            lambda: [(buffers.fill(b, grads.get), buffers.copy_out(b, grads.get)) for b in packed], None),
        "encode_block + to_bytes (codec)": (lambda: [encode(b) for b in blocks], None),
        "  of which the encode kernel": (
            lambda: [cpu.encode_maxmin_into(x[b.block_id].numpy(), *encoded[b.block_id], 4,
                                            b.codec.bucket_size, True, b.block_id) for b in quantized], None),
        f"  the encode kernel, one block's x in cache ({len(hot)} times)": (
            lambda: [cpu.encode_maxmin_into(x[b.block_id].numpy(), *encoded[b.block_id], 4,
                                            b.codec.bucket_size, True, b.block_id) for b in hot], None),
        "  of which to_bytes (crc32, header, copy)": (lambda: [e.to_bytes() for e in stamped.values()], None),
        "  of which the body's crc32": (lambda: [wire.body_crc32(e.payload) for e in stamped.values()], None),
        "  of which the payload's copy": (lambda: [e.payload.tobytes() for e in stamped.values()], None),
        "dequantize, scaled (codec)": (
            lambda: [dequantize(payloads[b.block_id], out=out[b.block_id], scale=0.5) for b in blocks], None),
        "  of which the decode kernel": (
            lambda: [cpu.decode_maxmin_into(*bodies[b.block_id], out[b.block_id].numpy(), False, 4,
                                            b.codec.bucket_size, 0.5) for b in quantized], None),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="mlp17m")
    parser.add_argument("--reps", type=int, default=30, help="steps' worth per piece and form (after one warm-up)")
    parser.add_argument("--fresh-pages", action="store_true", help="keep glibc's defaults (see the module doc)")
    args = parser.parse_args()
    if not args.fresh_pages:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: keep freed memory at the heap top
        libc.mallopt(-3, 1 << 26)  # M_MMAP_THRESHOLD: 0.5 MB buffers from the heap, not fresh mmaps
    torch.set_num_threads(1)
    cpu.set_num_threads(1)
    load = os.getloadavg()[0]
    table = pieces(args.model)
    times = {name: ([], []) for name in table}
    for rep in range(args.reps + 1):
        for name, (new, old) in table.items():
            forms = [(0, new), (1, old)] if rep % 2 else [(1, old), (0, new)]  # alternate the order
            for k, fn in forms:
                if fn is not None:
                    measured = thread_ms(fn)
                    if rep:
                        times[name][k].append(measured)
    print(f"{args.model}, one step's worth per piece, thread CPU ms, median of {args.reps} (old and new "
          f"alternated); load average {load:.2f} before, {os.getloadavg()[0]:.2f} after")
    print("| piece (thread) | before: ms (page faults) | after: ms (page faults) |")
    print("|---|---:|---:|")
    for name, forms in times.items():
        cells = [f"{statistics.median(ms for ms, _ in runs):.2f} ({statistics.median(n for _, n in runs):.0f})"
                 if runs else "(unchanged)" for runs in reversed(forms)]
        print(f"| {name} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
