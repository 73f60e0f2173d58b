"""Adaptive bits and auto mode with real shards and worker processes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.request
import uuid
from pathlib import Path

import pytest
import torch

from cgx_ps.server import LocalCluster
from cgx_ps.v1 import ps_pb2
from cgx_ps.worker.autotune import Decision
from cgx_ps.worker.automode import REEXPLORE, AutoFigures, ModeChooser
from cgx_ps.worker.blobformat import decode_object, encode_object
from cgx_ps.worker.layout import Compression

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _env(rank: int, world: int, servers: list[str], job: str) -> dict[str, str]:
    return dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                CGX_PS_NODE_RANK=str(rank), CGX_PS_NUM_NODES=str(world), CGX_PS_SERVERS=",".join(servers),
                CGX_PS_JOB_ID=job, OMP_NUM_THREADS="1", CGX_PS_CONNECT_TIMEOUT="20")


def test_compression_parse_modes():
    assert Compression.parse("adaptive") == Compression(adaptive=True)
    assert Compression.parse("auto:7") == Compression(auto=True, interval=7)
    with pytest.raises(ValueError, match="adaptive or auto"):
        Compression.parse("adaptive:x")


def test_adaptive_bits_change_on_the_same_round_everywhere(tmp_path):
    job = uuid.uuid4().hex[:8]
    with LocalCluster(2, metrics_base_port=0, extra_args=["--round-timeout", "20", "--log-level", "WARNING"]) as c:
        outs = [tmp_path / f"{r}.pt" for r in range(2)]
        procs = [subprocess.Popen([sys.executable, str(ROOT / "tests/workers/step_worker.py"), "--compression",
                                   "adaptive:2", "--steps", "6", "--hidden", "512", "--out", str(outs[r])],
                                  env=_env(r, 2, c.addresses, job), stderr=subprocess.PIPE, text=True)
                 for r in range(2)]
        errs = [p.communicate(timeout=240)[1] for p in procs]
        assert all(p.returncode == 0 for p in procs), errs[0][-2000:] + errs[1][-2000:]
        metrics = "".join(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
                          for port in c.metrics_ports)
    saved = [torch.load(o, weights_only=False) for o in outs]
    for name in saved[0]["final"]:  # replicas stay bit-identical across the changes
        assert torch.equal(saved[0]["final"][name], saved[1]["final"][name]), name
    history = saved[0]["tuning"]
    assert history == saved[1]["tuning"]  # every rank applied the same decisions
    assert [d["from_round"] for d in history] == [2, 4, 6]
    bits = history[0]["bits"]
    layout = ps_pb2.Layout.FromString(saved[0]["layout"])
    compressed = {t.name for t in layout.tensors if t.codec.codec == ps_pb2.CODEC_MAXMIN}
    assert set(bits) == compressed
    # the small layer with 10x larger gradients gets more bits, the big one fewer: fewer bytes
    # than uniform 4 bits at no more error
    assert bits["2.weight"] > 4 > bits["0.weight"], bits
    assert "rejected" not in metrics  # no push was refused around the changes
    assert 'cgx_ps_block_bits{block="0",shard="' in metrics or 'cgx_ps_block_bits{block="' in metrics


def _run_auto(model: str, servers: list[str], spawn=None, steps: int = 3, interval: int = 2) -> dict:
    job = uuid.uuid4().hex[:8]
    argv = [sys.executable, str(ROOT / "tests/workers/auto_worker.py"), "--model", model, "--steps", str(steps),
            "--interval", str(interval)]
    env = _env(0, 1, servers, job)
    proc = spawn(argv, env) if spawn else subprocess.Popen(argv, env=env, stdout=subprocess.PIPE,
                                                            stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def test_auto_mode_skips_compression_when_communication_hides_behind_compute():
    """The model says no compression; auto then measures compressed steps for one interval and
    goes back, since they are not faster on loopback."""
    with LocalCluster(1, extra_args=["--log-level", "WARNING"]) as c:
        result = _run_auto("conv", c.addresses, steps=13, interval=3)
    decisions = result["decisions"]
    first = decisions[0]
    f = first["figures"]
    assert first["compress"] is False and first["reason"] == "model", f
    assert f["throughput_bps"] > 50e6 and f["overlap_s"] > 0  # loopback, real backward
    explored = [d for d in decisions if d["reason"].startswith("measuring the other mode")]
    assert explored and explored[0]["compress"] is True, decisions
    later = decisions[decisions.index(explored[0]) + 1:]
    assert later and later[0]["reason"] == "measured", decisions
    assert set(later[0]["measured"]) == {"compressed", "uncompressed"}
    assert all(t > 0 for t in later[0]["measured"].values())
    m = later[0]["measured"]  # uncompressed was in use: compression must win by 5% to take over
    assert later[0]["compress"] is (m["compressed"] < 0.95 * m["uncompressed"]), decisions
    assert result["compressed"] is decisions[-1]["compress"]


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"),
                    reason="needs root and iproute2 for network namespaces")
def test_auto_mode_compresses_on_a_throttled_link():
    from benchmarks import netcluster

    with netcluster.Cluster(hosts=2, rate="100mbit") as cluster:
        shard = cluster.spawn(1, [sys.executable, "-m", "cgx_ps.cli", "server", "--host", cluster.address(1),
                                  "--port", "7070", "--metrics-port", "-1", "--log-level", "WARNING"])
        try:
            result = _run_auto("mlp", [f"{cluster.address(1)}:7070"], steps=6,
                               spawn=lambda argv, env: cluster.spawn(0, argv, env, stdout=subprocess.PIPE,
                                                                     stderr=subprocess.PIPE, text=True))
        finally:
            shard.terminate()
            shard.wait(timeout=30)
    first = result["decisions"][0]
    f = first["figures"]
    assert first["compress"] is True, f
    assert f["throughput_bps"] < 15e6  # the 100 Mbit/s link was measured, not loopback
    # uncompressed steps are predicted far slower: auto does not spend an interval measuring them
    assert not any(d["reason"].startswith("measuring") for d in result["decisions"]), result["decisions"]
    assert all(d["compress"] for d in result["decisions"])
    assert result["compressed"] is True


class _Figures:
    def exposed(self, compress: bool) -> float:
        return 0.0  # the model calls both modes equal: every exploration is plausible


@pytest.mark.parametrize("incumbent, ratio, expected", [
    (False, 0.97, False),  # compression 3% faster: not enough to start compressing
    (False, 0.90, True),   # 10% faster: compress
    (True, 0.97, True),    # already compressing and still faster: keep it
    (True, 1.02, False),   # compressed steps got slower: stop
])
def test_auto_decides_from_measured_steps_with_a_margin_to_start_compressing(incumbent, ratio, expected):
    modes = ModeChooser()
    assert modes.choose(incumbent, _Figures()) == (False, "model")  # the first choice is the model's
    base = 0.100
    for _ in range(3):
        modes.record(base * (ratio if incumbent else 1.0))
    compress, reason = modes.choose(incumbent, _Figures())  # measures the incumbent, then tries the other mode
    assert compress is (not incumbent) and reason.startswith("measuring the other mode")
    for _ in range(3):
        modes.record(base * (1.0 if incumbent else ratio))
    compress, reason = modes.choose(compress, _Figures())
    assert (compress, reason) == (expected, "measured"), modes.measured
    assert modes.medians() == {"compressed": base * ratio, "uncompressed": base}


class _Hopeless:
    """The model's view at 10 Gbit/s through gRPC: uncompressed steps look far slower than they are."""

    def exposed(self, compress: bool) -> float:
        return 0.150 if compress else 2.0


@pytest.mark.parametrize("uncompressed_s, expected", [(0.070, False), (0.200, True), (0.110, True)])
def test_auto_measures_an_uncompressed_path_the_model_cannot_see_once(uncompressed_s, expected):
    # through the shards, the model rules uncompressed steps out and they are never tried
    shards = ModeChooser()
    assert shards.choose(True, _Hopeless()) == (True, "model")
    shards.record(0.100)
    assert shards.choose(True, _Hopeless())[1].startswith("model rules the other mode out")
    # through a collective (the DDP hook's allreduce) the model cannot tell: measure once
    modes = ModeChooser(model_sees_uncompressed=False)
    assert modes.choose(True, _Hopeless()) == (True, "model")
    modes.record(0.100)
    compress, reason = modes.choose(True, _Hopeless())
    assert compress is False and "cannot predict" in reason, reason
    modes.record(uncompressed_s)
    assert modes.choose(False, _Hopeless()) == (expected, "measured"), modes.measured
    # later, the other mode is tried again only if its last measurement was within reach,
    # whatever the model says
    current = expected
    tried = []
    for _ in range(2 * REEXPLORE):
        modes.record(0.100 if current else uncompressed_s)
        new, reason = modes.choose(current, _Hopeless())
        tried.append(reason.startswith("measuring the other mode"))
        if new != current:
            modes.record(0.100 if new else uncompressed_s)
            back, _ = modes.choose(new, _Hopeless())
            assert back == current, (new, back, modes.measured)
        current = expected
    far_apart = max(0.100, uncompressed_s) > 1.25 * min(0.100, uncompressed_s)
    assert any(tried) is not far_apart, tried


def test_decisions_travel_as_plain_data():
    figures = AutoFigures(1e8, 1.2e8, 1e8, 4 << 20, 1 << 19, 0.01, 0.05)
    auto = Decision(12, compress=True, reason="measured", figures=figures, measured={"compressed": 0.1})
    both = Decision(3, bits={"w": 3}, compress=False, reason="model", figures=figures)
    for d in (auto, both, Decision(4, bits={}), Decision(5)):
        assert Decision.from_dict(decode_object(encode_object(d.as_dict()))) == d  # the broadcast's format
    assert Decision(4).as_dict() == {"from_round": 4}  # a mode that did not decide leaves no trace
    assert set(auto.as_dict()) == {"from_round", "compress", "reason", "figures", "measured"}
