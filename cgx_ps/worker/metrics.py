"""Prometheus metrics of one training process, from what ``step()`` reports.

Off unless ``CGX_PS_WORKER_METRICS_PORT`` is set. Then each process serves ``/metrics`` on that
port plus its LOCAL_RANK (the ranks of a node share an address), from its first step on; 0 picks
a free port (logged). They listen on ``CGX_PS_WORKER_METRICS_HOST`` (default 0.0.0.0, for a
Prometheus elsewhere; labels name tensors, so keep the port inside the job's network, as the
shards' metrics). Every metric has a ``rank`` label:

    cgx_ps_worker_steps_total                        steps taken
    cgx_ps_worker_step_seconds                       histogram: from one step() to the next
    cgx_ps_worker_exposed_comm_seconds               histogram: how long step() waited for blocks
    cgx_ps_worker_bytes_pushed_total                 compressed bytes this process pushed
    cgx_ps_worker_fp32_bytes_total                   what the same blocks weigh in fp32
    cgx_ps_worker_compression_ratio                  fp32 / pushed bytes, last step that pushed
    cgx_ps_worker_compressed                         1 while steps travel compressed (0: warm-up,
                                                     or auto mode chose not to)
    cgx_ps_worker_tensor_bits{tensor}                bits adaptive compression chose per tensor
    cgx_ps_worker_auto_decisions_total{mode,reason}  auto mode's decisions and what decided them

The optimizer calls ``after_step(stats, decisions)`` once at the end of ``step()``: that is the
whole coupling. ``stats`` is its public ``StepStats``; ``decisions`` the tuner's list of
decisions so far, of which this module reads the ones it has not seen.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from ..envparse import PORT, env_number
from .errors import ConfigError

__all__ = ["ENV_HOST", "ENV_PORT", "WorkerMetrics", "after_step"]

ENV_PORT = "CGX_PS_WORKER_METRICS_PORT"
ENV_HOST = "CGX_PS_WORKER_METRICS_HOST"
log = logging.getLogger(__name__)
_STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class WorkerMetrics:
    """The metrics of one process, in a registry of their own."""

    def __init__(self, rank: int) -> None:
        self.registry = r = CollectorRegistry()
        labels = {"rank": str(rank)}
        self.steps = Counter("cgx_ps_worker_steps", "Optimizer steps taken", ["rank"], registry=r).labels(**labels)
        self.step_seconds = Histogram("cgx_ps_worker_step_seconds", "Time from one step() to the next",
                                      ["rank"], buckets=_STEP_BUCKETS, registry=r).labels(**labels)
        self.exposed = Histogram("cgx_ps_worker_exposed_comm_seconds",
                                 "Time step() waited for communication still in flight", ["rank"],
                                 buckets=_STEP_BUCKETS, registry=r).labels(**labels)
        self.bytes_pushed = Counter("cgx_ps_worker_bytes_pushed", "Compressed bytes this process pushed",
                                    ["rank"], registry=r).labels(**labels)
        self.fp32_bytes = Counter("cgx_ps_worker_fp32_bytes", "What the pushed blocks weigh uncompressed (fp32)",
                                  ["rank"], registry=r).labels(**labels)
        self.ratio = Gauge("cgx_ps_worker_compression_ratio", "fp32 / pushed bytes of the last step that pushed",
                           ["rank"], registry=r).labels(**labels)
        self.compressed = Gauge("cgx_ps_worker_compressed", "1 while steps travel compressed, 0 uncompressed",
                                ["rank"], registry=r).labels(**labels)
        self.tensor_bits = Gauge("cgx_ps_worker_tensor_bits", "Bits per element adaptive compression chose",
                                 ["rank", "tensor"], registry=r)
        self.non_finite_steps = Counter("cgx_ps_worker_non_finite_steps", "Steps whose gradient on this rank had "
                                        "NaN/Inf (allow_non_finite: every rank decodes NaN, a GradScaler skips them)",
                                        ["rank"], registry=r).labels(**labels)
        self.auto_decisions = Counter("cgx_ps_worker_auto_decisions", "Auto mode decisions: compress or not, and why",
                                      ["rank", "mode", "reason"], registry=r)
        self._rank = str(rank)
        self._last_step: float | None = None
        self._decisions_seen = 0

    def observe(self, stats: Any, decisions: Sequence[Mapping[str, Any]] = ()) -> None:
        """Record one finished step (``stats``: a StepStats) and any new tuning decisions."""
        now = time.perf_counter()
        if self._last_step is not None:
            self.step_seconds.observe(now - self._last_step)
        self._last_step = now
        self.steps.inc()
        self.exposed.observe(stats.exposed_comm_s)
        self.bytes_pushed.inc(stats.bytes_pushed)
        self.fp32_bytes.inc(stats.fp32_bytes)
        if stats.bytes_pushed:  # 0: another local rank pushed every block this step
            self.ratio.set(stats.fp32_bytes / stats.bytes_pushed)
        self.compressed.set(1 if stats.compressed else 0)
        if getattr(stats, "non_finite_tensors", ()):
            self.non_finite_steps.inc()
        for decision in decisions[self._decisions_seen:]:
            decision = decision.as_dict() if hasattr(decision, "as_dict") else decision  # a tuner Decision
            for tensor, bits in decision.get("bits", {}).items():
                self.tensor_bits.labels(rank=self._rank, tensor=tensor).set(bits)
            if "compress" in decision:
                # the reason's figures vary; its kind ("model", "measured", ...) is a bounded label
                reason = str(decision.get("reason", "")).split(" (")[0] or "unknown"
                self.auto_decisions.labels(rank=self._rank, mode="compress" if decision["compress"] else "fp32",
                                           reason=reason).inc()
        self._decisions_seen = len(decisions)


class _Exporter:
    """Started on the first step, so a process that never trains opens no port."""

    def __init__(self) -> None:
        self.metrics: WorkerMetrics | None = None
        self.started = False
        self.port = -1

    def start(self, env: Mapping[str, str]) -> None:
        self.started = True
        base = env_number(env, ENV_PORT, None, PORT, ConfigError)
        if base is None:
            return
        from .runtime import current_config

        config = current_config()
        port = base + config.local_rank if base else 0
        if port > PORT.high:
            raise ConfigError(f"{ENV_PORT}={base} + LOCAL_RANK={config.local_rank} is past port {PORT.high:g}")
        metrics = WorkerMetrics(config.rank)
        try:
            server, _ = start_http_server(port, addr=env.get(ENV_HOST, "").strip() or "0.0.0.0",
                                          registry=metrics.registry)
        except OSError as exc:  # metrics are optional: training goes on without them
            log.warning("rank %d: cannot serve worker metrics on port %d (%s + LOCAL_RANK): %s; training goes on "
                        "without them", config.rank, port, ENV_PORT, exc.strerror or exc)
            return
        self.metrics, self.port = metrics, server.server_port
        log.info("rank %d: worker metrics on port %d", config.rank, self.port)


_exporter = _Exporter()


def after_step(stats: Any, decisions: Sequence[Mapping[str, Any]] = (), env: Mapping[str, str] | None = None) -> None:
    """The hook ``step()`` calls; does nothing unless CGX_PS_WORKER_METRICS_PORT is set."""
    if not _exporter.started:
        _exporter.start(os.environ if env is None else env)
    if _exporter.metrics is not None:
        _exporter.metrics.observe(stats, decisions)
