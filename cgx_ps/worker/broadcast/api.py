"""Broadcast from one rank to all through the shards' blob stores (no torch.distributed needed): the
blob is striped, a contiguous part on each shard (``shards/engine.py`` ``stripes``), so each shard's link carries
its share of every reader's copy.

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
    """Give every rank ``root_rank``'s object, through the shards' blob stores.

    Every rank calls it, in the same order as its other broadcasts.

    Args:
        obj: what to send (read on the root rank only): tensors, numbers, strings, None, lists,
            tuples and dicts of them (a state_dict, an optimizer's state_dict); no pickles.
        root_rank: the rank whose ``obj`` every rank receives.
        timeout_s: how long the other ranks wait for the root to publish it (default: the
            shards' round timeout).

    Returns:
        The root rank's object (on the root, ``obj`` itself).

    Raises:
        BroadcastError: the blob was not written by the root rank, or is not a valid broadcast.
        ConfigError: ``init()`` was not called, or no front end has opened the shards' session
            yet (create the ``DistributedOptimizer`` or register the DDP hook's state first).
        CgxPsError: a shard could not be reached, or the root did not publish in time.
    """
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
    """Copy ``root_rank``'s tensors into every rank's tensors, in place.

    Args:
        params: a mapping of names to tensors (``model.state_dict()``) or (name, tensor) pairs
            (``model.named_parameters()``); entries that are not tensors are skipped.
        root_rank: the rank whose values every rank takes.

    Raises:
        BroadcastError: the root has no tensor of that name and shape (the ranks built
            different models), or sent something else.
        ConfigError, CgxPsError: as for ``broadcast_object``.
    """
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
    """Give every rank ``root_rank``'s optimizer state (momentum buffers, step counts, lr...).

    A ``DistributedOptimizer``'s own part (``"cgx_ps"``: counters, residuals) stays each rank's own.

    Args:
        optimizer: the optimizer (a ``DistributedOptimizer`` or a plain torch one) on every rank.
        root_rank: the rank whose state every rank loads.

    Raises:
        BroadcastError: the root's state does not fit this rank's optimizer.
        ConfigError, CgxPsError: as for ``broadcast_object``.
    """
    state = optimizer.state_dict()
    state.pop("cgx_ps", None)  # per rank and per node: the residuals of root's blocks are not ours
    state = broadcast_object(state, root_rank)
    if current_config().rank != root_rank:
        try:
            optimizer.load_state_dict(state)
        except (ValueError, KeyError, TypeError) as exc:
            raise BroadcastError(f"broadcast_optimizer_state: rank {root_rank}'s state does not fit this "
                                 f"optimizer: {exc}") from None
