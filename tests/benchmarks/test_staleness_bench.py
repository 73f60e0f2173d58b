"""benchmarks/staleness.py: the schedules it trains are the ones it names."""

from __future__ import annotations

import pytest

from benchmarks.staleness import contributions, train


@pytest.mark.parametrize("schedule, step, computing, holds", [
    ("fresh", 0, [0, 1, 2], False), ("fresh", 1, [0, 1, 2], False),
    ("carried", 0, [0, 1, 2], True), ("carried", 1, [0, 1], False),  # late on even rounds, catching up on odd
    ("skipped", 0, [0, 1, 2], False), ("skipped", 1, [0, 1], False),
    ("dropped", 0, [0, 1, 2], False), ("dropped", 1, [0, 1], False),
])
def test_the_slow_node_computes_every_other_round(schedule, step, computing, holds):
    assert contributions(schedule, step, slow=2, nodes=3) == (computing, holds)


def test_a_carried_gradient_reaches_the_next_round_and_only_the_schedules_differ():
    # round 0 is even: every node computes, so only where the slow node's gradient goes differs
    fresh, skipped = train("fresh", 3, 1, 0.05, 0), train("skipped", 3, 1, 0.05, 0)
    carried, dropped = train("carried", 3, 1, 0.05, 0), train("dropped", 3, 1, 0.05, 0)
    assert fresh == skipped
    assert carried == dropped != fresh  # held for round 1, which a 1-step run never reaches
    assert train("carried", 3, 2, 0.05, 0) != train("dropped", 3, 2, 0.05, 0)  # ... and summed into it
