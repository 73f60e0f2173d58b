"""Choosing compression while training: layer-wise adaptive bits and the auto on/off mode.

One place decides, rank 0, and every rank applies the decision at the same step boundary:

1. rank 0 computes a ``Decision`` after ``step()`` of step s (the gradients there are the
   averaged ones, identical on every rank);
2. for new bit widths, it announces them to every shard with SetCodecs, effective from the next
   round, and waits for every shard to accept (so no push of that round can be refused);
3. it broadcasts the decision through the shards' blob stores; every other rank reads it at the
   same step boundary before its next backward.

Under quorum rounds a node that fell behind applies the rounds it missed without computing them;
at each one's step boundary it reads (rank 0: makes) the decisions due there
(``after_caught_up_round``), so every rank still makes the same broadcasts in the same order.

The tuner reads and changes a ``Tunable`` (the block pipeline is one): step figures, block
settings, averaged gradients, and a way to announce and apply settings from a round on.

Adaptive bits (``compression="adaptive"``): every ``interval`` steps, estimate for each compressed
tensor and each candidate bit width the error of quantizing the running average of its gradient
and its size, and solve the multiple-choice knapsack (``adaptive.choose_bits``): fewest bytes at
no more error than uniform 4 bits. Auto mode (``compression="auto"``): ``tuning/auto_mode.py``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol, runtime_checkable

import torch

from ...v1 import ps_pb2
from .adaptive_bits import DEFAULT_CANDIDATES, RunningAverage, choose_bits, estimate_tensor
from .auto_mode import AutoFigures, ModeChooser, measure
from ..broadcast.api import broadcast_object
from ..errors import CheckpointError
from ..pipeline.blocks import Compression

if TYPE_CHECKING:
    from ..config import WorkerConfig
    from ..pipeline.block_pipeline import StepStats

__all__ = ["Decision", "Tunable", "Tuner"]

log = logging.getLogger(__name__)

_COLLECTIVE_PROBE_BYTES = 4 << 20  # one default block: what an uncompressed step all-reduces at a time
_SETTLE_STEPS = 5  # a process's first steps are not samples of auto mode's step times (Tuner)


@runtime_checkable
class Tunable(Protocol):
    """What the tuner reads and changes (``BlockPipeline`` provides it)."""

    @property
    def layout(self) -> ps_pb2.Layout: ...  # blocks and the tensors in them
    @property
    def rank(self) -> int: ...
    @property
    def warmup_steps(self) -> int: ...  # the first steps travel uncompressed whatever is decided
    @property
    def compress(self) -> bool: ...  # auto mode's current choice
    @property
    def stats(self) -> StepStats: ...  # the last finished step: bytes, backward and transfer windows, arrivals
    @property
    def config(self) -> WorkerConfig: ...  # node and rank counts (auto mode's model)
    @property
    def next_round(self) -> int: ...  # the round the next step's blocks travel in
    def settings(self, block_id: int) -> ps_pb2.CodecSettings: ...  # a block's codec settings now
    def gradient(self, name: str) -> torch.Tensor: ...  # a tensor's averaged gradient of the last step
    def probe(self, nbytes_per_shard: int) -> float: ...  # upload bytes/s to all shards at once
    def announce(self, from_round: int, changes: Mapping[int, ps_pb2.CodecSettings]) -> None: ...  # to shards
    def apply(self, compress: bool | None, changes: Mapping[int, ps_pb2.CodecSettings]) -> None: ...


@dataclass(frozen=True)
class Decision:
    """One tuning decision: made by rank 0 after a step, applied by every rank from round
    ``from_round`` on. Each mode fills its part; the other stays None."""

    from_round: int
    # auto mode: compress from then on, why, what the model saw, the median step seconds per mode
    compress: bool | None = None
    reason: str = ""
    figures: AutoFigures | None = None
    measured: Mapping[str, float] = field(default_factory=dict)
    # adaptive bits: bits per compressed tensor
    bits: Mapping[str, int] | None = None

    def as_dict(self) -> dict[str, Any]:
        """Plain data (for broadcasts and JSON); the parts no mode decided are left out."""
        out: dict[str, Any] = {"from_round": self.from_round}
        if self.compress is not None:
            out.update(compress=self.compress, reason=self.reason, measured=dict(self.measured),
                       figures=dataclasses.asdict(self.figures) if self.figures else None)
        if self.bits is not None:
            out["bits"] = dict(self.bits)
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Decision":
        figures = d.get("figures")
        return cls(d["from_round"], d.get("compress"), d.get("reason", ""),
                   AutoFigures(**figures) if figures else None, dict(d.get("measured", {})),
                   dict(d["bits"]) if d.get("bits") is not None else None)


class Tuner:
    def __init__(self, target: Tunable, compression: Compression,
                 uncompressed_probe: Callable[[int], float | None] | None = None) -> None:
        """``uncompressed_probe(nbytes)``: the front end's all_reduce rate (bytes/s) on the path its
        uncompressed steps take, or None when they go through the shards; a collective, called
        on every rank at each auto-mode decision (the step driver's ``StepRouter.probe``; without
        one, as in the tuner's own tests, the model sees the shards' path alone)."""
        self.target = target
        self.compression = compression
        self.uncompressed_probe = uncompressed_probe
        self.interval = max(1, compression.interval)
        self.rank0 = target.rank == 0
        self.average = RunningAverage() if compression.adaptive and self.rank0 else None
        layout = target.layout
        # the quantized blocks, each holding one tensor's elements (adaptive layouts): block id -> name
        self.names = {b.block_id: layout.tensors[b.segments[0].tensor_index].name
                      for b in layout.blocks if b.codec.codec == ps_pb2.CODEC_MAXMIN}
        self.history: list[Decision] = []
        self.modes = ModeChooser()  # auto mode, rank 0
        self._last_step_end: float | None = None
        self._skip_sample = True  # the first step after a switch pays one-off costs: not a sample
        # so do a process's first steps (allocation, first touch, connections): in a 10 Gbit/s
        # cluster-benchmark run (auto:5) steps 1-7 took ~1.5x the later ones in either mode, and
        # the mode measured first, in them, lost to the other for the rest of the run
        self._settling = _SETTLE_STEPS

    def after_step(self) -> None:
        """Called by the front end after each step (``target.stats`` is that step's)."""
        step = self.target.stats.step
        now = time.perf_counter()
        sampling = self.compression.auto and self.rank0 and step >= self.target.warmup_steps
        if sampling and self._last_step_end is not None and not self._skip_sample and not self._settling:
            self.modes.record(now - self._last_step_end)
        self._skip_sample = False
        self._settling = max(0, self._settling - 1)
        try:
            self._after_step(step)
        finally:
            self._last_step_end = time.perf_counter()  # the decision's own cost is not a step's

    def after_caught_up_round(self, step: int) -> None:
        """Called by the front end after each round it applied without computing it (quorum
        rounds' catch-up, ``StepDriver.missed_rounds``), ``step`` being that round's step: the
        decisions due there are made (rank 0, from what it has: that round's averages, its last
        computed step's figures) or read, and applied, as ``after_step`` would, so every rank
        makes the same broadcasts and has the same settings at every round. Not a sample of auto
        mode's step times: the next computed step is timed from here."""
        try:
            self._after_step(step)
        finally:
            self._last_step_end = time.perf_counter()

    def _after_step(self, step: int) -> None:
        if self.average is not None:
            gradients = {name: self.target.gradient(name) for name in set(self.names.values())}
            # A step a GradScaler skips (allow_non_finite: an overflow, an abandoned step's marker)
            # averaged NaN/Inf: no gradient to choose bits from, and in the running average it would
            # make the window's estimate refuse at the decision (CodecError on rank 0, every other
            # rank waiting for its broadcast). One pass per gradient, on rank 0 in adaptive mode only.
            if all(bool(torch.isfinite(g).all()) for g in gradients.values()):
                for name, gradient in gradients.items():
                    self.average.update(name, gradient)
        due_auto = self.compression.auto and (step == 0 or (step + 1) % self.interval == 0)
        due_adaptive = self.compression.adaptive and (step + 1) % self.interval == 0
        if not (due_auto or due_adaptive):
            return
        # every rank takes part in the front end's probe (a collective); rank 0 decides with it
        uncompressed_bps = (self.uncompressed_probe(_COLLECTIVE_PROBE_BYTES) or 0.0) \
            if due_auto and self.uncompressed_probe is not None else 0.0
        mine = self._decide(due_auto, due_adaptive, uncompressed_bps).as_dict() if self.rank0 else None
        self._apply(Decision.from_dict(broadcast_object(mine, root_rank=0)))

    # ---- checkpoints ----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The decisions so far, and rank 0's gradient averages and step-time measurements (plain
        data and CPU tensors). The settings decided live in the target's own state."""
        return {"history": [d.as_dict() for d in self.history],
                "average": self.average.state_dict() if self.average is not None else None,
                "modes": self.modes.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state_dict()``. A rank-0 state restores the averaging window exactly;
        without one (another rank's checkpoint) the window starts empty at the next step."""
        try:
            history = [Decision.from_dict(d) for d in state["history"]]
            average = state.get("average")
            if self.average is not None and average is not None:
                unknown = set(average["averages"]) - set(self.names.values())
                if unknown:
                    raise ValueError(f"averages of tensors this layout does not compress: {sorted(unknown)[:3]}")
                self.average.load_state_dict(average)
            self.modes.load_state_dict(state["modes"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"the tuner's state in the checkpoint does not fit: {exc!r}") from None
        self.history = history
        self._last_step_end, self._skip_sample = None, True  # a resumed step pays one-off costs
        self._settling = _SETTLE_STEPS

    # ---- rank 0 -------------------------------------------------------------------------------------

    def _decide(self, auto: bool, adaptive: bool, uncompressed_bps: float = 0.0) -> Decision:
        decision = Decision(self.target.next_round)
        if auto:
            model = measure(self.target, list(self.names), uncompressed_bps)
            figures = model.figures
            compress, reason = self.modes.choose(self.target.compress, model)
            decision = dataclasses.replace(decision, compress=compress, reason=reason, figures=figures,
                                           measured=self.modes.medians())
            log.info("auto mode: %s (%s; measured step %s; model: rate %.0f MB/s: probe %.0f, pipeline %.0f; "
                     "all_reduce %.0f; %.1f -> %.1f MB/step, codec %.1f ms, overlap %.1f ms; exposed %.1f ms "
                     "%s vs %.1f ms %s)",
                     "compress" if compress else "no compression", reason,
                     {k: f"{v * 1e3:.1f} ms" for k, v in decision.measured.items()},
                     figures.throughput_bps / 1e6, figures.probe_bps / 1e6, figures.pipeline_bps / 1e6,
                     figures.uncompressed_bps / 1e6,
                     figures.fp32_bytes / 1e6, figures.compressed_bytes / 1e6,
                     figures.codec_s * 1e3, figures.overlap_s * 1e3, model.exposed(True) * 1e3, model.option(True),
                     model.exposed(False) * 1e3, model.option(False))
        if adaptive and self.average is not None and self.average.names():
            estimates = {n: estimate_tensor(self.average.average(n), DEFAULT_CANDIDATES,
                                            self.compression.bucket_size, stochastic=True)
                         for n in self.average.names()}
            bits = choose_bits(estimates)
            self.average.reset()
            changes = {b: s for b, s in self._settings(bits).items() if s != self.target.settings(b)}
            if changes:
                # every shard must expect the new settings before any rank pushes that round
                self.target.announce(decision.from_round, changes)
            decision = dataclasses.replace(decision, bits=bits)
            log.info("adaptive bits from round %d: %s", decision.from_round, bits)
        return decision

    # ---- every rank -------------------------------------------------------------------------------

    def _apply(self, decision: Decision) -> None:
        self.history.append(decision)
        if decision.compress is not None and decision.compress != self.target.compress:
            self._skip_sample = True
        self.target.apply(decision.compress, self._settings(decision.bits or {}))

    def _settings(self, bits: Mapping[str, int]) -> dict[int, ps_pb2.CodecSettings]:
        """The quantized blocks' settings with these bits per tensor (the others unchanged)."""
        out = {}
        for block_id, name in self.names.items():
            if name in bits:
                s = self.target.settings(block_id)
                out[block_id] = ps_pb2.CodecSettings(codec=ps_pb2.CODEC_MAXMIN, bits=bits[name],
                                                     bucket_size=s.bucket_size, stochastic=s.stochastic)
        return out
