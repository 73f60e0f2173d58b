"""The raw data plane's wire: the framing both of its ends speak (the shard's listener,
server/rpc/raw_listener.py, and a worker's stream, worker/shards/raw_call.py).

A connection carries one Exchange stream as frames: a 4-byte little-endian word (the body's
length, its top bit set for a status frame) and that many bytes.

- The handshake (version 2). The worker opens with ``MAGIC`` and ``VERSION`` (``opening``), and
  nothing else; the shard answers with a challenge: ``MAGIC``, ``VERSION`` and a fresh random
  nonce (``challenge``); the worker then sends its preface: ``MAGIC``, ``VERSION`` and its proof
  of the job token, HMAC-SHA256(token, ``PROOF_LABEL`` + nonce) (empty when it has no token).
  The token itself never travels on the plane: the data port is the one a shard advertises, and
  behind a proxy, a port-forward or a tunnel whatever listens on that port of that host (not a
  process the user configured) gets the worker's opening only, and a proof for a nonce of its
  choosing (bound to that nonce: no use on a connection to the shard, whose nonce is fresh).
  The worker checks the challenge before it sends anything more: another protocol's bytes, a
  wrong magic or version, a short or huge frame end the attempt.
- The worker speaks first so that a framing mismatch is told, by whichever end is older or
  newer, with a status naming both versions: a version 1 worker's first frame (magic, 1, its
  token) is answered so by a version 2 shard, and a version 2 worker's opening by a version 1
  shard; and a stray client of another protocol is refused by its first bytes.
- Then the Exchange messages exactly as gRPC carries them: a serialized Hello and
  ``chunkframes`` pushes one way, results (``frames.result_frames``' bytes) the other.
- The stream ends with a status frame from the shard, ``CODE\\ndetails`` (a ``grpc.StatusCode``
  name; ``OK`` for a clean end), standing in for gRPC's trailers. A client sends none.

A frame is limited to gRPC's own receive limit (``MAX_FRAME``), checked on the header, before a
byte of the body is allocated; the handshake's frames to far less (``MAX_PREFACE``,
``MAX_CHALLENGE``). The plane is plaintext only: with TLS the crypto dominates and gRPC is as fast
(a raw plane over Python's ``ssl`` measured 1.01x gRPC's round time; docs/data-plane.md), so TLS
deployments keep it. Plaintext, a man
in the middle who relays a live connection to the shard can use that one connection, as he can
read and change everything on it anyway: the proof keeps the token from whoever merely listens
at the advertised port, it does not make the plane an authenticated channel (TLS, on gRPC, does).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
import struct
from dataclasses import dataclass
from typing import Awaitable, Callable, NamedTuple

import numpy as np

from .channel_options import GRPC_OPTIONS

__all__ = ["Frame", "FrameReader", "FrameTooLarge", "HEADER", "MAGIC", "MAX_CHALLENGE", "MAX_FRAME", "MAX_HELLO", "MAX_PREFACE", "MAX_STATUS_DETAILS",
           "MAX_TOKEN", "NONCE_BYTES", "PROOF_LABEL", "STATUS_BIT", "VERSION", "Challenge", "Preface", "challenge",
           "frame_header", "new_nonce", "opening", "parse_challenge", "parse_preface", "parse_status", "preface",
           "proof", "receive_frame", "set_stream_options", "split_header", "status_body"]

MAGIC = b"CGXD"  # "cgx-ps data": the first bytes of every connection, both ways
VERSION = 2  # of this framing (2: the challenge-response handshake); a mismatch is refused with a status naming both
HEADER = struct.Struct("<I")
STATUS_BIT = 1 << 31  # a status frame: the stream's last
MAX_FRAME = dict(GRPC_OPTIONS)["grpc.max_receive_message_length"]  # the limit gRPC enforces on a message
MAX_TOKEN = 4096  # read_token's own limit on a token file is far below this
NONCE_BYTES = 32
# What a proof is of: an HMAC of this label and the nonce, so that a proof can be nothing but a
# cgx-ps data plane proof (no other use of the job token as an HMAC key yields the same bytes)
PROOF_LABEL = b"cgx-ps data plane proof v2\0"
# The stream's first message, its Hello, before the shard has checked its session id: far above a
# Hello's size (two ids, a hash, a member), and far below MAX_FRAME, so that the token alone (a
# member's session id is not needed to get this far) cannot park a large frame per connection
MAX_HELLO = 1 << 16
# A client's handshake frames, before its token is proven: room for a version 1 worker's first
# frame (magic, version, the token itself), so that it is answered with both versions' numbers
MAX_PREFACE = len(MAGIC) + 1 + MAX_TOKEN
MAX_STATUS_DETAILS = 1024  # a status's details, as the shard clips them (server/rpc/gate.py, MAX_DETAILS_CHARS)
# What a worker reads in place of a challenge: a challenge, or a shard's status refusing the
# opening (a code name and details of MAX_STATUS_DETAILS characters, 4 bytes at most each)
MAX_CHALLENGE = 32 + 4 * MAX_STATUS_DETAILS
# TCP keepalive as gRPC's (transport.GRPC_OPTIONS: a probe after 30 s idle), so either end notices
# a peer that vanished (a powered-off node, a dropped NAT entry) within about a minute
_KEEPALIVE = ((socket.TCP_KEEPIDLE, 30), (socket.TCP_KEEPINTVL, 10), (socket.TCP_KEEPCNT, 3))
_HEAD = MAGIC + bytes((VERSION,))
SMALL_FRAME = 1 << 16  # a body below this is handed on as bytes (a Hello, a status), a larger one as received


def set_stream_options(sock: socket.socket) -> None:
    """Both ends' socket options: no Nagle delay on a frame's tail, and keepalive."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in _KEEPALIVE:
        sock.setsockopt(socket.IPPROTO_TCP, option, value)


def frame_header(nbytes: int, status: bool = False) -> bytes:
    return HEADER.pack(nbytes | (STATUS_BIT if status else 0))


def split_header(word: bytes | bytearray | memoryview) -> tuple[int, bool]:
    """(body length, is a status frame) of a frame header."""
    (value,) = HEADER.unpack(word)
    return value & ~STATUS_BIT, bool(value & STATUS_BIT)


def opening() -> bytes:
    """The body of a worker's first frame: which framing it speaks, and nothing of its token."""
    return _HEAD


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def challenge(nonce: bytes) -> bytes:
    """The body of the shard's answer to an opening."""
    return _HEAD + nonce


def proof(token: bytes, nonce: bytes) -> bytes:
    """A worker's proof that it holds ``token``, for the shard's ``nonce``; empty without a token."""
    return hmac.new(token, PROOF_LABEL + nonce, hashlib.sha256).digest() if token else b""


def preface(proof_: bytes) -> bytes:
    """The body of a worker's second frame: its ``proof``."""
    return _HEAD + proof_


@dataclass(frozen=True)
class Preface:
    """A client's handshake frame read: what follows its magic and version (the proof), or why it
    is refused (``problem``)."""

    rest: bytes = b""
    problem: str = ""


@dataclass(frozen=True)
class Challenge:
    """A shard's challenge read: its nonce, or why it is not one (``problem``)."""

    nonce: bytes = b""
    problem: str = ""


def _head_problem(data: bytes, speaker: str, listener: str) -> str:
    """Why ``data`` does not start with this framing's magic and version, or ""."""
    if data[:len(MAGIC)] != MAGIC:
        return f"not a cgx-ps data plane {speaker}: it starts with {data[:len(MAGIC)]!r}, not {MAGIC!r}"
    version = data[len(MAGIC):len(MAGIC) + 1]
    if version != bytes((VERSION,)):
        found = version[0] if version else "none"
        return f"data plane framing version {found}; this {listener} speaks version {VERSION}"
    return ""


def parse_preface(body: bytes | memoryview) -> Preface:
    data = bytes(body)
    problem = _head_problem(data, "connection", "shard")
    return Preface(problem=problem) if problem else Preface(rest=data[len(_HEAD):])


def parse_challenge(body: bytes | memoryview) -> Challenge:
    data = bytes(body)
    problem = _head_problem(data, "shard", "worker")
    if not problem and len(data) != len(_HEAD) + NONCE_BYTES:
        problem = f"a challenge of {len(data)} bytes; a cgx-ps shard's has {len(_HEAD) + NONCE_BYTES}"
    return Challenge(problem=problem) if problem else Challenge(nonce=data[len(_HEAD):])


def status_body(code_name: str, details: str) -> bytes:
    return f"{code_name}\n{details}".encode("utf-8", "replace")


def parse_status(body: bytes | memoryview) -> tuple[str, str]:
    """(code name, details) of a status frame, the details at most ``MAX_STATUS_DETAILS``
    characters (a shard clips its own; a broken one's 8 MiB must not become an exception's message
    and a log line); one with no newline reads as its text, with no code name."""
    head = bytes(memoryview(body)[:4 * MAX_STATUS_DETAILS])  # utf-8: at most 4 bytes a character
    name, newline, details = head.decode("utf-8", "replace").partition("\n")
    if not newline:
        name, details = "", name
    if len(head) < len(body) or len(details) > MAX_STATUS_DETAILS:
        details = f"{details[:MAX_STATUS_DETAILS - 40]}... ({len(body)} bytes, clipped)"
    return name, details


class Frame(NamedTuple):
    """One whole frame: a status frame (the stream's last) or a message, and its body."""

    status: bool
    body: bytes | memoryview


class FrameTooLarge(ValueError):
    """A frame header announced more than the reader's limit: refused before its body is allocated."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"frame of {size} bytes; at most {limit}")
        self.size, self.limit = size, limit


class FrameReader:
    """The frames of one connection, with no I/O of its own (both ends drive it: the shard's
    asyncio BufferedProtocol, a worker's loop of ``sock_recv_into``).

    The caller receives into ``buffer()`` and reports how many bytes came with ``advance(n)``,
    which returns the frame they completed, if any. The body is received in place, into a buffer
    of its announced size, so a multi-megabyte push or result is never copied in Python; a body
    over ``limit`` (settable between frames: the handshake's are far smaller than a push) is
    refused on its header, before a byte of it is allocated.
    """

    def __init__(self, limit: int = MAX_FRAME) -> None:
        self.limit = limit
        self._header = bytearray(HEADER.size)
        self.reset()

    def reset(self) -> None:
        """Forget a partial frame (after a timeout or a refusal: what follows is not read as frames)."""
        self._view = memoryview(self._header)
        self._body: memoryview | None = None  # the frame being received, once its header is in
        self._status = False
        self._got = 0

    @property
    def started(self) -> bool:
        """Whether part of a frame has arrived: EOF now is inside a frame, not between two."""
        return self._got > 0 or self._body is not None

    def buffer(self) -> memoryview:
        """Where the next bytes go: the rest of the header, or the rest of the body."""
        return self._view[self._got:]

    def advance(self, nbytes: int) -> Frame | None:
        """``nbytes`` were written at the start of ``buffer()``: the frame they complete, or None.
        Raises FrameTooLarge when a header announces more than ``limit``."""
        self._got += nbytes
        if self._got < len(self._view):
            return None
        self._got = 0
        if self._body is None:
            size, self._status = split_header(self._header)
            if size > self.limit:
                raise FrameTooLarge(size, self.limit)
            if size:
                # not zeroed (a bytearray would be: a memset of every byte the socket then overwrites)
                self._body = self._view = memoryview(np.empty(size, np.uint8))
                return None
            self._body = memoryview(b"")
        body, status = self._body, self._status
        self.reset()
        return Frame(status, body.tobytes() if len(body) < SMALL_FRAME else body)


async def receive_frame(reader: FrameReader, recv_into: Callable[[memoryview], Awaitable[int]]) -> Frame | None:
    """The next frame of a stream socket, received in place into ``reader``'s buffers.

    Args:
        reader: the connection's decoder, its ``limit`` set for this frame.
        recv_into: receives into a buffer (a socket's ``sock_recv_into``); the bytes received, 0 at EOF.

    Returns:
        The frame, or None at EOF between frames.

    Raises:
        ConnectionResetError: EOF inside a frame.
        FrameTooLarge: the frame's header announces more than ``reader.limit`` bytes.
    """
    while True:
        n = await recv_into(reader.buffer())
        if n == 0:
            if reader.started:
                raise ConnectionResetError("connection closed inside a frame")
            return None
        frame = reader.advance(n)
        if frame is not None:
            return frame
