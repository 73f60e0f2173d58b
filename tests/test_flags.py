"""Every number a user can set is checked where it is read: nan, inf, negatives, zero where it means
nothing, values only a typo gives, and non-numbers are refused with one line naming the flag or
variable the user set and the accepted range (envparse.Bounds), never accepted, hung on or a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cgx_ps import cli
from cgx_ps.envparse import Bounds
from cgx_ps.server.config import SETTINGS, ServerConfig, flag_defaults
from cgx_ps.worker import ConfigError, WorkerConfig
from cgx_ps.worker import config as worker_config
from cgx_ps.worker.metrics import _Exporter

ROOT = Path(__file__).resolve().parents[1]
HUGE = "99999999999"  # the trial's: overflowed gRPC's C int, named 99999999999 shards


def bad_values(bounds: Bounds) -> list[str]:
    """The values a user may mistype for a setting with ``bounds``: each must be refused."""
    below = bounds.low if bounds.above else bounds.low - 1  # 0 where 0 means nothing, else -1 (or 1 below)
    if bounds.off is not None and below == bounds.off:
        below -= 1  # -1 is "off" for the optional ports: -2 is the mistake
    values = ["nan", "inf", "-inf", "1e400", f"{below:g}", HUGE, "x", "1.5e"]
    return values + (["2.5"] if bounds.integer else [])


NUMERIC = {name: s for name, s in SETTINGS.items() if s.kind in (int, float)}
SERVER_CASES = [(name, value) for name, s in NUMERIC.items() for value in bad_values(s.bounds)]


def test_every_numeric_setting_has_bounds() -> None:
    """A new int or float setting without bounds would bypass the checks below."""
    assert NUMERIC and all(s.bounds is not None for s in NUMERIC.values())


@pytest.mark.parametrize("name, value", SERVER_CASES, ids=[f"{n}={v}" for n, v in SERVER_CASES])
def test_a_bad_server_flag_is_one_line_naming_it(name: str, value: str, capsys) -> None:
    flag = SETTINGS[name].flag
    with pytest.raises(SystemExit) as exit_:
        cli.build_parser().parse_args(["server", f"{flag}={value}"])  # = : "-inf" is no option
    assert exit_.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith(f"cgx-ps server: error: argument {flag}: must be "), error
    assert f"got {value!r}" in error, error


@pytest.mark.parametrize("name, value", SERVER_CASES, ids=[f"{n}={v}" for n, v in SERVER_CASES])
def test_a_bad_server_variable_is_refused_naming_it(name: str, value: str) -> None:
    variable = SETTINGS[name].env
    with pytest.raises(ValueError) as error:
        flag_defaults({variable: value})
    assert str(error.value).startswith(f"{variable}={value!r}: must be "), error.value


@pytest.mark.parametrize("field, value", [
    ("round_timeout_s", float("nan")), ("drain_timeout_s", float("inf")), ("drain_timeout_s", -5.0),
    ("max_inflight_bytes", 1 << 60), ("max_model_bytes", 0), ("max_concurrent_rpcs", 99999999999),
    ("kernel_threads", -5), ("num_shards", 99999999999), ("port", 70000), ("metrics_port", -7),
])
def test_a_config_built_in_code_is_checked_alike(field: str, value: float) -> None:
    flag = SETTINGS[field].flag
    with pytest.raises(ValueError, match=f"^{flag} \\({SETTINGS[field].env}\\) must be "):
        ServerConfig(**{field: value})


def cgx_ps(*args: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("CGX_PS_")}
    return subprocess.run([sys.executable, "-m", "cgx_ps.cli", *args], capture_output=True, text=True, timeout=120,
                          env={**clean, **env}, cwd=ROOT)


@pytest.mark.parametrize("args, env, names", [
    (["server", "--round-timeout", "nan"], {}, "--round-timeout"),
    (["server", "--max-concurrent-rpcs", HUGE], {}, "--max-concurrent-rpcs"),
    (["server", "--max-inflight-mb", "1e400"], {}, "--max-inflight-mb"),
    (["cluster", "--shards", "1", "--base-port", "0", "--kernel-threads", "-5"], {}, "--kernel-threads"),
    (["codec-demo", "--bucket-size", "12"], {}, "--bucket-size"),
    (["server"], {"CGX_PS_ROUND_TIMEOUT": "nan"}, "CGX_PS_ROUND_TIMEOUT"),
    (["server"], {"CGX_PS_MAX_MODEL_MB": "1e400"}, "CGX_PS_MAX_MODEL_MB"),
])
def test_the_real_command_says_one_line_and_exits_2(args: list[str], env: dict, names: str) -> None:
    """The trial's commands, as a user runs them (23- and 37-line tracebacks before)."""
    res = cgx_ps(*args, "--port", "0", "--metrics-port", "-1", **env) if args[0] == "server" else cgx_ps(*args, **env)
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr and res.stdout == "", res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert names in last and "must be" in last, res.stderr
    if env:  # no usage text: the one line
        assert len(res.stderr.strip().splitlines()) == 1, res.stderr


WORKER_CASES = [(name, value) for name, b in worker_config.SETTINGS.items() for value in bad_values(b)]


@pytest.mark.parametrize("name, value", WORKER_CASES, ids=[f"{n}={v}" for n, v in WORKER_CASES])
def test_a_bad_worker_variable_is_a_config_error_naming_it(name: str, value: str) -> None:
    env = {"CGX_PS_SERVERS": "127.0.0.1:1", name: value}
    if name in ("CGX_PS_NODE_RANK", "CGX_PS_NUM_NODES"):
        env.setdefault("CGX_PS_NUM_NODES" if name == "CGX_PS_NODE_RANK" else "CGX_PS_NODE_RANK", "0")
    with pytest.raises(ConfigError) as error:
        WorkerConfig.from_env(env)
    assert str(error.value).startswith(f"{name}={value!r}: must be "), error.value


@pytest.mark.parametrize("env, says", [
    # the trial's: "RANK=0 is not in 0..WORLD_SIZE-1=-4", naming a variable the user did not set
    ({"CGX_PS_NUM_NODES": "-3"}, "CGX_PS_NUM_NODES='-3': must be an integer in 1.."),
    ({"CGX_PS_NODE_RANK": "2", "CGX_PS_NUM_NODES": "2"}, "CGX_PS_NODE_RANK=2 must be below CGX_PS_NUM_NODES=2"),
    ({"CGX_PS_NUM_SHARDS": HUGE, "CGX_PS_SERVERS": "s-{i}:7070"}, "CGX_PS_NUM_SHARDS='99999999999': must be"),
])
def test_worker_errors_name_what_the_user_set(env: dict, says: str) -> None:
    with pytest.raises(ConfigError, match="^" + says.replace(".", r"\.").replace("{", r"\{")):
        WorkerConfig.from_env({"CGX_PS_SERVERS": "127.0.0.1:1", **env})


@pytest.mark.parametrize("value", ["-1", "99999", "nan", HUGE])
def test_a_bad_worker_metrics_port_is_a_config_error(value: str) -> None:
    with pytest.raises(ConfigError, match=f"^CGX_PS_WORKER_METRICS_PORT='{value}': must be an integer in 0..65535"):
        _Exporter().start({"CGX_PS_WORKER_METRICS_PORT": value})


@pytest.mark.parametrize("example", ["cgx_ps.examples.train", "cgx_ps.examples.ddp_train"])
def test_a_nan_connect_timeout_fails_at_once_instead_of_hanging(tmp_path, example: str) -> None:
    """CGX_PS_CONNECT_TIMEOUT=nan and an unreachable shard once made the example
    train silently forever. Now it stops before dialling, naming the variable (the bound: 120 s
    of a loaded machine's imports; it took none of the connect timeout before it was refused)."""
    token = tmp_path / "job.tok"
    token.write_text("t" * 43)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("CGX_PS_")}
    env = {**clean, "CGX_PS_SERVERS": "127.0.0.1:1", "CGX_PS_TOKEN_FILE": str(token), "CGX_PS_CONNECT_TIMEOUT": "nan",
           "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-m", example, "--epochs", "1"], capture_output=True,
                         text=True, timeout=120, env=env, cwd=tmp_path)
    assert res.returncode != 0
    assert "CGX_PS_CONNECT_TIMEOUT='nan': must be a number of seconds in 0..604800" in res.stderr, res.stderr[-3000:]
    # the example to copy says it in one line, not in a 14-42-line traceback
    assert "Traceback" not in res.stderr and "ConfigError: CGX_PS_CONNECT_TIMEOUT='nan'" in res.stderr, res.stderr[-3000:]
