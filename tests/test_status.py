"""`cgx-ps status` and the shard's Status RPC: real shards on port 0 with a job token, real
clients training rounds, and the real CLI in a process of its own, judged by its exit code."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from cgx_ps.kernels import Codec, encode
from cgx_ps.server import ShardServer
from cgx_ps.cli.status_table import ShardReport, _add_rates, probe_all, render_table
from cgx_ps.v1 import ps_pb2, ps_pb2_grpc
from cgx_ps.worker.shards.client import ShardClient
from cgx_ps.worker.pipeline.blocks import Compression, TensorInfo, build_layout
from cgx_ps.server.cluster import wait_for_port_file
from support import METADATA, SECURITY, TOKEN_FILE, interruptible

SHARD_SETTINGS = dict(metrics_port=0, round_timeout_s=5.0)  # conftest.start_shard

LAYOUT = build_layout([TensorInfo("w", (64, 64)), TensorInfo("v", (32, 100))], 1, Compression(bits=None),
                      block_bytes=8 << 10)
STATUS = "/cgx_ps.v1.ParameterServer/Status"


async def status_of(server: ShardServer, metadata=METADATA) -> ps_pb2.StatusResponse:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        return await ps_pb2_grpc.ParameterServerStub(channel).Status(ps_pb2.StatusRequest(), metadata=metadata,
                                                                     timeout=5)


async def train(server: ShardServer, rounds: int, job: str = "job-7", nodes: int = 2,
                security=SECURITY) -> list[ShardClient]:
    clients = [ShardClient(f"127.0.0.1:{server.port}", f"node-{i}", nodes, LAYOUT, connect_timeout_s=5,
                           job_id=job, security=security) for i in range(nodes)]
    for c in clients:
        await c.connect()
    for round_ in range(rounds):
        await asyncio.gather(*[c.exchange(b.block_id, round_, encode(torch.ones(b.numel), Codec.FP32).to_bytes())
                               for c in clients for b in LAYOUT.blocks])
    return clients


async def status_eventually(server: ShardServer, condition, timeout_s: float = 20) -> ps_pb2.StatusResponse:
    """The shard's first Status for which ``condition`` holds, asked every 50 ms: what the shard
    does in the background (a timer, a closed connection) takes its time on a loaded machine."""
    deadline = time.monotonic() + timeout_s
    while not condition(s := await status_of(server)):
        assert time.monotonic() < deadline, f"not within {timeout_s:g}s; the last status:\n{s}"
        await asyncio.sleep(0.05)
    return s


def scrape(server: ShardServer) -> dict[str, list]:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


async def test_status_reports_the_session_and_agrees_with_the_metrics(start_shard):
    server = await start_shard()
    try:
        before = await status_of(server)
        assert before.session_state == ps_pb2.SESSION_STATE_NONE and before.instance_id == server.service.instance_id
        clients = await train(server, rounds=3)
        s = await status_of(server)
        assert s.session_state == ps_pb2.SESSION_STATE_ACTIVE
        assert s.job_id == "job-7"  # the caller proved it belongs to the job
        assert (s.num_nodes, s.nodes_registered, s.members_registered, s.streams_open) == (2, 2, 2, 2)
        assert s.blocks_owned == len(LAYOUT.blocks) and s.rounds_completed == 3
        assert s.rounds_total == 3 * len(LAYOUT.blocks) and s.rounds_failed == 0
        fp32 = sum(len(encode(torch.ones(b.numel), Codec.FP32).to_bytes()) for b in LAYOUT.blocks)
        assert s.bytes_in == 3 * 2 * fp32 and s.bytes_out == s.bytes_in
        assert s.max_inflight_bytes == server.config.max_inflight_bytes and s.inflight_bytes == 0
        assert s.uptime_s > before.uptime_s and not s.draining
        assert "session_id" not in ps_pb2.StatusResponse.DESCRIPTOR.fields_by_name  # proof of membership
        # the same numbers Prometheus scrapes, plus the session gauges served from the same state
        metrics = scrape(server)
        assert metrics["cgx_ps_bytes_in"][0].value == s.bytes_in
        assert metrics["cgx_ps_max_inflight_bytes"][0].value == s.max_inflight_bytes
        states = {x.labels["state"]: x.value for x in metrics["cgx_ps_session_state"]}
        assert states == {"none": 0, "active": 1, "idle": 0, "failed": 0}
        assert metrics["cgx_ps_session_rounds_completed"][0].value == 3
        assert metrics["cgx_ps_session_nodes"][0].value == 2
        for c in clients:
            await c.close()
        # the shard sees the streams end when their connections close: soon, not at once
        await status_eventually(server, lambda s: s.session_state == ps_pb2.SESSION_STATE_IDLE)
    finally:
        await server.stop(drain=False)


async def test_status_names_the_last_error_and_a_failed_round(start_shard):
    server = await start_shard(round_timeout_s=0.5)
    try:
        clients = await train(server, rounds=1)
        # node-0 pushes round 1, node-1 never does: the round fails after the timeout
        await clients[0].push(LAYOUT.blocks[0].block_id, 1, encode(torch.ones(LAYOUT.blocks[0].numel),
                                                                   Codec.FP32).to_bytes())
        # the round timeout's timer fails it 0.5 s on, later on a loaded machine
        s = await status_eventually(server, lambda s: s.session_state == ps_pb2.SESSION_STATE_FAILED)
        assert s.rounds_failed == 1
        assert "node-1" in s.last_error and 0 <= s.last_error_age_s < 5, s.last_error
        for c in clients:
            await c.close()
    finally:
        await server.stop(drain=False)


async def test_status_needs_the_token_and_an_open_shard_withholds_the_job(start_shard):
    server = await start_shard()
    try:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await status_of(server, metadata=None)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await server.stop(drain=False)
    open_shard = await start_shard(token_file=None)
    try:
        clients = await train(open_shard, rounds=1, job="secret-job", security=type(SECURITY)())
        with pytest.raises(Exception, match="block 99 is not owned"):  # a rejected push, logged
            await asyncio.wait_for(clients[0].exchange(99, 0, b"x"), 10)
        s = await status_of(open_shard, metadata=None)
        assert s.session_state != ps_pb2.SESSION_STATE_NONE and s.nodes_registered == 2
        assert s.job_id == "" and "secret-job" not in str(s)  # a stranger must not learn the job
        assert s.last_error.startswith("(details withheld") and s.pushes_rejected == 1
        for c in clients:
            await c.close()
    finally:
        await open_shard.stop(drain=False)


def test_rates_come_from_two_samples_of_the_same_shard_instance():
    def report(uptime: float, bytes_in: int, instance: str = "a", rounds: int = 10) -> ShardReport:
        return ShardReport(0, "x:1", "SERVING", status=ps_pb2.StatusResponse(
            instance_id=instance, uptime_s=uptime, bytes_in=bytes_in, bytes_out=2 * bytes_in, rounds_completed=rounds))

    now = report(12.0, 3000)
    _add_rates(now, report(10.0, 1000))
    assert now.rates == {"bytes_in": 1000.0, "bytes_out": 2000.0, "rounds_total": 0.0, "rounds_completed": 0.0}
    restarted = report(1.0, 10, instance="b")
    _add_rates(restarted, report(10.0, 1000))
    assert restarted.rates == {}  # a restarted shard's counters started over
    new_session = report(12.0, 3000, rounds=2)
    _add_rates(new_session, report(10.0, 1000, rounds=50))
    assert "rounds_completed" not in new_session.rates and new_session.rates["bytes_in"] == 1000.0


async def test_probe_names_shards_listed_out_of_order(start_shard):
    a, b = await start_shard(num_shards=2, shard_index=0), await start_shard(num_shards=2, shard_index=1)
    try:
        reports = await asyncio.to_thread(probe_all, [f"127.0.0.1:{b.port}", f"127.0.0.1:{a.port}"], SECURITY)
        assert not any(r.ok for r in reports)
        assert "listed as shard 0 of 2, but it is shard 1 of 2" in reports[0].problems[0]
        table = render_table(reports, width=10_000)  # as the CLI prints it off a terminal (on one: its width)
        assert "CGX_PS_SERVERS must list the shards in index order" in table
    finally:
        await a.stop(drain=False)
        await b.stop(drain=False)


async def test_a_draining_shard_is_not_ok(start_shard):
    server = await start_shard()
    try:
        await server.health.enter_graceful_shutdown()  # what SIGTERM does first
        server.service.draining = True
        (report,) = await asyncio.to_thread(probe_all, [f"127.0.0.1:{server.port}"], SECURITY)
        assert report.health == "NOT_SERVING" and report.status.draining and not report.ok
        assert "draining" in render_table([report]).splitlines()[1]
    finally:
        await server.stop(drain=False)


# ---- the command, as a user runs it ------------------------------------------------------------------


def cgx_ps(*args: str, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("CGX_PS_")}
    return subprocess.run([sys.executable, "-m", "cgx_ps.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**base, **env})


@contextlib.contextmanager
def shard_process(tmp_path: Path, *args: str):
    """`cgx-ps server` with a token on port 0; yields its address and its port file's contents."""
    port_file = tmp_path / f"ports-{time.monotonic_ns()}.json"
    proc = subprocess.Popen([sys.executable, "-m", "cgx_ps.cli", "server", "--host", "127.0.0.1", "--port", "0",
                             "--metrics-port", "-1", "--token-file", TOKEN_FILE, "--kernel-threads", "1",
                             "--port-file", str(port_file), *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        try:
            info = wait_for_port_file(proc, port_file, time.monotonic() + 60)
        except (RuntimeError, TimeoutError) as exc:
            raise AssertionError(f"shard {exc}: {proc.stderr.read()}") from None
        yield f"127.0.0.1:{info['port']}", info
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)


def test_cgx_ps_status_command(tmp_path):
    """A user's first look: the exit code gates readiness, each shard gets one line."""
    with shard_process(tmp_path, "--shard-index", "0", "--num-shards", "2", "--data-port", "0") as (a, ports), \
            shard_process(tmp_path, "--shard-index", "1", "--num-shards", "2", "--data-port", "-1") as (b, _):
        env = {"CGX_PS_SERVERS": f"{a},{b}", "CGX_PS_TOKEN_FILE": TOKEN_FILE}
        ok = cgx_ps("status", env=env)
        assert ok.returncode == 0, ok.stdout + ok.stderr
        lines = ok.stdout.splitlines()
        assert lines[0].endswith("2/2 shards OK") and lines[1].split()[:3] == ["SHARD", "ADDRESS", "HEALTH"]
        # the data port: shard 0's raw data plane, shard 1 has none (its workers stream over gRPC)
        assert ports["data_port"] > 0
        assert lines[2].split()[:5] == ["0", a, "SERVING", str(ports["data_port"]), "none"]
        assert lines[3].split()[:5] == ["1", b, "SERVING", "off", "none"]
        assert "B/s" in lines[2]  # two samples: rates

        as_json = cgx_ps("status", "--json", "--sample", "0", env=env)
        assert as_json.returncode == 0
        doc = json.loads(as_json.stdout)
        assert doc["ok"] and [s["status"]["shard_index"] for s in doc["shards"]] == [0, 1]
        assert doc["shards"][0]["status"]["session_state"] == "SESSION_STATE_NONE"
        assert [s["status"]["data_port"] for s in doc["shards"]] == [ports["data_port"], 0]

        no_token = cgx_ps("status", "--sample", "0", env={"CGX_PS_SERVERS": f"{a},{b}"})
        assert no_token.returncode == 1
        assert "UNAUTHENTICATED" in no_token.stdout and "set CGX_PS_TOKEN_FILE" in no_token.stdout

        down = cgx_ps("status", "--sample", "0", "--servers", f"{a},127.0.0.1:1", env=env)
        assert down.returncode == 1
        assert "listed as shard 0 of 2" not in down.stdout
        row = down.stdout.splitlines()[3].split()
        assert row[:3] == ["1", "127.0.0.1:1", "DOWN"] and "UNAVAILABLE" in down.stdout

        watch = interruptible([sys.executable, "-m", "cgx_ps.cli", "status", "--watch", "0.3"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,  # a traceback too
                              env={**{k: v for k, v in os.environ.items() if not k.startswith("CGX_PS_")}, **env})
        # two samples shown, then Ctrl-C: a clean stop, no traceback (a fixed 4 s sleep assumed the
        # process had started and shown two samples by then; on a loaded machine the signal could
        # come during its start-up, before `status` handles it)
        shown: list[str] = []
        while sum("2/2 shards OK" in line for line in shown) < 2 and (line := watch.stdout.readline()):
            shown.append(line)  # (pytest's timeout ends a watch that stalls; its exit ends the loop)
        watch.send_signal(signal.SIGINT)
        rest, _ = watch.communicate(timeout=20)
        out = "".join(shown) + rest
        assert watch.returncode == 0 and out.count("2/2 shards OK") >= 2 and "Traceback" not in out, out

    assert cgx_ps("status", env={}).returncode == 2
    bad = cgx_ps("status", env={"CGX_PS_SERVERS": "a:1", "CGX_PS_TOKEN_FILE": str(tmp_path / "none")})
    assert bad.returncode == 2 and "cannot read it" in bad.stderr


async def test_status_at_the_health_port_says_so_and_names_the_grpc_port(start_shard):
    """`cgx-ps status` pointed at a shard's --health-port: before, "the shard runs a cgx-ps without
    the Status RPC". Now the port says what it is and which port to ask; a worker that registers
    there is told the same. A gRPC server that is no shard at all gets the hint that it may not be
    a shard's gRPC port, not only that the shard is old."""
    shard = await start_shard(health_port=0)
    report, = await asyncio.to_thread(probe_all, [f"127.0.0.1:{shard.health_port}"], SECURITY)
    assert report.health == "SERVING" and not report.ok
    assert report.problems == [f"Status refused: UNIMPLEMENTED: this is shard 0's health-only port "
                               f"(--health-port); its gRPC port is {shard.port}"], report.problems
    worker = ShardClient(f"127.0.0.1:{shard.health_port}", "node-0", 1, LAYOUT, connect_timeout_s=5,
                         security=SECURITY)
    with pytest.raises(Exception, match=f"health-only port .*its gRPC port is {shard.port}"):
        await worker.connect()
    await worker.close()
    stranger = grpc.aio.server()  # the health service only, as another program's server may have it
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, stranger)
    await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    port = stranger.add_insecure_port("127.0.0.1:0")
    await stranger.start()
    try:
        report, = await asyncio.to_thread(probe_all, [f"127.0.0.1:{port}"], SECURITY)
        assert "not a shard's gRPC port" in report.problems[0], report.problems
    finally:
        await stranger.stop(None)
