"""``cgx-ps codec-demo``: what compression does to one gradient-sized tensor (size, error, speed)."""

from __future__ import annotations

import argparse
import time

import torch

from ..kernels import Codec, dequantize, encode

__all__ = ["run_codec_demo"]


def run_codec_demo(args: argparse.Namespace) -> int:
    """``cgx-ps codec-demo``: encode a random gradient of ``--numel`` elements with every codec
    and print each one's size, compression ratio, relative error and encode/decode times.

    Args:
        args: the parsed flags of ``cgx-ps codec-demo`` (``numel``, ``bucket_size``).

    Returns:
        The exit status, 0.
    """
    x = torch.randn(args.numel) * 1e-3
    fp32_bytes = 4 * args.numel
    print(f"gradient: {args.numel:,} float32 elements = {fp32_bytes / 1e6:.1f} MB")
    print(f"{'codec':18} {'MB':>8} {'ratio':>6} {'rel. L2 error':>14} {'encode ms':>10} {'decode ms':>10}")
    settings = [("fp32", Codec.FP32, 32, False), ("fp16", Codec.FP16, 16, False),
                ("bf16", Codec.BF16, 16, False)]
    settings += [(f"{b}-bit stochastic", Codec.MAXMIN, b, True) for b in (8, 4, 2)]
    settings += [("4-bit nearest", Codec.MAXMIN, 4, False)]
    for name, codec, bits, stochastic in settings:
        encode(x[:4096], codec, bits=bits, stochastic=stochastic)  # compile kernels first
        t0 = time.perf_counter()
        block = encode(x, codec, bits=bits, bucket_size=args.bucket_size, stochastic=stochastic, seed=1)
        t1 = time.perf_counter()
        y = dequantize(block)
        t2 = time.perf_counter()
        size = block.nbytes
        err = float((x - y).norm() / x.norm())
        print(f"{name:18} {size / 1e6:8.2f} {fp32_bytes / size:6.1f} {err:14.4f} "
              f"{(t1 - t0) * 1e3:10.1f} {(t2 - t1) * 1e3:10.1f}")
    return 0
