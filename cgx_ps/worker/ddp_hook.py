"""The DDP communication hook: cgx-ps under any trainer built on ``DistributedDataParallel``.

    cgx.init()
    dist.init_process_group("gloo")                    # or "nccl": DDP needs its own group
    ddp = DDP(model)
    ddp.register_comm_hook(cgx.DDPHookState(ddp, compression="4bit"), cgx.ddp_comm_hook)

Trainers that wrap the model themselves register the hook on the model they wrapped: Lightning
in a callback's ``on_fit_start`` on ``trainer.strategy.model`` (its ``DDPStrategy(ddp_comm_hook=,
ddp_comm_state=)`` registers hooks only on CUDA devices and silently ignores them elsewhere),
Accelerate on what ``prepare`` returns, the HF Trainer on ``trainer.model_wrapped`` in a
callback's ``on_train_begin`` (cgx_ps/examples/). The state needs only a module whose parameters
are the DDP model's (the DDP wrapper, the model it wraps, or a LightningModule), and registers
with the shards at the first backward, not before.

DDP calls the hook once per bucket of gradients, in bucket order, as backward produces them. The
hook is the second front end of the block pipeline (``pipeline.py``): it names the bucket's
gradients by matching the bucket's parameters to the module's by identity, so blocks are keyed
by parameter names (the same layout on every rank, whatever DDP's bucket order or rebuild does),
starts every block whose tensors have all arrived, and returns a future that completes once the
bucket's blocks are decoded and averaged into the bucket. DDP's overlap of communication with
backward works unchanged; the last bucket also starts the blocks of tensors DDP never handed over
(zeros), waits for every block and ends the step. The tuner (adaptive bits, auto mode) runs at
the next step's first bucket, on the training thread.

A block whose tensors lie end to end in one bucket (every block of a large tensor; small tensors
DDP put in the same bucket in layout order) is encoded straight from the bucket's memory and its
average decoded straight back into it; blocks across buckets are copied through the pipeline's
buffers (``buffers.work_in_place`` says when in place is not allowed at all). DDP then copies
the bucket into ``.grad``, unless it was built with ``gradient_as_bucket_view=True``: then the
gradients are the bucket, and that copy goes too (recommended).

Early hand-over (``early_handover``: the state holds the DDP model itself, built with
``gradient_as_bucket_view=True``, no ``find_unused_parameters`` or ``static_graph``, blocks in
place): after ``zero_grad(set_to_none=True)`` (torch's default) autograd hands every gradient
over as a fresh tensor, and DDP's reducer copies it into its bucket before the bucket goes to the
hook: one pass over every gradient per step, on the training thread, that
``DistributedOptimizer`` never makes (issue 14: it was most of the hook's extra CPU per step). So
from the step after DDP settles its buckets, a post-accumulate-grad hook on each parameter, which
autograd runs before DDP's reducer sees the gradient, starts the gradient's blocks at once
(encoded from autograd's tensor, as the optimizer does) and points ``.grad`` at the gradient's
place in DDP's bucket: DDP finds it there and skips its copy, and the average is decoded into
that place. ``no_sync()`` steps are left alone (DDP's reducer is not armed then).

With DDP, DDP itself divides by nothing when a hook is registered: the pipeline averages (it
divides the aggregate by the world size), as torch's ``allreduce_hook`` does. ``no_sync()``
steps never call the hook: gradients accumulate in the parameters and travel at the next
synchronized step. Unused parameters (``find_unused_parameters=True``) arrive as zeros in their
bucket on every rank. Mixed precision: ``allow_non_finite`` is on by default, as DDP's own
allreduce lets NaN/Inf through: a rank's overflow reaches every rank as NaN, and a GradScaler
skips the same step everywhere.

Auto mode (``compression="auto"``) never makes DDP slower than DDP: the steps it sends
uncompressed go through DDP's own allreduce on the DDP model's process group (as torch's
``allreduce_hook``: divide, sum), not through the shards' fp32 path, so on a link fast enough
that compression does not pay the hook costs what DDP costs. Which path a step takes is
``uncompressed_path``; every rank applies auto mode's decisions at the same step boundary, so
every rank takes the same one. ``uncompressed_via="shards"`` keeps every step on the shards.
Auto mode's model judges that path as the optimizer's does, by timing an all_reduce on the same
group at each decision (``collective.allreduce_rate``, every rank at the step's first gradient,
before any bucket of the step is started).
"""

# No ``from __future__ import annotations`` here: DDP's register_comm_hook compares the hook's
# annotations with dist.GradBucket and Future[Tensor] as objects, and refuses strings.
import threading
import time
import weakref
from typing import Iterable

import torch
import torch.distributed as dist

from ..v1 import ps_pb2
from .autotune import Decision
from .collective import allreduce_rate, collective_group
from .errors import CgxPsError, ConfigError
from .frontend import StepDriver, SyncOptions, uncompressed_path
from .layout import DEFAULT_BLOCK_BYTES, Compression
from .pipeline import StepStats

__all__ = ["DDPHookState", "ddp_comm_hook", "early_handover", "uncompressed_path"]


# States created but not yet registered with the shards, in creation order (the same on every
# rank: it names their tensors in the session). The first backward of any of them registers them
# all as one session (several DDP models in one process: a GAN), so create them all before
# training starts. Weak: a state dropped before training (no DDP model holds it) takes no part.
_waiting: list[weakref.ref] = []
_waiting_lock = threading.Lock()


def early_handover(is_ddp: bool, bucket_view: bool, find_unused: bool, static_graph: bool,
                   in_place: bool) -> bool:
    """Whether gradients go to the pipeline as autograd finishes them, straight into DDP's bucket
    (module doc): only where DDP's bucket views are ``.grad`` (``gradient_as_bucket_view``) and
    DDP calls the hook for every parameter as its gradient arrives (not ``find_unused_parameters``,
    whose unused ones DDP fills in itself, nor ``static_graph``, which delays the first step's
    hooks), and where blocks may work in place (no intra-node reduction, no tuner)."""
    return is_ddp and bucket_view and not find_unused and not static_graph and in_place


class DDPHookState:
    """The state ``ddp_comm_hook`` takes: one DDP model's side of the block pipeline.

    module: any ``nn.Module`` whose parameters are the DDP model's own tensors (the DDP wrapper,
        the wrapped model, or a LightningModule); tensors are named by ``named_parameters()``.
    compression, error_feedback, warmup_steps, block_bytes: as for ``DistributedOptimizer``.
    allow_non_finite: NaN/Inf gradients reach every rank as NaN (default, as DDP's allreduce
        does; a GradScaler then skips the step on every rank); False raises instead.
    uncompressed_via: where auto mode's uncompressed steps go: "allreduce" (default: DDP's own
        allreduce on the DDP model's process group, or the default group when ``module`` is not
        the DDP wrapper) or "shards" (fp32 through the shards).

    Fastest: give it the DDP wrapper built with ``gradient_as_bucket_view=True`` and keep torch's
    ``zero_grad()``: gradients are then handed over early, without DDP's copy into its bucket (the
    module doc). DDP's ``bucket_cap_mb`` needs no tuning for the hook: DDP never splits a tensor
    across buckets, and a block starts as soon as its tensors' gradients have arrived.
    """

    def __init__(self, module: torch.nn.Module, compression: str | Compression | None = "4bit", *,
                 error_feedback: bool = False, warmup_steps: int = 0, block_bytes: int = DEFAULT_BLOCK_BYTES,
                 allow_non_finite: bool = True, uncompressed_via: str = "allreduce") -> None:
        if not isinstance(module, torch.nn.Module):
            raise ConfigError(f"DDPHookState needs the model (an nn.Module), got {type(module).__name__}")
        self.options = SyncOptions.of(compression, error_feedback, warmup_steps, block_bytes, allow_non_finite,
                                      uncompressed_via)
        self.uncompressed_via = uncompressed_via
        self.module = module
        # set when registered with the shards (the first backward)
        self._driver: StepDriver | None = None
        self._params: dict[str, torch.Tensor] = {}
        self._name_of: dict[int, str] = {}
        # this step: each gradient handed over, where its blocks read it (autograd's tensor, or DDP's
        # bucket) and where its average goes (its place in DDP's bucket); blocks may wait for others
        self._sources: dict[str, torch.Tensor] = {}
        self._targets: dict[str, torch.Tensor] = {}
        self._early: set[str] = set()  # handed over early: its source is autograd's tensor
        self._lock = threading.Lock()
        # early hand-over: each gradient's view in DDP's settled buckets (learned from the buckets),
        # and the post-accumulate-grad hooks (registered at the end of the first step)
        self._views: dict[str, torch.Tensor] = {}
        self._early_hooks: list | None = None
        with _waiting_lock:
            _waiting.append(weakref.ref(self))

    # ---- registration ------------------------------------------------------------------------

    def open(self) -> StepDriver:
        """Register with the shards (done by the first backward; call it earlier to fail early).
        Every state of the process not yet registered registers with it, as one session."""
        if self._driver is not None:
            return self._driver
        with _waiting_lock:
            if self._driver is None:
                states = [s for s in (ref() for ref in _waiting) if s is not None and s._driver is None]
                named = [s._named_tensors() for s in states]
                drivers = StepDriver.open_together(named, [s.options for s in states],
                                                   [s._probe_allreduce for s in states])
                for state, tensors, driver in zip(states, named, drivers):
                    state._params = dict(tensors)
                    state._name_of = {id(t): n for n, t in tensors}
                    state._driver = driver
                _waiting[:] = [ref for ref in _waiting if ref() is not None and ref()._driver is None]
        return self._driver

    def _named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        module = self.module
        inner = getattr(module, "module", None)
        if _is_ddp(module) and isinstance(inner, torch.nn.Module):
            module = inner  # its names without DDP's "module." prefix: the same as the model's
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ConfigError(f"{type(self.module).__name__} has no parameters that require gradients")
        return named

    def _names(self, params: Iterable[torch.Tensor]) -> list[str]:
        names = []
        for p in params:
            name = self._name_of.get(id(p))
            if name is None or self._params[name] is not p:
                raise CgxPsError(
                    f"DDP hands over the gradient of a parameter of shape {tuple(p.shape)} that is not among "
                    f"the trainable parameters of the {type(self.module).__name__} given to DDPHookState when "
                    f"it registered: give it the DDP model (or the model DDP wraps), and create it after "
                    f"freezing or unfreezing parameters")
            names.append(name)
        return names

    # ---- one bucket --------------------------------------------------------------------------

    def communicate(self, bucket: torch.distributed.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """What ``ddp_comm_hook`` does: start the bucket's blocks, return its future."""
        driver = self.open()
        pipe = driver.pipe
        try:
            driver.gradient_arrived()  # a step's first bucket: auto mode's decision is applied here
        except BaseException:
            driver.abort()
            raise
        group = self._group()
        if uncompressed_path(pipe.compress, self.uncompressed_via, group is not None) == "allreduce":
            return self._allreduce(bucket, driver, group)
        try:
            names = self._names(bucket.parameters())
            grads = dict(zip(names, bucket.gradients()))  # views into bucket.buffer()
            if self._early_hooks and _buckets_settled(self.module):
                self._views.update(grads)  # DDP's buckets are settled: next step's places
            with self._lock:
                for name, grad in grads.items():
                    if name not in self._early:  # those handed over early are on their way
                        self._sources[name] = self._targets[name] = grad
            self._release(driver.submit_ready(names, self._sources.get, self._targets.get))
            last = bucket.is_last()  # DDP hands buckets over in order: every other one came before
            early = 0
            if last:
                driver.submit_rest(self._sources.get, self._targets.get)  # tensors no bucket held: zeros
                early = len(self._early)
                self._forget_step()
                if self._early_hooks is None:
                    self._start_early_handover(driver)
        except BaseException:
            driver.abort()
            self._forget_step()
            raise
        blocks = pipe.blocks_of(names)
        waiting = list(range(pipe.num_blocks)) if last else blocks
        waiting_since = time.perf_counter()
        buffer = bucket.buffer()

        def averaged(done: torch.futures.Future) -> torch.Tensor:
            if last:
                driver.finish(waiting_since).early_gradients = early  # all done: raises the first error
            for future in done.value():
                future.wait()
            for block in blocks:  # this bucket's tensors only; a no-op where decoded there
                pipe.copy_out(block, grads.get)
            return buffer

        return torch.futures.collect_all([pipe.future(b) for b in waiting]).then(averaged)

    def _forget_step(self) -> None:
        with self._lock:
            self._sources, self._targets, self._early = {}, {}, set()

    def _release(self, blocks: list[int]) -> None:
        """Let go of autograd's tensors whose blocks are all submitted (each holds its gradient
        until it is encoded): handed over early, they would otherwise live to the step's end."""
        pipe = self._driver.pipe
        with self._lock:
            for block in blocks:
                for name in pipe.buffers.tensors_in(block):
                    if name in self._early and not pipe.waits_for(name):
                        self._sources.pop(name, None)

    # ---- early hand-over (module doc) ----------------------------------------------------------

    def _start_early_handover(self, driver: StepDriver) -> None:
        """Once, at the end of the first step (every parameter's gradient has been accumulated:
        no hook is added while autograd may run one)."""
        ddp = self.module
        self._early_hooks = []
        if not early_handover(_is_ddp(ddp), getattr(ddp, "gradient_as_bucket_view", False),
                              getattr(ddp, "find_unused_parameters", True), getattr(ddp, "static_graph", True),
                              driver.in_place.allowed):
            return
        self._early_hooks = [p.register_post_accumulate_grad_hook(self._gradient_done)
                             for p in self._params.values()]

    def _gradient_done(self, param: torch.Tensor) -> None:
        """Autograd accumulated ``param``'s gradient (DDP's reducer has not seen it yet): start
        its blocks and point ``.grad`` at its place in DDP's bucket, so DDP does not copy it."""
        ddp = self.module
        if not (getattr(ddp, "require_forward_param_sync", False) and _buckets_settled(ddp)):
            return  # no_sync() accumulation, or buckets not settled yet: DDP copies, as without this
        name = self._name_of.get(id(param))
        view, grad = self._views.get(name), param.grad
        if view is None or grad is None or grad.data_ptr() == view.data_ptr():
            return  # unknown place, or already there (zero_grad(set_to_none=False)): nothing to skip
        if grad.dtype != view.dtype or grad.shape != view.shape or grad.device != view.device:
            return
        driver = self._driver
        try:
            driver.gradient_arrived()
            with self._lock:
                self._sources[name], self._targets[name] = grad, view
                self._early.add(name)
            param.grad = view  # DDP finds the gradient in its bucket view: no copy
            self._release(driver.submit_ready([name], self._sources.get, self._targets.get))
        except BaseException:
            driver.abort()
            self._forget_step()
            raise

    def _group(self) -> "dist.ProcessGroup | None":
        """The process group of auto mode's uncompressed steps, DDP's own allreduce: the DDP
        model's, else the default one (None: the shards)."""
        return collective_group(self.module.process_group if _is_ddp(self.module) else None, self.uncompressed_via)

    def _probe_allreduce(self, nbytes: int) -> float | None:
        """For auto mode's model: the all_reduce rate on the group DDP's allreduce uses, or None
        (uncompressed steps go through the shards). The tuner calls it on every rank at the same
        step (a collective), at a step's first gradient, before any of that step's buckets (or,
        on uncompressed steps, DDP allreduce calls) is started, so it never interleaves with them."""
        group = self._group()
        return allreduce_rate(group, nbytes) if group is not None else None

    def _allreduce(self, bucket: torch.distributed.GradBucket, driver: StepDriver,
                   group) -> torch.futures.Future[torch.Tensor]:
        """The bucket averaged by DDP's own allreduce, as torch's ``allreduce_hook`` does it
        (divide, then sum; every rank gets the same bytes). The last bucket ends the step."""
        buffer = bucket.buffer()
        buffer.div_(dist.get_world_size(group))
        future = dist.all_reduce(buffer, group=group, async_op=True).get_future()
        if not bucket.is_last():
            return future.then(lambda done: done.value()[0])
        waiting_since = time.perf_counter()

        def step_done(done: torch.futures.Future) -> torch.Tensor:
            try:
                averaged = done.value()[0]
            except BaseException:
                driver.abort()  # the next bucket starts a new step
                raise
            driver.finish_elsewhere(waiting_since)
            return averaged

        return future.then(step_done)

    # ---- checkpoints ---------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """What cgx-ps adds to a checkpoint for this model (counters, codec settings, this rank's
        error-feedback residuals, the tuner's state): save it next to the model's and the
        optimizer's state, e.g. ``{"model": ..., "optimizer": ..., "cgx_ps": state.state_dict()}``."""
        return self._opened().state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Resume from ``state_dict()``'s output, before the first step (registers with the
        shards now if the first backward has not yet); CheckpointError if it does not fit."""
        self.open().load_state_dict(state)

    # ---- what it shows -----------------------------------------------------------------------

    def _opened(self) -> StepDriver:
        if self._driver is None:
            raise CgxPsError("the DDPHookState registers with the shards at the first backward (or open())")
        return self._driver

    @property
    def stats(self) -> StepStats:
        """The last finished step: bytes pushed, exposed communication (from the last bucket
        handed over to the last block decoded), backward and transfer windows."""
        return self._opened().stats

    @property
    def layout(self) -> ps_pb2.Layout:
        return self._opened().layout

    @property
    def intranode(self) -> str | None:
        """How this node's local ranks reduce: "shm", "cuda", or None (alone on the node)."""
        return self._opened().intranode

    @property
    def tuning_history(self) -> list[Decision]:
        return self._opened().tuning_history


def _is_ddp(module: torch.nn.Module) -> bool:
    return isinstance(module, torch.nn.parallel.DistributedDataParallel)


def _buckets_settled(ddp: torch.nn.Module) -> bool:
    """DDP rebuilt its buckets in the order gradients arrived (once, at the second forward): from
    then on each parameter's place in them stays put. A torch without the flag: never (no early
    hand-over)."""
    return bool(getattr(ddp, "_has_rebuilt_buckets", False))


def ddp_comm_hook(state: DDPHookState, bucket: torch.distributed.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The DDP communication hook: ``ddp.register_comm_hook(DDPHookState(ddp), ddp_comm_hook)``.
    Averages the bucket's gradients across all workers through the cgx-ps shards, compressed."""
    if not isinstance(state, DDPHookState):
        raise ConfigError(f"ddp_comm_hook needs a DDPHookState as its state, got {type(state).__name__}")
    return state.communicate(bucket)
