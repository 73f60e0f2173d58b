"""Attacks on a real shard and real workers (docs/security.md): one test per attack, each of
which would succeed against the code before the security work.

Certificates are made here with trustme, never committed."""

from __future__ import annotations

import asyncio
import json
import math
import os
import pickle
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import grpc
import pytest
import torch
import trustme
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cgx_ps.kernels import Codec, encode
from cgx_ps.kernels.wire import max_encoded_size
from cgx_ps.model_layout import layout_hash
from cgx_ps.net.security import ChannelSecurity, CredentialError
from cgx_ps.server import ServerConfig, ShardServer
from cgx_ps.server.session.blobs import BlobError, BlobStore
from cgx_ps.server.process.allocator import TRIM_THRESHOLD
from cgx_ps.server.main import exposure_problem, exposure_warning
from cgx_ps.v1 import ps_pb2, ps_pb2_grpc
from cgx_ps.worker import ConfigError, WorkerConfig
from cgx_ps.worker.shards.client import ShardClient
from cgx_ps.worker.shards.recovery import WRITE_FAILED_DETAILS
from cgx_ps.worker.shards.exchange_stream import ExchangeStream
from cgx_ps.worker.errors import ShardRejectedError, ShardUnavailableError
from cgx_ps.worker.pipeline.blocks import Compression, TensorInfo, build_layout
from support import METADATA, SECURITY, TOKEN_FILE
from workers.warm_start import start_worker

SHARD_SETTINGS = dict(round_timeout_s=3.0, drain_timeout_s=2.0)  # conftest.start_shard

ROOT = Path(__file__).resolve().parents[1]
SERVICE = "/cgx_ps.v1.ParameterServer/"
WRONG = (("authorization", "Bearer " + "x" * 43),)


def layout_of(*shapes: tuple[int, ...], block_bytes: int = 64 << 10) -> ps_pb2.Layout:
    return build_layout([TensorInfo(f"t{i}", s) for i, s in enumerate(shapes)], 1, Compression(bits=None),
                        block_bytes=block_bytes)


async def member(server: ShardServer, layout: ps_pb2.Layout, node: str = "node-0", nodes: int = 1,
                 security: ChannelSecurity = SECURITY, connect_timeout_s: float = 5, **kw) -> ShardClient:
    client = ShardClient(f"127.0.0.1:{server.port}", node, nodes, layout, connect_timeout_s=connect_timeout_s,
                         security=security, **kw)
    await client.connect()
    return client


async def status_of(coro) -> tuple[grpc.StatusCode, str]:
    try:
        result = coro
        if hasattr(result, "__aiter__"):
            async for _ in result:
                pass
        else:
            await result
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


async def raw_calls(channel: grpc.aio.Channel, payload: bytes, metadata) -> dict[str, tuple[grpc.StatusCode, str]]:
    """Every ParameterServer method called with raw bytes (no client-side serializer)."""
    out = {}
    for name in ("Register", "SetCodecs", "Status"):
        out[name] = await status_of(channel.unary_unary(SERVICE + name)(payload, metadata=metadata, timeout=5))
    out["GetBlob"] = await status_of(channel.unary_stream(SERVICE + "GetBlob")(payload, metadata=metadata, timeout=5))
    for name in ("PutBlob", "Probe"):
        out[name] = await status_of(channel.stream_unary(SERVICE + name)(iter([payload]), metadata=metadata,
                                                                          timeout=5))
    out["Exchange"] = await status_of(channel.stream_stream(SERVICE + "Exchange")(iter([payload]),
                                                                                  metadata=metadata, timeout=5))
    return out


# ---- 1. no code execution from the wire -------------------------------------------------------------


class _Plant:
    """Unpickling this touches a marker file: proof that a pickle ran code."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


async def _put_stripes(addresses: list[str], layout: ps_pb2.Layout, writers: list[str], nodes: int, job: str,
                       data: bytes) -> None:
    """Join the victim's session on each shard as ``writers[i]`` member 0 and put stripe ``i`` of ``data``
    at broadcast/0 there (a broadcast is striped over the shards: shards/engine.py ``stripes``)."""
    from cgx_ps.worker.shards.engine import stripes

    for address, node, part in zip(addresses, writers, stripes(data, len(addresses))):
        client = ShardClient(address, node, nodes, layout, connect_timeout_s=10, security=SECURITY, job_id=job)
        await client.connect()
        async with grpc.aio.insecure_channel(address) as channel:
            await ps_pb2_grpc.ParameterServerStub(channel).PutBlob(
                iter([ps_pb2.BlobChunk(key="broadcast/0", total_bytes=len(part), offset=0, data=bytes(part), node_id=node,
                                       member=0, session_id=client.session_id)]), metadata=METADATA, timeout=10)
        await client.close()


@pytest.mark.slow
@pytest.mark.parametrize("writer", ["root", "another member", "one stripe by another member"])
def test_a_planted_blob_executes_nothing_and_is_refused(tmp_path, writer, local_cluster):
    """Before: broadcast blobs were torch.load(weights_only=False)ed, so whoever wrote
    broadcast/0 ran code in every worker. Now a pickle is refused as not a cgx-ps blob, and a
    valid blob from anyone but the root rank is refused too, as is a blob one of whose stripes
    (one per shard) another member wrote."""
    marker = tmp_path / "pwned"
    nodes = 3
    cluster = local_cluster(2, round_timeout=30)
    job = f"victim-{uuid.uuid4().hex[:6]}"
    env = dict(os.environ, **cluster.worker_env(), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
               LOCAL_WORLD_SIZE="1", CGX_PS_NODE_RANK="1", CGX_PS_NUM_NODES=str(nodes), CGX_PS_JOB_ID=job,
               OMP_NUM_THREADS="1", CGX_PS_CONNECT_TIMEOUT="20")
    layout_file = tmp_path / "layout.pb"
    proc = start_worker([sys.executable, str(ROOT / "tests/workers/broadcast_worker.py"), "--layout-out",
                         str(layout_file)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not layout_file.exists():
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the victim never registered"
            time.sleep(0.05)
        layout = ps_pb2.Layout.FromString(layout_file.read_bytes())
        from cgx_ps.worker.broadcast.blob_format import encode_object
        if writer == "root":  # a compromised or impersonated root puts a pickle
            writers, data = ["node-0"] * 2, pickle.dumps({"0.weight": _Plant(str(marker))})
        elif writer == "another member":  # a valid blob, written by a member that is not the root rank
            writers, data = ["node-2"] * 2, encode_object({"0.weight": torch.zeros(32, 16)})
        else:  # the root's stripe on shard 0, another member's on shard 1
            writers, data = ["node-0", "node-2"], encode_object({"0.weight": torch.zeros(32, 16)})
        asyncio.run(_put_stripes(list(cluster.addresses), layout, writers, nodes, job, data))
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    outcome = json.loads(out.strip().splitlines()[-1])
    assert not marker.exists(), "the planted pickle ran code in the worker"
    assert outcome["ok"] is False and outcome["type"] == "BroadcastError", outcome
    if writer == "root":
        assert "not a cgx-ps broadcast blob" in outcome["error"], outcome
    elif writer == "another member":
        assert "written by node 'node-2' member 0, not by the root rank 0" in outcome["error"], outcome
    else:
        assert "stripes on the shards were written by different members" in outcome["error"], outcome


# ---- 2. the job token ---------------------------------------------------------------------------------


def client_side_race(method: str, code: grpc.StatusCode, details: str) -> grpc.StatusCode:
    """The status the shard sent. grpc.aio's client replaces it with INTERNAL "Internal error from
    Core" when its write of a streamed request fails because the server already ended the call
    (grpc/grpc#36066, the worker's recovery.WRITE_FAILED_DETAILS; about 1 in 80 refused Exchange
    calls on loopback here). The shard ended the call before taking its one request, which only the
    token check does."""
    streamed = method in ("PutBlob", "Probe", "Exchange")
    if streamed and code == grpc.StatusCode.INTERNAL and details == WRITE_FAILED_DETAILS:
        return grpc.StatusCode.UNAUTHENTICATED
    return code


@pytest.mark.parametrize("metadata", [None, WRONG, (("authorization", "Basic abc"),)], ids=["none", "wrong", "basic"])
async def test_every_rpc_refuses_a_missing_or_wrong_token_before_parsing(start_shard, metadata):
    server = await start_shard()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        # garbage bodies: UNAUTHENTICATED (not INVALID_ARGUMENT) shows the token is checked first
        statuses = await raw_calls(channel, b"\xff\xfe garbage", metadata)
        assert {m: client_side_race(m, code, details) for m, (code, details) in statuses.items()} == \
            {m: grpc.StatusCode.UNAUTHENTICATED for m in statuses}, statuses
        # the health service stays open for probes
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    assert server.service.session is None  # nothing reached the service


async def test_a_worker_with_the_wrong_token_fails_at_once_naming_it(start_shard, tmp_path):
    server = await start_shard()
    wrong = tmp_path / "token"
    wrong.write_text("y" * 40)
    t0 = time.monotonic()
    with pytest.raises(ShardRejectedError, match="UNAUTHENTICATED.*check CGX_PS_TOKEN_FILE"):
        await member(server, layout_of((64, 64)), security=ChannelSecurity(token_file=str(wrong)))
    assert time.monotonic() - t0 < 5  # not retried for the connect timeout


@pytest.mark.parametrize("content, match", [("", "holds 0 characters"), ("short", "at least 16"),
                                            ("has space inside the token!", "printable ASCII")])
def test_bad_token_files_are_named(tmp_path, content, match):
    path = tmp_path / "token"
    path.write_text(content)
    with pytest.raises(ConfigError, match=match):
        WorkerConfig.from_env({"CGX_PS_SERVERS": "a:1", "CGX_PS_TOKEN_FILE": str(path)})
    with pytest.raises(ConfigError, match="cannot read it"):
        WorkerConfig.from_env({"CGX_PS_SERVERS": "a:1", "CGX_PS_TOKEN_FILE": str(tmp_path / "missing")})


def test_a_shard_with_an_unreadable_token_file_stops_with_one_line(tmp_path):
    res = subprocess.run([sys.executable, "-m", "cgx_ps.cli", "server", "--host", "127.0.0.1", "--port", "0",
                          "--metrics-port", "-1", "--token-file", str(tmp_path / "nope")],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "token file" in res.stderr and "cannot read it" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr, res.stderr


# ---- session takeover, stream replacement, codec changes by strangers -------------------------------


async def test_strangers_cannot_take_over_a_session(start_shard):
    layout = layout_of((64, 64))
    server = await start_shard()
    a = await member(server, layout, nodes=1, job_id="J")
    session = server.service.session
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        register = ps_pb2.RegisterRequest(node_id="node-0", num_nodes=1, layout=layout, layout_hash=layout_hash(layout),
                                          job_id="J")
        # without the token: nothing, whatever it knows
        assert (await status_of(stub.Register(register, metadata=WRONG)))[0] == grpc.StatusCode.UNAUTHENTICATED
        # with the token but not a member (no session id): no codecs, no blobs, no stream
        code, details = await status_of(stub.SetCodecs(ps_pb2.SetCodecsRequest(
            node_id="node-0", from_round=1, blocks=[ps_pb2.BlockCodec(block_id=0, codec=layout.blocks[0].codec)]),
            metadata=METADATA))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "not a member" in details
        code, _ = await status_of(stub.GetBlob(ps_pb2.GetBlobRequest(key="broadcast/0", timeout_s=1),
                                               metadata=METADATA))
        assert code == grpc.StatusCode.PERMISSION_DENIED
        code, _ = await status_of(stub.PutBlob(iter([ps_pb2.BlobChunk(key="broadcast/0", total_bytes=1, data=b"x",
                                                                      node_id="node-0")]), metadata=METADATA))
        assert code == grpc.StatusCode.PERMISSION_DENIED
        call = stub.Exchange(metadata=METADATA)
        await call.write(ps_pb2.ExchangeRequest(hello=ps_pb2.Hello(node_id="node-0", layout_hash=layout_hash(layout),
                                                                   session_id="0" * 32)))
        code, _ = await status_of(call)
        assert code == grpc.StatusCode.FAILED_PRECONDITION
    # the member's stream was not replaced and its session goes on
    assert server.service.session is session and session.streams[("node-0", 0)] is not None
    result = await asyncio.wait_for(a.exchange(0, 0, encode(torch.ones(4096), Codec.FP32).to_bytes()), 10)
    assert len(result) > 0
    await a.close()


async def test_an_open_shard_tells_strangers_no_job_id_or_tensor_names(start_shard):
    """Without authentication anyone may call: refusals must not describe the job's model."""
    server = await start_shard(token_file=None)
    secret = ps_pb2.Layout()
    secret.CopyFrom(build_layout([TensorInfo("secret_model.encoder.weight", (123, 77))], 1, Compression(bits=None)))
    a = await member(server, secret, nodes=2, job_id="job-secret-42", security=ChannelSecurity())
    probe = layout_of((64, 64))
    with pytest.raises(ShardRejectedError) as info:  # same job id guessed, other model
        await member(server, probe, node="node-1", nodes=2, job_id="job-secret-42", security=ChannelSecurity())
    assert "secret_model" not in str(info.value) and "123" not in str(info.value) and "withheld" in str(info.value)
    with pytest.raises(ShardUnavailableError) as info:  # another job while the shard is busy
        await member(server, probe, node="x", nodes=1, job_id="other", security=ChannelSecurity(),
                     connect_timeout_s=1)
    assert "job-secret-42" not in str(info.value) and "busy with another job" in str(info.value)
    await a.close()


# ---- TLS and mutual TLS ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, a shard certificate for 127.0.0.1, a client certificate, and a stranger CA."""
    d = tmp_path_factory.mktemp("pki")
    ca, other = trustme.CA(), trustme.CA()
    shard, client = ca.issue_cert("127.0.0.1", "localhost"), ca.issue_cert("worker.cgx-ps.test")
    rogue = other.issue_cert("worker.cgx-ps.test")
    files = {}
    for name, blob in [("ca", ca.cert_pem), ("other_ca", other.cert_pem), ("shard_key", shard.private_key_pem),
                       ("client_key", client.private_key_pem), ("rogue_key", rogue.private_key_pem)]:
        blob.write_to_path(str(d / f"{name}.pem"))
        files[name] = str(d / f"{name}.pem")
    for name, cert in [("shard", shard), ("client", client), ("rogue", rogue)]:
        path = d / f"{name}.pem"
        path.write_bytes(b"".join(b.bytes() for b in cert.cert_chain_pems))
        files[name] = str(path)
    files["other"] = other
    return files


def tls_args(pki, mutual: bool) -> list[str]:
    args = ["--tls-cert", pki["shard"], "--tls-key", pki["shard_key"]]
    return args + (["--tls-client-ca", pki["ca"]] if mutual else [])


async def test_tls_refuses_plaintext_and_certless_clients(start_shard, pki):
    server = await start_shard(tls_cert=pki["shard"], tls_key=pki["shard_key"], tls_client_ca=pki["ca"])
    layout = layout_of((64, 64))
    with pytest.raises((ShardRejectedError, ShardUnavailableError)):  # plaintext: no handshake
        await member(server, layout, connect_timeout_s=2)
    with pytest.raises((ShardRejectedError, ShardUnavailableError)):  # TLS, but no client certificate
        await member(server, layout, security=ChannelSecurity(token_file=TOKEN_FILE, tls_ca=pki["ca"]),
                     connect_timeout_s=2)
    with pytest.raises((ShardRejectedError, ShardUnavailableError)):  # a certificate from another CA
        await member(server, layout, security=ChannelSecurity(token_file=TOKEN_FILE, tls_ca=pki["ca"],
                                                              tls_cert=pki["rogue"], tls_key=pki["rogue_key"]),
                     connect_timeout_s=2)
    assert server.service.session is None
    good = await member(server, layout, security=ChannelSecurity(token_file=TOKEN_FILE, tls_ca=pki["ca"],
                                                                 tls_cert=pki["client"], tls_key=pki["client_key"]))
    assert server.service.session is not None
    await good.close()


async def test_a_worker_trusting_another_ca_fails_fast_naming_the_handshake(start_shard, pki):
    server = await start_shard(tls_cert=pki["shard"], tls_key=pki["shard_key"])
    t0 = time.monotonic()
    with pytest.raises(ShardRejectedError, match="TLS handshake failed"):
        await member(server, layout_of((64, 64)), security=ChannelSecurity(token_file=TOKEN_FILE,
                                                                           tls_ca=pki["other_ca"]),
                     connect_timeout_s=60)
    assert time.monotonic() - t0 < 10


# Each TLS mistake a worker can make, and the words its error must carry. gRPC reports the first
# three alike as "Socket closed" (a shard going away mid-connect says the same): the worker probes.
TLS_MISTAKES = {
    "plaintext to a TLS shard": (dict(), "serves TLS and this worker connects in plaintext.*CGX_PS_TLS_CA"),
    "no client certificate": (dict(tls_ca="ca"), "requires mutual TLS.*sends no client certificate.*CGX_PS_TLS_CERT"),
    "a client certificate from another CA": (dict(tls_ca="ca", tls_cert="rogue", tls_key="rogue_key"),
                                             "refused this worker's client certificate CGX_PS_TLS_CERT=.*rogue.pem"),
    "a wrong server name": (dict(tls_ca="ca", tls_cert="client", tls_key="client_key", server_name="wrong.name"),
                            "certificate does not name the host.*CGX_PS_TLS_SERVER_NAME"),
    "a key not matching its certificate": (dict(tls_ca="ca", tls_cert="client", tls_key="rogue_key"),
                                           "CGX_PS_TLS_KEY is the key of CGX_PS_TLS_CERT"),
}


@pytest.mark.parametrize("mistake", TLS_MISTAKES)
async def test_each_tls_mistake_of_a_worker_fails_at_once_naming_its_cause(start_shard, pki, mistake):
    """Before: all but a wrong CA waited out the connect timeout, then said "unreachable ... check
    that the shard is running"."""
    server = await start_shard(tls_cert=pki["shard"], tls_key=pki["shard_key"], tls_client_ca=pki["ca"])
    settings, cause = TLS_MISTAKES[mistake]
    files = {k: (pki[v] if k != "server_name" else v) for k, v in settings.items()}
    t0 = time.monotonic()
    with pytest.raises(ShardRejectedError, match=cause):
        await member(server, layout_of((64, 64)), security=ChannelSecurity(token_file=TOKEN_FILE, **files),
                     connect_timeout_s=60)
    assert time.monotonic() - t0 < 30  # the probe's own limit is 2 x 3 s; the timeout was 60 s
    assert server.service.session is None


async def test_a_port_closing_connections_without_tls_is_still_retried():
    """The probe must not turn a plain "Socket closed" into a TLS verdict: a plaintext worker
    against a plaintext port that closes every connection it reads from (gRPC: "Socket closed",
    as for a TLS mismatch) keeps retrying to its timeout."""
    async def close_after_first_byte(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1)
        writer.close()

    listener = await asyncio.start_server(close_after_first_byte, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    client = ShardClient(f"127.0.0.1:{port}", "node-0", 1, layout_of((64, 64)), connect_timeout_s=2,
                         security=SECURITY)
    with pytest.raises(ShardUnavailableError, match="unreachable for 2s.*Socket closed"):
        await client.connect()
    listener.close()


def test_a_client_key_not_matching_its_certificate_fails_at_init(pki):
    env = {"CGX_PS_SERVERS": "a:1", "CGX_PS_TLS_CA": pki["ca"], "CGX_PS_TLS_CERT": pki["client"],
           "CGX_PS_TLS_KEY": pki["rogue_key"]}
    with pytest.raises(ConfigError, match="CGX_PS_TLS_KEY .*rogue_key.pem.* is not the key of CGX_PS_TLS_CERT"):
        WorkerConfig.from_env(env)
    WorkerConfig.from_env({**env, "CGX_PS_TLS_KEY": pki["client_key"]})


def test_missing_tls_files_are_named(tmp_path):
    missing = str(tmp_path / "nope.pem")
    with pytest.raises(ConfigError, match="CGX_PS_TLS_CA.*nope.pem"):
        WorkerConfig.from_env({"CGX_PS_SERVERS": "a:1", "CGX_PS_TLS_CA": missing})
    with pytest.raises(ConfigError, match="needs both CGX_PS_TLS_CERT and CGX_PS_TLS_KEY"):
        WorkerConfig.from_env({"CGX_PS_SERVERS": "a:1", "CGX_PS_TLS_CA": missing, "CGX_PS_TLS_CERT": missing})
    with pytest.raises(CredentialError, match="--tls-cert.*nope.pem"):
        ShardServer(ServerConfig(port=0, tls_cert=missing, tls_key=missing))


async def test_certificates_rotate_without_a_restart(start_shard, pki, tmp_path):
    cert, key = tmp_path / "shard.pem", tmp_path / "shard.key"
    cert.write_bytes(Path(pki["shard"]).read_bytes())
    key.write_bytes(Path(pki["shard_key"]).read_bytes())
    server = await start_shard(tls_cert=str(cert), tls_key=str(key))
    layout = layout_of((64, 64))
    old_ca = ChannelSecurity(token_file=TOKEN_FILE, tls_ca=pki["ca"])
    new_ca_file = tmp_path / "new_ca.pem"
    new_ca = trustme.CA()
    new_ca.cert_pem.write_to_path(str(new_ca_file))
    rotated = new_ca.issue_cert("127.0.0.1")
    a = await member(server, layout, security=old_ca, nodes=2)
    # cert-manager renews the Secret: the files change under the running shard
    cert.write_bytes(b"".join(b.bytes() for b in rotated.cert_chain_pems))
    key.write_bytes(rotated.private_key_pem.bytes())
    os.utime(cert, (time.time() + 5, time.time() + 5))  # a new mtime even within one clock tick
    b = await member(server, layout, node="node-1", nodes=2,
                     security=ChannelSecurity(token_file=TOKEN_FILE, tls_ca=str(new_ca_file)))
    assert server.tls.reloads == 1
    with pytest.raises(ShardRejectedError, match="TLS handshake failed"):  # the old certificate is gone
        await member(server, layout, node="node-2", nodes=2, security=old_ca)
    # the connection opened before the rotation keeps working
    p = encode(torch.ones(4096), Codec.FP32).to_bytes()
    ra, rb = await asyncio.wait_for(asyncio.gather(a.exchange(0, 0, p), b.exchange(0, 0, p)), 10)
    assert ra == rb
    server.tls.request_reload()  # SIGHUP: re-read even if the files look unchanged
    await member(server, layout, node="node-1", nodes=2,
                 security=ChannelSecurity(token_file=TOKEN_FILE, tls_ca=str(new_ca_file)))
    assert server.tls.reloads == 2
    await a.close()
    await b.close()


@pytest.mark.slow
def test_workers_train_bit_identically_over_mutual_tls(pki, tmp_path, local_cluster):
    cluster = local_cluster(2, round_timeout=20, extra_args=tls_args(pki, mutual=True))
    job = f"tls-{uuid.uuid4().hex[:6]}"
    procs = []
    for rank in range(2):
        env = dict(os.environ, **cluster.worker_env(), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0",
                   LOCAL_WORLD_SIZE="1", CGX_PS_NODE_RANK=str(rank), CGX_PS_NUM_NODES="2", CGX_PS_JOB_ID=job,
                   OMP_NUM_THREADS="1", CGX_PS_TLS_CA=pki["ca"], CGX_PS_TLS_CERT=pki["client"],
                   CGX_PS_TLS_KEY=pki["client_key"])
        procs.append(start_worker([sys.executable, str(ROOT / "tests/workers/step_worker.py"), "--steps", "3",
                                   "--out", str(tmp_path / f"{rank}.pt")], env=env, stderr=subprocess.PIPE,
                                  text=True))
    errors = [p.communicate(timeout=180)[1] for p in procs]
    assert all(p.returncode == 0 for p in procs), errors
    a, b = (torch.load(tmp_path / f"{r}.pt", weights_only=False) for r in range(2))
    assert all(torch.equal(a["final"][n], b["final"][n]) for n in a["final"])
    assert any(not torch.equal(a["final"][n], a["initial"][n]) for n in a["final"])  # it trained


# ---- bounded memory whatever the input -------------------------------------------------------------


def test_blob_keys_count_against_the_capacity():
    store = BlobStore(capacity=1000)
    store.put("k" * 200, b"", ("node-0", 0))
    assert store.used == 200
    with pytest.raises(BlobError, match="keys must be 1..256 bytes"):
        store.put("k" * 257, b"", ("node-0", 0))
    for i in range(3):
        store.put(f"{i:0>200}", b"", ("node-0", 0))
    with pytest.raises(BlobError, match="exceeds the shard's blob capacity"):
        store.put("z" * 200, b"x", ("node-0", 0))
    assert store.used <= store.capacity


def test_uploads_and_stored_blobs_share_one_capacity():
    """Before: the store and the uploads each had the in-flight cap, and a blob was joined from
    its chunks (2x): a member could hold ~3x the cap. Now the total never exceeds the capacity."""
    store = BlobStore(capacity=1000)
    store.put("stored", b"x" * 400, ("node-0", 0))
    held = store.reserve("uploading", 500)  # an upload still arriving
    with pytest.raises(BlobError, match="exceeds the shard's blob capacity"):
        store.reserve("another", 100)  # 406 + 509 + 107 > 1000
    store.clear()  # a new session: stored blobs go, the upload's reservation stays until it ends
    assert store.used == held
    store.put("uploading", b"y" * 500, ("node-0", 0), reserved=held)
    assert store.used == held  # the reservation became the stored blob, not counted twice
    assert store.used <= store.capacity


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


@pytest.mark.slow
def test_huge_keys_and_blocks_leave_the_shard_within_its_caps(local_cluster):
    """Before: 30 empty blobs with 4 MiB keys grew a 2 MiB-capped shard by 144 MiB, and a block
    larger than the cap was admitted."""
    cluster = local_cluster(1, log_level="ERROR", extra_args=["--max-inflight-mb", "2"])
    pid, address = cluster.procs[0].pid, cluster.addresses[0]

    async def attack() -> list[grpc.StatusCode]:
        codes = []
        (client,) = [await member_at(address, layout_of((64, 64)))]
        async with grpc.aio.insecure_channel(address, options=[("grpc.max_send_message_length", 8 << 20)]) as ch:
            stub = ps_pb2_grpc.ParameterServerStub(ch)
            for i in range(30):
                key = f"{i}" + "k" * (4 << 20)
                code, _ = await status_of(stub.PutBlob(iter([ps_pb2.BlobChunk(
                    key=key, total_bytes=0, node_id="node-0", session_id=client.session_id)]),
                    metadata=METADATA, timeout=10))
                codes.append(code)
        big = build_layout([TensorInfo("w", (1024, 1024))], 1, Compression(bits=None), block_bytes=8 << 20)
        try:
            await member_at(address, big, node="node-1", nodes=1, job_id="other-job-after-idle")
            codes.append(grpc.StatusCode.OK)
        except ShardRejectedError as exc:
            codes.append(grpc.StatusCode[exc.code])
            assert "exceeds this shard's in-flight budget" in str(exc)
        await client.close()
        return codes

    # a shard serves at once and loads its kernels in the background (kernels/warm.py): the
    # baseline is taken once its memory has settled, so that load is not counted as the attack's
    before, deadline = _rss_kib(pid), time.monotonic() + 30
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = _rss_kib(pid)
        if abs(now - before) < 2048:
            break
        before = now
    codes = asyncio.run(attack())
    growth_mib = (_rss_kib(pid) - before) / 1024
    assert codes[:30] == [grpc.StatusCode.INVALID_ARGUMENT] * 30, codes
    assert codes[30] == grpc.StatusCode.INVALID_ARGUMENT, codes
    # receive buffers, not 30 x 4 MiB kept; and the freed ones the shard's allocator keeps for the next
    # round, by design up to its trim threshold (server/process/allocator.py: 41-49 MiB measured with it, 120+ if kept)
    allowance_mib = 40 + (TRIM_THRESHOLD >> 20)
    assert growth_mib < allowance_mib, f"shard RSS grew by {growth_mib:.0f} MiB"


async def member_at(address: str, layout, node: str = "node-0", nodes: int = 1, **kw) -> ShardClient:
    client = ShardClient(address, node, nodes, layout, connect_timeout_s=10, security=SECURITY, **kw)
    await client.connect()
    return client


async def test_a_layout_needing_more_state_than_allowed_is_refused(start_shard):
    server = await start_shard(max_model_bytes=1 << 20)
    with pytest.raises(ShardRejectedError, match="more than its --max-model-mb"):
        await member(server, layout_of((1024, 512)))


@pytest.mark.parametrize("timeout", [math.nan, math.inf, -1.0, 1e9])
async def test_getblob_timeouts_must_be_finite_and_bounded(start_shard, timeout):
    server = await start_shard()
    a = await member(server, layout_of((64, 64)))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        code, details = await status_of(ps_pb2_grpc.ParameterServerStub(channel).GetBlob(
            ps_pb2.GetBlobRequest(key="k", timeout_s=timeout, session_id=a.session_id), metadata=METADATA))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "timeout_s must be finite" in details
    await a.close()


async def test_the_codec_schedule_is_bounded(start_shard):
    layout = build_layout([TensorInfo("w", (64, 64))], 1, Compression(bits=4, bucket_size=512))
    server = await start_shard()
    a = await member(server, layout)
    block = server.service.session.aggregator.blocks[0]
    two = ps_pb2.CodecSettings(codec=ps_pb2.CODEC_MAXMIN, bits=2, bucket_size=512)
    for r in range(1, 9):
        await a.set_codecs(r, [ps_pb2.BlockCodec(block_id=0, codec=two)])
    with pytest.raises(ShardRejectedError, match="RESOURCE_EXHAUSTED.*already scheduled"):
        await a.set_codecs(20, [ps_pb2.BlockCodec(block_id=0, codec=two)])
    # as rounds pass, entries for rounds gone by are dropped: one change per round stays small
    x = torch.randn(4096)
    for r in range(12):
        await a.set_codecs(r + 1, [ps_pb2.BlockCodec(block_id=0, codec=two)])
        payload = encode(x, Codec.FP32).to_bytes()  # uncompressed is always allowed
        await asyncio.wait_for(a.exchange(0, r, payload), 10)
    assert len(block.schedule) <= 3, block.schedule
    await a.close()


async def test_streams_that_say_nothing_are_cut_off(start_shard, monkeypatch):
    from cgx_ps.server.rpc import service
    monkeypatch.setattr(service, "FIRST_MESSAGE_TIMEOUT_S", 0.5)
    server = await start_shard()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        never = asyncio.Event()

        async def silent():
            await never.wait()
            yield b""  # pragma: no cover

        t0 = time.monotonic()
        code, details = await status_of(channel.stream_stream(SERVICE + "Exchange")(silent(), metadata=METADATA))
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED and "no first message" in details
        code, _ = await status_of(channel.stream_unary(SERVICE + "PutBlob")(silent(), metadata=METADATA))
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - t0 < 5


async def test_a_draining_shard_takes_no_new_calls(start_shard):
    server = await start_shard()
    server.service.draining = True
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        statuses = await raw_calls(channel, b"", METADATA)
    del statuses["Exchange"]  # streams finish the rounds in flight
    assert statuses.pop("Status")[0] == grpc.StatusCode.OK  # `cgx-ps status` can see the shard drain
    assert {code for code, _ in statuses.values()} == {grpc.StatusCode.UNAVAILABLE}, statuses


# ---- malformed messages: a clear status and one rate-limited line, never a traceback ---------------


async def test_malformed_messages_get_invalid_argument_and_at_most_one_line_each(start_shard, caplog):
    server = await start_shard()
    caplog.set_level("INFO")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        for _ in range(3):
            statuses = await raw_calls(channel, b"\xff\xff\xff\xff\x0f garbage", METADATA)
            assert {code for code, _ in statuses.values()} == {grpc.StatusCode.INVALID_ARGUMENT}, statuses
            assert all("malformed" in details for _, details in statuses.values()), statuses
        for _ in range(40):  # a flood on one method: rate-limited
            await status_of(channel.unary_unary(SERVICE + "Register")(b"\xff\xff", metadata=METADATA))
    lines = [r for r in caplog.records if r.name.startswith("cgx_ps") or r.name.startswith("grpc")]
    assert not any(r.exc_info or "Traceback" in r.getMessage() for r in lines)
    assert len(lines) <= 6 * 3 + 10, [r.getMessage() for r in lines]
    assert all("\n" not in r.getMessage() for r in lines)


# ---- secure defaults ----------------------------------------------------------------------------------


def test_a_shard_open_beyond_loopback_without_token_or_tls_warns():
    assert exposure_warning(ServerConfig(host="127.0.0.1")) is None
    assert exposure_warning(ServerConfig(host="0.0.0.0", token_file="t")) is None
    assert exposure_warning(ServerConfig(host="::1")) is None
    assert "neither --token-file nor --tls-cert" in exposure_warning(ServerConfig(host="0.0.0.0"))
    assert exposure_warning(ServerConfig(host="shard-0.example")) is not None


def test_a_shard_beyond_loopback_without_token_or_tls_is_refused_unless_insecure():
    assert exposure_problem(ServerConfig(host="127.0.0.1")) is None
    assert exposure_problem(ServerConfig(host="::1")) is None
    assert exposure_problem(ServerConfig(host="0.0.0.0", token_file="t")) is None
    assert exposure_problem(ServerConfig(host="0.0.0.0", tls_cert="c", tls_key="k")) is None
    assert exposure_problem(ServerConfig(host="0.0.0.0", insecure=True)) is None
    for host in ("0.0.0.0", "::", "10.1.2.3", "shard-0.example"):
        problem = exposure_problem(ServerConfig(host=host))
        assert problem and "--token-file" in problem and "--insecure" in problem and host in problem


def _start(args: list[str], env: dict[str, str], tmp_path: Path) -> subprocess.Popen:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("CGX_PS_")}, **env}
    return subprocess.Popen([sys.executable, "-m", "cgx_ps.cli", "server", "--port", "0", "--metrics-port", "-1",
                             "--port-file", str(tmp_path / "port.json"), *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
def test_an_operator_command_line_open_to_the_network_is_refused_then_allowed_by_insecure(tmp_path):
    """`cgx-ps server --host 0.0.0.0` with no token and no TLS: one line naming the flags, exit 2,
    nothing bound. With --insecure (or CGX_PS_INSECURE=1) it serves, and says so in a warning;
    on loopback it serves without either."""
    refused = _start(["--host", "0.0.0.0"], {}, tmp_path)
    out = refused.communicate(timeout=60)[0]
    assert refused.returncode == 2, out
    assert out.count("\n") == 1 and "refusing to serve 0.0.0.0" in out and "--insecure" in out, out
    assert not (tmp_path / "port.json").exists()
    for args, env in ((["--host", "0.0.0.0", "--insecure"], {}), (["--host", "0.0.0.0"], {"CGX_PS_INSECURE": "1"}),
                      (["--host", "127.0.0.1"], {})):
        proc = _start(args, env, tmp_path)
        try:
            lines = []
            for line in proc.stdout:
                lines.append(line)
                if "serving on" in line:
                    break
            said = "".join(lines)
            assert "serving on" in said, said
            exposed = "neither --token-file nor --tls-cert: anyone who can reach" in said
            assert exposed == (args[1] == "0.0.0.0"), said
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.communicate(timeout=60)


def test_the_metrics_expose_no_token_nor_its_hash(tmp_path):
    """A shard with a token: nothing its metrics page serves names the token, in any common form."""
    import base64
    import hashlib
    import urllib.request

    token = "s3cret-" + uuid.uuid4().hex
    (tmp_path / "token").write_text(token + "\n")
    proc = _start(["--host", "127.0.0.1", "--token-file", str(tmp_path / "token"), "--metrics-port", "0"], {},
                  tmp_path)
    try:
        port_file, deadline = tmp_path / "port.json", time.monotonic() + 60
        while not port_file.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)  # written once the shard serves, after its start line
        info = json.loads(port_file.read_text())
        page = urllib.request.urlopen(f"http://127.0.0.1:{info['metrics_port']}/metrics", timeout=10).read().decode()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    assert "cgx_ps_" in page  # the shard's own metrics are there
    raw = token.encode()
    forms = [token, base64.b64encode(raw).decode(), raw.hex(), hashlib.sha256(raw).hexdigest(),
             base64.b64encode(hashlib.sha256(raw).digest()).decode(), hashlib.md5(raw).hexdigest(),
             hashlib.sha1(raw).hexdigest(), token[7:15]]
    for form in forms:
        assert form not in page, form


async def test_metrics_listen_where_the_grpc_port_does(start_shard):
    server = await start_shard(metrics_port=0)
    assert server._metrics_httpd.server_address[0] == "127.0.0.1"


@pytest.mark.slow
def test_cgx_ps_cluster_makes_a_private_token(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "CGX_PS_TOKEN_FILE"}
    proc = subprocess.Popen([sys.executable, "-m", "cgx_ps.cli", "cluster", "--shards", "1", "--base-port", "0",
                             "--log-level", "WARNING"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        line = proc.stdout.readline()
        exports = dict(kv.split("=", 1) for kv in line.split("export ", 1)[1].split())
        token_file = exports["CGX_PS_TOKEN_FILE"]
        assert token_file != TOKEN_FILE and os.stat(token_file).st_mode & 0o777 == 0o600
        layout = layout_of((64, 64))
        address = exports["CGX_PS_SERVERS"]

        async def clients() -> None:
            with pytest.raises(ShardRejectedError, match="UNAUTHENTICATED"):
                await ShardClient(address, "node-0", 1, layout, connect_timeout_s=5).connect()
            ok = ShardClient(address, "node-0", 1, layout, connect_timeout_s=5,
                             security=ChannelSecurity(token_file=token_file))
            await ok.connect()
            await ok.close()

        asyncio.run(clients())
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    assert not os.path.exists(token_file)  # it goes with the cluster


class _ScriptedResults:
    """A shard's result stream reduced to what an ExchangeStream reads from it: these chunks, then its end."""

    plane = "scripted"

    def __init__(self, chunks: list) -> None:
        self.chunks = chunks
        self.cancelled = False

    async def write(self, frame: bytes) -> None:
        pass  # the Hello: this shard reads nothing

    def __aiter__(self):
        return self._chunks()

    async def _chunks(self):
        for chunk in self.chunks:
            yield chunk

    def cancel(self) -> None:
        self.cancelled = True


def _chunk(round_: int, total: int, offset: int, data: bytes, block: int = 0):
    from cgx_ps.net.chunk_frames import ChunkFrame
    return ChunkFrame(round_, block, total, offset, data)


_LIMIT = max_encoded_size(64 * 64)


@pytest.mark.parametrize("chunks, problem", [
    ([_chunk(1, 8, 0, b"abcd"), _chunk(1, 8, 4, b"efgh")], None),  # the shape every shard sends
    ([_chunk(1, _LIMIT + 1, 0, b"x")], "more than any encoding of the block"),
    ([_chunk(1, 8, 0, b"ab"), _chunk(1, 8, 4, b"cd")], "at offset 4, where 2 bytes had come"),
    ([_chunk(1, 8, 0, b"ab")] * 3, "at offset 0, where 2 bytes had come"),  # the same chunk, again and again
    ([_chunk(1, 8, 0, b"ab"), _chunk(1, 9, 2, b"cd")], "size changed from 8 to 9"),
    ([_chunk(1, 8, 0, b"")], "an empty chunk"),
    ([_chunk(1, 4, 0, b"abcdef")], "past the result's 4 bytes"),
])
async def test_a_shards_results_cannot_make_a_worker_hold_more_than_its_block(chunks, problem) -> None:
    """A broken or hostile shard (a man in the middle without TLS, a shard of another version)
    decides the chunks a worker reassembles: each must continue the result under way, within the
    block's largest encoding, or the connection fails with a clear error. Before, the worker kept
    every chunk of any (block, round) for as long as the stream lasted: unbounded memory."""
    from cgx_ps.worker.errors import CgxPsError

    layout = build_layout([TensorInfo("w", (64, 64))], 1, Compression(bits=4, bucket_size=512))
    client = ExchangeStream("127.0.0.1:1", layout, keep_results=False)
    result = client.expect(0, 1)
    stream = _ScriptedResults(chunks)
    await client.attach(stream, b"hello")
    if problem is None:
        assert bytes(await asyncio.wait_for(result, 5)) == b"abcdefgh"
        return
    with pytest.raises(CgxPsError, match=f"sent a malformed result: block 0 round 1: .*{problem}"):
        await asyncio.wait_for(result, 5)  # not left waiting for a repair that would take the same junk
    assert stream.cancelled and not client._incoming


async def test_results_nobody_waits_for_are_not_kept() -> None:
    """A result for a (block, round) this worker neither pushed nor expects (a shard's second
    copy after a repair, or junk) is dropped at once, not buffered until the stream ends."""
    layout = build_layout([TensorInfo("w", (64, 64))], 1, Compression(bits=4, bucket_size=512))
    client = ExchangeStream("127.0.0.1:1", layout, keep_results=False)
    result = client.expect(0, 1)
    kept = []

    class Watching(_ScriptedResults):
        async def _chunks(self):
            for chunk in self.chunks:
                yield chunk
                kept.append(dict(client._incoming))

    stream = Watching([_chunk(round_, 8, 0, b"ab") for round_ in range(2, 50)] + [_chunk(1, 2, 0, b"ok")])
    await client.attach(stream, b"hello")
    assert bytes(await asyncio.wait_for(result, 5)) == b"ok" and all(not incoming for incoming in kept)


@pytest.mark.parametrize("verbosity, handshake_lines", [(None, 0), ("INFO", 1)])
def test_grpc_core_does_not_log_a_line_per_failed_handshake_unless_asked(pki, tmp_path, verbosity, handshake_lines):
    """A real `cgx-ps server` with TLS, called in plaintext (as a misconfigured worker or any
    stranger can): gRPC's core wrote one glog-format INFO line per handshake into the shard's
    structured log. The shard now starts gRPC at GRPC_VERBOSITY=ERROR; an operator's own wins."""
    from cgx_ps.server.cluster import launch_shard, wait_for_port_file

    env = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
    if verbosity:
        env["GRPC_VERBOSITY"] = verbosity
    port_file = tmp_path / "ports.json"
    proc = launch_shard(["--host", "127.0.0.1", "--port", "0", "--metrics-port", "-1", "--kernel-threads", "1",
                         *tls_args(pki, mutual=False)], port_file, env=env, stderr=subprocess.PIPE, text=True)
    try:
        port = wait_for_port_file(proc, port_file, time.monotonic() + 120)["port"]
        for _ in range(3):
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                with pytest.raises(grpc.RpcError):
                    health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "msg='stopped'" in err, err  # the shard's own log is there
    lines = [line for line in err.splitlines() if "Handshake failed" in line]
    assert (len(lines) >= 1) == bool(handshake_lines), err


def test_a_key_that_is_not_the_certificates_is_named_before_binding(pki, tmp_path):
    """A mismatched key once read "cannot bind ...: the port is in use". Now the
    real command says which file is wrong, in one line, exit status 2."""
    with pytest.raises(CredentialError, match="--tls-key.* is not the private key of the certificate in --tls-cert"):
        ShardServer(ServerConfig(port=0, tls_cert=pki["shard"], tls_key=pki["client_key"]))
    env = {k: v for k, v in os.environ.items() if not k.startswith("CGX_PS_")}
    res = subprocess.run([sys.executable, "-m", "cgx_ps.cli", "server", "--host", "127.0.0.1", "--port", "0",
                          "--metrics-port", "-1", "--kernel-threads", "1", "--tls-cert", pki["shard"],
                          "--tls-key", pki["client_key"]], capture_output=True, text=True, timeout=300, env=env,
                         cwd=Path(__file__).resolve().parents[1])
    assert res.returncode == 2, res.stderr
    assert "is not the private key of the certificate in --tls-cert" in res.stderr, res.stderr
    assert "cannot bind" not in res.stderr and "Traceback" not in res.stderr, res.stderr
