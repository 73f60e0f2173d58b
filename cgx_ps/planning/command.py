"""``cgx-ps plan``: which option trains fastest on a given cluster, and how to deploy cgx-ps there.

    cgx-ps plan --model resnet50 --nodes 8 --link 1gbit
    cgx-ps plan --model gpt2 --nodes 32 --gpus-per-node 4 --link 10Gbit/s --shards 16 --json
    cgx-ps plan --params 350000000 --compute-ms 800 --nodes 16 --link 25gbit --calibrate

Prints each option's predicted step time (``model.predict_all``), the dedicated shard hosts that keep the
shards' links from being the limit (``model.shards_needed``) and the recommendation with its reasons. Any bad
input is one line on stderr and exit status 2, as argparse's usage errors.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import asdict

from .model import OPTIONS, Cluster, Prediction, Speeds, predict_all, shards_needed
from .shapes import MODELS, PlanningError, sized_workload, workload

__all__ = ["add_parser", "parse_rate", "recommend", "run"]

_RATE = re.compile(r"^\s*(\d+(?:\.\d*)?(?:e[+-]?\d+)?)\s*([kmgt]?)(?:bit|bps|b)?(?:/s)?\s*$", re.IGNORECASE)
_SCALE = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
# From the least to the most lossy: the recommendation is the first within ``_CLOSE`` of the fastest
_FIDELITY = ("ddp-fp32", "ddp-fp16", "cgx-8bit", "cgx-4bit", "ddp-powersgd", "cgx-2bit")
_CLOSE = 0.05


def parse_rate(text: str) -> float:
    """A link rate in bits/s: 100mbit, 1gbit, 10Gbit/s, 25gbps, 1e9 (a bare number is bits/s)."""
    match = _RATE.match(text)
    if not match or float(match.group(1)) * _SCALE[match.group(2).lower()] <= 0:
        raise argparse.ArgumentTypeError(f"cannot read link rate {text!r}: use e.g. 100mbit, 1gbit, 10Gbit/s, 1e9")
    return float(match.group(1)) * _SCALE[match.group(2).lower()]


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number above 0, got {text!r}")
    return value


def _one_line_error(prog: str):
    """argparse's error, as one line (no usage block), exit status 2."""
    def error(message: str):
        print(f"{prog}: {message}", file=sys.stderr)
        raise SystemExit(2)
    return error


def add_parser(subparsers) -> argparse.ArgumentParser:
    """``cgx-ps plan`` on the CLI's subparsers; ``args.command_run`` runs it."""
    p = subparsers.add_parser("plan", help="predict step times of DDP and cgx-ps on a cluster, and advise",
                              description="Predict the step time of DDP (fp32, fp16, PowerSGD) and cgx-ps (8, 4, "
                                          "2 bits) for a model on a cluster, from a performance model "
                                          "(docs/performance-model.md), and recommend a setting.")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--model", help=f"{', '.join(MODELS)} or MODULE:FUNCTION (returns an nn.Module)")
    what.add_argument("--params", type=_count, help="a model given by its parameter count (needs --compute-ms)")
    p.add_argument("--nodes", type=_count, required=True, help="hosts")
    p.add_argument("--gpus-per-node", type=_count, default=1, help="GPUs per host (default %(default)s)")
    p.add_argument("--link", type=parse_rate, required=True, help="each host's link: 100mbit, 1gbit, 10Gbit/s, 1e9")
    p.add_argument("--shards", type=_count, default=None,
                   help="cgx-ps shards on this many dedicated hosts (default: one colocated on every node)")
    p.add_argument("--compute-ms", type=_positive, default=None,
                   help="forward + backward per step on one GPU (default: the model's published RTX 3090 time)")
    p.add_argument("--calibrate", action="store_true",
                   help="measure codec speed and shard ingest on this machine first (default: BENCHMARKS.md's)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    p.error = _one_line_error(p.prog)
    p.set_defaults(command_run=run)
    return p


def recommend(rows: list[Prediction]) -> Prediction:
    """The least lossy option (``_FIDELITY``: fp32, fp16, 8, 4 bits, PowerSGD rank 4, 2 bits) whose step is
    within 5% of the fastest: a step that fewer bits would not make noticeably shorter is not worth them."""
    fastest = min(r.step_s for r in rows)
    close = [r for r in rows if r.step_s <= fastest * (1 + _CLOSE)]
    return min(close, key=lambda r: _FIDELITY.index(r.name) if r.name in _FIDELITY else len(_FIDELITY))


def _reason(best: Prediction, ddp: Prediction, cluster: Cluster, fastest: float) -> str:
    """Why ``best`` wins, in the model's terms."""
    speedup = ddp.step_s / best.step_s
    if best.step_s > fastest * 1.001:
        return (f"within {_CLOSE:.0%} of the fastest option ({fastest:.3f} s) with less lost in compression; "
                + _reason(best, ddp, cluster, best.step_s))
    if best.name == "ddp-fp32":
        return (f"the link moves fp32 gradients fast enough: DDP's communication left exposed is "
                f"{ddp.exposed_comm_s * 1e3:.0f} ms, and compression would add codec time without saving more")
    hidden = "hidden behind backward" if best.exposed_comm_s < 0.1 * best.step_s else (
        f"{best.exposed_comm_s * 1e3:.0f} ms of it exposed")
    if best.name.startswith("cgx"):
        where = ("shards colocated, one per node" if cluster.shards is None
                 else f"{cluster.shards} dedicated shard hosts")
        return (f"{speedup:.2f}x DDP fp32: {best.bytes_per_host / 1e6:.1f} MB per step on the busiest link "
                f"against DDP's {ddp.bytes_per_host / 1e6:.1f} MB, {hidden} ({where})")
    return f"{speedup:.2f}x DDP fp32: {best.bytes_per_host / 1e6:.1f} MB per step on the link, {hidden}"


def _table(rows: list[Prediction], ddp: Prediction) -> list[str]:
    lines = [f"{'option':<14} {'compression':<12} {'step (s)':>9} {'vs DDP fp32':>11} {'exposed comm':>12} "
             f"{'link-bound':>10} {'codec':>7} {'shard CPU':>9}  bottleneck"]
    for r in rows:
        lines.append(f"{r.name:<14} {r.compression:<12} {r.step_s:>9.3f} {ddp.step_s / r.step_s:>10.2f}x "
                     f"{r.exposed_comm_s:>12.3f} {r.link_s:>10.3f} {r.codec_s:>7.3f} {r.shard_cpu_s:>9.3f}  "
                     f"{r.bottleneck}")
    return lines


def run(args: argparse.Namespace) -> int:
    """Plan and print; 2 on a model that cannot be planned."""
    compute_s = None if args.compute_ms is None else args.compute_ms / 1e3
    try:
        if args.params is not None:
            if compute_s is None:
                raise PlanningError("--params needs --compute-ms: a model's size alone does not give its compute")
            job = sized_workload(args.params, compute_s)
        else:
            job = workload(args.model, compute_s)
    except PlanningError as exc:
        print(f"cgx-ps plan: {exc}", file=sys.stderr)
        return 2
    if args.calibrate:
        from .calibrate import measure

        speeds = measure()
    else:
        speeds = Speeds()
    cluster = Cluster(args.nodes, args.link, args.gpus_per_node, args.shards)
    rows = predict_all(job, cluster, speeds, OPTIONS)
    ddp = rows[0]
    best = recommend(rows)
    fastest = min(r.step_s for r in rows)
    needed = shards_needed(job, cluster, speeds, "cgx-4bit")
    if args.json:
        print(json.dumps({
            "model": job.name, "params": job.params, "tensors": len(job.tensors), "compute_s": job.compute_s,
            "nodes": args.nodes, "gpus_per_node": args.gpus_per_node, "link_bps": args.link,
            "shards": args.shards, "calibrated": args.calibrate, "speeds": asdict(speeds),
            "options": [{k: v for k, v in asdict(r).items() if k != "detail"} for r in rows],
            "shards_needed": needed, "recommended": best.name, "reason": _reason(best, ddp, cluster, fastest)}, indent=1))
        return 0
    placement = "shards colocated, one per node" if args.shards is None else f"{args.shards} dedicated shard hosts"
    print(f"{job.name}: {job.params:,} parameters in {len(job.tensors)} tensors, compute {job.compute_s * 1e3:.0f} "
          f"ms/step; {args.nodes} nodes x {args.gpus_per_node} GPU{'s' if args.gpus_per_node > 1 else ''}, {args.link / 1e9:g} Gbit/s links, {placement}; "
          f"speeds {'measured here' if args.calibrate else 'from BENCHMARKS.md'}")
    print("\n".join(_table(rows, ddp)))
    print(f"shards: {needed} dedicated shard host{'s keep' if needed > 1 else ' keeps'} the shards' links from limiting "
          f"cgx-ps 4-bit on {args.nodes} nodes (BytePS's rule, as many as the nodes, is the bound)")
    print(f"recommended: {best.name} — {_reason(best, ddp, cluster, fastest)}")
    return 0
