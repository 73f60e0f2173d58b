"""The multiple-choice knapsack behind adaptive bits: one option (bits) per tensor.

``solve_min_bytes`` picks one option per tensor so that the total error stays within a budget
and the total bytes are fewest: an exact dynamic program over a discretized error axis (see
``_discretize`` for why the error budget still holds exactly), then a greedy pass that spends
the slack the rounding left. Pure algorithm on ``{bits: (error, bytes)}`` maps;
``adaptive.choose_bits`` states the problem.
"""

from __future__ import annotations

import math
from typing import Callable, Mapping, Sequence

import numpy as np

__all__ = ["Option", "evaluate", "solve_min_bytes"]

Option = tuple[float, int]  # (squared L2 error, wire bytes) of one bit width for one tensor

_INF = np.iinfo(np.int64).max // 4  # "no solution" in the DP; sums of two stay below overflow


def evaluate(options: Sequence[Mapping[int, Option]], choice: Sequence[int]) -> tuple[float, int]:
    """Total (error, bytes) of picking ``choice[i]`` for tensor ``i``; errors summed with fsum."""
    if len(choice) != len(options):
        raise ValueError(f"{len(choice)} choices for {len(options)} tensors")
    picked = [opts[c] for opts, c in zip(options, choice)]
    return math.fsum(e for e, _ in picked), sum(int(s) for _, s in picked)


def solve_min_bytes(
    options: Sequence[Mapping[int, Option]], error_budget: float, resolution: int = 1000
) -> list[int]:
    """Choose one key per tensor: fewest total bytes subject to total error <= ``error_budget``.

    ``options[i]`` maps a choice (bits) to its ``(error, bytes)``. Exact DP (minimum bytes for
    each level of discretized error) over ``resolution`` units of ``(budget - least total
    error) / resolution``, errors rounded UP (see ``_discretize``): the solution at level
    ``resolution`` meets the real budget and costs no more bytes than any solution whose real
    error is at most ``budget - n * unit``, since each tensor loses under a unit to the rounding.

    To win that loss back, the DP runs ``n`` levels further, each level's solution is scored
    with its real error, and the cheapest one within the real budget (fsum) wins; a greedy pass
    then spends what slack is left on single-tensor moves. Both only ever lower the bytes, and
    the level-0 solution (each tensor's least error) always fits. Ties go to the less error.
    O(n * (resolution + n) * options), vectorized over the error axis.

    Raises ValueError when even the least-error choice of every tensor exceeds the budget.
    """
    errs, sizes, keys = _arrays(options)
    _check_resolution(resolution)
    if math.isnan(error_budget) or error_budget < 0:
        raise ValueError(f"error_budget must be >= 0, got {error_budget}")
    floor = math.fsum(float(e.min()) for e in errs)  # the least achievable total error
    if floor > error_budget:
        raise ValueError(
            f"error budget {error_budget:.6g} is below the least achievable total error "
            f"{floor:.6g} (every tensor at its most precise option)")

    def total_error(choice: Sequence[int]) -> float:
        return math.fsum(float(e[c]) for e, c in zip(errs, choice))

    excess = [e - e.min() for e in errs]  # each tensor's least error costs 0 units
    unit = (error_budget - floor) / resolution
    capacity = resolution + len(errs)
    units = [_discretize(x, unit, capacity) for x in excess]
    best, real, choices = _levels(units, sizes, excess, capacity)
    fits = np.flatnonzero(real <= error_budget - floor)  # float screen; fsum decides below
    choice = [int(np.argmin(e)) for e in errs]  # level 0: always within the budget
    for at in fits[np.lexsort((real[fits], best[fits]))]:  # fewest bytes, then least error
        candidate = _backtrack(choices, units, int(at))
        if total_error(candidate) <= error_budget:
            choice = candidate
            break
    choice = _polish(sizes, errs, choice, error_budget, total_error)
    return [k[c] for k, c in zip(keys, choice)]


# --------------------------------------------------------------------------- DP internals


def _arrays(
    options: Sequence[Mapping[int, Option]],
) -> tuple[list[np.ndarray], list[np.ndarray], list[list[int]]]:
    """Per tensor: errors (float64), sizes (int64) and keys, sorted by (error, bytes).

    Sorting by error makes the DP's ties (equal bytes) keep the more precise option.
    """
    errs, sizes, keys = [], [], []
    for i, opts in enumerate(options):
        if not opts:
            raise ValueError(f"tensor {i} has no options")
        items = sorted(opts.items(), key=lambda kv: (float(kv[1][0]), int(kv[1][1])))
        e = np.array([float(v[0]) for _, v in items], dtype=np.float64)
        s = np.array([int(v[1]) for _, v in items], dtype=np.int64)
        if not np.isfinite(e).all() or (e < 0).any() or (s < 0).any():
            raise ValueError(f"tensor {i}: errors must be finite and >= 0, bytes >= 0: {opts}")
        errs.append(e)
        sizes.append(s)
        keys.append([k for k, _ in items])
    return errs, sizes, keys


def _check_resolution(resolution: int) -> None:
    if resolution < 1:
        raise ValueError(f"resolution must be >= 1, got {resolution}")


def _discretize(excess: np.ndarray, unit: float, capacity: int) -> np.ndarray:
    """Integer error units, rounded UP: ``units * unit >= excess`` for every option.

    Why rounding up keeps the budget: if the chosen options' units sum to at most
    ``resolution``, then sum(excess) <= sum(units) * unit <= resolution * unit = budget - least
    total error, i.e. the real total error is within the budget. Rounding to nearest could
    undercount every tensor by half a unit and overshoot the budget by n/2 units. The price of
    rounding up is under one unit per tensor, hence ``budget - n * unit`` in the guarantee.
    ``ceil`` of a float quotient can land one short (``k * unit`` just below ``excess``), so
    such options get one more unit. Options beyond ``capacity`` get ``capacity + 1``: never
    chosen, and no int64 overflow.
    """
    if unit <= 0:  # zero slack: only options with exactly the least error fit
        return np.where(excess > 0, capacity + 1, 0).astype(np.int64)
    if math.isinf(unit):  # no error budget at all
        return np.zeros(len(excess), dtype=np.int64)
    with np.errstate(over="ignore"):  # huge quotients: inf, clamped to capacity + 1 below
        units = np.ceil(excess / unit)
        units += units * unit < excess
    return np.minimum(units, float(capacity) + 1).astype(np.int64)


def _dp(units: list[np.ndarray], sizes: list[np.ndarray],
        capacity: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """``best[u]`` = min total bytes over choices with total units <= u, and the argmin tables.

    Starting from best[u] = 0 for every u gives the "at most u" meaning, so best is
    non-increasing in u. choices[i][u] is tensor i's option index in the optimum for
    tensors 0..i at level u; backtracking walks them from the last tensor down.
    """
    width = capacity + 1
    best = np.zeros(width, dtype=np.int64)
    shifted = np.empty(width, dtype=np.int64)
    choices: list[np.ndarray] = []
    for w, s in zip(units, sizes):
        new = np.full(width, _INF, dtype=np.int64)
        pick = np.zeros(width, dtype=np.int16)
        for j in range(len(w)):
            wj = int(w[j])
            if wj >= width:
                continue
            cand = np.add(best[:width - wj], s[j], out=shifted[:width - wj])  # option j at u
            better = cand < new[wj:]  # strict: on ties the earlier (less error) option stays
            np.minimum(new[wj:], cand, out=new[wj:])
            pick[wj:][better] = j
        best = new
        choices.append(pick)
    return best, choices


def _levels(units: list[np.ndarray], sizes: list[np.ndarray], excess: list[np.ndarray],
            capacity: int) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """The DP, plus the real excess error of every level's solution (all backtracked at once).

    Every tensor has a 0-unit option (its least error), so every level has a solution and the
    backtracking never leaves the table.
    """
    best, choices = _dp(units, sizes, capacity)
    at = np.arange(capacity + 1)
    real = np.zeros(capacity + 1)
    for i in range(len(choices) - 1, -1, -1):
        j = choices[i][at]
        real += excess[i][j]
        at -= units[i][j]
    return best, real, choices


def _backtrack(choices: list[np.ndarray], units: list[np.ndarray], at: int) -> list[int]:
    choice = [0] * len(choices)
    for i in range(len(choices) - 1, -1, -1):
        j = int(choices[i][at])
        choice[i] = j
        at -= int(units[i][j])
    return choice


def _polish(objective: list[np.ndarray], constraint: list[np.ndarray], choice: Sequence[int],
            limit: float, total: Callable[[Sequence[int]], float]) -> list[int]:
    """Greedy: while some single tensor can switch to an option with a lower objective whose
    constraint increase fits the real slack ``limit - total(choice)``, make the best such switch.

    The DP's rounding leaves up to one unit per tensor unused; this spends it. Every accepted
    move is re-checked with the exact ``total``, so the constraint keeps holding.
    """
    n = len(objective)
    if n == 0:
        return list(choice)
    k = max(len(o) for o in objective)
    obj = np.full((n, k), np.inf)
    con = np.full((n, k), np.inf)
    for i, (o, c) in enumerate(zip(objective, constraint)):
        obj[i, :len(o)] = o
        con[i, :len(c)] = c
    rows = np.arange(n)
    current = np.asarray(choice, dtype=np.int64)
    while True:
        slack = limit - total(current.tolist())
        gain = obj - obj[rows, current][:, None]
        ok = (gain < 0) & (con - con[rows, current][:, None] <= slack)
        if not ok.any():
            break
        i, j = np.unravel_index(int(np.argmin(np.where(ok, gain, 0.0))), gain.shape)
        trial = current.copy()
        trial[i] = j
        if total(trial.tolist()) > limit:  # float rounding at the edge: keep what holds
            break
        current = trial
    return current.tolist()
