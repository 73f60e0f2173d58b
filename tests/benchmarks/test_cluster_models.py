"""The cluster benchmark's shaped models (benchmarks/cluster_models.py, cluster.py --models resnet50 ...):
the options, what --scale does to the links, DDP's buckets and cgx-ps's blocks, the flags each job gets,
and the report's table for a scaled model. No network namespaces: the job runners are replaced by
recorders, and the report is drawn from rows in the shape cluster.py writes."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import cluster, jobs
from benchmarks.cluster_models import DDP_BUCKET_MB, ModelRun, describe, model_label
from benchmarks.cluster_report import markdown
from benchmarks.cluster_rows import add_link_figures
from benchmarks.cluster_stats import groups
from benchmarks.ddp_step import parse_args as ddp_args
from benchmarks.emulator import parse_rate

ROOT = Path(__file__).resolve().parents[2]


def test_help_lists_the_shaped_models_and_their_options():
    r = subprocess.run([sys.executable, "benchmarks/cluster.py", "--help"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    for word in ("resnet50", "bert-base", "gpt2", "vit-b16", "--scale", "--compute-ms"):
        assert word in r.stdout


@pytest.mark.parametrize("bad", [["--scale", "0"], ["--scale", "2"], ["--compute-ms", "-5"],
                                 ["--compute-ms", "nan"], ["--models", "resnet18"]])
def test_usage_errors(bad, capsys):
    with pytest.raises(SystemExit) as e:
        cluster.parse_args(bad)
    assert e.value.code == 2
    assert bad[0] in capsys.readouterr().err


def test_scale_shrinks_links_buckets_and_blocks_of_shaped_models_only():
    args = cluster.parse_args(["--models", "resnet50", "mlp17m", "--scale", "0.05", "--compute-ms", "300"])
    resnet, mlp = ModelRun.of("resnet50", args), ModelRun.of("mlp17m", args)
    assert resnet == ModelRun("resnet50", 0.05, 300.0) and mlp == ModelRun("mlp17m")
    assert parse_rate(resnet.link_rate("1gbit")) == 50_000_000 and mlp.link_rate("1gbit") == "1gbit"
    step = ["--scale", "0.05", "--compute-ms", "300.0"]
    assert resnet.step_args() == step and mlp.step_args() == []
    bucket = ["--bucket-cap-mb", repr(DDP_BUCKET_MB * 0.05)]
    assert resnet.ddp_args("none") == resnet.ddp_args("fp16") == step + bucket
    assert resnet.ddp_args("powersgd") == step  # its single bucket avoids the hook's deadlock
    assert resnet.cgx_args("optimizer", None) == ["--block-mb", repr(4.0 * 0.05), *step]
    assert resnet.cgx_args("ddp-hook", 8.0) == ["--block-mb", repr(8.0 * 0.05), *step, *bucket]
    assert mlp.cgx_args("optimizer", None) == [] and mlp.cgx_args("optimizer", 2.0) == ["--block-mb", "2.0"]
    # every flag is one the step scripts take
    parsed = ddp_args(["--model", "resnet50", *resnet.ddp_args("none")])
    assert (parsed.scale, parsed.compute_ms, parsed.bucket_cap_mb) == (0.05, 300.0, DDP_BUCKET_MB * 0.05)


def test_every_job_of_a_group_gets_the_models_flags(monkeypatch):
    """run_group with the job runners recorded: the cluster's links at the scaled rate, the model's
    flags on every job (the single-process ones too), and the rows' figures against the scaled rate."""
    calls: list[tuple[str, dict]] = []

    class FakeCluster:
        def __init__(self, config):
            calls.append(("cluster", {"rate": config.rate}))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    def job(kind):
        def run(cluster, **kw):
            calls.append((kind, kw))
            result = {"median_step_s": 0.7, "step_times_s": [0.7], "eval_loss": 2.0, "single_process_compute_s": 0.6,
                      "tx_bytes_per_step": 5e6, "rx_bytes_per_step": 5e6}
            return jobs.JobResult(kind, [result, result] if kind != "single" else [result], [0, 0], False, 1.0)
        return run

    monkeypatch.setattr(cluster.nc, "Cluster", FakeCluster)
    monkeypatch.setattr(cluster.nc, "run_ddp", job("ddp"))
    monkeypatch.setattr(cluster.nc, "run_cgx", job("cgx"))
    monkeypatch.setattr(cluster.nc, "run_single_process", job("single"))
    args = cluster.parse_args(["--models", "gpt2", "--scale", "0.1", "--configs", "ddp-fp32", "ddp-powersgd",
                               "cgx-4bit", "ddp-cgx-4bit"])
    rows = cluster.run_group("gpt2", "1gbit", "colocated", args)
    assert calls[0] == ("cluster", {"rate": "100000000bit"})
    by_kind = [(kind, kw.get("extra_args"), kw.get("front_end")) for kind, kw in calls[1:]]
    step = ["--scale", "0.1"]
    bucket = ["--bucket-cap-mb", repr(2.5)]
    blocks = ["--block-mb", repr(0.4)]
    assert by_kind == [("single", step, None), ("ddp", step + bucket, None), ("ddp", step, None),
                       ("cgx", blocks + step, "optimizer"), ("cgx", blocks + step + bucket, "ddp-hook"),
                       ("single", step, None)]
    ddp = next(r for r in rows if r["config"] == "ddp-fp32")
    assert ddp["model"] == "gpt2" and ddp["scale"] == 0.1 and ddp["rate"] == "1gbit"
    # 5 MB on the busiest direction at the emulated 100 Mbit/s: 0.4 s, the full-size figure
    assert ddp["ideal_s"] == pytest.approx(5e6 * 8 / 100e6)
    assert ddp["comm_s"] == pytest.approx(0.1)


def _row(config: str, label: str, step: float, **extra) -> dict:
    return {"run": 1, "model": "resnet50", "scale": 0.05, "compute_ms": None, "rate": "1gbit",
            "topology": "colocated", "workers": 2, "shards": 2, "batch_size": 64, "threads": 1, "steps": 10,
            "warmup": 3, "auto_interval": 5, "config": config, "label": label, "status": "ok", "step_s": step,
            "compute_s": 0.62, "compute_cpu_s": 0.05, "eval_loss": 1.9, **extra}


def test_the_report_says_what_a_scaled_run_stands_for():
    rows = [_row("single", "single process (start)", 0.62), _row("single", "single process (end)", 0.63),
            _row("ddp-fp32", "DDP gloo fp32", 1.4, link_bytes=5.2e6, tx_bytes=5.2e6, rx_bytes=5.2e6),
            _row("cgx-4bit", "cgx-ps 4-bit", 0.8, link_bytes=0.8e6, tx_bytes=0.8e6, rx_bytes=0.8e6,
                 host_cpu_s_per_step=0.30)]
    for r in rows:
        add_link_figures(r, parse_rate(ModelRun("resnet50", 0.05).link_rate("1gbit")), "colocated")
    text = markdown(rows, argparse.Namespace())
    assert "### resnet50 x0.05, 1gbit links" in text
    assert "161 tensors, 1.28M of 25.56M parameters" in text and "emulated at 50mbit" in text
    assert "619 ms/step (published RTX 3090 step time)" in text
    # the ideal is the measured bytes at the emulated rate: 5.2 MB at 50 Mbit/s
    assert "| DDP gloo fp32 | 1.400 |" in text and "| 0.832 |" in text
    # the compute is slept: its CPU is no yardstick for the communication's (0.30 s vs 0.05 s would fail it)
    assert "CPU per step per host" not in text and "does not apply" in text
    # a full-size run of the same model is another table
    full = [{**r, "scale": 1.0} for r in rows]
    assert len(groups(rows + full)) == 2 and model_label(full[0]) == "resnet50"
    assert "full size" in describe(full[0]) and describe({"model": "mlp17m"}) == ""
