"""The cluster benchmark's models (``benchmarks/cluster.py --models``) and what ``--scale`` changes in a run.

Two kinds: the CPU models of ``benchmarks/workload.py`` (tiny, mlp17m, mlp25m, convnet), whose compute runs
on the machine's cores, and the shaped models (resnet50, bert-base, gpt2, vit-b16): a real model's
parameter tensors, names and order of gradients, with its accelerator compute emulated by sleeps
(``benchmarks/shaped_model.py``), so that the CPUs are left to communication and compression.

A shaped model at ``--scale s`` emulates its full-size self on the same links: every tensor has about
``s`` of its elements and so does everything sized in bytes: the emulated link rate (``s`` times each of
``--rates``), DDP's bucket cap (``s`` x 25 MiB; PowerSGD keeps its one bucket) and cgx-ps's blocks (``s``
x ``--block-mb``, default 4 MiB). The compute stays, so every transfer and every step takes as long as at
full size, and the link-bound ideal (measured bytes / emulated rate) is the full-size model's. What does not
scale: per-message latency, DDP's first 1 MiB bucket, and the tensors that fall under the codec's
1024-element minimum (they go uncompressed). The CPU models ignore ``--scale``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from benchmarks.emulator import parse_rate
from benchmarks.model_names import CPU_MODELS, SHAPED_MODELS
from cgx_ps.planning.shapes import PlanningError, workload

__all__ = ["DDP_BUCKET_MB", "DEFAULT_BLOCK_MB", "MODEL_CHOICES", "ModelRun", "describe", "model_label"]

MODEL_CHOICES = CPU_MODELS + SHAPED_MODELS
DDP_BUCKET_MB = 25.0  # torch DDP's bucket_cap_mb default
DEFAULT_BLOCK_MB = 4.0  # cgx_step.py's and ddp_step.py's --block-mb default


@dataclass(frozen=True)
class ModelRun:
    """One model of a sweep with its scale (1 for the CPU models) and emulated compute override."""

    model: str
    scale: float = 1.0
    compute_ms: float | None = None

    @classmethod
    def of(cls, model: str, args: argparse.Namespace) -> "ModelRun":
        if model not in SHAPED_MODELS:
            return cls(model)
        return cls(model, args.scale, args.compute_ms)

    @property
    def shaped(self) -> bool:
        return self.model in SHAPED_MODELS

    def link_rate(self, rate: str) -> str:
        """The rate the links are emulated at for a nominal ``rate`` (tc units)."""
        return rate if self.scale == 1 else f"{max(1, round(parse_rate(rate) * self.scale))}bit"

    def step_args(self) -> list[str]:
        """ddp_step.py's and cgx_step.py's flags for the model's size and compute."""
        if not self.shaped:
            return []
        return ["--scale", repr(self.scale)] + ([] if self.compute_ms is None else ["--compute-ms", repr(self.compute_ms)])

    def ddp_args(self, hook: str) -> list[str]:
        """ddp_step.py's flags: the model's, and DDP's bucket cap scaled with it (PowerSGD keeps its
        single bucket, ddp_step.POWERSGD_BUCKET_CAP_MB, which avoids its deadlock)."""
        if self.scale == 1 or hook == "powersgd":
            return self.step_args()
        return [*self.step_args(), "--bucket-cap-mb", repr(DDP_BUCKET_MB * self.scale)]

    def cgx_args(self, front_end: str, block_mb: float | None) -> list[str]:
        """The flags of a cgx-ps worker (``run_cgx``'s ``extra_args``): the model's and cgx-ps's block
        size (``block_mb``, None: the step scripts' default) scaled with it, and for the DDP hook
        (``front_end="ddp-hook"``) DDP's bucket cap too."""
        if self.scale != 1:
            block_mb = (DEFAULT_BLOCK_MB if block_mb is None else block_mb) * self.scale
        blocks = [] if block_mb is None else ["--block-mb", repr(block_mb)]
        return blocks + (self.ddp_args("cgx") if front_end == "ddp-hook" else self.step_args())

    def row_fields(self) -> dict:
        """What the report's rows record of the model beyond its name (nothing for a CPU model)."""
        return {"scale": self.scale, "compute_ms": self.compute_ms} if self.shaped else {}


def model_label(row: dict) -> str:
    """A group's model as headings and charts name it: "resnet50", "resnet50 x0.05"."""
    scale = row.get("scale")
    return row["model"] if scale in (None, 1, 1.0) else f"{row['model']} x{scale:g}"


def describe(row: dict) -> str:
    """A sentence on a shaped model's run for the report (empty for a CPU model): its size against the
    full model's, the emulated compute, and the links' emulated rate."""
    if row.get("model") not in SHAPED_MODELS:
        return ""
    from benchmarks.shaped_model import scaled_workload  # torch: only for a report that has shaped models

    scale = row.get("scale") or 1.0
    compute_s = None if row.get("compute_ms") is None else row["compute_ms"] / 1e3
    try:
        full = workload(row["model"], compute_s)
    except PlanningError as e:  # say, transformers missing where the report is merged
        return f"{row['model']}, scaled x{scale:g} with the links ({e}). "
    params, small = sum(t.numel for t in full.tensors), sum(t.numel for t in scaled_workload(full, scale).tensors)
    source = "published RTX 3090 step time" if row.get("compute_ms") is None else "--compute-ms"
    text = (f"{row['model']}: {len(full.tensors)} tensors, {small / 1e6:.2f}M of {params / 1e6:.2f}M parameters "
            f"({4 * small / 1e6:.1f} of {4 * params / 1e6:.1f} MB fp32 gradients per step), emulated compute "
            f"{1e3 * full.compute_s:.0f} ms/step ({source}); ")
    text += "the target on CPU per step against the compute's does not apply (the compute is slept); "
    if scale == 1:
        return text + "full size. "
    rate = ModelRun(row["model"], scale).link_rate(row["rate"])
    return text + (f"scaled x{scale:g} with the links ({row['rate']} emulated at {_rate_text(rate)}), DDP buckets "
                   f"and cgx-ps blocks: times and the link-bound ideal are the full-size model's, MB/step are x{scale:g}. ")


def _rate_text(rate: str) -> str:
    bps = parse_rate(rate)
    for unit, size in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bps >= size:
            return f"{bps / size:.4g}{unit}"
    return f"{bps}bit"
