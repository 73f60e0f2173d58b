"""Making the calls: a Plan's raw bytes sent on a method with the blocking gRPC API, and the
status the shard ended the call with."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import grpc

from .settings import CLIENT_STREAMS, SERVER_STREAMS, SERVICE
from .world import Plan

@dataclass
class Outcome:
    code: str
    details: str = ""


def call(channel: grpc.Channel, method: str, plan: Plan, metadata) -> Outcome:
    """Send a plan's raw messages on ``method`` and return how the shard ended the call.

    Blocking gRPC, run on a thread: grpc.aio turns a write that comes after the shard has ended
    the call into a local INTERNAL ("Internal error from Core") and loses the shard's status;
    the blocking API stops writing then and reports the status the shard sent."""
    path = f"/{SERVICE}/{method}"
    try:
        if method in CLIENT_STREAMS:
            return client_stream(channel, path, method in SERVER_STREAMS, plan, metadata)
        message = plan.messages[0] if plan.messages else b""
        if method not in SERVER_STREAMS:
            channel.unary_unary(path)(message, metadata=metadata, timeout=plan.deadline)
            return Outcome("OK")
        responses = channel.unary_stream(path)(message, metadata=metadata, timeout=plan.deadline)
        if plan.ending == "cancel":
            threading.Timer(0.05, responses.cancel).start()
        return finish(responses, read=True)
    except grpc.RpcError as exc:
        return Outcome(exc.code().name, exc.details() or "")


def client_stream(channel: grpc.Channel, path: str, server_streams: bool, plan: Plan, metadata) -> Outcome:
    """A client-streaming call: the plan's messages, then a half-close (``close``), nothing until
    the call ends (``stall``) or a cancel (``cancel``)."""
    started, ended = threading.Event(), threading.Event()
    holder: list = []

    def requests():
        yield from plan.messages
        if plan.ending == "cancel":
            started.wait()
            time.sleep(0.05)
            holder[0].cancel()
        if plan.ending != "close":
            ended.wait(plan.deadline + 5)  # no half-close: the stream stays open until it ends

    if server_streams:
        rpc = channel.stream_stream(path)(requests(), metadata=metadata, timeout=plan.deadline)
    else:
        rpc = channel.stream_unary(path).future(requests(), metadata=metadata, timeout=plan.deadline)
    holder.append(rpc)
    started.set()
    rpc.add_done_callback(lambda *_: ended.set())
    return finish(rpc, read=server_streams)


def finish(rpc, read: bool) -> Outcome:
    """Wait for the end of a call (reading and dropping a server stream's responses, so flow
    control never holds the shard) and return its status."""
    try:
        if read:
            for _ in rpc:
                pass
        else:
            rpc.result()
    except (grpc.RpcError, grpc.FutureCancelledError):
        pass
    return Outcome(rpc.code().name, rpc.details() or "")
