#!/usr/bin/env python3
"""The cluster benchmark's report (``benchmarks/cluster.py``): Markdown tables per group of
rows, each with the issue's targets (``cluster_targets.py``); charts are ``cluster_charts.py``.

With repeated runs (``cluster.py --repeat N``, or several JSON files merged here) every table
shows per configuration the median over the runs with the min-max range, and every target is
checked on the medians and in each run: the communication cuts must hold in every run.

Merge the JSON files of separate invocations (runs made at different times) into one report::

    python -m benchmarks.cluster_report --json a.json b.json c.json \\
        --markdown out.md --png out.png --links-png links.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

if __name__ == "__main__" and not __package__:  # `python benchmarks/cluster_report.py`: import the package
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.cluster_charts import plot, plot_links  # noqa: E402
from benchmarks.cluster_configs import CONFIGS  # noqa: E402
from benchmarks.cluster_models import describe, model_label  # noqa: E402
from benchmarks.cluster_stats import fmt, groups, run_label, runs_of, summarize  # noqa: E402
from benchmarks.cluster_targets import Verdict, judge  # noqa: E402

__all__ = ["ResultsFileError", "host_cpu", "load_results", "main", "markdown", "write_outputs"]




def _spread(r: dict, field: str, spec: str = ".3f") -> str:
    """A figure with its min-max range over the runs when there was more than one: "0.320 [0.300-0.500]"."""
    span = r.get("range", {}).get(field)
    if r.get("n", 1) <= 1 or span is None:
        return fmt(r.get(field), spec)
    return f"{fmt(r.get(field), spec)} [{fmt(span[0], spec)}-{fmt(span[1], spec)}]"


def host_cpu(r: dict) -> str:
    """CPU s/step/host, split into the worker's and its shard's where a shard shares the host.
    With several runs each part is its own median, so the parts need not add up exactly."""
    total, shard = r.get("host_cpu_s_per_step"), r.get("colocated_cpu_s_per_step")
    if total is None or not shard:
        return _spread(r, "host_cpu_s_per_step")
    joiner = " = " if r.get("n", 1) <= 1 else "; "
    return f"{_spread(r, 'host_cpu_s_per_step')}{joiner}{r['worker_cpu_s_per_step']:.3f} + {shard:.3f}"


def _verdict_line(v: Verdict, runs: int) -> str:
    if runs <= 1:
        return f"- {'PASS' if v.ok else 'FAIL'}: {v.on_medians.text}"
    listed = ", ".join("-" if c is None else c.value + ("" if c.ok else " (FAIL)") for _, c in v.per_run)
    met, measured = v.met_in
    if not measured:  # e.g. the two configurations come from different files
        return (f"- {'PASS' if v.ok else 'FAIL'}: on the medians, {v.on_medians.text}; no run measured both "
                f"configurations, so it is judged on the medians alone")
    rule = " (required in every run)" if v.every_run else ""
    return (f"- {'PASS' if v.ok else 'FAIL'}: on the medians, {v.on_medians.text}; per run: {listed}: "
            f"met in {met} of {measured} runs{rule}")


def _group_intro(summary: list[dict], runs: int) -> str:
    r0 = summary[0]
    singles = [r for r in summary if r["config"] == "single"]
    text = (f"batch {r0['batch_size']}/worker, {r0['threads']} thread/worker, median of {r0['steps']} steps "
            f"after {r0['warmup']} warm-up; ")
    if any(CONFIGS.get(r["config"], ("", ""))[1] == "auto" for r in summary):
        text += f"auto mode decides every {r0.get('auto_interval') or '100 (its default)'} steps; "
    if runs <= 1:
        twice = ("; a configuration measured more than once: median [min-max]"
                 if any(r["n"] > 1 for r in summary if r["config"] != "single") else "")
        return text + (f"single-process compute {fmt(r0['compute_s'])} s/step (the smaller of "
                       f"{', '.join(fmt(r.get('step_s')) for r in singles)} measured at the start and the end), "
                       f"its CPU {fmt(r0.get('compute_cpu_s'))} s/step; load average "
                       f"{fmt(r0.get('load_before'), '.2f')} at start{twice}\n")
    return text + (f"**medians over {runs} runs [min-max]**; single-process compute {_spread(r0, 'compute_s')} "
                   f"s/step (each run: the smaller of its measurements at the start and the end), its CPU "
                   f"{fmt(r0.get('compute_cpu_s'))} s/step; load average {fmt(r0.get('load_before'), '.2f')} "
                   f"at the start of a run (median)\n")


def _row_line(r: dict) -> str:
    tx = (f"{r['tx_bytes'] / 1e6:.1f} / {r['rx_bytes'] / 1e6:.1f}" if r.get("tx_bytes") is not None else "-")
    return (f"| {r['label']} | {_spread(r, 'step_s')} | {host_cpu(r)} "
            f"| {fmt(r.get('speedup_vs_ddp_fp32'), '.2f', 'x')} "
            f"| {_spread(r, 'comm_s')} | {fmt(r.get('exposed_comm_s'))} | {tx} | {fmt(r.get('ideal_s'))} "
            f"| {fmt(r.get('comm_over_ideal'), '.2f', 'x')} | {fmt(r.get('eval_loss'), '.4f')} "
            f"| {fmt(None if r.get('loss_rel_vs_ddp_fp32') is None else 100 * r['loss_rel_vs_ddp_fp32'], '+.2f', '%')} "
            f"| {fmt(r.get('shard_cpu_s_per_step'), '.3f')} "
            f"| {fmt(r.get('own_cores'), '.2f')} + {fmt(r.get('irq_cores'), '.2f')} + "
            f"{fmt(r.get('other_cores'), '.2f')} | {r['status']} |")


def _per_run_table(rs: list[dict]) -> list[str]:
    """Step (and comm) time of every configuration in every run: what the medians are taken over."""
    runs = runs_of(rs)
    sources = len({source for source, _ in runs})
    labels = list(dict.fromkeys(r["label"] for r in rs))
    out = ["Per run, step / comm time (s):\n",
           "| configuration | " + " | ".join(run_label(k, sources) for k in runs) + " |",
           "|---|" + "---|" * len(runs)]
    for label in labels:
        cells = []
        for run_rows in runs.values():
            found = [r for r in run_rows if r["label"] == label]
            cells.append(", ".join(
                (f"{fmt(r.get('step_s'))} / {fmt(r.get('comm_s'))}" if r["config"] != "single" else fmt(r.get("step_s")))
                if r.get("step_s") is not None else r["status"].split(" (")[0] for r in found) or "-")
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    return out + [""]


def markdown(rows: list[dict], args: argparse.Namespace | None = None) -> str:
    """One table per group (model, link rate, topology, hosts): medians [min-max] when the group
    was run more than once, a table of the runs, and the target checks."""
    out: list[str] = []
    for rs in groups(rows).values():
        summary = summarize(rs)
        runs = len(runs_of(rs))
        r0 = summary[0]
        shards = (f"{r0['shards']} dedicated shard hosts" if r0["topology"] == "dedicated"
                  else f"{r0['shards']} shards colocated on the worker hosts")
        out.append(f"### {model_label(r0)}, {r0['rate']} links, {r0['workers']} worker hosts, {shards}\n")
        out.append(describe(r0) + _group_intro(summary, runs))
        out.append("| configuration | step (s) | CPU s/step/host: worker + its shard | vs DDP fp32 "
                   "| comm (s) = step - compute | exposed comm (s) "
                   "| MB/step/host tx / rx | link-bound ideal (s) | comm / ideal | eval loss | loss vs DDP fp32 "
                   "| shard CPU s/step | CPU cores busy: ours + irq + others' | status |")
        out.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        out += [_row_line(r) for r in summary]
        out.append("")
        if runs > 1:
            out += _per_run_table(rs)
        verdicts = judge(rs)
        if verdicts:
            out.append("Targets:\n" if runs <= 1 else f"Targets, on the medians and in each of the {runs} runs:\n")
            out += [_verdict_line(v, runs) for v in verdicts]
            out.append("")
    return "\n".join(out)


class ResultsFileError(ValueError):
    """A --json file that is not the output of benchmarks/cluster.py --json."""


_ROW_KEYS = ("config", "label", "status", "model", "rate", "topology", "workers", "shards")


def load_results(paths: Sequence[str]) -> tuple[list[dict], list[str]]:
    """The rows of every file, each tagged with its ``source`` (the file's name, or its path where
    two names are the same) and ``run`` (1 for files written before --repeat), and a line per file
    for the report's header."""
    names = [Path(p).name for p in paths]
    rows: list[dict] = []
    about: list[str] = []
    for path, name in zip(paths, names):
        source = name if names.count(name) == 1 else str(path)
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise ResultsFileError(f"{path}: cannot read it as JSON ({e})") from e
        file_rows = data.get("rows") if isinstance(data, dict) else None
        if not isinstance(file_rows, list) or not all(isinstance(r, dict) for r in file_rows):
            raise ResultsFileError(f"{path}: no list of rows under \"rows\" (not written by cluster.py --json?)")
        for i, r in enumerate(file_rows):
            missing = [k for k in _ROW_KEYS if k not in r]
            if missing:
                raise ResultsFileError(f"{path}: row {i} lacks {', '.join(missing)}")
            rows.append({**r, "source": r.get("source", source), "run": int(r.get("run", 1))})
        runs = len({int(r.get("run", 1)) for r in file_rows})
        about.append(f"{source}: started {data.get('started', '?')}, {runs} run{'s' if runs != 1 else ''}, "
                     f"{len(file_rows)} rows")
    return rows, about


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.cluster_report",
        description="Merge the JSON files of benchmarks/cluster.py runs into one report: per configuration the "
                    "median over all runs with the min-max range, the targets checked on the medians and in "
                    "each run, and the charts.",
        epilog="Rows are grouped by model, link rate, topology, worker and shard hosts, batch, threads and steps; a run "
               "is one pass of the sweep in one file (cluster.py --repeat N writes N runs to one file).")
    p.add_argument("--json", nargs="+", required=True, metavar="PATH", help="cluster.py --json files to merge")
    p.add_argument("--markdown", metavar="PATH", help="also write the Markdown report here (it always goes to stdout)")
    p.add_argument("--png", metavar="PATH", help="bar chart of step times (matplotlib, Agg)")
    p.add_argument("--links-png", metavar="PATH", help="chart of step time against link rate, a line per configuration")
    return p.parse_args(argv)


def write_outputs(text: str, rows: list[dict], args: argparse.Namespace) -> None:
    """The report on stdout, and where asked (``--markdown``, ``--png``, ``--links-png``) in files."""
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text)
    if args.png:
        plot(rows, args.png)
    if args.links_png:
        plot_links(rows, args.links_png)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        rows, about = load_results(args.json)
    except ResultsFileError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    runs = len(runs_of(rows))
    text = (f"cgx-ps vs DDP on a throttled cluster: {runs} run{'s' if runs != 1 else ''} merged from "
            f"{len(args.json)} file{'s' if len(args.json) != 1 else ''}\n\n"
            + "\n".join(f"- {line}" for line in about) + "\n\n" + markdown(rows))
    write_outputs(text, rows, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
