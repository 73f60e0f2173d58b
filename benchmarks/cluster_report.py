"""The commodity-cluster benchmark's configurations, targets and report: Markdown tables, the
issue's target checks for cgx-ps 4-bit, and a bar chart of step times (``benchmarks/cluster.py``)."""

from __future__ import annotations

import argparse
import math
import statistics

__all__ = ["CONFIGS", "TARGETS", "fmt", "host_cpu", "markdown", "plot", "target_checks"]

CONFIGS: dict[str, tuple[str, str, str]] = {  # name -> (system, hook or compression, label)
    "ddp-fp32": ("ddp", "none", "DDP gloo fp32"),
    "ddp-fp16": ("ddp", "fp16", "DDP fp16 hook"),
    "ddp-powersgd": ("ddp", "powersgd", "DDP PowerSGD r4"),
    "cgx-fp32": ("cgx", "fp32", "cgx-ps fp32"),
    "cgx-4bit": ("cgx", "4bit", "cgx-ps 4-bit"),
    "cgx-2bit": ("cgx", "2bit", "cgx-ps 2-bit"),
    "cgx-auto": ("cgx-group", "auto", "cgx-ps auto"),  # "auto": every --auto-interval steps (cluster.py)
    "ddp-cgx-4bit": ("ddp-hook", "4bit", "DDP + cgx-ps hook 4-bit"),
    "ddp-cgx-auto": ("ddp-hook", "auto", "DDP + cgx-ps hook auto"),
}
TARGETS = {"comm_cut_vs_ddp_fp32": 4.0, "comm_cut_vs_ddp_fp16": 2.0, "comm_over_ideal": 1.5, "loss_rel": 0.02,
           "cpu_over_compute": 1.5, "hook_over_optimizer": 1.10, "auto_over_best": 1.05}



def fmt(x, spec: str = ".3f", suffix: str = "") -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec) + suffix


def host_cpu(r: dict) -> str:
    """CPU s/step/host, split into the worker's and its shard's where a shard shares the host."""
    total, shard = r.get("host_cpu_s_per_step"), r.get("colocated_cpu_s_per_step")
    if total is None or not shard:
        return fmt(total)
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
                   f"after {r0['warmup']} warm-up; single-process compute {fmt(r0['compute_s'])} s/step "
                   f"(the smaller of {', '.join(fmt(r.get('step_s')) for r in singles)} measured at the start and "
                   f"the end), its CPU {fmt(r0.get('compute_cpu_s'))} s/step; load average "
                   f"{fmt(r0.get('load_before'), '.2f')} at start"
                   + (f"; auto mode decides every {r0.get('auto_interval') or '100 (its default)'} steps"
                      if any(CONFIGS.get(r["config"], ("", ""))[1] == "auto" for r in rs) else "") + "\n")
        out.append("| configuration | step (s) | CPU s/step/host: worker + its shard | vs DDP fp32 "
                   "| comm (s) = step - compute | exposed comm (s) "
                   "| MB/step/host tx / rx | link-bound ideal (s) | comm / ideal | eval loss | loss vs DDP fp32 "
                   "| shard CPU s/step | CPU cores busy: ours + irq + others' | status |")
        out.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in rs:
            tx = (f"{r['tx_bytes'] / 1e6:.1f} / {r['rx_bytes'] / 1e6:.1f}" if r.get("tx_bytes") is not None else "-")
            out.append(
                f"| {r['label']} | {fmt(r.get('step_s'))} | {host_cpu(r)} | {fmt(r.get('speedup_vs_ddp_fp32'), '.2f', 'x')} "
                f"| {fmt(r.get('comm_s'))} | {fmt(r.get('exposed_comm_s'))} | {tx} | {fmt(r.get('ideal_s'))} "
                f"| {fmt(r.get('comm_over_ideal'), '.2f', 'x')} | {fmt(r.get('eval_loss'), '.4f')} "
                f"| {fmt(None if r.get('loss_rel_vs_ddp_fp32') is None else 100 * r['loss_rel_vs_ddp_fp32'], '+.2f', '%')} "
                f"| {fmt(r.get('shard_cpu_s_per_step'), '.3f')} "
                f"| {fmt(r.get('own_cores'), '.2f')} + {fmt(r.get('irq_cores'), '.2f')} + "
                f"{fmt(r.get('other_cores'), '.2f')} | {r['status']} |")
        out.append("")
        checks = target_checks([r for r in rs if r["config"] != "single"])
        if checks:
            out.append("Targets:\n")
            for text, ok in checks:
                out.append(f"- {'PASS' if ok else 'FAIL'}: {text}")
            out.append("")
    return "\n".join(out)


# auto mode against the faster of its two choices run on their own: DDP fp32 (a fast link) and
# the same front end at 4 bits (a slow one)
AUTO_YARDSTICKS = {"ddp-cgx-auto": ("ddp-fp32", "ddp-cgx-4bit"), "cgx-auto": ("ddp-fp32", "cgx-4bit")}


def auto_check(by: dict[str, dict]) -> list[tuple[str, bool]]:
    out = []
    for name, yardsticks in AUTO_YARDSTICKS.items():
        auto = by.get(name)
        others = [by[c] for c in yardsticks if by.get(c) and by[c].get("step_s")]
        if not auto or auto.get("step_s") is None or not others:
            continue
        best = min(others, key=lambda r: r["step_s"])
        ratio = auto["step_s"] / best["step_s"]
        out.append((f"{auto['label']} step {auto['step_s']:.3f} s vs the faster of "
                    f"{' and '.join(r['label'] for r in others)}: {best['label']} {best['step_s']:.3f} s: "
                    f"{ratio:.2f}x (target <= {TARGETS['auto_over_best']:.2f}x)", ratio <= TARGETS["auto_over_best"]))
    return out


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
                    f"{fmt(hook.get('exposed_comm_s'))} s) vs DistributedOptimizer 4-bit {c4['step_s']:.3f} s "
                    f"(exposed comm {fmt(c4.get('exposed_comm_s'))} s): {ratio:.2f}x "
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

