"""A worker's CPU per step, by thread, for several code trees interleaved: the two 4-bit front ends
(DistributedOptimizer, the DDP hook) of each tree on the same shards, round after round.

    .venv/bin/python benchmarks/worker_cpu.py --trees DIR [DIR ...] [--rounds 5] [--steps 20] [--json out.json]
    .venv/bin/python benchmarks/worker_cpu.py --block-mb 4 8 16 --rounds 3     # this checkout, three block sizes

Each tree is a directory holding a ``cgx_ps`` package (``git archive <commit> | tar -x -C DIR``;
run ``python -m cgx_ps.kernels.warm`` there once: numba caches its kernels per tree); this checkout
is always the last, as in benchmarks/aggregator.py. A rank imports its tree's ``cgx_ps`` and then
runs this checkout's cgx_step.py / ddp_step.py, so every tree trains the same model on the same
data in the same timed loop; the shards (this checkout's) are shared by every run. Within a round
each front end runs once per tree, the trees' order rotated every round, so neighbouring runs of
different trees see the same load.

Per run: CPU seconds per timed step of one worker process (the mean of its two ranks), split by
thread role (``procstat.ThreadCpu``: training, communication, codec, other) with minor page
faults per step and each role's system (kernel) part. Per front end and tree: the median over
rounds, and the median of the paired ratios to the first tree, the figure to trust on a machine
shared with others. The trees must train bit-identically: the eval loss and the bytes pushed
per step of every run are compared, and the script fails where they differ. ``--block-mb`` runs
every tree at each of several block sizes too (interleaved with the rest; a block size is another
layout, so other bytes and another model, compared only with itself), with the step time: fewer,
larger messages against less overlap of communication with backward.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
ROLES = ("training", "communication", "codec", "other")


def child(tree: str, script: str, argv: list[str]) -> None:
    """One rank: ``tree``'s cgx_ps, this checkout's step script (``script``, e.g. cgx_step.py).
    Runs before anything imported cgx_ps: the scripts' imports then find the tree's loaded."""
    sys.path.insert(0, tree)
    import cgx_ps.worker

    if not Path(cgx_ps.worker.__file__).resolve().is_relative_to(Path(tree).resolve()):
        raise SystemExit(f"{tree}: imported {cgx_ps.worker.__file__} instead")
    sys.path[0] = str(HERE)  # this checkout's benchmarks package
    code = importlib.import_module(f"benchmarks.{Path(script).stem}").main(argv)
    sys.stdout.flush()
    os._exit(code)  # as the step scripts: skip gloo's teardown, the result is out


if __name__ == "__main__" and sys.argv[1:2] == ["--child"]:  # a rank: --child TREE SCRIPT, the script's flags
    child(sys.argv[2], sys.argv[3], sys.argv[4:])

if __name__ == "__main__" and not __package__:  # `python benchmarks/worker_cpu.py`: import the package
    sys.path[0] = str(HERE)

from benchmarks.worker import FRONT_ENDS, run_cgx_job  # noqa: E402
from cgx_ps.server import LocalCluster  # noqa: E402


def summarize(ranks: list[dict]) -> dict:
    """One run: the worker process's figures (the ranks' mean) and what must match across trees."""
    def mean(values) -> float:
        return statistics.fmean(values)

    return {"cpu_s": mean(r["cpu_s_per_step"] for r in ranks),
            "threads": {role: mean(r["thread_cpu_s_per_step"].get(role, 0.0) for r in ranks) for role in ROLES},
            "minflt": {role: mean(r["thread_minflt_per_step"].get(role, 0.0) for r in ranks) for role in ROLES},
            "sys": {role: mean((r.get("thread_sys_s_per_step") or {}).get(role, 0.0) for r in ranks) for role in ROLES},
            "step_s": max(r["median_step_s"] for r in ranks),
            "eval_loss": [r["eval_loss"] for r in ranks], "pushed": [r["bytes_pushed_per_step"] for r in ranks]}


def report(front_end: str, labels: list[str], runs: list[list[dict]]) -> None:
    """The table of one front end: ``runs[k]``, configuration k's runs in round order."""
    print(f"\n{front_end}: CPU ms per step of one worker process (median over {len(runs[0])} rounds; "
          f"minor page faults and the step time too)")
    print("| code | all threads (min) | training | communication | codec | other | × first, paired | faults "
          "| system part: training / comm. / codec / other | step (s) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|---:|")
    for k, label in enumerate(labels):
        cpu = [r["cpu_s"] * 1e3 for r in runs[k]]
        paired = statistics.median(a["cpu_s"] / b["cpu_s"] for a, b in zip(runs[k], runs[0]))
        roles = " | ".join(f"{statistics.median(r['threads'][role] for r in runs[k]) * 1e3:.1f}" for role in ROLES)
        faults = statistics.median(sum(r["minflt"].values()) for r in runs[k])
        step = statistics.median(r["step_s"] for r in runs[k])
        system = " / ".join(f"{statistics.median(r['sys'][role] for r in runs[k]) * 1e3:.1f}" for role in ROLES)
        print(f"| {label} | {statistics.median(cpu):.1f} ({min(cpu):.1f}) | {roles} | {paired:.3f} | {faults:.0f} "
              f"| {system} | {step:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trees", nargs="*", default=[], help="directories holding a cgx_ps package to compare")
    parser.add_argument("--block-mb", nargs="*", type=float, default=[4.0],
                        help="block sizes to run every tree with (fp32 MB; other sizes train other bytes)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per run (after --warmup)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--model", default="mlp17m")
    parser.add_argument("--front-ends", nargs="*", default=list(FRONT_ENDS), choices=list(FRONT_ENDS))
    parser.add_argument("--json", default=None, help="write every run's figures here")
    args = parser.parse_args()
    trees = [Path(t).resolve() for t in args.trees] + [HERE]
    for tree in trees:
        if not (tree / "cgx_ps" / "worker").is_dir():
            parser.error(f"no cgx_ps package under {tree}")
    configs = [(tree, mb) for mb in args.block_mb for tree in trees]
    labels = [f"{tree}" + (f" @ {mb:g} MB blocks" if len(args.block_mb) > 1 else "") for tree, mb in configs]
    common = ["--model", args.model, "--steps", str(args.steps), "--warmup", str(args.warmup), "--threads", "1"]
    base = dict(os.environ, OMP_NUM_THREADS="1")
    runs = {fe: [[] for _ in configs] for fe in args.front_ends}
    print(f"{len(configs)} configurations, {args.rounds} rounds; load average {os.getloadavg()[0]:.2f} at the start",
          flush=True)
    with LocalCluster(2, extra_args=["--log-level", "WARNING"]) as cluster:
        for r in range(args.rounds):
            for front_end in args.front_ends:
                script, *flags = FRONT_ENDS[front_end]
                for k in [*range(r % len(configs), len(configs)), *range(r % len(configs))]:
                    tree, mb = configs[k]
                    argv = [sys.executable, __file__, "--child", tree, script, *common, *flags, "--block-mb", str(mb)]
                    run = summarize(run_cgx_job(cluster, argv, base))
                    runs[front_end][k].append(run)
                    roles = ", ".join(f"{role} {run['threads'][role] * 1e3:.1f} ({run['sys'][role] * 1e3:.1f} sys)"
                                      for role in ROLES)
                    print(f"round {r} {front_end} {labels[k]}: {run['cpu_s'] * 1e3:.1f} ms/step ({roles}), "
                          f"step {run['step_s']:.3f} s, load {os.getloadavg()[0]:.2f}", flush=True)
    print(f"\nload average {os.getloadavg()[0]:.2f} at the end")
    identical = True
    for front_end in args.front_ends:
        report(front_end, labels, runs[front_end])
        for mb in args.block_mb:  # every tree trains the same bytes at one block size
            seen = {(tuple(run["eval_loss"]), tuple(run["pushed"]))
                    for (_, size), per_config in zip(configs, runs[front_end]) if size == mb for run in per_config}
            print(f"{mb:g} MB blocks: eval loss and bytes pushed per step (rank 0, rank 1) of every run: "
                  f"{sorted(seen)}")
            identical &= len(seen) == 1
    if args.json:
        Path(args.json).write_text(json.dumps({"configurations": labels, "runs": runs}, indent=1))
    if not identical:
        raise SystemExit("the trees did not train bit-identically (eval loss or bytes pushed differ)")


if __name__ == "__main__":
    main()
