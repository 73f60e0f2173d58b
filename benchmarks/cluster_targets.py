"""The issue's targets for the cluster benchmark (issue 16 item 5, issue 14's hook-vs-optimizer
step), judged on cgx-ps 4-bit over gRPC and over the raw data plane (``JUDGED``), and how a group
of rows meets them: each target checked on one set of rows
(``check_targets``: a summary row per configuration, or one run's rows), and over repeated runs
(``judge``: on the medians and in each run; the communication cuts must hold in every run)."""

from __future__ import annotations

from typing import NamedTuple

from benchmarks.cluster_stats import fmt, run_label, runs_of, summarize
from benchmarks.model_names import SHAPED_MODELS

__all__ = ["AUTO_YARDSTICKS", "EVERY_RUN_TARGETS", "JUDGED", "TARGETS", "TargetCheck", "Verdict", "check_targets",
           "judge", "target_checks", "target_of"]

TARGETS = {"comm_cut_vs_ddp_fp32": 4.0, "comm_cut_vs_ddp_fp16": 2.0, "comm_over_ideal": 1.5, "loss_rel": 0.02,
           "cpu_over_compute": 1.5, "hook_over_optimizer": 1.10, "auto_over_best": 1.05}
# the issue asks for these "in every run": one slow run is a miss, however good the median
EVERY_RUN_TARGETS = frozenset({"comm_cut_vs_ddp_fp32", "comm_cut_vs_ddp_fp16"})


class TargetCheck(NamedTuple):
    key: str  # which target on which configuration: "<TARGETS key>:<config>"
    text: str  # the figures and the target, in words
    ok: bool
    value: str  # the checked figure alone, for the per-run list ("4.13x")


class Verdict(NamedTuple):
    """A target over a group's runs: checked on the medians and in every run that measured it."""
    on_medians: TargetCheck
    per_run: list[tuple[str, TargetCheck | None]]  # (run label, that run's check; None: not measured)
    every_run: bool  # the target must hold in each run, not only on the medians
    ok: bool

    @property
    def met_in(self) -> tuple[int, int]:
        """(runs where it held, runs that measured it)"""
        measured = [c for _, c in self.per_run if c is not None]
        return sum(c.ok for c in measured), len(measured)


# auto mode against the faster of its two choices run on their own: DDP fp32 (a fast link) and
# the same front end at 4 bits (a slow one)
AUTO_YARDSTICKS = {"ddp-cgx-auto": ("ddp-fp32", "ddp-cgx-4bit"), "cgx-auto": ("ddp-fp32", "cgx-4bit")}


def _auto_checks(by: dict[str, dict]) -> list[TargetCheck]:
    out = []
    for name, yardsticks in AUTO_YARDSTICKS.items():
        auto = by.get(name)
        others = [by[c] for c in yardsticks if by.get(c) and by[c].get("step_s")]
        if not auto or auto.get("step_s") is None or not others:
            continue
        best = min(others, key=lambda r: r["step_s"])
        ratio = auto["step_s"] / best["step_s"]
        out.append(TargetCheck(
            f"auto_over_best:{name}",
            f"{auto['label']} step {auto['step_s']:.3f} s vs the faster of "
            f"{' and '.join(r['label'] for r in others)}: {best['label']} {best['step_s']:.3f} s: "
            f"{ratio:.2f}x (target <= {TARGETS['auto_over_best']:.2f}x)",
            ratio <= TARGETS["auto_over_best"], f"{ratio:.2f}x"))
    return out


# The configurations judged against the targets, each with its DDP-hook twin (the same
# pipeline behind a DDP comm hook, for the hook-over-optimizer target): on gRPC and on the raw
# data plane alike, so the raw plane's figures come out of this script, not by hand.
JUDGED = {"cgx-4bit": "ddp-cgx-4bit", "cgx-4bit-raw": "ddp-cgx-4bit-raw"}


def target_of(key: str) -> str:
    """The TARGETS key a check's key is for ("comm_cut_vs_ddp_fp32:cgx-4bit-raw" -> "comm_cut_vs_ddp_fp32")."""
    return key.split(":", 1)[0]


def _judged_checks(by: dict[str, dict], config: str) -> list[TargetCheck]:
    """The targets on configuration ``config``'s row (each check keyed "<target>:<config>", its
    text naming the configuration)."""
    c4 = by.get(config)
    if not c4 or c4.get("step_s") is None:
        return []
    out = []

    def check(target: str, text: str, ok: bool, value: str) -> None:
        out.append(TargetCheck(f"{target}:{config}", f"{c4['label']}: {text}", ok, value))

    for cfg, key, label in (("ddp-fp32", "comm_cut_vs_ddp_fp32", "DDP gloo fp32"),
                            ("ddp-fp16", "comm_cut_vs_ddp_fp16", "the fp16 hook")):
        o, cut = by.get(cfg), c4.get(key)
        if o and o.get("comm_s") is not None and cut is not None:
            check(key, f"comm time {c4['comm_s']:.3f} s vs {label}'s {o['comm_s']:.3f} s: cut {cut:.2f}x "
                       f"(target >= {TARGETS[key]:g}x)", cut >= TARGETS[key], f"{cut:.2f}x")
    if c4.get("comm_over_ideal") is not None:
        ratio = c4["comm_over_ideal"]
        check("comm_over_ideal", f"comm time {c4['comm_s']:.3f} s vs link-bound ideal {c4['ideal_s']:.3f} s for its "
                                 f"own bytes: {ratio:.2f}x (target <= {TARGETS['comm_over_ideal']:g}x)",
              ratio <= TARGETS["comm_over_ideal"], f"{ratio:.2f}x")
    # a shaped model's compute is slept, not computed: no CPU to compare the communication's with
    if c4.get("host_cpu_s_per_step") is not None and c4.get("compute_cpu_s") and c4.get("model") not in SHAPED_MODELS:
        ratio = c4["host_cpu_s_per_step"] / c4["compute_cpu_s"]
        check("cpu_over_compute", f"CPU per step per host {c4['host_cpu_s_per_step']:.3f} s vs the compute alone "
                                  f"{c4['compute_cpu_s']:.3f} s: {ratio:.2f}x "
                                  f"(target <= {TARGETS['cpu_over_compute']:g}x)",
              ratio <= TARGETS["cpu_over_compute"], f"{ratio:.2f}x")
    hook = by.get(JUDGED[config])
    if hook and hook.get("step_s") is not None:
        ratio = hook["step_s"] / c4["step_s"]
        check("hook_over_optimizer", f"{hook['label']} step {hook['step_s']:.3f} s (exposed comm "
                                     f"{fmt(hook.get('exposed_comm_s'))} s) vs DistributedOptimizer "
                                     f"{c4['step_s']:.3f} s (exposed comm {fmt(c4.get('exposed_comm_s'))} s): "
                                     f"{ratio:.2f}x (target <= {TARGETS['hook_over_optimizer']:.2f}x)",
              ratio <= TARGETS["hook_over_optimizer"], f"{ratio:.2f}x")
    if c4.get("loss_rel_vs_ddp_fp32") is not None:
        rel = c4["loss_rel_vs_ddp_fp32"]
        check("loss_rel", f"eval loss {c4['eval_loss']:.4f} vs DDP fp32 {by['ddp-fp32']['eval_loss']:.4f}: "
                          f"{100 * rel:+.2f}% (target within {100 * TARGETS['loss_rel']:g}%)",
              abs(rel) <= TARGETS["loss_rel"], f"{100 * rel:+.2f}%")
    return out


def check_targets(rs: list[dict]) -> list[TargetCheck]:
    """The issue's targets on one set of rows (one run, or one group's medians)."""
    by = {r["config"]: r for r in rs if r["config"] != "single"}
    return _auto_checks(by) + [c for config in JUDGED for c in _judged_checks(by, config)]


def target_checks(rs: list[dict]) -> list[tuple[str, bool]]:
    """(text, met) for each target the rows measure."""
    return [(c.text, c.ok) for c in check_targets(rs)]


def judge(group_rows: list[dict]) -> list[Verdict]:
    """Every target of one group: on the medians over its runs, and in each run.

    A target in EVERY_RUN_TARGETS is met only when it holds on the medians and in every run that
    measured it; the others are judged on the medians, their runs listed for the reader."""
    runs = runs_of(group_rows)
    sources = len({source for source, _ in runs})
    per_run = {run_label(key, sources): {c.key: c for c in check_targets(summarize(rs))}
               for key, rs in runs.items()}
    verdicts = []
    for check in check_targets(summarize(group_rows)):
        in_runs = [(label, checks.get(check.key)) for label, checks in per_run.items()]
        every = target_of(check.key) in EVERY_RUN_TARGETS
        ok = check.ok and (not every or all(c.ok for _, c in in_runs if c is not None))
        verdicts.append(Verdict(check, in_runs, every, ok))
    return verdicts
