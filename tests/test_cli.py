"""The `cgx-ps` command as a new user meets it: real processes, exit codes and what they print."""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from cgx_ps.server.cluster import launch_shard, wait_for_port_file
from cgx_ps.server.config import DEFAULT_METRICS_PORT, MAX_SHARDS
from support import TOKEN_FILE, interruptible

ROOT = Path(__file__).resolve().parents[1]


def env_without_cgx_ps(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CGX_PS_")}
    env.update(extra)
    return env


def cgx_ps(*args: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cgx_ps.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env_without_cgx_ps(**env), cwd=ROOT)


@contextlib.contextmanager
def server(tmp_path: Path, *args: str):
    """`cgx-ps server ... --port-file`: yields (process, the ports it reports) once it serves."""
    port_file = tmp_path / f"ports-{time.monotonic_ns()}.json"
    proc = launch_shard(["--host", "127.0.0.1", "--token-file", TOKEN_FILE, "--kernel-threads", "1", *args],
                        port_file, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                        env=env_without_cgx_ps())
    try:
        try:
            info = wait_for_port_file(proc, port_file, time.monotonic() + 60)
        except (RuntimeError, TimeoutError) as exc:
            raise AssertionError(f"shard {exc}: {proc.stdout.read()}") from None
        yield proc, info
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def one_error_line(res: subprocess.CompletedProcess) -> str:
    """The process failed with exactly one line of its own (gRPC's C core may add its own)."""
    assert res.returncode == 2, res.stdout + res.stderr
    out = res.stdout + res.stderr
    assert "Traceback" not in out, out
    ours = [line for line in out.splitlines() if "logger=cgx_ps" in line]
    assert len(ours) == 1, out
    return ours[0]


# ---- shards started by hand on one host ------------------------------------------------------------


def two_free_default_metrics_ports(rng: random.Random) -> int:
    """A shard index i whose default metrics ports, 9400 + i and 9400 + i + 1, are free now. Drawn
    at random from a wide range, so two test runs on one machine (or anything else listening near
    9400) rarely pick the same; a port taken between this check and the shard's bind is retried.
    Below 32768, where Linux's ephemeral ports (outgoing connections, port 0) begin; an index a
    shard accepts (below MAX_SHARDS - 1, for a second shard after it)."""
    while True:
        index = rng.randrange(0, MAX_SHARDS - 1)
        if port_is_free(DEFAULT_METRICS_PORT + index) and port_is_free(DEFAULT_METRICS_PORT + index + 1):
            return index


def test_shards_started_by_hand_on_one_host_get_their_own_metrics_ports(tmp_path):
    """Before: both shards defaulted to metrics port 9400 and the second died with a traceback.
    Now the default is 9400 + the shard index. The indices are drawn where both ports are free
    (not fixed ones: two test runs on one machine collided on them)."""
    rng = random.Random()
    for attempt in range(5):
        index = two_free_default_metrics_ports(rng)
        shard = [("--port", "0", "--shard-index", str(i), "--num-shards", str(index + 2)) for i in (index, index + 1)]
        try:
            with server(tmp_path, *shard[0]) as (_, a), server(tmp_path, *shard[1]) as (_, b):
                assert (a["metrics_port"], b["metrics_port"]) == (9400 + index, 9400 + index + 1)
            break
        except AssertionError as exc:  # taken since the check by someone else: another pair
            if "choose another --metrics-port" not in str(exc) or attempt == 4:
                raise
    help_text = cgx_ps("server", "--help").stdout
    assert "default 9400 + --shard-index" in " ".join(help_text.split())


def test_a_port_in_use_is_one_line_naming_the_port_and_the_flag(tmp_path):
    with server(tmp_path, "--port", "0", "--metrics-port", "0") as (_, ports):
        # gRPC sets SO_REUSEPORT by default: a second shard on the port used to start and share it
        same_grpc = cgx_ps("server", "--host", "127.0.0.1", "--port", str(ports["port"]), "--metrics-port", "-1",
                           "--token-file", TOKEN_FILE, timeout=60)
        line = one_error_line(same_grpc)
        assert f"cannot bind 127.0.0.1:{ports['port']}" in line and "choose another --port" in line
        same_metrics = cgx_ps("server", "--host", "127.0.0.1", "--port", "0", "--metrics-port",
                              str(ports["metrics_port"]), "--token-file", TOKEN_FILE, timeout=60)
        line = one_error_line(same_metrics)
        assert f"127.0.0.1:{ports['metrics_port']}" in line and "--metrics-port" in line


# ---- first contact: help, cluster ------------------------------------------------------------------


def test_first_contact_help():
    """`cgx-ps` alone shows the overview with examples (not just "COMMAND is required"), and
    every option of every command says what it does."""
    from cgx_ps.cli import build_parser

    bare = cgx_ps()
    assert bare.returncode == 2
    for command in ("demo", "cluster", "server", "status", "wait-for-shards", "codec-demo"):
        assert f"cgx-ps {command}" in bare.stderr, command
    assert "``" not in bare.stderr  # no reStructuredText leaking into the terminal
    parser = build_parser()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for name, sub in commands.choices.items():
        for action in sub._actions:
            if not isinstance(action, argparse._HelpAction):
                assert action.help, f"cgx-ps {name} {'/'.join(action.option_strings)}: no help text"


def cluster_process(*args: str) -> subprocess.Popen:
    """`cgx-ps cluster` in a process group of its own, with Ctrl-C handled as in a terminal."""
    return interruptible([sys.executable, "-m", "cgx_ps.cli", "cluster", *args], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, env=env_without_cgx_ps(), start_new_session=True)


def test_a_ctrl_c_tests_child_takes_sigint_also_from_a_test_run_that_ignores_it():
    """A test run started in the background has SIGINT ignored; the processes the Ctrl-C tests
    start must not inherit that (the status --watch test then waited out its timeout, every run)."""
    show = [sys.executable, "-c", "import signal; print(signal.getsignal(signal.SIGINT))"]
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a background run has it
    try:
        out, _ = interruptible(show, stdout=subprocess.PIPE, text=True).communicate(timeout=60)
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN  # this process's own is as it was
    finally:
        signal.signal(signal.SIGINT, previous)
    assert "default_int_handler" in out, out  # Python's Ctrl-C handler: SIGINT arrived at its default


def children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def test_cluster_with_a_port_in_use_says_so_in_one_line():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = cgx_ps("cluster", "--shards", "1", "--base-port", str(port), "--kernel-threads", "1")
    assert res.returncode == 1, res.stdout + res.stderr
    assert "Traceback" not in res.stdout + res.stderr
    assert f"cannot bind 127.0.0.1:{port}" in res.stderr
    assert "cgx-ps cluster: shard 0 exited with code 2 during startup" in res.stderr


def test_a_reader_that_goes_away_ends_the_output_quietly():
    """`cgx-ps status --json | head -c 100`: the pipe closes under the writer."""
    proc = subprocess.Popen([sys.executable, "-m", "cgx_ps.cli", "status", "--servers", "127.0.0.1:1", "--json",
                             "--sample", "0", "--timeout", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # nobody reads: the first write fails with EPIPE
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 141, err
    assert "Traceback" not in err, err


def _free_ports(n: int) -> int:
    """A base port with ``n`` free ports from it on (free now: another process may take one)."""
    for _ in range(100):
        base = random.randrange(20000, 60000)
        with contextlib.ExitStack() as stack:
            try:
                for port in range(base, base + n):
                    stack.enter_context(socket.socket()).bind(("127.0.0.1", port))
            except OSError:
                continue
        return base
    raise AssertionError("no free ports")


def _serving_lines(proc: subprocess.Popen) -> list[str]:
    """What a `cgx-ps cluster` printed until it said its shards serve (or ended)."""
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "then `cgx-ps status` shows them" in line:
            break
    return lines


def _health(port: int) -> str:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


@pytest.mark.parametrize("how", ["flags", "environment", "default"])
def test_cluster_gives_each_shard_its_own_data_and_health_port(how):
    """`cgx-ps cluster --data-base-port B --health-base-port H`: shard i's data plane on B + i, its
    health port on H + i. CGX_PS_DATA_PORT / CGX_PS_HEALTH_PORT in the environment are those
    bases: before, they reached every shard as its own port, and shard 1 failed to bind it.
    Without either: no data plane and no health port (the default: gRPC only)."""
    base = _free_ports(4)
    args, env = ["--shards", "2", "--base-port", "0", "--kernel-threads", "1"], {}
    if how == "flags":
        args += ["--data-base-port", str(base), "--health-base-port", str(base + 2)]
    elif how == "environment":
        env = {"CGX_PS_DATA_PORT": str(base), "CGX_PS_HEALTH_PORT": str(base + 2)}
    proc = interruptible([sys.executable, "-m", "cgx_ps.cli", "cluster", *args], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, env=env_without_cgx_ps(**env), start_new_session=True)
    try:
        lines = _serving_lines(proc)
        out = "".join(lines)
        assert "2 shards serving" in out, out
        data_ports = [line.split("data port ")[1].split(")")[0].split(",")[0] for line in lines if "serving on" in line]
        if how == "default":
            assert data_ports == ["off", "off"], out
        else:
            data_ports = sorted(map(int, data_ports))
            assert data_ports == [base, base + 1], out
            assert [_health(base + 2), _health(base + 3)] == ["SERVING", "SERVING"]
        os.killpg(proc.pid, signal.SIGINT)
        out += proc.communicate(timeout=90)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0 and "Traceback" not in out, out


def test_sigint_to_the_cluster_alone_stops_its_idle_shards_at_once():
    """`kill -INT` to `cgx-ps cluster` alone (its shards got nothing): before, it waited
    --drain-timeout + 5 s with idle shards, then stopped them with SIGTERM. Now it passes the
    SIGINT on and they stop as idle shards do; with --drain-timeout 60 the old wait was 65 s."""
    proc = cluster_process("--shards", "2", "--base-port", "0", "--kernel-threads", "1", "--drain-timeout", "60")
    try:
        out = "".join(_serving_lines(proc))
        assert "2 shards serving" in out, out
        started = time.monotonic()
        os.kill(proc.pid, signal.SIGINT)
        out += proc.communicate(timeout=120)[0]
        took = time.monotonic() - started
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0 and "Traceback" not in out, out
    assert out.count("signal received: draining") == 2 and out.count("msg='stopped'") == 2, out
    assert took < 40, f"{took:.1f}s: the cluster waited out the drain timeout ({out})"
    # what the cluster says comes before what the shards do, not after they stopped
    assert out.index("cgx-ps cluster: stopping the shards") < out.index("signal received: draining"), out


@pytest.mark.parametrize("when", ["starting", "serving"])
def test_ctrl_c_stops_the_cluster_without_a_traceback(when):
    """Ctrl-C reaches the whole foreground process group: the cluster and its shards."""
    proc = cluster_process("--shards", "2", "--base-port", "0", "--kernel-threads", "1")
    try:
        if when == "starting":  # the shards are importing, not yet serving
            deadline = time.monotonic() + 60
            while len(children(proc.pid)) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.3)
        else:
            lines = []
            for line in proc.stdout:
                lines.append(line)
                if "then `cgx-ps status` shows them" in line:
                    break
            assert any("2 shards serving" in line for line in lines), "".join(lines)
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert "Traceback" not in out, out
    if when == "starting" and "shards serving" not in out:  # (a fast machine may have finished)
        assert proc.returncode == 130, out
    else:
        assert proc.returncode == 0, out


# ---- the demo from a wheel installed without extras ---------------------------------------------------


def build_wheel(tmp_path: Path) -> Path:
    """The wheel of this checkout, built from a copy (so the build leaves nothing in the tree)."""
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", ".venv", "__pycache__", "build", "*.egg-info",
                                                             "dist", "benchmarks", "tests", "deploy", "docs"))
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                          str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    (wheel,) = (tmp_path / "dist").glob("cgx_ps-*.whl")
    return wheel


@pytest.mark.slow
def test_demo_from_a_wheel_without_the_extras(tmp_path):
    """`pip install cgx-ps` (no [demo] extras), then `cgx-ps demo`: before, it stopped asking for
    scikit-learn and tqdm, and then for a source checkout (the training script was not in the
    wheel). Now it trains on synthetic data with plain progress lines."""
    wheel = build_wheel(tmp_path)
    assert "cgx_ps/examples/train.py" in zipfile.ZipFile(wheel).namelist()
    site = tmp_path / "site"
    out = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target",
                          str(site), str(wheel)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    # The kernels this tree compiled (scripts/test.sh), where numba looks for the installed copy's:
    # same sources, same index names; compiling them again in the shard and both workers is not
    # what this test is about, and took most of its time.
    installed = site / "cgx_ps" / "kernels" / "__pycache__"
    installed.mkdir(exist_ok=True)
    for compiled in (ROOT / "cgx_ps" / "kernels" / "__pycache__").glob("*.nb[ic]"):
        shutil.copy(compiled, installed / compiled.name)
    # This interpreter has the extras: modules that fail to import stand in for their absence.
    missing = tmp_path / "missing"
    for name in ("sklearn", "tqdm"):
        (missing / name).mkdir(parents=True)
        (missing / name / "__init__.py").write_text(f"raise ModuleNotFoundError(\"No module named '{name}'\")\n")
    env = env_without_cgx_ps(PYTHONPATH=f"{missing}{os.pathsep}{site}")
    where = subprocess.run([sys.executable, "-c", "import cgx_ps; print(cgx_ps.__file__)"], env=env, cwd=tmp_path,
                           capture_output=True, text=True, timeout=60)
    assert where.stdout.startswith(str(site)), where.stdout + where.stderr  # the installed copy, not this tree
    res = subprocess.run([str(site / "bin" / "cgx-ps"), "demo", "--workers", "2", "--shards", "1", "--epochs", "2"],
                         env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "scikit-learn is not installed, so the workers train on synthetic data" in res.stdout
    assert "tqdm is not installed: progress as plain lines" in res.stdout
    assert "step 20/" in res.stdout and "Traceback" not in res.stdout + res.stderr
    summary = res.stdout.split("\nsummary\n", 1)[1]
    accuracy = float(summary.split("test accuracy", 1)[1].split("%")[0])
    assert accuracy > 80.0, summary  # synthetic classes are learnable: ~10% by chance
    assert "replicas identical   yes" in summary


@pytest.mark.parametrize("words, says", [
    (["cluster", "--shards", "0"], "--shards: must be an integer in 1..2147483647, got '0'"),
    (["cluster", "--base-port", "70000"], "--base-port: must be an integer in 0..65535, got '70000'"),
    (["cluster", "--base-port", "65535", "--shards", "2"], "--base-port 65535 + 2 shards goes past port 65535"),
    (["cluster", "--metrics-base-port", "-5"], "--metrics-base-port: must be an integer in 0..65535 or -1 (off)"),
    (["cluster", "--data-base-port", "65535", "--shards", "2"], "--data-base-port 65535 + 2 shards goes past port"),
    (["cluster", "--health-base-port", "-2"], "--health-base-port: must be an integer in 0..65535 or -1 (off)"),
    (["demo", "--workers", "0"], "--workers: must be an integer in 1..2147483647, got '0'"),
    (["demo", "--local-ranks", "-1"], "--local-ranks: must be an integer in 1..2147483647, got '-1'"),
    (["codec-demo", "--numel", "0"], "--numel: must be an integer in 1..2147483647, got '0'"),
    (["codec-demo", "--bucket-size", "12"], "--bucket-size: must be a multiple of 8 in 8..16777216, got 12"),
    (["demo", "--compression", "9bit"], "--compression: bits must be in 1..8"),
    (["status", "--timeout", "-1"], "--timeout: must be a number of seconds > 0 and <= 604800, got '-1'"),
    (["status", "--watch", "nan"], "--watch: must be a number of seconds > 0 and <= 604800, got 'nan'"),
    (["wait-for-shards", "--interval", "0"], "--interval: must be a number of seconds > 0 and <= 604800, got '0'"),
    (["status", "--sample", "-1"], "--sample: must be a number of seconds in 0..604800, got '-1'"),
])
def test_implausible_numbers_are_usage_errors_not_tracebacks(words, says, capsys):
    """Found by hand: `cluster --shards 0`, `demo --workers 0` ended in tracebacks (`demo
    --compression 9bit` in one per worker, after starting the shards), `cluster
    --base-port 70000` started shards on random ports, `codec-demo --numel 0` printed NaNs."""
    from cgx_ps.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(words)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err, err


@pytest.mark.parametrize("field, flag, value", [("port", "--port", 99999), ("port", "--port", -1),
                                               ("metrics_port", "--metrics-port", -7),
                                               ("health_port", "--health-port", 70000)])
def test_a_shard_refuses_a_port_that_is_not_one(field, flag, value):
    """From a flag or the environment alike (CGX_PS_PORT=99999 bound a random port before)."""
    from cgx_ps.server.config import ServerConfig

    with pytest.raises(ValueError, match=f"{flag} .* must be an integer in 0..65535"):
        ServerConfig(**{field: value})
