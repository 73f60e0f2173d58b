"""The shard under fuzzing: a short run of tests/shard_fuzzer, one test per property it must
leave true, and direct reproductions of what the fuzzer found.

The full run is ``.venv/bin/python -m tests.shard_fuzzer --cases 10000``; this one sends
FUZZ_CASES calls (every protocol scenario among them) to a shard in its own process.
"""

from __future__ import annotations

import asyncio
import time
import types

import grpc
import pytest
from grpc._cython import cygrpc

from cgx_ps.model_layout import layout_hash
from cgx_ps.net.security import read_token
from cgx_ps.server import ServerConfig, ShardServer
from cgx_ps.server.rpc.gate import Gate
from cgx_ps.v1 import ps_pb2, ps_pb2_grpc
from shard_fuzzer import (DETAILS_LIMIT, KINDS, METHODS, SCENARIOS, STYLES, FuzzReport, fuzz_layout,
                          run_fuzz)
from support import METADATA, TOKEN_FILE

FUZZ_CASES = 400
slow = pytest.mark.slow


@pytest.fixture(scope="module")
def report() -> FuzzReport:
    """One fuzz run shared by the property tests (it takes about 20 s)."""
    result = run_fuzz(FUZZ_CASES, seed=0)
    print(result.summary())  # shown with -s, or when a test fails
    return result


# ---- the fuzz run ---------------------------------------------------------------------------------


@slow
def test_every_method_kind_style_and_scenario_is_exercised(report: FuzzReport) -> None:
    for method in METHODS:  # the corpus has more scenarios for some methods: at least half a fair share
        assert sum(report.by_method[method].values()) >= FUZZ_CASES // len(METHODS) // 2, report.summary()
    for kind in KINDS:
        assert sum(report.by_kind[kind].values()) >= FUZZ_CASES // len(KINDS) // 2, report.summary()
    assert set(report.by_style) == set(STYLES)
    assert report.scenarios_run == {fn.__name__ for fns in SCENARIOS.values() for fn in fns}
    assert sum(report.codes.values()) == FUZZ_CASES and report.fuzzer_errors == 0, report.summary()
    member_cases = sum(report.by_kind["member"].values())
    # members mostly are members (a loaded machine can time out a few of their Registers)
    assert report.members_not_joined <= member_cases // 4, report.summary()


@slow
def test_the_shard_survives_serving_and_still_trains(report: FuzzReport) -> None:
    assert report.alive and report.serving, report.summary()
    assert report.exchange_before is None and report.exchange_after is None, report.summary()
    assert report.exit_code == 0, report.summary()  # and it still drains and stops cleanly


@slow
def test_rss_stays_within_the_shards_caps(report: FuzzReport) -> None:
    assert report.rss_peak_kib <= report.rss_bound_kib, report.summary()


@slow
def test_at_most_one_log_line_per_bad_call(report: FuzzReport) -> None:
    assert report.checks()["log_lines"] is None, report.summary()
    assert report.log.longest < 2 * DETAILS_LIMIT, report.summary()  # a line never carries a request's bulk


@slow
def test_no_traceback_in_the_log(report: FuzzReport) -> None:
    assert report.log.tracebacks == 0, report.summary()


@slow
def test_no_call_ends_unknown(report: FuzzReport) -> None:
    assert report.codes["UNKNOWN"] == 0, report.summary()


@slow
def test_no_call_ends_internal(report: FuzzReport) -> None:
    assert report.codes["INTERNAL"] == 0, report.summary()


@slow
def test_no_status_echoes_the_request(report: FuzzReport) -> None:
    assert report.oversized_details == 0, report.summary()


# ---- what the fuzzer found, reproduced directly -------------------------------------------------------


@pytest.fixture
async def shard():
    server = ShardServer(ServerConfig(host="127.0.0.1", port=0, metrics_port=-1, round_timeout_s=0.5,
                                      kernel_threads=1, token_file=TOKEN_FILE))
    await server.start()
    yield server
    await server.stop(drain=False)


async def register(stub, node: str = "node-0", layout: ps_pb2.Layout | None = None, job: str = "",
                   num_nodes: int = 1) -> ps_pb2.RegisterResponse:
    layout = layout or fuzz_layout()
    return await stub.Register(ps_pb2.RegisterRequest(node_id=node, num_nodes=num_nodes, layout=layout,
                                                      layout_hash=layout_hash(layout), job_id=job),
                               metadata=METADATA, timeout=5)


async def status_of(coro) -> tuple[grpc.StatusCode, str]:
    try:
        await asyncio.wait_for(coro, 10)
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


async def stream_status(call) -> tuple[grpc.StatusCode, str]:
    """How a stream we wrote to ends (its responses, if any, dropped)."""
    async def read_all():
        if hasattr(call, "read"):
            while await call.read() is not grpc.aio.EOF:
                pass
        else:
            await call
    return await status_of(read_all())


async def test_a_probe_that_stalls_past_the_round_timeout_ends_deadline_exceeded(shard) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{shard.port}") as channel:
        call = channel.stream_unary("/cgx_ps.v1.ParameterServer/Probe")(metadata=METADATA, timeout=5)
        await call.write(ps_pb2.ProbeChunk(data=b"abc").SerializeToString())  # then silence
        code, details = await stream_status(call)
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED, (code, details)


async def call_with_session_id(stub, method: str, session_id: str) -> tuple[grpc.StatusCode, str]:
    """One call of ``method`` by node-0 (a registered member) carrying ``session_id``; its status."""
    if method == "GetBlob":
        call = stub.GetBlob(ps_pb2.GetBlobRequest(key="k", timeout_s=0.1, session_id=session_id), metadata=METADATA)
        return await stream_status(call)
    if method == "SetCodecs":
        return await status_of(stub.SetCodecs(ps_pb2.SetCodecsRequest(node_id="node-0", from_round=1,
                                                                      session_id=session_id), metadata=METADATA))
    if method == "PutBlob":
        call = stub.PutBlob(metadata=METADATA)
        await call.write(ps_pb2.BlobChunk(key="k", total_bytes=1, offset=0, data=b"x", node_id="node-0",
                                          session_id=session_id))
        await call.done_writing()
        return await stream_status(call)
    call = stub.Exchange(metadata=METADATA)
    await call.write(ps_pb2.ExchangeRequest(hello=ps_pb2.Hello(node_id="node-0", layout_hash=layout_hash(fuzz_layout()),
                                                               session_id=session_id)))
    return await stream_status(call)


@pytest.mark.parametrize("method", ["GetBlob", "SetCodecs", "PutBlob", "Exchange"])
async def test_a_non_ascii_session_id_is_refused_like_any_wrong_one(shard, method: str) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{shard.port}") as channel:
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        await register(stub)
        wrong = await call_with_session_id(stub, method, "0" * 32)
        odd = await call_with_session_id(stub, method, "é" * 32)
    assert wrong[0] in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.FAILED_PRECONDITION), wrong
    assert odd[0] == wrong[0], (odd, wrong)


def with_tensor_name(layout: ps_pb2.Layout, name: str) -> ps_pb2.Layout:
    copy = ps_pb2.Layout()
    copy.CopyFrom(layout)
    copy.tensors[0].name = name  # "a...": still sorted first, so the layout stays valid
    return copy


@pytest.mark.parametrize("what", ["hello-node-id", "invalid-layout-tensor-name", "other-layout-tensor-name"])
async def test_a_refusal_does_not_echo_a_huge_field(shard, what: str) -> None:
    huge = "a" + "x" * 100_000
    async with grpc.aio.insecure_channel(f"127.0.0.1:{shard.port}") as channel:
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        if what == "hello-node-id":
            call = stub.Exchange(metadata=METADATA)
            await call.write(ps_pb2.ExchangeRequest(hello=ps_pb2.Hello(node_id=huge)))
            code, details = await stream_status(call)
            expected = grpc.StatusCode.FAILED_PRECONDITION
        elif what == "invalid-layout-tensor-name":
            layout = with_tensor_name(fuzz_layout(), huge)
            layout.blocks[0].segments[0].offset = 1  # the error names the tensor of the segment
            code, details = await status_of(register(stub, layout=layout))
            expected = grpc.StatusCode.INVALID_ARGUMENT
        else:
            await register(stub, job="J", num_nodes=2)
            code, details = await status_of(register(stub, "node-1", with_tensor_name(fuzz_layout(), huge), job="J",
                                                     num_nodes=2))
            expected = grpc.StatusCode.FAILED_PRECONDITION
    assert code == expected and len(details) <= DETAILS_LIMIT, (code, details[:200], len(details))


class ContextOfAGoneClient:
    """A ServicerContext whose client went away just as the shard refused it: like grpc's, its
    first abort fails to send the status (ExecuteBatchError) and a second abort is a UsageError."""

    def __init__(self) -> None:
        self.aborts = 0

    def invocation_metadata(self):
        return METADATA

    def peer(self) -> str:
        return ""

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        self.aborts += 1
        if self.aborts > 1:
            raise cygrpc.UsageError("Abort already called!")
        raise cygrpc.ExecuteBatchError('Failed "execute_batch"')


async def test_the_gate_aborts_once_when_the_client_is_gone() -> None:
    context = ContextOfAGoneClient()

    async def exchange() -> None:  # the service refusing a Hello, as in service.py Exchange
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "node 'x' has not registered with this shard")

    gate = Gate(types.SimpleNamespace(draining=False), read_token(TOKEN_FILE).encode())
    # grpc ignores an ExecuteBatchError once the client has closed, and logs an error if an
    # abort is swallowed: the gate must let it through without aborting a second time
    with pytest.raises((cygrpc.ExecuteBatchError, grpc.aio.AbortError, asyncio.CancelledError)):
        await gate.run("Exchange", context, exchange)
    assert context.aborts == 1


async def test_a_huge_setcodecs_request_does_not_hold_the_shard(shard) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{shard.port}") as channel:
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        member = await register(stub)
        change = ps_pb2.BlockCodec(block_id=1, codec=ps_pb2.CodecSettings(codec=ps_pb2.CODEC_MAXMIN, bits=4,
                                                                          bucket_size=512))
        request = ps_pb2.SetCodecsRequest(node_id="node-0", from_round=5, blocks=[change] * 100_000,
                                          session_id=member.session_id)
        t0 = time.monotonic()
        await status_of(stub.SetCodecs(request, metadata=METADATA, timeout=30))  # refused or applied: both fine
        elapsed = time.monotonic() - t0
    assert elapsed < 0.5, f"{elapsed:.1f} s"
