"""The worker API misused the ways users do: each gets an error naming the mistake, or the
behaviour plain PyTorch would have, never silently diverging replicas or a hang."""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path

import pytest
import torch

import cgx_ps.worker as cgx
from cgx_ps.net.security import ChannelSecurity
from cgx_ps.cli.status_table import probe_all
from cgx_ps.v1 import ps_pb2
from cgx_ps.worker import runtime
from cgx_ps.worker.pipeline.blocks import Compression, TensorInfo, build_layout
from prometheus_client.parser import text_string_to_metric_families
from support import env_for, free_port
from workers.warm_start import run_worker

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


CLUSTER_SETTINGS = dict(shards=2, round_timeout=5)  # the tests' shared shards (conftest.cluster)


def run(cluster, scenario: str, servers: list[str] | None = None, **env_vars: str) -> dict:
    env = env_for(0, 1, servers or cluster.addresses, CGX_PS_JOB_ID=uuid.uuid4().hex[:8], CGX_PS_CONNECT_TIMEOUT="10",
                  **env_vars)
    res = run_worker([sys.executable, str(ROOT / "tests/workers/misuse_worker.py"), scenario], env=env,
                     capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("scenario, error", [
    ("unnamed", "ConfigError: the optimizer holds 1 trainable tensor(s) not in named_parameters"),
    # a group added after wrapping once trained apart on each rank, silently
    ("added_later", "ConfigError: add_param_group after wrapping: 2 trainable tensor(s) that the DistributedOptimizer "
                    "does not synchronize"),
    ("added_frozen_then_thawed", "CgxPsError: 2 tensor(s) were frozen (requires_grad=False) when the "
                                 "DistributedOptimizer was created"),
    ("thawed", "CgxPsError: 1 tensor(s) were frozen (requires_grad=False) when the DistributedOptimizer was created"),
    ("extra_pass", "gradient computed 2 times before step(), but backward_passes_per_step=1"),
    ("nan", "CgxPsError: rank 0: cannot encode the gradient of"),
    ("after_shutdown", "CgxPsError: cgx_ps.worker.shutdown() has closed the connection to the shards"),
    ("skip_unsynchronized", "CgxPsError: step() inside skip_synchronize() needs synchronize() first"),
    ("second_optimizer", "ConfigError: one DistributedOptimizer per process"),
    ("catch_up_twice", "ConfigError: cgx.catch_up_with was already called for this DistributedOptimizer"),
    ("catch_up_with_hook_state", "ConfigError: cgx.catch_up_with: a DistributedOptimizer catches up by itself"),
])
def test_misuse_is_named(cluster, scenario, error):
    out = run(cluster, scenario)
    assert error in out.get("error", ""), out
    assert out["cgx_ps_error"] is True  # one except clause catches every misuse
    if scenario == "nan":
        assert "NaN/Inf" in out["error"] and ("0.weight" in out["error"] or "2.weight" in out["error"]), out


def test_a_nan_without_a_scaler_travels_by_default_and_is_counted_and_said_once(cluster):
    """allow_non_finite is on by default (as DDP's and Horovod's allreduce): a NaN gradient travels
    to every rank as NaN, where a GradScaler would skip the step. Without a scaler, step() applies
    nothing and says why on every rank alike (the same average), naming this rank's tensors; the log
    says so once a minute at most, however many steps are non-finite; training goes on after."""
    out = run(cluster, "nan_by_default", CGX_PS_WORKER_METRICS_PORT=str(free_port()),
              CGX_PS_WORKER_METRICS_HOST="127.0.0.1")
    tensors, errors = out["non_finite_tensors"], out["errors"]
    assert tensors[0] == tensors[3] == [] and errors[0] == errors[3] == "", out
    for step in (1, 2):
        assert {"0.weight", "2.weight"} <= set(tensors[step]), out
        assert "averaged gradient was not finite" in errors[step] and "0.weight" in errors[step], out
        assert "GradScaler" in errors[step], out
    lines = [line for line in out["said"] if "was not finite" in line]
    assert len(lines) == 1 and "0.weight" in lines[0] and "step 1" in lines[0], out
    assert out["weight_finite"] is True  # the non-finite steps were not applied
    counted = {s.name: s.value for f in text_string_to_metric_families(out["metrics"]) for s in f.samples}
    assert counted["cgx_ps_worker_non_finite_steps_total"] == 2 and counted["cgx_ps_worker_steps_total"] == 4, counted


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))


def _optimizer(**kw):
    model = _model()
    kw.setdefault("named_parameters", model.named_parameters())
    return cgx.DistributedOptimizer(kw.pop("optimizer", None) or torch.optim.SGD(model.parameters(), lr=0.1), **kw)


def _twice(name: str):
    model = _model()
    return cgx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                    [*model.named_parameters(), (name, model[0].weight)])


def _foreign():
    model = _model()
    return cgx.DistributedOptimizer(torch.optim.SGD(model[0].parameters(), lr=0.1), model.named_parameters())


MISUSE = [  # (what the user did, the call, a piece of the message)
    ("unknown compression", lambda: _optimizer(compression="5bits"), "unknown compression '5bits'"),
    ("compression not a string", lambda: _optimizer(compression=4), "compression must be a string"),
    ("bits out of range", lambda: Compression(bits=9), "bits must be in 1..8"),
    ("bits not a number", lambda: Compression(overrides={"0.*": "4"}), "bits must be in 1..8"),
    ("bucket not a multiple of 8", lambda: Compression(bucket_size=12), "bucket_size must be a multiple of 8"),
    ("bucket too large", lambda: Compression(bucket_size=1 << 25), "bucket_size must be a multiple of 8"),
    ("bad fallback codec", lambda: Compression(bits=None, fallback=7), "fallback must be FP32"),
    ("adaptive every 0 steps", lambda: _optimizer(compression="adaptive:0"), "unknown compression"),
    ("not an optimizer", lambda: cgx.DistributedOptimizer(_model()), "wraps a torch.optim.Optimizer"),
    ("parameters without names", lambda: _optimizer(named_parameters=_model().parameters()),
     "named_parameters must give (name, tensor) pairs"),
    ("zero backward passes", lambda: _optimizer(backward_passes_per_step=0), "backward_passes_per_step must be"),
    ("negative warm-up", lambda: _optimizer(warmup_steps=-1), "warmup_steps must be"),
    ("empty blocks", lambda: _optimizer(block_bytes=0), "block_bytes must be"),
    ("one name twice", lambda: _twice("0.weight"), "duplicate names"),
    ("one tensor twice", lambda: _twice("tied"), "names one tensor twice"),
    ("tensors the optimizer does not hold", _foreign, "holds tensors the optimizer does not"),
    ("a layout with no shard", lambda: build_layout([TensorInfo("w", (4, 4))], 0), "at least one shard"),
    ("a layout with a negative shape", lambda: build_layout([TensorInfo("w", (4, -4))], 1), "no usable layout"),
    ("broadcast before the optimizer", lambda: cgx.broadcast_parameters(_model().state_dict()),
     "create the DistributedOptimizer before broadcasting"),
    ("no shards configured", lambda: cgx.init(cgx.WorkerConfig.from_env({})), "set CGX_PS_SERVERS"),
    ("timeout not a number", lambda: cgx.WorkerConfig.from_env({"CGX_PS_SERVERS": "a:1",
                                                                "CGX_PS_CONNECT_TIMEOUT": "soon"}),
     "CGX_PS_CONNECT_TIMEOUT='soon': must be a number of seconds"),
]


@pytest.mark.parametrize("what, call, message", MISUSE, ids=[m[0] for m in MISUSE])
def test_public_api_misuse_raises_cgx_ps_errors(monkeypatch, what, call, message):
    """Misuse caught before any shard is contacted (the shard address here is never dialled):
    a CgxPsError naming the mistake; configuration errors stay ValueErrors too."""
    monkeypatch.setattr(runtime, "_config", None)
    cgx.init(cgx.WorkerConfig(servers=("127.0.0.1:9",), connect_timeout_s=0.1))
    with pytest.raises(cgx.CgxPsError, match=message.replace("(", r"\(").replace(")", r"\)")) as info:
        call()
    if isinstance(info.value, cgx.ConfigError):
        assert isinstance(info.value, ValueError)


def test_calls_before_init_are_named(monkeypatch):
    monkeypatch.setattr(runtime, "_config", None)
    for call in (cgx.rank, cgx.size, _optimizer):
        with pytest.raises(cgx.ConfigError, match=r"call cgx_ps.worker.init\(\) first"):
            call()


def test_a_parameter_frozen_after_wrapping_stays_put_as_in_plain_torch(cluster):
    out = run(cluster, "frozen_after")
    assert "error" not in out, out
    assert out["after"] == out["before"]  # weight decay must not touch a frozen tensor


def test_shards_listed_out_of_order_are_named(cluster):
    out = run(cluster, "frozen_after", servers=list(reversed(cluster.addresses)))
    assert "list the shards in index order" in out.get("error", ""), out
    assert "CGX_PS_SERVERS[0]=" in out["error"] and "is shard 1 of 2" in out["error"], out


@pytest.mark.parametrize("order", [(1, 0), (0, 0)], ids=["reversed", "one shard twice"])
def test_a_worker_refused_for_the_shards_order_leaves_no_session_behind(order, local_cluster):
    """Refused only after registering, the worker once left an idle session on
    every shard it reached (shown by `cgx-ps status`; a restart with another node count or layout
    under the same job id was then refused). The order is checked before anything registers."""
    fresh = local_cluster(2)
    out = run(fresh, "frozen_after", servers=[fresh.addresses[i] for i in order])
    assert "list the shards in index order" in out.get("error", ""), out
    states = [r.status.session_state for r in probe_all(fresh.addresses, ChannelSecurity(token_file=fresh.token_file))]
    assert states == [ps_pb2.SESSION_STATE_NONE] * 2, states
    out = run(fresh, "frozen_after")  # the corrected start trains at once
    assert "error" not in out and out["after"] == out["before"], out
