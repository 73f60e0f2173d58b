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

Auto mode's uncompressed steps (DDP's own allreduce, ``ddp_hook.py``) take the same way in: with a
Python comm hook registered, DDP copies each gradient into its bucket without dividing it (its
built-in allreduce divides while copying), so the hook had to make a pass of its own over every
bucket to divide it, on the training thread, as torch's ``allreduce_hook`` does (4-9 ms per step
for mlp17m's 68 MB on a 2-core machine, ``benchmarks/hook_overhead.py``). The hand-over instead divides
each gradient by the group's size straight into its place in DDP's bucket (one pass, as DDP's
copy is) and the hook divides only what did not come that way (``early_action``).

Only where that is safe (``early_handover``): the hook's state holds the DDP model itself, built
with ``gradient_as_bucket_view=True``, no ``find_unused_parameters`` or ``static_graph``, and
either blocks in place or steps that may go through DDP's allreduce. And only on a backward DDP
reduces: a forward hook on the DDP model arms the hand-over when that forward armed DDP's
reducer (grad enabled, not in ``no_sync()``: what ``_post_forward`` checks), and the step's last
bucket disarms it, as it ends the reducer's backward. Any other backward (a gradient probe
through ``ddp.module``, a ``no_sync()`` step, validation with gradients) is left to autograd:
local gradients, nothing pushed, as with plain DDP.

A user's own hooks on a parameter see what they see under plain DDP. Autograd runs a
parameter's post-accumulate-grad hooks in the order they were registered, all of them before DDP's
reducer: under plain DDP every one of them sees autograd's undivided local gradient, and what it
changes in place is what DDP copies into its bucket. A hook registered before the hand-over's
(which is installed at the end of the first step) runs before it, and so sees the same and is
honoured the same. One registered later would run after the gradient was divided into its place
in DDP's bucket or handed to the pipeline: it would see the bucket (the divided gradient, or the
last step's average) and its changes would be lost. So the hand-over acts only where its hook is
the parameter's last (``runs_last``); a gradient with a user's hook after it is left to DDP, which
copies it after every hook, as without the hand-over. ``register_hook`` hooks run before
accumulation, so before any of this.

The hooks hold the hand-over weakly and are removed when it is dropped (with its state) or when
its session ends (``cgx_ps.worker.shutdown()``); the hand-over holds the DDP model weakly, as DDP's
reducer holds the state out of the garbage collector's sight. One private DDP flag and each
parameter's private hook table are read through ``getattr``; on a torch without the flag there is
no early hand-over, without the table none for that parameter.
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch

if TYPE_CHECKING:
    from .step_driver import StepDriver

__all__ = ["EarlyHandover", "StepGradients", "buckets_settled", "early_action", "early_handover", "hands_over",
           "is_ddp", "runs_last"]


def early_handover(is_ddp: bool, bucket_view: bool, find_unused: bool, static_graph: bool,
                   in_place: bool, may_allreduce: bool = False) -> bool:
    """Whether gradients are taken from autograd as it finishes them, straight into DDP's bucket
    (module doc): only where DDP's bucket views are ``.grad`` (``gradient_as_bucket_view``) and
    DDP calls the hook for every parameter as its gradient arrives (not ``find_unused_parameters``,
    whose unused ones DDP fills in itself, nor ``static_graph``, which delays the first step's
    hooks), and where a step can use them (``early_action``): blocks may work in place (no
    intra-node reduction, no adaptive bits), or steps may go through DDP's allreduce (auto mode)."""
    return is_ddp and bucket_view and not find_unused and not static_graph and (in_place or may_allreduce)


def early_action(allreduce_step: bool, in_place: bool, requires_grad: bool) -> str | None:
    """What the hand-over does with a gradient autograd just finished on a step DDP reduces:
    "scale" (a step through DDP's allreduce: divide it by the group's size into its place in
    DDP's bucket, DDP's own fused copy), "submit" (a step to the shards with blocks in place:
    start its blocks from autograd's tensor), or None (leave it to DDP: it copies, the hook
    divides or encodes from its bucket). A gradient that itself requires grad (``create_graph``)
    is left to DDP too: written through ``out=`` it would lose its graph."""
    if requires_grad:
        return None
    if allreduce_step:
        return "scale"
    return "submit" if in_place else None


def hands_over(armed: bool, session_open: bool, settled: bool) -> bool:
    """Whether a gradient autograd just finished is handed over early: only on a backward DDP's
    reducer reduces (``armed`` by a synchronizing DDP forward, until the step's last bucket), while
    the state's session is open, and once DDP's buckets are settled (the places are known). Else
    autograd keeps it, as plain DDP does (DDP copies it into its bucket, or ignores it)."""
    return armed and session_open and settled


def runs_last(hooks: Mapping[int, Any] | None, own: int | None) -> bool:
    """Whether the hand-over's hook (handle id ``own``) is the last of a parameter's
    post-accumulate-grad hooks (``hooks``: the parameter's table, by handle id, in the order
    autograd runs them). If a user's hook comes after it, the gradient is left to DDP, so that hook
    sees autograd's gradient and its changes are honoured, as under plain DDP (module doc)."""
    return own is not None and bool(hooks) and next(reversed(hooks)) == own


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
        self._scaled: set[str] = set()  # divided into DDP's bucket early (a step through DDP's allreduce)

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

    def scaled(self, name: str) -> None:
        with self._lock:
            self._scaled.add(name)

    def was_scaled(self, name: str) -> bool:
        """Whether this step's gradient of ``name`` is in DDP's bucket divided already."""
        with self._lock:
            return name in self._scaled

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
            early = len(self._early) + len(self._scaled)
            self._sources, self._targets, self._early, self._scaled = {}, {}, set(), set()
        return early


class EarlyHandover:
    """The post-accumulate-grad hooks of one DDP model (module doc), installed once, at the end of
    the first step (every parameter's gradient has been accumulated then: no hook is added while
    autograd may run one), with a forward hook on the DDP model that arms them for its backward."""

    def __init__(self, module: torch.nn.Module, gradients: StepGradients) -> None:
        self._module = weakref.ref(module)  # weak: see the module doc
        self.gradients = gradients
        self._views: dict[str, torch.Tensor] = {}  # each gradient's place in DDP's settled buckets
        self._handles: list | None = None  # None: not installed yet; []: decided against, or removed
        self._driver: StepDriver | None = None
        self._name_of: Callable[[torch.Tensor], str | None] = lambda _: None
        self._hook_ids: dict[str, int] = {}  # each parameter's hook of the hand-over, by handle id (runs_last)
        self._armed = False  # the last DDP forward armed DDP's reducer, and its backward is not over
        self._session_open = True

    @property
    def installed(self) -> bool:
        return bool(self._handles)

    def learn(self, grads: dict[str, torch.Tensor]) -> None:
        """A bucket's gradient views: once DDP's buckets are settled, the places of the next
        step's early hand-overs."""
        module = self._module()
        if self._handles and module is not None and buckets_settled(module):
            self._views.update(grads)

    def install_once(self, driver: StepDriver, params: dict[str, torch.Tensor], may_allreduce: bool) -> None:
        """At the end of the first step: hook every parameter if ``early_handover`` allows it.
        ``may_allreduce``: whether any step may go through DDP's allreduce (``driver.route()``
        then says which do)."""
        if self._handles is not None:
            return
        ddp = self._module()
        self._handles = []
        if ddp is None or not early_handover(is_ddp(ddp), getattr(ddp, "gradient_as_bucket_view", False),
                                             getattr(ddp, "find_unused_parameters", True),
                                             getattr(ddp, "static_graph", True), driver.in_place.allowed,
                                             may_allreduce):
            return
        self._driver = driver
        name_of = {id(t): n for n, t in params.items()}
        self._name_of = lambda p: name_of.get(id(p))
        gradient_done = _weakly(self._gradient_done)
        handles = [p.register_post_accumulate_grad_hook(gradient_done) for p in params.values()]
        self._hook_ids = {name: handle.id for name, handle in zip(params, handles)}
        handles.append(ddp.register_forward_hook(_weakly(self._forward_done)))
        self._handles = handles
        weakref.finalize(self, _remove, handles).atexit = False  # dropped with its state: hooks go too
        driver.pipe.when_session_closes(_weakly(self.close))

    def disarm(self) -> None:
        """The step's last bucket (or a failed step): DDP's reducer is done with this backward."""
        self._armed = False

    def close(self) -> None:
        """The session ended: remove the hooks; every later backward is autograd's alone."""
        self._session_open = self._armed = False
        _remove(self._handles or [])
        self._views.clear()

    def _forward_done(self, ddp: torch.nn.Module, inputs, output) -> None:
        """After DDP's forward: armed where it armed its reducer for the backward to come (DDP's
        ``_post_forward``); a forward that did not (``no_sync()``, no grad) leaves it as it was,
        as it leaves the reducer."""
        if torch.is_grad_enabled() and getattr(ddp, "require_backward_grad_sync", False):
            self._armed = True

    def _gradient_done(self, param: torch.Tensor) -> None:
        """Autograd accumulated ``param``'s gradient (DDP's reducer has not seen it yet): start
        its blocks, or divide it into its place (``early_action``), and point ``.grad`` at its
        place in DDP's bucket, so DDP does not copy it."""
        ddp = self._module()
        if ddp is None or not hands_over(self._armed, self._session_open, buckets_settled(ddp)):
            return  # a backward DDP does not reduce, or buckets not settled yet: as without this
        name = self._name_of(param)
        view, grad = self._views.get(name), param.grad
        if view is None or grad is None or grad.data_ptr() == view.data_ptr():
            return  # unknown place, or already there (zero_grad(set_to_none=False)): nothing to skip
        if grad.dtype != view.dtype or grad.shape != view.shape or grad.device != view.device:
            return
        if not runs_last(getattr(param, "_post_accumulate_grad_hooks", None), self._hook_ids.get(name)):
            return  # a user's hook runs after this one: it must see autograd's gradient (module doc)
        driver, gradients = self._driver, self.gradients
        try:
            driver.gradient_arrived()  # the step's first gradient: auto mode's decision applies now
            route = driver.route()
            action = early_action(route.path == "allreduce", driver.in_place.allowed, grad.requires_grad)
            if action == "scale":
                torch.div(grad, route.size, out=view)  # what DDP's copy and the hook's division would give
                gradients.scaled(name)
                param.grad = view
            elif action == "submit":
                gradients.early(name, grad, view)
                param.grad = view  # DDP finds the gradient in its bucket view: no copy
                gradients.release(driver, driver.submit_ready([name], gradients.source, gradients.target))
        except BaseException:
            driver.abort()
            gradients.forget()
            self.disarm()
            raise


def _weakly(method: Callable) -> Callable:
    """``method`` called while its object lives, nothing after: what autograd, DDP and the engine
    hold of the hand-over, so that they do not keep it (and its state) alive."""
    ref = weakref.WeakMethod(method)

    def call(*args) -> None:
        bound = ref()
        if bound is not None:
            bound(*args)

    return call


def _remove(handles: list) -> None:
    for handle in handles:
        handle.remove()
