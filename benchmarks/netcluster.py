#!/usr/bin/env python3
"""A commodity-cluster emulator on one Linux machine, for benchmarks: its library face and CLI.

The jobs live in modules of their own, and this one re-exports their public names, so
``from benchmarks import netcluster as nc`` reaches all of them:

    benchmarks.netns       namespace names (CGX_PS_NETNS_PREFIX), root check, leftovers, teardown
    benchmarks.emulator    Cluster: H network namespaces on one bridge, each link shaped both ways
    benchmarks.linkprobe   measure_link: TCP goodput of one stream between two hosts
    benchmarks.jobs        run_job (one script per host, one JSON line back), run_ddp, run_single_process
    benchmarks.shards      start_shards (cgx-ps servers inside hosts), run_cgx
    benchmarks.procstat    CPU seconds of processes and of the machine

A second cluster never starts over leftovers of an earlier run: any ``cgxb-``
namespace or link makes ``Cluster`` refuse, naming the command that removes
them (``python benchmarks/netcluster.py --cleanup``).  ``CGX_PS_NETNS_PREFIX`` (default
``cgxb-``) gives a run a prefix of its own, so runs by different people on one machine neither
collide nor count as each other's leftovers; ``--cleanup`` removes that prefix's objects only.

CLI (needs root)::

    python benchmarks/netcluster.py --hosts 2 --rate 1gbit --measure
    python benchmarks/netcluster.py --hosts 2 --rate 1gbit --ddp --model mlp17m --steps 20
    python benchmarks/netcluster.py --cleanup

Library::

    with Cluster(hosts=2, rate="1gbit") as c:
        print(measure_link(c))                      # Gbit/s host0 -> host1
        res = run_ddp(c, "mlp17m", "fp16", steps=20)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Sequence

if __name__ == "__main__" and not __package__:  # `python benchmarks/netcluster.py`: import the package
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.emulator import Cluster, ClusterConfig, parse_rate, tbf_params  # noqa: E402
from benchmarks.jobs import JobResult, run_ddp, run_job, run_single_process  # noqa: E402
from benchmarks.linkprobe import measure_link  # noqa: E402
from benchmarks.netns import (PREFIX, ClusterError, LeftoversError, NotRootError, cleanup_command,  # noqa: E402
                              cleanup_leftovers, find_leftovers, require_root)
from benchmarks.procstat import machine_cpu_seconds, proc_cpu_seconds  # noqa: E402
from benchmarks.shards import ShardSet, run_cgx, start_shards  # noqa: E402


__all__ = [
    "PREFIX",
    "ClusterConfig",
    "Cluster",
    "ClusterError",
    "NotRootError",
    "LeftoversError",
    "JobResult",
    "find_leftovers",
    "cleanup_leftovers",
    "cleanup_command",
    "parse_rate",
    "tbf_params",
    "measure_link",
    "run_job",
    "run_ddp",
    "run_single_process",
    "ShardSet",
    "start_shards",
    "run_cgx",
    "proc_cpu_seconds",
    "machine_cpu_seconds",
    "main",
    "require_root",
]


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def _ddp_table(cluster: Cluster, args: argparse.Namespace) -> list[dict]:
    rows = []
    kw = dict(model=args.model, steps=args.steps, warmup=args.warmup, batch_size=args.batch_size,
              threads=args.threads, seed=args.seed, timeout=args.timeout)
    single = run_single_process(cluster, **kw)
    r0 = single.results[0] if single.ok else None
    rows.append({"config": "single-process", "status": single.status,
                 "median_step_s": r0 and r0["single_process_compute_s"], "eval_loss": r0 and r0["eval_loss"],
                 "tx_mb_per_step": None, "bucket_cap_mb": None, "wall_s": single.wall_s,
                 "per_rank": single.results})
    print(f"  single-process: {single.status} ({single.wall_s:.1f}s)", file=sys.stderr, flush=True)
    extra = [] if args.bucket_cap_mb is None else ["--bucket-cap-mb", str(args.bucket_cap_mb)]
    for hook in args.hooks:
        res = run_ddp(cluster, hook=hook, extra_args=extra, **kw)
        print(f"  ddp/{hook}: {res.status} ({res.wall_s:.1f}s)", file=sys.stderr, flush=True)
        if not res.ok and not res.timed_out:
            for i, tail in enumerate(res.stderr_tails):
                if tail.strip():
                    print(f"    host {i} stderr: ...{tail[-600:]}", file=sys.stderr)
        ok = [r for r in res.results if r]
        med = max(r["median_step_s"] for r in ok) if res.ok else None  # the slowest rank sets the pace
        tx = [r["tx_bytes_per_step"] for r in ok if r.get("tx_bytes_per_step") is not None]
        rows.append({"config": f"ddp gloo hook={hook}", "status": res.status, "median_step_s": med,
                     "eval_loss": ok[0]["eval_loss"] if res.ok else None,
                     "bucket_cap_mb": ok[0].get("bucket_cap_mb") if ok else None,
                     "per_rank": res.results,
                     "tx_mb_per_step": (statistics.mean(tx) / 1e6) if res.ok and tx else None,
                     "wall_s": res.wall_s})
    return rows


def _print_table(rows: list[dict], header: str) -> None:
    print(header)
    print(f"{'config':<24} {'median s/step':>13} {'tx MB/step/host':>15} {'eval loss':>9} {'bucket MiB':>10}  status")
    for r in rows:
        print(f"{r['config']:<24} {_fmt(r['median_step_s']):>13} {_fmt(r['tx_mb_per_step'], '.2f'):>15} "
              f"{_fmt(r['eval_loss'], '.4f'):>9} {_fmt(r.get('bucket_cap_mb'), 'g'):>10}  {r['status']}")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--rate", default="1gbit", help="per-link rate, both directions (tc units; default 1gbit)")
    p.add_argument("--burst-ms", type=float, default=ClusterConfig.burst_ms)
    p.add_argument("--latency-ms", type=float, default=ClusterConfig.latency_ms)
    p.add_argument("--cleanup", action="store_true", help="remove leftovers (CGX_PS_NETNS_PREFIX, default cgxb-) of earlier runs and exit")
    p.add_argument("--measure", action="store_true", help="measure host0 -> host1 TCP throughput")
    p.add_argument("--seconds", type=float, default=2.0, help="duration of --measure")
    p.add_argument("--ddp", action="store_true", help="run ddp_step.py per hook and print a table")
    p.add_argument("--model", default="mlp17m")
    p.add_argument("--hooks", nargs="+", default=["none", "fp16", "powersgd"], choices=["none", "fp16", "powersgd"])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bucket-cap-mb", type=float, default=None,
                   help="DDP bucket size for every hook (default: ddp_step.py's choice per hook)")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds per configuration")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        require_root()
    except NotRootError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.cleanup:
        found = cleanup_leftovers(verbose=True)
        if not (found["netns"] or found["links"]):
            print(f"no {PREFIX} leftovers")
        return 0
    if not (args.measure or args.ddp):
        print("nothing to do: pass --measure and/or --ddp (or --cleanup)", file=sys.stderr)
        return 2
    report: dict = {"hosts": args.hosts, "rate": args.rate}
    try:
        with Cluster(config=ClusterConfig(hosts=args.hosts, rate=args.rate, burst_ms=args.burst_ms,
                                          latency_ms=args.latency_ms)) as c:
            if args.measure:
                gbps = measure_link(c, seconds=args.seconds)
                report["link_gbit_s"] = gbps
                print(f"link host0 -> host1 at {args.rate}: {gbps:.3f} Gbit/s")
            if args.ddp:
                rows = _ddp_table(c, args)
                report["ddp"] = rows
                _print_table(rows, f"{args.model}, batch {args.batch_size}, {args.threads} thread(s)/worker, "
                                   f"{args.hosts} hosts at {args.rate}, {args.steps} steps ({args.warmup} warm-up)")
    except LeftoversError as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        print("interrupted; cluster removed", file=sys.stderr)
        return 130
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
