"""Smoke tests of the benchmark cluster harness (benchmarks.netcluster and the modules it re-exports).

They build real network namespaces, so they need root and iproute2; without
them they are skipped (except the check that the CLI refuses to run as
non-root).  Everything runs at tiny size: a few seconds on a 2-core machine.
"""

from __future__ import annotations

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
SCRIPT = ROOT / "benchmarks" / "netcluster.py"  # the CLI, run as documented

IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
HAVE_IP = shutil.which("ip") is not None and shutil.which("tc") is not None
root_only = pytest.mark.skipif(not (IS_ROOT and HAVE_IP), reason="needs root and iproute2 (ip, tc)")


def _no_leftovers() -> bool:
    left = nc.find_leftovers()
    return not left["netns"] and not left["links"]


@pytest.fixture
def clean_slate():
    if not _no_leftovers():
        pytest.fail(f"cgxb- leftovers exist before the test: {nc.find_leftovers()}; "
                    f"remove them with: {nc.cleanup_command()}")
    yield
    assert _no_leftovers(), f"the test left {nc.find_leftovers()}"


@pytest.mark.timeout(120)
@pytest.mark.root
@root_only
def test_cluster_link_and_ddp_smoke(clean_slate):
    procs = []
    with nc.Cluster(hosts=2, rate="1gbit") as c:
        assert [c.address(i) for i in range(2)] == ["10.77.0.1", "10.77.0.2"]
        for i in range(2):
            lo = subprocess.run(["ip", "-n", c.netns(i), "-o", "link", "show", "lo"],
                                capture_output=True, text=True, check=True).stdout
            assert "UP" in lo.split(">")[0], lo
            qdisc = subprocess.run(["tc", "-n", c.netns(i), "qdisc", "show", "dev", "eth0"],
                                   capture_output=True, text=True, check=True).stdout
            assert "tbf" in qdisc and "rate 1Gbit" in qdisc, qdisc

        gbps = nc.measure_link(c, seconds=1.5)
        assert 0.5 <= gbps <= 1.2, f"measured {gbps:.3f} Gbit/s on a 1gbit link"

        res = nc.run_ddp(c, model="tiny", hook="none", steps=3, warmup=1, timeout=90)
        assert res.ok, (res.status, res.stderr_tails)
        assert sorted(r["rank"] for r in res.results) == [0, 1]
        for r in res.results:
            assert r["world_size"] == 2
            assert len(r["step_times_s"]) == 4
            assert math.isfinite(r["eval_loss"]) and math.isfinite(r["train_loss"])
            assert r["tx_bytes_per_step"] > 0  # gradients really crossed eth0
        procs = list(c.procs)
    assert procs and all(p.poll() is not None for p in procs)


@pytest.mark.timeout(60)
@pytest.mark.root
@root_only
def test_leftovers_are_detected_and_cleaned(clean_slate):
    stray = nc.PREFIX + "stray"  # this run's prefix: leftovers of other prefixes are not ours
    subprocess.run(["ip", "netns", "add", stray], check=True)
    veth = subprocess.run(["ip", "link", "add", stray + "A", "type", "veth", "peer", "name", stray + "B"])
    try:
        left = nc.find_leftovers()
        assert stray in left["netns"]
        if veth.returncode == 0:
            assert stray + "A" in left["links"]
        with pytest.raises(nc.LeftoversError) as err:
            nc.Cluster(hosts=2).start()
        assert nc.cleanup_command() in str(err.value)
        assert "--cleanup" in str(err.value)
        assert stray in str(err.value)
        # it refused before building anything
        assert set(nc.find_leftovers()["netns"]) == {stray}
    finally:
        cli = subprocess.run([sys.executable, str(SCRIPT), "--cleanup"], capture_output=True, text=True)
    assert cli.returncode == 0, cli.stderr
    assert stray in cli.stdout


@pytest.mark.timeout(60)
@pytest.mark.root
@root_only
def test_sigterm_tears_everything_down(clean_slate):
    p = subprocess.Popen([sys.executable, str(SCRIPT), "--hosts", "2", "--measure", "--seconds", "30"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        while len(nc.find_leftovers()["netns"]) < 3:  # 2 hosts + the switch
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()
            time.sleep(0.1)
        time.sleep(1.0)  # let the measurement processes start
    finally:
        terminate(p, timeout=20)
    assert p.returncode == 128 + signal.SIGTERM


@pytest.mark.timeout(60)
def test_cli_refuses_without_root():
    if IS_ROOT:
        if shutil.which("setpriv") is None:
            pytest.skip("needs setpriv to drop root")
        prefix = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups"]
    else:
        prefix = []
    r = subprocess.run([*prefix, sys.executable, str(SCRIPT), "--hosts", "2", "--measure"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "root" in r.stderr
    assert "Gbit/s" not in r.stdout  # it did not fall back to measuring loopback
