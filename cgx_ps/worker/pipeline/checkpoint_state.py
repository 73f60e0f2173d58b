"""Checkpoints of a block pipeline: what a resumed job needs to continue bit for bit.

``BlockPipeline.state_dict()`` / ``load_state_dict()`` delegate here; the front ends'
``StepDriver`` (``frontends/step_driver.py``) adds the tuner's state and ``checkpoint.py`` writes the files.

    state = pipeline_state(pipe)   # between steps: counters, codec settings, auto mode, residuals
    restore(pipe, state)           # before the first step; CheckpointError if it does not fit

What is saved: the step count and each block's round counter (the rounds give the wire's
round ids and the encoders' seeds), each block's codec settings (adaptive bits change them),
auto mode's choice, and the error-feedback residuals of the blocks this process pushes, with
the node and local rank that owned them. A state is checked whole (``parse_state``, a pure
function of the state and this job's layout) before anything of the pipeline changes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

import torch

from ...model_layout import layout_hash
from ...v1 import ps_pb2
from ..errors import CheckpointError
from ..frontends.stepstats import StepStats

if TYPE_CHECKING:
    from .block_pipeline import BlockPipeline

__all__ = ["STATE_VERSION", "Restored", "check_between_steps", "parse_state", "pipeline_state", "restore"]

log = logging.getLogger(__name__)

STATE_VERSION = 1  # of pipeline_state(); a checkpoint of another version is refused


def pipeline_state(pipe: BlockPipeline) -> dict:
    """This process's part of a checkpoint (between steps): the step and round counters (the
    rounds give the seeds), each block's codec settings (adaptive bits), auto mode's choice,
    and the error-feedback residuals of the blocks this process pushes. Plain data and CPU
    tensors (``torch.load(weights_only=True)`` reads it)."""
    check_between_steps(pipe, "state_dict()")
    blocks = pipe._blocks
    return {
        "version": STATE_VERSION,
        "layout_hash": layout_hash(pipe.layout),
        "owner": _owner(pipe),
        "steps": pipe.steps,
        "compress": pipe.compress,
        "rounds": [b.round for b in blocks],
        "settings": [_settings_to_list(b.settings) for b in blocks],
        "residuals": {b.spec.block_id: b.feedback.residual.detach().cpu().clone() for b in blocks
                      if b.feedback is not None and b.feedback.residual is not None},
    }


def restore(pipe: BlockPipeline, state: Mapping) -> None:
    """Continue from ``pipeline_state()`` of a checkpoint, before this process's first step:
    counters, settings and auto mode's choice are restored, and every shard resumes the
    blocks at the checkpoint's rounds. Residuals are restored when the checkpoint was saved
    by the same node and local rank of a job of the same shape; otherwise (another rank's
    file, another node count) they start from zero, as in a fresh job (module doc of
    ``optimizer.py``). Raises ``CheckpointError`` for another layout or a damaged state."""
    check_between_steps(pipe, "load_state_dict()")
    if pipe._exchanged:
        raise CheckpointError("load the checkpoint before the first step: this process has already "
                              "exchanged gradients in the shards' current session")
    restored = parse_state(state, pipe.layout)
    keep_residuals = restored.owner == _owner(pipe)
    if restored.residuals and not keep_residuals:
        log.warning("checkpoint saved by node %s local rank %s of %s node(s): its error-feedback residuals "
                    "are not this process's and start from zero", restored.owner.get("node_rank"),
                    restored.owner.get("local_rank"), restored.owner.get("num_nodes"))
    for block, round_, settings in zip(pipe._blocks, restored.rounds, restored.settings):
        block.round = block.base = round_
        block.settings = settings
        if block.feedback is not None:
            residual = restored.residuals.get(block.spec.block_id) if keep_residuals else None
            block.feedback.residual = None if residual is None else residual.to(block.buffer.device, copy=True)
    pipe.steps, pipe.compress = restored.steps, restored.compress
    pipe.stats = StepStats(step=max(0, restored.steps - 1), compressed=pipe.compressing)
    by_round: dict[int, list[ps_pb2.BlockCodec]] = {}
    for block in pipe._blocks:
        by_round.setdefault(block.round, []).append(ps_pb2.BlockCodec(block_id=block.spec.block_id,
                                                                     codec=block.settings))
    for round_, blocks in sorted(by_round.items()):
        pipe._engine.set_codecs(round_, blocks, resume=True)


def check_between_steps(pipe: BlockPipeline, what: str) -> None:
    """Raise ``CheckpointError`` when a block of the step has arrived or been submitted: a state
    taken or restored then would split a step."""
    if pipe.arrivals.started():
        raise CheckpointError(f"{what} in the middle of a step: call it between steps (after step())")


def _owner(pipe: BlockPipeline) -> dict:
    """Whose residuals: they fit only the same node and local rank of a job of the same shape."""
    c = pipe.config
    return {"node_rank": c.node_rank, "local_rank": c.local_rank, "num_nodes": c.num_nodes,
            "local_world_size": c.local_world_size}


@dataclass(frozen=True)
class Restored:
    """A checked state: what ``restore`` applies."""

    owner: dict
    steps: int
    compress: bool
    rounds: list[int]
    settings: list[ps_pb2.CodecSettings]
    residuals: dict[int, torch.Tensor]


def _settings_to_list(s: ps_pb2.CodecSettings) -> list:
    return [int(s.codec), int(s.bits), int(s.bucket_size), bool(s.stochastic)]


def parse_state(state: Mapping, layout: ps_pb2.Layout) -> Restored:
    """Check a pipeline state against this job's layout; raises ``CheckpointError`` naming the
    first thing that does not fit."""
    if not isinstance(state, Mapping):
        raise CheckpointError(f"the cgx-ps state is a {type(state).__name__}, not a dict")
    missing = [k for k in ("version", "layout_hash", "owner", "steps", "compress", "rounds", "settings", "residuals")
               if k not in state]
    if missing:
        raise CheckpointError(f"the cgx-ps state lacks {', '.join(missing)}: not saved by state_dict()?")
    if state["version"] != STATE_VERSION:
        raise CheckpointError(f"cgx-ps state version {state['version']!r}, this cgx-ps reads version {STATE_VERSION}")
    mine = layout_hash(layout)
    if state["layout_hash"] != mine:
        raise CheckpointError(f"the checkpoint is of another model layout (layout hash {str(state['layout_hash'])[:12]}… "
                              f"vs this job's {mine[:12]}…): same model, compression, block_bytes and number of "
                              f"shards are needed to resume")
    n = len(layout.blocks)
    rounds, settings = state["rounds"], state["settings"]
    if len(rounds) != n or len(settings) != n:
        raise CheckpointError(f"the checkpoint has {len(rounds)} rounds and {len(settings)} settings for {n} blocks")
    if not all(isinstance(r, int) and 0 <= r < 1 << 32 for r in rounds):
        raise CheckpointError("the checkpoint's rounds must be integers in 0..2^32-1")
    if not isinstance(state["steps"], int) or state["steps"] < 0:
        raise CheckpointError(f"the checkpoint's step count {state['steps']!r} is not an integer >= 0")
    parsed = []
    for spec, item in zip(layout.blocks, settings):
        try:
            codec, bits, bucket, stochastic = item
            parsed.append(ps_pb2.CodecSettings(codec=codec, bits=bits, bucket_size=bucket, stochastic=stochastic))
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"block {spec.block_id}: codec settings {item!r} are not [codec, bits, bucket, "
                                  f"stochastic]: {exc}") from None
        if (parsed[-1].codec == ps_pb2.CODEC_MAXMIN) != (spec.codec.codec == ps_pb2.CODEC_MAXMIN):
            raise CheckpointError(f"block {spec.block_id}: the checkpoint's codec {parsed[-1].codec} does not fit the "
                                  f"layout's {spec.codec.codec}")
    residuals = state["residuals"]
    numel = {b.block_id: b.numel for b in layout.blocks}
    for block_id, residual in residuals.items():
        if not isinstance(residual, torch.Tensor) or block_id not in numel or residual.numel() != numel[block_id] \
                or residual.dtype != torch.float32:
            raise CheckpointError(f"the checkpoint's residual for block {block_id!r} does not fit the layout (a "
                                  f"float32 tensor of the block's {numel.get(block_id, '?')} elements is needed)")
    return Restored(dict(state["owner"]), state["steps"], bool(state["compress"]), list(rounds), parsed,
                    dict(residuals))
