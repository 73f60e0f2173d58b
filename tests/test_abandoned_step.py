"""A backward that fails part way, caught by the training loop: ``zero_grad()`` abandons the
step and training goes on, on every rank in step (DistributedOptimizer's docstring,
docs/troubleshooting.md). Real shards, real worker processes (tests/workers/abandon_worker.py).

Before: the next backward on that rank failed ("gradient computed 2 times before step()"), so
the job could only be restarted; the other rank's step waited out the round timeout."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from support import env_for, plane_env, until
from workers.warm_start import start_worker

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests/workers/abandon_worker.py"
ROUND_TIMEOUT_S = 120  # far above a step here: a step that waited for it was not recovered cleanly

pytestmark = pytest.mark.slow


CLUSTER_SETTINGS = dict(shards=2, round_timeout=ROUND_TIMEOUT_S)  # the tests' shared shards per plane (conftest.clusters)


def run(cluster, world: int, args_for, timeout: float = 300, plane: str = "grpc") -> list[dict]:
    """``world`` ranks of abandon_worker.py, rank r with ``args_for(r)``, streaming on ``plane``;
    their JSON lines."""
    job = {"CGX_PS_JOB_ID": f"abandon-{uuid.uuid4().hex[:8]}", **plane_env(plane)}
    procs = [start_worker([sys.executable, str(WORKER), *args_for(r)], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=env_for(r, world, cluster.addresses, **job))
             for r in range(world)]
    out = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=timeout)
            assert proc.returncode == 0, stderr[-3000:]
            out.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return out


def params(result: dict) -> dict[str, torch.Tensor]:
    return {n: torch.tensor(v) for n, v in result["params"].items()}


def assert_same_params(a: dict, b: dict) -> None:
    pa, pb = params(a), params(b)
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name


def outcome(result: dict, step: int) -> str:
    return result["outcomes"][step].rsplit(" (", 1)[0]


STEPS, FAIL_AT = 5, 2


def assert_rank_1_was_told_and_both_went_on(cluster, one: list[dict], compression: str, within_s: float,
                                            says: str) -> None:
    """Rank 0 gave step FAIL_AT up: rank 1's step raised StepAbandoned (saying ``says``) within
    ``within_s``, both trained every other step in step to the same parameters, and at fp32 to
    those of a run that skipped the step."""
    told = outcome(one[1], FAIL_AT)
    assert told.startswith("StepAbandoned: rank 1: step 2 was abandoned by another rank"), told
    assert says in told, told
    seconds = float(one[1]["outcomes"][FAIL_AT].rsplit(" (", 1)[1].split(" s)")[0])
    assert seconds < within_s, one[1]["outcomes"]
    for r in one:
        assert [outcome(r, s) for s in range(STEPS) if s != FAIL_AT] == ["ok"] * (STEPS - 1), r["outcomes"]
    assert one[0]["steps"] == one[1]["steps"]
    assert_same_params(one[0], one[1])
    if compression == "fp32":
        reference = run(cluster, 2, lambda r: ["--steps", str(STEPS), "--fail-at", str(FAIL_AT), "--skip"])
        assert_same_params(one[0], reference[0])


def test_one_process_goes_on_after_a_backward_that_raised_at_a_hook(cluster):
    """world 1: the failed step is abandoned, the next ones train; the parameters are those of a
    run that left that batch out."""
    (failed,) = run(cluster, 1, lambda r: ["--steps", str(STEPS), "--fail-at", str(FAIL_AT), "--fail"])
    (skipped,) = run(cluster, 1, lambda r: ["--steps", str(STEPS), "--fail-at", str(FAIL_AT), "--skip"])
    assert [outcome(failed, s) for s in range(STEPS)] == [
        "ok", "ok", "BackwardFailed: backward failed at 2.weight", "ok", "ok"]
    assert failed["steps"] == skipped["steps"]  # the abandoned step is not counted
    assert_same_params(failed, skipped)


def test_both_ranks_fail_the_same_step_and_both_go_on(cluster):
    both = run(cluster, 2, lambda r: ["--steps", str(STEPS), "--fail-at", str(FAIL_AT), "--fail"])
    reference = run(cluster, 2, lambda r: ["--steps", str(STEPS), "--fail-at", str(FAIL_AT), "--skip"])
    for r in both:
        assert [outcome(r, s) for s in range(STEPS)] == [
            "ok", "ok", "BackwardFailed: backward failed at 2.weight", "ok", "ok"], r["outcomes"]
    assert_same_params(both[0], both[1])
    assert_same_params(both[0], reference[0])  # as if every rank had left that batch out


@pytest.mark.parametrize("compression, plane", [("fp32", "grpc"), ("4bit", "grpc"), ("4bit", "raw")])
def test_one_rank_fails_and_the_other_is_told_at_once_then_both_go_on(clusters, compression, plane):
    """Rank 0's backward fails; rank 1's step() raises StepAbandoned, naming why, as soon as rank 0
    calls zero_grad() (not after the shards' round timeout); both skip the step and go on in step.
    With fp32 the result is the reference run's; at 4 bits (stochastic rounding seeded by round)
    the replicas are bit-identical, over gRPC and over the raw data plane."""
    cluster = clusters[plane]
    one = run(cluster, 2, lambda r: ["--steps", str(STEPS), "--fail-at", str(FAIL_AT), "--compression", compression,
                                     *(["--fail"] if r == 0 else [])], plane=plane)
    assert outcome(one[0], FAIL_AT) == "BackwardFailed: backward failed at 2.weight"
    assert_rank_1_was_told_and_both_went_on(cluster, one, compression, ROUND_TIMEOUT_S,
                                            "catch StepAbandoned, call zero_grad()")


def test_a_backward_that_fails_after_its_last_gradient_was_pushed_is_applied_not_abandoned(cluster):
    """Every block had gone to the shards: the other rank gets complete results and applies the
    step, so this rank cannot abandon it; zero_grad() says so, and step() applies it here too."""
    late = run(cluster, 2, lambda r: ["--steps", str(STEPS), "--fail-at", str(FAIL_AT), "--fail-param", "last",
                                      *(["--fail"] if r == 0 else [])])
    normal = run(cluster, 2, lambda r: ["--steps", str(STEPS), "--fail-at", str(FAIL_AT)])
    said = late[0]["outcomes"][FAIL_AT]
    assert said.startswith("BackwardFailed: backward failed at last"), said
    assert "zero_grad() said: rank 0: step 2 cannot be abandoned: every gradient had reached the shards" in said
    assert "Call step() to apply it here too" in said
    assert [outcome(r, s) for r in late[1:] for s in range(STEPS)] == ["ok"] * STEPS
    assert_same_params(late[0], late[1])
    assert_same_params(late[0], normal[0])  # the step was applied on both, as in a run without the failure


def test_with_allow_non_finite_an_abandoned_step_counts_on_every_rank_and_warmup_ends_together(cluster):
    """With allow_non_finite the other rank's step ends non-finite (its scaler skips it) and counts
    as a step there; the abandoning rank must count it too. Before, its step counter stayed one
    behind: warm-up ended a step apart, and the shard refused the round pushed with two codecs
    (the job failed at the round timeout)."""
    warmup = FAIL_AT + 1  # the step after the abandoned one is the first compressed one, on both ranks
    one = run(cluster, 2, lambda r: ["--steps", str(STEPS), "--fail-at", str(FAIL_AT), "--compression", "4bit",
                                     "--warmup-steps", str(warmup), "--allow-non-finite",
                                     *(["--fail"] if r == 0 else [])])
    assert outcome(one[0], FAIL_AT) == "BackwardFailed: backward failed at 2.weight"
    assert outcome(one[1], FAIL_AT) == "skipped: not finite"  # the marker, as a scaler sees an overflow
    for r in one:
        assert [outcome(r, s) for s in range(STEPS) if s != FAIL_AT] == ["ok"] * (STEPS - 1), r["outcomes"]
    assert one[0]["steps"] == one[1]["steps"] == STEPS - 1  # the last step's index: every step counted
    assert_same_params(one[0], one[1])


def test_with_allow_non_finite_adaptive_bits_go_on_after_an_abandoned_step(cluster):
    """Adaptive bits decide every 2 steps from rank 0's running average of the averaged gradients.
    The abandoned step's average is non-finite (as a real overflow's is under a GradScaler): it
    must not enter that average. Before, the next decision refused it on rank 0 (CodecError out
    of the next backward) and rank 1 waited for the decision's broadcast until its timeout."""
    one = run(cluster, 2, lambda r: ["--steps", str(STEPS), "--fail-at", str(FAIL_AT), "--compression", "adaptive:2",
                                     "--allow-non-finite", *(["--fail"] if r == 0 else [])])
    assert outcome(one[1], FAIL_AT) == "skipped: not finite"
    for r in one:
        assert [outcome(r, s) for s in range(STEPS) if s != FAIL_AT] == ["ok"] * (STEPS - 1), r["outcomes"]
    assert one[0]["steps"] == one[1]["steps"] == STEPS - 1
    assert_same_params(one[0], one[1])


@pytest.mark.parametrize("compression", ["fp32", "4bit"])
def test_a_rank_whose_gradient_is_not_finite_tells_the_other_at_once_then_both_go_on(cluster, compression):
    """Rank 0's gradient of 2.weight is NaN at step 2 (no allow_non_finite): its step() raises the
    codec's error naming the tensor, as before, and pushes the abandon marker for that block, so
    rank 1's step() raises StepAbandoned at once. Before, that block was never pushed and rank 1
    waited for it until the shards' round timeout (RoundFailedError after 120 s). Both catch,
    zero_grad() and go on in step: replicas equal (fp32: the run that left the batch out)."""
    one = run(cluster, 2, lambda r: ["--steps", str(STEPS), "--fail-at", str(FAIL_AT), "--compression", compression,
                                     *(["--nan"] if r == 0 else [])])
    said = outcome(one[0], FAIL_AT)
    assert said.startswith("CgxPsError: rank 0: cannot encode the gradient of "), said  # its block's tensors
    assert "2.weight" in said.split(": ")[2] and "contains NaN/Inf" in said, said
    # told far below the 120 s round timeout, with slack for a loaded host
    assert_rank_1_was_told_and_both_went_on(cluster, one, compression, 30, "a gradient there that was not finite")


def test_a_loop_that_does_not_catch_a_non_finite_gradient_stops_every_rank_promptly(cluster):
    """The same NaN, a loop that catches nothing: both ranks exit non-zero well before the round
    timeout, rank 0 naming the tensor, rank 1 saying the step was abandoned. Before, rank 1 sat
    until the 120 s round timeout."""
    job = {"CGX_PS_JOB_ID": f"abandon-{uuid.uuid4().hex[:8]}"}
    procs = [start_worker([sys.executable, str(WORKER), "--steps", str(STEPS), "--fail-at", str(FAIL_AT),
                           "--no-catch", *(["--nan"] if r == 0 else [])], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=env_for(r, 2, cluster.addresses, **job))
             for r in range(2)]
    try:
        errs = []
        for proc in procs:
            _, stderr = proc.communicate(timeout=60)  # far below the 120 s round timeout
            assert proc.returncode != 0, stderr[-3000:]
            errs.append(stderr)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    said = errs[0].strip().splitlines()[-1]
    assert said.startswith("cgx_ps.worker.errors.CgxPsError: rank 0: cannot encode the gradient of "), errs[0][-3000:]
    assert "2.weight" in said.split(": ")[2], said
    assert "StepAbandoned: rank 1: step 2 was abandoned by another rank" in errs[1], errs[1][-3000:]


def test_a_backward_that_fails_after_a_non_finite_gradient_abandons_the_step_quietly(cluster):
    """Rank 0's gradient of 2.weight is NaN and its backward then raises: that block already went
    as the marker (its encode refused the NaN), so zero_grad() abandons the step without pushing
    it again and without raising the codec's error; rank 1 is told at once; both go on in step.
    Before, rank 1 waited for that block until the round timeout."""
    one = run(cluster, 2, lambda r: ["--steps", str(STEPS), "--fail-at", str(FAIL_AT),
                                     *(["--nan", "--fail"] if r == 0 else [])])
    assert outcome(one[0], FAIL_AT) == "BackwardFailed: backward failed at 2.weight"
    told = outcome(one[1], FAIL_AT)
    assert told.startswith("StepAbandoned: rank 1: step 2 was abandoned by another rank"), told
    for r in one:
        assert [outcome(r, s) for s in range(STEPS) if s != FAIL_AT] == ["ok"] * (STEPS - 1), r["outcomes"]
    assert one[0]["steps"] == one[1]["steps"]
    assert_same_params(one[0], one[1])
    reference = run(cluster, 2, lambda r: ["--steps", str(STEPS), "--fail-at", str(FAIL_AT), "--skip"])
    assert_same_params(one[0], reference[0])


def test_ranks_that_differ_in_allow_non_finite_are_refused_at_start(cluster):
    """allow_non_finite decides how a NaN/Inf ends the step (a non-finite step every scaler skips,
    or StepAbandoned), so every rank must pass the same: the rank that registers second is refused
    at start, naming the setting and both values. Before, both trained, each ready to end such a
    step its own way."""
    job = {"CGX_PS_JOB_ID": f"abandon-{uuid.uuid4().hex[:8]}"}
    procs = [start_worker([sys.executable, str(WORKER), "--steps", str(STEPS),
                           *(["--allow-non-finite"] if r == 0 else [])], stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, env=env_for(r, 2, cluster.addresses, **job))
             for r in range(2)]
    try:
        # the refused rank exits; the other, registered, would wait for it at its first round
        asyncio.run(until(lambda: any(proc.poll() is not None for proc in procs), 120, "a rank exiting"))
        ended = next(proc for proc in procs if proc.poll() is not None)
        _, stderr = ended.communicate()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert ended.returncode != 0, stderr[-3000:]
    said = stderr.strip().splitlines()[-1]
    assert "ShardRejectedError" in said, stderr[-3000:]
    mine, theirs = ("True", "False") if ended is procs[0] else ("False", "True")
    assert f"allow_non_finite={mine}, the session's nodes passed allow_non_finite={theirs}" in said, said
