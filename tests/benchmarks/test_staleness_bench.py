"""benchmarks/staleness.py: the schedules it trains are the ones it names."""

from __future__ import annotations

import pytest

from benchmarks.staleness import STALL_ROUNDS, delay, train


@pytest.mark.parametrize("scenario, schedule, node, stalled, rounds", [
    ("slow", "fresh", 2, False, 0), ("slow", "corrected", 2, False, 1), ("slow", "carried", 2, False, 1),
    ("slow", "in-time", 2, False, 0), ("slow", "dropped", 2, False, None), ("slow", "corrected", 1, False, 0),
    ("stalls", "corrected", 1, True, STALL_ROUNDS), ("stalls", "carried", 0, True, STALL_ROUNDS),
    ("stalls", "in-time", 1, True, 0), ("stalls", "corrected", 2, False, 0),
])
def test_a_gradient_counts_as_late_as_its_schedule_says(scenario, schedule, node, stalled, rounds):
    assert delay(scenario, schedule, node, 3, stalled) == rounds


def test_the_slow_nodes_late_gradient_reaches_the_next_round_and_only_the_schedules_differ():
    # round 0 is even: every node computes, so only where the slow node's gradient goes differs
    run = {s: train("slow", s, 3, 1, 0.05, 0) for s in ("fresh", "in-time", "corrected", "carried", "dropped")}
    assert run["fresh"] == run["in-time"]
    assert run["corrected"] == run["carried"] == run["dropped"] != run["fresh"]  # held for round 1, never reached
    two = {s: train("slow", s, 3, 2, 0.05, 0) for s in ("corrected", "carried", "dropped")}
    assert len(set(two.values())) == 3  # ... and counted there, each its own way


def test_stalls_are_the_same_draws_in_every_schedule_and_change_only_the_late_ones():
    run = {s: train("stalls", s, 3, 30, 0.05, 0) for s in ("fresh", "in-time", "corrected", "carried")}
    assert len(set(run.values())) == 4  # seed 0 stalls a node within 30 rounds: each schedule counts it its own way
    assert train("stalls", "corrected", 3, 30, 0.05, 0) == run["corrected"]  # seeded: the same stalls again
