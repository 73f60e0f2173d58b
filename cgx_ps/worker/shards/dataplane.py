"""Which data plane carries a shard's Exchange stream, and the one place that opens it.

* ``decide_dataplane``: the raw plane when the shard advertises a data port (RegisterResponse)
  and the worker does not use TLS (the plane is plaintext, and under TLS it saves nothing), else
  gRPC. A pure function of its inputs, as ``gpu_setup.decide_transport``.
* ``falls_back_to_grpc``: under auto, whether a data port that cannot be reached sends the
  stream to gRPC (the shard has just answered Register: the network's doing) or is the shard's
  failure (a stream that broke mid-run: recovery's), also a pure function.
* ``open_exchange``: the stream itself, an ``ExchangeCall`` (exchange_call.py) of the plane
  those two decided: ``RawCall`` (raw_call.py) or ``GrpcExchangeCall``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc

from ...net.addresses import bare_host
from ..config import dataplane_problem
from ..errors import ConfigError, StreamEnded
from .exchange_call import ExchangeCall, GrpcExchangeCall, read_result
from .raw_call import RawCall

__all__ = ["DataplaneChoice", "decide_dataplane", "falls_back_to_grpc", "open_exchange"]

log = logging.getLogger("cgx_ps.worker.shards.client")  # the client's log: one place to read a connection's story


@dataclass(frozen=True)
class DataplaneChoice:
    """How a shard's Exchange stream travels, and what to tell the user about it."""

    plane: str  # "grpc" or "raw"
    warning: str = ""  # one log line when the choice is not what might be expected


def decide_dataplane(requested: str, advertised_port: int, tls: bool, shard: str = "") -> DataplaneChoice:
    """The transport for the Exchange stream to ``shard``; ``requested``: CGX_PS_DATAPLANE,
    ``advertised_port``: the shard's RegisterResponse.data_port (0: none), ``tls``: this worker
    reaches the shards over TLS. Raises ConfigError where ``raw`` cannot be had."""
    problem = dataplane_problem(requested, tls)
    if problem is not None:
        raise ConfigError(f"{problem} (shard {shard})")
    if requested == "grpc":
        return DataplaneChoice("grpc")
    if requested == "raw" and not advertised_port:
        raise ConfigError(f"CGX_PS_DATAPLANE=raw, but shard {shard} advertises no data port: start it with "
                          f"--data-port (CGX_PS_DATA_PORT), or use CGX_PS_DATAPLANE=auto")
    if not advertised_port:
        return DataplaneChoice("grpc")
    if tls:
        return DataplaneChoice("grpc", f"shard {shard} advertises a plaintext data port, but this worker uses "
                                       f"TLS: its Exchange stream stays on gRPC")
    return DataplaneChoice("raw")


def falls_back_to_grpc(requested: str, just_registered: bool) -> bool:
    """Under CGX_PS_DATAPLANE=``requested``, does a raw data plane connection that failed send the
    stream to gRPC? Only under auto, and only right after the shard answered Register (a first
    connect, or a rejoin of a restarted shard, which may listen on a new port): a port that cannot
    be reached then is a firewall, a NetworkPolicy or a port-forward of the gRPC port alone. On a
    stream repaired without a new Register (the plane worked for this registration), it is the
    shard's failure, which recovery retries; under raw, it always is."""
    return requested == "auto" and just_registered


def _unavailable(details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


async def open_exchange(address: str, channel: grpc.aio.Channel, metadata: tuple[tuple[str, str], ...],
                        data_port: int, token: bytes, may_fall_back: bool) -> ExchangeCall:
    """An Exchange stream to the shard at ``address``: over its raw data plane at ``data_port``
    (0: none, or not to be used: decide_dataplane) with the job ``token``, else over gRPC on
    ``channel`` with ``metadata``. A data port that cannot be reached sends the stream to gRPC,
    with one warning, where ``may_fall_back`` (falls_back_to_grpc); otherwise its StreamEnded
    (UNAVAILABLE: recovery retries it) is raised. The call's ``plane`` says which it took."""
    if data_port:
        try:
            return await RawCall.open(bare_host(address.rsplit(":", 1)[0]), data_port, token, read_result)
        except StreamEnded as exc:
            if not may_fall_back:
                raise
            log.warning("shard %s: its data port %d cannot be reached (%s): the Exchange stream goes over gRPC "
                        "(set CGX_PS_DATAPLANE=grpc to skip the attempt, or open the port)", address, data_port,
                        exc.details)
    return GrpcExchangeCall(channel, metadata)
