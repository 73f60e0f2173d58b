"""One data plane connection on the shard: an asyncio BufferedProtocol that the transport fills
with frames (``FrameReader``, net/raw_frames.py, decodes them in place: no copy in Python), and
the ``FrameStream`` (raw_stream.py) its handler reads and writes. The listener (raw_listener.py)
admits it, serves it, and forgets it when it closes.

What it adds to the framing, against a hostile network (raw_listener.py's docstring lists the
rest): reading pauses after each whole frame until the handler asks for the next, so a stream
holds at most one unread frame and the push budget's backpressure reaches TCP; a frame, once its
first byte is in, must be whole within the listener's ``frame_timeout_s``; a stream's status
frame never waits for its peer to read, and a closed connection whose peer does not take its last
bytes is aborted ``linger_s`` later; a peer that goes away cancels its handler.
"""

from __future__ import annotations

import asyncio
import ipaddress
from typing import TYPE_CHECKING, Any

from ...net.addresses import host_port
from ...net.raw_frames import MAX_PREFACE, Frame, FrameReader, FrameTooLarge, frame_header, set_stream_options
from ..errors import BadRequest, TimedOut

if TYPE_CHECKING:
    from .raw_listener import DataPlane

__all__ = ["FrameConnection", "peer_name"]


class FrameConnection(asyncio.BufferedProtocol):
    """One connection's frames. Complete frames, EOF (None) or an error wait in ``_frames`` for
    the handler (``read``)."""

    def __init__(self, plane: "DataPlane") -> None:
        self.plane = plane
        self.transport: asyncio.Transport | None = None
        self.peer = "unknown"
        self.task: asyncio.Task | None = None
        self._reader = FrameReader(MAX_PREFACE)
        self._deadline: asyncio.TimerHandle | None = None  # the frame under way must be whole by then
        self._failed: Exception | None = None  # what broke the framing: every later read raises it
        self._frames: asyncio.Queue = asyncio.Queue()
        self._writable = asyncio.Event()
        self._writable.set()
        self._linger: asyncio.TimerHandle | None = None  # a closed connection's unsent bytes are dropped then

    # ---- the transport's callbacks ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.peer = peer_name(transport.get_extra_info("peername"))
        if not self.plane.admit(self):
            transport.abort()  # past the cap: closed before a byte is read
            return
        try:
            set_stream_options(transport.get_extra_info("socket"))
        except OSError:  # reset before its options were set: gone before a byte was read
            self.plane.forget(self)
            transport.abort()
            return
        self.task = asyncio.get_running_loop().create_task(self.plane.serve(self))

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._reader.buffer()

    def buffer_updated(self, nbytes: int) -> None:
        if not self._reader.started:  # a frame's first bytes: its clock starts
            self._deadline = asyncio.get_running_loop().call_later(self.plane.frame_timeout_s, self._timed_out)
        try:
            frame = self._reader.advance(nbytes)
        except FrameTooLarge as exc:  # refused on its header: nothing is allocated for it
            self._deliver(BadRequest(str(exc)))
            return
        if frame is not None:
            self._deliver(frame)

    def _deliver(self, item: Frame | Exception | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        if not self.transport.is_closing():
            self.transport.pause_reading()
        if isinstance(item, Exception):
            self._failed = self._failed or item  # the bytes after it are not frames any more
        self._frames.put_nowait(item)

    def _timed_out(self) -> None:
        self._deadline = None
        self._reader.reset()
        self._deliver(TimedOut(f"a frame was not complete {self.plane.frame_timeout_s:g}s after its first byte"))

    def eof_received(self) -> bool:
        # the client's fault, as a malformed message is (a ConnectionResetError would reach the gate
        # as an unexpected error: INTERNAL, and a log line saying so)
        self._deliver(BadRequest("the connection closed inside a frame") if self._reader.started else None)
        return True  # half-closed: results due may still be written

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._deadline, self._linger):
            if timer is not None:
                timer.cancel()
        # one kind of error for every way a peer goes (reset, keepalive timeout, EPIPE...), its
        # reason as a line: readers log it as an event of the network, never with a traceback
        reason = (exc.strerror or str(exc)) if isinstance(exc, OSError) else str(exc or "closed")
        self._frames.put_nowait(ConnectionResetError(reason))
        self._writable.set()
        self.plane.forget(self)
        if self.task is not None:
            self.task.cancel()  # as gRPC cancels the handler of a call whose client is gone

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    # ---- the handler's side (raw_stream.FrameStream) ---------------------------------------------

    async def read(self, limit: int) -> Frame | None:
        """(is a status frame, body) of the next frame; None at EOF between frames."""
        if self._frames.empty() and self._failed is not None:
            raise self._failed
        if self._frames.empty() and not self.transport.is_closing():
            self._reader.limit = limit
            self.transport.resume_reading()
        item = await self._frames.get()
        if isinstance(item, Exception):
            raise item
        return item

    async def write(self, data: Any, status: bool = False) -> None:
        """One frame; ``data`` (bytes or any buffer) goes to the transport as it is, not copied.
        A result waits while the transport's buffer is over its high-water mark (the peer reads
        slowly: NodeStream's timeout bounds the wait). A status frame, the stream's last and small,
        does not: it often ends a stream precisely because its peer stopped reading, and waiting
        for that peer would hold the handler, and the connection, forever."""
        if self.transport.is_closing():
            raise ConnectionResetError("connection closed")
        view = memoryview(data)
        self.transport.write(frame_header(view.nbytes, status))
        self.transport.write(view)
        if not status:
            await self._writable.wait()

    def close(self, linger_s: float) -> None:
        """Close once the bytes written are sent, or abort after ``linger_s`` when the peer does not
        take them: a peer that acks a zero window keeps a TCP connection alive forever, and with it
        the unsent results and a place under the connection cap."""
        if self.transport is None or self.transport.is_closing():
            return
        self.transport.close()
        if self.transport.get_write_buffer_size():
            self._linger = asyncio.get_running_loop().call_later(linger_s, self.transport.abort)


def peer_name(peername: Any) -> str:
    """A client as the gRPC port's log lines name it: ipv4:10.0.0.5:41234, and an IPv4 client of
    the dual-stack socket on ``::`` so too (not ipv6:::ffff:10.0.0.5:41234), so that one client
    reads the same on both ports; ipv6:[fd00::5]:41234 (gRPC escapes the brackets: %5B, %5D)."""
    try:
        address, port = ipaddress.ip_address(peername[0].split("%")[0]), peername[1]
    except (TypeError, IndexError, ValueError):  # no address (the socket is gone already)
        return "unknown"
    if address.version == 6 and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return f"ipv{address.version}:{host_port(str(address), port)}"
