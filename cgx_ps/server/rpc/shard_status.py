"""What a shard says about itself: the Status RPC behind ``cgx-ps status``, and the session gauges.

    status = ShardStatus(service)        # before the service handles a call; close() at stop
    add_parameter_server(server, service, token, status=status)

Everything is read when asked, from the service's public state and the shard's Prometheus
registry, so the numbers ``cgx-ps status`` prints and the ones Prometheus scrapes are the same
counters. Nothing here changes the service. The last error is the last WARNING or ERROR line
under the ``cgx_ps.server`` logger: every refusal, rejected push and failed round is logged as
one line already, so this needs no hook in the code that fails. A process serving several shards
(tests) shares that line between them.
"""

from __future__ import annotations

import logging
import time
from typing import Iterator

from prometheus_client.core import GaugeMetricFamily

from ... import __version__
from ...v1 import ps_pb2
from ..errors import WITHHELD
from .service import ParameterServerService
from .stream_context import StreamContext

__all__ = ["ShardStatus"]

_MAX_ERROR_CHARS = 500
State = ps_pb2.SessionState


class _LastError(logging.Handler):
    """Keeps the text and time of the last WARNING+ record (not the record: it may hold a traceback)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.message = ""
        self.at = 0.0

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
        except Exception:  # noqa: BLE001 - a bad format string must not break logging
            text = str(record.msg)
        self.message, self.at = f"{record.levelname}: {text[:_MAX_ERROR_CHARS]}", time.monotonic()


class ShardStatus:
    def __init__(self, service: ParameterServerService) -> None:
        self.service = service
        self.metrics = service.metrics
        self.started = time.monotonic()
        self._errors = _LastError()
        self._logger = logging.getLogger("cgx_ps.server")
        self._logger.addHandler(self._errors)
        self.metrics.registry.register(_SessionCollector(self))

    def close(self) -> None:
        self._logger.removeHandler(self._errors)

    async def Status(self, request: ps_pb2.StatusRequest, context: StreamContext  # noqa: N802
                     ) -> ps_pb2.StatusResponse:
        return self.snapshot()

    def session_state(self) -> int:
        session = self.service.session
        if session is None:
            return State.SESSION_STATE_NONE
        if session.aggregator.failed is not None or session.ended is not None:
            return State.SESSION_STATE_FAILED
        return State.SESSION_STATE_ACTIVE if session.streams else State.SESSION_STATE_IDLE

    def snapshot(self) -> ps_pb2.StatusResponse:
        service, config, now = self.service, self.service.config, time.monotonic()
        reply = ps_pb2.StatusResponse(
            shard_index=config.shard_index, num_shards=config.num_shards, server_version=__version__,
            instance_id=service.instance_id, uptime_s=now - self.started, draining=service.draining,
            session_state=self.session_state(), rounds_total=self._counter("cgx_ps_rounds_total"),
            rounds_failed=self._counter("cgx_ps_rounds_failed_total"),
            bytes_in=self._counter("cgx_ps_bytes_in_total"), bytes_out=self._counter("cgx_ps_bytes_out_total"),
            pushes_rejected=self._rejected(), inflight_bytes=max(service.budget.used, 0),
            max_inflight_bytes=service.budget.capacity, data_port=service.data_port,
        )
        session = service.session
        if session is not None:
            reply.job_id = session.job_id if config.authenticates else ""
            reply.num_nodes = session.num_nodes
            reply.nodes_registered = len(session.nodes)
            reply.members_registered = sum(len(members) for members in session.nodes.values())
            reply.streams_open = len(session.streams)
            reply.blocks_owned = len(session.aggregator.blocks)
            reply.rounds_completed = self.rounds_completed()
            reply.idle_s = now - session.last_activity
            reply.quorum, reply.grace_ms = session.quorum_settings
            if config.authenticates:  # node names, as job_id: not for strangers
                late = sorted(session.late.total.items())
                reply.late_nodes.extend(node for node, _ in late)
                reply.late_pushes.extend(count for _, count in late)
        if self._errors.message:
            reply.last_error = self._errors.message if config.authenticates else WITHHELD
            reply.last_error_age_s = now - self._errors.at
        return reply

    def rounds_completed(self) -> int:
        """Rounds every owned block of the session has completed (the slowest block's count)."""
        session = self.service.session
        if session is None or not session.aggregator.blocks:
            return 0
        return min(session.aggregator.next_round(b) for b in session.aggregator.blocks)

    def _counter(self, name: str) -> int:
        return int(self.metrics.registry.get_sample_value(name, {"shard": self.metrics.shard}) or 0)

    def _rejected(self) -> int:
        return int(sum(s.value for family in self.metrics.pushes.collect() for s in family.samples
                       if s.name.endswith("_total") and s.labels.get("outcome") == "rejected"))


class _SessionCollector:
    """Gauges computed at scrape time from the same state Status reports."""

    def __init__(self, status: ShardStatus) -> None:
        self.status = status

    def collect(self) -> Iterator[GaugeMetricFamily]:
        status, shard = self.status, [self.status.metrics.shard]
        session = status.service.session

        def gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, documentation, labels=["shard"])
            family.add_metric(shard, value)
            return family

        yield gauge("cgx_ps_max_inflight_bytes", "Cap on pushed bytes buffered, not yet summed (--max-inflight-mb)",
                    status.service.budget.capacity)
        state = GaugeMetricFamily("cgx_ps_session_state", "1 for the session's current state, 0 for the others",
                                  labels=["shard", "state"])
        current = status.session_state()
        for name, value in State.items():
            if value != State.SESSION_STATE_UNSPECIFIED:
                state.add_metric([*shard, name.removeprefix("SESSION_STATE_").lower()], float(value == current))
        yield state
        yield gauge("cgx_ps_session_nodes", "Nodes registered in the current session",
                    len(session.nodes) if session else 0)
        yield gauge("cgx_ps_session_expected_nodes", "Nodes the current session expects",
                    session.num_nodes if session else 0)
        yield gauge("cgx_ps_session_rounds_completed",
                    "Rounds every owned block of the current session completed (0 again after a new session)",
                    status.rounds_completed())
