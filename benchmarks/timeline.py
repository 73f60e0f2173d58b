#!/usr/bin/env python3
"""What the timeline costs: step time with CGX_PS_TIMELINE's recorder off and on, interleaved.

    .venv/bin/python benchmarks/timeline.py [--model mlp17m] [--block-mb 4] [--phases 8] [--phase-steps 5]

2 shards (LocalCluster, not tracing: a shard's recorder is the same code) and 2 workers on
loopback train benchmarks/ddp_step.py's model (batch 64, one torch thread each). Each
worker alternates phases of ``--phase-steps`` steps with its recorder off and on (both workers
switch at the same step, between steps, so no block is in flight), after ``--warmup`` steps:
the two conditions share the same processes, connections, caches and the same minutes of a
shared machine's load. Reports the median step time of each condition per rank and their
ratio, and the cost of one span call measured alone (off: the ``None`` check a call site pays;
on: a span recorded), times the spans a step records.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import timeit
import uuid
from pathlib import Path

if __name__ == "__main__" and not __package__:  # `python benchmarks/timeline.py`: import the package
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.localjob import run_ranks  # noqa: E402


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.nn.functional as F
    from benchmarks.workload import Teacher, batch_seed, build_model, make_batch

    import cgx_ps.worker as cgx
    from cgx_ps import timeline

    torch.set_num_threads(args.threads)
    config = cgx.init()
    torch.manual_seed(0)
    model = build_model(args.model)
    opt = cgx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model.named_parameters(),
                                   compression=args.compression, block_bytes=int(args.block_mb * (1 << 20)))
    cgx.broadcast_parameters(model.state_dict(), root_rank=0)
    teacher = Teacher(args.model, 0)
    total = args.warmup + args.phases * args.phase_steps
    batches = [make_batch(args.model, teacher, args.batch_size, batch_seed(0, s, config.rank)) for s in range(total)]
    rec = timeline.Recorder(args.trace.replace(".json", f".rank{config.rank}.json"), f"worker rank {config.rank}")
    rows = []
    for step, (x, y) in enumerate(batches):
        phase = (step - args.warmup) // args.phase_steps
        on = step >= args.warmup and phase % 2 == 1  # off first: a phase's order does not favour "on"
        if on:
            timeline.start(rec)  # (a no-op while it records)
        else:
            # pause without writing: a write here would hold up the peer's next step
            timeline.stop(rec, write=False)
        t0, cpu0 = time.perf_counter(), time.process_time()
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        rows.append({"step": step, "on": on, "s": time.perf_counter() - t0, "cpu": time.process_time() - cpu0})
    timeline.stop(rec, write=False)
    rec.write()  # once, at the end: the trace of every "on" step
    cgx.shutdown()
    print(json.dumps({"rank": config.rank, "rows": rows[args.warmup:], "events": rec.recorded,
                      "on_steps": sum(r["on"] for r in rows)}), flush=True)


def span_costs() -> dict[str, float]:
    """ns per ``with timeline.span(...)`` call site, recorder off and on (best of 5)."""
    from cgx_ps import timeline

    def site() -> None:
        with timeline.span("encode", 3, block=1):
            pass

    n = 200_000
    off = min(timeit.repeat(site, number=n, repeat=5)) / n
    with tempfile.TemporaryDirectory() as tmp:
        timeline.start(timeline.Recorder(os.path.join(tmp, "t.json"), "bench", max_events=n))
        try:
            on = min(timeit.repeat(site, number=n, repeat=5)) / n
        finally:
            timeline.stop()
    return {"off_ns": off * 1e9, "on_ns": on * 1e9}


def paired_ratios(rows: list[dict], phase_steps: int) -> list[float]:
    """Median "on" step of each phase over the median of the "off" phase just before it: load
    that drifts over minutes on a shared machine cancels within a pair."""
    phases = [rows[i:i + phase_steps] for i in range(0, len(rows), phase_steps)]
    return [statistics.median(r["s"] for r in on) / statistics.median(r["s"] for r in off)
            for off, on in zip(phases[0::2], phases[1::2])]


def quartiles(values: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return q[0], q[2]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="mlp17m")
    p.add_argument("--compression", default="4bit")
    p.add_argument("--block-mb", type=float, default=4.0)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--phases", type=int, default=8, help="alternating off/on phases (even: as many of each)")
    p.add_argument("--phase-steps", type=int, default=5)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--trace", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0

    from cgx_ps.server import LocalCluster

    costs = span_costs()
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp, \
            LocalCluster(2, extra_args=["--kernel-threads", "1", "--log-level", "WARNING"]) as cluster:
        job = uuid.uuid4().hex[:8]
        worker_argv = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                       if k not in ("json", "worker", "trace")]

        def env(rank: int) -> dict[str, str]:
            env = dict(os.environ, **cluster.worker_env(), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0",
                       LOCAL_WORLD_SIZE="1", CGX_PS_NODE_RANK=str(rank), CGX_PS_NUM_NODES="2", CGX_PS_JOB_ID=job,
                       OMP_NUM_THREADS=str(args.threads))
            env.pop("CGX_PS_TIMELINE", None)  # the worker switches its recorder itself
            return env

        results = run_ranks([sys.executable, __file__, *worker_argv, "--worker", "--trace",
                             os.path.join(tmp, "trace.json")], 2, env, timeout=1800)
    per_rank = []
    for res in results:
        off = statistics.median(r["s"] for r in res["rows"] if not r["on"])
        on = statistics.median(r["s"] for r in res["rows"] if r["on"])
        pairs = paired_ratios(res["rows"], args.phase_steps)
        events_per_step = res["events"] / max(res["on_steps"], 1)
        per_rank.append({"rank": res["rank"], "off_s": off, "on_s": on, "overhead": on / off - 1,
                         "paired": statistics.median(pairs) - 1, "paired_q": quartiles(pairs),
                         # CPU seconds of the whole worker process (all its threads) per step: what
                         # the recorder adds, less exposed to other jobs' load than wall time
                         "cpu_overhead": statistics.median(r["cpu"] for r in res["rows"] if r["on"])
                         / statistics.median(r["cpu"] for r in res["rows"] if not r["on"]) - 1,
                         "events_per_step": events_per_step,
                         "predicted_on": events_per_step * costs["on_ns"] * 1e-9 / off,
                         "predicted_off": events_per_step * costs["off_ns"] * 1e-9 / off})
    summary = {"model": args.model, "block_mb": args.block_mb, "compression": args.compression,
               "phases": args.phases, "phase_steps": args.phase_steps, "load_before": load0,
               "load_after": os.getloadavg()[0], **costs, "ranks": per_rank,
               "steps": {res["rank"]: res["rows"] for res in results}}
    print(f"{args.model}, {args.compression}, {args.block_mb:g} MB blocks, {args.phases} phases x "
          f"{args.phase_steps} steps; load {load0:.1f} -> {summary['load_after']:.1f}")
    print(f"one span call site: {costs['off_ns']:.0f} ns off, {costs['on_ns']:.0f} ns on")
    print("| rank | step off (median) | step on (median) | on / off - 1 | paired phases: median (quartiles) "
          "| CPU/step on / off - 1 | events/step | predicted: on | off |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in per_rank:
        lo, hi = r["paired_q"]
        print(f"| {r['rank']} | {r['off_s'] * 1e3:.1f} ms | {r['on_s'] * 1e3:.1f} ms | {r['overhead']:+.2%} | "
              f"{r['paired']:+.2%} ({lo - 1:+.1%} .. {hi - 1:+.1%}) | {r['cpu_overhead']:+.2%} | "
              f"{r['events_per_step']:.0f} | "
              f"{r['predicted_on']:.3%} | {r['predicted_off']:.4%} |")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
