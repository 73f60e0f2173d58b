"""Checkpoint files of a job: one per rank and step, written atomically; a restarted job resumes
from the newest step that every rank finished saving.

    ckpt = cgx.Checkpoints("/ckpt")                   # a directory every rank can reach
    start, state = ckpt.load_latest()                 # (0, None) when there is none yet
    if state: model.load_state_dict(state["model"]); opt.load_state_dict(state["optimizer"])
    for step in range(start, steps):
        ...; opt.step()
        if (step + 1) % every == 0:
            ckpt.save(step + 1, {"model": model.state_dict(), "optimizer": opt.state_dict()})

Why a file per rank: error-feedback residuals belong to one node and one local rank (the share
of the blocks it pushes), so rank 0's file alone cannot resume the others bit for bit. Why the
newest *complete* step: a job killed while saving leaves some ranks' files of that step missing;
ranks of a synchronous job are never a step apart, so the checkpoint before it is complete, and
``keep=2`` keeps it. Under quorum rounds a node that caught up across a checkpoint's step skips
it, so the others may already have deleted the last step it saved: there the default is 3
(docs/stragglers.md). After a restart with another number of ranks (an elastic restart), rank r
reads rank r's file if there was one, else rank 0's: model and optimizer state are the same on
every rank, and the DistributedOptimizer drops the residuals that are not its own.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch

from .errors import CheckpointError
from .runtime import configured, current_config

__all__ = ["Checkpoints"]

log = logging.getLogger(__name__)

_NAME = re.compile(r"^step-(\d{9})\.rank-(\d+)-of-(\d+)\.pt$")


class Checkpoints:
    def __init__(self, directory: str | os.PathLike, rank: int | None = None, world_size: int | None = None,
                 keep: int | None = None) -> None:
        if keep is None:  # 2, or 3 under quorum rounds (module doc)
            config = configured()
            keep = 3 if config is not None and config.has_quorum else 2
        if keep < 2:
            raise CheckpointError(f"keep={keep}: at least 2, so a save cut short leaves a complete one behind")
        if rank is None or world_size is None:
            config = current_config()
            rank = config.rank if rank is None else rank
            world_size = config.world_size if world_size is None else world_size
        self.directory, self.rank, self.world_size, self.keep = Path(directory), rank, world_size, keep

    def path(self, step: int, rank: int, world_size: int) -> Path:
        return self.directory / f"step-{step:09d}.rank-{rank}-of-{world_size}.pt"

    def save(self, step: int, state: dict[str, Any]) -> Path:
        """Write this rank's ``state`` for ``step`` (atomically: a reader never sees half a file)
        and delete this rank's files older than the last ``keep`` steps."""
        self.directory.mkdir(parents=True, exist_ok=True)
        final = self.path(step, self.rank, self.world_size)
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{final.name}.")
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        mine = sorted(s for s, r, w in self._files() if r == self.rank and w == self.world_size)
        for old in mine[:-self.keep]:
            self.path(old, self.rank, self.world_size).unlink(missing_ok=True)
        return final

    def latest(self) -> tuple[int, int] | None:
        """(step, world size) of the newest checkpoint every rank of its job saved, or None."""
        ranks: dict[tuple[int, int], set[int]] = {}
        for step, rank, world in self._files():
            ranks.setdefault((step, world), set()).add(rank)
        complete = [key for key, have in ranks.items() if have >= set(range(key[1]))]
        return max(complete) if complete else None

    def load_latest(self) -> tuple[int, dict[str, Any] | None]:
        """(step, state) to resume from: this rank's file of the newest complete checkpoint
        (rank 0's if the saving job had fewer ranks), or (0, None) when there is none."""
        found = self.latest()
        if found is None:
            if self._files():  # a restart from step 0 over files of the job's: say why
                log.warning("%s holds checkpoint files but no step that every rank saved: starting from step 0",
                            self.directory)
            return 0, None
        step, world = found
        path = self.path(step, self.rank if self.rank < world else 0, world)
        try:
            return step, torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # a damaged or foreign file: say which
            raise CheckpointError(f"cannot read checkpoint {path}: {exc}") from exc

    def _files(self) -> list[tuple[int, int, int]]:
        if not self.directory.is_dir():
            return []
        found = []
        for entry in os.listdir(self.directory):
            m = _NAME.match(entry)
            if m:
                step, rank, world = map(int, m.groups())
                if rank < world:
                    found.append((step, rank, world))
        return found
