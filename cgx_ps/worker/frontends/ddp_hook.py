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

Early hand-over (``handover.py``): with the DDP model itself, built with
``gradient_as_bucket_view=True``, gradients of a backward DDP reduces (after a synchronizing DDP
forward) are taken from autograd as it finishes them, before DDP copies them into its bucket, and
their averages decoded straight into the bucket. Any other backward (through ``ddp.module``, in
``no_sync()``) keeps its local gradients, as with plain DDP. Its autograd hooks go when the state
is dropped or ``cgx_ps.worker.shutdown()`` ends its session (to re-wrap: ``shutdown()``, ``init()``,
a new DDP model and a new state).

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
that compression does not pay the hook costs what DDP costs. DDP divides while it copies a
gradient into its bucket only when no comm hook is registered; with one (torch's
``allreduce_hook`` too) it copies undivided and the hook makes another pass to divide. With bucket
views the early hand-over divides each gradient into its place in the bucket instead (DDP's one
pass; ``handover.py``), so those steps cost what plain DDP's do. Which path a step takes is the
step driver's route (``route.py``, shared with the optimizer); every rank applies auto mode's
decisions at the same step boundary, so every rank takes the same one.
``uncompressed_via="shards"`` keeps every step on the shards. Auto mode's model judges that path
as the optimizer's does, by timing an all_reduce on the same group at each decision
(``StepRouter.probe``, every rank at the step's first gradient, before any bucket of the step is
started).
"""

# No ``from __future__ import annotations`` here: DDP's register_comm_hook compares the hook's
# annotations with dist.GradBucket and Future[Tensor] as objects, and refuses strings.
import threading
import time
import weakref
from typing import TYPE_CHECKING, Callable, Iterable

import torch
import torch.distributed as dist

from ..errors import CgxPsError, ConfigError
from ..runtime import current_config
from .route import Route
from .step_driver import FrontEndView, StepDriver, SyncOptions
from .handover import EarlyHandover, StepGradients, is_ddp
from ..pipeline.blocks import DEFAULT_BLOCK_BYTES, Compression

if TYPE_CHECKING:
    from .ddp_catch_up import _CatchUp

__all__ = ["DDPHookState", "ddp_comm_hook"]


# States created but not yet registered with the shards, in creation order (the same on every
# rank: it names their tensors in the session). The first backward of any of them registers them
# all as one session (several DDP models in one process: a GAN), so create them all before
# training starts. Weak: a state dropped before training (no DDP model holds it) takes no part.
_waiting: list[weakref.ref] = []
_waiting_lock = threading.Lock()


class DDPHookState(FrontEndView):
    """The state ``ddp_comm_hook`` takes: one DDP model's side of the block pipeline.

    ``ddp.register_comm_hook(DDPHookState(ddp, compression="4bit"), ddp_comm_hook)``. Create the
    states of every DDP model of the process before training starts: the first backward
    registers them all with the shards as one session (``open()``). Shows ``steps_done``, and
    ``stats``, ``layout``, ``intranode`` and ``tuning_history`` once registered (``FrontEndView``).

    Fastest: give it the DDP wrapper built with ``gradient_as_bucket_view=True`` and keep torch's
    ``zero_grad()``: gradients are then handed over early, without DDP's copy into its bucket, and
    on auto mode's steps through DDP's allreduce divided into it as DDP itself would
    (``handover.py``). DDP's ``bucket_cap_mb`` needs no tuning for the hook: DDP never splits a
    tensor across buckets, and a block starts as soon as its tensors' gradients have arrived.
    Hooks of your own (``register_post_accumulate_grad_hook``: clipping, a gradient-norm logger)
    see autograd's undivided local gradient and may change it in place, as under plain DDP; on a
    parameter whose hook was registered after the first step that parameter's gradient is left
    to DDP's copy instead of being handed over early (register such hooks before training).

    Args:
        module: any ``nn.Module`` whose parameters are the DDP model's own tensors (the DDP
            wrapper, the wrapped model, or a LightningModule); tensors are named by
            ``named_parameters()``.
        compression: as for ``DistributedOptimizer`` ("4bit" by default).
        error_feedback: as for ``DistributedOptimizer``.
        warmup_steps: as for ``DistributedOptimizer``.
        block_bytes: as for ``DistributedOptimizer``.
        allow_non_finite: NaN/Inf gradients reach every rank as NaN (the default, as DDP's
            allreduce does; a GradScaler then skips the step on every rank, and the step is
            counted and logged as for ``DistributedOptimizer``); False: the step fails on every
            rank instead (``CgxPsError`` naming the tensors here, ``StepAbandoned`` elsewhere).
        uncompressed_via: where auto mode's uncompressed steps go: "allreduce" (default: DDP's
            own allreduce on the DDP model's process group, or the default group when ``module``
            is not the DDP wrapper) or "shards" (fp32 through the shards).

    Raises:
        ConfigError: ``module`` is not an ``nn.Module``, or an option is out of range.
    """

    def __init__(self, module: torch.nn.Module, compression: str | Compression | None = "4bit", *,
                 error_feedback: bool = False, warmup_steps: int = 0, block_bytes: int = DEFAULT_BLOCK_BYTES,
                 allow_non_finite: bool = True, uncompressed_via: str = "allreduce") -> None:
        if not isinstance(module, torch.nn.Module):
            raise ConfigError(f"DDPHookState needs the model (an nn.Module), got {type(module).__name__}")
        self.options = SyncOptions.of(compression, error_feedback, warmup_steps, block_bytes, allow_non_finite,
                                      uncompressed_via)
        self.uncompressed_via = uncompressed_via
        # The DDP wrapper weakly: its reducer holds this state (the comm hook's) where the garbage
        # collector cannot see it, so a strong reference back would keep both alive for good.
        self._module: Callable[[], torch.nn.Module | None] = (
            weakref.ref(module) if is_ddp(module) else (lambda: module))
        # set when registered with the shards (the first backward)
        self._driver: StepDriver | None = None
        self._params: dict[str, torch.Tensor] = {}
        self._name_of: dict[int, str] = {}
        self._gradients = StepGradients()  # this step's hand-overs
        self._early = EarlyHandover(module, self._gradients)
        self._catch_up: "_CatchUp | None" = None  # quorum rounds' optimizer steps (ddp_catch_up.py)
        with _waiting_lock:
            _waiting.append(weakref.ref(self))

    @property
    def module(self) -> torch.nn.Module:
        """The module given (the DDP wrapper is held weakly: gone once the caller drops it).

        Raises:
            CgxPsError: the DDP model given has been deleted.
        """
        return _alive(self._module)

    # ---- registration ------------------------------------------------------------------------

    def open(self) -> StepDriver:
        """Register with the shards (done by the first backward; call it earlier to fail early).
        Every state of the process not yet registered registers with it, as one session.

        Returns:
            This state's step driver (the same on later calls).

        Raises:
            ConfigError: the module has no trainable parameters, or ``init()`` was not called.
            CgxPsError: registering with the shards failed (``ShardUnavailableError``,
                ``ShardRejectedError``).
        """
        if self._driver is not None:
            return self._driver
        with _waiting_lock:
            if self._driver is None:
                states = [s for s in (ref() for ref in _waiting)
                          if s is not None and s._driver is None and s._module() is not None]
                config = current_config()
                if config.has_quorum and any(s._catch_up is None for s in states):
                    # a late node steps its optimizer for the rounds it missed (ddp_catch_up.py)
                    raise ConfigError(f"CGX_PS_QUORUM={config.quorum} under the DDP hook: call "
                                      f"cgx.catch_up_with(optimizer, hook_state=state) before the first backward")
                named = [s._named_tensors() for s in states]
                drivers = StepDriver.open_together(named, [s.options for s in states],
                                                   [_process_group_of(s._module) for s in states],
                                                   allreduce_blocks=False)
                for state, tensors, driver in zip(states, named, drivers):
                    state._params = dict(tensors)
                    state._name_of = {id(t): n for n, t in tensors}
                    state._driver = driver
                _waiting[:] = [ref for ref in _waiting if ref() is not None and ref()._driver is None]
        return self._driver

    def _named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        module = self.module
        inner = getattr(module, "module", None)
        if is_ddp(module) and isinstance(inner, torch.nn.Module):
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
        """What ``ddp_comm_hook`` does: start the bucket's blocks, return its future.

        Args:
            bucket: the bucket DDP hands over.

        Returns:
            A future that completes with the bucket's buffer, averaged in place.

        Raises:
            CgxPsError: a gradient of a parameter the state does not know (the wrong module),
                or the step failed; the future carries the errors of the blocks (a shard's,
                ``StepAbandoned``).
        """
        if bucket.is_last():  # every gradient of this backward has arrived: DDP's reducer is done
            self._early.disarm()
        driver = self.open()
        pipe = driver.pipe
        try:
            driver.gradient_arrived()  # a step's first bucket: auto mode's decision is applied here
        except BaseException:
            driver.abort()
            self._early.disarm()
            raise
        route = driver.route()
        if route.path == "allreduce":
            return self._allreduce(bucket, driver, route)
        gradients = self._gradients
        try:
            names = self._names(bucket.parameters())
            grads = dict(zip(names, bucket.gradients()))  # views into bucket.buffer()
            self._early.learn(grads)
            gradients.from_bucket(grads)
            gradients.release(driver, driver.submit_ready(names, gradients.source, gradients.target))
            last = bucket.is_last()  # DDP hands buckets over in order: every other one came before
            early = 0
            if last:
                driver.submit_rest(gradients.source, gradients.target)  # tensors no bucket held: zeros
                early = gradients.forget()
                self._early.install_once(driver, self._params, driver.router.may_allreduce())
        except BaseException:
            driver.abort()
            gradients.forget()
            self._early.disarm()
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

    def _allreduce(self, bucket: torch.distributed.GradBucket, driver: StepDriver,
                   route: Route) -> torch.futures.Future[torch.Tensor]:
        """The bucket averaged by DDP's own allreduce on the route's group, as torch's
        ``allreduce_hook`` does it (divide, then sum; every rank gets the same bytes), except that
        gradients the early hand-over already divided into the bucket are not divided again
        (``handover.py``). The last bucket ends the step."""
        group, size, gradients = route.group, route.size, self._gradients
        try:
            if self._early.installed:
                grads = dict(zip(self._names(bucket.parameters()), bucket.gradients()))  # views into the bucket
                self._early.learn(grads)
                for name, grad in grads.items():
                    if not gradients.was_scaled(name):
                        grad.div_(size)
            else:
                bucket.buffer().div_(size)
            future = dist.all_reduce(bucket.buffer(), group=group, async_op=True).get_future()
        except BaseException:
            driver.abort()
            gradients.forget()
            self._early.disarm()
            raise
        if not bucket.is_last():
            return future.then(lambda done: done.value()[0])
        early = gradients.forget()
        self._early.install_once(driver, self._params, True)  # a first step through it
        waiting_since = time.perf_counter()

        def step_done(done: torch.futures.Future) -> torch.Tensor:
            try:
                averaged = done.value()[0]
            except BaseException:
                driver.abort()  # the next bucket starts a new step
                raise
            driver.finish_elsewhere(waiting_since).early_gradients = early
            return averaged

        return future.then(step_done)

    # ---- checkpoints ---------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """What cgx-ps adds to a checkpoint for this model (counters, codec settings, this rank's
        error-feedback residuals, the tuner's state): save it next to the model's and the
        optimizer's state, e.g. ``{"model": ..., "optimizer": ..., "cgx_ps": state.state_dict()}``.

        Returns:
            Plain data and tensors (``torch.save`` keeps them).

        Raises:
            CgxPsError: the state has not registered yet (no backward, no ``open()``).
        """
        return self._cgx_step_driver().state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Resume from ``state_dict()``'s output, before the first step (registers with the
        shards now if the first backward has not yet).

        Args:
            state: what ``state_dict()`` returned (on this rank, for the same model).

        Raises:
            CheckpointError: it does not fit this model's layout.
        """
        self.open().load_state_dict(state)

    # ---- what it shows -----------------------------------------------------------------------

    def _cgx_registered(self) -> StepDriver | None:
        return self._driver


def _alive(module_ref: Callable[[], torch.nn.Module | None]) -> torch.nn.Module:
    module = module_ref()
    if module is None:
        raise CgxPsError("the DDP model given to this DDPHookState has been deleted")
    return module


def _process_group_of(module_ref: Callable[[], torch.nn.Module | None]) -> Callable[[], "dist.ProcessGroup | None"]:
    """The group of auto mode's uncompressed steps, DDP's own allreduce: the DDP model's (None:
    the default group, ``route.collective_group``). Holds the module as the state does (the DDP
    wrapper weakly), never the state: its driver holds this."""
    def group_of() -> "dist.ProcessGroup | None":
        module = _alive(module_ref)
        return module.process_group if is_ddp(module) else None

    return group_of


def ddp_comm_hook(state: DDPHookState, bucket: torch.distributed.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The DDP communication hook: ``ddp.register_comm_hook(DDPHookState(ddp), ddp_comm_hook)``.

    Averages the bucket's gradients across all workers through the cgx-ps shards, compressed
    (or, on auto mode's uncompressed steps, through DDP's allreduce).

    Args:
        state: this DDP model's ``DDPHookState``.
        bucket: the bucket DDP hands over.

    Returns:
        A future that completes with the bucket's buffer, averaged in place.

    Raises:
        ConfigError: ``state`` is not a ``DDPHookState``.
        CgxPsError: as ``DDPHookState.communicate``.
    """
    if not isinstance(state, DDPHookState):
        raise ConfigError(f"ddp_comm_hook needs a DDPHookState as its state, got {type(state).__name__}")
    return state.communicate(bucket)
