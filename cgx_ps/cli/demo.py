"""``cgx-ps demo``: local shards plus worker processes training a real model, end to end.

Starts ``--shards`` shard processes and ``--workers`` worker processes running
``cgx_ps/examples/train.py`` (digits classification, data bundled with scikit-learn), shows a
progress bar with per-step compression stats from rank 0, and ends with a summary: accuracy,
bytes sent versus fp32, step time, and whether every replica ended with bit-identical parameters.

The extras (``pip install 'cgx-ps[demo]'``) are optional: without scikit-learn the workers train
on synthetic data of the digits' shape, without tqdm progress is printed as plain lines.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from ..server.cluster import LocalCluster

__all__ = ["run_demo"]

TRAIN_MODULE = "cgx_ps.examples.train"
_EXTRAS = "pip install 'cgx-ps[demo]'"


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def _worker_env(rank: int, workers: int, local: int, cluster: LocalCluster, job_id: str) -> dict[str, str]:
    env = dict(os.environ, CGX_PS_JOB_ID=job_id)
    env.update(cluster.worker_env())  # the shards' addresses and the job token they require
    env.update(RANK=str(rank), WORLD_SIZE=str(workers), LOCAL_RANK=str(rank % local), LOCAL_WORLD_SIZE=str(local),
               CGX_PS_NODE_RANK=str(rank // local), CGX_PS_NUM_NODES=str(workers // local),
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def run_demo(args: argparse.Namespace) -> int:
    """``cgx-ps demo``: start a local cluster of shards and ``--workers`` worker processes that
    train a small model on the digits data (synthetic data without scikit-learn), then print a
    summary: test accuracy, step time, the bytes a node pushed against fp32, and whether the
    replicas ended identical.

    Args:
        args: the parsed flags of ``cgx-ps demo`` (workers, shards, local ranks, epochs, ...).

    Returns:
        The exit status: 0 when every worker finished, 1 otherwise.

    Raises:
        SystemExit: ``--local-ranks`` does not divide ``--workers``.
    """
    local = getattr(args, "local_ranks", 1)
    if local < 1 or args.workers % local:
        raise SystemExit(f"cgx-ps demo: --local-ranks {local} must divide --workers {args.workers}")
    data, tqdm = "digits", None
    if not _importable("sklearn"):  # the extras are optional: the demo runs without them
        data = "synthetic"
        print(f"cgx-ps demo: scikit-learn is not installed, so the workers train on synthetic data of the "
              f"digits' shape ({_EXTRAS} for the real digits)", flush=True)
    if not args.no_progress:
        try:
            from tqdm import tqdm
        except ImportError:
            print(f"cgx-ps demo: tqdm is not installed: progress as plain lines ({_EXTRAS} for a bar)", flush=True)
    logs = tempfile.mkdtemp(prefix="cgx-ps-demo-")
    nodes = f" as {args.workers // local} nodes of {local}" if local > 1 else ""
    print(f"cgx-ps demo: {args.shards} shards, {args.workers} workers{nodes}, compression {args.compression}, "
          f"{args.epochs} epochs (logs in {logs})", flush=True)
    t_start = time.perf_counter()
    # data_base_port None: the shards' own default, as `cgx-ps server` (gRPC only)
    with LocalCluster(args.shards, extra_args=["--log-level", "WARNING"], log_dir=logs,
                      data_base_port=None) as cluster:
        cmd = [sys.executable, "-m", TRAIN_MODULE, "--epochs", str(args.epochs), "--batch-size",
               str(args.batch_size), "--compression", args.compression, "--seed", str(args.seed), "--data", data,
               "--json"]
        job_id = f"demo-{uuid.uuid4().hex[:8]}"
        procs = [subprocess.Popen(cmd, env=_worker_env(r, args.workers, local, cluster, job_id), text=True,
                                  stdout=subprocess.PIPE, stderr=open(Path(logs) / f"worker{r}.log", "w"))
                 for r in range(args.workers)]
        summaries = _follow(procs, tqdm)
        codes = [p.wait() for p in procs]
    if any(codes):
        failed = [r for r, c in enumerate(codes) if c]
        print(f"cgx-ps demo: worker(s) {failed} failed; see {logs}/worker*.log", file=sys.stderr)
        for r in failed:
            print("".join(open(Path(logs) / f"worker{r}.log").readlines()[-15:]), file=sys.stderr)
        return 1
    _print_summary(summaries, time.perf_counter() - t_start, local)
    return 0


def _follow(procs: list[subprocess.Popen], tqdm) -> list[dict]:
    """Stream rank 0's step lines into a progress bar (plain lines if ``tqdm`` is None); collect
    every rank's final summary."""
    summaries: list[dict] = []
    bar = None
    for line in procs[0].stdout:
        event = _parse(line)
        if event is None:
            continue
        if event["event"] == "done":
            summaries.append(event)
            continue
        ratio = event["fp32_bytes"] / max(event["bytes"], 1)
        info = (f"loss {event['loss']:.3f} | sent {event['bytes'] / 1e3:.0f} kB ({ratio:.1f}x < fp32) | "
                f"step {event['step_s'] * 1e3:.0f} ms, comm exposed {event['exposed_s'] * 1e3:.0f} ms")
        if tqdm is None:
            if event["step"] % 20 == 0 or event["step"] == event["total_steps"]:
                print(f"step {event['step']}/{event['total_steps']} {info}", flush=True)
            continue
        if bar is None:
            bar = tqdm(total=event["total_steps"], unit="step", dynamic_ncols=True)
        bar.update(1)
        bar.set_postfix_str(info, refresh=False)
    if bar is not None:
        bar.close()
    for proc in procs[1:]:
        summaries += [e for e in map(_parse, proc.stdout) if e and e["event"] == "done"]
    return summaries


def _parse(line: str) -> dict | None:
    try:
        event = json.loads(line)
    except json.JSONDecodeError:
        return None
    return event if isinstance(event, dict) and "event" in event else None


def _print_summary(summaries: list[dict], wall_s: float, local: int = 1) -> None:
    summaries.sort(key=lambda s: s["rank"])
    first = summaries[0]
    identical = len({s["param_sha256"] for s in summaries}) == 1
    # a node's bytes: every block leaves it once, pushed by whichever local rank owns it
    node = summaries[:local]
    pushed, fp32 = sum(s["bytes_pushed"] for s in node), sum(s["fp32_bytes"] for s in node)
    ratio = fp32 / max(pushed, 1)
    print("\nsummary")
    print(f"  test accuracy        {first['accuracy'] * 100:.1f}%  (test loss {first['test_loss']:.3f})")
    print(f"  steps                {first['steps']} per worker, median step {first['median_step_s'] * 1e3:.1f} ms")
    print(f"  bytes pushed / node  {pushed / 1e6:.2f} MB vs {fp32 / 1e6:.2f} MB fp32 ({ratio:.1f}x less)"
          + (f", split over its {local} local ranks" if local > 1 else ""))
    print(f"  replicas identical   {'yes' if identical else 'NO'} ({len(summaries)} workers, "
          f"params sha256 {first['param_sha256'][:12]}…)")
    print(f"  wall time            {wall_s:.1f} s")
