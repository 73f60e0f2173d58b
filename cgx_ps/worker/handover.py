"""How the DDP hook's gradients reach the block pipeline: this step's hand-overs, and the early
hand-over that takes them from autograd before DDP copies them into its bucket.

After ``zero_grad(set_to_none=True)`` (torch's default) autograd hands every gradient over as a
fresh tensor, and DDP's reducer copies it into its bucket before the bucket goes to the hook: one
pass over every gradient per step, on the training thread, that ``DistributedOptimizer`` never
makes (issue 14: it was most of the hook's extra CPU per step). So from the step after DDP settles
its buckets, a post-accumulate-grad hook on each parameter, which autograd runs before DDP's
reducer sees the gradient, starts the gradient's blocks at once (encoded from autograd's tensor,
as the optimizer does) and points ``.grad`` at the gradient's place in DDP's bucket: DDP finds it
there and skips its copy, and the average is decoded into that place.

Only where that is safe (``early_handover``): the hook's state holds the DDP model itself, built
with ``gradient_as_bucket_view=True``, no ``find_unused_parameters`` or ``static_graph``, blocks in
place. ``no_sync()`` steps are left alone (DDP's reducer is not armed then). Two private DDP flags
are read through ``getattr``; on a torch without them there is no early hand-over.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:
    from .frontend import StepDriver

__all__ = ["EarlyHandover", "StepGradients", "buckets_settled", "early_handover", "is_ddp"]


def early_handover(is_ddp: bool, bucket_view: bool, find_unused: bool, static_graph: bool,
                   in_place: bool) -> bool:
    """Whether gradients go to the pipeline as autograd finishes them, straight into DDP's bucket
    (module doc): only where DDP's bucket views are ``.grad`` (``gradient_as_bucket_view``) and
    DDP calls the hook for every parameter as its gradient arrives (not ``find_unused_parameters``,
    whose unused ones DDP fills in itself, nor ``static_graph``, which delays the first step's
    hooks), and where blocks may work in place (no intra-node reduction, no tuner)."""
    return is_ddp and bucket_view and not find_unused and not static_graph and in_place


def is_ddp(module: torch.nn.Module) -> bool:
    return isinstance(module, torch.nn.parallel.DistributedDataParallel)


def buckets_settled(ddp: torch.nn.Module) -> bool:
    """DDP rebuilt its buckets in the order gradients arrived (once, at the second forward): from
    then on each parameter's place in them stays put. A torch without the flag: never (no early
    hand-over)."""
    return bool(getattr(ddp, "_has_rebuilt_buckets", False))


class StepGradients:
    """This step's gradients handed over, by tensor name: where each one's blocks read it
    (autograd's tensor, or DDP's bucket) and where its average goes (its place in DDP's bucket).
    Blocks may wait for other tensors, so these live until the step's last bucket. Buckets arrive
    on DDP's thread and early hand-overs on autograd's: one lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sources: dict[str, torch.Tensor] = {}
        self._targets: dict[str, torch.Tensor] = {}
        self._early: set[str] = set()  # handed over early: its source is autograd's tensor

    def source(self, name: str) -> torch.Tensor | None:
        return self._sources.get(name)

    def target(self, name: str) -> torch.Tensor | None:
        return self._targets.get(name)

    def from_bucket(self, grads: dict[str, torch.Tensor]) -> None:
        """A bucket's gradients (views into it): read and written there, except those handed over
        early, which are on their way already."""
        with self._lock:
            for name, grad in grads.items():
                if name not in self._early:
                    self._sources[name] = self._targets[name] = grad

    def early(self, name: str, grad: torch.Tensor, place: torch.Tensor) -> None:
        with self._lock:
            self._sources[name], self._targets[name] = grad, place
            self._early.add(name)

    def release(self, driver: StepDriver, blocks: list[int]) -> None:
        """Let go of autograd's tensors whose blocks are all submitted (each holds its gradient
        until it is encoded): handed over early, they would otherwise live to the step's end."""
        pipe = driver.pipe
        with self._lock:
            for block in blocks:
                for name in pipe.buffers.tensors_in(block):
                    if name in self._early and not pipe.waits_for(name):
                        self._sources.pop(name, None)

    def forget(self) -> int:
        """The step is over (or failed): drop everything; how many were handed over early."""
        with self._lock:
            early = len(self._early)
            self._sources, self._targets, self._early = {}, {}, set()
        return early


class EarlyHandover:
    """The post-accumulate-grad hooks of one DDP model (module doc), armed once, at the end of the
    first step (every parameter's gradient has been accumulated then: no hook is added while
    autograd may run one)."""

    def __init__(self, module: torch.nn.Module, gradients: StepGradients) -> None:
        self.module, self.gradients = module, gradients
        self._views: dict[str, torch.Tensor] = {}  # each gradient's place in DDP's settled buckets
        self._hooks: list | None = None  # None: not armed yet; []: decided against
        self._driver: StepDriver | None = None
        self._name_of: Callable[[torch.Tensor], str | None] = lambda _: None

    @property
    def armed(self) -> bool:
        return bool(self._hooks)

    def learn(self, grads: dict[str, torch.Tensor]) -> None:
        """A bucket's gradient views: once DDP's buckets are settled, the places of the next
        step's early hand-overs."""
        if self._hooks and buckets_settled(self.module):
            self._views.update(grads)

    def arm_once(self, driver: StepDriver, params: dict[str, torch.Tensor]) -> None:
        """At the end of the first step: hook every parameter if ``early_handover`` allows it."""
        if self._hooks is not None:
            return
        ddp = self.module
        self._hooks = []
        if not early_handover(is_ddp(ddp), getattr(ddp, "gradient_as_bucket_view", False),
                              getattr(ddp, "find_unused_parameters", True), getattr(ddp, "static_graph", True),
                              driver.in_place.allowed):
            return
        self._driver = driver
        name_of = {id(t): n for n, t in params.items()}
        self._name_of = lambda p: name_of.get(id(p))
        self._hooks = [p.register_post_accumulate_grad_hook(self._gradient_done) for p in params.values()]

    def _gradient_done(self, param: torch.Tensor) -> None:
        """Autograd accumulated ``param``'s gradient (DDP's reducer has not seen it yet): start
        its blocks and point ``.grad`` at its place in DDP's bucket, so DDP does not copy it."""
        ddp = self.module
        if not (getattr(ddp, "require_forward_param_sync", False) and buckets_settled(ddp)):
            return  # no_sync() accumulation, or buckets not settled yet: DDP copies, as without this
        name = self._name_of(param)
        view, grad = self._views.get(name), param.grad
        if view is None or grad is None or grad.data_ptr() == view.data_ptr():
            return  # unknown place, or already there (zero_grad(set_to_none=False)): nothing to skip
        if grad.dtype != view.dtype or grad.shape != view.shape or grad.device != view.device:
            return
        driver, gradients = self._driver, self.gradients
        try:
            driver.gradient_arrived()
            gradients.early(name, grad, view)
            param.grad = view  # DDP finds the gradient in its bucket view: no copy
            gradients.release(driver, driver.submit_ready([name], gradients.source, gradients.target))
        except BaseException:
            driver.abort()
            gradients.forget()
            raise
