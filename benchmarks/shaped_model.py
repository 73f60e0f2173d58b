"""A real model's gradients with emulated accelerator compute, for the step benchmarks.

    job = workload("resnet50")                      # cgx_ps.planning.shapes: names, shapes, backward order
    model = ShapedModel(job, scale=0.05)            # 161 parameters named as torchvision's, 1/20 the elements

``ShapedModel`` has one parameter per tensor of a planning ``Workload``, under the same dotted name and
(at ``scale=1``) the same shape, registered in the model's own order, so ``named_parameters()`` lists them
as the real model does and DDP buckets them as it would. Nothing of the real architecture runs: the
model's accelerator time is emulated and its arithmetic is a cheap stand-in.

**Compute.** A training step sleeps ``compute_s`` in all: ``compute_s * (1 - overlap)`` over the forward
pass, layer by layer in registration order, and ``compute_s * overlap`` over the backward pass, split
as ``backward_split`` says. Each parameter's backward sleeps until its share is over, *then* returns its
gradient, so the gradients arrive one by one in the workload's order (the last layer's first) and DDP's
buckets or cgx-ps's blocks go out while earlier layers still "compute", as on a GPU. ``time.sleep``
releases the GIL, so communication threads run meanwhile. Each pass sleeps until deadlines measured
from its start (not a fixed sleep per layer), so the overshoot of a few hundred short sleeps does not add
up, and CPU work done on the training thread (say a hook's encoding) overlaps the emulated compute as it
overlaps a GPU's. Evaluation (``model.eval()`` or ``torch.no_grad()``) does not sleep.

**Arithmetic.** The logits are a linear classifier in disguise: each parameter ``p`` contributes
``fold(p * |p|)``, its flattened elements summed in consecutive pieces of ``in_features x classes``
into one such matrix, and ``logits = gamma * x @ sum of the folds``. Every element gets a gradient
(``2 |p| * G`` with ``G`` the classifier's gradient tiled over the tensor), different from step to step,
deterministic from the seed, and costs a few passes over the parameters: no real forward. The model
learns (the eval loss falls), and replicas that average the same gradients stay equal. ``gamma`` and
the initial standard deviation make the initial logits of unit variance and the effective learning rate
independent of the model's size. What the eval loss can tell: a wrong or missing average, a stale block,
replicas that drift apart, a biased compressor (PowerSGD's low rank shows); what it cannot: the harm
of unbiased per-element noise such as quantization's, which the fold averages out over each piece's
elements, as a real network would not.

**Scale.** ``scale=s`` shrinks each tensor's largest dimension to ``max(1, round(d * s))``: the tensors'
number, names and order stay, each element count shrinks about ``s`` (small tensors by less: at least
one element per dimension), and the compute does not change. The rule for a cluster run: scale the link
rate by the same ``s`` (and everything sized in bytes with it: DDP's buckets, cgx-ps's blocks), and every
transfer takes as long as the full model's would on the full link, against the same compute: the
communication/compute ratio, and the step time, are the full-size model's. What does not scale: per-message
latency, and tensors that fall under the codec's 1024-element minimum travel uncompressed.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Sequence

import torch
import torch.nn as nn

from cgx_ps.planning.model import Tensor, Workload
from cgx_ps.planning.shapes import backward_split

__all__ = ["INIT_STD", "ShapedModel", "fold", "scaled_shape", "scaled_workload"]

INIT_STD = 0.03  # with gamma below: an effective learning rate of about 23 x lr on the hidden classifier


def scaled_shape(shape: Sequence[int], scale: float) -> tuple[int, ...]:
    """``shape`` with its largest dimension (the first of equals) times ``scale``, at least 1."""
    if not 0 < scale <= 1:
        raise ValueError(f"scale must be in (0, 1], got {scale}")
    shape = tuple(int(d) for d in shape)
    if not shape:
        return shape
    big = max(range(len(shape)), key=lambda k: (shape[k], -k))
    return shape[:big] + (max(1, round(shape[big] * scale)),) + shape[big + 1:]


def scaled_workload(job: Workload, scale: float) -> Workload:
    """``job`` with every tensor's shape scaled (``scaled_shape``) and its compute weight kept: the
    same tensors in the same order, the same compute and the same split of it over the layers."""
    tensors = tuple(Tensor(t.name, scaled_shape(t.shape, scale), t.numel if t.compute is None else t.compute)
                    for t in job.tensors)
    return Workload(job.name, tensors, job.compute_s, job.overlap)


def fold(v: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``v``'s elements, flattened, summed in consecutive pieces of ``rows * cols`` into a (rows, cols)
    matrix (the last piece short: its elements go to the first positions)."""
    k = rows * cols
    flat = v.reshape(-1)
    whole = flat.numel() // k * k
    out = flat[:whole].view(-1, k).sum(0) if whole else flat.new_zeros(k)
    tail = flat[whole:]
    if tail.numel():
        out = torch.cat([out[:tail.numel()] + tail, out[tail.numel():]])
    return out.view(rows, cols)


def _tile(m: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The transpose of ``fold``: ``m`` repeated over a tensor of ``shape`` (each element gets the
    entry of ``m`` it was summed into)."""
    n, k = math.prod(shape), m.numel()
    return m.reshape(-1).repeat(-(-n // k))[:n].view(shape)


class _Clock:
    """Sleeps until deadlines measured from the start of a pass, releasing the GIL."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def start(self) -> None:
        self.t0 = time.perf_counter()

    def wait_until(self, offset_s: float) -> None:
        delay = self.t0 + offset_s - time.perf_counter()
        if delay > 0:
            time.sleep(delay)


class _BackwardStart(torch.autograd.Function):
    """Identity on the logits whose backward, the first to run, starts the backward pass's clock."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, clock: _Clock) -> torch.Tensor:
        ctx.clock = clock
        return h.clone()

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        ctx.clock.start()
        return g, None


class _Layer(torch.autograd.Function):
    """``h + gamma * x @ fold(p * |p|)``; backward waits for the layer's compute, then returns the
    gradient of ``p`` (``x`` is data: no gradient)."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, x: torch.Tensor, p: torch.Tensor, gamma: float,
                wait: Callable[[], None] | None) -> torch.Tensor:
        ctx.save_for_backward(x, p)
        ctx.gamma, ctx.wait = gamma, wait
        return h + gamma * (x @ fold(p * p.abs(), x.shape[1], h.shape[1]))

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        if ctx.wait is not None:
            ctx.wait()
        x, p = ctx.saved_tensors
        grad_p = None
        if ctx.needs_input_grad[2]:
            grad_p = _tile(ctx.gamma * (x.t() @ g), p.shape) * (2 * p.abs())
        return g if ctx.needs_input_grad[0] else None, None, grad_p, None, None


class ShapedModel(nn.Module):
    """The tensors of ``job`` (scaled by ``scale``) as parameters under their names, a classifier of
    ``in_features`` inputs into ``classes`` logits, and ``job.compute_s`` of emulated compute per
    training step (see the module's docstring)."""

    def __init__(self, job: Workload, scale: float = 1.0, in_features: int = 64, classes: int = 10):
        super().__init__()
        self.job = scaled_workload(job, scale) if scale != 1 else job
        self.scale, self.in_features, self.classes = scale, in_features, classes
        order = list(reversed(self.job.tensors))  # registration (forward) order: backward's reversed
        self._chain: list[nn.Parameter] = []
        for t in order:
            p = nn.Parameter(torch.randn(t.shape) * INIT_STD)
            _attach(self, t.name, p)
            self._chain.append(p)
        numel = sum(p.numel() for p in self._chain)
        # initial logits of unit variance: each logit sums in_features x numel / (in_features x classes)
        # terms p|p| (variance 3 std^4) times x (variance 1)
        self.gamma = 1.0 / (INIT_STD ** 2 * math.sqrt(3 * numel / classes))
        # deadlines, seconds from the start of each pass, one per layer in the chain's order
        split = backward_split(self.job)  # backward order
        backward_s = [s for _, s in split]
        self.backward_deadlines = list(reversed(_cumulative(backward_s)))  # chain order
        forward_total = self.job.compute_s * (1 - self.job.overlap)
        total_b = sum(backward_s)
        forward_s = [forward_total * s / total_b if total_b else forward_total / len(order)
                     for s in reversed(backward_s)]
        self.forward_deadlines = _cumulative(forward_s)
        self._forward_clock, self._backward_clock = _Clock(), _Clock()

    @property
    def compute_s(self) -> float:
        """Emulated seconds per training step (forward and backward)."""
        return self.job.compute_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        emulate = self.training and torch.is_grad_enabled()
        h = x.new_zeros(x.shape[0], self.classes)
        fwd, bwd = self._forward_clock, self._backward_clock
        fwd.start()
        for i, p in enumerate(self._chain):
            wait = (lambda d=self.backward_deadlines[i]: bwd.wait_until(d)) if emulate else None
            h = _Layer.apply(h, x, p, self.gamma, wait)
            if emulate:
                fwd.wait_until(self.forward_deadlines[i])
        return _BackwardStart.apply(h, bwd) if emulate else h


def _cumulative(xs: Sequence[float]) -> list[float]:
    out, total = [], 0.0
    for x in xs:
        total += x
        out.append(total)
    return out


def _attach(root: nn.Module, name: str, p: nn.Parameter) -> None:
    """Register ``p`` as ``name`` ("layer1.0.conv1.weight"), making plain container modules on the way."""
    *path, leaf = name.split(".")
    module = root
    for part in path:
        child = module._modules.get(part)
        if child is None:
            child = nn.Module()
            module.add_module(part, child)
        module = child
    module.register_parameter(leaf, p)
