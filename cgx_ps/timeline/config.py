"""Which steps a timeline records and which file each process writes (``CGX_PS_TIMELINE``)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ENV_PATH", "ENV_STEPS", "StepRange", "parse_steps", "trace_path"]

ENV_PATH = "CGX_PS_TIMELINE"
ENV_STEPS = "CGX_PS_TIMELINE_STEPS"


@dataclass(frozen=True)
class StepRange:
    """Steps ``start`` .. ``stop - 1`` (``stop`` None: no end), as a Python slice."""

    start: int = 0
    stop: int | None = None

    def __contains__(self, step: int) -> bool:
        return self.start <= step and (self.stop is None or step < self.stop)

    def __str__(self) -> str:
        return f"{self.start}:{'' if self.stop is None else self.stop}"


_STEPS = re.compile(r"^\s*(\d*)\s*(:?)\s*(\d*)\s*$")


def parse_steps(text: str, source: str = ENV_STEPS, error: type[Exception] = ValueError) -> StepRange:
    """``"a:b"`` (steps a..b-1), ``"a:"``, ``":b"``, ``"a"`` (step a alone) or ``""`` (all);
    raises ``error`` naming ``source`` for anything else."""
    m = _STEPS.match(text or "")
    if m is None:
        raise error(f"{source}={text!r} is not a step range: write a:b for steps a..b-1 "
                    f"(a: or :b leave a side open; one number is one step)")
    first, colon, last = m.groups()
    start = int(first) if first else 0
    stop = (int(last) if last else None) if colon else (start + 1 if first else None)
    if stop is not None and stop <= start:
        raise error(f"{source}={text!r} selects no step: the end ({stop}) must be above the start ({start})")
    return StepRange(start, stop)


def trace_path(template: str, role: str, index: int) -> str:
    """Where a process writes: ``trace.json`` -> ``trace.rank3.json`` (role "rank") or
    ``trace.shard1.json``. Every rank of a torchrun job gets the same environment, and a shell
    that exports the variable starts shards and workers alike: the role and index in the name
    keep their files apart whatever the world size."""
    path = Path(template)
    suffix = path.suffix or ".json"
    return str(path.with_name(f"{path.name[:len(path.name) - len(path.suffix)]}.{role}{index}{suffix}"))

