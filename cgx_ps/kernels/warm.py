"""Compile and load every CPU kernel a shard round and a worker step use, once.

numba compiles the kernels on first use and caches them next to the sources (``__pycache__``).
A cold compile takes 60-90 s on a 2-core machine, so a shard runs this before it serves (its
first rounds would otherwise stall), and ``scripts/test.sh`` runs it once up front (``python -m
cgx_ps.kernels.warm``) so that concurrent test processes load from the cache instead of each
compiling. Images do not ship a cache: numba's cache is keyed to the CPU it was compiled on.
"""

from __future__ import annotations

import time

import torch

from .decoding import dequantize
from .feedback import ErrorFeedback, encode_block
from .summation import EncodedSum
from .wire import Codec

__all__ = ["warm_kernels"]


def warm_kernels() -> None:
    """Run every kernel a round uses once, on a tiny block."""
    values = torch.linspace(-1.0, 1.0, 1024)
    # FP16 and BF16: mixed precision's gradients, whose non-finite scan is its own kernel
    for codec, bits in ((Codec.MAXMIN, 4), (Codec.FP32, 32), (Codec.FP16, 16), (Codec.BF16, 16)):
        for stochastic in (False, True):
            payload = encode_block(values, codec, bits=bits, bucket_size=512, stochastic=stochastic, seed=1,
                                   feedback=ErrorFeedback()).to_bytes()
            total = EncodedSum(1024, parts=2)  # the round's sum (server/rounds/aggregator.py)
            total.add(payload)
            total.add(payload)
            total.encode(codec, bits=bits, bucket_size=512, stochastic=stochastic, seed=1, feedback=ErrorFeedback())
            dequantize(payload, out=torch.empty_like(values))  # a worker's decode


if __name__ == "__main__":
    started = time.perf_counter()
    warm_kernels()
    print(f"cgx-ps kernels ready in {time.perf_counter() - started:.1f} s")
