"""benchmarks/server.py and benchmarks/dataplane.py on small command lines: each runs to the end
(real shard processes on port 0), and a number that cannot make a run is a usage error.

Found by hand: ``--mb 1`` (or 0.1) ended in a ZeroDivisionError once the rounds were done. The
shards' CPU is read from /proc in clock ticks (10 ms), and a small workload's timed rounds
often cost a shard less than one: its CPU read 0 and the rates per CPU-second divided by it.
Those figures now read "n/a" with a line that says why; ``--rounds 0``, ``--nodes 0``,
``--mb 0`` and ``--bits 9`` ended in tracebacks (a ``--bits 9`` one after the shards had
started), and ``dataplane.py --profile DIR`` in one when DIR did not exist yet."""

from __future__ import annotations

import importlib
import json
import os
import threading
import time
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.procstat import CPU_RESOLUTION_S, cpu_ratio, figure, cpu_by_group, per_cpu, thread_cpu_snapshot

ROOT = Path(__file__).resolve().parents[2]


def bench(script: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, f"benchmarks/{script}", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def ran_to_the_end(res: subprocess.CompletedProcess) -> str:
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    return res.stdout


def test_server_bench_with_a_small_gradient_runs_to_the_end():
    out = ran_to_the_end(bench("server.py", "--mb", "0.1", "--nodes", "1", "--rounds", "1",
                               "--configs", "plain,token,raw"))
    rows = [line for line in out.splitlines() if line.startswith(("| plain", "| token", "| raw"))]
    assert len(rows) == 3, out
    if "n/a" in out:  # a shard's CPU read 0 ticks: said so, not divided by
        assert "a shard's CPU over the timed rounds was under /proc's resolution" in out, out


def test_dataplane_bench_with_a_small_gradient_runs_to_the_end(tmp_path):
    figures = tmp_path / "figures.json"
    out = ran_to_the_end(bench("dataplane.py", "--mb", "1", "--nodes", "1", "--rounds", "1", "--runs", "2",
                               "--json", str(figures)))
    assert "B / A, input per shard CPU-second" in out, out
    runs = json.loads(figures.read_text())["runs"]
    assert len(runs) == 2 and set(runs[0]) == {"A", "B"}


@pytest.mark.skipif(not Path(sys.executable).with_name("py-spy").exists(), reason="py-spy is not installed")
def test_dataplane_bench_profiles_into_a_directory_it_creates(tmp_path):
    profile = tmp_path / "not-yet" / "profiles"
    out = ran_to_the_end(bench("dataplane.py", "--mb", "0.1", "--nodes", "1", "--rounds", "1", "--runs", "1",
                               "--profile", str(profile)))
    assert profile.is_dir()
    for path in (profile / "A.txt", profile / "B.txt"):
        # each profile split, or said missing: a loaded machine can stop py-spy before it attached
        assert f"{path}: " in out, out
        assert path.exists() or f"{path}: no profile (py-spy wrote none" in out, out


@pytest.mark.parametrize("script", ["server.py", "dataplane.py"])
@pytest.mark.parametrize("flag, value, says", [
    ("--rounds", "0", "--rounds: must be >= 1, got 0"),
    ("--nodes", "0", "--nodes: must be >= 1, got 0"),
    ("--mb", "0", "--mb: must hold at least one fp32 element"),
    ("--mb", "0.000001", "--mb: must hold at least one fp32 element"),
    ("--block-mb", "nan", "--block-mb: must hold at least one fp32 element"),
    ("--bits", "9", "--bits: must be in 1..8, got 9"),
])
def test_a_number_that_cannot_make_a_run_is_a_usage_error(script, flag, value, says, monkeypatch, capsys):
    # In this process (the scripts' main() parses sys.argv): a process per case spent its time
    # importing torch; that the scripts run as scripts is test_benchmark_scripts' job
    main = importlib.import_module(f"benchmarks.{script.removesuffix('.py')}").main
    monkeypatch.setattr(sys, "argv", [script, flag, value])
    with pytest.raises(SystemExit) as exit_:
        main()
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err
    assert says in err and "Traceback" not in err, err


def test_a_thread_that_ended_takes_its_cpu_with_it_instead_of_a_negative_difference():
    """A shard's background kernel warm-up ends after the first timed round began: its compile
    time once came out of the kernel threads' CPU, as -520 ms per round."""
    start = {"1": ("event loop", 2.0), "2": ("kernel threads", 0.52), "3": ("kernel threads", 0.1)}
    end = {"1": ("event loop", 2.5), "3": ("kernel threads", 0.3), "4": ("gRPC threads", 0.05)}  # 2 ended, 4 new
    assert cpu_by_group(end, since=start) == pytest.approx(
        {"event loop": 0.5, "kernel threads": 0.2, "gRPC threads": 0.05})
    assert cpu_by_group(end) == pytest.approx({"event loop": 2.5, "kernel threads": 0.3, "gRPC threads": 0.05})


def test_a_threads_cpu_and_group_are_read_from_proc():
    release = threading.Event()

    def spin_then_wait() -> None:
        while time.thread_time() < 0.2:
            pass
        release.wait()

    spinner = threading.Thread(target=spin_then_wait, daemon=True)  # a failed assertion leaves it waiting
    spinner.start()
    deadline = time.monotonic() + 60
    try:
        while (snapshot := thread_cpu_snapshot(os.getpid()))[str(spinner.native_id)][1] < 0.15:  # 10 ms ticks
            assert time.monotonic() < deadline, snapshot
            time.sleep(0.05)
        assert snapshot[str(spinner.native_id)][0] == "kernel threads"
        assert snapshot[str(os.getpid())][0] == "event loop"
    finally:
        release.set()
    spinner.join()


def test_rates_per_cpu_second_are_not_measured_below_one_clock_tick():
    assert per_cpu(5.0, 0.0) is None and per_cpu(5.0, CPU_RESOLUTION_S / 2) is None
    assert per_cpu(5.0, 2 * CPU_RESOLUTION_S) == pytest.approx(2.5 / CPU_RESOLUTION_S)
    assert cpu_ratio(0.0, 1.0) is None and cpu_ratio(1.0, 0.0) is None  # 0 over anything says nothing
    assert cpu_ratio(1.0, 0.5) == 2.0
    assert figure(None, ".2f", " MB/s") == "n/a" and figure(2.0, ".1f", " MB/s") == "2.0 MB/s"


def test_shard_scale_replays_nodes_against_the_shards_and_compares_the_model(tmp_path):
    out = tmp_path / "scale.json"
    stdout = ran_to_the_end(bench("shard_scale.py", "--nodes", "1", "3", "--shards", "2", "--rounds", "1",
                                  "--block-mb", "16", "--json", str(out)))
    doc = json.loads(out.read_text())
    assert [r["nodes"] for r in doc["rows"]] == [1, 3]
    one, three = doc["rows"]
    # every replayed node pushes ResNet-50's gradient (25.6M parameters, about 13 MB at 4 bits) over 2 shards
    assert 12 < doc["pushed_per_node_MB"] < 14.5 and three["input_per_shard_MB"] == pytest.approx(
        3 * doc["pushed_per_node_MB"] / 2)
    assert three["model_shard_cpu_s"] == pytest.approx(3 * one["model_shard_cpu_s"])  # the model: linear in N
    assert three["shard_cpu_s"] > 0 and "3 nodes: round" in stdout
