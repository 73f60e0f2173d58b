"""Layer-wise adaptive compression (issue #7): pick each tensor's bit width from measured errors.

Uniform 4 bits spends the same precision on every tensor, yet tensors differ a lot in how much
error quantization adds to them. Following L-GreCo, we measure for every tensor and candidate bit
width the compression error and the exact wire size, then solve a multiple-choice knapsack:

* ``solve_min_bytes``: fewest total bytes with total error <= an error budget (``choose_bits``
  defaults to the total error of uniform 4 bits: as accurate as today's default, never bigger);
* ``solve_min_error``: least total error with total bytes <= a byte budget.

Both are exact dynamic programs over a discretized error axis (see ``_discretize`` for why the
error budget still holds exactly). The pieces here are pure algorithm; the optimizer decides when
to re-estimate, and ships the result as ``Compression.overrides``.

    avg = RunningAverage()
    ... each step: avg.update(name, param.grad) ...
    estimates = {n: estimate_tensor(avg.average(n)) for n in avg.names()}
    bits = choose_bits(estimates)          # {name: bits}; then avg.reset()
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np
import torch

from ..kernels import wire
from ..kernels.api import dequantize, quantize
from ..kernels.wire import HEADER_SIZE, Codec

__all__ = [
    "DEFAULT_CANDIDATES",
    "Option",
    "RunningAverage",
    "TensorEstimate",
    "choose_bits",
    "estimate_tensor",
    "evaluate",
    "solve_min_bytes",
    "solve_min_error",
]

DEFAULT_CANDIDATES: tuple[int, ...] = (2, 3, 4, 5, 6, 8)
Option = tuple[float, int]  # (squared L2 error, wire bytes) of one bit width for one tensor

_INF = np.iinfo(np.int64).max // 4  # "no solution" in the DP; sums of two stay below overflow
_DUAL_ROUNDS = 8  # range refinements of solve_min_error; it converges in 2-4 in practice


# --------------------------------------------------------------------------- estimation


class RunningAverage:
    """Per-tensor average of the gradients pushed since the last ``reset``.

    The bit-width decision is made every few hundred steps, and one step's gradient is noisy;
    the issue asks to estimate errors on the running average of each tensor's gradient. Updates
    are in place on one float32 buffer per tensor (``lerp_``: no temporaries for float32 input).

    ``decay=None`` keeps the exact arithmetic mean; ``decay=beta`` turns into an exponential
    moving average once ``1/count < 1 - beta`` (weight ``max(1/count, 1 - beta)``), so the first
    steps after a reset are averaged exactly instead of being biased toward zero.
    """

    def __init__(self, decay: float | None = None) -> None:
        if decay is not None and not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1) or None, got {decay}")
        self.decay = decay
        self._avg: dict[str, torch.Tensor] = {}
        self._count: dict[str, int] = {}

    @torch.no_grad()
    def update(self, name: str, grad: torch.Tensor) -> None:
        buf = self._avg.get(name)
        if buf is not None and buf.shape != grad.shape:
            raise ValueError(f"{name}: gradient shape {tuple(grad.shape)} != {tuple(buf.shape)}")
        count = self._count.get(name, 0) + 1
        self._count[name] = count
        if buf is None:  # first gradient ever: allocate the buffer once
            self._avg[name] = grad.detach().to(torch.float32, copy=True)
            return
        if count == 1:  # first gradient after a reset: reuse the buffer
            buf.copy_(grad)
            return
        weight = 1.0 / count if self.decay is None else max(1.0 / count, 1.0 - self.decay)
        g = grad.detach()
        if g.dtype != torch.float32 or g.device != buf.device:
            g = g.to(buf.device, torch.float32)
        buf.lerp_(g, weight)  # buf += weight * (g - buf)

    def average(self, name: str) -> torch.Tensor:
        """The running average (the live buffer: read it, don't modify it)."""
        if not self._count.get(name):
            raise KeyError(f"no gradient of {name!r} since the last reset")
        return self._avg[name]

    def count(self, name: str) -> int:
        return self._count.get(name, 0)

    def names(self) -> list[str]:
        """Tensors with at least one gradient since the last reset, sorted."""
        return sorted(n for n, c in self._count.items() if c)

    def __contains__(self, name: object) -> bool:
        return bool(self._count.get(name, 0))  # type: ignore[arg-type]

    def reset(self) -> None:
        """Start a new averaging window; the buffers are kept and reused."""
        self._count.clear()


@dataclass(frozen=True)
class TensorEstimate:
    """Per candidate bit width: squared L2 compression error and wire bytes of one tensor.

    ``sizes`` are the bytes of the tensor encoded as a block of its own (header included). In a
    layout tensors share blocks, so the real cost differs by a header and at most a bucket's
    metadata per block; the same for every candidate, so it does not move the decision.
    """

    numel: int
    bucket_size: int
    stochastic: bool
    errors: Mapping[int, float]
    sizes: Mapping[int, int]

    def options(self) -> dict[int, Option]:
        """``{bits: (error, bytes)}``, the input format of the solvers."""
        return {b: (self.errors[b], self.sizes[b]) for b in self.errors}


@torch.no_grad()
def estimate_tensor(
    grad: torch.Tensor,
    candidates: Iterable[int] = DEFAULT_CANDIDATES,
    bucket_size: int = 1024,
    *,
    stochastic: bool = False,
) -> TensorEstimate:
    """Measure ``||g - Q_b(g)||^2`` and the wire size of ``grad`` for every candidate ``b``.

    The error is measured with the codec itself (any device; CodecError on NaN/Inf), not a
    model of it. ``stochastic=False`` (the default) is the deterministic error of nearest
    rounding, ``dequantize(quantize(g, b, stochastic=False))``. Training uses stochastic rounding,
    whose error is larger: ``stochastic=True`` gives its exact expectation instead, from the same
    nearest-rounding pass (no sampling): an element at distance ``r <= unit/2`` from its nearest
    level rounds to the neighbouring levels with probabilities that make its expected squared
    error ``r * (unit - r)``. When the in-bucket positions are spread uniformly both are
    ``unit^2 * numel`` times a constant (1/12 vs 1/6), so the two choices rank bit widths almost
    alike; nearest is the default because it is what the codec provably does for a given input.
    """
    bits_list = sorted(set(int(b) for b in candidates))
    if not bits_list:
        raise ValueError("candidates is empty")
    g = grad.detach().reshape(-1)
    if g.dtype != torch.float32 or not g.is_contiguous():
        g = g.to(torch.float32).contiguous()
    numel = g.numel()
    work = torch.empty_like(g)
    errors: dict[int, float] = {}
    sizes: dict[int, int] = {}
    for b in bits_list:
        block = quantize(g, b, bucket_size, stochastic=False)
        sizes[b] = HEADER_SIZE + wire.body_size(Codec.MAXMIN, numel, b, bucket_size)
        dequantize(block, out=work)
        work.sub_(g).abs_()  # |r|: distance to the nearest level
        if stochastic:
            unit = _bucket_units(block.payload, numel, bucket_size).to(g.device)
            unit = unit.repeat_interleave(bucket_size)[:numel]
            torch.minimum(work, unit, out=work)  # float rounding must not make r > unit
            errors[b] = float(torch.sum(unit.sub_(work).mul_(work), dtype=torch.float64))
        else:
            errors[b] = float(torch.sum(work.square_(), dtype=torch.float64))
    return TensorEstimate(numel, bucket_size, stochastic, errors, sizes)


def _bucket_units(payload: np.ndarray | torch.Tensor, numel: int, bucket_size: int) -> torch.Tensor:
    """Per-bucket ``unit`` from a MAXMIN payload: (min, unit) float32 pairs follow the header."""
    nb = wire.num_buckets(numel, bucket_size)
    raw = payload if isinstance(payload, torch.Tensor) else torch.from_numpy(payload)
    return raw[HEADER_SIZE:HEADER_SIZE + 8 * nb].view(torch.float32).view(nb, 2)[:, 1].clone()


# --------------------------------------------------------------------------- solvers


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


def solve_min_error(
    options: Sequence[Mapping[int, Option]], byte_budget: int, resolution: int = 1000
) -> list[int]:
    """Choose one key per tensor: least total error subject to total bytes <= ``byte_budget``.

    The same DP as ``solve_min_bytes`` (minimum bytes for each level of discretized error);
    among the levels whose minimum bytes fit the budget, the solution with the least real error
    wins. Bytes are exact integers, so the byte budget holds exactly and infeasibility is
    detected exactly; only the objective is discretized. (A DP over discretized bytes would
    round the hard constraint instead, on budgets in the millions of bytes.)

    The first round spans every combination (``sum(max - min) / resolution`` per unit), which is
    coarse: 2-bit errors dwarf the optimum. Each next round re-discretizes ``[0, E]``, with ``E``
    the excess error of the best solution so far (the optimum lies inside), until ``E`` shrinks
    by less than 1%; the result is then within ``n * E / resolution`` of the optimum, before the
    same greedy slack pass as ``solve_min_bytes``.

    Raises ValueError when even the smallest choice of every tensor exceeds ``byte_budget``.
    """
    errs, sizes, keys = _arrays(options)
    _check_resolution(resolution)
    least = sum(int(s.min()) for s in sizes)
    if least > byte_budget:
        raise ValueError(
            f"byte budget {byte_budget} is below the smallest total size {least} "
            f"(every tensor at its smallest option)")
    excess = [e - e.min() for e in errs]

    def total_excess(choice: Sequence[int]) -> float:
        return math.fsum(float(x[c]) for x, c in zip(excess, choice))

    # A solution with excess <= span has at most resolution + n units (each tensor rounds up by
    # under one); options beyond the span get capacity + 1 and are never chosen. Round 1's span
    # holds every combination, so it finds the cheapest one if nothing else fits.
    capacity = resolution + len(errs)
    span = math.fsum(float(x.max()) for x in excess)
    choice = [int(np.argmin(s)) for s in sizes]  # within the budget (checked above)
    for _ in range(_DUAL_ROUNDS):
        units = [_discretize(x, span / resolution, capacity) for x in excess]
        best, real, choices = _levels(units, sizes, excess, capacity)
        at = int(np.argmin(np.where(best <= byte_budget, real, np.inf)))
        if best[at] > byte_budget:  # float fuzz hid every solution within the span: keep ours
            break
        found = _backtrack(choices, units, at)
        if total_excess(found) < total_excess(choice):
            choice = found
        narrower = total_excess(choice)
        if narrower <= 0 or narrower > 0.99 * span:  # the range stopped shrinking: done
            break
        span = narrower

    def total_bytes(choice: Sequence[int]) -> int:
        return sum(int(s[c]) for s, c in zip(sizes, choice))

    choice = _polish(errs, sizes, choice, byte_budget, total_bytes)
    return [k[c] for k, c in zip(keys, choice)]


def choose_bits(
    estimates: Mapping[str, TensorEstimate],
    *,
    error_budget: float | None = None,
    byte_budget: int | None = None,
    default_bits: int = 4,
    resolution: int = 1000,
) -> dict[str, int]:
    """Bits per tensor name (the shape of ``Compression.overrides``).

    With no budget, the error budget is the total error of uniform ``default_bits``: the same
    accuracy as today's default, in fewer bytes. If uniform ``default_bits`` is itself feasible
    and beats the DP's answer (possible only through the discretization), it is returned
    instead, so the result is never worse than the uniform default.
    """
    if error_budget is not None and byte_budget is not None:
        raise ValueError("give error_budget or byte_budget, not both")
    names = sorted(estimates)
    options = [estimates[n].options() for n in names]
    uniform: list[int] | None = None
    if all(default_bits in opts for opts in options):
        uniform = [default_bits] * len(names)
    if error_budget is None and byte_budget is None:
        if uniform is None:
            raise ValueError(f"default_bits={default_bits} is not a candidate of every tensor; "
                             "give a budget")
        error_budget = evaluate(options, uniform)[0]
    if byte_budget is not None:
        choice = solve_min_error(options, byte_budget, resolution)
        if uniform is not None:
            u_err, u_bytes = evaluate(options, uniform)
            if u_bytes <= byte_budget and u_err < evaluate(options, choice)[0]:
                choice = uniform
    else:
        assert error_budget is not None
        choice = solve_min_bytes(options, error_budget, resolution)
        if uniform is not None:
            u_err, u_bytes = evaluate(options, uniform)
            if u_err <= error_budget and u_bytes < evaluate(options, choice)[1]:
                choice = uniform
    return dict(zip(names, choice))


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
