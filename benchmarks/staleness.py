"""What a persistently slow node's one-round-stale gradients cost the model, without cgx-ps.

    .venv/bin/python benchmarks/staleness.py [--nodes 8] [--steps 200] [--seeds 3] [--lrs 0.05 0.02]
                                             [--json FILE]

benchmarks/stragglers.py measures quorum rounds with a node that computes 2x slower: under
``CGX_PS_QUORUM=N-1`` the others close every round without it, its gradient arrives a round late
and is carried into the round under way, and the node skips that round to compute the next one
with the others. Its eval loss at equal steps is worse than without the slow node. This script
trains the same task (stragglers.task(): the MLP, its teacher, SGD with momentum, every node's
seeded batches) in one process with plain torch, exact fp32 averages and no network, under the
same schedules, so the cost of the schedule is measured apart from the system's:

    fresh    every node's gradient in every round (the peer: no straggler)
    carried  quorum N-1: the slow node's gradient of round t is summed into round t+1, every
             round dividing by the gradients it sums (what cgx-ps does)
    skipped  the slow node computes every other round and its gradient is in time: the same
             samples without staleness (what no schedule reaches without waiting for it)
    dropped  the slow node never contributes (the gradients a quorum that drops late pushes keeps)

Reported: the final eval loss per seed (each seed draws other batches) and its median ratio to
``fresh`` per learning rate.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.argtypes import at_least  # noqa: E402
from benchmarks.stragglers import MOMENTUM, batch, eval_loss, task  # noqa: E402

SCHEDULES = ("fresh", "carried", "skipped", "dropped")


def contributions(schedule: str, step: int, slow: int, nodes: int) -> tuple[list[int], bool]:
    """Who computes in this round, and whether the slow node's gradient is held for the next.

    The slow node computes on even steps; on odd ones it is catching up (no gradient)."""
    computing = [n for n in range(nodes) if n != slow or step % 2 == 0 or schedule == "fresh"]
    holds = schedule == "carried" and slow in computing
    return computing, holds


def train(schedule: str, nodes: int, steps: int, lr: float, seed: int) -> float:
    """The eval loss after ``steps`` rounds of ``schedule``."""
    import torch

    model, teacher = task()
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=lr, momentum=MOMENTUM)
    data = [torch.Generator().manual_seed(1000 + 100 * seed + n) for n in range(nodes)]
    slow, held = nodes - 1, None
    for step in range(steps):
        computing, holds = contributions(schedule, step, slow, nodes)
        grads = []
        for node in computing:
            x, y = batch(teacher, data[node])
            model.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            grads.append([p.grad.clone() for p in params])
        late = grads.pop(computing.index(slow)) if holds or (schedule == "dropped" and slow in computing) else None
        if held is not None:
            grads.append(held)  # last round's late gradient, carried into this one
        held = late if holds else None
        for i, p in enumerate(params):
            p.grad = sum(g[i] for g in grads) / len(grads)
        opt.step()
    return eval_loss(model, teacher)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=at_least(2), default=8, help="nodes, the last of them the slow one")
    p.add_argument("--steps", type=at_least(1), default=200)
    p.add_argument("--seeds", type=at_least(1), default=3)
    p.add_argument("--lrs", type=float, nargs="+", default=[0.05, 0.02])
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    import torch

    torch.set_num_threads(1)
    rows = []
    for lr in args.lrs:
        losses = {s: [train(s, args.nodes, args.steps, lr, seed) for seed in range(args.seeds)] for s in SCHEDULES}
        ratios = {s: statistics.median(a / b for a, b in zip(losses[s], losses["fresh"])) for s in SCHEDULES}
        rows.append({"lr": lr, "eval_loss": losses, "median_ratio_to_fresh": ratios})
        print(f"lr {lr}: fresh eval loss {statistics.median(losses['fresh']):.4f}; median vs fresh: "
              + ", ".join(f"{s} {ratios[s] - 1:+.1%}" for s in SCHEDULES[1:])
              + "; per seed: " + "; ".join(f"{s} " + " ".join(f"{a / b - 1:+.1%}" for a, b in
                                                               zip(losses[s], losses["fresh"]))
                                          for s in SCHEDULES[1:]), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"nodes": args.nodes, "steps": args.steps, "seeds": args.seeds,
                                         "momentum": MOMENTUM, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
