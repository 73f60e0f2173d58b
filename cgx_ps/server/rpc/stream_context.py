"""What the service and the gate use of a call, whichever way it came: ``StreamContext``.

A call reaches the shard on its gRPC port (grpc.aio hands the handler a ServicerContext) or, for
an Exchange stream, on the raw data plane (server/rpc/raw_stream.py). The service reads and
writes through the one protocol below and never asks which; the gate (gate.py) checks the token
in ``invocation_metadata`` and ends a refused call with ``abort``. ``GrpcContext`` is the gRPC
port's adapter: grpc.aio's own bound methods, so a message costs no extra call.

How a call ends, the same on both planes:

- ``abort(code, details)`` sends the status and raises; what it raises (grpc.aio's AbortError, or
  ``StreamEnded`` on the data plane) means "the status is out", and the gate passes it on;
- ``read()`` returns ``EOF`` once the client has half-closed;
- a client that goes away cancels its handler; the data plane's ``read`` may also raise a
  ConnectionError when it notices first (grpc.aio's never does).
"""

from __future__ import annotations

from typing import Any, NoReturn, Protocol, Sequence

import grpc

__all__ = ["EOF", "GrpcContext", "StreamContext", "StreamEnded"]

EOF = grpc.aio.EOF  # what ``read`` returns at the client's half-close, on both planes


class StreamEnded(Exception):
    """The handler ended its stream with a status, already sent (``abort``), or its client is
    gone; nothing is left to tell it. The data plane's counterpart of grpc.aio's AbortError."""


class StreamContext(Protocol):
    """One call's side of the shard: its messages, its status, who sent it."""

    plane: str  # how it came: "grpc" (its port) or "raw" (the data plane); metrics.PLANES
    lost_as: str  # what a log line calls its transport when the client goes away
    token_presented_as: str  # how the job token travels on this plane, as the gate's refusal names it

    def invocation_metadata(self) -> Sequence[tuple[str, Any]]:
        """The call's metadata: ``authorization: Bearer <token>`` when the job token came with it."""

    def peer(self) -> str:
        """The client, as gRPC names it: ipv4:10.0.0.5:41234."""

    async def read(self) -> Any:
        """The client's next message (serialized bytes, or a buffer), or ``EOF``."""

    async def write(self, message: Any) -> None:
        """One message to the client: a protobuf message, or bytes serialized once for many."""

    async def abort(self, code: grpc.StatusCode, details: str = "") -> NoReturn:
        """End the call with this status; raises (AbortError or StreamEnded) once it is sent."""


class GrpcContext:
    """``StreamContext`` over a grpc.aio ServicerContext (the gRPC port's every call)."""

    plane = "grpc"
    lost_as = "gRPC call"
    token_presented_as = "authorization: Bearer ..."
    __slots__ = ("servicer_context", "read", "write", "abort", "peer", "invocation_metadata")

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        self.servicer_context = context
        # bound once: the hot path (a push per message) goes to grpc.aio with no call in between
        self.read, self.write, self.abort = context.read, context.write, context.abort
        self.peer, self.invocation_metadata = context.peer, context.invocation_metadata
