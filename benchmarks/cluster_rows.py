"""What a cluster-benchmark job becomes: one row of the report (``benchmarks/cluster.py``): its
step times, bytes and CPU (``job_row``), where the machine's CPU went (``add_cpu_usage``), and
its communication time against the link-bound ideal (``add_link_figures``)."""

from __future__ import annotations

import statistics

from benchmarks.jobs import JobResult

__all__ = ["add_cpu_usage", "add_link_figures", "job_row"]


def job_row(res: JobResult) -> dict:
    """A configuration's measurements from its job: the slowest rank's step time, means over the
    ranks of bytes and CPU, and what auto mode chose."""
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
    if ok[0].get("steps_by_path"):  # the optimizer: timed steps through the shards / all_reduce
        row["steps_by_path"] = ok[0]["steps_by_path"]
    return row


def add_cpu_usage(row: dict, res: JobResult, steps: int) -> None:
    """Where the machine's CPU went during the job (whole job: start-up included).

    busy_cores: all CPUs, from /proc/stat; own_cores: our workers and shards (utime+stime);
    irq_cores: irq + softirq time (packet processing of veth/tbf, mostly ours); other_cores:
    the rest = other people's processes on a shared machine. ``steps``: all the job's steps,
    warm-up included (the shards' CPU is counted over all of them)."""
    info = res.info or {}
    shard = [c for c in info.get("shard_cpu_s", []) if c is not None]
    if "shard_cpu_s" in info:
        row["shard_cpu_s"] = info["shard_cpu_s"]
        row["shard_cpu_s_per_step"] = sum(shard) / len(shard) / steps if shard else None
    if info.get("shard_log_tails"):
        row["shard_log_tails"] = info["shard_log_tails"]
    wall = info.get("machine_wall_s")
    if wall:
        own = sum(c for c in res.cpu_s if c is not None) + sum(shard)
        row["busy_cores"] = info["machine_busy_s"] / wall
        row["own_cores"] = own / wall
        row["irq_cores"] = info.get("machine_irq_s", 0.0) / wall
        row["other_cores"] = row["busy_cores"] - row["own_cores"] - row["irq_cores"]


def add_link_figures(row: dict, rate_bps: int, topology: str) -> None:
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
