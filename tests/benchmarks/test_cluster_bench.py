"""Smoke test of the commodity-cluster benchmark (benchmarks/cluster.py) at tiny size.

Two emulated hosts on 1 Gbit/s links, the tiny model, 3 timed steps: one DDP configuration and
cgx-ps 4-bit with one shard colocated on each worker host.  It checks the harness end to end
(a row per configuration, finite losses, bytes on the wire, the Markdown table and the chart)
and that nothing is left behind: no ``cgxb-`` namespaces or links and no shard processes, also
when the benchmark is stopped with SIGTERM while shards are serving.  Needs root and iproute2.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks import netcluster as nc
from support import terminate

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "cluster.py"  # the CLI, run as documented

IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
HAVE_IP = shutil.which("ip") is not None and shutil.which("tc") is not None
root_only = pytest.mark.skipif(not (IS_ROOT and HAVE_IP), reason="needs root and iproute2 (ip, tc)")


def _leftover_objects() -> list[str]:
    """This run's prefix's namespaces and links (CGX_PS_NETNS_PREFIX, as the benchmark names them)."""
    left = nc.find_leftovers()
    return left["netns"] + left["links"]


def _shard_processes() -> list[str]:
    """cgx-ps shard processes of this run's prefix: their --port-file lies in a folder named after
    it (benchmarks.shards), so runs with other prefixes on the same machine do not count."""
    folder = f"/{nc.PREFIX}shards-"
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        args = [a.decode(errors="replace") for a in argv]
        if "cgx_ps.cli" in args and "server" in args and any(folder in a for a in args):
            found.append(f"{proc.name}: {' '.join(args)}")
    return found


@pytest.fixture
def clean_slate():
    if _leftover_objects():
        pytest.fail(f"{nc.PREFIX} leftovers exist before the test: {_leftover_objects()}; remove them with: "
                    f"{nc.cleanup_command()}")
    yield
    deadline = time.monotonic() + 5  # processes killed by id may take a moment to vanish from /proc
    while _shard_processes() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _leftover_objects(), f"the benchmark left {_leftover_objects()}"
    assert not _shard_processes(), f"the benchmark left shard processes: {_shard_processes()}"


@pytest.mark.timeout(120)
@pytest.mark.root
@root_only
def test_cluster_benchmark_smoke(clean_slate, tmp_path):
    out_json, out_md, out_png = tmp_path / "r.json", tmp_path / "r.md", tmp_path / "r.png"
    cmd = [sys.executable, str(SCRIPT), "--models", "tiny", "--rates", "1gbit", "--steps", "3", "--warmup", "1",
           "--configs", "ddp-fp32", "cgx-4bit", "--timeout", "90",
           "--json", str(out_json), "--markdown", str(out_md), "--png", str(out_png)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=110, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out_json.read_text())["rows"]
    singles = [row for row in rows if row["config"] == "single"]  # compute only, at start and end
    rows = [row for row in rows if row["config"] != "single"]
    assert [row["config"] for row in rows] == ["ddp-fp32", "cgx-4bit"]
    assert len(singles) == 2 and all(s["status"] == "ok" and s["step_s"] > 0 for s in singles)
    for row in rows:
        assert row["compute_s"] == min(s["step_s"] for s in singles)
        assert row["status"] == "ok", row
        assert row["model"] == "tiny" and row["rate"] == "1gbit" and row["topology"] == "colocated"
        assert math.isfinite(row["eval_loss"]) and all(math.isfinite(x) for x in row["eval_loss_per_rank"])
        assert row["step_s"] > 0 and len(row["step_s_per_rank"]) == 2
        assert row["tx_bytes"] > 0 and row["rx_bytes"] > 0  # gradients crossed the shaped links
        assert row["ideal_s"] > 0 and row["comm_s"] is not None
        # CPU over the timed steps (/proc counts 10 ms ticks: a tiny model's 3 steps may read 0)
        assert row["compute_cpu_s"] >= 0 and row["worker_cpu_s_per_step"] >= 0
    assert rows[0]["host_cpu_s_per_step"] == rows[0]["worker_cpu_s_per_step"]  # DDP: the worker is the host
    cgx = rows[1]
    assert cgx["colocated_cpu_s_per_step"] is not None  # the colocated shard was accounted for
    assert cgx["host_cpu_s_per_step"] == pytest.approx(cgx["worker_cpu_s_per_step"] + cgx["colocated_cpu_s_per_step"])
    assert cgx["exposed_comm_s"] is not None and cgx["pushed_bytes"] < cgx["fp32_bytes"]  # 4-bit is smaller
    # measured for both shards (10 ms ticks again: a shard's share of 3 tiny steps may read 0; CI saw 0.01 and 0.0)
    assert len(cgx["shard_cpu_s"]) == 2 and all(c is not None and c >= 0 for c in cgx["shard_cpu_s"])
    # both replicas trained the same model: every worker decodes the same aggregates
    assert cgx["eval_loss_per_rank"][0] == cgx["eval_loss_per_rank"][1]
    md = out_md.read_text()
    assert "| DDP gloo fp32 |" in md and "| cgx-ps 4-bit |" in md and "CPU s/step/host" in md
    assert "| DDP gloo fp32 |" in r.stdout  # the table also goes to stdout
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(90)
@pytest.mark.root
@root_only
def test_sigterm_while_shards_serve_leaves_nothing(clean_slate):
    cmd = [sys.executable, str(SCRIPT), "--models", "tiny", "--steps", "3000", "--warmup", "1",
           "--configs", "cgx-4bit", "--timeout", "60"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        while len(_shard_processes()) < 2:  # both shards up (workers start right after)
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()
            time.sleep(0.2)
        time.sleep(3.0)  # let the workers connect and train
    finally:
        terminate(p, timeout=30)
    assert p.returncode == 128 + signal.SIGTERM, p.stderr.read()[-2000:]


def test_auto_interval_option_keeps_old_commands_meaning_the_same():
    from benchmarks.cluster import compression_arg, parse_args

    assert compression_arg("auto", parse_args([]).auto_interval) == "auto:5"  # as before the option
    assert compression_arg("auto", parse_args(["--auto-interval", "20"]).auto_interval) == "auto:20"
    assert compression_arg("auto", parse_args(["--auto-interval", "0"]).auto_interval) == "auto"  # auto's default
    assert compression_arg("4bit", 20) == "4bit"
    with pytest.raises(SystemExit):
        parse_args(["--auto-interval", "-1"])
