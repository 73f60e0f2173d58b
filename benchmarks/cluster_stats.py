"""Aggregating the cluster benchmark's rows over repeated runs (``benchmarks/cluster.py``).

On a shared 2-core machine one run of a configuration says little: others' jobs slow any run
down by tens of percent.  So the benchmark repeats its sweep (``--repeat``), and runs made at
different times are merged from several JSON files (``benchmarks/cluster_report.py --json``).
Every row then belongs to

- a **group**: one table of the report (model, link rate, topology, worker hosts, shards, batch,
  threads, timed and warm-up steps); rows of different groups are never compared with each other;
- a **run**: one pass of the sweep, ``(source, run)``: the JSON file it came from and the
  repetition within that file (rows written before ``--repeat`` existed are run 1).

``summarize`` collapses a group's rows into one row per configuration: the median of every
measured figure, the min-max range of each, the number of measurements, and the ratios between
configurations recomputed from the medians.  A summary row has the keys of a measured row, so
the report draws tables, checks and charts from either.  A configuration measured twice in one
run (``--configs cgx-4bit ddp-fp32 cgx-4bit``) contributes both measurements.

Pure functions of the rows: no files and no clock, so they are tested with synthetic rows.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from typing import Iterable

__all__ = ["MEDIAN_FIELDS", "RANGE_FIELDS", "fmt", "group_key", "groups", "panel_key", "relative_figures", "run_key", "run_label",
           "runs_of", "summarize"]

# measured figures whose median a summary row carries (the ratios are recomputed instead)
MEDIAN_FIELDS = (
    "step_s", "comm_s", "compute_s", "compute_cpu_s", "exposed_comm_s", "ideal_s", "eval_loss",
    "host_cpu_s_per_step", "worker_cpu_s_per_step", "colocated_cpu_s_per_step", "shard_cpu_s_per_step",
    "tx_bytes", "rx_bytes", "link_bytes", "pushed_bytes", "fp32_bytes",
    "busy_cores", "own_cores", "irq_cores", "other_cores", "load_before", "load_after", "wall_s",
)
# the figures whose min-max range the report shows next to the median
RANGE_FIELDS = ("step_s", "comm_s", "host_cpu_s_per_step", "compute_s")

# what identifies a table: rows that differ in any of these measure different things (the eval
# loss after 20 steps is not comparable with the loss after 30)
_GROUP_FIELDS = ("model", "scale", "compute_ms", "rate", "topology", "workers", "shards", "batch_size", "threads",
                 "steps", "warmup", "auto_interval")  # scale, compute_ms: shaped models only (cluster_models.py)


def fmt(x, spec: str = ".3f", suffix: str = "") -> str:
    """A figure for a table: "-" when missing or not finite."""
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec) + suffix


def group_key(row: dict) -> tuple:
    """The table a row belongs to."""
    return tuple(row.get(f) for f in _GROUP_FIELDS)


def groups(rows: list[dict]) -> dict[tuple, list[dict]]:
    """The rows by group (one table each), in order of first appearance."""
    out: dict[tuple, list[dict]] = {}
    for r in rows:
        out.setdefault(group_key(r), []).append(r)
    return out


def panel_key(row: dict) -> tuple:
    """The chart panel a row belongs to in the step-time-against-link-rate chart: its group
    without the link rate."""
    return tuple(row.get(f) for f in _GROUP_FIELDS if f != "rate")


def run_key(row: dict) -> tuple[str, int]:
    """(source, run): the JSON file a row came from and the repetition within it."""
    return (row.get("source", ""), int(row.get("run", 1)))


def run_label(key: tuple[str, int], sources: int) -> str:
    """How the report names a run: "run 2", or "a.json run 2" when files were merged."""
    source, run = key
    return f"{source} run {run}" if sources > 1 and source else f"run {run}"


def runs_of(rows: Iterable[dict]) -> dict[tuple[str, int], list[dict]]:
    """The rows of each run, runs in the order they first appear."""
    runs: dict[tuple[str, int], list[dict]] = {}
    for r in rows:
        runs.setdefault(run_key(r), []).append(r)
    return runs


def _median_and_range(values: list[float]) -> tuple[float | None, tuple[float, float] | None]:
    if not values:
        return None, None
    return statistics.median(values), (min(values), max(values))


def _status(rows: list[dict]) -> str:
    """One measurement: its status as it was; several: how many ended how ("ok x3, timed out x1")."""
    if len(rows) == 1:
        return rows[0]["status"]
    counts = Counter(r["status"] for r in rows)
    return ", ".join(f"{status} x{n}" for status, n in counts.items())


def _summary_row(rows: list[dict]) -> dict:
    """One configuration's measurements (in one group) as one row of medians."""
    first = rows[0]
    measured = [r for r in rows if r.get("step_s") is not None]  # failed runs have no figures
    out = {k: first.get(k) for k in (*_GROUP_FIELDS, "config", "label")}
    out["status"] = _status(rows)
    out["n"] = len(measured)
    out["runs"] = len({run_key(r) for r in measured})
    out["range"] = {}
    for field in MEDIAN_FIELDS:
        med, span = _median_and_range([r[field] for r in measured if r.get(field) is not None])
        out[field] = med
        if field in RANGE_FIELDS and span is not None:
            out["range"][field] = span
    # the ratio of the medians (not the median of the ratios): the same rule as every other ratio
    out["comm_over_ideal"] = (out["comm_s"] / out["ideal_s"]
                              if out["comm_s"] is not None and out["ideal_s"] else None)
    return out


def summarize(rows: Iterable[dict]) -> list[dict]:
    """One group's rows -> one summary row per configuration, in the order they first appear.

    Single-process rows are kept apart by label (the measurement at the start of a run and the
    one at its end); the cross-configuration ratios (``relative_figures``) are recomputed from
    the medians."""
    by_config: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        by_config.setdefault((r["config"], r["label"]), []).append(r)
    summary = [_summary_row(rs) for rs in by_config.values()]
    relative_figures(summary)
    return summary


def relative_figures(rows: list[dict]) -> None:
    """Ratios between the configurations of one run (or of one group's summary), written into
    the rows: step speed-up vs DDP fp32, communication cut vs DDP fp32 and the fp16 hook, the
    hook's step vs DistributedOptimizer 4-bit, eval loss vs DDP fp32.  A configuration that
    appears twice counts with its last row (``summarize`` merges them first)."""
    by = {r["config"]: r for r in rows}
    ref = by.get("ddp-fp32")
    for r in rows:
        if r["config"] == "single":
            continue
        ok = ref and ref.get("step_s") and r.get("step_s")
        r["speedup_vs_ddp_fp32"] = ref["step_s"] / r["step_s"] if ok else None
        for cfg in ("ddp-fp32", "ddp-fp16"):
            o = by.get(cfg)
            ok = o and o.get("comm_s") and r.get("comm_s") and r["comm_s"] > 0
            r[f"comm_cut_vs_{cfg.replace('-', '_')}"] = o["comm_s"] / r["comm_s"] if ok else None
        opt = by.get("cgx-4bit")  # the hook's yardstick: the same pipeline behind DistributedOptimizer
        ok = r["config"] == "ddp-cgx-4bit" and opt and opt.get("step_s") and r.get("step_s")
        r["step_vs_cgx_4bit"] = r["step_s"] / opt["step_s"] if ok else None
        ok = ref and ref.get("eval_loss") and r.get("eval_loss") is not None
        r["loss_rel_vs_ddp_fp32"] = (r["eval_loss"] - ref["eval_loss"]) / ref["eval_loss"] if ok else None
