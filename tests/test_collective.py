"""The pure decisions behind auto mode's uncompressed steps on a process group (frontends/uncompressed.py,
frontends/route.py) and the optimizer's options for them. The real all_reduce steps,
with two processes, gloo and real shards: tests/test_ddp_hook.py."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch
import torch.distributed as dist

import cgx_ps.worker as cgx
from cgx_ps.worker import runtime
from cgx_ps.planning.measured import AutoFigures, AutoModel, workload_of
from cgx_ps.worker.frontends.route import SHARDS, Route, StepRouter, choose_route, collective_group
from cgx_ps.worker.frontends.uncompressed import group_problem, launch_order
from cgx_ps.worker.pipeline.blocks import Compression, TensorInfo, build_layout


def test_only_auto_modes_uncompressed_steps_with_a_group_leave_the_shards():
    group = object()  # choose_route only passes the group on
    assert choose_route(False, "allreduce", group) == Route("allreduce", group)
    assert choose_route(True, "allreduce", group) == SHARDS  # compressed steps always use the shards
    assert choose_route(False, "allreduce", None) == SHARDS  # no group: the shards' fp32 path
    assert choose_route(False, "shards", group) == SHARDS
    assert SHARDS.group is None
    assert collective_group(None, "shards") is None
    assert collective_group(None, "allreduce") is None  # torch.distributed not initialized here


def test_a_front_ends_router_sends_uncompressed_steps_to_its_group_and_probes_it(tmp_path):
    """Both front ends route through a StepRouter: the group of their uncompressed steps, the
    step's route from auto mode's decision (``pipe.compress``), and the probe auto mode's model
    times that group with. The DDP hook's router (no block order) leaves the all_reduce to DDP."""
    pipe = types.SimpleNamespace(compress=True)  # all the router reads of a pipeline without a block order
    hook = StepRouter(pipe, "allreduce", True, lambda: None, block_order=None)
    assert hook.group() is None and not hook.may_allreduce() and hook.probe(1024) is None  # no group yet
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert hook.group() is dist.group.WORLD and hook.may_allreduce()
        assert hook.choose() == SHARDS  # compressed: the shards
        pipe.compress = False
        route = hook.choose()
        assert route == Route("allreduce", dist.group.WORLD) and route.size == 1
        assert hook.collective(route) is None  # the hook all-reduces its buckets itself
        assert hook.probe(1 << 16) > 0  # bytes/s of a real all_reduce on the group
        shards = StepRouter(pipe, "shards", True, lambda: dist.group.WORLD, block_order=None)
        assert shards.choose() == SHARDS and shards.probe(1024) is None and not shards.may_allreduce()
        assert not StepRouter(pipe, "allreduce", False, lambda: None, None).may_allreduce()  # not auto mode
    finally:
        dist.destroy_process_group()


def test_auto_modes_model_takes_the_all_reduce_rate_for_uncompressed_steps_when_measured():
    # 16 M parameters (64 MB of fp32) over 100 ms of backward; the shards move 100 MB/s, the group all-reduces 1 GB/s
    tensors = [(f"{i}.weight", (2048, 2048)) for i in range(4)]
    workload = workload_of(tensors, {name: 0.025 * i for i, (name, _) in enumerate(tensors)}, 0.1)
    shards = AutoFigures(1e8, 1e8, 0.0, 64 << 20, 8 << 20, 0.05, 0.1, codec_eps=1e9, nodes=2, ranks=2)
    group = dataclasses.replace(shards, uncompressed_bps=1e9)
    through_shards, through_group = AutoModel(workload, shards), AutoModel(workload, group)
    assert through_shards.exposed(False) > 0.5  # push + pull of 64 MB at 100 MB/s: most of it after backward
    assert through_group.exposed(False) < 0.02  # 64 ms of all_reduce, nearly all of it behind backward
    assert through_group.exposed(True) == through_shards.exposed(True)  # compressed steps use the shards either way
    assert through_shards.exposed(True) < through_shards.exposed(False)
    assert through_group.exposed(False) < through_group.exposed(True)


def test_blocks_launch_in_reverse_registration_order_of_their_earliest_tensor():
    model = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.ReLU(), torch.nn.Linear(300, 10))
    named = list(model.named_parameters())
    layout = build_layout([TensorInfo.of(n, p) for n, p in named], 2, Compression(), block_bytes=16384)
    # sorted by name, by codec: [0.bias + 2.bias], 0.weight in 4096-element blocks 1..4, its tail
    # with the head of 2.weight (block 5), the rest of 2.weight (block 6)
    order = launch_order(layout, [n for n, _ in named])
    assert order == [6, 0, 1, 2, 3, 4, 5]
    assert sorted(order) == list(range(len(layout.blocks)))
    # the same layout from another registration order launches in another order: ranks must agree
    assert launch_order(layout, [n for n, _ in reversed(named)]) != order


def test_a_group_that_is_not_exactly_this_jobs_ranks_is_refused_with_the_reason():
    ok = [[0, 11, 7], [1, 11, 7]]
    assert group_problem([0, 11, 7], ok, 2) is None
    assert "holds cgx-ps ranks [0], not this job's 2 ranks" in group_problem([0, 11, 7], ok[:1], 2)
    assert "holds cgx-ps ranks [0, 0]" in group_problem([0, 11, 7], [[0, 11, 7], [0, 11, 7]], 2)
    assert "different cgx-ps sessions" in group_problem([0, 11, 7], [[0, 11, 7], [1, 11, 8]], 2)
    assert "different orders" in group_problem([0, 11, 7], [[0, 11, 7], [1, 12, 7]], 2)


def test_bad_uncompressed_options_are_named_before_registering():
    opt = torch.optim.SGD(torch.nn.Linear(4, 4).parameters(), lr=0.1)
    with pytest.raises(cgx.ConfigError, match="uncompressed_via must be one of"):
        cgx.DistributedOptimizer(opt, compression="auto", uncompressed_via="nccl")
    with pytest.raises(cgx.ConfigError, match="only used with uncompressed_via='allreduce'"):
        cgx.DistributedOptimizer(opt, compression="auto", uncompressed_via="shards", process_group=object())
    with pytest.raises(cgx.ConfigError, match="must be a torch.distributed ProcessGroup, got str"):
        cgx.DistributedOptimizer(opt, compression="auto", process_group="gloo")


def test_auto_mode_with_a_default_group_smaller_than_the_job_is_refused_when_created(monkeypatch, tmp_path):
    """Before: the mismatch surfaced only at auto mode's first decision, inside an autograd hook
    (maybe at step 100). Now when the optimizer is created, before a shard is dialled (the
    address here is never reachable: registering would fail otherwise)."""
    monkeypatch.setattr(runtime, "_config", None)
    cgx.init(cgx.WorkerConfig(rank=0, world_size=2, node_rank=0, num_nodes=2, servers=("127.0.0.1:9",),
                              connect_timeout_s=0.1))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        opt = torch.optim.SGD(torch.nn.Linear(4, 4).parameters(), lr=0.1)
        with pytest.raises(cgx.ConfigError, match=r"rank 0: the process group has 1 ranks, this cgx-ps job 2"):
            cgx.DistributedOptimizer(opt, compression="auto")
        # other modes never use the group; with uncompressed_via="shards" neither does auto mode:
        # both go on to register, and fail at the unreachable shard instead
        for kwargs in (dict(compression="4bit"), dict(compression="auto", uncompressed_via="shards")):
            with pytest.raises(cgx.ShardUnavailableError):
                cgx.DistributedOptimizer(opt, **kwargs)
    finally:
        dist.destroy_process_group()
        cgx.shutdown()
