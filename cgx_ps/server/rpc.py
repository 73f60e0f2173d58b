"""The ParameterServer service on the wire: authentication, parsing, status codes and logging.

Handlers are registered with raw-bytes deserializers, so each call goes through one gate, in
this order, before the service sees it:

1. the job token (``authorization: Bearer ...``, constant-time) when the shard has one:
   UNAUTHENTICATED before a byte of the body is parsed;
2. draining: a shard shutting down takes no new calls (UNAVAILABLE), except Exchange streams,
   which finish the rounds in flight, and Status, which says so;
3. parsing: a malformed message is INVALID_ARGUMENT, never UNKNOWN with a traceback.

Refusals and failures are logged as one line each, rate-limited per method, so a hostile client
cannot fill the log (a gRPC default would log a full traceback per bad message).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message

from ..security import bearer_matches
from ..v1 import ps_pb2
from .aggregator import PushRejected

__all__ = ["SERVICE_NAME", "RateLimitedLog", "add_parameter_server", "read_message", "parse_message"]

SERVICE_NAME = "cgx_ps.v1.ParameterServer"
log = logging.getLogger("cgx_ps.server.rpc")
M = TypeVar("M", bound=Message)


class RateLimitedLog:
    """At most ``burst`` lines per ``window_s`` per key; what is dropped is counted and reported
    with the next line that gets through."""

    def __init__(self, logger: logging.Logger, burst: int = 10, window_s: float = 10.0) -> None:
        self.logger, self.burst, self.window_s = logger, burst, window_s
        self._windows: dict[str, tuple[float, int, int]] = {}  # key -> (start, logged, dropped)

    def warning(self, key: str, message: str, *args: object) -> None:
        now = time.monotonic()
        start, logged, dropped = self._windows.get(key, (now, 0, 0))
        if now - start >= self.window_s:
            start, logged = now, 0
        if logged >= self.burst:
            self._windows[key] = (start, logged, dropped + 1)
            return
        if dropped:
            message += f" ({dropped} similar lines suppressed)"
        self._windows[key] = (start, logged + 1, 0)
        self.logger.warning(message, *args)

    def __len__(self) -> int:  # keys seen: bounded by the number of methods, not by callers
        return len(self._windows)


def parse_message(cls: type[M], raw: bytes) -> M:
    """Parse a request; a malformed one is the client's fault (INVALID_ARGUMENT)."""
    message = cls()
    try:
        message.ParseFromString(raw)
    except (DecodeError, RuntimeError, ValueError) as exc:  # protobuf raises these on corrupt input
        raise PushRejected(grpc.StatusCode.INVALID_ARGUMENT,
                           f"malformed {cls.DESCRIPTOR.name}: {str(exc)[:100]}") from None
    return message


async def read_message(context: grpc.aio.ServicerContext, cls: type[M]) -> M | Any:
    """The next message of a client stream, parsed (or grpc.aio.EOF)."""
    raw = await context.read()
    if raw is grpc.aio.EOF:
        return raw
    return parse_message(cls, raw)


Handler = Callable[..., Awaitable[Any]]


class _Gate:
    """Token, draining and error mapping around every method of the service."""

    def __init__(self, service: Any, token: bytes | None) -> None:
        self.service = service
        self.token = token
        self.log = RateLimitedLog(log)

    def refusal(self, method: str, context: grpc.aio.ServicerContext) -> tuple[grpc.StatusCode, str] | None:
        """Why a call may not proceed (before its body is read), or None."""
        if self.token is not None and not bearer_matches(context.invocation_metadata(), self.token):
            return grpc.StatusCode.UNAUTHENTICATED, "missing or wrong job token (authorization: Bearer ...)"
        if self.service.draining and method not in ("Exchange", "Status"):
            return grpc.StatusCode.UNAVAILABLE, "shard is shutting down"
        return None

    async def run(self, method: str, context: grpc.aio.ServicerContext, call: Callable[[], Awaitable[Any]]) -> Any:
        refused = self.refusal(method, context)
        if refused is not None:
            self.log.warning(f"refused:{method}", "%s refused from %s: %s", method, context.peer(), refused[1])
            await context.abort(*refused)
        # Abort after the except blocks, not inside them: an exception raised there would chain
        # the caught one, whose traceback holds the request (up to 8 MiB) in a reference cycle
        # that only the cyclic GC frees, so a flood of bad calls would grow memory.
        try:
            return await call()
        except PushRejected as exc:
            code, message = exc.code, exc.message
            self.log.warning(f"rejected:{method}", "%s from %s: %s: %s", method, context.peer(), code.name, message)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise  # the client went away, or the service aborted with its own status
        except Exception as exc:  # noqa: BLE001 - a bug must not become a traceback per message
            code, message = grpc.StatusCode.INTERNAL, f"shard error in {method}: {type(exc).__name__}"
            self.log.warning(f"error:{method}", "%s from %s: unexpected %r", method, context.peer(), exc)
            log.debug("traceback", exc_info=True)
        await context.abort(code, message)


def add_parameter_server(server: grpc.aio.Server, service: Any, token: bytes | None, status: Any = None) -> None:
    """Register ``service`` (a ParameterServerService) behind the gate, and ``status`` (a
    ShardStatus, cgx_ps/server/status.py) for the Status method."""
    gate = _Gate(service, token)
    def serialize(message: Message) -> bytes:
        return message.SerializeToString()

    def unary(method: str, request_cls: type[Message], target: Any = service) -> Handler:
        async def handler(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
            return await gate.run(method, context,
                                  lambda: getattr(target, method)(parse_message(request_cls, raw), context))
        return handler

    def streaming(method: str) -> Handler:
        # The service reads its own messages (read_message), so a stream can be refused
        # before its first message is read.
        async def handler(request_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
            return await gate.run(method, context, lambda: getattr(service, method)(context))
        return handler

    handlers = {
        "Register": grpc.unary_unary_rpc_method_handler(unary("Register", ps_pb2.RegisterRequest),
                                                        response_serializer=serialize),
        "SetCodecs": grpc.unary_unary_rpc_method_handler(unary("SetCodecs", ps_pb2.SetCodecsRequest),
                                                         response_serializer=serialize),
        "GetBlob": grpc.unary_stream_rpc_method_handler(unary("GetBlob", ps_pb2.GetBlobRequest),
                                                        response_serializer=serialize),
        "Exchange": grpc.stream_stream_rpc_method_handler(streaming("Exchange"), response_serializer=serialize),
        "PutBlob": grpc.stream_unary_rpc_method_handler(streaming("PutBlob"), response_serializer=serialize),
        "Probe": grpc.stream_unary_rpc_method_handler(streaming("Probe"), response_serializer=serialize),
    }
    if status is not None:
        handlers["Status"] = grpc.unary_unary_rpc_method_handler(unary("Status", ps_pb2.StatusRequest, status),
                                                                 response_serializer=serialize)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
