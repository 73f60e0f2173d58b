"""Code trees side by side in one run, for the benchmarks that compare a change with the code
before it on a shared machine (``aggregator.py --trees``, ``sum_kernel.py --trees``).

A tree is a directory holding a ``cgx_ps`` package (``git archive <commit> cgx_ps | tar -x -C
DIR``). Each tree gets a child process of its own that answers one round per request; round r of
every tree runs back to back, the order rotated every round, so neighbouring rounds of different
trees see the same load and the paired ratios of their costs are the figure to trust. A child
starts in its tree with the tree first on PYTHONPATH (``python -c``/``-m`` would put the working
directory first whatever PYTHONPATH says) and prints the path of the ``cgx_ps`` it imported as
its first line: a child that imported another tree's code is refused, not measured.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Iterator, Sequence

__all__ = ["TreeChildren", "paired_ratio"]


class TreeChildren:
    """One child process per tree, each running ``python <child_args>`` (see the module doc)."""

    def __init__(self, trees: Sequence[Path], child_args: Sequence[str]) -> None:
        self.trees = list(trees)
        self.procs: list[subprocess.Popen] = []
        try:
            for tree in self.trees:
                path = os.pathsep.join([str(tree), *filter(None, [os.environ.get("PYTHONPATH")])])
                proc = subprocess.Popen([sys.executable, *child_args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        text=True, env={**os.environ, "PYTHONPATH": path}, cwd=tree)
                self.procs.append(proc)
                imported = Path(proc.stdout.readline().strip())
                if not imported.is_relative_to(tree):
                    raise SystemExit(f"{tree}: the child imported {imported}")
        except BaseException:
            self.close()
            raise

    def rounds(self, rounds: int, warmup: int = 2) -> Iterator[tuple[bool, int, str]]:
        """Ask every child for ``warmup + rounds`` rounds, alternated: (counted: past the warm-up
        rounds, the tree's index, the child's answer line) for each."""
        n = len(self.procs)
        for r in range(warmup + rounds):
            for k in [*range(r % n, n), *range(r % n)]:
                self.procs[k].stdin.write("round\n")
                self.procs[k].stdin.flush()
                yield r >= warmup, k, self.procs[k].stdout.readline()

    def close(self) -> None:
        for proc in self.procs:
            proc.stdin.close()
            proc.wait()

    def __enter__(self) -> "TreeChildren":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def paired_ratio(first: Sequence[float], other: Sequence[float]) -> float:
    """The median of round-by-round ratios ``first / other``: above 1 where ``other`` costs less."""
    return statistics.median(a / b for a, b in zip(first, other))
