"""Uneven inputs under the DDP hook (``cgx.join(opt, hook_state=state)``, frontends/ddp_join.py):
DDP over gloo, two real shards, two real worker processes with different numbers of batches
(tests/workers/ddp_join_scenarios.py, run by tests/workers/ddp_worker.py)."""

from __future__ import annotations

import pytest
from test_ddp_hook import assert_same, run_ddp_workers

pytestmark = pytest.mark.slow
ROUND_TIMEOUT_S = 30


def test_uneven_inputs_under_the_hook_end_every_epoch_quickly_with_bit_identical_replicas(tmp_path, local_cluster):
    """Rank 0 runs out after one batch in epoch 0, rank 1 first in epoch 1: each takes shadow
    steps (the round's average into .grad, an SGD step with momentum) until both have left, so
    both end with the same parameters and momentum, bit for bit, having taken the longest
    rank's steps, and neither waited for the round timeout."""
    cluster = local_cluster(2, round_timeout=ROUND_TIMEOUT_S)
    runs = [r["join_uneven"] for r in run_ddp_workers(cluster, tmp_path, "--scenarios", "join_uneven", timeout=240)]
    # the scenario's BATCHES: rank 0 [1, 3], rank 1 [4, 2]
    assert [r["computed"] for r in runs] == [1 + 3, 4 + 2]
    # round ids stay aligned: each epoch as long as its longest rank's, on every rank (and one
    # more round: the block refused for ending without its step)
    assert [r["steps"] for r in runs] == [4 + 3 + 1] * 2, runs
    assert_same(runs[0]["final"], runs[1]["final"], "rank 0 vs rank 1 (parameters and momentum)")
    assert all(r["train_s"] < ROUND_TIMEOUT_S / 3 for r in runs), [r["marks"] + [r["train_s"]] for r in runs]
    # rank 0's first shadow round took part in DDP's bucket rebuild (rank 1's second forward)
    assert all(r["rebuilt"] for r in runs)
    for r in runs:
        assert r["refusals"] == [
            "the optimizer given to cgx.join holds 1 trainable tensor(s) that are not the DDP model's: give it "
            "the optimizer of the DDP model's parameters alone",
            "this DDPHookState is already inside cgx.join: a node leaves the rounds once per epoch",
            "cgx.join: the block ended between a backward and its optimizer step: call opt.step() before leaving"]


def test_join_under_the_hook_refuses_bad_use_naming_it(tmp_path, cluster):
    results = run_ddp_workers(cluster, tmp_path, "--scenarios", "join_misuse,local:join_local", timeout=240)
    for r in results:
        misuse = r["join_misuse"]
        assert misuse["not_a_state"].startswith("cgx.join's hook_state takes the DDPHookState"), misuse
        assert "built on the DDP model itself, not on the Sequential it wraps" in misuse["inner"], misuse
        assert misuse["not_an_optimizer"].startswith("under the DDP hook cgx.join takes the torch optimizer"), misuse
        assert "broadcast_buffers=False" in misuse["buffers"], misuse
        assert "find_unused_parameters=True" in misuse["unused"], misuse
        assert misuse["adaptive"].startswith("cgx.join needs a fixed compression"), misuse
        assert r["local:join_local"]["refusal"] == "cgx.join needs one process per node (LOCAL_WORLD_SIZE=2)"
