"""Plain-torch reference of the max-min codec: clear, slow, and the definition tests check against.

Every step is one whole-tensor float32 operation, in the order the wire format specifies, so the
fused CPU kernel and the CUDA kernel must reproduce its bytes exactly.
"""

from __future__ import annotations

import torch

from . import rng

__all__ = ["encode_maxmin", "decode_maxmin"]


def encode_maxmin(
    x: torch.Tensor, bits: int, bucket_size: int, stochastic: bool, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (meta float32 [num_buckets, 2] of (min, unit), packed levels uint8)."""
    n = x.numel()
    nb = -(-n // bucket_size)
    if n == 0:
        return torch.zeros(0, 2), torch.zeros(0, dtype=torch.uint8)
    pad = nb * bucket_size - n
    # Pad the last bucket with its own first element: it changes neither its min nor its max.
    tail = x[(nb - 1) * bucket_size].expand(pad)
    buckets = torch.cat([x, tail]).view(nb, bucket_size)
    # "+ 0.0" turns a -0.0 extreme into +0.0, so the stored min never depends on which zero
    # an implementation's min() happened to keep.
    mn = buckets.amin(dim=1, keepdim=True) + 0.0
    mx = buckets.amax(dim=1, keepdim=True) + 0.0
    max_level = float((1 << bits) - 1)
    unit = (mx - mn) / torch.full_like(mn, max_level)
    if not torch.isfinite(unit).all():
        raise OverflowError("bucket range overflows float32")
    scale = torch.where(unit > 0, torch.reciprocal(unit), torch.zeros_like(unit))
    # A subnormal unit makes 1/unit overflow: such a bucket encodes like a constant one (all
    # levels 0, decoded as min; the error is below 2**-126 * max_level).
    scale = torch.where(torch.isinf(scale), torch.zeros_like(scale), scale)
    if stochastic:
        r = torch.from_numpy(rng.uniforms(seed, 0, nb * bucket_size)).view(nb, bucket_size)
    else:
        r = torch.full_like(buckets, 0.5)
    t = (buckets - mn) * scale + r
    levels = torch.floor(t).clamp_(0.0, max_level).to(torch.int64).view(-1)[:n]
    meta = torch.cat([mn, unit], dim=1)
    return meta, _pack(levels, bits)


def decode_maxmin(
    meta: torch.Tensor, packed: torch.Tensor, numel: int, bits: int, bucket_size: int
) -> torch.Tensor:
    """Decode to a float32 tensor of ``numel`` elements: min + unit * level, per bucket."""
    if numel == 0:
        return torch.zeros(0)
    levels = _unpack(packed, numel, bits).to(torch.float32)
    bucket_of = torch.arange(numel) // bucket_size
    mn, unit = meta[bucket_of, 0], meta[bucket_of, 1]
    return mn + unit * levels


def _pack(levels: torch.Tensor, bits: int) -> torch.Tensor:
    """LSB-first bit stream: bit j of element i lands at stream bit i * bits + j."""
    stream = ((levels.unsqueeze(1) >> torch.arange(bits)) & 1).view(-1)
    stream = torch.cat([stream, stream.new_zeros(-stream.numel() % 8)])
    weights = 1 << torch.arange(8)
    return (stream.view(-1, 8) * weights).sum(dim=1).to(torch.uint8)


def _unpack(packed: torch.Tensor, numel: int, bits: int) -> torch.Tensor:
    stream = ((packed.to(torch.int64).unsqueeze(1) >> torch.arange(8)) & 1).view(-1)
    stream = stream[: numel * bits].view(numel, bits)
    return (stream << torch.arange(bits)).sum(dim=1)
