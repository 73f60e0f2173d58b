#!/usr/bin/env python3
"""Commodity-cluster benchmark: cgx-ps against torch.distributed (DDP, gloo) on throttled links.

Every configuration trains the same model on the same synthetic data (same seeds) for the same
steps, one worker per emulated host (``netcluster.Cluster``: network namespaces whose links are
tbf-shaped to ``--rates`` both ways), batch ``--batch-size`` per worker, ``--threads`` torch
threads per worker:

    ddp-fp32      DDP, gloo all-reduce, no hook                     (benchmarks/ddp_step.py)
    ddp-fp16      DDP + fp16_compress_hook
    ddp-powersgd  DDP + PowerSGD hook (rank 4), under --powersgd-timeout; "timed out" if it hangs
    cgx-fp32      cgx-ps, uncompressed push/pull                    (benchmarks/cgx_step.py)
    cgx-4bit      cgx-ps, 4-bit max-min quantization
    cgx-2bit      cgx-ps, 2-bit
    cgx-auto      cgx-ps in auto mode, deciding every --auto-interval steps (default 5), with a
                  gloo process group (uncompressed: all_reduce per block on it; cgx_step.py
                  --process-group)
    ddp-cgx-4bit  DDP (gloo group) + the cgx-ps DDP comm hook, 4-bit   (ddp_step.py --hook cgx)
    ddp-cgx-auto  the same hook in auto mode, deciding every --auto-interval steps (uncompressed:
                  DDP's allreduce)
    cgx-4bit-raw, ddp-cgx-4bit-raw
                  cgx-4bit and ddp-cgx-4bit with the shards' raw data plane open (``--data-port``):
                  the workers' pushes and results over plain TCP instead of gRPC streams; the
                  transport a shard uses by default (without TLS). The other cgx configurations
                  keep their streams on gRPC (``--data-port -1``), as they did when it was not

The models: tiny, mlp17m, mlp25m and convnet compute on the machine's cores; resnet50, bert-base,
gpt2 and vit-b16 are the real models' parameter tensors (names, shapes, the order backward produces
their gradients) with the accelerator's compute emulated layer by layer from a published RTX 3090
step time (``shaped_model.py``; ``--compute-ms`` overrides it), so all configurations run the same
workload and the cores are left to communication. Where the cores would still be the limit,
``--scale S`` shrinks those models and the links together (every tensor, each link rate, DDP's
buckets and cgx-ps's blocks times S, the compute kept; ``cluster_models.py``): steps then take as
long as the full-size model's on the full-rate links, and each table says so.

ddp-cgx-4bit and ddp-cgx-auto are the second front end of the same block pipeline: DDP's buckets and overlap,
cgx-ps shards for the averaging; ddp-cgx-4bit's step time is compared with cgx-4bit's (target:
within 10%; ddp-cgx-4bit-raw's with cgx-4bit-raw's), ddp-cgx-auto's with the faster of ddp-fp32 and ddp-cgx-4bit (target: within 5%),
as cgx-auto's with the faster of ddp-fp32 and cgx-4bit.

cgx-ps shards run as ``cgx-ps server`` processes inside the host namespaces: ``--topology
colocated`` (default) puts one shard on every worker host (BytePS's advice when there are no
spare CPU hosts); ``--topology dedicated`` adds ``--shard-hosts`` extra hosts that run only
shards.  Single-process compute (``ddp_step.py`` with WORLD_SIZE=1 on host 0, same model and
batch) is measured in every cluster, so

    comm time       = median step time - single-process compute
    link-bound ideal = bytes on the busiest link direction per step / link rate
    CPU s/step/host = user + system CPU seconds of a worker process and the shard on its host
                      over the timed steps, per step (mean over worker hosts; /proc, all threads)

The CPU figure is the cost of a step on a host, independent of how many cores the host has: the
single-process row gives the compute alone, so the cost of communication and compression is
the difference.  With dedicated shard hosts it is the worker's alone (the shards' CPU is in
"shard CPU s/step", averaged over the whole job, start-up included).

where the bytes are the tx/rx counters of each worker host's eth0 over the timed steps (TCP/IP
headers included; with colocated shards the traffic between a worker and its own shard stays on
the host and is not counted, because it does not cross a link).  With dedicated shard hosts the
shard links carry W x (pushed bytes) / S each way; that estimate (scaled by the measured header
overhead) enters the ideal when it is larger.

Run as root (namespaces, qdiscs)::

    .venv/bin/python benchmarks/cluster.py --steps 10 --warmup 3              # mlp17m, 1gbit, colocated
    .venv/bin/python benchmarks/cluster.py --models mlp17m convnet --rates 1gbit 10gbit \\
        --markdown out.md --png out.png --json out.json
    .venv/bin/python benchmarks/cluster.py --topology dedicated --shard-hosts 2
    .venv/bin/python benchmarks/cluster.py --models resnet50 gpt2 --scale 0.05 --rates 1gbit 10gbit

``--repeat N`` runs the whole sweep N times, interleaved (run 1 of every group and configuration,
then run 2, ...), so slow drift on a shared machine hits every configuration alike; the JSON keeps
every run's rows (``run``: 1..N), and the tables show per configuration the median over the runs
with the min-max range.  Runs from separate invocations are merged into one report by
``python -m benchmarks.cluster_report --json a.json b.json ...``.

    .venv/bin/python benchmarks/cluster.py --rates 100mbit 1gbit 10gbit --repeat 3 \\
        --json out.json --links-png links.png                     # medians of 3, step time vs link rate

Prints a Markdown table (also written to ``--markdown``), checks the issue's targets for cgx-ps
4-bit on gRPC and on the raw data plane (cgx-4bit-raw) on the medians and in each run (the
communication cuts must hold in every run), and draws a bar chart of step times (``--png``) and
a chart of step time against link rate (``--links-png``).  Namespaces, workers and shards are removed on every
exit path (normal, exception, Ctrl-C, SIGTERM); leftovers of a killed run are refused with the
command that removes them (``benchmarks/netcluster.py --cleanup``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path
from typing import Sequence

if __name__ == "__main__" and not __package__:  # `python benchmarks/cluster.py`: import the package
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks import netcluster as nc  # noqa: E402
from benchmarks.argtypes import fraction, non_negative  # noqa: E402
from benchmarks.cluster_configs import CONFIGS, SHARD_ARGS, WORKER_ENV  # noqa: E402
from benchmarks.cluster_models import MODEL_CHOICES, ModelRun  # noqa: E402
from benchmarks.cluster_report import markdown, write_outputs  # noqa: E402
from benchmarks.cluster_rows import add_cpu_usage, add_link_figures, job_row  # noqa: E402
from benchmarks.cluster_stats import fmt  # noqa: E402
from benchmarks.cluster_stats import relative_figures  # noqa: E402


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _loadavg() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def compression_arg(variant: str, auto_interval: int) -> str:
    """The compression a configuration runs with: auto mode deciding every ``auto_interval``
    steps (0: auto's own default interval), any other variant as it is."""
    if variant != "auto":
        return variant
    return f"auto:{auto_interval}" if auto_interval else "auto"


def wait_idle(max_wait_s: float, busy_cores: float = 0.3, window_s: float = 2.0) -> float:
    """Wait (at most ``max_wait_s``) until the machine's CPUs were busy less than ``busy_cores``
    over a ``window_s`` window (others' jobs on a shared machine); returns the last busy value."""
    deadline = time.monotonic() + max_wait_s
    while True:
        b0, _ = nc.machine_cpu_seconds()
        time.sleep(window_s)
        busy = (nc.machine_cpu_seconds()[0] - b0) / window_s
        if busy < busy_cores or time.monotonic() >= deadline:
            return busy


# --------------------------------------------------------------------------
# running one group (model x rate x topology) of configurations
# --------------------------------------------------------------------------


def run_group(model: str, rate: str, topology: str, args: argparse.Namespace, run: int = 1) -> list[dict]:
    workers = args.workers
    shard_hosts = list(range(workers, workers + args.shard_hosts)) if topology == "dedicated" else None
    hosts = workers + (args.shard_hosts if topology == "dedicated" else 0)
    worker_hosts = list(range(workers))
    shaped = ModelRun.of(model, args)  # a shaped model's scale: its links' too (cluster_models.py)
    link_rate = shaped.link_rate(rate)
    rate_bps = nc.parse_rate(link_rate)
    base = {"run": run, "model": model, **shaped.row_fields(), "rate": rate, "topology": topology, "workers": workers,
            "shards": len(shard_hosts) if shard_hosts else workers, "batch_size": args.batch_size,
            "threads": args.threads, "steps": args.steps, "warmup": args.warmup, "auto_interval": args.auto_interval}
    kw = dict(model=model, steps=args.steps, warmup=args.warmup, batch_size=args.batch_size,
              threads=args.threads, seed=args.seed)
    rows: list[dict] = []
    _log(f"== run {run}/{args.repeat}: {model}, {rate}" + (f" (emulated at {link_rate})" if link_rate != rate else "")
         + f", {topology}: {workers} worker hosts"
         + (f" + {args.shard_hosts} shard hosts" if shard_hosts else "") + f" (load {_loadavg():.2f})")
    with nc.Cluster(config=nc.ClusterConfig(hosts=hosts, rate=link_rate, host_queue_ms=args.host_queue_ms)) as cluster:
        if args.wait_idle > 0:
            wait_idle(args.wait_idle)
        singles = [_single(cluster, base, kw, args, "start", shaped)]
        for name in args.configs:
            system, variant, label = CONFIGS[name]
            idle = wait_idle(args.wait_idle) if args.wait_idle > 0 else None
            load0 = _loadavg()
            timeout = args.powersgd_timeout if name == "ddp-powersgd" else args.timeout
            try:
                if system == "ddp":
                    res = nc.run_ddp(cluster, hook=variant, hosts=worker_hosts, timeout=timeout,
                                     extra_args=shaped.ddp_args(variant), **kw)
                else:
                    front_end = {"ddp-hook": "ddp-hook", "cgx-group": "optimizer-group"}.get(system, "optimizer")
                    extra = shaped.cgx_args(front_end, args.block_mb)
                    res = nc.run_cgx(cluster, compression=compression_arg(variant, args.auto_interval),
                                     worker_hosts=worker_hosts,
                                     shard_hosts=shard_hosts, timeout=timeout, extra_args=extra,
                                     shard_args=SHARD_ARGS.get(name, ()), worker_env=WORKER_ENV.get(name),
                                     front_end=front_end, **kw)
            except nc.ClusterError as e:  # e.g. a shard failed to start
                res = nc.JobResult(f"{system}/{model}/{variant}", [], [], False, 0.0, [str(e)])
                res_status = f"failed ({str(e).splitlines()[0][:80]})"
            else:
                res_status = None
            row = {**base, "config": name, "label": label, "load_before": load0,
                   "busy_cores_before": idle,
                   "load_after": _loadavg(), **job_row(res)}
            if res_status:
                row["status"] = res_status
            add_cpu_usage(row, res, args.steps + args.warmup)
            rows.append(row)
            _log(f"  {label}: {row['status']} ({row['wall_s']:.1f}s wall)"
                 + (f", {row['step_s']:.3f} s/step" if row.get("step_s") else "")
                 + (f", exposed comm {row['exposed_comm_s']:.3f} s" if row.get("exposed_comm_s") is not None else "")
                 + (", auto mode's decisions (compress?): " + " ".join(
                     "yes" if d.get("compress") else "no" for d in row["tuning"]) if row.get("tuning") else "")
                 + (f", timed steps by path {row['steps_by_path']}" if row.get("tuning") and row.get("steps_by_path")
                    else ""))
            if not row["status"].startswith(("ok", "timed out")) and row.get("error"):
                _log(f"    stderr: ...{row['error'][-600:]}")
        singles.append(_single(cluster, base, kw, args, "end", shaped))
    # compute time: the less disturbed of the two measurements (others' jobs only ever slow it down)
    measured = [r["step_s"] for r in singles if r.get("step_s") is not None]
    compute = min(measured) if measured else None
    cpus = [r["host_cpu_s_per_step"] for r in singles if r.get("host_cpu_s_per_step") is not None]
    for row in singles + rows:
        row["compute_s"] = compute
        row["compute_cpu_s"] = min(cpus) if cpus else None  # CPU of the compute alone, per step
        add_link_figures(row, rate_bps, topology)
    relative_figures(rows)
    return singles + rows


def _single(cluster: nc.Cluster, base: dict, kw: dict, args: argparse.Namespace, when: str,
            shaped: ModelRun) -> dict:
    """ddp_step.py with WORLD_SIZE=1 on host 0: compute only, no communication."""
    if args.wait_idle > 0:
        wait_idle(args.wait_idle)
    res = nc.run_single_process(cluster, timeout=args.timeout, extra_args=shaped.step_args(), **kw)
    r0 = res.results[0] if res.ok else None
    row = {**base, "config": "single", "label": f"single process ({when})", "status": res.status,
           "load_before": _loadavg(), "step_s": r0 and r0["single_process_compute_s"],
           "step_times_s": r0 and [r0["step_times_s"]], "eval_loss": r0 and r0["eval_loss"], "wall_s": res.wall_s,
           "host_cpu_s_per_step": r0 and r0.get("host_cpu_s_per_step")}
    add_cpu_usage(row, res, args.steps + args.warmup)
    _log(f"  single-process compute ({when}): {res.status}, {fmt(row['step_s'])} s/step"
         f" (others' load {fmt(row.get('other_cores'), '.2f')} cores)")
    return row


# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------


def sweep_plan(args: argparse.Namespace) -> list[tuple[int, str, str, str]]:
    """(run, model, topology, rate) of every group, in the order they run: all of run 1, then all
    of run 2, ... so that a slow hour on a shared machine hits every configuration alike rather
    than all the repetitions of one."""
    return [(run, model, topology, rate) for run in range(1, args.repeat + 1) for model in args.models
            for topology in args.topology for rate in args.rates]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--models", nargs="+", default=["mlp17m"], choices=MODEL_CHOICES,
                   help="computed on the CPU: mlp17m (17M params, modest compute: the main case), convnet "
                        "(compute-heavy), tiny, mlp25m; a real model's gradients with emulated GPU compute: "
                        "resnet50, bert-base, gpt2, vit-b16 (see --scale)")
    p.add_argument("--scale", type=fraction, default=1.0, metavar="S",
                   help="resnet50, bert-base, gpt2, vit-b16: every tensor, the link rates, DDP's buckets and "
                        "cgx-ps's blocks times S, the compute kept: the full-size model's step on fewer CPU cycles")
    p.add_argument("--compute-ms", type=non_negative, default=None, metavar="MS",
                   help="resnet50, bert-base, gpt2, vit-b16: emulated compute per step (default: the published "
                        "RTX 3090 step time, cgx_ps/planning/shapes.py)")
    p.add_argument("--rates", nargs="+", default=["1gbit"], help="per-link rate, both ways (tc units): 100mbit, 1gbit, 10gbit")
    p.add_argument("--topology", nargs="+", default=["colocated"], choices=["colocated", "dedicated"],
                   help="cgx-ps shards on the worker hosts (default) or on --shard-hosts extra hosts")
    p.add_argument("--workers", type=int, default=2, help="worker hosts (one worker each)")
    p.add_argument("--shard-hosts", type=int, default=2, help="shard hosts for --topology dedicated")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--batch-size", type=int, default=64, help="per worker")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="run the whole sweep N times, interleaved; tables show medians [min-max] (>= 3 for targets)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--auto-interval", type=int, default=5, metavar="N",
                   help="steps between auto mode's decisions in cgx-auto and ddp-cgx-auto (default 5: several "
                        "decisions within a short run); 0: auto's own default (100 steps), for runs long enough "
                        "to hold a few")
    p.add_argument("--block-mb", type=float, default=None, help="cgx-ps block size (default: cgx_step.py's)")
    p.add_argument("--host-queue-ms", type=float, default=None, metavar="MS",
                   help="each host's uplink queue in ms of line rate (default: a switch port's, the emulator's "
                        "latency_ms); a real host's NIC queue is far deeper than a switch port's")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds per configuration")
    p.add_argument("--powersgd-timeout", type=float, default=120.0, help="seconds for ddp-powersgd")
    p.add_argument("--wait-idle", type=float, default=0.0, metavar="SECONDS",
                   help="on a shared machine: before each configuration wait up to this long for the CPUs "
                        "to be idle (< 0.3 cores busy over 2 s)")
    p.add_argument("--markdown", metavar="PATH", help="also write the Markdown tables here")
    p.add_argument("--png", metavar="PATH", help="bar chart of step times (matplotlib, Agg)")
    p.add_argument("--links-png", metavar="PATH",
                   help="chart of step time against link rate, a line per configuration (matplotlib, Agg)")
    p.add_argument("--json", metavar="PATH",
                   help="all measurements as JSON, every run's rows (merge files: python -m benchmarks.cluster_report)")
    args = p.parse_args(argv)
    if args.workers < 1 or args.shard_hosts < 1:
        p.error("--workers and --shard-hosts must be >= 1")
    if args.repeat < 1:
        p.error("--repeat must be >= 1")
    if args.auto_interval < 0:
        p.error(f"--auto-interval must be >= 0 (0: auto's default), got {args.auto_interval}")
    for rate in args.rates:
        try:
            nc.parse_rate(rate)
        except ValueError as e:
            p.error(str(e))
    return args


def _write_json(args: argparse.Namespace, started: str, rows: list[dict]) -> None:
    Path(args.json).write_text(json.dumps({"args": vars(args), "started": started, "rows": rows}, indent=1))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        nc.require_root()
    except nc.ClusterError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    started = datetime.datetime.now().isoformat(timespec="seconds")
    rows: list[dict] = []
    try:
        for run, model, topology, rate in sweep_plan(args):
            rows += run_group(model, rate, topology, args, run)
            if args.json:  # after every group: a repeated sweep runs for hours, and may be stopped
                _write_json(args, started, rows)
    except nc.LeftoversError as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        print("interrupted; cluster, workers and shards removed", file=sys.stderr)
        return 130
    runs = f", {args.repeat} interleaved runs" if args.repeat > 1 else ""
    header = (f"cgx-ps vs DDP on a throttled cluster ({started}{runs}, {os.cpu_count()} CPU cores, "
              f"load average {fmt(_loadavg(), '.2f')} at the end)\n")
    text = header + "\n" + markdown(rows, args)
    write_outputs(text, rows, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
