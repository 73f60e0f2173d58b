"""Stragglers: quorum rounds (CGX_PS_QUORUM) against waiting for every node, in one run.

    .venv/bin/python benchmarks/stragglers.py [--nodes 8] [--steps 200] [--compute-ms 100]
                                              [--stall-p 0.02] [--stall-s 1] [--grace-ms 50] [--json FILE]

N worker processes (one node each) train a small MLP with DistributedOptimizer (4-bit) against
two local shards. Accelerator compute is emulated so the 2 cores are not the limit: each step
sleeps --compute-ms (split between forward and backward; a sleep releases the GIL) beside the
model's own small forward and backward. Scenarios, each with quorum off (every node, the peer)
and on, back to back:

    none     no straggler                        quorum N-2: what quorum rounds cost
    stalls   each node stalls --stall-s with     quorum N-2
             probability --stall-p per step,
             from a seeded generator
    slow     node N-1 computes 2x slower         quorum N-1

Reported per run: steps per second (the job's steps over the wall time of node 0, from its
first step to its last), the ratio to quorum off, whether every replica ended bit-identical
(parameter digests), the final eval loss (a fixed held-out set) against the no-straggler run's,
and how the samples were counted: every step a node computes pushes its gradient once; the
shards count each push as in time (``outcome="accepted"``) or late (carried into the round under
way); a gradient is dropped only if neither (the job's last rounds, which close with no one).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

BATCH = 32
LR, MOMENTUM = 0.05, 0.9


def task():
    """The job's model (seeded), its teacher (the linear map it learns) and the optimizer's
    settings; benchmarks/staleness.py trains the same task without cgx-ps."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 10))
    teacher = torch.nn.Linear(64, 10)
    torch.nn.init.normal_(teacher.weight, std=0.5, generator=torch.Generator().manual_seed(7))
    return model, teacher


def batch(teacher, data):
    """One node's next batch from its seeded generator ``data``."""
    import torch

    x = torch.randn(BATCH, 64, generator=data)
    return x, teacher(x).detach()


def eval_loss(model, teacher) -> float:
    """The loss on a fixed held-out set."""
    import torch

    with torch.no_grad():
        x = torch.randn(2048, 64, generator=torch.Generator().manual_seed(99))
        return float(torch.nn.functional.mse_loss(model(x), teacher(x)))


def worker(args: argparse.Namespace) -> None:
    """One node's training loop (run as a subprocess with the job's environment)."""
    import torch

    import cgx_ps.worker as cgx

    config = cgx.init()
    torch.set_num_threads(1)
    model, teacher = task()
    opt = cgx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM),
                                   model.named_parameters(), compression="4bit")
    cgx.broadcast_parameters(model.state_dict(), root_rank=0)
    data = torch.Generator().manual_seed(1000 + config.node_rank)
    stalls = random.Random(args.seed * 1000 + config.node_rank)
    compute_s = args.compute_ms / 1000 * (2.0 if config.node_rank == args.slow_node else 1.0)
    computed, started = 0, None
    while opt.steps_done < args.steps:  # the job's finished steps, those a late node caught up on included
        if started is None and opt.steps_done >= 1:
            started = time.perf_counter()  # from the first finished step: start-up is not timed
        if args.stall_p and stalls.random() < args.stall_p:
            time.sleep(args.stall_s)
        x, y = batch(teacher, data)
        time.sleep(compute_s / 3)  # forward
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        time.sleep(2 * compute_s / 3)  # backward
        opt.step()
        computed += 1
    wall = time.perf_counter() - started
    digest = hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in model.state_dict().values())).hexdigest()
    print(json.dumps({"node": config.node_rank, "steps": opt.steps_done, "computed": computed, "wall_s": wall,
                      "eval_loss": eval_loss(model, teacher), "digest": digest}), flush=True)
    cgx.shutdown()


def pushes(metrics_ports: list[int]) -> dict[str, float]:
    """Pushes the shards counted, by outcome (every block of every node)."""
    counts: dict[str, float] = {}
    for port in metrics_ports:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        for line in text.splitlines():
            if line.startswith("cgx_ps_pushes_total{"):
                outcome = line.split('outcome="')[1].split('"')[0]
                counts[outcome] = counts.get(outcome, 0) + float(line.rsplit(" ", 1)[1])
    return counts


def run(args: argparse.Namespace, name: str, quorum: int, stall_p: float, slow_node: int) -> dict:
    from cgx_ps.server import LocalCluster

    cluster = LocalCluster(2, metrics_base_port=0, extra_args=["--round-timeout", "120", "--log-level", "WARNING"])
    cluster.start()
    try:
        env = {**os.environ, **cluster.worker_env(), "CGX_PS_NUM_NODES": str(args.nodes),
               "CGX_PS_JOB_ID": f"stragglers-{name}-{quorum}", "CGX_PS_QUORUM": str(quorum),
               "CGX_PS_GRACE_MS": str(args.grace_ms), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        argv = [sys.executable, __file__, "--worker", "--steps", str(args.steps), "--compute-ms", str(args.compute_ms),
                "--stall-p", str(stall_p), "--stall-s", str(args.stall_s), "--slow-node", str(slow_node),
                "--seed", str(args.seed)]
        procs = [subprocess.Popen(argv, env={**env, "CGX_PS_NODE_RANK": str(r)}, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for r in range(args.nodes)]
        nodes = []
        for r, proc in enumerate(procs):
            out, err = proc.communicate(timeout=3600)
            if proc.returncode != 0:
                raise RuntimeError(f"{name}: node {r} exited {proc.returncode}:\n{err[-3000:]}")
            nodes.append(json.loads(out.strip().splitlines()[-1]))
        counted = pushes(cluster.metrics_ports)
    finally:
        cluster.stop()
    computed = sum(n["computed"] for n in nodes)
    blocks = round(sum(counted.values()) / max(computed, 1))  # pushes per computed step: the blocks
    return {"scenario": name, "quorum": quorum, "steps_per_s": args.steps / nodes[0]["wall_s"],
            "identical": len({n["digest"] for n in nodes}) == 1, "eval_loss": nodes[0]["eval_loss"],
            "computed_steps": computed, "pushes": counted, "blocks": blocks,
            "gradients_dropped": computed * blocks - counted.get("accepted", 0) - counted.get("late", 0),
            "nodes": nodes}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--nodes", type=int, default=8)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--compute-ms", type=float, default=100.0)
    p.add_argument("--stall-p", type=float, default=0.02)
    p.add_argument("--stall-s", type=float, default=1.0)
    p.add_argument("--grace-ms", type=int, default=50, help="CGX_PS_GRACE_MS (its default)")
    p.add_argument("--slow-node", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--scenarios", default="none,stalls,slow")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    n = args.nodes
    plans = {"none": (n - 2, 0.0, -1), "stalls": (n - 2, args.stall_p, -1), "slow": (n - 1, 0.0, n - 1)}
    results = []
    for name in args.scenarios.split(","):
        quorum, stall_p, slow = plans[name]
        off = run(args, name, 0, stall_p, slow)
        on = run(args, name, quorum, stall_p, slow)
        results += [off, on]
        reference = results[0]["eval_loss"]  # the no-straggler run without quorum, when it ran first
        for r in (off, on):
            print(f"{name:7s} quorum {r['quorum'] or 'off':>3}: {r['steps_per_s']:6.2f} steps/s "
                  f"({r['steps_per_s'] / off['steps_per_s']:.2f}x), identical {r['identical']}, eval loss "
                  f"{r['eval_loss']:.4f} ({r['eval_loss'] / reference - 1:+.1%} vs no stragglers), computed "
                  f"{r['computed_steps']} steps, pushes {r['pushes']}, dropped {r['gradients_dropped']:.0f}",
                  flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "time": time.time(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
