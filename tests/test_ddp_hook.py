"""The DDP communication hook with real processes: DDP over gloo, two real shards, two workers.

One launch runs every scenario in sequence (tests/workers/ddp_worker.py), a second one the
same hook with the two ranks as local ranks of one node. Each scenario is checked for
bit-identical replicas, and against the DistributedOptimizer (exactly: the same blocks, seeds
and shards), plain DDP, or exact expectations. Another launch runs the DistributedOptimizer's
auto-mode uncompressed steps, which all_reduce on the same gloo group (frontends/uncompressed.py), and one
more the hook's real auto mode, whose model probes DDP's allreduce on every rank."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from cgx_ps.server import LocalCluster
from cgx_ps.v1 import ps_pb2
from support import plane_env
from workers.step_worker import rank_gradient
from workers.warm_start import start_worker

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow
WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ddp_workers(cluster: LocalCluster, out: Path, *args: str, timeout: float = 300,
                    env_extra: dict[str, str] | None = None) -> list[dict]:
    port, job = str(_free_port()), f"ddp-{uuid.uuid4().hex[:8]}"
    procs = []
    for rank in range(WORLD):
        env = dict(os.environ, **cluster.worker_env(), RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK="0",
                   LOCAL_WORLD_SIZE="1", CGX_PS_NODE_RANK=str(rank), CGX_PS_NUM_NODES=str(WORLD),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port, CGX_PS_JOB_ID=job, OMP_NUM_THREADS="1",
                   CGX_PS_CONNECT_TIMEOUT="20", **(env_extra or {}))
        procs.append(start_worker([sys.executable, str(ROOT / "tests/workers/ddp_worker.py"),
                                   "--out", str(out / f"rank{rank}.pt"), *args],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        errs = [p.communicate(timeout=timeout)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, (p, err) in enumerate(zip(procs, errs)):
        assert p.returncode == 0, f"rank {rank}:\n{err[-4000:]}"
    results = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    for name in results[0]:
        for r in range(WORLD):
            assert "crash" not in results[r][name], f"{name} on rank {r}:\n{results[r][name]['crash']}"
    return results


def assert_same(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{what}: {name} differs"


def expected_fp32(initial: dict, steps: int, ranks_of=lambda name: range(WORLD)) -> dict:
    """fp32 through the shards: every node pushes its gradient, the shard sums, the worker
    halves; SGD with lr 1. ``ranks_of(name)``: the ranks whose gradient of ``name`` is not zero."""
    params = {n: t.clone() for n, t in initial.items()}
    for step in range(steps):
        for name, p in params.items():
            total = torch.zeros_like(p)
            for r in ranks_of(name):
                total = total + rank_gradient(name, p, r, step, 0)
            p.sub_(total * (1.0 / WORLD))
    return params


CLUSTER_SETTINGS = dict(shards=2, round_timeout=10)  # the tests' shared shards per plane (conftest.clusters)


def check_user_hooks(results: list[dict]) -> None:
    """A user's own post-accumulate-grad hooks (clipping in place on every parameter from the
    start, halving in place on two parameters from step 2, after the early hand-over is installed)
    under DDP with bucket views (the user_hooks_* scenarios of the launch of
    test_hook_in_every_ddp_configuration): each must see autograd's undivided local gradient, as under plain
    DDP, and its changes must reach the average as they do there, on the shards' steps (blocks
    handed over early) and on DDP's allreduce steps (gradients divided into the bucket early).
    Before, a hook registered after the hand-over's saw DDP's bucket instead (the last step's
    average, or the divided gradient) and its changes were lost."""
    for rank, r in enumerate(results):
        plain = r["user_hooks_plain"]
        shapes = {n: t.shape for n, t in plain["initial"].items()}
        for (step, name), total in plain["seen"]["first"].items():  # autograd's gradient, undivided
            assert total == float(rank_gradient(name, torch.empty(shapes[name]), rank, step, 0).double().sum())
        assert sorted(plain["seen"]["later"]) == [(s, n) for s in (2, 3) for n in ("0.weight", "2.weight")]
        for run in ("user_hooks_shards", "user_hooks_allreduce"):
            assert r[run]["seen"] == plain["seen"], (rank, run)
            for name, value in plain["final"].items():
                torch.testing.assert_close(r[run]["final"][name], value, rtol=0, atol=1e-5, msg=f"{run}: {name}")
            # the early hand-over (from step 2, once DDP's buckets are settled) goes on for every
            # parameter without a user's hook after its own
            params = len(plain["final"])
            assert r[run]["early"] == [0, 0, params - 2, params - 2], (run, r[run]["early"])
    assert results[0]["user_hooks_allreduce"]["paths"] == "allreduce"


def test_hook_in_every_ddp_configuration(cluster, tmp_path):
    results = run_ddp_workers(cluster, tmp_path)
    assert {"hook_4bit", "gan", "amp_ddp", "bf16", "local:hook_4bit", "local:gan"} <= results[0].keys()
    for name in results[0]:  # replicas bit-identical in every scenario
        if "final" in results[0][name]:
            final = [r[name]["final"] for r in results]
            flat = [{f"{k}.{n}": t for k, d in f.items() for n, t in d.items()} if "gan" in name else f for f in final]
            assert_same(flat[0], flat[1], f"{name}: rank 0 vs rank 1")
    r0 = results[0]

    # the hook is the DistributedOptimizer's pipeline: the same layout, allow_non_finite on by default
    # for both (as DDP's allreduce: a GradScaler's loop needs no flag), the same bits
    hook_layout, optimizer_layout = (ps_pb2.Layout.FromString(r0[n]["layout"]) for n in ("hook_4bit", "optimizer_4bit"))
    assert {t.allow_non_finite for t in hook_layout.tensors} == {True}
    assert hook_layout == optimizer_layout
    layout = ps_pb2.Layout.FromString(r0["hook_4bit"]["layout"])
    assert len(layout.blocks) > 2 and {b.shard for b in layout.blocks} == {0, 1}
    assert_same(r0["hook_4bit"]["final"], r0["optimizer_4bit"]["final"], "hook vs DistributedOptimizer")
    assert_same(r0["hook_static_graph"]["final"], r0["hook_4bit"]["final"], "static_graph")
    assert_same(r0["hook_bucket_view"]["final"], r0["hook_4bit"]["final"], "gradient_as_bucket_view")
    # with bucket views, the last step's gradients went to the pipeline before DDP's reducer copied
    # them into its bucket (early hand-over); without them DDP copies, as before
    params = len(r0["hook_4bit"]["final"])
    assert r0["hook_bucket_view"]["stats"]["early_gradients"] == params
    assert r0["hook_4bit"]["stats"]["early_gradients"] == r0["hook_static_graph"]["stats"]["early_gradients"] == 0
    assert_same(r0["hook_bucket_view_no_sync"]["final"], r0["optimizer_accumulate_3"]["final"],
                "early hand-over with no_sync() accumulation")
    assert r0["hook_bucket_view_no_sync"]["stats"]["early_gradients"] == params
    # early hand-over acts only on a backward DDP reduces: a probe through ddp.module (on both
    # ranks, then on rank 0 only) keeps its local gradients, and every step stays exact
    for r in results:
        probe = r["early_probe"]
        assert probe["probe_local"] == ([True, True] if r is r0 else [True]), probe["probe_local"]
        assert probe["early"][2:] == [params] * 3, probe["early"]  # and the DDP steps still hand over early
    for step, after in enumerate(r0["early_probe"]["after"]):
        assert_same(after, expected_fp32(r0["early_probe"]["initial"], step + 1), f"early_probe: step {step}")
    # its hooks go with the DDP model and its state, or with the session (then re-wrapping trains on)
    for r in results:
        dropped = r["early_dropped"]
        assert (dropped["early"], dropped["hooks_before"], dropped["hooks_after"]) == (params, params, 0), dropped
        assert dropped["ddp_freed"] and dropped["local"] == [True, True], dropped
        assert r["early_rewrap"]["early"] == [params, params] and r["early_rewrap"]["hooks"] == [params, 0, params]
    assert_same(r0["early_rewrap"]["final"], expected_fp32(r0["early_rewrap"]["initial"], 6), "early_rewrap")
    # blocks of one tensor, or of tensors end to end in one bucket, skip the copies (both front ends)
    for run in ("hook_4bit", "hook_bucket_view", "optimizer_4bit"):
        assert 0 < r0[run]["stats"]["in_place_blocks"] < len(layout.blocks), run
    assert r0["hook_adaptive"]["stats"]["in_place_blocks"] == 0  # the tuner reads the block buffers
    assert_same(r0["hook_no_sync"]["final"], r0["optimizer_accumulate"]["final"], "no_sync vs accumulation")
    assert_same(r0["hook_options"]["final"], r0["optimizer_options"]["final"], "error feedback, warm-up, overrides")
    assert_same(r0["hook_adaptive"]["final"], r0["optimizer_adaptive"]["final"], "adaptive bits")
    # the hook's tuner runs at the next step's first bucket: after 4 steps it decided once, the optimizer twice
    assert r0["hook_adaptive"]["tuning"] == r0["optimizer_adaptive"]["tuning"][:1] and r0["hook_adaptive"]["tuning"]
    for r in results:  # auto mode decided once, the same on every rank
        assert [d["compress"] for d in r["hook_auto"]["tuning"]] == [d["compress"] for d in r0["hook_auto"]["tuning"]]
        assert len(r["hook_auto"]["tuning"]) == 1
    # auto mode's uncompressed steps: DDP's own allreduce, exact, the shards' rounds untouched
    fallback = r0["hook_allreduce_fallback"]
    assert fallback["paths"] == ["shards", "allreduce", "allreduce", "shards"]
    assert [r - fallback["rounds"][0] for r in fallback["rounds"]] == [0, 0, 0, 1]
    for step in (1, 2):
        for name, p in fallback["before"][step].items():
            average = sum(rank_gradient(name, p, r, step, 0) for r in range(WORLD)) / WORLD
            assert torch.equal(fallback["before"][step + 1][name], p - average), (step, name)
    stats = r0["hook_4bit"]["stats"]
    assert stats["fp32_bytes"] / stats["bytes_pushed"] > 5 and stats["exposed_comm_s"] >= 0
    assert r0["hook_4bit"]["intranode"] is None

    # against plain DDP: fp32 through the shards agrees to rounding; 4 bits within quantization error
    plain, initial = r0["plain_ddp"]["final"], r0["plain_ddp"]["initial"]
    for name, value in plain.items():
        torch.testing.assert_close(r0["hook_fp32"]["final"][name], value, rtol=0, atol=1e-5)
        update, update_4bit = value - initial[name], r0["hook_4bit"]["final"][name] - initial[name]
        assert (update_4bit - update).norm() < 0.75 * update.norm(), name  # two 4-bit roundings: ~0.5 measured

    # find_unused_parameters: the branch only rank 0 used contributes zeros from rank 1
    unused = r0["unused"]
    want = expected_fp32(unused["initial"], 2, lambda n: [0] if n.startswith("extra.") else range(WORLD))
    for name, value in want.items():
        torch.testing.assert_close(unused["final"][name], value, rtol=1e-6, atol=1e-6)

    # two DDP models in one process: one session, each model exact
    gan = r0["gan"]
    for model in ("gen", "disc"):
        want = expected_fp32(gan["initial"][model], 2)
        for name, value in want.items():
            torch.testing.assert_close(gan["final"][model][name], value, rtol=1e-6, atol=1e-6)

    # AMP with the defaults (no allow_non_finite): rank 1 overflows at step 1; every rank's
    # GradScaler skips that step and halves its scale, and the replicas stay identical
    for front_end in ("amp_ddp", "amp_optimizer"):
        per_rank = [r[front_end] for r in results]
        for run in per_rank:
            assert run["changed"] == [True, False, True], (front_end, run["changed"])
            assert run["scales"] == [1024.0, 512.0, 512.0], (front_end, run["scales"])
            assert all(torch.isfinite(t).all() for t in run["final"].values())
        assert_same(per_rank[0]["final"], per_rank[1]["final"], f"{front_end}: rank 0 vs rank 1")

    # bf16 gradients: the overflow of one rank reaches every rank as non-finite
    for r in results:
        assert r["bf16"]["finite"] == [True, False, True] and r["bf16"]["grad_dtypes"] == ["torch.bfloat16"]

    # local ranks: two ranks of one node reduce through shared memory, then push once
    for r in results:
        assert r["local:hook_4bit"]["intranode"] == "shm"
        assert r["local:hook_4bit"]["stats"]["in_place_blocks"] == 0  # local ranks reduce in the block buffers
    for model in ("gen", "disc"):
        want = expected_fp32(r0["local:gan"]["initial"][model], 2)  # fp32: the node's sum, then the average
        for name, value in want.items():
            torch.testing.assert_close(r0["local:gan"]["final"][model][name], value, rtol=1e-6, atol=1e-6)

    check_user_hooks(results)

    # a state given another model's module: named, on every rank
    for r in results:
        error = r["foreign_module"]["error"]
        assert error and "not among the trainable parameters of the Sequential given to DDPHookState" in error



def test_optimizer_auto_uncompressed_steps_all_reduce_on_the_process_group(cluster, tmp_path):
    """DistributedOptimizer, auto mode's uncompressed steps: all_reduce on the gloo group, block by
    block; as two nodes and as two local ranks of one node (shared-memory reduction on the
    compressed steps)."""
    results = run_ddp_workers(cluster, tmp_path, "--scenarios",
                              "optimizer_allreduce,amp_optimizer_allreduce,optimizer_auto_group,"
                              "local:optimizer_allreduce")
    for name in ("optimizer_allreduce", "local:optimizer_allreduce"):
        runs = [r[name] for r in results]
        assert_same(runs[0]["final"], runs[1]["final"], f"{name}: rank 0 vs rank 1")
        assert runs[0]["intranode"] == (None if name == "optimizer_allreduce" else "shm")
        for run in runs:
            assert run["paths"] == ["shards", "allreduce", "allreduce", "shards", "error", "allreduce"], run["paths"]
            # the shards' rounds move only on the steps that went to them (step 4 failed on every rank)
            assert [r - run["rounds"][0] for r in run["rounds"]] == [0, 0, 0, 1, 1, 1]
            # in place where a block is a slice of one .grad, copied where it packs several tensors
            assert all(0 < run["in_place"][s] < run["blocks"] for s in (1, 2, 5)), run["in_place"]
            assert len(run["errors"]) == 1 and "NaN/Inf (on some rank) in the gradient of 0.weight" in run["errors"][0]
            assert "allow_non_finite=True" in run["errors"][0]
        run = runs[0]
        after = [*run["before"][1:], run["final"]]
        for step in (1, 2, 5):  # exactly the average of the known gradients: divide by 2 (exact), sum
            for pname, p in run["before"][step].items():
                average = sum(rank_gradient(pname, p, r, step, 0) for r in range(WORLD)) / WORLD
                assert torch.equal(after[step][pname], p - average), (name, step, pname)
        assert_same(run["before"][4], run["before"][5], f"{name}: the refused step changed nothing")
    # a GradScaler on all_reduce steps: rank 1's overflow at step 1 reaches both ranks, both skip it
    for r in results:
        amp = r["amp_optimizer_allreduce"]
        assert amp["paths"] == ["allreduce"] * 3
        assert amp["changed"] == [True, False, True] and amp["scales"] == [1024.0, 512.0, 512.0]
    assert_same(results[0]["amp_optimizer_allreduce"]["final"], results[1]["amp_optimizer_allreduce"]["final"],
                "AMP on all_reduce steps: rank 0 vs rank 1")
    # real auto mode: the model saw the group's all_reduce rate; every step went where the
    # decision before it said, the same on both ranks
    auto = [r["optimizer_auto_group"] for r in results]
    assert auto[0]["tuning"] == auto[1]["tuning"] and auto[0]["paths"] == auto[1]["paths"]
    assert_same(auto[0]["final"], auto[1]["final"], "auto mode with a group: rank 0 vs rank 1")
    decisions = auto[0]["tuning"]
    assert len(decisions) == 3 and all(d["figures"]["uncompressed_bps"] > 0 for d in decisions if d["figures"])
    compress = [True, decisions[0]["compress"], decisions[1]["compress"], decisions[1]["compress"]]
    assert auto[0]["paths"] == ["shards" if c else "allreduce" for c in compress], (auto[0]["paths"], decisions)


def test_a_stalled_rank_fails_the_optimizers_all_reduce_step_within_the_round_timeout(tmp_path, local_cluster):
    """Before: a rank that stalled in auto mode's all_reduce steps was detected only at the gloo
    group's own timeout (30 minutes), by an error naming no block or step; the shards path fails
    after its round timeout. Now the all_reduce steps wait the same round timeout, and the
    collective refuses every later step (torch cannot cancel the stalled all_reduce)."""
    round_timeout = 1.0
    short = local_cluster(1, round_timeout=round_timeout)
    results = run_ddp_workers(short, tmp_path, "--scenarios", "optimizer_allreduce_stall",
                              "--stall-s", str(round_timeout + 1.5), timeout=120)
    (ok, _), (stalled, took), (refused, refused_after) = results[0]["optimizer_allreduce_stall"]["outcomes"]
    assert ok == "allreduce"
    assert stalled.startswith("CollectiveStalledError: rank 0: the all_reduce of block "), stalled
    assert "at step 1 did not finish within the round timeout (1s) on the process group of 2 ranks" in stalled
    assert "restart the job" in stalled
    assert round_timeout * 0.9 < took < round_timeout + 5, took
    assert refused == stalled and refused_after < 1.0  # at once, the same reason
    # rank 1 came back after rank 0 gave up: its all_reduce paired with rank 0's stale one, which
    # is why rank 0 must not go on
    assert [o for o, _ in results[1]["optimizer_allreduce_stall"]["outcomes"]] == ["allreduce", "allreduce"]


def test_a_rank_whose_backward_fails_part_way_leaves_every_rank_an_error_not_a_mismatched_average(tmp_path, local_cluster):
    """gloo pairs all_reduces by the order ranks issue them. Auto mode's uncompressed steps on the
    gloo group: rank 1's backward fails at step 1 once some of its blocks are launched, and it goes
    on to the next batch, so from then on the ranks' all_reduces are out of step. No rank may apply
    an average that paired a block with another block, or another step, of the other rank. What
    happens: rank 0 fails step 1 naming the block (at the round timeout, or sooner when rank 1's
    process exits) and refuses every later step; rank 1's zero_grad() says that such a step cannot be
    abandoned (tests/test_abandoned_step.py: on the shards it can), and it starts no further step. No parameter moves after step 0, and the replicas stay equal."""
    round_timeout = 1.0
    short = local_cluster(1, round_timeout=round_timeout)
    results = run_ddp_workers(short, tmp_path, "--scenarios", "optimizer_allreduce_abandon", timeout=120)
    runs = [r["optimizer_allreduce_abandon"] for r in results]
    assert runs[0]["outcomes"][0] == runs[1]["outcomes"][0] == "allreduce"
    assert runs[1]["outcomes"][1] == "RuntimeError: injected: out of memory in backward"
    # stalled past the round timeout, or failed sooner when rank 1's process exited: named either way
    failed = runs[0]["outcomes"][1]
    assert failed.startswith(("CollectiveStalledError: rank 0: the all_reduce of block ",
                              "CgxPsError: rank 0: the all_reduce of block ")), failed
    # its zero_grad() cannot abandon the step on the group (the other rank's all_reduce waits): it says so
    assert "cannot be abandoned (the other ranks' all_reduce waits" in runs[1]["outcomes"][2], runs[1]["outcomes"][2]
    for run in runs:
        assert all(o not in ("allreduce", "shards") for o in run["outcomes"][1:]), run["outcomes"]
        for step, (before, after) in enumerate(zip(run["before"][1:], [*run["before"][2:], run["final"]]), 1):
            assert_same(before, after, f"step {step} after the failure")
    assert_same(runs[0]["final"], runs[1]["final"], "rank 0 vs rank 1")


def test_hook_auto_mode_probes_ddps_allreduce_on_every_rank_at_the_same_step(cluster, tmp_path):
    """The DDP hook's auto mode gives its model a probe of DDP's allreduce, as the optimizer does:
    every rank times an all_reduce on DDP's group at every decision, at the same step, rank 0's
    model decides with that rate, and every rank applies each decision from the same step."""
    results = run_ddp_workers(cluster, tmp_path, "--scenarios", "hook_auto_probe")
    runs = [r["hook_auto_probe"] for r in results]
    decisions = runs[0]["tuning"]
    assert len(decisions) == 4 and all(r["tuning"] == decisions for r in runs), [r["tuning"] for r in runs]
    for run in runs:  # a collective on every rank after the same steps: those auto mode decides after
        assert [p["after_step"] for p in run["probed"]] == [0, 1, 3, 5], run["probed"]
        assert all(p["bps"] > 0 for p in run["probed"]), run["probed"]
    # rank 0's model judged the uncompressed path by what its probe measured, at every decision
    assert [d["figures"]["uncompressed_bps"] for d in decisions] == [p["bps"] for p in runs[0]["probed"]]
    # each step went where the decision before it said, on every rank: DDP's allreduce or the shards
    compress = [True] + [d["compress"] for d in (decisions[0], decisions[1], decisions[1], decisions[2],
                                                 decisions[2], decisions[3])]
    for run in runs:
        assert run["paths"] == ["shards" if c else "allreduce" for c in compress], (run["paths"], decisions)
    assert runs[0]["rounds"] == runs[1]["rounds"]
    assert_same(runs[0]["final"], runs[1]["final"], "hook auto: rank 0 vs rank 1")


def test_hook_auto_mode_takes_gradients_from_autograd_on_both_paths(clusters, tmp_path, plane):
    """Auto mode with bucket views. Steps through DDP's allreduce: each gradient is divided into its
    place in DDP's bucket as autograd finishes it (DDP's fused copy), and the hook divides only what
    did not come that way; before, DDP copied every gradient into its bucket undivided and the hook
    divided the whole bucket again (a second pass per step). Compressed steps: blocks in place and
    the early hand-over, as at a fixed bit width; before, auto mode copied them through the block
    buffers (its tuner reads no gradients, unlike adaptive bits'). On both data planes: the
    shards' steps exact and the replicas identical over gRPC and over the raw data plane."""
    results = run_ddp_workers(clusters[plane], tmp_path, "--scenarios", "hook_auto_scaled", env_extra=plane_env(plane))
    runs = [r["hook_auto_scaled"] for r in results]
    assert_same(runs[0]["final"], runs[1]["final"], "auto, divided early: rank 0 vs rank 1")
    params = len(runs[0]["final"])
    for run in runs:
        assert [d["compress"] for d in run["tuning"]] == [False, True], run["tuning"]
        assert run["paths"] == ["shards"] + ["allreduce"] * 3 + ["shards"] * 2, run["paths"]
        # from the step after DDP settles its buckets (step 1); not where .grad is the bucket already
        assert run["early"] == [0, 0, params, 0, params, params], run["early"]
        assert all(0 < run["in_place"][s] < run["blocks"] for s in (0, 4, 5)), run["in_place"]
    run = runs[0]
    after = [*run["before"][1:], run["final"]]
    for step in range(1, 4):  # exactly the average of the known gradients (no_sync parts summed first)
        for name, p in run["before"][step].items():
            grads = [sum(rank_gradient(name, p, r, step, part) for part in range(run["parts"][step]))
                     for r in range(WORLD)]
            assert torch.equal(after[step][name], p - sum(g / WORLD for g in grads)), (step, name)


def test_early_handover_only_where_ddp_calls_the_hook_for_every_gradient_in_its_bucket_views():
    from cgx_ps.worker.frontends.handover import early_action, early_handover

    assert early_handover(True, True, False, False, True)
    assert early_handover(True, True, False, False, False, True)  # auto mode: its steps through DDP's allreduce
    for flags in [(False, True, False, False, True, True),  # the state holds the wrapped model, not DDP
                  (True, False, False, False, True, True),  # .grad is not DDP's bucket: DDP copies back anyway
                  (True, True, True, False, True, True),  # unused parameters: DDP fills them in itself
                  (True, True, False, True, True, True),  # static_graph: the first step's hooks come late
                  (True, True, False, False, False, False)]:  # blocks in the block buffers, never DDP's allreduce
        assert not early_handover(*flags), flags
    # per gradient: divided into the bucket on a step through DDP's allreduce, blocks started on a
    # step to the shards where blocks work in place, else left to DDP
    assert early_action(allreduce_step=True, in_place=False, requires_grad=False) == "scale"
    assert early_action(allreduce_step=False, in_place=True, requires_grad=False) == "submit"
    assert early_action(allreduce_step=False, in_place=False, requires_grad=False) is None
    assert early_action(allreduce_step=True, in_place=True, requires_grad=True) is None  # create_graph


def test_bad_state_options_are_named_before_any_training():
    import cgx_ps.worker as cgx

    model = torch.nn.Linear(4, 4)
    with pytest.raises(cgx.ConfigError, match="needs the model"):
        cgx.DDPHookState("model")
    with pytest.raises(cgx.ConfigError, match="bits must be in 1..8 or None, got 9"):
        cgx.DDPHookState(model, compression="9bit")
    with pytest.raises(cgx.ConfigError, match="warmup_steps must be an integer >= 0"):
        cgx.DDPHookState(model, warmup_steps=-1)
    with pytest.raises(cgx.ConfigError, match="allow_non_finite must be True or False"):
        cgx.DDPHookState(model, allow_non_finite="yes")
    with pytest.raises(cgx.ConfigError, match="uncompressed_via must be one of"):
        cgx.DDPHookState(model, uncompressed_via="nccl")
    with pytest.raises(cgx.ConfigError, match="needs a DDPHookState"):
        cgx.ddp_comm_hook(object(), None)
    with pytest.raises(cgx.CgxPsError, match="registers with the shards at the first backward"):
        _ = cgx.DDPHookState(model).stats


def test_hook_without_allow_non_finite_a_nan_gradient_abandons_the_step_on_every_rank_at_once(tmp_path, local_cluster):
    """The hook with allow_non_finite=False, rank 1's gradient NaN at step 1 (docs/troubleshooting.md:
    what each rank's backward raises). Rank 1's backward raises the codec's error naming the
    tensor; it pushes the abandon marker for that block, so rank 0's backward raises StepAbandoned
    at once (far below the 120 s round timeout), both through DDP's RuntimeError. Neither applies
    the step, the loop catches and goes on: the later steps train, the replicas stay equal."""
    slow = local_cluster(2, round_timeout=120)
    results = run_ddp_workers(slow, tmp_path, "--scenarios", "hook_nan", timeout=200)
    runs = [r["hook_nan"] for r in results]
    outcomes = [[o.rsplit(" (", 1)[0] for o in run["outcomes"]] for run in runs]
    seconds = [float(run["outcomes"][1].rsplit(" (", 1)[1].split(" s)")[0]) for run in runs]
    told, failed = outcomes[0][1], outcomes[1][1]
    assert failed.startswith("RuntimeError: "), failed  # DDP's own wrapping of the hook's error
    assert "CgxPsError: rank 1: cannot encode the gradient of " in failed and "2.weight" in failed, failed
    assert "StepAbandoned: rank 0: step 1 was abandoned by another rank" in told, told
    assert max(seconds) < 30, runs[0]["outcomes"]
    for steps in outcomes:
        assert [steps[0], *steps[2:]] == ["ok"] * 3, steps
    for run in runs:
        assert_same(run["before"][1], run["before"][2], "the abandoned step")  # applied nowhere
    assert_same(runs[0]["final"], runs[1]["final"], "rank 0 vs rank 1")
