"""Broadcast from one rank to all through shard 0's blob store (no torch.distributed needed).

Blobs are written in a format that carries tensors and plain data only (``broadcast/blob_format.py``:
safetensors plus a JSON structure), never a pickle, so nothing a blob holds can run code in a
worker. A reader also checks that the blob was written by its session's root rank: the shard
stores each blob with the session member that put it.
"""

from __future__ import annotations

import itertools
from typing import Any, Mapping

import torch

from .blob_format import BlobFormatError, decode_object, encode_object
from ..errors import BroadcastError
from ..runtime import connected_engine, current_config

__all__ = ["broadcast_object", "broadcast_parameters", "broadcast_optimizer_state"]

_counter = itertools.count()  # every rank makes the same broadcasts in the same order


def broadcast_object(obj: Any, root_rank: int = 0, timeout_s: float | None = None) -> Any:
    """Return root_rank's ``obj`` on every rank. ``obj`` may hold tensors, numbers, strings,
    None, lists, tuples and dicts (a state_dict, an optimizer's state_dict). Non-root ranks wait
    up to ``timeout_s`` (default: the shards' round timeout) for the root to publish it."""
    config = current_config()
    engine = connected_engine()
    if timeout_s is None:
        timeout_s = engine.round_timeout_s
    root = config.member_of(root_rank)
    key = f"broadcast/{next(_counter)}"
    if config.rank == root_rank:
        engine.put_blob(key, encode_object(obj))
        return obj
    data, writer = engine.get_blob(key, timeout_s)
    if writer != root:
        raise BroadcastError(f"broadcast {key!r} was written by node {writer[0]!r} member {writer[1]}, not by the "
                             f"root rank {root_rank} ({root[0]} member {root[1]}): refused")
    try:
        return decode_object(data)
    except BlobFormatError as exc:
        raise BroadcastError(f"broadcast {key!r} from rank {root_rank} is not a valid cgx-ps broadcast: {exc}") from None


def broadcast_parameters(params: Mapping[str, torch.Tensor] | Any, root_rank: int = 0) -> None:
    """Copy root_rank's tensors into every rank's tensors in place (a state_dict or
    named_parameters())."""
    items = sorted(params.items() if isinstance(params, Mapping) else params, key=lambda kv: kv[0])
    tensors = {name: t for name, t in items if isinstance(t, torch.Tensor)}
    values = broadcast_object({n: t.detach().cpu() for n, t in tensors.items()}, root_rank)
    if not isinstance(values, dict):
        raise BroadcastError(f"broadcast_parameters: rank {root_rank} sent a {type(values).__name__}, not tensors")
    with torch.no_grad():
        for name, t in tensors.items():
            value = values.get(name)
            if not isinstance(value, torch.Tensor) or value.shape != t.shape:
                raise BroadcastError(f"broadcast_parameters: rank {root_rank} has no tensor {name!r} of shape "
                                     f"{tuple(t.shape)}: are all ranks building the same model?")
            t.copy_(value)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0) -> None:
    """Give every rank root_rank's optimizer state (momentum buffers, step counts, lr...).
    A DistributedOptimizer's own part (``"cgx_ps"``: counters, residuals) stays each rank's own."""
    state = optimizer.state_dict()
    state.pop("cgx_ps", None)  # per rank and per node: the residuals of root's blocks are not ours
    state = broadcast_object(state, root_rank)
    if current_config().rank != root_rank:
        try:
            optimizer.load_state_dict(state)
        except (ValueError, KeyError, TypeError) as exc:
            raise BroadcastError(f"broadcast_optimizer_state: rank {root_rank}'s state does not fit this "
                                 f"optimizer: {exc}") from None
