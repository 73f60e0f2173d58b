"""Worker-side stats as Prometheus metrics (CGX_PS_WORKER_METRICS_PORT): what one step() hook
records, and a real worker process serving them while it trains against a real shard."""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from cgx_ps.worker import StepStats
from cgx_ps.worker.metrics import WorkerMetrics, after_step
from support import free_port
from workers.warm_start import run_worker

ROOT = Path(__file__).resolve().parents[1]


def samples(registry_or_text) -> dict[tuple[str, tuple], float]:
    families = (text_string_to_metric_families(registry_or_text) if isinstance(registry_or_text, str)
                else registry_or_text.collect())
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "rank"))): s.value
            for f in families for s in f.samples}


def test_a_step_is_recorded_with_tuning_decisions():
    m = WorkerMetrics(rank=3)
    auto = {"from_round": 4, "compress": False, "reason": "measuring the other mode (model predicts 12 ms/step)"}
    m.observe(StepStats(step=0, bytes_pushed=1000, fp32_bytes=7700, exposed_comm_s=0.02, compressed=True))
    m.observe(StepStats(step=1, bytes_pushed=0, fp32_bytes=0, compressed=False),
              [{"from_round": 2, "bits": {"a.weight": 3, "b.weight": 5}}, auto])
    m.observe(StepStats(step=2, bytes_pushed=2000, fp32_bytes=8000, compressed=False),
              [{"from_round": 2, "bits": {"a.weight": 3, "b.weight": 5}}, auto,
               {"from_round": 6, "compress": True, "reason": "measured"}])
    got = samples(m.registry)
    assert got[("cgx_ps_worker_steps_total", ())] == 3
    assert got[("cgx_ps_worker_bytes_pushed_total", ())] == 3000
    assert got[("cgx_ps_worker_fp32_bytes_total", ())] == 15700
    assert got[("cgx_ps_worker_compression_ratio", ())] == 4.0  # the last step that pushed
    assert got[("cgx_ps_worker_compressed", ())] == 0
    assert got[("cgx_ps_worker_step_seconds_count", ())] == 2  # between steps
    assert got[("cgx_ps_worker_exposed_comm_seconds_count", ())] == 3
    assert got[("cgx_ps_worker_tensor_bits", (("tensor", "a.weight"),))] == 3
    assert got[("cgx_ps_worker_tensor_bits", (("tensor", "b.weight"),))] == 5
    # each decision counted once; the reason label drops the figures (bounded cardinality)
    assert got[("cgx_ps_worker_auto_decisions_total", (("mode", "fp32"), ("reason", "measuring the other mode")))] == 1
    assert got[("cgx_ps_worker_auto_decisions_total", (("mode", "compress"), ("reason", "measured")))] == 1
    assert all(s.labels["rank"] == "3" for f in m.registry.collect() for s in f.samples)


def test_off_without_the_variable(monkeypatch):
    from cgx_ps.worker import metrics

    monkeypatch.setattr(metrics, "_exporter", metrics._Exporter())  # this process's exporter stays as it was
    after_step(StepStats(), env={})  # nothing to serve, nothing raised, no runtime needed
    assert metrics._exporter.metrics is None


def test_a_training_worker_serves_its_metrics(local_cluster):
    port = free_port()
    cluster = local_cluster(1, round_timeout=20)
    env = dict(os.environ, **cluster.worker_env(), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
               LOCAL_WORLD_SIZE="1", CGX_PS_JOB_ID=uuid.uuid4().hex[:8], OMP_NUM_THREADS="1",
               CGX_PS_WORKER_METRICS_PORT=str(port), CGX_PS_WORKER_METRICS_HOST="127.0.0.1")
    res = run_worker([sys.executable, str(ROOT / "tests/workers/metrics_worker.py"), "--compression",
                      "adaptive:2", "--steps", "5"], env=env, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    got = samples(res.stdout)
    assert got[("cgx_ps_worker_steps_total", ())] == 5
    pushed, fp32 = got[("cgx_ps_worker_bytes_pushed_total", ())], got[("cgx_ps_worker_fp32_bytes_total", ())]
    assert 0 < pushed < fp32 and got[("cgx_ps_worker_compression_ratio", ())] > 1.5
    bits = {labels[0][1]: v for (name, labels), v in got.items() if name == "cgx_ps_worker_tensor_bits"}
    assert set(bits) == {"0.weight", "2.weight"} and all(1 <= b <= 8 for b in bits.values()), bits


def test_non_finite_steps_are_counted() -> None:
    from cgx_ps.worker.frontends.stepstats import StepStats
    from cgx_ps.worker.metrics import WorkerMetrics

    metrics = WorkerMetrics(rank=3)
    for tensors in [(), ("fc.weight",), ("fc.weight", "fc.bias"), ()]:
        metrics.observe(StepStats(non_finite_tensors=tensors))
    assert metrics.registry.get_sample_value("cgx_ps_worker_non_finite_steps_total", {"rank": "3"}) == 2
    assert metrics.registry.get_sample_value("cgx_ps_worker_steps_total", {"rank": "3"}) == 4
