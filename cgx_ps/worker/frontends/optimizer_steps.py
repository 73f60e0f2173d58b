"""What a wrapped optimizer does (``DistributedOptimizer`` in optimizer.py builds it): a hook per
parameter hands final gradients to the block pipeline, ``synchronize()`` waits for the step's blocks
and writes the averages into ``.grad``, and ``step()`` steps the wrapped optimizer. The step's route
(the shards, or auto mode's all_reduce on a process group) is the step driver's (``route.py``)."""

from __future__ import annotations

import contextlib
import numbers
import threading
from typing import Iterator

import torch
import torch.distributed as dist
from torch.optim.lr_scheduler import LRScheduler

from ... import timeline
from .uncompressed import group_size_problem
from ..errors import CgxPsError, ConfigError
from .route import collective_group
from .schedulers import step_schedulers
from .step_driver import FrontEndView, StepDriver, SyncOptions
from ..runtime import current_config

__all__ = ["DistributedMixin"]


class DistributedMixin(FrontEndView):
    """A ``DistributedOptimizer``: the wrapped optimizer's own methods, with gradients averaged
    across all workers before its ``step()``.

    Mixed into a dynamic subclass of the wrapped optimizer's class (so LR schedulers and
    ``isinstance(opt, torch.optim.SGD)`` keep working); ``DistributedOptimizer`` (optimizer.py)
    builds it and documents its options. The front end of the block pipeline: it knows the
    parameters, their hooks and ``.grad``; the pipeline knows blocks. Also shows ``steps_done``,
    ``stats``, ``layout``, ``intranode`` and ``tuning_history`` (``FrontEndView``).
    """

    def _cgx_setup(self, named_parameters: list[tuple[str, torch.nn.Parameter]], options: SyncOptions,
                   backward_passes_per_step: int, uncompressed_via: str,
                   process_group: "dist.ProcessGroup | None") -> None:
        if not isinstance(backward_passes_per_step, numbers.Integral) or backward_passes_per_step < 1:
            raise ConfigError(f"backward_passes_per_step must be an integer >= 1, got {backward_passes_per_step!r}")
        names = [n for n, _ in named_parameters]
        if len(set(names)) != len(names):
            raise ConfigError("named_parameters has duplicate names")
        if len({id(p) for _, p in named_parameters}) != len(names):  # its gradient would count twice
            raise ConfigError("named_parameters names one tensor twice (tied weights: name it once)")
        opt_params = {id(p) for g in self.param_groups for p in g["params"]}
        missing = [n for n, p in named_parameters if id(p) not in opt_params]
        if missing:
            raise ConfigError(f"named_parameters holds tensors the optimizer does not: {missing[:3]}")
        named_ids = {id(p) for _, p in named_parameters}
        all_params = [p for g in self.param_groups for p in g["params"]]
        unnamed = sum(1 for p in all_params if p.requires_grad and id(p) not in named_ids)
        if unnamed:  # they would train on each rank's own gradient: replicas would drift apart
            raise ConfigError(f"the optimizer holds {unnamed} trainable tensor(s) not in named_parameters: "
                              f"pass every parameter the optimizer updates (e.g. model.named_parameters())")
        # frozen when wrapped: not synchronized, so they must stay without gradients (checked per step)
        self._cgx_frozen = [p for p in all_params if id(p) not in named_ids]
        self._cgx_params = dict(named_parameters)
        self._cgx_name_of = {id(p): n for n, p in named_parameters}
        # auto mode's uncompressed steps: all_reduce on this group when there is one (the given
        # one, else the default group), per block in the order of registration (frontends/uncompressed.py)
        _check_group_size(options, process_group)
        self._cgx_driver = StepDriver.open_together([named_parameters], [options], [lambda: process_group],
                                                    allreduce_blocks=True)[0]
        self._cgx_pipe = self._cgx_driver.pipe
        self._cgx_backward_passes = backward_passes_per_step
        self._cgx_lock = threading.Lock()
        self._cgx_synchronized = False
        self._cgx_skip = False
        self._cgx_passes: dict[int, int] = {}  # backward passes seen this step, per parameter
        self._cgx_catch_up_schedulers: list[LRScheduler] | None = None  # per-step ones (cgx.catch_up_with)
        self._cgx_hooks = [p.register_post_accumulate_grad_hook(self._cgx_on_grad)
                           for p in self._cgx_params.values() if p.requires_grad]

    def add_param_group(self, param_group: dict) -> None:
        """Add a parameter group, as torch's does, for tensors the optimizer already synchronizes
        or that do not train.

        The blocks are fixed when the optimizer is wrapped, so a new trainable tensor would train
        on this rank's gradient alone; put every parameter in the optimizer before wrapping it
        (e.g. in a group with lr=0 until it is needed). Frozen tensors may be added, and must
        stay without gradients.

        Args:
            param_group: torch's parameter group: ``{"params": tensors, **options}``.

        Raises:
            ConfigError: the group holds a trainable tensor not in ``named_parameters``.
        """
        if not hasattr(self, "_cgx_name_of"):  # torch's own __init__ (never: we wrap a built optimizer)
            return super().add_param_group(param_group)
        params = param_group["params"]
        if not isinstance(params, (torch.Tensor, set)):  # a set: torch's own error about its order
            param_group = {**param_group, "params": list(params)}  # a generator is read once
        listed = [params] if isinstance(params, torch.Tensor) else list(param_group["params"])
        # the layout and the shards' sessions are fixed at wrapping: a tensor added now would train
        # on this rank's gradient alone, and the replicas would drift apart without a word
        unsynced = [p for p in listed if isinstance(p, torch.Tensor) and p.requires_grad
                    and id(p) not in self._cgx_name_of]
        if unsynced:
            raise ConfigError(f"add_param_group after wrapping: {len(unsynced)} trainable tensor(s) that the "
                              f"DistributedOptimizer does not synchronize (its blocks are fixed when it is created); "
                              f"put every parameter in the optimizer before wrapping it (e.g. in a group with lr=0 "
                              f"until it is needed), or train under DDP with cgx.ddp_comm_hook")
        super().add_param_group(param_group)
        # frozen now: they must stay without gradients, as those frozen when wrapped (synchronize())
        self._cgx_frozen.extend(p for p in listed if isinstance(p, torch.Tensor) and id(p) not in self._cgx_name_of)

    # ---- hooks: gradients enter here --------------------------------------------------------------

    def _cgx_on_grad(self, param: torch.nn.Parameter) -> None:
        name = self._cgx_name_of[id(param)]
        if self._cgx_driver.gradient_arrived():
            # a new step: the last one ended in synchronize() without step() (a GradScaler skips
            # step() after an overflow), or in step()
            self._cgx_synchronized = False
        with self._cgx_lock:
            passes = self._cgx_passes.get(id(param), 0) + 1
            self._cgx_passes[id(param)] = passes
        if passes > self._cgx_backward_passes:  # its block is already on its way: this pass would be lost
            # the second cause is what a loop meets that skips a batch after an error in backward
            # without zero_grad(): that backward's gradients count as passes of the step it began
            raise CgxPsError(f"{name}: gradient computed {passes} times before step(), but backward_passes_per_step="
                             f"{self._cgx_backward_passes}; raise it to the number of backward passes per step. "
                             f"Or an earlier backward failed part way: call zero_grad() after it, which abandons "
                             f"the step it began on every rank")
        if passes == self._cgx_backward_passes:  # else accumulating: communicate after the last pass
            self._cgx_driver.submit_ready([name], self._cgx_grad_of)

    def _cgx_grad_of(self, name: str) -> torch.Tensor | None:
        return self._cgx_params[name].grad

    def _cgx_grad_out(self, name: str) -> torch.Tensor | None:
        param = self._cgx_params[name]
        if not param.requires_grad:
            return None  # frozen since wrapping: torch's optimizers must skip it (weight decay too)
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        return param.grad

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients, as torch's does; between a backward and its ``step()``, first
        abandon that step on every rank (a backward that failed part way: see
        ``DistributedOptimizer``).

        Args:
            set_to_none: as torch's: set ``.grad`` to None instead of zeroing it.

        Raises:
            CgxPsError: the step cannot be abandoned (nothing changes): every gradient was
                already pushed (call ``step()``: the other ranks apply it), several local ranks
                per node, or auto mode's step over the process group; or a shard failed while
                the step's results were waited for.
        """
        self._cgx_abandon_step()
        super().zero_grad(set_to_none)

    def _cgx_abandon_step(self) -> None:
        """zero_grad() between a backward and its step(): the backward failed part way (or the
        loop gave the batch up), and the step it began is abandoned on every rank (the
        factory's doc); nothing to do between steps. Where it cannot be, CgxPsError and nothing
        changes (``StepDriver.why_not_abandon``)."""
        with self._cgx_lock:
            began = bool(self._cgx_passes)
        if not began:
            return
        problem = self._cgx_driver.why_not_abandon()
        if problem is not None:
            raise CgxPsError(problem)
        try:
            self._cgx_driver.abandon()
        finally:
            self._cgx_next_step()

    def _cgx_next_step(self) -> None:
        with self._cgx_lock:
            self._cgx_passes = {}

    # ---- synchronize / step ---------------------------------------------------------------------

    def synchronize(self) -> None:
        """Finish communication for this step: submit the blocks whose parameters got no
        gradient (as zeros), wait for every block, and write the averaged gradients into
        ``.grad``. Called by ``step()``; call it yourself to read or clip the averaged gradients
        first (then step inside ``skip_synchronize()``). A second call before the next backward
        does nothing.

        Raises:
            StepAbandoned: another rank abandoned this step (catch it, ``zero_grad()``, go on).
            CgxPsError: a block could not be averaged (a shard failed or timed out; without
                ``allow_non_finite``, a NaN/Inf gradient, named), or a tensor frozen when the
                optimizer was created has a gradient now. The step is forgotten on this rank.
        """
        if self._cgx_synchronized:
            return
        pipe, driver = self._cgx_pipe, self._cgx_driver
        thawed = [p for p in self._cgx_frozen if p.requires_grad and p.grad is not None]
        if thawed:
            driver.abort()
            self._cgx_next_step()
            raise CgxPsError(f"{len(thawed)} tensor(s) were frozen (requires_grad=False) when the "
                             f"DistributedOptimizer was created (or add_param_group gave them) but have gradients now; "
                             f"ranks would update them "
                             f"apart: create the DistributedOptimizer after unfreezing")
        try:
            driver.submit_rest(self._cgx_grad_of)
            driver.finish()
        except BaseException:
            driver.abort()
            self._cgx_next_step()
            raise
        for block in range(pipe.num_blocks):
            pipe.copy_out(block, self._cgx_grad_out)
        self._cgx_next_step()
        self._cgx_synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """A context in which ``step()`` does not synchronize: call ``synchronize()`` first (the
        GradScaler and clipping loops in ``DistributedOptimizer``'s doc).

        Yields:
            None.
        """
        self._cgx_skip = True
        try:
            yield
        finally:
            self._cgx_skip = False

    def step(self, closure=None):
        """Synchronize (unless inside ``skip_synchronize()``), then step the wrapped optimizer.

        Args:
            closure: as torch's: re-evaluates the model and returns the loss.

        Returns:
            What the wrapped optimizer's ``step`` returns (the closure's loss, or None).

        Raises:
            StepAbandoned, CgxPsError: as ``synchronize()``.
            CgxPsError: the averaged gradient was not finite (``allow_non_finite``, no
                GradScaler): the step is not applied, on every rank alike; or ``step()`` inside
                ``skip_synchronize()`` without ``synchronize()`` first.
        """
        if not self._cgx_skip:
            synchronizing_here = not self._cgx_synchronized
            self.synchronize()
            if synchronizing_here and self._cgx_driver.options.allow_non_finite and not self._cgx_finite():
                # Every rank gets here alike (the same average): a GradScaler that read .grad before
                # step() averaged it would have let ranks decide apart, and without one the step
                # would write NaN into the weights. Neither is applied.
                self._cgx_synchronized = False
                self._cgx_driver.after_step()  # it counts, as a step a scaler skips: on every rank alike
                mine = ", ".join(self.stats.non_finite_tensors) or "none of this rank's"
                raise CgxPsError(f"the averaged gradient was not finite (NaN/Inf; this rank's non-finite tensors: "
                                 f"{mine}); the step is not applied. With a GradScaler, call opt.synchronize() "
                                 f"before scaler.unscale_(opt), and scaler.step(opt) inside opt.skip_synchronize(), "
                                 f"so every rank's scaler sees the averaged gradients and skips the step; without "
                                 f"one, training has diverged: catch CgxPsError, zero_grad() and go on, or lower the "
                                 f"learning rate")
        elif not self._cgx_synchronized:
            raise CgxPsError("step() inside skip_synchronize() needs synchronize() first")
        with timeline.span("optimizer", self.stats.step):
            result = super().step(closure)
        timeline.step_ends(self.stats.step)
        self._cgx_synchronized = False
        self._cgx_driver.after_step()
        # Quorum rounds: a node that was late applies the rounds it missed (the other nodes'
        # averages, the same bytes they applied) without computing them (pipeline/catch_up.py)
        for round_ in self._cgx_driver.missed_rounds():
            for block in range(self._cgx_pipe.num_blocks):
                self._cgx_pipe.copy_out(block, self._cgx_grad_out)
            with timeline.span("catch-up", round_):
                step_schedulers(self._cgx_catch_up_schedulers or [])  # each round at the rate the others used
                super().step()
        return result

    def _cgx_finite(self) -> bool:
        """Whether the step's averages are finite: the shards' path knows it from each block's
        result (one element read per block); an all_reduce step's averages are scanned in .grad."""
        if self.stats.path == "shards":
            return not self.stats.non_finite_average
        return all(bool(torch.isfinite(p.grad).all()) for p in self._cgx_params.values() if p.grad is not None)

    # ---- checkpoints ----------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The wrapped optimizer's state, plus a ``"cgx_ps"`` entry: counters, codec settings,
        auto/adaptive state and this rank's error-feedback residuals (call it between steps).

        Returns:
            torch's state dict with the ``"cgx_ps"`` entry added.
        """
        state = super().state_dict()
        state["cgx_ps"] = self._cgx_driver.state_dict()
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """Resume from ``state_dict()``'s output before the first step, bit for bit; a plain
        torch checkpoint (no ``"cgx_ps"`` entry) loads too, and cgx-ps starts fresh.

        Args:
            state_dict: what ``state_dict()`` returned (on this rank, for the same model).

        Raises:
            CheckpointError: the ``"cgx_ps"`` entry does not fit this optimizer's layout.
        """
        state = dict(state_dict)
        ours = state.pop("cgx_ps", None)  # absent in a plain torch checkpoint: cgx-ps starts fresh
        if ours is not None:
            self._cgx_driver.load_state_dict(ours)
        super().load_state_dict(state)

    def _cgx_registered(self) -> StepDriver | None:
        return self._cgx_driver


def _check_group_size(options: SyncOptions, process_group: "dist.ProcessGroup | None") -> None:
    """Auto mode's group, if it has one now, must be as large as the job: said here, before
    registering, not at auto mode's first decision (inside an autograd hook, maybe at step 100).
    The rest of the check (which ranks, one session, one parameter order) is a collective, made
    at the group's first use (``BlockAllreduce.open``)."""
    group = collective_group(process_group, options.uncompressed_via) if options.compression.auto else None
    if group is None:
        return
    config = current_config()
    problem = group_size_problem(dist.get_world_size(group), config.world_size)
    if problem is not None:
        raise ConfigError(f"rank {config.rank}: {problem}")
