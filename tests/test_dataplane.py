"""The raw data plane (server/rpc/raw_listener.py, worker/shards/raw_call.py, net/raw_frames.py): a second listener
on a shared network, attacked the way the gRPC port is.

In-process shards with ``data_port=0`` and connections driven by hand: what is refused (a wrong
or missing token before anything else is read, garbage, a bad magic or version, a frame over
gRPC's limit before it is allocated, a Hello over MAX_HELLO, a bad session id), what is cut off
(a silent connection, a trickled frame, streams past the cap, a member that stops reading), that
silent connections cannot lock the members out, and that none of it harms the members' rounds,
whose sums are exact. The handshake (framing version 2): a plain socket server at the advertised
port, whatever it answers, gets the worker's opening and never the token; a proof, recorded or
obtained with a challenge of one's own, is refused when replayed; framing versions are named both
ways. The worker's side against a broken shard (junk, huge or cut frames and statuses), and its
cancel of a write the shard does not read. Under auto, a rejoin whose new data port cannot be
reached takes gRPC; a stream broken mid-run stays recovery's. Real processes: two workers on
CGX_PS_DATAPLANE=raw survive a shard killed and restarted under them with exactly the reference's
parameters (those the gRPC stream gives: tests/test_worker.py). And the choice of plane, as a table.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import socket
import struct
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from cgx_ps.model_layout import layout_hash
from cgx_ps.net.raw_frames import (MAX_FRAME, MAX_HELLO, challenge, frame_header, new_nonce, opening, parse_challenge,
                              parse_status, preface, proof, split_header)
from cgx_ps.net.security import ChannelSecurity, read_token
from cgx_ps.server import ShardServer
from cgx_ps.server.rpc.raw_connection import peer_name
from cgx_ps.server.rpc.raw_listener import DataPlane
from cgx_ps.server.rpc.raw_stream import presented_token
from cgx_ps.server.rpc.gate import MAX_DETAILS_CHARS, STATUS_CODES
from cgx_ps.v1 import ps_pb2
from cgx_ps.worker.shards.client import ShardClient, read_result
from cgx_ps.worker.errors import StreamEnded
from cgx_ps.worker.shards.dataplane import DataplaneChoice, decide_dataplane, falls_back_to_grpc
from cgx_ps.worker.shards.raw_call import RawCall
from cgx_ps.worker.errors import ConfigError, ShardUnavailableError
from rounds import check_aggregate, close, encode_block, make_layout, run_round
from shard_fuzzer.frames import FRAME_MUTATIONS, fuzz_frames
from support import SECURITY, TOKEN_FILE
from test_resilience import finish, start_workers, wait_for_rounds
from test_worker import expected_params

SHARD_SETTINGS = dict(round_timeout_s=10.0, data_port=0)
LAYOUT = make_layout()
TOKEN = read_token(TOKEN_FILE).encode()
FRAME_CASES = 240  # the frame-layer fuzz's connections (about 4 s)


def _frame(body: bytes) -> bytes:
    return frame_header(len(body)) + body


def _hello(node: str, session_id: str) -> bytes:
    return _frame(ps_pb2.ExchangeRequest(hello=ps_pb2.Hello(node_id=node, layout_hash=layout_hash(LAYOUT),
                                                            session_id=session_id)).SerializeToString())


async def _handshake(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, token: bytes = TOKEN) -> bytes:
    """A worker's handshake, by hand: the opening, the shard's challenge, the preface with the
    proof of ``token``; the preface's body (the proof a listener would record)."""
    writer.write(_frame(opening()))
    size, status = split_header(await reader.readexactly(4))
    body = await reader.readexactly(size)
    assert not status, parse_status(body)
    sent = preface(proof(token, parse_challenge(body).nonce))
    writer.write(_frame(sent))
    return sent


async def _proven(port: int, token: bytes = TOKEN,
                  host: str = "127.0.0.1") -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection to the data plane past its handshake, with the proof of ``token``."""
    reader, writer = await asyncio.open_connection(host, port)
    await _handshake(reader, writer, token)
    return reader, writer


async def _ending(reader: asyncio.StreamReader, timeout_s: float = 5.0) -> tuple[str, str] | None:
    """The status a connection ends with ((code, details)), or None if it closes without one."""
    async def read() -> tuple[str, str] | None:
        while True:
            try:
                header = await reader.readexactly(4)
                size, status = split_header(header)
                body = await reader.readexactly(size)
            except (asyncio.IncompleteReadError, ConnectionResetError):
                return None
            if status:
                return parse_status(body)
    return await asyncio.wait_for(read(), timeout_s)


async def _until(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def _members(shard: ShardServer, n: int, plane: str = "raw") -> list[ShardClient]:
    clients = [ShardClient(f"127.0.0.1:{shard.port}", f"node-{i}", n, LAYOUT, connect_timeout_s=5, security=SECURITY,
                           dataplane=plane) for i in range(n)]
    for c in clients:
        await c.connect()
    return clients


async def test_hostile_connections_are_refused_and_the_members_rounds_stay_exact(shard: ShardServer) -> None:
    members = await _members(shard, 2)
    await _until(lambda: len(shard.dataplane.connections) == 2)  # their streams went over the plane, not gRPC
    session = members[0].session_id
    # (the token the connection proves, None: no handshake; what it sends then; the status it must
    # end with, words of its details)
    hostile = {
        # a registered member's Hello behind the token: refused on the token, the Hello never read
        "wrong token": (b"not-the-job-token", _hello("node-0", session), "UNAUTHENTICATED",
                        "wrong job token (the data plane handshake's proof of it)"),
        "no token": (b"", _hello("node-0", session), "UNAUTHENTICATED", "token"),
        "garbage": (None, b"GET / HTTP/1.1\r\nHost: shard\r\n\r\n", "INVALID_ARGUMENT", "at most"),
        "bad magic": (None, _frame(b"XXXX\x02"), "INVALID_ARGUMENT", "not a cgx-ps data plane"),
        "bad version": (None, _frame(b"CGXD\x09"), "INVALID_ARGUMENT", "version 9"),
        # a worker that sends its token in its first frame (version 1 did) is told so, not challenged
        "version 1 preface": (None, _frame(b"CGXD\x01" + TOKEN) + _hello("node-0", session), "INVALID_ARGUMENT",
                              "data plane framing version 1; this shard speaks version 2"),
        "opening with more": (None, _frame(opening() + TOKEN), "INVALID_ARGUMENT", "an opening of"),
        "preface, not opening": (None, _frame(preface(bytes(32))), "INVALID_ARGUMENT", "an opening of"),
        # announced only: answered at once, so nothing waited for (or was allocated for) its body
        "frame over the limit": (TOKEN, frame_header(0x7FFFFFFF), "INVALID_ARGUMENT", f"at most {MAX_HELLO}"),
        # within gRPC's limit, but a Hello, before the session is proven: with the token alone no
        # one parks 8 MiB on each of --max-concurrent-rpcs connections (beside the gRPC port's own)
        "an 8 MiB Hello": (TOKEN, frame_header(MAX_FRAME), "INVALID_ARGUMENT", f"at most {MAX_HELLO}"),
        "bad session id": (TOKEN, _hello("node-0", "f" * 32), "FAILED_PRECONDITION", "has not registered"),
    }

    async def attack(token: bytes | None, sent: bytes) -> tuple[str, str] | None:
        reader, writer = await asyncio.open_connection("127.0.0.1", shard.data_port)
        try:
            if token is not None:
                await _handshake(reader, writer, token)
            writer.write(sent)
            return await _ending(reader)
        finally:
            writer.close()

    try:
        rounds = asyncio.gather(*(run_round(members, LAYOUT, r, seed=7) for r in range(3)))
        endings = await asyncio.gather(*(attack(token, sent) for token, sent, _, _ in hostile.values()))
        for (case, (_, _, code, words)), ending in zip(hostile.items(), endings):
            assert ending is not None and ending[0] == code and words in ending[1], (case, ending)
        for round_, (pushed, results) in enumerate(await asyncio.wait_for(rounds, 60)):
            for block in LAYOUT.blocks:
                got = [bytes(results[k][block.block_id]) for k in range(2)]
                assert got[0] == got[1]
                check_aggregate(block, pushed[block.block_id], got[0], round_)
        assert all(c.error is None and c.recoveries == 0 for c in members)
        assert shard.service.session.failed is None
        assert shard.status.snapshot().data_port == shard.data_port > 0  # cgx-ps status shows it
        # stopping: the listener closes first, the members' streams end UNAVAILABLE (recoverable)
        await shard.stop(drain=True)
        with pytest.raises(OSError):
            await asyncio.open_connection("127.0.0.1", shard.data_port)
    finally:
        await close(members)


class _Listener:
    """Whatever listens at the port a shard advertises, seen from the worker (a port-forward of the
    gRPC port alone, a tunnel, another program on that port of the worker's own host): a plain
    socket server that records every byte it receives and answers each connection with ``answer``
    (a callable of the connection's nonce, so it may send a challenge of its own; None: it closes
    the connection once the first bytes came)."""

    def __init__(self, answer: Callable[[bytes], bytes | None]) -> None:
        self.answer = answer
        self.received = bytearray()
        self.nonces: list[bytes] = []
        self._writers: list[asyncio.StreamWriter] = []
        self.server: asyncio.Server | None = None
        self.port = 0

    async def __aenter__(self) -> "_Listener":
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        for writer in self._writers:
            writer.close()
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.append(writer)
        self.nonces.append(new_nonce())
        answer = self.answer(self.nonces[-1])
        if answer is None:  # after the worker's first bytes: an EOF, not a reset for bytes unread
            self.received += await reader.read(1 << 16)
            writer.close()
            return
        writer.write(answer)
        while data := await reader.read(1 << 16):
            self.received += data


# what a listener that is not the shard sends when a worker connects, how the worker must end the attempt
_NOT_THE_SHARD = {
    "silent": (lambda nonce: b"", "no challenge within 0.5s"),
    "another protocol": (lambda nonce: b"SSH-2.0-OpenSSH_9.6\r\n", "not a cgx-ps shard's challenge"),
    "a huge frame": (lambda nonce: frame_header(1 << 30) + b"x" * 64, "at most"),
    "bad magic": (lambda nonce: _frame(b"HTTP" + bytes(33)), "not a cgx-ps data plane shard"),
    "another version": (lambda nonce: _frame(b"CGXD\x03" + nonce), "version 3; this worker speaks version 2"),
    "a short challenge": (lambda nonce: _frame(b"CGXD\x02" + nonce[:8]), "a challenge of 13 bytes"),
    "closes at once": (lambda nonce: None, "closed before the shard's challenge"),
}


@pytest.mark.parametrize("case", _NOT_THE_SHARD)
async def test_a_listener_that_is_not_the_shard_gets_nothing_of_the_token(case: str) -> None:
    """The worker's opening is all such a listener gets: the attempt ends, with a reason, before
    anything of the token is sent (before: the first frame it sent was the token itself)."""
    answer, words = _NOT_THE_SHARD[case]
    async with _Listener(answer) as listener:
        with pytest.raises(StreamEnded) as raised:
            await RawCall.open("127.0.0.1", listener.port, TOKEN, read_result, connect_timeout_s=0.5)
        await asyncio.sleep(0.1)  # what the worker sent, if anything more, is in by now
    assert raised.value.code == "UNAVAILABLE" and words in raised.value.details, raised.value
    assert f"127.0.0.1:{listener.port}" in raised.value.details
    assert bytes(listener.received) == _frame(opening()), listener.received


async def test_a_listener_that_challenges_gets_a_proof_bound_to_its_nonce_never_the_token(shard) -> None:
    """Even a listener that speaks the handshake (sends a challenge) learns no token: it gets an
    HMAC of its own nonce, which the shard, whose nonce is fresh, refuses."""
    async with _Listener(lambda nonce: _frame(challenge(nonce))) as listener:
        call = await RawCall.open("127.0.0.1", listener.port, TOKEN, read_result, connect_timeout_s=5)
        try:
            await call.write(_hello("node-0", "0" * 32)[4:])
            await _until(lambda: len(listener.received) >= 2 * 4 + len(opening()) + len(preface(bytes(32))))
        finally:
            call.cancel()
    recorded = bytes(listener.received)
    expected_preface = preface(proof(TOKEN, listener.nonces[0]))
    assert recorded.startswith(_frame(opening()) + _frame(expected_preface)), recorded
    assert TOKEN not in recorded
    reader, writer = await asyncio.open_connection("127.0.0.1", shard.data_port)
    try:
        writer.write(_frame(opening()))
        await reader.readexactly(4 + len(challenge(bytes(32))))
        writer.write(_frame(expected_preface) + _hello("node-0", "0" * 32))  # the recorded proof, replayed
        code, details = await _ending(reader)
        assert code == "UNAUTHENTICATED" and "proof" in details, details
    finally:
        writer.close()


async def test_a_recorded_proof_replayed_on_a_new_connection_is_refused(shard: ShardServer) -> None:
    """A proof answers one connection's nonce: whoever records a good handshake on the plane
    cannot replay it (before: the token itself went by, and replaying it worked)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", shard.data_port)
    recorded = await _handshake(reader, writer)
    writer.write(_hello("node-9", "0" * 32))
    assert (await _ending(reader))[0] == "FAILED_PRECONDITION"  # the proof was good: past the gate
    writer.close()
    reader, writer = await asyncio.open_connection("127.0.0.1", shard.data_port)
    try:
        writer.write(_frame(opening()))
        size, _ = split_header(await reader.readexactly(4))
        nonce = parse_challenge(await reader.readexactly(size)).nonce
        assert len(nonce) == 32 and preface(proof(TOKEN, nonce)) != recorded  # a fresh nonce
        writer.write(_frame(recorded) + _hello("node-9", "0" * 32))
        code, details = await _ending(reader)
        assert code == "UNAUTHENTICATED" and "missing or wrong job token" in details, details
        assert "authorization: Bearer" not in details  # the plane's refusal names the plane's way
    finally:
        writer.close()


async def test_a_shard_without_a_token_takes_streams_with_or_without_one(start_shard) -> None:
    shard = await start_shard(token_file=None)
    members = [ShardClient(f"127.0.0.1:{shard.port}", f"node-{i}", 2, LAYOUT, connect_timeout_s=5, security=security,
                           dataplane="raw") for i, security in enumerate((SECURITY, ChannelSecurity()))]
    try:
        for member in members:
            await member.connect()
        await _until(lambda: len(shard.dataplane.connections) == 2 and not shard.dataplane.pending)
        pushed, results = await asyncio.wait_for(run_round(members, LAYOUT, 0), 30)
        for block in LAYOUT.blocks:
            check_aggregate(block, pushed[block.block_id], bytes(results[1][block.block_id]))
    finally:
        await close(members)


async def test_framing_versions_are_named_both_ways(shard: ShardServer) -> None:
    """A version 1 worker (its first frame: magic, 1, the token) is answered at once, its first
    frame back a status naming both versions; a version 2 worker at a version 1 shard (here by
    hand: what version 1's parse_preface answered to a first frame of another version) raises
    that status, having sent its opening only."""
    reader, writer = await asyncio.open_connection("127.0.0.1", shard.data_port)
    try:
        writer.write(_frame(b"CGXD\x01" + TOKEN) + _hello("node-0", "0" * 32))
        size, status = split_header(await reader.readexactly(4))
        assert status and parse_status(await reader.readexactly(size)) == (
            "INVALID_ARGUMENT", "data plane framing version 1; this shard speaks version 2")
    finally:
        writer.close()
    body = b"INVALID_ARGUMENT\ndata plane framing version 2; this shard speaks version 1"
    v1_answer = frame_header(len(body), status=True) + body
    async with _Listener(lambda nonce: v1_answer) as version_1_shard:
        with pytest.raises(StreamEnded) as raised:
            await RawCall.open("127.0.0.1", version_1_shard.port, TOKEN, read_result, connect_timeout_s=5)
        await asyncio.sleep(0.1)
    assert raised.value.code == "INVALID_ARGUMENT"
    assert raised.value.details == "data plane framing version 2; this shard speaks version 1"
    assert bytes(version_1_shard.received) == _frame(opening())


def test_presented_token_is_the_job_token_only_for_a_right_proof() -> None:
    nonce, other = new_nonce(), new_nonce()
    assert presented_token(proof(TOKEN, nonce), nonce, TOKEN) == TOKEN
    assert presented_token(proof(TOKEN, other), nonce, TOKEN) == b""  # another connection's nonce
    assert presented_token(proof(b"not-the-job-token", nonce), nonce, TOKEN) == b""
    assert presented_token(b"", nonce, TOKEN) == b""
    assert presented_token(TOKEN, nonce, TOKEN) == b""  # the token itself is no proof
    assert presented_token(b"", nonce, None) == b""  # a shard without a token checks nothing


async def test_silent_and_trickling_connections_are_cut_at_their_timeouts(shard: ShardServer) -> None:
    shard.dataplane.first_frame_timeout_s = 0.5
    shard.dataplane.frame_timeout_s = 0.5

    async def ending_of(whole: bytes, trickle: bytes, every_s: float,
                        handshake: bool = False) -> tuple[tuple[str, str] | None, float]:
        reader, writer = await asyncio.open_connection("127.0.0.1", shard.data_port)
        started = time.monotonic()
        if handshake:
            await _handshake(reader, writer)
        writer.write(whole)

        async def send() -> None:
            with contextlib.suppress(OSError):
                for i in range(len(trickle)):
                    writer.write(trickle[i:i + 1])
                    await asyncio.sleep(every_s)

        sender = asyncio.create_task(send())
        try:
            return await _ending(reader), time.monotonic() - started
        finally:
            sender.cancel()
            writer.close()

    silent, trickled_opening, unproven, trickled_hello = await asyncio.gather(
        ending_of(b"", b"", 0),  # connects and says nothing
        ending_of(b"", _frame(opening()), 0.2),  # a byte every 0.2 s: never idle 0.5 s, never whole
        ending_of(_frame(opening()), b"", 0),  # takes its challenge and never answers it
        # the handshake at once, then the Hello's frame a byte every 0.2 s: the Hello itself may take
        # 30 s (FIRST_MESSAGE_TIMEOUT_S), but a frame under way must be whole 0.5 s after its first byte
        ending_of(b"", _hello("node-0", ""), 0.2, handshake=True))
    for (ending, took), words in ((silent, "no preface"), (trickled_opening, "no preface"), (unproven, "no preface"),
                                  (trickled_hello, "not complete")):
        assert ending is not None and ending[0] == "DEADLINE_EXCEEDED" and words in ending[1], ending
        assert took < 3.0, took


async def test_streams_past_the_cap_are_refused(start_shard) -> None:
    shard = await start_shard(max_concurrent_rpcs=8)
    held = [await _proven(shard.data_port) for _ in range(8)]  # past the preface: streams waiting for their Hello
    try:
        await _until(lambda: len(shard.dataplane.connections) == 8 and not shard.dataplane.pending)
        reader, writer = await _proven(shard.data_port)
        writer.write(_hello("node-9", "0" * 32))
        code, details = await _ending(reader, 2.0)
        assert code == "RESOURCE_EXHAUSTED" and "the cap" in details  # as gRPC refuses a call past it
        writer.close()
        # without the token: the token is checked first, so a stranger learns nothing of the cap
        reader, writer = await _proven(shard.data_port, b"not-the-job-token")
        assert (await _ending(reader, 2.0))[0] == "UNAUTHENTICATED"
        writer.close()
        held.pop()[1].close()  # one leaves: there is room again
        await _until(lambda: len(shard.dataplane.connections) == 7)
        reader, writer = await _proven(shard.data_port)
        writer.write(_hello("node-9", "0" * 32))
        assert (await _ending(reader))[0] == "FAILED_PRECONDITION"  # read and answered
        writer.close()
    finally:
        for _, w in held:
            w.close()


async def test_auto_falls_back_to_grpc_once_and_raw_insists(start_shard, caplog) -> None:
    shard = await start_shard()
    with socket.socket() as unused:  # a port nobody listens on: as a NetworkPolicy without the data port
        unused.bind(("127.0.0.1", 0))
        shard.service.data_port = unused.getsockname()[1]
    caplog.set_level("WARNING", logger="cgx_ps.worker.shards.client")
    members = await _members(shard, 1, plane="auto")
    try:
        _, results = await asyncio.wait_for(run_round(members, LAYOUT, 0), 30)
        assert len(results[0]) == len(LAYOUT.blocks) and not shard.dataplane.connections
        await members[0].reopen()  # a second stream: no second attempt, no second warning
        assert len([r for r in caplog.records if "cannot be reached" in r.message]) == 1
    finally:
        await close(members)
    with pytest.raises(ShardUnavailableError, match="data plane"):
        await _members(shard, 1, plane="raw")
    plain = await start_shard(data_port=-1)
    with pytest.raises(ConfigError, match=f"shard 127.0.0.1:{plain.port} advertises no data port"):
        await _members(plain, 1, plane="raw")


class _UnreachableDataPlane(DataPlane):
    """A shard's data plane that listens, but advertises a port nobody listens on: as seen from a
    worker behind a port-forward of the gRPC port alone, or a NetworkPolicy without the new port."""

    async def start(self, host: str, port: int) -> int:
        await super().start(host, port)
        with socket.socket() as unused:
            unused.bind(("127.0.0.1", 0))
            return unused.getsockname()[1]


def _auto_member(shard: ShardServer, recovery_timeout_s: float) -> ShardClient:
    """One node of a one-node session on ``shard``, under CGX_PS_DATAPLANE=auto."""
    return ShardClient(f"127.0.0.1:{shard.port}", "node-0", 1, LAYOUT, connect_timeout_s=10, security=SECURITY,
                       dataplane="auto", recovery_timeout_s=recovery_timeout_s)


async def _first_round_on_the_plane(member: ShardClient, shard: ShardServer) -> None:
    await member.connect()
    await asyncio.wait_for(run_round([member], LAYOUT, 0), 30)
    assert len(shard.dataplane.connections) == 1  # over the plane


async def test_auto_falls_back_to_grpc_on_a_rejoin_whose_new_data_port_cannot_be_reached(start_shard, caplog,
                                                                                        monkeypatch) -> None:
    """A restarted shard may listen on another data port (ephemeral: a free one): a worker that
    rejoins it and cannot reach that port goes on over gRPC, with the one warning, as on a first
    connect (before: once the plane had worked, the rejoin failed until the recovery timeout
    ended the job). A stream that breaks mid-run, with no new Register, stays the shard's failure."""
    import cgx_ps.server.main as shard_main

    shard = await start_shard()
    port = shard.port
    member = _auto_member(shard, recovery_timeout_s=20)
    caplog.set_level("WARNING", logger="cgx_ps.worker")
    try:
        await _first_round_on_the_plane(member, shard)
        first_instance = member.registration.instance_id
        # the member learns of the restart once it is done: a recovery racing the in-process stop
        # (its Status call cancelled by the stopping server) is not what this test is about
        member.stream._reader.cancel()
        await shard.stop(drain=False)
        monkeypatch.setattr(shard_main, "DataPlane", _UnreachableDataPlane)
        restarted = await start_shard(port=port)
        member.stream.broke(member.stream.generation, "the shard restarted")
        pushed, results = await asyncio.wait_for(run_round([member], LAYOUT, 1), 30)  # through the rejoin
        for block in LAYOUT.blocks:
            check_aggregate(block, pushed[block.block_id], bytes(results[0][block.block_id]), 1)
        assert member.registration.instance_id != first_instance and member.recoveries == 1
        assert member.error is None and not restarted.dataplane.connections  # over gRPC
        warnings = [r.getMessage() for r in caplog.records if "cannot be reached" in r.getMessage()]
        assert len(warnings) == 1 and f"data port {restarted.service.data_port}" in warnings[0], warnings
    finally:
        await close([member])


async def test_under_auto_a_stream_broken_mid_run_stays_the_shards_failure(shard: ShardServer, caplog) -> None:
    """The other half of the rule: with no new Register (the same shard instance), a data port that
    stops answering is not a reason to change planes: recovery retries it, and its timeout ends
    the job, as for a shard gone."""
    member = _auto_member(shard, recovery_timeout_s=1.0)
    caplog.set_level("WARNING", logger="cgx_ps.worker")
    try:
        await _first_round_on_the_plane(member, shard)
        connection, = shard.dataplane.connections
        shard.dataplane.stop_accepting()  # the port stops answering; gRPC and the session stay
        connection.transport.abort()
        await _until(lambda: member.error is not None, timeout_s=20)
        assert isinstance(member.error, ShardUnavailableError) and "recovery timeout" in str(member.error)
        assert not [r for r in caplog.records if "cannot be reached" in r.getMessage()]  # no fallback
    finally:
        await close([member])


@pytest.mark.parametrize("requested, just_registered, falls_back", [
    ("auto", True, True),  # a first connect, or a rejoin: the port is closed to us, not the shard gone
    ("auto", False, False),  # a stream repaired with no new Register: the plane worked, the shard failed
    ("raw", True, False),  # asked for: a port that cannot be reached is an error, always
    ("raw", False, False),
])
def test_falls_back_to_grpc(requested: str, just_registered: bool, falls_back: bool) -> None:
    assert falls_back_to_grpc(requested, just_registered) is falls_back


@contextlib.contextmanager
def _unanswered_port():
    """A port whose connects hang, as behind a firewall that drops packets: a listener with a
    backlog of none, whose one queued connection is never accepted (the kernel drops the SYNs
    after it)."""
    with socket.socket() as listener, socket.socket() as queued:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        queued.connect(listener.getsockname())
        yield listener.getsockname()[1]


async def test_a_data_port_that_drops_packets_is_given_up_after_the_connect_timeout_saying_so() -> None:
    """Under auto, a worker waits this long once per shard, then takes gRPC with one warning: the
    warning must say why (the timeout's own error has no text: it read "data plane host:port: ")."""
    with _unanswered_port() as port:
        started = time.monotonic()
        with pytest.raises(StreamEnded) as raised:
            await RawCall.open("127.0.0.1", port, TOKEN, read_result, connect_timeout_s=0.5)
        took = time.monotonic() - started
    assert raised.value.code == "UNAVAILABLE"
    assert raised.value.details == (f"data plane 127.0.0.1:{port}: no answer within 0.5s (packets to the port "
                                      f"dropped: a firewall or NetworkPolicy?)"), raised.value.details
    assert 0.5 <= took < 5.0, took


async def test_frame_layer_fuzz_ends_every_connection_cleanly_and_the_members_train_on(shard, caplog) -> None:
    shard.dataplane.first_frame_timeout_s = shard.dataplane.frame_timeout_s = 0.5
    members = await _members(shard, 2)
    caplog.set_level("WARNING")
    try:
        endings = await fuzz_frames("127.0.0.1", shard.data_port, TOKEN, FRAME_CASES, seed=0)
        assert {kind for kind, _ in endings} == set(FRAME_MUTATIONS), endings
        refusals = {code.name for code in STATUS_CODES.values()} - {"INTERNAL"}
        assert {ending for _, ending in endings} <= refusals | {"closed"}, endings  # no hang, no INTERNAL
        # cases past the gate (the handshake right, what follows mutated) reach the service's checks
        assert {"FAILED_PRECONDITION", "UNAUTHENTICATED"} <= {ending for _, ending in endings}, endings
        assert not [r for r in caplog.records if r.exc_info], "a traceback in the log"
        assert len([r for r in caplog.records if r.levelname != "INFO"]) <= FRAME_CASES  # one line per bad call at most
        await _until(lambda: len(shard.dataplane.connections) == 2)  # every hostile connection let go
        pushed, results = await asyncio.wait_for(run_round(members, LAYOUT, 0), 30)
        for block in LAYOUT.blocks:
            check_aggregate(block, pushed[block.block_id], bytes(results[0][block.block_id]))
        assert shard.service.budget.used == 0
    finally:
        await close(members)


@pytest.mark.parametrize("requested, port, tls, expected", [
    ("auto", 7072, False, DataplaneChoice("raw")),
    ("auto", 0, False, DataplaneChoice("grpc")),
    ("grpc", 7072, False, DataplaneChoice("grpc")),
    ("raw", 7072, False, DataplaneChoice("raw")),
    ("raw", 0, False, ConfigError("advertises no data port")),
    ("raw", 7072, True, ConfigError("plaintext")),
    ("auto", 0, True, DataplaneChoice("grpc")),
    ("bogus", 7072, False, ConfigError("not one of auto, grpc, raw")),
])
def test_decide_dataplane(requested, port, tls, expected) -> None:
    if isinstance(expected, ConfigError):
        with pytest.raises(ConfigError, match=str(expected)):
            decide_dataplane(requested, port, tls, "shard-0:7070")
        return
    assert decide_dataplane(requested, port, tls, "shard-0:7070") == expected


def test_auto_under_tls_stays_on_grpc_and_says_why() -> None:
    choice = decide_dataplane("auto", 7072, True, "shard-0:7070")
    assert choice.plane == "grpc" and "TLS" in choice.warning and "shard-0:7070" in choice.warning


def _established(port: int) -> int:
    """Established TCP connections whose local end is ``port`` on this host (the shard's side)."""
    count = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        count += int(local.rsplit(":", 1)[1], 16) == port and state == "01"
    return count


@pytest.mark.slow
def test_workers_on_the_raw_plane_survive_a_shard_restart_exactly(tmp_path: Path, local_cluster) -> None:
    steps = 16
    cluster = local_cluster(2, round_timeout=30, extra_args=["--data-port", "0"])
    workers = start_workers(cluster.addresses, tmp_path, steps, CGX_PS_DATAPLANE="raw",
                            CGX_PS_RECOVERY_TIMEOUT="30")
    try:
        wait_for_rounds(cluster.addresses[1], 4, workers)
        assert all(_established(port) == 2 for port in cluster.data_ports)  # a stream per worker and shard
        cluster.procs[1].kill()  # SIGKILL: the raw streams see a reset, not a status
        cluster.procs[1].wait()
        cluster.restart(1)  # a new instance on the same gRPC port, and a new data port (0: a free one)
        wait_for_rounds(cluster.addresses[1], 6, workers)
        assert _established(cluster.data_ports[1]) == 2  # the rejoin found the new port
        results = finish(workers, timeout_s=120)
    finally:
        for p in workers:
            if p.poll() is None:
                p.kill()
    everything = "\n".join(f"rank {r} (exit {code}):\n{err[-3000:]}" for r, (code, err, _) in enumerate(results))
    for code, err, _ in results:
        assert code == 0, everything
        assert "rejoined the restarted shard" in err, everything
    saved = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    expected = expected_params(saved[0], 2, steps, 1, torch.float32)
    for name, value in expected.items():
        assert torch.equal(saved[0]["final"][name], saved[1]["final"][name]), name
        assert torch.equal(saved[0]["final"][name], value), name  # every step applied exactly once



@pytest.mark.slow
def test_by_default_shards_open_no_plane_and_workers_stream_over_grpc(tmp_path: Path, local_cluster) -> None:
    """No --data-port and no CGX_PS_DATAPLANE anywhere, as `cgx-ps cluster` and `cgx-ps demo` start
    shards (LocalCluster's data_base_port None: the shard's own default): no shard opens the raw
    plane (one port, gRPC, which also carries TLS), the workers' streams take gRPC, and they train
    to the reference's parameters. A worker under auto with no advertised port says nothing of it."""
    steps = 8
    cluster = local_cluster(2, data_base_port=None)
    assert all(port < 0 for port in cluster.data_ports), cluster.data_ports
    workers = start_workers(cluster.addresses, tmp_path, steps)
    try:
        results = finish(workers, timeout_s=120)
    finally:
        for p in workers:
            if p.poll() is None:
                p.kill()
    for code, err, _ in results:
        assert code == 0 and "data plane" not in err, err[-3000:]
    saved = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for name, value in expected_params(saved[0], 2, steps, 1, torch.float32).items():
        assert torch.equal(saved[0]["final"][name], saved[1]["final"][name]), name
        assert torch.equal(saved[0]["final"][name], value), name


async def test_a_member_that_stops_reading_is_let_go_not_held_forever(start_shard) -> None:
    """A member whose stream times out because it stopped reading: the shard's status frame must
    not wait for the reader that will never come, and the connection must be closed, not kept
    (with its unsent results) in the cap's count for as long as the peer acks a zero window."""
    shard = await start_shard(round_timeout_s=0.5)
    shard.dataplane.frame_timeout_s = 1.0  # also how long a closed connection's unsent bytes may wait
    member, = await _members(shard, 1)
    pusher = None
    try:
        await _until(lambda: len(shard.dataplane.connections) == 1)
        connection, = shard.dataplane.connections
        # a slow network: both ends' kernel buffers small, so the shard's transport buffer fills
        shard_socket = connection.transport.get_extra_info("socket")
        shard_socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        member.stream._reader.cancel()  # the member never reads again
        member.stream._call._frames.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)

        async def push() -> None:  # ~0.4 MB of results: far past the buffers and the transport's high-water mark
            gen = torch.Generator().manual_seed(0)
            for round_ in range(12):
                for block in LAYOUT.blocks:
                    await member.push(block.block_id, round_,
                                      encode_block(block, torch.randn(block.numel, generator=gen), seed=0))

        pusher = asyncio.create_task(push())  # its writes may wait too, once the shard stops reading
        started = time.monotonic()
        await _until(lambda: connection not in shard.dataplane.connections, timeout_s=8.0)
        assert connection.task.done() and time.monotonic() - started < 8.0
    finally:
        if pusher is not None:
            pusher.cancel()
            with contextlib.suppress(BaseException):  # its stream broke under it, or the cancel
                await pusher
        await close([member])


async def _challenged(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
    """A shard's side of the handshake, by hand: the opening read, a challenge, the preface read
    (returned)."""
    await reader.readexactly(4 + len(opening()))
    writer.write(_frame(challenge(new_nonce())))
    size, _ = split_header(await reader.readexactly(4))
    return await reader.readexactly(size)


@pytest.mark.parametrize("answer, code, words", [
    # a status longer than any the shard writes (clipped at rpc.MAX_DETAILS_CHARS): clipped here too,
    # not an 8 MiB exception message and log line
    (frame_header(1 << 20, status=True) + b"ABORTED\n" + b"x" * ((1 << 20) - 8), "ABORTED", "clipped"),
    (frame_header(12, status=True) + b"\xff\xfenot a code", "UNKNOWN", "not a code"),
    (frame_header(0x7FFFFFFF), "UNAVAILABLE", f"at most {MAX_FRAME}"),  # refused before it is allocated
    (_frame(b"\x08\x01garbage"), "INTERNAL", "malformed message"),
    (frame_header(100) + b"cut", "UNAVAILABLE", "inside a frame"),
    (b"", "UNAVAILABLE", "without a status"),
])
async def test_a_broken_shard_gives_the_worker_a_clear_error(answer: bytes, code: str, words: str) -> None:
    async def shard(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _challenged(reader, writer)
        writer.write(answer)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(shard, "127.0.0.1", 0)
    try:
        call = await RawCall.open("127.0.0.1", server.sockets[0].getsockname()[1], TOKEN, read_result)
        with pytest.raises(StreamEnded) as raised:
            await asyncio.wait_for(anext(aiter(call)), 5)
        assert raised.value.code == code and words in raised.value.details, raised.value
        assert len(raised.value.details) <= MAX_DETAILS_CHARS
        call.cancel()
    finally:
        server.close()


async def test_the_raw_stream_carries_the_token_the_grpc_calls_do(shard: ShardServer, tmp_path: Path) -> None:
    """Both planes authenticate with the token read when the client was made (the gRPC calls'
    metadata): a token file gone or unreadable later (a Secret's volume remounted) must not fail a
    repair on the raw plane, with a traceback, where the gRPC stream would go on."""
    token_file = tmp_path / "job.token"
    token_file.write_bytes(TOKEN)
    token_file.chmod(0o600)
    member = ShardClient(f"127.0.0.1:{shard.port}", "node-0", 1, LAYOUT, connect_timeout_s=5,
                         security=ChannelSecurity(token_file=str(token_file)), dataplane="raw")
    await member.connect()
    try:
        token_file.unlink()
        await member.reopen()
        _, results = await asyncio.wait_for(run_round([member], LAYOUT, 0), 30)
        assert len(results[0]) == len(LAYOUT.blocks) and len(shard.dataplane.connections) == 1
    finally:
        await close([member])


async def test_connections_without_a_preface_cannot_lock_the_members_out(start_shard) -> None:
    """Without the token, a client can open connections and say nothing: they must not fill the
    cap that members' streams need (on the gRPC port a call without the token is refused at once,
    and an idle HTTP/2 connection holds no call slot). The oldest silent one makes way."""
    shard = await start_shard(max_concurrent_rpcs=8)
    silent = [await asyncio.open_connection("127.0.0.1", shard.data_port) for _ in range(12)]
    members: list[ShardClient] = []
    try:
        members = await _members(shard, 2)
        _, results = await asyncio.wait_for(run_round(members, LAYOUT, 0), 30)
        assert len(results[1]) == len(LAYOUT.blocks) and all(c.recoveries == 0 for c in members)
        assert len(shard.dataplane.connections) <= 8 + 2  # the silent ones beyond the cap were let go
    finally:
        await close(members)
        for _, writer in silent:
            writer.close()


async def test_cancel_ends_a_write_the_shard_does_not_read() -> None:
    """A hung shard (stopped, cut off) reads nothing, so a push waits in the socket's send; when the
    worker gives the stream up (its hung detection, a repair, close) that write must fail, as a
    cancelled gRPC call's does: it holds the client's write lock, which the repair needs next."""
    accepted: list[asyncio.StreamWriter] = []

    async def hung_shard(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)
        await reader.readexactly(4 + len(opening()))
        writer.write(_frame(challenge(new_nonce())))  # and then reads nothing

    server = await asyncio.start_server(hung_shard, "127.0.0.1", 0)
    try:
        call = await RawCall.open("127.0.0.1", server.sockets[0].getsockname()[1], TOKEN, read_result)
        call._frames.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)

        async def push() -> None:
            while True:
                await call.write(bytes(1 << 20))

        writing = asyncio.create_task(push())
        await asyncio.sleep(0.3)
        assert not writing.done()  # waiting in the send
        call.cancel()
        with pytest.raises(StreamEnded) as raised:
            await asyncio.wait_for(writing, 2.0)
        assert raised.value.code == "CANCELLED"  # as every ExchangeCall's (test_exchange_call_contract.py)
        await _until(lambda: call._frames.sock.fileno() == -1, 2.0)  # and the socket is closed
    finally:
        for writer in accepted:
            writer.close()
        server.close()


async def test_the_raw_stream_tries_every_address_of_the_shards_name(shard: ShardServer, monkeypatch) -> None:
    """A name with an address the data plane does not listen on first (a dual-stack cluster's
    IPv6 address for a shard bound to 0.0.0.0): gRPC tries the next, and so must the raw stream,
    or auto would warn and fall back, and raw would fail."""
    loop = asyncio.get_running_loop()
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        closed_port = unused.getsockname()[1]
    answer = [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", closed_port)),  # refused
              (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", shard.data_port))]

    async def getaddrinfo(host, port, **kwargs):
        return answer if host == "shard-0.example" else await original(host, port, **kwargs)

    original = loop.getaddrinfo
    monkeypatch.setattr(loop, "getaddrinfo", getaddrinfo)
    call = await RawCall.open("shard-0.example", shard.data_port, TOKEN, read_result)
    try:
        await _until(lambda: len(shard.dataplane.connections) == 1 and not shard.dataplane.pending)
    finally:
        call.cancel()


async def test_a_shard_on_every_ipv6_address_serves_ipv4_workers_on_both_ports(start_shard, caplog) -> None:
    """--host :: (docs/deploy.md's advice for IPv6 clusters): gRPC's port takes IPv4 connections
    too, so the data plane must, or a dual-stack cluster's IPv4 workers get gRPC only (auto, after a
    warning) or fail (raw)."""
    shard = await start_shard(host="::")
    members = [ShardClient(f"127.0.0.1:{shard.port}", "node-0", 1, LAYOUT, connect_timeout_s=5, security=SECURITY,
                           dataplane="raw")]
    try:
        await members[0].connect()
        _, results = await asyncio.wait_for(run_round(members, LAYOUT, 0), 30)
        assert len(results[0]) == len(LAYOUT.blocks) and len(shard.dataplane.connections) == 1
        caplog.set_level("WARNING", logger="cgx_ps.server.rpc.gate")
        for address, named in (("::1", "ipv6:[::1]:"), ("127.0.0.1", "ipv4:127.0.0.1:")):  # and IPv6, as before
            reader, writer = await _proven(shard.data_port, b"not-the-job-token", address)
            assert (await _ending(reader))[0] == "UNAUTHENTICATED"
            writer.close()
            # the log names an IPv4 client as the gRPC port's lines do, not as ipv6:::ffff:127.0.0.1
            assert any(f"from {named}" in r.getMessage() for r in caplog.records), named
    finally:
        await close(members)


@pytest.mark.parametrize("peername, name", [
    (("10.0.0.5", 41234), "ipv4:10.0.0.5:41234"),
    (("::ffff:10.0.0.5", 41234, 0, 0), "ipv4:10.0.0.5:41234"),  # an IPv4 client of the socket on ::
    (("fd00::5", 41234, 0, 0), "ipv6:[fd00::5]:41234"),
    (("fe80::1%eth0", 41234, 0, 2), "ipv6:[fe80::1]:41234"),
    (None, "unknown"),
])
def test_peers_are_named_as_grpc_names_them(peername, name) -> None:
    assert peer_name(peername) == name


async def test_a_name_of_several_addresses_gets_one_data_port_on_all_of_them(shard: ShardServer,
                                                                             monkeypatch) -> None:
    """Port 0 on a name with an IPv4 and an IPv6 address (localhost where /etc/hosts lists ::1 too):
    asyncio bound each to a free port of its own and one was advertised, so a worker naming the
    other address was refused (or gave its token to another program on that port)."""
    loop = asyncio.get_running_loop()
    resolve = loop.getaddrinfo

    async def dual_stack_name(host, port, **kwargs):
        if host != "dual.invalid":
            return await resolve(host, port, **kwargs)
        return [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::1", port, 0, 0)),
                (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port))]

    monkeypatch.setattr(loop, "getaddrinfo", dual_stack_name)
    plane = DataPlane(shard.service, shard.dataplane.gate, max_connections=8)
    port = await plane.start("dual.invalid", 0)
    try:
        assert {sock.getsockname()[1] for sock in plane._server.sockets} == {port}
        assert len(plane._server.sockets) == 2
        for address in ("127.0.0.1", "::1"):
            reader, writer = await _proven(port, b"not-the-job-token", address)
            assert (await _ending(reader))[0] == "UNAUTHENTICATED", address
            writer.close()
    finally:
        await plane.close()


async def test_the_metrics_count_open_streams_by_plane(start_shard) -> None:
    """An operator sees which plane the workers use: cgx_ps_exchange_streams{plane} counts the
    streams open on each, both series there from the start, and each falls back when its
    streams end."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    shard = await start_shard(metrics_port=0)

    def streams() -> dict[str, float]:
        with urllib.request.urlopen(f"http://127.0.0.1:{shard.metrics_port}/metrics", timeout=10) as r:
            text = r.read().decode()
        (family,) = [f for f in text_string_to_metric_families(text) if f.name == "cgx_ps_exchange_streams"]
        assert all(s.labels["shard"] == "0" for s in family.samples)
        return {s.labels["plane"]: s.value for s in family.samples}

    assert streams() == {"grpc": 0, "raw": 0}
    # three nodes of one session: two stream over the plane, one over gRPC
    members = [ShardClient(f"127.0.0.1:{shard.port}", f"node-{i}", 3, LAYOUT, connect_timeout_s=5, security=SECURITY,
                           dataplane=plane) for i, plane in enumerate(("raw", "raw", "grpc"))]
    try:
        for c in members:
            await c.connect()
        await _until(lambda: streams() == {"grpc": 1, "raw": 2}, timeout_s=20)
        _, results = await asyncio.wait_for(run_round(members, LAYOUT, 0), 30)
        assert len(results) == 3 and all(len(r) == len(LAYOUT.blocks) for r in results)
        await members[0].close()
        await _until(lambda: streams() == {"grpc": 1, "raw": 1}, timeout_s=20)
    finally:
        await close(members)
    await _until(lambda: streams() == {"grpc": 0, "raw": 0}, timeout_s=20)


def _reset(sock: socket.socket, sent: bytes = b"") -> None:
    """End ``sock`` with a TCP RST (SO_LINGER 0), after ``sent`` (a frame's first bytes, say)."""
    if sent:
        sock.send(sent)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def _shard_side_error(error: OSError) -> Callable[[Any], None]:
    """What asyncio's transport does when a read or write on the shard's socket fails with
    ``error``, as a keepalive timeout's ETIMEDOUT or a write's EPIPE does (_fatal_error)."""
    def fail(connection: Any) -> None:
        connection.transport._fatal_error(error)
    return fail


@pytest.mark.parametrize("ending, words", [
    ("reset", "data plane connection lost: Connection reset by peer"),
    ("reset mid-frame", "data plane connection lost: Connection reset by peer"),
    ("shutdown mid-frame", "the connection closed inside a frame"),
    ("keepalive timeout", "data plane connection lost: Connection timed out"),
    ("broken pipe", "data plane connection lost: Broken pipe"),
])
async def test_a_member_connection_that_ends_is_one_warning_line_never_a_traceback(start_shard, caplog, ending,
                                                                                    words) -> None:
    """However a member's connection ends (a reset, a keepalive timeout, a write's EPIPE, a close
    inside a frame), the shard logs it as one WARNING line naming the node: an event of the
    network, not an ERROR with a traceback (15 lines once, for a node cut off past TCP
    keepalive)."""
    shard = await start_shard()
    member, = await _members(shard, 1)
    try:
        # its stream open on the shard (past the handshake and the Hello): the shard reads its pushes
        await _until(lambda: len(shard.dataplane.connections) == 1 and shard.service.session.streams)
        connection, = shard.dataplane.connections
        member.stream._reader.cancel()  # the member's own reaction (a recovery) is not under test
        client = member.stream._call._frames.sock
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="cgx_ps"):
            if ending == "reset":
                _reset(client)
            elif ending == "reset mid-frame":
                _reset(client, frame_header(1000) + b"x" * 10)
            elif ending == "shutdown mid-frame":
                client.send(frame_header(1000) + b"x" * 10)
                client.shutdown(socket.SHUT_WR)
            elif ending == "keepalive timeout":
                _shard_side_error(TimeoutError(errno.ETIMEDOUT, os.strerror(errno.ETIMEDOUT)))(connection)
            else:
                _shard_side_error(BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE)))(connection)
            await _until(lambda: any(words in r.getMessage() for r in caplog.records))
            await _until(lambda: connection not in shard.dataplane.connections)
            await asyncio.sleep(0.2)  # what else the end writes is in the log by now
        lines = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert [r.levelname for r in lines] == ["WARNING"], [r.getMessage() for r in lines]
        assert "node-0" in lines[0].getMessage() and "unexpected" not in lines[0].getMessage()
        assert not any(r.exc_info for r in caplog.records), "a traceback in the log"
    finally:
        await close([member])
