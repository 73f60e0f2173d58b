"""Adaptive bits vs uniform 4-bit on a throttled cluster, and auto mode's choices per link rate.

    sudo .venv/bin/python benchmarks/adaptive.py [--steps 40] [--interval 10] [--rates 1gbit 10gbit]

Two worker hosts with one colocated shard each (benchmarks/netcluster.py), mlp17m, batch 64,
one thread per worker. For each link rate: uniform 4-bit, adaptive (bits re-chosen every
--interval steps at the error budget of uniform 4-bit) and auto (compress or not, decided from a
link probe and the codec's measured cost, then from measured step times). Reports pushed bytes per step (after the first
decision), final eval loss, median step time, and the decisions.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

if __name__ == "__main__" and not __package__:  # `python benchmarks/adaptive.py`: import the package
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks import netcluster as nc  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--interval", type=int, default=10)
    p.add_argument("--rates", nargs="+", default=["1gbit", "10gbit"])
    p.add_argument("--model", default="mlp17m")
    args = p.parse_args()
    rows = []
    for rate in args.rates:
        with nc.Cluster(hosts=2, rate=rate) as cluster:
            for compression in ("4bit", f"adaptive:{args.interval}", f"auto:{args.interval}"):
                res = nc.run_cgx(cluster, model=args.model, compression=compression, steps=args.steps,
                                 warmup=args.warmup, timeout=900)
                if not res.ok:
                    print(f"{rate} {compression}: {res.status}\n{res.stderr_tails}", file=sys.stderr)
                    continue
                r0 = res.results[0]
                times = r0["step_times_s"][args.warmup:]
                rows.append({"rate": rate, "compression": compression,
                             "mb_per_step": r0["bytes_pushed_per_step"] / 1e6,
                             "step_s": statistics.median(times), "eval_loss": r0["eval_loss"],
                             "tuning": r0["tuning"]})
    print(f"{args.model}, 2 hosts, shards colocated, {args.steps} steps after {args.warmup} warm-up")
    print("| link | compression | MB pushed/step/worker | median step (s) | final eval loss |")
    print("|---|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['rate']} | {r['compression']} | {r['mb_per_step']:.2f} | {r['step_s']:.3f} | {r['eval_loss']:.4f} |")
    print()
    for r in rows:
        for d in r["tuning"]:
            if "bits" in d:
                print(f"{r['rate']} {r['compression']}: from round {d['from_round']}: bits {d['bits']}")
            if "compress" in d:
                f = d["figures"]
                measured = ", ".join(f"{k} {v * 1e3:.0f} ms/step" for k, v in d.get("measured", {}).items())
                print(f"{r['rate']} {r['compression']}: from round {d['from_round']}: "
                      f"{'compress' if d['compress'] else 'no compression'}: {d.get('reason', '')} "
                      f"[{measured or 'no steps measured yet'}; model: link {f['throughput_bps'] / 1e6:.0f} MB/s, "
                      f"fp32 {f['fp32_bytes'] / 1e6:.1f} MB vs {f['compressed_bytes'] / 1e6:.1f} MB, codec "
                      f"{f['codec_s'] * 1e3:.1f} ms, overlap {f['overlap_s'] * 1e3:.1f} ms]")


if __name__ == "__main__":
    main()
