"""The training workload every step benchmark shares: models, synthetic data, the timed loop.

The data are synthetic but learnable: inputs are Gaussian, labels are the argmax of a fixed
random "teacher" network. Everything is seeded, so the same seed gives the same initial model,
batches (per rank and step) and evaluation set in every run, and losses are comparable across
systems (``ddp_step.py``, ``cgx_step.py``, ``timeline.py``).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from typing import Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from benchmarks.argtypes import fraction, non_negative
from benchmarks.model_names import CPU_MODELS as MODELS
from benchmarks.model_names import SHAPED_MODELS
from benchmarks.procstat import HostCpu, ThreadCpu, iface_bytes
from cgx_ps.planning.shapes import workload

__all__ = ["MODELS", "SHAPED_MODELS", "Teacher", "batch_seed", "build_model", "eval_loss", "input_shape",
           "make_batch", "model_from_args", "timed_training", "training_parser"]

IN_FEATURES = 64
IMAGE = (3, 32, 32)
CLASSES = 10


def _mlp(*widths: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])  # no ReLU after the logits


def build_model(name: str, scale: float = 1.0, compute_s: float | None = None) -> nn.Module:
    """A CPU model of ``MODELS``, or a ``SHAPED_MODELS`` one: its tensors scaled by ``scale``, its emulated
    compute ``compute_s`` seconds per step (default: the published figure)."""
    if name in SHAPED_MODELS:
        from benchmarks.shaped_model import ShapedModel

        return ShapedModel(workload(name, compute_s), scale=scale, in_features=IN_FEATURES, classes=CLASSES)
    if name == "tiny":      # smoke tests
        return _mlp(IN_FEATURES, 128, CLASSES)
    if name == "mlp17m":    # 17.1M params, ~34 MFLOP/sample forward
        return _mlp(IN_FEATURES, 4096, 4096, CLASSES)
    if name == "mlp25m":    # 25.5M params, compute proportional to params
        return _mlp(IN_FEATURES, 4096, 4096, 2048, CLASSES)
    if name == "convnet":   # 4.6M params, ~3x the step time of mlp17m: compute-bound
        def conv(a, b):
            return [nn.Conv2d(a, b, 3, padding=1), nn.ReLU()]
        return nn.Sequential(
            *conv(3, 64), *conv(64, 64), nn.MaxPool2d(2),      # 32x32
            *conv(64, 128), nn.MaxPool2d(2),                   # 16x16
            *conv(128, 256), nn.MaxPool2d(2),                  # 8x8 -> 4x4
            nn.Flatten(), nn.Linear(256 * 4 * 4, 1024), nn.ReLU(), nn.Linear(1024, CLASSES),
        )
    raise ValueError(f"unknown model {name!r}; choose from {MODELS + SHAPED_MODELS}")


def input_shape(model: str) -> tuple[int, ...]:
    return IMAGE if model == "convnet" else (IN_FEATURES,)


class Teacher:
    """A fixed random network that labels inputs (argmax of its logits)."""

    def __init__(self, model: str, seed: int):
        g = torch.Generator().manual_seed(10_007 + seed)
        self.image = model == "convnet"
        d = 3 * 8 * 8 if self.image else IN_FEATURES  # images are 4x4-average-pooled first
        self.w1 = torch.randn(d, 256, generator=g) / math.sqrt(d)
        self.w2 = torch.randn(256, CLASSES, generator=g) / math.sqrt(256)

    @torch.no_grad()
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.image:
            x = F.avg_pool2d(x, 4).flatten(1)
        return (torch.tanh(x @ self.w1) @ self.w2).argmax(dim=1)


def make_batch(model: str, teacher: Teacher, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, *input_shape(model), generator=g)
    return x, teacher(x)


def batch_seed(seed: int, step: int, rank: int) -> int:
    return (seed * 1_000_003 + step) * 1_009 + rank



@torch.no_grad()
def eval_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Mean cross-entropy of ``model`` on a held-out set, in slices of 256."""
    model.eval()
    loss = sum(F.cross_entropy(model(xs), ys, reduction="sum").item() for xs, ys in zip(x.split(256), y.split(256)))
    model.train()
    return loss / len(x)


def timed_training(net: nn.Module, opt: torch.optim.Optimizer, batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                   warmup: int, iface: str | None, after_timed_step: Callable[[], None] = lambda: None) -> dict:
    """Train one step per batch and time each; the steps after ``warmup`` are measured: median and
    mean step time, bytes through ``iface``, CPU seconds (``HostCpu``) and CPU seconds and page
    faults per thread role (``ThreadCpu``) per timed step. ``step_cpu_s``: every step's CPU
    seconds (this process, all threads; warm-up included).
    ``after_timed_step`` runs after each timed step (to read a system's own per-step stats)."""
    times, cpu_times, loss = [], [], float("nan")
    counters0 = None
    cpu, threads = HostCpu(), ThreadCpu()
    for step, (x, y) in enumerate(batches):
        if step == warmup:
            counters0 = iface_bytes(iface)
            cpu.start()
            threads.start()
        t0, c0 = time.perf_counter(), time.process_time()
        opt.zero_grad(set_to_none=True)
        loss_t = F.cross_entropy(net(x), y)
        loss_t.backward()  # DDP: returns once every gradient bucket is all-reduced
        opt.step()
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
        loss = loss_t.item()
        if step >= warmup:
            after_timed_step()
    cpu.stop()
    threads.stop()
    counters1 = iface_bytes(iface)
    timed = times[warmup:]
    steps = len(timed)
    rx = tx = None
    if counters0 and counters1 and steps:
        rx = (counters1[0] - counters0[0]) / steps
        tx = (counters1[1] - counters0[1]) / steps
    return {"step_times_s": times, "step_cpu_s": cpu_times, "median_step_s": statistics.median(timed) if timed else None,
            "mean_step_s": statistics.mean(timed) if timed else None, "train_loss": loss,
            "tx_bytes_per_step": tx, "rx_bytes_per_step": rx, **cpu.per_step(steps), **threads.per_step(steps)}


def model_from_args(args: argparse.Namespace) -> nn.Module:
    """``build_model`` with a step script's --model, --scale and --compute-ms."""
    compute_s = None if args.compute_ms is None else args.compute_ms / 1e3
    return build_model(args.model, args.scale, compute_s)


def training_parser(description: str) -> argparse.ArgumentParser:
    """The flags of every step script: the same defaults make their runs comparable."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", choices=MODELS + SHAPED_MODELS, default="mlp17m",
                   help="a CPU model, or a real model's gradients with emulated compute (%s)" % ", ".join(SHAPED_MODELS))
    p.add_argument("--scale", type=fraction, default=1.0,
                   help="shaped models: each tensor's element count times this, in (0, 1] (compute kept)")
    p.add_argument("--compute-ms", type=non_negative, default=None,
                   help="shaped models: emulated compute per step in ms (default: the published RTX 3090 figure)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--steps", type=int, default=20, help="timed steps (after warm-up)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (>= 2 for ddp_step.py --hook powersgd)")
    p.add_argument("--compression", default="4bit", help="cgx-ps: fp32, fp16, Nbit")
    p.add_argument("--block-mb", type=float, default=4.0, help="cgx-ps: fp32 MB per block")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-size", type=int, default=512)
    p.add_argument("--iface", default=os.environ.get("GLOO_SOCKET_IFNAME"),
                   help="interface whose /proc/net/dev counters give bytes per step")
    return p
