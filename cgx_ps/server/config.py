"""Settings of one shard process: each one's default, environment variable and flag, in one place.

    ServerConfig(port=0, ...)        in code (tests, embedding): the defaults below
    ServerConfig.from_env(env)       CGX_PS_* variables over the defaults (a deployment)
    cgx-ps server --port 7070 ...    flags over the environment: the CLI builds its flags from
                                     SETTINGS and the config with ServerConfig.from_flags
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any, Mapping

from ..net.addresses import MAX_SHARDS, SHARD_COUNT
from ..envparse import PORT, Bounds, env_flag, env_number, env_str, plain_number
from ..timeline import ENV_PATH as TIMELINE_ENV, ENV_STEPS as TIMELINE_STEPS_ENV, parse_steps
from ..net.channel_options import CHUNK_BYTES, GRPC_OPTIONS

__all__ = ["CHUNK_BYTES", "DEFAULT_METRICS_PORT", "DEFAULT_PORT", "GRPC_OPTIONS", "HEALTH_PORT_CALLS",
           "MAX_SHARDS", "MIN_CONCURRENT_RPCS", "SETTINGS", "ServerConfig", "Setting",
           "flag_defaults", "shard_flags"]

DEFAULT_PORT = 7070
DEFAULT_METRICS_PORT = 9400  # a deployed shard serves metrics here unless told otherwise
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
_MIB = 1 << 20
# Upper bounds where a larger value can only be a typo (99999999999 overflows gRPC's C int, or
# names a pool of threads or a cap no host has): refused with the range instead of a traceback.
_MAX_SECONDS = 86400.0  # a round or a drain waiting a day is a stuck job, not a setting
_MAX_MIB = float(1 << 20)  # 1 TiB of buffered pushes or of fp32 state on one shard
_MAX_THREADS = 256  # as the workers' CGX_PS_CODEC_THREADS
_MAX_CALLS = 1 << 16  # each call may hold a connection: more than a host's file descriptors
MIN_CONCURRENT_RPCS = 8  # the least --max-concurrent-rpcs a shard takes
HEALTH_PORT_CALLS = 16  # the health-only port's maximum_concurrent_rpcs (main.py; fdlimit.py counts them)
_PORT_OR_OFF = Bounds(0, 65535, off=-1)


@dataclass(frozen=True)
class ServerConfig:
    """One shard's settings, checked when built: each field is a ``cgx-ps server`` flag and a
    ``CGX_PS_*`` variable (``SETTINGS`` names both; the comments below say what each does).

    Build it with ``from_env`` (a deployment's environment) or ``from_flags`` (the CLI), or
    directly with field values (tests, an embedded shard).

    Raises:
        ValueError: a value out of its range, or settings that do not fit together (a shard
            index past the shard count, half a TLS key pair, the raw data plane under TLS, ...),
            naming the flag.
    """

    # where to listen
    host: str = "0.0.0.0"
    port: int = DEFAULT_PORT  # 0 picks a free port (tests)
    metrics_port: int = -1  # Prometheus HTTP port; -1 disables, 0 picks a free one
    # which part of the model this shard owns
    shard_index: int = 0
    num_shards: int = 1
    # failure handling
    round_timeout_s: float = 60.0  # a round waiting longer for its last node fails for everyone
    drain_timeout_s: float = 20.0  # on SIGTERM, time to finish rounds in flight
    # memory: pushed bytes held but not yet summed; beyond it, reading pushes pauses
    max_inflight_bytes: int = 1 << 30
    # quality: carry each block's re-quantization error into its next round
    error_feedback: bool = False
    # threads running the codec kernels (0: one per CPU)
    kernel_threads: int = 0
    # memory: fp32 state a session's layout may make this shard hold (accumulators, residuals)
    max_model_bytes: int = 4 << 30
    # calls served at once; beyond it gRPC refuses new calls with RESOURCE_EXHAUSTED
    max_concurrent_rpcs: int = 1024
    # security (docs/security.md): the job token, TLS and mutual TLS
    token_file: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    # serve a non-loopback address with neither token nor TLS (exposure_problem refuses it otherwise)
    insecure: bool = False
    # a plaintext port serving only the gRPC health service (for kubelet probes when TLS is on)
    health_port: int = -1
    # the raw data plane (server/rpc/raw_listener.py): Exchange streams over plain TCP, token-checked;
    # -1 off (the default: gRPC carries every stream), 0 a free port. An opt-in for trusted networks
    # where the shard's CPU is the limit: it takes about a fifth less shard CPU per byte than gRPC
    data_port: int = -1
    # where metrics listen; None: the same address as the gRPC port
    metrics_host: str | None = None
    log_level: str = "INFO"
    # a Chrome trace of the rounds (cgx_ps/timeline/): its path (+ ".shard<index>"), which rounds
    timeline: str | None = None
    timeline_steps: str = ""

    @property
    def authenticates(self) -> bool:
        """Does every caller prove it belongs to the job (token or client certificate)?"""
        return bool(self.token_file or self.tls_client_ca)

    def __post_init__(self) -> None:
        for name, setting in SETTINGS.items():
            problem = setting.problem(getattr(self, name))
            if problem:
                raise ValueError(problem)
        if self.shard_index >= self.num_shards:
            raise ValueError(f"--shard-index {self.shard_index} must be below --num-shards {self.num_shards} "
                             f"(shard indexes are 0..{self.num_shards - 1})")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("TLS needs both --tls-cert and --tls-key")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")
        if self.data_port != -1 and self.tls_cert:
            # The plane is plaintext: over TLS it saves nothing (Python's ssl costs what gRPC's
            # does, BENCHMARKS.md), and a plaintext port beside a TLS one would undo the TLS.
            raise ValueError("--data-port cannot be used with --tls-cert: the raw data plane is plaintext and gains "
                             "nothing under TLS (the crypto dominates); TLS deployments keep the gRPC stream")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        parse_steps(self.timeline_steps, f"--timeline-steps ({TIMELINE_STEPS_ENV})")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> "ServerConfig":
        """The environment's settings over the defaults, then ``overrides``.

        Args:
            env: the variables to read (default: ``os.environ``).
            **overrides: field values that replace the environment's.

        Returns:
            The checked configuration.

        Raises:
            ValueError: a malformed variable or settings that do not fit together, named.
        """
        values = flag_defaults(os.environ if env is None else env)
        fields = {name: _field_value(name, v) for name, v in values.items()}
        return cls(**_deployed_ports({**fields, **overrides}))

    @classmethod
    def from_flags(cls, flags: Mapping[str, Any]) -> "ServerConfig":
        """From the CLI's parsed flags.

        Args:
            flags: ``vars(args)`` of ``cgx-ps server``, whose defaults came from ``flag_defaults``.

        Returns:
            The checked configuration.

        Raises:
            ValueError: settings that do not fit together, naming the flags.
        """
        return cls(**_deployed_ports({name: _field_value(name, flags[s.dest]) for name, s in SETTINGS.items()}))


@dataclass(frozen=True)
class Setting:
    env: str  # the environment variable
    flag: str  # the command-line flag
    help: str
    kind: type = str  # of the flag's value: int, float, bool or str
    unit: int = 1  # the field holds the flag's value times this (flags in MiB, fields in bytes)
    per_shard: bool = False  # differs between the shards of one cluster: `cgx-ps cluster` sets it
    security: bool = False  # listed under the CLI's security heading
    deployed: Any = None  # the default of a deployment, where it differs from the field's
    choices: tuple[str, ...] = ()
    bounds: Bounds | None = None  # of a number, in the flag's unit: every int and float setting has them

    def problem(self, field_value: Any) -> str | None:
        """Why the field value ``field_value`` is refused, naming the flag and variable; None if it
        is fine (or not a number, or not set)."""
        if self.bounds is None or field_value is None:
            return None
        value = field_value / self.unit if self.unit != 1 else field_value
        problem = self.bounds.problem(value)
        return f"{self.flag} ({self.env}) {problem}, got {plain_number(value)}" if problem else None

    @property
    def dest(self) -> str:
        """The flag's name in argparse's namespace."""
        return self.flag[2:].replace("-", "_")


# How each ServerConfig field is set outside code, in the order the CLI lists the flags.
SETTINGS: dict[str, Setting] = {
    "host": Setting("CGX_PS_HOST", "--host", "address to bind", per_shard=True),
    "port": Setting("CGX_PS_PORT", "--port", "gRPC port, 0 picks a free one", int, per_shard=True, bounds=PORT),
    "shard_index": Setting("CGX_PS_SHARD_INDEX", "--shard-index", "this shard's index", int, per_shard=True,
                           bounds=Bounds(0, MAX_SHARDS - 1)),
    "num_shards": Setting("CGX_PS_NUM_SHARDS", "--num-shards", "total shards", int, per_shard=True,
                          bounds=SHARD_COUNT),
    # Tests run many shards on one host: one built in code serves no metrics unless asked.
    # A deployed shard serves metrics on 9400 + its index unless told otherwise (cli.py), so
    # shards started by hand on one host do not collide.
    "metrics_port": Setting("CGX_PS_METRICS_PORT", "--metrics-port", "Prometheus metrics HTTP port, -1 disables, "
                            f"0 picks a free one; default {DEFAULT_METRICS_PORT} + --shard-index", int,
                            per_shard=True, deployed="", bounds=_PORT_OR_OFF),
    "metrics_host": Setting("CGX_PS_METRICS_HOST", "--metrics-host",
                            "address the metrics listen on; empty: the --host address", per_shard=True),
    "health_port": Setting("CGX_PS_HEALTH_PORT", "--health-port", "plaintext port serving only the gRPC health "
                           "service, for probes that cannot speak TLS; -1 disables", int, per_shard=True,
                           bounds=_PORT_OR_OFF),
    "data_port": Setting("CGX_PS_DATA_PORT", "--data-port", "port of the raw data plane, an opt-in beside the "
                         "gRPC port for trusted networks where the shard's CPU is the limit (Exchange streams over "
                         "plain TCP, token-checked like the gRPC port; advertised to workers at Register, used "
                         "under their CGX_PS_DATAPLANE=auto|raw); 0 picks a free one; -1 (default) turns it off; "
                         "not with --tls-cert", int, per_shard=True, bounds=_PORT_OR_OFF),
    "round_timeout_s": Setting("CGX_PS_ROUND_TIMEOUT", "--round-timeout",
                               "seconds a round may wait for its last node before it fails for everyone", float,
                               bounds=Bounds(0, _MAX_SECONDS, integer=False, above=True, unit="seconds")),
    "max_inflight_bytes": Setting("CGX_PS_MAX_INFLIGHT_MB", "--max-inflight-mb",
                                  "cap on pushed bytes buffered but not yet summed; beyond it pushes wait", float,
                                  unit=_MIB, bounds=Bounds(2 * CHUNK_BYTES / _MIB, _MAX_MIB, integer=False, unit="MiB")),
    "drain_timeout_s": Setting("CGX_PS_DRAIN_TIMEOUT", "--drain-timeout",
                               "on SIGTERM, seconds to finish rounds in flight before exiting", float,
                               bounds=Bounds(0, _MAX_SECONDS, integer=False, unit="seconds")),
    "error_feedback": Setting("CGX_PS_ERROR_FEEDBACK", "--error-feedback",
                              "carry the re-quantization error of each block into the next round", bool),
    "kernel_threads": Setting("CGX_PS_KERNEL_THREADS", "--kernel-threads", "threads summing and re-encoding "
                              "blocks; 0 = one per CPU (set 1 when the shard shares a host with workers)", int,
                              bounds=Bounds(0, _MAX_THREADS)),
    "max_model_bytes": Setting("CGX_PS_MAX_MODEL_MB", "--max-model-mb", "cap on the fp32 state (accumulators, "
                               "residuals) a job's layout may need on this shard; a larger layout is refused at "
                               "Register", float, unit=_MIB,
                               bounds=Bounds(0, _MAX_MIB, integer=False, above=True, unit="MiB")),
    "max_concurrent_rpcs": Setting("CGX_PS_MAX_CONCURRENT_RPCS", "--max-concurrent-rpcs",
                                   "calls served at once; more are refused with RESOURCE_EXHAUSTED", int,
                                   bounds=Bounds(MIN_CONCURRENT_RPCS, _MAX_CALLS)),
    "token_file": Setting("CGX_PS_TOKEN_FILE", "--token-file", "file holding the job token every call must carry "
                          "as 'authorization: Bearer <token>'", security=True),
    "tls_cert": Setting("CGX_PS_TLS_CERT", "--tls-cert", "PEM certificate chain: serve TLS; re-read when the "
                        "file changes or on SIGHUP", security=True),
    "tls_key": Setting("CGX_PS_TLS_KEY", "--tls-key", "PEM private key of --tls-cert", security=True),
    "tls_client_ca": Setting("CGX_PS_TLS_CLIENT_CA", "--tls-client-ca", "PEM CA bundle: require client "
                             "certificates it signed, mutual TLS", security=True),
    "insecure": Setting("CGX_PS_INSECURE", "--insecure", "serve a non-loopback --host with neither --token-file "
                        "nor --tls-cert: anyone who reaches the port joins the job (refused without it)", bool,
                        security=True),
    "log_level": Setting("CGX_PS_LOG_LEVEL", "--log-level", "log level", choices=LOG_LEVELS),
    # The workers' variables: one export traces a local job's shards and workers, each process
    # into a file of its own (trace.shard0.json, trace.rank0.json, ...).
    "timeline": Setting(TIMELINE_ENV, "--timeline", "write a Chrome trace (Perfetto, chrome://tracing) of the "
                        "rounds to PATH with .shard<index> before its extension, at exit"),
    "timeline_steps": Setting(TIMELINE_STEPS_ENV, "--timeline-steps", "rounds the timeline records, a:b for "
                              "a..b-1 (a: or :b open); default all (the newest 100000 events are kept)"),
}
_DEFAULTS = {f.name: f.default for f in fields(ServerConfig)}


def flag_defaults(env: Mapping[str, str]) -> dict[str, Any]:
    """Every setting's value in its flag's unit: the environment's, else the default. Raises
    ValueError naming a malformed or out-of-range variable."""
    out = {}
    for name, s in SETTINGS.items():
        default = _DEFAULTS[name] if s.deployed is None else s.deployed
        if default is None:
            default = ""
        elif s.unit != 1:
            default /= s.unit
        if s.bounds is not None:
            out[name] = env_number(env, s.env, default, s.bounds)
        elif s.kind is bool:
            out[name] = env_flag(env, s.env, default)
        else:
            out[name] = env_str(env, s.env, default)
    return out


def shard_flags(flags: Mapping[str, Any], skip: tuple[str, ...] = ()) -> list[str]:
    """Command-line flags that give a shard process the settings in ``flags`` (parsed flags,
    ``vars(args)``): all but those set per shard and those named in ``skip``."""
    argv: list[str] = []
    for name, s in SETTINGS.items():
        value = flags[s.dest] if not (s.per_shard or name in skip) else None
        if s.kind is bool and value:
            argv.append(s.flag)
        elif s.kind is not bool and value not in (None, ""):
            argv += [s.flag, str(value)]
    return argv


def _deployed_ports(fields: dict[str, Any]) -> dict[str, Any]:
    """Defaults of a deployed shard where they differ from one built in code. No metrics port:
    9400 + its index, so shards started by hand on one host (``cgx-ps server --shard-index i``
    each) do not collide."""
    if fields.get("metrics_port") is None:
        fields["metrics_port"] = DEFAULT_METRICS_PORT + fields.get("shard_index", 0)
    return fields


def _field_value(name: str, flag_value: Any) -> Any:
    if flag_value is None or (flag_value == "" and SETTINGS[name].kind is not str):
        return None  # not given, and no default of its own (the metrics port)
    if flag_value == "" and _DEFAULTS[name] is None:
        return None  # an empty path or address: not set
    unit = SETTINGS[name].unit
    return int(flag_value * unit) if unit != 1 else flag_value
