"""Auto mode (``compression="auto"``): compress only when it measurably pays.

The first choice comes from the library's performance model (``cgx_ps.planning.model``, the one
``cgx-ps plan`` uses), fed by ``cgx_ps.planning.measured`` with what this job measured after step 0
(``measure``): the tensors and when each one's gradient arrived, the backward time, the upload
throughput to the shards (the probe, and the last step's pipeline), the codec's speed on this device
and the node count. It predicts the communication each mode leaves exposed after backward
(``AutoModel.exposed``), and auto mode compresses only if that makes the predicted step clearly
shorter (the margin measured steps need, ``keep_or_switch``). Where the uncompressed steps
skip the shards (an all_reduce on a process group: the optimizer's ``frontends/uncompressed.py``, the
DDP hook's DDP allreduce), the probe of the shards says nothing about them, so every front end's step
driver hands the tuner a probe of its uncompressed path (``AutoFigures.uncompressed_bps``:
``StepRouter.probe`` on that group, every rank at the same step), and the model predicts them as a
ring allreduce at that rate (``AutoModel``'s doc says why each path maps onto which option).

The model cannot see everything that competes for the machine (the transport's CPU cost per
byte, a colocated shard), so after that the step time decides (``ModeChooser``), built not to flap
on a noisy, shared machine (the recorded runs at a decision every 5 steps flipped modes whenever
one interval of the mode in use was slowed by others' load):

- each mode is judged by the median of its latest stretch of steps (up to ``_WINDOW``), not of
  one interval, so one slow interval moves it little;
- a switch needs a clear margin both ways (``keep_or_switch``): compressed steps at least 5%
  faster to start compressing, uncompressed ones 3% faster to stop; in between the mode in use
  stays;
- the other mode is tried for an interval only when the model finds it plausible (the step time
  now, less this mode's predicted exposed communication, plus the other's: at most 1.25x the
  current step time), and again after ``REEXPLORE`` decisions; every try that confirms
  the mode in use doubles that gap (up to 4x), so on a steady run the cost of re-trying shrinks
  while a change of conditions is still found.
"""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING, Mapping, Protocol

import torch

from ...kernels import dequantize, quantize
from ...kernels.wire import HEADER_SIZE, Codec, body_size
from ...planning.measured import AutoFigures, AutoModel, pipeline_rate, workload_of

if TYPE_CHECKING:
    from .tuner import Tunable

__all__ = ["AutoFigures", "AutoModel", "ModeChooser", "keep_or_switch", "measure", "REEXPLORE"]

_PROBE_BYTES = 4 << 20  # per shard: long enough to measure a 1 Gbit/s link (~35 ms)
_PIPELINE_MIN_BYTES = 4 << 20  # below this a step's transfer is latency-bound: its rate says little
REEXPLORE = 8  # decisions between re-measuring the mode not in use, at first (ModeChooser)
_REEXPLORE_MAX = 4 * REEXPLORE  # backed off to at most this on a steady run
_START_COMPRESSING = 0.95  # compressed steps must measure this much faster (exact gradients win near-ties)
_STOP_COMPRESSING = 0.97  # and uncompressed ones this much faster to stop: a band between, no flapping
_MIN_SAMPLES = 3  # step times a mode needs before its median is compared
_WINDOW = 6  # a mode's median covers the steps of at most its latest this many intervals (older: stale)
_PLAUSIBLE = 1.25  # explore the other mode only if the model predicts at most this x the current step time


class _Predicts(Protocol):  # AutoModel
    def exposed(self, compress: bool) -> float: ...  # a mode's predicted exposed communication
    def step_s(self, compress: bool) -> float: ...  # and its predicted step: backward + exposed


def measure(target: Tunable, quantized: list[int], uncompressed_bps: float = 0.0) -> AutoModel:
    """The model of both modes now, after a step; ``quantized``: the blocks max-min quantization
    compresses; ``uncompressed_bps``: the all_reduce rate of the uncompressed path, if it has one."""
    probe = target.probe(_PROBE_BYTES)
    # The probe sees the link; the last step saw the whole pipeline (CPU per byte in gRPC, the
    # shard's work, the pull). Trust the pipeline's rate when it moved enough bytes to be
    # bandwidth-bound rather than latency-bound.
    stats = target.stats
    pipeline = pipeline_rate(stats.bytes_pushed, stats.fp32_bytes, stats.comm_window_s) \
        if stats.bytes_pushed >= _PIPELINE_MIN_BYTES else 0.0
    throughput = min(probe, pipeline) if pipeline else probe
    layout = target.layout
    blocks = layout.blocks
    fp32 = sum(HEADER_SIZE + 4 * b.numel for b in blocks)
    settings = [target.settings(b.block_id) for b in blocks]
    compressed = sum(HEADER_SIZE + body_size(Codec(s.codec), b.numel, s.bits, s.bucket_size)
                     for b, s in zip(blocks, settings))
    bits = next((settings[b].bits for b in quantized), 4)
    q_numel = sum(blocks[b].numel for b in quantized)
    sample = torch.randn(min(max(q_numel, 1), 1 << 20))
    copy = torch.empty_like(sample)
    best, best_copy = float("inf"), float("inf")
    for _ in range(2):  # the first call pays for first-touch pages and thread start
        t0 = time.perf_counter()
        dequantize(quantize(sample, bits, stochastic=True), out=sample)
        t1 = time.perf_counter()
        copy.copy_(sample)  # what an fp32 result costs instead of a decode
        best, best_copy = min(best, t1 - t0), min(best_copy, time.perf_counter() - t1)
    codec_eps, copy_eps = (sample.numel() / s if s > 0 else 0.0 for s in (best, best_copy))
    config = target.config
    figures = AutoFigures(throughput, probe, pipeline, fp32, compressed, q_numel / codec_eps if codec_eps else 0.0,
                          stats.backward_s, uncompressed_bps, codec_eps, bits, config.num_nodes, config.world_size,
                          copy_eps)
    workload = workload_of([(t.name, tuple(t.shape)) for t in layout.tensors], stats.arrivals, stats.backward_s)
    return AutoModel(workload, figures)


def keep_or_switch(incumbent: bool, medians: Mapping[bool, float]) -> bool:
    """Hysteresis between the two modes' median step times: leave the incumbent mode only for a
    clear margin, a wider one to start compressing (exact gradients win near-ties), so a mode
    measured within the band of the other never makes auto switch back and forth."""
    other = not incumbent
    margin = _START_COMPRESSING if other else _STOP_COMPRESSING
    return other if medians[other] < margin * medians[incumbent] else incumbent


class ModeChooser:
    """Rank 0's choice between compressing and not: the model first, then measured step times
    (module doc). It depends only on the step times recorded and the predictions given (no clock,
    no I/O), so tests drive it directly."""

    def __init__(self) -> None:
        self.decisions = 0
        self.samples: list[float] = []  # step times of the current mode since the last decision
        # each mode's latest stretch: the step times of its last intervals (at most _WINDOW), and
        # the decision that last added to it
        self.windows: dict[bool, list[list[float]]] = {}
        self.measured_at: dict[bool, int] = {}
        self._stretch: bool | None = None  # the mode whose stretch the next steps continue
        self._incumbent: bool | None = None  # while exploring: the mode it left
        self._reexplore = REEXPLORE  # decisions between tries of the mode not in use (backs off)

    def record(self, step_s: float) -> None:
        self.samples.append(step_s)

    def state_dict(self) -> dict:
        """Plain data for a checkpoint: what was measured and where the exploration stands."""
        return {"decisions": self.decisions, "samples": list(self.samples),
                "windows": {int(mode): [list(i) for i in w] for mode, w in self.windows.items()},
                "measured_at": {int(mode): k for mode, k in self.measured_at.items()},
                "stretch": self._stretch, "incumbent": self._incumbent, "reexplore": self._reexplore}

    def load_state_dict(self, state: dict) -> None:
        """``state_dict()``'s output; a checkpoint of an older chooser (medians only) keeps its
        decision count and measures both modes afresh."""
        self.decisions, self.samples = int(state["decisions"]), [float(s) for s in state["samples"]]
        self.windows, self.measured_at, self._stretch, self._incumbent = {}, {}, None, None
        self._reexplore = REEXPLORE
        if "windows" not in state:
            return
        self.windows = {bool(int(m)): [[float(s) for s in i] for i in w] for m, w in state["windows"].items()}
        self.measured_at = {bool(int(m)): int(k) for m, k in state["measured_at"].items()}
        stretch, incumbent = state["stretch"], state["incumbent"]
        self._stretch = None if stretch is None else bool(stretch)
        self._incumbent = None if incumbent is None else bool(incumbent)
        self._reexplore = int(state["reexplore"])

    def medians(self) -> dict[str, float]:
        """The median step time of each mode's latest stretch."""
        return {("compressed" if mode else "uncompressed"): s for mode, s in self._medians().items()}

    def _medians(self) -> dict[bool, float]:
        return {mode: statistics.median(s for i in w for s in i) for mode, w in self.windows.items() if w}

    def choose(self, current: bool, model: _Predicts) -> tuple[bool, str]:
        """Compress or not from now on, and why; ``current``: whether the steps recorded did;
        ``model``: both modes predicted for the step just measured (``measure``)."""
        k, self.decisions = self.decisions, self.decisions + 1
        samples, self.samples = self.samples, []
        if k == 0:  # predicted steps, with the measured steps' margin: exact gradients win near-ties
            return keep_or_switch(False, {mode: model.step_s(mode) for mode in (True, False)}), "model"
        if not samples:
            return current, "no step measured since the last decision"
        self._extend(current, samples, k)
        measured = sum(map(len, self.windows[current]))
        if measured < _MIN_SAMPLES:  # too few steps to judge this mode yet: go on
            return current, f"too few steps measured yet ({measured} of {_MIN_SAMPLES})"
        medians, other = self._medians(), not current
        exploring, self._incumbent = self._incumbent, None
        if exploring == other and other in medians:
            # a try ends: the explored mode only for a clear win over the one left; either way the
            # next scheduled try comes later (bounded cost on a steady run)
            self._reexplore = min(2 * self._reexplore, _REEXPLORE_MAX)
            choice = keep_or_switch(other, medians)
            if choice == other:
                self._stretch = other  # back to the mode left: its stretch goes on
            return choice, "measured"
        if other not in medians or k - self.measured_at[other] >= self._reexplore:
            now = medians[current]
            predicted = now - model.exposed(current) + model.exposed(other)
            if predicted <= _PLAUSIBLE * now:
                self._incumbent = current
                return other, f"measuring the other mode (the model predicts {predicted * 1e3:.0f} ms/step)"
            if other not in medians:
                return current, f"model rules the other mode out ({predicted * 1e3:.0f} ms/step predicted)"
        if keep_or_switch(current, medians) == other:
            # the mode in use got slower than the other's last measurement: measure the other
            # afresh before switching (a stale or lucky figure alone never switches)
            self._incumbent = current
            return other, f"measuring the other mode (it measured {medians[other] * 1e3:.0f} ms/step)"
        return current, "measured"

    def _extend(self, mode: bool, samples: list[float], k: int) -> None:
        """Add the steps since the last decision to ``mode``'s stretch (a new stretch when the
        steps before were of the other mode, unless that was a try of it that failed)."""
        stretch = self.windows[mode] if self._stretch == mode else []
        self.windows[mode], self.measured_at[mode], self._stretch = [*stretch, samples][-_WINDOW:], k, mode
