"""Auto mode (``compression="auto"``): compress only when it measurably pays.

The first choice comes from a model: after step 0, measure the upload throughput to the shards
and the codec's cost on this device, and predict the communication each choice leaves exposed
after overlapping with backward (``AutoFigures``). The model cannot see everything that competes
for the machine (the transport's CPU cost per byte, a colocated shard), so after that the step
time decides (``ModeChooser``): every interval rank 0 records the median step time of the
current mode, tries the other mode for one interval when the model says it could plausibly be
faster (and again every ``REEXPLORE`` decisions, as conditions change), and compresses only if
compressed steps measured at least 5% faster than uncompressed ones.

Where the uncompressed steps skip the shards (an all_reduce on a process group: the optimizer's
``collective.py``), the probe of the shards says nothing about them: the front end then measures
the all_reduce itself (``AutoFigures.uncompressed_bps``, every rank at the same step), so the
model does not rule out, on a fast link, the path that is as fast as DDP.

Where no such measurement is given (the DDP hook's allreduce, a native collective moving bytes at
a rate no gRPC probe shows), the model's guess for that path can be off several times over
(2.3 s predicted, 0.38 s measured at 10 Gbit/s): then the uncompressed mode is measured once whatever the model says, and afterwards its own last
measurement, not the model, says whether it is worth trying again.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..kernels import dequantize, quantize
from ..kernels.wire import HEADER_SIZE, Codec, body_size

if TYPE_CHECKING:
    from .autotune import Tunable

__all__ = ["AutoFigures", "ModeChooser", "measure", "predict_exposed", "REEXPLORE"]

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
    # uncompressed steps through an all_reduce: bytes all-reduced per second (measured on the
    # group); 0: they go through the shards at ``throughput_bps``
    uncompressed_bps: float = 0.0

    def exposed(self, compress: bool) -> float:
        return predict_exposed(self, compress)


def predict_exposed(f: AutoFigures, compress: bool) -> float:
    """Predicted communication time left exposed: push + pull of the bytes at the measured rate
    (or the all_reduce of the fp32 bytes at its measured rate), minus what backward hides; the
    codec's CPU time is counted in full (it competes with compute)."""
    if not compress and f.uncompressed_bps > 0:
        wire = f.fp32_bytes / f.uncompressed_bps
    else:
        wire = 2 * (f.compressed_bytes if compress else f.fp32_bytes) / f.throughput_bps
    return max(0.0, wire - f.overlap_s) + (f.codec_s if compress else 0.0)


def measure(target: Tunable, quantized: list[int], uncompressed_bps: float = 0.0) -> AutoFigures:
    """The model's figures now, after a step; ``quantized``: the blocks max-min quantization
    compresses; ``uncompressed_bps``: the all_reduce rate of the uncompressed path, if it has one."""
    probe = target.probe(_PROBE_BYTES)
    # The probe sees the link; the last step saw the whole pipeline (CPU per byte in gRPC, the
    # shard's work, the pull). Trust the pipeline's rate when it moved enough bytes to be
    # bandwidth-bound rather than latency-bound.
    stats = target.stats
    pipeline = 2 * stats.bytes_pushed / stats.comm_window_s \
        if stats.bytes_pushed >= _PIPELINE_MIN_BYTES and stats.comm_window_s > 0 else 0.0
    throughput = min(probe, pipeline) if pipeline else probe
    blocks = target.layout.blocks
    fp32 = sum(HEADER_SIZE + 4 * b.numel for b in blocks)
    settings = [target.settings(b.block_id) for b in blocks]
    compressed = sum(HEADER_SIZE + body_size(Codec(s.codec), b.numel, s.bits, s.bucket_size)
                     for b, s in zip(blocks, settings))
    q_numel = sum(blocks[b].numel for b in quantized)
    sample = torch.randn(min(max(q_numel, 1), 1 << 20))
    codec_s = float("inf")
    for _ in range(2):  # the first call pays for first-touch pages and thread start
        t0 = time.perf_counter()
        dequantize(quantize(sample, 4, stochastic=True), out=sample)
        codec_s = min(codec_s, (time.perf_counter() - t0) * q_numel / sample.numel())
    return AutoFigures(throughput, probe, pipeline, fp32, compressed, codec_s, stats.backward_s, uncompressed_bps)


class ModeChooser:
    """Rank 0's choice between compressing and not: the model first, then measured step times
    (module doc). It depends only on the step times recorded and the figures given (no clock, no
    I/O), so tests drive it directly."""

    def __init__(self, model_sees_uncompressed: bool = True) -> None:
        # False: uncompressed steps do not go through the shards, so the model cannot predict them
        self.model_sees_uncompressed = model_sees_uncompressed
        self.decisions = 0
        self.samples: list[float] = []  # step times of the current mode since the last decision
        self.measured: dict[bool, tuple[float, int]] = {}  # mode -> (median step seconds, decision index)
        self._incumbent: bool | None = None  # the mode in use before the last exploration

    def record(self, step_s: float) -> None:
        self.samples.append(step_s)

    def state_dict(self) -> dict:
        """Plain data for a checkpoint: what was measured and where the exploration stands."""
        return {"decisions": self.decisions, "samples": list(self.samples),
                "measured": {int(mode): [s, k] for mode, (s, k) in self.measured.items()},
                "incumbent": self._incumbent}

    def load_state_dict(self, state: dict) -> None:
        self.decisions, self.samples = int(state["decisions"]), [float(s) for s in state["samples"]]
        self.measured = {bool(mode): (float(s), int(k)) for mode, (s, k) in state["measured"].items()}
        self._incumbent = state["incumbent"]

    def medians(self) -> dict[str, float]:
        """The latest median step time of each mode measured so far."""
        return {("compressed" if mode else "uncompressed"): s for mode, (s, _) in self.measured.items()}

    def choose(self, current: bool, figures: AutoFigures) -> tuple[bool, str]:
        """Compress or not from now on, and why; ``current``: whether the steps recorded did."""
        k, self.decisions = self.decisions, self.decisions + 1
        samples, self.samples = self.samples, []
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
            predicted, source = self._predict(other, now, figures)
            if predicted is None or predicted <= _PLAUSIBLE * now:
                self._incumbent = current
                why = "never measured, and the model cannot predict it" if predicted is None else \
                    f"{source} predicts {predicted * 1e3:.0f} ms/step"
                return other, f"measuring the other mode ({why})"
            if other not in self.measured:
                return current, f"model rules the other mode out ({predicted * 1e3:.0f} ms/step predicted)"
        if True in self.measured and False in self.measured:
            # start compressing only for a clear win; while compressing, keep on as long as it wins
            margin = 1.0 if incumbent else _COMPRESS_MARGIN
            return self.measured[True][0] < margin * self.measured[False][0], "measured"
        return current, "measured"

    def _predict(self, mode: bool, now: float, figures: AutoFigures) -> tuple[float | None, str]:
        """The step time ``mode`` is expected to take, and from what: the model where it sees both
        modes' paths; else that mode's last measurement (None: never measured)."""
        if self.model_sees_uncompressed:
            return now - figures.exposed(not mode) + figures.exposed(mode), "model"
        if mode in self.measured:
            return self.measured[mode][0], "its last measurement"
        return None, ""
