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
    ddp-cgx-4bit  DDP (gloo group) + the cgx-ps DDP comm hook, 4-bit   (ddp_step.py --hook cgx)
    ddp-cgx-auto  the same hook in auto mode, deciding every 5 steps (uncompressed: DDP's allreduce)

The last two are the second front end of the same block pipeline: DDP's buckets and overlap,
cgx-ps shards for the averaging; ddp-cgx-4bit's step time is compared with cgx-4bit's (target:
within 10%), ddp-cgx-auto's with the faster of ddp-fp32 and ddp-cgx-4bit (target: within 5%).

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

Prints a Markdown table (also written to ``--markdown``), checks the issue's targets for cgx-ps
4-bit, and draws a bar chart (``--png``).  Namespaces, workers and shards are removed on every
exit path (normal, exception, Ctrl-C, SIGTERM); leftovers of a killed run are refused with the
command that removes them (``benchmarks/netcluster.py --cleanup``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
import netcluster as nc  # noqa: E402

CONFIGS: dict[str, tuple[str, str, str]] = {  # name -> (system, hook or compression, label)
    "ddp-fp32": ("ddp", "none", "DDP gloo fp32"),
    "ddp-fp16": ("ddp", "fp16", "DDP fp16 hook"),
    "ddp-powersgd": ("ddp", "powersgd", "DDP PowerSGD r4"),
    "cgx-fp32": ("cgx", "fp32", "cgx-ps fp32"),
    "cgx-4bit": ("cgx", "4bit", "cgx-ps 4-bit"),
    "cgx-2bit": ("cgx", "2bit", "cgx-ps 2-bit"),
    "ddp-cgx-4bit": ("ddp-hook", "4bit", "DDP + cgx-ps hook 4-bit"),
    "ddp-cgx-auto": ("ddp-hook", "auto:5", "DDP + cgx-ps hook auto"),
}
TARGETS = {"comm_cut_vs_ddp_fp32": 4.0, "comm_cut_vs_ddp_fp16": 2.0, "comm_over_ideal": 1.5, "loss_rel": 0.02,
           "cpu_over_compute": 1.5, "hook_over_optimizer": 1.10, "auto_over_best": 1.05}


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _loadavg() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


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


def _summarize(res: nc.JobResult, steps: int, warmup: int) -> dict:
    ok = [r for r in res.results if r]
    row: dict = {"status": res.status, "wall_s": res.wall_s, "worker_cpu_s": res.cpu_s}
    if not res.ok:
        tails = [t[-800:] for t in res.stderr_tails if t.strip()]
        row["error"] = tails[0] if tails else None
        return row
    row["step_s"] = max(r["median_step_s"] for r in ok)  # the slowest rank sets the pace
    row["step_s_per_rank"] = [r["median_step_s"] for r in ok]
    row["step_times_s"] = [r["step_times_s"] for r in ok]
    row["eval_loss"] = ok[0]["eval_loss"]
    row["eval_loss_per_rank"] = [r["eval_loss"] for r in ok]
    tx = [r.get("tx_bytes_per_step") for r in ok]
    rx = [r.get("rx_bytes_per_step") for r in ok]
    if all(v is not None for v in tx + rx):
        row["tx_bytes"] = statistics.mean(tx)
        row["rx_bytes"] = statistics.mean(rx)
        row["link_bytes"] = max(max(tx), max(rx))  # busiest direction of the busiest worker link
    host = [r.get("host_cpu_s_per_step") for r in ok]
    if all(v is not None for v in host):
        row["host_cpu_s_per_step"] = statistics.mean(host)
        row["worker_cpu_s_per_step"] = statistics.mean(r["cpu_s_per_step"] for r in ok)
        row["colocated_cpu_s_per_step"] = statistics.mean(r["colocated_cpu_s_per_step"] for r in ok)
    if "exposed_comm_s" in ok[0]:
        row["exposed_comm_s"] = max(r["exposed_comm_s"] for r in ok)
        row["pushed_bytes"] = ok[0]["bytes_pushed_per_step"]
        row["fp32_bytes"] = ok[0]["fp32_bytes_per_step"]
    if ok[0].get("tuning"):  # auto mode: what it chose, step by step
        row["tuning"] = ok[0]["tuning"]
    return row


def run_group(model: str, rate: str, topology: str, args: argparse.Namespace) -> list[dict]:
    workers = args.workers
    shard_hosts = list(range(workers, workers + args.shard_hosts)) if topology == "dedicated" else None
    hosts = workers + (args.shard_hosts if topology == "dedicated" else 0)
    worker_hosts = list(range(workers))
    rate_bps = nc.parse_rate(rate)
    base = {"model": model, "rate": rate, "topology": topology, "workers": workers,
            "shards": len(shard_hosts) if shard_hosts else workers, "batch_size": args.batch_size,
            "threads": args.threads, "steps": args.steps, "warmup": args.warmup}
    kw = dict(model=model, steps=args.steps, warmup=args.warmup, batch_size=args.batch_size,
              threads=args.threads, seed=args.seed)
    rows: list[dict] = []
    _log(f"== {model}, {rate}, {topology}: {workers} worker hosts"
         + (f" + {args.shard_hosts} shard hosts" if shard_hosts else "") + f" (load {_loadavg():.2f})")
    with nc.Cluster(config=nc.ClusterConfig(hosts=hosts, rate=rate)) as cluster:
        if args.wait_idle > 0:
            wait_idle(args.wait_idle)
        singles = [_single(cluster, base, kw, args, "start")]
        for name in args.configs:
            system, variant, label = CONFIGS[name]
            idle = wait_idle(args.wait_idle) if args.wait_idle > 0 else None
            load0 = _loadavg()
            timeout = args.powersgd_timeout if name == "ddp-powersgd" else args.timeout
            try:
                if system == "ddp":
                    res = nc.run_ddp(cluster, hook=variant, hosts=worker_hosts, timeout=timeout, **kw)
                else:
                    extra = ["--block-mb", str(args.block_mb)] if args.block_mb else []
                    res = nc.run_cgx(cluster, compression=variant, worker_hosts=worker_hosts,
                                     shard_hosts=shard_hosts, timeout=timeout, extra_args=extra,
                                     front_end="ddp-hook" if system == "ddp-hook" else "optimizer", **kw)
            except nc.ClusterError as e:  # e.g. a shard failed to start
                res = nc.JobResult(f"{system}/{model}/{variant}", [], [], False, 0.0, [str(e)])
                res_status = f"failed ({str(e).splitlines()[0][:80]})"
            else:
                res_status = None
            row = {**base, "config": name, "label": label, "load_before": load0,
                   "busy_cores_before": idle,
                   "load_after": _loadavg(), **_summarize(res, args.steps, args.warmup)}
            if res_status:
                row["status"] = res_status
            _cpu_usage(row, res, args)
            rows.append(row)
            _log(f"  {label}: {row['status']} ({row['wall_s']:.1f}s wall)"
                 + (f", {row['step_s']:.3f} s/step" if row.get("step_s") else "")
                 + (f", exposed comm {row['exposed_comm_s']:.3f} s" if row.get("exposed_comm_s") is not None else "")
                 + (", auto mode's decisions (compress?): " + " ".join(
                     "yes" if d.get("compress") else "no" for d in row["tuning"]) if row.get("tuning") else ""))
            if not row["status"].startswith(("ok", "timed out")) and row.get("error"):
                _log(f"    stderr: ...{row['error'][-600:]}")
        singles.append(_single(cluster, base, kw, args, "end"))
    # compute time: the less disturbed of the two measurements (others' jobs only ever slow it down)
    measured = [r["step_s"] for r in singles if r.get("step_s") is not None]
    compute = min(measured) if measured else None
    cpus = [r["host_cpu_s_per_step"] for r in singles if r.get("host_cpu_s_per_step") is not None]
    for row in singles + rows:
        row["compute_s"] = compute
        row["compute_cpu_s"] = min(cpus) if cpus else None  # CPU of the compute alone, per step
        _finish_row(row, rate_bps, topology)
    _relative(rows)
    return singles + rows


def _single(cluster: nc.Cluster, base: dict, kw: dict, args: argparse.Namespace, when: str) -> dict:
    """ddp_step.py with WORLD_SIZE=1 on host 0: compute only, no communication."""
    if args.wait_idle > 0:
        wait_idle(args.wait_idle)
    res = nc.run_single_process(cluster, timeout=args.timeout, **kw)
    r0 = res.results[0] if res.ok else None
    row = {**base, "config": "single", "label": f"single process ({when})", "status": res.status,
           "load_before": _loadavg(), "step_s": r0 and r0["single_process_compute_s"],
           "step_times_s": r0 and [r0["step_times_s"]], "eval_loss": r0 and r0["eval_loss"], "wall_s": res.wall_s,
           "host_cpu_s_per_step": r0 and r0.get("host_cpu_s_per_step")}
    _cpu_usage(row, res, args)
    _log(f"  single-process compute ({when}): {res.status}, {_f(row['step_s'])} s/step"
         f" (others' load {_f(row.get('other_cores'), '.2f')} cores)")
    return row


def _cpu_usage(row: dict, res: nc.JobResult, args: argparse.Namespace) -> None:
    """Where the machine's CPU went during the job (whole job: start-up included).

    busy_cores: all CPUs, from /proc/stat; own_cores: our workers and shards (utime+stime);
    irq_cores: irq + softirq time (packet processing of veth/tbf, mostly ours); other_cores:
    the rest = other people's processes on a shared machine."""
    info = res.info or {}
    shard = [c for c in info.get("shard_cpu_s", []) if c is not None]
    if "shard_cpu_s" in info:
        row["shard_cpu_s"] = info["shard_cpu_s"]
        row["shard_cpu_s_per_step"] = sum(shard) / len(shard) / (args.steps + args.warmup) if shard else None
    if info.get("shard_log_tails"):
        row["shard_log_tails"] = info["shard_log_tails"]
    wall = info.get("machine_wall_s")
    if wall:
        own = sum(c for c in res.cpu_s if c is not None) + sum(shard)
        row["busy_cores"] = info["machine_busy_s"] / wall
        row["own_cores"] = own / wall
        row["irq_cores"] = info.get("machine_irq_s", 0.0) / wall
        row["other_cores"] = row["busy_cores"] - row["own_cores"] - row["irq_cores"]


def _finish_row(row: dict, rate_bps: int, topology: str) -> None:
    """Communication time and the link-bound ideal."""
    step, compute = row.get("step_s"), row.get("compute_s")
    row["comm_s"] = step - compute if step is not None and compute is not None and row["config"] != "single" else None
    link = row.get("link_bytes")
    if link is not None and topology == "dedicated" and row.get("pushed_bytes"):
        # each shard host receives every worker's pushes for its blocks and sends the aggregate back
        overhead = row["tx_bytes"] / row["pushed_bytes"] if row["pushed_bytes"] else 1.0
        row["shard_link_bytes_est"] = overhead * row["workers"] * row["pushed_bytes"] / row["shards"]
        link = max(link, row["shard_link_bytes_est"])
    row["ideal_s"] = link * 8 / rate_bps if link is not None else None
    row["comm_over_ideal"] = (row["comm_s"] / row["ideal_s"]
                              if row["comm_s"] is not None and row.get("ideal_s") else None)


def _relative(rows: list[dict]) -> None:
    by = {r["config"]: r for r in rows}
    ref = by.get("ddp-fp32")
    for r in rows:
        if r["config"] == "single":
            continue
        for key, other in (("speedup_vs_ddp_fp32", "step_s"),):
            r[key] = ref[other] / r[other] if ref and ref.get(other) and r.get(other) else None
        for cfg in ("ddp-fp32", "ddp-fp16"):
            o = by.get(cfg)
            ok = o and o.get("comm_s") and r.get("comm_s") and r["comm_s"] > 0
            r[f"comm_cut_vs_{cfg.replace('-', '_')}"] = o["comm_s"] / r["comm_s"] if ok else None
        opt = by.get("cgx-4bit")  # the hook's yardstick: the same pipeline behind DistributedOptimizer
        ok = r["config"] == "ddp-cgx-4bit" and opt and opt.get("step_s") and r.get("step_s")
        r["step_vs_cgx_4bit"] = r["step_s"] / opt["step_s"] if ok else None
        ok = ref and ref.get("eval_loss") and r.get("eval_loss") is not None
        r["loss_rel_vs_ddp_fp32"] = (r["eval_loss"] - ref["eval_loss"]) / ref["eval_loss"] if ok else None


# --------------------------------------------------------------------------
# reporting
# --------------------------------------------------------------------------


def _f(x, spec: str = ".3f", suffix: str = "") -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec) + suffix


def host_cpu(r: dict) -> str:
    """CPU s/step/host, split into the worker's and its shard's where a shard shares the host."""
    total, shard = r.get("host_cpu_s_per_step"), r.get("colocated_cpu_s_per_step")
    if total is None or not shard:
        return _f(total)
    return f"{total:.3f} = {r['worker_cpu_s_per_step']:.3f} + {shard:.3f}"


def markdown(rows: list[dict], args: argparse.Namespace) -> str:
    out: list[str] = []
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["rate"], r["topology"]), []).append(r)
    for (model, rate, topo), rs in groups.items():
        r0 = rs[0]
        shards = (f"{r0['shards']} dedicated shard hosts" if topo == "dedicated"
                  else f"{r0['shards']} shards colocated on the worker hosts")
        out.append(f"### {model}, {rate} links, {r0['workers']} worker hosts, {shards}\n")
        singles = [r for r in rs if r["config"] == "single"]
        out.append(f"batch {r0['batch_size']}/worker, {r0['threads']} thread/worker, median of {r0['steps']} steps "
                   f"after {r0['warmup']} warm-up; single-process compute {_f(r0['compute_s'])} s/step "
                   f"(the smaller of {', '.join(_f(r.get('step_s')) for r in singles)} measured at the start and "
                   f"the end), its CPU {_f(r0.get('compute_cpu_s'))} s/step; load average "
                   f"{_f(r0.get('load_before'), '.2f')} at start\n")
        out.append("| configuration | step (s) | CPU s/step/host: worker + its shard | vs DDP fp32 "
                   "| comm (s) = step - compute | exposed comm (s) "
                   "| MB/step/host tx / rx | link-bound ideal (s) | comm / ideal | eval loss | loss vs DDP fp32 "
                   "| shard CPU s/step | CPU cores busy: ours + irq + others' | status |")
        out.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in rs:
            tx = (f"{r['tx_bytes'] / 1e6:.1f} / {r['rx_bytes'] / 1e6:.1f}" if r.get("tx_bytes") is not None else "-")
            out.append(
                f"| {r['label']} | {_f(r.get('step_s'))} | {host_cpu(r)} | {_f(r.get('speedup_vs_ddp_fp32'), '.2f', 'x')} "
                f"| {_f(r.get('comm_s'))} | {_f(r.get('exposed_comm_s'))} | {tx} | {_f(r.get('ideal_s'))} "
                f"| {_f(r.get('comm_over_ideal'), '.2f', 'x')} | {_f(r.get('eval_loss'), '.4f')} "
                f"| {_f(None if r.get('loss_rel_vs_ddp_fp32') is None else 100 * r['loss_rel_vs_ddp_fp32'], '+.2f', '%')} "
                f"| {_f(r.get('shard_cpu_s_per_step'), '.3f')} "
                f"| {_f(r.get('own_cores'), '.2f')} + {_f(r.get('irq_cores'), '.2f')} + "
                f"{_f(r.get('other_cores'), '.2f')} | {r['status']} |")
        out.append("")
        checks = target_checks([r for r in rs if r["config"] != "single"])
        if checks:
            out.append("Targets:\n")
            for text, ok in checks:
                out.append(f"- {'PASS' if ok else 'FAIL'}: {text}")
            out.append("")
    return "\n".join(out)


def auto_check(by: dict[str, dict]) -> list[tuple[str, bool]]:
    """The hook's auto mode against the faster of its two choices run on their own: DDP fp32
    (a fast link) and the hook at 4 bits (a slow one)."""
    auto = by.get("ddp-cgx-auto")
    others = [by[c] for c in ("ddp-fp32", "ddp-cgx-4bit") if by.get(c) and by[c].get("step_s")]
    if not auto or auto.get("step_s") is None or not others:
        return []
    best = min(others, key=lambda r: r["step_s"])
    ratio = auto["step_s"] / best["step_s"]
    return [(f"DDP + cgx-ps hook auto step {auto['step_s']:.3f} s vs the faster of "
             f"{' and '.join(r['label'] for r in others)}: {best['label']} {best['step_s']:.3f} s: {ratio:.2f}x "
             f"(target <= {TARGETS['auto_over_best']:.2f}x)", ratio <= TARGETS["auto_over_best"])]


def target_checks(rs: list[dict]) -> list[tuple[str, bool]]:
    by = {r["config"]: r for r in rs}
    out = auto_check(by)
    c4 = by.get("cgx-4bit")
    if not c4 or c4.get("step_s") is None:
        return out
    for cfg, key, label in (("ddp-fp32", "comm_cut_vs_ddp_fp32", "DDP gloo fp32"),
                            ("ddp-fp16", "comm_cut_vs_ddp_fp16", "the fp16 hook")):
        o, cut = by.get(cfg), c4.get(key)
        if o and o.get("comm_s") is not None and cut is not None:
            out.append((f"comm time {c4['comm_s']:.3f} s vs {label}'s {o['comm_s']:.3f} s: cut {cut:.2f}x "
                        f"(target >= {TARGETS[key]:g}x)", cut >= TARGETS[key]))
    if c4.get("comm_over_ideal") is not None:
        out.append((f"comm time {c4['comm_s']:.3f} s vs link-bound ideal {c4['ideal_s']:.3f} s for its own bytes: "
                    f"{c4['comm_over_ideal']:.2f}x (target <= {TARGETS['comm_over_ideal']:g}x)",
                    c4["comm_over_ideal"] <= TARGETS["comm_over_ideal"]))
    if c4.get("host_cpu_s_per_step") is not None and c4.get("compute_cpu_s"):
        ratio = c4["host_cpu_s_per_step"] / c4["compute_cpu_s"]
        out.append((f"CPU per step per host {c4['host_cpu_s_per_step']:.3f} s vs the compute alone "
                    f"{c4['compute_cpu_s']:.3f} s: {ratio:.2f}x (target <= {TARGETS['cpu_over_compute']:g}x)",
                    ratio <= TARGETS["cpu_over_compute"]))
    hook = by.get("ddp-cgx-4bit")
    if hook and hook.get("step_s") is not None:
        ratio = hook["step_s"] / c4["step_s"]
        out.append((f"DDP + cgx-ps hook 4-bit step {hook['step_s']:.3f} s (exposed comm "
                    f"{_f(hook.get('exposed_comm_s'))} s) vs DistributedOptimizer 4-bit {c4['step_s']:.3f} s "
                    f"(exposed comm {_f(c4.get('exposed_comm_s'))} s): {ratio:.2f}x "
                    f"(target <= {TARGETS['hook_over_optimizer']:.2f}x)", ratio <= TARGETS["hook_over_optimizer"]))
    if c4.get("loss_rel_vs_ddp_fp32") is not None:
        rel = c4["loss_rel_vs_ddp_fp32"]
        out.append((f"eval loss {c4['eval_loss']:.4f} vs DDP fp32 {by['ddp-fp32']['eval_loss']:.4f}: "
                    f"{100 * rel:+.2f}% (target within {100 * TARGETS['loss_rel']:g}%)", abs(rel) <= TARGETS["loss_rel"]))
    return out


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["config"] == "single":
            continue
        panels.setdefault((r["model"], r["topology"]), []).append(r)
    rates = list(dict.fromkeys(r["rate"] for r in rows))
    n = len(panels)
    ncols = 1 if n <= 2 else 2
    nrows = (n + ncols - 1) // ncols
    width = max(7.0, 0.55 * len(CONFIGS) * len(rates) + 3.0)
    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, 4.6 * nrows + 0.6), squeeze=False)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    colors = ["#4477aa", "#ee6677", "#228833", "#ccbb44"]
    for ax, ((model, topo), rs) in zip(axes.flat, panels.items()):
        configs = list(dict.fromkeys(r["config"] for r in rs))
        width = 0.8 / max(1, len(rates))
        top = max([r["step_s"] for r in rs if r.get("step_s")] + [0.1])
        for k, rate in enumerate(rates):
            for j, cfg in enumerate(configs):
                r = next((x for x in rs if x["config"] == cfg and x["rate"] == rate), None)
                if r is None:
                    continue
                x = j + (k - (len(rates) - 1) / 2) * width
                if r.get("step_s"):
                    seen = f"{rate} links" in ax.get_legend_handles_labels()[1]
                    ax.bar(x, r["step_s"], width, color=colors[k % len(colors)], edgecolor="black", linewidth=0.5,
                           label=None if seen else f"{rate} links")
                    ax.text(x, r["step_s"] + top * 0.01, f"{r['step_s']:.2f}", ha="center", va="bottom", fontsize=7)
                else:
                    ax.bar(x, top * 0.15, width, color="white", edgecolor=colors[k % len(colors)], hatch="//")
                    ax.text(x, top * 0.16, r["status"].split(" (")[0], ha="center", va="bottom", fontsize=7,
                            rotation=90)
        computes = [r["compute_s"] for r in rs if r.get("compute_s")]
        if computes:
            c = statistics.median(computes)
            ax.axhline(c, color="black", linestyle="--", linewidth=1, label=f"single-process compute ({c:.2f} s)")
        labels = [CONFIGS[c][2] for c in configs]
        ax.set_xticks(range(len(configs)))
        ax.set_xticklabels(labels, rotation=25, ha="right", fontsize=9)
        ax.set_ylabel("median step time (s)")
        shards = "shards colocated" if topo == "colocated" else f"{rs[0]['shards']} dedicated shard hosts"
        ax.set_title(f"{model}: {rs[0]['workers']} workers, {shards}\nbatch {rs[0]['batch_size']}/worker, "
                     f"{rs[0]['threads']} thread/worker", fontsize=10)
        ax.set_ylim(0, top * 1.3)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8, loc="upper right", ncol=len(rates) + 1)
    fig.suptitle("cgx-ps vs torch.distributed DDP on tbf-throttled links (lower is better)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--models", nargs="+", default=["mlp17m"], choices=["tiny", "mlp17m", "mlp25m", "convnet"],
                   help="mlp17m (17M params, modest compute: the main case); convnet (compute-heavy)")
    p.add_argument("--rates", nargs="+", default=["1gbit"], help="per-link rate, both ways (tc units): 1gbit, 10gbit")
    p.add_argument("--topology", nargs="+", default=["colocated"], choices=["colocated", "dedicated"],
                   help="cgx-ps shards on the worker hosts (default) or on --shard-hosts extra hosts")
    p.add_argument("--workers", type=int, default=2, help="worker hosts (one worker each)")
    p.add_argument("--shard-hosts", type=int, default=2, help="shard hosts for --topology dedicated")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--batch-size", type=int, default=64, help="per worker")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-mb", type=float, default=None, help="cgx-ps block size (default: cgx_step.py's)")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds per configuration")
    p.add_argument("--powersgd-timeout", type=float, default=120.0, help="seconds for ddp-powersgd")
    p.add_argument("--wait-idle", type=float, default=0.0, metavar="SECONDS",
                   help="on a shared machine: before each configuration wait up to this long for the CPUs "
                        "to be idle (< 0.3 cores busy over 2 s)")
    p.add_argument("--markdown", metavar="PATH", help="also write the Markdown tables here")
    p.add_argument("--png", metavar="PATH", help="bar chart of step times (matplotlib, Agg)")
    p.add_argument("--json", metavar="PATH", help="all measurements as JSON")
    args = p.parse_args(argv)
    if args.workers < 1 or args.shard_hosts < 1:
        p.error("--workers and --shard-hosts must be >= 1")
    for rate in args.rates:
        try:
            nc.parse_rate(rate)
        except ValueError as e:
            p.error(str(e))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        nc._require_root()
    except nc.ClusterError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    started = datetime.datetime.now().isoformat(timespec="seconds")
    rows: list[dict] = []
    try:
        for model in args.models:
            for topology in args.topology:
                for rate in args.rates:
                    rows += run_group(model, rate, topology, args)
    except nc.LeftoversError as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        print("interrupted; cluster, workers and shards removed", file=sys.stderr)
        return 130
    header = (f"cgx-ps vs DDP on a throttled cluster ({started}, {os.cpu_count()} CPU cores, "
              f"load average {_f(_loadavg(), '.2f')} at the end)\n")
    text = header + "\n" + markdown(rows, args)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "started": started, "rows": rows}, indent=1))
    if args.png:
        plot(rows, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
