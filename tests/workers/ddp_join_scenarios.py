"""Scenarios of tests/workers/ddp_worker.py for uneven inputs under the DDP hook
(``cgx.join(opt, hook_state=state)``, tests/test_ddp_join.py): each takes the rank, returns
plain data and tensors."""

from __future__ import annotations

import gc
import time
from typing import Callable

import torch
from step_worker import model_for
from torch.nn.parallel import DistributedDataParallel as DDP

import cgx_ps.worker as cgx

HIDDEN = 300
BLOCK_BYTES = 16384
BUCKET_MB = 0.02  # several buckets, blocks across two of them
# batches per epoch on each rank: rank 0 runs out first in epoch 0, after a single batch (before
# DDP's bucket rebuild at the second forward), rank 1 first in epoch 1
BATCHES = ([1, 3], [4, 2])
STEP_S = 0.02  # emulated compute per batch


def _refused(enter: Callable[[], object]) -> str | None:
    """The CgxPsError that entering ``cgx.join`` (``enter()`` builds it) raises, or None."""
    try:
        with enter():
            pass
    except cgx.CgxPsError as exc:
        return str(exc)
    return None


def _hooked(model: torch.nn.Module, compression: str = "4bit", **ddp_kw) -> tuple[DDP, cgx.DDPHookState]:
    ddp = DDP(model, bucket_cap_mb=BUCKET_MB, **ddp_kw)
    state = cgx.DDPHookState(ddp, compression=compression, block_bytes=BLOCK_BYTES)
    ddp.register_comm_hook(state, cgx.ddp_comm_hook)
    return ddp, state


def _model(buffer: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    model = model_for(torch.float32, HIDDEN)
    if buffer:  # a buffer makes DDP broadcast before each forward unless broadcast_buffers=False
        model.register_buffer("scale", torch.full((1,), 0.5))
    return model


def join_uneven_run(rank: int) -> dict:
    """Two epochs of BATCHES[rank] batches, each inside ``cgx.join``: SGD with momentum on the
    DDP model (bucket views, a buffer, so broadcast_buffers=False). Also what the real state
    refuses: an optimizer holding another tensor, a nested join, a block ending without the
    step of its last backward."""
    model = _model(buffer=True)
    ddp, state = _hooked(model, broadcast_buffers=False, gradient_as_bucket_view=True)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    extra = torch.nn.Parameter(torch.zeros(3))
    refusals = [_refused(lambda: cgx.join(torch.optim.SGD([*ddp.parameters(), extra], lr=0.1), hook_state=state))]
    data = torch.Generator().manual_seed(1000 + rank)
    computed, started, marks = 0, time.monotonic(), []
    for epoch, batches in enumerate(BATCHES[rank]):
        marks.append(time.monotonic() - started)
        with cgx.join(opt, hook_state=state):
            if epoch == 0:
                refusals.append(_refused(lambda: cgx.join(opt, hook_state=state)))
            for _ in range(batches):
                x = torch.randn(8, 64, generator=data)
                loss = (ddp(x) * model.scale).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                time.sleep(STEP_S)
                opt.step()
                computed += 1
            marks.append(time.monotonic() - started)  # its batches done: its shadow steps begin
    took = time.monotonic() - started
    try:  # a block that ends after a backward, without its step (the round is applied by no node)
        with cgx.join(opt, hook_state=state):
            opt.zero_grad()
            (ddp(torch.randn(8, 64, generator=data)) * model.scale).pow(2).mean().backward()
    except cgx.CgxPsError as exc:
        refusals.append(str(exc))
    final = {n: p.detach().clone() for n, p in model.named_parameters()}
    final.update({f"{n}.momentum": opt.state[p]["momentum_buffer"].clone() for n, p in model.named_parameters()})
    return {"final": final, "computed": computed, "steps": state.steps_done, "train_s": took, "marks": marks,
            "refusals": refusals, "rebuilt": bool(ddp._has_rebuilt_buckets)}


def _refusals_before_registering() -> dict:
    """What ``cgx.join`` refuses before the state registers with the shards."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = {"not_a_state": _refused(lambda: cgx.join(opt, hook_state=object()))}
    inner = cgx.DDPHookState(model)  # on the model DDP wraps, not on DDP
    out["inner"] = _refused(lambda: cgx.join(opt, hook_state=inner))
    _, state = _hooked(model)
    out["not_an_optimizer"] = _refused(lambda: cgx.join(object(), hook_state=state))
    _, buffered = _hooked(_model(buffer=True))  # broadcast_buffers=True, DDP's default
    out["buffers"] = _refused(lambda: cgx.join(opt, hook_state=buffered))
    _, unused = _hooked(_model(), find_unused_parameters=True)
    out["unused"] = _refused(lambda: cgx.join(opt, hook_state=unused))
    return out


def join_misuse_run(rank: int) -> dict:
    """Each refusal of ``cgx.join(opt, hook_state=...)``; the last one (adaptive bits) after the
    state registered with the shards."""
    out = _refusals_before_registering()
    gc.collect()  # those states are gone: the next one registers alone
    ddp, state = _hooked(_model(), compression="adaptive:2")
    out["adaptive"] = _refused(lambda: cgx.join(torch.optim.SGD(ddp.parameters(), lr=0.1), hook_state=state))
    return out


def join_local_run(rank: int) -> dict:
    """``cgx.join`` with every rank a local rank of one node (run as local:join_local)."""
    ddp, state = _hooked(_model())
    return {"refusal": _refused(lambda: cgx.join(torch.optim.SGD(ddp.parameters(), lr=0.1), hook_state=state))}


JOIN_SCENARIOS = {"join_uneven": join_uneven_run, "join_misuse": join_misuse_run, "join_local": join_local_run}
