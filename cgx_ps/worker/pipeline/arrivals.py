"""Which of a step's blocks can start: a block starts once every tensor it holds has its final
gradient for the step (the front end says which are final, in any order, from any autograd
thread), exactly once per step; at the end of backward the rest start with zeros for the tensors
that got no gradient. ``BlockPipeline`` keeps one ``StepArrivals`` and resets it between steps.
When each tensor arrived (``times``) is what auto mode's model takes as backward's order."""

from __future__ import annotations

import threading
import time
from typing import Iterable, Sequence

__all__ = ["StepArrivals"]


class StepArrivals:
    """This step's arrivals, per block id; ``tensors_in[b]``: the distinct tensors of block b."""

    def __init__(self, tensors_in: Sequence[Sequence[str]]) -> None:
        self._needed = [len(names) for names in tensors_in]
        self._blocks_of: dict[str, list[int]] = {}  # tensor -> the blocks holding a piece of it
        for block_id, names in enumerate(tensors_in):
            for name in names:
                self._blocks_of.setdefault(name, []).append(block_id)
        self._lock = threading.Lock()  # gradients may arrive on several autograd threads
        self._arrived: list[set[str]] = []
        self._submitted: list[bool] = []
        self._times: dict[str, float] = {}  # tensor -> when it first arrived this step (perf_counter)
        self.reset()

    def reset(self) -> None:
        """A new step: nothing arrived, nothing submitted."""
        with self._lock:
            self._arrived = [set() for _ in self._needed]
            self._submitted = [False] * len(self._needed)
            self._times = {}

    def blocks_of(self, names: Iterable[str]) -> list[int]:
        """The blocks holding any of these tensors, in order."""
        return sorted({b for n in names for b in self._blocks_of.get(n, ())})

    def ready(self, names: Iterable[str]) -> list[int]:
        """These tensors' gradients are final: the blocks that now have all their tensors, each
        returned once per step (the caller submits them). Saying so twice is harmless."""
        ready, now = [], time.perf_counter()
        with self._lock:
            for name in names:
                self._times.setdefault(name, now)
                for b in self._blocks_of.get(name, ()):
                    self._arrived[b].add(name)
                    if len(self._arrived[b]) == self._needed[b] and not self._submitted[b]:
                        self._submitted[b] = True
                        ready.append(b)
        return ready

    def times(self) -> dict[str, float]:
        """When each tensor said final this step first did (``time.perf_counter()``)."""
        with self._lock:
            return dict(self._times)

    def waits_for(self, name: str) -> bool:
        """Whether a block holding this tensor is still to be submitted this step."""
        with self._lock:
            return any(not self._submitted[b] for b in self._blocks_of.get(name, ()))

    def take_rest(self) -> list[int]:
        """The blocks ``ready`` has not returned this step; from now on it never will."""
        with self._lock:
            rest = [b for b, submitted in enumerate(self._submitted) if not submitted]
            for b in rest:
                self._submitted[b] = True
        return rest

    def all_submitted(self) -> bool:
        with self._lock:
            return all(self._submitted)

    def submitted(self) -> list[bool]:
        """Per block: submitted this step."""
        with self._lock:
            return list(self._submitted)

    def started(self) -> bool:
        """Whether anything arrived or was submitted this step (a checkpoint must come between steps)."""
        with self._lock:
            return any(self._submitted) or any(self._arrived)
