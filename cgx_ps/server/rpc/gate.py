"""The ParameterServer service on the wire: authentication, parsing, status codes and logging.

Handlers are registered with raw-bytes deserializers, so each call goes through one gate, in
this order, before the service sees it:

1. the job token (``authorization: Bearer ...``, constant-time) when the shard has one:
   UNAUTHENTICATED before a byte of the body is parsed;
2. draining: a shard shutting down takes no new calls (UNAVAILABLE), except Exchange streams,
   which finish the rounds in flight, and Status, which says so;
3. parsing: a malformed message is INVALID_ARGUMENT, never UNKNOWN with a traceback.

A refusal is a domain error (errors.py); STATUS_CODES, the one table from those errors to gRPC
status codes, gives the status the caller sees. Refusals and failures are logged as one line
each, rate-limited per method, so a hostile client cannot fill the log (a gRPC default would log
a full traceback per bad message).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable, TypeVar

import grpc
from grpc._cython import cygrpc as _cygrpc
from google.protobuf.message import DecodeError, Message

from ...net.security import bearer_matches
from ...v1 import ps_pb2
from ...rate_limited_log import RateLimitedLog
from ..errors import (AlreadyExists, BadRequest, Busy, Conflict, Forbidden, InternalError, LimitExceeded, NotMember,
                      ProtocolError, SessionEnded, ShuttingDown, StreamAborted, TimedOut, Unauthenticated, WrongRound)
from .stream_context import GrpcContext, StreamContext, StreamEnded

__all__ = ["MAX_DETAILS_CHARS", "SERVICE_NAME", "STATUS_CODES", "Gate", "add_parameter_server",
           "add_wrong_port_answer", "clip", "grpc_status", "read_message", "parse_message"]

SERVICE_NAME = "cgx_ps.v1.ParameterServer"
log = logging.getLogger("cgx_ps.server.rpc.gate")
M = TypeVar("M", bound=Message)

# What a refusal looks like on the wire: the one table from domain errors to status codes.
# ps.proto's header lists exactly these codes (tests/test_proto.py checks it); workers retry on
# UNAVAILABLE and DEADLINE_EXCEEDED, and take ABORTED for a round that failed for everyone.
STATUS_CODES: dict[type[ProtocolError], grpc.StatusCode] = {
    BadRequest: grpc.StatusCode.INVALID_ARGUMENT,
    AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    NotMember: grpc.StatusCode.FAILED_PRECONDITION,
    Forbidden: grpc.StatusCode.PERMISSION_DENIED,
    Conflict: grpc.StatusCode.FAILED_PRECONDITION,
    WrongRound: grpc.StatusCode.FAILED_PRECONDITION,
    SessionEnded: grpc.StatusCode.FAILED_PRECONDITION,
    StreamAborted: grpc.StatusCode.ABORTED,
    Busy: grpc.StatusCode.UNAVAILABLE,
    ShuttingDown: grpc.StatusCode.UNAVAILABLE,
    LimitExceeded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    TimedOut: grpc.StatusCode.DEADLINE_EXCEEDED,
    InternalError: grpc.StatusCode.INTERNAL,
}


# Status details travel in HTTP/2 trailers, which gRPC clients cap at 16 KiB: a reason that
# quotes a hostile request's field (an 800 kB node id, a tensor name) would arrive as an
# unrelated RESOURCE_EXHAUSTED. Every message is clipped here, in the one place all pass.
MAX_DETAILS_CHARS = 1024


def clip(text: str, limit: int = MAX_DETAILS_CHARS) -> str:
    return text if len(text) <= limit else f"{text[:limit - 40]}... ({len(text)} characters, clipped)"


def grpc_status(error: ProtocolError) -> tuple[grpc.StatusCode, str]:
    """The status code and details ``error`` travels as: the table's code for its class, or for
    the nearest base class in it (a blob store error is also a BadRequest, a TimedOut...)."""
    for cls in type(error).__mro__:
        code = STATUS_CODES.get(cls)
        if code is not None:
            return code, clip(error.message)
    return grpc.StatusCode.INTERNAL, clip(error.message)  # a class missing from the table is a bug


def parse_message(cls: type[M], raw: bytes) -> M:
    """Parse a request; a malformed one is the client's fault (INVALID_ARGUMENT)."""
    message = cls()
    try:
        message.ParseFromString(raw)
    except (DecodeError, RuntimeError, ValueError) as exc:  # protobuf raises these on corrupt input
        raise BadRequest(f"malformed {cls.DESCRIPTOR.name}: {str(exc)[:100]}") from None
    return message


async def read_message(context: StreamContext, cls: type[M]) -> M | Any:
    """The next message of a client stream, parsed (or grpc.aio.EOF)."""
    raw = await context.read()
    if raw is grpc.aio.EOF:
        return raw
    return parse_message(cls, raw)


async def discard_rest(context: StreamContext, timeout_s: float) -> None:
    """Read and drop what is left of a client stream, until its end or ``timeout_s``, before a
    refusal: a grpc.aio client still writing when the call ends is told INTERNAL "Internal error
    from Core" instead of the refusal (grpc/grpc#36066). Raw messages, one at a time: nothing is
    parsed or kept here, and the call is bounded in time as an accepted one is. The bound holds
    only if the caller keeps nothing big either while it awaits this: call it outside an
    ``except`` block, with the refusal stripped of its traceback (errors.without_tracebacks),
    which would otherwise keep the refused request's frames and buffers alive until the end."""
    async def drain() -> None:
        while await context.read() is not grpc.aio.EOF:
            pass

    try:
        await asyncio.wait_for(drain(), timeout_s)
    except asyncio.TimeoutError:
        pass  # a client that never finishes gets the refusal now, however its library reports it


Handler = Callable[..., Awaitable[Any]]


class Gate:
    """Token, draining and error mapping around every method of the service (and around the raw
    data plane's Exchange streams: server/rpc/raw_stream.py passes them through ``run`` too)."""

    def __init__(self, service: Any, token: bytes | None) -> None:
        self.service = service
        self.token = token
        self.log = RateLimitedLog(log)

    def refusal(self, method: str, context: StreamContext) -> ProtocolError | None:
        """Why a call may not proceed (before its body is read), or None."""
        if self.token is not None and not bearer_matches(context.invocation_metadata(), self.token):
            # named as the caller presents it: a raw data plane stream proves it (raw_stream.py)
            return Unauthenticated(f"missing or wrong job token ({context.token_presented_as})")
        if self.service.draining and method not in ("Exchange", "Status"):
            return ShuttingDown("shard is shutting down")
        return None

    async def run(self, method: str, context: StreamContext, call: Callable[[], Awaitable[Any]]) -> Any:
        refused = self.refusal(method, context)
        if refused is not None:
            self.log.warning(f"refused:{method}", "%s refused from %s: %s", method, context.peer(), refused.message)
            await context.abort(*grpc_status(refused))
        # Abort after the except blocks, not inside them: an exception raised there would chain
        # the caught one, whose traceback holds the request (up to 8 MiB) in a reference cycle
        # that only the cyclic GC frees, so a flood of bad calls would grow memory.
        try:
            return await call()
        except ProtocolError as exc:
            code, message = grpc_status(exc)
            self.log.warning(f"rejected:{method}", "%s from %s: %s: %s", method, context.peer(), code.name, message)
        except (asyncio.CancelledError, grpc.aio.AbortError, StreamEnded, _ExecuteBatchError):
            # the client went away, or the service aborted with its own status; an abort that
            # failed because the client is gone must not be answered by a second abort (gRPC
            # logs "Abort already called!" with a traceback for that)
            raise
        except Exception as exc:  # noqa: BLE001 - a bug must not become a traceback per message
            code, message = grpc_status(InternalError(f"shard error in {method}: {type(exc).__name__}"))
            self.log.warning(f"error:{method}", "%s from %s: unexpected %r", method, context.peer(), exc)
            log.debug("traceback", exc_info=True)
        await context.abort(code, message)


# What a service's own context.abort raises when the call has already ended (private to grpc,
# stable since grpc.aio exists; looked up so a rename degrades to "caught as unexpected").
_ExecuteBatchError = getattr(_cygrpc, "ExecuteBatchError", asyncio.CancelledError)


def add_parameter_server(server: grpc.aio.Server, service: Any, token: bytes | None, status: Any = None) -> Gate:
    """Register ``service`` (a ParameterServerService) behind the gate, and ``status`` (a
    ShardStatus, cgx_ps/server/rpc/shard_status.py) for the Status method; the gate, which the raw data
    plane shares."""
    gate = Gate(service, token)
    def serialize(message: Message | bytes) -> bytes:
        # results are serialized once for all nodes (frames.result_frames) and pass as they are
        return message if isinstance(message, bytes) else message.SerializeToString()

    def unary(method: str, request_cls: type[Message], target: Any = service) -> Handler:
        async def handler(raw: bytes, servicer_context: grpc.aio.ServicerContext) -> Any:
            context = GrpcContext(servicer_context)
            return await gate.run(method, context,
                                  lambda: getattr(target, method)(parse_message(request_cls, raw), context))
        return handler

    def streaming(method: str) -> Handler:
        # The service reads its own messages (read_message), so a stream can be refused
        # before its first message is read.
        async def handler(request_iterator: Any, servicer_context: grpc.aio.ServicerContext) -> Any:
            context = GrpcContext(servicer_context)
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
    return gate


def add_wrong_port_answer(server: grpc.aio.Server, details: str) -> None:
    """On a port that serves no ParameterServer (the plaintext --health-port): every method of it
    answers UNIMPLEMENTED with ``details``, which say which port to use. gRPC's own answer,
    "Method not found!", reads as a shard too old to have the method (`cgx-ps status` said so).
    Nothing the caller sends is read or parsed."""
    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, details)

    kinds = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
             (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
    methods = ps_pb2.DESCRIPTOR.services_by_name[SERVICE_NAME.rsplit(".", 1)[1]].methods
    handlers = {m.name: kinds[m.client_streaming, m.server_streaming](refuse) for m in methods}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
