"""Transport settings both ends share: chunk size and gRPC channel/server options."""

from __future__ import annotations

from typing import Iterator

__all__ = ["CHUNK_BYTES", "GRPC_OPTIONS", "chunks"]

# Blocks travel as raw-bytes chunks of this size: Python gRPC moves 1-2 MiB messages about 5x
# faster than one large message, and stays under the default 4 MiB receive limit.
CHUNK_BYTES = 1 << 20

# Room for a 2 MiB chunk plus framing; keepalives so a dead peer is noticed within a minute even
# when no round is running (a worker evaluating or checkpointing between steps sends no data).
# The last two are the server's side of that: gRPC servers by default refuse pings without data
# more often than every 5 minutes and, after two "strikes", drop the connection with GOAWAY
# too_many_pings, which cut off workers idle for ~95 s. A worker started with its shards retries
# while they start; gRPC's own reconnect backoff (1 s growing 1.6x, to 120 s) let a shard that
# came up 7 s after its worker wait for the 6th attempt, at 16-26 s: with attempts at most 1 s
# apart, a worker connects within a second of the shard serving.
GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", 8 << 20),
    ("grpc.max_send_message_length", 8 << 20),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 1_000),
]


def chunks(data: bytes | memoryview) -> Iterator[tuple[int, bytes]]:
    """(offset, bytes) pieces of at most CHUNK_BYTES; always at least one (empty data: one
    empty chunk, so a receiver still learns total_bytes)."""
    view = memoryview(data)
    for off in range(0, max(len(data), 1), CHUNK_BYTES):
        yield off, bytes(view[off: off + CHUNK_BYTES])
