"""cgx-ps plan and the performance model behind it (cgx_ps/planning): the command as a user runs it, the real
models' shapes, the model's formulas and monotonicity, and its predictions against measured cells of
BENCHMARKS.md."""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import replace

import pytest

from cgx_ps.planning import Cluster, Speeds, Tensor, Workload, predict, predict_all, shards_needed, workload
from cgx_ps.planning.command import parse_rate
from cgx_ps.planning.model import OPTIONS, compressed_bytes, pipeline_finish, ring_seconds, uncompressed
from cgx_ps.planning.shapes import backward_split, resnet50_tensors, sized_workload

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def plan(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cgx_ps.cli", "plan", *args], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=120)


# --- the command -------------------------------------------------------------------------------------------

def test_plan_prints_every_option_and_a_recommendation():
    out = plan("--model", "resnet50", "--nodes", "8", "--link", "1gbit")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("resnet50: 25,557,032 parameters in 161 tensors")
    for option in OPTIONS:
        assert any(line.startswith(option + " ") for line in lines), option
    assert any(line.startswith("shards: ") for line in lines)
    recommended = [line for line in lines if line.startswith("recommended: ")]
    assert len(recommended) == 1 and recommended[0].split()[1].startswith("cgx-")  # 1 Gbit/s: compression pays


def test_plan_json_lists_options_with_name_compression_and_step():
    out = plan("--params", "17000000", "--compute-ms", "100", "--nodes", "2", "--link", "10Gbit/s", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert [o["name"] for o in doc["options"]] == list(OPTIONS)
    assert [o["compression"] for o in doc["options"]] == ["fp32", "fp16", "powersgd-r4", "8bit", "4bit", "2bit"]
    assert all(o["step_s"] >= 0.1 for o in doc["options"])  # never below the compute alone
    assert doc["params"] == 17_000_000 and doc["link_bps"] == 1e10
    assert doc["recommended"] in OPTIONS and 1 <= doc["shards_needed"] <= 2


def test_plan_takes_a_model_from_module_function(tmp_path):
    (tmp_path / "mymodels.py").write_text(textwrap.dedent("""
        import torch
        def wide():
            return torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.Linear(2048, 10))
    """))
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    out = plan("--model", "mymodels:wide", "--compute-ms", "50", "--nodes", "4", "--link", "1e9", "--json", env=env)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["params"] == 1024 * 2048 + 2048 + 2048 * 10 + 10
    no_compute = plan("--model", "mymodels:wide", "--nodes", "4", "--link", "1gbit", env=env)
    assert no_compute.returncode == 2 and "--compute-ms" in no_compute.stderr


@pytest.mark.parametrize("args, says", [
    (["--model", "resnet51", "--nodes", "4", "--link", "1gbit"], "unknown model"),
    (["--model", "no_such_module:f", "--nodes", "4", "--link", "1gbit"], "cannot load model"),
    (["--model", "resnet50", "--nodes", "0", "--link", "1gbit"], "--nodes"),
    (["--model", "resnet50", "--nodes", "four", "--link", "1gbit"], "--nodes"),
    (["--model", "resnet50", "--nodes", "4", "--link", "fast"], "link rate"),
    (["--model", "resnet50", "--nodes", "4", "--link", "0gbit"], "link rate"),
    (["--model", "resnet50", "--nodes", "4"], "--link"),
    (["--params", "1000", "--nodes", "4", "--link", "1gbit"], "--compute-ms"),
    (["--model", "resnet50", "--nodes", "4", "--link", "1gbit", "--compute-ms", "-5"], "--compute-ms"),
])
def test_bad_input_is_one_line_and_exit_2(args, says):
    out = plan(*args)
    assert out.returncode == 2
    assert out.stdout == ""
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert says in out.stderr


def test_help_and_a_size_only_plan_import_no_torch():
    code = ("import sys, io, contextlib\nfrom cgx_ps.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    try:\n        main(['--help'])\n    except SystemExit:\n        pass\n"
            "    main(['plan', '--params', '1000000', '--compute-ms', '10', '--nodes', '2', '--link', '1gbit'])\n"
            "print('torch' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.stdout.split() == ["False", "False"], out.stderr


@pytest.mark.parametrize("text, bps", [("100mbit", 1e8), ("1gbit", 1e9), ("10Gbit/s", 1e10), ("1e9", 1e9),
                                       ("25gbps", 2.5e10), ("2.5 Gbit", 2.5e9), ("400k", 4e5)])
def test_parse_rate(text, bps):
    assert parse_rate(text) == pytest.approx(bps)


# --- the models' shapes --------------------------------------------------------------------------------------

def test_resnet50_is_torchvisions():
    tensors = resnet50_tensors()
    assert sum(t.numel for t in tensors) == 25_557_032 and len(tensors) == 161
    assert (tensors[0].name, tensors[0].shape) == ("conv1.weight", (64, 3, 7, 7))
    assert (tensors[-2].name, tensors[-2].shape) == ("fc.weight", (1000, 2048))
    assert ("layer2.0.downsample.0.weight", (512, 256, 1, 1)) in [(t.name, t.shape) for t in tensors]
    # 4.09 G multiply-adds per 224x224 image (the figure torchvision's model card gives)
    assert sum(t.compute for t in tensors) / 2 == pytest.approx(4.09e9, rel=0.01)
    job = workload("resnet50")
    assert job.tensors[0].name == "fc.bias" and job.tensors[-1].name == "conv1.weight"  # backward order
    split = dict(backward_split(job))
    assert sum(split.values()) == pytest.approx(job.compute_s * job.overlap)
    # by FLOPs: the stem's 118 M multiply-adds outweigh the 2 M of the classifier with 17x its parameters
    assert split["conv1.weight"] > 10 * split["fc.weight"] and split["bn1.weight"] == 0.0


@pytest.mark.parametrize("model, params, tensors", [("bert-base", 109_482_240, 199), ("gpt2", 124_439_808, 148),
                                                    ("vit-b16", 86_567_656, 200)])
def test_transformer_shapes_from_their_configs(model, params, tensors):
    pytest.importorskip("transformers")
    job = workload(model)
    assert (job.params, len(job.tensors)) == (params, tensors)
    assert job.compute_s > 0.3  # a published RTX 3090 step, not zero


def test_uncompressed_follows_the_workers_layout():
    from cgx_ps.kernels.wire import Codec, body_size
    from cgx_ps.v1 import ps_pb2
    from cgx_ps.worker import Compression

    rule = Compression()
    for t in resnet50_tensors() + [Tensor("tiny", (4, 255)), Tensor("edge", (8, 128))]:
        plain = rule.settings_for(t.name, t.shape).codec != ps_pb2.CODEC_MAXMIN
        assert uncompressed(t.shape) == plain, t
    for numel in (1, 1000, 1024, 1 << 20, 3_000_001):
        for bits in (2, 4, 8):
            assert compressed_bytes(numel, bits) == body_size(Codec.MAXMIN, numel, bits, 1024)


# --- the model -----------------------------------------------------------------------------------------------

def test_formulas():
    cluster = Cluster(4, 8e9, wire_efficiency=1.0, latency_s=0.0)  # 1 GB/s of payload
    assert ring_seconds(1e9, 4, cluster) == pytest.approx(1.5)  # 2 (n - 1) / n * M / B
    # two items through a 1 s stage then a 2 s stage: the second waits for the first at each
    end, busy = pipeline_finish([0.0, 0.0], [[("a", 1.0), ("b", 2.0)], [("a", 1.0), ("b", 2.0)]])
    assert end == 5.0 and busy == {"a": 2.0, "b": 4.0}
    job = Workload("one matrix", (Tensor("w", (4096, 4096)),), compute_s=1.0, overlap=0.0)
    p = predict(job, cluster, Speeds(), "ddp-fp32")
    assert p.exposed_comm_s == pytest.approx(1.5 * 4 * 4096 * 4096 / 1e9, rel=1e-6)
    dedicated = predict(job, replace(cluster, shards=2), Speeds(), "cgx-4bit")
    pushed = 16 * (compressed_bytes(1 << 20, 4) + 32)  # 16 blocks of 1 Mi elements, each with its header
    assert dedicated.bytes_per_host == pytest.approx(4 * pushed / 2)  # n c M / S on each shard's link
    colocated = predict(job, cluster, Speeds(), "cgx-4bit")
    assert colocated.bytes_per_host == pytest.approx(2 * pushed * 3 / 4)  # 2 c M (n - 1) / n


MODELS = [resnet50_tensors, lambda: [Tensor(f"l{i}", (2048, 2048)) for i in range(12)]]


@pytest.mark.parametrize("make", MODELS)
@pytest.mark.parametrize("nodes", [2, 8, 64])
def test_more_bandwidth_is_never_slower(make, nodes):
    job = Workload("m", tuple(reversed(make())), compute_s=0.2)
    for option in OPTIONS:
        for shards in (None, 1, nodes):
            steps = [predict(job, Cluster(nodes, rate, shards=shards), Speeds(), option).step_s
                     for rate in (1e8, 1e9, 2.5e9, 1e10, 1e11)]
            assert steps == sorted(steps, reverse=True), (option, shards, steps)


@pytest.mark.parametrize("nodes, rate", [(4, 1e9), (16, 1e8), (32, 1e10)])
def test_more_dedicated_shards_are_never_slower(nodes, rate):
    job = Workload("m", tuple(reversed(resnet50_tensors())), compute_s=0.1)
    for option in ("cgx-8bit", "cgx-4bit", "cgx-2bit"):
        steps = [predict(job, Cluster(nodes, rate, shards=s), Speeds(), option).step_s for s in range(1, 2 * nodes)]
        assert all(a >= b - 1e-12 for a, b in zip(steps, steps[1:])), (option, steps)
    needed = shards_needed(job, Cluster(nodes, rate), Speeds())
    assert 1 <= needed <= nodes


def test_a_model_given_by_size():
    job = sized_workload(25_000_123, 0.3)
    assert job.params == 25_000_123 and job.compute_s == 0.3
    rows = predict_all(job, Cluster(8, 1e9), Speeds())
    assert all(r.step_s >= 0.3 for r in rows)
    assert {r.name: r for r in rows}["cgx-4bit"].step_s < {r.name: r for r in rows}["ddp-fp32"].step_s


def test_an_explicit_ddp_bucket_cap_and_block_size_are_the_workloads():
    job = Workload("w", tuple(Tensor(f"t{i}", (1024, 1024)) for i in range(8)), 0.3)  # 8 x 4 MiB of fp32
    cluster = Cluster(4, 1e9)
    default, one_bucket = (predict(j, cluster, Speeds(), "ddp-fp32")
                           for j in (job, replace(job, ddp_bucket_bytes=1 << 30)))
    # the same bytes, all of them sent after backward: nothing of it hidden
    assert one_bucket.link_s == pytest.approx(default.link_s) and one_bucket.step_s > default.step_s
    assert one_bucket.exposed_comm_s > one_bucket.link_s
    small_blocks = predict(replace(job, block_bytes=1 << 20), cluster, Speeds(), "cgx-4bit")
    assert small_blocks.bytes_per_host > predict(job, cluster, Speeds(), "cgx-4bit").bytes_per_host  # more headers
    for bad in (dict(block_bytes=0), dict(ddp_bucket_bytes=0)):
        with pytest.raises(ValueError, match="positive bucket and block sizes"):
            replace(job, **bad)


def test_calibration_measures_this_machine():
    from cgx_ps.planning.calibrate import measure

    speeds = measure()
    for value in (speeds.encode_eps, speeds.decode_eps, speeds.shard_ingest_Bps, speeds.net_cpu_Bps):
        assert math.isfinite(value) and value > 1e7  # at least 10 M elements or bytes per CPU-second
    assert speeds.codec_threads >= 1 and speeds.cast_eps == Speeds().cast_eps  # the device's stay defaults


# --- against measured cells ----------------------------------------------------------------------------------

# mlp17m, emulated hosts on the project's 2-core machine (benchmarks/plan_chart.py has all 25 cells): (BENCHMARKS.md
# "section: run", hosts, link, compute alone of that run (s), option, measured median step (s))
MEASURED = [
    ("Commodity cluster: faster host", 2, 1e9, 0.100, "ddp-fp32", 0.685),  # 1 Gbit/s, idle
    ("Commodity cluster: faster host", 2, 1e9, 0.100, "ddp-fp16", 0.420),
    ("Commodity cluster: faster host", 2, 1e9, 0.100, "cgx-4bit", 0.182),  # raw plane
    ("Commodity cluster: slower host", 2, 1e9, 0.139, "ddp-fp32", 0.749),
    ("Three worker hosts", 3, 1e8, 0.178, "ddp-fp32", 8.110),  # 100 Mbit/s, colocated; compute solved from the
    ("Three worker hosts", 3, 1e8, 0.178, "ddp-fp16", 4.333),  # row's own comm cut
]


@pytest.mark.parametrize("source, nodes, rate, compute_s, option, measured", MEASURED)
def test_model_within_15_percent_of_measured(source, nodes, rate, compute_s, option, measured):
    from benchmarks.plan_chart import EMULATED, mlp17m

    predicted = predict(mlp17m(compute_s), Cluster(nodes, rate), EMULATED, option).step_s
    assert abs(predicted / measured - 1) <= 0.15, f"BENCHMARKS.md, {source}: {predicted:.3f} vs {measured}"


def _benchmarks_sections() -> dict[str, str]:
    """BENCHMARKS.md's sections by heading (any level), each the text up to the next heading."""
    with open(os.path.join(ROOT, "BENCHMARKS.md"), encoding="utf-8") as f:
        text = f.read()
    parts = re.split(r"^#{1,6} +(.+)$", text, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2]))


def test_every_cell_is_where_its_source_says():
    # the cells name their figure by section and run, not by line: each must still be there, with the same value
    from benchmarks.plan_chart import CELLS

    sections = _benchmarks_sections()
    cells = [(c.source, c.option, c.measured_s) for c in CELLS] + [(m[0], m[4], m[5]) for m in MEASURED]
    for source, option, measured in cells:
        heading, _, run = source.partition(": ")
        assert heading in sections, f"{source}: BENCHMARKS.md has no section {heading!r}"
        body = sections[heading]
        if run:
            label = body.lower().find(f"**{run.lower()}")
            assert label >= 0, f"{source}: section {heading!r} has no run **{run}**"
            body = body[label:]
        lines = body.splitlines()
        start = next((i for i, line in enumerate(lines) if line.startswith("|")), None)  # the run's own table
        if start is None:  # a run given in prose: its paragraph names the figure in seconds
            paragraph = body.split("\n\n", 1)[0]
            assert f" {measured:.3f} s" in paragraph, f"{source}: its paragraph has no {option} {measured:.3f} s"
            continue
        rows = list(itertools.takewhile(lambda line: line.startswith("|"), lines[start:]))
        assert any(f" {measured:.3f} " in row or f"**{measured:.3f}**" in row
                   for row in rows), f"{source}: no table row there holds {option}'s {measured:.3f} s"


def test_powersgds_shaped_cells_are_the_emulated_run_not_the_full_size_model():
    # cluster.py --scale shrinks each tensor's largest dimension and the links alike, but PowerSGD's factors
    # (n + m per matrix) keep the other dimension, and the benchmark runs PowerSGD in one DDP bucket: modelled
    # as it ran, every PowerSGD cell is within 15%; the full-size model is faster by a fifth or more
    from benchmarks.plan_chart import CELLS, predicted

    cells = [c for c in CELLS if c.option == "ddp-powersgd"]
    assert len(cells) == 5
    for cell in cells:
        full, as_run = predicted(cell)
        assert abs(as_run / cell.measured_s - 1) <= 0.15, (cell, as_run)
        assert full < 0.8 * cell.measured_s, (cell, full)
