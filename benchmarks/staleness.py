"""What late gradients cost the model under quorum rounds, without cgx-ps: a slow node, or stalls.

    .venv/bin/python benchmarks/staleness.py [--scenario slow|stalls] [--nodes 8] [--steps 200]
                                             [--seeds 3] [--lrs 0.05 0.02] [--json FILE]

benchmarks/stragglers.py measures quorum rounds with a node that computes 2x slower (``slow``),
and with every node stalling 1 s (10 rounds) with probability 2% per step (``stalls``). Under a
quorum the others close rounds without the late node; its gradient arrives after its round
closed and is carried into the round under way, and the node skips that round, catching up,
to compute the next one with the others. This script trains the same task (stragglers.task():
the MLP, its teacher, SGD with momentum, every node's seeded batches) in one process with plain
torch, exact fp32 averages and no network, under the same schedules, so the cost of the
schedule is measured apart from the system's:

    fresh      every node's gradient in every round (the peer: no straggler)
    corrected  a late gradient g of round t is carried into the round under way as the change it
               makes to the average round t applied, (g - m_t) / N, that round's own gradients
               keeping their full weight (what cgx-ps does: server/rounds/late_rounds.py)
    carried    a late gradient is summed into the round under way as one more gradient, every
               round dividing by the gradients it sums (what cgx-ps did before)
    in-time    the late node's gradient counts in its own round, and the node still computes
               nothing while it is late: the samples of a quorum without staleness (what no
               schedule reaches without waiting for it)
    dropped    (slow) the slow node never contributes: what a quorum that drops late pushes keeps

Reported: the final eval loss per seed (each seed draws other batches and, with ``stalls``, other
stalls, the same for every schedule) and its median ratio to ``fresh`` per learning rate.
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

SCHEDULES = {"slow": ("fresh", "corrected", "carried", "in-time", "dropped"),
             "stalls": ("fresh", "corrected", "carried", "in-time")}
STALL_P, STALL_ROUNDS = 0.02, 10  # stragglers.py's stalls: 1 s at about 10 rounds a second


def delay(scenario: str, schedule: str, node: int, nodes: int, stalled: bool) -> int | None:
    """Rounds after its own that a gradient a node computes counts in: 0 in time, None never.

    ``slow``: the last node computes every other round (it is catching up in between), and its
    gradient is late by one round. ``stalls``: a stalled node's gradient is late by
    ``STALL_ROUNDS`` rounds, and it computes nothing until then."""
    late = (node == nodes - 1) if scenario == "slow" else stalled
    if schedule == "fresh" or not late or schedule == "in-time":
        return 0
    if schedule == "dropped":
        return None
    return 1 if scenario == "slow" else STALL_ROUNDS


def train(scenario: str, schedule: str, nodes: int, steps: int, lr: float, seed: int) -> float:
    """The eval loss after ``steps`` rounds of ``schedule``."""
    import random

    import torch

    model, teacher = task()
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=lr, momentum=MOMENTUM)
    data = [torch.Generator().manual_seed(1000 + 100 * seed + n) for n in range(nodes)]
    stalls = random.Random(seed)
    idle_until = [-1] * nodes  # a late node computes nothing up to this round (it catches up)
    landing: dict[int, list] = {}  # round -> late gradients counted in it: (gradient, their round)
    applied: dict[int, list] = {}  # round -> the average every node applied
    for step in range(steps):
        grads = []
        for node in range(nodes):
            draw = stalls.random()  # drawn for every node and round: the same stalls in every schedule
            stalled = scenario == "stalls" and schedule != "fresh" and draw < STALL_P
            catching_up = scenario == "slow" and schedule != "fresh" and node == nodes - 1 and step % 2
            if step <= idle_until[node] or catching_up:
                continue
            x, y = batch(teacher, data[node])
            model.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            gradient = [p.grad.clone() for p in params]
            rounds = delay(scenario, schedule, node, nodes, stalled)
            if stalled:
                idle_until[node] = step + STALL_ROUNDS
            if rounds == 0:
                grads.append(gradient)
            elif rounds is not None:
                landing.setdefault(step + rounds, []).append((gradient, step))
        late = landing.pop(step, [])
        average = [sum(g[i] for g in grads) / len(grads) for i in range(len(params))]
        if late and schedule == "carried":
            average = [(a * len(grads) + sum(g[i] for g, _ in late)) / (len(grads) + len(late))
                       for i, a in enumerate(average)]
        elif late:  # corrected
            average = [a + sum((g[i] - applied[t][i]) / nodes for g, t in late) for i, a in enumerate(average)]
        applied[step] = average
        applied.pop(step - STALL_ROUNDS - 1, None)
        for p, a in zip(params, average):
            p.grad = a
        opt.step()
    return eval_loss(model, teacher)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scenario", choices=sorted(SCHEDULES), default="slow")
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
        schedules = SCHEDULES[args.scenario]
        losses = {s: [train(args.scenario, s, args.nodes, args.steps, lr, seed) for seed in range(args.seeds)]
                  for s in schedules}
        ratios = {s: statistics.median(a / b for a, b in zip(losses[s], losses["fresh"])) for s in schedules}
        rows.append({"lr": lr, "eval_loss": losses, "median_ratio_to_fresh": ratios})
        print(f"lr {lr}: fresh eval loss {statistics.median(losses['fresh']):.4f}; median vs fresh: "
              + ", ".join(f"{s} {ratios[s] - 1:+.1%}" for s in schedules[1:])
              + "; per seed: " + "; ".join(f"{s} " + " ".join(f"{a / b - 1:+.1%}" for a, b in
                                                               zip(losses[s], losses["fresh"]))
                                          for s in schedules[1:]), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"scenario": args.scenario, "nodes": args.nodes, "steps": args.steps,
                                         "seeds": args.seeds, "momentum": MOMENTUM, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
