#!/usr/bin/env python3
"""One step of a cgx-ps timeline as a Gantt chart (matplotlib, PNG).

    CGX_PS_TIMELINE=/tmp/t/trace.json CGX_PS_TIMELINE_STEPS=5:7 <run a job>
    .venv/bin/python benchmarks/timeline_gantt.py /tmp/t/trace.*.json --step 6 --out step.png
    .venv/bin/python benchmarks/timeline_gantt.py --run /tmp/t --out step.png     # run the job too

``--run DIR`` traces the cluster benchmark's cgx-ps job (benchmarks/cgx_step.py: mlp17m, batch
64 per worker, one torch thread, 4 MB blocks, 4-bit) with 2 workers and 2 shards (one kernel
thread each) on this host's loopback, as benchmarks/worker.py runs it: the network namespaces
and shaped links of benchmarks/cluster.py are left out. Traces go to DIR.

Takes the files of every worker and shard of one host (one clock), and draws one row per
thread or track of each process: the training thread, the codec threads, each block's track
(its whole exchange as a pale bar, the network phases on it), a shard's kernel threads and its
receive and send tracks. Time runs from the step's first event. ``--ranks`` keeps some workers
(the others' rows are alike).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import uuid
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

if __name__ == "__main__" and not __package__:  # `python benchmarks/timeline_gantt.py`: import the package
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from cgx_ps import timeline  # noqa: E402

# parents: drawn pale and full height behind their children
PARENTS = {"step", "block"}
COLORS = {
    "step": "#d9d9d9", "block": "#e3ecf7",
    "backward-ready": "#8c564b", "exposed wait": "#7f7f7f", "write-back": "#bcbd22", "optimizer": "#17becf",
    "reduce": "#c5b0d5", "local sum": "#9467bd", "encode": "#1f77b4", "push": "#ff7f0e", "wait": "#ffd8a8",
    "pull": "#2ca02c", "decode": "#aec7e8",
    "receive": "#ff9896", "sum": "#d62728", "re-encode": "#9edae5", "send": "#98df8a",
}
_RANK = re.compile(r"worker rank (\d+)")


def row_label(process: str, thread: str) -> str:
    who = process.replace("worker ", "").split(" (")[0].replace(" of ", "/")
    thread = {"MainThread": "training thread"}.get(thread, thread)
    thread = re.sub(r"^cgx-codec_(\d+)$", r"codec thread \1", thread)
    thread = re.sub(r"^cgx-shard_(\d+)$", r"kernel thread \1", thread)
    return f"{who} · {thread}"


def rows_of(trace: dict, step: int, ranks: set[int] | None) -> tuple[list[str], dict[str, list[dict]]]:
    """Row labels in drawing order (workers by rank, then shards; threads, then tracks) and the
    step's spans on each row."""
    procs, threads, sort = {}, {}, {}
    for e in trace["traceEvents"]:
        if e["ph"] == "M" and e["name"] == "process_name":
            procs[e["pid"]] = e["args"]["name"]
        elif e["ph"] == "M" and e["name"] == "process_sort_index":
            sort[e["pid"]] = e["args"]["sort_index"]
        elif e["ph"] == "M" and e["name"] == "thread_name":
            threads[e["pid"], e["tid"]] = e["args"]["name"]
    spans: dict[tuple, list[dict]] = defaultdict(list)
    for e in trace["traceEvents"]:
        if e["ph"] == "X" and e["args"].get("step") == step:
            m = _RANK.match(procs.get(e["pid"], ""))
            if ranks is None or m is None or int(m.group(1)) in ranks:
                spans[e["pid"], e["tid"]].append(e)

    def order(key: tuple) -> tuple:
        pid, tid = key
        name = threads.get(key, str(tid))
        kind = 0 if name == "MainThread" else 1 if tid < 1 << 24 else 2  # training, threads, tracks
        return (sort.get(pid, 0), pid, kind, [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)])

    labels, by_label = [], {}
    for key in sorted(spans, key=order):
        label = row_label(procs.get(key[0], str(key[0])), threads.get(key, str(key[1])))
        labels.append(label)
        by_label[label] = spans[key]
    return labels, by_label


def draw(labels: list[str], rows: dict[str, list[dict]], title: str, out: str) -> None:
    t0 = min(e["ts"] for spans in rows.values() for e in spans)
    fig, ax = plt.subplots(figsize=(15, 1.6 + 0.24 * len(labels)))
    for y, label in enumerate(labels):
        for e in sorted(rows[label], key=lambda e: -e["dur"]):  # parents first, children over them
            parent = e["name"] in PARENTS
            ax.barh(y, e["dur"] / 1e3, left=(e["ts"] - t0) / 1e3, height=0.86 if parent else 0.56,
                    color=COLORS.get(e["name"], "#444444"), edgecolor="#555555" if parent else "none",
                    linewidth=0.4, zorder=1 if parent else 2)
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.set_ylim(len(labels) - 0.4, -0.6)
    ax.set_xlabel("ms since the step's first event (one clock: CLOCK_MONOTONIC of the host)")
    ax.grid(axis="x", color="#eeeeee", zorder=0)
    ax.set_axisbelow(True)
    for y, label in enumerate(labels[1:], 1):  # a line between processes
        if label.split(" · ")[0] != labels[y - 1].split(" · ")[0]:
            ax.axhline(y - 0.5, color="#888888", linewidth=0.8)
    present = {e["name"] for spans in rows.values() for e in spans}
    ax.legend(handles=[Patch(color=c, label=n) for n, c in COLORS.items() if n in present],
              loc="upper center", bbox_to_anchor=(0.5, -0.5 / (1.6 + 0.24 * len(labels)) - 0.04),
              ncol=9, fontsize=8, frameon=False)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def run_job(folder: str, steps: str, warmup: int, model: str, compression: str) -> list[str]:
    """cgx_step.py on 2 workers and 2 shards, every process tracing ``steps`` into ``folder``."""
    from cgx_ps.server import LocalCluster

    os.makedirs(folder, exist_ok=True)
    template = os.path.join(folder, "trace.json")
    stop = timeline.parse_steps(steps).stop or warmup + 1
    shard_args = ["--kernel-threads", "1", "--log-level", "WARNING", "--timeline", template, "--timeline-steps", steps]
    with LocalCluster(2, extra_args=shard_args) as cluster:
        env = dict(os.environ, **cluster.worker_env(), CGX_PS_TIMELINE=template, CGX_PS_TIMELINE_STEPS=steps,
                   WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", CGX_PS_NUM_NODES="2",
                   CGX_PS_JOB_ID=uuid.uuid4().hex[:8], OMP_NUM_THREADS="1")
        argv = [sys.executable, str(Path(__file__).resolve().parent / "cgx_step.py"), "--model", model,
                "--compression", compression, "--warmup", str(warmup), "--steps", str(max(stop - warmup, 1))]
        procs = [subprocess.Popen(argv, env=dict(env, RANK=str(r), CGX_PS_NODE_RANK=str(r)), stdout=subprocess.PIPE,
                                  text=True) for r in range(2)]
        for proc in procs:
            proc.communicate(timeout=1800)
            if proc.returncode:
                raise SystemExit(f"{argv[1]} exited with {proc.returncode}")
    return [os.path.join(folder, f"trace.{who}.json") for who in ("rank0", "rank1", "shard0", "shard1")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("traces", nargs="*", help="trace files of one host's workers and shards")
    p.add_argument("--run", metavar="DIR", help="run the 2-worker job first, tracing into DIR")
    p.add_argument("--run-steps", default="4:6", help="with --run: the steps traced (default %(default)s)")
    p.add_argument("--warmup", type=int, default=3, help="with --run: cgx_step.py's warm-up steps")
    p.add_argument("--model", default="mlp17m", help="with --run")
    p.add_argument("--compression", default="4bit", help="with --run")
    p.add_argument("--step", type=int, default=None, help="default: the middle one of the recorded steps")
    p.add_argument("--ranks", type=int, nargs="*", default=None, help="workers to draw (default: all)")
    p.add_argument("--title", default="")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.run:
        args.traces = run_job(args.run, args.run_steps, args.warmup, args.model, args.compression)
    if not args.traces:
        p.error("give trace files, or --run DIR")
    trace = timeline.merge(timeline.load(path) for path in args.traces)
    steps = sorted({e["args"]["step"] for e in trace["traceEvents"] if e["ph"] == "X"})
    if not steps:
        raise SystemExit("no spans in these files")
    step = steps[len(steps) // 2] if args.step is None else args.step
    labels, rows = rows_of(trace, step, set(args.ranks) if args.ranks is not None else None)
    if not labels:
        raise SystemExit(f"no spans of step {step}; recorded: {steps}")
    draw(labels, rows, args.title or f"one cgx-ps step ({step}) of {len(args.traces)} processes", args.out)
    print(f"{args.out}: step {step}, {len(labels)} rows, {sum(map(len, rows.values()))} spans")
    return 0


if __name__ == "__main__":
    sys.exit(main())
