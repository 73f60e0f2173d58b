"""Choosing compression while training: layer-wise adaptive bits and the auto on/off mode.

One place decides, rank 0, and every rank applies the decision at the same step boundary:

1. rank 0 computes the decision after ``step()`` of step s (the gradients there are the averaged
   ones, identical on every rank);
2. for new bit widths, it announces them to every shard with SetCodecs, effective from the next
   round, and waits for every shard to accept (so no push of that round can be refused);
3. it publishes the decision through shard 0's blob store under ``tune/<s>``; every other rank
   reads it at the same step boundary before its next backward.

Adaptive bits (``compression="adaptive"``): every ``interval`` steps, estimate for each compressed
tensor and each candidate bit width the error of quantizing the running average of its gradient
and its size, and solve the multiple-choice knapsack (``adaptive.choose_bits``): fewest bytes at
no more error than uniform 4 bits.

Auto (``compression="auto"``): the first choice comes from a model (after step 0, measure the
upload throughput to the shards and the codec's cost on this device, predict the communication
each choice leaves exposed after overlapping with backward). The model cannot see everything
that competes for the machine (the transport's CPU cost per byte, a colocated shard), so after
that the step time decides: every ``interval`` steps rank 0 records the median step time of the
current mode, tries the other mode for one interval when the model says it could plausibly be
faster (and again every ``REEXPLORE`` decisions, as conditions change), and compresses only if
compressed steps measured at least 5% faster than uncompressed ones.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass

import torch

from ..kernels import dequantize, quantize
from ..kernels.wire import HEADER_SIZE, Codec, body_size
from ..v1 import ps_pb2
from .adaptive import DEFAULT_CANDIDATES, RunningAverage, choose_bits, estimate_tensor
from .broadcast import broadcast_object

__all__ = ["Tuner", "AutoFigures", "predict_exposed"]

log = logging.getLogger(__name__)

_PROBE_BYTES = 4 << 20  # per shard: long enough to measure a 1 Gbit/s link (~35 ms)
_PIPELINE_MIN_BYTES = 4 << 20  # below this a step's transfer is latency-bound: its rate says little
REEXPLORE = 8  # decisions between re-measuring the mode not in use
_COMPRESS_MARGIN = 0.95  # compressed steps must be measured this much faster (exact gradients win ties)
_PLAUSIBLE = 1.25  # explore the other mode only if the model predicts at most this x the current step time


@dataclass(frozen=True)
class AutoFigures:
    """What auto mode decides from, per step of this node."""

    throughput_bps: float  # the rate used: min of the probe and what the pipeline achieved
    probe_bps: float  # measured upload bytes/s to all shards together
    pipeline_bps: float  # 2 x bytes pushed / (first push to last result) of the last step; 0 if unknown
    fp32_bytes: int  # the gradient uncompressed
    compressed_bytes: int  # the gradient at the configured bits
    codec_s: float  # encode + decode of the compressed blocks on this device
    overlap_s: float  # backward time that communication can hide behind

    def exposed(self, compress: bool) -> float:
        return predict_exposed(self, compress)


def predict_exposed(f: AutoFigures, compress: bool) -> float:
    """Predicted communication time left exposed: push + pull of the bytes at the measured rate,
    minus what backward hides; the codec's CPU time is counted in full (it competes with compute)."""
    wire = 2 * (f.compressed_bytes if compress else f.fp32_bytes) / f.throughput_bps
    return max(0.0, wire - f.overlap_s) + (f.codec_s if compress else 0.0)


class Tuner:
    def __init__(self, target, compression) -> None:
        self.target = target
        self.compression = compression
        self.interval = max(1, compression.interval)
        self.rank0 = target.rank == 0
        self.average = RunningAverage() if compression.adaptive and self.rank0 else None
        layout = target.layout
        # the compressed blocks, each holding one tensor's elements (adaptive layouts): block id -> name
        self.names = {b.block_id: layout.tensors[b.segments[0].tensor_index].name
                      for b in layout.blocks if b.codec.codec == ps_pb2.CODEC_MAXMIN}
        self.history: list[dict] = []
        # auto mode, rank 0: step times of the current mode since the last decision, and the
        # latest median per mode as (seconds, decision index)
        self._decisions = 0
        self._step_samples: list[float] = []
        self._last_step_end: float | None = None
        self._skip_sample = True  # the first step after a switch pays one-off costs: not a sample
        self.measured: dict[bool, tuple[float, int]] = {}
        self._incumbent: bool | None = None  # the mode in use before the last exploration

    def after_step(self, step: int) -> None:
        """Called by step() after the optimizer stepped; step counts from 0."""
        now = time.perf_counter()
        sampling = self.compression.auto and self.rank0 and step >= self.target.warmup_steps  # warmup: uncompressed
        if sampling and self._last_step_end is not None and not self._skip_sample:
            self._step_samples.append(now - self._last_step_end)
        self._skip_sample = False
        try:
            self._after_step(step)
        finally:
            self._last_step_end = time.perf_counter()  # the decision's own cost is not a step's

    def _after_step(self, step: int) -> None:
        if self.average is not None:
            for name in set(self.names.values()):
                self.average.update(name, self.target.gradient(name))
        due_auto = self.compression.auto and (step == 0 or (step + 1) % self.interval == 0)
        due_adaptive = self.compression.adaptive and (step + 1) % self.interval == 0
        if not (due_auto or due_adaptive):
            return
        decision = self._decide(due_auto, due_adaptive) if self.rank0 else None
        decision = broadcast_object(decision, root_rank=0)
        self._apply(decision)

    # ---- rank 0 -------------------------------------------------------------------------------------

    def _decide(self, auto: bool, adaptive: bool) -> dict:
        decision: dict = {"from_round": self.target.next_round}
        if auto:
            figures = self._measure()
            compress, reason = self._choose(figures)
            decision.update(compress=compress, reason=reason, figures=figures.__dict__,
                            measured={("compressed" if k else "uncompressed"): v[0] for k, v in self.measured.items()})
            log.info("auto mode: %s (%s; measured step %s; model: rate %.0f MB/s: probe %.0f, pipeline %.0f; "
                     "%.1f -> %.1f MB/step, codec %.1f ms, overlap %.1f ms; exposed %.1f ms compressed vs %.1f ms not)",
                     "compress" if compress else "no compression", reason,
                     {k: f"{v * 1e3:.1f} ms" for k, v in decision["measured"].items()},
                     figures.throughput_bps / 1e6, figures.probe_bps / 1e6, figures.pipeline_bps / 1e6,
                     figures.fp32_bytes / 1e6, figures.compressed_bytes / 1e6,
                     figures.codec_s * 1e3, figures.overlap_s * 1e3, figures.exposed(True) * 1e3,
                     figures.exposed(False) * 1e3)
        if adaptive and self.average is not None and self.average.names():
            estimates = {n: estimate_tensor(self.average.average(n), DEFAULT_CANDIDATES,
                                            self.compression.bucket_size, stochastic=True)
                         for n in self.average.names()}
            bits = choose_bits(estimates)
            self.average.reset()
            changes = {b: s for b, s in self._settings(bits).items() if s != self.target.settings(b)}
            if changes:
                # every shard must expect the new settings before any rank pushes that round
                self.target.announce(decision["from_round"], changes)
            decision["bits"] = bits
            log.info("adaptive bits from round %d: %s", decision["from_round"], bits)
        return decision

    def _choose(self, figures: AutoFigures) -> tuple[bool, str]:
        """Compress or not, and why: the model first, then measured step times (module doc)."""
        k, self._decisions = self._decisions, self._decisions + 1
        current = self.target.compress
        samples, self._step_samples = self._step_samples, []
        if k == 0:
            return figures.exposed(True) < figures.exposed(False), "model"
        if not samples:
            return current, "no step measured since the last decision"
        self.measured[current] = (statistics.median(samples), k)
        other = not current
        exploring, self._incumbent = self._incumbent, None  # after an exploration: the mode we left
        incumbent = current if exploring is None else exploring
        if other not in self.measured or k - self.measured[other][1] >= REEXPLORE:
            now = self.measured[current][0]
            predicted = now - figures.exposed(current) + figures.exposed(other)
            if predicted <= _PLAUSIBLE * now:
                self._incumbent = current
                return other, f"measuring the other mode (model predicts {predicted * 1e3:.0f} ms/step)"
            if other not in self.measured:
                return current, f"model rules the other mode out ({predicted * 1e3:.0f} ms/step predicted)"
        if True in self.measured and False in self.measured:
            # start compressing only for a clear win; while compressing, keep on as long as it wins
            margin = 1.0 if incumbent else _COMPRESS_MARGIN
            return self.measured[True][0] < margin * self.measured[False][0], "measured"
        return current, "measured"

    def _measure(self) -> AutoFigures:
        target = self.target
        probe = target.probe(_PROBE_BYTES)
        # The probe sees the link; the last step saw the whole pipeline (CPU per byte in gRPC,
        # the shard's work, the pull). Trust the pipeline's rate when it moved enough bytes to be
        # bandwidth-bound rather than latency-bound.
        pushed, window = target.stats.bytes_pushed, target.stats.comm_window_s
        pipeline = 2 * pushed / window if pushed >= _PIPELINE_MIN_BYTES and window > 0 else 0.0
        throughput = min(probe, pipeline) if pipeline else probe
        blocks = target.layout.blocks
        fp32 = sum(HEADER_SIZE + 4 * b.numel for b in blocks)
        settings = [target.settings(b.block_id) for b in blocks]
        compressed = sum(HEADER_SIZE + body_size(Codec(s.codec), b.numel, s.bits, s.bucket_size)
                         for b, s in zip(blocks, settings))
        q_numel = sum(blocks[b].numel for b in self.names)
        sample = torch.randn(min(max(q_numel, 1), 1 << 20))
        codec_s = float("inf")
        for _ in range(2):  # the first call pays for first-touch pages and thread start
            t0 = time.perf_counter()
            dequantize(quantize(sample, 4, stochastic=True), out=sample)
            codec_s = min(codec_s, (time.perf_counter() - t0) * q_numel / sample.numel())
        return AutoFigures(throughput, probe, pipeline, fp32, compressed, codec_s, target.stats.backward_s)

    # ---- every rank -------------------------------------------------------------------------------

    def _apply(self, decision: dict) -> None:
        self.history.append(decision)
        compress = decision.get("compress")
        if compress is not None and compress != self.target.compress:
            self._skip_sample = True
        self.target.apply(compress, self._settings(decision.get("bits", {})))

    def _settings(self, bits: dict[str, int]) -> dict[int, ps_pb2.CodecSettings]:
        """The compressed blocks' settings with these bits per tensor (the others unchanged)."""
        out = {}
        for block_id, name in self.names.items():
            if name in bits:
                s = self.target.settings(block_id)
                out[block_id] = ps_pb2.CodecSettings(codec=ps_pb2.CODEC_MAXMIN, bits=bits[name],
                                                     bucket_size=s.bucket_size, stochastic=s.stochastic)
        return out
