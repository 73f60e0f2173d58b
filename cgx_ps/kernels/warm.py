"""Compile (or load from numba's cache) the CPU kernels a job needs before it needs them.

numba compiles a kernel on its first call and caches it on disk (``__pycache__`` next to the
sources, or ``NUMBA_CACHE_DIR``). Each bit width has kernels of its own (``cpu_loops``), so a
process compiles only the widths it meets: cold, a shard's 4-bit summing kernel takes about 4 s
of one core and a worker's 4-bit encoding and decoding kernels about 3.5 s (every width: 25-35 s),
loading them from the cache about a second (benchmarks/cold_start.py).

- ``warm_in_background(bits, role)``: a shard starts it for the default width as it starts
  serving, a worker for its compression's widths as it sets up; a round that needs a kernel still
  being compiled waits for it (numba compiles under one lock), and any other width is compiled
  lazily on first use.
- ``warm_kernels()``: every width, now (``python -m cgx_ps.kernels.warm``): ``scripts/test.sh``
  runs it once so that concurrent test processes load every kernel from the cache.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from typing import Iterable, Literal, Optional

import numpy as np

from . import cpu
from .decoding import dequantize
from .encoding import EncodedBlock
from .feedback import ErrorFeedback, encode_block
from .prebuilt import seed_once, write_manifest
from .summation import EncodedSum
from .wire import HEADER_SIZE, Codec, Header, pack_header, split_maxmin_body

__all__ = ["ALL_WIDTHS", "DEFAULT_WIDTH", "Role", "warm_in_background", "warm_kernels", "warm_width"]

ALL_WIDTHS = tuple(range(1, 9))
DEFAULT_WIDTH = 4  # the workers' default compression, "4bit" (worker/pipeline/blocks.py)
Role = Literal["shard", "worker", "both"]

log = logging.getLogger(__name__)


def warm_width(bits: int, role: Role = "both") -> None:
    """Run, on a tiny block, every kernel a round of ``bits``-bit max-min quantization uses in a
    shard (validating pushes, summing and re-encoding them) or a worker (encoding with error
    feedback, validating and decoding the result). The arrays are numpy's, whose memory the
    kernels see as they see a torch tensor's: one compiled kernel serves both."""
    cpu.first_bad_meta(np.zeros(2, dtype=np.float32), bits)
    if role == "shard":  # a push as a worker sends it; a shard compiles no encoding kernel of its own
        push = _constant_push(bits, 1024, 512)
    else:  # the encoding, and the decoding into the residual
        push = encode_block(np.linspace(-1.0, 1.0, 1024, dtype=np.float32), Codec.MAXMIN, bits=bits,
                            bucket_size=512, stochastic=True, seed=1, feedback=ErrorFeedback()).to_bytes()
    if role in ("shard", "both"):
        total = EncodedSum(1024, parts=2)  # the round's sum (server/rounds/aggregator.py)
        total.add(push)
        total.add(push)
        total.encode(Codec.MAXMIN, bits=bits, bucket_size=512, stochastic=True, seed=1, feedback=ErrorFeedback())


def _constant_push(bits: int, numel: int, bucket_size: int) -> bytes:
    """A valid max-min payload without an encoding kernel: every bucket's levels 0, min -1, unit 1."""
    header = Header(Codec.MAXMIN, bits, 0, numel, bucket_size, 0)
    payload = np.zeros(HEADER_SIZE + header.body_size, dtype=np.uint8)
    payload[:HEADER_SIZE] = np.frombuffer(pack_header(header), dtype=np.uint8)
    meta = split_maxmin_body(payload[HEADER_SIZE:], numel, bucket_size)[0]
    meta[0::2], meta[1::2] = -1.0, 1.0
    return EncodedBlock(header, payload).to_bytes()


def warm_kernels(widths: Iterable[int] = ALL_WIDTHS) -> None:
    """Every kernel of these widths, and the float codecs' non-finite scans, now."""
    values = np.linspace(-1.0, 1.0, 1024, dtype=np.float32)
    for codec, bits in ((Codec.FP32, 32), (Codec.FP16, 16), (Codec.BF16, 16)):  # mixed precision's gradients
        dequantize(encode_block(values, codec, bits=bits, bucket_size=512, stochastic=False, seed=1).to_bytes(),
                   out=np.empty_like(values))
    for bits in widths:
        warm_width(bits)


def warm_in_background(widths: Iterable[int], role: Role) -> threading.Thread:
    """Copy the prebuilt kernels in (``prebuilt.py``), then start a daemon thread that warms these
    widths' kernels for ``role``: loads them from the cache, or compiles them. A failure is logged
    (the kernel is then compiled on first use, where its error surfaces)."""
    widths = tuple(widths)
    seed_once()

    def run() -> None:
        started = time.perf_counter()
        try:
            for bits in widths:
                warm_width(bits, role)
        except Exception:  # noqa: BLE001 - a warm-up must never take the process down
            log.exception("warming the %s kernels of widths %s failed", role, widths)
            return
        # debug: an operator's log says what the shard does, and this is the same every start
        log.debug("kernels of widths %s ready for the %s in %.1f s", widths, role, time.perf_counter() - started)

    thread = threading.Thread(target=run, name="cgx-kernel-warm", daemon=True)
    thread.start()
    # A daemon thread cut off inside numba's compiler as the interpreter exits aborts the process
    # (SIGABRT, exit -6): a process that ends within seconds of its start (a shard stopped at
    # once, a worker whose setup failed) waits for the compile first, a few seconds at most.
    atexit.register(thread.join)
    return thread


def main(argv: Optional[list[str]] = None) -> None:
    """``python -m cgx_ps.kernels.warm``: compile every width now. With ``NUMBA_CACHE_DIR`` set,
    also record the CPU they were compiled for, so that the directory can serve as a prebuilt
    cache (``CGX_PS_KERNEL_CACHE``, as the container image does)."""
    import argparse

    from numba.core import config

    parser = argparse.ArgumentParser(prog="python -m cgx_ps.kernels.warm", description=main.__doc__.split("\n")[0])
    parser.add_argument("--widths", type=int, nargs="+", choices=ALL_WIDTHS, default=list(ALL_WIDTHS),
                        help="the bit widths to compile (default: all)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    seed_once()
    warm_kernels(args.widths)
    where = ""
    if config.CACHE_DIR:
        where = f"; {write_manifest(config.CACHE_DIR)} written"
    print(f"cgx-ps kernels ready in {time.perf_counter() - started:.1f} s{where}")


if __name__ == "__main__":
    main()
