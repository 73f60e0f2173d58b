"""Broadcast from one rank to all through shard 0's blob store (no torch.distributed needed)."""

from __future__ import annotations

import io
import itertools
from typing import Any, Mapping

import torch

from .runtime import connected_engine, current_config

__all__ = ["broadcast_object", "broadcast_parameters", "broadcast_optimizer_state"]

_counter = itertools.count()  # every rank makes the same broadcasts in the same order


def broadcast_object(obj: Any, root_rank: int = 0, timeout_s: float | None = None) -> Any:
    """Return root_rank's ``obj`` on every rank (serialized with torch.save). Non-root ranks wait
    up to ``timeout_s`` (default: the shards' round timeout) for the root to publish it."""
    config = current_config()
    engine = connected_engine()
    if timeout_s is None:
        timeout_s = engine.round_timeout_s
    key = f"broadcast/{next(_counter)}"
    if config.rank == root_rank:
        buf = io.BytesIO()
        torch.save(obj, buf)
        engine.put_blob(key, buf.getvalue())
        return obj
    data = engine.get_blob(key, timeout_s)
    return torch.load(io.BytesIO(data), weights_only=False)


def broadcast_parameters(params: Mapping[str, torch.Tensor] | Any, root_rank: int = 0) -> None:
    """Copy root_rank's tensors into every rank's tensors in place (a state_dict or
    named_parameters())."""
    items = sorted(params.items() if isinstance(params, Mapping) else params, key=lambda kv: kv[0])
    tensors = {name: t for name, t in items if isinstance(t, torch.Tensor)}
    values = broadcast_object({n: t.detach().cpu() for n, t in tensors.items()}, root_rank)
    with torch.no_grad():
        for name, t in tensors.items():
            if name not in values or values[name].shape != t.shape:
                raise ValueError(f"broadcast_parameters: rank {root_rank} has no tensor {name!r} of shape "
                                 f"{tuple(t.shape)}: are all ranks building the same model?")
            t.copy_(values[name])


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0) -> None:
    """Give every rank root_rank's optimizer state (momentum buffers, step counts, lr...)."""
    state = broadcast_object(optimizer.state_dict(), root_rank)
    if current_config().rank != root_rank:
        optimizer.load_state_dict(state)
