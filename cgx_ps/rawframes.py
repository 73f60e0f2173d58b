"""The raw data plane's wire: the framing both of its ends speak (the shard's listener,
server/dataplane.py, and a worker's stream, worker/dataplane.py).

A connection carries one Exchange stream as frames: a 4-byte little-endian word (the body's
length, its top bit set for a status frame) and that many bytes.

- The first frame, the preface, is ``MAGIC``, ``VERSION`` and the job token (empty when the
  shard has none): a stray client of another protocol, or a future frame format, is refused by
  its first bytes, and the token is checked before anything else is read.
- Then the Exchange messages exactly as gRPC carries them: a serialized Hello and
  ``chunkframes`` pushes one way, results (``frames.result_frames``' bytes) the other.
- The stream ends with a status frame from the shard, ``CODE\\ndetails`` (a ``grpc.StatusCode``
  name; ``OK`` for a clean end), standing in for gRPC's trailers. A client sends none.

A frame is limited to gRPC's own receive limit (``MAX_FRAME``), checked on the header, before a
byte of the body is allocated. The plane is plaintext only: with TLS, gRPC is as fast
(BENCHMARKS.md, "What Python gRPC costs the shard"; docs/data-plane.md), so TLS deployments keep it.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass

from .transport import GRPC_OPTIONS

__all__ = ["HEADER", "MAGIC", "MAX_FRAME", "MAX_HELLO", "MAX_PREFACE", "MAX_STATUS_DETAILS", "MAX_TOKEN", "STATUS_BIT",
           "VERSION", "Preface", "frame_header", "parse_preface", "parse_status", "preface", "set_stream_options",
           "split_header", "status_body"]

MAGIC = b"CGXD"  # "cgx-ps data": the first bytes of every connection
VERSION = 1  # of this framing; a shard refuses another with a status that names both
HEADER = struct.Struct("<I")
STATUS_BIT = 1 << 31  # a status frame: the stream's last
MAX_FRAME = dict(GRPC_OPTIONS)["grpc.max_receive_message_length"]  # the limit gRPC enforces on a message
MAX_TOKEN = 4096  # read_token's own limit on a token file is far below this
# The stream's first message, its Hello, before the shard has checked its session id: far above a
# Hello's size (two ids, a hash, a member), and far below MAX_FRAME, so that the token alone (a
# member's session id is not needed to get this far) cannot park a large frame per connection
MAX_HELLO = 1 << 16
MAX_PREFACE = len(MAGIC) + 1 + MAX_TOKEN
MAX_STATUS_DETAILS = 1024  # a status's details, as the shard clips them (server/rpc.py, MAX_DETAILS_CHARS)
# TCP keepalive as gRPC's (transport.GRPC_OPTIONS: a probe after 30 s idle), so either end notices
# a peer that vanished (a powered-off node, a dropped NAT entry) within about a minute
_KEEPALIVE = ((socket.TCP_KEEPIDLE, 30), (socket.TCP_KEEPINTVL, 10), (socket.TCP_KEEPCNT, 3))


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


def preface(token: bytes) -> bytes:
    """The body of a connection's first frame."""
    return MAGIC + bytes((VERSION,)) + token


@dataclass(frozen=True)
class Preface:
    """A first frame read: the token it presents, or why it is refused (``problem``)."""

    token: bytes = b""
    problem: str = ""


def parse_preface(body: bytes | memoryview) -> Preface:
    data = bytes(body)
    if data[:len(MAGIC)] != MAGIC:
        return Preface(problem=f"not a cgx-ps data plane connection: it starts with {data[:len(MAGIC)]!r}, "
                               f"not {MAGIC!r}")
    version = data[len(MAGIC):len(MAGIC) + 1]
    if version != bytes((VERSION,)):
        found = version[0] if version else "none"
        return Preface(problem=f"data plane framing version {found}; this shard speaks version {VERSION}")
    return Preface(token=data[len(MAGIC) + 1:])


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
