"""Step time on loopback: cgx-ps 4-bit and fp32 (2 workers, 2 shards) vs DDP over gloo, one run.

    .venv/bin/python benchmarks/worker.py [--model mlp17m] [--steps 20] [--rounds 1] [--json out.json]

The cgx-ps rows: ``DistributedOptimizer`` (cgx_step.py) and the DDP communication hook
(ddp_step.py --hook cgx), 4-bit, and the optimizer at fp32; with their CPU seconds per step of
one worker process (all threads; the shards apart), the figure that decides the step time when
the cores are shared. ``--rounds N`` repeats the two 4-bit front ends N times, interleaved.

Same model, data, batch and threads for every configuration (benchmarks/ddp_step.py and
benchmarks/cgx_step.py share them). Loopback is fast, so this measures the overhead and overlap
of the cgx-ps pipeline, not the benefit of compression on a slow link (benchmarks/cluster.py).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import uuid
from pathlib import Path

if __name__ == "__main__" and not __package__:  # `python benchmarks/worker.py`: import the package
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.localjob import run_ranks  # noqa: E402
from cgx_ps.server import LocalCluster  # noqa: E402

HERE = Path(__file__).resolve().parent
# the two 4-bit front ends: DistributedOptimizer (cgx_step.py) and the DDP hook (ddp_step.py)
FRONT_ENDS = {"cgx-ps 4bit": ("cgx_step.py", "--compression", "4bit"),
              "DDP + cgx-ps hook 4bit": ("ddp_step.py", "--hook", "cgx", "--compression", "4bit")}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_cgx_job(cluster: LocalCluster, argv: list, base_env: dict[str, str]) -> list[dict]:
    """Two ranks of ``argv`` (cgx_step.py, or ddp_step.py --hook cgx) as one job on ``cluster``'s
    shards (a fresh job id: runs one after another share the shards); each rank's result."""
    job, port = uuid.uuid4().hex[:8], str(_free_port())
    return run_ranks(argv, 2, lambda r: dict(
        base_env, RANK=str(r), WORLD_SIZE="2", CGX_PS_NODE_RANK=str(r), CGX_PS_NUM_NODES="2",
        **cluster.worker_env(), CGX_PS_JOB_ID=job, MASTER_ADDR="127.0.0.1", MASTER_PORT=port))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="mlp17m")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1, help="interleaved repeats of the two 4-bit front ends")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    common = ["--model", args.model, "--steps", str(args.steps), "--warmup", str(args.warmup), "--threads", "1"]
    base = dict(os.environ, OMP_NUM_THREADS="1")
    rows = []

    ddp_step, cgx_step = [sys.executable, HERE / "ddp_step.py", *common], [sys.executable, HERE / "cgx_step.py", *common]
    single = run_ranks(ddp_step, 1, lambda r: dict(base, WORLD_SIZE="1", RANK="0"))[0]
    compute = single["median_step_s"]
    rows.append({"config": "single process (compute only)", "step_s": compute, "exposed_s": None})

    port = str(_free_port())
    ddp = run_ranks(ddp_step, 2, lambda r: dict(base, WORLD_SIZE="2", RANK=str(r),
                                                MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
    rows.append({"config": "DDP gloo fp32 (peer)", "step_s": max(d["median_step_s"] for d in ddp), "exposed_s": None})

    runs = [(label, [sys.executable, HERE / script, *common, *flags])
            for label, (script, *flags) in FRONT_ENDS.items()] * args.rounds
    with LocalCluster(2, extra_args=["--log-level", "WARNING"]) as cluster:
        for label, argv in [*runs, ("cgx-ps fp32", [*cgx_step, "--compression", "fp32"])]:
            res = run_cgx_job(cluster, argv, base)
            rows.append({"config": label, "step_s": max(d["median_step_s"] for d in res),
                         "exposed_s": max(d["exposed_comm_s"] for d in res),
                         "mb_pushed": res[0]["bytes_pushed_per_step"] / 1e6,
                         "cpu_s": sum(d["cpu_s_per_step"] for d in res) / len(res)})

    gloo = rows[1]["step_s"]
    print(f"model {args.model}, 2 workers, batch 64, 1 thread each, loopback, median of {args.steps} steps")
    print("| configuration | step (s) | vs DDP gloo | comm exposed after overlap | MB pushed/step/worker "
          "| worker CPU s/step |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        exposed = "" if r["exposed_s"] is None else f"{r['exposed_s']:.3f} s ({r['exposed_s'] / r['step_s']:.0%})"
        mb = f"{r['mb_pushed']:.1f}" if "mb_pushed" in r else ""
        cpu = f"{r['cpu_s']:.3f}" if "cpu_s" in r else ""
        print(f"| {r['config']} | {r['step_s']:.3f} | {gloo / r['step_s']:.2f}x | {exposed} | {mb} | {cpu} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
