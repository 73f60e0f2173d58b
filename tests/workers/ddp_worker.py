"""A worker for tests/test_ddp_hook.py: DDP (gloo) with the cgx-ps hook, scenario after scenario.

Every scenario opens its own session on the shards (``cgx.shutdown()`` and a barrier between
them), so one pair of processes covers them all. Gradients are known exactly (``rank_gradient``
of step_worker.py: loss = sum(param * g) + 0 * model(x)), so the parent test can compare the
hook with the DistributedOptimizer, with plain DDP, and with exact expectations. Saves
{scenario: results} with torch.save to --out.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys
import time
import traceback
import weakref

import torch
import torch.distributed as dist
from ddp_join_scenarios import JOIN_SCENARIOS
from step_worker import model_for, rank_gradient
from torch.nn.parallel import DistributedDataParallel as DDP

import cgx_ps.worker as cgx

HIDDEN = 300
OPTIONS_COMPRESSION = cgx.Compression(bits=3, exclude=("2.*",), overrides={"0.weight": 5})
OPTIONS = {"error_feedback": True, "warmup_steps": 1}
BLOCK_BYTES = 16384
BUCKET_MB = 0.02  # about 5000 floats: several buckets, blocks that span two of them
STALL_S = 0.0  # how long rank 1 stalls in optimizer_allreduce_stall (--stall-s)


def _loss(module: torch.nn.Module, named, rank: int, step: int, part: int = 0) -> torch.Tensor:
    """d loss / d p = rank_gradient(p) exactly; the forward through the DDP model keeps DDP's
    bookkeeping real (0 * out adds exact zeros)."""
    x = torch.ones(2, 64, dtype=next(module.parameters()).dtype)
    out = module(x)
    return (out * 0).sum() + sum((p * rank_gradient(n, p, rank, step, part)).sum() for n, p in named)


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _ddp(model, **kw) -> DDP:
    return DDP(model, bucket_cap_mb=BUCKET_MB, **kw)


def _model(dtype=torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)  # the same start on every rank (DDP broadcasts it anyway)
    return model_for(dtype, HIDDEN)


def hook_run(rank: int, compression="4bit", steps: int = 3, accumulate: int = 1, options=None, **ddp_kw) -> dict:
    model = _model()
    ddp = _ddp(model, **ddp_kw)
    state = cgx.DDPHookState(ddp, compression=compression, block_bytes=BLOCK_BYTES, **(options or {}))
    ddp.register_comm_hook(state, cgx.ddp_comm_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=1.0)
    named = list(model.named_parameters())
    for step in range(steps):
        opt.zero_grad()
        for part in range(accumulate):
            sync = part == accumulate - 1
            with contextlib.nullcontext() if sync else ddp.no_sync():
                _loss(ddp, named, rank, step, part).backward()
        opt.step()
    return {"final": _snapshot(model), "layout": state.layout.SerializeToString(), "stats": vars(state.stats),
            "intranode": state.intranode, "tuning": [d.as_dict() for d in state.tuning_history]}


def optimizer_run(rank: int, compression="4bit", steps: int = 3, accumulate: int = 1, options=None) -> dict:
    model = _model()
    opt = cgx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), model.named_parameters(),
                                   compression=compression, backward_passes_per_step=accumulate,
                                   block_bytes=BLOCK_BYTES, **(options or {}))
    named = list(model.named_parameters())
    for step in range(steps):
        opt.zero_grad()
        for part in range(accumulate):
            _loss(model, named, rank, step, part).backward()
        opt.step()
    return {"final": _snapshot(model), "layout": opt.layout.SerializeToString(), "stats": vars(opt.stats),
            "tuning": [d.as_dict() for d in opt.tuning_history]}


def allreduce_fallback_run(rank: int, steps: int = 4) -> dict:
    """Auto mode's uncompressed steps go through DDP's allreduce: steps 1 and 2 are switched to
    uncompressed on every rank at the same step boundary, as auto mode's decision is."""
    model = _model()
    ddp = _ddp(model)
    state = cgx.DDPHookState(ddp, compression="4bit", block_bytes=BLOCK_BYTES)
    ddp.register_comm_hook(state, cgx.ddp_comm_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=1.0)
    named = list(model.named_parameters())
    before, paths, rounds = [], [], []
    for step in range(steps):
        if step in (1, 3):
            state.open().pipe.apply(step == 3, {})  # what every rank does with auto mode's decision
        before.append(_snapshot(model))
        opt.zero_grad()
        _loss(ddp, named, rank, step).backward()
        opt.step()
        paths.append(state.stats.path)
        rounds.append(state.open().pipe.next_round)
    return {"before": before, "final": _snapshot(model), "paths": paths, "rounds": rounds}


def optimizer_allreduce_run(rank: int) -> dict:
    """The DistributedOptimizer's auto-mode uncompressed steps go through all_reduce on the
    default (gloo) group: steps 1, 2, 4 and 5 are switched to uncompressed on every rank at the
    same step boundary, as auto mode's decision is (set here on the pipeline, as the tuner does).
    At step 4 rank 1's gradient overflows: with allow_non_finite=False every rank must refuse it."""
    model = _model()
    opt = cgx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), model.named_parameters(),
                                   compression="4bit", block_bytes=BLOCK_BYTES, allow_non_finite=False)
    pipe = opt._cgx_pipe  # what auto mode's tuner sets: no public switch, on purpose
    named = list(model.named_parameters())
    before, paths, rounds, in_place, errors = [], [], [], [], []
    for step in range(6):
        if step in (1, 3, 4):
            pipe.apply(step == 3, {})
        before.append(_snapshot(model))
        opt.zero_grad()
        handle = _inject_inf(model, "0.weight") if step == 4 and rank == 1 else None
        _loss(model, named, rank, step).backward()
        if handle is not None:
            handle.remove()
        try:
            opt.step()
        except cgx.CgxPsError as exc:
            errors.append(str(exc))
            paths.append("error")
        else:
            paths.append(opt.stats.path)
        rounds.append(pipe.next_round)
        in_place.append(opt.stats.in_place_blocks)
    return {"before": before, "final": _snapshot(model), "paths": paths, "rounds": rounds,
            "in_place": in_place, "blocks": len(opt.layout.blocks), "errors": errors, "intranode": opt.intranode}


def optimizer_allreduce_stall_run(rank: int) -> dict:
    """Auto mode's uncompressed steps on the gloo group, and rank 1 stalls before step 1's
    backward for longer than the shards' round timeout (``--stall-s``): rank 0 must fail that
    step within the round timeout, naming what stalled, and refuse the next one at once. Rank 1
    skips step 2 (rank 0 launches nothing there), so the group is idle for the final barrier."""
    model = _model()
    opt = cgx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), model.named_parameters(),
                                   compression="4bit", block_bytes=BLOCK_BYTES)
    opt._cgx_pipe.apply(False, {})  # what auto mode's tuner sets: every step uncompressed, on the group
    named = list(model.named_parameters())
    outcomes = []
    for step in range(3 if rank == 0 else 2):
        if step == 1 and rank == 1:
            time.sleep(STALL_S)
        start = time.monotonic()
        try:
            opt.zero_grad()
            _loss(model, named, rank, step).backward()
            opt.step()
            outcome = opt.stats.path
        except cgx.CgxPsError as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        outcomes.append((outcome, time.monotonic() - start))
    return {"outcomes": outcomes}


def optimizer_allreduce_abandon_run(rank: int) -> dict:
    """Auto mode's uncompressed steps on the gloo group; at step 1 rank 1's backward fails part
    way (a hook of its own raises once some blocks are launched), and it gives that step up and
    goes on, as a loop that skips a batch after an error does. Records each step's outcome on
    this rank and the parameters before each step. The group is out of step afterwards (rank 0's
    last all_reduces stay queued): the worker exits without its final barrier
    (LEAVES_GROUP_OUT_OF_STEP)."""
    model = _model()
    opt = cgx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), model.named_parameters(),
                                   compression="4bit", block_bytes=BLOCK_BYTES)
    opt._cgx_pipe.apply(False, {})  # what auto mode's tuner sets: every step uncompressed, on the group
    named = list(model.named_parameters())
    outcomes, before = [], []

    def fail(grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("injected: out of memory in backward")

    for step in range(4):
        before.append(_snapshot(model))
        handle = dict(named)["0.weight"].register_hook(fail) if step == 1 and rank == 1 else None
        try:
            opt.zero_grad()
            _loss(model, named, rank, step).backward()
            opt.step()
            outcomes.append(opt.stats.path)
        except Exception as exc:  # noqa: BLE001 - recorded for the parent test
            outcomes.append(f"{type(exc).__name__}: {exc}")
        finally:
            if handle is not None:
                handle.remove()
    return {"outcomes": outcomes, "before": before, "final": _snapshot(model)}


def optimizer_auto_group_run(rank: int, steps: int = 4) -> dict:
    """Real auto mode (deciding after steps 0, 1 and 3) with the default group: its model
    measures the group's all_reduce, and each step goes where the decision before it said."""
    model = _model()
    opt = cgx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), model.named_parameters(),
                                   compression="auto:2", block_bytes=BLOCK_BYTES)
    named = list(model.named_parameters())
    paths = []
    for step in range(steps):
        opt.zero_grad()
        _loss(model, named, rank, step).backward()
        opt.step()
        paths.append(opt.stats.path)
    return {"final": _snapshot(model), "paths": paths, "tuning": [d.as_dict() for d in opt.tuning_history]}


def hook_auto_probe_run(rank: int, steps: int = 7) -> dict:
    """Real auto mode in the DDP hook (``auto:2``: decisions after steps 0, 1, 3 and 5, each taken
    at the next step's first bucket). Records, on this rank, every call of the tuner's probe of
    DDP's allreduce with the step it followed, and the path each step took."""
    model = _model()
    ddp = _ddp(model)
    state = cgx.DDPHookState(ddp, compression="auto:2", block_bytes=BLOCK_BYTES)
    ddp.register_comm_hook(state, cgx.ddp_comm_hook)
    tuner = state.open().tuner
    probe, probed = tuner.uncompressed_probe, []

    def recording_probe(nbytes: int) -> float | None:  # the same probe, its calls written down
        rate = probe(nbytes)
        probed.append({"after_step": state.stats.step, "nbytes": nbytes, "bps": rate})
        return rate

    if probe is not None:
        tuner.uncompressed_probe = recording_probe
    opt = torch.optim.SGD(ddp.parameters(), lr=1.0)
    named = list(model.named_parameters())
    paths, rounds = [], []
    for step in range(steps):
        opt.zero_grad()
        _loss(ddp, named, rank, step).backward()
        opt.step()
        paths.append(state.stats.path)
        rounds.append(state.open().pipe.next_round)
    return {"final": _snapshot(model), "paths": paths, "rounds": rounds, "probed": probed,
            "tuning": [d.as_dict() for d in state.tuning_history]}


def hook_auto_scaled_run(rank: int) -> dict:
    """Real auto mode in the hook with bucket views (``auto:4``: decisions after steps 0 and 3),
    its model's choices replaced by "do not compress", then "compress" (rank 0 decides, every
    rank applies it at the next step's first gradient): steps 1-3 go through DDP's allreduce,
    steps 4-5 to the shards. Step 2 accumulates two backward passes (no_sync), step 3 keeps the
    gradients in DDP's bucket (zero_grad(set_to_none=False)). Records each step's parameters
    before it, path, early hand-overs and blocks in place."""
    model = _model()
    ddp = _ddp(model, gradient_as_bucket_view=True)
    state = cgx.DDPHookState(ddp, compression="auto:4", block_bytes=BLOCK_BYTES)
    ddp.register_comm_hook(state, cgx.ddp_comm_hook)
    choices = iter([False, True])
    state.open().tuner.modes.choose = lambda current, figures: (next(choices), "test")
    opt = torch.optim.SGD(ddp.parameters(), lr=1.0)
    named = list(model.named_parameters())
    parts = [1, 1, 2, 1, 1, 1]
    before, paths, early, in_place = [], [], [], []
    for step, accumulate in enumerate(parts):
        before.append(_snapshot(model))
        opt.zero_grad(set_to_none=step != 3)
        for part in range(accumulate):
            with contextlib.nullcontext() if part == accumulate - 1 else ddp.no_sync():
                _loss(ddp, named, rank, step, part).backward()
        opt.step()
        paths.append(state.stats.path)
        early.append(state.stats.early_gradients)
        in_place.append(state.stats.in_place_blocks)
    return {"before": before, "final": _snapshot(model), "parts": parts, "paths": paths, "early": early,
            "in_place": in_place, "blocks": len(state.layout.blocks),
            "tuning": [d.as_dict() for d in state.tuning_history]}


def _hooked_bucket_views(model: torch.nn.Module) -> tuple[DDP, cgx.DDPHookState]:
    """DDP with bucket views and the hook, fp32 (exact expectations): early hand-over from step 2."""
    ddp = _ddp(model, gradient_as_bucket_view=True)
    state = cgx.DDPHookState(ddp, compression="fp32", block_bytes=BLOCK_BYTES)
    ddp.register_comm_hook(state, cgx.ddp_comm_hook)
    return ddp, state


def _local_grads(named, rank: int, step: int) -> bool:
    return all(p.grad is not None and torch.equal(p.grad, rank_gradient(n, p, rank, step, 0)) for n, p in named)


def _cgx_hooks(model: torch.nn.Module) -> int:
    """Post-accumulate-grad hooks on the model's parameters (only early hand-over adds them)."""
    return sum(len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in model.parameters())


def early_probe_run(rank: int, steps: int = 5) -> dict:
    """Early hand-over with backward passes DDP does not reduce between its steps: a gradient probe
    through ``ddp.module`` (no DDP forward) before step 3 on both ranks, before step 4 on rank 0
    only. Plain DDP leaves the probe's gradients local and every step's average exact."""
    model = _model()
    initial = _snapshot(model)
    ddp, state = _hooked_bucket_views(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=1.0)
    named = list(model.named_parameters())
    after, probe_local, early = [], [], []
    for step in range(steps):
        if step == 3 or (step == 4 and rank == 0):
            opt.zero_grad()
            _loss(ddp.module, named, rank, 99).backward()
            probe_local.append(_local_grads(named, rank, 99))
        opt.zero_grad()
        _loss(ddp, named, rank, step).backward()
        opt.step()
        after.append(_snapshot(model))
        early.append(state.stats.early_gradients)
    return {"initial": initial, "after": after, "probe_local": probe_local, "early": early}


def early_dropped_run(rank: int) -> dict:
    """Early hand-over, then the DDP model and its state dropped (the session still open): their
    hooks go with them, and the bare model trains on local gradients, as after plain DDP."""
    model = _model()
    ddp, state = _hooked_bucket_views(model)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    named = list(model.named_parameters())
    for step in range(3):
        opt.zero_grad()
        _loss(ddp, named, rank, step).backward()
        opt.step()
    early, hooks_before, ddp_ref = state.stats.early_gradients, _cgx_hooks(model), weakref.ref(ddp)
    del ddp, state
    gc.collect()
    local = []
    for step in (10, 11):
        opt.zero_grad()
        _loss(model, named, rank, step).backward()
        local.append(_local_grads(named, rank, step))
    return {"early": early, "hooks_before": hooks_before, "hooks_after": _cgx_hooks(model),
            "ddp_freed": ddp_ref() is None, "local": local}


def early_rewrap_run(rank: int, steps: int = 3) -> dict:
    """Early hand-over, then a new session (shutdown, init) and the same model re-wrapped in a new
    DDP with a new state, the old ones still referenced: the old hooks go at shutdown, the new
    wrapper trains exactly."""
    model = _model()
    initial = _snapshot(model)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    named = list(model.named_parameters())
    old = _hooked_bucket_views(model)
    for step in range(steps):
        opt.zero_grad()
        _loss(old[0], named, rank, step).backward()
        opt.step()
    hooks_before = _cgx_hooks(model)
    cgx.shutdown()
    dist.barrier()
    _init_cgx(rank, dist.get_world_size(), local=False)
    hooks_after_shutdown = _cgx_hooks(model)
    ddp, state = _hooked_bucket_views(model)
    for step in range(steps, 2 * steps):
        opt.zero_grad()
        _loss(ddp, named, rank, step).backward()
        opt.step()
    return {"initial": initial, "final": _snapshot(model), "early": [old[1].stats.early_gradients,
            state.stats.early_gradients], "hooks": [hooks_before, hooks_after_shutdown, _cgx_hooks(model)]}


def plain_ddp_run(rank: int, steps: int = 3) -> dict:
    model = _model()
    initial = _snapshot(model)
    ddp = _ddp(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=1.0)
    named = list(model.named_parameters())
    for step in range(steps):
        opt.zero_grad()
        _loss(ddp, named, rank, step).backward()
        opt.step()
    return {"initial": initial, "final": _snapshot(model)}


def user_hooks_run(rank: int, path: str, steps: int = 4) -> dict:
    """A user's own post-accumulate-grad hooks under DDP with bucket views: "first", registered
    before training on every parameter, clips its gradient in place; "later", registered after
    step 1 (the early hand-over's hooks are installed and DDP's buckets settled by then) on two
    parameters, halves it in place. ``path``: "plain" (DDP alone), "shards" (the hook, fp32
    through the shards: blocks handed over early) or "allreduce" (the hook, every step through
    DDP's allreduce as auto mode's uncompressed ones: gradients divided into the bucket early).
    Records what each hook saw (a sum per step and parameter) and the final parameters."""
    model = _model()
    initial = _snapshot(model)
    ddp = _ddp(model, gradient_as_bucket_view=True)
    state = None
    if path != "plain":
        state = cgx.DDPHookState(ddp, compression="fp32" if path == "shards" else "4bit", block_bytes=BLOCK_BYTES)
        ddp.register_comm_hook(state, cgx.ddp_comm_hook)
        if path == "allreduce":
            state.open().pipe.apply(False, {})  # what every rank does with auto mode's decision
    named = list(model.named_parameters())
    name_of = {id(p): n for n, p in named}
    seen: dict[str, dict[tuple[int, str], float]] = {"first": {}, "later": {}}
    now = {"step": 0}

    def user_hook(kind: str, change):
        def hook(p: torch.Tensor) -> None:
            seen[kind][(now["step"], name_of[id(p)])] = float(p.grad.double().sum())
            change(p.grad)
        return hook

    for _, p in named:
        p.register_post_accumulate_grad_hook(user_hook("first", lambda g: g.clamp_(-1.0, 1.0)))
    opt = torch.optim.SGD(ddp.parameters(), lr=1.0)
    early = []
    for step in range(steps):
        now["step"] = step
        if step == 2:
            for name in ("0.weight", "2.weight"):
                dict(named)[name].register_post_accumulate_grad_hook(user_hook("later", lambda g: g.mul_(0.5)))
        opt.zero_grad()
        _loss(ddp, named, rank, step).backward()
        opt.step()
        early.append(state.stats.early_gradients if state is not None else 0)
    return {"initial": initial, "final": _snapshot(model), "seen": seen, "early": early,
            "paths": None if state is None else state.stats.path}


class TwoBranches(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.main = torch.nn.Linear(64, 64)
        self.extra = torch.nn.Linear(64, 64)

    def forward(self, x: torch.Tensor, use_extra: bool) -> torch.Tensor:
        out = self.main(x)
        return out + self.extra(x) if use_extra else out


def unused_run(rank: int, steps: int = 2) -> dict:
    """find_unused_parameters: ``extra`` is used on rank 0 only (fp32: exact expectations)."""
    torch.manual_seed(0)
    model = TwoBranches()
    initial = _snapshot(model)
    ddp = _ddp(model, find_unused_parameters=True)
    ddp.register_comm_hook(cgx.DDPHookState(ddp, compression="fp32", block_bytes=BLOCK_BYTES), cgx.ddp_comm_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=1.0)
    for step in range(steps):
        opt.zero_grad()
        use = rank == 0
        named = [(n, p) for n, p in model.named_parameters() if use or not n.startswith("extra.")]
        out = ddp(torch.ones(2, 64), use)
        loss = (out * 0).sum() + sum((p * rank_gradient(n, p, rank, step, 0)).sum() for n, p in named)
        loss.backward()
        opt.step()
    return {"initial": initial, "final": _snapshot(model)}


def gan_run(rank: int, steps: int = 2) -> dict:
    """Two DDP models in one process, each with its own state: one session, two layouts."""
    torch.manual_seed(0)
    gen, disc = model_for(torch.float32, 200), model_for(torch.float32, 100)
    initial = {"gen": _snapshot(gen), "disc": _snapshot(disc)}
    g_ddp, d_ddp = _ddp(gen), _ddp(disc)
    g_state = cgx.DDPHookState(g_ddp, compression="fp32", block_bytes=BLOCK_BYTES)
    d_state = cgx.DDPHookState(d_ddp, compression="fp32", block_bytes=BLOCK_BYTES)
    g_ddp.register_comm_hook(g_state, cgx.ddp_comm_hook)
    d_ddp.register_comm_hook(d_state, cgx.ddp_comm_hook)
    g_opt, d_opt = torch.optim.SGD(gen.parameters(), lr=1.0), torch.optim.SGD(disc.parameters(), lr=1.0)
    for step in range(steps):
        for ddp, model, opt in [(d_ddp, disc, d_opt), (g_ddp, gen, g_opt)]:  # discriminator first
            opt.zero_grad()
            _loss(ddp, list(model.named_parameters()), rank, step).backward()
            opt.step()
    return {"initial": initial, "final": {"gen": _snapshot(gen), "disc": _snapshot(disc)},
            "layouts": [g_state.layout.SerializeToString(), d_state.layout.SerializeToString()]}


def _inject_inf(model: torch.nn.Module, name: str, value: float = float("inf")) -> torch.utils.hooks.RemovableHandle:
    """Overflow one element of one parameter's gradient (before DDP or cgx-ps sees it)."""
    def poison(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad.view(-1)[5] = value
        return grad

    return dict(model.named_parameters())[name].register_hook(poison)


def amp_run(rank: int, front_end: str, steps: int = 3, overflow_step: int = 1, uncompressed: bool = False) -> dict:
    """fp16 autocast + GradScaler; at ``overflow_step`` rank 1's gradient overflows.
    ``uncompressed``: every step as auto mode's uncompressed ones (the optimizer: all_reduce)."""
    model = _model()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    if front_end == "ddp":
        net = _ddp(model)
        net.register_comm_hook(cgx.DDPHookState(net, compression="4bit", block_bytes=BLOCK_BYTES), cgx.ddp_comm_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    else:
        net = model
        # no allow_non_finite: the standard GradScaler loop works with the defaults, as under DDP
        opt = cgx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                       compression="4bit", block_bytes=BLOCK_BYTES)
        if uncompressed:
            opt._cgx_pipe.apply(False, {})  # as auto mode's decision
    named = list(model.named_parameters())
    scales, changed, paths = [], [], []
    for step in range(steps):
        before = _snapshot(model)
        opt.zero_grad()
        handle = _inject_inf(model, "2.weight") if step == overflow_step and rank == 1 else None
        with torch.autocast("cpu", dtype=torch.float16):
            loss = _loss(net, named, rank, step)
        scaler.scale(loss).backward()
        if handle is not None:
            handle.remove()
        if front_end == "ddp":
            scaler.step(opt)
        else:  # the optimizer's GradScaler loop, clipping included (README)
            opt.synchronize()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e3)
            with opt.skip_synchronize():
                scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        paths.append(opt.stats.path if front_end != "ddp" else None)
        after = _snapshot(model)
        changed.append(any(not torch.equal(before[n], after[n]) for n in after))
    return {"final": _snapshot(model), "scales": scales, "changed": changed, "paths": paths}


def hook_nan_run(rank: int, steps: int = 4, nan_step: int = 1) -> dict:
    """The hook with ``allow_non_finite=False``; at ``nan_step`` rank 1's gradient of 2.weight is
    NaN. Each step's outcome on this rank (with its seconds), and the parameters before each step
    and at the end: what a loop that catches the error and goes on sees."""
    model = _model()
    ddp = _ddp(model, gradient_as_bucket_view=True)
    ddp.register_comm_hook(cgx.DDPHookState(ddp, compression="4bit", block_bytes=BLOCK_BYTES,
                                            allow_non_finite=False), cgx.ddp_comm_hook)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    named = list(model.named_parameters())
    outcomes, before = [], []
    for step in range(steps):
        before.append(_snapshot(model))
        handle = _inject_inf(model, "2.weight", float("nan")) if step == nan_step and rank == 1 else None
        t0 = time.monotonic()
        try:
            opt.zero_grad()
            _loss(ddp, named, rank, step).backward()
            opt.step()
            outcomes.append("ok")
        except Exception as exc:  # noqa: BLE001 - recorded for the parent test
            outcomes.append(f"{type(exc).__name__}: {exc}")
        finally:
            if handle is not None:
                handle.remove()
        outcomes[-1] += f" ({time.monotonic() - t0:.1f} s)"
    return {"outcomes": outcomes, "before": before, "final": _snapshot(model)}


def bf16_run(rank: int, steps: int = 3, overflow_step: int = 1) -> dict:
    """bf16 parameters and gradients under the hook; rank 1's gradient overflows at one step:
    every rank must see a non-finite gradient then (and skips that step, as a scaler would)."""
    model = _model(torch.bfloat16)
    ddp = _ddp(model)
    ddp.register_comm_hook(cgx.DDPHookState(ddp, compression="8bit", block_bytes=BLOCK_BYTES), cgx.ddp_comm_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    named = list(model.named_parameters())
    finite = []
    for step in range(steps):
        opt.zero_grad()
        handle = _inject_inf(model, "0.weight") if step == overflow_step and rank == 1 else None
        _loss(ddp, named, rank, step).backward()
        if handle is not None:
            handle.remove()
        ok = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())
        finite.append(ok)
        if ok:
            opt.step()
    return {"final": _snapshot(model), "finite": finite,
            "grad_dtypes": sorted({str(p.grad.dtype) for p in model.parameters()})}


def foreign_module_run(rank: int) -> dict:
    """A state given a module that is not the DDP model's: the first backward says so."""
    ddp = _ddp(_model())
    ddp.register_comm_hook(cgx.DDPHookState(_model(), block_bytes=BLOCK_BYTES), cgx.ddp_comm_hook)
    try:
        _loss(ddp, list(ddp.module.named_parameters()), rank, 0).backward()
    except Exception as exc:  # DDP re-raises the hook's error from its C++ reducer
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"error": None}


SCENARIOS = {  # run in this order by default, then the local ranks' ones
    "hook_4bit": lambda r: hook_run(r, "4bit"),
    "optimizer_4bit": lambda r: optimizer_run(r, "4bit"),
    "hook_static_graph": lambda r: hook_run(r, "4bit", static_graph=True),
    "hook_bucket_view": lambda r: hook_run(r, "4bit", gradient_as_bucket_view=True),
    "hook_fp32": lambda r: hook_run(r, "fp32"),
    "plain_ddp": lambda r: plain_ddp_run(r),
    # error feedback, warm-up, exclusions and overrides, adaptive bits: as the optimizer does them
    "hook_options": lambda r: hook_run(r, OPTIONS_COMPRESSION, options=OPTIONS),
    "optimizer_options": lambda r: optimizer_run(r, OPTIONS_COMPRESSION, options=OPTIONS),
    "hook_adaptive": lambda r: hook_run(r, "adaptive:2", steps=4),
    "optimizer_adaptive": lambda r: optimizer_run(r, "adaptive:2", steps=4),
    "hook_auto": lambda r: hook_run(r, "auto", steps=2),
    "hook_allreduce_fallback": allreduce_fallback_run,
    "hook_no_sync": lambda r: hook_run(r, "4bit", steps=2, accumulate=2),
    "optimizer_accumulate": lambda r: optimizer_run(r, "4bit", steps=2, accumulate=2),
    # early hand-over (gradient_as_bucket_view, torch's zero_grad(set_to_none=True)) from the third step
    "hook_bucket_view_no_sync": lambda r: hook_run(r, "4bit", steps=3, accumulate=2, gradient_as_bucket_view=True),
    "optimizer_accumulate_3": lambda r: optimizer_run(r, "4bit", steps=3, accumulate=2),
    # early hand-over only on backward passes DDP reduces; its hooks go with the state or session
    "early_probe": early_probe_run,
    "early_dropped": early_dropped_run,
    "early_rewrap": early_rewrap_run,
    "unused": unused_run,
    "gan": gan_run,
    "amp_ddp": lambda r: amp_run(r, "ddp"),
    "amp_optimizer": lambda r: amp_run(r, "optimizer"),
    "bf16": bf16_run,
    "foreign_module": foreign_module_run,
    # a user's own post-accumulate-grad hooks: under plain DDP, and under the hook on both paths
    "user_hooks_plain": lambda r: user_hooks_run(r, "plain"),
    "user_hooks_shards": lambda r: user_hooks_run(r, "shards"),
    "user_hooks_allreduce": lambda r: user_hooks_run(r, "allreduce"),
}
# after these the gloo group is out of step for good: the worker saves and exits at once, since its
# final barrier would pair with an all_reduce still queued (frontends/uncompressed.py, "A stalled rank")
LEAVES_GROUP_OUT_OF_STEP = {"optimizer_allreduce_abandon"}
# run only when named (tests/test_ddp_hook.py's other launches): auto mode's uncompressed steps
# on the process group
ON_REQUEST = {
    "optimizer_allreduce": optimizer_allreduce_run,
    "optimizer_auto_group": optimizer_auto_group_run,
    "optimizer_allreduce_stall": optimizer_allreduce_stall_run,
    "optimizer_allreduce_abandon": optimizer_allreduce_abandon_run,
    "hook_auto_probe": hook_auto_probe_run,
    "hook_auto_scaled": hook_auto_scaled_run,
    "amp_optimizer_allreduce": lambda r: amp_run(r, "optimizer", uncompressed=True),
    "hook_nan": hook_nan_run,
    **JOIN_SCENARIOS,  # uneven inputs under the hook: tests/test_ddp_join.py
}


def _init_cgx(rank: int, world: int, local: bool) -> None:
    job = os.environ.get("CGX_PS_JOB_ID", "")
    if local:  # every rank a local rank of node 0: they reduce through shared memory first
        # Another job id: a job's shape never changes on the shards (a rank registering as
        # node-0 member 1 before node-0 member 0 restarted the 2-node session would be refused).
        cgx.init(local_rank=rank, local_world_size=world, node_rank=0, num_nodes=1, job_id=f"{job}-local")
    else:
        cgx.init(local_rank=0, local_world_size=1, node_rank=rank, num_nodes=world, job_id=job)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--scenarios", default=",".join([*SCENARIOS, "local:hook_4bit", "local:gan"]),
                   help="comma-separated; local:NAME runs NAME with every rank a local rank of one node")
    p.add_argument("--stall-s", type=float, default=0.0, help="optimizer_allreduce_stall: rank 1's stall")
    args = p.parse_args()
    global STALL_S
    STALL_S = args.stall_s
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    results = {}
    for name in args.scenarios.split(","):
        local, _, scenario = name.rpartition(":")
        _init_cgx(rank, world, bool(local))
        t0 = time.perf_counter()
        try:
            results[name] = {**SCENARIOS, **ON_REQUEST}[scenario](rank)
        except Exception:
            results[name] = {"crash": traceback.format_exc()}
        t1 = time.perf_counter()
        if scenario in LEAVES_GROUP_OUT_OF_STEP:
            torch.save(results, args.out)
            os._exit(0)
        cgx.shutdown()
        dist.barrier()  # both ranks done with this session before either opens the next
        print(f"rank {rank}: {name}: {t1 - t0:.2f}s, shutdown and barrier {time.perf_counter() - t1:.2f}s",
              file=sys.stderr)
    torch.save(results, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
