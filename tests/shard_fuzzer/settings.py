"""The fuzzer's settings: the RPCs, callers and styles it goes round, the caps it starts the
shard with, and the bounds it derives from them."""

from __future__ import annotations

from pathlib import Path

from google.protobuf.message import Message

from cgx_ps.v1 import ps_pb2

REPO = Path(__file__).resolve().parents[2]  # the shard runs from the checkout (`python -m cgx_ps.cli`)

SERVICE = "cgx_ps.v1.ParameterServer"
METHODS = ("Register", "Exchange", "PutBlob", "GetBlob", "SetCodecs", "Probe")
KINDS = ("no-token", "wrong-token", "stranger", "member")
STYLES = ("generated", "mutated", "garbage", "sequence")
STYLE_WEIGHTS = (3, 3, 1, 4)
REQUEST_TYPES: dict[str, type[Message]] = {
    "Register": ps_pb2.RegisterRequest, "Exchange": ps_pb2.ExchangeRequest, "PutBlob": ps_pb2.BlobChunk,
    "GetBlob": ps_pb2.GetBlobRequest, "SetCodecs": ps_pb2.SetCodecsRequest, "Probe": ps_pb2.ProbeChunk,
}
CLIENT_STREAMS = {"Exchange", "PutBlob", "Probe"}  # the client sends a stream of messages
SERVER_STREAMS = {"Exchange", "GetBlob"}  # the shard answers with a stream

# The shard's settings. Its memory caps are what the RSS bound is derived from.
ROUND_TIMEOUT_S = 2.0
MAX_INFLIGHT_MB = 16
MAX_MODEL_MB = 64  # the fuzz session's model state is tiny; this caps what a Register may ask for
MAX_MESSAGE = 8 << 20  # the shard's grpc.max_receive_message_length (cgx_ps.net.channel_options)
RSS_SLACK_MIB = 64  # allocator slack
CAPACITY = MAX_INFLIGHT_MB << 20

CALL_DEADLINE_S = 2.0
STALL_DEADLINE_S = ROUND_TIMEOUT_S + 1.5  # outlasts the shard's own timeouts for stalled streams
CONCURRENCY = 16  # calls in flight (threads: the calls block)
# What the shard may hold beyond its baseline, from its caps: pushed blocks, blob uploads and
# stored blobs (max-inflight each), and each call in flight its received message twice (gRPC's
# buffer and the bytes parsed from it), plus slack.
RSS_ALLOWANCE_MIB = 3 * MAX_INFLIGHT_MB + 2 * CONCURRENCY * (MAX_MESSAGE >> 20) + RSS_SLACK_MIB
HEALTH_EVERY_S = 0.25  # how often the fuzz asks the health service, timing the answer
DETAILS_LIMIT = 4096  # a status message longer than this is an echo of the request, not a reason
