"""A shard's settings: one place for defaults, environment variables and flags (server/config.py)."""

from __future__ import annotations

import dataclasses

import pytest

from cgx_ps import cli
from cgx_ps.server.config import SETTINGS, ServerConfig, flag_defaults, shard_flags


def test_every_field_has_one_environment_variable_and_flag() -> None:
    assert set(SETTINGS) == {f.name for f in dataclasses.fields(ServerConfig)}
    assert len({s.env for s in SETTINGS.values()}) == len({s.flag for s in SETTINGS.values()}) == len(SETTINGS)


def test_from_env_reads_the_variables_over_the_defaults() -> None:
    # deployed shards serve metrics; no raw data plane unless asked: gRPC carries every stream
    assert ServerConfig.from_env({}) == ServerConfig(metrics_port=9400, data_port=-1)
    config = ServerConfig.from_env({"CGX_PS_PORT": "7001", "CGX_PS_MAX_INFLIGHT_MB": "2.5", "CGX_PS_NUM_SHARDS": "4",
                                    "CGX_PS_SHARD_INDEX": "3", "CGX_PS_ERROR_FEEDBACK": "1", "CGX_PS_TOKEN_FILE": "",
                                    "CGX_PS_TLS_CERT": "c.pem", "CGX_PS_TLS_KEY": "k.pem", "CGX_PS_LOG_LEVEL": "DEBUG"})
    assert (config.port, config.max_inflight_bytes, config.num_shards, config.shard_index) == (7001, 5 << 19, 4, 3)
    assert config.error_feedback and config.token_file is None and config.tls_cert == "c.pem"
    assert config.log_level == "DEBUG" and config.data_port == -1  # no plaintext data plane beside TLS
    assert ServerConfig.from_env({"CGX_PS_ERROR_FEEDBACK": "false"}).error_feedback is False
    # overrides are field values, applied before validation (the index is valid for 2 shards only)
    assert ServerConfig.from_env({"CGX_PS_SHARD_INDEX": "1"}, num_shards=2).shard_index == 1


@pytest.mark.parametrize("env, message", [
    ({"CGX_PS_PORT": "x"}, "CGX_PS_PORT='x': must be an integer in 0..65535"),
    ({"CGX_PS_ROUND_TIMEOUT": "soon"}, "CGX_PS_ROUND_TIMEOUT='soon': must be a number of seconds > 0"),
    ({"CGX_PS_SHARD_INDEX": "2", "CGX_PS_NUM_SHARDS": "2"}, "--shard-index 2 must be below --num-shards 2"),
    ({"CGX_PS_LOG_LEVEL": "LOUD"}, "log_level must be one of"),
    ({"CGX_PS_TLS_CERT": "c.pem"}, "TLS needs both"),
])
def test_bad_settings_are_named(env: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ServerConfig.from_env(env)


@pytest.mark.parametrize("argv, env, data_port", [
    ([], {}, -1),  # the default: gRPC only, one port (the raw plane is an opt-in)
    (["--data-port", "0"], {}, 0),  # a free port, advertised at Register
    (["--data-port", "-1"], {}, -1),
    ([], {"CGX_PS_DATA_PORT": "-1"}, -1),
    ([], {"CGX_PS_DATA_PORT": "7072"}, 7072),
    (["--data-port", "7073"], {"CGX_PS_DATA_PORT": "7072"}, 7073),
    (["--tls-cert", "c.pem", "--tls-key", "k.pem"], {}, -1),  # TLS: off unless asked (and asking is refused)
    ([], {"CGX_PS_TLS_CERT": "c.pem", "CGX_PS_TLS_KEY": "k.pem"}, -1),
])
def test_a_deployed_shard_opens_the_data_plane_only_when_asked(monkeypatch, argv, env,
                                                                                  data_port) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = cli.build_parser().parse_args(["server", "--port", "0", *argv])
    assert ServerConfig.from_flags(vars(args)).data_port == data_port
    assert ServerConfig(port=0).data_port == -1  # built in code (tests, embedding): off unless asked


@pytest.mark.parametrize("argv", [["--data-port", "0"], ["--data-port", "7072"]])
def test_asking_for_the_data_plane_under_tls_is_refused(argv) -> None:
    args = cli.build_parser().parse_args(["server", "--tls-cert", "c.pem", "--tls-key", "k.pem", *argv])
    with pytest.raises(ValueError, match="--data-port cannot be used with --tls-cert"):
        ServerConfig.from_flags(vars(args))


def test_the_cli_takes_its_defaults_from_the_environment(monkeypatch, capsys) -> None:
    monkeypatch.setenv("CGX_PS_ROUND_TIMEOUT", "7.5")
    monkeypatch.setenv("CGX_PS_MAX_MODEL_MB", "64")
    args = cli.build_parser().parse_args(["server", "--port", "0"])
    assert (args.round_timeout, args.max_model_mb, args.port) == (7.5, 64.0, 0)
    config = ServerConfig.from_flags(vars(args))
    assert config == ServerConfig.from_env(port=0) and config.max_model_bytes == 64 << 20
    monkeypatch.setenv("CGX_PS_KERNEL_THREADS", "many")
    with pytest.raises(SystemExit) as exit_:
        cli.build_parser()
    assert exit_.value.code == 2  # a usage error, as a bad flag is
    assert "CGX_PS_KERNEL_THREADS='many': must be an integer in 0..256" in capsys.readouterr().err


def test_a_cluster_passes_its_settings_to_every_shard() -> None:
    args = cli.build_parser().parse_args(["cluster", "--error-feedback", "--max-inflight-mb", "3", "--tls-cert", "c",
                                          "--tls-key", "k", "--token-file", "t"])
    argv = shard_flags(vars(args), skip=("token_file",))
    shard = cli.build_parser().parse_args(["server", *argv])
    config = ServerConfig.from_flags(vars(shard))
    assert config.error_feedback and config.max_inflight_bytes == 3 << 20 and config.tls_key == "k"
    assert "--token-file" not in argv and "--port" not in argv  # the cluster sets those per shard
    assert flag_defaults({})["max_inflight_bytes"] == 1024.0  # flags in MiB, fields in bytes


def test_a_shard_splits_a_kernel_call_only_over_the_cores_its_executor_leaves_over() -> None:
    """server/rounds/kernel_threads.py: with a kernel thread per core (the default), blocks run side by side and
    one call is not split; with fewer executor threads than cores, a call takes the rest."""
    from cgx_ps.server.rounds.kernel_threads import executor_threads, per_call_threads

    assert executor_threads(0, 2) == 2 and executor_threads(1, 2) == 1 and executor_threads(3, 2) == 3
    assert per_call_threads(0, 2) == 1  # the default on this 2-core machine: no split
    assert per_call_threads(1, 2) == 2  # --kernel-threads 1: one block at a time, split in two
    assert per_call_threads(3, 8) == 2
    assert per_call_threads(4, 2) == 1  # more threads than cores: never below one
