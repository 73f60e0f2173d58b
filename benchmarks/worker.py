"""Step time on loopback: cgx-ps 4-bit and fp32 (2 workers, 2 shards) vs DDP over gloo, one run.

    .venv/bin/python benchmarks/worker.py [--model mlp17m] [--steps 20] [--json out.json]

Same model, data, batch and threads for every configuration (benchmarks/ddp_step.py and
benchmarks/cgx_step.py share them). Loopback is fast, so this measures the overhead and overlap
of the cgx-ps pipeline, not the benefit of compression on a slow link (benchmarks/cluster.py).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path

from cgx_ps.server import LocalCluster

HERE = Path(__file__).resolve().parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(script: str, world: int, argv: list[str], env_for) -> list[dict]:
    procs = [subprocess.Popen([sys.executable, str(HERE / script), *argv], env=env_for(r), text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in range(world)]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=900)
        if p.returncode:
            raise RuntimeError(f"{script} failed:\n{stderr[-2000:]}")
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="mlp17m")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    common = ["--model", args.model, "--steps", str(args.steps), "--warmup", str(args.warmup), "--threads", "1"]
    base = dict(os.environ, OMP_NUM_THREADS="1")
    rows = []

    single = _run("ddp_step.py", 1, common, lambda r: dict(base, WORLD_SIZE="1", RANK="0"))[0]
    compute = single["median_step_s"]
    rows.append({"config": "single process (compute only)", "step_s": compute, "exposed_s": None})

    port = str(_free_port())
    ddp = _run("ddp_step.py", 2, common, lambda r: dict(base, WORLD_SIZE="2", RANK=str(r),
                                                       MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
    rows.append({"config": "DDP gloo fp32 (peer)", "step_s": max(d["median_step_s"] for d in ddp), "exposed_s": None})

    with LocalCluster(2, extra_args=["--log-level", "WARNING"]) as cluster:
        for compression in ("4bit", "fp32"):
            job = uuid.uuid4().hex[:8]
            res = _run("cgx_step.py", 2, [*common, "--compression", compression], lambda r, job=job: dict(
                base, RANK=str(r), WORLD_SIZE="2", CGX_PS_NODE_RANK=str(r), CGX_PS_NUM_NODES="2",
                **cluster.worker_env(), CGX_PS_JOB_ID=job))
            rows.append({"config": f"cgx-ps {compression}", "step_s": max(d["median_step_s"] for d in res),
                         "exposed_s": max(d["exposed_comm_s"] for d in res),
                         "mb_pushed": res[0]["bytes_pushed_per_step"] / 1e6})

    gloo = rows[1]["step_s"]
    print(f"model {args.model}, 2 workers, batch 64, 1 thread each, loopback, median of {args.steps} steps")
    print("| configuration | step (s) | vs DDP gloo | comm exposed after overlap | MB pushed/step/worker |")
    print("|---|---|---|---|---|")
    for r in rows:
        exposed = "" if r["exposed_s"] is None else f"{r['exposed_s']:.3f} s ({r['exposed_s'] / r['step_s']:.0%})"
        mb = f"{r['mb_pushed']:.1f}" if "mb_pushed" in r else ""
        print(f"| {r['config']} | {r['step_s']:.3f} | {gloo / r['step_s']:.2f}x | {exposed} | {mb} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
