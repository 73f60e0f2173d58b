"""Blocks from sorted parameter names: the same layout on every worker, by construction.

Tensors are ordered by name (never by the order hooks fire, which broke CGX's own hook when a
model ran other collectives), grouped by codec settings, concatenated and cut into blocks of
about ``block_bytes`` of fp32. Blocks go to shards by ``largest_first`` on their wire size, so
shards carry balanced bytes.
"""

from __future__ import annotations

import heapq
import math
import numbers
from dataclasses import dataclass, field
from fnmatch import fnmatch
from typing import Iterable, Sequence

import torch

from ...kernels.wire import MAX_BUCKET_SIZE
from ...model_layout import LayoutError, block_payload_size, validate_layout
from ...v1 import ps_pb2
from ..errors import ConfigError

__all__ = ["Compression", "TensorInfo", "build_layout", "merge_layouts", "largest_first", "DEFAULT_BLOCK_BYTES"]

DEFAULT_BLOCK_BYTES = 4 << 20  # fp32 bytes per block: big enough to amortize RPC, small to pipeline


@dataclass(frozen=True)
class Compression:
    """Which codec each tensor travels with.

    Defaults follow CGX: 4 bits, buckets of 1024, stochastic rounding; 1-D tensors and tensors
    under ``min_numel`` elements (biases, norms: small and sensitive) stay uncompressed.
    """

    bits: int | None = 4  # None: no quantization at all (fp32 everywhere)
    bucket_size: int = 1024
    stochastic: bool = True
    min_numel: int = 1024
    compress_1d: bool = False
    exclude: tuple[str, ...] = ()  # fnmatch patterns of names that stay uncompressed
    overrides: dict[str, int | None] = field(default_factory=dict)  # name pattern -> bits or None
    fallback: int = ps_pb2.CODEC_FP32  # codec of uncompressed tensors (FP32, FP16 or BF16)
    # layer-wise adaptive bits (issue #7): re-chosen every `interval` steps; blocks never span
    # two compressed tensors so each tensor's bits can change on its own
    adaptive: bool = False
    interval: int = 100
    # auto mode: compress only when it measurably pays (a model first, then measured step times)
    auto: bool = False

    def __post_init__(self) -> None:
        for b in [self.bits, *self.overrides.values()]:
            if b is not None and not (isinstance(b, numbers.Integral) and 1 <= b <= 8):
                raise ConfigError(f"bits must be in 1..8 or None, got {b!r}")
        if not 8 <= self.bucket_size <= MAX_BUCKET_SIZE or self.bucket_size % 8:
            raise ConfigError(f"bucket_size must be a multiple of 8 in 8..{MAX_BUCKET_SIZE}, got {self.bucket_size}")
        if self.fallback not in (ps_pb2.CODEC_FP32, ps_pb2.CODEC_FP16, ps_pb2.CODEC_BF16):
            raise ConfigError(f"fallback must be FP32, FP16 or BF16, got {self.fallback}")
        if self.interval < 1:
            raise ConfigError(f"interval must be >= 1 step, got {self.interval}")

    @classmethod
    def parse(cls, spec: "str | Compression | None") -> "Compression":
        """'4bit', '2bit', 'fp32', 'fp16', 'bf16' (or a Compression) -> Compression."""
        if isinstance(spec, Compression):
            return spec
        if spec is not None and not isinstance(spec, str):
            raise ConfigError(f"compression must be a string or a Compression, got {type(spec).__name__} {spec!r}")
        text = (spec or "4bit").strip().lower()
        mode, _, every = text.partition(":")  # "adaptive:50": re-decide every 50 steps
        if mode in ("adaptive", "auto") and (every == "" or every.isdigit() and int(every) > 0):
            return cls(adaptive=mode == "adaptive", auto=mode == "auto", interval=int(every or 100))
        if text in ("fp32", "none", "off"):
            return cls(bits=None)
        if text in ("fp16", "bf16"):
            return cls(bits=None, fallback=ps_pb2.CODEC_FP16 if text == "fp16" else ps_pb2.CODEC_BF16)
        if text.endswith("bit") and text[:-3].isdigit():
            return cls(bits=int(text[:-3]))
        raise ConfigError(f"unknown compression {spec!r}: use fp32, fp16, bf16, Nbit with N in 1..8, "
                         f"adaptive or auto")

    def settings_for(self, name: str, shape: Sequence[int]) -> ps_pb2.CodecSettings:
        bits = self.bits
        numel = math.prod(shape)
        if len(shape) <= 1 and not self.compress_1d or numel < self.min_numel:
            bits = None
        if any(fnmatch(name, p) for p in self.exclude):
            bits = None
        for pattern, value in self.overrides.items():
            if fnmatch(name, pattern):
                bits = value
        if bits is None:
            return ps_pb2.CodecSettings(codec=self.fallback)
        return ps_pb2.CodecSettings(codec=ps_pb2.CODEC_MAXMIN, bits=bits, bucket_size=self.bucket_size,
                                    stochastic=self.stochastic)


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> "TensorInfo":
        return cls(name, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."))


def build_layout(tensors: Iterable[TensorInfo], num_shards: int, compression: Compression | None = None,
                 block_bytes: int = DEFAULT_BLOCK_BYTES, allow_non_finite: bool = False) -> ps_pb2.Layout:
    """The blocks ``tensors`` travel in. ``allow_non_finite`` is declared with every tensor, so
    that the shards refuse a node (or local rank) that passed another value than the session's."""
    if num_shards < 1:
        raise ConfigError(f"a layout needs at least one shard, got num_shards={num_shards}")
    compression = compression or Compression()
    infos = sorted(tensors, key=lambda t: t.name)
    layout = ps_pb2.Layout(num_shards=num_shards)
    for t in infos:
        layout.tensors.add(name=t.name, shape=list(t.shape), dtype=t.dtype,
                           codec=compression.settings_for(t.name, t.shape), allow_non_finite=allow_non_finite)
    block_numel = max(1, block_bytes // 4)
    groups: dict[bytes, list[int]] = {}
    for i, spec in enumerate(layout.tensors):
        groups.setdefault(spec.codec.SerializeToString(deterministic=True), []).append(i)
    for members in groups.values():  # insertion order: first tensor name of each codec group
        compressed = layout.tensors[members[0]].codec.codec == ps_pb2.CODEC_MAXMIN
        if compression.adaptive and compressed:
            for index in members:  # one tensor per block: its bits can change on their own
                _cut_blocks(layout, [index], block_numel)
        else:
            _cut_blocks(layout, members, block_numel)
    _assign_shards(layout, num_shards)
    try:
        validate_layout(layout)
    except LayoutError as exc:  # the shared check's error, in the worker's own tree
        raise ConfigError(f"these tensors and options give no usable layout: {exc}") from exc
    return layout


def merge_layouts(parts: Sequence[ps_pb2.Layout]) -> tuple[ps_pb2.Layout, list[int]]:
    """One session's layout from several models' layouts (models trained in one process): part
    ``i``'s tensors are named ``model{i}/<name>``, its blocks follow the earlier parts' blocks,
    and keep their shards. Returns the layout and each part's first block id."""
    if len(parts) == 1:
        return parts[0], [0]
    merged = ps_pb2.Layout(num_shards=parts[0].num_shards)
    offsets = []
    for i, part in enumerate(parts):
        first_tensor = len(merged.tensors)
        offsets.append(len(merged.blocks))
        for t in part.tensors:
            merged.tensors.add().CopyFrom(t)
            merged.tensors[-1].name = f"model{i}/{t.name}"
        for b in part.blocks:
            block = merged.blocks.add()
            block.CopyFrom(b)
            block.block_id = offsets[-1] + b.block_id
            for seg in block.segments:
                seg.tensor_index += first_tensor
    try:
        validate_layout(merged)
    except LayoutError as exc:
        raise ConfigError(f"the models' layouts do not merge into one: {exc}") from exc
    return merged, offsets


def _cut_blocks(layout: ps_pb2.Layout, members: list[int], block_numel: int) -> None:
    """Concatenate the members' elements and cut them into blocks of block_numel."""
    codec = layout.tensors[members[0]].codec
    if codec.codec == ps_pb2.CODEC_MAXMIN:  # keep buckets whole inside blocks
        block_numel = max(codec.bucket_size, block_numel // codec.bucket_size * codec.bucket_size)
    block = None
    for index in members:
        numel = math.prod(layout.tensors[index].shape)
        offset = 0
        while offset < numel:
            if block is None or block.numel == block_numel:
                block = layout.blocks.add(block_id=len(layout.blocks), codec=codec)
            take = min(numel - offset, block_numel - block.numel)
            block.segments.add(tensor_index=index, offset=offset, numel=take)
            block.numel += take
            offset += take


def _assign_shards(layout: ps_pb2.Layout, num_shards: int) -> None:
    for block, shard in zip(layout.blocks, largest_first([block_payload_size(b) for b in layout.blocks], num_shards)):
        block.shard = shard


def largest_first(sizes: Sequence[int], bins: int) -> list[int]:
    """The bin of every item, so that bins carry balanced totals: longest-processing-time greedy
    (each item, largest first, to the least loaded bin; ties go to the lower item index and the
    lower bin, so every worker computes the same answer). Blocks to shards, blocks to local ranks."""
    loads = [(0, b) for b in range(bins)]
    heapq.heapify(loads)
    where = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        load, b = heapq.heappop(loads)
        where[i] = b
        heapq.heappush(loads, (load + sizes[i], b))
    return where
