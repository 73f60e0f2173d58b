"""The model layout both sides agree on: tensors, blocks, codecs (shared by server and worker).

A layout is a ``cgx_ps.v1.Layout`` message. Its hash is the sha256 of its deterministic
serialization; nodes declare it at Register and the shard refuses any node whose layout differs,
naming the first differing tensor.
"""

from __future__ import annotations

import hashlib

from .kernels import HEADER_SIZE, Codec, CodecError, body_size
from .kernels.wire import validate_settings
from .v1 import ps_pb2

__all__ = ["LayoutError", "layout_hash", "first_difference", "validate_layout", "block_payload_size",
           "codec_of"]


class LayoutError(ValueError):
    """A layout is malformed, or differs from the one the session was started with."""


def layout_hash(layout: ps_pb2.Layout) -> str:
    return hashlib.sha256(layout.SerializeToString(deterministic=True)).hexdigest()


def codec_of(settings: ps_pb2.CodecSettings) -> Codec:
    try:
        return Codec(settings.codec)
    except ValueError:
        raise LayoutError(f"unknown codec id {settings.codec}") from None


def block_payload_size(block: ps_pb2.BlockSpec) -> int:
    """Exact wire size of one encoded block: header plus body for its codec and numel."""
    codec = codec_of(block.codec)
    return HEADER_SIZE + body_size(codec, block.numel, block.codec.bits, block.codec.bucket_size)


def _settings_text(s: ps_pb2.CodecSettings) -> str:
    name = ps_pb2.Codec.Name(s.codec) if s.codec in ps_pb2.Codec.values() else str(s.codec)
    if s.codec == ps_pb2.CODEC_MAXMIN:
        return f"{name}(bits={s.bits}, bucket={s.bucket_size}, stochastic={s.stochastic})"
    return name


def first_difference(expected: ps_pb2.Layout, got: ps_pb2.Layout) -> str | None:
    """A human-readable description of the first difference, or None when equal."""
    for i, (a, b) in enumerate(zip(expected.tensors, got.tensors)):
        if a.name != b.name:
            return f"tensor #{i}: expected {a.name!r}, got {b.name!r}"
        if list(a.shape) != list(b.shape):
            return f"tensor {a.name!r}: shape {list(a.shape)} expected, got {list(b.shape)}"
        if a.dtype != b.dtype:
            return f"tensor {a.name!r}: dtype {a.dtype} expected, got {b.dtype}"
        if a.codec != b.codec:
            return (f"tensor {a.name!r}: codec {_settings_text(a.codec)} expected, "
                    f"got {_settings_text(b.codec)}")
        if a.allow_non_finite != b.allow_non_finite:
            return (f"tensor {a.name!r}: allow_non_finite={b.allow_non_finite}, the session's nodes passed "
                    f"allow_non_finite={a.allow_non_finite}: every rank must pass the same (a NaN/Inf gradient "
                    f"would end the step differently on each)")
    if len(expected.tensors) != len(got.tensors):
        n = min(len(expected.tensors), len(got.tensors))
        extra = (expected.tensors if len(expected.tensors) > n else got.tensors)[n].name
        side = "missing" if len(expected.tensors) > n else "unexpected extra"
        return (f"{len(got.tensors)} tensors, expected {len(expected.tensors)}: "
                f"{side} tensor {extra!r}")
    if expected.num_shards != got.num_shards:
        return f"num_shards {got.num_shards}, expected {expected.num_shards}"
    if expected.blocks != got.blocks:
        for a, b in zip(expected.blocks, got.blocks):
            if a != b:
                return f"block {a.block_id} differs (same tensors, different block size or sharding?)"
        return f"{len(got.blocks)} blocks, expected {len(expected.blocks)}"
    return None


def validate_layout(layout: ps_pb2.Layout) -> None:
    """Check a layout is internally consistent; raise LayoutError naming the first problem."""
    if layout.num_shards < 1:
        raise LayoutError("num_shards must be >= 1")
    names = [t.name for t in layout.tensors]
    if len(set(names)) != len(names):
        raise LayoutError("tensor names are not unique")
    covered = [0] * len(layout.tensors)
    for i, block in enumerate(layout.blocks):
        if block.block_id != i:
            raise LayoutError(f"block ids must be 0..{len(layout.blocks) - 1} in order; "
                              f"position {i} has id {block.block_id}")
        if block.shard >= layout.num_shards:
            raise LayoutError(f"block {i}: shard {block.shard} >= num_shards {layout.num_shards}")
        try:
            validate_settings(codec_of(block.codec), block.codec.bits, block.codec.bucket_size)
        except CodecError as exc:
            raise LayoutError(f"block {i}: {exc}") from None
        total = 0
        for seg in block.segments:
            if seg.tensor_index >= len(layout.tensors):
                raise LayoutError(f"block {i}: tensor index {seg.tensor_index} out of range")
            tensor = layout.tensors[seg.tensor_index]
            if seg.offset != covered[seg.tensor_index]:
                raise LayoutError(f"block {i}: segment of {tensor.name!r} starts at {seg.offset}, "
                                  f"expected {covered[seg.tensor_index]}")
            covered[seg.tensor_index] += seg.numel
            total += seg.numel
        if total != block.numel:
            raise LayoutError(f"block {i}: segments hold {total} elements, numel says {block.numel}")
    for tensor, n in zip(layout.tensors, covered):
        if any(d < 0 for d in tensor.shape):
            raise LayoutError(f"tensor {tensor.name!r}: negative dimension in shape {list(tensor.shape)}")
        expected = 1
        for d in tensor.shape:
            expected *= d
        if n != expected:
            raise LayoutError(f"tensor {tensor.name!r}: blocks cover {n} of {expected} elements")
