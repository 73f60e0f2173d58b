"""What a DDP step through DDP's own allreduce costs with and without a Python comm hook, in the
same run: plain DDP, DDP with torch's ``allreduce_hook`` (a Python hook doing what DDP does), and
DDP with the cgx-ps hook in auto mode on its uncompressed path (issue #16 item 4: "auto within 5%
of DDP").

    .venv/bin/python benchmarks/hook_overhead.py [--configs ddp,allreduce-hook,cgx-auto] [--steps 80]
        [--rounds 3] [--baseline-tree DIR]

2 ranks of ``ddp_step.py`` on loopback per run (gloo; 2 cgx-ps shards for the cgx hook), one run at
a time, the configurations interleaved in a rotated order each round. Configurations:

- ``ddp``: no hook (cluster.py's ddp-fp32); ``ddp-view``: the same with ``gradient_as_bucket_view``
  (as ddp_step.py builds DDP for the cgx hook);
- ``allreduce-hook``: torch's ``default_hooks.allreduce_hook``, bucket views: the cost of any Python
  comm hook on DDP's allreduce;
- ``cgx-auto``: the cgx hook with ``compression="auto:<steps+warmup+1>"``: auto mode's one decision
  comes after step 0, from its model (on loopback DDP's allreduce is far faster than the shards, so
  it chooses not to compress), and every timed step goes through DDP's allreduce with auto mode's
  per-step work (tuner, metrics) but without later decisions; a run whose decision was to
  compress is reported, not counted;
- ``cgx-auto-deciding``: ``compression="auto:<--interval>"``: real auto mode deciding every
  ``--interval`` steps (its probes, and any compressed tries its model finds plausible);
- ``cgx-4bit``: the cgx hook at 4 bits, every step compressed (blocks in place, early hand-over):
  what auto mode's compressed steps would cost in place;
- ``--baseline-tree DIR`` adds ``cgx-auto-baseline`` and ``cgx-auto-deciding-baseline``: the same
  from another checkout (``git archive <commit> | tar -x -C DIR``), interleaved with the rest:
  before and after in the same run.

Per configuration: the median over rounds of each run's CPU seconds per step (user + system, one
worker process, all threads; mean of the two ranks), of its median step time, and of its CPU per
thread role (``thread_cpu_s_per_step``, ``procstat.ThreadCpu``: training, communication, codec, other). CPU seconds, not step times, are
the figure to compare on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import uuid
from pathlib import Path
from typing import NamedTuple

if __name__ == "__main__" and not __package__:  # `python benchmarks/hook_overhead.py`: import the package
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.localjob import run_ranks  # noqa: E402
from cgx_ps.server import LocalCluster  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


class Config(NamedTuple):
    tree: Path  # the checkout whose ddp_step.py and cgx_ps run
    args: list[str]  # ddp_step.py's arguments
    held_uncompressed: bool = False  # a run where auto mode chose to compress is not counted


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def configurations(steps: int, warmup: int, baseline: Path | None, interval: int) -> dict[str, Config]:
    """Name -> how to run it."""
    held = ["--hook", "cgx", "--compression", f"auto:{steps + warmup + 1}"]  # one decision, after step 0
    deciding = ["--hook", "cgx", "--compression", f"auto:{interval}"]
    out = {
        "ddp": Config(ROOT, ["--hook", "none"]),  # DDP's built-in allreduce (cluster.py's ddp-fp32)
        "ddp-view": Config(ROOT, ["--hook", "none", "--bucket-view", "on"]),  # with the cgx hook's bucket views
        "allreduce-hook": Config(ROOT, ["--hook", "allreduce", "--bucket-view", "on"]),  # torch's Python hook
        "cgx-auto": Config(ROOT, held, held_uncompressed=True),
        "cgx-auto-deciding": Config(ROOT, deciding),
        "cgx-4bit": Config(ROOT, ["--hook", "cgx", "--compression", "4bit"]),  # compressed, blocks in place
    }
    if baseline is not None:
        out["cgx-auto-baseline"] = Config(baseline, held, held_uncompressed=True)
        out["cgx-auto-deciding-baseline"] = Config(baseline, deciding)
    return out


def run_once(cluster: LocalCluster, config: Config, common: list[str]) -> dict:
    """One 2-rank run; its figures."""
    tree, args = config.tree, config.args
    job, port = uuid.uuid4().hex[:8], str(_free_port())
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(tree))
    results = run_ranks([sys.executable, tree / "benchmarks/ddp_step.py", *common, *args], 2,
                        lambda r: dict(env, RANK=str(r), WORLD_SIZE="2", CGX_PS_NODE_RANK=str(r),
                                       CGX_PS_NUM_NODES="2", **cluster.worker_env(), CGX_PS_JOB_ID=job,
                                       MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
    decisions = [d.get("compress") for d in results[0].get("tuning", [])]
    threads: dict[str, float] = {}
    for r in results:
        for name, s in (r.get("thread_cpu_s_per_step") or {}).items():
            key = name.rstrip("0123456789_") or name  # one row per pool ("cgx-codec_0", "cgx-codec_1")
            threads[key] = threads.get(key, 0.0) + s / len(results)
    return {"cpu_s": statistics.mean(r["cpu_s_per_step"] for r in results), "by_path": cpu_by_path(results),
            "step_s": max(r["median_step_s"] for r in results), "decisions": decisions,
            "counted": not (config.held_uncompressed and any(decisions)), "threads": threads,
            "eval_loss": results[0]["eval_loss"]}


def cpu_by_path(results: list[dict]) -> dict[str, dict[str, float]]:
    """The timed steps' CPU seconds by how each was averaged (``timed_paths``: "allreduce",
    "compressed", "shards"): per path the steps' count and median, and their share of the run's
    mean (``mean_share``: sum / all timed steps), mean of the ranks. Empty without per-step paths
    (no cgx hook, or an older ddp_step.py)."""
    per_rank = []
    for r in results:
        paths, cpu = r.get("timed_paths"), r.get("step_cpu_s")
        if not paths or not cpu:
            return {}
        timed = cpu[len(cpu) - len(paths):]
        groups: dict[str, list[float]] = {}
        for path, seconds in zip(paths, timed):
            groups.setdefault(path, []).append(seconds)
        per_rank.append({p: {"steps": len(v), "median": statistics.median(v), "mean_share": sum(v) / len(timed)}
                         for p, v in groups.items()})
    return {p: {k: statistics.mean(g[p][k] for g in per_rank) for k in ("steps", "median", "mean_share")}
            for p in per_rank[0] if all(p in g for g in per_rank)}


def summarize(runs: list[dict]) -> dict:
    """Medians over the rounds of the runs counted."""
    ok = [r for r in runs if r["counted"]]
    if not ok:
        return {"runs": len(runs), "counted": 0}
    names = sorted({n for r in ok for n in r["threads"]}, key=lambda n: -statistics.median(
        r["threads"].get(n, 0.0) for r in ok))
    return {"runs": len(runs), "counted": len(ok), "cpu_s": statistics.median(r["cpu_s"] for r in ok),
            "cpu_s_all": [round(r["cpu_s"], 4) for r in ok], "step_s": statistics.median(r["step_s"] for r in ok),
            "threads": {n: statistics.median(r["threads"].get(n, 0.0) for r in ok) for n in names},
            "by_path": [r["by_path"] for r in ok]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="mlp17m")
    p.add_argument("--steps", type=int, default=80, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--configs", default="ddp,allreduce-hook,cgx-auto",
                   help="comma-separated, the first is the yardstick: ddp, ddp-view, allreduce-hook, cgx-auto, "
                   "cgx-auto-deciding, cgx-4bit, and with --baseline-tree cgx-auto-baseline, "
                   "cgx-auto-deciding-baseline")
    p.add_argument("--interval", type=int, default=25, help="cgx-auto-deciding: auto mode's decision interval")
    p.add_argument("--baseline-tree", type=Path, default=None, help="another checkout's cgx hook, interleaved")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    common = ["--model", args.model, "--steps", str(args.steps), "--warmup", str(args.warmup), "--threads", "1"]
    configs = configurations(args.steps, args.warmup, args.baseline_tree, args.interval)
    labels = [c for c in args.configs.split(",") if c]
    unknown = [c for c in labels if c not in configs]
    if unknown:
        p.error(f"unknown configurations {unknown} (cgx-auto-baseline needs --baseline-tree)")
    runs: dict[str, list[dict]] = {label: [] for label in labels}
    with LocalCluster(2, extra_args=["--log-level", "WARNING"]) as cluster:
        for round_ in range(args.rounds):
            order = labels[round_ % len(labels):] + labels[:round_ % len(labels)]  # rotated: drift spreads
            for label in order:
                run = run_once(cluster, configs[label], common)
                runs[label].append(run)
                print(f"round {round_} {label}: {run['cpu_s']:.4f} CPU s/step, step {run['step_s']:.3f} s, "
                      f"decisions {run['decisions']}{'' if run['counted'] else ' (compressed: not counted)'}",
                      file=sys.stderr, flush=True)
    summary = {label: summarize(runs[label]) for label in labels}
    ddp = summary[labels[0]].get("cpu_s")
    print(f"model {args.model}, 2 workers on loopback, 1 thread, {args.steps} timed steps, "
          f"median of {args.rounds} interleaved rounds")
    print("| configuration | CPU s/step/worker | vs DDP | step (s) | runs counted | top threads (CPU s/step) |")
    print("|---|---:|---:|---:|---:|---|")
    for label, s in summary.items():
        if "cpu_s" not in s:
            print(f"| {label} | - | - | - | 0 of {s['runs']} | |")
            continue
        top = ", ".join(f"{n} {v:.4f}" for n, v in list(s["threads"].items())[:4])
        print(f"| {label} | {s['cpu_s']:.4f} | {s['cpu_s'] / ddp:.3f}x | {s['step_s']:.3f} | "
              f"{s['counted']} of {s['runs']} | {top} |")
    for label, s in summary.items():  # auto mode's steps by path: what its compressed tries and decisions cost
        for i, by_path in enumerate(s.get("by_path", [])):
            if len(by_path) > 1:
                print(f"{label} run {i}: " + "; ".join(
                    f"{p}: {v['steps']:.0f} steps, median {v['median']:.4f} CPU s, {v['mean_share']:.4f} of the mean"
                    for p, v in by_path.items()))
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
