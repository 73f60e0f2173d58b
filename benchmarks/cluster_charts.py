"""The cluster benchmark's charts (matplotlib, Agg): step time per configuration and link rate
as bars (``plot``), and step time against link rate, one line per configuration (``plot_links``);
medians with min-max error bars where runs were repeated."""

from __future__ import annotations

import statistics
from typing import NamedTuple

from benchmarks.cluster_configs import CONFIGS
from benchmarks.cluster_models import model_label
from benchmarks.cluster_stats import groups, panel_key, summarize
from benchmarks.emulator import parse_rate

__all__ = ["LinkPoint", "link_series", "plot", "plot_links", "rate_label"]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _panel_title(r: dict) -> str:
    shards = "shards colocated" if r["topology"] == "colocated" else f"{r['shards']} dedicated shard hosts"
    return (f"{model_label(r)}: {r['workers']} workers, {shards}\nbatch {r['batch_size']}/worker, "
            f"{r['threads']} thread/worker, {r['steps']} timed steps")


def _summaries(rows: list[dict]) -> list[dict]:
    return [s for rs in groups(rows).values() for s in summarize(rs)]


def _yerr(r: dict) -> list[list[float]] | None:
    """Asymmetric error bar from the median to the min and max over the runs (None for one run)."""
    span = r.get("range", {}).get("step_s")
    if r.get("n", 1) <= 1 or span is None:
        return None
    return [[r["step_s"] - span[0]], [span[1] - r["step_s"]]]


def plot(rows: list[dict], path: str) -> None:
    """Bar chart of step times, a panel per model/topology/hosts, a bar per configuration and link
    rate: the median with a min-max error bar when repeated."""
    plt = _pyplot()
    panels: dict[tuple, list[dict]] = {}
    for r in _summaries(rows):
        if r["config"] != "single":
            panels.setdefault(panel_key(r), []).append(r)
    rates = sorted(dict.fromkeys(r["rate"] for r in rows), key=parse_rate)
    n = len(panels)
    ncols = 1 if n <= 2 else 2
    nrows = (n + ncols - 1) // ncols
    width = max(7.0, 0.55 * len(CONFIGS) * len(rates) + 3.0)
    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, 4.6 * nrows + 0.6), squeeze=False)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    colors = ["#4477aa", "#ee6677", "#228833", "#ccbb44"]
    for ax, rs in zip(axes.flat, panels.values()):
        configs = list(dict.fromkeys(r["config"] for r in rs))
        width = 0.8 / max(1, len(rates))
        top = max([r["range"].get("step_s", (0, r["step_s"]))[1] for r in rs if r.get("step_s")] + [0.1])
        for k, rate in enumerate(rates):
            for j, cfg in enumerate(configs):
                r = next((x for x in rs if x["config"] == cfg and x["rate"] == rate), None)
                if r is None:
                    continue
                x = j + (k - (len(rates) - 1) / 2) * width
                if r.get("step_s"):
                    seen = f"{rate} links" in ax.get_legend_handles_labels()[1]
                    ax.bar(x, r["step_s"], width, color=colors[k % len(colors)], edgecolor="black", linewidth=0.5,
                           yerr=_yerr(r), capsize=2, label=None if seen else f"{rate} links")
                    above = r["range"].get("step_s", (0, r["step_s"]))[1]  # over the error bar
                    ax.text(x, above + top * 0.01, f"{r['step_s']:.2f}", ha="center", va="bottom", fontsize=7)
                else:
                    ax.bar(x, top * 0.15, width, color="white", edgecolor=colors[k % len(colors)], hatch="//")
                    ax.text(x, top * 0.16, r["status"].split(" (")[0], ha="center", va="bottom", fontsize=7,
                            rotation=90)
        computes = [r["compute_s"] for r in rs if r.get("compute_s")]
        if computes:
            c = statistics.median(computes)
            ax.axhline(c, color="black", linestyle="--", linewidth=1, label=f"single-process compute ({c:.2f} s)")
        ax.set_xticks(range(len(configs)))
        ax.set_xticklabels([CONFIGS[c][2] for c in configs], rotation=25, ha="right", fontsize=9)
        ax.set_ylabel("median step time (s)" + (", min-max over runs" if any(r["n"] > 1 for r in rs) else ""))
        ax.set_title(_panel_title(rs[0]), fontsize=10)
        ax.set_ylim(0, top * 1.3)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8, loc="upper right", ncol=len(rates) + 1)
    fig.suptitle("cgx-ps vs torch.distributed DDP on tbf-throttled links (lower is better)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def rate_label(bps: float) -> str:
    """1e9 -> "1 Gbit/s", 1e8 -> "100 Mbit/s", 2.5e9 -> "2.5 Gbit/s"."""
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:g} {unit}"
    return f"{bps:g} bit/s"


class LinkPoint(NamedTuple):
    rate_bps: int
    step_s: float  # median over the runs
    lo: float  # min over the runs
    hi: float  # max over the runs
    n: int  # measurements


def link_series(rows: list[dict]) -> dict[tuple, dict[str, list[LinkPoint]]]:
    """Step time against link rate: per panel (model, topology, hosts, batch, threads), per
    configuration, one point per link rate, sorted by rate.  The single-process compute comes as
    the configuration "single".  A configuration with no successful run at a rate has no point
    there."""
    panels: dict[tuple, dict[str, list[LinkPoint]]] = {}
    for r in _summaries(rows):
        if r["config"] == "single" and "(start)" not in r["label"]:
            continue  # one compute line per group: every run's rows carry its compute time
        # the single-process line is the compute time the comm times are measured against
        field = "compute_s" if r["config"] == "single" else "step_s"
        if r.get(field) is None:
            continue
        lo, hi = r["range"].get(field, (r[field], r[field]))
        point = LinkPoint(parse_rate(r["rate"]), r[field], lo, hi, r["n"])
        panels.setdefault(panel_key(r), {}).setdefault(r["config"], []).append(point)
    for series in panels.values():
        for points in series.values():
            points.sort()
    return panels


def plot_links(rows: list[dict], path: str) -> None:
    """Step time against link rate (log scale), a line per configuration (median, min-max error
    bars when repeated), a panel per model/topology/hosts."""
    plt = _pyplot()
    from matplotlib.ticker import NullLocator

    panels = link_series(rows)
    titles = {panel_key(r): _panel_title(r) for r in rows}
    n = max(1, len(panels))
    ncols = 1 if n == 1 else 2
    nrows = (n + ncols - 1) // ncols
    fig, axes = plt.subplots(nrows, ncols, figsize=(7.5 * ncols, 4.8 * nrows + 0.6), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    cmap = plt.get_cmap("tab10")
    order = list(CONFIGS)
    for ax, (key, series) in zip(axes.flat, panels.items()):
        rates = sorted({p.rate_bps for points in series.values() for p in points})
        for cfg, points in series.items():
            xs, ys = [p.rate_bps for p in points], [p.step_s for p in points]
            if cfg == "single":
                ax.plot(xs, ys, color="black", linestyle=":", marker=".", label="single-process compute")
                continue
            err = [[p.step_s - p.lo for p in points], [p.hi - p.step_s for p in points]]
            ddp_family = CONFIGS.get(cfg, ("",))[0] == "ddp"
            ax.errorbar(xs, ys, yerr=err if any(p.n > 1 for p in points) else None, capsize=3,
                        color=cmap(order.index(cfg) % 10 if cfg in order else 9),
                        linestyle="--" if ddp_family else "-", marker="o" if ddp_family else "s",
                        markersize=4, label=CONFIGS.get(cfg, ("", "", cfg))[2])
        ax.set_xscale("log")
        ax.set_xticks(rates)
        ax.set_xticklabels([rate_label(b) for b in rates])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlim(min(rates) / 1.8, max(rates) * 1.8)
        ax.set_ylim(bottom=0)
        ax.set_xlabel("link rate (each host, both ways)")
        repeated = any(p.n > 1 for points in series.values() for p in points)
        ax.set_ylabel("step time (s), median" + (" and min-max over runs" if repeated else ""))
        ax.set_title(titles.get(key, ""), fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Step time against link rate (lower is better)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
