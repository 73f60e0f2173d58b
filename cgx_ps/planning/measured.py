"""The performance model (``model.py``) fed with what a running job measured: auto mode's first choice.

Auto mode (``cgx_ps/worker/tuning/auto_mode.py``) measures after a step what the model needs (``AutoFigures``:
the rate of the shards' path and, where uncompressed steps all-reduce over a process group, of that group; the
codec's speed on this device; the node and rank counts) and the step itself (the tensors, when each gradient
arrived, the backward time). This module turns them into the model's ``Workload``, ``Cluster`` and ``Speeds``
and predicts both modes with ``model.predict`` (``AutoModel``): one model for ``cgx-ps plan`` and auto mode.

Measured rates stand in for the model's link rates, so that the model's stages take what was measured: no
framing overhead (``wire_efficiency=1``), no latency (a probe of megabytes includes it), and the shards' CPU
in the measured rate (the pipeline's rate is that of pushes through the shards and back).
Pure functions, no torch and no clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Mapping, Sequence

from .model import CGX_BLOCK_BYTES, Cluster, Prediction, Speeds, Tensor, Workload, predict

__all__ = ["AutoFigures", "AutoModel", "allreduce_cluster", "pipeline_rate", "shards_cluster", "speeds_of",
           "workload_of"]

_SLOWEST_BPS = 1.0  # a rate that could not be measured counts as a very slow link (the model needs one > 0)


@dataclass(frozen=True)
class AutoFigures:
    """What auto mode measured for a decision, per step of this node (plain data: decisions carry it)."""

    throughput_bps: float  # the shards' path, bytes/s each way: min of the probe and what the pipeline achieved
    probe_bps: float  # measured upload bytes/s to all shards together
    pipeline_bps: float  # the last step's rate through the shards (``pipeline_rate``); 0 if unknown
    fp32_bytes: int  # the gradient uncompressed
    compressed_bytes: int  # the gradient at the configured bits
    codec_s: float  # encode + decode of the compressed blocks on this device
    overlap_s: float  # backward time that communication can hide behind (first to last gradient)
    # uncompressed steps through an all_reduce: bytes all-reduced per second (measured on the
    # group); 0: they go through the shards at ``throughput_bps``
    uncompressed_bps: float = 0.0
    codec_eps: float = 0.0  # elements encoded and decoded per second (wall) on this device; 0: unknown
    bits: int = 4  # the compressed steps' bits
    nodes: int = 1  # cgx-ps nodes, each pushing to the shards
    ranks: int = 1  # processes in the job: the process group of the uncompressed all_reduce
    copy_eps: float = 0.0  # fp32 elements copied per second on this device (an fp32 result's copy-out); 0: unknown


def pipeline_rate(bytes_pushed: int, fp32_bytes: int, window_s: float) -> float:
    """The link rate (bytes/s) at which the model's pipeline of a step's blocks takes ``window_s`` from the
    first push to the last result: the pushes back to back, then the last block's result, so
    (bytes + one block) / window, a block being ``CGX_BLOCK_BYTES`` of fp32 at the step's compression ratio.
    0 when the step measured nothing."""
    if window_s <= 0 or bytes_pushed <= 0:
        return 0.0
    block = CGX_BLOCK_BYTES * bytes_pushed / fp32_bytes if fp32_bytes > 0 else bytes_pushed
    return (bytes_pushed + min(bytes_pushed, block)) / window_s


def workload_of(tensors: Sequence[tuple[str, Sequence[int]]], arrivals: Mapping[str, float],
                backward_s: float) -> Workload:
    """A measured step as the model's workload. ``tensors``: (name, shape) of every tensor the job averages;
    ``arrivals``: when each tensor's gradient arrived, seconds on any clock; ``backward_s``: the first to the
    last gradient. The tensors go in arrival order, each one's ``compute`` the time since the one before, so
    the model's ready times are the measured ones (scaled to ``backward_s``); tensors that got no gradient
    come last, at the end of backward. Without arrivals, the reverse of ``tensors``' order split by elements
    (the model's default). Only backward is modelled (``compute_s=backward_s``, ``overlap=1``): nothing is
    sent during forward, and both modes' steps share it, so it cancels out of the comparison."""
    shapes = dict((name, tuple(shape)) for name, shape in tensors)
    if not arrivals:
        ordered = tuple(Tensor(name, shapes[name]) for name, _ in reversed(tensors))
        return Workload("measured", ordered, max(0.0, backward_s), overlap=1.0)
    seen = sorted((t, name) for name, t in arrivals.items() if name in shapes)
    ordered_list, previous = [], seen[0][0] if seen else 0.0
    for t, name in seen:
        ordered_list.append(Tensor(name, shapes[name], t - previous))
        previous = t
    ordered_list += [Tensor(name, shapes[name], 0.0) for name, _ in tensors if name not in arrivals]
    return Workload("measured", tuple(ordered_list), max(0.0, backward_s), overlap=1.0)


def shards_cluster(f: AutoFigures) -> Cluster:
    """The shards' path at the measured rate: one shard per node on hosts of their own (S = n), where the
    model charges a block's push and its result wire bytes / link rate each (``ps_link_seconds``), so the
    rate is the measured one whether the shards are colocated or not (the measurement saw where they are)."""
    nodes = max(1, f.nodes)
    return Cluster(nodes, 8 * max(f.throughput_bps, _SLOWEST_BPS), shards=nodes, wire_efficiency=1.0,
                   latency_s=0.0)


def allreduce_cluster(f: AutoFigures) -> Cluster:
    """The process group of the uncompressed all_reduce: ``ranks`` on a ring whose link rate makes one
    all_reduce of X bytes take X / ``uncompressed_bps``, as probed (the ring's 2 (N - 1) / N folded in)."""
    ranks = max(1, f.ranks)
    ring = 2 * (ranks - 1) / ranks if ranks > 1 else 1.0
    return Cluster(ranks, 8 * ring * max(f.uncompressed_bps, _SLOWEST_BPS), wire_efficiency=1.0, latency_s=0.0)


def speeds_of(f: AutoFigures) -> Speeds:
    """The codec at its measured wall-clock speed (encode and decode taken as equally fast, on the threads
    the measurement used: ``codec_threads=1``), and an fp32 result's copy-out at the measured copy speed: not
    the codec's, or a slow codec would slow the uncompressed steps' results as much and never count against
    compressing. The shards' CPU is in the measured rate, not a stage of its own (``shard_ingest_Bps``
    infinite). What was not measured keeps the model's defaults."""
    copy = f.copy_eps if f.copy_eps > 0 else None
    if f.codec_eps <= 0:
        return Speeds(shard_ingest_Bps=math.inf, copy_eps=copy)
    return Speeds(encode_eps=2 * f.codec_eps, decode_eps=2 * f.codec_eps, codec_threads=1,
                  shard_ingest_Bps=math.inf, copy_eps=copy)


@dataclass(frozen=True)
class AutoModel:
    """Both of auto mode's modes predicted by ``model.predict`` for a measured step.

    Compressed steps always go through the shards: ``cgx-{bits}bit`` on ``shards_cluster``. Uncompressed
    steps take one of two paths, and each maps onto the model's option for that path:

    - without a process group (``uncompressed_bps == 0``) they are the shards' fp32 path: ``cgx-fp32`` on the
      same cluster and speeds, so the two modes differ by exactly what compression changes, the bytes and the
      codec;
    - with one they skip the shards for an all_reduce on the group (the optimizer's per block as backward
      completes it, the DDP hook's DDP buckets): ``ddp-fp32``, a ring allreduce per bucket in backward order,
      on ``allreduce_cluster``, whose rate is the group's probe, not the shards' (the shards' rate says
      nothing about it: through gRPC it once predicted 2.3 s for a step DDP's allreduce took 0.38 s).
    """

    workload: Workload
    figures: AutoFigures

    def option(self, compress: bool) -> str:
        if compress:
            return f"cgx-{self.figures.bits}bit"
        return "ddp-fp32" if self.figures.uncompressed_bps > 0 else "cgx-fp32"

    @cached_property
    def _predictions(self) -> dict[bool, Prediction]:
        f, speeds = self.figures, speeds_of(self.figures)
        return {mode: predict(self.workload, allreduce_cluster(f) if self.option(mode) == "ddp-fp32"
                              else shards_cluster(f), speeds, self.option(mode)) for mode in (True, False)}

    def prediction(self, compress: bool) -> Prediction:
        return self._predictions[compress]

    def exposed(self, compress: bool) -> float:
        """The communication a step in this mode leaves exposed after backward, in seconds."""
        return self._predictions[compress].exposed_comm_s

    def step_s(self, compress: bool) -> float:
        """A step in this mode as modelled: backward, then the exposed communication (forward is left out)."""
        return self._predictions[compress].step_s
