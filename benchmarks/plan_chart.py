#!/usr/bin/env python3
"""The performance model (cgx_ps/planning/model.py) against the measured cells of BENCHMARKS.md, and its
extrapolation to 256 nodes as a chart.

    .venv/bin/python benchmarks/plan_chart.py                  # the error table (Markdown) on stdout
    .venv/bin/python benchmarks/plan_chart.py --png benchmarks/results/model-step-time-vs-nodes.png

The cells are mlp17m (benchmarks/workload.py) on emulated hosts of one 2-core machine (benchmarks/cluster.py):
one worker per host, its compute on the CPU. So the model runs with the CPU's fp16 cast speed (torch's cast,
1.09 G elements/s, measured by benchmarks/codec.py) in place of a GPU's, and each cell gives the compute alone that
its own run measured. The "shared cores" column adds what a real cluster does not have: every host's
CPU shares the machine's 2 cores (``predicted``). docs/performance-model.md has the table and what it shows.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path

if __name__ == "__main__" and not __package__:  # `python benchmarks/plan_chart.py`: import the package
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from cgx_ps.planning import Cluster, Speeds, Tensor, Workload, predict, workload  # noqa: E402

OPTIONS = ("ddp-fp32", "ddp-fp16", "ddp-powersgd", "cgx-8bit", "cgx-4bit", "cgx-2bit")
EMULATED = replace(Speeds(), cast_eps=1.09e9)  # the emulated hosts' "device" is the CPU (torch's fp16 cast)
CORES = 2


@dataclass(frozen=True)
class Cell:
    """One measured median step (s) of BENCHMARKS.md: ``source`` is "section: run", the heading of the section
    whose table holds it and the run within that section (its row: hosts, link, shards and option)."""

    source: str
    nodes: int
    rate: float
    shards: int | None  # None: colocated, one per host
    compute_s: float  # that run's compute alone (single process), or derived where the section gives none
    option: str
    measured_s: float
    model: str = "mlp17m"  # or a shaped model (benchmarks/shaped_model.py): its compute slept, not run
    scale: float = 1.0  # a shaped model's cluster.py --scale: its tensors, links, buckets and blocks times this
    block_mb: float = 4.0  # cluster.py --block-mb (cgx-ps's blocks at full size)


# compute: 0.100 and 0.139 (the two 1 Gbit/s runs' own), 0.138 (benchmarks/results/cluster-10gbit-150steps-3runs-
# auto.json, the runs' "single" rows); the 3-host section gives none, so it is solved from each row's own
# "comm cut vs DDP fp32": (ddp - x) / (cgx - x) = cut
FASTER, SLOWER, AUTO, THREE = ("Commodity cluster: faster host", "Commodity cluster: slower host",
                               "Auto mode: 10 Gbit/s", "Three worker hosts")
SHAPES4, SHAPES8 = "Real model shapes: 4 hosts, 1 Gbit/s", "Real model shapes: 8 hosts"
SHAPES16 = "Real model shapes: 16 hosts"
CELLS = (
    Cell(FASTER, 2, 1e9, None, 0.100, "ddp-fp32", 0.685),
    Cell(FASTER, 2, 1e9, None, 0.100, "ddp-fp16", 0.420),
    Cell(FASTER, 2, 1e9, None, 0.100, "cgx-4bit", 0.182),  # the raw plane's row
    Cell(SLOWER, 2, 1e9, None, 0.139, "ddp-fp32", 0.749),
    Cell(SLOWER, 2, 1e9, None, 0.139, "ddp-fp16", 0.505),
    Cell(SLOWER, 2, 1e9, None, 0.139, "cgx-4bit", 0.257),
    Cell(AUTO, 2, 1e10, None, 0.138, "ddp-fp32", 0.236),
) + tuple(Cell(THREE, 3, rate, shards, compute, option, measured)
          for rate, shards, compute, steps in (  # the 3-host table's rows: DDP fp32, DDP fp16, cgx-ps 4-bit
              (1e8, None, 0.178, (8.110, 4.333, 1.466)), (1e8, 2, 0.213, (8.120, 4.300, 1.895)),
              (1e9, None, 0.179, (1.195, 0.897, 0.606)), (1e9, 2, 0.193, (1.165, 0.863, 0.631)),
              (1e10, None, 0.165, (0.630, 0.579, 0.543)), (1e10, 2, 0.194, (0.545, 0.646, 0.644)))
          for option, measured in zip(("ddp-fp32", "ddp-fp16", "cgx-4bit"), steps)) + (
    # shaped models (cluster.py --scale): the published RTX 3090 compute, slept
    Cell(SHAPES4, 4, 1e9, None, 0.619, "ddp-fp32", 1.546, "resnet50", 0.05),
    Cell(SHAPES4, 4, 1e9, None, 0.619, "ddp-powersgd", 0.830, "resnet50", 0.05),
    Cell(SHAPES4, 4, 1e9, None, 0.619, "cgx-4bit", 0.650, "resnet50", 0.05),
    Cell(SHAPES4, 4, 1e9, None, 0.558, "ddp-fp32", 5.882, "bert-base", 0.04, 16.0),
    Cell(SHAPES4, 4, 1e9, None, 0.558, "ddp-powersgd", 0.951, "bert-base", 0.04, 16.0),
    Cell(SHAPES4, 4, 1e9, None, 0.558, "cgx-4bit", 1.189, "bert-base", 0.04, 16.0),
    Cell(SHAPES4, 4, 1e9, None, 0.361, "ddp-fp32", 6.669, "gpt2", 0.04, 16.0),
    Cell(SHAPES4, 4, 1e9, None, 0.361, "ddp-powersgd", 0.660, "gpt2", 0.04, 16.0),
    Cell(SHAPES4, 4, 1e9, None, 0.361, "cgx-4bit", 1.127, "gpt2", 0.04, 16.0),
    Cell(SHAPES4, 4, 1e9, None, 0.490, "ddp-fp32", 4.702, "vit-b16", 0.04, 16.0),
    Cell(SHAPES4, 4, 1e9, None, 0.490, "ddp-powersgd", 0.845, "vit-b16", 0.04, 16.0),
    Cell(SHAPES4, 4, 1e9, None, 0.490, "cgx-4bit", 0.837, "vit-b16", 0.04, 16.0),
    Cell(SHAPES8, 8, 1e9, None, 0.558, "ddp-fp32", 6.704, "bert-base", 0.04, 16.0),
    Cell(SHAPES8, 8, 1e9, None, 0.558, "ddp-powersgd", 1.047, "bert-base", 0.04, 16.0),
    Cell(SHAPES8, 8, 1e9, None, 0.558, "cgx-4bit", 1.631, "bert-base", 0.04, 16.0),
    Cell(SHAPES8, 8, 1e8, None, 0.619, "ddp-fp32", 15.729, "resnet50", 0.05),
    Cell(SHAPES8, 8, 1e8, None, 0.619, "cgx-4bit", 2.996, "resnet50", 0.05),
    Cell(SHAPES8, 8, 1e8, None, 0.619, "ddp-fp32", 15.719, "resnet50", 0.05, 16.0),
    Cell(SHAPES8, 8, 1e8, None, 0.619, "cgx-4bit", 3.618, "resnet50", 0.05, 16.0),
    Cell(SHAPES16, 16, 1e8, None, 0.619, "ddp-fp32", 16.319, "resnet50", 0.05),
    Cell(SHAPES16, 16, 1e8, None, 0.619, "cgx-4bit", 3.813, "resnet50", 0.05),
)


def mlp17m(compute_s: float) -> Workload:
    """benchmarks/workload.py's mlp17m, gradients in backward order; an MLP's FLOPs follow its parameters."""
    from benchmarks.workload import build_model

    tensors = [Tensor(name, tuple(p.shape)) for name, p in build_model("mlp17m").named_parameters()]
    return Workload("mlp17m", tuple(reversed(tensors)), compute_s)


def predicted(cell: Cell) -> tuple[float, float]:
    """The model's step for a cell, and the model of the run as the emulation made it.

    An mlp17m cell's second figure is the step on the emulation's shared cores: the workers compute at the
    same time, so with more hosts than cores each one's compute stretches by hosts / cores, and no step is
    shorter than all hosts' CPU (compute plus the model's communication CPU, shards included) over the cores.

    A shaped model's cell stands for the full-size model's step (its tensors and links scaled together, its
    published GPU compute slept: ``cluster.py --scale``), so its first figure is what ``cgx-ps plan`` predicts
    for that model, with the default (GPU) speeds. Its second is the run itself: the scaled tensors on the
    scaled link, with the benchmark's DDP bucket caps (explicit, so no small first bucket; PowerSGD's one
    bucket) and its blocks. The two differ where bytes do not scale with the tensors: PowerSGD's factors
    (n + m per matrix, and scaling a matrix's largest dimension by s leaves the other) and DDP's bucketing."""
    if cell.model != "mlp17m":
        full = workload(cell.model, cell.compute_s)
        step = predict(full, Cluster(cell.nodes, cell.rate, shards=cell.shards), Speeds(), cell.option).step_s
        return step, predict(emulated_run(full, cell), Cluster(cell.nodes, max(1.0, round(cell.rate * cell.scale)),
                                                                  shards=cell.shards), Speeds(), cell.option).step_s
    cluster = Cluster(cell.nodes, cell.rate, shards=cell.shards)
    model = predict(mlp17m(cell.compute_s), cluster, EMULATED, cell.option)
    stretched = cell.compute_s * max(1.0, cell.nodes / CORES)
    shared = predict(mlp17m(stretched), cluster, EMULATED, cell.option)
    hosts_cpu = cell.nodes * (cell.compute_s + shared.cpu_per_host_s) + (cell.shards or 0) * shared.shard_cpu_s
    return model.step_s, max(shared.step_s, hosts_cpu / CORES)


def emulated_run(full: Workload, cell: Cell) -> Workload:
    """A shaped model as ``cluster.py --scale`` runs it (``benchmarks/cluster_models.ModelRun``): every tensor
    scaled, DDP's bucket cap and cgx-ps's blocks times the scale, PowerSGD in its one bucket."""
    from benchmarks.cluster_models import DDP_BUCKET_MB
    from benchmarks.ddp_step import POWERSGD_BUCKET_CAP_MB
    from benchmarks.shaped_model import scaled_workload  # torch: only for the shaped cells

    bucket_mb = POWERSGD_BUCKET_CAP_MB if cell.option == "ddp-powersgd" else DDP_BUCKET_MB * cell.scale
    return replace(scaled_workload(full, cell.scale), ddp_bucket_bytes=int(bucket_mb * 2**20),
                   block_bytes=int(cell.block_mb * cell.scale * 2**20))


def error_table() -> str:
    lines = ["| BENCHMARKS.md section: run | hosts | link | shards | compute (s) | option | measured (s) | model (s) | error "
             "| model of the run as emulated (s) | error |", "|---|---:|---|---|---:|---|---:|---:|---:|---:|---:|"]
    errors, floored = [], []
    for c in CELLS:
        model, floor = predicted(c)
        e, f = model / c.measured_s - 1, floor / c.measured_s - 1
        errors.append(abs(e))
        floored.append(abs(f))
        rate = f"{c.rate / 1e9:g} Gbit/s" if c.rate >= 1e9 else f"{c.rate / 1e6:g} Mbit/s"
        shards = "colocated" if c.shards is None else f"{c.shards} dedicated"
        blocks = "" if c.block_mb == 4.0 else f", {c.block_mb:g} MB blocks"
        source = f"{c.source} ({c.model}{blocks})" if c.model else c.source
        lines.append(f"| {source} | {c.nodes} | {rate} | {shards} | {c.compute_s:.3f} | {c.option} | "
                     f"{c.measured_s:.3f} | {model:.3f} | {e:+.0%} | {floor:.3f} | {f:+.0%} |")
    lines.append(f"\nMedian |error|: model {statistics.median(errors):.0%}, of the run as emulated "
                 f"{statistics.median(floored):.0%}; within 15%: {sum(e <= 0.15 for e in errors)} and "
                 f"{sum(f <= 0.15 for f in floored)} of {len(CELLS)} cells.")
    return "\n".join(lines)


def chart(path: str, models: tuple[str, ...] = ("resnet50", "bert-base"), rates: tuple[float, ...] = (1e9, 1e10),
          nodes: tuple[int, ...] = (2, 4, 8, 16, 32, 64, 128, 256)) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(models), len(rates), figsize=(6 * len(rates), 4 * len(models)), squeeze=False)
    for i, name in enumerate(models):
        job = workload(name)
        for j, rate in enumerate(rates):
            ax = axes[i][j]
            for option in OPTIONS:
                steps = [predict(job, Cluster(n, rate), Speeds(), option).step_s for n in nodes]
                ax.plot(nodes, steps, marker="o", label=option)
            ax.axhline(job.compute_s, color="grey", linestyle=":", label="compute alone")
            ax.set_xscale("log", base=2)
            ax.set_title(f"{name} ({job.params / 1e6:.1f}M), {rate / 1e9:g} Gbit/s, 1 GPU per node")
            ax.set_xlabel("nodes")
            ax.set_ylabel("predicted step time (s)")
            ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle("cgx_ps/planning/model.py: DDP gloo (ring) vs cgx-ps (colocated shards), RTX 3090 compute")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n\n")[0])
    parser.add_argument("--png", default=None, help="draw step time against node count here")
    args = parser.parse_args()
    print(error_table())
    if args.png:
        chart(args.png)
        print(f"chart: {args.png}")


if __name__ == "__main__":
    main()
